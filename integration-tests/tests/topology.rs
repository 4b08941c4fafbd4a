//! The simulator's board topology, as NVML's topology queries report it, seen over
//! gRPC and the CLI: an 8-GPU HGX board joins every pair by NVLink through its
//! NVSwitches and splits the GPUs over two NUMA nodes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use tessera_integration_tests::{TestDaemon, rt};
use tessera_proto::v1 as pb;

#[test]
fn an_hgx_board_reports_nvlink_between_every_pair_and_its_numa_split() {
    let mut gpus = String::new();
    for _ in 0..8 {
        gpus.push_str("[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = false\n\n");
    }
    // sim.topology sits in [sim], before the GPUs.
    let d = TestDaemon::start_with(&format!("topology = \"hgx-nvswitch\"\n{gpus}"), "").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(node.gpus.len(), 8);
        for g in &node.gpus {
            assert_eq!(g.peers.len(), 7, "{g:?}");
            for p in &g.peers {
                assert_eq!(p.nvlinks, 18, "gpu {} - gpu {}", g.index, p.index);
                let same_numa = g.index / 4 == p.index / 4;
                assert_eq!(
                    p.level == "system",
                    !same_numa,
                    "{} - {}: {p:?}",
                    g.index,
                    p.index
                );
            }
        }
    });
    let (ok, out) = d.cli(&["node"]);
    assert!(ok && out.contains("peers: gpu1 NV18, gpu2 NV18"), "{out}");
}

#[test]
fn plain_pcie_cards_report_no_nvlink() {
    let d = TestDaemon::start_with(
        "[[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n\n[[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n",
        "",
    )
    .unwrap();
    let (ok, out) = d.cli(&["node"]);
    assert!(ok && out.contains("peers: gpu1 single"), "{out}");
}
