//! The API server side of the DRA driver: a Kubernetes client (kube-rs, in-cluster
//! configuration or a kubeconfig), the publisher of this node's ResourceSlices and
//! the claim reader.
//!
//! * [`connect`]: the client, from `[kubernetes] kubeconfig` or the pod's service
//!   account.
//! * [`Publisher`]: makes the API server hold exactly the slices [`slices::build`]
//!   makes of the node now. It lists this node's slices of this driver (field
//!   selectors `spec.nodeName` and `spec.driver`), and when they differ from what
//!   the node has now, writes every slice at the next pool generation (replace with
//!   the `resourceVersion` it read; a 409 conflict re-reads and retries), then
//!   deletes the slices of the pool that are no longer wanted. It never writes a
//!   slice whose driver or node is not its own.
//! * [`start_publisher`]: the task that republishes on every lease event (debounced)
//!   and every `resync` (health and mode changes that move no lease, and repairs
//!   of slices someone else changed or deleted).
//! * [`KubeClaimSource`]: the allocation of a ResourceClaim, checked against the
//!   UID kubelet named.

mod claims;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use tokio::sync::{broadcast, watch};
use tracing::{debug, info, warn};

use crate::dra::DRIVER_NAME;
use crate::dra::slices::{self, NodeState, SliceConfig, SliceError};
use crate::lease::LeaseManager;

pub use claims::{KubeClaimSource, allocation_of};

/// How often a conflicting write is retried before the publish is given up (and
/// tried again at the next change or resync).
pub const CONFLICT_RETRIES: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("in-cluster configuration: {0}")]
    InCluster(#[from] kube::config::InClusterError),
    #[error("Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error("API server: {what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}")]
    Slices(#[from] SliceError),
    #[error("ResourceSlice {name}: still conflicting after {CONFLICT_RETRIES} tries")]
    Conflict { name: String },
}

/// A client of the API server: from the kubeconfig at `kubeconfig` (its current
/// context), or in-cluster (the pod's service account) when None.
pub async fn connect(kubeconfig: Option<&Path>) -> Result<kube::Client, KubeError> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|source| {
                KubeError::Kubeconfig {
                    path: path.to_path_buf(),
                    source,
                }
            })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|source| KubeError::Kubeconfig {
                    path: path.to_path_buf(),
                    source,
                })?
        }
        None => kube::Config::incluster()?,
    };
    kube::Client::try_from(config).map_err(KubeError::Client)
}

/// What a publish did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Published {
    /// The pool generation the API server holds now.
    pub generation: i64,
    /// Slices created, replaced and deleted (all 0 when it already matched).
    pub created: usize,
    pub replaced: usize,
    pub deleted: usize,
    /// Writes that met a conflict and were retried.
    pub conflicts: usize,
}

/// Keeps this node's pool on the API server equal to the node.
#[derive(Clone)]
pub struct Publisher {
    api: Api<ResourceSlice>,
    cfg: SliceConfig,
    /// The generation last written (the next write is above it and above any the
    /// API server holds).
    generation: i64,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("node", &self.cfg.node_name)
            .field("generation", &self.generation)
            .finish()
    }
}

fn is_code(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// A slice's spec with what the publisher does not decide cleared: the pool
/// generation (bumped at each write) and the taints' `timeAdded` (the API server
/// sets it).
fn comparable(
    s: &ResourceSlice,
) -> (
    Option<String>,
    k8s_openapi::api::resource::v1::ResourceSliceSpec,
) {
    let mut spec = s.spec.clone();
    spec.pool.generation = 0;
    for d in spec.devices.iter_mut().flatten() {
        for t in d.taints.iter_mut().flatten() {
            t.time_added = None;
        }
    }
    (s.metadata.name.clone(), spec)
}

impl Publisher {
    pub fn new(client: kube::Client, cfg: SliceConfig) -> Publisher {
        Publisher {
            api: Api::all(client),
            cfg,
            generation: 0,
        }
    }

    pub fn node_name(&self) -> &str {
        &self.cfg.node_name
    }

    /// This node's slices of this driver on the API server.
    pub async fn list_own(&self) -> Result<Vec<ResourceSlice>, KubeError> {
        let lp = ListParams::default().fields(&format!(
            "spec.nodeName={},spec.driver={DRIVER_NAME}",
            self.cfg.node_name
        ));
        let list = self.api.list(&lp).await.map_err(|source| KubeError::Api {
            what: format!("list the ResourceSlices of node {}", self.cfg.node_name),
            source,
        })?;
        // The selector is the API server's; the check is ours too.
        Ok(list.items.into_iter().filter(|s| self.owns(s)).collect())
    }

    fn owns(&self, s: &ResourceSlice) -> bool {
        s.spec.driver == DRIVER_NAME
            && s.spec.node_name.as_deref() == Some(self.cfg.node_name.as_str())
    }

    /// Makes the API server hold the slices of `node`.
    pub async fn publish(&mut self, node: &NodeState) -> Result<Published, KubeError> {
        let existing = self.list_own().await?;
        let held = existing.iter().map(|s| s.spec.pool.generation).max();
        let mut want = slices::build(&self.cfg, node, held.unwrap_or(0))?;
        let mut have: Vec<_> = existing.iter().map(comparable).collect();
        let mut wanted: Vec<_> = want.iter().map(comparable).collect();
        have.sort_by(|a, b| a.0.cmp(&b.0));
        wanted.sort_by(|a, b| a.0.cmp(&b.0));
        let one_generation = existing
            .iter()
            .all(|s| Some(s.spec.pool.generation) == held);
        if let Some(g) = held
            && have == wanted
            && one_generation
        {
            self.generation = self.generation.max(g);
            return Ok(Published {
                generation: g,
                ..Published::default()
            });
        }
        let generation = self.generation.max(held.unwrap_or(0)) + 1;
        for s in &mut want {
            s.spec.pool.generation = generation;
        }
        let mut out = Published {
            generation,
            ..Published::default()
        };
        let by_name: BTreeMap<&str, &ResourceSlice> = existing
            .iter()
            .filter_map(|s| Some((s.metadata.name.as_deref()?, s)))
            .collect();
        for s in &want {
            let name = s.metadata.name.clone().unwrap_or_default();
            let current = by_name
                .get(name.as_str())
                .and_then(|c| c.metadata.resource_version.clone());
            self.write(s, &name, current, &mut out).await?;
        }
        let wanted_names: BTreeSet<&str> = want
            .iter()
            .filter_map(|s| s.metadata.name.as_deref())
            .collect();
        for s in &existing {
            let Some(name) = s.metadata.name.as_deref() else {
                continue;
            };
            if wanted_names.contains(name) || !self.owns(s) {
                continue;
            }
            match self.api.delete(name, &DeleteParams::default()).await {
                Ok(_) => out.deleted += 1,
                Err(e) if is_code(&e, 404) => {}
                Err(source) => {
                    return Err(KubeError::Api {
                        what: format!("delete ResourceSlice {name}"),
                        source,
                    });
                }
            }
        }
        self.generation = generation;
        info!(
            node = %self.cfg.node_name,
            generation,
            slices = want.len(),
            created = out.created,
            replaced = out.replaced,
            deleted = out.deleted,
            "DRA: ResourceSlices published"
        );
        Ok(out)
    }

    /// Creates or replaces one slice; a conflict re-reads it and tries again.
    async fn write(
        &self,
        s: &ResourceSlice,
        name: &str,
        mut version: Option<String>,
        out: &mut Published,
    ) -> Result<(), KubeError> {
        let pp = PostParams::default();
        for _ in 0..CONFLICT_RETRIES {
            let result = match &version {
                Some(v) => {
                    let mut s = s.clone();
                    s.metadata.resource_version = Some(v.clone());
                    self.api
                        .replace(name, &pp, &s)
                        .await
                        .map(|_| &mut out.replaced)
                }
                None => self.api.create(&pp, s).await.map(|_| &mut out.created),
            };
            match result {
                Ok(n) => {
                    *n += 1;
                    return Ok(());
                }
                // Changed (or created) since it was read: read it again.
                Err(e) if is_code(&e, 409) => {
                    out.conflicts += 1;
                    debug!(
                        slice = name,
                        "DRA: ResourceSlice changed meanwhile; re-reading"
                    );
                    let fresh = self
                        .api
                        .get_opt(name)
                        .await
                        .map_err(|source| KubeError::Api {
                            what: format!("get ResourceSlice {name}"),
                            source,
                        })?;
                    if let Some(f) = &fresh
                        && !self.owns(f)
                    {
                        // A slice of that name that is not ours: never overwritten.
                        return Err(KubeError::Api {
                            what: format!("ResourceSlice {name} exists for another driver or node"),
                            source: e,
                        });
                    }
                    version = fresh.and_then(|f| f.metadata.resource_version);
                }
                // Deleted since it was read: create it.
                Err(e) if is_code(&e, 404) && version.is_some() => version = None,
                Err(source) => {
                    return Err(KubeError::Api {
                        what: format!("write ResourceSlice {name}"),
                        source,
                    });
                }
            }
        }
        Err(KubeError::Conflict {
            name: name.to_string(),
        })
    }
}

/// The publisher task's settings.
#[derive(Debug, Clone)]
pub struct PublisherOptions {
    pub slices: SliceConfig,
    /// The GPUs given to DRA (None: all).
    pub gpus: Option<BTreeSet<u32>>,
    /// How long after a lease event the slices are built (events that come
    /// meanwhile are taken in the same publish).
    pub debounce: Duration,
    /// How often the slices are compared with the node even without lease events
    /// (health and mode changes; slices changed by someone else).
    pub resync: Duration,
}

impl PublisherOptions {
    pub fn new(slices: SliceConfig) -> PublisherOptions {
        PublisherOptions {
            slices,
            gpus: None,
            debounce: Duration::from_millis(200),
            resync: Duration::from_secs(10),
        }
    }
}

/// Starts the publisher: publishes now, then on every lease event (after
/// `debounce`) and every `resync`, until `stop` turns true. A failed publish is
/// logged and tried again at the next event or resync.
pub fn start_publisher(
    mgr: Arc<LeaseManager>,
    client: kube::Client,
    opts: PublisherOptions,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let mut events = mgr.subscribe();
    let mut publisher = Publisher::new(client, opts.slices.clone());
    tokio::spawn(async move {
        let mut failing = false;
        loop {
            let node = slices::state::node_state(&mgr, opts.gpus.as_ref());
            match publisher.publish(&node).await {
                Ok(_) => {
                    if failing {
                        info!("DRA: ResourceSlices published again");
                    }
                    failing = false;
                }
                Err(e) => {
                    // Logged once per failing stretch, then at debug.
                    if failing {
                        debug!(error = %e, "DRA: ResourceSlices not published");
                    } else {
                        warn!(error = %e, "DRA: ResourceSlices not published; retrying");
                    }
                    failing = true;
                }
            }
            tokio::select! {
                _ = stop.changed() => {}
                r = events.recv() => {
                    if matches!(r, Err(broadcast::error::RecvError::Closed)) {
                        return;
                    }
                    tokio::time::sleep(opts.debounce).await;
                    // The events meanwhile are in this publish.
                    while events.try_recv().is_ok() {}
                }
                () = tokio::time::sleep(opts.resync) => {}
            }
            if *stop.borrow() {
                return;
            }
        }
    })
}

/// The claim reader on `client`.
pub fn claim_source(client: kube::Client) -> Arc<dyn crate::dra::claims::ClaimSource> {
    Arc::new(KubeClaimSource::new(client))
}
