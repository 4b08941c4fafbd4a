//! Identity and scope from state the tenant cannot write, through the real runtime and
//! real runc: pod sandboxes made by the runtime (runc records them under `--root`),
//! then containers that claim them. Judged by what happened: the cgroup a container
//! landed in (/proc/<pid>/cgroup), the network namespace it joined, and for a refusal,
//! that runc made no container and no cgroup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const UID_A: &str = "1d0c8a52-0000-4000-8000-00000000000a";
const UID_B: &str = "1d0c8a52-0000-4000-8000-00000000000b";

struct World {
    dir: tempfile::TempDir,
    config: PathBuf,
    root: PathBuf,
    /// The top cgroup standing for kubelet's /kubepods.
    top: String,
    made: std::cell::RefCell<Vec<String>>,
}

impl World {
    fn new() -> Option<World> {
        if !common::can_run_as_root("identity through runc", &["runc", "busybox"]) {
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("tid")
            .tempdir_in("/tmp")
            .unwrap();
        let d = dir.path();
        common::busybox_rootfs(d);
        let proc_root = common::fake_nvidia_proc(d);
        let config = common::runtime_config(d, &d.join("sock/no-daemon.sock"), &proc_root, "");
        // A containers-storage store of two containers (podman's layout).
        std::fs::create_dir_all(d.join("storage/overlay-containers")).unwrap();
        std::fs::write(
            d.join("storage/overlay-containers/containers.json"),
            r#"[{"id": "podman-own", "layer": "l-own"}, {"id": "podman-other", "layer": "l-other"}]"#,
        )
        .unwrap();
        for layer in ["l-own", "l-other"] {
            let merged = d.join("storage/overlay").join(layer).join("merged");
            std::fs::create_dir_all(merged.parent().unwrap()).unwrap();
            let st = Command::new("cp")
                .arg("-al")
                .arg(d.join("rootfs"))
                .arg(&merged)
                .status()
                .unwrap();
            assert!(st.success());
            // Which layer a container runs on, seen from the host.
            std::fs::write(merged.join(format!("{layer}.marker")), "").unwrap();
        }
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(
            &config,
            format!(
                "{text}container_storage_roots = [{:?}]\n",
                d.join("storage")
            ),
        )
        .unwrap();
        Some(World {
            root: d.join("runc-root"),
            config,
            top: format!("tessera-id-{}", std::process::id()),
            made: Default::default(),
            dir,
        })
    }

    fn pod_cgroup(&self, uid: &str) -> String {
        format!("/{}/pod{uid}", self.top)
    }

    /// A bundle with its own rootfs (hard links) and `spec` changed by `f`.
    fn bundle(&self, id: &str, f: impl FnOnce(&mut Value, &Path)) -> PathBuf {
        let b = self.dir.path().join("bundles").join(id);
        let mut spec = common::base_spec(&["sleep", "600"]);
        spec["root"]["path"] = json!(common::bundle_rootfs(self.dir.path(), &b));
        f(&mut spec, &b);
        common::write_spec(&b, &spec);
        b
    }

    /// `tessera-runtime create`: Ok, or the refusal's stderr.
    fn create(&self, id: &str, bundle: &Path) -> Result<(), String> {
        let err = self.dir.path().join(format!("{id}.stderr"));
        let st = Command::new(common::runtime_bin())
            .env("TESSERA_RUNTIME_CONFIG", &self.config)
            .arg("--root")
            .arg(&self.root)
            .args(["create", "--bundle"])
            .arg(bundle)
            .arg(id)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .status()
            .unwrap();
        self.made.borrow_mut().push(id.to_string());
        if st.success() {
            Ok(())
        } else {
            Err(std::fs::read_to_string(err).unwrap())
        }
    }

    /// A pod sandbox of pod `uid`, made by the runtime: its init pid.
    fn sandbox(&self, id: &str, uid: &str) -> u32 {
        let b = self.bundle(id, |s, _| {
            s["annotations"] = json!({
                "io.kubernetes.cri.container-type": "sandbox",
                "io.kubernetes.cri.sandbox-id": id,
                "io.kubernetes.cri.sandbox-uid": uid,
                "io.kubernetes.cri.sandbox-namespace": "team",
                "io.kubernetes.cri.sandbox-name": id,
            });
            s["linux"]["cgroupsPath"] = json!(format!("{}/{id}", self.pod_cgroup(uid)));
        });
        self.create(id, &b).unwrap();
        self.pid(id).unwrap()
    }

    /// runc's record of a container's init pid, if runc has the container.
    fn pid(&self, id: &str) -> Option<u32> {
        let out = Command::new("runc")
            .arg("--root")
            .arg(&self.root)
            .args(["state", id])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).ok()?;
        v["pid"].as_u64().map(|p| p as u32)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for id in self.made.borrow().iter().rev() {
            let _ = Command::new("runc")
                .arg("--root")
                .arg(&self.root)
                .args(["delete", "--force", id])
                .stderr(Stdio::null())
                .status();
        }
        if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in rd.flatten() {
                remove_tree(&h.path().join(&self.top));
            }
        }
    }
}

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

/// The memory cgroup of `pid` (v1 hybrid, else the unified one).
fn memory_cgroup(pid: u32) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let line = |f: &dyn Fn(&str) -> bool| {
        text.lines().find_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, ctrl, path) = (p.next()?, p.next()?, p.next()?);
            f(ctrl).then(|| path.to_string())
        })
    };
    line(&|c| c.split(',').any(|c| c == "memory"))
        .or_else(|| line(&|c| c.is_empty()))
        .unwrap()
}

fn netns(pid: u32) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap()
}

/// A container of pod `uid` naming sandbox `sandbox`.
fn member(s: &mut Value, sandbox: &str, uid: &str) {
    s["annotations"] = json!({
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-id": sandbox,
        "io.kubernetes.cri.sandbox-uid": uid,
    });
}

#[test]
fn cgroups_and_namespaces_follow_the_sandbox_runc_recorded() {
    let Some(w) = World::new() else { return };
    let pid_a = w.sandbox("sb-a", UID_A);
    let pid_b = w.sandbox("sb-b", UID_B);
    assert_eq!(
        memory_cgroup(pid_a),
        format!("{}/sb-a", w.pod_cgroup(UID_A)),
        "the sandbox is in its pod's cgroup"
    );

    // Pod A's container, in pod A's cgroup, joining sandbox A's network: admitted,
    // and runc put it there.
    let pod_a = w.pod_cgroup(UID_A);
    let b = w.bundle("c-a", |s, _| {
        member(s, "sb-a", UID_A);
        s["linux"]["cgroupsPath"] = json!(format!("{pod_a}/c-a"));
        s["linux"]["namespaces"][4] =
            json!({"type": "network", "path": format!("/proc/{pid_a}/ns/net")});
    });
    w.create("c-a", &b).unwrap();
    let pid = w.pid("c-a").unwrap();
    assert_eq!(memory_cgroup(pid), format!("{pod_a}/c-a"));
    assert_eq!(
        netns(pid),
        netns(pid_a),
        "it joined its own sandbox's network"
    );

    // Each of these is refused, and runc makes nothing.
    let pod_b = w.pod_cgroup(UID_B);
    let pod_b2 = pod_b.clone();
    type Change = Box<dyn Fn(&mut Value, &Path)>;
    let cases: Vec<(&str, &str, Change)> = vec![
        (
            "x-other-pod-cgroup",
            "is not inside its pod's cgroup",
            Box::new(move |s, _| {
                member(s, "sb-a", UID_A);
                s["linux"]["cgroupsPath"] = json!(format!("{pod_b2}/x-other-pod-cgroup"));
            }),
        ),
        (
            "x-claims-other-uid",
            "is not the pod of sandbox sb-a",
            Box::new(|s, _| member(s, "sb-a", UID_B)),
        ),
        (
            "x-other-sandbox-net",
            "is not the pod sandbox's",
            Box::new(move |s, _| {
                member(s, "sb-a", UID_A);
                s["linux"]["namespaces"][4] =
                    json!({"type": "network", "path": format!("/proc/{pid_b}/ns/net")});
            }),
        ),
        (
            "x-container-net",
            "is not the pod sandbox's",
            Box::new(move |s, _| {
                member(s, "sb-a", UID_A);
                s["linux"]["namespaces"][4] =
                    json!({"type": "network", "path": format!("/proc/{pid}/ns/net")});
            }),
        ),
        (
            "x-non-sandbox-as-sandbox",
            "is not a pod sandbox by its own record",
            Box::new(move |s, _| {
                member(s, "c-a", UID_A);
                s["linux"]["namespaces"][4] =
                    json!({"type": "network", "path": format!("/proc/{pid}/ns/net")});
            }),
        ),
        (
            "x-no-pod-joins",
            "a container outside a pod joins no namespace",
            Box::new(move |s, _| {
                s["linux"]["namespaces"][4] =
                    json!({"type": "network", "path": format!("/proc/{pid_a}/ns/net")});
            }),
        ),
        (
            "x-no-pod-in-pod-cgroup",
            "not inside a configured cgroup parent",
            Box::new(move |s, _| {
                s["linux"]["cgroupsPath"] = json!(format!("{pod_a}/x-no-pod-in-pod-cgroup"));
            }),
        ),
        (
            "x-systemd-host-slice",
            "systemd's slice:prefix:name form",
            Box::new(|s, _| {
                member(s, "sb-a", UID_A);
                s["linux"]["cgroupsPath"] = json!("system-x.slice:cri:x-systemd-host-slice");
            }),
        ),
        (
            "x-bundle-rw",
            "is the bundle or a directory above it",
            Box::new(|s, b| {
                s["mounts"].as_array_mut().unwrap().push(json!({
                    "destination": "/b", "type": "bind",
                    "source": b, "options": ["rbind", "rw"]}));
            }),
        ),
        (
            "x-bundle-parent",
            "is the bundle or a directory above it",
            Box::new(|s, b| {
                s["mounts"].as_array_mut().unwrap().push(json!({
                    "destination": "/b", "type": "bind",
                    "source": b.parent().unwrap(), "options": ["rbind", "ro"]}));
            }),
        ),
        (
            "x-config-rw",
            "config.json, which the runtime or the engine reads later",
            Box::new(|s, b| {
                s["mounts"].as_array_mut().unwrap().push(json!({
                    "destination": "/c.json", "type": "bind",
                    "source": b.join("config.json"), "options": ["bind", "rw"]}));
            }),
        ),
    ];
    let mut failures = Vec::new();
    for (id, want, change) in &cases {
        let b = w.bundle(id, |s, b| change(s, b));
        match w.create(id, &b) {
            Ok(()) => failures.push(format!("{id}: admitted")),
            Err(e) if !e.contains(want) => failures.push(format!("{id}: want {want:?}: {e}")),
            Err(_) => {}
        }
        if w.pid(id).is_some() {
            failures.push(format!("{id}: runc has the container"));
        }
        let stray = Path::new("/sys/fs/cgroup/memory")
            .join(pod_b.trim_start_matches('/'))
            .join(id);
        if stray.exists() {
            failures.push(format!("{id}: a cgroup was made in another pod"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // A sandbox claiming a pod that is already running (its uid, its cgroup) is
    // refused: a sandbox is its pod's first container.
    let b = w.bundle("sb-fake", |s, _| {
        s["annotations"] = json!({
            "io.kubernetes.cri.container-type": "sandbox",
            "io.kubernetes.cri.sandbox-id": "sb-fake",
            "io.kubernetes.cri.sandbox-uid": UID_A,
        });
        s["linux"]["cgroupsPath"] = json!(format!("{}/sb-fake", w.pod_cgroup(UID_A)));
    });
    let e = w.create("sb-fake", &b).unwrap_err();
    assert!(e.contains("already holds processes"), "{e}");
    assert!(w.pid("sb-fake").is_none());
    // A sandbox joining a CNI netns another pod's sandbox is in is refused.
    let netns = Path::new("/run/netns").join(format!("tessera-id-{}", std::process::id()));
    std::fs::create_dir_all("/run/netns").unwrap();
    std::fs::write(&netns, "").unwrap();
    let mounted = Command::new("mount")
        .arg("--bind")
        .arg(format!("/proc/{pid_a}/ns/net"))
        .arg(&netns)
        .status()
        .unwrap()
        .success();
    assert!(mounted, "bind-mounting sandbox A's netns");
    let uid_c = "1d0c8a52-0000-4000-8000-00000000000c";
    let b = w.bundle("sb-netns", |s, _| {
        s["annotations"] = json!({
            "io.kubernetes.cri.container-type": "sandbox",
            "io.kubernetes.cri.sandbox-id": "sb-netns",
            "io.kubernetes.cri.sandbox-uid": uid_c,
        });
        s["linux"]["cgroupsPath"] = json!(format!("{}/sb-netns", w.pod_cgroup(uid_c)));
        s["linux"]["namespaces"][4] = json!({"type": "network", "path": netns});
    });
    let r = w.create("sb-netns", &b);
    let _ = Command::new("umount").arg(&netns).status();
    let _ = std::fs::remove_file(&netns);
    let e = r.unwrap_err();
    assert!(e.contains("is already another pod's"), "{e}");

    // The sandbox gone (its init dead): its record no longer vouches for anyone.
    let _ = Command::new("runc")
        .arg("--root")
        .arg(&w.root)
        .args(["kill", "sb-b", "KILL"])
        .status();
    for _ in 0..100 {
        if common::proc_start_time_opt(pid_b).is_none() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let b = w.bundle("c-b", |s, _| {
        member(s, "sb-b", UID_B);
        s["linux"]["cgroupsPath"] = json!(format!("{}/c-b", w.pod_cgroup(UID_B)));
    });
    let e = w.create("c-b", &b).unwrap_err();
    assert!(e.contains("is not running"), "{e}");
}

#[test]
fn a_storage_rootfs_must_be_the_containers_own_layer() {
    let Some(w) = World::new() else { return };
    let storage = w.dir.path().join("storage");
    let with_root = |root: PathBuf| {
        move |s: &mut Value, _: &Path| {
            s["root"]["path"] = json!(root);
        }
    };
    // Its own layer, as containers.json records it: admitted, and runc runs on it.
    let own = storage.join("overlay/l-own/merged");
    let b = w.bundle("podman-own", with_root(own.clone()));
    w.create("podman-own", &b).unwrap();
    let pid = w.pid("podman-own").unwrap();
    assert!(Path::new(&format!("/proc/{pid}/root/l-own.marker")).exists());
    assert!(!Path::new(&format!("/proc/{pid}/root/l-other.marker")).exists());
    // Another container's layer, the layer store, the whole storage, a layer's
    // parent: refused.
    let mut failures = Vec::new();
    for (i, root) in [
        storage.join("overlay/l-other/merged"),
        storage.join("overlay"),
        storage.clone(),
        storage.join("overlay/l-own"),
    ]
    .into_iter()
    .enumerate()
    {
        let id = "podman-own";
        let b = w.dir.path().join("bundles").join(format!("podman-own-{i}"));
        let mut spec = common::base_spec(&["sleep", "600"]);
        spec["root"]["path"] = json!(root);
        common::write_spec(&b, &spec);
        let out = Command::new(common::runtime_bin())
            .env("TESSERA_RUNTIME_CONFIG", &w.config)
            .arg("--root")
            .arg(&w.root)
            .args(["check", "--json", "--id", id, "--bundle"])
            .arg(&b)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        if out.status.success() || !text.contains("not this container's own rootfs") {
            failures.push(format!("{}: {text}", root.display()));
        }
    }
    // A container the store does not know: refused.
    let b = w.bundle("podman-unknown", with_root(own));
    let e = w.create("podman-unknown", &b).unwrap_err();
    assert!(e.contains("is not in"), "{e}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
