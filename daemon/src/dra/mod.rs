//! Kubernetes Dynamic Resource Allocation (`resource.k8s.io/v1`): tesserad as the DRA
//! driver `gpu.tessera.io`, a client of the lease core like `k8s/`.
//!
//! * `device.rs`: the device names published in ResourceSlices and what each one is
//!   on the node (a whole GPU, a MIG placement, an MPS slot). Both sides use it: the
//!   publisher names devices with it, NodePrepareResources reads the names the
//!   scheduler allocated with it.
//! * `claims.rs`: how the node side learns which devices the scheduler allocated to a
//!   claim (kubelet's request carries only the claim's namespace, name and UID).
//! * `slices/`: the ResourceSlices of this node's pool, built from the lease core's
//!   view of the node (pure).
//! * `kube/`: the API server: the publisher of those slices and the claim reader
//!   ([`claims::ClaimSource`] over `ResourceClaim`s).

pub mod claims;
pub mod device;
pub mod kube;
pub mod slices;

/// The DRA driver name (the `driver` of every slice, device class and allocation).
pub const DRIVER_NAME: &str = "gpu.tessera.io";

/// The label on every lease made for a ResourceClaim: the claim's UID. The publisher
/// keeps hardware under such leases published (the scheduler accounts for it through
/// the claim); hardware under any other lease is not the scheduler's to give.
pub const LABEL_CLAIM_UID: &str = "tessera.io/dra-claim-uid";
