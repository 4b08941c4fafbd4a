//! `tessera doctor`: is this host ready to run Tessera? Each check prints OK, WARN or
//! FAIL with what it saw and, when not OK, the fix.
//!
//! The checks are pure functions over [`HostFacts`] (file contents and command
//! outputs), so they are unit-tested with the outputs of real hosts; [`gather`] reads
//! them from this host. Nothing here needs the daemon or a GPU.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use crate::output;

const RUNC_CVES: &str = "CVE-2025-31133, CVE-2025-52565, CVE-2025-52881";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl Level {
    fn as_str(self) -> &'static str {
        match self {
            Level::Ok => "OK",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub level: Level,
    /// What was found.
    pub detail: String,
    /// What to do about it (None when OK).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

fn ok(name: &'static str, detail: impl Into<String>) -> Check {
    Check {
        name,
        level: Level::Ok,
        detail: detail.into(),
        fix: None,
    }
}

fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check {
        name,
        level: Level::Warn,
        detail: detail.into(),
        fix: Some(fix.into()),
    }
}

fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check {
        name,
        level: Level::Fail,
        detail: detail.into(),
        fix: Some(fix.into()),
    }
}

/// What a command printed, or why it could not run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmdOut {
    Ran { success: bool, stdout: String },
    NotFound,
}

/// The API socket as found on disk.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SocketFacts {
    pub path: PathBuf,
    /// None when the path does not exist.
    pub stat: Option<SocketStat>,
    /// Modes of the socket's directory (the daemon's run_dir by default) and of its
    /// `mps` subdirectory, where they exist.
    pub dir_mode: Option<u32>,
    pub mps_dir_mode: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketStat {
    pub is_socket: bool,
    pub mode: u32,
    pub group: Option<String>,
    /// A connect() succeeded (a daemon answers).
    pub connects: bool,
}

/// Everything the checks look at.
#[derive(Debug, Clone, Default)]
pub struct HostFacts {
    /// /proc/driver/nvidia/version
    pub driver_proc: Option<String>,
    /// `nvidia-smi --version`
    pub smi_version: Option<CmdOut>,
    /// `nvidia-smi --query-gpu=index,name,mig.mode.current,mig.mode.pending --format=csv,noheader`
    pub smi_mig: Option<CmdOut>,
    /// /proc/devices
    pub proc_devices: Option<String>,
    /// /proc/driver/nvidia-caps/mig-minors
    pub mig_minors: Option<String>,
    /// Where nvidia-cuda-mps-control is on PATH.
    pub mps_control: Option<PathBuf>,
    /// `runc --version`
    pub runc_version: Option<CmdOut>,
    /// /proc/self/mountinfo or /proc/mounts
    pub mounts: Option<String>,
    /// /sys/kernel/security/lsm
    pub lsm: Option<String>,
    /// /sys/module/apparmor/parameters/enabled
    pub apparmor_enabled: Option<String>,
    /// containerd's config file (path, contents).
    pub containerd_config: Option<(PathBuf, Option<String>)>,
    pub socket: Option<SocketFacts>,
    /// The daemon's config, when `--config` names it.
    pub daemon: Option<DaemonView>,
    /// What NVML answers through the daemon's library (`--config` with
    /// backend = "nvml"): the driver version and each GPU, or why it cannot load.
    pub nvml: Option<Result<NvmlFacts, String>>,
}

/// What of tesserad's config the checks use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DaemonView {
    pub path: PathBuf,
    /// "nvml" or "sim".
    pub backend: String,
    pub library_path: Option<PathBuf>,
    pub mig_minors_path: Option<PathBuf>,
    pub mps_control: Option<PathBuf>,
    pub nvidia_caps_major: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlFacts {
    pub library: String,
    pub driver_version: String,
    /// (index, name, MIG current, MIG pending), or the error of a GPU that does not
    /// answer.
    pub gpus: Vec<Result<(u32, String, bool, bool), String>>,
}

/// `backend = "sim"`: no driver is needed.
fn simulated(f: &HostFacts) -> bool {
    f.daemon.as_ref().is_some_and(|d| d.backend == "sim")
}

fn cmd_stdout(c: &Option<CmdOut>) -> Option<&str> {
    match c {
        Some(CmdOut::Ran {
            success: true,
            stdout,
        }) => Some(stdout),
        _ => None,
    }
}

/// NVIDIA kernel driver and NVML versions.
pub fn check_driver(f: &HostFacts) -> Check {
    const NAME: &str = "nvidia driver";
    if simulated(f) {
        return ok(NAME, "not needed: the config's backend is \"sim\"");
    }
    match &f.nvml {
        Some(Ok(n)) => {
            return ok(
                NAME,
                format!(
                    "NVML answers through {}: driver {}",
                    n.library, n.driver_version
                ),
            );
        }
        Some(Err(e)) => {
            return fail(
                NAME,
                format!("NVML does not answer: {e}"),
                "install and load the NVIDIA driver, or point [nvml] library_path at libnvidia-ml.so.1",
            );
        }
        None => {}
    }
    let kernel = f.driver_proc.as_deref().and_then(|t| {
        // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 ..."
        let line = t.lines().find(|l| l.starts_with("NVRM version"))?;
        line.split_whitespace()
            .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
            .map(str::to_string)
    });
    let nvml = cmd_stdout(&f.smi_version).and_then(|t| {
        t.lines()
            .find(|l| l.to_ascii_uppercase().starts_with("NVML VERSION"))
            .and_then(|l| l.split(':').nth(1))
            .map(|v| v.trim().to_string())
    });
    match (kernel, nvml) {
        (Some(k), Some(n)) => ok(NAME, format!("kernel module {k}, NVML {n}")),
        (Some(k), None) => warn(
            NAME,
            format!("kernel module {k}; NVML version unknown (nvidia-smi missing or failing)"),
            "install the driver's user-space utilities (nvidia-utils / libnvidia-ml) matching the kernel module",
        ),
        (None, _) => fail(
            NAME,
            "no NVIDIA kernel driver loaded (/proc/driver/nvidia/version is absent)",
            "install the NVIDIA data-center driver (>= 470 for MIG) and load it (modprobe nvidia); until then tesserad can run only backend = \"sim\"",
        ),
    }
}

/// MIG mode per GPU from nvidia-smi.
pub fn check_mig(f: &HostFacts) -> Check {
    const NAME: &str = "MIG mode";
    if simulated(f) {
        return ok(NAME, "simulated GPUs (backend = \"sim\")");
    }
    // Through NVML as the daemon reads it, in nvidia-smi's words.
    let from_nvml;
    let out = match &f.nvml {
        Some(Ok(n)) => match nvml_mig_lines(n) {
            Ok(lines) => {
                from_nvml = lines;
                Some(from_nvml.as_str())
            }
            Err(check) => return check,
        },
        _ => cmd_stdout(&f.smi_mig),
    };
    let Some(out) = out else {
        return fail(
            NAME,
            "cannot query GPUs (nvidia-smi is missing or failed)",
            "install the NVIDIA driver; then check with: nvidia-smi -L",
        );
    };
    let modes = MigModes::of(out);
    if modes.on.is_empty() && modes.off.is_empty() {
        return fail(
            NAME,
            "nvidia-smi lists no GPUs",
            "check the driver sees the GPUs: nvidia-smi -L, dmesg | grep -i nvrm",
        );
    }
    let list = |v: &[String]| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    let detail = format!(
        "enabled on GPU {}; not on GPU {}",
        list(&modes.on),
        list(&modes.off)
    );
    if !modes.pending.is_empty() {
        return warn(
            NAME,
            format!(
                "{detail}; change pending on GPU {}",
                modes.pending.join(", ")
            ),
            "a MIG mode change needs a GPU reset: stop GPU users, then nvidia-smi -i <N> -r (or reboot)",
        );
    }
    if modes.on.is_empty() {
        return warn(
            NAME,
            detail,
            "MIG leases need MIG mode: nvidia-smi -i <N> -mig 1 (MPS and whole-GPU leases work without it)",
        );
    }
    ok(NAME, detail)
}

/// NVML's MIG modes as nvidia-smi's CSV lines (index, name, current, pending); a
/// warning when some GPU does not answer NVML.
fn nvml_mig_lines(n: &NvmlFacts) -> Result<String, Check> {
    let lost: Vec<String> = n
        .gpus
        .iter()
        .filter_map(|g| g.as_ref().err().cloned())
        .collect();
    if !lost.is_empty() {
        return Err(warn(
            "MIG mode",
            format!("GPUs that do not answer NVML: {}", lost.join("; ")),
            "tesserad serves the others and keeps these out of service until they answer; check dmesg | grep -i xid, and reset or reseat the GPU",
        ));
    }
    let mode = |on: bool| if on { "Enabled" } else { "Disabled" };
    Ok(n.gpus
        .iter()
        .filter_map(|g| g.as_ref().ok())
        .map(|(i, name, cur, pend)| format!("{i}, {name}, {}, {}\n", mode(*cur), mode(*pend)))
        .collect())
}

/// The GPUs with MIG on, off, and with a change pending, from nvidia-smi's
/// `index, name, mig.mode.current, mig.mode.pending` CSV lines.
struct MigModes {
    on: Vec<String>,
    off: Vec<String>,
    pending: Vec<String>,
}

impl MigModes {
    fn of(out: &str) -> MigModes {
        let mut m = MigModes {
            on: Vec::new(),
            off: Vec::new(),
            pending: Vec::new(),
        };
        for line in out.lines().filter(|l| !l.trim().is_empty()) {
            let cols: Vec<&str> = line.split(',').map(str::trim).collect();
            let (Some(idx), Some(cur)) = (cols.first(), cols.get(2)) else {
                continue;
            };
            let pend = cols.get(3).copied().unwrap_or("");
            match *cur {
                "Enabled" => m.on.push(idx.to_string()),
                _ => m.off.push(format!("{idx} ({cur})")),
            }
            if !pend.is_empty() && pend != *cur && pend != "[N/A]" {
                m.pending.push(format!("{idx} ({cur} -> {pend})"));
            }
        }
        m
    }
}

/// nvidia-caps major in /proc/devices and the mig-minors file.
pub fn check_caps(f: &HostFacts) -> Check {
    const NAME: &str = "nvidia-caps";
    if simulated(f) {
        return ok(NAME, "not needed: the config's backend is \"sim\"");
    }
    let configured = f
        .daemon
        .as_ref()
        .and_then(|d| d.nvidia_caps_major)
        .map(|m| m.to_string());
    let major = configured.or_else(|| {
        f.proc_devices.as_deref().and_then(|t| {
            t.lines().find_map(|l| {
                let mut w = l.split_whitespace();
                let major = w.next()?;
                (w.next()? == "nvidia-caps").then(|| major.to_string())
            })
        })
    });
    let minors_path = f
        .daemon
        .as_ref()
        .and_then(|d| d.mig_minors_path.clone())
        .unwrap_or_else(|| PathBuf::from("/proc/driver/nvidia-caps/mig-minors"));
    let minors = f
        .mig_minors
        .as_deref()
        .map(|t| t.lines().filter(|l| !l.trim().is_empty()).count());
    match (major, minors) {
        (Some(m), Some(n)) if n > 0 => ok(NAME, format!("major {m}, {n} mig-minors entries")),
        (Some(m), _) => fail(
            NAME,
            format!(
                "major {m}, but {} is missing or empty",
                minors_path.display()
            ),
            "load a driver with MIG support (>= 470) and set NVreg_ModifyDeviceFiles=1 (the default)",
        ),
        (None, _) => fail(
            NAME,
            "no nvidia-caps major in /proc/devices",
            "load the NVIDIA driver (>= 470); MIG access capabilities live in /dev/nvidia-caps (nvidia-modprobe -f /proc/driver/nvidia-caps/mig-minors creates the nodes)",
        ),
    }
}

pub fn check_mps(f: &HostFacts) -> Check {
    const NAME: &str = "MPS control";
    if simulated(f) {
        return ok(NAME, "simulated MPS (backend = \"sim\")");
    }
    if let Some(p) = f.daemon.as_ref().and_then(|d| d.mps_control.as_ref()) {
        return match std::fs::metadata(p) {
            Ok(m) if m.is_file() && m.mode() & 0o111 != 0 => {
                ok(NAME, format!("{} ([nvml] mps_control)", p.display()))
            }
            _ => fail(
                NAME,
                format!(
                    "[nvml] mps_control {} is not an executable file",
                    p.display()
                ),
                "point [nvml] mps_control at nvidia-cuda-mps-control; MPS leases fail without it",
            ),
        };
    }
    match &f.mps_control {
        Some(p) => ok(NAME, format!("{}", p.display())),
        None => warn(
            NAME,
            "nvidia-cuda-mps-control is not on PATH",
            "install the driver's CUDA utilities (nvidia-cuda-mps package) or set [nvml] mps_control; MPS leases fail without it",
        ),
    }
}

pub use tessera_common::runc::parse_version as parse_runc_version;

pub fn check_runc(f: &HostFacts) -> Check {
    const NAME: &str = "runc";
    let out = match &f.runc_version {
        None | Some(CmdOut::NotFound) => {
            return fail(
                NAME,
                "runc is not installed",
                "install runc >= 1.2.8 (1.3.3, 1.4.0 lines); tessera-runtime hands containers to it",
            );
        }
        Some(CmdOut::Ran { stdout, .. }) => stdout,
    };
    let Some(v) = parse_runc_version(out) else {
        return warn(
            NAME,
            format!(
                "cannot read the version from {:?}",
                out.lines().next().unwrap_or("")
            ),
            "check `runc --version` by hand: it must be >= 1.2.8 (or 1.3.3, 1.4.0)",
        );
    };
    let shown = format!("{}.{}.{}", v.0, v.1, v.2);
    if tessera_common::runc::unfixed(Some(v)).is_empty() {
        ok(NAME, format!("{shown} (has the fixes for {RUNC_CVES})"))
    } else {
        warn(
            NAME,
            format!(
                "{shown} is older than the releases that fix {RUNC_CVES} (1.2.8, 1.3.3, 1.4.0)"
            ),
            "upgrade runc to 1.2.8, 1.3.3 or 1.4.0 or later; a distribution build may carry backported fixes: check its changelog, then name the CVEs in runtime.toml's runc_cve_acknowledged (tessera-runtime refuses containers otherwise)",
        )
    }
}

/// cgroup v2 unified, hybrid or v1 from the mount table.
pub fn check_cgroup(f: &HostFacts) -> Check {
    const NAME: &str = "cgroup mode";
    let Some(m) = f.mounts.as_deref() else {
        return warn(
            NAME,
            "cannot read the mount table",
            "check /proc/self/mountinfo is readable",
        );
    };
    let mut unified = false;
    let mut hybrid = false;
    let mut v1 = false;
    for line in m.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        // /proc/mounts: dev mountpoint fstype ...
        let (Some(mp), Some(fs)) = (w.get(1), w.get(2)) else {
            continue;
        };
        match (*fs, *mp) {
            ("cgroup2", "/sys/fs/cgroup") => unified = true,
            ("cgroup2", _) => hybrid = true,
            ("cgroup", _) => v1 = true,
            _ => {}
        }
    }
    if unified {
        ok(NAME, "cgroup v2 (unified)")
    } else if v1 {
        warn(
            NAME,
            if hybrid {
                "cgroup v1 with a v2 hierarchy beside it (hybrid)"
            } else {
                "cgroup v1 (legacy)"
            },
            "prefer cgroup v2: boot with systemd.unified_cgroup_hierarchy=1 (device rules then need runc's eBPF filter, which runc >= 1.2 provides)",
        )
    } else {
        fail(
            NAME,
            "no cgroup filesystem mounted",
            "mount cgroup2 on /sys/fs/cgroup (systemd does this at boot)",
        )
    }
}

pub fn check_apparmor(f: &HostFacts) -> Check {
    const NAME: &str = "AppArmor";
    let in_lsm = f
        .lsm
        .as_deref()
        .is_some_and(|l| l.trim().split(',').any(|m| m == "apparmor"));
    let enabled = f
        .apparmor_enabled
        .as_deref()
        .is_some_and(|e| e.trim() == "Y");
    if in_lsm && enabled {
        ok(
            NAME,
            "enabled (the tessera-tenant profile can confine containers)",
        )
    } else {
        warn(
            NAME,
            match (&f.lsm, in_lsm) {
                (None, _) => {
                    "the LSM list is unreadable (securityfs not mounted?): AppArmor is not active"
                        .to_string()
                }
                (Some(l), false) => format!("not an active LSM (active: {})", l.trim()),
                (Some(_), true) => "in the LSM list but disabled".to_string(),
            },
            "enable AppArmor (apparmor=1 security=apparmor on the kernel command line, apt install apparmor) and load /etc/apparmor.d/tessera-tenant with apparmor_parser -r; without it containers rely on seccomp, capabilities and the device cgroup alone",
        )
    }
}

pub fn check_containerd(f: &HostFacts) -> Check {
    const NAME: &str = "containerd runtime class";
    let snippet = "add to the config:\n  [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera]\n    runtime_type = \"io.containerd.runc.v2\"\n    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera.options]\n      BinaryName = \"/usr/local/bin/tessera-runtime\"\nthen: systemctl restart containerd (see docs/operations.md)";
    let Some((path, text)) = &f.containerd_config else {
        return fail(NAME, "containerd config not found", snippet);
    };
    let Some(text) = text else {
        return fail(
            NAME,
            format!("{} does not exist or is unreadable", path.display()),
            snippet,
        );
    };
    let table = text
        .lines()
        .map(str::trim)
        .any(|l| l.starts_with('[') && l.trim_end_matches(']').ends_with("runtimes.tessera"));
    let binary = text
        .lines()
        .map(str::trim)
        .any(|l| l.starts_with("BinaryName") && l.contains("tessera-runtime"));
    match (table, binary) {
        (true, true) => ok(
            NAME,
            format!(
                "{}: runtime \"tessera\" runs tessera-runtime",
                path.display()
            ),
        ),
        (true, false) => fail(
            NAME,
            format!(
                "{}: runtime \"tessera\" exists but its BinaryName is not tessera-runtime",
                path.display()
            ),
            snippet,
        ),
        _ => fail(
            NAME,
            format!("{}: no runtime \"tessera\"", path.display()),
            snippet,
        ),
    }
}

pub fn check_socket(f: &HostFacts) -> Check {
    const NAME: &str = "API socket";
    let Some(s) = &f.socket else {
        return fail(NAME, "no socket path", "pass --socket");
    };
    let p = s.path.display();
    let Some(st) = &s.stat else {
        return fail(
            NAME,
            format!("{p} does not exist"),
            "start the daemon: systemctl enable --now tesserad (journalctl -u tesserad says why it is not up)",
        );
    };
    if !st.is_socket {
        return fail(
            NAME,
            format!("{p} exists but is not a socket"),
            "remove it and restart tesserad",
        );
    }
    let group = st.group.clone().unwrap_or_else(|| "?".into());
    let detail = format!("{p} mode {:04o} group {group}", st.mode & 0o7777);
    if st.mode & 0o007 != 0 {
        return fail(
            NAME,
            format!("{detail}: anyone on the host may create leases"),
            "set [daemon] socket_mode = \"0660\" and restart tesserad",
        );
    }
    if !st.connects {
        return fail(
            NAME,
            format!("{detail}: nothing answers (stale socket, or no permission for this user)"),
            "check systemctl status tesserad; non-root users need membership in the socket's group (usermod -aG tessera USER)",
        );
    }
    if st.group.as_deref() != Some("tessera") {
        return warn(
            NAME,
            detail,
            "set [daemon] socket_group = \"tessera\" so operators and the runtime reach it without root",
        );
    }
    ok(NAME, format!("{detail}, daemon answers"))
}

/// A lease's MPS server runs as the tenant's uid and reaches its pipe directory,
/// `<run_dir>/mps/<lease>/pipe`, through the run directory and `mps`: both must let
/// others pass (x). Read at the socket's directory, the run_dir by default.
pub fn check_mps_dirs(f: &HostFacts) -> Check {
    const NAME: &str = "MPS directories";
    let Some(s) = &f.socket else {
        return ok(NAME, "no socket path given: not checked");
    };
    let Some(dir) = s.path.parent() else {
        return ok(NAME, "the socket has no directory: not checked");
    };
    let closed: Vec<String> = [
        (dir.to_path_buf(), s.dir_mode),
        (dir.join("mps"), s.mps_dir_mode),
    ]
    .into_iter()
    .filter_map(|(p, m)| {
        m.filter(|m| m & 0o001 == 0)
            .map(|m| format!("{} mode {:04o}", p.display(), m & 0o7777))
    })
    .collect();
    if closed.is_empty() {
        return ok(
            NAME,
            format!("{} passable by the tenants' uids", dir.display()),
        );
    }
    warn(
        NAME,
        format!(
            "{}: an MPS lease's server (run as its tenant's uid) cannot reach its pipe directory, and clients of non-root containers cannot connect",
            closed.join(", ")
        ),
        "give others x on them (chmod o+x; the unit's RuntimeDirectoryMode=0751); tesserad makes <run_dir>/mps 0711 itself",
    )
}

/// Every check, in the order they print.
pub fn run_checks(f: &HostFacts) -> Vec<Check> {
    vec![
        check_driver(f),
        check_mig(f),
        check_caps(f),
        check_mps(f),
        check_runc(f),
        check_cgroup(f),
        check_apparmor(f),
        check_containerd(f),
        check_socket(f),
        check_mps_dirs(f),
    ]
}

// ---- reading the real host ----

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn run(cmd: &str, args: &[&str]) -> CmdOut {
    match Command::new(cmd).args(args).output() {
        Ok(o) => CmdOut::Ran {
            success: o.status.success(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        },
        Err(_) => CmdOut::NotFound,
    }
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    // Also the sbin dirs: doctor may run as a user whose PATH lacks them.
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

fn socket_facts(path: &Path) -> SocketFacts {
    let stat = std::fs::metadata(path).ok().map(|m| SocketStat {
        is_socket: m.file_type().is_socket(),
        mode: m.mode(),
        group: group_name(m.gid()),
        connects: std::os::unix::net::UnixStream::connect(path).is_ok(),
    });
    let mode_of = |p: &Path| std::fs::metadata(p).ok().map(|m| m.mode());
    let dir = path.parent();
    SocketFacts {
        path: path.to_path_buf(),
        stat,
        dir_mode: dir.and_then(mode_of),
        mps_dir_mode: dir.and_then(|d| mode_of(&d.join("mps"))),
    }
}

fn group_name(gid: u32) -> Option<String> {
    read("/etc/group")?.lines().find_map(|l| {
        let mut f = l.split(':');
        let name = f.next()?;
        f.next()?;
        (f.next()?.parse::<u32>().ok()? == gid).then(|| name.to_string())
    })
}

#[derive(Debug, Default, serde::Deserialize)]
struct RawConfig {
    #[serde(default)]
    daemon: RawDaemon,
    #[serde(default)]
    gpu: RawGpu,
    #[serde(default)]
    nvml: RawNvml,
    #[serde(default)]
    devices: RawDevices,
}

#[derive(Debug, Default, serde::Deserialize)]
struct RawDaemon {
    socket: Option<PathBuf>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct RawGpu {
    backend: Option<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct RawNvml {
    library_path: Option<PathBuf>,
    mig_minors_path: Option<PathBuf>,
    mps_control: Option<PathBuf>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct RawDevices {
    nvidia_caps_major: Option<u32>,
}

/// The parts of tesserad's config the checks use, and its socket.
pub fn read_daemon_config(path: &Path) -> anyhow::Result<(DaemonView, Option<PathBuf>)> {
    use anyhow::Context as _;
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let raw: RawConfig = toml::from_str(&text)
        .with_context(|| format!("{}: not a tesserad config", path.display()))?;
    Ok((
        DaemonView {
            path: path.to_path_buf(),
            backend: raw.gpu.backend.unwrap_or_else(|| "sim".into()),
            library_path: raw.nvml.library_path,
            mig_minors_path: raw.nvml.mig_minors_path,
            mps_control: raw.nvml.mps_control,
            nvidia_caps_major: raw.devices.nvidia_caps_major,
        },
        raw.daemon.socket,
    ))
}

/// NVML through `library` (None: libnvidia-ml.so.1 from the loader path), as the
/// daemon loads it.
pub fn nvml_facts(library: Option<&Path>) -> Result<NvmlFacts, String> {
    let nvml = match library {
        Some(p) => nvml_wrapper::Nvml::builder().lib_path(p.as_os_str()).init(),
        None => nvml_wrapper::Nvml::init(),
    }
    .map_err(|e| e.to_string())?;
    let driver_version = nvml.sys_driver_version().map_err(|e| e.to_string())?;
    let count = nvml.device_count().map_err(|e| e.to_string())?;
    let gpus = (0..count)
        .map(|i| {
            let d = nvml
                .device_by_index(i)
                .map_err(|e| format!("GPU {i}: {e}"))?;
            let name = d.name().map_err(|e| format!("GPU {i}: {e}"))?;
            let (cur, pend) = match d.mig_mode() {
                Ok(m) => (m.current == 1, m.pending == 1),
                Err(nvml_wrapper::error::NvmlError::NotSupported) => (false, false),
                Err(e) => return Err(format!("GPU {i}: {e}")),
            };
            d.memory_info().map_err(|e| format!("GPU {i}: {e}"))?;
            Ok((i, name, cur, pend))
        })
        .collect();
    Ok(NvmlFacts {
        library: library.map_or_else(
            || "libnvidia-ml.so.1".to_owned(),
            |p| p.display().to_string(),
        ),
        driver_version,
        gpus,
    })
}

/// Read this host's facts as the daemon of `config` would use it.
pub fn gather_for(
    socket: &Path,
    containerd_config: &Path,
    config: Option<&Path>,
) -> anyhow::Result<HostFacts> {
    let Some(path) = config else {
        return Ok(gather(socket, containerd_config));
    };
    let (view, config_socket) = read_daemon_config(path)?;
    let mut f = gather(
        config_socket.as_deref().unwrap_or(socket),
        containerd_config,
    );
    if let Some(p) = &view.mig_minors_path {
        f.mig_minors = std::fs::read_to_string(p).ok();
    }
    if view.backend == "nvml" {
        f.nvml = Some(nvml_facts(view.library_path.as_deref()));
    }
    f.daemon = Some(view);
    Ok(f)
}

/// Read this host's facts.
pub fn gather(socket: &Path, containerd_config: &Path) -> HostFacts {
    let smi = which("nvidia-smi");
    let smi_run = |args: &[&str]| {
        smi.as_ref()
            .map(|p| run(&p.to_string_lossy(), args))
            .unwrap_or(CmdOut::NotFound)
    };
    HostFacts {
        driver_proc: read("/proc/driver/nvidia/version"),
        smi_version: Some(smi_run(&["--version"])),
        smi_mig: Some(smi_run(&[
            "--query-gpu=index,name,mig.mode.current,mig.mode.pending",
            "--format=csv,noheader",
        ])),
        proc_devices: read("/proc/devices"),
        mig_minors: read("/proc/driver/nvidia-caps/mig-minors"),
        mps_control: which("nvidia-cuda-mps-control"),
        runc_version: Some(
            which("runc")
                .map(|p| run(&p.to_string_lossy(), &["--version"]))
                .unwrap_or(CmdOut::NotFound),
        ),
        mounts: read("/proc/mounts"),
        lsm: read("/sys/kernel/security/lsm"),
        apparmor_enabled: read("/sys/module/apparmor/parameters/enabled"),
        containerd_config: Some((
            containerd_config.to_path_buf(),
            std::fs::read_to_string(containerd_config).ok(),
        )),
        socket: Some(socket_facts(socket)),
        daemon: None,
        nvml: None,
    }
}

pub fn render(checks: &[Check]) -> String {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    let mut out = String::new();
    for c in checks {
        out.push_str(&format!(
            "{:<4}  {:<width$}  {}\n",
            c.level.as_str(),
            c.name,
            c.detail
        ));
        if let Some(fix) = &c.fix {
            for (i, line) in fix.lines().enumerate() {
                let lead = if i == 0 { "fix: " } else { "     " };
                out.push_str(&format!("{:<4}  {:<width$}  {lead}{line}\n", "", ""));
            }
        }
    }
    let count = |l| checks.iter().filter(|c| c.level == l).count();
    out.push_str(&format!(
        "\n{} ok, {} warnings, {} failures\n",
        count(Level::Ok),
        count(Level::Warn),
        count(Level::Fail)
    ));
    out
}

/// Run the checks on this host and print them. Returns true when nothing FAILed.
pub fn run_doctor(
    socket: &Path,
    containerd_config: &Path,
    config: Option<&Path>,
    json: bool,
) -> anyhow::Result<bool> {
    let checks = run_checks(&gather_for(socket, containerd_config, config)?);
    if json {
        output::print_json(&checks)?;
    } else {
        output::print(&render(&checks))?;
    }
    Ok(!checks.iter().any(|c| c.level == Level::Fail))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn ran(s: &str) -> Option<CmdOut> {
        Some(CmdOut::Ran {
            success: true,
            stdout: s.into(),
        })
    }

    #[test]
    fn runc_versions_against_the_2025_fixes() {
        let level = |v: &str| {
            check_runc(&HostFacts {
                runc_version: ran(v),
                ..HostFacts::default()
            })
            .level
        };
        // Debian bookworm's runc.
        assert_eq!(
            level("runc version 1.1.5+ds1\ncommit: 1.1.5+ds1-1+deb12u1\nspec: 1.0.2-dev\n"),
            Level::Warn
        );
        assert_eq!(level("runc version 1.2.7\n"), Level::Warn);
        assert_eq!(level("runc version 1.2.8\n"), Level::Ok);
        assert_eq!(level("runc version 1.3.2\n"), Level::Warn);
        assert_eq!(level("runc version 1.3.3\n"), Level::Ok);
        assert_eq!(level("runc version 1.4.0-rc.2\n"), Level::Ok);
        assert_eq!(level("runc version 1.5.1\n"), Level::Ok);
        assert_eq!(level("garbage"), Level::Warn);
        let missing = check_runc(&HostFacts {
            runc_version: Some(CmdOut::NotFound),
            ..HostFacts::default()
        });
        assert_eq!(missing.level, Level::Fail);
        assert!(missing.fix.unwrap().contains("1.2.8"));
    }

    #[test]
    fn driver_and_nvml_versions_are_read() {
        let f = HostFacts {
            driver_proc: Some("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\nGCC version:  gcc version 12.2.0\n".into()),
            smi_version: ran("NVIDIA-SMI version  : 550.54.15\nNVML version        : 550.54\nDRIVER version      : 550.54.15\nCUDA Version        : 12.4\n"),
            ..HostFacts::default()
        };
        let c = check_driver(&f);
        assert_eq!(c.level, Level::Ok);
        assert_eq!(c.detail, "kernel module 550.54.15, NVML 550.54");
        let none = check_driver(&HostFacts::default());
        assert_eq!(none.level, Level::Fail);
        assert!(none.fix.unwrap().contains("sim"));
    }

    #[test]
    fn mig_mode_per_gpu() {
        let f = |s: &str| HostFacts {
            smi_mig: ran(s),
            ..HostFacts::default()
        };
        let c = check_mig(&f(
            "0, NVIDIA H100 80GB HBM3, Enabled, Enabled\n1, NVIDIA A100-SXM4-40GB, Disabled, Disabled\n",
        ));
        assert_eq!(c.level, Level::Ok);
        assert_eq!(c.detail, "enabled on GPU 0; not on GPU 1 (Disabled)");
        let c = check_mig(&f("0, NVIDIA H100 80GB HBM3, Disabled, Enabled\n"));
        assert_eq!(c.level, Level::Warn);
        assert!(c.detail.contains("Disabled -> Enabled"), "{}", c.detail);
        let c = check_mig(&f("0, Tesla T4, [N/A], [N/A]\n"));
        assert_eq!(c.level, Level::Warn);
        assert_eq!(check_mig(&HostFacts::default()).level, Level::Fail);
    }

    #[test]
    fn caps_major_and_minors() {
        let f = HostFacts {
            proc_devices: Some(
                "Character devices:\n195 nvidia\n509 nvidia-caps\n510 nvidia-uvm\n".into(),
            ),
            mig_minors: Some("config 1\nmonitor 2\ngpu0/gi0/access 3\n".into()),
            ..HostFacts::default()
        };
        let c = check_caps(&f);
        assert_eq!(
            (c.level, c.detail.as_str()),
            (Level::Ok, "major 509, 3 mig-minors entries")
        );
        let no_minors = HostFacts {
            mig_minors: None,
            ..f
        };
        assert_eq!(check_caps(&no_minors).level, Level::Fail);
        assert_eq!(check_caps(&HostFacts::default()).level, Level::Fail);
    }

    #[test]
    fn cgroup_modes() {
        let level = |m: &str| {
            check_cgroup(&HostFacts {
                mounts: Some(m.into()),
                ..HostFacts::default()
            })
        };
        assert_eq!(
            level("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n").level,
            Level::Ok
        );
        let hybrid = level(
            "cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n",
        );
        assert_eq!(hybrid.level, Level::Warn);
        assert!(hybrid.detail.contains("hybrid"));
        assert_eq!(level("proc /proc proc rw 0 0\n").level, Level::Fail);
    }

    #[test]
    fn apparmor_needs_the_lsm_and_the_module() {
        let f = |lsm: Option<&str>, en: Option<&str>| {
            check_apparmor(&HostFacts {
                lsm: lsm.map(String::from),
                apparmor_enabled: en.map(String::from),
                ..HostFacts::default()
            })
            .level
        };
        assert_eq!(
            f(
                Some("lockdown,capability,landlock,yama,apparmor\n"),
                Some("Y\n")
            ),
            Level::Ok
        );
        assert_eq!(f(Some("lockdown,capability,selinux\n"), None), Level::Warn);
        assert_eq!(f(None, None), Level::Warn);
    }

    #[test]
    fn containerd_runtime_class() {
        let f = |text: Option<&str>| {
            check_containerd(&HostFacts {
                containerd_config: Some((
                    "/etc/containerd/config.toml".into(),
                    text.map(String::from),
                )),
                ..HostFacts::default()
            })
        };
        let good = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera]\n  runtime_type = \"io.containerd.runc.v2\"\n  [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera.options]\n    BinaryName = \"/usr/local/bin/tessera-runtime\"\n";
        assert_eq!(f(Some(good)).level, Level::Ok);
        let wrong = good.replace("tessera-runtime", "runc");
        assert_eq!(f(Some(&wrong)).level, Level::Fail);
        let none = f(Some("version = 2\n[plugins]\n"));
        assert_eq!(none.level, Level::Fail);
        assert!(none.fix.unwrap().contains("BinaryName"));
        assert_eq!(f(None).level, Level::Fail);
    }

    #[test]
    fn mps_directories_must_let_others_pass() {
        let f = |dir_mode, mps_dir_mode| {
            check_mps_dirs(&HostFacts {
                socket: Some(SocketFacts {
                    path: "/run/tessera/tesserad.sock".into(),
                    dir_mode,
                    mps_dir_mode,
                    ..SocketFacts::default()
                }),
                ..HostFacts::default()
            })
        };
        assert_eq!(f(Some(0o40751), Some(0o40711)).level, Level::Ok);
        // Not made yet (no MPS lease so far): nothing to say of it.
        assert_eq!(f(Some(0o40751), None).level, Level::Ok);
        // Either one closed to others: a warning naming it, and the fix.
        for (dir, mps, named) in [
            (0o40750, 0o40711, "/run/tessera mode 0750"),
            (0o40751, 0o40700, "/run/tessera/mps mode 0700"),
        ] {
            let c = f(Some(dir), Some(mps));
            assert_eq!(c.level, Level::Warn);
            assert!(c.detail.contains(named), "{}", c.detail);
            assert!(c.fix.unwrap().contains("0751"));
        }
    }

    #[test]
    fn socket_permissions() {
        let f = |stat: Option<SocketStat>| {
            check_socket(&HostFacts {
                socket: Some(SocketFacts {
                    path: "/run/tessera/tesserad.sock".into(),
                    stat,
                    ..SocketFacts::default()
                }),
                ..HostFacts::default()
            })
        };
        let st = SocketStat {
            is_socket: true,
            mode: 0o140660,
            group: Some("tessera".into()),
            connects: true,
        };
        assert_eq!(f(Some(st.clone())).level, Level::Ok);
        let world = f(Some(SocketStat {
            mode: 0o140666,
            ..st.clone()
        }));
        assert_eq!(world.level, Level::Fail);
        assert!(world.fix.unwrap().contains("0660"));
        assert_eq!(
            f(Some(SocketStat {
                group: Some("root".into()),
                ..st.clone()
            }))
            .level,
            Level::Warn
        );
        assert_eq!(
            f(Some(SocketStat {
                connects: false,
                ..st
            }))
            .level,
            Level::Fail
        );
        assert_eq!(f(None).level, Level::Fail);
    }

    #[test]
    fn render_prints_level_name_detail_and_fix() {
        let text = render(&[
            ok("runc", "1.2.8"),
            warn("AppArmor", "not active", "enable it"),
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "OK    runc      1.2.8");
        assert_eq!(lines[1], "WARN  AppArmor  not active");
        assert_eq!(lines[2], "                fix: enable it");
        assert_eq!(lines.last().unwrap(), &"1 ok, 1 warnings, 0 failures");
    }
}
