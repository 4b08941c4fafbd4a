//! Each token of the spec to the daemon's answer (an ACTIVE lease), and what they grant
//! merged into the one grant the container may use.

use super::view::SpecView;
use crate::harden::TOKEN_ANNOTATION;
use crate::lease::cache::AnswerCache;
use crate::lease::{DaemonClient, LeaseError, ResolvedLease};
use crate::policy::NoToken;
use crate::refusal::Refusal;
use crate::session::Session;
use std::path::PathBuf;
use tessera_proto::v1 as pb;
use thiserror::Error;

/// Why the spec's tokens do not resolve to a grant.
#[derive(Debug, Error)]
pub enum ResolveError {
    #[error(
        "the container carries no lease token ({TOKEN_ANNOTATION}) and the policy refuses such containers"
    )]
    NoToken,
    #[error("the tessera daemon at {} is unavailable: no socket there", .0.display())]
    NoDaemon(PathBuf),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("two tokens name the same lease {0}")]
    SameLease(String),
    /// A lease's token is bound to another pod than the container's (`why` says so).
    #[error("{why}")]
    OtherPod { lease: String, why: String },
}

impl ResolveError {
    /// The refusal it is, on the lease it names (if any).
    pub fn refusal(self) -> Refusal {
        let lease = match &self {
            Self::SameLease(l) | Self::OtherPod { lease: l, .. } => l.clone(),
            _ => String::new(),
        };
        Refusal::from(self).on_lease(lease)
    }
}

/// A lease token and the daemon's answer for it that the spec was judged against.
#[derive(Debug, Clone)]
pub struct Answer {
    pub token: String,
    pub judged: pb::ResolveTokenResponse,
    /// Kept from an earlier start (not asked of the daemon this time).
    pub kept: bool,
}

/// The answers for the spec's tokens and the grant they make together.
#[derive(Debug, Default)]
pub struct Grant {
    pub answers: Vec<Answer>,
    pub lease: Option<ResolvedLease>,
}

/// Resolve every token of the spec (from `kept` answers where it has one): each must
/// resolve to an ACTIVE lease, and what they grant is merged (refused when it cannot
/// be: two MPS shares, two tenants). No token: no grant, or a refusal if the policy
/// says so.
pub fn resolve(
    s: &Session,
    view: &SpecView,
    client: Option<&DaemonClient>,
    kept: Option<&AnswerCache>,
) -> Result<Grant, ResolveError> {
    if view.tokens.is_empty() {
        if s.cfg.policy.no_token == NoToken::Refuse && !view.sandbox {
            return Err(ResolveError::NoToken);
        }
        return Ok(Grant::default());
    }
    let Some(c) = client else {
        return Err(ResolveError::NoDaemon(s.cfg.daemon_socket.clone()));
    };
    let mut answers = Vec::with_capacity(view.tokens.len());
    let mut resolved = Vec::with_capacity(view.tokens.len());
    for t in &view.tokens {
        let (answer, lease) = answer(s, c, t, kept)?;
        resolved.push(lease);
        answers.push(answer);
    }
    check_distinct(&resolved, view.pod.as_deref())?;
    Ok(Grant {
        answers,
        lease: Some(crate::lease::merge(resolved)?),
    })
}

/// The answer for one token: one kept from an earlier start is judged against as a
/// fresh one would be (the bind then has the daemon confirm it is still current);
/// otherwise the daemon's.
fn answer(
    s: &Session,
    c: &DaemonClient,
    t: &str,
    kept: Option<&AnswerCache>,
) -> Result<(Answer, ResolvedLease), LeaseError> {
    let from_kept = kept.and_then(|k| match k.get(t) {
        Ok(found) => found,
        Err(e) => {
            s.log.warn(&format!(
                "tessera-runtime: kept ResolveToken answer ignored, the daemon is asked: {e}"
            ));
            k.forget(t);
            None
        }
    });
    let was_kept = from_kept.is_some();
    let (judged, lease) = match from_kept {
        Some(found) => found,
        None => c.resolve_answer(t)?,
    };
    let answer = Answer {
        token: t.to_string(),
        judged,
        kept: was_kept,
    };
    Ok((answer, lease))
}

/// No two tokens name one lease, and, validated before anything is bound (a lease whose
/// token another pod holds would refuse its bind after the others were made), with
/// several leases none is bound to another pod.
fn check_distinct(resolved: &[ResolvedLease], pod: Option<&str>) -> Result<(), ResolveError> {
    if let Some(dup) = resolved
        .iter()
        .enumerate()
        .find(|(i, l)| resolved[..*i].iter().any(|o| o.lease_id == l.lease_id))
        .map(|(_, l)| l.lease_id.clone())
    {
        return Err(ResolveError::SameLease(dup));
    }
    if let (true, Some(pod)) = (resolved.len() > 1, pod) {
        for l in resolved {
            if !l.pod.is_empty() && l.pod != pod {
                let why = format!(
                    "the token of lease {} is bound to pod {}; pod {pod} may not use it",
                    l.lease_id, l.pod
                );
                let lease = l.lease_id.clone();
                return Err(ResolveError::OtherPod { lease, why });
            }
        }
    }
    Ok(())
}
