//! The real `tesserad` binary on simulated GPUs, driven over its unix socket.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::Duration;

use tessera_integration_tests::{TestDaemon, bin_path, create_req, shape};
use tessera_proto::v1 as pb;
use tonic::Code;

use tessera_integration_tests::{lease_of, rt};

#[test]
fn two_h100s_take_fourteen_1g_instances_and_refuse_the_fifteenth() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let mut placements = HashSet::new();
        for i in 0..14 {
            let r = c
                .create_lease(create_req("team-a", shape::mig("1g.10gb")))
                .await
                .unwrap_or_else(|e| panic!("lease {i}: {e}"))
                .into_inner();
            let lease = r.lease.unwrap();
            assert_eq!(lease.state, pb::LeaseState::Active as i32);
            assert!(r.token.starts_with("tsr1_"), "token {}", r.token.len());
            let p = lease.partition.unwrap();
            let mig = p.mig.unwrap();
            assert!(mig.mig_uuid.starts_with("MIG-"), "{}", mig.mig_uuid);
            assert!(placements.insert((p.gpu_index, mig.placement_start)));
            assert!(p.gpu_index < 2, "1g instances only on the MIG GPUs");
        }
        let err = c
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
        assert!(err.message().contains("1g.10gb"), "{}", err.message());

        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(node.backend, tessera_integration_tests::backend().name());
        assert_eq!(node.gpus.len(), 3);
        for g in &node.gpus[..2] {
            assert!(g.mig_enabled);
            assert_eq!(g.partitions.len(), 7);
            assert_eq!(g.free_slices, 1);
            let p = g.profiles.iter().find(|p| p.profile == "1g.10gb").unwrap();
            assert_eq!(p.free, 0);
        }
    });
}

#[test]
fn mixed_profiles_pack_without_overlap_and_capacity_is_reported() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let mut made = Vec::new();
        for prof in [
            "4g.40gb", "3g.40gb", "3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb",
        ] {
            let r = c
                .create_lease(create_req("team-a", shape::mig(prof)))
                .await
                .unwrap_or_else(|e| panic!("{prof}: {e}"))
                .into_inner();
            let p = r.lease.unwrap().partition.unwrap();
            let m = p.mig.unwrap();
            assert_eq!(m.profile, prof);
            made.push((p.gpu_index, m.placement_start, m.placement_size));
        }
        for (i, a) in made.iter().enumerate() {
            for b in &made[i + 1..] {
                let overlap = a.0 == b.0 && a.1 < b.1 + b.2 && b.1 < a.1 + a.2;
                assert!(!overlap, "{a:?} overlaps {b:?}");
            }
        }
        // Both GPUs are now full: all 16 memory slices are used.
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(node.gpus[0].free_slices + node.gpus[1].free_slices, 0);
        let err = c
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
        // An unknown profile is an InvalidArgument naming what exists.
        let err = c
            .create_lease(create_req("team-a", shape::mig("5g.50gb")))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("1g.10gb"), "{}", err.message());
    });
}

#[test]
fn mps_admission_keeps_sm_and_memory_sums_within_the_gpu() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        // GPU 2 is the A100-40GB without MIG: the only place for MPS.
        let a = c
            .create_lease(create_req("t1", shape::mps(60, 16)))
            .await
            .unwrap()
            .into_inner();
        let la = a.lease.unwrap();
        assert_eq!(la.partition.as_ref().unwrap().gpu_index, 2);
        let mps = la.partition.unwrap().mps.unwrap();
        assert_eq!(mps.sm_percent, 60);
        assert!(
            std::path::Path::new(&mps.pipe_dir).is_dir(),
            "pipe dir made"
        );

        let err = c
            .create_lease(create_req("t2", shape::mps(50, 4)))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
        assert!(err.message().contains('%'), "{}", err.message());

        c.create_lease(create_req("t2", shape::mps(40, 8)))
            .await
            .unwrap();
        let err = c
            .create_lease(create_req("t3", shape::mps(0, 1)))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "0% is invalid: {err}");
        // A whole GPU is refused while shares exist on the only non-MIG GPU.
        let err = c
            .create_lease(create_req("t3", shape::whole()))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");

        // Releasing a share frees its SM percent.
        c.release_lease(pb::ReleaseLeaseRequest {
            lease_id: la.id.clone(),
            reason: String::new(),
        })
        .await
        .unwrap();
        c.create_lease(create_req("t3", shape::mps(50, 8)))
            .await
            .unwrap();
        // Memory: 8 + 8 of 40 GiB are admitted; 30 GiB more does not fit even
        // though 10% of the SMs are still free.
        let err = c
            .create_lease(create_req("t4", shape::mps(10, 30)))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    });
}

#[test]
fn a_retry_with_the_same_request_id_returns_the_same_lease() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let c = d.client().await.unwrap();
        let mut req = create_req("team-a", shape::mig("2g.20gb"));
        req.request_id = "job-42".into();
        let mut handles = Vec::new();
        for _ in 0..32 {
            let mut c = c.clone();
            let req = req.clone();
            handles.push(tokio::spawn(async move {
                c.create_lease(req).await.map(|r| r.into_inner())
            }));
        }
        let mut ids = HashSet::new();
        let mut tokens = Vec::new();
        let mut replayed = 0;
        for h in handles {
            let r = h.await.unwrap().unwrap();
            assert!(
                !r.token.is_empty(),
                "every reply for the live lease carries a token (replayed: {})",
                r.replayed
            );
            ids.insert(r.lease.unwrap().id);
            replayed += usize::from(r.replayed);
            tokens.push(r.token);
        }
        assert_eq!(ids.len(), 1, "one lease for one request id: {ids:?}");
        assert_eq!(replayed, 31);
        let mut c = c.clone();
        // Every token handed out resolves to that lease.
        for t in tokens {
            let r = c
                .resolve_token(pb::ResolveTokenRequest { token: t })
                .await
                .unwrap()
                .into_inner();
            assert!(ids.contains(&r.lease.unwrap().id));
        }
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        let n: usize = node.gpus.iter().map(|g| g.partitions.len()).sum();
        assert_eq!(n, 1, "no second partition was made");
    });
}

#[test]
fn an_unrenewed_lease_expires_and_frees_its_partition() {
    let d = TestDaemon::start("[lease]\nmin_ttl = \"1s\"\nexpiring_notice = \"1s\"\n").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let mut watch = c
            .watch_leases(pb::WatchLeasesRequest {
                tenant: "team-a".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut req = create_req("team-a", shape::mig("7g.80gb"));
        req.ttl_seconds = 2;
        let r = c.create_lease(req).await.unwrap().into_inner();
        let id = r.lease.unwrap().id;
        let mut kinds = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while let Ok(Some(ev)) = tokio::time::timeout_at(deadline, watch.message())
            .await
            .unwrap_or(Ok(None))
        {
            assert_eq!(ev.lease.as_ref().unwrap().id, id);
            kinds.push(ev.kind);
            if ev.kind == pb::LeaseEventKind::Revoked as i32 {
                assert!(ev.message.contains("TTL"), "{}", ev.message);
                break;
            }
        }
        assert!(
            kinds.contains(&(pb::LeaseEventKind::Created as i32)),
            "{kinds:?}"
        );
        assert!(
            kinds.contains(&(pb::LeaseEventKind::Expiring as i32)),
            "{kinds:?}"
        );
        assert!(
            kinds.contains(&(pb::LeaseEventKind::Revoked as i32)),
            "{kinds:?}"
        );
        let l = lease_of(&mut c, &id).await;
        assert_eq!(l.state, pb::LeaseState::Expired as i32);
        // The 7g placement is free again.
        c.create_lease(create_req("team-b", shape::mig("7g.80gb")))
            .await
            .unwrap();
        let err = c
            .resolve_token(pb::ResolveTokenRequest { token: r.token })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
    });
}

#[test]
fn renewing_extends_a_lease() {
    let d = TestDaemon::start("[lease]\nmin_ttl = \"1s\"\n").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let mut req = create_req("team-a", shape::mig("1g.10gb"));
        req.ttl_seconds = 2;
        let l = c
            .create_lease(req)
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let r = c
            .renew_lease(pb::RenewLeaseRequest {
                lease_id: l.id.clone(),
                ttl_seconds: 600,
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert!(r.expires_at_ms > l.expires_at_ms + 500_000);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let g = lease_of(&mut c, &l.id).await;
        assert_eq!(g.state, pb::LeaseState::Active as i32);
    });
}

#[test]
fn leases_and_instances_survive_a_daemon_crash() {
    let mut d = TestDaemon::start("").unwrap();
    let r = rt();
    let (mig, mps, tokens) = r.block_on(async {
        let mut c = d.client().await.unwrap();
        let a = c
            .create_lease(create_req("team-a", shape::mig("3g.40gb")))
            .await
            .unwrap()
            .into_inner();
        let b = c
            .create_lease(create_req("team-b", shape::mps(25, 8)))
            .await
            .unwrap()
            .into_inner();
        (a.lease.unwrap(), b.lease.unwrap(), vec![a.token, b.token])
    });
    d.kill().unwrap();
    d.spawn().unwrap();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        let list = c
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .leases;
        let ids: HashSet<_> = list.iter().map(|l| l.id.clone()).collect();
        assert!(ids.contains(&mig.id) && ids.contains(&mps.id), "{ids:?}");
        let again = list.iter().find(|l| l.id == mig.id).unwrap();
        // The same MIG instance was adopted, not re-created: the UUID is unchanged.
        assert_eq!(
            again
                .partition
                .as_ref()
                .unwrap()
                .mig
                .as_ref()
                .unwrap()
                .mig_uuid,
            mig.partition
                .as_ref()
                .unwrap()
                .mig
                .as_ref()
                .unwrap()
                .mig_uuid
        );
        for t in tokens {
            c.resolve_token(pb::ResolveTokenRequest { token: t })
                .await
                .unwrap();
        }
    });
    assert!(d.log().contains("reconciled"), "{}", d.log());
}

#[test]
fn sigterm_drains_and_exits_cleanly_keeping_leases() {
    let mut d = TestDaemon::start("").unwrap();
    let r = rt();
    let id = r.block_on(async {
        let mut c = d.client().await.unwrap();
        c.create_lease(create_req("team-a", shape::whole()))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap()
            .id
    });
    assert_eq!(d.stop().unwrap(), Some(0), "{}", d.log());
    assert!(!d.socket.exists(), "socket removed on clean stop");
    d.spawn().unwrap();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        let l = lease_of(&mut c, &id).await;
        assert_eq!(l.state, pb::LeaseState::Active as i32);
    });
}

#[test]
fn a_mig_token_resolves_to_exactly_its_nodes_and_uuid() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let r = c
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap()
            .into_inner();
        let lease = r.lease.unwrap();
        let p = lease.partition.unwrap();
        let m = p.mig.unwrap();
        let res = c
            .resolve_token(pb::ResolveTokenRequest { token: r.token })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(res.tenant, "team-a");
        assert_eq!(res.env.get("CUDA_VISIBLE_DEVICES"), Some(&m.mig_uuid));
        let paths: Vec<_> = res
            .devices
            .iter()
            .map(|d| d.container_path.clone())
            .collect();
        assert!(paths.contains(&"/dev/nvidiactl".to_string()), "{paths:?}");
        assert!(
            paths.contains(&format!("/dev/nvidia{}", p.gpu_index)),
            "{paths:?}"
        );
        let gi_minor = 3 + p.gpu_index * 135 + m.gi_id * 9;
        let ci_minor = gi_minor + 1 + m.ci_id;
        assert!(
            paths.contains(&format!("/dev/nvidia-caps/nvidia-cap{gi_minor}")),
            "{paths:?}"
        );
        assert!(
            paths.contains(&format!("/dev/nvidia-caps/nvidia-cap{ci_minor}")),
            "{paths:?}"
        );
        assert_eq!(res.devices.len(), 5, "{paths:?}");
        assert!(
            res.granted_capabilities
                .iter()
                .all(|c| !c.contains("config") && !c.contains("monitor"))
        );
        assert_eq!(res.visible_gpu_indices, vec![p.gpu_index]);
        let err = c
            .resolve_token(pb::ResolveTokenRequest {
                token: "tsr1_".to_string() + &"0".repeat(64),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
    });
}

#[test]
fn health_and_reflection_services_answer() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let channel = tessera_integration_tests::channel(&d.socket).await.unwrap();
        let mut h = tonic_health::pb::health_client::HealthClient::new(channel);
        let r = h
            .check(tonic_health::pb::HealthCheckRequest {
                service: "tessera.v1.Tessera".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    });
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
}

#[test]
fn invalid_requests_name_the_field() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        for (req, field) in [
            (create_req("", shape::whole()), "tenant"),
            (create_req("Team A", shape::whole()), "tenant"),
            (
                pb::CreateLeaseRequest {
                    tenant: "a".into(),
                    ..Default::default()
                },
                "shape",
            ),
            (
                pb::CreateLeaseRequest {
                    ttl_seconds: u64::MAX,
                    ..create_req("a", shape::whole())
                },
                "ttl_seconds",
            ),
            (create_req("a", shape::mps(101, 1)), "shape"),
        ] {
            let err = c.create_lease(req).await.unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{err}");
            assert!(err.message().contains(field), "{field}: {}", err.message());
        }
        let err = c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: "l-nope".into(),
                reason: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
    });
}

#[test]
fn a_bad_config_exits_64_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(
        &cfg,
        "[[sim.gpus]]\nmodel = \"h100-80gb\"\n[lease]\nmax_ttl = \"soon\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(bin_path("tesserad").unwrap())
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lease.max_ttl"), "{err}");
}

#[test]
fn a_second_daemon_on_the_same_state_dir_refuses_to_start() {
    let d = TestDaemon::start("").unwrap();
    // Same config, other socket: the state dir lock must stop it.
    let text = std::fs::read_to_string(&d.config)
        .unwrap()
        .replace("tesserad.sock", "second.sock");
    let cfg2 = d.dir.path().join("second.toml");
    std::fs::write(&cfg2, text).unwrap();
    let out = std::process::Command::new(bin_path("tesserad").unwrap())
        .arg("--config")
        .arg(&cfg2)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another tesserad"), "{err}");
}

#[test]
fn the_nvml_backend_without_a_driver_fails_at_start_with_a_clear_message() {
    if std::path::Path::new("/proc/driver/nvidia/version").exists() {
        // Written past the test harness's capture, so CI logs show the skip.
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!(
                "SKIPPED: this host has the NVIDIA driver; the no-driver path cannot be shown here\n"
            ),
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("nvml.toml");
    std::fs::write(
        &cfg,
        format!(
            "[daemon]\nsocket = {:?}\nstate_dir = {:?}\nrun_dir = {:?}\n[gpu]\nbackend = \"nvml\"\n",
            dir.path().join("s.sock"),
            dir.path().join("state"),
            dir.path().join("run")
        ),
    )
    .unwrap();
    let out = std::process::Command::new(bin_path("tesserad").unwrap())
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("libnvidia-ml.so.1"), "{err}");
    assert!(err.contains("backend = \"sim\""), "{err}");
    assert!(!dir.path().join("s.sock").exists(), "nothing was bound");
}

#[test]
fn a_static_layout_is_created_once_served_first_and_returned_to_the_pool() {
    let layout = "[[partition.static]]\ngpu = 0\ndevices = { \"1g.10gb\" = 2, \"3g.40gb\" = 1 }\n";
    let mut d = TestDaemon::start(layout).unwrap();
    let r = rt();
    let statics = |node: &pb::GetNodeResponse| -> Vec<(String, String, String)> {
        node.gpus[0]
            .partitions
            .iter()
            .filter(|p| p.origin == "static")
            .map(|p| {
                (
                    p.id.clone(),
                    p.mig.as_ref().unwrap().profile.clone(),
                    p.lease_id.clone(),
                )
            })
            .collect()
    };
    let before = r.block_on(async {
        let mut c = d.client().await.unwrap();
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        let s = statics(&node);
        assert_eq!(s.len(), 3, "{s:?}");
        assert_eq!(s.iter().filter(|x| x.1 == "1g.10gb").count(), 2);
        assert!(s.iter().all(|x| x.2.is_empty()), "all free: {s:?}");
        // A 1g lease takes a pool instance instead of creating one.
        let l = c
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let p = l.partition.unwrap();
        assert_eq!(p.origin, "static");
        assert_eq!(p.state, "ready", "made at start, whole");
        assert!(s.iter().any(|x| x.0 == p.id));
        c.release_lease(pb::ReleaseLeaseRequest {
            lease_id: l.id,
            reason: String::new(),
        })
        .await
        .unwrap();
        // Back in the pool, not destroyed: the same partition, free again.
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        let after = statics(&node);
        assert_eq!(after.len(), 3);
        assert!(after.iter().any(|x| x.0 == p.id && x.2.is_empty()));
        after
    });
    // A restart adopts the layout; it does not create it a second time.
    d.kill().unwrap();
    d.spawn().unwrap();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        let mut again = statics(&node);
        let mut before = before;
        again.sort();
        before.sort();
        assert_eq!(again, before);
    });
}

#[test]
fn with_on_release_keep_a_released_instance_serves_the_next_lease() {
    let d = TestDaemon::start("[partition]\non_release = \"keep\"\n").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let first = c
            .create_lease(create_req("team-a", shape::mig("2g.20gb")))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let p1 = first.partition.clone().unwrap();
        c.release_lease(pb::ReleaseLeaseRequest {
            lease_id: first.id,
            reason: String::new(),
        })
        .await
        .unwrap();
        let second = c
            .create_lease(create_req("team-b", shape::mig("2g.20gb")))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let p2 = second.partition.unwrap();
        assert_eq!(p2.id, p1.id, "the kept instance was reused");
        assert_eq!(
            p2.mig.unwrap().mig_uuid,
            p1.mig.unwrap().mig_uuid,
            "not re-created"
        );
    });
}

/// Everything is checked before the hardware is touched: a TLS certificate that
/// does not parse or a socket group that does not exist exits 64 naming the key,
/// and the simulated GPUs (the hardware) were never opened.
#[test]
fn startup_checks_come_before_the_hardware_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let sim_state = dir.path().join("sim.json");
    let cases = [
        (
            format!(
                "[auth.tls]\nlisten = \"127.0.0.1:0\"\ncert = {junk:?}\nkey = {junk:?}\nclient_ca = {junk:?}\n"
            ),
            "auth.tls",
        ),
        (
            "[daemon]\nsocket_group = \"no-such-group-tessera\"\n".to_string(),
            "daemon.socket_group",
        ),
    ];
    for (extra, key) in cases {
        let (daemon, rest) = match extra.strip_prefix("[daemon]\n") {
            Some(d) => (d.to_string(), String::new()),
            None => (String::new(), extra.clone()),
        };
        let cfg = dir.path().join("t.toml");
        std::fs::write(
            &cfg,
            format!(
                "[daemon]\nsocket = {:?}\nstate_dir = {:?}\nrun_dir = {:?}\n{daemon}\n[gpu]\nbackend = \"sim\"\n[sim]\nstate_file = {sim_state:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\n{rest}",
                dir.path().join("s.sock"),
                dir.path().join("state"),
                dir.path().join("run"),
            ),
        )
        .unwrap();
        let out = std::process::Command::new(bin_path("tesserad").unwrap())
            .arg("--config")
            .arg(&cfg)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{key}: {err}");
        assert!(err.contains(key), "{key}: {err}");
        assert!(
            !sim_state.exists(),
            "{key}: the GPUs were opened before the check"
        );
    }
}

/// How many leases the daemon lists.
async fn lease_count(
    c: &mut tessera_proto::v1::tessera_client::TesseraClient<tonic::transport::Channel>,
) -> usize {
    c.list_leases(pb::ListLeasesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .leases
        .len()
}

/// Refusals carry the rich error model: an ErrorInfo (domain tessera.io, a stable
/// reason) always, BadRequest naming the field for invalid input, and ErrorInfo
/// even on refusals the API layer makes itself (an unknown lease).
#[test]
fn refusals_carry_error_info_and_field_violations() {
    use tonic_types::StatusExt;
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let err = c
            .create_lease(create_req("Not A Tenant", shape::mig("1g.10gb")))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let info = err.get_details_error_info().expect("ErrorInfo");
        assert_eq!(
            (info.reason.as_str(), info.domain.as_str()),
            ("INVALID_ARGUMENT", "tessera.io")
        );
        let bad = err.get_details_bad_request().expect("BadRequest");
        assert_eq!(bad.field_violations[0].field, "tenant");

        let err = c
            .create_lease(create_req("team-a", shape::mig("7g.80gb")))
            .await
            .and(
                c.create_lease(create_req("team-a", shape::mig("7g.80gb")))
                    .await,
            )
            .and(
                c.create_lease(create_req("team-a", shape::mig("7g.80gb")))
                    .await,
            )
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
        let info = err.get_details_error_info().expect("ErrorInfo");
        assert_eq!(info.reason, "NO_CAPACITY", "{err}");
        assert!(err.get_details_retry_info().is_some());

        // A shape the GPU's mode cannot take (MIG on gpu2, MIG off; a whole GPU on
        // gpu0, in MIG mode) is no capacity question: waiting would not help.
        let leases_before = lease_count(&mut c).await;
        for (gpu, shape, says) in [
            (2, shape::mig("1g.10gb"), "gpu2 is not in MIG mode"),
            (0, shape::whole(), "gpu0 is in MIG mode: a whole GPU needs"),
        ] {
            let err = c
                .create_lease(pb::CreateLeaseRequest {
                    gpu_index: Some(gpu),
                    ..create_req("team-a", shape)
                })
                .await
                .unwrap_err();
            assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
            assert!(err.message().contains(says), "{err}");
            let info = err.get_details_error_info().expect("ErrorInfo");
            assert_eq!(info.reason, "GPU_MODE_MISMATCH", "{err}");
            assert!(err.get_details_precondition_failure().is_some(), "{err}");
            assert!(err.get_details_retry_info().is_none(), "{err}");
        }
        let leases_after = lease_count(&mut c).await;
        assert_eq!(
            leases_before, leases_after,
            "a refused request holds nothing"
        );

        let err = c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: "l-nope".into(),
                reason: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(
            err.get_details_error_info().expect("ErrorInfo").reason,
            "NOT_FOUND"
        );
    });
}

/// A uid-0 process inside a container (its own mount and PID namespaces) that reaches
/// the socket is not the host admin: the daemon compares its namespaces with its own.
#[test]
fn root_in_other_namespaces_is_not_the_admin() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to make namespaces with unshare");
        return;
    }
    let Ok(unshare) = which_unshare() else {
        eprintln!("SKIPPED: unshare (util-linux) is not installed");
        return;
    };
    let d = TestDaemon::start("").unwrap();
    let cli = bin_path("tessera").unwrap();
    let host = std::process::Command::new(&cli)
        .args(["--socket"])
        .arg(&d.socket)
        .args(["lease", "list"])
        .output()
        .unwrap();
    assert!(
        host.status.success(),
        "root on the host is the admin: {host:?}"
    );
    let contained = std::process::Command::new(unshare)
        .args(["--mount", "--pid", "--fork"])
        .arg(&cli)
        .args(["--socket"])
        .arg(&d.socket)
        .args(["lease", "list"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&contained.stderr);
    assert_eq!(contained.status.code(), Some(1), "{err}");
    assert!(err.contains("inside a container"), "{err}");
}

fn which_unshare() -> Result<std::path::PathBuf, ()> {
    ["/usr/bin/unshare", "/bin/unshare"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
        .ok_or(())
}
