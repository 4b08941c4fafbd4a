//! Install: the systemd unit's required directives, `systemd-analyze verify` (when
//! the tool is on the machine), and `make install` with DESTDIR/PREFIX.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_integration_tests::bin_path;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// section -> key -> values (a key may repeat, e.g. DeviceAllow).
fn parse_unit(text: &str) -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let mut out: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    let mut section = String::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = s.to_string();
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("not key=value: {line}"));
        assert!(!section.is_empty(), "key outside a section: {line}");
        out.entry(section.clone())
            .or_default()
            .entry(k.trim().to_string())
            .or_default()
            .push(v.trim().to_string());
    }
    out
}

#[test]
fn unit_has_the_directives_the_daemon_relies_on() {
    let text = std::fs::read_to_string(repo().join("systemd/tesserad.service")).unwrap();
    let unit = parse_unit(&text);
    let one = |section: &str, key: &str| -> String {
        let v = unit
            .get(section)
            .and_then(|s| s.get(key))
            .unwrap_or_else(|| panic!("[{section}] {key} missing"));
        assert_eq!(v.len(), 1, "[{section}] {key} set {} times", v.len());
        v[0].clone()
    };
    // tesserad sends READY=1 only once reconciled and bound.
    assert_eq!(one("Service", "Type"), "notify");
    assert_eq!(one("Service", "NotifyAccess"), "main");
    // The daemon feeds the watchdog at half its interval.
    let wd: u64 = one("Service", "WatchdogSec").parse().unwrap();
    assert!(wd > 0, "WatchdogSec must be set");
    let exec = one("Service", "ExecStart");
    assert!(
        exec.starts_with("/usr/local/bin/tesserad --config /etc/tessera/"),
        "make install rewrites these prefixes: {exec}"
    );
    assert_eq!(one("Service", "Restart"), "on-failure");
    assert_eq!(one("Service", "StateDirectory"), "tessera");
    assert_eq!(one("Service", "RuntimeDirectory"), "tessera");
    // A lease's MPS server runs as its tenant's uid and must pass through the run
    // directory to its pipe directory: others get x (not r, not w).
    let mode = u32::from_str_radix(&one("Service", "RuntimeDirectoryMode"), 8).unwrap();
    assert_eq!(mode & 0o007, 0o001, "RuntimeDirectoryMode {mode:o}");
    let tmpfiles = std::fs::read_to_string(repo().join("systemd/tessera.tmpfiles.conf")).unwrap();
    assert!(
        tmpfiles.lines().any(
            |l| l.split_whitespace().collect::<Vec<_>>()[..].starts_with(&[
                "d",
                "/run/tessera",
                "0751"
            ])
        ),
        "{tmpfiles}"
    );
    // NVML needs the NVIDIA device nodes.
    assert_eq!(one("Service", "PrivateDevices"), "no");
    assert_eq!(one("Install", "WantedBy"), "multi-user.target");
}

#[test]
fn systemd_analyze_verify_accepts_the_unit() {
    if !on_path("systemd-analyze") {
        // Written past the test harness's capture, so CI logs show the skip.
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("SKIPPED: systemd-analyze not found\n"),
        );
        return;
    }
    // verify checks that ExecStart is executable: point it at the built binary,
    // the same rewrite `make install` does for BINDIR.
    let bin_dir = bin_path("tesserad")
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let text = std::fs::read_to_string(repo().join("systemd/tesserad.service")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let unit = dir.path().join("tesserad.service");
    std::fs::write(
        &unit,
        text.replace("/usr/local/bin/", &format!("{}/", bin_dir.display())),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "systemd-analyze verify failed:\n{stderr}"
    );
    // Anything it says about our unit is a defect (it may talk about host units).
    let ours: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("tesserad.service"))
        .collect();
    assert!(ours.is_empty(), "systemd-analyze complained:\n{stderr}");
}

#[test]
fn make_install_honours_destdir_and_prefix_and_keeps_existing_configs() {
    if !on_path("make") {
        // Written past the test harness's capture, so CI logs show the skip.
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("SKIPPED: make not found\n"),
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // Stand-in binaries: this tests the layout, not the build.
    let target = tmp.path().join("target");
    std::fs::create_dir_all(target.join("debug")).unwrap();
    for b in ["tesserad", "tessera", "tessera-runtime"] {
        let p = target.join("debug").join(b);
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let root = tmp.path().join("root");
    let install = || {
        let out = Command::new("make")
            .current_dir(repo())
            .env_remove("MAKEFLAGS")
            .env_remove("MAKELEVEL")
            .env_remove("MFLAGS")
            .arg("install")
            .arg(format!("DESTDIR={}", root.display()))
            .arg("PREFIX=/opt/tessera")
            .arg("PROFILE=debug")
            .arg(format!("TARGET_DIR={}", target.display()))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "make install failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    install();
    for b in ["tesserad", "tessera", "tessera-runtime"] {
        assert!(root.join("opt/tessera/bin").join(b).is_file(), "{b}");
    }
    let unit = std::fs::read_to_string(root.join("lib/systemd/system/tesserad.service")).unwrap();
    assert!(
        unit.contains("ExecStart=/opt/tessera/bin/tesserad --config /etc/tessera/tesserad.toml"),
        "{unit}"
    );
    assert!(root.join("usr/lib/tmpfiles.d/tessera.conf").is_file());
    assert!(root.join("usr/lib/sysusers.d/tessera.conf").is_file());
    let conf = root.join("etc/tessera/tesserad.toml");
    assert_eq!(
        std::fs::read_to_string(&conf).unwrap(),
        std::fs::read_to_string(repo().join("configs/tesserad.toml")).unwrap()
    );
    // Whatever runtime configs and profiles the tree ships land in place.
    let shipped = |sub: &str| -> Vec<String> {
        std::fs::read_dir(repo().join("configs").join(sub))
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.path().is_file())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    if repo().join("configs/runtime.toml").is_file() {
        assert!(root.join("etc/tessera/runtime.toml").is_file());
    }
    for f in shipped("seccomp") {
        assert!(root.join("etc/tessera/seccomp").join(&f).is_file(), "{f}");
    }
    for f in shipped("apparmor") {
        assert!(root.join("etc/apparmor.d").join(&f).is_file(), "{f}");
    }

    // An operator's edited config survives a reinstall; the new one lands beside it.
    std::fs::write(&conf, "# edited\n").unwrap();
    let out = install();
    assert_eq!(std::fs::read_to_string(&conf).unwrap(), "# edited\n");
    assert!(root.join("etc/tessera/tesserad.toml.example").is_file());
    assert!(out.contains("kept existing"), "{out}");
}
