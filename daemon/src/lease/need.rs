//! Ask by need: a request by device memory and isolation gets the smallest partition
//! that fits and can be placed now.
//!
//! * `hardware`: the MIG profile with the least memory at or above the need (then the
//!   fewest compute slices), among those a GPU can place now; failing that, a whole
//!   GPU without MIG with enough memory (the smallest such).
//! * `shared`: an MPS share with the needed memory as its limit and an SM percentage
//!   in proportion (memory / the GPU's memory, rounded up), on the first GPU without
//!   MIG that admits it.
//!
//! The choice is made against the node as it is at this moment; the lease then
//! carries the concrete shape (what quotas, usage and the runtime see).

use crate::partition::{self, Shape};

use super::error::LeaseError;
use super::manager::LeaseManager;
use super::plan::{Isolation, Need};
use super::table::State;

impl LeaseManager {
    /// The smallest concrete shape for `need` that can be placed now (on
    /// `gpu_index` when given).
    pub(super) fn resolve_need(
        &self,
        need: &Need,
        gpu_index: Option<u32>,
    ) -> Result<Shape, LeaseError> {
        need.validate()?;
        let st = self.read();
        let candidates = match need.isolation {
            Isolation::Hardware => Self::hardware_candidates(&st, need),
            Isolation::Shared => Self::shared_candidates(&st, need),
        };
        let views = Self::placeable_views(&st);
        let opts = self.plan_options(gpu_index);
        let mut fits = false;
        for shape in &candidates {
            fits = true;
            if partition::plan(shape, &views, &opts).is_ok() {
                return Ok(shape.clone());
            }
        }
        Err(LeaseError::ResourceExhausted(if fits {
            format!(
                "no partition for {} is free now (the smallest that would fit: {})",
                need.describe(),
                candidates.first().map(shape_name).unwrap_or_default()
            )
        } else {
            format!("no GPU on this node offers {}", need.describe())
        }))
    }

    /// MIG profiles with enough memory, smallest first, then whole GPUs.
    fn hardware_candidates(st: &State, need: &Need) -> Vec<Shape> {
        let mut mig: Vec<(u64, u32, String)> = st
            .gpus
            .iter()
            .filter(|g| g.info.mig_current)
            .flat_map(|g| g.profiles.iter())
            .filter(|p| p.memory_bytes >= need.memory_bytes && !p.media_extensions)
            .map(|p| (p.memory_bytes, p.slices, p.name.clone()))
            .collect();
        mig.sort();
        mig.dedup_by(|a, b| a.2 == b.2);
        let whole = st
            .gpus
            .iter()
            .any(|g| !g.info.mig_current && g.info.memory_bytes >= need.memory_bytes);
        mig.into_iter()
            .map(|(_, _, profile)| Shape::Mig {
                profile,
                compute_profile: None,
            })
            .chain(whole.then_some(Shape::WholeGpu))
            .collect()
    }

    /// One MPS share per GPU without MIG that has the memory, its SM percentage in
    /// proportion to the memory asked (GPUs of different sizes give different ones).
    fn shared_candidates(st: &State, need: &Need) -> Vec<Shape> {
        let mut out: Vec<Shape> = st
            .gpus
            .iter()
            .filter(|g| !g.info.mig_current && g.info.memory_bytes >= need.memory_bytes)
            .map(|g| {
                let pct = (u128::from(need.memory_bytes) * 100)
                    .div_ceil(u128::from(g.info.memory_bytes.max(1)));
                Shape::Mps {
                    sm_percent: u32::try_from(pct.clamp(1, 100)).unwrap_or(100),
                    memory_bytes: need.memory_bytes,
                    mode: need.mps_mode,
                }
            })
            .collect();
        out.dedup();
        out
    }
}

fn shape_name(s: &Shape) -> String {
    match s {
        Shape::Mig { profile, .. } => profile.clone(),
        Shape::Mps {
            sm_percent,
            memory_bytes,
            ..
        } => format!(
            "an MPS share of {sm_percent}% SMs and {}",
            tessera_common::size::human(*memory_bytes)
        ),
        Shape::WholeGpu => "a whole GPU".into(),
        Shape::MigMps {
            profile,
            sm_percent,
            memory_bytes,
        } => format!(
            "an MPS share of {sm_percent}% SMs and {} on a {profile} instance",
            tessera_common::size::human(*memory_bytes)
        ),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::config::Config;
    use crate::lease::CreateRequest;
    use crate::store::Store;

    const GIB: u64 = 1 << 30;

    fn start(dir: &Path) -> Arc<LeaseManager> {
        let text = format!(
            "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
             [sim]\nstate_file = {s:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\n\
             [[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n",
            d = dir.display().to_string(),
            s = dir.join("sim.json").display().to_string(),
        );
        let cfg = Config::parse(Path::new("test.toml"), &text).unwrap();
        let sim = Arc::new(crate::gpu::open_sim(&cfg.sim).unwrap());
        let store = Arc::new(Store::open(dir).unwrap());
        LeaseManager::start(cfg, sim, store).unwrap()
    }

    fn by_need(memory_bytes: u64, isolation: Isolation) -> CreateRequest {
        CreateRequest {
            tenant: "team-a".into(),
            need: Some(Need {
                memory_bytes,
                isolation,
                mps_mode: crate::gpu::MpsMode::Isolated,
            }),
            ..Default::default()
        }
    }

    fn profile(s: &Shape) -> &str {
        match s {
            Shape::Mig { profile, .. } => profile,
            _ => panic!("not MIG: {s:?}"),
        }
    }

    #[tokio::test]
    async fn hardware_needs_get_the_smallest_mig_profile_that_fits_then_the_next_one() {
        let dir = tempfile::tempdir().unwrap();
        let mgr = start(dir.path());
        // 15 GiB: 1g.20gb, not 2g.20gb (same memory, more slices), not 1g.10gb.
        let l = mgr
            .create(by_need(15 * GIB, Isolation::Hardware))
            .await
            .unwrap();
        assert_eq!(profile(&l.lease.shape), "1g.20gb");
        // 30 GiB: 3g.40gb before 4g.40gb.
        let l = mgr
            .create(by_need(30 * GIB, Isolation::Hardware))
            .await
            .unwrap();
        assert_eq!(profile(&l.lease.shape), "3g.40gb");
        // 5 GiB: 1g.10gb.
        let l = mgr
            .create(by_need(5 * GIB, Isolation::Hardware))
            .await
            .unwrap();
        assert_eq!(profile(&l.lease.shape), "1g.10gb");
        // 60 GiB: only 7g.80gb would do, and the H100 is no longer free enough.
        let e = mgr
            .create(by_need(60 * GIB, Isolation::Hardware))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, LeaseError::ResourceExhausted(m) if m.contains("7g.80gb")),
            "{e}"
        );
        // 200 GiB: nothing on this node could ever do.
        let e = mgr
            .create(by_need(200 * GIB, Isolation::Hardware))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no GPU on this node offers"), "{e}");
    }

    #[tokio::test]
    async fn shared_needs_get_an_mps_share_with_sms_in_proportion() {
        let dir = tempfile::tempdir().unwrap();
        let mgr = start(dir.path());
        let l = mgr
            .create(by_need(10 * GIB, Isolation::Shared))
            .await
            .unwrap();
        let Shape::Mps {
            sm_percent,
            memory_bytes,
            ..
        } = l.lease.shape
        else {
            panic!("{:?}", l.lease.shape)
        };
        assert_eq!(memory_bytes, 10 * GIB);
        assert!((25..=26).contains(&sm_percent), "{sm_percent}");
        assert_eq!(l.lease.gpu, 1);
    }

    #[tokio::test]
    async fn a_need_with_a_shape_or_no_memory_is_refused_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let mgr = start(dir.path());
        let e = mgr
            .create(by_need(0, Isolation::Hardware))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("need.memory_bytes"), "{e}");
        let mut both = by_need(GIB, Isolation::Hardware);
        both.shape = Some(Shape::WholeGpu);
        let e = mgr.create(both).await.unwrap_err();
        assert!(e.to_string().contains("not both"), "{e}");
    }
}
