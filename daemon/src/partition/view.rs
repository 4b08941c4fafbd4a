//! What the planner sees and what it is asked: a tenant's [`Shape`], and per GPU a
//! [`GpuView`] of its profiles, MIG instances and MPS shares.

use serde::{Deserialize, Serialize};

use crate::gpu::{GiProfile, GpuInfo, MpsMode, Placement};

/// What a tenant asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Shape {
    /// A MIG instance of a GI profile (e.g. "1g.10gb"), optionally one CI profile
    /// inside it (e.g. "1c"); None = the CI spanning the whole GI.
    Mig {
        profile: String,
        compute_profile: Option<String>,
    },
    /// An MPS share: SM percentage 1..=100 and a device-memory limit in bytes, with
    /// its own control daemon (isolated) or on the GPU's shared server (shared).
    Mps {
        sm_percent: u32,
        memory_bytes: u64,
        #[serde(default)]
        mode: MpsMode,
    },
    /// The whole GPU: excludes any other partition on it.
    WholeGpu,
    /// An MPS share on a MIG instance of a GI profile: SM percentage 1..=100 of the
    /// instance and a memory limit within it; the instance's one MPS server serves
    /// the shares of one tenant (planned by [`plan_mig_mps`]).
    MigMps {
        profile: String,
        sm_percent: u32,
        memory_bytes: u64,
    },
}

/// A MIG instance that exists on a GPU (leased, or free in the static pool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OccupiedMig {
    pub gi_profile_id: u32,
    pub placement: Placement,
    /// Some(partition id) when it is a free static-pool partition a lease may take.
    pub free_static: Option<String>,
}

/// One MPS share on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MpsShare {
    pub sm_percent: u32,
    pub memory_bytes: u64,
    pub mode: MpsMode,
}

/// The MPS shares admitted on one GPU, summed: all MPS admission needs, at a cost
/// that does not grow with the number of shares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MpsLoad {
    /// How many shares.
    pub shares: u32,
    /// How many of them are in the shared MPS mode (the rest are isolated).
    pub shared: u32,
    /// Their SM percentages, summed.
    pub sm_percent: u64,
    /// Their memory limits, summed.
    pub memory_bytes: u128,
}

impl MpsLoad {
    pub fn push(&mut self, s: MpsShare) {
        self.shares = self.shares.saturating_add(1);
        if s.mode == MpsMode::Shared {
            self.shared = self.shared.saturating_add(1);
        }
        self.sm_percent += u64::from(s.sm_percent);
        self.memory_bytes += u128::from(s.memory_bytes);
    }

    /// Takes one share of this size out again.
    pub fn remove(&mut self, s: MpsShare) {
        self.shares = self.shares.saturating_sub(1);
        if s.mode == MpsMode::Shared {
            self.shared = self.shared.saturating_sub(1);
        }
        self.sm_percent = self.sm_percent.saturating_sub(u64::from(s.sm_percent));
        self.memory_bytes = self.memory_bytes.saturating_sub(u128::from(s.memory_bytes));
    }

    pub fn len(&self) -> usize {
        self.shares as usize
    }

    /// The mode the GPU's shares are in (none without shares).
    pub fn mode(&self) -> Option<MpsMode> {
        match (self.shares, self.shared) {
            (0, _) => None,
            (_, 0) => Some(MpsMode::Isolated),
            _ => Some(MpsMode::Shared),
        }
    }

    /// The mode the GPU's shares are in when it is not `mode` (a GPU serves one MPS
    /// mode at a time).
    pub fn other_mode(&self, mode: MpsMode) -> Option<MpsMode> {
        let isolated = self.shares.saturating_sub(self.shared);
        match mode {
            MpsMode::Isolated if self.shared > 0 => Some(MpsMode::Shared),
            MpsMode::Shared if isolated > 0 => Some(MpsMode::Isolated),
            _ => None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.shares == 0
    }
}

impl FromIterator<MpsShare> for MpsLoad {
    fn from_iter<I: IntoIterator<Item = MpsShare>>(iter: I) -> Self {
        let mut load = MpsLoad::default();
        for s in iter {
            load.push(s);
        }
        load
    }
}

/// Everything the planner needs to know about one GPU.
#[derive(Debug, Clone)]
pub struct GpuView {
    pub info: GpuInfo,
    /// GI profiles NVML reports for this GPU (empty when MIG is off).
    pub profiles: Vec<GiProfile>,
    /// MIG instances present (leased, pending, or free static ones).
    pub mig: Vec<OccupiedMig>,
    /// The MPS shares admitted here.
    pub mps: MpsLoad,
    /// A whole-GPU lease holds this GPU.
    pub whole_leased: bool,
}

impl GpuView {
    /// Count the region of GI profile `gi_profile_id` at `placement` as present (an
    /// instance that is never free and never moves): what a held region is to the
    /// planner.
    pub fn hold_region(&mut self, gi_profile_id: u32, placement: Placement) {
        self.mig.push(OccupiedMig {
            gi_profile_id,
            placement,
            free_static: None,
        });
    }

    /// The GI profile of this name ("1g.10gb", any case) this GPU offers.
    pub fn gi_profile(&self, name: &str) -> Option<&GiProfile> {
        self.profiles
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(name))
    }
}
