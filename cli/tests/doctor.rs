//! `tessera doctor` on this very host: it must run without a GPU or a daemon, print
//! every check, judge the files it is pointed at, and exit 1 when anything FAILs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

fn doctor(socket: &Path, containerd: &Path, json: bool) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.arg("--socket").arg(socket).arg("doctor");
    c.arg("--containerd-config").arg(containerd);
    if json {
        c.arg("--json");
    }
    c.output().unwrap()
}

fn checks(out: &Output) -> Vec<serde_json::Value> {
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
        .as_array()
        .unwrap()
        .clone()
}

fn find<'a>(checks: &'a [serde_json::Value], name: &str) -> &'a serde_json::Value {
    checks
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name:?}"))
}

const CONTAINERD_OK: &str = r#"version = 2
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.tessera]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.tessera.options]
    BinaryName = "/usr/local/bin/tessera-runtime"
"#;

#[test]
fn missing_socket_and_runtime_class_fail_with_fixes_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let containerd = dir.path().join("config.toml");
    std::fs::write(&containerd, "version = 2\n[plugins]\n").unwrap();
    let socket = dir.path().join("absent.sock");
    let out = doctor(&socket, &containerd, true);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let all = checks(&out);
    let names: Vec<&str> = all.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "nvidia driver",
            "MIG mode",
            "nvidia-caps",
            "MPS control",
            "runc",
            "cgroup mode",
            "AppArmor",
            "containerd runtime class",
            "API socket",
            "MPS directories"
        ]
    );
    // The socket's directory: passable by others, or closed to them (0750, as the unit
    // had it), which would stop a tenant's MPS server.
    for (mode, level, said) in [(0o755, "OK", "passable"), (0o750, "WARN", "mode 0750")] {
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        let c = find(
            &checks(&doctor(&socket, &containerd, true)),
            "MPS directories",
        )
        .clone();
        assert_eq!(c["level"], level, "{c}");
        assert!(c["detail"].as_str().unwrap().contains(said), "{c}");
    }
    for c in &all {
        let level = c["level"].as_str().unwrap();
        assert!(["OK", "WARN", "FAIL"].contains(&level), "{c}");
        // Every non-OK line says what to do.
        assert_eq!(level != "OK", c.get("fix").is_some(), "{c}");
    }
    let s = find(&all, "API socket");
    assert_eq!(s["level"], "FAIL");
    assert!(
        s["detail"].as_str().unwrap().contains("does not exist"),
        "{s}"
    );
    let c = find(&all, "containerd runtime class");
    assert_eq!(c["level"], "FAIL");
    assert!(c["fix"].as_str().unwrap().contains("BinaryName"), "{c}");
    // The driver check is truthful: FAIL exactly when the kernel module is absent.
    let driver_loaded = Path::new("/proc/driver/nvidia/version").exists();
    assert_eq!(
        find(&all, "nvidia driver")["level"] == "FAIL",
        !driver_loaded
    );
}

#[test]
fn configured_runtime_class_and_a_live_group_socket_pass() {
    let dir = tempfile::tempdir().unwrap();
    let containerd = dir.path().join("config.toml");
    std::fs::write(&containerd, CONTAINERD_OK).unwrap();
    let socket = dir.path().join("tesserad.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o660)).unwrap();
    let all = checks(&doctor(&socket, &containerd, true));
    assert_eq!(find(&all, "containerd runtime class")["level"], "OK");
    let s = find(&all, "API socket");
    // Answers, no world bits; the group is not "tessera" in a test dir: WARN.
    assert_ne!(s["level"], "FAIL", "{s}");
    assert!(s["detail"].as_str().unwrap().contains("mode 0660"), "{s}");

    // World-accessible: FAIL.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let all = checks(&doctor(&socket, &containerd, true));
    assert_eq!(find(&all, "API socket")["level"], "FAIL");

    // The text form prints the same verdicts.
    let out = doctor(&socket, &containerd, false);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("OK") && l.contains("containerd runtime class")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("FAIL") && l.contains("API socket")),
        "{text}"
    );
    assert!(text.contains("fix: set [daemon] socket_mode"), "{text}");
}
