//! The in-memory table of GPUs, leases, partitions and tokens, and the planner's view of it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::gpu::{GiProfile, GpuInfo, MigInstance};
use crate::model::Lease;

use super::index::{Leases, Partitions, Tokens};

/// One GPU as the manager knows it.
#[derive(Debug, Clone)]
pub struct GpuState {
    pub info: GpuInfo,
    pub profiles: Vec<GiProfile>,
    /// How it connects to each other GPU (read once at start: the board does not
    /// change): (other index, link). Empty where the backend could not tell.
    pub links: Vec<(u32, crate::gpu::GpuLink)>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) gpus: Vec<GpuState>,
    pub(super) leases: Leases,
    pub(super) partitions: Partitions,
    pub(super) tokens: Tokens,
    pub(super) requests: HashMap<(String, String), String>,
    pub(super) pending: HashMap<String, Arc<Notify>>,
    /// Leases whose teardown is running right now.
    pub(super) tearing_down: HashSet<String>,
    /// Leases that were told they are close to expiry.
    pub(super) expiring_notified: HashSet<String>,
    /// MIG instances no record explains (never touched, but occupied).
    pub(super) foreign: Vec<MigInstance>,
    /// Guaranteed requests waiting for their preemptions to finish.
    pub(super) preempting: usize,
    /// MPS control daemons found dead: lease -> (restarts so far, next try at ms).
    pub(super) mps_backoff: HashMap<String, (u32, i64)>,
    /// Teardowns that failed (a busy instance, a container that will not die):
    /// lease -> (retries so far, next try at ms).
    pub(super) teardown_backoff: HashMap<String, (u32, i64)>,
    /// When the MPS daemons were last checked.
    pub(super) mps_checked_ms: i64,
    /// Leases whose MIG instance is being moved right now.
    pub(super) moving: HashSet<String>,
    /// Leases a runtime has asked the devices of (since start): never moved.
    pub(super) resolved: HashSet<String>,
    /// GPUs (gi None) and MIG instances out of service: (gpu, gi) -> mark.
    pub(super) health: HashMap<(u32, Option<u32>), crate::model::HealthMark>,
    /// MIG instances hosting MPS shares that a CreateLease set up and has not yet
    /// placed its share on: host partition id -> calls. Never reaped while held.
    pub(super) host_claims: HashMap<String, usize>,
}

impl State {
    /// Forget a lease that ended or was rolled back, everywhere this table keys by its
    /// id: the lease, its tokens, its request id, and the marks kept per lease (expiry
    /// notice, teardown and MPS back-off, devices resolved). Its partitions are the
    /// caller's to free or drop.
    pub(super) fn forget_lease(&mut self, lease: &Lease) {
        self.leases.remove(&lease.id);
        self.tokens.remove_lease(&lease.id);
        if let Some(rid) = &lease.request_id {
            self.requests.remove(&(lease.tenant.clone(), rid.clone()));
        }
        self.expiring_notified.remove(&lease.id);
        self.teardown_backoff.remove(&lease.id);
        self.mps_backoff.remove(&lease.id);
        self.resolved.remove(&lease.id);
    }

    /// How GPUs `a` and `b` connect, as read at start. A pair the backend could not
    /// tell counts as the farthest (across NUMA nodes, no NVLink).
    pub(super) fn link(&self, a: u32, b: u32) -> crate::gpu::GpuLink {
        use crate::gpu::{GpuLink, TopologyLevel};
        if a == b {
            return GpuLink {
                level: TopologyLevel::Internal,
                nvlinks: 0,
            };
        }
        self.gpus
            .iter()
            .find(|g| g.info.index == a)
            .and_then(|g| g.links.iter().find(|(o, _)| *o == b))
            .map(|(_, l)| *l)
            .unwrap_or(GpuLink {
                level: TopologyLevel::System,
                nvlinks: 0,
            })
    }
}
