//! A corpus of hostile specs through `tessera-runtime check --json`: each is refused with
//! its reason. And a property test: no input yields a spec granting a GPU node outside
//! the lease, dropping seccomp, or clearing no_new_privileges.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use proptest::prelude::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use tessera_runtime::config::RuntimeConfig;
use tessera_runtime::harden::{self, Context, seccomp::Profile};
use tessera_runtime::host::HostFacts;
use tessera_runtime::lease::{LeaseDevice, ResolvedLease};

struct Checker {
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl Checker {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let proc_root = common::fake_nvidia_proc(dir.path());
        let config = common::runtime_config(
            dir.path(),
            &dir.path().join("no-daemon.sock"),
            &proc_root,
            "",
        );
        Self { dir, config }
    }

    fn bundle(&self, name: &str) -> PathBuf {
        let b = self.dir.path().join(name);
        std::fs::create_dir_all(b.join("rootfs")).unwrap();
        b
    }

    /// Run `check --json` on a bundle: (exit code, parsed output).
    fn check(&self, bundle: &Path) -> (i32, Value) {
        let out = Command::new(common::runtime_bin())
            .env("TESSERA_RUNTIME_CONFIG", &self.config)
            .args(["check", "--json", "--bundle"])
            .arg(bundle)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let v: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
            panic!(
                "check output is not JSON ({e}): {stdout} / {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        (out.status.code().unwrap_or(-1), v)
    }
}

fn assert_refused(code: i32, out: &Value, want: &str, what: &str) {
    assert_eq!(code, 1, "{what}: exit code");
    assert_eq!(out["admitted"], false, "{what}");
    let reasons: Vec<&str> = out["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains(want)),
        "{what}: no reason with {want:?} in {reasons:?}"
    );
}

#[test]
fn corpus_is_refused_with_reasons() {
    let c = Checker::new();
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let expect = std::fs::read_to_string(corpus.join("expect.txt")).unwrap();
    let mut n = 0;
    for line in expect
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (file, want) = line.split_once('\t').unwrap();
        let b = c.bundle(file.trim_end_matches(".json"));
        std::fs::copy(corpus.join(file), b.join("config.json")).unwrap();
        let (code, out) = c.check(&b);
        assert_refused(code, &out, want, file);
        n += 1;
    }
    assert!(n >= 30, "corpus has {n} cases");
}

#[test]
fn benign_spec_is_admitted_and_hardened() {
    let c = Checker::new();
    let b = c.bundle("ok");
    common::write_spec(&b, &common::base_spec(&["sh"]));
    let (code, out) = c.check(&b);
    assert_eq!(code, 0, "{out}");
    assert_eq!(out["admitted"], true);
    assert_eq!(out["spec"]["process"]["noNewPrivileges"], true);
    assert_eq!(
        out["spec"]["linux"]["seccomp"]["defaultAction"],
        "SCMP_ACT_ERRNO"
    );
    // check changes nothing on disk.
    let on_disk: Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    assert_eq!(on_disk, common::base_spec(&["sh"]));
}

#[test]
fn bundle_file_attacks() {
    let c = Checker::new();
    // config.json a symlink to a benign spec elsewhere.
    let b = c.bundle("symlinked-config");
    let elsewhere = c.dir.path().join("elsewhere.json");
    std::fs::write(
        &elsewhere,
        serde_json::to_vec(&common::base_spec(&["sh"])).unwrap(),
    )
    .unwrap();
    std::os::unix::fs::symlink(&elsewhere, b.join("config.json")).unwrap();
    let (code, out) = c.check(&b);
    assert_refused(code, &out, "symlink", "symlinked config.json");
    // rootfs a symlink to the host's /.
    let b = c.bundle("symlinked-rootfs");
    std::fs::remove_dir(b.join("rootfs")).unwrap();
    std::os::unix::fs::symlink("/", b.join("rootfs")).unwrap();
    common::write_spec(&b, &common::base_spec(&["sh"]));
    let (code, out) = c.check(&b);
    assert_refused(
        code,
        &out,
        "root.path rootfs is a symlink",
        "symlinked rootfs",
    );
    // Oversized.
    let b = c.bundle("oversized");
    let mut spec = common::base_spec(&["sh"]);
    spec["padding"] = json!("x".repeat(5 * 1024 * 1024));
    common::write_spec(&b, &spec);
    let (code, out) = c.check(&b);
    assert_refused(code, &out, "larger than", "oversized");
    // config.json a directory.
    let b = c.bundle("dir-config");
    std::fs::create_dir(b.join("config.json")).unwrap();
    let (code, out) = c.check(&b);
    assert_refused(code, &out, "not a regular file", "directory config.json");
    // No daemon: a token is refused (fail closed).
    let b = c.bundle("token-no-daemon");
    let mut spec = common::base_spec(&["sh"]);
    spec["annotations"] = json!({"tessera.io/lease-token": "tok"});
    common::write_spec(&b, &spec);
    let (code, out) = c.check(&b);
    assert_refused(code, &out, "unavailable", "no daemon");
}

// ------------------------------------------------------------------ property test

const ALL_CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW",
    "CAP_NET_ADMIN",
    "CAP_SYS_ADMIN",
    "CAP_SYS_PTRACE",
    "CAP_SYS_MODULE",
    "CAP_MKNOD",
    "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
    "CAP_BPF",
    "CAP_PERFMON",
    "CAP_SYS_CHROOT",
    "CAP_SYS_RAWIO",
    "sys_admin",
    "net_raw",
    "CAP_BOGUS",
];

const SAFE_CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_KILL",
    "CAP_SETUID",
    "CAP_NET_RAW",
    "CAP_MKNOD",
    "kill",
    "CAP_BOGUS",
];

fn cap_list() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => proptest::sample::subsequence(SAFE_CAPS, 0..5),
        1 => proptest::sample::subsequence(ALL_CAPS, 0..8),
    ]
    .prop_map(|v| json!(v))
}

fn device() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            Just("/dev/nvidia0"),
            Just("/dev/nvidia1"),
            Just("/dev/null"),
            Just("/dev/x"),
            Just("/dev/nvidia-caps/nvidia-cap1"),
            Just("/dev/../dev/nvidia2")
        ],
        prop_oneof![
            Just(195i64),
            Just(1),
            Just(10),
            Just(136),
            Just(237),
            Just(8)
        ],
        0i64..300,
        prop_oneof![Just("c"), Just("b")],
    )
        .prop_map(|(p, ma, mi, t)| json!({"path": p, "type": t, "major": ma, "minor": mi}))
}

fn rule() -> impl Strategy<Value = Value> {
    (
        any::<bool>(),
        prop_oneof![
            Just(json!("c")),
            Just(json!("b")),
            Just(json!("a")),
            Just(Value::Null)
        ],
        prop_oneof![
            Just(json!(195)),
            Just(json!(1)),
            Just(json!(136)),
            Just(json!(10)),
            Just(Value::Null),
            Just(json!(-1))
        ],
        prop_oneof![
            Just(json!(0)),
            Just(json!(1)),
            Just(json!(3)),
            Just(json!(200)),
            Just(json!(255)),
            Just(Value::Null)
        ],
    )
        .prop_map(|(allow, t, ma, mi)| {
            let mut r = json!({"allow": allow, "access": "rwm"});
            for (k, v) in [("type", t), ("major", ma), ("minor", mi)] {
                if !v.is_null() {
                    r[k] = v;
                }
            }
            r
        })
}

fn mount() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            Just("/dev/nvidia1"),
            Just("/proc"),
            Just("/tmp/data"),
            Just("/"),
            Just("/run/tessera/x"),
            Just("/var/tmp"),
            Just("proc"),
            Just("tmpfs")
        ],
        prop_oneof![
            Just("/data"),
            Just("/dev/nvidia0"),
            Just("/proc"),
            Just("/sys"),
            Just("/x")
        ],
        prop_oneof![
            Just("bind"),
            Just("proc"),
            Just("tmpfs"),
            Just("sysfs"),
            Just("ext4"),
            Just("")
        ],
        prop_oneof![Just(json!(["rbind"])), Just(json!(["ro"])), Just(json!([]))],
    )
        .prop_map(|(s, d, t, o)| json!({"source": s, "destination": d, "type": t, "options": o}))
}

fn spec_strategy() -> impl Strategy<Value = Value> {
    (
        (cap_list(), cap_list(), cap_list()),
        prop_oneof![3 => Just(vec![]), 1 => proptest::collection::vec(device(), 1..4)],
        prop_oneof![2 => Just(vec![json!({"allow": false, "access": "rwm"})]), 1 => proptest::collection::vec(rule(), 0..5)],
        prop_oneof![2 => Just(vec![]), 1 => proptest::collection::vec(mount(), 1..4)],
        prop_oneof![
            3 => Just(vec!["pid", "ipc", "uts", "mount", "network"]),
            1 => proptest::sample::subsequence(vec!["pid", "ipc", "uts", "mount", "network", "user", "cgroup"], 0..7),
        ],
        (
            proptest::bool::weighted(0.2),
            any::<bool>(),
            proptest::bool::weighted(0.1),
            any::<bool>(),
        ),
    )
        .prop_map(|((b, e, a), devs, rules, mounts, nss, (nnp_off, seccomp, hooks, token_env))| {
            let mut s = common::base_spec(&["sh"]);
            s["process"]["capabilities"] = json!({"bounding": b, "effective": e, "ambient": a, "permitted": b});
            s["process"]["noNewPrivileges"] = json!(!nnp_off);
            s["linux"]["devices"] = json!(devs);
            s["linux"]["resources"]["devices"] = json!(rules);
            s["mounts"] = json!(mounts);
            s["linux"]["namespaces"] = json!(nss.iter().map(|t| json!({"type": t})).collect::<Vec<_>>());
            if seccomp {
                s["linux"]["seccomp"] = json!({"defaultAction": "SCMP_ACT_ALLOW"});
            }
            if hooks {
                s["hooks"] = json!({"prestart": [{"path": "/bin/true"}]});
            }
            if token_env {
                s["process"]["env"] = json!(["TESSERA_LEASE_TOKEN=tok", "PATH=/bin"]);
            }
            s
        })
}

fn lease_on_nvidia0() -> ResolvedLease {
    ResolvedLease {
        lease_id: "l1".into(),
        tenant: "acme".into(),
        devices: vec![LeaseDevice {
            // /dev/null stands in for the host node: the property is about the spec.
            host_path: "/dev/null".into(),
            container_path: "/dev/nvidia0".into(),
            kind: 'c',
            major: 1,
            minor: 3,
            permissions: "rw".into(),
            file_mode: 0o666,
        }],
        cgroup_parent: "/tessera/l1".into(),
        pids_limit: 100,
        ..Default::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn no_spec_escapes_the_lease(spec in spec_strategy(), with_lease in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("rootfs")).unwrap();
        let mut cfg = RuntimeConfig::parse("[policy]\napparmor = \"if-available\"\n", Path::new("t")).unwrap();
        cfg.nvidia_proc_root = dir.path().join("none");
        let profile = Profile::load(None).unwrap();
        let host = HostFacts::gather(&cfg.nvidia_proc_root).with_apparmor(Default::default());
        let lease = lease_on_nvidia0();
        let ctx = Context {
            config: &cfg, seccomp: &profile, host: &host,
            lease: with_lease.then_some(&lease),
            container_id: "c", systemd_cgroup: false, bundle: dir.path(), runc_root: dir.path(),
        };
        let d = harden::harden(spec, &ctx);
        if std::env::var_os("PROPTEST_SHOW").is_some() {
            eprintln!("admitted={}", d.admitted);
        }
        if d.admitted {
            // What runc gets: the config.json bytes.
            let written: serde_json::Value = serde_json::from_slice(&d.config_json().unwrap()).unwrap();
            let s = &written;
            let allowed: Vec<(i64, i64)> = ctx.lease.map(|l| l.devices.iter().map(|d| (d.major, d.minor)).collect()).unwrap_or_default();
            for dev in s["linux"]["devices"].as_array().unwrap() {
                let mm = (dev["major"].as_i64().unwrap(), dev["minor"].as_i64().unwrap());
                prop_assert!(allowed.contains(&mm), "device {dev} outside the lease");
            }
            let rules = s["linux"]["resources"]["devices"].as_array().unwrap();
            prop_assert_eq!(&rules[0], &json!({"allow": false, "access": "rwm"}));
            for r in &rules[1..] {
                let mm = (r["major"].as_i64().unwrap(), r["minor"].as_i64().unwrap());
                prop_assert!(r["allow"] == true && allowed.contains(&mm), "rule {r} outside the lease");
            }
            prop_assert_eq!(&s["linux"]["seccomp"], &profile.oci().unwrap());
            prop_assert_eq!(&s["process"]["noNewPrivileges"], &json!(true));
            for set in ["bounding", "effective", "permitted", "ambient", "inheritable"] {
                for c in s["process"]["capabilities"][set].as_array().unwrap() {
                    prop_assert!(cfg.policy.allowed_capabilities.iter().any(|a| a == c.as_str().unwrap()), "cap {c}");
                }
            }
            prop_assert!(s.get("hooks").is_none());
            for m in s["mounts"].as_array().unwrap() {
                let src = m["source"].as_str().unwrap_or("");
                prop_assert!(!src.starts_with("/dev/nvidia"), "mount {m}");
                let opts = m["options"].as_array().cloned().unwrap_or_default();
                let bind = m["type"] == "bind" || opts.iter().any(|o| o == "bind" || o == "rbind");
                // For bind mounts the source is a host path; for proc/tmpfs it is a label.
                if bind {
                    prop_assert!(src != "/" && !src.starts_with("/proc") && !src.starts_with("/run/tessera"), "mount {m}");
                }
            }
            let env = s["process"]["env"].as_array().unwrap();
            prop_assert!(!env.iter().any(|e| e.as_str().unwrap().starts_with("TESSERA_LEASE_TOKEN=")));
        } else {
            prop_assert!(!d.reasons.is_empty());
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_parser(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = tessera_runtime::bundle::parse_strict(&bytes);
    }
}
