//! The kubelet device plugin against a kubelet stand-in speaking kubelet's own
//! protocol (deviceplugin v1beta1, podresources v1) over unix sockets in a temp
//! dir: a Registration server on `kubelet.sock` that dials the plugin's endpoint as
//! kubelet does, a DevicePlugin client (ListAndWatch, GetPreferredAllocation,
//! Allocate), and a PodResourcesLister server whose pods the test sets.
//!
//! Covered: registration of every resource, allocating every advertised device at
//! once, idempotent Allocate, leases that follow pods (tenant of the namespace,
//! labels, release when the pod is gone), ListAndWatch updates on a mix change and on
//! a health change, kubelet restart (sockets deleted, kubelet.sock recreated ->
//! registered again), and a tesserad restart (the same device ids and tokens). Last,
//! an Allocate answer carried into a container as containerd does (the container
//! annotations and envs into the OCI spec) runs through the real tessera-runtime and
//! runc bound to its lease, and stops when its pod is gone.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../runtime-shim/tests/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_integration_tests::{TestDaemon, rt};
use tessera_proto::k8s::deviceplugin::v1beta1 as dp;
use tessera_proto::k8s::podresources::v1 as pr;
use tessera_proto::v1 as pb;
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// Two H100s with MIG and two A100s without (whole GPUs and MPS shares).
const GPUS: &str = r#"
[[sim.gpus]]
model = "h100-80gb"
mig = true

[[sim.gpus]]
model = "h100-80gb"
mig = true

[[sim.gpus]]
model = "a100-40gb"
mig = false

[[sim.gpus]]
model = "a100-40gb"
mig = false
"#;

const MIG: &str = "tessera.io/mig-1g.10gb";
const WHOLE: &str = "tessera.io/gpu";
const MPS: &str = "tessera.io/mps-small";

/// kubelet's side, shared by its servers.
#[derive(Clone)]
struct Kubelet {
    dir: PathBuf,
    registered: Arc<Mutex<Vec<dp::RegisterRequest>>>,
    pods: Arc<Mutex<Vec<pr::PodResources>>>,
}

#[tonic::async_trait]
impl dp::registration_server::Registration for Kubelet {
    async fn register(
        &self,
        req: Request<dp::RegisterRequest>,
    ) -> Result<Response<dp::Empty>, Status> {
        let r = req.into_inner();
        if r.version != "v1beta1" {
            return Err(Status::invalid_argument(format!("version {}", r.version)));
        }
        if r.endpoint.contains('/') {
            return Err(Status::invalid_argument("endpoint is a file name"));
        }
        // kubelet dials the endpoint at once: it must already be served.
        let ch = tessera_common::unix::channel(&self.dir.join(&r.endpoint))
            .await
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        dp::device_plugin_client::DevicePluginClient::new(ch)
            .get_device_plugin_options(dp::Empty {})
            .await?;
        self.registered.lock().unwrap().push(r);
        Ok(Response::new(dp::Empty {}))
    }
}

#[tonic::async_trait]
impl pr::pod_resources_lister_server::PodResourcesLister for Kubelet {
    async fn list(
        &self,
        _: Request<pr::ListPodResourcesRequest>,
    ) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        Ok(Response::new(pr::ListPodResourcesResponse {
            pod_resources: self.pods.lock().unwrap().clone(),
        }))
    }
    async fn get_allocatable_resources(
        &self,
        _: Request<pr::AllocatableResourcesRequest>,
    ) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not in the stand-in"))
    }
    async fn get(
        &self,
        _: Request<pr::GetPodResourcesRequest>,
    ) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not in the stand-in"))
    }
}

/// The stand-in: its temp dir (device-plugins/, pod-resources/), its servers.
struct StandIn {
    _tmp: tempfile::TempDir,
    kubelet: Kubelet,
    plugins_dir: PathBuf,
    pod_resources: PathBuf,
    cdi_dir: PathBuf,
    registration: Option<oneshot::Sender<()>>,
    _lister: oneshot::Sender<()>,
}

fn serve_unix<S>(path: &Path, svc: S) -> oneshot::Sender<()>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let _ = std::fs::remove_file(path);
    let listener = tokio::net::UnixListener::bind(path).unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                async {
                    let _ = rx.await;
                },
            )
            .await
            .unwrap();
    });
    tx
}

impl StandIn {
    fn start() -> StandIn {
        let tmp = tempfile::Builder::new()
            .prefix("kubelet-it")
            .tempdir()
            .unwrap();
        let plugins_dir = tmp.path().join("device-plugins");
        let pr_dir = tmp.path().join("pod-resources");
        std::fs::create_dir_all(&plugins_dir).unwrap();
        std::fs::create_dir_all(&pr_dir).unwrap();
        let kubelet = Kubelet {
            dir: plugins_dir.clone(),
            registered: Arc::default(),
            pods: Arc::default(),
        };
        let pod_resources = pr_dir.join("kubelet.sock");
        let lister = serve_unix(
            &pod_resources,
            pr::pod_resources_lister_server::PodResourcesListerServer::new(kubelet.clone()),
        );
        let mut s = StandIn {
            cdi_dir: tmp.path().join("cdi"),
            _tmp: tmp,
            kubelet,
            plugins_dir,
            pod_resources,
            registration: None,
            _lister: lister,
        };
        s.start_registration();
        s
    }

    fn start_registration(&mut self) {
        self.registration = Some(serve_unix(
            &self.plugins_dir.join("kubelet.sock"),
            dp::registration_server::RegistrationServer::new(self.kubelet.clone()),
        ));
    }

    /// What kubelet does when it restarts: its device manager deletes every file in
    /// the directory but its checkpoint, then serves a new kubelet.sock.
    fn restart_kubelet(&mut self) {
        if let Some(stop) = self.registration.take() {
            let _ = stop.send(());
        }
        for e in std::fs::read_dir(&self.plugins_dir).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().unwrap() != "kubelet_internal_checkpoint" {
                std::fs::remove_file(&p).unwrap();
            }
        }
        self.start_registration();
    }

    fn config(&self, mix: &str) -> String {
        format!(
            r#"
[kubernetes]
device_plugin = true
device_plugin_dir = {:?}
pod_resources_socket = {:?}
cdi_dir = {:?}
release_grace = "5s"
poll_interval = "200ms"
default_tenant = "k8s"

[kubernetes.namespaces]
team-a = "acme"

[[kubernetes.mps_classes]]
name = "small"
sm_percent = 25
memory = "8GiB"

[kubernetes.mix]
{mix}
"#,
            self.plugins_dir, self.pod_resources, self.cdi_dir
        )
    }

    fn registrations(&self, resource: &str) -> usize {
        self.kubelet
            .registered
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.resource_name == resource)
            .count()
    }

    fn endpoint(&self, resource: &str) -> PathBuf {
        let r = self.kubelet.registered.lock().unwrap();
        let reg = r
            .iter()
            .rev()
            .find(|r| r.resource_name == resource)
            .unwrap_or_else(|| panic!("{resource} never registered"));
        self.plugins_dir.join(&reg.endpoint)
    }

    /// Wait until `resource` has registered `n` times.
    fn wait_registered(&self, resource: &str, n: usize, d: &TestDaemon) {
        wait(&format!("{resource} registered {n} times"), d, || {
            self.registrations(resource) >= n
        });
    }

    async fn plugin(
        &self,
        resource: &str,
    ) -> dp::device_plugin_client::DevicePluginClient<Channel> {
        let ch = tessera_common::unix::channel(&self.endpoint(resource))
            .await
            .unwrap();
        dp::device_plugin_client::DevicePluginClient::new(ch)
    }

    fn set_pods(&self, pods: Vec<pr::PodResources>) {
        *self.kubelet.pods.lock().unwrap() = pods;
    }
}

fn pod(ns: &str, name: &str, resource: &str, ids: &[String]) -> pr::PodResources {
    pr::PodResources {
        name: name.into(),
        namespace: ns.into(),
        containers: vec![pr::ContainerResources {
            name: "main".into(),
            devices: vec![pr::ContainerDevices {
                resource_name: resource.into(),
                device_ids: ids.to_vec(),
                topology: None,
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn wait(what: &str, d: &TestDaemon, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "{what}: not within 30s\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// ListAndWatch messages until one satisfies `pred` (30 s at most).
async fn watch_until(
    stream: &mut tonic::Streaming<dp::ListAndWatchResponse>,
    what: &str,
    mut pred: impl FnMut(&[dp::Device]) -> bool,
) -> Vec<dp::Device> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let msg = tokio::time::timeout_at(deadline, stream.message())
            .await
            .unwrap_or_else(|_| panic!("ListAndWatch: {what}: no such list within 30s"))
            .unwrap()
            .expect("ListAndWatch ended");
        if pred(&msg.devices) {
            return msg.devices;
        }
    }
}

async fn list_and_watch(
    c: &mut dp::device_plugin_client::DevicePluginClient<Channel>,
) -> tonic::Streaming<dp::ListAndWatchResponse> {
    c.list_and_watch(dp::Empty {}).await.unwrap().into_inner()
}

fn ids(devs: &[dp::Device]) -> Vec<String> {
    devs.iter().map(|d| d.id.clone()).collect()
}

fn all_healthy(devs: &[dp::Device], n: usize) -> bool {
    devs.len() == n && devs.iter().all(|d| d.health == "Healthy")
}

async fn allocate_each(
    c: &mut dp::device_plugin_client::DevicePluginClient<Channel>,
    ids: &[String],
) -> Result<Vec<dp::ContainerAllocateResponse>, Status> {
    c.allocate(dp::AllocateRequest {
        container_requests: ids
            .iter()
            .map(|id| dp::ContainerAllocateRequest {
                devices_ids: vec![id.clone()],
            })
            .collect(),
    })
    .await
    .map(|r| r.into_inner().container_responses)
}

/// The Prometheus text of the daemon's metrics endpoint.
fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

async fn lease(d: &TestDaemon, id: &str) -> pb::Lease {
    d.client()
        .await
        .unwrap()
        .get_lease(pb::GetLeaseRequest {
            lease_id: id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap()
}

#[test]
fn every_advertised_device_allocates_at_once_idempotently_and_leases_follow_pods() {
    let rt = rt();
    let _g = rt.enter();
    let k = StandIn::start();
    let d = TestDaemon::start_with(
        GPUS,
        &k.config(
            "\"mig-1g.10gb\" = 3\ngpu = 1\nmps-small = 2\n\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
        ),
    )
    .unwrap();
    let metrics = d.metrics_addr().unwrap();
    for r in [MIG, WHOLE, MPS] {
        k.wait_registered(r, 1, &d);
    }
    rt.block_on(async {
        let mut c = k.plugin(MIG).await;
        let opts = c
            .get_device_plugin_options(dp::Empty {})
            .await
            .unwrap()
            .into_inner();
        assert!(opts.get_preferred_allocation_available);
        let mut per: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for (r, n) in [(MIG, 3), (WHOLE, 1), (MPS, 2)] {
            let mut c = k.plugin(r).await;
            let mut s = list_and_watch(&mut c).await;
            let devs = watch_until(&mut s, r, |d| all_healthy(d, n)).await;
            per.insert(r, ids(&devs));
        }

        // Every advertised device of every resource, all at once.
        let mut tokens = BTreeSet::new();
        for (r, list) in &per {
            let mut c = k.plugin(r).await;
            let resp = allocate_each(&mut c, list).await.unwrap();
            assert_eq!(resp.len(), list.len());
            for (id, a) in list.iter().zip(&resp) {
                let tok = a.annotations.get("tessera.io/lease-token").unwrap();
                assert!(tokens.insert(tok.clone()), "a token given twice");
                assert_eq!(a.envs.get("TESSERA_LEASE_ID"), Some(id));
                assert_eq!(a.cdi_devices[0].name, format!("tessera.io/lease={id}"));
                // The CDI spec names exactly this lease's device.
                let spec =
                    std::fs::read_to_string(k.cdi_dir.join(format!("tessera.io-lease-{id}.json")))
                        .unwrap();
                let spec: serde_json::Value = serde_json::from_str(&spec).unwrap();
                assert_eq!(spec["kind"], "tessera.io/lease");
                assert_eq!(spec["devices"][0]["name"], id.as_str());
                // The token is the lease's: the runtime's ResolveToken says so.
                let resolved = d
                    .client()
                    .await
                    .unwrap()
                    .resolve_token(pb::ResolveTokenRequest { token: tok.clone() })
                    .await
                    .unwrap()
                    .into_inner();
                assert_eq!(&resolved.lease.unwrap().id, id);
            }
            // kubelet asks again (a retry, a restart): the same answer.
            let again = allocate_each(&mut c, list).await.unwrap();
            assert_eq!(again, resp, "{r}: Allocate is not idempotent");
        }
        let mut c = k.plugin(MIG).await;
        let two = c
            .allocate(dp::AllocateRequest {
                container_requests: vec![dp::ContainerAllocateRequest {
                    devices_ids: per[MIG][..2].to_vec(),
                }],
            })
            .await
            .unwrap_err();
        assert_eq!(two.code(), tonic::Code::InvalidArgument, "{two:?}");
        let unknown = allocate_each(&mut c, &["l-nope".to_string()])
            .await
            .unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
        // A device of another resource is not this endpoint's.
        let other = allocate_each(&mut c, &per[WHOLE]).await.unwrap_err();
        assert_eq!(other.code(), tonic::Code::NotFound, "{other:?}");

        // Preferred allocation: what kubelet must include comes first.
        let pref = c
            .get_preferred_allocation(dp::PreferredAllocationRequest {
                container_requests: vec![dp::ContainerPreferredAllocationRequest {
                    available_device_i_ds: per[MIG].clone(),
                    must_include_device_i_ds: vec![per[MIG][2].clone()],
                    allocation_size: 2,
                }],
            })
            .await
            .unwrap()
            .into_inner();
        let chosen = &pref.container_responses[0].device_i_ds;
        assert_eq!(chosen.len(), 2);
        assert_eq!(chosen[0], per[MIG][2]);

        // Leases follow pods: the namespace's tenant, labelled with the pod.
        let held = per[MIG][0].clone();
        let other_pod = per[MIG][1].clone();
        k.set_pods(vec![
            pod("team-a", "trainer-0", MIG, std::slice::from_ref(&held)),
            pod("team-b", "web-1", MIG, std::slice::from_ref(&other_pod)),
        ]);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let l = lease(&d, &held).await;
            let o = lease(&d, &other_pod).await;
            if l.tenant == "acme"
                && l.labels.get("tessera.io/k8s-pod").map(String::as_str) == Some("trainer-0")
                && o.labels.get("tessera.io/k8s-namespace").map(String::as_str) == Some("team-b")
            {
                assert_eq!(l.labels["tessera.io/k8s-namespace"], "team-a");
                // An unmapped namespace keeps the default tenant.
                assert_eq!(o.tenant, "k8s");
                break;
            }
            assert!(Instant::now() < deadline, "lease never followed its pod: {l:?}\n{}", d.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Metrics say which pod holds which lease.
        let want = format!(
            "tessera_kubernetes_pod_leases{{namespace=\"team-a\",pod=\"trainer-0\",tenant=\"acme\",resource=\"{MIG}\",lease=\"{held}\"}} 1"
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = scrape(&metrics);
            if text.lines().any(|l| l == want) {
                break;
            }
            assert!(Instant::now() < deadline, "no {want} in:\n{text}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        // trainer-0 is gone: after the grace its lease is released, and a fresh
        // reservation keeps the count.
        let mut s = list_and_watch(&mut c).await;
        k.set_pods(vec![pod(
            "team-b",
            "web-1",
            MIG,
            std::slice::from_ref(&other_pod),
        )]);
        let devs = watch_until(&mut s, "a replacement for the released device", |d| {
            all_healthy(d, 3) && !ids(d).contains(&held)
        })
        .await;
        assert!(ids(&devs).contains(&other_pod), "a held device went away");
        let l = lease(&d, &held).await;
        assert_eq!(l.state, pb::LeaseState::Released as i32, "{l:?}");
        assert!(l.end_reason.contains("trainer-0"), "{}", l.end_reason);
        assert!(
            !k.cdi_dir
                .join(format!("tessera.io-lease-{held}.json"))
                .exists(),
            "the CDI spec outlived its lease"
        );
        // web-1 ends and kubelet at once gives its device to web-2 (it frees a
        // terminated pod's devices right away): web-2 gets a fresh lease, not web-1's
        // token (bound to web-1's pod by the runtime).
        let web1 = allocate_each(&mut c, std::slice::from_ref(&other_pod))
            .await
            .unwrap()
            .remove(0);
        let web1_lease = web1.envs["TESSERA_LEASE_ID"].clone();
        k.set_pods(Vec::new());
        let web2 = allocate_each(&mut c, std::slice::from_ref(&other_pod))
            .await
            .unwrap()
            .remove(0);
        assert_ne!(
            web2.annotations["tessera.io/lease-token"],
            web1.annotations["tessera.io/lease-token"]
        );
        let old = lease(&d, &web1_lease).await;
        assert_eq!(old.state, pb::LeaseState::Released as i32, "{old:?}");
        assert!(old.end_reason.contains("another pod"), "{}", old.end_reason);
        k.set_pods(vec![pod("team-b", "web-2", MIG, std::slice::from_ref(&other_pod))]);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let l = lease(&d, &web2.envs["TESSERA_LEASE_ID"]).await;
            if l.labels.get("tessera.io/k8s-pod").map(String::as_str) == Some("web-2") {
                break;
            }
            assert!(Instant::now() < deadline, "web-2's lease: {l:?}\n{}", d.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        // The devices allocated but never seen in a pod are released too.
        let never = per[MIG][2].clone();
        assert_ne!(
            lease(&d, &never).await.state,
            pb::LeaseState::Active as i32,
            "a device no pod ever held kept its lease"
        );
    });
}

#[test]
fn list_and_watch_follows_health_and_mix_changes() {
    let rt = rt();
    let _g = rt.enter();
    let k = StandIn::start();
    let mut d = TestDaemon::start_with(GPUS, &k.config("\"mig-1g.10gb\" = 3\n")).unwrap();
    k.wait_registered(MIG, 1, &d);
    rt.block_on(async {
        let mut c = k.plugin(MIG).await;
        let mut s = list_and_watch(&mut c).await;
        let devs = watch_until(&mut s, "3 healthy", |d| all_healthy(d, 3)).await;
        let first = devs[0].id.clone();
        let gpu = lease(&d, &first).await.partition.unwrap().gpu_index;

        // Health: the GPU taken out of service -> its devices Unhealthy, and back.
        let (ok, out) = d.cli(&[
            "gpu",
            "mark-unhealthy",
            &gpu.to_string(),
            "--reason",
            "test",
        ]);
        assert!(ok, "{out}");
        let devs = watch_until(&mut s, "unhealthy", |d| {
            d.iter().any(|x| x.id == first && x.health == "Unhealthy")
        })
        .await;
        assert_eq!(devs.len(), 3);
        let (ok, out) = d.cli(&["gpu", "mark-healthy", &gpu.to_string(), "--reason", "test"]);
        assert!(ok, "{out}");
        watch_until(&mut s, "healthy again", |d| all_healthy(d, 3)).await;

        // Mix: one device allocated, then the mix says 1: only free ones go.
        allocate_each(&mut c, std::slice::from_ref(&first))
            .await
            .unwrap();
        k.set_pods(vec![pod("team-a", "p", MIG, std::slice::from_ref(&first))]);
        let text = std::fs::read_to_string(&d.config)
            .unwrap()
            .replace("\"mig-1g.10gb\" = 3", "\"mig-1g.10gb\" = 1");
        std::fs::write(&d.config, text).unwrap();
        let (ok, out) = d.cli(&["reload"]);
        assert!(ok, "{out}");
        let devs = watch_until(&mut s, "one device", |d| d.len() == 1).await;
        assert_eq!(
            ids(&devs),
            vec![first.clone()],
            "the allocated device went away"
        );
        let text = std::fs::read_to_string(&d.config)
            .unwrap()
            .replace("\"mig-1g.10gb\" = 1", "\"mig-1g.10gb\" = 2");
        std::fs::write(&d.config, text).unwrap();
        let (ok, out) = d.cli(&["reload"]);
        assert!(ok, "{out}");
        let devs = watch_until(&mut s, "two devices", |d| all_healthy(d, 2)).await;
        assert!(ids(&devs).contains(&first));
    });
    d.stop().unwrap();
}

#[test]
fn kubelet_and_tesserad_restarts_keep_devices_and_registration() {
    let rt = rt();
    let _g = rt.enter();
    let mut k = StandIn::start();
    let mut d = TestDaemon::start_with(GPUS, &k.config("\"mig-1g.10gb\" = 2\ngpu = 1\n")).unwrap();
    k.wait_registered(MIG, 1, &d);
    k.wait_registered(WHOLE, 1, &d);
    let (before, token) = rt.block_on(async {
        let mut c = k.plugin(MIG).await;
        let mut s = list_and_watch(&mut c).await;
        let devs = watch_until(&mut s, "2 healthy", |d| all_healthy(d, 2)).await;
        let resp = allocate_each(&mut c, &ids(&devs)[..1]).await.unwrap();
        (
            ids(&devs),
            resp[0].annotations["tessera.io/lease-token"].clone(),
        )
    });
    k.set_pods(vec![pod("team-a", "p", MIG, &before[..1])]);

    // kubelet restarts: the plugin sockets are deleted, kubelet.sock is new.
    k.restart_kubelet();
    k.wait_registered(MIG, 2, &d);
    k.wait_registered(WHOLE, 2, &d);
    rt.block_on(async {
        let mut c = k.plugin(MIG).await;
        let mut s = list_and_watch(&mut c).await;
        let devs = watch_until(&mut s, "the same devices", |d| all_healthy(d, 2)).await;
        assert_eq!(ids(&devs), before);
    });

    // Only kubelet.sock is new (the plugin's socket kept): registered again too.
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(k.endpoint(MIG))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "the plugin socket answers tokens: root only"
        );
    }
    if let Some(stop) = k.registration.take() {
        let _ = stop.send(());
    }
    std::fs::remove_file(k.plugins_dir.join("kubelet.sock")).unwrap();
    k.start_registration();
    k.wait_registered(MIG, 3, &d);

    // tesserad restarts: the same ids for the same leases, the same token.
    d.stop().unwrap();
    d.spawn().unwrap();
    k.wait_registered(MIG, 4, &d);
    rt.block_on(async {
        let mut c = k.plugin(MIG).await;
        let mut s = list_and_watch(&mut c).await;
        let devs = watch_until(&mut s, "the same devices", |d| all_healthy(d, 2)).await;
        assert_eq!(ids(&devs), before);
        let resp = allocate_each(&mut c, &before[..1]).await.unwrap();
        assert_eq!(resp[0].annotations["tessera.io/lease-token"], token);
    });
    d.stop().unwrap();
}

#[test]
fn an_allocate_answer_runs_a_container_bound_to_its_lease_until_its_pod_is_gone() {
    if !common::can_run_as_root("device plugin to runtime", &["runc", "busybox", "cc"]) {
        return;
    }
    let rt = rt();
    let _g = rt.enter();
    let k = StandIn::start();
    let work = tempfile::tempdir().unwrap();
    let dev = work.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    let d = TestDaemon::start_with(
        GPUS,
        &format!(
            "{}\n[devices]\ndev_root = {dev:?}\n[lease]\nrevocation_grace = \"1s\"\n",
            k.config("\"mig-1g.10gb\" = 1\n")
        ),
    )
    .unwrap();
    k.wait_registered(MIG, 1, &d);
    let (id, alloc, resolved) = rt.block_on(async {
        let mut c = k.plugin(MIG).await;
        let mut s = list_and_watch(&mut c).await;
        let devs = watch_until(&mut s, "one device", |d| all_healthy(d, 1)).await;
        let alloc = allocate_each(&mut c, &ids(&devs)).await.unwrap().remove(0);
        let resolved = d
            .client()
            .await
            .unwrap()
            .resolve_token(pb::ResolveTokenRequest {
                token: alloc.annotations["tessera.io/lease-token"].clone(),
            })
            .await
            .unwrap()
            .into_inner();
        (devs[0].id.clone(), alloc, resolved)
    });
    // The CDI spec names exactly the lease's device nodes.
    let spec: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(k.cdi_dir.join(format!("tessera.io-lease-{id}.json"))).unwrap(),
    )
    .unwrap();
    let mut cdi_nodes: Vec<String> = spec["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap().to_string())
        .collect();
    let mut lease_nodes: Vec<String> = resolved
        .devices
        .iter()
        .map(|d| d.container_path.clone())
        .collect();
    cdi_nodes.sort();
    lease_nodes.sort();
    assert_eq!(cdi_nodes, lease_nodes);

    // The driver's nodes on the "host".
    for n in &resolved.devices {
        let p = Path::new(&n.host_path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        if !p.exists() {
            nix::sys::stat::mknod(
                p,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(n.major as u64, n.minor as u64),
            )
            .unwrap();
        }
    }
    // What containerd makes of kubelet's container config: the container annotations
    // it passes (container_annotations) and the envs, in the OCI spec.
    let rootfs = common::busybox_rootfs(work.path());
    let gpu = resolved
        .lease
        .as_ref()
        .unwrap()
        .partition
        .as_ref()
        .unwrap()
        .gpu_index;
    let script = format!(
        "probe open /dev/nvidia{gpu}; echo LEASE=$TESSERA_LEASE_ID; echo CVD=$CUDA_VISIBLE_DEVICES; \
         trap '' TERM; while :; do sleep 1; done"
    );
    let mut oci = common::base_spec(&["sh", "-c", &script]);
    oci["root"]["path"] = serde_json::json!(rootfs);
    oci["annotations"] = serde_json::json!(alloc.annotations);
    let env = oci["process"]["env"].as_array_mut().unwrap();
    for (k, v) in &alloc.envs {
        env.push(serde_json::json!(format!("{k}={v}")));
    }
    let bundle = work.path().join("bundle");
    common::write_spec(&bundle, &oci);
    let proc_root = common::fake_nvidia_proc(work.path());
    let runtime_config = common::runtime_config(work.path(), &d.socket, &proc_root, "");
    let runc_root = work.path().join("runc-root");
    let out_path = work.path().join("out");
    let runtime = |args: &[&str]| {
        std::process::Command::new(common::runtime_bin())
            .env("TESSERA_RUNTIME_CONFIG", &runtime_config)
            .arg("--root")
            .arg(&runc_root)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(std::fs::File::create(work.path().join("err")).unwrap())
            .status()
            .unwrap()
    };
    let cid = format!("k8s-e2e-{}", std::process::id());
    let st = runtime(&["create", "--bundle", bundle.to_str().unwrap(), &cid]);
    assert!(
        st.success(),
        "create: {}",
        std::fs::read_to_string(work.path().join("err")).unwrap()
    );
    assert!(runtime(&["start", &cid]).success());
    let mig_uuid = resolved
        .lease
        .as_ref()
        .unwrap()
        .partition
        .as_ref()
        .unwrap()
        .mig
        .as_ref()
        .unwrap()
        .mig_uuid
        .clone();
    wait("the container's output", &d, || {
        std::fs::read_to_string(&out_path).is_ok_and(|o| o.contains("CVD="))
    });
    let out = std::fs::read_to_string(&out_path).unwrap();
    for want in [
        format!("open /dev/nvidia{gpu} errno=6"),
        format!("LEASE={id}"),
        format!("CVD={mig_uuid}"),
    ] {
        assert!(
            out.lines().any(|l| l.trim() == want),
            "missing {want:?} in {out}"
        );
    }
    rt.block_on(async {
        let l = lease(&d, &id).await;
        assert_eq!(l.containers.len(), 1, "the runtime bound the container");
        assert_eq!(l.containers[0].id, cid);
    });
    // The pod runs, then is gone: after the grace the lease is released and its
    // container stopped (it ignores SIGTERM: killed).
    k.set_pods(vec![pod("team-a", "job", MIG, std::slice::from_ref(&id))]);
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(30);
        while lease(&d, &id).await.tenant != "acme" {
            assert!(
                Instant::now() < deadline,
                "never handed to acme\n{}",
                d.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    k.set_pods(Vec::new());
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let l = lease(&d, &id).await;
            if l.state == pb::LeaseState::Released as i32 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "not released: {l:?}\n{}",
                d.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let state = std::process::Command::new("runc")
        .arg("--root")
        .arg(&runc_root)
        .args(["state", &cid])
        .output()
        .unwrap();
    let state: serde_json::Value = serde_json::from_slice(&state.stdout).unwrap_or_default();
    assert_ne!(
        state["status"], "running",
        "the container outlived its lease"
    );
    let _ = runtime(&["delete", "--force", &cid]);
}
