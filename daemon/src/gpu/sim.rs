//! Simulated GPUs: a faithful model of NVML for A100/H100/H200.
//!
//! The simulated hardware state (GIs, CIs, MIG UUIDs, MPS daemons, injected faults,
//! fake processes) lives in a *state file*, not only in memory: like real MIG
//! instances it outlives the daemon process, so a restarted daemon finds what the
//! last one created. The file is a log of JSON lines: a snapshot of the whole state,
//! then one line per change holding only what the change touched (the GPUs it
//! modified, the MPS daemons it started or stopped). A change costs one appended
//! line however many daemons run; once the changes outweigh the snapshot, a new
//! snapshot replaces the file (compaction, by rename). Every call runs under an
//! in-process mutex plus an advisory `flock` on a sibling lock file, and checks the
//! file's identity (a `stat`): when another process changed it (a test harness
//! injecting faults or adding processes through its own `SimBackend` on the same
//! file), the state is loaded again.
//!
//! Deleting the state file models a reboot: MIG instances and MPS daemons are gone,
//! MIG mode comes back from the config.
//!
//! Fidelity notes (NVML's documented behaviour, and what a real H200 answered):
//! * errors carry the NVML code NVML returns for the same mistake;
//! * GI ids and CI ids are the lowest free ones (reused), MIG UUIDs are fresh
//!   `MIG-<uuid v4>` values on every create;
//! * a MIG device (and so a MIG UUID) exists per CI: a GI without a CI is reported
//!   with `ci_id: None` and an empty `uuid`, as NVML has no MIG device handle for it;
//! * [`GpuBackend::mig_minors`] returns the full table the driver publishes for the
//!   simulated GPUs (every GI and CI id, whether or not an instance exists), exactly
//!   what `/proc/driver/nvidia-caps/mig-minors` lists; [`SimBackend::mig_minors_text`]
//!   renders it in that file's format.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::backend::GpuBackend;
use super::caps;
use super::health::{HealthCause, HealthEvent};
use super::profiles::GpuModel;
pub use super::sim_control::{CallFault, SimControl};
use super::topology::{GpuLink, SimTopology};
use super::types::{
    GiProfile, GpuError, GpuInfo, GpuProcess, MigInstance, MigMinors, NvmlCode, Placement,
    Utilization,
};
use crate::mps::{MpsDaemon, MpsSpec};

/// Driver version the simulator reports.
pub const SIM_DRIVER_VERSION: &str = "sim-580.65.06";
/// Version of the state-file layout: 2 is a snapshot line followed by change lines;
/// version 1 (a snapshot alone, in the same shape) is read too.
const STATE_VERSION: u32 = 2;
/// The oldest layout this simulator reads.
const OLDEST_STATE_VERSION: u32 = 1;
/// Change lines may grow to the snapshot's size plus this before the file is
/// compacted: compaction costs O(state) once per O(state) bytes of changes, and a
/// start reads at most twice the snapshot (plus this).
const COMPACT_SLACK_BYTES: u64 = 512 << 10;
/// First fake pid handed to simulated MPS daemons.
const FIRST_FAKE_PID: u32 = 40_000;
/// GI ids available per GPU (the nvidia-caps minor space holds 15).
const MAX_GI_IDS: u32 = caps::GI_IDS_PER_GPU;

fn default_true() -> bool {
    true
}

/// One simulated GPU in the daemon config (`[[sim.gpus]]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimGpuConfig {
    /// "a100-40gb", "a100-80gb", "h100-80gb" or "h200-141gb".
    pub model: GpuModel,
    /// MIG mode (current and pending). Default: enabled.
    #[serde(default = "default_true")]
    pub mig: bool,
    /// Fixed `GPU-<uuid>`; default derived from the seed, index and model.
    #[serde(default)]
    pub uuid: Option<String>,
}

/// The `[sim]` section of the daemon config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    pub gpus: Vec<SimGpuConfig>,
    /// Seed for derived GPU UUIDs (two simulated hosts with different seeds get
    /// different UUIDs).
    #[serde(default)]
    pub seed: Option<String>,
    /// Where the simulated hardware state lives; the daemon picks a default (e.g.
    /// under its state directory) when unset. See [`SimConfig::state_file_or`].
    #[serde(default)]
    pub state_file: Option<PathBuf>,
    /// Faults on simulated calls for the daemon's whole life (`[[sim.faults]]`):
    /// a failure rate, a delay, the NVML code. More can be injected at run time
    /// through the control file (`tesserad sim fault`).
    #[serde(default)]
    pub faults: Vec<CallFault>,
    /// The board modelled: how the GPUs connect (PCIe switches, NUMA nodes,
    /// NVLink), as NVML's topology queries report it.
    #[serde(default)]
    pub topology: SimTopology,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimConfigError {
    #[error("the simulator needs at least one GPU ([[sim.gpus]])")]
    NoGpus,
    #[error("sim GPU {index}: uuid {uuid:?} is not GPU-<uuid>")]
    BadUuid { index: u32, uuid: String },
    #[error("sim.faults: {0}")]
    Fault(#[from] super::sim_control::CallFaultError),
    #[error("sim GPUs {first} and {second} have the same uuid {uuid}")]
    DuplicateUuid {
        first: u32,
        second: u32,
        uuid: String,
    },
}

impl SimConfig {
    /// The configured state file, or `default`.
    pub fn state_file_or(&self, default: impl Into<PathBuf>) -> PathBuf {
        self.state_file.clone().unwrap_or_else(|| default.into())
    }

    /// Checks the config without touching any file.
    pub fn validate(&self) -> Result<(), SimConfigError> {
        if self.gpus.is_empty() {
            return Err(SimConfigError::NoGpus);
        }
        for f in &self.faults {
            f.validate()?;
        }
        let uuids = self.gpu_uuids()?;
        for (i, a) in uuids.iter().enumerate() {
            if let Some(j) = uuids[i + 1..].iter().position(|b| b == a) {
                return Err(SimConfigError::DuplicateUuid {
                    first: i as u32,
                    second: (i + 1 + j) as u32,
                    uuid: a.clone(),
                });
            }
        }
        Ok(())
    }

    /// The GPU UUIDs, configured or derived.
    fn gpu_uuids(&self) -> Result<Vec<String>, SimConfigError> {
        self.gpus
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let index = i as u32;
                match &g.uuid {
                    Some(u) => {
                        let ok = u
                            .strip_prefix("GPU-")
                            .is_some_and(|rest| uuid::Uuid::parse_str(rest).is_ok());
                        if ok {
                            Ok(u.clone())
                        } else {
                            Err(SimConfigError::BadUuid {
                                index,
                                uuid: u.clone(),
                            })
                        }
                    }
                    None => Ok(derived_gpu_uuid(
                        self.seed.as_deref().unwrap_or(""),
                        index,
                        g.model,
                    )),
                }
            })
            .collect()
    }
}

/// `GPU-<uuid>` derived from sha256(seed, index, model): stable across restarts.
pub fn derived_gpu_uuid(seed: &str, index: u32, model: GpuModel) -> String {
    let digest = Sha256::digest(format!(
        "tessera-sim\0{seed}\0{index}\0{}",
        model.short_name()
    ));
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    format!(
        "GPU-{}",
        uuid::Builder::from_random_bytes(bytes).into_uuid()
    )
}

/// Where an injected create failure strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CreateStage {
    /// `nvmlDeviceCreateGpuInstanceWithPlacement` fails: nothing is created.
    Gi,
    /// `nvmlGpuInstanceCreateComputeInstance` fails: the GI is rolled back.
    Ci,
}

/// A fault armed for the next create on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CreateFault {
    Fail(CreateStage),
    /// The GI is created, then the call errors without creating the CI and without
    /// rolling back: what a daemon crash between the two steps leaves behind.
    CrashAfterGi,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Faults {
    next_create: Option<CreateFault>,
    fail_next_destroy: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SimCi {
    ci_id: u32,
    profile_id: u32,
    uuid: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SimGi {
    gi_id: u32,
    profile_id: u32,
    placement: Placement,
    ci: Option<SimCi>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SimGpu {
    index: u32,
    model: GpuModel,
    uuid: String,
    mig: bool,
    instances: Vec<SimGi>,
    processes: Vec<GpuProcess>,
    faults: Faults,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SimState {
    version: u32,
    gpus: Vec<SimGpu>,
    mps: MpsTable,
    next_pid: u32,
    /// What the running mutation changed: the next change line.
    #[serde(skip)]
    touched: Touched,
}

/// GPUs and MPS daemons (by lease) a mutation touched.
#[derive(Debug, Clone, Default)]
struct Touched {
    gpus: BTreeSet<u32>,
    mps: BTreeSet<String>,
}

/// The MPS control daemons by lease, and which lease holds each pipe directory
/// (one daemon per pipe directory, as with the real control daemon). Stored as a
/// list of daemons.
#[derive(Debug, Clone, Default)]
struct MpsTable {
    by_lease: BTreeMap<String, MpsDaemon>,
    by_pipe: HashMap<PathBuf, String>,
}

impl MpsTable {
    fn get(&self, lease_id: &str) -> Option<&MpsDaemon> {
        self.by_lease.get(lease_id)
    }

    /// The lease whose daemon uses `pipe_dir`.
    fn pipe_holder(&self, pipe_dir: &Path) -> Option<&str> {
        self.by_pipe.get(pipe_dir).map(String::as_str)
    }

    fn put(&mut self, d: MpsDaemon) {
        if let Some(old) = self.by_lease.get(&d.spec.lease_id) {
            self.by_pipe.remove(&old.spec.pipe_dir);
        }
        self.by_pipe
            .insert(d.spec.pipe_dir.clone(), d.spec.lease_id.clone());
        self.by_lease.insert(d.spec.lease_id.clone(), d);
    }

    fn remove(&mut self, lease_id: &str) {
        if let Some(old) = self.by_lease.remove(lease_id) {
            self.by_pipe.remove(&old.spec.pipe_dir);
        }
    }
}

impl Serialize for MpsTable {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.by_lease.values())
    }
}

impl<'de> Deserialize<'de> for MpsTable {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let list = Vec::<MpsDaemon>::deserialize(deserializer)?;
        let mut table = MpsTable::default();
        for d in list {
            if table.by_lease.contains_key(&d.spec.lease_id) {
                return Err(serde::de::Error::custom(format!(
                    "two MPS daemons for lease {}",
                    d.spec.lease_id
                )));
            }
            if let Some(other) = table.pipe_holder(&d.spec.pipe_dir) {
                return Err(serde::de::Error::custom(format!(
                    "leases {other} and {} share the MPS pipe directory {}",
                    d.spec.lease_id,
                    d.spec.pipe_dir.display()
                )));
            }
            table.put(d);
        }
        Ok(table)
    }
}

/// One change line: the GPUs a mutation touched (whole), the MPS daemons it started
/// or changed (whole) and those it stopped, and the next fake pid.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Change {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    gpus: Vec<SimGpu>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    mps_put: Vec<MpsDaemon>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    mps_del: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next_pid: Option<u32>,
}

impl Change {
    fn is_empty(&self) -> bool {
        self.gpus.is_empty()
            && self.mps_put.is_empty()
            && self.mps_del.is_empty()
            && self.next_pid.is_none()
    }
}

impl SimState {
    fn fresh(config: &SimConfig, uuids: &[String]) -> SimState {
        SimState {
            version: STATE_VERSION,
            gpus: config
                .gpus
                .iter()
                .zip(uuids)
                .enumerate()
                .map(|(i, (g, uuid))| SimGpu {
                    index: i as u32,
                    model: g.model,
                    uuid: uuid.clone(),
                    mig: g.mig,
                    instances: Vec::new(),
                    processes: Vec::new(),
                    faults: Faults::default(),
                })
                .collect(),
            mps: MpsTable::default(),
            next_pid: FIRST_FAKE_PID,
            touched: Touched::default(),
        }
    }

    fn gpu(&self, gpu: u32) -> Result<&SimGpu, GpuError> {
        self.gpus.get(gpu as usize).ok_or(GpuError::NoSuchGpu(gpu))
    }

    fn gpu_mut(&mut self, gpu: u32) -> Result<&mut SimGpu, GpuError> {
        let g = self
            .gpus
            .get_mut(gpu as usize)
            .ok_or(GpuError::NoSuchGpu(gpu))?;
        self.touched.gpus.insert(gpu);
        Ok(g)
    }

    fn mps_put(&mut self, d: MpsDaemon) {
        self.touched.mps.insert(d.spec.lease_id.clone());
        self.mps.put(d);
    }

    fn mps_remove(&mut self, lease_id: &str) {
        if self.mps.get(lease_id).is_some() {
            self.touched.mps.insert(lease_id.to_owned());
            self.mps.remove(lease_id);
        }
    }

    /// What the mutation that began at `pid_before` changed; clears the record.
    fn take_change(&mut self, pid_before: u32) -> Change {
        let touched = std::mem::take(&mut self.touched);
        let mut change = Change {
            gpus: touched
                .gpus
                .iter()
                .filter_map(|&i| self.gpus.get(i as usize).cloned())
                .collect(),
            next_pid: (self.next_pid != pid_before).then_some(self.next_pid),
            ..Change::default()
        };
        for lease in touched.mps {
            match self.mps.get(&lease) {
                Some(d) => change.mps_put.push(d.clone()),
                None => change.mps_del.push(lease),
            }
        }
        change
    }

    /// Replays one change line.
    fn apply(&mut self, change: Change) -> Result<(), String> {
        for g in change.gpus {
            let slot = self
                .gpus
                .get_mut(g.index as usize)
                .ok_or_else(|| format!("a change names GPU {}, which is not here", g.index))?;
            if (slot.model, &slot.uuid) != (g.model, &g.uuid) {
                return Err(format!(
                    "a change describes GPU {} as {} {}, not {} {}",
                    g.index, g.model, g.uuid, slot.model, slot.uuid
                ));
            }
            *slot = g;
        }
        for lease in &change.mps_del {
            self.mps.remove(lease);
        }
        for d in change.mps_put {
            if let Some(other) = self
                .mps
                .pipe_holder(&d.spec.pipe_dir)
                .filter(|l| *l != d.spec.lease_id)
            {
                return Err(format!(
                    "leases {other} and {} share the MPS pipe directory {}",
                    d.spec.lease_id,
                    d.spec.pipe_dir.display()
                ));
            }
            self.mps.put(d);
        }
        if let Some(pid) = change.next_pid {
            self.next_pid = pid;
        }
        Ok(())
    }
}

/// Where the first newline of `bytes` is.
fn newline(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b == b'\n')
}

fn nvml_err(call: &'static str, code: NvmlCode, detail: impl Into<String>) -> GpuError {
    GpuError::Nvml {
        call,
        code,
        detail: detail.into(),
    }
}

const CALL_CREATE_GI: &str = "nvmlDeviceCreateGpuInstanceWithPlacement";
const CALL_CREATE_CI: &str = "nvmlGpuInstanceCreateComputeInstance";
const CALL_DESTROY_GI: &str = "nvmlGpuInstanceDestroy";
const CALL_DESTROY_CI: &str = "nvmlComputeInstanceDestroy";
const CALL_GET_GI: &str = "nvmlDeviceGetGpuInstanceById";

impl SimGpu {
    fn profile(&self, profile_id: u32) -> Result<GiProfile, GpuError> {
        self.model
            .gi_profile(profile_id)
            .ok_or(GpuError::UnknownProfile {
                gpu: self.index,
                profile_id,
            })
    }

    fn require_mig(&self, call: &'static str) -> Result<(), GpuError> {
        if self.mig {
            Ok(())
        } else {
            Err(nvml_err(
                call,
                NvmlCode::NotSupported,
                format!("MIG mode is disabled on GPU {}", self.index),
            ))
        }
    }

    fn instance(&self, gi: &SimGi) -> Result<MigInstance, GpuError> {
        let profile = self.profile(gi.profile_id)?;
        let ci_sm = gi.ci.as_ref().and_then(|ci| {
            profile
                .ci_profiles
                .iter()
                .find(|c| c.id == ci.profile_id)
                .map(|c| c.sm_count)
        });
        Ok(MigInstance {
            gpu: self.index,
            gi_id: gi.gi_id,
            gi_profile_id: gi.profile_id,
            placement: gi.placement,
            ci_id: gi.ci.as_ref().map(|c| c.ci_id),
            ci_profile_id: gi.ci.as_ref().map(|c| c.profile_id),
            uuid: gi.ci.as_ref().map(|c| c.uuid.clone()).unwrap_or_default(),
            memory_bytes: profile.memory_bytes,
            sm_count: ci_sm.unwrap_or(profile.sm_count),
        })
    }

    /// `nvmlDeviceCreateGpuInstanceWithPlacement`: checks as NVML does.
    fn create_gi(&mut self, profile: &GiProfile, placement: Placement) -> Result<u32, GpuError> {
        if !profile.placements.contains(&placement) {
            return Err(nvml_err(
                CALL_CREATE_GI,
                NvmlCode::InvalidArgument,
                format!(
                    "placement {}:{} is not a possible placement of {}",
                    placement.start, placement.size, profile.name
                ),
            ));
        }
        let same_profile = self
            .instances
            .iter()
            .filter(|g| g.profile_id == profile.id)
            .count() as u32;
        if same_profile >= profile.max_count {
            return Err(nvml_err(
                CALL_CREATE_GI,
                NvmlCode::InsufficientResources,
                format!(
                    "{} already has its maximum of {} instances",
                    profile.name, profile.max_count
                ),
            ));
        }
        if let Some(other) = self
            .instances
            .iter()
            .find(|g| g.placement.overlaps(&placement))
        {
            return Err(nvml_err(
                CALL_CREATE_GI,
                NvmlCode::InsufficientResources,
                format!(
                    "placement {}:{} overlaps GI {} at {}:{}",
                    placement.start,
                    placement.size,
                    other.gi_id,
                    other.placement.start,
                    other.placement.size
                ),
            ));
        }
        let used: BTreeSet<u32> = self.instances.iter().map(|g| g.gi_id).collect();
        let gi_id = (0..MAX_GI_IDS)
            .find(|id| !used.contains(id))
            .ok_or_else(|| {
                nvml_err(
                    CALL_CREATE_GI,
                    NvmlCode::InsufficientResources,
                    "no free GPU-instance id",
                )
            })?;
        self.instances.push(SimGi {
            gi_id,
            profile_id: profile.id,
            placement,
            ci: None,
        });
        self.instances.sort_by_key(|g| g.gi_id);
        Ok(gi_id)
    }

    /// `nvmlGpuInstanceCreateComputeInstance` on a GI without a CI.
    fn create_ci(
        &mut self,
        profile: &GiProfile,
        gi_id: u32,
        ci_profile_id: Option<u32>,
    ) -> Result<(), GpuError> {
        let ci_profile = match ci_profile_id {
            Some(id) => profile.ci_profiles.iter().find(|c| c.id == id),
            None => profile
                .ci_profiles
                .iter()
                .find(|c| c.slices == profile.slices),
        }
        .ok_or_else(|| {
            nvml_err(
                CALL_CREATE_CI,
                NvmlCode::InvalidArgument,
                format!(
                    "CI profile {ci_profile_id:?} does not exist in GI profile {}",
                    profile.name
                ),
            )
        })?;
        let gi = self
            .instances
            .iter_mut()
            .find(|g| g.gi_id == gi_id)
            .ok_or_else(|| nvml_err(CALL_CREATE_CI, NvmlCode::NotFound, "GI vanished"))?;
        gi.ci = Some(SimCi {
            // The lowest free CI id: the GI has none yet.
            ci_id: 0,
            profile_id: ci_profile.id,
            uuid: format!("MIG-{}", uuid::Uuid::new_v4()),
        });
        Ok(())
    }
}

/// The simulated backend. Cheap to construct; all state is in the state file.
pub struct SimBackend {
    config: SimConfig,
    uuids: Vec<String>,
    path: PathBuf,
    lock_path: PathBuf,
    /// Serialises operations in this process; holds the state as of the version of
    /// the file this process last read or wrote.
    mutex: Mutex<Option<Cached>>,
    /// Injected faults and hardware health, beside the state file.
    control: SimControl,
}

/// The state and the version of the file it is the content of.
struct Cached {
    id: FileId,
    state: SimState,
    /// Length of the file's snapshot line (compaction is due when the change lines
    /// outweigh it).
    snapshot_len: u64,
    /// The file `id` names, open for appending change lines: opened at the first
    /// change and kept while the cache is valid (a replaced file makes a new cache).
    append: Option<File>,
}

/// Identity of one version of the state file. A compaction renames a new file into
/// place (a new inode) and a change appends (a new length and mtime), so while the
/// identity is unchanged the cached state is the file's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl FileId {
    fn from_meta(m: &fs::Metadata) -> FileId {
        use std::os::unix::fs::MetadataExt;
        FileId {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        }
    }
}

impl std::fmt::Debug for SimBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBackend")
            .field("path", &self.path)
            .field("gpus", &self.config.gpus.len())
            .finish()
    }
}

/// Holds the in-process mutex and the cross-process flock for one operation.
struct Locked<'a> {
    guard: MutexGuard<'a, Option<Cached>>,
    _flock: Flock<File>,
}

impl SimBackend {
    /// Open (or create) the simulated hardware described by `config`, with its
    /// state in `state_file`. An existing state file must describe the same GPUs
    /// (models, order, UUIDs); otherwise this fails rather than wiping it.
    pub fn open(config: &SimConfig, state_file: impl Into<PathBuf>) -> Result<Self, GpuError> {
        config
            .validate()
            .map_err(|e| GpuError::DriverUnavailable(format!("invalid [sim] config: {e}")))?;
        let uuids = config
            .gpu_uuids()
            .map_err(|e| GpuError::DriverUnavailable(format!("invalid [sim] config: {e}")))?;
        let path: PathBuf = state_file.into();
        let mut lock_name = path.file_name().unwrap_or_default().to_os_string();
        lock_name.push(".lock");
        let lock_path = path.with_file_name(lock_name);
        let control = SimControl::beside(&path, config.faults.clone());
        let backend = SimBackend {
            control,
            config: config.clone(),
            uuids,
            path,
            lock_path,
            mutex: Mutex::new(None),
        };
        // Create the file now (or check the existing one) so errors surface at start.
        backend.read(|_| Ok(()))?;
        Ok(backend)
    }

    /// The state file's path.
    pub fn state_path(&self) -> &Path {
        &self.path
    }

    /// The control file: injected call faults and the simulated hardware's health.
    pub fn control(&self) -> &SimControl {
        &self.control
    }

    fn io_err(path: &Path, source: std::io::Error) -> GpuError {
        GpuError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    fn lock(&self) -> Result<Locked<'_>, GpuError> {
        // A panic in another thread leaves no half-written state behind (a change
        // line is applied in memory only after it is built, and a torn line is
        // discarded on load), so a poisoned mutex is safe to take over; its cache
        // is dropped, and the state read from the file again.
        let guard = self.mutex.lock().unwrap_or_else(|e| {
            let mut g = e.into_inner();
            *g = None;
            g
        });
        let open = || {
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&self.lock_path)
        };
        // The directory is made when it is missing (a fresh host, a cleared /run),
        // not checked on every call.
        let file = match open() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    fs::create_dir_all(dir).map_err(|e| Self::io_err(dir, e))?;
                }
                open()
            }
            r => r,
        }
        .map_err(|e| Self::io_err(&self.lock_path, e))?;
        let flock = Flock::lock(file, FlockArg::LockExclusive)
            .map_err(|(_, errno)| Self::io_err(&self.lock_path, errno.into()))?;
        Ok(Locked {
            guard,
            _flock: flock,
        })
    }

    fn corrupt(&self, detail: impl Into<String>) -> GpuError {
        GpuError::CorruptState {
            path: self.path.clone(),
            detail: detail.into(),
        }
    }

    /// The state file's identity now; None when there is none (a fresh host).
    fn file_id(&self) -> Result<Option<FileId>, GpuError> {
        match fs::metadata(&self.path) {
            Ok(m) => Ok(Some(FileId::from_meta(&m))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Self::io_err(&self.path, e)),
        }
    }

    /// The state as the file holds it now: the cache while the file is the version
    /// it came from, else the file loaded again (or a fresh host written).
    fn current<'c>(&self, slot: &'c mut Option<Cached>) -> Result<&'c mut Cached, GpuError> {
        let now = self.file_id()?;
        let valid = matches!((slot.as_ref(), now), (Some(c), Some(id)) if c.id == id);
        if !valid {
            *slot = None;
            let cached = match now {
                None => {
                    let state = SimState::fresh(&self.config, &self.uuids);
                    let (id, snapshot_len) = self.write_snapshot(&state)?;
                    Cached {
                        id,
                        state,
                        snapshot_len,
                        append: None,
                    }
                }
                Some(_) => self.load()?,
            };
            return Ok(slot.insert(cached));
        }
        slot.as_mut()
            .ok_or_else(|| self.corrupt("the cached state vanished"))
    }

    /// Load the state: the snapshot line, then every complete change line. A last
    /// line without its newline is a change whose writer died mid-write (the call
    /// never returned): it is cut off, as if it had never been made.
    fn load(&self) -> Result<Cached, GpuError> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .map_err(|e| Self::io_err(&self.path, e))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|e| Self::io_err(&self.path, e))?;
        let first_end = newline(&bytes).unwrap_or(bytes.len());
        let mut state: SimState =
            serde_json::from_slice(&bytes[..first_end]).map_err(|e| self.corrupt(e.to_string()))?;
        if !(OLDEST_STATE_VERSION..=STATE_VERSION).contains(&state.version) {
            return Err(self.corrupt(format!(
                "state version {} (this daemon reads versions {OLDEST_STATE_VERSION} to \
                 {STATE_VERSION})",
                state.version
            )));
        }
        self.check_matches_config(&state)?;
        let mut pos = first_end + 1;
        while let Some(len) = bytes.get(pos..).and_then(newline) {
            let change: Change = serde_json::from_slice(&bytes[pos..pos + len])
                .map_err(|e| self.corrupt(format!("change at byte {pos}: {e}")))?;
            state
                .apply(change)
                .map_err(|e| self.corrupt(format!("change at byte {pos}: {e}")))?;
            pos += len + 1;
        }
        if first_end == bytes.len() || state.version != STATE_VERSION {
            // A snapshot without its newline (written by hand) or of an older
            // layout: rewrite it, so that change lines can follow.
            state.version = STATE_VERSION;
            let (id, snapshot_len) = self.write_snapshot(&state)?;
            return Ok(Cached {
                id,
                state,
                snapshot_len,
                append: None,
            });
        }
        if pos < bytes.len() {
            file.set_len(pos as u64)
                .map_err(|e| Self::io_err(&self.path, e))?;
        }
        let meta = file.metadata().map_err(|e| Self::io_err(&self.path, e))?;
        Ok(Cached {
            id: FileId::from_meta(&meta),
            state,
            snapshot_len: first_end as u64 + 1,
            append: None,
        })
    }

    fn check_matches_config(&self, state: &SimState) -> Result<(), GpuError> {
        let have: Vec<(GpuModel, &str)> = state
            .gpus
            .iter()
            .map(|g| (g.model, g.uuid.as_str()))
            .collect();
        let want: Vec<(GpuModel, &str)> = self
            .config
            .gpus
            .iter()
            .zip(&self.uuids)
            .map(|(g, u)| (g.model, u.as_str()))
            .collect();
        let indices_ok = state
            .gpus
            .iter()
            .enumerate()
            .all(|(i, g)| g.index == i as u32);
        if have != want || !indices_ok {
            let fmt = |v: &[(GpuModel, &str)]| {
                v.iter()
                    .map(|(m, u)| format!("{m} {u}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(self.corrupt(format!(
                "the simulated GPUs in this state file [{}] differ from the config [{}]; \
                 refusing to discard the instances it records: fix the config, or delete \
                 the file to simulate a fresh host",
                fmt(&have),
                fmt(&want)
            )));
        }
        Ok(())
    }

    /// Replace the file with a snapshot of `state`: a temp file in the same
    /// directory, then a rename over the old file, so a reader sees the old or the
    /// new file, never a torn one. Returns the new file's identity and length.
    ///
    /// No fsync, here or for change lines: what a crash of the daemon must not lose
    /// is in the page cache the moment write(2) returns (real MIG instances survive
    /// a daemon crash, and so does this file). Real MIG instances and MPS daemons do
    /// not survive a reboot or power loss either, so losing the last writes then
    /// models the hardware.
    fn write_snapshot(&self, state: &SimState) -> Result<(FileId, u64), GpuError> {
        let mut json = serde_json::to_vec(state).map_err(|e| self.corrupt(e.to_string()))?;
        json.push(b'\n');
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(self.path.file_name().unwrap_or_default());
        tmp_name.push(format!(".tmp.{}", std::process::id()));
        let tmp = self.path.with_file_name(tmp_name);
        let result = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(&json)?;
            let meta = f.metadata()?;
            drop(f);
            fs::rename(&tmp, &self.path)?;
            Ok(meta)
        })();
        match result {
            Ok(meta) => Ok((FileId::from_meta(&meta), json.len() as u64)),
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                Err(Self::io_err(&self.path, e))
            }
        }
    }

    /// Record one change: a line appended (a single write), or, once the change
    /// lines would outweigh the snapshot (plus the slack), a new snapshot.
    fn record(&self, cached: &mut Cached, change: &Change) -> Result<(), GpuError> {
        let mut line = serde_json::to_vec(change).map_err(|e| self.corrupt(e.to_string()))?;
        line.push(b'\n');
        let grown = cached.id.len + line.len() as u64;
        if grown > 2 * cached.snapshot_len + COMPACT_SLACK_BYTES {
            // A new file (renamed into place): the handle to the old one is dropped.
            cached.append = None;
            let (id, snapshot_len) = self.write_snapshot(&cached.state)?;
            cached.id = id;
            cached.snapshot_len = snapshot_len;
            return Ok(());
        }
        let f = match &mut cached.append {
            Some(f) => f,
            slot @ None => slot.insert(
                OpenOptions::new()
                    .append(true)
                    .open(&self.path)
                    .map_err(|e| Self::io_err(&self.path, e))?,
            ),
        };
        let before = f.metadata().map_err(|e| Self::io_err(&self.path, e))?;
        if FileId::from_meta(&before) != cached.id {
            // Changed since this call read it: a handle opened just now to a file
            // replaced in between (a simulated reboot), or a write not made under
            // the lock. (A path replaced while a kept handle is open is caught by
            // `current`, which compares the path's identity first.)
            return Err(Self::io_err(
                &self.path,
                std::io::Error::other("the state file changed during the call"),
            ));
        }
        f.write_all(&line)
            .map_err(|e| Self::io_err(&self.path, e))?;
        let after = f.metadata().map_err(|e| Self::io_err(&self.path, e))?;
        cached.id = FileId::from_meta(&after);
        Ok(())
    }

    /// Run a mutation. Its change is recorded even when `f` fails, because NVML can
    /// fail after changing hardware (the crash-midway fault), and a consumed fault
    /// must stay consumed. When the change cannot be recorded, the state in memory
    /// is dropped (the next call reads the file) and the call fails.
    fn mutate<T>(
        &self,
        f: impl FnOnce(&mut SimState) -> Result<T, GpuError>,
    ) -> Result<T, GpuError> {
        let mut locked = self.lock()?;
        let cached = self.current(&mut locked.guard)?;
        let pid_before = cached.state.next_pid;
        cached.state.touched = Touched::default();
        let out = f(&mut cached.state);
        let change = cached.state.take_change(pid_before);
        if !change.is_empty()
            && let Err(e) = self.record(cached, &change)
        {
            *locked.guard = None;
            return Err(e);
        }
        out
    }

    fn read<T>(&self, f: impl FnOnce(&SimState) -> Result<T, GpuError>) -> Result<T, GpuError> {
        let mut locked = self.lock()?;
        let cached = self.current(&mut locked.guard)?;
        f(&cached.state)
    }

    // ---- fault injection and fake load (tests, demos) ----

    /// The next `create_instance` on `gpu` fails at `stage` (NVML_ERROR_UNKNOWN).
    /// A CI-stage failure rolls the GI back, as the trait requires.
    pub fn fail_next_create(&self, gpu: u32, stage: CreateStage) -> Result<(), GpuError> {
        self.mutate(|s| {
            s.gpu_mut(gpu)?.faults.next_create = Some(CreateFault::Fail(stage));
            Ok(())
        })
    }

    /// The next `create_instance` on `gpu` creates the GI and then errors without
    /// creating the CI or rolling back: a daemon crash between the two steps.
    pub fn crash_next_create_after_gi(&self, gpu: u32) -> Result<(), GpuError> {
        self.mutate(|s| {
            s.gpu_mut(gpu)?.faults.next_create = Some(CreateFault::CrashAfterGi);
            Ok(())
        })
    }

    /// The next `destroy_instance` on `gpu` fails (NVML_ERROR_UNKNOWN), destroying
    /// nothing.
    pub fn fail_next_destroy(&self, gpu: u32) -> Result<(), GpuError> {
        self.mutate(|s| {
            s.gpu_mut(gpu)?.faults.fail_next_destroy = true;
            Ok(())
        })
    }

    /// Disarm every fault on `gpu`.
    pub fn clear_faults(&self, gpu: u32) -> Result<(), GpuError> {
        self.mutate(|s| {
            s.gpu_mut(gpu)?.faults = Faults::default();
            Ok(())
        })
    }

    /// A fake process using `used_memory_bytes` on `gpu`: inside MIG instance
    /// (gi_id, ci_id) when MIG is enabled (both required then), on the whole GPU
    /// (both None) when it is disabled.
    pub fn add_process(
        &self,
        gpu: u32,
        gi_id: Option<u32>,
        ci_id: Option<u32>,
        pid: u32,
        used_memory_bytes: u64,
    ) -> Result<(), GpuError> {
        const CALL: &str = "sim add_process";
        self.mutate(|s| {
            let g = s.gpu_mut(gpu)?;
            if g.processes.iter().any(|p| p.pid == pid) {
                return Err(nvml_err(
                    CALL,
                    NvmlCode::InvalidArgument,
                    format!("pid {pid} already runs on GPU {gpu}"),
                ));
            }
            match (g.mig, gi_id, ci_id) {
                (true, Some(gi), Some(ci)) => {
                    let ok = g
                        .instances
                        .iter()
                        .any(|i| i.gi_id == gi && i.ci.as_ref().is_some_and(|c| c.ci_id == ci));
                    if !ok {
                        return Err(nvml_err(
                            CALL,
                            NvmlCode::NotFound,
                            format!("no CI {ci} in GI {gi} on GPU {gpu}"),
                        ));
                    }
                }
                (false, None, None) => {}
                _ => {
                    return Err(nvml_err(
                        CALL,
                        NvmlCode::InvalidArgument,
                        format!(
                            "GPU {gpu} has MIG {}: gi/ci must be {}",
                            if g.mig { "enabled" } else { "disabled" },
                            if g.mig { "given" } else { "None" }
                        ),
                    ));
                }
            }
            g.processes.push(GpuProcess {
                pid,
                used_memory_bytes,
                gi_id,
                ci_id,
            });
            Ok(())
        })
    }

    /// Remove a fake process. Err(NotFound) when it is not there.
    pub fn remove_process(&self, gpu: u32, pid: u32) -> Result<(), GpuError> {
        self.mutate(|s| {
            let g = s.gpu_mut(gpu)?;
            let before = g.processes.len();
            g.processes.retain(|p| p.pid != pid);
            if g.processes.len() == before {
                return Err(nvml_err(
                    "sim remove_process",
                    NvmlCode::NotFound,
                    format!("pid {pid} is not running on GPU {gpu}"),
                ));
            }
            Ok(())
        })
    }

    /// Mark an MPS daemon as dead (it crashed), for supervision tests. Err(Mps) when
    /// the lease has no daemon.
    pub fn kill_mps(&self, lease_id: &str) -> Result<(), GpuError> {
        self.mutate(|s| {
            let mut d = s.mps.get(lease_id).cloned().ok_or_else(|| GpuError::Mps {
                lease: lease_id.to_owned(),
                detail: "no MPS control daemon for this lease".to_owned(),
            })?;
            d.running = false;
            d.pid = None;
            s.mps_put(d);
            Ok(())
        })
    }

    /// `/proc/driver/nvidia-caps/mig-minors` as the driver would print it.
    pub fn mig_minors_text(&self) -> Result<String, GpuError> {
        Ok(caps::render(&self.mig_minors()?))
    }
}

impl GpuBackend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn instance_calls_are_quick(&self) -> bool {
        true
    }

    fn driver_version(&self) -> Result<String, GpuError> {
        Ok(SIM_DRIVER_VERSION.to_owned())
    }

    fn devices(&self) -> Result<Vec<GpuInfo>, GpuError> {
        self.control.before("devices", None)?;
        self.read(|s| {
            Ok(s.gpus
                .iter()
                .map(|g| GpuInfo {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.model.marketing_name().to_owned(),
                    memory_bytes: g.model.memory_bytes(),
                    minor: g.index,
                    // Distinct buses, in the style of an SXM board: 1B, 2B, 3B, ...
                    pci_bus_id: format!("00000000:{:02X}:00.0", 0x1B + 0x10 * g.index),
                    mig_current: g.mig,
                    mig_pending: g.mig,
                    sm_count: g.model.sm_count(),
                    fault: None,
                })
                .collect())
        })
    }

    fn gi_profiles(&self, gpu: u32) -> Result<Vec<GiProfile>, GpuError> {
        self.control.before("gi_profiles", Some(gpu))?;
        self.read(|s| {
            let g = s.gpu(gpu)?;
            Ok(if g.mig {
                g.model.gi_profiles()
            } else {
                Vec::new()
            })
        })
    }

    fn create_instance(
        &self,
        gpu: u32,
        gi_profile_id: u32,
        placement: Placement,
        ci_profile_id: Option<u32>,
    ) -> Result<MigInstance, GpuError> {
        self.control.before("create_instance", Some(gpu))?;
        self.mutate(|s| {
            let g = s.gpu_mut(gpu)?;
            g.require_mig(CALL_CREATE_GI)?;
            let profile = g.profile(gi_profile_id)?;
            let fault = g.faults.next_create.take();
            if fault == Some(CreateFault::Fail(CreateStage::Gi)) {
                return Err(nvml_err(
                    CALL_CREATE_GI,
                    NvmlCode::Unknown,
                    "injected fault",
                ));
            }
            let gi_id = g.create_gi(&profile, placement)?;
            let ci_result = match fault {
                Some(CreateFault::CrashAfterGi) => {
                    return Err(nvml_err(
                        CALL_CREATE_CI,
                        NvmlCode::Unknown,
                        format!("injected crash after creating GI {gi_id}: no CI, no rollback"),
                    ));
                }
                Some(CreateFault::Fail(CreateStage::Ci)) => Err(nvml_err(
                    CALL_CREATE_CI,
                    NvmlCode::Unknown,
                    "injected fault",
                )),
                _ => g.create_ci(&profile, gi_id, ci_profile_id),
            };
            if let Err(e) = ci_result {
                // The unit rollback: destroy the GI again before reporting.
                g.instances.retain(|i| i.gi_id != gi_id);
                return Err(e);
            }
            let gi = g
                .instances
                .iter()
                .find(|i| i.gi_id == gi_id)
                .ok_or_else(|| nvml_err(CALL_GET_GI, NvmlCode::NotFound, "GI vanished"))?;
            g.instance(gi)
        })
    }

    fn destroy_instance(&self, gpu: u32, gi_id: u32) -> Result<(), GpuError> {
        self.control.before("destroy_instance", Some(gpu))?;
        self.mutate(|s| {
            let g = s.gpu_mut(gpu)?;
            g.require_mig(CALL_GET_GI)?;
            let Some(pos) = g.instances.iter().position(|i| i.gi_id == gi_id) else {
                return Err(nvml_err(
                    CALL_GET_GI,
                    NvmlCode::NotFound,
                    format!("no GI {gi_id} on GPU {gpu}"),
                ));
            };
            if std::mem::take(&mut g.faults.fail_next_destroy) {
                return Err(nvml_err(
                    CALL_DESTROY_GI,
                    NvmlCode::Unknown,
                    "injected fault",
                ));
            }
            let busy: Vec<u32> = g
                .processes
                .iter()
                .filter(|p| p.gi_id == Some(gi_id))
                .map(|p| p.pid)
                .collect();
            if !busy.is_empty() {
                let call = if g.instances[pos].ci.is_some() {
                    CALL_DESTROY_CI
                } else {
                    CALL_DESTROY_GI
                };
                return Err(nvml_err(
                    call,
                    NvmlCode::InUse,
                    format!("GI {gi_id} on GPU {gpu} has running processes {busy:?}"),
                ));
            }
            g.instances.remove(pos);
            Ok(())
        })
    }

    fn instances(&self, gpu: u32) -> Result<Vec<MigInstance>, GpuError> {
        self.control.before("instances", Some(gpu))?;
        self.read(|s| {
            let g = s.gpu(gpu)?;
            g.instances.iter().map(|i| g.instance(i)).collect()
        })
    }

    fn processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, GpuError> {
        self.control.before("processes", Some(gpu))?;
        self.read(|s| Ok(s.gpu(gpu)?.processes.clone()))
    }

    fn mig_minors(&self) -> Result<MigMinors, GpuError> {
        Ok(caps::full_table(self.config.gpus.len() as u32))
    }

    /// The load model: memory used is the sum of the fake processes' memory. A
    /// process on a whole GPU keeps it 100% busy; processes in MIG instances keep
    /// their instances fully busy, so the GPU is busy in proportion to the compute
    /// slices of the instances that have at least one process (rounded down).
    fn utilization(&self, gpu: u32) -> Result<Utilization, GpuError> {
        self.control.before("utilization", Some(gpu))?;
        self.read(|s| {
            let g = s.gpu(gpu)?;
            let memory_used_bytes = g.processes.iter().map(|p| p.used_memory_bytes).sum();
            let gpu_percent = if g.processes.iter().any(|p| p.gi_id.is_none()) {
                100
            } else {
                let busy: BTreeSet<u32> = g.processes.iter().filter_map(|p| p.gi_id).collect();
                let slices: u32 = g
                    .instances
                    .iter()
                    .filter(|i| busy.contains(&i.gi_id))
                    .filter_map(|i| g.model.gi_profile(i.profile_id))
                    .map(|p| p.slices)
                    .sum();
                (slices * 100 / super::profiles::COMPUTE_SLICES).min(100)
            };
            Ok(Utilization {
                gpu_percent,
                memory_used_bytes,
            })
        })
    }

    fn mps_start(&self, spec: &MpsSpec) -> Result<MpsDaemon, GpuError> {
        // An injected failure is what the real control daemon's is: a failed
        // `nvidia-cuda-mps-control -d`, no NVML code (a lost GPU stays lost).
        self.control
            .before("mps_start", Some(spec.gpu))
            .map_err(|e| mps_fault(e, &spec.lease_id, "nvidia-cuda-mps-control -d"))?;
        let mps_err = |detail: String| GpuError::Mps {
            lease: spec.lease_id.clone(),
            detail,
        };
        self.mutate(|s| {
            let g = s.gpu(spec.gpu)?;
            let uuid_ok = g.uuid == spec.gpu_uuid
                || g.instances
                    .iter()
                    .any(|i| i.ci.as_ref().is_some_and(|c| c.uuid == spec.gpu_uuid));
            if !uuid_ok {
                return Err(mps_err(format!(
                    "uuid {} is neither GPU {} nor one of its MIG devices",
                    spec.gpu_uuid, spec.gpu
                )));
            }
            if !(1..=100).contains(&spec.sm_percent) {
                return Err(mps_err(format!(
                    "active thread percentage {} is outside 1..=100",
                    spec.sm_percent
                )));
            }
            // A shared server sets no limit of its own (its clients do).
            let isolated = spec.mode == crate::mps::MpsMode::Isolated;
            if isolated && (spec.memory_bytes == 0 || spec.memory_bytes > g.model.memory_bytes()) {
                return Err(mps_err(format!(
                    "pinned memory limit {} bytes does not fit GPU {}",
                    spec.memory_bytes, spec.gpu
                )));
            }
            if let Some(other) = s
                .mps
                .pipe_holder(&spec.pipe_dir)
                .filter(|l| *l != spec.lease_id)
            {
                return Err(mps_err(format!(
                    "pipe directory {} is in use by lease {other}",
                    spec.pipe_dir.display(),
                )));
            }
            match s.mps.get(&spec.lease_id) {
                Some(d) if d.spec != *spec => {
                    return Err(mps_err(
                        "an MPS control daemon with different limits runs for this lease"
                            .to_owned(),
                    ));
                }
                Some(d) if d.running => return Ok(d.clone()),
                // Start it, or restart a daemon that died.
                _ => {}
            }
            let d = MpsDaemon {
                spec: spec.clone(),
                pid: Some(s.next_pid),
                running: true,
                time_slice_percent: 0,
            };
            s.mps_put(d.clone());
            s.next_pid += 1;
            Ok(d)
        })
    }

    fn mps_stop(&self, lease_id: &str) -> Result<(), GpuError> {
        self.control
            .before("mps_stop", None)
            .map_err(|e| mps_fault(e, lease_id, "quit"))?;
        self.mutate(|s| {
            s.mps_remove(lease_id);
            Ok(())
        })
    }

    fn mps_running(&self) -> Result<std::collections::HashSet<String>, GpuError> {
        self.control.before("mps_daemons", None)?;
        self.read(|s| {
            Ok(s.mps
                .by_lease
                .iter()
                .filter(|(_, d)| d.running)
                .map(|(key, _)| key.clone())
                .collect())
        })
    }

    fn topology(&self, a: u32, b: u32) -> Result<GpuLink, GpuError> {
        self.control.before("topology", Some(a))?;
        // The board's wiring is the config's (the state file holds the same GPUs,
        // checked when it is loaded): no state lock or read per pair, which a start
        // asks about for every pair of GPUs (4,032 calls on 64).
        let gpus = &self.config.gpus;
        let ga = gpus.get(a as usize).ok_or(GpuError::NoSuchGpu(a))?;
        gpus.get(b as usize).ok_or(GpuError::NoSuchGpu(b))?;
        let count = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
        // NVLinks per pair through the NVSwitches: 12 on A100, 18 on Hopper.
        let per_pair = match ga.model {
            GpuModel::A100Sxm40Gb | GpuModel::A100Sxm80Gb => 12,
            _ => 18,
        };
        Ok(self.config.topology.link(a, b, count, per_pair))
    }

    fn mps_daemons(&self) -> Result<Vec<MpsDaemon>, GpuError> {
        self.control.before("mps_daemons", None)?;
        // The accounting NVML would show: separate servers on one device time-slice,
        // the clients of one server run concurrently within its slice.
        let mut all: Vec<MpsDaemon> =
            self.read(|s| Ok(s.mps.by_lease.values().cloned().collect()))?;
        crate::mps::assign_time_slices(&mut all);
        Ok(all)
    }

    fn health_events(&self, timeout: Duration) -> Result<Vec<HealthEvent>, GpuError> {
        self.control.take_events(timeout)
    }

    fn health_poll(&self, gpu: u32) -> Result<Option<HealthCause>, GpuError> {
        self.control.before("health_poll", None)?;
        if gpu as usize >= self.config.gpus.len() {
            return Err(GpuError::NoSuchGpu(gpu));
        }
        self.control.poll(gpu)
    }
}

/// An injected fault on an MPS call as the real MPS control reports one.
fn mps_fault(e: GpuError, lease: &str, command: &str) -> GpuError {
    match e {
        GpuError::Nvml {
            code: NvmlCode::GpuIsLost,
            ..
        } => e,
        GpuError::Nvml { detail, .. } => GpuError::Mps {
            lease: lease.to_owned(),
            detail: format!("`{command}` failed: {detail}"),
        },
        other => other,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::gpu::profiles::{
        GI_PROFILE_1_SLICE, GI_PROFILE_1_SLICE_REV1, GI_PROFILE_2_SLICE, GI_PROFILE_3_SLICE,
        GI_PROFILE_4_SLICE, GI_PROFILE_7_SLICE,
    };

    const GIB: u64 = 1024 * 1024 * 1024;

    fn config(models: &[(GpuModel, bool)]) -> SimConfig {
        SimConfig {
            gpus: models
                .iter()
                .map(|&(model, mig)| SimGpuConfig {
                    model,
                    mig,
                    uuid: None,
                })
                .collect(),
            seed: Some("test".to_owned()),
            state_file: None,
            topology: Default::default(),
            faults: Vec::new(),
        }
    }

    fn sim(models: &[(GpuModel, bool)]) -> (tempfile::TempDir, SimBackend) {
        let dir = tempfile::tempdir().unwrap();
        let b = SimBackend::open(&config(models), dir.path().join("sim-state.json")).unwrap();
        (dir, b)
    }

    fn h100() -> (tempfile::TempDir, SimBackend) {
        sim(&[(GpuModel::H100Hbm3_80Gb, true)])
    }

    fn at(start: u32, size: u32) -> Placement {
        Placement { start, size }
    }

    fn code(r: Result<impl std::fmt::Debug, GpuError>) -> NvmlCode {
        r.unwrap_err().nvml_code().expect("an NVML error")
    }

    #[test]
    fn config_parses_from_toml() {
        let c: SimConfig = toml::from_str(
            "seed = \"host-a\"\nstate_file = \"/var/lib/t/sim.json\"\n[[gpus]]\nmodel = \"h100-80gb\"\nmig = true\n\
             [[gpus]]\nmodel = \"a100-40gb\"\nmig = false\n\
             [[gpus]]\nmodel = \"h200-141gb\"\n\
             uuid = \"GPU-6f1e2b6a-5d0c-4a44-9a51-2f1f0c3b2e11\"\n",
        )
        .unwrap();
        assert_eq!(c.gpus.len(), 3);
        assert!(!c.gpus[1].mig);
        assert!(c.gpus[2].mig, "mig defaults to enabled");
        c.validate().unwrap();
        assert_eq!(c.state_file_or("/x"), PathBuf::from("/var/lib/t/sim.json"));
        assert!(toml::from_str::<SimConfig>("[[gpus]]\nmodel = \"v100\"\n").is_err());
        assert!(
            toml::from_str::<SimConfig>("[[gpus]]\nmodel = \"h100-80gb\"\nmigg = true\n").is_err()
        );
        let mut dup = c.clone();
        dup.gpus[0].uuid = dup.gpus[2].uuid.clone();
        assert!(matches!(
            dup.validate(),
            Err(SimConfigError::DuplicateUuid {
                first: 0,
                second: 2,
                ..
            })
        ));
        let bad = SimConfig {
            gpus: vec![SimGpuConfig {
                model: GpuModel::H200_141Gb,
                mig: true,
                uuid: Some("6f1e2b6a".to_owned()),
            }],
            seed: None,
            state_file: None,
            faults: Vec::new(),
            topology: Default::default(),
        };
        assert!(matches!(
            bad.validate(),
            Err(SimConfigError::BadUuid { .. })
        ));
        assert_eq!(
            SimConfig {
                gpus: vec![],
                seed: None,
                state_file: None,
                faults: Vec::new(),
                topology: Default::default(),
            }
            .validate(),
            Err(SimConfigError::NoGpus)
        );
    }

    #[test]
    fn devices_report_model_facts_and_stable_uuids() {
        let (dir, b) = sim(&[(GpuModel::A100Sxm40Gb, true), (GpuModel::H200_141Gb, false)]);
        let devs = b.devices().unwrap();
        assert_eq!(devs.len(), 2);
        assert_eq!(devs[0].name, "NVIDIA A100-SXM4-40GB");
        assert_eq!(devs[0].memory_bytes, 40 * GIB);
        assert_eq!(devs[0].sm_count, 108);
        assert_eq!(devs[1].name, "NVIDIA H200");
        assert_eq!(devs[1].memory_bytes, 141 * GIB);
        assert_eq!((devs[1].minor, devs[1].mig_current), (1, false));
        assert_ne!(devs[0].pci_bus_id, devs[1].pci_bus_id);
        assert_ne!(devs[0].uuid, devs[1].uuid);
        assert!(devs[0].uuid.starts_with("GPU-"));
        assert!(b.driver_version().unwrap().starts_with("sim-"));
        // Same config, new state file: same UUIDs (derived, not random).
        let again = SimBackend::open(
            &config(&[(GpuModel::A100Sxm40Gb, true), (GpuModel::H200_141Gb, false)]),
            dir.path().join("other.json"),
        )
        .unwrap();
        assert_eq!(again.devices().unwrap(), devs);
        // MIG disabled: no profiles, GI calls are NOT_SUPPORTED.
        assert!(b.gi_profiles(1).unwrap().is_empty());
        assert_eq!(
            code(b.create_instance(1, GI_PROFILE_7_SLICE, at(0, 8), None)),
            NvmlCode::NotSupported
        );
        assert!(matches!(b.gi_profiles(7), Err(GpuError::NoSuchGpu(7))));
    }

    #[test]
    fn profiles_served_match_reference_for_every_model() {
        for m in GpuModel::ALL {
            let (_d, b) = sim(&[(m, true)]);
            assert_eq!(b.gi_profiles(0).unwrap(), m.gi_profiles());
        }
    }

    #[test]
    fn h100_holds_seven_1g_and_refuses_the_eighth() {
        let (_d, b) = h100();
        for start in 0..7 {
            let i = b
                .create_instance(0, GI_PROFILE_1_SLICE, at(start, 1), None)
                .unwrap();
            assert_eq!(i.gi_id, start, "lowest free GI id");
            assert_eq!(i.ci_id, Some(0));
            assert_eq!(i.sm_count, 16);
            assert_eq!(i.memory_bytes, 9984 * 1024 * 1024);
        }
        assert_eq!(b.instances(0).unwrap().len(), 7);
        // Max count reached (and every 1-slice placement is taken).
        assert_eq!(
            code(b.create_instance(0, GI_PROFILE_1_SLICE, at(6, 1), None)),
            NvmlCode::InsufficientResources
        );
        // Memory slice 7 is not a possible placement for 1g.
        assert_eq!(
            code(b.create_instance(0, GI_PROFILE_1_SLICE, at(7, 1), None)),
            NvmlCode::InvalidArgument
        );
        assert_eq!(b.instances(0).unwrap().len(), 7);
    }

    #[test]
    fn overlapping_and_impossible_placements_are_refused() {
        let (_d, b) = h100();
        b.create_instance(0, GI_PROFILE_2_SLICE, at(2, 2), None)
            .unwrap();
        assert_eq!(
            code(b.create_instance(0, GI_PROFILE_1_SLICE, at(3, 1), None)),
            NvmlCode::InsufficientResources
        );
        assert_eq!(
            code(b.create_instance(0, GI_PROFILE_3_SLICE, at(0, 4), None)),
            NvmlCode::InsufficientResources
        );
        // 3g may start at 0 or 4 only, and its size must be 4.
        assert_eq!(
            code(b.create_instance(0, GI_PROFILE_3_SLICE, at(2, 4), None)),
            NvmlCode::InvalidArgument
        );
        assert_eq!(
            code(b.create_instance(0, GI_PROFILE_3_SLICE, at(4, 3), None)),
            NvmlCode::InvalidArgument
        );
        assert!(matches!(
            b.create_instance(0, 42, at(0, 1), None),
            Err(GpuError::UnknownProfile { profile_id: 42, .. })
        ));
        // Only one +me instance.
        b.create_instance(0, GI_PROFILE_1_SLICE_REV1, at(0, 1), None)
            .unwrap();
        assert_eq!(
            code(b.create_instance(0, GI_PROFILE_1_SLICE_REV1, at(1, 1), None)),
            NvmlCode::InsufficientResources
        );
        assert_eq!(b.instances(0).unwrap().len(), 2);
    }

    #[test]
    fn two_3g_then_nothing_and_4g_plus_3g_fits() {
        let (_d, b) = h100();
        b.create_instance(0, GI_PROFILE_3_SLICE, at(0, 4), None)
            .unwrap();
        let second = b
            .create_instance(0, GI_PROFILE_3_SLICE, at(4, 4), None)
            .unwrap();
        assert_eq!(second.sm_count, 60);
        for (p, pl) in [
            (GI_PROFILE_1_SLICE, at(0, 1)),
            (GI_PROFILE_1_SLICE, at(6, 1)),
            (GI_PROFILE_4_SLICE, at(0, 4)),
            (GI_PROFILE_7_SLICE, at(0, 8)),
        ] {
            assert_eq!(
                code(b.create_instance(0, p, pl, None)),
                NvmlCode::InsufficientResources
            );
        }

        let (_d2, b) = h100();
        b.create_instance(0, GI_PROFILE_4_SLICE, at(0, 4), None)
            .unwrap();
        b.create_instance(0, GI_PROFILE_3_SLICE, at(4, 4), None)
            .unwrap();
        let insts = b.instances(0).unwrap();
        assert_eq!(
            insts.iter().map(|i| i.placement).collect::<Vec<_>>(),
            vec![at(0, 4), at(4, 4)]
        );
        assert_eq!(b.utilization(0).unwrap(), Utilization::default());
    }

    #[test]
    fn ci_profile_choice_and_invalid_ci_rolls_back() {
        let (_d, b) = h100();
        let i = b
            .create_instance(0, GI_PROFILE_7_SLICE, at(0, 8), Some(2))
            .unwrap();
        assert_eq!((i.ci_profile_id, i.sm_count), (Some(2), 60), "3c in a 7g");
        b.destroy_instance(0, i.gi_id).unwrap();
        let e = b.create_instance(0, GI_PROFILE_1_SLICE, at(0, 1), Some(4));
        assert_eq!(code(e), NvmlCode::InvalidArgument);
        assert!(b.instances(0).unwrap().is_empty());
    }

    #[test]
    fn recreate_reuses_gi_id_with_a_new_uuid() {
        let (_d, b) = h100();
        let a = b
            .create_instance(0, GI_PROFILE_1_SLICE, at(0, 1), None)
            .unwrap();
        let c = b
            .create_instance(0, GI_PROFILE_1_SLICE, at(1, 1), None)
            .unwrap();
        assert_eq!((a.gi_id, c.gi_id), (0, 1));
        assert!(a.uuid.starts_with("MIG-") && a.uuid != c.uuid);
        b.destroy_instance(0, a.gi_id).unwrap();
        let again = b
            .create_instance(0, GI_PROFILE_1_SLICE, at(0, 1), None)
            .unwrap();
        assert_eq!(again.gi_id, a.gi_id, "lowest free id reused");
        assert_ne!(again.uuid, a.uuid, "MIG UUID churns");
        assert_eq!(
            code(b.destroy_instance(0, 9)),
            NvmlCode::NotFound,
            "destroying a missing GI"
        );
    }

    #[test]
    fn destroy_with_a_process_is_in_use_and_keeps_the_instance() {
        let (_d, b) = h100();
        let i = b
            .create_instance(0, GI_PROFILE_2_SLICE, at(0, 2), None)
            .unwrap();
        b.add_process(0, Some(i.gi_id), i.ci_id, 4242, 3 * GIB)
            .unwrap();
        assert_eq!(code(b.destroy_instance(0, i.gi_id)), NvmlCode::InUse);
        assert_eq!(b.instances(0).unwrap(), vec![i.clone()]);
        let procs = b.processes(0).unwrap();
        assert_eq!(procs.len(), 1);
        assert_eq!((procs[0].pid, procs[0].gi_id), (4242, Some(i.gi_id)));
        // 2 of 7 compute slices busy.
        assert_eq!(
            b.utilization(0).unwrap(),
            Utilization {
                gpu_percent: 28,
                memory_used_bytes: 3 * GIB
            }
        );
        // Processes must name an existing CI on a MIG GPU.
        assert_eq!(
            code(b.add_process(0, Some(5), Some(0), 1, 1)),
            NvmlCode::NotFound
        );
        assert_eq!(
            code(b.add_process(0, None, None, 1, 1)),
            NvmlCode::InvalidArgument
        );
        b.remove_process(0, 4242).unwrap();
        assert_eq!(code(b.remove_process(0, 4242)), NvmlCode::NotFound);
        b.destroy_instance(0, i.gi_id).unwrap();
        assert!(b.instances(0).unwrap().is_empty());
    }

    #[test]
    fn injected_faults() {
        let (_d, b) = h100();
        // GI stage: nothing created.
        b.fail_next_create(0, CreateStage::Gi).unwrap();
        let e = b.create_instance(0, GI_PROFILE_3_SLICE, at(0, 4), None);
        assert_eq!(code(e), NvmlCode::Unknown);
        assert!(b.instances(0).unwrap().is_empty());
        // CI stage: the GI is rolled back.
        b.fail_next_create(0, CreateStage::Ci).unwrap();
        let e = b
            .create_instance(0, GI_PROFILE_3_SLICE, at(0, 4), None)
            .unwrap_err();
        assert!(matches!(
            e,
            GpuError::Nvml {
                call: CALL_CREATE_CI,
                ..
            }
        ));
        assert!(b.instances(0).unwrap().is_empty(), "no GI left behind");
        // Faults are one-shot.
        let ok = b
            .create_instance(0, GI_PROFILE_3_SLICE, at(0, 4), None)
            .unwrap();
        // Destroy fault: nothing destroyed, then the next destroy works.
        b.fail_next_destroy(0).unwrap();
        assert_eq!(code(b.destroy_instance(0, ok.gi_id)), NvmlCode::Unknown);
        assert_eq!(b.instances(0).unwrap().len(), 1);
        b.destroy_instance(0, ok.gi_id).unwrap();
        // Crash midway: a GI without CI stays behind, for reconciliation.
        b.crash_next_create_after_gi(0).unwrap();
        assert!(
            b.create_instance(0, GI_PROFILE_4_SLICE, at(0, 4), None)
                .is_err()
        );
        let left = b.instances(0).unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!((left[0].ci_id, left[0].uuid.as_str()), (None, ""));
        assert_eq!(left[0].placement, at(0, 4));
        b.destroy_instance(0, left[0].gi_id).unwrap();
        // clear_faults disarms.
        b.fail_next_create(0, CreateStage::Gi).unwrap();
        b.clear_faults(0).unwrap();
        b.create_instance(0, GI_PROFILE_4_SLICE, at(0, 4), None)
            .unwrap();
    }

    #[test]
    fn restart_finds_instances_faults_and_mps() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join("sim.json");
        let cfg = config(&[
            (GpuModel::H100Hbm3_80Gb, true),
            (GpuModel::A100Sxm80Gb, true),
        ]);
        let first = SimBackend::open(&cfg, &path).unwrap();
        let made = first
            .create_instance(1, GI_PROFILE_3_SLICE, at(4, 4), None)
            .unwrap();
        first.fail_next_destroy(1).unwrap();
        let spec = mps_spec(&first, "lease-1");
        first.mps_start(&spec).unwrap();
        drop(first);

        let second = SimBackend::open(&cfg, &path).unwrap();
        assert_eq!(second.instances(1).unwrap(), vec![made.clone()]);
        assert_eq!(second.mps_daemons().unwrap().len(), 1);
        assert_eq!(
            code(second.destroy_instance(1, made.gi_id)),
            NvmlCode::Unknown
        );
        // Two backends on one file see each other's changes (cross-process harness).
        let harness = SimBackend::open(&cfg, &path).unwrap();
        harness
            .add_process(1, Some(made.gi_id), Some(0), 7, GIB)
            .unwrap();
        assert_eq!(
            code(second.destroy_instance(1, made.gi_id)),
            NvmlCode::InUse
        );

        // A config that disagrees with the file is refused, and the file is kept.
        let other = config(&[(GpuModel::H100Hbm3_80Gb, true)]);
        let e = SimBackend::open(&other, &path).unwrap_err();
        assert!(matches!(e, GpuError::CorruptState { .. }), "{e}");
        assert!(e.to_string().contains("differ from the config"), "{e}");
        assert_eq!(second.instances(1).unwrap().len(), 1);

        // Deleting the file is a reboot: instances are gone.
        fs::remove_file(&path).unwrap();
        assert!(second.instances(1).unwrap().is_empty());
    }

    #[test]
    fn changes_after_a_reboot_or_a_cleared_directory_go_to_the_new_file() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let path = run.join("sim-state.json");
        let cfg = config(&[(GpuModel::H100Hbm3_80Gb, true)]);
        let b = SimBackend::open(&cfg, &path).unwrap();
        let slice = at(0, 1);
        let first = b
            .create_instance(0, GI_PROFILE_1_SLICE, slice, None)
            .unwrap();
        // A reboot (the file deleted) after a change was appended: the next change
        // lands in the new file, not in the one the earlier change was written to.
        fs::remove_file(&path).unwrap();
        let after_reboot = b
            .create_instance(0, GI_PROFILE_1_SLICE, at(1, 1), None)
            .unwrap();
        let seen = SimBackend::open(&cfg, &path).unwrap().instances(0).unwrap();
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].uuid, after_reboot.uuid);
        assert_ne!(seen[0].uuid, first.uuid);
        // A cleared directory (/run emptied) is made again by the next call.
        fs::remove_dir_all(&run).unwrap();
        assert!(b.instances(0).unwrap().is_empty());
        b.create_instance(0, GI_PROFILE_1_SLICE, slice, None)
            .unwrap();
        assert_eq!(
            SimBackend::open(&cfg, &path)
                .unwrap()
                .instances(0)
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn corrupt_state_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sim.json");
        let cfg = config(&[(GpuModel::H100Hbm3_80Gb, true)]);
        fs::write(&path, "{\"version\": 1, \"gpus\": [").unwrap();
        let e = SimBackend::open(&cfg, &path).unwrap_err();
        assert!(matches!(e, GpuError::CorruptState { .. }), "{e}");
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"version\": 1, \"gpus\": ["
        );
        fs::write(
            &path,
            "{\"version\": 99, \"gpus\": [], \"mps\": [], \"next_pid\": 1}",
        )
        .unwrap();
        let e = SimBackend::open(&cfg, &path).unwrap_err();
        assert!(e.to_string().contains("version 99"), "{e}");
    }

    #[test]
    fn no_temp_files_left_behind() {
        let (d, b) = h100();
        b.create_instance(0, GI_PROFILE_1_SLICE, at(0, 1), None)
            .unwrap();
        let mut names: Vec<String> = fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, vec!["sim-state.json", "sim-state.json.lock"]);
    }

    #[test]
    fn a_change_appends_one_line_not_the_whole_state() {
        let (d, b) = sim(&[(GpuModel::A100Sxm80Gb, false)]);
        let path = d.path().join("sim-state.json");
        for i in 0..200 {
            b.mps_start(&mps_spec(&b, &format!("lease-{i:03}")))
                .unwrap();
        }
        let before = fs::metadata(&path).unwrap().len();
        b.mps_start(&mps_spec(&b, "lease-new")).unwrap();
        let grown = fs::metadata(&path).unwrap().len() - before;
        let one_daemon = serde_json::to_vec(&b.mps_daemons().unwrap()[0])
            .unwrap()
            .len() as u64;
        assert!(
            grown < 2 * one_daemon,
            "a start appended {grown} bytes; one daemon is {one_daemon}"
        );
        b.mps_stop("lease-007").unwrap();
        b.kill_mps("lease-008").unwrap();
        drop(b);

        // A restart replays the snapshot and every change.
        let again = SimBackend::open(&config(&[(GpuModel::A100Sxm80Gb, false)]), &path).unwrap();
        let daemons = again.mps_daemons().unwrap();
        assert_eq!(daemons.len(), 200);
        assert!(!daemons.iter().any(|d| d.spec.lease_id == "lease-007"));
        let dead = daemons
            .iter()
            .find(|d| d.spec.lease_id == "lease-008")
            .unwrap();
        assert_eq!((dead.running, dead.pid), (false, None));
        let fresh = again.mps_start(&mps_spec(&again, "lease-more")).unwrap();
        assert!(
            daemons.iter().all(|d| d.pid < fresh.pid),
            "pids are not reused after a restart"
        );
    }

    #[test]
    fn a_torn_last_change_is_discarded_and_the_log_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sim.json");
        let cfg = config(&[(GpuModel::H100Hbm3_80Gb, true)]);
        let b = SimBackend::open(&cfg, &path).unwrap();
        let kept = b
            .create_instance(0, GI_PROFILE_1_SLICE, at(0, 1), None)
            .unwrap();
        drop(b);
        // A writer killed mid-write leaves a line without its newline.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"gpus\":[{\"index\":0,").unwrap();
        drop(f);

        let b = SimBackend::open(&cfg, &path).unwrap();
        assert_eq!(b.instances(0).unwrap(), vec![kept.clone()]);
        let next = b
            .create_instance(0, GI_PROFILE_1_SLICE, at(1, 1), None)
            .unwrap();
        drop(b);
        let b = SimBackend::open(&cfg, &path).unwrap();
        assert_eq!(b.instances(0).unwrap(), vec![kept, next]);

        // A complete line that does not parse is corruption, not a torn write.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"gpus\":7}\n").unwrap();
        drop(f);
        let e = SimBackend::open(&cfg, &path).unwrap_err();
        assert!(matches!(e, GpuError::CorruptState { .. }), "{e}");
    }

    #[test]
    fn compaction_keeps_the_state_and_bounds_the_file() {
        let (d, b) = sim(&[(GpuModel::A100Sxm80Gb, false)]);
        let path = d.path().join("sim-state.json");
        let mut peak = 0;
        for round in 0..60 {
            for i in 0..100 {
                b.mps_start(&mps_spec(&b, &format!("lease-{round}-{i}")))
                    .unwrap();
            }
            for i in 0..100 {
                b.mps_stop(&format!("lease-{round}-{i}")).unwrap();
            }
            peak = peak.max(fs::metadata(&path).unwrap().len());
        }
        b.mps_start(&mps_spec(&b, "lease-last")).unwrap();
        // 12,000 changes (half of them ~300 bytes) make ~2 MB without compaction.
        assert!(
            peak <= COMPACT_SLACK_BYTES + 256 * 1024,
            "the file grew to {peak}"
        );
        let again = SimBackend::open(&config(&[(GpuModel::A100Sxm80Gb, false)]), &path).unwrap();
        let ids: Vec<String> = again
            .mps_daemons()
            .unwrap()
            .into_iter()
            .map(|d| d.spec.lease_id)
            .collect();
        assert_eq!(ids, vec!["lease-last".to_owned()]);
    }

    #[test]
    fn a_version_1_state_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sim.json");
        let cfg = config(&[(GpuModel::H100Hbm3_80Gb, false)]);
        let uuid = cfg.gpu_uuids().unwrap().remove(0);
        let v1 = serde_json::json!({
            "version": 1,
            "gpus": [{"index": 0, "model": GpuModel::H100Hbm3_80Gb, "uuid": uuid, "mig": false,
                      "instances": [], "processes": [],
                      "faults": {"next_create": null, "fail_next_destroy": false}}],
            "mps": [{"spec": {"lease_id": "lease-old", "gpu": 0, "gpu_uuid": uuid,
                              "sm_percent": 10, "memory_bytes": GIB,
                              "pipe_dir": "/run/p", "log_dir": "/run/l", "owner_uid": null},
                     "pid": 40000, "running": true}],
            "next_pid": 40001
        });
        fs::write(&path, format!("{v1}\n")).unwrap();
        let b = SimBackend::open(&cfg, &path).unwrap();
        assert_eq!(b.mps_daemons().unwrap()[0].spec.lease_id, "lease-old");
        b.mps_stop("lease-old").unwrap();
        drop(b);
        let b = SimBackend::open(&cfg, &path).unwrap();
        assert!(b.mps_daemons().unwrap().is_empty());
    }

    #[test]
    fn mig_minors_follow_the_formula() {
        let (_d, b) = sim(&[
            (GpuModel::H100Hbm3_80Gb, true),
            (GpuModel::H100Hbm3_80Gb, true),
        ]);
        let m = b.mig_minors().unwrap();
        assert_eq!((m.config, m.monitor), (Some(1), Some(2)));
        assert_eq!(m.gi_access[&(0, 0)], 3);
        assert_eq!(m.ci_access[&(0, 0, 0)], 4);
        assert_eq!(m.gi_access[&(1, 2)], 3 + 135 + 18);
        assert_eq!(m.ci_access[&(1, 2, 0)], 3 + 135 + 18 + 1);
        let text = b.mig_minors_text().unwrap();
        assert!(text.contains("\ngpu1/gi2/ci0/access 157\n"));
        assert_eq!(caps::parse(&text).unwrap(), m);
    }

    fn mps_spec(b: &SimBackend, lease: &str) -> MpsSpec {
        let gpu = b.devices().unwrap().remove(0);
        MpsSpec {
            lease_id: lease.to_owned(),
            gpu: 0,
            gpu_uuid: gpu.uuid,
            sm_percent: 25,
            memory_bytes: 8 * GIB,
            pipe_dir: PathBuf::from(format!("/run/tessera/mps/{lease}/pipe")),
            log_dir: PathBuf::from(format!("/run/tessera/mps/{lease}/log")),
            owner_uid: Some(1000),
            mode: crate::mps::MpsMode::Isolated,
        }
    }

    #[test]
    fn separate_mps_servers_on_one_gpu_are_time_sliced() {
        let (_d, b) = sim(&[(GpuModel::H100Hbm3_80Gb, false)]);
        let slices = |b: &SimBackend| -> Vec<(String, u32)> {
            b.mps_daemons()
                .unwrap()
                .into_iter()
                .map(|d| (d.spec.lease_id, d.time_slice_percent))
                .collect()
        };
        b.mps_start(&mps_spec(&b, "lease-a")).unwrap();
        assert_eq!(slices(&b), vec![("lease-a".to_owned(), 100)]);
        b.mps_start(&mps_spec(&b, "lease-b")).unwrap();
        b.mps_start(&mps_spec(&b, "lease-c")).unwrap();
        assert!(
            slices(&b).iter().all(|(_, pct)| *pct == 33),
            "{:?}",
            slices(&b)
        );
        // A dead daemon gets no time and leaves more for the others.
        b.kill_mps("lease-c").unwrap();
        let now = slices(&b);
        assert!(now.contains(&("lease-c".to_owned(), 0)), "{now:?}");
        assert!(now.contains(&("lease-a".to_owned(), 50)), "{now:?}");
    }

    /// The running daemons' keys, as the full listing says, without the listing.
    #[test]
    fn mps_running_names_the_running_daemons_only() {
        let (_d, b) = sim(&[(GpuModel::H100Hbm3_80Gb, false)]);
        assert!(b.mps_running().unwrap().is_empty());
        b.mps_start(&mps_spec(&b, "lease-a")).unwrap();
        b.mps_start(&mps_spec(&b, "lease-b")).unwrap();
        b.kill_mps("lease-b").unwrap();
        let running = b.mps_running().unwrap();
        assert_eq!(running, ["lease-a".to_owned()].into_iter().collect());
        let listed: std::collections::HashSet<String> = b
            .mps_daemons()
            .unwrap()
            .into_iter()
            .filter(|d| d.running)
            .map(|d| d.spec.lease_id)
            .collect();
        assert_eq!(running, listed);
    }

    #[test]
    fn mps_daemons_lifecycle() {
        let (_d, b) = sim(&[(GpuModel::H100Hbm3_80Gb, false)]);
        let spec = mps_spec(&b, "lease-a");
        let d = b.mps_start(&spec).unwrap();
        assert!(d.running);
        assert_eq!(b.mps_start(&spec).unwrap(), d, "idempotent per lease");
        let mut changed = spec.clone();
        changed.sm_percent = 50;
        assert!(matches!(b.mps_start(&changed), Err(GpuError::Mps { .. })));
        let mut bad = mps_spec(&b, "lease-b");
        bad.sm_percent = 0;
        assert!(b.mps_start(&bad).is_err());
        bad.sm_percent = 10;
        bad.gpu_uuid = "GPU-nope".to_owned();
        assert!(b.mps_start(&bad).is_err());
        let mut clash = mps_spec(&b, "lease-c");
        clash.pipe_dir = spec.pipe_dir.clone();
        assert!(b.mps_start(&clash).is_err(), "one daemon per pipe dir");

        b.kill_mps("lease-a").unwrap();
        let dead = b.mps_daemons().unwrap();
        assert_eq!((dead[0].running, dead[0].pid), (false, None));
        let restarted = b.mps_start(&spec).unwrap();
        assert!(restarted.running);
        assert_ne!(restarted.pid, d.pid);

        b.mps_stop("lease-a").unwrap();
        b.mps_stop("lease-a").unwrap();
        assert!(b.mps_daemons().unwrap().is_empty());
        assert!(b.kill_mps("lease-a").is_err());
    }

    #[test]
    fn whole_gpu_process_makes_it_busy() {
        let (_d, b) = sim(&[(GpuModel::A100Sxm40Gb, false)]);
        assert_eq!(b.utilization(0).unwrap().gpu_percent, 0);
        b.add_process(0, None, None, 10, 2 * GIB).unwrap();
        b.add_process(0, None, None, 11, GIB).unwrap();
        assert_eq!(
            code(b.add_process(0, None, None, 11, GIB)),
            NvmlCode::InvalidArgument
        );
        assert_eq!(
            b.utilization(0).unwrap(),
            Utilization {
                gpu_percent: 100,
                memory_used_bytes: 3 * GIB
            }
        );
        assert!(b.instances(0).unwrap().is_empty());
    }
}
