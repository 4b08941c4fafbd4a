//! The per-lease CDI specs (kind `tessera.io/lease`): `podman run --device
//! tessera.io/lease=<id>` or containerd with CDI on gets exactly the lease's device
//! nodes, mounts and env, and the driver's files from the NVIDIA Container Toolkit's
//! spec when the host has one. Written atomically (a temporary file in the same
//! directory, renamed) after the CDI rules are checked; removed when the lease ends.
//!
//! Two writers use these functions: the kubelet device plugin for its devices'
//! leases (`[kubernetes] cdi`), and [`run`] for every active lease (`[cdi]`). Both
//! write the same spec for a lease, under the same name.
//!
//! A spec only names device nodes: it grants nothing. tessera-runtime accepts the
//! nodes a spec injected when they are exactly the lease of the container's token,
//! and refuses them otherwise; a container started without tessera-runtime gets them
//! without its hardening (on the host that takes root; in Kubernetes the admission
//! policy refuses pods asking for `tessera.io` devices without the tessera runtime
//! class).
//!
//! Owns: the CDI spec files. May use: config, lease, model.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use tessera_common::cdi::{
    CDI_VERSION, CdiError, ContainerEdits, Device, DeviceNode, Mount, NvidiaCdi, Spec,
    nvidia_spec_paths, validate,
};
use tokio::sync::broadcast::error::RecvError;
use tracing::{debug, info, warn};

use crate::config::CdiConfig;
use crate::lease::devices::Resolved;
use crate::lease::{EventKind, LeaseManager};
use crate::model::LeaseState;

/// The CDI kind of Tessera's per-lease devices: `tessera.io/lease=<lease id>`.
pub const CDI_KIND: &str = "tessera.io/lease";

/// The file name prefix of a lease's spec in the CDI directory.
const FILE_PREFIX: &str = "tessera.io-lease-";

fn spec_path(dir: &Path, lease_id: &str) -> PathBuf {
    dir.join(format!("{FILE_PREFIX}{lease_id}.json"))
}

/// The CDI spec of one lease: its device nodes, its mounts (MPS pipe directory) and
/// env, and the driver's files from the NVIDIA spec when there is one.
pub fn spec_for(r: &Resolved, nvidia: Option<&NvidiaCdi>) -> Spec {
    let device_nodes = r
        .grant
        .devices
        .iter()
        .map(|d| DeviceNode {
            path: d.container_path.clone(),
            host_path: Some(d.host_path.to_string_lossy().into_owned()),
            kind: Some(d.kind.to_string()),
            major: Some(d.major),
            minor: Some(d.minor),
            file_mode: Some(d.file_mode),
            permissions: Some(d.permissions.clone()),
        })
        .collect();
    let mut mounts: Vec<Mount> = r
        .grant
        .mounts
        .iter()
        .map(|m| Mount {
            host_path: m.source.clone(),
            container_path: m.destination.clone(),
            options: m.options.clone(),
            kind: Some("bind".into()),
        })
        .collect();
    if let Some(n) = nvidia {
        mounts.extend(n.mounts.iter().cloned());
    }
    Spec {
        cdi_version: CDI_VERSION.into(),
        kind: CDI_KIND.into(),
        devices: vec![Device {
            name: r.lease.id.clone(),
            container_edits: ContainerEdits {
                env: r
                    .grant
                    .env
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect(),
                device_nodes,
                mounts,
            },
        }],
        container_edits: ContainerEdits::default(),
    }
}

/// Write the lease's spec atomically in `dir` (created if absent).
pub fn write_spec(
    dir: &Path,
    r: &Resolved,
    nvidia: Option<&NvidiaCdi>,
) -> Result<PathBuf, CdiError> {
    let spec = spec_for(r, nvidia);
    validate(&spec)?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CdiError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = spec_path(dir, &r.lease.id);
    let body = serde_json::to_vec_pretty(&spec).map_err(|e| CdiError::Invalid(e.to_string()))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".tessera-cdi-")
        .tempfile_in(dir)
        .map_err(io(dir))?;
    std::io::Write::write_all(&mut tmp, &body).map_err(io(tmp.path()))?;
    tmp.as_file().sync_all().map_err(io(tmp.path()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o644))
            .map_err(io(tmp.path()))?;
    }
    tmp.persist(&path).map_err(|e| CdiError::Io {
        path: path.clone(),
        source: e.error,
    })?;
    Ok(path)
}

/// Remove a lease's spec (absent is fine).
pub fn remove_spec(dir: &Path, lease_id: &str) -> Result<(), CdiError> {
    let path = spec_path(dir, lease_id);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(CdiError::Io { path, source }),
    }
}

/// Keep a CDI spec for every active lease in `cfg.dir` until `stop`: written when a
/// lease becomes active or moves, removed when it ends. At start (and whenever the
/// event stream lagged) the directory is brought in line with the live leases: specs
/// of leases that are gone are removed, missing ones written.
pub async fn run(
    mgr: Arc<LeaseManager>,
    cfg: CdiConfig,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let nvidia = match NvidiaCdi::find(&nvidia_spec_paths()) {
        Ok(n) => n,
        Err(e) => {
            warn!(error = %e, "cdi: the NVIDIA Container Toolkit's spec is unreadable: lease specs carry no driver files");
            None
        }
    };
    // Subscribed before the first sync: no change falls between the two.
    let mut events = mgr.subscribe();
    let synced = sync(&mgr, &cfg.dir, nvidia.as_ref());
    info!(dir = %cfg.dir.display(), specs = synced, "cdi: a spec for every active lease (tessera.io/lease=<id>)");
    loop {
        tokio::select! {
            _ = stop.changed() => {
                if *stop.borrow() {
                    return;
                }
            }
            ev = events.recv() => match ev {
                Ok(ev) => match ev.kind {
                    EventKind::Created | EventKind::Moved | EventKind::Healthy => {
                        write_lease(&mgr, &cfg.dir, &ev.lease.id, nvidia.as_ref());
                    }
                    EventKind::Released
                    | EventKind::Revoked
                    | EventKind::Revoking
                    | EventKind::Preempting => {
                        if let Err(e) = remove_spec(&cfg.dir, &ev.lease.id) {
                            warn!(lease = %ev.lease.id, error = %e, "cdi: spec not removed");
                        }
                    }
                    _ => {}
                },
                Err(RecvError::Lagged(n)) => {
                    debug!(missed = n, "cdi: events missed, syncing the directory");
                    sync(&mgr, &cfg.dir, nvidia.as_ref());
                }
                Err(RecvError::Closed) => return,
            },
        }
    }
}

/// Write the spec of lease `id` if it is active (a lease that ended meanwhile has
/// its spec removed).
fn write_lease(mgr: &LeaseManager, dir: &Path, id: &str, nvidia: Option<&NvidiaCdi>) {
    match mgr.view_devices(id) {
        Ok(r) => {
            if let Err(e) = write_spec(dir, &r, nvidia) {
                warn!(lease = %id, error = %e, "cdi: spec not written");
            }
        }
        Err(e) => {
            debug!(lease = %id, error = %e, "cdi: no spec for a lease that is not active");
            if mgr.get(id).is_ok_and(|(l, _)| !l.state().is_live()) {
                let _ = remove_spec(dir, id);
            }
        }
    }
}

/// Bring `dir` in line with the live leases; returns how many specs it holds.
fn sync(mgr: &LeaseManager, dir: &Path, nvidia: Option<&NvidiaCdi>) -> usize {
    let active: BTreeSet<String> = match mgr.list(None, None, false) {
        Ok(list) => list
            .into_iter()
            .filter(|(l, _)| l.state() == LeaseState::Active)
            .map(|(l, _)| l.id)
            .collect(),
        Err(e) => {
            warn!(error = %e, "cdi: leases not listed; specs left as they are");
            return 0;
        }
    };
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // A temporary file of a write that never finished (a daemon killed in it).
            if name.starts_with(".tessera-cdi-") {
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            let Some(id) = name
                .strip_prefix(FILE_PREFIX)
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            if !active.contains(id)
                && let Err(e) = remove_spec(dir, id)
            {
                warn!(lease = %id, error = %e, "cdi: stale spec not removed");
            }
        }
    }
    for id in &active {
        write_lease(mgr, dir, id, nvidia);
    }
    active.len()
}
