//! Room for large MIG instances, end to end on the real binaries: with one small idle
//! lease on each of two H100s, a 7g request over the CLI succeeds because tesserad
//! moves one of them; the moved lease keeps its id and token, watchers get a `moved`
//! event, and `tessera lease show` names its new GPU. A lease whose devices a runtime
//! asked for stays where it is.

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

async fn small_on(
    c: &mut pb::tessera_client::TesseraClient<tonic::transport::Channel>,
    gpu: u32,
) -> pb::CreateLeaseResponse {
    let mut req = create_req("team-a", shape::mig("1g.10gb"));
    req.gpu_index = Some(gpu);
    c.create_lease(req).await.unwrap().into_inner()
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
        let a = small_on(&mut c, 0).await;
        let b = small_on(&mut c, 1).await;
        let ids = [a.lease.unwrap().id, b.lease.unwrap().id];

        let (ok, out) = d.cli(&["lease", "create", "--tenant", "team-b", "--mig", "7g.80gb"]);
        assert!(ok, "{out}");

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
        assert!(ids.contains(&lease.id), "{}", lease.id);
        assert!(
            moved.message.contains("moved to make room"),
            "{}",
            moved.message
        );
        let gpu_now = lease.partition.unwrap().gpu_index;

        // Same token, new place.
        let token = if lease.id == ids[0] {
            &a.token
        } else {
            &b.token
        };
        let r = c
            .resolve_token(pb::ResolveTokenRequest {
                token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.lease.unwrap().id, lease.id);
        let (ok, out) = d.cli(&["lease", "show", &lease.id]);
        assert!(ok && out.contains(&format!("on gpu {gpu_now} ")), "{out}");

        // Both small leases now share a GPU; the 7g has the other.
        let list = c
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .leases;
        let gpu_of = |id: &str| {
            list.iter()
                .find(|l| l.id == id)
                .and_then(|l| l.partition.as_ref())
                .map(|p| p.gpu_index)
                .unwrap()
        };
        assert_eq!(gpu_of(&ids[0]), gpu_of(&ids[1]));
    });
}

#[test]
fn leases_in_use_are_not_moved() {
    let d = TestDaemon::start_with(TWO_H100, "").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        for gpu in [0, 1] {
            let l = small_on(&mut c, gpu).await;
            c.resolve_token(pb::ResolveTokenRequest { token: l.token })
                .await
                .unwrap();
        }
    });
    let (ok, out) = d.cli(&["lease", "create", "--tenant", "team-b", "--mig", "7g.80gb"]);
    assert!(
        !ok && out.contains("no free placement for 7g.80gb"),
        "{out}"
    );
}
