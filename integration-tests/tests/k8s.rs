//! The kubelet device plugin against a kubelet stand-in speaking kubelet's own
//! protocol (deviceplugin v1beta1, podresources v1) over unix sockets in a temp
//! dir: a Registration server on `kubelet.sock` that dials the plugin's endpoint as
//! kubelet does, a DevicePlugin client (ListAndWatch, GetPreferredAllocation,
//! Allocate), and a PodResourcesLister server whose pods the test sets.
//!
//! Covered: registration of every resource, allocating every advertised device at
//! once (one device per container, and all of a resource in one container),
//! idempotent Allocate, leases that follow pods (tenant of the namespace,
//! labels, release when the pod is gone), ListAndWatch updates on a mix change and on
//! a health change, kubelet restart (sockets deleted, kubelet.sock recreated ->
//! registered again), and a tesserad restart (the same device ids and tokens). Last,
//! an Allocate answer carried into a container as containerd does (the container
//! annotations and envs into the OCI spec) runs through the real tessera-runtime and
//! runc bound to its lease, and stops when its pod is gone; and a container given two
//! MIG devices in one request runs bound to both leases, sees both instances (in
//! init and in exec), and stops when either lease ends.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../runtime-shim/tests/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_integration_tests::{TestDaemon, devnodes, rt};
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

/// One container asking for all of `ids` (a pod with `resource: N`).
async fn allocate_all(
    c: &mut dp::device_plugin_client::DevicePluginClient<Channel>,
    ids: &[String],
) -> Result<dp::ContainerAllocateResponse, Status> {
    let mut r = c
        .allocate(dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest {
                devices_ids: ids.to_vec(),
            }],
        })
        .await?
        .into_inner()
        .container_responses;
    assert_eq!(r.len(), 1, "one answer per container request");
    Ok(r.remove(0))
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
            // Every device of the resource in ONE container request (a pod asking
            // for `resource: N`): one answer carrying every lease, in order.
            let all = allocate_all(&mut c, list).await.unwrap();
            let each_tokens: Vec<&str> = resp
                .iter()
                .map(|a| a.annotations["tessera.io/lease-token"].as_str())
                .collect();
            assert_eq!(
                all.annotations["tessera.io/lease-token"],
                each_tokens.join(","),
                "{r}: the tokens of every device, comma-separated"
            );
            assert_eq!(all.envs["TESSERA_LEASE_ID"], list.join(","));
            assert_eq!(
                all.cdi_devices
                    .iter()
                    .map(|d| d.name.clone())
                    .collect::<Vec<_>>(),
                list.iter()
                    .map(|id| format!("tessera.io/lease={id}"))
                    .collect::<Vec<_>>()
            );
            assert_eq!(
                allocate_all(&mut c, list).await.unwrap(),
                all,
                "{r}: a multi-device Allocate is not idempotent"
            );
        }
        let mut c = k.plugin(MIG).await;
        let twice = allocate_all(&mut c, &[per[MIG][0].clone(), per[MIG][0].clone()])
            .await
            .unwrap_err();
        assert_eq!(twice.code(), tonic::Code::InvalidArgument, "{twice:?}");
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
    devnodes::lease_nodes(&resolved, Path::new("/")).unwrap();
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
    let cid = format!("k8s-e2e-{}", std::process::id());
    let c = AllocatedContainer::create(work.path(), &d, &alloc, &rootfs, &script, &cid);
    assert!(c.runtime(&["start", &cid]).success());
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
        std::fs::read_to_string(&c.out).is_ok_and(|o| o.contains("CVD="))
    });
    let out = std::fs::read_to_string(&c.out).unwrap();
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
    assert!(!c.running(&cid), "the container outlived its lease");
    let _ = c.runtime(&["delete", "--force", &cid]);
}

/// A container made from an Allocate answer as containerd makes it from kubelet's
/// container config (the answer's annotations and envs in the OCI spec), created
/// through tessera-runtime with its own runc root; stdout goes to `out`.
struct AllocatedContainer {
    bundle: PathBuf,
    runtime_config: PathBuf,
    runc_root: PathBuf,
    out: PathBuf,
    err: PathBuf,
}

impl AllocatedContainer {
    fn create(
        work: &Path,
        d: &TestDaemon,
        alloc: &dp::ContainerAllocateResponse,
        rootfs: &Path,
        script: &str,
        cid: &str,
    ) -> Self {
        let bundle = work.join("bundle");
        let mut oci = common::base_spec(&["sh", "-c", script]);
        debug_assert_eq!(rootfs, work.join("rootfs"));
        oci["root"]["path"] = serde_json::json!(common::bundle_rootfs(work, &bundle));
        oci["annotations"] = serde_json::json!(alloc.annotations);
        let env = oci["process"]["env"].as_array_mut().unwrap();
        for (k, v) in &alloc.envs {
            env.push(serde_json::json!(format!("{k}={v}")));
        }
        common::write_spec(&bundle, &oci);
        let proc_root = common::fake_nvidia_proc(work);
        let c = AllocatedContainer {
            runtime_config: common::runtime_config(work, &d.socket, &proc_root, ""),
            runc_root: work.join("runc-root"),
            out: work.join("out"),
            err: work.join("err"),
            bundle,
        };
        let st = c.runtime(&["create", "--bundle", c.bundle.to_str().unwrap(), cid]);
        assert!(
            st.success(),
            "create: {}",
            std::fs::read_to_string(&c.err).unwrap()
        );
        c
    }

    /// tessera-runtime with this container's config and runc root.
    fn command(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(common::runtime_bin());
        cmd.env("TESSERA_RUNTIME_CONFIG", &self.runtime_config)
            .arg("--root")
            .arg(&self.runc_root)
            .stdin(std::process::Stdio::null());
        cmd
    }

    /// Whether runc (asked directly, not through the runtime) says `cid` is running.
    fn running(&self, cid: &str) -> bool {
        let state = std::process::Command::new("runc")
            .arg("--root")
            .arg(&self.runc_root)
            .args(["state", cid])
            .output()
            .unwrap();
        let state: serde_json::Value = serde_json::from_slice(&state.stdout).unwrap_or_default();
        state["status"] == "running"
    }

    /// Runs `args`, its stdout going to `out` (the container's, for create/start).
    fn runtime(&self, args: &[&str]) -> std::process::ExitStatus {
        self.command()
            .args(args)
            .stdout(std::fs::File::create(&self.out).unwrap())
            .stderr(std::fs::File::create(&self.err).unwrap())
            .status()
            .unwrap()
    }
}

/// A pod asking for `tessera.io/mig-1g.10gb: 2`: kubelet sends both device ids in
/// one container request; the answer carries both leases, and the container runs
/// through the real runtime and runc with both MIG instances (both capability
/// nodes, both UUIDs in order), bound to both leases. Releasing either lease stops
/// it; deleting it unbinds it from the other.
#[test]
fn a_container_given_two_mig_devices_runs_on_both_leases_and_stops_when_one_ends() {
    if !common::can_run_as_root("device plugin to runtime", &["runc", "busybox", "cc"]) {
        return;
    }
    let rt = rt();
    let _g = rt.enter();
    let k = StandIn::start();
    let work = tempfile::tempdir().unwrap();
    let dev = work.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    let mut d = TestDaemon::start_with(
        GPUS,
        &format!(
            "{}\n[devices]\ndev_root = {dev:?}\n[lease]\nrevocation_grace = \"1s\"\n",
            k.config("\"mig-1g.10gb\" = 2\n")
        ),
    )
    .unwrap();
    k.wait_registered(MIG, 1, &d);
    let (ids, alloc, resolved) = rt.block_on(async {
        let mut c = k.plugin(MIG).await;
        let mut s = list_and_watch(&mut c).await;
        let devs = watch_until(&mut s, "two devices", |d| all_healthy(d, 2)).await;
        let ids = ids(&devs);
        let alloc = allocate_all(&mut c, &ids).await.unwrap();
        let mut resolved = Vec::new();
        for token in alloc.annotations["tessera.io/lease-token"].split(',') {
            resolved.push(
                d.client()
                    .await
                    .unwrap()
                    .resolve_token(pb::ResolveTokenRequest {
                        token: token.to_string(),
                    })
                    .await
                    .unwrap()
                    .into_inner(),
            );
        }
        (ids, alloc, resolved)
    });
    assert_eq!(resolved.len(), 2, "{alloc:?}");
    let mut caps = Vec::new();
    let mut uuids = Vec::new();
    for (r, id) in resolved.iter().zip(&ids) {
        let l = r.lease.as_ref().unwrap();
        assert_eq!(&l.id, id, "the tokens in the order of the devices");
        devnodes::lease_nodes(r, Path::new("/")).unwrap();
        let ci = r
            .devices
            .iter()
            .filter(|d| d.container_path.contains("nvidia-caps"))
            .map(|d| d.container_path.clone())
            .next_back()
            .unwrap();
        caps.push(ci);
        uuids.push(
            l.partition
                .as_ref()
                .unwrap()
                .mig
                .as_ref()
                .unwrap()
                .mig_uuid
                .clone(),
        );
    }
    assert_ne!(caps[0], caps[1], "two MIG instances, two capability nodes");
    let rootfs = common::busybox_rootfs(work.path());
    let script = format!(
        "probe open_ro {}; probe open_ro {}; echo LEASE=$TESSERA_LEASE_ID; \
         echo CVD=$CUDA_VISIBLE_DEVICES; trap '' TERM; while :; do sleep 1; done",
        caps[0], caps[1]
    );
    let cid = format!("k8s-multi-{}", std::process::id());
    let c = AllocatedContainer::create(work.path(), &d, &alloc, &rootfs, &script, &cid);
    // No token is left in the config runc reads.
    let saved = std::fs::read_to_string(c.bundle.join("config.json")).unwrap();
    for t in alloc.annotations["tessera.io/lease-token"].split(',') {
        assert!(!saved.contains(t), "a token left in config.json");
    }
    assert!(c.runtime(&["start", &cid]).success());
    wait("the container's output", &d, || {
        std::fs::read_to_string(&c.out).is_ok_and(|o| o.contains("CVD="))
    });
    let out = std::fs::read_to_string(&c.out).unwrap();
    for want in [
        format!("open_ro {} errno=6", caps[0]),
        format!("open_ro {} errno=6", caps[1]),
        format!("LEASE={}", ids.join(",")),
        format!("CVD={}", uuids.join(",")),
    ] {
        assert!(
            out.lines().any(|l| l.trim() == want),
            "missing {want:?} in {out}"
        );
    }
    // A process exec'd into the container gets the merged variables too.
    let exec = c
        .command()
        .args([
            "exec",
            &cid,
            "sh",
            "-c",
            "echo EXEC=$TESSERA_LEASE_ID/$CUDA_VISIBLE_DEVICES",
        ])
        .output()
        .unwrap();
    assert!(exec.status.success(), "exec: {exec:?}");
    assert_eq!(
        String::from_utf8_lossy(&exec.stdout).trim(),
        format!("EXEC={}/{}", ids.join(","), uuids.join(","))
    );
    rt.block_on(async {
        for id in &ids {
            let l = lease(&d, id).await;
            let bound: Vec<&str> = l.containers.iter().map(|c| c.id.as_str()).collect();
            assert_eq!(bound, [cid.as_str()], "not bound to lease {id}");
        }
        // One of the two leases ends: the container stops.
        d.client()
            .await
            .unwrap()
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: ids[1].clone(),
                reason: "taken back".into(),
            })
            .await
            .unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.running(&cid) {
        assert!(
            Instant::now() < deadline,
            "the container outlived one of its leases\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(c.runtime(&["delete", "--force", &cid]).success());
    // Deleted: forgotten on the lease that is still live too.
    rt.block_on(async {
        let l = lease(&d, &ids[0]).await;
        assert_eq!(l.state, pb::LeaseState::Active as i32);
        assert!(l.containers.is_empty(), "{l:?}");
    });
    d.stop().unwrap();
}
