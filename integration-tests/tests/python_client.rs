//! A gRPC client that is not tonic: Python `grpcio` (grpc-core, like the C++, Ruby,
//! PHP and C# clients) with default channel options, stubs generated from proto/ by
//! grpcio-tools. Runs integration-tests/python/test_grpcio_client.py with pytest
//! against a daemon on the simulator.
//!
//! Which Python, and when it may skip: see `tessera_integration_tests::python`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tessera_integration_tests::TestDaemon;
use tessera_integration_tests::python::{generate_stubs, pytest, python_or_skip, say};

#[test]
fn python_grpcio_with_default_options_talks_to_the_daemon() {
    let Some(py) = python_or_skip().unwrap() else {
        return;
    };
    // Stubs from proto/, generated fresh for this run (never committed).
    let gen_dir = tempfile::tempdir().unwrap();
    generate_stubs(&py, gen_dir.path(), &["tessera/v1/tessera.proto"]).unwrap();

    let daemon = TestDaemon::start("").unwrap();
    let run = pytest(
        &py,
        "integration-tests/python/test_grpcio_client.py",
        gen_dir.path(),
        &[("TESSERA_SOCKET", daemon.socket.as_os_str())],
        Duration::from_secs(120),
    )
    .unwrap();
    let output = &run.output;
    let Some(status) = run.status else {
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
    // pytest's own summary, so the log shows the Python tests ran.
    say(&format!(
        "python grpcio client ({}): {}",
        py.display(),
        run.summary()
    ));
    assert!(
        !output.contains("skipped") && !output.contains("SKIPPED"),
        "no Python test may skip:\n{output}"
    );
}
