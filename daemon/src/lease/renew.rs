//! RenewLease: a new expiry for an active lease.

use std::time::Duration;

use tessera_common::clock::now_ms;

use crate::model::{Lease, LeaseState};
use crate::names::truncate;

use super::error::LeaseError;
use super::events::EventKind;
use super::manager::LeaseManager;
use super::plan::Change;
use super::table::State;
use super::validate::validate_ttl;

impl LeaseManager {
    pub async fn renew(&self, id: &str, ttl: Option<Duration>) -> Result<Lease, LeaseError> {
        self.wait_while_moving(id).await;
        let now = now_ms();
        let lease = self
            .run_records(|st| self.decide_renewal(st, id, ttl, now))
            .await?;
        self.emit(EventKind::Renewed, &lease, None, String::new());
        Ok(lease)
    }

    /// The renewal of lease `id` by `ttl` (its own when none) at `now`: the lease
    /// with its new expiry and its expiry notice forgotten, or the refusal.
    fn decide_renewal(
        &self,
        st: &State,
        id: &str,
        ttl: Option<Duration>,
        now: i64,
    ) -> Result<Change<Lease>, LeaseError> {
        if st.moving.contains(id) {
            return Err(LeaseError::FailedPrecondition(format!(
                "lease {id} is being moved to another MIG placement; retry in a moment"
            )));
        }
        let mut lease = active_lease(st, id, "can be renewed")?;
        let ttl = ttl.unwrap_or(Duration::from_secs(lease.ttl_secs));
        validate_ttl(ttl, &self.config.lease)?;
        lease.expires_at_ms = now + ttl.as_millis() as i64;
        lease.ttl_secs = ttl.as_secs();
        let mut change = Change::leases(vec![lease.clone()], lease);
        change.outcome.marks.notices_cleared.push(id.to_string());
        Ok(change)
    }
}

/// Live lease `id` as the table holds it, when it is active; else the refusal
/// (`only`: what only active leases do).
pub(super) fn active_lease(st: &State, id: &str, only: &str) -> Result<Lease, LeaseError> {
    let lease = st
        .leases
        .get(id)
        .cloned()
        .ok_or_else(|| LeaseError::NotFound(format!("no live lease {:?}", truncate(id, 80))))?;
    if lease.state() != LeaseState::Active {
        return Err(LeaseError::FailedPrecondition(format!(
            "lease {id} is {}, only active leases {only}",
            lease.state().as_str()
        )));
    }
    Ok(lease)
}
