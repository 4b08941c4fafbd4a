//! The fake's hardware: GPUs, their MIG instances, processes, queued health events
//! and injected faults, in one JSON file shared by every process that loads the
//! library (real MIG instances outlive the process that made them).
//!
//! Every call reads the file under an exclusive `flock` on `<file>.lock`, and one
//! that changes the hardware writes it back atomically (temp file + rename) before
//! the lock is released.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::models::Model;

/// The environment variable naming the state file.
pub const STATE_ENV: &str = "TESSERA_FAKE_NVML_STATE";

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(
        "{STATE_ENV} is not set and no {STATE_BESIDE} is beside the library: the fake NVML has no hardware"
    )]
    NoPath,
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a fake NVML state: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The whole fake machine.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    #[serde(default = "default_driver")]
    pub driver_version: String,
    pub gpus: Vec<Gpu>,
    /// Calls made to fail or hang.
    #[serde(default)]
    pub faults: Vec<Fault>,
    /// Health events not yet delivered by `nvmlEventSetWait`.
    #[serde(default)]
    pub events: Vec<Event>,
    /// Counter behind MIG device UUIDs (a new one on every create, as NVML does).
    #[serde(default)]
    pub uuid_counter: u64,
    /// How the GPUs are wired.
    #[serde(default)]
    pub board: Board,
}

/// The board: how GPUs connect (PCIe switches, NUMA nodes, NVLink).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Board {
    /// PCIe cards without NVLink: two per PCIe switch, half the GPUs per NUMA node.
    #[default]
    Pcie,
    /// An HGX board: every GPU's NVLinks go to NVSwitches (every pair reaches over
    /// NVLink), four GPUs per NUMA node.
    HgxNvswitch,
    /// PCIe cards joined in pairs by NVLink bridges (12 links).
    PciePairs,
}

impl Board {
    pub fn parse(s: &str) -> Option<Board> {
        match s {
            "pcie" => Some(Board::Pcie),
            "hgx-nvswitch" => Some(Board::HgxNvswitch),
            "pcie-pairs" => Some(Board::PciePairs),
            _ => None,
        }
    }

    /// NVML's topology level (`NVML_TOPOLOGY_*`) between GPUs `a` and `b` of `count`.
    pub fn level(self, a: u32, b: u32, count: u32) -> u32 {
        if a == b {
            return 0;
        }
        let half = count.div_ceil(2).max(1);
        let numa = |i: u32| match self {
            Board::HgxNvswitch => i / 4,
            _ => i / half,
        };
        if a / 2 == b / 2 {
            10
        } else if numa(a) == numa(b) {
            40
        } else {
            50
        }
    }
}

fn default_driver() -> String {
    "570.133.20".to_owned()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Gpu {
    pub model: Model,
    pub uuid: String,
    #[serde(default)]
    pub mig_current: bool,
    #[serde(default)]
    pub mig_pending: bool,
    /// Fallen off the bus: every call naming it answers `GPU_IS_LOST`.
    #[serde(default)]
    pub lost: bool,
    #[serde(default)]
    pub instances: Vec<Gi>,
    #[serde(default)]
    pub processes: Vec<Process>,
    /// Remapped rows waiting for a reset / failed (`nvmlDeviceGetRemappedRows`).
    #[serde(default)]
    pub rows_pending: bool,
    #[serde(default)]
    pub rows_failed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Gi {
    pub id: u32,
    /// `NVML_GPU_INSTANCE_PROFILE_*`.
    pub profile: u32,
    pub start: u32,
    pub size: u32,
    #[serde(default)]
    pub cis: Vec<Ci>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ci {
    pub id: u32,
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*`.
    pub profile: u32,
    /// First compute slice inside the GI, and how many.
    pub start: u32,
    pub slices: u32,
    pub uuid: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Process {
    pub pid: u32,
    pub used_memory: u64,
    #[serde(default)]
    pub gi: Option<u32>,
    #[serde(default)]
    pub ci: Option<u32>,
}

/// A call that fails with `code`, or first hangs for `hang_ms`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fault {
    /// The exported symbol name ("nvmlDeviceGetMemoryInfo_v2"), or "*" for every call.
    pub call: String,
    /// Only calls about this GPU (None: any).
    #[serde(default)]
    pub gpu: Option<u32>,
    /// `nvmlReturn_t` to answer; 0 answers normally (after the hang).
    #[serde(default)]
    pub code: u32,
    #[serde(default)]
    pub hang_ms: u64,
    /// How many calls it applies to (None: until removed).
    #[serde(default)]
    pub times: Option<u32>,
}

/// A health event: an XID (`xid`) or a double-bit ECC error (`xid` None).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Event {
    pub gpu: u32,
    #[serde(default)]
    pub xid: Option<u64>,
    #[serde(default)]
    pub gi: Option<u32>,
}

impl State {
    /// A fresh machine of these models (MIG on where `mig`).
    pub fn new(gpus: &[(Model, bool)]) -> State {
        State {
            driver_version: default_driver(),
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(i, &(model, mig))| Gpu {
                    model,
                    uuid: gpu_uuid(i as u32, model),
                    mig_current: mig,
                    mig_pending: mig,
                    lost: false,
                    instances: Vec::new(),
                    processes: Vec::new(),
                    rows_pending: false,
                    rows_failed: false,
                })
                .collect(),
            faults: Vec::new(),
            events: Vec::new(),
            uuid_counter: 0,
            board: Board::default(),
        }
    }

    /// A new `MIG-<uuid>`.
    pub fn next_mig_uuid(&mut self) -> String {
        self.uuid_counter += 1;
        let salt = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id());
        format!(
            "MIG-{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            (salt >> 32) as u32,
            (salt >> 16) as u16,
            (salt & 0xfff) as u16,
            (self.uuid_counter >> 48) as u16 & 0xfff,
            self.uuid_counter & 0xffff_ffff_ffff
        )
    }
}

/// `GPU-<uuid>`, stable for an index and model.
pub fn gpu_uuid(index: u32, model: Model) -> String {
    format!(
        "GPU-{:08x}-fa4e-4000-8000-{:012x}",
        0xfa4e_0000u32 | index,
        model.number() as u64
    )
}

/// The state file's name beside the loaded library, where the environment names none.
pub const STATE_BESIDE: &str = "nvml-fake-state.json";

/// The state file: named by the environment, else `nvml-fake-state.json` in the
/// directory the library was loaded from (so that two copies of the library in one
/// process, each in its own directory, are two machines).
pub fn path_from_env() -> Result<PathBuf, StateError> {
    if let Some(p) = std::env::var_os(STATE_ENV).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let beside = loaded_from()
        .and_then(|lib| lib.parent().map(|d| d.join(STATE_BESIDE)))
        .filter(|p| p.exists());
    beside.ok_or(StateError::NoPath)
}

/// The path this library was loaded from (dladdr of one of its own functions).
fn loaded_from() -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: all-zero is a valid Dl_info (null pointers); dladdr fills it.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let addr = path_from_env as *const libc::c_void;
    // SAFETY: `addr` is an address inside this library; `info` a valid out-pointer.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated file name that lives as long as the
    // library stays loaded; it is copied at once.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

/// The state file, locked for one call.
pub struct Locked {
    path: PathBuf,
    _lock: File,
    pub state: State,
}

/// Lock and read the state.
pub fn lock(path: &Path) -> Result<Locked, StateError> {
    let mut lock_path = path.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io(&lock_path))?;
    // SAFETY: flock on a descriptor this function owns (kept open in `Locked`).
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io(&lock_path)(std::io::Error::last_os_error()));
    }
    let text = std::fs::read(path).map_err(io(path))?;
    let state = serde_json::from_slice(&text).map_err(|source| StateError::Parse {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Locked {
        path: path.to_path_buf(),
        _lock: lock,
        state,
    })
}

impl Locked {
    /// Write the state back (atomically), still under the lock.
    pub fn save(&self) -> Result<(), StateError> {
        write_state(&self.path, &self.state)
    }
}

/// Write a state file atomically (the control binary's `init`, and every change).
pub fn write_state(path: &Path, state: &State) -> Result<(), StateError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let text = serde_json::to_vec_pretty(state).map_err(|source| StateError::Parse {
        path: path.to_path_buf(),
        source,
    })?;
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(&text).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}
