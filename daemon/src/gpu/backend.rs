//! The hardware interface both backends implement.

use super::health::{HealthCause, HealthEvent};
use super::topology::GpuLink;
use super::types::{
    GiProfile, GpuError, GpuInfo, GpuProcess, MigInstance, MigMinors, Placement, Utilization,
};
use crate::mps::{MpsDaemon, MpsSpec};

/// The hardware interface. Every method maps to NVML calls (or the sim's model of them).
pub trait GpuBackend: Send + Sync {
    /// "nvml" or "sim".
    fn name(&self) -> &'static str;
    /// True when a MIG create or destroy returns within microseconds and never
    /// waits on hardware (the simulator): callers may then run it on the async
    /// runtime instead of handing it to a blocking thread. NVML's take up to
    /// hundreds of milliseconds.
    fn instance_calls_are_quick(&self) -> bool {
        false
    }
    fn driver_version(&self) -> Result<String, GpuError>;
    /// Every GPU. One GPU that does not answer does not fail the list: it is listed
    /// with its `fault` set (a failure here is of the whole driver).
    fn devices(&self) -> Result<Vec<GpuInfo>, GpuError>;
    /// One GPU, read again (a GPU that was lost and is back).
    fn device(&self, gpu: u32) -> Result<GpuInfo, GpuError> {
        self.devices()?
            .into_iter()
            .find(|g| g.index == gpu)
            .ok_or(GpuError::NoSuchGpu(gpu))
    }
    /// GI profiles supported on this GPU (empty when MIG is disabled), with their
    /// possible placements and CI profiles.
    fn gi_profiles(&self, gpu: u32) -> Result<Vec<GiProfile>, GpuError>;
    /// Create a GI at an explicit placement and its CI as one unit: if the CI cannot
    /// be created, the GI is destroyed again before the error is returned.
    /// `ci_profile_id` None = the CI profile that spans the whole GI.
    fn create_instance(
        &self,
        gpu: u32,
        gi_profile_id: u32,
        placement: Placement,
        ci_profile_id: Option<u32>,
    ) -> Result<MigInstance, GpuError>;
    /// Destroy a GI's CIs then the GI. Fails with IN_USE while processes run in it.
    fn destroy_instance(&self, gpu: u32, gi_id: u32) -> Result<(), GpuError>;
    fn instances(&self, gpu: u32) -> Result<Vec<MigInstance>, GpuError>;
    fn processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, GpuError>;
    fn mig_minors(&self) -> Result<MigMinors, GpuError>;
    fn utilization(&self, gpu: u32) -> Result<Utilization, GpuError>;

    /// Start one MPS control daemon with the spec's limits as the daemon-side
    /// defaults (`set_default_active_thread_percentage`,
    /// `set_default_device_pinned_mem_limit`). Idempotent for the same lease.
    fn mps_start(&self, spec: &MpsSpec) -> Result<MpsDaemon, GpuError>;
    /// Stop it cleanly (`quit`). Idempotent: stopping a stopped daemon is Ok.
    fn mps_stop(&self, lease_id: &str) -> Result<(), GpuError>;
    /// The MPS daemons the backend knows of (the sim's state file, or pid files).
    fn mps_daemons(&self) -> Result<Vec<MpsDaemon>, GpuError>;
    /// The keys (lease id, or a shared server's name) of the MPS daemons running
    /// now: what supervision (every second) and the start ask, without a copy of
    /// every daemon (about 10 MB with 10,000 MPS leases, each time).
    fn mps_running(&self) -> Result<std::collections::HashSet<String>, GpuError> {
        Ok(self
            .mps_daemons()?
            .into_iter()
            .filter(|d| d.running)
            .map(|d| d.spec.lease_id)
            .collect())
    }
    /// How GPUs `a` and `b` are connected (NVML: the topology common ancestor, and
    /// the active NVLinks of `a` whose remote end is `b`).
    fn topology(&self, a: u32, b: u32) -> Result<GpuLink, GpuError>;

    /// Health events (critical XIDs, double-bit ECC) since the last call, waiting up
    /// to `timeout` for the first one (NVML: `nvmlEventSetWait`). Empty when none
    /// came. One caller at a time (the daemon's health watcher).
    fn health_events(&self, timeout: std::time::Duration) -> Result<Vec<HealthEvent>, GpuError>;
    /// What no event covers, read now: None when the GPU is healthy.
    fn health_poll(&self, gpu: u32) -> Result<Option<HealthCause>, GpuError>;
}
