//! The domain model: leases, partitions, intents and grants as plain Rust types,
//! and the lease state machine.
//!
//! ```text
//!            reserve (hardware to set up)          reserve (nothing to set up)
//!                 |                                        |
//!                 v        activate                        v
//!             pending ---------------------------->    active ----renew----+
//!                 |                                   |    ^               |
//!            fail |                         begin_end |    +---------------+
//!                 v                                   v
//!              failed                             revoking
//!                                                     | finish_end
//!                                                     v
//!                                   released | expired | revoked
//!
//!   lose: pending | active | revoking -> revoked (its partition is gone for good)
//! ```
//!
//! The life-cycle fields of [`Lease`] are private: this module is the only place a
//! lease's state changes, each change guarded by a `LeaseState::can_*` check. These
//! types are what the store persists and what the API converts to protobuf.
//!
//! May use: names, gpu (placements), partition (shapes), config (amounts). May not
//! touch: the store, the lease core or the API.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::gpu::{HealthCause, Placement};
use crate::partition::Shape;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    /// Intent recorded, hardware being set up.
    Pending,
    Active,
    /// Containers being stopped, partition being torn down.
    Revoking,
    Released,
    Expired,
    Revoked,
    Failed,
}

impl LeaseState {
    pub fn is_live(self) -> bool {
        matches!(
            self,
            LeaseState::Pending | LeaseState::Active | LeaseState::Revoking
        )
    }

    /// Its hardware can be declared set up.
    pub fn can_activate(self) -> bool {
        self == LeaseState::Pending
    }
    /// Its hardware set-up can be declared failed.
    pub fn can_fail(self) -> bool {
        self == LeaseState::Pending
    }
    /// It can start ending (release, expiry, revocation).
    pub fn can_begin_end(self) -> bool {
        self == LeaseState::Active
    }
    /// Its teardown can be declared done.
    pub fn can_finish_end(self) -> bool {
        self == LeaseState::Revoking
    }
    /// It can get a new expiry.
    pub fn can_renew(self) -> bool {
        self == LeaseState::Active
    }
    /// A container may be started on it.
    pub fn can_bind(self) -> bool {
        self == LeaseState::Active
    }

    pub fn as_str(self) -> &'static str {
        match self {
            LeaseState::Pending => "pending",
            LeaseState::Active => "active",
            LeaseState::Revoking => "revoking",
            LeaseState::Released => "released",
            LeaseState::Expired => "expired",
            LeaseState::Revoked => "revoked",
            LeaseState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<LeaseState> {
        Some(match s {
            "pending" => LeaseState::Pending,
            "active" => LeaseState::Active,
            "revoking" => LeaseState::Revoking,
            "released" => LeaseState::Released,
            "expired" => LeaseState::Expired,
            "revoked" => LeaseState::Revoked,
            "failed" => LeaseState::Failed,
            _ => return None,
        })
    }
}

/// A container bound to a lease by the runtime.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerBinding {
    pub id: String,
    /// The cgroup the container runs in, as its caller gave it (cgroupfs path or
    /// systemd's `slice:prefix:name`): where a revocation stops it.
    pub cgroup_path: String,
    pub runtime_root: String,
    pub bound_at_ms: i64,
    /// Host path of the container's termination-message file; empty when none.
    #[serde(default)]
    pub termination_log: String,
    /// The pod (CRI sandbox id, else pod uid) the container belongs to.
    #[serde(default)]
    pub pod: String,
}

/// A lease as the store keeps it. Its life-cycle fields (`state`, `ending_as`,
/// `end_reason`, `ended_at_ms`) are private: they change only through the
/// transition methods below, each guarded by a `LeaseState::can_*` check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub id: String,
    pub tenant: String,
    state: LeaseState,
    pub shape: Shape,
    /// Its (first) partition; `gpu` is that partition's GPU.
    pub partition_id: String,
    pub gpu: u32,
    /// A lease of several partitions (N whole GPUs or N MIG instances of one
    /// profile, `shape` being the shape of each): the partitions after the first,
    /// in order. Empty for a lease of one (and in records from before them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more_partitions: Vec<String>,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub ttl_secs: u64,
    pub request_id: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub priority_class: String,
    /// Beyond the tenant's guarantee: may be preempted.
    pub burst: bool,
    /// The state a revoking lease ends in (released, expired or revoked).
    ending_as: Option<LeaseState>,
    end_reason: Option<String>,
    ended_at_ms: Option<i64>,
    pub containers: Vec<ContainerBinding>,
    /// The pod the lease's token is bound to: the first pod that bound a container
    /// with it. Another pod presenting the token is refused.
    #[serde(default)]
    pub pod: Option<String>,
    /// The request pinned the lease to its GPU (`gpu_index`): it never moves.
    #[serde(default)]
    pub pinned_gpu: bool,
    /// Why the lease's GPU or MIG instance is out of service, while it is. Not
    /// stored with the lease: it follows the GPU's health marks.
    #[serde(skip)]
    pub unhealthy: Option<String>,
}

/// What a new lease is made of (everything but its life cycle).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLease {
    pub id: String,
    pub tenant: String,
    pub shape: Shape,
    pub partition_id: String,
    pub gpu: u32,
    /// The partitions after the first (a multi-partition lease).
    pub more_partitions: Vec<String>,
    pub created_at_ms: i64,
    pub ttl_secs: u64,
    pub request_id: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub priority_class: String,
    pub burst: bool,
}

/// A transition the lease state machine does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease state {} cannot become {}", from.as_str(), to.as_str())]
pub struct IllegalTransition {
    pub from: LeaseState,
    pub to: LeaseState,
}

impl Lease {
    /// A lease just reserved: `pending` while its hardware is being set up, `active`
    /// when there is nothing to set up (a static or whole-GPU partition).
    pub fn reserved(n: NewLease, hardware_pending: bool) -> Lease {
        Lease {
            id: n.id,
            tenant: n.tenant,
            state: if hardware_pending {
                LeaseState::Pending
            } else {
                LeaseState::Active
            },
            shape: n.shape,
            partition_id: n.partition_id,
            gpu: n.gpu,
            more_partitions: n.more_partitions,
            created_at_ms: n.created_at_ms,
            expires_at_ms: n
                .created_at_ms
                .saturating_add((n.ttl_secs as i64).saturating_mul(1000)),
            ttl_secs: n.ttl_secs,
            request_id: n.request_id,
            labels: n.labels,
            priority_class: n.priority_class,
            burst: n.burst,
            ending_as: None,
            end_reason: None,
            ended_at_ms: None,
            containers: vec![],
            pod: None,
            pinned_gpu: false,
            unhealthy: None,
        }
    }

    pub fn state(&self) -> LeaseState {
        self.state
    }
    /// Every partition of the lease, the first first.
    pub fn partition_ids(&self) -> impl Iterator<Item = &String> {
        std::iter::once(&self.partition_id).chain(self.more_partitions.iter())
    }
    /// How many partitions it holds (quota and usage count each).
    pub fn partition_count(&self) -> u32 {
        u32::try_from(self.more_partitions.len())
            .unwrap_or(u32::MAX)
            .saturating_add(1)
    }
    /// The state a revoking lease will end in.
    pub fn ending_as(&self) -> Option<LeaseState> {
        self.ending_as
    }
    pub fn end_reason(&self) -> Option<&str> {
        self.end_reason.as_deref()
    }
    pub fn ended_at_ms(&self) -> Option<i64> {
        self.ended_at_ms
    }

    fn guard(&self, ok: bool, to: LeaseState) -> Result<(), IllegalTransition> {
        if ok {
            Ok(())
        } else {
            Err(IllegalTransition {
                from: self.state,
                to,
            })
        }
    }

    /// pending -> active: its hardware exists.
    pub fn activate(&mut self) -> Result<(), IllegalTransition> {
        self.guard(self.state.can_activate(), LeaseState::Active)?;
        self.state = LeaseState::Active;
        Ok(())
    }

    /// pending -> failed: its hardware could not be set up.
    pub fn fail(&mut self, reason: String, at_ms: i64) -> Result<(), IllegalTransition> {
        self.guard(self.state.can_fail(), LeaseState::Failed)?;
        self.state = LeaseState::Failed;
        self.end_reason = Some(reason);
        self.ended_at_ms = Some(at_ms);
        Ok(())
    }

    /// active -> revoking: its containers are stopped and its partition torn down
    /// next; it then ends as `ending_as` (released, expired or revoked).
    pub fn begin_end(
        &mut self,
        ending_as: LeaseState,
        reason: &str,
    ) -> Result<(), IllegalTransition> {
        let final_ok = matches!(
            ending_as,
            LeaseState::Released | LeaseState::Expired | LeaseState::Revoked
        );
        self.guard(self.state.can_begin_end() && final_ok, ending_as)?;
        self.state = LeaseState::Revoking;
        self.ending_as = Some(ending_as);
        self.end_reason = Some(reason.to_string());
        Ok(())
    }

    /// revoking -> released | expired | revoked: its teardown is done.
    pub fn finish_end(&mut self, at_ms: i64) -> Result<LeaseState, IllegalTransition> {
        let to = self.ending_as.unwrap_or(LeaseState::Released);
        self.guard(self.state.can_finish_end(), to)?;
        self.state = to;
        self.ended_at_ms = Some(at_ms);
        // Its containers were stopped: an ended lease lists none.
        self.containers.clear();
        Ok(to)
    }

    /// Tests only: the lease as a store might hold it in any state, without the
    /// transitions that lead there.
    #[cfg(test)]
    pub fn with_state(mut self, state: LeaseState, ended_at_ms: Option<i64>) -> Lease {
        self.state = state;
        self.ended_at_ms = ended_at_ms;
        self
    }

    /// Any live state -> revoked: its partition is gone for good (found at start).
    pub fn lose(&mut self, reason: String, at_ms: i64) -> Result<(), IllegalTransition> {
        self.guard(self.state.is_live(), LeaseState::Revoked)?;
        self.state = LeaseState::Revoked;
        self.end_reason = Some(reason);
        self.ended_at_ms = Some(at_ms);
        self.containers.clear();
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Declared in the operator's static layout: returns to the pool on release.
    Static,
    /// Created on demand for a lease.
    Dynamic,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionState {
    /// Intent recorded, hardware change in progress.
    Creating,
    Ready,
    /// Intent recorded, teardown in progress (or retried after a failure).
    Destroying,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigPart {
    pub gi_profile_id: u32,
    pub profile: String,
    pub placement: Placement,
    pub ci_profile_id: Option<u32>,
    pub compute_profile: Option<String>,
    pub gi_id: Option<u32>,
    pub ci_id: Option<u32>,
    pub uuid: Option<String>,
    pub memory_bytes: u64,
    pub sm_count: u32,
    pub slices: u32,
    /// Some(tenant) while the instance hosts MPS shares of that tenant (MPS inside
    /// MIG): not leased itself, not free for MIG leases.
    #[serde(default)]
    pub mps_host: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MpsPart {
    pub sm_percent: u32,
    pub memory_bytes: u64,
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    /// The uid the lease's containers run as (owner of the pipe and log dirs).
    #[serde(default)]
    pub owner_uid: Option<u32>,
    /// Isolated: its own control daemon under `<run_dir>/mps/<lease>`; shared: the
    /// GPU's shared server for its tenant under `<run_dir>/mps/shared-gpu<N>-<tenant>`
    /// (records before modes existed are isolated).
    #[serde(default)]
    pub mode: crate::gpu::MpsMode,
    /// MPS inside MIG: the partition id of the MIG instance it runs on (its device;
    /// the share's `gpu_uuid` is the instance's MIG uuid).
    #[serde(default)]
    pub host: Option<String>,
}

/// The key (and directory name under `<run_dir>/mps`) of the MPS server of a MIG
/// instance hosting shares (its partition id).
pub fn mig_mps_key(host_partition: &str) -> String {
    format!("mig-{host_partition}")
}

/// The key (and directory name under `<run_dir>/mps`) of the shared MPS server of a
/// tenant on a GPU.
pub fn shared_mps_key(gpu: u32, tenant: &str) -> String {
    format!("shared-gpu{gpu}-{tenant}")
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PartKind {
    Mig(MigPart),
    Mps(MpsPart),
    WholeGpu,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    pub id: String,
    pub gpu: u32,
    pub gpu_uuid: String,
    pub origin: Origin,
    pub state: PartitionState,
    pub lease_id: Option<String>,
    pub kind: PartKind,
}

impl Partition {
    pub fn mig(&self) -> Option<&MigPart> {
        match &self.kind {
            PartKind::Mig(m) => Some(m),
            _ => None,
        }
    }
    pub fn mps(&self) -> Option<&MpsPart> {
        match &self.kind {
            PartKind::Mps(m) => Some(m),
            _ => None,
        }
    }

    /// The key of the MPS control daemon that serves an MPS partition leased to
    /// `lease_id`: the lease itself (isolated) or the shared server (shared: the
    /// name of the directory that holds its pipe and log directories).
    pub fn mps_daemon_key(&self, lease_id: &str) -> Option<String> {
        let m = self.mps()?;
        match m.mode {
            crate::gpu::MpsMode::Isolated => Some(lease_id.to_string()),
            crate::gpu::MpsMode::Shared => m
                .pipe_dir
                .parent()
                .and_then(|d| d.file_name())
                .map(|n| n.to_string_lossy().into_owned()),
        }
    }

    /// The MPS control daemon spec of an MPS partition leased to `lease_id`. A
    /// shared server has no daemon-side limits (100%, no memory limit) and keeps its
    /// directories' owner as the binding set it.
    pub fn mps_spec(&self, lease_id: &str) -> Option<crate::gpu::MpsSpec> {
        let m = self.mps()?;
        let key = self.mps_daemon_key(lease_id)?;
        let shared = m.mode == crate::gpu::MpsMode::Shared;
        Some(crate::gpu::MpsSpec {
            lease_id: key,
            gpu: self.gpu,
            gpu_uuid: self.gpu_uuid.clone(),
            sm_percent: if shared { 100 } else { m.sm_percent },
            memory_bytes: if shared { 0 } else { m.memory_bytes },
            pipe_dir: m.pipe_dir.clone(),
            log_dir: m.log_dir.clone(),
            owner_uid: if shared { None } else { m.owner_uid },
            mode: m.mode,
        })
    }
}

/// A hardware change the daemon is about to make (write-ahead).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IntentOp {
    CreateMig,
    DestroyMig,
    StartMps,
    StopMps,
    /// An idle lease's MIG instance moves: the partition named is the new one.
    MoveMig,
}

impl IntentOp {
    pub fn as_str(self) -> &'static str {
        match self {
            IntentOp::CreateMig => "create_mig",
            IntentOp::DestroyMig => "destroy_mig",
            IntentOp::StartMps => "start_mps",
            IntentOp::StopMps => "stop_mps",
            IntentOp::MoveMig => "move_mig",
        }
    }
    pub fn parse(s: &str) -> Option<IntentOp> {
        Some(match s {
            "create_mig" => IntentOp::CreateMig,
            "destroy_mig" => IntentOp::DestroyMig,
            "start_mps" => IntentOp::StartMps,
            "stop_mps" => IntentOp::StopMps,
            "move_mig" => IntentOp::MoveMig,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intent {
    pub id: i64,
    pub op: IntentOp,
    pub partition_id: String,
    pub lease_id: Option<String>,
    pub created_at_ms: i64,
}

/// A temporary quota raise granted by an admin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub id: String,
    pub tenant: String,
    #[serde(with = "amounts_serde")]
    pub extra: crate::config::Amounts,
    pub expires_at_ms: i64,
    pub reason: String,
    pub granted_by: String,
    pub created_at_ms: i64,
}

mod amounts_serde {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::config::Amounts;

    #[derive(Serialize, Deserialize)]
    struct A {
        mig_slices: u32,
        mps_sm_percent: u32,
        memory_bytes: u64,
        whole_gpus: u32,
    }

    pub fn serialize<S: Serializer>(a: &Amounts, s: S) -> Result<S::Ok, S::Error> {
        A {
            mig_slices: a.mig_slices,
            mps_sm_percent: a.mps_sm_percent,
            memory_bytes: a.memory_bytes,
            whole_gpus: a.whole_gpus,
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Amounts, D::Error> {
        let a = A::deserialize(d)?;
        Ok(Amounts {
            mig_slices: a.mig_slices,
            mps_sm_percent: a.mps_sm_percent,
            memory_bytes: a.memory_bytes,
            whole_gpus: a.whole_gpus,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod lifecycle_tests {
    use super::*;

    fn new(hardware_pending: bool) -> Lease {
        Lease::reserved(
            NewLease {
                id: "l-1".into(),
                tenant: "t".into(),
                shape: Shape::WholeGpu,
                partition_id: "p-1".into(),
                gpu: 0,
                more_partitions: vec![],
                created_at_ms: 1_000,
                ttl_secs: 60,
                request_id: None,
                labels: BTreeMap::new(),
                priority_class: "batch".into(),
                burst: false,
            },
            hardware_pending,
        )
    }

    #[test]
    fn a_lease_lives_pending_active_revoking_ended() -> Result<(), IllegalTransition> {
        let mut l = new(true);
        assert_eq!((l.state(), l.expires_at_ms), (LeaseState::Pending, 61_000));
        l.activate()?;
        l.containers.push(ContainerBinding {
            id: "c1".into(),
            bound_at_ms: 2_000,
            ..Default::default()
        });
        l.begin_end(LeaseState::Expired, "TTL ran out")?;
        assert_eq!(l.state(), LeaseState::Revoking);
        assert_eq!(l.containers.len(), 1, "a revoking lease still has them");
        assert_eq!(l.ending_as(), Some(LeaseState::Expired));
        assert_eq!(l.finish_end(70_000)?, LeaseState::Expired);
        assert_eq!(
            (l.end_reason(), l.ended_at_ms()),
            (Some("TTL ran out"), Some(70_000))
        );
        Ok(())
    }

    #[test]
    fn transitions_the_machine_lacks_are_refused_and_change_nothing() {
        let mut l = new(false);
        assert_eq!(l.state(), LeaseState::Active, "nothing to set up");
        let before = l.clone();
        let e = l.activate().unwrap_err();
        assert_eq!((e.from, e.to), (LeaseState::Active, LeaseState::Active));
        assert!(l.fail("x".into(), 1).is_err());
        assert!(l.finish_end(1).is_err(), "not revoking");
        assert!(
            l.begin_end(LeaseState::Pending, "x").is_err(),
            "not a final state"
        );
        assert_eq!(l, before);
        assert!(l.begin_end(LeaseState::Released, "bye").is_ok());
        assert!(l.begin_end(LeaseState::Released, "again").is_err());
        assert_eq!(e.to_string(), "lease state active cannot become active");
    }

    #[test]
    fn only_live_leases_can_be_lost() -> Result<(), IllegalTransition> {
        let mut l = new(true);
        l.lose("instance vanished".into(), 5)?;
        assert_eq!(l.state(), LeaseState::Revoked);
        assert!(l.lose("again".into(), 6).is_err());
        let mut f = new(true);
        f.fail("no room".into(), 2)?;
        assert_eq!(f.state(), LeaseState::Failed);
        assert!(!f.state().can_bind() && !f.state().can_renew());
        Ok(())
    }
}

/// A GPU (or one of its MIG instances) out of service, as the store keeps it until
/// it is back: marked by a health event, a poll, or an operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthMark {
    /// The GPU's UUID: indices can change across reboots, UUIDs do not.
    pub gpu_uuid: String,
    /// The GPU's index when the mark was made (and at the last start).
    pub gpu: u32,
    /// The MIG GPU instance, for a mark confined to one; None for the whole GPU.
    pub gi_id: Option<u32>,
    pub cause: HealthCause,
    pub since_ms: i64,
}

impl HealthMark {
    /// The store's key: `<uuid>` or `<uuid>/gi<N>`.
    pub fn key(&self) -> String {
        match self.gi_id {
            Some(gi) => format!("{}/gi{gi}", self.gpu_uuid),
            None => self.gpu_uuid.clone(),
        }
    }

    /// "GPU 0" or "GPU 0 instance 3", then the cause.
    pub fn describe(&self) -> String {
        match self.gi_id {
            Some(gi) => format!("GPU {} instance {gi}: {}", self.gpu, self.cause),
            None => format!("GPU {}: {}", self.gpu, self.cause),
        }
    }
}
