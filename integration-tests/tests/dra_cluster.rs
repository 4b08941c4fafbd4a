//! The DRA driver's API server side against the API server stand-in
//! (`python/apiserver_standin.py`, which checks every write against the
//! resource.k8s.io/v1 schema and validation rules): the publisher runs in-process
//! on a lease manager over the GPU simulator and a real SQLite store.
//!
//! * the slices validate, and the pool is complete and consistent (every consumed
//!   counter defined);
//! * a lease change republishes with a bumped pool generation; hardware of non-DRA
//!   leases disappears from the slices, hardware of DRA leases stays;
//! * a conflicting write is re-read and retried; another node's slices are never
//!   touched; stale slices of this node are deleted;
//! * an unhealthy GPU's devices are tainted, and untainted on recovery;
//! * the publisher task republishes on its own after a lease event;
//! * the claim reader returns a claim's allocation, checked against its UID;
//! * a watch of the node's slices sees the publisher's changes;
//! * the DRA manifests in deploy/kubernetes/dra validate against the same schemas;
//! * scheduler side: first fit with the counters rule over the published slices
//!   allocates a stream of claims onto disjoint hardware; how much first fit over
//!   Tessera's order and over NVML's order strands is printed (no assertion on it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};
use tessera_integration_tests::apiserver::{ApiServer, validate_manifests};
use tessera_integration_tests::python::say;
use tesserad::config::{Config, OnUnhealthy};
use tesserad::dra::claims::{ClaimRef, ClaimSource, ClaimSourceError};
use tesserad::dra::device::DeviceName;
use tesserad::dra::kube::{KubeClaimSource, Publisher, PublisherOptions, start_publisher};
use tesserad::dra::slices::sched::{Allocator, Selector, attr};
use tesserad::dra::slices::{self, GpuState, MpsClass, NodeState, SliceConfig, TAINT_KEY};
use tesserad::dra::{DRIVER_NAME, LABEL_CLAIM_UID};
use tesserad::gpu::{HealthCause, Placement};
use tesserad::lease::{CreateRequest, HealthSource, LeaseManager};
use tesserad::partition::{GpuView, OccupiedMig, Shape};
use tesserad::store::Store;

const NODE: &str = "node-a";

fn config(dir: &std::path::Path) -> Config {
    let text = format!(
        "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
         [sim]\nstate_file = {s:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n\
         [[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n\
         [kubernetes]\ncdi_dir = {c:?}\n\
         [[kubernetes.mps_classes]]\nname = \"small\"\nsm_percent = 25\nmemory = \"8GiB\"\nslots = 3\n",
        d = dir.display().to_string(),
        s = dir.join("sim.json").display().to_string(),
        c = dir.join("cdi").display().to_string(),
    );
    Config::parse(std::path::Path::new("test.toml"), &text).unwrap()
}

fn manager(dir: &std::path::Path) -> Arc<LeaseManager> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cfg = config(dir);
    let sim = Arc::new(tesserad::gpu::open_sim(&cfg.sim).unwrap());
    let store = Arc::new(Store::open(dir).unwrap());
    LeaseManager::start(cfg, sim, store).unwrap()
}

fn client(api: &ApiServer) -> kube::Client {
    let cfg = kube::Config::new(api.url().parse().unwrap());
    kube::Client::try_from(cfg).unwrap()
}

async fn raw(client: &kube::Client, method: &str, path: &str, body: Option<Value>) -> Value {
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("Content-Type", "application/json")
        .body(body.map(|b| b.to_string().into_bytes()).unwrap_or_default())
        .unwrap();
    client.request::<Value>(req).await.unwrap()
}

/// The stand-in's pool check: no problems, and the pool's generation.
async fn pool_ok(client: &kube::Client) -> i64 {
    let v = raw(
        client,
        "GET",
        &format!("/standin/pool/{DRIVER_NAME}/{NODE}"),
        None,
    )
    .await;
    assert_eq!(v["problems"], json!([]), "{v}");
    let stats = raw(client, "GET", "/standin/stats", None).await;
    assert_eq!(stats["rejected"], json!([]), "writes refused: {stats}");
    v["generation"].as_i64().unwrap()
}

async fn own_slices(client: &kube::Client) -> Vec<ResourceSlice> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    api.list(
        &ListParams::default().fields(&format!("spec.nodeName={NODE},spec.driver={DRIVER_NAME}")),
    )
    .await
    .unwrap()
    .items
}

fn devices(slices: &[ResourceSlice]) -> Vec<Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten().cloned())
        .collect()
}

fn names(slices: &[ResourceSlice]) -> BTreeSet<String> {
    devices(slices).into_iter().map(|d| d.name).collect()
}

fn slice_config(mgr: &LeaseManager) -> SliceConfig {
    SliceConfig::from_config(mgr.config(), NODE)
}

async fn mig_lease(mgr: &LeaseManager, profile: &str, dra: bool) -> String {
    let mut labels = BTreeMap::new();
    if dra {
        labels.insert(LABEL_CLAIM_UID.to_string(), uuid_like(profile));
    }
    mgr.create(CreateRequest {
        tenant: "default".into(),
        shape: Some(Shape::Mig {
            profile: profile.into(),
            compute_profile: None,
        }),
        labels,
        gpu_index: Some(0),
        ..CreateRequest::default()
    })
    .await
    .unwrap()
    .lease
    .id
}

fn uuid_like(seed: &str) -> String {
    format!("0000-{}", seed.replace(['.', '+'], "-"))
}

fn placement_of(name: &str, view: &GpuView) -> Option<(u32, Placement)> {
    match DeviceName::parse(name).ok()? {
        DeviceName::Mig {
            gpu,
            profile,
            start,
        } => {
            let p = view.gi_profile(&profile)?;
            Some((
                gpu,
                Placement {
                    start,
                    size: p.memory_slices,
                },
            ))
        }
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_validate_and_follow_leases_health_and_conflicts() {
    let Some(api) = ApiServer::start().unwrap() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path());
    let client = client(&api);

    // Another node's slice, which this node's publisher must never touch.
    let other: ResourceSlice = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": "node-b-gpu.tessera.io-devices-0"},
        "spec": {"driver": DRIVER_NAME, "nodeName": "node-b",
                 "pool": {"name": "node-b", "generation": 1, "resourceSliceCount": 1},
                 "devices": []}
    }))
    .unwrap();
    let all: Api<ResourceSlice> = Api::all(client.clone());
    all.create(&PostParams::default(), &other).await.unwrap();
    // A stale slice of this node (a pool that had more slices before).
    let mut stale = other.clone();
    stale.metadata.name = Some(format!("{NODE}-gpu.tessera.io-devices-9"));
    stale.spec.node_name = Some(NODE.into());
    stale.spec.pool.name = NODE.into();
    all.create(&PostParams::default(), &stale).await.unwrap();

    let mut publisher = Publisher::new(client.clone(), slice_config(&mgr));
    let node = slices::state::node_state(&mgr, None);
    let first = publisher.publish(&node).await.unwrap();
    assert_eq!(first.deleted, 1, "the stale slice goes");
    let g1 = pool_ok(&client).await;
    assert_eq!(g1, first.generation);
    let published = own_slices(&client).await;
    let n = names(&published);
    assert!(n.contains("gpu-0-mig-0-7g-80gb"), "{n:?}");
    assert!(n.contains("gpu-0-mig-6-1g-10gb"), "{n:?}");
    assert!(n.contains("gpu-1"), "{n:?}");
    for s in ["gpu-1-mps-small-0", "gpu-1-mps-small-2"] {
        assert!(n.contains(s), "{n:?}");
    }
    assert!(
        !n.contains("gpu-0"),
        "a MIG-mode GPU is not published whole"
    );
    // Nothing changed: nothing is written.
    let again = publisher
        .publish(&slices::state::node_state(&mgr, None))
        .await
        .unwrap();
    assert_eq!((again.created, again.replaced), (0, 0));
    assert_eq!(again.generation, g1);

    // A gRPC lease (not DRA) takes 3g.40gb: what overlaps it is no longer published.
    let grpc = mig_lease(&mgr, "3g.40gb", false).await;
    let (lease, part) = mgr.get(&grpc).unwrap();
    let held = part.unwrap().mig().unwrap().placement;
    let out = publisher
        .publish(&slices::state::node_state(&mgr, None))
        .await
        .unwrap();
    assert!(out.generation > g1, "the pool generation is bumped");
    let g2 = pool_ok(&client).await;
    let views = mgr.views_and_labelled(LABEL_CLAIM_UID).0;
    let n = names(&own_slices(&client).await);
    for d in &n {
        if let Some((0, p)) = placement_of(d, &views[0]) {
            assert!(
                !p.overlaps(&held),
                "{d} overlaps the gRPC lease {}",
                lease.id
            );
        }
    }
    // A DRA lease (labelled with its claim's UID): its device stays published.
    let dra = mig_lease(&mgr, "1g.10gb", true).await;
    let (_, part) = mgr.get(&dra).unwrap();
    let dra_at = part.unwrap().mig().unwrap().placement;
    publisher
        .publish(&slices::state::node_state(&mgr, None))
        .await
        .unwrap();
    let g3 = pool_ok(&client).await;
    assert!(g3 > g2);
    let n = names(&own_slices(&client).await);
    assert!(
        n.contains(&format!("gpu-0-mig-{}-1g-10gb", dra_at.start)),
        "{n:?}"
    );

    // Another writer changes the device slice twice before each replace.
    let dev_slice = format!("{NODE}-gpu.tessera.io-devices-0");
    raw(
        &client,
        "POST",
        "/standin/conflict",
        Some(json!({"name": dev_slice, "times": 2})),
    )
    .await;
    mgr.end(&grpc, tesserad::model::LeaseState::Released, "test")
        .await
        .unwrap();
    let out = publisher
        .publish(&slices::state::node_state(&mgr, None))
        .await
        .unwrap();
    assert_eq!(out.conflicts, 2, "{out:?}");
    let g4 = pool_ok(&client).await;
    assert!(g4 > g3);
    assert!(names(&own_slices(&client).await).contains("gpu-0-mig-4-3g-40gb"));

    // GPU 1 out of service: its devices are tainted; back in service: untainted.
    mgr.mark_unhealthy(
        1,
        None,
        HealthCause::Operator {
            reason: "fan failure".into(),
        },
        HealthSource::Operator,
    )
    .await
    .unwrap();
    publisher
        .publish(&slices::state::node_state(&mgr, None))
        .await
        .unwrap();
    pool_ok(&client).await;
    for d in devices(&own_slices(&client).await) {
        let on_1 = DeviceName::parse(&d.name).unwrap().gpu() == 1;
        let taints = d.taints.clone().unwrap_or_default();
        assert_eq!(!taints.is_empty(), on_1, "{}: {taints:?}", d.name);
        if on_1 {
            assert_eq!(taints[0].key, TAINT_KEY);
            assert_eq!(taints[0].effect, "NoSchedule");
            assert!(taints[0].time_added.is_some(), "the API server dates it");
        }
    }
    mgr.mark_healthy(1, None, HealthSource::Operator, "fixed")
        .await
        .unwrap();
    publisher
        .publish(&slices::state::node_state(&mgr, None))
        .await
        .unwrap();
    pool_ok(&client).await;
    assert!(
        devices(&own_slices(&client).await)
            .iter()
            .all(|d| d.taints.is_none())
    );

    // The other node's slice is as it was.
    let b = all.get("node-b-gpu.tessera.io-devices-0").await.unwrap();
    assert_eq!(b.spec.pool.generation, 1);
    assert_eq!(b.metadata.generation, Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publisher_task_republishes_after_a_lease_event() {
    let Some(api) = ApiServer::start().unwrap() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path());
    let client = client(&api);
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let mut opts = PublisherOptions::new(slice_config(&mgr));
    // Long enough that only the lease event can explain a republish.
    opts.resync = Duration::from_secs(3600);
    let task = start_publisher(mgr.clone(), client.clone(), opts, stop);
    let generation = |client: kube::Client| async move {
        own_slices(&client)
            .await
            .iter()
            .map(|s| s.spec.pool.generation)
            .max()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        let n = names(&own_slices(&client).await);
        if n.iter().any(|d| d.starts_with("gpu-0-mig-"))
            && let Some(g) = generation(client.clone()).await
        {
            break g;
        }
        assert!(Instant::now() < deadline, "never published");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    mig_lease(&mgr, "7g.80gb", false).await;
    loop {
        let n = names(&own_slices(&client).await);
        if !n.iter().any(|d| d.starts_with("gpu-0-mig-")) {
            break;
        }
        assert!(Instant::now() < deadline, "not republished: {n:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(generation(client.clone()).await.unwrap() > first);
    pool_ok(&client).await;
    stop_tx.send(true).unwrap();
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_reader_returns_the_allocation_of_that_claim() {
    let Some(api) = ApiServer::start().unwrap() else {
        return;
    };
    let client = client(&api);
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "train", "namespace": "team-a"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "mig.gpu.tessera.io", "allocationMode": "ExactCount", "count": 1}}]}}
    });
    let created = raw(
        &client,
        "POST",
        "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims",
        Some(claim.clone()),
    )
    .await;
    let uid = created["metadata"]["uid"].as_str().unwrap().to_string();
    let reader = KubeClaimSource::new(client.clone());
    let r = ClaimRef {
        namespace: "team-a".into(),
        name: "train".into(),
        uid: uid.clone(),
    };
    assert!(matches!(
        reader.allocation(&r).await,
        Err(ClaimSourceError::NotAllocated(_))
    ));
    let mut with_status = created.clone();
    with_status["status"] = json!({"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRIVER_NAME, "pool": NODE, "device": "gpu-0-mig-3-1g-10gb"},
        {"request": "nic", "driver": "net.example.com", "pool": NODE, "device": "eth1"}
    ]}}});
    raw(
        &client,
        "PUT",
        "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/train/status",
        Some(with_status),
    )
    .await;
    let a = reader.allocation(&r).await.unwrap();
    assert_eq!(a.uid, uid);
    assert_eq!(a.devices.len(), 2);
    assert_eq!(a.devices[0].device, "gpu-0-mig-3-1g-10gb");
    assert_eq!(a.devices[0].driver, DRIVER_NAME);
    assert_eq!(a.devices[1].driver, "net.example.com");
    // A claim recreated under the same name is another claim.
    let old = ClaimRef {
        uid: "5f0c3d5e-0000-0000-0000-000000000000".into(),
        ..r.clone()
    };
    assert!(matches!(
        reader.allocation(&old).await,
        Err(ClaimSourceError::NotFound(_))
    ));
    let gone = ClaimRef {
        name: "nope".into(),
        ..r
    };
    assert!(matches!(
        reader.allocation(&gone).await,
        Err(ClaimSourceError::NotFound(_))
    ));
    let stats = raw(&client, "GET", "/standin/stats", None).await;
    assert_eq!(stats["rejected"], json!([]), "{stats}");
}

/// A small deterministic generator (the stream must be the same each run).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// The published devices in NVML's order instead of Tessera's: per GPU, profile by
/// profile as NVML lists them, placements by start.
fn nvml_order(slices: &mut [ResourceSlice], views: &[GpuView]) {
    for s in slices.iter_mut() {
        if let Some(devs) = s.spec.devices.as_mut() {
            devs.sort_by_key(|d| {
                let name = DeviceName::parse(&d.name).unwrap();
                let gpu = name.gpu();
                let view = views.iter().find(|v| v.info.index == gpu).unwrap();
                match name {
                    DeviceName::Mig { profile, start, .. } => {
                        let idx = view
                            .profiles
                            .iter()
                            .position(|p| p.name == profile)
                            .unwrap();
                        (gpu, 0, idx, start)
                    }
                    DeviceName::WholeGpu { .. } => (gpu, 1, 0, 0),
                    DeviceName::Mps { slot, .. } => (gpu, 2, 0, slot),
                }
            });
        }
    }
}

/// Runs a stream of claims (allocations and releases) through first fit over the
/// slices Tessera publishes after each change (`tessera_order`), or over NVML's
/// order; returns (allocated, refused while the GPU had the memory slices free).
fn run_stream(
    base: &[GpuView],
    cfg: &SliceConfig,
    tessera_order: bool,
    steps: usize,
) -> (usize, usize, usize) {
    let mut rng = Lcg(42);
    // The MIG leases the scheduler's claims became: (device name, gpu, placement).
    let mut held: Vec<(String, u32, Placement, u32)> = Vec::new();
    let (mut allocated, mut stranded, mut refused) = (0, 0, 0);
    let profiles: Vec<String> = base[0]
        .profiles
        .iter()
        .filter(|p| !p.name.contains('+'))
        .map(|p| p.name.clone())
        .collect();
    for _ in 0..steps {
        // The node as the leases left it; all of it is DRA's.
        let gpus: Vec<GpuState> = base
            .iter()
            .map(|v| {
                let mut view = v.clone();
                for (_, _, p, id) in held.iter().filter(|h| h.1 == v.info.index) {
                    view.mig.push(OccupiedMig {
                        gi_profile_id: *id,
                        placement: *p,
                        free_static: None,
                    });
                }
                let dra_mig = view.mig.iter().map(|m| m.placement).collect();
                GpuState {
                    view,
                    dra_mig,
                    dra_mps: Default::default(),
                    dra_whole: false,
                    unhealthy: None,
                    unhealthy_instances: vec![],
                }
            })
            .collect();
        let node = NodeState {
            gpus,
            driver_version: String::new(),
        };
        let mut published = slices::build(cfg, &node, 1).unwrap();
        let views: Vec<GpuView> = node.gpus.iter().map(|g| g.view.clone()).collect();
        if !tessera_order {
            nvml_order(&mut published, &views);
        }
        let mut alloc = Allocator::new(&published);
        for (name, ..) in &held {
            assert!(alloc.allocated_before(name), "{name} no longer fits");
        }
        let release = !held.is_empty() && rng.next() % 10 < 3;
        if release {
            let i = (rng.next() as usize) % held.len();
            held.remove(i);
            continue;
        }
        // Small profiles more often than large ones.
        let weights = [6u64, 3, 3, 2, 1, 1];
        let total: u64 = weights.iter().take(profiles.len()).sum();
        let mut pick = rng.next() % total;
        let mut want = &profiles[0];
        for (p, w) in profiles.iter().zip(weights) {
            if pick < w {
                want = p;
                break;
            }
            pick -= w;
        }
        match alloc.allocate(&|d: &Device| attr(d, "profile") == Some(want.as_str())) {
            Some(name) => {
                let (gpu, p) = placement_of(&name, &views[0]).unwrap();
                // Disjoint hardware: no held instance on that GPU overlaps it.
                assert!(
                    held.iter().all(|h| h.1 != gpu || !h.2.overlaps(&p)),
                    "{name} overlaps an allocated instance"
                );
                let id = views[0].gi_profile(want).unwrap().id;
                held.push((name, gpu, p, id));
                allocated += 1;
            }
            None => {
                refused += 1;
                let size = views[0].gi_profile(want).unwrap().memory_slices;
                let room = views.iter().any(|v| {
                    let used: u32 = held
                        .iter()
                        .filter(|h| h.1 == v.info.index)
                        .map(|h| h.2.size)
                        .sum();
                    8u32.saturating_sub(used) >= size
                });
                if room {
                    stranded += 1;
                }
            }
        }
    }
    (allocated, refused, stranded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_fit_over_the_slices_allocates_disjoint_hardware_and_measures_stranding() {
    let Some(api) = ApiServer::start().unwrap() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path());
    let client = client(&api);
    let mut publisher = Publisher::new(client.clone(), slice_config(&mgr));
    publisher
        .publish(&slices::state::node_state(&mgr, None))
        .await
        .unwrap();
    pool_ok(&client).await;

    // Claims of every kind against what the API server holds: MIG profiles,
    // MPS shares and whole GPUs, until nothing more fits.
    let published = own_slices(&client).await;
    let mut alloc = Allocator::new(&published);
    let views = mgr.views_and_labelled(LABEL_CLAIM_UID).0;
    let kinds: [Selector<'_>; 5] = [
        &|d| attr(d, "profile") == Some("1g.10gb"),
        &|d| attr(d, "profile") == Some("3g.40gb"),
        &|d| attr(d, "type") == Some("mps"),
        &|d| attr(d, "profile") == Some("2g.20gb"),
        &|d| attr(d, "type") == Some("gpu"),
    ];
    let mut got: Vec<String> = Vec::new();
    for _ in 0..8 {
        for accepts in kinds {
            if let Some(d) = alloc.allocate(accepts) {
                got.push(d);
            }
        }
    }
    // Every allocation is hardware that exists at once.
    let mut mig: Vec<(u32, Placement)> = Vec::new();
    let (mut mps_sm, mut whole) = (0u32, false);
    for name in &got {
        match DeviceName::parse(name).unwrap() {
            DeviceName::Mig { .. } => {
                let (gpu, p) = placement_of(name, &views[0]).unwrap();
                assert!(
                    mig.iter().all(|(g, q)| *g != gpu || !q.overlaps(&p)),
                    "{name} overlaps another allocation: {got:?}"
                );
                mig.push((gpu, p));
            }
            DeviceName::Mps { gpu, .. } => {
                assert_eq!(gpu, 1);
                mps_sm += 25;
            }
            DeviceName::WholeGpu { gpu } => {
                assert_eq!(gpu, 1);
                whole = true;
            }
        }
    }
    assert!(!(whole && mps_sm > 0), "GPU 1 whole and shared: {got:?}");
    assert!(mps_sm <= 100);
    let memory: u32 = mig.iter().map(|(_, p)| p.size).sum();
    assert!(memory <= 8, "{got:?}");
    assert!(got.iter().any(|d| d.contains("-mig-")), "{got:?}");
    assert!(got.iter().any(|d| d.contains("-mps-")), "{got:?}");
    say(&format!("DRA: first fit allocated {got:?}"));

    // Churn: first fit over Tessera's order (republished after every change) and
    // over NVML's order, on two MIG GPUs.
    let base: Vec<GpuView> = {
        let mut a = views[0].clone();
        a.mig.clear();
        let mut b = a.clone();
        b.info.index = 1;
        b.info.uuid.push('b');
        vec![a, b]
    };
    let cfg = SliceConfig {
        node_name: NODE.into(),
        mps_classes: vec![MpsClass {
            name: "small".into(),
            sm_percent: 25,
            memory_bytes: 8 << 30,
            slots: None,
        }],
        on_unhealthy: OnUnhealthy::Keep,
    };
    let steps = 600;
    let (ta, tr, ts) = run_stream(&base, &cfg, true, steps);
    let (na, nr, ns) = run_stream(&base, &cfg, false, steps);
    say(&format!(
        "DRA first fit, {steps} claims and releases on 2 H100s: Tessera's order allocated {ta}, refused {tr} ({ts} with the memory slices free); NVML's order allocated {na}, refused {nr} ({ns} with the memory slices free)"
    ));
    assert!(ta > 0 && na > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_of_the_nodes_slices_sees_the_publishers_changes() {
    use kube::api::{WatchEvent, WatchParams};
    use tokio_stream::StreamExt;
    let Some(api) = ApiServer::start().unwrap() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mgr = manager(dir.path());
    let client = client(&api);
    let mut publisher = Publisher::new(client.clone(), slice_config(&mgr));
    publisher
        .publish(&slices::state::node_state(&mgr, None))
        .await
        .unwrap();
    let all: Api<ResourceSlice> = Api::all(client.clone());
    let wp = WatchParams::default()
        .fields(&format!("spec.nodeName={NODE},spec.driver={DRIVER_NAME}"))
        .timeout(20);
    let mut stream = Box::pin(all.watch(&wp, "0").await.unwrap());
    let mut added = 0;
    // The slices there now come first, as ADDED.
    while added < 2 {
        match stream.next().await.unwrap().unwrap() {
            WatchEvent::Added(s) => {
                assert_eq!(s.spec.node_name.as_deref(), Some(NODE));
                added += 1;
            }
            e => panic!("{e:?}"),
        }
    }
    mig_lease(&mgr, "7g.80gb", false).await;
    let out = publisher
        .publish(&slices::state::node_state(&mgr, None))
        .await
        .unwrap();
    let mut modified = BTreeSet::new();
    while modified.len() < out.replaced {
        match stream.next().await.unwrap().unwrap() {
            WatchEvent::Modified(s) => {
                assert_eq!(s.spec.pool.generation, out.generation);
                modified.insert(s.metadata.name.unwrap());
            }
            WatchEvent::Bookmark(_) => {}
            e => panic!("{e:?}"),
        }
    }
    assert_eq!(modified.len(), 2, "{modified:?}");
}

#[test]
fn the_dra_manifests_validate_against_the_kubernetes_schema() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let files: Vec<_> = [
        "deviceclasses.yaml",
        "rbac.yaml",
        "sample-claims.yaml",
        "admission-policy.yaml",
    ]
    .iter()
    .map(|f| repo.join("deploy/kubernetes/dra").join(f))
    .collect();
    let Some((ok, report)) = validate_manifests(&files).unwrap() else {
        return;
    };
    assert!(ok, "{report}");
    assert_eq!(report.matches(": valid").count(), 14, "{report}");
    // The check can fail: an unknown field in a DeviceClass is refused.
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(&files[0]).unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, text.replacen("selectors:", "selector:", 1)).unwrap();
    let (ok, report) = validate_manifests(&[bad]).unwrap().unwrap();
    assert!(!ok, "{report}");
    assert!(report.contains("selector"), "{report}");
}
