//! Append-only audit log: one JSON object per line, rotated by size.
//!
//! Every API decision (principal, tenant, RPC, lease, result, reason) and every
//! runtime admission or refusal is written here. Tokens never are: callers pass
//! lease ids, and [`AuditLog::record`] scrubs anything that looks like a token from
//! the free-text reason as a last line of defence.
//!
//! Rotation: when the file would grow past `max_bytes`, `audit.jsonl` becomes
//! `audit.jsonl.1` (older ones shift up to `keep`, the oldest is deleted) and a new
//! file is started. Records are written with one `write` call each on an O_APPEND
//! file, so concurrent readers never see half a line.
//!
//! Owns: the audit file and its rotation. May use: lease (token scrubbing). May not
//! touch: the transport.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::lease::token;

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// One audit record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Unix milliseconds.
    pub at_ms: i64,
    /// "api" or "runtime".
    pub source: String,
    /// Principal name (from the config's auth rules), or "unmapped uid 1234".
    pub principal: String,
    /// The tenant the call concerned, when known.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tenant: String,
    /// RPC name, or the runtime command (create, exec, ...).
    pub action: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub lease: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub container: String,
    /// "ok", or the gRPC code name of a refusal ("PermissionDenied", ...).
    pub result: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
    /// Who the caller is when it showed an OIDC bearer token: the person or
    /// service account, as the identity provider names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oidc: Option<OidcSubject>,
}

/// The identity an OIDC token vouches for (never the token itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OidcSubject {
    /// `iss`
    pub issuer: String,
    /// `sub`
    pub subject: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub email: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_username: Option<String>,
}

pub struct AuditLog {
    path: PathBuf,
    max_bytes: u64,
    keep: u32,
    file: Mutex<Option<(File, u64)>>,
}

impl std::fmt::Debug for AuditLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditLog")
            .field("path", &self.path)
            .finish()
    }
}

/// Replace anything shaped like a lease token with a marker.
pub fn scrub(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(token::PREFIX) {
        out.push_str(&rest[..i]);
        let after = &rest[i + token::PREFIX.len()..];
        let hex_len = after.bytes().take_while(|b| b.is_ascii_hexdigit()).count();
        out.push_str("[token]");
        rest = &after[hex_len..];
    }
    out.push_str(rest);
    out
}

impl AuditLog {
    /// Open (create) the log. The directory is created with mode 0750.
    pub fn open(path: &Path, max_bytes: u64, keep: u32) -> Result<AuditLog, AuditError> {
        let log = AuditLog {
            path: path.to_path_buf(),
            max_bytes,
            keep,
            file: Mutex::new(None),
        };
        let f = log.open_file()?;
        *log.file.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
        Ok(log)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn open_file(&self) -> Result<(File, u64), AuditError> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| AuditError::Io { path, source }
        };
        if let Some(dir) = self.path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o750)
                .create(dir)
                .map_err(io(dir))?;
        }
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o640)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&self.path)
            .map_err(io(&self.path))?;
        let len = f.metadata().map_err(io(&self.path))?.len();
        Ok((f, len))
    }

    fn rotated(&self, n: u32) -> PathBuf {
        let mut s = self.path.clone().into_os_string();
        s.push(format!(".{n}"));
        PathBuf::from(s)
    }

    fn rotate(&self) -> Result<(), AuditError> {
        let io = |path: PathBuf| move |source| AuditError::Io { path, source };
        if self.keep == 0 {
            std::fs::remove_file(&self.path).map_err(io(self.path.clone()))?;
            return Ok(());
        }
        let oldest = self.rotated(self.keep);
        if oldest.exists() {
            std::fs::remove_file(&oldest).map_err(io(oldest.clone()))?;
        }
        for n in (1..self.keep).rev() {
            let from = self.rotated(n);
            if from.exists() {
                std::fs::rename(&from, self.rotated(n + 1)).map_err(io(from.clone()))?;
            }
        }
        std::fs::rename(&self.path, self.rotated(1)).map_err(io(self.path.clone()))
    }

    /// Append one record. Failures are returned: the caller logs them once.
    pub fn record(&self, mut rec: Record) -> Result<(), AuditError> {
        rec.reasons = rec.reasons.iter().map(|r| scrub(r)).collect();
        let mut line = serde_json::to_vec(&rec).map_err(|e| AuditError::Io {
            path: self.path.clone(),
            source: std::io::Error::other(e),
        })?;
        line.push(b'\n');
        let mut guard = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let needs_rotation = guard
            .as_ref()
            .is_some_and(|(_, len)| len + line.len() as u64 > self.max_bytes && *len > 0);
        if needs_rotation || guard.is_none() {
            *guard = None;
            if needs_rotation {
                self.rotate()?;
            }
            *guard = Some(self.open_file()?);
        }
        if let Some((f, len)) = guard.as_mut() {
            f.write_all(&line).map_err(|source| AuditError::Io {
                path: self.path.clone(),
                source,
            })?;
            *len += line.len() as u64;
        }
        Ok(())
    }
}

/// Read records from the log and its rotated files (oldest first).
pub fn read_all(path: &Path, keep: u32) -> Result<Vec<Record>, AuditError> {
    let mut files: Vec<PathBuf> = (1..=keep.max(1))
        .rev()
        .map(|n| {
            let mut s = path.to_path_buf().into_os_string();
            s.push(format!(".{n}"));
            PathBuf::from(s)
        })
        .collect();
    files.push(path.to_path_buf());
    let mut out = Vec::new();
    for f in files {
        let text = match std::fs::read_to_string(&f) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(AuditError::Io { path: f, source }),
        };
        out.extend(
            text.lines()
                .filter_map(|l| serde_json::from_str::<Record>(l).ok()),
        );
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn rec(i: usize) -> Record {
        Record {
            at_ms: i as i64,
            source: "api".into(),
            principal: "ops".into(),
            tenant: "team-a".into(),
            action: "CreateLease".into(),
            lease: format!("l-{i}"),
            container: String::new(),
            result: "ok".into(),
            reasons: vec![],
            oidc: None,
        }
    }

    #[test]
    fn records_append_and_rotate_by_size_keeping_n_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let log = AuditLog::open(&path, 4096, 2).unwrap();
        for i in 0..200 {
            log.record(rec(i)).unwrap();
        }
        assert!(std::fs::metadata(&path).unwrap().len() <= 4096);
        assert!(dir.path().join("audit.jsonl.1").exists());
        assert!(dir.path().join("audit.jsonl.2").exists());
        assert!(!dir.path().join("audit.jsonl.3").exists());
        let all = read_all(&path, 2).unwrap();
        // The newest records are all there, in order.
        assert_eq!(all.last().unwrap().lease, "l-199");
        let ids: Vec<i64> = all.iter().map(|r| r.at_ms).collect();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(ids, sorted);
        assert!(all.len() < 200, "the oldest rotated away");
    }

    #[test]
    fn tokens_are_scrubbed_from_reasons() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.jsonl");
        let log = AuditLog::open(&path, 1 << 20, 1).unwrap();
        let t = token::generate();
        let mut r = rec(1);
        r.reasons = vec![format!("bad token {t} given")];
        log.record(r).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&t[token::PREFIX.len()..]), "{text}");
        assert!(text.contains("bad token [token] given"), "{text}");
    }
}
