//! The reserved mix, planned: which free reservations to release and how many new
//! ones to make so that each class advertises its count. Pure: the plugin applies it.
//!
//! Rules: a device a pod was given (allocated) is never touched; it counts towards
//! its class's number. Only free reservations are released (the newest first), and
//! releases come before creations, so a changed mix re-carves unused capacity only.

use std::collections::BTreeMap;

use crate::config::ClassSpec;
use crate::partition::Shape;

/// A device as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub device_id: String,
    pub class: String,
    /// Allocate was called for it.
    pub allocated: bool,
    /// Its lease is live.
    pub live: bool,
    pub created_at_ms: i64,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MixPlan {
    /// Free devices whose lease has ended under them (expired, revoked): forgotten.
    pub forget: Vec<String>,
    /// Free reservations to release (their class has more than it should).
    pub release: Vec<String>,
    /// Reservations to make, largest shapes first: (class, how many).
    pub create: Vec<(String, u32)>,
}

/// Largest first: whole GPUs, then MIG profiles by slices, then MPS shares by SMs;
/// small partitions placed last leave the least fragmentation.
fn size_rank(shape: &Shape) -> (u32, u32) {
    match shape {
        Shape::WholeGpu => (3, 0),
        Shape::Mig { profile, .. } => (
            2,
            profile
                .split('g')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0),
        ),
        Shape::Mps { sm_percent, .. } => (1, *sm_percent),
    }
}

pub fn plan(mix: &BTreeMap<String, ClassSpec>, slots: &[Slot]) -> MixPlan {
    let mut out = MixPlan::default();
    let mut classes: Vec<&str> = mix.keys().map(String::as_str).collect();
    for s in slots {
        if !classes.contains(&s.class.as_str()) {
            classes.push(&s.class);
        }
    }
    let mut creates = Vec::new();
    for class in classes {
        let want = mix.get(class).map_or(0, |c| c.count);
        let allocated = slots
            .iter()
            .filter(|s| s.class == class && s.allocated)
            .count() as u32;
        let mut free: Vec<&Slot> = Vec::new();
        for s in slots.iter().filter(|s| s.class == class && !s.allocated) {
            if s.live {
                free.push(s);
            } else {
                out.forget.push(s.device_id.clone());
            }
        }
        let target = want.saturating_sub(allocated) as usize;
        if free.len() > target {
            free.sort_by(|a, b| {
                (b.created_at_ms, &b.device_id).cmp(&(a.created_at_ms, &a.device_id))
            });
            let extra = free.len() - target;
            out.release
                .extend(free.iter().take(extra).map(|s| s.device_id.clone()));
        } else if free.len() < target
            && let Some(spec) = mix.get(class)
        {
            creates.push((
                size_rank(&spec.shape),
                class.to_string(),
                (target - free.len()) as u32,
            ));
        }
    }
    creates.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    out.create = creates.into_iter().map(|(_, c, n)| (c, n)).collect();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix(items: &[(&str, u32)]) -> BTreeMap<String, ClassSpec> {
        items
            .iter()
            .map(|(c, n)| {
                let shape = if *c == "gpu" {
                    Shape::WholeGpu
                } else if let Some(p) = c.strip_prefix("mig-") {
                    Shape::Mig {
                        profile: p.into(),
                        compute_profile: None,
                    }
                } else {
                    Shape::Mps {
                        sm_percent: 25,
                        memory_bytes: 1 << 30,
                    }
                };
                (c.to_string(), ClassSpec { shape, count: *n })
            })
            .collect()
    }

    fn slot(id: &str, class: &str, allocated: bool, live: bool, at: i64) -> Slot {
        Slot {
            device_id: id.into(),
            class: class.into(),
            allocated,
            live,
            created_at_ms: at,
        }
    }

    #[test]
    fn an_empty_node_reserves_the_whole_mix_largest_first() {
        let p = plan(
            &mix(&[
                ("mig-1g.10gb", 3),
                ("gpu", 1),
                ("mig-3g.40gb", 1),
                ("mps-small", 2),
            ]),
            &[],
        );
        assert_eq!(
            p.create,
            vec![
                ("gpu".to_string(), 1),
                ("mig-3g.40gb".to_string(), 1),
                ("mig-1g.10gb".to_string(), 3),
                ("mps-small".to_string(), 2)
            ]
        );
        assert!(p.release.is_empty() && p.forget.is_empty());
    }

    #[test]
    fn a_smaller_count_releases_only_free_reservations_newest_first() {
        let slots = [
            slot("a", "mig-1g.10gb", true, true, 1),
            slot("b", "mig-1g.10gb", false, true, 2),
            slot("c", "mig-1g.10gb", false, true, 3),
            slot("d", "mig-1g.10gb", true, true, 4),
        ];
        let p = plan(&mix(&[("mig-1g.10gb", 3)]), &slots);
        assert_eq!(p.release, vec!["c".to_string()]);
        assert!(p.create.is_empty());
        // Fewer than the pods hold: every free one goes, no allocated one.
        let p = plan(&mix(&[("mig-1g.10gb", 1)]), &slots);
        assert_eq!(p.release, vec!["c".to_string(), "b".to_string()]);
    }

    #[test]
    fn a_class_dropped_from_the_mix_keeps_its_pods_devices_only() {
        let slots = [
            slot("a", "gpu", true, true, 1),
            slot("b", "gpu", false, true, 2),
        ];
        let p = plan(&mix(&[("mig-1g.10gb", 1)]), &slots);
        assert_eq!(p.release, vec!["b".to_string()]);
        assert_eq!(p.create, vec![("mig-1g.10gb".to_string(), 1)]);
    }

    #[test]
    fn a_free_device_whose_lease_ended_is_forgotten_and_replaced() {
        let slots = [
            slot("a", "gpu", false, false, 1),
            slot("b", "gpu", true, false, 2),
        ];
        let p = plan(&mix(&[("gpu", 2)]), &slots);
        assert_eq!(p.forget, vec!["a".to_string()]);
        // The allocated one whose lease ended stays (its pod still has it) and counts.
        assert_eq!(p.create, vec![("gpu".to_string(), 1)]);
    }

    #[test]
    fn a_larger_count_adds_only_the_difference() {
        let slots = [
            slot("a", "gpu", true, true, 1),
            slot("b", "gpu", false, true, 2),
        ];
        let p = plan(&mix(&[("gpu", 4)]), &slots);
        assert_eq!(p.create, vec![("gpu".to_string(), 2)]);
        assert!(p.release.is_empty());
    }
}
