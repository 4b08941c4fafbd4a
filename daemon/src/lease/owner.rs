//! A live lease handed to another tenant, with labels merged: the kubelet device
//! plugin reserves capacity as leases of its default tenant and hands each to the
//! tenant of the pod that holds it once PodResources names the pod.

use std::collections::BTreeMap;

use tessera_common::clock::now_ms;

use crate::model::{Lease, LeaseState};
use crate::names::{truncate, validate_tenant};

use super::error::LeaseError;
use super::manager::LeaseManager;
use super::validate::validate_labels;

impl LeaseManager {
    /// Give the active lease `id` to `tenant` (admitted by that tenant's quota like a
    /// new lease of the same shape) and set `labels` on it (other labels stay).
    /// Recorded in the store before it is answered; a refused write undoes it.
    pub async fn reassign(
        &self,
        id: &str,
        tenant: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Lease, LeaseError> {
        validate_tenant(tenant)?;
        let tenancy = self.tenancy();
        let extra = self.grants_extra(tenant, now_ms());
        let (after, before) = {
            let mut st = self.change();
            let lease = st.leases.get(id).cloned().ok_or_else(|| {
                LeaseError::NotFound(format!("no live lease {:?}", truncate(id, 80)))
            })?;
            if lease.state() != LeaseState::Active {
                return Err(LeaseError::FailedPrecondition(format!(
                    "lease {id} is {}, only active leases change hands",
                    lease.state().as_str()
                )));
            }
            let mut merged = lease.labels.clone();
            merged.extend(labels);
            validate_labels(&merged)?;
            if lease.tenant == tenant && merged == lease.labels {
                return Ok(lease);
            }
            if lease.tenant != tenant {
                Self::admit(
                    &st,
                    &tenancy,
                    tenant,
                    &lease.shape,
                    lease.partition_count(),
                    extra,
                )?;
            }
            let mut l = st.leases.get_mut(id).ok_or_else(|| {
                LeaseError::NotFound(format!("no live lease {:?}", truncate(id, 80)))
            })?;
            let before = (l.tenant.clone(), l.labels.clone());
            l.tenant = tenant.to_string();
            l.labels = merged;
            (l.clone(), before)
        };
        let stored = after.clone();
        if let Err(e) = self.store.write(move |w| w.put_lease(&stored)).await {
            let mut st = self.change();
            if let Some(mut l) = st.leases.get_mut(id)
                && l.tenant == after.tenant
                && l.labels == after.labels
            {
                (l.tenant, l.labels) = before;
            }
            return Err(e.into());
        }
        Ok(after)
    }
}
