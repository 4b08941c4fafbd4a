//! The node and operator calls: GetNode, GetUsage, GetQuota, GrantQuota,
//! SetGpuHealth, ReloadConfig. Each is the call into the lease core; the envelope
//! does the rest.

use std::collections::HashSet;

use tessera_proto::v1 as pb;
use tonic::Status;

use super::super::auth::{Principal, Rpc};
use super::super::convert::{self, status};
use super::super::envelope::{About, Call, Handled, Handler};
use super::super::state::ApiState;
use crate::config::Amounts;
use crate::gpu::HealthCause;
use crate::lease::{HealthSource, LeaseManager};

impl Handler for pb::GetNodeRequest {
    const RPC: Rpc = Rpc::GetNode;
    type Reply = pb::GetNodeResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let own = cx.who.tenant().unwrap_or("");
        Handled::new(node(&cx.api.mgr, &cx.who), About::tenant(own))
    }
}

/// The node's GPUs; a tenant sees capacity, and only its own partitions.
fn node(mgr: &LeaseManager, who: &Principal) -> Result<pb::GetNodeResponse, Status> {
    let mut gpus: Vec<pb::Gpu> = mgr.node().iter().map(convert::gpu_to_pb).collect();
    if let Some(own) = who.tenant() {
        let mine: HashSet<String> = mgr
            .list(Some(own), None, false)
            .map_err(status)?
            .into_iter()
            .map(|(l, _)| l.id)
            .collect();
        for g in &mut gpus {
            g.partitions.retain(|p| mine.contains(&p.lease_id));
        }
    }
    Ok(pb::GetNodeResponse {
        hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default(),
        backend: mgr.backend().name().to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        gpus,
        driver_version: mgr.backend().driver_version().unwrap_or_default(),
        queued_requests: u32::try_from(mgr.queued_requests()).unwrap_or(u32::MAX),
    })
}

impl Handler for pb::GetUsageRequest {
    const RPC: Rpc = Rpc::GetUsage;
    type Reply = pb::GetUsageResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let (api, r) = (&cx.api, &cx.req);
        let result = api.scope(&cx.who, &r.tenant).and_then(|tenant| {
            let q = pb::GetUsageRequest {
                tenant,
                ..r.clone()
            };
            usage(&api.mgr, &q)
        });
        Handled::new(result, About::tenant(&r.tenant))
    }
}

/// GetUsage: usage per tenant (`tenant` empty = all; `to_ms` 0 = now).
fn usage(mgr: &LeaseManager, req: &pb::GetUsageRequest) -> Result<pb::GetUsageResponse, Status> {
    if req.from_ms < 0 || req.to_ms < 0 {
        return Err(Status::invalid_argument(
            "invalid window: from_ms and to_ms are unix milliseconds (0 = unbounded / now)",
        ));
    }
    let tenant = (!req.tenant.is_empty()).then_some(req.tenant.as_str());
    match mgr.usage(tenant, req.from_ms, req.to_ms) {
        Ok(rows) => Ok(pb::GetUsageResponse {
            usage: rows
                .into_iter()
                .map(|u| pb::TenantUsage {
                    tenant: u.tenant,
                    mig_slice_seconds: u.mig_slice_seconds,
                    mps_sm_percent_seconds: u.mps_sm_percent_seconds,
                    memory_gib_seconds: u.memory_gib_seconds,
                    whole_gpu_seconds: u.whole_gpu_seconds,
                    leases: u.leases,
                })
                .collect(),
        }),
        Err(e @ crate::usage::UsageError::BadWindow { .. }) => {
            Err(Status::invalid_argument(e.to_string()))
        }
        Err(e) => Err(Status::internal(format!("usage: {e}"))),
    }
}

impl Handler for pb::ReloadConfigRequest {
    const RPC: Rpc = Rpc::ReloadConfig;
    type Reply = pb::ReloadConfigResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let result = cx
            .api
            .reload()
            .map(|message| pb::ReloadConfigResponse { message });
        Handled::new(result, About::default())
    }
}

fn amounts_to_pb(a: Amounts) -> pb::QuotaAmounts {
    pb::QuotaAmounts {
        mig_slices: a.mig_slices,
        mps_sm_percent: a.mps_sm_percent,
        memory_bytes: a.memory_bytes,
        whole_gpus: a.whole_gpus,
    }
}

fn amounts_from_pb(a: &pb::QuotaAmounts) -> Amounts {
    Amounts {
        mig_slices: a.mig_slices,
        mps_sm_percent: a.mps_sm_percent,
        memory_bytes: a.memory_bytes,
        whole_gpus: a.whole_gpus,
    }
}

impl Handler for pb::GrantQuotaRequest {
    const RPC: Rpc = Rpc::GrantQuota;
    type Reply = pb::GrantQuotaResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let (api, r) = (&cx.api, &cx.req);
        let extra = r.extra_burst.unwrap_or_default();
        let result = api
            .mgr
            .grant_quota(
                &r.tenant,
                amounts_from_pb(&extra),
                r.expires_at_ms,
                &r.reason,
                cx.who.name(),
            )
            .await
            .map_err(status);
        let grant_id = match result {
            Ok(g) => g,
            Err(st) => return Handled::new(Err(st), About::tenant(&r.tenant)),
        };
        // The reason and the amounts are part of the audit trail.
        let mut rec = ApiState::record(cx.who.name(), "QuotaGranted", grant_id.clone());
        rec.tenant = r.tenant.clone();
        rec.reasons = vec![
            r.reason.clone(),
            format!(
                "extra burst: {} MIG slices, {}% MPS SMs, {} bytes, {} whole GPUs until {}",
                extra.mig_slices,
                extra.mps_sm_percent,
                extra.memory_bytes,
                extra.whole_gpus,
                r.expires_at_ms
            ),
        ];
        Handled::new(
            Ok(pb::GrantQuotaResponse { grant_id }),
            About::tenant(&r.tenant),
        )
        .then(rec)
    }
}

impl Handler for pb::GetQuotaRequest {
    const RPC: Rpc = Rpc::GetQuota;
    type Reply = pb::GetQuotaResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let (api, r) = (&cx.api, &cx.req);
        let result = api
            .scope(&cx.who, &r.tenant)
            .and_then(|tenant| quota(&api.mgr, tenant));
        Handled::new(result, About::tenant(&r.tenant))
    }
}

/// A tenant's quota, what it uses and its grants now.
fn quota(mgr: &LeaseManager, tenant: String) -> Result<pb::GetQuotaResponse, Status> {
    if tenant.is_empty() {
        return Err(Status::invalid_argument("invalid tenant: required"));
    }
    let (q, used, extra, class) = mgr.quota_of(&tenant);
    let q = q.ok_or_else(|| {
        Status::not_found(format!(
            "tenant {tenant:?} has no quota on this node (quotas are off or it is not configured)"
        ))
    })?;
    Ok(pb::GetQuotaResponse {
        tenant,
        guaranteed: Some(amounts_to_pb(q.guaranteed)),
        burst: Some(amounts_to_pb(crate::lease::quota::add(q.burst, extra))),
        used: Some(amounts_to_pb(used)),
        priority_class: class,
    })
}

impl Handler for pb::SetGpuHealthRequest {
    const RPC: Rpc = Rpc::SetGpuHealth;
    type Reply = pb::SetGpuHealthResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let (api, r) = (&cx.api, &cx.req);
        let result = set_health(&api.mgr, r).await;
        let Ok(resp) = result else {
            return Handled::new(result, About::default());
        };
        // What changed, and why, is part of the audit trail.
        let scope = match r.gi_id {
            Some(gi) => format!("GPU {} instance {gi}", r.gpu_index),
            None => format!("GPU {}", r.gpu_index),
        };
        let (action, now) = if r.healthy {
            ("GpuMarkedHealthy", "in service")
        } else {
            ("GpuMarkedUnhealthy", "out of service")
        };
        let what = if resp.changed { "now" } else { "already" };
        let mut rec = ApiState::record(cx.who.name(), action, format!("{scope} {what} {now}"));
        rec.reasons = vec![r.reason.clone()];
        Handled::new(Ok(resp), About::default()).then(rec)
    }
}

/// Mark a GPU or one of its instances in or out of service (a store write and,
/// with `on_unhealthy = "revoke"`, revocations).
async fn set_health(
    mgr: &LeaseManager,
    r: &pb::SetGpuHealthRequest,
) -> Result<pb::SetGpuHealthResponse, Status> {
    let reason = r.reason.trim();
    if reason.is_empty() || reason.len() > 1024 {
        return Err(Status::invalid_argument(
            "invalid reason: required, at most 1024 characters (it goes to the audit log)",
        ));
    }
    let changed = if r.healthy {
        mgr.mark_healthy(r.gpu_index, r.gi_id, HealthSource::Operator, reason)
            .await
            .map_err(status)?
            .is_some()
    } else {
        let cause = HealthCause::Operator {
            reason: reason.to_string(),
        };
        mgr.mark_unhealthy(r.gpu_index, r.gi_id, cause, HealthSource::Operator)
            .await
            .map_err(status)?
    };
    let gpu = mgr
        .node()
        .iter()
        .find(|g| g.info.index == r.gpu_index)
        .map(convert::gpu_to_pb);
    Ok(pb::SetGpuHealthResponse { gpu, changed })
}
