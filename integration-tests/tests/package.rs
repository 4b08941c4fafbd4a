//! The Debian package as an operator meets it: built from the test build
//! (deploy/debian/build-deb.sh, what `make deb` runs), checked by lintian, installed
//! with `dpkg -i`, its unit verified, its tesserad started on simulated GPUs and
//! answered by its CLI, then removed (configuration and state kept) and purged
//! (nothing left). Needs root and dpkg; it never replaces a tessera package that is
//! already installed on the machine.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_integration_tests::bin_path;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

fn skip(why: &str) {
    // Written past the test harness's capture, so CI logs show the skip.
    let _ = std::io::Write::write_fmt(&mut std::io::stderr(), format_args!("SKIPPED: {why}\n"));
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn installed() -> bool {
    run(Command::new("dpkg-query").args(["-W", "-f=${Status}", "tessera"]))
        .1
        .contains("install ok installed")
}

fn group_exists(name: &str) -> bool {
    run(Command::new("getent").args(["group", name])).0
}

/// Build the package from the debug binaries the test suite runs.
fn build_deb(out: &Path) -> PathBuf {
    let target_dir = bin_path("tesserad")
        .unwrap()
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    let (ok, text) = run(Command::new(repo().join("deploy/debian/build-deb.sh"))
        .args(["--profile", "debug", "--out"])
        .arg(out)
        .env("CARGO_TARGET_DIR", &target_dir));
    assert!(ok, "build-deb.sh failed:\n{text}");
    let debs: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "deb"))
        .collect();
    assert_eq!(debs.len(), 1, "{debs:?}\n{text}");
    let name = debs[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("tessera_") && name.ends_with(".deb"),
        "{name}"
    );
    debs[0].clone()
}

/// The regular files the package holds, as absolute paths.
fn package_files(deb: &Path) -> Vec<PathBuf> {
    let (ok, text) = run(Command::new("dpkg-deb").arg("--contents").arg(deb));
    assert!(ok, "{text}");
    text.lines()
        .filter(|l| l.starts_with('-'))
        .filter_map(|l| l.split_whitespace().last())
        .map(|p| PathBuf::from(p.trim_start_matches('.')))
        .collect()
}

#[test]
fn the_deb_builds_installs_serves_and_purges_clean() {
    if !on_path("dpkg-deb") || !on_path("dpkg") {
        skip("dpkg is not on this machine (not Debian)");
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let deb = build_deb(work.path());
    let files = package_files(&deb);
    for want in [
        "/usr/bin/tesserad",
        "/usr/bin/tessera",
        "/usr/bin/tessera-runtime",
        "/lib/systemd/system/tesserad.service",
        "/usr/lib/sysusers.d/tessera.conf",
        "/usr/lib/tmpfiles.d/tessera.conf",
        "/etc/tessera/tesserad.toml",
        "/etc/tessera/runtime.toml",
        "/etc/apparmor.d/tessera-tenant",
        "/usr/share/man/man1/tessera.1.gz",
        "/usr/share/man/man1/tessera-lease-create.1.gz",
        "/usr/share/man/man8/tesserad.8.gz",
        "/usr/share/bash-completion/completions/tessera",
        "/usr/share/tessera/containerd/tessera-runtime.toml",
        "/usr/share/tessera/monitoring/tessera-alerts.yaml",
        "/usr/share/doc/tessera/copyright",
    ] {
        assert!(
            files.iter().any(|f| f == Path::new(want)),
            "{want} is not in the package: {files:?}"
        );
    }
    let (_, info) = run(Command::new("dpkg-deb").arg("--info").arg(&deb));
    assert!(info.contains("Package: tessera"), "{info}");
    assert!(info.contains("Depends: libc6 (>="), "{info}");
    // Every file under /etc is a conffile (an operator's edits survive upgrades).
    let (_, conffiles) = run(Command::new("dpkg-deb")
        .arg("--field")
        .arg(&deb)
        .arg("Package"));
    assert_eq!(conffiles.trim(), "tessera");
    let ctl = work.path().join("control");
    let (ok, text) = run(Command::new("dpkg-deb")
        .arg("--control")
        .arg(&deb)
        .arg(&ctl));
    assert!(ok, "{text}");
    let conf = std::fs::read_to_string(ctl.join("conffiles")).unwrap();
    for f in files.iter().filter(|f| f.starts_with("/etc")) {
        assert!(
            conf.lines().any(|l| Path::new(l) == f.as_path()),
            "{} is not a conffile:\n{conf}",
            f.display()
        );
    }

    if on_path("lintian") {
        let (_, text) = run(Command::new("lintian")
            .args(["--tag-display-limit", "0"])
            .arg(&deb));
        let errors: Vec<&str> = text.lines().filter(|l| l.starts_with("E:")).collect();
        assert!(errors.is_empty(), "lintian reports errors:\n{text}");
    } else {
        skip("lintian is not installed (`make deps` installs it): package not linted");
    }

    if !nix::unistd::geteuid().is_root() {
        skip("not root: the package is built and linted, not installed");
        return;
    }
    if installed() {
        skip("a tessera package is installed on this machine: the test will not replace it");
        return;
    }
    // Purge deletes these: never when they hold someone's own install (`make install`).
    for d in ["/etc/tessera", "/var/lib/tessera", "/usr/share/tessera"] {
        if Path::new(d).exists() {
            skip(&format!(
                "{d} exists (a tessera installed without the package?): the package is built and linted, not installed"
            ));
            return;
        }
    }
    let had_group = group_exists("tessera");

    let (ok, text) = run(Command::new("dpkg").arg("-i").arg(&deb));
    assert!(ok, "dpkg -i failed:\n{text}");
    let installed_ok = std::panic::catch_unwind(|| check_installed(&files));
    // Whatever the checks said, take the package off the machine again.
    let (ok, text) = run(Command::new("dpkg").args(["-r", "tessera"]));
    assert!(ok, "dpkg -r failed:\n{text}");
    let removed_ok = std::panic::catch_unwind(|| {
        for b in [
            "/usr/bin/tesserad",
            "/usr/bin/tessera",
            "/usr/bin/tessera-runtime",
        ] {
            assert!(!Path::new(b).exists(), "{b} left after remove");
        }
        // Remove keeps the configuration and the lease store.
        assert!(Path::new("/etc/tessera/tesserad.toml").exists());
        assert!(Path::new("/var/lib/tessera").is_dir());
    });
    let (ok, text) = run(Command::new("dpkg").args(["-P", "tessera"]));
    assert!(ok, "dpkg -P failed:\n{text}");
    if let Err(e) = installed_ok {
        std::panic::resume_unwind(e);
    }
    if let Err(e) = removed_ok {
        std::panic::resume_unwind(e);
    }
    assert!(!installed(), "dpkg still lists tessera after purge");
    for f in &files {
        assert!(!f.exists(), "{} left after purge", f.display());
    }
    for d in ["/etc/tessera", "/var/lib/tessera", "/usr/share/tessera"] {
        assert!(!Path::new(d).exists(), "{d} left after purge");
    }
    if !had_group {
        assert!(
            !group_exists("tessera"),
            "the tessera group is left after purge"
        );
    }
}

/// What an operator finds after `dpkg -i`, and the installed daemon serving.
fn check_installed(files: &[PathBuf]) {
    for f in files {
        assert!(f.exists(), "{} not installed", f.display());
    }
    assert!(group_exists("tessera"), "postinst made no tessera group");
    let state = std::fs::metadata("/var/lib/tessera").expect("postinst made no /var/lib/tessera");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&state.permissions()) & 0o777,
        0o700
    );
    let (ok, help) = run(Command::new("/usr/bin/tessera").arg("--help"));
    assert!(ok && help.contains("lease"), "{help}");

    if on_path("systemd-analyze") {
        let (ok, text) = run(Command::new("systemd-analyze")
            .args(["verify", "/lib/systemd/system/tesserad.service"]));
        let ours: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("tesserad.service"))
            .collect();
        assert!(
            ok && ours.is_empty(),
            "systemd-analyze verify on the installed unit:\n{text}"
        );
    } else {
        skip("systemd-analyze not found: the installed unit is not verified");
    }

    // The installed tesserad on simulated GPUs, answered by the installed CLI.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("tesserad.sock");
    let config = dir.path().join("tesserad.toml");
    std::fs::write(
        &config,
        format!(
            "[daemon]\nsocket = {:?}\nstate_dir = {:?}\nrun_dir = {:?}\n\n[gpu]\nbackend = \"sim\"\n\n[sim]\nstate_file = {:?}\n\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n\n[cdi]\nenabled = false\n",
            socket,
            dir.path().join("state"),
            dir.path().join("run"),
            dir.path().join("sim.json"),
        ),
    )
    .unwrap();
    let mut child = Command::new("/usr/bin/tesserad")
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut answer = String::new();
    while Instant::now() < deadline {
        let (ok, text) = run(Command::new("/usr/bin/tessera")
            .arg("--socket")
            .arg(&socket)
            .arg("gpus"));
        if ok {
            answer = text;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Our own child, not reaped yet: its pid is still its own.
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = child.wait().unwrap();
    assert!(
        answer.contains("H100"),
        "the installed CLI got no answer from the installed daemon: {answer}"
    );
    assert!(status.success(), "the installed tesserad exited {status}");
}
