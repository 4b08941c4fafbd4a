//! RenewLease: a new expiry for an active lease.

use std::time::Duration;

use tessera_common::clock::now_ms;

use crate::model::{Lease, LeaseState};
use crate::names::truncate;

use super::error::LeaseError;
use super::error::invalid;
use super::events::EventKind;
use super::manager::LeaseManager;

impl LeaseManager {
    pub async fn renew(&self, id: &str, ttl: Option<Duration>) -> Result<Lease, LeaseError> {
        self.wait_while_moving(id).await;
        let lease = {
            let mut st = self.change();
            if st.moving.contains(id) {
                return Err(LeaseError::FailedPrecondition(format!(
                    "lease {id} is being moved to another MIG placement; retry in a moment"
                )));
            }
            let mut lease = st.leases.get_mut(id).ok_or_else(|| {
                LeaseError::NotFound(format!("no live lease {:?}", truncate(id, 80)))
            })?;
            if lease.state() != LeaseState::Active {
                return Err(LeaseError::FailedPrecondition(format!(
                    "lease {id} is {}, only active leases can be renewed",
                    lease.state().as_str()
                )));
            }
            let ttl = ttl.unwrap_or(Duration::from_secs(lease.ttl_secs));
            if ttl < self.config.lease.min_ttl || ttl > self.config.lease.max_ttl {
                return Err(invalid(
                    "ttl_seconds",
                    format!(
                        "{}s is outside the allowed {}s..={}s",
                        ttl.as_secs(),
                        self.config.lease.min_ttl.as_secs(),
                        self.config.lease.max_ttl.as_secs()
                    ),
                ));
            }
            let before = (lease.expires_at_ms, lease.ttl_secs);
            lease.expires_at_ms = now_ms() + ttl.as_millis() as i64;
            lease.ttl_secs = ttl.as_secs();
            let l = lease.clone();
            drop(lease);
            let notified = st.expiring_notified.remove(id);
            (l, before, notified)
        };
        let (lease, before, notified) = lease;
        let l2 = lease.clone();
        if let Err(e) = self.store.write(move |w| w.put_lease(&l2)).await {
            // Refused: the renewal did not happen, in memory either (unless another
            // renewal has replaced this one meanwhile).
            let mut st = self.change();
            let undone = match st.leases.get_mut(id) {
                Some(mut l) if l.expires_at_ms == lease.expires_at_ms => {
                    (l.expires_at_ms, l.ttl_secs) = before;
                    true
                }
                _ => false,
            };
            if undone && notified {
                st.expiring_notified.insert(id.to_string());
            }
            return Err(e.into());
        }
        self.emit(EventKind::Renewed, &lease, None, String::new());
        Ok(lease)
    }
}
