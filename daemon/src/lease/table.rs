//! The in-memory table of GPUs, leases, partitions and tokens, and the planner's view of it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::gpu::{GiProfile, GpuInfo, MigInstance};
use crate::model::{Lease, PartKind, PartitionState};
use crate::partition::{Expiry, GpuView, MigMpsHost, MpsShare, OccupiedMig, PlanOptions};

use super::LeaseManager;
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

impl LeaseManager {
    pub(super) fn plan_options(&self, gpu_index: Option<u32>) -> PlanOptions {
        self.config.partition.plan_options(gpu_index)
    }

    /// When a new lease of `ttl` granted at `now_ms` would expire, and per GPU the
    /// latest expiry of the leases holding its MIG instances (temporal packing; only
    /// GPUs with leased instances are listed).
    pub(super) fn expiry(st: &State, now_ms: i64, ttl: Duration) -> Expiry {
        let now = u64::try_from(now_ms).unwrap_or(0);
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let mut latest = Vec::new();
        for g in &st.gpus {
            let idx = g.info.index;
            let (placed, _) = st.partitions.on_gpu(idx);
            let last = placed
                .filter(|p| matches!(p.kind, PartKind::Mig(_)))
                .filter_map(|p| st.leases.get(p.lease_id.as_deref()?))
                .map(|l| u64::try_from(l.expires_at_ms).unwrap_or(0))
                .max();
            if let Some(t) = last {
                latest.push((idx, t));
            }
        }
        Expiry {
            now,
            new_lease: now.saturating_add(ttl_ms),
            latest,
        }
    }

    /// The views new placements may use: no GPU out of service, and no free static
    /// instance that is.
    pub(super) fn placeable_views(st: &State) -> Vec<GpuView> {
        let mut views = Self::views(st);
        views.retain(|v| st.unhealthy(v.info.index, None).is_none());
        for v in &mut views {
            for m in &mut v.mig {
                let sick = m.free_static.as_ref().is_some_and(|pid| {
                    st.partitions
                        .get(pid)
                        .and_then(|p| p.mig())
                        .is_some_and(|mp| st.unhealthy(v.info.index, mp.gi_id).is_some())
                });
                if sick {
                    m.free_static = None;
                }
            }
        }
        views
    }

    /// The MIG instances hosting MPS shares, with their shares (MPS inside MIG).
    pub(super) fn mig_mps_hosts(st: &State) -> Vec<MigMpsHost> {
        let mut hosts: Vec<MigMpsHost> = st
            .partitions
            .values()
            .filter_map(|p| {
                let m = p.mig()?;
                let tenant = m.mps_host.clone()?;
                Some(MigMpsHost {
                    partition_id: p.id.clone(),
                    gpu: p.gpu,
                    profile: m.profile.clone(),
                    memory_bytes: m.memory_bytes,
                    tenant,
                    ready: p.state == PartitionState::Ready
                        && st.unhealthy(p.gpu, m.gi_id).is_none()
                        && st.unhealthy(p.gpu, None).is_none(),
                    shares: Vec::new(),
                })
            })
            .collect();
        for p in st.partitions.values() {
            if let Some(m) = p.mps()
                && let Some(h) = &m.host
                && let Some(host) = hosts.iter_mut().find(|x| x.partition_id == *h)
            {
                host.shares.push(MpsShare {
                    sm_percent: m.sm_percent,
                    memory_bytes: m.memory_bytes,
                    mode: m.mode,
                });
            }
        }
        hosts.sort_by(|a, b| a.partition_id.cmp(&b.partition_id));
        hosts
    }

    pub(super) fn views(st: &State) -> Vec<GpuView> {
        st.gpus
            .iter()
            .map(|g| {
                let idx = g.info.index;
                let mut mig = Vec::new();
                let mut whole = false;
                let (placed, mps) = st.partitions.on_gpu(idx);
                for p in placed {
                    match &p.kind {
                        PartKind::Mig(m) => mig.push(OccupiedMig {
                            gi_profile_id: m.gi_profile_id,
                            placement: m.placement,
                            // An instance hosting MPS shares is not free.
                            free_static: (p.lease_id.is_none()
                                && m.mps_host.is_none()
                                && p.state == PartitionState::Ready)
                                .then(|| p.id.clone()),
                        }),
                        PartKind::WholeGpu => whole = true,
                        // Summed in `mps` by the index.
                        PartKind::Mps(_) => {}
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
}
