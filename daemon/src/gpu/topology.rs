//! How two GPUs of a node are connected, as NVML's topology queries report it
//! (`nvmlDeviceGetTopologyCommonAncestor`, and the NVLinks whose remote end is the
//! other GPU), and the boards the simulator models.

use serde::{Deserialize, Serialize};

/// The closest common ancestor of two GPUs on the PCIe tree
/// (`nvmlGpuTopologyLevel_t`), nearest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopologyLevel {
    /// The same board (e.g. one GPU, or a dual-GPU card).
    Internal,
    /// Behind one PCIe switch.
    Single,
    /// Behind several PCIe switches, without crossing a host bridge.
    Multiple,
    /// On the same host bridge.
    HostBridge,
    /// On the same NUMA node (possibly different host bridges).
    Node,
    /// Across NUMA nodes (the CPUs' interconnect).
    System,
}

impl TopologyLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            TopologyLevel::Internal => "internal",
            TopologyLevel::Single => "single",
            TopologyLevel::Multiple => "multiple",
            TopologyLevel::HostBridge => "host_bridge",
            TopologyLevel::Node => "node",
            TopologyLevel::System => "system",
        }
    }
}

/// The connection between two GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLink {
    pub level: TopologyLevel,
    /// Active NVLinks between the two (through NVSwitches or direct bridges).
    pub nvlinks: u32,
}

/// The board a simulated node models (`sim.topology`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SimTopology {
    /// PCIe cards, two per PCIe switch, the first half of the GPUs on NUMA node 0
    /// and the rest on node 1; no NVLink.
    #[default]
    Pcie,
    /// An HGX board (8 SXM GPUs): every pair joined through the NVSwitches with
    /// 18 NVLinks each (H100/H200; 12 on A100), two GPUs per PCIe switch, GPUs 0-3
    /// on NUMA node 0 and 4-7 on node 1.
    HgxNvswitch,
    /// PCIe cards in NVLink-bridged pairs (0-1, 2-3, ...; 12 links per pair), each
    /// pair behind one PCIe switch, NUMA as for `pcie`.
    PciePairs,
}

impl SimTopology {
    /// The link between GPUs `a` and `b` of `count`, as NVML would report it.
    pub fn link(self, a: u32, b: u32, count: u32, nvlinks_per_pair: u32) -> GpuLink {
        if a == b {
            return GpuLink {
                level: TopologyLevel::Internal,
                nvlinks: 0,
            };
        }
        let half = count.div_ceil(2).max(1);
        let (numa_a, numa_b) = match self {
            SimTopology::HgxNvswitch => (a / 4, b / 4),
            _ => (a / half, b / half),
        };
        let level = if a / 2 == b / 2 {
            TopologyLevel::Single
        } else if numa_a == numa_b {
            TopologyLevel::Node
        } else {
            TopologyLevel::System
        };
        let nvlinks = match self {
            SimTopology::Pcie => 0,
            SimTopology::HgxNvswitch => nvlinks_per_pair,
            SimTopology::PciePairs if a / 2 == b / 2 => 12,
            SimTopology::PciePairs => 0,
        };
        GpuLink { level, nvlinks }
    }

    /// The NUMA node of GPU `i` of `count`.
    pub fn numa_node(self, i: u32, count: u32) -> u32 {
        match self {
            SimTopology::HgxNvswitch => i / 4,
            _ => i / count.div_ceil(2).max(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_hgx_board_joins_every_pair_by_nvlink_and_splits_numa_in_halves() {
        let t = SimTopology::HgxNvswitch;
        for a in 0..8 {
            for b in 0..8 {
                let l = t.link(a, b, 8, 18);
                if a == b {
                    assert_eq!(l.level, TopologyLevel::Internal);
                    continue;
                }
                assert_eq!(l.nvlinks, 18, "{a}-{b}");
                assert_eq!(l.level == TopologyLevel::System, a / 4 != b / 4, "{a}-{b}");
                assert_eq!(t.link(b, a, 8, 18), l, "symmetric");
            }
        }
        assert_eq!(t.link(0, 1, 8, 18).level, TopologyLevel::Single);
        assert_eq!(t.link(0, 2, 8, 18).level, TopologyLevel::Node);
    }

    #[test]
    fn pcie_pairs_have_nvlink_only_within_the_pair() {
        let t = SimTopology::PciePairs;
        assert_eq!(t.link(2, 3, 4, 0).nvlinks, 12);
        assert_eq!(t.link(1, 2, 4, 0).nvlinks, 0);
        assert_eq!(t.link(1, 2, 4, 0).level, TopologyLevel::System);
        assert_eq!(SimTopology::Pcie.link(0, 1, 4, 0).nvlinks, 0);
    }
}
