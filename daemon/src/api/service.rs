use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_server::{Tessera, TesseraServer};
use tonic::codegen::http;
use tonic::{Request, Response, Status};
use tonic_types::StatusExt;
use tracing::info;

use super::auth::{self, Authenticator, Caller, Principal, Rpc};
use super::convert::{self, status};
use super::errors::rich;
use super::paging::{self, PageTokens};
use super::watch::EventStream;
use crate::audit::{AuditLog, Record};
use crate::config::{Amounts, AuditOnFailure, Config};
use crate::gpu::HealthCause;
use crate::lease::devices::Resolved;
use crate::lease::{CreateRequest, HealthSource, LeaseError, LeaseManager};
use crate::model::ContainerBinding;
use tessera_common::clock::now_ms;

pub mod timing;
pub mod uds_authority;

/// Largest request the daemon decodes (a lease request is a few hundred bytes).
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

/// The receive limit every gRPC stack has by default (grpc-core, grpc-go, grpc-java,
/// tonic): a ListLeases page stays under it, whatever `api.max_send_message` allows.
pub const DEFAULT_CLIENT_LIMIT: usize = 4 << 20;

/// Room a ListLeases page leaves below its limit (the answer's own fields and
/// framing).
const PAGE_HEADROOM: usize = 64 * 1024;

#[derive(Debug, Clone)]
pub struct TesseraService {
    mgr: Arc<LeaseManager>,
    auth: Arc<Authenticator>,
    audit: Option<Arc<AuditLog>>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    reload_hooks: ReloadHooks,
    /// ListLeases page tokens of this daemon run.
    tokens: Arc<PageTokens>,
}

/// What else applies a reloaded config (the device plugin's mix): each gets the new
/// config and answers a few words for the reload message.
pub type ReloadHook = Arc<dyn Fn(&Config) -> String + Send + Sync>;

#[derive(Clone, Default)]
struct ReloadHooks(Arc<std::sync::Mutex<Vec<ReloadHook>>>);

impl std::fmt::Debug for ReloadHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadHooks").finish_non_exhaustive()
    }
}

fn code_name(code: tonic::Code) -> String {
    format!("{code:?}")
}

impl TesseraService {
    pub fn new(
        mgr: Arc<LeaseManager>,
        auth: Arc<Authenticator>,
        audit: Option<Arc<AuditLog>>,
        metrics: Option<Arc<crate::metrics::Metrics>>,
    ) -> Self {
        TesseraService {
            mgr,
            auth,
            audit,
            metrics,
            reload_hooks: ReloadHooks::default(),
            tokens: Arc::new(PageTokens::default()),
        }
    }

    /// Run `hook` with every config a reload (SIGHUP, ReloadConfig) accepts.
    pub fn on_reload(&self, hook: ReloadHook) {
        self.reload_hooks
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    fn count(&self, rpc: Rpc, code: tonic::Code) {
        if let Some(m) = &self.metrics {
            m.record_call(rpc.name(), super::code_name(code));
        }
    }

    /// Re-read the config file and apply what can change at run time: tenants,
    /// quotas, priority classes and principals. A bad file changes nothing.
    pub fn reload(&self) -> Result<String, Status> {
        let path = self.mgr.config().path.clone();
        let cfg = Config::load(&path).map_err(|e| {
            Status::failed_precondition(format!("config not reloaded, the old one stays: {e}"))
        })?;
        let tenants = cfg.tenancy.tenants.len();
        let principals = cfg.auth.principals.len();
        let hooks: Vec<ReloadHook> = self
            .reload_hooks
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let more: String = hooks.iter().map(|h| format!(", {}", h(&cfg))).collect();
        self.mgr.set_tenancy(cfg.tenancy);
        self.auth.set_rules(cfg.auth.principals);
        let msg = format!(
            "reloaded {}: {tenants} tenant quotas, {principals} principals{more} (other sections apply at the next start)",
            path.display()
        );
        info!("{msg}");
        Ok(msg)
    }

    /// A container admitted or refused by the runtime: metrics, log and audit.
    #[allow(clippy::too_many_arguments)]
    fn record_admission(
        &self,
        who: &Principal,
        tenant: String,
        lease: String,
        container: String,
        command: String,
        admitted: bool,
        reasons: Vec<String>,
    ) {
        if let Some(m) = &self.metrics {
            m.record_admission(admitted, &reasons);
        }
        info!(
            container = %container,
            lease = %lease,
            admitted,
            command = %command,
            reasons = ?reasons,
            "runtime admission"
        );
        self.write_audit(Record {
            at_ms: now_ms(),
            source: "runtime".into(),
            principal: who.name().to_string(),
            tenant,
            action: if command.is_empty() {
                "admission".into()
            } else {
                command
            },
            lease,
            container,
            result: if admitted {
                "admitted".into()
            } else {
                "refused".into()
            },
            reasons,
            oidc: None,
        });
    }

    fn write_audit(&self, rec: Record) {
        if let Some(a) = &self.audit
            && let Err(e) = a.record(rec)
        {
            if let Some(m) = &self.metrics {
                m.audit_failed();
            }
            tracing::error!(error = %e, "audit log write failed");
        }
    }

    /// Before a call changes anything: its audit record, written ahead. When that
    /// fails and `audit.on_failure = "refuse"`, the call is refused and nothing
    /// happens that the log cannot show (auditd's disk-full action); with "log" it
    /// goes on. The outcome is recorded after the call as before.
    fn audit_ahead(&self, rpc: Rpc, who: &Principal) -> Result<(), Status> {
        let Some(a) = &self.audit else {
            return Ok(());
        };
        let rec = Record {
            at_ms: now_ms(),
            source: "api".into(),
            principal: who.name().to_string(),
            tenant: who.tenant().unwrap_or_default().to_string(),
            action: rpc.name().into(),
            lease: String::new(),
            container: String::new(),
            result: "attempt".into(),
            reasons: vec![],
            oidc: who.oidc().cloned(),
        };
        let Err(e) = a.record(rec) else {
            return Ok(());
        };
        if let Some(m) = &self.metrics {
            m.audit_failed();
        }
        match self.mgr.config().audit.on_failure {
            AuditOnFailure::Log => {
                tracing::error!(error = %e, rpc = rpc.name(), "audit log write failed; going on (audit.on_failure = \"log\")");
                Ok(())
            }
            AuditOnFailure::Refuse => {
                tracing::error!(error = %e, rpc = rpc.name(), "audit log write failed; refusing the call (audit.on_failure = \"refuse\")");
                self.count(rpc, tonic::Code::Unavailable);
                let mut details = tonic_types::ErrorDetails::with_retry_info(Some(
                    std::time::Duration::from_secs(30),
                ));
                details.set_error_info("AUDIT_UNAVAILABLE", super::errors::DOMAIN, HashMap::new());
                Err(Status::with_error_details(
                    tonic::Code::Unavailable,
                    format!(
                        "{} refused: the audit log cannot be written ({e}); nothing was changed. Free space or fix {}, then retry",
                        rpc.name(),
                        a.path().display()
                    ),
                    details,
                ))
            }
        }
    }

    /// Identify the caller and check that its kind may call `rpc` at all.
    fn begin<T>(&self, rpc: Rpc, req: &Request<T>) -> Result<Principal, Status> {
        let caller = auth::caller_of(req);
        let refuse = |st: Status, who: String| {
            self.count(rpc, st.code());
            self.write_audit(Record {
                at_ms: now_ms(),
                source: "api".into(),
                principal: who,
                tenant: String::new(),
                action: rpc.name().into(),
                lease: String::new(),
                container: String::new(),
                result: code_name(st.code()),
                reasons: vec![st.message().to_string()],
                oidc: caller.oidc().cloned(),
            });
            super::errors::with_error_info(st)
        };
        let who = self
            .auth
            .identify(&caller)
            .map_err(|st| refuse(st, describe(&caller)))?;
        if !auth::allowed(rpc, &who) {
            let st = Status::permission_denied(format!(
                "principal {:?} may not call {}",
                who.name(),
                rpc.name()
            ));
            return Err(refuse(st, who.name().to_string()));
        }
        if rpc.mutates() {
            self.audit_ahead(rpc, &who)?;
        }
        Ok(who)
    }

    /// Audit the outcome of a call and pass it through.
    fn done<R>(
        &self,
        rpc: Rpc,
        who: &Principal,
        tenant: &str,
        lease: &str,
        r: Result<R, Status>,
    ) -> Result<R, Status> {
        self.done_for(rpc, who, (tenant, lease), "", r)
    }

    /// [`Self::done`] for a call about one container (its id in the audit record).
    fn done_for<R>(
        &self,
        rpc: Rpc,
        who: &Principal,
        (tenant, lease): (&str, &str),
        container: &str,
        r: Result<R, Status>,
    ) -> Result<R, Status> {
        let r = r.map_err(super::errors::with_error_info);
        let (result, reasons) = match &r {
            Ok(_) => ("ok".to_string(), vec![]),
            Err(st) => (code_name(st.code()), vec![st.message().to_string()]),
        };
        self.count(rpc, r.as_ref().err().map_or(tonic::Code::Ok, Status::code));
        self.write_audit(Record {
            at_ms: now_ms(),
            source: "api".into(),
            principal: who.name().to_string(),
            tenant: tenant.to_string(),
            action: rpc.name().into(),
            lease: lease.to_string(),
            // An id is at most 1024 bytes where it is accepted; a refused one may
            // be longer (the request's limit): the record keeps its start.
            container: crate::names::truncate(container, 1024),
            result,
            reasons,
            oidc: who.oidc().cloned(),
        });
        r
    }

    /// The tenant a tenant principal may act for: its own. `asked` must be empty or
    /// equal. Admins act for whatever they ask.
    fn scope(&self, who: &Principal, asked: &str) -> Result<String, Status> {
        match who.tenant() {
            None => Ok(asked.to_string()),
            Some(own) if asked.is_empty() || asked == own => Ok(own.to_string()),
            Some(own) => Err(Status::permission_denied(format!(
                "principal {:?} acts for tenant {own:?}, not {asked:?}",
                who.name()
            ))),
        }
    }

    /// For a tenant principal, the lease must be its own tenant's.
    fn check_lease_owner(&self, who: &Principal, lease_id: &str) -> Result<String, Status> {
        let (lease, _) = self.mgr.get(lease_id).map_err(status)?;
        if let Some(own) = who.tenant()
            && lease.tenant != own
        {
            return Err(Status::permission_denied(format!(
                "lease {lease_id} belongs to another tenant"
            )));
        }
        Ok(lease.tenant)
    }

    pub fn into_server(self) -> TesseraServer<Self> {
        let max_send = self.mgr.config().api.max_send_message;
        TesseraServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(max_send)
    }
}

fn describe(c: &Caller) -> String {
    c.describe()
}

fn amounts_to_pb(a: Amounts) -> pb::QuotaAmounts {
    pb::QuotaAmounts {
        mig_slices: a.mig_slices,
        mps_sm_percent: a.mps_sm_percent,
        memory_bytes: a.memory_bytes,
        whole_gpus: a.whole_gpus,
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

/// Run a state-changing call to completion even if the client goes away: hyper
/// drops a handler whose client reset the stream, and a lease operation cancelled
/// between its steps would stay half done (a lease pending forever, a teardown
/// never retried).
/// The caller's deadline from its `grpc-timeout` header (digits and a unit: H, M, S,
/// m, u, n), None when absent or malformed.
fn grpc_timeout(meta: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let v = meta.get("grpc-timeout")?.to_str().ok()?;
    let split = v.len().checked_sub(1)?;
    let (digits, unit) = (v.get(..split)?, v.get(split..)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

async fn detached<T: Send + 'static>(
    fut: impl std::future::Future<Output = Result<T, Status>> + Send + 'static,
) -> Result<T, Status> {
    tokio::spawn(fut)
        .await
        .map_err(|e| Status::internal(format!("request task failed: {e}")))?
}

#[tonic::async_trait]
impl Tessera for TesseraService {
    async fn get_node(
        &self,
        req: Request<pb::GetNodeRequest>,
    ) -> Result<Response<pb::GetNodeResponse>, Status> {
        let who = self.begin(Rpc::GetNode, &req)?;
        let mut gpus: Vec<pb::Gpu> = self.mgr.node().iter().map(convert::gpu_to_pb).collect();
        if let Some(own) = who.tenant() {
            // A tenant sees capacity, and only its own partitions.
            let mine: std::collections::HashSet<String> = self
                .mgr
                .list(Some(own), None, false)
                .map_err(status)?
                .into_iter()
                .map(|(l, _)| l.id)
                .collect();
            for g in &mut gpus {
                g.partitions.retain(|p| mine.contains(&p.lease_id));
            }
        }
        let r = Ok(Response::new(pb::GetNodeResponse {
            hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_default(),
            backend: self.mgr.backend().name().to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            gpus,
            driver_version: self.mgr.backend().driver_version().unwrap_or_default(),
            queued_requests: u32::try_from(self.mgr.queued_requests()).unwrap_or(u32::MAX),
        }));
        self.done(Rpc::GetNode, &who, who.tenant().unwrap_or(""), "", r)
    }

    async fn create_lease(
        &self,
        req: Request<pb::CreateLeaseRequest>,
    ) -> Result<Response<pb::CreateLeaseResponse>, Status> {
        let who = self.begin(Rpc::CreateLease, &req)?;
        let asked_wait = Duration::from_millis(u64::from(req.get_ref().queue_wait_ms));
        // A queued call never outlives its caller's deadline (grpc-timeout).
        let deadline = grpc_timeout(req.metadata());
        let queue_wait = deadline.map_or(asked_wait, |d| asked_wait.min(d));
        let cut_by_deadline = queue_wait < asked_wait;
        let this = self.clone();
        let body = async move {
            let r = req.into_inner();
            let tenant = match this.scope(&who, &r.tenant) {
                Ok(t) => t,
                Err(st) => return this.done(Rpc::CreateLease, &who, &r.tenant, "", Err(st)),
            };
            let result = async {
                let default_mps = this.mgr.config().partition.mps_mode;
                let need = convert::need_from_pb(r.shape.as_ref(), default_mps)?;
                let count = convert::count_from_pb(r.shape.as_ref());
                let topology = convert::topology_from_pb(r.topology)?;
                let shape = convert::shape_from_pb(r.shape, default_mps)?;
                let labels: BTreeMap<String, String> = r.labels.into_iter().collect();
                let req = CreateRequest {
                    tenant: tenant.clone(),
                    shape,
                    ttl: (r.ttl_seconds > 0).then(|| Duration::from_secs(r.ttl_seconds)),
                    request_id: non_empty(r.request_id),
                    labels,
                    priority_class: non_empty(r.priority_class),
                    gpu_index: r.gpu_index,
                    need,
                    count,
                    topology,
                };
                if asked_wait.is_zero() {
                    this.mgr.create(req).await.map_err(status)
                } else {
                    match this.mgr.create_queued(req, queue_wait).await {
                        Err(LeaseError::ResourceExhausted(m)) if cut_by_deadline => {
                            Err(Status::deadline_exceeded(m))
                        }
                        other => other.map_err(status),
                    }
                }
            }
            .await;
            let lease_id = result
                .as_ref()
                .map(|c| c.lease.id.clone())
                .unwrap_or_default();
            let r = result.map(|created| {
                Response::new(pb::CreateLeaseResponse {
                    lease: Some(lease_pb(
                        &this.mgr,
                        &created.lease,
                        created.partition.as_ref(),
                    )),
                    token: created.token.unwrap_or_default(),
                    replayed: created.replayed,
                })
            });
            this.done(Rpc::CreateLease, &who, &tenant, &lease_id, r)
        };
        if asked_wait.is_zero() {
            // Runs to the end even if the client goes away: a lease operation cut off
            // between its steps would stay half done.
            detached(body).await
        } else {
            // A caller that goes away leaves the queue; each try to create runs to its
            // end all the same (`create_queued`).
            body.await
        }
    }

    async fn renew_lease(
        &self,
        req: Request<pb::RenewLeaseRequest>,
    ) -> Result<Response<pb::RenewLeaseResponse>, Status> {
        let who = self.begin(Rpc::RenewLease, &req)?;
        // Runs to the end even if the client goes away: a lease operation cut off
        // between its steps would stay half done.
        let this = self.clone();
        detached(async move {
            let r = req.into_inner();
            let result = async {
                let tenant = this.check_lease_owner(&who, &r.lease_id)?;
                let ttl = (r.ttl_seconds > 0).then(|| Duration::from_secs(r.ttl_seconds));
                let lease = this.mgr.renew(&r.lease_id, ttl).await.map_err(status)?;
                let (l, p) = this.mgr.get(&lease.id).map_err(status)?;
                Ok((
                    tenant,
                    Response::new(pb::RenewLeaseResponse {
                        lease: Some(lease_pb(&this.mgr, &l, p.as_ref())),
                    }),
                ))
            }
            .await;
            let tenant = result.as_ref().map(|(t, _)| t.clone()).unwrap_or_default();
            this.done(
                Rpc::RenewLease,
                &who,
                &tenant,
                &r.lease_id,
                result.map(|(_, r)| r),
            )
        })
        .await
    }

    async fn release_lease(
        &self,
        req: Request<pb::ReleaseLeaseRequest>,
    ) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
        let who = self.begin(Rpc::ReleaseLease, &req)?;
        // Runs to the end even if the client goes away: a lease operation cut off
        // between its steps would stay half done.
        let this = self.clone();
        detached(async move {
            let r = req.into_inner();
            let result = async {
                // Validate first, then look anything up.
                if r.reason.len() > 1024 {
                    return Err(Status::invalid_argument(
                        "invalid reason: at most 1024 characters",
                    ));
                }
                let tenant = this.check_lease_owner(&who, &r.lease_id)?;
                let reason = if r.reason.is_empty() {
                    format!("released by {}", who.name())
                } else {
                    r.reason.clone()
                };
                let lease = this
                    .mgr
                    .end(&r.lease_id, crate::model::LeaseState::Released, &reason)
                    .await
                    .map_err(status)?;
                Ok((
                    tenant,
                    Response::new(pb::ReleaseLeaseResponse {
                        lease: Some(convert::lease_to_pb(&lease, None)),
                    }),
                ))
            }
            .await;
            let tenant = result.as_ref().map(|(t, _)| t.clone()).unwrap_or_default();
            this.done(
                Rpc::ReleaseLease,
                &who,
                &tenant,
                &r.lease_id,
                result.map(|(_, r)| r),
            )
        })
        .await
    }

    async fn get_lease(
        &self,
        req: Request<pb::GetLeaseRequest>,
    ) -> Result<Response<pb::GetLeaseResponse>, Status> {
        let who = self.begin(Rpc::GetLease, &req)?;
        let r = req.into_inner();
        let result = (|| {
            let tenant = self.check_lease_owner(&who, &r.lease_id)?;
            let (l, p) = self.mgr.get(&r.lease_id).map_err(status)?;
            Ok((
                tenant,
                Response::new(pb::GetLeaseResponse {
                    lease: Some(lease_pb(&self.mgr, &l, p.as_ref())),
                }),
            ))
        })();
        let tenant = result.as_ref().map(|(t, _)| t.clone()).unwrap_or_default();
        self.done(
            Rpc::GetLease,
            &who,
            &tenant,
            &r.lease_id,
            result.map(|(_, r)| r),
        )
    }

    async fn list_leases(
        &self,
        req: Request<pb::ListLeasesRequest>,
    ) -> Result<Response<pb::ListLeasesResponse>, Status> {
        let who = self.begin(Rpc::ListLeases, &req)?;
        let r = req.into_inner();
        let result = (|| {
            let tenant = self.scope(&who, &r.tenant)?;
            let state = convert::state_from_pb(r.state)?;
            let size = paging::page_size(r.page_size).map_err(|e| {
                rich(
                    tonic::Code::InvalidArgument,
                    e.to_string(),
                    "INVALID_ARGUMENT",
                    tonic_types::ErrorDetails::with_bad_request_violation(
                        "page_size",
                        e.to_string(),
                    ),
                )
            })?;
            let filter = paging::filter_hash(&tenant, r.state, r.include_ended);
            let cursor = if r.page_token.is_empty() {
                None
            } else {
                Some(self.tokens.open(&r.page_token, &filter).map_err(|e| {
                    rich(
                        tonic::Code::InvalidArgument,
                        e.to_string(),
                        "INVALID_ARGUMENT",
                        tonic_types::ErrorDetails::with_bad_request_violation(
                            "page_token",
                            e.to_string(),
                        ),
                    )
                })?)
            };
            let tenant = non_empty(tenant);
            let page = self
                .mgr
                .list_page(
                    tenant.as_deref(),
                    state,
                    r.include_ended,
                    cursor.as_ref().map(|c| &c.after),
                    size,
                )
                .map_err(status)?;
            // Every page of a listing answers its first page's revision: watched
            // from there, nothing changed while the pages were read is missed.
            let revision = cursor.as_ref().map_or(page.revision, |c| c.revision);
            // The page stops short of what any client takes by default (and of the
            // largest message the daemon sends).
            let budget = self
                .mgr
                .config()
                .api
                .max_send_message
                .min(DEFAULT_CLIENT_LIMIT)
                .saturating_sub(PAGE_HEADROOM);
            let mut leases = Vec::with_capacity(page.leases.len());
            let mut bytes = 0usize;
            let mut last = None;
            let mut cut = false;
            for (l, p) in &page.leases {
                let one = lease_pb(&self.mgr, l, p.as_ref());
                let n = prost::Message::encoded_len(&one) + 8;
                if !leases.is_empty() && bytes + n > budget {
                    cut = true;
                    break;
                }
                bytes += n;
                last = Some((l.created_at_ms, l.id.clone()));
                leases.push(one);
            }
            let next_page_token = match last {
                Some(key) if page.more || cut => self.tokens.issue(&filter, revision, &key),
                _ => String::new(),
            };
            Ok(Response::new(pb::ListLeasesResponse {
                leases,
                next_page_token,
                revision,
            }))
        })();
        self.done(Rpc::ListLeases, &who, &r.tenant, "", result)
    }

    type WatchLeasesStream = EventStream;

    async fn watch_leases(
        &self,
        req: Request<pb::WatchLeasesRequest>,
    ) -> Result<Response<Self::WatchLeasesStream>, Status> {
        let who = self.begin(Rpc::WatchLeases, &req)?;
        let r = req.into_inner();
        let tenant = match self.scope(&who, &r.tenant) {
            Ok(t) => non_empty(t),
            Err(st) => return self.done(Rpc::WatchLeases, &who, &r.tenant, "", Err(st)),
        };
        let since = (r.since_revision != 0).then_some(r.since_revision);
        let result = super::watch::start(&self.mgr, tenant.clone(), since, r.bookmarks);
        self.done(
            Rpc::WatchLeases,
            &who,
            tenant.as_deref().unwrap_or(""),
            "",
            result.map(Response::new),
        )
    }

    async fn resolve_token(
        &self,
        req: Request<pb::ResolveTokenRequest>,
    ) -> Result<Response<pb::ResolveTokenResponse>, Status> {
        let who = self.begin(Rpc::ResolveToken, &req)?;
        let r = req.into_inner();
        let result = self.mgr.resolve_token(&r.token).map_err(status);
        // A refusal is recorded against the token's lease too, when it has one.
        let (tenant, lease) = match &result {
            Ok(x) => (x.lease.tenant.clone(), x.lease.id.clone()),
            Err(_) => self.mgr.token_lease(&r.token).unwrap_or_default(),
        };
        let r = result.map(|x| Response::new(convert::resolved_to_pb(&x)));
        self.done(Rpc::ResolveToken, &who, &tenant, &lease, r)
    }

    async fn bind_container(
        &self,
        req: Request<pb::BindContainerRequest>,
    ) -> Result<Response<pb::BindContainerResponse>, Status> {
        let who = self.begin(Rpc::BindContainer, &req)?;
        if req.get_ref().admission_command.len() > 64 {
            return self.done(
                Rpc::BindContainer,
                &who,
                "",
                "",
                Err(Status::invalid_argument(
                    "admission_command: at most 64 bytes",
                )),
            );
        }
        // Runs to the end even if the client goes away: a lease operation cut off
        // between its steps would stay half done.
        let this = self.clone();
        detached(async move {
            let r = req.into_inner();
            let container_id = r.container_id.clone();
            // The answer the runtime judged the spec against must be the current one.
            let judged = r.resolved;
            let checked = judged.is_some();
            let check = |now: &Resolved| match &judged {
                Some(j) if !convert::same_resolution(j, &convert::resolved_to_pb(now)) => {
                    Err(LeaseError::ResolutionChanged(format!(
                        "lease {} changed since the runtime resolved its token (devices, environment, mounts, cgroup parent or pod): resolve again",
                        now.lease.id
                    )))
                }
                _ => Ok(()),
            };
            let result = this
                .mgr
                .bind_container_checked(
                    &r.token,
                    ContainerBinding {
                        id: r.container_id.clone(),
                        cgroup_path: r.cgroup_path,
                        runtime_root: r.runtime_root,
                        bound_at_ms: now_ms(),
                        termination_log: r.termination_log_path,
                        pod: r.pod,
                    },
                    r.uid,
                    check,
                )
                .await
                .map_err(status);
            // A refusal is recorded against the token's lease too, when it has one:
            // the audit log shows whose lease a refused container tried to use.
            let (tenant, lease) = match &result {
                Ok(l) => (l.tenant.clone(), l.id.clone()),
                Err(_) => this.mgr.token_lease(&r.token).unwrap_or_default(),
            };
            if result.is_ok() && !r.admission_command.is_empty() {
                this.record_admission(
                    &who,
                    tenant.clone(),
                    lease.clone(),
                    container_id.clone(),
                    r.admission_command.clone(),
                    true,
                    Vec::new(),
                );
            }
            let r = result.map(|l| {
                Response::new(pb::BindContainerResponse {
                    lease: Some(convert::lease_to_pb(&l, None)),
                    resolution_checked: checked,
                })
            });
            this.done_for(Rpc::BindContainer, &who, (&tenant, &lease), &container_id, r)
        })
        .await
    }

    async fn unbind_container(
        &self,
        req: Request<pb::UnbindContainerRequest>,
    ) -> Result<Response<pb::UnbindContainerResponse>, Status> {
        let who = self.begin(Rpc::UnbindContainer, &req)?;
        let r = req.into_inner();
        let result = self
            .mgr
            .unbind_container(
                &r.container_id,
                Some(r.runtime_root.as_str()).filter(|s| !s.is_empty()),
            )
            .await
            .map_err(status)
            .map(|()| Response::new(pb::UnbindContainerResponse {}));
        self.done_for(
            Rpc::UnbindContainer,
            &who,
            ("", ""),
            &r.container_id,
            result,
        )
    }

    async fn report_admission(
        &self,
        req: Request<pb::ReportAdmissionRequest>,
    ) -> Result<Response<pb::ReportAdmissionResponse>, Status> {
        let who = self.begin(Rpc::ReportAdmission, &req)?;
        let r = req.into_inner();
        if r.reasons.len() > 256
            || r.reasons.iter().any(|x| x.len() > 4096)
            || r.container_id.len() > 1024
            || r.command.len() > 64
        {
            return self.done(
                Rpc::ReportAdmission,
                &who,
                "",
                "",
                Err(Status::invalid_argument(
                    "invalid reasons: at most 256 reasons of 4096 bytes",
                )),
            );
        }
        // A container on several leases reports their ids joined with ',' (all of
        // one tenant: the runtime refuses a mix).
        let first = r.lease_id.split(',').next().unwrap_or_default();
        let tenant = self
            .mgr
            .get(first)
            .map(|(l, _)| l.tenant)
            .unwrap_or_default();
        self.count(Rpc::ReportAdmission, tonic::Code::Ok);
        self.record_admission(
            &who,
            tenant,
            r.lease_id,
            r.container_id,
            r.command,
            r.admitted,
            r.reasons,
        );
        Ok(Response::new(pb::ReportAdmissionResponse {}))
    }

    async fn get_usage(
        &self,
        req: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::GetUsageResponse>, Status> {
        let who = self.begin(Rpc::GetUsage, &req)?;
        let r = req.into_inner();
        let result = self
            .scope(&who, &r.tenant)
            .and_then(|tenant| {
                let q = pb::GetUsageRequest {
                    tenant,
                    ..r.clone()
                };
                usage_response(&self.mgr, &q)
            })
            .map(Response::new);
        self.done(Rpc::GetUsage, &who, &r.tenant, "", result)
    }

    async fn reload_config(
        &self,
        req: Request<pb::ReloadConfigRequest>,
    ) -> Result<Response<pb::ReloadConfigResponse>, Status> {
        let who = self.begin(Rpc::ReloadConfig, &req)?;
        let r = self
            .reload()
            .map(|message| Response::new(pb::ReloadConfigResponse { message }));
        self.done(Rpc::ReloadConfig, &who, "", "", r)
    }

    async fn grant_quota(
        &self,
        req: Request<pb::GrantQuotaRequest>,
    ) -> Result<Response<pb::GrantQuotaResponse>, Status> {
        let who = self.begin(Rpc::GrantQuota, &req)?;
        let r = req.into_inner();
        let extra = r.extra_burst.unwrap_or_default();
        let result = self
            .mgr
            .grant_quota(
                &r.tenant,
                Amounts {
                    mig_slices: extra.mig_slices,
                    mps_sm_percent: extra.mps_sm_percent,
                    memory_bytes: extra.memory_bytes,
                    whole_gpus: extra.whole_gpus,
                },
                r.expires_at_ms,
                &r.reason,
                who.name(),
            )
            .await
            .map_err(status)
            .map(|grant_id| Response::new(pb::GrantQuotaResponse { grant_id }));
        let grant = result
            .as_ref()
            .map(|g| g.get_ref().grant_id.clone())
            .unwrap_or_default();
        let out = self.done(Rpc::GrantQuota, &who, &r.tenant, "", result);
        if out.is_ok() {
            // The reason and the amounts are part of the audit trail.
            self.write_audit(Record {
                at_ms: now_ms(),
                source: "api".into(),
                principal: who.name().to_string(),
                tenant: r.tenant.clone(),
                action: "QuotaGranted".into(),
                lease: String::new(),
                container: String::new(),
                result: grant,
                reasons: vec![
                    r.reason.clone(),
                    format!(
                        "extra burst: {} MIG slices, {}% MPS SMs, {} bytes, {} whole GPUs until {}",
                        extra.mig_slices,
                        extra.mps_sm_percent,
                        extra.memory_bytes,
                        extra.whole_gpus,
                        r.expires_at_ms
                    ),
                ],
                oidc: who.oidc().cloned(),
            });
        }
        out
    }

    async fn set_gpu_health(
        &self,
        req: Request<pb::SetGpuHealthRequest>,
    ) -> Result<Response<pb::SetGpuHealthResponse>, Status> {
        let who = self.begin(Rpc::SetGpuHealth, &req)?;
        let this = self.clone();
        // Runs to the end even if the client goes away (a mark is a store write,
        // and, with on_unhealthy = "revoke", revocations).
        detached(async move {
            let r = req.into_inner();
            let result = async {
                let reason = r.reason.trim();
                if reason.is_empty() || reason.len() > 1024 {
                    return Err(Status::invalid_argument(
                        "invalid reason: required, at most 1024 characters (it goes to the audit log)",
                    ));
                }
                let changed = if r.healthy {
                    this.mgr
                        .mark_healthy(r.gpu_index, r.gi_id, HealthSource::Operator, reason)
                        .await
                        .map_err(status)?
                        .is_some()
                } else {
                    this.mgr
                        .mark_unhealthy(
                            r.gpu_index,
                            r.gi_id,
                            HealthCause::Operator {
                                reason: reason.to_string(),
                            },
                            HealthSource::Operator,
                        )
                        .await
                        .map_err(status)?
                };
                let gpu = this
                    .mgr
                    .node()
                    .iter()
                    .find(|g| g.info.index == r.gpu_index)
                    .map(convert::gpu_to_pb);
                Ok(Response::new(pb::SetGpuHealthResponse { gpu, changed }))
            }
            .await;
            let out = this.done(Rpc::SetGpuHealth, &who, "", "", result);
            if let Ok(resp) = &out {
                // What changed, and why, is part of the audit trail.
                let scope = match r.gi_id {
                    Some(gi) => format!("GPU {} instance {gi}", r.gpu_index),
                    None => format!("GPU {}", r.gpu_index),
                };
                let now = if r.healthy { "in service" } else { "out of service" };
                let what = if resp.get_ref().changed { "now" } else { "already" };
                this.write_audit(Record {
                    at_ms: now_ms(),
                    source: "api".into(),
                    principal: who.name().to_string(),
                    tenant: String::new(),
                    action: if r.healthy {
                        "GpuMarkedHealthy".into()
                    } else {
                        "GpuMarkedUnhealthy".into()
                    },
                    lease: String::new(),
                    container: String::new(),
                    result: format!("{scope} {what} {now}"),
                    reasons: vec![r.reason.clone()],
                    oidc: who.oidc().cloned(),
                });
            }
            out
        })
        .await
    }

    async fn get_quota(
        &self,
        req: Request<pb::GetQuotaRequest>,
    ) -> Result<Response<pb::GetQuotaResponse>, Status> {
        let who = self.begin(Rpc::GetQuota, &req)?;
        let r = req.into_inner();
        let result = self.scope(&who, &r.tenant).and_then(|tenant| {
            if tenant.is_empty() {
                return Err(Status::invalid_argument("invalid tenant: required"));
            }
            let (q, used, extra, class) = self.mgr.quota_of(&tenant);
            let q = q.ok_or_else(|| {
                Status::not_found(format!(
                    "tenant {tenant:?} has no quota on this node (quotas are off or it is not configured)"
                ))
            })?;
            Ok(Response::new(pb::GetQuotaResponse {
                tenant,
                guaranteed: Some(amounts_to_pb(q.guaranteed)),
                burst: Some(amounts_to_pb(crate::lease::quota::add(q.burst, extra))),
                used: Some(amounts_to_pb(used)),
                priority_class: class,
            }))
        });
        self.done(Rpc::GetQuota, &who, &r.tenant, "", result)
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
    #[error("reflection service: {0}")]
    Reflection(String),
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

async fn router(service: TesseraService) -> Result<tonic::service::Routes, ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<TesseraServer<TesseraService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let routes = tonic::service::Routes::new(health_service).add_service(reflection);
    Ok(match service.metrics.clone() {
        Some(m) => routes.add_service(timing::Timed::new(service.into_server(), m)),
        None => routes.add_service(service.into_server()),
    })
}

/// The start of tonic's answer to a request over the decode limit.
const TOO_LARGE: &str = "Error, decoded message length too large";

/// tonic answers a request over the decode limit with OUT_OF_RANGE; gRPC's status code
/// table gives RESOURCE_EXHAUSTED to "server max receive message size exceeded", and
/// that is what grpc-core and grpc-go servers answer, so clients written against them
/// see the code they expect. The message is kept. (The refusal comes before any
/// handler runs, so it is a trailers-only answer: the status is in the headers.)
fn too_large_is_resource_exhausted<B>(mut resp: http::Response<B>) -> http::Response<B> {
    if let Some(st) = Status::from_header_map(resp.headers())
        && st.code() == tonic::Code::OutOfRange
        && st.message().starts_with(TOO_LARGE)
    {
        let exhausted = Status::resource_exhausted(st.message());
        if exhausted.add_header(resp.headers_mut()).is_err() {
            resp.headers_mut().insert(
                "grpc-status",
                http::HeaderValue::from(tonic::Code::ResourceExhausted as i32),
            );
        }
    }
    resp
}

type TooLargeLayer = tower::util::MapResponseLayer<
    fn(http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body>,
>;

fn builder()
-> tonic::transport::Server<tower::layer::util::Stack<TooLargeLayer, tower::layer::util::Identity>>
{
    let map: fn(http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body> =
        too_large_is_resource_exhausted;
    tonic::transport::Server::builder()
        .concurrency_limit_per_connection(256)
        .max_concurrent_streams(Some(1024))
        .timeout(Duration::from_secs(120))
        .layer(tower::util::MapResponseLayer::new(map))
}

/// Serve the API (with grpc.health.v1 and reflection) on `listener` until `shutdown`.
pub async fn serve_unix(
    service: TesseraService,
    listener: tokio::net::UnixListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    use tokio_stream::StreamExt;
    // grpc-core clients (Python grpcio, C++, ...) send the socket path as :authority,
    // which h2 refuses: normalized before h2 reads it (see uds_authority).
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
        .map(|conn| conn.map(uds_authority::NormalizeAuthority::new));
    builder()
        .add_routes(router(service).await?)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

/// The mutual-TLS listener's material, read and checked: a certificate and key
/// that parse and match, and the CA client certificates must chain to.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    listen: std::net::SocketAddr,
    config: tonic::transport::ServerTlsConfig,
}

impl TlsMaterial {
    /// Read and check the files `[auth.tls]` names (before anything is touched).
    pub fn load(tls: &crate::config::TlsConfig, oidc: bool) -> Result<TlsMaterial, ServeError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| ServeError::Io {
                path: p.to_path_buf(),
                source,
            })
        };
        let identity = tonic::transport::Identity::from_pem(read(&tls.cert)?, read(&tls.key)?);
        let mut config = tonic::transport::ServerTlsConfig::new().identity(identity);
        // Without a client CA (only with [auth.oidc]) no certificate is asked for;
        // with one and [auth.oidc], a caller shows a certificate or a token.
        if let Some(ca) = &tls.client_ca {
            config = config
                .client_ca_root(tonic::transport::Certificate::from_pem(read(ca)?))
                .client_auth_optional(oidc);
        }
        // Building the server's TLS settings parses the certificate, the key and
        // the CA: a bad file fails here, not after the daemon said READY.
        builder().tls_config(config.clone())?;
        Ok(TlsMaterial {
            listen: tls.listen,
            config,
        })
    }

    /// Bind the TCP listener.
    pub async fn bind(self) -> Result<BoundTls, ServeError> {
        let listener = tokio::net::TcpListener::bind(self.listen)
            .await
            .map_err(|source| ServeError::Io {
                path: self.listen.to_string().into(),
                source,
            })?;
        Ok(BoundTls {
            material: self,
            listener,
        })
    }
}

/// A bound mutual-TLS listener, not yet serving.
#[derive(Debug)]
pub struct BoundTls {
    material: TlsMaterial,
    listener: tokio::net::TcpListener,
}

/// Serve the API over TCP with mutual TLS: the client must present a certificate
/// signed by `client_ca`; its common name selects the principal.
pub async fn serve_tls(
    service: TesseraService,
    tls: BoundTls,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    info!(listen = %tls.material.listen, "serving the tessera.v1 API over mutual TLS");
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(tls.listener);
    let oidc = super::oidc::OidcLayer::new(service.auth.oidc());
    builder()
        .tls_config(tls.material.config)?
        .layer(oidc)
        .add_routes(router(service).await?)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

/// GetUsage: usage per tenant (`tenant` empty = all; `to_ms` 0 = now).
fn usage_response(
    mgr: &LeaseManager,
    req: &pb::GetUsageRequest,
) -> Result<pb::GetUsageResponse, Status> {
    if req.from_ms < 0 || req.to_ms < 0 {
        return Err(Status::invalid_argument(
            "invalid window: from_ms and to_ms are unix milliseconds (0 = unbounded / now)",
        ));
    }
    let tenant = (!req.tenant.is_empty()).then_some(req.tenant.as_str());
    match mgr.usage(tenant, req.from_ms, req.to_ms) {
        Ok(rows) => Ok(pb::GetUsageResponse {
            usage: rows
                .into_iter()
                .map(|u| pb::TenantUsage {
                    tenant: u.tenant,
                    mig_slice_seconds: u.mig_slice_seconds,
                    mps_sm_percent_seconds: u.mps_sm_percent_seconds,
                    memory_gib_seconds: u.memory_gib_seconds,
                    whole_gpu_seconds: u.whole_gpu_seconds,
                    leases: u.leases,
                })
                .collect(),
        }),
        Err(e @ crate::usage::UsageError::BadWindow { .. }) => {
            Err(Status::invalid_argument(e.to_string()))
        }
        Err(e) => Err(Status::internal(format!("usage: {e}"))),
    }
}

/// A lease on the wire with every partition it holds (and, for several, how their
/// GPUs connect).
fn lease_pb(
    mgr: &LeaseManager,
    l: &crate::model::Lease,
    p: Option<&crate::model::Partition>,
) -> pb::Lease {
    let mut out = convert::lease_to_pb(l, p);
    if l.partition_count() > 1 {
        let (parts, links) = mgr.partitions_of(l);
        convert::add_partitions(&mut out, &parts, links.as_ref());
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_headers_are_read_as_deadlines() {
        let with = |v: &str| {
            let mut m = tonic::metadata::MetadataMap::new();
            m.insert("grpc-timeout", v.parse().unwrap());
            grpc_timeout(&m)
        };
        assert_eq!(with("300m"), Some(Duration::from_millis(300)));
        assert_eq!(with("2S"), Some(Duration::from_secs(2)));
        assert_eq!(with("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(with("5u"), Some(Duration::from_micros(5)));
        assert_eq!(with("12x"), None);
        assert_eq!(with("S"), None);
        assert_eq!(grpc_timeout(&tonic::metadata::MetadataMap::new()), None);
    }
}
