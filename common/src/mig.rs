//! NVIDIA's published MIG tables (the MIG user guide) for the GPU models Tessera
//! knows: A100-SXM4-40GB/80GB, H100 80GB HBM3, H200. One table, which the daemon's
//! simulator and the fake NVML library (`nvml-fake`) both serve.
//!
//! Ids follow NVML: GI profile ids are `NVML_GPU_INSTANCE_PROFILE_*`, CI profile ids
//! `NVML_COMPUTE_INSTANCE_PROFILE_*`.

/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE`.
pub const GI_PROFILE_1_SLICE: u32 = 0;
/// `NVML_GPU_INSTANCE_PROFILE_2_SLICE`.
pub const GI_PROFILE_2_SLICE: u32 = 1;
/// `NVML_GPU_INSTANCE_PROFILE_3_SLICE`.
pub const GI_PROFILE_3_SLICE: u32 = 2;
/// `NVML_GPU_INSTANCE_PROFILE_4_SLICE`.
pub const GI_PROFILE_4_SLICE: u32 = 3;
/// `NVML_GPU_INSTANCE_PROFILE_7_SLICE`.
pub const GI_PROFILE_7_SLICE: u32 = 4;
/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1` (1 slice + all media engines, "+me").
pub const GI_PROFILE_1_SLICE_REV1: u32 = 7;
/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2` (1 compute slice, 2 memory slices).
pub const GI_PROFILE_1_SLICE_REV2: u32 = 9;

/// The GPU models with MIG tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MigModel {
    A100Sxm40Gb,
    A100Sxm80Gb,
    H100Hbm3_80Gb,
    H200_141Gb,
}

/// One GPU-instance profile of one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiRow {
    /// `NVML_GPU_INSTANCE_PROFILE_*`: what nvmlDeviceGetGpuInstanceProfileInfoV takes.
    pub id: u32,
    /// The driver's id of the profile (`nvmlGpuInstanceProfileInfo_t.id`), what the
    /// placement, create and list calls take and `nvmlGpuInstanceInfo_t.profileId`
    /// says: not the index (a real H200 on driver 580: 1g 19, 1g+me 20, 1g with two
    /// memory slices 15, 2g 14, 3g 9, 4g 5, 7g 0; the same ids on A100 and H100).
    pub driver_id: u32,
    /// The profile's name as NVML and nvidia-smi spell it ("1g.10gb+me").
    pub name: &'static str,
    pub slices: u32,
    pub memory_slices: u32,
    pub memory_mib: u64,
    pub sm_count: u32,
    pub max_count: u32,
    /// The memory slices a placement may start at.
    pub starts: &'static [u32],
    /// All media engines of the GPU ("+me").
    pub media_extensions: bool,
}

impl MigModel {
    pub const ALL: [MigModel; 4] = [
        MigModel::A100Sxm40Gb,
        MigModel::A100Sxm80Gb,
        MigModel::H100Hbm3_80Gb,
        MigModel::H200_141Gb,
    ];

    /// The short name configs use ("h100-80gb").
    pub fn short_name(self) -> &'static str {
        match self {
            MigModel::A100Sxm40Gb => "a100-40gb",
            MigModel::A100Sxm80Gb => "a100-80gb",
            MigModel::H100Hbm3_80Gb => "h100-80gb",
            MigModel::H200_141Gb => "h200-141gb",
        }
    }

    /// The name NVML reports (`nvmlDeviceGetName`).
    pub fn marketing_name(self) -> &'static str {
        match self {
            MigModel::A100Sxm40Gb => "NVIDIA A100-SXM4-40GB",
            MigModel::A100Sxm80Gb => "NVIDIA A100-SXM4-80GB",
            MigModel::H100Hbm3_80Gb => "NVIDIA H100 80GB HBM3",
            MigModel::H200_141Gb => "NVIDIA H200",
        }
    }

    pub fn memory_bytes(self) -> u64 {
        let gib: u64 = match self {
            MigModel::A100Sxm40Gb => 40,
            MigModel::A100Sxm80Gb | MigModel::H100Hbm3_80Gb => 80,
            MigModel::H200_141Gb => 141,
        };
        gib << 30
    }

    pub fn sm_count(self) -> u32 {
        match self {
            MigModel::A100Sxm40Gb | MigModel::A100Sxm80Gb => 108,
            MigModel::H100Hbm3_80Gb | MigModel::H200_141Gb => 132,
        }
    }

    /// The GI profiles, in the reference table's order: 1g, 1g+me, 1g with two memory
    /// slices, 2g, 3g, 4g, 7g.
    pub fn gi_rows(self) -> [GiRow; 7] {
        // (name, MiB, SMs) per row. Memory in the reference is in GiB with two
        // decimals (nvidia-smi rounds MiB values): 9.62 GiB is 9856 MiB, 19.62 GiB is
        // 20096 MiB.
        let t: [(&'static str, u64, u32); 7] = match self {
            MigModel::A100Sxm40Gb => [
                ("1g.5gb", 4864, 14),
                ("1g.5gb+me", 4864, 14),
                ("1g.10gb", 9856, 14),
                ("2g.10gb", 9856, 28),
                ("3g.20gb", 19968, 42),
                ("4g.20gb", 20096, 56),
                ("7g.40gb", 40448, 98),
            ],
            // 1g.20gb and 7g.80gb are marked unconfirmed in the reference; the values
            // are those NVIDIA's MIG user guide lists (19.50 and 78.75 GiB).
            MigModel::A100Sxm80Gb => [
                ("1g.10gb", 9728, 14),
                ("1g.10gb+me", 9728, 14),
                ("1g.20gb", 19968, 14),
                ("2g.20gb", 19968, 28),
                ("3g.40gb", 40192, 42),
                ("4g.40gb", 40192, 56),
                ("7g.80gb", 80640, 98),
            ],
            MigModel::H100Hbm3_80Gb => [
                ("1g.10gb", 9984, 16),
                ("1g.10gb+me", 9984, 16),
                ("1g.20gb", 20096, 26),
                ("2g.20gb", 20096, 32),
                ("3g.40gb", 40448, 60),
                ("4g.40gb", 40448, 64),
                ("7g.80gb", 81152, 132),
            ],
            // As a real H200 (driver 580.159.04) reports them: 32.5 and 69.75 GiB
            // for the 35gb and 71gb profiles, 140 GiB for the 7g.
            MigModel::H200_141Gb => [
                ("1g.18gb", 16384, 16),
                ("1g.18gb+me", 16384, 16),
                ("1g.35gb", 33280, 26),
                ("2g.35gb", 33280, 32),
                ("3g.71gb", 71424, 60),
                ("4g.71gb", 71424, 64),
                ("7g.141gb", 143360, 132),
            ],
        };
        // (NVML id, driver id, compute slices, memory slices, max count, starts) per row.
        type Shape = (u32, u32, u32, u32, u32, &'static [u32]);
        const SHAPES: [Shape; 7] = [
            (GI_PROFILE_1_SLICE, 19, 1, 1, 7, &[0, 1, 2, 3, 4, 5, 6]),
            (GI_PROFILE_1_SLICE_REV1, 20, 1, 1, 1, &[0, 1, 2, 3, 4, 5, 6]),
            (GI_PROFILE_1_SLICE_REV2, 15, 1, 2, 4, &[0, 2, 4, 6]),
            (GI_PROFILE_2_SLICE, 14, 2, 2, 3, &[0, 2, 4]),
            (GI_PROFILE_3_SLICE, 9, 3, 4, 2, &[0, 4]),
            (GI_PROFILE_4_SLICE, 5, 4, 4, 1, &[0]),
            (GI_PROFILE_7_SLICE, 0, 7, 8, 1, &[0]),
        ];
        std::array::from_fn(|i| {
            let (id, driver_id, slices, memory_slices, max_count, starts) = SHAPES[i];
            GiRow {
                id,
                driver_id,
                name: t[i].0,
                slices,
                memory_slices,
                memory_mib: t[i].1,
                sm_count: t[i].2,
                max_count,
                starts,
                media_extensions: id == GI_PROFILE_1_SLICE_REV1,
            }
        })
    }

    /// One GI profile by NVML id.
    pub fn gi_row(self, profile: u32) -> Option<GiRow> {
        self.gi_rows().into_iter().find(|r| r.id == profile)
    }

    /// SMs of an n-slice compute instance smaller than its GI: those of the plain
    /// n-slice GI profile (0 for a slice count without one).
    pub fn sm_of_slices(self, slices: u32) -> u32 {
        let id = match slices {
            1 => GI_PROFILE_1_SLICE,
            2 => GI_PROFILE_2_SLICE,
            3 => GI_PROFILE_3_SLICE,
            4 => GI_PROFILE_4_SLICE,
            7 => GI_PROFILE_7_SLICE,
            _ => return 0,
        };
        self.gi_row(id).map_or(0, |r| r.sm_count)
    }
}

/// `NVML_COMPUTE_INSTANCE_PROFILE_<N>_SLICE` for N compute slices, per NVML's numbering
/// (1c=0, 2c=1, 3c=2, 4c=3, 7c=4, 8c=5, 6c=6).
pub fn ci_profile_id(slices: u32) -> Option<u32> {
    match slices {
        1 => Some(0),
        2 => Some(1),
        3 => Some(2),
        4 => Some(3),
        7 => Some(4),
        8 => Some(5),
        6 => Some(6),
        _ => None,
    }
}

/// The compute-instance profiles a GI with `gi_slices` compute slices allows, as
/// (CI compute slices, max count), from the reference table.
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn every_model_has_the_seven_profiles_in_table_order() {
        for m in MigModel::ALL {
            let ids: Vec<u32> = m.gi_rows().iter().map(|r| r.id).collect();
            assert_eq!(ids, [0, 7, 9, 1, 2, 3, 4], "{m:?}");
            let me: Vec<&str> = m
                .gi_rows()
                .iter()
                .filter(|r| r.media_extensions)
                .map(|r| r.name)
                .collect();
            assert_eq!(me.len(), 1, "{m:?}");
            assert!(me[0].ends_with("+me"), "{m:?}");
            assert_eq!(
                m.sm_of_slices(7),
                m.gi_row(GI_PROFILE_7_SLICE).unwrap().sm_count
            );
        }
    }
}
