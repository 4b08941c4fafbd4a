//! GPU health end to end, on the real binaries: the simulator is told of an XID
//! (`tesserad sim xid`) or loses a GPU (`tesserad sim lose`), and the daemon takes the
//! GPU out of service. Its leases hear of it on the watch stream and in their status,
//! `tessera gpus` and `tessera_gpu_healthy` show it, new leases go elsewhere, and it
//! returns by `tessera gpu mark-healthy` (audited) or, for a lost GPU, by itself.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use tessera_integration_tests::{TestDaemon, create_req, lease_of, rt, shape};
use tessera_proto::v1 as pb;
use tonic_types::StatusExt;

/// The `tessera_gpu_healthy` sample of GPU `gpu`.
fn healthy_metric(addr: &str, gpu: u32) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    resp.lines()
        .find(|l| l.starts_with("tessera_gpu_healthy{") && l.contains(&format!("gpu=\"{gpu}\"")))
        .map(str::to_string)
}

async fn next_event(
    stream: &mut tonic::Streaming<pb::LeaseEvent>,
    kind: pb::LeaseEventKind,
) -> pb::LeaseEvent {
    let deadline = Duration::from_secs(15);
    loop {
        let ev = tokio::time::timeout(deadline, stream.message())
            .await
            .unwrap_or_else(|_| panic!("no {kind:?} event within {deadline:?}"))
            .unwrap()
            .unwrap();
        if ev.kind == kind as i32 {
            return ev;
        }
    }
}

async fn gpu(
    c: &mut pb::tessera_client::TesseraClient<tonic::transport::Channel>,
    i: usize,
) -> pb::Gpu {
    c.get_node(pb::GetNodeRequest {})
        .await
        .unwrap()
        .into_inner()
        .gpus
        .swap_remove(i)
}

#[test]
fn an_xid_takes_a_gpu_out_of_service_end_to_end_until_an_operator_returns_it() {
    let d = TestDaemon::start("[metrics]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    let addr = d.metrics_addr().unwrap();
    let rt = rt();
    let lease = rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let mut req = create_req("team-a", shape::mig("1g.10gb"));
        req.gpu_index = Some(0);
        let lease = c
            .create_lease(req)
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let mut watch = c
            .watch_leases(pb::WatchLeasesRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(healthy_metric(&addr, 0).unwrap().ends_with(" 1"));

        d.sim(&["xid", "--gpu", "0", "--xid", "79"]);
        let ev = next_event(&mut watch, pb::LeaseEventKind::Unhealthy).await;
        assert_eq!(ev.lease.as_ref().unwrap().id, lease.id);
        assert!(ev.message.contains("XID 79"), "{}", ev.message);

        let g0 = gpu(&mut c, 0).await;
        assert!(
            !g0.healthy && g0.health.contains("fallen off the bus"),
            "{g0:?}"
        );
        let got = lease_of(&mut c, &lease.id).await;
        assert!(got.unhealthy.contains("GPU 0"), "{got:?}");
        assert_eq!(got.state, pb::LeaseState::Active as i32, "default: kept");

        // New leases: never on GPU 0; pinned there, a precise refusal.
        let mut pinned = create_req("team-a", shape::mig("1g.10gb"));
        pinned.gpu_index = Some(0);
        let st = c.create_lease(pinned).await.unwrap_err();
        assert_eq!(st.code(), tonic::Code::FailedPrecondition);
        assert_eq!(st.get_details_error_info().unwrap().reason, "GPU_UNHEALTHY");
        for _ in 0..3 {
            let l = c
                .create_lease(create_req("team-a", shape::mig("1g.10gb")))
                .await
                .unwrap()
                .into_inner()
                .lease
                .unwrap();
            assert_eq!(l.partition.unwrap().gpu_index, 1);
        }
        lease
    });
    let sample = healthy_metric(&addr, 0).unwrap();
    assert!(
        sample.contains("cause=\"xid-79\"") && sample.ends_with(" 0"),
        "{sample}"
    );
    let (ok, out) = d.cli(&["gpus"]);
    assert!(ok && out.contains("UNHEALTHY: XID 79"), "{out}");
    let (ok, out) = d.cli(&["lease", "show", &lease.id]);
    assert!(ok && out.contains("UNHEALTHY"), "{out}");

    // Back by an operator, with a reason that lands in the audit log.
    let (ok, out) = d.cli(&["gpu", "mark-healthy", "0"]);
    assert!(!ok && out.contains("--reason"), "{out}");
    let (ok, out) = d.cli(&["gpu", "mark-healthy", "0", "--reason", "node rebooted"]);
    assert!(ok && out.contains("GPU 0 is now in service"), "{out}");
    let (ok, out) = d.cli(&["gpu", "mark-healthy", "0", "--reason", "again"]);
    assert!(ok && out.contains("already in service"), "{out}");
    assert!(healthy_metric(&addr, 0).unwrap().ends_with(" 1"));
    let audit = std::fs::read_to_string(d.dir.path().join("state/audit.jsonl")).unwrap();
    assert!(
        audit
            .lines()
            .any(|l| l.contains("GpuMarkedHealthy") && l.contains("node rebooted")),
        "{audit}"
    );
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        assert!(gpu(&mut c, 0).await.healthy);
        let mut req = create_req("team-a", shape::mig("1g.10gb"));
        req.gpu_index = Some(0);
        c.create_lease(req).await.unwrap();
    });
}

#[test]
fn a_gpu_off_the_bus_is_found_by_the_poll_and_returns_when_it_is_back() {
    let mut d = TestDaemon::start("[health]\npoll_interval = \"100ms\"\n").unwrap();
    let rt = rt();
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let mut req = create_req("team-a", shape::mig("2g.20gb"));
        req.gpu_index = Some(1);
        c.create_lease(req).await.unwrap();
        let mut watch = c
            .watch_leases(pb::WatchLeasesRequest::default())
            .await
            .unwrap()
            .into_inner();
        d.sim(&["lose", "--gpu", "1"]);
        let ev = next_event(&mut watch, pb::LeaseEventKind::Unhealthy).await;
        assert!(ev.message.contains("fallen off the bus"), "{}", ev.message);
        assert!(!gpu(&mut c, 1).await.healthy);
        d.sim(&["recover", "--gpu", "1"]);
        let ev = next_event(&mut watch, pb::LeaseEventKind::Healthy).await;
        assert!(ev.message.contains("NVML poll"), "{}", ev.message);
        assert!(gpu(&mut c, 1).await.healthy);
    });
    // An XID mark outlives a restart of the daemon.
    d.sim(&["xid", "--gpu", "0", "--xid", "48"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        while gpu(&mut c, 0).await.healthy {
            assert!(Instant::now() < deadline, "XID 48 not noticed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    d.stop().unwrap();
    d.spawn().unwrap();
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let g0 = gpu(&mut c, 0).await;
        assert!(!g0.healthy && g0.health.contains("XID 48"), "{g0:?}");
    });
}

/// Wait (up to 15 s) until GPU `i` is back in service.
async fn until_healthy(
    c: &mut pb::tessera_client::TesseraClient<tonic::transport::Channel>,
    i: usize,
) -> pb::Gpu {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let g = gpu(c, i).await;
        if g.healthy {
            return g;
        }
        assert!(Instant::now() < deadline, "GPU {i} never came back: {g:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn a_gpu_lost_before_the_start_is_fenced_and_the_others_are_served() {
    let mut d = TestDaemon::configure(
        tessera_integration_tests::DEV_GPUS,
        "[health]\npoll_interval = \"100ms\"\n",
    )
    .unwrap();
    d.sim(&["lose", "--gpu", "1"]);
    d.spawn()
        .expect("one lost GPU of three must not stop the daemon");
    let rt = rt();
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let g1 = gpu(&mut c, 1).await;
        assert!(
            !g1.healthy && g1.health.contains("fallen off the bus"),
            "{g1:?}"
        );
        assert_eq!(
            g1.free_slices, 0,
            "no capacity on a GPU it cannot read: {g1:?}"
        );
        assert!(gpu(&mut c, 0).await.healthy);
        // The others serve; the lost one is refused by name.
        let l = c
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(l.partition.unwrap().gpu_index, 0);
        let mut on_lost = create_req("team-a", shape::mig("1g.10gb"));
        on_lost.gpu_index = Some(1);
        let e = c.create_lease(on_lost).await.unwrap_err();
        assert_eq!(
            e.get_details_error_info().map(|i| i.reason),
            Some("GPU_UNHEALTHY".to_owned()),
            "{e:?}"
        );
        let (ok, out) = d.cli(&["gpus"]);
        assert!(ok && out.contains("fallen off the bus"), "{out}");
        // Over NVML nothing of it could be read: an operator cannot return it yet.
        if tessera_integration_tests::backend() == tessera_integration_tests::Backend::Nvml {
            let (ok, out) = d.cli(&["gpu", "mark-healthy", "1", "--reason", "too early"]);
            assert!(!ok && out.contains("GPU_IS_LOST"), "{out}");
            assert!(!gpu(&mut c, 1).await.healthy);
        }
        // Back on the bus: read again, profiles too, and in service.
        d.sim(&["recover", "--gpu", "1"]);
        let g1 = until_healthy(&mut c, 1).await;
        assert!(g1.mig_enabled && !g1.profiles.is_empty(), "{g1:?}");
        assert_eq!(g1.free_slices, 8, "{g1:?}");
        let mut on_back = create_req("team-a", shape::mig("1g.10gb"));
        on_back.gpu_index = Some(1);
        c.create_lease(on_back).await.unwrap();
    });
}

#[test]
fn mig_profiles_that_cannot_be_read_are_said_and_offer_no_capacity() {
    let mut d = TestDaemon::configure(
        tessera_integration_tests::DEV_GPUS,
        "[health]\npoll_interval = \"100ms\"\n",
    )
    .unwrap();
    d.sim(&["fault", "--call", "gi_profiles", "--fail-rate", "1"]);
    d.spawn()
        .expect("unreadable MIG profiles must not stop the daemon");
    let rt = rt();
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        for i in [0, 1] {
            let g = gpu(&mut c, i).await;
            assert!(!g.healthy && g.health.contains("NVML query fails"), "{g:?}");
            assert_eq!(g.free_slices, 0, "{g:?}");
            assert!(g.profiles.is_empty(), "{g:?}");
        }
        // The GPU without MIG serves.
        let g2 = gpu(&mut c, 2).await;
        assert!(g2.healthy, "{g2:?}");
        c.create_lease(create_req("team-a", shape::whole()))
            .await
            .unwrap();
        let (ok, out) = d.cli(&["gpus"]);
        assert!(ok && out.contains("NVML query fails"), "{out}");
        d.sim(&["clear-faults"]);
        let g0 = until_healthy(&mut c, 0).await;
        assert_eq!(g0.free_slices, 8, "{g0:?}");
        assert!(!g0.profiles.is_empty(), "{g0:?}");
    });
}

#[test]
fn doctor_checks_the_host_the_daemon_s_config_names() {
    let d = TestDaemon::configure(tessera_integration_tests::DEV_GPUS, "").unwrap();
    let config = d.config.to_string_lossy().into_owned();
    let doctor = || {
        // Other checks (containerd, AppArmor) may FAIL on a test host: only the
        // lines about the GPUs are looked at.
        d.cli(&["doctor", "--config", &config]).1
    };
    let line = |out: &str, name: &str| {
        out.lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("no {name} line:\n{out}"))
            .to_owned()
    };
    let out = doctor();
    match tessera_integration_tests::backend() {
        tessera_integration_tests::Backend::Sim => {
            assert!(
                line(&out, "nvidia driver").contains("backend is \"sim\""),
                "{out}"
            );
        }
        tessera_integration_tests::Backend::Nvml => {
            let driver = line(&out, "nvidia driver");
            assert!(
                driver.starts_with("OK") && driver.contains("libnvidia-ml.so.1"),
                "{out}"
            );
            let mig = line(&out, "MIG mode");
            assert!(mig.contains("enabled on GPU 0, 1"), "{out}");
            assert!(line(&out, "nvidia-caps").starts_with("OK"), "{out}");
            assert!(line(&out, "MPS control").starts_with("OK"), "{out}");
            d.sim(&["lose", "--gpu", "1"]);
            let out = doctor();
            let mig = line(&out, "MIG mode");
            assert!(mig.starts_with("WARN") && mig.contains("GPU 1"), "{out}");
        }
    }
}
