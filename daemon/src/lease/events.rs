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

use tessera_common::clock::now_ms;
use tokio::sync::broadcast;

use crate::model::{Lease, Partition};

use super::LeaseManager;

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
    last: u64,
    /// The oldest revision a watch may start from: every event after it is kept.
    floor: u64,
    kept: VecDeque<Arc<LeaseEvent>>,
    capacity: usize,
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

impl LeaseManager {
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<LeaseEvent>> {
        self.events.subscribe()
    }

    /// The latest revision issued.
    pub fn revision(&self) -> u64 {
        self.history().last
    }

    /// Subscribe to the events after `since` (None: from now): the kept ones to
    /// replay, then live ones, without a gap or an overlap.
    pub fn subscribe_from(&self, since: Option<u64>) -> Result<Subscription, ResumeError> {
        let h = self.history();
        let replay = match since {
            None => Vec::new(),
            Some(asked) if asked > h.last => {
                return Err(ResumeError::Ahead {
                    asked,
                    last: h.last,
                });
            }
            Some(asked) if asked < h.floor => {
                return Err(ResumeError::TooOld {
                    asked,
                    floor: h.floor,
                    kept: h.capacity,
                });
            }
            Some(asked) => {
                // Kept events are consecutive: the first after `asked` is at
                // index asked - (the first kept's revision).
                let first = h.kept.front().map_or(h.last + 1, |e| e.revision);
                let skip = usize::try_from((asked + 1).saturating_sub(first)).unwrap_or(usize::MAX);
                h.kept.iter().skip(skip).cloned().collect()
            }
        };
        Ok(Subscription {
            replay,
            live: self.events.subscribe(),
            start: h.last,
        })
    }

    fn history(&self) -> std::sync::MutexGuard<'_, History> {
        self.history.lock().unwrap_or_else(|p| p.into_inner())
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
        let mut h = self.history();
        h.last += 1;
        let ev = Arc::new(LeaseEvent {
            kind,
            lease: lease.clone(),
            partition: partition.cloned(),
            at_ms: now_ms(),
            message: msg,
            revision: h.last,
        });
        if h.capacity > 0 {
            if h.kept.len() == h.capacity
                && let Some(old) = h.kept.pop_front()
            {
                h.floor = old.revision;
            }
            h.kept.push_back(ev.clone());
        } else {
            h.floor = h.last;
        }
        // Sent under the lock: receivers see events in revision order, and a
        // subscriber gets exactly the events after the history it was handed.
        let _ = self.events.send(ev);
    }
}
