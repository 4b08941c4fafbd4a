//! MPS inside MIG: MPS shares on a MIG instance (a lease shape of profile + SM% +
//! memory), one MPS server per instance.
//!
//! A share joins an instance that already hosts shares of the same tenant (its
//! shares' SM percentages add up to at most 100, their memory to at most the
//! instance's); otherwise a new host instance is placed as a MIG lease of the profile
//! would be (a free static-pool instance first, else a new one by the strategy). An
//! instance hosts one tenant: its server's limits are client-side and a fault in one
//! client reaches all of them.

use super::planner::{PlanDecision, PlanError, PlanOptions, Strategy, check_mps_share, plan};
use super::view::{GpuView, MpsShare, Shape};

/// A MIG instance that hosts MPS shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigMpsHost {
    /// Its partition id.
    pub partition_id: String,
    pub gpu: u32,
    /// GI profile name, e.g. "3g.40gb".
    pub profile: String,
    /// The instance's memory.
    pub memory_bytes: u64,
    /// The tenant whose shares it hosts.
    pub tenant: String,
    /// Ready to take shares (not being created or torn down).
    pub ready: bool,
    pub shares: Vec<MpsShare>,
}

/// Where an MPS-inside-MIG share goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigMpsDecision {
    /// Onto this host instance (partition id).
    Join { gpu: u32, host: String },
    /// A new host instance first: a new MIG instance or a free static one.
    NewHost(PlanDecision),
}

/// Decide where a share of `sm_percent` % of an instance's SMs and `memory_bytes` of
/// its memory on an instance of `profile` goes, for `tenant`.
pub fn plan_mig_mps(
    profile: &str,
    sm_percent: u32,
    memory_bytes: u64,
    tenant: &str,
    hosts: &[MigMpsHost],
    gpus: &[GpuView],
    opts: &PlanOptions,
) -> Result<MigMpsDecision, PlanError> {
    check_mps_share(sm_percent, memory_bytes)?;
    // The profile must exist and hold the share at all.
    let known = gpus
        .iter()
        .filter(|g| g.info.mig_current)
        .find_map(|g| g.gi_profile(profile));
    if let Some(p) = known
        && memory_bytes > p.memory_bytes
    {
        return Err(PlanError::InvalidShape(format!(
            "an MPS share of {memory_bytes} bytes does not fit a {} instance ({} bytes)",
            p.name, p.memory_bytes
        )));
    }
    if let Some(join) = join_host(profile, sm_percent, memory_bytes, tenant, hosts, gpus, opts) {
        return Ok(join);
    }
    let shape = Shape::Mig {
        profile: profile.to_string(),
        compute_profile: None,
    };
    match plan(&shape, gpus, opts) {
        Ok(d @ (PlanDecision::NewMig { .. } | PlanDecision::Static { .. })) => {
            Ok(MigMpsDecision::NewHost(d))
        }
        Ok(other) => Err(PlanError::InvalidShape(format!(
            "a MIG profile was planned as {other:?}"
        ))),
        Err(PlanError::NoCapacity(msg)) => Err(PlanError::NoCapacity(format!(
            "no {profile} instance of tenant {tenant} has room for {sm_percent}% SMs and {memory_bytes} bytes, and no new one can be placed: {msg}"
        ))),
        Err(e) => Err(e),
    }
}

/// The ready host of `tenant` and `profile` on a placeable GPU that admits the share,
/// chosen by the strategy.
fn join_host(
    profile: &str,
    sm_percent: u32,
    memory_bytes: u64,
    tenant: &str,
    hosts: &[MigMpsHost],
    gpus: &[GpuView],
    opts: &PlanOptions,
) -> Option<MigMpsDecision> {
    let placeable = |gpu: u32| {
        gpus.iter().any(|g| g.info.index == gpu) && opts.gpu_index.is_none_or(|i| i == gpu)
    };
    // (SM percent left, memory left, gpu, host id) of every host that admits it.
    let mut fitting: Vec<(u64, u64, u32, &str)> = Vec::new();
    for h in hosts {
        if !h.ready
            || h.tenant != tenant
            || !h.profile.eq_ignore_ascii_case(profile)
            || !placeable(h.gpu)
        {
            continue;
        }
        let used_sm: u64 = h.shares.iter().map(|s| u64::from(s.sm_percent)).sum();
        let used_mem: u64 = h.shares.iter().map(|s| s.memory_bytes).sum();
        let sm_ok = opts.mps_oversubscribe || used_sm + u64::from(sm_percent) <= 100;
        let mem_ok = used_mem.saturating_add(memory_bytes) <= h.memory_bytes;
        if sm_ok && mem_ok {
            fitting.push((
                100u64.saturating_sub(used_sm),
                h.memory_bytes - used_mem,
                h.gpu,
                h.partition_id.as_str(),
            ));
        }
    }
    let chosen = match opts.strategy {
        Strategy::FirstFit => fitting.iter().min_by_key(|(_, _, g, id)| (*g, *id)),
        Strategy::BestFit => fitting.iter().min(),
    };
    chosen.map(|(_, _, gpu, host)| MigMpsDecision::Join {
        gpu: *gpu,
        host: (*host).to_string(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::{
        GpuView, MigMpsDecision, MigMpsHost, MpsShare, PlanDecision, PlanError, PlanOptions, plan,
        plan_mig_mps,
    };
    use crate::gpu::Placement;
    use crate::partition::planner::Strategy as PlanStrategy;
    use crate::partition::test_fixtures::*;
    use crate::partition::{MpsMode, OccupiedMig};
    use proptest::prelude::*;

    fn share(sm_percent: u32, memory_bytes: u64) -> MpsShare {
        MpsShare {
            sm_percent,
            memory_bytes,
            mode: MpsMode::Shared,
        }
    }

    fn host(id: &str, gpu: u32, tenant: &str, shares: Vec<MpsShare>) -> MigMpsHost {
        MigMpsHost {
            partition_id: id.into(),
            gpu,
            profile: "3g.40gb".into(),
            memory_bytes: gib(39),
            tenant: tenant.into(),
            ready: true,
            shares,
        }
    }

    fn opts() -> PlanOptions {
        PlanOptions::default()
    }

    #[test]
    fn a_share_joins_its_tenants_instance_with_room_else_gets_a_new_one() {
        let gpus = [h100_mig(0)];
        let hosts = [
            host("p-full", 0, "team-a", vec![share(80, gib(4))]),
            host("p-other", 0, "team-b", vec![]),
            host("p-room", 0, "team-a", vec![share(50, gib(4))]),
        ];
        let d = plan_mig_mps("3g.40gb", 30, gib(8), "team-a", &hosts, &gpus, &opts());
        assert_eq!(
            d.unwrap(),
            MigMpsDecision::Join {
                gpu: 0,
                host: "p-room".into()
            }
        );
        // Too much memory for what is left in p-room: a new instance.
        let d = plan_mig_mps("3g.40gb", 10, gib(36), "team-a", &hosts, &gpus, &opts());
        assert!(
            matches!(d, Ok(MigMpsDecision::NewHost(PlanDecision::NewMig { .. }))),
            "{d:?}"
        );
        // Another tenant never joins.
        let d = plan_mig_mps("3g.40gb", 10, gib(1), "team-c", &hosts, &gpus, &opts());
        assert!(matches!(d, Ok(MigMpsDecision::NewHost(_))), "{d:?}");
        // More than the instance holds is refused outright.
        let e = plan_mig_mps("1g.10gb", 10, gib(11), "team-a", &[], &gpus, &opts());
        assert!(matches!(e, Err(PlanError::InvalidShape(_))), "{e:?}");
        let e = plan_mig_mps("3g.40gb", 0, gib(1), "team-a", &[], &gpus, &opts());
        assert!(matches!(e, Err(PlanError::InvalidShape(_))), "{e:?}");
    }

    #[test]
    fn a_full_gpu_refuses_with_the_reason() {
        let mut g = h100_mig(0);
        let seven = occ(&g, "7g.80gb", 0);
        g.mig = vec![seven];
        let e = plan_mig_mps("3g.40gb", 10, gib(1), "team-a", &[], &[g], &opts());
        let Err(PlanError::NoCapacity(msg)) = e else {
            panic!("{e:?}")
        };
        assert!(
            msg.contains("no 3g.40gb instance of tenant team-a has room"),
            "{msg}"
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Create {
            profile: usize,
            sm: u32,
            mem_gib: u64,
            tenant: usize,
            best_fit: bool,
        },
        Release(usize),
    }

    const PROFILES: [&str; 3] = ["1g.10gb", "2g.20gb", "3g.40gb"];
    const TENANTS: [&str; 2] = ["team-a", "team-b"];

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        prop_oneof![
            3 => (0..PROFILES.len(), 1u32..=100, 1u64..=20, 0..TENANTS.len(), any::<bool>())
                .prop_map(|(profile, sm, mem_gib, tenant, best_fit)| Op::Create {
                    profile,
                    sm,
                    mem_gib,
                    tenant,
                    best_fit,
                }),
            1 => any::<usize>().prop_map(Op::Release),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Whatever the sequence: host instances never overlap each other or other
        /// instances, every host's shares fit its SMs and memory, a host serves one
        /// tenant and one profile, and a refusal means nothing could take the share.
        #[test]
        fn shares_respect_their_instance_and_instances_never_overlap(
            ops in proptest::collection::vec(op(), 1..60)
        ) {
            let mut gpus = vec![h100_mig(0), h100_mig(1)];
            let mut hosts: Vec<MigMpsHost> = Vec::new();
            // (host id, share) of every live share.
            let mut live: Vec<(String, MpsShare)> = Vec::new();
            let mut next = 0u32;
            let mut placed: std::collections::HashMap<String, Placement> = Default::default();
            for op in ops {
                match op {
                    Op::Create { profile, sm, mem_gib, tenant, best_fit } => {
                        let (profile, tenant) = (PROFILES[profile], TENANTS[tenant]);
                        let o = PlanOptions {
                            strategy: if best_fit { PlanStrategy::BestFit } else { PlanStrategy::FirstFit },
                            ..PlanOptions::default()
                        };
                        let s = share(sm, gib(mem_gib));
                        match plan_mig_mps(profile, sm, gib(mem_gib), tenant, &hosts, &gpus, &o) {
                            Ok(MigMpsDecision::Join { gpu, host }) => {
                                let h = hosts.iter_mut().find(|h| h.partition_id == host).unwrap();
                                prop_assert_eq!(h.gpu, gpu);
                                prop_assert_eq!(&h.tenant, tenant);
                                prop_assert_eq!(&h.profile, profile);
                                h.shares.push(s);
                                live.push((host, s));
                            }
                            Ok(MigMpsDecision::NewHost(d)) => {
                                // Only when no host of the tenant and profile had room.
                                for h in hosts.iter().filter(|h| h.tenant == tenant && h.profile == profile) {
                                    let sm_used: u32 = h.shares.iter().map(|s| s.sm_percent).sum();
                                    let mem_used: u64 = h.shares.iter().map(|s| s.memory_bytes).sum();
                                    prop_assert!(sm_used + sm > 100 || mem_used + gib(mem_gib) > h.memory_bytes);
                                }
                                let PlanDecision::NewMig { gpu, gi_profile_id, placement, .. } = d else {
                                    return Err(TestCaseError::fail(format!("{d:?}: no static pool here")));
                                };
                                let g = view_mut(&mut gpus, gpu);
                                let p = profile_of(g, gi_profile_id);
                                prop_assert_eq!(p.name.as_str(), profile);
                                for o in &g.mig {
                                    let (a, b) = (o.placement, placement);
                                    prop_assert!(a.start + a.size <= b.start || b.start + b.size <= a.start,
                                        "{placement:?} overlaps {a:?}");
                                }
                                g.mig.push(OccupiedMig { gi_profile_id, placement, free_static: None });
                                next += 1;
                                let id = format!("h{next}");
                                placed.insert(id.clone(), placement);
                                prop_assert!(gib(mem_gib) <= p.memory_bytes);
                                hosts.push(MigMpsHost {
                                    partition_id: id.clone(),
                                    gpu,
                                    profile: profile.into(),
                                    memory_bytes: p.memory_bytes,
                                    tenant: tenant.into(),
                                    ready: true,
                                    shares: vec![s],
                                });
                                live.push((id, s));
                            }
                            Err(PlanError::InvalidShape(_)) => {
                                let p = gpus[0].profiles.iter().find(|p| p.name == profile).unwrap();
                                prop_assert!(gib(mem_gib) > p.memory_bytes);
                            }
                            Err(PlanError::NoCapacity(_)) => {
                                let room = hosts.iter().any(|h| {
                                    h.tenant == tenant && h.profile == profile && {
                                        let sm_used: u32 = h.shares.iter().map(|s| s.sm_percent).sum();
                                        let mem_used: u64 = h.shares.iter().map(|s| s.memory_bytes).sum();
                                        sm_used + sm <= 100 && mem_used + gib(mem_gib) <= h.memory_bytes
                                    }
                                });
                                prop_assert!(!room);
                                let placeable = plan(&mig_shape(profile), &gpus, &PlanOptions::default());
                                prop_assert!(placeable.is_err());
                            }
                            Err(e) => return Err(TestCaseError::fail(e.to_string())),
                        }
                    }
                    Op::Release(k) => {
                        if live.is_empty() {
                            continue;
                        }
                        let (host, s) = live.remove(k % live.len());
                        let h = hosts.iter_mut().find(|h| h.partition_id == host).unwrap();
                        let i = h.shares.iter().position(|x| *x == s).unwrap();
                        h.shares.remove(i);
                        // The last share ends its instance.
                        if h.shares.is_empty() {
                            let (gpu, id) = (h.gpu, h.partition_id.clone());
                            hosts.retain(|h| h.partition_id != id);
                            let at = placed.remove(&id).unwrap();
                            let g = view_mut(&mut gpus, gpu);
                            let i = g.mig.iter().position(|m| m.placement == at).unwrap();
                            g.mig.remove(i);
                        }
                    }
                }
                for h in &hosts {
                    let sm_used: u32 = h.shares.iter().map(|s| s.sm_percent).sum();
                    let mem_used: u64 = h.shares.iter().map(|s| s.memory_bytes).sum();
                    prop_assert!(sm_used <= 100, "{h:?}");
                    prop_assert!(mem_used <= h.memory_bytes, "{h:?}");
                }
            }
        }
    }

    fn profile_of(g: &GpuView, id: u32) -> crate::gpu::GiProfile {
        g.profiles.iter().find(|p| p.id == id).unwrap().clone()
    }
}
