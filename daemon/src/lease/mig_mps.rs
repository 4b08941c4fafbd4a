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
use super::plan::{Ask, HwCreate, Outcome, Publish};
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
            let mut st = self.mgr.lock();
            if let Some(n) = st.host_claims.get_mut(&h) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    st.host_claims.remove(&h);
                }
            }
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
        let (host, setup) = {
            let mut st = self.change();
            let (host, setup) = self.decide_mig_mps_host(&st, ask, tenancy, extra)?;
            // Reserved in the table: a free pool instance marked as the tenant's
            // host, a new one as being created.
            match &setup {
                Some(Setup::Static(p) | Setup::New(p, _)) => {
                    st.partitions.insert(p.id.clone(), p.clone());
                }
                None => {}
            }
            *st.host_claims.entry(host.clone()).or_default() += 1;
            claim.host = Some(host.clone());
            (host, setup)
        };
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
        if let Err(e) = self.store.write(move |w| w.put_partition(&p)).await {
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
        if let Some(mut p) = self.change().partitions.get_mut(partition_id)
            && let PartKind::Mig(m) = &mut p.kind
        {
            m.mps_host = None;
        }
    }

    /// Housekeeping: every MIG instance hosting MPS shares whose last share has
    /// gone (and that no CreateLease holds) is destroyed write-ahead, or becomes a
    /// free pool instance (a static one, or `on_release = "keep"`). A failure leaves
    /// it hosting nothing and is tried again at the next tick.
    pub(super) async fn reap_idle_mps_hosts(&self) {
        let idle: Vec<(Partition, Partition)> = {
            let mut st = self.change();
            let used: std::collections::HashSet<String> = st
                .partitions
                .values()
                .filter_map(|p| p.mps().and_then(|m| m.host.clone()))
                .collect();
            let ids: Vec<String> = st
                .partitions
                .values()
                .filter(|p| {
                    p.state == PartitionState::Ready
                        && p.mig().is_some_and(|m| m.mps_host.is_some())
                        && !used.contains(&p.id)
                        && !st.host_claims.contains_key(&p.id)
                })
                .map(|p| p.id.clone())
                .collect();
            let keep = self.config.partition.on_release == OnRelease::Keep;
            ids.into_iter()
                .filter_map(|id| {
                    let mut p = st.partitions.get_mut(&id)?;
                    let before = p.clone();
                    if p.origin == Origin::Static || keep {
                        if let PartKind::Mig(m) = &mut p.kind {
                            m.mps_host = None;
                        }
                    } else {
                        p.state = PartitionState::Destroying;
                    }
                    Some((before, p.clone()))
                })
                .collect()
        };
        for (before, p) in idle {
            if let Err(e) = self.reap_host(&p).await {
                warn!(partition = %p.id, error = %e, "an idle MPS host instance could not be torn down; will retry");
                // As it was: hosting nothing, tried again at the next tick.
                self.change().partitions.insert(before.id.clone(), before);
            }
        }
    }

    async fn reap_host(&self, p: &Partition) -> Result<(), LeaseError> {
        if p.state != PartitionState::Destroying {
            // Back to the pool: only the record changes.
            let p2 = p.clone();
            self.store.write(move |w| w.put_partition(&p2)).await?;
            info!(partition = %p.id, "MPS host instance has no shares left: back in the free pool");
            return Ok(());
        }
        let Some(gi_id) = p.mig().and_then(|m| m.gi_id) else {
            return Ok(());
        };
        let (p2, now) = (p.clone(), now_ms());
        let intent = self
            .store
            .write(move |w| {
                w.put_partition(&p2)?;
                w.begin_intent(IntentOp::DestroyMig, &p2.id, None, now)
            })
            .await?;
        let backend = self.backend.clone();
        let gpu = p.gpu;
        let done = tokio::task::spawn_blocking(move || backend.destroy_instance(gpu, gi_id))
            .await
            .map_err(|source| LeaseError::Task {
                what: "MPS host teardown",
                source,
            })?;
        match done {
            Ok(()) => {}
            Err(e) if e.nvml_code() == Some(crate::gpu::NvmlCode::NotFound) => {}
            Err(e) => {
                let now = now_ms();
                let mut back = p.clone();
                back.state = PartitionState::Ready;
                // The instance is still there and its record says so.
                self.store
                    .write(move |w| {
                        w.put_partition(&back)?;
                        w.finish_intent(intent, now, "failed")
                    })
                    .await?;
                return Err(LeaseError::Hardware(e));
            }
        }
        let gone = Outcome {
            gone: vec![p.id.clone()],
            finished: vec![(intent, now_ms(), "done")],
            ..Outcome::default()
        };
        self.commit(gone, Publish::IfCommitted).await?;
        info!(partition = %p.id, gpu = p.gpu, "MPS host instance destroyed with its last share");
        Ok(())
    }
}

fn tenant_of(p: &Partition) -> String {
    p.mig().and_then(|m| m.mps_host.clone()).unwrap_or_default()
}
