//! Room for large MIG instances, end to end on the real binaries: with a pinned 4g on
//! one H100 and one small idle lease on the other, a 7g request over the CLI succeeds
//! because tesserad moves the small lease next to the 4g; it keeps its id and token,
//! watchers get a `moved` event, and `tessera lease show` names its new GPU. A lease
//! whose devices a runtime asked for stays where it is. A new lease joins the GPU whose
//! lease outlasts it (temporal packing).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tessera_integration_tests::{TestDaemon, create_req, rt, shape};
use tessera_proto::v1 as pb;

const TWO_H100: &str = r#"
[[sim.gpus]]
model = "h100-80gb"
mig = true

[[sim.gpus]]
model = "h100-80gb"
mig = true
"#;

/// gpu0: a 4g pinned there (never moved) with room beside it; gpu1: one idle 1g, not
/// pinned. Returns the 1g's CreateLease answer.
async fn idle_lease_in_the_way(
    c: &mut pb::tessera_client::TesseraClient<tonic::transport::Channel>,
) -> pb::CreateLeaseResponse {
    let mut ids = Vec::new();
    for profile in ["4g.40gb", "3g.40gb"] {
        let mut req = create_req("team-a", shape::mig(profile));
        req.gpu_index = Some(0);
        ids.push(
            c.create_lease(req)
                .await
                .unwrap()
                .into_inner()
                .lease
                .unwrap()
                .id,
        );
    }
    let a = c
        .create_lease(create_req("team-a", shape::mig("1g.10gb")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        a.lease
            .as_ref()
            .unwrap()
            .partition
            .as_ref()
            .unwrap()
            .gpu_index,
        1
    );
    c.release_lease(pb::ReleaseLeaseRequest {
        lease_id: ids[1].clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    a
}

#[test]
fn an_idle_lease_moves_for_a_7g_over_grpc_and_the_cli() {
    let d = TestDaemon::start_with(TWO_H100, "").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let mut watch = c
            .watch_leases(pb::WatchLeasesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let a = idle_lease_in_the_way(&mut c).await;
        let id = a.lease.as_ref().unwrap().id.clone();

        let (ok, out) = d.cli(&["lease", "create", "--tenant", "team-b", "--mig", "7g.80gb"]);
        assert!(ok && out.contains("on gpu 1"), "{out}");

        let moved = loop {
            let ev = tokio::time::timeout(Duration::from_secs(15), watch.message())
                .await
                .expect("a moved event")
                .unwrap()
                .unwrap();
            if ev.kind == pb::LeaseEventKind::Moved as i32 {
                break ev;
            }
        };
        let lease = moved.lease.unwrap();
        assert_eq!(lease.id, id);
        assert!(
            moved.message.contains("moved to make room"),
            "{}",
            moved.message
        );
        assert_eq!(lease.partition.unwrap().gpu_index, 0);

        // Same token, new place.
        let r = c
            .resolve_token(pb::ResolveTokenRequest {
                token: a.token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.lease.unwrap().id, id);
        let (ok, out) = d.cli(&["lease", "show", &id]);
        assert!(ok && out.contains("on gpu 0 "), "{out}");
    });
}

#[test]
fn leases_in_use_are_not_moved() {
    let d = TestDaemon::start_with(TWO_H100, "").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let a = idle_lease_in_the_way(&mut c).await;
        c.resolve_token(pb::ResolveTokenRequest { token: a.token })
            .await
            .unwrap();
    });
    let (ok, out) = d.cli(&["lease", "create", "--tenant", "team-b", "--mig", "7g.80gb"]);
    assert!(
        !ok && out.contains("no free placement for 7g.80gb"),
        "{out}"
    );
}

/// Until the daemon says `n` CreateLease calls wait in its admission queue.
async fn queued(c: &mut pb::tessera_client::TesseraClient<tonic::transport::Channel>, n: u32) {
    for _ in 0..1000 {
        let node = c
            .get_node(pb::GetNodeRequest::default())
            .await
            .unwrap()
            .into_inner();
        if node.queued_requests == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the queue never held {n} requests");
}

/// The admission queue over gRPC and the CLI, with moves at refusal off (so only a
/// lease ending makes room): a 7g that asks to wait is granted when the small lease in
/// its way is released; one whose wait ends gets RESOURCE_EXHAUSTED with the reason;
/// one whose caller's deadline passes gets DEADLINE_EXCEEDED; the queue is empty after
/// each.
#[test]
fn a_7g_waits_in_the_admission_queue_until_a_lease_ends() {
    let d = TestDaemon::start_with(TWO_H100, "[partition]\nmove_idle = false\n").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let a = idle_lease_in_the_way(&mut c).await;
        let seven = |wait_ms: u32| {
            let mut req = create_req("team-b", shape::mig("7g.80gb"));
            req.queue_wait_ms = wait_ms;
            req
        };
        // Its wait ends: refused with the planner's reason, and gone from the queue.
        let st = c.create_lease(seven(300)).await.unwrap_err();
        assert_eq!(st.code(), tonic::Code::ResourceExhausted, "{st:?}");
        assert!(
            st.message()
                .contains("no room within the queue wait of 300 ms")
                && st.message().contains("7g.80gb"),
            "{}",
            st.message()
        );
        queued(&mut c, 0).await;
        // The caller's deadline passes first: the call ends, the request leaves.
        let mut req = tonic::Request::new(seven(60_000));
        req.set_timeout(Duration::from_millis(300));
        let st = c.create_lease(req).await.unwrap_err();
        // tonic's own timer answers CANCELLED, the daemon's DEADLINE_EXCEEDED.
        assert!(
            matches!(
                st.code(),
                tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
            ),
            "{st:?}"
        );
        queued(&mut c, 0).await;
        // Waits, and is granted once the 1g is released.
        let mut c2 = d.client().await.unwrap();
        let waiting = tokio::spawn(async move { c2.create_lease(seven(60_000)).await });
        queued(&mut c, 1).await;
        c.release_lease(pb::ReleaseLeaseRequest {
            lease_id: a.lease.unwrap().id,
            ..Default::default()
        })
        .await
        .unwrap();
        let got = waiting.await.unwrap().unwrap().into_inner();
        assert_eq!(got.lease.unwrap().partition.unwrap().gpu_index, 1);
        assert!(!got.token.is_empty());
        queued(&mut c, 0).await;
    });
    // The CLI: refused at once without --wait; with it, it waits for the 7g to end.
    let (ok, out) = d.cli(&["lease", "create", "--tenant", "team-c", "--mig", "7g.80gb"]);
    assert!(!ok && out.contains("7g.80gb"), "{out}");
    std::thread::scope(|s| {
        let cli = s.spawn(|| {
            d.cli(&[
                "lease", "create", "--tenant", "team-c", "--mig", "7g.80gb", "--wait", "60s",
            ])
        });
        rt().block_on(async {
            let mut c = d.client().await.unwrap();
            queued(&mut c, 1).await;
            let (ok, out) = d.cli(&["node"]);
            assert!(
                ok && out.contains("1 create request waiting for room"),
                "{out}"
            );
            let live = c
                .list_leases(pb::ListLeasesRequest {
                    tenant: "team-b".into(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            for l in live.leases {
                c.release_lease(pb::ReleaseLeaseRequest {
                    lease_id: l.id,
                    ..Default::default()
                })
                .await
                .unwrap();
            }
        });
        let (ok, out) = cli.join().unwrap();
        assert!(ok && out.contains("on gpu 1"), "{out}");
    });
}

/// Temporal packing end to end: gpu0 holds a 1g lease of 10 minutes, gpu1 one of 2
/// hours (both pinned over gRPC); a 1g lease of an hour asked for over the CLI goes to
/// gpu1, where it delays nothing, so gpu0 can empty in 10 minutes. Without expiries
/// best fit ties and takes gpu0 (`expiry_weight = 0`).
#[test]
fn a_new_lease_joins_the_gpu_whose_lease_outlasts_it() {
    for (config, want) in [
        ("", "on gpu 1"),
        ("[partition]\nexpiry_weight = 0\n", "on gpu 0"),
    ] {
        let d = TestDaemon::start_with(TWO_H100, config).unwrap();
        rt().block_on(async {
            let mut c = d.client().await.unwrap();
            for (gpu, ttl_seconds) in [(0, 600), (1, 7200)] {
                let mut req = create_req("team-a", shape::mig("1g.10gb"));
                req.gpu_index = Some(gpu);
                req.ttl_seconds = ttl_seconds;
                c.create_lease(req).await.unwrap();
            }
        });
        let (ok, out) = d.cli(&[
            "lease", "create", "--tenant", "team-a", "--mig", "1g.10gb", "--ttl", "1h",
        ]);
        assert!(ok && out.contains(want), "{config:?}: {out}");
    }
}

/// The admission queue is bounded per tenant: a tenant at its bound gets no place to
/// wait (a request that fits is still granted at once; one that does not is refused
/// saying why), while another tenant still queues.
#[test]
fn a_tenant_at_its_queue_bound_cannot_wait_but_others_can() {
    let d = TestDaemon::start_with(
        TWO_H100,
        "[partition]\nmove_idle = false\n[lease]\nmax_queued_per_tenant = 1\n",
    )
    .unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let _a = idle_lease_in_the_way(&mut c).await;
        let waiting = |tenant: &str, profile: &str| {
            let mut req = create_req(tenant, shape::mig(profile));
            req.queue_wait_ms = 60_000;
            req
        };
        let mut c2 = d.client().await.unwrap();
        let first = waiting("team-b", "7g.80gb");
        let first = tokio::spawn(async move { c2.create_lease(first).await });
        queued(&mut c, 1).await;
        let st = c
            .create_lease(waiting("team-b", "7g.80gb"))
            .await
            .unwrap_err();
        assert_eq!(st.code(), tonic::Code::ResourceExhausted, "{st:?}");
        assert!(
            st.message().contains("it cannot wait for room")
                && st.message().contains("max_queued_per_tenant"),
            "{}",
            st.message()
        );
        // What fits is granted all the same.
        c.create_lease(waiting("team-b", "1g.10gb"))
            .await
            .unwrap_or_else(|e| panic!("a 1g that fits: {e}"));
        // Another tenant still has room to wait.
        let mut c3 = d.client().await.unwrap();
        let other = waiting("team-c", "7g.80gb");
        let other = tokio::spawn(async move { c3.create_lease(other).await });
        queued(&mut c, 2).await;
        first.abort();
        other.abort();
        queued(&mut c, 0).await;
    });
}
