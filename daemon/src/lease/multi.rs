//! Leases of several partitions (N whole GPUs, or N MIG instances of one profile):
//! created all or none, write-ahead, and shown with how their GPUs connect.
//!
//! CreateLease for such a lease runs the executor's one sequence (`executor.rs`):
//! the lease, every partition, its token and one `create_mig` intent per instance
//! in one commit; then the instances one after another; then one commit that makes
//! them all ready and the lease active. When an instance cannot be created, those
//! made before it are destroyed (and a GI the failed call left behind), the lease
//! fails, and the caller hears why. A crash in between leaves the lease pending
//! with open intents: the next start adopts the lease only if every instance
//! exists, else destroys those that do
//! ([`LeaseManager::reconcile_several_at_start`]).

use std::collections::HashSet;

use tracing::{info, warn};

use crate::gpu::{GpuLink, MigInstance, TopologyLevel};
use crate::model::{Lease, LeaseState, Origin, PartKind, Partition, PartitionState};

use super::error::Inconsistency;
use super::error::LeaseError;
use super::executor::ready;
use super::manager::LeaseManager;
use super::plan::Outcome;
use super::table::State;

/// How the GPUs of a multi-partition lease connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseLinks {
    /// The GPUs its partitions are on, ascending.
    pub gpus: Vec<u32>,
    /// The worst pair's closest common PCIe ancestor (`Internal`: one GPU).
    pub worst_level: TopologyLevel,
    /// The fewest NVLinks between any two of them (0: some pair is PCIe only; also
    /// 0 when all are on one GPU).
    pub min_nvlinks: u32,
}

/// How the GPUs of `parts` connect, by `link`.
pub fn links_of(parts: &[Partition], link: &dyn Fn(u32, u32) -> GpuLink) -> LeaseLinks {
    let mut gpus: Vec<u32> = parts.iter().map(|p| p.gpu).collect();
    gpus.sort_unstable();
    gpus.dedup();
    let mut worst = TopologyLevel::Internal;
    let mut min_nvlinks: Option<u32> = None;
    for (i, &a) in gpus.iter().enumerate() {
        for &b in &gpus[i + 1..] {
            let l = link(a, b);
            worst = worst.max(l.level);
            min_nvlinks = Some(min_nvlinks.map_or(l.nvlinks, |m| m.min(l.nvlinks)));
        }
    }
    LeaseLinks {
        gpus,
        worst_level: worst,
        min_nvlinks: min_nvlinks.unwrap_or(0),
    }
}

impl LeaseManager {
    /// Every partition a lease holds that is still recorded, in its order, and (for
    /// several) how their GPUs connect. Ended leases hold none.
    pub fn partitions_of(&self, lease: &Lease) -> (Vec<Partition>, Option<LeaseLinks>) {
        let st = self.read();
        let parts: Vec<Partition> = lease
            .partition_ids()
            .filter_map(|id| st.partitions.get(id).cloned())
            .filter(|p| p.lease_id.as_deref() == Some(lease.id.as_str()))
            .collect();
        let links = (lease.partition_count() > 1 && !parts.is_empty())
            .then(|| links_of(&parts, &|a, b| st.link(a, b)));
        (parts, links)
    }

    /// At start, before the intents one by one: a multi-partition lease still
    /// pending (a crash during its creation) is adopted only when every one of its
    /// instances exists complete; otherwise every instance of it that exists is
    /// destroyed, its records go and the lease fails. Returns the intents resolved
    /// here (the caller skips them).
    pub(super) fn reconcile_several_at_start(
        &self,
        st: &mut State,
        instances: &mut super::reconcile::Instances,
        intents: &[crate::model::Intent],
        now: i64,
    ) -> Result<HashSet<i64>, LeaseError> {
        let mut resolved = HashSet::new();
        let pending: Vec<Lease> = st
            .leases
            .values()
            .filter(|l| l.state() == LeaseState::Pending && l.partition_count() > 1)
            .cloned()
            .collect();
        for lease in pending {
            let parts: Vec<Partition> = lease
                .partition_ids()
                .filter_map(|id| st.partitions.get(id).cloned())
                .collect();
            let ids: Vec<i64> = intents
                .iter()
                .filter(|i| i.lease_id.as_deref() == Some(lease.id.as_str()))
                .map(|i| i.id)
                .collect();
            let found = found_at_start(st, instances, &parts);
            let complete = parts.len() == lease.partition_count() as usize
                && parts.iter().zip(&found).all(|(p, f)| match &p.kind {
                    PartKind::Mig(_) => f.as_ref().is_some_and(|i| i.ci_id.is_some()),
                    _ => true,
                });
            if complete {
                self.adopt_several_at_start(st, lease, parts, found, (&ids, now))?;
            } else {
                self.undo_several_at_start(st, instances, lease, (&parts, &found), (&ids, now))?;
            }
            resolved.extend(ids);
        }
        Ok(resolved)
    }

    /// A multi-partition lease whose every instance exists complete: adopted, its
    /// intents (`ids`) finished.
    fn adopt_several_at_start(
        &self,
        st: &mut State,
        mut lease: Lease,
        parts: Vec<Partition>,
        found: Vec<Option<MigInstance>>,
        (ids, now): (&[i64], i64),
    ) -> Result<(), LeaseError> {
        let mut ready_parts = Vec::new();
        for (mut p, f) in parts.into_iter().zip(found) {
            ready(&mut p, f);
            ready_parts.push(p);
        }
        lease.activate()?;
        let lease_id = lease.id.clone();
        let adopted = Outcome {
            parts: ready_parts,
            leases: vec![lease],
            finished: ids.iter().map(|i| (*i, now, "adopted")).collect(),
            ..Outcome::default()
        };
        self.commit_at_start(st, adopted)?;
        info!(lease = %lease_id, "multi-partition lease found complete at start: adopted");
        Ok(())
    }

    /// A multi-partition lease a crash left incomplete, all or nothing: the
    /// instances of it that exist destroyed (one that cannot be is left alone as
    /// foreign), its places given back, the lease failed, its intents (`ids`)
    /// finished.
    fn undo_several_at_start(
        &self,
        st: &mut State,
        instances: &mut super::reconcile::Instances,
        mut lease: Lease,
        (parts, found): (&[Partition], &[Option<MigInstance>]),
        (ids, now): (&[i64], i64),
    ) -> Result<(), LeaseError> {
        let mut kept: HashSet<String> = HashSet::new();
        for (p, f) in parts.iter().zip(found) {
            let Some(inst) = f else { continue };
            if p.origin != Origin::Dynamic {
                continue;
            }
            match self.backend.destroy_instance(inst.gpu, inst.gi_id) {
                Ok(()) => {
                    if let Some(list) = instances.get_mut(&inst.gpu) {
                        list.retain(|i| i.gi_id != inst.gi_id);
                    }
                }
                Err(e) => {
                    warn!(partition = %p.id, gpu = inst.gpu, gi = inst.gi_id, error = %e,
                        "could not undo an instance of a multi-partition lease a crash left; \
                         it is left alone as foreign");
                    kept.insert(p.id.clone());
                }
            }
        }
        let reason = format!(
            "the daemon stopped while creating its {} partitions; all or nothing: \
             the instances already made were destroyed",
            lease.partition_count()
        );
        if lease.fail(reason.clone(), now).is_err() {
            lease.lose(reason, now)?;
        }
        let mut rolled_back = Outcome {
            ended: vec![lease.clone()],
            finished: ids.iter().map(|i| (*i, now, "rolled back")).collect(),
            ..Outcome::default()
        };
        // Each place given back: a static one ready and unleased again, a dynamic
        // one gone.
        for p in parts {
            if p.origin == Origin::Static {
                let mut back = p.clone();
                back.lease_id = None;
                back.state = PartitionState::Ready;
                rolled_back.parts.push(back);
            } else {
                rolled_back.gone.push(p.id.clone());
            }
        }
        self.commit_at_start(st, rolled_back)?;
        warn!(lease = %lease.id, kept = kept.len(),
            "multi-partition lease interrupted by a crash: rolled back");
        Ok(())
    }

    /// Every partition of a lease still in the table, in its order; an error when
    /// even its first is gone.
    pub(super) fn lease_partitions(
        st: &State,
        lease: &Lease,
    ) -> Result<Vec<Partition>, LeaseError> {
        let parts: Vec<Partition> = lease
            .partition_ids()
            .filter_map(|id| st.partitions.get(id).cloned())
            .collect();
        if parts.is_empty() {
            return Err(LeaseError::Inconsistent(
                Inconsistency::LeaseWithoutPartition(lease.id.clone()),
            ));
        }
        Ok(parts)
    }
}

/// Each partition's instance as it stands at start: complete, half (GI only) or
/// none.
fn found_at_start(
    st: &State,
    instances: &super::reconcile::Instances,
    parts: &[Partition],
) -> Vec<Option<MigInstance>> {
    parts
        .iter()
        .map(|p| {
            let m = p.mig()?;
            if p.state == PartitionState::Ready {
                // Created and recorded: the record knows its ids.
                return instances
                    .get(&p.gpu)?
                    .iter()
                    .find(|i| Some(i.gi_id) == m.gi_id && Some(&i.uuid) == m.uuid.as_ref());
            }
            // One another record names is that record's, never this one's.
            instances.get(&p.gpu)?.iter().find(|i| {
                i.placement == m.placement
                    && i.gi_profile_id == m.gi_profile_id
                    && !super::reconcile::claimed_by_another(st, &p.id, i)
            })
        })
        .map(|i| i.cloned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::SimTopology;
    use crate::model::Origin;

    fn whole(id: &str, gpu: u32) -> Partition {
        Partition {
            id: id.into(),
            gpu,
            gpu_uuid: format!("GPU-{gpu}"),
            origin: Origin::Dynamic,
            state: PartitionState::Ready,
            lease_id: Some("l-1".into()),
            kind: PartKind::WholeGpu,
        }
    }

    #[test]
    fn the_links_of_a_lease_are_its_worst_pair() {
        let hgx = |a, b| SimTopology::HgxNvswitch.link(a, b, 8, 18);
        let l = links_of(&[whole("a", 1), whole("b", 0)], &hgx);
        assert_eq!(l.gpus, vec![0, 1]);
        assert_eq!((l.worst_level, l.min_nvlinks), (TopologyLevel::Single, 18));
        let l = links_of(&[whole("a", 0), whole("b", 5)], &hgx);
        assert_eq!(l.worst_level, TopologyLevel::System, "across NUMA nodes");
        let pairs = |a, b| SimTopology::PciePairs.link(a, b, 4, 0);
        let l = links_of(&[whole("a", 1), whole("b", 2)], &pairs);
        assert_eq!(l.min_nvlinks, 0, "1 and 2 are not a bridged pair");
        let l = links_of(&[whole("a", 3), whole("b", 3)], &pairs);
        assert_eq!((l.gpus.len(), l.worst_level), (1, TopologyLevel::Internal));
    }
}
