//! Quota in force: the tenancy policy, temporary grants, and what a tenant uses.

use std::sync::Arc;

use tessera_common::clock::now_ms;
use tracing::info;

use crate::config::{Amounts, TenancyConfig, TenantQuota};
use crate::model::Grant;
use crate::names::{new_id, validate_tenant};

use super::error::LeaseError;
use super::error::invalid;
use super::manager::LeaseManager;
use super::plan::{Outcome, Publish};
use super::quota;

impl LeaseManager {
    /// The tenancy policy in force (quotas, priority classes); replaced on reload.
    pub fn tenancy(&self) -> Arc<TenancyConfig> {
        self.tenancy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replace quotas and priority classes (SIGHUP, ReloadConfig). Live leases keep
    /// running; the new quotas apply to the next request.
    pub fn set_tenancy(&self, t: TenancyConfig) {
        *self.tenancy.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(t);
    }

    pub(super) fn grants_extra(&self, tenant: &str, now: i64) -> Amounts {
        self.grants
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|g| g.tenant == tenant && g.expires_at_ms > now)
            .fold(Amounts::default(), |acc, g| quota::add(acc, g.extra))
    }

    /// Record a temporary quota raise (durably). Returns its id.
    pub async fn grant_quota(
        &self,
        tenant: &str,
        extra: Amounts,
        expires_at_ms: i64,
        reason: &str,
        granted_by: &str,
    ) -> Result<String, LeaseError> {
        validate_tenant(tenant)?;
        let now = now_ms();
        if expires_at_ms <= now {
            return Err(invalid("expires_at_ms", "must lie in the future"));
        }
        if expires_at_ms - now > 90 * 24 * 3_600_000 {
            return Err(invalid("expires_at_ms", "a grant may last at most 90 days"));
        }
        if reason.trim().is_empty() || reason.len() > 1024 {
            return Err(invalid("reason", "must be 1-1024 characters"));
        }
        if extra == Amounts::default() {
            return Err(invalid("extra_burst", "grants nothing"));
        }
        if !self.tenancy().tenants.contains_key(tenant) {
            return Err(LeaseError::NotFound(format!(
                "tenant {tenant:?} has no quota on this node"
            )));
        }
        let g = Grant {
            id: new_id("g-"),
            tenant: tenant.to_string(),
            extra,
            expires_at_ms,
            reason: reason.to_string(),
            granted_by: granted_by.to_string(),
            created_at_ms: now,
        };
        let id = g.id.clone();
        let granted = Outcome {
            quota_grants: vec![g],
            ..Outcome::default()
        };
        self.commit(granted, Publish::IfCommitted).await?;
        info!(grant = %id, tenant, "temporary quota raise granted");
        Ok(id)
    }

    /// A tenant's quota (None when quotas are off), what its live leases use, and
    /// its active temporary grants.
    pub fn quota_of(&self, tenant: &str) -> (Option<TenantQuota>, Amounts, Amounts, String) {
        let t = self.tenancy();
        let used = self.read().leases.live_usage(tenant);
        let q = t.tenants.get(tenant).cloned();
        let class = q
            .as_ref()
            .map(|q| q.priority_class.clone())
            .unwrap_or_else(|| t.default_priority_class.clone());
        (q, used, self.grants_extra(tenant, now_ms()), class)
    }
}
