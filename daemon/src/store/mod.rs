//! SQLite persistence: leases, partitions, token hashes, write-ahead intents.
//!
//! * WAL mode with `synchronous=FULL`: a commit that returned is on disk. The one
//!   exception is [`Store::write_relaxed`], for records that an OS crash makes moot
//!   (see there): its commits skip the fsync when no durable write shares them.
//! * One writer thread does *group commit*: writes queued while a commit is in flight
//!   are applied together in the next transaction (each in its own savepoint, so one
//!   failing write does not undo the others), then acknowledged after one fsync.
//!   This is what lets many concurrent CreateLease calls each wait for a durable commit
//!   without each paying a whole fsync.
//! * Versioned schema migrations (`PRAGMA user_version`).
//! * A lock file in the state directory: a second daemon on it refuses to start.
//! * A damaged or unreadable database is an error at open: never start empty.
//!   `PRAGMA quick_check` runs at open unless the last daemon closed the database
//!   cleanly and nothing has written it since (see [`CleanClose`]).
//!
//! Owns: the database file and its schema. May use: model. May not touch: the lease
//! core (it stores what it is given) or the hardware.

mod dra;
mod dra_claim;
pub mod faults;
mod k8s;
mod k8s_device;
mod schema;

pub use dra_claim::{DraClaim, DraDevice};
pub use k8s_device::K8sDevice;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::mpsc;

use rusqlite::{Connection, OpenFlags, OptionalExtension, params};

use crate::model::{Grant, HealthMark, Intent, IntentOp, Lease, LeaseState, Partition};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path}: another tesserad holds this state directory (lock file {lock} is taken); stop it first"
    )]
    Locked { path: PathBuf, lock: PathBuf },
    #[error(
        "{path}: the database is damaged or unreadable ({detail}); refusing to start without it: restore it from a backup or move it aside to start empty"
    )]
    Damaged { path: PathBuf, detail: String },
    #[error(
        "{path}: database schema version {found} is newer than this tesserad knows ({known}); upgrade tesserad"
    )]
    TooNew {
        path: PathBuf,
        found: i64,
        known: i64,
    },
    #[error("database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("database record {what} {id} is corrupt: {detail}")]
    Corrupt {
        what: &'static str,
        id: String,
        detail: String,
    },
    #[error("the store's writer has stopped")]
    WriterGone,
    #[error("a request with id {request_id:?} already exists for tenant {tenant:?}")]
    DuplicateRequest { tenant: String, request_id: String },
}

impl StoreError {
    /// The filesystem of the state directory is full (SQLITE_FULL): nothing was
    /// written; retrying helps once space is freed.
    pub fn is_disk_full(&self) -> bool {
        matches!(
            self,
            StoreError::Sqlite(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DiskFull
        ) || matches!(self, StoreError::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC))
    }

    /// The state directory's disk refuses writes (an I/O error, a filesystem
    /// remounted read-only): nothing was written; retrying helps once the disk is
    /// fixed.
    pub fn is_unwritable(&self) -> bool {
        use rusqlite::ErrorCode as C;
        matches!(
            self,
            StoreError::Sqlite(rusqlite::Error::SqliteFailure(e, _))
                if matches!(e.code, C::SystemIoFailure | C::ReadOnly | C::CannotOpen)
        ) || matches!(self, StoreError::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::EIO | libc::EROFS)))
    }
}

/// Why a batch did not commit: SQLite's code (kept, so a full disk stays a full
/// disk for the caller) and its message.
#[derive(Debug, Clone)]
struct CommitFailed(rusqlite::ffi::Error, String);

impl CommitFailed {
    fn of(e: &rusqlite::Error) -> CommitFailed {
        let code = e
            .sqlite_error()
            .copied()
            .unwrap_or_else(|| rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_IOERR));
        CommitFailed(code, e.to_string())
    }

    fn into_error(self) -> StoreError {
        StoreError::Sqlite(rusqlite::Error::SqliteFailure(self.0, Some(self.1)))
    }
}

type Completion = Box<dyn FnOnce(Result<(), CommitFailed>) + Send>;
/// A queued write. Given no connection (the batch's transaction could not begin),
/// it runs nothing and only hands back its completion.
type JobFn = Box<dyn FnOnce(Option<&Connection>) -> (bool, Completion) + Send>;
/// A queued write, and whether its commit must reach the disk before it is answered.
struct Job {
    durable: bool,
    run: JobFn,
}

/// What the daemon reloads at start.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub leases: Vec<Lease>,
    pub partitions: Vec<Partition>,
    pub intents: Vec<Intent>,
    /// (token hash, lease id) for live leases.
    pub tokens: Vec<(String, String)>,
}

/// Filter for listing leases from the database (ended ones included).
#[derive(Debug, Default, Clone)]
pub struct LeaseQuery {
    pub tenant: Option<String>,
    pub state: Option<LeaseState>,
    pub limit: usize,
}

/// Where a paged listing goes on: the (creation time, id) of the last lease listed.
pub type ListKey = (i64, String);

pub struct Store {
    path: PathBuf,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    reader: Mutex<Connection>,
    /// A snapshot read ahead ([`Store::prefetch_snapshot`]), valid until the first
    /// write is queued.
    prefetched: Mutex<Option<Snapshot>>,
    /// Whether the last open skipped `quick_check` (for tests and the log).
    checked_at_open: bool,
    _lock: nix::fcntl::Flock<File>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl Store {
    /// Open (or create) the database `tessera.db` in `state_dir`.
    pub fn open(state_dir: &Path) -> Result<Store, StoreError> {
        Self::open_with_faults(state_dir, None)
    }

    /// [`Store::open`], with commits failing while `faults` says so (chaos testing).
    pub fn open_with_faults(
        state_dir: &Path,
        faults: Option<faults::StoreFaults>,
    ) -> Result<Store, StoreError> {
        std::fs::create_dir_all(state_dir).map_err(io_err(state_dir))?;
        let lock = lock_state_dir(state_dir)?;

        let path = state_dir.join("tessera.db");
        let damaged = |detail: String| StoreError::Damaged {
            path: path.clone(),
            detail,
        };
        if path.exists() {
            std::fs::File::open(&path).map_err(|e| damaged(e.to_string()))?;
        }
        // Taken (and removed) before the database is opened: whatever happens from
        // here on, the next start checks unless this daemon closes cleanly again.
        let clean = CleanClose::take(&path);
        let writer_conn = open_writer(&path, clean)?;
        let reader = open_reader(&path)?;

        let (tx, rx) = mpsc::channel::<Job>();
        let db = path.clone();
        let writer = std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || {
                writer_loop(&writer_conn, rx, faults);
                CleanClose::record(&writer_conn, &db);
            })
            .map_err(io_err(&path))?;
        Ok(Store {
            path,
            jobs: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
            reader: Mutex::new(reader),
            prefetched: Mutex::new(None),
            checked_at_open: !clean,
            _lock: lock,
        })
    }

    /// Whether this open ran `quick_check` (false: the database was closed cleanly
    /// and not written since).
    pub fn checked_at_open(&self) -> bool {
        self.checked_at_open
    }

    /// Read the start-up snapshot now (while the daemon does other start-up work):
    /// the next [`Store::snapshot`] returns it, unless a write was queued since.
    pub fn prefetch_snapshot(&self) -> Result<(), StoreError> {
        let snap = self.read_snapshot()?;
        *self.prefetched.lock().map_err(|_| StoreError::WriterGone)? = Some(snap);
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Run `f` in a write transaction and wait until it is durably committed.
    /// Concurrent writes are grouped into one commit.
    pub async fn write<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Writer<'_>) -> Result<T, StoreError> + Send + 'static,
    {
        let (otx, orx) = tokio::sync::oneshot::channel::<Result<T, StoreError>>();
        self.submit(f, move |out| {
            let _ = otx.send(out);
        })?;
        orx.await.map_err(|_| StoreError::WriterGone)?
    }

    /// [`Store::write`] for a record that only describes what an OS crash ends anyway:
    /// which containers run on a lease. The commit is atomic and survives the
    /// daemon's own crash (it is in the write-ahead log, in the page cache), but is
    /// not fsynced unless a durable write shares it: a power loss or kernel crash
    /// may lose it, and that same crash has stopped every container it names. A
    /// later durable commit makes it durable too (the log is synced in order).
    /// Saves an fsync on the runtime's path (bind and unbind of each container).
    pub async fn write_relaxed<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Writer<'_>) -> Result<T, StoreError> + Send + 'static,
    {
        let (otx, orx) = tokio::sync::oneshot::channel::<Result<T, StoreError>>();
        self.submit_as(false, f, move |out| {
            let _ = otx.send(out);
        })?;
        orx.await.map_err(|_| StoreError::WriterGone)?
    }

    /// Blocking variant of [`Store::write`] for start-up and tests.
    pub fn write_blocking<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Writer<'_>) -> Result<T, StoreError> + Send + 'static,
    {
        let (otx, orx) = mpsc::channel::<Result<T, StoreError>>();
        self.submit(f, move |out| {
            let _ = otx.send(out);
        })?;
        orx.recv().map_err(|_| StoreError::WriterGone)?
    }

    /// Queue `f` for the writer; `deliver` gets its result once the commit that
    /// carried it is durable (or failed).
    fn submit<T, F, D>(&self, f: F, deliver: D) -> Result<(), StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Writer<'_>) -> Result<T, StoreError> + Send + 'static,
        D: FnOnce(Result<T, StoreError>) + Send + 'static,
    {
        self.submit_as(true, f, deliver)
    }

    /// [`Store::submit`], durable or relaxed (see [`Store::write_relaxed`]).
    fn submit_as<T, F, D>(&self, durable: bool, f: F, deliver: D) -> Result<(), StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Writer<'_>) -> Result<T, StoreError> + Send + 'static,
        D: FnOnce(Result<T, StoreError>) + Send + 'static,
    {
        let run: JobFn = Box::new(move |conn: Option<&Connection>| {
            let result = conn.map(|conn| f(&Writer { conn }));
            let ok = matches!(result, Some(Ok(_)));
            let completion: Completion = Box::new(move |commit: Result<(), CommitFailed>| {
                deliver(match (commit, result) {
                    (Ok(()), Some(r)) => r,
                    (Err(e), _) => Err(e.into_error()),
                    // Not reached: a job that did not run gets its batch's failure.
                    (Ok(()), None) => Err(StoreError::WriterGone),
                });
            });
            (ok, completion)
        });
        // A snapshot read ahead no longer holds once anything is written.
        if let Ok(mut p) = self.prefetched.lock() {
            p.take();
        }
        let guard = self.jobs.lock().map_err(|_| StoreError::WriterGone)?;
        let sender = guard.as_ref().ok_or(StoreError::WriterGone)?;
        sender
            .send(Job { durable, run })
            .map_err(|_| StoreError::WriterGone)
    }

    /// Run `f` on the store's read-only connection (WAL readers never block the
    /// writer). For queries of other modules (usage) that stay inside the store's
    /// one database and connection pair.
    pub fn read<T, E>(&self, f: impl FnOnce(&mut Connection) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        let mut conn = self.reader.lock().map_err(|_| StoreError::WriterGone)?;
        f(&mut conn)
    }

    /// Everything the daemon needs to rebuild its state at start (the one
    /// [`Store::prefetch_snapshot`] read, when no write came since).
    pub fn snapshot(&self) -> Result<Snapshot, StoreError> {
        let ahead = self
            .prefetched
            .lock()
            .map_err(|_| StoreError::WriterGone)?
            .take();
        match ahead {
            Some(snap) => Ok(snap),
            None => self.read_snapshot(),
        }
    }

    fn read_snapshot(&self) -> Result<Snapshot, StoreError> {
        let conn = self.reader.lock().map_err(|_| StoreError::WriterGone)?;
        let mut snap = Snapshot {
            leases: decode_rows(
                &conn,
                "lease",
                "SELECT id, body FROM leases WHERE state IN ('pending','active','revoking') ORDER BY created_at_ms",
            )?,
            partitions: decode_rows(
                &conn,
                "partition",
                "SELECT id, body FROM partitions ORDER BY id",
            )?,
            ..Snapshot::default()
        };
        let mut stmt = conn.prepare(
            "SELECT id, op, partition_id, lease_id, created_at_ms FROM intents WHERE done_at_ms IS NULL ORDER BY id",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, Option<String>>(3)?,
                r.get::<_, i64>(4)?,
            ))
        })?;
        for row in rows {
            let (id, op, partition_id, lease_id, created_at_ms) = row?;
            let op = IntentOp::parse(&op).ok_or_else(|| StoreError::Corrupt {
                what: "intent",
                id: id.to_string(),
                detail: format!("unknown op {op:?}"),
            })?;
            snap.intents.push(Intent {
                id,
                op,
                partition_id,
                lease_id,
                created_at_ms,
            });
        }
        let mut stmt = conn.prepare(
            "SELECT t.hash, t.lease_id FROM tokens t JOIN leases l ON l.id = t.lease_id \
             WHERE l.state IN ('pending','active','revoking')",
        )?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        for row in rows {
            snap.tokens.push(row?);
        }
        Ok(snap)
    }

    pub fn get_lease(&self, id: &str) -> Result<Option<Lease>, StoreError> {
        let conn = self.reader.lock().map_err(|_| StoreError::WriterGone)?;
        let body: Option<String> = conn
            .query_row("SELECT body FROM leases WHERE id = ?1", [id], |r| r.get(0))
            .optional()?;
        body.map(|b| decode("lease", id, &b)).transpose()
    }

    /// The non-failed lease a tenant created with `request_id` (the unique index
    /// `leases_request` answers this without a scan).
    pub fn find_by_request(
        &self,
        tenant: &str,
        request_id: &str,
    ) -> Result<Option<Lease>, StoreError> {
        let conn = self.reader.lock().map_err(|_| StoreError::WriterGone)?;
        let row: Option<(String, String)> = conn
            .prepare_cached(
                "SELECT id, body FROM leases WHERE tenant = ?1 AND request_id = ?2 AND state <> 'failed'",
            )?
            .query_row(params![tenant, request_id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        row.map(|(id, body)| decode("lease", &id, &body))
            .transpose()
    }

    /// Leases from the database, newest first (includes ended ones).
    pub fn list_leases(&self, q: &LeaseQuery) -> Result<Vec<Lease>, StoreError> {
        let conn = self.reader.lock().map_err(|_| StoreError::WriterGone)?;
        let limit = if q.limit == 0 { 1000 } else { q.limit } as i64;
        let mut stmt = conn.prepare(
            "SELECT id, body FROM leases WHERE (?1 IS NULL OR tenant = ?1) AND (?2 IS NULL OR state = ?2) \
             ORDER BY created_at_ms DESC LIMIT ?3",
        )?;
        let rows = stmt.query_map(params![q.tenant, q.state.map(|s| s.as_str()), limit], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, body) = row?;
            out.push(decode("lease", &id, &body)?);
        }
        Ok(out)
    }

    /// Up to `limit` leases (ended ones included) in (creation time, id) order,
    /// after `after` when given: one page of a listing.
    pub fn list_leases_page(
        &self,
        tenant: Option<&str>,
        state: Option<LeaseState>,
        after: Option<&ListKey>,
        limit: usize,
    ) -> Result<Vec<Lease>, StoreError> {
        let conn = self.reader.lock().map_err(|_| StoreError::WriterGone)?;
        let (after_ms, after_id) = match after {
            Some((ms, id)) => (Some(*ms), Some(id.as_str())),
            None => (None, None),
        };
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut stmt = conn.prepare_cached(
            "SELECT id, body FROM leases WHERE (?1 IS NULL OR tenant = ?1) AND (?2 IS NULL OR state = ?2) \
             AND (?3 IS NULL OR created_at_ms > ?3 OR (created_at_ms = ?3 AND id > ?4)) \
             ORDER BY created_at_ms, id LIMIT ?5",
        )?;
        let rows = stmt.query_map(
            params![tenant, state.map(|s| s.as_str()), after_ms, after_id, limit],
            |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
        )?;
        let mut out = Vec::new();
        for row in rows {
            let (id, body) = row?;
            out.push(decode("lease", &id, &body)?);
        }
        Ok(out)
    }

    /// The generation the daemon last recorded (0 before any): one more at each
    /// start, the high bits of lease event revisions.
    pub fn generation(&self) -> Result<u64, StoreError> {
        let conn = self.reader.lock().map_err(|_| StoreError::WriterGone)?;
        let last: Option<i64> = conn
            .query_row("SELECT value FROM meta WHERE key = 'generation'", [], |r| {
                r.get(0)
            })
            .optional()?;
        Ok(last.and_then(|v| u64::try_from(v).ok()).unwrap_or(0))
    }

    /// Queue `f` without waiting for its commit (a failure is logged). It commits
    /// before, or with, every write queued after it: whatever later becomes durable
    /// implies it is.
    pub fn write_detached<F>(&self, what: &'static str, f: F) -> Result<(), StoreError>
    where
        F: FnOnce(&Writer<'_>) -> Result<(), StoreError> + Send + 'static,
    {
        self.submit(f, move |r| {
            if let Err(e) = r {
                tracing::error!(error = %e, "the store could not record {what}");
            }
        })
    }

    /// Temporary quota grants (expired ones included until pruned).
    pub fn grants(&self) -> Result<Vec<Grant>, StoreError> {
        let conn = self.reader.lock().map_err(|_| StoreError::WriterGone)?;
        decode_rows(
            &conn,
            "grant",
            "SELECT id, body FROM quota_grants ORDER BY expires_at_ms",
        )
    }

    /// The health marks (GPUs and instances out of service).
    pub fn health_marks(&self) -> Result<Vec<HealthMark>, StoreError> {
        let conn = self.reader.lock().map_err(|_| StoreError::WriterGone)?;
        decode_rows(
            &conn,
            "health mark",
            "SELECT key, body FROM health_marks ORDER BY key",
        )
    }

    /// Stop the writer after the queued writes are committed.
    pub fn close(&self) {
        if let Ok(mut g) = self.jobs.lock() {
            g.take();
        }
        if let Ok(mut w) = self.writer.lock()
            && let Some(handle) = w.take()
        {
            let _ = handle.join();
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.close();
    }
}

/// Every row of `sql` (an id and a JSON body), decoded as `what`.
fn decode_rows<T: serde::de::DeserializeOwned>(
    conn: &Connection,
    what: &'static str,
    sql: &str,
) -> Result<Vec<T>, StoreError> {
    let mut stmt = conn.prepare(sql)?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
    let mut out = Vec::new();
    for row in rows {
        let (id, body) = row?;
        out.push(decode(what, &id, &body)?);
    }
    Ok(out)
}

fn decode<T: serde::de::DeserializeOwned>(
    what: &'static str,
    id: &str,
    body: &str,
) -> Result<T, StoreError> {
    serde_json::from_str(body).map_err(|e| StoreError::Corrupt {
        what,
        id: id.to_string(),
        detail: e.to_string(),
    })
}

fn encode<T: serde::Serialize>(what: &'static str, id: &str, v: &T) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|e| StoreError::Corrupt {
        what,
        id: id.to_string(),
        detail: e.to_string(),
    })
}

/// The most writes grouped into one commit.
const MAX_BATCH: usize = 256;

/// What a clean close leaves beside the database (`tessera.db.clean`): the
/// database file's identity, size, and change and modification times right after
/// the daemon's last write, once every committed write was copied into it (a
/// truncating WAL checkpoint).
///
/// `PRAGMA quick_check` at open is there for a database damaged while no daemon had
/// it open (a bad restore or copy, a disk error): it reads every page (about 25 ms
/// with 10,000 live leases, growing with the ended leases kept). When the marker
/// matches the file exactly and no WAL holds anything, nothing has written the file
/// since the last daemon, which ran on it, closed it: any write changes its
/// modification and change times (the change time cannot be set back by a user),
/// and a file put in its place has another inode. The check is skipped then, and
/// only then. The marker is removed before the database is opened, so a daemon that
/// crashes leaves none, and the next start checks. Bytes changed on the medium
/// without a write are not caught by this, as they are not while the daemon runs;
/// SQLite reports such a page when it reads it (the start reads every live lease).
/// Removing the marker forces the check.
struct CleanClose;

impl CleanClose {
    fn marker(db: &Path) -> PathBuf {
        let mut name = db.as_os_str().to_os_string();
        name.push(".clean");
        PathBuf::from(name)
    }

    fn stamp(db: &Path) -> Option<String> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(db).ok()?;
        Some(format!(
            "tessera-clean-close 1 dev {} ino {} size {} mtime {}.{:09} ctime {}.{:09}\n",
            m.dev(),
            m.ino(),
            m.size(),
            m.mtime(),
            m.mtime_nsec(),
            m.ctime(),
            m.ctime_nsec()
        ))
    }

    /// Whether the database was closed cleanly and is unchanged since; the marker
    /// is removed either way (a marker that cannot be removed means a check).
    fn take(db: &Path) -> bool {
        let marker = Self::marker(db);
        let Ok(recorded) = std::fs::read_to_string(&marker) else {
            return false;
        };
        if std::fs::remove_file(&marker).is_err() {
            return false;
        }
        let mut wal = db.as_os_str().to_os_string();
        wal.push("-wal");
        let wal_empty = match std::fs::symlink_metadata(PathBuf::from(wal)) {
            Ok(m) => m.len() == 0,
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        wal_empty && Self::stamp(db).is_some_and(|now| now == recorded)
    }

    /// After the writer's last commit: copy the WAL into the database and write the
    /// marker. Nothing is written when that fails (the next start checks).
    fn record(conn: &Connection, db: &Path) {
        let done = conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })
            // Not blocked, and every frame of the log copied into the database.
            .is_ok_and(|(busy, log, copied)| busy == 0 && log == copied);
        if !done {
            return;
        }
        if let Some(stamp) = Self::stamp(db) {
            let _ = std::fs::write(Self::marker(db), stamp);
        }
    }
}

/// The state directory's lock, held for as long as the store is open: a second
/// daemon on the same directory is refused.
fn lock_state_dir(state_dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, StoreError> {
    let lock_path = state_dir.join("tesserad.lock");
    let lock_file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io_err(&lock_path))?;
    nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(
        |(_, errno)| {
            if errno == nix::errno::Errno::EWOULDBLOCK {
                StoreError::Locked {
                    path: state_dir.to_path_buf(),
                    lock: lock_path.clone(),
                }
            } else {
                StoreError::Io {
                    path: lock_path.clone(),
                    source: errno.into(),
                }
            }
        },
    )
}

/// The writer's connection to the database at `path`: checked (`quick_check`)
/// unless it was closed `clean`, in WAL mode with `synchronous=FULL`, migrated.
fn open_writer(path: &Path, clean: bool) -> Result<Connection, StoreError> {
    let damaged = |detail: String| StoreError::Damaged {
        path: path.to_path_buf(),
        detail,
    };
    let writer_conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| damaged(e.to_string()))?;
    if !clean {
        let check: String = writer_conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| damaged(e.to_string()))?;
        if check != "ok" {
            return Err(damaged(check));
        }
    }
    writer_conn
        .pragma_update(None, "journal_mode", "WAL")
        .map_err(|e| damaged(e.to_string()))?;
    writer_conn.pragma_update(None, "synchronous", "FULL")?;
    writer_conn.pragma_update(None, "foreign_keys", "ON")?;
    // Savepoint journals in memory: they only matter within one transaction.
    writer_conn.pragma_update(None, "temp_store", "MEMORY")?;
    writer_conn.set_prepared_statement_cache_capacity(64);
    writer_conn.busy_timeout(std::time::Duration::from_secs(5))?;
    schema::migrate(&writer_conn, path)?;
    Ok(writer_conn)
}

/// The read-only connection to the database at `path`.
fn open_reader(path: &Path) -> Result<Connection, StoreError> {
    let reader = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    reader.busy_timeout(std::time::Duration::from_secs(5))?;
    // Sorts in memory: loading the live leases at start sorts every row (with its
    // body) by creation, which spilled to a temp file under /var/tmp with
    // thousands of leases.
    reader.pragma_update(None, "temp_store", "MEMORY")?;
    Ok(reader)
}

fn writer_loop(conn: &Connection, rx: mpsc::Receiver<Job>, faults: Option<faults::StoreFaults>) {
    // What the connection's `synchronous` is now (FULL from open).
    let mut synced = true;
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        // A batch with any durable write commits with an fsync; one made only of
        // relaxed writes without (NORMAL: in WAL mode, no sync at commit). Set
        // between transactions, as SQLite requires. Should the switch fail, the
        // connection stays as it was: FULL is always safe, so a failed switch to
        // NORMAL costs only speed; a failed switch back fails that batch's writes
        // (as a failed BEGIN does) and is tried again with the next batch.
        let durable = batch.iter().any(|j| j.durable);
        if durable != synced {
            let mode = if durable { "FULL" } else { "NORMAL" };
            if conn.pragma_update(None, "synchronous", mode).is_ok() {
                synced = durable;
            }
        }
        if durable && !synced {
            fail_batch(
                batch,
                CommitFailed(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_IOERR),
                    "could not set synchronous=FULL for a durable commit".into(),
                ),
            );
            continue;
        }
        commit_batch(conn, batch, faults.as_ref());
    }
}

/// Every job of `batch` answered with `failed`, none run (outside a transaction
/// each statement would commit on its own).
fn fail_batch(batch: Vec<Job>, failed: CommitFailed) {
    for job in batch {
        let (_, done) = (job.run)(None);
        done(Err(failed.clone()));
    }
}

/// One transaction for `batch`, each write in its own savepoint, then every job
/// answered with the commit's result.
fn commit_batch(conn: &Connection, batch: Vec<Job>, faults: Option<&faults::StoreFaults>) {
    if let Err(e) = conn.execute_batch("BEGIN IMMEDIATE") {
        fail_batch(batch, CommitFailed::of(&e));
        return;
    }
    let mut completions = Vec::with_capacity(batch.len());
    let run = |sql: &str| conn.prepare_cached(sql).and_then(|mut s| s.execute([]));
    for job in batch {
        // Each write in its own savepoint: one failing write (a duplicate request
        // id, say) is undone alone, the rest of the batch commits.
        let sp = run("SAVEPOINT w");
        let (ok, done) = (job.run)(Some(conn));
        if sp.is_ok() {
            if !ok {
                let _ = run("ROLLBACK TO w");
            }
            let _ = run("RELEASE w");
        }
        completions.push(done);
    }
    let injected = faults.map_or(faults::CommitFault::None, |f| f.commit());
    let commit = match injected {
        faults::CommitFault::None => conn
            .execute_batch("COMMIT")
            .map_err(|e| CommitFailed::of(&e)),
        faults::CommitFault::IoError => Err(CommitFailed(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_IOERR),
            "disk I/O error (injected)".into(),
        )),
        faults::CommitFault::DiskFull => Err(CommitFailed(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
            "database or disk is full (injected)".into(),
        )),
    };
    if commit.is_err() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    for done in completions {
        done(commit.clone());
    }
}

/// Write access inside one transaction.
pub struct Writer<'a> {
    conn: &'a Connection,
}

impl Writer<'_> {
    /// Execute a cached prepared statement (parsing SQL per write costs more than
    /// the write itself).
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.conn.prepare_cached(sql)?.execute(params)
    }

    /// Insert or replace a lease.
    pub fn put_lease(&self, lease: &Lease) -> Result<(), StoreError> {
        let body = encode("lease", &lease.id, lease)?;
        self.exec(
            "INSERT INTO leases (id, tenant, state, request_id, created_at_ms, expires_at_ms, ended_at_ms, body) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
             ON CONFLICT(id) DO UPDATE SET tenant = excluded.tenant, state = excluded.state, request_id = excluded.request_id, \
             expires_at_ms = excluded.expires_at_ms, ended_at_ms = excluded.ended_at_ms, body = excluded.body",
            params![
                lease.id,
                lease.tenant,
                lease.state().as_str(),
                lease.request_id,
                lease.created_at_ms,
                lease.expires_at_ms,
                lease.ended_at_ms(),
                body
            ],
        ).map_err(|e| match &e {
            rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::ConstraintViolation => {
                StoreError::DuplicateRequest {
                    tenant: lease.tenant.clone(),
                    request_id: lease.request_id.clone().unwrap_or_default(),
                }
            }
            _ => StoreError::Sqlite(e),
        })?;
        Ok(())
    }

    pub fn put_partition(&self, p: &Partition) -> Result<(), StoreError> {
        let body = encode("partition", &p.id, p)?;
        self.exec(
            "INSERT INTO partitions (id, gpu, lease_id, body) VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT(id) DO UPDATE SET gpu = excluded.gpu, lease_id = excluded.lease_id, body = excluded.body",
            params![p.id, p.gpu, p.lease_id, body],
        )?;
        Ok(())
    }

    pub fn delete_partition(&self, id: &str) -> Result<(), StoreError> {
        self.exec("DELETE FROM partitions WHERE id = ?1", [id])?;
        Ok(())
    }

    /// A partition its lease no longer holds: a static one is ready and unleased
    /// again, a dynamic one is gone.
    pub fn give_back_partition(&self, p: &Partition) -> Result<(), StoreError> {
        if p.origin == crate::model::Origin::Static {
            let mut back = p.clone();
            back.lease_id = None;
            back.state = crate::model::PartitionState::Ready;
            self.put_partition(&back)
        } else {
            self.delete_partition(&p.id)
        }
    }

    pub fn add_token(&self, hash: &str, lease_id: &str, now_ms: i64) -> Result<(), StoreError> {
        self.exec(
            "INSERT INTO tokens (hash, lease_id, created_at_ms) VALUES (?1, ?2, ?3)",
            params![hash, lease_id, now_ms],
        )?;
        Ok(())
    }

    pub fn delete_tokens(&self, lease_id: &str) -> Result<(), StoreError> {
        self.exec("DELETE FROM tokens WHERE lease_id = ?1", [lease_id])?;
        Ok(())
    }

    /// Record a hardware change about to happen; returns the intent id.
    pub fn begin_intent(
        &self,
        op: IntentOp,
        partition_id: &str,
        lease_id: Option<&str>,
        now_ms: i64,
    ) -> Result<i64, StoreError> {
        // A retried step (a teardown blocked by a busy instance, say) keeps the
        // intent it opened the first time instead of adding one per attempt.
        let open: Option<i64> = self
            .conn
            .prepare_cached(
                "SELECT id FROM intents WHERE done_at_ms IS NULL AND op = ?1 AND partition_id = ?2 \
                 AND lease_id IS ?3 ORDER BY id LIMIT 1",
            )?
            .query_row(params![op.as_str(), partition_id, lease_id], |r| r.get(0))
            .optional()?;
        if let Some(id) = open {
            return Ok(id);
        }
        self.exec(
            "INSERT INTO intents (op, partition_id, lease_id, created_at_ms) VALUES (?1, ?2, ?3, ?4)",
            params![op.as_str(), partition_id, lease_id, now_ms],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    /// Mark an intent done (the hardware change happened, or was undone).
    pub fn finish_intent(&self, id: i64, now_ms: i64, outcome: &str) -> Result<(), StoreError> {
        self.exec(
            "UPDATE intents SET done_at_ms = ?2, outcome = ?3 WHERE id = ?1",
            params![id, now_ms, outcome],
        )?;
        Ok(())
    }

    /// Forget ended leases older than `before_ms` (and intents done before it).
    pub fn prune(&self, before_ms: i64) -> Result<usize, StoreError> {
        let n = self.exec(
            "DELETE FROM leases WHERE ended_at_ms IS NOT NULL AND ended_at_ms < ?1",
            [before_ms],
        )?;
        self.exec(
            "DELETE FROM intents WHERE done_at_ms IS NOT NULL AND done_at_ms < ?1",
            [before_ms],
        )?;
        self.exec(
            "DELETE FROM quota_grants WHERE expires_at_ms < ?1",
            [before_ms],
        )?;
        Ok(n)
    }

    pub fn put_grant(&self, g: &Grant) -> Result<(), StoreError> {
        let body = encode("grant", &g.id, g)?;
        self.exec(
            "INSERT INTO quota_grants (id, tenant, expires_at_ms, body) VALUES (?1, ?2, ?3, ?4)",
            params![g.id, g.tenant, g.expires_at_ms, body],
        )?;
        Ok(())
    }

    pub fn put_health_mark(&self, m: &HealthMark) -> Result<(), StoreError> {
        let key = m.key();
        let body = encode("health mark", &key, m)?;
        self.exec(
            "INSERT INTO health_marks (key, body) VALUES (?1, ?2) \
             ON CONFLICT(key) DO UPDATE SET body = excluded.body",
            params![key, body],
        )?;
        Ok(())
    }

    pub fn delete_health_mark(&self, key: &str) -> Result<(), StoreError> {
        self.exec("DELETE FROM health_marks WHERE key = ?1", params![key])?;
        Ok(())
    }

    /// Record the daemon's generation (see [`Store::generation`]).
    pub fn set_generation(&self, generation: u64) -> Result<(), StoreError> {
        self.exec(
            "INSERT INTO meta (key, value) VALUES ('generation', ?1) \
             ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            [i64::try_from(generation).unwrap_or(i64::MAX)],
        )?;
        Ok(())
    }

    /// Raw access for other modules' tables (usage, quota grants).
    pub fn conn(&self) -> &Connection {
        self.conn
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
