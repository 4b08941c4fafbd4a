//! End to end: the real `tesserad` on the simulator, the real `tessera-runtime`,
//! Debian's runc, a busybox rootfs, and GPU device nodes made with mknod from what the
//! daemon resolves for the lease. Needs root, runc, busybox-static and a C compiler
//! (for the syscall probe); says SKIPPED otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../runtime-shim/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tessera_integration_tests::{DEV_GPUS, TestDaemon, create_req, devnodes, shape};
use tessera_proto::v1 as pb;

use tessera_integration_tests::{lease_of, rt};

struct World {
    daemon: TestDaemon,
    dir: tempfile::TempDir,
    dev: PathBuf,
    runtime_config: PathBuf,
    runc_root: PathBuf,
}

impl World {
    fn new(extra: &str) -> Option<World> {
        Self::with_gpus(DEV_GPUS, extra)
    }

    /// A world whose daemon simulates `gpus` (the `[sim]` section's tail).
    fn with_gpus(gpus: &str, extra: &str) -> Option<World> {
        if !common::can_run_as_root("end-to-end runtime", &["runc", "busybox", "cc"]) {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        let daemon = TestDaemon::start_with(
            gpus,
            &format!(
                "[devices]\ndev_root = {dev:?}\n[lease]\nmin_ttl = \"1s\"\nrevocation_grace = \"1s\"\n{extra}"
            ),
        )
        .unwrap();
        common::busybox_rootfs(dir.path());
        let proc_root = common::fake_nvidia_proc(dir.path());
        let runtime_config = common::runtime_config(dir.path(), &daemon.socket, &proc_root, "");
        let runc_root = dir.path().join("runc-root");
        // Its runc root stands for the CRI's (containerd's k8s.io), its kubepods
        // cgroup for kubelet's /kubepods ([`World::kubepods`]).
        let mut cfg = std::fs::read_to_string(&runtime_config).unwrap();
        cfg.push_str(&format!(
            "cri_runc_roots = [{runc_root:?}]\nkubepods_roots = [\"/kubepods-e2e-{}\"]\n",
            std::process::id()
        ));
        std::fs::write(&runtime_config, cfg).unwrap();
        Some(World {
            daemon,
            dev,
            runtime_config,
            runc_root,
            dir,
        })
    }

    /// A lease of `shape` for team-a, and what its token resolves to.
    fn lease(
        &self,
        r: &tokio::runtime::Runtime,
        shape: pb::Shape,
    ) -> (pb::Lease, String, pb::ResolveTokenResponse) {
        r.block_on(async {
            let mut c = self.daemon.client().await.unwrap();
            let created = c
                .create_lease(create_req("team-a", shape))
                .await
                .unwrap()
                .into_inner();
            let resolved = c
                .resolve_token(pb::ResolveTokenRequest {
                    token: created.token.clone(),
                })
                .await
                .unwrap()
                .into_inner();
            (created.lease.unwrap(), created.token, resolved)
        })
    }

    /// Make the lease's device nodes on the "host" (the driver would have), plus a
    /// node of another GPU that the container must not get.
    fn mknod_lease_nodes(&self, resolved: &pb::ResolveTokenResponse) {
        devnodes::lease_nodes(resolved, &self.dev).unwrap();
    }

    /// Make the node of a GPU other than `gpu` (0 or 1), which no container on a
    /// lease of `gpu` may get; its index.
    fn mknod_other_gpu(&self, gpu: u32) -> u32 {
        let other = u32::from(gpu == 0);
        devnodes::mknod(
            &self.dev.join(format!("nvidia{other}")),
            &self.dev,
            195,
            u64::from(other),
        )
        .unwrap();
        other
    }

    fn bundle(&self, name: &str, args: &[&str], token: &str) -> PathBuf {
        let b = self.dir.path().join(name);
        let mut spec = common::base_spec(args);
        spec["root"]["path"] = json!(common::bundle_rootfs(self.dir.path(), &b));
        spec["annotations"] = json!({ "tessera.io/lease-token": token });
        common::write_spec(&b, &spec);
        b
    }

    /// The cgroup standing for kubelet's /kubepods in this test process.
    fn kubepods(&self) -> String {
        format!("kubepods-e2e-{}", std::process::id())
    }

    /// A pod sandbox of pod `uid`, made through the runtime (runc records it) in the
    /// pod's cgroup `/<kubepods>/pod<uid>`: its id.
    fn sandbox(&self, uid: &str) -> String {
        let sid = format!("e2e-sb-{uid}-{}", std::process::id());
        let b = self.dir.path().join(format!("sandbox-{uid}"));
        let mut spec = common::base_spec(&["sleep", "600"]);
        spec["root"]["path"] = json!(common::bundle_rootfs(self.dir.path(), &b));
        spec["annotations"] = json!({
            "io.kubernetes.cri.container-type": "sandbox",
            "io.kubernetes.cri.sandbox-id": sid,
            "io.kubernetes.cri.sandbox-uid": uid,
        });
        spec["linux"]["cgroupsPath"] = json!(format!("/{}/pod{uid}/{sid}", self.kubepods()));
        common::write_spec(&b, &spec);
        let out = self.runtime(&["create", "--bundle", b.to_str().unwrap(), &sid]);
        assert!(out.status.success(), "sandbox {uid}: {}", text(&out));
        sid
    }

    fn runtime(&self, args: &[&str]) -> Output {
        self.runtime_at(&self.runc_root, args)
    }

    /// The runtime under runc root `root`.
    fn runtime_at(&self, root: &Path, args: &[&str]) -> Output {
        let n = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        // Files, not pipes: a detached container inherits them.
        let out = self.dir.path().join(format!("out-{n}"));
        let err = self.dir.path().join(format!("err-{n}"));
        let status = Command::new(common::runtime_bin())
            .env("TESSERA_RUNTIME_CONFIG", &self.runtime_config)
            .arg("--root")
            .arg(root)
            .args(args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .status()
            .unwrap();
        Output {
            status,
            stdout: std::fs::read(&out).unwrap(),
            stderr: std::fs::read(&err).unwrap(),
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Ok(rd) = std::fs::read_dir(&self.runc_root) {
            for e in rd.flatten() {
                let _ = Command::new("runc")
                    .arg("--root")
                    .arg(&self.runc_root)
                    .args(["delete", "-f"])
                    .arg(e.file_name())
                    .output();
            }
        }
        // The pods' cgroups (empty once their containers are gone).
        fn remove_tree(p: &Path) {
            if let Ok(rd) = std::fs::read_dir(p) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        remove_tree(&e.path());
                    }
                }
            }
            let _ = std::fs::remove_dir(p);
        }
        if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in rd.flatten() {
                remove_tree(&h.path().join(self.kubepods()));
            }
        }
    }
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn a_container_on_a_mig_lease_sees_exactly_its_nodes_and_uuid() {
    let Some(w) = World::new("") else { return };
    let r = rt();
    let (lease, token, resolved) = w.lease(&r, shape::mig("1g.10gb"));
    w.mknod_lease_nodes(&resolved);
    let gpu = lease.partition.as_ref().unwrap().gpu_index;
    let other = w.mknod_other_gpu(gpu);
    let caps: Vec<String> = resolved
        .devices
        .iter()
        .filter(|d| d.container_path.contains("nvidia-caps"))
        .map(|d| d.container_path.clone())
        .collect();
    assert_eq!(caps.len(), 2, "GI and CI access nodes: {caps:?}");
    let script = format!(
        "probe open /dev/nvidia{gpu}; probe open /dev/nvidiactl; probe open_ro {}; probe open_ro {}; probe open {}; \
         probe open /dev/nvidia{other}; echo CVD=$CUDA_VISIBLE_DEVICES; echo TOKEN=${{TESSERA_LEASE_TOKEN:-none}}; \
         grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status",
        caps[0], caps[1], caps[0]
    );
    let b = w.bundle("mig", &["sh", "-c", &script], &token);
    let id = format!("e2e-mig-{}", std::process::id());
    let out = w.runtime(&["run", "--bundle", b.to_str().unwrap(), &id]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}", text(&out));
    // Allowed nodes reach the (absent) driver: ENXIO. The other GPU is not there.
    for want in [
        format!("open /dev/nvidia{gpu} errno=6"),
        "open /dev/nvidiactl errno=6".to_string(),
        // Capability nodes are granted read-only, as the driver checks them.
        format!("open_ro {} errno=6", caps[0]),
        format!("open_ro {} errno=6", caps[1]),
        format!("open {} errno=1", caps[0]),
        format!("open /dev/nvidia{other} errno=2"),
        format!(
            "CVD={}",
            lease
                .partition
                .as_ref()
                .unwrap()
                .mig
                .as_ref()
                .unwrap()
                .mig_uuid
        ),
        "TOKEN=none".to_string(),
        "NoNewPrivs:\t1".to_string(),
        "Seccomp:\t2".to_string(),
    ] {
        assert!(
            stdout.lines().any(|l| l.trim() == want.trim()),
            "missing {want:?}:\n{}",
            text(&out)
        );
    }
    // The admission was reported and audited, without the token.
    let audit = std::fs::read_to_string(w.daemon.dir.path().join("state/audit.jsonl")).unwrap();
    assert!(
        audit
            .lines()
            .any(|l| l.contains("\"runtime\"") && l.contains(&id) && l.contains("admitted")),
        "{audit}"
    );
    assert!(audit.contains("BindContainer"), "{audit}");
    assert!(!audit.contains(&token[5..]), "token in the audit log");
}

#[test]
fn a_revoked_token_is_refused_and_the_refusal_is_audited() {
    let Some(w) = World::new("") else { return };
    let token = rt().block_on(async {
        let mut c = w.daemon.client().await.unwrap();
        let created = c
            .create_lease(create_req("team-a", shape::whole()))
            .await
            .unwrap()
            .into_inner();
        c.release_lease(pb::ReleaseLeaseRequest {
            lease_id: created.lease.unwrap().id,
            reason: String::new(),
        })
        .await
        .unwrap();
        created.token
    });
    let b = w.bundle("revoked", &["true"], &token);
    let out = w.runtime(&["run", "--bundle", b.to_str().unwrap(), "e2e-revoked"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown, expired or revoked lease token"),
        "{err}"
    );
    let audit = std::fs::read_to_string(w.daemon.dir.path().join("state/audit.jsonl")).unwrap();
    assert!(
        audit
            .lines()
            .any(|l| l.contains("e2e-revoked") && l.contains("\"refused\"")),
        "the runtime's refusal is in the audit log:\n{audit}"
    );
    assert!(!audit.contains(&token[5..]), "token in the audit log");
}

#[test]
fn a_container_cannot_outlive_its_lease() {
    let Some(w) = World::new("") else { return };
    let r = rt();
    let (lease, token, resolved, mut watch) = r.block_on(async {
        let mut c = w.daemon.client().await.unwrap();
        // Watching from before the lease exists: on a loaded machine the expiry may
        // come before the container has even started (then create is refused and
        // the test says so), never unseen.
        let watch = c
            .watch_leases(pb::WatchLeasesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let mut req = create_req("team-a", shape::whole());
        // Long enough for create and start on a busy 2-core machine.
        req.ttl_seconds = 10;
        let created = c.create_lease(req).await.unwrap().into_inner();
        let resolved = c
            .resolve_token(pb::ResolveTokenRequest {
                token: created.token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        (created.lease.unwrap(), created.token, resolved, watch)
    });
    w.mknod_lease_nodes(&resolved);
    // A process that ignores SIGTERM: the revocation must escalate to SIGKILL.
    let b = w.bundle(
        "long",
        &["sh", "-c", "trap '' TERM; while :; do sleep 1; done"],
        &token,
    );
    let id = format!("e2e-ttl-{}", std::process::id());
    let out = w.runtime(&["create", "--bundle", b.to_str().unwrap(), &id]);
    assert!(out.status.success(), "create: {}", text(&out));
    let out = w.runtime(&["start", &id]);
    assert!(out.status.success(), "start: {}", text(&out));
    let state = Command::new("runc")
        .arg("--root")
        .arg(&w.runc_root)
        .args(["state", &id])
        .output()
        .unwrap();
    let state: serde_json::Value = serde_json::from_slice(&state.stdout).unwrap();
    let pid = state["pid"].as_i64().unwrap() as i32;
    assert!(pid > 1);
    assert_eq!(state["status"], "running");

    r.block_on(async {
        let mut c = w.daemon.client().await.unwrap();
        let l = lease_of(&mut c, &lease.id).await;
        assert_eq!(l.containers.len(), 1, "the runtime bound the container");
        assert_eq!(l.containers[0].id, id);
        assert!(l.containers[0].cgroup_path.contains(&lease.id));
        // Wait for the expiry and the revocation to finish.
        let mut steps = Vec::new();
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(40), watch.message())
                .await
                .expect("revocation within 40 s")
                .unwrap()
                .unwrap();
            if ev.lease.as_ref().unwrap().id != lease.id {
                continue;
            }
            steps.push(ev.message.clone());
            if ev.kind == pb::LeaseEventKind::Revoked as i32 {
                break;
            }
        }
        assert!(
            steps.iter().any(|s| s.contains("stopping 1 container")),
            "{steps:?}"
        );
        assert!(
            steps.iter().any(|s| s.contains("needed SIGKILL")),
            "{steps:?}"
        );
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(
            node.gpus.iter().all(|g| g.partitions.is_empty()),
            "the partition is free again"
        );
    });
    // The container's processes are gone.
    let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false);
    assert!(!alive, "container init {pid} outlived its lease");
    let out = w.runtime(&["delete", "--force", &id]);
    assert!(out.status.success(), "delete: {}", text(&out));
}

#[test]
fn the_runtime_fails_closed_while_the_daemon_is_down_and_works_after_a_restart() {
    let Some(mut w) = World::new("") else { return };
    let (token, resolved) = rt().block_on(async {
        let mut c = w.daemon.client().await.unwrap();
        let created = c
            .create_lease(create_req("team-a", shape::whole()))
            .await
            .unwrap()
            .into_inner();
        let resolved = c
            .resolve_token(pb::ResolveTokenRequest {
                token: created.token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        (created.token, resolved)
    });
    w.mknod_lease_nodes(&resolved);
    w.daemon.kill().unwrap();
    let b = w.bundle("down", &["true"], &token);
    let out = w.runtime(&["run", "--bundle", b.to_str().unwrap(), "e2e-down"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        err.contains("tesserad") || err.contains("daemon"),
        "the refusal names the daemon: {err}"
    );
    // After the restart the same token (kept by the daemon) works.
    w.daemon.spawn().unwrap();
    let out = w.runtime(&["run", "--bundle", b.to_str().unwrap(), "e2e-up"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// A Kubernetes-style GPU container: it stays in the pod's cgroup its caller gave
/// (pod limits, QoS and CRI stats see it); its lease's token is bound to its pod (a
/// second pod presenting it is refused); ending the lease writes why into the
/// container's termination-message file (the host side of kubelet's bind mount),
/// stops it through the pod's cgroup, and the ended lease lists no container.
#[test]
fn a_pod_container_stays_in_its_pod_cgroup_and_is_told_why_its_lease_ended() {
    let Some(w) = World::new("") else { return };
    let r = rt();
    let (lease, token, resolved) = w.lease(&r, shape::whole());
    w.mknod_lease_nodes(&resolved);
    let top = w.kubepods();
    let pod_cgroup_of = |uid: &str| format!("{top}/pod{uid}");
    let pod_cgroup = pod_cgroup_of("pod-a");
    // Each pod's sandbox, made through the runtime: runc's record of it is what the
    // pod's containers are judged by.
    for uid in ["pod-a", "pod-b"] {
        w.sandbox(uid);
    }
    let pod_bundle = |name: &str, pod: &str, id: &str| {
        let b = w.bundle(name, &["sh", "-c", "sleep 600"], &token);
        let term = b.join("termination-log");
        std::fs::write(&term, "").unwrap();
        let mut spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
        spec["annotations"]["io.kubernetes.cri.container-type"] = json!("container");
        spec["annotations"]["io.kubernetes.cri.sandbox-id"] =
            json!(format!("e2e-sb-{pod}-{}", std::process::id()));
        spec["annotations"]["io.kubernetes.cri.sandbox-uid"] = json!(pod);
        spec["linux"]["cgroupsPath"] = json!(format!("/{}/{id}", pod_cgroup_of(pod)));
        spec["mounts"].as_array_mut().unwrap().push(json!({
            "destination": "/dev/termination-log", "type": "bind",
            "source": term, "options": ["rbind", "rprivate", "rw"]}));
        common::write_spec(&b, &spec);
        (b, term)
    };
    let id = format!("e2e-pod-{}", std::process::id());
    let (b, term) = pod_bundle("pod-a", "pod-a", &id);
    let out = w.runtime(&["create", "--bundle", b.to_str().unwrap(), &id]);
    assert!(out.status.success(), "create: {}", text(&out));
    let out = w.runtime(&["start", &id]);
    assert!(out.status.success(), "start: {}", text(&out));
    let state = Command::new("runc")
        .arg("--root")
        .arg(&w.runc_root)
        .args(["state", &id])
        .output()
        .unwrap();
    let state: serde_json::Value = serde_json::from_slice(&state.stdout).unwrap();
    let pid = state["pid"].as_i64().unwrap();
    // The container runs in the pod's cgroup, not in a Tessera tree.
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(
        own.lines()
            .any(|l| l.ends_with(&format!("/{pod_cgroup}/{id}"))),
        "{own}"
    );
    assert!(!own.contains("tessera"), "{own}");
    // Its token and its config on disk: the token is scrubbed from what runc keeps.
    let config = std::fs::read_to_string(b.join("config.json")).unwrap();
    assert!(!config.contains(&token), "token left in config.json");

    // Another pod presenting the token is refused.
    let id_b = format!("e2e-podb-{}", std::process::id());
    let (b2, _) = pod_bundle("pod-b", "pod-b", &id_b);
    let out = w.runtime(&["create", "--bundle", b2.to_str().unwrap(), &id_b]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is bound to pod pod-a; pod pod-b may not use it"),
        "{err}"
    );

    r.block_on(async {
        let mut c = w.daemon.client().await.unwrap();
        let l = lease_of(&mut c, &lease.id).await;
        assert_eq!(l.pod, "pod-a");
        assert_eq!(l.containers.len(), 1, "{:?}", l.containers);
        assert_eq!(l.containers[0].cgroup_path, format!("/{pod_cgroup}/{id}"));
        assert_eq!(
            Path::new(&l.containers[0].termination_log_path),
            term.canonicalize().unwrap()
        );
        let ended = c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: lease.id.clone(),
                reason: "node drained for maintenance".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(ended.state, pb::LeaseState::Released as i32);
        assert!(ended.containers.is_empty(), "an ended lease lists none");
    });
    assert_eq!(
        std::fs::read_to_string(&term).unwrap(),
        format!(
            "tessera: lease {} released: node drained for maintenance",
            lease.id
        )
    );
    let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false);
    assert!(!alive, "container init {pid} outlived its lease");
    let out = w.runtime(&["delete", "--force", &id]);
    assert!(out.status.success(), "delete: {}", text(&out));
    for uid in ["pod-a", "pod-b"] {
        let sid = format!("e2e-sb-{uid}-{}", std::process::id());
        let _ = w.runtime(&["delete", "--force", &sid]);
    }
    for ctl in [
        "pids", "memory", "cpu", "devices", "freezer", "blkio", "cpuset", "unified",
    ] {
        for uid in ["pod-a", "pod-b"] {
            let _ = std::fs::remove_dir(
                Path::new("/sys/fs/cgroup")
                    .join(ctl)
                    .join(pod_cgroup_of(uid)),
            );
        }
        let _ = std::fs::remove_dir(Path::new("/sys/fs/cgroup").join(ctl).join(&top));
    }
}

/// kubeadm's default: the systemd cgroup driver (`runc --systemd-cgroup`, cgroup paths
/// `slice:prefix:name`). Runs for real only where systemd is PID 1; the decision and
/// the produced spec are tested without systemd in runtime-shim/tests/harden.rs
/// (`a_lease_container_stays_in_its_callers_cgroup`) and the daemon's reading of the
/// path in daemon/src/lease/enforce.rs.
#[test]
fn a_gpu_container_runs_under_the_systemd_cgroup_driver() {
    let init = std::fs::read_to_string("/proc/1/comm").unwrap_or_default();
    if init.trim() != "systemd" {
        // Written past the test harness's capture, so CI logs show the skip.
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!(
                "SKIPPED: systemd is not PID 1 here (PID 1 is {:?}); runc --systemd-cgroup needs it\n",
                init.trim()
            ),
        );
        return;
    }
    let Some(w) = World::new("") else { return };
    let r = rt();
    let (lease, token, resolved) = w.lease(&r, shape::whole());
    w.mknod_lease_nodes(&resolved);
    let id = format!("e2e-sd-{}", std::process::id());
    let b = w.bundle("systemd", &["sh", "-c", "sleep 600"], &token);
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    let path = format!("e2etest.slice:e2e:{id}");
    spec["linux"]["cgroupsPath"] = json!(path);
    common::write_spec(&b, &spec);
    let out = w.runtime(&[
        "--systemd-cgroup",
        "create",
        "--bundle",
        b.to_str().unwrap(),
        &id,
    ]);
    assert!(out.status.success(), "create: {}", text(&out));
    let out = w.runtime(&["--systemd-cgroup", "start", &id]);
    assert!(out.status.success(), "start: {}", text(&out));
    let state = Command::new("runc")
        .arg("--root")
        .arg(&w.runc_root)
        .args(["state", &id])
        .output()
        .unwrap();
    let state: serde_json::Value = serde_json::from_slice(&state.stdout).unwrap();
    let pid = state["pid"].as_i64().unwrap();
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(
        own.contains(&format!("e2etest.slice/e2e-{id}.scope")),
        "{own}"
    );
    r.block_on(async {
        let mut c = w.daemon.client().await.unwrap();
        let ended = c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: lease.id.clone(),
                reason: "systemd driver test".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(ended.state, pb::LeaseState::Released as i32);
    });
    let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false);
    assert!(!alive, "container init {pid} outlived its lease");
    let out = w.runtime(&["--systemd-cgroup", "delete", "--force", &id]);
    assert!(out.status.success(), "delete: {}", text(&out));
}

/// Several tokens in one container (a Kubernetes container given several devices):
/// checked before anything is bound, and bound to all leases or to none.
#[test]
fn a_container_on_several_leases_is_bound_to_all_or_none() {
    let Some(w) = World::new("") else { return };
    let r = rt();
    let (mig_a, mig_b, mps_1, mps_2) = r.block_on(async {
        let mut c = w.daemon.client().await.unwrap();
        let mut made = Vec::new();
        for s in [
            shape::mig("1g.10gb"),
            shape::mig("1g.10gb"),
            shape::mps(25, 5),
            shape::mps(25, 5),
        ] {
            let l = c
                .create_lease(create_req("team-a", s))
                .await
                .unwrap()
                .into_inner();
            made.push((l.lease.unwrap().id, l.token));
        }
        let mut it = made.into_iter();
        let mut next = || it.next().unwrap();
        (next(), next(), next(), next())
    });
    let containers = |id: &str| -> (Vec<String>, String) {
        r.block_on(async {
            let l = w
                .daemon
                .client()
                .await
                .unwrap()
                .get_lease(pb::GetLeaseRequest {
                    lease_id: id.into(),
                })
                .await
                .unwrap()
                .into_inner()
                .lease
                .unwrap();
            (l.containers.into_iter().map(|c| c.id).collect(), l.pod)
        })
    };
    let run = |name: &str, tokens: &[&str], pod: &str| {
        let b = w.bundle(name, &["true"], &tokens.join(","));
        let mut spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
        spec["annotations"]["io.kubernetes.cri.container-type"] = json!("container");
        spec["annotations"]["io.kubernetes.cri.sandbox-uid"] = json!(pod);
        common::write_spec(&b, &spec);
        w.runtime(&["run", "--bundle", b.to_str().unwrap(), name])
    };
    let refused = |out: &Output, want: &str| {
        assert_eq!(out.status.code(), Some(1), "{}", text(out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "missing {want:?}: {}", text(out));
    };

    // Lease b's token is already another pod's: refused before lease a is touched.
    r.block_on(async {
        w.daemon
            .client()
            .await
            .unwrap()
            .bind_container(pb::BindContainerRequest {
                token: mig_b.1.clone(),
                container_id: "squatter".into(),
                pod: "pod-other".into(),
                ..Default::default()
            })
            .await
            .unwrap();
    });
    let out = run("multi-pod", &[&mig_a.1, &mig_b.1], "pod-mine");
    refused(&out, "is bound to pod pod-other; pod pod-mine");
    assert_eq!(containers(&mig_a.0), (Vec::new(), String::new()));

    // Two MPS shares cannot be one container's: refused, nothing bound.
    let out = run("multi-mps", &[&mps_1.1, &mps_2.1], "pod-mine");
    refused(&out, "CUDA_MPS_PIPE_DIRECTORY");
    assert!(containers(&mps_1.0).0.is_empty());
    assert!(containers(&mps_2.0).0.is_empty());

    // The same token twice.
    let out = run("multi-dup", &[&mig_a.1, &mig_a.1], "pod-mine");
    refused(&out, "repeats an earlier token");

    // A bind that fails after another succeeded (the MPS share serves another uid):
    // the container is unbound from the lease it was bound to.
    r.block_on(async {
        w.daemon
            .client()
            .await
            .unwrap()
            .bind_container(pb::BindContainerRequest {
                token: mps_1.1.clone(),
                container_id: "other-uid".into(),
                uid: Some(4321),
                ..Default::default()
            })
            .await
            .unwrap();
    });
    for t in [&mig_a.1, &mps_1.1] {
        let resolved = r.block_on(async {
            w.daemon
                .client()
                .await
                .unwrap()
                .resolve_token(pb::ResolveTokenRequest { token: t.clone() })
                .await
                .unwrap()
                .into_inner()
        });
        w.mknod_lease_nodes(&resolved);
    }
    let out = run("multi-uid", &[&mig_a.1, &mps_1.1], "");
    refused(&out, "BindContainer failed");
    refused(&out, "serves uid 4321");
    assert!(containers(&mig_a.0).0.is_empty(), "left half-bound");
    assert_eq!(containers(&mps_1.0).0, ["other-uid"]);
}

/// A container on a lease of two whole GPUs (a bridged pair of PCIe cards) sees
/// both GPUs' device nodes and UUIDs, and not the other pair's GPU.
#[test]
fn a_container_on_a_two_gpu_lease_sees_exactly_its_two_gpus() {
    let gpus = format!(
        "topology = \"pcie-pairs\"\n{}",
        "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = false\n\n".repeat(4)
    );
    let Some(w) = World::with_gpus(&gpus, "") else {
        return;
    };
    let r = rt();
    let two = pb::Shape {
        kind: Some(pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count: 2 })),
    };
    let (lease, token, resolved) = w.lease(&r, two);
    let mine: Vec<u32> = lease.partitions.iter().map(|p| p.gpu_index).collect();
    assert_eq!(mine, vec![0, 1], "the bridged pair");
    assert_eq!(resolved.visible_gpu_indices, vec![0, 1]);
    w.mknod_lease_nodes(&resolved);
    // Another GPU's node on the host: the container must not get it.
    devnodes::mknod(&w.dev.join("nvidia2"), &w.dev, 195, 2).unwrap();
    let script = "probe open /dev/nvidia0; probe open /dev/nvidia1; probe open /dev/nvidia2; \
                  probe open /dev/nvidiactl; echo CVD=$CUDA_VISIBLE_DEVICES; \
                  ls /dev | grep -c '^nvidia[0-9]'";
    let b = w.bundle("two-gpus", &["sh", "-c", script], &token);
    let id = format!("e2e-two-{}", std::process::id());
    let out = w.runtime(&["run", "--bundle", b.to_str().unwrap(), &id]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let uuids: Vec<String> = lease
        .partitions
        .iter()
        .map(|p| p.gpu_uuid.clone())
        .collect();
    for want in [
        // Its two GPUs reach the (absent) driver: ENXIO; the third is not there.
        "open /dev/nvidia0 errno=6".to_string(),
        "open /dev/nvidia1 errno=6".to_string(),
        "open /dev/nvidia2 errno=2".to_string(),
        "open /dev/nvidiactl errno=6".to_string(),
        format!("CVD={}", uuids.join(",")),
        // Exactly two GPU nodes in the container's /dev.
        "2".to_string(),
    ] {
        assert!(
            stdout.lines().any(|l| l.trim() == want.trim()),
            "missing {want:?}:\n{}",
            text(&out)
        );
    }
}

/// The ResolveToken records in the daemon's audit log so far.
fn resolves_audited(w: &World) -> usize {
    std::fs::read_to_string(w.daemon.dir.path().join("state/audit.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"action\":\"ResolveToken\""))
        .count()
}

#[test]
fn a_second_start_judges_on_the_kept_answer_and_a_changed_one_is_refused_at_bind() {
    let Some(w) = World::new("") else { return };
    let r = rt();
    let (lease, token, resolved) = w.lease(&r, shape::whole());
    w.mknod_lease_nodes(&resolved);
    let gpu = lease.partition.as_ref().unwrap().gpu_index;
    let other = w.mknod_other_gpu(gpu);
    let script = format!("probe open /dev/nvidia{gpu}; probe open /dev/nvidia{other}");
    // Containers of one pod: the first bind claims the token for the pod, which the
    // answer kept after it says.
    let sandbox = w.sandbox("pod-kept");
    let start = |name: &str| {
        let b = w.bundle(name, &["sh", "-c", &script], &token);
        let mut spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
        spec["annotations"]["io.kubernetes.cri.container-type"] = json!("container");
        spec["annotations"]["io.kubernetes.cri.sandbox-uid"] = json!("pod-kept");
        spec["annotations"]["io.kubernetes.cri.sandbox-id"] = json!(sandbox);
        common::write_spec(&b, &spec);
        let out = w.runtime(&["run", "--bundle", b.to_str().unwrap(), name]);
        assert!(out.status.success(), "{}", text(&out));
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        for want in [
            format!("open /dev/nvidia{gpu} errno=6"),
            format!("open /dev/nvidia{other} errno=2"),
        ] {
            assert!(
                stdout.lines().any(|l| l.trim() == want),
                "{name}: missing {want:?}:\n{}",
                text(&out)
            );
        }
        // As containerd's shim does once the container has exited: unbind it.
        w.runtime(&["delete", "--force", name]);
    };
    // The first start asks the daemon and keeps its answer (root's, 0600).
    let asked = resolves_audited(&w);
    start("kept-1");
    assert_eq!(resolves_audited(&w), asked + 1);
    let kept = tessera_runtime::lease::cache::AnswerCache::new(&w.dir.path().join("runtime-state"))
        .path_of(&token);
    let meta = std::fs::metadata(&kept).expect("the answer is kept");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
        0o600
    );
    // The second start on the lease asks nothing before its bind.
    start("kept-2");
    assert_eq!(resolves_audited(&w), asked + 1, "the kept answer was used");
    let binds = std::fs::read_to_string(w.daemon.dir.path().join("state/audit.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"action\":\"BindContainer\"") && !l.contains("\"attempt\""))
        .map(str::to_string)
        .collect::<Vec<_>>();
    assert_eq!(
        binds.len(),
        2,
        "one bind per start, none refused: {binds:#?}"
    );
    assert!(binds.iter().all(|l| l.contains("\"ok\"")), "{binds:#?}");
    // A kept answer that no longer matches the daemon's (here: one that grants the
    // other GPU too) is refused at bind; the runtime asks again and the container
    // gets exactly its lease's devices.
    let mut answer: pb::ResolveTokenResponse =
        prost::Message::decode(&std::fs::read(&kept).unwrap()[..]).unwrap();
    let mut extra = answer
        .devices
        .iter()
        .find(|d| d.container_path == format!("/dev/nvidia{gpu}"))
        .unwrap()
        .clone();
    extra.host_path = w.dev.join(format!("nvidia{other}")).display().to_string();
    extra.container_path = format!("/dev/nvidia{other}");
    extra.minor = i64::from(other);
    answer.devices.push(extra);
    std::fs::write(&kept, prost::Message::encode_to_vec(&answer)).unwrap();
    start("kept-3");
    assert_eq!(
        resolves_audited(&w),
        asked + 2,
        "asked again after the refused bind"
    );
    let audit = std::fs::read_to_string(w.daemon.dir.path().join("state/audit.jsonl")).unwrap();
    assert!(
        audit
            .lines()
            .any(|l| l.contains("\"action\":\"BindContainer\"")
                && l.contains("\"FailedPrecondition\"")
                && l.contains("changed since the runtime resolved")),
        "the stale answer's bind is refused and audited:\n{audit}"
    );
    // And the answer kept now is the daemon's again.
    let now: pb::ResolveTokenResponse =
        prost::Message::decode(&std::fs::read(&kept).unwrap()[..]).unwrap();
    assert_eq!(now.devices, resolved.devices);
}

/// The containers a lease lists, and the pod it is bound to.
fn lease_containers(w: &World, r: &tokio::runtime::Runtime, id: &str) -> (Vec<String>, String) {
    r.block_on(async {
        let l = w
            .daemon
            .client()
            .await
            .unwrap()
            .get_lease(pb::GetLeaseRequest {
                lease_id: id.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        (l.containers.into_iter().map(|c| c.id).collect(), l.pod)
    })
}

/// A spec in bundle `name` with `token`, of a pod: `annotations` set, in `cgroup`.
fn pod_spec(w: &World, name: &str, token: &str, annotations: &Value, cgroup: &str) -> PathBuf {
    let b = w.bundle(name, &["sleep", "600"], token);
    let mut spec: Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    if token.is_empty() {
        spec["annotations"] = json!({});
    }
    for (k, v) in annotations.as_object().unwrap() {
        spec["annotations"][k] = v.clone();
    }
    spec["linux"]["cgroupsPath"] = json!(cgroup);
    common::write_spec(&b, &spec);
    b
}

/// Red team 2, finding 2, with a real tesserad: a second sandbox claiming pod-a's
/// uid (in another QoS class under the CRI's root, or anywhere under another root) is
/// refused, so no container of the attacker's can present itself as pod-a's and take
/// pod-a's lease; the lease lists pod-a's own container only.
#[test]
fn a_forged_sandbox_takes_no_other_pods_lease() {
    let Some(w) = World::new("") else { return };
    let r = rt();
    let (lease, token, resolved) = w.lease(&r, shape::whole());
    w.mknod_lease_nodes(&resolved);
    let top = w.kubepods();
    let pid = std::process::id();
    let victim_sb = w.sandbox("pod-a");
    let member = |sb: &str| {
        json!({"io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-id": sb, "io.kubernetes.cri.sandbox-uid": "pod-a"})
    };
    let id = format!("e2e-victim-{pid}");
    let b = pod_spec(
        &w,
        "victim",
        &token,
        &member(&victim_sb),
        &format!("/{top}/podpod-a/{id}"),
    );
    let out = w.runtime(&["create", "--bundle", b.to_str().unwrap(), &id]);
    assert!(out.status.success(), "victim: {}", text(&out));
    let other_root = w.dir.path().join("other-root");
    let mut failures = Vec::new();
    for (root, cg, want) in [
        (
            &w.runc_root,
            format!("/{top}/besteffort/podpod-a"),
            "already has a cgroup",
        ),
        (
            &other_root,
            format!("/{top}/podpod-a"),
            "not the CRI's runc root",
        ),
    ] {
        let fsid = format!("e2e-forged-{pid}");
        let sandbox = json!({"io.kubernetes.cri.container-type": "sandbox",
            "io.kubernetes.cri.sandbox-id": fsid, "io.kubernetes.cri.sandbox-uid": "pod-a"});
        let fb = pod_spec(&w, "forged", "", &sandbox, &format!("{cg}/{fsid}"));
        let out = w.runtime_at(root, &["create", "--bundle", fb.to_str().unwrap(), &fsid]);
        if out.status.success() || !text(&out).contains(want) {
            failures.push(format!("forged sandbox in {cg}: {}", text(&out)));
        }
        let aid = format!("e2e-attacker-{pid}");
        let ab = pod_spec(
            &w,
            "attacker",
            &token,
            &member(&fsid),
            &format!("{cg}/{aid}"),
        );
        let out = w.runtime_at(root, &["create", "--bundle", ab.to_str().unwrap(), &aid]);
        if out.status.success() {
            failures.push(format!("attacker's container in {cg}: admitted"));
            let _ = w.runtime_at(root, &["delete", "--force", &aid]);
        }
    }
    let (containers, pod) = lease_containers(&w, &r, &lease.id);
    assert_eq!(
        containers,
        vec![id.clone()],
        "the lease lists pod-a's container only"
    );
    assert_eq!(pod, "pod-a");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Red team 2, finding 2 (tenant_namespaces), with a real tesserad: a sandbox made
/// outside the CRI claiming the tenant's namespace gives its containers no pod, so
/// the tenant's token is refused to them, and the daemon binds nothing.
#[test]
fn a_sandbox_made_outside_the_cri_satisfies_no_tenant_namespace() {
    let Some(w) = World::new("") else { return };
    let mut cfg = std::fs::read_to_string(&w.runtime_config).unwrap();
    cfg.push_str("\n[tenant_namespaces]\nteam-a = [\"ns-a\"]\n");
    std::fs::write(&w.runtime_config, cfg).unwrap();
    let r = rt();
    let (lease, token, resolved) = w.lease(&r, shape::whole());
    w.mknod_lease_nodes(&resolved);
    let top = w.kubepods();
    let pid = std::process::id();
    let other_root = w.dir.path().join("other-root");
    let sid = format!("e2e-sb-z-{pid}");
    let sandbox = json!({"io.kubernetes.cri.container-type": "sandbox",
        "io.kubernetes.cri.sandbox-id": sid, "io.kubernetes.cri.sandbox-uid": "pod-z",
        "io.kubernetes.cri.sandbox-namespace": "ns-a"});
    let fb = pod_spec(&w, "sb-z", "", &sandbox, &format!("/{top}/podpod-z/{sid}"));
    let out = w.runtime_at(
        &other_root,
        &["create", "--bundle", fb.to_str().unwrap(), &sid],
    );
    assert!(
        !out.status.success(),
        "sandbox outside the CRI: {}",
        text(&out)
    );
    assert!(
        text(&out).contains("not the CRI's runc root"),
        "{}",
        text(&out)
    );
    let id = format!("e2e-c-z-{pid}");
    let member = json!({"io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-id": sid, "io.kubernetes.cri.sandbox-uid": "pod-z",
        "io.kubernetes.cri.sandbox-namespace": "ns-a"});
    let b = pod_spec(&w, "c-z", &token, &member, &format!("/{top}/podpod-z/{id}"));
    let out = w.runtime_at(
        &other_root,
        &["create", "--bundle", b.to_str().unwrap(), &id],
    );
    assert!(!out.status.success(), "member: {}", text(&out));
    // Without pod claims, outside a pod: the tenant binding refuses it.
    let b = w.bundle("plain", &["sleep", "600"], &token);
    let out = w.runtime_at(
        &other_root,
        &["create", "--bundle", b.to_str().unwrap(), "e2e-plain"],
    );
    assert!(!out.status.success(), "plain: {}", text(&out));
    assert!(
        text(&out).contains("tenants are bound to Kubernetes namespaces"),
        "{}",
        text(&out)
    );
    let (containers, _) = lease_containers(&w, &r, &lease.id);
    assert!(containers.is_empty(), "{containers:?}");
}
