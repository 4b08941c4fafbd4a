//! The operator's static MIG layout, created at start where it is missing.

use tessera_common::clock::now_ms;
use tracing::info;

use crate::config::StaticLayout;
use crate::gpu::{GiProfile, Placement};
use crate::model::{IntentOp, MigPart, Origin, PartKind, Partition, PartitionState};
use crate::names::new_id;
use crate::partition::{self, PlanDecision, Shape};

use super::error::Inconsistency;
use super::error::LeaseError;
use super::manager::LeaseManager;
use super::plan::{Marks, Outcome};
use super::table::{GpuState, State};

/// The next instance a static layout still lacks.
struct Missing {
    /// How many of the profile the layout has already.
    have: u32,
    gpu: GpuState,
    profile: GiProfile,
    placement: Placement,
    ci_profile_id: Option<u32>,
}

impl LeaseManager {
    /// Create the operator's static MIG layout where it is missing.
    pub(super) fn ensure_static_layout(&self) -> Result<(), LeaseError> {
        for layout in &self.config.partition.static_layouts {
            for (profile, want) in &layout.devices {
                loop {
                    let missing = self.next_missing(&self.read(), layout, profile, *want)?;
                    let Some(missing) = missing else { break };
                    self.create_static(missing)?;
                }
            }
        }
        Ok(())
    }

    /// Plan the next instance of `profile` the layout lacks on its GPU (`None` when
    /// it has `want`). The layout never counts an existing free instance (static
    /// or kept) as one of its own.
    fn next_missing(
        &self,
        st: &State,
        layout: &StaticLayout,
        profile: &str,
        want: u32,
    ) -> Result<Option<Missing>, LeaseError> {
        let gpu = layout_gpu(st, layout)?;
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
        if have >= want {
            return Ok(None);
        }
        let mut views = Self::views(st);
        for v in &mut views {
            for m in &mut v.mig {
                m.free_static = None;
            }
        }
        let mut opts = self.plan_options(Some(layout.gpu));
        opts.dynamic_mig = true;
        let shape = Shape::Mig {
            profile: profile.to_string(),
            compute_profile: None,
        };
        let decision = partition::plan(&shape, &views, &opts).map_err(|e| {
            LeaseError::FailedPrecondition(format!(
                "static layout for GPU {}: cannot place {profile}: {e}",
                layout.gpu
            ))
        })?;
        let PlanDecision::NewMig {
            gi_profile_id,
            placement,
            ci_profile_id,
            ..
        } = decision
        else {
            return Err(LeaseError::Inconsistent(Inconsistency::ShapeMismatch {
                decision: "an existing partition",
                shape: "static layout",
            }));
        };
        let prof = gpu
            .profiles
            .iter()
            .find(|p| p.id == gi_profile_id)
            .cloned()
            .ok_or(LeaseError::Inconsistent(Inconsistency::UnknownProfile {
                gpu: layout.gpu,
                profile_id: gi_profile_id,
            }))?;
        Ok(Some(Missing {
            have,
            gpu,
            profile: prof,
            placement,
            ci_profile_id,
        }))
    }

    /// Create one static instance write-ahead: the intent, the instance, the outcome.
    fn create_static(&self, m: Missing) -> Result<(), LeaseError> {
        let now = now_ms();
        let (g, prof) = (m.gpu.info.index, &m.profile);
        let mut p = Partition {
            id: new_id("p-"),
            gpu: g,
            gpu_uuid: m.gpu.info.uuid.clone(),
            origin: Origin::Static,
            state: PartitionState::Creating,
            lease_id: None,
            kind: PartKind::Mig(MigPart {
                gi_profile_id: prof.id,
                profile: prof.name.clone(),
                placement: m.placement,
                ci_profile_id: m.ci_profile_id,
                compute_profile: None,
                gi_id: None,
                ci_id: None,
                uuid: None,
                memory_bytes: prof.memory_bytes,
                sm_count: prof.sm_count,
                slices: prof.slices,
                mps_host: None,
            }),
        };
        let iid = self.write_partition_intent_blocking(&p, IntentOp::CreateMig, now)?;
        match self
            .backend
            .create_instance(g, prof.id, m.placement, m.ci_profile_id)
        {
            Ok(inst) => {
                super::executor::ready(&mut p, Some(inst));
                let made = Outcome {
                    parts: vec![p],
                    finished: vec![(iid, now, "done")],
                    ..Outcome::default()
                };
                self.commit_blocking(made)?;
                info!(gpu = g, profile = %prof.name, start = m.placement.start, n = m.have + 1, "static partition created");
                Ok(())
            }
            Err(e) => {
                // A GI made without its CI goes (else it is set aside as foreign).
                let foreign = p.mig().and_then(|mig| {
                    super::executor::undo_half_or_left(self.backend.as_ref(), g, mig)
                });
                let failed = Outcome {
                    gone: vec![p.id.clone()],
                    finished: vec![(iid, now, "failed")],
                    marks: Marks {
                        foreign: foreign.into_iter().collect(),
                        ..Marks::default()
                    },
                    ..Outcome::default()
                };
                self.commit_blocking(failed)?;
                Err(e.into())
            }
        }
    }
}

/// The GPU a static layout names, which must be in MIG mode.
fn layout_gpu(st: &State, layout: &StaticLayout) -> Result<GpuState, LeaseError> {
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
    Ok(gpu)
}
