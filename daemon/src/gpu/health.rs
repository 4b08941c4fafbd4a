//! GPU health as the hardware reports it: the events NVML delivers (critical XID
//! errors, double-bit ECC errors) and what a poll reads that no event covers (a GPU
//! fallen off the bus, pages waiting for retirement).
//!
//! Owns: the vocabulary of causes and which XIDs take a GPU or an instance out of
//! service. May not touch: leases, the planner (the lease core decides what an
//! unhealthy GPU means for them).

use serde::{Deserialize, Serialize};

/// XIDs after which a GPU (or, with an instance scope, a MIG instance) must not take
/// new work, as NVIDIA's device plugin and DCGM treat them:
///
/// | XID | meaning |
/// |---|---|
/// | 48 | double-bit ECC error |
/// | 63 | ECC page retirement or row remapping recorded (a reset applies it) |
/// | 64 | ECC page retirement or row remapping failed |
/// | 74 | NVLink error |
/// | 79 | the GPU has fallen off the bus |
/// | 94 | contained ECC error (the affected instance's processes) |
/// | 95 | uncontained ECC error (every process on the GPU) |
/// | 119, 120 | GSP firmware error or timeout |
///
/// Application XIDs (13, 31, 43, 45: a faulting kernel, a killed context) say
/// nothing about the hardware and are not in the list.
pub const CRITICAL_XIDS: &[u64] = &[48, 63, 64, 74, 79, 94, 95, 119, 120];

/// What an XID means, in a few words (for events, logs and `tessera gpus`).
pub fn xid_meaning(xid: u64) -> &'static str {
    match xid {
        13 => "graphics engine exception",
        31 => "GPU memory page fault",
        43 => "GPU stopped processing",
        45 => "preemptive cleanup",
        48 => "double-bit ECC error",
        63 => "ECC page retirement or row remapping recorded",
        64 => "ECC page retirement or row remapping failed",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        119 => "GSP RPC timeout",
        120 => "GSP error",
        _ => "driver error",
    }
}

/// Why a GPU or an instance is unhealthy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HealthCause {
    /// A critical XID error event.
    Xid { xid: u64 },
    /// A double-bit (uncorrectable) ECC error event.
    DoubleBitEcc,
    /// NVML answers `GPU_IS_LOST` for the device: it has fallen off the bus.
    Lost,
    /// Retired pages or remapped rows are pending: they apply at the next GPU reset.
    PendingRetirement,
    /// An operator took it out of service (`tessera gpu mark-unhealthy`).
    Operator { reason: String },
    /// An NVML query of the GPU fails (its handle, memory, MIG profiles, ...): the
    /// GPU cannot be served until the query answers again.
    Nvml { error: String },
}

impl HealthCause {
    /// True when the hardware says it is over once a poll reads healthy again (the
    /// GPU is back on the bus, the retirement applied); false when only an operator
    /// can tell (an XID or ECC event is a moment, not a state NVML can be asked for).
    pub fn clears_by_poll(&self) -> bool {
        matches!(
            self,
            HealthCause::Lost | HealthCause::PendingRetirement | HealthCause::Nvml { .. }
        )
    }

    /// Stable short name, used as the `cause` label and the reason in events.
    pub fn code(&self) -> String {
        match self {
            HealthCause::Xid { xid } => format!("xid-{xid}"),
            HealthCause::DoubleBitEcc => "ecc-dbe".into(),
            HealthCause::Lost => "lost".into(),
            HealthCause::PendingRetirement => "pending-retirement".into(),
            HealthCause::Operator { .. } => "operator".into(),
            HealthCause::Nvml { .. } => "nvml-error".into(),
        }
    }
}

impl std::fmt::Display for HealthCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HealthCause::Xid { xid } => write!(f, "XID {xid} ({})", xid_meaning(*xid)),
            HealthCause::DoubleBitEcc => f.write_str("double-bit ECC error"),
            HealthCause::Lost => f.write_str("GPU has fallen off the bus (NVML: GPU is lost)"),
            HealthCause::PendingRetirement => {
                f.write_str("retired pages or remapped rows pending (a GPU reset applies them)")
            }
            HealthCause::Operator { reason } => write!(f, "taken out of service: {reason}"),
            HealthCause::Nvml { error } => write!(f, "NVML query fails: {error}"),
        }
    }
}

/// One health event from the hardware.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthEvent {
    pub gpu: u32,
    /// The MIG GPU instance the event is confined to (NVML's `gpuInstanceId` for
    /// contained errors); None for the whole GPU.
    #[serde(default)]
    pub gi_id: Option<u32>,
    pub cause: HealthCause,
}

impl HealthEvent {
    /// Whether the event takes its GPU (or instance) out of service. XIDs outside
    /// [`CRITICAL_XIDS`] are logged and otherwise ignored.
    pub fn is_critical(&self) -> bool {
        match &self.cause {
            HealthCause::Xid { xid } => CRITICAL_XIDS.contains(xid),
            _ => true,
        }
    }

    /// The scope the event takes out of service: an instance only for a contained
    /// error (XID 94) that NVML attributes to one GPU instance; the GPU otherwise.
    pub fn instance_scope(&self) -> Option<u32> {
        match self.cause {
            HealthCause::Xid { xid: 94 } => self.gi_id,
            _ => None,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn only_hardware_xids_are_critical_and_only_contained_ones_stay_in_their_instance() {
        let ev = |xid, gi_id| HealthEvent {
            gpu: 0,
            gi_id,
            cause: HealthCause::Xid { xid },
        };
        assert!(ev(79, None).is_critical());
        assert!(ev(48, None).is_critical());
        assert!(
            !ev(13, None).is_critical(),
            "an application fault is no hardware fault"
        );
        assert!(!ev(43, Some(1)).is_critical());
        assert_eq!(ev(94, Some(3)).instance_scope(), Some(3));
        assert_eq!(
            ev(95, Some(3)).instance_scope(),
            None,
            "uncontained takes the GPU"
        );
        assert_eq!(ev(94, None).instance_scope(), None);
    }

    #[test]
    fn only_states_nvml_can_be_asked_about_clear_by_themselves() {
        assert!(HealthCause::Lost.clears_by_poll());
        assert!(HealthCause::PendingRetirement.clears_by_poll());
        assert!(!HealthCause::Xid { xid: 79 }.clears_by_poll());
        assert!(!HealthCause::DoubleBitEcc.clears_by_poll());
        assert!(!HealthCause::Operator { reason: "x".into() }.clears_by_poll());
        assert_eq!(HealthCause::Xid { xid: 79 }.code(), "xid-79");
        assert!(
            HealthCause::Xid { xid: 79 }
                .to_string()
                .contains("fallen off the bus")
        );
    }
}
