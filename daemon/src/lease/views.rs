//! The planner's view of the table: placement options from the configuration,
//! the GPUs as the planner sees them, the MPS-in-MIG hosts and expiries.

use std::time::Duration;

use crate::model::{PartKind, Partition, PartitionState};
use crate::partition::{Expiry, GpuView, MigMpsHost, MpsShare, OccupiedMig, PlanOptions};

use super::manager::LeaseManager;
use super::table::State;

impl LeaseManager {
    /// The planner's view of every GPU, and the partitions of the live leases that
    /// carry the label `label`, from one reading of the table (the DRA publisher's
    /// input: which hardware the scheduler's own claims hold).
    pub fn views_and_labelled(&self, label: &str) -> (Vec<GpuView>, Vec<Partition>) {
        let st = self.read();
        let parts = st
            .leases
            .values()
            .filter(|l| l.labels.contains_key(label))
            .flat_map(|l| {
                l.partition_ids()
                    .filter_map(|id| st.partitions.get(id))
                    .filter(|p| p.lease_id.as_deref() == Some(l.id.as_str()))
                    .cloned()
                    .collect::<Vec<_>>()
            })
            .collect();
        (Self::views(&st), parts)
    }

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
