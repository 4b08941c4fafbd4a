//! A claim the DRA driver prepared, as the store keeps it (table `dra_claims`; read
//! and written by `dra.rs`).

use serde::{Deserialize, Serialize};

/// One claim the DRA driver prepared (or is preparing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraClaim {
    /// The claim's UID on the API server (the key).
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// The tenant its leases were created for (its namespace's, at prepare).
    pub tenant: String,
    /// Random, per prepare: the leases' request ids are `dra-<nonce>-<i>`, so a
    /// prepare cut off by a crash finds the leases it made when kubelet retries.
    pub nonce: String,
    /// False while the leases are being made (recorded first, so nothing leaks).
    pub prepared: bool,
    /// Our devices of the allocation, in its order, with their leases once made.
    pub devices: Vec<DraDevice>,
    pub created_at_ms: i64,
}

/// One device of a prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraDevice {
    /// The claim's requests this device serves.
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    pub lease_id: String,
    /// The lease's token (what binds a container to the lease).
    pub token: String,
}
