//! The kubelet device plugin (deviceplugin v1beta1) and PodResources follower: a
//! client of the lease core, like `api/`.
//!
//! * Every advertised device is a lease the plugin holds for `[kubernetes]
//!   default_tenant`: capacity already placed (a MIG instance created, an MPS share
//!   admitted, a whole GPU held), so kubelet can allocate every advertised device at
//!   once and Allocate never fails for want of room. The device id is the lease id;
//!   the map (with the lease's token) is kept in the store, so a restart advertises
//!   the same ids for the same leases.
//! * Allocate answers the lease's token as the container annotation the runtime reads
//!   (`tessera.io/lease-token`), `TESSERA_LEASE_ID`, and the CDI name
//!   `tessera.io/lease=<id>`; a container asking for several devices (at most
//!   [`MAX_DEVICES_PER_CONTAINER`]) gets the tokens and ids joined with `,` and one
//!   CDI name per lease. The same devices always get the same answer.
//! * PodResources says which pod holds which device: the lease is handed to the
//!   tenant of the pod's namespace and labelled with namespace and pod; a device no
//!   pod holds for `release_grace` is released, and a fresh reservation replaces it.
//! * The mix (devices per class) changes on a config reload: only free reservations
//!   are released or added ([`mix::plan`]).
//!
//! `kubelet.rs` serves one socket per resource and registers it (again when kubelet
//! restarts); `service.rs` is the DevicePlugin gRPC service; `crate::cdi` writes the
//! per-lease CDI specs.

mod kubelet;
pub mod mix;
mod service;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_common::clock::now_ms;
use tokio::sync::{Notify, watch};
use tracing::{error, info, warn};

use crate::config::{ClassSpec, KubernetesConfig, resource_name};
use crate::lease::{CreateRequest, LeaseError, LeaseManager};
use crate::model::{Lease, LeaseState};
use crate::store::{K8sDevice, Store, StoreError};

use crate::cdi;
pub use crate::cdi::{CDI_KIND, CdiError, NvidiaCdi};

/// The CDI kind of the per-lease specs.
/// Labels the plugin puts on its leases.
pub use crate::names::{
    LABEL_K8S_CLASS as LABEL_CLASS, LABEL_K8S_NAMESPACE as LABEL_NAMESPACE,
    LABEL_K8S_POD as LABEL_POD,
};
/// The annotation tessera-runtime reads the lease token from.
pub use tessera_common::contract::LEASE_TOKEN_ANNOTATION as TOKEN_ANNOTATION;

#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Lease(#[from] LeaseError),
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// kubelet's Registration or PodResources did not answer as it should.
    #[error("kubelet at {}: {message}", socket.display())]
    Kubelet { socket: PathBuf, message: String },
    #[error("no device {device:?} of {resource}")]
    UnknownDevice { device: String, resource: String },
    #[error("device {device} of {resource} is no longer usable: {reason}")]
    DeviceEnded {
        device: String,
        resource: String,
        reason: String,
    },
    #[error(
        "a container gets at most {MAX_DEVICES_PER_CONTAINER} devices of {resource} ({n} asked)"
    )]
    TooManyDevices { resource: String, n: usize },
    #[error("a container request names no device of {resource}")]
    NoDevice { resource: String },
    #[error("a container request names device {device:?} of {resource} twice")]
    RepeatedDevice { device: String, resource: String },
    #[error("CDI: {0}")]
    Cdi(#[from] CdiError),
}

/// The most devices of a resource one container may get: the runtime binds the
/// container to every one of their leases.
pub const MAX_DEVICES_PER_CONTAINER: usize = 16;

/// The token annotation for a container given several leases: their tokens in
/// the order kubelet asked for the devices, joined with `,` (a token is a prefix
/// and hex digits, never a comma).
pub fn token_annotation(devices: &[Allocation]) -> String {
    join(devices.iter().map(|a| a.token.as_str()))
}

/// `TESSERA_LEASE_ID` for a container given several leases: the ids joined with
/// `,`, in the order of the tokens.
pub fn lease_id_env(devices: &[Allocation]) -> String {
    join(devices.iter().map(|a| a.lease_id.as_str()))
}

fn join<'a>(it: impl Iterator<Item = &'a str>) -> String {
    it.collect::<Vec<_>>().join(",")
}

/// A device as ListAndWatch advertises it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advertised {
    pub id: String,
    pub healthy: bool,
}

/// What Allocate answers for one device of a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub lease_id: String,
    pub token: String,
    /// `tessera.io/lease=<id>` when CDI specs are published.
    pub cdi_device: Option<String>,
}

/// Who holds a device, as PodResources says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub resource: String,
    pub namespace: String,
    pub pod: String,
}

pub struct DevicePlugin {
    mgr: Arc<LeaseManager>,
    store: Arc<Store>,
    cfg: KubernetesConfig,
    mix: Mutex<BTreeMap<String, ClassSpec>>,
    devices: tokio::sync::Mutex<Vec<K8sDevice>>,
    lists: Mutex<BTreeMap<String, watch::Sender<Vec<Advertised>>>>,
    wake: Notify,
    /// The last reservation failure per class (logged once, not every tick).
    shortfall: Mutex<BTreeMap<String, String>>,
    nvidia: Option<NvidiaCdi>,
}

impl std::fmt::Debug for DevicePlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePlugin").finish_non_exhaustive()
    }
}

/// `dir` readable by its owner only (0700): tightened when group or others may enter.
fn private_dir(dir: &std::path::Path) -> Result<(), K8sError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |source| K8sError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mode = std::fs::metadata(dir).map_err(io)?.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        warn!(dir = %dir.display(), was = format!("{:o}", mode & 0o777), "kubernetes: the state directory holds the device plugin's lease tokens: made 0700");
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every container request of an Allocate, checked before any device is touched:
/// at least one device, at most [`MAX_DEVICES_PER_CONTAINER`], none twice.
fn check_requests(resource: &str, containers: &[Vec<String>]) -> Result<(), K8sError> {
    let resource = resource.to_string();
    for ids in containers {
        if ids.is_empty() {
            return Err(K8sError::NoDevice { resource });
        }
        if ids.len() > MAX_DEVICES_PER_CONTAINER {
            return Err(K8sError::TooManyDevices {
                resource,
                n: ids.len(),
            });
        }
        if let Some((_, id)) = ids
            .iter()
            .enumerate()
            .find(|(i, id)| ids[..*i].contains(id))
        {
            return Err(K8sError::RepeatedDevice {
                device: id.clone(),
                resource,
            });
        }
    }
    Ok(())
}

/// Why a device's lease can no longer be handed to a container: gone, ended, or
/// on an unhealthy GPU; None when it serves.
fn unusable(lease: Option<&Lease>) -> Option<String> {
    match lease {
        None => Some("its lease is gone".to_string()),
        Some(l) if !l.state().is_live() => Some(format!(
            "its lease is {}: {}",
            l.state().as_str(),
            l.end_reason().unwrap_or("")
        )),
        Some(l) => l.unhealthy.clone(),
    }
}

impl DevicePlugin {
    /// Load the devices the store remembers, release leases of devices a crash left
    /// unrecorded, and reserve the mix. Serves nothing yet: see [`DevicePlugin::run`].
    pub async fn start(
        mgr: Arc<LeaseManager>,
        store: Arc<Store>,
        cfg: KubernetesConfig,
    ) -> Result<Arc<DevicePlugin>, K8sError> {
        // The store keeps the devices' tokens: only tesserad's user may read it.
        let state_dir = mgr.config().daemon.state_dir.clone();
        private_dir(&state_dir)?;
        let devices = store.k8s_devices()?;
        let nvidia = if cfg.cdi {
            NvidiaCdi::find(&cdi::nvidia_spec_paths())?
        } else {
            None
        };
        if let Some(n) = &nvidia {
            info!(spec = %n.path.display(), "driver files from the NVIDIA Container Toolkit's CDI spec");
        }
        let plugin = Arc::new(DevicePlugin {
            mix: Mutex::new(cfg.mix.clone()),
            mgr,
            store,
            cfg,
            devices: tokio::sync::Mutex::new(devices),
            lists: Mutex::new(BTreeMap::new()),
            wake: Notify::new(),
            shortfall: Mutex::new(BTreeMap::new()),
            nvidia,
        });
        plugin.release_orphans().await;
        // Devices kubelet allocated stay pinned across a restart (what pins a lease
        // is kept in memory only).
        for d in plugin.devices.lock().await.iter().filter(|d| d.allocated) {
            if let Err(e) = plugin.pin(d) {
                warn!(device = %d.device_id, error = %e, "kubernetes: allocated device not pinned");
            }
        }
        plugin.reconcile().await;
        Ok(plugin)
    }

    pub fn config(&self) -> &KubernetesConfig {
        &self.cfg
    }

    /// A reloaded config's mix: free reservations are re-carved at once.
    pub fn set_mix(&self, mix: BTreeMap<String, ClassSpec>) -> String {
        let msg = format!(
            "kubernetes mix: {}",
            mix.iter()
                .map(|(c, s)| format!("{c}={}", s.count))
                .collect::<Vec<_>>()
                .join(" ")
        );
        *lock(&self.mix) = mix;
        self.wake.notify_one();
        msg
    }

    /// Every class served: those of the mix and those devices still have.
    pub fn classes(&self) -> Vec<String> {
        let mut out: Vec<String> = lock(&self.mix).keys().cloned().collect();
        for c in lock(&self.lists).keys() {
            if !out.contains(c) {
                out.push(c.clone());
            }
        }
        out
    }

    /// The advertised devices of a class, now and on every change.
    pub fn watch(&self, class: &str) -> watch::Receiver<Vec<Advertised>> {
        lock(&self.lists)
            .entry(class.to_string())
            .or_insert_with(|| watch::channel(Vec::new()).0)
            .subscribe()
    }

    fn lease(&self, id: &str) -> Option<Lease> {
        self.mgr.get(id).ok().map(|(l, _)| l)
    }

    /// Leases this plugin made whose device a crash left unrecorded: released.
    async fn release_orphans(&self) {
        let known: Vec<String> = self
            .devices
            .lock()
            .await
            .iter()
            .map(|d| d.lease_id.clone())
            .collect();
        let leases = match self.mgr.list(None, None, false) {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %e, "kubernetes: cannot list leases to find orphans");
                return;
            }
        };
        for (l, _) in leases {
            // Only the default tenant's: whoever could label a lease so could release
            // it through the API anyway.
            if l.labels.contains_key(LABEL_CLASS)
                && l.tenant == self.cfg.default_tenant
                && !l.labels.contains_key(LABEL_POD)
                && !known.contains(&l.id)
                && l.state() == LeaseState::Active
            {
                match self
                    .mgr
                    .end(
                        &l.id,
                        LeaseState::Released,
                        "kubernetes: reservation never recorded as a device (crash)",
                    )
                    .await
                {
                    Ok(_) => info!(lease = %l.id, "kubernetes: released an unrecorded reservation"),
                    Err(e) => {
                        warn!(lease = %l.id, error = %e, "kubernetes: cannot release an unrecorded reservation")
                    }
                }
            }
        }
    }

    async fn persist(&self, d: &K8sDevice) -> Result<(), StoreError> {
        let d = d.clone();
        self.store.write(move |w| w.put_k8s_device(&d)).await
    }

    async fn forget(&self, d: &K8sDevice) -> Result<(), StoreError> {
        let id = d.device_id.clone();
        self.store.write(move |w| w.delete_k8s_device(&id)).await?;
        if self.cfg.cdi
            && let Err(e) = cdi::remove_spec(&self.cfg.cdi_dir, &d.lease_id)
        {
            warn!(error = %e, "kubernetes: CDI spec not removed");
        }
        Ok(())
    }

    /// Renew, apply the mix (forget, release, reserve), and advertise the result.
    pub async fn reconcile(&self) {
        let mut devices = self.devices.lock().await;
        let now = now_ms();
        let ttl = self.cfg.lease_ttl;
        let mut slots = Vec::with_capacity(devices.len());
        for d in devices.iter() {
            let lease = self.lease(&d.lease_id);
            let live = lease.as_ref().is_some_and(|l| l.state().is_live());
            if let Some(l) = &lease
                && l.state() == LeaseState::Active
                && l.expires_at_ms - now < ttl.as_millis() as i64 / 2
                && let Err(e) = self.mgr.renew(&l.id, Some(ttl)).await
            {
                warn!(lease = %l.id, error = %e, "kubernetes: lease not renewed");
            }
            slots.push(mix::Slot {
                device_id: d.device_id.clone(),
                class: d.class.clone(),
                allocated: d.allocated,
                live,
                created_at_ms: d.created_at_ms,
            });
        }
        let mix = lock(&self.mix).clone();
        let plan = mix::plan(&mix, &slots);
        for id in &plan.forget {
            self.drop_device(&mut devices, id).await;
        }
        for id in &plan.release {
            let Some(d) = devices.iter().find(|d| &d.device_id == id).cloned() else {
                continue;
            };
            let reason = format!(
                "kubernetes: the mix reserves fewer {}",
                resource_name(&d.class)
            );
            match self
                .mgr
                .end(&d.lease_id, LeaseState::Released, &reason)
                .await
            {
                Ok(_) => {
                    info!(device = %id, class = %d.class, "kubernetes: free reservation released (mix)");
                    self.drop_device(&mut devices, id).await;
                }
                Err(e) => {
                    warn!(device = %id, error = %e, "kubernetes: free reservation not released")
                }
            }
        }
        for (class, n) in &plan.create {
            let Some(spec) = mix.get(class) else { continue };
            let mut made = 0;
            for _ in 0..*n {
                match self.reserve(class, spec).await {
                    Ok(d) => {
                        made += 1;
                        devices.push(d);
                    }
                    Err(e) => {
                        let msg = e.to_string();
                        let mut s = lock(&self.shortfall);
                        if s.get(class) != Some(&msg) {
                            warn!(class = %class, wanted = n, made, error = %msg, "kubernetes: cannot reserve the whole mix; advertising fewer devices");
                            s.insert(class.clone(), msg);
                        }
                        break;
                    }
                }
            }
            if made == *n {
                lock(&self.shortfall).remove(class);
            }
        }
        self.publish_locked(&devices);
    }

    async fn drop_device(&self, devices: &mut Vec<K8sDevice>, id: &str) {
        let Some(i) = devices.iter().position(|d| d.device_id == id) else {
            return;
        };
        match self.forget(&devices[i]).await {
            Ok(()) => {
                devices.remove(i);
            }
            Err(e) => warn!(device = %id, error = %e, "kubernetes: device not forgotten"),
        }
    }

    /// One reservation: a lease of the default tenant, its CDI spec, its record.
    async fn reserve(&self, class: &str, spec: &ClassSpec) -> Result<K8sDevice, K8sError> {
        let d = self.make_lease(class, &spec.shape, None).await?;
        info!(device = %d.device_id, class, "kubernetes: device reserved");
        Ok(d)
    }

    /// A new lease of `shape` for the default tenant, its CDI spec and its record:
    /// a new device, or `device` (same id) given a fresh lease for a new pod.
    async fn make_lease(
        &self,
        class: &str,
        shape: &crate::partition::Shape,
        device: Option<&K8sDevice>,
    ) -> Result<K8sDevice, K8sError> {
        let req = CreateRequest {
            tenant: self.cfg.default_tenant.clone(),
            shape: Some(shape.clone()),
            ttl: Some(self.cfg.lease_ttl),
            labels: BTreeMap::from([(LABEL_CLASS.to_string(), class.to_string())]),
            ..Default::default()
        };
        let created = self.create_off_dra_gpus(req).await?;
        let lease_id = created.lease.id.clone();
        let Some(token) = created.token else {
            return Err(K8sError::DeviceEnded {
                device: lease_id,
                resource: resource_name(class),
                reason: "the new lease ended at once".into(),
            });
        };
        let d = K8sDevice {
            device_id: device.map_or_else(|| lease_id.clone(), |d| d.device_id.clone()),
            class: class.to_string(),
            lease_id: lease_id.clone(),
            token,
            allocated: device.is_some(),
            pod: None,
            unseen_since_ms: None,
            created_at_ms: device.map_or_else(now_ms, |d| d.created_at_ms),
        };
        let recorded = async {
            if self.cfg.cdi {
                // A view, not a hold: a reserved lease may still move (its spec is
                // rewritten on `moved`) until kubelet allocates it.
                let resolved = self.mgr.view_devices(&lease_id)?;
                cdi::write_spec(&self.cfg.cdi_dir, &resolved, self.nvidia.as_ref())?;
            }
            self.persist(&d).await?;
            Ok::<_, K8sError>(())
        }
        .await;
        if let Err(e) = recorded {
            // Not advertised: give the capacity back rather than leak it.
            if let Err(end) = self
                .mgr
                .end(
                    &lease_id,
                    LeaseState::Released,
                    "kubernetes: device not recorded",
                )
                .await
            {
                warn!(lease = %lease_id, error = %end, "kubernetes: unrecorded reservation not released");
            }
            if self.cfg.cdi {
                let _ = cdi::remove_spec(&self.cfg.cdi_dir, &lease_id);
            }
            return Err(e);
        }
        Ok(d)
    }

    /// Create `req` on a GPU the DRA driver does not serve (`[kubernetes] dra_gpus`):
    /// each other GPU in turn while DRA is on, any GPU otherwise.
    async fn create_off_dra_gpus(
        &self,
        req: CreateRequest,
    ) -> Result<crate::lease::Created, LeaseError> {
        if !self.cfg.dra {
            return self.mgr.create(req).await;
        }
        let mut last = LeaseError::ResourceExhausted(
            "every GPU of this node is served by the DRA driver (kubernetes.dra_gpus)".into(),
        );
        for g in self.mgr.node().iter().map(|r| r.info.index) {
            if self.cfg.dra_serves(g) {
                continue;
            }
            match self
                .mgr
                .create(CreateRequest {
                    gpu_index: Some(g),
                    ..req.clone()
                })
                .await
            {
                Ok(c) => return Ok(c),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// kubelet gives a device whose pod is gone to a new pod (it frees a terminated
    /// pod's devices at once): the old lease (its token bound to the old pod) ends
    /// and the device gets a fresh one.
    async fn renew_for_new_pod(&self, d: &mut K8sDevice) -> Result<(), K8sError> {
        let old = self.lease(&d.lease_id);
        let pod = d
            .pod
            .as_ref()
            .map(|(ns, p)| format!("{ns}/{p}"))
            .unwrap_or_default();
        if old.as_ref().is_some_and(|l| l.state().is_live()) {
            let reason = format!(
                "kubernetes: kubelet gave {} to another pod; {pod} no longer holds it",
                d.device_id
            );
            self.mgr
                .end(&d.lease_id, LeaseState::Released, &reason)
                .await?;
        }
        if self.cfg.cdi
            && let Err(e) = cdi::remove_spec(&self.cfg.cdi_dir, &d.lease_id)
        {
            warn!(error = %e, "kubernetes: CDI spec not removed");
        }
        let shape = match (&old, lock(&self.mix).get(&d.class)) {
            (Some(l), _) => l.shape.clone(),
            (None, Some(spec)) => spec.shape.clone(),
            (None, None) => {
                return Err(K8sError::DeviceEnded {
                    device: d.device_id.clone(),
                    resource: resource_name(&d.class),
                    reason: "its lease is gone".into(),
                });
            }
        };
        let class = d.class.clone();
        *d = self.make_lease(&class, &shape, Some(d)).await?;
        info!(device = %d.device_id, lease = %d.lease_id, previous_pod = %pod, "kubernetes: device given to a new pod: a fresh lease");
        Ok(())
    }

    /// Holds `d`'s lease for a pod (ResolveToken: it never moves again) and writes
    /// its CDI spec from that answer.
    fn pin(&self, d: &K8sDevice) -> Result<(), K8sError> {
        let resolved = self.mgr.resolve_token(&d.token)?;
        if self.cfg.cdi {
            cdi::write_spec(&self.cfg.cdi_dir, &resolved, self.nvidia.as_ref())?;
        }
        Ok(())
    }

    /// A lease moved: if it is a device's (a reserved one), its CDI spec names the
    /// new instance's device nodes.
    async fn moved(&self, lease_id: &str) {
        if !self.cfg.cdi {
            return;
        }
        let devices = self.devices.lock().await;
        if !devices.iter().any(|d| d.lease_id == lease_id) {
            return;
        }
        let written = self
            .mgr
            .view_devices(lease_id)
            .map_err(K8sError::from)
            .and_then(|r| {
                cdi::write_spec(&self.cfg.cdi_dir, &r, self.nvidia.as_ref()).map_err(K8sError::from)
            });
        match written {
            Ok(_) => info!(lease = %lease_id, "kubernetes: CDI spec rewritten after a move"),
            Err(e) => {
                warn!(lease = %lease_id, error = %e, "kubernetes: CDI spec not rewritten after a move")
            }
        }
    }

    /// Advertise every class's devices (health from the lease).
    pub async fn publish(&self) {
        let devices = self.devices.lock().await;
        self.publish_locked(&devices);
    }

    fn publish_locked(&self, devices: &[K8sDevice]) {
        let mut per: BTreeMap<String, Vec<Advertised>> = lock(&self.mix)
            .keys()
            .map(|c| (c.clone(), Vec::new()))
            .collect();
        for d in devices {
            let healthy = self
                .lease(&d.lease_id)
                .is_some_and(|l| l.state() == LeaseState::Active && l.unhealthy.is_none());
            per.entry(d.class.clone()).or_default().push(Advertised {
                id: d.device_id.clone(),
                healthy,
            });
        }
        let mut lists = lock(&self.lists);
        for (class, mut list) in per {
            list.sort_by(|a, b| a.id.cmp(&b.id));
            let tx = lists
                .entry(class)
                .or_insert_with(|| watch::channel(Vec::new()).0);
            tx.send_if_modified(|cur| {
                if *cur == list {
                    false
                } else {
                    *cur = list;
                    true
                }
            });
        }
    }

    /// Allocate: for each container, for each of its devices (in the order asked)
    /// the lease's token, id and CDI name. The same devices get the same answer
    /// every time. Every request is checked before any device is marked allocated.
    pub async fn allocate(
        &self,
        class: &str,
        containers: &[Vec<String>],
    ) -> Result<Vec<Vec<Allocation>>, K8sError> {
        let resource = resource_name(class);
        check_requests(&resource, containers)?;
        let holders = self.holders_if_held(containers).await;
        let mut devices = self.devices.lock().await;
        let mut out = Vec::with_capacity(containers.len());
        for ids in containers {
            let mut granted = Vec::with_capacity(ids.len());
            for id in ids {
                let Some(d) = devices
                    .iter_mut()
                    .find(|d| &d.device_id == id && d.class == class)
                else {
                    return Err(K8sError::UnknownDevice {
                        device: id.clone(),
                        resource,
                    });
                };
                granted.push(self.grant(d, &resource, holders.as_ref()).await?);
            }
            out.push(granted);
        }
        drop(devices);
        // The pod shows in PodResources in a moment: follow it soon.
        self.wake.notify_one();
        Ok(out)
    }

    /// A device a pod was seen holding may come back for another pod: when one of
    /// `containers` asks for such a device, who holds what now, from kubelet (the
    /// last poll may be a moment old); None when none does or kubelet does not
    /// answer.
    async fn holders_if_held(
        &self,
        containers: &[Vec<String>],
    ) -> Option<BTreeMap<String, Holder>> {
        let asked_held = {
            let devices = self.devices.lock().await;
            containers.iter().flatten().any(|id| {
                devices
                    .iter()
                    .any(|d| &d.device_id == id && d.allocated && d.pod.is_some())
            })
        };
        if !asked_held {
            return None;
        }
        kubelet::pod_holders(&self.cfg.pod_resources_socket)
            .await
            .ok()
    }

    /// One device for a container: its lease handed on when another pod asks for
    /// it, refused when its lease no longer serves, marked allocated.
    async fn grant(
        &self,
        d: &mut K8sDevice,
        resource: &str,
        holders: Option<&BTreeMap<String, Holder>>,
    ) -> Result<Allocation, K8sError> {
        if let Some((ns, pod)) = d.pod.clone().filter(|_| d.allocated) {
            let still_held = match holders {
                Some(h) => h
                    .get(&d.device_id)
                    .is_some_and(|x| x.namespace == ns && x.pod == pod && x.resource == resource),
                // kubelet did not answer: the last poll decides.
                None => d.unseen_since_ms.is_none(),
            };
            if !still_held {
                self.renew_for_new_pod(d).await?;
            }
        }
        if let Some(reason) = unusable(self.lease(&d.lease_id).as_ref()) {
            return Err(K8sError::DeviceEnded {
                device: d.device_id.clone(),
                resource: resource.to_string(),
                reason,
            });
        }
        // A pod gets it: the lease never moves again, and its CDI spec names the
        // instance it is pinned on (a move may have come since the spec was written;
        // a lease moving right now refuses, and kubelet asks again).
        self.pin(d)?;
        if !d.allocated {
            d.allocated = true;
            d.unseen_since_ms = None;
            let rec = d.clone();
            self.persist(&rec).await?;
            info!(device = %d.device_id, resource = %resource, "kubernetes: device allocated");
        }
        Ok(Allocation {
            lease_id: d.lease_id.clone(),
            token: d.token.clone(),
            cdi_device: self.cfg.cdi.then(|| format!("{CDI_KIND}={}", d.lease_id)),
        })
    }

    /// GetPreferredAllocation: the devices kubelet must include, then those on the
    /// GPUs already most used by pods, so that whole GPUs stay free longest for a
    /// changed mix (large partitions).
    pub async fn preferred(
        &self,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Vec<String> {
        let devices = self.devices.lock().await;
        let gpu_of = |id: &str| -> Option<u32> {
            devices
                .iter()
                .find(|d| d.device_id == id)
                .and_then(|d| self.lease(&d.lease_id))
                .map(|l| l.gpu)
        };
        let mut busy: BTreeMap<u32, usize> = BTreeMap::new();
        for d in devices.iter().filter(|d| d.allocated) {
            if let Some(g) = self.lease(&d.lease_id).map(|l| l.gpu) {
                *busy.entry(g).or_default() += 1;
            }
        }
        let mut out: Vec<String> = must_include.iter().take(size).cloned().collect();
        let mut rest: Vec<(usize, Option<u32>, &String)> = available
            .iter()
            .filter(|id| !out.contains(id))
            .map(|id| {
                let g = gpu_of(id);
                (g.and_then(|g| busy.get(&g).copied()).unwrap_or(0), g, id)
            })
            .collect();
        rest.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(b.2)));
        for (_, _, id) in rest {
            if out.len() >= size {
                break;
            }
            out.push(id.clone());
        }
        out
    }

    /// Follow pods: `holders` (device id -> holder) is PodResources' answer now.
    pub async fn follow(&self, holders: &BTreeMap<String, Holder>) {
        let mut devices = self.devices.lock().await;
        let now = now_ms();
        let grace = self.cfg.release_grace.as_millis() as i64;
        let mut gone = Vec::new();
        for d in devices.iter_mut() {
            let before = d.clone();
            match holders
                .get(&d.device_id)
                .filter(|h| h.resource == resource_name(&d.class))
            {
                Some(h) => {
                    d.allocated = true;
                    d.unseen_since_ms = None;
                    d.pod = Some((h.namespace.clone(), h.pod.clone()));
                    self.hand_to_pod(d, h).await;
                }
                None if d.allocated => match d.unseen_since_ms {
                    None => d.unseen_since_ms = Some(now),
                    Some(since) if now - since >= grace => gone.push(d.device_id.clone()),
                    Some(_) => {}
                },
                None => {}
            }
            if *d != before
                && let Err(e) = self.persist(d).await
            {
                warn!(device = %d.device_id, error = %e, "kubernetes: device state not recorded");
            }
        }
        for id in gone {
            let Some(d) = devices.iter().find(|d| d.device_id == id).cloned() else {
                continue;
            };
            let pod = d
                .pod
                .as_ref()
                .map(|(ns, p)| format!("{ns}/{p}"))
                .unwrap_or_else(|| "a pod that never started".into());
            let live = self.lease(&d.lease_id).is_some_and(|l| l.state().is_live());
            if live {
                let reason = format!(
                    "kubernetes: {pod} no longer holds {} (gone for {}s)",
                    resource_name(&d.class),
                    self.cfg.release_grace.as_secs()
                );
                if let Err(e) = self
                    .mgr
                    .end(&d.lease_id, LeaseState::Released, &reason)
                    .await
                {
                    warn!(device = %id, error = %e, "kubernetes: lease of a device no pod holds not released");
                    continue;
                }
            }
            info!(device = %id, pod = %pod, "kubernetes: lease released: no pod holds its device");
            self.drop_device(&mut devices, &id).await;
        }
        self.publish_locked(&devices);
    }

    /// The lease of a device a pod holds goes to the tenant of the pod's namespace,
    /// labelled with both. Over that tenant's quota, it is revoked (fail closed).
    async fn hand_to_pod(&self, d: &K8sDevice, h: &Holder) {
        let Some(lease) = self.lease(&d.lease_id) else {
            return;
        };
        if lease.state() != LeaseState::Active {
            return;
        }
        let tenant = self.cfg.tenant_of(&h.namespace);
        let labels = BTreeMap::from([
            (LABEL_NAMESPACE.to_string(), h.namespace.clone()),
            (LABEL_POD.to_string(), h.pod.clone()),
        ]);
        if lease.tenant == tenant && labels.iter().all(|(k, v)| lease.labels.get(k) == Some(v)) {
            return;
        }
        match self.mgr.reassign(&lease.id, tenant, labels).await {
            Ok(_) => {
                info!(lease = %lease.id, tenant, namespace = %h.namespace, pod = %h.pod, "kubernetes: lease follows its pod")
            }
            Err(LeaseError::QuotaExceeded(m)) => {
                let reason = format!(
                    "kubernetes: pod {}/{} of tenant {tenant:?} is over quota: {m}",
                    h.namespace, h.pod
                );
                error!(lease = %lease.id, "{reason}");
                if let Err(e) = self.mgr.end(&lease.id, LeaseState::Revoked, &reason).await {
                    warn!(lease = %lease.id, error = %e, "kubernetes: over-quota lease not revoked");
                }
            }
            Err(e) => {
                warn!(lease = %lease.id, error = %e, "kubernetes: lease not handed to its pod's tenant")
            }
        }
    }

    /// Serve kubelet until `stop`: the plugin sockets and their registration, the
    /// PodResources poll, renewals, the mix, and health changes.
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let endpoints = tokio::spawn(kubelet::serve_and_register(self.clone(), stop.clone()));
        let mut events = self.mgr.subscribe();
        let mut fast_until = 0i64;
        let mut pod_resources_failing = false;
        // A deadline, not a sleep per turn: a stream of lease events must not starve
        // the poll.
        let mut next_poll = tokio::time::Instant::now() + self.cfg.poll_interval;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next_poll) => {}
                _ = self.wake.notified() => { fast_until = now_ms() + 5_000; }
                ev = events.recv() => {
                    if matches!(ev, Err(tokio::sync::broadcast::error::RecvError::Closed)) {
                        // The lease core is gone: nothing left to serve.
                        break;
                    }
                    if let Ok(e) = &ev
                        && e.kind == crate::lease::EventKind::Moved
                    {
                        self.moved(&e.lease.id).await;
                    }
                    // Health and state changes show at once.
                    self.publish().await;
                    continue;
                }
                _ = stop.changed() => break,
            }
            match kubelet::pod_holders(&self.cfg.pod_resources_socket).await {
                Ok(h) => {
                    if pod_resources_failing {
                        info!("kubernetes: PodResources answers again");
                    }
                    pod_resources_failing = false;
                    self.follow(&h).await;
                }
                Err(e) => {
                    // Without an answer nothing is released: a kubelet restart must
                    // not end running pods' leases.
                    if !pod_resources_failing {
                        warn!(error = %e, "kubernetes: PodResources unavailable; leases are kept until it answers");
                    }
                    pod_resources_failing = true;
                }
            }
            self.reconcile().await;
            let interval = if now_ms() < fast_until {
                Duration::from_millis(200).min(self.cfg.poll_interval)
            } else {
                self.cfg.poll_interval
            };
            next_poll = tokio::time::Instant::now() + interval;
        }
        let _ = endpoints.await;
    }
}

#[cfg(test)]
mod tests;
