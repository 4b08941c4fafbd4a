//! An exact placement: the lease goes where the caller names (a whole GPU, a MIG
//! profile at one placement start, an MPS share on one GPU) or is refused. The
//! planner never chooses another GPU or placement, no idle lease is moved and no
//! burst lease preempted to make room: the DRA driver's scheduler chose the device,
//! and a lease anywhere else would not be the device the pod was given. Quota and
//! tenancy apply as for any lease; the lease is pinned (never moved later).

use crate::partition::{self, GpuView, PlanDecision, PlanError, PlanOptions, Shape};

use super::error::{LeaseError, invalid};
use super::plan::{CreateRequest, ExactPlacement};

/// Checks `req.exact` against the rest of the request and pins `req.gpu_index` to
/// its GPU (what the mode and health checks and the decision read).
pub(super) fn pin(req: &mut CreateRequest) -> Result<(), LeaseError> {
    let Some(at) = req.exact else {
        return Ok(());
    };
    if req.need.is_some() {
        return Err(invalid(
            "placement",
            "an exact placement is asked for by shape, not by need",
        ));
    }
    if req.count > 1 {
        return Err(invalid(
            "placement",
            "an exact placement is one partition (count 1)",
        ));
    }
    if let Some(g) = req.gpu_index
        && g != at.gpu
    {
        return Err(invalid(
            "gpu_index",
            format!("gpu{g} differs from the exact placement's gpu{}", at.gpu),
        ));
    }
    match (&req.shape, at.mig_start) {
        (Some(Shape::Mig { .. }), None) => {
            return Err(invalid(
                "placement",
                "an exact MIG placement names its start slice",
            ));
        }
        (Some(Shape::Mig { .. }), Some(_)) | (Some(Shape::Mps { .. } | Shape::WholeGpu), None) => {}
        (Some(Shape::MigMps { .. }), _) => {
            return Err(invalid(
                "placement",
                "an MPS share inside MIG cannot be placed exactly",
            ));
        }
        (Some(_), Some(_)) => {
            return Err(invalid(
                "placement",
                "a placement start is for a MIG instance only",
            ));
        }
        (None, _) => return Err(invalid("shape", "an exact placement needs a shape")),
    }
    req.gpu_index = Some(at.gpu);
    Ok(())
}

/// The decision for `shape` at exactly `at` over `views` (the placeable ones), or
/// why it cannot be there now. Never another GPU or placement.
pub(super) fn decide(
    shape: &Shape,
    at: ExactPlacement,
    views: &[GpuView],
    opts: &PlanOptions,
) -> Result<PlanDecision, LeaseError> {
    let gpu = at.gpu;
    let Some(view) = views.iter().find(|v| v.info.index == gpu) else {
        return Err(LeaseError::GpuUnhealthy(format!(
            "gpu{gpu} is not on this node or is out of service"
        )));
    };
    match (shape, at.mig_start) {
        (
            Shape::Mig {
                profile,
                compute_profile,
            },
            Some(start),
        ) => mig_at(view, profile, compute_profile.as_deref(), start, opts),
        _ => {
            let opts = PlanOptions {
                gpu_index: Some(gpu),
                ..opts.clone()
            };
            partition::plan(shape, std::slice::from_ref(view), &opts).map_err(|e| match e {
                PlanError::NoCapacity(m) => LeaseError::ResourceExhausted(format!(
                    "the exact placement on gpu{gpu} is taken: {m}"
                )),
                other => other.into(),
            })
        }
    }
}

/// The placement of `prof` that starts at `start`, or why there is none.
fn placement_at(
    prof: &crate::gpu::GiProfile,
    gpu: u32,
    start: u32,
) -> Result<crate::gpu::Placement, LeaseError> {
    prof.placements
        .iter()
        .copied()
        .find(|p| p.start == start)
        .ok_or_else(|| {
            let starts: Vec<String> = prof
                .placements
                .iter()
                .map(|p| p.start.to_string())
                .collect();
            invalid(
                "placement",
                format!(
                    "{start} is not a placement start of {} on gpu{gpu} (its starts: {})",
                    prof.name,
                    starts.join(", ")
                ),
            )
        })
}

/// A MIG instance of `profile` at placement `start` on `view`'s GPU: the free
/// static-pool instance there, or a new one when the slices are free.
fn mig_at(
    view: &GpuView,
    profile: &str,
    compute_profile: Option<&str>,
    start: u32,
    opts: &PlanOptions,
) -> Result<PlanDecision, LeaseError> {
    let gpu = view.info.index;
    if !view.info.mig_current {
        return Err(LeaseError::ModeUnavailable(format!(
            "gpu{gpu} is not in MIG mode"
        )));
    }
    let Some(prof) = view.gi_profile(profile) else {
        return Err(invalid(
            "shape",
            format!("gpu{gpu} offers no MIG profile {profile}"),
        ));
    };
    let placement = placement_at(prof, gpu, start)?;
    let ci_profile_id = compute_profile
        .map(|c| {
            prof.ci_profile(c).map(|ci| ci.id).ok_or_else(|| {
                invalid("shape", format!("{} has no compute profile {c}", prof.name))
            })
        })
        .transpose()?;
    let what = format!(
        "{} at placement {start} on gpu{gpu} (memory slices {}..{})",
        prof.name,
        placement.start,
        placement.end()
    );
    if view.whole_leased {
        return Err(LeaseError::ResourceExhausted(format!(
            "{what} is taken: the GPU is held by a whole-GPU lease"
        )));
    }
    if compute_profile.is_none()
        && let Some(id) = view.mig.iter().find_map(|m| {
            (m.placement == placement && m.gi_profile_id == prof.id)
                .then_some(m.free_static.as_ref())
                .flatten()
        })
    {
        return Ok(PlanDecision::Static {
            gpu,
            partition_id: id.clone(),
        });
    }
    if let Some(m) = view.mig.iter().find(|m| m.placement.overlaps(&placement)) {
        return Err(LeaseError::ResourceExhausted(format!(
            "{what} is taken: an instance holds memory slices {}..{}",
            m.placement.start,
            m.placement.end()
        )));
    }
    let n = view
        .mig
        .iter()
        .filter(|m| m.gi_profile_id == prof.id)
        .count();
    if u32::try_from(n).unwrap_or(u32::MAX) >= prof.max_count {
        return Err(LeaseError::ResourceExhausted(format!(
            "{what}: gpu{gpu} already has {n} {} instances (at most {})",
            prof.name, prof.max_count
        )));
    }
    if !opts.dynamic_mig {
        return Err(LeaseError::ResourceExhausted(format!(
            "{what}: no free static-pool instance there, and dynamic MIG is disabled on this node"
        )));
    }
    Ok(PlanDecision::NewMig {
        gpu,
        gi_profile_id: prof.id,
        placement,
        ci_profile_id,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::config::Config;
    use crate::lease::LeaseManager;
    use crate::model::PartKind;
    use crate::store::Store;

    /// GPU 0: an H100 with MIG on; GPU 1: an A100 with MIG off.
    fn manager(dir: &Path) -> Arc<LeaseManager> {
        manager_with(dir, |_| {})
    }

    /// [`manager`], `before` run on the simulated hardware before the lease core starts.
    fn manager_with(dir: &Path, before: impl FnOnce(&crate::gpu::SimBackend)) -> Arc<LeaseManager> {
        let text = format!(
            "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
             [sim]\nstate_file = {s:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n\
             [[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n",
            d = dir.display().to_string(),
            s = dir.join("sim.json").display().to_string(),
        );
        let config = Config::parse(Path::new("test.toml"), &text).unwrap();
        let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
        before(&sim);
        let store = Arc::new(Store::open(dir).unwrap());
        LeaseManager::start(config, sim, store).unwrap()
    }

    fn mig_at(profile: &str, gpu: u32, start: u32) -> CreateRequest {
        CreateRequest {
            tenant: "team-a".into(),
            shape: Some(Shape::Mig {
                profile: profile.into(),
                compute_profile: None,
            }),
            exact: Some(ExactPlacement {
                gpu,
                mig_start: Some(start),
            }),
            ..Default::default()
        }
    }

    fn start_of(c: &crate::lease::Created) -> (u32, u32) {
        let p = c.partition.as_ref().unwrap();
        match &p.kind {
            PartKind::Mig(m) => (p.gpu, m.placement.start),
            other => panic!("not MIG: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_free_mig_placement_is_taken_exactly_where_named() {
        let dir = tempfile::tempdir().unwrap();
        let mgr = manager(dir.path());
        // The planner alone would put a first 1g.10gb at another start; 5 is honoured.
        let c = mgr.create(mig_at("1g.10gb", 0, 5)).await.unwrap();
        assert_eq!(start_of(&c), (0, 5));
        assert!(c.lease.pinned_gpu, "an exact lease is never moved");
        let c = mgr.create(mig_at("2g.20gb", 0, 2)).await.unwrap();
        assert_eq!(start_of(&c), (0, 2));
    }

    #[tokio::test]
    async fn a_taken_placement_is_refused_and_nothing_else_is_chosen() {
        let dir = tempfile::tempdir().unwrap();
        let mgr = manager(dir.path());
        mgr.create(mig_at("2g.20gb", 0, 4)).await.unwrap();
        let before = mgr.list(None, None, false).unwrap().len();
        // 1g.10gb at 5 overlaps the 2g.20gb at 4..6, though 0..3 are free.
        let err = mgr.create(mig_at("1g.10gb", 0, 5)).await.unwrap_err();
        assert!(matches!(err, LeaseError::ResourceExhausted(_)), "{err:?}");
        assert!(err.to_string().contains("is taken"), "{err}");
        assert_eq!(mgr.list(None, None, false).unwrap().len(), before);
        // The whole GPU 1 once, then taken.
        let whole = CreateRequest {
            tenant: "team-a".into(),
            shape: Some(Shape::WholeGpu),
            exact: Some(ExactPlacement {
                gpu: 1,
                mig_start: None,
            }),
            ..Default::default()
        };
        let c = mgr.create(whole.clone()).await.unwrap();
        assert_eq!(c.lease.gpu, 1);
        let err = mgr.create(whole).await.unwrap_err();
        assert!(
            err.to_string().contains("exact placement on gpu1 is taken"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_illegal_start_or_a_mismatched_request_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mgr = manager(dir.path());
        // 3g.40gb starts at 0 or 4 on an H100, never 1.
        let err = mgr.create(mig_at("3g.40gb", 0, 1)).await.unwrap_err();
        assert!(
            matches!(
                err,
                LeaseError::InvalidArgument {
                    field: "placement",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("not a placement start"), "{err}");
        // A MIG profile on the GPU without MIG.
        let err = mgr.create(mig_at("1g.10gb", 1, 0)).await.unwrap_err();
        assert!(matches!(err, LeaseError::ModeUnavailable(_)), "{err:?}");
        // A MIG shape without a start, a start on an MPS share, another gpu_index.
        let mut no_start = mig_at("1g.10gb", 0, 0);
        no_start.exact = Some(ExactPlacement {
            gpu: 0,
            mig_start: None,
        });
        assert!(mgr.create(no_start).await.is_err());
        let mut other_gpu = mig_at("1g.10gb", 0, 0);
        other_gpu.gpu_index = Some(1);
        assert!(mgr.create(other_gpu).await.is_err());
        assert!(mgr.list(None, None, false).unwrap().is_empty());
    }

    #[tokio::test]
    async fn an_mps_share_goes_on_the_named_gpu_only() {
        let dir = tempfile::tempdir().unwrap();
        let mgr = manager(dir.path());
        let share = |sm| CreateRequest {
            tenant: "team-a".into(),
            shape: Some(Shape::Mps {
                sm_percent: sm,
                memory_bytes: 1 << 30,
                mode: crate::gpu::MpsMode::Isolated,
            }),
            exact: Some(ExactPlacement {
                gpu: 1,
                mig_start: None,
            }),
            ..Default::default()
        };
        let c = mgr.create(share(60)).await.unwrap();
        assert_eq!(c.lease.gpu, 1);
        let err = mgr.create(share(60)).await.unwrap_err();
        assert!(matches!(err, LeaseError::ResourceExhausted(_)), "{err:?}");
    }

    #[tokio::test]
    async fn an_instance_tessera_does_not_know_is_taken_and_left_alone() {
        use crate::gpu::GpuBackend;
        let dir = tempfile::tempdir().unwrap();
        let mut made = None;
        let mgr = manager_with(dir.path(), |sim| {
            let at = crate::gpu::Placement { start: 3, size: 1 };
            made = Some(
                sim.create_instance(0, tessera_common::mig::GI_PROFILE_1_SLICE, at, None)
                    .unwrap(),
            );
        });
        let err = mgr.create(mig_at("1g.10gb", 0, 3)).await.unwrap_err();
        assert!(err.to_string().contains("is taken"), "{err}");
        let still = mgr.backend().instances(0).unwrap();
        assert_eq!(
            still,
            vec![made.unwrap()],
            "the foreign instance is untouched"
        );
        // The slice next to it is free.
        assert_eq!(
            start_of(&mgr.create(mig_at("1g.10gb", 0, 4)).await.unwrap()),
            (0, 4)
        );
    }
}
