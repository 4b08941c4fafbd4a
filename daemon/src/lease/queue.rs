//! The admission queue: a CreateLease with `queue_wait_ms` that finds no room waits for
//! leases to end instead of failing at once.
//!
//! A waiting call holds a ticket, keyed by its shape (a MIG profile, or the whole
//! shape otherwise). Only the oldest ticket of a key tries again, so requests for the
//! same shape are served in arrival order; each try is a whole [`LeaseManager::create`]
//! (moves, preemption and quota included), run to its end even if the caller goes
//! away. Any lease event (an end, a move, a new lease) and any ticket leaving wakes
//! the waiting calls to look again. A call whose wait ends without room gets
//! RESOURCE_EXHAUSTED with the last refusal; a caller that goes away (or whose
//! deadline passes) drops its ticket, which leaves the queue at once. The queue is
//! bounded (`lease.max_queued_per_tenant`, `lease.max_queued`): a call beyond either
//! bound is refused at once, so no tenant can fill it, nor make every lease event
//! cost a try for thousands of waiting calls.
//!
//! The queue also keeps the node's reservations (`partition::reservation`): regions
//! held for large MIG requests refused for lack of room, whether they wait here or
//! their callers try again later. They are soft state, kept in memory only.

use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::sync::Notify;

use super::error::LeaseError;
use super::plan::CreateRequest;
use crate::partition::{Reservations, ReserveOptions, Shape};

#[derive(Debug, Default)]
pub(super) struct AdmissionQueue {
    waiting: Mutex<Waiting>,
    pub(super) room: Notify,
    /// The regions held for refused large MIG requests (made on first use, with the
    /// options of the configuration then in force).
    reservations: Mutex<Option<Reservations>>,
}

#[derive(Debug, Default)]
struct Waiting {
    next: u64,
    /// (ticket, key, tenant), oldest first.
    tickets: VecDeque<(u64, String, String)>,
}

impl AdmissionQueue {
    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The node's reservations, with `opts` (the configuration's).
    pub(super) fn reservations(
        &self,
        opts: ReserveOptions,
    ) -> std::sync::MutexGuard<'_, Option<Reservations>> {
        let mut r = self.reservations.lock().unwrap_or_else(|p| p.into_inner());
        match r.as_mut() {
            Some(held) => held.opts = opts,
            None => *r = Some(Reservations::new(opts)),
        }
        r
    }

    /// Wake every waiting call to look again.
    pub(super) fn room_changed(&self) {
        self.room.notify_waiters();
    }

    pub(super) fn len(&self) -> usize {
        self.waiting().tickets.len()
    }

    /// A place in the queue, unless `tenant` already has `per_tenant` calls waiting
    /// or the queue holds `total`: then the refusal.
    pub(super) fn enter(
        &self,
        key: String,
        tenant: &str,
        per_tenant: usize,
        total: usize,
    ) -> Result<Ticket<'_>, LeaseError> {
        let mut w = self.waiting();
        let mine = w.tickets.iter().filter(|(_, _, t)| t == tenant).count();
        if mine >= per_tenant {
            return Err(LeaseError::ResourceExhausted(format!(
                "tenant {tenant} already has {mine} create requests waiting for room (lease.max_queued_per_tenant)"
            )));
        }
        if w.tickets.len() >= total {
            return Err(LeaseError::ResourceExhausted(format!(
                "the admission queue is full: {} create requests wait for room (lease.max_queued)",
                w.tickets.len()
            )));
        }
        let id = w.next;
        w.next += 1;
        w.tickets.push_back((id, key, tenant.to_string()));
        Ok(Ticket { queue: self, id })
    }
}

/// A place in the queue; dropping it leaves the queue and wakes the others.
pub(super) struct Ticket<'q> {
    queue: &'q AdmissionQueue,
    id: u64,
}

impl Ticket<'_> {
    /// No older ticket has the same key.
    pub(super) fn first_of_its_key(&self) -> bool {
        let w = self.queue.waiting();
        let Some(key) = w
            .tickets
            .iter()
            .find(|(id, _, _)| *id == self.id)
            .map(|(_, k, _)| k)
        else {
            return false;
        };
        w.tickets
            .iter()
            .take_while(|(id, _, _)| *id != self.id)
            .all(|(_, k, _)| k != key)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.queue
            .waiting()
            .tickets
            .retain(|(id, _, _)| *id != self.id);
        self.queue.room_changed();
    }
}

/// Requests with the same key are served in arrival order.
pub(super) fn queue_key(req: &CreateRequest) -> String {
    let shape = match &req.shape {
        Some(Shape::Mig { profile, .. }) => format!("mig:{}", profile.to_ascii_lowercase()),
        Some(other) => format!("{other:?}"),
        None => format!("need:{:?}", req.need),
    };
    format!("{shape} x{}", req.count.max(1))
}
