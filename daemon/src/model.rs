//! The lease domain: leases, partitions and intents as plain Rust types.
//!
//! These are what the store persists and what the API converts to protobuf.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::gpu::Placement;
use crate::partition::Shape;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    /// Intent recorded, hardware being set up.
    Pending,
    Active,
    /// Containers being stopped, partition being torn down.
    Revoking,
    Released,
    Expired,
    Revoked,
    Failed,
}

impl LeaseState {
    pub fn is_live(self) -> bool {
        matches!(
            self,
            LeaseState::Pending | LeaseState::Active | LeaseState::Revoking
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            LeaseState::Pending => "pending",
            LeaseState::Active => "active",
            LeaseState::Revoking => "revoking",
            LeaseState::Released => "released",
            LeaseState::Expired => "expired",
            LeaseState::Revoked => "revoked",
            LeaseState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<LeaseState> {
        Some(match s {
            "pending" => LeaseState::Pending,
            "active" => LeaseState::Active,
            "revoking" => LeaseState::Revoking,
            "released" => LeaseState::Released,
            "expired" => LeaseState::Expired,
            "revoked" => LeaseState::Revoked,
            "failed" => LeaseState::Failed,
            _ => return None,
        })
    }
}

/// A container bound to a lease by the runtime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerBinding {
    pub id: String,
    pub cgroup_path: String,
    pub runtime_root: String,
    pub bound_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub id: String,
    pub tenant: String,
    pub state: LeaseState,
    pub shape: Shape,
    pub partition_id: String,
    pub gpu: u32,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub ttl_secs: u64,
    pub request_id: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub priority_class: String,
    /// Beyond the tenant's guarantee: may be preempted.
    pub burst: bool,
    /// The state a revoking lease ends in (released, expired or revoked).
    pub ending_as: Option<LeaseState>,
    pub end_reason: Option<String>,
    pub ended_at_ms: Option<i64>,
    pub containers: Vec<ContainerBinding>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Declared in the operator's static layout: returns to the pool on release.
    Static,
    /// Created on demand for a lease.
    Dynamic,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionState {
    /// Intent recorded, hardware change in progress.
    Creating,
    Ready,
    /// Intent recorded, teardown in progress (or retried after a failure).
    Destroying,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigPart {
    pub gi_profile_id: u32,
    pub profile: String,
    pub placement: Placement,
    pub ci_profile_id: Option<u32>,
    pub compute_profile: Option<String>,
    pub gi_id: Option<u32>,
    pub ci_id: Option<u32>,
    pub uuid: Option<String>,
    pub memory_bytes: u64,
    pub sm_count: u32,
    pub slices: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MpsPart {
    pub sm_percent: u32,
    pub memory_bytes: u64,
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    /// The uid the lease's containers run as (owner of the pipe and log dirs).
    #[serde(default)]
    pub owner_uid: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PartKind {
    Mig(MigPart),
    Mps(MpsPart),
    WholeGpu,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    pub id: String,
    pub gpu: u32,
    pub gpu_uuid: String,
    pub origin: Origin,
    pub state: PartitionState,
    pub lease_id: Option<String>,
    pub kind: PartKind,
}

impl Partition {
    pub fn mig(&self) -> Option<&MigPart> {
        match &self.kind {
            PartKind::Mig(m) => Some(m),
            _ => None,
        }
    }
    pub fn mps(&self) -> Option<&MpsPart> {
        match &self.kind {
            PartKind::Mps(m) => Some(m),
            _ => None,
        }
    }
}

/// A hardware change the daemon is about to make (write-ahead).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IntentOp {
    CreateMig,
    DestroyMig,
    StartMps,
    StopMps,
}

impl IntentOp {
    pub fn as_str(self) -> &'static str {
        match self {
            IntentOp::CreateMig => "create_mig",
            IntentOp::DestroyMig => "destroy_mig",
            IntentOp::StartMps => "start_mps",
            IntentOp::StopMps => "stop_mps",
        }
    }
    pub fn parse(s: &str) -> Option<IntentOp> {
        Some(match s {
            "create_mig" => IntentOp::CreateMig,
            "destroy_mig" => IntentOp::DestroyMig,
            "start_mps" => IntentOp::StartMps,
            "stop_mps" => IntentOp::StopMps,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intent {
    pub id: i64,
    pub op: IntentOp,
    pub partition_id: String,
    pub lease_id: Option<String>,
    pub created_at_ms: i64,
}

/// A temporary quota raise granted by an admin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub id: String,
    pub tenant: String,
    #[serde(with = "amounts_serde")]
    pub extra: crate::config::Amounts,
    pub expires_at_ms: i64,
    pub reason: String,
    pub granted_by: String,
    pub created_at_ms: i64,
}

mod amounts_serde {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::config::Amounts;

    #[derive(Serialize, Deserialize)]
    struct A {
        mig_slices: u32,
        mps_sm_percent: u32,
        memory_bytes: u64,
        whole_gpus: u32,
    }

    pub fn serialize<S: Serializer>(a: &Amounts, s: S) -> Result<S::Ok, S::Error> {
        A {
            mig_slices: a.mig_slices,
            mps_sm_percent: a.mps_sm_percent,
            memory_bytes: a.memory_bytes,
            whole_gpus: a.whole_gpus,
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Amounts, D::Error> {
        let a = A::deserialize(d)?;
        Ok(Amounts {
            mig_slices: a.mig_slices,
            mps_sm_percent: a.mps_sm_percent,
            memory_bytes: a.memory_bytes,
            whole_gpus: a.whole_gpus,
        })
    }
}
