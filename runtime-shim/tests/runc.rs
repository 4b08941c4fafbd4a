//! Root integration tests with the host's runc, a busybox-static rootfs, the fake daemon
//! and GPU nodes made with mknod. Prints "SKIPPED: <reason>" when not root or runc is
//! missing (CI runs them as root with runc).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use tessera_proto::v1 as pb;

const SCRIPT: &str = r#"
probe open /dev/nvidia0
probe open /dev/nvidiactl
probe open /dev/nvidia1
grep -E '^(Seccomp|NoNewPrivs|CapEff):' /proc/self/status
unshare -U true 2>/dev/null; echo "unshare-U=$?"
for p in clone3 clone_newuser bpf perf_event_open ptrace userfaultfd io_uring_setup keyctl fork; do probe $p; done
probe mknod_char /tmp/gpu
echo "cuda=$CUDA_VISIBLE_DEVICES"
echo "token=${TESSERA_LEASE_TOKEN:-unset}"
grep ' /run/nvidia-mps ' /proc/self/mountinfo | sed 's/^/mps: /'
ls /proc/driver/nvidia 2>&1 | head -1 | sed 's/^/procnv: /'
"#;

struct Env {
    dir: tempfile::TempDir,
    dev: PathBuf,
    root: PathBuf,
    config: PathBuf,
    cgroup_prefix: String,
    daemon: Option<common::FakeDaemon>,
}

impl Env {
    fn new() -> Option<Self> {
        if !common::can_run_as_root("runc integration", &["runc", "busybox", "cc"]) {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        common::busybox_rootfs(dir.path());
        let dev = common::gpu_dev_dir(dir.path());
        let proc_root = common::fake_nvidia_proc(dir.path());
        let mps = dir.path().join("mps-lease-1");
        std::fs::create_dir_all(&mps).unwrap();
        let cgroup_prefix = format!("tessera-test-{}", std::process::id());
        let socket = dir.path().join("tesserad.sock");
        let good = common::lease_answer(
            "lease-1",
            "acme",
            &[
                (&dev.join("nvidia0"), "/dev/nvidia0", 195, 0),
                (&dev.join("nvidiactl"), "/dev/nvidiactl", 195, 255),
            ],
            Some(&mps),
            &format!("/{cgroup_prefix}/lease-1"),
        );
        let mut revoked = good.clone();
        revoked.lease.as_mut().unwrap().state = pb::LeaseState::Revoked as i32;
        let mut answers: HashMap<String, common::Answer> = HashMap::new();
        answers.insert("tok-good".into(), Ok(good));
        answers.insert("tok-revoked".into(), Ok(revoked));
        answers.insert(
            "tok-expired".into(),
            Err((tonic::Code::PermissionDenied, "lease expired".into())),
        );
        let daemon = common::FakeDaemon::start(&socket, answers);
        let config = common::runtime_config(dir.path(), &socket, &proc_root, "");
        let root = dir.path().join("runc-root");
        Some(Self {
            dev,
            root,
            config,
            cgroup_prefix,
            daemon: Some(daemon),
            dir,
        })
    }

    fn daemon(&self) -> &common::FakeDaemon {
        self.daemon.as_ref().unwrap()
    }

    /// A bundle whose rootfs is the shared busybox one.
    fn bundle(&self, name: &str, args: &[&str], token: Option<&str>) -> PathBuf {
        let b = self.dir.path().join(name);
        std::fs::create_dir_all(&b).unwrap();
        let mut spec = common::base_spec(args);
        spec["root"]["path"] = json!(common::bundle_rootfs(self.dir.path(), &b));
        if let Some(t) = token {
            spec["annotations"] = json!({"tessera.io/lease-token": t});
        }
        common::write_spec(&b, &spec);
        b
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("log.json")
    }

    /// Run tessera-runtime; stdout/stderr go to files (a container inherits them, so
    /// pipes would stay open as long as it runs).
    fn runtime(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let n = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let out_path = self.dir.path().join(format!("out-{n}"));
        let err_path = self.dir.path().join(format!("err-{n}"));
        let mut cmd = Command::new(common::runtime_bin());
        cmd.env("TESSERA_RUNTIME_CONFIG", &self.config)
            .arg("--root")
            .arg(&self.root)
            .arg("--log")
            .arg(self.log())
            .args(["--log-format", "json"])
            .args(args)
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(std::fs::File::create(&err_path).unwrap());
        let status = match stdin {
            None => cmd.stdin(Stdio::null()).status().unwrap(),
            Some(input) => {
                let in_path = self.dir.path().join(format!("in-{n}"));
                std::fs::write(&in_path, input).unwrap();
                cmd.stdin(std::fs::File::open(&in_path).unwrap())
                    .status()
                    .unwrap()
            }
        };
        Output {
            status,
            stdout: std::fs::read(&out_path).unwrap(),
            stderr: std::fs::read(&err_path).unwrap(),
        }
    }

    fn last_log(&self) -> Value {
        let text = std::fs::read_to_string(self.log()).unwrap();
        serde_json::from_str(
            text.lines()
                .rev()
                .find(|l| l.contains("\"error\""))
                .unwrap(),
        )
        .unwrap()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // Remove leftover containers and the test's cgroup trees.
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
                remove_cgroup_tree(&h.path().join(&self.cgroup_prefix));
            }
        }
        remove_cgroup_tree(&Path::new("/sys/fs/cgroup").join(&self.cgroup_prefix));
        self.daemon.take();
    }
}

/// rmdir a cgroup directory tree, deepest first (cgroup dirs hold only virtual files).
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

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn leased_container_sees_only_its_gpu_and_runs_hardened() {
    let Some(env) = Env::new() else { return };
    // The first start asks runc its version and execs it once decided; the second
    // starts runc while its spec is judged (crate::early). Both run hardened.
    let b = env.bundle("b0", &["sh", "-c", SCRIPT], None);
    let first = env.runtime(&["run", "--bundle", b.to_str().unwrap(), "first"], None);
    assert!(first.status.success(), "{:?}", text(&first));
    let b = env.bundle("b1", &["sh", "-c", SCRIPT], Some("tok-good"));
    let id = format!("t{}-lease", std::process::id());
    let out = env.runtime(&["run", "--bundle", b.to_str().unwrap(), &id], None);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "run failed: {stdout}\n{stderr}");
    let want = [
        "open /dev/nvidia0 errno=6", // leased: ENXIO (no driver behind the node)
        "open /dev/nvidiactl errno=6", // leased
        "open /dev/nvidia1 errno=2", // another GPU: absent
        "Seccomp:\t2",
        "NoNewPrivs:\t1",
        "CapEff:\t00000000200004fb", // the policy's nine capabilities
        "clone3 errno=38",
        "clone_newuser errno=1",
        "bpf errno=1",
        "perf_event_open errno=1",
        "ptrace errno=1",
        "userfaultfd errno=1",
        "io_uring_setup errno=1",
        "keyctl errno=1",
        "fork ok",
        "mknod_char errno=1",
        "cuda=GPU-00000000-1111-2222-3333-444444444444",
        "token=unset",
    ];
    for w in want {
        assert!(
            stdout.lines().any(|l| l.trim() == w),
            "missing {w:?} in:\n{stdout}\n{stderr}"
        );
    }
    assert!(
        !stdout.contains("unshare-U=0"),
        "unshare -U succeeded:\n{stdout}"
    );
    let mps = stdout
        .lines()
        .find(|l| l.starts_with("mps: "))
        .expect("MPS pipe dir mounted");
    for o in ["nosuid", "nodev", "noexec"] {
        assert!(mps.contains(o), "MPS mount lacks {o}: {mps}");
    }
    let rec = env.daemon().recorded();
    assert_eq!(rec.resolves, ["tok-good"]);
    assert_eq!(rec.binds.len(), 1);
    assert_eq!(rec.binds[0].container_id, id);
    assert_eq!(
        rec.binds[0].cgroup_path,
        format!("/{}/lease-1/{id}", env.cgroup_prefix)
    );
    assert_eq!(rec.binds[0].runtime_root, env.root.to_str().unwrap());
    assert!(
        rec.reports
            .iter()
            .any(|r| r.admitted && r.lease_id == "lease-1" && r.command == "run")
    );
}

#[test]
fn baseline_container_gets_no_gpu() {
    let Some(env) = Env::new() else { return };
    let b = env.bundle("b2", &["sh", "-c", SCRIPT], None);
    let id = format!("t{}-base", std::process::id());
    let out = env.runtime(&["run", "-b", b.to_str().unwrap(), &id], None);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "run failed: {stdout}\n{stderr}");
    for w in [
        "open /dev/nvidia0 errno=2",
        "open /dev/nvidiactl errno=2",
        "NoNewPrivs:\t1",
        "Seccomp:\t2",
        "token=unset",
        "cuda=",
    ] {
        assert!(
            stdout.lines().any(|l| l.trim() == w),
            "missing {w:?} in:\n{stdout}"
        );
    }
    assert!(env.daemon().recorded().binds.is_empty());
}

/// The hardened spec in memory carries a placeholder where the built-in seccomp profile
/// goes (the profile's text is written into config.json as it is). A spec written with
/// the placeholder left in, by a path that forgot to write it in, is refused by runc:
/// no container starts without its profile.
#[test]
fn a_spec_with_the_seccomp_placeholder_left_in_is_refused_by_runc() {
    let Some(env) = Env::new() else { return };
    let b = env.bundle("b6", &["true"], None);
    let id = format!("t{}-ph", std::process::id());
    let out = env.runtime(&["create", "--bundle", b.to_str().unwrap(), &id], None);
    assert!(out.status.success(), "create: {:?}", text(&out));
    let _ = env.runtime(&["delete", "--force", &id], None);
    let mut written: Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        written["linux"]["seccomp"]["defaultAction"],
        "SCMP_ACT_ERRNO"
    );
    written["linux"]["seccomp"] = json!(tessera_runtime::harden::seccomp::BUILTIN_PLACEHOLDER);
    common::write_spec(&b, &written);
    let out = Command::new("runc")
        .arg("--root")
        .arg(&env.root)
        .args(["run", "--bundle"])
        .arg(&b)
        .arg(format!("{id}-2"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "runc ran it: {stdout}");
    assert!(stderr.contains("seccomp"), "{stderr}");
}

#[test]
fn deleting_a_container_without_a_lease_asks_the_daemon_nothing() {
    let Some(env) = Env::new() else { return };
    let b = env.bundle("b5", &["sleep", "60"], None);
    let id = format!("t{}-nolease", std::process::id());
    let out = env.runtime(&["create", "--bundle", b.to_str().unwrap(), &id], None);
    assert!(out.status.success(), "create: {:?}", text(&out));
    let out = env.runtime(&["delete", "--force", &id], None);
    assert!(out.status.success(), "delete: {:?}", text(&out));
    let rec = env.daemon().recorded();
    assert!(rec.unbinds.is_empty(), "unbinds: {:?}", rec.unbinds);
    // runc did delete it.
    let out = env.runtime(&["state", &id], None);
    assert!(!out.status.success(), "still there: {:?}", text(&out));
    // A delete of a container runc no longer has, with no record, unbinds nothing
    // (another root's container of the same id keeps its lease binding).
    let _ = env.runtime(&["delete", "--force", &id], None);
    assert!(env.daemon().recorded().unbinds.is_empty());
}

#[test]
fn bad_tokens_and_no_daemon_are_refused() {
    let Some(mut env) = Env::new() else { return };
    for (token, want) in [
        ("tok-unknown", "unknown lease token"),
        ("tok-revoked", "is REVOKED, not ACTIVE"),
        ("tok-expired", "lease token refused: lease expired"),
    ] {
        let b = env.bundle(token, &["true"], Some(token));
        let out = env.runtime(&["create", "--bundle", b.to_str().unwrap(), token], None);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{token}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
        assert!(stderr.contains(want), "{token}: {stderr}");
        let log = env.last_log();
        assert_eq!(log["level"], "error");
        assert!(log["msg"].as_str().unwrap().contains(want));
        assert!(log["time"].as_str().unwrap().ends_with('Z'));
        assert!(!env.root.join(token).exists(), "runc must not have run");
    }
    // The daemon goes away: fail closed.
    env.daemon.take();
    let b = env.bundle("nodaemon", &["true"], Some("tok-good"));
    let out = env.runtime(
        &["create", "--bundle", b.to_str().unwrap(), "nodaemon"],
        None,
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("unavailable"), "{stderr}");
}

/// A bundle `<dir>/<name>` running `true` on the shared busybox rootfs with a lease
/// token; its spec.
fn true_bundle(dir: &Path, name: &str, token: &str) -> (PathBuf, Value) {
    let b = dir.join(name);
    let mut spec = common::base_spec(&["true"]);
    spec["root"]["path"] = json!(common::bundle_rootfs(dir, &b));
    spec["annotations"] = json!({"tessera.io/lease-token": token});
    common::write_spec(&b, &spec);
    (b, spec)
}

/// tessera-runtime with `config`, runc's state under `<dir>/root`.
fn runtime_in(dir: &Path, config: &Path) -> Command {
    let mut cmd = Command::new(common::runtime_bin());
    cmd.env("TESSERA_RUNTIME_CONFIG", config)
        .arg("--root")
        .arg(dir.join("root"));
    cmd
}

#[test]
fn bind_failure_refuses() {
    if !common::can_run_as_root("bind failure", &["runc"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    common::busybox_rootfs(dir.path());
    let socket = dir.path().join("d.sock");
    let mut answers: HashMap<String, common::Answer> = HashMap::new();
    answers.insert(
        "tok".into(),
        Ok(common::lease_answer(
            "l9",
            "acme",
            &[],
            None,
            "/tessera-bindfail",
        )),
    );
    let _d = common::FakeDaemon::start_with(&socket, answers, true);
    let config = common::runtime_config(dir.path(), &socket, &dir.path().join("none"), "");
    let (b, spec) = true_bundle(dir.path(), "b", "tok");
    let tenant = std::fs::read(b.join("config.json")).unwrap();
    // The first start asks runc its version and starts it once decided; the second
    // (the version cached) starts runc while the spec is judged, and kills it.
    for id in ["x", "y"] {
        let out = runtime_in(dir.path(), &config)
            .args(["create", "--bundle"])
            .arg(&b)
            .arg(id)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1));
        assert!(stderr.contains("BindContainer failed"), "{stderr}");
        // The bundle was not rewritten, and the new config.json written while the
        // bind was under way is gone.
        assert_eq!(std::fs::read(b.join("config.json")).unwrap(), tenant);
        let on_disk: Value =
            serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
        assert_eq!(on_disk, spec);
        let mut names: Vec<String> = std::fs::read_dir(&b)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["config.json", "rootfs"],
            "left in the bundle: {names:?}"
        );
        // runc made no container.
        let state = Command::new(common::which("runc").unwrap())
            .arg("--root")
            .arg(dir.path().join("root"))
            .args(["state", id])
            .output()
            .unwrap();
        assert!(!state.status.success(), "runc created {id}");
    }
    assert!(
        dir.path().join("runtime-state/runc-version.json").exists(),
        "the version was cached for the second start"
    );
}

#[test]
fn exec_update_delete_on_a_running_container() {
    let Some(env) = Env::new() else { return };
    let b = env.bundle("b3", &["sleep", "60"], Some("tok-good"));
    // A container with fewer capabilities than the policy allows.
    let mut spec: Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    let few = json!(["CAP_KILL", "CAP_CHOWN", "CAP_NET_RAW"]);
    spec["process"]["capabilities"] = json!({"bounding": few, "effective": few, "permitted": few});
    common::write_spec(&b, &spec);
    let id = format!("t{}-exec", std::process::id());
    let out = env.runtime(&["create", "--bundle", b.to_str().unwrap(), &id], None);
    assert!(out.status.success(), "create: {:?}", text(&out));
    let out = env.runtime(&["start", &id], None);
    assert!(out.status.success(), "start: {:?}", text(&out));

    // The devices cgroup (v1) allows exactly the lease's nodes besides runc's defaults.
    let list = Path::new("/sys/fs/cgroup/devices")
        .join(&env.cgroup_prefix)
        .join("lease-1")
        .join(&id)
        .join("devices.list");
    if let Ok(list) = std::fs::read_to_string(&list) {
        assert!(list.lines().any(|l| l == "c 195:0 rw"), "{list}");
        assert!(list.lines().any(|l| l == "c 195:255 rw"), "{list}");
        assert!(!list.contains("195:1 "), "{list}");
        assert!(!list.contains("a *:* rwm"), "{list}");
    } else {
        println!("note: no cgroup v1 devices controller; devices.list not checked");
    }

    // Plain exec goes through the hardened path and keeps the hardening.
    let out = env.runtime(
        &[
            "exec",
            &id,
            "sh",
            "-c",
            "grep -E '^(NoNewPrivs|CapEff|Seccomp):' /proc/self/status; probe open /dev/nvidia1",
        ],
        None,
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "exec: {stdout} {stderr}");
    for w in [
        "NoNewPrivs:\t1",
        "Seccomp:\t2",
        "CapEff:\t0000000000000021",
        "open /dev/nvidia1 errno=2",
    ] {
        assert!(
            stdout.lines().any(|l| l.trim() == w),
            "exec: missing {w:?} in {stdout}"
        );
    }

    // An exec'd process gets the lease's environment like the init process, over
    // what its process JSON says (kubectl exec, exec probes).
    let pe = env.dir.path().join("process-env.json");
    std::fs::write(
        &pe,
        json!({"args": ["sh", "-c", "echo lease=$TESSERA_LEASE_ID; echo cuda=$CUDA_VISIBLE_DEVICES"],
               "cwd": "/", "env": ["PATH=/bin", "TESSERA_LEASE_ID=forged"], "user": {"uid": 0, "gid": 0},
               "capabilities": {"bounding": ["CAP_KILL"], "effective": ["CAP_KILL"], "permitted": ["CAP_KILL"]},
               "noNewPrivileges": true})
        .to_string(),
    )
    .unwrap();
    let out = env.runtime(&["exec", "--process", pe.to_str().unwrap(), &id], None);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "exec env: {stdout} {stderr}");
    assert!(stdout.lines().any(|l| l == "lease=lease-1"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("cuda=") && l.len() > 5),
        "{stdout}"
    );

    // Without --process (runc builds the process from config.json plus each --env),
    // the lease's variables still win over the caller's.
    let out = env.runtime(
        &[
            "exec",
            "-e",
            "TESSERA_LEASE_ID=forged",
            "-e=CUDA_VISIBLE_DEVICES=all",
            &id,
            "sh",
            "-c",
            "echo lease=$TESSERA_LEASE_ID; echo cuda=$CUDA_VISIBLE_DEVICES",
        ],
        None,
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "exec --env: {stdout} {stderr}");
    assert!(stdout.lines().any(|l| l == "lease=lease-1"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("cuda=") && l.len() > 5 && l != "cuda=all"),
        "{stdout}"
    );

    // --cap is refused.
    let out = env.runtime(&["exec", "--cap", "CAP_SYS_ADMIN", &id, "true"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).1.contains("exec --cap CAP_SYS_ADMIN is refused"));

    // A --process JSON asking for more than the container has is refused.
    let p = env.dir.path().join("process.json");
    let proc_json = |caps: Value, nnp: bool| {
        json!({"args": ["sh", "-c", "grep -E '^(NoNewPrivs|CapEff):' /proc/self/status"],
               "cwd": "/", "env": ["PATH=/bin"], "user": {"uid": 0, "gid": 0},
               "capabilities": caps, "noNewPrivileges": nnp})
    };
    std::fs::write(
        &p,
        proc_json(
            json!({"bounding": ["CAP_SYS_ADMIN"], "effective": ["CAP_SYS_ADMIN"]}),
            true,
        )
        .to_string(),
    )
    .unwrap();
    let out = env.runtime(&["exec", "--process", p.to_str().unwrap(), &id], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).1.contains("forbidden capability CAP_SYS_ADMIN"),
        "{:?}",
        text(&out)
    );
    std::fs::write(
        &p,
        proc_json(json!({"bounding": ["CAP_SETUID"]}), true).to_string(),
    )
    .unwrap();
    let out = env.runtime(&["exec", "-p", p.to_str().unwrap(), &id], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out)
            .1
            .contains("CAP_SETUID, which the container does not have"),
        "{:?}",
        text(&out)
    );
    // What containerd sends (the unreduced sets): reduced to the container's, and runs.
    let unreduced = json!(["CAP_KILL", "CAP_CHOWN", "CAP_NET_RAW", "CAP_MKNOD"]);
    std::fs::write(
        &p,
        proc_json(
            json!({"bounding": unreduced, "effective": unreduced, "permitted": unreduced}),
            true,
        )
        .to_string(),
    )
    .unwrap();
    let out = env.runtime(&["exec", "-p", p.to_str().unwrap(), &id], None);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout} {stderr}");
    assert!(stdout.contains("CapEff:\t0000000000000021"), "{stdout}");

    // noNewPrivileges=false in the process JSON is forced back on.
    std::fs::write(
        &p,
        proc_json(
            json!({"bounding": ["CAP_KILL"], "effective": ["CAP_KILL"], "permitted": ["CAP_KILL"]}),
            false,
        )
        .to_string(),
    )
    .unwrap();
    let out = env.runtime(&["exec", "--process", p.to_str().unwrap(), &id], None);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout} {stderr}");
    assert!(stdout.contains("NoNewPrivs:\t1"), "{stdout}");
    assert!(stdout.contains("CapEff:\t0000000000000020"), "{stdout}");

    // update: a rule that allows a device and a pids limit of 0 are refused; what
    // containerd's CRI sends (a deny-all device rule with CPU and memory) passes
    // and the container keeps its devices; memory passes (read from stdin).
    let out = env.runtime(
        &["update", "--resources", "-", &id],
        Some(r#"{"devices":[{"allow":true,"access":"rwm"}]}"#),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).1.contains("update may not allow a device"));
    let out = env.runtime(
        &["update", "--resources", "-", &id],
        Some(r#"{"devices":[{"allow":false,"access":"rwm"}],"cpu":{"shares":512},"memory":{"limit":268435456}}"#),
    );
    assert!(out.status.success(), "CRI-style update: {:?}", text(&out));
    // With the device plugin's rule for the lease's own device too (what containerd
    // sends for a GPU pod): accepted; a device beyond the lease's is refused by index.
    let out = env.runtime(
        &["update", "--resources=-", &id],
        Some(r#"{"devices":[{"allow":false,"access":"rwm"},{"allow":true,"type":"c","major":195,"minor":0,"access":"rw"}],"cpu":{"shares":256,"cpus":"0"},"memory":{"limit":134217728}}"#),
    );
    assert!(out.status.success(), "CRI GPU update: {:?}", text(&out));
    let cg = |ctl: &str, file: &str| {
        std::fs::read_to_string(
            Path::new("/sys/fs/cgroup")
                .join(ctl)
                .join(&env.cgroup_prefix)
                .join("lease-1")
                .join(&id)
                .join(file),
        )
        .ok()
    };
    if let Some(limit) = cg("memory", "memory.limit_in_bytes") {
        assert_eq!(limit.trim(), "134217728", "memory changed");
    }
    if let Some(list) = cg("devices", "devices.list") {
        assert!(list.lines().any(|l| l == "c 195:0 rw"), "{list}");
        assert!(
            list.lines().any(|l| l == "c 195:255 rw"),
            "the lease's rules stay: {list}"
        );
        assert!(!list.contains("a *:* rwm"), "{list}");
    }
    let out = env.runtime(
        &["update", "--resources", "-", &id],
        Some(r#"{"devices":[{"allow":false,"access":"rwm"},{"allow":true,"type":"c","major":195,"minor":1,"access":"rw"}]}"#),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).1.contains("/devices/1"), "{:?}", text(&out));
    let out = env.runtime(
        &["update", "--resources", "-", &id],
        Some(r#"{"blockIO":{"weight":10}}"#),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out)
            .1
            .contains("/blockIO: update may change CPU, memory, pids, hugepages and cpuset only"),
        "{:?}",
        text(&out)
    );
    let out = env.runtime(&["update", "--pids-limit", "0", &id], None);
    assert_eq!(out.status.code(), Some(1));
    let out = env.runtime(
        &["update", "-r", "-", &id],
        Some(r#"{"memory":{"limit":268435456}}"#),
    );
    assert!(out.status.success(), "update memory: {:?}", text(&out));

    // delete unbinds.
    let out = env.runtime(&["delete", "--force", &id], None);
    assert!(out.status.success(), "delete: {:?}", text(&out));
    assert!(env.daemon().recorded().unbinds.contains(&id));
    let _ = &env.dev;
}

#[test]
fn pass_through_commands_reach_runc() {
    let Some(env) = Env::new() else { return };
    let out = env.runtime(&["--version"], None);
    assert!(text(&out).0.contains("runc version"), "{:?}", text(&out));
    let out = env.runtime(&["list", "--format", "json"], None);
    assert!(out.status.success(), "{:?}", text(&out));
    let out = env.runtime(&["state", "nonexistent-container"], None);
    assert!(!out.status.success());
}

/// Neutralized, for real: a spec that asks for sysfs and the cgroup tree read-write
/// gets them read-only from runc, so a container cannot raise its own limits.
#[test]
fn sysfs_and_cgroup_asked_read_write_are_mounted_read_only() {
    let Some(env) = Env::new() else { return };
    // cgroup v1 (runc mounts each hierarchy under a tmpfs) or v2: the pids limit file.
    let script = "grep -E ' /sys(/fs/cgroup)? ' /proc/mounts; \
                  for f in /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max; do \
                    [ -e $f ] || continue; \
                    if echo 1 > $f 2>/dev/null; then echo WROTE $f; else echo REFUSED $f; fi; \
                  done";
    let b = env.bundle("rw-sys", &["sh", "-c", script], None);
    let mut spec: Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    for m in spec["mounts"].as_array_mut().unwrap() {
        if m["type"] == "sysfs" {
            m["options"] = json!(["rw", "nosuid", "nodev", "noexec"]);
        }
    }
    spec["mounts"].as_array_mut().unwrap().push(json!({
        "destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["rw", "nosuid", "nodev", "noexec"]
    }));
    common::write_spec(&b, &spec);
    let id = format!("t{}-rwsys", std::process::id());
    let out = env.runtime(&["run", "-b", b.to_str().unwrap(), &id], None);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "run failed: {stdout}\n{stderr}");
    let sys = stdout
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("/sys"))
        .unwrap_or_else(|| panic!("no /sys mount in:\n{stdout}"));
    let opts = sys.split_whitespace().nth(3).unwrap_or("");
    assert!(
        opts.split(',').any(|o| o == "ro"),
        "/sys is not read-only: {sys}"
    );
    assert!(
        !stdout.contains("WROTE"),
        "the container wrote its pids limit:\n{stdout}"
    );
    if !stdout.contains("REFUSED") {
        eprintln!("note: no pids.max visible in the container on this host (checked /sys only)");
    }
}

/// A kept ResolveToken answer counts only when the daemon confirms at bind that it
/// compared it with its own (`resolution_checked`). Here the daemon's answers say it
/// checks, but its binds never confirm (a tesserad downgraded since the answer was
/// kept): the second start unbinds, forgets the kept answer, resolves again and binds
/// again, and the container still starts.
#[test]
fn a_kept_answer_the_daemon_does_not_confirm_is_not_relied_on() {
    if !common::can_run_as_root("unconfirmed kept answer", &["runc", "busybox"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    common::busybox_rootfs(dir.path());
    let socket = dir.path().join("d.sock");
    let mut answer = common::lease_answer("l7", "acme", &[], None, "/tessera-unconfirmed");
    answer.bind_checks_resolution = true;
    let mut answers: HashMap<String, common::Answer> = HashMap::new();
    answers.insert("tok".into(), Ok(answer));
    let d = common::FakeDaemon::start(&socket, answers);
    let config = common::runtime_config(dir.path(), &socket, &dir.path().join("none"), "");
    let kept = tessera_runtime::lease::cache::AnswerCache::new(&dir.path().join("runtime-state"))
        .path_of("tok");
    let start = |id: &str| {
        let (b, _) = true_bundle(dir.path(), id, "tok");
        let out = runtime_in(dir.path(), &config)
            .args(["run", "--bundle"])
            .arg(&b)
            .arg(id)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{id}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    start("first");
    assert!(kept.exists(), "the first start keeps the answer");
    let before = d.recorded();
    assert_eq!((before.resolves.len(), before.binds.len()), (1, 1));
    assert!(
        before.binds[0].resolved.is_some(),
        "the bind carries the answer"
    );
    start("second");
    let rec = d.recorded();
    assert_eq!(rec.binds.len(), 3, "the unconfirmed bind, then a fresh one");
    assert_eq!(
        rec.resolves.len(),
        2,
        "asked again after the unconfirmed bind"
    );
    // The unconfirmed bind is undone before runc runs; each `run` that ended (runc
    // deleted its container) is unbound after.
    assert_eq!(
        rec.unbinds,
        ["first", "second", "second"],
        "the unconfirmed bind is undone"
    );
}

/// The uid, gid and groups lines of /proc/self/status, as `Uid: 1000 1000 1000 1000`.
const IDS: &str = "grep -E '^(Uid|Gid|Groups):' /proc/self/status | tr -s '\\t ' ' '";

/// issue 31: what runc is handed for exec and update is the runtime's own, judged by
/// what really happened in the container (its ids, its cgroup's pids.max).
#[test]
fn exec_and_update_escapes_are_refused_or_neutralized_under_runc() {
    let Some(env) = Env::new() else { return };
    let b = env.bundle("b-esc", &["sleep", "60"], Some("tok-good"));
    let mut spec: Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    spec["process"]["user"] = json!({"uid": 1000, "gid": 1000, "additionalGids": [1000]});
    spec["linux"]["resources"]["pids"] = json!({"limit": 64});
    common::write_spec(&b, &spec);
    let id = format!("t{}-esc", std::process::id());
    let out = env.runtime(&["create", "--bundle", b.to_str().unwrap(), &id], None);
    assert!(out.status.success(), "create: {:?}", text(&out));
    let out = env.runtime(&["start", &id], None);
    assert!(out.status.success(), "start: {:?}", text(&out));
    let pids_max = || {
        std::fs::read_to_string(
            Path::new("/sys/fs/cgroup/pids")
                .join(&env.cgroup_prefix)
                .join("lease-1")
                .join(&id)
                .join("pids.max"),
        )
        .or_else(|_| {
            std::fs::read_to_string(
                Path::new("/sys/fs/cgroup")
                    .join(&env.cgroup_prefix)
                    .join("lease-1")
                    .join(&id)
                    .join("pids.max"),
            )
        })
        .expect("the container's pids.max")
        .trim()
        .to_string()
    };
    assert_eq!(pids_max(), "64", "granted at create");

    // A process JSON with no user, only a gid, only a uid, or no --process at all:
    // the process runs as the container's 1000:1000 with its groups, never as root.
    let own = [
        "Uid: 1000 1000 1000 1000",
        "Gid: 1000 1000 1000 1000",
        "Groups: 1000",
    ];
    let p = env.dir.path().join("p-esc.json");
    for user in [
        None,
        Some(json!({"gid": 1000})),
        Some(json!({"uid": 1000})),
        Some(json!({})),
    ] {
        let mut proc_json = json!({"args": ["sh", "-c", IDS], "cwd": "/", "env": ["PATH=/bin"]});
        if let Some(u) = &user {
            proc_json["user"] = u.clone();
        }
        std::fs::write(&p, proc_json.to_string()).unwrap();
        let out = env.runtime(&["exec", "--process", p.to_str().unwrap(), &id], None);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{user:?}: {stdout} {stderr}");
        let got: Vec<&str> = stdout.lines().map(str::trim).collect();
        assert_eq!(got, own, "user {user:?}");
    }
    let out = env.runtime(&["exec", &id, "sh", "-c", IDS], None);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout} {stderr}");
    assert_eq!(stdout.lines().map(str::trim).collect::<Vec<_>>(), own);

    // Root's group, or any group the container did not start with, by flag or JSON,
    // and a flag that moves the process to another cgroup: refused, nothing runs.
    // The container's user may write /tmp (shared with this test through the
    // rootfs): a refused exec that ran anyway would leave its marker there.
    let marker = b.join("rootfs/tmp/ran");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            b.join("rootfs/tmp"),
            std::fs::Permissions::from_mode(0o1777),
        )
        .unwrap();
    }
    let touch = "touch /tmp/ran".to_string();
    for (args, want) in [
        (vec!["exec", "-g", "0"], "--additional-gids 0"),
        (vec!["exec", "--additional-gids=0"], "--additional-gids 0"),
        (vec!["exec", "-g", "27"], "--additional-gids 27"),
        (vec!["exec", "--user", "1000:0"], "--user 1000:0"),
        (vec!["exec", "-u", "0"], "--user 0"),
        (vec!["exec", "--cgroup", "pids:/"], "--cgroup"),
        (
            vec!["exec", "-u", "1000", "--user", "1000"],
            "given more than once",
        ),
    ] {
        let mut argv = args.clone();
        argv.extend([id.as_str(), "sh", "-c", touch.as_str()]);
        let out = env.runtime(&argv, None);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {:?}", text(&out));
        assert!(text(&out).1.contains(want), "{args:?}: {:?}", text(&out));
        assert!(!marker.exists(), "{args:?} ran");
    }
    for (user, want) in [
        (
            json!({"uid": 1000, "gid": 1000, "additionalGids": [0]}),
            "/process/user/additionalGids/0",
        ),
        (json!({"gid": 0}), "/process/user/gid"),
        (json!({"uid": 1000, "GID": 0}), "/process/user/GID"),
    ] {
        std::fs::write(
            &p,
            json!({"args": ["sh", "-c", touch], "cwd": "/", "user": user}).to_string(),
        )
        .unwrap();
        let out = env.runtime(&["exec", "-p", p.to_str().unwrap(), &id], None);
        assert_eq!(out.status.code(), Some(1), "{user}: {:?}", text(&out));
        assert!(text(&out).1.contains(want), "{user}: {:?}", text(&out));
        assert!(!marker.exists(), "{user} ran");
    }
    // Two spellings of one key (Go reads the last): refused by its path.
    std::fs::write(
        &p,
        r#"{"args": ["sh", "-c", "touch /tmp/ran"], "cwd": "/", "user": {"uid": 1000, "gid": 1000, "GID": 0}}"#,
    )
    .unwrap();
    let out = env.runtime(&["exec", "-p", p.to_str().unwrap(), &id], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out)
            .1
            .contains(r#"/user: keys "gid" and "GID" are one key to runc"#),
        "{:?}",
        text(&out)
    );
    assert!(!marker.exists());
    // The marker is made when an exec does run (the checks above could fail).
    let out = env.runtime(&["exec", &id, "sh", "-c", &touch], None);
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(marker.exists(), "an admitted exec leaves its marker");

    // update: runc reads the runtime's JSON, bounded by the container's grant.
    for (doc, want) in [
        (
            r#"{"pids":{"limit":100,"LIMIT":-1}}"#,
            r#"keys "limit" and "LIMIT""#,
        ),
        (r#"{"pids":{"Limit":999999}}"#, "/pids/Limit"),
        (r#"{"pids":{"limit":100}}"#, "/pids/limit: 100"),
        (r#"{"pids":{"limit":-1}}"#, "/pids/limit: -1"),
        (
            r#"{"pids":{"limit":32},"pids":{"limit":-1}}"#,
            "duplicate key",
        ),
    ] {
        let out = env.runtime(&["update", "--resources", "-", &id], Some(doc));
        assert_eq!(out.status.code(), Some(1), "{doc}: {:?}", text(&out));
        assert!(text(&out).1.contains(want), "{doc}: {:?}", text(&out));
        assert_eq!(pids_max(), "64", "{doc}");
    }
    let out = env.runtime(
        &["update", "-r", "-", &id],
        Some(r#"{"pids":{"limit":32}}"#),
    );
    assert!(out.status.success(), "{:?}", text(&out));
    assert_eq!(pids_max(), "32");
    for args in [
        vec!["update", "--pids-limit", "-1"],
        vec!["update", "--pids-limit=max"],
        vec!["update", "--pids-limit", "65"],
        vec!["update", "--pids-limit", "16", "--pids-limit", "-1"],
    ] {
        let mut argv = args.clone();
        argv.push(&id);
        let out = env.runtime(&argv, None);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {:?}", text(&out));
        assert_eq!(pids_max(), "32", "{args:?}");
    }
    // A single-dash long flag is read as runc reads it and given to runc as the
    // runtime's own JSON.
    let out = env.runtime(&["update", "-pids-limit", "16", &id], None);
    assert!(out.status.success(), "{:?}", text(&out));
    assert_eq!(pids_max(), "16");

    let out = env.runtime(&["delete", "--force", &id], None);
    assert!(out.status.success(), "delete: {:?}", text(&out));
    // No record after delete: exec and update are refused (fail closed).
    let out = env.runtime(&["update", "--pids-limit", "8", &id], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).1.contains("no record"), "{:?}", text(&out));
}

/// issue 31: a config.json with two keys runc's Go decoder reads as one (it matches
/// keys case-insensitively, with Unicode folds, and keeps the last) never reaches
/// runc; nor do create flags that loosen every container.
#[test]
fn config_json_keys_runc_would_read_otherwise_are_refused() {
    let Some(env) = Env::new() else { return };
    for (n, from, to, want) in [
        (
            "nnp",
            r#""noNewPrivileges":true"#,
            r#""noNewPrivileges":true,"NoNewPrivileges":false"#,
            r#"/process: keys "noNewPrivileges" and "NoNewPrivileges""#,
        ),
        (
            "seccomp",
            r#""linux":{"#,
            "\"linux\":{\"\\u017feccomp\":null,\"seccomp\":null,",
            "/linux: keys \"\u{17f}eccomp\" and \"seccomp\"",
        ),
        (
            "dup",
            r#""uid":0"#,
            r#""uid":1000,"uid":0"#,
            r#"/process/user: duplicate key "uid""#,
        ),
    ] {
        let b = env.bundle(&format!("b-fold-{n}"), &["true"], None);
        let raw = std::fs::read_to_string(b.join("config.json")).unwrap();
        let raw = serde_json::to_string(&serde_json::from_str::<Value>(&raw).unwrap()).unwrap();
        assert!(raw.contains(from), "{n}: {from} not in {raw}");
        std::fs::write(b.join("config.json"), raw.replacen(from, to, 1)).unwrap();
        let id = format!("t{}-fold-{n}", std::process::id());
        let out = env.runtime(&["create", "--bundle", b.to_str().unwrap(), &id], None);
        assert_eq!(out.status.code(), Some(1), "{n}: {:?}", text(&out));
        assert!(text(&out).1.contains(want), "{n}: {:?}", text(&out));
        let state = Command::new("runc")
            .arg("--root")
            .arg(&env.root)
            .args(["state", &id])
            .output()
            .unwrap();
        assert!(!state.status.success(), "runc created {id}");
    }
    let b = env.bundle("b-pivot", &["true"], None);
    for flag in ["--no-pivot", "--no-new-keyring"] {
        let id = format!("t{}-pivot", std::process::id());
        let out = env.runtime(
            &["create", flag, "--bundle", b.to_str().unwrap(), &id],
            None,
        );
        assert_eq!(out.status.code(), Some(1), "{flag}: {:?}", text(&out));
        assert!(
            text(&out).1.contains(&format!("{flag} is refused")),
            "{:?}",
            text(&out)
        );
    }
}
