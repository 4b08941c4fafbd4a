//! The Prometheus endpoint: `GET /metrics` on `[metrics] listen` (off by default).
//!
//! * Gauges (leases, partitions, free capacity, NVML utilisation) are computed at
//!   scrape time from the lease manager and the backend (a collector), so they can
//!   never drift from the daemon's state.
//! * Counters (API calls, runtime admissions, lease lifecycle) are incremented by
//!   [`Metrics::record_call`], [`Metrics::record_admission`] and a task subscribed to
//!   the lease events ([`Metrics::run_event_counter`]).
//!
//! Labels are bounded: RPC names are static, result codes are the gRPC code names,
//! shapes are MIG profile names (a hardware list) or "mps"/"whole_gpu". Tenant names
//! and admission reasons are caller-chosen, so each keeps its first
//! [`MAX_TENANT_LABELS`] / [`MAX_REASON_LABELS`] distinct values and reports the rest
//! as "other". Tokens never appear.
//!
//! Owns: the metrics endpoint and its label bounds. May use: lease, model, partition.
//! May not touch: tonic or proto (the API layer names each status code).

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tracing::{info, warn};

use crate::lease::{EventKind, LeaseManager};
use crate::model::{Lease, PartKind, Partition};
use crate::partition::Shape;

/// Distinct tenant label values before the rest become "other".
pub const MAX_TENANT_LABELS: usize = 1000;
/// Distinct admission-refusal reasons before the rest become "other".
pub const MAX_REASON_LABELS: usize = 64;
/// Longest label value kept from a caller-chosen string.
const MAX_LABEL_LEN: usize = 64;

type Labels = Vec<(&'static str, String)>;

/// API call latency buckets: 0.25 ms to about 8 s, doubling.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("metrics listener {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics server: {0}")]
    Serve(#[source] std::io::Error),
}

/// Keeps a label bounded: the first `max` distinct values pass, later ones are "other".
#[derive(Debug)]
pub struct LabelCap {
    max: usize,
    seen: Mutex<HashSet<String>>,
}

impl LabelCap {
    pub fn new(max: usize) -> LabelCap {
        LabelCap {
            max,
            seen: Mutex::new(HashSet::new()),
        }
    }

    pub fn label(&self, value: &str) -> String {
        let value: String = value.chars().take(MAX_LABEL_LEN).collect();
        let Ok(mut seen) = self.seen.lock() else {
            return "other".into();
        };
        if seen.contains(&value) {
            return value;
        }
        if seen.len() < self.max {
            seen.insert(value.clone());
            return value;
        }
        "other".into()
    }
}

/// "1g.10gb", "mps" or "whole_gpu".
pub fn shape_label(shape: &Shape) -> String {
    match shape {
        Shape::Mig { profile, .. } => profile.chars().take(MAX_LABEL_LEN).collect(),
        Shape::Mps { .. } => "mps".into(),
        Shape::WholeGpu => "whole_gpu".into(),
        Shape::MigMps { profile, .. } => format!("mps@{profile}")
            .chars()
            .take(MAX_LABEL_LEN)
            .collect(),
    }
}

fn partition_label(p: &Partition) -> String {
    match &p.kind {
        PartKind::Mig(m) => m.profile.clone(),
        PartKind::Mps(_) => "mps".into(),
        PartKind::WholeGpu => "whole_gpu".into(),
    }
}

/// The daemon's metrics: counters it increments and the registry it serves.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    api_calls: Family<Labels, Counter>,
    admissions: Family<Labels, Counter>,
    lease_events: Family<Labels, Counter>,
    api_latency: Family<Labels, Histogram, fn() -> Histogram>,
    audit_failures: Counter,
    tenants: Arc<LabelCap>,
    reasons: LabelCap,
}

impl Metrics {
    /// Counters only; with `mgr`, also the scrape-time gauges of its node.
    pub fn new(mgr: Option<Arc<LeaseManager>>) -> Metrics {
        let mut registry = Registry::with_prefix("tessera");
        let api_calls = Family::<Labels, Counter>::default();
        registry.register(
            "api_calls",
            "gRPC calls by RPC and result code (refusals are every code but OK)",
            api_calls.clone(),
        );
        let admissions = Family::<Labels, Counter>::default();
        // Exported from the start at 0, so rate() and the dashboard see the series
        // before the first container is admitted.
        admissions
            .get_or_create(&vec![
                ("result", "admitted".into()),
                ("reason", String::new()),
            ])
            .inc_by(0);
        registry.register(
            "runtime_admissions",
            "Container admissions reported by tessera-runtime, by result and refusal reason",
            admissions.clone(),
        );
        let lease_events = Family::<Labels, Counter>::default();
        registry.register(
            "lease_events",
            "Lease lifecycle events (created, released, expired, revoked, revoking, preempting) by tenant and shape",
            lease_events.clone(),
        );
        let api_latency: Family<Labels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "api_call_duration_seconds",
            "Time from a gRPC request's arrival to its response headers, by RPC (a stream's first answer for WatchLeases)",
            api_latency.clone(),
        );
        let audit_failures = Counter::default();
        registry.register(
            "audit_failures",
            "Audit records that could not be written (see audit.on_failure)",
            audit_failures.clone(),
        );
        let tenants = Arc::new(LabelCap::new(MAX_TENANT_LABELS));
        if let Some(mgr) = mgr {
            registry.register_collector(Box::new(NodeCollector {
                mgr,
                tenants: tenants.clone(),
                since_ms: tessera_common::clock::now_ms(),
            }));
        }
        Metrics {
            registry,
            api_calls,
            admissions,
            lease_events,
            api_latency,
            audit_failures,
            tenants,
            reasons: LabelCap::new(MAX_REASON_LABELS),
        }
    }

    /// Observe how long one API call took (`rpc` is one of the API's method names,
    /// or "other").
    pub fn record_latency(&self, rpc: &'static str, seconds: f64) {
        self.api_latency
            .get_or_create(&vec![("rpc", rpc.to_string())])
            .observe(seconds);
    }

    /// Count one audit record that could not be written.
    pub fn audit_failed(&self) {
        self.audit_failures.inc();
    }

    /// Count one API call and its result, by the canonical gRPC name of its
    /// status code ("OK" for a success; the API layer names it).
    pub fn record_call(&self, rpc: &'static str, code: &'static str) {
        self.api_calls
            .get_or_create(&vec![("rpc", rpc.to_string()), ("code", code.into())])
            .inc();
    }

    /// Count one runtime admission decision; a refusal counts once per reason.
    pub fn record_admission(&self, admitted: bool, reasons: &[String]) {
        if admitted {
            self.admissions
                .get_or_create(&vec![
                    ("result", "admitted".into()),
                    ("reason", String::new()),
                ])
                .inc();
            return;
        }
        let mut labels: Vec<String> = reasons.iter().map(|r| self.reasons.label(r)).collect();
        if labels.is_empty() {
            labels.push("unspecified".into());
        }
        for reason in labels {
            self.admissions
                .get_or_create(&vec![("result", "refused".into()), ("reason", reason)])
                .inc();
        }
    }

    /// Count one lease event.
    pub fn record_event(&self, kind: EventKind, lease: &Lease) {
        let event = match kind {
            EventKind::Created => "created",
            EventKind::Released => lease.state().as_str(),
            EventKind::Revoked => lease.state().as_str(),
            EventKind::Revoking => "revoking",
            EventKind::Preempting => "preempting",
            EventKind::MpsRestarted => "mps_restarted",
            EventKind::Unhealthy => "unhealthy",
            EventKind::Healthy => "healthy",
            EventKind::Moved => "moved",
            EventKind::Renewed
            | EventKind::Expiring
            | EventKind::ContainerBound
            | EventKind::ContainerUnbound => return,
        };
        self.lease_events
            .get_or_create(&vec![
                ("event", event.to_string()),
                ("tenant", self.tenants.label(&lease.tenant)),
                ("shape", shape_label(&lease.shape)),
            ])
            .inc();
    }

    /// Count lease events until the manager's event channel closes.
    pub async fn run_event_counter(
        self: Arc<Self>,
        mgr: Arc<LeaseManager>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut rx = mgr.subscribe();
        loop {
            tokio::select! {
                ev = rx.recv() => match ev {
                    Ok(ev) => self.record_event(ev.kind, &ev.lease),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        warn!(missed = n, "metrics: lease events missed; counters undercount");
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                },
                r = stop.changed() => if r.is_err() || *stop.borrow() { return },
            }
        }
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// Serve `/metrics` on `listener` until `shutdown` resolves.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), MetricsError> {
        use axum::http::{StatusCode, header};
        let metrics = self;
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let m = metrics.clone();
                async move {
                    // The collector calls NVML and takes the state lock: off the
                    // async workers.
                    match tokio::task::spawn_blocking(move || m.render()).await {
                        Ok(Ok(text)) => (
                            StatusCode::OK,
                            [(
                                header::CONTENT_TYPE,
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            )],
                            text,
                        ),
                        _ => (
                            StatusCode::INTERNAL_SERVER_ERROR,
                            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                            "encoding the metrics failed\n".to_string(),
                        ),
                    }
                }
            }),
        );
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(MetricsError::Serve)
    }
}

/// Create the daemon's metrics, count lease events until `stop`, and serve
/// `/metrics` on `listen` when it is set. The returned handle is what the API
/// service records calls and admissions on (it counts even when nothing serves it).
pub async fn spawn(
    listen: Option<SocketAddr>,
    mgr: Arc<LeaseManager>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Arc<Metrics>, MetricsError> {
    let metrics = Arc::new(Metrics::new(Some(mgr.clone())));
    let Some(addr) = listen else {
        tokio::spawn(metrics.clone().run_event_counter(mgr, stop));
        return Ok(metrics);
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    tokio::spawn(metrics.clone().run_event_counter(mgr, stop.clone()));
    let mut stop_serve = stop;
    let shutdown = async move {
        while !*stop_serve.borrow() {
            if stop_serve.changed().await.is_err() {
                return;
            }
        }
    };
    let m = metrics.clone();
    tokio::spawn(async move {
        if let Err(e) = m.serve(listener, shutdown).await {
            warn!(error = %e, "metrics endpoint stopped");
        }
    });
    info!(addr = %bound, "serving Prometheus metrics on /metrics");
    Ok(metrics)
}

/// Scrape-time gauges from the lease manager and the backend.
#[derive(Debug)]
struct NodeCollector {
    mgr: Arc<LeaseManager>,
    tenants: Arc<LabelCap>,
    /// When the collector was made (the daemon's start): usage counters count from here.
    since_ms: i64,
}

/// A family of f64 counters computed at scrape time.
fn counter_family(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: BTreeMap<Labels, f64>,
) -> Result<(), std::fmt::Error> {
    let family = Family::<Labels, Counter<f64>>::default();
    for (labels, v) in values {
        family.get_or_create(&labels).inc_by(v);
    }
    let e = encoder.encode_descriptor(name, help, None, family.metric_type())?;
    family.encode(e)
}

/// One quota resource's amounts as label value and number.
fn quota_amounts(a: &crate::config::Amounts) -> [(&'static str, i64); 4] {
    [
        ("mig_slices", i64::from(a.mig_slices)),
        ("mps_sm_percent", i64::from(a.mps_sm_percent)),
        (
            "memory_bytes",
            i64::try_from(a.memory_bytes).unwrap_or(i64::MAX),
        ),
        ("whole_gpus", i64::from(a.whole_gpus)),
    ]
}

/// The state directory's file system: (bytes available to the daemon, size).
fn state_filesystem(dir: &std::path::Path) -> Option<(u64, u64)> {
    let st = nix::sys::statvfs::statvfs(dir).ok()?;
    let frsize = st.fragment_size() as u64;
    Some((
        (st.blocks_available() as u64).saturating_mul(frsize),
        (st.blocks() as u64).saturating_mul(frsize),
    ))
}

fn gauge_family(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: BTreeMap<Labels, i64>,
) -> Result<(), std::fmt::Error> {
    let family = Family::<Labels, Gauge>::default();
    for (labels, v) in values {
        family.get_or_create(&labels).set(v);
    }
    let e = encoder.encode_descriptor(name, help, None, family.metric_type())?;
    family.encode(e)
}

impl NodeCollector {
    /// Each configured tenant's quota: what its live leases use, and its guaranteed
    /// and burst amounts (burst includes active temporary grants). Tenants come from
    /// the config, so the label is bounded by it.
    fn encode_tenancy(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let tenancy = self.mgr.tenancy();
        let mut used = BTreeMap::new();
        let mut limit = BTreeMap::new();
        for (name, q) in &tenancy.tenants {
            let (_, in_use, extra, _) = self.mgr.quota_of(name);
            let tenant = crate::names::truncate(name, MAX_LABEL_LEN);
            for (resource, v) in quota_amounts(&in_use) {
                used.insert(
                    vec![("tenant", tenant.clone()), ("resource", resource.into())],
                    v,
                );
            }
            let burst = crate::lease::quota::add(q.burst, extra);
            for (kind, amounts) in [("guaranteed", &q.guaranteed), ("burst", &burst)] {
                for (resource, v) in quota_amounts(amounts) {
                    limit.insert(
                        vec![
                            ("tenant", tenant.clone()),
                            ("resource", resource.into()),
                            ("kind", kind.into()),
                        ],
                        v,
                    );
                }
            }
        }
        gauge_family(
            encoder,
            "tenant_quota_used",
            "What a configured tenant's live leases use, by resource (mig_slices, mps_sm_percent, memory_bytes, whole_gpus)",
            used,
        )?;
        gauge_family(
            encoder,
            "tenant_quota_limit",
            "A configured tenant's quota by resource and kind (guaranteed; burst, temporary grants included)",
            limit,
        )
    }

    /// Partition-seconds per tenant since the daemon started, as GetUsage counts them
    /// (counters: they restart from zero with the daemon).
    fn encode_usage(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(usage) = self.mgr.usage(None, self.since_ms, 0) else {
            return Ok(());
        };
        let mut per: [BTreeMap<Labels, f64>; 5] = Default::default();
        for u in usage {
            let labels = vec![("tenant", self.tenants.label(&u.tenant))];
            // One GPU's worth: a whole GPU, 7 MIG compute slices, 100 % of the SMs.
            let gpu_seconds =
                u.whole_gpu_seconds + u.mig_slice_seconds / 7.0 + u.mps_sm_percent_seconds / 100.0;
            for (i, v) in [
                gpu_seconds,
                u.whole_gpu_seconds,
                u.mig_slice_seconds,
                u.mps_sm_percent_seconds,
                u.memory_gib_seconds,
            ]
            .into_iter()
            .enumerate()
            {
                *per[i].entry(labels.clone()).or_default() += v;
            }
        }
        let [gpu, whole, mig, mps, mem] = per;
        counter_family(
            encoder,
            "usage_gpu_seconds",
            "GPU-seconds per tenant since the daemon started: whole GPUs, plus MIG compute slices / 7, plus MPS SM percent / 100",
            gpu,
        )?;
        counter_family(
            encoder,
            "usage_whole_gpu_seconds",
            "Whole-GPU lease seconds per tenant since the daemon started",
            whole,
        )?;
        counter_family(
            encoder,
            "usage_mig_slice_seconds",
            "MIG compute-slice seconds (of 7 per GPU) per tenant since the daemon started",
            mig,
        )?;
        counter_family(
            encoder,
            "usage_mps_sm_percent_seconds",
            "MPS SM-percent seconds (100 = one GPU's SMs) per tenant since the daemon started",
            mps,
        )?;
        counter_family(
            encoder,
            "usage_memory_gib_seconds",
            "Partition memory GiB-seconds per tenant since the daemon started",
            mem,
        )
    }
}

/// The per-GPU and per-MIG-instance gauge families, filled one GPU at a time.
#[derive(Default)]
struct GpuGauges {
    partitions: BTreeMap<Labels, i64>,
    healthy: BTreeMap<Labels, i64>,
    free_slices: BTreeMap<Labels, i64>,
    free_sm: BTreeMap<Labels, i64>,
    free_mem: BTreeMap<Labels, i64>,
    util: BTreeMap<Labels, i64>,
    mem_used: BTreeMap<Labels, i64>,
    mig_util: BTreeMap<Labels, i64>,
    mig_mem: BTreeMap<Labels, i64>,
}

impl GpuGauges {
    /// What the lease core knows of `g`: health, partitions, free capacity.
    fn add_gpu(&mut self, g: &crate::lease::GpuReport) {
        let gpu = g.info.index.to_string();
        self.healthy.insert(
            vec![
                ("gpu", gpu.clone()),
                ("uuid", g.info.uuid.clone()),
                (
                    "cause",
                    g.health
                        .as_ref()
                        .map(|m| m.cause.code())
                        .unwrap_or_default(),
                ),
            ],
            i64::from(g.health.is_none()),
        );
        for p in &g.partitions {
            let leased = if p.lease_id.is_some() {
                "true"
            } else {
                "false"
            };
            *self
                .partitions
                .entry(vec![
                    ("gpu", gpu.clone()),
                    ("profile", partition_label(p)),
                    ("leased", leased.to_string()),
                ])
                .or_insert(0) += 1;
        }
        let whole_mem = g.info.memory_bytes;
        let (slices, sm, mem) = if g.whole_leased {
            (0, 0, 0)
        } else if g.info.mig_current {
            // free_slices counts memory slices (8 per GPU).
            let mem = whole_mem / 8 * u64::from(g.free_slices);
            (g.free_slices, 0, mem)
        } else {
            (
                0,
                100u32.saturating_sub(g.mps_sm_percent_used),
                whole_mem.saturating_sub(g.mps_memory_used),
            )
        };
        self.free_slices
            .insert(vec![("gpu", gpu.clone())], i64::from(slices));
        if !g.info.mig_current {
            self.free_sm
                .insert(vec![("gpu", gpu.clone())], i64::from(sm));
        }
        self.free_mem.insert(vec![("gpu", gpu)], mem as i64);
    }

    /// What NVML reports of `g`: utilisation and memory, per GPU and per MIG instance.
    fn add_nvml(&mut self, g: &crate::lease::GpuReport, backend: &dyn crate::gpu::GpuBackend) {
        let gpu = g.info.index.to_string();
        if let Ok(u) = backend.utilization(g.info.index) {
            self.util
                .insert(vec![("gpu", gpu.clone())], i64::from(u.gpu_percent));
            self.mem_used
                .insert(vec![("gpu", gpu.clone())], u.memory_used_bytes as i64);
        }
        if !g.info.mig_current {
            return;
        }
        let (Ok(instances), Ok(procs)) = (
            backend.instances(g.info.index),
            backend.processes(g.info.index),
        ) else {
            return;
        };
        for i in instances {
            let in_gi: Vec<_> = procs.iter().filter(|p| p.gi_id == Some(i.gi_id)).collect();
            let labels = vec![
                ("gpu", gpu.clone()),
                ("gi", i.gi_id.to_string()),
                (
                    "profile",
                    g.profiles
                        .iter()
                        .find(|(p, _)| p.id == i.gi_profile_id)
                        .map(|(p, _)| p.name.clone())
                        .unwrap_or_else(|| format!("id{}", i.gi_profile_id)),
                ),
            ];
            // NVML reports no SM utilisation for MIG devices: an instance
            // with compute processes in it counts as busy (100).
            let busy = if in_gi.is_empty() { 0 } else { 100 };
            self.mig_util.insert(labels.clone(), busy);
            self.mig_mem.insert(
                labels,
                in_gi.iter().map(|p| p.used_memory_bytes).sum::<u64>() as i64,
            );
        }
    }

    fn encode(self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, values) in [
            (
                "partitions",
                "Partitions by GPU, profile (MIG profile, mps, whole_gpu) and whether leased",
                self.partitions,
            ),
            (
                "gpu_healthy",
                "1 while the GPU is in service, 0 while it is out of service (cause: xid-N, ecc-dbe, lost, pending-retirement, operator)",
                self.healthy,
            ),
            (
                "gpu_free_slices",
                "Free MIG memory slices per GPU (of 8; 0 when MIG is off or the GPU is leased whole)",
                self.free_slices,
            ),
            (
                "gpu_free_sm_percent",
                "SM percent not yet given to MPS shares (GPUs without MIG)",
                self.free_sm,
            ),
            (
                "gpu_free_memory_bytes",
                "Device memory not yet given to partitions",
                self.free_mem,
            ),
            (
                "gpu_utilization_percent",
                "GPU utilisation as NVML reports it",
                self.util,
            ),
            (
                "gpu_memory_used_bytes",
                "Device memory used by processes, from NVML",
                self.mem_used,
            ),
            (
                "mig_instance_utilization_percent",
                "Per MIG instance: 100 while compute processes run in it, else 0",
                self.mig_util,
            ),
            (
                "mig_instance_memory_used_bytes",
                "Per MIG instance: device memory used by its processes, from NVML",
                self.mig_mem,
            ),
        ] {
            gauge_family(encoder, name, help, values)?;
        }
        Ok(())
    }
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.encode_leases(&mut encoder)?;
        self.encode_gpus(&mut encoder)?;
        self.encode_tenancy(&mut encoder)?;
        self.encode_usage(&mut encoder)?;
        self.encode_state_filesystem(&mut encoder)?;
        self.encode_queue(&mut encoder)
    }
}

impl NodeCollector {
    /// Live leases by tenant, shape and state, and the device plugin's leases by pod.
    fn encode_leases(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut leases: BTreeMap<Labels, i64> = BTreeMap::new();
        let mut pods: BTreeMap<Labels, i64> = BTreeMap::new();
        if let Ok(list) = self.mgr.list(None, None, false) {
            for (l, _) in list {
                // A lease of the kubelet device plugin held by a pod: bounded by the
                // live leases, so the pod may be a label.
                if let (Some(ns), Some(pod)) = (
                    l.labels.get(crate::names::LABEL_K8S_NAMESPACE),
                    l.labels.get(crate::names::LABEL_K8S_POD),
                ) {
                    let cut = |s: &str| crate::names::truncate(s, MAX_LABEL_LEN);
                    pods.insert(
                        vec![
                            ("namespace", cut(ns)),
                            ("pod", cut(pod)),
                            ("tenant", self.tenants.label(&l.tenant)),
                            (
                                "resource",
                                l.labels
                                    .get(crate::names::LABEL_K8S_CLASS)
                                    .map(|c| format!("tessera.io/{}", cut(c)))
                                    .unwrap_or_default(),
                            ),
                            ("lease", l.id.clone()),
                        ],
                        1,
                    );
                }
                *leases
                    .entry(vec![
                        ("tenant", self.tenants.label(&l.tenant)),
                        ("shape", shape_label(&l.shape)),
                        ("state", l.state().as_str().to_string()),
                    ])
                    .or_default() += 1;
            }
        }
        gauge_family(
            encoder,
            "leases",
            "Live leases by tenant, shape and state",
            leases,
        )?;
        gauge_family(
            encoder,
            "kubernetes_pod_leases",
            "Live leases of the kubelet device plugin held by a pod, by namespace, pod, tenant, resource and lease (1 each)",
            pods,
        )
    }

    /// Partitions, health, free capacity and NVML's utilisation per GPU and per MIG
    /// instance.
    fn encode_gpus(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let backend = self.mgr.backend();
        let mut gauges = GpuGauges::default();
        for g in &self.mgr.node() {
            gauges.add_gpu(g);
            gauges.add_nvml(g, backend.as_ref());
        }
        gauges.encode(encoder)
    }

    fn encode_state_filesystem(
        &self,
        encoder: &mut DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        if let Some((avail, size)) = state_filesystem(&self.mgr.config().daemon.state_dir) {
            for (name, help, v) in [
                (
                    "state_filesystem_avail_bytes",
                    "Bytes available to the daemon on the file system of its state directory (the lease store, the audit log)",
                    avail,
                ),
                (
                    "state_filesystem_size_bytes",
                    "Size of the file system of the daemon's state directory",
                    size,
                ),
            ] {
                let g = Gauge::<i64>::default();
                g.set(i64::try_from(v).unwrap_or(i64::MAX));
                let e = encoder.encode_descriptor(name, help, None, g.metric_type())?;
                g.encode(e)?;
            }
        }
        Ok(())
    }

    fn encode_queue(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // One value, no labels: a plain gauge (a family would print `name{} 0`).
        let depth = Gauge::<i64>::default();
        depth.set(i64::try_from(self.mgr.queued_requests()).unwrap_or(i64::MAX));
        let e = encoder.encode_descriptor(
            "admission_queue_depth",
            "CreateLease calls waiting in the admission queue for room (queue_wait_ms)",
            None,
            depth.metric_type(),
        )?;
        depth.encode(e)?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn label_cap_keeps_first_values_then_other() {
        let cap = LabelCap::new(2);
        assert_eq!(cap.label("a"), "a");
        assert_eq!(cap.label("b"), "b");
        assert_eq!(cap.label("c"), "other");
        assert_eq!(cap.label("a"), "a");
        assert_eq!(cap.label(&"x".repeat(500)).len(), "other".len());
    }

    #[test]
    fn record_call_counts_by_rpc_and_code() {
        let m = Metrics::new(None);
        m.record_call("CreateLease", "OK");
        m.record_call("CreateLease", "OK");
        m.record_call("CreateLease", "PERMISSION_DENIED");
        let text = m.render().unwrap();
        assert!(
            text.contains("tessera_api_calls_total{rpc=\"CreateLease\",code=\"OK\"} 2"),
            "{text}"
        );
        assert!(
            text.contains(
                "tessera_api_calls_total{rpc=\"CreateLease\",code=\"PERMISSION_DENIED\"} 1"
            ),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn admission_reasons_are_bounded() {
        let m = Metrics::new(None);
        m.record_admission(true, &[]);
        for i in 0..(MAX_REASON_LABELS + 10) {
            m.record_admission(false, &[format!("reason {i}")]);
        }
        let text = m.render().unwrap();
        assert!(
            text.contains("tessera_runtime_admissions_total{result=\"admitted\",reason=\"\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "tessera_runtime_admissions_total{result=\"refused\",reason=\"other\"} 10"
            ),
            "{text}"
        );
        let refused = text
            .lines()
            .filter(|l| l.starts_with("tessera_runtime_admissions_total{result=\"refused\""))
            .count();
        assert_eq!(refused, MAX_REASON_LABELS + 1);
    }
}
