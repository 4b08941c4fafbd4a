//! What a container on a lease needs: device nodes, env, mounts (ResolveToken).

use std::collections::BTreeMap;
use std::path::Path;

use tessera_common::contract::LEASE_ID_ENV;
use tessera_common::grant::{Grant, GrantDevice, GrantError, GrantMount};

use crate::config::DevicesConfig;
use crate::gpu::MigMinors;

use crate::model::{Lease, MpsPart, PartKind, Partition};

/// Major of /dev/nvidia<N>, /dev/nvidiactl.
pub const NVIDIA_MAJOR: i64 = 195;
pub const NVIDIACTL_MINOR: i64 = 255;
/// Majors the simulator reports when /proc/devices has no NVIDIA entries.
pub const SIM_UVM_MAJOR: i64 = 510;
pub const SIM_CAPS_MAJOR: i64 = 511;
/// Where the lease's MPS pipe directory appears inside the container.
pub const CONTAINER_MPS_PIPE_DIR: &str = "/run/nvidia-mps";

/// Everything the runtime needs for one lease: the lease, its partitions and the
/// grant (`tessera_common::grant::Grant`, the type the runtime judges a spec
/// against), answered to ResolveToken through [`Grant::to_proto`].
#[derive(Debug, Clone)]
pub struct Resolved {
    pub lease: Lease,
    pub partition: Partition,
    /// A multi-partition lease: its partitions after the first (their devices are
    /// in the grant too).
    pub more_partitions: Vec<Partition>,
    pub grant: Grant,
}

/// Why a lease's device nodes cannot be described on this host.
#[derive(Debug, thiserror::Error)]
pub enum DevicesError {
    #[error(
        "the {driver} driver has no major number in /proc/devices (is the NVIDIA driver loaded?); \
         set devices.{key} in tesserad.toml to name it"
    )]
    MajorUnknown {
        driver: &'static str,
        key: &'static str,
    },
}

/// The majors of nvidia-uvm and nvidia-caps: from the config, else from
/// `/proc/devices` text. Only the simulator, whose devices the kernel never
/// registered, falls back to fixed majors; on real hardware a missing one is an
/// error naming the config key, never a guess.
pub fn dynamic_majors(
    cfg: &DevicesConfig,
    proc_devices: &str,
    simulated: bool,
) -> Result<(i64, i64), DevicesError> {
    let find = |configured: Option<u32>, driver: &'static str, key: &'static str, sim: i64| {
        configured
            .map(i64::from)
            .or_else(|| tessera_common::procdevices::major_of(proc_devices, driver))
            .or(simulated.then_some(sim))
            .ok_or(DevicesError::MajorUnknown { driver, key })
    };
    Ok((
        find(
            cfg.nvidia_uvm_major,
            "nvidia-uvm",
            "nvidia_uvm_major",
            SIM_UVM_MAJOR,
        )?,
        find(
            cfg.nvidia_caps_major,
            "nvidia-caps",
            "nvidia_caps_major",
            SIM_CAPS_MAJOR,
        )?,
    ))
}

fn node(dev_root: &Path, name: &str, major: i64, minor: i64) -> GrantDevice {
    GrantDevice {
        host_path: dev_root.join(name),
        container_path: format!("/dev/{name}"),
        kind: 'c',
        major,
        minor,
        permissions: "rw".into(),
        file_mode: 0o666,
    }
}

/// An MPS client's side: the pipe directory (mounted) and, for a shared server,
/// the lease's limits as client env.
fn mps_client(m: &MpsPart, env: &mut BTreeMap<String, String>, mounts: &mut Vec<GrantMount>) {
    env.insert(
        "CUDA_MPS_PIPE_DIRECTORY".into(),
        CONTAINER_MPS_PIPE_DIR.to_string(),
    );
    if m.mode == crate::gpu::MpsMode::Shared {
        // The shared server has no daemon-side limits: each lease's are the
        // client's, which can only tighten the server's (so its own process could
        // raise them back up to the whole device).
        env.insert(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(),
            m.sm_percent.to_string(),
        );
        env.insert(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(),
            format!("0={}M", (m.memory_bytes >> 20).max(1)),
        );
    }
    mounts.push(GrantMount {
        source: m.pipe_dir.display().to_string(),
        destination: CONTAINER_MPS_PIPE_DIR.to_string(),
        options: ["rbind", "nosuid", "nodev", "noexec"]
            .map(String::from)
            .to_vec(),
    });
}

/// MPS inside MIG: what a share's container gets is its host instance's devices
/// (resolved as `host`) plus the share's MPS client side; the share stays the
/// lease's partition.
pub fn add_mps_share(resolved: &mut Resolved, share: &Partition) {
    if let PartKind::Mps(m) = &share.kind {
        mps_client(m, &mut resolved.grant.env, &mut resolved.grant.mounts);
    }
    resolved.partition = share.clone();
}

/// A multi-partition lease: the grants of each partition (`each`, in the lease's
/// order, as [`resolve`] built them) in one answer, by the one merge of
/// [`Grant::merge`]: device nodes shared by them (`nvidiactl`, `nvidia-uvm`, a GPU
/// holding several of its instances) appear once, `CUDA_VISIBLE_DEVICES` lists
/// every partition's UUID in order (so the container sees all of them and only
/// them), the GPU indices sorted, the lease id once. None when `each` is empty.
pub fn merge_several(each: Vec<Resolved>) -> Result<Option<Resolved>, GrantError> {
    let mut it = each.into_iter();
    let Some(mut out) = it.next() else {
        return Ok(None);
    };
    let mut grants = vec![std::mem::take(&mut out.grant)];
    for r in it {
        grants.push(r.grant);
        out.more_partitions.push(r.partition);
    }
    out.grant = Grant::merge(grants)?;
    Ok(Some(out))
}

/// A MIG instance's access: the read-only capability nodes of its GI and CI (their
/// minors as the driver numbers them, else as it would) and the capabilities
/// granted.
fn mig_access(
    dev: &Path,
    gpu: u32,
    m: &crate::model::MigPart,
    minors: &MigMinors,
    caps_major: i64,
) -> (Vec<GrantDevice>, Vec<String>) {
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
    let nodes = [gi_minor, ci_minor]
        .into_iter()
        .map(|minor| {
            let name = format!("nvidia-caps/nvidia-cap{minor}");
            GrantDevice {
                file_mode: 0o444,
                permissions: "r".into(),
                ..node(dev, &name, caps_major, i64::from(minor))
            }
        })
        .collect();
    let access = vec![
        format!("gpu{gpu}/mig/gi{gi}/access"),
        format!("gpu{gpu}/mig/gi{gi}/ci{ci}/access"),
    ];
    (nodes, access)
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
    (uvm_major, caps_major): (i64, i64),
    pids_limit: u64,
) -> Resolved {
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
    env.insert(LEASE_ID_ENV.into(), lease.id.clone());
    env.insert("NVIDIA_VISIBLE_DEVICES".into(), "void".into());
    match &partition.kind {
        PartKind::Mig(m) => {
            let (nodes, access) = mig_access(dev, gpu, m, minors, caps_major);
            devices.extend(nodes);
            caps.extend(access);
            if let Some(uuid) = &m.uuid {
                env.insert("CUDA_VISIBLE_DEVICES".into(), uuid.clone());
            }
        }
        PartKind::Mps(m) => {
            env.insert("CUDA_VISIBLE_DEVICES".into(), gpu_uuid.to_string());
            mps_client(m, &mut env, &mut mounts);
        }
        PartKind::WholeGpu => {
            env.insert("CUDA_VISIBLE_DEVICES".into(), gpu_uuid.to_string());
        }
    }
    Resolved {
        lease: lease.clone(),
        partition: partition.clone(),
        more_partitions: Vec::new(),
        grant: Grant {
            lease_id: lease.id.clone(),
            tenant: lease.tenant.clone(),
            devices,
            env,
            mounts,
            visible_gpu_indices: vec![gpu],
            granted_capabilities: caps,
            cgroup_parent: format!("tessera/{}", lease.id),
            pids_limit,
            pod: lease.pod.clone().unwrap_or_default(),
        },
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn cfg(uvm: Option<u32>) -> DevicesConfig {
        DevicesConfig {
            dev_root: "/dev".into(),
            nvidia_uvm_major: uvm,
            nvidia_caps_major: None,
        }
    }

    const PROC: &str = "Character devices:\n195 nvidia\n234 nvidia-uvm\n237 nvidia-caps\n";

    #[test]
    fn majors_come_from_config_then_proc_devices() {
        assert_eq!(dynamic_majors(&cfg(None), PROC, false).unwrap(), (234, 237));
        assert_eq!(
            dynamic_majors(&cfg(Some(300)), PROC, false).unwrap(),
            (300, 237)
        );
    }

    #[test]
    fn only_the_simulator_falls_back_to_fixed_majors() {
        let none = "Character devices:\n  1 mem\n";
        assert_eq!(
            dynamic_majors(&cfg(None), none, true).unwrap(),
            (SIM_UVM_MAJOR, SIM_CAPS_MAJOR)
        );
        let e = dynamic_majors(&cfg(None), none, false).unwrap_err();
        assert!(e.to_string().contains("devices.nvidia_uvm_major"), "{e}");
    }
}
