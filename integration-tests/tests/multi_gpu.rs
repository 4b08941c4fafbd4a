//! Multi-GPU leases, end to end on the simulator over gRPC and the CLI: N whole
//! GPUs or N MIG instances of one profile in one lease, placed by the board's
//! topology (an 8-GPU HGX board with NVSwitches; PCIe cards in NVLink-bridged
//! pairs), refused with TOPOLOGY_UNMET when a constraint cannot be met, shown with
//! every partition, counted whole by quota, ended together, kept across a restart.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use tessera_integration_tests::{TestDaemon, create_req, lease_of, rt, shape};
use tessera_proto::v1 as pb;
use tonic::Code;
use tonic_types::StatusExt;

fn board(topology: &str, n: usize, mig: bool) -> String {
    let mut s = format!("topology = \"{topology}\"\n");
    for _ in 0..n {
        s.push_str(&format!(
            "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = {mig}\n\n"
        ));
    }
    s
}

fn with_topology(shape: pb::Shape, topology: pb::TopologyConstraint) -> pb::CreateLeaseRequest {
    pb::CreateLeaseRequest {
        topology: topology as i32,
        ..create_req("team-a", shape)
    }
}

fn gpus_of(l: &pb::Lease) -> Vec<u32> {
    l.partitions.iter().map(|p| p.gpu_index).collect()
}

/// A lease id from the CLI's `lease create` text.
fn lease_id(out: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix("lease:"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| panic!("no lease id in {out}"))
}

#[test]
fn an_hgx_board_gives_whole_gpus_by_numa_node_and_keeps_them_across_a_restart() {
    let mut d = TestDaemon::start_with(
        &board("hgx-nvswitch", 8, false),
        "[tenants.team-a]\nguaranteed = { whole_gpus = 8 }\nburst = { whole_gpus = 8 }\n",
    )
    .unwrap();
    let r = rt();
    let first = r.block_on(async {
        let mut c = d.client().await.unwrap();
        let mut events = c
            .watch_leases(pb::WatchLeasesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let l = c
            .create_lease(with_topology(
                shape::wholes(4),
                pb::TopologyConstraint::Nvlink,
            ))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        // Every pair is NVLinked on this board; four stay on one NUMA node.
        assert_eq!(gpus_of(&l), vec![0, 1, 2, 3]);
        assert_eq!(
            l.partition.as_ref().unwrap().id,
            l.partitions[0].id,
            "old field = first"
        );
        let t = l.topology.clone().unwrap();
        assert_eq!((t.min_nvlinks, t.worst_level.as_str()), (18, "node"));
        match l.shape.as_ref().and_then(|s| s.kind.as_ref()) {
            Some(pb::shape::Kind::WholeGpu(w)) => assert_eq!(w.count, 4),
            other => panic!("{other:?}"),
        }
        // WatchLeases tells of it with every partition.
        let ev = events.message().await.unwrap().unwrap();
        assert_eq!(ev.kind, pb::LeaseEventKind::Created as i32);
        assert_eq!(gpus_of(ev.lease.as_ref().unwrap()), vec![0, 1, 2, 3]);
        l
    });
    // The CLI: the other NUMA node's four, shown with every GPU and the link.
    let (ok, out) = d.cli(&[
        "lease",
        "create",
        "--tenant",
        "team-a",
        "--gpus",
        "4",
        "--topology",
        "numa",
    ]);
    assert!(ok, "{out}");
    let second = lease_id(&out);
    let (ok, out) = d.cli(&["lease", "show", &second]);
    assert!(ok, "{out}");
    assert!(out.contains("shape:") && out.contains("gpu x4"), "{out}");
    for g in 4..8 {
        assert!(out.contains(&format!("on gpu {g} (")), "gpu {g}: {out}");
    }
    assert!(
        out.contains("gpus 4,5,6,7: NVLink (18 links or more each pair); PCIe: one NUMA node"),
        "{out}"
    );
    let (ok, out) = d.cli(&["lease", "list"]);
    assert!(
        ok && out.contains("0,1,2,3") && out.contains("4,5,6,7"),
        "{out}"
    );
    // Quota counts each GPU: 8 of 8 used, one more is over quota.
    let (ok, out) = d.cli(&["lease", "create", "--tenant", "team-a", "--gpu"]);
    assert!(!ok && out.contains("quota"), "{out}");
    // A restart keeps both leases with all their partitions.
    d.stop().unwrap();
    d.spawn().unwrap();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        let l = lease_of(&mut c, &first.id).await;
        assert_eq!(l.state, pb::LeaseState::Active as i32);
        assert_eq!(gpus_of(&l), vec![0, 1, 2, 3]);
    });
    // Release ends all four: the freed GPUs serve a new lease of eight... once the
    // second is released too.
    let (ok, out) = d.cli(&["lease", "release", &first.id]);
    assert!(ok && out.contains("released"), "{out}");
    let (ok, _) = d.cli(&["lease", "release", &second]);
    assert!(ok);
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        let l = c
            .create_lease(create_req("team-a", shape::wholes(8)))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(gpus_of(&l), (0..8).collect::<Vec<_>>());
    });
}

#[test]
fn pcie_pairs_place_mig_instances_on_a_bridged_pair_or_refuse_by_topology() {
    let d = TestDaemon::start_with(&board("pcie-pairs", 4, true), "").unwrap();
    let r = rt();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        // A 4g on gpu0 and on gpu2: each bridged pair (0-1, 2-3) has room for
        // three 3g, the node for six.
        for gpu in [0, 2] {
            let l = c
                .create_lease(pb::CreateLeaseRequest {
                    gpu_index: Some(gpu),
                    ..create_req("team-b", shape::migs("4g.40gb", 0))
                })
                .await
                .unwrap()
                .into_inner()
                .lease
                .unwrap();
            assert_eq!(l.partitions.len(), 1, "one partition: listed too");
            assert!(l.topology.is_none());
        }
        let err = c
            .create_lease(with_topology(
                shape::migs("3g.40gb", 4),
                pb::TopologyConstraint::Nvlink,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
        let info = err.get_details_error_info().expect("ErrorInfo");
        assert_eq!(info.reason, "TOPOLOGY_UNMET", "{err}");
        assert!(
            err.message().contains("NVLink") && err.message().contains("room for 6"),
            "{err}"
        );
        // Three fit on one bridged pair: the first GPU's room, then its partner's.
        let l = c
            .create_lease(with_topology(
                shape::migs("3g.40gb", 3),
                pb::TopologyConstraint::Nvlink,
            ))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(gpus_of(&l), vec![0, 1, 1]);
        let t = l.topology.clone().unwrap();
        assert_eq!((t.gpu_indices.clone(), t.min_nvlinks), (vec![0, 1], 12));
        assert!(
            l.partitions
                .iter()
                .all(|p| p.mig.as_ref().unwrap().mig_uuid.starts_with("MIG-")),
            "{l:?}"
        );
        // The other pair's three, without a constraint; then the node is full.
        let other = c
            .create_lease(create_req("team-a", shape::migs("3g.40gb", 3)))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(gpus_of(&other), vec![2, 3, 3]);
        let err = c
            .create_lease(create_req("team-a", shape::migs("1g.10gb", 2)))
            .await
            .unwrap_err();
        let info = err.get_details_error_info().expect("ErrorInfo");
        assert_eq!(info.reason, "NO_CAPACITY", "{err}");
        let leased =
            |n: &pb::GetNodeResponse| -> usize { n.gpus.iter().map(|g| g.partitions.len()).sum() };
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(leased(&node), 8, "2 x 4g + 3 + 3 instances");
        // Releasing ends every instance of each lease.
        for id in [&l.id, &other.id] {
            let ended = c
                .release_lease(pb::ReleaseLeaseRequest {
                    lease_id: id.clone(),
                    reason: "done".into(),
                })
                .await
                .unwrap()
                .into_inner()
                .lease
                .unwrap();
            assert_eq!(ended.state, pb::LeaseState::Released as i32);
        }
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(leased(&node), 2);
    });
    // The CLI: --count with --mig; a refusal by topology names why.
    let (ok, out) = d.cli(&[
        "lease",
        "create",
        "--tenant",
        "team-a",
        "--mig",
        "3g.40gb",
        "--count",
        "4",
        "--topology",
        "nvlink",
    ]);
    assert!(!ok, "{out}");
    assert!(out.contains("NVLink"), "{out}");
    let (ok, out) = d.cli(&[
        "lease",
        "create",
        "--tenant",
        "team-a",
        "--mig",
        "3g.40gb",
        "--count",
        "3",
        "--topology",
        "nvlink",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("mig 3g.40gb x3"), "{out}");
    assert!(
        out.contains("gpus 0,1: NVLink (12 links or more each pair)"),
        "{out}"
    );
}
