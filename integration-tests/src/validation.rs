//! The CreateLease validation path as one checkable function, shared by the
//! proptest (`tests/validation_props.rs`) and the fuzz target (`fuzz/`).
//!
//! Bytes are decoded as a `CreateLeaseRequest`, converted as the API does
//! ([`tesserad::api::convert::create_request_from_pb`]), validated as the manager
//! does ([`tesserad::lease::validate_create`]) and, when valid, planned on a
//! small node ([`tesserad::partition::plan`]). The properties: nothing panics, every
//! refusal is an InvalidArgument whose message starts with `invalid <field>` for a
//! known field and stays short (it never echoes a huge input), and every accepted
//! request has a TTL within the limits.

use std::time::Duration;

use prost::Message;
use tessera_proto::v1 as pb;
use tesserad::config::LeaseConfig;
use tesserad::gpu::{GpuInfo, GpuModel};
use tesserad::lease::LeaseError;
use tesserad::lease::validate_create;
use tesserad::partition::{GpuView, PlanDecision, PlanError, PlanOptions, plan};

/// Fields a refusal may name.
pub const FIELDS: &[&str] = &[
    "tenant",
    "shape",
    "shape.mig.profile",
    "shape.mig.compute_profile",
    "request_id",
    "labels",
    "priority_class",
    "ttl_seconds",
    "shape.count",
    "gpu_index",
    "topology",
];

/// Longest refusal message accepted (inputs may be up to 1 MiB).
pub const MAX_MESSAGE: usize = 1024;

/// What happened to one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Not a CreateLeaseRequest (the gRPC layer answers with a decode error).
    Undecodable,
    /// Refused, naming this field.
    Refused(&'static str),
    /// Valid, but no GPU of the test node has room.
    NoCapacity,
    /// Valid and placed.
    Placed,
}

/// The lease limits of the default config.
pub fn default_limits() -> LeaseConfig {
    LeaseConfig {
        default_ttl: Duration::from_secs(3600),
        max_ttl: Duration::from_secs(7 * 86_400),
        min_ttl: Duration::from_secs(1),
        expiring_notice: Duration::from_secs(60),
        revocation_grace: Duration::from_secs(10),
        retain_ended: Duration::from_secs(7 * 86_400),
        pids_limit: 4096,
        max_queue_wait: Duration::from_secs(600),
        max_queued_per_tenant: 16,
        max_queued: 256,
    }
}

/// An empty H100-80GB with MIG and an empty A100-40GB without.
pub fn test_node() -> Vec<GpuView> {
    [
        (GpuModel::H100Hbm3_80Gb, true),
        (GpuModel::A100Sxm40Gb, false),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (model, mig))| GpuView {
        info: GpuInfo {
            index: i as u32,
            uuid: format!("GPU-00000000-0000-0000-0000-00000000000{i}"),
            name: model.marketing_name().to_owned(),
            memory_bytes: model.memory_bytes(),
            minor: i as u32,
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x1B + 0x10 * i),
            mig_current: mig,
            mig_pending: mig,
            sm_count: model.sm_count(),
            fault: None,
        },
        profiles: if mig { model.gi_profiles() } else { Vec::new() },
        mig: Vec::new(),
        mps: Default::default(),
        whole_leased: false,
    })
    .collect()
}

fn named_field(message: &str) -> Result<&'static str, String> {
    if message.len() > MAX_MESSAGE {
        return Err(format!("{} byte refusal message", message.len()));
    }
    let rest = message
        .strip_prefix("invalid ")
        .ok_or_else(|| format!("refusal does not start with \"invalid <field>\": {message:?}"))?;
    let word = rest.split([':', ' ']).next().unwrap_or_default();
    FIELDS
        .iter()
        .find(|f| **f == word)
        .copied()
        .ok_or_else(|| format!("refusal names no known field: {message:?}"))
}

fn refused(e: LeaseError) -> Result<Outcome, String> {
    match e {
        LeaseError::InvalidArgument { field, .. } => {
            let msg = e.to_string();
            let named = named_field(&msg)?;
            if named != field {
                return Err(format!("field {field} but message {msg:?}"));
            }
            Ok(Outcome::Refused(named))
        }
        other => Err(format!("refusal is not InvalidArgument: {other}")),
    }
}

/// Run the whole validation path on `data`. Err describes a broken property.
pub fn check_create_request_bytes(data: &[u8]) -> Result<Outcome, String> {
    let Ok(req) = pb::CreateLeaseRequest::decode(data) else {
        return Ok(Outcome::Undecodable);
    };
    check_create_request(req)
}

/// Run the validation path on a decoded request. Err describes a broken property.
pub fn check_create_request(req: pb::CreateLeaseRequest) -> Result<Outcome, String> {
    let limits = default_limits();
    let gpu_index = req.gpu_index;
    let req = match tesserad::api::convert::create_request_from_pb(req, Default::default()) {
        Ok(r) => r,
        Err(status) => {
            if status.code() != tonic::Code::InvalidArgument {
                return Err(format!("conversion refused with {status}"));
            }
            return named_field(status.message()).map(Outcome::Refused);
        }
    };
    let (shape, ttl) = match validate_create(&req, &limits) {
        Ok(v) => v,
        Err(e) => return refused(e),
    };
    if ttl < limits.min_ttl || ttl > limits.max_ttl {
        return Err(format!("accepted TTL {ttl:?} outside the limits"));
    }
    let views = test_node();
    let opts = PlanOptions {
        gpu_index,
        ..PlanOptions::default()
    };
    if req.count > 1 {
        return several(&shape, req.count, req.topology, &views, &opts);
    }
    match plan(&shape, &views, &opts) {
        Ok(d) => {
            let gpu = match &d {
                PlanDecision::NewMig { gpu, .. }
                | PlanDecision::Static { gpu, .. }
                | PlanDecision::Mps { gpu }
                | PlanDecision::WholeGpu { gpu } => *gpu,
            };
            if gpu as usize >= views.len() || gpu_index.is_some_and(|g| g != gpu) {
                return Err(format!(
                    "{shape:?} placed on GPU {gpu} ({gpu_index:?} asked)"
                ));
            }
            Ok(Outcome::Placed)
        }
        Err(PlanError::NoCapacity(m)) => {
            if m.len() > 4 * MAX_MESSAGE {
                return Err(format!("{} byte capacity message", m.len()));
            }
            Ok(Outcome::NoCapacity)
        }
        Err(e) => refused(LeaseError::from(e)),
    }
}

/// A valid request for several partitions, planned by topology on the test node.
fn several(
    shape: &tesserad::partition::Shape,
    count: u32,
    constraint: tesserad::partition::topology::TopologyConstraint,
    views: &[GpuView],
    opts: &PlanOptions,
) -> Result<Outcome, String> {
    use tesserad::partition::Shape;
    use tesserad::partition::topology::{plan_gpus_within, plan_migs};
    let board = tesserad::gpu::SimTopology::Pcie;
    let n = views.len() as u32;
    let link = move |a, b| board.link(a, b, n, 0);
    let placed = match shape {
        Shape::WholeGpu => plan_gpus_within(count, views, &link, constraint).map(|s| s.len()),
        Shape::Mig { .. } => {
            plan_migs(shape, count, views, opts, &link, constraint).map(|d| d.len())
        }
        other => return Err(format!("{other:?} accepted with a count of {count}")),
    };
    match placed {
        Ok(k) if k == count as usize => Ok(Outcome::Placed),
        Ok(k) => Err(format!("{k} placed of {count} asked")),
        Err(PlanError::NoCapacity(_) | PlanError::TopologyUnmet(_)) => Ok(Outcome::NoCapacity),
        Err(e) => refused(LeaseError::from(e)),
    }
}
