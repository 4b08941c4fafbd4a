//! The red team's findings against the runtime (F1-F8), each replayed through the real
//! runtime and the host's runc and judged by what happened: the ids a process ran
//! with, the cgroup files the kernel shows, a file written or not, a process alive or
//! killed. Prints "SKIPPED: <reason>" when not root or runc is missing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

struct Env {
    dir: tempfile::TempDir,
    root: PathBuf,
    config: PathBuf,
    /// A cgroup parent the policy allows (`/tessera-test/<this>`).
    cgroup_parent: String,
    daemon: Option<common::FakeDaemon>,
}

impl Env {
    fn new(what: &str) -> Option<Self> {
        if !common::can_run_as_root(what, &["runc", "busybox"]) {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        common::busybox_rootfs(dir.path());
        let socket = dir.path().join("tesserad.sock");
        let n = std::process::id();
        let cgroup_parent = format!("/tessera-test/rt1-{n}-{}", what.len());
        let mut answers: HashMap<String, common::Answer> = HashMap::new();
        for (tok, lease) in [("tok-a", "lease-a"), ("tok-m", "lease-m")] {
            answers.insert(
                tok.into(),
                Ok(common::lease_answer(
                    lease,
                    "acme",
                    &[],
                    None,
                    &format!("{cgroup_parent}/{lease}"),
                )),
            );
        }
        let daemon = common::FakeDaemon::start(&socket, answers);
        let config = common::runtime_config(dir.path(), &socket, &dir.path().join("no-nvidia"), "");
        // Containers outside a pod live directly in a configured parent: this test's.
        let text = std::fs::read_to_string(&config).unwrap().replace(
            "\"e2etest.slice\"]",
            &format!("\"e2etest.slice\", {cgroup_parent:?}]"),
        );
        assert!(text.contains(&cgroup_parent), "{text}");
        std::fs::write(&config, text).unwrap();
        let root = dir.path().join("runc-root");
        Some(Self {
            root,
            config,
            cgroup_parent,
            daemon: Some(daemon),
            dir,
        })
    }

    fn daemon(&self) -> &common::FakeDaemon {
        self.daemon.as_ref().unwrap()
    }

    fn state_dir(&self) -> PathBuf {
        self.dir.path().join("runtime-state")
    }

    /// A bundle running `args` as `uid:gid` (busybox rootfs inside it).
    fn bundle(&self, name: &str, args: &[&str], uid: u32) -> (PathBuf, Value) {
        let b = self.dir.path().join(name);
        std::fs::create_dir_all(&b).unwrap();
        let mut spec = common::base_spec(args);
        spec["root"]["path"] = json!(common::bundle_rootfs(self.dir.path(), &b));
        spec["process"]["user"] = json!({"uid": uid, "gid": uid});
        common::write_spec(&b, &spec);
        (b, spec)
    }

    /// Run tessera-runtime with `--root root`; stdout/stderr to files (a container
    /// inherits them).
    fn runtime_at(&self, root: &str, args: &[&str]) -> Output {
        let n = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let out_path = self.dir.path().join(format!("out-{n}"));
        let err_path = self.dir.path().join(format!("err-{n}"));
        let status = Command::new(common::runtime_bin())
            .env("TESSERA_RUNTIME_CONFIG", &self.config)
            .args(["--root", root])
            .args(args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(std::fs::File::create(&err_path).unwrap())
            .status()
            .unwrap();
        Output {
            status,
            stdout: std::fs::read(&out_path).unwrap(),
            stderr: std::fs::read(&err_path).unwrap(),
        }
    }

    fn runtime(&self, args: &[&str]) -> Output {
        self.runtime_at(self.root.to_str().unwrap(), args)
    }

    /// `run -d` a container from `b` under the env's root; panics unless it started.
    fn started(&self, b: &Path, id: &str) {
        let out = self.runtime(&["run", "-d", "--bundle", b.to_str().unwrap(), id]);
        assert!(out.status.success(), "run {id}: {:?}", text(&out));
    }

    /// `id -u` in container `id` through the runtime, under `root`.
    fn uid_in(&self, root: &str, id: &str) -> Result<String, String> {
        let out = self.runtime_at(root, &["exec", id, "id", "-u"]);
        let (o, e) = text(&out);
        if out.status.success() {
            Ok(o.trim().to_string())
        } else {
            Err(e)
        }
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Ok(rd) = std::fs::read_dir(&self.root) {
            for e in rd.flatten() {
                let _ = Command::new("runc")
                    .arg("--root")
                    .arg(&self.root)
                    .args(["delete", "-f"])
                    .arg(e.file_name())
                    .output();
            }
        }
        if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in rd.flatten() {
                remove_cgroup_tree(&h.path().join(self.cgroup_parent.trim_start_matches('/')));
            }
        }
        remove_cgroup_tree(
            &Path::new("/sys/fs/cgroup").join(self.cgroup_parent.trim_start_matches('/')),
        );
        self.daemon.take();
    }
}

fn remove_cgroup_tree(p: &Path) {
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(p);
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// F4: runc reads only the config.json the runtime wrote. The bundle's owner swaps
/// its own spec (a createRuntime hook that runs `id` on the host) over config.json
/// each time the file changes after the runtime read it, as the red team did; the
/// hook never runs, and runc's state names the runtime's own bundle directory.
#[test]
fn f4_runc_never_reads_a_spec_from_the_tenants_bundle() {
    let Some(env) = Env::new("f4 bundle race") else {
        return;
    };
    let pwned = env.dir.path().join("PWNED");
    let (b, spec) = env.bundle("att", &["sleep", "60"], 1000);
    let mut evil = spec.clone();
    evil["hooks"] = json!({"createRuntime": [{"path": "/bin/sh",
        "args": ["sh", "-c", format!("id > {}", pwned.display())]}]});
    let evil_bytes = serde_json::to_vec(&evil).unwrap();
    let good_bytes = std::fs::read(b.join("config.json")).unwrap();
    for round in 0..4 {
        std::fs::write(b.join("config.json"), &good_bytes).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swapper = {
            let (b, evil, stop) = (b.clone(), evil_bytes.clone(), stop.clone());
            std::thread::spawn(move || {
                use std::os::unix::fs::MetadataExt;
                let cfg = b.join("config.json");
                let first = std::fs::symlink_metadata(&cfg).unwrap().ino();
                let mut swaps = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && swaps < 50 {
                    match std::fs::symlink_metadata(&cfg) {
                        Ok(m)
                            if m.ino() != first
                                && std::fs::read(&cfg).ok().as_ref() != Some(&evil) =>
                        {
                            let tmp = b.join("evil.tmp");
                            std::fs::write(&tmp, &evil).unwrap();
                            std::fs::rename(&tmp, &cfg).unwrap();
                            swaps += 1;
                        }
                        _ => std::thread::yield_now(),
                    }
                }
            })
        };
        let id = format!("race{round}");
        let out = env.runtime(&["create", "--bundle", b.to_str().unwrap(), &id]);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        swapper.join().unwrap();
        assert!(out.status.success(), "create {id}: {:?}", text(&out));
        assert!(
            !pwned.exists(),
            "round {round}: the tenant's hook ran on the host: {}",
            std::fs::read_to_string(&pwned).unwrap_or_default()
        );
        let st = Command::new("runc")
            .arg("--root")
            .arg(&env.root)
            .args(["state", &id])
            .output()
            .unwrap();
        let st: Value = serde_json::from_slice(&st.stdout).unwrap();
        let bundle = PathBuf::from(st["bundle"].as_str().unwrap());
        assert!(
            bundle.starts_with(env.state_dir()),
            "runc was given {} as its bundle",
            bundle.display()
        );
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&bundle).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o700));
        let out = env.runtime(&["delete", "-f", &id]);
        assert!(out.status.success(), "delete {id}: {:?}", text(&out));
        assert!(!bundle.exists(), "the own bundle goes with the container");
    }
}

/// F1: the record exec and update judge against is the one of the container runc
/// has: a `--root` spelt through a missing directory or `..` is refused, another
/// spelling of the same root is the same root, a create of an id that exists is
/// refused before anything is recorded, a failed create leaves no record, and a
/// record does not vouch for a container of the same id made later outside the
/// runtime.
#[test]
fn f1_exec_never_uses_a_record_the_attacker_wrote() {
    let Some(env) = Env::new("f1 record aliasing") else {
        return;
    };
    let root = env.root.to_str().unwrap().to_string();
    let (vb, _) = env.bundle("victim", &["sleep", "60"], 1000);
    env.started(&vb, "v1");
    assert_eq!(env.uid_in(&root, "v1").unwrap(), "1000");
    let (eb, _) = env.bundle("evil", &["sleep", "60"], 0);
    let dotdot = format!("{}/nonexistent/../runc-root", env.dir.path().display());
    let slash = format!("{root}/");
    let link = env.dir.path().join("root-link");
    std::os::unix::fs::symlink(&env.root, &link).unwrap();
    let link = link.to_str().unwrap().to_string();
    for r in [&dotdot, &slash, &link, &format!("{root}//")] {
        let out = env.runtime_at(r, &["create", "--bundle", eb.to_str().unwrap(), "v1"]);
        assert_eq!(out.status.code(), Some(1), "{r}: {:?}", text(&out));
        // Whatever spelling exec uses, it runs as the victim's user, or not at all.
        for er in [&root, &slash, &link] {
            assert_eq!(env.uid_in(er, "v1").unwrap(), "1000", "exec under {er}");
        }
        assert!(env.uid_in(&dotdot, "v1").is_err());
    }
    // Route two: made and deleted under one spelling, made again by the victim.
    let (xb, _) = env.bundle("x-evil", &["sleep", "60"], 0);
    let out = env.runtime_at(
        &slash,
        &["run", "-d", "--bundle", xb.to_str().unwrap(), "x2"],
    );
    assert!(out.status.success(), "{:?}", text(&out));
    let out = env.runtime_at(&root, &["delete", "-f", "x2"]);
    assert!(out.status.success(), "{:?}", text(&out));
    env.started(&vb, "x2");
    assert_eq!(env.uid_in(&slash, "x2").unwrap(), "1000");
    // A create runc fails (no such program) leaves no record and no own bundle.
    let (fb, _) = env.bundle("fails", &["/no/such/program"], 0);
    let out = env.runtime(&["create", "--bundle", fb.to_str().unwrap(), "f1"]);
    assert!(!out.status.success(), "{:?}", text(&out));
    let recs = tessera_runtime::record::Records::new(&env.state_dir());
    let canon = std::fs::canonicalize(&env.root).unwrap();
    assert!(recs.get(canon.to_str().unwrap(), "f1").is_err());
    assert!(!recs.bundle_dir(canon.to_str().unwrap(), "f1").exists());
    // A container of a recorded id, deleted and made again by runc directly as root:
    // the record does not vouch for it.
    let (ob, _) = env.bundle("outside", &["sleep", "60"], 0);
    env.started(&vb, "o1");
    let st = Command::new("runc")
        .args(["--root", &root, "delete", "-f", "o1"])
        .status()
        .unwrap();
    assert!(st.success());
    let st = Command::new("runc")
        .args([
            "--root",
            &root,
            "run",
            "-d",
            "--bundle",
            ob.to_str().unwrap(),
            "o1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    let e = env.uid_in(&root, "o1").unwrap_err();
    assert!(e.contains("not this container's"), "{e}");
}

/// F2: an exec'd process gets no capability outside the container's own set of the
/// same name. The container (1000:1000) has CAP_SETUID and CAP_SETGID in its
/// bounding, effective and permitted sets and none ambient; a process JSON asking for
/// them in all five sets runs with no ambient and no effective capability (as the
/// container's own user would), so it cannot become root.
#[test]
fn f2_exec_gets_no_ambient_capability_the_container_lacks() {
    let Some(env) = Env::new("f2 exec ambient caps") else {
        return;
    };
    let (b, mut spec) = env.bundle("v2", &["sleep", "60"], 1000);
    let two = json!(["CAP_SETUID", "CAP_SETGID"]);
    spec["process"]["capabilities"] = json!({"bounding": two, "effective": two, "permitted": two});
    common::write_spec(&b, &spec);
    env.started(&b, "v2");
    let p = env.dir.path().join("p2.json");
    std::fs::write(
        &p,
        json!({"args": ["sh", "-c", "grep -E '^Cap(Amb|Eff|Inh):' /proc/self/status"],
               "cwd": "/", "env": ["PATH=/bin"], "user": {"uid": 1000, "gid": 1000},
               "capabilities": {"bounding": two, "effective": two, "permitted": two,
                                "inheritable": two, "ambient": two}})
        .to_string(),
    )
    .unwrap();
    let out = env.runtime(&["exec", "--process", p.to_str().unwrap(), "v2"]);
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o} {e}");
    let caps: Vec<String> = o.split_whitespace().map(str::to_string).collect();
    assert_eq!(
        caps,
        [
            "CapInh:",
            "0000000000000000",
            "CapEff:",
            "0000000000000000",
            "CapAmb:",
            "0000000000000000"
        ],
        "the exec'd process's capabilities"
    );
}

/// The pids in a cgroup, in whichever hierarchy shows it (v1 pids controller, v2).
fn cgroup_procs(cgroup: &str) -> Option<Vec<String>> {
    let rel = cgroup.trim_start_matches('/');
    [
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup/unified",
        "/sys/fs/cgroup",
    ]
    .iter()
    .find_map(|h| std::fs::read_to_string(Path::new(h).join(rel).join("cgroup.procs")).ok())
    .map(|t| t.lines().map(str::to_string).collect())
}

/// F8: a tenant on its own lease cannot put its container into another tenant's
/// cgroup (where its lease's release would kill that tenant's processes): a
/// cgroupsPath that exists is refused, under any root, and nothing is bound.
#[test]
fn f8_a_container_never_joins_an_existing_cgroup() {
    let Some(env) = Env::new("f8 cgroup hijack") else {
        return;
    };
    let cg = format!("{}/vic", env.cgroup_parent);
    let (vb, mut spec) = env.bundle("vic", &["sleep", "60"], 1000);
    spec["linux"]["cgroupsPath"] = json!(cg);
    common::write_spec(&vb, &spec);
    env.started(&vb, "vic");
    let before = cgroup_procs(&cg).expect("the victim's cgroup");
    assert_eq!(before.len(), 1, "{before:?}");
    let (ab, mut spec) = env.bundle("att", &["sleep", "60"], 1000);
    spec["linux"]["cgroupsPath"] = json!(cg);
    spec["annotations"] = json!({"tessera.io/lease-token": "tok-m"});
    common::write_spec(&ab, &spec);
    let other = env.dir.path().join("root-b");
    for root in [other.to_str().unwrap(), env.root.to_str().unwrap()] {
        let out = env.runtime_at(
            root,
            &["run", "-d", "--bundle", ab.to_str().unwrap(), "vic"],
        );
        assert_eq!(out.status.code(), Some(1), "{root}: {:?}", text(&out));
        assert!(text(&out).1.contains("already exists"), "{:?}", text(&out));
    }
    assert_eq!(
        cgroup_procs(&cg).unwrap(),
        before,
        "nothing joined the victim's cgroup"
    );
    assert!(
        env.daemon().recorded().binds.is_empty(),
        "nothing was bound"
    );
}

/// F7: only a delete that runc carried out, of the container this root's record
/// names, unbinds it: a delete under another root, or of a running container without
/// --force, leaves the lease binding (and exec) as they were. A create runc fails
/// after the bind is unbound.
#[test]
fn f7_a_delete_drops_only_its_own_containers_binding() {
    let Some(env) = Env::new("f7 delete unbinds") else {
        return;
    };
    let (b, mut spec) = env.bundle("gpu1", &["sleep", "60"], 1000);
    spec["annotations"] = json!({"tessera.io/lease-token": "tok-a"});
    common::write_spec(&b, &spec);
    env.started(&b, "gpu1");
    assert_eq!(env.daemon().recorded().binds.len(), 1);
    let empty = env.dir.path().join("empty-root");
    std::fs::create_dir(&empty).unwrap();
    // runc's delete --force of a container it does not have succeeds: nothing of
    // that root is bound, so nothing is unbound.
    for (root, args, ok) in [
        (empty.to_str().unwrap(), vec!["delete", "-f", "gpu1"], true),
        (env.root.to_str().unwrap(), vec!["delete", "gpu1"], false),
    ] {
        let out = env.runtime_at(root, &args);
        assert_eq!(
            out.status.success(),
            ok,
            "{root} {args:?}: {:?}",
            text(&out)
        );
        assert!(
            env.daemon().recorded().unbinds.is_empty(),
            "{root} {args:?} unbound"
        );
        assert_eq!(
            env.uid_in(env.root.to_str().unwrap(), "gpu1").unwrap(),
            "1000"
        );
    }
    let out = env.runtime(&["delete", "-f", "gpu1"]);
    assert!(out.status.success(), "{:?}", text(&out));
    assert_eq!(env.daemon().recorded().unbinds, ["gpu1"]);
    // A create runc refuses (no such program) after the bind: unbound again.
    let (fb, mut spec) = env.bundle("fails", &["/no/such/program"], 1000);
    spec["annotations"] = json!({"tessera.io/lease-token": "tok-a"});
    common::write_spec(&fb, &spec);
    let out = env.runtime(&["create", "--bundle", fb.to_str().unwrap(), "f7"]);
    assert!(!out.status.success(), "{:?}", text(&out));
    let rec = env.daemon().recorded();
    assert_eq!(rec.binds.len(), 2);
    assert_eq!(rec.unbinds, ["gpu1", "f7"]);
}

/// A cgroup v1 controller's file of cgroup `cg` (`None` where this host has no such
/// file: a v2-only host).
fn v1_file(controller: &str, cg: &str, file: &str) -> Option<String> {
    std::fs::read_to_string(
        Path::new("/sys/fs/cgroup")
            .join(controller)
            .join(cg.trim_start_matches('/'))
            .join(file),
    )
    .ok()
    .map(|s| s.trim().to_string())
}

/// F5: a memory limit spelt `LIMIT` (runc folds it to `limit`, a reader by exact name
/// sees none) is refused at create; the record keeps the limit runc set, and update
/// cannot raise it.
#[test]
fn f5_a_misspelt_limit_at_create_is_refused_and_update_stays_within_the_grant() {
    let Some(env) = Env::new("f5 LIMIT at create") else {
        return;
    };
    let cg = format!("{}/v5", env.cgroup_parent);
    let (b, mut spec) = env.bundle("v5", &["sleep", "60"], 1000);
    spec["linux"]["cgroupsPath"] = json!(cg);
    spec["linux"]["resources"]["memory"] = json!({"LIMIT": 67108864});
    common::write_spec(&b, &spec);
    let out = env.runtime(&["run", "-d", "--bundle", b.to_str().unwrap(), "v5"]);
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("/linux/resources/memory/LIMIT"),
        "{:?}",
        text(&out)
    );
    assert!(cgroup_procs(&cg).is_none(), "nothing ran");
    spec["linux"]["resources"]["memory"] = json!({"limit": 67108864});
    common::write_spec(&b, &spec);
    env.started(&b, "v5");
    let limit = || v1_file("memory", &cg, "memory.limit_in_bytes");
    if limit().is_none() {
        eprintln!("SKIPPED: f5 update part: no cgroup v1 memory controller");
        return;
    }
    assert_eq!(limit().unwrap(), "67108864");
    let r = env.dir.path().join("r5.json");
    std::fs::write(&r, r#"{"memory":{"limit":8589934592}}"#).unwrap();
    let out = env.runtime(&["update", "-r", r.to_str().unwrap(), "v5"]);
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    assert_eq!(limit().unwrap(), "67108864");
}

/// F3: update cannot lift the CPU limits of the create (quota -1 or a larger
/// quota/period, more shares, cpus outside the create's), by JSON, flag or cgroup v2
/// key; a tighter quota is applied.
#[test]
fn f3_update_never_lifts_the_cpu_limits_of_the_create() {
    let Some(env) = Env::new("f3 update lifts cpu") else {
        return;
    };
    let cg = format!("{}/v3", env.cgroup_parent);
    let (b, mut spec) = env.bundle("v3", &["sleep", "60"], 1000);
    spec["linux"]["cgroupsPath"] = json!(cg);
    spec["linux"]["resources"]["cpu"] =
        json!({"quota": 20000, "period": 100000, "shares": 2, "cpus": "0", "mems": "0"});
    common::write_spec(&b, &spec);
    env.started(&b, "v3");
    let now = || {
        (
            v1_file("cpu", &cg, "cpu.cfs_quota_us"),
            v1_file("cpu", &cg, "cpu.shares"),
            v1_file("cpuset", &cg, "cpuset.cpus"),
        )
    };
    if now().0.is_none() {
        eprintln!("SKIPPED: f3: no cgroup v1 cpu controller");
        return;
    }
    let granted = (
        Some("20000".to_string()),
        Some("2".to_string()),
        Some("0".to_string()),
    );
    assert_eq!(now(), granted);
    let r = env.dir.path().join("r3.json");
    for doc in [
        r#"{"cpu":{"quota":-1}}"#,
        r#"{"cpu":{"quota":40000}}"#,
        r#"{"cpu":{"period":50000}}"#,
        r#"{"cpu":{"shares":262144}}"#,
        r#"{"cpu":{"cpus":"0-1"}}"#,
        r#"{"cpu":{"quota":-1,"cpus":"0-1","shares":262144}}"#,
        r#"{"unified":{"cpu.max":"max 100000"}}"#,
        r#"{"unified":{"cpuset.cpus":"0-1"}}"#,
    ] {
        std::fs::write(&r, doc).unwrap();
        let out = env.runtime(&["update", "-r", r.to_str().unwrap(), "v3"]);
        assert_eq!(out.status.code(), Some(1), "{doc}: {:?}", text(&out));
        assert_eq!(now(), granted, "{doc}");
    }
    for flags in [
        vec!["--cpu-quota=-1"],
        vec!["--cpu-share=100000"],
        vec!["--cpuset-cpus", "0-1"],
    ] {
        let mut argv = vec!["update"];
        argv.extend(flags.iter().copied());
        argv.push("v3");
        let out = env.runtime(&argv);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {:?}", text(&out));
        assert_eq!(now(), granted, "{flags:?}");
    }
    std::fs::write(&r, r#"{"cpu":{"quota":10000}}"#).unwrap();
    let out = env.runtime(&["update", "-r", r.to_str().unwrap(), "v3"]);
    assert!(out.status.success(), "{:?}", text(&out));
    assert_eq!(
        now().0.as_deref(),
        Some("10000"),
        "a tighter quota is applied"
    );
}

/// F6: `exec --preserve-fds` passes on only sockets, pipes and character devices: a
/// host directory on fd 3 is refused (the container writes nothing through it), a
/// pipe still works.
#[test]
fn f6_a_preserved_fd_is_never_a_host_directory() {
    let Some(env) = Env::new("f6 preserve-fds") else {
        return;
    };
    let (b, _) = env.bundle("v6", &["sleep", "60"], 0);
    env.started(&b, "v6");
    let hostdir = env.dir.path().join("hostdir");
    std::fs::create_dir(&hostdir).unwrap();
    let run_with_fd3 = |fd3: std::fs::File, script: &str| -> Output {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let raw = fd3.as_raw_fd();
        let mut cmd = Command::new(common::runtime_bin());
        cmd.env("TESSERA_RUNTIME_CONFIG", &env.config)
            .args(["--root", env.root.to_str().unwrap()])
            .args(["exec", "--preserve-fds", "1", "v6", "sh", "-c", script])
            .stdin(Stdio::null());
        // SAFETY: dup2 (or, where the descriptor is fd 3 already, fcntl clearing its
        // close-on-exec flag) between fork and exec only puts the test's descriptor on
        // fd 3 for the runtime.
        unsafe {
            cmd.pre_exec(move || {
                let rc = if raw == 3 {
                    libc::fcntl(3, libc::F_SETFD, 0)
                } else {
                    libc::dup2(raw, 3)
                };
                if rc < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        drop(fd3);
        out
    };
    for fd3 in [
        std::fs::File::open(&hostdir).unwrap(),
        std::fs::File::open(env.dir.path().join("runtime.toml")).unwrap(),
    ] {
        let out = run_with_fd3(fd3, "echo escaped > /proc/self/fd/3/written");
        assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
        assert!(text(&out).1.contains("--preserve-fds"), "{:?}", text(&out));
    }
    assert_eq!(
        std::fs::read_dir(&hostdir).unwrap().count(),
        0,
        "written on the host"
    );
    // A pipe is passed on: the container writes into it.
    // Close-on-exec: no other test's child keeps the write end open.
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let out = run_with_fd3(std::fs::File::from(w), "echo through-the-pipe >&3");
    assert!(out.status.success(), "{:?}", text(&out));
    let mut got = String::new();
    std::io::Read::read_to_string(&mut std::fs::File::from(r), &mut got).unwrap();
    assert_eq!(got.trim(), "through-the-pipe");
    // A number not open is /dev/null in the container, never a file of the runtime's.
    let mut cmd = Command::new(common::runtime_bin());
    cmd.env("TESSERA_RUNTIME_CONFIG", &env.config)
        .args(["--root", env.root.to_str().unwrap()])
        .args([
            "exec",
            "--preserve-fds",
            "1",
            "v6",
            "readlink",
            "/proc/self/fd/3",
        ])
        .stdin(Stdio::null());
    // SAFETY: close between fork and exec only closes fd 3 of the child.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            libc::close(3);
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    assert_eq!(text(&out).0.trim(), "/dev/null");
}
