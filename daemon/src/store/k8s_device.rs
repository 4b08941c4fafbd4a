//! A device of the kubelet device plugin as the store keeps it (table
//! `k8s_devices`; read and written by `k8s.rs`).

use serde::{Deserialize, Serialize};

/// One advertised device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct K8sDevice {
    /// The id kubelet knows (stable across restarts).
    pub device_id: String,
    /// The class (`mig-1g.10gb`, `gpu`, `mps-small`): the resource `tessera.io/<class>`.
    pub class: String,
    pub lease_id: String,
    /// The lease's token. Allocate returns it as the container annotation the runtime
    /// reads; kubelet may ask again (retries, restarts) and must get the same one.
    pub token: String,
    /// Allocate was called for it (it no longer counts as free reserved capacity).
    pub allocated: bool,
    /// The pod that holds it, as PodResources last said (namespace, name).
    pub pod: Option<(String, String)>,
    /// Unix ms since when no pod in PodResources holds it (an allocated device).
    pub unseen_since_ms: Option<i64>,
    pub created_at_ms: i64,
}
