//! The runc this runtime hands containers to must carry the fixes for the known
//! container-escape CVEs, unless runtime.toml acknowledges them by name
//! (`runc_cve_acknowledged`, for a distribution build with backports).
//!
//! Asking `runc --version` starts a Go program (a few milliseconds of CPU, several
//! threads) on every container start. Its answer depends only on the binary, so it is
//! kept in a cache under the runtime's state dir ([`VersionCache`]), keyed by the
//! binary's identity (device, inode, size, mtime and ctime, following a symlink at
//! `runc_path`): a binary replaced, rewritten or touched is asked again. The cache holds
//! the version only; the verdict (which CVEs are missing, which are acknowledged) is
//! made on every start from the current config. A cache that root does not own alone
//! (the file or its directory owned by another user, writable by group or others, a
//! symlink) is ignored and the version asked again: it could otherwise make an old runc
//! look new.

use crate::private_file::{self, FileError};
use serde::{Deserialize, Serialize};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use thiserror::Error;

/// The cache file's name under the state dir.
pub const CACHE_FILE: &str = "runc-version.json";
/// The most binaries the cache remembers (a host has one runc, tests a few).
const MAX_ENTRIES: usize = 16;
/// The largest cache file read.
const MAX_CACHE_BYTES: u64 = 64 * 1024;

/// Why the version cache was not used (the version is then asked of runc).
#[derive(Debug, Error)]
pub enum CacheError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{path}: not a version cache: {message}")]
    Format { path: PathBuf, message: String },
}

/// A runc that lacks fixes nobody acknowledged: refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "runc {shown} lacks the fixes for {missing} (runc 1.2.8, 1.3.3, 1.4.0): upgrade runc, or if this build carries backports name them in runtime.toml's runc_cve_acknowledged"
)]
pub struct Unfixed {
    /// The version (`1.1.5`, or "of unknown version").
    pub shown: String,
    /// The CVEs, joined with ", ".
    pub missing: String,
}

/// The identity of a runc binary: what changes when it is replaced or rewritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BinaryKey {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_sec: i64,
    pub mtime_nsec: i64,
    pub ctime_sec: i64,
    pub ctime_nsec: i64,
}

impl BinaryKey {
    /// The key of the file at `path` (a symlink followed: runc is exec'd by path).
    pub fn of(path: &Path) -> Result<Self, CacheError> {
        let m = std::fs::metadata(path).map_err(|source| CacheError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_sec: m.mtime(),
            mtime_nsec: m.mtime_nsec(),
            ctime_sec: m.ctime(),
            ctime_nsec: m.ctime_nsec(),
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    key: BinaryKey,
    version: (u64, u64, u64),
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheFile {
    entries: Vec<Entry>,
}

/// `runc --version` answers, kept in `<dir>/runc-version.json` (root's, 0600, in a
/// directory only root may write).
#[derive(Debug, Clone)]
pub struct VersionCache {
    dir: PathBuf,
}

impl VersionCache {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
        }
    }

    /// The cache file's path.
    pub fn path(&self) -> PathBuf {
        self.dir.join(CACHE_FILE)
    }

    fn read(&self) -> Result<CacheFile, CacheError> {
        let Some(buf) = private_file::read(&self.dir, CACHE_FILE, MAX_CACHE_BYTES)? else {
            // Nothing cached yet.
            return Ok(CacheFile::default());
        };
        serde_json::from_slice(&buf).map_err(|e| CacheError::Format {
            path: self.path(),
            message: e.to_string(),
        })
    }

    /// The cached version of the binary with `key`: `Ok(None)` when it is not cached,
    /// `Err` when the cache may not be trusted.
    pub fn lookup(&self, key: &BinaryKey) -> Result<Option<(u64, u64, u64)>, CacheError> {
        Ok(self
            .read()?
            .entries
            .iter()
            .find(|e| e.key == *key)
            .map(|e| e.version))
    }

    /// Remember `version` for the binary with `key` (replacing the file by rename,
    /// 0600). Only root writes the cache; the directory is made (0700) if missing.
    ///
    /// No fsync: a cache lost in a crash is asked again.
    pub fn store(&self, key: BinaryKey, version: (u64, u64, u64)) -> Result<(), CacheError> {
        // Written only into a directory root alone may write; a file there that is
        // not to be trusted (wrong owner or mode, unreadable) is replaced.
        if !private_file::ensure_dir(&self.dir)? {
            return Ok(());
        }
        let mut file = self.read().unwrap_or_default();
        file.entries.retain(|e| e.key != key);
        file.entries.push(Entry { key, version });
        let excess = file.entries.len().saturating_sub(MAX_ENTRIES);
        file.entries.drain(..excess);
        let bytes = serde_json::to_vec(&file).map_err(|e| CacheError::Format {
            path: self.path(),
            message: e.to_string(),
        })?;
        Ok(private_file::write(&self.dir, CACHE_FILE, &bytes)?)
    }
}

/// The CVEs `runc` lacks fixes for and nobody acknowledged: `Err` refuses the
/// container naming them; `Ok(Some)` is a warning to log each time an
/// acknowledgement is relied on. Always asks runc (no cache).
pub fn check(runc: &Path, acknowledged: &[String]) -> Result<Option<String>, Unfixed> {
    start(runc, None).judge(acknowledged).result
}

/// The version of `runc`: from `cache` when it holds this very binary, else
/// `runc --version` started: [`Pending::judge`] waits for its answer. runc is a Go
/// program that takes a few milliseconds to start; a container start does its other
/// work (the token's resolve, the hardening) meanwhile, and judges before anything
/// is bound, written or run.
pub fn start(runc: &Path, cache: Option<&VersionCache>) -> Pending {
    let mut notes = Vec::new();
    // No key: runc cannot be run either, and is judged as of unknown version.
    let key = BinaryKey::of(runc).ok();
    if let (Some(cache), Some(key)) = (cache, key) {
        match cache.lookup(&key) {
            Ok(Some(version)) => {
                return Pending {
                    how: How::Cached(version),
                    notes,
                };
            }
            Ok(None) => {}
            // No state dir yet: the first start makes it.
            Err(CacheError::File(e)) if e.is_not_found() => {}
            Err(e) => notes.push(format!(
                "tessera-runtime: WARNING: runc version cache ignored, runc asked instead: {e}"
            )),
        }
    }
    let child = Command::new(runc)
        .arg("--version")
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok();
    Pending {
        how: How::Asked {
            child,
            runc: runc.to_path_buf(),
            key,
            cache: cache.cloned(),
        },
        notes,
    }
}

#[derive(Debug)]
enum How {
    Cached((u64, u64, u64)),
    Asked {
        child: Option<Child>,
        runc: PathBuf,
        key: Option<BinaryKey>,
        cache: Option<VersionCache>,
    },
}

/// A runc version known from the cache, or `runc --version` running.
#[derive(Debug)]
pub struct Pending {
    how: How,
    notes: Vec<String>,
}

/// What [`Pending::judge`] found.
#[derive(Debug)]
pub struct Verdict {
    /// See [`judge`].
    pub result: Result<Option<String>, Unfixed>,
    /// Warnings about the cache (ignored as untrusted, or not written), to log.
    pub cache_notes: Vec<String>,
    /// Whether the version came from the cache.
    pub cached: bool,
}

impl Pending {
    /// Whether the version came from the cache and passes [`judge`] (with or without
    /// a warning): runc may be started before the spec is decided
    /// ([`crate::early`]). A version still to be asked, or one that is refused, waits
    /// for the decision: a runc that may be refused is never started for a container.
    pub fn cached_and_admitted(&self, acknowledged: &[String]) -> bool {
        matches!(self.how, How::Cached(v) if judge(Some(v), acknowledged).is_ok())
    }

    /// Wait for the version and judge it ([`judge`]); a runc that could not be
    /// run is of unknown version, and refused. A version runc answered is cached
    /// when the binary did not change while it ran.
    pub fn judge(self, acknowledged: &[String]) -> Verdict {
        let mut notes = self.notes;
        let (version, cached) = match self.how {
            How::Cached(v) => (Some(v), true),
            How::Asked {
                child,
                runc,
                key,
                cache,
            } => {
                let out = child
                    .and_then(|c| c.wait_with_output().ok())
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default();
                let version = tessera_common::runc::parse_version(&out);
                if let (Some(v), Some(key), Some(cache)) = (version, key, cache)
                    && BinaryKey::of(&runc).ok() == Some(key)
                    && let Err(e) = cache.store(key, v)
                {
                    notes.push(format!(
                        "tessera-runtime: WARNING: runc version not cached: {e}"
                    ));
                }
                (version, false)
            }
        };
        Verdict {
            result: judge(version, acknowledged),
            cache_notes: notes,
            cached,
        }
    }
}

/// The verdict for a known (or unknown) version.
pub fn judge(
    version: Option<(u64, u64, u64)>,
    acknowledged: &[String],
) -> Result<Option<String>, Unfixed> {
    let shown = version.map_or_else(
        || "of unknown version".to_string(),
        |(a, b, c)| format!("{a}.{b}.{c}"),
    );
    let unfixed = tessera_common::runc::unfixed(version);
    let missing: Vec<&str> = unfixed
        .iter()
        .copied()
        .filter(|c| !acknowledged.iter().any(|a| a == c))
        .collect();
    if !missing.is_empty() {
        return Err(Unfixed {
            shown,
            missing: missing.join(", "),
        });
    }
    Ok((!unfixed.is_empty()).then(|| {
        format!(
            "tessera-runtime: WARNING: runc {shown} predates the fixes for {}; relying on runtime.toml's runc_cve_acknowledged",
            unfixed.join(", ")
        )
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_vulnerable_runc_is_refused_unless_each_cve_is_acknowledged() {
        let e = judge(Some((1, 1, 5)), &[]).unwrap_err().to_string();
        assert!(
            e.contains("CVE-2025-31133") && e.contains("runc_cve_acknowledged"),
            "{e}"
        );
        let some = vec!["CVE-2025-31133".to_string()];
        let e = judge(Some((1, 1, 5)), &some).unwrap_err().to_string();
        assert!(
            !e.contains("CVE-2025-31133,") && e.contains("CVE-2025-52565"),
            "{e}"
        );
        let all: Vec<String> = tessera_common::runc::MOUNT_RACE_CVES
            .iter()
            .map(|s| s.to_string())
            .collect();
        let w = judge(Some((1, 1, 5)), &all).unwrap().unwrap();
        assert!(w.contains("WARNING"), "{w}");
        assert_eq!(judge(Some((1, 2, 8)), &[]).unwrap(), None);
        assert!(judge(None, &[]).is_err(), "an unknown runc is not trusted");
    }

    /// A fake runc answering `--version` with `version`, and counting its runs in
    /// `<dir>/asked`.
    fn fake_runc(path: &Path, version: &str) {
        let asked = path.with_file_name("asked");
        let script = format!(
            "#!/bin/sh\necho x >> {}\necho 'runc version {version}'\necho 'spec: 1.0.2'\n",
            asked.display()
        );
        // Replaced by rename, as a package upgrade does: a new inode.
        let tmp = path.with_extension("new");
        std::fs::write(&tmp, script).unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    fn times_asked(runc: &Path) -> usize {
        std::fs::read_to_string(runc.with_file_name("asked"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    fn verdict(runc: &Path, cache: &VersionCache) -> Verdict {
        start(runc, Some(cache)).judge(&[])
    }

    #[test]
    fn the_version_is_asked_once_per_binary_and_again_when_it_changes() {
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: the runc version cache is written by root only");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let runc = dir.path().join("runc");
        let cache = VersionCache::new(&dir.path().join("state"));
        fake_runc(&runc, "1.2.8");
        let first = verdict(&runc, &cache);
        assert!(!first.cached && first.result.is_ok(), "{first:?}");
        assert!(first.cache_notes.is_empty(), "{:?}", first.cache_notes);
        let m = std::fs::metadata(cache.path()).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o600));
        let dm = std::fs::metadata(dir.path().join("state")).unwrap();
        assert_eq!(dm.mode() & 0o777, 0o700);
        // The second start does not run runc.
        let second = verdict(&runc, &cache);
        assert!(second.cached && second.result.is_ok(), "{second:?}");
        assert_eq!(times_asked(&runc), 1);

        // A downgrade (a new binary at the same path) is asked and refused.
        fake_runc(&runc, "1.1.5");
        let third = verdict(&runc, &cache);
        assert!(!third.cached, "{third:?}");
        let e = third.result.unwrap_err().to_string();
        assert!(e.contains("runc 1.1.5 lacks"), "{e}");
        assert_eq!(times_asked(&runc), 2);
        // ... and that answer is cached too: still refused, without asking.
        let fourth = verdict(&runc, &cache);
        assert!(fourth.cached && fourth.result.is_err(), "{fourth:?}");

        // Rewritten in place (same inode, same size), only its mtime differs.
        let text = std::fs::read_to_string(&runc)
            .unwrap()
            .replace("1.1.5", "1.2.9");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&runc)
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let t = nix::sys::time::TimeSpec::new(1_000_000_000, 0);
        nix::sys::stat::utimensat(
            None,
            &runc,
            &t,
            &t,
            nix::sys::stat::UtimensatFlags::FollowSymlink,
        )
        .unwrap();
        let fifth = verdict(&runc, &cache);
        assert!(!fifth.cached && fifth.result.is_ok(), "{fifth:?}");
        assert_eq!(times_asked(&runc), 3);
    }

    #[test]
    fn a_cache_others_could_write_is_ignored() {
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: chown to another user needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let runc = dir.path().join("runc");
        let state = dir.path().join("state");
        let cache = VersionCache::new(&state);
        fake_runc(&runc, "1.1.5");
        assert!(verdict(&runc, &cache).result.is_err());
        assert_eq!(times_asked(&runc), 1);
        // Someone makes the cache say 1.2.8 for this very binary.
        let forged = std::fs::read_to_string(cache.path())
            .unwrap()
            .replace("[1,1,5]", "[1,2,8]");
        assert!(forged.contains("[1,2,8]"), "{forged}");
        let forge = |mode: u32, owner: u32| {
            std::fs::write(cache.path(), &forged).unwrap();
            std::fs::set_permissions(cache.path(), std::fs::Permissions::from_mode(mode)).unwrap();
            std::os::unix::fs::chown(cache.path(), Some(owner), None).unwrap();
        };
        // Root's own 0600 file is believed (this is what the test forges below).
        forge(0o600, 0);
        let v = verdict(&runc, &cache);
        assert!(v.cached && v.result.is_ok(), "{v:?}");

        // Writable by others: ignored, runc asked, refused; a warning says why.
        forge(0o606, 0);
        let v = verdict(&runc, &cache);
        assert!(!v.cached && v.result.is_err(), "{v:?}");
        assert!(
            v.cache_notes.iter().any(|n| n.contains("mode 606")),
            "{:?}",
            v.cache_notes
        );
        // Owned by another user, even 0600: ignored.
        forge(0o600, 1000);
        let v = verdict(&runc, &cache);
        assert!(!v.cached && v.result.is_err(), "{v:?}");
        assert!(
            v.cache_notes
                .iter()
                .any(|n| n.contains("not owned by root")),
            "{:?}",
            v.cache_notes
        );
        // Each refusal replaced the file with root's own answer.
        let m = std::fs::metadata(cache.path()).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o600));
        assert!(verdict(&runc, &cache).result.is_err());

        // A symlink in place of the file: ignored.
        let elsewhere = dir.path().join("elsewhere.json");
        std::fs::write(&elsewhere, &forged).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::remove_file(cache.path()).unwrap();
        std::os::unix::fs::symlink(&elsewhere, cache.path()).unwrap();
        let v = verdict(&runc, &cache);
        assert!(!v.cached && v.result.is_err(), "{v:?}");

        // A directory others may write: neither read nor written.
        forge_dir_writable(&state);
        std::fs::remove_file(cache.path()).unwrap();
        std::fs::write(cache.path(), &forged).unwrap();
        std::fs::set_permissions(cache.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
        let v = verdict(&runc, &cache);
        assert!(!v.cached && v.result.is_err(), "{v:?}");
        assert!(
            v.cache_notes
                .iter()
                .any(|n| n.contains("writable by others")),
            "{:?}",
            v.cache_notes
        );
        assert_eq!(
            std::fs::read_to_string(cache.path()).unwrap(),
            forged,
            "not written into a directory others may write"
        );
    }

    fn forge_dir_writable(dir: &Path) {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
}
