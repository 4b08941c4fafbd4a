//! CreateLease: reserve, record the intent, change the hardware, record the outcome.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tessera_common::clock::now_ms;
use tokio::sync::Notify;
use tracing::{info, warn};

use crate::gpu::{GpuError, MigInstance, MpsSpec, NvmlCode};
use crate::model::{
    IntentOp, Lease, LeaseState, MigPart, MpsPart, Origin, PartKind, Partition, PartitionState,
};
use crate::names::{new_id, truncate};
use crate::partition::{self, PlanDecision, PlanError, Shape};
use crate::store::StoreError;

use super::error::invalid;
#[allow(unused_imports)]
use super::*;
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

impl LeaseManager {
    pub async fn create(&self, req: CreateRequest) -> Result<Created, LeaseError> {
        if self.shutting_down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(LeaseError::ShuttingDown);
        }
        let (shape, ttl) = validate_create(&req, &self.config.lease)?;
        let priority_class = req.priority_class.clone().unwrap_or_default();

        // Idempotent retries: an existing lease for (tenant, request_id). A live
        // one is in memory (reserved there before it reaches the store); an ended
        // one only in the store. The memory check and the store read are not one
        // atomic step: a first call can reserve and write its lease between them,
        // so a live lease read from the store sends this call back to the memory
        // check (where it waits for, or replays, that first call) rather than
        // being answered as an ended lease without a token.
        if let Some(rid) = &req.request_id {
            let key = (req.tenant.clone(), rid.clone());
            let mut rounds = 0u32;
            loop {
                let wait = {
                    let st = self.lock();
                    match st.requests.get(&key).cloned() {
                        None => None,
                        Some(lid) => match st.pending.get(&lid) {
                            Some(n) => Some(Ok(n.clone().notified_owned())),
                            None => Some(Err(lid)),
                        },
                    }
                };
                match wait {
                    Some(Ok(notified)) => {
                        notified.await;
                        continue;
                    }
                    Some(Err(lid)) => return self.replay(&lid).await,
                    None => {}
                }
                match self.store.find_by_request(&req.tenant, rid)? {
                    None => break,
                    Some(l) if l.state.is_live() => {
                        // Reserved and written since the memory check, or ended
                        // and not yet written as ended: look again.
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
                        return Ok(Created {
                            lease: l,
                            partition: None,
                            token: None,
                            replayed: true,
                        });
                    }
                }
            }
        }

        let now = now_ms();
        let lease_id = new_id("l-");
        let partition_id = new_id("p-");
        let tok = token::generate();
        let tok_hash = token::hash(&tok);
        let notify = Arc::new(Notify::new());

        // 1. Admission and reservation under the lock. A request within its
        //    tenant's guarantee that does not fit may preempt burst leases of other
        //    tenants once, then it is planned again.
        let tenancy = self.tenancy();
        let priority_class = if priority_class.is_empty() {
            tenancy
                .tenants
                .get(&req.tenant)
                .map(|q| q.priority_class.clone())
                .unwrap_or_else(|| tenancy.default_priority_class.clone())
        } else {
            priority_class
        };
        if !tenancy.priority_classes.contains_key(&priority_class) {
            return Err(invalid(
                "priority_class",
                format!(
                    "{:?} is not one of {}",
                    truncate(&priority_class, 64),
                    tenancy
                        .priority_classes
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        if let Some(q) = tenancy.tenants.get(&req.tenant)
            && quota::priority(&tenancy, &priority_class)
                > quota::priority(&tenancy, &q.priority_class)
        {
            return Err(LeaseError::PermissionDenied(format!(
                "tenant {:?} may use priority classes up to {:?}, not {priority_class:?}",
                req.tenant, q.priority_class
            )));
        }
        let request_amounts = quota::amounts_of(&shape);
        let extra = self.grants_extra(&req.tenant, now);
        let mut preempt_rounds = 0;
        let mut holding_capacity = false;
        let (lease, partition, hw) = loop {
            #[allow(clippy::type_complexity)]
            let step: Result<(Lease, Partition, Option<HwCreate>), Again> = 'reserve: {
                let mut st = self.lock();
                if std::mem::take(&mut holding_capacity) {
                    st.preempting = st.preempting.saturating_sub(1);
                }
                // A concurrent call with the same request id got here first.
                if let Some(rid) = &req.request_id
                    && let Some(lid) = st.requests.get(&(req.tenant.clone(), rid.clone())).cloned()
                {
                    let pending = st.pending.get(&lid).map(|n| n.clone().notified_owned());
                    break 'reserve Err(Again::SameRequest(lid, pending));
                }
                let used = st
                    .leases
                    .values()
                    .filter(|l| l.tenant == req.tenant && l.state.is_live())
                    .fold(Default::default(), |acc, l| {
                        quota::add(acc, quota::amounts_of(&l.shape))
                    });
                let admission = quota::admit(&tenancy, &req.tenant, used, request_amounts, extra)
                    .map_err(LeaseError::ResourceExhausted)?;
                if admission == quota::Admission::Burst && st.preempting > 0 {
                    // Capacity being freed by a preemption belongs to the guaranteed
                    // request that caused it, not to a burst request racing it.
                    return Err(LeaseError::ResourceExhausted(
                        "capacity is being freed for another tenant's guaranteed request; burst requests wait".into(),
                    ));
                }
                let views = Self::views(&st);
                let opts = self.plan_options(req.gpu_index);
                let decision = match partition::plan(&shape, &views, &opts) {
                    Ok(d) => d,
                    Err(PlanError::NoCapacity(msg))
                        if admission == quota::Admission::Guaranteed
                            && tenancy.preemption
                            && !tenancy.tenants.is_empty()
                            && preempt_rounds < 3 =>
                    {
                        let victims = Self::pick_victims(&st, &tenancy, &req.tenant, &shape, &opts);
                        if victims.is_empty() {
                            // Capacity held by leases being torn down right now
                            // comes back in a moment: wait for that, then retry.
                            if st.tearing_down.is_empty() {
                                return Err(LeaseError::ResourceExhausted(msg));
                            }
                            st.preempting += 1;
                            break 'reserve Err(Again::WaitTeardowns);
                        }
                        st.preempting += 1;
                        break 'reserve Err(Again::Preempt(victims));
                    }
                    Err(e) => return Err(e.into()),
                };
                let gpu_index = match &decision {
                    PlanDecision::NewMig { gpu, .. }
                    | PlanDecision::Static { gpu, .. }
                    | PlanDecision::Mps { gpu }
                    | PlanDecision::WholeGpu { gpu } => *gpu,
                };
                let gpu = st
                    .gpus
                    .iter()
                    .find(|g| g.info.index == gpu_index)
                    .cloned()
                    .ok_or_else(|| {
                        LeaseError::Internal(format!("planner chose unknown GPU {gpu_index}"))
                    })?;
                let (partition, hw) = match decision {
                    PlanDecision::NewMig {
                        gpu: g,
                        gi_profile_id,
                        placement,
                        ci_profile_id,
                    } => {
                        let prof = gpu
                            .profiles
                            .iter()
                            .find(|p| p.id == gi_profile_id)
                            .ok_or_else(|| {
                                LeaseError::Internal("planner chose unknown profile".into())
                            })?;
                        let ci = ci_profile_id
                            .and_then(|id| prof.ci_profiles.iter().find(|c| c.id == id));
                        let p = Partition {
                            id: partition_id.clone(),
                            gpu: g,
                            gpu_uuid: gpu.info.uuid.clone(),
                            origin: Origin::Dynamic,
                            state: PartitionState::Creating,
                            lease_id: Some(lease_id.clone()),
                            kind: PartKind::Mig(MigPart {
                                gi_profile_id,
                                profile: prof.name.clone(),
                                placement,
                                ci_profile_id,
                                compute_profile: ci.map(|c| c.name.clone()),
                                gi_id: None,
                                ci_id: None,
                                uuid: None,
                                memory_bytes: prof.memory_bytes,
                                sm_count: ci.map(|c| c.sm_count).unwrap_or(prof.sm_count),
                                slices: prof.slices,
                            }),
                        };
                        (
                            p,
                            Some(HwCreate::Mig {
                                gpu: g,
                                gi_profile_id,
                                placement,
                                ci_profile_id,
                            }),
                        )
                    }
                    PlanDecision::Static {
                        partition_id: pid, ..
                    } => {
                        let mut p = st.partitions.get(&pid).cloned().ok_or_else(|| {
                            LeaseError::Internal(format!("planner chose unknown partition {pid}"))
                        })?;
                        p.lease_id = Some(lease_id.clone());
                        (p, None)
                    }
                    PlanDecision::Mps { gpu: g } => {
                        let Shape::Mps {
                            sm_percent,
                            memory_bytes,
                        } = shape
                        else {
                            return Err(LeaseError::Internal(
                                "MPS decision for a non-MPS shape".into(),
                            ));
                        };
                        let base = self.config.daemon.run_dir.join("mps").join(&lease_id);
                        let spec = MpsSpec {
                            lease_id: lease_id.clone(),
                            gpu: g,
                            gpu_uuid: gpu.info.uuid.clone(),
                            sm_percent,
                            memory_bytes,
                            pipe_dir: base.join("pipe"),
                            log_dir: base.join("log"),
                            owner_uid: None,
                        };
                        let p = Partition {
                            id: partition_id.clone(),
                            gpu: g,
                            gpu_uuid: gpu.info.uuid.clone(),
                            origin: Origin::Dynamic,
                            state: PartitionState::Creating,
                            lease_id: Some(lease_id.clone()),
                            kind: PartKind::Mps(MpsPart {
                                sm_percent,
                                memory_bytes,
                                pipe_dir: spec.pipe_dir.clone(),
                                log_dir: spec.log_dir.clone(),
                                owner_uid: None,
                            }),
                        };
                        (p, Some(HwCreate::Mps(spec)))
                    }
                    PlanDecision::WholeGpu { gpu: g } => (
                        Partition {
                            id: partition_id.clone(),
                            gpu: g,
                            gpu_uuid: gpu.info.uuid.clone(),
                            origin: Origin::Dynamic,
                            state: PartitionState::Ready,
                            lease_id: Some(lease_id.clone()),
                            kind: PartKind::WholeGpu,
                        },
                        None,
                    ),
                };
                let lease = Lease {
                    id: lease_id.clone(),
                    tenant: req.tenant.clone(),
                    state: if hw.is_some() {
                        LeaseState::Pending
                    } else {
                        LeaseState::Active
                    },
                    shape: shape.clone(),
                    partition_id: partition.id.clone(),
                    gpu: partition.gpu,
                    created_at_ms: now,
                    expires_at_ms: now + ttl.as_millis() as i64,
                    ttl_secs: ttl.as_secs(),
                    request_id: req.request_id.clone(),
                    labels: req.labels.clone(),
                    priority_class: priority_class.clone(),
                    burst: admission == quota::Admission::Burst,
                    ending_as: None,
                    end_reason: None,
                    ended_at_ms: None,
                    containers: vec![],
                };
                st.partitions
                    .insert(partition.id.clone(), partition.clone());
                st.leases.insert(lease.id.clone(), lease.clone());
                if let Some(rid) = &lease.request_id {
                    st.requests
                        .insert((lease.tenant.clone(), rid.clone()), lease.id.clone());
                }
                st.pending.insert(lease.id.clone(), notify.clone());
                Ok((lease, partition, hw))
            };
            match step {
                Ok(r) => break r,
                Err(Again::Preempt(victims)) => {
                    preempt_rounds += 1;
                    holding_capacity = true;
                    self.preempt(&victims, &req.tenant).await;
                }
                Err(Again::WaitTeardowns) => {
                    preempt_rounds += 1;
                    holding_capacity = true;
                    self.wait_for_teardowns(Duration::from_secs(5)).await;
                }
                Err(Again::SameRequest(lid, pending)) => match pending {
                    // Still being created: wait, then answer as a retry would.
                    Some(done) => {
                        done.await;
                        return Box::pin(self.create(req)).await;
                    }
                    None => return self.replay(&lid).await,
                },
            }
        };

        // 2. Durable intent (or, without hardware work, the final record).
        let op = match &hw {
            Some(HwCreate::Mig { .. }) => Some(IntentOp::CreateMig),
            Some(HwCreate::Mps(_)) => Some(IntentOp::StartMps),
            None => None,
        };
        let (l2, p2, h2) = (lease.clone(), partition.clone(), tok_hash.clone());
        let intent = self
            .store
            .write(move |w| {
                w.put_lease(&l2)?;
                w.put_partition(&p2)?;
                w.add_token(&h2, &l2.id, now)?;
                op.map(|op| w.begin_intent(op, &p2.id, Some(&l2.id), now))
                    .transpose()
            })
            .await;
        let intent = match intent {
            Ok(i) => i,
            Err(e) => {
                self.forget_reservation(&lease, &partition, true);
                return Err(match e {
                    StoreError::DuplicateRequest { .. } => LeaseError::FailedPrecondition(
                        "a lease with this request_id is being created concurrently; retry".into(),
                    ),
                    e => e.into(),
                });
            }
        };

        let Some(hw) = hw else {
            // Static-pool partition or whole GPU: nothing to change on the hardware.
            let mut st = self.lock();
            st.tokens.insert(tok_hash, lease.id.clone());
            if let Some(n) = st.pending.remove(&lease.id) {
                n.notify_waiters();
            }
            drop(st);
            self.emit(EventKind::Created, &lease, Some(&partition), String::new());
            info!(lease = %lease.id, tenant = %lease.tenant, gpu = lease.gpu, "lease created");
            return Ok(Created {
                lease,
                partition: Some(partition),
                token: Some(tok),
                replayed: false,
            });
        };
        let intent = intent.ok_or_else(|| LeaseError::Internal("intent id missing".into()))?;

        // 3. Hardware.
        let result = self.hw_create(hw).await;

        // 4. Outcome.
        let mut lease = lease;
        let mut partition = partition;
        let now = now_ms();
        match result {
            Ok(inst) => {
                partition.state = PartitionState::Ready;
                if let (PartKind::Mig(m), Some(inst)) = (&mut partition.kind, inst) {
                    m.gi_id = Some(inst.gi_id);
                    m.ci_id = inst.ci_id;
                    m.uuid = Some(inst.uuid);
                }
                lease.state = LeaseState::Active;
                let (l2, p2) = (lease.clone(), partition.clone());
                let res = self
                    .store
                    .write(move |w| {
                        w.put_partition(&p2)?;
                        w.put_lease(&l2)?;
                        w.finish_intent(intent, now, "done")
                    })
                    .await;
                if let Err(e) = res {
                    // The hardware exists and the intent stays open: the next start
                    // reconciles it. Keep the reservation so nothing else takes it.
                    return Err(e.into());
                }
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
                Ok(Created {
                    lease,
                    partition: Some(partition),
                    token: Some(tok),
                    replayed: false,
                })
            }
            Err(e) => {
                lease.state = LeaseState::Failed;
                lease.end_reason = Some(format!("hardware set-up failed: {e}"));
                lease.ended_at_ms = Some(now);
                // A create can fail after its GI exists (an error between the GI and
                // the CI step without rollback): destroy that GI before giving the
                // placement back. If that fails too, the partition row keeps the
                // placement and the intent stays open for the next start to undo.
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
                Err(match e.nvml_code() {
                    Some(NvmlCode::InsufficientResources) => LeaseError::ResourceExhausted(
                        format!("GPU {} has no room for this instance: {e}", partition.gpu),
                    ),
                    _ => LeaseError::Hardware(e),
                })
            }
        }
    }

    /// Destroy the GI a failed create left without its CI at the placement this
    /// create reserved (nothing else can be there).
    pub(super) async fn undo_half_create(&self, gpu: u32, m: &MigPart) -> Result<(), GpuError> {
        let backend = self.backend.clone();
        let (placement, profile) = (m.placement, m.gi_profile_id);
        let run = move || {
            let half = backend.instances(gpu)?.into_iter().find(|i| {
                i.placement == placement && i.gi_profile_id == profile && i.ci_id.is_none()
            });
            match half {
                Some(i) => backend.destroy_instance(gpu, i.gi_id),
                None => Ok(()),
            }
        };
        tokio::task::spawn_blocking(run)
            .await
            .map_err(|e| GpuError::Task(e.to_string()))?
    }

    pub(super) fn forget_reservation(
        &self,
        lease: &Lease,
        partition: &Partition,
        undo_static: bool,
    ) {
        let mut st = self.lock();
        st.leases.remove(&lease.id);
        if let Some(rid) = &lease.request_id {
            st.requests.remove(&(lease.tenant.clone(), rid.clone()));
        }
        if partition.origin == Origin::Static && undo_static {
            if let Some(p) = st.partitions.get_mut(&partition.id) {
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
        if !lease.state.is_live() {
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
        let backend = self.backend.clone();
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
                for dir in [&spec.pipe_dir, &spec.log_dir] {
                    create_private_dir(dir)?;
                }
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
