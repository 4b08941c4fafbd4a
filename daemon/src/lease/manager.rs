//! The lease manager: the table behind its lock, the store, the hardware backend,
//! and what the rest of the core reaches them through. Start-up (load, reconcile,
//! static layout) is here; each concern's methods are in its own file.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tessera_common::clock::now_ms;
use tokio::sync::broadcast;

use crate::config::{Config, TenancyConfig};
use crate::gpu::{GpuBackend, GpuError};
use crate::host::{HostOps, RealHost};
use crate::model::Grant;
use crate::store::Store;

use super::error::LeaseError;
use super::events::{self, LeaseEvent};
use super::queue;
use super::table::State;

pub struct LeaseManager {
    pub(super) config: Config,
    pub(super) backend: Arc<dyn GpuBackend>,
    pub(super) store: Arc<Store>,
    pub(super) state: Mutex<State>,
    pub(super) events: broadcast::Sender<Arc<LeaseEvent>>,
    /// Revisions issued and the latest events (WatchLeases from a revision).
    pub(super) history: Mutex<events::History>,
    pub(super) shutting_down: std::sync::atomic::AtomicBool,
    /// Unix ms of the housekeeping loop's last completed pass (watchdog feed).
    pub(super) heartbeat: std::sync::atomic::AtomicI64,
    pub(super) tenancy: std::sync::RwLock<Arc<TenancyConfig>>,
    pub(super) grants: Mutex<Vec<Grant>>,
    pub(super) host: Arc<dyn HostOps>,
    /// CreateLease calls waiting for room (`queue_wait_ms`).
    pub(super) queue: queue::AdmissionQueue,
    /// The nvidia-uvm and nvidia-caps majors last read from `/proc/devices`, and
    /// when (see `device_majors`).
    pub(super) majors: Mutex<Option<(std::time::Instant, (i64, i64))>>,
    /// Per MPS server (its key), the step on it in progress: a start, or a stop
    /// with the removal of its directories (`mps_server_step`).
    pub(super) mps_steps: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for LeaseManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseManager").finish_non_exhaustive()
    }
}

/// The private (0700) pipe and log directories of an MPS lease, before its control
/// daemon starts.
pub(super) fn mps_dirs(host: &dyn HostOps, spec: &crate::gpu::MpsSpec) -> Result<(), GpuError> {
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
            mps_steps: Mutex::new(HashMap::new()),
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

    /// The table under its lock. Only the executor (`executor.rs`: the plans'
    /// sequences, the changes and outcomes it applies) and this file take it;
    /// every other file reads through [`LeaseManager::read`].
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock would be a bug; keep serving with the data.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The table, read only, under its lock until the answer is dropped: a query,
    /// or a decision whose change the executor makes.
    pub(super) fn read(&self) -> Reading<'_> {
        Reading(self.lock())
    }
}

/// The table held for reading ([`LeaseManager::read`]): nothing can change it
/// through this guard.
pub(super) struct Reading<'a>(MutexGuard<'a, State>);

impl std::ops::Deref for Reading<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        &self.0
    }
}
