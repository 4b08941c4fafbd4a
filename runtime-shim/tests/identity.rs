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
        // One kubepods cgroup per world: the tests of this file run in parallel.
        static WORLDS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = WORLDS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let top = format!("tessera-id-{}-{n}", std::process::id());
        let text = std::fs::read_to_string(&config).unwrap();
        // The runc root stands for the CRI's (containerd's k8s.io), `top` for
        // kubelet's /kubepods.
        std::fs::write(
            &config,
            format!(
                "{text}container_storage_roots = [{:?}]\ncontainer_run_roots = [{:?}]\ncri_runc_roots = [{:?}]\nkubepods_roots = [\"/{top}\", \"kubepods.slice\"]\n",
                d.join("storage"),
                d.join("runroot"),
                d.join("runc-root"),
            ),
        )
        .unwrap();
        Some(World {
            root: d.join("runc-root"),
            config,
            top,
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
            "directly in a configured cgroup parent",
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

/// `tessera-runtime` with `args`, as root under `root`: Ok, or the refusal's stderr.
fn runtime_at(
    w: &World,
    root: &Path,
    args: &[&str],
    bundle: &Path,
    id: &str,
) -> Result<(), String> {
    let mut cmd = Command::new(common::runtime_bin());
    cmd.env("TESSERA_RUNTIME_CONFIG", &w.config)
        .arg("--root")
        .arg(root)
        .args(args)
        .arg("--bundle")
        .arg(bundle);
    if !id.is_empty() {
        cmd.arg(id);
    }
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[test]
fn a_storage_rootfs_must_be_the_containers_own_layer() {
    let Some(w) = World::new() else { return };
    let storage = w.dir.path().join("storage");
    // podman's bundle for a container: its own userdata in the store.
    let userdata = |id: &str| storage.join("overlay-containers").join(id).join("userdata");
    let podman_bundle = |id: &str, root: &Path, f: &dyn Fn(&mut Value)| {
        let b = userdata(id);
        let mut spec = common::base_spec(&["sleep", "600"]);
        spec["root"]["path"] = json!(root);
        spec["linux"]["cgroupsPath"] = json!(format!("/tessera-test/libpod-{id}"));
        f(&mut spec);
        common::write_spec(&b, &spec);
        b
    };
    // Its own layer, as containers.json records it, from its own userdata bundle:
    // admitted, and runc runs on it.
    let own = storage.join("overlay/l-own/merged");
    let b = podman_bundle("podman-own", &own, &|_| {});
    w.create("podman-own", &b).unwrap();
    let pid = w.pid("podman-own").unwrap();
    assert!(Path::new(&format!("/proc/{pid}/root/l-own.marker")).exists());
    assert!(!Path::new(&format!("/proc/{pid}/root/l-other.marker")).exists());
    // Another container's layer, the layer store, the whole storage, a layer's
    // parent: refused.
    let mut failures = Vec::new();
    for root in [
        storage.join("overlay/l-other/merged"),
        storage.join("overlay"),
        storage.clone(),
        storage.join("overlay/l-own"),
    ] {
        let b = podman_bundle("podman-own", &root, &|_| {});
        match runtime_at(
            &w,
            &w.root,
            &["check", "--json", "--id", "podman-own"],
            &b,
            "",
        ) {
            Err(e) if e.contains("not this container's own rootfs") => {}
            r => failures.push(format!("{}: {r:?}", root.display())),
        }
    }
    // The same id under another runc root (ids are unique per root only), its bundle
    // elsewhere: podman's container of that id is not this one. Refused, and runc has
    // nothing; the victim's layer is untouched.
    let other_root = w.dir.path().join("other-root");
    let b = w.bundle("podman-other", |s, _| {
        s["root"]["path"] = json!(storage.join("overlay/l-other/merged"));
        s["linux"]["cgroupsPath"] = json!("/tessera-test/podman-other");
    });
    match runtime_at(&w, &other_root, &["create"], &b, "podman-other") {
        Err(e) if e.contains("is not this container's own userdata") => {}
        r => failures.push(format!("podman-other under another root: {r:?}")),
    }
    let st = Command::new("runc")
        .arg("--root")
        .arg(&other_root)
        .args(["state", "podman-other"])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    if st.status.success() {
        failures.push("runc has podman-other under the other root".into());
        let _ = Command::new("runc")
            .arg("--root")
            .arg(&other_root)
            .args(["delete", "--force", "podman-other"])
            .status();
    }
    // A container the store does not know: refused.
    let b = podman_bundle("podman-unknown", &own, &|_| {});
    match w.create("podman-unknown", &b) {
        Err(e) if e.contains("is not in") => {}
        r => failures.push(format!("podman-unknown: {r:?}")),
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// podman's run directory (`<runroot>/<driver>-containers/<id>/userdata`) holds
/// conmon's pid files beside the files it writes for the container: a container gets
/// those (hosts, hostname, resolv.conf, .containerenv) writable, the engine's files
/// and the directory never; another engine's container directory never writable.
#[test]
fn a_podman_run_directory_gives_only_the_containers_own_files() {
    let Some(w) = World::new() else { return };
    let d = w.dir.path();
    let storage = d.join("storage");
    let run = |id: &str| {
        d.join("runroot/overlay-containers")
            .join(id)
            .join("userdata")
    };
    for id in ["podman-own", "podman-other"] {
        std::fs::create_dir_all(run(id)).unwrap();
        for f in ["hosts", "conmon.pid", "pidfile", "resolv.conf"] {
            std::fs::write(run(id).join(f), "42\n").unwrap();
        }
    }
    let bind = |src: PathBuf, dest: &str, rw: bool| {
        json!({"destination": dest, "type": "bind", "source": src,
               "options": ["rbind", if rw { "rw" } else { "ro" }]})
    };
    let make = |mounts: Vec<Value>| {
        let b = storage.join("overlay-containers/podman-own/userdata");
        let mut spec = common::base_spec(&["sleep", "600"]);
        spec["root"]["path"] = json!(storage.join("overlay/l-own/merged"));
        spec["linux"]["cgroupsPath"] = json!("/tessera-test/libpod-podman-own");
        spec["mounts"].as_array_mut().unwrap().extend(mounts);
        common::write_spec(&b, &spec);
        b
    };
    let mut failures = Vec::new();
    for (what, m) in [
        (
            "conmon.pid rw",
            bind(run("podman-own").join("conmon.pid"), "/c", true),
        ),
        (
            "pidfile rw",
            bind(run("podman-own").join("pidfile"), "/c", true),
        ),
        ("the run dir rw", bind(run("podman-own"), "/c", true)),
        (
            "another's hosts",
            bind(run("podman-other").join("hosts"), "/c", true),
        ),
        (
            "another's bundle config.json",
            bind(
                storage.join("overlay-containers/podman-other/userdata/config.json"),
                "/c",
                false,
            ),
        ),
    ] {
        std::fs::create_dir_all(storage.join("overlay-containers/podman-other/userdata")).unwrap();
        std::fs::write(
            storage.join("overlay-containers/podman-other/userdata/config.json"),
            "{}",
        )
        .unwrap();
        let b = make(vec![m]);
        match runtime_at(
            &w,
            &w.root,
            &["check", "--json", "--id", "podman-own"],
            &b,
            "",
        ) {
            Ok(()) => failures.push(format!("{what}: admitted")),
            Err(e) if e.contains("\"admitted\":true") || e.contains("\"admitted\": true") => {
                failures.push(format!("{what}: admitted: {e}"))
            }
            Err(_) => {}
        }
    }
    // Its own hosts file writable and the run directory read-only: admitted, and
    // what it writes to /etc/hosts is what the host's file holds; conmon's pid file
    // is unchanged.
    let b = make(vec![
        bind(run("podman-own").join("hosts"), "/etc/hosts", true),
        bind(run("podman-own"), "/run/podman-run", false),
    ]);
    let mut spec: Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    spec["process"]["args"] = json!([
        "sh",
        "-c",
        "echo 6.6.6.6 x >> /etc/hosts; echo 1 > /run/podman-run/conmon.pid; sleep 600"
    ]);
    common::write_spec(&b, &spec);
    w.create("podman-own", &b).unwrap();
    let _ = Command::new("runc")
        .arg("--root")
        .arg(&w.root)
        .args(["start", "podman-own"])
        .status();
    let mut hosts = String::new();
    for _ in 0..200 {
        hosts = std::fs::read_to_string(run("podman-own").join("hosts")).unwrap();
        if hosts.contains("6.6.6.6") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        hosts.contains("6.6.6.6"),
        "its own hosts file is writable: {hosts}"
    );
    assert_eq!(
        std::fs::read_to_string(run("podman-own").join("conmon.pid")).unwrap(),
        "42\n",
        "conmon's pid file is read-only to it"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A pod sandbox (findings 1, 2, 8 of the second red team): only under the CRI's runc
/// root, directly in its own pod's cgroup directly below a kubepods root, that pod's
/// only pod cgroup (no other QoS class) and still empty. Judged by what runc made.
#[test]
fn a_sandbox_is_its_pods_only_one_directly_below_kubepods() {
    let Some(w) = World::new() else { return };
    let top = w.top.clone();
    let pid_a = w.sandbox("sb-a", UID_A);
    let other_root = w.dir.path().join("other-root");
    let uid_x = "1d0c8a52-0000-4000-8000-0000000000f1";
    let uid_w = "1d0c8a52-0000-4000-8000-0000000000f2";
    let sandbox_spec = |id: &str, uid: &str, cg: String| {
        let id = id.to_string();
        let uid = uid.to_string();
        w.bundle(&id.clone(), move |s, _| {
            s["annotations"] = json!({
                "io.kubernetes.cri.container-type": "sandbox",
                "io.kubernetes.cri.sandbox-id": id,
                "io.kubernetes.cri.sandbox-uid": uid,
                "io.kubernetes.cri.sandbox-namespace": "team",
            });
            s["linux"]["cgroupsPath"] = json!(cg);
        })
    };
    // kubelet made pod W's cgroup; its sandbox is not started yet.
    let pod_w = format!("/sys/fs/cgroup/memory/{top}/pod{uid_w}");
    std::fs::create_dir_all(&pod_w).unwrap();
    let pa = format!("/{top}/pod{UID_A}");
    let cases: Vec<(&str, &str, String, &Path, &str)> = vec![
        // 1: inside another pod, its sandbox, a host slice, outside kubepods.
        (
            "sbx1",
            uid_x,
            format!("{pa}/pod{uid_x}/sbx1"),
            &w.root,
            "directly in its pod's cgroup",
        ),
        (
            "sbx2",
            uid_x,
            format!("/{top}/burstable/pod{UID_A}/pod{uid_x}/sbx2"),
            &w.root,
            "directly in its pod's cgroup",
        ),
        (
            "sbx3",
            uid_x,
            format!("{pa}/sb-a/pod{uid_x}/sbx3"),
            &w.root,
            "directly in its pod's cgroup",
        ),
        (
            "sbx4",
            uid_x,
            format!("/system.slice/pod{uid_x}/sbx4"),
            &w.root,
            "directly in its pod's cgroup",
        ),
        (
            "sbx5",
            uid_x,
            format!("/{top}x/pod{uid_x}/sbx5"),
            &w.root,
            "directly in its pod's cgroup",
        ),
        // 2: pod A's uid again in another QoS class; a fresh pod from another root.
        (
            "sbf",
            UID_A,
            format!("/{top}/besteffort/pod{UID_A}/sbf"),
            &w.root,
            "already has a cgroup",
        ),
        (
            "sby",
            uid_x,
            format!("/{top}/pod{uid_x}/sby"),
            &other_root,
            "not the CRI's runc root",
        ),
        // 8: a sandbox squatting pod W's empty cgroup from another root, or pod W's
        // uid in another QoS class from the CRI's root.
        (
            "sbq",
            uid_w,
            format!("/{top}/pod{uid_w}/sbq"),
            &other_root,
            "not the CRI's runc root",
        ),
        (
            "sbq2",
            uid_w,
            format!("/{top}/burstable/pod{uid_w}/sbq2"),
            &w.root,
            "already has a cgroup",
        ),
    ];
    let mut failures = Vec::new();
    for (id, uid, cg, root, want) in &cases {
        let b = sandbox_spec(id, uid, cg.clone());
        match runtime_at(&w, root, &["create"], &b, id) {
            Ok(()) => failures.push(format!("{id}: admitted")),
            Err(e) if !e.contains(want) => failures.push(format!("{id}: want {want:?}: {e}")),
            Err(_) => {}
        }
        let st = Command::new("runc")
            .arg("--root")
            .arg(root)
            .args(["state", id])
            .stderr(Stdio::null())
            .output()
            .unwrap();
        if st.status.success() {
            failures.push(format!("{id}: runc has it"));
            let _ = Command::new("runc")
                .arg("--root")
                .arg(root)
                .args(["delete", "--force", id])
                .status();
        }
        let leaf = Path::new("/sys/fs/cgroup/memory").join(cg.trim_start_matches('/'));
        if leaf.exists() {
            failures.push(format!("{id}: runc made its cgroup {}", leaf.display()));
        }
    }
    // A container of pod A made under another runc root: no pod, no namespace join.
    let b = w.bundle("x-other-root", |s, _| {
        member(s, "sb-a", UID_A);
        s["linux"]["cgroupsPath"] = json!(format!("{pa}/x-other-root"));
        s["linux"]["namespaces"][4] =
            json!({"type": "network", "path": format!("/proc/{pid_a}/ns/net")});
    });
    match runtime_at(&w, &other_root, &["create"], &b, "x-other-root") {
        Err(e) if e.contains("not the CRI's runc root") => {}
        r => failures.push(format!("x-other-root: {r:?}")),
    }
    // systemd's forms (checked, not run: no systemd here): host slices, another
    // pod's slice, and the one kubelet makes.
    let uid_sd = uid_x.replace('-', "_");
    for (cg, ok) in [
        (format!("system-pod{uid_sd}.slice:cri-containerd:sd"), false),
        (format!("user-0-pod{uid_sd}.slice:cri-containerd:sd"), false),
        (
            format!(
                "kubepods-burstable-pod{}-pod{uid_sd}.slice:cri-containerd:sd",
                UID_A.replace('-', "_")
            ),
            false,
        ),
        (
            format!("kubepods-besteffort-pod{uid_sd}.slice:cri-containerd:sd"),
            true,
        ),
    ] {
        let b = sandbox_spec("sd", uid_x, cg.clone());
        let r = runtime_at(
            &w,
            &w.root,
            &["--systemd-cgroup", "check", "--json", "--id", "sd"],
            &b,
            "",
        );
        if r.is_ok() != ok {
            failures.push(format!("systemd {cg}: {r:?}"));
        }
    }
    // The real sandbox of pod W, under the CRI's root: admitted, in pod W's cgroup.
    let b = sandbox_spec("sb-w", uid_w, format!("/{top}/pod{uid_w}/sb-w"));
    w.create("sb-w", &b).unwrap();
    let pid = w.pid("sb-w").unwrap();
    assert_eq!(memory_cgroup(pid), format!("/{top}/pod{uid_w}/sb-w"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Outside a pod (findings 6, 7): a container's cgroup is its own, directly in a
/// configured parent and named by its id: never inside another container's.
#[test]
fn a_container_outside_a_pod_gets_its_own_cgroup_directly_in_a_parent() {
    let Some(w) = World::new() else { return };
    let b = w.bundle("octr", |s, _| {
        s["linux"]["cgroupsPath"] = json!("/tessera-test/octr");
    });
    w.create("octr", &b).unwrap();
    let pid = w.pid("octr").unwrap();
    assert_eq!(memory_cgroup(pid), "/tessera-test/octr");
    let mut failures = Vec::new();
    for (id, cg) in [
        ("evil", "/tessera-test/octr/evil"),
        ("evil2", "/tessera-test/x/evil2"),
        ("evil3", "/tessera-test/octr"),
        ("evil4", "/tessera-test/pre-evil4"),
    ] {
        let b = w.bundle(id, |s, _| s["linux"]["cgroupsPath"] = json!(cg));
        match w.create(id, &b) {
            Err(e)
                if e.contains("directly in a configured cgroup parent")
                    || e.contains("must end in this container's id") => {}
            r => failures.push(format!("{id} in {cg}: {r:?}")),
        }
        if w.pid(id).is_some() {
            failures.push(format!("{id}: runc has it"));
        }
    }
    let _ = Command::new("runc")
        .arg("--root")
        .arg(&w.root)
        .args(["delete", "--force", "octr"])
        .status();
    let _ = std::fs::remove_dir("/sys/fs/cgroup/memory/tessera-test/octr");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
