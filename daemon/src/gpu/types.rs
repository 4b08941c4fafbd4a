//! What the GPU layer speaks: GPUs, MIG profiles, placements and instances,
//! processes, and its error type.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::health::HealthCause;

/// Every `nvmlReturn_t` NVML defines but success, by name (`NVML_ERROR_<NAME>`), so
/// that no driver answer is reported as "unknown" when NVML named it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NvmlCode {
    /// 1
    Uninitialized,
    /// 2
    InvalidArgument,
    /// 3
    NotSupported,
    /// 4
    NoPermission,
    /// 5
    AlreadyInitialized,
    /// 6
    NotFound,
    /// 7: an in/out count was smaller than what NVML had to return.
    InsufficientSize,
    /// 8
    InsufficientPower,
    /// 9
    DriverNotLoaded,
    /// 10
    Timeout,
    /// 11
    IrqIssue,
    /// 12
    LibraryNotFound,
    /// 13
    FunctionNotFound,
    /// 14
    CorruptedInforom,
    /// 15: the GPU has fallen off the bus.
    GpuIsLost,
    /// 16
    ResetRequired,
    /// 17
    OperatingSystem,
    /// 18
    LibRmVersionMismatch,
    /// 19
    InUse,
    /// 20
    Memory,
    /// 21
    NoData,
    /// 22
    VgpuEccNotSupported,
    /// 23
    InsufficientResources,
    /// 24
    FreqNotSupported,
    /// 25
    ArgumentVersionMismatch,
    /// 26
    Deprecated,
    /// 27
    NotReady,
    /// 28
    GpuNotFound,
    /// 29
    InvalidState,
    /// 30
    ResetTypeNotSupported,
    /// 999, and any number NVML has not defined.
    Unknown,
}

impl NvmlCode {
    /// Every code, in `nvmlReturn_t` order.
    pub const ALL: [NvmlCode; 31] = [
        NvmlCode::Uninitialized,
        NvmlCode::InvalidArgument,
        NvmlCode::NotSupported,
        NvmlCode::NoPermission,
        NvmlCode::AlreadyInitialized,
        NvmlCode::NotFound,
        NvmlCode::InsufficientSize,
        NvmlCode::InsufficientPower,
        NvmlCode::DriverNotLoaded,
        NvmlCode::Timeout,
        NvmlCode::IrqIssue,
        NvmlCode::LibraryNotFound,
        NvmlCode::FunctionNotFound,
        NvmlCode::CorruptedInforom,
        NvmlCode::GpuIsLost,
        NvmlCode::ResetRequired,
        NvmlCode::OperatingSystem,
        NvmlCode::LibRmVersionMismatch,
        NvmlCode::InUse,
        NvmlCode::Memory,
        NvmlCode::NoData,
        NvmlCode::VgpuEccNotSupported,
        NvmlCode::InsufficientResources,
        NvmlCode::FreqNotSupported,
        NvmlCode::ArgumentVersionMismatch,
        NvmlCode::Deprecated,
        NvmlCode::NotReady,
        NvmlCode::GpuNotFound,
        NvmlCode::InvalidState,
        NvmlCode::ResetTypeNotSupported,
        NvmlCode::Unknown,
    ];

    /// NVML's name of the code (`NVML_ERROR_IN_USE`).
    pub fn name(self) -> &'static str {
        const NAMES: [&str; 31] = [
            "NVML_ERROR_UNINITIALIZED",
            "NVML_ERROR_INVALID_ARGUMENT",
            "NVML_ERROR_NOT_SUPPORTED",
            "NVML_ERROR_NO_PERMISSION",
            "NVML_ERROR_ALREADY_INITIALIZED",
            "NVML_ERROR_NOT_FOUND",
            "NVML_ERROR_INSUFFICIENT_SIZE",
            "NVML_ERROR_INSUFFICIENT_POWER",
            "NVML_ERROR_DRIVER_NOT_LOADED",
            "NVML_ERROR_TIMEOUT",
            "NVML_ERROR_IRQ_ISSUE",
            "NVML_ERROR_LIBRARY_NOT_FOUND",
            "NVML_ERROR_FUNCTION_NOT_FOUND",
            "NVML_ERROR_CORRUPTED_INFOROM",
            "NVML_ERROR_GPU_IS_LOST",
            "NVML_ERROR_RESET_REQUIRED",
            "NVML_ERROR_OPERATING_SYSTEM",
            "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
            "NVML_ERROR_IN_USE",
            "NVML_ERROR_MEMORY",
            "NVML_ERROR_NO_DATA",
            "NVML_ERROR_VGPU_ECC_NOT_SUPPORTED",
            "NVML_ERROR_INSUFFICIENT_RESOURCES",
            "NVML_ERROR_FREQ_NOT_SUPPORTED",
            "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
            "NVML_ERROR_DEPRECATED",
            "NVML_ERROR_NOT_READY",
            "NVML_ERROR_GPU_NOT_FOUND",
            "NVML_ERROR_INVALID_STATE",
            "NVML_ERROR_RESET_TYPE_NOT_SUPPORTED",
            "NVML_ERROR_UNKNOWN",
        ];
        NvmlCode::ALL
            .iter()
            .position(|c| *c == self)
            .map_or("NVML_ERROR_UNKNOWN", |i| NAMES[i])
    }

    /// The `nvmlReturn_t` value.
    pub fn value(self) -> u32 {
        match self {
            NvmlCode::Unknown => 999,
            // The codes 1..=30 are in order in ALL.
            c => NvmlCode::ALL
                .iter()
                .position(|x| *x == c)
                .map_or(999, |i| i as u32 + 1),
        }
    }

    /// The code of an `nvmlReturn_t` value (None for success).
    pub fn from_value(v: u32) -> Option<NvmlCode> {
        match v {
            0 => None,
            1..=30 => Some(NvmlCode::ALL[v as usize - 1]),
            _ => Some(NvmlCode::Unknown),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// An NVML call failed with a return code (the sim reproduces these codes).
    #[error("{call} failed: {}: {detail}", code.name())]
    Nvml {
        call: &'static str,
        code: NvmlCode,
        detail: String,
    },
    #[error("no GPU with index {0}")]
    NoSuchGpu(u32),
    #[error("MIG mode is disabled on GPU {0}")]
    MigDisabled(u32),
    #[error("unknown GPU-instance profile id {profile_id} on GPU {gpu}")]
    UnknownProfile { gpu: u32, profile_id: u32 },
    #[error("NVIDIA driver not usable: {0}")]
    DriverUnavailable(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: corrupt state file: {detail}")]
    CorruptState { path: PathBuf, detail: String },
    #[error("MPS control for {lease}: {detail}")]
    Mps { lease: String, detail: String },
    /// The blocking task that ran a hardware call panicked or was cancelled.
    #[error("hardware call did not complete: {0}")]
    Task(String),
    /// A host operation around a hardware step (the MPS directories).
    #[error(transparent)]
    Host(#[from] crate::host::HostError),
}

impl GpuError {
    /// The NVML code, when the failure came from NVML (or the sim's model of it).
    pub fn nvml_code(&self) -> Option<NvmlCode> {
        match self {
            GpuError::Nvml { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// One physical GPU as the backend sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    /// Marketing name as NVML reports it, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    pub memory_bytes: u64,
    /// Minor number of /dev/nvidia<N>.
    pub minor: u32,
    pub pci_bus_id: String,
    pub mig_current: bool,
    pub mig_pending: bool,
    pub sm_count: u32,
    /// Set when a query of this GPU failed while it was read (its handle, memory,
    /// UUID...): the fields NVML did not answer are empty, and the GPU is kept out of
    /// service until it answers again. None for a GPU read whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<HealthCause>,
}

/// A compute-instance profile available inside a GI profile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CiProfile {
    /// NVML CI profile id (`NVML_COMPUTE_INSTANCE_PROFILE_*`).
    pub id: u32,
    /// e.g. "1c", "2c", "7c".
    pub name: String,
    pub slices: u32,
    pub max_count: u32,
    pub sm_count: u32,
}

/// A possible placement: start and size in memory slices (8 per GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Placement {
    pub start: u32,
    pub size: u32,
}

impl Placement {
    pub fn end(&self) -> u32 {
        self.start + self.size
    }
    pub fn overlaps(&self, other: &Placement) -> bool {
        self.start < other.end() && other.start < self.end()
    }
}

/// A GPU-instance profile as NVML reports it for one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GiProfile {
    /// NVML profile id (`NVML_GPU_INSTANCE_PROFILE_*`), e.g. 0 for 1 slice.
    pub id: u32,
    /// Name as `nvidia-smi mig -lgip` prints it, e.g. "1g.10gb", "1g.10gb+me".
    pub name: String,
    /// Compute slices (the "Ng" of the name).
    pub slices: u32,
    /// Memory slices (placement size).
    pub memory_slices: u32,
    pub memory_bytes: u64,
    pub sm_count: u32,
    pub max_count: u32,
    /// Possible placements, from `nvmlDeviceGetGpuInstancePossiblePlacements`.
    pub placements: Vec<Placement>,
    pub ci_profiles: Vec<CiProfile>,
    /// True for "+me" profiles (all media engines).
    pub media_extensions: bool,
}

impl GiProfile {
    /// The CI profile of this name inside the GI ("1c", any case).
    pub fn ci_profile(&self, name: &str) -> Option<&CiProfile> {
        self.ci_profiles
            .iter()
            .find(|ci| ci.name.eq_ignore_ascii_case(name))
    }
}

/// A MIG instance: one GI with (normally) one CI, created and destroyed as a unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInstance {
    pub gpu: u32,
    pub gi_id: u32,
    pub gi_profile_id: u32,
    pub placement: Placement,
    /// None when a GI exists without a CI (a half-done create, or made by another tool).
    pub ci_id: Option<u32>,
    pub ci_profile_id: Option<u32>,
    /// `MIG-<uuid>`; changes on every re-create.
    pub uuid: String,
    pub memory_bytes: u64,
    pub sm_count: u32,
}

/// A process using a GPU or MIG instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    pub pid: u32,
    pub used_memory_bytes: u64,
    /// Set when the process runs inside a MIG instance.
    pub gi_id: Option<u32>,
    pub ci_id: Option<u32>,
}

/// The nvidia-caps minors from `/proc/driver/nvidia-caps/mig-minors`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigMinors {
    pub config: Option<u32>,
    pub monitor: Option<u32>,
    /// (gpu, gi) -> minor of `gpu<N>/gi<X>/access`.
    pub gi_access: std::collections::BTreeMap<(u32, u32), u32>,
    /// (gpu, gi, ci) -> minor of `gpu<N>/gi<X>/ci<Y>/access`.
    pub ci_access: std::collections::BTreeMap<(u32, u32, u32), u32>,
}

/// Utilisation as NVML reports it (per GPU).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Utilization {
    pub gpu_percent: u32,
    pub memory_used_bytes: u64,
}

impl crate::mps::MpsError {
    /// As the backend trait's error, naming the lease.
    pub fn into_gpu_error(self, lease_id: &str) -> GpuError {
        GpuError::Mps {
            lease: lease_id.to_owned(),
            detail: self.to_string(),
        }
    }
}

impl HealthCause {
    /// The cause a failed hardware query stands for: fallen off the bus for
    /// `GPU_IS_LOST`, the failing query otherwise.
    pub fn of_error(e: &GpuError) -> HealthCause {
        match e.nvml_code() {
            Some(NvmlCode::GpuIsLost) => HealthCause::Lost,
            _ => HealthCause::Nvml {
                error: e.to_string(),
            },
        }
    }
}
