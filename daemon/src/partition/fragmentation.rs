//! Free-capacity and fragmentation measures over one GPU's MIG layout.
//!
//! All functions here are pure and look only at a [`GpuView`] (or at a GI profile and the
//! list of instances present). Placements are intervals of memory slices; two instances
//! conflict exactly when their placements overlap, whatever their profiles (so a
//! `1g.10gb+me` and a `1g.10gb` on the same slice conflict like any other pair).
//!
//! * [`creatable_count`] — how many *new* instances of one profile could be created now,
//!   together, on top of what exists: the largest set of mutually non-overlapping free
//!   placements of that profile (interval scheduling by earliest end, which is optimal
//!   for intervals), capped by `max_count` minus the instances of that profile already
//!   present (free static ones included).
//! * [`free_capacity`] — that count for every GI profile of a GPU, each profile on its
//!   own (the counts of different profiles are alternatives, not a combination that fits
//!   at the same time).
//! * [`capacity_value`] — the best-fit planner's measure of how useful a layout's free
//!   space still is (see the planner's module doc).

use crate::gpu::{GiProfile, Placement};

use super::view::{GpuView, OccupiedMig};

/// Number of instances of GI profile `profile_id` present (leased, pending or free static).
pub fn instance_count(mig: &[OccupiedMig], profile_id: u32) -> u32 {
    let n = mig.iter().filter(|m| m.gi_profile_id == profile_id).count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// True when `placement` overlaps none of the instances present.
pub fn placement_is_free(mig: &[OccupiedMig], placement: &Placement) -> bool {
    mig.iter().all(|m| !m.placement.overlaps(placement))
}

/// True when `profile` allows one more instance (its `max_count` is not reached yet).
pub fn below_max_count(mig: &[OccupiedMig], profile: &GiProfile) -> bool {
    instance_count(mig, profile.id) < profile.max_count
}

/// The placements of `profile` that overlap no present instance, in the order the
/// profile lists them. Ignores `max_count` (see [`below_max_count`]).
pub fn free_placements(profile: &GiProfile, mig: &[OccupiedMig]) -> Vec<Placement> {
    profile
        .placements
        .iter()
        .filter(|p| placement_is_free(mig, p))
        .copied()
        .collect()
}

/// How many new instances of `profile` could be created now *as a set* on top of `mig`:
/// the maximum number of pairwise non-overlapping free placements, capped by the
/// profile's remaining `max_count`.
pub fn creatable_count(profile: &GiProfile, mig: &[OccupiedMig]) -> u32 {
    let remaining = profile
        .max_count
        .saturating_sub(instance_count(mig, profile.id));
    if remaining == 0 {
        return 0;
    }
    let mut free = free_placements(profile, mig);
    // Earliest end first maximises the number of disjoint intervals chosen greedily.
    free.sort_by_key(|p| (p.end(), p.start));
    let mut chosen = 0u32;
    let mut last_end: Option<u32> = None;
    for p in free {
        if last_end.is_none_or(|end| p.start >= end) {
            chosen += 1;
            last_end = Some(p.end());
            if chosen == remaining {
                break;
            }
        }
    }
    chosen
}

/// For every GI profile of the GPU (in the order the view lists them): how many more
/// instances of that profile alone could be created right now, respecting overlaps with
/// every present instance (free static ones included, since they hold their slices) and
/// the profile's `max_count`. See [`creatable_count`]. The counts are per profile, not a
/// combination: "3 of 2g.20gb or 1 of 4g.40gb", never "3 and 1".
///
/// A GPU with MIG disabled, or held by a whole-GPU lease, has no creatable instances:
/// every profile it lists gets 0.
pub fn free_capacity(view: &GpuView) -> Vec<(u32, u32)> {
    let usable = view.info.mig_current && !view.whole_leased;
    view.profiles
        .iter()
        .map(|p| {
            let n = if usable {
                creatable_count(p, &view.mig)
            } else {
                0
            };
            (p.id, n)
        })
        .collect()
}

/// Number of distinct memory slices covered by the MIG instances present on the GPU
/// (leased, pending and free static ones alike).
pub fn used_memory_slices(view: &GpuView) -> u32 {
    union_len(view.mig.iter().map(|m| m.placement))
}

/// Number of memory slices of the GPU: the highest slice any profile placement or
/// present instance reaches (8 on A100/H100/H200; 0 when MIG is off and nothing is
/// known).
pub fn total_memory_slices(view: &GpuView) -> u32 {
    let from_profiles = view
        .profiles
        .iter()
        .flat_map(|p| p.placements.iter())
        .map(Placement::end);
    let from_instances = view.mig.iter().map(|m| m.placement.end());
    from_profiles.chain(from_instances).max().unwrap_or(0)
}

/// Per GI profile of the GPU (in the order the view lists them): how many free
/// static-pool instances of it a lease could take now.
pub fn free_static_counts(view: &GpuView) -> Vec<(u32, u32)> {
    view.profiles
        .iter()
        .map(|p| {
            let n = view
                .mig
                .iter()
                .filter(|m| m.gi_profile_id == p.id && m.free_static.is_some())
                .count();
            (p.id, u32::try_from(n).unwrap_or(u32::MAX))
        })
        .collect()
}

/// How useful the free space of a layout still is: the sum over all GI profiles `q` of
/// `memory_slices(q)^2 * creatable_count(q)`.
///
/// Each profile contributes the free memory it could still turn into instances of its
/// own size (`memory_slices * count`), weighted once more by its size, so that keeping a
/// place for one large instance counts for more than keeping places for small ones that
/// can go almost anywhere. The best-fit planner picks the placement that lowers this
/// value the least.
pub fn capacity_value(profiles: &[GiProfile], mig: &[OccupiedMig]) -> u64 {
    profiles
        .iter()
        .map(|q| {
            let size = u64::from(q.memory_slices);
            size * size * u64::from(creatable_count(q, mig))
        })
        .sum()
}

/// Length of the union of a set of intervals.
fn union_len(placements: impl Iterator<Item = Placement>) -> u32 {
    let mut v: Vec<Placement> = placements.collect();
    v.sort();
    let mut total = 0u32;
    let mut cur: Option<(u32, u32)> = None;
    for p in v {
        match cur {
            Some((s, e)) if p.start <= e => cur = Some((s, e.max(p.end()))),
            Some((s, e)) => {
                total += e - s;
                cur = Some((p.start, p.end()));
            }
            None => cur = Some((p.start, p.end())),
        }
    }
    if let Some((s, e)) = cur {
        total += e - s;
    }
    total
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::partition::test_fixtures::*;

    fn cap(view: &GpuView, name: &str) -> u32 {
        let id = profile_id(&view.profiles, name);
        free_capacity(view)
            .into_iter()
            .find(|(p, _)| *p == id)
            .map(|(_, n)| n)
            .unwrap()
    }

    #[test]
    fn empty_h100_capacity_matches_the_reference_table() {
        let v = h100_mig(0);
        assert_eq!(cap(&v, "1g.10gb"), 7);
        assert_eq!(cap(&v, "1g.10gb+me"), 1);
        assert_eq!(cap(&v, "1g.20gb"), 4);
        assert_eq!(cap(&v, "2g.20gb"), 3);
        assert_eq!(cap(&v, "3g.40gb"), 2);
        assert_eq!(cap(&v, "4g.40gb"), 1);
        assert_eq!(cap(&v, "7g.80gb"), 1);
        assert_eq!(used_memory_slices(&v), 0);
        assert_eq!(total_memory_slices(&v), 8);
    }

    #[test]
    fn capacity_respects_overlaps_and_counts_a_set() {
        let mut v = h100_mig(0);
        // 1g at slice 6 and 2g at 0: 3g@4 and 3g@0 are both blocked, 4g too.
        v.mig.push(occ(&v, "1g.10gb", 6));
        v.mig.push(occ(&v, "2g.20gb", 0));
        assert_eq!(cap(&v, "3g.40gb"), 0);
        assert_eq!(cap(&v, "4g.40gb"), 0);
        assert_eq!(cap(&v, "7g.80gb"), 0);
        // 2g at 2 and 4 are free: two of them together.
        assert_eq!(cap(&v, "2g.20gb"), 2);
        // free 1g slices: 2,3,4,5 (7 is not a 1g placement).
        assert_eq!(cap(&v, "1g.10gb"), 4);
        assert_eq!(cap(&v, "1g.20gb"), 2);
        assert_eq!(used_memory_slices(&v), 3);
    }

    #[test]
    fn capacity_respects_max_count() {
        let mut v = h100_mig(0);
        v.mig.push(occ(&v, "1g.10gb+me", 0));
        assert_eq!(cap(&v, "1g.10gb+me"), 0, "max one +me instance");
        // +me shares slices with 1g: slice 0 is gone for 1g.
        assert_eq!(cap(&v, "1g.10gb"), 6);
        for s in [1, 2, 3, 4, 5] {
            v.mig.push(occ(&v, "1g.10gb", s));
        }
        // Slice 6 is free, and 5 of max 7 1g exist: 1 more.
        assert_eq!(cap(&v, "1g.10gb"), 1);
        let mut w = h100_mig(0);
        for s in 0..7 {
            w.mig.push(occ(&w, "1g.10gb", s));
        }
        assert_eq!(cap(&w, "1g.10gb"), 0);
        assert_eq!(used_memory_slices(&w), 7);
    }

    #[test]
    fn free_static_instances_hold_their_slices() {
        let mut v = h100_mig(0);
        let mut s = occ(&v, "3g.40gb", 0);
        s.free_static = Some("p-1".into());
        v.mig.push(s);
        assert_eq!(cap(&v, "3g.40gb"), 1);
        assert_eq!(cap(&v, "4g.40gb"), 0);
        assert_eq!(used_memory_slices(&v), 4);
        let id = profile_id(&v.profiles, "3g.40gb");
        assert!(free_static_counts(&v).contains(&(id, 1)));
    }

    #[test]
    fn mig_disabled_or_whole_leased_gpu_has_no_capacity() {
        let mut v = h100_mig(0);
        v.info.mig_current = false;
        assert!(free_capacity(&v).iter().all(|(_, n)| *n == 0));
        let mut w = h100_mig(1);
        w.whole_leased = true;
        assert!(free_capacity(&w).iter().all(|(_, n)| *n == 0));
        assert!(free_capacity(&h100_plain(2)).is_empty());
    }

    #[test]
    fn union_len_merges_overlaps() {
        let p = |start, size| Placement { start, size };
        assert_eq!(union_len([p(0, 4), p(2, 4), p(7, 1)].into_iter()), 7);
        assert_eq!(union_len(std::iter::empty()), 0);
    }
}
