//! The DaemonSet's image, as `make image` builds it (deploy/image: a scratch base, no
//! registry), built and run with podman: tesserad in the container on simulated GPUs
//! answers the CLI on the host through the mounted socket directory, and the init
//! container's `tessera-install-runtime` puts a working tessera-runtime on the host.
//! podman runs isolated in a temp dir (its own storage, config and no network): the
//! host's podman setup is not touched. Needs root, podman and a static busybox.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tessera_integration_tests::bin_path;

const IMAGE: &str = "localhost/tessera:it";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// podman confined to `dir`: its storage, run root, config and temp files.
struct Podman {
    dir: tempfile::TempDir,
}

impl Podman {
    fn new() -> Podman {
        let dir = tempfile::Builder::new()
            .prefix("timg")
            .tempdir_in("/tmp")
            .unwrap();
        let d = dir.path();
        for sub in ["graph", "run", "tmp"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        std::fs::write(
            d.join("storage.conf"),
            format!(
                "[storage]\ndriver = \"vfs\"\ngraphroot = {:?}\nrunroot = {:?}\n",
                d.join("graph"),
                d.join("run")
            ),
        )
        .unwrap();
        std::fs::write(
            d.join("containers.conf"),
            format!(
                "[containers]\ndefault_ulimits = []\n\n[engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\nevents_logfile_path = {:?}\ntmp_dir = {:?}\n",
                d.join("events.log"),
                d.join("tmp"),
            ),
        )
        .unwrap();
        std::fs::write(d.join("registries.conf"), "").unwrap();
        Podman { dir }
    }

    fn run(&self, args: &[&str]) -> Output {
        let d = self.dir.path();
        Command::new("podman")
            .env("CONTAINERS_CONF", d.join("containers.conf"))
            .env("CONTAINERS_STORAGE_CONF", d.join("storage.conf"))
            .env("CONTAINERS_REGISTRIES_CONF", d.join("registries.conf"))
            .arg("--root")
            .arg(d.join("graph"))
            .arg("--runroot")
            .arg(d.join("run"))
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.run(&["rm", "--all", "--force", "--time", "0"]);
        let _ = self.run(&["rmi", "--all", "--force"]);
    }
}

#[test]
fn the_image_builds_serves_the_host_cli_and_installs_the_runtime() {
    let root = nix::unistd::geteuid().is_root();
    let busybox = Path::new("/bin/busybox").exists();
    if !root || !on_path("podman") || !busybox {
        eprintln!(
            "SKIPPED: the image test needs root, podman and busybox-static (root {root}, podman {}, busybox {busybox})",
            on_path("podman")
        );
        return;
    }
    let bin_dir = bin_path("tesserad")
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let pm = Podman::new();
    let d = pm.dir.path().to_path_buf();

    // Staged and built as `make image` does.
    let rootfs = d.join("rootfs");
    let out = Command::new(repo().join("deploy/image/stage-rootfs.sh"))
        .arg(&bin_dir)
        .arg(bin_dir.join("tessera-runtime"))
        .arg(&rootfs)
        .output()
        .unwrap();
    assert!(out.status.success(), "stage-rootfs.sh: {}", text(&out));
    let out = pm.run(&[
        "build",
        "--network",
        "none",
        "-f",
        repo().join("deploy/image/Containerfile").to_str().unwrap(),
        "-t",
        IMAGE,
        rootfs.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "podman build: {}", text(&out));
    let out = pm.run(&["image", "inspect", "--format", "{{.Size}}", IMAGE]);
    let size: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    // Written past the harness's capture: CI logs show the image's size.
    eprintln!("image {IMAGE}: {size} bytes (debug binaries; `make image` ships the dist build)");
    // Nothing but what the stage holds: no distribution under it.
    let out = pm.run(&[
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        "/bin/sh",
        IMAGE,
        "-c",
        "[ ! -e /usr/bin/apt-get ] && [ ! -e /etc/os-release ]",
    ]);
    assert!(
        out.status.success(),
        "the image holds a distribution: {}",
        text(&out)
    );

    // tesserad in the container on simulated GPUs; the socket directory is the host's.
    // The host is this test's namespaces (`[auth] host_pid`): in the DaemonSet it is
    // PID 1, the host's init, which a test cannot count on being readable.
    let host_pid = std::process::id();
    let etc = d.join("etc");
    let sock_dir = d.join("sock");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::create_dir_all(&sock_dir).unwrap();
    std::fs::write(
        etc.join("tesserad.toml"),
        format!(
            "[daemon]\nsocket = \"/run/tessera/tesserad.sock\"\nstate_dir = \"/var/lib/tessera\"\nrun_dir = \"/run/tessera\"\nshutdown_grace = \"3s\"\n\n[auth]\nhost_pid = {host_pid}\n\n[gpu]\nbackend = \"sim\"\n\n[sim]\nstate_file = \"/var/lib/tessera/sim-gpus.json\"\n\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n"
        ),
    )
    .unwrap();
    let out = pm.run(&[
        "run",
        "-d",
        "--name",
        "tesserad",
        "--network",
        "none",
        // As the DaemonSet's hostPID: callers are identified by their host pid, and
        // their namespaces are read through /proc (CAP_SYS_PTRACE: the DaemonSet's
        // container is privileged).
        "--pid",
        "host",
        "--cap-add",
        "SYS_PTRACE",
        "-v",
        &format!("{}:/etc/tessera:ro", etc.display()),
        "-v",
        &format!("{}:/run/tessera", sock_dir.display()),
        IMAGE,
    ]);
    assert!(out.status.success(), "podman run tesserad: {}", text(&out));
    let socket = sock_dir.join("tesserad.sock");
    let cli = bin_path("tessera").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut answer = String::new();
    while Instant::now() < deadline {
        let out = Command::new(&cli)
            .arg("--socket")
            .arg(&socket)
            .args(["--json", "gpus"])
            .output()
            .unwrap();
        if out.status.success() {
            answer = text(&out);
            break;
        }
        answer = text(&out);
        std::thread::sleep(Duration::from_millis(100));
    }
    let logs = text(&pm.run(&["logs", "tesserad"]));
    assert!(
        answer.contains("H100"),
        "the host CLI got no GPUs from the containerized daemon: {answer}\nlogs:\n{logs}"
    );
    let out = pm.run(&["stop", "--time", "10", "tesserad"]);
    assert!(out.status.success(), "podman stop: {}", text(&out));
    let out = pm.run(&["inspect", "--format", "{{.State.ExitCode}}", "tesserad"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0",
        "tesserad did not stop cleanly on SIGTERM:\n{logs}"
    );

    // The init container: tessera-runtime copied to the host, whole and runnable.
    let host = d.join("host-opt-tessera");
    std::fs::create_dir_all(&host).unwrap();
    let out = pm.run(&[
        "run",
        "--rm",
        "--network",
        "none",
        "--cap-drop",
        "all",
        "-v",
        &format!("{}:/host/opt/tessera", host.display()),
        "--entrypoint",
        "/usr/bin/tessera-install-runtime",
        IMAGE,
        "/host/opt/tessera/bin",
    ]);
    assert!(out.status.success(), "init container: {}", text(&out));
    let installed = host.join("bin/tessera-runtime");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&installed).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o755);
    assert!(!host.join("bin/.tessera-runtime.new").exists());
    let staged = std::fs::read(rootfs.join("usr/bin/tessera-runtime")).unwrap();
    assert!(
        std::fs::read(&installed).unwrap() == staged,
        "the copy differs from the image's tessera-runtime"
    );
}
