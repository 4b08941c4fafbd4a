//! What a container on a lease needs: device nodes, env, mounts (ResolveToken).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::DevicesConfig;
use crate::gpu::MigMinors;

use crate::model::{Lease, PartKind, Partition};

/// Major of /dev/nvidia<N>, /dev/nvidiactl.
pub const NVIDIA_MAJOR: i64 = 195;
pub const NVIDIACTL_MINOR: i64 = 255;
/// Majors the simulator reports when /proc/devices has no NVIDIA entries.
pub const SIM_UVM_MAJOR: i64 = 510;
pub const SIM_CAPS_MAJOR: i64 = 511;
/// Where the lease's MPS pipe directory appears inside the container.
pub const CONTAINER_MPS_PIPE_DIR: &str = "/run/nvidia-mps";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceNode {
    pub host_path: PathBuf,
    pub container_path: String,
    pub major: i64,
    pub minor: i64,
    pub permissions: String,
    pub file_mode: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountSpec {
    pub source: PathBuf,
    pub destination: String,
    pub options: Vec<String>,
}

/// Everything the runtime needs for one lease.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub lease: Lease,
    pub partition: Partition,
    pub devices: Vec<DeviceNode>,
    pub env: BTreeMap<String, String>,
    pub mounts: Vec<MountSpec>,
    pub visible_gpu_indices: Vec<u32>,
    pub granted_capabilities: Vec<String>,
    pub cgroup_parent: String,
    pub pids_limit: u64,
}

/// Read a character-device major from /proc/devices text ("195 nvidia-frontend").
pub fn major_from_proc_devices(text: &str, name: &str) -> Option<i64> {
    let mut in_char = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with("Character devices") {
            in_char = true;
            continue;
        }
        if line.starts_with("Block devices") {
            in_char = false;
            continue;
        }
        if !in_char {
            continue;
        }
        let mut parts = line.split_whitespace();
        if let (Some(major), Some(n)) = (parts.next(), parts.next())
            && n == name
        {
            return major.parse().ok();
        }
    }
    None
}

/// The majors of nvidia-uvm and nvidia-caps: config, else /proc/devices, else the
/// simulator's fixed values.
pub fn dynamic_majors(cfg: &DevicesConfig) -> (i64, i64) {
    let proc = std::fs::read_to_string("/proc/devices").unwrap_or_default();
    let uvm = cfg
        .nvidia_uvm_major
        .map(i64::from)
        .or_else(|| major_from_proc_devices(&proc, "nvidia-uvm"))
        .unwrap_or(SIM_UVM_MAJOR);
    let caps = cfg
        .nvidia_caps_major
        .map(i64::from)
        .or_else(|| major_from_proc_devices(&proc, "nvidia-caps"))
        .unwrap_or(SIM_CAPS_MAJOR);
    (uvm, caps)
}

fn node(dev_root: &Path, name: &str, major: i64, minor: i64) -> DeviceNode {
    DeviceNode {
        host_path: dev_root.join(name),
        container_path: format!("/dev/{name}"),
        major,
        minor,
        permissions: "rw".into(),
        file_mode: 0o666,
    }
}

/// Build the devices, env and mounts of a lease.
#[allow(clippy::too_many_arguments)]
pub fn resolve(
    lease: &Lease,
    partition: &Partition,
    gpu_minor: u32,
    gpu_uuid: &str,
    minors: &MigMinors,
    cfg: &DevicesConfig,
    pids_limit: u64,
) -> Resolved {
    let (uvm_major, caps_major) = dynamic_majors(cfg);
    let dev = &cfg.dev_root;
    let gpu = partition.gpu;
    let mut devices = vec![
        node(dev, "nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR),
        node(dev, "nvidia-uvm", uvm_major, 0),
        node(
            dev,
            &format!("nvidia{gpu_minor}"),
            NVIDIA_MAJOR,
            i64::from(gpu_minor),
        ),
    ];
    let mut env = BTreeMap::new();
    let mut mounts = Vec::new();
    let mut caps = Vec::new();
    env.insert("TESSERA_LEASE_ID".into(), lease.id.clone());
    env.insert("NVIDIA_VISIBLE_DEVICES".into(), "void".into());
    match &partition.kind {
        PartKind::Mig(m) => {
            let gi = m.gi_id.unwrap_or_default();
            let ci = m.ci_id.unwrap_or_default();
            let gi_minor = minors
                .gi_access
                .get(&(gpu, gi))
                .copied()
                .unwrap_or(3 + gpu * 135 + gi * 9);
            let ci_minor = minors
                .ci_access
                .get(&(gpu, gi, ci))
                .copied()
                .unwrap_or(3 + gpu * 135 + gi * 9 + 1 + ci);
            for minor in [gi_minor, ci_minor] {
                let name = format!("nvidia-caps/nvidia-cap{minor}");
                devices.push(DeviceNode {
                    file_mode: 0o444,
                    permissions: "r".into(),
                    ..node(dev, &name, caps_major, i64::from(minor))
                });
            }
            caps.push(format!("gpu{gpu}/mig/gi{gi}/access"));
            caps.push(format!("gpu{gpu}/mig/gi{gi}/ci{ci}/access"));
            if let Some(uuid) = &m.uuid {
                env.insert("CUDA_VISIBLE_DEVICES".into(), uuid.clone());
            }
        }
        PartKind::Mps(m) => {
            env.insert("CUDA_VISIBLE_DEVICES".into(), gpu_uuid.to_string());
            env.insert(
                "CUDA_MPS_PIPE_DIRECTORY".into(),
                CONTAINER_MPS_PIPE_DIR.to_string(),
            );
            mounts.push(MountSpec {
                source: m.pipe_dir.clone(),
                destination: CONTAINER_MPS_PIPE_DIR.to_string(),
                options: ["rbind", "nosuid", "nodev", "noexec"]
                    .map(String::from)
                    .to_vec(),
            });
        }
        PartKind::WholeGpu => {
            env.insert("CUDA_VISIBLE_DEVICES".into(), gpu_uuid.to_string());
        }
    }
    Resolved {
        lease: lease.clone(),
        partition: partition.clone(),
        devices,
        env,
        mounts,
        visible_gpu_indices: vec![gpu],
        granted_capabilities: caps,
        cgroup_parent: format!("tessera/{}", lease.id),
        pids_limit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn majors_come_from_the_character_section() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n234 nvidia-uvm\n237 nvidia-caps\n\nBlock devices:\n259 blkext\n 8 nvidia-uvm\n";
        assert_eq!(major_from_proc_devices(text, "nvidia-uvm"), Some(234));
        assert_eq!(major_from_proc_devices(text, "nvidia-caps"), Some(237));
        assert_eq!(major_from_proc_devices(text, "nvidia-modeset"), None);
    }
}
