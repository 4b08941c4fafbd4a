//! [`ClaimSource`] over the API server's ResourceClaims.

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;

use crate::dra::claims::{
    AllocatedDevice, ClaimAllocation, ClaimRef, ClaimSource, ClaimSourceError,
};

/// Reads `status.allocation.devices.results` of the namespaced ResourceClaim.
#[derive(Clone)]
pub struct KubeClaimSource {
    client: kube::Client,
}

impl std::fmt::Debug for KubeClaimSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeClaimSource")
    }
}

impl KubeClaimSource {
    pub fn new(client: kube::Client) -> KubeClaimSource {
        KubeClaimSource { client }
    }
}

/// The allocation of `claim` as `found` holds it.
pub fn allocation_of(
    claim: &ClaimRef,
    found: &ResourceClaim,
) -> Result<ClaimAllocation, ClaimSourceError> {
    let uid = found.metadata.uid.as_deref().unwrap_or_default();
    if uid != claim.uid {
        // Deleted and recreated under the same name: not the claim kubelet means.
        return Err(ClaimSourceError::NotFound(format!(
            "{claim} (the API server's claim of that name has UID {uid:?})"
        )));
    }
    let Some(alloc) = found.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Err(ClaimSourceError::NotAllocated(claim.to_string()));
    };
    let devices = alloc
        .devices
        .as_ref()
        .map(|d| {
            d.results
                .iter()
                .flatten()
                .map(|r| AllocatedDevice {
                    request: r.request.clone(),
                    driver: r.driver.clone(),
                    pool: r.pool.clone(),
                    device: r.device.clone(),
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(ClaimAllocation {
        uid: uid.to_string(),
        devices,
    })
}

#[tonic::async_trait]
impl ClaimSource for KubeClaimSource {
    async fn allocation(&self, claim: &ClaimRef) -> Result<ClaimAllocation, ClaimSourceError> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
        let found = api
            .get_opt(&claim.name)
            .await
            .map_err(|e| ClaimSourceError::Api {
                claim: claim.to_string(),
                message: e.to_string(),
            })?
            .ok_or_else(|| ClaimSourceError::NotFound(claim.to_string()))?;
        allocation_of(claim, &found)
    }
}
