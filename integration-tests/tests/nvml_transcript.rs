//! The fake NVML against the real one: `integration-tests/gpu/nvml_transcript.py`
//! recorded what libnvidia-ml answered on a real H200 (driver 580.159.04, MIG off) to
//! the calls tesserad makes and their edge cases (in/out counts, MIG queries with MIG
//! off, bad handles, an event wait); the same script runs here against the fake set up
//! as one H200, and every answer must be the real one: return code and values. Only
//! what differs from host to host is left out (driver version, PCI address and device
//! id, the supported-event mask) and one call tesserad does not make
//! (`nvmlDeviceGetMemoryInfo` v1; it uses `_v2`). Needs python3.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use tessera_integration_tests::{fake_nvml_ctl, fake_nvml_library};

/// Calls whose answers are the host's, not the model's.
const HOST_SPECIFIC: &[&str] = &[
    "driver version",
    "gpu0 pci",
    "gpu0 supported events",
    "gpu0 memory",
];

#[test]
fn the_fake_answers_the_calls_tesserad_makes_as_a_real_h200_did() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let real: Value = serde_json::from_slice(
        &std::fs::read(
            repo.join("integration-tests/gpu/transcripts/h200-driver-580.159.04-mig-off.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    fake_nvml_ctl(dir.path(), &["init", "h200-141gb"]).unwrap();
    let out = dir.path().join("fake.json");
    let run = Command::new("python3")
        .arg(repo.join("integration-tests/gpu/nvml_transcript.py"))
        .arg("--lib")
        .arg(fake_nvml_library().unwrap())
        .arg("--out")
        .arg(&out)
        .env(
            "TESSERA_FAKE_NVML_STATE",
            dir.path().join("nvml-fake-state.json"),
        )
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "nvml_transcript.py on the fake: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let fake: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let fake_calls = fake["calls"].as_array().unwrap();
    let mut differences = Vec::new();
    let real_calls = real["calls"].as_array().unwrap();
    assert!(real_calls.len() > 60, "the recorded transcript is short");
    for r in real_calls {
        let label = r["call"].as_str().unwrap();
        if HOST_SPECIFIC.contains(&label) {
            continue;
        }
        let Some(f) = fake_calls.iter().find(|f| f["call"] == r["call"]) else {
            differences.push(format!("{label}: not made against the fake"));
            continue;
        };
        if f["rc_name"] != r["rc_name"] || f["out"] != r["out"] {
            differences.push(format!(
                "{label}: real {} {}, fake {} {}",
                r["rc_name"], r["out"], f["rc_name"], f["out"]
            ));
        }
    }
    assert!(
        differences.is_empty(),
        "the fake answers otherwise than the real H200:\n{}",
        differences.join("\n")
    );
}
