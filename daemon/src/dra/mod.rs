//! Kubernetes Dynamic Resource Allocation (`resource.k8s.io/v1`): tesserad as the DRA
//! driver `gpu.tessera.io`, a client of the lease core like `k8s/`.
//!
//! * `device.rs`: the device names published in ResourceSlices and what each one is
//!   on the node (a whole GPU, a MIG placement, an MPS slot). Both sides use it: the
//!   publisher names devices with it, NodePrepareResources reads the names the
//!   scheduler allocated with it.
//! * `claims.rs`: how the node side learns which devices the scheduler allocated to a
//!   claim (kubelet's request carries only the claim's namespace, name and UID).

pub mod claims;
pub mod device;

/// The DRA driver name (the `driver` of every slice, device class and allocation).
pub const DRIVER_NAME: &str = "gpu.tessera.io";
