//! The grant: what a container on one or more leases may use (device nodes, variables,
//! mounts, GPUs, driver capabilities, its cgroup parent and pids limit), as the daemon
//! answers `ResolveToken` and as the runtime judges a spec against it. The daemon's
//! answer is checked as it is converted ([`Grant::from_proto`]: fail closed, every path
//! clean); several leases of one container (the runtime) and the partitions of one
//! multi-partition lease (the daemon) are merged by one rule ([`Grant::merge`]).
//!
//! The merge keys device nodes by their *container* path: that is where two leases'
//! nodes can collide, and one container path naming two different nodes is refused;
//! the same node granted twice is kept once with the union of its access. (The host
//! path is not the key: two host paths may not be given one container path, and one
//! host node may appear under two container paths.)

use std::collections::BTreeMap;
use std::path::PathBuf;
use tessera_proto::v1 as pb;
use thiserror::Error;

use crate::contract::LEASE_ID_ENV;

/// Why a daemon's answer, or several leases together, cannot be run on.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GrantError {
    #[error("lease {lease_id} is {state}, not ACTIVE")]
    NotActive { lease_id: String, state: String },
    #[error("lease {lease_id} expired at {expires_at_ms} ms")]
    Expired {
        lease_id: String,
        expires_at_ms: i64,
    },
    #[error("the daemon's answer is not usable: {0}")]
    Invalid(String),
    /// Several leases that cannot be given to one container together.
    #[error("these leases cannot run in one container: {0}")]
    Merge(String),
}

/// A device node the lease grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantDevice {
    pub host_path: PathBuf,
    pub container_path: String,
    /// 'c' or 'b'.
    pub kind: char,
    pub major: i64,
    pub minor: i64,
    /// Device cgroup access, a subset of "rwm".
    pub permissions: String,
    pub file_mode: u32,
}

/// A mount the lease asks for (the MPS pipe directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantMount {
    pub source: String,
    pub destination: String,
    pub options: Vec<String>,
}

/// What the daemon says a token may use.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Grant {
    pub lease_id: String,
    pub tenant: String,
    pub devices: Vec<GrantDevice>,
    pub env: BTreeMap<String, String>,
    pub mounts: Vec<GrantMount>,
    pub visible_gpu_indices: Vec<u32>,
    /// Relative to /proc/driver/nvidia/capabilities, e.g. "gpu0/mig/gi3/access".
    pub granted_capabilities: Vec<String>,
    pub cgroup_parent: String,
    pub pids_limit: u64,
    /// The pod the lease's token is bound to (the first pod that used it), or empty.
    pub pod: String,
}

/// The variables whose values are lists a CUDA program reads in order: joined
/// with `,` across leases.
const JOINED_ENV: [&str; 3] = [
    LEASE_ID_ENV,
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
];

fn clean_abs(p: &str) -> bool {
    p.starts_with('/') && !p.contains('\0') && !p.split('/').any(|c| c == ".." || c == ".")
}

fn invalid(m: String) -> GrantError {
    GrantError::Invalid(m)
}

impl Grant {
    /// Check and convert the daemon's answer. `now_ms` is the current unix time.
    pub fn from_proto(resp: pb::ResolveTokenResponse, now_ms: i64) -> Result<Self, GrantError> {
        let lease = resp
            .lease
            .ok_or_else(|| invalid("no lease in the answer".to_string()))?;
        check_lease(&lease, now_ms)?;
        let tenant = tenant_of(&resp.tenant, &lease.tenant)?;
        let devices = resp
            .devices
            .into_iter()
            .map(device_from_proto)
            .collect::<Result<Vec<_>, _>>()?;
        for k in resp.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(invalid(format!("env name {k:?}")));
            }
        }
        let mounts = resp
            .mounts
            .into_iter()
            .map(mount_from_proto)
            .collect::<Result<Vec<_>, _>>()?;
        for c in &resp.granted_capabilities {
            if c.is_empty() || c.starts_with('/') || c.split('/').any(|p| p == ".." || p.is_empty())
            {
                return Err(invalid(format!("capability path {c:?}")));
            }
        }
        Ok(Self {
            pod: lease.pod,
            lease_id: lease.id,
            tenant,
            devices,
            env: resp.env.into_iter().collect(),
            mounts,
            visible_gpu_indices: resp.visible_gpu_indices,
            granted_capabilities: resp.granted_capabilities,
            cgroup_parent: resp.cgroup_parent,
            pids_limit: resp.pids_limit,
        })
    }

    /// The grant as the daemon answers it, for `lease` (whose id, tenant and pod it
    /// should carry).
    pub fn to_proto(&self, lease: pb::Lease) -> pb::ResolveTokenResponse {
        pb::ResolveTokenResponse {
            lease: Some(lease),
            tenant: self.tenant.clone(),
            devices: self.devices.iter().map(device_to_proto).collect(),
            env: self.env.clone().into_iter().collect(),
            mounts: self
                .mounts
                .iter()
                .map(|m| pb::Mount {
                    source: m.source.clone(),
                    destination: m.destination.clone(),
                    r#type: "bind".into(),
                    options: m.options.clone(),
                })
                .collect(),
            visible_gpu_indices: self.visible_gpu_indices.clone(),
            granted_capabilities: self.granted_capabilities.clone(),
            cgroup_parent: self.cgroup_parent.clone(),
            pids_limit: self.pids_limit,
            bind_checks_resolution: true,
        }
    }

    /// What a container running on every one of `leases` (in order) may use: the
    /// devices (each container path once), device-cgroup rules, capabilities and GPUs
    /// (their indices sorted) of all, `CUDA_VISIBLE_DEVICES` and
    /// `NVIDIA_VISIBLE_DEVICES` joined in order, and the lease ids joined with `,`,
    /// each once. The runtime merges the leases of several tokens with it, the
    /// daemon the partitions of one multi-partition lease (one grant per partition,
    /// all of one lease id). One lease is returned unchanged. Refused: leases
    /// of different tenants, more than one MPS share (a process has one
    /// `CUDA_MPS_PIPE_DIRECTORY`), one container path naming different device nodes,
    /// and another variable set to different values.
    pub fn merge(leases: Vec<Grant>) -> Result<Grant, GrantError> {
        let bad = |m: String| GrantError::Merge(m);
        let mps = leases
            .iter()
            .filter(|l| l.env.contains_key("CUDA_MPS_PIPE_DIRECTORY") || !l.mounts.is_empty())
            .count();
        if leases.len() > 1 && mps > 1 {
            return Err(bad(format!(
                "CUDA_MPS_PIPE_DIRECTORY: {mps} of the leases are MPS shares and a container can use one MPS server"
            )));
        }
        let mut it = leases.into_iter();
        let mut out = it
            .next()
            .ok_or_else(|| bad("no lease to run on".to_string()))?;
        let several = it.len() > 0;
        for l in it {
            out.add(l)?;
        }
        if several {
            out.visible_gpu_indices.sort_unstable();
        }
        // The container's cgroup goes under the first lease's parent; every lease is
        // bound to that cgroup, so revoking any of them stops the container.
        Ok(out)
    }

    /// Add lease `l` to this grant (see [`Grant::merge`]).
    fn add(&mut self, l: Grant) -> Result<(), GrantError> {
        if l.tenant != self.tenant {
            return Err(GrantError::Merge(format!(
                "tenant: lease {} belongs to {} and lease {} to {}",
                self.lease_id, self.tenant, l.lease_id, l.tenant
            )));
        }
        for d in l.devices {
            self.add_device(d, &l.lease_id)?;
        }
        for (k, v) in l.env {
            self.add_env(k, v, &l.lease_id)?;
        }
        self.mounts.extend(l.mounts);
        union(&mut self.visible_gpu_indices, l.visible_gpu_indices);
        union(&mut self.granted_capabilities, l.granted_capabilities);
        self.pids_limit = match (self.pids_limit, l.pids_limit) {
            (0, b) => b,
            (a, 0) => a,
            (a, b) => a.min(b),
        };
        if !self.lease_id.split(',').any(|id| id == l.lease_id) {
            self.lease_id = format!("{},{}", self.lease_id, l.lease_id);
        }
        Ok(())
    }

    fn add_device(&mut self, d: GrantDevice, lease_id: &str) -> Result<(), GrantError> {
        match self
            .devices
            .iter_mut()
            .find(|o| o.container_path == d.container_path)
        {
            None => self.devices.push(d),
            Some(o) if (o.kind, o.major, o.minor) != (d.kind, d.major, d.minor) => {
                return Err(GrantError::Merge(format!(
                    "devices: {} is {}:{} for one lease and {}:{} for lease {lease_id}",
                    d.container_path, o.major, o.minor, d.major, d.minor
                )));
            }
            Some(o) => {
                // The same node: the union of what the leases allow.
                for c in d.permissions.chars() {
                    if !o.permissions.contains(c) {
                        o.permissions.push(c);
                    }
                }
                o.file_mode |= d.file_mode;
            }
        }
        Ok(())
    }

    fn add_env(&mut self, k: String, v: String, lease_id: &str) -> Result<(), GrantError> {
        match self.env.get_mut(&k) {
            None => {
                self.env.insert(k, v);
            }
            Some(o) if *o == v => {}
            Some(o) if JOINED_ENV.contains(&k.as_str()) => {
                if !o.split(',').any(|x| x == v) {
                    o.push(',');
                    o.push_str(&v);
                }
            }
            Some(o) => {
                return Err(GrantError::Merge(format!(
                    "env {k}: {o:?} for one lease and {v:?} for lease {lease_id}"
                )));
            }
        }
        Ok(())
    }
}

/// Append the items of `more` that `out` lacks, in order.
fn union<T: PartialEq>(out: &mut Vec<T>, more: Vec<T>) {
    for x in more {
        if !out.contains(&x) {
            out.push(x);
        }
    }
}

/// The lease is ACTIVE, not expired, and has an id.
fn check_lease(lease: &pb::Lease, now_ms: i64) -> Result<(), GrantError> {
    let state = pb::LeaseState::try_from(lease.state).unwrap_or(pb::LeaseState::Unspecified);
    if state != pb::LeaseState::Active {
        return Err(GrantError::NotActive {
            lease_id: lease.id.clone(),
            state: state
                .as_str_name()
                .trim_start_matches("LEASE_STATE_")
                .to_string(),
        });
    }
    if lease.expires_at_ms > 0 && lease.expires_at_ms <= now_ms {
        return Err(GrantError::Expired {
            lease_id: lease.id.clone(),
            expires_at_ms: lease.expires_at_ms,
        });
    }
    if lease.id.is_empty() {
        return Err(invalid("the lease has no id".to_string()));
    }
    Ok(())
}

/// The tenant, as the answer and its lease agree on it.
fn tenant_of(answer: &str, lease: &str) -> Result<String, GrantError> {
    match (answer, lease) {
        ("", "") => Err(invalid("the lease has no tenant".to_string())),
        (a, b) if !a.is_empty() && !b.is_empty() && a != b => Err(invalid(format!(
            "tenant {a:?} differs from the lease's {b:?}"
        ))),
        (a, b) => Ok(if a.is_empty() { b } else { a }.to_string()),
    }
}

/// A device node of the answer: a character or block device, clean /dev paths,
/// numbers and access as a devices cgroup takes them.
fn device_from_proto(d: pb::DeviceNode) -> Result<GrantDevice, GrantError> {
    let kind = match d.r#type.as_str() {
        "c" => 'c',
        "b" => 'b',
        t => return Err(invalid(format!("device {} has type {t:?}", d.host_path))),
    };
    if !clean_abs(&d.host_path)
        || !clean_abs(&d.container_path)
        || !d.container_path.starts_with("/dev/")
    {
        return Err(invalid(format!(
            "device {} -> {} is not a clean /dev path",
            d.host_path, d.container_path
        )));
    }
    if d.major < 0 || d.minor < 0 {
        return Err(invalid(format!(
            "device {} has a negative number",
            d.host_path
        )));
    }
    let perms = if d.permissions.is_empty() {
        "rw".to_string()
    } else {
        d.permissions
    };
    if !perms.chars().all(|c| "rwm".contains(c)) {
        return Err(invalid(format!(
            "device {} has permissions {perms:?}",
            d.host_path
        )));
    }
    Ok(GrantDevice {
        host_path: PathBuf::from(d.host_path),
        container_path: d.container_path,
        kind,
        major: d.major,
        minor: d.minor,
        permissions: perms,
        file_mode: if d.file_mode == 0 {
            0o666
        } else {
            d.file_mode & 0o777
        },
    })
}

fn device_to_proto(d: &GrantDevice) -> pb::DeviceNode {
    pb::DeviceNode {
        host_path: d.host_path.display().to_string(),
        container_path: d.container_path.clone(),
        r#type: d.kind.to_string(),
        major: d.major,
        minor: d.minor,
        permissions: d.permissions.clone(),
        file_mode: d.file_mode,
    }
}

/// A mount of the answer: a bind mount between clean absolute paths.
fn mount_from_proto(m: pb::Mount) -> Result<GrantMount, GrantError> {
    if !(m.r#type.is_empty() || m.r#type == "bind") {
        return Err(invalid(format!(
            "mount {} has type {:?}",
            m.destination, m.r#type
        )));
    }
    if !clean_abs(&m.source) || !clean_abs(&m.destination) {
        return Err(invalid(format!(
            "mount {} -> {} is not a clean absolute path",
            m.source, m.destination
        )));
    }
    Ok(GrantMount {
        source: m.source,
        destination: m.destination,
        options: m.options,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_survives_its_conversion_to_the_answer_and_back() {
        let g = Grant {
            lease_id: "l1".into(),
            tenant: "acme".into(),
            devices: vec![GrantDevice {
                host_path: "/dev/nvidia0".into(),
                container_path: "/dev/nvidia0".into(),
                kind: 'c',
                major: 195,
                minor: 0,
                permissions: "rw".into(),
                file_mode: 0o666,
            }],
            env: [(LEASE_ID_ENV.to_string(), "l1".to_string())].into(),
            mounts: vec![GrantMount {
                source: "/run/tessera/mps/l1".into(),
                destination: "/run/nvidia-mps".into(),
                options: vec!["rbind".into()],
            }],
            visible_gpu_indices: vec![0],
            granted_capabilities: vec!["gpu0/mig/gi1/access".into()],
            cgroup_parent: "/tessera/l1".into(),
            pids_limit: 64,
            pod: "uid-1".into(),
        };
        let lease = pb::Lease {
            id: "l1".into(),
            tenant: "acme".into(),
            pod: "uid-1".into(),
            state: pb::LeaseState::Active as i32,
            ..Default::default()
        };
        assert_eq!(Grant::from_proto(g.to_proto(lease), 1_000).unwrap(), g);
    }

    /// A multi-partition lease: one grant per partition, all of one lease id.
    #[test]
    fn the_partitions_of_one_lease_merge_with_its_id_once_and_gpus_sorted() {
        let part = |gpu: u32, uuid: &str| Grant {
            lease_id: "l1".into(),
            tenant: "acme".into(),
            devices: vec![GrantDevice {
                host_path: format!("/dev/nvidia{gpu}").into(),
                container_path: format!("/dev/nvidia{gpu}"),
                kind: 'c',
                major: 195,
                minor: i64::from(gpu),
                permissions: "rw".into(),
                file_mode: 0o666,
            }],
            env: [
                (LEASE_ID_ENV.to_string(), "l1".to_string()),
                ("CUDA_VISIBLE_DEVICES".to_string(), uuid.to_string()),
            ]
            .into(),
            visible_gpu_indices: vec![gpu],
            cgroup_parent: "tessera/l1".into(),
            ..Grant::default()
        };
        let m = Grant::merge(vec![part(3, "GPU-d"), part(1, "GPU-b"), part(3, "GPU-d")]).unwrap();
        assert_eq!(m.lease_id, "l1");
        assert_eq!(m.env[LEASE_ID_ENV], "l1");
        assert_eq!(m.env["CUDA_VISIBLE_DEVICES"], "GPU-d,GPU-b");
        assert_eq!(m.visible_gpu_indices, [1, 3]);
        assert_eq!(m.devices.len(), 2);
    }
}
