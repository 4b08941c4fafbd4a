//! Lease enforcement: MPS control daemons are supervised; containers do not outlive
//! their lease.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tessera_integration_tests::{DEV_GPUS, TestDaemon, create_req, shape};
use tessera_proto::v1 as pb;
use tesserad::gpu::{GpuBackend, SimBackend, SimConfig};

use tessera_integration_tests::rt;

/// The simulator the daemon drives, opened from the test process (the state file is
/// shared safely across processes).
fn sim_of(d: &TestDaemon) -> SimBackend {
    let cfg: toml::Value = toml::from_str(DEV_GPUS).unwrap();
    let sim: SimConfig = cfg["sim"].clone().try_into().unwrap();
    SimBackend::open(&sim, d.sim_state()).unwrap()
}

#[test]
fn a_dead_mps_control_daemon_is_restarted_with_the_lease_limits() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let mut watch = c
            .watch_leases(pb::WatchLeasesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let l = c
            .create_lease(create_req("team-a", shape::mps(30, 6)))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let sim = sim_of(&d);
        sim.kill_mps(&l.id).unwrap();
        assert!(
            !sim.mps_daemons()
                .unwrap()
                .iter()
                .any(|m| m.spec.lease_id == l.id && m.running)
        );
        let mut restarted = None;
        while restarted.is_none() {
            let ev = tokio::time::timeout(Duration::from_secs(10), watch.message())
                .await
                .expect("an MPS restart event within 10s")
                .unwrap()
                .unwrap();
            if ev.kind == pb::LeaseEventKind::MpsRestarted as i32 {
                restarted = Some(ev);
            }
        }
        let ev = restarted.unwrap();
        assert_eq!(ev.lease.unwrap().id, l.id);
        assert!(ev.message.contains("30%"), "{}", ev.message);
        let daemons = sim.mps_daemons().unwrap();
        let m = daemons.iter().find(|m| m.spec.lease_id == l.id).unwrap();
        assert!(m.running);
        assert_eq!(m.spec.sm_percent, 30);
        assert_eq!(m.spec.memory_bytes, 6 << 30);
        // Released: the daemon is stopped and gone.
        c.release_lease(pb::ReleaseLeaseRequest {
            lease_id: l.id.clone(),
            reason: String::new(),
        })
        .await
        .unwrap();
        assert!(
            !sim.mps_daemons()
                .unwrap()
                .iter()
                .any(|m| m.spec.lease_id == l.id)
        );
    });
}

#[test]
fn an_mps_lease_hands_its_private_pipe_dir_to_the_container_uid() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !nix::unistd::geteuid().is_root() {
        // Written past the test harness's capture, so CI logs show the skip.
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("SKIPPED: needs root to chown the MPS directories\n"),
        );
        return;
    }
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let r = c
            .create_lease(create_req("team-a", shape::mps(20, 4)))
            .await
            .unwrap()
            .into_inner();
        let pipe = r.lease.unwrap().partition.unwrap().mps.unwrap().pipe_dir;
        let bind = |id: &str, uid: u32| pb::BindContainerRequest {
            token: r.token.clone(),
            container_id: id.into(),
            cgroup_path: format!("/tessera/x/{id}"),
            runtime_root: "/run/runc".into(),
            uid: Some(uid),
            ..Default::default()
        };
        c.bind_container(bind("c1", 1000)).await.unwrap();
        let meta = std::fs::metadata(&pipe).unwrap();
        assert_eq!(meta.uid(), 1000, "{pipe} owner");
        assert_eq!(meta.permissions().mode() & 0o777, 0o700, "{pipe} mode");
        let base = std::path::Path::new(&pipe).parent().unwrap();
        assert_eq!(std::fs::metadata(base).unwrap().uid(), 1000);
        // The same uid again is fine; another uid cannot share the MPS server.
        c.bind_container(bind("c2", 1000)).await.unwrap();
        let e = c.bind_container(bind("c3", 2000)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("uid 1000"), "{}", e.message());
    });
}
