//! The host's side effects behind one trait, so the lease core can be tested and
//! replaced: stopping a container through its cgroup, the private directories of an
//! MPS lease (create, hand to a uid, remove), reading `/proc/devices`, and writing a
//! container's termination message.
//!
//! [`RealHost`] does them; [`RecordingHost`] records the calls and does nothing
//! (tests). Owns: the mechanics. May not touch: leases or policy (which cgroup may be
//! stopped is the lease core's decision). Imports nothing above `names`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

mod cgroup;

/// A host operation that failed, with what it was done to.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("container {container}: freezing {path}: {detail}")]
    Freeze {
        container: String,
        path: String,
        detail: String,
    },
    #[error("container {container}: {left} processes still in {path} after SIGKILL")]
    StillRunning {
        container: String,
        path: String,
        left: usize,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HostError + '_ {
    move |source| HostError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What stopping one container took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stopped {
    pub container: String,
    /// Processes that got SIGTERM.
    pub terminated: usize,
    /// Processes still there after the grace period, which got SIGKILL.
    pub killed: usize,
}

/// The host operations the lease core performs. All are blocking.
pub trait HostOps: Send + Sync + std::fmt::Debug {
    /// Stop every process in the cgroup `rel` (relative to the hierarchy roots):
    /// SIGTERM, then SIGKILL after `grace`.
    fn stop_cgroup(
        &self,
        container: &str,
        rel: &str,
        grace: Duration,
    ) -> Result<Stopped, HostError>;
    /// Create a directory (and parents) with mode 0700.
    fn create_private_dir(&self, dir: &Path) -> Result<(), HostError>;
    /// Hand a directory to `uid` (its group unchanged).
    fn chown(&self, path: &Path, uid: u32) -> Result<(), HostError>;
    /// Remove a directory tree; one that is already gone is not an error.
    fn remove_dir_all(&self, dir: &Path) -> Result<(), HostError>;
    /// The text of `/proc/devices`.
    fn proc_devices(&self) -> Result<String, HostError>;
    /// Replace the contents of a container's termination-message file (a host
    /// path: the source of kubelet's bind mount) with `message`. The file must
    /// exist and be a regular file; no component of the path may be a symlink.
    fn write_termination_message(&self, path: &Path, message: &str) -> Result<(), HostError>;
    /// Whether the runtime still keeps state for container `id` under `root` (runc's
    /// `<root>/<id>`, from create to delete). Unsure (a bad name, an error other than
    /// "not there") answers true: a binding is dropped only when its container is
    /// certainly gone.
    fn runtime_state_exists(&self, root: &Path, id: &str) -> bool;
}

/// kubelet reads at most this much of a termination message.
pub const TERMINATION_MESSAGE_MAX: usize = 4096;

/// Open an existing regular file for writing without following any symlink on the
/// way (openat2 RESOLVE_NO_SYMLINKS; O_NOFOLLOW on the last component where the
/// kernel lacks openat2), without blocking on a FIFO.
fn open_no_symlinks(path: &Path) -> std::io::Result<std::fs::File> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    use std::os::fd::FromRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    if !path.is_absolute() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not an absolute path",
        ));
    }
    let flags = OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
    let how = OpenHow::new()
        .flags(flags)
        .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    match nix::fcntl::openat2(libc::AT_FDCWD, path, how) {
        // SAFETY: openat2 returned a new descriptor that nothing else owns.
        Ok(fd) => Ok(unsafe { std::fs::File::from_raw_fd(fd) }),
        Err(nix::errno::Errno::ENOSYS) => std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path),
        Err(e) => Err(std::io::Error::from(e)),
    }
}

fn write_termination_message(path: &Path, message: &str) -> Result<(), HostError> {
    use std::io::Write;
    let f = open_no_symlinks(path).map_err(io(path))?;
    let meta = f.metadata().map_err(io(path))?;
    if !meta.is_file() {
        return Err(io(path)(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        )));
    }
    // A kernel file (/proc/sys, sysfs, a cgroup) is a regular file too: never one.
    use nix::sys::statfs as fs;
    let kind = fs::fstatfs(&f)
        .map_err(|e| io(path)(e.into()))?
        .filesystem_type();
    let kernel = [
        fs::PROC_SUPER_MAGIC,
        fs::SYSFS_MAGIC,
        fs::CGROUP_SUPER_MAGIC,
        fs::CGROUP2_SUPER_MAGIC,
        fs::DEBUGFS_MAGIC,
        fs::TRACEFS_MAGIC,
        fs::SECURITYFS_MAGIC,
        fs::SELINUX_MAGIC,
        fs::BPF_FS_MAGIC,
        fs::DEVPTS_SUPER_MAGIC,
        fs::NSFS_MAGIC,
    ];
    if kernel.contains(&kind) {
        return Err(io(path)(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a kernel filesystem's file, not a termination message",
        )));
    }
    let mut end = message.len().min(TERMINATION_MESSAGE_MAX);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    f.set_len(0).map_err(io(path))?;
    (&f).write_all(&message.as_bytes()[..end]).map_err(io(path))
}

/// The real host.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealHost;

impl HostOps for RealHost {
    fn stop_cgroup(
        &self,
        container: &str,
        rel: &str,
        grace: Duration,
    ) -> Result<Stopped, HostError> {
        cgroup::stop_cgroup(container, rel, grace)
    }

    fn create_private_dir(&self, dir: &Path) -> Result<(), HostError> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .and_then(|_| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)))
            .map_err(io(dir))
    }

    fn chown(&self, path: &Path, uid: u32) -> Result<(), HostError> {
        std::os::unix::fs::chown(path, Some(uid), None).map_err(io(path))
    }

    fn remove_dir_all(&self, dir: &Path) -> Result<(), HostError> {
        match std::fs::remove_dir_all(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(dir)(e)),
            _ => Ok(()),
        }
    }

    fn proc_devices(&self) -> Result<String, HostError> {
        let path = Path::new("/proc/devices");
        std::fs::read_to_string(path).map_err(io(path))
    }

    fn write_termination_message(&self, path: &Path, message: &str) -> Result<(), HostError> {
        write_termination_message(path, message)
    }

    fn runtime_state_exists(&self, root: &Path, id: &str) -> bool {
        if !root.is_absolute() || id.is_empty() || id.contains('/') || id == "." || id == ".." {
            return true;
        }
        match std::fs::symlink_metadata(root.join(id)) {
            Err(e) => e.kind() != std::io::ErrorKind::NotFound,
            Ok(_) => true,
        }
    }
}

/// One call a [`RecordingHost`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostCall {
    StopCgroup { container: String, rel: String },
    CreatePrivateDir(PathBuf),
    Chown { path: PathBuf, uid: u32 },
    RemoveDirAll(PathBuf),
    ProcDevices,
    TerminationMessage { path: PathBuf, message: String },
}

/// Tests: records every call, touches nothing, and answers `/proc/devices` with the
/// text it was given. `stop_cgroup` reports one process terminated.
#[derive(Debug, Default)]
pub struct RecordingHost {
    calls: Mutex<Vec<HostCall>>,
    proc_devices: String,
    /// Containers whose runtime state is gone (every other one exists).
    gone: Mutex<Vec<String>>,
}

impl RecordingHost {
    pub fn with_proc_devices(text: &str) -> RecordingHost {
        RecordingHost {
            calls: Mutex::default(),
            proc_devices: text.to_string(),
            gone: Mutex::default(),
        }
    }

    /// From now on, container `id`'s runtime state is gone.
    pub fn container_gone(&self, id: &str) {
        self.gone
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(id.to_string());
    }

    /// The calls so far, oldest first.
    pub fn calls(&self) -> Vec<HostCall> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn record(&self, c: HostCall) {
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).push(c);
    }
}

impl HostOps for RecordingHost {
    fn stop_cgroup(&self, container: &str, rel: &str, _: Duration) -> Result<Stopped, HostError> {
        self.record(HostCall::StopCgroup {
            container: container.into(),
            rel: rel.into(),
        });
        Ok(Stopped {
            container: container.into(),
            terminated: 1,
            killed: 0,
        })
    }
    fn create_private_dir(&self, dir: &Path) -> Result<(), HostError> {
        self.record(HostCall::CreatePrivateDir(dir.into()));
        Ok(())
    }
    fn chown(&self, path: &Path, uid: u32) -> Result<(), HostError> {
        self.record(HostCall::Chown {
            path: path.into(),
            uid,
        });
        Ok(())
    }
    fn remove_dir_all(&self, dir: &Path) -> Result<(), HostError> {
        self.record(HostCall::RemoveDirAll(dir.into()));
        Ok(())
    }
    fn proc_devices(&self) -> Result<String, HostError> {
        self.record(HostCall::ProcDevices);
        Ok(self.proc_devices.clone())
    }
    fn runtime_state_exists(&self, _: &Path, id: &str) -> bool {
        !self
            .gone
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|g| g == id)
    }
    fn write_termination_message(&self, path: &Path, message: &str) -> Result<(), HostError> {
        self.record(HostCall::TerminationMessage {
            path: path.into(),
            message: message.into(),
        });
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn private_dirs_are_0700_and_removal_of_a_missing_tree_is_fine() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("a/b");
        RealHost.create_private_dir(&d).unwrap();
        let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        RealHost.remove_dir_all(&dir.path().join("a")).unwrap();
        assert!(!d.exists());
        RealHost.remove_dir_all(&dir.path().join("a")).unwrap();
        let e = RealHost.chown(&d, 1).unwrap_err();
        assert!(
            e.to_string().contains("a/b"),
            "the error names its path: {e}"
        );
    }

    #[test]
    fn a_termination_message_replaces_the_file_and_never_follows_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("termination-log");
        std::fs::write(&file, "an older and longer message").unwrap();
        RealHost
            .write_termination_message(&file, "tessera: lease l-1 revoked: admin")
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "tessera: lease l-1 revoked: admin"
        );
        let long = "x".repeat(10_000);
        RealHost.write_termination_message(&file, &long).unwrap();
        assert_eq!(std::fs::read(&file).unwrap().len(), TERMINATION_MESSAGE_MAX);
        // A symlink, as the last component or on the way, is not followed.
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "keep").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(RealHost.write_termination_message(&link, "no").is_err());
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join("elsewhere"), "keep").unwrap();
        let dirlink = dir.path().join("dirlink");
        std::os::unix::fs::symlink(&sub, &dirlink).unwrap();
        assert!(
            RealHost
                .write_termination_message(&dirlink.join("elsewhere"), "no")
                .is_err()
        );
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        assert_eq!(
            std::fs::read_to_string(sub.join("elsewhere")).unwrap(),
            "keep"
        );
        // Nothing is created, and a directory is not a message file.
        assert!(
            RealHost
                .write_termination_message(&dir.path().join("absent"), "no")
                .is_err()
        );
        assert!(!dir.path().join("absent").exists());
        assert!(RealHost.write_termination_message(&sub, "no").is_err());
        // A kernel file is a regular file too (this process's own name: harmless).
        let comm = std::path::PathBuf::from(format!("/proc/{}/comm", std::process::id()));
        let before = std::fs::read_to_string(&comm).unwrap();
        let e = RealHost.write_termination_message(&comm, "no").unwrap_err();
        assert!(e.to_string().contains("kernel filesystem"), "{e}");
        assert_eq!(std::fs::read_to_string(&comm).unwrap(), before);
    }
}
