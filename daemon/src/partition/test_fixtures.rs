//! Test fixtures for the partition module: GI-profile tables of H100-80GB and A100-40GB
//! (from NVIDIA's published MIG profile tables) and helpers that build [`GpuView`]s and apply
//! planner decisions to them the way the lease manager would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::gpu::{CiProfile, GiProfile, GpuInfo, Placement};

use super::{GpuView, MpsLoad, MpsShare, OccupiedMig, PlanDecision, Shape};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn ci(name: &str, slices: u32, max_count: u32, sm_per_slice: u32) -> CiProfile {
    // NVML_COMPUTE_INSTANCE_PROFILE_{1,2,3,4,7}_SLICE = 0, 1, 2, 3, 4.
    let id = match slices {
        1 => 0,
        2 => 1,
        3 => 2,
        4 => 3,
        7 => 4,
        _ => panic!("no CI profile of {slices} slices"),
    };
    CiProfile {
        id,
        name: name.to_string(),
        slices,
        max_count,
        sm_count: sm_per_slice * slices,
    }
}

fn cis_for(compute_slices: u32, sm_per_slice: u32) -> Vec<CiProfile> {
    let c = |n: &str, s, m| ci(n, s, m, sm_per_slice);
    match compute_slices {
        1 => vec![c("1c", 1, 1)],
        2 => vec![c("1c", 1, 2), c("2c", 2, 1)],
        3 => vec![c("1c", 1, 3), c("2c", 2, 1), c("3c", 3, 1)],
        4 => vec![c("1c", 1, 4), c("2c", 2, 2), c("4c", 4, 1)],
        7 => vec![
            c("1c", 1, 7),
            c("2c", 2, 3),
            c("3c", 3, 2),
            c("4c", 4, 1),
            c("7c", 7, 1),
        ],
        _ => panic!("no GI of {compute_slices} compute slices"),
    }
}

struct Row {
    id: u32,
    name: &'static str,
    slices: u32,
    memory_slices: u32,
    memory_mib: u64,
    sm: u32,
    max_count: u32,
    starts: &'static [u32],
    me: bool,
}

fn build(rows: &[Row], sm_per_slice: u32) -> Vec<GiProfile> {
    rows.iter()
        .map(|r| GiProfile {
            id: r.id,
            name: r.name.to_string(),
            slices: r.slices,
            memory_slices: r.memory_slices,
            memory_bytes: r.memory_mib * MIB,
            sm_count: r.sm,
            max_count: r.max_count,
            placements: crate::gpu::profiles::placements_at(r.starts, r.memory_slices),
            ci_profiles: cis_for(r.slices, sm_per_slice),
            media_extensions: r.me,
        })
        .collect()
}

const ONE_SLICE: &[u32] = &[0, 1, 2, 3, 4, 5, 6];

/// H100-80GB GI profiles (NVML ids).
pub fn h100_profiles() -> Vec<GiProfile> {
    #[rustfmt::skip]
    let rows = [
        Row { id: 0, name: "1g.10gb", slices: 1, memory_slices: 1, memory_mib: 9984, sm: 16, max_count: 7, starts: ONE_SLICE, me: false },
        Row { id: 7, name: "1g.10gb+me", slices: 1, memory_slices: 1, memory_mib: 9984, sm: 16, max_count: 1, starts: ONE_SLICE, me: true },
        Row { id: 9, name: "1g.20gb", slices: 1, memory_slices: 2, memory_mib: 20090, sm: 26, max_count: 4, starts: &[0, 2, 4, 6], me: false },
        Row { id: 1, name: "2g.20gb", slices: 2, memory_slices: 2, memory_mib: 20090, sm: 32, max_count: 3, starts: &[0, 2, 4], me: false },
        Row { id: 2, name: "3g.40gb", slices: 3, memory_slices: 4, memory_mib: 40448, sm: 60, max_count: 2, starts: &[0, 4], me: false },
        Row { id: 3, name: "4g.40gb", slices: 4, memory_slices: 4, memory_mib: 40448, sm: 64, max_count: 1, starts: &[0], me: false },
        Row { id: 4, name: "7g.80gb", slices: 7, memory_slices: 8, memory_mib: 81152, sm: 132, max_count: 1, starts: &[0], me: false },
    ];
    build(&rows, 16)
}

/// A100-40GB GI profiles (NVML ids).
pub fn a100_40gb_profiles() -> Vec<GiProfile> {
    #[rustfmt::skip]
    let rows = [
        Row { id: 0, name: "1g.5gb", slices: 1, memory_slices: 1, memory_mib: 4864, sm: 14, max_count: 7, starts: ONE_SLICE, me: false },
        Row { id: 7, name: "1g.5gb+me", slices: 1, memory_slices: 1, memory_mib: 4864, sm: 14, max_count: 1, starts: ONE_SLICE, me: true },
        Row { id: 9, name: "1g.10gb", slices: 1, memory_slices: 2, memory_mib: 9851, sm: 14, max_count: 4, starts: &[0, 2, 4, 6], me: false },
        Row { id: 1, name: "2g.10gb", slices: 2, memory_slices: 2, memory_mib: 9851, sm: 28, max_count: 3, starts: &[0, 2, 4], me: false },
        Row { id: 2, name: "3g.20gb", slices: 3, memory_slices: 4, memory_mib: 19968, sm: 42, max_count: 2, starts: &[0, 4], me: false },
        Row { id: 3, name: "4g.20gb", slices: 4, memory_slices: 4, memory_mib: 20090, sm: 56, max_count: 1, starts: &[0], me: false },
        Row { id: 4, name: "7g.40gb", slices: 7, memory_slices: 8, memory_mib: 40448, sm: 98, max_count: 1, starts: &[0], me: false },
    ];
    build(&rows, 14)
}

pub fn gpu_info(index: u32, name: &str, memory_bytes: u64, mig: bool, sm_count: u32) -> GpuInfo {
    GpuInfo {
        index,
        uuid: format!("GPU-00000000-0000-0000-0000-00000000000{index}"),
        name: name.to_string(),
        memory_bytes,
        minor: index,
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x17 + index),
        mig_current: mig,
        mig_pending: mig,
        sm_count,
        fault: None,
    }
}

/// An empty H100-80GB with MIG enabled.
pub fn h100_mig(index: u32) -> GpuView {
    GpuView {
        info: gpu_info(index, "NVIDIA H100 80GB HBM3", 80 * GIB, true, 132),
        profiles: h100_profiles(),
        mig: vec![],
        mps: MpsLoad::default(),
        whole_leased: false,
    }
}

/// An empty A100-40GB with MIG enabled.
pub fn a100_mig(index: u32) -> GpuView {
    GpuView {
        info: gpu_info(index, "NVIDIA A100-SXM4-40GB", 40 * GIB, true, 108),
        profiles: a100_40gb_profiles(),
        mig: vec![],
        mps: MpsLoad::default(),
        whole_leased: false,
    }
}

/// An idle H100-80GB with MIG disabled (no GI profiles reported).
pub fn h100_plain(index: u32) -> GpuView {
    GpuView {
        info: gpu_info(index, "NVIDIA H100 80GB HBM3", 80 * GIB, false, 132),
        profiles: vec![],
        mig: vec![],
        mps: MpsLoad::default(),
        whole_leased: false,
    }
}

pub fn profile_id(profiles: &[GiProfile], name: &str) -> u32 {
    profiles
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("fixture has no profile {name}"))
        .id
}

pub fn profile(profiles: &[GiProfile], id: u32) -> &GiProfile {
    profiles.iter().find(|p| p.id == id).unwrap()
}

/// A leased instance of profile `name` at memory slice `start` of `view`'s GPU.
pub fn occ(view: &GpuView, name: &str, start: u32) -> OccupiedMig {
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

pub fn mig_shape(profile: &str) -> Shape {
    Shape::Mig {
        profile: profile.to_string(),
        compute_profile: None,
    }
}

pub fn gib(n: u64) -> u64 {
    n * GIB
}

pub fn view_mut(gpus: &mut [GpuView], index: u32) -> &mut GpuView {
    gpus.iter_mut().find(|g| g.info.index == index).unwrap()
}

/// Apply a planner decision for `shape` to the views as the lease manager would.
pub fn apply(gpus: &mut [GpuView], shape: &Shape, decision: &PlanDecision) {
    match decision {
        PlanDecision::NewMig {
            gpu,
            gi_profile_id,
            placement,
            ..
        } => view_mut(gpus, *gpu).mig.push(OccupiedMig {
            gi_profile_id: *gi_profile_id,
            placement: *placement,
            free_static: None,
        }),
        PlanDecision::Static { gpu, partition_id } => {
            let v = view_mut(gpus, *gpu);
            let m = v
                .mig
                .iter_mut()
                .find(|m| m.free_static.as_deref() == Some(partition_id.as_str()))
                .unwrap();
            m.free_static = None;
        }
        PlanDecision::Mps { gpu } => {
            let Shape::Mps {
                sm_percent,
                memory_bytes,
                mode,
            } = shape
            else {
                panic!("MPS decision for {shape:?}");
            };
            view_mut(gpus, *gpu).mps.push(MpsShare {
                sm_percent: *sm_percent,
                memory_bytes: *memory_bytes,
                mode: *mode,
            });
        }
        PlanDecision::WholeGpu { gpu } => view_mut(gpus, *gpu).whole_leased = true,
    }
}
