//! The allowlist, through `tessera-runtime check --json`: a hostile corpus (each case a
//! change to a benign spec that must be refused with a reason naming the field, or
//! neutralized in the hardened spec), and a compatibility corpus (what containerd's
//! CRI, `ctr run` and podman 4 really send) that must be admitted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;

const SANDBOX: &str = "5e1c0ffee5e1c0ffee5e1c0ffee5e1c0ffee5e1c0ffee5e1c0ffee5e1c0ffee0";
const POD_UID: &str = "0b5c3c9e-6b1e-4b7f-9e0a-1f2d3c4b5a69";

/// A temp "host": containerd, kubelet and podman roots of its own, a runtime config
/// that names them, and bundles with their rootfs inside.
struct Host {
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl Host {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let proc_root = common::fake_nvidia_proc(d);
        let runc = common::which("runc").unwrap_or_else(|| PathBuf::from("/usr/sbin/runc"));
        for p in [
            format!("containerd/io.containerd.grpc.v1.cri/sandboxes/{SANDBOX}"),
            format!("run-containerd/io.containerd.grpc.v1.cri/sandboxes/{SANDBOX}/shm"),
            format!("kubelet/pods/{POD_UID}/volumes/kubernetes.io~empty-dir/cache"),
            format!("kubelet/pods/{POD_UID}/containers/app/0a1b2c3d"),
            "kubelet/pods/other-pod-uid/volumes".to_string(),
            "storage/overlay/abc/merged/bin".to_string(),
            "storage/overlay/def/merged/bin".to_string(),
            "run-storage/overlay-containers/podctr/userdata".to_string(),
            "run-storage/vfs-containers/podctr/userdata".to_string(),
            "tessera-run".to_string(),
            "shared-ro/models".to_string(),
            "etc-cron.d".to_string(),
        ] {
            std::fs::create_dir_all(d.join(p)).unwrap();
        }
        std::fs::write(
            d.join(format!(
                "containerd/io.containerd.grpc.v1.cri/sandboxes/{SANDBOX}/hostname"
            )),
            "pod\n",
        )
        .unwrap();
        std::fs::write(
            d.join(format!("kubelet/pods/{POD_UID}/etc-hosts")),
            "127.0.0.1 localhost\n",
        )
        .unwrap();
        std::fs::write(
            d.join(format!(
                "kubelet/pods/{POD_UID}/containers/app/0a1b2c3d/termination-log"
            )),
            "",
        )
        .unwrap();
        for driver in ["overlay", "vfs"] {
            std::fs::write(
                d.join(format!(
                    "run-storage/{driver}-containers/podctr/userdata/hosts"
                )),
                "",
            )
            .unwrap();
        }
        std::fs::write(d.join("tessera-run/tesserad.sock"), "").unwrap();
        // runc's record of the pod sandbox (this test process stands for its init).
        sandbox_state(std::process::id()).write(&d.join("runc-root"));
        // podman's record of its container podctr: its layer.
        std::fs::create_dir_all(d.join("storage/overlay-containers")).unwrap();
        std::fs::write(
            d.join("storage/overlay-containers/containers.json"),
            r#"[{"id": "otherctr", "layer": "def"}, {"id": "podctr", "layer": "abc"}, {"id": "c1", "layer": "ghi"}]"#,
        )
        .unwrap();
        let config = d.join("runtime.toml");
        let q = |p: &str| format!("{:?}", d.join(p));
        std::fs::write(
            &config,
            format!(
                "runc_path = {runc:?}\nstate_dir = {}\ndaemon_socket = {}\ndaemon_timeout_ms = 3000\nnvidia_proc_root = {proc_root:?}\nrunc_cve_acknowledged = [\"CVE-2025-31133\", \"CVE-2025-52565\", \"CVE-2025-52881\"]\n\
                 [policy]\napparmor = \"if-available\"\n\
                 container_storage_roots = [{}]\ncontainer_run_roots = [{}]\n\
                 containerd_root = {}\ncontainerd_state = {}\nkubelet_root = {}\n\
                 bind_sources = [{{ path = {}, writable = false }}]\ncri_runc_roots = [{}]\n",
                q("runtime-state"),
                q("tessera-run/tesserad.sock"),
                q("storage"),
                q("run-storage"),
                q("containerd"),
                q("run-containerd"),
                q("kubelet"),
                q("shared-ro"),
                q("runc-root"),
            ),
        )
        .unwrap();
        Self { dir, config }
    }

    fn path(&self, p: &str) -> String {
        self.dir.path().join(p).to_string_lossy().into_owned()
    }

    /// `check --json` on `spec` in a new bundle named `name` (its rootfs inside).
    fn check(&self, name: &str, spec: &Value) -> (i32, Value) {
        self.check_id(name, spec, "c1")
    }

    fn check_id(&self, name: &str, spec: &Value, id: &str) -> (i32, Value) {
        // Where the engine puts the bundle: containerd's task directory of the id
        // for a CRI container (the runc root's name is the namespace), podman's
        // userdata in the store for a container on a storage layer, else anywhere.
        let d = self.dir.path();
        let cri = spec
            .pointer("/annotations/io.kubernetes.cri.container-type")
            .is_some();
        let podman = spec["root"]["path"]
            .as_str()
            .is_some_and(|r| r.starts_with(&self.path("storage/")));
        let b = if podman {
            let driver = if spec.to_string().contains("vfs-containers") {
                "vfs"
            } else {
                "overlay"
            };
            d.join("storage")
                .join(format!("{driver}-containers"))
                .join(id)
                .join("userdata")
        } else if cri {
            d.join("run-containerd/io.containerd.runtime.v2.task/runc-root")
                .join(id)
        } else {
            d.join("bundles").join(name)
        };
        let _ = std::fs::remove_dir_all(&b);
        std::fs::create_dir_all(b.join("rootfs/etc")).unwrap();
        // "BUNDLE/" in a case stands for this bundle's path.
        let text = spec
            .to_string()
            .replace("BUNDLE/", &format!("{}/", b.display()));
        common::write_spec(&b, &serde_json::from_str(&text).unwrap());
        let out = Command::new(common::runtime_bin())
            .env("TESSERA_RUNTIME_CONFIG", &self.config)
            .arg("--root")
            .arg(self.dir.path().join("runc-root"))
            .args(["check", "--json", "--id", id, "--bundle"])
            .arg(&b)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let v: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
            panic!(
                "{name}: check output is not JSON ({e}): {stdout} / {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        (out.status.code().unwrap_or(-1), v)
    }
}

fn reasons(out: &Value) -> Vec<String> {
    out["reasons"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|r| r.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// runc's record of the pod sandbox, its init process `pid`.
fn sandbox_state(pid: u32) -> common::SandboxState<'static> {
    common::SandboxState {
        id: SANDBOX,
        pod_uid: POD_UID,
        namespace: "team-a",
        name: "app-0",
        pid,
        cgroups_path: "/kubepods/burstable/pod0b5c3c9e-6b1e-4b7f-9e0a-1f2d3c4b5a69/5e1c0ffee5e1c0ffee5e1c0ffee5e1c0ffee5e1c0ffee5e1c0ffee5e1c0ffee0",
    }
}

/// A benign CRI container spec of the pod (SANDBOX, POD_UID).
fn pod_container(h: &Host) -> Value {
    let mut s = common::base_spec(&["sh"]);
    s["annotations"] = json!({
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-id": SANDBOX,
        "io.kubernetes.cri.sandbox-uid": POD_UID,
        "io.kubernetes.cri.sandbox-namespace": "team-a",
        "io.kubernetes.cri.sandbox-name": "app-0",
        "io.kubernetes.cri.container-name": "app",
    });
    let mounts = s["mounts"].as_array_mut().unwrap();
    for (dest, src, ro) in [
        (
            "/etc/hosts",
            format!("kubelet/pods/{POD_UID}/etc-hosts"),
            false,
        ),
        (
            "/dev/termination-log",
            format!("kubelet/pods/{POD_UID}/containers/app/0a1b2c3d/termination-log"),
            false,
        ),
        (
            "/etc/hostname",
            format!("containerd/io.containerd.grpc.v1.cri/sandboxes/{SANDBOX}/hostname"),
            false,
        ),
        (
            "/dev/shm",
            format!("run-containerd/io.containerd.grpc.v1.cri/sandboxes/{SANDBOX}/shm"),
            false,
        ),
        (
            "/cache",
            format!("kubelet/pods/{POD_UID}/volumes/kubernetes.io~empty-dir/cache"),
            false,
        ),
        ("/models", "shared-ro/models".to_string(), true),
    ] {
        let mut opts = vec!["rbind", "rprivate"];
        opts.push(if ro { "ro" } else { "rw" });
        mounts.push(
            json!({"destination": dest, "type": "bind", "source": h.path(&src), "options": opts}),
        );
    }
    s["linux"]["cgroupsPath"] = json!(format!("/kubepods/burstable/pod{POD_UID}/c1"));
    s["process"]["oomScoreAdj"] = json!(-997);
    s
}

type Mutation = Box<dyn Fn(&mut Value, &Host)>;

fn case(
    name: &'static str,
    want: &'static str,
    m: impl Fn(&mut Value, &Host) + 'static,
) -> (&'static str, &'static str, Mutation) {
    (name, want, Box::new(m))
}

fn bind(s: &mut Value, src: &str, dest: &str, opts: &[&str]) {
    s["mounts"]
        .as_array_mut()
        .unwrap()
        .push(json!({"destination": dest, "type": "bind", "source": src, "options": opts}));
}

/// Every hostile case: its name, a piece of the reason it must be refused with, and
/// the change to the benign pod container spec.
fn hostile() -> Vec<(&'static str, &'static str, Mutation)> {
    vec![
        // Unknown and refused fields (item 1, 7).
        case(
            "unknown-top-level",
            "/vm: not in the runtime's policy table",
            |s, _| s["vm"] = json!({"hypervisor": {"path": "/bin/sh"}}),
        ),
        case("unknown-solaris", "/solaris: not in", |s, _| {
            s["solaris"] = json!({})
        }),
        case("unknown-windows", "/windows: not in", |s, _| {
            s["windows"] = json!({})
        }),
        case(
            "unknown-process-field",
            "/process/futureKnob: not in",
            |s, _| s["process"]["futureKnob"] = json!(1),
        ),
        case(
            "unknown-linux-field",
            "/linux/futureKnob: not in",
            |s, _| s["linux"]["futureKnob"] = json!(true),
        ),
        case(
            "unknown-mount-field",
            "/mounts/0/futureKnob: not in",
            |s, _| s["mounts"][0]["futureKnob"] = json!("x"),
        ),
        case(
            "unknown-resources-field",
            "/linux/resources/futureKnob: not in",
            |s, _| s["linux"]["resources"]["futureKnob"] = json!({}),
        ),
        case("unknown-root-field", "/root/futureKnob: not in", |s, _| {
            s["root"]["futureKnob"] = json!(1)
        }),
        case("intel-rdt", "/linux/intelRdt: refused", |s, _| {
            s["linux"]["intelRdt"] = json!({"closID": "tenant", "l3CacheSchema": "L3:0=ffff"})
        }),
        case("net-devices", "/linux/netDevices: refused", |s, _| {
            s["linux"]["netDevices"] = json!({"eth0": {"name": "eth0"}})
        }),
        case("personality", "/linux/personality: refused", |s, _| {
            s["linux"]["personality"] = json!({"domain": "LINUX32"})
        }),
        case("time-offsets", "/linux/timeOffsets: refused", |s, _| {
            s["linux"]["timeOffsets"] = json!({"monotonic": {"secs": 1}})
        }),
        case("memory-policy", "/linux/memoryPolicy: refused", |s, _| {
            s["linux"]["memoryPolicy"] = json!({"mode": "MPOL_BIND"})
        }),
        case(
            "resources-network",
            "/linux/resources/network: refused",
            |s, _| s["linux"]["resources"]["network"] = json!({"classID": 1}),
        ),
        case(
            "resources-rdma",
            "/linux/resources/rdma: refused",
            |s, _| s["linux"]["resources"]["rdma"] = json!({"mlx5_0": {"hcaHandles": 1}}),
        ),
        case(
            "exec-cpu-affinity",
            "/process/execCPUAffinity: refused",
            |s, _| s["process"]["execCPUAffinity"] = json!({"initial": "0"}),
        ),
        case(
            "idmapped-mount",
            "/mounts/0/uidMappings: refused",
            |s, _| {
                s["mounts"][0]["uidMappings"] = json!([{"containerID": 0, "hostID": 0, "size": 1}])
            },
        ),
        case("hook-createruntime", "/hooks: refused", |s, _| {
            s["hooks"] = json!({"createRuntime": [{"path": "/bin/sh"}]})
        }),
        case("hook-poststart", "/hooks: refused", |s, _| {
            s["hooks"] = json!({"poststart": [{"path": "/usr/bin/nvidia-ctk"}]})
        }),
        case("oom-score-1000", "/process/oomScoreAdj: -1000", |s, _| {
            s["process"]["oomScoreAdj"] = json!(-1000)
        }),
        case("oom-score-999", "/process/oomScoreAdj: -999", |s, _| {
            s["process"]["oomScoreAdj"] = json!(-999)
        }),
        case("rlimit-rtprio", "/process/rlimits/1/type", |s, _| {
            s["process"]["rlimits"]
                .as_array_mut()
                .unwrap()
                .push(json!({"type": "RLIMIT_RTPRIO", "hard": 99, "soft": 99}))
        }),
        case("rlimit-memlock", "/process/rlimits/1/type", |s, _| {
            s["process"]["rlimits"]
                .as_array_mut()
                .unwrap()
                .push(json!({"type": "RLIMIT_MEMLOCK", "hard": u64::MAX, "soft": u64::MAX}))
        }),
        case("rlimit-nofile-huge", "/process/rlimits/0/hard", |s, _| {
            s["process"]["rlimits"][0]["hard"] = json!(u64::MAX)
        }),
        case(
            "sched-fifo",
            "/process/scheduler/policy: SCHED_FIFO",
            |s, _| s["process"]["scheduler"] = json!({"policy": "SCHED_FIFO", "priority": 99}),
        ),
        case(
            "sched-deadline",
            "/process/scheduler/runtime: refused",
            |s, _| s["process"]["scheduler"] = json!({"policy": "SCHED_DEADLINE", "runtime": 1000}),
        ),
        case("sched-nice", "/process/scheduler/nice", |s, _| {
            s["process"]["scheduler"] = json!({"policy": "SCHED_OTHER", "nice": -20})
        }),
        case("ioprio-rt", "/process/ioPriority/class", |s, _| {
            s["process"]["ioPriority"] = json!({"class": "IOPRIO_CLASS_RT", "priority": 0})
        }),
        case("selinux-label", "/process/selinuxLabel: refused", |s, _| {
            s["process"]["selinuxLabel"] = json!("system_u:system_r:container_t:s0")
        }),
        case("mount-label", "/linux/mountLabel: refused", |s, _| {
            s["linux"]["mountLabel"] = json!("system_u:object_r:container_file_t:s0")
        }),
        case(
            "systemd-property",
            "/annotations/org.systemd.property.DeviceAllow",
            |s, _| {
                s["annotations"]["org.systemd.property.DeviceAllow"] = json!("'char-nvidia rwm'")
            },
        ),
        case(
            "systemd-property-delegate",
            "org.systemd.property.",
            |s, _| s["annotations"]["org.systemd.property.Delegate"] = json!("true"),
        ),
        case("run-oci-annotation", "run.oci.", |s, _| {
            s["annotations"]["run.oci.keep_original_groups"] = json!("1")
        }),
        case(
            "rootfs-shared-propagation",
            "/linux/rootfsPropagation",
            |s, _| s["linux"]["rootfsPropagation"] = json!("rshared"),
        ),
        case("rootfs-shared", "/linux/rootfsPropagation", |s, _| {
            s["linux"]["rootfsPropagation"] = json!("shared")
        }),
        // root.path (item 2).
        case("root-daemon-run-dir", "/root/path", |s, h| {
            s["root"]["path"] = json!(h.path("tessera-run"))
        }),
        case("root-host-etc", "/root/path", |s, _| {
            s["root"]["path"] = json!("/etc")
        }),
        case("root-host-usr", "/root/path", |s, _| {
            s["root"]["path"] = json!("/usr")
        }),
        case("root-bundle-itself", "/root/path", |s, _| {
            s["root"]["path"] = json!(".")
        }),
        case("root-dotdot", "/root/path", |s, _| {
            s["root"]["path"] = json!("../../")
        }),
        case("root-other-pod", "/root/path", |s, h| {
            s["root"]["path"] = json!(h.path("kubelet/pods/other-pod-uid"))
        }),
        // Bind sources (item 2, 3).
        case("bind-usr-bin-rw", "/usr/bin is not under", |s, _| {
            bind(s, "/usr/bin", "/host-bin", &["rbind", "rw"])
        }),
        case("bind-etc-cron", "is not under", |s, h| {
            bind(s, &h.path("etc-cron.d"), "/cron", &["rbind", "rw"])
        }),
        case("bind-other-pod", "is not under", |s, h| {
            bind(
                s,
                &h.path("kubelet/pods/other-pod-uid/volumes"),
                "/steal",
                &["rbind"],
            )
        }),
        case("bind-kubelet-root", "is not under", |s, h| {
            bind(s, &h.path("kubelet"), "/k", &["rbind", "ro"])
        }),
        case("bind-containerd-root", "is not under", |s, h| {
            bind(s, &h.path("containerd"), "/c", &["rbind", "ro"])
        }),
        case("bind-other-sandbox", "is not under", |s, h| {
            bind(
                s,
                &h.path("containerd/io.containerd.grpc.v1.cri"),
                "/c",
                &["rbind", "ro"],
            )
        }),
        case("bind-snapshots", "is not under", |s, h| {
            bind(s, &h.path("storage"), "/snap", &["rbind"])
        }),
        case("bind-daemon-socket", "Tessera's own", |s, h| {
            bind(s, &h.path("tessera-run/tesserad.sock"), "/sock", &["bind"])
        }),
        case("bind-daemon-socket-dir", "Tessera's own", |s, h| {
            bind(s, &h.path("tessera-run"), "/t", &["rbind"])
        }),
        case("bind-ro-prefix-rw", "read-only only", |s, h| {
            bind(s, &h.path("shared-ro/models"), "/m", &["rbind", "rw"])
        }),
        case("bind-var-run", "is not under", |s, _| {
            bind(s, "/var/run", "/vr", &["rbind"])
        }),
        case("bind-root", "is not under", |s, _| {
            bind(s, "/", "/host", &["rbind", "ro"])
        }),
        case("bind-etc", "is not under", |s, _| {
            bind(s, "/etc", "/hostetc", &["rbind", "ro"])
        }),
        case("bind-home", "is not under", |s, _| {
            bind(s, "/root", "/r", &["rbind"])
        }),
        case("bind-missing", "No such file", |s, h| {
            bind(s, &h.path("nope/x"), "/x", &["rbind"])
        }),
        case("bind-dotdot-escape", "is not under", |s, h| {
            bind(
                s,
                &format!(
                    "{}/../../../../../../../etc",
                    h.path(&format!("kubelet/pods/{POD_UID}"))
                ),
                "/e",
                &["rbind"],
            )
        }),
        case("bind-via-type-none", "is not under", |s, _| {
            s["mounts"].as_array_mut().unwrap().push(json!({"destination": "/x", "type": "none", "source": "/etc", "options": ["rbind"]}))
        }),
        case(
            "bind-inside-rootfs",
            "inside the container's rootfs",
            |s, _| {
                s["mounts"].as_array_mut().unwrap().push(json!({"destination": "/x", "type": "bind", "source": "BUNDLE/rootfs/etc", "options": ["rbind"]}));
            },
        ),
        case("bind-relative", "relative source", |s, _| {
            bind(s, "etc", "/x", &["rbind"])
        }),
        // Namespaces (item 5).
        case(
            "ns-mount-path",
            "joining a mount namespace by path",
            |s, _| {
                s["linux"]["namespaces"][3] = json!({"type": "mount", "path": "/proc/1234/ns/mnt"})
            },
        ),
        case(
            "ns-user-path",
            "joining a user namespace by path",
            |s, _| {
                s["linux"]["namespaces"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"type": "user", "path": "/proc/1234/ns/user"}))
            },
        ),
        case("ns-net-any-file", "is not a namespace file", |s, h| {
            s["linux"]["namespaces"][4] = json!({"type": "network", "path": h.path(&format!("kubelet/pods/{POD_UID}/etc-hosts"))})
        }),
        case("ns-ipc-wrong-type", "is not a namespace file", |s, _| {
            s["linux"]["namespaces"][1] = json!({"type": "ipc", "path": "/proc/1234/ns/net"})
        }),
        case(
            "ns-net-other-process",
            "is not the pod sandbox's (",
            |s, _| {
                s["linux"]["namespaces"][4] =
                    json!({"type": "network", "path": "/proc/999999/ns/net"})
            },
        ),
        case(
            "ns-net-no-sandbox-id",
            "needs the pod sandbox's id",
            |s, _| {
                s["annotations"]
                    .as_object_mut()
                    .unwrap()
                    .remove("io.kubernetes.cri.sandbox-id");
                s["linux"]["namespaces"][4] =
                    json!({"type": "network", "path": "/proc/4242/ns/net"});
            },
        ),
        case(
            "ns-cni-netns-from-a-container",
            "for the pod sandbox only",
            |s, _| {
                s["linux"]["namespaces"][4] =
                    json!({"type": "network", "path": "/run/netns/cni-other-pod"})
            },
        ),
        case(
            "ns-cni-var-run-netns-from-a-container",
            "for the pod sandbox only",
            |s, _| {
                s["linux"]["namespaces"][4] =
                    json!({"type": "network", "path": "/var/run/netns/cni-other-pod"})
            },
        ),
        case("ns-pid-init", "is not a namespace file", |s, _| {
            s["linux"]["namespaces"][0] = json!({"type": "pid", "path": "/proc/1/ns/pid"})
        }),
        case("ns-host-pid-missing", "host's pid namespace", |s, _| {
            s["linux"]["namespaces"].as_array_mut().unwrap().remove(0);
        }),
        case("ns-host-net-missing", "host's network namespace", |s, _| {
            s["linux"]["namespaces"].as_array_mut().unwrap().remove(4);
        }),
        // cgroupsPath (item 6).
        case("cgroup-host-slice", "/linux/cgroupsPath", |s, _| {
            s["linux"]["cgroupsPath"] = json!("/system.slice/c1")
        }),
        case("cgroup-other-container", "/linux/cgroupsPath", |s, _| {
            s["linux"]["cgroupsPath"] = json!(format!("/kubepods/burstable/pod{POD_UID}/victim"))
        }),
        case("cgroup-lease-tree", "/linux/cgroupsPath", |s, _| {
            s["linux"]["cgroupsPath"] = json!("/tessera/l-other/c1")
        }),
        case("cgroup-root", "/linux/cgroupsPath", |s, _| {
            s["linux"]["cgroupsPath"] = json!("/")
        }),
        case("cgroup-dotdot", "/linux/cgroupsPath", |s, _| {
            s["linux"]["cgroupsPath"] = json!("/kubepods/../system.slice/c1")
        }),
        case("cgroup-systemd-host-slice", "/linux/cgroupsPath", |s, _| {
            s["linux"]["cgroupsPath"] = json!("system.slice:cri-containerd:c1")
        }),
        case("cgroup-systemd-other", "/linux/cgroupsPath", |s, _| {
            s["linux"]["cgroupsPath"] = json!("kubepods-pod.slice:cri-containerd:victim")
        }),
        case("cgroup-user-slice", "/linux/cgroupsPath", |s, _| {
            s["linux"]["cgroupsPath"] = json!("/user.slice/user-0.slice/c1")
        }),
        // Identity from runc's record, not from the spec (issue: identity and scope).
        case(
            "cgroup-other-pod",
            "is not inside its pod's cgroup",
            |s, _| {
                s["linux"]["cgroupsPath"] =
                    json!("/kubepods/burstable/pod11111111-2222-3333-4444-555555555555/c1")
            },
        ),
        case(
            "cgroup-qos-class",
            "is not inside its pod's cgroup",
            |s, _| s["linux"]["cgroupsPath"] = json!("/kubepods/burstable/c1"),
        ),
        case(
            "cgroup-in-the-sandbox",
            "is not inside its pod's cgroup",
            |s, _| {
                s["linux"]["cgroupsPath"] =
                    json!(format!("/kubepods/burstable/pod{POD_UID}/{SANDBOX}/c1"))
            },
        ),
        case("cgroup-empty-component", "not a clean path", |s, _| {
            s["linux"]["cgroupsPath"] = json!(format!("/kubepods//burstable/pod{POD_UID}/c1"))
        }),
        case("cgroup-relative", "is not absolute", |s, _| {
            s["linux"]["cgroupsPath"] = json!(format!("kubepods/burstable/pod{POD_UID}/c1"))
        }),
        case(
            "claims-another-pods-uid",
            "is not the pod of sandbox",
            |s, _| {
                s["annotations"]["io.kubernetes.cri.sandbox-uid"] =
                    json!("11111111-2222-3333-4444-555555555555")
            },
        ),
        case(
            "claims-another-namespace",
            "is not the pod of sandbox",
            |s, _| s["annotations"]["io.kubernetes.pod.namespace"] = json!("kube-system"),
        ),
        case("names-an-unknown-sandbox", "is not known", |s, _| {
            s["annotations"]["io.kubernetes.cri.sandbox-id"] = json!("no-such-sandbox")
        }),
        case(
            "sandbox-id-climbs",
            "is not another container's id",
            |s, _| s["annotations"]["io.kubernetes.cri.sandbox-id"] = json!("../runc-root"),
        ),
        case(
            "pod-claims-without-sandbox",
            "names a pod but no sandbox",
            |s, _| {
                s["annotations"]
                    .as_object_mut()
                    .unwrap()
                    .remove("io.kubernetes.cri.sandbox-id");
            },
        ),
        case(
            "claims-to-be-a-sandbox",
            "says it is a pod sandbox",
            |s, _| s["annotations"]["io.kubernetes.cri.container-type"] = json!("sandbox"),
        ),
        case(
            "bind-bundle-rw",
            "is the bundle or a directory above it",
            |s, _| bind(s, "BUNDLE/", "/b", &["rbind", "rw"]),
        ),
        case(
            "bind-bundle-parent-ro",
            "is the bundle or a directory above it",
            |s, _| bind(s, "BUNDLE/..", "/b", &["rbind", "ro"]),
        ),
        case(
            "bind-config-json-rw",
            "never bind-mounted writable",
            |s, _| bind(s, "BUNDLE/config.json", "/c", &["bind", "rw"]),
        ),
        case("bind-runc-state", "is under Tessera's own", |s, h| {
            bind(s, &h.path("runc-root"), "/r", &["rbind", "ro"])
        }),
        case("bind-other-pods-kubelet-dir", "is not under", |s, h| {
            bind(
                s,
                &h.path("kubelet/pods/other-pod-uid/volumes"),
                "/v",
                &["rbind"],
            )
        }),
        case(
            "root-another-containers-layer",
            "not this container's own rootfs",
            |s, h| s["root"]["path"] = json!(h.path("storage/overlay/def/merged")),
        ),
        case(
            "root-the-layer-store",
            "not this container's own rootfs",
            |s, h| s["root"]["path"] = json!(h.path("storage/overlay")),
        ),
        // Kernel filesystems (item 4), sysctls, devices, capabilities.
        case("mount-xfs", "mount type \"xfs\"", |s, _| {
            s["mounts"]
                .as_array_mut()
                .unwrap()
                .push(json!({"destination": "/d", "type": "xfs", "source": "/dev/sda1"}))
        }),
        case("mount-extra-sysfs", "extra sysfs", |s, _| {
            s["mounts"]
                .as_array_mut()
                .unwrap()
                .push(json!({"destination": "/host-sys", "type": "sysfs", "source": "sysfs"}))
        }),
        case("mount-extra-proc", "extra procfs", |s, _| {
            s["mounts"]
                .as_array_mut()
                .unwrap()
                .push(json!({"destination": "/p2", "type": "proc", "source": "proc"}))
        }),
        case("sysctl-kernel", "sysctl kernel.", |s, _| {
            s["linux"]["sysctl"] = json!({"kernel.modprobe": "/tmp/x"})
        }),
        case("sysctl-vm", "sysctl vm.", |s, _| {
            s["linux"]["sysctl"] = json!({"vm.overcommit_memory": "1"})
        }),
        case(
            "device-nvidia",
            "GPU device node",
            |s, _| {
                s["linux"]["devices"] =
                    json!([{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}])
            },
        ),
        case("unified-pids", "cgroup file pids.max", |s, _| {
            s["linux"]["resources"]["unified"] = json!({"pids.max": "max"})
        }),
        case(
            "unified-cgroup-procs",
            "cgroup file cgroup.procs",
            |s, _| s["linux"]["resources"]["unified"] = json!({"cgroup.procs": "1"}),
        ),
        // runc joins these names to the container's cgroup directory.
        case(
            "unified-climbs-out",
            "/linux/resources/unified/memory.~1..~1..~1victim~1memory.max: not a cgroup file name",
            |s, _| {
                s["linux"]["resources"]["unified"] = json!({"memory./../../victim/memory.max": "1"})
            },
        ),
        case(
            "hugepage-size-climbs-out",
            "/linux/resources/hugepageLimits/0/pageSize",
            |s, _| {
                s["linux"]["resources"]["hugepageLimits"] = json!([{
                    "pageSize": "2MB.limit_in_bytes/../../victim/hugetlb.2MB", "limit": 0
                }])
            },
        ),
        case("cap-sys-admin", "CAP_SYS_ADMIN", |s, _| {
            s["process"]["capabilities"]["bounding"]
                .as_array_mut()
                .unwrap()
                .push(json!("CAP_SYS_ADMIN"))
        }),
        case("cap-bpf-ambient", "CAP_BPF", |s, _| {
            s["process"]["capabilities"]["ambient"] = json!(["CAP_BPF"])
        }),
        case("cap-sys-ptrace", "CAP_SYS_PTRACE", |s, _| {
            s["process"]["capabilities"]["effective"]
                .as_array_mut()
                .unwrap()
                .push(json!("CAP_SYS_PTRACE"))
        }),
    ]
}

#[test]
fn every_hostile_case_is_refused_naming_the_field() {
    let h = Host::new();
    let cases = hostile();
    assert!(
        cases.len() >= 80,
        "the hostile corpus has {} cases",
        cases.len()
    );
    let mut failures = Vec::new();
    for (name, want, mutate) in &cases {
        let mut spec = pod_container(&h);
        mutate(&mut spec, &h);
        let (code, out) = h.check(name, &spec);
        let rs = reasons(&out);
        if code != 1 || out["admitted"] != false || !rs.iter().any(|r| r.contains(want)) {
            failures.push(format!(
                "{name}: exit {code}, want a reason with {want:?}, got {rs:?}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// What the runtime neutralizes instead of refusing: the hardened spec is safe.
#[test]
fn kernel_filesystems_and_process_flags_are_neutralized() {
    let h = Host::new();
    let mut spec = pod_container(&h);
    for m in spec["mounts"].as_array_mut().unwrap() {
        if m["type"] == "sysfs" {
            m["options"] = json!(["rw", "suid", "dev", "exec"]);
        }
    }
    spec["mounts"].as_array_mut().unwrap().push(json!({
        "destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["rw", "suid"]
    }));
    spec["process"]["noNewPrivileges"] = json!(false);
    spec["process"]["apparmorProfile"] = json!("unconfined");
    spec["linux"]["seccomp"] = json!({"defaultAction": "SCMP_ACT_ALLOW"});
    spec["linux"]["maskedPaths"] = json!([]);
    let (code, out) = h.check("neutral", &spec);
    assert_eq!(code, 0, "{:?}", reasons(&out));
    let s = &out["spec"];
    for m in s["mounts"].as_array().unwrap() {
        if m["type"] == "sysfs" || m["type"] == "cgroup" {
            let o: Vec<&str> = m["options"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap())
                .collect();
            assert!(
                o.contains(&"ro") && o.contains(&"nosuid") && !o.contains(&"rw"),
                "{m}"
            );
        }
    }
    assert_eq!(s["process"]["noNewPrivileges"], true);
    assert_eq!(s["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ERRNO");
    assert!(
        s["linux"]["maskedPaths"]
            .as_array()
            .unwrap()
            .contains(&json!("/proc/kcore"))
    );
    assert_ne!(s["process"]["apparmorProfile"], "unconfined");
    // Bind sources reach runc in canonical form.
    let hosts = s["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["destination"] == "/etc/hosts")
        .unwrap();
    let canon =
        std::fs::canonicalize(h.path(&format!("kubelet/pods/{POD_UID}/etc-hosts"))).unwrap();
    assert_eq!(hosts["source"], json!(canon));
}

/// A symlink inside an allowed prefix that points out of it: the check follows it
/// and refuses (the canonical target is not under the prefix), so no swap after the
/// check can matter: runc would get the canonical path.
#[test]
fn a_symlinked_bind_source_is_judged_by_its_target() {
    let h = Host::new();
    let link = h.path(&format!("kubelet/pods/{POD_UID}/volumes/escape"));
    std::os::unix::fs::symlink("/etc", &link).unwrap();
    let mut spec = pod_container(&h);
    bind(&mut spec, &link, "/e", &["rbind", "ro"]);
    let (code, out) = h.check("symlink", &spec);
    assert_eq!(code, 1);
    assert!(
        reasons(&out)
            .iter()
            .any(|r| r.contains("/etc is not under")),
        "{:?}",
        reasons(&out)
    );
}

/// kubelet creates each container's termination-log file 0666 (so a non-root process
/// can write its message) and bind-mounts it at /dev/termination-log: admitted, as a
/// file's content cannot swap a path component. Its directory must still be safe.
#[test]
fn kubelets_world_writable_termination_log_file_is_admitted() {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to own the directories the check requires");
        return;
    }
    let h = Host::new();
    let dir = h.path(&format!("kubelet/pods/{POD_UID}/containers/cuda"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = format!("{dir}/3f2a1b0c");
    std::fs::write(&file, "").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
    let mut spec = pod_container(&h);
    bind(
        &mut spec,
        &file,
        "/dev/termination-log",
        &["rbind", "rprivate", "rw"],
    );
    let (code, out) = h.check("termlog", &spec);
    assert_eq!(code, 0, "{:?}", reasons(&out));
    // The same file in a directory others may write to is refused.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (code, out) = h.check("termlog-open-dir", &spec);
    assert_eq!(code, 1);
    assert!(
        reasons(&out)
            .iter()
            .any(|r| r.contains("writable by others")),
        "{:?}",
        reasons(&out)
    );
}

/// A directory on the way to a bind source that others may write to (no sticky bit)
/// lets a tenant swap a component: refused.
#[test]
fn a_bind_source_below_a_writable_directory_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to own the directories the check requires");
        return;
    }
    let h = Host::new();
    let open = h.path(&format!("kubelet/pods/{POD_UID}/volumes/open"));
    std::fs::create_dir_all(format!("{open}/data")).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut spec = pod_container(&h);
    bind(&mut spec, &format!("{open}/data"), "/d", &["rbind"]);
    let (code, out) = h.check("writable", &spec);
    assert_eq!(code, 1);
    assert!(
        reasons(&out)
            .iter()
            .any(|r| r.contains("writable by others")),
        "{:?}",
        reasons(&out)
    );
}

#[test]
fn what_real_callers_send_is_admitted() {
    let h = Host::new();
    // containerd CRI: the pod's container with kubelet's and containerd's mounts.
    let (code, out) = h.check("cri-container", &pod_container(&h));
    assert_eq!(code, 0, "CRI container: {:?}", reasons(&out));
    // containerd CRI: the pod sandbox (pause).
    let mut sandbox = common::base_spec(&["/pause"]);
    sandbox["annotations"] = json!({
        "io.kubernetes.cri.container-type": "sandbox",
        "io.kubernetes.cri.sandbox-id": SANDBOX,
        "io.kubernetes.cri.sandbox-uid": POD_UID,
        "io.kubernetes.cri.sandbox-namespace": "team-a",
        "io.kubernetes.cri.sandbox-name": "app-0",
    });
    sandbox["linux"]["cgroupsPath"] = json!(format!("/kubepods/burstable/pod{POD_UID}/{SANDBOX}"));
    sandbox["process"]["oomScoreAdj"] = json!(-998);
    let (code, out) = h.check_id("cri-sandbox", &sandbox, SANDBOX);
    assert_eq!(code, 0, "CRI sandbox: {:?}", reasons(&out));
    // systemd cgroup driver form: the sandbox's record in it too.
    let slice = format!("kubepods-burstable-pod{}.slice", POD_UID.replace('-', "_"));
    let sd_path = format!("{slice}:cri-containerd:{SANDBOX}");
    common::SandboxState {
        cgroups_path: &sd_path,
        ..sandbox_state(std::process::id())
    }
    .write(&h.dir.path().join("runc-root"));
    let mut sd = pod_container(&h);
    sd["linux"]["cgroupsPath"] = json!(format!(
        "kubepods-burstable-pod{}.slice:cri-containerd:c1",
        POD_UID.replace('-', "_")
    ));
    let (code, out) = h.check("cri-systemd", &sd);
    assert_eq!(code, 0, "CRI systemd form: {:?}", reasons(&out));
    // ctr run: rootfs in the bundle, cgroup /default/<id>.
    let mut ctr = common::base_spec(&["sh"]);
    ctr["linux"]["cgroupsPath"] = json!("/default/c1");
    let (code, out) = h.check("ctr", &ctr);
    assert_eq!(code, 0, "ctr run: {:?}", reasons(&out));
    // podman 4: rootfs in its storage, sandbox files in its run root, libpod cgroup.
    let mut pod = common::base_spec(&["sh"]);
    pod["root"]["path"] = json!(h.path("storage/overlay/abc/merged"));
    pod["linux"]["cgroupsPath"] = json!("machine.slice:libpod:podctr");
    pod["annotations"] =
        json!({"io.container.manager": "libpod", "org.opencontainers.image.stopSignal": "15"});
    bind(
        &mut pod,
        &h.path("run-storage/overlay-containers/podctr/userdata/hosts"),
        "/etc/hosts",
        &["bind", "rprivate"],
    );
    let (code, out) = h.check_id("podman", &pod, "podctr");
    assert_eq!(code, 0, "podman: {:?}", reasons(&out));
    // podman with the vfs driver (where overlayfs cannot stack): vfs-containers
    // (its bundle is then vfs-containers/<id>/userdata too).
    pod["mounts"].as_array_mut().unwrap().pop();
    bind(
        &mut pod,
        &h.path("run-storage/vfs-containers/podctr/userdata/hosts"),
        "/etc/hosts2",
        &["bind", "rprivate"],
    );
    let (code, out) = h.check_id("podman-vfs", &pod, "podctr");
    assert_eq!(code, 0, "podman vfs: {:?}", reasons(&out));
    // Another container's userdata stays refused.
    let (code, out) = h.check_id("podman-other", &pod, "otherctr");
    assert_eq!(code, 1);
    assert!(
        reasons(&out)
            .iter()
            .any(|r| r.contains("vfs-containers/podctr/userdata/hosts is not under")),
        "{:?}",
        reasons(&out)
    );
}

/// A CRI container joins its pod sandbox's network, IPC and UTS namespaces by
/// `/proc/<sandbox init pid>/ns/...`: admitted when runc's record of the sandbox
/// names that pid, refused for any other process.
#[test]
fn a_container_joins_only_its_own_sandboxs_namespaces() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to make namespaces with unshare");
        return;
    }
    let Some(unshare) = ["/usr/bin/unshare", "/bin/unshare"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
    else {
        eprintln!("SKIPPED: unshare (util-linux) is not installed");
        return;
    };
    let h = Host::new();
    let mut sandbox = Command::new(unshare)
        .args(["--net", "--ipc", "--uts", "sleep", "60"])
        .spawn()
        .unwrap();
    let pid = sandbox.id();
    // Wait until the process has left the host's namespaces.
    let host_net = std::fs::read_link("/proc/self/ns/net").unwrap();
    for _ in 0..100 {
        if std::fs::read_link(format!("/proc/{pid}/ns/net")).is_ok_and(|n| n != host_net) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    sandbox_state(pid).write(&h.dir.path().join("runc-root"));
    let mut spec = pod_container(&h);
    spec["linux"]["namespaces"] = json!([
        {"type": "pid"}, {"type": "mount"},
        {"type": "ipc", "path": format!("/proc/{pid}/ns/ipc")},
        {"type": "uts", "path": format!("/proc/{pid}/ns/uts")},
        {"type": "network", "path": format!("/proc/{pid}/ns/net")},
    ]);
    let (code, out) = h.check("joins-sandbox", &spec);
    let other = std::process::id();
    spec["linux"]["namespaces"][4] =
        json!({"type": "network", "path": format!("/proc/{other}/ns/net")});
    let (code2, out2) = h.check("joins-other", &spec);
    let _ = sandbox.kill();
    let _ = sandbox.wait();
    assert_eq!(code, 0, "{:?}", reasons(&out));
    assert_eq!(code2, 1);
    assert!(
        reasons(&out2)
            .iter()
            .any(|r| r.contains("is not the pod sandbox's")),
        "{:?}",
        reasons(&out2)
    );
}

/// containerd's sandbox files of a pod (red team 2, finding 5): only for a container
/// whose bundle is containerd's task directory of its own id under the CRI's runc
/// root's namespace. The same spec from a bundle anywhere else, or from another id's
/// task directory, gets none of them.
#[test]
fn cri_sandbox_files_only_from_containerds_task_directory() {
    let h = Host::new();
    let spec = pod_container(&h);
    let (code, out) = h.check("own-task-dir", &spec);
    assert_eq!(code, 0, "{:?}", reasons(&out));
    let d = h.dir.path();
    for bundle in [
        d.join("bundles/elsewhere"),
        d.join("run-containerd/io.containerd.runtime.v2.task/runc-root/c2"),
        d.join("run-containerd/io.containerd.runtime.v2.task/other-ns/c1"),
    ] {
        std::fs::create_dir_all(bundle.join("rootfs/etc")).unwrap();
        common::write_spec(&bundle, &spec);
        let out = Command::new(common::runtime_bin())
            .env("TESSERA_RUNTIME_CONFIG", &h.config)
            .arg("--root")
            .arg(d.join("runc-root"))
            .args(["check", "--json", "--id", "c1", "--bundle"])
            .arg(&bundle)
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let r = reasons(&v).join("\n");
        assert!(!out.status.success(), "{}: admitted", bundle.display());
        assert!(
            r.contains(&format!("sandboxes/{SANDBOX}/hostname is not under")),
            "{}: {r}",
            bundle.display()
        );
    }
}
