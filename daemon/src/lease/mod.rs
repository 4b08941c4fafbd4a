//! The lease core: admission, placement, the write-ahead protocol, expiry,
//! revocation and reconciliation at start. One file per concern:
//!
//! | file | concern |
//! |---|---|
//! | `table.rs` | the in-memory table (GPUs, leases, partitions, tokens) and the planner's view |
//! | `validate.rs` | checks of a request that need no state |
//! | `create.rs` | CreateLease: reserve, intent, hardware, outcome |
//! | `admission.rs` | quota and placement under the lock; preemption of burst leases |
//! | `grants.rs`, `quota.rs` | the tenancy policy in force, temporary grants; quota arithmetic |
//! | `renew.rs`, `end.rs` | a new expiry; release, expiry and revocation with write-ahead teardown |
//! | `binding.rs` | the runtime's side: token -> devices, container bindings |
//! | `housekeeping.rs` | the background loop |
//! | `owner.rs` | a live lease handed to another tenant (the device plugin: reserved -> the pod's tenant) |
//! | `moves.rs` | idle MIG leases moved (write-ahead) to make room for a request |
//! | `need.rs` | ask by need: memory and isolation to the smallest shape that fits now |
//! | `health.rs` | GPUs and instances out of service: marks, their leases, no new placements |
//! | `reconcile.rs`, `static_layout.rs` | start: store vs hardware, the operator's static layout |
//! | `devices.rs`, `token.rs`, `events.rs`, `error.rs` | device nodes of a lease, tokens, events, errors |
//!
//! Protocol for every hardware change (invariant 2):
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
//!
//! May use: names, config, model, gpu, partition, store, host, usage. May not touch:
//! api, tonic or the generated proto types (the API layer converts).

use std::sync::{Arc, Mutex, MutexGuard};

use tessera_common::clock::now_ms;
use tokio::sync::broadcast;

use crate::config::{Config, TenancyConfig};
use crate::gpu::{GpuBackend, GpuError};
use crate::host::{HostOps, RealHost};
use crate::model::Grant;
use crate::store::Store;

mod admission;
mod binding;
mod create;
pub mod devices;
mod end;
pub mod enforce;
mod error;
mod events;
mod grants;
mod health;
mod housekeeping;
mod index;
mod mig_mps;
mod moves;
mod multi;
mod need;
mod owner;
mod queries;
mod queue;
pub mod quota;
mod reconcile;
mod renew;
mod static_layout;
mod table;
pub mod token;
mod validate;

pub use create::{CreateRequest, Created};
pub use error::LeaseError;
pub use events::{EventKind, GENERATION_SHIFT, LeaseEvent, ResumeError, Subscription};
pub use health::HealthSource;
pub use multi::LeaseLinks;
pub use need::{Isolation, Need};
pub use queries::{GpuReport, Page};
pub use table::GpuState;
pub use validate::validate_create;

use admission::Again;
use create::HwCreate;
use table::State;

pub struct LeaseManager {
    config: Config,
    backend: Arc<dyn GpuBackend>,
    store: Arc<Store>,
    state: Mutex<State>,
    events: broadcast::Sender<Arc<LeaseEvent>>,
    /// Revisions issued and the latest events (WatchLeases from a revision).
    history: Mutex<events::History>,
    shutting_down: std::sync::atomic::AtomicBool,
    /// Unix ms of the housekeeping loop's last completed pass (watchdog feed).
    heartbeat: std::sync::atomic::AtomicI64,
    tenancy: std::sync::RwLock<Arc<TenancyConfig>>,
    grants: Mutex<Vec<Grant>>,
    host: Arc<dyn HostOps>,
    /// CreateLease calls waiting for room (`queue_wait_ms`).
    queue: queue::AdmissionQueue,
    /// The nvidia-uvm and nvidia-caps majors last read from `/proc/devices`, and
    /// when (see `device_majors`).
    majors: Mutex<Option<(std::time::Instant, (i64, i64))>>,
}

impl std::fmt::Debug for LeaseManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseManager").finish_non_exhaustive()
    }
}

/// The private (0700) pipe and log directories of an MPS lease, before its control
/// daemon starts.
fn mps_dirs(host: &dyn HostOps, spec: &crate::gpu::MpsSpec) -> Result<(), GpuError> {
    for dir in [&spec.pipe_dir, &spec.log_dir] {
        host.create_private_dir(dir)?;
    }
    Ok(())
}

impl LeaseManager {
    /// Load the store, reconcile it with the hardware, and set up the static layout,
    /// on the real host.
    pub fn start(
        config: Config,
        backend: Arc<dyn GpuBackend>,
        store: Arc<Store>,
    ) -> Result<Arc<LeaseManager>, LeaseError> {
        Self::start_with_host(config, backend, store, Arc::new(RealHost))
    }

    /// [`LeaseManager::start`] with the host's side effects done by `host`.
    pub fn start_with_host(
        config: Config,
        backend: Arc<dyn GpuBackend>,
        store: Arc<Store>,
        host: Arc<dyn HostOps>,
    ) -> Result<Arc<LeaseManager>, LeaseError> {
        let (events, _) = broadcast::channel(4096);
        let grants = store.grants()?;
        let mgr = Arc::new(LeaseManager {
            config: config.clone(),
            backend,
            store,
            state: Mutex::new(State::default()),
            events,
            history: events::History::new(0, 0),
            shutting_down: std::sync::atomic::AtomicBool::new(false),
            majors: Mutex::new(None),
            heartbeat: std::sync::atomic::AtomicI64::new(now_ms()),
            tenancy: std::sync::RwLock::new(Arc::new(config.tenancy.clone())),
            grants: Mutex::new(Vec::new()),
            queue: queue::AdmissionQueue::default(),
            host,
        });
        *mgr.grants.lock().unwrap_or_else(|p| p.into_inner()) = grants;
        mgr.load_and_reconcile()?;
        mgr.ensure_static_layout()?;
        // After the snapshot is read (a write would discard the one read ahead),
        // and not waited for: it commits before any lease change of this run does.
        // Nobody watches yet: what start-up published needs no revision.
        let generation = mgr.store.generation()?.saturating_add(1);
        mgr.store
            .write_detached("the daemon's generation", move |w| {
                w.set_generation(generation)
            })?;
        let fresh = events::History::new(generation, mgr.config.api.watch_history);
        *mgr.history.lock().unwrap_or_else(|p| p.into_inner()) =
            fresh.into_inner().unwrap_or_else(|p| p.into_inner());
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

    pub fn begin_shutdown(&self) {
        self.shutting_down
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock would be a bug; keep serving with the data.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod paging_tests;
#[cfg(test)]
mod tests;
