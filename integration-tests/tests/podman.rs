//! podman drives tessera-runtime (`podman --runtime`): podman 4 with conmon, its
//! storage, run root, configuration and events in a temp dir (vfs storage, cgroupfs,
//! no network: nothing of the host's podman setup is touched), an image imported from
//! a busybox-static rootfs, `tesserad` on the simulator. Covers run, exec (the lease's
//! environment), the `--privileged` refusal as one clear line, and cleanup (no binding
//! left once podman removed the container).
//!
//! Needs root, podman, conmon, runc, busybox-static and a C compiler; says SKIPPED
//! otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../runtime-shim/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use tessera_integration_tests::{DEV_GPUS, TestDaemon, create_req, devnodes, rt, shape};
use tessera_proto::v1 as tpb;

const IMAGE: &str = "localhost/tessera-e2e/busybox:1";

struct World {
    daemon: TestDaemon,
    dev: PathBuf,
    runtime: PathBuf,
    dir: tempfile::TempDir,
}

impl World {
    fn new() -> Option<World> {
        Self::with_config("")
    }

    /// A world whose daemon's config has `extra` too.
    fn with_config(extra: &str) -> Option<World> {
        if !common::can_run_as_root(
            "podman end-to-end",
            &["podman", "conmon", "runc", "busybox", "cc"],
        ) {
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("tpod")
            .tempdir_in("/tmp")
            .unwrap();
        let d = dir.path();
        let dev = d.join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        let daemon = TestDaemon::start_with(
            DEV_GPUS,
            &format!(
                "[devices]\ndev_root = {dev:?}\n[lease]\nmin_ttl = \"1s\"\nrevocation_grace = \"1s\"\n{extra}"
            ),
        )
        .unwrap();
        let rootfs = common::busybox_rootfs(d);
        let proc_root = common::fake_nvidia_proc(d);
        for sub in ["graph", "run", "tmp", "volumes", "net"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        // podman's own configuration, all of it here (the env names the files).
        std::fs::write(
            d.join("storage.conf"),
            format!(
                "[storage]\ndriver = \"vfs\"\ngraphroot = {:?}\nrunroot = {:?}\n",
                d.join("graph"),
                d.join("run")
            ),
        )
        .unwrap();
        // No default ulimits: podman's nofile 1048576 may exceed the host's hard limit.
        std::fs::write(
            d.join("containers.conf"),
            format!(
                "[containers]\ndefault_ulimits = []\n\n[engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\nevents_logfile_path = {:?}\ntmp_dir = {:?}\nvolume_path = {:?}\n\n[network]\nnetwork_config_dir = {:?}\n",
                d.join("events.log"),
                d.join("tmp"),
                d.join("volumes"),
                d.join("net"),
            ),
        )
        .unwrap();
        std::fs::write(d.join("registries.conf"), "").unwrap();
        // The runtime under another name, its config beside it: conmon passes it no
        // environment of ours.
        let bin = d.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let runtime = bin.join("tessera-gpu");
        std::os::unix::fs::symlink(common::runtime_bin(), &runtime).unwrap();
        let runc = common::which("runc").unwrap();
        std::fs::write(
            bin.join("tessera-gpu.toml"),
            format!(
                "runc_path = {runc:?}\nstate_dir = {rt_state:?}\ndaemon_socket = {sock:?}\ndaemon_timeout_ms = 3000\nnvidia_proc_root = {proc_root:?}\n\
                 runc_cve_acknowledged = [\"CVE-2025-31133\", \"CVE-2025-52565\", \"CVE-2025-52881\"]\n\
                 [policy]\napparmor = \"if-available\"\ncontainer_storage_roots = [{graph:?}]\ncontainer_run_roots = [{run:?}]\n",
                sock = daemon.socket,
                rt_state = d.join("runtime-state"),
                graph = d.join("graph"),
                run = d.join("run"),
            ),
        )
        .unwrap();
        let w = World {
            daemon,
            dev,
            runtime,
            dir,
        };
        let layer = w.dir.path().join("rootfs.tar");
        let st = Command::new("tar")
            .args(["--numeric-owner", "--owner=0", "--group=0", "-C"])
            .arg(&rootfs)
            .arg("-cf")
            .arg(&layer)
            .arg(".")
            .status()
            .unwrap();
        assert!(st.success());
        let out = w.podman(&["import", layer.to_str().unwrap(), IMAGE]);
        assert!(out.status.success(), "podman import: {}", text(&out));
        Some(w)
    }

    /// `podman ARGS` isolated in this world's dir, with tessera-runtime as its runtime.
    fn podman(&self, args: &[&str]) -> Output {
        let d = self.dir.path();
        Command::new("podman")
            .env("CONTAINERS_CONF", d.join("containers.conf"))
            .env("CONTAINERS_STORAGE_CONF", d.join("storage.conf"))
            .env("CONTAINERS_REGISTRIES_CONF", d.join("registries.conf"))
            .env_remove("TESSERA_RUNTIME_CONFIG")
            .arg("--root")
            .arg(d.join("graph"))
            .arg("--runroot")
            .arg(d.join("run"))
            .args([
                "--storage-driver",
                "vfs",
                "--cgroup-manager",
                "cgroupfs",
                "--events-backend",
                "file",
            ])
            .arg("--tmpdir")
            .arg(d.join("tmp"))
            .arg("--runtime")
            .arg(&self.runtime)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// A lease of `shape`, its device nodes made as the driver would have.
    fn lease(&self, shape: tpb::Shape) -> (tpb::Lease, String) {
        rt().block_on(async {
            let mut c = self.daemon.client().await.unwrap();
            let created = c
                .create_lease(create_req("team-a", shape))
                .await
                .unwrap()
                .into_inner();
            let resolved = c
                .resolve_token(tpb::ResolveTokenRequest {
                    token: created.token.clone(),
                })
                .await
                .unwrap()
                .into_inner();
            devnodes::lease_nodes(&resolved, &self.dev).unwrap();
            (created.lease.unwrap(), created.token)
        })
    }

    fn lease_now(&self, id: &str) -> tpb::Lease {
        rt().block_on(async {
            let mut c = self.daemon.client().await.unwrap();
            c.get_lease(tpb::GetLeaseRequest {
                lease_id: id.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap()
        })
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let out = self.podman(&["rm", "--all", "--force", "--time", "0"]);
        if !out.status.success() {
            eprintln!("cleanup: podman rm: {}", text(&out));
        }
        // conmon runs `podman container cleanup` when a container exits: let those
        // finish before the dir goes, or they re-create parts of it.
        let me = self.dir.path().to_string_lossy().into_owned();
        for _ in 0..100 {
            if !processes_mentioning(&me) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// Whether a process's command line mentions `s`.
fn processes_mentioning(s: &str) -> bool {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return false;
    };
    rd.flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .any(|c| String::from_utf8_lossy(&c).contains(s))
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn has_line(out: &str, want: &str) -> bool {
    out.lines().any(|l| l.trim() == want.trim())
}

#[test]
fn podman_runs_and_execs_a_gpu_container_with_the_lease_env_and_leaves_no_binding() {
    let Some(w) = World::new() else { return };
    let (lease, token) = w.lease(shape::mig("1g.10gb"));
    let part = lease.partition.clone().unwrap();
    let gpu = part.gpu_index;
    let mig_uuid = part.mig.unwrap().mig_uuid;
    let ann = format!("tessera.io/lease-token={token}");

    // podman run: the container sees its GPU only, with the lease's environment.
    let out = w.podman(&[
        "run",
        "--rm",
        "--network",
        "none",
        "--annotation",
        &ann,
        IMAGE,
        "sh",
        "-c",
        &format!(
            "probe open /dev/nvidia{gpu}; probe open /dev/nvidia{}; echo CVD=$CUDA_VISIBLE_DEVICES; echo TOKEN=${{TESSERA_LEASE_TOKEN:-none}}",
            1 - gpu
        ),
    ]);
    let t = text(&out);
    assert!(out.status.success(), "podman run: {t}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for want in [
        format!("open /dev/nvidia{gpu} errno=6"),
        format!("open /dev/nvidia{} errno=2", 1 - gpu),
        format!("CVD={mig_uuid}"),
        "TOKEN=none".to_string(),
    ] {
        assert!(has_line(&stdout, &want), "missing {want:?}: {t}");
    }
    assert!(
        w.lease_now(&lease.id).containers.is_empty(),
        "podman run --rm left a binding"
    );

    // podman exec into a running container: the lease's environment is there too.
    let out = w.podman(&[
        "run",
        "-d",
        "--name",
        "gpu-exec",
        "--network",
        "none",
        "--annotation",
        &ann,
        IMAGE,
        "sleep",
        "600",
    ]);
    assert!(out.status.success(), "podman run -d: {}", text(&out));
    let cid = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let bound = w.lease_now(&lease.id).containers;
    assert_eq!(bound.len(), 1, "{bound:?}");
    assert_eq!(bound[0].id, cid);
    let out = w.podman(&["exec", "gpu-exec", "sh", "-c", "env"]);
    let t = text(&out);
    assert!(out.status.success(), "podman exec: {t}");
    let env = String::from_utf8_lossy(&out.stdout);
    for want in [
        format!("CUDA_VISIBLE_DEVICES={mig_uuid}"),
        format!("TESSERA_LEASE_ID={}", lease.id),
    ] {
        assert!(has_line(&env, &want), "exec lacks {want:?}: {t}");
    }
    assert!(
        !env.contains(&token),
        "the token reached the exec'd process"
    );

    // podman rm -f: the daemon's binding goes with the container.
    let out = w.podman(&["rm", "--force", "--time", "0", "gpu-exec"]);
    assert!(out.status.success(), "podman rm: {}", text(&out));
    let left = w.lease_now(&lease.id).containers;
    assert!(left.is_empty(), "stale binding after podman rm: {left:?}");
}

#[test]
fn podman_privileged_and_unknown_tokens_are_refused_in_one_clear_line_and_leave_nothing() {
    let Some(w) = World::new() else { return };
    let (lease, token) = w.lease(shape::mig("1g.10gb"));
    let ann = format!("tessera.io/lease-token={token}");
    let out = w.podman(&[
        "run",
        "--rm",
        "--privileged",
        "--network",
        "none",
        "--annotation",
        &ann,
        IMAGE,
        "true",
    ]);
    let t = text(&out);
    assert!(!out.status.success(), "podman run --privileged ran: {t}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("privileged containers are not allowed"))
        .collect();
    assert_eq!(lines.len(), 1, "one line says why: {t}");
    assert!(
        lines[0].contains("refused: privileged containers are not allowed")
            && !lines[0].contains("{\"")
            && !lines[0].contains("\\n")
            && lines[0].matches("refused:").count() == 1,
        "garbled: {:?}",
        lines[0]
    );
    assert!(
        w.lease_now(&lease.id).containers.is_empty(),
        "a refused container left a binding"
    );
    // An unknown token: one line too, and nothing kept.
    let out = w.podman(&[
        "run",
        "--rm",
        "--network",
        "none",
        "--annotation",
        "tessera.io/lease-token=tsr1_not-a-token",
        IMAGE,
        "true",
    ]);
    let t = text(&out);
    assert!(!out.status.success(), "podman ran an unknown token: {t}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("unknown, expired or revoked lease token"))
        .collect();
    assert_eq!(lines.len(), 1, "one line says why: {t}");
    let out = w.podman(&["ps", "--all", "--quiet"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "",
        "podman kept a container"
    );
}

/// `podman run --device tessera.io/lease=<id>`: the daemon keeps a CDI spec for every
/// active lease (`[cdi]`), podman injects it, and tessera-runtime takes the lease's
/// own nodes and mounts as the lease's; a CDI device of another lease refuses. podman
/// 4 reads CDI specs from /etc/cdi and /var/run/cdi only: the test's specs go there
/// (each named by its lease id) and are gone when their leases end.
#[test]
fn podman_runs_a_container_by_the_leases_cdi_name() {
    let cdi_dir = Path::new("/var/run/cdi");
    /// Takes the directory away again if this test made it, however the test ends:
    /// test daemons find it there otherwise.
    struct MadeDir(Option<&'static Path>);
    impl Drop for MadeDir {
        fn drop(&mut self) {
            if let Some(d) = self.0 {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
    let _made = MadeDir((!cdi_dir.exists()).then_some(Path::new("/var/run/cdi")));
    let Some(w) = World::with_config("[cdi]\nenabled = true\ndir = \"/var/run/cdi\"\n") else {
        return;
    };
    let spec_of = |id: &str| cdi_dir.join(format!("tessera.io-lease-{id}.json"));
    let wait_for = |p: &Path, present: bool| {
        for _ in 0..200 {
            if p.exists() == present {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        false
    };
    let (a, token) = w.lease(shape::mig("1g.10gb"));
    let (b, _) = w.lease(shape::mig("1g.10gb"));
    assert!(
        wait_for(&spec_of(&a.id), true),
        "no CDI spec for lease {}",
        a.id
    );
    assert!(
        wait_for(&spec_of(&b.id), true),
        "no CDI spec for lease {}",
        b.id
    );
    let part = a.partition.clone().unwrap();
    let gpu = part.gpu_index;
    let mig_uuid = part.mig.unwrap().mig_uuid;
    let ann = format!("tessera.io/lease-token={token}");

    let out = w.podman(&[
        "run",
        "--rm",
        "--network",
        "none",
        "--annotation",
        &ann,
        "--device",
        &format!("tessera.io/lease={}", a.id),
        IMAGE,
        "sh",
        "-c",
        &format!("probe open /dev/nvidia{gpu}; echo CVD=$CUDA_VISIBLE_DEVICES"),
    ]);
    let t = text(&out);
    let result = std::panic::catch_unwind(|| {
        assert!(
            out.status.success(),
            "podman run --device tessera.io/lease=ID: {t}"
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        for want in [
            format!("open /dev/nvidia{gpu} errno=6"),
            format!("CVD={mig_uuid}"),
        ] {
            assert!(has_line(&stdout, &want), "missing {want:?}: {t}");
        }
    });
    // Another lease's CDI device with this lease's token: refused, nothing runs.
    let other = w.podman(&[
        "run",
        "--rm",
        "--network",
        "none",
        "--annotation",
        &ann,
        "--device",
        &format!("tessera.io/lease={}", b.id),
        IMAGE,
        "true",
    ]);
    // The spec goes with its lease.
    rt().block_on(async {
        let mut c = w.daemon.client().await.unwrap();
        c.release_lease(tpb::ReleaseLeaseRequest {
            lease_id: a.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    });
    let removed = wait_for(&spec_of(&a.id), false);
    drop(w);
    // Lease b outlived the world's daemon: its spec goes too.
    let _ = std::fs::remove_file(spec_of(&b.id));
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    let t = text(&other);
    assert!(
        !other.status.success(),
        "another lease's CDI device ran: {t}"
    );
    assert!(t.contains("GPU device node"), "{t}");
    assert!(removed, "the released lease's CDI spec is still there");
}

/// Red team 2, findings 3 and 4, with a real podman victim: container ids are unique
/// per runc root only, so a container created by a direct call under another root
/// with a podman container's id gets none of that container's: not its layer as
/// rootfs, not its run directory's files, not its bundle's config.json. Judged by
/// what runc made (nothing) and by podman's container afterwards (intact).
#[test]
fn a_container_of_another_root_gets_nothing_of_the_podman_container_of_its_id() {
    let Some(w) = World::new() else { return };
    let out = w.podman(&[
        "run",
        "-d",
        "--network",
        "none",
        "--name",
        "victim",
        IMAGE,
        "sleep",
        "600",
    ]);
    assert!(out.status.success(), "podman run: {}", text(&out));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let d = w.dir.path();
    let list: serde_json::Value = serde_json::from_slice(
        &std::fs::read(d.join("graph/vfs-containers/containers.json")).unwrap(),
    )
    .unwrap();
    let layer = list
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id.as_str())
        .and_then(|c| c["layer"].as_str())
        .unwrap()
        .to_string();
    let victim_root = d.join("graph/vfs/dir").join(&layer);
    let run_dir = d.join("run/vfs-containers").join(&id).join("userdata");
    let victim_config = d
        .join("graph/vfs-containers")
        .join(&id)
        .join("userdata/config.json");
    assert!(run_dir.join("hosts").exists() && victim_config.exists());
    let attacker_root = d.join("attacker-root");
    let bind = |src: &Path, dest: &str| {
        serde_json::json!({"destination": dest, "type": "bind", "source": src,
                           "options": ["rbind", "rw"]})
    };
    let mut failures = Vec::new();
    for (what, want) in [
        ("rootfs", "is not this container's own userdata"),
        ("hosts", "is not under this container's bundle"),
        ("conmon.pid", "never bind-mounted writable"),
        ("config.json", "never bind-mounted writable"),
    ] {
        let b = d.join("attacker").join(what);
        let mut spec = common::base_spec(&[
            "sh",
            "-c",
            "echo owned > /victim-was-here; echo 6.6.6.6 x >> /h; sleep 600",
        ]);
        spec["root"]["path"] = serde_json::json!(common::bundle_rootfs(d, &b));
        spec["linux"]["cgroupsPath"] = serde_json::json!(format!("/default/{id}"));
        match what {
            "rootfs" => spec["root"]["path"] = serde_json::json!(victim_root),
            "hosts" => spec["mounts"]
                .as_array_mut()
                .unwrap()
                .push(bind(&run_dir.join("hosts"), "/h")),
            "conmon.pid" => spec["mounts"]
                .as_array_mut()
                .unwrap()
                .push(bind(&run_dir.join("conmon.pid"), "/h")),
            _ => spec["mounts"]
                .as_array_mut()
                .unwrap()
                .push(bind(&victim_config, "/h")),
        }
        common::write_spec(&b, &spec);
        let out = Command::new(common::runtime_bin())
            .env("TESSERA_RUNTIME_CONFIG", d.join("bin/tessera-gpu.toml"))
            .arg("--root")
            .arg(&attacker_root)
            .args(["create", "--bundle"])
            .arg(&b)
            .arg(&id)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.success() || !err.contains(want) {
            failures.push(format!("{what}: want {want:?}: {}", text(&out)));
        }
        let st = Command::new("runc")
            .arg("--root")
            .arg(&attacker_root)
            .args(["state", &id])
            .output()
            .unwrap();
        if st.status.success() {
            failures.push(format!("{what}: runc has the attacker's container"));
            let _ = Command::new("runc")
                .arg("--root")
                .arg(&attacker_root)
                .args(["delete", "--force", &id])
                .status();
        }
    }
    // podman's container is intact: its layer, its /etc/hosts, its bundle.
    assert!(!victim_root.join("victim-was-here").exists());
    let out = w.podman(&["exec", "victim", "cat", "/etc/hosts"]);
    assert!(out.status.success(), "podman exec: {}", text(&out));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("6.6.6.6"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
