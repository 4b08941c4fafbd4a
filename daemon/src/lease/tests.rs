//! Tests of the lease core that need its private state.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use std::sync::Arc;

use super::*;
use crate::config::Config;
use crate::gpu::GpuBackend;
use crate::model::LeaseState;
use crate::partition::Shape;
use crate::store::LeaseQuery;
use crate::store::Store;

fn manager(dir: &std::path::Path) -> Arc<LeaseManager> {
    manager_and_sim(dir).0
}

fn test_config(dir: &std::path::Path) -> Config {
    let text = format!(
        "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
         [sim]\nstate_file = {s:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n\
         [[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n",
        d = dir.display().to_string(),
        s = dir.join("sim.json").display().to_string(),
    );
    Config::parse(std::path::Path::new("test.toml"), &text).unwrap()
}

fn manager_and_sim(dir: &std::path::Path) -> (Arc<LeaseManager>, Arc<crate::gpu::SimBackend>) {
    let config = test_config(dir);
    let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
    let store = Arc::new(Store::open(dir).unwrap());
    (
        LeaseManager::start(config, sim.clone(), store).unwrap(),
        sim,
    )
}

/// A lease core on simulated GPUs (`gpus`: `[[sim.gpus]]` tables) with `[partition]`
/// settings `partition` (TOML lines).
fn sim_manager(
    dir: &std::path::Path,
    partition: &str,
    gpus: &str,
) -> (Arc<LeaseManager>, Arc<crate::gpu::SimBackend>) {
    let text = format!(
        "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
         [partition]\n{partition}\n[sim]\nstate_file = {s:?}\n{gpus}",
        d = dir.display().to_string(),
        s = dir.join("sim.json").display().to_string(),
    );
    let config = Config::parse(std::path::Path::new("test.toml"), &text).unwrap();
    let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
    let store = Arc::new(Store::open(dir).unwrap());
    (
        LeaseManager::start(config, sim.clone(), store).unwrap(),
        sim,
    )
}

/// `n` H100s with MIG on, as `[[sim.gpus]]` tables.
fn h100s(n: usize) -> String {
    "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n".repeat(n)
}

fn mig_request(request_id: &str) -> CreateRequest {
    CreateRequest {
        tenant: "team-a".into(),
        shape: Some(Shape::Mig {
            profile: "1g.10gb".into(),
            compute_profile: None,
        }),
        ttl: None,
        request_id: Some(request_id.into()),
        labels: BTreeMap::new(),
        priority_class: None,
        gpu_index: None,
        need: None,
        count: 0,
        topology: Default::default(),
        exact: None,
    }
}

/// A retry that misses the first call in memory but finds its lease live in
/// the store (the first call reserved and wrote it in between) is a replay with
/// a token, not the "ended lease" answer that carries none.
#[tokio::test]
async fn a_retry_racing_the_first_call_still_gets_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path());
    let first = mgr.create(mig_request("job-7")).await.unwrap();
    assert!(!first.replayed);
    let key = ("team-a".to_string(), "job-7".to_string());
    // Open the window: the lease is in the store but not (yet) in memory.
    let lid = mgr.lock().requests.remove(&key).unwrap();
    let m2 = mgr.clone();
    let restore = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(30)).await;
        m2.lock().requests.insert(key, lid);
    });
    let retry = mgr.create(mig_request("job-7")).await.unwrap();
    restore.await.unwrap();
    assert!(retry.replayed);
    assert_eq!(retry.lease.id, first.lease.id);
    let token = retry.token.expect("a live lease's retry carries a token");
    let resolved = mgr.resolve_token(&token).unwrap();
    assert_eq!(resolved.lease.id, first.lease.id);
}

/// An ended lease is answered from the store without a token.
#[tokio::test]
async fn a_retry_after_release_reports_the_ended_lease_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path());
    let first = mgr.create(mig_request("job-8")).await.unwrap();
    mgr.end(&first.lease.id, LeaseState::Released, "test")
        .await
        .unwrap();
    let retry = mgr.create(mig_request("job-8")).await.unwrap();
    assert!(retry.replayed);
    assert_eq!(retry.lease.id, first.lease.id);
    assert!(!retry.lease.state().is_live());
    assert!(retry.token.is_none());
}

/// An ended lease leaves nothing behind in memory keyed by its id: a daemon that
/// serves leases for months must not grow with every lease a runtime ever resolved.
#[tokio::test]
async fn an_ended_lease_leaves_no_per_lease_state_behind() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path());
    let created = mgr.create(mig_request("job-9")).await.unwrap();
    let id = created.lease.id.clone();
    mgr.resolve_token(created.token.as_ref().unwrap()).unwrap();
    {
        let mut st = mgr.lock();
        assert!(st.resolved.contains(&id));
        st.expiring_notified.insert(id.clone());
        st.mps_backoff.insert(id.clone(), (1, 0));
    }
    mgr.end(&id, LeaseState::Released, "test").await.unwrap();
    let st = mgr.lock();
    assert!(st.leases.get(&id).is_none());
    assert!(!st.resolved.contains(&id), "resolved kept the ended lease");
    assert!(!st.expiring_notified.contains(&id));
    assert!(!st.mps_backoff.contains_key(&id));
    assert!(st.requests.is_empty());
    drop(st);
    assert!(
        mgr.resolve_token(created.token.as_ref().unwrap()).is_err(),
        "the ended lease's token still resolves"
    );
}

/// A teardown blocked by a process in the instance is retried with growing
/// waits, under the one intent it opened, and finishes once the process is gone.
#[tokio::test]
async fn a_blocked_teardown_backs_off_keeps_one_intent_and_finishes_later() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = manager_and_sim(dir.path());
    let created = mgr.create(mig_request("job-9")).await.unwrap();
    let part = created.partition.unwrap();
    let m = part.mig().unwrap().clone();
    sim.add_process(0, m.gi_id, m.ci_id, 4242, 1 << 20).unwrap();
    let mut events = mgr.subscribe();
    let id = created.lease.id.clone();
    let l = mgr.end(&id, LeaseState::Released, "test").await.unwrap();
    assert_eq!(l.state(), LeaseState::Revoking);
    // Two seconds of housekeeping ticks every 50 ms: without a backoff that
    // is 40 attempts; with one (250 ms doubling) at most a handful.
    for _ in 0..40 {
        mgr.tick().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut failed = 0;
    while let Ok(ev) = events.try_recv() {
        if ev.lease.id == id && ev.message.starts_with("teardown failed") {
            failed += 1;
        }
    }
    assert!((3..=8).contains(&failed), "{failed} failed attempts in 2 s");
    let open: Vec<_> = mgr
        .store
        .snapshot()
        .unwrap()
        .intents
        .into_iter()
        .filter(|i| i.partition_id == part.id)
        .collect();
    assert_eq!(open.len(), 1, "one open intent for the teardown: {open:?}");
    // The blocker leaves: the next due retry (at most 5 s away) finishes it.
    sim.remove_process(0, 4242).unwrap();
    let mut state = LeaseState::Revoking;
    for _ in 0..120 {
        mgr.tick().await;
        state = mgr.get(&id).unwrap().0.state();
        if state != LeaseState::Revoking {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state, LeaseState::Released);
    assert!(sim.instances(0).unwrap().is_empty());
    assert!(mgr.lock().teardown_backoff.is_empty());
}

/// A crash left a GI without its CI and the driver refuses to destroy it at
/// start: the daemon still starts, fails the lease, and counts the GI as a
/// foreign, occupied instance instead of placing anything over it.
#[tokio::test]
async fn a_half_created_instance_that_cannot_be_undone_does_not_stop_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = manager_and_sim(dir.path());
    sim.crash_next_create_after_gi(0).unwrap();
    sim.fail_next_destroy(0).unwrap();
    let mut req = mig_request("job-10");
    req.gpu_index = Some(0);
    assert!(mgr.create(req).await.is_err());
    let all = mgr.store.list_leases(&LeaseQuery::default()).unwrap();
    assert_eq!(all.len(), 1);
    let lid = all[0].id.clone();
    drop(mgr);
    assert_eq!(sim.instances(0).unwrap().len(), 1, "the half GI is there");
    sim.fail_next_destroy(0).unwrap();
    let (mgr, sim) = manager_and_sim(dir.path());
    let half = sim.instances(0).unwrap();
    assert_eq!(half.len(), 1, "left alone");
    assert!(half[0].ci_id.is_none());
    let (l, _) = mgr.get(&lid).unwrap();
    assert_eq!(l.state(), LeaseState::Failed);
    let gpu0 = mgr.node().into_iter().find(|g| g.info.index == 0).unwrap();
    assert_eq!(
        gpu0.free_slices, 7,
        "the foreign GI holds one of the 8 memory slices"
    );
    // The other slices still serve leases, never over the foreign GI.
    let mut req = mig_request("job-11");
    req.gpu_index = Some(0);
    let c = mgr.create(req).await.unwrap();
    let placed = c.partition.unwrap().mig().unwrap().placement;
    assert_ne!(placed, half[0].placement);
}

/// An MPS daemon that cannot be restarted at start does not stop the start;
/// the supervisor restarts it once it can.
#[tokio::test]
async fn an_mps_daemon_that_cannot_restart_at_start_is_retried_later() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = manager_and_sim(dir.path());
    let mut req = mig_request("job-12");
    req.shape = Some(Shape::Mps {
        sm_percent: 25,
        memory_bytes: 4 << 30,
        mode: crate::gpu::MpsMode::Isolated,
    });
    let c = mgr.create(req).await.unwrap();
    let lid = c.lease.id.clone();
    let pipe_dir = c.partition.unwrap().mps().unwrap().pipe_dir.clone();
    drop(mgr);
    // The daemon died with tesserad, and its pipe directory cannot be made.
    sim.kill_mps(&lid).unwrap();
    let blocker = pipe_dir.parent().unwrap().to_path_buf();
    std::fs::remove_dir_all(&blocker).unwrap();
    std::fs::write(&blocker, b"not a directory").unwrap();
    let (mgr, sim) = manager_and_sim(dir.path());
    assert_eq!(mgr.get(&lid).unwrap().0.state(), LeaseState::Active);
    let running = |sim: &crate::gpu::SimBackend| {
        sim.mps_daemons()
            .unwrap()
            .iter()
            .any(|d| d.spec.lease_id == lid && d.running)
    };
    assert!(!running(&sim));
    std::fs::remove_file(&blocker).unwrap();
    let mut up = false;
    for _ in 0..100 {
        mgr.tick().await;
        if running(&sim) {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(up, "the supervisor restarted the MPS daemon");
}

/// A shared MPS server that died with tesserad is restarted once at start for all
/// the leases it serves; a lease still pending on it (its intent open) is adopted;
/// releasing them stops it only with the last.
#[tokio::test]
async fn a_shared_mps_server_survives_a_restart_for_all_its_leases() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = manager_and_sim(dir.path());
    let shared = |sm| CreateRequest {
        tenant: "team-a".into(),
        shape: Some(Shape::Mps {
            sm_percent: sm,
            memory_bytes: 4 << 30,
            mode: crate::gpu::MpsMode::Shared,
        }),
        ..Default::default()
    };
    let a = mgr.create(shared(20)).await.unwrap().lease.id;
    let b = mgr.create(shared(30)).await.unwrap().lease.id;
    let key = crate::model::shared_mps_key(1, "team-a");
    let servers = |sim: &crate::gpu::SimBackend| -> Vec<(String, bool)> {
        sim.mps_daemons()
            .unwrap()
            .into_iter()
            .map(|d| (d.spec.lease_id, d.running))
            .collect()
    };
    assert_eq!(servers(&sim), vec![(key.clone(), true)]);
    drop(mgr);
    sim.kill_mps(&key).unwrap();
    let (mgr, sim) = manager_and_sim(dir.path());
    assert_eq!(servers(&sim), vec![(key.clone(), true)], "restarted once");
    for id in [&a, &b] {
        assert_eq!(mgr.get(id).unwrap().0.state(), LeaseState::Active);
    }
    mgr.end(&a, LeaseState::Released, "done").await.unwrap();
    assert_eq!(servers(&sim), vec![(key.clone(), true)], "b still uses it");
    mgr.end(&b, LeaseState::Released, "done").await.unwrap();
    assert!(servers(&sim).is_empty(), "the last lease stops it");
    assert!(
        !dir.path().join("mps").join(&key).exists(),
        "its directories go with it"
    );
}

/// MPS inside MIG with `on_release = "keep"`: the instance set up for the first
/// share stays after the last one as a free pool instance, which the next host
/// request (another tenant) takes without creating one; a MIG lease can take it too.
#[tokio::test]
async fn an_idle_mps_host_is_kept_per_on_release_and_reused() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.partition.on_release = crate::config::OnRelease::Keep;
    let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
    let store = Arc::new(Store::open(dir.path()).unwrap());
    let mgr = LeaseManager::start(config, sim.clone(), store).unwrap();
    let share = |tenant: &str| CreateRequest {
        tenant: tenant.into(),
        shape: Some(Shape::MigMps {
            profile: "3g.40gb".into(),
            sm_percent: 50,
            memory_bytes: 4 << 30,
        }),
        ..Default::default()
    };
    let instances = |sim: &crate::gpu::SimBackend| sim.instances(0).unwrap();
    let a = mgr.create(share("team-a")).await.unwrap();
    let host = a.partition.unwrap().mps().unwrap().host.clone().unwrap();
    assert_eq!(instances(&sim).len(), 1);
    mgr.end(&a.lease.id, LeaseState::Released, "done")
        .await
        .unwrap();
    mgr.tick().await;
    assert_eq!(instances(&sim).len(), 1, "kept");
    // Another tenant's share gets the kept instance as its host.
    let b = mgr.create(share("team-b")).await.unwrap();
    assert_eq!(
        b.partition.unwrap().mps().unwrap().host.as_deref(),
        Some(host.as_str())
    );
    assert_eq!(instances(&sim).len(), 1, "no new instance");
    mgr.end(&b.lease.id, LeaseState::Released, "done")
        .await
        .unwrap();
    mgr.tick().await;
    // Free again: a MIG lease of the profile takes it.
    let mut req = mig_request("mig-1");
    req.shape = Some(Shape::Mig {
        profile: "3g.40gb".into(),
        compute_profile: None,
    });
    let m = mgr.create(req).await.unwrap();
    assert_eq!(m.partition.unwrap().id, host);
    assert_eq!(instances(&sim).len(), 1);
}

/// A manager whose host side effects are only recorded, holding one isolated MPS
/// lease of team-a.
async fn isolated_mps_lease_on_recording_host(
    dir: &std::path::Path,
) -> (Arc<LeaseManager>, Arc<crate::host::RecordingHost>, Created) {
    let config = test_config(dir);
    let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
    let store = Arc::new(Store::open(dir).unwrap());
    let host = Arc::new(crate::host::RecordingHost::with_proc_devices(""));
    let mgr = LeaseManager::start_with_host(config, sim, store, host.clone()).unwrap();
    let created = mgr
        .create(CreateRequest {
            tenant: "team-a".into(),
            shape: Some(Shape::Mps {
                sm_percent: 25,
                memory_bytes: 4 << 30,
                mode: crate::gpu::MpsMode::Isolated,
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    (mgr, host, created)
}

/// Every container start resolves a token; `/proc/devices` (where the uvm and caps
/// majors come from) is read once for starts that come close together, not once each.
#[tokio::test]
async fn close_resolves_read_proc_devices_once() {
    use crate::host::HostCall;
    let dir = tempfile::tempdir().unwrap();
    let (mgr, host, created) = isolated_mps_lease_on_recording_host(dir.path()).await;
    let token = created.token.unwrap();
    let first = mgr.resolve_token(&token).unwrap();
    for _ in 0..3 {
        let again = mgr.resolve_token(&token).unwrap();
        assert_eq!(again.grant.devices, first.grant.devices);
    }
    let reads = host
        .calls()
        .iter()
        .filter(|c| matches!(c, HostCall::ProcDevices))
        .count();
    assert_eq!(reads, 1, "{:?}", host.calls());
}

/// The host's side effects of a lease's life go through `HostOps`: an MPS lease's
/// private directories, their hand-over to the container's uid, the container
/// stopped through its cgroup on release, and the directories removed after.
#[tokio::test]
async fn an_mps_lease_drives_the_host_through_host_ops() {
    use crate::host::HostCall;
    let dir = tempfile::tempdir().unwrap();
    let (mgr, host, created) = isolated_mps_lease_on_recording_host(dir.path()).await;
    let lease = created.lease.clone();
    let pipe = created
        .partition
        .as_ref()
        .unwrap()
        .mps()
        .unwrap()
        .pipe_dir
        .clone();
    let binding = crate::model::ContainerBinding {
        id: "c1".into(),
        cgroup_path: format!("/tessera/{}/c1", lease.id),
        ..Default::default()
    };
    mgr.bind_container(created.token.as_deref().unwrap(), binding, Some(1000))
        .await
        .unwrap();
    let ended = mgr
        .end(&lease.id, LeaseState::Released, "done")
        .await
        .unwrap();
    assert_eq!(ended.state(), LeaseState::Released);
    let calls = host.calls();
    let base = pipe.parent().unwrap().to_path_buf();
    let want = [
        HostCall::CreatePrivateDir(pipe.clone()),
        HostCall::Chown {
            path: pipe.clone(),
            uid: 1000,
        },
        HostCall::StopCgroup {
            container: "c1".into(),
            rel: format!("tessera/{}/c1", lease.id),
        },
        HostCall::RemoveDirAll(base),
    ];
    for w in &want {
        assert!(calls.contains(w), "{w:?} missing from {calls:?}");
    }
    let pos = |c: &HostCall| calls.iter().position(|x| x == c).unwrap();
    assert!(
        pos(&want[2]) < pos(&want[3]),
        "containers stop before the directories go"
    );
    assert!(!pipe.exists(), "the recording host touched nothing");
}

// ------------------------------------------------------------------ moves of idle leases

fn two_h100(
    dir: &std::path::Path,
    move_idle: bool,
) -> (Arc<LeaseManager>, Arc<crate::gpu::SimBackend>) {
    two_h100_compacting(dir, move_idle, false)
}

fn two_h100_compacting(
    dir: &std::path::Path,
    move_idle: bool,
    compact_idle: bool,
) -> (Arc<LeaseManager>, Arc<crate::gpu::SimBackend>) {
    sim_manager(
        dir,
        &format!("move_idle = {move_idle}\ncompact_idle = {compact_idle}"),
        &h100s(2),
    )
}

/// gpu0 holds a pinned 4g (slices 0-3, never moved) with room left beside it; gpu1
/// holds one idle 1g (`a`, not pinned). A 7g fits only once `a` moves to gpu0.
/// Returns (a, the pinned 4g).
async fn idle_lease_in_the_way(mgr: &LeaseManager, pin_a: bool) -> (Created, Created) {
    idle_lease_in_the_way_labelled(mgr, pin_a, BTreeMap::new()).await
}

async fn idle_lease_in_the_way_labelled(
    mgr: &LeaseManager,
    pin_a: bool,
    labels: BTreeMap<String, String>,
) -> (Created, Created) {
    let pinned = |id: &str, profile: &str| CreateRequest {
        shape: Some(Shape::Mig {
            profile: profile.into(),
            compute_profile: None,
        }),
        gpu_index: Some(0),
        ..mig_request(id)
    };
    let four = mgr.create(pinned("pin-4g", "4g.40gb")).await.unwrap();
    let three = mgr.create(pinned("pin-3g", "3g.40gb")).await.unwrap();
    let mut small = mig_request("small-a");
    small.gpu_index = pin_a.then_some(1);
    small.labels = labels;
    let a = mgr.create(small).await.unwrap();
    assert_eq!(a.lease.gpu, 1, "gpu0 is full");
    mgr.end(&three.lease.id, LeaseState::Released, "test")
        .await
        .unwrap();
    (a, four)
}

fn seven_g(request_id: &str) -> CreateRequest {
    CreateRequest {
        shape: Some(Shape::Mig {
            profile: "7g.80gb".into(),
            compute_profile: None,
        }),
        ..mig_request(request_id)
    }
}

fn instance_count(sim: &crate::gpu::SimBackend) -> usize {
    (0..2).map(|g| sim.instances(g).unwrap().len()).sum()
}

/// A move of `a` (in the way of a 7g beside the pinned 4g) that did not happen:
/// the lease active on its partition as created, the two instances, no intent.
fn assert_not_moved(mgr: &LeaseManager, sim: &crate::gpu::SimBackend, a: &Created) {
    let (l, p) = mgr.get(&a.lease.id).unwrap();
    assert_eq!(l.state(), LeaseState::Active);
    assert_eq!(
        p.unwrap(),
        a.partition.clone().unwrap(),
        "still where it was"
    );
    assert_eq!(instance_count(sim), 2);
    assert!(mgr.store.snapshot().unwrap().intents.is_empty());
}

#[tokio::test]
async fn an_idle_lease_moves_to_make_room_keeping_its_id_and_token() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let mut events = mgr.subscribe();
    let (a, _) = idle_lease_in_the_way(&mgr, false).await;
    let big = mgr.create(seven_g("big")).await.unwrap();
    assert_eq!(big.lease.gpu, 1);
    let (la, _) = mgr.get(&a.lease.id).unwrap();
    assert_eq!(la.gpu, 0, "the idle lease went next to the pinned 4g");
    assert_eq!(instance_count(&sim), 3);
    // Same id, same token, and the token names the instance where it is now.
    let r = mgr.resolve_token(a.token.as_ref().unwrap()).unwrap();
    assert_eq!(r.lease.id, a.lease.id);
    assert_eq!(r.partition.gpu, 0);
    assert_ne!(
        r.partition.mig().unwrap().uuid,
        a.partition.as_ref().unwrap().mig().unwrap().uuid,
        "a re-created MIG instance has a new UUID"
    );
    let mut saw = false;
    while let Ok(ev) = events.try_recv() {
        if ev.kind == EventKind::Moved {
            assert_eq!(ev.lease.id, a.lease.id);
            assert!(ev.message.contains("moved to make room"), "{}", ev.message);
            saw = true;
        }
    }
    assert!(saw, "watchers hear of the move");
    // The move is durable: a restart finds the lease where it went.
    drop(mgr);
    let (mgr, sim) = two_h100(dir.path(), true);
    let (l, p) = mgr.get(&a.lease.id).unwrap();
    assert_eq!(l.state(), LeaseState::Active);
    assert_eq!((l.gpu, p.unwrap().gpu), (0, 0));
    assert_eq!(instance_count(&sim), 3);
    assert!(mgr.store.snapshot().unwrap().intents.is_empty());
}

#[tokio::test]
async fn housekeeping_compacts_an_idle_lease_so_a_7g_fits_without_moves() {
    // Moves at refusal off: only housekeeping can make room.
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100_compacting(dir.path(), false, true);
    let mut events = mgr.subscribe();
    let (a, _) = idle_lease_in_the_way(&mgr, false).await;
    mgr.tick().await;
    let (la, _) = mgr.get(&a.lease.id).unwrap();
    assert_eq!(la.gpu, 0, "the idle 1g went next to the pinned 4g");
    let r = mgr.resolve_token(a.token.as_ref().unwrap()).unwrap();
    assert_eq!(
        (r.lease.id.as_str(), r.partition.gpu),
        (a.lease.id.as_str(), 0)
    );
    let moved: Vec<String> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|ev| ev.kind == EventKind::Moved)
        .map(|ev| ev.message.clone())
        .collect();
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert!(moved[0].contains("to compact free space"), "{}", moved[0]);
    // Nothing more to gain: the next pass moves nothing.
    mgr.tick().await;
    assert_eq!(mgr.get(&a.lease.id).unwrap().0.gpu, 0);
    let big = mgr.create(seven_g("big")).await.unwrap();
    assert_eq!(big.lease.gpu, 1);
    assert_eq!(instance_count(&sim), 3);
    assert!(mgr.store.snapshot().unwrap().intents.is_empty());

    // Off (the default), or the lease in use: housekeeping leaves it, the 7g is refused.
    for in_use in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (mgr, _) = two_h100_compacting(dir.path(), false, in_use);
        let (a, _) = idle_lease_in_the_way(&mgr, false).await;
        if in_use {
            mgr.resolve_token(a.token.as_ref().unwrap()).unwrap();
        }
        mgr.tick().await;
        assert_eq!(mgr.get(&a.lease.id).unwrap().0.gpu, 1);
        let err = mgr.create(seven_g("big")).await.unwrap_err();
        assert!(matches!(err, LeaseError::ResourceExhausted(_)), "{err}");
    }
}

#[tokio::test]
async fn leases_in_use_or_pinned_never_move_and_moves_can_be_turned_off() {
    let refused = |err: LeaseError| {
        assert!(matches!(err, LeaseError::ResourceExhausted(_)), "{err}");
    };
    // A runtime asked for its devices.
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let (a, _) = idle_lease_in_the_way(&mgr, false).await;
    mgr.resolve_token(a.token.as_ref().unwrap()).unwrap();
    refused(mgr.create(seven_g("big")).await.unwrap_err());
    assert_eq!(mgr.get(&a.lease.id).unwrap().0.gpu, 1);
    assert_eq!(instance_count(&sim), 2);
    // Pinned to its GPU by its request.
    let dir = tempfile::tempdir().unwrap();
    let (mgr, _) = two_h100(dir.path(), true);
    let (a, _) = idle_lease_in_the_way(&mgr, true).await;
    refused(mgr.create(seven_g("big")).await.unwrap_err());
    assert_eq!(mgr.get(&a.lease.id).unwrap().0.gpu, 1);
    // A device plugin lease a pod holds (a reserved one moves: the plugin rewrites
    // its CDI spec).
    let dir = tempfile::tempdir().unwrap();
    let (mgr, _) = two_h100(dir.path(), true);
    let k8s = BTreeMap::from([
        (
            crate::names::LABEL_K8S_CLASS.to_string(),
            "mig-1g.10gb".to_string(),
        ),
        (
            crate::names::LABEL_K8S_POD.to_string(),
            "trainer".to_string(),
        ),
    ]);
    let (a, _) = idle_lease_in_the_way_labelled(&mgr, false, k8s).await;
    refused(mgr.create(seven_g("big")).await.unwrap_err());
    assert_eq!(mgr.get(&a.lease.id).unwrap().0.gpu, 1);
    let dir = tempfile::tempdir().unwrap();
    let (mgr, _) = two_h100(dir.path(), true);
    let reserved = BTreeMap::from([(
        crate::names::LABEL_K8S_CLASS.to_string(),
        "mig-1g.10gb".to_string(),
    )]);
    let (a, _) = idle_lease_in_the_way_labelled(&mgr, false, reserved).await;
    mgr.create(seven_g("big")).await.unwrap();
    assert_eq!(
        mgr.get(&a.lease.id).unwrap().0.gpu,
        0,
        "a reserved lease moves"
    );
    // move_idle = false.
    let dir = tempfile::tempdir().unwrap();
    let (mgr, _) = two_h100(dir.path(), false);
    idle_lease_in_the_way(&mgr, false).await;
    refused(mgr.create(seven_g("big")).await.unwrap_err());
}

#[tokio::test]
async fn a_move_whose_destroy_fails_leaves_the_lease_where_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let (a, _) = idle_lease_in_the_way(&mgr, false).await;
    sim.fail_next_destroy(1).unwrap();
    let err = mgr.create(seven_g("big")).await.unwrap_err();
    assert!(matches!(err, LeaseError::ResourceExhausted(_)), "{err}");
    assert!(err.to_string().contains("moving an idle lease"), "{err}");
    assert_not_moved(&mgr, &sim, &a);
}

/// A move is planned under the lock and done after it: when the place it planned
/// was taken meanwhile (a lease created there), the move is refused and changes
/// nothing, never making a second instance over the first.
#[tokio::test]
async fn a_move_to_a_place_taken_since_it_was_planned_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let (a, four) = idle_lease_in_the_way(&mgr, false).await;
    let from = a.partition.as_ref().unwrap().mig().unwrap().clone();
    let taken = four.partition.as_ref().unwrap().mig().unwrap().placement;
    let mv = crate::partition::Move {
        from_gpu: 1,
        from: from.placement,
        gi_profile_id: from.gi_profile_id,
        to_gpu: 0,
        to: crate::gpu::Placement {
            start: taken.start,
            size: from.placement.size,
        },
    };
    let err = mgr.move_idle(&mv, "test").await.unwrap_err();
    assert!(matches!(err, LeaseError::FailedPrecondition(_)), "{err}");
    assert!(err.to_string().contains("taken"), "{err}");
    assert_not_moved(&mgr, &sim, &a);
    assert_eq!(mgr.get(&a.lease.id).unwrap().0.gpu, 1);
    no_half_made_gi(&sim, 2);
}

/// A move whose new instance is left half made (its GI without a CI, as an error
/// between the two NVML steps leaves it): that GI goes, the lease's instance is made
/// again where it was, and no instance is left that no record explains, then or
/// after a restart.
#[tokio::test]
async fn a_move_whose_create_is_half_done_leaves_no_gi_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let (a, _) = idle_lease_in_the_way(&mgr, false).await;
    sim.crash_next_create_after_gi(0).unwrap();
    let err = mgr.create(seven_g("big")).await.unwrap_err();
    assert!(matches!(err, LeaseError::ResourceExhausted(_)), "{err}");
    let check = |mgr: &LeaseManager, sim: &crate::gpu::SimBackend| {
        let (l, p) = mgr.get(&a.lease.id).unwrap();
        assert_eq!(l.state(), LeaseState::Active);
        assert_eq!(p.unwrap().gpu, 1, "back where it was");
        assert_eq!(instance_count(sim), 2, "the 4g and the lease's 1g");
        no_half_made_gi(sim, 2);
        assert!(mgr.store.snapshot().unwrap().intents.is_empty());
        assert!(mgr.lock().foreign.is_empty());
    };
    check(&mgr, &sim);
    drop(mgr);
    let (mgr, sim) = two_h100(dir.path(), true);
    check(&mgr, &sim);
}

/// Every instance on the simulated GPUs has its CI (no GI left half made).
fn no_half_made_gi(sim: &crate::gpu::SimBackend, gpus: u32) {
    let all: Vec<_> = (0..gpus).flat_map(|g| sim.instances(g).unwrap()).collect();
    assert!(
        all.iter().all(|i| i.ci_id.is_some()),
        "a GI without CI: {all:?}"
    );
}

/// A static layout whose instance is left half made at start (its GI, no CI): the
/// start fails saying why, leaves no GI behind, and the next start makes the layout.
#[test]
fn a_static_instance_half_made_at_start_leaves_no_gi_behind() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
         [[partition.static]]\ngpu = 0\ndevices = {{ \"1g.10gb\" = 2 }}\n\
         [sim]\nstate_file = {s:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n",
        d = dir.path().display().to_string(),
        s = dir.path().join("sim.json").display().to_string(),
    );
    let config = Config::parse(std::path::Path::new("test.toml"), &text).unwrap();
    let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
    sim.crash_next_create_after_gi(0).unwrap();
    let store = Arc::new(Store::open(dir.path()).unwrap());
    let err = LeaseManager::start(config.clone(), sim.clone(), store).unwrap_err();
    assert!(err.to_string().contains("injected crash"), "{err}");
    assert!(sim.instances(0).unwrap().is_empty(), "nothing left");
    let store = Arc::new(Store::open(dir.path()).unwrap());
    let mgr = LeaseManager::start(config, sim.clone(), store).unwrap();
    assert_eq!(sim.instances(0).unwrap().len(), 2);
    no_half_made_gi(&sim, 1);
    assert!(mgr.lock().foreign.is_empty());
    assert!(mgr.store.snapshot().unwrap().intents.is_empty());
}

/// An instance that vanished while the daemon was down and whose re-creation is
/// left half made: the lease is revoked, and no GI is left behind.
#[tokio::test]
async fn a_vanished_instance_half_made_again_at_start_leaves_no_gi_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), false);
    let c = mgr.create(mig_request("gone")).await.unwrap();
    let p = c.partition.clone().unwrap();
    drop(mgr);
    sim.destroy_instance(p.gpu, p.mig().unwrap().gi_id.unwrap())
        .unwrap();
    sim.crash_next_create_after_gi(p.gpu).unwrap();
    let (mgr, sim) = two_h100(dir.path(), false);
    let (l, _) = mgr.get(&c.lease.id).unwrap();
    assert_eq!(l.state(), LeaseState::Revoked, "{:?}", l.end_reason());
    assert_eq!(instance_count(&sim), 0, "nothing left");
    assert!(mgr.lock().foreign.is_empty());
}

/// A crash right after the move's intent was written (nothing done on the hardware
/// yet): the next start destroys the old instance and creates the new one; or, when
/// the old one cannot be destroyed, drops the move and keeps the lease where it was.
#[tokio::test]
async fn a_move_interrupted_by_a_crash_is_finished_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let (a, four) = idle_lease_in_the_way(&mgr, false).await;
    crash_mid_move(&mgr, &a, &four).await;
    drop(mgr);
    let (mgr, sim2) = two_h100(dir.path(), true);
    drop(sim);
    let (l, p) = mgr.get(&a.lease.id).unwrap();
    assert_eq!(l.state(), LeaseState::Active);
    assert_eq!(l.partition_id, "p-moved");
    let p = p.unwrap();
    assert_eq!(p.gpu, 0);
    assert_eq!(p.state, crate::model::PartitionState::Ready);
    assert!(
        sim2.instances(1).unwrap().is_empty(),
        "the old instance is gone"
    );
    assert_eq!(sim2.instances(0).unwrap().len(), 2);
    assert!(mgr.store.snapshot().unwrap().intents.is_empty());
    let r = mgr.resolve_token(a.token.as_ref().unwrap()).unwrap();
    assert_eq!(r.partition.id, "p-moved");

    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let (a, four) = idle_lease_in_the_way(&mgr, false).await;
    crash_mid_move(&mgr, &a, &four).await;
    drop(mgr);
    sim.fail_next_destroy(1).unwrap();
    let (mgr, sim2) = two_h100(dir.path(), true);
    assert_not_moved(&mgr, &sim2, &a);
}

/// An interrupted move whose new instance cannot be made at start: the old one is
/// destroyed as the move goes, then made again at its place, and the lease stays
/// there (a new MIG device UUID), not lost.
#[tokio::test]
async fn an_interrupted_move_that_cannot_finish_moves_back_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let (a, four) = idle_lease_in_the_way(&mgr, false).await;
    crash_mid_move(&mgr, &a, &four).await;
    drop(mgr);
    sim.fail_next_create(0, crate::gpu::sim::CreateStage::Gi)
        .unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let (l, p) = mgr.get(&a.lease.id).unwrap();
    assert_eq!(l.state(), LeaseState::Active, "{:?}", l.end_reason());
    let (p, was) = (p.unwrap(), a.partition.clone().unwrap());
    assert_eq!((l.gpu, p.gpu, &p.id), (1, 1, &was.id), "back where it was");
    assert_eq!(p.mig().unwrap().placement, was.mig().unwrap().placement);
    assert_ne!(p.mig().unwrap().uuid, was.mig().unwrap().uuid, "made again");
    assert_eq!(instance_count(&sim), 2);
    no_half_made_gi(&sim, 2);
    assert!(mgr.store.snapshot().unwrap().intents.is_empty());
    let r = mgr.resolve_token(a.token.as_ref().unwrap()).unwrap();
    assert_eq!(r.partition.mig().unwrap().uuid, p.mig().unwrap().uuid);
}

/// The records a crash leaves right after a move's intent: `a` (gpu1) was going to
/// slice 4 of gpu0, beside the pinned 4g.
async fn crash_mid_move(mgr: &LeaseManager, a: &Created, four: &Created) {
    let old = a.partition.clone().unwrap();
    let mut new = old.clone();
    new.id = "p-moved".into();
    new.gpu = 0;
    new.gpu_uuid = four.partition.as_ref().unwrap().gpu_uuid.clone();
    new.state = crate::model::PartitionState::Creating;
    if let crate::model::PartKind::Mig(m) = &mut new.kind {
        m.placement.start = 4;
        m.gi_id = None;
        m.ci_id = None;
        m.uuid = None;
    }
    let (n2, lid) = (new.clone(), a.lease.id.clone());
    mgr.store
        .write(move |w| {
            w.put_partition(&n2)?;
            w.begin_intent(crate::model::IntentOp::MoveMig, &n2.id, Some(&lid), 1)
        })
        .await
        .unwrap();
}

/// A GPU container stays in its pod's cgroup: the binding records where, a revocation
/// writes its reason to the container's termination-message file (where kubelet reads
/// it) before stopping it through that cgroup, and keeps the reason in the events.
#[tokio::test]
async fn a_revocation_writes_its_reason_then_stops_the_pod_cgroup() {
    use crate::host::{HostCall, RecordingHost};
    let dir = tempfile::tempdir().unwrap();
    let config = test_config(dir.path());
    let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
    let store = Arc::new(Store::open(dir.path()).unwrap());
    let host = Arc::new(RecordingHost::with_proc_devices(""));
    let mgr = LeaseManager::start_with_host(config, sim, store, host.clone()).unwrap();
    let created = mgr.create(mig_request("r-term")).await.unwrap();
    let token = created.token.clone().unwrap();
    let lease = created.lease.clone();
    let term = "/var/lib/kubelet/pods/uid-1/containers/app/1a2b";
    let binding = crate::model::ContainerBinding {
        id: "abc123".into(),
        cgroup_path: "kubepods-burstable-poduid_1.slice:cri-containerd:abc123".into(),
        termination_log: term.into(),
        pod: "uid-1".into(),
        ..Default::default()
    };
    mgr.bind_container(&token, binding, None).await.unwrap();
    // A cgroup that is not the container's own is refused at bind time.
    for bad in ["/system.slice", "/kubepods/burstable/poduid-1"] {
        let e = mgr
            .bind_container(
                &token,
                crate::model::ContainerBinding {
                    id: "abc124".into(),
                    cgroup_path: bad.into(),
                    ..Default::default()
                },
                None,
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("cgroup_path"), "{bad}: {e}");
    }
    for bad in [
        "/var/lib/kubelet/../../etc/shadow",
        "/proc/sys/kernel/core_pattern",
        "/sys/kernel/uevent_helper",
        "relative/termination-log",
    ] {
        let e = mgr
            .bind_container(
                &token,
                crate::model::ContainerBinding {
                    id: "abc125".into(),
                    termination_log: bad.into(),
                    ..Default::default()
                },
                None,
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("termination_log_path"), "{bad}: {e}");
    }
    let mut events = mgr.subscribe();
    let ended = mgr
        .end(&lease.id, LeaseState::Revoked, "preempted by team-b")
        .await
        .unwrap();
    assert_eq!(ended.state(), LeaseState::Revoked);
    assert!(ended.containers.is_empty(), "an ended lease lists none");
    let calls = host.calls();
    let note = HostCall::TerminationMessage {
        path: term.into(),
        message: format!("tessera: lease {} revoked: preempted by team-b", lease.id),
    };
    let stop = HostCall::StopCgroup {
        container: "abc123".into(),
        rel: "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-poduid_1.slice/cri-containerd-abc123.scope".into(),
    };
    let pos = |c: &HostCall| calls.iter().position(|x| x == c);
    assert!(
        pos(&note).unwrap() < pos(&stop).unwrap(),
        "the reason is written before the container stops: {calls:?}"
    );
    let mut said = Vec::new();
    while let Ok(ev) = events.try_recv() {
        said.push(ev.message.clone());
    }
    assert!(
        said.iter().any(|m| m.contains("preempted by team-b")),
        "the reason is in the lease's events: {said:?}"
    );
}

/// A lease's token belongs to the first pod that uses it: another pod presenting it
/// is refused, the same pod (a restarted container) and non-Kubernetes callers are not.
#[tokio::test]
async fn a_token_is_bound_to_the_first_pod_that_uses_it() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path());
    let created = mgr.create(mig_request("r-pod")).await.unwrap();
    let token = created.token.clone().unwrap();
    let bind = |id: &str, pod: &str| crate::model::ContainerBinding {
        id: id.into(),
        cgroup_path: format!("/kubepods/pod{pod}/{id}"),
        pod: pod.into(),
        ..Default::default()
    };
    let l = mgr
        .bind_container(&token, bind("c1", "uid-a"), None)
        .await
        .unwrap();
    assert_eq!(l.pod.as_deref(), Some("uid-a"));
    mgr.bind_container(&token, bind("c2", "uid-a"), None)
        .await
        .unwrap();
    let e = mgr
        .bind_container(&token, bind("c3", "uid-b"), None)
        .await
        .unwrap_err();
    assert!(matches!(e, LeaseError::PermissionDenied(_)), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("bound to pod uid-a") && msg.contains("pod uid-b may not use it"),
        "{msg}"
    );
    // A container that names no pod is refused too, not let through.
    let e = mgr
        .bind_container(&token, bind("c5", ""), None)
        .await
        .unwrap_err();
    assert!(matches!(e, LeaseError::PermissionDenied(_)), "{e:?}");
    assert!(
        e.to_string()
            .contains("a container in no pod may not use it"),
        "{e}"
    );
    let (l, _) = mgr.get(&created.lease.id).unwrap();
    assert_eq!(
        l.containers
            .iter()
            .map(|c| c.id.as_str())
            .collect::<Vec<_>>(),
        ["c1", "c2"],
        "the refused container is not bound"
    );
    // Kept across a restart of the daemon.
    drop(mgr);
    let mgr = manager(dir.path());
    assert!(
        mgr.bind_container(&token, bind("c4", "uid-b"), None)
            .await
            .is_err()
    );
}

/// A binding whose container is gone from its runtime's state (a delete that never
/// reached the daemon) is dropped by housekeeping; a live one, or one just made, stays.
#[tokio::test]
async fn bindings_of_containers_that_are_gone_are_dropped() {
    use crate::host::RecordingHost;
    let dir = tempfile::tempdir().unwrap();
    let config = test_config(dir.path());
    let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
    let store = Arc::new(Store::open(dir.path()).unwrap());
    let host = Arc::new(RecordingHost::with_proc_devices(""));
    let mgr = LeaseManager::start_with_host(config, sim, store, host.clone()).unwrap();
    let created = mgr.create(mig_request("r-gone")).await.unwrap();
    let token = created.token.clone().unwrap();
    let now = tessera_common::clock::now_ms();
    for (id, bound_at_ms) in [("old-live", 0), ("old-gone", 0), ("new-gone", now)] {
        let b = crate::model::ContainerBinding {
            id: id.into(),
            cgroup_path: format!("/kubepods/pod1/{id}"),
            runtime_root: "/run/containerd/runc/k8s.io".into(),
            bound_at_ms,
            ..Default::default()
        };
        mgr.bind_container(&token, b, None).await.unwrap();
    }
    host.container_gone("old-gone");
    host.container_gone("new-gone");
    mgr.tick().await;
    let (l, _) = mgr.get(&created.lease.id).unwrap();
    let ids: Vec<&str> = l.containers.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["old-live", "new-gone"]);
}

/// Unbinding under a runc root forgets only that root's container: another root's
/// container of the same id keeps its binding (and its lease's release still finds it).
#[tokio::test]
async fn unbinding_under_a_root_keeps_another_roots_container_of_the_same_id() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path());
    let a = mgr.create(mig_request("root-a")).await.unwrap();
    let b = mgr.create(mig_request("root-b")).await.unwrap();
    for (l, root, pod) in [(&a, "/run/a", "pod1"), (&b, "/run/b", "pod2")] {
        let bind = crate::model::ContainerBinding {
            id: "gpu1".into(),
            cgroup_path: format!("/kubepods/{pod}/gpu1"),
            runtime_root: root.into(),
            ..Default::default()
        };
        mgr.bind_container(l.token.as_ref().unwrap(), bind, None)
            .await
            .unwrap();
    }
    let roots = |id: &str| -> Vec<String> {
        mgr.get(id)
            .unwrap()
            .0
            .containers
            .iter()
            .map(|c| c.runtime_root.clone())
            .collect()
    };
    mgr.unbind_container("gpu1", Some("/run/empty"))
        .await
        .unwrap();
    assert_eq!(roots(&a.lease.id), ["/run/a"]);
    assert_eq!(roots(&b.lease.id), ["/run/b"]);
    mgr.unbind_container("gpu1", Some("/run/b")).await.unwrap();
    assert_eq!(roots(&a.lease.id), ["/run/a"]);
    assert!(roots(&b.lease.id).is_empty());
}

/// A container on two leases (two devices of a Kubernetes resource) is forgotten
/// on both when it is deleted, and the unbinding outlives a restart.
#[tokio::test]
async fn unbinding_a_container_forgets_it_on_every_lease() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path());
    let a = mgr.create(mig_request("multi-a")).await.unwrap();
    let b = mgr.create(mig_request("multi-b")).await.unwrap();
    let bind = |id: &str| crate::model::ContainerBinding {
        id: id.into(),
        cgroup_path: format!("/kubepods/pod1/{id}"),
        pod: "pod-1".into(),
        ..Default::default()
    };
    for l in [&a, &b] {
        mgr.bind_container(l.token.as_ref().unwrap(), bind("both"), None)
            .await
            .unwrap();
    }
    mgr.bind_container(a.token.as_ref().unwrap(), bind("other"), None)
        .await
        .unwrap();
    let ids = |m: &LeaseManager, id: &str| -> Vec<String> {
        m.get(id)
            .unwrap()
            .0
            .containers
            .iter()
            .map(|c| c.id.clone())
            .collect()
    };
    assert_eq!(ids(&mgr, &b.lease.id), ["both"]);
    mgr.unbind_container("both", None).await.unwrap();
    assert_eq!(ids(&mgr, &a.lease.id), ["other"]);
    assert!(ids(&mgr, &b.lease.id).is_empty());
    mgr.begin_shutdown();
    drop(mgr);
    let mgr = manager(dir.path());
    assert_eq!(ids(&mgr, &a.lease.id), ["other"]);
    assert!(ids(&mgr, &b.lease.id).is_empty());
}

/// If the moved lease's new instance (on gpu0) cannot be created, the old one is
/// created again where it was (gpu1); if even that fails, the lease is lost with its
/// reason.
#[tokio::test]
async fn a_move_whose_create_fails_puts_the_instance_back_or_loses_the_lease() {
    use crate::gpu::sim::CreateStage;
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let (a, _) = idle_lease_in_the_way(&mgr, false).await;
    sim.fail_next_create(0, CreateStage::Gi).unwrap();
    let err = mgr.create(seven_g("big")).await.unwrap_err();
    assert!(err.to_string().contains("moving an idle lease"), "{err}");
    let (l, p) = mgr.get(&a.lease.id).unwrap();
    assert_eq!(l.state(), LeaseState::Active);
    let (before, after) = (a.partition.clone().unwrap(), p.unwrap());
    assert_eq!((after.gpu, after.id.as_str()), (1, before.id.as_str()));
    assert_eq!(
        after.mig().unwrap().placement,
        before.mig().unwrap().placement
    );
    assert_ne!(
        after.mig().unwrap().uuid,
        before.mig().unwrap().uuid,
        "created again"
    );
    assert_eq!(instance_count(&sim), 2);
    assert!(mgr.store.snapshot().unwrap().intents.is_empty());
    assert_eq!(
        mgr.resolve_token(a.token.as_ref().unwrap())
            .unwrap()
            .partition
            .id,
        before.id
    );

    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), true);
    let mut events = mgr.subscribe();
    let (a, _) = idle_lease_in_the_way(&mgr, false).await;
    sim.fail_next_create(0, CreateStage::Gi).unwrap();
    sim.fail_next_create(1, CreateStage::Gi).unwrap();
    assert!(mgr.create(seven_g("big")).await.is_err());
    let (l, p) = mgr.get(&a.lease.id).unwrap();
    assert!(!l.state().is_live(), "{:?}", l.state());
    assert!(
        l.end_reason().unwrap().contains("being moved"),
        "{:?}",
        l.end_reason()
    );
    assert!(p.is_none());
    assert_eq!(instance_count(&sim), 1, "the pinned 4g");
    assert!(mgr.resolve_token(a.token.as_ref().unwrap()).is_err());
    assert!(mgr.store.snapshot().unwrap().intents.is_empty());
    let mut revoked = false;
    while let Ok(ev) = events.try_recv() {
        revoked |= ev.kind == EventKind::Revoked && ev.lease.id == a.lease.id;
    }
    assert!(revoked, "watchers hear the lease is gone");
}

// ---- multi-partition leases ----

fn three_3g(request_id: &str) -> CreateRequest {
    CreateRequest {
        shape: Some(Shape::Mig {
            profile: "3g.40gb".into(),
            compute_profile: None,
        }),
        count: 3,
        ..mig_request(request_id)
    }
}

/// Three 3g instances on two H100s: two fill gpu0, the third goes to gpu1.
#[tokio::test]
async fn a_lease_of_three_instances_holds_sees_counts_and_ends_all_of_them() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), false);
    let c = mgr.create(three_3g("three")).await.unwrap();
    let lease = c.lease.clone();
    assert_eq!(lease.state(), LeaseState::Active);
    assert_eq!(lease.partition_count(), 3);
    assert_eq!(instance_count(&sim), 3);
    let (parts, links) = mgr.partitions_of(&lease);
    assert_eq!(
        parts.iter().map(|p| p.gpu).collect::<Vec<_>>(),
        vec![0, 0, 1],
        "the first GPU filled first"
    );
    assert!(
        parts
            .iter()
            .all(|p| p.lease_id.as_deref() == Some(lease.id.as_str()))
    );
    assert_eq!(links.unwrap().gpus, vec![0, 1]);
    // Quota counts every partition: 3 x 3 slices.
    assert_eq!(mgr.lock().leases.live_usage("team-a").mig_slices, 9);
    // The runtime's answer: every instance's devices and UUIDs, once each.
    let r = mgr.resolve_token(c.token.as_deref().unwrap()).unwrap();
    let uuids: Vec<String> = parts
        .iter()
        .map(|p| p.mig().unwrap().uuid.clone().unwrap())
        .collect();
    assert_eq!(r.grant.env["CUDA_VISIBLE_DEVICES"], uuids.join(","));
    assert_eq!(r.grant.visible_gpu_indices, vec![0, 1]);
    let caps = r
        .grant
        .devices
        .iter()
        .filter(|d| d.container_path.starts_with("/dev/nvidia-caps/"))
        .count();
    assert_eq!(caps, 6, "a GI and a CI access node per instance");
    for gpu in ["/dev/nvidia0", "/dev/nvidia1"] {
        let n = r
            .grant
            .devices
            .iter()
            .filter(|d| d.container_path == gpu)
            .count();
        assert_eq!(n, 1, "{gpu} once");
    }
    assert_eq!(r.more_partitions.len(), 2);
    // Release ends them all: instances destroyed, records gone, usage of three.
    mgr.end(&lease.id, LeaseState::Released, "done")
        .await
        .unwrap();
    assert_eq!(instance_count(&sim), 0);
    assert_eq!(mgr.counts(), (0, 0));
    assert!(mgr.store.snapshot().unwrap().intents.is_empty());
    assert_eq!(mgr.lock().leases.live_usage("team-a").mig_slices, 0);
    let slices: i64 = mgr
        .store
        .read(|c| -> Result<i64, crate::store::StoreError> {
            Ok(c.query_row(
                "SELECT mig_slices FROM usage_records WHERE lease_id = ?1",
                [&lease.id],
                |r| r.get(0),
            )?)
        })
        .unwrap();
    assert_eq!(slices, 9);
}

/// All or nothing: the third instance fails (a GI left without its CI, as a crash
/// between the NVML calls leaves it): the two made are destroyed, the GI too, and
/// the lease is refused and failed.
#[tokio::test]
async fn when_the_third_instance_fails_the_first_two_are_destroyed() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), false);
    sim.crash_next_create_after_gi(1).unwrap();
    let e = mgr.create(three_3g("three")).await.unwrap_err();
    assert!(e.to_string().contains("GPU"), "{e}");
    assert_eq!(instance_count(&sim), 0, "nothing left on the hardware");
    assert_eq!(mgr.counts(), (0, 0));
    let snap = mgr.store.snapshot().unwrap();
    assert!(snap.intents.is_empty() && snap.partitions.is_empty());
    let all = mgr.store.list_leases(&LeaseQuery::default()).unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].state(), LeaseState::Failed);
    assert!(
        all[0].end_reason().unwrap().contains("partition 3 of 3"),
        "{:?}",
        all[0].end_reason()
    );
    // The room is whole again: the same request now succeeds.
    let c = mgr.create(three_3g("three-again")).await.unwrap();
    assert_eq!(c.lease.partition_count(), 3);
}

/// The records a crash leaves in the middle of creating a three-instance lease:
/// the lease pending, its intents open, the third instance not (yet) made.
async fn crash_mid_multi_create(mgr: &LeaseManager, sim: &crate::gpu::SimBackend, c: &Created) {
    let (parts, _) = mgr.partitions_of(&c.lease);
    let mut lease = c.lease.clone().with_state(LeaseState::Pending, None);
    lease.containers.clear();
    let third = parts[2].clone();
    let gi = third.mig().unwrap().gi_id.unwrap();
    sim.destroy_instance(third.gpu, gi).unwrap();
    let mut creating = third.clone();
    creating.state = crate::model::PartitionState::Creating;
    if let crate::model::PartKind::Mig(m) = &mut creating.kind {
        (m.gi_id, m.ci_id, m.uuid) = (None, None, None);
    }
    let ps = parts.clone();
    mgr.store
        .write(move |w| {
            w.put_lease(&lease)?;
            w.put_partition(&creating)?;
            for p in &ps {
                w.begin_intent(crate::model::IntentOp::CreateMig, &p.id, Some(&lease.id), 1)?;
            }
            Ok(())
        })
        .await
        .unwrap();
}

/// A crash between the instances of one lease: at the next start the instances
/// made are destroyed and the lease fails (it was never acknowledged); one whose
/// every instance exists is adopted whole.
#[tokio::test]
async fn a_crash_mid_multi_create_is_rolled_back_or_adopted_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), false);
    let c = mgr.create(three_3g("crash")).await.unwrap();
    crash_mid_multi_create(&mgr, &sim, &c).await;
    assert_eq!(instance_count(&sim), 2, "two made before the crash");
    drop(mgr);
    let (mgr, sim) = two_h100(dir.path(), false);
    assert_eq!(instance_count(&sim), 0, "all or nothing");
    let (l, _) = mgr.get(&c.lease.id).unwrap();
    assert_eq!(l.state(), LeaseState::Failed);
    let snap = mgr.store.snapshot().unwrap();
    assert!(snap.intents.is_empty() && snap.partitions.is_empty());
    assert!(mgr.resolve_token(c.token.as_deref().unwrap()).is_err());

    // Every instance made, the final commit lost: adopted, all three, active.
    let c = mgr.create(three_3g("crash-2")).await.unwrap();
    let (parts, _) = mgr.partitions_of(&c.lease);
    let mut lease = c.lease.clone().with_state(LeaseState::Pending, None);
    lease.containers.clear();
    let ps = parts.clone();
    mgr.store
        .write(move |w| {
            w.put_lease(&lease)?;
            for p in &ps {
                w.begin_intent(crate::model::IntentOp::CreateMig, &p.id, Some(&lease.id), 1)?;
            }
            Ok(())
        })
        .await
        .unwrap();
    drop(mgr);
    let (mgr, sim) = two_h100(dir.path(), false);
    assert_eq!(instance_count(&sim), 3);
    let (l, _) = mgr.get(&c.lease.id).unwrap();
    assert_eq!(l.state(), LeaseState::Active);
    assert_eq!(mgr.partitions_of(&l).0.len(), 3);
    assert!(mgr.store.snapshot().unwrap().intents.is_empty());
    // It still resolves and ends whole after the restart.
    assert!(mgr.resolve_token(c.token.as_deref().unwrap()).is_ok());
    mgr.end(&l.id, LeaseState::Revoked, "test").await.unwrap();
    assert_eq!(instance_count(&sim), 0);
}

/// Whole GPUs by count, with a NUMA constraint the board cannot meet refused by
/// reason, and a count on a shape that cannot have one refused as invalid.
#[tokio::test]
async fn whole_gpus_by_count_and_the_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
         [sim]\nstate_file = {s:?}\ntopology = \"pcie-pairs\"\n{g}",
        d = dir.path().display().to_string(),
        s = dir.path().join("sim.json").display().to_string(),
        g = "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = false\n".repeat(4),
    );
    let config = Config::parse(std::path::Path::new("test.toml"), &text).unwrap();
    let sim = Arc::new(crate::gpu::open_sim(&config.sim).unwrap());
    let store = Arc::new(Store::open(dir.path()).unwrap());
    let mgr = LeaseManager::start(config, sim, store).unwrap();
    let whole =
        |id: &str, n: u32, t: crate::partition::topology::TopologyConstraint| CreateRequest {
            shape: Some(Shape::WholeGpu),
            count: n,
            topology: t,
            ..mig_request(id)
        };
    use crate::partition::topology::TopologyConstraint as T;
    let two = mgr.create(whole("two", 2, T::Nvlink)).await.unwrap();
    let (parts, links) = mgr.partitions_of(&two.lease);
    assert_eq!(parts.iter().map(|p| p.gpu).collect::<Vec<_>>(), vec![0, 1]);
    assert_eq!(links.unwrap().min_nvlinks, 12, "a bridged pair");
    let r = mgr.resolve_token(two.token.as_deref().unwrap()).unwrap();
    assert_eq!(r.grant.visible_gpu_indices, vec![0, 1]);
    // Two left (2 and 3): three is beyond the node now.
    let e = mgr.create(whole("three", 3, T::Any)).await.unwrap_err();
    assert!(matches!(e, LeaseError::ResourceExhausted(_)), "{e:?}");
    mgr.end(&two.lease.id, LeaseState::Released, "t")
        .await
        .unwrap();
    // Four free, but a NUMA node of this board has two (0-1 and 2-3).
    let e = mgr.create(whole("numa3", 3, T::Numa)).await.unwrap_err();
    assert!(matches!(e, LeaseError::TopologyUnmet(_)), "{e:?}");
    assert!(e.to_string().contains("NUMA"), "{e}");
    assert_eq!(mgr.counts(), (0, 0), "a refusal holds nothing");
    let mps = CreateRequest {
        shape: Some(Shape::Mps {
            sm_percent: 10,
            memory_bytes: 1 << 30,
            mode: crate::gpu::MpsMode::Isolated,
        }),
        count: 2,
        ..mig_request("mps2")
    };
    let e = mgr.create(mps).await.unwrap_err();
    assert!(
        matches!(
            e,
            LeaseError::InvalidArgument {
                field: "shape.count",
                ..
            }
        ),
        "{e:?}"
    );
    let mut pinned = whole("pinned", 2, T::Any);
    pinned.gpu_index = Some(0);
    let e = mgr.create(pinned).await.unwrap_err();
    assert!(
        matches!(
            e,
            LeaseError::InvalidArgument {
                field: "gpu_index",
                ..
            }
        ),
        "{e:?}"
    );
}

/// An instance of a multi-partition lease vanished while the daemon was down (a GPU
/// reset) and cannot be created again: the lease is lost whole, its other instances
/// destroyed, no record left pointing at it.
#[tokio::test]
async fn a_multi_lease_whose_instance_cannot_come_back_is_lost_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), false);
    let c = mgr.create(three_3g("reset")).await.unwrap();
    let (parts, _) = mgr.partitions_of(&c.lease);
    drop(mgr);
    let third = &parts[2];
    sim.destroy_instance(third.gpu, third.mig().unwrap().gi_id.unwrap())
        .unwrap();
    sim.fail_next_create(third.gpu, crate::gpu::sim::CreateStage::Gi)
        .unwrap();
    let (mgr, sim) = two_h100(dir.path(), false);
    let (l, _) = mgr.get(&c.lease.id).unwrap();
    assert_eq!(l.state(), LeaseState::Revoked);
    assert!(l.end_reason().unwrap().contains("could not be re-created"));
    assert_eq!(instance_count(&sim), 0, "the other two went with it");
    assert!(mgr.store.snapshot().unwrap().partitions.is_empty());
    assert_eq!(mgr.counts(), (0, 0));
}

/// All or nothing when the undo itself fails: the third instance fails and one of
/// the two made cannot be destroyed now; the lease fails at once, and the next
/// start destroys the instance left behind (its `destroy_mig` intent).
#[tokio::test]
async fn an_instance_the_undo_could_not_destroy_goes_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), false);
    sim.crash_next_create_after_gi(1).unwrap();
    sim.fail_next_destroy(0).unwrap();
    let e = mgr.create(three_3g("stuck")).await.unwrap_err();
    assert!(e.to_string().contains("GPU"), "{e}");
    assert_eq!(instance_count(&sim), 1, "one could not be destroyed yet");
    let all = mgr.store.list_leases(&LeaseQuery::default()).unwrap();
    assert_eq!(all[0].state(), LeaseState::Failed);
    assert!(
        all[0]
            .end_reason()
            .unwrap()
            .contains("1 left to the next start"),
        "{:?}",
        all[0].end_reason()
    );
    // The instance left is recorded (no lease), under its teardown intent.
    let snap = mgr.store.snapshot().unwrap();
    assert_eq!((snap.partitions.len(), snap.intents.len()), (1, 1));
    drop(mgr);
    let (mgr, sim) = two_h100(dir.path(), false);
    assert_eq!(instance_count(&sim), 0);
    let snap = mgr.store.snapshot().unwrap();
    assert!(snap.partitions.is_empty() && snap.intents.is_empty());
    assert_eq!(mgr.counts(), (0, 0));
}

/// A crash in the middle of ending a three-instance lease (its intents written,
/// one instance destroyed): the next start destroys the other two and ends it.
#[tokio::test]
async fn a_crash_mid_multi_teardown_is_finished_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, sim) = two_h100(dir.path(), false);
    let c = mgr.create(three_3g("ending")).await.unwrap();
    let (parts, _) = mgr.partitions_of(&c.lease);
    let mut lease = c.lease.clone();
    lease.begin_end(LeaseState::Released, "done").unwrap();
    let first = &parts[0];
    sim.destroy_instance(first.gpu, first.mig().unwrap().gi_id.unwrap())
        .unwrap();
    let ps = parts.clone();
    mgr.store
        .write(move |w| {
            w.put_lease(&lease)?;
            for p in &ps {
                let mut d = p.clone();
                d.state = crate::model::PartitionState::Destroying;
                w.put_partition(&d)?;
                w.begin_intent(
                    crate::model::IntentOp::DestroyMig,
                    &d.id,
                    Some(&lease.id),
                    1,
                )?;
            }
            Ok(())
        })
        .await
        .unwrap();
    drop(mgr);
    let (mgr, sim) = two_h100(dir.path(), false);
    assert_eq!(instance_count(&sim), 0);
    let snap = mgr.store.snapshot().unwrap();
    assert!(snap.partitions.is_empty() && snap.intents.is_empty());
    let (l, _) = mgr.get(&c.lease.id).unwrap();
    assert_eq!(l.state(), LeaseState::Released);
    assert_eq!(mgr.counts(), (0, 0));
}

// ------------------------------------------------------------------ admission queue

/// Until `n` CreateLease calls wait in the queue (each enters it within a moment).
async fn queued(mgr: &LeaseManager, n: usize) {
    for _ in 0..2000 {
        if mgr.queued_requests() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{} requests queued, not {n}", mgr.queued_requests());
}

#[tokio::test]
async fn a_queued_7g_is_granted_when_a_lease_ends_first_come_first_served() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, _) = two_h100(dir.path(), false);
    let (a, _) = idle_lease_in_the_way(&mgr, false).await;
    let refused = mgr.create(seven_g("now")).await.unwrap_err();
    assert!(
        matches!(refused, LeaseError::ResourceExhausted(_)),
        "{refused}"
    );
    let wait = Duration::from_secs(60);
    let m = mgr.clone();
    let first = tokio::spawn(async move { m.create_queued(seven_g("first"), wait).await });
    queued(&mgr, 1).await;
    let m = mgr.clone();
    let second = tokio::spawn(async move { m.create_queued(seven_g("second"), wait).await });
    queued(&mgr, 2).await;
    mgr.end(&a.lease.id, LeaseState::Released, "test")
        .await
        .unwrap();
    let got = first.await.unwrap().unwrap();
    assert_eq!(got.lease.gpu, 1);
    assert_eq!(got.lease.request_id.as_deref(), Some("first"));
    assert!(got.token.is_some());
    // The second still waits (one 7g per GPU, gpu0 has the 4g); it leaves when its
    // caller goes away.
    queued(&mgr, 1).await;
    second.abort();
    assert!(second.await.unwrap_err().is_cancelled());
    assert_eq!(
        mgr.queued_requests(),
        0,
        "a caller that went away left the queue"
    );
}

#[tokio::test]
async fn a_queued_request_whose_wait_ends_is_refused_and_leaves_the_queue() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, _) = two_h100(dir.path(), false);
    idle_lease_in_the_way(&mgr, false).await;
    let err = mgr
        .create_queued(seven_g("big"), Duration::from_millis(200))
        .await
        .unwrap_err();
    let LeaseError::ResourceExhausted(msg) = &err else {
        panic!("{err}");
    };
    assert!(
        msg.contains("no room within the queue wait of 200 ms"),
        "{msg}"
    );
    assert!(msg.contains("7g.80gb"), "the planner's reason: {msg}");
    assert_eq!(mgr.queued_requests(), 0);
    // Longer than lease.max_queue_wait (10m by default): refused before queueing.
    let err = mgr
        .create_queued(seven_g("long"), Duration::from_secs(3600))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            LeaseError::InvalidArgument {
                field: "queue_wait_ms",
                ..
            }
        ),
        "{err}"
    );
    // Room now: a queued request is served at once.
    let small = mgr
        .create_queued(mig_request("small"), Duration::from_secs(5))
        .await
        .unwrap();
    assert!(small.token.is_some());
    assert_eq!(mgr.queued_requests(), 0);
}

#[tokio::test]
async fn a_shape_no_gpu_mode_can_take_is_refused_at_once_not_queued() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = format!(
        "{}[[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n",
        h100s(2)
    );
    let (mgr, _) = sim_manager(dir.path(), "move_idle = false", &gpus);
    idle_lease_in_the_way(&mgr, false).await;
    // A 7g has no room: it waits.
    let m = mgr.clone();
    let waiting = tokio::spawn(async move {
        m.create_queued(seven_g("first"), Duration::from_secs(60))
            .await
    });
    queued(&mgr, 1).await;
    // The same shape on gpu2 (MIG off) is refused at once, not queued behind it.
    let pinned = CreateRequest {
        gpu_index: Some(2),
        ..seven_g("pinned")
    };
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        mgr.create_queued(pinned, Duration::from_secs(60)),
    )
    .await
    .expect("refused at once, not after the wait")
    .unwrap_err();
    let LeaseError::ModeUnavailable(msg) = &err else {
        panic!("{err}");
    };
    assert!(msg.contains("gpu2 is not in MIG mode"), "{msg}");
    assert_eq!(mgr.queued_requests(), 1, "only the first request waits");
    // And without a wait: the same answer, nothing held.
    let err = mgr
        .create(CreateRequest {
            gpu_index: Some(2),
            ..seven_g("again")
        })
        .await
        .unwrap_err();
    assert!(matches!(err, LeaseError::ModeUnavailable(_)), "{err}");
    waiting.abort();
}

// ------------------------------------------------------------------ temporal packing

fn two_h100_expiry_weight(dir: &std::path::Path, weight: u32) -> Arc<LeaseManager> {
    sim_manager(dir, &format!("expiry_weight = {weight}"), &h100s(2)).0
}

/// gpu0 holds a 1g lease ending in 10 minutes, gpu1 one ending in 2 hours: a new 1g
/// lease of an hour joins gpu1 (where it delays nothing), so gpu0 can empty for a 7g
/// in 10 minutes. With `expiry_weight = 0` best fit ties and takes gpu0.
#[tokio::test]
async fn a_new_lease_joins_the_gpu_whose_leases_outlast_it() {
    for (weight, want) in [(32, 1), (0, 0)] {
        let dir = tempfile::tempdir().unwrap();
        let mgr = two_h100_expiry_weight(dir.path(), weight);
        for (id, gpu, mins) in [("short", 0, 10), ("long", 1, 120)] {
            let req = CreateRequest {
                gpu_index: Some(gpu),
                ttl: Some(Duration::from_secs(mins * 60)),
                ..mig_request(id)
            };
            mgr.create(req).await.unwrap();
        }
        let req = CreateRequest {
            ttl: Some(Duration::from_secs(3600)),
            ..mig_request("hour")
        };
        let hour = mgr.create(req).await.unwrap();
        assert_eq!(hour.lease.gpu, want, "expiry_weight = {weight}");
    }
}

/// A refused 7g holds the GPU whose lease ends first (`partition::reservation`): new
/// small leases that would outlast it go to the other GPU, and are refused once that
/// one is full although the held GPU has room; when its lease ends, the 7g fits there.
#[tokio::test]
async fn a_refused_7g_holds_the_gpu_that_empties_first_until_it_fits() {
    let dir = tempfile::tempdir().unwrap();
    let (mgr, _) = two_h100(dir.path(), false);
    let one_g = |id: &str, gpu: Option<u32>, ttl_s: u64| CreateRequest {
        gpu_index: gpu,
        ttl: Some(Duration::from_secs(ttl_s)),
        ..mig_request(id)
    };
    mgr.create(one_g("long", Some(0), 3600)).await.unwrap();
    let short = mgr.create(one_g("short", Some(1), 600)).await.unwrap();
    let err = mgr.create(seven_g("big")).await.unwrap_err();
    assert!(matches!(err, LeaseError::ResourceExhausted(_)), "{err}");
    // gpu0 takes six more 1g (seven at most); none goes to the held gpu1.
    for i in 0..6 {
        let c = mgr
            .create(one_g(&format!("f{i}"), None, 3600))
            .await
            .unwrap();
        assert_eq!(c.lease.gpu, 0, "f{i}");
    }
    let err = mgr.create(one_g("f6", None, 3600)).await.unwrap_err();
    assert!(matches!(err, LeaseError::ResourceExhausted(_)), "{err}");
    // Its lease ends: the 7g gets gpu1.
    mgr.end(&short.lease.id, LeaseState::Released, "test")
        .await
        .unwrap();
    let big = mgr.create(seven_g("big-again")).await.unwrap();
    assert_eq!(big.lease.gpu, 1);
}
