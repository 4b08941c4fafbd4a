//! Reservations for MIG requests that wait in the trace model's admission queue (its
//! "queue-reserve" policy, one region per waiting request; the daemon's own regions,
//! held for refused large profiles, are `tesserad::partition::reservation`).
//!
//! A request the planner refuses may wait for room. While it waits, one (GPU,
//! placement) is *reserved* for it: the region whose present instances are the least to wait for (fewest memory
//! slices held by instances that cannot move, then fewest slices in all, then the
//! lower GPU and start). No new instance may overlap a reserved region, so leases
//! ending there bring the waiting request closer to fitting instead of being taken by
//! newer, smaller requests; those go elsewhere when they fit there (backfilling that
//! does not delay the waiting request). [`hold`] makes the planner see reservations as
//! present instances that never move.

use tesserad::gpu::Placement;
use tesserad::partition::fragmentation::instance_count;
use tesserad::partition::{GpuView, Movable};

/// A region held for a waiting request of GI profile `gi_profile_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    pub gpu: u32,
    pub gi_profile_id: u32,
    pub placement: Placement,
}

/// Where a waiting request of GI profile `profile` (a name, any case) should be served:
/// see the module doc. `held` are the reservations of requests that wait longer (never
/// overlapped); `movable` are the instances that could be moved away. None when no
/// MIG-enabled GPU offers the profile or every region is taken by `held` or by
/// `max_count`.
pub fn reserve(
    profile: &str,
    gpus: &[GpuView],
    movable: &[Movable],
    held: &[Reservation],
) -> Option<Reservation> {
    // (slices that must end, slices in the region, gpu, start)
    let mut best: Option<((u32, u32, u32, u32), Reservation)> = None;
    for g in gpus {
        if !g.info.mig_current || g.whole_leased {
            continue;
        }
        let Some(gp) = g.gi_profile(profile) else {
            continue;
        };
        let held_here: Vec<&Reservation> = held.iter().filter(|r| r.gpu == g.info.index).collect();
        for placement in &gp.placements {
            if held_here.iter().any(|r| r.placement.overlaps(placement)) {
                continue;
            }
            // Instances of the profile that stay, plus regions already held for it.
            let staying = instance_count(&g.mig, gp.id)
                - u32::try_from(
                    g.mig
                        .iter()
                        .filter(|m| m.gi_profile_id == gp.id && m.placement.overlaps(placement))
                        .count(),
                )
                .unwrap_or(0);
            let held_same = u32::try_from(
                held_here
                    .iter()
                    .filter(|r| r.gi_profile_id == gp.id)
                    .count(),
            )
            .unwrap_or(u32::MAX);
            if staying.saturating_add(held_same) >= gp.max_count {
                continue;
            }
            let mut busy = 0u32;
            let mut all = 0u32;
            for m in g.mig.iter().filter(|m| m.placement.overlaps(placement)) {
                all += m.placement.size;
                let moves = m.free_static.is_none()
                    && movable
                        .iter()
                        .any(|v| v.gpu == g.info.index && v.placement == m.placement);
                if !moves {
                    busy += m.placement.size;
                }
            }
            let key = (busy, all, g.info.index, placement.start);
            if best.as_ref().is_none_or(|(k, _)| key < *k) {
                best = Some((
                    key,
                    Reservation {
                        gpu: g.info.index,
                        gi_profile_id: gp.id,
                        placement: *placement,
                    },
                ));
            }
        }
    }
    best.map(|(_, r)| r)
}

/// The reservations of the requests that wait, oldest first, each chosen with the
/// older ones held (see [`reserve`]).
pub fn reserve_all<'a>(
    waiting: impl IntoIterator<Item = &'a str>,
    gpus: &[GpuView],
    movable: &[Movable],
) -> Vec<Reservation> {
    let mut held = Vec::new();
    for profile in waiting {
        if let Some(r) = reserve(profile, gpus, movable, &held) {
            held.push(r);
        }
    }
    held
}

/// `gpus` with every reservation present as an instance (never free, never movable):
/// what the planner must see when it places anything but the waiting requests.
pub fn hold(gpus: &[GpuView], held: &[Reservation]) -> Vec<GpuView> {
    let mut out = gpus.to_vec();
    for r in held {
        if let Some(g) = out.iter_mut().find(|g| g.info.index == r.gpu) {
            g.hold_region(r.gi_profile_id, r.placement);
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tesserad::gpu::profiles::GpuModel;
    use tesserad::gpu::{GiProfile, GpuInfo};
    use tesserad::partition::OccupiedMig;
    use tesserad::partition::{
        MovePlan, PlanDecision, PlanOptions, Shape, Strategy, plan, plan_with_moves,
    };

    /// An empty H100-80GB with MIG on.
    fn h100_mig(index: u32) -> GpuView {
        let m = GpuModel::H100Hbm3_80Gb;
        GpuView {
            info: GpuInfo {
                index,
                uuid: format!("GPU-reserve-{index}"),
                name: m.marketing_name().to_string(),
                memory_bytes: m.memory_bytes(),
                minor: index,
                pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + index),
                mig_current: true,
                mig_pending: true,
                sm_count: m.sm_count(),
                fault: None,
            },
            profiles: m.gi_profiles(),
            mig: Vec::new(),
            mps: Default::default(),
            whole_leased: false,
        }
    }

    /// A leased instance of profile `name` at memory slice `start` of `view`'s GPU.
    fn occ(view: &GpuView, name: &str, start: u32) -> OccupiedMig {
        let p = view.profiles.iter().find(|p| p.name == name).unwrap();
        OccupiedMig {
            gi_profile_id: p.id,
            placement: Placement {
                start,
                size: p.memory_slices,
            },
            free_static: None,
        }
    }

    fn mig_shape(profile: &str) -> Shape {
        Shape::Mig {
            profile: profile.to_string(),
            compute_profile: None,
        }
    }

    fn view_mut(gpus: &mut [GpuView], index: u32) -> &mut GpuView {
        gpus.iter_mut().find(|g| g.info.index == index).unwrap()
    }

    fn profile(profiles: &[GiProfile], id: u32) -> &GiProfile {
        profiles.iter().find(|p| p.id == id).unwrap()
    }

    /// A new instance the planner decided, as the lease core would add it.
    fn apply(gpus: &mut [GpuView], decision: &PlanDecision) {
        if let PlanDecision::NewMig {
            gpu,
            gi_profile_id,
            placement,
            ..
        } = decision
        {
            view_mut(gpus, *gpu).mig.push(OccupiedMig {
                gi_profile_id: *gi_profile_id,
                placement: *placement,
                free_static: None,
            });
        }
    }

    const NAMES: [&str; 7] = [
        "1g.10gb",
        "1g.10gb+me",
        "1g.20gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    ];

    fn options(best_fit: bool) -> PlanOptions {
        PlanOptions {
            strategy: if best_fit {
                Strategy::BestFit
            } else {
                Strategy::FirstFit
            },
            ..PlanOptions::default()
        }
    }

    #[test]
    fn a_7g_waits_for_the_gpu_with_the_least_to_end() {
        // gpu0: a busy 3g and a busy 1g; gpu1: one busy 1g and an idle 2g; gpu2: two busy 2g.
        let mut gpus = vec![h100_mig(0), h100_mig(1), h100_mig(2)];
        let a = occ(&gpus[0], "3g.40gb", 4);
        let b = occ(&gpus[0], "1g.10gb", 0);
        gpus[0].mig = vec![a, b];
        let c = occ(&gpus[1], "1g.10gb", 6);
        let d = occ(&gpus[1], "2g.20gb", 0);
        gpus[1].mig = vec![c, d.clone()];
        let e = occ(&gpus[2], "2g.20gb", 0);
        let f = occ(&gpus[2], "2g.20gb", 2);
        gpus[2].mig = vec![e, f];
        let idle = [Movable {
            gpu: 1,
            placement: d.placement,
        }];
        let r = reserve("7g.80gb", &gpus, &idle, &[]).unwrap();
        assert_eq!((r.gpu, r.placement.start, r.placement.size), (1, 0, 8));
        // With nothing idle, busy slices are gpu0 5, gpu1 3, gpu2 4: still gpu1.
        let r2 = reserve("7g.80gb", &gpus, &[], &[]).unwrap();
        assert_eq!(r2.gpu, 1);
        // A second waiting 7g takes another GPU: two 7g never share one.
        let r3 = reserve("7g.80gb", &gpus, &idle, &[r]).unwrap();
        assert_ne!(r3.gpu, 1);
    }

    #[test]
    fn nothing_new_goes_into_a_held_region_but_it_may_go_beside_it() {
        // gpu0 holds one busy 1g at slice 0 and is reserved for a 4g at 0..4; gpu1 is full
        // but for slice 6.
        let mut gpus = vec![h100_mig(0), h100_mig(1)];
        let one = occ(&gpus[0], "1g.10gb", 0);
        gpus[0].mig = vec![one];
        let full: Vec<_> = [0, 2, 4]
            .iter()
            .map(|s| occ(&gpus[1], "2g.20gb", *s))
            .collect();
        gpus[1].mig = full;
        let r = reserve("4g.40gb", &gpus, &[], &[]).unwrap();
        assert_eq!((r.gpu, r.placement.start), (0, 0));
        let mut held = hold(&gpus, &[r]);
        // 1g instances go beside the region (gpu0 slices 4, 5, 6 and gpu1 slice 6), never
        // into it; a fifth is refused although the region has three free slices.
        let shape = mig_shape("1g.10gb");
        for _ in 0..4 {
            let d = plan(&shape, &held, &PlanOptions::default()).unwrap();
            let PlanDecision::NewMig { gpu, placement, .. } = d else {
                panic!("{d:?}");
            };
            assert!(
                !(gpu == 0 && placement.overlaps(&r.placement)),
                "{placement:?}"
            );
            apply(&mut held, &d);
        }
        assert!(plan(&shape, &held, &PlanOptions::default()).is_err());
        // A 4g would only fit in the held region: refused while the request waits.
        assert!(plan(&mig_shape("4g.40gb"), &held, &PlanOptions::default()).is_err());
        // Once the 1g ends, the waiting 4g fits exactly there.
        gpus[0].mig.clear();
        let d = plan(&mig_shape("4g.40gb"), &gpus, &PlanOptions::default()).unwrap();
        assert!(
            matches!(d, PlanDecision::NewMig { gpu: 0, placement, .. } if placement == r.placement)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

    /// Reservations of waiting requests never overlap one another on a GPU, never go
    /// past a profile's `max_count` (instances that stay plus regions held), and with
    /// them held the planner (moves included) puts nothing, new or moved, into any.
    #[test]
    fn nothing_is_placed_into_a_region_held_for_a_waiting_request(
        layout in prop::collection::vec((0usize..7, any::<bool>()), 0..30),
        waiting in prop::collection::vec(0usize..7, 1..6),
        asks in prop::collection::vec((0usize..7, any::<bool>()), 1..20),
    ) {
        let mut gpus = vec![h100_mig(0), h100_mig(1), h100_mig(2)];
        let mut movable: Vec<Movable> = Vec::new();
        for (n, idle) in layout {
            let shape = mig_shape(NAMES[n]);
            if let Ok(d @ PlanDecision::NewMig { gpu, placement, .. }) =
                plan(&shape, &gpus, &options(true))
            {
                apply(&mut gpus, &d);
                if idle {
                    movable.push(Movable { gpu, placement });
                }
            }
        }
        let held = reserve_all(waiting.iter().map(|&n| NAMES[n]), &gpus, &movable);
        for (i, a) in held.iter().enumerate() {
            for b in &held[i + 1..] {
                prop_assert!(!(a.gpu == b.gpu && a.placement.overlaps(&b.placement)), "{a:?} {b:?}");
            }
            let g = gpus.iter().find(|g| g.info.index == a.gpu).unwrap();
            let p = profile(&g.profiles, a.gi_profile_id);
            // Once every region's present instances are gone and each is served.
            let staying = g.mig.iter()
                .filter(|m| m.gi_profile_id == p.id)
                .filter(|m| !held.iter().any(|r| r.gpu == a.gpu && r.placement.overlaps(&m.placement)))
                .count();
            let regions = held.iter().filter(|r| r.gpu == a.gpu && r.gi_profile_id == p.id).count();
            prop_assert!(u32::try_from(staying + regions).unwrap() <= p.max_count, "{a:?}");
        }
        let mut view = hold(&gpus, &held);
        for (n, best_fit) in asks {
            let shape = mig_shape(NAMES[n]);
            let Ok(MovePlan { moves, decision }) =
                plan_with_moves(&shape, &view, &options(best_fit), &movable)
            else {
                continue;
            };
            let PlanDecision::NewMig { gpu, placement, gi_profile_id, .. } = decision else {
                return Err(TestCaseError::fail(format!("{decision:?}")));
            };
            for r in &held {
                prop_assert!(!(r.gpu == gpu && r.placement.overlaps(&placement)), "new {placement:?} in {r:?}");
                for m in &moves {
                    prop_assert!(!(r.gpu == m.to_gpu && r.placement.overlaps(&m.to)), "moved {m:?} into {r:?}");
                    prop_assert!(!(r.gpu == m.from_gpu && r.placement == m.from), "moved a reservation {m:?}");
                }
            }
            for m in &moves {
                let src = view_mut(&mut view, m.from_gpu);
                src.mig.retain(|i| i.placement != m.from);
                view_mut(&mut view, m.to_gpu).mig.push(OccupiedMig {
                    gi_profile_id: m.gi_profile_id, placement: m.to, free_static: None,
                });
                movable.retain(|v| !(v.gpu == m.from_gpu && v.placement == m.from));
            }
            view_mut(&mut view, gpu).mig.push(OccupiedMig { gi_profile_id, placement, free_static: None });
        }
    }
    }
}
