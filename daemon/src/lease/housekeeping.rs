//! The background loop: expiry, expiry notices, retried teardowns, MPS supervision, pruning.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tessera_common::clock::now_ms;
use tracing::warn;

use crate::model::{Lease, LeaseState, Partition, PartitionState};

use super::error::LeaseError;
use super::events::EventKind;
use super::manager::LeaseManager;
use super::plan::{HwCreate, Marks, Outcome, TeardownStep};
use super::table::State;

/// How long after its bind a container's runtime state must exist (the runtime binds
/// before runc creates the container).
pub(super) const STALE_BINDING_GRACE_MS: i64 = 60_000;

/// First wait before a failed teardown is tried again; it doubles per failure.
pub(super) const TEARDOWN_RETRY_MS: i64 = 250;

impl LeaseManager {
    /// One pass of the housekeeping loop: expire leases, warn of expiry, retry stuck
    /// teardowns. Returns how many leases it ended.
    pub async fn tick(&self) -> usize {
        let now = now_ms();
        let notice = self.config.lease.expiring_notice.as_millis() as i64;
        let (expired, expiring, stuck) = self
            .hold_in_table(|st| {
                let due = due_now(st, now, notice);
                let told = Outcome::marks(Marks {
                    notices_sent: due.1.iter().map(|l| l.id.clone()).collect(),
                    ..Marks::default()
                });
                Ok((told, due))
            })
            .unwrap_or_default();
        for l in expiring {
            let left = (l.expires_at_ms - now).max(0) / 1000;
            self.emit(
                EventKind::Expiring,
                &l,
                None,
                format!("expires in {left}s unless renewed"),
            );
        }
        let mut ended = 0;
        for id in expired {
            match self.end(&id, LeaseState::Expired, "TTL ran out").await {
                Ok(_) => ended += 1,
                Err(e) => warn!(lease = %id, error = %e, "could not expire lease"),
            }
        }
        for id in stuck {
            if let Err(e) = self.retry_teardown(&id).await {
                warn!(lease = %id, error = %e, "teardown retry failed");
            }
            // Still blocked: wait longer before the next try (250 ms doubling up
            // to 5 s), so a long-blocked teardown neither spins nor floods the log.
            let backoff = self.hold_in_table(|st| {
                let next = teardown_backoff(st, &id, now_ms());
                let marks = Marks {
                    teardown_backoff: vec![(id.clone(), next)],
                    ..Marks::default()
                };
                Ok((Outcome::marks(marks), ()))
            });
            if let Err(e) = backoff {
                warn!(lease = %id, error = %e, "could not note a teardown's backoff");
            }
        }
        self.supervise_mps(now).await;
        self.reap_idle_mps_hosts().await;
        self.prune_gone_containers(now).await;
        if self.config.partition.compact_idle {
            self.compact_idle().await;
        }
        ended
    }

    /// Forget bindings whose container is gone: its runtime's state directory
    /// (`<runtime_root>/<id>`) no longer exists a while after the bind (the runtime
    /// binds before runc creates it). A `delete` that never reached the daemon (the
    /// runtime killed, another config) leaves no stale binding behind.
    pub(super) async fn prune_gone_containers(&self, now: i64) {
        let candidates: Vec<(String, String, String)> = {
            let st = self.read();
            st.leases
                .values()
                .filter(|l| l.state() == LeaseState::Active)
                .flat_map(|l| {
                    l.containers
                        .iter()
                        .filter(|c| {
                            !c.runtime_root.is_empty()
                                && c.bound_at_ms.saturating_add(STALE_BINDING_GRACE_MS) <= now
                        })
                        .map(|c| (l.id.clone(), c.id.clone(), c.runtime_root.clone()))
                })
                .collect()
        };
        for (lease, id, root) in candidates {
            if self
                .host
                .runtime_state_exists(std::path::Path::new(&root), &id)
            {
                continue;
            }
            match self.unbind_container(&id, Some(&root)).await {
                Ok(()) => {
                    tracing::info!(lease = %lease, container = %id, runtime_root = %root, "container gone: binding dropped")
                }
                Err(e) => {
                    warn!(lease = %lease, container = %id, error = %e, "could not drop the binding of a container that is gone")
                }
            }
        }
    }

    /// Restart the MPS control daemon of any active MPS lease whose daemon died,
    /// with the lease's limits, backing off exponentially (1 s .. 60 s) per lease.
    pub(super) async fn supervise_mps(&self, now: i64) {
        let check = self.hold_in_table(|st| {
            if now - st.mps_checked_ms < 1000 {
                return Ok((Outcome::default(), false));
            }
            let checked = Outcome::marks(Marks {
                mps_checked_ms: Some(now),
                ..Marks::default()
            });
            Ok((checked, st.partitions.values().any(|p| p.mps().is_some())))
        });
        if !check.unwrap_or(false) {
            return;
        }
        // Which daemons run, first: then only the leases whose daemon does not are
        // looked at (and copied), not every MPS lease every second.
        let backend = self.backend.clone();
        let running: HashSet<String> =
            match tokio::task::spawn_blocking(move || backend.mps_running()).await {
                Ok(Ok(running)) => running,
                Ok(Err(e)) => {
                    warn!(error = %e, "cannot list MPS daemons");
                    return;
                }
                Err(_) => return,
            };
        let due = self.hold_in_table(|st| {
            let (healthy, due) = mps_due(st, &running, now);
            let forgotten = Outcome::marks(Marks {
                mps_backoff: healthy.into_iter().map(|id| (id, None)).collect(),
                ..Marks::default()
            });
            Ok((forgotten, due))
        });
        for (lease, p, attempts) in due.unwrap_or_default() {
            self.restart_mps(&lease, &p, attempts, now).await;
        }
    }

    /// Start the MPS control daemon of `lease` again (its `attempts`-th restart),
    /// and when the next may be tried.
    async fn restart_mps(&self, lease: &Lease, p: &Partition, attempts: u32, now: i64) {
        let Some(spec) = p.mps_spec(&lease.id) else {
            return;
        };
        let (sm_percent, memory_bytes) = (spec.sm_percent, spec.memory_bytes);
        let res = self.hw_create(HwCreate::Mps(spec)).await;
        let delay = 1000i64 << attempts.min(6);
        let next = (attempts + 1, now + delay.min(60_000));
        self.publish_only(Outcome::marks(Marks {
            mps_backoff: vec![(lease.id.clone(), Some(next))],
            ..Marks::default()
        }));
        match res {
            Ok(_) => {
                warn!(lease = %lease.id, attempt = attempts + 1, "MPS control daemon had died; restarted with the lease's limits");
                self.emit(
                    EventKind::MpsRestarted,
                    lease,
                    Some(p),
                    format!(
                        "MPS control daemon restarted (attempt {}) with {}% SMs and {} MiB",
                        attempts + 1,
                        sm_percent,
                        memory_bytes >> 20
                    ),
                );
            }
            Err(e) => {
                warn!(lease = %lease.id, error = %e, "restarting the MPS control daemon failed; backing off");
            }
        }
    }

    pub(super) async fn retry_teardown(&self, id: &str) -> Result<(), LeaseError> {
        let retry = self.hold_in_table(|st| {
            let Some(retry) = self.decide_retry(st, id) else {
                return Ok((Outcome::default(), None));
            };
            let running = Outcome::marks(Marks {
                tearing_down: vec![id.to_string()],
                ..Marks::default()
            });
            Ok((running, Some(retry)))
        })?;
        let Some((lease, steps)) = retry else {
            return Ok(());
        };
        let r = self.teardown(lease.clone(), steps, lease).await;
        self.teardown_finished(id);
        r.map(|_| ())
    }

    /// The teardown of revoking lease `id` to try again: the lease and each of its
    /// partitions with its hardware step. None when it is running now or gone.
    fn decide_retry(&self, st: &State, id: &str) -> Option<(Lease, Vec<TeardownStep>)> {
        if st.tearing_down.contains(id) {
            return None;
        }
        let lease = st.leases.get(id).cloned()?;
        let parts = Self::lease_partitions(st, &lease).ok()?;
        let steps = parts
            .into_iter()
            .map(|p| {
                let hw = self.teardown_for(st, &p);
                (p, hw)
            })
            .collect();
        Some((lease, steps))
    }

    /// Run [`LeaseManager::tick`] until `stop` fires.
    pub async fn run_housekeeping(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        let mut every = tokio::time::interval(Duration::from_millis(250));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_prune = now_ms();
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = stop.changed() => return,
            }
            self.tick().await;
            self.heartbeat
                .store(now_ms(), std::sync::atomic::Ordering::SeqCst);
            if now_ms() - last_prune > 3_600_000 {
                last_prune = now_ms();
                let before = now_ms() - self.config.lease.retain_ended.as_millis() as i64;
                if let Err(e) = self.store.write(move |w| w.prune(before)).await {
                    warn!(error = %e, "pruning ended leases failed");
                }
            }
        }
    }
}

/// What housekeeping finds due at `now`: the leases expired, those to tell they
/// expire within `notice` (not told yet), and the revoking leases whose teardown
/// is to be tried again (not running, their backoff passed). Through the indexes:
/// only the leases due now, not every lease.
fn due_now(st: &State, now: i64, notice: i64) -> (Vec<String>, Vec<Lease>, Vec<String>) {
    let mut expired = Vec::new();
    let mut expiring = Vec::new();
    for l in st.leases.active_expiring_by(now.saturating_add(notice)) {
        if l.expires_at_ms <= now {
            expired.push(l.id.clone());
        } else if !st.expiring_notified.contains(&l.id) {
            expiring.push(l.clone());
        }
    }
    let stuck = st
        .leases
        .revoking()
        .filter(|l| {
            !st.tearing_down.contains(&l.id)
                && st
                    .teardown_backoff
                    .get(&l.id)
                    .is_none_or(|(_, next)| *next <= now)
        })
        .map(|l| l.id.clone())
        .collect();
    (expired, expiring, stuck)
}

/// The backoff of lease `id`'s teardown after a try at `now`: the next try later
/// while it is still revoking, else none.
fn teardown_backoff(st: &State, id: &str, now: i64) -> Option<(u32, i64)> {
    let blocked = st
        .leases
        .get(id)
        .is_some_and(|l| l.state() == LeaseState::Revoking);
    if !blocked {
        return None;
    }
    let n = st
        .teardown_backoff
        .get(id)
        .map_or(0, |(n, _)| *n)
        .saturating_add(1);
    Some((
        n,
        now + TEARDOWN_RETRY_MS.saturating_mul(1 << n.min(5)).min(5_000),
    ))
}

/// The MPS leases whose daemon is not `running` and whose backoff has passed, with
/// their restarts so far, and the leases whose daemon runs again (their backoff
/// forgotten). A daemon runs under its key: the lease's id (isolated) or the
/// shared server's.
type MpsDue = (Vec<String>, Vec<(Lease, Partition, u32)>);

fn mps_due(st: &State, running: &HashSet<String>, now: i64) -> MpsDue {
    // Healthy again for a whole check: forget old failures.
    let healthy: Vec<String> = st
        .mps_backoff
        .keys()
        .filter(|id| {
            st.leases
                .get(id.as_str())
                .and_then(|l| st.partitions.get(&l.partition_id))
                .and_then(|p| p.mps_daemon_key(id))
                .is_none_or(|key| running.contains(&key))
        })
        .cloned()
        .collect();
    let due = st
        .partitions
        .values()
        .filter(|p| p.state == PartitionState::Ready && p.mps().is_some())
        .filter(|p| {
            p.lease_id
                .as_deref()
                .and_then(|l| p.mps_daemon_key(l))
                .is_some_and(|key| !running.contains(&key))
        })
        .filter_map(|p| {
            let l = st.leases.get(p.lease_id.as_deref()?)?;
            (l.state() == LeaseState::Active && !st.tearing_down.contains(&l.id))
                .then(|| (l.clone(), p.clone()))
        })
        .filter_map(|(l, p)| {
            let backoff = st
                .mps_backoff
                .get(&l.id)
                .filter(|_| !healthy.contains(&l.id));
            let (n, next) = backoff.copied().unwrap_or((0, 0));
            (next <= now).then_some((l, p, n))
        })
        .collect();
    (healthy, due)
}
