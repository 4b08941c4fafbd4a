use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_server::{Tessera, TesseraServer};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::info;

use super::convert::{self, status};
use crate::lease::model::ContainerBinding;
use crate::lease::{LeaseManager, now_ms};

/// Largest request the daemon decodes (a lease request is a few hundred bytes).
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

#[derive(Debug, Clone)]
pub struct TesseraService {
    mgr: Arc<LeaseManager>,
}

impl TesseraService {
    pub fn new(mgr: Arc<LeaseManager>) -> Self {
        TesseraService { mgr }
    }

    pub fn into_server(self) -> TesseraServer<Self> {
        TesseraServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(16 * MAX_MESSAGE_BYTES)
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

/// Run a state-changing call to completion even if the client goes away: hyper
/// drops a handler whose client reset the stream, and a lease operation cancelled
/// between its steps would stay half done (a lease pending forever, a teardown
/// never retried).
async fn detached<T: Send + 'static>(
    fut: impl std::future::Future<Output = Result<T, Status>> + Send + 'static,
) -> Result<T, Status> {
    tokio::spawn(fut)
        .await
        .map_err(|e| Status::internal(format!("request task failed: {e}")))?
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::LeaseEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Tessera for TesseraService {
    async fn get_node(
        &self,
        _req: Request<pb::GetNodeRequest>,
    ) -> Result<Response<pb::GetNodeResponse>, Status> {
        let gpus = self.mgr.node();
        Ok(Response::new(pb::GetNodeResponse {
            hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_default(),
            backend: self.mgr.backend().name().to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            gpus: gpus.iter().map(convert::gpu_to_pb).collect(),
            driver_version: self.mgr.backend().driver_version().unwrap_or_default(),
        }))
    }

    async fn create_lease(
        &self,
        req: Request<pb::CreateLeaseRequest>,
    ) -> Result<Response<pb::CreateLeaseResponse>, Status> {
        let req = convert::create_request_from_pb(req.into_inner())?;
        let mgr = self.mgr.clone();
        let created = detached(async move { mgr.create(req).await.map_err(status) }).await?;
        Ok(Response::new(pb::CreateLeaseResponse {
            lease: Some(convert::lease_to_pb(
                &created.lease,
                created.partition.as_ref(),
            )),
            token: created.token.unwrap_or_default(),
            replayed: created.replayed,
        }))
    }

    async fn renew_lease(
        &self,
        req: Request<pb::RenewLeaseRequest>,
    ) -> Result<Response<pb::RenewLeaseResponse>, Status> {
        let r = req.into_inner();
        let ttl = (r.ttl_seconds > 0).then(|| Duration::from_secs(r.ttl_seconds));
        let mgr = self.mgr.clone();
        let id = r.lease_id.clone();
        let lease = detached(async move { mgr.renew(&id, ttl).await.map_err(status) }).await?;
        let (l, p) = self.mgr.get(&lease.id).map_err(status)?;
        Ok(Response::new(pb::RenewLeaseResponse {
            lease: Some(convert::lease_to_pb(&l, p.as_ref())),
        }))
    }

    async fn release_lease(
        &self,
        req: Request<pb::ReleaseLeaseRequest>,
    ) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
        let r = req.into_inner();
        if r.reason.len() > 1024 {
            return Err(Status::invalid_argument(
                "invalid reason: at most 1024 characters",
            ));
        }
        let reason = if r.reason.is_empty() {
            "released by the tenant".to_string()
        } else {
            r.reason
        };
        let mgr = self.mgr.clone();
        let lease = detached(async move {
            mgr.end(
                &r.lease_id,
                crate::lease::model::LeaseState::Released,
                &reason,
            )
            .await
            .map_err(status)
        })
        .await?;
        Ok(Response::new(pb::ReleaseLeaseResponse {
            lease: Some(convert::lease_to_pb(&lease, None)),
        }))
    }

    async fn get_lease(
        &self,
        req: Request<pb::GetLeaseRequest>,
    ) -> Result<Response<pb::GetLeaseResponse>, Status> {
        let r = req.into_inner();
        let (l, p) = self.mgr.get(&r.lease_id).map_err(status)?;
        Ok(Response::new(pb::GetLeaseResponse {
            lease: Some(convert::lease_to_pb(&l, p.as_ref())),
        }))
    }

    async fn list_leases(
        &self,
        req: Request<pb::ListLeasesRequest>,
    ) -> Result<Response<pb::ListLeasesResponse>, Status> {
        let r = req.into_inner();
        let state = convert::state_from_pb(r.state)?;
        let tenant = non_empty(r.tenant);
        let leases = self
            .mgr
            .list(tenant.as_deref(), state, r.include_ended)
            .map_err(status)?;
        Ok(Response::new(pb::ListLeasesResponse {
            leases: leases
                .iter()
                .map(|(l, p)| convert::lease_to_pb(l, p.as_ref()))
                .collect(),
        }))
    }

    type WatchLeasesStream = EventStream;

    async fn watch_leases(
        &self,
        req: Request<pb::WatchLeasesRequest>,
    ) -> Result<Response<Self::WatchLeasesStream>, Status> {
        let tenant = non_empty(req.into_inner().tenant);
        let mut rx = self.mgr.subscribe();
        let (tx, out) = tokio::sync::mpsc::channel(256);
        // Forward matching events until the client goes away; a watcher that falls
        // behind gets DATA_LOSS once and the stream ends (it must re-list).
        tokio::spawn(async move {
            loop {
                // A watcher whose client left ends now, not at the next event it
                // would be sent (with a tenant filter that may never come).
                let recv = tokio::select! {
                    r = rx.recv() => r,
                    () = tx.closed() => return,
                };
                let item = match recv {
                    Ok(ev) => {
                        if tenant.as_ref().is_some_and(|t| *t != ev.lease.tenant) {
                            continue;
                        }
                        Ok(convert::event_to_pb(&ev))
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        Err(Status::data_loss(format!(
                            "this watcher fell {n} events behind and was dropped; re-list and watch again"
                        )))
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                };
                let stop = item.is_err();
                if tx.send(item).await.is_err() || stop {
                    return;
                }
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(out);
        Ok(Response::new(Box::pin(stream) as EventStream))
    }

    async fn resolve_token(
        &self,
        req: Request<pb::ResolveTokenRequest>,
    ) -> Result<Response<pb::ResolveTokenResponse>, Status> {
        let r = req.into_inner();
        let resolved = self.mgr.resolve_token(&r.token).map_err(status)?;
        Ok(Response::new(convert::resolved_to_pb(&resolved)))
    }

    async fn bind_container(
        &self,
        req: Request<pb::BindContainerRequest>,
    ) -> Result<Response<pb::BindContainerResponse>, Status> {
        let r = req.into_inner();
        let mgr = self.mgr.clone();
        let binding = ContainerBinding {
            id: r.container_id,
            cgroup_path: r.cgroup_path,
            runtime_root: r.runtime_root,
            bound_at_ms: now_ms(),
        };
        let lease =
            detached(async move { mgr.bind_container(&r.token, binding).await.map_err(status) })
                .await?;
        Ok(Response::new(pb::BindContainerResponse {
            lease: Some(convert::lease_to_pb(&lease, None)),
        }))
    }

    async fn unbind_container(
        &self,
        req: Request<pb::UnbindContainerRequest>,
    ) -> Result<Response<pb::UnbindContainerResponse>, Status> {
        let r = req.into_inner();
        let mgr = self.mgr.clone();
        detached(async move { mgr.unbind_container(&r.container_id).await.map_err(status) })
            .await?;
        Ok(Response::new(pb::UnbindContainerResponse {}))
    }

    async fn report_admission(
        &self,
        req: Request<pb::ReportAdmissionRequest>,
    ) -> Result<Response<pb::ReportAdmissionResponse>, Status> {
        let r = req.into_inner();
        info!(
            container = %r.container_id,
            lease = %r.lease_id,
            admitted = r.admitted,
            command = %r.command,
            reasons = ?r.reasons,
            "runtime admission"
        );
        Ok(Response::new(pb::ReportAdmissionResponse {}))
    }

    async fn get_usage(
        &self,
        _req: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::GetUsageResponse>, Status> {
        Err(Status::unimplemented(
            "usage accounting is not available in this build",
        ))
    }

    async fn reload_config(
        &self,
        _req: Request<pb::ReloadConfigRequest>,
    ) -> Result<Response<pb::ReloadConfigResponse>, Status> {
        Err(Status::unimplemented(
            "config reload is not available in this build",
        ))
    }

    async fn grant_quota(
        &self,
        _req: Request<pb::GrantQuotaRequest>,
    ) -> Result<Response<pb::GrantQuotaResponse>, Status> {
        Err(Status::unimplemented(
            "quotas are not available in this build",
        ))
    }

    async fn get_quota(
        &self,
        _req: Request<pb::GetQuotaRequest>,
    ) -> Result<Response<pb::GetQuotaResponse>, Status> {
        Err(Status::unimplemented(
            "quotas are not available in this build",
        ))
    }
}

/// Errors of binding the API socket.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: a live tesserad already answers on this socket")]
    InUse { path: std::path::PathBuf },
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Bind the unix socket (removing a stale one), set its mode, and return the listener.
pub fn bind_unix(path: &Path, mode: u32) -> Result<tokio::net::UnixListener, ServeError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |source| ServeError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ServeError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServeError::InUse {
                path: path.to_path_buf(),
            });
        }
        std::fs::remove_file(path).map_err(io)?;
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io)?;
    Ok(listener)
}

/// Serve the API (with grpc.health.v1 and reflection) on `listener` until `shutdown`.
pub async fn serve_unix(
    mgr: Arc<LeaseManager>,
    listener: tokio::net::UnixListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<TesseraServer<TesseraService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Io {
            path: "reflection".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    tonic::transport::Server::builder()
        .concurrency_limit_per_connection(256)
        .max_concurrent_streams(Some(1024))
        .timeout(Duration::from_secs(120))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(TesseraService::new(mgr).into_server())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}
