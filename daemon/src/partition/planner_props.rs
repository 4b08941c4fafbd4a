//! Workload comparison of the two MIG strategies, and property tests of the planner's
//! invariants under random create/release sequences.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::fragmentation::{capacity_value, total_memory_slices, used_memory_slices};
use super::test_fixtures::*;
use super::{
    Expiry, GpuView, Movable, MovePlan, MpsMode, PlanDecision, PlanError, PlanOptions, Shape,
    Strategy as PlanStrategy, Temporal, compact, plan, plan_with_moves,
};
use crate::gpu::Placement;

// ------------------------------------------------------------------ strategy comparison

/// H100 profile mix of the workload, with weights (1g requests are most common).
const MIX: &[(&str, u32)] = &[
    ("1g.10gb", 30),
    ("1g.10gb+me", 3),
    ("1g.20gb", 12),
    ("2g.20gb", 20),
    ("3g.40gb", 15),
    ("4g.40gb", 10),
    ("7g.80gb", 10),
];

struct Outcome {
    requests: u32,
    refused: u32,
    /// Refusals although some GPU had at least as many free memory slices as asked.
    refused_with_room: u32,
    /// Memory slices of the refused requests.
    refused_slices: u32,
}

/// One request arrives per step with a random lifetime; granted instances are destroyed
/// when their lifetime ends. The same arrivals and lifetimes are offered to both
/// strategies (only the seed decides them).
fn simulate(strategy: PlanStrategy, seed: u64, steps: u32) -> Outcome {
    let total_weight: u32 = MIX.iter().map(|(_, w)| w).sum();
    let mut rng = StdRng::seed_from_u64(seed);
    let arrivals: Vec<(&str, u32)> = (0..steps)
        .map(|_| {
            let mut x = rng.gen_range(0..total_weight);
            let name = MIX
                .iter()
                .find(|(_, w)| {
                    if x < *w {
                        true
                    } else {
                        x -= w;
                        false
                    }
                })
                .unwrap()
                .0;
            (name, rng.gen_range(1..=8))
        })
        .collect();

    let opts = PlanOptions {
        strategy,
        ..PlanOptions::default()
    };
    let mut gpus = [h100_mig(0), h100_mig(1)];
    let mut expiry: BTreeMap<u32, Vec<(u32, Placement)>> = BTreeMap::new();
    let mut out = Outcome {
        requests: 0,
        refused: 0,
        refused_with_room: 0,
        refused_slices: 0,
    };
    for (t, (name, life)) in (0u32..).zip(arrivals) {
        for (gpu, placement) in expiry.remove(&t).unwrap_or_default() {
            let v = view_mut(&mut gpus, gpu);
            let i = v.mig.iter().position(|m| m.placement == placement).unwrap();
            v.mig.remove(i);
        }
        let shape = mig_shape(name);
        out.requests += 1;
        match plan(&shape, &gpus, &opts) {
            Ok(d) => {
                let PlanDecision::NewMig { gpu, placement, .. } = d else {
                    panic!("{d:?}");
                };
                apply(&mut gpus, &shape, &d);
                expiry.entry(t + life).or_default().push((gpu, placement));
            }
            Err(PlanError::NoCapacity(_)) => {
                out.refused += 1;
                let size = gpus[0]
                    .profiles
                    .iter()
                    .find(|p| p.name == name)
                    .unwrap()
                    .memory_slices;
                out.refused_slices += size;
                if gpus
                    .iter()
                    .any(|g| total_memory_slices(g) - used_memory_slices(g) >= size)
                {
                    out.refused_with_room += 1;
                }
            }
            Err(e) => panic!("{e}"),
        }
    }
    out
}

#[test]
fn best_fit_refuses_fewer_requests_than_first_fit() {
    // Two H100s, 5 seeds x 2000 requests, mean lifetime 4.5 requests: first fit refuses
    // about 15% of them.
    let mut totals = [[0u32; 3]; 2];
    for seed in 1..=5u64 {
        for (i, strategy) in [PlanStrategy::BestFit, PlanStrategy::FirstFit]
            .into_iter()
            .enumerate()
        {
            let o = simulate(strategy, seed, 2000);
            println!(
                "seed {seed} {strategy:?}: refused {} of {} requests ({} slices), {} of them \
                 while a GPU had enough free slices",
                o.refused, o.requests, o.refused_slices, o.refused_with_room
            );
            totals[i][0] += o.refused;
            totals[i][1] += o.refused_slices;
            totals[i][2] += o.refused_with_room;
        }
    }
    let [bf, ff] = totals;
    println!("best fit {bf:?}, first fit {ff:?} (refused, refused slices, refused with room)");
    assert!(
        bf[0] < ff[0],
        "refused requests: best fit {} vs first fit {}",
        bf[0],
        ff[0]
    );
    assert!(
        bf[1] < ff[1],
        "refused slices: best fit {} vs first fit {}",
        bf[1],
        ff[1]
    );
    assert!(
        bf[2] < ff[2],
        "stranded refusals: best fit {} vs first fit {}",
        bf[2],
        ff[2]
    );
}

// ------------------------------------------------------------------ property tests

use proptest::prelude::*;

use super::{OccupiedMig, free_capacity};

/// GI profile names of both fixture GPUs, plus one no GPU offers.
const NAMES: &[&str] = &[
    "1g.10gb",
    "1g.10gb+me",
    "1g.20gb",
    "2g.20gb",
    "3g.40gb",
    "4g.40gb",
    "7g.80gb",
    "1g.5gb",
    "1g.5gb+me",
    "2g.10gb",
    "3g.20gb",
    "4g.20gb",
    "7g.40gb",
    "9g.999gb",
];
const CI_NAMES: &[&str] = &["1c", "2c", "3c", "4c", "7c", "5c"];

#[derive(Debug, Clone)]
enum Op {
    Mig {
        name: usize,
        ci: Option<usize>,
        best_fit: bool,
        /// Put the new instance into the static pool instead of leasing it.
        to_static: bool,
        dynamic: bool,
        gpu: Option<u32>,
    },
    Mps {
        sm: u32,
        mem_gib: u64,
        oversubscribe: bool,
        best_fit: bool,
        shared: bool,
    },
    Whole {
        best_fit: bool,
    },
    /// Release the (k mod n)-th live lease.
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (
            0..NAMES.len(),
            prop::option::weighted(0.2, 0..CI_NAMES.len()),
            any::<bool>(),
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.85),
            prop::option::weighted(0.15, 0u32..5),
        )
            .prop_map(|(name, ci, best_fit, to_static, dynamic, gpu)| Op::Mig {
                name,
                ci,
                best_fit,
                to_static,
                dynamic,
                gpu,
            }),
        2 => (0u32..=110, 0u64..=90, prop::bool::weighted(0.3), any::<bool>(), any::<bool>()).prop_map(
            |(sm, mem_gib, oversubscribe, best_fit, shared)| Op::Mps {
                sm,
                mem_gib,
                oversubscribe,
                best_fit,
                shared,
            }
        ),
        1 => any::<bool>().prop_map(|best_fit| Op::Whole { best_fit }),
        4 => any::<usize>().prop_map(Op::Release),
    ]
}

#[derive(Debug, Clone)]
enum Lease {
    Mig {
        gpu: u32,
        placement: Placement,
        static_id: Option<String>,
    },
    Mps {
        gpu: u32,
        mode: MpsMode,
        sm: u32,
        mem: u64,
    },
    Whole {
        gpu: u32,
    },
}

fn node() -> Vec<GpuView> {
    vec![h100_mig(0), a100_mig(1), h100_plain(2), h100_plain(3)]
}

fn options(best_fit: bool) -> PlanOptions {
    PlanOptions {
        strategy: if best_fit {
            PlanStrategy::BestFit
        } else {
            PlanStrategy::FirstFit
        },
        ..PlanOptions::default()
    }
}

/// Every invariant the planner must keep, over the whole node.
fn check_invariants(gpus: &[GpuView], oversubscribed: &[bool]) -> Result<(), TestCaseError> {
    for g in gpus {
        let i = g.info.index;
        if !g.mig.is_empty() {
            prop_assert!(
                g.info.mig_current,
                "gpu{i}: MIG instance on a MIG-disabled GPU"
            );
            prop_assert!(
                !g.whole_leased,
                "gpu{i}: MIG instance on a whole-leased GPU"
            );
        }
        for (a, m) in g.mig.iter().enumerate() {
            let p = g.profiles.iter().find(|p| p.id == m.gi_profile_id);
            prop_assert!(p.is_some(), "gpu{i}: unknown profile {}", m.gi_profile_id);
            let p = p.unwrap();
            prop_assert!(
                p.placements.contains(&m.placement),
                "gpu{i}: {:?} is not a placement of {}",
                m.placement,
                p.name
            );
            for n in &g.mig[a + 1..] {
                prop_assert!(
                    !m.placement.overlaps(&n.placement),
                    "gpu{i}: {:?} overlaps {:?}",
                    m,
                    n
                );
            }
        }
        for p in &g.profiles {
            let n = g.mig.iter().filter(|m| m.gi_profile_id == p.id).count();
            prop_assert!(n <= p.max_count as usize, "gpu{i}: {n} x {}", p.name);
        }
        if !g.mps.is_empty() {
            prop_assert!(!g.info.mig_current, "gpu{i}: MPS share on a MIG GPU");
            prop_assert!(!g.whole_leased, "gpu{i}: MPS share on a whole-leased GPU");
        }
        let sm = g.mps.sm_percent;
        let mem = g.mps.memory_bytes;
        prop_assert!(
            mem <= u128::from(g.info.memory_bytes),
            "gpu{i}: MPS memory {mem}"
        );
        if !oversubscribed[i as usize] {
            prop_assert!(sm <= 100, "gpu{i}: MPS SMs {sm}%");
        }
    }
    Ok(())
}

/// Brute force: could a new instance of `name` (with CI `ci`) be created anywhere?
fn creatable_somewhere(gpus: &[GpuView], name: &str, ci: Option<&str>, gpu: Option<u32>) -> bool {
    gpus.iter()
        .filter(|g| g.info.mig_current && !g.whole_leased)
        .filter(|g| gpu.is_none_or(|i| g.info.index == i))
        .any(|g| {
            g.profiles
                .iter()
                .filter(|p| p.name.eq_ignore_ascii_case(name))
                .filter(|p| ci.is_none_or(|c| p.ci_profiles.iter().any(|x| x.name == c)))
                .any(|p| {
                    g.mig.iter().filter(|m| m.gi_profile_id == p.id).count() < p.max_count as usize
                        && p.placements
                            .iter()
                            .any(|pl| g.mig.iter().all(|m| !m.placement.overlaps(pl)))
                })
        })
}

fn free_static_somewhere(gpus: &[GpuView], name: &str, gpu: Option<u32>) -> bool {
    gpus.iter()
        .filter(|g| g.info.mig_current && !g.whole_leased)
        .filter(|g| gpu.is_none_or(|i| g.info.index == i))
        .any(|g| {
            g.profiles
                .iter()
                .filter(|p| p.name.eq_ignore_ascii_case(name))
                .any(|p| {
                    g.mig
                        .iter()
                        .any(|m| m.gi_profile_id == p.id && m.free_static.is_some())
                })
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn planner_keeps_invariants_and_refuses_only_when_full(
        ops in prop::collection::vec(op(), 1..120)
    ) {
        let mut gpus = node();
        let mut leases: Vec<Lease> = Vec::new();
        let mut oversubscribed = vec![false; gpus.len()];
        let mut static_seq = 0u32;
        for op in ops {
            match op {
                Op::Mig { name, ci, best_fit, to_static, dynamic, gpu } => {
                    let name = NAMES[name];
                    let ci = ci.map(|c| CI_NAMES[c]);
                    let shape = Shape::Mig {
                        profile: name.to_string(),
                        compute_profile: ci.map(str::to_string),
                    };
                    let opts = PlanOptions { dynamic_mig: dynamic, gpu_index: gpu, ..options(best_fit) };
                    match plan(&shape, &gpus, &opts) {
                        Ok(PlanDecision::NewMig { gpu, gi_profile_id, placement, ci_profile_id }) => {
                            prop_assert!(dynamic, "new instance without dynamic MIG");
                            let g = view_mut(&mut gpus, gpu);
                            let p = profile(&g.profiles, gi_profile_id);
                            prop_assert!(p.name.eq_ignore_ascii_case(name));
                            match (ci, ci_profile_id) {
                                (None, None) => {}
                                (Some(c), Some(id)) => prop_assert!(
                                    p.ci_profiles.iter().any(|x| x.id == id && x.name == c)
                                ),
                                other => prop_assert!(false, "CI mismatch {other:?}"),
                            }
                            // A new instance is only created when no free static one fits.
                            if ci.is_none() {
                                prop_assert!(!free_static_somewhere(&gpus, name, opts.gpu_index));
                            }
                            let g = view_mut(&mut gpus, gpu);
                            if to_static && ci.is_none() {
                                static_seq += 1;
                                g.mig.push(OccupiedMig {
                                    gi_profile_id,
                                    placement,
                                    free_static: Some(format!("s{static_seq}")),
                                });
                            } else {
                                g.mig.push(OccupiedMig { gi_profile_id, placement, free_static: None });
                                leases.push(Lease::Mig { gpu, placement, static_id: None });
                            }
                        }
                        Ok(d @ PlanDecision::Static { .. }) => {
                            prop_assert!(ci.is_none(), "static partition for a CI request");
                            let PlanDecision::Static { gpu, partition_id } = &d else { unreachable!() };
                            let g = view_mut(&mut gpus, *gpu);
                            let m = g.mig.iter().find(|m| m.free_static.as_deref() == Some(partition_id));
                            prop_assert!(m.is_some(), "static partition {partition_id} not free");
                            let m = m.unwrap();
                            prop_assert!(profile(&g.profiles, m.gi_profile_id).name.eq_ignore_ascii_case(name));
                            let placement = m.placement;
                            apply(&mut gpus, &shape, &d);
                            leases.push(Lease::Mig { gpu: *gpu, placement, static_id: Some(partition_id.clone()) });
                        }
                        Ok(other) => prop_assert!(false, "MIG shape got {other:?}"),
                        Err(PlanError::NoCapacity(msg)) => {
                            prop_assert!(!free_static_somewhere(&gpus, name, opts.gpu_index) || ci.is_some(), "{msg}");
                            if dynamic {
                                prop_assert!(!creatable_somewhere(&gpus, name, ci, opts.gpu_index), "{msg}");
                            }
                        }
                        Err(PlanError::UnknownProfile { .. }) => {
                            prop_assert!(gpus.iter()
                                .filter(|g| g.info.mig_current && !g.whole_leased)
                                .filter(|g| opts.gpu_index.is_none_or(|i| g.info.index == i))
                                .all(|g| g.profiles.iter().all(|p| !p.name.eq_ignore_ascii_case(name))));
                        }
                        Err(PlanError::InvalidShape(msg)) => {
                            prop_assert!(
                                opts.gpu_index.is_some_and(|i| i > 3)
                                    || ci.is_some(),
                                "{msg}"
                            );
                        }
                        // Only multi-partition planning (topology.rs) answers this.
                        Err(PlanError::TopologyUnmet(msg)) => {
                            return Err(TestCaseError::fail(msg));
                        }
                    }
                }
                Op::Mps { sm, mem_gib, oversubscribe, best_fit, shared } => {
                    let mode = if shared { MpsMode::Shared } else { MpsMode::Isolated };
                    let shape = Shape::Mps { sm_percent: sm, memory_bytes: gib(mem_gib), mode };
                    let opts = PlanOptions { mps_oversubscribe: oversubscribe, ..options(best_fit) };
                    match plan(&shape, &gpus, &opts) {
                        Ok(d) => {
                            let PlanDecision::Mps { gpu } = d else {
                                return Err(TestCaseError::fail(format!("MPS shape got {d:?}")));
                            };
                            if oversubscribe {
                                oversubscribed[gpu as usize] = true;
                            }
                            // One MPS mode per GPU at a time.
                            prop_assert!(
                                view_mut(&mut gpus, gpu).mps.other_mode(mode).is_none(),
                                "{mode} share placed on GPU {gpu} beside another mode"
                            );
                            apply(&mut gpus, &shape, &d);
                            leases.push(Lease::Mps { gpu, mode, sm, mem: gib(mem_gib) });
                        }
                        Err(PlanError::InvalidShape(_)) => {
                            prop_assert!(sm == 0 || sm > 100 || mem_gib == 0);
                        }
                        Err(PlanError::NoCapacity(msg)) => {
                            let fits = gpus.iter().any(|g| {
                                !g.info.mig_current && !g.whole_leased
                                    && g.mps.other_mode(mode).is_none() && {
                                    let s = g.mps.sm_percent;
                                    let m = g.mps.memory_bytes;
                                    (oversubscribe || s + u64::from(sm) <= 100) && m + u128::from(gib(mem_gib)) <= u128::from(g.info.memory_bytes)
                                }
                            });
                            prop_assert!(!fits, "{msg}");
                        }
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                }
                Op::Whole { best_fit } => match plan(&Shape::WholeGpu, &gpus, &options(best_fit)) {
                    Ok(d) => {
                        let PlanDecision::WholeGpu { gpu } = d else {
                            return Err(TestCaseError::fail(format!("whole shape got {d:?}")));
                        };
                        let g = view_mut(&mut gpus, gpu);
                        prop_assert!(g.mps.is_empty() && g.mig.is_empty() && !g.whole_leased && !g.info.mig_current);
                        apply(&mut gpus, &Shape::WholeGpu, &d);
                        leases.push(Lease::Whole { gpu });
                    }
                    Err(PlanError::NoCapacity(msg)) => {
                        prop_assert!(
                            gpus.iter().all(|g| g.info.mig_current || !g.mps.is_empty() || g.whole_leased),
                            "{msg}"
                        );
                    }
                    Err(e) => prop_assert!(false, "{e}"),
                },
                Op::Release(k) => {
                    if leases.is_empty() {
                        continue;
                    }
                    match leases.remove(k % leases.len()) {
                        Lease::Mig { gpu, placement, static_id } => {
                            let g = view_mut(&mut gpus, gpu);
                            let i = g.mig.iter().position(|m| m.placement == placement && m.free_static.is_none());
                            prop_assert!(i.is_some());
                            let i = i.unwrap();
                            match static_id {
                                Some(id) => g.mig[i].free_static = Some(id),
                                None => { g.mig.remove(i); }
                            }
                        }
                        Lease::Mps { gpu, mode, sm, mem } => {
                            let g = view_mut(&mut gpus, gpu);
                            prop_assert!(!g.mps.is_empty());
                            g.mps.remove(crate::partition::MpsShare { sm_percent: sm, memory_bytes: mem, mode });
                        }
                        Lease::Whole { gpu } => view_mut(&mut gpus, gpu).whole_leased = false,
                    }
                }
            }
            check_invariants(&gpus, &oversubscribed)?;
            // free_capacity never promises an instance the planner would refuse.
            for g in gpus.iter().filter(|g| g.info.mig_current) {
                for (id, n) in free_capacity(g) {
                    let p = profile(&g.profiles, id);
                    let creatable = g.mig.iter().filter(|m| m.gi_profile_id == id).count() < p.max_count as usize
                        && p.placements.iter().any(|pl| g.mig.iter().all(|m| !m.placement.overlaps(pl)));
                    prop_assert_eq!(n > 0, creatable, "gpu{} {}", g.info.index, p.name);
                }
            }
        }
    }
}

// ------------------------------------------------------------------ moves of idle leases

#[derive(Debug, Clone)]
enum MoveOp {
    /// Ask for an H100 profile (index into NAMES' first seven), moves allowed.
    Create {
        name: usize,
        best_fit: bool,
    },
    /// A container binds to the (k mod n)-th live lease: it may not move any more.
    Bind(usize),
    Release(usize),
}

fn move_op() -> impl Strategy<Value = MoveOp> {
    prop_oneof![
        5 => (0usize..7, any::<bool>()).prop_map(|(name, best_fit)| MoveOp::Create { name, best_fit }),
        2 => any::<usize>().prop_map(MoveOp::Bind),
        3 => any::<usize>().prop_map(MoveOp::Release),
    ]
}

/// A live lease of the move test: its id never changes, its place may.
#[derive(Debug, Clone)]
struct Placed {
    id: u32,
    gpu: u32,
    placement: Placement,
    gi_profile_id: u32,
    bound: bool,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// plan_with_moves only moves idle leases, keeps every lease (same id, same
    /// profile), never creates an overlap (each move's target is free of everything
    /// present before it, so moves can run one by one), never moves when plan() alone
    /// fits, and refuses only what plan() refuses too.
    #[test]
    fn moves_keep_leases_and_never_overlap(ops in prop::collection::vec(move_op(), 1..150)) {
        let mut gpus = vec![h100_mig(0), h100_mig(1), h100_mig(2)];
        let mut live: Vec<Placed> = Vec::new();
        let mut next_id = 0u32;
        let no_oversubscription = [false; 3];
        for op in ops {
            match op {
                MoveOp::Create { name, best_fit } => {
                    let shape = mig_shape(NAMES[name]);
                    let opts = options(best_fit);
                    let movable: Vec<Movable> = live
                        .iter()
                        .filter(|l| !l.bound)
                        .map(|l| Movable { gpu: l.gpu, placement: l.placement })
                        .collect();
                    let direct = plan(&shape, &gpus, &opts);
                    match plan_with_moves(&shape, &gpus, &opts, &movable) {
                        Ok(MovePlan { moves, decision }) => {
                            if let Ok(d) = &direct {
                                prop_assert!(moves.is_empty(), "moved although plan() fit");
                                prop_assert_eq!(d, &decision);
                            }
                            let before: Vec<GpuView> = gpus.clone();
                            let ids_before: Vec<u32> = live.iter().map(|l| l.id).collect();
                            let PlanDecision::NewMig { gpu, gi_profile_id, placement, .. } = decision else {
                                return Err(TestCaseError::fail(format!("{decision:?}")));
                            };
                            for m in &moves {
                                let l = live.iter_mut().find(|l| l.gpu == m.from_gpu && l.placement == m.from);
                                prop_assert!(l.is_some(), "move of no lease: {m:?}");
                                let l = l.unwrap();
                                prop_assert!(!l.bound, "moved a bound lease: {m:?}");
                                prop_assert_eq!(l.gi_profile_id, m.gi_profile_id);
                                // The target is free of everything present before the plan.
                                let target = before.iter().find(|g| g.info.index == m.to_gpu).unwrap();
                                prop_assert!(target.mig.iter().all(|i| !i.placement.overlaps(&m.to)),
                                    "move target {m:?} was occupied");
                                let src = view_mut(&mut gpus, m.from_gpu);
                                let i = src.mig.iter().position(|i| i.placement == m.from).unwrap();
                                src.mig.remove(i);
                                view_mut(&mut gpus, m.to_gpu).mig.push(OccupiedMig {
                                    gi_profile_id: m.gi_profile_id,
                                    placement: m.to,
                                    free_static: None,
                                });
                                l.gpu = m.to_gpu;
                                l.placement = m.to;
                                check_invariants(&gpus, &no_oversubscription)?;
                            }
                            let g = view_mut(&mut gpus, gpu);
                            prop_assert!(g.mig.iter().all(|i| !i.placement.overlaps(&placement)));
                            prop_assert!(profile(&g.profiles, gi_profile_id).name == NAMES[name]);
                            g.mig.push(OccupiedMig { gi_profile_id, placement, free_static: None });
                            let ids_after: Vec<u32> = live.iter().map(|l| l.id).collect();
                            prop_assert_eq!(ids_before, ids_after);
                            live.push(Placed { id: next_id, gpu, placement, gi_profile_id, bound: false });
                            next_id += 1;
                        }
                        Err(PlanError::NoCapacity(msg)) => {
                            prop_assert!(direct.is_err(), "{msg}");
                            // With nothing movable, exactly plan()'s refusal.
                            if movable.is_empty() {
                                prop_assert_eq!(direct, Err(PlanError::NoCapacity(msg)));
                            }
                        }
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                }
                MoveOp::Bind(k) => {
                    if !live.is_empty() {
                        let n = live.len();
                        live[k % n].bound = true;
                    }
                }
                MoveOp::Release(k) => {
                    if !live.is_empty() {
                        let l = live.remove(k % live.len());
                        let g = view_mut(&mut gpus, l.gpu);
                        let i = g.mig.iter().position(|m| m.placement == l.placement).unwrap();
                        g.mig.remove(i);
                    }
                }
            }
            check_invariants(&gpus, &no_oversubscription)?;
            // Every live lease is on the node where the test thinks it is.
            for l in &live {
                let g = gpus.iter().find(|g| g.info.index == l.gpu).unwrap();
                prop_assert!(g.mig.iter().any(|m| m.placement == l.placement && m.gi_profile_id == l.gi_profile_id));
            }
            let instances: usize = gpus.iter().map(|g| g.mig.len()).sum();
            prop_assert_eq!(instances, live.len());
        }
    }

    /// Housekeeping's `compact` moves only an idle lease, to a place free of every
    /// instance present (its own old one included), keeps its profile, and strictly
    /// raises the node's free-space value.
    #[test]
    fn compaction_moves_only_idle_leases_and_raises_free_space(
        ops in prop::collection::vec(move_op(), 1..120),
    ) {
        let mut gpus = vec![h100_mig(0), h100_mig(1), h100_mig(2)];
        let mut live: Vec<Placed> = Vec::new();
        let no_oversubscription = [false; 3];
        let value = |gpus: &[GpuView]| -> u64 {
            gpus.iter().map(|g| capacity_value(&g.profiles, &g.mig)).sum()
        };
        for (id, op) in (0u32..).zip(ops) {
            match op {
                MoveOp::Create { name, best_fit } => {
                    let shape = mig_shape(NAMES[name]);
                    if let Ok(d @ PlanDecision::NewMig { gpu, placement, gi_profile_id, .. }) =
                        plan(&shape, &gpus, &options(best_fit))
                    {
                        apply(&mut gpus, &shape, &d);
                        live.push(Placed { id, gpu, placement, gi_profile_id, bound: false });
                    }
                }
                MoveOp::Bind(k) => {
                    if !live.is_empty() {
                        let n = live.len();
                        live[k % n].bound = true;
                    }
                }
                MoveOp::Release(k) => {
                    if !live.is_empty() {
                        let l = live.remove(k % live.len());
                        let g = view_mut(&mut gpus, l.gpu);
                        g.mig.retain(|m| m.placement != l.placement);
                    }
                }
            }
            let movable: Vec<Movable> = live
                .iter()
                .filter(|l| !l.bound)
                .map(|l| Movable { gpu: l.gpu, placement: l.placement })
                .collect();
            let before = value(&gpus);
            if let Some(m) = compact(&gpus, &options(true), &movable) {
                let l = live.iter_mut().find(|l| l.gpu == m.from_gpu && l.placement == m.from);
                prop_assert!(l.is_some(), "move of no lease: {m:?}");
                let l = l.unwrap();
                prop_assert!(!l.bound, "moved a bound lease: {m:?}");
                prop_assert_eq!(l.gi_profile_id, m.gi_profile_id);
                let target = gpus.iter().find(|g| g.info.index == m.to_gpu).unwrap();
                prop_assert!(target.mig.iter().all(|i| !i.placement.overlaps(&m.to)),
                    "move target {m:?} was occupied");
                view_mut(&mut gpus, m.from_gpu).mig.retain(|i| i.placement != m.from);
                view_mut(&mut gpus, m.to_gpu).mig.push(OccupiedMig {
                    gi_profile_id: m.gi_profile_id,
                    placement: m.to,
                    free_static: None,
                });
                l.gpu = m.to_gpu;
                l.placement = m.to;
                prop_assert!(value(&gpus) > before, "{m:?} did not raise the free-space value");
                check_invariants(&gpus, &no_oversubscription)?;
            }
            let instances: usize = gpus.iter().map(|g| g.mig.len()).sum();
            prop_assert_eq!(instances, live.len());
        }
    }

}

// ---------------------------------------------------------------------------------------
// Temporal packing

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Expiry information only chooses among feasible placements: with it, the planner
    /// accepts exactly the requests it accepts without it, and what it places keeps
    /// the invariants (no overlap, valid placements, max_count), whatever the weight,
    /// the expiries and the clock.
    #[test]
    fn expiry_never_makes_a_feasible_request_infeasible(
        ops in prop::collection::vec((0usize..7, 0u64..1000, 1u64..1000, any::<bool>()), 1..120),
        temporal in prop_oneof![
            Just(Temporal::TieBreak),
            (0u32..10_000).prop_map(Temporal::Weighted),
            (0u32..10_000).prop_map(Temporal::Group),
            (0u32..10_000).prop_map(Temporal::Empties),
        ],
        n_gpus in 1u32..=3,
    ) {
        let mut gpus: Vec<GpuView> = (0..n_gpus).map(h100_mig).collect();
        // (gpu, placement, expiry) of each live instance.
        let mut live: Vec<(u32, Placement, u64)> = Vec::new();
        let mut now = 0u64;
        for (n, step, ttl, release) in ops {
            now += step;
            if release && !live.is_empty() {
                let (gpu, placement, _) = live.remove(usize::try_from(step).unwrap() % live.len());
                view_mut(&mut gpus, gpu).mig.retain(|m| m.placement != placement);
            }
            let shape = mig_shape(NAMES[n]);
            let mut latest: Vec<(u32, u64)> = Vec::new();
            for (g, _, e) in &live {
                match latest.iter_mut().find(|(x, _)| x == g) {
                    Some((_, t)) => *t = (*t).max(*e),
                    None => latest.push((*g, *e)),
                }
            }
            let with = PlanOptions {
                temporal,
                expiry: Some(Expiry { now, new_lease: now + ttl, latest }),
                ..options(true)
            };
            let without = PlanOptions { temporal: Temporal::Off, ..options(true) };
            let a = plan(&shape, &gpus, &with);
            let b = plan(&shape, &gpus, &without);
            prop_assert_eq!(a.is_ok(), b.is_ok(), "{:?} vs {:?}", a, b);
            if let Ok(d) = a {
                let PlanDecision::NewMig { gpu, placement, .. } = d else {
                    return Err(TestCaseError::fail(format!("{d:?}")));
                };
                apply(&mut gpus, &shape, &d);
                live.push((gpu, placement, now + ttl));
                check_invariants(&gpus, &vec![false; gpus.len()])?;
            }
        }
    }
}
