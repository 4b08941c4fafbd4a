//! Benchmark: CreateLease+ReleaseLease cycles per second and latency percentiles with
//! 1, 8 and 32 concurrent clients against a real `tesserad` on simulated GPUs,
//! beside the machine's raw durable-commit rate (SQLite WAL, synchronous=FULL).
//!
//! Usage: tessera-bench [--seconds N] [--clients 1,8,32] [--shape mig|mps|whole]
//!        [--tesserad PATH]
//! Each cycle is: CreateLease (a durable intent, the hardware change, a durable
//! commit) then ReleaseLease (the same again). Targets on a 2-core machine:
//! >= 2,000 cycles/s at 32 clients, p99 <= 10 ms.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;
use tonic::transport::{Channel, Endpoint, Uri};

struct Args {
    seconds: u64,
    clients: Vec<usize>,
    shape: String,
    tesserad: Option<PathBuf>,
    socket: Option<PathBuf>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        seconds: 5,
        clients: vec![1, 8, 32],
        shape: "mig".into(),
        tesserad: None,
        socket: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--seconds" => a.seconds = val()?.parse().context("--seconds")?,
            "--clients" => {
                a.clients = val()?
                    .split(',')
                    .map(|s| s.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .context("--clients")?
            }
            "--shape" => a.shape = val()?,
            "--tesserad" => a.tesserad = Some(PathBuf::from(val()?)),
            "--socket" => a.socket = Some(PathBuf::from(val()?)),
            "-h" | "--help" => {
                println!(
                    "tessera-bench [--seconds N] [--clients 1,8,32] [--shape mig|mps|whole] [--tesserad PATH | --socket PATH]\n\
                     --socket: measure an already running daemon instead of starting one"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (try --help)"),
        }
    }
    if !["mig", "mps", "whole"].contains(&a.shape.as_str()) {
        bail!("--shape must be mig, mps or whole");
    }
    Ok(a)
}

fn shape(kind: &str) -> pb::Shape {
    let kind = match kind {
        "mig" => pb::shape::Kind::Mig(pb::MigShape {
            profile: "1g.10gb".into(),
            compute_profile: String::new(),
        }),
        "mps" => pb::shape::Kind::Mps(pb::MpsShape {
            sm_percent: 2,
            memory_bytes: 1 << 30,
        }),
        _ => pb::shape::Kind::WholeGpu(pb::WholeGpuShape {}),
    };
    pb::Shape { kind: Some(kind) }
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
    let path = socket.to_path_buf();
    let ch = Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await?;
    Ok(TesseraClient::new(ch))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Start a daemon on 8 simulated H100s in `dir`; returns its socket and process.
fn start_daemon(
    args: &Args,
    dir: &Path,
) -> anyhow::Result<(PathBuf, Child, Option<tempfile::TempDir>)> {
    let tesserad = match &args.tesserad {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("bench has no directory")?
            .join("tesserad"),
    };
    if !tesserad.exists() {
        bail!(
            "{} not found: build it (cargo build --release --bin tesserad) or pass --tesserad",
            tesserad.display()
        );
    }
    let socket = dir.join("tesserad.sock");
    // The run dir (MPS pipes, the simulator's hardware state) lives on tmpfs, as
    // /run does on a host; the database stays on disk in `dir`.
    let shm = tempfile::Builder::new()
        .prefix("tessera-bench-run")
        .tempdir_in("/dev/shm")
        .ok();
    let run_dir = shm
        .as_ref()
        .map(|d| d.path().to_path_buf())
        .unwrap_or_else(|| dir.join("run"));
    let mig = args.shape == "mig";
    let gpus: String = (0..8)
        .map(|_| format!("[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = {mig}\n"))
        .collect();
    let cfg = dir.join("bench.toml");
    std::fs::write(
        &cfg,
        format!(
            "[daemon]\nsocket = {:?}\nstate_dir = {:?}\nrun_dir = {:?}\n\n{gpus}\n[partition]\nmps_oversubscribe = true\n{}",
            socket,
            dir.join("state"),
            run_dir,
            std::env::var("TESSERA_BENCH_EXTRA").unwrap_or_default(),
        ),
    )?;
    let log_path = dir.join("tesserad.log");
    let log = std::fs::File::create(&log_path)?;
    let mut child = Command::new(&tesserad)
        .arg("--config")
        .arg(&cfg)
        .env("TESSERA_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("spawn {}", tesserad.display()))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if Instant::now() > deadline || child.try_wait()?.is_some() {
            let _ = child.kill();
            bail!(
                "tesserad did not start: {}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((socket, child, shm))
}

struct Sample {
    cycle: Duration,
    create: Duration,
    release: Duration,
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let dir = tempfile::Builder::new().prefix("tessera-bench").tempdir()?;
    let raw = raw_commit_rate(dir.path())?;
    let (socket, mut child, _shm) = match &args.socket {
        Some(s) => (s.clone(), None, None),
        None => {
            let (s, c, shm) = start_daemon(&args, dir.path())?;
            (s, Some(c), shm)
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!(
        "tessera-bench: shape {} ({}), {} s per run, {} cores",
        args.shape,
        if args.socket.is_some() {
            "running daemon"
        } else {
            "8 simulated H100s"
        },
        args.seconds,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    println!("raw durable commits (SQLite WAL, synchronous=FULL, 1 row each): {raw:.0}/s");
    println!(
        "{:>7} {:>8} {:>9} | {:>17} | {:>17} | {:>17}",
        "clients", "cycles", "cycles/s", "cycle p50/p99 ms", "create p50/p99", "release p50/p99"
    );
    let result = rt.block_on(async {
        for &n in &args.clients {
            let stop_at = Instant::now() + Duration::from_secs(args.seconds);
            let shape = Arc::new(shape(&args.shape));
            let mut tasks = Vec::new();
            for i in 0..n {
                let mut c = connect(&socket).await?;
                let shape = shape.clone();
                tasks.push(tokio::spawn(async move {
                    let mut samples = Vec::new();
                    let tenant = format!("bench-{i}");
                    while Instant::now() < stop_at {
                        let t0 = Instant::now();
                        let r = c
                            .create_lease(pb::CreateLeaseRequest {
                                tenant: tenant.clone(),
                                shape: Some((*shape).clone()),
                                ..Default::default()
                            })
                            .await?
                            .into_inner();
                        let t1 = Instant::now();
                        let id = r.lease.map(|l| l.id).unwrap_or_default();
                        c.release_lease(pb::ReleaseLeaseRequest {
                            lease_id: id,
                            reason: String::new(),
                        })
                        .await?;
                        let t2 = Instant::now();
                        samples.push(Sample {
                            cycle: t2 - t0,
                            create: t1 - t0,
                            release: t2 - t1,
                        });
                    }
                    Ok::<_, anyhow::Error>(samples)
                }));
            }
            let start = Instant::now();
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await??);
            }
            let secs = start.elapsed().as_secs_f64();
            let pick = |f: fn(&Sample) -> Duration| {
                let mut v: Vec<Duration> = all.iter().map(f).collect();
                v.sort();
                format!(
                    "{:>8.2} /{:>7.2}",
                    percentile(&v, 0.50).as_secs_f64() * 1e3,
                    percentile(&v, 0.99).as_secs_f64() * 1e3
                )
            };
            println!(
                "{:>7} {:>8} {:>9.0} | {} | {} | {}",
                n,
                all.len(),
                all.len() as f64 / secs,
                pick(|s| s.cycle),
                pick(|s| s.create),
                pick(|s| s.release),
            );
        }
        Ok::<_, anyhow::Error>(())
    });
    if let Some(c) = child.as_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    result
}
