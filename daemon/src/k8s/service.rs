//! The DevicePlugin gRPC service of one resource: unpacks requests, asks the
//! plugin, maps its errors to status codes.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use tessera_proto::k8s::deviceplugin::v1beta1 as dp;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::config::resource_name;

use super::{Advertised, DevicePlugin, K8sError, TOKEN_ANNOTATION};

/// What the plugin tells kubelet at registration and when asked.
pub(super) fn options() -> dp::DevicePluginOptions {
    dp::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

pub(super) struct PluginService {
    plugin: Arc<DevicePlugin>,
    class: String,
    /// The endpoint is being replaced or the daemon stops: streams end.
    stop: watch::Receiver<bool>,
}

impl PluginService {
    pub(super) fn new(
        plugin: Arc<DevicePlugin>,
        class: String,
        stop: watch::Receiver<bool>,
    ) -> Self {
        PluginService {
            plugin,
            class,
            stop,
        }
    }
}

fn status(e: K8sError) -> Status {
    match &e {
        K8sError::UnknownDevice { .. } => Status::not_found(e.to_string()),
        K8sError::OneDevicePerContainer { .. } => Status::invalid_argument(e.to_string()),
        K8sError::DeviceEnded { .. } => Status::failed_precondition(e.to_string()),
        _ => Status::unavailable(e.to_string()),
    }
}

fn devices(list: &[Advertised]) -> dp::ListAndWatchResponse {
    dp::ListAndWatchResponse {
        devices: list
            .iter()
            .map(|a| dp::Device {
                id: a.id.clone(),
                health: if a.healthy {
                    dp::HEALTHY
                } else {
                    dp::UNHEALTHY
                }
                .into(),
                topology: None,
            })
            .collect(),
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl dp::device_plugin_server::DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut rx = self.plugin.watch(&self.class);
        let mut stop = self.stop.clone();
        let (tx, out) = mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                let list = devices(&rx.borrow_and_update());
                if tx.send(Ok(list)).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return },
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            let size = usize::try_from(c.allocation_size).unwrap_or(0);
            let ids = self
                .plugin
                .preferred(&c.available_device_i_ds, &c.must_include_device_i_ds, size)
                .await;
            container_responses.push(dp::ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(dp::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        req: Request<dp::AllocateRequest>,
    ) -> Result<Response<dp::AllocateResponse>, Status> {
        let asked: Vec<Vec<String>> = req
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| c.devices_ids)
            .collect();
        let allocs = self
            .plugin
            .allocate(&self.class, &asked)
            .await
            .map_err(|e| {
                tracing::warn!(resource = %resource_name(&self.class), error = %e, "kubernetes: Allocate refused");
                status(e)
            })?;
        let container_responses = allocs
            .into_iter()
            .map(|a| dp::ContainerAllocateResponse {
                envs: HashMap::from([("TESSERA_LEASE_ID".to_string(), a.lease_id.clone())]),
                mounts: Vec::new(),
                devices: Vec::new(),
                annotations: HashMap::from([(TOKEN_ANNOTATION.to_string(), a.token)]),
                cdi_devices: a
                    .cdi_device
                    .into_iter()
                    .map(|name| dp::CdiDevice { name })
                    .collect(),
            })
            .collect();
        Ok(Response::new(dp::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}
