//! Golden tests (input spec + lease -> hardened spec) and one test per refusal reason.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use tessera_runtime::config::RuntimeConfig;
use tessera_runtime::harden::{self, Context, Decision, seccomp::Profile};
use tessera_runtime::host::HostFacts;
use tessera_runtime::lease::ResolvedLease;

struct Fixture {
    dir: tempfile::TempDir,
    bundle: PathBuf,
    cfg: RuntimeConfig,
    profile: Profile,
    host: HostFacts,
    lease: Option<ResolvedLease>,
}

impl Fixture {
    /// A bundle with a rootfs dir, a fake driver /proc, and (as root) a lease on nvidia0.
    fn new(with_lease: bool) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("bundle");
        std::fs::create_dir_all(bundle.join("rootfs")).unwrap();
        let proc_root = common::fake_nvidia_proc(dir.path());
        let mut cfg = RuntimeConfig::parse(
            "[policy]\napparmor = \"if-available\"\n",
            Path::new("test.toml"),
        )
        .unwrap();
        cfg.nvidia_proc_root = proc_root.clone();
        // Its runc root stands for the CRI's (containerd's k8s.io).
        cfg.policy.cri_runc_roots = vec![dir.path().join("runc-root")];
        // The host's own NVIDIA CDI spec (if any) must not change the answers.
        cfg.nvidia_cdi_specs = Some(Vec::new());
        let lease = if with_lease {
            if !nix::unistd::geteuid().is_root() {
                // Written past the test harness's capture, so CI logs show the skip.
                let _ = std::io::Write::write_fmt(
                    &mut std::io::stderr(),
                    format_args!("SKIPPED: lease fixtures need mknod (root)\n"),
                );
                return None;
            }
            let dev = common::gpu_dev_dir(dir.path());
            let answer = common::lease_answer(
                "lease-1",
                "acme",
                &[
                    (&dev.join("nvidia0"), "/dev/nvidia0", 195, 0),
                    (&dev.join("nvidiactl"), "/dev/nvidiactl", 195, 255),
                ],
                Some(Path::new("/run/tessera/mps/lease-1")),
                "/tessera/lease-1",
            );
            Some(ResolvedLease::from_proto(answer, tessera_runtime::lease::now_ms()).unwrap())
        } else {
            None
        };
        Some(Self {
            bundle,
            cfg,
            profile: Profile::load(None).unwrap(),
            // Deterministic goldens: behave as on a host without AppArmor.
            host: HostFacts::gather(&proc_root).with_apparmor(Default::default()),
            lease,
            dir,
        })
    }

    fn harden(&self, spec: Value) -> Decision {
        self.harden_with(spec, false)
    }

    fn runc_root(&self) -> PathBuf {
        self.dir.path().join("runc-root")
    }

    /// runc's record of a running pod sandbox `id` (this test process stands for its
    /// init) of pod `uid` in `namespace`, its cgroup `cgroups_path`.
    fn sandbox(&self, id: &str, uid: &str, namespace: &str, cgroups_path: &str) {
        common::SandboxState {
            id,
            pod_uid: uid,
            namespace,
            name: "app-0",
            pid: std::process::id(),
            cgroups_path,
        }
        .write(&self.runc_root());
    }

    /// Harden as `runc --systemd-cgroup` (or not) would be asked to.
    fn harden_with(&self, spec: Value, systemd_cgroup: bool) -> Decision {
        let ctx = Context {
            config: &self.cfg,
            seccomp: &self.profile,
            host: &self.host,
            lease: self.lease.as_ref(),
            container_id: "c1",
            systemd_cgroup,
            bundle: &self.bundle,
            runc_root: &self.runc_root(),
        };
        harden::harden(spec, &ctx)
    }
}

fn golden(name: &str, mut spec: Value) {
    // The seccomp profile is checked by its own tests; keep the golden readable.
    spec["linux"].as_object_mut().unwrap().remove("seccomp");
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let text = serde_json::to_string_pretty(&spec).unwrap() + "\n";
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        text,
        want,
        "hardened spec differs from {} (BLESS=1 to update)",
        path.display()
    );
}

#[test]
fn golden_lease_spec() {
    let Some(fx) = Fixture::new(true) else { return };
    fx.sandbox("sb1", "0f1e", "acme", "/kubepods/pod0f1e/sb1");
    let mut spec = common::base_spec(&["sh"]);
    spec["annotations"] = json!({"tessera.io/lease-token": "tok",
        "io.kubernetes.cri.sandbox-id": "sb1", "io.kubernetes.cri.sandbox-namespace": "acme"});
    spec["process"]["env"] = json!([
        "PATH=/bin",
        "TESSERA_LEASE_TOKEN=tok",
        "CUDA_VISIBLE_DEVICES=all"
    ]);
    let d = fx.harden(spec);
    assert!(d.admitted, "{:?}", d.reasons);
    let s = &d.spec;
    // The essentials, spelled out (the golden file pins the rest).
    assert_eq!(s["process"]["noNewPrivileges"], true);
    // The profile is written into config.json, and the spec read whole has it.
    let written: Value = serde_json::from_slice(&d.config_json().unwrap()).unwrap();
    assert_eq!(written["linux"]["seccomp"], fx.profile.oci().unwrap());
    assert_eq!(written, d.full_spec());
    assert_eq!(
        s["linux"]["seccomp"],
        tessera_runtime::harden::seccomp::BUILTIN_PLACEHOLDER
    );
    assert_eq!(
        s["linux"]["devices"],
        json!([
            {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 438, "uid": 0, "gid": 0},
            {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "fileMode": 438, "uid": 0, "gid": 0}
        ])
    );
    assert_eq!(
        s["linux"]["resources"]["devices"],
        json!([
            {"allow": false, "access": "rwm"},
            {"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rw"},
            {"allow": true, "type": "c", "major": 195, "minor": 255, "access": "rw"}
        ])
    );
    let env = s["process"]["env"].as_array().unwrap();
    assert!(env.contains(&json!(
        "CUDA_VISIBLE_DEVICES=GPU-00000000-1111-2222-3333-444444444444"
    )));
    assert!(
        !env.iter()
            .any(|e| e.as_str().unwrap().starts_with("TESSERA_LEASE_TOKEN"))
    );
    assert!(s["annotations"].get("tessera.io/lease-token").is_none());
    assert_eq!(s["annotations"]["tessera.io/lease-id"], "lease-1");
    let masked = s["linux"]["maskedPaths"].as_array().unwrap();
    for m in [
        "/proc/driver/nvidia/gpus/0000:5e:00.0",
        "/proc/driver/nvidia/capabilities/mig/config",
        "/proc/driver/nvidia/capabilities/mig/monitor",
        "/proc/driver/nvidia/capabilities/gpu0/mig/gi2/access",
        "/proc/driver/nvidia/capabilities/gpu1/mig/gi1/access",
    ] {
        assert!(masked.contains(&json!(m)), "{m} not masked");
    }
    for m in [
        "/proc/driver/nvidia/gpus/0000:3b:00.0",
        "/proc/driver/nvidia/capabilities/gpu0/mig/gi1/access",
    ] {
        assert!(!masked.contains(&json!(m)), "{m} masked but leased");
    }
    let mps = s["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["destination"] == "/run/nvidia-mps")
        .unwrap();
    for o in ["nosuid", "nodev", "noexec"] {
        assert!(mps["options"].as_array().unwrap().contains(&json!(o)));
    }
    assert_eq!(s["linux"]["cgroupsPath"], "/tessera/lease-1/c1");
    assert_eq!(s["linux"]["resources"]["pids"]["limit"], 256);
    golden("lease-hardened.json", d.spec);
}

#[test]
fn golden_baseline_spec() {
    let fx = Fixture::new(false).unwrap();
    let d = fx.harden(common::base_spec(&["sh"]));
    assert!(d.admitted, "{:?}", d.reasons);
    assert_eq!(d.spec["linux"]["devices"], json!([]));
    assert_eq!(
        d.spec["linux"]["resources"]["devices"],
        json!([{"allow": false, "access": "rwm"}])
    );
    assert!(
        d.spec["linux"]["maskedPaths"]
            .as_array()
            .unwrap()
            .contains(&json!("/proc/driver/nvidia"))
    );
    assert_eq!(
        d.spec["process"]["capabilities"]["bounding"],
        json!([
            "CAP_CHOWN",
            "CAP_DAC_OVERRIDE",
            "CAP_FSETID",
            "CAP_FOWNER",
            "CAP_SETGID",
            "CAP_SETUID",
            "CAP_NET_BIND_SERVICE",
            "CAP_KILL",
            "CAP_AUDIT_WRITE"
        ])
    );
    assert!(d.notes.iter().any(|n| n.contains("CAP_MKNOD")));
    assert!(d.notes.iter().any(|n| n.contains("no AppArmor LSM")));
    golden("baseline-hardened.json", d.spec);
}

/// (what the test changes, the change, a piece of the expected reason)
type Case = (&'static str, fn(&mut Value, &Path), &'static str);

fn refusal_cases() -> Vec<Case> {
    vec![
        (
            "wrong type",
            |s, _| s["process"]["env"] = json!("PATH=/bin"),
            "/process/env has the wrong JSON type",
        ),
        (
            "two tokens",
            |s, _| {
                s["annotations"] = json!({"tessera.io/lease-token": "a"});
                s["process"]["env"] = json!(["TESSERA_LEASE_TOKEN=b"]);
            },
            "name different tokens",
        ),
        (
            "two env tokens",
            |s, _| s["process"]["env"] = json!(["TESSERA_LEASE_TOKEN=a", "TESSERA_LEASE_TOKEN=b"]),
            "different tokens",
        ),
        (
            "empty token",
            |s, _| s["annotations"] = json!({"tessera.io/lease-token": " "}),
            "token is empty",
        ),
        (
            "hook",
            |s, _| s["hooks"] = json!({"createContainer": [{"path": "/usr/bin/nvidia-ctk", "env": ["LD_PRELOAD=/x.so"]}]}),
            "OCI hooks are not allowed in a tenant spec: createContainer (/usr/bin/nvidia-ctk)",
        ),
        (
            "no root",
            |s, _| {
                s.as_object_mut().unwrap().remove("root");
            },
            "no root.path",
        ),
        (
            "host root",
            |s, _| s["root"]["path"] = json!("/"),
            "host's /",
        ),
        (
            "symlinked rootfs",
            |s, b| {
                std::os::unix::fs::symlink("/", b.join("evil")).unwrap();
                s["root"]["path"] = json!("evil");
            },
            "is a symlink",
        ),
        (
            "host pid",
            |s, _| {
                s["linux"]["namespaces"] = json!([{"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}])
            },
            "shares the host's pid namespace",
        ),
        (
            "host ipc by path",
            |s, _| {
                s["linux"]["namespaces"][1] = json!({"type": "ipc", "path": "/proc/self/ns/ipc"})
            },
            "joins the host's ipc namespace",
        ),
        (
            "host network",
            |s, _| {
                s["linux"]["namespaces"] =
                    json!([{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}])
            },
            "host's network namespace",
        ),
        (
            "bad ns path",
            |s, _| s["linux"]["namespaces"][0] = json!({"type": "pid", "path": "/nonexistent/ns"}),
            "cannot check the pid namespace path",
        ),
        (
            "unknown ns",
            |s, _| s["linux"]["namespaces"][0] = json!({"type": "weird"}),
            "unknown namespace type",
        ),
        (
            "sysctl",
            |s, _| s["linux"]["sysctl"] = json!({"kernel.core_pattern": "|/x"}),
            "sysctl kernel.core_pattern is not in the safe list",
        ),
        (
            "sys_admin",
            |s, _| s["process"]["capabilities"]["bounding"] = json!(["CAP_SYS_ADMIN"]),
            "forbidden capability CAP_SYS_ADMIN",
        ),
        (
            "ptrace",
            |s, _| s["process"]["capabilities"]["effective"] = json!(["SYS_PTRACE"]),
            "forbidden capability CAP_SYS_PTRACE",
        ),
        (
            "bpf",
            |s, _| s["process"]["capabilities"]["permitted"] = json!(["CAP_BPF", "CAP_PERFMON"]),
            "CAP_PERFMON",
        ),
        (
            "selinux",
            |s, _| s["process"]["selinuxLabel"] = json!("system_u:system_r:spc_t:s0"),
            "forbidden type spc_t",
        ),
        (
            "dev bind",
            |s, _| s["mounts"] = json!([{"destination": "/host-dev", "type": "bind", "source": "/dev", "options": ["rbind"]}]),
            "sensitive host path /dev",
        ),
        (
            "proc bind",
            |s, _| {
                s["mounts"] =
                    json!([{"destination": "/p", "source": "/proc/1/root", "options": ["bind"]}])
            },
            "under /proc",
        ),
        (
            "root bind",
            |s, _| s["mounts"] = json!([{"destination": "/host", "type": "bind", "source": "/", "options": ["rbind"]}]),
            "sensitive host path /",
        ),
        (
            "socket dir",
            |s, _| s["mounts"] = json!([{"destination": "/r", "type": "bind", "source": "/run/containerd/", "options": ["rbind"]}]),
            "exposes /run/containerd/containerd.sock",
        ),
        (
            "tessera state",
            |s, _| s["mounts"] = json!([{"destination": "/t", "type": "bind", "source": "/var/lib/tessera/x", "options": ["rbind"]}]),
            "under /var/lib/tessera",
        ),
        (
            "dotdot bind",
            |s, _| s["mounts"] = json!([{"destination": "/t", "type": "bind", "source": "/tmp/../proc", "options": ["rbind"]}]),
            "under /proc",
        ),
        (
            "gpu bind",
            |s, _| s["mounts"] = json!([{"destination": "/dev/nvidia1", "type": "bind", "source": "/dev/nvidia1", "options": ["bind"]}]),
            "GPU device path /dev/nvidia1",
        ),
        (
            "relative bind",
            |s, _| s["mounts"] = json!([{"destination": "/t", "type": "bind", "source": "data", "options": ["bind"]}]),
            "relative source",
        ),
        (
            "block mount",
            |s, _| {
                s["mounts"] =
                    json!([{"destination": "/mnt", "type": "ext4", "source": "/dev/sda1"}])
            },
            "mount type \"ext4\"",
        ),
        (
            "second proc",
            |s, _| {
                s["mounts"] =
                    json!([{"destination": "/hostproc", "type": "proc", "source": "proc"}])
            },
            "extra procfs",
        ),
        (
            "second sysfs",
            |s, _| s["mounts"] = json!([{"destination": "/s", "type": "sysfs", "source": "sysfs"}]),
            "extra sysfs",
        ),
        (
            "no destination",
            |s, _| s["mounts"] = json!([{"type": "tmpfs", "source": "tmpfs"}]),
            "has no destination",
        ),
        (
            "gpu node",
            |s, _| {
                s["linux"]["devices"] =
                    json!([{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}])
            },
            "GPU device node /dev/nvidia1 (195:1)",
        ),
        (
            "renamed gpu node",
            |s, _| {
                s["linux"]["devices"] =
                    json!([{"path": "/dev/innocent", "type": "c", "major": 195, "minor": 3}])
            },
            "GPU device node /dev/innocent",
        ),
        (
            "other node",
            |s, _| {
                s["linux"]["devices"] =
                    json!([{"path": "/dev/sda", "type": "b", "major": 8, "minor": 0}])
            },
            "device node /dev/sda (8:0)",
        ),
        (
            "allow all",
            |s, _| s["linux"]["resources"]["devices"] = json!([{"allow": true, "access": "rwm"}]),
            "allows every device",
        ),
        (
            "gpu rule",
            |s, _| {
                s["linux"]["resources"]["devices"] =
                    json!([{"allow": true, "type": "c", "major": 195, "minor": 1, "access": "rw"}])
            },
            "allows GPU devices",
        ),
        (
            "gpu wildcard",
            |s, _| {
                s["linux"]["resources"]["devices"] =
                    json!([{"allow": true, "type": "c", "major": 195, "access": "rw"}])
            },
            "allows GPU devices",
        ),
        (
            "other rule",
            |s, _| {
                s["linux"]["resources"]["devices"] =
                    json!([{"allow": true, "type": "b", "major": 8, "minor": 0, "access": "rw"}])
            },
            "outside the lease",
        ),
        (
            "bad rule",
            |s, _| s["linux"]["resources"]["devices"] = json!([{"type": "c", "major": 1}]),
            "no boolean allow",
        ),
        (
            "unified",
            |s, _| s["linux"]["resources"]["unified"] = json!({"pids.max": "max"}),
            "cgroup file pids.max",
        ),
        (
            "cgroup escape",
            |s, _| s["linux"]["cgroupsPath"] = json!("/../../system.slice/x"),
            "climbs out",
        ),
    ]
}

#[test]
fn every_refusal_reason() {
    for (what, change, want) in refusal_cases() {
        let fx = Fixture::new(false).unwrap();
        let mut spec = common::base_spec(&["sh"]);
        change(&mut spec, &fx.bundle);
        let d = fx.harden(spec);
        assert!(!d.admitted, "{what}: admitted");
        assert!(
            d.reasons.iter().any(|r| r.contains(want)),
            "{what}: no reason containing {want:?} in {:?}",
            d.reasons
        );
    }
}

/// A device the host's driver registered under a dynamic major (nvidia-uvm, nvidia-caps)
/// is a GPU device too, whether asked for as a node or by a cgroup rule: the majors come
/// from the host (/proc/devices), read when a spec has such entries.
#[test]
fn the_hosts_own_gpu_majors_are_refused_as_gpu_devices() {
    let mut fx = Fixture::new(false).unwrap();
    fx.host = fx.host.clone().with_gpu_majors(vec![508]);
    let mut rule = common::base_spec(&["sh"]);
    rule["linux"]["resources"]["devices"] =
        json!([{"allow": true, "type": "c", "major": 508, "minor": 0, "access": "rw"}]);
    let mut node = common::base_spec(&["sh"]);
    node["linux"]["devices"] =
        json!([{"path": "/dev/uvm-renamed", "type": "c", "major": 508, "minor": 0}]);
    for (what, spec, want) in [
        ("rule", rule, "allows GPU devices"),
        ("node", node, "GPU device node /dev/uvm-renamed (508:0)"),
    ] {
        let d = fx.harden(spec.clone());
        assert!(
            d.reasons.iter().any(|r| r.contains(want)),
            "{what}: {:?}",
            d.reasons
        );
        // Without the driver's major on the host it is just a device outside the lease.
        let mut fx2 = Fixture::new(false).unwrap();
        fx2.host = HostFacts::gather(Path::new("/nonexistent")).with_gpu_majors(Vec::new());
        let d = fx2.harden(spec);
        assert!(!d.admitted, "{what}");
        assert!(
            !d.reasons.iter().any(|r| r.contains("GPU device")),
            "{what}: {:?}",
            d.reasons
        );
    }
}

#[test]
fn apparmor_required_without_lsm_refuses() {
    let mut fx = Fixture::new(false).unwrap();
    fx.cfg.policy.apparmor = tessera_runtime::policy::AppArmorMode::Required;
    fx.host.apparmor = Default::default();
    let d = fx.harden(common::base_spec(&["sh"]));
    assert!(
        d.reasons.iter().any(|r| r.contains("requires AppArmor")),
        "{:?}",
        d.reasons
    );
    fx.host.apparmor = harden::apparmor::AppArmorHost {
        enabled: true,
        loaded: Some(vec!["tessera-tenant".into()]),
    };
    let mut spec = common::base_spec(&["sh"]);
    spec["process"]["apparmorProfile"] = json!("unconfined");
    let d = fx.harden(spec);
    assert!(d.admitted, "{:?}", d.reasons);
    assert_eq!(d.spec["process"]["apparmorProfile"], "tessera-tenant");
}

#[test]
fn user_namespace_policy_and_host_network_policy() {
    let mut fx = Fixture::new(false).unwrap();
    fx.cfg.policy.require_user_namespace = true;
    let d = fx.harden(common::base_spec(&["sh"]));
    assert!(
        d.reasons
            .iter()
            .any(|r| r.contains("requires a user namespace"))
    );
    let mut fx = Fixture::new(false).unwrap();
    fx.cfg.policy.allow_host_network = true;
    let mut spec = common::base_spec(&["sh"]);
    spec["linux"]["namespaces"] =
        json!([{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}]);
    assert!(fx.harden(spec).admitted);
}

#[test]
fn lease_refusals() {
    let Some(mut fx) = Fixture::new(true) else {
        return;
    };
    // Tenant bound to namespaces.
    fx.cfg
        .tenant_namespaces
        .insert("acme".into(), vec!["acme-prod".into()]);
    fx.sandbox(
        "sb-other",
        "u-other",
        "other",
        "/kubepods/podu-other/sb-other",
    );
    fx.sandbox(
        "sb-prod",
        "u-prod",
        "acme-prod",
        "/kubepods/podu-prod/sb-prod",
    );
    let mut spec = common::base_spec(&["sh"]);
    spec["annotations"] = json!({"io.kubernetes.cri.sandbox-id": "sb-other"});
    let d = fx.harden(spec.clone());
    assert!(
        d.reasons
            .iter()
            .any(|r| r.contains("tenant acme which may not run in namespace other")),
        "{:?}",
        d.reasons
    );
    spec["annotations"] = json!({});
    assert!(
        fx.harden(spec.clone())
            .reasons
            .iter()
            .any(|r| r.contains("io.kubernetes.cri.sandbox-namespace"))
    );
    spec["annotations"] = json!({"io.kubernetes.cri.sandbox-id": "sb-prod"});
    assert!(fx.harden(spec.clone()).admitted);
    // The namespace is the sandbox's, whatever the spec claims.
    spec["annotations"] = json!({"io.kubernetes.cri.sandbox-id": "sb-other",
        "io.kubernetes.cri.sandbox-namespace": "acme-prod"});
    let d = fx.harden(spec.clone());
    assert!(
        d.reasons
            .iter()
            .any(|r| r.contains("\"acme-prod\" is not the pod of sandbox sb-other")),
        "{:?}",
        d.reasons
    );
    fx.cfg.tenant_namespaces.clear();

    let base = fx.lease.clone().unwrap();
    type LeaseChange = fn(&mut ResolvedLease, &Path);
    let cases: Vec<(LeaseChange, &str)> = vec![
        (
            |l, _| l.granted_capabilities.push("mig/config".into()),
            "mig/config capability",
        ),
        (
            |l, _| l.devices[0].host_path = "/nonexistent/nvidia0".into(),
            "missing on the host",
        ),
        (|l, _| l.devices[0].minor = 1, "is not the node c 195:1"),
        (
            |l, d| {
                l.devices[0].container_path = "/dev/nvidia-caps/nvidia-cap1".into();
                l.devices[0].host_path = d.join("dev/nvidia0");
            },
            "MIG config/monitor capability",
        ),
        (
            |l, _| l.mounts[0].source = "/tmp/nvidia-mps".into(),
            "shared or sensitive",
        ),
        (
            |l, _| l.mounts[0].source = "/dev/shm".into(),
            "shared or sensitive",
        ),
        (|l, _| l.cgroup_parent = String::new(), "no cgroup parent"),
        (|l, _| l.cgroup_parent = "/".into(), "root cgroup"),
    ];
    for (change, want) in cases {
        let mut l = base.clone();
        change(&mut l, fx.dir.path());
        fx.lease = Some(l);
        let d = fx.harden(common::base_spec(&["sh"]));
        assert!(
            d.reasons.iter().any(|r| r.contains(want)),
            "{want}: {:?}",
            d.reasons
        );
    }
    // A missing driver library refuses unless optional.
    fx.lease = Some(base);
    fx.cfg.driver_libraries = vec![tessera_runtime::config::DriverLibrary {
        source: "/nonexistent/libcuda.so.1".into(),
        destination: None,
        optional: false,
    }];
    assert!(
        fx.harden(common::base_spec(&["sh"]))
            .reasons
            .iter()
            .any(|r| r.contains("libcuda.so.1 is missing"))
    );
    fx.cfg.driver_libraries[0].optional = true;
    assert!(fx.harden(common::base_spec(&["sh"])).admitted);
    fx.cfg.driver_libraries[0].source = fx.bundle.join("config-lib.so");
    std::fs::write(&fx.cfg.driver_libraries[0].source, b"").unwrap();
    let d = fx.harden(common::base_spec(&["sh"]));
    let lib = d.spec["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["source"].as_str().unwrap().ends_with("config-lib.so"))
        .unwrap();
    assert_eq!(lib["options"], json!(["bind", "ro", "nosuid", "nodev"]));
}

#[test]
fn the_driver_files_come_from_the_nvidia_cdi_spec_when_there_is_one() {
    let Some(mut fx) = Fixture::new(true) else {
        return;
    };
    let lib = fx.bundle.join("libcuda.so.550.54.15");
    std::fs::write(&lib, b"").unwrap();
    fx.cfg.driver_libraries = vec![tessera_runtime::config::DriverLibrary {
        source: "/nonexistent/from-config.so".into(),
        destination: None,
        optional: false,
    }];
    let spec_path = fx.bundle.join("nvidia.yaml");
    std::fs::write(
        &spec_path,
        format!(
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: all\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\ncontainerEdits:\n  mounts:\n  - hostPath: {}\n    containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n    options: [ro, nosuid, nodev, bind]\n  hooks:\n  - hookName: createContainer\n    path: /usr/bin/nvidia-ctk\n",
            lib.display()
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&spec_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    fx.cfg.nvidia_cdi_specs = Some(vec![fx.bundle.join("absent.yaml"), spec_path.clone()]);
    let d = fx.harden(common::base_spec(&["sh"]));
    assert!(d.admitted, "{:?}", d.reasons);
    let mounts = d.spec["mounts"].as_array().unwrap();
    let m = mounts
        .iter()
        .find(|m| m["destination"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15")
        .expect("the spec's library is mounted");
    assert_eq!(m["source"], json!(lib.to_string_lossy()));
    assert_eq!(m["options"], json!(["bind", "ro", "nosuid", "nodev"]));
    // The configured list is not used, and the spec's hook never runs.
    assert!(
        !mounts
            .iter()
            .any(|m| m["source"] == "/nonexistent/from-config.so")
    );
    assert!(d.spec.pointer("/hooks/createContainer").is_none());
    // A spec others may write refuses the container (fail closed).
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&spec_path, std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let d = fx.harden(common::base_spec(&["sh"]));
    assert!(
        d.reasons.iter().any(|r| r.contains("not trusted")),
        "{:?}",
        d.reasons
    );
}

/// A GPU container stays in the cgroup its caller gave (kubelet's pod cgroup, with
/// the cgroupfs or the systemd driver), so pod limits, QoS, eviction and CRI stats
/// see it; only a spec without one goes to the lease's tree.
#[test]
fn a_lease_container_stays_in_its_callers_cgroup() {
    let Some(fx) = Fixture::new(true) else { return };
    fx.sandbox("sb", "0f1e", "team-a", "/kubepods/burstable/pod0f1e/sb");
    fx.sandbox(
        "sbsd",
        "0f1e",
        "team-a",
        "kubepods-burstable-pod0f1e.slice:cri-containerd:sbsd",
    );
    let in_pod = |p: &str, sandbox: &str| {
        let mut s = common::base_spec(&["sh"]);
        s["annotations"] = json!({"io.kubernetes.cri.sandbox-id": sandbox});
        s["linux"]["cgroupsPath"] = json!(p);
        s
    };
    let with_path = |p: &str| in_pod(p, "sb");
    // cgroupfs driver: inside the pod's cgroup, kept as given.
    let d = fx.harden(with_path("/kubepods/burstable/pod0f1e/c1"));
    assert!(d.admitted, "{:?}", d.reasons);
    assert_eq!(
        d.spec["linux"]["cgroupsPath"],
        "/kubepods/burstable/pod0f1e/c1"
    );
    // systemd driver (kubeadm's default), with runc --systemd-cgroup: kept as given.
    let sd = "kubepods-burstable-pod0f1e.slice:cri-containerd:c1";
    let d = fx.harden_with(in_pod(sd, "sbsd"), true);
    assert!(d.admitted, "{:?}", d.reasons);
    assert_eq!(d.spec["linux"]["cgroupsPath"], sd);
    // No cgroup named: the lease's tree, or its slice under systemd.
    let d = fx.harden_with(common::base_spec(&["sh"]), true);
    assert!(d.admitted, "{:?}", d.reasons);
    assert_eq!(d.spec["linux"]["cgroupsPath"], "tessera.slice:tessera:c1");
    let d = fx.harden(common::base_spec(&["sh"]));
    assert_eq!(d.spec["linux"]["cgroupsPath"], "/tessera/lease-1/c1");
    // The driver and the path's form must agree, and the cgroup must be this
    // container's own.
    for (path, systemd, want) in [
        (sd, false, "not given --systemd-cgroup"),
        ("/kubepods/burstable/pod0f1e/c1", true, "slice:prefix:name"),
        (
            "/kubepods/burstable/pod0f1e/victim",
            false,
            "must end in this container's id",
        ),
        ("/system.slice/c1", false, "not inside its pod's cgroup"),
        (
            "system.slice:cri-containerd:c1",
            true,
            "not inside its pod's cgroup",
        ),
        ("/tessera/l-other/c1", false, "lease tree"),
        // The sandbox's own cgroup, and the pod's cgroup itself, are not the
        // container's.
        ("/kubepods/burstable/pod0f1e/sb/c1", false, "not inside"),
        ("/kubepods/burstable/pod0f1e-c1", false, "not inside"),
        // Another pod's cgroup, and the QoS class above the pod.
        ("/kubepods/burstable/pod0f1f/c1", false, "not inside"),
        ("/kubepods/burstable/c1", false, "not inside"),
        // Host slices that systemd nests under system.slice, user.slice and
        // machine.slice.
        ("system-x.slice:cri-containerd:c1", true, "not inside"),
        ("user-0.slice:cri-containerd:c1", true, "not inside"),
        ("machine-x.slice:cri-containerd:c1", true, "not inside"),
        (
            "kubepods-burstable-pod0f1e.slice:cri:c1.slice",
            true,
            "name a scope",
        ),
        ("/kubepods//burstable/pod0f1e/c1", false, "not a clean path"),
        ("kubepods/burstable/pod0f1e/c1", false, "is not absolute"),
    ] {
        let d = fx.harden_with(with_path(path), systemd);
        assert!(!d.admitted, "{path} admitted");
        assert!(
            d.reasons.iter().any(|r| r.contains(want)),
            "{path}: want {want:?} in {:?}",
            d.reasons
        );
    }
}

/// A lease bound to a pod serves that pod only: its containers by runc's record of
/// their sandbox, never a container of another pod or of none.
#[test]
fn a_lease_bound_to_a_pod_serves_only_that_pod() {
    let Some(mut fx) = Fixture::new(true) else {
        return;
    };
    fx.sandbox("sb-own", "u-own", "team", "/kubepods/podu-own/sb-own");
    fx.sandbox("sb-else", "u-else", "team", "/kubepods/podu-else/sb-else");
    fx.lease.as_mut().unwrap().pod = "u-own".into();
    let in_pod = |sandbox: Option<&str>| {
        let mut s = common::base_spec(&["sh"]);
        if let Some(sb) = sandbox {
            s["annotations"] = json!({"io.kubernetes.cri.sandbox-id": sb});
        }
        s
    };
    let d = fx.harden(in_pod(Some("sb-own")));
    assert!(d.admitted, "{:?}", d.reasons);
    // The pod reported to the daemon is the record's.
    assert_eq!(
        d.spec["annotations"]["io.kubernetes.cri.sandbox-uid"],
        "u-own"
    );
    for (spec, want) in [
        (in_pod(Some("sb-else")), "pod u-else may not use it"),
        (in_pod(None), "a container in no pod may not use it"),
    ] {
        let d = fx.harden(spec);
        assert!(
            d.reasons.iter().any(|r| r.contains(want)),
            "want {want:?}: {:?}",
            d.reasons
        );
    }
}

/// `podman run --device tessera.io/lease=<id>` (or containerd with CDI on) puts the
/// lease's CDI spec into config.json before the runtime sees it: the lease's own
/// nodes, device rules and mounts are accepted (and written again by the runtime);
/// any other GPU node or rule still refuses.
#[test]
fn nodes_rules_and_mounts_a_leases_cdi_spec_injects_are_accepted_others_refused() {
    let Some(mut fx) = Fixture::new(true) else {
        return;
    };
    // The lease's MPS directory exists on a real host (the allowlist checks sources).
    let pipe = fx.dir.path().join("mps-pipe");
    std::fs::create_dir_all(&pipe).unwrap();
    let lease = fx.lease.as_mut().unwrap();
    lease.mounts[0].source = pipe.to_string_lossy().into_owned();
    let mps = lease.mounts[0].clone();
    let mut spec = common::base_spec(&["sh"]);
    spec["linux"]["devices"] = json!([
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 438, "uid": 0, "gid": 0},
        {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "fileMode": 438, "uid": 0, "gid": 0},
    ]);
    spec["linux"]["resources"]["devices"] = json!([
        {"allow": false, "access": "rwm"},
        {"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rwm"},
        {"allow": true, "type": "c", "major": 195, "minor": 255, "access": "rw"},
    ]);
    spec["mounts"]
        .as_array_mut()
        .unwrap()
        .push(json!({"destination": mps.destination, "type": "bind", "source": mps.source, "options": ["rbind", "rw"]}));
    let d = fx.harden(spec.clone());
    assert!(d.admitted, "{:?}", d.reasons);
    assert!(
        d.notes
            .iter()
            .filter(|n| n.contains("the lease's CDI spec"))
            .count()
            == 5,
        "{:?}",
        d.notes
    );
    let full = d.full_spec();
    let nodes: Vec<(&str, i64)> = full["linux"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["path"].as_str().unwrap(), n["minor"].as_i64().unwrap()))
        .collect();
    assert_eq!(nodes, vec![("/dev/nvidia0", 0), ("/dev/nvidiactl", 255)]);
    let mps_mounts = full["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["destination"] == json!(mps.destination))
        .count();
    assert_eq!(
        mps_mounts, 1,
        "the lease's mount is made once, by the runtime"
    );

    // Another GPU's node, under the lease's path or its own: refused.
    for (node, why) in [
        (
            json!({"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}),
            "GPU device node /dev/nvidia1 (195:1)",
        ),
        (
            json!({"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 1}),
            "GPU device node /dev/nvidia0 (195:1)",
        ),
    ] {
        let mut s = spec.clone();
        s["linux"]["devices"].as_array_mut().unwrap().push(node);
        let d = fx.harden(s);
        assert!(!d.admitted);
        assert!(d.reasons.iter().any(|r| r.contains(why)), "{:?}", d.reasons);
    }
    // A rule for another GPU, or for every device: refused.
    for rule in [
        json!({"allow": true, "type": "c", "major": 195, "minor": 1, "access": "rwm"}),
        json!({"allow": true, "type": "a", "access": "rwm"}),
    ] {
        let mut s = spec.clone();
        s["linux"]["resources"]["devices"]
            .as_array_mut()
            .unwrap()
            .push(rule);
        assert!(!fx.harden(s).admitted);
    }
    // Without a lease the same nodes are anybody's GPU: refused.
    let Some(bare) = Fixture::new(false) else {
        return;
    };
    assert!(!bare.harden(spec).admitted);
}

/// The hardening reads the host only through the view it is given: a view that says
/// the lease's node is missing refuses a spec the real host admits, and nothing below
/// the container's rootfs is ever looked at.
#[test]
fn the_host_is_read_through_the_host_view_only() {
    use tessera_runtime::host::{HostView, RecordingHost};
    let Some(fx) = Fixture::new(true) else { return };
    let spec = || {
        let mut spec = common::base_spec(&["sh"]);
        spec["annotations"] = json!({"tessera.io/lease-token": "tok"});
        spec
    };
    let harden_on = |host: &dyn HostView| {
        let ctx = Context {
            config: &fx.cfg,
            seccomp: &fx.profile,
            host,
            lease: fx.lease.as_ref(),
            container_id: "c1",
            systemd_cgroup: false,
            bundle: &fx.bundle,
            runc_root: &fx.runc_root(),
        };
        harden::harden(spec(), &ctx)
    };
    let real = RecordingHost::new(fx.host.clone());
    let d = harden_on(&real);
    assert!(d.admitted, "{:?}", d.reasons);
    let node = fx.lease.as_ref().unwrap().devices[0].host_path.clone();
    assert!(real.asked().contains(&node), "{:?}", real.asked());
    let rootfs = fx.bundle.join("rootfs");
    assert!(
        !real
            .asked()
            .iter()
            .any(|p| p.starts_with(&rootfs) && *p != rootfs),
        "a path inside the rootfs was looked at: {:?}",
        real.asked()
    );
    let without_node = RecordingHost::new(fx.host.clone()).with_path(&node, None);
    let d = harden_on(&without_node);
    assert!(
        d.reasons.iter().any(|r| r.contains(&format!(
            "the lease's device {} is missing on the host",
            node.display()
        ))),
        "{:?}",
        d.reasons
    );
}
