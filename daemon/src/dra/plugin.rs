//! The node side of the DRA driver: a claim's devices become leases at exactly the
//! placement the scheduler chose, recorded in the store by claim UID.

use std::collections::BTreeMap;
use std::sync::Arc;

use tessera_common::clock::now_ms;
use tokio::sync::{Mutex, watch};
use tracing::{info, warn};

use crate::cdi::{self, CDI_KIND, NvidiaCdi};
use crate::config::KubernetesConfig;
use crate::gpu::MpsMode;
use crate::lease::{CreateRequest, ExactPlacement, LeaseManager};
use crate::model::{Lease, LeaseState};
use crate::names::new_id;
use crate::partition::Shape;
use crate::store::{DraClaim, DraDevice, Store};

use super::claims::{ClaimRef, ClaimSource, ClaimSourceError};
use super::device::DeviceName;
use super::{DRIVER_NAME, DraError, LABEL_CLAIM, LABEL_CLAIM_UID, LABEL_NAMESPACE};

/// One device of a prepared claim as NodePrepareResources answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    /// `tessera.io/lease=<lease id>`.
    pub cdi_device_ids: Vec<String>,
    pub lease_id: String,
}

/// The health of one prepared device (NodeWatchResources).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    pub pool: String,
    pub device: String,
    pub healthy: bool,
    /// Why not, or empty.
    pub message: String,
}

/// The DRA kubelet plugin's state: the lease core, the store, the claim source.
pub struct DraPlugin {
    mgr: Arc<LeaseManager>,
    pub(super) store: Arc<Store>,
    cfg: KubernetesConfig,
    claims: Arc<dyn ClaimSource>,
    /// This node's pool name.
    pool: String,
    /// One prepare or unprepare at a time (kubelet calls are rare and short).
    busy: Mutex<()>,
    nvidia: Option<NvidiaCdi>,
    health: watch::Sender<Vec<DeviceHealth>>,
    /// The prepared claims' devices, (pool, device, lease id): the store's, kept in
    /// memory for renewals and health (read on every lease event).
    prepared: std::sync::Mutex<Vec<(String, String, String)>>,
    /// Prepared claims the API server answered as gone: UID -> when first seen so
    /// ([`DraPlugin::sweep_orphans`]).
    orphans: std::sync::Mutex<BTreeMap<String, i64>>,
}

impl std::fmt::Debug for DraPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraPlugin")
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

/// A result of ours, resolved: the device, what the lease is, where.
struct Wanted {
    requests: Vec<String>,
    device: String,
    shape: Shape,
    exact: ExactPlacement,
}

impl DraPlugin {
    /// The plugin over `mgr` and `store`, for the pool `pool` (this node's name).
    pub fn new(
        mgr: Arc<LeaseManager>,
        store: Arc<Store>,
        cfg: KubernetesConfig,
        claims: Arc<dyn ClaimSource>,
        pool: String,
    ) -> Result<Arc<DraPlugin>, DraError> {
        let nvidia = if cfg.cdi {
            NvidiaCdi::find(&cdi::nvidia_spec_paths())?
        } else {
            None
        };
        let plugin = Arc::new(DraPlugin {
            mgr,
            store,
            cfg,
            claims,
            pool,
            busy: Mutex::new(()),
            nvidia,
            health: watch::channel(Vec::new()).0,
            prepared: std::sync::Mutex::new(Vec::new()),
            orphans: std::sync::Mutex::new(BTreeMap::new()),
        });
        plugin.reload_prepared()?;
        Ok(plugin)
    }

    pub fn config(&self) -> &KubernetesConfig {
        &self.cfg
    }

    pub fn pool(&self) -> &str {
        &self.pool
    }

    /// NodePrepareResources for one claim: its devices' leases (made now, or those
    /// made before for the same claim UID).
    pub async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, DraError> {
        check_uid(claim)?;
        // The allocation is read before taking the lock: a slow or hung API server
        // answer holds up this claim only, never every other prepare and unprepare.
        let early = match self.store.dra_claim(&claim.uid)? {
            Some(rec) if rec.prepared => None,
            _ => Some(self.claims.allocation(claim).await?),
        };
        let _one = self.busy.lock().await;
        let out = self.prepare_locked(claim, early).await;
        if let Err(e) = self.reload_prepared() {
            warn!(error = %e, "dra: prepared devices not read again from the store; renewals and health may lag");
        }
        out
    }

    async fn prepare_locked(
        &self,
        claim: &ClaimRef,
        early: Option<super::claims::ClaimAllocation>,
    ) -> Result<Vec<PreparedDevice>, DraError> {
        let recorded = self.store.dra_claim(&claim.uid)?;
        if let Some(rec) = &recorded
            && rec.prepared
        {
            return self.answer(rec);
        }
        // Read before the lock, unless the claim was prepared then (and unprepared
        // since, by a call that held the lock meanwhile).
        let alloc = match early {
            Some(a) => a,
            None => self.claims.allocation(claim).await?,
        };
        if alloc.uid != claim.uid {
            return Err(DraError::Claim(format!(
                "the API server's claim {}/{} has UID {}, kubelet asked for {}",
                claim.namespace, claim.name, alloc.uid, claim.uid
            )));
        }
        let wanted = self.ours(&alloc.devices)?;
        self.refuse_held(&wanted)?;
        let tenant = self.cfg.tenant_of(&claim.namespace).to_string();
        // Recorded before any lease is made: a crash part way leaves a record whose
        // request ids find the leases made (a retry replays them, an unprepare
        // releases them).
        let mut rec = match recorded {
            Some(r) if r.tenant == tenant => r,
            Some(old) => {
                // Cut off under another tenant (the namespace map changed across a
                // restart): what it made goes first.
                self.release(&old, "dra: claim prepared again for another tenant")
                    .await?;
                fresh_record(claim, &tenant)
            }
            None => fresh_record(claim, &tenant),
        };
        rec.devices = wanted
            .iter()
            .map(|w| DraDevice {
                requests: w.requests.clone(),
                pool: self.pool.clone(),
                device: w.device.clone(),
                lease_id: String::new(),
                token: String::new(),
            })
            .collect();
        self.persist(&rec).await?;
        match self.make_leases(claim, &mut rec, &wanted).await {
            Ok(()) => {
                rec.prepared = true;
                if let Err(e) = self.persist(&rec).await {
                    self.undo(&rec, "dra: claim not recorded").await;
                    return Err(e);
                }
                info!(claim = %claim, tenant = %rec.tenant, devices = rec.devices.len(), "dra: claim prepared");
                self.answer(&rec)
            }
            Err(e) => {
                self.undo(&rec, "dra: the claim's other devices could not be prepared")
                    .await;
                Err(e)
            }
        }
    }

    /// A device is one claim's at a time (the scheduler allocates it so): an MPS slot
    /// would otherwise become a second share.
    fn refuse_held(&self, wanted: &[Wanted]) -> Result<(), DraError> {
        let held = self.prepared();
        match wanted.iter().find(|w| {
            held.iter()
                .any(|(p, d, _)| *p == self.pool && *d == w.device)
        }) {
            Some(w) => Err(DraError::Claim(format!(
                "device {} is prepared for another claim; unprepare it first",
                w.device
            ))),
            None => Ok(()),
        }
    }

    /// Every result of ours (this driver, this pool), its name read and its lease's
    /// shape and placement, grouped by device; refused whole if any is not valid.
    fn ours(&self, results: &[super::claims::AllocatedDevice]) -> Result<Vec<Wanted>, DraError> {
        let mut by_device: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut order: Vec<String> = Vec::new();
        for r in results
            .iter()
            .filter(|r| r.driver == DRIVER_NAME && r.pool == self.pool)
        {
            if !by_device.contains_key(&r.device) {
                order.push(r.device.clone());
            }
            by_device
                .entry(r.device.clone())
                .or_default()
                .push(r.request.clone());
        }
        let mut out = Vec::with_capacity(order.len());
        for device in order {
            let name = DeviceName::parse(&device)?;
            let gpu = name.gpu();
            if !self.cfg.dra_serves(gpu) {
                return Err(DraError::Claim(format!(
                    "device {device}: gpu{gpu} is not served by the DRA driver on this node (kubernetes.dra_gpus)"
                )));
            }
            let (shape, mig_start) = match &name {
                DeviceName::WholeGpu { .. } => (Shape::WholeGpu, None),
                DeviceName::Mig { profile, start, .. } => (
                    Shape::Mig {
                        profile: profile.clone(),
                        compute_profile: None,
                    },
                    Some(*start),
                ),
                DeviceName::Mps { class, .. } => {
                    let shape = self.cfg.mps_shapes.get(class).cloned().ok_or_else(|| {
                        DraError::Claim(format!(
                            "device {device}: no [[kubernetes.mps_classes]] entry is named {class:?}"
                        ))
                    })?;
                    // Pods of any namespace may share a GPU: each share its own
                    // control daemon, whatever the class says.
                    let shape = match shape {
                        Shape::Mps {
                            sm_percent,
                            memory_bytes,
                            ..
                        } => Shape::Mps {
                            sm_percent,
                            memory_bytes,
                            mode: MpsMode::Isolated,
                        },
                        other => other,
                    };
                    (shape, None)
                }
            };
            out.push(Wanted {
                requests: by_device.remove(&device).unwrap_or_default(),
                device,
                shape,
                exact: ExactPlacement { gpu, mig_start },
            });
        }
        Ok(out)
    }

    /// The leases of `wanted`, into `rec.devices` (same order), with their CDI specs.
    async fn make_leases(
        &self,
        claim: &ClaimRef,
        rec: &mut DraClaim,
        wanted: &[Wanted],
    ) -> Result<(), DraError> {
        for (i, w) in wanted.iter().enumerate() {
            let created = self
                .mgr
                .create(CreateRequest {
                    tenant: rec.tenant.clone(),
                    shape: Some(w.shape.clone()),
                    ttl: Some(self.cfg.lease_ttl),
                    request_id: Some(request_id(&rec.nonce, i)),
                    labels: BTreeMap::from([
                        (LABEL_NAMESPACE.to_string(), claim.namespace.clone()),
                        (LABEL_CLAIM.to_string(), claim.name.clone()),
                        (LABEL_CLAIM_UID.to_string(), claim.uid.clone()),
                    ]),
                    exact: Some(w.exact),
                    ..Default::default()
                })
                .await
                .map_err(|e| DraError::Device {
                    device: w.device.clone(),
                    source: e,
                })?;
            let lease_id = created.lease.id.clone();
            rec.devices[i].lease_id = lease_id.clone();
            let Some(token) = created.token else {
                return Err(DraError::Claim(format!(
                    "device {}: its lease {lease_id} has ended",
                    w.device
                )));
            };
            rec.devices[i].token = token;
            if self.cfg.cdi {
                let resolved = self.mgr.view_devices(&lease_id)?;
                cdi::write_spec(&self.cfg.cdi_dir, &resolved, self.nvidia.as_ref())?;
            }
            info!(claim = %claim, device = %w.device, lease = %lease_id, "dra: device prepared");
        }
        Ok(())
    }

    /// The answer for a prepared claim; refused when a lease no longer serves. The
    /// CDI specs it names are written (again: `cdi_dir` may be a tmpfs).
    fn answer(&self, rec: &DraClaim) -> Result<Vec<PreparedDevice>, DraError> {
        if self.cfg.cdi {
            let tokens: Vec<&str> = rec.devices.iter().map(|d| d.token.as_str()).collect();
            write_token_spec(&self.cfg.cdi_dir, &rec.uid, &tokens)?;
        }
        rec.devices
            .iter()
            .map(|d| {
                let lease = self.mgr.get(&d.lease_id).ok().map(|(l, _)| l);
                if let Some(why) = ended(lease.as_ref()) {
                    return Err(DraError::Claim(format!(
                        "device {}: lease {} {why}",
                        d.device, d.lease_id
                    )));
                }
                if self.cfg.cdi {
                    // Written again: `cdi_dir` may be a tmpfs emptied by a reboot.
                    let resolved = self.mgr.view_devices(&d.lease_id)?;
                    cdi::write_spec(&self.cfg.cdi_dir, &resolved, self.nvidia.as_ref())?;
                }
                Ok(PreparedDevice {
                    requests: d.requests.clone(),
                    pool: d.pool.clone(),
                    device: d.device.clone(),
                    cdi_device_ids: if self.cfg.cdi {
                        vec![
                            format!("{CDI_KIND}={}", d.lease_id),
                            format!("{CLAIM_CDI_KIND}={}", rec.uid),
                        ]
                    } else {
                        Vec::new()
                    },
                    lease_id: d.lease_id.clone(),
                })
            })
            .collect()
    }

    /// NodeUnprepareResources for one claim: its leases released, its record gone.
    /// A claim never prepared here is already unprepared.
    pub async fn unprepare(&self, claim: &ClaimRef) -> Result<(), DraError> {
        let _one = self.busy.lock().await;
        let Some(rec) = self.store.dra_claim(&claim.uid)? else {
            return Ok(());
        };
        let reason = format!("dra: claim {}/{} unprepared", claim.namespace, claim.name);
        self.release(&rec, &reason).await?;
        if self.cfg.cdi {
            remove_token_spec(&self.cfg.cdi_dir, &rec.uid)?;
        }
        self.store
            .write(move |w| w.delete_dra_claim(&rec.uid))
            .await?;
        info!(claim = %claim, "dra: claim unprepared");
        if let Err(e) = self.reload_prepared() {
            warn!(error = %e, "dra: prepared devices not read again from the store; renewals and health may lag");
        }
        Ok(())
    }

    /// Release every lease of `rec` (those a cut-off prepare made are found by their
    /// request ids) and remove their CDI specs. The first failure is returned after
    /// the others were tried.
    async fn release(&self, rec: &DraClaim, reason: &str) -> Result<(), DraError> {
        let mut first = None;
        for (i, d) in rec.devices.iter().enumerate() {
            let lease_id = if d.lease_id.is_empty() {
                match self
                    .store
                    .find_by_request(&rec.tenant, &request_id(&rec.nonce, i))
                {
                    Ok(Some(l)) => l.id,
                    Ok(None) => continue,
                    Err(e) => {
                        first.get_or_insert(DraError::Store(e));
                        continue;
                    }
                }
            } else {
                d.lease_id.clone()
            };
            let live = self
                .mgr
                .get(&lease_id)
                .is_ok_and(|(l, _)| l.state().is_live());
            if live && let Err(e) = self.mgr.end(&lease_id, LeaseState::Released, reason).await {
                // Ended meanwhile (expired, revoked) is released enough.
                let still = self
                    .mgr
                    .get(&lease_id)
                    .is_ok_and(|(l, _)| l.state().is_live());
                if still {
                    first.get_or_insert(DraError::Device {
                        device: d.device.clone(),
                        source: e,
                    });
                    continue;
                }
            }
            if self.cfg.cdi
                && let Err(e) = cdi::remove_spec(&self.cfg.cdi_dir, &lease_id)
            {
                warn!(lease = %lease_id, error = %e, "dra: CDI spec not removed");
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// A failed prepare: what it made is released and its record forgotten.
    async fn undo(&self, rec: &DraClaim, reason: &str) {
        if let Err(e) = self.release(rec, reason).await {
            warn!(claim = %rec.uid, error = %e, "dra: a failed prepare's leases not all released; an unprepare retries");
            return;
        }
        let uid = rec.uid.clone();
        if let Err(e) = self.store.write(move |w| w.delete_dra_claim(&uid)).await {
            warn!(claim = %rec.uid, error = %e, "dra: a failed prepare's record not removed");
        }
    }

    async fn persist(&self, rec: &DraClaim) -> Result<(), DraError> {
        let rec = rec.clone();
        Ok(self.store.write(move |w| w.put_dra_claim(&rec)).await?)
    }

    /// The prepared devices from the store again (after a prepare or an
    /// unprepare), and their health.
    fn reload_prepared(&self) -> Result<(), DraError> {
        let list: Vec<(String, String, String)> = self
            .store
            .dra_claims()?
            .into_iter()
            .filter(|c| c.prepared)
            .flat_map(|c| c.devices)
            .map(|d| (d.pool, d.device, d.lease_id))
            .collect();
        *self.prepared.lock().unwrap_or_else(|p| p.into_inner()) = list;
        self.refresh_health();
        Ok(())
    }

    fn prepared(&self) -> Vec<(String, String, String)> {
        self.prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Release what kubelet never unprepared. kubelet unprepares a claim before its
    /// pod's sandbox goes; a claim it never unprepared (its pod force-deleted while
    /// the node was away, kubelet's state wiped) would keep its leases, renewed, for
    /// good. A prepared claim the API server answers as gone (deleted, recreated
    /// under another UID, or no longer allocated) is unprepared here once it has
    /// been gone for `grace` on every sweep since it was first seen so. An API server
    /// that does not answer proves nothing: it neither starts nor ends the wait.
    pub async fn sweep_orphans(&self, grace: std::time::Duration) {
        let claims = match self.store.dra_claims() {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "dra: prepared claims not read for the orphan sweep");
                return;
            }
        };
        let now = now_ms();
        let grace = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let mut due = Vec::new();
        for c in claims.into_iter().filter(|c| c.prepared) {
            let r = ClaimRef {
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                uid: c.uid.clone(),
            };
            let gone = match self.claims.allocation(&r).await {
                Ok(a) => a.uid != c.uid,
                Err(ClaimSourceError::NotFound(_) | ClaimSourceError::NotAllocated(_)) => true,
                Err(ClaimSourceError::Api { .. }) => continue,
            };
            let mut orphans = self.orphans.lock().unwrap_or_else(|p| p.into_inner());
            if !gone {
                orphans.remove(&c.uid);
                continue;
            }
            let since = *orphans.entry(c.uid.clone()).or_insert(now);
            if now.saturating_sub(since) >= grace {
                due.push(r);
            }
        }
        for r in due {
            warn!(claim = %r, "dra: the API server no longer has this prepared claim and kubelet never unprepared it: releasing its leases");
            match self.unprepare(&r).await {
                Ok(()) => {
                    self.orphans
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&r.uid);
                }
                Err(e) => {
                    warn!(claim = %r, error = %e, "dra: orphaned claim not released; tried again at the next sweep")
                }
            }
        }
    }

    /// Renew the prepared claims' leases that are past half their TTL.
    pub async fn renew(&self) {
        let now = now_ms();
        let half = i64::try_from(self.cfg.lease_ttl.as_millis() / 2).unwrap_or(i64::MAX);
        for (_, _, lease_id) in self.prepared() {
            if let Ok((l, _)) = self.mgr.get(&lease_id)
                && l.state() == LeaseState::Active
                && l.expires_at_ms - now < half
                && let Err(e) = self.mgr.renew(&l.id, Some(self.cfg.lease_ttl)).await
            {
                warn!(lease = %l.id, error = %e, "dra: lease not renewed");
            }
        }
    }

    /// The prepared devices' health, now and on every change.
    pub fn watch_health(&self) -> watch::Receiver<Vec<DeviceHealth>> {
        self.health.subscribe()
    }

    /// Recompute the prepared devices' health from their leases (the lease core's
    /// health marks: `Lease::unhealthy`).
    pub fn refresh_health(&self) {
        let mut list = Vec::new();
        for (pool, device, lease_id) in self.prepared() {
            let lease = self.mgr.get(&lease_id).ok().map(|(l, _)| l);
            let why = ended(lease.as_ref())
                .map(|w| format!("lease {lease_id} {w}"))
                .or_else(|| lease.as_ref().and_then(|l| l.unhealthy.clone()));
            list.push(DeviceHealth {
                pool,
                device,
                healthy: why.is_none(),
                message: why.unwrap_or_default(),
            });
        }
        list.sort_by(|a, b| (&a.pool, &a.device).cmp(&(&b.pool, &b.device)));
        list.dedup_by(|a, b| a.pool == b.pool && a.device == b.device);
        self.health.send_if_modified(|cur| {
            if *cur == list {
                false
            } else {
                *cur = list;
                true
            }
        });
    }
}

/// The CDI kind of a claim's token spec: `tessera.io/claim=<claim uid>` sets
/// `TESSERA_LEASE_TOKEN` to the tokens of the claim's leases (joined by `,`), which
/// tessera-runtime binds the container with (as the device plugin's annotation
/// does). Root-only (0600): containerd reads it as root.
pub const CLAIM_CDI_KIND: &str = "tessera.io/claim";

fn token_spec_path(dir: &std::path::Path, uid: &str) -> std::path::PathBuf {
    dir.join(format!("tessera.io-claim-{uid}.json"))
}

/// Write claim `uid`'s token spec atomically (mode 0600).
fn write_token_spec(dir: &std::path::Path, uid: &str, tokens: &[&str]) -> Result<(), DraError> {
    use std::os::unix::fs::PermissionsExt;
    let spec = cdi::Spec {
        cdi_version: cdi::CDI_VERSION.into(),
        kind: CLAIM_CDI_KIND.into(),
        devices: vec![cdi::Device {
            name: uid.to_string(),
            container_edits: cdi::ContainerEdits {
                env: vec![format!(
                    "{}={}",
                    tessera_common::contract::LEASE_TOKEN_ENV,
                    tokens.join(",")
                )],
                ..Default::default()
            },
        }],
        container_edits: cdi::ContainerEdits::default(),
    };
    cdi::validate(&spec)?;
    let io = |path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| DraError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let body = serde_json::to_vec_pretty(&spec)
        .map_err(|e| DraError::Cdi(cdi::CdiError::Invalid(e.to_string())))?;
    // tempfile creates the file 0600, and it stays so.
    let mut tmp = tempfile::Builder::new()
        .prefix(".tessera-claim-")
        .permissions(std::fs::Permissions::from_mode(0o600))
        .tempfile_in(dir)
        .map_err(io(dir))?;
    std::io::Write::write_all(&mut tmp, &body).map_err(io(tmp.path()))?;
    tmp.as_file().sync_all().map_err(io(tmp.path()))?;
    let path = token_spec_path(dir, uid);
    tmp.persist(&path).map_err(|e| DraError::Io {
        path: path.clone(),
        source: e.error,
    })?;
    Ok(())
}

/// Remove claim `uid`'s token spec (absent is fine).
fn remove_token_spec(dir: &std::path::Path, uid: &str) -> Result<(), DraError> {
    let path = token_spec_path(dir, uid);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DraError::Io { path, source }),
    }
}

/// A UID names files and records: an API server UID's characters only.
fn check_uid(claim: &ClaimRef) -> Result<(), DraError> {
    if claim.uid.is_empty()
        || claim.uid.len() > 128
        || !claim
            .uid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        return Err(DraError::Claim(format!(
            "claim {}/{}: {:?} is not a UID",
            claim.namespace, claim.name, claim.uid
        )));
    }
    Ok(())
}

/// The request id of a claim's `i`th device's lease.
fn request_id(nonce: &str, i: usize) -> String {
    format!("dra-{nonce}-{i}")
}

/// Why a lease no longer serves (gone or ended), or None.
fn ended(lease: Option<&Lease>) -> Option<String> {
    match lease {
        None => Some("is gone".into()),
        Some(l) if !l.state().is_live() => Some(format!(
            "is {}: {}",
            l.state().as_str(),
            l.end_reason().unwrap_or("")
        )),
        Some(_) => None,
    }
}

impl DraPlugin {
    /// The lease core's events (health and state changes).
    pub(super) fn mgr_subscribe(
        &self,
    ) -> tokio::sync::broadcast::Receiver<Arc<crate::lease::LeaseEvent>> {
        self.mgr.subscribe()
    }
}

/// A claim's record before any of its leases is made: a new nonce names their
/// request ids.
fn fresh_record(claim: &ClaimRef, tenant: &str) -> DraClaim {
    DraClaim {
        uid: claim.uid.clone(),
        namespace: claim.namespace.clone(),
        name: claim.name.clone(),
        tenant: tenant.to_string(),
        nonce: new_id(""),
        prepared: false,
        devices: Vec::new(),
        created_at_ms: now_ms(),
    }
}
