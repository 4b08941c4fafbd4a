//! The runtime's calls: ResolveToken, BindContainer, UnbindContainer,
//! ReportAdmission. Each is the call into the lease core; the envelope does the
//! rest.

use tessera_common::clock::now_ms;
use tessera_proto::v1 as pb;
use tonic::Status;

use super::super::auth::Rpc;
use super::super::convert::{self, status};
use super::super::envelope::{About, Call, Handled, Handler};
use super::super::state::{Admission, ApiState};
use crate::lease::LeaseError;
use crate::lease::devices::Resolved;
use crate::model::ContainerBinding;

/// The tenant and lease a token names, for the audit record of a refusal: the log
/// shows whose lease a refused call tried to use.
fn token_owner(api: &ApiState, token: &str) -> (String, String) {
    api.mgr.token_lease(token).unwrap_or_default()
}

impl Handler for pb::ResolveTokenRequest {
    const RPC: Rpc = Rpc::ResolveToken;
    type Reply = pb::ResolveTokenResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let (api, r) = (&cx.api, &cx.req);
        let result = api.mgr.resolve_token(&r.token).map_err(status);
        let (tenant, lease) = match &result {
            Ok(x) => (x.lease.tenant.clone(), x.lease.id.clone()),
            Err(_) => token_owner(api, &r.token),
        };
        let result = result.map(|x| convert::resolved_to_pb(&x));
        Handled::new(result, About::lease(&tenant, &lease))
    }
}

impl Handler for pb::BindContainerRequest {
    const RPC: Rpc = Rpc::BindContainer;
    type Reply = pb::BindContainerResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let Call { api, who, req, .. } = cx;
        if req.admission_command.len() > 64 {
            let st = Status::invalid_argument("admission_command: at most 64 bytes");
            return Handled::new(Err(st), About::default());
        }
        let container = req.container_id.clone();
        let command = req.admission_command.clone();
        let token = req.token.clone();
        let checked = req.resolved.is_some();
        let result = bind(&api, req).await;
        let (tenant, lease) = match &result {
            Ok(l) => (l.tenant.clone(), l.id.clone()),
            Err(_) => token_owner(&api, &token),
        };
        if result.is_ok() && !command.is_empty() {
            let admission = Admission {
                tenant: tenant.clone(),
                lease: lease.clone(),
                container: container.clone(),
                command,
                admitted: true,
                reasons: Vec::new(),
            };
            api.record_admission(&who, admission);
        }
        let result = result.map(|l| pb::BindContainerResponse {
            lease: Some(convert::lease_to_pb(&l, None)),
            resolution_checked: checked,
        });
        let about = About {
            container,
            ..About::lease(&tenant, &lease)
        };
        Handled::new(result, about)
    }
}

/// Bind a container to its token's lease, when the answer the runtime judged the
/// spec against (if it sent one) is still the current one.
async fn bind(api: &ApiState, r: pb::BindContainerRequest) -> Result<crate::model::Lease, Status> {
    let judged = r.resolved;
    let check = |now: &Resolved| match &judged {
        Some(j) if !convert::same_resolution(j, &convert::resolved_to_pb(now)) => {
            Err(LeaseError::ResolutionChanged(format!(
                "lease {} changed since the runtime resolved its token (devices, environment, mounts, cgroup parent or pod): resolve again",
                now.lease.id
            )))
        }
        _ => Ok(()),
    };
    let binding = ContainerBinding {
        id: r.container_id,
        cgroup_path: r.cgroup_path,
        runtime_root: r.runtime_root,
        bound_at_ms: now_ms(),
        termination_log: r.termination_log_path,
        pod: r.pod,
    };
    api.mgr
        .bind_container_checked(&r.token, binding, r.uid, check)
        .await
        .map_err(status)
}

impl Handler for pb::UnbindContainerRequest {
    const RPC: Rpc = Rpc::UnbindContainer;
    type Reply = pb::UnbindContainerResponse;

    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let (api, r) = (&cx.api, &cx.req);
        let root = Some(r.runtime_root.as_str()).filter(|s| !s.is_empty());
        let result = api
            .mgr
            .unbind_container(&r.container_id, root)
            .await
            .map_err(status)
            .map(|()| pb::UnbindContainerResponse {});
        let about = About {
            container: r.container_id.clone(),
            ..About::default()
        };
        Handled::new(result, about)
    }
}

impl Handler for pb::ReportAdmissionRequest {
    const RPC: Rpc = Rpc::ReportAdmission;
    type Reply = pb::ReportAdmissionResponse;

    /// Its record is the admission's own.
    async fn handle(cx: Call<Self>) -> Handled<Self::Reply> {
        let Call { api, who, req, .. } = cx;
        if req.reasons.len() > 256
            || req.reasons.iter().any(|x| x.len() > 4096)
            || req.container_id.len() > 1024
            || req.command.len() > 64
        {
            let st = Status::invalid_argument("invalid reasons: at most 256 reasons of 4096 bytes");
            return Handled::new(Err(st), About::default());
        }
        // A container on several leases reports their ids joined with ',' (all of
        // one tenant: the runtime refuses a mix).
        let first = req.lease_id.split(',').next().unwrap_or_default();
        let tenant = api
            .mgr
            .get(first)
            .map(|(l, _)| l.tenant)
            .unwrap_or_default();
        let admission = Admission {
            tenant,
            lease: req.lease_id,
            container: req.container_id,
            command: req.command,
            admitted: req.admitted,
            reasons: req.reasons,
        };
        api.record_admission(&who, admission);
        Handled::recorded(pb::ReportAdmissionResponse {})
    }
}
