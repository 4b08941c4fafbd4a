//! Conversions between domain types and the generated protobuf types.

use tessera_proto::v1 as pb;
use tonic::Status;

use crate::lease::devices::Resolved;
use crate::lease::{CreateRequest, EventKind, GpuReport, LeaseError, LeaseEvent, LeaseLinks};
use crate::model::{Lease, LeaseState, PartKind, Partition};
use crate::partition::topology::TopologyConstraint;
use crate::partition::{MpsMode, Shape};

/// Map a domain error to a precise gRPC status with its rich details
/// ([`super::errors::status_of`]). Internal details of hardware or storage failures
/// are kept (operators need them) but never include tokens.
pub fn status(e: LeaseError) -> Status {
    super::errors::status_of(e)
}

pub fn shape_from_pb(s: Option<pb::Shape>, default_mps: MpsMode) -> Result<Option<Shape>, Status> {
    let Some(s) = s else { return Ok(None) };
    Ok(match s.kind {
        None => None,
        Some(pb::shape::Kind::Mig(m)) => {
            if m.profile.is_empty() || m.profile.len() > 64 {
                return Err(Status::invalid_argument(
                    "invalid shape.mig.profile: must be a profile name like \"1g.10gb\"",
                ));
            }
            if m.compute_profile.len() > 64 {
                return Err(Status::invalid_argument(
                    "invalid shape.mig.compute_profile: too long",
                ));
            }
            Some(Shape::Mig {
                profile: m.profile,
                compute_profile: (!m.compute_profile.is_empty()).then_some(m.compute_profile),
            })
        }
        Some(pb::shape::Kind::Mps(m)) if !m.mig_profile.is_empty() => {
            if m.mig_profile.len() > 64 {
                return Err(Status::invalid_argument(
                    "invalid shape.mps.mig_profile: too long",
                ));
            }
            // The instance's one server is shared by its shares.
            if m.mode == pb::MpsMode::Isolated as i32 {
                return Err(Status::invalid_argument(
                    "invalid shape.mps.mode: an MPS share inside MIG runs on its instance's one MPS server (shared); isolated applies to whole GPUs",
                ));
            }
            mps_mode_from_pb(m.mode, default_mps, "shape.mps.mode")?;
            Some(Shape::MigMps {
                profile: m.mig_profile,
                sm_percent: m.sm_percent,
                memory_bytes: m.memory_bytes,
            })
        }
        Some(pb::shape::Kind::Mps(m)) => Some(Shape::Mps {
            sm_percent: m.sm_percent,
            memory_bytes: m.memory_bytes,
            mode: mps_mode_from_pb(m.mode, default_mps, "shape.mps.mode")?,
        }),
        Some(pb::shape::Kind::WholeGpu(_)) => Some(Shape::WholeGpu),
        // Resolved by the lease core (create_request_from_pb carries it).
        Some(pb::shape::Kind::Need(_)) => None,
    })
}

/// The need of a shape that asks by need.
pub fn need_from_pb(
    s: Option<&pb::Shape>,
    default_mps: MpsMode,
) -> Result<Option<crate::lease::Need>, Status> {
    use crate::lease::{Isolation, Need};
    let Some(pb::shape::Kind::Need(n)) = s.and_then(|s| s.kind.as_ref()) else {
        return Ok(None);
    };
    let isolation = match pb::Isolation::try_from(n.isolation) {
        Ok(pb::Isolation::Unspecified | pb::Isolation::Hardware) => Isolation::Hardware,
        Ok(pb::Isolation::Shared) => Isolation::Shared,
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "invalid shape.need.isolation: unknown value {}",
                n.isolation
            )));
        }
    };
    Ok(Some(Need {
        memory_bytes: n.memory_bytes,
        isolation,
        mps_mode: mps_mode_from_pb(n.mps_mode, default_mps, "shape.need.mps_mode")?,
    }))
}

/// An MPS mode on the wire; unspecified is the configured default.
pub fn mps_mode_from_pb(mode: i32, default_mps: MpsMode, field: &str) -> Result<MpsMode, Status> {
    match pb::MpsMode::try_from(mode) {
        Ok(pb::MpsMode::Unspecified) => Ok(default_mps),
        Ok(pb::MpsMode::Isolated) => Ok(MpsMode::Isolated),
        Ok(pb::MpsMode::Shared) => Ok(MpsMode::Shared),
        Err(_) => Err(Status::invalid_argument(format!(
            "invalid {field}: unknown value {mode}"
        ))),
    }
}

pub fn mps_mode_to_pb(mode: MpsMode) -> pb::MpsMode {
    match mode {
        MpsMode::Isolated => pb::MpsMode::Isolated,
        MpsMode::Shared => pb::MpsMode::Shared,
    }
}

/// A CreateLease request as the manager takes it: the shape's strings are checked
/// here ([`shape_from_pb`]), everything else by
/// [`crate::lease::validate_create`]. Empty strings and a zero TTL mean
/// "not given".
pub fn create_request_from_pb(
    r: pb::CreateLeaseRequest,
    default_mps: MpsMode,
) -> Result<CreateRequest, Status> {
    let need = need_from_pb(r.shape.as_ref(), default_mps)?;
    let count = count_from_pb(r.shape.as_ref());
    let topology = topology_from_pb(r.topology)?;
    let shape = shape_from_pb(r.shape, default_mps)?;
    let non_empty = |s: String| (!s.is_empty()).then_some(s);
    Ok(CreateRequest {
        tenant: r.tenant,
        shape,
        ttl: (r.ttl_seconds > 0).then(|| std::time::Duration::from_secs(r.ttl_seconds)),
        request_id: non_empty(r.request_id),
        labels: r.labels.into_iter().collect(),
        priority_class: non_empty(r.priority_class),
        gpu_index: r.gpu_index,
        need,
        count,
        topology,
        // The API has no exact placement (the DRA driver's, in-process).
        exact: None,
    })
}

/// How many partitions a shape asks for (`count` on the MIG or whole-GPU shape;
/// 0 means 1). Its range is checked by the lease core.
pub fn count_from_pb(s: Option<&pb::Shape>) -> u32 {
    match s.and_then(|s| s.kind.as_ref()) {
        Some(pb::shape::Kind::Mig(m)) => m.count,
        Some(pb::shape::Kind::WholeGpu(w)) => w.count,
        _ => 0,
    }
}

/// A topology constraint on the wire; unspecified is `any`.
pub fn topology_from_pb(v: i32) -> Result<TopologyConstraint, Status> {
    match pb::TopologyConstraint::try_from(v) {
        Ok(pb::TopologyConstraint::Unspecified | pb::TopologyConstraint::Any) => {
            Ok(TopologyConstraint::Any)
        }
        Ok(pb::TopologyConstraint::Numa) => Ok(TopologyConstraint::Numa),
        Ok(pb::TopologyConstraint::Nvlink) => Ok(TopologyConstraint::Nvlink),
        Err(_) => Err(Status::invalid_argument(format!(
            "invalid topology: unknown value {v}"
        ))),
    }
}

/// A multi-partition lease's every partition and how their GPUs connect.
pub fn add_partitions(out: &mut pb::Lease, parts: &[Partition], links: Option<&LeaseLinks>) {
    if !parts.is_empty() {
        out.partitions = parts.iter().map(partition_to_pb).collect();
        if out.partition.is_none() {
            out.partition = out.partitions.first().cloned();
        }
    }
    out.topology = links.map(|l| pb::LeaseTopology {
        gpu_indices: l.gpus.clone(),
        worst_level: l.worst_level.as_str().to_string(),
        min_nvlinks: l.min_nvlinks,
    });
}

pub fn shape_to_pb(s: &Shape) -> pb::Shape {
    let kind = match s {
        Shape::Mig {
            profile,
            compute_profile,
        } => pb::shape::Kind::Mig(pb::MigShape {
            profile: profile.clone(),
            compute_profile: compute_profile.clone().unwrap_or_default(),
            count: 0,
        }),
        Shape::Mps {
            sm_percent,
            memory_bytes,
            mode,
        } => pb::shape::Kind::Mps(pb::MpsShape {
            sm_percent: *sm_percent,
            memory_bytes: *memory_bytes,
            mode: mps_mode_to_pb(*mode) as i32,
            mig_profile: String::new(),
        }),
        Shape::MigMps {
            profile,
            sm_percent,
            memory_bytes,
        } => pb::shape::Kind::Mps(pb::MpsShape {
            sm_percent: *sm_percent,
            memory_bytes: *memory_bytes,
            mode: pb::MpsMode::Shared as i32,
            mig_profile: profile.clone(),
        }),
        Shape::WholeGpu => pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count: 0 }),
    };
    pb::Shape { kind: Some(kind) }
}

pub fn state_to_pb(s: LeaseState) -> pb::LeaseState {
    match s {
        LeaseState::Pending => pb::LeaseState::Pending,
        LeaseState::Active => pb::LeaseState::Active,
        LeaseState::Revoking => pb::LeaseState::Revoking,
        LeaseState::Released => pb::LeaseState::Released,
        LeaseState::Expired => pb::LeaseState::Expired,
        LeaseState::Revoked => pb::LeaseState::Revoked,
        LeaseState::Failed => pb::LeaseState::Failed,
    }
}

/// None for UNSPECIFIED; Err for values this daemon does not know.
pub fn state_from_pb(v: i32) -> Result<Option<LeaseState>, Status> {
    let s = pb::LeaseState::try_from(v)
        .map_err(|_| Status::invalid_argument(format!("invalid state: unknown value {v}")))?;
    Ok(match s {
        pb::LeaseState::Unspecified => None,
        pb::LeaseState::Pending => Some(LeaseState::Pending),
        pb::LeaseState::Active => Some(LeaseState::Active),
        pb::LeaseState::Revoking => Some(LeaseState::Revoking),
        pb::LeaseState::Released => Some(LeaseState::Released),
        pb::LeaseState::Expired => Some(LeaseState::Expired),
        pb::LeaseState::Revoked => Some(LeaseState::Revoked),
        pb::LeaseState::Failed => Some(LeaseState::Failed),
    })
}

pub fn partition_to_pb(p: &Partition) -> pb::Partition {
    let mut out = pb::Partition {
        id: p.id.clone(),
        gpu_index: p.gpu,
        gpu_uuid: p.gpu_uuid.clone(),
        lease_id: p.lease_id.clone().unwrap_or_default(),
        origin: match p.origin {
            crate::model::Origin::Static => "static".into(),
            crate::model::Origin::Dynamic => "dynamic".into(),
        },
        state: match p.state {
            crate::model::PartitionState::Creating => "creating",
            crate::model::PartitionState::Ready => "ready",
            crate::model::PartitionState::Destroying => "destroying",
        }
        .into(),
        ..Default::default()
    };
    match &p.kind {
        PartKind::Mig(m) => {
            out.kind = pb::PartitionKind::Mig as i32;
            out.mig = Some(pb::MigPartition {
                profile: m.profile.clone(),
                gi_profile_id: m.gi_profile_id,
                placement_start: m.placement.start,
                placement_size: m.placement.size,
                gi_id: m.gi_id.unwrap_or_default(),
                ci_id: m.ci_id.unwrap_or_default(),
                compute_profile: m.compute_profile.clone().unwrap_or_default(),
                mig_uuid: m.uuid.clone().unwrap_or_default(),
                memory_bytes: m.memory_bytes,
                sm_count: m.sm_count,
                mps_host_tenant: m.mps_host.clone().unwrap_or_default(),
            });
        }
        PartKind::Mps(m) => {
            out.kind = pb::PartitionKind::Mps as i32;
            out.mps = Some(pb::MpsPartition {
                sm_percent: m.sm_percent,
                memory_bytes: m.memory_bytes,
                pipe_dir: m.pipe_dir.display().to_string(),
                log_dir: m.log_dir.display().to_string(),
                mode: mps_mode_to_pb(m.mode) as i32,
                mig_host: m.host.clone().unwrap_or_default(),
            });
        }
        PartKind::WholeGpu => out.kind = pb::PartitionKind::WholeGpu as i32,
    }
    out
}

/// A lease on the wire with its (first) partition; a multi-partition lease's
/// others are added by [`add_partitions`]. The shape carries the lease's count.
pub fn lease_to_pb(l: &Lease, p: Option<&Partition>) -> pb::Lease {
    let mut shape = shape_to_pb(&l.shape);
    let n = l.partition_count();
    if n > 1 {
        match &mut shape.kind {
            Some(pb::shape::Kind::Mig(m)) => m.count = n,
            Some(pb::shape::Kind::WholeGpu(w)) => w.count = n,
            _ => {}
        }
    }
    pb::Lease {
        id: l.id.clone(),
        tenant: l.tenant.clone(),
        state: state_to_pb(l.state()) as i32,
        shape: Some(shape),
        partition: p.map(partition_to_pb),
        created_at_ms: l.created_at_ms,
        expires_at_ms: l.expires_at_ms,
        ttl_seconds: l.ttl_secs,
        request_id: l.request_id.clone().unwrap_or_default(),
        labels: l.labels.clone().into_iter().collect(),
        containers: l
            .containers
            .iter()
            .map(|c| pb::Container {
                id: c.id.clone(),
                cgroup_path: c.cgroup_path.clone(),
                runtime_root: c.runtime_root.clone(),
                bound_at_ms: c.bound_at_ms,
                termination_log_path: c.termination_log.clone(),
                pod: c.pod.clone(),
            })
            .collect(),
        priority_class: l.priority_class.clone(),
        burst: l.burst,
        end_reason: l.end_reason().unwrap_or_default().to_string(),
        ended_at_ms: l.ended_at_ms().unwrap_or_default(),
        unhealthy: l.unhealthy.clone().unwrap_or_default(),
        pod: l.pod.clone().unwrap_or_default(),
        partitions: p.map(partition_to_pb).into_iter().collect(),
        topology: None,
    }
}

pub fn event_to_pb(e: &LeaseEvent) -> pb::LeaseEvent {
    let kind = match e.kind {
        EventKind::Created => pb::LeaseEventKind::Created,
        EventKind::Renewed => pb::LeaseEventKind::Renewed,
        EventKind::Expiring => pb::LeaseEventKind::Expiring,
        EventKind::Released => pb::LeaseEventKind::Released,
        EventKind::Revoked => pb::LeaseEventKind::Revoked,
        EventKind::Revoking => pb::LeaseEventKind::Revoking,
        EventKind::Preempting => pb::LeaseEventKind::Preempting,
        EventKind::ContainerBound => pb::LeaseEventKind::ContainerBound,
        EventKind::ContainerUnbound => pb::LeaseEventKind::ContainerUnbound,
        EventKind::MpsRestarted => pb::LeaseEventKind::MpsRestarted,
        EventKind::Unhealthy => pb::LeaseEventKind::Unhealthy,
        EventKind::Healthy => pb::LeaseEventKind::Healthy,
        EventKind::Moved => pb::LeaseEventKind::Moved,
    };
    pb::LeaseEvent {
        kind: kind as i32,
        lease: Some(lease_to_pb(&e.lease, e.partition.as_ref())),
        at_ms: e.at_ms,
        message: e.message.clone(),
        revision: e.revision,
    }
}

pub fn gpu_to_pb(g: &GpuReport) -> pb::Gpu {
    pb::Gpu {
        index: g.info.index,
        uuid: g.info.uuid.clone(),
        name: g.info.name.clone(),
        memory_bytes: g.info.memory_bytes,
        minor: g.info.minor,
        pci_bus_id: g.info.pci_bus_id.clone(),
        mig_enabled: g.info.mig_current,
        mig_pending: g.info.mig_pending,
        sm_count: g.info.sm_count,
        profiles: g
            .profiles
            .iter()
            .map(|(p, free)| pb::ProfileCapacity {
                profile: p.name.clone(),
                gi_profile_id: p.id,
                slices: p.slices,
                memory_bytes: p.memory_bytes,
                sm_count: p.sm_count,
                free: *free,
                max_count: p.max_count,
            })
            .collect(),
        mps_sm_percent_used: g.mps_sm_percent_used,
        mps_memory_bytes_used: g.mps_memory_used,
        whole_leased: g.whole_leased,
        partitions: g.partitions.iter().map(partition_to_pb).collect(),
        free_slices: g.free_slices,
        healthy: g.health.is_none(),
        health: g
            .health
            .as_ref()
            .map(|m| m.cause.to_string())
            .unwrap_or_default(),
        unhealthy_since_ms: g.health.as_ref().map_or(0, |m| m.since_ms),
        mps_mode: g.mps_mode.map_or(pb::MpsMode::Unspecified, mps_mode_to_pb) as i32,
        mps_servers: g.mps_servers,
        mps_time_slice_percent: g.mps_time_slice_percent,
        peers: g
            .links
            .iter()
            .map(|(index, l)| pb::GpuPeer {
                index: *index,
                level: l.level.as_str().to_owned(),
                nvlinks: l.nvlinks,
            })
            .collect(),
        unhealthy_instances: g
            .unhealthy_instances
            .iter()
            .map(|m| pb::InstanceHealth {
                gi_id: m.gi_id.unwrap_or_default(),
                health: m.cause.to_string(),
                since_ms: m.since_ms,
            })
            .collect(),
    }
}

/// The answer to ResolveToken: the grant's own conversion, with the lease (all its
/// partitions for a multi-partition lease).
pub fn resolved_to_pb(r: &Resolved) -> pb::ResolveTokenResponse {
    let mut lease = lease_to_pb(&r.lease, Some(&r.partition));
    if !r.more_partitions.is_empty() {
        let all: Vec<Partition> = std::iter::once(r.partition.clone())
            .chain(r.more_partitions.iter().cloned())
            .collect();
        add_partitions(&mut lease, &all, None);
    }
    r.grant.to_proto(lease)
}

/// Whether two answers to ResolveToken agree in what a runtime judges a spec by and
/// gives a container: everything but the lease's other fields (its expiry, labels,
/// bindings, times), which a renewal or another container's bind changes without
/// changing what this container may use. The lease's id, tenant and pod count.
pub fn same_resolution(a: &pb::ResolveTokenResponse, b: &pb::ResolveTokenResponse) -> bool {
    fn key(l: Option<&pb::Lease>) -> Option<(&str, &str, &str)> {
        l.map(|l| (l.id.as_str(), l.tenant.as_str(), l.pod.as_str()))
    }
    key(a.lease.as_ref()) == key(b.lease.as_ref())
        && a.tenant == b.tenant
        && a.devices == b.devices
        && a.env == b.env
        && a.mounts == b.mounts
        && a.visible_gpu_indices == b.visible_gpu_indices
        && a.granted_capabilities == b.granted_capabilities
        && a.cgroup_parent == b.cgroup_parent
        && a.pids_limit == b.pids_limit
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn answer() -> pb::ResolveTokenResponse {
        pb::ResolveTokenResponse {
            lease: Some(pb::Lease {
                id: "l1".into(),
                tenant: "acme".into(),
                expires_at_ms: 1_000,
                ..Default::default()
            }),
            tenant: "acme".into(),
            devices: vec![pb::DeviceNode {
                host_path: "/dev/nvidia0".into(),
                container_path: "/dev/nvidia0".into(),
                r#type: "c".into(),
                major: 195,
                minor: 0,
                permissions: "rw".into(),
                file_mode: 0o666,
            }],
            env: [("A", "1"), ("B", "2")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            cgroup_parent: "/tessera/l1".into(),
            pids_limit: 256,
            bind_checks_resolution: true,
            ..Default::default()
        }
    }

    #[test]
    fn a_renewal_or_another_binding_keeps_the_resolution_a_grant_change_does_not() {
        let a = answer();
        let mut renewed = a.clone();
        if let Some(l) = renewed.lease.as_mut() {
            l.expires_at_ms = 9_000;
            l.containers.push(pb::Container::default());
        }
        assert!(same_resolution(&a, &renewed));
        let changes: [fn(&mut pb::ResolveTokenResponse); 6] = [
            |r| r.devices[0].minor = 1,
            |r| {
                r.env.insert("B".into(), "3".into());
            },
            |r| r.cgroup_parent = "/elsewhere".into(),
            |r| r.pids_limit = 0,
            |r| r.granted_capabilities.push("gpu0/mig/gi1/access".into()),
            |r| {
                if let Some(l) = r.lease.as_mut() {
                    l.pod = "pod-b".into();
                }
            },
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut b = a.clone();
            change(&mut b);
            assert!(!same_resolution(&a, &b), "change {i} went unnoticed");
        }
    }
}
