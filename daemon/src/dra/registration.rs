//! The plugin's two unix sockets: the registration socket kubelet's plugin watcher
//! finds in `plugins_registry`, and `dra.sock`, the endpoint it names. Each is
//! served until stop, and made again when its file is removed or replaced.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_proto::k8s::dra::{v1 as drav1, v1beta1 as drav1beta1};
use tessera_proto::k8s::dra_health::v1 as health;
use tessera_proto::k8s::pluginregistration::v1 as reg;
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tracing::{info, warn};

use crate::api::transport::uds_authority::NormalizeAuthority;

use super::plugin::DraPlugin;
use super::service::{DraService, HealthService, RegistrationService, plugin_info};
use super::{DraError, PLUGIN_SOCKET, REGISTRATION_SOCKET};

/// A socket file's identity (device, inode, change time).
type SocketId = (u64, u64, i64, i64);

fn socket_id(path: &Path) -> Option<SocketId> {
    let m = std::fs::metadata(path).ok()?;
    m.file_type()
        .is_socket()
        .then(|| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// One served socket.
struct Served {
    path: PathBuf,
    id: Option<SocketId>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Served {
    async fn stop(self, remove: bool) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        // Only our own file: one made by someone since is left alone.
        if remove && socket_id(&self.path) == self.id {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[derive(Clone, Copy)]
enum Which {
    Registration,
    Plugin,
}

/// The endpoint and the registration socket, served.
pub(super) struct Sockets {
    endpoint: Served,
    registration: Served,
}

fn bind(path: &Path) -> Result<tokio::net::UnixListener, DraError> {
    // Prepare makes leases for any namespace's tenant: kubelet (root) only.
    tessera_common::unix::bind_socket(path, 0o600).map_err(|source| DraError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn serve(plugin: &Arc<DraPlugin>, which: Which, path: PathBuf) -> Result<Served, DraError> {
    let listener = bind(&path)?;
    let id = socket_id(&path);
    let (stop_tx, mut stop) = watch::channel(false);
    // grpc-go (kubelet) sends the socket path as :authority: normalized first.
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
        .map(|c| c.map(NormalizeAuthority::new));
    let mut router = tonic::transport::Server::builder();
    let router = match which {
        Which::Registration => {
            let endpoint = plugin.config().dra_plugin_dir.join(PLUGIN_SOCKET);
            router.add_service(reg::registration_server::RegistrationServer::new(
                RegistrationService {
                    info: plugin_info(&endpoint),
                },
            ))
        }
        Which::Plugin => router
            .add_service(drav1::dra_plugin_server::DraPluginServer::new(DraService {
                plugin: plugin.clone(),
            }))
            .add_service(drav1beta1::dra_plugin_server::DraPluginServer::new(
                DraService {
                    plugin: plugin.clone(),
                },
            ))
            .add_service(
                health::dra_resource_health_server::DraResourceHealthServer::new(HealthService {
                    plugin: plugin.clone(),
                    stop: stop.clone(),
                }),
            ),
    };
    let shown = path.clone();
    let task = tokio::spawn(async move {
        let res = router
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = res {
            warn!(socket = %shown.display(), error = %e, "dra: socket no longer served");
        }
    });
    Ok(Served {
        path,
        id,
        stop: stop_tx,
        task,
    })
}

impl Sockets {
    /// Serve `dra.sock` first, then the registration socket (kubelet connects to
    /// the endpoint as soon as it finds the registration).
    pub(super) fn bind(plugin: &Arc<DraPlugin>) -> Result<Sockets, DraError> {
        let cfg = plugin.config();
        let endpoint = serve(
            plugin,
            Which::Plugin,
            cfg.dra_plugin_dir.join(PLUGIN_SOCKET),
        )?;
        let registration = serve(
            plugin,
            Which::Registration,
            cfg.dra_registry_dir.join(REGISTRATION_SOCKET),
        )?;
        Ok(Sockets {
            endpoint,
            registration,
        })
    }

    pub(super) fn endpoint(&self) -> &Path {
        &self.endpoint.path
    }

    pub(super) fn registration(&self) -> &Path {
        &self.registration.path
    }

    /// A socket whose file is gone or replaced is served again (the registration
    /// socket then too, so kubelet's plugin watcher registers the plugin again).
    pub(super) fn keep(&mut self, plugin: &Arc<DraPlugin>) {
        let lost_endpoint = socket_id(&self.endpoint.path) != self.endpoint.id;
        let lost_registration = socket_id(&self.registration.path) != self.registration.id;
        if !lost_endpoint && !lost_registration {
            return;
        }
        if lost_endpoint {
            match serve(plugin, Which::Plugin, self.endpoint.path.clone()) {
                Ok(s) => {
                    let old = std::mem::replace(&mut self.endpoint, s);
                    let _ = old.stop.send(true);
                }
                Err(e) => {
                    warn!(error = %e, "dra: plugin socket not served again");
                    return;
                }
            }
        }
        match serve(plugin, Which::Registration, self.registration.path.clone()) {
            Ok(s) => {
                let old = std::mem::replace(&mut self.registration, s);
                let _ = old.stop.send(true);
                info!(socket = %self.registration.path.display(), "dra: sockets made again; kubelet registers the plugin anew");
            }
            Err(e) => warn!(error = %e, "dra: registration socket not served again"),
        }
    }

    /// Stop serving; the registration socket is removed (kubelet deregisters the
    /// plugin), then the endpoint.
    pub(super) async fn shutdown(self) {
        self.registration.stop(true).await;
        self.endpoint.stop(true).await;
    }
}
