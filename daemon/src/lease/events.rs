//! Lease events (WatchLeases): what happened to a lease, published on a bounded broadcast channel.

use tessera_common::clock::now_ms;
use tokio::sync::broadcast;

use crate::model::{Lease, Partition};

use super::LeaseManager;

/// Kinds of lease events (WatchLeases).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Created,
    Renewed,
    Expiring,
    Released,
    Revoked,
    Revoking,
    Preempting,
    ContainerBound,
    ContainerUnbound,
    MpsRestarted,
    /// The lease's GPU or MIG instance was taken out of service.
    Unhealthy,
    /// It is back in service.
    Healthy,
    /// Its (idle) MIG instance was moved to make room; same lease, same token.
    Moved,
}

#[derive(Debug, Clone)]
pub struct LeaseEvent {
    pub kind: EventKind,
    pub lease: Lease,
    pub partition: Option<Partition>,
    pub at_ms: i64,
    pub message: String,
}

impl LeaseManager {
    pub fn subscribe(&self) -> broadcast::Receiver<LeaseEvent> {
        self.events.subscribe()
    }

    pub(super) fn emit(
        &self,
        kind: EventKind,
        lease: &Lease,
        partition: Option<&Partition>,
        msg: String,
    ) {
        // Any change to a lease may make room for a queued request.
        self.queue.room_changed();
        let _ = self.events.send(LeaseEvent {
            kind,
            lease: lease.clone(),
            partition: partition.cloned(),
            at_ms: now_ms(),
            message: msg,
        });
    }
}
