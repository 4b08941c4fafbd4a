//! Usage accounting: partition-seconds per tenant, weighted by partition size.
//!
//! Usage is derived from the durable lease rows, never from in-memory timers, so a
//! lease that spans a daemon restart is counted once, from `created_at_ms` to
//! `ended_at_ms` (the partition existed on the hardware the whole time).
//!
//! * When a lease ends its interval and weights are copied into the `usage_records`
//!   table (one row per lease, keyed by lease id: copying twice is a no-op). This
//!   [`sweep`] runs at start, on every lease-ending event and once a minute, so the
//!   record is made long before `lease.retain_ended` prunes the lease row.
//! * A query reads, in one read transaction on the store's read connection, the records plus the lease rows not yet
//!   recorded (live leases count up to `now`), clips every interval to the window
//!   and sums `seconds x weight` per tenant.
//!
//! Weights of a lease: MIG compute slices of its GI profile (a lease on one CI of a
//! GI still holds the whole GI) and the GI's memory; an MPS share's SM percent and
//! memory limit; a whole GPU counts 1 GPU and all its memory. Failed leases (never
//! got hardware) count nothing.
//!
//! May use: model, partition, store. May not touch: the lease core (it is a client
//! of this module), the API or any transport type.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use rusqlite::{Connection, params};
use tracing::warn;

use crate::model::{Lease, LeaseState};
use crate::partition::Shape;
use crate::store::{Store, StoreError};
use tessera_common::clock::now_ms;

const GIB: f64 = (1u64 << 30) as f64;
/// How long after a lease ends its usage record is written (ends in between share
/// the commit).

#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error("usage query: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("usage record of lease {id} is corrupt: {detail}")]
    Corrupt { id: String, detail: String },
    #[error("invalid window: from ({from_ms}) is after to ({to_ms})")]
    BadWindow { from_ms: i64, to_ms: i64 },
}

/// The size of one lease's partition, the multipliers of its seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Weights {
    pub mig_slices: u32,
    pub sm_percent: u32,
    pub memory_bytes: u64,
    pub whole_gpus: u32,
}

impl Weights {
    /// Both together (a lease of several partitions weighs them all).
    pub fn plus(self, o: Weights) -> Weights {
        Weights {
            mig_slices: self.mig_slices.saturating_add(o.mig_slices),
            sm_percent: self.sm_percent.saturating_add(o.sm_percent),
            memory_bytes: self.memory_bytes.saturating_add(o.memory_bytes),
            whole_gpus: self.whole_gpus.saturating_add(o.whole_gpus),
        }
    }
}

/// Sums for one tenant over a window (what GetUsage reports).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantUsage {
    pub tenant: String,
    pub mig_slice_seconds: f64,
    pub mps_sm_percent_seconds: f64,
    pub memory_gib_seconds: f64,
    pub whole_gpu_seconds: f64,
    /// Leases that overlap the window.
    pub leases: u64,
}

/// What the weights of a lease are looked up in: (GPU index, GI profile name) ->
/// (compute slices, memory bytes), and GPU index -> memory bytes.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    pub mig_profiles: HashMap<(u32, String), (u32, u64)>,
    pub gpu_memory: HashMap<u32, u64>,
}

/// "3g.40gb" / "1g.10gb+me" -> (3, 40 GiB): the fallback when no GPU reports the
/// profile any more (MIG switched off since the lease ended).
pub fn parse_profile_name(name: &str) -> Option<(u32, u64)> {
    let base = name.split('+').next()?;
    let (g, mem) = base.split_once('.')?;
    let slices = g.strip_suffix('g')?.parse().ok()?;
    let gb: u64 = mem.strip_suffix("gb")?.parse().ok()?;
    Some((slices, gb << 30))
}

/// A lease's weights (failed leases weigh nothing): one partition's, times the
/// partitions it holds.
pub fn weights(lease: &Lease, catalog: &Catalog) -> Weights {
    let one = weights_of_one(lease, catalog);
    let n = lease.partition_count();
    Weights {
        mig_slices: one.mig_slices.saturating_mul(n),
        sm_percent: one.sm_percent.saturating_mul(n),
        memory_bytes: one.memory_bytes.saturating_mul(u64::from(n)),
        whole_gpus: one.whole_gpus.saturating_mul(n),
    }
}

fn weights_of_one(lease: &Lease, catalog: &Catalog) -> Weights {
    if lease.state() == LeaseState::Failed {
        return Weights::default();
    }
    match &lease.shape {
        Shape::Mig { profile, .. } => {
            let (mig_slices, memory_bytes) = catalog
                .mig_profiles
                .get(&(lease.gpu, profile.clone()))
                .copied()
                .or_else(|| parse_profile_name(profile))
                .unwrap_or_default();
            Weights {
                mig_slices,
                memory_bytes,
                ..Weights::default()
            }
        }
        Shape::Mps {
            sm_percent,
            memory_bytes,
            ..
        } => Weights {
            sm_percent: *sm_percent,
            memory_bytes: *memory_bytes,
            ..Weights::default()
        },
        Shape::WholeGpu => Weights {
            whole_gpus: 1,
            memory_bytes: catalog.gpu_memory.get(&lease.gpu).copied().unwrap_or(0),
            ..Weights::default()
        },
        Shape::MigMps { .. } => mig_mps_weights(&lease.shape),
    }
}

/// An MPS share inside MIG weighs its SM percent of the whole GPU (the instance's
/// compute slices, of 7, times its share of them) and its memory.
fn mig_mps_weights(shape: &Shape) -> Weights {
    let Shape::MigMps {
        profile,
        sm_percent,
        memory_bytes,
    } = shape
    else {
        return Weights::default();
    };
    let slices = parse_profile_name(profile).map_or(7, |(s, _)| s);
    Weights {
        sm_percent: sm_percent.saturating_mul(slices).div_ceil(7),
        memory_bytes: *memory_bytes,
        ..Weights::default()
    }
}

/// Milliseconds of `[start, end)` inside `[from, to)`; 0 when they do not meet.
pub fn overlap_ms(start: i64, end: i64, from: i64, to: i64) -> i64 {
    (end.min(to) - start.max(from)).max(0)
}

/// One lease's interval and weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Interval {
    pub tenant: String,
    pub start_ms: i64,
    /// None while the lease is live (counted up to the query's `now`).
    pub end_ms: Option<i64>,
    pub weights: Weights,
}

/// Sum intervals per tenant over `[from, to)`, with live intervals ending at `now`.
/// Sorted by tenant; tenants without overlap are left out.
///
/// Sums are exact integers (milliseconds x weight) until the final division, so
/// windows that split a period add up to the whole and CSV exports carry no
/// floating-point noise from summing.
pub fn accumulate(intervals: &[Interval], from_ms: i64, to_ms: i64, now: i64) -> Vec<TenantUsage> {
    #[derive(Default)]
    struct Sums {
        leases: u64,
        mig: u128,
        sm: u128,
        mem: u128,
        whole: u128,
    }
    let mut out: BTreeMap<&str, Sums> = BTreeMap::new();
    for i in intervals {
        let end = i.end_ms.unwrap_or(now).max(i.start_ms);
        if !(i.start_ms < to_ms && end > from_ms) {
            continue;
        }
        let ms = overlap_ms(i.start_ms, end, from_ms, to_ms) as u128;
        let u = out.entry(&i.tenant).or_default();
        u.leases += 1;
        u.mig += ms * u128::from(i.weights.mig_slices);
        u.sm += ms * u128::from(i.weights.sm_percent);
        u.mem += ms * u128::from(i.weights.memory_bytes);
        u.whole += ms * u128::from(i.weights.whole_gpus);
    }
    out.into_iter()
        .map(|(tenant, u)| TenantUsage {
            tenant: tenant.to_string(),
            leases: u.leases,
            mig_slice_seconds: u.mig as f64 / 1000.0,
            mps_sm_percent_seconds: u.sm as f64 / 1000.0,
            memory_gib_seconds: u.mem as f64 / (1000.0 * GIB),
            whole_gpu_seconds: u.whole as f64 / 1000.0,
        })
        .collect()
}

/// Write one ended lease's usage record (in the caller's transaction; idempotent).
pub fn insert_record(conn: &Connection, lease: &Lease, wt: &Weights) -> rusqlite::Result<()> {
    let end = lease.ended_at_ms().unwrap_or(lease.created_at_ms);
    conn.prepare_cached(
        "INSERT OR IGNORE INTO usage_records \
         (lease_id, tenant, state, start_ms, end_ms, mig_slices, sm_percent, memory_bytes, whole_gpus) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    )?
    .execute(params![
        lease.id,
        lease.tenant,
        lease.state().as_str(),
        lease.created_at_ms,
        end.max(lease.created_at_ms),
        wt.mig_slices,
        wt.sm_percent,
        wt.memory_bytes as i64,
        wt.whole_gpus
    ])?;
    Ok(())
}

/// The weights of a lease from its partition record (what the lease manager knows
/// when the lease ends): MIG slices and instance memory, MPS limits, whole GPUs.
pub fn weights_of_partition(
    lease: &Lease,
    p: &crate::model::Partition,
    gpu_memory: u64,
) -> Weights {
    use crate::model::PartKind;
    if lease.state() == LeaseState::Failed {
        return Weights::default();
    }
    match &p.kind {
        PartKind::Mig(m) => Weights {
            mig_slices: m.slices,
            memory_bytes: m.memory_bytes,
            ..Weights::default()
        },
        PartKind::Mps(m) if m.host.is_some() => mig_mps_weights(&lease.shape),
        PartKind::Mps(m) => Weights {
            sm_percent: m.sm_percent,
            memory_bytes: m.memory_bytes,
            ..Weights::default()
        },
        PartKind::WholeGpu => Weights {
            whole_gpus: 1,
            memory_bytes: gpu_memory,
            ..Weights::default()
        },
    }
}

/// Copy every ended, not yet recorded lease into `usage_records`. Returns how many
/// were recorded. Idempotent.
pub async fn sweep(store: &Store, catalog: Catalog) -> Result<usize, UsageError> {
    sweep_since(store, catalog, 0).await
}

/// [`sweep`] limited to leases that ended at or after `since_ms` (an index range
/// scan: the writer's transaction stays short however many leases ended before).
pub async fn sweep_since(
    store: &Store,
    catalog: Catalog,
    since_ms: i64,
) -> Result<usize, UsageError> {
    let n = store
        .write(move |w| {
            let conn = w.conn();
            let mut stmt = conn.prepare_cached(
                "SELECT id, body FROM leases WHERE ended_at_ms >= ?1 \
                 AND NOT EXISTS (SELECT 1 FROM usage_records u WHERE u.lease_id = leases.id)",
            )?;
            let rows: Vec<(String, String)> = stmt
                .query_map([since_ms], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<Result<_, _>>()?;
            let mut n = 0;
            for (id, body) in rows {
                let lease: Lease = match serde_json::from_str(&body) {
                    Ok(l) => l,
                    Err(e) => {
                        warn!(lease = %id, error = %e, "usage: unreadable lease row skipped");
                        continue;
                    }
                };
                insert_record(conn, &lease, &weights(&lease, &catalog))?;
                n += 1;
            }
            Ok(n)
        })
        .await?;
    Ok(n)
}

/// Usage per tenant over `[from_ms, to_ms)` (`to_ms` 0 = now; `tenant` None = all),
/// read through the store's read connection.
pub fn query(
    store: &Store,
    tenant: Option<&str>,
    from_ms: i64,
    to_ms: i64,
    catalog: &Catalog,
) -> Result<Vec<TenantUsage>, UsageError> {
    store.read(|conn| query_on(conn, tenant, from_ms, to_ms, catalog))
}

fn query_on(
    conn: &mut Connection,
    tenant: Option<&str>,
    from_ms: i64,
    to_ms: i64,
    catalog: &Catalog,
) -> Result<Vec<TenantUsage>, UsageError> {
    let now = now_ms();
    let to_ms = if to_ms <= 0 { now } else { to_ms };
    let from_ms = from_ms.max(0);
    if from_ms > to_ms {
        return Err(UsageError::BadWindow { from_ms, to_ms });
    }
    // One read transaction: a lease recorded between the two reads must not be
    // seen twice (or not at all).
    let tx = conn.transaction()?;
    let mut intervals = Vec::new();
    {
        let mut stmt = tx.prepare_cached(
            "SELECT tenant, start_ms, end_ms, mig_slices, sm_percent, memory_bytes, whole_gpus \
             FROM usage_records WHERE state <> 'failed' AND (?1 IS NULL OR tenant = ?1) \
             AND start_ms <= ?3 AND end_ms >= ?2",
        )?;
        let rows = stmt.query_map(params![tenant, from_ms, to_ms], |r| {
            Ok(Interval {
                tenant: r.get(0)?,
                start_ms: r.get(1)?,
                end_ms: Some(r.get(2)?),
                weights: Weights {
                    mig_slices: r.get(3)?,
                    sm_percent: r.get(4)?,
                    memory_bytes: r.get::<_, i64>(5)?.max(0) as u64,
                    whole_gpus: r.get(6)?,
                },
            })
        })?;
        for row in rows {
            intervals.push(row?);
        }
        let mut stmt = tx.prepare_cached(
            "SELECT id, body FROM leases WHERE state <> 'failed' AND (?1 IS NULL OR tenant = ?1) \
             AND created_at_ms <= ?3 AND (ended_at_ms IS NULL OR ended_at_ms >= ?2) \
             AND id NOT IN (SELECT lease_id FROM usage_records)",
        )?;
        let rows = stmt.query_map(params![tenant, from_ms, to_ms], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
        })?;
        for row in rows {
            let (id, body) = row?;
            let lease: Lease = serde_json::from_str(&body).map_err(|e| UsageError::Corrupt {
                id: id.clone(),
                detail: e.to_string(),
            })?;
            intervals.push(Interval {
                weights: weights(&lease, catalog),
                end_ms: lease.ended_at_ms(),
                tenant: lease.tenant,
                start_ms: lease.created_at_ms,
            });
        }
    }
    tx.finish()?;
    Ok(accumulate(&intervals, from_ms, to_ms, now))
}

/// Record ended leases at start, after every lease-ending event and once a minute,
/// until `stop` turns true.
pub async fn run_recorder(
    store: Arc<Store>,
    catalog: impl Fn() -> Catalog,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    // The lease manager writes each lease's usage record in the same commit that
    // ends the lease. This sweep is the safety net (leases ended by an older
    // tesserad, or by reconciliation at start): at start, then hourly.
    let mut tick = tokio::time::interval(Duration::from_secs(3600));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            r = stop.changed() => {
                if r.is_err() || *stop.borrow() { return; }
                continue;
            }
        }
        if let Err(e) = sweep(&store, catalog()).await {
            warn!(error = %e, "usage: recording ended leases failed; retrying within the hour");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const H: i64 = 3_600_000;

    fn iv(tenant: &str, start: i64, end: Option<i64>, w: Weights) -> Interval {
        Interval {
            tenant: tenant.into(),
            start_ms: start,
            end_ms: end,
            weights: w,
        }
    }

    fn mig(slices: u32, gib: u64) -> Weights {
        Weights {
            mig_slices: slices,
            memory_bytes: gib << 30,
            ..Weights::default()
        }
    }

    #[test]
    fn an_mps_share_inside_mig_weighs_its_part_of_the_whole_gpu() {
        let l = lease(
            Shape::MigMps {
                profile: "3g.40gb".into(),
                sm_percent: 50,
                memory_bytes: 4 << 30,
            },
            LeaseState::Active,
        );
        let w = weights(&l, &Catalog::default());
        // 50 % of 3 of 7 compute slices, rounded up.
        assert_eq!((w.sm_percent, w.memory_bytes), (22, 4 << 30));
    }

    #[test]
    fn overlap_clips_both_ends() {
        assert_eq!(overlap_ms(0, 10, 2, 5), 3);
        assert_eq!(overlap_ms(3, 10, 0, 5), 2);
        assert_eq!(overlap_ms(0, 10, 0, 10), 10);
        assert_eq!(overlap_ms(0, 10, 10, 20), 0);
        assert_eq!(overlap_ms(5, 8, 0, 3), 0);
    }

    #[test]
    fn window_clips_intervals_and_weights_multiply() {
        // 3g.40gb from 1h to 3h; window 2h..10h -> 1h counted.
        let v = accumulate(
            &[iv("a", H, Some(3 * H), mig(3, 40))],
            2 * H,
            10 * H,
            20 * H,
        );
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].mig_slice_seconds, 3.0 * 3600.0);
        assert_eq!(v[0].memory_gib_seconds, 40.0 * 3600.0);
        assert_eq!(v[0].leases, 1);
    }

    #[test]
    fn live_leases_count_up_to_now_only() {
        let mps = Weights {
            sm_percent: 25,
            memory_bytes: 8 << 30,
            ..Weights::default()
        };
        let v = accumulate(&[iv("b", 0, None, mps)], 0, 10 * H, 2 * H);
        assert_eq!(v[0].mps_sm_percent_seconds, 25.0 * 7200.0);
        assert_eq!(v[0].memory_gib_seconds, 8.0 * 7200.0);
    }

    #[test]
    fn tenants_are_summed_separately_and_outside_windows_dropped() {
        let whole = Weights {
            whole_gpus: 1,
            memory_bytes: 80 << 30,
            ..Weights::default()
        };
        let v = accumulate(
            &[
                iv("a", 0, Some(H), whole),
                iv("a", H, Some(2 * H), whole),
                iv("b", 5 * H, Some(6 * H), whole),
            ],
            0,
            2 * H,
            10 * H,
        );
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].tenant, "a");
        assert_eq!(v[0].whole_gpu_seconds, 7200.0);
        assert_eq!(v[0].leases, 2);
    }

    #[test]
    fn split_windows_add_up_to_the_whole_exactly() {
        let w = Weights {
            mig_slices: 3,
            memory_bytes: 40 << 30,
            ..Weights::default()
        };
        let ivs = [iv("a", 1_123, Some(7 * H + 4_567), w)];
        let whole = accumulate(&ivs, 0, 10 * H, 10 * H);
        let first = accumulate(&ivs, 0, 3 * H + 1, 10 * H);
        let second = accumulate(&ivs, 3 * H + 1, 10 * H, 10 * H);
        assert_eq!(
            first[0].mig_slice_seconds + second[0].mig_slice_seconds,
            whole[0].mig_slice_seconds
        );
        // 3 slices x (7h + 3.444 s): no floating-point noise.
        assert_eq!(whole[0].mig_slice_seconds.to_string(), "75610.332");
    }

    #[test]
    fn profile_names_parse_as_fallback() {
        assert_eq!(parse_profile_name("3g.40gb"), Some((3, 40 << 30)));
        assert_eq!(parse_profile_name("1g.10gb+me"), Some((1, 10 << 30)));
        assert_eq!(parse_profile_name("bogus"), None);
    }

    fn lease(shape: Shape, state: LeaseState) -> Lease {
        Lease::reserved(
            crate::model::NewLease {
                id: "l1".into(),
                tenant: "t".into(),
                shape,
                partition_id: "p".into(),
                gpu: 1,
                more_partitions: vec![],
                created_at_ms: 0,
                ttl_secs: 3600,
                request_id: None,
                labels: BTreeMap::new(),
                priority_class: String::new(),
                burst: false,
            },
            false,
        )
        .with_state(state, None)
    }

    #[test]
    fn weights_follow_the_shape() {
        let mut cat = Catalog::default();
        // NVML's size on GPU 1 (not the name's round number).
        cat.mig_profiles
            .insert((1, "2g.20gb".into()), (2, 19 << 30));
        cat.gpu_memory.insert(1, 80 << 30);
        let m = Shape::Mig {
            profile: "2g.20gb".into(),
            compute_profile: Some("1c".into()),
        };
        assert_eq!(
            weights(&lease(m.clone(), LeaseState::Active), &cat),
            mig(2, 19)
        );
        // A GPU that does not report the profile (MIG off since): the name's numbers.
        let mut on_gpu0 = lease(m.clone(), LeaseState::Released);
        on_gpu0.gpu = 0;
        assert_eq!(weights(&on_gpu0, &cat), mig(2, 20));
        assert_eq!(
            weights(&lease(Shape::WholeGpu, LeaseState::Released), &cat),
            Weights {
                whole_gpus: 1,
                memory_bytes: 80 << 30,
                ..Weights::default()
            }
        );
        assert_eq!(
            weights(&lease(m, LeaseState::Failed), &cat),
            Weights::default()
        );
    }

    #[tokio::test]
    async fn sweep_records_ended_leases_once_and_query_reads_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let ended = lease(
            Shape::Mps {
                sm_percent: 50,
                memory_bytes: 4 << 30,
                mode: crate::gpu::MpsMode::Isolated,
            },
            LeaseState::Released,
        );
        let mut ended = ended.with_state(LeaseState::Released, Some(1000 + 2 * H));
        ended.created_at_ms = 1000;
        let mut live = lease(Shape::WholeGpu, LeaseState::Active);
        live.id = "l2".into();
        live.tenant = "u".into();
        live.created_at_ms = now_ms() - H;
        let (a, b) = (ended.clone(), live.clone());
        store
            .write(move |w| {
                w.put_lease(&a)?;
                w.put_lease(&b)
            })
            .await
            .unwrap();
        let cat = Catalog::default();
        let before = query(&store, None, 0, 0, &cat).unwrap();
        assert_eq!(sweep(&store, cat.clone()).await.unwrap(), 1);
        assert_eq!(sweep(&store, cat.clone()).await.unwrap(), 0);
        let after = query(&store, None, 0, 0, &cat).unwrap();
        assert_eq!(before.len(), 2);
        assert_eq!(after.len(), 2);
        assert_eq!(before[0], after[0], "recording must not change the sums");
        assert_eq!(after[0].tenant, "t");
        assert_eq!(after[0].mps_sm_percent_seconds, 50.0 * 7200.0);
        assert!(after[1].whole_gpu_seconds >= 3600.0);
        // The lease row pruned: the record still counts.
        store.write(|w| w.prune(i64::MAX)).await.unwrap();
        let pruned = query(&store, Some("t"), 0, 0, &cat).unwrap();
        assert_eq!(pruned, vec![after[0].clone()]);
    }
}
