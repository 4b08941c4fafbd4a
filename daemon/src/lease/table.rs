//! The in-memory table of GPUs, leases, partitions and tokens, and the planner's view of it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::gpu::{GiProfile, GpuInfo, MigInstance};
use crate::model::{PartKind, PartitionState};
use crate::partition::{GpuView, OccupiedMig, PlanOptions};

use super::LeaseManager;
use super::index::{Leases, Partitions, Tokens};

/// One GPU as the manager knows it.
#[derive(Debug, Clone)]
pub struct GpuState {
    pub info: GpuInfo,
    pub profiles: Vec<GiProfile>,
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
}

impl LeaseManager {
    pub(super) fn plan_options(&self, gpu_index: Option<u32>) -> PlanOptions {
        PlanOptions {
            strategy: self.config.partition.strategy,
            mps_oversubscribe: self.config.partition.mps_oversubscribe,
            dynamic_mig: self.config.partition.dynamic_mig,
            gpu_index,
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
                            free_static: (p.lease_id.is_none() && p.state == PartitionState::Ready)
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
