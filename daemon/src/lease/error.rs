//! Typed refusals and failures of the lease core; the API maps each to a gRPC status.

use crate::gpu::GpuError;
use crate::partition::PlanError;
use crate::store::StoreError;

#[allow(unused_imports)]
use super::*;

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("invalid {field}: {message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("the daemon is shutting down")]
    ShuttingDown,
    #[error("GPU: {0}")]
    Hardware(#[from] GpuError),
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("internal: {0}")]
    Internal(String),
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
