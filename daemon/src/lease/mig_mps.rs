//! MPS inside MIG: the MIG instances that host MPS shares. The first share of a
//! tenant that finds no instance with room gets one set up (a new instance, created
//! write-ahead like any other, or a free static-pool one); when an instance's last
//! share has ended it is destroyed write-ahead, or kept as a free pool instance
//! (`partition.on_release = "keep"`, or a static one), by housekeeping.

use tessera_common::clock::now_ms;
use tracing::{info, warn};

use crate::config::OnRelease;
use crate::model::{IntentOp, Origin, PartKind, Partition, PartitionState};
use crate::names::new_id;
use crate::partition::{MigMpsDecision, PlanDecision, Shape};

use super::error::Inconsistency;
use super::error::LeaseError;
use super::manager::LeaseManager;
use super::plan::{Ask, DestroyError, HwCreate, HwDestroy, Marks, Outcome, Publish};
use super::table::State;

/// What setting up a host instance takes.
enum Setup {
    /// A free static-pool instance becomes the host: only its record changes.
    Static(Partition),
    /// A new instance: its record (creating) and the hardware step.
    New(Partition, HwCreate),
}

/// A host instance a CreateLease set up (or found) for its share: released when the
/// share is reserved on it (or the call gives up), so housekeeping never reaps it
/// in between.
pub(super) struct HostClaim<'m> {
    mgr: &'m LeaseManager,
    host: Option<String>,
}

impl Drop for HostClaim<'_> {
    fn drop(&mut self) {
        if let Some(h) = self.host.take() {
            self.mgr.release_host_claim(&h);
        }
    }
}

impl LeaseManager {
    /// Before the reservation of an MPS share inside MIG: make sure an instance of
    /// the tenant with room exists, setting one up when none has. Quota is checked
    /// first, so a refused request changes no hardware.
    pub(super) async fn ensure_mig_mps_host(
        &self,
        ask: &Ask<'_>,
        tenancy: &crate::config::TenancyConfig,
    ) -> Result<HostClaim<'_>, LeaseError> {
        let mut claim = HostClaim {
            mgr: self,
            host: None,
        };
        if !matches!(ask.shape, Shape::MigMps { .. }) {
            return Ok(claim);
        }
        let tenant = ask.req.tenant.clone();
        let extra = self.grants_extra(&tenant, ask.now);
        // Reserved in the table: a free pool instance marked as the tenant's host,
        // a new one as being created; either held by this call.
        let (host, setup) = self.hold_in_table(|st| {
            let (host, setup) = self.decide_mig_mps_host(st, ask, tenancy, extra)?;
            let held = Outcome {
                parts: match &setup {
                    Some(Setup::Static(p) | Setup::New(p, _)) => vec![p.clone()],
                    None => Vec::new(),
                },
                marks: Marks {
                    host_claims: vec![host.clone()],
                    ..Marks::default()
                },
                ..Outcome::default()
            };
            Ok((held, (host, setup)))
        })?;
        claim.host = Some(host.clone());
        match setup {
            None => {}
            Some(Setup::Static(p)) => self.adopt_static_host(p, &tenant).await?,
            Some(Setup::New(p, hw)) => self.create_host_instance(&host, p, hw).await?,
        }
        Ok(claim)
    }

    /// The host instance a share of `ask` joins (its partition id), and what
    /// setting it up takes when it is not there yet. Reads only `st`.
    fn decide_mig_mps_host(
        &self,
        st: &State,
        ask: &Ask<'_>,
        tenancy: &crate::config::TenancyConfig,
        extra: crate::config::Amounts,
    ) -> Result<(String, Option<Setup>), LeaseError> {
        let tenant = &ask.req.tenant;
        Self::admit(st, tenancy, tenant, &ask.shape, 1, extra)?;
        let opts = self.plan_options(ask.req.gpu_index);
        let (decision, _) = Self::plan_mig_mps_share(st, ask, &opts)?;
        match decision {
            MigMpsDecision::Join { host, .. } => Ok((host, None)),
            MigMpsDecision::NewHost(PlanDecision::Static { partition_id, .. }) => {
                // A free pool instance becomes the host: no hardware change.
                let mut p = st.partitions.get(&partition_id).cloned().ok_or_else(|| {
                    LeaseError::Inconsistent(Inconsistency::UnknownPartition(partition_id.clone()))
                })?;
                if let PartKind::Mig(m) = &mut p.kind {
                    m.mps_host = Some(tenant.clone());
                }
                Ok((partition_id, Some(Setup::Static(p))))
            }
            MigMpsDecision::NewHost(PlanDecision::NewMig {
                gpu,
                gi_profile_id,
                placement,
                ci_profile_id,
            }) => {
                let hw = HwCreate::Mig {
                    gpu,
                    gi_profile_id,
                    placement,
                    ci_profile_id,
                };
                let p = Self::new_host_instance(st, tenant, &hw)?;
                Ok((p.id.clone(), Some(Setup::New(p, hw))))
            }
            MigMpsDecision::NewHost(other) => {
                Err(LeaseError::Inconsistent(Inconsistency::ShapeMismatch {
                    decision: if matches!(other, PlanDecision::Mps { .. }) {
                        "an MPS share"
                    } else {
                        "a whole GPU"
                    },
                    shape: "an MPS share inside MIG",
                }))
            }
        }
    }

    /// The record (creating) of a new instance that `hw` makes to host `tenant`'s
    /// MPS shares.
    fn new_host_instance(st: &State, tenant: &str, hw: &HwCreate) -> Result<Partition, LeaseError> {
        let HwCreate::Mig {
            gpu,
            gi_profile_id,
            placement,
            ci_profile_id,
        } = *hw
        else {
            return Err(LeaseError::Inconsistent(Inconsistency::ShapeMismatch {
                decision: "an MPS share",
                shape: "an MPS share inside MIG",
            }));
        };
        let g = st
            .gpus
            .iter()
            .find(|g| g.info.index == gpu)
            .ok_or(LeaseError::Inconsistent(Inconsistency::UnknownGpu(gpu)))?;
        let mut mig = Self::mig_part(g, gi_profile_id, placement, ci_profile_id)?;
        mig.mps_host = Some(tenant.to_string());
        Ok(Partition {
            id: new_id("p-"),
            gpu,
            gpu_uuid: g.info.uuid.clone(),
            origin: Origin::Dynamic,
            state: PartitionState::Creating,
            lease_id: None,
            kind: PartKind::Mig(mig),
        })
    }

    /// A free static-pool instance, now the tenant's host: its record.
    async fn adopt_static_host(&self, p: Partition, tenant: &str) -> Result<(), LeaseError> {
        let id = p.id.clone();
        let adopted = Outcome {
            parts: vec![p],
            ..Outcome::default()
        };
        if let Err(e) = self.commit(adopted, Publish::IfCommitted).await {
            self.give_back_host(&id);
            return Err(e.into());
        }
        info!(partition = %id, tenant = %tenant, "static MIG instance now hosts MPS shares");
        Ok(())
    }

    /// A new host instance, write-ahead: its record and the intent, the hardware,
    /// then the outcome (ready, or the record gone and the half-made GI undone).
    async fn create_host_instance(
        &self,
        host: &str,
        p: Partition,
        hw: HwCreate,
    ) -> Result<(), LeaseError> {
        let intent = self
            .write_partition_intent(&p, IntentOp::CreateMig, None, now_ms())
            .await?;
        match self.hw_create(hw).await {
            Ok(inst) => {
                let mut ready = p;
                super::executor::ready(&mut ready, inst);
                let (gpu, tenant) = (ready.gpu, tenant_of(&ready));
                let made = Outcome {
                    parts: vec![ready],
                    finished: vec![(intent, now_ms(), "done")],
                    ..Outcome::default()
                };
                // If this fails the instance exists with its intent open: the next
                // start adopts it, and it stays occupied until then.
                self.commit(made, Publish::IfCommitted).await?;
                info!(partition = %host, gpu, tenant = %tenant, "MIG instance created to host MPS shares");
                Ok(())
            }
            Err(e) => {
                self.undo_host_instance(host, &p, intent).await;
                Err(LeaseError::Hardware(e))
            }
        }
    }

    /// A host instance whose creation failed: the GI a failed call left undone,
    /// then its record gone and its intent finished. If either fails, the next
    /// start resolves the open intent.
    async fn undo_host_instance(&self, host: &str, p: &Partition, intent: i64) {
        let undone = match &p.kind {
            PartKind::Mig(m) => self.undo_half_create(p.gpu, m).await,
            _ => Ok(()),
        };
        if undone.is_err() {
            return;
        }
        if let Err(se) = self.drop_partition_intent(host, intent).await {
            warn!(partition = %host, error = %se, "could not record a failed MPS host instance; the next start resolves it");
        }
    }

    fn give_back_host(&self, partition_id: &str) {
        let given_back = self.hold_in_table(|st| -> Result<_, LeaseError> {
            let mut parts = Vec::new();
            if let Some(p) = st.partitions.get(partition_id)
                && let PartKind::Mig(m) = &p.kind
            {
                let mut p = p.clone();
                p.kind = PartKind::Mig(crate::model::MigPart {
                    mps_host: None,
                    ..m.clone()
                });
                parts.push(p);
            }
            Ok((
                Outcome {
                    parts,
                    ..Outcome::default()
                },
                (),
            ))
        });
        if let Err(e) = given_back {
            warn!(partition = %partition_id, error = %e, "could not give an MPS host instance back");
        }
    }

    /// Housekeeping: every MIG instance hosting MPS shares whose last share has
    /// gone (and that no CreateLease holds) is destroyed write-ahead, or becomes a
    /// free pool instance (a static one, or `on_release = "keep"`). A failure leaves
    /// it hosting nothing and is tried again at the next tick.
    pub(super) async fn reap_idle_mps_hosts(&self) {
        let keep = self.config.partition.on_release == OnRelease::Keep;
        let idle = self.hold_in_table(|st| {
            let idle = idle_hosts(st, keep);
            let marked = Outcome {
                parts: idle.iter().map(|(_, p)| p.clone()).collect(),
                ..Outcome::default()
            };
            Ok((marked, idle))
        });
        for (before, p) in idle.unwrap_or_default() {
            if let Err(e) = self.reap_host(&p).await {
                warn!(partition = %p.id, error = %e, "an idle MPS host instance could not be torn down; will retry");
                // As it was: hosting nothing, tried again at the next tick.
                self.publish_only(Outcome {
                    parts: vec![before],
                    ..Outcome::default()
                });
            }
        }
    }

    /// One idle host instance (`p` as [`idle_hosts`] marked it): back in the
    /// pool (its record), or destroyed write-ahead: the intent, the hardware, the
    /// outcome (its record gone; or, when the hardware refused, ready again with
    /// its intent failed).
    async fn reap_host(&self, p: &Partition) -> Result<(), LeaseError> {
        if p.state != PartitionState::Destroying {
            // Back to the pool: only the record changes.
            let back = Outcome {
                parts: vec![p.clone()],
                ..Outcome::default()
            };
            self.commit(back, Publish::IfCommitted).await?;
            info!(partition = %p.id, "MPS host instance has no shares left: back in the free pool");
            return Ok(());
        }
        let Some(gi_id) = p.mig().and_then(|m| m.gi_id) else {
            return Ok(());
        };
        let intent = self
            .write_partition_intent(p, IntentOp::DestroyMig, None, now_ms())
            .await?;
        let gpu = p.gpu;
        let outcome = match self.destroy_hw(HwDestroy::Mig { gpu, gi_id }).await {
            Ok(()) => Outcome {
                gone: vec![p.id.clone()],
                finished: vec![(intent, now_ms(), "done")],
                ..Outcome::default()
            },
            Err(DestroyError::Task(source)) => {
                return Err(LeaseError::Task {
                    what: "MPS host teardown",
                    source,
                });
            }
            Err(DestroyError::Hardware(e)) => {
                // The instance is still there and its record says so.
                let mut back = p.clone();
                back.state = PartitionState::Ready;
                let kept = Outcome {
                    parts: vec![back],
                    finished: vec![(intent, now_ms(), "failed")],
                    ..Outcome::default()
                };
                self.commit(kept, Publish::IfCommitted).await?;
                return Err(LeaseError::Hardware(e));
            }
        };
        self.commit(outcome, Publish::IfCommitted).await?;
        info!(partition = %p.id, gpu = p.gpu, "MPS host instance destroyed with its last share");
        Ok(())
    }
}

/// Every MIG instance hosting MPS shares whose last share has gone and that no
/// CreateLease holds: (as it is, as it goes) -- hosting nothing (a static one, or
/// `keep`) or destroying. Reads only `st`.
fn idle_hosts(st: &State, keep: bool) -> Vec<(Partition, Partition)> {
    let used: std::collections::HashSet<&str> = st
        .partitions
        .values()
        .filter_map(|p| p.mps().and_then(|m| m.host.as_deref()))
        .collect();
    st.partitions
        .values()
        .filter(|p| {
            p.state == PartitionState::Ready
                && p.mig().is_some_and(|m| m.mps_host.is_some())
                && !used.contains(p.id.as_str())
                && !st.host_claims.contains_key(&p.id)
        })
        .map(|before| {
            let mut p = before.clone();
            if p.origin == Origin::Static || keep {
                if let PartKind::Mig(m) = &mut p.kind {
                    m.mps_host = None;
                }
            } else {
                p.state = PartitionState::Destroying;
            }
            (before.clone(), p)
        })
        .collect()
}

fn tenant_of(p: &Partition) -> String {
    p.mig().and_then(|m| m.mps_host.clone()).unwrap_or_default()
}
