//! Reservations: regions held for large MIG requests refused for fragmentation, so
//! that small leases cannot starve them.
//!
//! Best fit keeps small instances together, but with leases that run work (which never
//! move) a GPU rarely empties while small requests keep arriving: a `7g.80gb` (or a
//! `4g.40gb`, whose only placement is the first half) can wait forever. When a request
//! of a profile of at least [`ReserveOptions::min_slices`] memory slices is refused
//! for lack of room, [`Reservations::refused`] *holds* one region (a GPU and one of
//! the profile's placements) for that profile: the one with the least to wait for
//! (the earliest time by which every instance in it has expired, then the fewest
//! memory slices in use, then the lower GPU and start). While it is held, no new
//! instance of another profile goes into it ([`Reservations::view`] shows it to them
//! as present); small requests go elsewhere when they fit elsewhere, and are refused
//! when only held regions are left. The instances in the region end in their time
//! and the next request of the profile takes the region.
//!
//! A reservation ends when a request of its profile is placed into it, when its
//! region has been free for [`ReserveOptions::grace`] without one coming (the caller
//! went away), or at the latest [`ReserveOptions::max_hold`] after it was made.
//!
//! **Aging.** A profile holds one region at first; every [`ReserveOptions::aging`]
//! refusals since it was last served let it hold one more, up to
//! [`ReserveOptions::max_per_profile`]: the longer a profile is starved, the more of
//! the node drains for it, and serving it resets the count.
//!
//! Times are on one clock of the caller's choosing (Unix milliseconds in the daemon,
//! trace ticks in the benchmark). Nothing here is persisted: reservations are soft
//! state, lost (harmlessly) on a restart.

use std::collections::BTreeMap;

use crate::gpu::Placement;

use super::fragmentation::instance_count;
use super::view::{GpuView, OccupiedMig};

/// How reservations are made (`[partition] reserve_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveOptions {
    /// Only profiles of at least this many memory slices are reserved for (4: the
    /// 3g, 4g and 7g of an A100/H100/H200); 0 turns reservations off.
    pub min_slices: u32,
    /// How long a held region that has come free waits for a request of its profile.
    pub grace: u64,
    /// The longest a reservation lasts.
    pub max_hold: u64,
    /// Refusals (since the profile was last served) per extra region it may hold.
    pub aging: u32,
    /// The most regions one profile may hold at once.
    pub max_per_profile: u32,
}

/// The daemon's defaults, in milliseconds (`[partition] reserve_*`).
pub const RESERVE_DEFAULTS_MS: ReserveOptions = ReserveOptions {
    min_slices: 4,
    grace: 18 * 60 * 1000,
    max_hold: 2 * 60 * 60 * 1000,
    aging: 16,
    max_per_profile: 2,
};

impl ReserveOptions {
    pub fn enabled(&self) -> bool {
        self.min_slices > 0 && self.max_per_profile > 0
    }
}

/// A region held for requests of one GI profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub gpu: u32,
    pub gi_profile_id: u32,
    /// The profile's name, lower case.
    pub profile: String,
    pub placement: Placement,
    /// When it was made.
    pub since: u64,
    /// When every instance in the region has expired at the latest (as it was made):
    /// a lease of another profile that expires by then may still go into the region
    /// (backfill), since it cannot delay the region's emptying.
    pub ready_at: u64,
    /// When it ends at the latest.
    pub until: u64,
    /// Since when its region is free (no instance overlaps it).
    pub free_since: Option<u64>,
}

/// When one MIG instance present ends at the latest: (GPU, placement, expiry).
pub type InstanceEnd = (u32, Placement, u64);

/// The regions held now, and how long each profile has been starved.
#[derive(Debug, Clone)]
pub struct Reservations {
    pub opts: ReserveOptions,
    held: Vec<Reservation>,
    /// Per profile (lower case): refusals since a request of it was last placed.
    starved: BTreeMap<String, u32>,
}

impl Reservations {
    pub fn new(opts: ReserveOptions) -> Reservations {
        Reservations {
            opts,
            held: Vec::new(),
            starved: BTreeMap::new(),
        }
    }

    /// The regions held now.
    pub fn held(&self) -> &[Reservation] {
        &self.held
    }

    /// Ends the reservations that are over at `now` on `gpus` (see the module doc);
    /// starts the grace period of those whose region came free.
    pub fn refresh(&mut self, gpus: &[GpuView], now: u64) {
        let grace = self.opts.grace;
        self.held.retain_mut(|r| {
            let Some(g) = gpus.iter().find(|g| g.info.index == r.gpu) else {
                return false;
            };
            if !g.info.mig_current || g.whole_leased {
                return false;
            }
            let free = g.mig.iter().all(|m| !m.placement.overlaps(&r.placement));
            match (free, r.free_since) {
                (true, None) => {
                    r.free_since = Some(now);
                    r.until = r.until.min(now.saturating_add(grace));
                }
                (false, Some(_)) => r.free_since = None,
                _ => {}
            }
            r.until > now
        });
    }

    /// Whether `r` keeps a request of `profile` expiring at `expires_at` out: it is
    /// held for another profile, and the request would not expire before the region
    /// empties ([`Reservation::ready_at`]).
    pub fn keeps_out(r: &Reservation, profile: &str, expires_at: Option<u64>) -> bool {
        !r.profile.eq_ignore_ascii_case(profile) && expires_at.is_none_or(|e| e > r.ready_at)
    }

    /// `gpus` as a request of GI profile `profile` that expires at `expires_at` must
    /// see them: every region that [keeps it out](Reservations::keeps_out) present as
    /// an instance (never free, never movable).
    pub fn view(&self, gpus: &[GpuView], profile: &str, expires_at: Option<u64>) -> Vec<GpuView> {
        let mut out = gpus.to_vec();
        for r in self
            .held
            .iter()
            .filter(|r| Self::keeps_out(r, profile, expires_at))
        {
            if let Some(g) = out.iter_mut().find(|g| g.info.index == r.gpu) {
                g.hold_region(r.gi_profile_id, r.placement);
            }
        }
        out
    }

    /// Whether any region keeps a request of `profile` expiring at `expires_at` out.
    pub fn holds_against(&self, profile: &str, expires_at: Option<u64>) -> bool {
        self.held
            .iter()
            .any(|r| Self::keeps_out(r, profile, expires_at))
    }

    /// A request of `profile` was placed at `placement` of `gpu`: the reservation of
    /// that profile there (if any) is used up, and the profile is no longer starved.
    pub fn granted(&mut self, profile: &str, gpu: u32, placement: Placement) {
        let key = profile.to_ascii_lowercase();
        if let Some(i) = self
            .held
            .iter()
            .position(|r| r.profile == key && r.gpu == gpu && r.placement.overlaps(&placement))
        {
            self.held.remove(i);
        }
        self.starved.remove(&key);
    }

    /// A request of `profile` was refused for lack of room at `now`: hold a region for
    /// it when its size and aging allow one more (see the module doc). `ends` says when
    /// the instances present expire (an instance not listed is taken to stay
    /// [`ReserveOptions::max_hold`] or longer). Returns the new reservation.
    pub fn refused(
        &mut self,
        profile: &str,
        gpus: &[GpuView],
        ends: &[InstanceEnd],
        now: u64,
    ) -> Option<Reservation> {
        if !self.opts.enabled() {
            return None;
        }
        let key = profile.to_ascii_lowercase();
        let slices = gpus
            .iter()
            .filter_map(|g| g.gi_profile(&key))
            .map(|p| p.memory_slices)
            .max()?;
        if slices < self.opts.min_slices {
            return None;
        }
        let starved = self.starved.entry(key.clone()).or_insert(0);
        *starved = starved.saturating_add(1);
        let allowed = (1 + (*starved - 1) / self.opts.aging.max(1)).min(self.opts.max_per_profile);
        let mine = self.held.iter().filter(|r| r.profile == key).count();
        if u32::try_from(mine).unwrap_or(u32::MAX) >= allowed {
            return None;
        }
        let r = self.pick(&key, gpus, ends, now)?;
        self.held.push(r.clone());
        Some(r)
    }

    /// The region to hold for `profile`: see the module doc.
    fn pick(
        &self,
        profile: &str,
        gpus: &[GpuView],
        ends: &[InstanceEnd],
        now: u64,
    ) -> Option<Reservation> {
        let never = now.saturating_add(self.opts.max_hold);
        // (when it is free, slices in use, gpu, start)
        let mut best: Option<((u64, u32, u32, u32), Reservation)> = None;
        for g in gpus {
            if !g.info.mig_current || g.whole_leased {
                continue;
            }
            let Some(gp) = g.gi_profile(profile) else {
                continue;
            };
            let held_here: Vec<&Reservation> =
                self.held.iter().filter(|r| r.gpu == g.info.index).collect();
            for placement in &gp.placements {
                if held_here.iter().any(|r| r.placement.overlaps(placement)) {
                    continue;
                }
                let inside: Vec<&OccupiedMig> = g
                    .mig
                    .iter()
                    .filter(|m| m.placement.overlaps(placement))
                    .collect();
                // A free static-pool instance stays where it is.
                if inside.iter().any(|m| m.free_static.is_some()) {
                    continue;
                }
                // Instances of the profile that stay, and regions held for it here.
                let gone = inside.iter().filter(|m| m.gi_profile_id == gp.id).count();
                let staying = instance_count(&g.mig, gp.id)
                    .saturating_sub(u32::try_from(gone).unwrap_or(u32::MAX));
                let held_same = held_here.iter().filter(|r| r.profile == profile).count();
                if staying.saturating_add(u32::try_from(held_same).unwrap_or(u32::MAX))
                    >= gp.max_count
                {
                    continue;
                }
                let mut free_at = now;
                let mut used = 0u32;
                for m in &inside {
                    used += m.placement.size;
                    let end = ends
                        .iter()
                        .find(|(gpu, p, _)| *gpu == g.info.index && *p == m.placement)
                        .map_or(never, |(_, _, t)| *t);
                    free_at = free_at.max(end);
                }
                let key = (free_at, used, g.info.index, placement.start);
                if best.as_ref().is_none_or(|(k, _)| key < *k) {
                    best = Some((
                        key,
                        Reservation {
                            gpu: g.info.index,
                            gi_profile_id: gp.id,
                            profile: profile.to_string(),
                            placement: *placement,
                            since: now,
                            ready_at: free_at,
                            until: free_at
                                .saturating_add(self.opts.grace)
                                .min(now.saturating_add(self.opts.max_hold)),
                            free_since: None,
                        },
                    ));
                }
            }
        }
        best.map(|(_, r)| r)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::partition::test_fixtures::*;
    use crate::partition::{PlanDecision, PlanOptions, plan};

    fn opts() -> ReserveOptions {
        ReserveOptions {
            min_slices: 4,
            grace: 10,
            max_hold: 1000,
            aging: 2,
            max_per_profile: 2,
        }
    }

    /// gpu0: a 1g at 0 ending at 50 and a 2g at 2 ending at 40; gpu1: a 1g at 6 ending
    /// at 30. Nowhere room for a 7g.
    fn busy() -> (Vec<GpuView>, Vec<InstanceEnd>) {
        let mut gpus = vec![h100_mig(0), h100_mig(1)];
        let a = occ(&gpus[0], "1g.10gb", 0);
        let b = occ(&gpus[0], "2g.20gb", 2);
        let c = occ(&gpus[1], "1g.10gb", 6);
        let ends = vec![
            (0, a.placement, 50),
            (0, b.placement, 40),
            (1, c.placement, 30),
        ];
        gpus[0].mig = vec![a, b];
        gpus[1].mig = vec![c];
        (gpus, ends)
    }

    #[test]
    fn a_refused_7g_holds_the_gpu_that_empties_first_and_small_leases_go_elsewhere() {
        let (mut gpus, ends) = busy();
        let mut r = Reservations::new(opts());
        // Small profiles never hold anything.
        assert!(r.refused("2g.20gb", &gpus, &ends, 0).is_none());
        let held = r.refused("7g.80gb", &gpus, &ends, 0).unwrap();
        assert_eq!((held.gpu, held.placement.start), (1, 0));
        assert_eq!(held.until, 30 + 10);
        // A 1g goes to gpu0 although best fit would join gpu1's 1g otherwise.
        let view = r.view(&gpus, "1g.10gb", None);
        let d = plan(&mig_shape("1g.10gb"), &view, &PlanOptions::default()).unwrap();
        assert!(matches!(d, PlanDecision::NewMig { gpu: 0, .. }), "{d:?}");
        // Unless it expires before gpu1 empties (30): then it cannot delay the 7g.
        assert!(r.holds_against("1g.10gb", Some(31)));
        assert!(!r.holds_against("1g.10gb", Some(30)));
        assert_eq!(r.view(&gpus, "1g.10gb", Some(30))[1].mig, gpus[1].mig);
        assert_eq!(r.view(&gpus, "1g.10gb", Some(31))[1].mig.len(), 2);
        // The 7g itself sees the region; once gpu1's 1g ends it fits there.
        gpus[1].mig.clear();
        r.refresh(&gpus, 31);
        assert_eq!(r.held()[0].free_since, Some(31));
        let d = plan(
            &mig_shape("7g.80gb"),
            &r.view(&gpus, "7g.80gb", None),
            &PlanOptions::default(),
        )
        .unwrap();
        let PlanDecision::NewMig { gpu, placement, .. } = d else {
            panic!("{d:?}")
        };
        assert_eq!(gpu, 1);
        r.granted("7g.80gb", gpu, placement);
        assert!(r.held().is_empty());
    }

    #[test]
    fn a_free_region_waits_only_its_grace_and_aging_holds_more() {
        let (mut gpus, ends) = busy();
        let mut r = Reservations::new(opts());
        r.refused("7g.80gb", &gpus, &ends, 0).unwrap();
        // One region at first; a second after `aging` (2) refusals.
        assert!(r.refused("7g.80gb", &gpus, &ends, 1).is_none());
        let second = r.refused("7g.80gb", &gpus, &ends, 2).unwrap();
        assert_eq!(second.gpu, 0);
        assert!(r.refused("7g.80gb", &gpus, &ends, 3).is_none(), "at most 2");
        assert_eq!(r.held().len(), 2);
        // gpu1 comes free at 31 and nobody asks: the region goes at 31 + grace.
        gpus[1].mig.clear();
        r.refresh(&gpus, 31);
        r.refresh(&gpus, 39);
        assert_eq!(r.held().len(), 2);
        r.refresh(&gpus, 40);
        assert_eq!(r.held().len(), 1);
        // Nothing outlasts max_hold.
        r.refresh(&gpus, 1000);
        assert!(r.held().is_empty());
    }

    #[test]
    fn reservations_off_hold_nothing() {
        let (gpus, ends) = busy();
        let mut r = Reservations::new(ReserveOptions {
            min_slices: 0,
            ..opts()
        });
        assert!(r.refused("7g.80gb", &gpus, &ends, 0).is_none());
        assert!(!r.holds_against("1g.10gb", None));
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

    /// Whether some placement of `name` on `gpus` is free of every instance present
    /// and of every region held against `name`, within `max_count`: brute force.
    fn legal_placement_exists(
        gpus: &[GpuView],
        r: &Reservations,
        name: &str,
        expires_at: Option<u64>,
    ) -> bool {
        gpus.iter().any(|g| {
            let Some(p) = g.gi_profile(name) else {
                return false;
            };
            instance_count(&g.mig, p.id) < p.max_count
                && p.placements.iter().any(|pl| {
                    g.mig.iter().all(|m| !m.placement.overlaps(pl))
                        && r.held().iter().all(|h| {
                            !Reservations::keeps_out(h, name, expires_at)
                                || h.gpu != g.info.index
                                || !h.placement.overlaps(pl)
                        })
                })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// No false refusal: with reservations held, a request is refused only when
        /// every legal placement for it is taken or held for another profile; what it
        /// gets is never inside a region held against it.
        #[test]
        fn the_planner_never_refuses_what_no_reservation_holds(
            steps in prop::collection::vec((0usize..7, 0u8..4, any::<bool>()), 1..60),
            n_gpus in 1u32..=3,
        ) {
            let mut gpus: Vec<GpuView> = (0..n_gpus).map(h100_mig).collect();
            let mut r = Reservations::new(opts());
            let mut ends: Vec<InstanceEnd> = Vec::new();
            for (now, (n, action, best_fit)) in (0u64..).zip(steps) {
                let name = NAMES[n];
                if action == 0 {
                    // An instance ends.
                    let len = gpus.len();
                    let g = &mut gpus[n % len];
                    if !g.mig.is_empty() {
                        g.mig.remove(now as usize % g.mig.len());
                    }
                    r.refresh(&gpus, now);
                    continue;
                }
                r.refresh(&gpus, now);
                // Some requests expire soon enough to backfill held regions.
                let expires_at = (action == 3).then_some(now + 4);
                let view = r.view(&gpus, name, expires_at);
                let o = PlanOptions {
                    strategy: if best_fit { crate::partition::Strategy::BestFit } else { crate::partition::Strategy::FirstFit },
                    ..PlanOptions::default()
                };
                let exists = legal_placement_exists(&gpus, &r, name, expires_at);
                match plan(&mig_shape(name), &view, &o) {
                    Ok(d @ PlanDecision::NewMig { gpu, placement, .. }) => {
                        prop_assert!(exists);
                        for h in r.held() {
                            prop_assert!(!Reservations::keeps_out(h, name, expires_at) || h.gpu != gpu || !h.placement.overlaps(&placement), "{d:?} in {h:?}");
                        }
                        r.granted(name, gpu, placement);
                        apply(&mut gpus, &mig_shape(name), &d);
                        ends.push((gpu, placement, now + 5 + u64::from(action)));
                    }
                    Ok(d) => prop_assert!(false, "{d:?}"),
                    Err(e) => {
                        prop_assert!(!exists, "{name} refused with a legal placement free: {e}");
                        r.refused(name, &gpus, &ends, now);
                    }
                }
                // Held regions never overlap one another.
                let h = r.held();
                for (i, a) in h.iter().enumerate() {
                    for b in &h[i + 1..] {
                        prop_assert!(a.gpu != b.gpu || !a.placement.overlaps(&b.placement));
                    }
                }
            }
        }
    }
}
