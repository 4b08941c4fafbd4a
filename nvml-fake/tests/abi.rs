//! The fake as tesserad sees it: loaded with dlopen (never linked), its exported
//! symbols checked against what the daemon's NVML backend resolves, and driven
//! through nvml-wrapper the way the backend drives it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings as sys;

/// The built library (cargo builds it beside the test executables, in deps/).
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for p in [
        deps.join("libnvidia_ml.so"),
        deps.parent().unwrap().join("libnvidia_ml.so"),
    ] {
        if p.exists() {
            return p;
        }
    }
    panic!("libnvidia_ml.so not built beside {}", exe.display());
}

/// The symbols nvml-wrapper 0.13 resolves for the wrapper methods
/// daemon/src/gpu/nvml.rs calls (read from its source: the versioned names the real
/// library exports), as (method as nvml.rs calls it, symbol).
const THROUGH_THE_WRAPPER: &[(&str, &str)] = &[
    ("Nvml::builder()", "nvmlInit_v2"),
    ("Nvml::init()", "nvmlInit_v2"),
    ("Nvml::builder()", "nvmlShutdown"),
    (".device_count()", "nvmlDeviceGetCount_v2"),
    (".sys_driver_version()", "nvmlSystemGetDriverVersion"),
    (".device_by_index(", "nvmlDeviceGetHandleByIndex_v2"),
    (".name()", "nvmlDeviceGetName"),
    (".mig_mode()", "nvmlDeviceGetMigMode"),
    (".attributes()", "nvmlDeviceGetAttributes_v2"),
    (".uuid()", "nvmlDeviceGetUUID"),
    (".memory_info()", "nvmlDeviceGetMemoryInfo_v2"),
    (".minor_number()", "nvmlDeviceGetMinorNumber"),
    (".pci_info()", "nvmlDeviceGetPciInfo_v3"),
    (
        ".running_compute_processes()",
        "nvmlDeviceGetComputeRunningProcesses_v3",
    ),
    (".utilization_rates()", "nvmlDeviceGetUtilizationRates"),
    (
        ".topology_common_ancestor(",
        "nvmlDeviceGetTopologyCommonAncestor",
    ),
    (".is_active()", "nvmlDeviceGetNvLinkState"),
    (".remote_pci_info()", "nvmlDeviceGetNvLinkRemotePciInfo_v2"),
    (".p2p_status(", "nvmlDeviceGetP2PStatus"),
];

fn nvml_rs() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../daemon/src/gpu/nvml.rs");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The raw symbols nvml.rs takes from the loaded bindings (`lib().nvmlX`,
/// `lib.nvmlX`).
fn raw_symbols(src: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let parts = src.split("lib().").skip(1).chain(src.split("lib.").skip(1));
    for part in parts {
        let name: String = part
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.starts_with("nvml") {
            out.insert(name);
        }
    }
    out
}

fn exported(lib: &Path) -> BTreeSet<String> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(lib)
        .output()
        .expect("nm (binutils) reads the library's dynamic symbols");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with("nvml"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_symbol_the_daemon_resolves_is_exported_under_the_real_library_s_name() {
    let src = nvml_rs();
    let raw = raw_symbols(&src);
    assert!(
        raw.len() >= 20,
        "the scan of nvml.rs found too few symbols: {raw:?}"
    );
    for (method, _) in THROUGH_THE_WRAPPER {
        assert!(
            src.contains(method),
            "nvml.rs no longer calls {method}: update THROUGH_THE_WRAPPER"
        );
    }
    let have = exported(&library());
    let mut missing: Vec<&str> = raw
        .iter()
        .map(String::as_str)
        .chain(THROUGH_THE_WRAPPER.iter().map(|(_, s)| *s))
        .filter(|s| !have.contains(*s))
        .collect();
    missing.dedup();
    assert!(missing.is_empty(), "the fake does not export {missing:?}");
    // The create without a placement, which NVML offers beside it.
    assert!(have.contains("nvmlDeviceCreateGpuInstance"));
}

/// A machine in its own directory: the library copied as libnvidia-ml.so.1 with
/// its state file beside it.
struct Machine {
    dir: tempfile::TempDir,
}

impl Machine {
    fn new(gpus: &[&str]) -> Machine {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(library(), dir.path().join("libnvidia-ml.so.1")).unwrap();
        let m = Machine { dir };
        let mut args = vec!["init"];
        args.extend(gpus);
        m.ctl(&args);
        m
    }

    fn ctl(&self, args: &[&str]) {
        let out = Command::new(env!("CARGO_BIN_EXE_nvml-fake-ctl"))
            .arg("--state")
            .arg(self.dir.path().join("nvml-fake-state.json"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "nvml-fake-ctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn open(&self) -> Nvml {
        Nvml::builder()
            .lib_path(self.dir.path().join("libnvidia-ml.so.1").as_os_str())
            .init()
            .unwrap()
    }
}

const fn version<T>(v: u32) -> u32 {
    (std::mem::size_of::<T>() as u32) | (v << 24)
}

#[test]
fn devices_read_through_nvml_wrapper_as_the_real_library_s() {
    let m = Machine::new(&["h100-80gb:mig", "a100-40gb"]);
    let nvml = m.open();
    assert_eq!(nvml.device_count().unwrap(), 2);
    let d0 = nvml.device_by_index(0).unwrap();
    assert_eq!(d0.name().unwrap(), "NVIDIA H100 80GB HBM3");
    assert_eq!(d0.memory_info().unwrap().total, 80 << 30);
    assert!(d0.uuid().unwrap().starts_with("GPU-"));
    assert_eq!(d0.pci_info().unwrap().bus_id, "00000000:1B:00.0");
    assert_eq!(d0.mig_mode().unwrap().current, sys::NVML_DEVICE_MIG_ENABLE);
    let d1 = nvml.device_by_index(1).unwrap();
    assert_eq!(d1.mig_mode().unwrap().current, sys::NVML_DEVICE_MIG_DISABLE);
    // As driver 580 answers on an H200: no attributes for a whole GPU.
    assert!(matches!(d0.attributes(), Err(NvmlError::NotSupported)));
    assert!(d1.running_compute_processes().unwrap().is_empty());
    m.ctl(&["process", "1", "4242", "1073741824"]);
    let procs = d1.running_compute_processes().unwrap();
    assert_eq!((procs.len(), procs[0].pid), (1, 4242));
    assert!(matches!(
        nvml.device_by_index(2),
        Err(NvmlError::InvalidArg)
    ));
    // A lost GPU: its handle lookup and every query answer GPU_IS_LOST; the other
    // answers; back on the bus it answers again.
    m.ctl(&["lose", "0"]);
    assert!(matches!(d0.memory_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(nvml.device_by_index(0), Err(NvmlError::GpuLost)));
    assert!(d1.memory_info().is_ok());
    m.ctl(&["restore", "0"]);
    assert!(d0.memory_info().is_ok());
    // An injected failure with a code, once.
    m.ctl(&["fail", "nvmlDeviceGetMemoryInfo_v2", "17", "1", "1"]);
    assert!(matches!(d1.memory_info(), Err(NvmlError::OperatingSystem)));
    assert!(d1.memory_info().is_ok());
}

#[test]
fn mig_instances_follow_nvml_s_count_semantics_and_survive_the_process() {
    let m = Machine::new(&["h100-80gb:mig"]);
    let nvml = m.open();
    let lib = nvml.lib();
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    let dev = unsafe { nvml.device_by_index(0).unwrap().handle() };
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    let mut info: sys::nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
    info.version = version::<sys::nvmlGpuInstanceProfileInfo_v2_t>(2);
    let get_info = lib.nvmlDeviceGetGpuInstanceProfileInfoV.as_ref().unwrap();
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    assert_eq!(unsafe { get_info(dev, 0, &mut info) }, 0);
    assert_eq!(
        (info.sliceCount, info.instanceCount, info.memorySizeMB),
        (1, 7, 9984)
    );
    // The profile's driver id (what the placement, create and list calls take) is
    // not its index: 19 for the 1g, as a real driver says.
    assert_eq!(info.id, 19);
    let id = info.id;
    // Placements: a null buffer asks the count; a short buffer gets what fits and
    // the count (the real driver 580 does not answer INSUFFICIENT_SIZE here).
    let placements = lib
        .nvmlDeviceGetGpuInstancePossiblePlacements_v2
        .as_ref()
        .unwrap();
    let mut n = 0u32;
    assert_eq!(
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        unsafe { placements(dev, id, std::ptr::null_mut(), &mut n) },
        0
    );
    assert_eq!(n, 7);
    let mut buf = vec![sys::nvmlGpuInstancePlacement_t { start: 0, size: 0 }; 2];
    let mut n = 2u32;
    assert_eq!(
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        unsafe { placements(dev, id, buf.as_mut_ptr(), &mut n) },
        0
    );
    assert_eq!(n, 7);
    assert_eq!((buf[1].start, buf[1].size), (1, 1));
    // An index is not a driver id: 7 (the 1g+me's index; its driver id is 20).
    let mut n = 0u32;
    assert_ne!(
        // SAFETY: as above.
        unsafe { placements(dev, 7, std::ptr::null_mut(), &mut n) },
        0,
        "placements took a profile index for a driver id"
    );
    // Create three 1g GIs (one without a placement), each with its CI.
    let create = lib
        .nvmlDeviceCreateGpuInstanceWithPlacement
        .as_ref()
        .unwrap();
    let create_any = lib.nvmlDeviceCreateGpuInstance.as_ref().unwrap();
    let create_ci = lib.nvmlGpuInstanceCreateComputeInstance.as_ref().unwrap();
    for start in [2u32, 5] {
        let mut gi = std::ptr::null_mut();
        let p = sys::nvmlGpuInstancePlacement_t { start, size: 1 };
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        assert_eq!(unsafe { create(dev, id, &p, &mut gi) }, 0);
        let mut ci = std::ptr::null_mut();
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        assert_eq!(unsafe { create_ci(gi, 0, &mut ci) }, 0);
    }
    let mut gi = std::ptr::null_mut();
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    assert_eq!(unsafe { create_any(dev, id, &mut gi) }, 0);
    let overlapping = sys::nvmlGpuInstancePlacement_t { start: 2, size: 1 };
    let mut other = std::ptr::null_mut();
    assert_eq!(
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        unsafe { create(dev, id, &overlapping, &mut other) },
        sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES
    );
    // Listing: the count in is the buffer's size.
    let list = lib.nvmlDeviceGetGpuInstances.as_ref().unwrap();
    let mut small = vec![std::ptr::null_mut(); 2];
    let mut n = 2u32;
    assert_eq!(
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        unsafe { list(dev, id, small.as_mut_ptr(), &mut n) },
        sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE
    );
    assert_eq!(n, 3, "the size needed comes back");
    let mut zero = vec![std::ptr::null_mut(); 8];
    let mut n = 0u32;
    assert_eq!(
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        unsafe { list(dev, id, zero.as_mut_ptr(), &mut n) },
        sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE,
        "a count of 0 is a buffer of 0"
    );
    let mut all = vec![std::ptr::null_mut(); 8];
    let mut n = 8u32;
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    assert_eq!(unsafe { list(dev, id, all.as_mut_ptr(), &mut n) }, 0);
    assert_eq!(n, 3);
    // MIG devices: two have a CI (the third GI has none), each with a MIG UUID.
    let by_index = lib.nvmlDeviceGetMigDeviceHandleByIndex.as_ref().unwrap();
    let mut uuids = Vec::new();
    for i in 0..7 {
        let mut mig = std::ptr::null_mut();
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        if unsafe { by_index(dev, i, &mut mig) } != 0 {
            continue;
        }
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        let d = unsafe { nvml_wrapper::Device::new(mig, &nvml) };
        uuids.push(d.uuid().unwrap());
    }
    assert_eq!(uuids.len(), 2, "{uuids:?}");
    assert!(uuids.iter().all(|u| u.starts_with("MIG-")));
    // A destroy with a CI left is refused; the GI without one goes.
    let destroy = lib.nvmlGpuInstanceDestroy.as_ref().unwrap();
    assert_eq!(
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        unsafe { destroy(all[0]) },
        sys::nvmlReturn_enum_NVML_ERROR_IN_USE
    );
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    assert_eq!(unsafe { destroy(gi) }, 0);
    drop(nvml);
    // Another process (here: a new load) sees the instances that are left.
    let again = m.open();
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    let dev = unsafe { again.device_by_index(0).unwrap().handle() };
    let list = again.lib().nvmlDeviceGetGpuInstances.as_ref().unwrap();
    let mut buf = vec![std::ptr::null_mut(); 8];
    let mut n = 8u32;
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    assert_eq!(unsafe { list(dev, id, buf.as_mut_ptr(), &mut n) }, 0);
    assert_eq!(n, 2);
}

#[test]
fn health_events_arrive_through_the_event_set() {
    let m = Machine::new(&["h100-80gb", "h100-80gb"]);
    let nvml = m.open();
    let lib = nvml.lib();
    let mut set = std::ptr::null_mut();
    assert_eq!(
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        unsafe { lib.nvmlEventSetCreate.as_ref().unwrap()(&mut set) },
        0
    );
    let register = lib.nvmlDeviceRegisterEvents.as_ref().unwrap();
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    let dev1 = unsafe { nvml.device_by_index(1).unwrap().handle() };
    let types = u64::from(sys::nvmlEventTypeXidCriticalError | sys::nvmlEventTypeDoubleBitEccError);
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    assert_eq!(unsafe { register(dev1, types, set) }, 0);
    let wait = lib.nvmlEventSetWait_v2.as_ref().unwrap();
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    let mut data: sys::nvmlEventData_t = unsafe { std::mem::zeroed() };
    assert_eq!(
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        unsafe { wait(set, &mut data, 10) },
        sys::nvmlReturn_enum_NVML_ERROR_TIMEOUT
    );
    m.ctl(&["xid", "0", "79"]); // GPU 0 is not registered: not delivered
    m.ctl(&["xid", "1", "94", "3"]);
    m.ctl(&["ecc", "1"]);
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    assert_eq!(unsafe { wait(set, &mut data, 1000) }, 0);
    assert_eq!(
        (data.eventType, data.eventData, data.gpuInstanceId),
        (u64::from(sys::nvmlEventTypeXidCriticalError), 94, 3)
    );
    assert_eq!(data.device, dev1);
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    assert_eq!(unsafe { wait(set, &mut data, 1000) }, 0);
    assert_eq!(
        data.eventType,
        u64::from(sys::nvmlEventTypeDoubleBitEccError)
    );
    assert_eq!(
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        unsafe { wait(set, &mut data, 10) },
        sys::nvmlReturn_enum_NVML_ERROR_TIMEOUT
    );
    // Null pointers are refused, never dereferenced.
    assert_eq!(
        // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
        unsafe { wait(set, std::ptr::null_mut(), 10) },
        sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
    );
    // SAFETY: handles this library gave out; out-parameters valid, buffers as large as the counts passed.
    assert_eq!(unsafe { lib.nvmlEventSetFree.as_ref().unwrap()(set) }, 0);
}
