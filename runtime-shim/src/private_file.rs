//! Files only root may write, for what the runtime keeps between starts under its
//! state dir (runc's version, ResolveToken answers). A file is trusted only when it
//! and its directory are root's, the directory writable by nobody else and the file
//! readable by nobody else; a symlink is never followed. Writes replace the file by
//! rename (0600), with no fsync: what is kept is asked again when it is lost.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Why a kept file was not read or written.
#[derive(Debug, Error)]
pub enum FileError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not owned by root")]
    NotRootOwned { path: PathBuf },
    #[error("{path} is writable by others than root (mode {mode:o})")]
    Writable { path: PathBuf, mode: u32 },
    #[error("{path} is readable or writable by others than root (mode {mode:o}, want 0600)")]
    NotPrivate { path: PathBuf, mode: u32 },
    #[error("{path} is not a {what}")]
    NotKind { path: PathBuf, what: &'static str },
    #[error("{path} is larger than {max} bytes")]
    TooLarge { path: PathBuf, max: u64 },
}

impl FileError {
    /// The file or directory is not there (nothing kept yet).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FileError + '_ {
    move |source| FileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn check_owner(path: &Path, m: &std::fs::Metadata, what: &'static str) -> Result<(), FileError> {
    let kind_ok = if what == "directory" {
        m.file_type().is_dir()
    } else {
        m.file_type().is_file()
    };
    if !kind_ok {
        return Err(FileError::NotKind {
            path: path.to_path_buf(),
            what,
        });
    }
    if m.uid() != 0 {
        return Err(FileError::NotRootOwned {
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

/// The directory must be root's and writable by nobody else.
pub fn check_dir(dir: &Path) -> Result<(), FileError> {
    let m = std::fs::symlink_metadata(dir).map_err(io(dir))?;
    check_owner(dir, &m, "directory")?;
    if m.mode() & 0o022 != 0 {
        return Err(FileError::Writable {
            path: dir.to_path_buf(),
            mode: m.mode() & 0o7777,
        });
    }
    Ok(())
}

/// The bytes of `<dir>/<name>`, at most `max`: `Ok(None)` when there is no such
/// file, `Err` when it or its directory may not be trusted.
pub fn read(dir: &Path, name: &str, max: u64) -> Result<Option<Vec<u8>>, FileError> {
    check_dir(dir)?;
    let path = dir.join(name);
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(&path)(e)),
    };
    let m = file.metadata().map_err(io(&path))?;
    check_owner(&path, &m, "regular file")?;
    if m.mode() & 0o077 != 0 {
        return Err(FileError::NotPrivate {
            path,
            mode: m.mode() & 0o7777,
        });
    }
    if m.len() > max {
        return Err(FileError::TooLarge { path, max });
    }
    let mut buf = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut buf)
        .map_err(io(&path))?;
    Ok(Some(buf))
}

/// Make `dir` and any missing parent (0700) if it is missing, and check it. Only root
/// writes kept files: `Ok(false)` for any other caller, which then keeps nothing.
pub fn ensure_dir(dir: &Path) -> Result<bool, FileError> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(false);
    }
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(dir)
        .map_err(io(dir))?;
    check_dir(dir)?;
    Ok(true)
}

/// Replace `<dir>/<name>` with `bytes` (0600, by rename) in a directory
/// [`ensure_dir`] has checked.
pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), FileError> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.{:016x}", crate::bundle::temp_suffix()));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        drop(f);
        std::fs::rename(&tmp, &path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io(&path))
}

/// A new file holding `bytes`, made by root in `dir` (checked as [`ensure_dir`]
/// does), 0600, and unlinked at once: only the returned descriptor reaches it. The
/// descriptor is close-on-exec and numbered `min_fd` or above.
pub fn unlinked(dir: &Path, bytes: &[u8], min_fd: i32) -> Result<std::os::fd::OwnedFd, FileError> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    if !ensure_dir(dir)? {
        return Err(FileError::NotRootOwned {
            path: dir.to_path_buf(),
        });
    }
    let path = dir.join(format!(".doc.{:016x}", crate::bundle::temp_suffix()));
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(io(&path))?;
    let written = f.write_all(bytes);
    let removed = std::fs::remove_file(&path);
    written.and(removed).map_err(io(&path))?;
    let raw = nix::fcntl::fcntl(f.as_raw_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(min_fd))
        .map_err(|e| io(&path)(std::io::Error::from(e)))?;
    // SAFETY: F_DUPFD_CLOEXEC just returned this new descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn written_file_reads_back_private() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: written_file_reads_back_private: not root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        // Parents are made too (the state dir may not exist yet).
        let dir = t.path().join("state").join("kept");
        assert!(ensure_dir(&dir).unwrap());
        let mode = std::fs::metadata(t.path().join("state")).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
        write(&dir, "a", b"hello").unwrap();
        assert_eq!(read(&dir, "a", 64).unwrap().as_deref(), Some(&b"hello"[..]));
        let mode = std::fs::metadata(dir.join("a")).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(read(&dir, "missing", 64).unwrap().is_none());
        // Too large, readable by others, a symlink, a writable directory: refused.
        assert!(matches!(
            read(&dir, "a", 2),
            Err(FileError::TooLarge { .. })
        ));
        std::fs::set_permissions(dir.join("a"), std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            read(&dir, "a", 64),
            Err(FileError::NotPrivate { .. })
        ));
        std::os::unix::fs::symlink(dir.join("a"), dir.join("link")).unwrap();
        assert!(read(&dir, "link", 64).is_err());
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(
            read(&dir, "a", 64),
            Err(FileError::Writable { .. })
        ));
    }
}
