#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use super::sched::{Allocator, attr};
use super::*;
use crate::config::OnUnhealthy;
use crate::gpu::{MpsMode, Placement};
use crate::partition::test_fixtures::{a100_mig, h100_mig, h100_plain, profile_id};
use crate::partition::{
    GpuView, MpsShare, OccupiedMig, PlanDecision, PlanOptions, Shape, Strategy, plan,
};

const GIB: u64 = 1 << 30;

fn cfg() -> SliceConfig {
    SliceConfig {
        node_name: "node-a".into(),
        mps_classes: vec![
            MpsClass {
                name: "small".into(),
                sm_percent: 25,
                memory_bytes: 16 * GIB,
                slots: None,
            },
            MpsClass {
                name: "half".into(),
                sm_percent: 50,
                memory_bytes: 40 * GIB,
                slots: Some(2),
            },
        ],
        on_unhealthy: OnUnhealthy::Keep,
    }
}

fn state(view: GpuView) -> GpuState {
    GpuState {
        view,
        dra_mig: vec![],
        dra_mps: Default::default(),
        dra_whole: false,
        unhealthy: None,
        unhealthy_instances: vec![],
    }
}

fn node(gpus: Vec<GpuState>) -> NodeState {
    NodeState {
        gpus,
        driver_version: "570.86.15".into(),
    }
}

fn devices(slices: &[ResourceSlice]) -> Vec<Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten().cloned())
        .collect()
}

fn names(slices: &[ResourceSlice]) -> Vec<String> {
    devices(slices).into_iter().map(|d| d.name).collect()
}

fn occupy(view: &mut GpuView, profile: &str, start: u32) -> Placement {
    let id = profile_id(&view.profiles, profile);
    let size = view
        .profiles
        .iter()
        .find(|p| p.id == id)
        .unwrap()
        .memory_slices;
    let placement = Placement { start, size };
    view.mig.push(OccupiedMig {
        gi_profile_id: id,
        placement,
        free_static: None,
    });
    placement
}

fn mig_placement(name: &str, view: &GpuView) -> Option<Placement> {
    match DeviceName::parse(name).unwrap() {
        DeviceName::Mig { profile, start, .. } => {
            let p = view.gi_profile(&profile).unwrap();
            Some(Placement {
                start,
                size: p.memory_slices,
            })
        }
        _ => None,
    }
}

#[test]
fn an_idle_mig_gpu_publishes_every_placement_over_its_counter_set() {
    let slices = build(&cfg(), &node(vec![state(h100_mig(0))]), 3).unwrap();
    assert_eq!(slices.len(), 2, "one counter slice, one device slice");
    for s in &slices {
        assert_eq!(s.spec.driver, DRIVER_NAME);
        assert_eq!(s.spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(s.spec.pool.name, "node-a");
        assert_eq!(s.spec.pool.generation, 3);
        assert_eq!(s.spec.pool.resource_slice_count, 2);
        assert!(
            s.spec.devices.is_none() || s.spec.shared_counters.is_none(),
            "a slice has devices or counter sets, never both"
        );
        assert!(is_dns_subdomain(s.metadata.name.as_deref().unwrap()));
    }
    let sets = slices[0].spec.shared_counters.as_ref().unwrap();
    assert_eq!(sets.len(), 1);
    assert_eq!(sets[0].name, "gpu-0");
    let keys: BTreeSet<&str> = sets[0].counters.keys().map(String::as_str).collect();
    for k in 0..8 {
        assert!(keys.contains(format!("memory-slice-{k}").as_str()));
    }
    assert_eq!(sets[0].counters["compute-slices"].value.0, "7");
    // 7 + 7 + 4 + 3 + 2 + 1 + 1 placements of H100's seven profiles; no whole GPU
    // (MIG is on) and no MPS slot.
    let devs = devices(&slices);
    assert_eq!(devs.len(), 25, "{:?}", names(&slices));
    for d in &devs {
        let name = DeviceName::parse(&d.name).unwrap();
        assert!(matches!(name, DeviceName::Mig { gpu: 0, .. }), "{name:?}");
        assert_eq!(attr(d, "type"), Some("mig"));
        assert_eq!(attr(d, "model"), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(attr(d, "driverVersion"), Some("570.86.15"));
        let c = &d.consumes_counters.as_ref().unwrap()[0];
        assert_eq!(c.counter_set, "gpu-0");
        for k in c.counters.keys() {
            assert!(keys.contains(k.as_str()), "{} consumes unknown {k}", d.name);
        }
        assert!(d.taints.is_none());
    }
    assert!(names(&slices).contains(&"gpu-0-mig-6-1g-10gb-me".to_string()));
    assert!(names(&slices).contains(&"gpu-0-mig-0-7g-80gb".to_string()));
}

#[test]
fn two_devices_can_both_be_allocated_exactly_when_their_instances_can_coexist() {
    let view = h100_mig(0);
    let slices = build(&cfg(), &node(vec![state(view.clone())]), 1).unwrap();
    let devs = devices(&slices);
    for a in &devs {
        for b in &devs {
            if a.name >= b.name {
                continue;
            }
            let mut alloc = Allocator::new(&slices);
            assert!(alloc.allocated_before(&a.name));
            let both = alloc.allocated_before(&b.name);
            let pa = mig_placement(&a.name, &view).unwrap();
            let pb = mig_placement(&b.name, &view).unwrap();
            let pa_prof = view.gi_profile(attr(a, "profile").unwrap()).unwrap().slices;
            let pb_prof = view.gi_profile(attr(b, "profile").unwrap()).unwrap().slices;
            let same = attr(a, "profile") == attr(b, "profile");
            let max = view
                .gi_profile(attr(a, "profile").unwrap())
                .unwrap()
                .max_count;
            let coexist = !pa.overlaps(&pb) && pa_prof + pb_prof <= 7 && !(same && max < 2);
            assert_eq!(both, coexist, "{} and {}", a.name, b.name);
        }
    }
}

#[test]
fn hardware_of_non_dra_leases_is_not_published_and_dra_leases_stay() {
    let mut view = h100_mig(0);
    // A gRPC lease holds 3g.40gb at 4; a DRA claim holds 2g.20gb at 0.
    occupy(&mut view, "3g.40gb", 4);
    let dra = occupy(&mut view, "2g.20gb", 0);
    let mut g = state(view.clone());
    g.dra_mig = vec![dra];
    let slices = build(&cfg(), &node(vec![g]), 1).unwrap();
    let published = names(&slices);
    for n in &published {
        let p = mig_placement(n, &view).unwrap();
        assert!(
            p.end() <= 4,
            "{n} uses slices 4-7, which a non-DRA lease holds"
        );
    }
    assert!(published.contains(&"gpu-0-mig-0-2g-20gb".to_string()));
    assert!(published.contains(&"gpu-0-mig-0-1g-10gb".to_string()));
    assert!(!published.contains(&"gpu-0-mig-0-7g-80gb".to_string()));
}

#[test]
fn a_plain_gpu_publishes_itself_whole_and_mps_slots() {
    let slices = build(&cfg(), &node(vec![state(h100_plain(1))]), 1).unwrap();
    let n = names(&slices);
    // small: min(100/25, 80/16) = 4 slots; half: 2 as configured.
    assert_eq!(
        n,
        vec![
            "gpu-1",
            "gpu-1-mps-small-0",
            "gpu-1-mps-half-0",
            "gpu-1-mps-small-1",
            "gpu-1-mps-half-1",
            "gpu-1-mps-small-2",
            "gpu-1-mps-small-3"
        ]
    );
    let mut alloc = Allocator::new(&slices);
    let mps = |d: &Device| attr(d, "type") == Some("mps");
    let whole = |d: &Device| attr(d, "type") == Some("gpu");
    assert_eq!(alloc.allocate(&mps).as_deref(), Some("gpu-1-mps-small-0"));
    assert_eq!(alloc.allocate(&whole), None, "a share holds part of it");
    alloc.free("gpu-1-mps-small-0");
    assert_eq!(alloc.allocate(&whole).as_deref(), Some("gpu-1"));
    assert_eq!(alloc.allocate(&mps), None);
    alloc.free("gpu-1");
    // Shares until SM percent runs out: 25+50+25 = 100.
    let mut got = Vec::new();
    while let Some(d) = alloc.allocate(&mps) {
        got.push(d);
    }
    let sm: u32 = got
        .iter()
        .map(|n| if n.contains("-half-") { 50 } else { 25 })
        .sum();
    assert!(sm <= 100, "{got:?}");
}

#[test]
fn non_dra_mps_shares_shrink_the_counters_and_hide_the_whole_gpu() {
    let mut view = h100_plain(0);
    view.mps.push(MpsShare {
        sm_percent: 50,
        memory_bytes: 40 * GIB,
        mode: MpsMode::Isolated,
    });
    let slices = build(&cfg(), &node(vec![state(view.clone())]), 1).unwrap();
    assert!(!names(&slices).contains(&"gpu-0".to_string()));
    let set = &slices[0].spec.shared_counters.as_ref().unwrap()[0];
    assert_eq!(set.counters["sm-percent"].value.0, "50");
    assert_eq!(set.counters["memory"].value.0, (40 * GIB).to_string());
    // The same share held by a DRA claim: the scheduler knows it, all stays.
    let mut g = state(view.clone());
    g.dra_mps.push(MpsShare {
        sm_percent: 50,
        memory_bytes: 40 * GIB,
        mode: MpsMode::Isolated,
    });
    let slices = build(&cfg(), &node(vec![g]), 1).unwrap();
    assert!(names(&slices).contains(&"gpu-0".to_string()));
    let set = &slices[0].spec.shared_counters.as_ref().unwrap()[0];
    assert_eq!(set.counters["sm-percent"].value.0, "100");
    // Shares in the shared mode leave no room for a class's isolated shares.
    view.mps = Default::default();
    view.mps.push(MpsShare {
        sm_percent: 10,
        memory_bytes: GIB,
        mode: MpsMode::Shared,
    });
    let slices = build(&cfg(), &node(vec![state(view)]), 1).unwrap();
    assert!(names(&slices).is_empty(), "{:?}", names(&slices));
}

#[test]
fn health_becomes_taints_and_recovery_drops_them() {
    let mut sick = state(h100_mig(0));
    sick.unhealthy = Some("XID 79 (GPU has fallen off the bus)".into());
    let slices = build(&cfg(), &node(vec![sick.clone()]), 1).unwrap();
    for d in devices(&slices) {
        let t = d.taints.as_ref().unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].key, TAINT_KEY);
        assert_eq!(t[0].effect, "NoSchedule");
        assert_eq!(
            t[0].value.as_deref(),
            Some("XID-79--GPU-has-fallen-off-the-bus")
        );
    }
    let mut revoke = cfg();
    revoke.on_unhealthy = OnUnhealthy::Revoke;
    let slices = build(&revoke, &node(vec![sick]), 2).unwrap();
    assert!(
        devices(&slices)
            .iter()
            .all(|d| d.taints.as_ref().unwrap()[0].effect == "NoExecute")
    );
    // Scheduling skips tainted devices.
    let mut alloc = Allocator::new(&slices);
    assert_eq!(alloc.allocate(&|_| true), None);

    // One instance out of service: the devices on its slices only.
    let mut view = h100_mig(0);
    let p = occupy(&mut view, "1g.10gb", 3);
    let mut g = state(view.clone());
    g.dra_mig = vec![p];
    g.unhealthy_instances = vec![(p, "double-bit ECC error".into())];
    let slices = build(&cfg(), &node(vec![g.clone()]), 3).unwrap();
    for d in devices(&slices) {
        let overlaps = mig_placement(&d.name, &view).unwrap().overlaps(&p);
        assert_eq!(d.taints.is_some(), overlaps, "{}", d.name);
    }
    g.unhealthy_instances.clear();
    let slices = build(&cfg(), &node(vec![g]), 4).unwrap();
    assert!(devices(&slices).iter().all(|d| d.taints.is_none()));
}

/// First fit over the published order lands where Tessera's best-fit planner puts
/// the instance, layout after layout, on one GPU and across two.
#[test]
fn first_fit_over_the_published_order_follows_the_planner() {
    for base in [
        vec![h100_mig(0)],
        vec![a100_mig(0)],
        vec![h100_mig(0), h100_mig(1)],
    ] {
        let mut views = base.clone();
        let profiles: Vec<String> = views[0].profiles.iter().map(|p| p.name.clone()).collect();
        // A fixed stream of requests (every profile, small ones more often).
        let stream: Vec<&str> = [
            0usize, 0, 2, 0, 3, 1, 0, 4, 0, 2, 0, 0, 3, 0, 1, 2, 0, 3, 0, 0,
        ]
        .iter()
        .map(|&i| profiles[i % profiles.len()].as_str())
        .collect();
        for want in stream {
            let opts = PlanOptions {
                strategy: Strategy::BestFit,
                ..PlanOptions::default()
            };
            let planned = plan(
                &Shape::Mig {
                    profile: want.to_string(),
                    compute_profile: None,
                },
                &views,
                &opts,
            );
            // Everything on the GPUs is the scheduler's (DRA claims).
            let gpus = views
                .iter()
                .map(|v| {
                    let mut g = state(v.clone());
                    g.dra_mig = v.mig.iter().map(|m| m.placement).collect();
                    g
                })
                .collect();
            let slices = build(&cfg(), &node(gpus), 1).unwrap();
            let mut alloc = Allocator::new(&slices);
            for v in &views {
                for m in &v.mig {
                    let prof = v.profiles.iter().find(|p| p.id == m.gi_profile_id).unwrap();
                    let name = DeviceName::Mig {
                        gpu: v.info.index,
                        profile: prof.name.clone(),
                        start: m.placement.start,
                    }
                    .to_string();
                    assert!(alloc.allocated_before(&name), "{name}");
                }
            }
            let got = alloc.allocate(&|d: &Device| attr(d, "profile") == Some(want));
            match planned {
                Ok(PlanDecision::NewMig { gpu, placement, .. }) => {
                    let got = got.unwrap_or_else(|| panic!("no {want} allocated"));
                    let name = DeviceName::parse(&got).unwrap();
                    assert_eq!(
                        (name.gpu(), mig_placement(&got, &views[0])),
                        (gpu, Some(placement)),
                        "{want}: first fit took {got}"
                    );
                    let v = views.iter_mut().find(|v| v.info.index == gpu).unwrap();
                    occupy(v, want, placement.start);
                }
                // No room for the planner (overlaps, max_count): none for the
                // scheduler either.
                _ => assert_eq!(got, None, "{want}"),
            }
        }
    }
}

#[test]
fn gpus_are_packed_whole_into_slices_fullest_first() {
    let gpus: Vec<GpuState> = (0..9)
        .map(|i| {
            let mut v = h100_mig(i);
            if i == 5 {
                occupy(&mut v, "3g.40gb", 0);
            }
            let mut g = state(v);
            g.dra_mig = g.view.mig.iter().map(|m| m.placement).collect();
            g
        })
        .collect();
    let slices = build(&cfg(), &node(gpus), 7).unwrap();
    let counter_slices: Vec<_> = slices
        .iter()
        .filter(|s| s.spec.shared_counters.is_some())
        .collect();
    assert_eq!(counter_slices.len(), 2, "9 counter sets, 8 per slice");
    let device_slices: Vec<_> = slices.iter().filter(|s| s.spec.devices.is_some()).collect();
    // 25 devices a GPU, two GPUs a slice.
    assert_eq!(device_slices.len(), 5);
    for s in &slices {
        assert_eq!(s.spec.pool.resource_slice_count, 7);
        assert!(
            s.spec
                .devices
                .as_ref()
                .is_none_or(|d| d.len() <= MAX_DEVICES)
        );
    }
    let mut seen = BTreeMap::new();
    for (i, s) in device_slices.iter().enumerate() {
        for d in s.spec.devices.iter().flatten() {
            let gpu = DeviceName::parse(&d.name).unwrap().gpu();
            let first = *seen.entry(gpu).or_insert(i);
            assert_eq!(first, i, "GPU {gpu} is split across slices");
        }
    }
    assert_eq!(seen[&5], 0, "the fullest GPU comes first");
    let first = &device_slices[0].spec.devices.as_ref().unwrap()[0];
    assert!(first.name.starts_with("gpu-5-"), "{}", first.name);
}

#[test]
fn names_fit_the_api_server() {
    let long = format!("{}.example.com", "n".repeat(63));
    let long = format!("{long}.{long}.{long}");
    assert!(long.len() <= 253 && is_dns_subdomain(&long));
    let mut c = cfg();
    c.node_name = long;
    let slices = build(&c, &node(vec![state(h100_plain(0))]), 1).unwrap();
    for s in &slices {
        let n = s.metadata.name.as_deref().unwrap();
        assert!(n.len() <= 253 && is_dns_subdomain(n), "{n}");
    }
    c.node_name = "Node_A".into();
    assert_eq!(
        build(&c, &node(vec![]), 1).unwrap_err(),
        SliceError::NodeName("Node_A".into())
    );
    // An empty pool is one empty slice.
    let slices = build(&cfg(), &node(vec![]), 1).unwrap();
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0].spec.devices.as_deref(), Some(&[][..]));
    assert_eq!(label_value("  -bad value!- "), "bad-value");
    assert_eq!(label_value(&"x".repeat(100)).len(), 63);
}

#[test]
fn mps_slots_fit_the_gpu_and_the_cap() {
    let c = MpsClass {
        name: "x".into(),
        sm_percent: 1,
        memory_bytes: GIB,
        slots: None,
    };
    assert_eq!(mps_slots(&c, 80 * GIB), MAX_MPS_SLOTS);
    let c = MpsClass {
        sm_percent: 30,
        memory_bytes: 30 * GIB,
        ..c
    };
    assert_eq!(mps_slots(&c, 80 * GIB), 2);
}
