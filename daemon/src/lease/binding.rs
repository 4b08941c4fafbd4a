//! The runtime's side: resolve a token to devices, bind and unbind containers.

use std::path::PathBuf;

use crate::gpu::MpsMode;
use crate::model::{ContainerBinding, Lease, LeaseState, PartKind, Partition};

use super::devices::{self, Resolved};
use super::error::Inconsistency;
use super::error::LeaseError;
use super::error::invalid;
use super::events::EventKind;
use super::manager::LeaseManager;
use super::plan::{Change, Durability, Marks, Outcome};
use super::table::State;
use super::token;

impl LeaseManager {
    /// The nvidia-uvm and nvidia-caps majors (config, else `/proc/devices`).
    ///
    /// `/proc/devices` is read at most once a second (the kernel formats every
    /// driver's line on each read; every container start resolves a token). A
    /// major changes only when its module is unloaded and loaded again, which
    /// cannot happen while containers use the GPU, and the nvidia module stays
    /// loaded while this daemon holds NVML.
    fn device_majors(&self) -> Result<(i64, i64), LeaseError> {
        const FRESH: std::time::Duration = std::time::Duration::from_secs(1);
        let cfg = &self.config.devices;
        let from_proc = cfg.nvidia_uvm_major.is_none() || cfg.nvidia_caps_major.is_none();
        let cached = self.majors.lock().ok().and_then(|m| *m);
        if let Some((at, majors)) = cached
            && from_proc
            && at.elapsed() < FRESH
        {
            return Ok(majors);
        }
        let text = if from_proc {
            self.host.proc_devices()?
        } else {
            String::new()
        };
        let simulated = self.backend.name() == "sim";
        let majors = devices::dynamic_majors(cfg, &text, simulated)?;
        if from_proc && let Ok(mut m) = self.majors.lock() {
            *m = Some((std::time::Instant::now(), majors));
        }
        Ok(majors)
    }

    /// The tenant and id of the lease `tok` is a token of, whatever the lease's state:
    /// for the audit record of a refused ResolveToken or BindContainer. None for a
    /// token the daemon does not know.
    pub fn token_lease(&self, tok: &str) -> Option<(String, String)> {
        if !token::looks_valid(tok) {
            return None;
        }
        let h = token::hash(tok);
        let st = self.read();
        let lease = st.leases.get(st.tokens.get(&h)?)?;
        Some((lease.tenant.clone(), lease.id.clone()))
    }

    pub fn resolve_token(&self, tok: &str) -> Result<Resolved, LeaseError> {
        let not_found = || LeaseError::NotFound("unknown, expired or revoked lease token".into());
        if !token::looks_valid(tok) {
            return Err(not_found());
        }
        let h = token::hash(tok);
        let lid = self.read().tokens.get(&h).cloned().ok_or_else(not_found)?;
        self.resolve(&lid, true, not_found)
    }

    /// What a container on live lease `id` gets (device nodes, env, mounts), as
    /// ResolveToken answers it, without holding the lease: a view (its CDI spec), so
    /// the lease may still move while no runtime has asked for its devices.
    pub fn view_devices(&self, id: &str) -> Result<Resolved, LeaseError> {
        self.resolve(id, false, || LeaseError::NotFound(format!("lease {id}")))
    }

    /// Resolve lease `lid`; `hold`: a runtime now holds its devices, so it never
    /// moves again.
    fn resolve(
        &self,
        lid: &str,
        hold: bool,
        not_found: impl Fn() -> LeaseError,
    ) -> Result<Resolved, LeaseError> {
        // A runtime that resolves a lease holds its devices: it never moves again.
        let found = self.hold_in_table(|st| {
            let found = found_in(st, lid, &not_found)?;
            let held = Outcome::marks(Marks {
                resolved: hold.then(|| found.lease.id.clone()).into_iter().collect(),
                ..Marks::default()
            });
            Ok((held, found))
        })?;
        let Found {
            lease,
            mut parts,
            host,
        } = found;
        if parts.len() != 1 {
            return self.resolve_several(&lease, parts);
        }
        let (partition, gpu) = parts.remove(0);
        let device = host.as_ref().unwrap_or(&partition);
        let minors = match device.kind {
            PartKind::Mig(_) => self.backend.mig_minors()?,
            _ => Default::default(),
        };
        let majors = self.device_majors()?;
        let mut resolved = self.devices_of(&lease, device, &gpu, &minors, majors);
        if host.is_some() {
            devices::add_mps_share(&mut resolved, &partition);
        }
        Ok(resolved)
    }

    /// What a container of `lease` gets of partition `p` on `gpu`, with this
    /// node's device configuration.
    fn devices_of(
        &self,
        lease: &Lease,
        p: &Partition,
        gpu: &crate::gpu::GpuInfo,
        minors: &crate::gpu::MigMinors,
        majors: (i64, i64),
    ) -> Resolved {
        devices::resolve(
            lease,
            p,
            gpu.minor,
            &gpu.uuid,
            minors,
            &self.config.devices,
            majors,
            self.config.lease.pids_limit,
        )
    }

    /// The devices of a multi-partition lease (N whole GPUs or N MIG instances):
    /// each partition's, in one answer.
    fn resolve_several(
        &self,
        lease: &Lease,
        parts: Vec<(Partition, crate::gpu::GpuInfo)>,
    ) -> Result<Resolved, LeaseError> {
        let minors = if parts.iter().any(|(p, _)| p.mig().is_some()) {
            self.backend.mig_minors()?
        } else {
            Default::default()
        };
        let majors = self.device_majors()?;
        let each = parts
            .iter()
            .map(|(p, gpu)| self.devices_of(lease, p, gpu, &minors, majors))
            .collect();
        let inconsistent = |i| LeaseError::Inconsistent(i);
        devices::merge_several(each)
            .map_err(|e| {
                inconsistent(Inconsistency::PartitionsDisagree {
                    lease: lease.id.clone(),
                    reason: e.to_string(),
                })
            })?
            .ok_or_else(|| inconsistent(Inconsistency::LeaseWithoutPartition(lease.id.clone())))
    }

    /// Record a container on the lease its token names (the runtime calls this
    /// before runc). `uid` is the container's uid: an MPS lease's pipe and log
    /// directories are handed to it (mode 0700); MPS serves one uid at a time, so a
    /// container with another uid is refused.
    pub async fn bind_container(
        &self,
        tok: &str,
        binding: ContainerBinding,
        uid: Option<u32>,
    ) -> Result<Lease, LeaseError> {
        self.bind_container_checked(tok, binding, uid, |_| Ok(()))
            .await
    }

    /// [`Self::bind_container`], refused (nothing bound) when `check` refuses the
    /// token's current resolution: the runtime's answer must still be current.
    pub async fn bind_container_checked(
        &self,
        tok: &str,
        binding: ContainerBinding,
        uid: Option<u32>,
        check: impl FnOnce(&Resolved) -> Result<(), LeaseError>,
    ) -> Result<Lease, LeaseError> {
        check_binding(&binding)?;
        let resolved = self.resolve_token(tok)?;
        check(&resolved)?;
        let lease = self
            .run_change(
                |st| decide_binding(st, &resolved, &binding, uid),
                async |b: &Bound| self.hand_dirs(uid, b.handed.as_ref()),
                |b: &Bound| self.hand_dirs_back(b.handed.as_ref()),
            )
            .await?
            .lease;
        self.emit(EventKind::ContainerBound, &lease, None, binding.id);
        Ok(lease)
    }

    /// The host side of a binding: the MPS directories handed to `uid` when its
    /// server was.
    fn hand_dirs(&self, uid: Option<u32>, handed: Option<&Handed>) -> Result<(), LeaseError> {
        if let (Some(uid), Some((_, pipe, log))) = (uid, handed) {
            for dir in [pipe.parent(), Some(pipe.as_path()), Some(log.as_path())]
                .into_iter()
                .flatten()
            {
                self.host.chown(dir, uid)?;
            }
        }
        Ok(())
    }

    /// A binding that could not be recorded: the MPS directories it handed to a
    /// uid go back to root, unless a shared server's other leases use them.
    fn hand_dirs_back(&self, handed: Option<&Handed>) {
        let Some((p, pipe, log)) = handed else {
            return;
        };
        if self.read().partitions.shared_server_owner(p).is_some() {
            return;
        }
        for dir in [pipe.parent(), Some(pipe.as_path()), Some(log.as_path())]
            .into_iter()
            .flatten()
        {
            if let Err(e) = self.host.chown(dir, 0) {
                tracing::warn!(dir = %dir.display(), error = %e, "could not hand an MPS directory back to root");
            }
        }
    }

    /// Forget a container on every lease it is bound to (a container may run on
    /// several leases: one per device a Kubernetes container asked for). With a
    /// `runtime_root`, only the bindings made under that runc root: a container of
    /// the same id under another root keeps its own.
    pub async fn unbind_container(
        &self,
        container_id: &str,
        runtime_root: Option<&str>,
    ) -> Result<(), LeaseError> {
        let this = |c: &ContainerBinding| {
            c.id == container_id && runtime_root.is_none_or(|r| c.runtime_root == r)
        };
        let unbound = self
            .run_records(|st| Ok(decide_unbinding(st, this)))
            .await?;
        for lease in &unbound {
            self.emit(
                EventKind::ContainerUnbound,
                lease,
                None,
                container_id.to_string(),
            );
        }
        Ok(())
    }
}

/// A container on a lease, as the decision to bind it answers: the lease with
/// the binding, and the MPS partition handed to the container's uid, if it was.
struct Bound {
    lease: Lease,
    handed: Option<Handed>,
}

/// The binding of `binding` (a container of `uid`) on `resolved`'s lease: the
/// lease with it (a binding of the same container replaced), the pod's claim on
/// the token, an MPS server handed to the uid; or the refusal. A binding only
/// says which containers run, and an OS crash that could lose an unsynced commit
/// ends them all: relaxed (no fsync on the runtime's path). What outlives the
/// containers is durable: a pod's claim on the token, and the uid an MPS server
/// was handed.
fn decide_binding(
    st: &State,
    resolved: &Resolved,
    binding: &ContainerBinding,
    uid: Option<u32>,
) -> Result<Change<Bound>, LeaseError> {
    let id = &resolved.lease.id;
    let n = st.leases.get(id).map(|l| l.containers.len()).unwrap_or(0);
    if n >= 1024 {
        return Err(LeaseError::ResourceExhausted(format!(
            "lease {id} already has {n} containers"
        )));
    }
    let handed = hand_mps_server(st, &resolved.partition, uid)?;
    let mut lease = st
        .leases
        .get(id)
        .cloned()
        .ok_or_else(|| LeaseError::NotFound("lease ended".into()))?;
    let pod_claimed = claim_for_pod(&mut lease, &binding.pod)?;
    lease.containers.retain(|c| c.id != binding.id);
    lease.containers.push(binding.clone());
    let mut change = Change::leases(vec![lease.clone()], Bound { lease, handed });
    if let Some((p, _, _)) = &change.answer.handed {
        change.outcome.parts.push(p.clone());
    }
    if change.answer.handed.is_none() && !pod_claimed {
        change.durability = Durability::Relaxed;
    }
    Ok(change)
}

/// A container forgotten on every lease it is bound to (`this` names its
/// bindings): those leases without it, written relaxed as a bind is (a binding an
/// OS crash brings back names a container that crash ended, and housekeeping
/// drops it).
fn decide_unbinding(st: &State, this: impl Fn(&ContainerBinding) -> bool) -> Change<Vec<Lease>> {
    let unbound: Vec<Lease> = st
        .leases
        .values()
        .filter(|l| l.containers.iter().any(&this))
        .map(|l| {
            let mut l = l.clone();
            l.containers.retain(|c| !this(c));
            l
        })
        .collect();
    let mut change = Change::leases(unbound.clone(), unbound);
    change.durability = Durability::Relaxed;
    change
}

/// A termination-message path is a clean absolute host path (the daemon writes a
/// revocation's reason there, never following a symlink), or empty.
fn check_termination_log(path: &str) -> Result<(), LeaseError> {
    if path.is_empty() {
        return Ok(());
    }
    let kernel = ["/proc/", "/sys/", "/dev/"]
        .iter()
        .any(|p| path.starts_with(p));
    let clean = path.len() <= 4096
        && !kernel
        && path.starts_with('/')
        && !path.contains('\0')
        && path[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if clean {
        Ok(())
    } else {
        Err(invalid(
            "termination_log_path",
            "must be a clean absolute host path outside /proc, /sys and /dev",
        ))
    }
}

/// The GPU a partition is on, as the table knows it.
fn gpu_of(st: &State, p: &Partition) -> Result<crate::gpu::GpuInfo, LeaseError> {
    st.gpus
        .iter()
        .find(|g| g.info.index == p.gpu)
        .map(|g| g.info.clone())
        .ok_or_else(|| {
            LeaseError::Inconsistent(Inconsistency::PartitionOnUnknownGpu {
                partition: p.id.clone(),
                gpu: p.gpu,
            })
        })
}

/// A live lease a runtime may have the devices of, as the table holds it: its
/// partitions, each with its GPU, and (MPS inside MIG) the host instance whose
/// devices the container gets.
struct Found {
    lease: Lease,
    parts: Vec<(Partition, crate::gpu::GpuInfo)>,
    host: Option<Partition>,
}

/// Live lease `lid` and what its devices are made of; refused while it is not
/// resolvable (see [`resolvable`]).
fn found_in(
    st: &State,
    lid: &str,
    not_found: &impl Fn() -> LeaseError,
) -> Result<Found, LeaseError> {
    let lease = resolvable(st, lid, not_found)?;
    if lease.partition_count() > 1 {
        let parts = LeaseManager::lease_partitions(st, &lease)?
            .into_iter()
            .map(|p| gpu_of(st, &p).map(|gpu| (p, gpu)))
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(Found {
            lease,
            parts,
            host: None,
        });
    }
    let (partition, gpu, host) = one_partition(st, &lease)?;
    Ok(Found {
        lease,
        parts: vec![(partition, gpu)],
        host,
    })
}

/// An MPS partition handed to a container's uid: the partition (its owner set),
/// its pipe and its log directory.
type Handed = (Partition, PathBuf, PathBuf);

/// Live lease `lid`, if a runtime may have its devices now: active and not moving.
fn resolvable(
    st: &State,
    lid: &str,
    not_found: &impl Fn() -> LeaseError,
) -> Result<Lease, LeaseError> {
    let lease = st.leases.get(lid).cloned().ok_or_else(not_found)?;
    if st.moving.contains(&lease.id) {
        return Err(LeaseError::FailedPrecondition(format!(
            "lease {} is being moved to another MIG placement; retry in a moment",
            lease.id
        )));
    }
    if lease.state() != LeaseState::Active {
        return Err(LeaseError::FailedPrecondition(format!(
            "lease {} is {}",
            lease.id,
            lease.state().as_str()
        )));
    }
    Ok(lease)
}

/// The partition of a lease of one, its GPU, and (MPS inside MIG) the host
/// instance whose devices the container gets.
fn one_partition(
    st: &State,
    lease: &Lease,
) -> Result<(Partition, crate::gpu::GpuInfo, Option<Partition>), LeaseError> {
    let partition = st
        .partitions
        .get(&lease.partition_id)
        .cloned()
        .ok_or_else(|| {
            LeaseError::Inconsistent(Inconsistency::LeaseWithoutPartition(lease.id.clone()))
        })?;
    let gpu = gpu_of(st, &partition)?;
    let host =
        match partition.mps().and_then(|m| m.host.as_ref()) {
            Some(h) => Some(st.partitions.get(h).cloned().ok_or_else(|| {
                LeaseError::Inconsistent(Inconsistency::UnknownPartition(h.clone()))
            })?),
            None => None,
        };
    Ok((partition, gpu, host))
}

/// The checks of a binding that need no state.
fn check_binding(binding: &ContainerBinding) -> Result<(), LeaseError> {
    if binding.id.is_empty() || binding.id.len() > 1024 {
        return Err(invalid("container_id", "must be 1-1024 characters"));
    }
    if binding.cgroup_path.len() > 4096 || binding.runtime_root.len() > 4096 {
        return Err(invalid(
            "cgroup_path",
            "cgroup_path and runtime_root are at most 4096 bytes",
        ));
    }
    // A revocation stops the container through this cgroup: it must be the
    // container's own, checked now rather than when it is needed.
    if !binding.cgroup_path.is_empty()
        && let Err(e) = super::enforce::cgroup_of(binding)
    {
        return Err(invalid("cgroup_path", e.to_string()));
    }
    check_termination_log(&binding.termination_log)?;
    if binding.pod.len() > 256 || binding.pod.chars().any(char::is_control) {
        return Err(invalid("pod", "at most 256 printable characters"));
    }
    Ok(())
}

/// A container of `uid` on MPS partition `partition`: refused when its server
/// serves another uid, else the partition handed to `uid` if it was not yet. A
/// shared server serves one uid (MPS starts a server per uid and makes other uids
/// wait): the uid of the first container bound to any of its leases.
fn hand_mps_server(
    st: &State,
    partition: &Partition,
    uid: Option<u32>,
) -> Result<Option<Handed>, LeaseError> {
    let server_owner = st.partitions.shared_server_owner(partition);
    let (Some(uid), Some(p)) = (uid, st.partitions.get(&partition.id)) else {
        return Ok(None);
    };
    let mut p = p.clone();
    let PartKind::Mps(m) = &mut p.kind else {
        return Ok(None);
    };
    match m.owner_uid.or(server_owner) {
        Some(owner) if owner != uid && m.mode == MpsMode::Shared => {
            Err(LeaseError::FailedPrecondition(format!(
                "the shared MPS server of GPU {} serves uid {owner}; a container running as uid {uid} cannot share it (run as uid {owner}, or lease in isolated mode)",
                p.gpu
            )))
        }
        Some(owner) if owner != uid => Err(LeaseError::FailedPrecondition(format!(
            "this MPS lease serves uid {owner}; a container running as uid {uid} cannot share its MPS server"
        ))),
        Some(_) if m.owner_uid.is_some() => Ok(None),
        Some(_) | None => {
            m.owner_uid = Some(uid);
            let dirs = (m.pipe_dir.clone(), m.log_dir.clone());
            Ok(Some((p.clone(), dirs.0, dirs.1)))
        }
    }
}

/// The token belongs to the first pod that uses it; another pod presenting it
/// (copied from an annotation, say) is refused. A lease bound to a pod serves that
/// pod only: a container that names no pod is refused, not let through. True when
/// `pod` claims the lease now.
fn claim_for_pod(l: &mut Lease, pod: &str) -> Result<bool, LeaseError> {
    if pod.is_empty() {
        if let Some(owner) = &l.pod {
            return Err(LeaseError::PermissionDenied(format!(
                "the token of lease {} is bound to pod {owner}; a container in no pod may not use it",
                l.id
            )));
        }
        return Ok(false);
    }
    if let Some(owner) = &l.pod {
        if owner != pod {
            return Err(LeaseError::PermissionDenied(format!(
                "the token of lease {} is bound to pod {owner}; pod {pod} may not use it",
                l.id
            )));
        }
        return Ok(false);
    }
    l.pod = Some(pod.to_string());
    Ok(true)
}
