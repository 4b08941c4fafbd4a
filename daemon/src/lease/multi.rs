//! Leases of several partitions (N whole GPUs, or N MIG instances of one profile):
//! created all or none, write-ahead, and shown with how their GPUs connect.
//!
//! CreateLease for such a lease: the lease, every partition, its token and one
//! `create_mig` intent per instance in one commit; then the instances one after
//! another; then one commit that makes them all ready and the lease active. When an
//! instance cannot be created, those made before it are destroyed (and a GI the
//! failed call left behind), the lease fails, and the caller hears why. A crash in
//! between leaves the lease pending with open intents: the next start adopts the
//! lease only if every instance exists, else destroys those that do
//! ([`LeaseManager::reconcile_several_at_start`]).

use std::collections::HashSet;

use tessera_common::clock::now_ms;
use tracing::{info, warn};

use crate::gpu::{GpuError, GpuLink, MigInstance, NvmlCode, TopologyLevel};
use crate::model::{IntentOp, Lease, LeaseState, Origin, PartKind, Partition, PartitionState};

use super::create::{Created, HwCreate, Reserved};
use super::end::HwDestroy;
use super::error::Inconsistency;
use super::{EventKind, LeaseError, LeaseManager, State, token};

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
        let st = self.lock();
        let parts: Vec<Partition> = lease
            .partition_ids()
            .filter_map(|id| st.partitions.get(id).cloned())
            .filter(|p| p.lease_id.as_deref() == Some(lease.id.as_str()))
            .collect();
        let links = (lease.partition_count() > 1 && !parts.is_empty())
            .then(|| links_of(&parts, &|a, b| st.link(a, b)));
        (parts, links)
    }

    /// CreateLease of a multi-partition lease, after its reservation (see the
    /// module doc).
    pub(super) async fn create_several(
        &self,
        reserved: Reserved,
        now: i64,
    ) -> Result<Created, LeaseError> {
        let Reserved {
            lease,
            partition,
            hw,
            more,
        } = reserved;
        let steps: Vec<(Partition, Option<HwCreate>)> =
            std::iter::once((partition, hw)).chain(more).collect();
        let tok = token::generate();
        let tok_hash = token::hash(&tok);
        let intents = self.record_several(&lease, &steps, &tok_hash, now).await?;
        if steps.iter().all(|(_, hw)| hw.is_none()) {
            // Whole GPUs (or static pool instances): nothing to change on the
            // hardware, the lease is active as recorded.
            let parts = steps.into_iter().map(|(p, _)| p).collect();
            return Ok(self.publish_several(lease, parts, tok_hash, tok));
        }
        let total = steps.len();
        let mut made: Vec<Partition> = Vec::with_capacity(total);
        let mut steps = steps.into_iter();
        while let Some((mut p, hw)) = steps.next() {
            let Some(hw) = hw else {
                made.push(p);
                continue;
            };
            match self.hw_create(hw).await {
                Ok(inst) => {
                    ready(&mut p, inst);
                    made.push(p);
                }
                Err(e) => {
                    let untouched: Vec<Partition> = steps.map(|(p, _)| p).collect();
                    let k = made.len() + 1;
                    return Err(self
                        .fail_several(lease, made, p, untouched, intents, (k, total), e)
                        .await);
                }
            }
        }
        let mut lease = lease;
        if lease.state().can_activate() {
            lease.activate()?;
        }
        let (l2, p2, i2, done_at) = (lease.clone(), made.clone(), intents.clone(), now_ms());
        // If this fails, the instances exist and the intents stay open: the next
        // start adopts them. The reservation is kept so nothing else takes them.
        self.store
            .write(move |w| {
                for p in &p2 {
                    w.put_partition(p)?;
                }
                w.put_lease(&l2)?;
                for i in i2.iter().flatten() {
                    w.finish_intent(*i, done_at, "done")?;
                }
                Ok(())
            })
            .await?;
        Ok(self.publish_several(lease, made, tok_hash, tok))
    }

    /// Step 2 for several: the lease, every partition, the token and one intent
    /// per hardware change, in one durable commit. On failure nothing was written
    /// and the reservation is given back.
    async fn record_several(
        &self,
        lease: &Lease,
        steps: &[(Partition, Option<HwCreate>)],
        tok_hash: &str,
        now: i64,
    ) -> Result<Vec<Option<i64>>, LeaseError> {
        let ops: Vec<(Partition, Option<IntentOp>)> = steps
            .iter()
            .map(|(p, hw)| {
                let op = match hw {
                    Some(HwCreate::Mig { .. }) => Some(IntentOp::CreateMig),
                    Some(HwCreate::Mps(_)) => Some(IntentOp::StartMps),
                    None => None,
                };
                (p.clone(), op)
            })
            .collect();
        let (l2, h2) = (lease.clone(), tok_hash.to_string());
        let written = self
            .store
            .write(move |w| {
                w.put_lease(&l2)?;
                w.add_token(&h2, &l2.id, now)?;
                let mut ids = Vec::with_capacity(ops.len());
                for (p, op) in &ops {
                    w.put_partition(p)?;
                    ids.push(
                        op.map(|op| w.begin_intent(op, &p.id, Some(&l2.id), now))
                            .transpose()?,
                    );
                }
                Ok(ids)
            })
            .await;
        written.map_err(|e| {
            for (p, _) in steps {
                self.forget_reservation(lease, p, true);
            }
            match e {
                crate::store::StoreError::DuplicateRequest { .. } => {
                    LeaseError::FailedPrecondition(
                        "a lease with this request_id is being created concurrently; retry".into(),
                    )
                }
                e => e.into(),
            }
        })
    }

    /// Step 5 for several: every partition and the lease in the table, the token
    /// known, retries woken, watchers told.
    fn publish_several(
        &self,
        lease: Lease,
        parts: Vec<Partition>,
        tok_hash: String,
        tok: String,
    ) -> Created {
        let mut st = self.lock();
        for p in &parts {
            st.partitions.insert(p.id.clone(), p.clone());
        }
        st.leases.insert(lease.id.clone(), lease.clone());
        st.tokens.insert(tok_hash, lease.id.clone());
        if let Some(n) = st.pending.remove(&lease.id) {
            n.notify_waiters();
        }
        drop(st);
        let first = parts.first().cloned();
        self.emit(
            EventKind::Created,
            &lease,
            first.as_ref(),
            format!("{} partitions", parts.len()),
        );
        info!(lease = %lease.id, tenant = %lease.tenant,
            gpus = ?parts.iter().map(|p| p.gpu).collect::<Vec<_>>(), "multi-partition lease created");
        Created {
            lease,
            partition: first,
            token: Some(tok),
            replayed: false,
        }
    }

    /// Instance `k` of `total` could not be created: destroy the `made` ones (and
    /// a GI the failed call left), fail the lease and give every place back, in one
    /// commit. An instance that cannot be destroyed keeps its record (no lease) and
    /// its intent open: the next start undoes it. Returns the refusal.
    #[allow(clippy::too_many_arguments)]
    async fn fail_several(
        &self,
        mut lease: Lease,
        made: Vec<Partition>,
        failed: Partition,
        untouched: Vec<Partition>,
        intents: Vec<Option<i64>>,
        (k, total): (usize, usize),
        e: GpuError,
    ) -> LeaseError {
        let now = now_ms();
        // Undo what was made. What cannot be undone stays recorded without a lease:
        // a complete instance under a `destroy_mig` intent, the failed call's GI
        // under its `create_mig` intent; the next start finishes either.
        let mut undone = 0usize;
        let mut stuck: HashSet<String> = HashSet::new();
        for p in &made {
            let Some(m) = p.mig() else { continue };
            if p.origin != Origin::Dynamic {
                continue;
            }
            let Some(gi_id) = m.gi_id else { continue };
            let gone = self
                .destroy_hw(HwDestroy::Mig { gpu: p.gpu, gi_id })
                .await
                .map_err(|t| GpuError::Task(t.to_string()))
                .and_then(|r| r);
            match gone {
                Ok(()) => undone += 1,
                Err(d) => {
                    warn!(lease = %lease.id, partition = %p.id, error = %d,
                        "could not destroy an instance of a failed multi-partition lease; the next start does");
                    stuck.insert(p.id.clone());
                }
            }
        }
        let mut half_kept = false;
        if let PartKind::Mig(m) = &failed.kind
            && let Err(d) = self.undo_half_create(failed.gpu, m).await
        {
            warn!(lease = %lease.id, gpu = failed.gpu, error = %d,
                "could not destroy the GI of a failed create; the next start undoes it");
            half_kept = true;
        }
        let reason = format!(
            "hardware set-up failed on partition {k} of {total} (GPU {}): {e}; all or nothing: \
             {undone} instance(s) made before it destroyed{}",
            failed.gpu,
            if stuck.is_empty() {
                String::new()
            } else {
                format!(", {} left to the next start", stuck.len())
            }
        );
        if let Err(t) = lease.fail(reason.clone(), now) {
            return t.into();
        }
        let failed_id = failed.id.clone();
        let all: Vec<Partition> = made
            .into_iter()
            .chain(std::iter::once(failed))
            .chain(untouched)
            .collect();
        // Each partition as it is recorded afterwards: None = gone (or back in the
        // pool when static), Some = kept without a lease.
        let kept: Vec<Option<Partition>> = all
            .iter()
            .map(|p| {
                let mut orphan = p.clone();
                orphan.lease_id = None;
                if stuck.contains(&p.id) {
                    orphan.state = PartitionState::Destroying;
                    Some(orphan)
                } else if half_kept && p.id == failed_id {
                    Some(orphan)
                } else {
                    None
                }
            })
            .collect();
        let (l2, a2, k2) = (lease.clone(), all.clone(), kept.clone());
        let res = self
            .store
            .write(move |w| {
                w.put_lease(&l2)?;
                w.delete_tokens(&l2.id)?;
                for ((p, keep), intent) in a2.iter().zip(&k2).zip(&intents) {
                    match keep {
                        Some(orphan) if orphan.state == PartitionState::Destroying => {
                            w.put_partition(orphan)?;
                            if let Some(i) = intent {
                                w.finish_intent(*i, now, "failed")?;
                            }
                            w.begin_intent(IntentOp::DestroyMig, &orphan.id, None, now)?;
                        }
                        // The failed call's GI: its create intent stays open.
                        Some(orphan) => w.put_partition(orphan)?,
                        None => {
                            w.give_back_partition(p)?;
                            if let Some(i) = intent {
                                w.finish_intent(*i, now, "failed")?;
                            }
                        }
                    }
                }
                Ok(())
            })
            .await;
        if res.is_ok() {
            for (p, keep) in all.iter().zip(kept) {
                self.forget_reservation(&lease, p, true);
                if let Some(orphan) = keep {
                    self.lock().partitions.insert(orphan.id.clone(), orphan);
                }
            }
        }
        match e.nvml_code() {
            Some(NvmlCode::InsufficientResources) => LeaseError::ResourceExhausted(reason),
            _ => LeaseError::Hardware(e),
        }
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
        for mut lease in pending {
            let parts: Vec<Partition> = lease
                .partition_ids()
                .filter_map(|id| st.partitions.get(id).cloned())
                .collect();
            let mine: Vec<&crate::model::Intent> = intents
                .iter()
                .filter(|i| i.lease_id.as_deref() == Some(lease.id.as_str()))
                .collect();
            // Each partition's instance as it stands: complete, half (GI only) or none.
            let found: Vec<Option<MigInstance>> = parts
                .iter()
                .map(|p| {
                    let m = p.mig()?;
                    if p.state == PartitionState::Ready {
                        // Created and recorded: the record knows its ids.
                        return instances.get(&p.gpu)?.iter().find(|i| {
                            Some(i.gi_id) == m.gi_id && Some(&i.uuid) == m.uuid.as_ref()
                        });
                    }
                    // One another record names is that record's, never this one's.
                    instances.get(&p.gpu)?.iter().find(|i| {
                        i.placement == m.placement
                            && i.gi_profile_id == m.gi_profile_id
                            && !super::reconcile::claimed_by_another(st, &p.id, i)
                    })
                })
                .map(|i| i.cloned())
                .collect();
            let complete = parts.len() == lease.partition_count() as usize
                && parts.iter().zip(&found).all(|(p, f)| match &p.kind {
                    PartKind::Mig(_) => f.as_ref().is_some_and(|i| i.ci_id.is_some()),
                    _ => true,
                });
            if complete {
                let mut ready_parts = Vec::new();
                for (mut p, f) in parts.into_iter().zip(found) {
                    ready(&mut p, f);
                    ready_parts.push(p);
                }
                lease.activate()?;
                let (l2, p2) = (lease.clone(), ready_parts.clone());
                let ids: Vec<i64> = mine.iter().map(|i| i.id).collect();
                let i2 = ids.clone();
                self.store.write_blocking(move |w| {
                    for p in &p2 {
                        w.put_partition(p)?;
                    }
                    w.put_lease(&l2)?;
                    for i in &i2 {
                        w.finish_intent(*i, now, "adopted")?;
                    }
                    Ok(())
                })?;
                for p in ready_parts {
                    st.partitions.insert(p.id.clone(), p);
                }
                st.leases.insert(lease.id.clone(), lease.clone());
                resolved.extend(ids);
                info!(lease = %lease.id, "multi-partition lease found complete at start: adopted");
                continue;
            }
            // All or nothing: undo what exists.
            let mut kept: HashSet<String> = HashSet::new();
            for (p, f) in parts.iter().zip(&found) {
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
            let (l2, p2) = (lease.clone(), parts.clone());
            let ids: Vec<i64> = mine.iter().map(|i| i.id).collect();
            let i2 = ids.clone();
            self.store.write_blocking(move |w| {
                for p in &p2 {
                    w.give_back_partition(p)?;
                }
                w.put_lease(&l2)?;
                w.delete_tokens(&l2.id)?;
                for i in &i2 {
                    w.finish_intent(*i, now, "rolled back")?;
                }
                Ok(())
            })?;
            for p in &parts {
                if p.origin == Origin::Static {
                    if let Some(mut back) = st.partitions.get_mut(&p.id) {
                        back.lease_id = None;
                        back.state = PartitionState::Ready;
                    }
                } else {
                    st.partitions.remove(&p.id);
                }
            }
            st.forget_lease(&lease);
            resolved.extend(ids);
            warn!(lease = %lease.id, kept = kept.len(),
                "multi-partition lease interrupted by a crash: rolled back");
        }
        Ok(resolved)
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

/// A partition whose hardware now exists: ready, with its instance's ids.
fn ready(p: &mut Partition, inst: Option<MigInstance>) {
    p.state = PartitionState::Ready;
    if let (PartKind::Mig(m), Some(inst)) = (&mut p.kind, inst) {
        m.gi_id = Some(inst.gi_id);
        m.ci_id = inst.ci_id;
        m.uuid = Some(inst.uuid);
    }
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
