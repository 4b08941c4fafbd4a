//! The lease calls: CreateLease, RenewLease, ReleaseLease, GetLease, ListLeases,
//! WatchLeases. Each is the call into the lease core; the envelope does the rest.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tessera_proto::v1 as pb;
use tonic::Status;

use super::super::auth::{Authenticator, Caller, Principal, Rpc};
use super::super::convert::{self, status};
use super::super::envelope::{About, Call, Handled, Handler};
use super::super::errors::bad_field;
use super::super::paging;
use super::super::state::ApiState;
use super::super::watch::{self, EventStream};
use crate::lease::LeaseError;
use crate::model::LeaseState;

/// The receive limit every gRPC stack has by default (grpc-core, grpc-go, grpc-java,
/// tonic): a ListLeases page stays under it, whatever `api.max_send_message` allows.
pub const DEFAULT_CLIENT_LIMIT: usize = 4 << 20;

/// Room a ListLeases page leaves below its limit (the answer's own fields and
/// framing).
const PAGE_HEADROOM: usize = 64 * 1024;

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

impl Handler for pb::CreateLeaseRequest {
    const RPC: Rpc = Rpc::CreateLease;
    type Reply = pb::CreateLeaseResponse;

    /// An immediate create runs to its end even if the client goes away; a queued
    /// one leaves the queue with its caller (each try to create runs to its end all
    /// the same: `create_queued`).
    fn runs_to_end(&self) -> bool {
        self.queue_wait_ms == 0
    }

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let Call {
            api,
            who,
            deadline,
            mut req,
            ..
        } = cx;
        let tenant = match api.scope(&who, &req.tenant) {
            Ok(t) => t,
            Err(st) => return Handled::new(Err(st), About::tenant(&req.tenant)),
        };
        req.tenant = tenant.clone();
        let created = create(&api, req, deadline).await;
        let lease_id = created
            .as_ref()
            .map(|c| c.lease.id.clone())
            .unwrap_or_default();
        let result = created.map(|c| pb::CreateLeaseResponse {
            lease: Some(api.lease_pb(&c.lease, c.partition.as_ref())),
            token: c.token.unwrap_or_default(),
            replayed: c.replayed,
        });
        Handled::new(result, About::lease(&tenant, &lease_id))
    }
}

/// Create a lease now, or within the request's queue wait. A queued call never
/// outlives its caller's deadline.
async fn create(
    api: &ApiState,
    req: pb::CreateLeaseRequest,
    deadline: Option<Duration>,
) -> Result<crate::lease::Created, Status> {
    let asked_wait = Duration::from_millis(u64::from(req.queue_wait_ms));
    let queue_wait = deadline.map_or(asked_wait, |d| asked_wait.min(d));
    let cut_by_deadline = queue_wait < asked_wait;
    let req = convert::create_request_from_pb(req, api.mgr.config().partition.mps_mode)?;
    if asked_wait.is_zero() {
        return api.mgr.create(req).await.map_err(status);
    }
    match api.mgr.create_queued(req, queue_wait).await {
        Err(LeaseError::ResourceExhausted(m)) if cut_by_deadline => {
            Err(Status::deadline_exceeded(m))
        }
        other => other.map_err(status),
    }
}

impl Handler for pb::RenewLeaseRequest {
    const RPC: Rpc = Rpc::RenewLease;
    type Reply = pb::RenewLeaseResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let (api, r) = (&cx.api, &cx.req);
        let result = async {
            let tenant = api.check_lease_owner(&cx.who, &r.lease_id)?;
            let ttl = (r.ttl_seconds > 0).then(|| Duration::from_secs(r.ttl_seconds));
            let lease = api.mgr.renew(&r.lease_id, ttl).await.map_err(status)?;
            let (l, p) = api.mgr.get(&lease.id).map_err(status)?;
            let lease = Some(api.lease_pb(&l, p.as_ref()));
            Ok((tenant, pb::RenewLeaseResponse { lease }))
        }
        .await;
        owned(result, &r.lease_id)
    }
}

/// A call about one lease of `tenant` (the owner the handler checked; empty when
/// it failed before it knew).
fn owned<R>(result: Result<(String, R), Status>, lease: &str) -> Handled<R> {
    let tenant = result.as_ref().map(|(t, _)| t.clone()).unwrap_or_default();
    Handled::new(result.map(|(_, r)| r), About::lease(&tenant, lease))
}

impl Handler for pb::ReleaseLeaseRequest {
    const RPC: Rpc = Rpc::ReleaseLease;
    type Reply = pb::ReleaseLeaseResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let (api, r) = (&cx.api, &cx.req);
        let result = async {
            // Validate first, then look anything up.
            if r.reason.len() > 1024 {
                return Err(Status::invalid_argument(
                    "invalid reason: at most 1024 characters",
                ));
            }
            let tenant = api.check_lease_owner(&cx.who, &r.lease_id)?;
            let reason = if r.reason.is_empty() {
                format!("released by {}", cx.who.name())
            } else {
                r.reason.clone()
            };
            let lease = api
                .mgr
                .end(&r.lease_id, LeaseState::Released, &reason)
                .await
                .map_err(status)?;
            let lease = Some(convert::lease_to_pb(&lease, None));
            Ok((tenant, pb::ReleaseLeaseResponse { lease }))
        }
        .await;
        owned(result, &r.lease_id)
    }
}

impl Handler for pb::GetLeaseRequest {
    const RPC: Rpc = Rpc::GetLease;
    type Reply = pb::GetLeaseResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let (api, r) = (&cx.api, &cx.req);
        let result = api
            .check_lease_owner(&cx.who, &r.lease_id)
            .and_then(|tenant| {
                let (l, p) = api.mgr.get(&r.lease_id).map_err(status)?;
                let lease = Some(api.lease_pb(&l, p.as_ref()));
                Ok((tenant, pb::GetLeaseResponse { lease }))
            });
        owned(result, &r.lease_id)
    }
}

impl Handler for pb::ListLeasesRequest {
    const RPC: Rpc = Rpc::ListLeases;
    type Reply = pb::ListLeasesResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let result = list(&cx.api, &cx.who, &cx.req);
        Handled::new(result, About::tenant(&cx.req.tenant))
    }
}

/// One page of a listing.
fn list(
    api: &ApiState,
    who: &Principal,
    r: &pb::ListLeasesRequest,
) -> Result<pb::ListLeasesResponse, Status> {
    let tenant = api.scope(who, &r.tenant)?;
    let state = convert::state_from_pb(r.state)?;
    let size = paging::page_size(r.page_size).map_err(|e| bad_field("page_size", e))?;
    let filter = paging::filter_hash(&tenant, r.state, r.include_ended);
    let cursor = if r.page_token.is_empty() {
        None
    } else {
        let c = api.tokens.open(&r.page_token, &filter);
        Some(c.map_err(|e| bad_field("page_token", e))?)
    };
    let tenant = non_empty(tenant);
    let after = cursor.as_ref().map(|c| &c.after);
    let page = api
        .mgr
        .list_page(tenant.as_deref(), state, r.include_ended, after, size)
        .map_err(status)?;
    // Every page of a listing answers its first page's revision: watched from
    // there, nothing changed while the pages were read is missed.
    let revision = cursor.as_ref().map_or(page.revision, |c| c.revision);
    let (leases, last, cut) = fill(api, &page.leases);
    let next_page_token = match last {
        Some(key) if page.more || cut => api.tokens.issue(&filter, revision, &key),
        _ => String::new(),
    };
    Ok(pb::ListLeasesResponse {
        leases,
        next_page_token,
        revision,
    })
}

type Listed = (crate::model::Lease, Option<crate::model::Partition>);

/// The leases of a page that fit in what any client takes by default (and in the
/// largest message the daemon sends), the key of the last one, and whether some
/// were left for the next page.
fn fill(api: &ApiState, page: &[Listed]) -> (Vec<pb::Lease>, Option<crate::store::ListKey>, bool) {
    let budget = api
        .mgr
        .config()
        .api
        .max_send_message
        .min(DEFAULT_CLIENT_LIMIT)
        .saturating_sub(PAGE_HEADROOM);
    let mut leases = Vec::with_capacity(page.len());
    let mut bytes = 0usize;
    let mut last = None;
    for (l, p) in page {
        let one = api.lease_pb(l, p.as_ref());
        let n = prost::Message::encoded_len(&one) + 8;
        if !leases.is_empty() && bytes + n > budget {
            return (leases, last, true);
        }
        bytes += n;
        last = Some((l.created_at_ms, l.id.clone()));
        leases.push(one);
    }
    (leases, last, false)
}

/// A watch goes on while its caller is still the principal it began as (a reload
/// may map it to another, or to none) and, for a bearer token, until the token's
/// `exp`.
fn standing(api: &Arc<ApiState>, who: &Principal, caller: &Caller) -> watch::Standing {
    let expires_in = match caller {
        Caller::Token(t) => Some(t.expires_in()),
        _ => None,
    };
    let (auth, who, caller) = (api.auth.clone(), who.clone(), caller.clone());
    // The caller is identified again only when the rules changed since it last was
    // (the first check always: a reload may have come since the call began).
    let checked_at = AtomicU64::new(u64::MAX);
    let check = move || {
        let now_at = auth.generation();
        if checked_at.load(Ordering::SeqCst) == now_at {
            return Ok(());
        }
        still_the_same(&auth, &caller, &who)?;
        checked_at.store(now_at, Ordering::SeqCst);
        Ok(())
    };
    watch::Standing {
        check: Box::new(check),
        expires_in,
    }
}

/// `caller` is still `who` under the rules in force.
fn still_the_same(auth: &Authenticator, caller: &Caller, who: &Principal) -> Result<(), Status> {
    match auth.identify(caller) {
        Ok(now) if now == *who => Ok(()),
        Ok(now) => Err(Status::permission_denied(format!(
            "{} is principal {:?} now, not {:?} as when this watch began: the watch ends; watch again",
            caller.describe(),
            now.name(),
            who.name()
        ))),
        Err(st) => Err(Status::permission_denied(format!(
            "{}: the watch ends",
            st.message()
        ))),
    }
}

impl Handler for pb::WatchLeasesRequest {
    const RPC: Rpc = Rpc::WatchLeases;
    type Reply = EventStream;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let (api, r) = (&cx.api, &cx.req);
        let tenant = match api.scope(&cx.who, &r.tenant) {
            Ok(t) => non_empty(t),
            Err(st) => return Handled::new(Err(st), About::tenant(&r.tenant)),
        };
        let since = (r.since_revision != 0).then_some(r.since_revision);
        let standing = standing(api, &cx.who, &cx.caller);
        let result = watch::start(&api.mgr, tenant.clone(), since, r.bookmarks, standing);
        Handled::new(result, About::tenant(tenant.as_deref().unwrap_or("")))
    }
}
