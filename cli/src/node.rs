//! `tessera gpus` and `tessera node`: the node's GPUs, MIG mode, free capacity, partitions.

use serde::Serialize;
use tessera_proto::v1 as pb;

use crate::client::Daemon;
use crate::output::{self, PartitionView, Table, human_bytes, mig_mode};

#[derive(Debug, Serialize)]
pub struct ProfileView {
    pub profile: String,
    pub gi_profile_id: u32,
    pub slices: u32,
    pub memory_bytes: u64,
    pub sm_count: u32,
    pub free: u32,
    pub max_count: u32,
}

#[derive(Debug, Serialize)]
pub struct GpuView {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_bytes: u64,
    pub minor: u32,
    pub pci_bus_id: String,
    /// "on", "off", or "off (on after reset)" / "on (off after reset)" when a mode
    /// change waits for a GPU reset.
    pub mig_mode: String,
    pub mig_enabled: bool,
    pub mig_pending: bool,
    pub sm_count: u32,
    pub free_slices: u32,
    pub mps_sm_percent_used: u32,
    pub mps_memory_bytes_used: u64,
    /// The MPS mode of its MPS leases ("" while it has none).
    pub mps_mode: String,
    /// MPS servers running on it and the share of its time each gets.
    pub mps_servers: u32,
    pub mps_time_slice_percent: u32,
    /// How it connects to the other GPUs: (index, PCIe level, NVLinks).
    pub peers: Vec<PeerView>,
    pub whole_leased: bool,
    pub profiles: Vec<ProfileView>,
    pub partitions: Vec<PartitionView>,
    /// False while the GPU is out of service.
    pub healthy: bool,
    /// Why it is out of service ("" when healthy).
    pub health: String,
    pub unhealthy_since_ms: i64,
    /// MIG instances out of service: (gi, why).
    pub unhealthy_instances: Vec<InstanceHealthView>,
}

#[derive(Debug, Serialize)]
pub struct PeerView {
    pub index: u32,
    pub level: String,
    pub nvlinks: u32,
}

#[derive(Debug, Serialize)]
pub struct InstanceHealthView {
    pub gi_id: u32,
    pub health: String,
    pub since_ms: i64,
}

impl From<&pb::Gpu> for GpuView {
    fn from(g: &pb::Gpu) -> Self {
        Self {
            index: g.index,
            uuid: g.uuid.clone(),
            name: g.name.clone(),
            memory_bytes: g.memory_bytes,
            minor: g.minor,
            pci_bus_id: g.pci_bus_id.clone(),
            mig_mode: mig_mode(g).to_owned(),
            mig_enabled: g.mig_enabled,
            mig_pending: g.mig_pending,
            sm_count: g.sm_count,
            free_slices: g.free_slices,
            mps_sm_percent_used: g.mps_sm_percent_used,
            mps_memory_bytes_used: g.mps_memory_bytes_used,
            mps_mode: crate::output::mps_mode_name(g.mps_mode).to_owned(),
            mps_servers: g.mps_servers,
            mps_time_slice_percent: g.mps_time_slice_percent,
            peers: g
                .peers
                .iter()
                .map(|p| PeerView {
                    index: p.index,
                    level: p.level.clone(),
                    nvlinks: p.nvlinks,
                })
                .collect(),
            whole_leased: g.whole_leased,
            profiles: g
                .profiles
                .iter()
                .map(|p| ProfileView {
                    profile: p.profile.clone(),
                    gi_profile_id: p.gi_profile_id,
                    slices: p.slices,
                    memory_bytes: p.memory_bytes,
                    sm_count: p.sm_count,
                    free: p.free,
                    max_count: p.max_count,
                })
                .collect(),
            partitions: g.partitions.iter().map(PartitionView::from).collect(),
            healthy: g.healthy,
            health: g.health.clone(),
            unhealthy_since_ms: g.unhealthy_since_ms,
            unhealthy_instances: g
                .unhealthy_instances
                .iter()
                .map(|i| InstanceHealthView {
                    gi_id: i.gi_id,
                    health: i.health.clone(),
                    since_ms: i.since_ms,
                })
                .collect(),
        }
    }
}

impl GpuView {
    /// "ok", "UNHEALTHY: <why>", or "ok (instance 3 unhealthy: <why>)".
    pub fn health_text(&self) -> String {
        if !self.healthy {
            return format!("UNHEALTHY: {}", self.health);
        }
        match self.unhealthy_instances.as_slice() {
            [] => "ok".to_owned(),
            list => format!(
                "ok ({})",
                list.iter()
                    .map(|i| format!("instance {} unhealthy: {}", i.gi_id, i.health))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct NodeView {
    pub hostname: String,
    pub backend: String,
    pub version: String,
    pub driver_version: String,
    /// CreateLease calls waiting in the daemon's admission queue.
    pub queued_requests: u32,
    pub gpus: Vec<GpuView>,
}

impl From<&pb::GetNodeResponse> for NodeView {
    fn from(n: &pb::GetNodeResponse) -> Self {
        Self {
            hostname: n.hostname.clone(),
            backend: n.backend.clone(),
            version: n.version.clone(),
            driver_version: n.driver_version.clone(),
            queued_requests: n.queued_requests,
            gpus: n.gpus.iter().map(GpuView::from).collect(),
        }
    }
}

/// `tessera gpu mark-healthy|mark-unhealthy`
pub async fn set_health(
    daemon: &mut Daemon,
    gpu: u32,
    instance: Option<u32>,
    healthy: bool,
    reason: String,
    json: bool,
) -> anyhow::Result<()> {
    let resp = daemon
        .client
        .set_gpu_health(pb::SetGpuHealthRequest {
            gpu_index: gpu,
            gi_id: instance,
            healthy,
            reason,
        })
        .await
        .map_err(|s| daemon.fail("SetGpuHealth", s))?
        .into_inner();
    let view = resp.gpu.as_ref().map(GpuView::from);
    if json {
        return output::print_json(&view);
    }
    let scope = match instance {
        Some(gi) => format!("GPU {gpu} instance {gi}"),
        None => format!("GPU {gpu}"),
    };
    let state = if healthy {
        "in service"
    } else {
        "out of service"
    };
    let line = if resp.changed {
        format!("{scope} is now {state}")
    } else {
        format!("{scope} was already {state}; nothing changed")
    };
    let health = view.map(|v| v.health_text()).unwrap_or_default();
    output::print(&format!("{line}\nhealth: {health}\n"))?;
    Ok(())
}

async fn get_node(daemon: &mut Daemon) -> anyhow::Result<NodeView> {
    let resp = daemon
        .client
        .get_node(pb::GetNodeRequest {})
        .await
        .map_err(|s| daemon.fail("GetNode", s))?
        .into_inner();
    Ok(NodeView::from(&resp))
}

/// `tessera gpus`
pub async fn gpus(daemon: &mut Daemon, json: bool) -> anyhow::Result<()> {
    let node = get_node(daemon).await?;
    if json {
        return output::print_json(&node.gpus);
    }
    output::print(&gpus_table(&node.gpus))?;
    Ok(())
}

pub fn gpus_table(gpus: &[GpuView]) -> String {
    let mut t = Table::new(&[
        "INDEX",
        "NAME",
        "UUID",
        "MEMORY",
        "MIG",
        "FREE SLICES",
        "MPS SM%",
        "PARTITIONS",
        "HEALTH",
    ]);
    for g in gpus {
        t.row(vec![
            g.index.to_string(),
            g.name.clone(),
            g.uuid.clone(),
            human_bytes(g.memory_bytes),
            g.mig_mode.clone(),
            if g.mig_enabled {
                g.free_slices.to_string()
            } else {
                "-".to_owned()
            },
            format!("{}%", g.mps_sm_percent_used),
            g.partitions.len().to_string(),
            g.health_text(),
        ]);
    }
    t.render()
}

/// How the GPU's MPS servers share it: "" without servers.
fn mps_servers_text(g: &GpuView) -> String {
    let mode = if g.mps_mode.is_empty() {
        String::new()
    } else {
        format!("{} mode, ", g.mps_mode)
    };
    match g.mps_servers {
        0 => String::new(),
        1 => format!("  ({mode}1 server: its clients run concurrently)"),
        n => format!(
            "  ({mode}{n} servers time-sliced, {}% of the time each; clients of one server run concurrently)",
            g.mps_time_slice_percent
        ),
    }
}

/// `tessera node`
pub async fn node(daemon: &mut Daemon, json: bool) -> anyhow::Result<()> {
    let node = get_node(daemon).await?;
    if json {
        return output::print_json(&node);
    }
    output::print(&node_text(&node))?;
    Ok(())
}

pub fn node_text(node: &NodeView) -> String {
    let mut out = format!(
        "node {}  backend {}  tesserad {}  driver {}\n",
        dash(&node.hostname),
        dash(&node.backend),
        dash(&node.version),
        dash(&node.driver_version)
    );
    if node.queued_requests > 0 {
        out.push_str(&format!(
            "{} create request{} waiting for room (admission queue)\n",
            node.queued_requests,
            if node.queued_requests == 1 { "" } else { "s" }
        ));
    }
    for g in &node.gpus {
        out.push('\n');
        gpu_text(&mut out, g);
    }
    out
}

/// One GPU of `tessera node`: what it is, its MPS load, peers, free capacity and
/// partitions.
fn gpu_text(out: &mut String, g: &GpuView) {
    out.push_str(&format!(
        "GPU {}  {}  {}\n  pci {}  minor {}  memory {}  SMs {}  MIG {}{}\n",
        g.index,
        g.name,
        g.uuid,
        dash(&g.pci_bus_id),
        g.minor,
        human_bytes(g.memory_bytes),
        g.sm_count,
        g.mig_mode,
        if g.whole_leased {
            "  (leased whole)"
        } else {
            ""
        },
    ));
    if g.mig_enabled {
        out.push_str(&format!("  free slices {}\n", g.free_slices));
    }
    out.push_str(&format!(
        "  MPS used {}% SM, {}{}\n",
        g.mps_sm_percent_used,
        human_bytes(g.mps_memory_bytes_used),
        mps_servers_text(g)
    ));
    if !g.peers.is_empty() {
        // nvidia-smi topo -m style: NV<links> over NVLink, else the PCIe level.
        let peers: Vec<String> = g
            .peers
            .iter()
            .map(|p| {
                if p.nvlinks > 0 {
                    format!("gpu{} NV{}", p.index, p.nvlinks)
                } else {
                    format!("gpu{} {}", p.index, p.level)
                }
            })
            .collect();
        out.push_str(&format!("  peers: {}\n", peers.join(", ")));
    }
    if !g.profiles.is_empty() {
        out.push_str("  free capacity:\n");
        let mut t = Table::new(&["PROFILE", "ID", "SLICES", "MEMORY", "SMS", "FREE", "MAX"]);
        for p in &g.profiles {
            t.row(vec![
                p.profile.clone(),
                p.gi_profile_id.to_string(),
                p.slices.to_string(),
                human_bytes(p.memory_bytes),
                p.sm_count.to_string(),
                p.free.to_string(),
                p.max_count.to_string(),
            ]);
        }
        indent(out, &t.render(), "    ");
    }
    partitions_text(out, &g.partitions);
}

fn partitions_text(out: &mut String, partitions: &[PartitionView]) {
    if partitions.is_empty() {
        out.push_str("  partitions: none\n");
        return;
    }
    out.push_str("  partitions:\n");
    let mut t = Table::new(&["ID", "KIND", "WHAT", "MEMORY", "ORIGIN", "LEASE"]);
    for p in partitions {
        t.row(vec![
            p.id.clone(),
            p.kind.clone(),
            p.describe(),
            p.memory_bytes().map_or_else(|| "-".to_owned(), human_bytes),
            dash(&p.origin).to_owned(),
            match &p.mig {
                Some(m) if !m.mps_host_tenant.is_empty() => {
                    format!("hosts MPS of {}", m.mps_host_tenant)
                }
                _ if p.lease_id.is_empty() => "free".to_owned(),
                _ => p.lease_id.clone(),
            },
        ]);
    }
    indent(out, &t.render(), "    ");
}

fn dash(s: &str) -> &str {
    if s.is_empty() { "-" } else { s }
}

fn indent(out: &mut String, text: &str, prefix: &str) {
    for line in text.lines() {
        out.push_str(prefix);
        out.push_str(line);
        out.push('\n');
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn sample_gpu() -> pb::Gpu {
        pb::Gpu {
            index: 0,
            uuid: "GPU-1111".to_owned(),
            name: "NVIDIA A100-SXM4-80GB".to_owned(),
            memory_bytes: 80 << 30,
            minor: 0,
            pci_bus_id: "00000000:07:00.0".to_owned(),
            mig_enabled: true,
            mig_pending: true,
            sm_count: 108,
            profiles: vec![pb::ProfileCapacity {
                profile: "1g.10gb".to_owned(),
                gi_profile_id: 19,
                slices: 1,
                memory_bytes: 10_468_982_784,
                sm_count: 14,
                free: 6,
                max_count: 7,
            }],
            mps_sm_percent_used: 0,
            mps_memory_bytes_used: 0,
            mps_mode: 0,
            mps_servers: 0,
            mps_time_slice_percent: 0,
            peers: vec![pb::GpuPeer {
                index: 1,
                level: "node".to_owned(),
                nvlinks: 18,
            }],
            whole_leased: false,
            partitions: vec![crate::output::tests::sample_lease().partition.unwrap()],
            free_slices: 6,
            healthy: true,
            health: String::new(),
            unhealthy_since_ms: 0,
            unhealthy_instances: vec![],
        }
    }

    #[test]
    fn gpus_table_shows_mig_mode_and_free_slices() {
        let text = gpus_table(&[GpuView::from(&sample_gpu())]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "INDEX  NAME                   UUID      MEMORY  MIG  FREE SLICES  MPS SM%  PARTITIONS  HEALTH"
        );
        assert_eq!(
            lines[1],
            "0      NVIDIA A100-SXM4-80GB  GPU-1111  80 GiB  on   6            0%       1           ok"
        );
        let mut pending = sample_gpu();
        pending.mig_enabled = false;
        pending.mig_pending = true;
        assert_eq!(GpuView::from(&pending).mig_mode, "off (on after reset)");
    }

    #[test]
    fn node_text_lists_free_capacity_per_profile() {
        let node = NodeView::from(&pb::GetNodeResponse {
            hostname: "gpu-host-1".to_owned(),
            backend: "sim".to_owned(),
            version: "0.1.0".to_owned(),
            gpus: vec![sample_gpu()],
            driver_version: "550.54".to_owned(),
            queued_requests: 0,
        });
        let text = node_text(&node);
        assert!(!text.contains("waiting for room"), "{text}");
        let queued = NodeView {
            hostname: String::new(),
            backend: String::new(),
            version: String::new(),
            driver_version: String::new(),
            queued_requests: 2,
            gpus: Vec::new(),
        };
        assert!(
            node_text(&queued).contains("\n2 create requests waiting for room (admission queue)\n"),
            "{}",
            node_text(&queued)
        );
        assert!(
            text.contains("    1g.10gb  19  1       9.75 GiB  14   6     7\n"),
            "{text}"
        );
        assert!(
            text.contains("p-0-3  mig   1g.10gb  9.75 GiB  dynamic  l-7f3a"),
            "{text}"
        );
        assert!(text.contains("  peers: gpu1 NV18\n"), "{text}");
        let json = serde_json::to_value(&node).unwrap();
        assert_eq!(json["gpus"][0]["peers"][0]["level"], "node");
        assert_eq!(json["gpus"][0]["mig_mode"], "on");
        assert_eq!(json["gpus"][0]["profiles"][0]["free"], 6);
    }
}
