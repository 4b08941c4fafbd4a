//! A property test of identity and scope: real containerd CRI- and podman-shaped specs,
//! composed with random hostile mutations (other pods' sandboxes, cgroups and
//! directories, non-sandbox containers, `..`, empty components, host slices, symlinks,
//! case-folded duplicate keys, writable bundle mounts, other containers' rootfs), and
//! the invariants every ADMITTED spec must hold, checked against the ground truth of
//! the fixture (not against what the spec says):
//! - its cgroup lies strictly inside its own pod's cgroup (a pod's container), or inside
//!   a configured parent (outside Kubernetes);
//! - it joins namespaces only of its own pod's sandbox's init process;
//! - no bind mount is the bundle, above it, a file the runtime reads later (writable),
//!   runc's state, or another pod's directory;
//! - `root.path` is its own (inside the bundle, or the layer the store records for it);
//! - the pod uid it is reported with is its sandbox's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use proptest::prelude::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use tessera_runtime::config::RuntimeConfig;
use tessera_runtime::harden::identity::{cgroup_components, parent_components};
use tessera_runtime::harden::{self, Context, seccomp::Profile};
use tessera_runtime::host::HostFacts;

const UID_A: &str = "aaaa-1111";
const UID_B: &str = "bbbb-2222";

struct Fx {
    dir: tempfile::TempDir,
    cfg: RuntimeConfig,
    profile: Profile,
    host: HostFacts,
    /// Live processes standing for the sandboxes' and a plain container's init.
    children: Vec<std::process::Child>,
    pid_a: u32,
    pid_b: u32,
    pid_x: u32,
}

impl Drop for Fx {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn p(fx: &Fx, rel: &str) -> PathBuf {
    fx.dir.path().join(rel)
}

fn fixture() -> Option<Fx> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: identity properties: runc-style records must be root's");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The engines' bundles: containerd's task directory of c1 under the CRI's runc
    // root ("runc-root" is its namespace), podman's userdata of c1 in its store.
    for sub in [
        "containerd/io.containerd.runtime.v2.task/runc-root/c1/rootfs",
        "containerd/io.containerd.runtime.v2.task/runc-root/c1/shm",
        "storage/overlay-containers/c1/userdata/rootfs",
        "storage/overlay-containers/c1/userdata/shm",
        "kubelet/pods/aaaa-1111/volumes/v",
        "kubelet/pods/bbbb-2222/volumes/v",
        "containerd/io.containerd.grpc.v1.cri/sandboxes/sb-a",
        "containerd/io.containerd.grpc.v1.cri/sandboxes/sb-b",
        "storage/overlay/l-own/merged",
        "storage/overlay/l-other/merged",
        "storage/overlay-containers",
        "run-storage/overlay-containers/c1/userdata",
        "run-storage/overlay-containers/c2/userdata",
    ] {
        std::fs::create_dir_all(d.join(sub)).unwrap();
    }
    std::os::unix::fs::symlink(
        d.join("containerd/io.containerd.runtime.v2.task/runc-root/c1"),
        d.join("bundle"),
    )
    .unwrap();
    std::os::unix::fs::symlink(
        d.join("storage/overlay-containers/c1/userdata"),
        d.join("podman-bundle"),
    )
    .unwrap();
    std::fs::write(d.join("bundle/config.json"), "{}").unwrap();
    std::fs::write(d.join("podman-bundle/config.json"), "{}").unwrap();
    std::fs::write(
        d.join("run-storage/overlay-containers/c1/userdata/hosts"),
        "",
    )
    .unwrap();
    std::fs::write(
        d.join("storage/overlay-containers/containers.json"),
        r#"[{"id": "c1", "layer": "l-own"}, {"id": "c2", "layer": "l-other"}]"#,
    )
    .unwrap();
    // Symlinks the tenant might point at: into another pod's directory, at another
    // container's layer.
    std::os::unix::fs::symlink(
        d.join("kubelet/pods/bbbb-2222/volumes/v"),
        d.join("kubelet/pods/aaaa-1111/volumes/link"),
    )
    .unwrap();
    std::os::unix::fs::symlink(
        d.join("storage/overlay/l-other/merged"),
        d.join("bundle/other-root"),
    )
    .unwrap();
    let sleeper = || {
        std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap()
    };
    // Sandbox A's init in namespaces of its own (joining the host's is refused).
    let Some(unshare) = ["/usr/bin/unshare", "/bin/unshare"]
        .into_iter()
        .find(|p| Path::new(p).exists())
    else {
        eprintln!("SKIPPED: identity properties: unshare (util-linux) is not installed");
        return None;
    };
    let a = std::process::Command::new(unshare)
        .args(["--net", "--ipc", "--uts", "sleep", "600"])
        .spawn()
        .unwrap();
    let host_net = std::fs::read_link("/proc/self/ns/net").unwrap();
    for _ in 0..200 {
        if std::fs::read_link(format!("/proc/{}/ns/net", a.id())).is_ok_and(|n| n != host_net) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let (b, x) = (sleeper(), sleeper());
    let (pid_a, pid_b, pid_x) = (a.id(), b.id(), x.id());
    let root = d.join("runc-root");
    let sandbox = |id, uid, pid, cg| common::SandboxState {
        id,
        pod_uid: uid,
        namespace: "ns",
        name: id,
        pid,
        cgroups_path: cg,
    };
    sandbox(
        "sb-a",
        UID_A,
        pid_a,
        "/kubepods/burstable/podaaaa-1111/sb-a",
    )
    .write(&root);
    sandbox(
        "sb-b",
        UID_B,
        pid_b,
        "/kubepods/burstable/podbbbb-2222/sb-b",
    )
    .write(&root);
    // A plain container of pod A, recorded by runc: not a sandbox.
    sandbox("c-x", UID_A, pid_x, "/kubepods/burstable/podaaaa-1111/c-x").write(&root);
    let sx = root.join("c-x/state.json");
    let text = std::fs::read_to_string(&sx)
        .unwrap()
        .replace("container-type=sandbox", "container-type=container");
    std::fs::write(&sx, text).unwrap();
    let q = |s: &str| format!("{:?}", d.join(s));
    let mut cfg = RuntimeConfig::parse(
        &format!(
            "[policy]\napparmor = \"if-available\"\ncontainer_storage_roots = [{}]\ncontainer_run_roots = [{}]\ncontainerd_root = {}\ncontainerd_state = {}\nkubelet_root = {}\ncri_runc_roots = [{}]\n",
            q("storage"),
            q("run-storage"),
            q("containerd"),
            q("containerd"),
            q("kubelet"),
            q("runc-root")
        ),
        Path::new("props.toml"),
    )
    .unwrap();
    cfg.nvidia_cdi_specs = Some(Vec::new());
    let proc_root = common::fake_nvidia_proc(d);
    Some(Fx {
        cfg,
        profile: Profile::load(None).unwrap(),
        host: HostFacts::gather(&proc_root).with_apparmor(Default::default()),
        children: vec![a, b, x],
        pid_a,
        pid_b,
        pid_x,
        dir,
    })
}

/// containerd CRI's container of pod A (kubelet's and containerd's mounts).
fn cri_spec(fx: &Fx) -> Value {
    let mut s = common::base_spec(&["sh"]);
    s["annotations"] = json!({
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-id": "sb-a",
        "io.kubernetes.cri.sandbox-uid": UID_A,
        "io.kubernetes.cri.sandbox-namespace": "ns",
        "io.kubernetes.cri.sandbox-name": "sb-a",
    });
    s["linux"]["cgroupsPath"] = json!("/kubepods/burstable/podaaaa-1111/c1");
    s["linux"]["namespaces"][4] =
        json!({"type": "network", "path": format!("/proc/{}/ns/net", fx.pid_a)});
    s["mounts"].as_array_mut().unwrap().push(json!({
        "destination": "/v", "type": "bind", "options": ["rbind", "rw"],
        "source": p(fx, "kubelet/pods/aaaa-1111/volumes/v")}));
    s
}

/// podman's container c1: its layer, its userdata files, libpod's cgroup.
fn podman_spec(fx: &Fx) -> Value {
    let mut s = common::base_spec(&["sh"]);
    s["root"]["path"] = json!(p(fx, "storage/overlay/l-own/merged"));
    s["annotations"] = json!({"io.container.manager": "libpod"});
    s["linux"]["cgroupsPath"] = json!("/libpod_parent/libpod-c1");
    for (dest, src) in [
        (
            "/etc/hosts",
            "run-storage/overlay-containers/c1/userdata/hosts",
        ),
        ("/dev/shm", "podman-bundle/shm"),
    ] {
        s["mounts"].as_array_mut().unwrap().push(json!({
            "destination": dest, "type": "bind", "options": ["bind", "rprivate"],
            "source": p(fx, src)}));
    }
    s
}

const CGROUPS: &[&str] = &[
    "/kubepods/burstable/podaaaa-1111/c1",
    "/kubepods/burstable/podbbbb-2222/c1",
    "/kubepods/burstable/podaaaa-1111/sb-a/c1",
    "/kubepods/burstable/podaaaa-1111/../podbbbb-2222/c1",
    "/kubepods/burstable//podaaaa-1111/c1",
    "kubepods/burstable/podaaaa-1111/c1",
    "/kubepods/burstable/c1",
    "/libpod_parent/libpod-c1",
    "/system.slice/c1",
    "system-x.slice:cri:c1",
    "user-0.slice:cri:c1",
    "machine-x.slice:libpod:c1",
    "kubepods-burstable-podaaaa_1111.slice:cri:c1",
    "machine.slice:libpod:c1",
    "/tessera/l/c1",
    "",
];

#[derive(Debug, Clone)]
enum M {
    Cgroup(usize),
    Systemd(bool),
    Join(usize),
    SandboxId(usize),
    Uid(usize),
    CaseDup,
    CaseFold(usize),
    Root(usize),
    Bind(usize, bool),
}

fn mutation() -> impl Strategy<Value = M> {
    prop_oneof![
        (0..CGROUPS.len()).prop_map(M::Cgroup),
        any::<bool>().prop_map(M::Systemd),
        (0usize..6).prop_map(M::Join),
        (0usize..5).prop_map(M::SandboxId),
        (0usize..3).prop_map(M::Uid),
        Just(M::CaseDup),
        (0usize..4).prop_map(M::CaseFold),
        (0usize..6).prop_map(M::Root),
        ((0usize..8), any::<bool>()).prop_map(|(i, rw)| M::Bind(i, rw)),
    ]
}

fn apply(fx: &Fx, s: &mut Value, m: &M, systemd: &mut bool) {
    match m {
        M::Cgroup(i) => s["linux"]["cgroupsPath"] = json!(CGROUPS[*i]),
        M::Systemd(b) => *systemd = *b,
        M::Join(i) => {
            let path = match i {
                0 => format!("/proc/{}/ns/net", fx.pid_a),
                1 => format!("/proc/{}/ns/net", fx.pid_b),
                2 => format!("/proc/{}/ns/net", fx.pid_x),
                3 => "/run/netns/cni-other".to_string(),
                4 => format!("/proc/{}/ns/../ns/net", fx.pid_b),
                _ => format!("/proc/{}/ns/ipc", fx.pid_b),
            };
            let ty = if *i == 5 { "ipc" } else { "network" };
            let idx = if *i == 5 { 1 } else { 4 };
            s["linux"]["namespaces"][idx] = json!({"type": ty, "path": path});
        }
        M::SandboxId(i) => {
            let ann = s["annotations"].as_object_mut().unwrap();
            match i {
                0 => ann.insert("io.kubernetes.cri.sandbox-id".into(), json!("sb-a")),
                1 => ann.insert("io.kubernetes.cri.sandbox-id".into(), json!("sb-b")),
                2 => ann.insert("io.kubernetes.cri.sandbox-id".into(), json!("c-x")),
                3 => ann.insert("io.kubernetes.cri.sandbox-id".into(), json!("../sb-a")),
                _ => ann.remove("io.kubernetes.cri.sandbox-id"),
            };
        }
        M::Uid(i) => {
            let ann = s["annotations"].as_object_mut().unwrap();
            match i {
                0 => ann.insert("io.kubernetes.cri.sandbox-uid".into(), json!(UID_B)),
                1 => ann.insert("io.kubernetes.pod.uid".into(), json!(UID_B)),
                _ => ann.remove("io.kubernetes.cri.sandbox-uid"),
            };
        }
        M::CaseDup => {
            let ann = s["annotations"].as_object_mut().unwrap();
            ann.insert("IO.KUBERNETES.CRI.SANDBOX-ID".into(), json!("sb-b"));
            ann.insert("io.kubernetes.cri.Sandbox-Uid".into(), json!(UID_B));
        }
        // Keys Go's encoding/json would read as the field (case-insensitively).
        M::CaseFold(i) => match i {
            0 => {
                s["linux"]["CgroupsPath"] = json!("/kubepods/burstable/podbbbb-2222/c1");
            }
            1 => s["Root"] = json!({"path": p(fx, "storage/overlay/l-other/merged")}),
            2 => {
                s["linux"]["Namespaces"] =
                    json!([{"type": "network", "path": format!("/proc/{}/ns/net", fx.pid_b)}]);
            }
            _ => {
                let m = s["mounts"].as_array_mut().unwrap();
                m.push(
                    json!({"destination": "/m", "type": "bind", "options": ["rbind"],
                    "Source": p(fx, "bundle"), "source": p(fx, "bundle/shm")}),
                );
            }
        },
        M::Root(i) => {
            s["root"]["path"] = match i {
                0 => json!("rootfs"),
                1 => json!(p(fx, "storage/overlay/l-own/merged")),
                2 => json!(p(fx, "storage/overlay/l-other/merged")),
                3 => json!(p(fx, "storage/overlay")),
                4 => json!("other-root"),
                _ => json!(p(fx, "storage")),
            }
        }
        M::Bind(i, rw) => {
            let src = match i {
                0 => p(fx, "bundle"),
                1 => p(fx, "bundle/config.json"),
                2 => fx.dir.path().to_path_buf(),
                3 => p(fx, "kubelet/pods/bbbb-2222/volumes/v"),
                4 => p(fx, "kubelet/pods/aaaa-1111/volumes/link"),
                5 => p(fx, "runc-root"),
                6 => p(fx, "containerd/io.containerd.grpc.v1.cri/sandboxes/sb-b"),
                _ => p(fx, "bundle/shm"),
            };
            let opts = if *rw {
                ["rbind", "rw"]
            } else {
                ["rbind", "ro"]
            };
            s["mounts"]
                .as_array_mut()
                .unwrap()
                .push(json!({"destination": "/m", "type": "bind", "source": src, "options": opts}));
        }
    }
}

/// What the fixture knows: sandbox id -> (pod uid, init pid, pod cgroup).
fn truth(fx: &Fx, sid: &str) -> Option<(&'static str, u32, Vec<String>)> {
    let c = |s: &str| s.split('/').map(String::from).collect::<Vec<_>>();
    match sid {
        "sb-a" => Some((UID_A, fx.pid_a, c("kubepods/burstable/podaaaa-1111"))),
        "sb-b" => Some((UID_B, fx.pid_b, c("kubepods/burstable/podbbbb-2222"))),
        _ => None,
    }
}

/// A key runc would read as another (equal when ASCII case is folded, at any depth).
fn folded_twin(v: &Value, at: &str) -> Option<String> {
    match v {
        Value::Object(m) => {
            let mut seen = std::collections::HashSet::new();
            for (k, child) in m {
                if !seen.insert(k.to_ascii_lowercase()) && !at.ends_with("/annotations") {
                    return Some(format!("{at}/{k}"));
                }
                if let Some(t) = folded_twin(child, &format!("{at}/{k}")) {
                    return Some(t);
                }
            }
            None
        }
        Value::Array(a) => a.iter().find_map(|c| folded_twin(c, at)),
        _ => None,
    }
}

/// Keys of the OCI spec in their exact spelling, where a folded spelling was tried.
const EXACT: &[(&str, &str)] = &[
    ("", "root"),
    ("/linux", "cgroupsPath"),
    ("/linux", "namespaces"),
    ("/mounts", "source"),
];

fn check_invariants(fx: &Fx, s: &Value, id: &str, systemd: bool) -> Result<(), String> {
    if let Some(t) = folded_twin(s, "") {
        return Err(format!("two keys runc reads as one: {t}"));
    }
    for (at, exact) in EXACT {
        let objs: Vec<&Value> = match *at {
            "/mounts" => s["mounts"].as_array().unwrap().iter().collect(),
            "" => vec![s],
            p => vec![s.pointer(p).unwrap()],
        };
        for o in objs {
            if let Some(k) = o.as_object().and_then(|m| {
                m.keys()
                    .find(|k| k.eq_ignore_ascii_case(exact) && k.as_str() != *exact)
            }) {
                return Err(format!("{at}/{k} is read by runc as {exact}"));
            }
        }
    }
    let ann = |k: &str| s["annotations"].get(k).and_then(Value::as_str);
    let sid = ann("io.kubernetes.cri.sandbox-id");
    let pod = match sid {
        Some(sid) => Some(truth(fx, sid).ok_or(format!("admitted with sandbox {sid:?}"))?),
        None => None,
    };
    // The pod it is reported with is its sandbox's.
    if let Some((uid, _, _)) = &pod {
        for k in ["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"] {
            if ann(k).is_some_and(|v| v != *uid) {
                return Err(format!("{k} is not the sandbox's pod {uid}"));
            }
        }
    }
    // cgroup.
    if let Some(cg) = s["linux"]["cgroupsPath"].as_str().filter(|c| !c.is_empty()) {
        let comps = cgroup_components(cg, systemd).map_err(|e| format!("admitted {e}"))?;
        let inside = |parent: &[String]| comps.len() > parent.len() && comps.starts_with(parent);
        let ok = match &pod {
            Some((_, _, pod_cg)) => inside(pod_cg),
            None => {
                fx.cfg
                    .policy
                    .cgroup_parents
                    .iter()
                    .any(|p| inside(&parent_components(p).unwrap()))
                    || comps.first().is_some_and(|c| c == "tessera")
            }
        };
        if !ok {
            return Err(format!("cgroup {cg} is outside its pod / parents"));
        }
    }
    // Namespace joins: only the own sandbox's init.
    for ns in s["linux"]["namespaces"].as_array().unwrap() {
        let Some(path) = ns["path"].as_str().filter(|p| !p.is_empty()) else {
            continue;
        };
        match &pod {
            Some((_, pid, _)) if path.starts_with(&format!("/proc/{pid}/ns/")) => {}
            _ => return Err(format!("joins {path}")),
        }
    }
    // Mounts.
    let podman = s["root"]["path"]
        .as_str()
        .is_some_and(|r| Path::new(r).starts_with(p(fx, "storage")));
    let bundle =
        std::fs::canonicalize(p(fx, if podman { "podman-bundle" } else { "bundle" })).unwrap();
    for m in s["mounts"].as_array().unwrap() {
        if m["type"] != "bind" && !m["options"].to_string().contains("bind") {
            continue;
        }
        let src = std::fs::canonicalize(m["source"].as_str().unwrap()).unwrap();
        let rw = !m["options"].to_string().contains("\"ro\"");
        if bundle.starts_with(&src) {
            return Err(format!("mounts the bundle or above: {}", src.display()));
        }
        if rw && src == bundle.join("config.json") {
            return Err("mounts config.json writable".into());
        }
        for other in ["kubelet/pods/bbbb-2222", "runc-root"] {
            let o = std::fs::canonicalize(p(fx, other)).unwrap();
            if src.starts_with(&o) && pod.as_ref().is_none_or(|(u, _, _)| *u != UID_B) {
                return Err(format!("mounts {}", src.display()));
            }
        }
        if src.starts_with(p(fx, "containerd/io.containerd.grpc.v1.cri/sandboxes/sb-b"))
            && sid != Some("sb-b")
        {
            return Err(format!("mounts another sandbox's {}", src.display()));
        }
    }
    // root.path.
    let root = s["root"]["path"].as_str().unwrap();
    let full = if Path::new(root).is_absolute() {
        PathBuf::from(root)
    } else {
        bundle.join(root)
    };
    let canon = std::fs::canonicalize(full).unwrap();
    let own_layer = (id == "c1").then(|| p(fx, "storage/overlay/l-own/merged"));
    if !(canon.starts_with(&bundle) && canon != bundle) && Some(&canon) != own_layer.as_ref() {
        return Err(format!("root.path {} is not its own", canon.display()));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_admitted_spec_keeps_to_its_own_pod(
        podman in any::<bool>(),
        ms in proptest::collection::vec(mutation(), 1..5),
    ) {
        thread_local! {
            static FX: Option<Fx> = fixture();
        }
        FX.with(|fx| {
            let Some(fx) = fx else { return Ok(()) };
            let mut spec = if podman { podman_spec(fx) } else { cri_spec(fx) };
            let mut systemd = false;
            for m in &ms {
                apply(fx, &mut spec, m, &mut systemd);
            }
            let bundle = p(fx, if podman { "podman-bundle" } else { "bundle" });
            let root = p(fx, "runc-root");
            let ctx = Context {
                config: &fx.cfg,
                seccomp: &fx.profile,
                host: &fx.host,
                lease: None,
                container_id: "c1",
                systemd_cgroup: systemd,
                bundle: &bundle,
                runc_root: &root,
            };
            let d = harden::harden(spec, &ctx);
            if d.admitted
                && let Err(e) = check_invariants(fx, &d.spec, "c1", systemd)
            {
                return Err(TestCaseError::fail(format!("{e}\nmutations {ms:?}\n{}", d.spec)));
            }
            Ok(())
        })?;
    }
}

/// The unmutated specs are admitted (the property is not vacuous).
#[test]
fn the_real_specs_are_admitted() {
    let Some(fx) = fixture() else { return };
    let bundle = p(&fx, "bundle");
    let root = p(&fx, "runc-root");
    for (spec, bundle) in [
        (cri_spec(&fx), bundle.clone()),
        (podman_spec(&fx), p(&fx, "podman-bundle")),
    ] {
        let ctx = Context {
            config: &fx.cfg,
            seccomp: &fx.profile,
            host: &fx.host,
            lease: None,
            container_id: "c1",
            systemd_cgroup: false,
            bundle: &bundle,
            runc_root: &root,
        };
        let d = harden::harden(spec, &ctx);
        assert!(d.admitted, "{:?}", d.reasons);
        check_invariants(&fx, &d.spec, "c1", false).unwrap();
    }
    // The invariants can fail: each breach, put into an admitted spec by hand, is seen.
    let ctx = Context {
        config: &fx.cfg,
        seccomp: &fx.profile,
        host: &fx.host,
        lease: None,
        container_id: "c1",
        systemd_cgroup: false,
        bundle: &bundle,
        runc_root: &root,
    };
    let good = harden::harden(cri_spec(&fx), &ctx).spec;
    type Breach<'a> = Box<dyn Fn(&mut Value) + 'a>;
    let breaches: Vec<Breach> = vec![
        Box::new(|s| s["linux"]["cgroupsPath"] = json!("/kubepods/burstable/podbbbb-2222/c1")),
        Box::new(|s| {
            s["linux"]["namespaces"][4]["path"] = json!(format!("/proc/{}/ns/net", fx.pid_x))
        }),
        Box::new(|s| s["annotations"]["io.kubernetes.cri.sandbox-uid"] = json!(UID_B)),
        Box::new(|s| s["root"]["path"] = json!(p(&fx, "storage/overlay/l-other/merged"))),
        Box::new(|s| s["linux"]["CgroupsPath"] = json!("/kubepods/burstable/podbbbb-2222/c1")),
        Box::new(|s| {
            s["mounts"]
                .as_array_mut()
                .unwrap()
                .push(json!({"destination": "/b",
                "type": "bind", "source": p(&fx, "bundle"), "options": ["rbind"]}))
        }),
    ];
    for (i, breach) in breaches.iter().enumerate() {
        let mut bad = good.clone();
        breach(&mut bad);
        assert!(
            check_invariants(&fx, &bad, "c1", false).is_err(),
            "breach {i} unseen"
        );
    }
}
