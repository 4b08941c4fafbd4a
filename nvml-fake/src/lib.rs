//! A `libnvidia-ml.so.1` of our own for CI: the NVML C ABI tesserad calls, over a
//! stateful model of A100/H100/H200 GPUs with MIG (see [`state`] and [`models`]).
//!
//! Built as `libnvidia_ml.so`; tests copy or link it as `libnvidia-ml.so.1` and point
//! tesserad's `[nvml] library_path` at it, with `TESSERA_FAKE_NVML_STATE` naming the
//! state file (written by `nvml-fake-ctl init`). Faults (a lost GPU, an XID, a call
//! that fails with a code or hangs) are injected by editing that file, through
//! `nvml-fake-ctl`.
//!
//! # Safety
//!
//! Every exported function is `unsafe extern "C"` with NVML's contract: pointer
//! arguments are null or valid for the access NVML documents (an out-parameter for
//! one value, a buffer of `*count` entries, a string buffer of `length` bytes), and
//! handles are those this library handed out. Null pointers are refused with
//! `NVML_ERROR_INVALID_ARGUMENT`; handles are plain numbers, decoded and checked,
//! never dereferenced.

#![allow(clippy::missing_safety_doc)]

pub mod models;
pub mod state;

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_uint, c_ulonglong};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings as sys;

use models::{Model, ci_layout, ci_profile_id, ci_slices};
use state::{Ci, Gi, State};

type Ret = sys::nvmlReturn_t;

const SUCCESS: Ret = sys::nvmlReturn_enum_NVML_SUCCESS;
const UNINITIALIZED: Ret = sys::nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
const INVALID_ARGUMENT: Ret = sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: Ret = sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const NOT_FOUND: Ret = sys::nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
const INSUFFICIENT_SIZE: Ret = sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const DRIVER_NOT_LOADED: Ret = sys::nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED;
const TIMEOUT: Ret = sys::nvmlReturn_enum_NVML_ERROR_TIMEOUT;
const GPU_IS_LOST: Ret = sys::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
const IN_USE: Ret = sys::nvmlReturn_enum_NVML_ERROR_IN_USE;
const INSUFFICIENT_RESOURCES: Ret = sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
const UNKNOWN: Ret = sys::nvmlReturn_enum_NVML_ERROR_UNKNOWN;

/// GI ids a GPU hands out (the driver's space: 0..15).
const GI_IDS: u32 = 15;
/// MIG devices a GPU can have at most (7 compute slices).
const MAX_MIG_DEVICES: u32 = 7;

static INIT_COUNT: AtomicU32 = AtomicU32::new(0);

/// What a handle this library handed out stands for. Handles are numbers with a tag
/// in bits 40..48, never pointers to memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handle {
    Gpu(u32),
    Mig { gpu: u32, gi: u32, ci: u32 },
    Gi { gpu: u32, gi: u32 },
    Ci { gpu: u32, gi: u32, ci: u32 },
    Set(u32),
}

impl Handle {
    fn raw(self) -> usize {
        let (tag, v): (usize, usize) = match self {
            Handle::Gpu(g) => (1, g as usize),
            Handle::Mig { gpu, gi, ci } => {
                (2, (gpu as usize) << 16 | (gi as usize) << 8 | ci as usize)
            }
            Handle::Gi { gpu, gi } => (3, (gpu as usize) << 16 | (gi as usize) << 8),
            Handle::Ci { gpu, gi, ci } => {
                (4, (gpu as usize) << 16 | (gi as usize) << 8 | ci as usize)
            }
            Handle::Set(n) => (5, n as usize),
        };
        tag << 40 | v
    }

    fn of(raw: usize) -> Option<Handle> {
        let v = raw & 0xff_ffff_ffff;
        let gpu = (v >> 16) as u32;
        let gi = ((v >> 8) & 0xff) as u32;
        let ci = (v & 0xff) as u32;
        Some(match raw >> 40 {
            1 => Handle::Gpu(v as u32),
            2 => Handle::Mig { gpu, gi, ci },
            3 => Handle::Gi { gpu, gi },
            4 => Handle::Ci { gpu, gi, ci },
            5 => Handle::Set(v as u32),
            _ => return None,
        })
    }

    fn gpu(self) -> Option<u32> {
        match self {
            Handle::Gpu(g) => Some(g),
            Handle::Mig { gpu, .. } | Handle::Gi { gpu, .. } | Handle::Ci { gpu, .. } => Some(gpu),
            Handle::Set(_) => None,
        }
    }

    fn ptr<T>(self) -> *mut T {
        self.raw() as *mut T
    }
}

fn handle<T>(p: *mut T) -> Option<Handle> {
    Handle::of(p as usize)
}

/// Event sets of this process: set number -> (gpu, event mask) registrations.
type Registrations = HashMap<u32, Vec<(u32, u64)>>;
static EVENT_SETS: Mutex<Option<Registrations>> = Mutex::new(None);
static NEXT_SET: AtomicU32 = AtomicU32::new(1);

/// Run one call: the state locked, the call's injected faults applied, the GPU it
/// names checked (out of range: INVALID_ARGUMENT; lost: GPU_IS_LOST), then `f`.
/// `write` saves what `f` changed.
fn call<T>(
    name: &str,
    gpu: Option<u32>,
    write: bool,
    f: impl FnOnce(&mut State) -> Result<T, Ret>,
) -> Result<T, Ret> {
    if INIT_COUNT.load(Ordering::SeqCst) == 0 {
        return Err(UNINITIALIZED);
    }
    let path = state::path_from_env().map_err(|_| DRIVER_NOT_LOADED)?;
    let mut locked = state::lock(&path).map_err(|_| UNKNOWN)?;
    // Faults first: a hang is served with the lock released.
    let mut hang = 0u64;
    let mut code = SUCCESS;
    let mut changed = false;
    locked.state.faults.retain_mut(|fault| {
        let hits = (fault.call == name || fault.call == "*")
            && (fault.gpu.is_none() || fault.gpu == gpu)
            && code == SUCCESS
            && hang == 0;
        if !hits {
            return true;
        }
        hang = fault.hang_ms;
        code = fault.code;
        match &mut fault.times {
            Some(n) => {
                changed = true;
                *n = n.saturating_sub(1);
                *n > 0
            }
            None => true,
        }
    });
    if changed {
        locked.save().map_err(|_| UNKNOWN)?;
    }
    if hang > 0 {
        drop(locked);
        std::thread::sleep(Duration::from_millis(hang));
        if code != SUCCESS {
            return Err(code);
        }
        locked = state::lock(&path).map_err(|_| UNKNOWN)?;
    } else if code != SUCCESS {
        return Err(code);
    }
    if let Some(g) = gpu {
        match locked.state.gpus.get(g as usize) {
            None => return Err(INVALID_ARGUMENT),
            Some(gpu) if gpu.lost => return Err(GPU_IS_LOST),
            Some(_) => {}
        }
    }
    let out = f(&mut locked.state)?;
    if write {
        locked.save().map_err(|_| UNKNOWN)?;
    }
    Ok(out)
}

fn ret(r: Result<(), Ret>) -> Ret {
    match r {
        Ok(()) => SUCCESS,
        Err(e) => e,
    }
}

/// Store `v` through an out-pointer the caller checked for null.
///
/// # Safety
/// `p` is non-null and valid for a write of `T`.
unsafe fn put<T>(p: *mut T, v: T) {
    // SAFETY: the caller's contract.
    unsafe { p.write(v) }
}

/// Copy `s` with its NUL into a C buffer of `len` bytes.
///
/// # Safety
/// `buf` is non-null and valid for `len` bytes of writes.
unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), Ret> {
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    for (i, b) in bytes.iter().enumerate() {
        // SAFETY: i < bytes.len() < len, inside the caller's buffer.
        unsafe { buf.add(i).write(*b as c_char) };
    }
    // SAFETY: bytes.len() < len.
    unsafe { buf.add(bytes.len()).write(0) };
    Ok(())
}

fn c_name<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *o = b as c_char;
    }
    out
}

fn bus_id(gpu: u32) -> String {
    format!("00000000:{:02X}:00.0", 0x1B + 0x10 * gpu)
}

fn pci_info(gpu: u32) -> sys::nvmlPciInfo_t {
    let id = bus_id(gpu);
    sys::nvmlPciInfo_t {
        busIdLegacy: c_name::<16>(&id[4..]),
        domain: 0,
        bus: 0x1B + 0x10 * gpu,
        device: 0,
        pciDeviceId: 0x2330_10DE,
        pciSubSystemId: 0x16C1_10DE,
        busId: c_name::<32>(&id),
    }
}

/// A physical GPU handle's index (MIG device handles are refused).
fn gpu_of(device: sys::nvmlDevice_t) -> Result<u32, Ret> {
    match handle(device) {
        Some(Handle::Gpu(g)) => Ok(g),
        _ => Err(INVALID_ARGUMENT),
    }
}

fn gpu_or_mig(device: sys::nvmlDevice_t) -> Result<Handle, Ret> {
    match handle(device) {
        Some(h @ (Handle::Gpu(_) | Handle::Mig { .. })) => Ok(h),
        _ => Err(INVALID_ARGUMENT),
    }
}

/// The shape of an entry point on a GPU handle: INVALID_ARGUMENT when `bad_args` (a
/// null out-pointer, an argument out of range) or `device` is no GPU; otherwise `f`
/// runs as call `name` on the GPU's index (`write`: it changes the state).
fn on_gpu(
    name: &str,
    device: sys::nvmlDevice_t,
    bad_args: bool,
    write: bool,
    f: impl FnOnce(&mut State, u32) -> Result<(), Ret>,
) -> Ret {
    if bad_args {
        return INVALID_ARGUMENT;
    }
    let gpu = match gpu_of(device) {
        Ok(g) => g,
        Err(e) => return e,
    };
    ret(call(name, Some(gpu), write, |st| f(st, gpu)))
}

/// [`on_gpu`] for an entry point that takes a GPU or a MIG device handle.
fn on_gpu_or_mig(
    name: &str,
    device: sys::nvmlDevice_t,
    bad_args: bool,
    write: bool,
    f: impl FnOnce(&mut State, Handle) -> Result<(), Ret>,
) -> Ret {
    if bad_args {
        return INVALID_ARGUMENT;
    }
    let h = match gpu_or_mig(device) {
        Ok(h) => h,
        Err(e) => return e,
    };
    ret(call(name, h.gpu(), write, |st| f(st, h)))
}

fn mig_on(st: &State, gpu: u32) -> Result<(), Ret> {
    if st.gpus[gpu as usize].mig_current {
        Ok(())
    } else {
        Err(NOT_SUPPORTED)
    }
}

fn find_gi(st: &mut State, gpu: u32, gi: u32) -> Result<&mut Gi, Ret> {
    st.gpus[gpu as usize]
        .instances
        .iter_mut()
        .find(|g| g.id == gi)
        .ok_or(NOT_FOUND)
}

// ---- init, system ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit_v2() -> Ret {
    match state::path_from_env().and_then(|p| state::lock(&p).map(|_| ())) {
        Ok(()) => {
            INIT_COUNT.fetch_add(1, Ordering::SeqCst);
            SUCCESS
        }
        Err(state::StateError::NoPath) => DRIVER_NOT_LOADED,
        Err(_) => UNKNOWN,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit() -> Ret {
    // SAFETY: no arguments.
    unsafe { nvmlInit_v2() }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlShutdown() -> Ret {
    let prev = INIT_COUNT
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .unwrap_or(0);
    if prev == 0 { UNINITIALIZED } else { SUCCESS }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: Ret) -> *const c_char {
    let s: &'static CStr = match result {
        SUCCESS => c"Success",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        NOT_FOUND => c"Not Found",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        GPU_IS_LOST => c"GPU is lost",
        IN_USE => c"In use by another client",
        INSUFFICIENT_RESOURCES => c"Insufficient resources",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> Ret {
    if version.is_null() {
        return INVALID_ARGUMENT;
    }
    ret(call("nvmlSystemGetDriverVersion", None, false, |st| {
        // SAFETY: non-null, `length` bytes per NVML's contract.
        unsafe { put_str(version, length, &st.driver_version) }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> Ret {
    if count.is_null() {
        return INVALID_ARGUMENT;
    }
    ret(call("nvmlDeviceGetCount_v2", None, false, |st| {
        // SAFETY: checked non-null above.
        unsafe { put(count, st.gpus.len() as c_uint) };
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut sys::nvmlDevice_t,
) -> Ret {
    if device.is_null() {
        return INVALID_ARGUMENT;
    }
    ret(call(
        "nvmlDeviceGetHandleByIndex_v2",
        Some(index),
        false,
        |_| {
            // SAFETY: checked non-null above.
            unsafe { put(device, Handle::Gpu(index).ptr()) };
            Ok(())
        },
    ))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut sys::nvmlDevice_t,
) -> Ret {
    if uuid.is_null() || device.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: non-null, NUL-terminated per NVML's contract.
    let want = unsafe { CStr::from_ptr(uuid) }
        .to_string_lossy()
        .into_owned();
    ret(call("nvmlDeviceGetHandleByUUID", None, false, |st| {
        let i = st
            .gpus
            .iter()
            .position(|g| g.uuid == want)
            .ok_or(NOT_FOUND)?;
        if st.gpus[i].lost {
            return Err(GPU_IS_LOST);
        }
        // SAFETY: checked non-null above.
        unsafe { put(device, Handle::Gpu(i as u32).ptr()) };
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: sys::nvmlDevice_t, index: *mut c_uint) -> Ret {
    on_gpu(
        "nvmlDeviceGetIndex",
        device,
        index.is_null(),
        false,
        |_, gpu| {
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe { put(index, gpu) };
            Ok(())
        },
    )
}

// ---- device attributes ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: sys::nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> Ret {
    on_gpu_or_mig(
        "nvmlDeviceGetName",
        device,
        name.is_null(),
        false,
        |st, h| {
            let g = &st.gpus[h.gpu().unwrap_or(0) as usize];
            let text = match h {
                Handle::Mig { gi, .. } => {
                    let gi = g.instances.iter().find(|x| x.id == gi).ok_or(NOT_FOUND)?;
                    let row = g.model.gi_row(gi.profile).ok_or(UNKNOWN)?;
                    format!("{} MIG {}", g.model.name(), row.name)
                }
                _ => g.model.name().to_owned(),
            };
            // SAFETY: non-null, `length` bytes per NVML's contract.
            unsafe { put_str(name, length, &text) }
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: sys::nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> Ret {
    on_gpu_or_mig(
        "nvmlDeviceGetUUID",
        device,
        uuid.is_null(),
        false,
        |st, h| {
            let text = match h {
                Handle::Mig { gpu, gi, ci } => find_gi(st, gpu, gi)?
                    .cis
                    .iter()
                    .find(|c| c.id == ci)
                    .map(|c| c.uuid.clone())
                    .ok_or(NOT_FOUND)?,
                Handle::Gpu(g) => st.gpus[g as usize].uuid.clone(),
                _ => return Err(INVALID_ARGUMENT),
            };
            // SAFETY: non-null, `length` bytes per NVML's contract.
            unsafe { put_str(uuid, length, &text) }
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: sys::nvmlDevice_t,
    minor: *mut c_uint,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetMinorNumber",
        device,
        minor.is_null(),
        false,
        |_, gpu| {
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe { put(minor, gpu) };
            Ok(())
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: sys::nvmlDevice_t,
    pci: *mut sys::nvmlPciInfo_t,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetPciInfo_v3",
        device,
        pci.is_null(),
        false,
        |_, gpu| {
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe { put(pci, pci_info(gpu)) };
            Ok(())
        },
    )
}

/// Memory of a GPU, or of a MIG device (its GI's memory).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: sys::nvmlDevice_t,
    memory: *mut sys::nvmlMemory_v2_t,
) -> Ret {
    on_gpu_or_mig(
        "nvmlDeviceGetMemoryInfo_v2",
        device,
        memory.is_null(),
        false,
        |st, h| {
            let g = &st.gpus[h.gpu().unwrap_or(0) as usize];
            let (total, gi) = match h {
                Handle::Mig { gi, .. } => {
                    let x = g.instances.iter().find(|x| x.id == gi).ok_or(NOT_FOUND)?;
                    let row = g.model.gi_row(x.profile).ok_or(UNKNOWN)?;
                    (row.memory_mib << 20, Some(gi))
                }
                _ => (g.model.memory_bytes(), None),
            };
            let used: u64 = g
                .processes
                .iter()
                .filter(|p| gi.is_none() || p.gi == gi)
                .map(|p| p.used_memory)
                .sum();
            let used = used.min(total);
            // SAFETY: checked non-null above.
            unsafe {
                put(
                    memory,
                    sys::nvmlMemory_v2_t {
                        version: (*memory).version,
                        total,
                        reserved: 0,
                        free: total - used,
                        used,
                    },
                )
            };
            Ok(())
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: sys::nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetMigMode",
        device,
        current.is_null() || pending.is_null(),
        false,
        |st, gpu| {
            let g = &st.gpus[gpu as usize];
            // SAFETY: both checked non-null above.
            unsafe {
                put(current, c_uint::from(g.mig_current));
                put(pending, c_uint::from(g.mig_pending));
            }
            Ok(())
        },
    )
}

/// Pending mode only: it applies at the next GPU reset (`nvml-fake-ctl reset`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: sys::nvmlDevice_t,
    mode: c_uint,
    activation: *mut Ret,
) -> Ret {
    on_gpu(
        "nvmlDeviceSetMigMode",
        device,
        activation.is_null() || mode > 1,
        true,
        |st, gpu| {
            st.gpus[gpu as usize].mig_pending = mode == 1;
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe { put(activation, SUCCESS) };
            Ok(())
        },
    )
}

/// Attributes: NVML answers them for MIG devices only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: sys::nvmlDevice_t,
    attributes: *mut sys::nvmlDeviceAttributes_t,
) -> Ret {
    on_gpu_or_mig(
        "nvmlDeviceGetAttributes_v2",
        device,
        attributes.is_null(),
        false,
        |st, h| {
            let g = &st.gpus[h.gpu().unwrap_or(0) as usize];
            let (sms, gi_slices, ci_slices_, mib) = match h {
                Handle::Mig { gi, ci, .. } => {
                    let x = g.instances.iter().find(|x| x.id == gi).ok_or(NOT_FOUND)?;
                    let c = x.cis.iter().find(|c| c.id == ci).ok_or(NOT_FOUND)?;
                    let row = g.model.gi_row(x.profile).ok_or(UNKNOWN)?;
                    let sms = if c.slices == row.slices {
                        row.sm_count
                    } else {
                        g.model.sm_of_slices(c.slices)
                    };
                    (sms, row.slices, c.slices, row.memory_mib)
                }
                // The driver answers attributes for MIG devices only (driver 580 on an
                // H200 answers NOT_SUPPORTED for the whole GPU).
                _ => return Err(NOT_SUPPORTED),
            };
            // SAFETY: checked non-null above.
            unsafe {
                put(
                    attributes,
                    sys::nvmlDeviceAttributes_t {
                        multiprocessorCount: sms,
                        sharedCopyEngineCount: 1,
                        sharedDecoderCount: 1,
                        sharedEncoderCount: 0,
                        sharedJpegCount: 0,
                        sharedOfaCount: 0,
                        gpuInstanceSliceCount: gi_slices,
                        computeInstanceSliceCount: ci_slices_,
                        memorySizeMB: mib,
                    },
                )
            };
            Ok(())
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: sys::nvmlDevice_t,
    utilization: *mut sys::nvmlUtilization_t,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetUtilizationRates",
        device,
        utilization.is_null(),
        false,
        |st, gpu| {
            let g = &st.gpus[gpu as usize];
            if g.mig_current {
                // NVML reports no utilisation with MIG enabled.
                return Err(NOT_SUPPORTED);
            }
            let busy = if g.processes.is_empty() { 0 } else { 100 };
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe {
                put(
                    utilization,
                    sys::nvmlUtilization_t {
                        gpu: busy,
                        memory: busy,
                    },
                )
            };
            Ok(())
        },
    )
}

/// Processes with a compute context; `*count` in: the buffer's size, out: how many
/// there are (INSUFFICIENT_SIZE when they do not fit).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: sys::nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut sys::nvmlProcessInfo_t,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        device,
        count.is_null(),
        false,
        |st, gpu| {
            let procs = &st.gpus[gpu as usize].processes;
            // SAFETY: non-null: on_gpu refused a null one.
            let room = unsafe { *count } as usize;
            // SAFETY: as above.
            unsafe { put(count, procs.len() as c_uint) };
            if procs.len() > room || (infos.is_null() && !procs.is_empty()) {
                return Err(INSUFFICIENT_SIZE);
            }
            for (i, p) in procs.iter().enumerate() {
                // SAFETY: i < room entries of the caller's buffer (non-null here).
                unsafe {
                    infos.add(i).write(sys::nvmlProcessInfo_t {
                        pid: p.pid,
                        usedGpuMemory: p.used_memory,
                        gpuInstanceId: p.gi.unwrap_or(u32::MAX),
                        computeInstanceId: p.ci.unwrap_or(u32::MAX),
                    })
                };
            }
            Ok(())
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRemappedRows(
    device: sys::nvmlDevice_t,
    corr: *mut c_uint,
    unc: *mut c_uint,
    pending: *mut c_uint,
    failed: *mut c_uint,
) -> Ret {
    if corr.is_null() || unc.is_null() || pending.is_null() || failed.is_null() {
        return INVALID_ARGUMENT;
    }
    let gpu = match gpu_of(device) {
        Ok(g) => g,
        Err(e) => return e,
    };
    ret(call("nvmlDeviceGetRemappedRows", Some(gpu), false, |st| {
        let g = &st.gpus[gpu as usize];
        // SAFETY: all four checked non-null above.
        unsafe {
            put(corr, 0);
            put(unc, c_uint::from(g.rows_pending || g.rows_failed));
            put(pending, c_uint::from(g.rows_pending));
            put(failed, c_uint::from(g.rows_failed));
        }
        Ok(())
    }))
}

// ---- topology: the board of the state ([`state::Board`]) ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    a: sys::nvmlDevice_t,
    b: sys::nvmlDevice_t,
    level: *mut sys::nvmlGpuTopologyLevel_t,
) -> Ret {
    if level.is_null() {
        return INVALID_ARGUMENT;
    }
    let (ga, gb) = match (gpu_of(a), gpu_of(b)) {
        (Ok(x), Ok(y)) => (x, y),
        _ => return INVALID_ARGUMENT,
    };
    ret(call(
        "nvmlDeviceGetTopologyCommonAncestor",
        Some(ga),
        false,
        |st| {
            if gb as usize >= st.gpus.len() {
                return Err(INVALID_ARGUMENT);
            }
            if ga == gb {
                // The real driver has no common ancestor of a GPU with itself.
                return Err(NOT_SUPPORTED);
            }
            let v = st.board.level(ga, gb, st.gpus.len() as u32);
            // SAFETY: checked non-null above.
            unsafe { put(level, v) };
            Ok(())
        },
    ))
}

/// The NVLinks of `gpu` (None: it has none) and, per link, the bus id of its remote
/// end: an NVSwitch on an HGX board, the partner GPU of a bridged pair.
fn nvlink_remote(st: &State, gpu: u32, link: u32) -> Result<Option<String>, Ret> {
    let model = st.gpus[gpu as usize].model;
    match st.board {
        state::Board::Pcie => Err(NOT_SUPPORTED),
        state::Board::HgxNvswitch if link < model.nvlinks() => {
            Ok(Some(format!("00000000:{:02X}:00.0", 0xC0 + link % 4)))
        }
        state::Board::PciePairs if link < 12 => {
            let partner = gpu ^ 1;
            Ok(((partner as usize) < st.gpus.len()).then(|| bus_id(partner)))
        }
        _ => Err(INVALID_ARGUMENT),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: sys::nvmlDevice_t,
    link: c_uint,
    active: *mut sys::nvmlEnableState_t,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetNvLinkState",
        device,
        active.is_null(),
        false,
        |st, gpu| {
            let up = nvlink_remote(st, gpu, link)?.is_some();
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe { put(active, c_uint::from(up)) };
            Ok(())
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: sys::nvmlDevice_t,
    link: c_uint,
    pci: *mut sys::nvmlPciInfo_t,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetNvLinkRemotePciInfo_v2",
        device,
        pci.is_null(),
        false,
        |st, gpu| {
            let id = nvlink_remote(st, gpu, link)?.ok_or(NOT_SUPPORTED)?;
            let mut info = pci_info(0);
            info.busId = c_name::<32>(&id);
            info.busIdLegacy = c_name::<16>(&id[4..]);
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe { put(pci, info) };
            Ok(())
        },
    )
}

/// Peer-to-peer over NVLink: every pair on an HGX board, the bridged pairs of
/// `pcie-pairs`, none over plain PCIe.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetP2PStatus(
    a: sys::nvmlDevice_t,
    b: sys::nvmlDevice_t,
    index: sys::nvmlGpuP2PCapsIndex_t,
    status: *mut sys::nvmlGpuP2PStatus_t,
) -> Ret {
    if status.is_null() {
        return INVALID_ARGUMENT;
    }
    let (ga, gb) = match (gpu_of(a), gpu_of(b)) {
        (Ok(x), Ok(y)) => (x, y),
        _ => return INVALID_ARGUMENT,
    };
    ret(call("nvmlDeviceGetP2PStatus", Some(ga), false, |st| {
        if gb as usize >= st.gpus.len() {
            return Err(INVALID_ARGUMENT);
        }
        let nvlink = match st.board {
            state::Board::Pcie => false,
            state::Board::HgxNvswitch => true,
            state::Board::PciePairs => ga / 2 == gb / 2,
        };
        let ok = index != sys::nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK || nvlink;
        let v = if ok {
            sys::nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK
        } else {
            sys::nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_NOT_SUPPORTED
        };
        // SAFETY: checked non-null above.
        unsafe { put(status, v) };
        Ok(())
    }))
}

// ---- MIG: GPU-instance profiles, placements, instances ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: sys::nvmlDevice_t,
    profile: c_uint,
    info: *mut sys::nvmlGpuInstanceProfileInfo_v2_t,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetGpuInstanceProfileInfoV",
        device,
        info.is_null(),
        false,
        |st, gpu| {
            // Answered with MIG disabled too, as the real driver does.
            let model = st.gpus[gpu as usize].model;
            let row = model.gi_row(profile).ok_or(NOT_SUPPORTED)?;
            // The real driver writes version 0 back (seen on an H200, driver 580).
            let version = 0;
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe {
                put(
                    info,
                    sys::nvmlGpuInstanceProfileInfo_v2_t {
                        version,
                        id: row.driver_id,
                        isP2pSupported: 0,
                        sliceCount: row.slices,
                        instanceCount: row.max_count,
                        multiprocessorCount: row.sm_count,
                        copyEngineCount: if model.hopper() && row.slices == 7 {
                            8
                        } else {
                            row.slices.max(1)
                        },
                        decoderCount: if model.hopper() {
                            row.slices
                        } else {
                            row.slices / 2
                        },
                        encoderCount: 0,
                        jpegCount: if model.hopper() {
                            row.slices
                        } else {
                            u32::from(row.id == 7 || row.slices == 7)
                        },
                        ofaCount: u32::from(row.id == 7 || row.slices == 7),
                        memorySizeMB: row.memory_mib,
                        name: c_name::<96>(&format!("MIG {}", row.name)),
                    },
                )
            };
            Ok(())
        },
    )
}

/// Possible placements: a null buffer asks for the count; otherwise every placement
/// that fits in `*count` entries is written and `*count` says how many there are.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: sys::nvmlDevice_t,
    profile: c_uint,
    placements: *mut sys::nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
        device,
        count.is_null(),
        false,
        |st, gpu| {
            // Answered with MIG disabled too, as the real driver does.
            let row = st.gpus[gpu as usize]
                .model
                .gi_row_by_driver_id(profile)
                .ok_or(NOT_SUPPORTED)?;
            let n = row.starts.len();
            if placements.is_null() {
                // SAFETY: non-null: on_gpu refused a null one.
                unsafe { put(count, n as c_uint) };
                return Ok(());
            }
            // SAFETY: non-null: on_gpu refused a null one.
            let room = unsafe { *count } as usize;
            // SAFETY: as above.
            unsafe { put(count, n as c_uint) };
            // The real driver (an H200, driver 580) does not check `*count` here: it
            // answers SUCCESS and the number of placements whatever the buffer's size
            // (and writes them all). The fake answers the same but writes only what
            // fits: a caller must size the buffer by a count query first.
            for (i, &start) in row.starts.iter().enumerate().take(room) {
                // SAFETY: i < n <= room entries of the caller's buffer.
                unsafe {
                    placements.add(i).write(sys::nvmlGpuInstancePlacement_t {
                        start,
                        size: row.memory_slices,
                    })
                };
            }
            Ok(())
        },
    )
}

fn overlaps(a_start: u32, a_size: u32, b_start: u32, b_size: u32) -> bool {
    a_start < b_start + b_size && b_start < a_start + a_size
}

/// Create a GI at `start` (or the first free placement when None).
fn create_gi(st: &mut State, gpu: u32, profile: u32, start: Option<u32>) -> Result<u32, Ret> {
    mig_on(st, gpu)?;
    let g = &mut st.gpus[gpu as usize];
    let row = g.model.gi_row(profile).ok_or(INVALID_ARGUMENT)?;
    let same = g.instances.iter().filter(|x| x.profile == profile).count() as u32;
    if same >= row.max_count {
        return Err(INSUFFICIENT_RESOURCES);
    }
    let free = |s: u32| {
        !g.instances
            .iter()
            .any(|x| overlaps(s, row.memory_slices, x.start, x.size))
    };
    let used_compute: u32 = g
        .instances
        .iter()
        .filter_map(|x| g.model.gi_row(x.profile))
        .map(|r| r.slices)
        .sum();
    if used_compute + row.slices > 7 {
        return Err(INSUFFICIENT_RESOURCES);
    }
    let start = match start {
        Some(s) => {
            if !row.starts.contains(&s) {
                return Err(INVALID_ARGUMENT);
            }
            if !free(s) {
                return Err(INSUFFICIENT_RESOURCES);
            }
            s
        }
        None => row
            .starts
            .iter()
            .copied()
            .find(|&s| free(s))
            .ok_or(INSUFFICIENT_RESOURCES)?,
    };
    // The whole GPU's GI is id 0; others take the lowest free id from 1.
    let id = if row.slices == 7 {
        0
    } else {
        (1..GI_IDS)
            .find(|id| !g.instances.iter().any(|x| x.id == *id))
            .ok_or(INSUFFICIENT_RESOURCES)?
    };
    g.instances.push(Gi {
        id,
        profile,
        start,
        size: row.memory_slices,
        cis: Vec::new(),
    });
    g.instances.sort_by_key(|x| x.id);
    Ok(id)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: sys::nvmlDevice_t,
    profile: c_uint,
    placement: *const sys::nvmlGpuInstancePlacement_t,
    gi: *mut sys::nvmlGpuInstance_t,
) -> Ret {
    if placement.is_null() || gi.is_null() {
        return INVALID_ARGUMENT;
    }
    let gpu = match gpu_of(device) {
        Ok(g) => g,
        Err(e) => return e,
    };
    // SAFETY: checked non-null above.
    let p = unsafe { *placement };
    ret(call(
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        Some(gpu),
        true,
        |st| {
            let row = st.gpus[gpu as usize]
                .model
                .gi_row_by_driver_id(profile)
                .ok_or(INVALID_ARGUMENT)?;
            if p.size != row.memory_slices {
                return Err(INVALID_ARGUMENT);
            }
            let id = create_gi(st, gpu, row.id, Some(p.start))?;
            // SAFETY: checked non-null above.
            unsafe { put(gi, Handle::Gi { gpu, gi: id }.ptr()) };
            Ok(())
        },
    ))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: sys::nvmlDevice_t,
    profile: c_uint,
    gi: *mut sys::nvmlGpuInstance_t,
) -> Ret {
    if gi.is_null() {
        return INVALID_ARGUMENT;
    }
    let gpu = match gpu_of(device) {
        Ok(g) => g,
        Err(e) => return e,
    };
    ret(call("nvmlDeviceCreateGpuInstance", Some(gpu), true, |st| {
        let row = st.gpus[gpu as usize]
            .model
            .gi_row_by_driver_id(profile)
            .ok_or(INVALID_ARGUMENT)?;
        let id = create_gi(st, gpu, row.id, None)?;
        // SAFETY: checked non-null above.
        unsafe { put(gi, Handle::Gi { gpu, gi: id }.ptr()) };
        Ok(())
    }))
}

/// The GIs of one profile; `*count` in is the buffer's size.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: sys::nvmlDevice_t,
    profile: c_uint,
    gis: *mut sys::nvmlGpuInstance_t,
    count: *mut c_uint,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetGpuInstances",
        device,
        gis.is_null() || count.is_null(),
        false,
        |st, gpu| {
            // With MIG disabled there are none (SUCCESS, 0), as the real driver answers.
            let g = &st.gpus[gpu as usize];
            let row = g
                .model
                .gi_row_by_driver_id(profile)
                .ok_or(INVALID_ARGUMENT)?;
            let ids: Vec<u32> = g
                .instances
                .iter()
                .filter(|x| x.profile == row.id)
                .map(|x| x.id)
                .collect();
            // SAFETY: non-null: on_gpu refused a null one.
            let room = unsafe { *count } as usize;
            // SAFETY: as above.
            unsafe { put(count, ids.len() as c_uint) };
            if ids.len() > room {
                return Err(INSUFFICIENT_SIZE);
            }
            for (i, id) in ids.iter().enumerate() {
                // SAFETY: i < room entries of the caller's buffer.
                unsafe { gis.add(i).write(Handle::Gi { gpu, gi: *id }.ptr()) };
            }
            Ok(())
        },
    )
}

fn gi_of(h: sys::nvmlGpuInstance_t) -> Result<(u32, u32), Ret> {
    match handle(h) {
        Some(Handle::Gi { gpu, gi }) => Ok((gpu, gi)),
        _ => Err(INVALID_ARGUMENT),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: sys::nvmlDevice_t,
    id: c_uint,
    gi: *mut sys::nvmlGpuInstance_t,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetGpuInstanceById",
        device,
        gi.is_null(),
        false,
        |st, gpu| {
            mig_on(st, gpu)?;
            find_gi(st, gpu, id)?;
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe { put(gi, Handle::Gi { gpu, gi: id }.ptr()) };
            Ok(())
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gi: sys::nvmlGpuInstance_t,
    info: *mut sys::nvmlGpuInstanceInfo_t,
) -> Ret {
    if info.is_null() {
        return INVALID_ARGUMENT;
    }
    let (gpu, id) = match gi_of(gi) {
        Ok(v) => v,
        Err(e) => return e,
    };
    ret(call("nvmlGpuInstanceGetInfo", Some(gpu), false, |st| {
        let model = st.gpus[gpu as usize].model;
        let x = find_gi(st, gpu, id)?;
        let driver_id = model.gi_row(x.profile).map_or(x.profile, |r| r.driver_id);
        // SAFETY: checked non-null above.
        unsafe {
            put(
                info,
                sys::nvmlGpuInstanceInfo_t {
                    device: Handle::Gpu(gpu).ptr(),
                    id,
                    profileId: driver_id,
                    placement: sys::nvmlGpuInstancePlacement_t {
                        start: x.start,
                        size: x.size,
                    },
                },
            )
        };
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(gi: sys::nvmlGpuInstance_t) -> Ret {
    let (gpu, id) = match gi_of(gi) {
        Ok(v) => v,
        Err(e) => return e,
    };
    ret(call("nvmlGpuInstanceDestroy", Some(gpu), true, |st| {
        let g = &mut st.gpus[gpu as usize];
        let x = g
            .instances
            .iter()
            .find(|x| x.id == id)
            .ok_or(INVALID_ARGUMENT)?;
        // NVML refuses while CIs or processes remain.
        if !x.cis.is_empty() || g.processes.iter().any(|p| p.gi == Some(id)) {
            return Err(IN_USE);
        }
        g.instances.retain(|x| x.id != id);
        Ok(())
    }))
}

// ---- compute instances ----

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gi: sys::nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut sys::nvmlComputeInstanceProfileInfo_v2_t,
) -> Ret {
    if info.is_null() {
        return INVALID_ARGUMENT;
    }
    let (gpu, id) = match gi_of(gi) {
        Ok(v) => v,
        Err(e) => return e,
    };
    ret(call(
        "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
        Some(gpu),
        false,
        |st| {
            if eng_profile != sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
                return Err(NOT_SUPPORTED);
            }
            let model = st.gpus[gpu as usize].model;
            let x = find_gi(st, gpu, id)?;
            let row = model.gi_row(x.profile).ok_or(UNKNOWN)?;
            let slices = ci_slices(profile).ok_or(INVALID_ARGUMENT)?;
            let &(_, max) = ci_layout(row.slices)
                .iter()
                .find(|(s, _)| *s == slices)
                .ok_or(NOT_SUPPORTED)?;
            let sms = if slices == row.slices {
                row.sm_count
            } else {
                model.sm_of_slices(slices)
            };
            // The real driver writes version 0 back (seen on an H200, driver 580).
            let version = 0;
            let name = if slices == row.slices {
                row.name.to_owned()
            } else {
                format!("{slices}c.{}", row.name)
            };
            // SAFETY: checked non-null above.
            unsafe {
                put(
                    info,
                    sys::nvmlComputeInstanceProfileInfo_v2_t {
                        version,
                        id: profile,
                        sliceCount: slices,
                        instanceCount: max,
                        multiprocessorCount: sms,
                        sharedCopyEngineCount: row.slices.max(1),
                        sharedDecoderCount: row.slices / 2,
                        sharedEncoderCount: 0,
                        sharedJpegCount: 0,
                        sharedOfaCount: 0,
                        name: c_name::<96>(&format!("MIG {name}")),
                    },
                )
            };
            Ok(())
        },
    ))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gi: sys::nvmlGpuInstance_t,
    profile: c_uint,
    ci: *mut sys::nvmlComputeInstance_t,
) -> Ret {
    if ci.is_null() {
        return INVALID_ARGUMENT;
    }
    let (gpu, id) = match gi_of(gi) {
        Ok(v) => v,
        Err(e) => return e,
    };
    ret(call(
        "nvmlGpuInstanceCreateComputeInstance",
        Some(gpu),
        true,
        |st| {
            let uuid = st.next_mig_uuid();
            let model = st.gpus[gpu as usize].model;
            let x = find_gi(st, gpu, id)?;
            let row = model.gi_row(x.profile).ok_or(UNKNOWN)?;
            let slices = ci_slices(profile).ok_or(INVALID_ARGUMENT)?;
            let &(_, max) = ci_layout(row.slices)
                .iter()
                .find(|(s, _)| *s == slices)
                .ok_or(NOT_SUPPORTED)?;
            if x.cis.iter().filter(|c| c.profile == profile).count() as u32 >= max {
                return Err(INSUFFICIENT_RESOURCES);
            }
            let start = (0..row.slices)
                .step_by(slices as usize)
                .find(|&s| {
                    s + slices <= row.slices
                        && !x.cis.iter().any(|c| overlaps(s, slices, c.start, c.slices))
                })
                .ok_or(INSUFFICIENT_RESOURCES)?;
            let ci_id = (0..8)
                .find(|i| !x.cis.iter().any(|c| c.id == *i))
                .ok_or(INSUFFICIENT_RESOURCES)?;
            x.cis.push(Ci {
                id: ci_id,
                profile,
                start,
                slices,
                uuid,
            });
            x.cis.sort_by_key(|c| c.id);
            // SAFETY: checked non-null above.
            unsafe {
                put(
                    ci,
                    Handle::Ci {
                        gpu,
                        gi: id,
                        ci: ci_id,
                    }
                    .ptr(),
                )
            };
            Ok(())
        },
    ))
}

/// The CIs of one CI profile in a GI; `*count` in is the buffer's size.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gi: sys::nvmlGpuInstance_t,
    profile: c_uint,
    cis: *mut sys::nvmlComputeInstance_t,
    count: *mut c_uint,
) -> Ret {
    if cis.is_null() || count.is_null() {
        return INVALID_ARGUMENT;
    }
    let (gpu, id) = match gi_of(gi) {
        Ok(v) => v,
        Err(e) => return e,
    };
    ret(call(
        "nvmlGpuInstanceGetComputeInstances",
        Some(gpu),
        false,
        |st| {
            let x = find_gi(st, gpu, id)?;
            let ids: Vec<u32> = x
                .cis
                .iter()
                .filter(|c| c.profile == profile)
                .map(|c| c.id)
                .collect();
            // SAFETY: checked non-null above.
            let room = unsafe { *count } as usize;
            // SAFETY: as above.
            unsafe { put(count, ids.len() as c_uint) };
            if ids.len() > room {
                return Err(INSUFFICIENT_SIZE);
            }
            for (i, c) in ids.iter().enumerate() {
                // SAFETY: i < room entries of the caller's buffer.
                unsafe {
                    cis.add(i).write(
                        Handle::Ci {
                            gpu,
                            gi: id,
                            ci: *c,
                        }
                        .ptr(),
                    )
                };
            }
            Ok(())
        },
    ))
}

fn ci_of(h: sys::nvmlComputeInstance_t) -> Result<(u32, u32, u32), Ret> {
    match handle(h) {
        Some(Handle::Ci { gpu, gi, ci }) => Ok((gpu, gi, ci)),
        _ => Err(INVALID_ARGUMENT),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    ci: sys::nvmlComputeInstance_t,
    info: *mut sys::nvmlComputeInstanceInfo_t,
) -> Ret {
    if info.is_null() {
        return INVALID_ARGUMENT;
    }
    let (gpu, gi, id) = match ci_of(ci) {
        Ok(v) => v,
        Err(e) => return e,
    };
    ret(call(
        "nvmlComputeInstanceGetInfo_v2",
        Some(gpu),
        false,
        |st| {
            let x = find_gi(st, gpu, gi)?;
            let c = x.cis.iter().find(|c| c.id == id).ok_or(INVALID_ARGUMENT)?;
            // SAFETY: checked non-null above.
            unsafe {
                put(
                    info,
                    sys::nvmlComputeInstanceInfo_t {
                        device: Handle::Gpu(gpu).ptr(),
                        gpuInstance: Handle::Gi { gpu, gi }.ptr(),
                        id,
                        profileId: c.profile,
                        placement: sys::nvmlComputeInstancePlacement_t {
                            start: c.start,
                            size: c.slices,
                        },
                    },
                )
            };
            Ok(())
        },
    ))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(ci: sys::nvmlComputeInstance_t) -> Ret {
    let (gpu, gi, id) = match ci_of(ci) {
        Ok(v) => v,
        Err(e) => return e,
    };
    ret(call("nvmlComputeInstanceDestroy", Some(gpu), true, |st| {
        let busy = st.gpus[gpu as usize]
            .processes
            .iter()
            .any(|p| p.gi == Some(gi) && p.ci == Some(id));
        if busy {
            return Err(IN_USE);
        }
        let x = find_gi(st, gpu, gi)?;
        let before = x.cis.len();
        x.cis.retain(|c| c.id != id);
        if x.cis.len() == before {
            return Err(INVALID_ARGUMENT);
        }
        Ok(())
    }))
}

// ---- MIG devices ----

/// The MIG devices of a GPU in NVML's order (by GI id, then CI id).
fn mig_devices(st: &State, gpu: u32) -> Vec<(u32, u32)> {
    st.gpus[gpu as usize]
        .instances
        .iter()
        .flat_map(|x| x.cis.iter().map(move |c| (x.id, c.id)))
        .collect()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: sys::nvmlDevice_t,
    count: *mut c_uint,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetMaxMigDeviceCount",
        device,
        count.is_null(),
        false,
        |st, gpu| {
            let n = if st.gpus[gpu as usize].mig_current {
                MAX_MIG_DEVICES
            } else {
                0
            };
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe { put(count, n) };
            Ok(())
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: sys::nvmlDevice_t,
    index: c_uint,
    mig: *mut sys::nvmlDevice_t,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetMigDeviceHandleByIndex",
        device,
        mig.is_null(),
        false,
        |st, gpu| {
            // With MIG disabled there is no MIG device: NOT_FOUND, as the real driver
            // answers (seen on an H200, driver 580).
            if index >= MAX_MIG_DEVICES {
                return Err(INVALID_ARGUMENT);
            }
            let &(gi, ci) = mig_devices(st, gpu).get(index as usize).ok_or(NOT_FOUND)?;
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe { put(mig, Handle::Mig { gpu, gi, ci }.ptr()) };
            Ok(())
        },
    )
}

fn mig_ids(device: sys::nvmlDevice_t) -> Result<(u32, u32, u32), Ret> {
    match handle(device) {
        Some(Handle::Mig { gpu, gi, ci }) => Ok((gpu, gi, ci)),
        // A physical GPU's handle is not a MIG device: the real driver answers
        // INVALID_ARGUMENT (an H200, driver 580).
        Some(Handle::Gpu(_)) => Err(INVALID_ARGUMENT),
        _ => Err(INVALID_ARGUMENT),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: sys::nvmlDevice_t,
    id: *mut c_uint,
) -> Ret {
    if id.is_null() {
        return INVALID_ARGUMENT;
    }
    let (gpu, gi, _) = match mig_ids(device) {
        Ok(v) => v,
        Err(e) => return e,
    };
    ret(call("nvmlDeviceGetGpuInstanceId", Some(gpu), false, |st| {
        find_gi(st, gpu, gi)?;
        // SAFETY: checked non-null above.
        unsafe { put(id, gi) };
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: sys::nvmlDevice_t,
    id: *mut c_uint,
) -> Ret {
    if id.is_null() {
        return INVALID_ARGUMENT;
    }
    let (gpu, gi, ci) = match mig_ids(device) {
        Ok(v) => v,
        Err(e) => return e,
    };
    ret(call(
        "nvmlDeviceGetComputeInstanceId",
        Some(gpu),
        false,
        |st| {
            find_gi(st, gpu, gi)?
                .cis
                .iter()
                .find(|c| c.id == ci)
                .ok_or(NOT_FOUND)?;
            // SAFETY: checked non-null above.
            unsafe { put(id, ci) };
            Ok(())
        },
    ))
}

// ---- events ----

const HEALTH_EVENTS: u64 =
    (sys::nvmlEventTypeXidCriticalError | sys::nvmlEventTypeDoubleBitEccError) as u64;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut sys::nvmlEventSet_t) -> Ret {
    if set.is_null() {
        return INVALID_ARGUMENT;
    }
    ret(call("nvmlEventSetCreate", None, false, |_| {
        let n = NEXT_SET.fetch_add(1, Ordering::SeqCst);
        EVENT_SETS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(HashMap::new)
            .insert(n, Vec::new());
        // SAFETY: checked non-null above.
        unsafe { put(set, Handle::Set(n).ptr()) };
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: sys::nvmlEventSet_t) -> Ret {
    let Some(Handle::Set(n)) = handle(set) else {
        return INVALID_ARGUMENT;
    };
    let removed = EVENT_SETS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        .and_then(|m| m.remove(&n));
    if removed.is_some() {
        SUCCESS
    } else {
        INVALID_ARGUMENT
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: sys::nvmlDevice_t,
    types: *mut c_ulonglong,
) -> Ret {
    on_gpu(
        "nvmlDeviceGetSupportedEventTypes",
        device,
        types.is_null(),
        false,
        |_, _| {
            // SAFETY: non-null: on_gpu refused a null one.
            unsafe { put(types, HEALTH_EVENTS) };
            Ok(())
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: sys::nvmlDevice_t,
    types: c_ulonglong,
    set: sys::nvmlEventSet_t,
) -> Ret {
    let gpu = match gpu_of(device) {
        Ok(g) => g,
        Err(e) => return e,
    };
    let Some(Handle::Set(n)) = handle(set) else {
        return INVALID_ARGUMENT;
    };
    if types & !HEALTH_EVENTS != 0 {
        return NOT_SUPPORTED;
    }
    ret(call("nvmlDeviceRegisterEvents", Some(gpu), false, |_| {
        let mut sets = EVENT_SETS.lock().unwrap_or_else(|e| e.into_inner());
        let regs = sets
            .as_mut()
            .and_then(|m| m.get_mut(&n))
            .ok_or(INVALID_ARGUMENT)?;
        regs.push((gpu, types));
        Ok(())
    }))
}

/// The next queued event of a GPU registered in the set (taken off the queue), up
/// to `timeoutms` waiting; TIMEOUT when none came.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: sys::nvmlEventSet_t,
    data: *mut sys::nvmlEventData_t,
    timeoutms: c_uint,
) -> Ret {
    if data.is_null() {
        return INVALID_ARGUMENT;
    }
    let Some(Handle::Set(n)) = handle(set) else {
        return INVALID_ARGUMENT;
    };
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeoutms));
    loop {
        let regs = EVENT_SETS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|m| m.get(&n).cloned());
        let Some(regs) = regs else {
            return INVALID_ARGUMENT;
        };
        let got = call("nvmlEventSetWait_v2", None, true, |st| {
            let pos = st.events.iter().position(|e| {
                let kind = if e.xid.is_some() {
                    u64::from(sys::nvmlEventTypeXidCriticalError)
                } else {
                    u64::from(sys::nvmlEventTypeDoubleBitEccError)
                };
                regs.iter().any(|(g, mask)| *g == e.gpu && mask & kind != 0)
            });
            Ok(pos.map(|i| st.events.remove(i)))
        });
        match got {
            Ok(Some(e)) => {
                let (kind, value) = match e.xid {
                    Some(x) => (u64::from(sys::nvmlEventTypeXidCriticalError), x),
                    None => (u64::from(sys::nvmlEventTypeDoubleBitEccError), 0),
                };
                // SAFETY: checked non-null above.
                unsafe {
                    put(
                        data,
                        sys::nvmlEventData_t {
                            device: Handle::Gpu(e.gpu).ptr(),
                            eventType: kind,
                            eventData: value,
                            gpuInstanceId: e.gi.unwrap_or(u32::MAX),
                            computeInstanceId: u32::MAX,
                        },
                    )
                };
                return SUCCESS;
            }
            Ok(None) => {}
            Err(e) => return e,
        }
        let now = Instant::now();
        if now >= deadline {
            return TIMEOUT;
        }
        std::thread::sleep((deadline - now).min(Duration::from_millis(20)));
    }
}

/// Models by name, for the control binary.
pub fn parse_model(s: &str) -> Option<Model> {
    Model::parse(s)
}

/// The CI profile spanning a GI of `slices` (for the control binary's listing).
pub fn full_ci_profile(slices: u32) -> Option<u32> {
    ci_profile_id(slices)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_strangers_are_refused() {
        for h in [
            Handle::Gpu(7),
            Handle::Mig {
                gpu: 3,
                gi: 14,
                ci: 6,
            },
            Handle::Gi { gpu: 1, gi: 0 },
            Handle::Ci {
                gpu: 0,
                gi: 2,
                ci: 1,
            },
            Handle::Set(9),
        ] {
            assert_eq!(Handle::of(h.raw()), Some(h));
        }
        assert_eq!(Handle::of(0x1234), None);
        assert_eq!(gpu_of(std::ptr::null_mut()), Err(INVALID_ARGUMENT));
    }
}
