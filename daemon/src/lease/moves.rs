//! Moving idle MIG leases to make room: when a MIG request would be refused and
//! `partition.move_idle` is on, the planner (`partition::plan_with_moves`) may name
//! idle leases whose instance, created again elsewhere, frees a placement for it.
//!
//! A lease is *idle* while it is active, on a dynamic MIG partition that is ready and in
//! service, it was not pinned to its GPU (`gpu_index`), no container (and no pod) is
//! bound to it (and no pod holds it, for the Kubernetes device plugin's leases: a
//! reserved one moves, and the plugin rewrites its CDI spec), and no runtime has asked
//! for its devices
//! (ResolveToken) since the daemon started: a runtime that resolved the old devices
//! never binds to a moved instance. While a lease moves, ResolveToken and
//! BindContainer refuse it (FAILED_PRECONDITION, retry).
//!
//! One move, write-ahead:
//! 1. under the lock: the lease is checked idle and marked moving; its new partition
//!    (same GI and CI profile, new place, `creating`) is reserved in memory;
//! 2. one commit: the new partition and a `move_mig` intent naming it and the lease;
//! 3. the old instance is destroyed; 4. the new one is created;
//! 5. one commit: the old partition deleted, the new one ready, the lease pointing at
//!    it (same id, same token), the intent finished; then the `moved` event.
//!
//! If the destroy fails nothing changed: the new partition is dropped. If the create
//! fails, the instance is created again where it was; if even that fails the lease is
//! lost (revoked, its reason saying why). A crash between the steps leaves the
//! intent open, and the next start finishes or undoes the move
//! ([`LeaseManager::reconcile_move`]).

use std::collections::HashMap;

use tessera_common::clock::now_ms;
use tracing::{info, warn};

use crate::gpu::{GpuError, MigInstance};
use crate::model::{IntentOp, Lease, LeaseState, Origin, PartKind, Partition, PartitionState};
use crate::names::new_id;
use crate::partition::{self, Movable, Move};

/// Housekeeping moves at most this many idle leases per pass (the trace bench's
/// housekeeping policy moves as many after each grant and each end).
pub(super) const COMPACT_MOVES_PER_TICK: usize = crate::partition::COMPACT_MOVES_PER_PASS;

use super::error::LeaseError;
use super::events::EventKind;
use super::manager::LeaseManager;
use super::plan::{Outcome, Publish};
use super::table::State;

impl LeaseManager {
    /// The MIG instances the planner may move now (see the module doc).
    pub(super) fn movable(st: &State) -> Vec<Movable> {
        st.leases
            .values()
            .filter(|l| {
                l.state() == LeaseState::Active
                    && l.containers.is_empty()
                    && l.pod.is_none()
                    && !l.pinned_gpu
                    // A multi-partition lease was placed as a whole, by topology.
                    && l.more_partitions.is_empty()
                    // A device plugin lease a pod holds stays where it is (a reserved
                    // one moves, and the plugin rewrites its CDI spec on `moved`; it
                    // pins the lease when kubelet allocates it).
                    && !l.labels.contains_key(crate::names::LABEL_K8S_POD)
                    && !st.resolved.contains(&l.id)
                    && !st.moving.contains(&l.id)
                    && !st.tearing_down.contains(&l.id)
            })
            .filter_map(|l| {
                let p = st.partitions.get(&l.partition_id)?;
                let m = p.mig()?;
                let idle = p.origin == Origin::Dynamic
                    && p.state == PartitionState::Ready
                    && st.unhealthy(p.gpu, None).is_none()
                    && st.unhealthy(p.gpu, m.gi_id).is_none();
                idle.then_some(Movable {
                    gpu: p.gpu,
                    placement: m.placement,
                })
            })
            .collect()
    }

    /// Housekeeping (`[partition] compact_idle`): up to [`COMPACT_MOVES_PER_TICK`]
    /// moves of idle leases, each the one that most raises the node's free-space value
    /// (`partition::compact`), so that large requests find room without waiting for a
    /// refusal to move anything. Returns how many leases moved; a failed move ends the
    /// pass (logged here).
    pub(super) async fn compact_idle(&self) -> usize {
        let opts = self.plan_options(None);
        let mut moved = 0;
        for _ in 0..COMPACT_MOVES_PER_TICK {
            let mv = {
                let st = self.read();
                let views = Self::placeable_views(&st);
                partition::compact(&views, &opts, &Self::movable(&st))
            };
            let Some(mv) = mv else {
                break;
            };
            match self.move_idle(&mv, "to compact free space").await {
                Ok(()) => moved += 1,
                Err(e) => {
                    warn!(error = %e, from_gpu = mv.from_gpu, to_gpu = mv.to_gpu, "housekeeping move of an idle lease failed");
                    break;
                }
            }
        }
        moved
    }

    /// Do one move the planner chose. Errors leave the lease where it was, except a
    /// lease whose instance could be created neither at its new nor at its old place
    /// (then it is lost, and its watchers are told).
    pub(super) async fn move_idle(&self, mv: &Move, why: &'static str) -> Result<(), LeaseError> {
        let now = now_ms();
        let (lease, old, new) = {
            let mut st = self.change();
            let (lease, old, new) = Self::decide_move(&st, mv)?;
            st.partitions.insert(new.id.clone(), new.clone());
            st.moving.insert(lease.id.clone());
            (lease, old, new)
        };
        let result = self.move_steps(&lease, &old, new, now, why).await;
        self.move_finished(&lease.id);
        result
    }

    /// The move `mv` checked against the table as it is now: the lease, its
    /// partition, and the partition it gets at the target (creating). Reads only
    /// `st`.
    fn decide_move(st: &State, mv: &Move) -> Result<(Lease, Partition, Partition), LeaseError> {
        if !Self::movable(st)
            .iter()
            .any(|m| m.gpu == mv.from_gpu && m.placement == mv.from)
        {
            return Err(LeaseError::FailedPrecondition(format!(
                "the instance at gpu{} slice {} is no longer idle",
                mv.from_gpu, mv.from.start
            )));
        }
        let Some(old) = st
            .partitions
            .on_gpu(mv.from_gpu)
            .0
            .find(|p| p.mig().is_some_and(|m| m.placement == mv.from) && p.lease_id.is_some())
            .cloned()
        else {
            return Err(LeaseError::FailedPrecondition(
                "the instance to move is gone".into(),
            ));
        };
        // The target, planned before the lock was let go, may have been taken
        // since by a lease created meanwhile: never two instances at one place.
        if Self::target_taken(st, mv, &old.id) {
            return Err(LeaseError::FailedPrecondition(format!(
                "gpu{} slice {} was taken since the move was planned",
                mv.to_gpu, mv.to.start
            )));
        }
        let lease_id = old.lease_id.clone().unwrap_or_default();
        let Some(lease) = st.leases.get(&lease_id).cloned() else {
            return Err(LeaseError::FailedPrecondition(
                "the lease to move is gone".into(),
            ));
        };
        let Some(gpu_uuid) = st
            .gpus
            .iter()
            .find(|g| g.info.index == mv.to_gpu)
            .map(|g| g.info.uuid.clone())
        else {
            return Err(LeaseError::Inconsistent(
                super::error::Inconsistency::UnknownGpu(mv.to_gpu),
            ));
        };
        let mut kind = old.kind.clone();
        if let PartKind::Mig(m) = &mut kind {
            m.placement = mv.to;
            m.gi_id = None;
            m.ci_id = None;
            m.uuid = None;
        }
        let new = Partition {
            id: new_id("p-"),
            gpu: mv.to_gpu,
            gpu_uuid,
            origin: Origin::Dynamic,
            state: PartitionState::Creating,
            lease_id: Some(lease_id),
            kind,
        };
        Ok((lease, old, new))
    }

    /// Whether anything but partition `moving` (a recorded instance or a foreign
    /// one) overlaps the move's target.
    fn target_taken(st: &State, mv: &Move, moving: &str) -> bool {
        st.partitions
            .on_gpu(mv.to_gpu)
            .0
            .filter(|p| p.id != moving)
            .filter_map(|p| p.mig())
            .map(|m| m.placement)
            .chain(
                st.foreign
                    .iter()
                    .filter(|f| f.gpu == mv.to_gpu)
                    .map(|f| f.placement),
            )
            .any(|at| at.overlaps(&mv.to))
    }

    /// The move, write-ahead: the new partition and a `move_mig` intent; the old
    /// instance destroyed; the new one created (else the old one again); the
    /// outcome; publish.
    async fn move_steps(
        &self,
        lease: &Lease,
        old: &Partition,
        mut new: Partition,
        now: i64,
        why: &'static str,
    ) -> Result<(), LeaseError> {
        let intent = self
            .write_partition_intent(&new, IntentOp::MoveMig, Some(&lease.id), now)
            .await?;
        let (Some(old_mig), Some(new_mig)) = (old.mig().cloned(), new.mig().cloned()) else {
            return Err(LeaseError::Inconsistent(
                super::error::Inconsistency::ShapeMismatch {
                    decision: "a MIG move",
                    shape: "non-MIG",
                },
            ));
        };
        // Step 3: the old instance goes.
        self.destroy_moved_from(old, &old_mig, &new, intent).await?;
        // Step 4: the new one, else the old one again.
        let (gpu, profile, to, ci) = (
            new.gpu,
            new_mig.gi_profile_id,
            new_mig.placement,
            new_mig.ci_profile_id,
        );
        let created = self
            .blocking(move |b| b.create_instance(gpu, profile, to, ci))
            .await;
        let inst = match created {
            Ok(inst) => inst,
            Err(e) => {
                // A create can fail with its GI made and no CI (an error between
                // the two NVML steps): that GI goes before the old place is used.
                self.undo_half_or_set_aside(gpu, &new_mig).await;
                return Err(self.move_back(lease, old, &new, intent, e).await);
            }
        };
        super::executor::ready(&mut new, Some(inst));
        let moved = self.record_moved(lease, old, &new, intent).await?;
        let msg = format!(
            "moved {why}: gpu{} slice {} -> gpu{} slice {} (new MIG device UUID)",
            old.gpu, old_mig.placement.start, new.gpu, new_mig.placement.start
        );
        info!(lease = %moved.id, from_gpu = old.gpu, to_gpu = new.gpu, "idle lease moved");
        self.emit(EventKind::Moved, &moved, Some(&new), msg);
        Ok(())
    }

    /// Step 3 of a move: the old instance destroyed. When it cannot be, the move
    /// is given up: the new partition's record goes and the intent fails.
    async fn destroy_moved_from(
        &self,
        old: &Partition,
        old_mig: &crate::model::MigPart,
        new: &Partition,
        intent: i64,
    ) -> Result<(), LeaseError> {
        let destroyed = match old_mig.gi_id {
            Some(gi) => {
                let og = old.gpu;
                self.blocking(move |b| b.destroy_instance(og, gi)).await
            }
            None => Ok(()),
        };
        let Err(e) = destroyed else {
            return Ok(());
        };
        // If this is not recorded, the next start resolves the open intent.
        let _ = self.drop_partition_intent(&new.id, intent).await;
        Err(LeaseError::Hardware(e))
    }

    /// The outcome of a move: the lease as it is now (renewals and ends wait for
    /// the move, but one that began just before it may have changed it), pointing
    /// at the new partition, in memory first, then durably. If the commit fails,
    /// memory still follows the hardware and the open intent finishes the move at
    /// the next start.
    async fn record_moved(
        &self,
        lease: &Lease,
        old: &Partition,
        new: &Partition,
        intent: i64,
    ) -> Result<Lease, LeaseError> {
        let moved = self
            .publish_then_commit(|st| {
                let mut moved = st
                    .leases
                    .get(&lease.id)
                    .cloned()
                    .unwrap_or_else(|| lease.clone());
                moved.partition_id = new.id.clone();
                moved.gpu = new.gpu;
                let outcome = Outcome {
                    gone: vec![old.id.clone()],
                    parts: vec![new.clone()],
                    leases: vec![moved.clone()],
                    finished: vec![(intent, now_ms(), "moved")],
                    ..Outcome::default()
                };
                (outcome, moved)
            })
            .await?;
        Ok(moved)
    }

    /// The new instance could not be created: create the old one again. If that fails
    /// too, the lease is lost.
    async fn move_back(
        &self,
        lease: &Lease,
        old: &Partition,
        new: &Partition,
        intent: i64,
        cause: GpuError,
    ) -> LeaseError {
        let Some(m) = old.mig().cloned() else {
            return LeaseError::Hardware(cause);
        };
        let gpu = old.gpu;
        let (profile, at, ci) = (m.gi_profile_id, m.placement, m.ci_profile_id);
        let again = self
            .blocking(move |b| b.create_instance(gpu, profile, at, ci))
            .await;
        let now = now_ms();
        match again {
            Ok(inst) => {
                let mut back = old.clone();
                if let PartKind::Mig(mm) = &mut back.kind {
                    mm.gi_id = Some(inst.gi_id);
                    mm.ci_id = inst.ci_id;
                    mm.uuid = Some(inst.uuid);
                }
                let back = Outcome {
                    gone: vec![new.id.clone()],
                    parts: vec![back],
                    finished: vec![(intent, now, "failed")],
                    ..Outcome::default()
                };
                match self.commit(back, Publish::Always).await {
                    Ok(()) => LeaseError::Hardware(cause),
                    Err(e) => e.into(),
                }
            }
            Err(e2) => {
                warn!(lease = %lease.id, error = %e2, "a moved lease's instance could be created neither at its new nor at its old place; the lease is lost");
                self.undo_half_or_set_aside(gpu, &m).await;
                let current = self.read().leases.get(&lease.id).cloned();
                let mut lost = current.unwrap_or_else(|| lease.clone());
                if let Err(t) = lost.lose(
                    format!("its MIG instance was being moved and could not be created again: {cause}; {e2}"),
                    now,
                ) {
                    return t.into();
                }
                let gone = Outcome {
                    gone: vec![old.id.clone(), new.id.clone()],
                    ended: vec![lost.clone()],
                    finished: vec![(intent, now, "failed")],
                    ..Outcome::default()
                };
                let res = self.commit(gone, Publish::Always).await;
                self.emit(EventKind::Revoked, &lost, None, lost_reason(&lost));
                match res {
                    Ok(()) => LeaseError::Hardware(cause),
                    Err(e) => e.into(),
                }
            }
        }
    }

    /// Ending or renewing a lease waits while it moves (a move takes two hardware
    /// calls), so the move's final record and theirs never cross.
    pub(super) async fn wait_while_moving(&self, id: &str) {
        for _ in 0..12_000 {
            if !self.read().moving.contains(id) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// A backend call on the blocking pool (unless the backend's MIG calls are quick).
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn crate::gpu::GpuBackend) -> Result<T, GpuError> + Send + 'static,
    ) -> Result<T, GpuError> {
        let backend = self.backend.clone();
        if backend.instance_calls_are_quick() {
            return f(backend.as_ref());
        }
        tokio::task::spawn_blocking(move || f(backend.as_ref()))
            .await
            .map_err(|e| GpuError::Task(e.to_string()))?
    }

    /// At start, an open `move_mig` intent (`new` is the partition it names): the old
    /// instance is destroyed if still there, then the new one adopted or created; the
    /// lease ends up on the new partition. If the old one cannot be destroyed, the move
    /// is undone instead (the lease stays where it was). If the new one cannot be
    /// created, the old one is made again at its place; if that fails too, the lease
    /// is lost.
    pub(super) fn reconcile_move(
        &self,
        st: &mut State,
        instances: &mut HashMap<u32, Vec<MigInstance>>,
        new: &Partition,
        iid: i64,
        now: i64,
    ) -> Result<(), LeaseError> {
        let lease = new
            .lease_id
            .as_ref()
            .and_then(|l| st.leases.get(l).cloned());
        let Some(lease) = lease else {
            let orphan = Outcome {
                gone: vec![new.id.clone()],
                finished: vec![(iid, now, "orphan")],
                ..Outcome::default()
            };
            self.commit_at_start(st, orphan)?;
            return Ok(());
        };
        let Some(nm) = new.mig().cloned() else {
            return Ok(());
        };
        let old = st
            .partitions
            .get(&lease.partition_id)
            .filter(|p| p.id != new.id)
            .cloned();
        // The old instance first: while it exists the lease stays on it.
        if let Some(old) = &old
            && let Some(om) = old.mig()
        {
            // At its place: the instance itself, or one a move back made again (a
            // new GI id and UUID, whole or half made) before the crash recorded it.
            let list = instances.entry(old.gpu).or_default();
            let present = list
                .iter()
                .find(|i| i.placement == om.placement && i.gi_profile_id == om.gi_profile_id)
                .filter(|i| !super::reconcile::claimed_by_another(st, &old.id, i))
                .cloned();
            if let Some(there) = present {
                let gi = there.gi_id;
                if let Err(e) = self.backend.destroy_instance(old.gpu, gi) {
                    warn!(lease = %lease.id, error = %e, "an interrupted move cannot destroy the old instance; the lease stays where it was");
                    return self.roll_back_move_at_start(
                        st,
                        instances,
                        old,
                        (new, &nm),
                        &there,
                        (iid, now),
                    );
                }
                list.retain(|i| i.gi_id != gi);
            }
        }
        let old_id = old.as_ref().map(|p| p.id.clone());
        match self.new_instance_at_start(st, instances, new, &nm) {
            Ok(inst) => self.moved_at_start(st, lease, new, inst, old_id, (iid, now)),
            Err(e) => {
                // A GI made without its CI goes, or is set aside as foreign.
                if let Some(left) =
                    super::executor::undo_half_or_left(self.backend.as_ref(), new.gpu, &nm)
                {
                    instances.entry(new.gpu).or_default().push(left);
                }
                // Back where it was, as a move that fails while the daemon runs.
                if let Some(old) = &old
                    && self.move_back_at_start(st, instances, old, new, iid, now)?
                {
                    return Ok(());
                }
                warn!(lease = %lease.id, error = %e, "an interrupted move can create the instance neither at its new nor at its old place; the lease is lost");
                self.lost_in_move_at_start(st, lease, new, old_id, &e, (iid, now))
            }
        }
    }

    /// An interrupted move whose old instance (`there`) cannot be destroyed: the
    /// new one goes if it was made, and the lease stays on the old one.
    fn roll_back_move_at_start(
        &self,
        st: &mut State,
        instances: &mut HashMap<u32, Vec<MigInstance>>,
        old: &Partition,
        (new, nm): (&Partition, &crate::model::MigPart),
        there: &MigInstance,
        (iid, now): (i64, i64),
    ) -> Result<(), LeaseError> {
        let found = instances
            .entry(new.gpu)
            .or_default()
            .iter()
            .find(|i| i.placement == nm.placement && i.gi_profile_id == nm.gi_profile_id)
            .cloned();
        if let Some(inst) = found
            && self.backend.destroy_instance(inst.gpu, inst.gi_id).is_ok()
        {
            instances
                .entry(new.gpu)
                .or_default()
                .retain(|i| i.gi_id != inst.gi_id);
        }
        // The lease's record names the instance that stays (a move back's has a
        // new GI id and UUID).
        let mut kept = old.clone();
        if let PartKind::Mig(m) = &mut kept.kind
            && there.ci_id.is_some()
        {
            m.gi_id = Some(there.gi_id);
            m.ci_id = there.ci_id;
            m.uuid = Some(there.uuid.clone());
        }
        let rolled_back = Outcome {
            gone: vec![new.id.clone()],
            parts: vec![kept],
            finished: vec![(iid, now, "rolled back")],
            ..Outcome::default()
        };
        Ok(self.commit_at_start(st, rolled_back)?)
    }

    /// The new instance of an interrupted move: adopted when it exists complete,
    /// else created (a half-made one destroyed first). One another record names is
    /// that record's: then the place is taken, and creating there fails.
    fn new_instance_at_start(
        &self,
        st: &State,
        instances: &mut HashMap<u32, Vec<MigInstance>>,
        new: &Partition,
        nm: &crate::model::MigPart,
    ) -> Result<MigInstance, GpuError> {
        let list = instances.entry(new.gpu).or_default();
        let found = list
            .iter()
            .find(|i| i.placement == nm.placement && i.gi_profile_id == nm.gi_profile_id)
            .filter(|i| !super::reconcile::claimed_by_another(st, &new.id, i))
            .cloned();
        match found {
            Some(i) if i.ci_id.is_some() => Ok(i),
            half => {
                if let Some(h) = half
                    && self.backend.destroy_instance(h.gpu, h.gi_id).is_ok()
                {
                    list.retain(|i| i.gi_id != h.gi_id);
                }
                let created = self.backend.create_instance(
                    new.gpu,
                    nm.gi_profile_id,
                    nm.placement,
                    nm.ci_profile_id,
                );
                if let Ok(i) = &created {
                    list.push(i.clone());
                }
                created
            }
        }
    }

    /// An interrupted move finished at start: the lease on the new instance, the
    /// old record gone.
    fn moved_at_start(
        &self,
        st: &mut State,
        mut lease: Lease,
        new: &Partition,
        inst: MigInstance,
        old_id: Option<String>,
        (iid, now): (i64, i64),
    ) -> Result<(), LeaseError> {
        let mut p = new.clone();
        super::executor::ready(&mut p, Some(inst));
        lease.partition_id = p.id.clone();
        lease.gpu = p.gpu;
        let moved = Outcome {
            gone: old_id.into_iter().collect(),
            parts: vec![p],
            leases: vec![lease],
            finished: vec![(iid, now, "moved")],
            ..Outcome::default()
        };
        Ok(self.commit_at_start(st, moved)?)
    }

    /// An interrupted move whose instance can be made neither at its new nor at its
    /// old place: the lease is lost and both records go.
    fn lost_in_move_at_start(
        &self,
        st: &mut State,
        mut lease: Lease,
        new: &Partition,
        old_id: Option<String>,
        e: &GpuError,
        (iid, now): (i64, i64),
    ) -> Result<(), LeaseError> {
        lease.lose(
            format!("its MIG instance was being moved when the daemon stopped and could not be created again: {e}"),
            now,
        )?;
        let lost = Outcome {
            gone: old_id.into_iter().chain([new.id.clone()]).collect(),
            ended: vec![lease],
            finished: vec![(iid, now, "failed")],
            ..Outcome::default()
        };
        Ok(self.commit_at_start(st, lost)?)
    }
}

impl LeaseManager {
    /// At start, an interrupted move whose new instance cannot be made: the old one
    /// is made again at its place (a new GI id and UUID) and the lease stays on it.
    /// False when that fails too.
    fn move_back_at_start(
        &self,
        st: &mut State,
        instances: &mut HashMap<u32, Vec<MigInstance>>,
        old: &Partition,
        new: &Partition,
        iid: i64,
        now: i64,
    ) -> Result<bool, LeaseError> {
        let Some(om) = old.mig().cloned() else {
            return Ok(false);
        };
        let inst = match self.backend.create_instance(
            old.gpu,
            om.gi_profile_id,
            om.placement,
            om.ci_profile_id,
        ) {
            Ok(i) => i,
            Err(e) => {
                warn!(partition = %old.id, error = %e, "an interrupted move cannot make the instance again at its old place either");
                if let Some(left) =
                    super::executor::undo_half_or_left(self.backend.as_ref(), old.gpu, &om)
                {
                    instances.entry(old.gpu).or_default().push(left);
                }
                return Ok(false);
            }
        };
        let mut back = old.clone();
        back.state = PartitionState::Ready;
        if let PartKind::Mig(m) = &mut back.kind {
            m.gi_id = Some(inst.gi_id);
            m.ci_id = inst.ci_id;
            m.uuid = Some(inst.uuid.clone());
        }
        instances.entry(old.gpu).or_default().push(inst);
        let moved_back = Outcome {
            gone: vec![new.id.clone()],
            parts: vec![back],
            finished: vec![(iid, now, "moved back")],
            ..Outcome::default()
        };
        self.commit_at_start(st, moved_back)?;
        warn!(partition = %old.id, "an interrupted move could not finish: the lease's instance was made again at its old place (new MIG device UUID)");
        Ok(true)
    }
}

fn lost_reason(l: &Lease) -> String {
    l.end_reason().unwrap_or_default().to_string()
}
