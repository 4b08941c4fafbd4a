//! The lease manager: admission, placement, write-ahead hardware changes, expiry,
//! revocation and reconciliation at start.
//!
//! Protocol for every hardware change (invariant 2 of DESIGN.md):
//! 1. reserve in memory (under the state lock) so no concurrent call takes the same
//!    placement or share;
//! 2. durably record the intent (lease + partition + intent row in one commit);
//! 3. change the hardware;
//! 4. durably record the outcome and finish the intent;
//! 5. publish in memory and acknowledge.
//!
//! A crash between any two steps leaves an open intent that [`LeaseManager::start`]
//! resolves: it adopts what the daemon created, undoes half-done work, and never
//! touches instances no record explains.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{Notify, broadcast};
use tracing::{info, warn};

use crate::config::{Amounts, Config, OnRelease, TenancyConfig, TenantQuota};
use crate::gpu::{GiProfile, GpuBackend, GpuError, GpuInfo, MigInstance, MpsSpec, NvmlCode};
use crate::partition::{
    self, GpuView, MpsShare, OccupiedMig, PlanDecision, PlanError, PlanOptions, Shape,
};
use crate::store::{LeaseQuery, Store, StoreError};

use super::devices::{self, Resolved};
use super::model::{
    ContainerBinding, Grant, IntentOp, Lease, LeaseState, MigPart, MpsPart, Origin, PartKind,
    Partition, PartitionState,
};
use super::{quota, token};

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("invalid {field}: {message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("the daemon is shutting down")]
    ShuttingDown,
    #[error("GPU: {0}")]
    Hardware(#[from] GpuError),
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("internal: {0}")]
    Internal(String),
}

impl From<PlanError> for LeaseError {
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::InvalidShape(m) => LeaseError::InvalidArgument {
                field: "shape",
                message: m,
            },
            e @ PlanError::UnknownProfile { .. } => LeaseError::InvalidArgument {
                field: "shape.mig.profile",
                message: e.to_string(),
            },
            PlanError::NoCapacity(m) => LeaseError::ResourceExhausted(m),
        }
    }
}

/// Kinds of lease events (WatchLeases).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Created,
    Renewed,
    Expiring,
    Released,
    Revoked,
    Revoking,
    Preempting,
    ContainerBound,
    ContainerUnbound,
    MpsRestarted,
}

#[derive(Debug, Clone)]
pub struct LeaseEvent {
    pub kind: EventKind,
    pub lease: Lease,
    pub partition: Option<Partition>,
    pub at_ms: i64,
    pub message: String,
}

#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    pub tenant: String,
    pub shape: Option<Shape>,
    pub ttl: Option<Duration>,
    pub request_id: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub priority_class: Option<String>,
    pub gpu_index: Option<u32>,
}

#[derive(Debug, Clone)]
pub struct Created {
    pub lease: Lease,
    pub partition: Option<Partition>,
    /// None when the lease was found ended on a retry (no token is issued then).
    pub token: Option<String>,
    pub replayed: bool,
}

/// One GPU as the manager knows it.
#[derive(Debug, Clone)]
pub struct GpuState {
    pub info: GpuInfo,
    pub profiles: Vec<GiProfile>,
}

/// A GPU with its partitions and free capacity (GetNode).
#[derive(Debug, Clone)]
pub struct GpuReport {
    pub info: GpuInfo,
    pub profiles: Vec<(GiProfile, u32)>,
    pub partitions: Vec<Partition>,
    pub mps_sm_percent_used: u32,
    pub mps_memory_used: u64,
    pub whole_leased: bool,
    pub free_slices: u32,
}

/// First wait before a failed teardown is tried again; it doubles per failure.
const TEARDOWN_RETRY_MS: i64 = 250;

#[derive(Default)]
struct State {
    gpus: Vec<GpuState>,
    leases: HashMap<String, Lease>,
    partitions: HashMap<String, Partition>,
    tokens: HashMap<String, String>,
    requests: HashMap<(String, String), String>,
    pending: HashMap<String, Arc<Notify>>,
    /// Leases whose teardown is running right now.
    tearing_down: HashSet<String>,
    /// Leases that were told they are close to expiry.
    expiring_notified: HashSet<String>,
    /// MIG instances no record explains (never touched, but occupied).
    foreign: Vec<MigInstance>,
    /// Guaranteed requests waiting for their preemptions to finish.
    preempting: usize,
    /// MPS control daemons found dead: lease -> (restarts so far, next try at ms).
    mps_backoff: HashMap<String, (u32, i64)>,
    /// Teardowns that failed (a busy instance, a container that will not die):
    /// lease -> (retries so far, next try at ms).
    teardown_backoff: HashMap<String, (u32, i64)>,
    /// When the MPS daemons were last checked.
    mps_checked_ms: i64,
}

pub struct LeaseManager {
    config: Config,
    backend: Arc<dyn GpuBackend>,
    store: Arc<Store>,
    state: Mutex<State>,
    events: broadcast::Sender<LeaseEvent>,
    shutting_down: std::sync::atomic::AtomicBool,
    /// Unix ms of the housekeeping loop's last completed pass (watchdog feed).
    heartbeat: std::sync::atomic::AtomicI64,
    tenancy: std::sync::RwLock<Arc<TenancyConfig>>,
    grants: Mutex<Vec<Grant>>,
}

impl std::fmt::Debug for LeaseManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseManager").finish_non_exhaustive()
    }
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// A new record id: the prefix, the creation time (ms, 12 hex digits) and 64 random
/// bits. Ids sort by creation, so the rows and index entries a batch of commits adds
/// land in the same few B-tree pages instead of one random page each (fewer pages
/// written per durable commit), and listings by id read oldest first.
fn new_id(prefix: &str) -> String {
    let ms = now_ms().max(0) as u64 & 0xffff_ffff_ffff;
    format!("{prefix}{ms:012x}{:016x}", rand::random::<u64>())
}

fn invalid(field: &'static str, message: impl Into<String>) -> LeaseError {
    LeaseError::InvalidArgument {
        field,
        message: message.into(),
    }
}

/// Tenant names: 1..=63 of [a-z0-9._-], starting with [a-z0-9] (fits a Kubernetes
/// namespace, which the runtime may bind tenants to).
pub fn validate_tenant(tenant: &str) -> Result<(), LeaseError> {
    let ok = !tenant.is_empty()
        && tenant.len() <= 63
        && tenant
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        && tenant
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(invalid(
            "tenant",
            format!(
                "{:?} must be 1-63 characters of a-z, 0-9, '.', '_' or '-', starting with a letter or digit",
                truncate(tenant, 80)
            ),
        ))
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        s.to_string()
    } else {
        let mut end = n;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &s[..end])
    }
}

/// Most bytes a lease's labels may take in all (keys and values). Every event of a
/// lease carries a copy of them, and the event buffer holds 4096 events.
const MAX_LABEL_BYTES: usize = 16 * 1024;

fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), LeaseError> {
    if labels.len() > 64 {
        return Err(invalid(
            "labels",
            format!("{} labels; at most 64", labels.len()),
        ));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= 253
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b));
        if !key_ok {
            return Err(invalid(
                "labels",
                format!(
                    "key {:?} must be 1-253 characters of A-Z, a-z, 0-9, '.', '_', '/', '-'",
                    truncate(k, 80)
                ),
            ));
        }
        if v.len() > 1024 || v.chars().any(char::is_control) {
            return Err(invalid(
                "labels",
                format!("value of {k:?} must be at most 1024 printable characters"),
            ));
        }
    }
    let total: usize = labels.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total > MAX_LABEL_BYTES {
        return Err(invalid(
            "labels",
            format!("{total} bytes of keys and values; at most {MAX_LABEL_BYTES} in all"),
        ));
    }
    Ok(())
}

/// Priority classes are names like tenants (1-63 of [a-z0-9._-]); the daemon keeps
/// one per lease and copies it into every event, so it must be short.
fn validate_priority_class(class: &str) -> Result<(), LeaseError> {
    validate_tenant(class).map_err(|_| {
        invalid(
            "priority_class",
            format!(
                "{:?} must be 1-63 characters of a-z, 0-9, '.', '_' or '-', starting with a letter or digit",
                truncate(class, 80)
            ),
        )
    })
}

fn validate_request_id(rid: &str) -> Result<(), LeaseError> {
    if rid.len() > 128 || rid.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(invalid(
            "request_id",
            "must be at most 128 characters without spaces or control characters",
        ));
    }
    Ok(())
}

/// Checks a create request without touching any state: tenant, shape present,
/// request id, labels, priority class and TTL (against `limits`; None = the default
/// TTL). Returns the shape and the TTL to use. Every refusal is
/// [`LeaseError::InvalidArgument`] naming its field. Whether the shape itself is
/// possible is the planner's question ([`partition::plan`]).
pub fn validate_create(
    req: &CreateRequest,
    limits: &crate::config::LeaseConfig,
) -> Result<(Shape, Duration), LeaseError> {
    validate_tenant(&req.tenant)?;
    let shape = req
        .shape
        .clone()
        .ok_or_else(|| invalid("shape", "one of mig, mps or whole_gpu is required"))?;
    if let Some(rid) = &req.request_id {
        validate_request_id(rid)?;
    }
    validate_labels(&req.labels)?;
    if let Some(class) = &req.priority_class {
        validate_priority_class(class)?;
    }
    let ttl = req.ttl.unwrap_or(limits.default_ttl);
    if ttl < limits.min_ttl || ttl > limits.max_ttl {
        return Err(invalid(
            "ttl_seconds",
            format!(
                "{}s is outside the allowed {}s..={}s",
                ttl.as_secs(),
                limits.min_ttl.as_secs(),
                limits.max_ttl.as_secs()
            ),
        ));
    }
    Ok((shape, ttl))
}

/// Why a reservation attempt has to be tried again (or answered otherwise).
enum Again {
    /// Preempt these leases, then plan again.
    Preempt(Vec<String>),
    /// Capacity is held by teardowns in progress: wait for them, then plan again.
    WaitTeardowns,
    /// A call with the same request id reserved first (and may still be creating).
    SameRequest(String, Option<tokio::sync::futures::OwnedNotified>),
}

/// A hardware step that follows a durable intent.
enum HwCreate {
    Mig {
        gpu: u32,
        gi_profile_id: u32,
        placement: crate::gpu::Placement,
        ci_profile_id: Option<u32>,
    },
    Mps(MpsSpec),
}

enum HwDestroy {
    Mig { gpu: u32, gi_id: u32 },
    Mps { lease_id: String },
}

impl LeaseManager {
    /// Load the store, reconcile it with the hardware, and set up the static layout.
    pub fn start(
        config: Config,
        backend: Arc<dyn GpuBackend>,
        store: Arc<Store>,
    ) -> Result<Arc<LeaseManager>, LeaseError> {
        let (events, _) = broadcast::channel(4096);
        let grants = store.grants()?;
        let mgr = Arc::new(LeaseManager {
            config: config.clone(),
            backend,
            store,
            state: Mutex::new(State::default()),
            events,
            shutting_down: std::sync::atomic::AtomicBool::new(false),
            heartbeat: std::sync::atomic::AtomicI64::new(now_ms()),
            tenancy: std::sync::RwLock::new(Arc::new(config.tenancy.clone())),
            grants: Mutex::new(Vec::new()),
        });
        *mgr.grants.lock().unwrap_or_else(|p| p.into_inner()) = grants;
        mgr.load_and_reconcile()?;
        mgr.ensure_static_layout()?;
        Ok(mgr)
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn backend(&self) -> &Arc<dyn GpuBackend> {
        &self.backend
    }

    /// Unix ms when the housekeeping loop last completed a pass.
    pub fn heartbeat_ms(&self) -> i64 {
        self.heartbeat.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn subscribe(&self) -> broadcast::Receiver<LeaseEvent> {
        self.events.subscribe()
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock would be a bug; keep serving with the data.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn emit(&self, kind: EventKind, lease: &Lease, partition: Option<&Partition>, msg: String) {
        let _ = self.events.send(LeaseEvent {
            kind,
            lease: lease.clone(),
            partition: partition.cloned(),
            at_ms: now_ms(),
            message: msg,
        });
    }

    fn plan_options(&self, gpu_index: Option<u32>) -> PlanOptions {
        PlanOptions {
            strategy: self.config.partition.strategy,
            mps_oversubscribe: self.config.partition.mps_oversubscribe,
            dynamic_mig: self.config.partition.dynamic_mig,
            gpu_index,
        }
    }

    fn views(st: &State) -> Vec<GpuView> {
        st.gpus
            .iter()
            .map(|g| {
                let idx = g.info.index;
                let mut mig = Vec::new();
                let mut mps = Vec::new();
                let mut whole = false;
                for p in st.partitions.values().filter(|p| p.gpu == idx) {
                    match &p.kind {
                        PartKind::Mig(m) => mig.push(OccupiedMig {
                            gi_profile_id: m.gi_profile_id,
                            placement: m.placement,
                            free_static: (p.lease_id.is_none() && p.state == PartitionState::Ready)
                                .then(|| p.id.clone()),
                        }),
                        PartKind::Mps(m) => mps.push(MpsShare {
                            sm_percent: m.sm_percent,
                            memory_bytes: m.memory_bytes,
                        }),
                        PartKind::WholeGpu => whole = true,
                    }
                }
                for f in st.foreign.iter().filter(|f| f.gpu == idx) {
                    mig.push(OccupiedMig {
                        gi_profile_id: f.gi_profile_id,
                        placement: f.placement,
                        free_static: None,
                    });
                }
                GpuView {
                    info: g.info.clone(),
                    profiles: g.profiles.clone(),
                    mig,
                    mps,
                    whole_leased: whole,
                }
            })
            .collect()
    }

    // ---------------------------------------------------------------- queries

    pub fn node(&self) -> Vec<GpuReport> {
        let st = self.lock();
        let views = Self::views(&st);
        views
            .iter()
            .map(|v| {
                let free = partition::free_capacity(v);
                let profiles = v
                    .profiles
                    .iter()
                    .map(|p| {
                        let n = free
                            .iter()
                            .find(|(id, _)| *id == p.id)
                            .map(|(_, n)| *n)
                            .unwrap_or(0);
                        (p.clone(), n)
                    })
                    .collect();
                let mut partitions: Vec<Partition> = st
                    .partitions
                    .values()
                    .filter(|p| p.gpu == v.info.index)
                    .cloned()
                    .collect();
                partitions.sort_by(|a, b| a.id.cmp(&b.id));
                let used = partition::used_memory_slices(v);
                GpuReport {
                    info: v.info.clone(),
                    profiles,
                    partitions,
                    mps_sm_percent_used: v.mps.iter().map(|m| m.sm_percent).sum(),
                    mps_memory_used: v.mps.iter().map(|m| m.memory_bytes).sum(),
                    whole_leased: v.whole_leased,
                    free_slices: if v.info.mig_current {
                        8u32.saturating_sub(used)
                    } else {
                        0
                    },
                }
            })
            .collect()
    }

    /// A lease (live from memory, ended from the store) with its partition.
    pub fn get(&self, id: &str) -> Result<(Lease, Option<Partition>), LeaseError> {
        {
            let st = self.lock();
            if let Some(l) = st.leases.get(id) {
                let p = st.partitions.get(&l.partition_id).cloned();
                return Ok((l.clone(), p));
            }
        }
        match self.store.get_lease(id)? {
            Some(l) => Ok((l, None)),
            None => Err(LeaseError::NotFound(format!(
                "no lease {:?}",
                truncate(id, 80)
            ))),
        }
    }

    pub fn list(
        &self,
        tenant: Option<&str>,
        state: Option<LeaseState>,
        include_ended: bool,
    ) -> Result<Vec<(Lease, Option<Partition>)>, LeaseError> {
        let live_only = state.is_none_or(LeaseState::is_live) && !include_ended;
        if live_only {
            let st = self.lock();
            let mut out: Vec<_> = st
                .leases
                .values()
                .filter(|l| tenant.is_none_or(|t| l.tenant == t))
                .filter(|l| state.is_none_or(|s| l.state == s))
                .map(|l| (l.clone(), st.partitions.get(&l.partition_id).cloned()))
                .collect();
            out.sort_by_key(|(l, _)| l.created_at_ms);
            return Ok(out);
        }
        let rows = self.store.list_leases(&LeaseQuery {
            tenant: tenant.map(String::from),
            state,
            limit: 1000,
        })?;
        let st = self.lock();
        Ok(rows
            .into_iter()
            .map(|l| {
                // Prefer the in-memory copy of live leases (it is newer).
                let l = st.leases.get(&l.id).cloned().unwrap_or(l);
                let p = st.partitions.get(&l.partition_id).cloned();
                (l, p)
            })
            .collect())
    }

    // ---------------------------------------------------------------- create

    pub async fn create(&self, req: CreateRequest) -> Result<Created, LeaseError> {
        if self.shutting_down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(LeaseError::ShuttingDown);
        }
        let (shape, ttl) = validate_create(&req, &self.config.lease)?;
        let priority_class = req.priority_class.clone().unwrap_or_default();

        // Idempotent retries: an existing lease for (tenant, request_id). A live
        // one is in memory (reserved there before it reaches the store); an ended
        // one only in the store. The memory check and the store read are not one
        // atomic step: a first call can reserve and write its lease between them,
        // so a live lease read from the store sends this call back to the memory
        // check (where it waits for, or replays, that first call) rather than
        // being answered as an ended lease without a token.
        if let Some(rid) = &req.request_id {
            let key = (req.tenant.clone(), rid.clone());
            let mut rounds = 0u32;
            loop {
                let wait = {
                    let st = self.lock();
                    match st.requests.get(&key).cloned() {
                        None => None,
                        Some(lid) => match st.pending.get(&lid) {
                            Some(n) => Some(Ok(n.clone().notified_owned())),
                            None => Some(Err(lid)),
                        },
                    }
                };
                match wait {
                    Some(Ok(notified)) => {
                        notified.await;
                        continue;
                    }
                    Some(Err(lid)) => return self.replay(&lid).await,
                    None => {}
                }
                match self.store.find_by_request(&req.tenant, rid)? {
                    None => break,
                    Some(l) if l.state.is_live() => {
                        // Reserved and written since the memory check, or ended
                        // and not yet written as ended: look again.
                        rounds += 1;
                        if rounds > 100 {
                            return Err(LeaseError::FailedPrecondition(format!(
                                "lease {} for this request_id is changing state; retry",
                                l.id
                            )));
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Some(l) => {
                        return Ok(Created {
                            lease: l,
                            partition: None,
                            token: None,
                            replayed: true,
                        });
                    }
                }
            }
        }

        let now = now_ms();
        let lease_id = new_id("l-");
        let partition_id = new_id("p-");
        let tok = token::generate();
        let tok_hash = token::hash(&tok);
        let notify = Arc::new(Notify::new());

        // 1. Admission and reservation under the lock. A request within its
        //    tenant's guarantee that does not fit may preempt burst leases of other
        //    tenants once, then it is planned again.
        let tenancy = self.tenancy();
        let priority_class = if priority_class.is_empty() {
            tenancy
                .tenants
                .get(&req.tenant)
                .map(|q| q.priority_class.clone())
                .unwrap_or_else(|| tenancy.default_priority_class.clone())
        } else {
            priority_class
        };
        if !tenancy.priority_classes.contains_key(&priority_class) {
            return Err(invalid(
                "priority_class",
                format!(
                    "{:?} is not one of {}",
                    truncate(&priority_class, 64),
                    tenancy
                        .priority_classes
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        if let Some(q) = tenancy.tenants.get(&req.tenant)
            && quota::priority(&tenancy, &priority_class)
                > quota::priority(&tenancy, &q.priority_class)
        {
            return Err(LeaseError::PermissionDenied(format!(
                "tenant {:?} may use priority classes up to {:?}, not {priority_class:?}",
                req.tenant, q.priority_class
            )));
        }
        let request_amounts = quota::amounts_of(&shape);
        let extra = self.grants_extra(&req.tenant, now);
        let mut preempt_rounds = 0;
        let mut holding_capacity = false;
        let (lease, partition, hw) = loop {
            #[allow(clippy::type_complexity)]
            let step: Result<(Lease, Partition, Option<HwCreate>), Again> = 'reserve: {
                let mut st = self.lock();
                if std::mem::take(&mut holding_capacity) {
                    st.preempting = st.preempting.saturating_sub(1);
                }
                // A concurrent call with the same request id got here first.
                if let Some(rid) = &req.request_id
                    && let Some(lid) = st.requests.get(&(req.tenant.clone(), rid.clone())).cloned()
                {
                    let pending = st.pending.get(&lid).map(|n| n.clone().notified_owned());
                    break 'reserve Err(Again::SameRequest(lid, pending));
                }
                let used = st
                    .leases
                    .values()
                    .filter(|l| l.tenant == req.tenant && l.state.is_live())
                    .fold(Default::default(), |acc, l| {
                        quota::add(acc, quota::amounts_of(&l.shape))
                    });
                let admission = quota::admit(&tenancy, &req.tenant, used, request_amounts, extra)
                    .map_err(LeaseError::ResourceExhausted)?;
                if admission == quota::Admission::Burst && st.preempting > 0 {
                    // Capacity being freed by a preemption belongs to the guaranteed
                    // request that caused it, not to a burst request racing it.
                    return Err(LeaseError::ResourceExhausted(
                        "capacity is being freed for another tenant's guaranteed request; burst requests wait".into(),
                    ));
                }
                let views = Self::views(&st);
                let opts = self.plan_options(req.gpu_index);
                let decision = match partition::plan(&shape, &views, &opts) {
                    Ok(d) => d,
                    Err(PlanError::NoCapacity(msg))
                        if admission == quota::Admission::Guaranteed
                            && tenancy.preemption
                            && !tenancy.tenants.is_empty()
                            && preempt_rounds < 3 =>
                    {
                        let victims = Self::pick_victims(&st, &tenancy, &req.tenant, &shape, &opts);
                        if victims.is_empty() {
                            // Capacity held by leases being torn down right now
                            // comes back in a moment: wait for that, then retry.
                            if st.tearing_down.is_empty() {
                                return Err(LeaseError::ResourceExhausted(msg));
                            }
                            st.preempting += 1;
                            break 'reserve Err(Again::WaitTeardowns);
                        }
                        st.preempting += 1;
                        break 'reserve Err(Again::Preempt(victims));
                    }
                    Err(e) => return Err(e.into()),
                };
                let gpu_index = match &decision {
                    PlanDecision::NewMig { gpu, .. }
                    | PlanDecision::Static { gpu, .. }
                    | PlanDecision::Mps { gpu }
                    | PlanDecision::WholeGpu { gpu } => *gpu,
                };
                let gpu = st
                    .gpus
                    .iter()
                    .find(|g| g.info.index == gpu_index)
                    .cloned()
                    .ok_or_else(|| {
                        LeaseError::Internal(format!("planner chose unknown GPU {gpu_index}"))
                    })?;
                let (partition, hw) = match decision {
                    PlanDecision::NewMig {
                        gpu: g,
                        gi_profile_id,
                        placement,
                        ci_profile_id,
                    } => {
                        let prof = gpu
                            .profiles
                            .iter()
                            .find(|p| p.id == gi_profile_id)
                            .ok_or_else(|| {
                                LeaseError::Internal("planner chose unknown profile".into())
                            })?;
                        let ci = ci_profile_id
                            .and_then(|id| prof.ci_profiles.iter().find(|c| c.id == id));
                        let p = Partition {
                            id: partition_id.clone(),
                            gpu: g,
                            gpu_uuid: gpu.info.uuid.clone(),
                            origin: Origin::Dynamic,
                            state: PartitionState::Creating,
                            lease_id: Some(lease_id.clone()),
                            kind: PartKind::Mig(MigPart {
                                gi_profile_id,
                                profile: prof.name.clone(),
                                placement,
                                ci_profile_id,
                                compute_profile: ci.map(|c| c.name.clone()),
                                gi_id: None,
                                ci_id: None,
                                uuid: None,
                                memory_bytes: prof.memory_bytes,
                                sm_count: ci.map(|c| c.sm_count).unwrap_or(prof.sm_count),
                                slices: prof.slices,
                            }),
                        };
                        (
                            p,
                            Some(HwCreate::Mig {
                                gpu: g,
                                gi_profile_id,
                                placement,
                                ci_profile_id,
                            }),
                        )
                    }
                    PlanDecision::Static {
                        partition_id: pid, ..
                    } => {
                        let mut p = st.partitions.get(&pid).cloned().ok_or_else(|| {
                            LeaseError::Internal(format!("planner chose unknown partition {pid}"))
                        })?;
                        p.lease_id = Some(lease_id.clone());
                        (p, None)
                    }
                    PlanDecision::Mps { gpu: g } => {
                        let Shape::Mps {
                            sm_percent,
                            memory_bytes,
                        } = shape
                        else {
                            return Err(LeaseError::Internal(
                                "MPS decision for a non-MPS shape".into(),
                            ));
                        };
                        let base = self.config.daemon.run_dir.join("mps").join(&lease_id);
                        let spec = MpsSpec {
                            lease_id: lease_id.clone(),
                            gpu: g,
                            gpu_uuid: gpu.info.uuid.clone(),
                            sm_percent,
                            memory_bytes,
                            pipe_dir: base.join("pipe"),
                            log_dir: base.join("log"),
                            owner_uid: None,
                        };
                        let p = Partition {
                            id: partition_id.clone(),
                            gpu: g,
                            gpu_uuid: gpu.info.uuid.clone(),
                            origin: Origin::Dynamic,
                            state: PartitionState::Creating,
                            lease_id: Some(lease_id.clone()),
                            kind: PartKind::Mps(MpsPart {
                                sm_percent,
                                memory_bytes,
                                pipe_dir: spec.pipe_dir.clone(),
                                log_dir: spec.log_dir.clone(),
                                owner_uid: None,
                            }),
                        };
                        (p, Some(HwCreate::Mps(spec)))
                    }
                    PlanDecision::WholeGpu { gpu: g } => (
                        Partition {
                            id: partition_id.clone(),
                            gpu: g,
                            gpu_uuid: gpu.info.uuid.clone(),
                            origin: Origin::Dynamic,
                            state: PartitionState::Ready,
                            lease_id: Some(lease_id.clone()),
                            kind: PartKind::WholeGpu,
                        },
                        None,
                    ),
                };
                let lease = Lease {
                    id: lease_id.clone(),
                    tenant: req.tenant.clone(),
                    state: if hw.is_some() {
                        LeaseState::Pending
                    } else {
                        LeaseState::Active
                    },
                    shape: shape.clone(),
                    partition_id: partition.id.clone(),
                    gpu: partition.gpu,
                    created_at_ms: now,
                    expires_at_ms: now + ttl.as_millis() as i64,
                    ttl_secs: ttl.as_secs(),
                    request_id: req.request_id.clone(),
                    labels: req.labels.clone(),
                    priority_class: priority_class.clone(),
                    burst: admission == quota::Admission::Burst,
                    ending_as: None,
                    end_reason: None,
                    ended_at_ms: None,
                    containers: vec![],
                };
                st.partitions
                    .insert(partition.id.clone(), partition.clone());
                st.leases.insert(lease.id.clone(), lease.clone());
                if let Some(rid) = &lease.request_id {
                    st.requests
                        .insert((lease.tenant.clone(), rid.clone()), lease.id.clone());
                }
                st.pending.insert(lease.id.clone(), notify.clone());
                Ok((lease, partition, hw))
            };
            match step {
                Ok(r) => break r,
                Err(Again::Preempt(victims)) => {
                    preempt_rounds += 1;
                    holding_capacity = true;
                    self.preempt(&victims, &req.tenant).await;
                }
                Err(Again::WaitTeardowns) => {
                    preempt_rounds += 1;
                    holding_capacity = true;
                    self.wait_for_teardowns(Duration::from_secs(5)).await;
                }
                Err(Again::SameRequest(lid, pending)) => match pending {
                    // Still being created: wait, then answer as a retry would.
                    Some(done) => {
                        done.await;
                        return Box::pin(self.create(req)).await;
                    }
                    None => return self.replay(&lid).await,
                },
            }
        };

        // 2. Durable intent (or, without hardware work, the final record).
        let op = match &hw {
            Some(HwCreate::Mig { .. }) => Some(IntentOp::CreateMig),
            Some(HwCreate::Mps(_)) => Some(IntentOp::StartMps),
            None => None,
        };
        let (l2, p2, h2) = (lease.clone(), partition.clone(), tok_hash.clone());
        let intent = self
            .store
            .write(move |w| {
                w.put_lease(&l2)?;
                w.put_partition(&p2)?;
                w.add_token(&h2, &l2.id, now)?;
                op.map(|op| w.begin_intent(op, &p2.id, Some(&l2.id), now))
                    .transpose()
            })
            .await;
        let intent = match intent {
            Ok(i) => i,
            Err(e) => {
                self.forget_reservation(&lease, &partition, true);
                return Err(match e {
                    StoreError::DuplicateRequest { .. } => LeaseError::FailedPrecondition(
                        "a lease with this request_id is being created concurrently; retry".into(),
                    ),
                    e => e.into(),
                });
            }
        };

        let Some(hw) = hw else {
            // Static-pool partition or whole GPU: nothing to change on the hardware.
            let mut st = self.lock();
            st.tokens.insert(tok_hash, lease.id.clone());
            if let Some(n) = st.pending.remove(&lease.id) {
                n.notify_waiters();
            }
            drop(st);
            self.emit(EventKind::Created, &lease, Some(&partition), String::new());
            info!(lease = %lease.id, tenant = %lease.tenant, gpu = lease.gpu, "lease created");
            return Ok(Created {
                lease,
                partition: Some(partition),
                token: Some(tok),
                replayed: false,
            });
        };
        let intent = intent.ok_or_else(|| LeaseError::Internal("intent id missing".into()))?;

        // 3. Hardware.
        let result = self.hw_create(hw).await;

        // 4. Outcome.
        let mut lease = lease;
        let mut partition = partition;
        let now = now_ms();
        match result {
            Ok(inst) => {
                partition.state = PartitionState::Ready;
                if let (PartKind::Mig(m), Some(inst)) = (&mut partition.kind, inst) {
                    m.gi_id = Some(inst.gi_id);
                    m.ci_id = inst.ci_id;
                    m.uuid = Some(inst.uuid);
                }
                lease.state = LeaseState::Active;
                let (l2, p2) = (lease.clone(), partition.clone());
                let res = self
                    .store
                    .write(move |w| {
                        w.put_partition(&p2)?;
                        w.put_lease(&l2)?;
                        w.finish_intent(intent, now, "done")
                    })
                    .await;
                if let Err(e) = res {
                    // The hardware exists and the intent stays open: the next start
                    // reconciles it. Keep the reservation so nothing else takes it.
                    return Err(e.into());
                }
                let mut st = self.lock();
                st.partitions
                    .insert(partition.id.clone(), partition.clone());
                st.leases.insert(lease.id.clone(), lease.clone());
                st.tokens.insert(tok_hash, lease.id.clone());
                if let Some(n) = st.pending.remove(&lease.id) {
                    n.notify_waiters();
                }
                drop(st);
                self.emit(EventKind::Created, &lease, Some(&partition), String::new());
                info!(lease = %lease.id, tenant = %lease.tenant, gpu = lease.gpu, "lease created");
                Ok(Created {
                    lease,
                    partition: Some(partition),
                    token: Some(tok),
                    replayed: false,
                })
            }
            Err(e) => {
                lease.state = LeaseState::Failed;
                lease.end_reason = Some(format!("hardware set-up failed: {e}"));
                lease.ended_at_ms = Some(now);
                // A create can fail after its GI exists (an error between the GI and
                // the CI step without rollback): destroy that GI before giving the
                // placement back. If that fails too, the partition row keeps the
                // placement and the intent stays open for the next start to undo.
                let undone = match &partition.kind {
                    PartKind::Mig(m) => self.undo_half_create(partition.gpu, m).await,
                    _ => Ok(()),
                };
                let mut orphan = partition.clone();
                orphan.lease_id = None;
                let (l2, p2, keep) = (lease.clone(), orphan.clone(), undone.is_err());
                let res = self
                    .store
                    .write(move |w| {
                        w.put_lease(&l2)?;
                        w.delete_tokens(&l2.id)?;
                        if keep {
                            return w.put_partition(&p2);
                        }
                        w.delete_partition(&p2.id)?;
                        w.finish_intent(intent, now, "failed")
                    })
                    .await;
                if res.is_ok() {
                    self.forget_reservation(&lease, &partition, false);
                    if let Err(u) = undone {
                        warn!(lease = %lease.id, gpu = partition.gpu, error = %u,
                            "could not destroy the GI of a failed create; the next start undoes it");
                        self.lock().partitions.insert(orphan.id.clone(), orphan);
                    }
                }
                Err(match e.nvml_code() {
                    Some(NvmlCode::InsufficientResources) => LeaseError::ResourceExhausted(
                        format!("GPU {} has no room for this instance: {e}", partition.gpu),
                    ),
                    _ => LeaseError::Hardware(e),
                })
            }
        }
    }

    /// Destroy the GI a failed create left without its CI at the placement this
    /// create reserved (nothing else can be there).
    async fn undo_half_create(&self, gpu: u32, m: &MigPart) -> Result<(), GpuError> {
        let backend = self.backend.clone();
        let (placement, profile) = (m.placement, m.gi_profile_id);
        let run = move || {
            let half = backend.instances(gpu)?.into_iter().find(|i| {
                i.placement == placement && i.gi_profile_id == profile && i.ci_id.is_none()
            });
            match half {
                Some(i) => backend.destroy_instance(gpu, i.gi_id),
                None => Ok(()),
            }
        };
        tokio::task::spawn_blocking(run)
            .await
            .map_err(|e| GpuError::Task(e.to_string()))?
    }

    fn forget_reservation(&self, lease: &Lease, partition: &Partition, undo_static: bool) {
        let mut st = self.lock();
        st.leases.remove(&lease.id);
        if let Some(rid) = &lease.request_id {
            st.requests.remove(&(lease.tenant.clone(), rid.clone()));
        }
        if partition.origin == Origin::Static && undo_static {
            if let Some(p) = st.partitions.get_mut(&partition.id) {
                p.lease_id = None;
            }
        } else {
            st.partitions.remove(&partition.id);
        }
        if let Some(n) = st.pending.remove(&lease.id) {
            n.notify_waiters();
        }
    }

    async fn replay(&self, lease_id: &str) -> Result<Created, LeaseError> {
        let (lease, partition) = self.get(lease_id)?;
        if !lease.state.is_live() {
            return Ok(Created {
                lease,
                partition,
                token: None,
                replayed: true,
            });
        }
        let tok = token::generate();
        let h = token::hash(&tok);
        let (h2, lid) = (h.clone(), lease.id.clone());
        let now = now_ms();
        self.store
            .write(move |w| w.add_token(&h2, &lid, now))
            .await?;
        self.lock().tokens.insert(h, lease.id.clone());
        Ok(Created {
            lease,
            partition,
            token: Some(tok),
            replayed: true,
        })
    }

    async fn hw_create(&self, hw: HwCreate) -> Result<Option<MigInstance>, GpuError> {
        let backend = self.backend.clone();
        let quick = matches!(hw, HwCreate::Mig { .. }) && backend.instance_calls_are_quick();
        let run = move || match hw {
            HwCreate::Mig {
                gpu,
                gi_profile_id,
                placement,
                ci_profile_id,
            } => backend
                .create_instance(gpu, gi_profile_id, placement, ci_profile_id)
                .map(Some),
            HwCreate::Mps(spec) => {
                for dir in [&spec.pipe_dir, &spec.log_dir] {
                    create_private_dir(dir)?;
                }
                backend.mps_start(&spec).map(|_| None)
            }
        };
        if quick {
            return run();
        }
        tokio::task::spawn_blocking(run)
            .await
            .map_err(|e| GpuError::Task(e.to_string()))?
    }

    // ---------------------------------------------------------------- tenancy

    /// The tenancy policy in force (quotas, priority classes); replaced on reload.
    pub fn tenancy(&self) -> Arc<TenancyConfig> {
        self.tenancy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replace quotas and priority classes (SIGHUP, ReloadConfig). Live leases keep
    /// running; the new quotas apply to the next request.
    pub fn set_tenancy(&self, t: TenancyConfig) {
        *self.tenancy.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(t);
    }

    fn grants_extra(&self, tenant: &str, now: i64) -> Amounts {
        self.grants
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|g| g.tenant == tenant && g.expires_at_ms > now)
            .fold(Amounts::default(), |acc, g| quota::add(acc, g.extra))
    }

    /// Record a temporary quota raise (durably). Returns its id.
    pub async fn grant_quota(
        &self,
        tenant: &str,
        extra: Amounts,
        expires_at_ms: i64,
        reason: &str,
        granted_by: &str,
    ) -> Result<String, LeaseError> {
        validate_tenant(tenant)?;
        let now = now_ms();
        if expires_at_ms <= now {
            return Err(invalid("expires_at_ms", "must lie in the future"));
        }
        if expires_at_ms - now > 90 * 24 * 3_600_000 {
            return Err(invalid("expires_at_ms", "a grant may last at most 90 days"));
        }
        if reason.trim().is_empty() || reason.len() > 1024 {
            return Err(invalid("reason", "must be 1-1024 characters"));
        }
        if extra == Amounts::default() {
            return Err(invalid("extra_burst", "grants nothing"));
        }
        if !self.tenancy().tenants.contains_key(tenant) {
            return Err(LeaseError::NotFound(format!(
                "tenant {tenant:?} has no quota on this node"
            )));
        }
        let g = Grant {
            id: new_id("g-"),
            tenant: tenant.to_string(),
            extra,
            expires_at_ms,
            reason: reason.to_string(),
            granted_by: granted_by.to_string(),
            created_at_ms: now,
        };
        let g2 = g.clone();
        self.store.write(move |w| w.put_grant(&g2)).await?;
        let id = g.id.clone();
        self.grants
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(g);
        info!(grant = %id, tenant, "temporary quota raise granted");
        Ok(id)
    }

    /// A tenant's quota (None when quotas are off), what its live leases use, and
    /// its active temporary grants.
    pub fn quota_of(&self, tenant: &str) -> (Option<TenantQuota>, Amounts, Amounts, String) {
        let t = self.tenancy();
        let used = self
            .lock()
            .leases
            .values()
            .filter(|l| l.tenant == tenant && l.state.is_live())
            .fold(Amounts::default(), |acc, l| {
                quota::add(acc, quota::amounts_of(&l.shape))
            });
        let q = t.tenants.get(tenant).cloned();
        let class = q
            .as_ref()
            .map(|q| q.priority_class.clone())
            .unwrap_or_else(|| t.default_priority_class.clone());
        (q, used, self.grants_extra(tenant, now_ms()), class)
    }

    /// The smallest set of preemptible leases (in victim order) whose partitions,
    /// once freed, let `shape` be placed. Empty when no such set exists.
    fn pick_victims(
        st: &State,
        tenancy: &TenancyConfig,
        tenant: &str,
        shape: &Shape,
        opts: &PlanOptions,
    ) -> Vec<String> {
        // Pending leases count too: a burst lease still being created holds
        // capacity; it is preempted once its creation finishes.
        let live: Vec<&Lease> = st
            .leases
            .values()
            .filter(|l| matches!(l.state, LeaseState::Active | LeaseState::Pending))
            .collect();
        let order = quota::victims_in_order(tenancy, tenant, &live);
        let mut views = Self::views(st);
        let mut chosen = Vec::new();
        for v in order {
            let Some(p) = st.partitions.get(&v.partition_id) else {
                continue;
            };
            let Some(view) = views.iter_mut().find(|g| g.info.index == p.gpu) else {
                continue;
            };
            match &p.kind {
                PartKind::Mig(m) => {
                    if let Some(i) = view.mig.iter().position(|o| o.placement == m.placement) {
                        if p.origin == Origin::Static {
                            view.mig[i].free_static = Some(p.id.clone());
                        } else {
                            view.mig.remove(i);
                        }
                    }
                }
                PartKind::Mps(m) => {
                    if let Some(i) = view.mps.iter().position(|s| {
                        s.sm_percent == m.sm_percent && s.memory_bytes == m.memory_bytes
                    }) {
                        view.mps.remove(i);
                    }
                }
                PartKind::WholeGpu => view.whole_leased = false,
            }
            chosen.push(v.id.clone());
            if partition::plan(shape, &views, opts).is_ok() {
                return chosen;
            }
        }
        Vec::new()
    }

    /// Wait (at most `limit`) until the teardowns running now have finished.
    async fn wait_for_teardowns(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        let mut rx = self.events.subscribe();
        loop {
            let busy: HashSet<String> = self.lock().tearing_down.clone();
            if busy.is_empty() {
                return;
            }
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Err(_) => return,
                Ok(Err(broadcast::error::RecvError::Closed)) => return,
                Ok(_) => {}
            }
        }
    }

    /// Preempt leases (with notice on WatchLeases), waiting for their teardown.
    async fn preempt(&self, victims: &[String], for_tenant: &str) {
        let grace = self.config.lease.revocation_grace;
        for id in victims {
            // A victim still being created is preempted once it exists.
            let pending = {
                let st = self.lock();
                st.pending.get(id).map(|n| n.clone().notified_owned())
            };
            if let Some(done) = pending {
                let _ = tokio::time::timeout(Duration::from_secs(60), done).await;
            }
            let Ok((lease, _)) = self.get(id) else {
                continue;
            };
            self.emit(
                EventKind::Preempting,
                &lease,
                None,
                format!(
                    "preempted: tenant {for_tenant:?} needs capacity within its guarantee; containers get {}s to stop",
                    grace.as_secs()
                ),
            );
            let reason = format!("preempted for tenant {for_tenant:?} (burst lease)");
            match self.end(id, LeaseState::Revoked, &reason).await {
                Ok(_) => info!(lease = %id, for_tenant, "lease preempted"),
                Err(e) => warn!(lease = %id, error = %e, "preemption failed"),
            }
        }
    }

    // ---------------------------------------------------------------- renew

    pub async fn renew(&self, id: &str, ttl: Option<Duration>) -> Result<Lease, LeaseError> {
        let lease = {
            let mut st = self.lock();
            let lease = st.leases.get_mut(id).ok_or_else(|| {
                LeaseError::NotFound(format!("no live lease {:?}", truncate(id, 80)))
            })?;
            if lease.state != LeaseState::Active {
                return Err(LeaseError::FailedPrecondition(format!(
                    "lease {id} is {}, only active leases can be renewed",
                    lease.state.as_str()
                )));
            }
            let ttl = ttl.unwrap_or(Duration::from_secs(lease.ttl_secs));
            if ttl < self.config.lease.min_ttl || ttl > self.config.lease.max_ttl {
                return Err(invalid(
                    "ttl_seconds",
                    format!(
                        "{}s is outside the allowed {}s..={}s",
                        ttl.as_secs(),
                        self.config.lease.min_ttl.as_secs(),
                        self.config.lease.max_ttl.as_secs()
                    ),
                ));
            }
            lease.expires_at_ms = now_ms() + ttl.as_millis() as i64;
            lease.ttl_secs = ttl.as_secs();
            let l = lease.clone();
            st.expiring_notified.remove(id);
            l
        };
        let l2 = lease.clone();
        self.store.write(move |w| w.put_lease(&l2)).await?;
        self.emit(EventKind::Renewed, &lease, None, String::new());
        Ok(lease)
    }

    // ---------------------------------------------------------------- end

    /// Release (tenant), expire (TTL) or revoke (admin, preemption) a lease. Returns
    /// the lease as it is afterwards: ended, or `revoking` when teardown must be
    /// retried (it then finishes in the background).
    pub async fn end(
        &self,
        id: &str,
        ending_as: LeaseState,
        reason: &str,
    ) -> Result<Lease, LeaseError> {
        let (lease, partition, teardown) = {
            let mut st = self.lock();
            let Some(lease) = st.leases.get(id).cloned() else {
                // Already ended: releasing twice is not an error.
                return match self.store.get_lease(id)? {
                    Some(l) => Ok(l),
                    None => Err(LeaseError::NotFound(format!(
                        "no lease {:?}",
                        truncate(id, 80)
                    ))),
                };
            };
            match lease.state {
                LeaseState::Pending => {
                    return Err(LeaseError::FailedPrecondition(format!(
                        "lease {id} is still being created; retry in a moment"
                    )));
                }
                LeaseState::Revoking => return Ok(lease),
                _ => {}
            }
            if st.tearing_down.contains(id) {
                return Ok(lease);
            }
            let partition = st
                .partitions
                .get(&lease.partition_id)
                .cloned()
                .ok_or_else(|| LeaseError::Internal(format!("lease {id} has no partition")))?;
            let teardown = self.teardown_for(&partition);
            let l = st
                .leases
                .get_mut(id)
                .ok_or_else(|| LeaseError::Internal("vanished".into()))?;
            l.state = LeaseState::Revoking;
            l.ending_as = Some(ending_as);
            l.end_reason = Some(reason.to_string());
            let lease = l.clone();
            st.tearing_down.insert(id.to_string());
            (lease, partition, teardown)
        };
        let result = self.teardown(lease, partition, teardown).await;
        self.lock().tearing_down.remove(id);
        result
    }

    fn teardown_for(&self, p: &Partition) -> Option<HwDestroy> {
        match &p.kind {
            PartKind::Mig(m) => {
                let keep = p.origin == Origin::Static
                    || self.config.partition.on_release == OnRelease::Keep;
                match (keep, m.gi_id) {
                    (false, Some(gi_id)) => Some(HwDestroy::Mig { gpu: p.gpu, gi_id }),
                    _ => None,
                }
            }
            PartKind::Mps(_) => Some(HwDestroy::Mps {
                lease_id: p.lease_id.clone().unwrap_or_default(),
            }),
            PartKind::WholeGpu => None,
        }
    }

    async fn teardown(
        &self,
        mut lease: Lease,
        partition: Partition,
        hw: Option<HwDestroy>,
    ) -> Result<Lease, LeaseError> {
        let now = now_ms();
        let op = match &hw {
            Some(HwDestroy::Mig { .. }) => Some(IntentOp::DestroyMig),
            Some(HwDestroy::Mps { .. }) => Some(IntentOp::StopMps),
            None => None,
        };
        let mut destroying = partition.clone();
        destroying.state = PartitionState::Destroying;
        let intent = if let Some(op) = op {
            let (l2, p2) = (lease.clone(), destroying.clone());
            Some(
                self.store
                    .write(move |w| {
                        w.put_lease(&l2)?;
                        w.put_partition(&p2)?;
                        w.begin_intent(op, &p2.id, Some(&l2.id), now)
                    })
                    .await?,
            )
        } else {
            None
        };
        self.emit(
            EventKind::Revoking,
            &lease,
            Some(&partition),
            format!(
                "ending as {}: {}",
                lease.ending_as.unwrap_or(LeaseState::Released).as_str(),
                lease.end_reason.clone().unwrap_or_default()
            ),
        );

        // Containers first: the partition is torn down only when no process of the
        // lease remains.
        let containers = self
            .lock()
            .leases
            .get(&lease.id)
            .map(|l| l.containers.clone())
            .unwrap_or_else(|| lease.containers.clone());
        if !containers.is_empty() {
            let grace = self.config.lease.revocation_grace;
            self.emit(
                EventKind::Revoking,
                &lease,
                Some(&partition),
                format!(
                    "stopping {} container(s): SIGTERM, then SIGKILL after {}s",
                    containers.len(),
                    grace.as_secs()
                ),
            );
            let lid = lease.id.clone();
            let res = tokio::task::spawn_blocking(move || {
                containers
                    .iter()
                    .map(|c| super::enforce::stop_container(&lid, c, grace))
                    .collect::<Result<Vec<_>, _>>()
            })
            .await
            .map_err(|e| LeaseError::Internal(format!("container stop task failed: {e}")))?;
            match res {
                Ok(stopped) => {
                    let (t, k): (usize, usize) = stopped
                        .iter()
                        .fold((0, 0), |(t, k), s| (t + s.terminated, k + s.killed));
                    self.emit(
                        EventKind::Revoking,
                        &lease,
                        Some(&partition),
                        format!(
                            "containers stopped: {t} process(es) got SIGTERM, {k} needed SIGKILL"
                        ),
                    );
                }
                Err(e) => {
                    warn!(lease = %lease.id, error = %e, "stopping containers failed; will retry");
                    self.emit(
                        EventKind::Revoking,
                        &lease,
                        Some(&partition),
                        format!("stopping containers failed, retrying: {e}"),
                    );
                    let mut st = self.lock();
                    if let Some(l) = st.leases.get_mut(&lease.id) {
                        l.state = LeaseState::Revoking;
                        l.ending_as = lease.ending_as;
                        l.end_reason = lease.end_reason.clone();
                    }
                    return Ok(lease);
                }
            }
        }

        if let Some(hw) = hw {
            let backend = self.backend.clone();
            let res = match hw {
                HwDestroy::Mig { gpu, gi_id } if backend.instance_calls_are_quick() => {
                    backend.destroy_instance(gpu, gi_id)
                }
                hw => tokio::task::spawn_blocking(move || match hw {
                    HwDestroy::Mig { gpu, gi_id } => backend.destroy_instance(gpu, gi_id),
                    HwDestroy::Mps { lease_id } => backend.mps_stop(&lease_id),
                })
                .await
                .map_err(|e| LeaseError::Internal(format!("hardware task failed: {e}")))?,
            };
            if let Err(e) = res {
                warn!(lease = %lease.id, error = %e, "teardown failed; will retry");
                let mut st = self.lock();
                if let Some(p) = st.partitions.get_mut(&partition.id) {
                    p.state = PartitionState::Destroying;
                }
                if let Some(l) = st.leases.get_mut(&lease.id) {
                    *l = lease.clone();
                }
                drop(st);
                self.emit(
                    EventKind::Revoking,
                    &lease,
                    Some(&partition),
                    format!("teardown failed, retrying: {e}"),
                );
                return Ok(lease);
            }
        }

        if let PartKind::Mps(m) = &partition.kind
            && let Some(base) = m.pipe_dir.parent()
            && base.starts_with(self.config.daemon.run_dir.join("mps"))
            && let Err(e) = std::fs::remove_dir_all(base)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!(lease = %lease.id, dir = %base.display(), error = %e, "could not remove the MPS directories");
        }
        let final_state = lease.ending_as.unwrap_or(LeaseState::Released);
        lease.state = final_state;
        lease.ended_at_ms = Some(now_ms());
        let now = now_ms();
        let back_to_pool = hw_keeps(&partition, self.config.partition.on_release);
        let mut freed = partition.clone();
        freed.lease_id = None;
        freed.state = PartitionState::Ready;
        let (l2, f2) = (lease.clone(), freed.clone());
        let gpu_memory = self
            .lock()
            .gpus
            .iter()
            .find(|g| g.info.index == partition.gpu)
            .map(|g| g.info.memory_bytes)
            .unwrap_or_default();
        let usage = crate::usage::weights_of_partition(&lease, &partition, gpu_memory);
        self.store
            .write(move |w| {
                w.put_lease(&l2)?;
                crate::usage::insert_record(w.conn(), &l2, &usage)?;
                if back_to_pool {
                    w.put_partition(&f2)?;
                } else {
                    w.delete_partition(&f2.id)?;
                }
                w.delete_tokens(&l2.id)?;
                if let Some(i) = intent {
                    w.finish_intent(i, now, "done")?;
                }
                Ok(())
            })
            .await?;
        {
            let mut st = self.lock();
            st.leases.remove(&lease.id);
            st.tokens.retain(|_, l| *l != lease.id);
            st.expiring_notified.remove(&lease.id);
            st.teardown_backoff.remove(&lease.id);
            if let Some(rid) = &lease.request_id {
                st.requests.remove(&(lease.tenant.clone(), rid.clone()));
            }
            if back_to_pool {
                st.partitions.insert(freed.id.clone(), freed);
            } else {
                st.partitions.remove(&partition.id);
            }
        }
        let kind = if final_state == LeaseState::Released {
            EventKind::Released
        } else {
            EventKind::Revoked
        };
        self.emit(
            kind,
            &lease,
            Some(&partition),
            lease.end_reason.clone().unwrap_or_default(),
        );
        info!(lease = %lease.id, state = final_state.as_str(), "lease ended");
        Ok(lease)
    }

    // ---------------------------------------------------------------- runtime

    pub fn resolve_token(&self, tok: &str) -> Result<Resolved, LeaseError> {
        let not_found = || LeaseError::NotFound("unknown, expired or revoked lease token".into());
        if !token::looks_valid(tok) {
            return Err(not_found());
        }
        let h = token::hash(tok);
        let (lease, partition, gpu) = {
            let st = self.lock();
            let lid = st.tokens.get(&h).ok_or_else(not_found)?;
            let lease = st.leases.get(lid).cloned().ok_or_else(not_found)?;
            if lease.state != LeaseState::Active {
                return Err(LeaseError::FailedPrecondition(format!(
                    "lease {} is {}",
                    lease.id,
                    lease.state.as_str()
                )));
            }
            let partition = st
                .partitions
                .get(&lease.partition_id)
                .cloned()
                .ok_or_else(|| LeaseError::Internal("lease without partition".into()))?;
            let gpu = st
                .gpus
                .iter()
                .find(|g| g.info.index == partition.gpu)
                .map(|g| g.info.clone())
                .ok_or_else(|| LeaseError::Internal("partition on unknown GPU".into()))?;
            (lease, partition, gpu)
        };
        let minors = match partition.kind {
            PartKind::Mig(_) => self.backend.mig_minors()?,
            _ => Default::default(),
        };
        Ok(devices::resolve(
            &lease,
            &partition,
            gpu.minor,
            &gpu.uuid,
            &minors,
            &self.config.devices,
            self.config.lease.pids_limit,
        ))
    }

    /// Record a container on the lease its token names (the runtime calls this
    /// before runc). `uid` is the container's uid: an MPS lease's pipe and log
    /// directories are handed to it (mode 0700); MPS serves one uid at a time, so a
    /// container with another uid is refused.
    pub async fn bind_container(
        &self,
        tok: &str,
        binding: ContainerBinding,
        uid: Option<u32>,
    ) -> Result<Lease, LeaseError> {
        if binding.id.is_empty() || binding.id.len() > 1024 {
            return Err(invalid("container_id", "must be 1-1024 characters"));
        }
        if binding.cgroup_path.len() > 4096 || binding.runtime_root.len() > 4096 {
            return Err(invalid(
                "cgroup_path",
                "cgroup_path and runtime_root are at most 4096 bytes",
            ));
        }
        let resolved = self.resolve_token(tok)?;
        let (lease, handed) = {
            let mut st = self.lock();
            let n = st
                .leases
                .get(&resolved.lease.id)
                .map(|l| l.containers.len())
                .unwrap_or(0);
            if n >= 1024 {
                return Err(LeaseError::ResourceExhausted(format!(
                    "lease {} already has {n} containers",
                    resolved.lease.id
                )));
            }
            let mut handed = None;
            if let (Some(uid), Some(p)) = (uid, st.partitions.get_mut(&resolved.partition.id))
                && let PartKind::Mps(m) = &mut p.kind
            {
                match m.owner_uid {
                    Some(owner) if owner != uid => {
                        return Err(LeaseError::FailedPrecondition(format!(
                            "this MPS lease serves uid {owner}; a container running as uid {uid} cannot share its MPS server"
                        )));
                    }
                    Some(_) => {}
                    None => {
                        m.owner_uid = Some(uid);
                        let dirs = (m.pipe_dir.clone(), m.log_dir.clone());
                        handed = Some((p.clone(), dirs.0, dirs.1));
                    }
                }
            }
            let l = st
                .leases
                .get_mut(&resolved.lease.id)
                .ok_or_else(|| LeaseError::NotFound("lease ended".into()))?;
            l.containers.retain(|c| c.id != binding.id);
            l.containers.push(binding.clone());
            (l.clone(), handed)
        };
        if let (Some(uid), Some((_, pipe, log))) = (uid, &handed) {
            for dir in [pipe.parent(), Some(pipe.as_path()), Some(log.as_path())]
                .into_iter()
                .flatten()
            {
                std::os::unix::fs::chown(dir, Some(uid), None).map_err(|source| {
                    LeaseError::Hardware(GpuError::Io {
                        path: dir.to_path_buf(),
                        source,
                    })
                })?;
            }
        }
        let l2 = lease.clone();
        let p2 = handed.map(|(p, _, _)| p);
        self.store
            .write(move |w| {
                if let Some(p) = &p2 {
                    w.put_partition(p)?;
                }
                w.put_lease(&l2)
            })
            .await?;
        self.emit(EventKind::ContainerBound, &lease, None, binding.id);
        Ok(lease)
    }

    pub async fn unbind_container(&self, container_id: &str) -> Result<(), LeaseError> {
        let lease = {
            let mut st = self.lock();
            let Some(l) = st
                .leases
                .values_mut()
                .find(|l| l.containers.iter().any(|c| c.id == container_id))
            else {
                return Ok(());
            };
            l.containers.retain(|c| c.id != container_id);
            l.clone()
        };
        let l2 = lease.clone();
        self.store.write(move |w| w.put_lease(&l2)).await?;
        self.emit(
            EventKind::ContainerUnbound,
            &lease,
            None,
            container_id.to_string(),
        );
        Ok(())
    }

    // ---------------------------------------------------------------- background

    /// One pass of the housekeeping loop: expire leases, warn of expiry, retry stuck
    /// teardowns. Returns how many leases it ended.
    pub async fn tick(&self) -> usize {
        let now = now_ms();
        let notice = self.config.lease.expiring_notice.as_millis() as i64;
        let (expired, expiring, stuck) = {
            let mut st = self.lock();
            let mut expired = Vec::new();
            let mut expiring = Vec::new();
            let mut stuck = Vec::new();
            for l in st.leases.values() {
                if l.state == LeaseState::Active && l.expires_at_ms <= now {
                    expired.push(l.id.clone());
                } else if l.state == LeaseState::Active
                    && l.expires_at_ms - notice <= now
                    && !st.expiring_notified.contains(&l.id)
                {
                    expiring.push(l.clone());
                } else if l.state == LeaseState::Revoking
                    && !st.tearing_down.contains(&l.id)
                    && st
                        .teardown_backoff
                        .get(&l.id)
                        .is_none_or(|(_, next)| *next <= now)
                {
                    stuck.push(l.id.clone());
                }
            }
            for l in &expiring {
                st.expiring_notified.insert(l.id.clone());
            }
            (expired, expiring, stuck)
        };
        for l in expiring {
            let left = (l.expires_at_ms - now).max(0) / 1000;
            self.emit(
                EventKind::Expiring,
                &l,
                None,
                format!("expires in {left}s unless renewed"),
            );
        }
        let mut ended = 0;
        for id in expired {
            match self.end(&id, LeaseState::Expired, "TTL ran out").await {
                Ok(_) => ended += 1,
                Err(e) => warn!(lease = %id, error = %e, "could not expire lease"),
            }
        }
        for id in stuck {
            if let Err(e) = self.retry_teardown(&id).await {
                warn!(lease = %id, error = %e, "teardown retry failed");
            }
            // Still blocked: wait longer before the next try (250 ms doubling up
            // to 5 s), so a long-blocked teardown neither spins nor floods the log.
            let mut st = self.lock();
            let blocked = st
                .leases
                .get(&id)
                .is_some_and(|l| l.state == LeaseState::Revoking);
            if blocked {
                let (n, next) = st.teardown_backoff.entry(id).or_insert((0, 0));
                *n = n.saturating_add(1);
                *next = now_ms()
                    + TEARDOWN_RETRY_MS
                        .saturating_mul(1 << (*n).min(5))
                        .min(5_000);
            } else {
                st.teardown_backoff.remove(&id);
            }
        }
        self.supervise_mps(now).await;
        ended
    }

    /// Restart the MPS control daemon of any active MPS lease whose daemon died,
    /// with the lease's limits, backing off exponentially (1 s .. 60 s) per lease.
    async fn supervise_mps(&self, now: i64) {
        let due: Vec<(Lease, Partition, u32)> = {
            let mut st = self.lock();
            if now - st.mps_checked_ms < 1000 {
                return;
            }
            st.mps_checked_ms = now;
            st.partitions
                .values()
                .filter(|p| p.state == PartitionState::Ready && p.mps().is_some())
                .filter_map(|p| {
                    let l = st.leases.get(p.lease_id.as_deref()?)?;
                    (l.state == LeaseState::Active && !st.tearing_down.contains(&l.id))
                        .then(|| (l.clone(), p.clone()))
                })
                .filter_map(|(l, p)| {
                    let (n, next) = st.mps_backoff.get(&l.id).copied().unwrap_or((0, 0));
                    (next <= now).then_some((l, p, n))
                })
                .collect()
        };
        if due.is_empty() {
            return;
        }
        let backend = self.backend.clone();
        let running: HashSet<String> =
            match tokio::task::spawn_blocking(move || backend.mps_daemons()).await {
                Ok(Ok(d)) => d
                    .into_iter()
                    .filter(|d| d.running)
                    .map(|d| d.spec.lease_id)
                    .collect(),
                Ok(Err(e)) => {
                    warn!(error = %e, "cannot list MPS daemons");
                    return;
                }
                Err(_) => return,
            };
        for (lease, p, attempts) in due {
            if running.contains(&lease.id) {
                // Healthy again for a whole check: forget old failures.
                self.lock().mps_backoff.remove(&lease.id);
                continue;
            }
            let Some(m) = p.mps() else { continue };
            let spec = MpsSpec {
                lease_id: lease.id.clone(),
                gpu: p.gpu,
                gpu_uuid: p.gpu_uuid.clone(),
                sm_percent: m.sm_percent,
                memory_bytes: m.memory_bytes,
                pipe_dir: m.pipe_dir.clone(),
                log_dir: m.log_dir.clone(),
                owner_uid: m.owner_uid,
            };
            let backend = self.backend.clone();
            let res = tokio::task::spawn_blocking(move || {
                for dir in [&spec.pipe_dir, &spec.log_dir] {
                    create_private_dir(dir)?;
                }
                backend.mps_start(&spec)
            })
            .await;
            let delay = 1000i64 << attempts.min(6);
            self.lock()
                .mps_backoff
                .insert(lease.id.clone(), (attempts + 1, now + delay.min(60_000)));
            match res {
                Ok(Ok(_)) => {
                    warn!(lease = %lease.id, attempt = attempts + 1, "MPS control daemon had died; restarted with the lease's limits");
                    self.emit(
                        EventKind::MpsRestarted,
                        &lease,
                        Some(&p),
                        format!(
                            "MPS control daemon restarted (attempt {}) with {}% SMs and {} MiB",
                            attempts + 1,
                            m.sm_percent,
                            m.memory_bytes >> 20
                        ),
                    );
                }
                Ok(Err(e)) => {
                    warn!(lease = %lease.id, error = %e, "restarting the MPS control daemon failed; backing off");
                }
                Err(_) => {}
            }
        }
    }

    async fn retry_teardown(&self, id: &str) -> Result<(), LeaseError> {
        let (lease, partition) = {
            let mut st = self.lock();
            if st.tearing_down.contains(id) {
                return Ok(());
            }
            let Some(lease) = st.leases.get(id).cloned() else {
                return Ok(());
            };
            let Some(p) = st.partitions.get(&lease.partition_id).cloned() else {
                return Ok(());
            };
            st.tearing_down.insert(id.to_string());
            (lease, p)
        };
        let hw = self.teardown_for(&partition);
        let r = self.teardown(lease, partition, hw).await;
        self.lock().tearing_down.remove(id);
        r.map(|_| ())
    }

    /// Run [`LeaseManager::tick`] until `stop` fires.
    pub async fn run_housekeeping(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        let mut every = tokio::time::interval(Duration::from_millis(250));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_prune = now_ms();
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = stop.changed() => return,
            }
            self.tick().await;
            self.heartbeat
                .store(now_ms(), std::sync::atomic::Ordering::SeqCst);
            if now_ms() - last_prune > 3_600_000 {
                last_prune = now_ms();
                let before = now_ms() - self.config.lease.retain_ended.as_millis() as i64;
                if let Err(e) = self.store.write(move |w| w.prune(before)).await {
                    warn!(error = %e, "pruning ended leases failed");
                }
            }
        }
    }

    // ---------------------------------------------------------------- start-up

    fn load_and_reconcile(&self) -> Result<(), LeaseError> {
        let devices = self.backend.devices()?;
        let mut gpus = Vec::new();
        for info in devices {
            let profiles = if info.mig_current {
                self.backend.gi_profiles(info.index)?
            } else {
                Vec::new()
            };
            gpus.push(GpuState { info, profiles });
        }
        let snap = self.store.snapshot()?;
        let mut st = State {
            gpus,
            ..Default::default()
        };
        for p in snap.partitions {
            st.partitions.insert(p.id.clone(), p);
        }
        for l in snap.leases {
            if let Some(rid) = &l.request_id {
                st.requests
                    .insert((l.tenant.clone(), rid.clone()), l.id.clone());
            }
            st.leases.insert(l.id.clone(), l);
        }
        for (h, lid) in snap.tokens {
            st.tokens.insert(h, lid);
        }
        let mut instances: HashMap<u32, Vec<MigInstance>> = HashMap::new();
        for g in &st.gpus {
            if g.info.mig_current {
                instances.insert(g.info.index, self.backend.instances(g.info.index)?);
            }
        }
        let now = now_ms();
        let mut report = Reconciled::default();

        // Open intents first: each explains a hardware change that may be half done.
        for intent in &snap.intents {
            self.reconcile_intent(&mut st, &mut instances, intent, now, &mut report)?;
        }

        // Records that point at hardware: verify it is still there.
        let mps_running: HashSet<String> = self
            .backend
            .mps_daemons()?
            .into_iter()
            .filter(|d| d.running)
            .map(|d| d.spec.lease_id)
            .collect();
        let ids: Vec<String> = st.partitions.keys().cloned().collect();
        for id in ids {
            let Some(p) = st.partitions.get(&id).cloned() else {
                continue;
            };
            if p.state != PartitionState::Ready {
                continue;
            }
            match &p.kind {
                PartKind::Mig(m) => {
                    let present = instances.get(&p.gpu).is_some_and(|v| {
                        v.iter()
                            .any(|i| Some(i.gi_id) == m.gi_id && Some(&i.uuid) == m.uuid.as_ref())
                    });
                    if !present {
                        // The instance vanished (GPU reset, reboot): recreate it at
                        // the same placement for the lease that holds it.
                        self.recreate_vanished(&mut st, &p, m, now, &mut report)?;
                        if let Some(inst) = st
                            .partitions
                            .get(&p.id)
                            .and_then(|p| p.mig().and_then(|m| m.gi_id))
                        {
                            let list = instances.entry(p.gpu).or_default();
                            if let Ok(all) = self.backend.instances(p.gpu) {
                                *list = all;
                            }
                            let _ = inst;
                        }
                    }
                }
                PartKind::Mps(m) => {
                    if let Some(lid) = &p.lease_id
                        && !mps_running.contains(lid)
                    {
                        let spec = MpsSpec {
                            lease_id: lid.clone(),
                            gpu: p.gpu,
                            gpu_uuid: p.gpu_uuid.clone(),
                            sm_percent: m.sm_percent,
                            memory_bytes: m.memory_bytes,
                            pipe_dir: m.pipe_dir.clone(),
                            log_dir: m.log_dir.clone(),
                            owner_uid: m.owner_uid,
                        };
                        let started = [&spec.pipe_dir, &spec.log_dir]
                            .into_iter()
                            .try_for_each(|d| create_private_dir(d))
                            .and_then(|()| self.backend.mps_start(&spec).map(|_| ()));
                        match started {
                            Ok(()) => report.mps_restarted += 1,
                            // The supervisor retries it with its backoff once the
                            // daemon runs; one GPU's MPS trouble does not stop the
                            // others being served.
                            Err(e) => warn!(
                                lease = %lid,
                                gpu = p.gpu,
                                error = %e,
                                "could not restart the MPS control daemon at start; will retry"
                            ),
                        }
                    }
                }
                PartKind::WholeGpu => {}
            }
        }

        // Instances no record explains: never touched, but counted as occupied.
        for (gpu, list) in &instances {
            for inst in list {
                let explained = st.partitions.values().any(|p| {
                    p.gpu == *gpu
                        && p.mig().is_some_and(|m| {
                            m.gi_id == Some(inst.gi_id) || m.placement == inst.placement
                        })
                });
                if !explained {
                    warn!(gpu, gi = inst.gi_id, uuid = %inst.uuid,
                        "MIG instance not created by tesserad: leaving it alone and treating its placement as occupied");
                    st.foreign.push(inst.clone());
                }
            }
        }
        info!(
            leases = st.leases.len(),
            partitions = st.partitions.len(),
            intents = snap.intents.len(),
            adopted = report.adopted,
            rolled_back = report.rolled_back,
            recreated = report.recreated,
            mps_restarted = report.mps_restarted,
            foreign = st.foreign.len(),
            "state loaded and reconciled with the hardware"
        );
        *self.lock() = st;
        Ok(())
    }

    fn reconcile_intent(
        &self,
        st: &mut State,
        instances: &mut HashMap<u32, Vec<MigInstance>>,
        intent: &super::model::Intent,
        now: i64,
        report: &mut Reconciled,
    ) -> Result<(), LeaseError> {
        let iid = intent.id;
        let Some(p) = st.partitions.get(&intent.partition_id).cloned() else {
            self.store
                .write_blocking(move |w| w.finish_intent(iid, now, "orphan"))?;
            return Ok(());
        };
        let lease = p.lease_id.as_ref().and_then(|l| st.leases.get(l).cloned());
        match intent.op {
            IntentOp::CreateMig => {
                let Some(m) = p.mig().cloned() else {
                    return Ok(());
                };
                let list = instances.entry(p.gpu).or_default();
                let found = list
                    .iter()
                    .find(|i| i.placement == m.placement && i.gi_profile_id == m.gi_profile_id)
                    .cloned();
                match found {
                    Some(inst) if inst.ci_id.is_some() => {
                        // Created completely: adopt it.
                        let mut p2 = p.clone();
                        if let PartKind::Mig(mm) = &mut p2.kind {
                            mm.gi_id = Some(inst.gi_id);
                            mm.ci_id = inst.ci_id;
                            mm.uuid = Some(inst.uuid.clone());
                        }
                        self.adopt_at_start(st, p2, lease, iid, now)?;
                        report.adopted += 1;
                    }
                    other => {
                        if let Some(inst) = other {
                            // A GI without its CI: our half-done create. Undo it. If
                            // the driver refuses, start anyway: the GI stays in
                            // `instances`, so it is reported as foreign below and
                            // its slices count as occupied until an operator
                            // removes it.
                            match self.backend.destroy_instance(inst.gpu, inst.gi_id) {
                                Ok(()) => list.retain(|i| i.gi_id != inst.gi_id),
                                Err(e) => warn!(
                                    gpu = inst.gpu,
                                    gi = inst.gi_id,
                                    error = %e,
                                    "could not undo a MIG instance a crash left half created; \
                                     it is left alone as foreign: remove it with \
                                     `nvidia-smi mig -i {} -dgi -gi {}`",
                                    inst.gpu,
                                    inst.gi_id
                                ),
                            }
                        }
                        self.fail_creation(st, &p, lease, iid, now)?;
                        report.rolled_back += 1;
                    }
                }
            }
            IntentOp::StartMps => {
                let lid = p.lease_id.clone().unwrap_or_default();
                let running = self
                    .backend
                    .mps_daemons()?
                    .iter()
                    .any(|d| d.spec.lease_id == lid && d.running);
                if running {
                    self.adopt_at_start(st, p.clone(), lease, iid, now)?;
                    report.adopted += 1;
                } else {
                    let _ = self.backend.mps_stop(&lid);
                    self.fail_creation(st, &p, lease, iid, now)?;
                    report.rolled_back += 1;
                }
            }
            IntentOp::DestroyMig | IntentOp::StopMps => {
                match (&p.kind, intent.op) {
                    (PartKind::Mig(m), IntentOp::DestroyMig) => {
                        let list = instances.entry(p.gpu).or_default();
                        let present = list
                            .iter()
                            .any(|i| Some(i.gi_id) == m.gi_id && Some(&i.uuid) == m.uuid.as_ref());
                        if present {
                            let gi = m.gi_id.unwrap_or_default();
                            if let Err(e) = self.backend.destroy_instance(p.gpu, gi) {
                                warn!(partition = %p.id, error = %e, "teardown still fails; will retry");
                                return Ok(());
                            }
                            list.retain(|i| i.gi_id != gi);
                        }
                    }
                    _ => {
                        if let Some(l) = &p.lease_id
                            && let Err(e) = self.backend.mps_stop(l)
                        {
                            // As for a MIG teardown: the lease stays revoking and
                            // housekeeping tries again.
                            warn!(partition = %p.id, error = %e, "stopping the MPS daemon still fails; will retry");
                            return Ok(());
                        }
                    }
                }
                let mut l2 = lease.clone();
                if let Some(l) = &mut l2 {
                    l.state = l.ending_as.unwrap_or(LeaseState::Released);
                    l.ended_at_ms = Some(now);
                }
                self.drop_at_start(st, &p.id, l2, iid, now, "done")?;
            }
        }
        Ok(())
    }

    fn fail_creation(
        &self,
        st: &mut State,
        p: &Partition,
        lease: Option<Lease>,
        iid: i64,
        now: i64,
    ) -> Result<(), LeaseError> {
        let mut l2 = lease;
        if let Some(l) = &mut l2 {
            l.state = LeaseState::Failed;
            l.end_reason = Some("the daemon stopped while creating the partition".into());
            l.ended_at_ms = Some(now);
        }
        self.drop_at_start(st, &p.id, l2, iid, now, "rolled back")
    }

    /// At start: the hardware change of an open intent completed before the crash:
    /// mark the partition ready and its pending lease active, durably, then in
    /// memory.
    fn adopt_at_start(
        &self,
        st: &mut State,
        mut p: Partition,
        mut lease: Option<Lease>,
        iid: i64,
        now: i64,
    ) -> Result<(), LeaseError> {
        p.state = PartitionState::Ready;
        if let Some(l) = &mut lease
            && l.state == LeaseState::Pending
        {
            l.state = LeaseState::Active;
        }
        let (pp, ll) = (p.clone(), lease.clone());
        self.store.write_blocking(move |w| {
            w.put_partition(&pp)?;
            if let Some(l) = &ll {
                w.put_lease(l)?;
            }
            w.finish_intent(iid, now, "adopted")
        })?;
        st.partitions.insert(p.id.clone(), p);
        if let Some(l) = lease {
            st.leases.insert(l.id.clone(), l);
        }
        Ok(())
    }

    /// At start: forget a partition, end its lease (as the caller set it) and
    /// finish the intent, durably, then in memory.
    fn drop_at_start(
        &self,
        st: &mut State,
        partition_id: &str,
        lease: Option<Lease>,
        iid: i64,
        now: i64,
        outcome: &'static str,
    ) -> Result<(), LeaseError> {
        let (pid, ll) = (partition_id.to_string(), lease.clone());
        self.store.write_blocking(move |w| {
            w.delete_partition(&pid)?;
            if let Some(l) = &ll {
                w.put_lease(l)?;
                w.delete_tokens(&l.id)?;
            }
            w.finish_intent(iid, now, outcome)
        })?;
        st.partitions.remove(partition_id);
        if let Some(l) = lease {
            st.leases.remove(&l.id);
            st.tokens.retain(|_, v| *v != l.id);
            if let Some(rid) = &l.request_id {
                st.requests.remove(&(l.tenant.clone(), rid.clone()));
            }
        }
        Ok(())
    }

    fn recreate_vanished(
        &self,
        st: &mut State,
        p: &Partition,
        m: &MigPart,
        now: i64,
        report: &mut Reconciled,
    ) -> Result<(), LeaseError> {
        warn!(partition = %p.id, gpu = p.gpu, "MIG instance of a record is gone (GPU reset or reboot?): re-creating it");
        let pid = p.id.clone();
        let lid = p.lease_id.clone();
        let iid = self.store.write_blocking(move |w| {
            w.begin_intent(IntentOp::CreateMig, &pid, lid.as_deref(), now)
        })?;
        match self
            .backend
            .create_instance(p.gpu, m.gi_profile_id, m.placement, m.ci_profile_id)
        {
            Ok(inst) => {
                let mut p2 = p.clone();
                if let PartKind::Mig(mm) = &mut p2.kind {
                    mm.gi_id = Some(inst.gi_id);
                    mm.ci_id = inst.ci_id;
                    mm.uuid = Some(inst.uuid);
                }
                let pp = p2.clone();
                self.store.write_blocking(move |w| {
                    w.put_partition(&pp)?;
                    w.finish_intent(iid, now, "recreated")
                })?;
                st.partitions.insert(p2.id.clone(), p2);
                report.recreated += 1;
            }
            Err(e) => {
                warn!(partition = %p.id, error = %e, "could not re-create the MIG instance; revoking its lease");
                let mut l2 = p.lease_id.as_ref().and_then(|l| st.leases.get(l).cloned());
                if let Some(l) = &mut l2 {
                    l.state = LeaseState::Revoked;
                    l.end_reason = Some(format!(
                        "MIG instance vanished and could not be re-created: {e}"
                    ));
                    l.ended_at_ms = Some(now);
                }
                let (pid, ll) = (p.id.clone(), l2.clone());
                self.store.write_blocking(move |w| {
                    w.delete_partition(&pid)?;
                    if let Some(l) = &ll {
                        w.put_lease(l)?;
                        w.delete_tokens(&l.id)?;
                    }
                    w.finish_intent(iid, now, "failed")
                })?;
                st.partitions.remove(&p.id);
                if let Some(l) = l2 {
                    st.leases.remove(&l.id);
                    st.tokens.retain(|_, v| *v != l.id);
                }
            }
        }
        Ok(())
    }

    /// Create the operator's static MIG layout where it is missing.
    fn ensure_static_layout(&self) -> Result<(), LeaseError> {
        for layout in &self.config.partition.static_layouts {
            for (profile, want) in &layout.devices {
                loop {
                    let (have, decision, gpu) = {
                        let st = self.lock();
                        let gpu = st
                            .gpus
                            .iter()
                            .find(|g| g.info.index == layout.gpu)
                            .cloned()
                            .ok_or_else(|| {
                                LeaseError::FailedPrecondition(format!(
                                    "static layout names GPU {} which this host does not have",
                                    layout.gpu
                                ))
                            })?;
                        if !gpu.info.mig_current {
                            return Err(LeaseError::FailedPrecondition(format!(
                                "static layout for GPU {} needs MIG mode, which is off (tesserad never toggles it)",
                                layout.gpu
                            )));
                        }
                        let have = st
                            .partitions
                            .values()
                            .filter(|p| {
                                p.gpu == layout.gpu
                                    && p.origin == Origin::Static
                                    && p.mig()
                                        .is_some_and(|m| m.profile.eq_ignore_ascii_case(profile))
                            })
                            .count() as u32;
                        if have >= *want {
                            break;
                        }
                        // Plan a new instance: the layout never counts an existing
                        // free instance (static or kept) as one of its own.
                        let mut views = Self::views(&st);
                        for v in &mut views {
                            for m in &mut v.mig {
                                m.free_static = None;
                            }
                        }
                        let mut opts = self.plan_options(Some(layout.gpu));
                        opts.dynamic_mig = true;
                        let shape = Shape::Mig {
                            profile: profile.clone(),
                            compute_profile: None,
                        };
                        let decision = partition::plan(&shape, &views, &opts).map_err(|e| {
                            LeaseError::FailedPrecondition(format!(
                                "static layout for GPU {}: cannot place {profile}: {e}",
                                layout.gpu
                            ))
                        })?;
                        (have, decision, gpu)
                    };
                    let PlanDecision::NewMig {
                        gpu: g,
                        gi_profile_id,
                        placement,
                        ci_profile_id,
                    } = decision
                    else {
                        return Err(LeaseError::Internal(format!(
                            "static layout for GPU {}: planner did not create a new instance",
                            layout.gpu
                        )));
                    };
                    let prof = gpu
                        .profiles
                        .iter()
                        .find(|p| p.id == gi_profile_id)
                        .cloned()
                        .ok_or_else(|| LeaseError::Internal("unknown profile".into()))?;
                    let now = now_ms();
                    let mut p = Partition {
                        id: new_id("p-"),
                        gpu: g,
                        gpu_uuid: gpu.info.uuid.clone(),
                        origin: Origin::Static,
                        state: PartitionState::Creating,
                        lease_id: None,
                        kind: PartKind::Mig(MigPart {
                            gi_profile_id,
                            profile: prof.name.clone(),
                            placement,
                            ci_profile_id,
                            compute_profile: None,
                            gi_id: None,
                            ci_id: None,
                            uuid: None,
                            memory_bytes: prof.memory_bytes,
                            sm_count: prof.sm_count,
                            slices: prof.slices,
                        }),
                    };
                    self.lock().partitions.insert(p.id.clone(), p.clone());
                    let pp = p.clone();
                    let iid = self.store.write_blocking(move |w| {
                        w.put_partition(&pp)?;
                        w.begin_intent(IntentOp::CreateMig, &pp.id, None, now)
                    })?;
                    let inst =
                        self.backend
                            .create_instance(g, gi_profile_id, placement, ci_profile_id);
                    match inst {
                        Ok(inst) => {
                            if let PartKind::Mig(m) = &mut p.kind {
                                m.gi_id = Some(inst.gi_id);
                                m.ci_id = inst.ci_id;
                                m.uuid = Some(inst.uuid);
                            }
                            p.state = PartitionState::Ready;
                            let pp = p.clone();
                            self.store.write_blocking(move |w| {
                                w.put_partition(&pp)?;
                                w.finish_intent(iid, now, "done")
                            })?;
                            info!(gpu = g, profile = %prof.name, start = placement.start, n = have + 1, "static partition created");
                            self.lock().partitions.insert(p.id.clone(), p);
                        }
                        Err(e) => {
                            let pid = p.id.clone();
                            self.store.write_blocking(move |w| {
                                w.delete_partition(&pid)?;
                                w.finish_intent(iid, now, "failed")
                            })?;
                            self.lock().partitions.remove(&p.id);
                            return Err(e.into());
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Shared read of state for tests and metrics: (live leases, partitions).
    pub fn counts(&self) -> (usize, usize) {
        let st = self.lock();
        (st.leases.len(), st.partitions.len())
    }
}

fn hw_keeps(p: &Partition, on_release: OnRelease) -> bool {
    matches!(p.kind, PartKind::Mig(_))
        && (p.origin == Origin::Static || on_release == OnRelease::Keep)
}

#[derive(Default)]
struct Reconciled {
    adopted: usize,
    rolled_back: usize,
    recreated: usize,
    mps_restarted: usize,
}

/// Create a directory (and parents) with mode 0700.
fn create_private_dir(dir: &std::path::Path) -> Result<(), GpuError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .and_then(|_| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|source| GpuError::Io {
            path: dir.to_path_buf(),
            source,
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn manager(dir: &std::path::Path) -> Arc<LeaseManager> {
        manager_and_sim(dir).0
    }

    fn manager_and_sim(dir: &std::path::Path) -> (Arc<LeaseManager>, Arc<crate::gpu::SimBackend>) {
        let text = format!(
            "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
             [sim]\nstate_file = {s:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n\
             [[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n",
            d = dir.display().to_string(),
            s = dir.join("sim.json").display().to_string(),
        );
        let config = Config::parse(std::path::Path::new("test.toml"), &text).unwrap();
        let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
        let store = Arc::new(Store::open(dir).unwrap());
        (
            LeaseManager::start(config, sim.clone(), store).unwrap(),
            sim,
        )
    }

    fn mig_request(request_id: &str) -> CreateRequest {
        CreateRequest {
            tenant: "team-a".into(),
            shape: Some(Shape::Mig {
                profile: "1g.10gb".into(),
                compute_profile: None,
            }),
            ttl: None,
            request_id: Some(request_id.into()),
            labels: BTreeMap::new(),
            priority_class: None,
            gpu_index: None,
        }
    }

    /// A retry that misses the first call in memory but finds its lease live in
    /// the store (the first call reserved and wrote it in between) is a replay with
    /// a token, not the "ended lease" answer that carries none.
    #[tokio::test]
    async fn a_retry_racing_the_first_call_still_gets_a_token() {
        let dir = tempfile::tempdir().unwrap();
        let mgr = manager(dir.path());
        let first = mgr.create(mig_request("job-7")).await.unwrap();
        assert!(!first.replayed);
        let key = ("team-a".to_string(), "job-7".to_string());
        // Open the window: the lease is in the store but not (yet) in memory.
        let lid = mgr.lock().requests.remove(&key).unwrap();
        let m2 = mgr.clone();
        let restore = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            m2.lock().requests.insert(key, lid);
        });
        let retry = mgr.create(mig_request("job-7")).await.unwrap();
        restore.await.unwrap();
        assert!(retry.replayed);
        assert_eq!(retry.lease.id, first.lease.id);
        let token = retry.token.expect("a live lease's retry carries a token");
        let resolved = mgr.resolve_token(&token).unwrap();
        assert_eq!(resolved.lease.id, first.lease.id);
    }

    /// An ended lease is answered from the store without a token.
    #[tokio::test]
    async fn a_retry_after_release_reports_the_ended_lease_without_a_token() {
        let dir = tempfile::tempdir().unwrap();
        let mgr = manager(dir.path());
        let first = mgr.create(mig_request("job-8")).await.unwrap();
        mgr.end(&first.lease.id, LeaseState::Released, "test")
            .await
            .unwrap();
        let retry = mgr.create(mig_request("job-8")).await.unwrap();
        assert!(retry.replayed);
        assert_eq!(retry.lease.id, first.lease.id);
        assert!(!retry.lease.state.is_live());
        assert!(retry.token.is_none());
    }

    /// A teardown blocked by a process in the instance is retried with growing
    /// waits, under the one intent it opened, and finishes once the process is gone.
    #[tokio::test]
    async fn a_blocked_teardown_backs_off_keeps_one_intent_and_finishes_later() {
        let dir = tempfile::tempdir().unwrap();
        let (mgr, sim) = manager_and_sim(dir.path());
        let created = mgr.create(mig_request("job-9")).await.unwrap();
        let part = created.partition.unwrap();
        let m = part.mig().unwrap().clone();
        sim.add_process(0, m.gi_id, m.ci_id, 4242, 1 << 20).unwrap();
        let mut events = mgr.subscribe();
        let id = created.lease.id.clone();
        let l = mgr.end(&id, LeaseState::Released, "test").await.unwrap();
        assert_eq!(l.state, LeaseState::Revoking);
        // Two seconds of housekeeping ticks every 50 ms: without a backoff that
        // is 40 attempts; with one (250 ms doubling) at most a handful.
        for _ in 0..40 {
            mgr.tick().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut failed = 0;
        while let Ok(ev) = events.try_recv() {
            if ev.lease.id == id && ev.message.starts_with("teardown failed") {
                failed += 1;
            }
        }
        assert!((3..=8).contains(&failed), "{failed} failed attempts in 2 s");
        let open: Vec<_> = mgr
            .store
            .snapshot()
            .unwrap()
            .intents
            .into_iter()
            .filter(|i| i.partition_id == part.id)
            .collect();
        assert_eq!(open.len(), 1, "one open intent for the teardown: {open:?}");
        // The blocker leaves: the next due retry (at most 5 s away) finishes it.
        sim.remove_process(0, 4242).unwrap();
        let mut state = LeaseState::Revoking;
        for _ in 0..120 {
            mgr.tick().await;
            state = mgr.get(&id).unwrap().0.state;
            if state != LeaseState::Revoking {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(state, LeaseState::Released);
        assert!(sim.instances(0).unwrap().is_empty());
        assert!(mgr.lock().teardown_backoff.is_empty());
    }

    /// A crash left a GI without its CI and the driver refuses to destroy it at
    /// start: the daemon still starts, fails the lease, and counts the GI as a
    /// foreign, occupied instance instead of placing anything over it.
    #[tokio::test]
    async fn a_half_created_instance_that_cannot_be_undone_does_not_stop_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let (mgr, sim) = manager_and_sim(dir.path());
        sim.crash_next_create_after_gi(0).unwrap();
        sim.fail_next_destroy(0).unwrap();
        let mut req = mig_request("job-10");
        req.gpu_index = Some(0);
        assert!(mgr.create(req).await.is_err());
        let all = mgr.store.list_leases(&LeaseQuery::default()).unwrap();
        assert_eq!(all.len(), 1);
        let lid = all[0].id.clone();
        drop(mgr);
        assert_eq!(sim.instances(0).unwrap().len(), 1, "the half GI is there");
        sim.fail_next_destroy(0).unwrap();
        let (mgr, sim) = manager_and_sim(dir.path());
        let half = sim.instances(0).unwrap();
        assert_eq!(half.len(), 1, "left alone");
        assert!(half[0].ci_id.is_none());
        let (l, _) = mgr.get(&lid).unwrap();
        assert_eq!(l.state, LeaseState::Failed);
        let gpu0 = mgr.node().into_iter().find(|g| g.info.index == 0).unwrap();
        assert_eq!(
            gpu0.free_slices, 7,
            "the foreign GI holds one of the 8 memory slices"
        );
        // The other slices still serve leases, never over the foreign GI.
        let mut req = mig_request("job-11");
        req.gpu_index = Some(0);
        let c = mgr.create(req).await.unwrap();
        let placed = c.partition.unwrap().mig().unwrap().placement;
        assert_ne!(placed, half[0].placement);
    }

    /// An MPS daemon that cannot be restarted at start does not stop the start;
    /// the supervisor restarts it once it can.
    #[tokio::test]
    async fn an_mps_daemon_that_cannot_restart_at_start_is_retried_later() {
        let dir = tempfile::tempdir().unwrap();
        let (mgr, sim) = manager_and_sim(dir.path());
        let mut req = mig_request("job-12");
        req.shape = Some(Shape::Mps {
            sm_percent: 25,
            memory_bytes: 4 << 30,
        });
        let c = mgr.create(req).await.unwrap();
        let lid = c.lease.id.clone();
        let pipe_dir = c.partition.unwrap().mps().unwrap().pipe_dir.clone();
        drop(mgr);
        // The daemon died with tesserad, and its pipe directory cannot be made.
        sim.kill_mps(&lid).unwrap();
        let blocker = pipe_dir.parent().unwrap().to_path_buf();
        std::fs::remove_dir_all(&blocker).unwrap();
        std::fs::write(&blocker, b"not a directory").unwrap();
        let (mgr, sim) = manager_and_sim(dir.path());
        assert_eq!(mgr.get(&lid).unwrap().0.state, LeaseState::Active);
        let running = |sim: &crate::gpu::SimBackend| {
            sim.mps_daemons()
                .unwrap()
                .iter()
                .any(|d| d.spec.lease_id == lid && d.running)
        };
        assert!(!running(&sim));
        std::fs::remove_file(&blocker).unwrap();
        let mut up = false;
        for _ in 0..100 {
            mgr.tick().await;
            if running(&sim) {
                up = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(up, "the supervisor restarted the MPS daemon");
    }

    #[test]
    fn ids_are_unique_and_sort_by_creation() {
        let a = new_id("l-");
        assert_eq!(a.len(), 2 + 12 + 16);
        assert!(a[2..].bytes().all(|b| b.is_ascii_hexdigit()), "{a}");
        std::thread::sleep(Duration::from_millis(2));
        let many: Vec<String> = (0..10_000).map(|_| new_id("l-")).collect();
        assert!(
            many.iter().all(|b| *b > a),
            "later ids sort after earlier ones"
        );
        assert_eq!(many.iter().collect::<HashSet<_>>().len(), many.len());
    }

    #[test]
    fn labels_are_bounded_in_count_size_and_total() {
        let mk = |n: usize, vlen: usize| -> BTreeMap<String, String> {
            (0..n)
                .map(|i| (format!("k{i}"), "v".repeat(vlen)))
                .collect()
        };
        assert!(validate_labels(&mk(64, 200)).is_ok(), "64 x ~200 B fits");
        assert!(validate_labels(&mk(65, 1)).is_err(), "65 labels");
        assert!(validate_labels(&mk(1, 1025)).is_err(), "a value over 1 KiB");
        // 64 values of 1 KiB each are each allowed but 64 KiB in all is not.
        let err = validate_labels(&mk(64, 1024)).unwrap_err();
        assert!(err.to_string().contains("at most 16384 in all"), "{err}");
    }
}
