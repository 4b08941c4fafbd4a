//! The per-lease CDI specs (kind `tessera.io/lease`): `podman run --device
//! tessera.io/lease=<id>` or containerd with CDI on gets exactly the lease's device
//! nodes, mounts and env, and the driver's files from the NVIDIA Container Toolkit's
//! spec when the host has one. Written atomically (a temporary file in the same
//! directory, renamed) after the CDI rules are checked; removed when the lease ends.

use std::path::{Path, PathBuf};

pub use tessera_common::cdi::{
    CDI_VERSION, CdiError, ContainerEdits, Device, DeviceNode, Mount, NvidiaCdi, Spec,
    nvidia_spec_paths, validate,
};

use crate::lease::devices::Resolved;

use super::CDI_KIND;

fn spec_path(dir: &Path, lease_id: &str) -> PathBuf {
    dir.join(format!("tessera.io-lease-{lease_id}.json"))
}

/// The CDI spec of one lease: its device nodes, its mounts (MPS pipe directory) and
/// env, and the driver's files from the NVIDIA spec when there is one.
pub fn spec_for(r: &Resolved, nvidia: Option<&NvidiaCdi>) -> Spec {
    let device_nodes = r
        .devices
        .iter()
        .map(|d| DeviceNode {
            path: d.container_path.clone(),
            host_path: Some(d.host_path.to_string_lossy().into_owned()),
            kind: Some("c".into()),
            major: Some(d.major),
            minor: Some(d.minor),
            file_mode: Some(d.file_mode),
            permissions: Some(d.permissions.clone()),
        })
        .collect();
    let mut mounts: Vec<Mount> = r
        .mounts
        .iter()
        .map(|m| Mount {
            host_path: m.source.to_string_lossy().into_owned(),
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
                env: r.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
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
