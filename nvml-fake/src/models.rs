//! The GPU models the fake serves and their MIG tables, from NVIDIA's published
//! profile and placement tables (the MIG user guide): A100-SXM4-40GB/80GB,
//! H100-SXM5-80GB, H200-141GB.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Model {
    #[serde(rename = "a100-40gb")]
    A100_40,
    #[serde(rename = "a100-80gb")]
    A100_80,
    #[serde(rename = "h100-80gb")]
    H100_80,
    #[serde(rename = "h200-141gb")]
    H200_141,
}

/// One GPU-instance profile.
#[derive(Debug, Clone, Copy)]
pub struct GiRow {
    /// `NVML_GPU_INSTANCE_PROFILE_*`: what nvmlDeviceGetGpuInstanceProfileInfoV takes.
    pub id: u32,
    /// The driver's id of the profile (`nvmlGpuInstanceProfileInfo_t.id`), what the
    /// placement, create and list calls take and `nvmlGpuInstanceInfo_t.profileId`
    /// says: not the index (a real H200 on driver 580: 1g 19, 1g+me 20, 1g with two
    /// memory slices 15, 2g 14, 3g 9, 4g 5, 7g 0; the same ids on A100 and H100).
    pub driver_id: u32,
    pub slices: u32,
    pub memory_slices: u32,
    pub memory_mib: u64,
    pub sm_count: u32,
    pub max_count: u32,
    pub starts: &'static [u32],
    pub name: &'static str,
}

impl Model {
    pub fn parse(s: &str) -> Option<Model> {
        match s.trim().to_ascii_lowercase().as_str() {
            "a100-40gb" | "a100" => Some(Model::A100_40),
            "a100-80gb" => Some(Model::A100_80),
            "h100-80gb" | "h100" => Some(Model::H100_80),
            "h200-141gb" | "h200" => Some(Model::H200_141),
            _ => None,
        }
    }

    pub fn number(self) -> u32 {
        match self {
            Model::A100_40 => 1,
            Model::A100_80 => 2,
            Model::H100_80 => 3,
            Model::H200_141 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Model::A100_40 => "NVIDIA A100-SXM4-40GB",
            Model::A100_80 => "NVIDIA A100-SXM4-80GB",
            Model::H100_80 => "NVIDIA H100 80GB HBM3",
            Model::H200_141 => "NVIDIA H200",
        }
    }

    pub fn memory_bytes(self) -> u64 {
        let gib: u64 = match self {
            Model::A100_40 => 40,
            Model::A100_80 | Model::H100_80 => 80,
            Model::H200_141 => 141,
        };
        gib << 30
    }

    pub fn sm_count(self) -> u32 {
        match self {
            Model::A100_40 | Model::A100_80 => 108,
            Model::H100_80 | Model::H200_141 => 132,
        }
    }

    /// NVLinks per GPU (NVLink 3 on A100: 12; NVLink 4 on H100/H200: 18).
    pub fn nvlinks(self) -> u32 {
        match self {
            Model::A100_40 | Model::A100_80 => 12,
            Model::H100_80 | Model::H200_141 => 18,
        }
    }

    /// The GI profiles: 1g, 1g+me, 1g (2 memory slices), 2g, 3g, 4g, 7g.
    pub fn gi_rows(self) -> [GiRow; 7] {
        // (name, MiB, SMs) per row.
        let t: [(&'static str, u64, u32); 7] = match self {
            Model::A100_40 => [
                ("1g.5gb", 4864, 14),
                ("1g.5gb+me", 4864, 14),
                ("1g.10gb", 9856, 14),
                ("2g.10gb", 9856, 28),
                ("3g.20gb", 19968, 42),
                ("4g.20gb", 20096, 56),
                ("7g.40gb", 40448, 98),
            ],
            Model::A100_80 => [
                ("1g.10gb", 9728, 14),
                ("1g.10gb+me", 9728, 14),
                ("1g.20gb", 19968, 14),
                ("2g.20gb", 19968, 28),
                ("3g.40gb", 40192, 42),
                ("4g.40gb", 40192, 56),
                ("7g.80gb", 80640, 98),
            ],
            Model::H100_80 => [
                ("1g.10gb", 9984, 16),
                ("1g.10gb+me", 9984, 16),
                ("1g.20gb", 20096, 26),
                ("2g.20gb", 20096, 32),
                ("3g.40gb", 40448, 60),
                ("4g.40gb", 40448, 64),
                ("7g.80gb", 81152, 132),
            ],
            Model::H200_141 => [
                ("1g.18gb", 16384, 16),
                ("1g.18gb+me", 16384, 16),
                ("1g.35gb", 33280, 26),
                ("2g.35gb", 33280, 32),
                ("3g.71gb", 71424, 60),
                ("4g.71gb", 71424, 64),
                ("7g.141gb", 143360, 132),
            ],
        };
        let row = |i: usize, id, slices, memory_slices, max_count, starts| GiRow {
            id,
            driver_id: match id {
                0 => 19,
                7 => 20,
                9 => 15,
                1 => 14,
                2 => 9,
                3 => 5,
                _ => 0,
            },
            slices,
            memory_slices,
            memory_mib: t[i].1,
            sm_count: t[i].2,
            max_count,
            starts,
            name: t[i].0,
        };
        [
            row(0, 0, 1, 1, 7, &[0, 1, 2, 3, 4, 5, 6]),
            row(1, 7, 1, 1, 1, &[0, 1, 2, 3, 4, 5, 6]),
            row(2, 9, 1, 2, 4, &[0, 2, 4, 6]),
            row(3, 1, 2, 2, 3, &[0, 2, 4]),
            row(4, 2, 3, 4, 2, &[0, 4]),
            row(5, 3, 4, 4, 1, &[0]),
            row(6, 4, 7, 8, 1, &[0]),
        ]
    }

    pub fn gi_row(self, profile: u32) -> Option<GiRow> {
        self.gi_rows().into_iter().find(|r| r.id == profile)
    }

    /// The row of the driver's profile id (`nvmlGpuInstanceProfileInfo_t.id`).
    pub fn gi_row_by_driver_id(self, driver_id: u32) -> Option<GiRow> {
        self.gi_rows()
            .into_iter()
            .find(|r| r.driver_id == driver_id)
    }

    /// Hopper's media engines per GI (as a real H200 reports them): one decoder and
    /// one JPEG engine per compute slice, and eight copy engines on the whole GPU.
    pub fn hopper(self) -> bool {
        matches!(self, Model::H100_80 | Model::H200_141)
    }

    /// SMs of an n-slice compute instance smaller than its GI (those of the plain
    /// n-slice GI profile).
    pub fn sm_of_slices(self, slices: u32) -> u32 {
        self.gi_rows()
            .iter()
            .find(|r| r.slices == slices && matches!(r.id, 0..=4))
            .map_or(0, |r| r.sm_count)
    }
}

/// `NVML_COMPUTE_INSTANCE_PROFILE_*` of an n-slice CI.
pub fn ci_profile_id(slices: u32) -> Option<u32> {
    match slices {
        1 => Some(0),
        2 => Some(1),
        3 => Some(2),
        4 => Some(3),
        7 => Some(4),
        _ => None,
    }
}

/// Compute slices of a CI profile id.
pub fn ci_slices(profile: u32) -> Option<u32> {
    match profile {
        0 => Some(1),
        1 => Some(2),
        2 => Some(3),
        3 => Some(4),
        4 => Some(7),
        _ => None,
    }
}

/// (CI compute slices, max count) allowed in a GI of `gi_slices`.
pub fn ci_layout(gi_slices: u32) -> &'static [(u32, u32)] {
    match gi_slices {
        1 => &[(1, 1)],
        2 => &[(1, 2), (2, 1)],
        3 => &[(1, 3), (2, 1), (3, 1)],
        4 => &[(1, 4), (2, 2), (4, 1)],
        7 => &[(1, 7), (2, 3), (3, 2), (4, 1), (7, 1)],
        _ => &[],
    }
}
