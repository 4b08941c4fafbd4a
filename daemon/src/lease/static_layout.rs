//! The operator's static MIG layout, created at start where it is missing.

use tessera_common::clock::now_ms;
use tracing::info;

use crate::model::{IntentOp, MigPart, Origin, PartKind, Partition, PartitionState};
use crate::names::new_id;
use crate::partition::{self, PlanDecision, Shape};

#[allow(unused_imports)]
use super::*;

impl LeaseManager {
    /// Create the operator's static MIG layout where it is missing.
    pub(super) fn ensure_static_layout(&self) -> Result<(), LeaseError> {
        for layout in &self.config.partition.static_layouts {
            for (profile, want) in &layout.devices {
                loop {
                    let (have, decision, gpu) = {
                        let st = self.lock();
                        let gpu = st
                            .gpus
                            .iter()
                            .find(|g| g.info.index == layout.gpu)
                            .cloned()
                            .ok_or_else(|| {
                                LeaseError::FailedPrecondition(format!(
                                    "static layout names GPU {} which this host does not have",
                                    layout.gpu
                                ))
                            })?;
                        if !gpu.info.mig_current {
                            return Err(LeaseError::FailedPrecondition(format!(
                                "static layout for GPU {} needs MIG mode, which is off (tesserad never toggles it)",
                                layout.gpu
                            )));
                        }
                        let have = st
                            .partitions
                            .values()
                            .filter(|p| {
                                p.gpu == layout.gpu
                                    && p.origin == Origin::Static
                                    && p.mig()
                                        .is_some_and(|m| m.profile.eq_ignore_ascii_case(profile))
                            })
                            .count() as u32;
                        if have >= *want {
                            break;
                        }
                        // Plan a new instance: the layout never counts an existing
                        // free instance (static or kept) as one of its own.
                        let mut views = Self::views(&st);
                        for v in &mut views {
                            for m in &mut v.mig {
                                m.free_static = None;
                            }
                        }
                        let mut opts = self.plan_options(Some(layout.gpu));
                        opts.dynamic_mig = true;
                        let shape = Shape::Mig {
                            profile: profile.clone(),
                            compute_profile: None,
                        };
                        let decision = partition::plan(&shape, &views, &opts).map_err(|e| {
                            LeaseError::FailedPrecondition(format!(
                                "static layout for GPU {}: cannot place {profile}: {e}",
                                layout.gpu
                            ))
                        })?;
                        (have, decision, gpu)
                    };
                    let PlanDecision::NewMig {
                        gpu: g,
                        gi_profile_id,
                        placement,
                        ci_profile_id,
                    } = decision
                    else {
                        return Err(LeaseError::Internal(format!(
                            "static layout for GPU {}: planner did not create a new instance",
                            layout.gpu
                        )));
                    };
                    let prof = gpu
                        .profiles
                        .iter()
                        .find(|p| p.id == gi_profile_id)
                        .cloned()
                        .ok_or_else(|| LeaseError::Internal("unknown profile".into()))?;
                    let now = now_ms();
                    let mut p = Partition {
                        id: new_id("p-"),
                        gpu: g,
                        gpu_uuid: gpu.info.uuid.clone(),
                        origin: Origin::Static,
                        state: PartitionState::Creating,
                        lease_id: None,
                        kind: PartKind::Mig(MigPart {
                            gi_profile_id,
                            profile: prof.name.clone(),
                            placement,
                            ci_profile_id,
                            compute_profile: None,
                            gi_id: None,
                            ci_id: None,
                            uuid: None,
                            memory_bytes: prof.memory_bytes,
                            sm_count: prof.sm_count,
                            slices: prof.slices,
                        }),
                    };
                    self.lock().partitions.insert(p.id.clone(), p.clone());
                    let pp = p.clone();
                    let iid = self.store.write_blocking(move |w| {
                        w.put_partition(&pp)?;
                        w.begin_intent(IntentOp::CreateMig, &pp.id, None, now)
                    })?;
                    let inst =
                        self.backend
                            .create_instance(g, gi_profile_id, placement, ci_profile_id);
                    match inst {
                        Ok(inst) => {
                            if let PartKind::Mig(m) = &mut p.kind {
                                m.gi_id = Some(inst.gi_id);
                                m.ci_id = inst.ci_id;
                                m.uuid = Some(inst.uuid);
                            }
                            p.state = PartitionState::Ready;
                            let pp = p.clone();
                            self.store.write_blocking(move |w| {
                                w.put_partition(&pp)?;
                                w.finish_intent(iid, now, "done")
                            })?;
                            info!(gpu = g, profile = %prof.name, start = placement.start, n = have + 1, "static partition created");
                            self.lock().partitions.insert(p.id.clone(), p);
                        }
                        Err(e) => {
                            let pid = p.id.clone();
                            self.store.write_blocking(move |w| {
                                w.delete_partition(&pid)?;
                                w.finish_intent(iid, now, "failed")
                            })?;
                            self.lock().partitions.remove(&p.id);
                            return Err(e.into());
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
