//! A gRPC client that is not tonic: Python `grpcio` (grpc-core, like the C++, Ruby,
//! PHP and C# clients) with default channel options, stubs generated from proto/ by
//! grpcio-tools. Runs integration-tests/python/test_grpcio_client.py with pytest
//! against a daemon on the simulator.
//!
//! The Python comes from `$TESSERA_PYTHON` (`make test` points it at the venv it
//! creates with the pinned packages), else `python3`. Without grpcio, grpcio-tools
//! and pytest the test says SKIPPED, unless `TESSERA_REQUIRE_PYTHON=1` (set by `make
//! test`, so CI cannot skip it), which makes it fail instead.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_integration_tests::TestDaemon;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Written past the test harness's capture, so CI logs show it.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The Python to use, or why there is none.
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
            "{} lacks grpcio, grpcio-tools or pytest (`make pyvenv` installs them): {}",
            py.display(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
                .trim()
        ));
    }
    Ok(py)
}

#[test]
fn python_grpcio_with_default_options_talks_to_the_daemon() {
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

    // Stubs from proto/, generated fresh for this run (never committed).
    let gen_dir = tempfile::tempdir().unwrap();
    let protoc = Command::new(&py)
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(repo().join("proto"))
        .arg(format!("--python_out={}", gen_dir.path().display()))
        .arg(format!("--grpc_python_out={}", gen_dir.path().display()))
        .arg("tessera/v1/tessera.proto")
        .output()
        .unwrap();
    assert!(
        protoc.status.success(),
        "grpc_tools.protoc failed:\n{}",
        String::from_utf8_lossy(&protoc.stderr)
    );

    let daemon = TestDaemon::start("").unwrap();
    let log = gen_dir.path().join("pytest.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(&py)
        .args(["-m", "pytest", "-v", "-p", "no:cacheprovider"])
        .arg(repo().join("integration-tests/python/test_grpcio_client.py"))
        .env("TESSERA_SOCKET", &daemon.socket)
        .env("PYTHONPATH", gen_dir.path())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
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
            "pytest ran past 120 s:\n{output}\n--- tesserad log:\n{}",
            daemon.log()
        );
    };
    assert!(
        status.success(),
        "the grpcio client failed ({status}):\n{output}\n--- tesserad log:\n{}",
        daemon.log()
    );
    // pytest's own summary ("8 passed in 0.30s"), so the log shows the Python tests ran.
    let summary = output
        .lines()
        .rev()
        .find(|l| l.contains(" passed"))
        .unwrap_or("(no pytest summary)");
    say(&format!(
        "python grpcio client ({}): {}",
        py.display(),
        summary.trim_matches(|c: char| c == '=' || c.is_whitespace())
    ));
    assert!(
        !output.contains("skipped") && !output.contains("SKIPPED"),
        "no Python test may skip:\n{output}"
    );
}
