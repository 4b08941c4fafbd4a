//! Admission under the state lock: quota, placement, and preemption of burst leases.

use std::collections::HashSet;
use std::time::Duration;

use tokio::sync::broadcast;
use tracing::{info, warn};

use crate::config::TenancyConfig;
use crate::model::{Lease, LeaseState, Origin, PartKind};
use crate::partition::{self, PlanOptions, Shape};

use super::quota;
#[allow(unused_imports)]
use super::*;

/// Why a reservation attempt has to be tried again (or answered otherwise).
pub(super) enum Again {
    /// Preempt these leases, then plan again.
    Preempt(Vec<String>),
    /// Capacity is held by teardowns in progress: wait for them, then plan again.
    WaitTeardowns,
    /// A call with the same request id reserved first (and may still be creating).
    SameRequest(String, Option<tokio::sync::futures::OwnedNotified>),
}

impl LeaseManager {
    /// The smallest set of preemptible leases (in victim order) whose partitions,
    /// once freed, let `shape` be placed. Empty when no such set exists.
    pub(super) fn pick_victims(
        st: &State,
        tenancy: &TenancyConfig,
        tenant: &str,
        shape: &Shape,
        opts: &PlanOptions,
    ) -> Vec<String> {
        // Pending leases count too: a burst lease still being created holds
        // capacity; it is preempted once its creation finishes.
        let live: Vec<&Lease> = st
            .leases
            .values()
            .filter(|l| matches!(l.state, LeaseState::Active | LeaseState::Pending))
            .collect();
        let order = quota::victims_in_order(tenancy, tenant, &live);
        let mut views = Self::views(st);
        let mut chosen = Vec::new();
        for v in order {
            let Some(p) = st.partitions.get(&v.partition_id) else {
                continue;
            };
            let Some(view) = views.iter_mut().find(|g| g.info.index == p.gpu) else {
                continue;
            };
            match &p.kind {
                PartKind::Mig(m) => {
                    if let Some(i) = view.mig.iter().position(|o| o.placement == m.placement) {
                        if p.origin == Origin::Static {
                            view.mig[i].free_static = Some(p.id.clone());
                        } else {
                            view.mig.remove(i);
                        }
                    }
                }
                PartKind::Mps(m) => {
                    if let Some(i) = view.mps.iter().position(|s| {
                        s.sm_percent == m.sm_percent && s.memory_bytes == m.memory_bytes
                    }) {
                        view.mps.remove(i);
                    }
                }
                PartKind::WholeGpu => view.whole_leased = false,
            }
            chosen.push(v.id.clone());
            if partition::plan(shape, &views, opts).is_ok() {
                return chosen;
            }
        }
        Vec::new()
    }

    /// Wait (at most `limit`) until the teardowns running now have finished.
    pub(super) async fn wait_for_teardowns(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        let mut rx = self.events.subscribe();
        loop {
            let busy: HashSet<String> = self.lock().tearing_down.clone();
            if busy.is_empty() {
                return;
            }
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Err(_) => return,
                Ok(Err(broadcast::error::RecvError::Closed)) => return,
                Ok(_) => {}
            }
        }
    }

    /// Preempt leases (with notice on WatchLeases), waiting for their teardown.
    pub(super) async fn preempt(&self, victims: &[String], for_tenant: &str) {
        let grace = self.config.lease.revocation_grace;
        for id in victims {
            // A victim still being created is preempted once it exists.
            let pending = {
                let st = self.lock();
                st.pending.get(id).map(|n| n.clone().notified_owned())
            };
            if let Some(done) = pending {
                let _ = tokio::time::timeout(Duration::from_secs(60), done).await;
            }
            let Ok((lease, _)) = self.get(id) else {
                continue;
            };
            self.emit(
                EventKind::Preempting,
                &lease,
                None,
                format!(
                    "preempted: tenant {for_tenant:?} needs capacity within its guarantee; containers get {}s to stop",
                    grace.as_secs()
                ),
            );
            let reason = format!("preempted for tenant {for_tenant:?} (burst lease)");
            match self.end(id, LeaseState::Revoked, &reason).await {
                Ok(_) => info!(lease = %id, for_tenant, "lease preempted"),
                Err(e) => warn!(lease = %id, error = %e, "preemption failed"),
            }
        }
    }
}
