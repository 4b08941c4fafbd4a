//! runc's `--preserve-fds`: which descriptors pass on into the container.

use crate::cli::SubArgs;
use thiserror::Error;

/// Why a `--preserve-fds` is refused.
#[derive(Debug, Error)]
pub enum FdError {
    #[error("--preserve-fds {0:?} is not a small number")]
    NotSmall(String),
    #[error("--preserve-fds: /dev/null: {0}")]
    DevNull(std::io::Error),
    #[error("--preserve-fds: fd {fd}: {source}")]
    Io { fd: i32, source: std::io::Error },
    #[error("--preserve-fds: fd {0} is an O_PATH descriptor: refused")]
    OPath(i32),
    #[error(
        "--preserve-fds: fd {0} is a directory: it would reach the host's filesystem from the container"
    )]
    Directory(i32),
    #[error(
        "--preserve-fds: fd {0} is a regular file: only sockets, pipes and character devices are passed on"
    )]
    RegularFile(i32),
    #[error("--preserve-fds: fd {0} is not a socket, pipe or character device")]
    Other(i32),
}

impl FdError {
    fn last_os(fd: i32) -> Self {
        Self::Io {
            fd,
            source: std::io::Error::last_os_error(),
        }
    }
}

/// How many descriptors above stderr the caller passes on (`--preserve-fds`), each
/// checked to be one a container may have ([`preserved_fd_ok`]).
pub fn preserve_fds(sub: &SubArgs) -> Result<i32, FdError> {
    let n = match sub.value("preserve-fds") {
        None => return Ok(0),
        Some(v) => v
            .parse::<i32>()
            .ok()
            .filter(|n| (0..=1024).contains(n))
            .ok_or_else(|| FdError::NotSmall(v.to_string()))?,
    };
    for fd in 3..3 + n {
        preserved_fd_ok(fd)?;
    }
    Ok(n)
}

/// A descriptor passed on into the container (`--preserve-fds`) must be a socket, a
/// pipe or a character device opened for I/O: a directory or a regular file (or an
/// `O_PATH` descriptor of anything) would give the container a handle on the host's
/// filesystem outside its rootfs.
fn preserved_fd_ok(fd: i32) -> Result<(), FdError> {
    // SAFETY: fcntl F_GETFL reads the flags of a descriptor number; it changes nothing.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return hold_with_null(fd);
    }
    if flags & libc::O_PATH != 0 {
        return Err(FdError::OPath(fd));
    }
    // SAFETY: `st` is a plain C struct that fstat fills in for a descriptor number.
    let (rc, mode) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(fd, &mut st), st.st_mode)
    };
    if rc != 0 {
        return Err(FdError::last_os(fd));
    }
    match mode & libc::S_IFMT {
        libc::S_IFSOCK | libc::S_IFIFO | libc::S_IFCHR => Ok(()),
        libc::S_IFDIR => Err(FdError::Directory(fd)),
        libc::S_IFREG => Err(FdError::RegularFile(fd)),
        _ => Err(FdError::Other(fd)),
    }
}

/// A preserved descriptor that is not open: /dev/null is put there, so that no file the
/// runtime opens later takes that number and is passed on to the container.
fn hold_with_null(fd: i32) -> Result<(), FdError> {
    use std::os::fd::AsRawFd;
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(FdError::DevNull)?;
    if null.as_raw_fd() == fd {
        // Opened on that very number (the lowest free one): kept open, and
        // inherited by runc.
        use std::os::fd::IntoRawFd;
        let raw = null.into_raw_fd();
        // SAFETY: F_SETFD only clears the close-on-exec flag of a descriptor this
        // process just opened and keeps.
        if unsafe { libc::fcntl(raw, libc::F_SETFD, 0) } < 0 {
            return Err(FdError::last_os(fd));
        }
        return Ok(());
    }
    // SAFETY: dup2 onto a descriptor number that is not open; `null` stays
    // valid for the call and is closed after (the copy, without close-on-exec,
    // stays).
    if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
        return Err(FdError::last_os(fd));
    }
    Ok(())
}
