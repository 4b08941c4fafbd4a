//! runtime-bench: time `tessera-runtime run` against plain `runc run` of the same busybox
//! bundle (`/bin/true`), pairwise and alternating, and print medians and ratios.
//!
//! Variants per iteration, in an order shuffled afresh each iteration (a fixed seed):
//! - runc on the tenant's spec as given (no seccomp, no masks);
//! - runc on the tenant's spec with what containerd gives every pod: its default masked
//!   and read-only paths and its default seccomp profile (Docker's allowlist, here the
//!   tenant profile's rules, for all of containerd's architectures) -- the fair baseline;
//! - runc on the spec tessera-runtime produces (what runc itself costs with the tenant
//!   seccomp, masks and device rules);
//! - tessera-runtime on the tenant's spec (hardening, atomic config.json write, exec runc);
//! - tessera-runtime alone: `run` with `runc_path` set to `true`, so everything but runc
//!   (the config.json write included), and `check` (hardening, no write), and `true` alone;
//! - runc on the hardened spec again, after the machine idled 5 ms (untimed): on a
//!   virtual machine whose idle vCPUs halt, a start that follows idle time is slower
//!   than one that follows work, and tessera-runtime's runc follows its waits on the
//!   daemon. Printed beside the ratios; no goal uses it.
//!
//! Each variant prints the median wall time and the median CPU time (user + system of the
//! process and the descendants it waited for), which other work on a shared machine
//! disturbs far less. The goal's ratio (tessera-runtime over runc on the hardened spec,
//! median wall) comes with its 95% bootstrap interval: how far this one run can be
//! trusted.
//!
//! The bundles and runc's state live in `--workdir` (default: the temp dir). containerd
//! keeps bundles and runc state on /run (tmpfs); on a disk filesystem runc's own state
//! writes reach the disk, which the output points out.
//!
//! With a lease (the path a GPU container takes: the runtime resolves the token and
//! binds the container, the bind recording the admission: two RPCs to tesserad on one
//! connection; it adds the lease's devices, mounts and environment), either `--sim-lease`: the bench starts a
//! `tesserad` on one simulated A100, takes an MPS lease and makes its device nodes with
//! mknod under the daemon's `dev_root` (as the driver would on a GPU host); or
//! `--daemon-socket PATH --token TOKEN`: a lease of a running daemon, whose device nodes
//! must exist (a real GPU host).
//!
//! Needs root, runc and busybox. Usage:
//!   runtime-bench [--iterations N] [--runtime PATH] [--runc PATH] [--workdir DIR]
//!                 [--sim-lease [--tesserad PATH] | --daemon-socket PATH --token TOKEN]
//!                 [--results FILE]
//! `--results` appends the medians and ratios as `key value` lines (see tessera-bench
//! report).

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tessera_proto::v1 as pb;
use tessera_runtime::harden::{DEFAULT_MASKED, DEFAULT_READONLY};

struct Args {
    iterations: usize,
    runtime: PathBuf,
    runc: PathBuf,
    daemon_socket: Option<PathBuf>,
    token: Option<String>,
    workdir: Option<PathBuf>,
    sim_lease: bool,
    tesserad: Option<PathBuf>,
    results: Option<PathBuf>,
}

const USAGE: &str = "runtime-bench [--iterations N] [--runtime PATH] [--runc PATH] [--workdir DIR]
              [--sim-lease [--tesserad PATH] | --daemon-socket PATH --token TOKEN]
              [--results FILE]";

fn parse_args() -> Result<Args> {
    let exe = std::env::current_exe().context("current_exe")?;
    let mut a = Args {
        iterations: 50,
        runtime: exe.with_file_name("tessera-runtime"),
        runc: PathBuf::from("/usr/sbin/runc"),
        daemon_socket: None,
        token: None,
        workdir: None,
        sim_lease: false,
        tesserad: None,
        results: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--iterations" | "-n" => a.iterations = value()?.parse().context("--iterations")?,
            "--runtime" => a.runtime = value()?.into(),
            "--runc" => a.runc = value()?.into(),
            "--daemon-socket" => a.daemon_socket = Some(value()?.into()),
            "--token" => a.token = Some(value()?),
            "--workdir" => a.workdir = Some(value()?.into()),
            "--sim-lease" => a.sim_lease = true,
            "--tesserad" => a.tesserad = Some(value()?.into()),
            "--results" => a.results = Some(value()?.into()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    if a.iterations == 0 {
        bail!("--iterations must be positive");
    }
    if a.daemon_socket.is_some() != a.token.is_some() {
        bail!("--daemon-socket and --token go together");
    }
    if a.sim_lease && a.daemon_socket.is_some() {
        bail!("--sim-lease starts its own daemon: drop --daemon-socket and --token");
    }
    Ok(a)
}

/// A busybox rootfs in `bundle/rootfs`: each bundle holds its own, as containerd's
/// do (the runtime admits a rootfs inside the bundle, or a container engine's own in
/// its storage).
fn rootfs(bundle: &Path) -> Result<()> {
    let rootfs = bundle.join("rootfs");
    for d in ["bin", "proc", "sys", "dev", "tmp"] {
        std::fs::create_dir_all(rootfs.join(d)).with_context(|| format!("mkdir {d}"))?;
    }
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).context("copy /bin/busybox")?;
    std::os::unix::fs::symlink("busybox", rootfs.join("bin/true")).context("symlink true")?;
    Ok(())
}

fn spec(token: Option<&str>) -> serde_json::Value {
    let caps = json!([
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FSETID",
        "CAP_FOWNER",
        "CAP_MKNOD",
        "CAP_NET_RAW",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETFCAP",
        "CAP_SETPCAP",
        "CAP_NET_BIND_SERVICE",
        "CAP_SYS_CHROOT",
        "CAP_KILL",
        "CAP_AUDIT_WRITE"
    ]);
    let mut s = json!({
        "ociVersion": "1.0.2-dev",
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["/bin/true"], "env": ["PATH=/bin"],
                    "cwd": "/", "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
                    "noNewPrivileges": true},
        "root": {"path": "rootfs"},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}
        ],
        "linux": {"resources": {"devices": [{"allow": false, "access": "rwm"}]},
                  "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]}
    });
    if let Some(t) = token {
        s["annotations"] = json!({"tessera.io/lease-token": t});
    }
    s
}

fn time_run(
    program: &Path,
    root: &Path,
    bundle: &Path,
    id: &str,
    env: &[(&str, &Path)],
) -> Result<Sample> {
    let (root, bundle) = (root.to_string_lossy(), bundle.to_string_lossy());
    time_cmd(
        program,
        &["--root", &root, "run", "--bundle", &bundle, id],
        env,
    )
}

/// After a timed run, what containerd's shim does once a container has exited (not
/// timed): `delete` through the runtime, which drops the container's binding to the
/// lease. Without it every run would leave one more binding on the bench's lease
/// (for the minute before housekeeping finds the container gone), and every later
/// resolve and bind would carry a longer list of containers than a real lease has.
/// runc has removed a `run` container already, so its own answer is not checked.
fn runtime_delete(runtime: &Path, root: &str, id: &str, env: &[(&str, &Path)]) -> Result<()> {
    let mut cmd = Command::new(runtime);
    cmd.args(["--root", root, "delete", "--force", id])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.status()
        .with_context(|| format!("running {} delete", runtime.display()))?;
    Ok(())
}

/// One run: wall-clock time, and CPU time (user + system) of the process and every
/// descendant it waited for (runc's init and the container included). CPU time is far
/// less disturbed than wall time by other work on a shared machine.
#[derive(Debug, Clone, Copy)]
struct Sample {
    wall: Duration,
    cpu: Duration,
}

/// CPU time of this process's waited-for descendants so far.
fn children_cpu() -> Duration {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a complete rusage through the pointer, which points to a
    // zeroed rusage of the right size; RUSAGE_CHILDREN is a valid `who`.
    let ru = unsafe {
        if libc::getrusage(libc::RUSAGE_CHILDREN, ru.as_mut_ptr()) != 0 {
            return Duration::ZERO;
        }
        ru.assume_init()
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The `linux.seccomp` containerd's default profile gives a pod on this host: the same
/// rule set (Docker's allowlist, as the tenant profile's allowed set), compiled by runc
/// for every architecture containerd lists for the host (amd64: x86_64, x86, x32;
/// arm64: aarch64, arm), not the native one only.
fn containerd_like_seccomp(tenant: &Value) -> Value {
    let mut sc = tenant.clone();
    let arches = if cfg!(target_arch = "aarch64") {
        json!(["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"])
    } else {
        json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"])
    };
    sc["architectures"] = arches;
    sc
}

/// The baseline a real pod carries: the tenant spec plus containerd's default masked and
/// read-only paths and its default seccomp profile.
fn containerd_like_spec(original: &Value, tenant_seccomp: &Value) -> Value {
    let mut s = original.clone();
    s["linux"]["maskedPaths"] = json!(DEFAULT_MASKED);
    s["linux"]["readonlyPaths"] = json!(DEFAULT_READONLY);
    s["linux"]["seccomp"] = containerd_like_seccomp(tenant_seccomp);
    s
}

/// "tmpfs" or the filesystem's magic number.
fn fs_kind(dir: &Path) -> String {
    match nix::sys::statfs::statfs(dir) {
        Ok(st) if st.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC => "tmpfs".to_string(),
        Ok(st) if st.filesystem_type() == nix::sys::statfs::EXT4_SUPER_MAGIC => "ext4".to_string(),
        Ok(st) => format!("f_type {:#x}", st.filesystem_type().0),
        Err(e) => format!("unknown ({e})"),
    }
}

/// Time a command that must succeed, output discarded.
fn time_cmd(program: &Path, args: &[&str], env: &[(&str, &Path)]) -> Result<Sample> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let cpu0 = children_cpu();
    let start = Instant::now();
    let out = cmd
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    let wall = start.elapsed();
    let cpu = children_cpu().saturating_sub(cpu0);
    if !out.status.success() {
        bail!(
            "{} {args:?} failed ({}): {}{}",
            program.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(Sample { wall, cpu })
}

/// An absolute, root-owned `true` for the runtime-only measurement.
fn find_true() -> Result<PathBuf> {
    ["/usr/bin/true", "/bin/true"]
        .iter()
        .map(PathBuf::from)
        .find(|p| tessera_runtime::app::check_runtime_binary(p).is_ok())
        .context("no root-owned /usr/bin/true or /bin/true for the runtime-only timing")
}

/// The runtime's state dir (its cache of `runc --version` answers) for the bench.
fn state_dir(dir: &Path) -> PathBuf {
    dir.join("runtime-state")
}

fn runtime_config(path: &Path, runc: &Path, socket: &Path, dir: &Path) -> Result<()> {
    std::fs::write(
        path,
        format!(
            "runc_path = {:?}\ndaemon_socket = {:?}\nnvidia_proc_root = {:?}\nstate_dir = {:?}\nrunc_cve_acknowledged = [{}]\n[policy]\napparmor = \"if-available\"\n",
            runc,
            socket,
            dir.join("no-nvidia"),
            state_dir(dir),
            // Measured on whatever runc the machine has: the check still runs on
            // every start (the version from the cache, `runc --version` after the
            // binary changed), but an old runc does not stop the benchmark.
            tessera_common::runc::MOUNT_RACE_CVES
                .iter()
                .map(|c| format!("{c:?}"))
                .collect::<Vec<_>>()
                .join(", "),
        ),
    )
    .with_context(|| format!("writing {}", path.display()))
}

const VARIANTS: &[&str] = &[
    "runc run (tenant spec, no seccomp)",
    "runc run (containerd-default-like)",
    "runc run (hardened spec)",
    "tessera-runtime run",
    "tessera-runtime alone: run -> true",
    "tessera-runtime alone: check",
    "true alone",
    "runc run (hardened spec) after 5 ms idle",
    "tessera-runtime run, no kept answer",
];

/// splitmix64: the bench's order of variants, the same for every run.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Fisher-Yates.
    fn shuffle(&mut self, v: &mut [usize]) {
        for i in (1..v.len()).rev() {
            // i + 1 is small: the modulo's bias is far below anything measured here.
            let j = usize::try_from(self.next() % (i as u64 + 1)).unwrap_or(0);
            v.swap(i, j);
        }
    }
}

/// The 95% interval of median(a) / median(b), by the percentile bootstrap: each
/// round draws `a` and `b` again with replacement (they were timed interleaved but
/// not paired: each start had its own predecessors). What one run's ratio is worth on
/// a noisy machine.
fn ratio_interval(a: &[Duration], b: &[Duration], rng: &mut SplitMix64) -> (f64, f64) {
    const ROUNDS: usize = 1000;
    if a.is_empty() || b.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mut draw = |v: &[Duration]| -> Duration {
        let mut x: Vec<Duration> = (0..v.len())
            .map(|_| v[usize::try_from(rng.next() % v.len() as u64).unwrap_or(0)])
            .collect();
        median(&mut x)
    };
    let mut ratios: Vec<f64> = (0..ROUNDS)
        .map(|_| draw(a).as_secs_f64() / draw(b).as_secs_f64())
        .collect();
    ratios.sort_by(f64::total_cmp);
    (ratios[ROUNDS / 40], ratios[ROUNDS - 1 - ROUNDS / 40])
}

/// How long the machine idles before the last variant's runc start (not timed).
const IDLE_BEFORE: std::time::Duration = std::time::Duration::from_millis(5);

fn main() -> Result<()> {
    let args = parse_args()?;
    if !nix::unistd::geteuid().is_root() {
        bail!("runtime-bench needs root (runc run)");
    }
    let dir = work_dir(args.workdir.as_deref())?;
    let result = run_bench(args, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_bench(mut args: Args, dir: &Path) -> Result<()> {
    let _daemon = if args.sim_lease {
        let d = SimLease::start(&args)?;
        println!(
            "lease path: tesserad on a simulated A100, MPS lease {} (device nodes made under {})",
            d.lease_id,
            d.dev_root.display()
        );
        args.daemon_socket = Some(d.socket.clone());
        args.token = Some(d.token.clone());
        Some(d)
    } else {
        None
    };
    bench(&args, dir)
}

/// A `tesserad` on one simulated A100 (MIG off) holding one MPS lease, whose device
/// nodes exist under the daemon's `dev_root` in the bench directory.
struct SimLease {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
    dev_root: PathBuf,
    lease_id: String,
    token: String,
}

impl SimLease {
    fn start(args: &Args) -> Result<SimLease> {
        let tesserad = match &args.tesserad {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .context("current_exe")?
                .with_file_name("tesserad"),
        };
        if !tesserad.exists() {
            bail!(
                "{} not found: build it (cargo build --release --bin tesserad) or pass --tesserad",
                tesserad.display()
            );
        }
        // Not in the bench's workdir: that may be /dev/shm, and the runtime refuses a
        // lease mount from under /dev (the MPS pipe directory lives in the run dir).
        let d = std::env::temp_dir().join(format!("tessera-bench-daemon-{}", std::process::id()));
        let dev_root = d.join("dev");
        std::fs::create_dir_all(&dev_root)
            .with_context(|| format!("mkdir {}", dev_root.display()))?;
        let socket = d.join("tesserad.sock");
        let config = d.join("tesserad.toml");
        std::fs::write(
            &config,
            format!(
                "[daemon]\nsocket = {socket:?}\nstate_dir = {:?}\nrun_dir = {:?}\n\n[[sim.gpus]]\nmodel = \"a100-80gb\"\nmig = false\n\n[devices]\ndev_root = {dev_root:?}\n\n[lease]\ndefault_ttl = \"24h\"\n",
                d.join("state"),
                d.join("run"),
            ),
        )
        .with_context(|| format!("writing {}", config.display()))?;
        let log = d.join("tesserad.log");
        let child = Command::new(&tesserad)
            .arg("--config")
            .arg(&config)
            .env("TESSERA_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).with_context(|| format!("{}", log.display()))?)
            .spawn()
            .with_context(|| format!("spawn {}", tesserad.display()))?;
        let mut me = SimLease {
            child,
            dir: d.clone(),
            socket,
            dev_root,
            lease_id: String::new(),
            token: String::new(),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("tokio runtime")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut client = loop {
            if let Ok(c) = rt.block_on(connect(&me.socket)) {
                break c;
            }
            if Instant::now() > deadline || me.child.try_wait()?.is_some() {
                bail!(
                    "tesserad did not start: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let devices = rt.block_on(me.take_lease(&mut client))?;
        me.make_device_nodes(&devices)?;
        Ok(me)
    }

    /// An MPS lease of the bench's own: its id and token kept, the devices it
    /// resolves to returned.
    async fn take_lease(
        &mut self,
        client: &mut pb::tessera_client::TesseraClient<tonic::transport::Channel>,
    ) -> Result<Vec<pb::DeviceNode>> {
        let created = client
            .create_lease(pb::CreateLeaseRequest {
                tenant: "bench".into(),
                shape: Some(pb::Shape {
                    kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                        sm_percent: 25,
                        memory_bytes: 8 << 30,
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            })
            .await
            .context("CreateLease")?
            .into_inner();
        self.lease_id = created.lease.map(|l| l.id).unwrap_or_default();
        self.token = created.token;
        let resolved = client
            .resolve_token(pb::ResolveTokenRequest {
                token: self.token.clone(),
            })
            .await
            .context("ResolveToken")?
            .into_inner();
        Ok(resolved.devices)
    }

    /// The nodes the driver would have made on a GPU host, under the daemon's
    /// `dev_root`.
    fn make_device_nodes(&self, devices: &[pb::DeviceNode]) -> Result<()> {
        for dev in devices {
            let p = Path::new(&dev.host_path);
            if !p.starts_with(&self.dev_root) {
                bail!(
                    "the lease's device {} is outside {}",
                    p.display(),
                    self.dev_root.display()
                );
            }
            if p.exists() {
                continue;
            }
            let (major, minor) = (
                u64::try_from(dev.major).context("device major")?,
                u64::try_from(dev.minor).context("device minor")?,
            );
            nix::sys::stat::mknod(
                p,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(major, minor),
            )
            .with_context(|| format!("mknod {}", p.display()))?;
        }
        Ok(())
    }
}

impl Drop for SimLease {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn connect(
    socket: &Path,
) -> Result<pb::tessera_client::TesseraClient<tonic::transport::Channel>> {
    let ch = tessera_common::unix::channel(socket).await?;
    Ok(pb::tessera_client::TesseraClient::new(ch))
}

/// What every timed start uses: the bundles of each variant, runc's root, the
/// tenant's spec, the runtime's two configs and where it keeps its answer.
struct Bundles {
    root: PathBuf,
    root_s: String,
    plain: PathBuf,
    ctrd: PathBuf,
    hard: PathBuf,
    tess: PathBuf,
    alone: PathBuf,
    alone_s: String,
    /// The tenant's spec, as each run starts from it.
    original: Vec<u8>,
    config: PathBuf,
    config_true: PathBuf,
    true_bin: PathBuf,
    /// The runtime's kept answer for the lease's token (with a lease).
    kept: Option<PathBuf>,
}

fn bench(args: &Args, dir: &Path) -> Result<()> {
    let b = prepare(args, dir)?;
    let env: [(&str, &Path); 1] = [("TESSERA_RUNTIME_CONFIG", &b.config)];
    let mut times: Vec<Vec<Sample>> = vec![Vec::new(); VARIANTS.len()];
    // Warm-up (page cache, binaries).
    time_run(&args.runc, &b.root, &b.plain, "warm-0", &[])?;
    std::fs::write(b.tess.join("config.json"), &b.original)?;
    time_run(&args.runtime, &b.root, &b.tess, "warm-1", &env)?;
    runtime_delete(&args.runtime, &b.root_s, "warm-1", &env)?;
    // A fresh order each iteration, from a fixed seed: what a start costs here depends
    // on what ran just before it (see IDLE_BEFORE), and a fixed rotation gives each
    // variant the same predecessors every time, which moved the goal's ratio by 0.05
    // to 0.1 (docs/performance.md).
    let mut rng = SplitMix64(0x7e55_e7a0);
    let mut order: Vec<usize> = (0..VARIANTS.len()).collect();
    for i in 0..args.iterations {
        rng.shuffle(&mut order);
        for &v in &order {
            let took = time_variant(args, &b, v, &format!("v{v}-{i}"))?;
            times[v].push(took);
        }
    }
    report(args, dir, &times)
}

/// The bundles, configs and specs of every variant.
fn prepare(args: &Args, dir: &Path) -> Result<Bundles> {
    let root = dir.join("runc-root");
    let true_bin = find_true()?;
    let config = dir.join("runtime.toml");
    let config_true = dir.join("runtime-true.toml");
    let socket = args
        .daemon_socket
        .clone()
        .unwrap_or_else(|| dir.join("no-daemon.sock"));
    runtime_config(&config, &args.runc, &socket, dir)?;
    runtime_config(&config_true, &true_bin, &socket, dir)?;
    // `true` stands in for runc in the runtime-only timing: the version cache says
    // what a fixed runc would, so that, as with the real runc after the first start,
    // no `--version` is run (the real runc's answer is cached by the warm-up).
    let cache = tessera_runtime::runc_cves::VersionCache::new(&state_dir(dir));
    tessera_runtime::runc_cves::BinaryKey::of(&true_bin)
        .and_then(|key| cache.store(key, (1, 2, 8)))
        .context("seeding the runc version cache for the runtime-only timing")?;
    let original_spec = spec(args.token.as_deref());
    let original = serde_json::to_vec(&original_spec)?;
    let bundles: Vec<PathBuf> = ["plain", "containerd", "hardened", "tessera", "alone"]
        .iter()
        .map(|b| dir.join(b))
        .collect();
    for b in &bundles {
        std::fs::create_dir_all(b).with_context(|| format!("mkdir {}", b.display()))?;
        std::fs::write(b.join("config.json"), &original)?;
        rootfs(b)?;
    }
    let [plain, ctrd, hard, tess, alone] = &bundles[..] else {
        bail!("bundle list");
    };
    // The hardened spec, as tessera-runtime writes it (check prints it).
    let out = Command::new(&args.runtime)
        .env("TESSERA_RUNTIME_CONFIG", &config)
        .args(["check", "--json", "--bundle"])
        .arg(tess)
        .output()
        .with_context(|| format!("running {}", args.runtime.display()))?;
    let checked: Value = serde_json::from_slice(&out.stdout).context("check --json output")?;
    if checked["admitted"] != true {
        bail!("the bench spec was refused: {}", checked["reasons"]);
    }
    std::fs::write(
        hard.join("config.json"),
        serde_json::to_vec(&checked["spec"])?,
    )?;
    let tenant_seccomp = &checked["spec"]["linux"]["seccomp"];
    std::fs::write(
        ctrd.join("config.json"),
        serde_json::to_vec(&containerd_like_spec(&original_spec, tenant_seccomp))?,
    )?;
    // The runtime keeps the daemon's answer for the lease's token after a start, so
    // later starts bind without asking first; the last variant removes it.
    let kept = args
        .token
        .as_deref()
        .map(|t| tessera_runtime::lease::cache::AnswerCache::new(&state_dir(dir)).path_of(t));
    Ok(Bundles {
        root_s: root.to_string_lossy().into_owned(),
        root,
        plain: plain.clone(),
        ctrd: ctrd.clone(),
        hard: hard.clone(),
        tess: tess.clone(),
        alone_s: alone.to_string_lossy().into_owned(),
        alone: alone.clone(),
        original,
        config,
        config_true,
        true_bin,
        kept,
    })
}

/// One timed start of variant `v` (container id `id`).
fn time_variant(args: &Args, b: &Bundles, v: usize, id: &str) -> Result<Sample> {
    let env: [(&str, &Path); 1] = [("TESSERA_RUNTIME_CONFIG", &b.config)];
    let env_true: [(&str, &Path); 1] = [("TESSERA_RUNTIME_CONFIG", &b.config_true)];
    Ok(match v {
        0 => time_run(&args.runc, &b.root, &b.plain, id, &[])?,
        1 => time_run(&args.runc, &b.root, &b.ctrd, id, &[])?,
        2 => time_run(&args.runc, &b.root, &b.hard, id, &[])?,
        3 | 8 => {
            // The last variant: a start with no answer kept from an earlier
            // one (the first start on a lease): ResolveToken, then
            // BindContainer. Every earlier start kept one, so a missing file
            // means this variant would time the kept path.
            if let (8, Some(kept)) = (v, &b.kept) {
                std::fs::remove_file(kept).with_context(|| {
                    format!("removing the runtime's kept answer {}", kept.display())
                })?;
            }
            // Each run starts from the tenant's spec (not timed).
            std::fs::write(b.tess.join("config.json"), &b.original)?;
            let t = time_run(&args.runtime, &b.root, &b.tess, id, &env)?;
            runtime_delete(&args.runtime, &b.root_s, id, &env)?;
            t
        }
        4 => {
            std::fs::write(b.alone.join("config.json"), &b.original)?;
            let t = time_run(&args.runtime, &b.root, &b.alone, id, &env_true)?;
            runtime_delete(&args.runtime, &b.root_s, id, &env_true)?;
            t
        }
        5 => {
            // From the tenant's spec too: `run` above rewrote this bundle's
            // config.json into the hardened spec, which lists the lease's GPU
            // devices itself and so is (rightly) refused by check.
            std::fs::write(b.alone.join("config.json"), &b.original)?;
            time_cmd(
                &args.runtime,
                &[
                    "--root", &b.root_s, "check", "--json", "--bundle", &b.alone_s,
                ],
                &env,
            )?
        }
        6 => time_cmd(&b.true_bin, &[], &[])?,
        _ => {
            // The baseline again, from an idle machine: tessera-runtime's own
            // runc follows its waits on the daemon.
            std::thread::sleep(IDLE_BEFORE);
            time_run(&args.runc, &b.root, &b.hard, id, &[])?
        }
    })
}

/// The medians, ratios and interval printed, and written to `--results`.
fn report(args: &Args, dir: &Path, times: &[Vec<Sample>]) -> Result<()> {
    let med_of = |f: fn(&Sample) -> Duration| -> Vec<Duration> {
        times
            .iter()
            .map(|t| median(&mut t.iter().map(f).collect::<Vec<_>>()))
            .collect()
    };
    let (med, cpu) = (med_of(|s| s.wall), med_of(|s| s.cpu));
    println!(
        "workdir {} ({}); iterations {} (alternating, each in a shuffled order)",
        dir.display(),
        fs_kind(dir),
        args.iterations
    );
    println!("{:<40} {:>10} {:>10}", "median of", "wall ms", "cpu ms");
    for ((name, m), c) in VARIANTS.iter().zip(&med).zip(&cpu) {
        println!("{name:<40} {:10.2} {:10.2}", ms(*m), ms(*c));
    }
    let ratio = |v: &[Duration], a: usize, b: usize| v[a].as_secs_f64() / v[b].as_secs_f64();
    for (name, b) in [
        ("runc", 0),
        ("runc(containerd-default)", 1),
        ("runc(hardened)", 2),
    ] {
        println!(
            "ratio tessera / {name:<24} {:10.3} {:10.3}",
            ratio(&med, 3, b),
            ratio(&cpu, 3, b)
        );
    }
    println!(
        "ratio tessera, no kept answer / runc(hardened) {:4.3} {:10.3}  (the first start on a lease)",
        ratio(&med, 8, 2),
        ratio(&cpu, 8, 2)
    );
    let walls = |v: usize| times[v].iter().map(|s| s.wall).collect::<Vec<_>>();
    let (lo, hi) = ratio_interval(&walls(3), &walls(2), &mut SplitMix64(0x0b00_7571));
    println!(
        "  its 95% interval (bootstrap, wall)      {lo:10.3} to {hi:.3}  (what this one run can tell apart)"
    );
    println!(
        "runtime alone (run -> true, minus true)  {:10.2} {:10.2}  (hardening, lease RPCs, config.json write)",
        ms(med[4].saturating_sub(med[6])),
        ms(cpu[4].saturating_sub(cpu[6]))
    );
    println!(
        "runc after {} ms idle, minus the baseline    {:10.2} {:10.2}  (what idling costs the next start on this machine)",
        IDLE_BEFORE.as_millis(),
        ms(med[7]) - ms(med[2]),
        ms(cpu[7]) - ms(cpu[2])
    );
    if let Some(path) = &args.results {
        write_results(path, args.token.is_some(), &med, &cpu, (lo, hi))?;
    }
    if fs_kind(dir) != "tmpfs" {
        println!(
            "note: the bundles are not on tmpfs, so runc's state writes reach the disk; containerd keeps bundles under /run (tmpfs): try --workdir on a tmpfs"
        );
    }
    Ok(())
}

/// The medians and ratios appended to `path` as `key value` lines.
fn write_results(
    path: &Path,
    lease: bool,
    med: &[Duration],
    cpu: &[Duration],
    (lo, hi): (f64, f64),
) -> Result<()> {
    let ratio = |v: &[Duration], a: usize, b: usize| v[a].as_secs_f64() / v[b].as_secs_f64();
    let mode = if lease { "lease" } else { "nolease" };
    let mut lines = String::new();
    for (key, v) in [
        ("runc_ms", ms(med[0])),
        ("runc_containerd_default_ms", ms(med[1])),
        ("runc_hardened_ms", ms(med[2])),
        ("tessera_runtime_ms", ms(med[3])),
        ("runtime_alone_ms", ms(med[4].saturating_sub(med[6]))),
        ("check_ms", ms(med[5])),
        ("runc_hardened_after_idle_ms", ms(med[7])),
        ("ratio_wall_vs_runc", ratio(med, 3, 0)),
        ("ratio_wall_vs_containerd_default", ratio(med, 3, 1)),
        ("ratio_wall_vs_hardened_runc", ratio(med, 3, 2)),
        ("ratio_wall_vs_hardened_runc_lo", lo),
        ("ratio_wall_vs_hardened_runc_hi", hi),
        ("ratio_cpu_vs_hardened_runc", ratio(cpu, 3, 2)),
        ("tessera_runtime_unkept_ms", ms(med[8])),
        ("ratio_wall_unkept_vs_hardened_runc", ratio(med, 8, 2)),
    ] {
        lines.push_str(&format!("runtime.{mode}.{key} {v}\n"));
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(lines.as_bytes()))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// A fresh directory for the bench (below `base`, or the system temp dir).
fn work_dir(base: Option<&Path>) -> Result<PathBuf> {
    let base = base.map_or_else(std::env::temp_dir, Path::to_path_buf);
    let d = base.join(format!("tessera-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).with_context(|| format!("mkdir {}", d.display()))?;
    Ok(d)
}
