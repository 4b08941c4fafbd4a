//! GPU backends: one trait, two implementations.
//!
//! * [`nvml::NvmlBackend`] talks to the NVIDIA driver through nvml-wrapper.
//! * [`sim::SimBackend`] is a faithful model of NVML for A100/H100/H200 (the default
//!   backend on hosts without NVIDIA GPUs). Its hardware state lives in a state file,
//!   outside the daemon's database, because real MIG instances outlive a daemon restart.
//!
//! The trait is synchronous, like NVML. Callers serialise hardware changes per GPU.
//!
//! Owns: the hardware interface and the config types only it reads (`SimSection`,
//! `NvmlConfig`). May use: names, host, mps. May not touch: leases, the store, the
//! config file as a whole.

mod backend;
pub mod caps;
pub mod health;
pub mod nvml;
pub mod profiles;
pub mod sim;
pub mod sim_control;
pub mod topology;
mod types;

pub use backend::GpuBackend;
pub use health::{HealthCause, HealthEvent};
pub use nvml::{NvmlBackend, NvmlConfig};
pub use profiles::GpuModel;
pub use sim::{SimBackend, SimConfig, SimGpuConfig};
pub use topology::{GpuLink, SimTopology, TopologyLevel};
pub use types::{
    CiProfile, GiProfile, GpuError, GpuInfo, GpuProcess, MigInstance, MigMinors, NvmlCode,
    Placement, Utilization,
};

use std::path::PathBuf;

pub use crate::mps::{MpsDaemon, MpsMode, MpsSpec};

#[derive(Debug, Clone)]
pub struct SimSection {
    /// The simulator's hardware state (outside the daemon's database: real MIG
    /// instances outlive a daemon restart).
    pub state_file: PathBuf,
    pub gpus: sim::SimConfig,
}

/// Open the simulated GPUs of the config's `[sim]` section.
pub fn open_sim(section: &SimSection) -> Result<sim::SimBackend, GpuError> {
    if let Some(dir) = section.state_file.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(|source| GpuError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    sim::SimBackend::open(&section.gpus, &section.state_file)
}

/// Open the NVIDIA driver through NVML (fails with a clear message without one).
pub fn open_nvml(cfg: &NvmlConfig) -> Result<NvmlBackend, GpuError> {
    NvmlBackend::new(cfg)
}
