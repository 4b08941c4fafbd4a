//! Start: load the store and reconcile it with the hardware (open intents,
//! vanished instances, MPS daemons, foreign instances).

use std::collections::{HashMap, HashSet};

use tessera_common::clock::now_ms;
use tracing::{info, warn};

use crate::gpu::{HealthCause, MigInstance, MpsMode};
use crate::model::{IntentOp, Lease, MigPart, PartKind, Partition, PartitionState};

use super::error::LeaseError;
use super::manager::LeaseManager;
use super::manager::mps_dirs;
use super::plan::Outcome;
use super::table::GpuState;
use super::table::State;

/// The MIG instances of each GPU, as the backend listed them at start.
pub(super) type Instances = HashMap<u32, Vec<MigInstance>>;

/// What reconciliation did, for the start-up log line.
#[derive(Default)]
pub(super) struct Reconciled {
    adopted: usize,
    rolled_back: usize,
    recreated: usize,
    mps_restarted: usize,
}

impl LeaseManager {
    /// Start: the store's records into memory, then each open intent resolved,
    /// each record checked against the hardware, and instances no record explains
    /// set aside as foreign.
    pub(super) fn load_and_reconcile(&self) -> Result<(), LeaseError> {
        let snap = self.store.snapshot()?;
        let (mut st, mut faults) = self.load_state(snap.partitions, snap.leases, snap.tokens)?;
        self.load_health(&mut st)?;
        let mut instances: Instances = HashMap::new();
        for g in &st.gpus {
            if g.info.mig_current && !faults.contains_key(&g.info.index) {
                match self.backend.instances(g.info.index) {
                    Ok(list) => {
                        instances.insert(g.info.index, list);
                    }
                    // One GPU that does not answer is fenced; the others serve.
                    Err(e) => {
                        warn!(gpu = g.info.index, error = %e, "the MIG instances of a GPU cannot be listed");
                        faults.insert(g.info.index, HealthCause::of_error(&e));
                    }
                }
            }
        }
        let lost: HashSet<u32> = faults.keys().copied().collect();
        let now = now_ms();
        let mut report = Reconciled::default();
        // Open intents first: each explains a hardware change that may be half done.
        // Those on a GPU fallen off the bus stay open: nothing can be learnt of it
        // until it is back, and the next start resolves them.
        let on_lost = |st: &State, pid: &str| {
            st.partitions
                .get(pid)
                .is_some_and(|p| lost.contains(&p.gpu))
        };
        // A multi-partition lease a crash caught being created: all or nothing.
        let several =
            self.reconcile_several_at_start(&mut st, &mut instances, &snap.intents, now)?;
        for intent in &snap.intents {
            if on_lost(&st, &intent.partition_id) || several.contains(&intent.id) {
                continue;
            }
            self.reconcile_intent(&mut st, &mut instances, intent, now, &mut report)?;
        }
        self.verify_records(&mut st, &mut instances, &lost, now, &mut report)?;
        for (gpu, cause) in faults {
            self.mark_lost_at_start(&mut st, gpu, cause)?;
        }
        Self::set_aside_foreign(&mut st, &instances);
        info!(
            leases = st.leases.len(),
            partitions = st.partitions.len(),
            intents = snap.intents.len(),
            adopted = report.adopted,
            rolled_back = report.rolled_back,
            recreated = report.recreated,
            mps_restarted = report.mps_restarted,
            foreign = st.foreign.len(),
            "state loaded and reconciled with the hardware"
        );
        self.serve(st);
        Ok(())
    }

    /// The GPUs as the backend reports them, and the live records of the store.
    /// GPUs that do not answer (fallen off the bus, a failing query, MIG profiles
    /// that cannot be read) come back with no profiles, in the second value with
    /// why: they are kept out of service and out of reconciliation.
    fn load_state(
        &self,
        partitions: Vec<Partition>,
        leases: Vec<Lease>,
        tokens: Vec<(String, String)>,
    ) -> Result<(State, HashMap<u32, HealthCause>), LeaseError> {
        let mut st = State::default();
        let mut faults = HashMap::new();
        for info in self.backend.devices()? {
            let profiles = match &info.fault {
                Some(cause) => {
                    faults.insert(info.index, cause.clone());
                    Vec::new()
                }
                None if info.mig_current => {
                    match super::health::read_profiles(self.backend.as_ref(), info.index) {
                        Ok(p) => p,
                        Err(e) => {
                            warn!(gpu = info.index, error = %e, "MIG profiles cannot be read: the GPU offers no MIG capacity and is kept out of service");
                            faults.insert(info.index, HealthCause::of_error(&e));
                            Vec::new()
                        }
                    }
                }
                None => Vec::new(),
            };
            st.gpus.push(GpuState {
                info,
                profiles,
                links: Vec::new(),
            });
        }
        let lost: HashSet<u32> = faults.keys().copied().collect();
        // The board's topology, once.
        let indices: Vec<u32> = st.gpus.iter().map(|g| g.info.index).collect();
        for g in st.gpus.iter_mut().filter(|g| !lost.contains(&g.info.index)) {
            for &other in indices
                .iter()
                .filter(|&&o| o != g.info.index && !lost.contains(&o))
            {
                match self.backend.topology(g.info.index, other) {
                    Ok(l) => g.links.push((other, l)),
                    Err(e) => {
                        warn!(gpu = g.info.index, other, error = %e, "GPU topology unknown");
                        break;
                    }
                }
            }
        }
        for p in partitions {
            st.partitions.insert(p.id.clone(), p);
        }
        for l in leases {
            if let Some(rid) = &l.request_id {
                st.requests
                    .insert((l.tenant.clone(), rid.clone()), l.id.clone());
            }
            st.leases.insert(l.id.clone(), l);
        }
        st.tokens.extend(tokens);
        Ok((st, faults))
    }

    /// A GPU found fallen off the bus (or not answering) at start: out of service
    /// (stored) until a poll reads it again.
    fn mark_lost_at_start(
        &self,
        st: &mut State,
        gpu: u32,
        cause: HealthCause,
    ) -> Result<(), LeaseError> {
        let Some(g) = st.gpus.iter().find(|g| g.info.index == gpu) else {
            return Ok(());
        };
        warn!(
            gpu,
            cause = %cause,
            "GPU out of service: its records are kept as they are, untouched until it answers again"
        );
        if st.health.contains_key(&(gpu, None)) {
            return Ok(());
        }
        let mark = crate::model::HealthMark {
            gpu_uuid: g.info.uuid.clone(),
            gpu,
            gi_id: None,
            cause,
            since_ms: now_ms(),
        };
        let marked = Outcome {
            marked: vec![mark],
            ..Outcome::default()
        };
        Ok(self.commit_at_start(st, marked)?)
    }

    /// Records that point at hardware: a MIG instance that vanished (GPU reset,
    /// reboot) is created again at its placement for the lease that holds it; a
    /// dead MPS control daemon is restarted (or left to the supervisor's backoff).
    fn verify_records(
        &self,
        st: &mut State,
        instances: &mut Instances,
        lost: &HashSet<u32>,
        now: i64,
        report: &mut Reconciled,
    ) -> Result<(), LeaseError> {
        let mut mps_running: HashSet<String> = self.backend.mps_running()?;
        // In creation order: an MPS host instance before the shares on it.
        let mut ids: Vec<String> = st.partitions.keys().cloned().collect();
        ids.sort();
        for id in ids {
            let Some(p) = st.partitions.get(&id).cloned() else {
                continue;
            };
            if p.state != PartitionState::Ready || lost.contains(&p.gpu) {
                continue;
            }
            match &p.kind {
                PartKind::Mig(m) => {
                    let present = instances.get(&p.gpu).is_some_and(|v| {
                        v.iter()
                            .any(|i| Some(i.gi_id) == m.gi_id && Some(&i.uuid) == m.uuid.as_ref())
                    });
                    if !present {
                        self.recreate_vanished(st, &p, m, now, report)?;
                        if let Ok(all) = self.backend.instances(p.gpu) {
                            instances.insert(p.gpu, all);
                        }
                    }
                }
                PartKind::Mps(m) => {
                    // MPS inside MIG: its host instance may have been re-created
                    // above (new MIG uuid); the share's device follows it.
                    let mut p = p.clone();
                    if let Some(uuid) = m
                        .host
                        .as_ref()
                        .and_then(|h| st.partitions.get(h))
                        .and_then(|h| h.mig())
                        .and_then(|h| h.uuid.clone())
                        .filter(|u| *u != p.gpu_uuid)
                    {
                        p.gpu_uuid = uuid;
                        let followed = Outcome {
                            parts: vec![p.clone()],
                            ..Outcome::default()
                        };
                        self.commit_at_start(st, followed)?;
                    }
                    if let Some(lid) = &p.lease_id
                        && let Some(spec) = p.mps_spec(lid)
                        && !mps_running.contains(&spec.lease_id)
                    {
                        let started = mps_dirs(self.host.as_ref(), &spec)
                            .and_then(|()| self.backend.mps_start(&spec).map(|_| ()));
                        match started {
                            Ok(()) => {
                                report.mps_restarted += 1;
                                // A shared server serves its other leases too.
                                mps_running.insert(spec.lease_id.clone());
                            }
                            // The supervisor retries it with its backoff once the
                            // daemon runs; one GPU's MPS trouble does not stop the
                            // others being served.
                            Err(e) => warn!(
                                lease = %lid,
                                gpu = p.gpu,
                                error = %e,
                                "could not restart the MPS control daemon at start; will retry"
                            ),
                        }
                    }
                }
                PartKind::WholeGpu => {}
            }
        }
        Ok(())
    }

    /// Instances no record explains: never touched, but counted as occupied.
    fn set_aside_foreign(st: &mut State, instances: &Instances) {
        for (gpu, list) in instances {
            for inst in list {
                let explained = st.partitions.values().any(|p| {
                    p.gpu == *gpu
                        && p.mig().is_some_and(|m| {
                            m.gi_id == Some(inst.gi_id) || m.placement == inst.placement
                        })
                });
                if !explained {
                    warn!(gpu, gi = inst.gi_id, uuid = %inst.uuid,
                        "MIG instance not created by tesserad: leaving it alone and treating its placement as occupied");
                    st.foreign.push(inst.clone());
                }
            }
        }
    }

    /// One open intent: the hardware change it announced is adopted if it
    /// completed, undone if it did not; an interrupted teardown is finished.
    fn reconcile_intent(
        &self,
        st: &mut State,
        instances: &mut Instances,
        intent: &crate::model::Intent,
        now: i64,
        report: &mut Reconciled,
    ) -> Result<(), LeaseError> {
        let iid = intent.id;
        let Some(p) = st.partitions.get(&intent.partition_id).cloned() else {
            let orphan = Outcome {
                finished: vec![(iid, now, "orphan")],
                ..Outcome::default()
            };
            self.commit_at_start(st, orphan)?;
            return Ok(());
        };
        let lease = p.lease_id.as_ref().and_then(|l| st.leases.get(l).cloned());
        match intent.op {
            IntentOp::CreateMig | IntentOp::StartMps => {
                let adopted = if matches!(intent.op, IntentOp::CreateMig) {
                    self.reconcile_create_mig(st, instances, &p, lease, (iid, now))?
                } else {
                    self.reconcile_start_mps(st, &p, lease, (iid, now))?
                };
                match adopted {
                    Some(true) => report.adopted += 1,
                    Some(false) => report.rolled_back += 1,
                    None => {}
                }
            }
            IntentOp::MoveMig => {
                self.reconcile_move(st, instances, &p, iid, now)?;
                report.adopted += 1;
            }
            IntentOp::DestroyMig | IntentOp::StopMps => {
                if self.finish_teardown_hw(instances, &p, intent.op) {
                    let mut l2 = lease.clone();
                    if let Some(l) = &mut l2
                        && l.finish_end(now).is_err()
                    {
                        // An intent to tear down is written with the lease revoking;
                        // anything else is a record from an older daemon: end it.
                        l.lose(
                            "its partition was torn down while the daemon was stopped".into(),
                            now,
                        )?;
                    }
                    self.drop_at_start(st, &p.id, l2, iid, now, "done")?;
                }
            }
        }
        Ok(())
    }

    /// An open `create_mig` intent: the instance adopted when it was created
    /// completely (Some(true)), else a half-made one undone and the creation failed
    /// (Some(false)); None when the partition is not a MIG instance.
    fn reconcile_create_mig(
        &self,
        st: &mut State,
        instances: &mut Instances,
        p: &Partition,
        lease: Option<Lease>,
        (iid, now): (i64, i64),
    ) -> Result<Option<bool>, LeaseError> {
        let Some(m) = p.mig().cloned() else {
            return Ok(None);
        };
        let list = instances.entry(p.gpu).or_default();
        // An instance another record names is that record's, never adopted here (a
        // second record would claim one instance).
        let found = list
            .iter()
            .find(|i| i.placement == m.placement && i.gi_profile_id == m.gi_profile_id)
            .filter(|i| !claimed_by_another(st, &p.id, i))
            .cloned();
        if let Some(inst) = found.as_ref().filter(|i| i.ci_id.is_some()) {
            // Created completely: adopt it.
            let mut p2 = p.clone();
            if let PartKind::Mig(mm) = &mut p2.kind {
                mm.gi_id = Some(inst.gi_id);
                mm.ci_id = inst.ci_id;
                mm.uuid = Some(inst.uuid.clone());
            }
            self.adopt_at_start(st, p2, lease, iid, now)?;
            return Ok(Some(true));
        }
        if let Some(inst) = found {
            self.undo_half_created(list, &inst);
        }
        self.fail_creation(st, p, lease, iid, now)?;
        Ok(Some(false))
    }

    /// An open `start_mps` intent: the daemon adopted when it runs (true), else the
    /// creation failed (false), stopping an isolated daemon half started. A shared
    /// server that other leases hold stays (it is restarted for them).
    fn reconcile_start_mps(
        &self,
        st: &mut State,
        p: &Partition,
        lease: Option<Lease>,
        (iid, now): (i64, i64),
    ) -> Result<Option<bool>, LeaseError> {
        let lid = p.lease_id.clone().unwrap_or_default();
        let key = p.mps_daemon_key(&lid).unwrap_or_else(|| lid.clone());
        if self.backend.mps_running()?.contains(&key) {
            self.adopt_at_start(st, p.clone(), lease, iid, now)?;
            return Ok(Some(true));
        }
        let shared_in_use = p.mps().is_some_and(|m| m.mode == MpsMode::Shared)
            && super::end::shared_server_users(st, p, &key) > 0;
        if !shared_in_use {
            let _ = self.backend.mps_stop(&key);
        }
        self.fail_creation(st, p, lease, iid, now)?;
        Ok(Some(false))
    }

    /// A GI without its CI: our half-done create. Undo it. If the driver refuses,
    /// start anyway: the GI stays in `list`, so it is set aside as foreign and its
    /// slices count as occupied until an operator removes it.
    fn undo_half_created(&self, list: &mut Vec<MigInstance>, inst: &MigInstance) {
        match self.backend.destroy_instance(inst.gpu, inst.gi_id) {
            Ok(()) => list.retain(|i| i.gi_id != inst.gi_id),
            Err(e) => warn!(
                gpu = inst.gpu,
                gi = inst.gi_id,
                error = %e,
                "could not undo a MIG instance a crash left half created; \
                 it is left alone as foreign: remove it with \
                 `nvidia-smi mig -i {} -dgi -gi {}`",
                inst.gpu,
                inst.gi_id
            ),
        }
    }

    /// The hardware step of an interrupted teardown, done again (what is already
    /// gone counts as done). False while it still fails: the lease stays revoking
    /// and housekeeping tries again.
    fn finish_teardown_hw(&self, instances: &mut Instances, p: &Partition, op: IntentOp) -> bool {
        match (&p.kind, op) {
            (PartKind::Mig(m), IntentOp::DestroyMig) => {
                let list = instances.entry(p.gpu).or_default();
                // Whole, or half torn down: NVML destroys the CI, then the GI, and a
                // stop between the two leaves the GI at its placement without a CI
                // (and without the MIG device UUID the record holds).
                let present = list.iter().any(|i| {
                    Some(i.gi_id) == m.gi_id
                        && (Some(&i.uuid) == m.uuid.as_ref()
                            || (i.ci_id.is_none()
                                && i.placement == m.placement
                                && i.gi_profile_id == m.gi_profile_id))
                });
                if present {
                    let gi = m.gi_id.unwrap_or_default();
                    if let Err(e) = self.backend.destroy_instance(p.gpu, gi) {
                        warn!(partition = %p.id, error = %e, "teardown still fails; will retry");
                        return false;
                    }
                    list.retain(|i| i.gi_id != gi);
                }
                true
            }
            _ => match p.lease_id.as_deref().and_then(|l| p.mps_daemon_key(l)) {
                Some(key) => match self.backend.mps_stop(&key) {
                    Ok(()) => true,
                    Err(e) => {
                        warn!(partition = %p.id, error = %e, "stopping the MPS daemon still fails; will retry");
                        false
                    }
                },
                None => true,
            },
        }
    }

    pub(super) fn fail_creation(
        &self,
        st: &mut State,
        p: &Partition,
        lease: Option<Lease>,
        iid: i64,
        now: i64,
    ) -> Result<(), LeaseError> {
        let mut l2 = lease;
        if let Some(l) = &mut l2 {
            let reason = "the daemon stopped while creating the partition";
            if l.fail(reason.into(), now).is_err() {
                l.lose(reason.into(), now)?;
            }
        }
        self.drop_at_start(st, &p.id, l2, iid, now, "rolled back")
    }

    /// At start: the hardware change of an open intent completed before the crash:
    /// mark the partition ready and its pending lease active, durably, then in
    /// memory.
    pub(super) fn adopt_at_start(
        &self,
        st: &mut State,
        mut p: Partition,
        mut lease: Option<Lease>,
        iid: i64,
        now: i64,
    ) -> Result<(), LeaseError> {
        p.state = PartitionState::Ready;
        if let Some(l) = &mut lease
            && l.state().can_activate()
        {
            l.activate()?;
        }
        let adopted = Outcome {
            parts: vec![p],
            leases: lease.into_iter().collect(),
            finished: vec![(iid, now, "adopted")],
            ..Outcome::default()
        };
        Ok(self.commit_at_start(st, adopted)?)
    }

    /// At start: forget a partition, end its lease (as the caller set it) and
    /// finish the intent, durably, then in memory.
    pub(super) fn drop_at_start(
        &self,
        st: &mut State,
        partition_id: &str,
        lease: Option<Lease>,
        iid: i64,
        now: i64,
        outcome: &'static str,
    ) -> Result<(), LeaseError> {
        let dropped = Outcome {
            gone: vec![partition_id.to_string()],
            ended: lease.into_iter().collect(),
            finished: vec![(iid, now, outcome)],
            ..Outcome::default()
        };
        Ok(self.commit_at_start(st, dropped)?)
    }

    pub(super) fn recreate_vanished(
        &self,
        st: &mut State,
        p: &Partition,
        m: &MigPart,
        now: i64,
        report: &mut Reconciled,
    ) -> Result<(), LeaseError> {
        warn!(partition = %p.id, gpu = p.gpu, "MIG instance of a record is gone (GPU reset or reboot?): re-creating it");
        let iid = self.begin_intent_at_start(IntentOp::CreateMig, p, now)?;
        match self
            .backend
            .create_instance(p.gpu, m.gi_profile_id, m.placement, m.ci_profile_id)
        {
            Ok(inst) => {
                // A ready record (only those are re-created): ready again, with
                // the new instance's ids.
                let mut p2 = p.clone();
                super::executor::ready(&mut p2, Some(inst));
                let recreated = Outcome {
                    parts: vec![p2],
                    finished: vec![(iid, now, "recreated")],
                    ..Outcome::default()
                };
                self.commit_at_start(st, recreated)?;
                report.recreated += 1;
            }
            Err(e) => {
                warn!(partition = %p.id, error = %e, "could not re-create the MIG instance; revoking its lease");
                // A GI made without its CI goes; one that cannot is found by the
                // caller's fresh listing and set aside as foreign.
                super::executor::undo_half_or_left(self.backend.as_ref(), p.gpu, m);
                self.lose_vanished(st, p, &e, (iid, now))?;
            }
        }
        Ok(())
    }

    /// A vanished instance that cannot be made again: its lease is lost, whole (a
    /// multi-partition lease's other instances go too, all or nothing; one that
    /// cannot be destroyed stays as foreign), static pool instances go back to the
    /// pool and dynamic ones go.
    fn lose_vanished(
        &self,
        st: &mut State,
        p: &Partition,
        e: &crate::gpu::GpuError,
        (iid, now): (i64, i64),
    ) -> Result<(), LeaseError> {
        let mut l2 = p.lease_id.as_ref().and_then(|l| st.leases.get(l).cloned());
        if let Some(l) = &mut l2 {
            l.lose(
                format!("MIG instance vanished and could not be re-created: {e}"),
                now,
            )?;
        }
        let others: Vec<String> = l2
            .iter()
            .flat_map(|l| l.partition_ids())
            .filter(|id| **id != p.id)
            .cloned()
            .collect();
        for o in others.iter().filter_map(|id| st.partitions.get(id)) {
            if let (Some(m), crate::model::Origin::Dynamic) = (o.mig(), o.origin)
                && let Some(gi) = m.gi_id
                && let Err(e) = self.backend.destroy_instance(o.gpu, gi)
            {
                warn!(partition = %o.id, error = %e,
                    "could not destroy an instance of a lost multi-partition lease; left alone as foreign");
            }
        }
        let freed: Vec<Partition> = others
            .iter()
            .filter_map(|id| st.partitions.get(id))
            .filter(|o| o.origin == crate::model::Origin::Static)
            .map(|o| {
                let mut f = o.clone();
                f.lease_id = None;
                f
            })
            .collect();
        let lost = Outcome {
            gone: std::iter::once(p.id.clone()).chain(others).collect(),
            // Deleted, then written back: the static ones return to the pool.
            parts: freed,
            ended: l2.into_iter().collect(),
            finished: vec![(iid, now, "failed")],
            ..Outcome::default()
        };
        Ok(self.commit_at_start(st, lost)?)
    }
}

/// Whether a partition record other than `except` names instance `inst` (its GPU,
/// GI id and MIG UUID).
pub(super) fn claimed_by_another(st: &State, except: &str, inst: &MigInstance) -> bool {
    st.partitions.on_gpu(inst.gpu).0.any(|p| {
        p.id != except
            && p.mig().is_some_and(|m| {
                m.gi_id == Some(inst.gi_id) && m.uuid.as_deref() == Some(inst.uuid.as_str())
            })
    })
}
