//! The real backend: NVML through nvml-wrapper, plus the raw MIG calls nvml-wrapper
//! has no safe wrappers for (through `Nvml::lib()`, the loaded `nvml-wrapper-sys`
//! bindings). Every symbol is looked up through its `Result` field, so a driver that
//! lacks one yields an error, never a panic.
//!
//! Profiles and placements come from the driver (`nvmlDeviceGetGpuInstanceProfileInfoV`,
//! `nvmlDeviceGetGpuInstancePossiblePlacements_v2`), not from the reference tables. CI
//! profiles can only be read through an existing GI; for a GI profile without one, the
//! reference CI layout is used with the SM counts the driver reports for the GI
//! profiles (see [`profiles::ci_profiles_for`]).

use std::collections::BTreeMap;
use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings as sys;
use serde::{Deserialize, Serialize};

use super::backend::GpuBackend;
use super::caps;
use super::health::{HealthCause, HealthEvent};
use super::profiles::{self, GpuModel};
use super::topology::{GpuLink, TopologyLevel};
use super::types::{
    CiProfile, GiProfile, GpuError, GpuInfo, GpuProcess, MigInstance, MigMinors, NvmlCode,
    Placement, Utilization,
};
use crate::mps::{MpsConfig, MpsControl, MpsDaemon, MpsSpec};

/// Where the driver lists the nvidia-caps minors.
pub const MIG_MINORS_PATH: &str = "/proc/driver/nvidia-caps/mig-minors";
const MIB: u64 = 1024 * 1024;
/// Slots allocated at least for instance lists (a GPU has 8 memory slices), in case
/// a driver reports a smaller instance count than it returns.
const MIN_BUFFER: usize = 8;

fn default_mig_minors_path() -> PathBuf {
    PathBuf::from(MIG_MINORS_PATH)
}

/// The `[nvml]` section of the daemon config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmlConfig {
    /// Path of libnvidia-ml; default: `libnvidia-ml.so.1` from the loader path.
    #[serde(default)]
    pub library_path: Option<PathBuf>,
    #[serde(default = "default_mig_minors_path")]
    pub mig_minors_path: PathBuf,
    #[serde(default)]
    pub mps: MpsConfig,
}

impl Default for NvmlConfig {
    fn default() -> Self {
        NvmlConfig {
            library_path: None,
            mig_minors_path: default_mig_minors_path(),
            mps: MpsConfig::default(),
        }
    }
}

/// Map a raw `nvmlReturn_t` to the daemon's codes: every code NVML defines has a name.
pub fn code_of_return(ret: sys::nvmlReturn_t) -> NvmlCode {
    NvmlCode::from_value(ret).unwrap_or(NvmlCode::Unknown)
}

/// Map an nvml-wrapper error to the daemon's codes.
#[allow(deprecated)]
pub fn code_of_error(e: &NvmlError) -> NvmlCode {
    match e {
        NvmlError::Uninitialized => NvmlCode::Uninitialized,
        NvmlError::InvalidArg => NvmlCode::InvalidArgument,
        NvmlError::NotSupported => NvmlCode::NotSupported,
        NvmlError::NoPermission => NvmlCode::NoPermission,
        NvmlError::AlreadyInitialized => NvmlCode::AlreadyInitialized,
        NvmlError::NotFound => NvmlCode::NotFound,
        NvmlError::InsufficientSize(_) => NvmlCode::InsufficientSize,
        NvmlError::InsufficientPower => NvmlCode::InsufficientPower,
        NvmlError::DriverNotLoaded => NvmlCode::DriverNotLoaded,
        NvmlError::Timeout => NvmlCode::Timeout,
        NvmlError::IrqIssue => NvmlCode::IrqIssue,
        NvmlError::LibraryNotFound | NvmlError::LibloadingError(_) => NvmlCode::LibraryNotFound,
        NvmlError::FunctionNotFound | NvmlError::FailedToLoadSymbol(_) => {
            NvmlCode::FunctionNotFound
        }
        NvmlError::CorruptedInfoROM => NvmlCode::CorruptedInforom,
        NvmlError::GpuLost => NvmlCode::GpuIsLost,
        NvmlError::ResetRequired => NvmlCode::ResetRequired,
        NvmlError::OperatingSystem => NvmlCode::OperatingSystem,
        NvmlError::LibRmVersionMismatch => NvmlCode::LibRmVersionMismatch,
        NvmlError::InUse => NvmlCode::InUse,
        NvmlError::InsufficientMemory => NvmlCode::Memory,
        NvmlError::NoData => NvmlCode::NoData,
        NvmlError::VgpuEccNotSupported => NvmlCode::VgpuEccNotSupported,
        NvmlError::UnexpectedVariant(v) => code_of_return(*v),
        _ => NvmlCode::Unknown,
    }
}

fn wrap(call: &'static str) -> impl FnOnce(NvmlError) -> GpuError {
    move |e| GpuError::Nvml {
        call,
        code: code_of_error(&e),
        detail: e.to_string(),
    }
}

/// Ok for NVML_SUCCESS, else the error named after `call`.
fn check(call: &'static str, ret: sys::nvmlReturn_t) -> Result<(), GpuError> {
    if ret == sys::nvmlReturn_enum_NVML_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Nvml {
            call,
            code: code_of_return(ret),
            detail: format!("nvmlReturn_t {ret}"),
        })
    }
}

/// A function pointer from the loaded library, or NOT_SUPPORTED if the driver lacks it.
fn sym<F: Copy, E: std::fmt::Display>(f: &Result<F, E>, call: &'static str) -> Result<F, GpuError> {
    f.as_ref().copied().map_err(|e| GpuError::Nvml {
        call,
        code: NvmlCode::NotSupported,
        detail: format!("symbol missing from libnvidia-ml: {e}"),
    })
}

/// Fill a list through an NVML call with an in/out count: `*count` goes in as the
/// buffer's size and comes back as the number written. NVML answers
/// `INSUFFICIENT_SIZE` (with the size it needs in `*count`, where it knows it) when
/// the buffer is too small: the buffer grows and the call is made again.
fn fill_list<T: Clone>(
    call: &'static str,
    first_len: usize,
    empty: T,
    mut f: impl FnMut(*mut T, &mut u32) -> sys::nvmlReturn_t,
) -> Result<Vec<T>, GpuError> {
    let mut len = first_len.max(1);
    for _ in 0..8 {
        let mut buf = vec![empty.clone(); len];
        let mut count = u32::try_from(len).unwrap_or(u32::MAX);
        let ret = f(buf.as_mut_ptr(), &mut count);
        if ret == sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE {
            len = (count as usize).max(len * 2);
            continue;
        }
        check(call, ret)?;
        buf.truncate((count as usize).min(len));
        return Ok(buf);
    }
    Err(GpuError::Nvml {
        call,
        code: NvmlCode::InsufficientSize,
        detail: format!("the list kept growing past {len} entries"),
    })
}

/// The error for a failed `nvmlInit`: clear about what to do next.
pub fn init_error(e: &NvmlError) -> GpuError {
    let msg = match e {
        NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound => format!(
            "libnvidia-ml.so.1 not found: is the NVIDIA driver installed? set backend = \"sim\" \
             to use simulated GPUs ({e})"
        ),
        NvmlError::DriverNotLoaded => format!(
            "the NVIDIA kernel driver is not loaded (nvmlInit: {e}); load it, or set backend = \
             \"sim\" to use simulated GPUs"
        ),
        NvmlError::NoPermission => {
            format!("no permission to talk to the NVIDIA driver (nvmlInit: {e})")
        }
        other => format!("nvmlInit failed: {other}"),
    };
    GpuError::DriverUnavailable(msg)
}

/// The profile name as `nvidia-smi mig -lgip` prints it ("MIG 1g.10gb" -> "1g.10gb").
pub fn profile_name(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let s = String::from_utf8_lossy(&bytes);
    s.trim().strip_prefix("MIG ").unwrap_or(s.trim()).to_owned()
}

/// `NVML_STRUCT_VERSION(name, ver)`: size of the struct | ver << 24.
const fn struct_version<T>(ver: u32) -> u32 {
    (std::mem::size_of::<T>() as u32) | (ver << 24)
}

/// One GI profile as the driver reports it, with the id NVML's create calls take.
#[derive(Debug, Clone)]
struct RawGiProfile {
    /// `NVML_GPU_INSTANCE_PROFILE_*` (what the daemon calls the profile id).
    index: u32,
    /// `nvmlGpuInstanceProfileInfo_t.id`, passed to create/list calls.
    driver_id: u32,
    name: String,
    slices: u32,
    max_count: u32,
    sm_count: u32,
    memory_bytes: u64,
    placements: Vec<Placement>,
}

/// A GI's CI profile as the driver reports it.
#[derive(Debug, Clone)]
struct RawCiProfile {
    index: u32,
    driver_id: u32,
    slices: u32,
    max_count: u32,
    sm_count: u32,
}

/// NVML, for real GPUs.
pub struct NvmlBackend {
    /// The event set the health watcher waits on, made at its first call.
    ///
    /// Declared (and so dropped) before `nvml`: freeing the set calls into
    /// libnvidia-ml, which dropping `nvml` shuts down and unloads. In the other order
    /// tesserad crashed (SIGSEGV) at every clean stop on a GPU host once the health
    /// watcher had made its set (seen on an H200, driver 580).
    events: Mutex<Option<EventSet>>,
    nvml: Nvml,
    mps: MpsControl,
    mig_minors_path: PathBuf,
    /// Serialises create/destroy so a unit (GI + CI) is never interleaved with another.
    changes: Mutex<()>,
}

/// An NVML event set handle (`nvmlEventSet_t`), freed on drop.
struct EventSet {
    raw: sys::nvmlEventSet_t,
    free: Option<unsafe extern "C" fn(sys::nvmlEventSet_t) -> sys::nvmlReturn_t>,
}

// SAFETY: an nvmlEventSet_t is an opaque handle NVML allows to be used from any
// thread; the daemon uses it from one thread at a time (behind `events`' mutex).
unsafe impl Send for EventSet {}

impl Drop for EventSet {
    fn drop(&mut self) {
        if let Some(free) = self.free {
            // SAFETY: `raw` came from nvmlEventSetCreate and is freed exactly once.
            unsafe {
                free(self.raw);
            }
        }
    }
}

/// Event types the health watcher registers for, where a GPU supports them.
const HEALTH_EVENT_TYPES: u64 =
    (sys::nvmlEventTypeXidCriticalError | sys::nvmlEventTypeDoubleBitEccError) as u64;

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("mig_minors_path", &self.mig_minors_path)
            .finish()
    }
}

impl NvmlBackend {
    /// Load libnvidia-ml and initialise NVML. Without a driver this returns
    /// `GpuError::DriverUnavailable`, never panics.
    pub fn new(config: &NvmlConfig) -> Result<Self, GpuError> {
        let nvml = match &config.library_path {
            Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
            None => Nvml::init(),
        }
        .map_err(|e| init_error(&e))?;
        Ok(NvmlBackend {
            events: Mutex::new(None),
            nvml,
            mps: MpsControl::new(&config.mps),
            mig_minors_path: config.mig_minors_path.clone(),
            changes: Mutex::new(()),
        })
    }

    /// Create the event set and register every GPU for the health events it
    /// supports. A GPU that supports none (or a driver without events) is covered by
    /// polling alone.
    fn event_set(&self) -> Result<EventSet, GpuError> {
        let lib = self.lib();
        let create = sym(&lib.nvmlEventSetCreate, "nvmlEventSetCreate")?;
        let register = sym(&lib.nvmlDeviceRegisterEvents, "nvmlDeviceRegisterEvents")?;
        let supported = sym(
            &lib.nvmlDeviceGetSupportedEventTypes,
            "nvmlDeviceGetSupportedEventTypes",
        )?;
        let mut raw: sys::nvmlEventSet_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer for the new set's handle.
        check("nvmlEventSetCreate", unsafe { create(&mut raw) })?;
        let set = EventSet {
            raw,
            free: lib.nvmlEventSetFree.as_ref().ok().copied(),
        };
        let count = self
            .nvml
            .device_count()
            .map_err(wrap("nvmlDeviceGetCount"))?;
        for gpu in 0..count {
            let dev = self.handle(gpu)?;
            let mut types: std::ffi::c_ulonglong = 0;
            // SAFETY: `dev` is a live handle of this Nvml; `types` a valid out-pointer.
            let ret = unsafe { supported(dev, &mut types) };
            let wanted = if ret == sys::nvmlReturn_enum_NVML_SUCCESS {
                types & HEALTH_EVENT_TYPES
            } else {
                0
            };
            if wanted == 0 {
                tracing::info!(gpu, "GPU reports no health events; it is polled only");
                continue;
            }
            // SAFETY: `dev` and `set.raw` are live handles of this Nvml.
            check("nvmlDeviceRegisterEvents", unsafe {
                register(dev, wanted, set.raw)
            })?;
        }
        Ok(set)
    }

    fn index_of(&self, dev: sys::nvmlDevice_t) -> Result<u32, GpuError> {
        let get = sym(&self.lib().nvmlDeviceGetIndex, "nvmlDeviceGetIndex")?;
        let mut index = 0;
        // SAFETY: `dev` came from an event of this Nvml; `index` is a valid out-pointer.
        check("nvmlDeviceGetIndex", unsafe { get(dev, &mut index) })?;
        Ok(index)
    }

    fn lib(&self) -> &sys::NvmlLib {
        self.nvml.lib()
    }

    fn lock_changes(&self) -> MutexGuard<'_, ()> {
        // The guard protects no data, only ordering: a poisoned one is still usable.
        self.changes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn device(&self, gpu: u32) -> Result<nvml_wrapper::Device<'_>, GpuError> {
        self.nvml.device_by_index(gpu).map_err(|e| match e {
            NvmlError::InvalidArg | NvmlError::NotFound => GpuError::NoSuchGpu(gpu),
            other => wrap("nvmlDeviceGetHandleByIndex")(other),
        })
    }

    fn handle(&self, gpu: u32) -> Result<sys::nvmlDevice_t, GpuError> {
        let dev = self.device(gpu)?;
        // SAFETY: the handle is only used with this `Nvml`, which stays initialised
        // for the lifetime of `self`.
        Ok(unsafe { dev.handle() })
    }

    fn mig_enabled(&self, gpu: u32) -> Result<bool, GpuError> {
        match self.device(gpu)?.mig_mode() {
            Ok(m) => Ok(m.current == sys::NVML_DEVICE_MIG_ENABLE),
            Err(NvmlError::NotSupported) => Ok(false),
            Err(e) => Err(wrap("nvmlDeviceGetMigMode")(e)),
        }
    }

    fn require_mig(&self, gpu: u32, call: &'static str) -> Result<sys::nvmlDevice_t, GpuError> {
        if !self.mig_enabled(gpu)? {
            return Err(GpuError::Nvml {
                call,
                code: NvmlCode::NotSupported,
                detail: format!("MIG mode is disabled on GPU {gpu}"),
            });
        }
        self.handle(gpu)
    }

    fn possible_placements(
        &self,
        dev: sys::nvmlDevice_t,
        driver_id: u32,
    ) -> Result<Vec<Placement>, GpuError> {
        const CALL: &str = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
        let f = sym(
            &self.lib().nvmlDeviceGetGpuInstancePossiblePlacements_v2,
            CALL,
        )?;
        let mut count = 0u32;
        // SAFETY: a null buffer with a count of 0 asks NVML only for the number of
        // placements.
        let ret = unsafe { f(dev, driver_id, std::ptr::null_mut(), &mut count) };
        if ret != sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE {
            check(CALL, ret)?;
        }
        let buf = fill_list(
            CALL,
            (count as usize).max(MIN_BUFFER),
            sys::nvmlGpuInstancePlacement_t { start: 0, size: 0 },
            // SAFETY: `ptr` has room for `*n` placements (fill_list's buffer), at least
            // the count NVML just gave: driver 580 writes every placement whatever
            // `*n` says (seen on an H200), so the buffer is sized by that count.
            |ptr, n| unsafe { f(dev, driver_id, ptr, n) },
        )?;
        Ok(buf
            .iter()
            .map(|p| Placement {
                start: p.start,
                size: p.size,
            })
            .collect())
    }

    /// Every GI profile this GPU supports (profile ids NVML refuses are skipped).
    fn raw_gi_profiles(&self, dev: sys::nvmlDevice_t) -> Result<Vec<RawGiProfile>, GpuError> {
        const CALL: &str = "nvmlDeviceGetGpuInstanceProfileInfoV";
        let f = sym(&self.lib().nvmlDeviceGetGpuInstanceProfileInfoV, CALL)?;
        let mut out = Vec::new();
        for index in 0..sys::NVML_GPU_INSTANCE_PROFILE_COUNT {
            // SAFETY: a zeroed plain-C struct is a valid value for NVML to fill.
            let mut info: sys::nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            info.version = struct_version::<sys::nvmlGpuInstanceProfileInfo_v2_t>(2);
            // SAFETY: `info` is a valid, versioned out-parameter for this call.
            let ret = unsafe { f(dev, index, &mut info) };
            if ret == sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
                || ret == sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
            {
                continue;
            }
            check(CALL, ret)?;
            let placements = self.possible_placements(dev, info.id)?;
            out.push(RawGiProfile {
                index,
                driver_id: info.id,
                name: profile_name(&info.name),
                slices: info.sliceCount,
                max_count: info.instanceCount,
                sm_count: info.multiprocessorCount,
                memory_bytes: info.memorySizeMB * MIB,
                placements,
            });
        }
        Ok(out)
    }

    fn raw_gi_profile(
        &self,
        gpu: u32,
        dev: sys::nvmlDevice_t,
        profile_id: u32,
    ) -> Result<RawGiProfile, GpuError> {
        self.raw_gi_profiles(dev)?
            .into_iter()
            .find(|p| p.index == profile_id)
            .ok_or(GpuError::UnknownProfile { gpu, profile_id })
    }

    /// The CI profiles of an existing GI.
    fn raw_ci_profiles(&self, gi: sys::nvmlGpuInstance_t) -> Result<Vec<RawCiProfile>, GpuError> {
        const CALL: &str = "nvmlGpuInstanceGetComputeInstanceProfileInfoV";
        let f = sym(
            &self.lib().nvmlGpuInstanceGetComputeInstanceProfileInfoV,
            CALL,
        )?;
        let mut out = Vec::new();
        for index in 0..sys::NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            // SAFETY: a zeroed plain-C struct is a valid value for NVML to fill.
            let mut info: sys::nvmlComputeInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            info.version = struct_version::<sys::nvmlComputeInstanceProfileInfo_v2_t>(2);
            // SAFETY: `gi` is a live GI handle; `info` is a valid out-parameter.
            let ret = unsafe {
                f(
                    gi,
                    index,
                    sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    &mut info,
                )
            };
            if ret == sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
                || ret == sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
            {
                continue;
            }
            check(CALL, ret)?;
            out.push(RawCiProfile {
                index,
                driver_id: info.id,
                slices: info.sliceCount,
                max_count: info.instanceCount,
                sm_count: info.multiprocessorCount,
            });
        }
        Ok(out)
    }

    /// The GIs of one profile.
    fn gpu_instances(
        &self,
        dev: sys::nvmlDevice_t,
        profile: &RawGiProfile,
    ) -> Result<Vec<sys::nvmlGpuInstance_t>, GpuError> {
        const CALL: &str = "nvmlDeviceGetGpuInstances";
        let f = sym(&self.lib().nvmlDeviceGetGpuInstances, CALL)?;
        fill_list(
            CALL,
            (profile.max_count as usize).max(MIN_BUFFER),
            std::ptr::null_mut(),
            // SAFETY: `ptr` has room for `*n` handles (fill_list's buffer, at least
            // the profile's instance count); NVML stores the number written in `*n`.
            |ptr, n| unsafe { f(dev, profile.driver_id, ptr, n) },
        )
    }

    fn gi_info(&self, gi: sys::nvmlGpuInstance_t) -> Result<sys::nvmlGpuInstanceInfo_t, GpuError> {
        const CALL: &str = "nvmlGpuInstanceGetInfo";
        let f = sym(&self.lib().nvmlGpuInstanceGetInfo, CALL)?;
        // SAFETY: a zeroed plain-C struct is a valid value for NVML to fill.
        let mut info: sys::nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `gi` is a live GI handle; `info` is a valid out-parameter.
        check(CALL, unsafe { f(gi, &mut info) })?;
        Ok(info)
    }

    /// The CIs of one CI profile in a GI, as (handle, ci id).
    fn compute_instances(
        &self,
        gi: sys::nvmlGpuInstance_t,
        profile: &RawCiProfile,
    ) -> Result<Vec<(sys::nvmlComputeInstance_t, u32)>, GpuError> {
        const CALL: &str = "nvmlGpuInstanceGetComputeInstances";
        const INFO: &str = "nvmlComputeInstanceGetInfo_v2";
        let f = sym(&self.lib().nvmlGpuInstanceGetComputeInstances, CALL)?;
        let info_f = sym(&self.lib().nvmlComputeInstanceGetInfo_v2, INFO)?;
        let buf = fill_list(
            CALL,
            (profile.max_count as usize).max(MIN_BUFFER),
            std::ptr::null_mut(),
            // SAFETY: `ptr` has room for `*n` handles (fill_list's buffer, at least
            // the CI profile's instance count); NVML stores the number written in `*n`.
            |ptr, n| unsafe { f(gi, profile.driver_id, ptr, n) },
        )?;
        let mut out = Vec::new();
        for &ci in &buf {
            // SAFETY: a zeroed plain-C struct is a valid value for NVML to fill.
            let mut info: sys::nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: `ci` was just returned by NVML; `info` is a valid out-parameter.
            check(INFO, unsafe { info_f(ci, &mut info) })?;
            out.push((ci, info.id));
        }
        Ok(out)
    }

    /// MIG device UUIDs by (gi id, ci id).
    fn mig_uuids(&self, dev: sys::nvmlDevice_t) -> Result<BTreeMap<(u32, u32), String>, GpuError> {
        const MAX: &str = "nvmlDeviceGetMaxMigDeviceCount";
        const BY_INDEX: &str = "nvmlDeviceGetMigDeviceHandleByIndex";
        const GI_ID: &str = "nvmlDeviceGetGpuInstanceId";
        const CI_ID: &str = "nvmlDeviceGetComputeInstanceId";
        let max_f = sym(&self.lib().nvmlDeviceGetMaxMigDeviceCount, MAX)?;
        let by_index = sym(&self.lib().nvmlDeviceGetMigDeviceHandleByIndex, BY_INDEX)?;
        let gi_f = sym(&self.lib().nvmlDeviceGetGpuInstanceId, GI_ID)?;
        let ci_f = sym(&self.lib().nvmlDeviceGetComputeInstanceId, CI_ID)?;
        let mut max = 0u32;
        // SAFETY: `dev` is a live device handle; `max` is a valid out-parameter.
        check(MAX, unsafe { max_f(dev, &mut max) })?;
        let mut out = BTreeMap::new();
        for i in 0..max {
            let mut mig: sys::nvmlDevice_t = std::ptr::null_mut();
            // SAFETY: `dev` is a live device handle; `mig` is a valid out-parameter.
            let ret = unsafe { by_index(dev, i, &mut mig) };
            if ret == sys::nvmlReturn_enum_NVML_ERROR_NOT_FOUND {
                continue;
            }
            check(BY_INDEX, ret)?;
            let (mut gi, mut ci) = (0u32, 0u32);
            // SAFETY: `mig` is the MIG device handle NVML just returned.
            check(GI_ID, unsafe { gi_f(mig, &mut gi) })?;
            // SAFETY: as above.
            check(CI_ID, unsafe { ci_f(mig, &mut ci) })?;
            // SAFETY: `mig` is a valid device handle belonging to `self.nvml`.
            let device = unsafe { nvml_wrapper::Device::new(mig, &self.nvml) };
            let uuid = device.uuid().map_err(wrap("nvmlDeviceGetUUID"))?;
            out.insert((gi, ci), uuid);
        }
        Ok(out)
    }

    fn destroy_gi_handle(&self, gi: sys::nvmlGpuInstance_t) -> Result<(), GpuError> {
        const CALL: &str = "nvmlGpuInstanceDestroy";
        let f = sym(&self.lib().nvmlGpuInstanceDestroy, CALL)?;
        // SAFETY: `gi` is a live GI handle; it is not used after this call.
        check(CALL, unsafe { f(gi) })
    }

    /// Create the CI inside a fresh GI; returns (ci id, CI profile index, SMs).
    fn create_ci(
        &self,
        gi: sys::nvmlGpuInstance_t,
        gi_slices: u32,
        ci_profile_id: Option<u32>,
    ) -> Result<(u32, u32, u32), GpuError> {
        const CALL: &str = "nvmlGpuInstanceCreateComputeInstance";
        const INFO: &str = "nvmlComputeInstanceGetInfo_v2";
        let cis = self.raw_ci_profiles(gi)?;
        let chosen = match ci_profile_id {
            Some(id) => cis.iter().find(|c| c.index == id),
            None => cis.iter().find(|c| c.slices == gi_slices),
        }
        .ok_or_else(|| GpuError::Nvml {
            call: CALL,
            code: NvmlCode::InvalidArgument,
            detail: format!("CI profile {ci_profile_id:?} is not available in this GI"),
        })?;
        let f = sym(&self.lib().nvmlGpuInstanceCreateComputeInstance, CALL)?;
        let info_f = sym(&self.lib().nvmlComputeInstanceGetInfo_v2, INFO)?;
        let mut ci: sys::nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: `gi` is a live GI handle; `ci` is a valid out-parameter.
        check(CALL, unsafe { f(gi, chosen.driver_id, &mut ci) })?;
        // SAFETY: a zeroed plain-C struct is a valid value for NVML to fill.
        let mut info: sys::nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `ci` was just created; `info` is a valid out-parameter.
        check(INFO, unsafe { info_f(ci, &mut info) })?;
        Ok((info.id, chosen.index, chosen.sm_count))
    }

    fn find_gi(
        &self,
        dev: sys::nvmlDevice_t,
        gi_id: u32,
    ) -> Result<sys::nvmlGpuInstance_t, GpuError> {
        const CALL: &str = "nvmlDeviceGetGpuInstanceById";
        let f = sym(&self.lib().nvmlDeviceGetGpuInstanceById, CALL)?;
        let mut gi: sys::nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: `dev` is a live device handle; `gi` is a valid out-parameter.
        check(CALL, unsafe { f(dev, gi_id, &mut gi) })?;
        Ok(gi)
    }
}

impl NvmlBackend {
    /// Everything the daemon knows of one GPU, or the first query that failed.
    fn read_device(&self, index: u32) -> Result<GpuInfo, GpuError> {
        let d = self.device(index)?;
        let name = d.name().map_err(wrap("nvmlDeviceGetName"))?;
        let (mig_current, mig_pending) = match d.mig_mode() {
            Ok(m) => (
                m.current == sys::NVML_DEVICE_MIG_ENABLE,
                m.pending == sys::NVML_DEVICE_MIG_ENABLE,
            ),
            Err(NvmlError::NotSupported) => (false, false),
            Err(e) => return Err(wrap("nvmlDeviceGetMigMode")(e)),
        };
        // NVML reports SM counts for MIG devices only: use it when it answers,
        // else the known model's count (0 for a model the tables do not know).
        let sm_count = d
            .attributes()
            .map(|a| a.multiprocessor_count)
            .ok()
            .or_else(|| GpuModel::from_name(&name).map(GpuModel::sm_count))
            .unwrap_or(0);
        Ok(GpuInfo {
            index,
            uuid: d.uuid().map_err(wrap("nvmlDeviceGetUUID"))?,
            memory_bytes: d
                .memory_info()
                .map_err(wrap("nvmlDeviceGetMemoryInfo"))?
                .total,
            minor: d.minor_number().map_err(wrap("nvmlDeviceGetMinorNumber"))?,
            pci_bus_id: d.pci_info().map_err(wrap("nvmlDeviceGetPciInfo"))?.bus_id,
            mig_current,
            mig_pending,
            sm_count,
            name,
            fault: None,
        })
    }

    /// A GPU that failed a query while it was read: what still answers (its UUID,
    /// where the handle does), and the fault. Its minor is unknown: no device node is
    /// ever granted from it (it is out of service).
    fn unreadable_device(&self, index: u32, e: &GpuError) -> GpuInfo {
        let uuid = self
            .device(index)
            .ok()
            .and_then(|d| d.uuid().ok())
            .unwrap_or_else(|| unreadable_uuid(index));
        GpuInfo {
            index,
            uuid,
            name: String::new(),
            memory_bytes: 0,
            minor: u32::MAX,
            pci_bus_id: String::new(),
            mig_current: false,
            mig_pending: false,
            sm_count: 0,
            fault: Some(HealthCause::of_error(e)),
        }
    }
}

/// The stand-in UUID of a GPU whose own cannot be read (its health mark is kept
/// under it until the GPU answers).
pub fn unreadable_uuid(index: u32) -> String {
    format!("GPU-unreadable-{index}")
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn driver_version(&self) -> Result<String, GpuError> {
        self.nvml
            .sys_driver_version()
            .map_err(wrap("nvmlSystemGetDriverVersion"))
    }

    fn devices(&self) -> Result<Vec<GpuInfo>, GpuError> {
        let count = self
            .nvml
            .device_count()
            .map_err(wrap("nvmlDeviceGetCount"))?;
        Ok((0..count)
            .map(|index| {
                self.read_device(index).unwrap_or_else(|e| {
                    tracing::warn!(gpu = index, error = %e, "GPU does not answer NVML: kept out of service");
                    self.unreadable_device(index, &e)
                })
            })
            .collect())
    }

    fn device(&self, gpu: u32) -> Result<GpuInfo, GpuError> {
        self.read_device(gpu)
    }

    fn gi_profiles(&self, gpu: u32) -> Result<Vec<GiProfile>, GpuError> {
        if !self.mig_enabled(gpu)? {
            return Ok(Vec::new());
        }
        let dev = self.handle(gpu)?;
        let raws = self.raw_gi_profiles(dev)?;
        let sm_of_slices = |n: u32| {
            raws.iter()
                .filter(|r| r.slices == n)
                .map(|r| r.sm_count)
                .min()
                .unwrap_or(0)
        };
        let mut out = Vec::new();
        for r in &raws {
            // Read CI profiles from an existing GI of this profile when there is one.
            let existing = self.gpu_instances(dev, r)?;
            let ci_profiles: Vec<CiProfile> = match existing.first() {
                Some(&gi) => self
                    .raw_ci_profiles(gi)?
                    .into_iter()
                    .map(|c| CiProfile {
                        id: c.index,
                        name: format!("{}c", c.slices),
                        slices: c.slices,
                        max_count: c.max_count,
                        sm_count: c.sm_count,
                    })
                    .collect(),
                None => profiles::ci_profiles_for(r.slices, r.sm_count, sm_of_slices),
            };
            out.push(GiProfile {
                id: r.index,
                name: r.name.clone(),
                slices: r.slices,
                memory_slices: r.placements.first().map_or(0, |p| p.size),
                memory_bytes: r.memory_bytes,
                sm_count: r.sm_count,
                max_count: r.max_count,
                placements: r.placements.clone(),
                ci_profiles,
                media_extensions: r.name.contains("+me"),
            });
        }
        Ok(out)
    }

    fn create_instance(
        &self,
        gpu: u32,
        gi_profile_id: u32,
        placement: Placement,
        ci_profile_id: Option<u32>,
    ) -> Result<MigInstance, GpuError> {
        const CALL: &str = "nvmlDeviceCreateGpuInstanceWithPlacement";
        let _guard = self.lock_changes();
        let dev = self.require_mig(gpu, CALL)?;
        let profile = self.raw_gi_profile(gpu, dev, gi_profile_id)?;
        let f = sym(&self.lib().nvmlDeviceCreateGpuInstanceWithPlacement, CALL)?;
        let raw_placement = sys::nvmlGpuInstancePlacement_t {
            start: placement.start,
            size: placement.size,
        };
        let mut gi: sys::nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: `dev` is a live device handle, `raw_placement` outlives the call,
        // `gi` is a valid out-parameter.
        check(CALL, unsafe {
            f(dev, profile.driver_id, &raw_placement, &mut gi)
        })?;
        let made = self
            .gi_info(gi)
            .and_then(|info| Ok((info, self.create_ci(gi, profile.slices, ci_profile_id)?)));
        let (info, (ci_id, ci_index, ci_sm)) = match made {
            Ok(v) => v,
            Err(e) => {
                // The unit rollback: no GI without its CI.
                return Err(match self.destroy_gi_handle(gi) {
                    Ok(()) => e,
                    Err(rollback) => GpuError::Nvml {
                        call: "nvmlGpuInstanceDestroy",
                        code: rollback.nvml_code().unwrap_or(NvmlCode::Unknown),
                        detail: format!(
                            "rolling back the GI after `{e}` failed too: {rollback}; the GI \
                             is left without a CI"
                        ),
                    },
                });
            }
        };
        let uuid = self
            .mig_uuids(dev)?
            .remove(&(info.id, ci_id))
            .unwrap_or_default();
        Ok(MigInstance {
            gpu,
            gi_id: info.id,
            gi_profile_id,
            placement: Placement {
                start: info.placement.start,
                size: info.placement.size,
            },
            ci_id: Some(ci_id),
            ci_profile_id: Some(ci_index),
            uuid,
            memory_bytes: profile.memory_bytes,
            sm_count: ci_sm,
        })
    }

    fn destroy_instance(&self, gpu: u32, gi_id: u32) -> Result<(), GpuError> {
        const CALL: &str = "nvmlComputeInstanceDestroy";
        let _guard = self.lock_changes();
        let dev = self.require_mig(gpu, "nvmlDeviceGetGpuInstanceById")?;
        let gi = self.find_gi(dev, gi_id)?;
        let busy: Vec<u32> = self
            .processes(gpu)?
            .iter()
            .filter(|p| p.gi_id == Some(gi_id))
            .map(|p| p.pid)
            .collect();
        if !busy.is_empty() {
            return Err(GpuError::Nvml {
                call: CALL,
                code: NvmlCode::InUse,
                detail: format!("GI {gi_id} on GPU {gpu} has running processes {busy:?}"),
            });
        }
        let f = sym(&self.lib().nvmlComputeInstanceDestroy, CALL)?;
        for c in self.raw_ci_profiles(gi)? {
            for (ci, _) in self.compute_instances(gi, &c)? {
                // SAFETY: `ci` is a live CI handle; it is not used after this call.
                check(CALL, unsafe { f(ci) })?;
            }
        }
        self.destroy_gi_handle(gi)
    }

    fn instances(&self, gpu: u32) -> Result<Vec<MigInstance>, GpuError> {
        if !self.mig_enabled(gpu)? {
            return Ok(Vec::new());
        }
        let dev = self.handle(gpu)?;
        let mut uuids = self.mig_uuids(dev)?;
        let mut out = Vec::new();
        for p in self.raw_gi_profiles(dev)? {
            for gi in self.gpu_instances(dev, &p)? {
                let info = self.gi_info(gi)?;
                let mut first_ci: Option<(u32, RawCiProfile)> = None;
                for c in self.raw_ci_profiles(gi)? {
                    for (_, ci_id) in self.compute_instances(gi, &c)? {
                        if first_ci.as_ref().is_none_or(|(id, _)| ci_id < *id) {
                            first_ci = Some((ci_id, c.clone()));
                        }
                    }
                }
                out.push(MigInstance {
                    gpu,
                    gi_id: info.id,
                    gi_profile_id: p.index,
                    placement: Placement {
                        start: info.placement.start,
                        size: info.placement.size,
                    },
                    ci_id: first_ci.as_ref().map(|(id, _)| *id),
                    ci_profile_id: first_ci.as_ref().map(|(_, c)| c.index),
                    uuid: first_ci
                        .as_ref()
                        .and_then(|(id, _)| uuids.remove(&(info.id, *id)))
                        .unwrap_or_default(),
                    memory_bytes: p.memory_bytes,
                    sm_count: first_ci.as_ref().map_or(p.sm_count, |(_, c)| c.sm_count),
                });
            }
        }
        out.sort_by_key(|i| i.gi_id);
        Ok(out)
    }

    fn processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, GpuError> {
        let d = self.device(gpu)?;
        let procs = d
            .running_compute_processes()
            .map_err(wrap("nvmlDeviceGetComputeRunningProcesses"))?;
        Ok(procs
            .into_iter()
            .map(|p| GpuProcess {
                pid: p.pid,
                used_memory_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => b,
                    UsedGpuMemory::Unavailable => 0,
                },
                gi_id: p.gpu_instance_id,
                ci_id: p.compute_instance_id,
            })
            .collect())
    }

    /// The whole table the driver publishes (every possible GI/CI of every GPU).
    fn mig_minors(&self) -> Result<MigMinors, GpuError> {
        read_mig_minors(&self.mig_minors_path)
    }

    /// GPU busy percent from `nvmlDeviceGetUtilizationRates`; NVML does not report it
    /// with MIG enabled, then it is 0 and only the memory figure is meaningful.
    fn utilization(&self, gpu: u32) -> Result<Utilization, GpuError> {
        let d = self.device(gpu)?;
        let gpu_percent = match d.utilization_rates() {
            Ok(u) => u.gpu,
            Err(NvmlError::NotSupported) => 0,
            Err(e) => return Err(wrap("nvmlDeviceGetUtilizationRates")(e)),
        };
        let memory_used_bytes = d
            .memory_info()
            .map_err(wrap("nvmlDeviceGetMemoryInfo"))?
            .used;
        Ok(Utilization {
            gpu_percent,
            memory_used_bytes,
        })
    }

    fn mps_start(&self, spec: &MpsSpec) -> Result<MpsDaemon, GpuError> {
        self.mps
            .start(spec)
            .map_err(|e| e.into_gpu_error(&spec.lease_id))
    }

    fn mps_stop(&self, lease_id: &str) -> Result<(), GpuError> {
        self.mps
            .stop(lease_id)
            .map_err(|e| e.into_gpu_error(lease_id))
    }

    fn topology(&self, a: u32, b: u32) -> Result<GpuLink, GpuError> {
        use nvml_wrapper::enum_wrappers::device::TopologyLevel as Nvml;
        use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus};
        let (da, db) = (self.device(a)?, self.device(b)?);
        if a == b {
            return Ok(GpuLink {
                level: TopologyLevel::Internal,
                nvlinks: 0,
            });
        }
        let level = match da.topology_common_ancestor(self.device(b)?) {
            Ok(Nvml::Internal) => TopologyLevel::Internal,
            Ok(Nvml::Single) => TopologyLevel::Single,
            Ok(Nvml::Multiple) => TopologyLevel::Multiple,
            Ok(Nvml::HostBridge) => TopologyLevel::HostBridge,
            Ok(Nvml::Node) => TopologyLevel::Node,
            Ok(Nvml::System) => TopologyLevel::System,
            Err(e) => return Err(wrap("nvmlDeviceGetTopologyCommonAncestor")(e)),
        };
        // NVLinks: those of `a` whose remote end is `b` (a bridge); through
        // NVSwitches the remote end is a switch, so every active link of `a` counts
        // when NVML says the two reach each other over NVLink.
        let bus_b = db.pci_info().map_err(wrap("nvmlDeviceGetPciInfo"))?.bus_id;
        let (mut direct, mut active) = (0u32, 0u32);
        for link in 0..sys::NVML_NVLINK_MAX_LINKS {
            let l = da.link_wrapper_for(link);
            if !matches!(l.is_active(), Ok(true)) {
                continue;
            }
            active += 1;
            if l.remote_pci_info().is_ok_and(|r| r.bus_id == bus_b) {
                direct += 1;
            }
        }
        let over_nvlink = matches!(
            da.p2p_status(&db, P2pCapabilitiesIndex::NvLink),
            Ok(P2pStatus::Ok)
        );
        let nvlinks = match (direct, over_nvlink) {
            (0, true) => active,
            (0, false) => 0,
            (n, _) => n,
        };
        Ok(GpuLink { level, nvlinks })
    }

    fn mps_daemons(&self) -> Result<Vec<MpsDaemon>, GpuError> {
        self.mps.daemons().map_err(|e| e.into_gpu_error(""))
    }

    fn health_events(&self, timeout: std::time::Duration) -> Result<Vec<HealthEvent>, GpuError> {
        let mut guard = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            *guard = Some(self.event_set()?);
        }
        let Some(set) = guard.as_ref() else {
            return Ok(Vec::new());
        };
        let wait = sym(&self.lib().nvmlEventSetWait_v2, "nvmlEventSetWait_v2")?;
        let mut out = Vec::new();
        let mut timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        loop {
            // SAFETY: all-zero is a valid nvmlEventData_t (plain integers and a null
            // handle); NVML fills it on success.
            let mut data: sys::nvmlEventData_t = unsafe { std::mem::zeroed() };
            // SAFETY: `set.raw` is a live event set; `data` a valid out-pointer.
            let ret = unsafe { wait(set.raw, &mut data, timeout_ms) };
            if ret == sys::nvmlReturn_enum_NVML_ERROR_TIMEOUT {
                return Ok(out);
            }
            check("nvmlEventSetWait_v2", ret)?;
            let gpu = self.index_of(data.device)?;
            // NVML reports 0xFFFFFFFF when the event is not tied to one instance.
            let gi_id = (data.gpuInstanceId != u32::MAX).then_some(data.gpuInstanceId);
            let cause = if data.eventType & u64::from(sys::nvmlEventTypeXidCriticalError) != 0 {
                HealthCause::Xid {
                    xid: data.eventData,
                }
            } else {
                HealthCause::DoubleBitEcc
            };
            out.push(HealthEvent { gpu, gi_id, cause });
            // Drain what is already queued without waiting again.
            timeout_ms = 0;
        }
    }

    fn health_poll(&self, gpu: u32) -> Result<Option<HealthCause>, GpuError> {
        // The queries the daemon needs of a GPU: one that fails takes it out of
        // service, and the same queries answering brings it back.
        if let Err(e) = self.read_device(gpu) {
            return Ok(Some(HealthCause::of_error(&e)));
        }
        let dev = self.handle(gpu)?;
        let remapped = sym(
            &self.lib().nvmlDeviceGetRemappedRows,
            "nvmlDeviceGetRemappedRows",
        );
        let Ok(remapped) = remapped else {
            return Ok(None);
        };
        let (mut corr, mut unc, mut pending, mut failed) = (0, 0, 0, 0);
        // SAFETY: `dev` is a live handle of this Nvml; the four are valid out-pointers.
        let ret = unsafe { remapped(dev, &mut corr, &mut unc, &mut pending, &mut failed) };
        Ok(match ret {
            sys::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => Some(HealthCause::Lost),
            sys::nvmlReturn_enum_NVML_SUCCESS if failed != 0 => Some(HealthCause::Xid { xid: 64 }),
            sys::nvmlReturn_enum_NVML_SUCCESS if pending != 0 => {
                Some(HealthCause::PendingRetirement)
            }
            // Not supported (pre-Ampere) or unreadable: nothing to say.
            _ => None,
        })
    }
}

/// Read and parse the driver's `mig-minors` file.
pub fn read_mig_minors(path: &Path) -> Result<MigMinors, GpuError> {
    let text = std::fs::read_to_string(path).map_err(|source| GpuError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    caps::parse(&text).map_err(|e| GpuError::DriverUnavailable(format!("{}: {e}", path.display())))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_a_clear_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let config = NvmlConfig {
            library_path: Some(dir.path().join("libnvidia-ml.so.1")),
            ..NvmlConfig::default()
        };
        let e = NvmlBackend::new(&config).unwrap_err();
        match &e {
            GpuError::DriverUnavailable(msg) => {
                assert!(msg.contains("libnvidia-ml.so.1 not found"), "{msg}");
                assert!(msg.contains("backend = \"sim\""), "{msg}");
            }
            other => panic!("expected DriverUnavailable, got {other}"),
        }
    }

    #[test]
    fn default_library_absent_here_or_usable() {
        // On a host without the driver this must be DriverUnavailable; on a GPU host
        // it must work. Either way: no panic.
        match NvmlBackend::new(&NvmlConfig::default()) {
            Ok(b) => assert_eq!(b.name(), "nvml"),
            Err(e) => assert!(matches!(e, GpuError::DriverUnavailable(_)), "{e}"),
        }
    }

    #[test]
    fn return_codes_map_to_daemon_codes() {
        assert_eq!(
            code_of_return(sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES),
            NvmlCode::InsufficientResources
        );
        assert_eq!(
            code_of_return(sys::nvmlReturn_enum_NVML_ERROR_IN_USE),
            NvmlCode::InUse
        );
        assert_eq!(
            code_of_return(sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
            NvmlCode::InvalidArgument
        );
        assert_eq!(code_of_return(999), NvmlCode::Unknown);
        assert!(check("x", sys::nvmlReturn_enum_NVML_SUCCESS).is_ok());
        let e = check(
            "nvmlGpuInstanceDestroy",
            sys::nvmlReturn_enum_NVML_ERROR_IN_USE,
        )
        .unwrap_err();
        assert_eq!(e.nvml_code(), Some(NvmlCode::InUse));
        assert!(e.to_string().contains("nvmlGpuInstanceDestroy"), "{e}");
        assert_eq!(code_of_error(&NvmlError::InUse), NvmlCode::InUse);
        assert_eq!(
            code_of_error(&NvmlError::UnexpectedVariant(
                sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES
            )),
            NvmlCode::InsufficientResources
        );
    }

    #[test]
    fn every_code_nvml_defines_has_a_name() {
        for v in 1..=30u32 {
            let code = code_of_return(v);
            assert_ne!(code, NvmlCode::Unknown, "nvmlReturn_t {v}");
            assert_eq!(code.value(), v);
        }
        assert_eq!(
            code_of_return(sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE),
            NvmlCode::InsufficientSize
        );
        assert_eq!(
            NvmlCode::InsufficientSize.name(),
            "NVML_ERROR_INSUFFICIENT_SIZE"
        );
        assert_eq!(NvmlCode::GpuIsLost.name(), "NVML_ERROR_GPU_IS_LOST");
        assert_eq!(
            NvmlCode::ResetTypeNotSupported.name(),
            "NVML_ERROR_RESET_TYPE_NOT_SUPPORTED"
        );
        assert_eq!(
            code_of_return(sys::nvmlReturn_enum_NVML_ERROR_UNKNOWN),
            NvmlCode::Unknown
        );
        assert_eq!(
            code_of_error(&NvmlError::InsufficientSize(None)),
            NvmlCode::InsufficientSize
        );
    }

    #[test]
    fn lists_pass_their_size_and_grow_when_nvml_says_it_is_too_small() {
        let held = [11u32, 12, 13, 14, 15, 16, 17, 18, 19, 20];
        let mut sizes_seen = Vec::new();
        let got = fill_list("nvmlDeviceGetGpuInstances", 8, 0u32, |ptr, n| {
            sizes_seen.push(*n);
            if (*n as usize) < held.len() {
                *n = held.len() as u32;
                return sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
            }
            for (i, v) in held.iter().enumerate() {
                // SAFETY: the buffer has room for `*n` >= held.len() entries.
                unsafe { ptr.add(i).write(*v) };
            }
            *n = held.len() as u32;
            sys::nvmlReturn_enum_NVML_SUCCESS
        })
        .unwrap();
        assert_eq!(got, held);
        assert_eq!(sizes_seen[0], 8, "the buffer's size goes in, never 0");
        assert!(
            sizes_seen[1] >= 10,
            "then at least what NVML asked for: {sizes_seen:?}"
        );
        let e = fill_list("x", 4, 0u32, |_, _| {
            sys::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST
        })
        .unwrap_err();
        assert_eq!(e.nvml_code(), Some(NvmlCode::GpuIsLost));
    }

    #[test]
    fn missing_symbol_is_not_supported() {
        let missing: Result<fn(), String> = Err("undefined symbol".to_owned());
        let e = sym(&missing, "nvmlDeviceGetGpuInstances").unwrap_err();
        assert_eq!(e.nvml_code(), Some(NvmlCode::NotSupported));
    }

    #[test]
    fn profile_names_drop_the_mig_prefix() {
        let raw = |s: &str| {
            let mut raw = [0 as c_char; 96];
            for (i, b) in s.bytes().enumerate() {
                raw[i] = b as c_char;
            }
            raw
        };
        assert_eq!(profile_name(&raw("MIG 1g.10gb+me")), "1g.10gb+me");
        assert_eq!(profile_name(&raw("MIG 7g.80gb")), "7g.80gb");
        assert_eq!(profile_name(&raw("3g.40gb")), "3g.40gb");
        assert_eq!(profile_name(&[0 as c_char; 4]), "");
    }

    #[test]
    fn struct_versions_follow_the_nvml_macro() {
        let v = struct_version::<sys::nvmlGpuInstanceProfileInfo_v2_t>(2);
        assert_eq!(v >> 24, 2);
        assert_eq!(
            (v & 0x00ff_ffff) as usize,
            std::mem::size_of::<sys::nvmlGpuInstanceProfileInfo_v2_t>()
        );
    }

    #[test]
    fn mig_minors_file_is_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mig-minors");
        let e = read_mig_minors(&path).unwrap_err();
        assert!(matches!(e, GpuError::Io { ref path, .. } if path.ends_with("mig-minors")));
        std::fs::write(
            &path,
            "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n",
        )
        .unwrap();
        let m = read_mig_minors(&path).unwrap();
        assert_eq!(m.gi_access[&(0, 1)], caps::gi_minor(0, 1));
        assert_eq!(m.ci_access[&(0, 1, 0)], caps::ci_minor(0, 1, 0));
        std::fs::write(&path, "config 1\ngpu0/gi1/access twelve\n").unwrap();
        let e = read_mig_minors(&path).unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
    }
}
