//! Answers to ResolveToken kept for the next start on the same lease, so that a start
//! asks the daemon once (BindContainer) instead of twice.
//!
//! Keeping an answer never lets a container start on an outdated one: the spec is
//! judged against the kept answer, and the bind sends that answer back; the daemon
//! compares it with its current answer for the token and refuses the bind, binding
//! nothing, when they differ in anything a container is given or judged by
//! (RESOLUTION_CHANGED). The runtime then forgets the answer, resolves again and
//! judges the spec anew. So the file need not be trusted for safety, only for speed;
//! it is still read only when root alone can write it ([`crate::private_file`]).
//!
//! Only answers from a daemon that says it makes that check
//! (`bind_checks_resolution`) are kept, and only after a bind with them succeeded.
//! One file per token under `<state_dir>/resolved/`, named by the token's SHA-256
//! (the token itself is never written), the answer's protobuf bytes; the oldest are
//! removed past [`MAX_ENTRIES`].

use std::path::{Path, PathBuf};

use prost::Message;
use sha2::{Digest, Sha256};
use tessera_proto::v1 as pb;
use thiserror::Error;

use super::{ResolvedLease, now_ms};
use crate::private_file::{self, FileError};

/// The directory under the state dir.
pub const DIR: &str = "resolved";
/// The most answers kept (a host runs a few hundred leases at most; each start of an
/// unknown token adds one).
pub const MAX_ENTRIES: usize = 512;
/// The largest answer read (a 16-GPU lease's answer is a few kB).
const MAX_BYTES: u64 = 256 * 1024;

/// Why a kept answer was not used or not kept.
#[derive(Debug, Error)]
pub enum CacheError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{path}: not a kept ResolveToken answer: {message}")]
    Format { path: PathBuf, message: String },
}

/// The kept answers under one state dir.
#[derive(Debug, Clone)]
pub struct AnswerCache {
    dir: PathBuf,
}

impl AnswerCache {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join(DIR),
        }
    }

    /// The file a token's answer is kept in.
    pub fn path_of(&self, token: &str) -> PathBuf {
        self.dir.join(name_of(token))
    }

    /// The kept answer for `token` and the lease it describes: `Ok(None)` when none is
    /// kept, or the kept one describes a lease that has expired by now (it is
    /// forgotten then); `Err` when the file may not be trusted or does not decode.
    pub fn get(
        &self,
        token: &str,
    ) -> Result<Option<(pb::ResolveTokenResponse, ResolvedLease)>, CacheError> {
        let name = name_of(token);
        let bytes = match private_file::read(&self.dir, &name, MAX_BYTES) {
            Ok(Some(b)) => b,
            Ok(None) => return Ok(None),
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let format = |message: String| CacheError::Format {
            path: self.dir.join(&name),
            message,
        };
        let answer =
            pb::ResolveTokenResponse::decode(&bytes[..]).map_err(|e| format(e.to_string()))?;
        if !answer.bind_checks_resolution {
            return Err(format("an answer the daemon does not check at bind".into()));
        }
        match ResolvedLease::from_proto(answer.clone(), now_ms()) {
            Ok(lease) => Ok(Some((answer, lease))),
            Err(_) => {
                // Expired (or a lease the runtime would refuse): asked again.
                self.forget(token);
                Ok(None)
            }
        }
    }

    /// Keep `answer` for `token`, when its daemon checks answers at bind (else nothing
    /// is kept). Only root keeps answers.
    pub fn put(&self, token: &str, answer: &pb::ResolveTokenResponse) -> Result<(), CacheError> {
        if !answer.bind_checks_resolution || !private_file::ensure_dir(&self.dir)? {
            return Ok(());
        }
        private_file::write(&self.dir, &name_of(token), &answer.encode_to_vec())?;
        self.trim();
        Ok(())
    }

    /// Forget the answer kept for `token` (best effort: a file left behind is
    /// refused at the next bind, and replaced).
    pub fn forget(&self, token: &str) {
        let _ = std::fs::remove_file(self.path_of(token));
    }

    /// Past [`MAX_ENTRIES`], remove the least recently written answers (those of
    /// leases that ended, mostly).
    fn trim(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut files: Vec<(std::time::SystemTime, PathBuf)> = rd
            .filter_map(Result::ok)
            // Not another start's file being written (`.name.suffix`).
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                if !m.is_file() {
                    return None;
                }
                Some((m.modified().ok()?, e.path()))
            })
            .collect();
        if files.len() <= MAX_ENTRIES {
            return;
        }
        files.sort();
        let excess = files.len() - MAX_ENTRIES;
        for (_, p) in files.into_iter().take(excess) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A token's file name: the hex SHA-256 of the token.
fn name_of(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn answer(checks: bool, expires_at_ms: i64) -> pb::ResolveTokenResponse {
        pb::ResolveTokenResponse {
            lease: Some(pb::Lease {
                id: "l1".into(),
                tenant: "acme".into(),
                state: pb::LeaseState::Active as i32,
                expires_at_ms,
                ..Default::default()
            }),
            tenant: "acme".into(),
            cgroup_parent: "/tessera/l1".into(),
            bind_checks_resolution: checks,
            ..Default::default()
        }
    }

    fn root() -> bool {
        if nix::unistd::geteuid().is_root() {
            return true;
        }
        eprintln!("SKIPPED: answer cache test: only root keeps answers");
        false
    }

    #[test]
    fn kept_answer_comes_back_until_forgotten() {
        if !root() {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let c = AnswerCache::new(t.path());
        assert!(c.get("tok").unwrap().is_none());
        let a = answer(true, now_ms() + 60_000);
        c.put("tok", &a).unwrap();
        // Named by the token's digest, never the token.
        let name = c
            .path_of("tok")
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert_eq!(name.len(), 64);
        assert!(!name.contains("tok"));
        let (back, lease) = c.get("tok").unwrap().unwrap();
        assert_eq!(back, a);
        assert_eq!(lease.lease_id, "l1");
        assert!(c.get("other").unwrap().is_none());
        c.forget("tok");
        assert!(c.get("tok").unwrap().is_none());
    }

    #[test]
    fn unchecked_expired_or_garbled_answers_are_not_used() {
        if !root() {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let c = AnswerCache::new(t.path());
        // A daemon that does not check answers at bind: nothing kept.
        c.put("old", &answer(false, 0)).unwrap();
        assert!(!c.path_of("old").exists());
        // Expired since it was kept: not used, and forgotten.
        c.put("exp", &answer(true, now_ms() - 1)).unwrap();
        assert!(c.get("exp").unwrap().is_none());
        assert!(!c.path_of("exp").exists());
        // Bytes that are not an answer: an error, never a lease.
        private_file::write(&t.path().join(DIR), &name_of("bad"), b"\xff\xff\xff").unwrap();
        assert!(matches!(c.get("bad"), Err(CacheError::Format { .. })));
    }

    #[test]
    fn the_oldest_answers_go_past_the_limit() {
        if !root() {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let c = AnswerCache::new(t.path());
        let a = answer(true, 0);
        c.put("first", &a).unwrap();
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(c.path_of("first"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        for i in 0..MAX_ENTRIES {
            c.put(&format!("t{i}"), &a).unwrap();
        }
        let n = std::fs::read_dir(t.path().join(DIR)).unwrap().count();
        assert_eq!(n, MAX_ENTRIES);
        assert!(!c.path_of("first").exists(), "the oldest answer is removed");
        assert!(c.get(&format!("t{}", MAX_ENTRIES - 1)).unwrap().is_some());
    }
}
