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

use std::time::Duration;

use tessera_integration_tests::TestDaemon;
use tessera_integration_tests::python::{generate_stubs, pytest, python_or_skip, say};

#[test]
fn a_grpcio_kubelet_registers_lists_allocates_follows_pods_and_sees_reregistration() {
    let Some(py) = python_or_skip().unwrap() else {
        return;
    };
    let gen_dir = tempfile::tempdir().unwrap();
    generate_stubs(
        &py,
        gen_dir.path(),
        &[
            "k8s/deviceplugin/v1beta1/api.proto",
            "k8s/podresources/v1/api.proto",
        ],
    )
    .unwrap();
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
    let run = pytest(
        &py,
        "integration-tests/python/test_kubelet_standin.py",
        gen_dir.path(),
        &[("KUBELET_DIR", kubelet.path().as_os_str())],
        Duration::from_secs(180),
    )
    .unwrap();
    let output = &run.output;
    let Some(status) = run.status else {
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
    say(&format!(
        "python grpcio kubelet ({}): {}",
        py.display(),
        run.summary()
    ));
    assert!(
        !output.contains("skipped") && !output.contains("SKIPPED"),
        "no Python test may skip:\n{output}"
    );
}
