//! What a CreateLease asks and what the decision about it is, before anything is
//! changed: the request ([`CreateRequest`]), the request checked and resolved
//! ([`Ask`]), and the [`Plan`] a decision over the table gives for it. The
//! decision is pure (`admission.rs`); the executor (`executor.rs`) acts on the plan.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::gpu::{GpuError, MpsSpec};
use crate::model::{HealthMark, IntentOp, Lease, Partition};
use crate::partition::{self, Shape};

use super::error::{LeaseError, invalid};

#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    pub tenant: String,
    pub shape: Option<Shape>,
    pub ttl: Option<Duration>,
    pub request_id: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub priority_class: Option<String>,
    pub gpu_index: Option<u32>,
    /// Instead of a shape: memory and isolation; the smallest partition that fits
    /// now is chosen (see `need.rs`).
    pub need: Option<Need>,
    /// How many partitions of `shape` (0 and 1: one): N whole GPUs or N MIG
    /// instances of one profile, placed by topology and created all or none.
    pub count: u32,
    /// With `count` > 1: how closely the partitions' GPUs must be connected.
    pub topology: crate::partition::topology::TopologyConstraint,
    /// Exactly where the lease goes (`exact.rs`): there, or refused.
    pub exact: Option<ExactPlacement>,
}

/// An exact target for one partition: GPU `gpu` whole or an MPS share on it (by the
/// request's shape), or the MIG profile of the shape at placement start
/// `mig_start`. The lease is placed there or refused, never elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExactPlacement {
    pub gpu: u32,
    /// The MIG placement's start slice (a MIG shape only, and required for one).
    pub mig_start: Option<u32>,
}

#[derive(Debug, Clone)]
pub struct Created {
    pub lease: Lease,
    pub partition: Option<Partition>,
    /// None when the lease was found ended on a retry (no token is issued then).
    pub token: Option<String>,
    pub replayed: bool,
}

/// A hardware step that follows a durable intent.
pub(super) enum HwCreate {
    Mig {
        gpu: u32,
        gi_profile_id: u32,
        placement: crate::gpu::Placement,
        ci_profile_id: Option<u32>,
    },
    Mps(MpsSpec),
}

impl HwCreate {
    /// The intent that announces this step.
    pub(super) fn intent(&self) -> IntentOp {
        match self {
            HwCreate::Mig { .. } => IntentOp::CreateMig,
            HwCreate::Mps(_) => IntentOp::StartMps,
        }
    }
}

/// A hardware step that ends a partition, after a durable intent.
pub(super) enum HwDestroy {
    Mig { gpu: u32, gi_id: u32 },
    Mps { lease_id: String },
}

impl HwDestroy {
    /// The intent that announces this step.
    pub(super) fn intent(&self) -> IntentOp {
        match self {
            HwDestroy::Mig { .. } => IntentOp::DestroyMig,
            HwDestroy::Mps { .. } => IntentOp::StopMps,
        }
    }
}

/// A partition and the hardware step that ends it (none: its hardware stays).
pub(super) type TeardownStep = (Partition, Option<HwDestroy>);

/// Why a [`HwDestroy`] step did not finish: the hardware refused, or the task
/// running the call failed.
pub(super) enum DestroyError {
    Hardware(GpuError),
    Task(tokio::task::JoinError),
}

impl DestroyError {
    /// As the lease core's error (the task's failure names the teardown).
    pub(super) fn into_lease_error(self) -> LeaseError {
        match self {
            DestroyError::Hardware(e) => LeaseError::Hardware(e),
            DestroyError::Task(source) => LeaseError::Task {
                what: "hardware teardown",
                source,
            },
        }
    }
}

/// What the hardware steps of a plan came to, as the executor records it: one
/// durable commit, then the same in the table ([`super::manager::LeaseManager`]'s
/// `commit`). Every sequence (create, teardown, move, start-up) ends with one.
#[derive(Default, Clone)]
pub(super) struct Outcome {
    /// Partition records deleted (their hardware gone, or never made).
    pub(super) gone: Vec<String>,
    /// Partition records written (ready, moved, back in the pool). Written after
    /// `gone`, so a record can be deleted and put back in one outcome.
    pub(super) parts: Vec<Partition>,
    /// Leases written that stay in the table: its copy is replaced (one it no
    /// longer holds is not put back).
    pub(super) leases: Vec<Lease>,
    /// Leases written that end here: their tokens go and they leave the table.
    pub(super) ended: Vec<Lease>,
    /// The usage record of an ended lease.
    pub(super) usage: Option<(Lease, crate::usage::Weights)>,
    /// Intents finished: (intent, when, what came of it).
    pub(super) finished: Vec<(i64, i64, &'static str)>,
    /// Health marks stored: a GPU or MIG instance out of service.
    pub(super) marked: Vec<HealthMark>,
    /// Health marks deleted: back in service.
    pub(super) unmarked: Vec<HealthMark>,
    /// Temporary quota raises granted.
    pub(super) quota_grants: Vec<crate::model::Grant>,
    /// The table's own bookkeeping that goes with it (nothing of it is written).
    pub(super) marks: Marks,
}

/// The table's own bookkeeping beside the records: applied with an outcome,
/// never written (a start rebuilds it).
#[derive(Default, Clone)]
pub(super) struct Marks {
    /// Leases told they near their expiry.
    pub(super) notices_sent: Vec<String>,
    /// Leases whose expiry notice is forgotten (a renewal): told again when they
    /// near their new expiry.
    pub(super) notices_cleared: Vec<String>,
    /// Leases whose devices a runtime has asked for: they never move again.
    pub(super) resolved: Vec<String>,
    /// Leases whose teardown runs now (another waits for it).
    pub(super) tearing_down: Vec<String>,
    /// A retried teardown's backoff: (lease, its tries and the next try's time,
    /// or None: forgotten).
    pub(super) teardown_backoff: Vec<(String, Option<(u32, i64)>)>,
    /// A dead MPS daemon's restart backoff, the same way.
    pub(super) mps_backoff: Vec<(String, Option<(u32, i64)>)>,
    /// When MPS daemons were last checked.
    pub(super) mps_checked_ms: Option<i64>,
    /// MPS host instances a CreateLease holds until its share is reserved, so
    /// housekeeping never reaps them in between.
    pub(super) host_claims: Vec<String>,
    /// A GPU read again (its description where it was unreadable, its MIG
    /// profiles).
    pub(super) gpu_read: Option<GpuRead>,
    /// MIG instances no record explains (a GI a failed create left that could not
    /// be undone): never touched, counted as occupied.
    pub(super) foreign: Vec<crate::gpu::MigInstance>,
}

impl Outcome {
    /// The intents of a sequence's hardware steps (`None`: a step without one),
    /// each finished at `at` as `how`.
    pub(super) fn finishing(
        intents: Vec<Option<i64>>,
        at: i64,
        how: &'static str,
    ) -> Vec<(i64, i64, &'static str)> {
        intents
            .into_iter()
            .flatten()
            .map(|i| (i, at, how))
            .collect()
    }

    /// Only the table's bookkeeping.
    pub(super) fn marks(marks: Marks) -> Self {
        Outcome {
            marks,
            ..Outcome::default()
        }
    }
}

/// A GPU that did not answer, read again.
#[derive(Clone)]
pub(super) struct GpuRead {
    pub(super) gpu: u32,
    pub(super) info: Option<crate::gpu::GpuInfo>,
    pub(super) profiles: Vec<crate::gpu::GiProfile>,
}

impl Outcome {
    /// True when committing it would write no row.
    pub(super) fn writes_nothing(&self) -> bool {
        self.gone.is_empty()
            && self.parts.is_empty()
            && self.leases.is_empty()
            && self.ended.is_empty()
            && self.usage.is_none()
            && self.finished.is_empty()
            && self.marked.is_empty()
            && self.unmarked.is_empty()
            && self.quota_grants.is_empty()
    }
}

/// How the commit of a [`Change`] is written.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Durability {
    /// Synced before the caller is answered.
    Durable,
    /// Atomic and in the write-ahead log (it survives the daemon's crash) but
    /// without a sync of its own: which containers run on a lease, which a power
    /// loss ends anyway.
    Relaxed,
}

/// A change outside a hardware sequence (a renewal, a new owner, a binding, an
/// unbinding, a health mark), as its decision answers it from the table: the
/// records it writes, how durably, and what the caller is answered. The executor
/// runs it (`run_change`): applied to the table under the decision's lock,
/// committed, and undone in the table if the commit is refused.
pub(super) struct Change<T> {
    pub(super) outcome: Outcome,
    pub(super) durability: Durability,
    pub(super) answer: T,
}

impl<T> Change<T> {
    /// Leases written durably, answering `answer`.
    pub(super) fn leases(leases: Vec<Lease>, answer: T) -> Self {
        Change {
            outcome: Outcome {
                leases,
                ..Outcome::default()
            },
            durability: Durability::Durable,
            answer,
        }
    }
}

/// When the table takes an outcome whose commit failed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Publish {
    /// Only once it is durable (the open intents redo the step at the next start).
    IfCommitted,
    /// Either way: the table follows the hardware, and the open intent finishes the
    /// record at the next start.
    Always,
}

/// A new lease placed: the lease (reserved: pending while any partition needs the
/// hardware changed) and its partitions in order (the first is its
/// `partition_id`), each with the hardware step it needs (none for a static-pool
/// instance or a whole GPU).
pub(super) struct Placement {
    pub(super) lease: Lease,
    pub(super) parts: Vec<(Partition, Option<HwCreate>)>,
}

/// What the decision needs to know of the request, checked and resolved.
pub(super) struct Ask<'r> {
    pub(super) req: &'r CreateRequest,
    pub(super) shape: Shape,
    pub(super) ttl: Duration,
    pub(super) priority_class: String,
    pub(super) lease_id: String,
    pub(super) partition_id: String,
    pub(super) now: i64,
    /// How many partitions (1 for most leases).
    pub(super) count: u32,
}

/// The decision about a request, from a snapshot of the table. A refusal is the
/// decision's `Err`.
pub(super) enum Plan {
    /// Place the new lease: reserve it in the table, then intent, hardware,
    /// outcome, publish.
    Place(Box<Placement>),
    /// Preempt these burst leases of other tenants, then decide again.
    Preempt(Vec<String>),
    /// Capacity is held by teardowns in progress: wait for them, then decide again.
    WaitTeardowns,
    /// Move these idle MIG leases, then decide again; the message is the refusal
    /// to give if a move fails.
    Move(Vec<partition::Move>, String),
    /// A call with the same request id reserved first (and may still be
    /// creating): answer as its retry.
    SameRequest,
}

/// What isolation a need asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// Its own hardware partition: a MIG instance (or a whole GPU).
    #[default]
    Hardware,
    /// A share of a GPU's SMs and memory under MPS limits.
    Shared,
}

/// A request by need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    pub memory_bytes: u64,
    pub isolation: Isolation,
    /// With `Isolation::Shared`: the MPS mode of the share.
    pub mps_mode: crate::gpu::MpsMode,
}

/// Largest need accepted (no GPU has more).
const MAX_NEED: u64 = 1 << 40;

impl Need {
    pub fn validate(&self) -> Result<(), LeaseError> {
        if self.memory_bytes == 0 || self.memory_bytes > MAX_NEED {
            return Err(invalid(
                "need.memory_bytes",
                "must be more than 0 and at most 1 TiB",
            ));
        }
        Ok(())
    }

    pub(super) fn describe(&self) -> String {
        let what = match self.isolation {
            Isolation::Hardware => "hardware isolation",
            Isolation::Shared => "a shared GPU",
        };
        format!(
            "{} of device memory with {what}",
            tessera_common::size::human(self.memory_bytes)
        )
    }
}
