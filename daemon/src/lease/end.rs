//! Ending a lease (release, expiry, revocation): stop its containers, tear the partition down write-ahead, record the end.

use tessera_common::clock::now_ms;
use tracing::{info, warn};

use crate::config::OnRelease;

use crate::model::{IntentOp, Lease, LeaseState, Origin, PartKind, Partition, PartitionState};
use crate::names::truncate;

use super::error::Inconsistency;
#[allow(unused_imports)]
use super::*;

pub(super) enum HwDestroy {
    Mig { gpu: u32, gi_id: u32 },
    Mps { lease_id: String },
}

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
        let (lease, partition, teardown) = {
            let mut st = self.lock();
            let Some(lease) = st.leases.get(id).cloned() else {
                // Already ended: releasing twice is not an error.
                return match self.store.get_lease(id)? {
                    Some(l) => Ok(l),
                    None => Err(LeaseError::NotFound(format!(
                        "no lease {:?}",
                        truncate(id, 80)
                    ))),
                };
            };
            match lease.state() {
                LeaseState::Pending => {
                    return Err(LeaseError::FailedPrecondition(format!(
                        "lease {id} is still being created; retry in a moment"
                    )));
                }
                LeaseState::Revoking => return Ok(lease),
                _ => {}
            }
            if st.tearing_down.contains(id) {
                return Ok(lease);
            }
            let partition = st
                .partitions
                .get(&lease.partition_id)
                .cloned()
                .ok_or_else(|| {
                    LeaseError::Inconsistent(Inconsistency::LeaseWithoutPartition(id.to_string()))
                })?;
            let teardown = self.teardown_for(&partition);
            let l = st.leases.get_mut(id).ok_or_else(|| {
                LeaseError::Inconsistent(Inconsistency::LeaseVanished(id.to_string()))
            })?;
            l.begin_end(ending_as, reason)?;
            let lease = l.clone();
            st.tearing_down.insert(id.to_string());
            (lease, partition, teardown)
        };
        let result = self.teardown(lease, partition, teardown).await;
        self.lock().tearing_down.remove(id);
        result
    }

    pub(super) fn teardown_for(&self, p: &Partition) -> Option<HwDestroy> {
        match &p.kind {
            PartKind::Mig(m) => {
                let keep = p.origin == Origin::Static
                    || self.config.partition.on_release == OnRelease::Keep;
                match (keep, m.gi_id) {
                    (false, Some(gi_id)) => Some(HwDestroy::Mig { gpu: p.gpu, gi_id }),
                    _ => None,
                }
            }
            PartKind::Mps(_) => Some(HwDestroy::Mps {
                lease_id: p.lease_id.clone().unwrap_or_default(),
            }),
            PartKind::WholeGpu => None,
        }
    }

    pub(super) async fn teardown(
        &self,
        mut lease: Lease,
        partition: Partition,
        hw: Option<HwDestroy>,
    ) -> Result<Lease, LeaseError> {
        let now = now_ms();
        let op = match &hw {
            Some(HwDestroy::Mig { .. }) => Some(IntentOp::DestroyMig),
            Some(HwDestroy::Mps { .. }) => Some(IntentOp::StopMps),
            None => None,
        };
        let mut destroying = partition.clone();
        destroying.state = PartitionState::Destroying;
        let intent = if let Some(op) = op {
            let (l2, p2) = (lease.clone(), destroying.clone());
            Some(
                self.store
                    .write(move |w| {
                        w.put_lease(&l2)?;
                        w.put_partition(&p2)?;
                        w.begin_intent(op, &p2.id, Some(&l2.id), now)
                    })
                    .await?,
            )
        } else {
            None
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

        // Containers first: the partition is torn down only when no process of the
        // lease remains.
        let containers = self
            .lock()
            .leases
            .get(&lease.id)
            .map(|l| l.containers.clone())
            .unwrap_or_else(|| lease.containers.clone());
        if !containers.is_empty() {
            let grace = self.config.lease.revocation_grace;
            self.emit(
                EventKind::Revoking,
                &lease,
                Some(&partition),
                format!(
                    "stopping {} container(s): SIGTERM, then SIGKILL after {}s",
                    containers.len(),
                    grace.as_secs()
                ),
            );
            let (lid, host) = (lease.id.clone(), self.host.clone());
            let res = tokio::task::spawn_blocking(move || {
                containers
                    .iter()
                    .map(|c| enforce::stop_container(host.as_ref(), &lid, c, grace))
                    .collect::<Result<Vec<_>, _>>()
            })
            .await
            .map_err(|source| LeaseError::Task {
                what: "container stop",
                source,
            })?;
            match res {
                Ok(stopped) => {
                    let (t, k): (usize, usize) = stopped
                        .iter()
                        .fold((0, 0), |(t, k), s| (t + s.terminated, k + s.killed));
                    self.emit(
                        EventKind::Revoking,
                        &lease,
                        Some(&partition),
                        format!(
                            "containers stopped: {t} process(es) got SIGTERM, {k} needed SIGKILL"
                        ),
                    );
                }
                Err(e) => {
                    warn!(lease = %lease.id, error = %e, "stopping containers failed; will retry");
                    self.emit(
                        EventKind::Revoking,
                        &lease,
                        Some(&partition),
                        format!("stopping containers failed, retrying: {e}"),
                    );
                    let mut st = self.lock();
                    if let Some(l) = st.leases.get_mut(&lease.id) {
                        *l = lease.clone();
                    }
                    return Ok(lease);
                }
            }
        }

        if let Some(hw) = hw {
            let backend = self.backend.clone();
            let res = match hw {
                HwDestroy::Mig { gpu, gi_id } if backend.instance_calls_are_quick() => {
                    backend.destroy_instance(gpu, gi_id)
                }
                hw => tokio::task::spawn_blocking(move || match hw {
                    HwDestroy::Mig { gpu, gi_id } => backend.destroy_instance(gpu, gi_id),
                    HwDestroy::Mps { lease_id } => backend.mps_stop(&lease_id),
                })
                .await
                .map_err(|source| LeaseError::Task {
                    what: "hardware teardown",
                    source,
                })?,
            };
            if let Err(e) = res {
                warn!(lease = %lease.id, error = %e, "teardown failed; will retry");
                let mut st = self.lock();
                if let Some(p) = st.partitions.get_mut(&partition.id) {
                    p.state = PartitionState::Destroying;
                }
                if let Some(l) = st.leases.get_mut(&lease.id) {
                    *l = lease.clone();
                }
                drop(st);
                self.emit(
                    EventKind::Revoking,
                    &lease,
                    Some(&partition),
                    format!("teardown failed, retrying: {e}"),
                );
                return Ok(lease);
            }
        }

        if let PartKind::Mps(m) = &partition.kind
            && let Some(base) = m.pipe_dir.parent()
            && base.starts_with(self.config.daemon.run_dir.join("mps"))
            && let Err(e) = self.host.remove_dir_all(base)
        {
            warn!(lease = %lease.id, dir = %base.display(), error = %e, "could not remove the MPS directories");
        }
        let now = now_ms();
        let final_state = lease.finish_end(now)?;
        let back_to_pool = hw_keeps(&partition, self.config.partition.on_release);
        let mut freed = partition.clone();
        freed.lease_id = None;
        freed.state = PartitionState::Ready;
        let (l2, f2) = (lease.clone(), freed.clone());
        let gpu_memory = self
            .lock()
            .gpus
            .iter()
            .find(|g| g.info.index == partition.gpu)
            .map(|g| g.info.memory_bytes)
            .unwrap_or_default();
        let usage = crate::usage::weights_of_partition(&lease, &partition, gpu_memory);
        self.store
            .write(move |w| {
                w.put_lease(&l2)?;
                crate::usage::insert_record(w.conn(), &l2, &usage)?;
                if back_to_pool {
                    w.put_partition(&f2)?;
                } else {
                    w.delete_partition(&f2.id)?;
                }
                w.delete_tokens(&l2.id)?;
                if let Some(i) = intent {
                    w.finish_intent(i, now, "done")?;
                }
                Ok(())
            })
            .await?;
        {
            let mut st = self.lock();
            st.leases.remove(&lease.id);
            st.tokens.retain(|_, l| *l != lease.id);
            st.expiring_notified.remove(&lease.id);
            st.teardown_backoff.remove(&lease.id);
            if let Some(rid) = &lease.request_id {
                st.requests.remove(&(lease.tenant.clone(), rid.clone()));
            }
            if back_to_pool {
                st.partitions.insert(freed.id.clone(), freed);
            } else {
                st.partitions.remove(&partition.id);
            }
        }
        let kind = if final_state == LeaseState::Released {
            EventKind::Released
        } else {
            EventKind::Revoked
        };
        self.emit(
            kind,
            &lease,
            Some(&partition),
            lease.end_reason().unwrap_or_default().to_string(),
        );
        info!(lease = %lease.id, state = final_state.as_str(), "lease ended");
        Ok(lease)
    }
}
