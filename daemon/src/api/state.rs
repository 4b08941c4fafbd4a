//! What every handler of the tessera.v1 API shares: the lease core, the caller
//! rules, the audit log, the metrics, the page tokens and the reload hooks; and the
//! checks that keep a tenant principal to its own tenant.
//!
//! Owns: the API's shared state and its audit and metrics writers. May use: auth,
//! convert, paging, and the layers below `api`.

use std::sync::{Arc, Mutex};

use tessera_common::clock::now_ms;
use tessera_proto::v1 as pb;
use tonic::Status;
use tracing::info;

use super::auth::{Authenticator, Principal, Rpc};
use super::convert::{self, status};
use super::errors::code_name;
use super::paging::PageTokens;
use crate::audit::{AuditLog, Record};
use crate::config::Config;
use crate::lease::LeaseManager;
use crate::metrics::Metrics;

/// What else applies a reloaded config (the device plugin's mix): each gets the new
/// config and answers a few words for the reload message.
pub type ReloadHook = Arc<dyn Fn(&Config) -> String + Send + Sync>;

#[derive(Default)]
pub(super) struct ReloadHooks(Mutex<Vec<ReloadHook>>);

impl std::fmt::Debug for ReloadHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadHooks").finish_non_exhaustive()
    }
}

/// The state of the API, shared by every call.
#[derive(Debug)]
pub(super) struct ApiState {
    pub(super) mgr: Arc<LeaseManager>,
    pub(super) auth: Arc<Authenticator>,
    pub(super) audit: Option<Arc<AuditLog>>,
    pub(super) metrics: Option<Arc<Metrics>>,
    pub(super) reload_hooks: ReloadHooks,
    /// ListLeases page tokens of this daemon run.
    pub(super) tokens: PageTokens,
}

/// A container the runtime admitted or refused, as the audit log keeps it.
#[derive(Debug, Default)]
pub(super) struct Admission {
    pub(super) tenant: String,
    pub(super) lease: String,
    pub(super) container: String,
    pub(super) command: String,
    pub(super) admitted: bool,
    pub(super) reasons: Vec<String>,
}

impl ApiState {
    /// Count a call's outcome (`tessera_api_calls_total`).
    pub(super) fn count(&self, rpc: Rpc, code: tonic::Code) {
        if let Some(m) = &self.metrics {
            m.record_call(rpc.name(), code_name(code));
        }
    }

    /// Write one audit record; a failure is counted and logged here.
    pub(super) fn write_audit(&self, rec: Record) {
        if let Some(a) = &self.audit
            && let Err(e) = a.record(rec)
        {
            if let Some(m) = &self.metrics {
                m.audit_failed();
            }
            tracing::error!(error = %e, "audit log write failed");
        }
    }

    /// An audit record of the API about `who`, with the rest left empty.
    pub(super) fn record(who: &str, action: &str, result: String) -> Record {
        Record {
            at_ms: now_ms(),
            source: "api".into(),
            principal: who.to_string(),
            tenant: String::new(),
            action: action.into(),
            lease: String::new(),
            container: String::new(),
            result,
            reasons: vec![],
            oidc: None,
        }
    }

    /// A container admitted or refused by the runtime: metrics, log and audit.
    pub(super) fn record_admission(&self, who: &Principal, a: Admission) {
        if let Some(m) = &self.metrics {
            m.record_admission(a.admitted, &a.reasons);
        }
        info!(
            container = %a.container,
            lease = %a.lease,
            admitted = a.admitted,
            command = %a.command,
            reasons = ?a.reasons,
            "runtime admission"
        );
        self.write_audit(Record {
            at_ms: now_ms(),
            source: "runtime".into(),
            principal: who.name().to_string(),
            tenant: a.tenant,
            action: if a.command.is_empty() {
                "admission".into()
            } else {
                a.command
            },
            lease: a.lease,
            container: a.container,
            result: if a.admitted { "admitted" } else { "refused" }.into(),
            reasons: a.reasons,
            oidc: who.oidc().cloned(),
        });
    }

    /// The tenant a tenant principal may act for: its own. `asked` must be empty or
    /// equal. Admins act for whatever they ask.
    pub(super) fn scope(&self, who: &Principal, asked: &str) -> Result<String, Status> {
        match who.tenant() {
            None => Ok(asked.to_string()),
            Some(own) if asked.is_empty() || asked == own => Ok(own.to_string()),
            Some(own) => Err(Status::permission_denied(format!(
                "principal {:?} acts for tenant {own:?}, not {asked:?}",
                who.name()
            ))),
        }
    }

    /// For a tenant principal, the lease must be its own tenant's: its tenant.
    pub(super) fn check_lease_owner(
        &self,
        who: &Principal,
        lease_id: &str,
    ) -> Result<String, Status> {
        let (lease, _) = self.mgr.get(lease_id).map_err(status)?;
        if let Some(own) = who.tenant()
            && lease.tenant != own
        {
            return Err(Status::permission_denied(format!(
                "lease {lease_id} belongs to another tenant"
            )));
        }
        Ok(lease.tenant)
    }

    /// A lease on the wire with every partition it holds (and, for several, how
    /// their GPUs connect).
    pub(super) fn lease_pb(
        &self,
        l: &crate::model::Lease,
        p: Option<&crate::model::Partition>,
    ) -> pb::Lease {
        let mut out = convert::lease_to_pb(l, p);
        if l.partition_count() > 1 {
            let (parts, links) = self.mgr.partitions_of(l);
            convert::add_partitions(&mut out, &parts, links.as_ref());
        }
        out
    }

    /// Run `hook` with every config a reload (SIGHUP, ReloadConfig) accepts.
    pub(super) fn on_reload(&self, hook: ReloadHook) {
        self.reload_hooks
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// Re-read the config file and apply what can change at run time: tenants,
    /// quotas, priority classes and principals. A bad file changes nothing.
    pub(super) fn reload(&self) -> Result<String, Status> {
        let path = self.mgr.config().path.clone();
        let cfg = Config::load(&path).map_err(|e| {
            Status::failed_precondition(format!("config not reloaded, the old one stays: {e}"))
        })?;
        let tenants = cfg.tenancy.tenants.len();
        let principals = cfg.auth.principals.len();
        let hooks: Vec<ReloadHook> = self
            .reload_hooks
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let more: String = hooks.iter().map(|h| format!(", {}", h(&cfg))).collect();
        self.mgr.set_tenancy(cfg.tenancy);
        self.auth.set_rules(cfg.auth.principals);
        let msg = format!(
            "reloaded {}: {tenants} tenant quotas, {principals} principals{more} (other sections apply at the next start)",
            path.display()
        );
        info!("{msg}");
        Ok(msg)
    }
}
