//! A live lease handed to another tenant, with labels merged: the kubelet device
//! plugin reserves capacity as leases of its default tenant and hands each to the
//! tenant of the pod that holds it once PodResources names the pod.

use std::collections::BTreeMap;

use tessera_common::clock::now_ms;

use crate::config::{Amounts, TenancyConfig};
use crate::model::Lease;
use crate::names::validate_tenant;

use super::error::LeaseError;
use super::manager::LeaseManager;
use super::plan::Change;
use super::renew::active_lease;
use super::table::State;
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
        self.run_records(|st| Self::decide_owner(st, id, tenant, labels, (&tenancy, extra)))
            .await
    }

    /// Lease `id` given to `tenant` with `labels` merged into its own: the lease
    /// as it is then (unchanged when nothing changes), or the refusal (not
    /// active, labels invalid, the new tenant's quota).
    fn decide_owner(
        st: &State,
        id: &str,
        tenant: &str,
        labels: BTreeMap<String, String>,
        (tenancy, extra): (&TenancyConfig, Amounts),
    ) -> Result<Change<Lease>, LeaseError> {
        let mut lease = active_lease(st, id, "change hands")?;
        let mut merged = lease.labels.clone();
        merged.extend(labels);
        validate_labels(&merged)?;
        if lease.tenant == tenant && merged == lease.labels {
            return Ok(Change::leases(Vec::new(), lease));
        }
        if lease.tenant != tenant {
            Self::admit(
                st,
                tenancy,
                tenant,
                &lease.shape,
                lease.partition_count(),
                extra,
            )?;
        }
        lease.tenant = tenant.to_string();
        lease.labels = merged;
        Ok(Change::leases(vec![lease.clone()], lease))
    }
}
