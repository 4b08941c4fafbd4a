//! What the real runtime receives: the argv the runtime rebuilt from what it parsed, a
//! clean environment, only fds 0-2 (plus --preserve-fds), and for `exec` and `update`
//! a process or resources JSON the runtime wrote itself. A recording script stands in
//! for runc (root only to keep a container's record and runc's version).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use serde_json::{Value, json};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fake_runc(dir: &Path) -> PathBuf {
    let p = dir.join("fake-runc");
    std::fs::write(
        &p,
        concat!(
            // As runc does: `create` and `run` read the bundle's config.json first, and
            // an empty one (the runtime closed it without a spec) ends it.
            "#!/bin/sh\nb=.\nprev=\nfor a in \"$@\"; do if [ \"$prev\" = --bundle ] || [ \"$prev\" = -b ]; then b=$a; fi; case $a in --bundle=*) b=${a#--bundle=};; esac; prev=$a; done\n",
            "case \" $* \" in *\" create \"*|*\" run \"*) IFS= read -r spec < \"$b/config.json\"; if [ -z \"$spec\" ]; then echo 'runc: config.json: unexpected EOF' >&2; exit 1; fi; echo \"spec: $spec\" ;; esac\n",
            // As runc does under a --root: create and run leave the container's
            // state.json (this process as its init), delete removes it.
            "root=/run/runc\nfor a in \"$@\"; do case $a in --root=*) root=${a#--root=};; esac; last=$a; done\n",
            "if [ \"$root\" != /run/runc ]; then case \" $* \" in *\" create \"*|*\" run \"*) mkdir -p \"$root/$last\"; printf '{\"id\":\"%s\",\"init_process_pid\":%s,\"init_process_start\":%s,\"config\":{\"labels\":[],\"cgroups\":{\"path\":\"\"}}}' \"$last\" $$ \"$(cut -d' ' -f22 /proc/$$/stat)\" > \"$root/$last/state.json\" ;; *\" delete \"*) rm -rf \"$root/$last\" ;; esac; fi\n",
            "echo \"argv: $*\"\nfor f in /proc/$$/fd/*; do echo \"fd: ${f##*/}\"; done\nenv | sort | sed 's/^/env: /'\nfor a in \"$@\"; do case $a in --resources=*|--process=*) f=${a#*=}; echo \"doc: $(cat $f)\"; echo \"mode: $(stat -L -c '%a %u %h' $f)\";; esac; done\n",
        ),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn setup() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let runc = fake_runc(dir.path());
    let cfg = dir.path().join("runtime.toml");
    std::fs::write(
        &cfg,
        format!(
            "runc_path = {runc:?}\nstate_dir = {:?}\ndaemon_socket = {:?}\nrunc_cve_acknowledged = [\"CVE-2025-31133\", \"CVE-2025-52565\", \"CVE-2025-52881\"]\n[policy]\napparmor = \"if-available\"\n",
            dir.path().join("runtime-state"),
            dir.path().join("none.sock")
        ),
    )
    .unwrap();
    (dir, cfg)
}

fn run(cfg: &Path, args: &[&str], extra_fd: bool) -> Output {
    let mut cmd = Command::new(common::runtime_bin());
    cmd.env_clear()
        .env("TESSERA_RUNTIME_CONFIG", cfg)
        .env("SECRET_FROM_CONTAINERD", "x")
        .env("LD_PRELOAD", "/tmp/evil.so")
        .env("NOTIFY_SOCKET", "/run/notify")
        .args(args);
    if extra_fd {
        // SAFETY: dup2 in the child between fork and exec only duplicates stdout onto
        // fds 7 and 8; it allocates nothing.
        unsafe {
            cmd.pre_exec(|| {
                if libc::dup2(1, 7) < 0 || libc::dup2(1, 8) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    cmd.output().unwrap()
}

/// The standard fds a caller left closed are open (/dev/null) when runc starts, as Rust's
/// own start-up would have made them: a closed fd 0 would otherwise be the next file the
/// runtime opens.
#[test]
fn closed_standard_fds_are_held_open_with_dev_null() {
    let (d, cfg) = setup();
    // This runc says what its fd 0 is (the shell moves its script's fd above 9).
    std::fs::write(
        d.path().join("fake-runc"),
        "#!/bin/sh\necho \"fd0: $(readlink /proc/$$/fd/0 || echo closed)\"\n",
    )
    .unwrap();
    let mut cmd = Command::new(common::runtime_bin());
    cmd.env_clear()
        .env("TESSERA_RUNTIME_CONFIG", &cfg)
        .args(["state", "c1"]);
    // SAFETY: close(0) in the child between fork and exec allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            if libc::close(0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(lines(&out, "fd0: "), ["/dev/null"], "{out:?}");
}

fn lines(o: &Output, prefix: &str) -> Vec<String> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix(prefix).map(str::to_string))
        .collect()
}

#[test]
fn argv_env_and_fds_are_clean() {
    let (_d, cfg) = setup();
    let out = run(
        &cfg,
        &[
            "--root",
            "/r",
            "--log-format=json",
            "kill",
            "--all",
            "abc",
            "KILL",
        ],
        true,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        lines(&out, "argv: "),
        ["--root=/r --log-format=json kill --all abc KILL"]
    );
    let fds = lines(&out, "fd: ");
    // 0-2, plus the one the shell's glob opened for /proc/$$/fd itself at most.
    assert!(
        !fds.iter().any(|f| f == "7" || f == "8"),
        "leaked fds: {fds:?}"
    );
    let env = lines(&out, "env: ");
    assert!(
        env.iter().any(|e| e.starts_with("PATH=/usr/local/sbin:")),
        "{env:?}"
    );
    assert!(
        env.iter().any(|e| e == "NOTIFY_SOCKET=/run/notify"),
        "{env:?}"
    );
    assert!(
        !env.iter()
            .any(|e| e.starts_with("LD_PRELOAD") || e.starts_with("SECRET_FROM")),
        "{env:?}"
    );
    assert!(
        !env.iter().any(|e| e.starts_with("TESSERA_RUNTIME_CONFIG")),
        "{env:?}"
    );
}

#[test]
fn preserve_fds_are_kept() {
    let (d, cfg) = setup();
    let b = d.path().join("b");
    std::fs::create_dir_all(b.join("rootfs")).unwrap();
    common::write_spec(&b, &common::base_spec(&["true"]));
    let out = run(
        &cfg,
        &[
            "create",
            "--preserve-fds",
            "5",
            "--bundle",
            b.to_str().unwrap(),
            "c1",
        ],
        true,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fds = lines(&out, "fd: ");
    assert!(
        fds.iter().any(|f| f == "7"),
        "preserved fd 7 closed: {fds:?}"
    );
    // The bundle was hardened before runc saw it.
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    assert_eq!(spec["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ERRNO");
}

/// Create a container through the runtime (the fake runc), so that it has a record.
/// Create container `id` under the root `<d>/root` (returned, as `--root=...`), where
/// the fake runc leaves its state.json.
fn created(d: &Path, cfg: &Path, id: &str, user: Value) -> String {
    let b = d.join(format!("b-{id}"));
    std::fs::create_dir_all(b.join("rootfs")).unwrap();
    let mut spec = common::base_spec(&["sleep", "60"]);
    spec["process"]["user"] = user;
    common::write_spec(&b, &spec);
    let root = format!("--root={}", d.join("root").display());
    let out = run(
        cfg,
        &[&root, "create", "--bundle", b.to_str().unwrap(), id],
        false,
    );
    assert!(out.status.success(), "{out:?}");
    root
}

#[test]
fn update_gives_runc_only_the_runtimes_own_resources_json() {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED: only root keeps a container's record");
        return;
    }
    let (d, cfg) = setup();
    let id = format!("upd-{}", std::process::id());
    let r = d.path().join("res.json");
    std::fs::write(&r, r#"{"memory":{"limit":1048576}}"#).unwrap();
    // No record of a create: refused, runc never runs.
    let out = run(
        &cfg,
        &["update", "--resources", r.to_str().unwrap(), &id],
        false,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no record of its create"));
    assert!(lines(&out, "argv: ").is_empty());
    let root = created(d.path(), &cfg, &id, json!({"uid": 0, "gid": 0}));
    for (args, stdin_doc, want) in [
        (
            vec!["update", "--resources", r.to_str().unwrap()],
            None,
            r#"{"memory":{"limit":1048576}}"#,
        ),
        // Spaces, escapes and key order are the tenant's; the bytes runc reads are not.
        (
            vec!["update", "-r", "-"],
            Some(r#"{ "pids" : { "limit" : 100 }, "cpu": {"shares": 2}, "blockIO": {} }"#),
            r#"{"cpu":{"shares":2},"pids":{"limit":100}}"#,
        ),
        (
            vec!["update", "-pids-limit", "50", "--memory=1m"],
            None,
            r#"{"memory":{"limit":1048576},"pids":{"limit":50}}"#,
        ),
    ] {
        let mut argv = vec![root.as_str()];
        argv.extend(args.iter().copied());
        argv.push(&id);
        let out = match stdin_doc {
            None => run(&cfg, &argv, false),
            Some(doc) => {
                let mut cmd = Command::new(common::runtime_bin());
                cmd.env_clear()
                    .env("TESSERA_RUNTIME_CONFIG", &cfg)
                    .args(&argv)
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped());
                let mut child = cmd.spawn().unwrap();
                std::io::Write::write_all(&mut child.stdin.take().unwrap(), doc.as_bytes())
                    .unwrap();
                child.wait_with_output().unwrap()
            }
        };
        assert!(out.status.success(), "{args:?}: {out:?}");
        let argv_seen = lines(&out, "argv: ");
        assert_eq!(argv_seen.len(), 1, "{out:?}");
        let (head, tail) = argv_seen[0].split_once("/proc/self/fd/").unwrap();
        assert_eq!(head, format!("{root} update --resources="), "{argv_seen:?}");
        assert!(tail.ends_with(&format!(" {id}")), "{argv_seen:?}");
        assert_eq!(lines(&out, "doc: "), [want], "{args:?}");
        // Root's own file, private, unlinked.
        assert_eq!(lines(&out, "mode: "), ["600 0 0"], "{args:?}");
    }
    for (doc, want) in [
        (r#"{"memory":{},"memory":{},"devices":[]}"#, "duplicate key"),
        (
            r#"{"pids":{"limit":100,"LIMIT":-1}}"#,
            r#"keys "limit" and "LIMIT" are one key to runc"#,
        ),
        (
            r#"{"pids":{"Limit":999999}}"#,
            "/pids/Limit: unknown resources key",
        ),
    ] {
        std::fs::write(&r, doc).unwrap();
        let out = run(
            &cfg,
            &[&root, "update", "-r", r.to_str().unwrap(), &id],
            false,
        );
        assert_eq!(out.status.code(), Some(1), "{doc}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(want),
            "{doc}: {out:?}"
        );
        assert!(lines(&out, "argv: ").is_empty());
    }
    // delete forgets the record: no update after it.
    let out = run(&cfg, &[&root, "delete", &id], false);
    assert!(out.status.success(), "{out:?}");
    std::fs::write(&r, r#"{"memory":{"limit":1048576}}"#).unwrap();
    let out = run(
        &cfg,
        &[&root, "update", "-r", r.to_str().unwrap(), &id],
        false,
    );
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn argv_runc_would_read_otherwise_is_refused_before_runc_runs() {
    let (_d, cfg) = setup();
    for (args, want) in [
        (
            vec!["--root", "/a", "-root", "/b", "kill", "c1"],
            "--root is given more than once",
        ),
        (vec!["--criu", "/tmp/x", "state", "c1"], "--criu is refused"),
        (vec!["--bogus", "state", "c1"], "unknown flag --bogus"),
        (
            vec!["checkpoint", "--image-path", "/etc", "c1"],
            "checkpoint is refused",
        ),
        (vec!["pwn", "c1"], "unknown command \"pwn\""),
        (
            vec!["kill", "--all", "-a", "c1", "KILL"],
            "--all is given more than once",
        ),
        (
            vec!["spec", "--bundle", "/etc", "-b", "/root"],
            "--bundle is given more than once",
        ),
        (
            vec!["update", "-r", "/a", "--resources=/b", "c1"],
            "--resources is given more than once",
        ),
    ] {
        let out = run(&cfg, &args, false);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(want),
            "{args:?}: {out:?}"
        );
        assert!(lines(&out, "argv: ").is_empty(), "{args:?}: runc ran");
    }
}

#[test]
fn exec_gives_runc_a_process_the_runtime_wrote_with_the_containers_user() {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED: only root keeps a container's record");
        return;
    }
    let (d, cfg) = setup();
    let id = format!("exe-{}", std::process::id());
    let root = created(
        d.path(),
        &cfg,
        &id,
        json!({"uid": 1000, "gid": 1000, "additionalGids": [44]}),
    );
    let out = run(
        &cfg,
        &[
            &root,
            "exec",
            "-t",
            "-d",
            "--pid-file",
            "/p",
            &id,
            "id",
            "-G",
        ],
        false,
    );
    assert!(out.status.success(), "{out:?}");
    let argv_seen = lines(&out, "argv: ");
    let (head, tail) = argv_seen[0].split_once("/proc/self/fd/").unwrap();
    assert_eq!(
        head,
        format!("{root} exec --detach --pid-file=/p --process="),
        "{argv_seen:?}"
    );
    assert!(tail.ends_with(&format!(" {id}")), "{argv_seen:?}");
    let doc: Value = serde_json::from_str(&lines(&out, "doc: ")[0]).unwrap();
    assert_eq!(
        doc["user"],
        json!({"uid": 1000, "gid": 1000, "additionalGids": [44]})
    );
    assert_eq!(doc["args"], json!(["id", "-G"]));
    assert_eq!(doc["terminal"], true);
    assert_eq!(lines(&out, "mode: "), ["600 0 0"]);
    for line in [
        vec!["exec", "-g", "0"],
        vec!["exec", "--user", "1000:0"],
        vec!["exec", "--cgroup", "/x"],
        vec!["exec", "-u", "1000", "--user", "1000"],
    ] {
        let mut argv = vec![root.as_str()];
        argv.extend(line.iter().copied());
        argv.extend([id.as_str(), "id"]);
        let out = run(&cfg, &argv, false);
        assert_eq!(out.status.code(), Some(1), "{line:?}: {out:?}");
        assert!(lines(&out, "argv: ").is_empty());
    }
    let _ = run(&cfg, &[&root, "delete", &id], false);
}

#[test]
fn bad_config_refuses_to_start() {
    let (d, _) = setup();
    let cfg = d.path().join("bad.toml");
    std::fs::write(&cfg, "runc_path = \"/usr/sbin/runc\"\nunknown_knob = 1\n").unwrap();
    let out = run(&cfg, &["state", "x"], false);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown_knob"));
    let out = run(&d.path().join("missing.toml"), &["state", "x"], false);
    assert_eq!(out.status.code(), Some(64));
}

#[test]
fn check_text_output_lists_every_reason() {
    let (d, cfg) = setup();
    let b = d.path().join("b");
    std::fs::create_dir_all(b.join("rootfs")).unwrap();
    let mut spec = common::base_spec(&["true"]);
    spec["process"]["capabilities"]["bounding"] = serde_json::json!(["CAP_SYS_ADMIN"]);
    spec["hooks"] = serde_json::json!({"prestart": [{"path": "/bin/x"}]});
    common::write_spec(&b, &spec);
    let out = run(&cfg, &["check", "--bundle", b.to_str().unwrap()], false);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("refused\n"), "{text}");
    assert!(
        text.contains("reason: the spec asks for the forbidden capability CAP_SYS_ADMIN"),
        "{text}"
    );
    assert!(
        text.contains("reason: OCI hooks are not allowed in a tenant spec: prestart (/bin/x)"),
        "{text}"
    );
}

#[test]
fn a_writable_runtime_binary_is_refused() {
    let (d, cfg) = setup();
    std::fs::set_permissions(
        d.path().join("fake-runc"),
        std::fs::Permissions::from_mode(0o777),
    )
    .unwrap();
    let out = run(&cfg, &["state", "x"], false);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("writable by others"));
}

#[test]
fn no_token_policy_refuse() {
    let (d, _) = setup();
    let cfg = d.path().join("refuse.toml");
    std::fs::write(
        &cfg,
        format!(
            "runc_path = {:?}\nstate_dir = {:?}\nrunc_cve_acknowledged = [\"CVE-2025-31133\", \"CVE-2025-52565\", \"CVE-2025-52881\"]\n[policy]\napparmor = \"if-available\"\nno_token = \"refuse\"\ncri_runc_roots = [\"/run/runc\"]\nkubepods_roots = [\"/tessera-passthrough\"]\n",
            d.path().join("fake-runc"),
            d.path().join("runtime-state")
        ),
    )
    .unwrap();
    let b = d.path().join("b");
    std::fs::create_dir_all(b.join("rootfs")).unwrap();
    common::write_spec(&b, &common::base_spec(&["true"]));
    let out = run(
        &cfg,
        &["create", "--bundle", b.to_str().unwrap(), "c1"],
        false,
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("carries no lease token"), "{stderr}");
    assert!(lines(&out, "argv: ").is_empty(), "runc must not run");
}

#[test]
fn pod_sandbox_gets_baseline_even_with_the_pods_token() {
    let (d, _) = setup();
    let cfg = d.path().join("refuse.toml");
    std::fs::write(
        &cfg,
        format!(
            "runc_path = {:?}\nstate_dir = {:?}\ndaemon_socket = {:?}\nrunc_cve_acknowledged = [\"CVE-2025-31133\", \"CVE-2025-52565\", \"CVE-2025-52881\"]\n[policy]\napparmor = \"if-available\"\nno_token = \"refuse\"\ncri_runc_roots = [\"/run/runc\"]\nkubepods_roots = [\"/tessera-passthrough\"]\n",
            d.path().join("fake-runc"),
            d.path().join("runtime-state"),
            d.path().join("no-daemon.sock")
        ),
    )
    .unwrap();
    let b = d.path().join("b");
    std::fs::create_dir_all(b.join("rootfs")).unwrap();
    let mut spec = common::base_spec(&["/pause"]);
    spec["annotations"] = serde_json::json!({
        "io.kubernetes.cri.container-type": "sandbox",
        "io.kubernetes.cri.sandbox-id": "pause1",
        "io.kubernetes.cri.sandbox-uid": "0b5c3c9e",
        "tessera.io/lease-token": "tok"
    });
    spec["linux"]["cgroupsPath"] = serde_json::json!("/tessera-passthrough/pod0b5c3c9e/pause1");
    // A tenant container that only claims to be a sandbox (another id) gets no
    // exemption: no_token = "refuse" and its token cannot be resolved.
    common::write_spec(&b, &spec);
    let fake = run(
        &cfg,
        &["create", "--bundle", b.to_str().unwrap(), "tenant1"],
        false,
    );
    assert!(!fake.status.success(), "a fake sandbox was admitted");
    // No daemon is running: a resolved token would fail; the sandbox never resolves it.
    let out = run(
        &cfg,
        &["create", "--bundle", b.to_str().unwrap(), "pause1"],
        false,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let hardened: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    assert_eq!(hardened["linux"]["devices"], serde_json::json!([]));
    assert!(
        hardened["annotations"]
            .get("tessera.io/lease-token")
            .is_none()
    );
}

/// conmon and containerd's shims pass no TESSERA_RUNTIME_CONFIG: the runtime finds its
/// config next to the name it was started by, or next to its binary.
#[test]
fn the_config_is_found_next_to_the_binary_without_the_environment() {
    let (d, cfg) = setup();
    let bin = d.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let copy = bin.join("tessera-runtime");
    std::fs::copy(common::runtime_bin(), &copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    let text = std::fs::read_to_string(&cfg).unwrap();
    let beside = bin.join("tessera-runtime.toml");
    std::fs::write(&beside, &text).unwrap();
    std::fs::set_permissions(&beside, std::fs::Permissions::from_mode(0o644)).unwrap();
    let run_bare = |program: &Path| {
        Command::new(program)
            .env_clear()
            .args(["--root", "/r", "state", "x"])
            .output()
            .unwrap()
    };
    let out = run_bare(&copy);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        lines(&out, "argv: "),
        ["--root=/r state x"],
        "the fake runc ran"
    );
    // A second name (a symlink) with a config of its own: that one wins.
    let other = bin.join("tessera-gpu");
    std::os::unix::fs::symlink(&copy, &other).unwrap();
    std::fs::write(
        bin.join("tessera-gpu.toml"),
        "runc_path = \"/nonexistent/runc\"\n",
    )
    .unwrap();
    std::fs::set_permissions(
        bin.join("tessera-gpu.toml"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let out = run_bare(&other);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/nonexistent/runc"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A config others may write is refused, not used (exit 64).
    std::fs::set_permissions(&beside, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = run_bare(&copy);
    assert_eq!(out.status.code(), Some(64));
    assert!(lines(&out, "argv: ").is_empty(), "runc must not run");
}

/// `--privileged` is refused in one clear line: once on stderr, and as the last
/// error of runc's JSON log, which containerd and conmon show.
#[test]
fn a_privileged_container_is_refused_in_one_line() {
    let (d, cfg) = setup();
    let b = d.path().join("b");
    std::fs::create_dir_all(b.join("rootfs")).unwrap();
    let mut spec = common::base_spec(&["true"]);
    // What podman --privileged writes.
    spec["process"]["capabilities"]["bounding"] =
        serde_json::json!(["CAP_SYS_ADMIN", "CAP_SYS_MODULE"]);
    spec["linux"]["resources"]["devices"] = serde_json::json!([{"allow": true, "access": "rwm"}]);
    spec["process"]["apparmorProfile"] = serde_json::json!("unconfined");
    common::write_spec(&b, &spec);
    let log = d.path().join("oci-log");
    let out = run(
        &cfg,
        &[
            "--log",
            log.to_str().unwrap(),
            "--log-format",
            "json",
            "create",
            "--bundle",
            b.to_str().unwrap(),
            "c1",
        ],
        false,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(lines(&out, "argv: ").is_empty(), "runc must not run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // (The harness's LD_PRELOAD makes ld.so complain once; that line is not ours.)
    let stderr_lines: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("ERROR: ld.so"))
        .collect();
    assert_eq!(stderr_lines.len(), 1, "{stderr}");
    assert!(
        stderr_lines[0].starts_with(
            "tessera-runtime: create c1 refused: privileged containers are not allowed"
        ),
        "{stderr}"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let errors: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["level"] == "error")
        .collect();
    assert_eq!(errors.len(), 1, "{text}");
    assert_eq!(errors[0]["msg"], stderr_lines[0], "the same line in both");
}

/// A fake runc that answers `--version` with `version` (and counts the questions in
/// `<dir>/asked`), and otherwise prints its argv. Put in place by rename, as a
/// package upgrade does.
fn versioned_runc(dir: &Path, version: &str) -> PathBuf {
    let p = dir.join("versioned-runc");
    let tmp = dir.join("versioned-runc.new");
    std::fs::write(
        &tmp,
        format!(
            "#!/bin/sh\nif [ \"$1\" = --version ]; then echo x >> {:?}; echo 'runc version {version}'; exit 0; fi\necho \"argv: $*\"\n",
            dir.join("asked")
        ),
    )
    .unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
    p
}

fn times_asked(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("asked"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[test]
fn runc_is_asked_its_version_once_and_again_after_it_changes() {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED: the runc version cache is written by root only");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let runc = versioned_runc(d.path(), "1.2.8");
    let state = d.path().join("state");
    let cfg = d.path().join("cached.toml");
    std::fs::write(
        &cfg,
        format!(
            "runc_path = {runc:?}\ndaemon_socket = {:?}\nstate_dir = {state:?}\n[policy]\napparmor = \"if-available\"\n",
            d.path().join("none.sock")
        ),
    )
    .unwrap();
    let b = d.path().join("b");
    std::fs::create_dir_all(b.join("rootfs")).unwrap();
    let create = |id: &str| {
        common::write_spec(&b, &common::base_spec(&["true"]));
        run(
            &cfg,
            &["create", "--bundle", b.to_str().unwrap(), id],
            false,
        )
    };
    for id in ["c1", "c2", "c3"] {
        let out = create(id);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(lines(&out, "argv: ").len(), 1, "runc ran for {id}");
    }
    assert_eq!(times_asked(d.path()), 1, "asked once for three starts");

    // runc is replaced by one without the fixes: asked again, and refused.
    versioned_runc(d.path(), "1.1.5");
    let out = create("c4");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("runc 1.1.5 lacks the fixes"), "{stderr}");
    assert!(lines(&out, "argv: ").is_empty(), "runc must not run");
    assert_eq!(times_asked(d.path()), 2);

    // A cache file someone else may write, saying 1.2.8 for this binary, is not
    // believed: runc is asked and the container refused.
    let cache = state.join("runc-version.json");
    let forged = std::fs::read_to_string(&cache)
        .unwrap()
        .replace("[1,1,5]", "[1,2,8]");
    std::fs::write(&cache, &forged).unwrap();
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = create("c5");
    assert_eq!(out.status.code(), Some(1));
    assert!(lines(&out, "argv: ").is_empty(), "runc must not run");
    assert_eq!(times_asked(d.path()), 3);
}

/// A bundle, and a config whose fake runc answers `--version` as a fixed runc (1.2.8)
/// and otherwise reads `config.json` from its bundle as runc does, says what it was
/// (`first: fifo` when it was still the FIFO the runtime put there), its parent and
/// its fds, then runs `body`. One `create` has run (and the version is cached): the
/// next `create` or `run` starts this runc before the spec is decided. `None` (with a
/// SKIPPED line) when not root: only root keeps the version cache.
fn early_setup(body: &str) -> Option<(tempfile::TempDir, PathBuf, PathBuf)> {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED: runc is started early only on a cached version, which only root keeps");
        return None;
    }
    let d = tempfile::tempdir().unwrap();
    let runc = d.path().join("early-runc");
    std::fs::write(
        &runc,
        format!(
            concat!(
                "#!/bin/sh\n",
                "if [ \"$1\" = --version ]; then echo 'runc version 1.2.8'; exit 0; fi\n",
                "b=.\nprev=\nfor a in \"$@\"; do if [ \"$prev\" = --bundle ]; then b=$a; fi; case $a in --bundle=*) b=${{a#--bundle=}};; esac; prev=$a; id=$a; done\n",
                "if [ -p \"$b/config.json\" ]; then echo 'first: fifo'; else echo 'first: file'; fi\n",
                // Read in the shell's own process, as runc reads it in its own: a
                // killed runc leaves no reader behind.
                "IFS= read -r spec < \"$b/config.json\"\n",
                "if [ -z \"$spec\" ]; then echo 'runc: config.json: unexpected EOF' >&2; exit 1; fi\n",
                "echo \"spec: $spec\"\necho \"ppid: $PPID\"\n",
                "for f in /proc/$$/fd/*; do echo \"fd: ${{f##*/}}\"; done\n",
                "if [ \"$id\" = warm ]; then exit 0; fi\n",
                "{body}\n"
            ),
            body = body
        ),
    )
    .unwrap();
    std::fs::set_permissions(&runc, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cfg = d.path().join("early.toml");
    std::fs::write(
        &cfg,
        format!(
            "runc_path = {runc:?}\nstate_dir = {:?}\ndaemon_socket = {:?}\n[policy]\napparmor = \"if-available\"\n",
            d.path().join("runtime-state"),
            d.path().join("none.sock")
        ),
    )
    .unwrap();
    let b = d.path().join("b");
    std::fs::create_dir_all(b.join("rootfs")).unwrap();
    common::write_spec(&b, &common::base_spec(&["true"]));
    let warm = run(
        &cfg,
        &["create", "--bundle", b.to_str().unwrap(), "warm"],
        false,
    );
    assert!(warm.status.success(), "{warm:?}");
    assert_eq!(
        lines(&warm, "first: "),
        ["file"],
        "the first start waits for the version"
    );
    common::write_spec(&b, &common::base_spec(&["true"]));
    Some((d, cfg, b))
}

fn runtime_cmd(cfg: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(common::runtime_bin());
    cmd.env_clear()
        .env("TESSERA_RUNTIME_CONFIG", cfg)
        .args(args);
    cmd
}

/// With the version known, runc starts while the spec is judged: it finds config.json
/// a FIFO, reads the hardened spec from it, keeps the fds it is to pass on and no
/// other, and the runtime exits with runc's code.
#[test]
fn an_early_runc_reads_the_hardened_spec_and_its_exit_code_is_the_runtimes() {
    let Some((_d, cfg, b)) = early_setup("exit 7") else {
        return;
    };
    let mut cmd = runtime_cmd(
        &cfg,
        &[
            "create",
            "--preserve-fds",
            "1",
            "--bundle",
            b.to_str().unwrap(),
            "c1",
        ],
    );
    // SAFETY: dup2 in the child between fork and exec allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            if libc::dup2(1, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let runtime = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    // Started by the runtime, not exec'd in its place. (Whether it found the FIFO or
    // the hardened file depends on who was faster: tests in early.rs take each way.)
    assert_eq!(lines(&out, "ppid: "), [runtime.to_string()], "{out:?}");
    let spec = lines(&out, "spec: ");
    assert_eq!(spec.len(), 1, "{out:?}");
    let seen: serde_json::Value = serde_json::from_str(&spec[0]).unwrap();
    let on_disk: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    assert_eq!(seen, on_disk, "runc read the file the runtime left");
    assert_eq!(seen["process"]["noNewPrivileges"], true, "hardened: {seen}");
    // 0-3 (--preserve-fds 1 keeps 3), the shell's script (10 and up) and the one its
    // glob opened for /proc/$$/fd (the lowest free number): nothing of the runtime's
    // (the FIFO, the daemon, the log).
    let fds: Vec<i32> = lines(&out, "fd: ")
        .iter()
        .map(|f| f.parse().unwrap())
        .collect();
    assert!(fds.contains(&3), "fd 3 kept: {fds:?}");
    assert!(
        fds.iter().filter(|n| (4..10).contains(*n)).count() <= 1,
        "an fd of the runtime's reached runc: {fds:?}"
    );
    let mut names: Vec<String> = std::fs::read_dir(&b)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["config.json", "rootfs"], "left in the bundle");
}

/// A refused spec never reaches the runc started for it: runc is killed before it
/// reads anything, and config.json is the tenant's again, byte for byte.
#[test]
fn a_refused_spec_never_reaches_an_early_runc() {
    let Some((_d, cfg, b)) = early_setup("exit 0") else {
        return;
    };
    let mut spec = common::base_spec(&["true"]);
    spec["process"]["capabilities"]["bounding"] = serde_json::json!(["CAP_SYS_ADMIN"]);
    common::write_spec(&b, &spec);
    let tenant = std::fs::read(b.join("config.json")).unwrap();
    let out = run(
        &cfg,
        &["create", "--bundle", b.to_str().unwrap(), "c1"],
        false,
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("CAP_SYS_ADMIN"),
        "{out:?}"
    );
    assert!(
        lines(&out, "spec: ").is_empty(),
        "runc read a spec: {out:?}"
    );
    assert!(lines(&out, "argv: ").is_empty(), "{out:?}");
    assert_eq!(std::fs::read(b.join("config.json")).unwrap(), tenant);
    let names: Vec<String> = std::fs::read_dir(&b)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "rootfs")
        .collect();
    assert_eq!(names, ["config.json"], "left in the bundle");
}

/// The runtime stays runc's parent while runc runs: a signal sent to the runtime
/// reaches runc, and when runc dies of a signal the runtime does too.
#[test]
fn signals_sent_to_the_runtime_reach_an_early_runc() {
    let Some((_d, cfg, b)) = early_setup(concat!(
        "trap 'echo got: TERM; exit 3' TERM\n",
        "trap 'kill -KILL $$' USR1\n",
        "echo ready\n",
        "while :; do sleep 0.05; done"
    )) else {
        return;
    };
    use std::io::BufRead;
    for (signal, want_code, want_signal) in [
        (libc::SIGTERM, Some(3), None),
        (libc::SIGUSR1, None, Some(libc::SIGKILL)),
    ] {
        common::write_spec(&b, &common::base_spec(&["true"]));
        let mut child = runtime_cmd(&cfg, &["run", "--bundle", b.to_str().unwrap(), "c1"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut seen = Vec::new();
        loop {
            let mut l = String::new();
            assert!(
                out.read_line(&mut l).unwrap() > 0,
                "runc ended early: {seen:?}"
            );
            seen.push(l.trim_end().to_string());
            if l.trim_end() == "ready" {
                break;
            }
        }
        assert!(
            seen.contains(&format!("ppid: {}", child.id())),
            "runc is the runtime's child: {seen:?}"
        );
        // SAFETY: kill with a valid signal to the runtime this test started.
        unsafe {
            libc::kill(i32::try_from(child.id()).unwrap(), signal);
        }
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.code(), want_code, "{status:?} {rest}");
        assert_eq!(status.signal(), want_signal, "{status:?} {rest}");
        if want_code.is_some() {
            assert!(rest.contains("got: TERM"), "{rest}");
        }
    }
}

/// A runtime killed while runc runs takes runc with it, as killing runc itself did
/// when the runtime exec'd it.
#[test]
fn killing_the_runtime_kills_an_early_runc() {
    let Some((d, cfg, b)) = early_setup("echo $$ > \"$b/../../../runc.pid\"\nexec sleep 60") else {
        return;
    };
    let mut child = runtime_cmd(&cfg, &["run", "--bundle", b.to_str().unwrap(), "c1"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid_file = d.path().join("runc.pid");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let pid: i32 = loop {
        if let Ok(s) = std::fs::read_to_string(&pid_file)
            && let Ok(p) = s.trim().parse()
        {
            break p;
        }
        assert!(std::time::Instant::now() < deadline, "runc never started");
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    // Gone, or a zombie its new parent has yet to reap; never still sleeping.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit(')').next().map(|r| r.trim().chars().next()))
            .flatten();
        if matches!(state, None | Some('Z') | Some('X')) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "runc {pid} outlived the runtime (state {state:?})"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
