//! Property tests of the CreateLease validation path (the same check the fuzz
//! target in `fuzz/` runs): random requests and random bytes never panic, every
//! refusal is InvalidArgument naming a known field, and its message stays short.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;

use proptest::prelude::*;
use prost::Message;
use tessera_integration_tests::validation::{
    Outcome, check_create_request, check_create_request_bytes,
};
use tessera_proto::v1 as pb;

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z0-9][a-z0-9._-]{0,70}",
        "\\PC{0,80}",
        "[ -~]{0,300}",
        (1usize..4000).prop_map(|n| "a".repeat(n)),
        Just("\u{0}\u{7f}\n\t".to_string()),
    ]
}

fn profile() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "1g.10gb",
            "1g.20gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb",
            "1g.10gb+me",
            "1G.10GB",
            "5g.50gb",
            "",
        ])
        .prop_map(String::from),
        text(),
    ]
}

/// How many partitions a shape asks for: none given, a few, or absurd.
fn count() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0u32), 1u32..10, 60u32..70, any::<u32>()]
}

fn shape() -> impl Strategy<Value = Option<pb::Shape>> {
    let kind = prop_oneof![
        (
            profile(),
            prop_oneof![Just(String::new()), Just("1c".to_string()), text()]
        )
            .prop_map(
                |(profile, compute_profile)| pb::shape::Kind::Mig(pb::MigShape {
                    profile,
                    compute_profile,
                    count: 0,
                })
            ),
        (profile(), count()).prop_map(|(profile, count)| pb::shape::Kind::Mig(pb::MigShape {
            profile,
            compute_profile: String::new(),
            count,
        })),
        count().prop_map(|count| pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count })),
        (
            prop_oneof![0u32..=101, any::<u32>()],
            prop_oneof![Just(0u64), 1u64..(100u64 << 30), any::<u64>()]
        )
            .prop_map(
                |(sm_percent, memory_bytes)| pb::shape::Kind::Mps(pb::MpsShape {
                    sm_percent,
                    memory_bytes,
                    ..Default::default()
                })
            ),
        Just(pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count: 0 })),
    ];
    prop_oneof![
        Just(None),
        Just(Some(pb::Shape { kind: None })),
        kind.prop_map(|k| Some(pb::Shape { kind: Some(k) })),
    ]
}

fn request() -> impl Strategy<Value = pb::CreateLeaseRequest> {
    (
        text(),
        shape(),
        prop_oneof![Just(0u64), 1u64..1_000_000, any::<u64>()],
        text(),
        prop::collection::hash_map(text(), text(), 0..70),
        text(),
        prop::option::of(prop_oneof![0u32..4, any::<u32>()]),
        prop_oneof![0i32..4, any::<i32>()],
    )
        .prop_map(
            |(
                tenant,
                shape,
                ttl_seconds,
                request_id,
                labels,
                priority_class,
                gpu_index,
                topology,
            )| {
                pb::CreateLeaseRequest {
                    tenant,
                    shape,
                    ttl_seconds,
                    request_id,
                    labels: labels.into_iter().collect::<HashMap<_, _>>(),
                    priority_class,
                    gpu_index,
                    topology,
                    queue_wait_ms: 0,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn random_requests_are_placed_or_refused_by_field(req in request()) {
        let encoded = req.encode_to_vec();
        let outcome = check_create_request(req);
        prop_assert!(outcome.is_ok(), "{:?}", outcome);
        // The same request through the byte path gives the same answer.
        prop_assert_eq!(check_create_request_bytes(&encoded), outcome);
    }

    #[test]
    fn random_bytes_never_break_validation(data in prop::collection::vec(any::<u8>(), 0..512)) {
        let outcome = check_create_request_bytes(&data);
        prop_assert!(outcome.is_ok(), "{:?}", outcome);
    }
}

/// The oracle is not vacuous: it accepts, places and refuses what it should.
#[test]
fn known_requests_give_known_outcomes() {
    let ok = pb::CreateLeaseRequest {
        tenant: "team-a".into(),
        shape: Some(pb::Shape {
            kind: Some(pb::shape::Kind::Mig(pb::MigShape {
                profile: "3g.40gb".into(),
                compute_profile: String::new(),
                count: 0,
            })),
        }),
        ..Default::default()
    };
    assert_eq!(check_create_request(ok.clone()), Ok(Outcome::Placed));
    for (req, field) in [
        (
            pb::CreateLeaseRequest {
                tenant: "Team A".into(),
                ..ok.clone()
            },
            "tenant",
        ),
        (
            pb::CreateLeaseRequest {
                shape: None,
                ..ok.clone()
            },
            "shape",
        ),
        (
            pb::CreateLeaseRequest {
                ttl_seconds: u64::MAX,
                ..ok.clone()
            },
            "ttl_seconds",
        ),
        (
            pb::CreateLeaseRequest {
                priority_class: "x".repeat(64),
                ..ok.clone()
            },
            "priority_class",
        ),
        (
            pb::CreateLeaseRequest {
                request_id: "has space".into(),
                ..ok.clone()
            },
            "request_id",
        ),
        (
            pb::CreateLeaseRequest {
                shape: Some(pb::Shape {
                    kind: Some(pb::shape::Kind::Mig(pb::MigShape {
                        profile: "5g.50gb".into(),
                        compute_profile: String::new(),
                        count: 0,
                    })),
                }),
                ..ok.clone()
            },
            "shape.mig.profile",
        ),
        (
            pb::CreateLeaseRequest {
                shape: Some(pb::Shape {
                    kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                        sm_percent: 101,
                        memory_bytes: 1 << 30,
                        ..Default::default()
                    })),
                }),
                ..ok.clone()
            },
            "shape",
        ),
        (
            pb::CreateLeaseRequest {
                shape: Some(pb::Shape {
                    kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                        sm_percent: 10,
                        memory_bytes: 1 << 30,
                        ..Default::default()
                    })),
                }),
                topology: pb::TopologyConstraint::Numa as i32,
                ..ok.clone()
            },
            "topology",
        ),
        (
            pb::CreateLeaseRequest {
                topology: 99,
                ..ok.clone()
            },
            "topology",
        ),
        (
            pb::CreateLeaseRequest {
                shape: Some(mig_n("3g.40gb", 2)),
                gpu_index: Some(0),
                ..ok.clone()
            },
            "gpu_index",
        ),
        (
            pb::CreateLeaseRequest {
                shape: Some(mig_n("3g.40gb", 65)),
                ..ok.clone()
            },
            "shape.count",
        ),
    ] {
        assert_eq!(check_create_request(req), Ok(Outcome::Refused(field)));
    }
    // Several partitions: two 3g fit the test node's H100; two whole GPUs do not
    // (one GPU without MIG).
    let two = pb::CreateLeaseRequest {
        shape: Some(mig_n("3g.40gb", 2)),
        topology: pb::TopologyConstraint::Nvlink as i32,
        ..ok.clone()
    };
    assert_eq!(check_create_request(two), Ok(Outcome::Placed));
    let whole2 = pb::CreateLeaseRequest {
        shape: Some(pb::Shape {
            kind: Some(pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count: 2 })),
        }),
        ..ok.clone()
    };
    assert_eq!(check_create_request(whole2), Ok(Outcome::NoCapacity));
    assert_eq!(
        check_create_request_bytes(&[0xff, 0xff]),
        Ok(Outcome::Undecodable)
    );
    // 7 x 1g fit on the H100, but the A100 has no MIG: pinning MIG to GPU 1 finds no room.
    let pinned = pb::CreateLeaseRequest {
        gpu_index: Some(1),
        ..ok
    };
    assert_eq!(check_create_request(pinned), Ok(Outcome::NoCapacity));
}

fn mig_n(profile: &str, count: u32) -> pb::Shape {
    pb::Shape {
        kind: Some(pb::shape::Kind::Mig(pb::MigShape {
            profile: profile.into(),
            compute_profile: String::new(),
            count,
        })),
    }
}
