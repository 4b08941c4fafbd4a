//! Several whole GPUs for one job, placed by topology: the set of free GPUs whose
//! worst-connected pair is best (NVLink before PCIe; then one PCIe switch, one host
//! bridge, one NUMA node before crossing the CPUs' interconnect), ties broken by the
//! sum over all pairs, then by the lowest indices.
//!
//! Pure: the links come from the caller (the backend's topology query).

use super::GpuView;
use super::planner::PlanError;
use crate::gpu::{GpuLink, TopologyLevel};

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
    let mut best: Option<(SetCost, Vec<u32>)> = None;
    let mut idx: Vec<usize> = (0..n).collect();
    loop {
        let set: Vec<u32> = idx.iter().map(|&i| free[i]).collect();
        let cost = set_cost(&set, link);
        if best.as_ref().is_none_or(|(c, _)| cost < *c) {
            best = Some((cost, set));
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
        .ok_or_else(|| PlanError::NoCapacity(format!("{count} whole GPUs asked")))
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
    }
}
