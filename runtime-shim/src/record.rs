//! What the runtime keeps from a container's create, in its own root-owned state: the
//! hardened process (its user, groups, capabilities, AppArmor profile and label, the
//! lease's variables), the lease id, the device rules and the pids and memory limits
//! as granted. `exec` and `update` judge against this record, never against the
//! bundle's `config.json`, which whoever owns the bundle can write after the create.
//!
//! One 0600 file per container under `<state_dir>/containers/`, named by the SHA-256
//! of runc's `--root` and the container id, written at create (before runc reads the
//! spec) by rename, removed at delete. A container without a record (created by runc
//! directly, or by an older runtime) gets no exec and no update: fail closed.

use crate::private_file::{self, FileError};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The directory under the state dir.
pub const DIR: &str = "containers";
/// The largest record read (a process with a long environment).
const MAX_BYTES: u64 = 4 * 1024 * 1024;
/// The record format written by this runtime.
const VERSION: u32 = 2;
/// The directory under the state dir holding each container's own bundle: the
/// directory runc is given as `--bundle`, with the `config.json` the runtime wrote.
pub const BUNDLES_DIR: &str = "bundles";

/// Why a record was not read or written.
#[derive(Debug, Error)]
pub enum RecordError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{path}: not a container record of this runtime: {message}")]
    Format { path: PathBuf, message: String },
    #[error(
        "container {id} has no record of its create under {dir} (it was not created by this runtime, or was deleted): exec and update are refused"
    )]
    Missing { id: String, dir: PathBuf },
    #[error("the hardened spec has no {what}")]
    Spec { what: &'static str },
    #[error(
        "container {id}: the record of its create is not this container's ({why}): exec and update are refused"
    )]
    Instance { id: String, why: String },
    #[error("container {id} is being created or deleted by another runtime process")]
    Busy { id: String },
}

/// The container's init process as runc recorded it once the create succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Instance {
    pub init_pid: u32,
    pub init_start: u64,
}

/// The user a container's process runs as.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
    #[serde(default)]
    pub additional_gids: Vec<u32>,
}

/// A created container, as the runtime admitted it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub version: u32,
    pub id: String,
    /// runc's `--root` the container was created under.
    pub root: String,
    pub bundle: PathBuf,
    pub user: User,
    /// The hardened `process` of config.json (what runc started the container with).
    pub process: Value,
    /// The lease the container runs on (`None`: no lease).
    pub lease_id: Option<String>,
    /// The lease's variables (`KEY=value`), `TESSERA_LEASE_ID` last.
    pub lease_env: Vec<String>,
    /// The device cgroup rules the container was started with.
    pub devices: Vec<Value>,
    /// `linux.resources.pids.limit` as granted.
    pub pids_limit: Option<i64>,
    /// `linux.resources.memory.limit` as granted (`None`: no limit was set).
    pub memory_limit: Option<i64>,
    /// `linux.resources.memory.swap` as granted.
    pub memory_swap: Option<i64>,
    /// `linux.resources.cpu` as granted (quota, period, shares, burst, cpus, mems).
    pub cpu: Option<crate::resources::Cpu>,
    /// The start time (clock ticks after boot) of the runtime process that wrote the
    /// record before runc ran: the container's init started at or after it.
    pub min_start: u64,
    /// The container's init as runc recorded it after a create that succeeded (`None`
    /// while runc runs, and for `run` in the foreground).
    pub instance: Option<Instance>,
}

fn u32_at(v: &Value, ptr: &str) -> Option<u32> {
    v.pointer(ptr)
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
}

/// The user, group and additional groups runc runs the container as.
fn user_of(process: &Value) -> Result<User, RecordError> {
    // What runc runs the container as: a uid or gid left out is Go's zero, root.
    let id_at = |ptr: &str, what: &'static str| match process.pointer(ptr) {
        None | Some(Value::Null) => Ok(0),
        Some(_) => u32_at(process, ptr).ok_or(RecordError::Spec { what }),
    };
    Ok(User {
        uid: id_at("/user/uid", "valid process.user.uid")?,
        gid: id_at("/user/gid", "valid process.user.gid")?,
        additional_gids: match process.pointer("/user/additionalGids") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|g| g.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<Vec<_>>>()
                .ok_or(RecordError::Spec {
                    what: "valid process.user.additionalGids",
                })?,
            Some(_) => {
                return Err(RecordError::Spec {
                    what: "valid process.user.additionalGids",
                });
            }
        },
    })
}

/// The lease's variables of the process (`KEY=value`), `TESSERA_LEASE_ID` last.
fn lease_env_of(process: &Value, lease: &str, lease_env_keys: &[&str]) -> Vec<String> {
    let mut lease_env: Vec<String> = process
        .get("env")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter(|e| {
            lease_env_keys
                .iter()
                .any(|k| e.starts_with(&format!("{k}=")))
        })
        .filter(|e| !e.starts_with("TESSERA_LEASE_ID="))
        .map(str::to_string)
        .collect();
    lease_env.push(format!("TESSERA_LEASE_ID={lease}"));
    lease_env
}

impl Record {
    /// The record of a hardened, admitted spec (`full_spec`).
    pub fn from_spec(
        id: &str,
        root: &str,
        bundle: &Path,
        spec: &Value,
        lease_id: Option<&str>,
        lease_env_keys: &[&str],
    ) -> Result<Self, RecordError> {
        let process = spec
            .get("process")
            .filter(|p| p.is_object())
            .cloned()
            .ok_or(RecordError::Spec { what: "process" })?;
        let user = user_of(&process)?;
        let lease_env = lease_id.map_or_else(Vec::new, |lease| {
            lease_env_of(&process, lease, lease_env_keys)
        });
        let res = spec.pointer("/linux/resources");
        // The grant as runc reads it: typed, every key spelt as runc's.
        let typed = match res {
            Some(r) => crate::resources::parse_create(r).map_err(|_| RecordError::Spec {
                what: "valid linux.resources",
            })?,
            None => crate::resources::Resources::default(),
        };
        let memory = typed.memory.clone().unwrap_or_default();
        Ok(Self {
            version: VERSION,
            id: id.to_string(),
            root: root.to_string(),
            bundle: bundle.to_path_buf(),
            user,
            process,
            lease_id: lease_id.map(str::to_string),
            lease_env,
            devices: res
                .and_then(|r| r.get("devices"))
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
            pids_limit: typed.pids.as_ref().map(|p| p.limit),
            memory_limit: memory.limit,
            memory_swap: memory.swap,
            cpu: typed.cpu.clone(),
            min_start: crate::host::proc_start_time(std::process::id()).unwrap_or(0),
            instance: None,
        })
    }

    /// Whether this record is the one of the container runc has under its root now
    /// (`state`: runc's `state.json` of the id under the canonical root): the init
    /// runc recorded after the create, or, before that was recorded, an init that
    /// started after the record was written. A record left by a create that failed,
    /// or by a container deleted and made again outside the runtime, is not.
    pub fn matches(&self, init_pid: u32, init_start: u64) -> Result<(), RecordError> {
        let why = match self.instance {
            Some(i) if i.init_pid == init_pid && i.init_start == init_start => return Ok(()),
            Some(i) => format!(
                "runc's init is pid {init_pid} started at {init_start}, the record's pid {} started at {}",
                i.init_pid, i.init_start
            ),
            None if self.min_start != 0 && init_start >= self.min_start => return Ok(()),
            None => format!(
                "runc's init started at {init_start}, before the record was written ({})",
                self.min_start
            ),
        };
        Err(RecordError::Instance {
            id: self.id.clone(),
            why,
        })
    }
}

/// A lock on one (root, id): held by a create from before runc runs until the record
/// says how it ended, and by a delete. Released when dropped (its fd closes).
#[derive(Debug)]
pub struct Lock {
    _file: std::fs::File,
}

/// The records under one state dir.
#[derive(Debug, Clone)]
pub struct Records {
    dir: PathBuf,
}

/// The file name of a container's record: its `--root` and id hashed (both are the
/// caller's strings; neither becomes a path).
fn name_of(root: &str, id: &str) -> String {
    let mut h = Sha256::new();
    h.update(root.as_bytes());
    h.update([0]);
    h.update(id.as_bytes());
    format!("{}.json", hex::encode(h.finalize()))
}

impl Records {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join(DIR),
        }
    }

    /// The directory the records live in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The runtime's own bundle directory for container `id` under the canonical
    /// `root`: `<state_dir>/bundles/<hash of root and id>`.
    pub fn bundle_dir(&self, root: &str, id: &str) -> PathBuf {
        let name = name_of(root, id);
        let stem = name.trim_end_matches(".json");
        self.dir
            .parent()
            .unwrap_or(Path::new("/"))
            .join(BUNDLES_DIR)
            .join(stem)
    }

    /// Make the runtime's own bundle directory for a create anew: root's, 0700, empty.
    pub fn fresh_bundle_dir(&self, root: &str, id: &str) -> Result<PathBuf, RecordError> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = self.bundle_dir(root, id);
        let parent = dir.parent().unwrap_or(Path::new("/")).to_path_buf();
        if !private_file::ensure_dir(&parent)? {
            return Err(FileError::NotRootOwned { path: parent }.into());
        }
        self.remove_bundle_dir(root, id)?;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|source| FileError::Io {
                path: dir.clone(),
                source,
            })?;
        private_file::check_dir(&dir)?;
        Ok(dir)
    }

    /// Remove the runtime's own bundle directory of a container (no error when gone).
    pub fn remove_bundle_dir(&self, root: &str, id: &str) -> Result<(), RecordError> {
        let dir = self.bundle_dir(root, id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(FileError::Io { path: dir, source }.into()),
        }
    }

    /// Take the lock of (root, id) without waiting: `Busy` when another runtime
    /// process holds it.
    pub fn lock(&self, root: &str, id: &str) -> Result<Lock, RecordError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        if !private_file::ensure_dir(&self.dir)? {
            return Err(FileError::NotRootOwned {
                path: self.dir.clone(),
            }
            .into());
        }
        let path = self.dir.join(name_of(root, id).replace(".json", ".lock"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|source| FileError::Io {
                path: path.clone(),
                source,
            })?;
        // SAFETY: flock on a descriptor this function owns; it changes no memory.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(RecordError::Busy { id: id.to_string() });
        }
        Ok(Lock { _file: file })
    }

    /// Write (or replace) the record of a container. Only root keeps records: any
    /// other caller gets an error, and its create is refused.
    pub fn put(&self, r: &Record) -> Result<(), RecordError> {
        if !private_file::ensure_dir(&self.dir)? {
            return Err(FileError::NotRootOwned {
                path: self.dir.clone(),
            }
            .into());
        }
        let bytes = serde_json::to_vec(r).map_err(|e| RecordError::Format {
            path: self.dir.join(name_of(&r.root, &r.id)),
            message: e.to_string(),
        })?;
        private_file::write(&self.dir, &name_of(&r.root, &r.id), &bytes)?;
        Ok(())
    }

    /// The record of container `id` under runc root `root`; `Missing` when there is
    /// none.
    pub fn get(&self, root: &str, id: &str) -> Result<Record, RecordError> {
        let name = name_of(root, id);
        let path = self.dir.join(&name);
        let bytes = match private_file::read(&self.dir, &name, MAX_BYTES) {
            Ok(Some(b)) => b,
            Ok(None) => {
                return Err(RecordError::Missing {
                    id: id.to_string(),
                    dir: self.dir.clone(),
                });
            }
            Err(e) if e.is_not_found() => {
                return Err(RecordError::Missing {
                    id: id.to_string(),
                    dir: self.dir.clone(),
                });
            }
            Err(e) => return Err(e.into()),
        };
        let r: Record = serde_json::from_slice(&bytes).map_err(|e| RecordError::Format {
            path: path.clone(),
            message: e.to_string(),
        })?;
        if r.version != VERSION || r.root != root || r.id != id {
            return Err(RecordError::Format {
                path,
                message: format!(
                    "version {} for {:?} under {:?}, not {VERSION} for {id:?} under {root:?}",
                    r.version, r.id, r.root
                ),
            });
        }
        Ok(r)
    }

    /// Forget a container's record (at delete, or after a create runc failed), and its
    /// lock file. A record not there is no error.
    pub fn remove(&self, root: &str, id: &str) -> Result<(), RecordError> {
        let _ = std::fs::remove_file(self.dir.join(name_of(root, id).replace(".json", ".lock")));
        let path = self.dir.join(name_of(root, id));
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(FileError::Io { path, source }.into()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec() -> Value {
        json!({
            "process": {"user": {"uid": 1000, "gid": 1000, "additionalGids": [1000, 44]},
                        "args": ["sh"],
                        "env": ["PATH=/bin", "CUDA_VISIBLE_DEVICES=MIG-1", "TESSERA_LEASE_ID=forged"]},
            "linux": {"resources": {"pids": {"limit": 100}, "memory": {"limit": 1 << 30},
                                    "devices": [{"allow": false, "access": "rwm"}]}}
        })
    }

    #[test]
    fn a_record_keeps_what_the_create_granted() {
        let r = Record::from_spec(
            "c1",
            "/run/runc",
            Path::new("/b"),
            &spec(),
            Some("l-1"),
            &["CUDA_VISIBLE_DEVICES", "TESSERA_LEASE_ID"],
        )
        .unwrap();
        assert_eq!(
            r.user,
            User {
                uid: 1000,
                gid: 1000,
                additional_gids: vec![1000, 44]
            }
        );
        assert_eq!(r.pids_limit, Some(100));
        assert_eq!(r.memory_limit, Some(1 << 30));
        assert_eq!(r.memory_swap, None);
        assert_eq!(
            r.lease_env,
            ["CUDA_VISIBLE_DEVICES=MIG-1", "TESSERA_LEASE_ID=l-1"]
        );
        // runc runs a process without a uid or gid as root's: so says the record.
        let mut no_user = spec();
        no_user["process"]["user"] = json!({"gid": 5});
        let r = Record::from_spec("c1", "/r", Path::new("/b"), &no_user, None, &[]).unwrap();
        assert_eq!((r.user.uid, r.user.gid), (0, 5));
        no_user["process"]["user"] = json!({"uid": -1});
        assert!(Record::from_spec("c1", "/r", Path::new("/b"), &no_user, None, &[]).is_err());
    }

    #[test]
    fn records_are_root_owned_keyed_by_root_and_id_and_fail_closed() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!(
                "SKIPPED: records_are_root_owned_keyed_by_root_and_id_and_fail_closed: not root"
            );
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let recs = Records::new(t.path());
        assert!(matches!(
            recs.get("/run/runc", "c1"),
            Err(RecordError::Missing { .. })
        ));
        let r = Record::from_spec("c1", "/run/runc", Path::new("/b"), &spec(), None, &[]).unwrap();
        recs.put(&r).unwrap();
        assert_eq!(recs.get("/run/runc", "c1").unwrap(), r);
        // Another root, another id: another container.
        assert!(matches!(
            recs.get("/run/other", "c1"),
            Err(RecordError::Missing { .. })
        ));
        assert!(matches!(
            recs.get("/run/runc", "c2"),
            Err(RecordError::Missing { .. })
        ));
        // A record someone else could have written is not trusted.
        use std::os::unix::fs::PermissionsExt;
        let file = recs.dir().join(name_of("/run/runc", "c1"));
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            recs.get("/run/runc", "c1"),
            Err(RecordError::File(_))
        ));
        recs.remove("/run/runc", "c1").unwrap();
        recs.remove("/run/runc", "c1").unwrap();
        assert!(matches!(
            recs.get("/run/runc", "c1"),
            Err(RecordError::Missing { .. })
        ));
    }
}
