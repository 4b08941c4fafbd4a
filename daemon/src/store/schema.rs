//! Versioned schema migrations, applied in order inside one transaction each.

use std::path::Path;

use rusqlite::Connection;

use super::StoreError;

/// Each entry upgrades the schema from version i to i+1.
const MIGRATIONS: &[&str] = &[
    // 1: leases, partitions, tokens, intents
    "CREATE TABLE leases (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        state TEXT NOT NULL,
        request_id TEXT,
        created_at_ms INTEGER NOT NULL,
        expires_at_ms INTEGER NOT NULL,
        ended_at_ms INTEGER,
        body TEXT NOT NULL
    );
    CREATE INDEX leases_tenant ON leases(tenant, state);
    -- A request id names at most one non-failed lease per tenant (idempotent retries).
    CREATE UNIQUE INDEX leases_request ON leases(tenant, request_id)
        WHERE request_id IS NOT NULL AND state <> 'failed';
    CREATE TABLE partitions (
        id TEXT PRIMARY KEY,
        gpu INTEGER NOT NULL,
        lease_id TEXT,
        body TEXT NOT NULL
    );
    CREATE TABLE tokens (
        hash TEXT PRIMARY KEY,
        lease_id TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL
    );
    CREATE INDEX tokens_lease ON tokens(lease_id);
    CREATE TABLE intents (
        id INTEGER PRIMARY KEY,
        op TEXT NOT NULL,
        partition_id TEXT NOT NULL,
        lease_id TEXT,
        created_at_ms INTEGER NOT NULL,
        done_at_ms INTEGER,
        outcome TEXT
    );
    CREATE INDEX intents_open ON intents(done_at_ms);",
    // 2: temporary quota raises
    "CREATE TABLE quota_grants (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        expires_at_ms INTEGER NOT NULL,
        body TEXT NOT NULL
    );",
    // 3: usage accounting: one row per ended lease, kept after the lease is pruned.
    "CREATE TABLE usage_records (
        lease_id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        state TEXT NOT NULL,
        start_ms INTEGER NOT NULL,
        end_ms INTEGER NOT NULL,
        mig_slices INTEGER NOT NULL,
        sm_percent INTEGER NOT NULL,
        memory_bytes INTEGER NOT NULL,
        whole_gpus INTEGER NOT NULL
    );
    CREATE INDEX usage_records_window ON usage_records(tenant, start_ms, end_ms);",
    // 4: find recently ended leases without scanning them all
    "CREATE INDEX leases_ended ON leases(ended_at_ms);",
    // 5: GPUs and MIG instances out of service, kept until they are back
    "CREATE TABLE health_marks (
        key TEXT PRIMARY KEY,
        body TEXT NOT NULL
    );",
    // 6: the kubelet device plugin's devices: device id <-> lease, so that a restart
    // advertises the same ids for the same leases (kubelet's checkpoint names them)
    "CREATE TABLE k8s_devices (
        device_id TEXT PRIMARY KEY,
        lease_id TEXT NOT NULL,
        body TEXT NOT NULL
    );",
    // 7: paged listings walk leases by (creation time, id); `meta` keeps the
    // daemon's generation (one more at each start: the high bits of every lease
    // event's revision, so revisions grow across restarts)
    "CREATE INDEX leases_created ON leases(created_at_ms, id);
    CREATE TABLE meta (
        key TEXT PRIMARY KEY,
        value INTEGER NOT NULL
    );",
    // 8: the DRA driver's prepared claims: claim UID -> its leases, so that a
    // prepare is answered the same after a restart and an unprepare releases them
    "CREATE TABLE dra_claims (
        uid TEXT PRIMARY KEY,
        body TEXT NOT NULL
    );",
];

pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

pub fn migrate(conn: &Connection, path: &Path) -> Result<(), StoreError> {
    let found: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if found > SCHEMA_VERSION {
        return Err(StoreError::TooNew {
            path: path.to_path_buf(),
            found,
            known: SCHEMA_VERSION,
        });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        let version = i as i64 + 1;
        conn.execute_batch(&format!(
            "BEGIN IMMEDIATE; {sql}; PRAGMA user_version = {version}; COMMIT;"
        ))
        .inspect_err(|_| {
            let _ = conn.execute_batch("ROLLBACK");
        })?;
    }
    Ok(())
}
