//! How the runtime ends: exec the real runc as a plan says, run it as a child and exit
//! as it did, or exit with a code. What every command returns to `main`.

use std::path::{Path, PathBuf};
use thiserror::Error;

/// Exit code for a bad runtime config or seccomp profile (EX_USAGE-like: 64).
pub const EXIT_CONFIG: i32 = 64;
/// Exit code for a refusal.
pub const EXIT_REFUSED: i32 = 1;
/// The PATH runc gets.
pub const RUNC_PATH_ENV: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How to exec the real runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecPlan {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// File descriptors 0..=keep_fds_through stay open; the rest are closed on exec.
    pub keep_fds_through: i32,
    /// One more descriptor, above `keep_fds_through`, that runc inherits: the
    /// runtime's own document (exec's process, update's resources) that `args` name
    /// as `/proc/self/fd/N`.
    pub inherit_fd: Option<i32>,
}

/// What `main` must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Exec(ExecPlan),
    Exit(i32),
    /// runc was started as a child ([`crate::early`]) and ended so: exit as it did.
    Mirror(std::process::ExitStatus),
}

/// Why the configured real runtime is not run.
#[derive(Debug, Error)]
pub enum RuntimeBinaryError {
    #[error("the real runtime {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the real runtime {} is not an executable file", .0.display())]
    NotExecutable(PathBuf),
    #[error("the real runtime {} is writable by others than root", .0.display())]
    Writable(PathBuf),
}

/// The real runtime must be a regular executable file that only its owner (root or the
/// caller) can change: it runs as root with the container's bundle.
pub fn check_runtime_binary(path: &Path) -> Result<(), RuntimeBinaryError> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).map_err(|source| RuntimeBinaryError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let euid = nix::unistd::geteuid().as_raw();
    if !m.is_file() || m.mode() & 0o111 == 0 {
        return Err(RuntimeBinaryError::NotExecutable(path.to_path_buf()));
    }
    if m.mode() & 0o022 != 0 || (m.uid() != 0 && m.uid() != euid) {
        return Err(RuntimeBinaryError::Writable(path.to_path_buf()));
    }
    Ok(())
}

/// Exec the plan: mark every fd above `keep_fds_through` close-on-exec (but the
/// runtime's own document runc is to read), clear the environment, exec. Returns only
/// on failure.
pub fn exec_plan(plan: &ExecPlan) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    close_fds_above(plan.keep_fds_through);
    if let Some(fd) = plan.inherit_fd {
        // SAFETY: F_SETFD only changes the close-on-exec flag of a descriptor number
        // this process opened for runc (Session::own_document); nothing is read or freed.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } != 0 {
            return std::io::Error::last_os_error();
        }
    }
    let err = std::process::Command::new(&plan.program)
        .arg0("runc")
        .args(&plan.args)
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k, v)))
        .exec();
    std::io::Error::new(
        err.kind(),
        format!("exec {}: {err}", plan.program.display()),
    )
}

pub(crate) fn close_fds_above(keep: i32) {
    // One call on Linux >= 5.11; older kernels (ENOSYS, EINVAL) walk /proc/self/fd.
    if let Ok(first) = u32::try_from(keep.saturating_add(1)) {
        // SAFETY: close_range with CLOSE_RANGE_CLOEXEC closes nothing: it only sets the
        // close-on-exec flag of the open descriptors in [first, u32::MAX].
        let rc =
            unsafe { libc::close_range(first, u32::MAX, libc::CLOSE_RANGE_CLOEXEC as libc::c_int) };
        if rc == 0 {
            return;
        }
    }
    let Ok(rd) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = rd
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
        .filter(|fd| *fd > keep)
        .collect();
    for fd in fds {
        // SAFETY: F_SETFD only sets the close-on-exec flag of a descriptor number; a number
        // that is no longer open (the read_dir's own fd) just fails with EBADF.
        unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
}
