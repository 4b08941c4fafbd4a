//! Injected commit failures, for chaos testing (`[daemon] fault_injection = true`):
//! while the fault file says so, every commit fails with SQLite's I/O-error or
//! disk-full code and is rolled back, exactly as a failing disk makes it fail.
//! The file is `<run_dir>/store-faults.json`, written by `tesserad inject store`.
//! Off (the default), the store never looks for it.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// What the next commits do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommitFault {
    #[default]
    None,
    /// SQLITE_IOERR: the disk fails writes.
    IoError,
    /// SQLITE_FULL: the filesystem is full.
    DiskFull,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultFile {
    #[serde(default)]
    pub commit: CommitFault,
}

type Stamp = (u64, u64, i64, i64, u64);

/// The fault file of one store, read again when it changes.
#[derive(Debug)]
pub struct StoreFaults {
    path: PathBuf,
    seen: Mutex<Option<(Stamp, FaultFile)>>,
}

impl StoreFaults {
    pub fn new(path: impl Into<PathBuf>) -> StoreFaults {
        StoreFaults {
            path: path.into(),
            seen: Mutex::new(None),
        }
    }

    /// The file under `run_dir`.
    pub fn in_run_dir(run_dir: &Path) -> StoreFaults {
        StoreFaults::new(run_dir.join("store-faults.json"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The fault in force for the next commit. An unreadable or missing file is no
    /// fault (the file is a test's instrument, not state).
    pub fn commit(&self) -> CommitFault {
        use std::os::unix::fs::MetadataExt;
        let Ok(m) = std::fs::metadata(&self.path) else {
            return CommitFault::None;
        };
        let stamp = (m.dev(), m.ino(), m.mtime(), m.mtime_nsec(), m.size());
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((s, f)) = seen.as_ref()
            && *s == stamp
        {
            return f.commit;
        }
        let file: FaultFile = std::fs::read(&self.path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        *seen = Some((stamp, file));
        file.commit
    }

    /// Write the file atomically.
    pub fn set(&self, commit: CommitFault) -> std::io::Result<()> {
        let json = serde_json::to_vec(&FaultFile { commit }).map_err(std::io::Error::other)?;
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".tmp");
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, &self.path)
    }
}
