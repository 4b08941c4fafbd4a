//! The tessera.v1 service: every RPC is one call into the envelope
//! ([`super::envelope::serve`]) with its request, whose handler lives in
//! `handlers/`.

use std::sync::Arc;

use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_server::{Tessera, TesseraServer};
use tonic::{Request, Response, Status};

use super::auth::Authenticator;
use super::envelope::serve;
use super::paging::PageTokens;
use super::state::{ApiState, ReloadHook};
use super::watch::EventStream;
use crate::audit::AuditLog;
use crate::lease::LeaseManager;
use crate::metrics::Metrics;

/// Largest request the daemon decodes (a lease request is a few hundred bytes).
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

#[derive(Debug, Clone)]
pub struct TesseraService {
    api: Arc<ApiState>,
}

impl TesseraService {
    pub fn new(
        mgr: Arc<LeaseManager>,
        auth: Arc<Authenticator>,
        audit: Option<Arc<AuditLog>>,
        metrics: Option<Arc<Metrics>>,
    ) -> Self {
        let api = ApiState {
            mgr,
            auth,
            audit,
            metrics,
            reload_hooks: Default::default(),
            tokens: PageTokens::default(),
        };
        TesseraService { api: Arc::new(api) }
    }

    /// Run `hook` with every config a reload (SIGHUP, ReloadConfig) accepts.
    pub fn on_reload(&self, hook: ReloadHook) {
        self.api.on_reload(hook);
    }

    /// Re-read the config file and apply what can change at run time: tenants,
    /// quotas, priority classes and principals. A bad file changes nothing.
    pub fn reload(&self) -> Result<String, Status> {
        self.api.reload()
    }

    /// The metrics the calls are counted and timed into, when they are kept.
    /// The token verifier the TLS listener checks bearer tokens with, when
    /// `[auth.oidc]` is configured.
    pub(super) fn token_verifier(&self) -> Option<Arc<super::oidc::Verifier>> {
        self.api.auth.oidc()
    }

    pub fn metrics(&self) -> Option<Arc<Metrics>> {
        self.api.metrics.clone()
    }

    pub fn into_server(self) -> TesseraServer<Self> {
        let max_send = self.api.mgr.config().api.max_send_message;
        TesseraServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(max_send)
    }
}

/// The tessera.v1 trait, every method one call of [`serve`] with its request.
macro_rules! every_call_in_the_envelope {
    ($($method:ident: $req:ident -> $reply:ty;)*) => {
        #[tonic::async_trait]
        impl Tessera for TesseraService {
            type WatchLeasesStream = EventStream;

            $(
                async fn $method(
                    &self,
                    req: Request<pb::$req>,
                ) -> Result<Response<$reply>, Status> {
                    serve(&self.api, req).await
                }
            )*
        }
    };
}

every_call_in_the_envelope! {
    get_node: GetNodeRequest -> pb::GetNodeResponse;
    create_lease: CreateLeaseRequest -> pb::CreateLeaseResponse;
    renew_lease: RenewLeaseRequest -> pb::RenewLeaseResponse;
    release_lease: ReleaseLeaseRequest -> pb::ReleaseLeaseResponse;
    get_lease: GetLeaseRequest -> pb::GetLeaseResponse;
    list_leases: ListLeasesRequest -> pb::ListLeasesResponse;
    watch_leases: WatchLeasesRequest -> EventStream;
    resolve_token: ResolveTokenRequest -> pb::ResolveTokenResponse;
    bind_container: BindContainerRequest -> pb::BindContainerResponse;
    unbind_container: UnbindContainerRequest -> pb::UnbindContainerResponse;
    report_admission: ReportAdmissionRequest -> pb::ReportAdmissionResponse;
    get_usage: GetUsageRequest -> pb::GetUsageResponse;
    reload_config: ReloadConfigRequest -> pb::ReloadConfigResponse;
    grant_quota: GrantQuotaRequest -> pb::GrantQuotaResponse;
    set_gpu_health: SetGpuHealthRequest -> pb::SetGpuHealthResponse;
    get_quota: GetQuotaRequest -> pb::GetQuotaResponse;
}
