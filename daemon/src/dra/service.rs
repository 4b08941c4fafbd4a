//! The gRPC services of the DRA plugin: Registration (on the registration socket),
//! DRAPlugin v1 and v1beta1 and DRAResourceHealth v1 (on `dra.sock`).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tessera_common::clock::now_ms;
use tessera_proto::k8s::dra::{v1 as drav1, v1beta1 as drav1beta1};
use tessera_proto::k8s::dra_health::v1 as health;
use tessera_proto::k8s::pluginregistration::v1 as reg;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::{error, info, warn};

use super::DRIVER_NAME;
use super::claims::ClaimRef;
use super::plugin::{DeviceHealth, DraPlugin, PreparedDevice};

/// How often the health stream repeats itself when nothing changes (kubelet
/// treats a device not reported for a while as of unknown health).
const HEALTH_RESEND: Duration = Duration::from_secs(10);

/// What GetInfo answers: the driver, its endpoint and its services.
pub(super) fn plugin_info(endpoint: &std::path::Path) -> reg::PluginInfo {
    reg::PluginInfo {
        r#type: reg::DRA_PLUGIN.into(),
        name: DRIVER_NAME.into(),
        endpoint: endpoint.to_string_lossy().into_owned(),
        // kubelet picks the first DRAPlugin service it knows (newest first), and
        // streams health when a DRAResourceHealth service is listed.
        supported_versions: vec![
            drav1::SERVICE.into(),
            drav1beta1::SERVICE.into(),
            health::SERVICE.into(),
        ],
    }
}

pub(super) struct RegistrationService {
    pub(super) info: reg::PluginInfo,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _req: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        req: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let s = req.into_inner();
        if s.plugin_registered {
            info!("dra: kubelet registered the plugin");
        } else {
            error!(error = %s.error, "dra: kubelet refused the plugin's registration");
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// The DRAPlugin service of one API version over the plugin.
pub(super) struct DraService {
    pub(super) plugin: Arc<DraPlugin>,
}

fn claim_ref(namespace: String, name: String, uid: String) -> ClaimRef {
    ClaimRef {
        namespace,
        name,
        uid,
    }
}

/// Prepare every claim, each on its own: (uid, devices or error).
async fn prepare_all(
    plugin: &DraPlugin,
    claims: Vec<ClaimRef>,
) -> Vec<(String, Result<Vec<PreparedDevice>, String>)> {
    let mut out = Vec::with_capacity(claims.len());
    for c in claims {
        let r = plugin.prepare(&c).await.map_err(|e| {
            warn!(claim = %c, error = %e, "dra: claim not prepared");
            e.to_string()
        });
        out.push((c.uid, r));
    }
    out
}

async fn unprepare_all(plugin: &DraPlugin, claims: Vec<ClaimRef>) -> Vec<(String, String)> {
    let mut out = Vec::with_capacity(claims.len());
    for c in claims {
        let err = match plugin.unprepare(&c).await {
            Ok(()) => String::new(),
            Err(e) => {
                warn!(claim = %c, error = %e, "dra: claim not unprepared");
                e.to_string()
            }
        };
        out.push((c.uid, err));
    }
    out
}

/// The DRAPlugin service of API version `$v` (v1 and v1beta1 have the same
/// messages; v1's Device has a `share_id` more, set with `$share`).
macro_rules! dra_service {
    ($v:ident, $($share:tt)*) => {
        #[tonic::async_trait]
        impl $v::dra_plugin_server::DraPlugin for DraService {
            async fn node_prepare_resources(
                &self,
                req: Request<$v::NodePrepareResourcesRequest>,
            ) -> Result<Response<$v::NodePrepareResourcesResponse>, Status> {
                let claims = req
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| claim_ref(c.namespace, c.name, c.uid))
                    .collect();
                let mut out = HashMap::new();
                for (uid, r) in prepare_all(&self.plugin, claims).await {
                    let resp = match r {
                        Ok(devices) => $v::NodePrepareResourceResponse {
                            devices: devices
                                .into_iter()
                                .map(|d| $v::Device {
                                    request_names: d.requests,
                                    pool_name: d.pool,
                                    device_name: d.device,
                                    cdi_device_ids: d.cdi_device_ids,
                                    $($share)*
                                })
                                .collect(),
                            error: String::new(),
                        },
                        Err(error) => $v::NodePrepareResourceResponse {
                            devices: Vec::new(),
                            error,
                        },
                    };
                    out.insert(uid, resp);
                }
                Ok(Response::new($v::NodePrepareResourcesResponse { claims: out }))
            }

            async fn node_unprepare_resources(
                &self,
                req: Request<$v::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$v::NodeUnprepareResourcesResponse>, Status> {
                let claims = req
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| claim_ref(c.namespace, c.name, c.uid))
                    .collect();
                let claims = unprepare_all(&self.plugin, claims)
                    .await
                    .into_iter()
                    .map(|(uid, error)| (uid, $v::NodeUnprepareResourceResponse { error }))
                    .collect();
                Ok(Response::new($v::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

dra_service!(drav1, share_id: None,);
dra_service!(drav1beta1,);

/// DRAResourceHealth: the prepared devices' health, at once, on every change, and
/// again every [`HEALTH_RESEND`].
pub(super) struct HealthService {
    pub(super) plugin: Arc<DraPlugin>,
    pub(super) stop: watch::Receiver<bool>,
}

fn health_response(list: &[DeviceHealth]) -> health::NodeWatchResourcesResponse {
    let now = now_ms() / 1000;
    health::NodeWatchResourcesResponse {
        devices: list
            .iter()
            .map(|d| health::DeviceHealth {
                device: Some(health::DeviceIdentifier {
                    pool_name: d.pool.clone(),
                    device_name: d.device.clone(),
                }),
                health: if d.healthy {
                    health::HealthStatus::Healthy
                } else {
                    health::HealthStatus::Unhealthy
                } as i32,
                last_updated_time: now,
                health_check_timeout_seconds: 0,
                message: d.message.clone(),
            })
            .collect(),
    }
}

type HealthStream =
    Pin<Box<dyn Stream<Item = Result<health::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl health::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _req: Request<health::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        let mut rx = self.plugin.watch_health();
        let mut stop = self.stop.clone();
        let (tx, out) = mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                let msg = health_response(&rx.borrow_and_update());
                if tx.send(Ok(msg)).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return },
                    _ = tokio::time::sleep(HEALTH_RESEND) => {}
                    _ = stop.wait_for(|s| *s) => return,
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }
}
