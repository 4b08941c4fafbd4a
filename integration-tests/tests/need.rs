//! Ask by need, end to end: over gRPC and the CLI, a request by memory and isolation
//! gets the smallest partition that fits, and says which.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use tessera_integration_tests::{TestDaemon, rt};
use tessera_proto::v1 as pb;

#[test]
fn a_request_by_memory_gets_the_smallest_partition_that_fits_over_grpc_and_the_cli() {
    let d = TestDaemon::start("").unwrap();
    let (ok, out) = d.cli(&["lease", "create", "--tenant", "team-a", "--memory", "15GiB"]);
    assert!(ok && out.contains("1g.20gb"), "{out}");
    let (ok, out) = d.cli(&[
        "lease",
        "create",
        "--tenant",
        "team-a",
        "--memory",
        "10GiB",
        "--isolation",
        "shared",
    ]);
    assert!(
        ok && out.contains("mps 25%") && out.contains("10 GiB"),
        "{out}"
    );
    let (ok, out) = d.cli(&[
        "lease", "create", "--tenant", "team-a", "--memory", "500GiB",
    ]);
    assert!(!ok && out.contains("no GPU on this node offers"), "{out}");
    let (ok, out) = d.cli(&[
        "lease",
        "create",
        "--tenant",
        "team-a",
        "--isolation",
        "shared",
    ]);
    assert!(!ok && out.contains("--memory"), "{out}");

    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let lease = c
            .create_lease(pb::CreateLeaseRequest {
                tenant: "team-b".into(),
                shape: Some(pb::Shape {
                    kind: Some(pb::shape::Kind::Need(pb::NeedShape {
                        memory_bytes: 30 << 30,
                        isolation: pb::Isolation::Hardware as i32,
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let Some(pb::shape::Kind::Mig(m)) = lease.shape.unwrap().kind else {
            panic!("not MIG")
        };
        assert_eq!(m.profile, "3g.40gb");
        let st = c
            .create_lease(pb::CreateLeaseRequest {
                tenant: "team-b".into(),
                shape: Some(pb::Shape {
                    kind: Some(pb::shape::Kind::Need(pb::NeedShape {
                        memory_bytes: 1 << 30,
                        isolation: 9,
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(st.code(), tonic::Code::InvalidArgument);
        assert!(st.message().contains("isolation"), "{st:?}");
    });
}
