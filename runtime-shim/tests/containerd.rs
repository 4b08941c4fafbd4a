//! containerd drives tessera-runtime: a private containerd (own root, state and socket in
//! a temp dir), a hand-made OCI image of the busybox rootfs imported with `ctr images
//! import`, and `ctr run --runc-binary tessera-runtime` with and without a valid token;
//! `ctr task exec` goes through the hardened exec path.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const IMAGE: &str = "docker.io/library/tessera-busybox:test";
const NS: &str = "tessera-test";

struct Containerd {
    child: Child,
    socket: PathBuf,
    cgroup_prefix: String,
}

impl Containerd {
    fn start(dir: &Path, runtime_config: &Path) -> Self {
        let socket = dir.join("containerd.sock");
        let config = dir.join("containerd.toml");
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = {root:?}\nstate = {state:?}\n\
                 disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = {sock:?}\n\
                 [ttrpc]\n  address = {ttrpc:?}\n\
                 [debug]\n  address = {debug:?}\n",
                root = dir.join("root"),
                state = dir.join("state"),
                sock = socket,
                ttrpc = dir.join("containerd.ttrpc.sock"),
                debug = dir.join("debug.sock"),
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .env("TESSERA_RUNTIME_CONFIG", runtime_config)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let c = Self {
            child,
            socket,
            cgroup_prefix: String::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if c.ctr(&["version"]).status.success() {
                return c;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!(
            "containerd did not start: {}",
            std::fs::read_to_string(dir.join("containerd.log")).unwrap_or_default()
        );
    }

    fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(["--namespace", NS])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        for id in ["c-lease", "c-base", "c-bad", "c-exec"] {
            let _ = self.ctr(&["task", "kill", "-s", "SIGKILL", id]);
            std::thread::sleep(Duration::from_millis(100));
            let _ = self.ctr(&["task", "delete", "-f", id]);
            let _ = self.ctr(&["container", "delete", id]);
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap()),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
        // The lease's cgroup parent and ctr's per-namespace cgroup (/<namespace>/<id>).
        if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in rd.flatten() {
                if !self.cgroup_prefix.is_empty() {
                    let top = h.path().join(&self.cgroup_prefix);
                    let _ = std::fs::remove_dir(top.join("lease-1"));
                    let _ = std::fs::remove_dir(top);
                }
                let _ = std::fs::remove_dir(h.path().join(NS));
            }
        }
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn containerd_runs_tenant_containers_through_tessera_runtime() {
    if !common::can_run_as_root(
        "containerd",
        &[
            "containerd",
            "ctr",
            "containerd-shim-runc-v2",
            "runc",
            "busybox",
            "cc",
        ],
    ) {
        return;
    }
    // Short paths: unix socket names are limited to 108 bytes.
    let dir = tempfile::Builder::new()
        .prefix("tsc")
        .tempdir_in("/tmp")
        .unwrap();
    let rootfs = common::busybox_rootfs(dir.path());
    let dev = common::gpu_dev_dir(dir.path());
    let proc_root = common::fake_nvidia_proc(dir.path());
    let mps = dir.path().join("mps");
    std::fs::create_dir_all(&mps).unwrap();
    let cgroup_prefix = format!("tessera-ctrd-{}", std::process::id());
    let socket = dir.path().join("tesserad.sock");
    let mut answers: HashMap<String, common::Answer> = HashMap::new();
    answers.insert(
        "tok-good".into(),
        Ok(common::lease_answer(
            "lease-1",
            "acme",
            &[(&dev.join("nvidia0"), "/dev/nvidia0", 195, 0)],
            Some(&mps),
            &format!("/{cgroup_prefix}/lease-1"),
        )),
    );
    let daemon = common::FakeDaemon::start(&socket, answers);
    let runtime_config = common::runtime_config(dir.path(), &socket, &proc_root, "");
    let mut ctrd = Containerd::start(dir.path(), &runtime_config);
    ctrd.cgroup_prefix = cgroup_prefix;

    let image = common::oci_image(dir.path(), &rootfs, IMAGE);
    let out = ctrd.ctr(&[
        "images",
        "import",
        "--snapshotter",
        "native",
        image.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "import: {}", text(&out));

    let bin = common::runtime_bin();
    let bin = bin.to_str().unwrap();
    let script = "probe open /dev/nvidia0; probe open /dev/nvidia1; grep -E '^(Seccomp|NoNewPrivs|CapEff):' /proc/self/status; echo cuda=$CUDA_VISIBLE_DEVICES";
    let run = |id: &str, token: Option<&str>, args: &[&str]| {
        let ann = token.map(|t| format!("tessera.io/lease-token={t}"));
        let mut a = vec![
            "run",
            "--rm",
            "--snapshotter",
            "native",
            "--runc-binary",
            bin,
        ];
        if let Some(ann) = &ann {
            a.extend(["--annotation", ann.as_str()]);
        }
        a.extend([IMAGE, id]);
        a.extend(args);
        ctrd.ctr(&a)
    };

    // With a valid token: the leased GPU only, hardened.
    let out = run("c-lease", Some("tok-good"), &["sh", "-c", script]);
    let t = text(&out);
    assert!(out.status.success(), "ctr run with token: {t}");
    for w in [
        "open /dev/nvidia0 errno=6",
        "open /dev/nvidia1 errno=2",
        "Seccomp:\t2",
        "NoNewPrivs:\t1",
        "CapEff:\t00000000200004fb",
        "cuda=GPU-00000000-1111-2222-3333-444444444444",
    ] {
        assert!(t.lines().any(|l| l.trim() == w), "missing {w:?} in {t}");
    }
    let rec = daemon.recorded();
    assert!(
        rec.binds.iter().any(|b| b.container_id == "c-lease"),
        "{rec:?}"
    );

    // Without a token: baseline hardening, no GPU node.
    let out = run("c-base", None, &["sh", "-c", script]);
    let t = text(&out);
    assert!(out.status.success(), "ctr run without token: {t}");
    for w in ["open /dev/nvidia0 errno=2", "NoNewPrivs:\t1", "Seccomp:\t2"] {
        assert!(t.lines().any(|l| l.trim() == w), "missing {w:?} in {t}");
    }

    // An invalid token: refused, and containerd shows why.
    let out = run("c-bad", Some("tok-nope"), &["true"]);
    let t = text(&out);
    assert!(
        !out.status.success(),
        "ctr run with a bad token succeeded: {t}"
    );
    assert!(t.contains("unknown lease token"), "{t}");
    let _ = ctrd.ctr(&["container", "delete", "c-bad"]);

    // --privileged: refused, and containerd shows the one clear line, once.
    let out = ctrd.ctr(&[
        "run",
        "--rm",
        "--snapshotter",
        "native",
        "--runc-binary",
        bin,
        "--privileged",
        "--annotation",
        "tessera.io/lease-token=tok-good",
        IMAGE,
        "c-priv",
        "true",
    ]);
    let t = text(&out);
    assert!(!out.status.success(), "ctr run --privileged succeeded: {t}");
    assert_eq!(
        t.matches("privileged containers are not allowed").count(),
        1,
        "{t}"
    );
    let _ = ctrd.ctr(&["container", "delete", "c-priv"]);

    // ctr task exec into a running container goes through the hardened exec path.
    let out = ctrd.ctr(&[
        "run",
        "-d",
        "--snapshotter",
        "native",
        "--runc-binary",
        bin,
        "--annotation",
        "tessera.io/lease-token=tok-good",
        IMAGE,
        "c-exec",
        "sleep",
        "120",
    ]);
    assert!(out.status.success(), "ctr run -d: {}", text(&out));
    let out = ctrd.ctr(&[
        "task",
        "exec",
        "--exec-id",
        "e1",
        "c-exec",
        "sh",
        "-c",
        "grep -E '^(NoNewPrivs|CapEff|Seccomp):' /proc/self/status",
    ]);
    let t = text(&out);
    assert!(out.status.success(), "ctr task exec: {t}");
    // containerd sends the image's unreduced capability sets; the exec'd process gets
    // the container's reduced ones.
    for w in ["NoNewPrivs:\t1", "Seccomp:\t2", "CapEff:\t00000000200004fb"] {
        assert!(
            t.lines().any(|l| l.trim() == w),
            "exec: missing {w:?} in {t}"
        );
    }
    let _ = ctrd.ctr(&["task", "kill", "-s", "SIGKILL", "c-exec"]);
    std::thread::sleep(Duration::from_millis(300));
    let out = ctrd.ctr(&["task", "delete", "-f", "c-exec"]);
    assert!(out.status.success(), "task delete: {}", text(&out));
    assert!(daemon.recorded().unbinds.iter().any(|u| u == "c-exec"));
}
