//! End to end through Kubernetes' CRI: a private containerd (its own root, state,
//! sockets, CNI bridge without uplink) with `tessera-runtime` as the `tessera` runtime
//! handler, `tesserad` on the simulator, and a CRI RuntimeService v1 client generated
//! from kubernetes/cri-api driving it as kubelet does: RunPodSandbox with the runtime
//! handler, kubelet's cgroup parent and annotations; CreateContainer with kubelet's
//! mounts (termination log included) and the device plugin's token annotation;
//! StartContainer, ExecSync, UpdateContainerResources, stats, Stop/Remove.
//!
//! Needs root, containerd with its CRI plugin, runc, busybox-static, a C compiler and
//! the CNI plugins (Debian: containernetworking-plugins); says SKIPPED otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../runtime-shim/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use tessera_integration_tests::cri::{self, Containerd, ContainerdSetup, Pod, pb};
use tessera_integration_tests::{DEV_GPUS, TestDaemon, create_req, devnodes, rt, shape};
use tessera_proto::v1 as tpb;

/// Worlds made by this process (each gets its own bridge and subnet).
static WORLDS: AtomicU32 = AtomicU32::new(0);
/// Pods made by this process (unique uids).
static PODS: AtomicU32 = AtomicU32::new(0);

struct World {
    ctrd: Containerd,
    daemon: TestDaemon,
    dev: PathBuf,
    /// Stands for kubelet's "/kubepods": every pod's cgroup is below it.
    cgroup_root: String,
    dir: tempfile::TempDir,
}

/// A lease made through the API, with the token and what the runtime will resolve.
struct Lease {
    lease: tpb::Lease,
    token: String,
    resolved: tpb::ResolveTokenResponse,
}

impl World {
    fn new() -> Option<World> {
        Self::with_driver(false)
    }

    /// A world whose handler uses runc's systemd cgroup driver when `systemd`.
    fn with_driver(systemd: bool) -> Option<World> {
        Self::with_config(systemd, "")
    }

    /// [`World::with_driver`] with `extra` tesserad config.
    fn with_config(systemd: bool, extra: &str) -> Option<World> {
        if !common::can_run_as_root(
            "CRI end-to-end",
            &[
                "containerd",
                "ctr",
                "containerd-shim-runc-v2",
                "runc",
                "busybox",
                "cc",
            ],
        ) {
            return None;
        }
        let Some(cni_bin_dir) = cri::cni_bin_dir() else {
            skipped(
                "CRI end-to-end: no CNI bridge/host-local plugins in /usr/lib/cni or /opt/cni/bin (Debian: containernetworking-plugins)",
            );
            return None;
        };
        // Unique on this host among concurrent runs too: up to 32 worlds a process.
        let n = WORLDS.fetch_add(1, Ordering::SeqCst) % 32;
        let slot = (std::process::id() % 3_000) * 32 + n;
        // Short paths: unix socket names are limited to 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("tcri")
            .tempdir_in("/tmp")
            .unwrap();
        let dev = dir.path().join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        let daemon = TestDaemon::start_with(
            DEV_GPUS,
            &format!(
                "[devices]\ndev_root = {dev:?}\n[lease]\nmin_ttl = \"1s\"\nrevocation_grace = \"1s\"\n{extra}"
            ),
        )
        .unwrap();
        let rootfs = common::busybox_rootfs(dir.path());
        let proc_root = common::fake_nvidia_proc(dir.path());
        // The runtime as an operator installs it under another name: a link whose
        // config sits beside it (`<name>.toml`), found without any environment.
        let bin_dir = dir.path().join("bin");
        std::fs::create_dir_all(&bin_dir).unwrap();
        let runtime_bin = bin_dir.join("tessera-gpu");
        std::os::unix::fs::symlink(common::runtime_bin(), &runtime_bin).unwrap();
        let setup = ContainerdSetup {
            dir: dir.path().join("c"),
            runtime_bin: runtime_bin.clone(),
            cni_bin_dir,
            slot,
            systemd_cgroup: systemd,
        };
        std::fs::create_dir_all(&setup.dir).unwrap();
        let runc = common::which("runc").unwrap();
        std::fs::write(
            bin_dir.join("tessera-gpu.toml"),
            format!(
                "runc_path = {runc:?}\nstate_dir = {rt_state:?}\ndaemon_socket = {sock:?}\ndaemon_timeout_ms = 3000\nnvidia_proc_root = {proc_root:?}\n\
                 runc_cve_acknowledged = [\"CVE-2025-31133\", \"CVE-2025-52565\", \"CVE-2025-52881\"]\n\
                 [policy]\napparmor = \"if-available\"\ncontainerd_root = {root:?}\ncontainerd_state = {state:?}\nkubelet_root = {kubelet:?}\n\
                 kubepods_roots = [\"/tessera-e2e-{slot}\", \"e2etessera{pid}.slice\"]\n",
                pid = std::process::id(),
                sock = daemon.socket,
                rt_state = setup.dir.join("runtime-state"),
                root = setup.root(),
                state = setup.state(),
                kubelet = dir.path().join("kubelet"),
            ),
        )
        .unwrap();
        let ctrd = Containerd::start(setup).unwrap();
        let r = rt();
        r.block_on(async {
            ctrd.wait_ready().await.unwrap();
            let pause = cri::oci_image(
                dir.path(),
                &rootfs,
                cri::PAUSE_IMAGE,
                &["/bin/sleep", "2147483647"],
            )
            .unwrap();
            ctrd.import_image(&pause, cri::PAUSE_IMAGE).await.unwrap();
            let image = cri::oci_image(dir.path(), &rootfs, cri::TEST_IMAGE, &["/bin/sh"]).unwrap();
            ctrd.import_image(&image, cri::TEST_IMAGE).await.unwrap();
        });
        Some(World {
            ctrd,
            daemon,
            dev,
            cgroup_root: format!("/tessera-e2e-{slot}"),
            dir,
        })
    }

    fn pod(&self, name: &str) -> Pod {
        let uid = format!(
            "{:08x}-0000-4000-8000-{:012x}",
            PODS.fetch_add(1, Ordering::SeqCst),
            std::process::id()
        );
        Pod::new(name, &uid, &self.cgroup_root, self.dir.path())
    }

    /// A lease of `shape` for tenant "team-a", its token resolved once to make the
    /// device nodes the driver would have made on the host.
    async fn lease(&self, shape: tpb::Shape) -> Lease {
        self.lease_with(create_req("team-a", shape)).await
    }

    async fn lease_with(&self, req: tpb::CreateLeaseRequest) -> Lease {
        let mut c = self.daemon.client().await.unwrap();
        let created = c.create_lease(req).await.unwrap().into_inner();
        let resolved = c
            .resolve_token(tpb::ResolveTokenRequest {
                token: created.token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        devnodes::lease_nodes(&resolved, &self.dev).unwrap();
        Lease {
            lease: created.lease.unwrap(),
            token: created.token,
            resolved,
        }
    }

    async fn run_pod(&self, pod: &Pod) -> Result<String, tonic::Status> {
        let mut rs = self.ctrd.runtime().await.unwrap();
        rs.run_pod_sandbox(pb::RunPodSandboxRequest {
            config: Some(pod.sandbox_config().unwrap()),
            runtime_handler: cri::HANDLER.into(),
        })
        .await
        .map(|r| r.into_inner().pod_sandbox_id)
    }

    /// CreateContainer then StartContainer, as kubelet does; the container id, or the
    /// status of the call that failed.
    async fn start_container(
        &self,
        sandbox: &str,
        pod: &Pod,
        config: pb::ContainerConfig,
    ) -> Result<String, tonic::Status> {
        let mut rs = self.ctrd.runtime().await.unwrap();
        let id = rs
            .create_container(pb::CreateContainerRequest {
                pod_sandbox_id: sandbox.into(),
                config: Some(config),
                sandbox_config: Some(pod.sandbox_config().unwrap()),
            })
            .await?
            .into_inner()
            .container_id;
        rs.start_container(pb::StartContainerRequest {
            container_id: id.clone(),
        })
        .await?;
        Ok(id)
    }

    /// A long-running GPU container holding `token` in pod `pod`.
    async fn gpu_container(&self, sandbox: &str, pod: &Pod, name: &str, token: &str) -> String {
        let cfg = token_config(pod, name, 0, INIT_ENV_AND_SLEEP, token);
        match self.start_container(sandbox, pod, cfg).await {
            Ok(id) => id,
            Err(e) => panic!(
                "start {name}: {e}\ncontainerd log:\n{}",
                tail(&self.ctrd.log())
            ),
        }
    }

    /// Starts a container that must be refused: its error is one clear line holding
    /// `must` (kubelet shows the first line of it).
    async fn refused(
        &self,
        sandbox: &str,
        pod: &Pod,
        cfg: pb::ContainerConfig,
        what: &str,
        must: &str,
    ) {
        let e = self
            .start_container(sandbox, pod, cfg)
            .await
            .expect_err(what);
        assert_one_clear_line(what, e.message(), must);
    }

    /// ExecSync as kubelet's exec probes do: (exit code, stdout, stderr).
    async fn exec(&self, id: &str, script: &str) -> (i32, String, String) {
        let mut rs = self.ctrd.runtime().await.unwrap();
        let r = rs
            .exec_sync(pb::ExecSyncRequest {
                container_id: id.into(),
                cmd: vec!["sh".into(), "-c".into(), script.into()],
                timeout: 30,
            })
            .await
            .unwrap_or_else(|e| panic!("ExecSync {script:?}: {e}"))
            .into_inner();
        (
            r.exit_code,
            String::from_utf8_lossy(&r.stdout).into_owned(),
            String::from_utf8_lossy(&r.stderr).into_owned(),
        )
    }

    async fn container_status(&self, id: &str) -> (pb::ContainerStatus, serde_json::Value) {
        let mut rs = self.ctrd.runtime().await.unwrap();
        let r = rs
            .container_status(pb::ContainerStatusRequest {
                container_id: id.into(),
                verbose: true,
            })
            .await
            .unwrap()
            .into_inner();
        let info = r
            .info
            .get("info")
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or(serde_json::Value::Null);
        (r.status.unwrap(), info)
    }

    /// Wait (up to 30 s) until the container has exited; its status then.
    async fn wait_exited(&self, id: &str) -> pb::ContainerStatus {
        for _ in 0..300 {
            let (st, _) = self.container_status(id).await;
            if st.state == pb::ContainerState::ContainerExited as i32 {
                return st;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!("container {id} still runs 30 s after its lease ended");
    }

    async fn lease_now(&self, id: &str) -> tpb::Lease {
        let mut c = self.daemon.client().await.unwrap();
        c.get_lease(tpb::GetLeaseRequest {
            lease_id: id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap()
    }

    /// The host pid of a running container's init (containerd's verbose status).
    async fn pid(&self, id: &str) -> i32 {
        let (_, info) = self.container_status(id).await;
        info["pid"]
            .as_i64()
            .unwrap_or_else(|| panic!("no pid in {info}")) as i32
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for e in self.ctrd.shutdown() {
            eprintln!("cleanup: {e}");
        }
        cri::remove_cgroup_tree(&self.cgroup_root);
    }
}

/// "SKIPPED: <why>", past the test harness's capture so CI logs show it.
/// The command of a long-running GPU container: its init environment is kept in
/// /tmp/init-env for the test to read.
const INIT_ENV_AND_SLEEP: &[&str] = &["sh", "-c", "env > /tmp/init-env; exec sleep 3600"];

/// A container of `pod` carrying `token` in the device plugin's annotation, as kubelet
/// creates it (attempt counts restarts).
fn token_config(
    pod: &Pod,
    name: &str,
    attempt: u32,
    cmd: &[&str],
    token: &str,
) -> pb::ContainerConfig {
    pod.container_config(
        name,
        attempt,
        cri::TEST_IMAGE,
        cmd,
        &[(cri::TOKEN_ANNOTATION, token)],
    )
    .unwrap()
}

fn skipped(why: &str) {
    let _ = std::io::Write::write_fmt(&mut std::io::stderr(), format_args!("SKIPPED: {why}\n"));
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

fn has_line(out: &str, want: &str) -> bool {
    out.lines().any(|l| l.trim() == want.trim())
}

/// The v1 cgroup path of `pid` in `controller` (from /proc/<pid>/cgroup).
fn cgroup_of(pid: i32, controller: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    text.lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
            ctrls
                .split(',')
                .any(|c| c == controller)
                .then(|| path.to_string())
        })
        .unwrap_or_else(|| panic!("no {controller} cgroup in {text}"))
}

#[test]
fn a_mig_pod_sees_exactly_its_instance_through_cri() {
    let Some(w) = World::new() else { return };
    rt().block_on(async {
        let l = w.lease(shape::mig("1g.10gb")).await;
        let part = l.lease.partition.clone().unwrap();
        let gpu = part.gpu_index;
        let other = 1 - gpu;
        let other_node = w.dev.join(format!("nvidia{other}"));
        devnodes::mknod(&other_node, &w.dev, 195, u64::from(other)).unwrap();
        let pod = w.pod("mig-pod");
        let sandbox = w.run_pod(&pod).await.unwrap_or_else(|e| {
            panic!("RunPodSandbox: {e}\n{}", tail(&w.ctrd.log()))
        });
        let id = w.gpu_container(&sandbox, &pod, "cuda", &l.token).await;
        let (code, out, err) = w
            .exec(
                &id,
                &format!(
                    "probe open /dev/nvidia{gpu}; probe open /dev/nvidiactl; probe open /dev/nvidia{other}; \
                     cat /tmp/init-env; echo TOKEN=${{TESSERA_LEASE_TOKEN:-none}}; \
                     grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status"
                ),
            )
            .await;
        assert_eq!(code, 0, "{out}{err}");
        let mig_uuid = part.mig.as_ref().unwrap().mig_uuid.clone();
        for want in [
            format!("open /dev/nvidia{gpu} errno=6"),
            "open /dev/nvidiactl errno=6".to_string(),
            format!("open /dev/nvidia{other} errno=2"),
            format!("CUDA_VISIBLE_DEVICES={mig_uuid}"),
            "TOKEN=none".to_string(),
            "NoNewPrivs:\t1".to_string(),
            "Seccomp:\t2".to_string(),
        ] {
            assert!(has_line(&out, &want), "missing {want:?} in:\n{out}{err}");
        }
        // The devices cgroup allows the leased GPU and no other.
        let pid = w.pid(&id).await;
        let cg = cgroup_of(pid, "devices");
        let list = std::fs::read_to_string(format!("/sys/fs/cgroup/devices{cg}/devices.list"))
            .unwrap();
        assert!(
            list.lines().any(|l| l.starts_with(&format!("c 195:{gpu} "))),
            "GPU {gpu} allowed in {cg}:\n{list}"
        );
        assert!(
            !list.lines().any(|l| l.starts_with(&format!("c 195:{other} ")) || l.starts_with("a ")),
            "only the leased GPU in {cg}:\n{list}"
        );
        // The runtime scrubbed the token from the spec runc and containerd keep.
        let bundle = w
            .ctrd
            .setup
            .state()
            .join("io.containerd.runtime.v2.task/k8s.io")
            .join(&id);
        let config = std::fs::read_to_string(bundle.join("config.json")).unwrap();
        assert!(config.contains("CUDA_VISIBLE_DEVICES"), "not the hardened spec");
        assert!(!config.contains(&l.token), "the token is left in the bundle's config.json");
        // The daemon knows which container holds the lease.
        let mut c = w.daemon.client().await.unwrap();
        let got = c
            .get_lease(tpb::GetLeaseRequest {
                lease_id: l.lease.id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert!(
            got.containers.iter().any(|c| c.id == id),
            "the lease lists the pod's container: {:?}",
            got.containers
        );
    });
}

#[test]
fn an_mps_pod_gets_its_pipe_directory_and_limits_in_init_and_in_exec() {
    let Some(w) = World::new() else { return };
    rt().block_on(async {
        let l = w.lease(shape::mps(25, 8)).await;
        assert!(
            l.resolved.env.contains_key("CUDA_MPS_PIPE_DIRECTORY"),
            "an MPS lease resolves to a pipe directory: {:?}",
            l.resolved.env
        );
        let pod = w.pod("mps-pod");
        let sandbox = w.run_pod(&pod).await.unwrap();
        let id = w.gpu_container(&sandbox, &pod, "worker", &l.token).await;
        let pipe = l.resolved.env["CUDA_MPS_PIPE_DIRECTORY"].clone();
        let (code, out, err) = w
            .exec(
                &id,
                &format!(
                    "echo INIT; cat /tmp/init-env; echo EXEC; env; test -d {pipe} && echo PIPE_DIR_OK"
                ),
            )
            .await;
        assert_eq!(code, 0, "{out}{err}");
        let (init, exec) = out.split_once("\nEXEC\n").expect("both sections");
        for (k, v) in &l.resolved.env {
            let want = format!("{k}={v}");
            assert!(has_line(init, &want), "init lacks {want}:\n{init}");
            assert!(has_line(exec, &want), "exec (ExecSync) lacks {want}:\n{exec}");
        }
        assert!(has_line(exec, &format!("TESSERA_LEASE_ID={}", l.lease.id)), "{exec}");
        assert!(has_line(&out, "PIPE_DIR_OK"), "the MPS pipe directory is mounted: {out}{err}");
        assert!(!out.contains(&l.token), "the token leaked into the container's env");
    });
}

/// kubelet finds a container's termination message through ContainerStatus: the mount at
/// its terminationMessagePath, read on the host.
fn termination_message(st: &pb::ContainerStatus) -> String {
    let m = st
        .mounts
        .iter()
        .find(|m| m.container_path == "/dev/termination-log")
        .unwrap_or_else(|| panic!("no termination-log mount in the status: {:?}", st.mounts));
    std::fs::read_to_string(&m.host_path).unwrap()
}

/// One line: what containerd, kubelet and `kubectl describe` show of a refusal.
fn assert_one_clear_line(what: &str, msg: &str, must: &str) {
    assert!(msg.contains(must), "{what}: {must:?} missing in {msg:?}");
    assert!(!msg.contains('\n'), "{what}: more than one line: {msg:?}");
    assert!(
        msg.matches("tessera-runtime: ").count() == 1
            && !msg.contains("{\"")
            && !msg.contains("\\n"),
        "{what}: garbled (repeated, JSON or escaped): {msg:?}"
    );
}

#[test]
fn a_gpu_container_stays_in_its_pod_cgroup_where_pod_and_container_stats_see_it() {
    let Some(w) = World::new() else { return };
    rt().block_on(async {
        let l = w.lease(shape::mig("1g.10gb")).await;
        let pod = w.pod("stats-pod");
        let sandbox = w.run_pod(&pod).await.unwrap();
        let id = w.gpu_container(&sandbox, &pod, "cuda", &l.token).await;
        let pid = w.pid(&id).await;
        for ctrl in ["memory", "cpu", "pids", "devices", "freezer"] {
            let cg = cgroup_of(pid, ctrl);
            assert_eq!(
                cg,
                format!("{}/{id}", pod.cgroup_parent),
                "{ctrl}: the GPU container is in its pod's cgroup, as kubelet asked"
            );
        }
        // 32 MiB in the pod's shared memory, charged to the container's cgroup.
        let (code, out, err) = w
            .exec(
                &id,
                "head -c 33554432 /dev/zero > /dev/shm/fill && echo FILLED",
            )
            .await;
        assert_eq!(code, 0, "{out}{err}");
        let mut rs = w.ctrd.runtime().await.unwrap();
        let cs = rs
            .container_stats(pb::ContainerStatsRequest {
                container_id: id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .stats
            .unwrap();
        let used = |m: Option<&pb::MemoryUsage>| {
            m.and_then(|m| m.working_set_bytes.as_ref())
                .map_or(0, |v| v.value)
        };
        let c_ws = used(cs.memory.as_ref());
        assert!(c_ws >= 32 << 20, "ContainerStats working set {c_ws}");
        let ps = rs
            .pod_sandbox_stats(pb::PodSandboxStatsRequest {
                pod_sandbox_id: sandbox.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .stats
            .unwrap();
        let linux = ps.linux.unwrap();
        let p_ws = used(linux.memory.as_ref());
        assert!(
            p_ws >= 32 << 20,
            "PodSandboxStats sees the GPU container's memory: pod {p_ws}, container {c_ws}"
        );
        assert!(
            linux
                .containers
                .iter()
                .any(|c| c.attributes.as_ref().is_some_and(|a| a.id == id)),
            "the pod's stats list the GPU container"
        );
        // The lease finds its container through its binding, at the pod's cgroup.
        let got = w.lease_now(&l.lease.id).await;
        assert_eq!(got.containers.len(), 1, "{:?}", got.containers);
        assert_eq!(
            got.containers[0].cgroup_path,
            format!("{}/{id}", pod.cgroup_parent)
        );
        // StopContainer and RemoveContainer as kubelet does: no binding is left.
        rs.stop_container(pb::StopContainerRequest {
            container_id: id.clone(),
            timeout: 2,
        })
        .await
        .unwrap();
        rs.remove_container(pb::RemoveContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap();
        let got = w.lease_now(&l.lease.id).await;
        assert!(
            got.containers.is_empty(),
            "stale binding: {:?}",
            got.containers
        );
    });
}

#[test]
fn update_container_resources_changes_cpu_and_memory_and_keeps_the_gpu() {
    let Some(w) = World::new() else { return };
    rt().block_on(async {
        let l = w.lease(shape::mig("1g.10gb")).await;
        let gpu = l.lease.partition.as_ref().unwrap().gpu_index;
        let pod = w.pod("resize-pod");
        let sandbox = w.run_pod(&pod).await.unwrap();
        let id = w.gpu_container(&sandbox, &pod, "cuda", &l.token).await;
        let pid = w.pid(&id).await;
        let mut rs = w.ctrd.runtime().await.unwrap();
        // What the CPU manager and in-place resize send; containerd adds its deny-all
        // device rule to every update.
        rs.update_container_resources(pb::UpdateContainerResourcesRequest {
            container_id: id.clone(),
            linux: Some(pb::LinuxContainerResources {
                cpu_period: 100_000,
                cpu_quota: 50_000,
                cpu_shares: 512,
                memory_limit_in_bytes: 256 << 20,
                oom_score_adj: 1000,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("UpdateContainerResources on a GPU container: {e}"));
        let read = |ctrl: &str, file: &str| {
            let p = format!("/sys/fs/cgroup/{ctrl}{}/{file}", cgroup_of(pid, ctrl));
            std::fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("{p}: {e}"))
                .trim()
                .to_string()
        };
        assert_eq!(read("cpu", "cpu.cfs_quota_us"), "50000");
        assert_eq!(read("cpu", "cpu.shares"), "512");
        assert_eq!(
            read("memory", "memory.limit_in_bytes"),
            (256u64 << 20).to_string()
        );
        let devices = read("devices", "devices.list");
        assert!(
            devices
                .lines()
                .any(|l| l.starts_with(&format!("c 195:{gpu} "))),
            "the lease's GPU is still allowed after the update:\n{devices}"
        );
        assert!(!devices.lines().any(|l| l.starts_with("a ")), "{devices}");
        let (code, out, err) = w.exec(&id, &format!("probe open /dev/nvidia{gpu}")).await;
        assert_eq!(code, 0, "{out}{err}");
        assert!(
            has_line(&out, &format!("open /dev/nvidia{gpu} errno=6")),
            "the GPU still opens (reaches the driver): {out}{err}"
        );
        let (st, _) = w.container_status(&id).await;
        let res = st.resources.and_then(|r| r.linux).unwrap();
        assert_eq!(res.memory_limit_in_bytes, 256 << 20);
        assert_eq!(res.cpu_quota, 50_000);
    });
}

#[test]
fn a_revoked_lease_says_why_where_kubelet_reads_it_and_its_container_cannot_restart() {
    let Some(w) = World::new() else { return };
    rt().block_on(async {
        let l = w.lease(shape::mig("1g.10gb")).await;
        let pod = w.pod("revoked-pod");
        let sandbox = w.run_pod(&pod).await.unwrap();
        let id = w.gpu_container(&sandbox, &pod, "cuda", &l.token).await;
        let mut c = w.daemon.client().await.unwrap();
        let mut watch = c
            .watch_leases(tpb::WatchLeasesRequest::default())
            .await
            .unwrap()
            .into_inner();
        c.release_lease(tpb::ReleaseLeaseRequest {
            lease_id: l.lease.id.clone(),
            reason: "node drained for maintenance".into(),
        })
        .await
        .unwrap();
        let st = w.wait_exited(&id).await;
        assert_ne!(st.exit_code, 0, "{st:?}");
        let msg = termination_message(&st);
        assert!(
            msg.contains(&format!(
                "lease {} released: node drained for maintenance",
                l.lease.id
            )),
            "the termination message kubelet shows: {msg:?}"
        );
        // The lease's events say it too.
        let mut seen = Vec::new();
        while let Ok(Some(Ok(ev))) =
            tokio::time::timeout(std::time::Duration::from_secs(5), watch.message())
                .await
                .map(|r| r.transpose())
        {
            if ev.lease.as_ref().is_some_and(|x| x.id == l.lease.id) {
                seen.push(ev.message.clone());
                if seen
                    .iter()
                    .any(|m| m.contains("node drained for maintenance"))
                {
                    break;
                }
            }
        }
        assert!(
            seen.iter()
                .any(|m| m.contains("node drained for maintenance")),
            "events: {seen:?}"
        );
        let ended = w.lease_now(&l.lease.id).await;
        assert!(
            ended.containers.is_empty(),
            "an ended lease lists none: {:?}",
            ended.containers
        );
        // kubelet restarts the container (attempt 1, same device plugin annotation).
        let cfg = token_config(&pod, "cuda", 1, &["sleep", "3600"], &l.token);
        w.refused(
            &sandbox,
            &pod,
            cfg,
            "restart after revocation",
            "unknown, expired or revoked lease token",
        )
        .await;
    });
}

#[test]
fn a_token_is_bound_to_the_first_pod_and_refused_to_another() {
    let Some(w) = World::new() else { return };
    rt().block_on(async {
        let l = w.lease(shape::mig("1g.10gb")).await;
        let pod_a = w.pod("pod-a");
        let sandbox_a = w.run_pod(&pod_a).await.unwrap();
        let _id = w.gpu_container(&sandbox_a, &pod_a, "cuda", &l.token).await;
        let pod_b = w.pod("pod-b");
        let sandbox_b = w.run_pod(&pod_b).await.unwrap();
        let cfg = token_config(&pod_b, "thief", 0, &["sleep", "3600"], &l.token);
        let must = format!(
            "is bound to pod {}; pod {} may not use it",
            pod_a.uid, pod_b.uid
        );
        w.refused(&sandbox_b, &pod_b, cfg, "token reuse", &must)
            .await;
        let got = w.lease_now(&l.lease.id).await;
        assert_eq!(
            got.containers.len(),
            1,
            "only pod A's container: {:?}",
            got.containers
        );
        // A second container of the same pod shares the lease.
        let cfg = token_config(&pod_a, "sidecar", 0, &["sleep", "3600"], &l.token);
        w.start_container(&sandbox_a, &pod_a, cfg)
            .await
            .unwrap_or_else(|e| panic!("a second container of the same pod: {e}"));
    });
}

#[test]
fn with_the_daemon_down_a_gpu_container_fails_closed_and_starts_once_it_is_back() {
    let Some(mut w) = World::new() else { return };
    let r = rt();
    let (l, pod, sandbox) = r.block_on(async {
        let l = w.lease(shape::mig("1g.10gb")).await;
        let pod = w.pod("down-pod");
        let sandbox = w.run_pod(&pod).await.unwrap();
        (l, pod, sandbox)
    });
    w.daemon.kill().unwrap();
    let cfg = |attempt| token_config(&pod, "cuda", attempt, &["sleep", "3600"], &l.token);
    r.block_on(w.refused(&sandbox, &pod, cfg(0), "daemon down", "tessera daemon"));
    w.daemon.spawn().unwrap();
    r.block_on(w.start_container(&sandbox, &pod, cfg(1)))
        .unwrap_or_else(|e| panic!("after the daemon's restart: {e}"));
}

/// kubeadm's default: kubelet and runc use the systemd cgroup driver. The pod's cgroup
/// parent is a slice and each container a `cri-containerd-<id>.scope` in it. Needs
/// systemd as PID 1 (runc asks it over D-Bus for the scope); CI has none, where the
/// runtime's unit tests cover the decision and the spec.
#[test]
fn with_the_systemd_cgroup_driver_a_gpu_container_lands_in_its_pod_slice() {
    if !Path::new("/run/systemd/system").is_dir() {
        skipped(
            "CRI systemd cgroup driver: systemd is not PID 1 here (no /run/systemd/system); runtime-shim's tests cover the decision and the spec",
        );
        return;
    }
    let Some(w) = World::with_driver(true) else {
        return;
    };
    rt().block_on(async {
        let l = w.lease(shape::mig("1g.10gb")).await;
        let mut pod = w.pod("systemd-pod");
        // As kubelet names it: "-" nests slices, so the uid's dashes become "_". The
        // prefix keeps it out of kubelet's own kubepods.slice on a developer's host.
        let top = format!("e2etessera{}", std::process::id());
        let uid = pod.uid.replace('-', "_");
        pod.cgroup_parent = format!("{top}-pod{uid}.slice");
        let sandbox = w
            .run_pod(&pod)
            .await
            .unwrap_or_else(|e| panic!("RunPodSandbox (systemd): {e}\n{}", tail(&w.ctrd.log())));
        let id = w.gpu_container(&sandbox, &pod, "cuda", &l.token).await;
        let pid = w.pid(&id).await;
        let want = format!("/{top}.slice/{top}-pod{uid}.slice/cri-containerd-{id}.scope");
        assert_eq!(cgroup_of(pid, "memory"), want);
        let gpu = l.lease.partition.as_ref().unwrap().gpu_index;
        let (code, out, err) = w.exec(&id, &format!("probe open /dev/nvidia{gpu}")).await;
        assert_eq!(code, 0, "{out}{err}");
        assert!(
            has_line(&out, &format!("open /dev/nvidia{gpu} errno=6")),
            "{out}{err}"
        );
        let got = w.lease_now(&l.lease.id).await;
        assert_eq!(got.containers.len(), 1, "{:?}", got.containers);
        assert_eq!(
            got.containers[0].cgroup_path,
            format!("{}:cri-containerd:{id}", pod.cgroup_parent)
        );
    });
}

#[test]
fn an_expired_lease_stops_its_pod_container_and_says_so_in_the_termination_message() {
    let Some(w) = World::new() else { return };
    rt().block_on(async {
        let mut req = create_req("team-a", shape::mig("1g.10gb"));
        // Long enough for the pod to start on a loaded machine.
        req.ttl_seconds = 10;
        let l = w.lease_with(req).await;
        let pod = w.pod("expiring-pod");
        let sandbox = w.run_pod(&pod).await.unwrap();
        let id = w.gpu_container(&sandbox, &pod, "cuda", &l.token).await;
        let st = w.wait_exited(&id).await;
        assert_ne!(st.exit_code, 0, "{st:?}");
        let msg = termination_message(&st);
        assert!(
            msg.starts_with(&format!("tessera: lease {} expired", l.lease.id)),
            "the termination message kubelet shows: {msg:?}"
        );
    });
}

/// restartPolicy Always: a GPU container that crashed is created again (attempt 1) in
/// the same pod with the same device plugin annotation, and starts.
#[test]
fn a_crashed_gpu_container_restarts_in_its_pod_with_the_same_token() {
    let Some(w) = World::new() else { return };
    rt().block_on(async {
        let l = w.lease(shape::mig("1g.10gb")).await;
        let pod = w.pod("crashy-pod");
        let sandbox = w.run_pod(&pod).await.unwrap();
        let cfg = token_config(&pod, "cuda", 0, &["sh", "-c", "exit 3"], &l.token);
        let first = w.start_container(&sandbox, &pod, cfg).await.unwrap();
        let st = w.wait_exited(&first).await;
        assert_eq!(st.exit_code, 3, "{st:?}");
        let cfg = token_config(&pod, "cuda", 1, INIT_ENV_AND_SLEEP, &l.token);
        let second = w
            .start_container(&sandbox, &pod, cfg)
            .await
            .unwrap_or_else(|e| panic!("the restart (attempt 1): {e}"));
        let (code, out, err) = w.exec(&second, "cat /tmp/init-env").await;
        assert_eq!(code, 0, "{out}{err}");
        assert!(
            out.contains(&format!("TESSERA_LEASE_ID={}", l.lease.id)),
            "the restarted container holds the lease: {out}"
        );
        let got = w.lease_now(&l.lease.id).await;
        assert!(
            got.containers.iter().any(|c| c.id == second),
            "{:?}",
            got.containers
        );
    });
}

/// A pod with a privileged container: kubelet makes its sandbox privileged too. The
/// pause process runs confined all the same (it runs no tenant code); the privileged
/// container is refused in one line kubelet can show. So is an unknown token.
#[test]
fn privileged_containers_and_unknown_tokens_are_refused_in_one_line() {
    let Some(w) = World::new() else { return };
    rt().block_on(async {
        let l = w.lease(shape::mig("1g.10gb")).await;
        let pod = w.pod("privileged-pod");
        let mut config = pod.sandbox_config().unwrap();
        if let Some(sc) = config
            .linux
            .as_mut()
            .and_then(|l| l.security_context.as_mut())
        {
            sc.privileged = true;
        }
        let mut rs = w.ctrd.runtime().await.unwrap();
        let sandbox = rs
            .run_pod_sandbox(pb::RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: cri::HANDLER.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("the privileged pod's sandbox: {e}"))
            .into_inner()
            .pod_sandbox_id;
        let st = rs
            .pod_sandbox_status(pb::PodSandboxStatusRequest {
                pod_sandbox_id: sandbox.clone(),
                verbose: true,
            })
            .await
            .unwrap()
            .into_inner();
        let info: serde_json::Value = serde_json::from_str(&st.info["info"]).unwrap();
        let pid = info["pid"].as_i64().unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        for want in ["NoNewPrivs:\t1", "Seccomp:\t2"] {
            assert!(
                has_line(&status, want),
                "the pause process is confined: {status}"
            );
        }
        let mut cfg = token_config(&pod, "cuda", 0, &["sleep", "3600"], &l.token);
        if let Some(sc) = cfg.linux.as_mut().and_then(|l| l.security_context.as_mut()) {
            sc.privileged = true;
            sc.seccomp = None;
        }
        let id = rs
            .create_container(pb::CreateContainerRequest {
                pod_sandbox_id: sandbox.clone(),
                config: Some(cfg),
                sandbox_config: Some(config),
            })
            .await
            .unwrap()
            .into_inner()
            .container_id;
        let e = rs
            .start_container(pb::StartContainerRequest { container_id: id })
            .await
            .expect_err("a privileged container started");
        assert_one_clear_line(
            "privileged container",
            e.message(),
            "privileged containers are not allowed",
        );
        let got = w.lease_now(&l.lease.id).await;
        assert!(got.containers.is_empty(), "{:?}", got.containers);

        let pod = w.pod("bad-token-pod");
        let sandbox = w.run_pod(&pod).await.unwrap();
        let cfg = token_config(&pod, "cuda", 0, &["sleep", "3600"], "tsr1_not-a-token");
        w.refused(
            &sandbox,
            &pod,
            cfg,
            "unknown token",
            "unknown, expired or revoked lease token",
        )
        .await;
    });
}

/// The device plugin's Allocate answer carried into CRI as kubelet carries it: the
/// container annotations and envs of its ContainerAllocateResponse in
/// CreateContainer. No lease is made by hand and no token pasted: the container runs
/// bound to the lease the plugin reserved.
#[test]
fn a_device_plugin_allocation_runs_its_container_bound_to_the_lease_through_cri() {
    use tessera_proto::k8s::deviceplugin::v1beta1 as dp;
    let kubelet = tempfile::Builder::new()
        .prefix("tdp")
        .tempdir_in("/tmp")
        .unwrap();
    let plugins = kubelet.path().join("dp");
    std::fs::create_dir_all(&plugins).unwrap();
    let extra = format!(
        "[kubernetes]\ndevice_plugin = true\ndevice_plugin_dir = {plugins:?}\n\
         pod_resources_socket = {pr:?}\ncdi_dir = {cdi:?}\n[kubernetes.mix]\n\"mig-1g.10gb\" = 1\n",
        pr = kubelet.path().join("pr.sock"),
        cdi = kubelet.path().join("cdi"),
    );
    let Some(w) = World::with_config(false, &extra) else {
        return;
    };
    rt().block_on(async {
        // The plugin serves its endpoint before it registers: dial it as kubelet does.
        let sock = plugins.join("tessera-mig-1g.10gb.sock");
        for _ in 0..300 {
            if sock.exists() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let ch = tessera_common::unix::channel(&sock).await.unwrap();
        let mut c = dp::device_plugin_client::DevicePluginClient::new(ch);
        let mut s = c.list_and_watch(dp::Empty {}).await.unwrap().into_inner();
        let devices = s.message().await.unwrap().unwrap().devices;
        assert_eq!(devices.len(), 1, "{devices:?}");
        let device = devices[0].id.clone();
        let alloc = c
            .allocate(dp::AllocateRequest {
                container_requests: vec![dp::ContainerAllocateRequest {
                    devices_ids: vec![device.clone()],
                }],
            })
            .await
            .unwrap()
            .into_inner()
            .container_responses
            .remove(0);
        let token = alloc.annotations[cri::TOKEN_ANNOTATION].clone();
        let resolved = w
            .daemon
            .client()
            .await
            .unwrap()
            .resolve_token(tpb::ResolveTokenRequest {
                token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        devnodes::lease_nodes(&resolved, &w.dev).unwrap();
        let part = resolved.lease.as_ref().unwrap().partition.clone().unwrap();
        let gpu = part.gpu_index;
        let pod = w.pod("plugin-pod");
        let sandbox = w
            .run_pod(&pod)
            .await
            .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", tail(&w.ctrd.log())));
        let annotations: Vec<(&str, &str)> = alloc
            .annotations
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let mut cfg = pod
            .container_config(
                "cuda",
                0,
                cri::TEST_IMAGE,
                &["sh", "-c", "env > /tmp/init-env; exec sleep 3600"],
                &annotations,
            )
            .unwrap();
        for (k, v) in &alloc.envs {
            cfg.envs.push(pb::KeyValue {
                key: k.clone(),
                value: v.clone().into_bytes(),
            });
        }
        let id = w
            .start_container(&sandbox, &pod, cfg)
            .await
            .unwrap_or_else(|e| panic!("start: {e}\n{}", tail(&w.ctrd.log())));
        let (code, out, err) = w
            .exec(
                &id,
                &format!("probe open /dev/nvidia{gpu}; cat /tmp/init-env"),
            )
            .await;
        assert_eq!(code, 0, "{out}{err}");
        for want in [
            format!("open /dev/nvidia{gpu} errno=6"),
            format!(
                "CUDA_VISIBLE_DEVICES={}",
                part.mig.as_ref().unwrap().mig_uuid
            ),
            format!("TESSERA_LEASE_ID={device}"),
        ] {
            assert!(has_line(&out, &want), "missing {want:?} in:\n{out}{err}");
        }
        let l = w.lease_now(&device).await;
        assert!(
            l.containers.iter().any(|c| c.id == id),
            "the plugin's lease holds the pod's container: {:?}",
            l.containers
        );
    });
}

/// DRA from published slice to running container: tesserad publishes its node's
/// ResourceSlices to the API server stand-in, the scheduler's allocator (first fit
/// with the counters rule) picks a 1g.10gb MIG placement, an MPS slot and a whole GPU
/// from them, each claim's allocation is written to the stand-in as the scheduler
/// writes it, and a kubelet stand-in prepares the claims over the plugin's sockets.
/// Each pod's container then gets the CDI devices of the answer (applied as
/// containerd 1.7 would; Debian's 1.6 has no CDI) and runs through containerd and
/// tessera-runtime on exactly the allocated placement; unprepare releases the lease.
#[test]
fn dra_claims_for_a_mig_instance_an_mps_share_and_a_whole_gpu_run_their_pods_through_cri() {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use tessera_integration_tests::apiserver::ApiServer;
    use tessera_integration_tests::kubelet_dra::{Kubelet, claim_tokens, lease_of};
    use tesserad::dra::device::DeviceName;
    use tesserad::dra::slices::sched::{Allocator, Selector, attr};
    const NODE: &str = "node-e2e";
    let Some(api) = ApiServer::start().unwrap() else {
        return;
    };
    let kubelet = tempfile::Builder::new()
        .prefix("tdra")
        .tempdir_in("/tmp")
        .unwrap();
    let k = kubelet.path();
    let cdi = k.join("cdi");
    api.write_kubeconfig(&k.join("kubeconfig")).unwrap();
    let extra = format!(
        "[kubernetes]\ndra = true\nnode_name = \"{NODE}\"\nkubeconfig = {kc:?}\n\
         dra_plugin_dir = {plugins:?}\ndra_registry_dir = {registry:?}\ncdi_dir = {cdi:?}\n\
         [kubernetes.namespaces]\nml = \"team-a\"\n\
         [[kubernetes.mps_classes]]\nname = \"small\"\nsm_percent = 25\nmemory = \"8GiB\"\n",
        kc = k.join("kubeconfig"),
        plugins = k.join("plugins"),
        registry = k.join("registry"),
    );
    let Some(w) = World::with_config(false, &extra) else {
        return;
    };
    rt().block_on(async {
        let client = api.client().unwrap();
        let slices: kube::Api<ResourceSlice> = kube::Api::all(client.clone());
        let by_node = kube::api::ListParams::default().fields(&format!("spec.nodeName={NODE}"));
        let mut published = Vec::new();
        for _ in 0..300 {
            published = slices.list(&by_node).await.unwrap().items;
            if published
                .iter()
                .any(|s| s.spec.devices.as_ref().is_some_and(|d| !d.is_empty()))
            {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        // One scheduler for the whole test: it holds each claim's device until the
        // claim is deallocated. GPU 2 (MIG off) serves both the MPS slot and the
        // whole GPU, whose counters overlap: the whole GPU is allocated only once the
        // MPS claim is gone.
        let mut alloc = Allocator::new(&published);
        let kinds: [(&str, &str, Selector<'_>); 3] = [
            ("train", "mig.gpu.tessera.io", &|d| {
                attr(d, "profile") == Some("1g.10gb")
            }),
            ("infer", "mps.gpu.tessera.io", &|d| {
                attr(d, "type") == Some("mps")
            }),
            ("render", "gpu.gpu.tessera.io", &|d| {
                attr(d, "type") == Some("gpu")
            }),
        ];
        let mut kubelet = Kubelet::register(&k.join("registry")).await;
        for (name, class, selector) in kinds {
            let device = alloc.allocate(selector).unwrap_or_else(|| {
                let names: Vec<&str> = alloc.devices().iter().map(|d| d.name.as_str()).collect();
                panic!("no {class} device left of {names:?}")
            });
            let uid = ApiServer::allocated_claim(&client, "ml", name, class, NODE, &device)
                .await
                .unwrap();
            let answer = kubelet.prepare_one("ml", name, &uid).await;
            assert!(
                answer.error.is_empty(),
                "{name} ({device}) refused: {}",
                answer.error
            );
            assert_eq!(answer.devices.len(), 1, "{answer:?}");
            let d = &answer.devices[0];
            assert_eq!(
                (d.pool_name.as_str(), d.device_name.as_str()),
                (NODE, device.as_str())
            );
            let lease_id = lease_of(d);
            let lease = w.lease_now(&lease_id).await;
            assert_eq!(lease.tenant, "team-a", "the namespace's tenant");
            let part = lease.partition.clone().unwrap();
            match DeviceName::parse(&device).unwrap() {
                DeviceName::Mig {
                    gpu,
                    profile,
                    start,
                } => {
                    let mig = part.mig.as_ref().unwrap();
                    assert_eq!(
                        (part.gpu_index, mig.profile.as_str(), mig.placement_start),
                        (gpu, profile.as_str(), start),
                        "the lease is at exactly the allocated placement"
                    );
                }
                other => assert_eq!(part.gpu_index, other.gpu(), "{device}: {part:?}"),
            }
            // The driver made the device nodes on the host; the simulator's stand in.
            let token = claim_tokens(&cdi, &uid).remove(0);
            let resolved = w
                .daemon
                .client()
                .await
                .unwrap()
                .resolve_token(tpb::ResolveTokenRequest {
                    token: token.clone(),
                })
                .await
                .unwrap()
                .into_inner();
            devnodes::lease_nodes(&resolved, &w.dev).unwrap();

            let pod = w.pod(name);
            let sandbox = w
                .run_pod(&pod)
                .await
                .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", tail(&w.ctrd.log())));
            let mut cfg = pod
                .container_config("cuda", 0, cri::TEST_IMAGE, INIT_ENV_AND_SLEEP, &[])
                .unwrap();
            for id in &d.cdi_device_ids {
                cri::apply_cdi_device(&mut cfg, &cdi, id).unwrap();
            }
            let id = w
                .start_container(&sandbox, &pod, cfg)
                .await
                .unwrap_or_else(|e| panic!("start {name}: {e}\n{}", tail(&w.ctrd.log())));
            let gpu = part.gpu_index;
            let (code, out, err) = w
                .exec(
                    &id,
                    &format!("probe open /dev/nvidia{gpu}; cat /tmp/init-env; env"),
                )
                .await;
            assert_eq!(code, 0, "{out}{err}");
            assert!(
                has_line(&out, &format!("open /dev/nvidia{gpu} errno=6")),
                "{name}: the allocated GPU's node is there:\n{out}{err}"
            );
            assert!(
                has_line(&out, &format!("TESSERA_LEASE_ID={lease_id}")),
                "{out}"
            );
            for (k, v) in &resolved.env {
                assert!(
                    has_line(&out, &format!("{k}={v}")),
                    "{name} lacks {k}={v}:\n{out}"
                );
            }
            assert!(
                !out.contains(&token),
                "{name}: the token reached the container:\n{out}"
            );
            let held = w.lease_now(&lease_id).await;
            assert!(
                held.containers.iter().any(|c| c.id == id),
                "{name}: the claim's lease holds the pod's container: {:?}",
                held.containers
            );
            // The pod goes, then kubelet unprepares its claim: the lease ends, and
            // the scheduler may give the device again.
            let mut rs = w.ctrd.runtime().await.unwrap();
            rs.stop_pod_sandbox(pb::StopPodSandboxRequest {
                pod_sandbox_id: sandbox.clone(),
            })
            .await
            .unwrap();
            rs.remove_pod_sandbox(pb::RemovePodSandboxRequest {
                pod_sandbox_id: sandbox.clone(),
            })
            .await
            .unwrap();
            let err = kubelet.unprepare("ml", name, &uid).await;
            assert!(err.is_empty(), "unprepare {name}: {err}");
            let l = w.lease_now(&lease_id).await;
            assert_ne!(l.state, tpb::LeaseState::Active as i32, "{name}: {l:?}");
            assert!(
                !cdi.join(format!("tessera.io-claim-{uid}.json")).exists(),
                "{name}: the claim's token spec is removed"
            );
            alloc.free(&device);
        }
    });
}
