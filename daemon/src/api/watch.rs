//! WatchLeases: the kept events after the revision asked, then live ones, each
//! exactly once and in revision order; bookmarks on request; a bounded queue per
//! watcher.
//!
//! A forwarding task moves live events (filtered by tenant) into the watcher's
//! queue of `api.watch_queue` entries without ever waiting: when the queue is full
//! (the client does not read as fast as events come, and the HTTP/2 flow control
//! windows are full too) the task stops, and the stream ends, once what is queued
//! has been read, with RESOURCE_EXHAUSTED naming the way back (watch again from the
//! last revision received). The daemon never waits for a watcher, and a watcher
//! holds at most its queue and the replay it was handed (shared with the history).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tessera_common::clock::now_ms;
use tessera_proto::v1 as pb;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::Stream;
use tonic::{Code, Status};
use tonic_types::ErrorDetails;

use super::convert;
use super::errors::rich;
use crate::lease::{LeaseEvent, LeaseManager, ResumeError};

pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::LeaseEvent, Status>> + Send>>;

/// The reason of a watch that starts before the kept history.
pub const REVISION_TOO_OLD: &str = "REVISION_TOO_OLD";
/// The reason of a watcher dropped because it did not keep up.
pub const WATCHER_TOO_SLOW: &str = "WATCHER_TOO_SLOW";

/// Whether the watch's caller may still watch: its principal as it was when the
/// watch began (checked again before each event, so a reload that unmaps the caller
/// ends the watch), and the end of its bearer token's validity.
pub struct Standing {
    pub check: Box<dyn Fn() -> Result<(), Status> + Send + Sync>,
    pub expires_in: Option<Duration>,
}

enum Item {
    Event(Arc<LeaseEvent>),
    Bookmark(u64),
}

/// Start a watch for `tenant` (None: every tenant) after `since` (None: from now).
pub fn start(
    mgr: &Arc<LeaseManager>,
    tenant: Option<String>,
    since: Option<u64>,
    bookmarks: bool,
    standing: Standing,
) -> Result<EventStream, Status> {
    let api = &mgr.config().api;
    let sub = mgr.subscribe_from(since).map_err(|e| match e {
        ResumeError::TooOld { .. } => rich(
            Code::OutOfRange,
            e.to_string(),
            REVISION_TOO_OLD,
            ErrorDetails::new(),
        ),
        ResumeError::Ahead { .. } => rich(
            Code::InvalidArgument,
            e.to_string(),
            "INVALID_ARGUMENT",
            ErrorDetails::with_bad_request_violation("since_revision", e.to_string()),
        ),
    })?;
    let replay: VecDeque<Arc<LeaseEvent>> = sub
        .replay
        .into_iter()
        .filter(|ev| tenant.as_ref().is_none_or(|t| *t == ev.lease.tenant))
        .collect();
    let (tx, rx) = mpsc::channel(api.watch_queue);
    let fatal = Arc::new(Mutex::new(None));
    let bookmark = bookmarks.then_some(api.watch_bookmark_interval);
    tokio::spawn(forward(
        sub.live,
        Queue {
            tx,
            fatal: fatal.clone(),
            capacity: api.watch_queue,
        },
        tenant,
        sub.start,
        bookmark,
        standing,
    ));
    Ok(Box::pin(WatchStream {
        replay,
        rx,
        fatal,
        mgr: mgr.clone(),
        done: false,
    }))
}

fn too_slow(message: String) -> Status {
    rich(
        Code::ResourceExhausted,
        message,
        WATCHER_TOO_SLOW,
        ErrorDetails::new(),
    )
}

/// Where a watcher's events go, and the status it ends with when it is dropped.
struct Queue {
    tx: mpsc::Sender<Item>,
    fatal: Arc<Mutex<Option<Status>>>,
    capacity: usize,
}

impl Queue {
    fn fail(&self, st: Status) {
        *self.fatal.lock().unwrap_or_else(|p| p.into_inner()) = Some(st);
    }
}

/// Move live events into the watcher's queue until the client goes away, the
/// queue is full, the lease core closes, or the caller may no longer watch (its
/// token expired, or a reload no longer maps it to the principal it watched as).
async fn forward(
    mut live: broadcast::Receiver<Arc<LeaseEvent>>,
    q: Queue,
    tenant: Option<String>,
    mut reached: u64,
    bookmark: Option<Duration>,
    standing: Standing,
) {
    let mut tick = bookmark.map(|d| {
        let mut i = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        i
    });
    let expiry = standing.expires_in.map(|d| tokio::time::Instant::now() + d);
    loop {
        let item = tokio::select! {
            r = live.recv() => match r {
                Ok(ev) => {
                    reached = ev.revision;
                    if tenant.as_ref().is_some_and(|t| *t != ev.lease.tenant) {
                        continue;
                    }
                    Item::Event(ev)
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    q.fail(too_slow(format!(
                        "this watcher fell {n} events behind and was dropped; watch again from the last revision it received"
                    )));
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            // A watcher whose client left ends now, not at the next event it
            // would be sent (with a tenant filter that may never come).
            () = q.tx.closed() => return,
            () = async {
                match tick.as_mut() {
                    Some(t) => {
                        t.tick().await;
                    }
                    None => std::future::pending().await,
                }
            } => Item::Bookmark(reached),
            () = async {
                match expiry {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {
                q.fail(Status::unauthenticated(format!(
                    "the bearer token this watch began with has expired: sign in again and watch from revision {reached}"
                )));
                return;
            }
        };
        if let Err(st) = (standing.check)() {
            q.fail(st);
            return;
        }
        match q.tx.try_send(item) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                q.fail(too_slow(format!(
                    "this watcher's queue of {} events (api.watch_queue) is full: it does not read as fast as events come, and was dropped; watch again from the last revision it received",
                    q.capacity
                )));
                return;
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return,
        }
    }
}

struct WatchStream {
    replay: VecDeque<Arc<LeaseEvent>>,
    rx: mpsc::Receiver<Item>,
    fatal: Arc<Mutex<Option<Status>>>,
    mgr: Arc<LeaseManager>,
    done: bool,
}

impl WatchStream {
    fn event_pb(&self, ev: &LeaseEvent) -> pb::LeaseEvent {
        let mut out = convert::event_to_pb(ev);
        // A multi-partition lease's every partition, while it holds them.
        if ev.lease.partition_count() > 1
            && let Some(l) = out.lease.as_mut()
        {
            let (parts, links) = self.mgr.partitions_of(&ev.lease);
            convert::add_partitions(l, &parts, links.as_ref());
        }
        out
    }
}

impl Stream for WatchStream {
    type Item = Result<pb::LeaseEvent, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(ev) = this.replay.pop_front() {
            return Poll::Ready(Some(Ok(this.event_pb(&ev))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        match this.rx.poll_recv(cx) {
            Poll::Ready(Some(Item::Event(ev))) => Poll::Ready(Some(Ok(this.event_pb(&ev)))),
            Poll::Ready(Some(Item::Bookmark(revision))) => Poll::Ready(Some(Ok(pb::LeaseEvent {
                kind: pb::LeaseEventKind::Bookmark as i32,
                lease: None,
                at_ms: now_ms(),
                message: String::new(),
                revision,
            }))),
            Poll::Ready(None) => {
                this.done = true;
                let fatal = this.fatal.lock().unwrap_or_else(|p| p.into_inner()).take();
                Poll::Ready(fatal.map(Err))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
