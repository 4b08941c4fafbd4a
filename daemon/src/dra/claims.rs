//! What the scheduler allocated to a ResourceClaim: kubelet's NodePrepareResources
//! names only the claim (namespace, name, UID); the allocation is in the claim's
//! `status.allocation` on the API server. [`ClaimSource`] reads it.

use std::fmt;

/// A claim as kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// One result of a claim's allocation (`status.allocation.devices.results[]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedDevice {
    /// The claim's request this device serves (`request`).
    pub request: String,
    /// The driver that owns it (`driver`): results of other drivers are not ours.
    pub driver: String,
    /// The pool (`pool`): this node's pool for our devices.
    pub pool: String,
    /// The device name within the pool (`device`), see [`super::device`].
    pub device: String,
}

/// A claim's allocation as the API server holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimAllocation {
    /// The claim's UID on the API server: a claim recreated under the same name has
    /// another UID, and must not be prepared with the old one's allocation.
    pub uid: String,
    /// Every result, ours and other drivers'.
    pub devices: Vec<AllocatedDevice>,
}

#[derive(Debug, thiserror::Error)]
pub enum ClaimSourceError {
    #[error("resource claim {0} not found")]
    NotFound(String),
    #[error("resource claim {0} is not allocated")]
    NotAllocated(String),
    #[error("resource claim {claim}: {message}")]
    Api { claim: String, message: String },
}

/// Reads a claim's allocation (the API server in production).
#[tonic::async_trait]
pub trait ClaimSource: Send + Sync {
    async fn allocation(&self, claim: &ClaimRef) -> Result<ClaimAllocation, ClaimSourceError>;
}
