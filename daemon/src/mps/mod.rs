//! MPS control daemons on real GPUs: one `nvidia-cuda-mps-control -d` per lease.
//!
//! A lease that needs its own limits needs its own control daemon and pipe directory
//! (client-side env can only tighten limits), so every lease gets one, started with
//! `CUDA_VISIBLE_DEVICES=<gpu uuid>` and its own `CUDA_MPS_PIPE_DIRECTORY` /
//! `CUDA_MPS_LOG_DIRECTORY`. The limits are set on the daemon side
//! (`set_default_active_thread_percentage`, `set_default_device_pinned_mem_limit`),
//! where a tenant cannot loosen them.
//!
//! What tesserad started is recorded in `<state_dir>/<lease>.json` (written before the
//! daemon is spawned, so a crash in between leaves a record to clean up). Liveness
//! comes from the daemon's own pid file, `<pipe_dir>/nvidia-cuda-mps-control.pid`,
//! checked against `/proc/<pid>/cmdline` so a reused pid is not taken for the daemon.
//!
//! Owns: the control daemons, their records and `MpsSpec`. May use: nothing of the
//! daemon but names (the GPU layer uses this module, never the other way round).

use std::ffi::OsString;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How an MPS lease shares its GPU with the other MPS leases there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MpsMode {
    /// A control daemon of its own: its limits are set on the daemon side, where the
    /// tenant cannot loosen them; the control daemons on one GPU time-slice against
    /// each other.
    #[default]
    Isolated,
    /// One control daemon (one server) per GPU and tenant, shared by that tenant's
    /// shared leases there: their clients run concurrently; the limits of each lease
    /// are client-side (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in the container's env), which the tenant's
    /// own process can raise up to the whole device.
    Shared,
}

impl MpsMode {
    pub fn as_str(self) -> &'static str {
        match self {
            MpsMode::Isolated => "isolated",
            MpsMode::Shared => "shared",
        }
    }
}

impl std::fmt::Display for MpsMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for MpsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "isolated" => Ok(MpsMode::Isolated),
            "shared" => Ok(MpsMode::Shared),
            other => Err(format!("{other:?} is not isolated or shared")),
        }
    }
}

/// The limits of one MPS control daemon (one per isolated MPS lease, one per GPU and
/// tenant for shared ones).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MpsSpec {
    /// The daemon's key: the lease it belongs to (isolated), or the shared server's
    /// name (`shared-gpu<N>-<tenant>`).
    pub lease_id: String,
    pub gpu: u32,
    pub gpu_uuid: String,
    pub sm_percent: u32,
    pub memory_bytes: u64,
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    /// uid that owns pipe and log dirs (the uid the container runs as); None = root.
    pub owner_uid: Option<u32>,
    /// Shared: no daemon-side limits (sm_percent 100, memory_bytes the device's), the
    /// limits of each lease are client-side.
    #[serde(default)]
    pub mode: MpsMode,
}

/// A running MPS control daemon as the backend reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MpsDaemon {
    pub spec: MpsSpec,
    pub pid: Option<u32>,
    pub running: bool,
    /// The share of the device's time this daemon's server gets: the running control
    /// daemons on one device (GPU or MIG instance) time-slice against each other, so
    /// each gets 100/N percent (see [`assign_time_slices`]). Clients of one server
    /// run concurrently within its slice.
    #[serde(default)]
    pub time_slice_percent: u32,
}

/// Fill in `time_slice_percent` of every daemon: 100 / (running daemons on the same
/// device uuid); 0 for one not running. The model: separate MPS servers get separate
/// GPU contexts, which the driver time-slices (equal slices assumed).
pub fn assign_time_slices(daemons: &mut [MpsDaemon]) {
    // Counted per device once: this runs on every listing, with one daemon per lease.
    let mut running: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
    for d in daemons.iter().filter(|d| d.running) {
        let n = running.entry(d.spec.gpu_uuid.clone()).or_default();
        *n = n.saturating_add(1);
    }
    for d in daemons.iter_mut() {
        let n = running.get(&d.spec.gpu_uuid).copied().unwrap_or(0);
        d.time_slice_percent = if d.running && n > 0 { 100 / n } else { 0 };
    }
}

/// The control binary, looked up in PATH unless configured.
pub const DEFAULT_BINARY: &str = "nvidia-cuda-mps-control";
/// The pid file the control daemon writes into its pipe directory (removed on quit).
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The control socket in the pipe directory.
pub const CONTROL_SOCKET: &str = "control";
/// PATH handed to the control daemon when tesserad itself has none.
const FALLBACK_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const POLL: Duration = Duration::from_millis(20);
const MIB: u64 = 1024 * 1024;

fn default_timeout_secs() -> u64 {
    10
}

fn default_state_dir() -> PathBuf {
    PathBuf::from("/run/tesserad/mps")
}

/// The `[mps]` section of the daemon config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsConfig {
    /// Path of `nvidia-cuda-mps-control`; default: looked up in PATH.
    #[serde(default)]
    pub binary: Option<PathBuf>,
    /// Where tesserad records the daemons it started.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// How long to wait for `-d` to daemonise, a control command to answer, and a
    /// daemon to exit after `quit`.
    #[serde(default = "default_timeout_secs")]
    pub timeout_secs: u64,
}

impl Default for MpsConfig {
    fn default() -> Self {
        MpsConfig {
            binary: None,
            state_dir: default_state_dir(),
            timeout_secs: default_timeout_secs(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error("invalid MPS spec: {0}")]
    InvalidSpec(String),
    #[error("{binary}: cannot run: {source} (install the CUDA MPS tools or set mps.binary)")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {output}")]
    CommandFailed {
        command: String,
        status: String,
        output: String,
    },
    #[error("{what} did not finish within {after:?}")]
    Timeout { what: String, after: Duration },
    #[error("{0}")]
    Conflict(String),
    #[error("{path}: corrupt MPS record: {detail}")]
    CorruptRecord { path: PathBuf, detail: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> MpsError + '_ {
    move |source| MpsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A lease id usable as a file name: 1..=128 of `[A-Za-z0-9._-]`, not starting with '.'.
pub fn valid_lease_id(lease_id: &str) -> bool {
    !lease_id.is_empty()
        && lease_id.len() <= 128
        && !lease_id.starts_with('.')
        && lease_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Checks a spec before anything is touched.
pub fn validate_spec(spec: &MpsSpec) -> Result<(), MpsError> {
    let bad = |d: String| Err(MpsError::InvalidSpec(d));
    if !valid_lease_id(&spec.lease_id) {
        return bad(format!(
            "lease id {:?} is not [A-Za-z0-9._-]+",
            spec.lease_id
        ));
    }
    if !(spec.gpu_uuid.starts_with("GPU-") || spec.gpu_uuid.starts_with("MIG-"))
        || spec.gpu_uuid.contains(',')
    {
        return bad(format!("{:?} is not one GPU or MIG uuid", spec.gpu_uuid));
    }
    if !(1..=100).contains(&spec.sm_percent) {
        return bad(format!(
            "active thread percentage {} is outside 1..=100",
            spec.sm_percent
        ));
    }
    if spec.mode == MpsMode::Isolated && spec.memory_bytes < MIB {
        return bad(format!(
            "pinned memory limit {} bytes is below 1 MiB",
            spec.memory_bytes
        ));
    }
    for dir in [&spec.pipe_dir, &spec.log_dir] {
        if !dir.is_absolute() {
            return bad(format!("{} is not an absolute path", dir.display()));
        }
    }
    if spec.pipe_dir == spec.log_dir {
        return bad("pipe and log directories must differ".to_owned());
    }
    Ok(())
}

/// The daemon-side limit commands for a spec, in the order they are sent. The device
/// is 0: the daemon sees only the spec's GPU (`CUDA_VISIBLE_DEVICES=<uuid>`). Memory
/// is rounded down to whole MiB so the limit never exceeds the lease.
/// A shared daemon gets none: its clients' limits are client-side.
pub fn limit_commands(spec: &MpsSpec) -> Vec<String> {
    if spec.mode == MpsMode::Shared {
        return Vec::new();
    }
    vec![
        format!("set_default_active_thread_percentage {}", spec.sm_percent),
        format!(
            "set_default_device_pinned_mem_limit 0 {}M",
            spec.memory_bytes / MIB
        ),
    ]
}

/// The environment of the control daemon and of every control command for a spec.
/// The rest of tesserad's environment is not passed on (no stray `CUDA_*` settings),
/// except PATH and LD_LIBRARY_PATH, which the daemon needs to find its server binary
/// and the driver library.
pub fn daemon_env(spec: &MpsSpec) -> Vec<(String, OsString)> {
    let mut env = vec![
        (
            "PATH".to_owned(),
            std::env::var_os("PATH").unwrap_or_else(|| FALLBACK_PATH.into()),
        ),
        (
            "CUDA_VISIBLE_DEVICES".to_owned(),
            OsString::from(&spec.gpu_uuid),
        ),
        (
            "CUDA_MPS_PIPE_DIRECTORY".to_owned(),
            spec.pipe_dir.clone().into_os_string(),
        ),
        (
            "CUDA_MPS_LOG_DIRECTORY".to_owned(),
            spec.log_dir.clone().into_os_string(),
        ),
    ];
    if let Some(ld) = std::env::var_os("LD_LIBRARY_PATH") {
        env.push(("LD_LIBRARY_PATH".to_owned(), ld));
    }
    env
}

/// Create `dir` (and parents) with `mode`, force `mode` on an existing one, and
/// refuse a symlink or non-directory.
fn dir_with_mode(dir: &Path, mode: u32) -> Result<(), MpsError> {
    match fs::symlink_metadata(dir) {
        Ok(m) if !m.file_type().is_dir() => {
            return Err(MpsError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "exists and is not a directory (symlinks are refused)",
                ),
            });
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(mode)
                .create(dir)
                .map_err(io_err(dir))?;
        }
        Err(e) => return Err(io_err(dir)(e)),
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(mode)).map_err(io_err(dir))
}

/// Create `dir` (and parents) with mode 0700, force 0700 on an existing one, refuse a
/// symlink or non-directory, and chown it to `owner` when given.
pub fn prepare_dir(dir: &Path, owner: Option<u32>) -> Result<(), MpsError> {
    dir_with_mode(dir, 0o700)?;
    if let Some(uid) = owner {
        std::os::unix::fs::chown(dir, Some(uid), None).map_err(io_err(dir))?;
    }
    Ok(())
}

/// The directory holding every lease's MPS directories (`<run_dir>/mps`): made if
/// missing, and always mode 0711. Each lease's own directory below it is 0700 and
/// handed to the uid its containers run as; the MPS server the control daemon starts
/// for that uid must pass through this one to reach its pipe and log directories, so
/// others may traverse it (but not list it). With 0700 every server exited at once
/// and no client could connect (seen on an H200: "Server ... exited with status 0").
pub fn prepare_base(dir: &Path) -> Result<(), MpsError> {
    dir_with_mode(dir, 0o711)
}

/// The pid in `<pipe_dir>/nvidia-cuda-mps-control.pid`, if the file is there.
pub fn read_pid(pipe_dir: &Path) -> Option<u32> {
    fs::read_to_string(pipe_dir.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|&p| p > 0)
}

/// Whether `pid` is a live process whose argv[0] names `binary_name` (when /proc lets
/// us read it). A zombie has an empty cmdline and counts as dead.
pub fn pid_is_daemon(pid: u32, binary_name: &str) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None) {
        Ok(()) | Err(nix::errno::Errno::EPERM) => {}
        Err(_) => return false,
    }
    match fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(cmdline) => {
            let argv0 = cmdline.split(|&b| b == 0).next().unwrap_or_default();
            let argv0 = Path::new(std::str::from_utf8(argv0).unwrap_or_default());
            argv0
                .file_name()
                .is_some_and(|n| n.to_string_lossy() == binary_name)
        }
        // No /proc access: trust the signal check.
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => true,
        Err(_) => false,
    }
}

/// Starts, configures, checks and stops MPS control daemons.
#[derive(Debug, Clone)]
pub struct MpsControl {
    binary: PathBuf,
    state_dir: PathBuf,
    timeout: Duration,
}

impl MpsControl {
    pub fn new(config: &MpsConfig) -> MpsControl {
        MpsControl {
            binary: config
                .binary
                .clone()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_BINARY)),
            state_dir: config.state_dir.clone(),
            timeout: Duration::from_secs(config.timeout_secs.max(1)),
        }
    }

    fn binary_name(&self) -> String {
        self.binary.file_name().map_or_else(
            || DEFAULT_BINARY.to_owned(),
            |n| n.to_string_lossy().into_owned(),
        )
    }

    fn command(&self, spec: &MpsSpec) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.env_clear();
        for (k, v) in daemon_env(spec) {
            cmd.env(k, v);
        }
        cmd
    }

    /// `nvidia-cuda-mps-control -d` with the spec's environment. Its output goes
    /// nowhere: the daemon logs to the log directory, and a daemonised grandchild
    /// must not hold a pipe of ours open.
    pub fn start_command(&self, spec: &MpsSpec) -> Command {
        let mut cmd = self.command(spec);
        cmd.arg("-d")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    }

    /// `nvidia-cuda-mps-control` in client mode (commands on stdin).
    pub fn control_command(&self, spec: &MpsSpec) -> Command {
        let mut cmd = self.command(spec);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    fn record_path(&self, lease_id: &str) -> PathBuf {
        self.state_dir.join(format!("{lease_id}.json"))
    }

    fn load_record(&self, lease_id: &str) -> Result<Option<MpsSpec>, MpsError> {
        let path = self.record_path(lease_id);
        match fs::read_to_string(&path) {
            Ok(text) => {
                serde_json::from_str(&text)
                    .map(Some)
                    .map_err(|e| MpsError::CorruptRecord {
                        path,
                        detail: e.to_string(),
                    })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    /// Atomic: temp file in the same directory, then rename.
    fn save_record(&self, spec: &MpsSpec) -> Result<(), MpsError> {
        prepare_dir(&self.state_dir, None)?;
        let path = self.record_path(&spec.lease_id);
        let tmp = self.state_dir.join(format!(".{}.json.tmp", spec.lease_id));
        let json = serde_json::to_vec_pretty(spec).map_err(|e| MpsError::CorruptRecord {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        fs::write(&tmp, json).map_err(io_err(&tmp))?;
        fs::rename(&tmp, &path).map_err(io_err(&path))
    }

    fn remove_record(&self, lease_id: &str) -> Result<(), MpsError> {
        let path = self.record_path(lease_id);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(&path)(e)),
            _ => Ok(()),
        }
    }

    /// The daemon's state as seen now.
    pub fn status(&self, spec: &MpsSpec) -> MpsDaemon {
        let pid = read_pid(&spec.pipe_dir).filter(|&p| pid_is_daemon(p, &self.binary_name()));
        MpsDaemon {
            spec: spec.clone(),
            pid,
            running: pid.is_some(),
            time_slice_percent: 0,
        }
    }

    fn wait_timeout(&self, child: &mut Child, what: &str) -> Result<ExitStatus, MpsError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(status) = child.try_wait().map_err(|source| MpsError::Spawn {
                binary: self.binary.clone(),
                source,
            })? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(MpsError::Timeout {
                    what: what.to_owned(),
                    after: self.timeout,
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// Send one command to the spec's control daemon; returns its stdout.
    pub fn send(&self, spec: &MpsSpec, command: &str) -> Result<String, MpsError> {
        let mut child = self
            .control_command(spec)
            .spawn()
            .map_err(|source| MpsError::Spawn {
                binary: self.binary.clone(),
                source,
            })?;
        if let Some(mut stdin) = child.stdin.take() {
            // A client that exits early closes the pipe; its exit status tells why.
            let _ = stdin.write_all(format!("{command}\n").as_bytes());
        }
        let status = self.wait_timeout(&mut child, &format!("`{command}`"))?;
        let mut out = String::new();
        let mut err = String::new();
        if let Some(mut s) = child.stdout.take() {
            let _ = s.read_to_string(&mut out);
        }
        if let Some(mut s) = child.stderr.take() {
            let _ = s.read_to_string(&mut err);
        }
        if !status.success() {
            return Err(MpsError::CommandFailed {
                command: command.to_owned(),
                status: status.to_string(),
                output: format!("{}{}", out.trim(), err.trim()),
            });
        }
        Ok(out)
    }

    fn apply_limits(&self, spec: &MpsSpec) -> Result<(), MpsError> {
        for c in limit_commands(spec) {
            self.send(spec, &c)?;
        }
        Ok(())
    }

    /// Start (or find running) the lease's control daemon with its limits applied.
    /// Idempotent: a running daemon with the same spec gets its limits re-applied and
    /// is returned. A different spec for the same lease, or a pipe directory that
    /// another recorded lease uses, is a conflict.
    pub fn start(&self, spec: &MpsSpec) -> Result<MpsDaemon, MpsError> {
        validate_spec(spec)?;
        if self
            .load_record(&spec.lease_id)?
            .is_some_and(|old| old != *spec)
        {
            return Err(MpsError::Conflict(format!(
                "lease {} already has an MPS daemon with other limits or directories",
                spec.lease_id
            )));
        }
        for other in self.records()? {
            if other.lease_id != spec.lease_id && other.pipe_dir == spec.pipe_dir {
                return Err(MpsError::Conflict(format!(
                    "pipe directory {} belongs to lease {}",
                    spec.pipe_dir.display(),
                    other.lease_id
                )));
            }
        }
        if let Some(base) = spec.pipe_dir.parent().and_then(Path::parent) {
            prepare_base(base)?;
        }
        prepare_dir(&spec.pipe_dir, spec.owner_uid)?;
        prepare_dir(&spec.log_dir, spec.owner_uid)?;
        // Record first: a crash after the spawn must leave something to stop.
        self.save_record(spec)?;
        if !self.status(spec).running {
            let mut child = match self.start_command(spec).spawn() {
                Ok(child) => child,
                Err(source) => {
                    // Nothing started: the record would only mislead.
                    self.remove_record(&spec.lease_id)?;
                    return Err(MpsError::Spawn {
                        binary: self.binary.clone(),
                        source,
                    });
                }
            };
            // On a timeout the record stays: the daemon may be up, stop() cleans up.
            let status = self.wait_timeout(&mut child, "nvidia-cuda-mps-control -d")?;
            if !status.success() {
                self.remove_record(&spec.lease_id)?;
                return Err(MpsError::CommandFailed {
                    command: "nvidia-cuda-mps-control -d".to_owned(),
                    status: status.to_string(),
                    output: format!("see {}", spec.log_dir.join("control.log").display()),
                });
            }
        }
        if let Err(e) = self.apply_limits(spec) {
            // Fail closed: a daemon without its limits must not serve the lease.
            let _ = self.stop_spec(spec);
            return Err(e);
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let status = self.status(spec);
            if status.running {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(MpsError::Timeout {
                    what: format!("pid file {}", spec.pipe_dir.join(PID_FILE).display()),
                    after: self.timeout,
                });
            }
            std::thread::sleep(POLL);
        }
    }

    fn stop_spec(&self, spec: &MpsSpec) -> Result<(), MpsError> {
        let status = self.status(spec);
        if let Some(pid) = status.pid {
            self.send(spec, "quit")?;
            let deadline = Instant::now() + self.timeout;
            while pid_is_daemon(pid, &self.binary_name()) {
                if Instant::now() >= deadline {
                    return Err(MpsError::Timeout {
                        what: format!("MPS control daemon {pid} exiting after quit"),
                        after: self.timeout,
                    });
                }
                std::thread::sleep(POLL);
            }
        }
        self.remove_record(&spec.lease_id)
    }

    /// Stop the lease's daemon with `quit` and wait for it to exit. Idempotent.
    pub fn stop(&self, lease_id: &str) -> Result<(), MpsError> {
        if !valid_lease_id(lease_id) {
            return Err(MpsError::InvalidSpec(format!(
                "lease id {lease_id:?} is not [A-Za-z0-9._-]+"
            )));
        }
        match self.load_record(lease_id)? {
            Some(spec) => self.stop_spec(&spec),
            None => Ok(()),
        }
    }

    fn records(&self) -> Result<Vec<MpsSpec>, MpsError> {
        let entries = match fs::read_dir(&self.state_dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err(&self.state_dir)(e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err(&self.state_dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(lease) = name.strip_suffix(".json").filter(|l| valid_lease_id(l)) else {
                continue;
            };
            if let Some(spec) = self.load_record(lease)? {
                out.push(spec);
            }
        }
        out.sort_by(|a, b| a.lease_id.cmp(&b.lease_id));
        Ok(out)
    }

    /// Every daemon tesserad recorded, with its liveness now.
    pub fn daemons(&self) -> Result<Vec<MpsDaemon>, MpsError> {
        let mut all: Vec<MpsDaemon> = self.records()?.iter().map(|s| self.status(s)).collect();
        assign_time_slices(&mut all);
        Ok(all)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    fn spec(root: &Path, lease: &str) -> MpsSpec {
        MpsSpec {
            lease_id: lease.to_owned(),
            gpu: 1,
            gpu_uuid: "GPU-8d4b7c2e-1f0a-4c55-9e1b-3a2f6d7e8c90".to_owned(),
            sm_percent: 30,
            memory_bytes: 10 * 1024 * MIB + 123,
            pipe_dir: root.join(lease).join("pipe"),
            log_dir: root.join(lease).join("log"),
            owner_uid: None,
            mode: MpsMode::Isolated,
        }
    }

    fn control(root: &Path, binary: PathBuf) -> MpsControl {
        MpsControl::new(&MpsConfig {
            binary: Some(binary),
            state_dir: root.join("records"),
            timeout_secs: 20,
        })
    }

    #[test]
    fn limit_commands_are_daemon_side_and_round_down() {
        let s = spec(Path::new("/run/t"), "l1");
        assert_eq!(
            limit_commands(&s),
            vec![
                "set_default_active_thread_percentage 30".to_owned(),
                "set_default_device_pinned_mem_limit 0 10240M".to_owned(),
            ]
        );
        // A shared server sets none: its clients carry their own (client-side).
        let shared = MpsSpec {
            mode: MpsMode::Shared,
            sm_percent: 100,
            memory_bytes: 0,
            ..s
        };
        assert!(validate_spec(&shared).is_ok());
        assert!(limit_commands(&shared).is_empty());
    }

    #[test]
    fn commands_carry_exactly_the_spec_environment() {
        let s = spec(Path::new("/run/t"), "l1");
        let c = MpsControl::new(&MpsConfig::default());
        let start = c.start_command(&s);
        assert_eq!(start.get_program(), OsStr::new(DEFAULT_BINARY));
        assert_eq!(start.get_args().collect::<Vec<_>>(), vec![OsStr::new("-d")]);
        let envs: Vec<(String, Option<String>)> = start
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.map(|v| v.to_string_lossy().into_owned()),
                )
            })
            .collect();
        let get = |k: &str| {
            envs.iter()
                .find(|(n, _)| n == k)
                .and_then(|(_, v)| v.clone())
        };
        assert_eq!(
            get("CUDA_VISIBLE_DEVICES").as_deref(),
            Some(s.gpu_uuid.as_str())
        );
        assert_eq!(
            get("CUDA_MPS_PIPE_DIRECTORY").as_deref(),
            Some("/run/t/l1/pipe")
        );
        assert_eq!(
            get("CUDA_MPS_LOG_DIRECTORY").as_deref(),
            Some("/run/t/l1/log")
        );
        assert!(get("PATH").is_some());
        for (k, _) in &envs {
            assert!(
                matches!(
                    k.as_str(),
                    "PATH"
                        | "LD_LIBRARY_PATH"
                        | "CUDA_VISIBLE_DEVICES"
                        | "CUDA_MPS_PIPE_DIRECTORY"
                        | "CUDA_MPS_LOG_DIRECTORY"
                ),
                "unexpected env {k}"
            );
        }
        let ctl = c.control_command(&s);
        assert_eq!(ctl.get_args().count(), 0);
        assert_eq!(ctl.get_envs().count(), envs.len());
    }

    #[test]
    fn specs_are_validated() {
        let ok = spec(Path::new("/run/t"), "lease-1.a_b");
        validate_spec(&ok).unwrap();
        let mut s = ok.clone();
        s.lease_id = "../etc".to_owned();
        assert!(validate_spec(&s).is_err());
        let mut s = ok.clone();
        s.sm_percent = 101;
        assert!(validate_spec(&s).is_err());
        let mut s = ok.clone();
        s.memory_bytes = 1000;
        assert!(validate_spec(&s).is_err());
        let mut s = ok.clone();
        s.gpu_uuid = "GPU-a,GPU-b".to_owned();
        assert!(validate_spec(&s).is_err());
        let mut s = ok.clone();
        s.pipe_dir = PathBuf::from("relative");
        assert!(validate_spec(&s).is_err());
        let mut s = ok;
        s.log_dir = s.pipe_dir.clone();
        assert!(validate_spec(&s).is_err());
    }

    #[test]
    fn dirs_are_private_and_symlinks_refused() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a/b");
        prepare_dir(&dir, None).unwrap();
        let mode = fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        prepare_dir(&dir, None).unwrap();
        assert_eq!(
            fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(prepare_dir(&link, None).is_err());
    }

    #[test]
    fn missing_binary_is_a_clear_error() {
        let root = tempfile::tempdir().unwrap();
        let c = control(root.path(), root.path().join("no-such-mps-control"));
        let e = c.start(&spec(root.path(), "l1")).unwrap_err();
        assert!(matches!(e, MpsError::Spawn { .. }), "{e}");
        assert!(e.to_string().contains("mps.binary"), "{e}");
        assert!(
            c.daemons().unwrap().is_empty(),
            "no record of a daemon never started"
        );
    }

    /// A stand-in for nvidia-cuda-mps-control: `-d` leaves a background process named
    /// like the daemon and writes its pid file; client mode logs each command and
    /// handles `quit`.
    const FAKE: &str = r#"#!/bin/bash
log="$CUDA_MPS_LOG_DIRECTORY/fake.log"
pidfile="$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
if [ "$1" = "-d" ]; then
  echo "daemon $CUDA_VISIBLE_DEVICES" >> "$log"
  (exec -a nvidia-cuda-mps-control sleep 120) </dev/null >/dev/null 2>&1 &
  echo $! > "$pidfile"
  exit 0
fi
while read -r line; do
  echo "cmd $line" >> "$log"
  case "$line" in
    quit) kill "$(cat "$pidfile")"; rm -f "$pidfile" ;;
    set_default_active_thread_percentage\ 99) echo "refused" ; exit 1 ;;
  esac
done
"#;

    /// The MPS server the control daemon starts runs as the tenant's uid and must
    /// pass through `<run_dir>/mps` to its lease's pipe and log directories: that
    /// directory is made 0711 (and made so again when it was not), the lease's own
    /// directories stay 0700.
    #[test]
    fn the_mps_base_is_traversable_and_a_lease_s_directories_are_not() {
        let root = tempfile::tempdir().unwrap();
        let c = stand_in(root.path());
        let base = root.path().join("run").join("mps");
        fs::create_dir_all(&base).unwrap();
        fs::set_permissions(&base, fs::Permissions::from_mode(0o700)).unwrap();
        let s = spec(&base, "lease-b");
        c.start(&s).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&base), 0o711);
        assert_eq!(mode(&base.join("lease-b")), 0o700);
        assert_eq!(mode(&s.pipe_dir), 0o700);
        assert_eq!(mode(&s.log_dir), 0o700);
        c.stop("lease-b").unwrap();
        // A base that is a file (or a symlink) is refused, not replaced.
        let odd = root.path().join("odd");
        fs::write(&odd, "").unwrap();
        assert!(prepare_base(&odd).is_err());
    }

    /// An MpsControl on the stand-in control binary (FAKE), written into `root`.
    fn stand_in(root: &Path) -> MpsControl {
        let bin = root.join("nvidia-cuda-mps-control");
        fs::write(&bin, FAKE).unwrap();
        fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
        control(root, bin)
    }

    #[test]
    fn start_stop_with_a_stand_in_binary() {
        let root = tempfile::tempdir().unwrap();
        let c = stand_in(root.path());
        let s = spec(root.path(), "lease-a");

        let d = c.start(&s).unwrap();
        assert!(d.running);
        let pid = d.pid.unwrap();
        assert!(pid_is_daemon(pid, DEFAULT_BINARY));
        let log = fs::read_to_string(s.log_dir.join("fake.log")).unwrap();
        assert_eq!(
            log.lines().collect::<Vec<_>>(),
            vec![
                format!("daemon {}", s.gpu_uuid).as_str(),
                "cmd set_default_active_thread_percentage 30",
                "cmd set_default_device_pinned_mem_limit 0 10240M",
            ]
        );
        assert_eq!(
            fs::metadata(&s.pipe_dir).unwrap().permissions().mode() & 0o777,
            0o700
        );

        // Idempotent: no second daemon, limits re-sent.
        assert_eq!(c.start(&s).unwrap().pid, Some(pid));
        let log = fs::read_to_string(s.log_dir.join("fake.log")).unwrap();
        assert_eq!(log.matches("daemon ").count(), 1);
        // A new MpsControl (daemon restart) finds it from the records.
        let again = control(root.path(), root.path().join("nvidia-cuda-mps-control"));
        // The only daemon on its GPU gets all of the GPU's time.
        assert_eq!(
            again.daemons().unwrap(),
            vec![MpsDaemon {
                time_slice_percent: 100,
                ..d.clone()
            }]
        );
        // Conflicts: other limits for the lease, or its pipe dir for another lease.
        let mut other = s.clone();
        other.sm_percent = 50;
        assert!(matches!(c.start(&other), Err(MpsError::Conflict(_))));
        let mut thief = spec(root.path(), "lease-b");
        thief.pipe_dir = s.pipe_dir.clone();
        assert!(matches!(c.start(&thief), Err(MpsError::Conflict(_))));

        c.stop("lease-a").unwrap();
        assert!(!pid_is_daemon(pid, DEFAULT_BINARY));
        assert!(c.daemons().unwrap().is_empty());
        c.stop("lease-a").unwrap();
        let log = fs::read_to_string(s.log_dir.join("fake.log")).unwrap();
        assert!(log.ends_with("cmd quit\n"), "{log}");

        // A refused limit fails closed: the daemon is stopped again.
        let mut refused = spec(root.path(), "lease-c");
        refused.sm_percent = 99;
        let e = c.start(&refused).unwrap_err();
        assert!(matches!(e, MpsError::CommandFailed { .. }), "{e}");
        assert!(e.to_string().contains("refused"), "{e}");
        assert!(!c.status(&refused).running);
        assert!(c.daemons().unwrap().is_empty());
    }
}
