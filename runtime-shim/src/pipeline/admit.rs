//! The policy's decision on a spec: view -> resolve -> harden, against the host as the
//! runtime sees it ([`crate::host::HostView`]).

use super::resolve::{self, Answer, Grant};
use super::view::SpecView;
use crate::harden::seccomp::{Profile, SeccompError};
use crate::harden::{self, Context, Decision};
use crate::host::HostFacts;
use crate::lease::cache::AnswerCache;
use crate::lease::{DaemonClient, ResolvedLease};
use crate::refusal::Refusal;
use crate::session::Session;
use serde_json::Value;
use std::path::Path;
use thiserror::Error;

/// Why no decision could be made.
#[derive(Debug, Error)]
pub enum AdmitError {
    #[error("bad seccomp profile: {0}")]
    Profile(#[from] SeccompError),
}

/// Everything a create-like command decides before acting.
pub struct Admission {
    pub decision: Decision,
    pub lease: Option<ResolvedLease>,
    /// The tokens of the leases the container runs on, with the answers the spec was
    /// judged against (empty: no lease).
    pub answers: Vec<Answer>,
}

impl Admission {
    /// The id of the lease the container runs on ("" for none).
    pub fn lease_id(&self) -> String {
        self.lease
            .as_ref()
            .map(|l| l.lease_id.clone())
            .unwrap_or_default()
    }
}

/// Load the bundle, resolve the token (from `kept` answers where it has one), harden.
/// The refusal carries every reason and the lease id (if one was resolved).
pub fn admit(
    s: &Session,
    client: Option<&DaemonClient>,
    bundle: &Path,
    id: &str,
    kept: Option<&AnswerCache>,
    tenant: Option<&[u8]>,
) -> Result<Admission, Refusal> {
    // One thread, in order: the profile, the spec and its lease (ResolveToken is a
    // read: nothing is bound, written or run before every check has passed), then the
    // host facts. Helper threads for the profile and the facts made a start slower, not
    // faster: making a thread and waking its joiner cost more on a small VM than the
    // 0.1-0.2 ms of work each took off this one (docs/performance.md).
    let profile =
        Profile::load(s.cfg.policy.seccomp_profile.as_deref()).map_err(AdmitError::from)?;
    let view = SpecView::read(bundle, tenant, id, &s.cfg)?;
    let Grant { answers, lease } =
        resolve::resolve(s, &view, client, kept).map_err(resolve::ResolveError::refusal)?;
    let privileged = harden::privileged(&view.spec);
    let decision = judge(s, view.spec, lease.as_ref(), &profile, id, bundle);
    if !decision.admitted {
        let mut reasons = decision.reasons;
        reasons.splice(0..0, privileged);
        return Err(Refusal::many(reasons).on_lease(lease.map(|l| l.lease_id).unwrap_or_default()));
    }
    Ok(Admission {
        decision,
        lease,
        answers,
    })
}

/// Harden `spec` on `lease` (none: the baseline) against this host.
fn judge(
    s: &Session,
    spec: Value,
    lease: Option<&ResolvedLease>,
    profile: &Profile,
    id: &str,
    bundle: &Path,
) -> Decision {
    let host = HostFacts::gather(&s.cfg.nvidia_proc_root);
    let ctx = Context {
        config: &s.cfg,
        seccomp: profile,
        host: &host,
        lease,
        container_id: id,
        systemd_cgroup: s.systemd_cgroup(&spec),
        bundle,
        runc_root: Path::new(s.root()),
    };
    harden::harden(spec, &ctx)
}

/// The spec hardened without a lease (for `check` output after a refusal), or the raw
/// spec, or null.
pub fn partial_spec(s: &Session, bundle: &Path, id: &str) -> Value {
    let Ok(spec) = crate::bundle::load(bundle, s.cfg.policy.max_config_bytes) else {
        return Value::Null;
    };
    let Ok(profile) = Profile::load(s.cfg.policy.seccomp_profile.as_deref()) else {
        return spec;
    };
    judge(s, spec, None, &profile, id, bundle).full_spec()
}
