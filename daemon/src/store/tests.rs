use std::collections::{BTreeMap, HashSet};

use super::*;
use crate::model::{LeaseState, Origin, PartKind, PartitionState};
use crate::partition::Shape;

fn lease(id: &str, tenant: &str, request_id: Option<&str>) -> Lease {
    Lease::reserved(
        crate::model::NewLease {
            id: id.into(),
            tenant: tenant.into(),
            shape: Shape::WholeGpu,
            partition_id: format!("p-{id}"),
            gpu: 0,
            more_partitions: vec![],
            created_at_ms: 1,
            ttl_secs: 60,
            request_id: request_id.map(String::from),
            labels: BTreeMap::new(),
            priority_class: String::new(),
            burst: false,
        },
        false,
    )
    .with_state(LeaseState::Active, None)
}

#[test]
fn leases_partitions_and_intents_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path()).unwrap();
        store
            .write_blocking(|w| {
                w.put_lease(&lease("l1", "a", Some("r1")))?;
                w.put_partition(&Partition {
                    id: "p-l1".into(),
                    gpu: 0,
                    gpu_uuid: "GPU-x".into(),
                    origin: Origin::Dynamic,
                    state: PartitionState::Ready,
                    lease_id: Some("l1".into()),
                    kind: PartKind::WholeGpu,
                })?;
                w.add_token("h1", "l1", 5)?;
                w.begin_intent(IntentOp::CreateMig, "p-l1", Some("l1"), 5)?;
                Ok(())
            })
            .unwrap();
    }
    let store = Store::open(dir.path()).unwrap();
    let snap = store.snapshot().unwrap();
    assert_eq!(snap.leases.len(), 1);
    assert_eq!(snap.leases[0], lease("l1", "a", Some("r1")));
    assert_eq!(snap.partitions.len(), 1);
    assert_eq!(snap.tokens, vec![("h1".to_string(), "l1".to_string())]);
    assert_eq!(snap.intents.len(), 1);
    assert_eq!(snap.intents[0].op, IntentOp::CreateMig);
}

#[test]
fn second_open_of_the_same_state_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _first = Store::open(dir.path()).unwrap();
    let err = Store::open(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    assert!(err.to_string().contains("another tesserad"), "{err}");
}

#[test]
fn damaged_database_is_refused_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tessera.db");
    std::fs::write(&db, vec![0x42u8; 8192]).unwrap();
    let err = Store::open(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::Damaged { .. }), "{err}");
    // The damaged file is left as it was for the operator.
    assert_eq!(std::fs::read(&db).unwrap(), vec![0x42u8; 8192]);
}

/// quick_check is skipped only when the last daemon closed the database cleanly
/// and nothing wrote it since; the marker is taken at open (a crash leaves none).
#[test]
fn quick_check_is_skipped_only_after_a_clean_close_of_an_untouched_file() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("tessera.db.clean");
    {
        let store = Store::open(dir.path()).unwrap();
        assert!(store.checked_at_open(), "a new database is checked");
        store
            .write_blocking(|w| w.put_lease(&lease("l1", "a", None)))
            .unwrap();
    }
    assert!(marker.exists(), "a clean close leaves its marker");
    {
        let store = Store::open(dir.path()).unwrap();
        assert!(!store.checked_at_open(), "closed cleanly and untouched");
        assert!(!marker.exists(), "the marker is taken at open");
        assert_eq!(store.get_lease("l1").unwrap().unwrap().id, "l1");
    }
    // Damaged after a clean close: the write changed the file's times, so the
    // check runs and refuses it.
    let db = dir.path().join("tessera.db");
    let mut bytes = std::fs::read(&db).unwrap();
    assert!(bytes.len() >= 8192, "at least two pages");
    bytes[4096..8192].fill(0x42);
    std::fs::write(&db, &bytes).unwrap();
    assert!(marker.exists());
    let err = Store::open(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::Damaged { .. }), "{err}");
}

/// A snapshot read ahead is what the start gets, unless something was written
/// since.
#[test]
fn a_prefetched_snapshot_is_dropped_by_a_write() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    store.prefetch_snapshot().unwrap();
    store
        .write_blocking(|w| w.put_lease(&lease("l1", "a", None)))
        .unwrap();
    let snap = store.snapshot().unwrap();
    assert_eq!(snap.leases.len(), 1, "the write is seen");
    store.prefetch_snapshot().unwrap();
    assert_eq!(store.snapshot().unwrap().leases.len(), 1);
}

#[test]
fn a_failing_write_does_not_undo_its_batch_neighbours() {
    let dir = tempfile::tempdir().unwrap();
    let store = std::sync::Arc::new(Store::open(dir.path()).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    rt.block_on(async {
        let mut handles = Vec::new();
        for i in 0..64 {
            let store = store.clone();
            handles.push(tokio::spawn(async move {
                store
                    .write(move |w| {
                        // Every 4th write reuses a request id: a constraint failure.
                        let rid = if i % 4 == 0 {
                            "dup".to_string()
                        } else {
                            format!("r{i}")
                        };
                        w.put_lease(&lease(&format!("l{i}"), "t", Some(&rid)))
                    })
                    .await
            }));
        }
        let mut ok = 0;
        let mut dup = 0;
        for h in handles {
            match h.await.unwrap() {
                Ok(()) => ok += 1,
                Err(StoreError::DuplicateRequest { .. }) => dup += 1,
                Err(e) => panic!("unexpected {e}"),
            }
        }
        // 16 writers share "dup": exactly one wins.
        assert_eq!(dup, 15);
        assert_eq!(ok, 49);
    });
    let all = store
        .list_leases(&LeaseQuery {
            tenant: Some("t".into()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(all.len(), 49);
}

#[test]
fn failed_leases_free_their_request_id() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let failed = lease("l1", "a", Some("r")).with_state(LeaseState::Failed, Some(5));
    store.write_blocking(move |w| w.put_lease(&failed)).unwrap();
    store
        .write_blocking(|w| w.put_lease(&lease("l2", "a", Some("r"))))
        .unwrap();
    // Another tenant may use the same request id.
    store
        .write_blocking(|w| w.put_lease(&lease("l3", "b", Some("r"))))
        .unwrap();
}

#[test]
fn prune_forgets_old_ended_leases_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let old = lease("old", "a", None).with_state(LeaseState::Released, Some(10));
    let live = lease("live", "a", None);
    store
        .write_blocking(move |w| {
            w.put_lease(&old)?;
            w.put_lease(&live)
        })
        .unwrap();
    let n = store.write_blocking(|w| w.prune(100)).unwrap();
    assert_eq!(n, 1);
    assert!(store.get_lease("old").unwrap().is_none());
    assert!(store.get_lease("live").unwrap().is_some());
}

#[test]
fn a_request_id_is_found_among_many_ended_leases() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    store
        .write_blocking(|w| {
            for i in 0..1500 {
                let mut l = lease(&format!("l{i}"), "t", Some(&format!("r{i}")))
                    .with_state(LeaseState::Released, Some(i + 1));
                l.created_at_ms = i;
                w.put_lease(&l)?;
            }
            let failed = lease("lf", "t", Some("rf")).with_state(LeaseState::Failed, Some(2));
            w.put_lease(&failed)
        })
        .unwrap();
    // The oldest one, far beyond any listing limit.
    assert_eq!(store.find_by_request("t", "r0").unwrap().unwrap().id, "l0");
    assert!(store.find_by_request("other", "r0").unwrap().is_none());
    // A failed lease frees its request id.
    assert!(store.find_by_request("t", "rf").unwrap().is_none());
}

#[test]
fn a_retried_step_keeps_its_open_intent_and_a_new_step_opens_one() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let begin = |op, pid: &'static str, lid: Option<&'static str>, at| {
        store
            .write_blocking(move |w| w.begin_intent(op, pid, lid, at))
            .unwrap()
    };
    let first = begin(IntentOp::DestroyMig, "p-1", Some("l1"), 10);
    // Retries of the same teardown: the same open intent, its time unchanged.
    assert_eq!(begin(IntentOp::DestroyMig, "p-1", Some("l1"), 20), first);
    assert_eq!(begin(IntentOp::DestroyMig, "p-1", Some("l1"), 30), first);
    // Another op, partition or lease is a different step.
    let other_op = begin(IntentOp::StopMps, "p-1", Some("l1"), 40);
    let other_part = begin(IntentOp::DestroyMig, "p-2", Some("l1"), 40);
    let no_lease = begin(IntentOp::DestroyMig, "p-1", None, 40);
    let all = [first, other_op, other_part, no_lease];
    assert_eq!(all.iter().collect::<HashSet<_>>().len(), 4, "{all:?}");
    let snap = store.snapshot().unwrap();
    assert_eq!(snap.intents.len(), 4);
    let kept = snap.intents.iter().find(|i| i.id == first).unwrap();
    assert_eq!(kept.created_at_ms, 10);
    // Once finished, the next attempt opens a new one.
    store
        .write_blocking(move |w| w.finish_intent(first, 50, "done"))
        .unwrap();
    assert_ne!(begin(IntentOp::DestroyMig, "p-1", Some("l1"), 60), first);
}

/// The commit mode each kind of write gets: relaxed writes alone commit without a
/// sync (`synchronous` NORMAL), any durable write (alone or after relaxed ones)
/// with one (FULL); a relaxed write is committed all the same and is there after a
/// reopen, as a daemon crash would find it.
#[tokio::test]
async fn relaxed_writes_skip_the_sync_and_durable_ones_never_do() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let mode = |w: &Writer<'_>| -> Result<i64, StoreError> {
        Ok(w.conn.query_row("PRAGMA synchronous", [], |r| r.get(0))?)
    };
    const NORMAL: i64 = 1;
    const FULL: i64 = 2;
    let m = store
        .write_relaxed(move |w| {
            w.put_lease(&lease("l1", "a", None))?;
            mode(w)
        })
        .await
        .unwrap();
    assert_eq!(m, NORMAL, "a relaxed write alone");
    assert_eq!(store.write(mode).await.unwrap(), FULL, "a durable write");
    assert_eq!(store.write_relaxed(mode).await.unwrap(), NORMAL);
    assert_eq!(store.write(mode).await.unwrap(), FULL, "back to FULL");
    // A relaxed and a durable write in one batch: the commit syncs.
    let (r, d) = tokio::join!(store.write_relaxed(mode), store.write(mode));
    let (r, d) = (r.unwrap(), d.unwrap());
    assert_eq!(d, FULL);
    assert!(r == FULL || r == NORMAL, "{r}");
    drop(store);
    let store = Store::open(dir.path()).unwrap();
    let snap = store.snapshot().unwrap();
    assert_eq!(snap.leases, vec![lease("l1", "a", None)]);
}
