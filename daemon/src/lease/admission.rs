//! The CreateLease decision: quota, placement, preemption of burst leases and moves
//! of idle ones, as a pure function of the table and the request that returns a
//! [`Plan`]. Nothing here locks or changes anything: the executor reserves what a
//! plan places (under the same lock the decision read the table with) and acts.

use crate::config::{Amounts, TenancyConfig};
use crate::gpu::MpsMode;
use crate::model::{
    Lease, LeaseState, MigPart, MpsPart, NewLease, Origin, PartKind, Partition, PartitionState,
    mig_mps_key, shared_mps_key,
};
use crate::partition::{
    self, MigMpsDecision, MpsShare, PlanDecision, PlanError, PlanOptions, Shape,
};

use super::error::{Inconsistency, LeaseError};
use super::manager::LeaseManager;
use super::plan::{Ask, HwCreate, Placement, Plan};
use super::quota;
use super::table::{GpuState, State};

impl LeaseManager {
    /// The decision about `ask` on the table `st`: admission (quota), then
    /// placement. A request within its tenant's guarantee that does not fit may
    /// plan to preempt burst leases of other tenants (or to wait for teardowns)
    /// first; a single MIG instance may plan to move idle leases. `rounds`: how
    /// many such plans this request has run already (at most 3 each). Reads only
    /// `st` and the configuration.
    pub(super) fn decide(
        &self,
        st: &State,
        ask: &Ask<'_>,
        tenancy: &TenancyConfig,
        extra: Amounts,
        rounds: u32,
    ) -> Result<Plan, LeaseError> {
        let req = ask.req;
        // A concurrent call with the same request id got here first.
        if let Some(rid) = &req.request_id
            && st.requests.contains_key(&(req.tenant.clone(), rid.clone()))
        {
            return Ok(Plan::SameRequest);
        }
        let admission = Self::admit(st, tenancy, &req.tenant, &ask.shape, ask.count, extra)?;
        let opts = self.plan_options(req.gpu_index);
        if let Some(g) = req.gpu_index
            && let Some(m) = st.unhealthy(g, None)
        {
            return Err(LeaseError::GpuUnhealthy(format!(
                "{}; it takes no new leases until it is back in service",
                m.describe()
            )));
        }
        let fit = Fit {
            st,
            tenancy,
            ask,
            admission,
            rounds,
        };
        // An exact placement (DRA): there or refused, nothing moved or preempted.
        if let Some(at) = req.exact {
            let decision = super::exact::decide(&ask.shape, at, &Self::placeable_views(st), &opts)?;
            let part = self.partition_for(st, decision, ask, &ask.partition_id)?;
            return Ok(Plan::Place(Box::new(fit.placement(vec![part]))));
        }
        if ask.count > 1 {
            return self.decide_several(&fit, &opts);
        }
        if let Shape::MigMps { .. } = &ask.shape {
            return self.decide_mig_mps_share(&fit, &opts);
        }
        self.decide_one(&fit, opts)
    }

    /// One partition (not a share inside MIG): [`LeaseManager::decide_one_on`] the
    /// placeable GPUs, less the regions held for other profiles' refused large MIG
    /// requests (`partition::reservation`). A MIG request placed uses up its own
    /// profile's reservation there; one refused for lack of room may hold a region.
    fn decide_one(&self, fit: &Fit<'_>, opts: PlanOptions) -> Result<Plan, LeaseError> {
        let views = Self::placeable_views(fit.st);
        let reserve = self.config.partition.reserve;
        let Shape::Mig { profile, .. } = &fit.ask.shape else {
            return self.decide_one_on(fit, opts, &views, &|v| v.to_vec());
        };
        if !reserve.enabled() {
            return self.decide_one_on(fit, opts, &views, &|v| v.to_vec());
        }
        let now = u64::try_from(fit.ask.now).unwrap_or(0);
        // Held through the decision (which never waits), so two decisions never
        // interleave their reservations.
        let mut guard = self.queue.reservations(reserve);
        let Some(held) = guard.as_mut() else {
            return self.decide_one_on(fit, opts, &views, &|v| v.to_vec());
        };
        held.refresh(&views, now);
        let ttl_ms = u64::try_from(fit.ask.ttl.as_millis()).unwrap_or(u64::MAX);
        let expires_at = Some(now.saturating_add(ttl_ms));
        let out = {
            let held: &partition::Reservations = held;
            // Burst leases are preempted only for room outside the held regions.
            let outside = |v: &[partition::GpuView]| held.view(v, profile, expires_at);
            self.decide_one_on(fit, opts, &outside(&views), &outside)
        };
        match &out {
            Ok(Plan::Place(p)) => {
                for (part, _) in &p.parts {
                    if let Some(m) = part.mig() {
                        held.granted(profile, part.gpu, m.placement);
                    }
                }
            }
            Err(LeaseError::ResourceExhausted(_)) => {
                held.refused(profile, &views, &Self::instance_ends(fit.st), now);
            }
            _ => {}
        }
        out
    }

    /// `views` less the regions held against MIG request `ask` (several instances of
    /// one profile stay out of other profiles' reservations, but make none).
    fn outside_held_regions(
        &self,
        ask: &Ask<'_>,
        views: Vec<partition::GpuView>,
    ) -> Vec<partition::GpuView> {
        let reserve = self.config.partition.reserve;
        let Shape::Mig { profile, .. } = &ask.shape else {
            return views;
        };
        if !reserve.enabled() {
            return views;
        }
        let now = u64::try_from(ask.now).unwrap_or(0);
        let ttl_ms = u64::try_from(ask.ttl.as_millis()).unwrap_or(u64::MAX);
        let mut guard = self.queue.reservations(reserve);
        let Some(held) = guard.as_mut() else {
            return views;
        };
        held.refresh(&views, now);
        held.view(&views, profile, Some(now.saturating_add(ttl_ms)))
    }

    /// When each leased MIG instance expires at the latest: (GPU, placement, Unix ms).
    fn instance_ends(st: &State) -> Vec<partition::InstanceEnd> {
        st.partitions
            .values()
            .filter_map(|p| {
                let m = p.mig()?;
                let lease = st.leases.get(p.lease_id.as_deref()?)?;
                Some((
                    p.gpu,
                    m.placement,
                    u64::try_from(lease.expires_at_ms).unwrap_or(0),
                ))
            })
            .collect()
    }

    /// One partition on `views`: the planner's place, else idle MIG leases moved,
    /// else burst leases preempted (where `outside` of the held regions, the views
    /// with the victims gone, has room), else a refusal.
    fn decide_one_on(
        &self,
        fit: &Fit<'_>,
        opts: PlanOptions,
        views: &[partition::GpuView],
        outside: &dyn Fn(&[partition::GpuView]) -> Vec<partition::GpuView>,
    ) -> Result<Plan, LeaseError> {
        let (st, ask) = (fit.st, fit.ask);
        // Temporal packing: the planner weighs when the new lease and those present
        // expire (MIG best fit only; other shapes ignore it).
        let opts = PlanOptions {
            expiry: Some(Self::expiry(st, ask.now, ask.ttl)),
            ..opts
        };
        let decision = match partition::plan(&ask.shape, views, &opts) {
            Ok(d) => d,
            Err(PlanError::NoCapacity(msg))
                if self.config.partition.move_idle
                    && fit.rounds < 3
                    && matches!(ask.shape, Shape::Mig { .. }) =>
            {
                let movable = Self::movable(st);
                match partition::plan_with_moves(&ask.shape, views, &opts, &movable) {
                    Ok(p) if !p.moves.is_empty() => return Ok(Plan::Move(p.moves, msg)),
                    Ok(p) => p.decision,
                    Err(_) => return fit.refused_or_preempt(&opts, msg, outside),
                }
            }
            Err(PlanError::NoCapacity(msg)) => return fit.refused_or_preempt(&opts, msg, outside),
            Err(e) => return Err(e.into()),
        };
        let part = self.partition_for(st, decision, ask, &ask.partition_id)?;
        Ok(Plan::Place(Box::new(fit.placement(vec![part]))))
    }

    /// MPS inside MIG: the share joins the host instance set up before
    /// (`ensure_mig_mps_host`).
    fn decide_mig_mps_share(&self, fit: &Fit<'_>, opts: &PlanOptions) -> Result<Plan, LeaseError> {
        let (st, ask) = (fit.st, fit.ask);
        match Self::plan_mig_mps_share(st, ask, opts)? {
            (MigMpsDecision::Join { host, .. }, _) => {
                let part = self.mig_mps_share_for(st, &host, ask)?;
                Ok(Plan::Place(Box::new(fit.placement(vec![part]))))
            }
            (MigMpsDecision::NewHost(_), profile) => Err(LeaseError::ResourceExhausted(format!(
                "the {profile} instance set up for this share was taken by another request; retry"
            ))),
        }
    }

    /// Where a share inside MIG of `ask` goes: an instance of its tenant with room,
    /// or a new host instance; and the MIG profile asked for.
    pub(super) fn plan_mig_mps_share<'a>(
        st: &State,
        ask: &'a Ask<'_>,
        opts: &PlanOptions,
    ) -> Result<(MigMpsDecision, &'a str), LeaseError> {
        let Shape::MigMps {
            profile,
            sm_percent,
            memory_bytes,
        } = &ask.shape
        else {
            return Err(LeaseError::Inconsistent(Inconsistency::ShapeMismatch {
                decision: "an MPS share inside MIG",
                shape: "another",
            }));
        };
        let decision = partition::plan_mig_mps(
            profile,
            *sm_percent,
            *memory_bytes,
            &ask.req.tenant,
            &Self::mig_mps_hosts(st),
            &Self::placeable_views(st),
            opts,
        )?;
        Ok((decision, profile))
    }

    /// Several partitions: all placed by topology, else burst leases preempted,
    /// else a refusal (idle leases are not moved for several).
    fn decide_several(&self, fit: &Fit<'_>, opts: &PlanOptions) -> Result<Plan, LeaseError> {
        let (st, ask) = (fit.st, fit.ask);
        let views = self.outside_held_regions(ask, Self::placeable_views(st));
        match Self::plan_several(st, ask, &views, opts) {
            Ok(decisions) => {
                let parts = self.partitions_for_several(st, ask, decisions)?;
                Ok(Plan::Place(Box::new(fit.placement(parts))))
            }
            // Burst leases of other tenants may make room, or room within the
            // topology asked for.
            Err(refusal @ (PlanError::NoCapacity(_) | PlanError::TopologyUnmet(_))) => {
                let fits = |v: &[partition::GpuView]| Self::plan_several(st, ask, v, opts).is_ok();
                fit.preempt_or_refuse(fit.victims_if_allowed(&fits), refusal)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A multi-partition lease's places on `views`: N whole GPUs
    /// (`plan_gpus_within`) or N MIG instances of one profile (`plan_migs`), by the
    /// board's topology and within the request's constraint. All or nothing: a
    /// refusal places none. Idle leases are not moved to make room (a guaranteed
    /// request may preempt burst leases, as a single partition's may).
    fn plan_several(
        st: &State,
        ask: &Ask<'_>,
        views: &[partition::GpuView],
        opts: &PlanOptions,
    ) -> Result<Vec<PlanDecision>, PlanError> {
        let link = |a: u32, b: u32| st.link(a, b);
        let constraint = ask.req.topology;
        match &ask.shape {
            Shape::WholeGpu => Ok(partition::topology::plan_gpus_within(
                ask.count, views, &link, constraint,
            )?
            .into_iter()
            .map(|gpu| PlanDecision::WholeGpu { gpu })
            .collect()),
            Shape::Mig { .. } => partition::topology::plan_migs(
                &ask.shape, ask.count, views, opts, &link, constraint,
            ),
            _ => Err(PlanError::InvalidShape(
                "shape.count: only MIG instances and whole GPUs come several to a lease".into(),
            )),
        }
    }

    /// The partitions of a multi-partition lease's `decisions` (the first is its
    /// `partition_id`).
    fn partitions_for_several(
        &self,
        st: &State,
        ask: &Ask<'_>,
        decisions: Vec<PlanDecision>,
    ) -> Result<Vec<(Partition, Option<HwCreate>)>, LeaseError> {
        decisions
            .into_iter()
            .enumerate()
            .map(|(i, d)| {
                let id = if i == 0 {
                    ask.partition_id.clone()
                } else {
                    crate::names::new_id("p-")
                };
                self.partition_for(st, d, ask, &id)
            })
            .collect()
    }

    /// Quota admission: guaranteed, burst, or refused. A burst request waits while
    /// capacity is being freed for another tenant's guaranteed request.
    pub(super) fn admit(
        st: &State,
        tenancy: &TenancyConfig,
        tenant: &str,
        shape: &Shape,
        count: u32,
        extra: Amounts,
    ) -> Result<quota::Admission, LeaseError> {
        let used = st.leases.live_usage(tenant);
        let wanted = quota::amounts_of_n(shape, count);
        let admission = quota::admit(tenancy, tenant, used, wanted, extra)
            .map_err(LeaseError::QuotaExceeded)?;
        if admission == quota::Admission::Burst && st.preempting > 0 {
            // Capacity being freed by a preemption belongs to the guaranteed
            // request that caused it, not to a burst request racing it.
            return Err(LeaseError::BurstWaits(
                "capacity is being freed for another tenant's guaranteed request; burst requests wait".into(),
            ));
        }
        Ok(admission)
    }

    /// The partition a planner decision stands for, and the hardware step it needs.
    fn partition_for(
        &self,
        st: &State,
        decision: PlanDecision,
        ask: &Ask<'_>,
        partition_id: &str,
    ) -> Result<(Partition, Option<HwCreate>), LeaseError> {
        let gpu_index = match &decision {
            PlanDecision::NewMig { gpu, .. }
            | PlanDecision::Static { gpu, .. }
            | PlanDecision::Mps { gpu }
            | PlanDecision::WholeGpu { gpu } => *gpu,
        };
        let gpu =
            st.gpus
                .iter()
                .find(|g| g.info.index == gpu_index)
                .ok_or(LeaseError::Inconsistent(Inconsistency::UnknownGpu(
                    gpu_index,
                )))?;
        let dynamic = |state, kind| Partition {
            id: partition_id.to_string(),
            gpu: gpu_index,
            gpu_uuid: gpu.info.uuid.clone(),
            origin: Origin::Dynamic,
            state,
            lease_id: Some(ask.lease_id.clone()),
            kind,
        };
        Ok(match decision {
            PlanDecision::NewMig {
                gi_profile_id,
                placement,
                ci_profile_id,
                ..
            } => {
                let mig = Self::mig_part(gpu, gi_profile_id, placement, ci_profile_id)?;
                let hw = HwCreate::Mig {
                    gpu: gpu_index,
                    gi_profile_id,
                    placement,
                    ci_profile_id,
                };
                (
                    dynamic(PartitionState::Creating, PartKind::Mig(mig)),
                    Some(hw),
                )
            }
            PlanDecision::Static { partition_id, .. } => {
                let mut p =
                    st.partitions
                        .get(&partition_id)
                        .cloned()
                        .ok_or(LeaseError::Inconsistent(Inconsistency::UnknownPartition(
                            partition_id,
                        )))?;
                p.lease_id = Some(ask.lease_id.clone());
                (p, None)
            }
            PlanDecision::Mps { .. } => {
                let mps = self.mps_part_for(gpu, ask)?;
                let p = dynamic(PartitionState::Creating, PartKind::Mps(mps));
                let spec = p.mps_spec(&ask.lease_id).ok_or(LeaseError::Inconsistent(
                    Inconsistency::ShapeMismatch {
                        decision: "an MPS share",
                        shape: "non-MPS",
                    },
                ))?;
                // Shared: the first lease starts the server, later ones find it
                // running (starting is idempotent), each under its own intent.
                (p, Some(HwCreate::Mps(spec)))
            }
            PlanDecision::WholeGpu { .. } => {
                (dynamic(PartitionState::Ready, PartKind::WholeGpu), None)
            }
        })
    }

    /// A new MIG partition's description from its GI (and CI) profile.
    pub(super) fn mig_part(
        gpu: &GpuState,
        gi_profile_id: u32,
        placement: crate::gpu::Placement,
        ci_profile_id: Option<u32>,
    ) -> Result<MigPart, LeaseError> {
        let prof =
            gpu.profiles
                .iter()
                .find(|p| p.id == gi_profile_id)
                .ok_or(LeaseError::Inconsistent(Inconsistency::UnknownProfile {
                    gpu: gpu.info.index,
                    profile_id: gi_profile_id,
                }))?;
        let ci = ci_profile_id.and_then(|id| prof.ci_profiles.iter().find(|c| c.id == id));
        Ok(MigPart {
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
            mps_host: None,
        })
    }

    /// The MPS partition a new MPS lease gets: isolated, its own control daemon
    /// with private directories under `<run_dir>/mps/<lease>`; shared, the GPU's
    /// server for its tenant under `<run_dir>/mps/shared-gpu<N>-<tenant>`.
    fn mps_part_for(&self, gpu: &GpuState, ask: &Ask<'_>) -> Result<MpsPart, LeaseError> {
        let Shape::Mps {
            sm_percent,
            memory_bytes,
            mode,
        } = ask.shape
        else {
            return Err(LeaseError::Inconsistent(Inconsistency::ShapeMismatch {
                decision: "an MPS share",
                shape: "non-MPS",
            }));
        };
        let dir = match mode {
            MpsMode::Isolated => ask.lease_id.clone(),
            MpsMode::Shared => shared_mps_key(gpu.info.index, &ask.req.tenant),
        };
        let base = self.config.daemon.run_dir.join("mps").join(dir);
        Ok(MpsPart {
            sm_percent,
            memory_bytes,
            pipe_dir: base.join("pipe"),
            log_dir: base.join("log"),
            owner_uid: None,
            mode,
            host: None,
        })
    }

    /// MPS inside MIG: the share partition of a lease on host instance `host_id`,
    /// served by the instance's one MPS server (`<run_dir>/mps/mig-<host>`), and
    /// the hardware step (start that server, or find it running).
    fn mig_mps_share_for(
        &self,
        st: &State,
        host_id: &str,
        ask: &Ask<'_>,
    ) -> Result<(Partition, Option<HwCreate>), LeaseError> {
        let Shape::MigMps {
            sm_percent,
            memory_bytes,
            ..
        } = ask.shape
        else {
            return Err(LeaseError::Inconsistent(Inconsistency::ShapeMismatch {
                decision: "an MPS share inside MIG",
                shape: "another",
            }));
        };
        let host = st.partitions.get(host_id).ok_or_else(|| {
            LeaseError::Inconsistent(Inconsistency::UnknownPartition(host_id.to_string()))
        })?;
        let uuid = host.mig().and_then(|m| m.uuid.clone()).ok_or_else(|| {
            LeaseError::Inconsistent(Inconsistency::UnknownPartition(host_id.to_string()))
        })?;
        let base = self
            .config
            .daemon
            .run_dir
            .join("mps")
            .join(mig_mps_key(host_id));
        let p = Partition {
            id: ask.partition_id.clone(),
            gpu: host.gpu,
            gpu_uuid: uuid,
            origin: Origin::Dynamic,
            state: PartitionState::Creating,
            lease_id: Some(ask.lease_id.clone()),
            kind: PartKind::Mps(MpsPart {
                sm_percent,
                memory_bytes,
                pipe_dir: base.join("pipe"),
                log_dir: base.join("log"),
                owner_uid: None,
                mode: MpsMode::Shared,
                host: Some(host_id.to_string()),
            }),
        };
        let spec = p.mps_spec(&ask.lease_id).ok_or(LeaseError::Inconsistent(
            Inconsistency::ShapeMismatch {
                decision: "an MPS share",
                shape: "non-MPS",
            },
        ))?;
        Ok((p, Some(HwCreate::Mps(spec))))
    }

    /// The smallest set of preemptible leases (in victim order) whose partitions,
    /// once freed, make the request fit. Empty when no such set exists.
    pub(super) fn pick_victims(
        st: &State,
        tenancy: &TenancyConfig,
        tenant: &str,
        fits: &dyn Fn(&[partition::GpuView]) -> bool,
    ) -> Vec<String> {
        // Pending leases count too: a burst lease still being created holds
        // capacity; it is preempted once its creation finishes.
        let live: Vec<&Lease> = st
            .leases
            .values()
            .filter(|l| matches!(l.state(), LeaseState::Active | LeaseState::Pending))
            .collect();
        let order = quota::victims_in_order(tenancy, tenant, &live);
        let mut views = Self::placeable_views(st);
        let mut chosen = Vec::new();
        for v in order {
            // Every partition of the victim comes free.
            for pid in v.partition_ids() {
                let Some(p) = st.partitions.get(pid) else {
                    continue;
                };
                Self::free_in_views(&mut views, p);
            }
            chosen.push(v.id.clone());
            if fits(&views) {
                return chosen;
            }
        }
        Vec::new()
    }

    /// `p`'s place, free in the planner's views (a preemption victim's).
    fn free_in_views(views: &mut [partition::GpuView], p: &Partition) {
        {
            let Some(view) = views.iter_mut().find(|g| g.info.index == p.gpu) else {
                return;
            };
            match &p.kind {
                PartKind::Mig(m) => {
                    if let Some(i) = view.mig.iter().position(|o| o.placement == m.placement) {
                        if p.origin == Origin::Static {
                            view.mig[i].free_static = Some(p.id.clone());
                        } else {
                            view.mig.remove(i);
                        }
                    }
                }
                // Shares inside a MIG instance are the instance's, not the GPU's.
                PartKind::Mps(m) if m.host.is_some() => {}
                PartKind::Mps(m) => view.mps.remove(MpsShare {
                    sm_percent: m.sm_percent,
                    memory_bytes: m.memory_bytes,
                    mode: m.mode,
                }),
                PartKind::WholeGpu => view.whole_leased = false,
            }
        }
    }
}

/// A request admitted, on the table it was decided on.
struct Fit<'a> {
    st: &'a State,
    tenancy: &'a TenancyConfig,
    ask: &'a Ask<'a>,
    admission: quota::Admission,
    rounds: u32,
}

impl Fit<'_> {
    /// The new lease on `parts` (the first is its `partition_id`): pending while
    /// any partition needs the hardware changed.
    fn placement(&self, parts: Vec<(Partition, Option<HwCreate>)>) -> Placement {
        let (ask, req) = (self.ask, self.ask.req);
        let (partition_id, gpu) = parts
            .first()
            .map(|(p, _)| (p.id.clone(), p.gpu))
            .unwrap_or_else(|| (ask.partition_id.clone(), 0));
        let pending = parts.iter().any(|(_, hw)| hw.is_some());
        let mut lease = Lease::reserved(
            NewLease {
                id: ask.lease_id.clone(),
                tenant: req.tenant.clone(),
                shape: ask.shape.clone(),
                partition_id,
                gpu,
                more_partitions: parts.iter().skip(1).map(|(p, _)| p.id.clone()).collect(),
                created_at_ms: ask.now,
                ttl_secs: ask.ttl.as_secs(),
                request_id: req.request_id.clone(),
                labels: req.labels.clone(),
                priority_class: ask.priority_class.clone(),
                burst: self.admission == quota::Admission::Burst,
            },
            pending,
        );
        // Only a lease of one partition is held to the GPU asked for.
        if ask.count <= 1 {
            lease.pinned_gpu = req.gpu_index.is_some();
        }
        Placement { lease, parts }
    }

    /// No room: a guaranteed request may preempt burst leases of other tenants (or
    /// wait for teardowns in progress) and plan again; anything else is refused.
    fn refused_or_preempt(
        &self,
        opts: &PlanOptions,
        msg: String,
        outside: &dyn Fn(&[partition::GpuView]) -> Vec<partition::GpuView>,
    ) -> Result<Plan, LeaseError> {
        let fits =
            |v: &[partition::GpuView]| partition::plan(&self.ask.shape, &outside(v), opts).is_ok();
        self.preempt_or_refuse(self.victims_if_allowed(&fits), PlanError::NoCapacity(msg))
    }

    /// The burst leases to preempt so that `fits`, if the request may preempt at
    /// all (a guaranteed request, preemption on, tenants configured, fewer than 3
    /// rounds): None when it may not.
    fn victims_if_allowed(
        &self,
        fits: &dyn Fn(&[partition::GpuView]) -> bool,
    ) -> Option<Vec<String>> {
        let tenancy = self.tenancy;
        (self.admission == quota::Admission::Guaranteed
            && tenancy.preemption
            && !tenancy.tenants.is_empty()
            && self.rounds < 3)
            .then(|| LeaseManager::pick_victims(self.st, tenancy, &self.ask.req.tenant, fits))
    }

    /// Preempt `victims` (or wait for teardowns in progress, which give capacity
    /// back in a moment), or refuse with `refusal` when there is neither.
    fn preempt_or_refuse(
        &self,
        victims: Option<Vec<String>>,
        refusal: PlanError,
    ) -> Result<Plan, LeaseError> {
        let Some(victims) = victims else {
            return Err(refusal.into());
        };
        if victims.is_empty() && self.st.tearing_down.is_empty() {
            return Err(refusal.into());
        }
        // Without victims, capacity held by leases being torn down right now comes
        // back in a moment: wait for that, then decide again.
        Ok(if victims.is_empty() {
            Plan::WaitTeardowns
        } else {
            Plan::Preempt(victims)
        })
    }
}
