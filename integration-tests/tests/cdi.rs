//! `[cdi]`: tesserad keeps a CDI spec for every active lease in the CDI directory,
//! written when the lease becomes active, removed when it ends, and the directory
//! brought in line with the leases at start (a spec whose lease ended while the
//! daemon was down goes; one that is missing comes back).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use tessera_integration_tests::{TestDaemon, create_req, rt, shape};
use tessera_proto::v1 as pb;

fn spec_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("tessera.io-lease-{id}.json"))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..400 {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("timed out waiting for {what}");
}

#[test]
fn every_active_lease_has_a_cdi_spec_until_it_ends_across_restarts() {
    let cdi = tempfile::tempdir().unwrap();
    let dir = cdi.path().to_path_buf();
    let mut d = TestDaemon::start(&format!("[cdi]\nenabled = true\ndir = {dir:?}\n")).unwrap();
    let (mig, mps) = rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let mig = c
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let mut req = create_req("team-b", shape::mps(25, 4));
        req.gpu_index = Some(2);
        let mps = c
            .create_lease(req)
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        (mig, mps)
    });
    wait_until("both specs", || {
        spec_path(&dir, &mig.id).exists() && spec_path(&dir, &mps.id).exists()
    });
    // The MIG lease's spec: its kind and name, its GPU's and instance's nodes, its env.
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(spec_path(&dir, &mig.id)).unwrap()).unwrap();
    assert_eq!(spec["kind"], "tessera.io/lease");
    assert_eq!(spec["devices"][0]["name"], mig.id.as_str());
    let gpu = mig.partition.as_ref().unwrap().gpu_index;
    let nodes: Vec<&str> = spec["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert!(
        nodes.contains(&format!("/dev/nvidia{gpu}").as_str()),
        "{nodes:?}"
    );
    assert!(nodes.contains(&"/dev/nvidiactl"), "{nodes:?}");
    let env = spec["devices"][0]["containerEdits"]["env"].to_string();
    assert!(
        env.contains(&format!("TESSERA_LEASE_ID={}", mig.id)),
        "{env}"
    );
    // The MPS lease's spec mounts its pipe directory.
    let mps_spec = std::fs::read_to_string(spec_path(&dir, &mps.id)).unwrap();
    assert!(mps_spec.contains("\"mounts\""), "{mps_spec}");
    // Only root may write the directory's files; everyone may read them.
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(spec_path(&dir, &mig.id))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o644);

    // Released: its spec goes.
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        c.release_lease(pb::ReleaseLeaseRequest {
            lease_id: mig.id.clone(),
            reason: "test".into(),
        })
        .await
        .unwrap();
    });
    wait_until("the released lease's spec to go", || {
        !spec_path(&dir, &mig.id).exists()
    });

    // While the daemon is down: a stale spec appears, a live lease's spec is lost.
    assert_eq!(d.stop().unwrap(), Some(0));
    std::fs::write(spec_path(&dir, "l-gone"), "{}").unwrap();
    std::fs::remove_file(spec_path(&dir, &mps.id)).unwrap();
    std::fs::write(dir.join("other-vendor.json"), "{}").unwrap();
    d.spawn().unwrap();
    wait_until("the start's sync", || {
        spec_path(&dir, &mps.id).exists() && !spec_path(&dir, "l-gone").exists()
    });
    assert!(
        dir.join("other-vendor.json").exists(),
        "another vendor's spec was touched"
    );
}
