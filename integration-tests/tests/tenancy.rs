//! Tenancy: who may call what (peer credentials and mTLS), quotas, preemption,
//! fair share, temporary grants, reload, and the audit log.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::Duration;

use tessera_integration_tests::{TestDaemon, bin_path, create_req, shape};
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use tessera_integration_tests::rt;

const TWO_H100: &str = "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n";

fn tenants(a_burst: u32, b_burst: u32) -> String {
    format!(
        r#"
[tenants.team-a]
guaranteed = {{ mig_slices = 7 }}
burst = {{ mig_slices = {a_burst} }}
priority_class = "production"

[tenants.team-b]
guaranteed = {{ mig_slices = 7 }}
burst = {{ mig_slices = {b_burst} }}
priority_class = "batch"
"#
    )
}

// ------------------------------------------------------------------ mTLS matrix

struct Pki {
    ca_pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Pki {
    fn new() -> Pki {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tessera test CA");
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).unwrap();
        Pki {
            ca_pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// (cert pem, key pem) for `cn`, valid for localhost.
    fn leaf(&self, cn: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.subject_alt_names
            .push(rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()));
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn tls_client(port: u16, pki: &Pki, cn: &str) -> TesseraClient<Channel> {
    let (cert, key) = pki.leaf(cn);
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca_pem))
        .identity(Identity::from_pem(cert, key))
        .domain_name("localhost");
    // Bounded: a test that waits forever would hold CI to its limit.
    let ch = Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .unwrap();
    TesseraClient::new(ch)
}

fn allowed(r: Result<(), tonic::Status>) -> bool {
    match r {
        Ok(()) => true,
        Err(s) => s.code() != Code::PermissionDenied,
    }
}

#[test]
fn every_rpc_for_every_principal_kind_is_allowed_or_permission_denied_as_documented() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new();
    let (cert, key) = pki.leaf("localhost");
    let w = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let (cert_p, key_p, ca_p) = (
        w("server.pem", &cert),
        w("server.key", &key),
        w("ca.pem", &pki.ca_pem),
    );
    let port = free_port();
    let extra = format!(
        "{}\n[[auth.principals]]\nname = \"ops\"\nrole = \"admin\"\ncert_cns = [\"admin-client\"]\n\n[[auth.principals]]\nname = \"node-runtime\"\nrole = \"runtime\"\ncert_cns = [\"runtime-client\"]\n\n[[auth.principals]]\nname = \"team-a\"\nrole = \"tenant\"\ntenant = \"team-a\"\ncert_cns = [\"team-a-client\"]\n\n[auth.tls]\nlisten = \"127.0.0.1:{port}\"\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n",
        tenants(14, 14),
        cert_p,
        key_p,
        ca_p
    );
    let d = TestDaemon::start_with(TWO_H100, &extra).unwrap();
    rt().block_on(async {
        // Fixtures made by root over the unix socket (uid 0 is admin).
        let mut root = d.client().await.unwrap();
        let mk = |t: &str| create_req(t, shape::mig("1g.10gb"));
        let a = root.create_lease(mk("team-a")).await.unwrap().into_inner();
        let b = root.create_lease(mk("team-b")).await.unwrap().into_inner();
        let (a_id, b_id) = (a.lease.unwrap().id, b.lease.unwrap().id);
        // Wait for the TLS listener.
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        let mut table = Vec::new();
        for (kind, cn) in [
            ("admin", "admin-client"),
            ("runtime", "runtime-client"),
            ("tenant", "team-a-client"),
            ("unmapped", "stranger"),
        ] {
            let mut c = tls_client(port, &pki, cn).await;
            let other = "team-b".to_string();
            let mut row = Vec::new();
            macro_rules! probe {
                ($name:expr, $call:expr) => {{
                    let r = $call.await.map(|_| ());
                    row.push(($name, allowed(r)));
                }};
            }
            probe!("GetNode", c.get_node(pb::GetNodeRequest {}));
            probe!("CreateLease(other)", c.create_lease(mk("team-b")));
            probe!(
                "RenewLease(other)",
                c.renew_lease(pb::RenewLeaseRequest {
                    lease_id: b_id.clone(),
                    ttl_seconds: 0
                })
            );
            probe!(
                "ReleaseLease(other)",
                c.release_lease(pb::ReleaseLeaseRequest {
                    lease_id: if kind == "admin" {
                        "l-missing".into()
                    } else {
                        b_id.clone()
                    },
                    reason: String::new()
                })
            );
            probe!(
                "GetLease(other)",
                c.get_lease(pb::GetLeaseRequest {
                    lease_id: b_id.clone()
                })
            );
            probe!(
                "ListLeases(other)",
                c.list_leases(pb::ListLeasesRequest {
                    tenant: other.clone(),
                    ..Default::default()
                })
            );
            probe!(
                "WatchLeases(other)",
                c.watch_leases(pb::WatchLeasesRequest {
                    tenant: other.clone(),
                    ..Default::default()
                })
            );
            probe!(
                "ResolveToken",
                c.resolve_token(pb::ResolveTokenRequest {
                    token: b.token.clone()
                })
            );
            probe!(
                "BindContainer",
                c.bind_container(pb::BindContainerRequest {
                    token: b.token.clone(),
                    container_id: format!("ctr-{kind}"),
                    ..Default::default()
                })
            );
            probe!(
                "UnbindContainer",
                c.unbind_container(pb::UnbindContainerRequest {
                    container_id: format!("ctr-{kind}"),
                    ..Default::default()
                })
            );
            probe!(
                "ReportAdmission",
                c.report_admission(pb::ReportAdmissionRequest {
                    container_id: "x".into(),
                    lease_id: b_id.clone(),
                    admitted: true,
                    ..Default::default()
                })
            );
            probe!(
                "GetUsage(other)",
                c.get_usage(pb::GetUsageRequest {
                    tenant: other.clone(),
                    ..Default::default()
                })
            );
            probe!("ReloadConfig", c.reload_config(pb::ReloadConfigRequest {}));
            probe!(
                "GrantQuota",
                c.grant_quota(pb::GrantQuotaRequest {
                    tenant: other.clone(),
                    extra_burst: Some(pb::QuotaAmounts {
                        mig_slices: 1,
                        ..Default::default()
                    }),
                    expires_at_ms: 4_000_000_000_000,
                    reason: "matrix".into()
                })
            );
            probe!(
                "GetQuota(other)",
                c.get_quota(pb::GetQuotaRequest {
                    tenant: other.clone()
                })
            );
            // Own-tenant calls.
            probe!("CreateLease(own)", c.create_lease(mk("team-a")));
            probe!(
                "GetLease(own)",
                c.get_lease(pb::GetLeaseRequest {
                    lease_id: a_id.clone()
                })
            );
            probe!(
                "RenewLease(own)",
                c.renew_lease(pb::RenewLeaseRequest {
                    lease_id: a_id.clone(),
                    ttl_seconds: 0
                })
            );
            probe!(
                "ListLeases(own)",
                c.list_leases(pb::ListLeasesRequest {
                    tenant: "team-a".into(),
                    ..Default::default()
                })
            );
            probe!(
                "GetQuota(own)",
                c.get_quota(pb::GetQuotaRequest {
                    tenant: "team-a".into()
                })
            );
            table.push((kind, row));
        }

        // What each kind may do (true = not PermissionDenied).
        let expect = |kind: &str, call: &str| -> bool {
            match kind {
                "admin" => true,
                "runtime" => matches!(
                    call,
                    "ResolveToken" | "BindContainer" | "UnbindContainer" | "ReportAdmission"
                ),
                "tenant" => matches!(
                    call,
                    "GetNode"
                        | "CreateLease(own)"
                        | "GetLease(own)"
                        | "RenewLease(own)"
                        | "ListLeases(own)"
                        | "GetQuota(own)"
                ),
                _ => false,
            }
        };
        let mut wrong = Vec::new();
        for (kind, row) in &table {
            for (call, got) in row {
                if *got != expect(kind, call) {
                    wrong.push(format!("{kind} {call}: allowed={got}"));
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "authorization matrix violations: {wrong:#?}"
        );
        assert_eq!(table.len(), 4);
        assert!(table.iter().all(|(_, r)| r.len() == 20));

        // A tenant's list shows only its own leases and its node view only its own
        // partitions.
        let mut ta = tls_client(port, &pki, "team-a-client").await;
        let leases = ta
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .leases;
        assert!(!leases.is_empty());
        assert!(leases.iter().all(|l| l.tenant == "team-a"));
        let node = ta
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        let mine: HashSet<_> = leases.iter().map(|l| l.id.clone()).collect();
        for g in node.gpus {
            assert!(g.partitions.iter().all(|p| mine.contains(&p.lease_id)));
        }
    });
    // The audit log recorded the refusals.
    let audit = std::fs::read_to_string(d.dir.path().join("state/audit.jsonl")).unwrap();
    assert!(audit.contains("\"PermissionDenied\""), "{audit}");
    assert!(audit.contains("certificate CN=\\\"stranger\\\""), "{audit}");
}

#[test]
fn a_certificate_from_another_ca_cannot_connect() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new();
    let rogue = Pki::new();
    let (cert, key) = pki.leaf("localhost");
    std::fs::write(dir.path().join("s.pem"), cert).unwrap();
    std::fs::write(dir.path().join("s.key"), key).unwrap();
    std::fs::write(dir.path().join("ca.pem"), &pki.ca_pem).unwrap();
    let port = free_port();
    let extra = format!(
        "[[auth.principals]]\nname = \"ops\"\nrole = \"admin\"\ncert_cns = [\"admin-client\"]\n[auth.tls]\nlisten = \"127.0.0.1:{port}\"\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n",
        dir.path().join("s.pem"),
        dir.path().join("s.key"),
        dir.path().join("ca.pem")
    );
    let _d = TestDaemon::start_with(TWO_H100, &extra).unwrap();
    rt().block_on(async {
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A client certificate named like the admin but signed by another CA.
        let (c, k) = rogue.leaf("admin-client");
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&pki.ca_pem))
            .identity(Identity::from_pem(c, k))
            .domain_name("localhost");
        // With TLS 1.3 the client's handshake ends before the server has judged its
        // certificate, so the refusal can reach the client at any step after it:
        // each step is bounded (a CI run once waited here forever), and what must never
        // happen is an answer.
        let bound = Duration::from_secs(10);
        let res = async {
            let ch = Endpoint::from_shared(format!("https://127.0.0.1:{port}"))?
                .tls_config(tls)?
                .connect_timeout(bound)
                .timeout(bound)
                .connect()
                .await?;
            TesseraClient::new(ch)
                .get_node(pb::GetNodeRequest {})
                .await
                .map_err(anyhow::Error::from)?;
            Ok::<_, anyhow::Error>(())
        };
        let res = tokio::time::timeout(3 * bound, res)
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer in {:?}", 3 * bound)));
        assert!(res.is_err(), "a rogue certificate was accepted");
    });
}

// ------------------------------------------------------------------ unix peer creds

#[test]
fn unix_callers_are_identified_by_uid() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !nix::unistd::geteuid().is_root() {
        // Written past the test harness's capture, so CI logs show the skip.
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("SKIPPED: needs root to run the CLI as another uid\n"),
        );
        return;
    }
    let extra = tenants(14, 14)
        + "[[auth.principals]]\nname = \"team-a-user\"\nrole = \"tenant\"\ntenant = \"team-a\"\nuids = [65534]\n";
    let d = TestDaemon::start_with(TWO_H100, &extra).unwrap();
    // Let uid 65534 reach the socket: the dir is traversable and the socket's group
    // is nogroup (the daemon's socket_group setting does this in production).
    std::fs::set_permissions(d.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    nix::unistd::chown(&d.socket, None, Some(nix::unistd::Gid::from_raw(65534))).unwrap();
    let cli = bin_path("tessera").unwrap();
    let run = |uid: u32, args: &[&str]| {
        std::process::Command::new(&cli)
            .arg("--socket")
            .arg(&d.socket)
            .args(args)
            .uid(uid)
            .gid(65534)
            .output()
            .unwrap()
    };
    let ok = run(
        65534,
        &["lease", "create", "--tenant", "team-a", "--mig", "1g.10gb"],
    );
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let other = run(
        65534,
        &["lease", "create", "--tenant", "team-b", "--mig", "1g.10gb"],
    );
    assert_eq!(other.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&other.stderr).contains("PermissionDenied"));
    let stranger = run(65533, &["gpus"]);
    assert_eq!(
        stranger.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&stranger.stderr)
    );
    assert!(
        String::from_utf8_lossy(&stranger.stderr).contains("uid 65533"),
        "{}",
        String::from_utf8_lossy(&stranger.stderr)
    );
}

// ------------------------------------------------------------------ quotas and preemption

/// The leases ListLeases shows for `tenant` (live ones, by default).
async fn leases_of(c: &mut TesseraClient<Channel>, tenant: &str) -> Vec<pb::Lease> {
    c.list_leases(pb::ListLeasesRequest {
        tenant: tenant.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .leases
}

/// How many live leases (pending, active or revoking) `tenant` holds.
async fn live_count(c: &mut TesseraClient<Channel>, tenant: &str) -> usize {
    let live = [
        pb::LeaseState::Pending as i32,
        pb::LeaseState::Active as i32,
        pb::LeaseState::Revoking as i32,
    ];
    leases_of(c, tenant)
        .await
        .iter()
        .filter(|l| live.contains(&l.state))
        .count()
}

/// The active leases of `tenant`, oldest first.
async fn ids_of(c: &mut TesseraClient<Channel>, tenant: &str) -> Vec<(i64, String)> {
    let mut v: Vec<(i64, String)> = leases_of(c, tenant)
        .await
        .into_iter()
        .filter(|l| l.state == pb::LeaseState::Active as i32)
        .map(|l| (l.created_at_ms, l.id))
        .collect();
    v.sort();
    v
}

/// The ids of `tenant`'s active leases, oldest first.
async fn active_ids(c: &mut TesseraClient<Channel>, tenant: &str) -> Vec<String> {
    ids_of(c, tenant).await.into_iter().map(|x| x.1).collect()
}

/// `n` leases of one 1g.10gb instance for `tenant`, a moment apart (so that their
/// creation times order them), in order.
async fn fill_1g(c: &mut TesseraClient<Channel>, tenant: &str, n: usize) -> Vec<pb::Lease> {
    let mut leases = Vec::new();
    for _ in 0..n {
        leases.push(
            c.create_lease(create_req(tenant, shape::mig("1g.10gb")))
                .await
                .unwrap()
                .into_inner()
                .lease
                .unwrap(),
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    leases
}

#[test]
fn a_guaranteed_request_preempts_burst_leases_youngest_first_but_never_a_guarantee() {
    let d = TestDaemon::start_with(TWO_H100, &tenants(14, 14)).unwrap();
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
        // team-a fills both GPUs: 7 guaranteed + 7 burst.
        let mut a_ids = Vec::new();
        for (i, l) in fill_1g(&mut c, "team-a", 14).await.into_iter().enumerate() {
            assert_eq!(l.burst, i >= 7, "lease {i} burst flag");
            a_ids.push(l.id);
        }
        // Beyond burst: refused naming the quota.
        let e = c
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted);
        assert!(e.message().contains("quota"), "{}", e.message());

        // team-b asks within its guarantee: each request preempts one of team-a's
        // burst leases, youngest first.
        for i in 0..7 {
            let r = c
                .create_lease(create_req("team-b", shape::mig("1g.10gb")))
                .await
                .unwrap_or_else(|e| panic!("team-b lease {i}: {e}"));
            assert!(!r.into_inner().lease.unwrap().burst);
        }
        let left = active_ids(&mut c, "team-a").await;
        assert_eq!(
            left,
            a_ids[..7].to_vec(),
            "team-a keeps exactly its guaranteed (oldest) leases"
        );
        // team-b's 8th is burst: nothing may be preempted for it.
        let e = c
            .create_lease(create_req("team-b", shape::mig("1g.10gb")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        assert_eq!(ids_of(&mut c, "team-a").await.len(), 7);

        // team-a was told before each preemption.
        let mut preempting = Vec::new();
        let mut revoked = Vec::new();
        while preempting.len() < 7 || revoked.len() < 7 {
            let ev = tokio::time::timeout(Duration::from_secs(5), watch.message())
                .await
                .expect("events")
                .unwrap()
                .unwrap();
            let id = ev.lease.unwrap().id;
            if ev.kind == pb::LeaseEventKind::Preempting as i32 {
                assert!(ev.message.contains("team-b"), "{}", ev.message);
                assert!(!revoked.contains(&id), "notice came after the revocation");
                preempting.push(id);
            } else if ev.kind == pb::LeaseEventKind::Revoked as i32 {
                revoked.push(id);
            }
        }
        let mut expect: Vec<String> = a_ids[7..].to_vec();
        expect.reverse();
        assert_eq!(preempting, expect, "youngest burst lease first");
    });
}

/// A guaranteed request for several instances in one lease preempts as many burst
/// leases as all of them need, youngest first, and no more.
#[test]
fn a_guaranteed_multi_instance_request_preempts_the_burst_leases_it_needs() {
    let d = TestDaemon::start_with(TWO_H100, &tenants(14, 14)).unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let a_ids: Vec<String> = fill_1g(&mut c, "team-a", 14)
            .await
            .into_iter()
            .map(|l| l.id)
            .collect();
        let l = c
            .create_lease(create_req("team-b", shape::migs("1g.10gb", 3)))
            .await
            .unwrap_or_else(|e| panic!("team-b's three instances: {e}"))
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(l.partitions.len(), 3, "{l:?}");
        assert!(!l.burst);
        let left = active_ids(&mut c, "team-a").await;
        assert_eq!(
            left,
            a_ids[..11].to_vec(),
            "exactly the three youngest burst leases made room"
        );
        // Four more fill team-b's guarantee (7 slices): they take team-a's last four
        // burst leases, never a guaranteed one.
        let l = c
            .create_lease(create_req("team-b", shape::migs("1g.10gb", 4)))
            .await
            .unwrap_or_else(|e| panic!("team-b's four instances: {e}"))
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(l.partitions.len(), 4);
        let left = active_ids(&mut c, "team-a").await;
        assert_eq!(left, a_ids[..7].to_vec(), "team-a keeps its guarantee");
        // Beyond its guarantee team-b is burst: nothing is preempted for two more.
        let e = c
            .create_lease(create_req("team-b", shape::migs("1g.10gb", 2)))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        assert_eq!(
            live_count(&mut c, "team-a").await,
            7,
            "nothing preempted for it"
        );
    });
}

#[test]
fn two_competing_tenants_each_always_get_their_guarantee() {
    let d = TestDaemon::start_with(TWO_H100, &tenants(14, 14)).unwrap();
    let violations = rt().block_on(async {
        let c = d.client().await.unwrap();
        let mut tasks = Vec::new();
        for (t, seed) in [("team-a", 7u64), ("team-b", 13u64)] {
            let mut c = c.clone();
            tasks.push(tokio::spawn(async move {
                let mut held: Vec<String> = Vec::new();
                let mut x = seed;
                let mut refused_below_guarantee = Vec::new();
                let mut granted = 0;
                for step in 0..150 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    // Mostly grow, sometimes shrink: both push past their guarantee.
                    if (x >> 33) % 4 == 0 && !held.is_empty() {
                        let i = ((x >> 40) as usize) % held.len();
                        let id = held.swap_remove(i);
                        let _ = c
                            .release_lease(pb::ReleaseLeaseRequest {
                                lease_id: id,
                                reason: String::new(),
                            })
                            .await;
                        continue;
                    }
                    // Leases preempted by the other tenant drop out of `held`.
                    let live: HashSet<String> =
                        ids_of(&mut c, t).await.into_iter().map(|x| x.1).collect();
                    held.retain(|id| live.contains(id));
                    match c.create_lease(create_req(t, shape::mig("1g.10gb"))).await {
                        Ok(r) => {
                            granted += 1;
                            held.push(r.into_inner().lease.unwrap().id);
                        }
                        Err(e) => {
                            assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
                            // A lease being preempted (revoking) still holds its
                            // capacity, and counts against the quota, until its
                            // teardown is done: count what the daemon holds.
                            let holding = live_count(&mut c, t).await;
                            if holding < 7 {
                                refused_below_guarantee.push((
                                    step,
                                    holding,
                                    e.message().to_string(),
                                ));
                            }
                        }
                    }
                }
                (t, granted, refused_below_guarantee)
            }));
        }
        let mut out = Vec::new();
        for h in tasks {
            let (t, granted, bad) = h.await.unwrap();
            println!(
                "fair share: {t} got {granted} leases; refused below its guarantee: {}",
                bad.len()
            );
            assert!(granted > 7, "{t} got only {granted}");
            out.extend(bad.into_iter().map(|b| format!("{t}: {b:?}")));
        }
        out
    });
    assert!(
        violations.is_empty(),
        "a tenant was refused below its guarantee: {violations:#?}"
    );
}

#[test]
fn an_admin_grant_raises_burst_until_it_expires_and_is_audited() {
    let extra = "[tenants.team-a]\nguaranteed = { mig_slices = 1 }\nburst = { mig_slices = 2 }\n";
    let d = TestDaemon::start_with(TWO_H100, extra).unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let mk = || create_req("team-a", shape::mig("1g.10gb"));
        c.create_lease(mk()).await.unwrap();
        let second = c
            .create_lease(mk())
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let e = c.create_lease(mk()).await.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        let g = c
            .grant_quota(pb::GrantQuotaRequest {
                tenant: "team-a".into(),
                extra_burst: Some(pb::QuotaAmounts {
                    mig_slices: 1,
                    ..Default::default()
                }),
                expires_at_ms: now + 2500,
                reason: "incident 42: training deadline".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!g.grant_id.is_empty());
        c.create_lease(mk()).await.unwrap();
        let q = c
            .get_quota(pb::GetQuotaRequest {
                tenant: "team-a".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(q.burst.unwrap().mig_slices, 3);
        assert_eq!(q.used.unwrap().mig_slices, 3);
        assert_eq!(q.guaranteed.unwrap().mig_slices, 1);
        // After it expires, the old burst applies again.
        tokio::time::sleep(Duration::from_millis(2700)).await;
        c.release_lease(pb::ReleaseLeaseRequest {
            lease_id: second.id,
            reason: String::new(),
        })
        .await
        .unwrap();
        let e = c.create_lease(mk()).await.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        // A grant needs a reason.
        let e = c
            .grant_quota(pb::GrantQuotaRequest {
                tenant: "team-a".into(),
                extra_burst: Some(pb::QuotaAmounts {
                    mig_slices: 1,
                    ..Default::default()
                }),
                expires_at_ms: now + 60_000,
                reason: " ".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
    });
    let audit = std::fs::read_to_string(d.dir.path().join("state/audit.jsonl")).unwrap();
    let granted: Vec<&str> = audit
        .lines()
        .filter(|l| l.contains("QuotaGranted"))
        .collect();
    assert_eq!(granted.len(), 1, "{audit}");
    assert!(granted[0].contains("incident 42"), "{}", granted[0]);
}

#[test]
fn sighup_reloads_quotas_and_a_bad_file_changes_nothing() {
    let mut d =
        TestDaemon::start_with(TWO_H100, "[tenants.team-a]\nburst = { mig_slices = 1 }\n").unwrap();
    let pid = nix::unistd::Pid::from_raw(d.pid().unwrap() as i32);
    let r = rt();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        let mk = || create_req("team-a", shape::mig("1g.10gb"));
        c.create_lease(mk()).await.unwrap();
        assert_eq!(
            c.create_lease(mk()).await.unwrap_err().code(),
            Code::ResourceExhausted
        );
        let cfg = std::fs::read_to_string(&d.config).unwrap();
        // A broken file: the old quota stays.
        std::fs::write(
            &d.config,
            cfg.replace("mig_slices = 1", "mig_slices = \"two\""),
        )
        .unwrap();
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            c.create_lease(mk()).await.unwrap_err().code(),
            Code::ResourceExhausted
        );
        std::fs::write(&d.config, cfg.replace("mig_slices = 1", "mig_slices = 2")).unwrap();
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
        let mut ok = false;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if c.create_lease(mk()).await.is_ok() {
                ok = true;
                break;
            }
        }
        assert!(ok, "the raised quota was not applied:\n{}", d.log());
    });
    assert!(d.log().contains("config not reloaded"), "{}", d.log());
    d.stop().unwrap();
}

#[test]
fn the_audit_log_records_decisions_and_never_a_token() {
    let d = TestDaemon::start_with(TWO_H100, "").unwrap();
    let token = rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let r = c
            .create_lease(create_req("team-a", shape::mig("2g.20gb")))
            .await
            .unwrap()
            .into_inner();
        c.resolve_token(pb::ResolveTokenRequest {
            token: r.token.clone(),
        })
        .await
        .unwrap();
        let _ = c
            .create_lease(create_req("team-a", shape::mig("9g.99gb")))
            .await
            .unwrap_err();
        // Refused binds: one with the lease's token, one with a token of no lease.
        for (token, container) in [
            (r.token.clone(), "c-refused"),
            (format!("tsr1_{}", "0".repeat(64)), "c-no-lease"),
        ] {
            c.bind_container(pb::BindContainerRequest {
                token,
                container_id: container.into(),
                termination_log_path: "/proc/self/mem".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        }
        r.token
    });
    let path = d.dir.path().join("state/audit.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        !text.contains(&token[5..]),
        "a token leaked into the audit log"
    );
    let recs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let create_ok = recs
        .iter()
        .find(|r| r["action"] == "CreateLease" && r["result"] == "ok")
        .unwrap();
    assert_eq!(create_ok["tenant"], "team-a");
    assert!(create_ok["lease"].as_str().unwrap().starts_with("l-"));
    assert_eq!(create_ok["principal"], "uid 0");
    let refused = recs
        .iter()
        .find(|r| r["action"] == "CreateLease" && r["result"] == "InvalidArgument")
        .unwrap();
    assert!(refused["reasons"][0].as_str().unwrap().contains("9g.99gb"));
    assert!(
        recs.iter()
            .any(|r| r["action"] == "ResolveToken" && r["result"] == "ok")
    );
    // A refused bind names the container and, for a token of a lease, whose lease
    // it tried to use.
    let bind = |container: &str| {
        recs.iter()
            .find(|r| r["action"] == "BindContainer" && r["container"] == container)
            .unwrap_or_else(|| panic!("no BindContainer record of {container}: {text}"))
    };
    let refused = bind("c-refused");
    assert_eq!(refused["result"], "InvalidArgument", "{refused}");
    assert_eq!(refused["tenant"], "team-a", "{refused}");
    assert_eq!(refused["lease"], create_ok["lease"], "{refused}");
    let unknown = bind("c-no-lease");
    assert_eq!(unknown["result"], "InvalidArgument", "{unknown}");
    assert!(unknown.get("lease").is_none(), "{unknown}");
    assert!(unknown.get("tenant").is_none(), "{unknown}");
    // The CLI shows it, filtered by tenant.
    let out = std::process::Command::new(bin_path("tessera").unwrap())
        .args(["audit", "--file"])
        .arg(&path)
        .args(["--tenant", "team-a", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = String::from_utf8_lossy(&out.stdout);
    assert!(lines.lines().count() >= 3, "{lines}");
    assert!(lines.lines().all(|l| l.contains("\"team-a\"")), "{lines}");
}
