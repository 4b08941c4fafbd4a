//! The GPU models the fake serves: A100-SXM4-40GB/80GB, H100-SXM5-80GB, H200-141GB.
//! Their MIG tables (NVIDIA's published profile and placement tables) are
//! `tessera_common::mig`, the daemon's simulator's too.

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

use tessera_common::mig::MigModel;
pub use tessera_common::mig::{GiRow, ci_layout, ci_profile_id};

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

    /// The model's row in the MIG tables.
    fn mig(self) -> MigModel {
        match self {
            Model::A100_40 => MigModel::A100Sxm40Gb,
            Model::A100_80 => MigModel::A100Sxm80Gb,
            Model::H100_80 => MigModel::H100Hbm3_80Gb,
            Model::H200_141 => MigModel::H200_141Gb,
        }
    }

    pub fn name(self) -> &'static str {
        self.mig().marketing_name()
    }

    pub fn memory_bytes(self) -> u64 {
        self.mig().memory_bytes()
    }

    pub fn sm_count(self) -> u32 {
        self.mig().sm_count()
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
        self.mig().gi_rows()
    }

    pub fn gi_row(self, profile: u32) -> Option<GiRow> {
        self.mig().gi_row(profile)
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
        self.mig().sm_of_slices(slices)
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
