//! An independent kubelet stand-in: Python `grpcio` (grpc-core, not tonic) with stubs
//! compiled by grpcio-tools from kubelet's protos in proto/k8s/, against tesserad's
//! device plugin: it serves Registration and PodResourcesLister, registers nothing
//! itself, lists, allocates every advertised device, sees leases follow pods and sees
//! the plugin register again after a kubelet restart. grpc-core sends the socket path
//! as :authority, as kubelet's grpc-go does.
//!
//! Python as in python_client.rs: `$TESSERA_PYTHON` (the venv `make test` makes), else
//! `python3`; SKIPPED without grpcio, grpcio-tools and pytest unless
//! `TESSERA_REQUIRE_PYTHON=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_integration_tests::TestDaemon;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn python() -> Result<PathBuf, String> {
    let py = std::env::var_os("TESSERA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("python3"));
    let out = Command::new(&py)
        .args(["-c", "import grpc, grpc_tools, pytest"])
        .output()
        .map_err(|e| format!("{}: {e}", py.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} lacks grpcio, grpcio-tools or pytest (`make pyvenv` installs them)",
            py.display()
        ));
    }
    Ok(py)
}

#[test]
fn a_grpcio_kubelet_registers_lists_allocates_follows_pods_and_sees_reregistration() {
    let py = match python() {
        Ok(py) => py,
        Err(why) => {
            if std::env::var("TESSERA_REQUIRE_PYTHON").as_deref() == Ok("1") {
                panic!("TESSERA_REQUIRE_PYTHON=1 but {why}");
            }
            say(&format!("SKIPPED: {why}"));
            return;
        }
    };
    let gen_dir = tempfile::tempdir().unwrap();
    for file in [
        "k8s/deviceplugin/v1beta1/api.proto",
        "k8s/podresources/v1/api.proto",
    ] {
        let out = Command::new(&py)
            .args(["-m", "grpc_tools.protoc", "-I"])
            .arg(repo().join("proto"))
            .arg(format!("--python_out={}", gen_dir.path().display()))
            .arg(format!("--grpc_python_out={}", gen_dir.path().display()))
            .arg(file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "grpc_tools.protoc {file}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Short paths: unix socket names are limited to 108 bytes.
    let kubelet = tempfile::Builder::new()
        .prefix("pyk")
        .tempdir_in("/tmp")
        .unwrap();
    let plugins = kubelet.path().join("device-plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    std::fs::create_dir_all(kubelet.path().join("pod-resources")).unwrap();
    let daemon = TestDaemon::start(&format!(
        "[kubernetes]\ndevice_plugin = true\ndevice_plugin_dir = {plugins:?}\n\
         pod_resources_socket = {pr:?}\ncdi_dir = {cdi:?}\nrelease_grace = \"2s\"\npoll_interval = \"200ms\"\n\
         [kubernetes.mix]\n\"mig-1g.10gb\" = 2\ngpu = 1\n",
        pr = kubelet.path().join("pod-resources/kubelet.sock"),
        cdi = kubelet.path().join("cdi"),
    ))
    .unwrap();
    let log = gen_dir.path().join("pytest.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(&py)
        .args(["-m", "pytest", "-v", "-p", "no:cacheprovider"])
        .arg(repo().join("integration-tests/python/test_kubelet_standin.py"))
        .env("KUBELET_DIR", kubelet.path())
        .env("PYTHONPATH", gen_dir.path())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let Some(status) = status else {
        panic!(
            "pytest ran past 180 s:\n{output}\n--- tesserad log:\n{}",
            daemon.log()
        );
    };
    assert!(
        status.success(),
        "the grpcio kubelet failed ({status}):\n{output}\n--- tesserad log:\n{}",
        daemon.log()
    );
    let summary = output
        .lines()
        .rev()
        .find(|l| l.contains(" passed"))
        .unwrap_or("(no pytest summary)");
    say(&format!(
        "python grpcio kubelet ({}): {}",
        py.display(),
        summary.trim_matches(|c: char| c == '=' || c.is_whitespace())
    ));
    assert!(
        !output.contains("skipped") && !output.contains("SKIPPED"),
        "no Python test may skip:\n{output}"
    );
}
