//! The fault-injection suite: every mutating RPC under each fault (a full disk, an
//! I/O error of the state store, an unwritable audit log, NVML calls failing, NVML
//! calls slow, the daemon killed mid-call), on the real binaries.
//!
//! For each call the answer must tell the truth: its code and reason are the
//! documented ones, an acknowledged change is there after a crash (SIGKILL) and a
//! restart, a refused one is not. After every fault: no acknowledged lease lost, no
//! partition leased twice, no MIG instance or MPS daemon the records do not explain
//! (the crash harness's structural checks).
//!
//! ReloadConfig is not in the matrix: it changes no stored state (a reload that
//! cannot be audited is still refused, like every change).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use tessera_integration_tests::invariants::{check_structure, sim_of};
use tessera_integration_tests::{DEV_GPUS, TestDaemon, bin_path, create_req, lease_of, rt, shape};
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;
use tonic::Code;
use tonic::transport::Channel;
use tonic_types::StatusExt;

type Client = TesseraClient<Channel>;

const GPUS: &str = DEV_GPUS;

const TENANTS: &str = r#"
[tenants.team-a]
guaranteed = { mig_slices = 14, mps_sm_percent = 100, memory = "40GiB" }
burst = { mig_slices = 14, mps_sm_percent = 100, memory = "40GiB" }
"#;

/// What each mutating call is tried on.
struct Fixture {
    mig: pb::Lease,
    mig_token: String,
    mps: pb::Lease,
    mps_token: String,
    to_release: pb::Lease,
}

async fn create(c: &mut Client, s: pb::Shape, gpu: u32, rid: &str) -> (pb::Lease, String) {
    let mut req = create_req("team-a", s);
    req.gpu_index = Some(gpu);
    req.request_id = rid.into();
    let r = c.create_lease(req).await.unwrap().into_inner();
    (r.lease.unwrap(), r.token)
}

async fn fixture(c: &mut Client) -> Fixture {
    let (mig, mig_token) = create(c, shape::mig("1g.10gb"), 0, "fx-mig").await;
    let (mps, mps_token) = create(c, shape::mps(20, 4), 2, "fx-mps").await;
    let (to_release, _) = create(c, shape::mig("2g.20gb"), 1, "fx-release").await;
    c.bind_container(pb::BindContainerRequest {
        token: mig_token.clone(),
        container_id: "c-before".into(),
        cgroup_path: "/sys/fs/cgroup/pids/faults/c-before".into(),
        // No runtime root: housekeeping never drops these as gone.
        runtime_root: String::new(),
        uid: None,
        ..Default::default()
    })
    .await
    .unwrap();
    Fixture {
        mig,
        mig_token,
        mps,
        mps_token,
        to_release,
    }
}

/// One call's answer: Ok, or its code and ErrorInfo reason.
type Answer = Result<(), (Code, String)>;

fn answer<T>(r: Result<tonic::Response<T>, tonic::Status>) -> Answer {
    r.map(|_| ()).map_err(|st| {
        let reason = st
            .get_details_error_info()
            .map(|i| i.reason)
            .unwrap_or_default();
        (st.code(), format!("{reason}: {}", st.message()))
    })
}

const CALLS: [&str; 9] = [
    "CreateLease(mig)",
    "CreateLease(mps)",
    "RenewLease",
    "ReleaseLease",
    "BindContainer",
    "UnbindContainer",
    "ReportAdmission",
    "GrantQuota",
    "SetGpuHealth",
];

/// Every mutating call once, in `CALLS` order.
async fn every_call(c: &mut Client, fx: &Fixture) -> Vec<Answer> {
    let mut out = Vec::new();
    let mut req = create_req("team-a", shape::mig("1g.10gb"));
    req.request_id = "under-fault-mig".into();
    out.push(answer(c.create_lease(req).await));
    let mut req = create_req("team-a", shape::mps(10, 2));
    req.request_id = "under-fault-mps".into();
    req.gpu_index = Some(2);
    out.push(answer(c.create_lease(req).await));
    out.push(answer(
        c.renew_lease(pb::RenewLeaseRequest {
            lease_id: fx.mig.id.clone(),
            ttl_seconds: 7200,
        })
        .await,
    ));
    out.push(answer(
        c.release_lease(pb::ReleaseLeaseRequest {
            lease_id: fx.to_release.id.clone(),
            reason: "under fault".into(),
        })
        .await,
    ));
    out.push(answer(
        c.bind_container(pb::BindContainerRequest {
            token: fx.mig_token.clone(),
            container_id: "c-under-fault".into(),
            cgroup_path: "/sys/fs/cgroup/pids/faults/c-under-fault".into(),
            // No runtime root: housekeeping never drops these as gone.
            runtime_root: String::new(),
            uid: None,
            ..Default::default()
        })
        .await,
    ));
    out.push(answer(
        c.unbind_container(pb::UnbindContainerRequest {
            container_id: "c-before".into(),
            ..Default::default()
        })
        .await,
    ));
    out.push(answer(
        c.report_admission(pb::ReportAdmissionRequest {
            container_id: "c-under-fault".into(),
            lease_id: fx.mig.id.clone(),
            admitted: true,
            reasons: vec![],
            command: "create".into(),
        })
        .await,
    ));
    out.push(answer(
        c.grant_quota(pb::GrantQuotaRequest {
            tenant: "team-a".into(),
            extra_burst: Some(pb::QuotaAmounts {
                mig_slices: 1,
                ..Default::default()
            }),
            expires_at_ms: tessera_common::clock::now_ms() + 3_600_000,
            reason: "under fault".into(),
        })
        .await,
    ));
    out.push(answer(
        c.set_gpu_health(pb::SetGpuHealthRequest {
            gpu_index: 1,
            gi_id: None,
            healthy: false,
            reason: "under fault".into(),
        })
        .await,
    ));
    out
}

/// Whether each call's change is there now, in `CALLS` order.
async fn effects(c: &mut Client, fx: &Fixture, renewed_from: i64) -> Vec<bool> {
    let all = c
        .list_leases(pb::ListLeasesRequest {
            include_ended: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .leases;
    let live_rid = |rid: &str| {
        all.iter()
            .any(|l| l.request_id == rid && l.state == pb::LeaseState::Active as i32)
    };
    let get = |id: &str| all.iter().find(|l| l.id == id).cloned().unwrap();
    let mig = get(&fx.mig.id);
    let released = get(&fx.to_release.id);
    let quota = c
        .get_quota(pb::GetQuotaRequest {
            tenant: "team-a".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let node = c
        .get_node(pb::GetNodeRequest {})
        .await
        .unwrap()
        .into_inner();
    vec![
        live_rid("under-fault-mig"),
        live_rid("under-fault-mps"),
        mig.expires_at_ms > renewed_from,
        released.state != pb::LeaseState::Active as i32,
        mig.containers.iter().any(|c| c.id == "c-under-fault"),
        !mig.containers.iter().any(|c| c.id == "c-before"),
        // An admission report changes nothing but the audit log.
        true,
        quota.burst.unwrap_or_default().mig_slices > 14,
        !node.gpus[1].healthy,
    ]
}

/// Structure and the fixture's leases, after a restart: nothing acknowledged lost,
/// nothing leased twice, nothing orphaned.
async fn verify(c: &mut Client, d: &TestDaemon, fx: &Fixture, released_ok: bool) {
    verify_structure_only(c, d).await;
    for (lease, token) in [(&fx.mig, &fx.mig_token), (&fx.mps, &fx.mps_token)] {
        let r = c
            .resolve_token(pb::ResolveTokenRequest {
                token: token.clone(),
            })
            .await
            .unwrap_or_else(|e| panic!("acknowledged lease {} lost: {e}", lease.id))
            .into_inner();
        assert_eq!(r.lease.unwrap().id, lease.id);
    }
    let rel = lease_of(c, &fx.to_release.id).await;
    let ended = rel.state == pb::LeaseState::Released as i32;
    assert_eq!(
        ended, released_ok,
        "release answered {released_ok}, lease is {rel:?}"
    );
}

fn run_tool(bin: &str, args: &[&str]) {
    let out = Command::new(bin_path(bin).unwrap())
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{bin} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every hardware change of the simulator takes `delay_ms` (a slow driver).
fn slow_hardware(d: &TestDaemon, delay_ms: &str) {
    for call in ["create_instance", "destroy_instance", "mps_start"] {
        d.sim(&[
            "fault",
            "--call",
            call,
            "--fail-rate",
            "0",
            "--delay-ms",
            delay_ms,
        ]);
    }
}

/// A tmpfs of `size` on the daemon's state directory: a disk that can be filled.
struct SmallDisk {
    mount: std::path::PathBuf,
}

impl SmallDisk {
    fn mount(at: &std::path::Path, size: &str) -> Result<SmallDisk, String> {
        if !nix::unistd::Uid::effective().is_root() {
            return Err("not root (mounting a tmpfs needs it)".into());
        }
        std::fs::create_dir_all(at).unwrap();
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(at)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(SmallDisk {
            mount: at.to_path_buf(),
        })
    }

    /// Fill it to the last byte.
    fn fill(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.mount.join("filler")).unwrap();
        let chunk = vec![0u8; 64 << 10];
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(nix::libc::ENOSPC) => break,
                Err(e) => panic!("filling the disk: {e}"),
            }
        }
        // The last partial page, byte by byte.
        while f.write(&[0]).is_ok_and(|n| n == 1) {}
    }

    fn free(&self) {
        std::fs::remove_file(self.mount.join("filler")).unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}

/// Kill the daemon (SIGKILL: what was acknowledged must be durable), start it again.
fn crash_and_restart(d: &mut TestDaemon) {
    d.kill().unwrap();
    d.spawn().unwrap();
}

/// Every answer is Ok or one of `refusals` (code, reason prefix), and its change is
/// there exactly when it was Ok.
fn assert_truthful(fault: &str, answers: &[Answer], seen: &[bool], refusals: &[(Code, &str)]) {
    for ((call, a), there) in CALLS.iter().zip(answers).zip(seen) {
        match a {
            Ok(()) => assert!(*there, "{fault}: {call} answered OK but did not happen"),
            Err((code, reason)) => {
                assert!(
                    refusals
                        .iter()
                        .any(|(c, r)| c == code && reason.starts_with(r)),
                    "{fault}: {call} answered {code:?} {reason}; expected one of {refusals:?}"
                );
                assert!(
                    !*there,
                    "{fault}: {call} was refused ({reason}) but happened"
                );
            }
        }
    }
}

#[test]
fn a_full_disk_refuses_changes_as_resource_exhausted_and_what_was_acknowledged_survives() {
    let mut d = TestDaemon::configure(GPUS, TENANTS).unwrap();
    // The audit log elsewhere: this test is about the state store's disk.
    let audit = d.dir.path().join("audit.jsonl");
    let mut text = std::fs::read_to_string(&d.config).unwrap();
    text.push_str(&format!("[audit]\npath = {audit:?}\n"));
    std::fs::write(&d.config, text).unwrap();
    let disk = match SmallDisk::mount(&d.state_dir(), "24m") {
        Ok(disk) => disk,
        Err(why) => {
            println!("SKIPPED: a full disk needs a tmpfs: {why}");
            return;
        }
    };
    d.spawn().unwrap();
    let rt = rt();
    let fx = rt.block_on(async { fixture(&mut d.client().await.unwrap()).await });
    let renewed_from = fx.mig.expires_at_ms;
    disk.fill();
    let answers = rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let answers = every_call(&mut c, &fx).await;
        // Reads still work on a full disk.
        c.get_node(pb::GetNodeRequest {}).await.unwrap();
        c.list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap();
        answers
    });
    assert!(
        answers[0].is_err(),
        "a create on a full disk was acknowledged: {answers:?}"
    );
    // The truth right away, with the disk still full, and after a crash.
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let seen = effects(&mut c, &fx, renewed_from).await;
        let refusals = [(Code::ResourceExhausted, "STATE_DISK_FULL")];
        assert_truthful("disk full (before the restart)", &answers, &seen, &refusals);
    });
    disk.free();
    crash_and_restart(&mut d);
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let seen = effects(&mut c, &fx, renewed_from).await;
        assert_truthful(
            "disk full",
            &answers,
            &seen,
            &[(Code::ResourceExhausted, "STATE_DISK_FULL")],
        );
        verify(&mut c, &d, &fx, answers[3].is_ok()).await;
    });
}

#[test]
fn an_audit_log_that_cannot_be_written_refuses_every_change_and_nothing_happens() {
    let mut d = TestDaemon::configure(GPUS, TENANTS).unwrap();
    // The audit log on its own small disk; the state store has room.
    let audit_dir = d.dir.path().join("audit");
    let mut text = std::fs::read_to_string(&d.config).unwrap();
    text.push_str(&format!(
        "[audit]\npath = {:?}\n",
        audit_dir.join("audit.jsonl")
    ));
    std::fs::write(&d.config, text).unwrap();
    let disk = match SmallDisk::mount(&audit_dir, "1m") {
        Ok(disk) => disk,
        Err(why) => {
            println!("SKIPPED: a full audit disk needs a tmpfs: {why}");
            return;
        }
    };
    d.spawn().unwrap();
    let rt = rt();
    let fx = rt.block_on(async { fixture(&mut d.client().await.unwrap()).await });
    let renewed_from = fx.mig.expires_at_ms;
    disk.fill();
    let answers = rt.block_on(async {
        let mut c = d.client().await.unwrap();
        // The log's last page may still hold a few records: admission reports (they
        // change nothing else) until the first one is refused.
        let mut refused = false;
        for _ in 0..200 {
            let r = c
                .report_admission(pb::ReportAdmissionRequest {
                    container_id: "c-filler".into(),
                    lease_id: fx.mig.id.clone(),
                    admitted: true,
                    reasons: vec![],
                    command: "create".into(),
                })
                .await;
            if r.is_err() {
                refused = true;
                break;
            }
        }
        assert!(
            refused,
            "200 audited calls on a full disk were all accepted"
        );
        let answers = every_call(&mut c, &fx).await;
        c.get_node(pb::GetNodeRequest {}).await.unwrap();
        answers
    });
    for (call, a) in CALLS.iter().zip(&answers) {
        assert!(
            matches!(a, Err((Code::Unavailable, r)) if r.starts_with("AUDIT_UNAVAILABLE")),
            "{call} with the audit log full: {a:?}"
        );
    }
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let mut seen = effects(&mut c, &fx, renewed_from).await;
        seen[6] = false;
        let refusals = [(Code::Unavailable, "AUDIT_UNAVAILABLE")];
        assert_truthful(
            "audit full (before the restart)",
            &answers,
            &seen,
            &refusals,
        );
    });
    disk.free();
    crash_and_restart(&mut d);
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let seen = effects(&mut c, &fx, renewed_from).await;
        // The admission report's "effect" is its audit record: skip it.
        let mut seen = seen;
        seen[6] = false;
        assert_truthful(
            "audit full",
            &answers,
            &seen,
            &[(Code::Unavailable, "AUDIT_UNAVAILABLE")],
        );
        verify(&mut c, &d, &fx, false).await;
    });
}

#[test]
fn a_state_store_io_error_refuses_changes_as_unavailable_and_what_was_acknowledged_survives() {
    let mut d = TestDaemon::configure(GPUS, TENANTS).unwrap();
    let mut text = std::fs::read_to_string(&d.config).unwrap();
    text = text.replace(
        "shutdown_grace = \"3s\"\n",
        "shutdown_grace = \"3s\"\nfault_injection = true\n",
    );
    std::fs::write(&d.config, text).unwrap();
    d.spawn().unwrap();
    let config = d.config.to_str().unwrap().to_string();
    let rt = rt();
    let fx = rt.block_on(async { fixture(&mut d.client().await.unwrap()).await });
    let renewed_from = fx.mig.expires_at_ms;
    run_tool(
        "tesserad",
        &["--config", &config, "inject", "--store", "io-error"],
    );
    let answers = rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let answers = every_call(&mut c, &fx).await;
        c.list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap();
        answers
    });
    for (i, call) in CALLS.iter().enumerate() {
        // The admission report writes only the audit log, which is fine.
        if i != 6 {
            assert!(answers[i].is_err(), "{call} acknowledged on a failing disk");
        }
    }
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let seen = effects(&mut c, &fx, renewed_from).await;
        let refusals = [(Code::Unavailable, "STATE_UNWRITABLE")];
        assert_truthful("I/O error (before the restart)", &answers, &seen, &refusals);
    });
    run_tool(
        "tesserad",
        &["--config", &config, "inject", "--store", "none"],
    );
    crash_and_restart(&mut d);
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let seen = effects(&mut c, &fx, renewed_from).await;
        assert_truthful(
            "I/O error",
            &answers,
            &seen,
            &[(Code::Unavailable, "STATE_UNWRITABLE")],
        );
        verify(&mut c, &d, &fx, false).await;
    });
}

#[test]
fn nvml_calls_that_fail_are_refused_as_unavailable_and_a_blocked_teardown_finishes_later() {
    let mut d = TestDaemon::start_with(GPUS, TENANTS).unwrap();
    let rt = rt();
    let fx = rt.block_on(async { fixture(&mut d.client().await.unwrap()).await });
    let renewed_from = fx.mig.expires_at_ms;
    for call in ["create_instance", "destroy_instance", "mps_start"] {
        d.sim(&["fault", "--call", call, "--fail-rate", "1"]);
    }
    let answers = rt.block_on(async { every_call(&mut d.client().await.unwrap(), &fx).await });
    // Creates need the hardware: refused (an NVML failure may pass; an MPS control
    // daemon that does not start is a failure of its own, as on real hardware). The
    // release is accepted and says so (revoking: the teardown is retried until the
    // hardware lets it finish).
    assert!(
        matches!(&answers[0], Err((Code::Unavailable, r)) if r.starts_with("HARDWARE_UNAVAILABLE")),
        "{:?}",
        answers[0]
    );
    assert!(
        matches!(&answers[1], Err((Code::Internal, r)) if r.starts_with("HARDWARE_FAILED")),
        "{:?}",
        answers[1]
    );
    assert!(answers[3].is_ok(), "release: {:?}", answers[3]);
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let l = lease_of(&mut c, &fx.to_release.id).await;
        assert_eq!(l.state, pb::LeaseState::Revoking as i32, "{l:?}");
    });
    d.sim(&["clear-faults"]);
    crash_and_restart(&mut d);
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let l = lease_of(&mut c, &fx.to_release.id).await;
            if l.state == pb::LeaseState::Released as i32 {
                break;
            }
            assert!(Instant::now() < deadline, "release never finished: {l:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let seen = effects(&mut c, &fx, renewed_from).await;
        assert_truthful(
            "NVML failing",
            &answers,
            &seen,
            &[
                (Code::Unavailable, "HARDWARE_UNAVAILABLE"),
                (Code::Internal, "HARDWARE_FAILED"),
            ],
        );
        verify(&mut c, &d, &fx, true).await;
    });
}

#[test]
fn slow_nvml_calls_past_the_client_deadline_still_converge_on_one_lease_per_request() {
    let mut d = TestDaemon::start_with(GPUS, TENANTS).unwrap();
    let rt = rt();
    let fx = rt.block_on(async { fixture(&mut d.client().await.unwrap()).await });
    slow_hardware(&d, "1500");
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let mut req = create_req("team-a", shape::mig("1g.10gb"));
        req.request_id = "slow-create".into();
        let mut timed = tonic::Request::new(req.clone());
        timed.set_timeout(Duration::from_millis(300));
        let st = c.create_lease(timed).await.unwrap_err();
        // The client gave up: it cannot know whether the lease exists.
        assert!(
            matches!(st.code(), Code::DeadlineExceeded | Code::Cancelled),
            "{st:?}"
        );
        let mut timed = tonic::Request::new(pb::ReleaseLeaseRequest {
            lease_id: fx.to_release.id.clone(),
            reason: "slow".into(),
        });
        timed.set_timeout(Duration::from_millis(300));
        let st = c.release_lease(timed).await.unwrap_err();
        assert!(
            matches!(st.code(), Code::DeadlineExceeded | Code::Cancelled),
            "{st:?}"
        );
        // The client does not know: it retries with the same request id, with
        // time to wait. One lease, not two.
        let again = c.create_lease(req.clone()).await.unwrap().into_inner();
        let again2 = c.create_lease(req).await.unwrap().into_inner();
        assert!(again2.replayed);
        assert_eq!(again.lease.unwrap().id, again2.lease.unwrap().id);
        let rel = c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: fx.to_release.id.clone(),
                reason: "slow, again".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_ne!(rel.state, pb::LeaseState::Active as i32);
        let n = c
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .leases
            .iter()
            .filter(|l| l.request_id == "slow-create")
            .count();
        assert_eq!(n, 1);
    });
    d.sim(&["clear-faults"]);
    crash_and_restart(&mut d);
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        verify(&mut c, &d, &fx, true).await;
    });
}

#[test]
fn a_daemon_killed_in_the_middle_of_calls_leaves_nothing_half_done_after_a_restart() {
    let mut d = TestDaemon::start_with(GPUS, TENANTS).unwrap();
    let rt = rt();
    let fx = rt.block_on(async { fixture(&mut d.client().await.unwrap()).await });
    slow_hardware(&d, "2000");
    let socket = d.socket.clone();
    let release_id = fx.to_release.id.clone();
    let in_flight = rt.spawn(async move {
        let mut c = tessera_integration_tests::connect(&socket).await.unwrap();
        let mut req = create_req("team-a", shape::mig("3g.40gb"));
        req.request_id = "killed-create".into();
        let mut mps = create_req("team-a", shape::mps(10, 2));
        mps.request_id = "killed-mps".into();
        mps.gpu_index = Some(2);
        let rel = pb::ReleaseLeaseRequest {
            lease_id: release_id,
            reason: "killed".into(),
        };
        let (mut c1, mut c2) = (c.clone(), c.clone());
        let (a, b, r) = tokio::join!(
            c1.create_lease(req),
            c2.create_lease(mps),
            c.release_lease(rel)
        );
        (a.is_ok(), b.is_ok(), r.is_ok())
    });
    std::thread::sleep(Duration::from_millis(700));
    d.kill().unwrap();
    let (a, b, r) = rt.block_on(in_flight).unwrap();
    assert!(!a && !b && !r, "a call was answered before the kill");
    d.sim(&["clear-faults"]);
    d.spawn().unwrap();
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        verify_structure_only(&mut c, &d).await;
        // Retries converge: each request id names at most one lease, and succeeds.
        for (rid, s, gpu) in [
            ("killed-create", shape::mig("3g.40gb"), None),
            ("killed-mps", shape::mps(10, 2), Some(2)),
        ] {
            let mut req = create_req("team-a", s);
            req.request_id = rid.into();
            req.gpu_index = gpu;
            c.create_lease(req).await.unwrap();
            let n = c
                .list_leases(pb::ListLeasesRequest::default())
                .await
                .unwrap()
                .into_inner()
                .leases
                .iter()
                .filter(|l| l.request_id == rid)
                .count();
            assert_eq!(n, 1, "{rid}");
        }
        c.release_lease(pb::ReleaseLeaseRequest {
            lease_id: fx.to_release.id.clone(),
            reason: "after the crash".into(),
        })
        .await
        .unwrap();
        verify(&mut c, &d, &fx, true).await;
    });
}

async fn verify_structure_only(c: &mut Client, d: &TestDaemon) {
    let sim = sim_of(d, GPUS);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (violations, in_progress) = check_structure(c, &*sim).await;
        if violations.is_empty() && !in_progress {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "after the restart: {violations:#?}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
