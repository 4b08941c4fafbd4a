//! The plugin started and run: its sockets served until stop, the prepared claims'
//! leases renewed, their health followed.

use std::sync::Arc;

use tokio::sync::watch;
use tracing::info;

use crate::config::KubernetesConfig;
use crate::lease::LeaseManager;
use crate::store::Store;

use super::claims::ClaimSource;
use super::plugin::DraPlugin;
use super::registration::Sockets;
use super::{DRIVER_NAME, DraError};

/// Start the DRA kubelet plugin: serve `dra.sock` and the registration socket until
/// `stop`, renew the prepared claims' leases, follow health. The returned task ends
/// after `stop`. Fails (serving nothing) when no node name is known.
pub async fn start(
    mgr: Arc<LeaseManager>,
    store: Arc<Store>,
    cfg: KubernetesConfig,
    claims: Arc<dyn ClaimSource>,
    stop: watch::Receiver<bool>,
) -> Result<(Arc<DraPlugin>, tokio::task::JoinHandle<()>), DraError> {
    let pool = cfg.dra_node_name().ok_or_else(|| {
        DraError::Config(
            "no node name: set [kubernetes] node_name or the NODE_NAME environment variable (the DaemonSet sets it from spec.nodeName)".into(),
        )
    })?;
    // The store keeps the claims' lease tokens: only tesserad's user may read it.
    private_dir(&mgr.config().daemon.state_dir)?;
    let plugin = DraPlugin::new(mgr, store, cfg, claims, pool)?;
    let served = Sockets::bind(&plugin)?;
    info!(
        pool = %plugin.pool(),
        endpoint = %served.endpoint().display(),
        registration = %served.registration().display(),
        "dra: kubelet plugin {DRIVER_NAME} on"
    );
    let task = tokio::spawn(run(plugin.clone(), served, stop));
    Ok((plugin, task))
}

/// How often prepared claims are looked up on the API server for ones kubelet never
/// unprepared ([`DraPlugin::sweep_orphans`]).
pub const ORPHAN_SWEEP: std::time::Duration = std::time::Duration::from_secs(60);
/// How long such a claim must have been gone before its leases are released.
pub const ORPHAN_GRACE: std::time::Duration = std::time::Duration::from_secs(300);

/// Serve until `stop`: the sockets (made again when removed), renewals, health and
/// the orphan sweep.
async fn run(plugin: Arc<DraPlugin>, mut served: Sockets, mut stop: watch::Receiver<bool>) {
    let mut events = plugin.mgr_subscribe();
    let interval = plugin.config().poll_interval;
    let mut next = tokio::time::Instant::now() + interval;
    let mut next_sweep = tokio::time::Instant::now() + ORPHAN_SWEEP;
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            ev = events.recv() => {
                if matches!(ev, Err(tokio::sync::broadcast::error::RecvError::Closed)) {
                    break;
                }
                plugin.refresh_health();
                continue;
            }
            _ = stop.changed() => break,
        }
        plugin.renew().await;
        plugin.refresh_health();
        served.keep(&plugin);
        if tokio::time::Instant::now() >= next_sweep {
            plugin.sweep_orphans(ORPHAN_GRACE).await;
            next_sweep = tokio::time::Instant::now() + ORPHAN_SWEEP;
        }
        next = tokio::time::Instant::now() + interval;
    }
    served.shutdown().await;
}

/// `dir` readable by its owner only (0700): tightened when group or others may enter.
fn private_dir(dir: &std::path::Path) -> Result<(), DraError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |source| DraError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mode = std::fs::metadata(dir).map_err(io)?.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        tracing::warn!(dir = %dir.display(), was = format!("{:o}", mode & 0o777), "dra: the state directory holds the prepared claims' lease tokens: made 0700");
    }
    Ok(())
}
