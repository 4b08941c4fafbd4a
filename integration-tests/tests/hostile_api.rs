//! The gRPC API under hostile input: oversized messages, unknown enum values,
//! extreme TTLs and numbers, empty and huge strings, invalid UTF-8, garbage bytes,
//! thousands of concurrent streams, clients that disconnect mid-call. After each,
//! the daemon must still serve and its resident memory must stay bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::{Buf, BufMut};
use prost::Message;
use tessera_integration_tests::{TestDaemon, channel, create_req, shape};
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;
use tesserad::gpu::{GpuBackend, SimBackend, SimConfig};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;
use tonic::{Code, Status};

/// Generous: the debug daemon idles at a few tens of MiB.
const RSS_LIMIT: u64 = 200 << 20;
const MIB: usize = 1 << 20;

use tessera_integration_tests::{lease_of, rt};

/// The daemon answers GetNode and its RSS is under the bound.
async fn still_serving(d: &TestDaemon, what: &str) {
    let mut c = d.client().await.unwrap();
    let node = c
        .get_node(pb::GetNodeRequest {})
        .await
        .unwrap_or_else(|e| panic!("after {what}: GetNode failed: {e}"))
        .into_inner();
    assert_eq!(node.gpus.len(), 3, "after {what}");
    let rss = d.rss().expect("daemon alive");
    assert!(
        rss < RSS_LIMIT,
        "after {what}: daemon RSS {} MiB >= {} MiB",
        rss >> 20,
        RSS_LIMIT >> 20
    );
}

fn assert_code<T>(r: Result<T, Status>, codes: &[Code], what: &str) -> Status {
    let Err(e) = r else {
        panic!("{what}: accepted, want one of {codes:?}");
    };
    assert!(
        codes.contains(&e.code()),
        "{what}: got {:?} {:?}, want one of {codes:?}",
        e.code(),
        truncate(e.message())
    );
    // The answer never echoes a huge input back.
    assert!(
        e.message().len() < 2048,
        "{what}: {} byte status message",
        e.message().len()
    );
    e
}

fn truncate(s: &str) -> &str {
    let mut n = s.len().min(300);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    &s[..n]
}

// ---- a codec that sends and receives raw protobuf bytes ----

#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;
#[derive(Debug)]
struct RawEnc;
#[derive(Debug)]
struct RawDec;

impl Encoder for RawEnc {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDec {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n).to_vec()))
    }
}

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEnc;
    type Decoder = RawDec;
    fn encoder(&mut self) -> RawEnc {
        RawEnc
    }
    fn decoder(&mut self) -> RawDec {
        RawDec
    }
}

async fn raw_unary(ch: Channel, method: &str, body: Vec<u8>) -> Result<Vec<u8>, Status> {
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::try_from(format!("/tessera.v1.Tessera/{method}")).unwrap();
    grpc.unary(tonic::Request::new(body), path, RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// A length-delimited protobuf field (wire type 2).
fn field_bytes(field: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    prost::encoding::encode_key(field, prost::encoding::WireType::LengthDelimited, &mut out);
    prost::encoding::encode_varint(data.len() as u64, &mut out);
    out.extend_from_slice(data);
    out
}

fn field_varint(field: u32, v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    prost::encoding::encode_key(field, prost::encoding::WireType::Varint, &mut out);
    prost::encoding::encode_varint(v, &mut out);
    out
}

fn client(ch: &Channel) -> TesseraClient<Channel> {
    TesseraClient::new(ch.clone())
        .max_encoding_message_size(64 * MIB)
        .max_decoding_message_size(64 * MIB)
}

#[test]
fn oversized_empty_and_huge_strings_get_precise_statuses() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let ch = channel(&d.socket).await.unwrap();
        let mut c = client(&ch);
        let big = "a".repeat(10 * MIB);
        let near = "a".repeat(MIB - 1024);
        // Over the 1 MiB decode limit: refused before any handler runs, with
        // RESOURCE_EXHAUSTED as gRPC's status code table and grpc-core servers have it
        // (tonic alone answers OUT_OF_RANGE).
        let too_large = [Code::ResourceExhausted];
        for i in 0..10 {
            assert_code(
                c.create_lease(create_req(&big, shape::whole())).await,
                &too_large,
                &format!("10 MB tenant #{i}"),
            );
        }
        assert_code(
            c.get_lease(pb::GetLeaseRequest {
                lease_id: big.clone(),
            })
            .await,
            &too_large,
            "10 MB lease id",
        );
        assert_code(
            c.resolve_token(pb::ResolveTokenRequest { token: big.clone() })
                .await,
            &too_large,
            "10 MB token",
        );
        still_serving(&d, "10 MB messages").await;

        // Just under the limit: validation names the field, without echoing it.
        let e = assert_code(
            c.create_lease(create_req(&near, shape::whole())).await,
            &[Code::InvalidArgument],
            "1 MB tenant",
        );
        assert!(e.message().contains("tenant"), "{}", e.message());
        let mut req = create_req("team-a", shape::whole());
        req.request_id = near.clone();
        let e = assert_code(
            c.create_lease(req).await,
            &[Code::InvalidArgument],
            "1 MB request id",
        );
        assert!(e.message().contains("request_id"), "{}", e.message());
        let mut req = create_req("team-a", shape::whole());
        req.labels.insert("k".into(), near.clone());
        let e = assert_code(
            c.create_lease(req).await,
            &[Code::InvalidArgument],
            "1 MB label",
        );
        assert!(e.message().contains("labels"), "{}", e.message());
        let mut req = create_req("team-a", shape::whole());
        req.labels = (0..1000).map(|i| (format!("k{i}"), "v".into())).collect();
        let e = assert_code(
            c.create_lease(req).await,
            &[Code::InvalidArgument],
            "1000 labels",
        );
        assert!(e.message().contains("labels"), "{}", e.message());
        let mut req = create_req("team-a", shape::whole());
        req.priority_class = near.clone();
        let e = assert_code(
            c.create_lease(req).await,
            &[Code::InvalidArgument],
            "1 MB priority class",
        );
        assert!(e.message().contains("priority_class"), "{}", e.message());
        let e = assert_code(
            c.create_lease(create_req("team-a", shape::mig(&near)))
                .await,
            &[Code::InvalidArgument],
            "1 MB profile",
        );
        assert!(e.message().contains("shape"), "{}", e.message());
        assert_code(
            c.get_lease(pb::GetLeaseRequest {
                lease_id: near.clone(),
            })
            .await,
            &[Code::NotFound, Code::InvalidArgument],
            "1 MB lease id",
        );
        assert_code(
            c.resolve_token(pb::ResolveTokenRequest {
                token: near.clone(),
            })
            .await,
            &[Code::NotFound, Code::InvalidArgument, Code::Unauthenticated],
            "1 MB token",
        );
        assert_code(
            c.release_lease(pb::ReleaseLeaseRequest {
                lease_id: "l-x".into(),
                reason: near.clone(),
            })
            .await,
            &[Code::InvalidArgument],
            "1 MB reason",
        );

        // Empty strings.
        let e = assert_code(
            c.create_lease(create_req("", shape::whole())).await,
            &[Code::InvalidArgument],
            "empty tenant",
        );
        assert!(e.message().contains("tenant"), "{}", e.message());
        let e = assert_code(
            c.create_lease(create_req("team-a", shape::mig(""))).await,
            &[Code::InvalidArgument],
            "empty profile",
        );
        assert!(e.message().contains("shape"), "{}", e.message());
        for (what, r) in [
            (
                "empty GetLease",
                c.get_lease(pb::GetLeaseRequest::default())
                    .await
                    .map(|_| ()),
            ),
            (
                "empty ReleaseLease",
                c.release_lease(pb::ReleaseLeaseRequest::default())
                    .await
                    .map(|_| ()),
            ),
            (
                "empty RenewLease",
                c.renew_lease(pb::RenewLeaseRequest::default())
                    .await
                    .map(|_| ()),
            ),
            (
                "empty ResolveToken",
                c.resolve_token(pb::ResolveTokenRequest::default())
                    .await
                    .map(|_| ()),
            ),
            (
                "empty BindContainer",
                c.bind_container(pb::BindContainerRequest::default())
                    .await
                    .map(|_| ()),
            ),
        ] {
            assert_code(
                r,
                &[Code::NotFound, Code::InvalidArgument, Code::Unauthenticated],
                what,
            );
        }
        still_serving(&d, "huge and empty strings").await;
    });
}

/// Strings a tenant controls are bounded: leases created with the largest fields
/// the daemon accepts never make it hold hundreds of megabytes, however often they
/// are created and released (every event keeps a copy of the lease).
#[test]
fn repeated_leases_with_the_largest_accepted_fields_keep_memory_bounded() {
    // The longest priority class name the config may define (63 characters).
    let longest = "p".repeat(63);
    let d = TestDaemon::start(&format!("[priority_classes]\n{longest} = 1\nbatch = 1\n")).unwrap();
    rt().block_on(async {
        let ch = channel(&d.socket).await.unwrap();
        let mut c = client(&ch);
        let mut req = create_req("team-a", shape::mps(1, 1));
        // A long priority class is refused by name.
        req.priority_class = "p".repeat(900 * 1024);
        let e = assert_code(
            c.create_lease(req.clone()).await,
            &[Code::InvalidArgument],
            "900 KB priority class",
        );
        assert!(e.message().contains("priority_class"), "{}", e.message());
        // 64 labels of the longest key and value each pass alone, but not in all
        // (80 KiB; 16 KiB is the most).
        req.priority_class = longest.clone();
        req.labels = (0..64)
            .map(|i| (format!("{i:0>253}"), "v".repeat(1024)))
            .collect();
        let e = assert_code(
            c.create_lease(req.clone()).await,
            &[Code::InvalidArgument],
            "80 KiB of labels",
        );
        assert!(e.message().contains("labels"), "{}", e.message());
        // The largest request accepted: 12 labels with 253-byte keys and 1 KiB
        // values, the longest priority class.
        req.labels = (0..12)
            .map(|i| (format!("{i:0>253}"), "v".repeat(1024)))
            .collect();
        for i in 0..150 {
            let mut r = req.clone();
            r.request_id = format!("big-{i}");
            let l = c.create_lease(r).await.unwrap().into_inner();
            c.release_lease(pb::ReleaseLeaseRequest {
                lease_id: l.lease.unwrap().id,
                reason: "x".repeat(1000),
            })
            .await
            .unwrap();
            if i % 50 == 0 {
                still_serving(&d, &format!("{i} large leases")).await;
            }
        }
        still_serving(&d, "150 large leases").await;
    });
}

#[test]
fn unknown_enums_and_extreme_numbers_are_refused_by_field() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let ch = channel(&d.socket).await.unwrap();
        let mut c = client(&ch);
        for state in [99, -1, i32::MAX, i32::MIN] {
            let e = assert_code(
                c.list_leases(pb::ListLeasesRequest {
                    state,
                    ..Default::default()
                })
                .await,
                &[Code::InvalidArgument],
                &format!("state {state}"),
            );
            assert!(e.message().contains("state"), "{}", e.message());
        }
        // "Negative" TTLs: uint64 on the wire, so -1 arrives as u64::MAX.
        for ttl in [u64::MAX, 1 << 63, i64::MAX as u64, 10 * 365 * 86_400] {
            let mut req = create_req("team-a", shape::mig("1g.10gb"));
            req.ttl_seconds = ttl;
            let e = assert_code(
                c.create_lease(req).await,
                &[Code::InvalidArgument],
                &format!("ttl {ttl}"),
            );
            assert!(e.message().contains("ttl_seconds"), "{}", e.message());
        }
        let l = c
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        for ttl in [u64::MAX, 1 << 63] {
            let e = assert_code(
                c.renew_lease(pb::RenewLeaseRequest {
                    lease_id: l.id.clone(),
                    ttl_seconds: ttl,
                })
                .await,
                &[Code::InvalidArgument],
                &format!("renew ttl {ttl}"),
            );
            assert!(e.message().contains("ttl_seconds"), "{}", e.message());
        }
        let again = lease_of(&mut c, &l.id).await;
        assert_eq!(again.state, pb::LeaseState::Active as i32);
        assert_eq!(
            again.expires_at_ms, l.expires_at_ms,
            "a refused renew changes nothing"
        );

        // Shapes at the edges.
        for (s, codes) in [
            (shape::mps(0, 1), &[Code::InvalidArgument][..]),
            (shape::mps(101, 1), &[Code::InvalidArgument]),
            (shape::mps(u32::MAX, 1), &[Code::InvalidArgument]),
            (
                pb::Shape {
                    kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                        sm_percent: 10,
                        memory_bytes: 0,
                        ..Default::default()
                    })),
                },
                &[Code::InvalidArgument],
            ),
            (
                pb::Shape {
                    kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                        sm_percent: 10,
                        memory_bytes: u64::MAX,
                        ..Default::default()
                    })),
                },
                &[Code::InvalidArgument, Code::ResourceExhausted],
            ),
            (pb::Shape { kind: None }, &[Code::InvalidArgument]),
            (shape::mig("7g.80gb\0"), &[Code::InvalidArgument]),
        ] {
            let what = format!("shape {s:?}");
            assert_code(c.create_lease(create_req("team-a", s)).await, codes, &what);
        }
        for gpu in [3, 1000, u32::MAX] {
            let mut req = create_req("team-a", shape::whole());
            req.gpu_index = Some(gpu);
            let e = assert_code(
                c.create_lease(req).await,
                &[
                    Code::InvalidArgument,
                    Code::NotFound,
                    Code::ResourceExhausted,
                ],
                &format!("gpu_index {gpu}"),
            );
            assert!(
                e.message().contains("GPU") || e.message().contains("gpu"),
                "{}",
                e.message()
            );
        }
        // A raw ListLeases whose state is a 10-byte negative varint.
        let body = field_varint(2, (-7i64) as u64);
        let e = assert_code(
            raw_unary(ch.clone(), "ListLeases", body).await,
            &[Code::InvalidArgument],
            "raw negative state",
        );
        assert!(e.message().contains("state"), "{}", e.message());
        still_serving(&d, "enums and numbers").await;
    });
}

#[test]
fn invalid_utf8_and_garbage_bytes_are_decode_errors() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let ch = channel(&d.socket).await.unwrap();
        let valid = create_req("team-a", shape::mig("1g.10gb")).encode_to_vec();
        let bad = [0xff, 0xfe, 0xc3, 0x28];

        // Invalid UTF-8 in the tenant (field 1), a label key, a label value.
        let mut tenant = field_bytes(1, &bad);
        tenant.extend(field_bytes(2, &pb::Shape::encode_to_vec(&shape::whole())));
        let mut entry = field_bytes(1, b"k");
        entry.extend(field_bytes(2, &bad));
        let mut label_value = valid.clone();
        label_value.extend(field_bytes(5, &entry));
        let mut entry = field_bytes(1, &bad);
        entry.extend(field_bytes(2, b"v"));
        let mut label_key = valid.clone();
        label_key.extend(field_bytes(5, &entry));
        for (what, body) in [
            ("tenant", tenant),
            ("label value", label_value),
            ("label key", label_key),
        ] {
            let e = assert_code(
                raw_unary(ch.clone(), "CreateLease", body).await,
                &[Code::Internal, Code::InvalidArgument],
                &format!("invalid UTF-8 in the {what}"),
            );
            assert!(e.message().contains("UTF-8"), "{what}: {}", e.message());
        }
        // Garbage and truncated messages.
        for (what, body) in [
            ("0xff bytes", vec![0xff; 64]),
            ("truncated varint", vec![0x18, 0x80]),
            ("length past the end", vec![0x0a, 0x7f, b'a']),
            ("wire type 7", vec![0x0f, 0x00]),
        ] {
            assert_code(
                raw_unary(ch.clone(), "CreateLease", body).await,
                &[Code::Internal, Code::InvalidArgument],
                what,
            );
        }
        // Unknown fields are skipped (proto3): the request is otherwise valid.
        let mut unknown = valid.clone();
        unknown.extend(field_bytes(99, b"from the future"));
        unknown.extend(field_varint(100, 7));
        let reply = raw_unary(ch.clone(), "CreateLease", unknown).await.unwrap();
        let reply = pb::CreateLeaseResponse::decode(reply.as_slice()).unwrap();
        assert_eq!(reply.lease.unwrap().state, pb::LeaseState::Active as i32);
        // An unknown method is Unimplemented.
        assert_code(
            raw_unary(ch.clone(), "DropAllTables", vec![]).await,
            &[Code::Unimplemented],
            "unknown method",
        );
        still_serving(&d, "invalid UTF-8 and garbage").await;
    });
}

#[test]
fn thousands_of_watch_streams_then_dropped_leave_the_daemon_serving() {
    let d = TestDaemon::start("").unwrap();
    rt().block_on(async {
        let mut after_first = 0;
        for round in 0..5 {
            // 4 connections x 500 streams: 2000 concurrent watchers (the server
            // allows 1024 streams per connection).
            let mut chans = Vec::new();
            for _ in 0..4 {
                chans.push(channel(&d.socket).await.unwrap());
            }
            let mut opens = Vec::new();
            for i in 0..2000 {
                let mut c = TesseraClient::new(chans[i % 4].clone());
                opens.push(tokio::spawn(async move {
                    c.watch_leases(pb::WatchLeasesRequest {
                        tenant: format!("ghost-{i}"),
                        ..Default::default()
                    })
                    .await
                    .map(tonic::Response::into_inner)
                }));
            }
            let mut streams = Vec::new();
            for o in opens {
                streams.push(o.await.unwrap().expect("watch opened"));
            }
            assert_eq!(streams.len(), 2000);
            still_serving(&d, &format!("2000 open watchers, round {round}")).await;
            drop(streams);
            drop(chans);
            // Events after the watchers left: each must be delivered to a live
            // watcher, and leave nothing behind for the dropped ones.
            let mut c = d.client().await.unwrap();
            let mut watch = c
                .watch_leases(pb::WatchLeasesRequest::default())
                .await
                .unwrap()
                .into_inner();
            let l = c
                .create_lease(create_req("team-a", shape::whole()))
                .await
                .unwrap()
                .into_inner()
                .lease
                .unwrap();
            let ev = tokio::time::timeout(Duration::from_secs(20), watch.message())
                .await
                .expect("an event within 20 s")
                .unwrap()
                .unwrap();
            assert_eq!(ev.lease.unwrap().id, l.id);
            c.release_lease(pb::ReleaseLeaseRequest {
                lease_id: l.id,
                reason: String::new(),
            })
            .await
            .unwrap();
            still_serving(&d, &format!("2000 dropped watchers, round {round}")).await;
            let rss = d.rss().unwrap();
            if round == 0 {
                after_first = rss;
            } else {
                // 10 000 streams over five rounds: memory does not grow with them.
                assert!(
                    rss < after_first + (48 << 20),
                    "round {round}: RSS {} MiB, {} MiB after the first round",
                    rss >> 20,
                    after_first >> 20
                );
            }
        }
    });
}

#[test]
fn clients_that_disconnect_mid_call_leave_no_half_done_lease() {
    let d = TestDaemon::start("").unwrap();
    let sim = SimBackend::open(
        &serde_json::from_value::<SimConfig>(serde_json::json!({
            "gpus": [
                {"model": "h100-80gb", "mig": true},
                {"model": "h100-80gb", "mig": true},
                {"model": "a100-40gb", "mig": false},
            ]
        }))
        .unwrap(),
        d.sim_state(),
    )
    .unwrap();
    rt().block_on(async {
        let c = d.client().await.unwrap();
        let shapes = [
            shape::mig("1g.10gb"),
            shape::mig("2g.20gb"),
            shape::mps(5, 1),
            shape::whole(),
        ];
        // Calls cut off after 0-4 ms: the client goes away mid-call.
        for i in 0..120u64 {
            let mut c2 = c.clone();
            let mut req = create_req("team-a", shapes[i as usize % 4].clone());
            req.request_id = format!("cut-{i}");
            let _ = tokio::time::timeout(Duration::from_micros(i % 5 * 1000), c2.create_lease(req))
                .await;
            if i % 3 == 0 {
                // Also cut off releases of whatever exists.
                let live = c2
                    .list_leases(pb::ListLeasesRequest::default())
                    .await
                    .unwrap()
                    .into_inner()
                    .leases;
                if let Some(l) = live.first() {
                    let _ = tokio::time::timeout(
                        Duration::from_micros(i % 4 * 1000),
                        c2.release_lease(pb::ReleaseLeaseRequest {
                            lease_id: l.id.clone(),
                            reason: String::new(),
                        }),
                    )
                    .await;
                }
            }
        }
        let mut c = d.client().await.unwrap();
        // Whatever the cut-off calls started finishes: nothing stays pending or
        // revoking.
        let mut stuck = Vec::new();
        for _ in 0..100 {
            stuck = c
                .list_leases(pb::ListLeasesRequest::default())
                .await
                .unwrap()
                .into_inner()
                .leases
                .into_iter()
                .filter(|l| l.state != pb::LeaseState::Active as i32)
                .map(|l| (l.id, l.state))
                .collect();
            if stuck.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(stuck.is_empty(), "leases left half done: {stuck:?}");
        // A retry of every cut-off create answers (never waits forever on a create
        // that was abandoned) and names at most one lease.
        for i in 0..120u64 {
            let mut req = create_req("team-a", shapes[i as usize % 4].clone());
            req.request_id = format!("cut-{i}");
            let r = tokio::time::timeout(Duration::from_secs(20), c.create_lease(req))
                .await
                .unwrap_or_else(|_| panic!("retry of cut-{i} hangs"));
            if let Err(e) = r {
                assert_eq!(e.code(), Code::ResourceExhausted, "cut-{i}: {e}");
            }
        }
        // Release everything: the hardware ends up empty.
        let live = c
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .leases;
        for l in live {
            let r = c
                .release_lease(pb::ReleaseLeaseRequest {
                    lease_id: l.id.clone(),
                    reason: String::new(),
                })
                .await
                .unwrap()
                .into_inner()
                .lease
                .unwrap();
            assert_eq!(r.state, pb::LeaseState::Released as i32, "{}", l.id);
        }
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        for g in &node.gpus {
            assert!(
                g.partitions.is_empty(),
                "GPU {}: {:?}",
                g.index,
                g.partitions
            );
            assert!(
                sim.instances(g.index).unwrap().is_empty(),
                "GPU {}: leaked instances",
                g.index
            );
        }
        assert!(sim.mps_daemons().unwrap().is_empty(), "leaked MPS daemons");
        still_serving(&d, "disconnects mid-call").await;
    });
}
