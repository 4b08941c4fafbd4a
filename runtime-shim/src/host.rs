//! The host as the hardening reads it, behind one trait ([`HostView`]) that tests
//! replace: facts read once from host paths (never from a container's rootfs: AppArmor,
//! GPU device majors, and the driver's /proc entries, for masking), and the host paths
//! a spec names (bind sources, device nodes, namespace files, the bundle), looked at
//! without following anything into a rootfs. [`HostFacts`] is this host;
//! [`RecordingHost`] wraps another view, records every path it is asked about and can
//! answer for some paths itself.

use crate::bundle::BundleError;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The host as the hardening sees it. Every read of the host the hardening makes goes
/// through this trait, so that `harden` is a function of (spec, grant, host view).
pub trait HostView: std::fmt::Debug {
    /// AppArmor on this host.
    fn apparmor(&self) -> &AppArmorHost;
    /// The majors of the host's "nvidia*" character devices.
    fn gpu_majors(&self) -> &[i64];
    /// The driver's GPUs (`<nvidia_proc_root>/gpus/`): bus id and device minor.
    fn nvidia_gpus(&self) -> &[(String, Option<i64>)];
    /// The driver's capability files, relative to `<nvidia_proc_root>/capabilities/`.
    fn nvidia_capabilities(&self) -> &[String];
    /// `lstat(2)` of a host path (a symlink is described, not followed).
    fn lstat(&self, path: &Path) -> std::io::Result<PathInfo>;
    /// `stat(2)` of a host path (symlinks followed).
    fn stat(&self, path: &Path) -> std::io::Result<PathInfo>;
    /// The host path with every symlink resolved.
    fn canonicalize(&self, path: &Path) -> std::io::Result<PathBuf>;
    /// Whether (dev, ino) is the host's namespace of OCI type `ty` ([`is_host_namespace`]).
    fn is_host_namespace(&self, ty: &str, dev: u64, ino: u64) -> std::io::Result<bool>;
    /// A live process's start time ([`proc_start_time`]).
    fn proc_start_time(&self, pid: u32) -> Option<u64>;
    /// The text of a host file (a cgroup's `cgroup.procs`, `/proc/self/mountinfo`).
    fn read_to_string(&self, path: &Path) -> std::io::Result<String>;
    /// The entries of a host directory (a runc root, a cgroup, `/proc`).
    fn read_dir(&self, path: &Path) -> std::io::Result<Vec<HostEntry>>;
    /// A regular host file read without following a symlink at its last component,
    /// at most `max` bytes, with its permission bits ([`crate::bundle::read_with_mode`]).
    fn read_file(&self, path: &Path, max: u64) -> Result<(Vec<u8>, u32), BundleError>;
}

/// Why a host path is not one only root can change.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is owned by uid {uid}, not root", path.display())]
    NotRoot { path: PathBuf, uid: u32 },
    #[error("{} is writable by others (mode {mode:o})", path.display())]
    Writable { path: PathBuf, mode: u32 },
}

/// An entry of a host directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    pub name: String,
    pub path: PathBuf,
    /// A directory (not a symlink to one).
    pub is_dir: bool,
}

/// What a host path is: the part of its metadata the hardening judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathInfo {
    pub kind: PathKind,
    pub uid: u32,
    /// The mode bits, file type included (as `st_mode`).
    pub mode: u32,
    pub dev: u64,
    pub ino: u64,
    /// The device number of a device node.
    pub rdev: u64,
}

/// The type of a host path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    Dir,
    File,
    Symlink,
    CharDevice,
    BlockDevice,
    Other,
}

impl PathInfo {
    /// What `m` says.
    pub fn of(m: &std::fs::Metadata) -> Self {
        let t = m.file_type();
        let kind = if t.is_dir() {
            PathKind::Dir
        } else if t.is_file() {
            PathKind::File
        } else if t.is_symlink() {
            PathKind::Symlink
        } else if t.is_char_device() {
            PathKind::CharDevice
        } else if t.is_block_device() {
            PathKind::BlockDevice
        } else {
            PathKind::Other
        };
        Self {
            kind,
            uid: m.uid(),
            mode: m.mode(),
            dev: m.dev(),
            ino: m.ino(),
            rdev: m.rdev(),
        }
    }
    pub fn uid(&self) -> u32 {
        self.uid
    }
    pub fn mode(&self) -> u32 {
        self.mode
    }
    pub fn dev(&self) -> u64 {
        self.dev
    }
    pub fn ino(&self) -> u64 {
        self.ino
    }
    pub fn rdev(&self) -> u64 {
        self.rdev
    }
    pub fn is_dir(&self) -> bool {
        self.kind == PathKind::Dir
    }
    pub fn is_file(&self) -> bool {
        self.kind == PathKind::File
    }
    pub fn is_symlink(&self) -> bool {
        self.kind == PathKind::Symlink
    }
    pub fn is_char_device(&self) -> bool {
        self.kind == PathKind::CharDevice
    }
}

impl HostView for HostFacts {
    fn apparmor(&self) -> &AppArmorHost {
        &self.apparmor
    }
    fn gpu_majors(&self) -> &[i64] {
        HostFacts::gpu_majors(self)
    }
    fn nvidia_gpus(&self) -> &[(String, Option<i64>)] {
        &self.nvidia_gpus
    }
    fn nvidia_capabilities(&self) -> &[String] {
        &self.nvidia_capabilities
    }
    fn lstat(&self, path: &Path) -> std::io::Result<PathInfo> {
        std::fs::symlink_metadata(path).map(|m| PathInfo::of(&m))
    }
    fn stat(&self, path: &Path) -> std::io::Result<PathInfo> {
        std::fs::metadata(path).map(|m| PathInfo::of(&m))
    }
    fn canonicalize(&self, path: &Path) -> std::io::Result<PathBuf> {
        std::fs::canonicalize(path)
    }
    fn is_host_namespace(&self, ty: &str, dev: u64, ino: u64) -> std::io::Result<bool> {
        is_host_namespace(ty, dev, ino)
    }
    fn proc_start_time(&self, pid: u32) -> Option<u64> {
        proc_start_time(pid)
    }
    fn read_to_string(&self, path: &Path) -> std::io::Result<String> {
        std::fs::read_to_string(path)
    }
    fn read_dir(&self, path: &Path) -> std::io::Result<Vec<HostEntry>> {
        Ok(std::fs::read_dir(path)?
            .flatten()
            .map(|e| HostEntry {
                name: e.file_name().to_string_lossy().into_owned(),
                path: e.path(),
                is_dir: e.file_type().is_ok_and(|t| t.is_dir()),
            })
            .collect())
    }
    fn read_file(&self, path: &Path, max: u64) -> Result<(Vec<u8>, u32), BundleError> {
        crate::bundle::read_with_mode(path, max)
    }
}

/// A host view for tests: answers from `inner`, except for the paths given an answer
/// of their own ([`RecordingHost::with_path`]), and records every path asked about.
#[derive(Debug)]
pub struct RecordingHost<H> {
    pub inner: H,
    /// Paths answered here: `lstat` and `stat` say this (a missing path: `None`).
    given: BTreeMap<PathBuf, Option<PathInfo>>,
    asked: RefCell<Vec<PathBuf>>,
}

impl<H: HostView> RecordingHost<H> {
    pub fn new(inner: H) -> Self {
        Self {
            inner,
            given: BTreeMap::new(),
            asked: RefCell::new(Vec::new()),
        }
    }

    /// Answer for `path` with `info` (`None`: it does not exist).
    #[must_use]
    pub fn with_path(mut self, path: impl Into<PathBuf>, info: Option<PathInfo>) -> Self {
        self.given.insert(path.into(), info);
        self
    }

    /// Every path asked about, in order.
    pub fn asked(&self) -> Vec<PathBuf> {
        self.asked.borrow().clone()
    }

    fn answer(
        &self,
        path: &Path,
        real: impl FnOnce() -> std::io::Result<PathInfo>,
    ) -> std::io::Result<PathInfo> {
        self.asked.borrow_mut().push(path.to_path_buf());
        match self.given.get(path) {
            Some(Some(info)) => Ok(*info),
            Some(None) => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
            None => real(),
        }
    }
}

impl<H: HostView> HostView for RecordingHost<H> {
    fn apparmor(&self) -> &AppArmorHost {
        self.inner.apparmor()
    }
    fn gpu_majors(&self) -> &[i64] {
        self.inner.gpu_majors()
    }
    fn nvidia_gpus(&self) -> &[(String, Option<i64>)] {
        self.inner.nvidia_gpus()
    }
    fn nvidia_capabilities(&self) -> &[String] {
        self.inner.nvidia_capabilities()
    }
    fn lstat(&self, path: &Path) -> std::io::Result<PathInfo> {
        self.answer(path, || self.inner.lstat(path))
    }
    fn stat(&self, path: &Path) -> std::io::Result<PathInfo> {
        self.answer(path, || self.inner.stat(path))
    }
    fn canonicalize(&self, path: &Path) -> std::io::Result<PathBuf> {
        self.asked.borrow_mut().push(path.to_path_buf());
        match self.given.get(path) {
            Some(Some(_)) => Ok(path.to_path_buf()),
            Some(None) => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
            None => self.inner.canonicalize(path),
        }
    }
    fn is_host_namespace(&self, ty: &str, dev: u64, ino: u64) -> std::io::Result<bool> {
        self.inner.is_host_namespace(ty, dev, ino)
    }
    fn proc_start_time(&self, pid: u32) -> Option<u64> {
        self.inner.proc_start_time(pid)
    }
    fn read_to_string(&self, path: &Path) -> std::io::Result<String> {
        self.asked.borrow_mut().push(path.to_path_buf());
        self.inner.read_to_string(path)
    }
    fn read_dir(&self, path: &Path) -> std::io::Result<Vec<HostEntry>> {
        self.asked.borrow_mut().push(path.to_path_buf());
        self.inner.read_dir(path)
    }
    fn read_file(&self, path: &Path, max: u64) -> Result<(Vec<u8>, u32), BundleError> {
        self.asked.borrow_mut().push(path.to_path_buf());
        self.inner.read_file(path, max)
    }
}

/// What the host offers of AppArmor.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AppArmorHost {
    /// The LSM is enabled (/sys/module/apparmor/parameters/enabled is "Y").
    pub enabled: bool,
    /// Names of loaded profiles, when readable.
    pub loaded: Option<Vec<String>>,
}

/// OCI namespace type -> the name under `/proc/<pid>/ns/`.
pub fn proc_name(oci: &str) -> Option<&'static str> {
    Some(match oci {
        "pid" => "pid",
        "network" => "net",
        "mount" => "mnt",
        "ipc" => "ipc",
        "uts" => "uts",
        "user" => "user",
        "cgroup" => "cgroup",
        "time" => "time",
        _ => return None,
    })
}

/// A live process's start time (clock ticks after boot), from /proc/<pid>/stat;
/// `None` when it is gone or a zombie (dead, not yet reaped: its namespaces are gone).
pub fn proc_start_time(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = text.rsplit_once(')')?;
    // After the command: field 3 (state) onwards; the start time is field 22.
    let mut fields = rest.split_whitespace();
    if matches!(fields.next(), Some("Z" | "X" | "x")) {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// What the hardening knows about the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    pub apparmor: AppArmorHost,
    /// Majors of the "nvidia*" character devices in /proc/devices, read the first time
    /// a check needs them (a spec with device nodes or device cgroup rules of its own;
    /// most have neither): the kernel formats every driver's line on each read of that
    /// file, 0.07-0.09 ms of a container start.
    gpu_majors: std::cell::OnceCell<Vec<i64>>,
    /// Entries of `<nvidia_proc_root>/gpus/`: name (PCI bus id) and device minor, when
    /// the `information` file says.
    pub nvidia_gpus: Vec<(String, Option<i64>)>,
    /// Files below `<nvidia_proc_root>/capabilities/`, relative ("gpu0/mig/gi1/access").
    pub nvidia_capabilities: Vec<String>,
}

impl HostFacts {
    /// Read the facts from this host.
    pub fn gather(nvidia_proc_root: &Path) -> Self {
        Self {
            apparmor: apparmor_host(),
            gpu_majors: std::cell::OnceCell::new(),
            nvidia_gpus: nvidia_gpus(&nvidia_proc_root.join("gpus")),
            nvidia_capabilities: nvidia_capabilities(&nvidia_proc_root.join("capabilities")),
        }
    }

    /// The majors of the host's "nvidia*" character devices (/proc/devices, read once).
    pub fn gpu_majors(&self) -> &[i64] {
        self.gpu_majors.get_or_init(|| {
            read_proc("/proc/devices")
                .map(|t| nvidia_majors(&t))
                .unwrap_or_default()
        })
    }

    /// These facts with the GPU majors given rather than read (tests).
    pub fn with_gpu_majors(self, majors: Vec<i64>) -> Self {
        Self {
            gpu_majors: std::cell::OnceCell::from(majors),
            ..self
        }
    }

    /// These facts with AppArmor's state given rather than read (tests).
    pub fn with_apparmor(self, apparmor: AppArmorHost) -> Self {
        Self { apparmor, ..self }
    }
}

/// Whether (dev, ino) is the host's namespace of type `ty` (an OCI type): the runtime's
/// own, which containerd, CRI-O and podman start in the host's namespaces. Read when a
/// spec names a namespace path, not on every start (most specs name none). `Err` when
/// the type is unknown or the runtime's own namespace cannot be read: the caller refuses.
pub fn is_host_namespace(ty: &str, dev: u64, ino: u64) -> std::io::Result<bool> {
    let name = proc_name(ty).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("unknown namespace type {ty:?}"),
        )
    })?;
    let own = format!("/proc/self/ns/{name}");
    let m = std::fs::metadata(&own)
        .map_err(|e| std::io::Error::new(e.kind(), format!("the host's own {own}: {e}")))?;
    Ok((m.dev(), m.ino()) == (dev, ino))
}

/// Whether every ancestor of `path` (and `path` itself) is owned by root and not
/// writable by group or others (a sticky directory, like /tmp, may be world-writable):
/// then nothing but root can swap a component between the check and runc's mount.
pub fn root_owned_chain(host: &dyn HostView, path: &Path) -> Result<(), ChainError> {
    let mut cur = Some(path);
    while let Some(p) = cur {
        let m = host.lstat(p).map_err(|source| ChainError::Io {
            path: p.to_path_buf(),
            source,
        })?;
        if m.uid() != 0 {
            return Err(ChainError::NotRoot {
                path: p.to_path_buf(),
                uid: m.uid(),
            });
        }
        let mode = m.mode();
        let sticky = mode & 0o1000 != 0;
        if mode & 0o022 != 0 && !(sticky && m.is_dir()) {
            return Err(ChainError::Writable {
                path: p.to_path_buf(),
                mode: mode & 0o7777,
            });
        }
        cur = p.parent();
    }
    Ok(())
}

/// A /proc file (its size shows as 0) read with a page-sized buffer: the kernel makes
/// the whole text again for each read, and `read_to_string` starts with 32 bytes.
fn read_proc(path: &str) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::with_capacity(8192);
    std::fs::File::open(path)?.read_to_string(&mut text)?;
    Ok(text)
}

fn apparmor_host() -> AppArmorHost {
    let enabled = std::fs::read_to_string("/sys/module/apparmor/parameters/enabled")
        .is_ok_and(|s| s.trim() == "Y");
    let loaded = std::fs::read_to_string("/sys/kernel/security/apparmor/profiles")
        .ok()
        .map(|t| {
            t.lines()
                .filter_map(|l| l.rsplit_once(" (").map(|(n, _)| n.to_string()))
                .collect()
        });
    AppArmorHost { enabled, loaded }
}

/// The majors of "nvidia*" character devices in /proc/devices text.
pub fn nvidia_majors(proc_devices: &str) -> Vec<i64> {
    let mut in_char = false;
    let mut out = Vec::new();
    for line in proc_devices.lines() {
        let line = line.trim();
        if line.starts_with("Character devices") {
            in_char = true;
            continue;
        }
        if line.starts_with("Block devices") {
            in_char = false;
            continue;
        }
        if !in_char {
            continue;
        }
        if let Some((major, name)) = line.split_once(char::is_whitespace)
            && name.trim().starts_with("nvidia")
            && let Ok(m) = major.parse()
        {
            out.push(m);
        }
    }
    out
}

/// The GPU entries of a driver `gpus/` directory.
pub fn nvidia_gpus(dir: &Path) -> Vec<(String, Option<i64>)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Option<i64>)> = rd
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let minor = std::fs::read_to_string(e.path().join("information"))
                .ok()
                .and_then(|t| {
                    t.lines().find_map(|l| {
                        l.strip_prefix("Device Minor:")
                            .and_then(|v| v.trim().parse().ok())
                    })
                });
            (name, minor)
        })
        .collect();
    out.sort();
    out
}

/// Every file below a driver `capabilities/` directory, relative, at most 6 levels deep.
pub fn nvidia_capabilities(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, rel: &str, depth: usize, out: &mut Vec<String>) {
        if depth > 6 {
            return;
        }
        let Ok(rd) = std::fs::read_dir(base.join(rel)) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let r = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            match e.file_type() {
                Ok(t) if t.is_dir() => walk(base, &r, depth + 1, out),
                Ok(_) => out.push(r),
                Err(_) => {}
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, "", 0, &mut out);
    out.sort();
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn majors_from_proc_devices() {
        let t = "Character devices:\n  1 mem\n195 nvidia-frontend\n 508 nvidia-uvm\n 235 nvidia-caps\n\nBlock devices:\n  8 sd\n 9 nvidia-fake-block\n";
        assert_eq!(nvidia_majors(t), vec![195, 508, 235]);
    }

    #[test]
    fn gpu_majors_are_read_when_first_asked_and_can_be_given() {
        let f = HostFacts::gather(Path::new("/nonexistent"));
        assert!(f.gpu_majors.get().is_none(), "not read at gather");
        let text = read_proc("/proc/devices").unwrap();
        assert_eq!(f.gpu_majors(), nvidia_majors(&text));
        assert!(f.gpu_majors.get().is_some());
        let given = HostFacts::gather(Path::new("/nonexistent")).with_gpu_majors(vec![508]);
        assert_eq!(given.gpu_majors(), [508]);
    }

    #[test]
    fn driver_proc_tree() {
        let d = tempfile::tempdir().unwrap();
        for (bus, minor) in [("0000:3b:00.0", 0), ("0000:5e:00.0", 1)] {
            std::fs::create_dir_all(d.path().join("gpus").join(bus)).unwrap();
            std::fs::write(
                d.path().join("gpus").join(bus).join("information"),
                format!("Model: H100\nDevice Minor: {minor}\n"),
            )
            .unwrap();
        }
        std::fs::create_dir_all(d.path().join("gpus/0000:86:00.0")).unwrap();
        std::fs::create_dir_all(d.path().join("capabilities/gpu0/mig/gi1/ci0")).unwrap();
        std::fs::create_dir_all(d.path().join("capabilities/mig")).unwrap();
        std::fs::write(d.path().join("capabilities/mig/config"), "").unwrap();
        std::fs::write(d.path().join("capabilities/gpu0/mig/gi1/access"), "").unwrap();
        std::fs::write(d.path().join("capabilities/gpu0/mig/gi1/ci0/access"), "").unwrap();
        let f = HostFacts::gather(d.path());
        assert_eq!(
            f.nvidia_gpus,
            vec![
                ("0000:3b:00.0".to_string(), Some(0)),
                ("0000:5e:00.0".to_string(), Some(1)),
                ("0000:86:00.0".to_string(), None)
            ]
        );
        assert_eq!(
            f.nvidia_capabilities,
            [
                "gpu0/mig/gi1/access",
                "gpu0/mig/gi1/ci0/access",
                "mig/config"
            ]
        );
    }

    #[test]
    fn the_runtimes_own_namespaces_are_the_hosts_and_others_are_not() {
        let own = std::fs::metadata("/proc/self/ns/net").unwrap();
        assert!(is_host_namespace("network", own.dev(), own.ino()).unwrap());
        // The same inode under another type, and another namespace's inode, are not.
        assert!(!is_host_namespace("ipc", own.dev(), own.ino()).unwrap());
        let ipc = std::fs::metadata("/proc/self/ns/ipc").unwrap();
        assert!(!is_host_namespace("network", ipc.dev(), ipc.ino()).unwrap());
        let err = is_host_namespace("no-such-type", own.dev(), own.ino()).unwrap_err();
        assert!(err.to_string().contains("no-such-type"), "{err}");
    }
}
