//! Ending a lease (release, expiry, revocation): stop its containers, tear the partition down write-ahead, record the end.

use tessera_common::clock::now_ms;
use tracing::{info, warn};

use crate::config::OnRelease;

use crate::gpu::{GpuError, MpsMode};
use crate::model::{Lease, LeaseState, Origin, PartKind, Partition, PartitionState};
use crate::names::truncate;

use super::enforce;
use super::error::Inconsistency;
use super::error::LeaseError;
use super::events::EventKind;
use super::manager::LeaseManager;
use super::plan::{DestroyError, HwDestroy, Marks, Outcome, Publish, TeardownStep};
use super::table::State;

pub(super) fn hw_keeps(p: &Partition, on_release: OnRelease) -> bool {
    matches!(p.kind, PartKind::Mig(_))
        && (p.origin == Origin::Static || on_release == OnRelease::Keep)
}

impl LeaseManager {
    /// Release (tenant), expire (TTL) or revoke (admin, preemption) a lease. Returns
    /// the lease as it is afterwards: ended, or `revoking` when teardown must be
    /// retried (it then finishes in the background).
    pub async fn end(
        &self,
        id: &str,
        ending_as: LeaseState,
        reason: &str,
    ) -> Result<Lease, LeaseError> {
        self.wait_while_moving(id).await;
        let (lease, steps, before) = match self.hold_in_table(|st| {
            let Some(ending) = self.decide_end(st, id, ending_as, reason)? else {
                return Ok((Outcome::default(), None));
            };
            // The lease revoking in the table, its teardown running; its intent
            // records both.
            let begun = Outcome {
                leases: vec![ending.0.clone()],
                marks: Marks {
                    tearing_down: vec![id.to_string()],
                    ..Marks::default()
                },
                ..Outcome::default()
            };
            Ok((begun, Some(ending)))
        })? {
            Some(ending) => ending,
            None => return self.ended_already(id),
        };
        let result = self.teardown(lease, steps, before).await;
        self.teardown_finished(id);
        result
    }

    /// The end of live lease `id` as `ending_as`: the lease revoking, each of its
    /// partitions with its hardware step, and the lease as it was; or the refusal.
    /// `Ok(None)`: nothing to begin (already ended, already revoking, its teardown
    /// running): [`Self::ended_already`] answers.
    fn decide_end(
        &self,
        st: &State,
        id: &str,
        ending_as: LeaseState,
        reason: &str,
    ) -> Result<Option<(Lease, Vec<TeardownStep>, Lease)>, LeaseError> {
        if st.moving.contains(id) {
            return Err(LeaseError::FailedPrecondition(format!(
                "lease {id} is being moved to another MIG placement; retry in a moment"
            )));
        }
        let Some(lease) = st.leases.get(id) else {
            return Ok(None);
        };
        match lease.state() {
            LeaseState::Pending => {
                return Err(LeaseError::FailedPrecondition(format!(
                    "lease {id} is still being created; retry in a moment"
                )));
            }
            LeaseState::Revoking => return Ok(None),
            _ => {}
        }
        if st.tearing_down.contains(id) {
            return Ok(None);
        }
        // Every partition it holds (several for a multi-partition lease).
        let steps: Vec<(Partition, Option<HwDestroy>)> = Self::lease_partitions(st, lease)?
            .into_iter()
            .map(|p| {
                let hw = self.teardown_for(st, &p);
                (p, hw)
            })
            .collect();
        let mut ending = lease.clone();
        ending.begin_end(ending_as, reason)?;
        Ok(Some((ending, steps, lease.clone())))
    }

    /// The answer to ending lease `id` that had nothing to begin: the lease as the
    /// table or the store holds it (releasing twice is not an error).
    fn ended_already(&self, id: &str) -> Result<Lease, LeaseError> {
        if let Some(l) = self.read().leases.get(id) {
            return Ok(l.clone());
        }
        match self.store.get_lease(id)? {
            Some(l) => Ok(l),
            None => Err(LeaseError::NotFound(format!(
                "no lease {:?}",
                truncate(id, 80)
            ))),
        }
    }

    /// The hardware step that ends `p`'s lease. A shared MPS server is stopped only
    /// by the last lease it serves: while another live lease not itself ending uses
    /// it, the ending one just leaves (a lease that joins while the server stops
    /// finds it restarted by the supervisor within a second).
    pub(super) fn teardown_for(&self, st: &State, p: &Partition) -> Option<HwDestroy> {
        match &p.kind {
            PartKind::Mig(m) => {
                let keep = p.origin == Origin::Static
                    || self.config.partition.on_release == OnRelease::Keep;
                match (keep, m.gi_id) {
                    (false, Some(gi_id)) => Some(HwDestroy::Mig { gpu: p.gpu, gi_id }),
                    _ => None,
                }
            }
            PartKind::Mps(m) => {
                let lease_id = p.lease_id.clone().unwrap_or_default();
                let key = p.mps_daemon_key(&lease_id)?;
                if m.mode == MpsMode::Shared && shared_server_users(st, p, &key) > 0 {
                    return None;
                }
                Some(HwDestroy::Mps { lease_id: key })
            }
            PartKind::WholeGpu => None,
        }
    }

    /// Steps of a teardown: the intent (with the lease revoking and the partition
    /// destroying, in one commit), the containers stopped, the hardware torn down,
    /// then the end recorded. A step that fails leaves the lease revoking with its
    /// intent open; housekeeping retries it.
    ///
    /// The answer tells the truth: when the intent cannot be written nothing has
    /// happened (the lease is put back as it was, `before`) and the error says so;
    /// once it is written the end will happen, so a later failure (the hardware,
    /// the final commit) answers the lease as it is: revoking.
    pub(super) async fn teardown(
        &self,
        lease: Lease,
        steps: Vec<(Partition, Option<HwDestroy>)>,
        before: Lease,
    ) -> Result<Lease, LeaseError> {
        let Some(partition) = steps.first().map(|(p, _)| p.clone()) else {
            return Err(LeaseError::Inconsistent(
                Inconsistency::LeaseWithoutPartition(lease.id.clone()),
            ));
        };
        let intents = match self.write_teardown_intent(&lease, &steps).await {
            Ok(i) => i,
            Err(e) => {
                self.publish_only(Outcome {
                    leases: vec![before],
                    ..Outcome::default()
                });
                return Err(e);
            }
        };
        self.emit(
            EventKind::Revoking,
            &lease,
            Some(&partition),
            format!(
                "ending as {}: {}",
                lease.ending_as().unwrap_or(LeaseState::Released).as_str(),
                lease.end_reason().unwrap_or_default()
            ),
        );
        // Containers first: the partitions are torn down only when no process of
        // the lease remains.
        if !self.stop_containers(&lease, &partition).await? {
            return Ok(lease);
        }
        let (parts, failed) = self.destroy_partitions(&lease, steps).await?;
        if !failed.is_empty() {
            self.teardown_failed(&lease, &partition, &failed);
            return Ok(lease);
        }
        match self.record_end(lease.clone(), parts, intents).await {
            Ok(ended) => Ok(ended),
            Err(e) => {
                warn!(lease = %lease.id, error = %e, "the end could not be recorded; will retry");
                self.emit(
                    EventKind::Revoking,
                    &lease,
                    Some(&partition),
                    format!("torn down; recording the end failed, retrying: {e}"),
                );
                Ok(lease)
            }
        }
    }

    /// The hardware step of each partition of a teardown (and an MPS daemon's
    /// directories): every partition, and those whose step failed with why.
    async fn destroy_partitions(
        &self,
        lease: &Lease,
        steps: Vec<(Partition, Option<HwDestroy>)>,
    ) -> Result<(Vec<Partition>, Vec<(String, GpuError)>), LeaseError> {
        let mut parts = Vec::with_capacity(steps.len());
        let mut failed = Vec::new();
        for (p, hw) in steps {
            // The MPS directories go with the daemon (a shared server's stay while
            // it serves other leases), in the same step on the server as its stop.
            let done = match hw {
                Some(HwDestroy::Mps { lease_id: key }) => {
                    let step = async {
                        let done = self
                            .destroy_hw(HwDestroy::Mps {
                                lease_id: key.clone(),
                            })
                            .await;
                        if done.is_ok() {
                            self.remove_mps_dirs(&lease.id, &p);
                        }
                        done
                    };
                    self.mps_server_step(&key, step).await
                }
                Some(hw) => self.destroy_hw(hw).await,
                None => Ok(()),
            };
            if let Err(e) = done {
                let e = match e {
                    DestroyError::Hardware(e) => e,
                    task => return Err(task.into_lease_error()),
                };
                warn!(lease = %lease.id, partition = %p.id, error = %e, "teardown failed; will retry");
                failed.push((p.id.clone(), e));
                parts.push(p);
                continue;
            }
            parts.push(p);
        }
        Ok((parts, failed))
    }

    /// An MPS share's directories, once its server is stopped (only those under
    /// the daemon's `run_dir`).
    fn remove_mps_dirs(&self, lease_id: &str, p: &Partition) {
        if let PartKind::Mps(m) = &p.kind
            && let Some(base) = m.pipe_dir.parent()
            && base.starts_with(self.config.daemon.run_dir.join("mps"))
            && let Err(e) = self.host.remove_dir_all(base)
        {
            warn!(lease = %lease_id, dir = %base.display(), error = %e, "could not remove the MPS directories");
        }
    }

    /// A teardown step failed: the lease stays revoking (its intent open), those
    /// partitions destroying, and watchers hear why; housekeeping retries.
    fn teardown_failed(&self, lease: &Lease, partition: &Partition, failed: &[(String, GpuError)]) {
        let marked = self.hold_in_table(|st| {
            let parts = failed
                .iter()
                .filter_map(|(pid, _)| st.partitions.get(pid))
                .map(|p| Partition {
                    state: PartitionState::Destroying,
                    ..p.clone()
                })
                .collect();
            let marked = Outcome {
                parts,
                leases: vec![lease.clone()],
                ..Outcome::default()
            };
            Ok((marked, ()))
        });
        if let Err(e) = marked {
            warn!(lease = %lease.id, error = %e, "could not mark a failed teardown");
        }
        let why: Vec<String> = failed.iter().map(|(_, e)| e.to_string()).collect();
        self.emit(
            EventKind::Revoking,
            lease,
            Some(partition),
            format!("teardown failed, retrying: {}", why.join("; ")),
        );
    }

    /// Stop every container bound to the lease: SIGTERM, then SIGKILL after the
    /// grace. False when that failed (the lease stays revoking and is retried).
    async fn stop_containers(
        &self,
        lease: &Lease,
        partition: &Partition,
    ) -> Result<bool, LeaseError> {
        let containers = self
            .read()
            .leases
            .get(&lease.id)
            .map(|l| l.containers.clone())
            .unwrap_or_else(|| lease.containers.clone());
        if containers.is_empty() {
            return Ok(true);
        }
        let grace = self.config.lease.revocation_grace;
        self.emit(
            EventKind::Revoking,
            lease,
            Some(partition),
            format!(
                "stopping {} container(s): SIGTERM, then SIGKILL after {}s",
                containers.len(),
                grace.as_secs()
            ),
        );
        let note = termination_note(lease);
        let (lid, host) = (lease.id.clone(), self.host.clone());
        let res = tokio::task::spawn_blocking(move || {
            // The reason first, where kubelet reads it once the container is gone
            // (its termination-message file): a pod shows why, not only "Error 137".
            for c in containers.iter().filter(|c| !c.termination_log.is_empty()) {
                let path = std::path::Path::new(&c.termination_log);
                if let Err(e) = host.write_termination_message(path, &note) {
                    warn!(lease = %lid, container = %c.id, error = %e, "could not write the termination message");
                }
            }
            containers
                .iter()
                .map(|c| enforce::stop_container(host.as_ref(), c, grace))
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .map_err(|source| LeaseError::Task {
            what: "container stop",
            source,
        })?;
        let message = match &res {
            Ok(stopped) => {
                let (t, k) = stopped
                    .iter()
                    .fold((0, 0), |(t, k), s| (t + s.terminated, k + s.killed));
                format!("containers stopped: {t} process(es) got SIGTERM, {k} needed SIGKILL")
            }
            Err(e) => {
                warn!(lease = %lease.id, error = %e, "stopping containers failed; will retry");
                self.publish_only(Outcome {
                    leases: vec![lease.clone()],
                    ..Outcome::default()
                });
                format!("stopping containers failed, retrying: {e}")
            }
        };
        self.emit(EventKind::Revoking, lease, Some(partition), message);
        Ok(res.is_ok())
    }

    /// The end, durably: the lease ended (with its usage record), its partitions
    /// back in the pool or gone, its tokens deleted, its intents finished. Then in
    /// memory and on the watch stream.
    async fn record_end(
        &self,
        mut lease: Lease,
        parts: Vec<Partition>,
        intents: Vec<Option<i64>>,
    ) -> Result<Lease, LeaseError> {
        let now = now_ms();
        let final_state = lease.finish_end(now)?;
        let usage = {
            let st = self.read();
            parts
                .iter()
                .fold(crate::usage::Weights::default(), |acc, p| {
                    let gpu_memory = st
                        .gpus
                        .iter()
                        .find(|g| g.info.index == p.gpu)
                        .map(|g| g.info.memory_bytes)
                        .unwrap_or_default();
                    acc.plus(crate::usage::weights_of_partition(&lease, p, gpu_memory))
                })
        };
        let mut end = Outcome {
            ended: vec![lease.clone()],
            usage: Some((lease.clone(), usage)),
            finished: Outcome::finishing(intents, now, "done"),
            ..Outcome::default()
        };
        // Each partition back in the pool (its hardware kept), or gone.
        for p in &parts {
            if hw_keeps(p, self.config.partition.on_release) {
                let mut freed = p.clone();
                freed.lease_id = None;
                freed.state = PartitionState::Ready;
                end.parts.push(freed);
            } else {
                end.gone.push(p.id.clone());
            }
        }
        self.commit(end, Publish::IfCommitted).await?;
        let kind = if final_state == LeaseState::Released {
            EventKind::Released
        } else {
            EventKind::Revoked
        };
        self.emit(
            kind,
            &lease,
            parts.first(),
            lease.end_reason().unwrap_or_default().to_string(),
        );
        info!(lease = %lease.id, state = final_state.as_str(), "lease ended");
        Ok(lease)
    }
}

/// How many leases other than `p`'s, live and not ending, the shared MPS server
/// `key` on `p`'s GPU serves.
pub(super) fn shared_server_users(st: &State, p: &Partition, key: &str) -> usize {
    st.partitions
        .shared_server_shares(p.gpu, key)
        .filter(|o| o.id != p.id)
        .filter_map(|o| {
            let lid = o.lease_id.as_deref()?;
            let l = st.leases.get(lid)?;
            let serving = matches!(l.state(), LeaseState::Pending | LeaseState::Active)
                && !st.tearing_down.contains(lid);
            serving.then_some(())
        })
        .count()
}

/// What a stopped container's termination message says: the lease, how it ends and
/// why (kubelet shows it as the container's last state message).
pub(super) fn termination_note(lease: &Lease) -> String {
    format!(
        "tessera: lease {} {}: {}",
        lease.id,
        lease.ending_as().unwrap_or(LeaseState::Released).as_str(),
        lease
            .end_reason()
            .filter(|r| !r.is_empty())
            .unwrap_or("no reason given")
    )
}
