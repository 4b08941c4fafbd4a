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
//!
//! # The node side (kubelet plugin)
//!
//! Off unless `[kubernetes] dra = true`; [`node::start`] runs it. This file only
//! declares: its children use its names, it uses none of theirs (no import loop).
//!
//! * `registration.rs`: kubelet's plugin watcher finds the registration socket
//!   `<dra_registry_dir>/gpu.tessera.io-reg.sock` and calls `GetInfo`: type
//!   `DRAPlugin`, name `gpu.tessera.io`, endpoint `<dra_plugin_dir>/dra.sock`, and
//!   as "supported versions" the gRPC services served there: `v1.DRAPlugin` (kubelet
//!   1.34 and later pick it), `v1beta1.DRAPlugin` (older kubelets) and
//!   `v1.DRAResourceHealth` (KEP-4680). kubelet then calls
//!   `NotifyRegistrationStatus`; a refusal is logged. A socket removed (kubelet
//!   restarting wipes nothing there, an operator may) is made again and so found
//!   again.
//! * `service.rs`: the gRPC services on `dra.sock`. `NodePrepareResources` and
//!   `NodeUnprepareResources` answer per claim: one claim's failure is its own
//!   `error`, never the whole call's.
//! * `plugin.rs`: a claim becomes leases. Its allocation is read through the
//!   [`claims::ClaimSource`] (the API server), before the plugin's one-at-a-time lock
//!   (a hung API server answer holds up only its own claim); the results of this driver and this
//!   node's pool (the node name) are ours, the others' ignored. Each device name
//!   ([`device::DeviceName`]) is a lease at exactly that placement
//!   ([`crate::lease::ExactPlacement`]: the lease core places it there or refuses,
//!   never elsewhere), for the tenant of the claim's namespace
//!   ([`crate::config::KubernetesConfig::tenant_of`]) under its quota, labelled with
//!   the namespace, claim name and UID; an MPS slot device is a share of its
//!   `[[kubernetes.mps_classes]]` class (isolated mode: pods of any namespace may
//!   share a GPU). A claim is all or nothing: a device refused releases the others.
//!   A device is one claim's at a time: one prepared for another claim is refused
//!   (an MPS slot would otherwise become a second share).
//!   The answer per device is two CDI ids: the per-lease spec
//!   (`tessera.io/lease=<id>`, written by `crate::cdi`: the lease's device nodes,
//!   mounts and env) and the claim's token spec (`tessera.io/claim=<uid>`, mode
//!   0600, written here: `TESSERA_LEASE_TOKEN` with the claim's leases' tokens,
//!   which tessera-runtime binds the container with, as it does the device
//!   plugin's token annotation). A container may use one claim of this driver (two
//!   would set two different token values).
//! * Idempotent on the claim UID, across restarts: the claim's record (store table
//!   `dra_claims`: UID -> devices, leases and tokens) is written before any lease is
//!   made, with a random nonce naming the leases' request ids, so a prepare cut off
//!   by a crash replays the leases it made when kubelet retries, and an unprepare
//!   finds them. A prepared claim is answered from the record (the same leases);
//!   unprepare releases its leases and forgets it; an unknown claim is already
//!   unprepared. Nothing is released at start: kubelet's own checkpoint decides what
//!   is unprepared, and MIG instances no record explains are never touched (the
//!   lease core's rule).
//! * Leases are renewed at half `kubernetes.lease_ttl` while their claim is
//!   prepared. Health (`NodeWatchResources`): every prepared device, unhealthy while
//!   its lease is marked (a GPU or instance out of service) or has ended, sent again
//!   on every lease event.
//! * GPUs: `dra_gpus` names those the driver serves (all by default); the device
//!   plugin, when on too, reserves only on the others, and a claim for a GPU not
//!   served is refused.

pub mod claims;
pub mod device;
pub mod kube;
pub mod node;
pub mod plugin;
mod registration;
mod service;
pub mod slices;

use std::path::PathBuf;

use crate::lease::LeaseError;
use crate::store::StoreError;

/// The DRA driver name (the `driver` of every slice, device class and allocation).
pub const DRIVER_NAME: &str = "gpu.tessera.io";

/// The DRA plugin's gRPC socket, in `[kubernetes] dra_plugin_dir`.
pub const PLUGIN_SOCKET: &str = "dra.sock";
/// The registration socket, in `[kubernetes] dra_registry_dir`.
pub const REGISTRATION_SOCKET: &str = "gpu.tessera.io-reg.sock";

/// Labels of a claim's leases.
pub use crate::names::LABEL_K8S_NAMESPACE as LABEL_NAMESPACE;
pub const LABEL_CLAIM: &str = "tessera.io/dra-claim";
/// The label on every lease made for a ResourceClaim: the claim's UID. The publisher
/// keeps hardware under such leases published (the scheduler accounts for it through
/// the claim); hardware under any other lease is not the scheduler's to give.
pub const LABEL_CLAIM_UID: &str = "tessera.io/dra-claim-uid";

#[derive(Debug, thiserror::Error)]
pub enum DraError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Lease(#[from] LeaseError),
    /// One device of a claim could not become a lease.
    #[error("device {device}: {source}")]
    Device {
        device: String,
        #[source]
        source: LeaseError,
    },
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    ClaimSource(#[from] claims::ClaimSourceError),
    #[error("{0}")]
    DeviceName(#[from] device::DeviceNameError),
    /// A claim that cannot be prepared as allocated.
    #[error("{0}")]
    Claim(String),
    #[error("CDI: {0}")]
    Cdi(#[from] crate::cdi::CdiError),
    /// `[kubernetes] dra = true` without what it needs.
    #[error("kubernetes.dra: {0}")]
    Config(String),
}

#[cfg(test)]
mod tests;
