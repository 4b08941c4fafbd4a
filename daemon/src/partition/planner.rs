//! Placement planner. SCAFFOLD: the planner work replaces this body.

use serde::{Deserialize, Serialize};

use super::{GpuView, Shape};
use crate::gpu::Placement;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    #[default]
    BestFit,
    FirstFit,
}

#[derive(Debug, Clone)]
pub struct PlanOptions {
    pub strategy: Strategy,
    /// Allow the sum of MPS SM percentages on a GPU to exceed 100.
    pub mps_oversubscribe: bool,
    /// Create MIG instances on demand (else only the static pool is used).
    pub dynamic_mig: bool,
    /// Only consider this GPU.
    pub gpu_index: Option<u32>,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            strategy: Strategy::BestFit,
            mps_oversubscribe: false,
            dynamic_mig: true,
            gpu_index: None,
        }
    }
}

/// Where a shape goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanDecision {
    /// Create a new GI (+CI) at this placement.
    NewMig {
        gpu: u32,
        gi_profile_id: u32,
        placement: Placement,
        ci_profile_id: Option<u32>,
    },
    /// Take this free static-pool partition.
    Static { gpu: u32, partition_id: String },
    Mps { gpu: u32 },
    WholeGpu { gpu: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("invalid shape: {0}")]
    InvalidShape(String),
    #[error("unknown MIG profile {profile:?}; this node offers: {known}")]
    UnknownProfile { profile: String, known: String },
    #[error("no capacity: {0}")]
    NoCapacity(String),
}

pub fn plan(shape: &Shape, gpus: &[GpuView], opts: &PlanOptions) -> Result<PlanDecision, PlanError> {
    let _ = (shape, gpus, opts);
    Err(PlanError::NoCapacity("planner not yet written".into()))
}

/// How many more instances of each GI profile could be created now: (profile id, count).
pub fn free_capacity(view: &GpuView) -> Vec<(u32, u32)> {
    let _ = view;
    Vec::new()
}

/// Memory slices (of 8) in use on a GPU.
pub fn used_memory_slices(view: &GpuView) -> u32 {
    view.mig.iter().map(|m| m.placement.size).sum()
}
