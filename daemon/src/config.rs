//! tesserad's configuration: TOML, parsed and validated before anything is bound.
//!
//! Unknown keys are errors (a typo must not silently weaken a setting). Every error
//! names the field, so `tesserad` can exit 64 with a message a person can act on.
//!
//! Owns: the file format and its validation. May use: names, gpu (the GPU layer's
//! own config types live there), partition (the strategy). May not touch: anything
//! with side effects: it binds, opens and creates nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use tessera_common::size::parse_size;

use crate::gpu::SimSection;
use crate::gpu::sim::{SimConfig, SimGpuConfig};
use crate::partition::Strategy;

mod kubernetes;
mod validator;
pub use kubernetes::{ClassSpec, KubernetesConfig, RESOURCE_DOMAIN, resource_name};
mod auth;
mod oidc;
mod role;
pub use auth::{AuthConfig, PrincipalRule, TlsConfig};
pub use oidc::{ClaimRule, JwksSource, MAX_LEEWAY, OidcAlgorithm, OidcConfig};
pub use role::Role;
pub use validator::ConfigError;
use validator::Validator;

/// Which GPU backend drives the hardware.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Simulated GPUs (the default on hosts without NVIDIA GPUs).
    Sim,
    /// The NVIDIA driver through NVML.
    Nvml,
}

/// What happens to a dynamically created MIG instance when its lease ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnRelease {
    /// Destroy it (frees the placement for any profile).
    #[default]
    Destroy,
    /// Keep it as a free pool partition of the same profile.
    Keep,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub path: PathBuf,
    pub daemon: DaemonConfig,
    pub gpu: GpuConfig,
    pub sim: SimSection,
    pub partition: PartitionConfig,
    pub lease: LeaseConfig,
    pub devices: DevicesConfig,
    pub metrics: MetricsConfig,
    pub api: ApiConfig,
    pub auth: AuthConfig,
    pub tenancy: TenancyConfig,
    pub audit: AuditConfig,
    pub health: HealthConfig,
    pub kubernetes: KubernetesConfig,
    pub cdi: CdiConfig,
}

/// `[cdi]`: a CDI spec for every active lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiConfig {
    /// Write them (default: when `dir` exists at start).
    pub enabled: bool,
    /// Where (default /var/run/cdi, where podman and containerd look).
    pub dir: PathBuf,
}

/// What happens to leases on a GPU (or MIG instance) that goes unhealthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnUnhealthy {
    /// Tell them (an event on the watch stream, a status on the lease) and leave
    /// their containers running: a job may still checkpoint.
    #[default]
    Keep,
    /// Revoke them: their containers are stopped and the partition torn down.
    Revoke,
}

/// GPU health (`[health]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthConfig {
    /// Watch NVML's health events (critical XIDs, double-bit ECC).
    pub watch_events: bool,
    /// How often to poll what events do not cover (a GPU fallen off the bus,
    /// pending retirements). Zero turns polling off.
    pub poll_interval: Duration,
    pub on_unhealthy: OnUnhealthy,
}

/// When an audit record cannot be written (`audit.on_failure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AuditOnFailure {
    /// Refuse the change: nothing happens that the audit log does not show
    /// (auditd's disk-full action). Reads are still served.
    #[default]
    Refuse,
    /// Go on, with an error log line and `tessera_audit_failures_total`.
    Log,
}

/// Amounts counted against quotas.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Amounts {
    pub mig_slices: u32,
    pub mps_sm_percent: u32,
    pub memory_bytes: u64,
    pub whole_gpus: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantQuota {
    pub guaranteed: Amounts,
    pub burst: Amounts,
    pub priority_class: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenancyConfig {
    /// name -> quota. Empty: quotas are off (every tenant unlimited).
    pub tenants: BTreeMap<String, TenantQuota>,
    /// class -> priority (higher wins).
    pub priority_classes: BTreeMap<String, i32>,
    pub default_priority_class: String,
    /// Preempt burst leases of other tenants for a request within its guarantee.
    pub preemption: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditConfig {
    pub path: PathBuf,
    pub max_bytes: u64,
    pub keep: u32,
    pub on_failure: AuditOnFailure,
}

/// Limits of the gRPC API the daemon states and keeps (`[api]`).
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// The largest message the daemon sends (GetNode lists every partition); a
    /// ListLeases page also stops short of 4 MiB.
    pub max_send_message: usize,
    /// Lease events queued for one watcher; a watcher whose queue is full is
    /// dropped (RESOURCE_EXHAUSTED).
    pub watch_queue: usize,
    /// Lease events kept for watchers that resume from a revision.
    pub watch_history: usize,
    /// How often a watcher that asked for bookmarks gets one.
    pub watch_bookmark_interval: Duration,
}

/// The smallest `api.max_send_message`: one lease with the most labels allowed and
/// every partition fits with room to spare.
pub const MIN_SEND_MESSAGE: usize = 1 << 20;

/// The Prometheus endpoint (`[metrics]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsConfig {
    /// Where `/metrics` is served; None = no endpoint (the default).
    pub listen: Option<std::net::SocketAddr>,
    /// A non-loopback `listen` address is refused unless this is true.
    pub allow_remote: bool,
}

#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub socket: PathBuf,
    pub socket_mode: u32,
    pub socket_group: Option<String>,
    pub state_dir: PathBuf,
    pub run_dir: PathBuf,
    pub shutdown_grace: Duration,
    pub log_format: LogFormat,
    /// Chaos testing: store commits fail while `<run_dir>/store-faults.json` says so
    /// (`tesserad inject store`). Never on a production host.
    pub fault_injection: bool,
}

#[derive(Debug, Clone)]
pub struct GpuConfig {
    pub backend: BackendKind,
    /// The NVML backend's settings (`[nvml]`).
    pub nvml: crate::gpu::NvmlConfig,
}

/// One GPU's static MIG layout (like mig-parted's `mig-devices`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticLayout {
    pub gpu: u32,
    /// profile name -> count
    pub devices: BTreeMap<String, u32>,
}

#[derive(Debug, Clone)]
pub struct PartitionConfig {
    pub strategy: Strategy,
    pub dynamic_mig: bool,
    pub on_release: OnRelease,
    pub mps_oversubscribe: bool,
    /// The MPS mode of a request that does not name one.
    pub mps_mode: crate::gpu::MpsMode,
    pub static_layouts: Vec<StaticLayout>,
    /// Move idle MIG leases to make room for a request that would be refused.
    pub move_idle: bool,
    /// Housekeeping: move idle MIG leases where they leave the most room for large
    /// profiles (a few per housekeeping pass).
    pub compact_idle: bool,
    /// Temporal packing: best fit's weight on how far a new lease's expiry extends a
    /// GPU's latest (0 = expiries ignored).
    pub expiry_weight: u32,
    /// Regions held for large MIG requests refused for lack of room (times in
    /// milliseconds; `partition::reservation`).
    pub reserve: crate::partition::ReserveOptions,
}

impl PartitionConfig {
    /// The planner's options these settings give, for a request that names
    /// `gpu_index` (or none); the lease core adds the expiries.
    pub fn plan_options(&self, gpu_index: Option<u32>) -> crate::partition::PlanOptions {
        crate::partition::PlanOptions {
            strategy: self.strategy,
            mps_oversubscribe: self.mps_oversubscribe,
            dynamic_mig: self.dynamic_mig,
            gpu_index,
            temporal: match self.expiry_weight {
                0 => crate::partition::Temporal::Off,
                w => crate::partition::Temporal::Weighted(w),
            },
            expiry: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub default_ttl: Duration,
    pub max_ttl: Duration,
    pub min_ttl: Duration,
    /// WatchLeases reports `expiring` this long before a lease's end.
    pub expiring_notice: Duration,
    /// Time between SIGTERM and SIGKILL when a lease's containers are stopped.
    pub revocation_grace: Duration,
    /// Keep ended leases in the database this long (ListLeases --all shows them).
    pub retain_ended: Duration,
    pub pids_limit: u64,
    /// The longest a CreateLease may wait in the admission queue (`queue_wait_ms`).
    pub max_queue_wait: Duration,
    /// The most CreateLease calls that may wait in the admission queue at once, of
    /// one tenant and of all.
    pub max_queued_per_tenant: usize,
    pub max_queued: usize,
}

#[derive(Debug, Clone)]
pub struct DevicesConfig {
    /// Where the host's device nodes live (tests point this at a temp dir).
    pub dev_root: PathBuf,
    /// Major of nvidia-uvm; None = read "nvidia-uvm" from /proc/devices.
    pub nvidia_uvm_major: Option<u32>,
    /// Major of nvidia-caps; None = read "nvidia-caps" from /proc/devices.
    pub nvidia_caps_major: Option<u32>,
}

// ---- the raw file format ----

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    daemon: RawDaemon,
    #[serde(default)]
    gpu: RawGpu,
    #[serde(default)]
    nvml: RawNvml,
    #[serde(default)]
    sim: RawSim,
    #[serde(default)]
    partition: RawPartition,
    #[serde(default)]
    lease: RawLease,
    #[serde(default)]
    devices: RawDevices,
    #[serde(default)]
    auth: auth::RawAuth,
    #[serde(default)]
    tenants: BTreeMap<String, RawTenant>,
    #[serde(default)]
    priority_classes: BTreeMap<String, i32>,
    #[serde(default)]
    quota: RawQuota,
    #[serde(default)]
    audit: RawAudit,
    #[serde(default)]
    metrics: RawMetrics,
    #[serde(default)]
    api: RawApi,
    #[serde(default)]
    health: RawHealth,
    #[serde(default)]
    kubernetes: kubernetes::RawKubernetes,
    #[serde(default)]
    cdi: RawCdi,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAmounts {
    #[serde(default)]
    mig_slices: u32,
    #[serde(default)]
    mps_sm_percent: u32,
    memory: Option<String>,
    #[serde(default)]
    whole_gpus: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    #[serde(default)]
    guaranteed: RawAmounts,
    burst: Option<RawAmounts>,
    priority_class: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQuota {
    default_priority_class: Option<String>,
    preemption: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAudit {
    path: Option<PathBuf>,
    max_size: Option<String>,
    keep: Option<u32>,
    on_failure: Option<AuditOnFailure>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHealth {
    watch_events: Option<bool>,
    poll_interval: Option<String>,
    on_unhealthy: Option<OnUnhealthy>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawApi {
    max_send_message: Option<String>,
    watch_queue: Option<usize>,
    watch_history: Option<usize>,
    watch_bookmark_interval: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    listen: Option<String>,
    allow_remote: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCdi {
    enabled: Option<bool>,
    dir: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDaemon {
    socket: Option<PathBuf>,
    socket_mode: Option<String>,
    socket_group: Option<String>,
    state_dir: Option<PathBuf>,
    run_dir: Option<PathBuf>,
    shutdown_grace: Option<String>,
    log_format: Option<LogFormat>,
    fault_injection: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    backend: Option<BackendKind>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNvml {
    library_path: Option<PathBuf>,
    mig_minors_path: Option<PathBuf>,
    mps_control: Option<PathBuf>,
    mps_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSim {
    state_file: Option<PathBuf>,
    #[serde(default)]
    gpus: Vec<SimGpuConfig>,
    seed: Option<String>,
    #[serde(default)]
    faults: Vec<crate::gpu::sim::CallFault>,
    #[serde(default)]
    topology: crate::gpu::SimTopology,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStatic {
    gpu: u32,
    devices: BTreeMap<String, u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPartition {
    strategy: Option<Strategy>,
    dynamic_mig: Option<bool>,
    on_release: Option<OnRelease>,
    mps_oversubscribe: Option<bool>,
    mps_mode: Option<crate::gpu::MpsMode>,
    move_idle: Option<bool>,
    compact_idle: Option<bool>,
    expiry_weight: Option<u32>,
    reserve_min_slices: Option<u32>,
    reserve_grace: Option<String>,
    reserve_max_hold: Option<String>,
    reserve_aging: Option<u32>,
    reserve_max_per_profile: Option<u32>,
    #[serde(default, rename = "static")]
    static_layouts: Vec<RawStatic>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLease {
    default_ttl: Option<String>,
    max_ttl: Option<String>,
    min_ttl: Option<String>,
    expiring_notice: Option<String>,
    revocation_grace: Option<String>,
    retain_ended: Option<String>,
    pids_limit: Option<u64>,
    max_queue_wait: Option<String>,
    max_queued_per_tenant: Option<usize>,
    max_queued: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevices {
    dev_root: Option<PathBuf>,
    nvidia_uvm_major: Option<u32>,
    nvidia_caps_major: Option<u32>,
}

impl Config {
    /// Read and validate a config file. Binds and creates nothing.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(path, &text)
    }

    /// Parse and validate config text; `path` is used in messages only.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim().replace('\n', " "),
        })?;
        let v = Validator { path };
        let daemon = daemon_section(&v, raw.daemon)?;
        let gpu = gpu_section(&v, raw.gpu, raw.nvml, &daemon)?;
        let sim = sim_section(&v, raw.sim, &daemon, &gpu)?;
        let partition = partition_section(&v, raw.partition, &gpu, &sim)?;
        let lease = lease_section(&v, raw.lease)?;
        let devices = DevicesConfig {
            dev_root: raw
                .devices
                .dev_root
                .unwrap_or_else(|| PathBuf::from("/dev")),
            nvidia_uvm_major: raw.devices.nvidia_uvm_major,
            nvidia_caps_major: raw.devices.nvidia_caps_major,
        };
        let auth = auth::validate_auth(&v, raw.auth)?;
        let tenancy = validate_tenancy(&v, raw.tenants, raw.priority_classes, raw.quota)?;
        principals_have_tenants(&v, &auth, &tenancy)?;
        let audit = audit_section(&v, raw.audit, &daemon)?;
        let health = HealthConfig {
            watch_events: raw.health.watch_events.unwrap_or(true),
            poll_interval: v.duration("health.poll_interval", raw.health.poll_interval, "10s")?,
            on_unhealthy: raw.health.on_unhealthy.unwrap_or_default(),
        };
        let metrics = metrics_section(&v, raw.metrics)?;
        let declared = |t: &str| tenancy.tenants.is_empty() || tenancy.tenants.contains_key(t);
        let kubernetes = kubernetes::validate_kubernetes(
            &v,
            raw.kubernetes,
            &declared,
            lease.min_ttl..=lease.max_ttl,
        )?;
        let cdi = cdi_section(&v, raw.cdi)?;
        let api = api_section(&v, raw.api)?;
        Ok(Config {
            path: path.to_path_buf(),
            daemon,
            gpu,
            sim,
            partition,
            lease,
            devices,
            auth,
            tenancy,
            audit,
            metrics,
            api,
            health,
            kubernetes,
            cdi,
        })
    }
}

fn daemon_section(v: &Validator<'_>, d: RawDaemon) -> Result<DaemonConfig, ConfigError> {
    let state_dir = d
        .state_dir
        .unwrap_or_else(|| PathBuf::from("/var/lib/tessera"));
    let run_dir = d.run_dir.unwrap_or_else(|| PathBuf::from("/run/tessera"));
    let socket = d.socket.unwrap_or_else(|| run_dir.join("tesserad.sock"));
    let socket_mode = match d.socket_mode {
        None => 0o660,
        Some(s) => u32::from_str_radix(s.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777 && m & 0o007 == 0)
            .ok_or_else(|| {
                v.err(
                    "daemon.socket_mode",
                    format!("{s:?} is not an octal mode without world bits, e.g. \"0660\""),
                )
            })?,
    };
    Ok(DaemonConfig {
        socket,
        socket_mode,
        socket_group: d.socket_group,
        state_dir,
        run_dir,
        shutdown_grace: v.duration("daemon.shutdown_grace", d.shutdown_grace, "10s")?,
        log_format: d.log_format.unwrap_or_default(),
        fault_injection: d.fault_injection.unwrap_or(false),
    })
}

fn gpu_section(
    v: &Validator<'_>,
    raw: RawGpu,
    raw_nvml: RawNvml,
    daemon: &DaemonConfig,
) -> Result<GpuConfig, ConfigError> {
    let mps_timeout = v.duration("nvml.mps_timeout", raw_nvml.mps_timeout, "10s")?;
    let mut nvml = crate::gpu::NvmlConfig {
        library_path: raw_nvml.library_path,
        ..Default::default()
    };
    if let Some(p) = raw_nvml.mig_minors_path {
        nvml.mig_minors_path = p;
    }
    nvml.mps.binary = raw_nvml.mps_control;
    nvml.mps.state_dir = daemon.run_dir.join("mps-daemons");
    nvml.mps.timeout_secs = mps_timeout.as_secs().max(1);
    Ok(GpuConfig {
        backend: raw.backend.unwrap_or(BackendKind::Sim),
        nvml,
    })
}

fn sim_section(
    v: &Validator<'_>,
    raw: RawSim,
    daemon: &DaemonConfig,
    gpu: &GpuConfig,
) -> Result<SimSection, ConfigError> {
    let sim = SimSection {
        // Under the run dir by default: /run is emptied at boot, and real MIG
        // instances do not survive a reboot either.
        state_file: raw
            .state_file
            .unwrap_or_else(|| daemon.run_dir.join("sim-gpus.json")),
        gpus: SimConfig {
            gpus: raw.gpus,
            seed: raw.seed,
            state_file: None,
            faults: raw.faults,
            topology: raw.topology,
        },
    };
    if gpu.backend == BackendKind::Sim {
        if sim.gpus.gpus.is_empty() {
            return Err(v.err(
                "sim.gpus",
                "backend = \"sim\" needs at least one [[sim.gpus]] entry".into(),
            ));
        }
        sim.gpus
            .validate()
            .map_err(|e| v.err("sim.gpus", e.to_string()))?;
    }
    Ok(sim)
}

fn partition_section(
    v: &Validator<'_>,
    p: RawPartition,
    gpu: &GpuConfig,
    sim: &SimSection,
) -> Result<PartitionConfig, ConfigError> {
    let reserve = reserve_options(v, &p)?;
    let mut static_layouts = Vec::new();
    for (i, s) in p.static_layouts.into_iter().enumerate() {
        if gpu.backend == BackendKind::Sim && s.gpu as usize >= sim.gpus.gpus.len() {
            return Err(v.err(
                &format!("partition.static[{i}].gpu"),
                format!("no simulated GPU with index {}", s.gpu),
            ));
        }
        if static_layouts.iter().any(|l: &StaticLayout| l.gpu == s.gpu) {
            return Err(v.err(
                &format!("partition.static[{i}].gpu"),
                format!("GPU {} has two static layouts", s.gpu),
            ));
        }
        for (name, n) in &s.devices {
            if *n == 0 || *n > 7 {
                return Err(v.err(
                    &format!("partition.static[{i}].devices.{name}"),
                    format!("count {n} is not in 1..=7"),
                ));
            }
        }
        static_layouts.push(StaticLayout {
            gpu: s.gpu,
            devices: s.devices,
        });
    }
    Ok(PartitionConfig {
        reserve,
        strategy: p.strategy.unwrap_or_default(),
        dynamic_mig: p.dynamic_mig.unwrap_or(true),
        on_release: p.on_release.unwrap_or_default(),
        mps_oversubscribe: p.mps_oversubscribe.unwrap_or(false),
        mps_mode: p.mps_mode.unwrap_or_default(),
        static_layouts,
        move_idle: p.move_idle.unwrap_or(true),
        compact_idle: p.compact_idle.unwrap_or(false),
        expiry_weight: p.expiry_weight.unwrap_or(crate::partition::EXPIRY_WEIGHT),
    })
}

/// `[partition] reserve_*`: see `partition::reservation` (defaults
/// `partition::RESERVE_DEFAULTS_MS`).
fn reserve_options(
    v: &Validator<'_>,
    p: &RawPartition,
) -> Result<crate::partition::ReserveOptions, ConfigError> {
    let d = crate::partition::RESERVE_DEFAULTS_MS;
    let ms = |field: &str, value: &Option<String>, default: u64| -> Result<u64, ConfigError> {
        let t = v.duration(field, value.clone(), &format!("{default}ms"))?;
        Ok(u64::try_from(t.as_millis()).unwrap_or(u64::MAX))
    };
    let aging = p.reserve_aging.unwrap_or(d.aging);
    if aging == 0 {
        return Err(v.err("partition.reserve_aging", "must be at least 1".into()));
    }
    Ok(crate::partition::ReserveOptions {
        min_slices: p.reserve_min_slices.unwrap_or(d.min_slices),
        grace: ms("partition.reserve_grace", &p.reserve_grace, d.grace)?,
        max_hold: ms(
            "partition.reserve_max_hold",
            &p.reserve_max_hold,
            d.max_hold,
        )?,
        aging,
        max_per_profile: p.reserve_max_per_profile.unwrap_or(d.max_per_profile),
    })
}

fn lease_section(v: &Validator<'_>, l: RawLease) -> Result<LeaseConfig, ConfigError> {
    let lease = LeaseConfig {
        default_ttl: v.duration("lease.default_ttl", l.default_ttl, "1h")?,
        max_ttl: v.duration("lease.max_ttl", l.max_ttl, "7d")?,
        min_ttl: v.duration("lease.min_ttl", l.min_ttl, "1s")?,
        expiring_notice: v.duration("lease.expiring_notice", l.expiring_notice, "5m")?,
        revocation_grace: v.duration("lease.revocation_grace", l.revocation_grace, "10s")?,
        retain_ended: v.duration("lease.retain_ended", l.retain_ended, "30d")?,
        pids_limit: l.pids_limit.unwrap_or(4096),
        max_queue_wait: v.duration("lease.max_queue_wait", l.max_queue_wait, "10m")?,
        max_queued_per_tenant: l.max_queued_per_tenant.unwrap_or(16),
        max_queued: l.max_queued.unwrap_or(256),
    };
    if lease.min_ttl > lease.max_ttl {
        return Err(v.err("lease.min_ttl", "is longer than lease.max_ttl".into()));
    }
    if lease.default_ttl < lease.min_ttl || lease.default_ttl > lease.max_ttl {
        return Err(v.err(
            "lease.default_ttl",
            "must lie between lease.min_ttl and lease.max_ttl".into(),
        ));
    }
    if lease.pids_limit == 0 {
        return Err(v.err("lease.pids_limit", "must be at least 1".into()));
    }
    Ok(lease)
}

/// A tenant principal names a tenant with its own section, when tenants are declared.
fn principals_have_tenants(
    v: &Validator<'_>,
    auth: &AuthConfig,
    tenancy: &TenancyConfig,
) -> Result<(), ConfigError> {
    for p in &auth.principals {
        if let Role::Tenant(t) = &p.role
            && !tenancy.tenants.is_empty()
            && !tenancy.tenants.contains_key(t)
        {
            return Err(v.err(
                &format!("auth.principals.{}.tenant", p.name),
                format!("tenant {t:?} has no [tenants.{t}] section"),
            ));
        }
    }
    Ok(())
}

fn audit_section(
    v: &Validator<'_>,
    raw: RawAudit,
    daemon: &DaemonConfig,
) -> Result<AuditConfig, ConfigError> {
    let audit = AuditConfig {
        path: raw
            .path
            .unwrap_or_else(|| daemon.state_dir.join("audit.jsonl")),
        max_bytes: match raw.max_size {
            None => 64 << 20,
            Some(s) => parse_size(&s).map_err(|e| v.err("audit.max_size", e.to_string()))?,
        },
        keep: raw.keep.unwrap_or(5),
        on_failure: raw.on_failure.unwrap_or_default(),
    };
    if audit.max_bytes < 4096 {
        return Err(v.err("audit.max_size", "must be at least 4KiB".into()));
    }
    Ok(audit)
}

fn metrics_section(v: &Validator<'_>, raw: RawMetrics) -> Result<MetricsConfig, ConfigError> {
    let allow_remote = raw.allow_remote.unwrap_or(false);
    let listen = match raw.listen.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(s) => {
            let addr: std::net::SocketAddr = s.parse().map_err(|_| {
                v.err(
                    "metrics.listen",
                    format!("{s:?} is not an address like \"127.0.0.1:9464\" or \"[::1]:9464\""),
                )
            })?;
            if !addr.ip().is_loopback() && !allow_remote {
                return Err(v.err(
                    "metrics.listen",
                    format!(
                        "{addr} is not a loopback address: metrics reveal tenants and usage; set metrics.allow_remote = true to serve them beyond this host"
                    ),
                ));
            }
            Some(addr)
        }
    };
    Ok(MetricsConfig {
        listen,
        allow_remote,
    })
}

fn cdi_section(v: &Validator<'_>, raw: RawCdi) -> Result<CdiConfig, ConfigError> {
    let dir = raw.dir.unwrap_or_else(|| PathBuf::from("/var/run/cdi"));
    if !dir.is_absolute() {
        return Err(v.err("cdi.dir", format!("{} is not absolute", dir.display())));
    }
    Ok(CdiConfig {
        enabled: raw.enabled.unwrap_or_else(|| dir.is_dir()),
        dir,
    })
}

fn api_section(v: &Validator<'_>, raw: RawApi) -> Result<ApiConfig, ConfigError> {
    let api = ApiConfig {
        max_send_message: match raw.max_send_message {
            None => 16 << 20,
            Some(s) => usize::try_from(
                parse_size(&s).map_err(|e| v.err("api.max_send_message", e.to_string()))?,
            )
            .unwrap_or(usize::MAX),
        },
        watch_queue: raw.watch_queue.unwrap_or(4096),
        watch_history: raw.watch_history.unwrap_or(1024),
        watch_bookmark_interval: v.duration(
            "api.watch_bookmark_interval",
            raw.watch_bookmark_interval,
            "30s",
        )?,
    };
    if api.max_send_message < MIN_SEND_MESSAGE {
        return Err(v.err(
            "api.max_send_message",
            "must be at least 1MiB (one lease with every label it may have)".into(),
        ));
    }
    if api.watch_queue == 0 || api.watch_queue > 1 << 20 {
        return Err(v.err("api.watch_queue", "must be 1 to 1048576 events".into()));
    }
    if api.watch_history > 1 << 20 {
        return Err(v.err("api.watch_history", "must be at most 1048576 events".into()));
    }
    if api.watch_bookmark_interval < Duration::from_millis(100) {
        return Err(v.err(
            "api.watch_bookmark_interval",
            "must be at least 100ms".into(),
        ));
    }
    Ok(api)
}

fn validate_tenancy(
    v: &Validator<'_>,
    tenants: BTreeMap<String, RawTenant>,
    mut classes: BTreeMap<String, i32>,
    quota: RawQuota,
) -> Result<TenancyConfig, ConfigError> {
    if classes.is_empty() {
        classes.insert("production".into(), 100);
        classes.insert("batch".into(), 10);
    }
    for name in classes.keys() {
        let ok = !name.is_empty()
            && name.len() <= 63
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
        if !ok {
            return Err(v.err(
                &format!("priority_classes.{name}"),
                "a class name is 1-63 characters of a-z, 0-9, '.', '_' or '-'".into(),
            ));
        }
    }
    let default_class = quota.default_priority_class.unwrap_or_else(|| {
        if classes.contains_key("batch") {
            "batch".into()
        } else {
            classes.keys().next().cloned().unwrap_or_default()
        }
    });
    if !classes.contains_key(&default_class) {
        return Err(v.err(
            "quota.default_priority_class",
            format!("{default_class:?} is not in [priority_classes]"),
        ));
    }
    let mut out = BTreeMap::new();
    for (name, t) in tenants {
        let quota = tenant_quota(v, &name, t, &classes, &default_class)?;
        out.insert(name, quota);
    }
    Ok(TenancyConfig {
        tenants: out,
        priority_classes: classes,
        default_priority_class: default_class,
        preemption: quota.preemption.unwrap_or(true),
    })
}

/// One `[tenants.NAME]` section: its amounts (burst at least guaranteed) and a
/// priority class of `classes`.
fn tenant_quota(
    v: &Validator<'_>,
    name: &str,
    t: RawTenant,
    classes: &BTreeMap<String, i32>,
    default_class: &str,
) -> Result<TenantQuota, ConfigError> {
    crate::names::validate_tenant(name)
        .map_err(|e| v.err(&format!("tenants.{name}"), e.to_string()))?;
    let guaranteed = amounts(v, &format!("tenants.{name}.guaranteed"), t.guaranteed)?;
    let burst = match t.burst {
        None => guaranteed,
        Some(b) => amounts(v, &format!("tenants.{name}.burst"), b)?,
    };
    if burst.mig_slices < guaranteed.mig_slices
        || burst.mps_sm_percent < guaranteed.mps_sm_percent
        || burst.memory_bytes < guaranteed.memory_bytes
        || burst.whole_gpus < guaranteed.whole_gpus
    {
        return Err(v.err(
            &format!("tenants.{name}.burst"),
            "must be at least the guaranteed amount in every dimension".into(),
        ));
    }
    let class = t
        .priority_class
        .unwrap_or_else(|| default_class.to_string());
    if !classes.contains_key(&class) {
        return Err(v.err(
            &format!("tenants.{name}.priority_class"),
            format!("{class:?} is not in [priority_classes]"),
        ));
    }
    Ok(TenantQuota {
        guaranteed,
        burst,
        priority_class: class,
    })
}

fn amounts(v: &Validator<'_>, field: &str, a: RawAmounts) -> Result<Amounts, ConfigError> {
    let memory_bytes = match a.memory {
        None => 0,
        Some(m) => parse_size(&m).map_err(|e| v.err(&format!("{field}.memory"), e.to_string()))?,
    };
    if a.mps_sm_percent > 100 * 64 {
        return Err(v.err(
            &format!("{field}.mps_sm_percent"),
            "is larger than any host".into(),
        ));
    }
    Ok(Amounts {
        mig_slices: a.mig_slices,
        mps_sm_percent: a.mps_sm_percent,
        memory_bytes,
        whole_gpus: a.whole_gpus,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("test.toml"), text)
    }

    const MINIMAL: &str = "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n";

    #[test]
    fn defaults_are_sane() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.gpu.backend, BackendKind::Sim);
        assert_eq!(c.daemon.socket, PathBuf::from("/run/tessera/tesserad.sock"));
        assert_eq!(c.daemon.socket_mode, 0o660);
        assert_eq!(c.lease.default_ttl, Duration::from_secs(3600));
        assert_eq!(c.partition.strategy, Strategy::BestFit);
        assert!(c.partition.dynamic_mig);
    }

    #[test]
    fn api_limits_default_and_refuse_what_cannot_work() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.api.max_send_message, 16 << 20);
        assert_eq!(c.api.watch_queue, 4096);
        assert_eq!(c.api.watch_history, 1024);
        assert_eq!(c.api.watch_bookmark_interval, Duration::from_secs(30));
        let c = parse(&format!(
            "{MINIMAL}[api]\nmax_send_message = \"8MiB\"\nwatch_history = 0\n"
        ))
        .unwrap();
        assert_eq!(c.api.max_send_message, 8 << 20);
        assert_eq!(c.api.watch_history, 0);
        for (bad, field) in [
            ("max_send_message = \"64KiB\"", "api.max_send_message"),
            ("watch_queue = 0", "api.watch_queue"),
            (
                "watch_bookmark_interval = \"1ms\"",
                "api.watch_bookmark_interval",
            ),
        ] {
            let e = parse(&format!("{MINIMAL}[api]\n{bad}\n")).unwrap_err();
            assert!(e.to_string().contains(field), "{bad}: {e}");
        }
    }

    #[test]
    fn unknown_key_is_refused_naming_it() {
        let e = parse(&format!("{MINIMAL}[lease]\ndefault_tll = \"1h\"\n")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("default_tll"), "{msg}");
    }

    #[test]
    fn bad_duration_names_the_field() {
        let e = parse(&format!("{MINIMAL}[lease]\nmax_ttl = \"forever\"\n")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("lease.max_ttl"), "{msg}");
    }

    #[test]
    fn unknown_sim_model_is_refused() {
        let e = parse("[[sim.gpus]]\nmodel = \"v100\"\n").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("v100") && msg.contains("h100-80gb"), "{msg}");
    }

    #[test]
    fn sim_backend_needs_gpus() {
        let e = parse("[gpu]\nbackend = \"sim\"\n").unwrap_err();
        assert!(e.to_string().contains("sim.gpus"), "{e}");
    }

    #[test]
    fn world_accessible_socket_is_refused() {
        let e = parse(&format!("{MINIMAL}[daemon]\nsocket_mode = \"0666\"\n")).unwrap_err();
        assert!(e.to_string().contains("daemon.socket_mode"), "{e}");
    }

    #[test]
    fn static_layout_on_missing_gpu_is_refused() {
        let e = parse(&format!(
            "{MINIMAL}[[partition.static]]\ngpu = 3\ndevices = {{ \"1g.10gb\" = 2 }}\n"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("partition.static[0].gpu"), "{e}");
    }

    #[test]
    fn tenants_quotas_and_principals_parse() {
        let c = parse(&format!(
            "{MINIMAL}[tenants.team-a]\nguaranteed = {{ mig_slices = 4, memory = \"8GiB\" }}\nburst = {{ mig_slices = 7, memory = \"16GiB\" }}\npriority_class = \"production\"\n\n[[auth.principals]]\nname = \"a\"\nrole = \"tenant\"\ntenant = \"team-a\"\nuids = [1000]\n"
        ))
        .unwrap();
        let t = &c.tenancy.tenants["team-a"];
        assert_eq!(t.guaranteed.mig_slices, 4);
        assert_eq!(t.burst.memory_bytes, 16 << 30);
        assert_eq!(c.auth.principals[0].role, Role::Tenant("team-a".into()));
    }

    #[test]
    fn burst_below_guarantee_is_refused() {
        let e = parse(&format!(
            "{MINIMAL}[tenants.a]\nguaranteed = {{ mig_slices = 4 }}\nburst = {{ mig_slices = 2 }}\n"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("tenants.a.burst"), "{e}");
    }

    #[test]
    fn principal_for_an_unknown_tenant_is_refused() {
        let e = parse(&format!(
            "{MINIMAL}[tenants.a]\n[[auth.principals]]\nname = \"b\"\nrole = \"tenant\"\ntenant = \"b\"\nuids = [5]\n"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("auth.principals.b.tenant"), "{e}");
    }

    #[test]
    fn sizes_follow_the_one_rule_and_si_units_are_refused_naming_the_key() {
        let c = parse(&format!("{MINIMAL}[audit]\nmax_size = \"1.5MiB\"\n")).unwrap();
        assert_eq!(c.audit.max_bytes, 3 << 19);
        let e = parse(&format!("{MINIMAL}[audit]\nmax_size = \"64MB\"\n")).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("audit.max_size") && msg.contains("\"64MiB\""),
            "{msg}"
        );
    }

    #[test]
    fn metrics_are_off_by_default_and_loopback_only_unless_allowed() {
        assert_eq!(parse(MINIMAL).unwrap().metrics.listen, None);
        let c = parse(&format!("{MINIMAL}[metrics]\nlisten = \"\"\n")).unwrap();
        assert_eq!(c.metrics.listen, None);
        let c = parse(&format!(
            "{MINIMAL}[metrics]\nlisten = \"127.0.0.1:9464\"\n"
        ))
        .unwrap();
        assert_eq!(c.metrics.listen, Some("127.0.0.1:9464".parse().unwrap()));
        let e = parse(&format!("{MINIMAL}[metrics]\nlisten = \"0.0.0.0:9464\"\n")).unwrap_err();
        assert!(e.to_string().contains("metrics.listen"), "{e}");
        assert!(e.to_string().contains("allow_remote"), "{e}");
        let c = parse(&format!(
            "{MINIMAL}[metrics]\nlisten = \"0.0.0.0:9464\"\nallow_remote = true\n"
        ))
        .unwrap();
        assert_eq!(c.metrics.listen, Some("0.0.0.0:9464".parse().unwrap()));
        let e = parse(&format!("{MINIMAL}[metrics]\nlisten = \"localhost\"\n")).unwrap_err();
        assert!(e.to_string().contains("metrics.listen"), "{e}");
    }

    /// Every tesserad config shipped directly under configs/ must load (runtime*.toml
    /// are tessera-runtime's, subdirectories hold profiles).
    #[test]
    fn shipped_configs_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let mut checked = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if !name.ends_with(".toml") || name.starts_with("runtime") {
                continue;
            }
            Config::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
            checked.push(name);
        }
        checked.sort();
        assert!(checked.contains(&"dev.toml".to_string()), "{checked:?}");
        assert!(
            checked.contains(&"tesserad.toml".to_string()),
            "{checked:?}"
        );
    }

    #[test]
    fn production_example_is_nvml_under_system_dirs() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let c = Config::load(&dir.join("tesserad.toml")).unwrap();
        assert_eq!(c.gpu.backend, BackendKind::Nvml);
        assert_eq!(c.daemon.state_dir, PathBuf::from("/var/lib/tessera"));
        assert_eq!(c.daemon.run_dir, PathBuf::from("/run/tessera"));
        assert_eq!(c.daemon.socket, PathBuf::from("/run/tessera/tesserad.sock"));
        assert_eq!(c.metrics.listen, Some("127.0.0.1:9464".parse().unwrap()));
    }

    #[test]
    fn ttl_bounds_are_checked() {
        let e = parse(&format!("{MINIMAL}[lease]\ndefault_ttl = \"30d\"\n")).unwrap_err();
        assert!(e.to_string().contains("lease.default_ttl"), "{e}");
    }
}
