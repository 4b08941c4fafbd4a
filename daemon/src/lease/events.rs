//! Lease events (WatchLeases): what happened to a lease, each with its revision,
//! published on a bounded broadcast channel and kept in a bounded history from
//! which a watcher resumes.
//!
//! Revisions: every event gets the next one, in the order events are published
//! (one lock orders them). The high bits are the daemon's generation (one more at
//! each start, kept in the store), so revisions grow across restarts too; a restart
//! keeps no history, so a watcher from before it lists again.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

use crate::model::{Lease, Partition};

/// Bits of a revision that count events within one generation.
pub const GENERATION_SHIFT: u32 = 40;

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
    /// One more than the event before it.
    pub revision: u64,
}

/// The revisions issued so far and the latest events, under one lock with the
/// broadcast send so that subscribing and replaying see one order.
#[derive(Debug)]
pub(super) struct History {
    /// The latest revision issued (the generation's base before any).
    pub(super) last: u64,
    /// The oldest revision a watch may start from: every event after it is kept.
    pub(super) floor: u64,
    pub(super) kept: VecDeque<Arc<LeaseEvent>>,
    pub(super) capacity: usize,
}

impl History {
    pub(super) fn new(generation: u64, capacity: usize) -> Mutex<History> {
        let base = generation << GENERATION_SHIFT;
        Mutex::new(History {
            last: base,
            floor: base,
            kept: VecDeque::with_capacity(capacity.min(4096)),
            capacity,
        })
    }
}

/// Why a watch cannot start from the revision asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResumeError {
    #[error(
        "revision {asked} is older than the lease events this daemon keeps (from revision {floor}; it keeps the last {kept}, and none from before it started): list the leases again and watch from the list's revision"
    )]
    TooOld { asked: u64, floor: u64, kept: usize },
    #[error("revision {asked} is ahead of this daemon's latest revision {last}")]
    Ahead { asked: u64, last: u64 },
}

/// A watch's start: the kept events after its revision and the live ones after them.
#[derive(Debug)]
pub struct Subscription {
    /// The kept events after the revision asked, in order.
    pub replay: Vec<Arc<LeaseEvent>>,
    /// Every event after the replay's last (or after `start`).
    pub live: broadcast::Receiver<Arc<LeaseEvent>>,
    /// The revision the watch starts at: the latest issued when it subscribed.
    pub start: u64,
}
