//! kubelet's side: one plugin socket per resource in the device-plugins directory,
//! registered with kubelet.sock (again whenever kubelet restarts: it deletes every
//! socket there and makes a new kubelet.sock), and the PodResources List.

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tessera_proto::k8s::deviceplugin::v1beta1 as dp;
use tessera_proto::k8s::podresources::v1 as pr;
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tracing::{info, warn};

use crate::api::transport::uds_authority::NormalizeAuthority;
use crate::config::{RESOURCE_DOMAIN, resource_name};

use super::service::PluginService;
use super::{DevicePlugin, Holder, K8sError};

/// How long a call to kubelet may take.
const KUBELET_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the directory is looked at for a new kubelet.sock or a lost socket.
const WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// A unix socket's identity: device, inode and change time. A file deleted and
/// created again between two looks may get the same inode number back (kubelet
/// restarting quickly), never the same change time to the nanosecond.
type SocketId = (u64, u64, i64, i64);

fn socket_id(path: &Path) -> Option<SocketId> {
    let m = std::fs::metadata(path).ok()?;
    m.file_type()
        .is_socket()
        .then(|| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// The socket file of a class, relative to the device-plugins directory.
pub(super) fn endpoint_name(class: &str) -> String {
    format!("tessera-{class}.sock")
}

struct Endpoint {
    socket: Option<SocketId>,
    registered_with: Option<SocketId>,
    stop: watch::Sender<bool>,
    /// The kubelet.sock a registration failure was last logged for.
    warned_for: Option<SocketId>,
}

fn bind(path: &Path) -> Result<tokio::net::UnixListener, K8sError> {
    // Allocate answers lease tokens: kubelet (root) only.
    tessera_common::unix::bind_socket(path, 0o600).map_err(|source| K8sError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn serve(
    plugin: Arc<DevicePlugin>,
    class: String,
    listener: tokio::net::UnixListener,
    stop: watch::Receiver<bool>,
) {
    let svc = PluginService::new(plugin, class.clone(), stop.clone());
    tokio::spawn(async move {
        // grpc-go (kubelet) sends the socket path as :authority: normalized first.
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
            .map(|c| c.map(NormalizeAuthority::new));
        let mut stop = stop;
        let res = tonic::transport::Server::builder()
            .add_service(dp::device_plugin_server::DevicePluginServer::new(svc))
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = res {
            warn!(class = %class, error = %e, "kubernetes: plugin endpoint stopped");
        }
    });
}

async fn register(kubelet: &Path, class: &str) -> Result<(), K8sError> {
    let fail = |message| failed(kubelet, message);
    let ch = connect(kubelet).await?;
    let mut client = dp::registration_client::RegistrationClient::new(ch);
    let req = dp::RegisterRequest {
        version: dp::VERSION.into(),
        endpoint: endpoint_name(class),
        resource_name: resource_name(class),
        options: Some(super::service::options()),
    };
    tokio::time::timeout(KUBELET_TIMEOUT, client.register(req))
        .await
        .map_err(|_| fail("Register: no answer".into()))?
        .map_err(|s| fail(format!("Register refused: {}", s.message())))?;
    Ok(())
}

/// Serve every class's endpoint and keep it registered until `stop`.
pub(super) async fn serve_and_register(plugin: Arc<DevicePlugin>, mut stop: watch::Receiver<bool>) {
    let dir = plugin.cfg.device_plugin_dir.clone();
    let kubelet = dir.join(dp::KUBELET_SOCKET);
    let mut eps: BTreeMap<String, Endpoint> = BTreeMap::new();
    let mut dir_missing_logged = false;
    loop {
        if dir.is_dir() {
            dir_missing_logged = false;
            let kid = socket_id(&kubelet);
            for class in plugin.classes() {
                let path = dir.join(endpoint_name(&class));
                let alive = eps
                    .get(&class)
                    .is_some_and(|e| e.socket.is_some() && socket_id(&path) == e.socket);
                if !alive {
                    if let Some(old) = eps.remove(&class) {
                        let _ = old.stop.send(true);
                    }
                    match bind(&path) {
                        Ok(l) => {
                            let (tx, rx) = watch::channel(false);
                            serve(plugin.clone(), class.clone(), l, rx);
                            eps.insert(
                                class.clone(),
                                Endpoint {
                                    socket: socket_id(&path),
                                    registered_with: None,
                                    stop: tx,
                                    warned_for: None,
                                },
                            );
                        }
                        Err(e) => {
                            warn!(error = %e, "kubernetes: plugin socket not served");
                            continue;
                        }
                    }
                }
                let Some(ep) = eps.get_mut(&class) else {
                    continue;
                };
                if kid.is_some() && ep.registered_with != kid {
                    match register(&kubelet, &class).await {
                        Ok(()) => {
                            info!(resource = %resource_name(&class), endpoint = %path.display(), "kubernetes: registered with kubelet");
                            ep.registered_with = kid;
                        }
                        Err(e) => {
                            if ep.warned_for != kid {
                                warn!(error = %e, "kubernetes: registration failed; retrying");
                                ep.warned_for = kid;
                            }
                        }
                    }
                }
            }
        } else if !dir_missing_logged {
            warn!(dir = %dir.display(), "kubernetes: the device-plugins directory does not exist (is kubelet installed?); waiting for it");
            dir_missing_logged = true;
        }
        tokio::select! {
            _ = tokio::time::sleep(WATCH_INTERVAL) => {}
            _ = stop.changed() => break,
        }
    }
    for (class, ep) in eps {
        let _ = ep.stop.send(true);
        let path = dir.join(endpoint_name(&class));
        if socket_id(&path) == ep.socket {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// kubelet at `socket` did not answer as it should.
fn failed(socket: &Path, message: String) -> K8sError {
    K8sError::Kubelet {
        socket: socket.to_path_buf(),
        message,
    }
}

/// A channel to one of kubelet's sockets, within [`KUBELET_TIMEOUT`].
async fn connect(socket: &Path) -> Result<tonic::transport::Channel, K8sError> {
    tokio::time::timeout(KUBELET_TIMEOUT, tessera_common::unix::channel(socket))
        .await
        .map_err(|_| failed(socket, "no answer".into()))?
        .map_err(|e| failed(socket, e.to_string()))
}

/// PodResources List: device id -> the pod holding it, for tessera.io resources.
pub(super) async fn pod_holders(socket: &Path) -> Result<BTreeMap<String, Holder>, K8sError> {
    let fail = |message| failed(socket, message);
    let ch = connect(socket).await?;
    let mut client = pr::pod_resources_lister_client::PodResourcesListerClient::new(ch);
    let resp = tokio::time::timeout(KUBELET_TIMEOUT, client.list(pr::ListPodResourcesRequest {}))
        .await
        .map_err(|_| fail("List: no answer".into()))?
        .map_err(|s| fail(format!("List: {}", s.message())))?
        .into_inner();
    let prefix = format!("{RESOURCE_DOMAIN}/");
    let mut out = BTreeMap::new();
    for pod in resp.pod_resources {
        for c in &pod.containers {
            for d in &c.devices {
                if !d.resource_name.starts_with(&prefix) {
                    continue;
                }
                for id in &d.device_ids {
                    out.insert(
                        id.clone(),
                        Holder {
                            resource: d.resource_name.clone(),
                            namespace: pod.namespace.clone(),
                            pod: pod.name.clone(),
                        },
                    );
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_created_again_at_once_is_a_new_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubelet.sock");
        let _first = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let before = socket_id(&path).unwrap();
        assert_eq!(socket_id(&path), Some(before), "the same file, the same id");
        // Deleted and created again at once: the inode number often comes back.
        let mut same_inode = false;
        let mut prev = before;
        for _ in 0..20 {
            std::fs::remove_file(&path).unwrap();
            let _again = std::os::unix::net::UnixListener::bind(&path).unwrap();
            let now = socket_id(&path).unwrap();
            same_inode |= (now.0, now.1) == (prev.0, prev.1);
            assert_ne!(now, prev, "a socket created again must be seen as new");
            prev = now;
        }
        println!("inode number reused: {same_inode}");
        std::fs::write(dir.path().join("plain"), b"").unwrap();
        assert_eq!(socket_id(&dir.path().join("plain")), None, "not a socket");
    }
}
