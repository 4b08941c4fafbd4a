//! The one envelope every tessera.v1 call runs in ([`serve`]): each RPC is a
//! [`Handler`] on its request type, and the envelope does for all of them, the same
//! way:
//!
//! 1. auth: who the caller is (`auth::caller_of`, `Authenticator::identify`) and
//!    whether its kind may call the RPC at all (`auth::allowed`); a refusal is
//!    counted, audited and answered here, before any handler runs;
//! 2. write-ahead audit for calls that change something (`audit.on_failure`);
//! 3. deadline: the caller's `grpc-timeout`, handed to the handler ([`Call`]);
//! 4. the handler, run to its end even if the client goes away when it changes
//!    state ([`Handler::runs_to_end`]);
//! 5. the outcome: the rich error model on every refusal (`errors::with_error_info`),
//!    `tessera_api_calls_total{rpc,code}`, and one audit record naming the tenant,
//!    lease and container the handler reports ([`About`]), then any records the
//!    handler adds ([`Handled::then`]).
//!
//! Latency (`tessera_api_call_duration_seconds`) is measured around the whole
//! generated server by [`timing::Timed`], so that a call refused before it reaches a
//! handler (a message over the size limit, an unknown method) is timed too.
//!
//! Owns: the order of those steps. May use: auth, errors, state, and the layers below
//! `api`.

pub mod timing;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};
use tonic_types::StatusExt;

use super::auth::{self, Caller, Principal, Rpc};
use super::errors::{self, DOMAIN};
use super::state::ApiState;
use crate::audit::Record;
use crate::config::AuditOnFailure;

/// One RPC: its request type, what it answers, and the call into the core.
pub(super) trait Handler: Sized + Send + 'static {
    const RPC: Rpc;
    type Reply: Send + 'static;

    /// Whether the call runs to its end even if its client goes away: hyper drops a
    /// handler whose client reset the stream, and a lease operation cancelled between
    /// its steps would stay half done (a lease pending forever, a teardown never
    /// retried). Every call that changes state does.
    fn runs_to_end(&self) -> bool {
        Self::RPC.mutates()
    }

    /// The call into the core, for a caller already identified and allowed.
    fn handle(cx: Call<Self>) -> impl Future<Output = Handled<Self::Reply>> + Send;
}

/// A call as its handler gets it.
pub(super) struct Call<T> {
    pub(super) api: Arc<ApiState>,
    pub(super) who: Principal,
    /// How the caller reached the daemon (a stream checks it again as it goes on).
    pub(super) caller: Caller,
    /// The caller's deadline (`grpc-timeout`), when it sent one.
    pub(super) deadline: Option<Duration>,
    pub(super) req: T,
}

/// What a call was about, for its audit record.
#[derive(Debug, Default, Clone)]
pub(super) struct About {
    pub(super) tenant: String,
    pub(super) lease: String,
    pub(super) container: String,
}

impl About {
    pub(super) fn tenant(tenant: &str) -> About {
        About {
            tenant: tenant.to_string(),
            ..About::default()
        }
    }

    pub(super) fn lease(tenant: &str, lease: &str) -> About {
        About {
            tenant: tenant.to_string(),
            lease: lease.to_string(),
            container: String::new(),
        }
    }
}

/// A handler's answer: the result, what it was about, and what else the audit log
/// keeps of it.
pub(super) struct Handled<R> {
    result: Result<R, Status>,
    about: About,
    /// Records written after the outcome's, when the call succeeded.
    then: Vec<Record>,
    /// Whether the envelope writes the outcome's record (a handler whose own record
    /// is the outcome says no).
    record: bool,
}

impl<R> Handled<R> {
    pub(super) fn new(result: Result<R, Status>, about: About) -> Self {
        Handled {
            result,
            about,
            then: Vec::new(),
            record: true,
        }
    }

    /// A record to write after the outcome's, when the call succeeded.
    pub(super) fn then(mut self, rec: Record) -> Self {
        self.then.push(rec);
        self
    }

    /// A success the handler has recorded itself: counted, no outcome record.
    pub(super) fn recorded(result: R) -> Self {
        Handled {
            record: false,
            ..Handled::new(Ok(result), About::default())
        }
    }
}

/// Run one call of `H` in the envelope.
pub(super) async fn serve<H: Handler>(
    api: &Arc<ApiState>,
    req: Request<H>,
) -> Result<Response<H::Reply>, Status> {
    let (who, caller) = begin(api, H::RPC, &req)?;
    let deadline = grpc_timeout(req.metadata());
    let req = req.into_inner();
    let to_end = req.runs_to_end();
    let api = api.clone();
    let call = async move {
        let cx = Call {
            api: api.clone(),
            who: who.clone(),
            caller,
            deadline,
            req,
        };
        finish(&api, H::RPC, &who, H::handle(cx).await).map(Response::new)
    };
    if to_end {
        tokio::spawn(call)
            .await
            .map_err(|e| Status::internal(format!("request task failed: {e}")))?
    } else {
        call.await
    }
}

/// How an audit record names a status code ("PermissionDenied").
fn audit_code(code: tonic::Code) -> String {
    format!("{code:?}")
}

/// Identify the caller and check that its kind may call `rpc` at all; for a call
/// that changes something, its audit record written ahead.
fn begin<T>(api: &ApiState, rpc: Rpc, req: &Request<T>) -> Result<(Principal, Caller), Status> {
    let caller = auth::caller_of(req);
    let refuse = |st: Status, who: String| {
        api.count(rpc, st.code());
        let mut rec = ApiState::record(&who, rpc.name(), audit_code(st.code()));
        rec.reasons = vec![st.message().to_string()];
        rec.oidc = caller.oidc().cloned();
        api.write_audit(rec);
        errors::with_error_info(st)
    };
    let who = api
        .auth
        .identify(&caller)
        .map_err(|st| refuse(st, caller.describe()))?;
    if !auth::allowed(rpc, &who) {
        let st = Status::permission_denied(format!(
            "principal {:?} may not call {}",
            who.name(),
            rpc.name()
        ));
        return Err(refuse(st, who.name().to_string()));
    }
    if rpc.mutates() {
        audit_ahead(api, rpc, &who)?;
    }
    Ok((who, caller))
}

/// Before a call changes anything: its audit record, written ahead. When that
/// fails and `audit.on_failure = "refuse"`, the call is refused and nothing happens
/// that the log cannot show (auditd's disk-full action); with "log" it goes on. The
/// outcome is recorded after the call as before.
fn audit_ahead(api: &ApiState, rpc: Rpc, who: &Principal) -> Result<(), Status> {
    let Some(a) = &api.audit else {
        return Ok(());
    };
    let mut rec = ApiState::record(who.name(), rpc.name(), "attempt".into());
    rec.tenant = who.tenant().unwrap_or_default().to_string();
    rec.oidc = who.oidc().cloned();
    let Err(e) = a.record(rec) else {
        return Ok(());
    };
    if let Some(m) = &api.metrics {
        m.audit_failed();
    }
    match api.mgr.config().audit.on_failure {
        AuditOnFailure::Log => {
            tracing::error!(error = %e, rpc = rpc.name(), "audit log write failed; going on (audit.on_failure = \"log\")");
            Ok(())
        }
        AuditOnFailure::Refuse => {
            tracing::error!(error = %e, rpc = rpc.name(), "audit log write failed; refusing the call (audit.on_failure = \"refuse\")");
            api.count(rpc, tonic::Code::Unavailable);
            let mut details =
                tonic_types::ErrorDetails::with_retry_info(Some(Duration::from_secs(30)));
            details.set_error_info("AUDIT_UNAVAILABLE", DOMAIN, HashMap::new());
            Err(Status::with_error_details(
                tonic::Code::Unavailable,
                format!(
                    "{} refused: the audit log cannot be written ({e}); nothing was changed. Free space or fix {}, then retry",
                    rpc.name(),
                    a.path().display()
                ),
                details,
            ))
        }
    }
}

/// The outcome of a call: its error details, its count and its audit records (each
/// naming the person behind a token, when the caller showed one).
fn finish<R>(api: &ApiState, rpc: Rpc, who: &Principal, h: Handled<R>) -> Result<R, Status> {
    let subject = who.oidc().cloned();
    let r = h.result.map_err(errors::with_error_info);
    api.count(rpc, r.as_ref().err().map_or(tonic::Code::Ok, Status::code));
    if h.record {
        let (result, reasons) = match &r {
            Ok(_) => ("ok".to_string(), vec![]),
            Err(st) => (audit_code(st.code()), vec![st.message().to_string()]),
        };
        let mut rec = ApiState::record(who.name(), rpc.name(), result);
        rec.tenant = h.about.tenant;
        rec.lease = h.about.lease;
        // An id is at most 1024 bytes where it is accepted; a refused one may be
        // longer (the request's limit): the record keeps its start.
        rec.container = crate::names::truncate(&h.about.container, 1024);
        rec.reasons = reasons;
        rec.oidc = subject.clone();
        api.write_audit(rec);
    }
    if r.is_ok() {
        for mut rec in h.then {
            rec.oidc = rec.oidc.or_else(|| subject.clone());
            api.write_audit(rec);
        }
    }
    r
}

/// The caller's deadline from its `grpc-timeout` header (digits and a unit: H, M, S,
/// m, u, n), None when absent or malformed.
fn grpc_timeout(meta: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let v = meta.get("grpc-timeout")?.to_str().ok()?;
    let split = v.len().checked_sub(1)?;
    let (digits, unit) = (v.get(..split)?, v.get(split..)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_headers_are_read_as_deadlines() {
        let with = |v: &str| {
            let mut m = tonic::metadata::MetadataMap::new();
            m.insert("grpc-timeout", v.parse().unwrap());
            grpc_timeout(&m)
        };
        assert_eq!(with("300m"), Some(Duration::from_millis(300)));
        assert_eq!(with("2S"), Some(Duration::from_secs(2)));
        assert_eq!(with("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(with("5u"), Some(Duration::from_micros(5)));
        assert_eq!(with("12x"), None);
        assert_eq!(with("S"), None);
        assert_eq!(grpc_timeout(&tonic::metadata::MetadataMap::new()), None);
    }
}
