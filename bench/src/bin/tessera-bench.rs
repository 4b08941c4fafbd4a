//! Benchmark of the lease path against a real `tesserad` on simulated GPUs.
//!
//! Throughput: CreateLease+ReleaseLease cycles per second and latency percentiles with
//! 1, 8 and 32 concurrent clients (8 simulated H100s), beside the machine's raw
//! durable-commit rate (SQLite WAL, synchronous=FULL). Each cycle is CreateLease (a
//! durable intent, the hardware change, a durable commit) then ReleaseLease (the same
//! again).
//!
//! Scale (`--prefill N`): one daemon on 64 simulated A100s (`--curve-gpus`) takes MPS
//! leases that stay live; at each point of the curve (0, 1k, 5k, 10k, 20k live leases,
//! up to N) one client measures CreateLease (each followed by a release, so the live
//! count holds), the daemon's RSS is read from /proc right after the leases were
//! created, and at `--restart-at` the daemon is stopped and started again: the time
//! from its start to its first answered RPC is "restart to serving" (GetNode, which
//! lists every partition, is timed after it on its own).
//!
//! `--results FILE` appends every figure as a `key value` line; `tessera-bench report
//! FILE` prints them against the goals (what `make bench` shows).
//!
//! Usage: tessera-bench --help

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;
use tonic::transport::Channel;

const USAGE: &str = "\
tessera-bench [--seconds N] [--clients 1,8,32] [--shape mig|mps|whole]
              [--prefill N] [--points 0,1000,5000,10000,20000] [--restart-at 10000]
              [--curve-seconds S] [--curve-gpus 64] [--no-throughput]
              [--tesserad PATH | --socket PATH] [--results FILE] [--keep]
tessera-bench report FILE     the goals table from the figures in FILE

  --seconds       length of each throughput run (default 5)
  --clients       concurrent clients of the throughput runs (default 1,8,32)
  --shape         the throughput runs' lease shape (default mig)
  --prefill       live leases to reach on the scale curve (default 0: no curve)
  --points        live-lease counts the curve measures at (those <= --prefill, and it)
  --restart-at    curve points where the daemon is restarted (default 10000, or the
                  last point when lower); later points run on the restarted daemon
  --curve-seconds length of each curve measurement (default 2)
  --curve-gpus    simulated A100-80GB GPUs of the curve's daemon (default 64)
  --no-throughput only the scale curve
  --tesserad      the daemon binary (default: next to this one)
  --socket        measure an already running daemon (no curve, RSS or restart)
  --results       append every figure to FILE as `key value` lines
  --keep          keep the curve daemon's directories (state, config, log) and
                  print where they are: to profile its start on the same state";

struct Args {
    seconds: u64,
    clients: Vec<usize>,
    shape: String,
    prefill: usize,
    points: Vec<usize>,
    restart_at: Vec<usize>,
    curve_seconds: f64,
    curve_gpus: usize,
    throughput: bool,
    tesserad: Option<PathBuf>,
    socket: Option<PathBuf>,
    results: Option<PathBuf>,
    keep: bool,
}

fn list<T: std::str::FromStr>(s: &str, what: &str) -> anyhow::Result<Vec<T>>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    s.split(',')
        .map(|v| v.trim().parse::<T>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("{what}: {s:?}"))
}

fn parse_args(args: impl Iterator<Item = String>) -> anyhow::Result<Args> {
    let mut a = Args {
        seconds: 5,
        clients: vec![1, 8, 32],
        shape: "mig".into(),
        prefill: 0,
        points: vec![0, 1000, 5000, 10000, 20000],
        restart_at: vec![10000],
        curve_seconds: 2.0,
        curve_gpus: 64,
        throughput: true,
        tesserad: None,
        socket: None,
        results: None,
        keep: false,
    };
    let mut restart_given = false;
    let mut it = args;
    while let Some(arg) = it.next() {
        let mut val = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--seconds" => a.seconds = val()?.parse().context("--seconds")?,
            "--clients" => a.clients = list(&val()?, "--clients")?,
            "--shape" => a.shape = val()?,
            "--prefill" => a.prefill = val()?.parse().context("--prefill")?,
            "--points" => a.points = list(&val()?, "--points")?,
            "--restart-at" => {
                a.restart_at = list(&val()?, "--restart-at")?;
                restart_given = true;
            }
            "--curve-seconds" => a.curve_seconds = val()?.parse().context("--curve-seconds")?,
            "--curve-gpus" => a.curve_gpus = val()?.parse().context("--curve-gpus")?,
            "--no-throughput" => a.throughput = false,
            "--tesserad" => a.tesserad = Some(PathBuf::from(val()?)),
            "--socket" => a.socket = Some(PathBuf::from(val()?)),
            "--results" => a.results = Some(PathBuf::from(val()?)),
            "--keep" => a.keep = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (try --help)"),
        }
    }
    if !["mig", "mps", "whole"].contains(&a.shape.as_str()) {
        bail!("--shape must be mig, mps or whole");
    }
    if a.clients.contains(&0) {
        bail!("--clients: each count must be positive");
    }
    if !a.curve_seconds.is_finite() || a.curve_seconds <= 0.0 {
        bail!("--curve-seconds must be positive");
    }
    if a.curve_gpus == 0 {
        bail!("--curve-gpus must be positive");
    }
    if a.prefill > 0 && a.socket.is_some() {
        bail!("--prefill starts its own daemon (it restarts it and reads its RSS): drop --socket");
    }
    // The curve: the points up to --prefill, and --prefill itself.
    a.points.retain(|&p| p <= a.prefill);
    a.points.push(a.prefill);
    a.points.sort_unstable();
    a.points.dedup();
    if !restart_given {
        a.restart_at = vec![10000.min(a.prefill)];
    }
    for r in &a.restart_at {
        if a.prefill > 0 && !a.points.contains(r) {
            bail!(
                "--restart-at {r} is not a point of the curve {:?}",
                a.points
            );
        }
    }
    Ok(a)
}

fn shape(kind: &str) -> pb::Shape {
    let kind = match kind {
        "mig" => pb::shape::Kind::Mig(pb::MigShape {
            count: 0,
            profile: "1g.10gb".into(),
            compute_profile: String::new(),
        }),
        "mps" => pb::shape::Kind::Mps(pb::MpsShape {
            sm_percent: 2,
            memory_bytes: 1 << 30,
            ..Default::default()
        }),
        _ => pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count: 0 }),
    };
    pb::Shape { kind: Some(kind) }
}

/// The curve's leases: 1% SM (oversubscribed), 64 MiB: an A100-80GB holds 1,280.
fn small_mps() -> pb::Shape {
    pb::Shape {
        kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
            sm_percent: 1,
            memory_bytes: 64 << 20,
            ..Default::default()
        })),
    }
}

/// Raw durable commits per second: one-row transactions in SQLite WAL with
/// synchronous=FULL, in the same directory the daemon's state lives in.
fn raw_commit_rate(dir: &Path) -> anyhow::Result<f64> {
    let conn = rusqlite::Connection::open(dir.join("raw.db"))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute_batch("CREATE TABLE t (x INTEGER)")?;
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs(2) {
        conn.execute("INSERT INTO t VALUES (?1)", [n as i64])?;
        n += 1;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

async fn connect(socket: &Path) -> anyhow::Result<TesseraClient<Channel>> {
    Ok(TesseraClient::new(
        tessera_common::unix::channel(socket).await?,
    ))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Resident set size of a process in bytes (VmRSS in /proc/<pid>/status).
fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| path.clone())?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("{path}: no VmRSS"))?;
    Ok(kib * 1024)
}

/// CPU time (user + system) a process has used, from /proc/<pid>/stat.
fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| path.clone())?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .with_context(|| format!("{path}: no command name"))?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line: 12 and 13 after the name.
    let ticks = |i: usize| -> anyhow::Result<u64> {
        f.get(i)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{path}: field {}", i + 3))
    };
    // SAFETY: sysconf has no preconditions; _SC_CLK_TCK is a valid name.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = u64::try_from(hz).ok().filter(|&h| h > 0).unwrap_or(100);
    let total = ticks(11)? + ticks(12)?;
    Ok(Duration::from_micros(total * 1_000_000 / hz))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Figures for `--results`, written as they are measured.
struct Results(Option<std::fs::File>);

impl Results {
    fn open(path: Option<&Path>) -> anyhow::Result<Results> {
        let file = path
            .map(|p| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .with_context(|| format!("{}", p.display()))
            })
            .transpose()?;
        Ok(Results(file))
    }

    fn put(&mut self, key: &str, value: f64) -> anyhow::Result<()> {
        if let Some(f) = self.0.as_mut() {
            writeln!(f, "{key} {value}").context("writing --results")?;
        }
        Ok(())
    }
}

/// A `tesserad` this bench started, on simulated GPUs in its own directory.
struct Daemon {
    tesserad: PathBuf,
    config: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// The run dir on tmpfs (as /run is on a host), removed on drop.
    _run: Option<tempfile::TempDir>,
}

impl Daemon {
    /// `gpus`: [[sim.gpus]] tables. The database stays on disk in `dir`.
    fn start(tesserad: &Path, dir: &Path, gpus: &str) -> anyhow::Result<Daemon> {
        if !tesserad.exists() {
            bail!(
                "{} not found: build it (cargo build --release --bin tesserad) or pass --tesserad",
                tesserad.display()
            );
        }
        let shm = tempfile::Builder::new()
            .prefix("tessera-bench-run")
            .tempdir_in("/dev/shm")
            .ok();
        let run_dir = shm
            .as_ref()
            .map(|d| d.path().to_path_buf())
            .unwrap_or_else(|| dir.join("run"));
        let socket = dir.join("tesserad.sock");
        let config = dir.join("bench.toml");
        std::fs::write(
            &config,
            format!(
                "[daemon]\nsocket = {:?}\nstate_dir = {:?}\nrun_dir = {:?}\n\n{gpus}\n[partition]\nmps_oversubscribe = true\n\n[lease]\ndefault_ttl = \"24h\"\n{}",
                socket,
                dir.join("state"),
                run_dir,
                std::env::var("TESSERA_BENCH_EXTRA").unwrap_or_default(),
            ),
        )
        .with_context(|| format!("{}", config.display()))?;
        let mut d = Daemon {
            tesserad: tesserad.to_path_buf(),
            config,
            socket,
            log: dir.join("tesserad.log"),
            child: None,
            _run: shm,
        };
        d.spawn()?;
        Ok(d)
    }

    /// Start the process; returns once an RPC is answered, with the time that took.
    fn spawn(&mut self) -> anyhow::Result<Duration> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("{}", self.log.display()))?;
        let start = Instant::now();
        let child = Command::new(&self.tesserad)
            .arg("--config")
            .arg(&self.config)
            .env("TESSERA_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawn {}", self.tesserad.display()))?;
        self.child = Some(child);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let deadline = start + Duration::from_secs(60);
        loop {
            // The daemon binds its socket only once the store is loaded and
            // reconciled with the hardware: its first answer, of any RPC, is
            // "serving". The probe is the cheapest read (a lease that cannot
            // exist: NOT_FOUND), so the time is the daemon's start, not the
            // size of one answer (GetNode's is timed on its own).
            let answered = rt.block_on(async {
                let mut c = connect(&self.socket).await.ok()?;
                match c
                    .get_lease(pb::GetLeaseRequest {
                        lease_id: "tessera-bench-probe".into(),
                    })
                    .await
                {
                    Ok(_) => Some(()),
                    Err(s) if s.code() == tonic::Code::NotFound => Some(()),
                    Err(_) => None,
                }
            });
            if answered.is_some() {
                return Ok(start.elapsed());
            }
            let exited = match self.child.as_mut() {
                Some(c) => c.try_wait()?.is_some(),
                None => true,
            };
            if exited || Instant::now() > deadline {
                self.kill();
                bail!(
                    "tesserad did not start serving: {}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// How long one GetNode takes (it lists every partition).
    fn time_get_node(&self) -> anyhow::Result<Duration> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let mut c = connect(&self.socket).await?;
            let start = Instant::now();
            c.get_node(pb::GetNodeRequest {}).await?;
            Ok(start.elapsed())
        })
    }

    /// How long a full paged listing of the live leases takes (ListLeases at the
    /// default page size, page after page): (time, leases, pages, largest answer).
    fn time_list_all(&self) -> anyhow::Result<(Duration, usize, usize, usize)> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let mut c = connect(&self.socket).await?;
            let mut req = pb::ListLeasesRequest::default();
            let (mut leases, mut pages, mut largest) = (0, 0, 0);
            let start = Instant::now();
            loop {
                let r = c.list_leases(req.clone()).await?.into_inner();
                pages += 1;
                leases += r.leases.len();
                largest = largest.max(prost::Message::encoded_len(&r));
                if r.next_page_token.is_empty() {
                    break;
                }
                req.page_token = r.next_page_token;
            }
            Ok((start.elapsed(), leases, pages, largest))
        })
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGTERM, wait for the exit (not timed), start again: the restart-to-serving time.
    fn restart(&mut self) -> anyhow::Result<Duration> {
        self.stop()?;
        self.spawn()
    }

    /// SIGTERM and wait for the exit.
    fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            let pid = i32::try_from(c.id()).context("pid")?;
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            )
            .context("SIGTERM tesserad")?;
            let status = c.wait().context("waiting for tesserad")?;
            if !status.success() {
                bail!("tesserad exited with {status} on SIGTERM");
            }
        }
        Ok(())
    }

    /// Stop the daemon and keep its run directory (which holds the simulator's
    /// state); returns it.
    fn stop_and_keep(&mut self) -> anyhow::Result<Option<PathBuf>> {
        self.stop()?;
        Ok(self._run.take().map(tempfile::TempDir::keep))
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

fn default_tesserad(args: &Args) -> anyhow::Result<PathBuf> {
    Ok(match &args.tesserad {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("bench has no directory")?
            .join("tesserad"),
    })
}

fn sim_gpus(n: usize, model: &str, mig: bool) -> String {
    (0..n)
        .map(|_| format!("[[sim.gpus]]\nmodel = \"{model}\"\nmig = {mig}\n"))
        .collect()
}

struct Sample {
    cycle: Duration,
    create: Duration,
    release: Duration,
}

async fn cycle(
    c: &mut TesseraClient<Channel>,
    tenant: &str,
    shape: &pb::Shape,
) -> anyhow::Result<Sample> {
    let t0 = Instant::now();
    let r = c
        .create_lease(pb::CreateLeaseRequest {
            tenant: tenant.to_owned(),
            shape: Some(shape.clone()),
            ..Default::default()
        })
        .await?
        .into_inner();
    let t1 = Instant::now();
    let id = r
        .lease
        .map(|l| l.id)
        .context("CreateLease answered no lease")?;
    c.release_lease(pb::ReleaseLeaseRequest {
        lease_id: id,
        reason: String::new(),
    })
    .await?;
    let t2 = Instant::now();
    Ok(Sample {
        cycle: t2 - t0,
        create: t1 - t0,
        release: t2 - t1,
    })
}

fn sorted(all: &[Sample], f: fn(&Sample) -> Duration) -> Vec<Duration> {
    let mut v: Vec<Duration> = all.iter().map(f).collect();
    v.sort();
    v
}

/// Cycles with 1, 8, 32 clients on 8 simulated H100s.
fn throughput(
    args: &Args,
    rt: &tokio::runtime::Runtime,
    results: &mut Results,
) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new().prefix("tessera-bench").tempdir()?;
    let raw = raw_commit_rate(dir.path())?;
    let daemon = match &args.socket {
        Some(_) => None,
        None => {
            let model_mig = args.shape == "mig";
            Some(Daemon::start(
                &default_tesserad(args)?,
                dir.path(),
                &sim_gpus(8, "h100-80gb", model_mig),
            )?)
        }
    };
    let socket = match (&args.socket, &daemon) {
        (Some(s), _) => s.clone(),
        (None, Some(d)) => d.socket.clone(),
        (None, None) => bail!("no daemon"),
    };
    println!(
        "throughput: shape {} ({}), {} s per run",
        args.shape,
        if args.socket.is_some() {
            "running daemon"
        } else {
            "8 simulated H100s"
        },
        args.seconds,
    );
    println!("raw durable commits (SQLite WAL, synchronous=FULL, 1 row each): {raw:.0}/s");
    results.put("raw_commits_per_s", raw)?;
    println!(
        "{:>7} {:>8} {:>9} | {:>17} | {:>17} | {:>17} | {:>9}",
        "clients",
        "cycles",
        "cycles/s",
        "cycle p50/p99 ms",
        "create p50/p99",
        "release p50/p99",
        "CPU ms/cy"
    );
    let pid = daemon.as_ref().and_then(Daemon::pid);
    let shape = Arc::new(shape(&args.shape));
    for &n in &args.clients {
        // The daemon's own CPU per cycle: what other work on a shared machine
        // disturbs far less than rates and latencies.
        let cpu0 = pid.map(cpu_time).transpose()?;
        let (all, secs) = rt.block_on(run_clients(&socket, n, args.seconds, &shape))?;
        let cpu_per_cycle = match (pid, cpu0) {
            (Some(pid), Some(cpu0)) => {
                Some(cpu_time(pid)?.saturating_sub(cpu0) / all.len().max(1) as u32)
            }
            _ => None,
        };
        clients_row(n, &all, secs, cpu_per_cycle, results)?;
    }
    drop(daemon);
    Ok(())
}

/// `n` clients, each on its own connection, running create+release cycles for
/// `seconds`: every cycle's sample, and how long they ran.
async fn run_clients(
    socket: &Path,
    n: usize,
    seconds: u64,
    shape: &Arc<pb::Shape>,
) -> anyhow::Result<(Vec<Sample>, f64)> {
    let stop_at = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for i in 0..n {
        let mut c = connect(socket).await?;
        let shape = shape.clone();
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let tenant = format!("bench-{i}");
            while Instant::now() < stop_at {
                samples.push(cycle(&mut c, &tenant, &shape).await?);
            }
            Ok::<_, anyhow::Error>(samples)
        }));
    }
    let start = Instant::now();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok((all, start.elapsed().as_secs_f64()))
}

/// The throughput row of `n` clients, printed and recorded.
fn clients_row(
    n: usize,
    all: &[Sample],
    secs: f64,
    cpu_per_cycle: Option<Duration>,
    results: &mut Results,
) -> anyhow::Result<()> {
    let (cyc, cre, rel) = (
        sorted(all, |s| s.cycle),
        sorted(all, |s| s.create),
        sorted(all, |s| s.release),
    );
    let pair = |v: &[Duration]| {
        format!(
            "{:>8.2} /{:>7.2}",
            ms(percentile(v, 0.50)),
            ms(percentile(v, 0.99))
        )
    };
    let rate = all.len() as f64 / secs;
    println!(
        "{:>7} {:>8} {:>9.0} | {} | {} | {} | {:>9}",
        n,
        all.len(),
        rate,
        pair(&cyc),
        pair(&cre),
        pair(&rel),
        cpu_per_cycle.map_or("-".into(), |c| format!("{:.3}", ms(c))),
    );
    if let Some(c) = cpu_per_cycle {
        results.put(
            &format!("throughput.{n}.daemon_cpu_us_per_cycle"),
            c.as_secs_f64() * 1e6,
        )?;
    }
    results.put(&format!("throughput.{n}.cycles_per_s"), rate)?;
    results.put(
        &format!("throughput.{n}.create_p99_ms"),
        ms(percentile(&cre, 0.99)),
    )?;
    results.put(
        &format!("throughput.{n}.cycle_p99_ms"),
        ms(percentile(&cyc, 0.99)),
    )
}

/// Create leases that stay live until `target` are, with 16 clients.
async fn fill(socket: &Path, live: usize, target: usize) -> anyhow::Result<()> {
    let next = Arc::new(AtomicUsize::new(live));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let mut c = connect(socket).await?;
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let shape = small_mps();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= target {
                    return Ok::<_, anyhow::Error>(());
                }
                c.create_lease(pb::CreateLeaseRequest {
                    tenant: format!("prefill-{}", i % 16),
                    shape: Some(shape.clone()),
                    labels: [("bench".to_owned(), "prefill".to_owned())].into(),
                    ..Default::default()
                })
                .await
                .with_context(|| format!("creating live lease {i}"))?;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// One client's create+release cycles for `seconds` (at least 10).
async fn one_client(socket: &Path, seconds: f64, shape: &pb::Shape) -> anyhow::Result<Vec<Sample>> {
    let mut c = connect(socket).await?;
    let mut v = Vec::new();
    let stop_at = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < stop_at || v.len() < 10 {
        v.push(cycle(&mut c, "curve", shape).await?);
    }
    Ok(v)
}

/// Restart the daemon with `point` live leases: how long until it served, its RSS
/// then; GetNode and a full paged listing timed after it (in `notes`).
fn restart_at(
    daemon: &mut Daemon,
    point: usize,
    results: &mut Results,
    notes: &mut Vec<String>,
) -> anyhow::Result<(Duration, u64)> {
    let took = daemon.restart()?;
    let rss_after = rss_bytes(daemon.pid().context("the daemon is not running")?)?;
    results.put(&format!("curve.{point}.restart_ms"), ms(took))?;
    let node = daemon.time_get_node()?;
    results.put(&format!("curve.{point}.get_node_ms"), ms(node))?;
    let (list, leases, pages, largest) = daemon.time_list_all()?;
    results.put(&format!("curve.{point}.list_all_ms"), ms(list))?;
    results.put(&format!("curve.{point}.list_largest_bytes"), largest as f64)?;
    notes.push(format!(
        "restart with {point} live leases: {:.1} ms to serving; then GetNode (every partition) answered in {:.1} ms, \
         and a full paged ListLeases ({leases} leases, {pages} pages, the largest answer {:.0} KiB) took {:.1} ms",
        ms(took),
        ms(node),
        largest as f64 / 1024.0,
        ms(list)
    ));
    results.put(
        &format!("curve.{point}.rss_after_restart_bytes"),
        rss_after as f64,
    )?;
    Ok((took, rss_after))
}

/// The scale curve: CreateLease rate, RSS and restart time against live leases.
/// One client's CreateLease rate at a point: 1 / the median latency (the median
/// resists the other work of a shared machine better than the mean), and the mean-based
/// rate printed beside it.
fn point_rates(samples: &[Sample], sorted_creates: &[Duration]) -> (f64, f64) {
    let rate = 1.0 / percentile(sorted_creates, 0.50).as_secs_f64().max(1e-9);
    let create_time: Duration = samples.iter().map(|s| s.create).sum();
    (rate, samples.len() as f64 / create_time.as_secs_f64())
}

/// A point's figures in the results.
fn record_point(
    results: &mut Results,
    point: usize,
    [rate, mean_rate]: [f64; 2],
    cpu_per_cycle: Duration,
    sorted_creates: &[Duration],
    rss: u64,
) -> anyhow::Result<()> {
    results.put(&format!("curve.{point}.create_per_s"), rate)?;
    results.put(&format!("curve.{point}.create_per_s_mean"), mean_rate)?;
    results.put(
        &format!("curve.{point}.daemon_cpu_us_per_cycle"),
        cpu_per_cycle.as_secs_f64() * 1e6,
    )?;
    results.put(
        &format!("curve.{point}.create_p99_ms"),
        ms(percentile(sorted_creates, 0.99)),
    )?;
    results.put(&format!("curve.{point}.rss_bytes"), rss as f64)
}

/// The scale curve's title and column heads.
fn curve_header(args: &Args) {
    println!();
    println!(
        "scale: {} simulated A100-80GB, MPS leases (1% SM, 64 MiB) kept live; at each point one client \
         runs CreateLease+ReleaseLease for {} s; RSS right after the leases were created",
        args.curve_gpus, args.curve_seconds
    );
    println!(
        "creates/s = 1 / median CreateLease latency (mean-based beside it); daemon CPU per \
         create+release cycle; RSS after the restart in 'then'"
    );
    println!(
        "{:>6} {:>7} {:>9} {:>6} {:>6} | {:>14} | {:>9} | {:>7} | {:>7} {:>8} | {:>6}",
        "live",
        "cycles",
        "creates/s",
        "mean",
        "vs 0",
        "create p50/p99",
        "CPU ms/cy",
        "RSS MiB",
        "restart",
        "then MiB",
        "fill s"
    );
}

fn curve(args: &Args, rt: &tokio::runtime::Runtime, results: &mut Results) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("tessera-bench-curve")
        .tempdir()?;
    let mut notes: Vec<String> = Vec::new();
    let mut daemon = Daemon::start(
        &default_tesserad(args)?,
        dir.path(),
        &sim_gpus(args.curve_gpus, "a100-80gb", false),
    )?;
    curve_header(args);
    let mut live = 0usize;
    let mut base = None;
    let shape = small_mps();
    for &point in &args.points {
        let t_fill = Instant::now();
        rt.block_on(fill(&daemon.socket, live, point))?;
        let fill_s = t_fill.elapsed().as_secs_f64();
        live = point;
        let pid = daemon.pid().context("the daemon is not running")?;
        let rss = rss_bytes(pid)?;
        let cpu0 = cpu_time(pid)?;
        let samples = rt.block_on(one_client(&daemon.socket, args.curve_seconds, &shape))?;
        let cpu_per_cycle = cpu_time(pid)?.saturating_sub(cpu0) / samples.len().max(1) as u32;
        let cre = sorted(&samples, |s| s.create);
        let (rate, mean_rate) = point_rates(&samples, &cre);
        let base_rate = *base.get_or_insert(rate);
        record_point(results, point, [rate, mean_rate], cpu_per_cycle, &cre, rss)?;
        let (restart, rss_after) = if args.restart_at.contains(&point) {
            let (took, rss_after) = restart_at(&mut daemon, point, results, &mut notes)?;
            (format!("{:.1}", ms(took)), format!("{:.1}", mib(rss_after)))
        } else {
            ("-".into(), "-".into())
        };
        println!(
            "{:>6} {:>7} {:>9.0} {:>6.0} {:>6.2} | {:>6.2} /{:>6.2} | {:>9.2} | {:>7.1} | {:>7} {:>8} | {:>6.1}",
            point,
            samples.len(),
            rate,
            mean_rate,
            rate / base_rate,
            ms(percentile(&cre, 0.50)),
            ms(percentile(&cre, 0.99)),
            ms(cpu_per_cycle),
            mib(rss),
            restart,
            rss_after,
            fill_s,
        );
    }
    if let Some(r) = args.restart_at.iter().find(|&&r| r < live) {
        println!("(points after {r} ran on the daemon restarted there)");
    }
    for n in notes {
        println!("{n}");
    }
    if args.keep {
        let run = daemon.stop_and_keep()?;
        let dir = dir.keep();
        println!(
            "kept: {} (config {}), run dir {}",
            dir.display(),
            daemon.config.display(),
            run.map_or_else(
                || dir.join("run").display().to_string(),
                |r| r.display().to_string()
            )
        );
    }
    Ok(())
}

/// One goal: (measure, goal text, measured text, met?).
type Goal = (&'static str, &'static str, Option<String>, bool);

/// The goals, checked against the figures of `--results` files.
fn report(files: &[String]) -> anyhow::Result<()> {
    if files.is_empty() {
        bail!("report needs the results file(s) the benches wrote (--results)");
    }
    let v = read_results(files)?;
    let get = |k: &str| v.get(k).copied();
    let mut rows = daemon_goals(&get);
    rows.extend(runtime_and_placement_goals(&get));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!();
    println!("goals ({cores} cores, load average now {}):", loadavg());
    println!("{:<60} {:<26} {:<30} result", "measure", "goal", "measured");
    let mut met = 0;
    for (name, goal, got, ok) in &rows {
        let verdict = match (got, ok) {
            (None, _) => "not measured",
            (Some(_), true) => "met",
            (Some(_), false) => "NOT MET",
        };
        met += usize::from(*ok);
        println!(
            "{name:<60} {goal:<26} {:<30} {verdict}",
            got.as_deref().unwrap_or("-")
        );
    }
    println!("{met} of {} goals met", rows.len());
    if let Some(list) = get("curve.10000.list_all_ms") {
        let largest = get("curve.10000.list_largest_bytes").unwrap_or(0.0) / 1024.0;
        println!(
            "full paged ListLeases of 10,000 leases: {list:.0} ms (the largest answer {largest:.0} KiB)"
        );
    }
    Ok(())
}

/// The `key value` lines of the results files (a later file's value wins).
fn read_results(files: &[String]) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut v: BTreeMap<String, f64> = BTreeMap::new();
    for f in files {
        let text = std::fs::read_to_string(f).with_context(|| f.clone())?;
        for (n, line) in text.lines().enumerate() {
            let Some((k, val)) = line.split_once(' ') else {
                bail!("{f}:{}: not `key value`: {line:?}", n + 1);
            };
            let val: f64 = val
                .trim()
                .parse()
                .with_context(|| format!("{f}:{}: {line:?}", n + 1))?;
            v.insert(k.to_owned(), val);
        }
    }
    Ok(v)
}

/// The daemon's goals: the scale curve, RSS, restart and throughput.
fn daemon_goals(get: &dyn Fn(&str) -> Option<f64>) -> Vec<Goal> {
    let ratio = |a: &str, b: &str| Some(get(a)? / get(b)?);
    let mut rows: Vec<Goal> = Vec::new();
    let r5 = ratio("curve.5000.create_per_s", "curve.0.create_per_s");
    rows.push((
        "CreateLease rate, 5,000 live vs none",
        ">= 0.8",
        r5.map(|r| format!("{r:.2}")),
        r5.is_some_and(|r| r >= 0.8),
    ));
    let r20 = ratio("curve.20000.create_per_s", "curve.0.create_per_s");
    rows.push((
        "CreateLease rate, 20,000 live vs none",
        ">= 0.7",
        r20.map(|r| format!("{r:.2}")),
        r20.is_some_and(|r| r >= 0.7),
    ));
    let rss = get("curve.10000.rss_bytes").map(|b| b / (1024.0 * 1024.0));
    rows.push((
        "RSS after creating 10,000 leases",
        "<= 64 MiB",
        rss.map(|m| format!("{m:.1} MiB")),
        rss.is_some_and(|m| m <= 64.0),
    ));
    let restart = get("curve.10000.restart_ms");
    let node = get("curve.10000.get_node_ms");
    rows.push((
        "restart to serving, 10,000 leases",
        "<= 250 ms",
        restart.map(|m| match node {
            Some(n) => format!("{m:.0} ms (GetNode then {n:.0} ms)"),
            None => format!("{m:.0} ms"),
        }),
        restart.is_some_and(|m| m <= 250.0),
    ));
    let (rate, p99) = (
        get("throughput.32.cycles_per_s"),
        get("throughput.32.create_p99_ms"),
    );
    rows.push((
        "create+release cycles/s, 32 clients",
        ">= 3,000/s, p99 <= 10 ms",
        rate.zip(p99)
            .map(|(r, p)| format!("{r:.0}/s, p99 create {p:.1} ms")),
        rate.zip(p99).is_some_and(|(r, p)| r >= 3000.0 && p <= 10.0),
    ));
    rows
}

/// The runtime's goal and MIG placement's.
fn runtime_and_placement_goals(get: &dyn Fn(&str) -> Option<f64>) -> Vec<Goal> {
    let mut rows: Vec<Goal> = Vec::new();
    let rt = get("runtime.lease.ratio_wall_vs_hardened_runc");
    // The run's 95% interval (runtime-bench's bootstrap) beside the median's ratio,
    // which alone decides the goal.
    let interval = get("runtime.lease.ratio_wall_vs_hardened_runc_lo")
        .zip(get("runtime.lease.ratio_wall_vs_hardened_runc_hi"))
        .filter(|(lo, hi)| lo.is_finite() && hi.is_finite());
    // The first start on a lease (no answer kept: two calls to the daemon) beside it.
    let first = get("runtime.lease.ratio_wall_unkept_vs_hardened_runc")
        .map(|f| format!("; first start {f:.3}"))
        .unwrap_or_default();
    rows.push((
        "tessera-runtime with a lease vs hardened runc (median wall)",
        "<= 1.10",
        rt.map(|r| match interval {
            Some((lo, hi)) => format!("{r:.3} (95% {lo:.2}-{hi:.2}{first})"),
            None => format!("{r:.3}{first}"),
        }),
        rt.is_some_and(|r| r <= 1.10),
    ));
    // MIG placement, leases in use (a container on every lease: none moves).
    let min = get("placement.default.min_ratio");
    let mean = get("placement.default.mean_ratio");
    rows.push((
        "MIG placement vs the repacking bound, mean (lowest)",
        ">= 0.90 (>= 0.87)",
        mean.zip(min).map(|(m, l)| format!("{m:.3} ({l:.3})")),
        mean.zip(min).is_some_and(|(m, l)| m >= 0.90 && l >= 0.87),
    ));
    let ff = get("placement.default.ff_mean_ratio");
    rows.push((
        "MIG placement vs canonical first fit, mean",
        ">= 1.02",
        ff.map(|r| format!("{r:.3}")),
        ff.is_some_and(|r| r >= 1.02),
    ));
    let least = get("placement.default.least_profile");
    rows.push((
        "least-served MIG profile vs the bound, any trace",
        ">= 0.60 (none starved)",
        least.map(|r| format!("{r:.3}")),
        least.is_some_and(|r| r >= 0.6),
    ));
    // Waits in the admission queue are in mean lease durations.
    let wait = get("placement.queue.p99_wait.load1");
    rows.push((
        "queue p99 wait at load 1.0, worst profile (mean leases)",
        "<= 3",
        wait.map(|w| format!("{w:.3}")),
        wait.is_some_and(|w| w <= 3.0),
    ));
    rows
}

/// The 1, 5 and 15 minute load averages, to show what else the machine was doing.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

fn main() -> anyhow::Result<()> {
    let mut argv = std::env::args().skip(1).peekable();
    if argv.peek().map(String::as_str) == Some("report") {
        return report(&argv.skip(1).collect::<Vec<_>>());
    }
    let args = parse_args(argv)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut results = Results::open(args.results.as_deref())?;
    println!(
        "tessera-bench: {} cores, load average {}",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        loadavg()
    );
    if args.throughput {
        throughput(&args, &rt, &mut results)?;
    }
    if args.prefill > 0 {
        curve(&args, &rt, &mut results)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn parse(s: &str) -> anyhow::Result<Args> {
        parse_args(s.split_whitespace().map(str::to_owned))
    }

    #[test]
    fn the_curve_stops_at_prefill_and_includes_it() {
        let a = parse("--prefill 7000").unwrap();
        assert_eq!(a.points, [0, 1000, 5000, 7000]);
        assert_eq!(a.restart_at, [7000], "restart at the last point under 10k");
        let a = parse("--prefill 20000").unwrap();
        assert_eq!(a.points, [0, 1000, 5000, 10000, 20000]);
        assert_eq!(a.restart_at, [10000]);
        let a = parse("--prefill 300 --points 0,100").unwrap();
        assert_eq!(a.points, [0, 100, 300]);
        assert!(parse("--prefill 300 --restart-at 200").is_err());
        assert!(parse("--prefill 10 --socket /x").is_err());
        assert!(parse("--clients 1,0").is_err());
    }
}
