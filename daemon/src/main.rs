//! tesserad, in this order: parse and validate everything (the config, exit 64; the
//! socket group, the TLS files, the state directory), then open the GPU backend (exit
//! 69 without one) and the store, then touch the hardware (reconcile, static
//! layout), then bind every listener (unix socket, TLS, metrics), and only then tell
//! systemd READY. SIGTERM drains in-flight calls within the grace period.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tessera_common::clock::now_ms;
use tesserad::api::auth::Authenticator;
use tesserad::api::{TesseraService, TlsMaterial};
use tesserad::audit::AuditLog;
use tesserad::config::{BackendKind, Config, LogFormat};
use tesserad::gpu::GpuBackend;
use tesserad::lease::LeaseManager;
use tesserad::store::Store;
use tokio::signal::unix::{SignalKind, signal};
use tracing::{error, info, warn};

/// Exit status for a bad config (EX_USAGE).
const EXIT_CONFIG: u8 = 64;
/// Exit status when the GPU backend is unavailable (EX_UNAVAILABLE).
const EXIT_UNAVAILABLE: u8 = 69;

#[derive(Debug, Parser)]
#[command(
    name = "tesserad",
    version,
    about = "Tessera node daemon: leases GPU partitions to tenants"
)]
struct Args {
    /// Path of the TOML config file.
    #[arg(
        long,
        short,
        default_value = "/etc/tessera/tesserad.toml",
        env = "TESSERAD_CONFIG"
    )]
    config: PathBuf,
    /// Validate the config file and exit.
    #[arg(long)]
    check_config: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Make the state store's commits fail (needs `[daemon] fault_injection = true`
    /// in the running daemon's config): chaos testing.
    Inject {
        /// What commits do from now on: io-error, disk-full or none.
        #[arg(long, value_parser = ["io-error", "disk-full", "none"])]
        store: String,
    },
    /// Play the simulated hardware's misfortune (backend = "sim"): health events and
    /// faults for a running daemon on the same config, through the simulator's
    /// control file.
    #[command(subcommand)]
    Sim(SimCommand),
}

#[derive(Debug, clap::Subcommand)]
enum SimCommand {
    /// An XID error event (critical ones: 48 63 64 74 79 94 95 119 120).
    Xid {
        #[arg(long)]
        gpu: u32,
        #[arg(long)]
        xid: u64,
        /// The GPU instance a contained error (XID 94) stays in.
        #[arg(long)]
        gi: Option<u32>,
    },
    /// A double-bit ECC error event.
    Ecc {
        #[arg(long)]
        gpu: u32,
    },
    /// The GPU falls off the bus: its calls fail with GPU_IS_LOST until `recover`.
    Lose {
        #[arg(long)]
        gpu: u32,
    },
    /// Retired pages or remapped rows pending (until `recover`).
    PendingRetirement {
        #[arg(long)]
        gpu: u32,
    },
    /// The GPU is back on the bus and its retirements applied (a reset).
    Recover {
        #[arg(long)]
        gpu: u32,
    },
    /// A fault on one simulated call (or `*`): a delay, then a failure rate.
    Fault {
        #[arg(long)]
        call: String,
        #[arg(long, default_value_t = 1.0)]
        fail_rate: f64,
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
    },
    /// Remove every injected call fault.
    ClearFaults,
    /// Print the control file.
    Show,
}

/// glibc malloc arenas for what still allocates through glibc (SQLite, which has
/// its own malloc calls; Rust's allocations go to mimalloc). glibc gives each thread
/// that allocates under contention an arena of its own, up to 8 per core, each
/// keeping what its thread freed; two keep the store's memory in one place.
#[cfg(target_env = "gnu")]
const MALLOC_ARENAS: libc::c_int = 2;

/// mimalloc's `mi_option_purge_delay` (its place in `mi_option_t` of mimalloc.h,
/// the same in v2 and v3; the sys crate names only some options).
///
/// mimalloc rather than glibc for Rust's allocations: glibc's malloc, free and arena
/// locks were about 13 % of the daemon's CPU under 32 clients; with mimalloc the
/// daemon spends 20 to 25 % less CPU per create+release cycle and 32 clients get
/// 25 % more cycles a second, at the same RSS once freed pages go back at once
/// (here) and arenas are committed on demand (`.cargo/config.toml`).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    tune_allocators();
    let args = Args::parse();
    let cfg = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tesserad: invalid config: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    init_tracing(cfg.daemon.log_format);
    let checked = match preflight(&cfg) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tesserad: invalid config: {e:#}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    match args.command {
        Some(Command::Inject { store }) => inject(&cfg, &args.config, &store),
        Some(Command::Sim(cmd)) => match sim_command(&cfg, cmd) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tesserad sim: {e:#}");
                ExitCode::from(EXIT_CONFIG)
            }
        },
        None if args.check_config => {
            println!("{}: OK", args.config.display());
            ExitCode::SUCCESS
        }
        None => serve(cfg, checked),
    }
}

/// Both allocators' settings, before any other thread exists.
fn tune_allocators() {
    // SAFETY: mi_option_set only stores an option's value; it is called before any
    // other thread exists. Freed pages go back to the kernel at once, not after a
    // second: what keeps RSS at the glibc figure (docs/performance.md).
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0);
    }
    // SAFETY: mallopt only sets a tunable of the C allocator (SQLite's); it is
    // called before any other thread exists, and a value it does not accept is
    // ignored (it returns 0, which is harmless here: glibc's default stays).
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS);
    }
}

/// `tesserad inject --store ...`: tell a running daemon's store to fail its commits.
fn inject(cfg: &Config, config_path: &std::path::Path, store: &str) -> ExitCode {
    use tesserad::store::faults::{CommitFault, StoreFaults};
    if !cfg.daemon.fault_injection {
        eprintln!(
            "tesserad inject: {} does not set [daemon] fault_injection = true; the daemon would ignore it",
            config_path.display()
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    let fault = match store {
        "io-error" => CommitFault::IoError,
        "disk-full" => CommitFault::DiskFull,
        _ => CommitFault::None,
    };
    let f = StoreFaults::in_run_dir(&cfg.daemon.run_dir);
    match f.set(fault) {
        Ok(()) => {
            println!("store commits: {store} ({})", f.path().display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tesserad inject: {}: {e}", f.path().display());
            ExitCode::FAILURE
        }
    }
}

/// The daemon: the store and the backend opened, then served until a signal.
fn serve(cfg: Config, checked: Checked) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tesserad")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    // The store opens (its check, the start-up snapshot read ahead) beside the
    // backend: neither touches the hardware, and each takes tens of milliseconds
    // with thousands of leases.
    let store = match open_store_beside(&cfg) {
        Ok(s) => s,
        Err(e) => {
            error!("{}", error_chain(&e));
            return ExitCode::FAILURE;
        }
    };
    let backend = match open_backend(&cfg) {
        Ok(b) => b,
        Err(e) => {
            error!("{}", error_chain(&e));
            return ExitCode::from(EXIT_UNAVAILABLE);
        }
    };
    match rt.block_on(run(cfg, checked, backend, store)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// `tesserad sim ...`: write the simulator's control file.
fn sim_command(cfg: &Config, cmd: SimCommand) -> anyhow::Result<()> {
    use tesserad::gpu::sim::{CallFault, SimControl};
    use tesserad::gpu::{HealthCause, HealthEvent, NvmlCode};
    if cfg.gpu.backend != BackendKind::Sim {
        anyhow::bail!("the config's backend is not \"sim\": there is no simulated hardware");
    }
    let gpus = cfg.sim.gpus.gpus.len() as u32;
    let check = |gpu: u32| -> anyhow::Result<u32> {
        anyhow::ensure!(gpu < gpus, "no simulated GPU {gpu} (the config has {gpus})");
        Ok(gpu)
    };
    let control = SimControl::beside(&cfg.sim.state_file, Vec::new());
    let event = |gpu, gi_id, cause| -> anyhow::Result<()> {
        control.update(|c| c.events.push(HealthEvent { gpu, gi_id, cause }))?;
        Ok(())
    };
    match cmd {
        SimCommand::Xid { gpu, xid, gi } => event(check(gpu)?, gi, HealthCause::Xid { xid })?,
        SimCommand::Ecc { gpu } => event(check(gpu)?, None, HealthCause::DoubleBitEcc)?,
        SimCommand::Lose { gpu } => {
            let gpu = check(gpu)?;
            control.update(|c| c.lost.insert(gpu))?;
        }
        SimCommand::PendingRetirement { gpu } => {
            let gpu = check(gpu)?;
            control.update(|c| c.pending_retirement.insert(gpu))?;
        }
        SimCommand::Recover { gpu } => {
            let gpu = check(gpu)?;
            control.update(|c| {
                c.lost.remove(&gpu);
                c.pending_retirement.remove(&gpu);
            })?;
        }
        SimCommand::Fault {
            call,
            fail_rate,
            delay_ms,
        } => {
            let f = CallFault {
                call,
                fail_rate,
                delay_ms,
                code: NvmlCode::Unknown,
            };
            f.validate()?;
            control.update(|c| {
                c.call_faults.retain(|old| old.call != f.call);
                c.call_faults.push(f);
            })?;
        }
        SimCommand::ClearFaults => control.update(|c| c.call_faults.clear())?,
        SimCommand::Show => {}
    }
    println!("{}", serde_json::to_string_pretty(&*control.current()?)?);
    Ok(())
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TESSERA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

fn open_backend(cfg: &Config) -> anyhow::Result<Arc<dyn GpuBackend>> {
    match cfg.gpu.backend {
        BackendKind::Sim => {
            let b = tesserad::gpu::open_sim(&cfg.sim)
                .with_context(|| format!("simulated GPUs ({})", cfg.sim.state_file.display()))?;
            Ok(Arc::new(b))
        }
        BackendKind::Nvml => {
            let b = tesserad::gpu::open_nvml(&cfg.gpu.nvml).context("backend = \"nvml\"")?;
            Ok(Arc::new(b))
        }
    }
}

/// The store being opened on a thread of its own.
type StoreOpening = std::thread::JoinHandle<anyhow::Result<Store>>;

/// Open the store on a thread, and read the start-up snapshot ahead.
fn open_store_beside(cfg: &Config) -> anyhow::Result<StoreOpening> {
    let faults = cfg.daemon.fault_injection.then(|| {
        let f = tesserad::store::faults::StoreFaults::in_run_dir(&cfg.daemon.run_dir);
        warn!(file = %f.path().display(), "fault injection is on: store commits fail while this file says so (never on a production host)");
        f
    });
    let dir = cfg.daemon.state_dir.clone();
    std::thread::Builder::new()
        .name("store-open".into())
        .spawn(move || {
            let store = Store::open_with_faults(&dir, faults)?;
            store.prefetch_snapshot()?;
            Ok(store)
        })
        .context("starting the thread that opens the store")
}

/// What the checks before any action found, for the steps that act.
struct Checked {
    /// The gid of `daemon.socket_group`.
    socket_gid: Option<nix::unistd::Gid>,
    /// The TLS listener's certificate, key and client CA, parsed.
    tls: Option<TlsMaterial>,
    /// `[auth.oidc]`: its CA file or JWKS file read (the issuer not yet asked).
    oidc: Option<Arc<tesserad::api::oidc::Verifier>>,
}

/// Everything that can be checked without acting: the socket group exists, the TLS
/// files parse, the state directory is (or can be made) a writable directory.
fn preflight(cfg: &Config) -> anyhow::Result<Checked> {
    let socket_gid = match &cfg.daemon.socket_group {
        None => None,
        Some(group) => Some(
            nix::unistd::Group::from_name(group)
                .with_context(|| format!("daemon.socket_group: looking up group {group:?}"))?
                .with_context(|| format!("daemon.socket_group: no group {group:?} on this host"))?
                .gid,
        ),
    };
    let tls = cfg
        .auth
        .tls
        .as_ref()
        .map(|t| TlsMaterial::load(t, cfg.auth.oidc.is_some()))
        .transpose()
        .context("auth.tls")?;
    let oidc = cfg
        .auth
        .oidc
        .clone()
        .map(tesserad::api::oidc::Verifier::new)
        .transpose()
        .context("auth.oidc")?;
    let dir = &cfg.daemon.state_dir;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("daemon.state_dir: cannot create {}", dir.display()))?;
    tempfile::tempfile_in(dir)
        .with_context(|| format!("daemon.state_dir: {} is not writable", dir.display()))?;
    Ok(Checked {
        socket_gid,
        tls,
        oidc,
    })
}

/// Who may call: the configured principals and, with `[auth.oidc]`, the token
/// verifier preflight built.
fn authenticator(cfg: &Config, checked: &Checked) -> Arc<Authenticator> {
    tesserad::api::auth::set_host_pid(cfg.auth.host_pid);
    let mut auth = Authenticator::new(cfg.auth.principals.clone());
    if let Some(v) = &checked.oidc {
        auth = auth.with_oidc(v.clone());
    }
    Arc::new(auth)
}

/// `[auth.oidc]`: the issuer's keys kept fresh until stop; the claim rules follow
/// `tessera reload`.
fn serve_tokens(
    oidc: Option<&Arc<tesserad::api::oidc::Verifier>>,
    service: &TesseraService,
    auth: &Arc<Authenticator>,
    stop_rx: &tokio::sync::watch::Receiver<bool>,
) {
    if let Some(v) = oidc {
        info!(issuer = %v.config().issuer, "OIDC bearer tokens accepted on the TLS listener");
        tokio::spawn(v.clone().run_refresh(stop_rx.clone()));
    }
    let oidc_rules = auth.clone();
    service.on_reload(Arc::new(move |cfg: &Config| {
        let rules = cfg.auth.oidc.as_ref().map(|o| o.rules.clone());
        let n = rules.as_ref().map_or(0, Vec::len);
        oidc_rules.set_oidc_rules(rules.unwrap_or_default());
        format!("{n} OIDC rules")
    }));
}

async fn run(
    cfg: Config,
    checked: Checked,
    backend: Arc<dyn GpuBackend>,
    store: StoreOpening,
) -> anyhow::Result<()> {
    let store = Arc::new(
        store
            .join()
            .map_err(|_| anyhow::anyhow!("the thread opening the store panicked"))??,
    );
    info!(
        db = %store.path().display(),
        checked = store.checked_at_open(),
        backend = backend.name(),
        "store opened"
    );
    let socket = cfg.daemon.socket.clone();
    let grace = cfg.daemon.shutdown_grace;
    let mode = cfg.daemon.socket_mode;
    let audit = Arc::new(
        AuditLog::open(&cfg.audit.path, cfg.audit.max_bytes, cfg.audit.keep)
            .context("opening the audit log")?,
    );
    info!(audit = %audit.path().display(), "audit log opened");
    let auth = authenticator(&cfg, &checked);
    if cfg.tenancy.tenants.is_empty() {
        warn!("no [tenants] configured: quotas are off, every tenant may use any free capacity");
    }
    let metrics_listen = cfg.metrics.listen;
    let kubernetes = cfg.kubernetes.clone();
    let kubernetes_dra = cfg.kubernetes.clone();
    // The DRA driver's slices are built from the whole config (health policy, MPS
    // classes) and the node name.
    let dra_slices = match (cfg.kubernetes.dra, cfg.kubernetes.dra_node_name()) {
        (false, _) => None,
        (true, Some(node)) => Some(tesserad::dra::slices::SliceConfig::from_config(
            &cfg, &node,
        )),
        (true, None) => anyhow::bail!(
            "[kubernetes] dra = true needs this node's name: set kubernetes.node_name or the NODE_NAME environment variable"
        ),
    };
    let cdi = cfg.cdi.clone();
    // The hardware is touched from here on (reconcile, static layout).
    let mgr = LeaseManager::start(cfg, backend, store.clone())?;
    // The device plugin's reservations are leases: made before anything is served.
    let device_plugin = start_device_plugin(&mgr, &store, kubernetes).await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // The DRA plugin answers kubelet from here on (before READY, like the device
    // plugin's sockets).
    let dra = start_dra(&mgr, &store, &kubernetes_dra, dra_slices, &stop_rx).await?;

    // Every listener is bound before READY.
    let listener = tesserad::api::bind_unix(&socket, mode)?;
    if let Some(gid) = checked.socket_gid {
        nix::unistd::chown(&socket, None, Some(gid))
            .with_context(|| format!("{}: chown to group {gid}", socket.display()))?;
    }
    let tls = match checked.tls {
        Some(t) => Some(t.bind().await.context("auth.tls.listen")?),
        None => None,
    };
    info!(socket = %socket.display(), "serving the tessera.v1 API");

    let mut tasks = Background::spawn(&mgr, &store, &stop_rx);
    // The handle the API service records calls and admissions on.
    let metrics = tesserad::metrics::spawn(metrics_listen, mgr.clone(), stop_rx.clone()).await?;
    if cdi.enabled {
        tokio::spawn(tesserad::cdi::run(mgr.clone(), cdi, stop_rx.clone()));
    } else {
        info!(dir = %cdi.dir.display(), "cdi: no per-lease specs ([cdi] enabled = false, or the directory is absent)");
    }
    let service = TesseraService::new(mgr.clone(), auth.clone(), Some(audit), Some(metrics));
    serve_tokens(checked.oidc.as_ref(), &service, &auth, &stop_rx);
    tasks.dra = dra;
    tasks.plugin = device_plugin.map(|p| {
        let on_reload = p.clone();
        service.on_reload(Arc::new(move |cfg: &Config| {
            on_reload.set_mix(cfg.kubernetes.mix.clone())
        }));
        tokio::spawn(p.run(stop_rx.clone()))
    });
    notify(&[sd_notify::NotifyState::Ready]);

    serve_until_signal(&service, listener, tls, grace, &mgr).await?;
    let _ = stop_tx.send(true);
    tasks.join().await;
    let _ = std::fs::remove_file(&socket);
    store.close();
    info!("stopped; leases and partitions are kept for the next start");
    Ok(())
}

/// The kubelet device plugin when `[kubernetes] device_plugin` is on; when it is off,
/// a warning if its devices' leases remain.
async fn start_device_plugin(
    mgr: &Arc<LeaseManager>,
    store: &Arc<Store>,
    kubernetes: tesserad::config::KubernetesConfig,
) -> anyhow::Result<Option<Arc<tesserad::k8s::DevicePlugin>>> {
    if kubernetes.device_plugin {
        let p = tesserad::k8s::DevicePlugin::start(mgr.clone(), store.clone(), kubernetes)
            .await
            .context("kubernetes device plugin")?;
        info!(dir = %p.config().device_plugin_dir.display(), "kubernetes device plugin on");
        return Ok(Some(p));
    }
    if let Ok(left) = store.k8s_devices()
        && !left.is_empty()
    {
        warn!(
            devices = left.len(),
            "the kubernetes device plugin is off but its devices' leases remain until they expire (kubernetes.lease_ttl) or are released (tessera lease list shows them, label tessera.io/k8s-class)"
        );
    }
    Ok(None)
}

/// The DRA driver when `[kubernetes] dra` is on: the kubelet plugin (claims become
/// leases, read from the API server's ResourceClaims) and the publisher of this
/// node's ResourceSlices, one task that ends when both have stopped. The API server
/// is reached through `kubernetes.kubeconfig`, else in-cluster; it need not be up
/// now (the publisher retries, a prepare fails until it answers).
async fn start_dra(
    mgr: &Arc<LeaseManager>,
    store: &Arc<Store>,
    kubernetes: &tesserad::config::KubernetesConfig,
    slices: Option<tesserad::dra::slices::SliceConfig>,
    stop_rx: &tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(slices) = slices.filter(|_| kubernetes.dra) else {
        return Ok(None);
    };
    let client = tesserad::dra::kube::connect(kubernetes.kubeconfig.as_deref())
        .await
        .context("kubernetes DRA: the API server client")?;
    let (_, plugin) = tesserad::dra::node::start(
        mgr.clone(),
        store.clone(),
        kubernetes.clone(),
        tesserad::dra::kube::claim_source(client.clone()),
        stop_rx.clone(),
    )
    .await
    .context("kubernetes DRA plugin")?;
    let mut opts = tesserad::dra::kube::PublisherOptions::new(slices);
    opts.gpus = kubernetes
        .dra_gpus
        .as_ref()
        .map(|g| g.iter().copied().collect());
    let publisher =
        tesserad::dra::kube::start_publisher(mgr.clone(), client, opts, stop_rx.clone());
    info!(
        node = %kubernetes.dra_node_name().unwrap_or_default(),
        "kubernetes DRA driver gpu.tessera.io on"
    );
    Ok(Some(tokio::spawn(async move {
        let _ = plugin.await;
        let _ = publisher.await;
    })))
}

/// The daemon's background tasks, stopped by the stop channel they were given.
struct Background {
    housekeeping: tokio::task::JoinHandle<()>,
    watchdog: tokio::task::JoinHandle<()>,
    #[cfg(target_env = "gnu")]
    trim: tokio::task::JoinHandle<()>,
    health: tokio::task::JoinHandle<()>,
    usage: tokio::task::JoinHandle<()>,
    plugin: Option<tokio::task::JoinHandle<()>>,
    dra: Option<tokio::task::JoinHandle<()>>,
}

impl Background {
    fn spawn(
        mgr: &Arc<LeaseManager>,
        store: &Arc<Store>,
        stop_rx: &tokio::sync::watch::Receiver<bool>,
    ) -> Background {
        // ops: usage records ([metrics] listen serves the Prometheus endpoint).
        let catalog_of = mgr.clone();
        Background {
            housekeeping: tokio::spawn(mgr.clone().run_housekeeping(stop_rx.clone())),
            watchdog: tokio::spawn(feed_watchdog(mgr.clone(), stop_rx.clone())),
            #[cfg(target_env = "gnu")]
            trim: tokio::spawn(trim_after_bulk_work(mgr.clone(), stop_rx.clone())),
            health: tokio::spawn(mgr.clone().run_health_watch(stop_rx.clone())),
            usage: tokio::spawn(tesserad::usage::run_recorder(
                store.clone(),
                move || catalog_of.usage_catalog(),
                stop_rx.clone(),
            )),
            plugin: None,
            dra: None,
        }
    }

    async fn join(self) {
        let _ = self.housekeeping.await;
        let _ = self.watchdog.await;
        #[cfg(target_env = "gnu")]
        let _ = self.trim.await;
        let _ = self.health.await;
        let _ = self.usage.await;
        if let Some(t) = self.plugin {
            let _ = t.await;
        }
        if let Some(t) = self.dra {
            let _ = t.await;
        }
    }
}

/// Serve the API on the unix socket (and TLS) until SIGTERM or SIGINT (SIGHUP
/// reloads the config), then drain: in-flight calls get `grace` to finish.
async fn serve_until_signal(
    service: &TesseraService,
    listener: tokio::net::UnixListener,
    tls: Option<tesserad::api::BoundTls>,
    grace: Duration,
    mgr: &LeaseManager,
) -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let mut hup = signal(SignalKind::hangup()).context("SIGHUP handler")?;
    let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
    let drained = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|d| *d).await;
    };
    let mut server = tokio::spawn(tesserad::api::serve_unix(
        service.clone(),
        listener,
        drained(drain_rx.clone()),
    ));
    let tls_server = tls.map(|tls| {
        let service = service.clone();
        let done = drained(drain_rx.clone());
        tokio::spawn(async move { tesserad::api::serve_tls(service, tls, done).await })
    });
    loop {
        tokio::select! {
            _ = term.recv() => { info!("SIGTERM: draining"); break; }
            _ = int.recv() => { info!("SIGINT: draining"); break; }
            _ = hup.recv() => {
                if let Err(e) = service.reload() {
                    error!("SIGHUP: {}", e.message());
                }
            }
            res = &mut server => {
                res.context("server task")??;
                anyhow::bail!("the API server stopped unexpectedly");
            }
        }
    }
    notify(&[sd_notify::NotifyState::Stopping]);
    mgr.begin_shutdown();
    let _ = drain_tx.send(true);
    if let Some(t) = tls_server {
        match tokio::time::timeout(grace, t).await {
            Ok(Ok(Err(e))) => warn!(error = %e, "TLS listener"),
            Err(_) => warn!("TLS listener did not drain within the grace period"),
            _ => {}
        }
    }
    match tokio::time::timeout(grace, &mut server).await {
        Ok(res) => res.context("server task")??,
        Err(_) => {
            warn!(grace = ?grace, "in-flight calls did not finish within the grace period; stopping anyway");
            server.abort();
        }
    }
    Ok(())
}

fn notify(state: &[sd_notify::NotifyState]) {
    if std::env::var_os("NOTIFY_SOCKET").is_some()
        && let Err(e) = sd_notify::notify(false, state)
    {
        warn!(error = %e, "sd_notify failed");
    }
}

/// Feed the systemd watchdog at half its interval, but only while the lease manager's
/// housekeeping loop keeps completing passes.
/// How far the live lease count moves before freed memory is given back.
#[cfg(target_env = "gnu")]
const TRIM_AFTER_LEASES: usize = 1000;

/// glibc keeps what the daemon frees in its arenas (the copies a bulk of creates or
/// releases, or the start-up load, leave behind), and gives back only the top of a
/// heap. `malloc_trim(0)` returns every whole free page to the kernel. Looked at
/// four times a second; trimmed once after the start, then whenever the live lease
/// count moved by [`TRIM_AFTER_LEASES`] since the last trim (a few milliseconds,
/// off the async workers).
#[cfg(target_env = "gnu")]
async fn trim_after_bulk_work(
    mgr: Arc<LeaseManager>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut trimmed_at: Option<usize> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            _ = stop.changed() => return,
        }
        let (live, _) = mgr.counts();
        if trimmed_at.is_some_and(|at| at.abs_diff(live) < TRIM_AFTER_LEASES) {
            continue;
        }
        trimmed_at = Some(live);
        // SAFETY: malloc_trim only walks the allocator's own free lists under its
        // locks and releases free pages; it has no preconditions.
        let _ = tokio::task::spawn_blocking(|| unsafe { libc::malloc_trim(0) }).await;
    }
}

async fn feed_watchdog(mgr: Arc<LeaseManager>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut usec = 0u64;
    if !sd_notify::watchdog_enabled(false, &mut usec) || usec == 0 {
        return;
    }
    let interval = Duration::from_micros(usec / 2);
    let healthy_within = Duration::from_micros(usec).as_millis() as i64;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.changed() => return,
        }
        let age = now_ms() - mgr.heartbeat_ms();
        if age < healthy_within {
            notify(&[sd_notify::NotifyState::Watchdog]);
        } else {
            warn!(
                age_ms = age,
                "lease manager loop stalled: not feeding the watchdog"
            );
        }
    }
}

/// An error and its causes, each once: a cause whose words its error already says
/// (thiserror's `"...: {0}"` over a `#[from]` source) is not said again.
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}
