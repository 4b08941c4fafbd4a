//! runc's `--root` as the runtime uses it and hands it to runc.

use std::path::{Path, PathBuf};
use thiserror::Error;

/// runc's default state root.
pub const RUNC_DEFAULT_ROOT: &str = "/run/runc";

/// Why a `--root` is refused.
#[derive(Debug, Error)]
pub enum RootError {
    #[error("--root {0:?} is not an absolute path")]
    NotAbsolute(String),
    #[error("--root {0:?} has a '.' or '..' component")]
    DotComponent(String),
    #[error("--root {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--root {}: not a directory", .0.display())]
    NotDirectory(PathBuf),
    #[error(
        "--root {given}: {} may be changed by others than root (owner {uid}, mode {mode:o})",
        path.display()
    )]
    Writable {
        given: String,
        path: PathBuf,
        uid: u32,
        mode: u32,
    },
}

/// runc's `--root` as the runtime uses it and hands it to runc: absolute, with no `.`
/// or `..` component, and where it exists, canonical (symlinks resolved once) with
/// every directory from it up to `/` owned by root (or the caller) and writable by
/// nobody else (a sticky directory excepted). A create makes a missing root first
/// (0700, as runc would). Records are keyed by this path, so two spellings of one
/// root are one root, and no spelling reaches a root through a missing directory.
pub fn canonical_root(given: &str, create: bool) -> Result<String, RootError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if !given.starts_with('/') {
        return Err(RootError::NotAbsolute(given.to_string()));
    }
    if given.split('/').any(|c| c == "." || c == "..") {
        return Err(RootError::DotComponent(given.to_string()));
    }
    let path = Path::new(given);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| RootError::Io { path, source }
    };
    if std::fs::symlink_metadata(path).is_err() {
        if !create {
            // Nothing is there for runc to find; it says so itself.
            return Ok(crate::harden::mounts::normalize(given));
        }
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(path)
            .map_err(io(path))?;
    }
    let canon = std::fs::canonicalize(path).map_err(io(path))?;
    let euid = nix::unistd::geteuid().as_raw();
    let mut cur = Some(canon.as_path());
    while let Some(p) = cur {
        let m = std::fs::symlink_metadata(p).map_err(io(p))?;
        if !m.is_dir() {
            return Err(RootError::NotDirectory(p.to_path_buf()));
        }
        let sticky = m.mode() & 0o1000 != 0;
        if (m.uid() != 0 && m.uid() != euid) || (m.mode() & 0o022 != 0 && !sticky) {
            return Err(RootError::Writable {
                given: given.to_string(),
                path: p.to_path_buf(),
                uid: m.uid(),
                mode: m.mode() & 0o7777,
            });
        }
        cur = p.parent();
    }
    Ok(canon.to_string_lossy().into_owned())
}
