//! The executor: every CreateLease plan is run here, the same way. A `Place` plan
//! goes through one sequence whatever the lease holds (one partition or several,
//! with or without a hardware step):
//!
//! 1. reserve in the table, under the lock the decision read it with, so no
//!    concurrent call takes the same capacity ([`LeaseManager::reserve`]);
//! 2. intent: the lease, its partitions, its token and one intent per hardware
//!    step, in one durable commit;
//! 3. hardware: each step in order; on a failure, what was made is undone and the
//!    failure recorded in one commit (all or nothing);
//! 4. outcome: the partitions ready, the lease active and the intents finished, in
//!    one commit;
//! 5. publish: the lease in the table and known by its token, waiting retries
//!    woken, watchers told.
//!
//! The other plans act and hand back to the decision: preempt burst leases, move
//! idle ones, wait for teardowns.
//!
//! A change outside a hardware sequence (a binding, a renewal, a new owner) is a
//! [`Change`] its decision answers from the table; [`LeaseManager::run_change`]
//! applies it under that lock, runs its host step, commits it through the same
//! outcome writer and undoes it if refused. What the table alone holds (a teardown
//! begun, notices, back-offs) is an outcome's [`Marks`].

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tessera_common::clock::now_ms;
use tokio::sync::{Notify, broadcast};
use tracing::{info, warn};

use crate::store::Writer;

use crate::config::{Amounts, TenancyConfig};
use crate::gpu::{GpuBackend, GpuError, MigInstance, NvmlCode};
use crate::model::{
    IntentOp, Lease, LeaseState, MigPart, Origin, PartKind, Partition, PartitionState,
};
use crate::store::StoreError;

use super::error::LeaseError;
use super::events::EventKind;
use super::manager::{LeaseManager, mps_dirs};
use super::outcome::{Replaced, apply, write_outcome_rows};
use super::plan::{
    Ask, Change, Created, DestroyError, Durability, HwCreate, HwDestroy, Outcome, Placement, Plan,
    Publish,
};
use super::table::State;
use super::token;

/// A failed hardware step of a placement: the partitions made before it, the one
/// that failed, those not tried, and why.
struct Failure {
    made: Vec<Partition>,
    failed: Partition,
    untouched: Vec<Partition>,
    error: GpuError,
}

impl LeaseManager {
    /// Decide about `ask` and reserve what the plan places (or count the capacity a
    /// preemption frees as this request's), under one lock. `holding`: the last
    /// plan of this request was a preemption or a wait, whose capacity claim this
    /// decision gives back.
    pub(super) fn reserve(
        &self,
        ask: &Ask<'_>,
        tenancy: &TenancyConfig,
        extra: Amounts,
        (rounds, holding): (u32, bool),
        notify: &Arc<Notify>,
    ) -> Result<Plan, LeaseError> {
        let mut st = self.lock();
        if holding {
            st.preempting = st.preempting.saturating_sub(1);
        }
        let plan = self.decide(&st, ask, tenancy, extra, rounds)?;
        match &plan {
            Plan::Place(placed) => hold(&mut st, placed, notify),
            Plan::Preempt(_) | Plan::WaitTeardowns => st.preempting += 1,
            Plan::Move(..) | Plan::SameRequest => {}
        }
        Ok(plan)
    }

    /// The table held while the caller changes it (left to a replayed
    /// CreateLease's new token and a move's start; every other change is a [`Change`] run by
    /// [`Self::run_change`], or an outcome applied by [`Self::hold_in_table`],
    /// [`Self::commit`] or [`Self::publish_only`]). Reads go through
    /// [`LeaseManager::read`].
    pub(super) fn change(&self) -> std::sync::MutexGuard<'_, State> {
        self.lock()
    }

    /// Run a `Place` plan already reserved: intent, hardware, outcome, publish.
    pub(super) async fn execute(&self, placed: Placement, now: i64) -> Result<Created, LeaseError> {
        let tok = token::generate();
        let tok_hash = token::hash(&tok);
        let intents = self.write_intent(&placed, &tok_hash, now).await?;
        let Placement { mut lease, parts } = placed;
        if parts.iter().all(|(_, hw)| hw.is_none()) {
            // Static-pool instances or whole GPUs: nothing to change on the
            // hardware, the lease is active as recorded.
            let parts = parts.into_iter().map(|(p, _)| p).collect();
            return Ok(self.publish(lease, parts, tok_hash, tok));
        }
        let made = match self.build(parts).await {
            Ok(made) => made,
            Err(f) => return Err(self.record_failure(lease, f, intents).await),
        };
        lease.activate()?;
        self.write_outcome(&lease, &made, intents).await?;
        Ok(self.publish(lease, made, tok_hash, tok))
    }

    /// Step 2: the lease, every partition, the token and one intent per hardware
    /// step, in one durable commit (the intent ids in the partitions' order). On
    /// failure nothing was written and the reservation is given back.
    async fn write_intent(
        &self,
        placed: &Placement,
        tok_hash: &str,
        now: i64,
    ) -> Result<Vec<Option<i64>>, LeaseError> {
        let ops: Vec<(Partition, Option<IntentOp>)> = placed
            .parts
            .iter()
            .map(|(p, hw)| (p.clone(), hw.as_ref().map(HwCreate::intent)))
            .collect();
        let (l2, h2) = (placed.lease.clone(), tok_hash.to_string());
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
            for (p, _) in &placed.parts {
                self.forget_reservation(&placed.lease, p, true);
            }
            match e {
                StoreError::DuplicateRequest { .. } => LeaseError::FailedPrecondition(
                    "a lease with this request_id is being created concurrently; retry".into(),
                ),
                e => e.into(),
            }
        })
    }

    /// Step 3: each hardware step in order; the partitions, ready. Stops at the
    /// first that fails.
    async fn build(
        &self,
        parts: Vec<(Partition, Option<HwCreate>)>,
    ) -> Result<Vec<Partition>, Failure> {
        let mut made: Vec<Partition> = Vec::with_capacity(parts.len());
        let mut steps = parts.into_iter();
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
                Err(error) => {
                    return Err(Failure {
                        made,
                        failed: p,
                        untouched: steps.map(|(p, _)| p).collect(),
                        error,
                    });
                }
            }
        }
        Ok(made)
    }

    /// Step 4: the partitions ready, the lease active, the intents finished, in
    /// one commit. If this fails, the hardware exists and the intents stay open:
    /// the next start adopts it. The reservation is kept so nothing else takes it.
    async fn write_outcome(
        &self,
        lease: &Lease,
        made: &[Partition],
        intents: Vec<Option<i64>>,
    ) -> Result<(), LeaseError> {
        let done_at = now_ms();
        let outcome = Outcome {
            parts: made.to_vec(),
            leases: vec![lease.clone()],
            finished: Outcome::finishing(intents, done_at, "done"),
            ..Outcome::default()
        };
        self.store_outcome(outcome).await?;
        Ok(())
    }

    /// Step 5: every partition and the lease in the table, the token known,
    /// retries woken, watchers told.
    fn publish(
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
        if parts.len() > 1 {
            self.emit(
                EventKind::Created,
                &lease,
                first.as_ref(),
                format!("{} partitions", parts.len()),
            );
            info!(lease = %lease.id, tenant = %lease.tenant,
                gpus = ?parts.iter().map(|p| p.gpu).collect::<Vec<_>>(), "multi-partition lease created");
        } else {
            self.emit(EventKind::Created, &lease, first.as_ref(), String::new());
            info!(lease = %lease.id, tenant = %lease.tenant, gpu = lease.gpu, "lease created");
        }
        Created {
            lease,
            partition: first,
            token: Some(tok),
            replayed: false,
        }
    }

    /// Step 3 failed: destroy the partitions made (and a GI the failed call left),
    /// fail the lease and give every place back, in one commit. A partition that
    /// cannot be destroyed keeps its record without a lease: a complete instance
    /// under a `destroy_mig` intent, the failed call's GI under its open
    /// `create_mig` intent; the next start finishes either. Returns the refusal.
    async fn record_failure(
        &self,
        mut lease: Lease,
        f: Failure,
        intents: Vec<Option<i64>>,
    ) -> LeaseError {
        let now = now_ms();
        let total = f.made.len() + 1 + f.untouched.len();
        let undo = self.undo_made(&lease, &f).await;
        let reason = if total == 1 {
            format!("hardware set-up failed: {}", f.error)
        } else {
            undo.reason(&f, total)
        };
        if let Err(t) = lease.fail(reason.clone(), now) {
            return t.into();
        }
        let Failure {
            made,
            failed,
            untouched,
            error,
        } = f;
        let failed_gpu = failed.gpu;
        let all: Vec<Partition> = made
            .into_iter()
            .chain(std::iter::once(failed))
            .chain(untouched)
            .collect();
        let kept: Vec<Option<Partition>> = all.iter().map(|p| undo.kept(p)).collect();
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
        match error.nvml_code() {
            Some(NvmlCode::InsufficientResources) if total == 1 => LeaseError::ResourceExhausted(
                format!("GPU {failed_gpu} has no room for this instance: {error}"),
            ),
            Some(NvmlCode::InsufficientResources) => LeaseError::ResourceExhausted(reason),
            _ => LeaseError::Hardware(error),
        }
    }

    /// The hardware side of a failure: the dynamic instances made are destroyed and
    /// the failed call's half-made GI undone; what could not be is remembered.
    async fn undo_made(&self, lease: &Lease, f: &Failure) -> Undo {
        let mut undo = Undo::default();
        for p in &f.made {
            let Some(m) = p.mig() else { continue };
            if p.origin != Origin::Dynamic {
                continue;
            }
            let Some(gi_id) = m.gi_id else { continue };
            let gone = self
                .destroy_hw(HwDestroy::Mig { gpu: p.gpu, gi_id })
                .await
                .map_err(|e| match e {
                    DestroyError::Hardware(e) => e,
                    task => GpuError::Task(task.into_lease_error().to_string()),
                });
            match gone {
                Ok(()) => undo.destroyed += 1,
                Err(d) => {
                    warn!(lease = %lease.id, partition = %p.id, error = %d,
                        "could not destroy an instance of a failed multi-partition lease; the next start does");
                    undo.stuck.insert(p.id.clone());
                }
            }
        }
        if let PartKind::Mig(m) = &f.failed.kind
            && let Err(d) = self.undo_half_create(f.failed.gpu, m).await
        {
            warn!(lease = %lease.id, gpu = f.failed.gpu, error = %d,
                "could not destroy the GI of a failed create; the next start undoes it");
            undo.half_kept = Some(f.failed.id.clone());
        }
        undo
    }

    /// The intent of a hardware step on partition `p` outside a CreateLease (a
    /// host instance for MPS shares, the new place of a moved lease): its record
    /// (already in the table) and the intent, in one durable commit. On failure
    /// the partition leaves the table again.
    pub(super) async fn write_partition_intent(
        &self,
        p: &Partition,
        op: IntentOp,
        lease_id: Option<&str>,
        now: i64,
    ) -> Result<i64, LeaseError> {
        let (p2, lid) = (p.clone(), lease_id.map(str::to_string));
        let written = self
            .store
            .write(move |w| {
                w.put_partition(&p2)?;
                w.begin_intent(op, &p2.id, lid.as_deref(), now)
            })
            .await;
        written.map_err(|e| {
            self.lock().partitions.remove(&p.id);
            e.into()
        })
    }

    /// A step of [`Self::write_partition_intent`] given up before it changed
    /// anything: the partition's record goes and its intent fails, in one commit,
    /// then it leaves the table. If the commit fails, both stay for the next start.
    pub(super) async fn drop_partition_intent(
        &self,
        partition_id: &str,
        intent: i64,
    ) -> Result<(), StoreError> {
        let (pid, now) = (partition_id.to_string(), now_ms());
        self.store
            .write(move |w| {
                w.delete_partition(&pid)?;
                w.finish_intent(intent, now, "failed")
            })
            .await?;
        self.lock().partitions.remove(partition_id);
        Ok(())
    }

    /// A `Move` plan: the idle leases moved, one after another; the refusal when
    /// one cannot be.
    pub(super) async fn make_room(
        &self,
        moves: &[crate::partition::Move],
        refusal: &str,
    ) -> Result<(), LeaseError> {
        for m in moves {
            if let Err(e) = self.move_idle(m, "to make room").await {
                warn!(error = %e, "moving an idle lease to make room failed");
                return Err(LeaseError::ResourceExhausted(format!(
                    "{refusal}; moving an idle lease to make room failed: {e}"
                )));
            }
        }
        Ok(())
    }

    /// Wait (at most `limit`) until the teardowns running now have finished.
    pub(super) async fn wait_for_teardowns(&self, limit: Duration) {
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
    pub(super) async fn preempt(&self, victims: &[String], for_tenant: &str) {
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

    pub(super) async fn undo_half_create(&self, gpu: u32, m: &MigPart) -> Result<(), GpuError> {
        let backend = self.backend.clone();
        let m = m.clone();
        tokio::task::spawn_blocking(move || undo_half(backend.as_ref(), gpu, &m))
            .await
            .map_err(|e| GpuError::Task(e.to_string()))?
    }

    /// `undo_half_create` where nothing records the placement afterwards: if the
    /// driver refuses, the GI left is set aside as foreign (its slices occupied, no
    /// lease placed over it) and the operator is told how to remove it.
    pub(super) async fn undo_half_or_set_aside(&self, gpu: u32, m: &MigPart) {
        let backend = self.backend.clone();
        let m = m.clone();
        match tokio::task::spawn_blocking(move || undo_half_or_left(backend.as_ref(), gpu, &m))
            .await
        {
            Ok(Some(left)) => self.lock().foreign.push(left),
            Ok(None) => {}
            Err(e) => warn!(gpu, error = %e,
                "the check for a MIG instance a failed create may have left half made did not finish; \
                 the next start sets any such instance aside"),
        }
    }

    pub(super) fn forget_reservation(
        &self,
        lease: &Lease,
        partition: &Partition,
        undo_static: bool,
    ) {
        let mut st = self.lock();
        st.forget_lease(lease);
        if partition.origin == Origin::Static && undo_static {
            if let Some(mut p) = st.partitions.get_mut(&partition.id) {
                p.lease_id = None;
            }
        } else {
            st.partitions.remove(&partition.id);
        }
        if let Some(n) = st.pending.remove(&lease.id) {
            n.notify_waiters();
        }
    }

    pub(super) async fn hw_create(&self, hw: HwCreate) -> Result<Option<MigInstance>, GpuError> {
        match &hw {
            HwCreate::Mps(spec) => {
                let key = spec.lease_id.clone();
                self.mps_server_step(&key, self.hw_create_now(hw)).await
            }
            HwCreate::Mig { .. } => self.hw_create_now(hw).await,
        }
    }

    /// One MPS server's steps one at a time: a share that joins a shared server
    /// while the server's last lease stops it and removes its directories waits for
    /// the stop, then starts the server again; it never finds its directories gone
    /// halfway.
    pub(super) async fn mps_server_step<T>(&self, key: &str, step: impl Future<Output = T>) -> T {
        let lock = self
            .mps_steps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.to_string())
            .or_default()
            .clone();
        let out = {
            let _one = lock.lock().await;
            step.await
        };
        let mut steps = self.mps_steps.lock().unwrap_or_else(|p| p.into_inner());
        // The map's and this step's: nobody else waits on this server.
        if Arc::strong_count(&lock) == 2 {
            steps.remove(key);
        }
        out
    }

    async fn hw_create_now(&self, hw: HwCreate) -> Result<Option<MigInstance>, GpuError> {
        let (backend, host) = (self.backend.clone(), self.host.clone());
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
                mps_dirs(host.as_ref(), &spec)?;
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
}

/// The one commit sequence's last steps, for every plan: the outcome written in
/// one durable commit, then the table.
impl LeaseManager {
    /// Steps 4 and 5 of a plan that is not a CreateLease (a teardown, a move): the
    /// outcome, durably, then in the table (`publish` says whether the table takes
    /// it when the commit fails).
    pub(super) async fn commit(
        &self,
        outcome: Outcome,
        publish: Publish,
    ) -> Result<(), StoreError> {
        let written = self.store_outcome(outcome.clone()).await;
        if written.is_ok() || publish == Publish::Always {
            if !outcome.quota_grants.is_empty() {
                self.grants
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend(outcome.quota_grants.iter().cloned());
            }
            apply(&mut self.lock(), outcome);
        }
        written
    }

    /// Start: the table loaded and reconciled with the hardware is served.
    pub(super) fn serve(&self, st: State) {
        *self.lock() = st;
    }

    /// The intent of a hardware step on partition `p` at start, its record
    /// already stored (an instance that vanished, created again), in one durable
    /// commit.
    pub(super) fn begin_intent_at_start(
        &self,
        op: IntentOp,
        p: &Partition,
        now: i64,
    ) -> Result<i64, StoreError> {
        let (pid, lid) = (p.id.clone(), p.lease_id.clone());
        self.store
            .write_blocking(move |w| w.begin_intent(op, &pid, lid.as_deref(), now))
    }

    /// [`Self::write_partition_intent`] from a thread that may block (start-up's
    /// static layout): the record of partition `p` (creating) in the table, then
    /// it and its intent in one durable commit.
    pub(super) fn write_partition_intent_blocking(
        &self,
        p: &Partition,
        op: IntentOp,
        now: i64,
    ) -> Result<i64, StoreError> {
        self.lock().partitions.insert(p.id.clone(), p.clone());
        let p2 = p.clone();
        self.store.write_blocking(move |w| {
            w.put_partition(&p2)?;
            w.begin_intent(op, &p2.id, None, now)
        })
    }

    /// Steps 4 and 5 where what is recorded depends on the table as it is when
    /// the hardware step ends: `decide` reads it and the outcome is applied under
    /// that one lock, then written durably. If the commit fails, the table still
    /// follows the hardware and the open intent finishes the record at the next
    /// start. Returns what `decide` answered with the outcome.
    pub(super) async fn publish_then_commit<T>(
        &self,
        decide: impl FnOnce(&State) -> (Outcome, T),
    ) -> Result<T, StoreError> {
        let (outcome, answer) = {
            let mut st = self.lock();
            let (outcome, answer) = decide(&st);
            let recorded = outcome.clone();
            apply(&mut st, outcome);
            (recorded, answer)
        };
        self.store_outcome(outcome).await?;
        Ok(answer)
    }

    /// Steps 4 and 5 at start-up, before the table is served: the outcome written
    /// (blocking), then applied to `st`, the table being loaded.
    pub(super) fn commit_at_start(
        &self,
        st: &mut State,
        outcome: Outcome,
    ) -> Result<(), StoreError> {
        let recorded = outcome.clone();
        self.store
            .write_blocking(move |w| write_outcome_rows(w, &recorded))?;
        apply(st, outcome);
        Ok(())
    }

    /// [`Self::commit`] from a thread that may block (start-up's static layout):
    /// the outcome written, then applied to the table, which is served already.
    pub(super) fn commit_blocking(&self, outcome: Outcome) -> Result<(), StoreError> {
        let recorded = outcome.clone();
        self.store
            .write_blocking(move |w| write_outcome_rows(w, &recorded))?;
        apply(&mut self.lock(), outcome);
        Ok(())
    }

    /// Step 5 alone, for what no commit records: a lease put back as it was when
    /// its teardown's intent could not be written, or when its containers could
    /// not be stopped (the open intent records the rest).
    pub(super) fn publish_only(&self, outcome: Outcome) {
        apply(&mut self.lock(), outcome);
    }

    /// A teardown of lease `id` has ended (done, or left to housekeeping): another
    /// may begin.
    pub(super) fn teardown_finished(&self, id: &str) {
        self.lock().tearing_down.remove(id);
    }

    /// A move of lease `id` has ended: it may be ended, renewed or resolved again.
    pub(super) fn move_finished(&self, id: &str) {
        self.lock().moving.remove(id);
    }

    /// Run a change outside a hardware sequence: `decide` reads the table and
    /// answers the [`Change`] (or the refusal, and nothing changes); its outcome is
    /// applied to the table under that one lock, so no other change comes between
    /// a decision and its effect. Then `act` (what the change does on the host,
    /// e.g. MPS directories handed to a container's uid) and the commit (none
    /// when the outcome writes nothing). When either fails, the records the change
    /// replaced are put back wherever the table still holds what it applied (a
    /// later change is never undone), `undo` undoes the host's side, and the error
    /// is answered.
    pub(super) async fn run_change<T>(
        &self,
        decide: impl FnOnce(&State) -> Result<Change<T>, LeaseError>,
        act: impl AsyncFnOnce(&T) -> Result<(), LeaseError>,
        undo: impl FnOnce(&T),
    ) -> Result<T, LeaseError> {
        let (change, replaced) = {
            let mut st = self.lock();
            let change = decide(&st)?;
            let replaced = Replaced::of(&st, &change.outcome);
            apply(&mut st, change.outcome.clone());
            (change, replaced)
        };
        let Change {
            outcome,
            durability,
            answer,
        } = change;
        let done = match act(&answer).await {
            Ok(()) if outcome.writes_nothing() => Ok(()),
            Ok(()) => {
                let recorded = outcome.clone();
                let put = move |w: &Writer<'_>| write_outcome_rows(w, &recorded);
                match durability {
                    Durability::Durable => self.store.write(put).await,
                    Durability::Relaxed => self.store.write_relaxed(put).await,
                }
                .map_err(LeaseError::from)
            }
            Err(e) => Err(e),
        };
        match done {
            Ok(()) => Ok(answer),
            Err(e) => {
                replaced.restore(&mut self.lock(), &outcome);
                undo(&answer);
                Err(e)
            }
        }
    }

    /// A change the table alone holds until an intent or a commit records it (a
    /// reservation, a partition marked before its teardown's intent): `decide`
    /// reads the table and answers the outcome, applied under that one lock;
    /// nothing is written.
    pub(super) fn hold_in_table<T>(
        &self,
        decide: impl FnOnce(&State) -> Result<(Outcome, T), LeaseError>,
    ) -> Result<T, LeaseError> {
        let mut st = self.lock();
        let (outcome, answer) = decide(&st)?;
        apply(&mut st, outcome);
        Ok(answer)
    }

    /// A CreateLease no longer holds MPS host instance `host` (its share is
    /// reserved there, or it gave up).
    pub(super) fn release_host_claim(&self, host: &str) {
        let mut st = self.lock();
        if let Some(n) = st.host_claims.get_mut(host) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                st.host_claims.remove(host);
            }
        }
    }

    /// [`Self::run_change`] of a change with nothing to do on the host.
    pub(super) async fn run_records<T>(
        &self,
        decide: impl FnOnce(&State) -> Result<Change<T>, LeaseError>,
    ) -> Result<T, LeaseError> {
        self.run_change(decide, async |_| Ok(()), |_| {}).await
    }

    /// Step 4 alone: the outcome in one durable commit.
    async fn store_outcome(&self, outcome: Outcome) -> Result<(), StoreError> {
        self.store
            .write(move |w| write_outcome_rows(w, &outcome))
            .await
    }

    /// Step 2 of a teardown: one intent per partition with a hardware step, written
    /// with the lease (revoking) and those partitions (destroying) in one commit
    /// before anything is touched (the ids in the steps' order). Without a
    /// hardware step only the lease (revoking) is written, before its containers
    /// are stopped.
    pub(super) async fn write_teardown_intent(
        &self,
        lease: &Lease,
        steps: &[(Partition, Option<HwDestroy>)],
    ) -> Result<Vec<Option<i64>>, LeaseError> {
        let ops: Vec<(Partition, Option<IntentOp>)> = steps
            .iter()
            .map(|(p, hw)| {
                let op = hw.as_ref().map(HwDestroy::intent);
                let mut destroying = p.clone();
                if op.is_some() {
                    destroying.state = PartitionState::Destroying;
                }
                (destroying, op)
            })
            .collect();
        let (l2, now) = (lease.clone(), now_ms());
        let ids = self
            .store
            .write(move |w| {
                w.put_lease(&l2)?;
                let mut ids = Vec::with_capacity(ops.len());
                for (p, op) in &ops {
                    let Some(op) = op else {
                        ids.push(None);
                        continue;
                    };
                    w.put_partition(p)?;
                    ids.push(Some(w.begin_intent(*op, &p.id, Some(&l2.id), now)?));
                }
                Ok(ids)
            })
            .await?;
        Ok(ids)
    }

    /// Step 3 of a teardown: the hardware step. Destroying what is already gone
    /// (NVML NotFound) counts as done.
    pub(super) async fn destroy_hw(&self, hw: HwDestroy) -> Result<(), DestroyError> {
        let backend = self.backend.clone();
        let done = match hw {
            HwDestroy::Mig { gpu, gi_id } if backend.instance_calls_are_quick() => {
                backend.destroy_instance(gpu, gi_id)
            }
            hw => tokio::task::spawn_blocking(move || match hw {
                HwDestroy::Mig { gpu, gi_id } => backend.destroy_instance(gpu, gi_id),
                HwDestroy::Mps { lease_id } => backend.mps_stop(&lease_id),
            })
            .await
            .map_err(DestroyError::Task)?,
        };
        match done {
            Err(e) if e.nvml_code() == Some(NvmlCode::NotFound) => {
                info!(error = %e, "the instance to destroy is already gone: teardown done");
                Ok(())
            }
            // A GPU fallen off the bus comes back only through a reset or a reboot,
            // and either destroys its MIG instances: nothing is left to tear down.
            // Should it return without one, the instance is foreign at the next
            // start: counted as occupied, never handed out.
            Err(e) if e.nvml_code() == Some(NvmlCode::GpuIsLost) => {
                warn!(error = %e, "the GPU is lost; its instance goes with it: teardown done");
                Ok(())
            }
            other => other.map_err(DestroyError::Hardware),
        }
    }
}

/// What undoing a failed placement did.
#[derive(Default)]
struct Undo {
    /// Instances made before the failure and destroyed.
    destroyed: usize,
    /// Instances made before the failure that could not be destroyed.
    stuck: HashSet<String>,
    /// The failed partition, when the GI its call left could not be destroyed.
    half_kept: Option<String>,
}

impl Undo {
    /// Why a lease of several partitions failed (`total` of them).
    fn reason(&self, f: &Failure, total: usize) -> String {
        format!(
            "hardware set-up failed on partition {} of {total} (GPU {}): {}; all or nothing: \
             {} instance(s) made before it destroyed{}",
            f.made.len() + 1,
            f.failed.gpu,
            f.error,
            self.destroyed,
            if self.stuck.is_empty() {
                String::new()
            } else {
                format!(", {} left to the next start", self.stuck.len())
            }
        )
    }

    /// `p` as it is recorded after the failure: None = gone (or back in the pool
    /// when static), Some = kept without a lease.
    fn kept(&self, p: &Partition) -> Option<Partition> {
        let mut orphan = p.clone();
        orphan.lease_id = None;
        if self.stuck.contains(&p.id) {
            orphan.state = PartitionState::Destroying;
            Some(orphan)
        } else if self.half_kept.as_deref() == Some(p.id.as_str()) {
            Some(orphan)
        } else {
            None
        }
    }
}

/// The reservation in the table: the lease (pending or active), its partitions,
/// its request id, and the notice retries of the same request wait on.
fn hold(st: &mut State, placed: &Placement, notify: &Arc<Notify>) {
    let lease = &placed.lease;
    for (p, _) in &placed.parts {
        st.partitions.insert(p.id.clone(), p.clone());
    }
    st.leases.insert(lease.id.clone(), lease.clone());
    if let Some(rid) = &lease.request_id {
        st.requests
            .insert((lease.tenant.clone(), rid.clone()), lease.id.clone());
    }
    st.pending.insert(lease.id.clone(), notify.clone());
}

/// A partition whose hardware now exists: ready, with its instance's ids.
pub(super) fn ready(p: &mut Partition, inst: Option<MigInstance>) {
    p.state = PartitionState::Ready;
    if let (PartKind::Mig(m), Some(inst)) = (&mut p.kind, inst) {
        m.gi_id = Some(inst.gi_id);
        m.ci_id = inst.ci_id;
        m.uuid = Some(inst.uuid);
    }
}

/// A GI a failed create left without its CI at `m`'s placement (an error between
/// the GI and the CI step): destroyed. None there is success too.
pub(super) fn undo_half(backend: &dyn GpuBackend, gpu: u32, m: &MigPart) -> Result<(), GpuError> {
    let half = backend.instances(gpu)?.into_iter().find(|i| {
        i.placement == m.placement && i.gi_profile_id == m.gi_profile_id && i.ci_id.is_none()
    });
    match half {
        Some(i) => backend.destroy_instance(gpu, i.gi_id),
        None => Ok(()),
    }
}

/// [`undo_half`], answering the GI it could not destroy (told to the operator, for
/// the caller to set aside as foreign).
pub(super) fn undo_half_or_left(
    backend: &dyn GpuBackend,
    gpu: u32,
    m: &MigPart,
) -> Option<MigInstance> {
    let e = undo_half(backend, gpu, m).err()?;
    let left = backend.instances(gpu).ok().and_then(|all| {
        all.into_iter().find(|i| {
            i.placement == m.placement && i.gi_profile_id == m.gi_profile_id && i.ci_id.is_none()
        })
    });
    match &left {
        Some(i) => warn!(gpu, gi = i.gi_id, error = %e,
            "could not undo a MIG instance a failed create left half made; \
             it is left alone as foreign: remove it with `nvidia-smi mig -i {gpu} -dgi -gi {}`",
            i.gi_id),
        None => warn!(gpu, error = %e,
            "could not check for a MIG instance a failed create may have left half made; \
             the next start sets any such instance aside"),
    }
    left
}
