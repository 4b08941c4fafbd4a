//! The DRA kubelet plugin (`[kubernetes] dra = true`) against a kubelet stand-in
//! speaking kubelet's own protocols over unix sockets in a temp dir: the plugin
//! watcher's side of pluginregistration v1 (find the socket in `plugins_registry`,
//! GetInfo, pick the DRAPlugin service kubelet knows, NotifyRegistrationStatus),
//! then DRAPlugin v1 (and v1beta1) and DRAResourceHealth v1 on the endpoint GetInfo
//! names. The plugin runs in-process from the tesserad library on the GPU simulator
//! with a real SQLite store; the claims' allocations come from an in-test
//! ClaimSource (what the API server would answer).
//!
//! Covered: the registration answer; a MIG placement, an MPS slot and a whole GPU
//! each prepared at exactly the named placement, as leases of the namespace's
//! tenant labelled with the claim; the same answer twice; a claim for a taken
//! placement refused with its own error and nothing created (the other claims of
//! the call prepared); a claim over its tenant's quota refused; another driver's and
//! another pool's results ignored; unprepare releases (and an unknown claim is
//! unprepared); a restart (a new lease core and plugin on the same store) answers
//! the same prepared claims; health of prepared devices, and a GPU out of service
//! streamed as its device's UNHEALTHY.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tessera_proto::k8s::dra::{v1 as drav1, v1beta1 as drav1beta1};
use tessera_proto::k8s::dra_health::v1 as health;
use tessera_proto::k8s::pluginregistration::v1 as reg;
use tesserad::config::Config;
use tesserad::dra::claims::{
    AllocatedDevice, ClaimAllocation, ClaimRef, ClaimSource, ClaimSourceError,
};
use tesserad::lease::LeaseManager;
use tesserad::model::{LeaseState, PartKind};
use tesserad::store::Store;
use tokio::sync::watch;
use tonic::transport::Channel;

const NODE: &str = "node-1";
const DRIVER: &str = "gpu.tessera.io";

/// The API server's claims, as the test sets them.
#[derive(Default)]
struct Claims(Mutex<HashMap<String, ClaimAllocation>>);

#[tonic::async_trait]
impl ClaimSource for Claims {
    async fn allocation(&self, claim: &ClaimRef) -> Result<ClaimAllocation, ClaimSourceError> {
        self.0
            .lock()
            .unwrap()
            .get(&claim.uid)
            .cloned()
            .ok_or_else(|| ClaimSourceError::NotFound(claim.to_string()))
    }
}

impl Claims {
    /// Allocate claim `uid` the devices `(driver, pool, device)`.
    fn set(&self, uid: &str, devices: &[(&str, &str, &str)]) {
        let devices = devices
            .iter()
            .enumerate()
            .map(|(i, (driver, pool, device))| AllocatedDevice {
                request: format!("req-{i}"),
                driver: driver.to_string(),
                pool: pool.to_string(),
                device: device.to_string(),
            })
            .collect();
        self.0.lock().unwrap().insert(
            uid.into(),
            ClaimAllocation {
                uid: uid.into(),
                devices,
            },
        );
    }
}

/// GPU 0: an H100 with MIG; GPUs 1 and 2: A100s without (whole GPUs, MPS shares).
/// Namespace `ml` is tenant team-b (room for all of it), `small` is team-a (one MIG
/// slice at most).
fn config(dir: &Path) -> Config {
    let text = format!(
        r#"[daemon]
state_dir = {d:?}
run_dir = {d:?}
[gpu]
backend = "sim"
[sim]
state_file = {s:?}
[[sim.gpus]]
model = "h100-80gb"
mig = true
[[sim.gpus]]
model = "a100-40gb"
mig = false
[[sim.gpus]]
model = "a100-40gb"
mig = false
[tenants.team-a]
burst = {{ mig_slices = 1 }}
[tenants.team-b]
burst = {{ mig_slices = 7, whole_gpus = 2, mps_sm_percent = 200, memory = "80GiB" }}
[tenants.kubernetes]
[kubernetes]
dra = true
node_name = "{NODE}"
dra_plugin_dir = {p:?}
dra_registry_dir = {r:?}
cdi_dir = {c:?}
[kubernetes.namespaces]
ml = "team-b"
small = "team-a"
[[kubernetes.mps_classes]]
name = "small"
sm_percent = 25
memory = "8GiB"
"#,
        d = dir.display().to_string(),
        s = dir.join("sim.json").display().to_string(),
        p = dir.join("plugins").join(DRIVER).display().to_string(),
        r = dir.join("plugins_registry").display().to_string(),
        c = dir.join("cdi").display().to_string(),
    );
    Config::parse(Path::new("test.toml"), &text).unwrap()
}

/// tesserad's lease core and DRA plugin, in-process.
struct Node {
    mgr: Arc<LeaseManager>,
    store: Arc<Store>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Node {
    async fn start(dir: &Path, claims: Arc<Claims>) -> Node {
        let cfg = config(dir);
        let k = cfg.kubernetes.clone();
        let sim = Arc::new(tesserad::gpu::open_sim(&cfg.sim).unwrap());
        let store = Arc::new(Store::open(dir).unwrap());
        let mgr = LeaseManager::start(cfg, sim, store.clone()).unwrap();
        let (stop, stop_rx) = watch::channel(false);
        let (_, task) = tesserad::dra::node::start(mgr.clone(), store.clone(), k, claims, stop_rx)
            .await
            .unwrap();
        Node {
            mgr,
            store,
            stop,
            task,
        }
    }

    /// Stop as tesserad does: the plugin's sockets, then the store.
    async fn stop(self) {
        let _ = self.stop.send(true);
        self.task.await.unwrap();
        self.store.close();
    }

    fn live_leases(&self) -> Vec<tesserad::model::Lease> {
        self.mgr
            .list(None, None, false)
            .unwrap()
            .into_iter()
            .map(|(l, _)| l)
            .collect()
    }
}

/// kubelet's side: registered through the registry dir, a client of the endpoint.
struct Kubelet {
    info: reg::PluginInfo,
    dra: drav1::dra_plugin_client::DraPluginClient<Channel>,
}

impl Kubelet {
    /// What kubelet's plugin watcher does: find the socket in the registry dir,
    /// GetInfo, check it, dial the endpoint, and say it registered.
    async fn register(dir: &Path) -> Kubelet {
        let registry = dir.join("plugins_registry");
        let sockets: Vec<PathBuf> = std::fs::read_dir(&registry)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(sockets.len(), 1, "one registration socket: {sockets:?}");
        let ch = tessera_common::unix::channel(&sockets[0]).await.unwrap();
        let mut registration = reg::registration_client::RegistrationClient::new(ch);
        let info = registration
            .get_info(reg::InfoRequest {})
            .await
            .unwrap()
            .into_inner();
        // kubelet's DRA handler: the newest DRAPlugin service it knows.
        let chosen = info
            .supported_versions
            .iter()
            .find(|v| ["v1.DRAPlugin", "v1beta1.DRAPlugin"].contains(&v.as_str()))
            .expect("a DRAPlugin service kubelet knows");
        assert_eq!(chosen, "v1.DRAPlugin");
        let ch = tessera_common::unix::channel(Path::new(&info.endpoint))
            .await
            .unwrap();
        registration
            .notify_registration_status(reg::RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            })
            .await
            .unwrap();
        Kubelet {
            info,
            dra: drav1::dra_plugin_client::DraPluginClient::new(ch),
        }
    }

    async fn prepare(
        &mut self,
        claims: &[(&str, &str, &str)],
    ) -> HashMap<String, drav1::NodePrepareResourceResponse> {
        let claims = claims
            .iter()
            .map(|(ns, name, uid)| drav1::Claim {
                namespace: ns.to_string(),
                name: name.to_string(),
                uid: uid.to_string(),
            })
            .collect();
        self.dra
            .node_prepare_resources(drav1::NodePrepareResourcesRequest { claims })
            .await
            .unwrap()
            .into_inner()
            .claims
    }

    async fn prepare_one(
        &mut self,
        ns: &str,
        name: &str,
        uid: &str,
    ) -> drav1::NodePrepareResourceResponse {
        let mut out = self.prepare(&[(ns, name, uid)]).await;
        assert_eq!(out.len(), 1);
        out.remove(uid).expect("the claim's answer")
    }

    async fn unprepare(&mut self, ns: &str, name: &str, uid: &str) -> String {
        let mut out = self
            .dra
            .node_unprepare_resources(drav1::NodeUnprepareResourcesRequest {
                claims: vec![drav1::Claim {
                    namespace: ns.into(),
                    name: name.into(),
                    uid: uid.into(),
                }],
            })
            .await
            .unwrap()
            .into_inner()
            .claims;
        out.remove(uid).expect("the claim's answer").error
    }
}

/// The lease a prepared device's CDI id names (the first; the second is its claim's
/// token spec).
fn lease_of(d: &drav1::Device) -> String {
    assert_eq!(d.cdi_device_ids.len(), 2, "{d:?}");
    assert!(
        d.cdi_device_ids[1].starts_with("tessera.io/claim="),
        "{d:?}"
    );
    d.cdi_device_ids[0]
        .strip_prefix("tessera.io/lease=")
        .unwrap_or_else(|| panic!("not a per-lease CDI id: {d:?}"))
        .to_string()
}

/// The tokens claim `uid`'s token spec gives its containers (root-only file).
fn claim_tokens(dir: &Path, uid: &str) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("cdi").join(format!("tessera.io-claim-{uid}.json"));
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "{}",
        path.display()
    );
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(spec["kind"], "tessera.io/claim");
    assert_eq!(spec["devices"][0]["name"], uid);
    let env = spec["devices"][0]["containerEdits"]["env"][0]
        .as_str()
        .unwrap();
    env.strip_prefix("TESSERA_LEASE_TOKEN=")
        .unwrap()
        .split(',')
        .map(String::from)
        .collect()
}

fn ok(r: &drav1::NodePrepareResourceResponse) -> &drav1::Device {
    assert!(r.error.is_empty(), "refused: {}", r.error);
    assert_eq!(r.devices.len(), 1, "{r:?}");
    &r.devices[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_become_leases_at_exactly_their_placement_and_survive_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    {
        // As an operator may have made it.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let claims = Arc::new(Claims::default());
    let node = Node::start(dir, claims.clone()).await;
    let mut kubelet = Kubelet::register(dir).await;

    // The registration answer.
    assert_eq!(kubelet.info.r#type, "DRAPlugin");
    assert_eq!(kubelet.info.name, DRIVER);
    assert_eq!(
        Path::new(&kubelet.info.endpoint),
        dir.join("plugins").join(DRIVER).join("dra.sock")
    );
    assert_eq!(
        kubelet.info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth"]
    );

    // A MIG placement: 1g.10gb at start 5 (a planner left alone picks another).
    claims.set("u-mig", &[(DRIVER, NODE, "gpu-0-mig-5-1g-10gb")]);
    let mig = kubelet.prepare_one("ml", "mig", "u-mig").await;
    let d = ok(&mig);
    assert_eq!(
        (d.pool_name.as_str(), d.device_name.as_str()),
        (NODE, "gpu-0-mig-5-1g-10gb")
    );
    assert_eq!(d.request_names, ["req-0"]);
    let mig_lease = lease_of(d);
    let (l, p) = node.mgr.get(&mig_lease).unwrap();
    assert_eq!(l.tenant, "team-b", "the namespace's tenant");
    assert_eq!(l.labels["tessera.io/k8s-namespace"], "ml");
    assert_eq!(l.labels["tessera.io/dra-claim"], "mig");
    assert_eq!(l.labels["tessera.io/dra-claim-uid"], "u-mig");
    match &p.unwrap().kind {
        PartKind::Mig(m) => {
            assert_eq!((m.profile.as_str(), m.placement.start), ("1g.10gb", 5));
        }
        other => panic!("not MIG: {other:?}"),
    }
    assert!(
        dir.join("cdi")
            .join(format!("tessera.io-lease-{mig_lease}.json"))
            .is_file(),
        "the per-lease CDI spec is written"
    );
    // The claim's token spec binds a container to the lease (tessera-runtime reads
    // TESSERA_LEASE_TOKEN).
    let tokens = claim_tokens(dir, "u-mig");
    assert_eq!(tokens.len(), 1);
    assert_eq!(
        node.mgr.resolve_token(&tokens[0]).unwrap().lease.id,
        mig_lease
    );

    // An MPS slot on GPU 2 (the class's share), a whole GPU 1.
    claims.set("u-mps", &[(DRIVER, NODE, "gpu-2-mps-small-3")]);
    let mps = kubelet.prepare_one("ml", "mps", "u-mps").await;
    let mps_lease = lease_of(ok(&mps));
    let (l, _) = node.mgr.get(&mps_lease).unwrap();
    assert_eq!(l.gpu, 2);
    match &l.shape {
        tesserad::partition::Shape::Mps {
            sm_percent,
            memory_bytes,
            ..
        } => assert_eq!((*sm_percent, *memory_bytes), (25, 8 << 30)),
        other => panic!("not MPS: {other:?}"),
    }
    claims.set("u-gpu", &[(DRIVER, NODE, "gpu-1")]);
    let whole = kubelet.prepare_one("ml", "gpu", "u-gpu").await;
    let whole_lease = lease_of(ok(&whole));
    assert_eq!(node.mgr.get(&whole_lease).unwrap().0.gpu, 1);

    // Idempotent: the same answer, no new lease.
    let before = node.live_leases().len();
    assert_eq!(kubelet.prepare_one("ml", "mig", "u-mig").await, mig);
    assert_eq!(kubelet.prepare_one("ml", "gpu", "u-gpu").await, whole);
    assert_eq!(node.live_leases().len(), before);

    // In one call: a claim for a taken placement (2g.20gb at 4 overlaps slice 5),
    // one of another driver and pool only, and one with a result of ours among
    // others': each answered on its own.
    claims.set("u-taken", &[(DRIVER, NODE, "gpu-0-mig-4-2g-20gb")]);
    claims.set(
        "u-foreign",
        &[
            ("gpu.nvidia.com", NODE, "gpu-0"),
            (DRIVER, "node-2", "gpu-0"),
        ],
    );
    claims.set(
        "u-mixed",
        &[
            ("gpu.nvidia.com", NODE, "gpu-7"),
            (DRIVER, NODE, "gpu-0-mig-0-1g-10gb"),
        ],
    );
    let answers = kubelet
        .prepare(&[
            ("ml", "taken", "u-taken"),
            ("ml", "foreign", "u-foreign"),
            ("ml", "mixed", "u-mixed"),
        ])
        .await;
    let taken = &answers["u-taken"];
    assert!(taken.devices.is_empty());
    assert!(
        taken.error.contains("gpu-0-mig-4-2g-20gb") && taken.error.contains("is taken"),
        "a clear per-claim error: {}",
        taken.error
    );
    let foreign = &answers["u-foreign"];
    assert!(
        foreign.error.is_empty() && foreign.devices.is_empty(),
        "{foreign:?}"
    );
    let mixed = ok(&answers["u-mixed"]);
    assert_eq!(mixed.device_name, "gpu-0-mig-0-1g-10gb");
    assert_eq!(mixed.request_names, ["req-1"]);
    assert_eq!(
        node.live_leases().len(),
        before + 1,
        "only the mixed claim's lease"
    );

    // Over quota: team-a may hold one MIG slice.
    claims.set("u-a1", &[(DRIVER, NODE, "gpu-0-mig-1-1g-10gb")]);
    ok(&kubelet.prepare_one("small", "a1", "u-a1").await);
    claims.set("u-a2", &[(DRIVER, NODE, "gpu-0-mig-2-1g-10gb")]);
    let over = kubelet.prepare_one("small", "a2", "u-a2").await;
    assert!(over.devices.is_empty());
    assert!(
        over.error.contains("gpu-0-mig-2-1g-10gb")
            && over.error.contains("quota of tenant \"team-a\" exceeded"),
        "{}",
        over.error
    );
    assert!(
        !node.live_leases().iter().any(|l| l
            .labels
            .get("tessera.io/dra-claim-uid")
            .map(String::as_str)
            == Some("u-a2")),
        "nothing created for the refused claim"
    );

    // Health of the prepared devices.
    {
        let ch = tessera_common::unix::channel(Path::new(&kubelet.info.endpoint))
            .await
            .unwrap();
        let mut h = health::dra_resource_health_client::DraResourceHealthClient::new(ch);
        let mut stream = h
            .node_watch_resources(health::NodeWatchResourcesRequest {})
            .await
            .unwrap()
            .into_inner();
        let first = stream.message().await.unwrap().unwrap();
        let mut names: Vec<(String, i32)> = first
            .devices
            .iter()
            .map(|d| (d.device.as_ref().unwrap().device_name.clone(), d.health))
            .collect();
        names.sort();
        let healthy = health::HealthStatus::Healthy as i32;
        assert_eq!(
            names,
            [
                ("gpu-0-mig-0-1g-10gb".to_string(), healthy),
                ("gpu-0-mig-1-1g-10gb".to_string(), healthy),
                ("gpu-0-mig-5-1g-10gb".to_string(), healthy),
                ("gpu-1".to_string(), healthy),
                ("gpu-2-mps-small-3".to_string(), healthy),
            ]
        );
        // GPU 2 out of service: its device is reported unhealthy, with why.
        node.mgr
            .mark_unhealthy(
                2,
                None,
                tesserad::gpu::HealthCause::DoubleBitEcc,
                tesserad::lease::HealthSource::Operator,
            )
            .await
            .unwrap();
        let unhealthy = health::HealthStatus::Unhealthy as i32;
        let mut seen = None;
        for _ in 0..10 {
            let m = stream.message().await.unwrap().unwrap();
            if let Some(d) = m.devices.iter().find(|d| {
                d.device.as_ref().unwrap().device_name == "gpu-2-mps-small-3"
                    && d.health == unhealthy
            }) {
                seen = Some(d.clone());
                break;
            }
        }
        let d = seen.expect("the unhealthy device is streamed");
        assert!(d.message.contains("GPU 2"), "{d:?}");
    }

    // The store holds the leases' tokens: the state directory is tesserad's only.
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "state dir mode {mode:o}");
    }

    // Unprepare releases; again, or an unknown claim, is success.
    assert_eq!(kubelet.unprepare("ml", "gpu", "u-gpu").await, "");
    let (l, _) = node.mgr.get(&whole_lease).unwrap();
    assert_eq!(l.state(), LeaseState::Released);
    assert!(
        !dir.join("cdi")
            .join(format!("tessera.io-lease-{whole_lease}.json"))
            .exists(),
        "its CDI spec is gone"
    );
    assert!(
        !dir.join("cdi").join("tessera.io-claim-u-gpu.json").exists(),
        "its claim's token spec is gone"
    );
    assert_eq!(kubelet.unprepare("ml", "gpu", "u-gpu").await, "");
    assert_eq!(kubelet.unprepare("ml", "never", "u-never").await, "");
    // The whole GPU is free again for another claim.
    claims.set("u-gpu2", &[(DRIVER, NODE, "gpu-1")]);
    ok(&kubelet.prepare_one("ml", "gpu2", "u-gpu2").await);

    // Restart: a new lease core and plugin on the same store and hardware answer
    // the prepared claims with the same leases.
    drop(kubelet);
    node.stop().await;
    let node = Node::start(dir, claims.clone()).await;
    let mut kubelet = Kubelet::register(dir).await;
    // The CDI directory is a tmpfs: a reboot empties it; a prepare writes it again.
    std::fs::remove_dir_all(dir.join("cdi")).unwrap();
    assert_eq!(kubelet.prepare_one("ml", "mig", "u-mig").await, mig);
    assert!(
        dir.join("cdi")
            .join(format!("tessera.io-lease-{mig_lease}.json"))
            .is_file()
    );
    let tokens = claim_tokens(dir, "u-mig");
    assert_eq!(
        node.mgr.resolve_token(&tokens[0]).unwrap().lease.id,
        mig_lease,
        "the token still binds to the lease after the restart"
    );
    assert_eq!(kubelet.prepare_one("ml", "mps", "u-mps").await, mps);
    assert_eq!(
        node.mgr.get(&mig_lease).unwrap().0.state(),
        LeaseState::Active
    );
    // And releases them when kubelet unprepares after the restart.
    assert_eq!(kubelet.unprepare("ml", "mig", "u-mig").await, "");
    assert_eq!(
        node.mgr.get(&mig_lease).unwrap().0.state(),
        LeaseState::Released
    );
    node.stop().await;
}

/// kubelets before 1.34 speak DRAPlugin v1beta1: the same claims, the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1beta1_kubelet_prepares_and_unprepares_too() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let claims = Arc::new(Claims::default());
    let node = Node::start(dir, claims.clone()).await;
    let kubelet = Kubelet::register(dir).await;
    let ch = tessera_common::unix::channel(Path::new(&kubelet.info.endpoint))
        .await
        .unwrap();
    let mut old = drav1beta1::dra_plugin_client::DraPluginClient::new(ch);
    claims.set("u-1", &[(DRIVER, NODE, "gpu-0-mig-4-3g-40gb")]);
    let claim = drav1beta1::Claim {
        namespace: "ml".into(),
        name: "c".into(),
        uid: "u-1".into(),
    };
    let r = old
        .node_prepare_resources(drav1beta1::NodePrepareResourcesRequest {
            claims: vec![claim.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    let a = &r.claims["u-1"];
    assert!(a.error.is_empty(), "{}", a.error);
    assert_eq!(a.devices[0].device_name, "gpu-0-mig-4-3g-40gb");
    let id = a.devices[0].cdi_device_ids[0]
        .strip_prefix("tessera.io/lease=")
        .unwrap()
        .to_string();
    assert!(node.mgr.get(&id).unwrap().0.state().is_live());
    let r = old
        .node_unprepare_resources(drav1beta1::NodeUnprepareResourcesRequest {
            claims: vec![claim],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims["u-1"].error, "");
    assert_eq!(node.mgr.get(&id).unwrap().0.state(), LeaseState::Released);
    node.stop().await;
}

/// A socket removed (an operator cleaning up, a kubelet wiping its directories) is
/// made again, and kubelet's plugin watcher registers the plugin anew; prepared
/// claims are still answered on the new endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_sockets_are_made_again() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let claims = Arc::new(Claims::default());
    let node = Node::start(dir, claims.clone()).await;
    let mut kubelet = Kubelet::register(dir).await;
    claims.set("u-1", &[(DRIVER, NODE, "gpu-1")]);
    let first = kubelet.prepare_one("ml", "c", "u-1").await;
    ok(&first);
    let registration = dir.join("plugins_registry").join("gpu.tessera.io-reg.sock");
    let endpoint = PathBuf::from(&kubelet.info.endpoint);
    std::fs::remove_file(&registration).unwrap();
    std::fs::remove_file(&endpoint).unwrap();
    // Made again at the plugin's next look (every poll_interval, 2s by default).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !(registration.exists() && endpoint.exists()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the sockets were not made again"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut kubelet = Kubelet::register(dir).await;
    assert_eq!(kubelet.prepare_one("ml", "c", "u-1").await, first);
    node.stop().await;
    assert!(
        !registration.exists() && !endpoint.exists(),
        "a stopped plugin leaves no socket for kubelet to find"
    );
}
