//! Several partitions for one job (a multi-GPU lease), placed by topology.
//!
//! N whole GPUs ([`plan_gpus`]): the set of free GPUs whose worst-connected pair is
//! best (NVLink before PCIe; then one PCIe switch, one host bridge, one NUMA node
//! before crossing the CPUs' interconnect), ties broken by the sum over all pairs,
//! then by the lowest indices.
//!
//! N MIG instances of one profile ([`plan_migs`]): from each GPU as the anchor, the
//! instances are placed (by the ordinary planner, one GPU at a time) on the anchor
//! first, then on the GPUs nearest to it; the anchor whose GPUs are best connected
//! (then fewest GPUs, then lowest index) wins.
//!
//! A [`TopologyConstraint`] (`nvlink`, `numa`) limits which pairs of GPUs may be in
//! one lease; when room exists but not within it, the refusal says so
//! ([`PlanError::TopologyUnmet`]).
//!
//! Pure: the links come from the caller (the backend's topology query).

use serde::{Deserialize, Serialize};

use super::planner::{PlanDecision, PlanError, PlanOptions, plan};
use super::view::{GpuView, OccupiedMig, Shape};
use crate::gpu::{GpuLink, TopologyLevel};

/// How closely the GPUs of a multi-partition lease must be connected. Partitions on
/// one GPU always meet it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TopologyConstraint {
    /// The best connected set there is, whatever its links.
    #[default]
    Any,
    /// Every pair on one NUMA node (PCIe switch, host bridge or node level).
    Numa,
    /// Every pair joined by NVLink (NVSwitch or bridge).
    Nvlink,
}

impl TopologyConstraint {
    pub fn as_str(self) -> &'static str {
        match self {
            TopologyConstraint::Any => "any",
            TopologyConstraint::Numa => "numa",
            TopologyConstraint::Nvlink => "nvlink",
        }
    }

    pub fn parse(s: &str) -> Option<TopologyConstraint> {
        Some(match s {
            "any" => TopologyConstraint::Any,
            "numa" => TopologyConstraint::Numa,
            "nvlink" => TopologyConstraint::Nvlink,
            _ => return None,
        })
    }

    /// Whether two GPUs joined by `l` may be in one lease.
    pub fn admits(self, l: GpuLink) -> bool {
        l.level == TopologyLevel::Internal
            || match self {
                TopologyConstraint::Any => true,
                TopologyConstraint::Numa => l.level <= TopologyLevel::Node,
                TopologyConstraint::Nvlink => l.nvlinks > 0,
            }
    }

    /// What it demands, for refusals.
    fn describe(self) -> &'static str {
        match self {
            TopologyConstraint::Any => "anywhere",
            TopologyConstraint::Numa => "on one NUMA node",
            TopologyConstraint::Nvlink => "joined pairwise by NVLink",
        }
    }
}

/// The cost of one pair: without NVLink first, then how far apart on PCIe.
fn pair_cost(l: GpuLink) -> (u32, TopologyLevel) {
    (u32::from(l.nvlinks == 0), l.level)
}

/// Whether `g` can be taken whole: no MIG, nothing on it, in the view.
pub fn free_whole(g: &GpuView) -> bool {
    !g.info.mig_current && g.mig.is_empty() && g.mps.is_empty() && !g.whole_leased
}

/// The cost of a set: (worst pair, (pairs without NVLink, sum of PCIe levels)).
pub type SetCost = ((u32, TopologyLevel), (u32, u32));

/// The cost of a set of GPUs; lower is better connected.
pub fn set_cost(set: &[u32], link: &dyn Fn(u32, u32) -> GpuLink) -> SetCost {
    let mut worst = (0, TopologyLevel::Internal);
    let (mut no_nvlink, mut levels) = (0u32, 0u32);
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            let c = pair_cost(link(a, b));
            worst = worst.max(c);
            no_nvlink += c.0;
            levels += c.1 as u32;
        }
    }
    (worst, (no_nvlink, levels))
}

/// Choose `count` free whole GPUs among `gpus` by topology. Refuses with the reason
/// when fewer are free. Exhaustive over the sets (a node has at most a few dozen
/// GPUs; 8 choose 4 is 70 sets).
pub fn plan_gpus(
    count: u32,
    gpus: &[GpuView],
    link: &dyn Fn(u32, u32) -> GpuLink,
) -> Result<Vec<u32>, PlanError> {
    plan_gpus_within(count, gpus, link, TopologyConstraint::Any)
}

/// [`plan_gpus`] among the sets whose every pair meets `constraint`.
pub fn plan_gpus_within(
    count: u32,
    gpus: &[GpuView],
    link: &dyn Fn(u32, u32) -> GpuLink,
    constraint: TopologyConstraint,
) -> Result<Vec<u32>, PlanError> {
    let mut free: Vec<u32> = gpus
        .iter()
        .filter(|g| free_whole(g))
        .map(|g| g.info.index)
        .collect();
    free.sort_unstable();
    let n = usize::try_from(count).unwrap_or(usize::MAX);
    if count == 0 || count > 64 {
        return Err(PlanError::InvalidShape(format!(
            "a multi-GPU lease takes 1..=64 GPUs, got {count}"
        )));
    }
    if free.len() < n {
        return Err(PlanError::NoCapacity(format!(
            "{count} whole GPUs asked, {} free ({})",
            free.len(),
            if free.is_empty() {
                "none".to_string()
            } else {
                free.iter()
                    .map(|i| format!("gpu {i}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        )));
    }
    let best = if combinations(free.len(), n) <= EXHAUSTIVE_SETS {
        best_set_exhaustive(&free, n, link, constraint)
    } else {
        best_set_from_anchors(&free, n, link, constraint)
    };
    best.ok_or_else(|| {
        PlanError::TopologyUnmet(format!(
            "{count} whole GPUs asked {}: {} are free ({}) but no {count} of them are {}",
            constraint.describe(),
            free.len(),
            free.iter()
                .map(|i| format!("gpu {i}"))
                .collect::<Vec<_>>()
                .join(", "),
            constraint.describe()
        ))
    })
}

/// Above this many candidate sets, whole GPUs are chosen from anchors (each free
/// GPU with its nearest) rather than over every set: a request's cost stays small
/// on any node (16 GPUs choose 8 is 12,870 sets; 64 choose 32 would never end).
const EXHAUSTIVE_SETS: u64 = 20_000;

/// `n` choose `k`, saturating.
fn combinations(n: usize, k: usize) -> u64 {
    let k = k.min(n.saturating_sub(k));
    let mut c: u64 = 1;
    for i in 0..k {
        c = c.saturating_mul((n - i) as u64) / (i as u64 + 1);
        if c > EXHAUSTIVE_SETS {
            return u64::MAX;
        }
    }
    c
}

/// Each free GPU as the anchor, with the free GPUs nearest to it (those meeting
/// `constraint` with every one taken); the best set over the anchors.
fn best_set_from_anchors(
    free: &[u32],
    n: usize,
    link: &dyn Fn(u32, u32) -> GpuLink,
    constraint: TopologyConstraint,
) -> Option<Vec<u32>> {
    let mut best: Option<(SetCost, Vec<u32>)> = None;
    for &anchor in free {
        let mut order: Vec<u32> = free.iter().copied().filter(|&o| o != anchor).collect();
        order.sort_by_key(|&o| (pair_cost(link(anchor, o)), o));
        let mut set = vec![anchor];
        for o in order {
            if set.len() == n {
                break;
            }
            if set.iter().all(|&u| constraint.admits(link(u, o))) {
                set.push(o);
            }
        }
        if set.len() < n {
            continue;
        }
        set.sort_unstable();
        let cost = set_cost(&set, link);
        if best.as_ref().is_none_or(|(c, _)| cost < *c) {
            best = Some((cost, set));
        }
    }
    best.map(|(_, s)| s)
}

/// Every set of `n` of the free GPUs; the best one meeting `constraint`.
fn best_set_exhaustive(
    free: &[u32],
    n: usize,
    link: &dyn Fn(u32, u32) -> GpuLink,
    constraint: TopologyConstraint,
) -> Option<Vec<u32>> {
    let mut best: Option<(SetCost, Vec<u32>)> = None;
    let mut idx: Vec<usize> = (0..n).collect();
    loop {
        let set: Vec<u32> = idx.iter().map(|&i| free[i]).collect();
        if meets(&set, link, constraint) {
            let cost = set_cost(&set, link);
            if best.as_ref().is_none_or(|(c, _)| cost < *c) {
                best = Some((cost, set));
            }
        }
        // Next combination in lexicographic order.
        let Some(pos) = (0..n).rev().find(|&p| idx[p] < free.len() - n + p) else {
            break;
        };
        idx[pos] += 1;
        for q in pos + 1..n {
            idx[q] = idx[q - 1] + 1;
        }
    }
    best.map(|(_, s)| s)
}

/// Whether every pair of `set` meets `constraint`.
pub fn meets(set: &[u32], link: &dyn Fn(u32, u32) -> GpuLink, c: TopologyConstraint) -> bool {
    set.iter()
        .enumerate()
        .all(|(i, &a)| set[i + 1..].iter().all(|&b| c.admits(link(a, b))))
}

/// Choose places for `count` MIG instances of `shape` (a [`Shape::Mig`]) among
/// `gpus`, by topology: the instances fill the anchor GPU first, then the GPUs
/// nearest to it; the anchor with the best connected GPUs wins (then the fewest
/// GPUs, then the lowest index). Each decision is what [`plan`] answers for one
/// GPU, so profile placement rules, the static pool and the strategy hold as for
/// one instance. Refuses when there is not room for all `count` (nothing is
/// placed then), or not within `constraint`.
pub fn plan_migs(
    shape: &Shape,
    count: u32,
    gpus: &[GpuView],
    opts: &PlanOptions,
    link: &dyn Fn(u32, u32) -> GpuLink,
    constraint: TopologyConstraint,
) -> Result<Vec<PlanDecision>, PlanError> {
    let Shape::Mig { profile, .. } = shape else {
        return Err(PlanError::InvalidShape(
            "several partitions in one lease are MIG instances or whole GPUs".into(),
        ));
    };
    if count == 0 || count > 64 {
        return Err(PlanError::InvalidShape(format!(
            "a multi-instance lease takes 1..=64 MIG instances, got {count}"
        )));
    }
    // The shape itself (its profile known here, some room for one): as `plan` says.
    let one = plan(shape, gpus, opts)?;
    if count == 1 {
        return Ok(vec![one]);
    }
    let within = fill_from_anchors(shape, count, gpus, opts, link, constraint);
    if let Some(d) = within {
        return Ok(d);
    }
    let room = max_instances(shape, gpus, opts);
    if constraint != TopologyConstraint::Any
        && fill_from_anchors(shape, count, gpus, opts, link, TopologyConstraint::Any).is_some()
    {
        return Err(PlanError::TopologyUnmet(format!(
            "{count} {profile} instances asked {}: the node has room for {room} now, \
             but not for {count} {}",
            constraint.describe(),
            constraint.describe()
        )));
    }
    Err(PlanError::NoCapacity(format!(
        "{count} {profile} instances asked, room for {room} now"
    )))
}

/// The best fill over every anchor (see [`plan_migs`]); None when no anchor fits
/// all `count`.
fn fill_from_anchors(
    shape: &Shape,
    count: u32,
    gpus: &[GpuView],
    opts: &PlanOptions,
    link: &dyn Fn(u32, u32) -> GpuLink,
    constraint: TopologyConstraint,
) -> Option<Vec<PlanDecision>> {
    let mut indices: Vec<u32> = gpus.iter().map(|g| g.info.index).collect();
    indices.sort_unstable();
    let mut best: Option<((SetCost, usize, u32), Vec<PlanDecision>)> = None;
    for &anchor in &indices {
        let mut order: Vec<u32> = indices.iter().copied().filter(|&o| o != anchor).collect();
        order.sort_by_key(|&o| (pair_cost(link(anchor, o)), o));
        order.insert(0, anchor);
        let mut views = gpus.to_vec();
        let mut used: Vec<u32> = Vec::new();
        let mut decisions = Vec::new();
        for g in order {
            if decisions.len() as u32 == count {
                break;
            }
            if !used.iter().all(|&u| constraint.admits(link(u, g))) {
                continue;
            }
            let on_g = PlanOptions {
                gpu_index: Some(g),
                ..opts.clone()
            };
            while (decisions.len() as u32) < count {
                let Ok(d) = plan(shape, &views, &on_g) else {
                    break;
                };
                take(&mut views, &d);
                decisions.push(d);
                if !used.contains(&g) {
                    used.push(g);
                }
            }
        }
        if decisions.len() as u32 != count {
            continue;
        }
        used.sort_unstable();
        let key = (set_cost(&used, link), used.len(), anchor);
        if best.as_ref().is_none_or(|(k, _)| key < *k) {
            best = Some((key, decisions));
        }
    }
    best.map(|(_, d)| d)
}

/// How many instances of `shape` fit on the node now, one after another.
fn max_instances(shape: &Shape, gpus: &[GpuView], opts: &PlanOptions) -> u32 {
    let mut views = gpus.to_vec();
    let mut n = 0;
    while n < 64 {
        let Ok(d) = plan(shape, &views, opts) else {
            break;
        };
        take(&mut views, &d);
        n += 1;
    }
    n
}

/// A decision applied to the views, as the lease manager's reservation would.
fn take(views: &mut [GpuView], d: &PlanDecision) {
    let gpu = match d {
        PlanDecision::NewMig { gpu, .. }
        | PlanDecision::Static { gpu, .. }
        | PlanDecision::Mps { gpu }
        | PlanDecision::WholeGpu { gpu } => *gpu,
    };
    let Some(v) = views.iter_mut().find(|v| v.info.index == gpu) else {
        return;
    };
    match d {
        PlanDecision::NewMig {
            gi_profile_id,
            placement,
            ..
        } => v.mig.push(OccupiedMig {
            gi_profile_id: *gi_profile_id,
            placement: *placement,
            free_static: None,
        }),
        PlanDecision::Static { partition_id, .. } => {
            for m in v
                .mig
                .iter_mut()
                .filter(|m| m.free_static.as_deref() == Some(partition_id.as_str()))
            {
                m.free_static = None;
            }
        }
        PlanDecision::WholeGpu { .. } => v.whole_leased = true,
        // Not planned here (MIG instances and whole GPUs only).
        PlanDecision::Mps { .. } => {}
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::gpu::SimTopology;
    use crate::partition::test_fixtures::*;
    use proptest::prelude::*;

    fn node(n: u32) -> Vec<GpuView> {
        (0..n).map(h100_plain).collect()
    }

    #[test]
    fn on_an_hgx_board_four_gpus_stay_on_one_numa_node() {
        let t = SimTopology::HgxNvswitch;
        let link = |a, b| t.link(a, b, 8, 18);
        let mut gpus = node(8);
        assert_eq!(plan_gpus(4, &gpus, &link).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(
            plan_gpus(2, &gpus, &link).unwrap(),
            vec![0, 1],
            "one PCIe switch"
        );
        // GPU 1 taken: the other node's four still share a NUMA node.
        view_mut(&mut gpus, 1).whole_leased = true;
        assert_eq!(plan_gpus(4, &gpus, &link).unwrap(), vec![4, 5, 6, 7]);
        let e = plan_gpus(8, &gpus, &link).unwrap_err();
        assert!(
            matches!(&e, PlanError::NoCapacity(m) if m.contains("8 whole GPUs asked, 7 free")),
            "{e:?}"
        );
    }

    #[test]
    fn on_pcie_pairs_two_gpus_are_a_bridged_pair() {
        let t = SimTopology::PciePairs;
        let link = |a, b| t.link(a, b, 4, 0);
        let mut gpus = node(4);
        view_mut(&mut gpus, 0).whole_leased = true;
        // 1 is free but its partner is not: the bridged pair 2-3 wins.
        assert_eq!(plan_gpus(2, &gpus, &link).unwrap(), vec![2, 3]);
    }

    fn one_gpu_link(t: SimTopology) -> impl Fn(u32, u32) -> GpuLink {
        move |a, b| t.link(a, b, 8, 18)
    }

    fn gpus_of(d: &[PlanDecision]) -> Vec<u32> {
        let mut g: Vec<u32> = d
            .iter()
            .map(|d| match d {
                PlanDecision::NewMig { gpu, .. }
                | PlanDecision::Static { gpu, .. }
                | PlanDecision::Mps { gpu }
                | PlanDecision::WholeGpu { gpu } => *gpu,
            })
            .collect();
        g.sort_unstable();
        g.dedup();
        g
    }

    #[test]
    fn mig_instances_fill_one_gpu_then_its_nvlink_partner() {
        let opts = PlanOptions::default();
        let link = one_gpu_link(SimTopology::PciePairs);
        let mut gpus: Vec<GpuView> = (0..4).map(h100_mig).collect();
        // gpu0 holds one 3g already: two more go together on one empty GPU, not
        // split over gpu0 and its partner.
        let occupied = occ(&gpus[0], "3g.40gb", 0);
        view_mut(&mut gpus, 0).mig.push(occupied);
        let d = plan_migs(
            &mig_shape("3g.40gb"),
            2,
            &gpus,
            &opts,
            &link,
            TopologyConstraint::Any,
        )
        .unwrap();
        assert_eq!(gpus_of(&d), vec![1], "two 3g fit on one empty GPU");
        let d = plan_migs(
            &mig_shape("3g.40gb"),
            4,
            &gpus,
            &opts,
            &link,
            TopologyConstraint::Nvlink,
        )
        .unwrap();
        assert_eq!(
            gpus_of(&d),
            vec![2, 3],
            "the bridged pair with room for four"
        );
        // Five 3g: room for 7 on the node, but no NVLink-joined GPUs hold five.
        let e = plan_migs(
            &mig_shape("3g.40gb"),
            5,
            &gpus,
            &opts,
            &link,
            TopologyConstraint::Nvlink,
        )
        .unwrap_err();
        assert!(
            matches!(&e, PlanError::TopologyUnmet(m) if m.contains("room for 7")),
            "{e:?}"
        );
        let d = plan_migs(
            &mig_shape("3g.40gb"),
            5,
            &gpus,
            &opts,
            &link,
            TopologyConstraint::Any,
        )
        .unwrap();
        assert_eq!(d.len(), 5);
        let e = plan_migs(
            &mig_shape("3g.40gb"),
            8,
            &gpus,
            &opts,
            &link,
            TopologyConstraint::Any,
        )
        .unwrap_err();
        assert!(
            matches!(&e, PlanError::NoCapacity(m) if m.contains("8 3g.40gb instances asked, room for 7")),
            "{e:?}"
        );
    }

    #[test]
    fn whole_gpus_within_a_numa_node_or_refused_naming_why() {
        let link = one_gpu_link(SimTopology::HgxNvswitch);
        let mut gpus = node(8);
        for i in [0, 1, 4] {
            view_mut(&mut gpus, i).whole_leased = true;
        }
        // 2,3 on node 0 and 5,6,7 on node 1: four need both nodes.
        let e = plan_gpus_within(4, &gpus, &link, TopologyConstraint::Numa).unwrap_err();
        assert!(
            matches!(&e, PlanError::TopologyUnmet(m) if m.contains("on one NUMA node")),
            "{e:?}"
        );
        let set = plan_gpus_within(4, &gpus, &link, TopologyConstraint::Nvlink).unwrap();
        assert_eq!(set.len(), 4, "every HGX pair has NVLink");
        assert_eq!(
            plan_gpus_within(3, &gpus, &link, TopologyConstraint::Numa).unwrap(),
            vec![5, 6, 7]
        );
        let pcie = one_gpu_link(SimTopology::Pcie);
        let e = plan_gpus_within(2, &gpus, &pcie, TopologyConstraint::Nvlink).unwrap_err();
        assert!(matches!(e, PlanError::TopologyUnmet(_)), "{e:?}");
    }

    #[test]
    fn a_large_node_is_planned_from_anchors_and_still_meets_the_constraint() {
        assert_eq!(combinations(8, 4), 70);
        assert_eq!(combinations(64, 32), u64::MAX, "saturates past the limit");
        let t = SimTopology::HgxNvswitch;
        let link = |a, b| t.link(a, b, 64, 18);
        let gpus = node(64);
        let set = plan_gpus_within(32, &gpus, &link, TopologyConstraint::Any).unwrap();
        assert_eq!(set.len(), 32);
        // NUMA nodes of four on this board: 32 on one node cannot be.
        let e = plan_gpus_within(32, &gpus, &link, TopologyConstraint::Numa).unwrap_err();
        assert!(matches!(e, PlanError::TopologyUnmet(_)), "{e:?}");
        let four = plan_gpus_within(4, &gpus, &link, TopologyConstraint::Numa).unwrap();
        assert!(meets(&four, &link, TopologyConstraint::Numa), "{four:?}");
    }

    /// Random occupancy of 8 MIG GPUs: some instances of random profiles.
    fn occupied_node(seed: &[(u32, usize)]) -> Vec<GpuView> {
        let names = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"];
        let mut gpus: Vec<GpuView> = (0..8).map(h100_mig).collect();
        for &(gpu, which) in seed {
            let opts = PlanOptions {
                gpu_index: Some(gpu % 8),
                ..PlanOptions::default()
            };
            let shape = mig_shape(names[which % names.len()]);
            if let Ok(d) = plan(&shape, &gpus, &opts) {
                take(&mut gpus, &d);
            }
        }
        gpus
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// N MIG instances of one profile: all placed or none; no overlap and the
        /// profile's placement rules and counts on every GPU; every pair of GPUs
        /// used meets the constraint; as few GPUs as one when one can hold them
        /// all; NVLink-joined whenever such a placement exists; a refusal names
        /// the right reason.
        #[test]
        fn n_mig_instances_are_valid_constrained_and_compact(
            seed in proptest::collection::vec((0u32..8, 0usize..5), 0..20),
            count in 1u32..=8,
            which in 0usize..4,
            board in 0usize..3,
            constraint in 0usize..3,
        ) {
            let t = [SimTopology::HgxNvswitch, SimTopology::PciePairs, SimTopology::Pcie][board];
            let c = [TopologyConstraint::Any, TopologyConstraint::Numa, TopologyConstraint::Nvlink][constraint];
            let link = one_gpu_link(t);
            let gpus = occupied_node(&seed);
            let shape = mig_shape(["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb"][which]);
            let opts = PlanOptions::default();
            match plan_migs(&shape, count, &gpus, &opts, &link, c) {
                Ok(d) => {
                    prop_assert_eq!(d.len(), count as usize);
                    let mut after = gpus.clone();
                    for x in &d {
                        prop_assert!(matches!(x, PlanDecision::NewMig { .. }), "{x:?}");
                        take(&mut after, x);
                    }
                    for g in &after {
                        for (a, m) in g.mig.iter().enumerate() {
                            let p = profile(&g.profiles, m.gi_profile_id);
                            prop_assert!(p.placements.contains(&m.placement));
                            for n in &g.mig[a + 1..] {
                                prop_assert!(!m.placement.overlaps(&n.placement), "{m:?} {n:?}");
                            }
                        }
                        for p in &g.profiles {
                            let n = g.mig.iter().filter(|m| m.gi_profile_id == p.id).count();
                            prop_assert!(n <= p.max_count as usize);
                        }
                    }
                    let used = gpus_of(&d);
                    prop_assert!(meets(&used, &link, c), "{used:?} breaks {c:?}");
                    let one_holds_all = (0..8).any(|g| {
                        let on = PlanOptions { gpu_index: Some(g), ..PlanOptions::default() };
                        max_instances(&shape, &gpus, &on) >= count
                    });
                    if one_holds_all {
                        prop_assert_eq!(used.len(), 1, "{:?} when one GPU holds all", used);
                    }
                    if c == TopologyConstraint::Any
                        && plan_migs(&shape, count, &gpus, &opts, &link, TopologyConstraint::Nvlink).is_ok()
                    {
                        prop_assert!(meets(&used, &link, TopologyConstraint::Nvlink), "{used:?} without NVLink");
                    }
                }
                Err(PlanError::NoCapacity(_)) => {
                    prop_assert!(max_instances(&shape, &gpus, &opts) < count);
                }
                Err(PlanError::TopologyUnmet(_)) => {
                    prop_assert!(c != TopologyConstraint::Any);
                    prop_assert!(plan_migs(&shape, count, &gpus, &opts, &link, TopologyConstraint::Any).is_ok());
                }
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// The chosen set is `count` distinct free GPUs, no other free set has a
        /// better worst pair (an NVLink-connected set is chosen whenever one exists,
        /// and a set within one NUMA node whenever one with the same links exists).
        #[test]
        fn the_chosen_set_is_free_and_best_connected(
            taken in proptest::collection::vec(any::<bool>(), 8),
            count in 1u32..=8,
            board in 0usize..3,
        ) {
            let t = [SimTopology::HgxNvswitch, SimTopology::PciePairs, SimTopology::Pcie][board];
            let link = |a, b| t.link(a, b, 8, 18);
            let mut gpus = node(8);
            for (i, &x) in taken.iter().enumerate() {
                view_mut(&mut gpus, u32::try_from(i).unwrap()).whole_leased = x;
            }
            let free: Vec<u32> = (0..8).filter(|&i| !taken[i as usize]).collect();
            match plan_gpus(count, &gpus, &link) {
                Ok(set) => {
                    prop_assert_eq!(set.len(), count as usize);
                    let mut s = set.clone();
                    s.dedup();
                    prop_assert_eq!(s.len(), set.len());
                    prop_assert!(set.iter().all(|i| free.contains(i)));
                    let (worst, _) = set_cost(&set, &link);
                    // Brute force over every free set of that size.
                    let n = free.len();
                    for mask in 0u32..(1 << n) {
                        if mask.count_ones() != count {
                            continue;
                        }
                        let other: Vec<u32> = (0..n).filter(|b| mask & (1 << b) != 0).map(|b| free[b]).collect();
                        prop_assert!(set_cost(&other, &link).0 >= worst, "{other:?} beats {set:?}");
                    }
                    let numa = |s: &[u32]| s.iter().map(|&i| t.numa_node(i, 8)).min() == s.iter().map(|&i| t.numa_node(i, 8)).max();
                    let one_numa_exists = (0..2).any(|node| {
                        free.iter().filter(|&&i| t.numa_node(i, 8) == node).count() >= count as usize
                    });
                    if one_numa_exists {
                        prop_assert!(numa(&set), "{set:?} crosses NUMA nodes");
                    }
                }
                Err(PlanError::NoCapacity(_)) => prop_assert!(free.len() < count as usize),
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            }
        }

        /// N whole GPUs within a constraint: every pair meets it, or the refusal
        /// says the constraint (not capacity) is why, and then no set meets it.
        #[test]
        fn whole_gpus_meet_the_constraint_or_none_can(
            taken in proptest::collection::vec(any::<bool>(), 8),
            count in 1u32..=8,
            board in 0usize..3,
            constraint in 1usize..3,
        ) {
            let t = [SimTopology::HgxNvswitch, SimTopology::PciePairs, SimTopology::Pcie][board];
            let c = [TopologyConstraint::Any, TopologyConstraint::Numa, TopologyConstraint::Nvlink][constraint];
            let link = |a, b| t.link(a, b, 8, 18);
            let mut gpus = node(8);
            for (i, &x) in taken.iter().enumerate() {
                view_mut(&mut gpus, u32::try_from(i).unwrap()).whole_leased = x;
            }
            let free: Vec<u32> = (0..8).filter(|&i| !taken[i as usize]).collect();
            let any_meets = |n: usize| (0u32..(1 << free.len())).any(|mask| {
                mask.count_ones() as usize == n && {
                    let s: Vec<u32> = (0..free.len()).filter(|b| mask & (1 << b) != 0).map(|b| free[b]).collect();
                    meets(&s, &link, c)
                }
            });
            match plan_gpus_within(count, &gpus, &link, c) {
                Ok(set) => {
                    prop_assert_eq!(set.len(), count as usize);
                    prop_assert!(meets(&set, &link, c));
                }
                Err(PlanError::TopologyUnmet(_)) => {
                    prop_assert!(free.len() >= count as usize);
                    prop_assert!(!any_meets(count as usize));
                }
                Err(PlanError::NoCapacity(_)) => prop_assert!(free.len() < count as usize),
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            }
        }
    }
}
