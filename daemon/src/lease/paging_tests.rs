//! Paged listings and revisions: what a client that lists, then watches, sees.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashSet};

use std::sync::Arc;

use super::*;
use crate::config::Config;
use crate::model::LeaseState;
use crate::partition::Shape;
use crate::store::ListKey;
use crate::store::Store;

/// A lease core on one A100 without MIG (MPS shares, oversubscribed) and one H100,
/// keeping `history` events.
fn manager(dir: &std::path::Path, history: usize) -> Arc<LeaseManager> {
    let text = format!(
        "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
         [partition]\nmps_oversubscribe = true\n[api]\nwatch_history = {history}\n\
         [sim]\nstate_file = {s:?}\n[[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n",
        d = dir.display().to_string(),
        s = dir.join("sim.json").display().to_string(),
    );
    let config = Config::parse(std::path::Path::new("test.toml"), &text).unwrap();
    let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
    let store = Arc::new(Store::open(dir).unwrap());
    LeaseManager::start(config, sim, store).unwrap()
}

fn mps(tenant: &str) -> CreateRequest {
    CreateRequest {
        tenant: tenant.into(),
        shape: Some(Shape::Mps {
            sm_percent: 1,
            memory_bytes: 16 << 20,
            mode: crate::gpu::MpsMode::Shared,
        }),
        labels: BTreeMap::new(),
        ..Default::default()
    }
}

async fn create(mgr: &LeaseManager, tenant: &str) -> String {
    mgr.create(mps(tenant)).await.unwrap().lease.id
}

/// Every page of a listing after another, `size` at a time, running `between`
/// after each page; the ids in the order listed.
async fn walk<F, Fut>(
    mgr: &Arc<LeaseManager>,
    state: Option<LeaseState>,
    include_ended: bool,
    size: usize,
    mut between: F,
) -> Vec<String>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut after: Option<ListKey> = None;
    let mut seen = Vec::new();
    let mut last_key: Option<ListKey> = None;
    for n in 0.. {
        let page = mgr
            .list_page(None, state, include_ended, after.as_ref(), size)
            .unwrap();
        assert!(page.leases.len() <= size);
        for (l, _) in &page.leases {
            let key = (l.created_at_ms, l.id.clone());
            assert!(last_key.as_ref().is_none_or(|k| *k < key), "out of order");
            last_key = Some(key);
            seen.push(l.id.clone());
        }
        if !page.more {
            break;
        }
        after = last_key.clone();
        between(n).await;
    }
    seen
}

/// Leases created and ended between the pages of a listing make none of the
/// leases that live throughout be listed twice or skipped.
#[tokio::test]
async fn a_listing_sees_every_lease_alive_throughout_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path(), 64);
    let mut ids = Vec::new();
    for i in 0..40 {
        ids.push(create(&mgr, &format!("t{}", i % 3)).await);
    }
    // Ended during the listing: every third lease, front, middle and back.
    let doomed: Vec<String> = ids.iter().step_by(3).cloned().collect();
    let doomed_set: HashSet<String> = doomed.iter().cloned().collect();
    let m = mgr.clone();
    let queue = std::sync::Mutex::new(doomed.clone());
    let seen = walk(&mgr, None, false, 7, |_| {
        let m = m.clone();
        let next = queue.lock().unwrap().pop();
        async move {
            if let Some(id) = next {
                m.end(&id, LeaseState::Released, "test").await.unwrap();
            }
            create(&m, "late").await;
        }
    })
    .await;
    let mut count = BTreeMap::new();
    for id in &seen {
        *count.entry(id.clone()).or_insert(0) += 1;
    }
    assert!(count.values().all(|&n| n == 1), "listed twice: {count:?}");
    for id in ids.iter().filter(|id| !doomed_set.contains(*id)) {
        assert_eq!(count.get(id), Some(&1), "{id} alive throughout was skipped");
    }
}

/// Ended leases come from the store, paged by the same key.
#[tokio::test]
async fn ended_leases_are_paged_from_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path(), 64);
    let mut ended = Vec::new();
    for _ in 0..12 {
        let id = create(&mgr, "a").await;
        mgr.end(&id, LeaseState::Released, "test").await.unwrap();
        ended.push(id);
    }
    let live = create(&mgr, "a").await;
    let released = walk(&mgr, Some(LeaseState::Released), false, 5, |_| async {}).await;
    assert_eq!(released, ended, "every released lease once, oldest first");
    let all = walk(&mgr, None, true, 5, |_| async {}).await;
    let mut want = ended.clone();
    want.push(live);
    assert_eq!(all, want);
}

/// A list answer's revision, watched from, gives exactly the events after the
/// listing; an older revision than the history keeps is refused, as is one the
/// daemon has not reached; revisions grow across a restart.
#[tokio::test]
async fn a_watch_from_a_listings_revision_replays_what_came_after() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path(), 4);
    create(&mgr, "a").await;
    let listed = mgr.list_page(None, None, false, None, 100).unwrap();
    assert_eq!(listed.leases.len(), 1);
    let r = listed.revision;
    assert_eq!(r, mgr.revision());
    let b = create(&mgr, "b").await;
    let c = create(&mgr, "c").await;
    let sub = mgr.subscribe_from(Some(r)).unwrap();
    let replayed: Vec<(u64, String)> = sub
        .replay
        .iter()
        .map(|e| (e.revision, e.lease.id.clone()))
        .collect();
    assert_eq!(replayed, vec![(r + 1, b.clone()), (r + 2, c.clone())]);
    assert_eq!(sub.start, r + 2);
    // Live after the replay, with no gap.
    let mut live = sub.live;
    let d = create(&mgr, "d").await;
    let ev = live.recv().await.unwrap();
    assert_eq!((ev.revision, ev.lease.id.clone()), (r + 3, d));
    // The history keeps 4 events: r + 4 .. are past what r can resume from.
    for _ in 0..4 {
        create(&mgr, "e").await;
    }
    assert!(matches!(
        mgr.subscribe_from(Some(r)),
        Err(ResumeError::TooOld { .. })
    ));
    let now = mgr.revision();
    assert!(mgr.subscribe_from(Some(now - 4)).unwrap().replay.len() == 4);
    assert!(matches!(
        mgr.subscribe_from(Some(now + 1)),
        Err(ResumeError::Ahead { .. })
    ));
    drop(live);
    drop(mgr);
    let again = manager(dir.path(), 4);
    let after = again.revision();
    assert!(after > now, "{after} after a restart, {now} before");
    // Nothing from before the restart is kept.
    assert!(matches!(
        again.subscribe_from(Some(now)),
        Err(ResumeError::TooOld { .. })
    ));
    assert!(again.subscribe_from(Some(after)).unwrap().replay.is_empty());
}
