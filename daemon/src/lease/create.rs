//! CreateLease: reserve, record the intent, change the hardware, record the outcome.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tessera_common::clock::now_ms;
use tokio::sync::Notify;
use tracing::{info, warn};

use crate::config::TenancyConfig;
use crate::gpu::{GpuBackend, GpuError, MigInstance, MpsSpec, NvmlCode};
use crate::model::{IntentOp, Lease, MigPart, Origin, PartKind, Partition, PartitionState};
use crate::names::{new_id, truncate};
use crate::partition::Shape;
use crate::store::StoreError;

use super::error::{Inconsistency, invalid};
use super::{Again, EventKind, LeaseError, LeaseManager, mps_dirs, validate_create};
use super::{quota, token};

#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    pub tenant: String,
    pub shape: Option<Shape>,
    pub ttl: Option<Duration>,
    pub request_id: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub priority_class: Option<String>,
    pub gpu_index: Option<u32>,
    /// Instead of a shape: memory and isolation; the smallest partition that fits
    /// now is chosen (see `need.rs`).
    pub need: Option<super::Need>,
    /// How many partitions of `shape` (0 and 1: one): N whole GPUs or N MIG
    /// instances of one profile, placed by topology and created all or none.
    pub count: u32,
    /// With `count` > 1: how closely the partitions' GPUs must be connected.
    pub topology: crate::partition::topology::TopologyConstraint,
}

#[derive(Debug, Clone)]
pub struct Created {
    pub lease: Lease,
    pub partition: Option<Partition>,
    /// None when the lease was found ended on a retry (no token is issued then).
    pub token: Option<String>,
    pub replayed: bool,
}

/// A hardware step that follows a durable intent.
pub(super) enum HwCreate {
    Mig {
        gpu: u32,
        gi_profile_id: u32,
        placement: crate::gpu::Placement,
        ci_profile_id: Option<u32>,
    },
    Mps(MpsSpec),
}

/// A reservation in memory: the lease, its partition, the hardware step its intent
/// announces (none for a static or whole-GPU partition), and the token it will get.
pub(super) struct Reserved {
    pub(super) lease: Lease,
    pub(super) partition: Partition,
    pub(super) hw: Option<HwCreate>,
    /// A multi-partition lease: its other partitions, each with its hardware step.
    pub(super) more: Vec<(Partition, Option<HwCreate>)>,
}

/// What `reserve` needs to know of the request, checked and resolved.
pub(super) struct Ask<'r> {
    pub(super) req: &'r CreateRequest,
    pub(super) shape: Shape,
    pub(super) ttl: Duration,
    pub(super) priority_class: String,
    pub(super) lease_id: String,
    pub(super) partition_id: String,
    pub(super) now: i64,
    /// How many partitions (1 for most leases).
    pub(super) count: u32,
}

impl LeaseManager {
    /// CreateLease. Steps: check the request; answer a retry of an earlier call;
    /// refuse a shape no GPU's mode can take; reserve capacity under the lock
    /// (preempting burst leases once where the tenant's guarantee allows); record the
    /// lease, its token and the intent in one commit; change the hardware; record the
    /// outcome; publish.
    pub async fn create(&self, mut req: CreateRequest) -> Result<Created, LeaseError> {
        if self.shutting_down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(LeaseError::ShuttingDown);
        }
        if let Some(need) = req.need.take() {
            if req.shape.is_some() {
                return Err(invalid("shape", "give a shape or a need, not both"));
            }
            need.validate()?;
            // A retry answers with the lease the first call got, whatever fits now.
            if let Some(answer) = self.answer_retry(&req).await? {
                return Ok(answer);
            }
            req.shape = Some(self.resolve_need(&need, req.gpu_index)?);
        }
        let (shape, ttl) = validate_create(&req, &self.config.lease)?;
        if let Some(answer) = self.answer_retry(&req).await? {
            return Ok(answer);
        }
        let tenancy = self.tenancy();
        let priority_class = self.priority_class_of(&req, &tenancy)?;
        let now = now_ms();
        let ask = Ask {
            req: &req,
            shape,
            ttl,
            priority_class,
            lease_id: new_id("l-"),
            partition_id: new_id("p-"),
            now,
            count: req.count.max(1),
        };
        // A shape no GPU's mode can take is refused before anything is held.
        self.refuse_wrong_mode(&ask.shape, req.gpu_index)?;
        // MPS inside MIG: its host instance first (held until the share is reserved).
        let host_claim = self.ensure_mig_mps_host(&ask, &tenancy).await?;
        let notify = Arc::new(Notify::new());
        let reserved = match self
            .reserve_with_preemption(&ask, &tenancy, &notify)
            .await?
        {
            Ok(r) => r,
            Err(answer) => return answer,
        };
        drop(host_claim);
        if !reserved.more.is_empty() {
            return self.create_several(reserved, now).await;
        }
        let tok = token::generate();
        let tok_hash = token::hash(&tok);
        let intent = self.record_reservation(&reserved, &tok_hash, now).await?;
        let Reserved {
            lease,
            partition,
            hw,
            more: _,
        } = reserved;
        let Some(hw) = hw else {
            // Static-pool partition or whole GPU: nothing to change on the hardware.
            return Ok(self.publish_created(lease, partition, tok_hash, tok));
        };
        let intent = intent.ok_or_else(|| {
            LeaseError::Inconsistent(Inconsistency::IntentMissing(lease.id.clone()))
        })?;
        let result = self.hw_create(hw).await;
        match result {
            Ok(inst) => {
                self.record_created(lease, partition, inst, intent, tok_hash, tok)
                    .await
            }
            Err(e) => Err(self.record_failed(lease, partition, intent, e).await),
        }
    }

    /// An earlier call with the same (tenant, request id): wait for it while it is
    /// still being created, then replay it (a fresh token for a live lease, none for
    /// an ended one). `None`: no such call, go on and create.
    ///
    /// A live lease is in memory (reserved there before it reaches the store); an
    /// ended one only in the store. The memory check and the store read are not one
    /// atomic step: a first call can reserve and write its lease between them, so a
    /// live lease read from the store sends this call back to the memory check
    /// rather than being answered as an ended lease without a token.
    async fn answer_retry(&self, req: &CreateRequest) -> Result<Option<Created>, LeaseError> {
        let Some(rid) = &req.request_id else {
            return Ok(None);
        };
        let key = (req.tenant.clone(), rid.clone());
        let mut rounds = 0u32;
        loop {
            let wait = {
                let st = self.lock();
                st.requests
                    .get(&key)
                    .cloned()
                    .map(|lid| match st.pending.get(&lid) {
                        Some(n) => Ok(n.clone().notified_owned()),
                        None => Err(lid),
                    })
            };
            match wait {
                Some(Ok(notified)) => {
                    notified.await;
                    continue;
                }
                Some(Err(lid)) => return self.replay(&lid).await.map(Some),
                None => {}
            }
            match self.store.find_by_request(&req.tenant, rid)? {
                None => return Ok(None),
                Some(l) if l.state().is_live() => {
                    // Reserved and written since the memory check, or ended and
                    // not yet written as ended: look again.
                    rounds += 1;
                    if rounds > 100 {
                        return Err(LeaseError::FailedPrecondition(format!(
                            "lease {} for this request_id is changing state; retry",
                            l.id
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Some(l) => {
                    return Ok(Some(Created {
                        lease: l,
                        partition: None,
                        token: None,
                        replayed: true,
                    }));
                }
            }
        }
    }

    /// The request's priority class (else its tenant's, else the default), which
    /// must exist and may not exceed the tenant's own.
    fn priority_class_of(
        &self,
        req: &CreateRequest,
        tenancy: &TenancyConfig,
    ) -> Result<String, LeaseError> {
        let class = match req.priority_class.as_deref() {
            Some(c) if !c.is_empty() => c.to_string(),
            _ => tenancy
                .tenants
                .get(&req.tenant)
                .map(|q| q.priority_class.clone())
                .unwrap_or_else(|| tenancy.default_priority_class.clone()),
        };
        if !tenancy.priority_classes.contains_key(&class) {
            let known: Vec<&str> = tenancy
                .priority_classes
                .keys()
                .map(String::as_str)
                .collect();
            return Err(invalid(
                "priority_class",
                format!(
                    "{:?} is not one of {}",
                    truncate(&class, 64),
                    known.join(", ")
                ),
            ));
        }
        if let Some(q) = tenancy.tenants.get(&req.tenant)
            && quota::priority(tenancy, &class) > quota::priority(tenancy, &q.priority_class)
        {
            return Err(LeaseError::PermissionDenied(format!(
                "tenant {:?} may use priority classes up to {:?}, not {class:?}",
                req.tenant, q.priority_class
            )));
        }
        Ok(class)
    }

    /// Reserve, preempting or waiting for teardowns at most three times. `Err` is
    /// the answer to give instead (a concurrent call with the same request id).
    async fn reserve_with_preemption(
        &self,
        ask: &Ask<'_>,
        tenancy: &TenancyConfig,
        notify: &Arc<Notify>,
    ) -> Result<Result<Reserved, Result<Created, LeaseError>>, LeaseError> {
        let extra = self.grants_extra(&ask.req.tenant, ask.now);
        let mut rounds = 0;
        let mut holding_capacity = false;
        loop {
            // `reserve` gives back the capacity claim a preemption round made.
            let step = self.reserve(ask, tenancy, extra, rounds, holding_capacity, notify)?;
            match step {
                Ok(r) => return Ok(Ok(r)),
                Err(Again::Preempt(victims)) => {
                    rounds += 1;
                    holding_capacity = true;
                    self.preempt(&victims, &ask.req.tenant).await;
                }
                Err(Again::Move(moves, refusal)) => {
                    rounds += 1;
                    for m in &moves {
                        if let Err(e) = self.move_idle(m, "to make room").await {
                            warn!(error = %e, "moving an idle lease to make room failed");
                            return Err(LeaseError::ResourceExhausted(format!(
                                "{refusal}; moving an idle lease to make room failed: {e}"
                            )));
                        }
                    }
                }
                Err(Again::WaitTeardowns) => {
                    rounds += 1;
                    holding_capacity = true;
                    self.wait_for_teardowns(Duration::from_secs(5)).await;
                }
                Err(Again::SameRequest(lid, pending)) => {
                    return Ok(Err(match pending {
                        // Still being created: wait, then answer as a retry would.
                        Some(done) => {
                            done.await;
                            Box::pin(self.create(ask.req.clone())).await
                        }
                        None => self.replay(&lid).await,
                    }));
                }
            }
        }
    }

    /// ModeUnavailable when no GPU considered (every GPU of the node, healthy or not,
    /// or the one asked for) is in the mode `shape` needs: only an operator's mode
    /// change would let it succeed, so it is not a capacity refusal.
    pub(super) fn refuse_wrong_mode(
        &self,
        shape: &Shape,
        gpu_index: Option<u32>,
    ) -> Result<(), LeaseError> {
        let st = self.lock();
        // A GPU that could not be read has no known mode: the health check that
        // follows names why it takes nothing.
        if let Some(g) = gpu_index
            && st
                .gpus
                .iter()
                .any(|x| x.info.index == g && x.info.fault.is_some())
        {
            return Ok(());
        }
        let infos: Vec<&crate::gpu::GpuInfo> = st
            .gpus
            .iter()
            .map(|g| &g.info)
            .filter(|i| i.fault.is_none())
            .collect();
        match crate::partition::mode_unavailable(shape, &infos, gpu_index) {
            Some(why) => Err(LeaseError::ModeUnavailable(why)),
            None => Ok(()),
        }
    }

    /// Step 2: the lease, its partition, its token and (for a hardware step) the
    /// intent, in one durable commit. On failure the reservation is given back.
    async fn record_reservation(
        &self,
        r: &Reserved,
        tok_hash: &str,
        now: i64,
    ) -> Result<Option<i64>, LeaseError> {
        let op = match &r.hw {
            Some(HwCreate::Mig { .. }) => Some(IntentOp::CreateMig),
            Some(HwCreate::Mps(_)) => Some(IntentOp::StartMps),
            None => None,
        };
        let (l2, p2, h2) = (r.lease.clone(), r.partition.clone(), tok_hash.to_string());
        let written = self
            .store
            .write(move |w| {
                w.put_lease(&l2)?;
                w.put_partition(&p2)?;
                w.add_token(&h2, &l2.id, now)?;
                op.map(|op| w.begin_intent(op, &p2.id, Some(&l2.id), now))
                    .transpose()
            })
            .await;
        written.map_err(|e| {
            self.forget_reservation(&r.lease, &r.partition, true);
            match e {
                StoreError::DuplicateRequest { .. } => LeaseError::FailedPrecondition(
                    "a lease with this request_id is being created concurrently; retry".into(),
                ),
                e => e.into(),
            }
        })
    }

    /// Step 5: the lease is known by its token, waiting retries are woken, and
    /// watchers hear of it.
    fn publish_created(
        &self,
        lease: Lease,
        partition: Partition,
        tok_hash: String,
        tok: String,
    ) -> Created {
        let mut st = self.lock();
        st.partitions
            .insert(partition.id.clone(), partition.clone());
        st.leases.insert(lease.id.clone(), lease.clone());
        st.tokens.insert(tok_hash, lease.id.clone());
        if let Some(n) = st.pending.remove(&lease.id) {
            n.notify_waiters();
        }
        drop(st);
        self.emit(EventKind::Created, &lease, Some(&partition), String::new());
        info!(lease = %lease.id, tenant = %lease.tenant, gpu = lease.gpu, "lease created");
        Created {
            lease,
            partition: Some(partition),
            token: Some(tok),
            replayed: false,
        }
    }

    /// Step 4 after success: the partition is ready and the lease active, durably.
    async fn record_created(
        &self,
        mut lease: Lease,
        mut partition: Partition,
        inst: Option<MigInstance>,
        intent: i64,
        tok_hash: String,
        tok: String,
    ) -> Result<Created, LeaseError> {
        partition.state = PartitionState::Ready;
        if let (PartKind::Mig(m), Some(inst)) = (&mut partition.kind, inst) {
            m.gi_id = Some(inst.gi_id);
            m.ci_id = inst.ci_id;
            m.uuid = Some(inst.uuid);
        }
        lease.activate()?;
        let (l2, p2, now) = (lease.clone(), partition.clone(), now_ms());
        // If this fails, the hardware exists and the intent stays open: the next
        // start reconciles it. The reservation is kept so nothing else takes it.
        self.store
            .write(move |w| {
                w.put_partition(&p2)?;
                w.put_lease(&l2)?;
                w.finish_intent(intent, now, "done")
            })
            .await?;
        Ok(self.publish_created(lease, partition, tok_hash, tok))
    }

    /// Step 4 after failure: the lease failed, its placement is given back (after
    /// destroying a GI the failed create left behind), and the caller hears why.
    async fn record_failed(
        &self,
        mut lease: Lease,
        partition: Partition,
        intent: i64,
        e: GpuError,
    ) -> LeaseError {
        let now = now_ms();
        if let Err(t) = lease.fail(format!("hardware set-up failed: {e}"), now) {
            return t.into();
        }
        // A create can fail after its GI exists (an error between the GI and the CI
        // step without rollback): destroy that GI before giving the placement back.
        // If that fails too, the partition row keeps the placement and the intent
        // stays open for the next start to undo.
        let undone = match &partition.kind {
            PartKind::Mig(m) => self.undo_half_create(partition.gpu, m).await,
            _ => Ok(()),
        };
        let mut orphan = partition.clone();
        orphan.lease_id = None;
        let (l2, p2, keep) = (lease.clone(), orphan.clone(), undone.is_err());
        let res = self
            .store
            .write(move |w| {
                w.put_lease(&l2)?;
                w.delete_tokens(&l2.id)?;
                if keep {
                    return w.put_partition(&p2);
                }
                w.delete_partition(&p2.id)?;
                w.finish_intent(intent, now, "failed")
            })
            .await;
        if res.is_ok() {
            self.forget_reservation(&lease, &partition, false);
            if let Err(u) = undone {
                warn!(lease = %lease.id, gpu = partition.gpu, error = %u,
                    "could not destroy the GI of a failed create; the next start undoes it");
                self.lock().partitions.insert(orphan.id.clone(), orphan);
            }
        }
        match e.nvml_code() {
            Some(NvmlCode::InsufficientResources) => LeaseError::ResourceExhausted(format!(
                "GPU {} has no room for this instance: {e}",
                partition.gpu
            )),
            _ => LeaseError::Hardware(e),
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

    pub(super) async fn replay(&self, lease_id: &str) -> Result<Created, LeaseError> {
        let (lease, partition) = self.get(lease_id)?;
        if !lease.state().is_live() {
            return Ok(Created {
                lease,
                partition,
                token: None,
                replayed: true,
            });
        }
        let tok = token::generate();
        let h = token::hash(&tok);
        let (h2, lid) = (h.clone(), lease.id.clone());
        let now = now_ms();
        self.store
            .write(move |w| w.add_token(&h2, &lid, now))
            .await?;
        self.lock().tokens.insert(h, lease.id.clone());
        Ok(Created {
            lease,
            partition,
            token: Some(tok),
            replayed: true,
        })
    }

    pub(super) async fn hw_create(&self, hw: HwCreate) -> Result<Option<MigInstance>, GpuError> {
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
