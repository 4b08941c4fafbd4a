//! Publishing: each change to a lease becomes an event with the next revision,
//! kept in a bounded history and sent to watchers; subscriptions resume from a
//! revision without a gap or an overlap.

use std::sync::Arc;

use tessera_common::clock::now_ms;
use tokio::sync::broadcast;

use crate::model::{Lease, Partition};

use super::events::{EventKind, History, LeaseEvent, ResumeError, Subscription};
use super::manager::LeaseManager;

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
