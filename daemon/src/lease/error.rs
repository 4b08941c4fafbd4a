//! Typed refusals and failures of the lease core; the API maps each to a gRPC status.

use crate::gpu::GpuError;
use crate::partition::PlanError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("invalid {field}: {message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    #[error("{0}")]
    NotFound(String),
    /// No capacity for the request on this node (now).
    #[error("{0}")]
    ResourceExhausted(String),
    /// The tenant's quota does not allow the request.
    #[error("{0}")]
    QuotaExceeded(String),
    /// Capacity is being freed for another tenant's guaranteed request; a burst
    /// request waits.
    #[error("{0}")]
    BurstWaits(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// BindContainer: the answer the runtime judged the spec against differs from
    /// the token's current answer (nothing was bound).
    #[error("{0}")]
    ResolutionChanged(String),
    /// Room exists, but not within the topology the request demands (a
    /// multi-partition lease with `nvlink` or `numa`).
    #[error("{0}")]
    TopologyUnmet(String),
    /// No GPU considered is in the mode the shape needs (MIG for a MIG shape, MIG
    /// off for an MPS share or a whole GPU): only an operator's mode change helps.
    #[error("{0}")]
    ModeUnavailable(String),
    /// The GPU asked for is out of service.
    #[error("{0}")]
    GpuUnhealthy(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("the daemon is shutting down")]
    ShuttingDown,
    #[error("GPU: {0}")]
    Hardware(#[from] GpuError),
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// A transition the lease state machine does not have (a lease changed state
    /// under the caller, e.g. ended while being renewed).
    #[error("{0}")]
    Transition(#[from] crate::model::IllegalTransition),
    /// The daemon's own records disagree with each other: a bug, never the caller's
    /// fault.
    #[error("inconsistent records: {0}")]
    Inconsistent(Inconsistency),
    /// A host operation (chown, cgroup) failed.
    #[error("host: {0}")]
    Host(#[from] crate::host::HostError),
    /// The device nodes of a lease cannot be described on this host.
    #[error("{0}")]
    Devices(#[from] super::devices::DevicesError),
    /// A blocking task (hardware call, container stop) panicked or was cancelled.
    #[error("the {what} task did not complete: {source}")]
    Task {
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
}

impl From<PlanError> for LeaseError {
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::InvalidShape(m) => LeaseError::InvalidArgument {
                field: "shape",
                message: m,
            },
            e @ PlanError::UnknownProfile { .. } => LeaseError::InvalidArgument {
                field: "shape.mig.profile",
                message: e.to_string(),
            },
            PlanError::NoCapacity(m) => LeaseError::ResourceExhausted(m),
            PlanError::TopologyUnmet(m) => LeaseError::TopologyUnmet(m),
        }
    }
}

impl From<crate::names::InvalidName> for LeaseError {
    fn from(e: crate::names::InvalidName) -> Self {
        LeaseError::InvalidArgument {
            field: e.field,
            message: e.message,
        }
    }
}

/// An invalid argument, naming its field.
pub(super) fn invalid(field: &'static str, message: impl Into<String>) -> LeaseError {
    LeaseError::InvalidArgument {
        field,
        message: message.into(),
    }
}

/// Records of the daemon that disagree with each other.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Inconsistency {
    #[error("the planner chose GPU {0}, which the daemon does not know")]
    UnknownGpu(u32),
    #[error("the planner chose GI profile {profile_id} on GPU {gpu}, which it does not offer")]
    UnknownProfile { gpu: u32, profile_id: u32 },
    #[error("the planner chose partition {0}, which does not exist")]
    UnknownPartition(String),
    #[error("the planner answered {decision} for a {shape} request")]
    ShapeMismatch {
        decision: &'static str,
        shape: &'static str,
    },
    #[error("lease {0} has no partition")]
    LeaseWithoutPartition(String),
    #[error("partition {partition} is on GPU {gpu}, which the daemon does not know")]
    PartitionOnUnknownGpu { partition: String, gpu: u32 },
    #[error("the partitions of lease {lease} cannot be given to one container: {reason}")]
    PartitionsDisagree { lease: String, reason: String },
    #[error("lease {0} vanished while it was being changed")]
    LeaseVanished(String),
    #[error("lease {0} needed a hardware step but no intent was recorded")]
    IntentMissing(String),
}
