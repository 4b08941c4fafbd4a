//! Helpers shared by the integration tests: start the real `tesserad` binary on the
//! simulator in a temp dir, talk to it over its unix socket.
//!
//! The binaries must be built first (`make test` runs `cargo build --bins`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

pub mod apiserver;
pub mod cri;
pub mod devnodes;
pub mod import_graph;
pub mod invariants;
pub mod python;
use tessera_proto::v1::tessera_client::TesseraClient;
use tonic::transport::Channel;

/// The async runtime the tests drive their clients on (two workers).
pub fn rt() -> tokio::runtime::Runtime {
    match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => panic!("cannot start a tokio runtime: {e}"),
    }
}

/// Path of a workspace binary next to the test executable (target/<profile>/<name>),
/// or in `$TESSERA_BIN_DIR` when set (a target directory shared by several
/// checkouts may hold another checkout's build).
pub fn bin_path(name: &str) -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("TESSERA_BIN_DIR") {
        let p = PathBuf::from(dir).join(name);
        if !p.exists() {
            bail!("{} is missing (TESSERA_BIN_DIR)", p.display());
        }
        return Ok(p);
    }
    let exe = std::env::current_exe().context("current_exe")?;
    // target/<profile>/deps/<test>-<hash>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .context("test executable has no target dir")?;
    let p = dir.join(name);
    if !p.exists() {
        bail!(
            "{} is missing: build the binaries first (`cargo build --bins`, which `make test` does)",
            p.display()
        );
    }
    Ok(p)
}

/// The GPU backend the daemons of a test run use, from `TESSERA_TEST_BACKEND`:
/// "sim" (the default) or "nvml" (the NVML backend over the fake libnvidia-ml that
/// nvml-fake/ builds). `make test` runs the hardware suites with both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sim,
    Nvml,
}

impl Backend {
    /// What GetNode reports as the backend.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Sim => "sim",
            Backend::Nvml => "nvml",
        }
    }
}

pub fn backend() -> Backend {
    match std::env::var("TESSERA_TEST_BACKEND").as_deref() {
        Ok("nvml") => Backend::Nvml,
        Ok("sim") | Ok("") | Err(_) => Backend::Sim,
        Ok(other) => panic!("TESSERA_TEST_BACKEND={other:?}: expected \"sim\" or \"nvml\""),
    }
}

/// True (after saying so) when the test needs the simulator itself, not the
/// hardware model both backends share: the caller returns.
pub fn skip_unless_sim(what: &str) -> bool {
    if backend() == Backend::Sim {
        return false;
    }
    println!("SKIPPED: {what} is the simulator's own (backend = \"nvml\" here)");
    true
}

/// The fake NVML's machine in `dir`: `libnvidia-ml.so.1` (a copy of the built
/// `libnvidia_ml.so`), its state file beside it made from the `[[sim.gpus]]` of
/// `gpus`, the driver's mig-minors table and an MPS control stand-in. Returns the
/// daemon's `[gpu]` and `[nvml]` sections.
pub fn fake_nvml_machine(dir: &Path, gpus: &str) -> anyhow::Result<String> {
    #[derive(serde::Deserialize)]
    struct Gpu {
        model: String,
        #[serde(default = "yes")]
        mig: bool,
    }
    fn yes() -> bool {
        true
    }
    #[derive(serde::Deserialize)]
    struct Sim {
        #[serde(default)]
        gpus: Vec<Gpu>,
        #[serde(default)]
        topology: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct Doc {
        sim: Sim,
    }
    let doc: Doc = toml::from_str(&format!("[sim]\n{gpus}")).context("the test's [[sim.gpus]]")?;
    let lib = dir.join("libnvidia-ml.so.1");
    std::fs::copy(fake_nvml_library()?, &lib).context("copy libnvidia_ml.so")?;
    let mut init = vec!["init".to_owned()];
    init.extend(doc.sim.topology.map(|t| format!("--board={t}")));
    for g in &doc.sim.gpus {
        init.push(if g.mig {
            format!("{}:mig", g.model)
        } else {
            g.model.clone()
        });
    }
    let refs: Vec<&str> = init.iter().map(String::as_str).collect();
    fake_nvml_ctl(dir, &refs)?;
    let minors = dir.join("mig-minors");
    fake_nvml_ctl(dir, &["minors", &minors.to_string_lossy()])?;
    let mps = dir.join("nvidia-cuda-mps-control");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../nvml-fake/nvidia-cuda-mps-control");
    std::fs::copy(&script, &mps).with_context(|| format!("copy {}", script.display()))?;
    Ok(format!(
        "[gpu]\nbackend = \"nvml\"\n\n[nvml]\nlibrary_path = {lib:?}\nmig_minors_path = {minors:?}\nmps_control = {mps:?}\n",
    ))
}

/// The built fake NVML (`libnvidia_ml.so` of nvml-fake/): in the target directory
/// (`cargo build -p nvml-fake --lib`, which `make test` runs), else the copy cargo
/// leaves in `deps/` when it built the library only for `nvml-fake-ctl`; the newer.
pub fn fake_nvml_library() -> anyhow::Result<PathBuf> {
    let ctl = bin_path("nvml-fake-ctl")?;
    let dir = ctl.parent().context("nvml-fake-ctl has no directory")?;
    let newest = [
        dir.join("libnvidia_ml.so"),
        dir.join("deps").join("libnvidia_ml.so"),
    ]
    .into_iter()
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max_by_key(|(t, _)| *t)
    .map(|(_, p)| p);
    newest.with_context(|| {
        format!(
            "libnvidia_ml.so is missing beside {}: build it first (`cargo build -p nvml-fake`, which `make test` does)",
            ctl.display()
        )
    })
}

/// The `[devices]` majors of the fake's drivers (the simulator's fixed ones).
const FAKE_MAJORS: &str = "nvidia_uvm_major = 510\nnvidia_caps_major = 511\n";

/// `nvml-fake-ctl` on the fake machine in `dir`.
pub fn fake_nvml_ctl(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(bin_path("nvml-fake-ctl")?)
        .arg("--state")
        .arg(dir.join("nvml-fake-state.json"))
        .args(args)
        .output()
        .context("run nvml-fake-ctl")?;
    if !out.status.success() {
        bail!(
            "nvml-fake-ctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The NVML calls behind each of the simulator's fault targets (its `GpuBackend`
/// methods).
fn nvml_calls_of(sim_call: &str) -> &'static [&'static str] {
    match sim_call {
        "*" => &["*"],
        "devices" => &["nvmlDeviceGetCount_v2"],
        "gi_profiles" => &["nvmlDeviceGetGpuInstanceProfileInfoV"],
        "create_instance" => &["nvmlDeviceCreateGpuInstanceWithPlacement"],
        "destroy_instance" => &["nvmlGpuInstanceDestroy"],
        "instances" => &["nvmlDeviceGetGpuInstances"],
        "processes" => &["nvmlDeviceGetComputeRunningProcesses_v3"],
        "utilization" => &["nvmlDeviceGetUtilizationRates"],
        "health_poll" => &["nvmlDeviceGetRemappedRows"],
        "topology" => &["nvmlDeviceGetTopologyCommonAncestor"],
        other => {
            panic!("the fake NVML has no call behind the simulator's {other:?} (not an NVML call)")
        }
    }
}

/// "start" or "stop" for a `tesserad sim fault` on an MPS call.
fn mps_fault_target(args: &[&str]) -> Option<&'static str> {
    if args.first() != Some(&"fault") {
        return None;
    }
    let call = args
        .iter()
        .position(|a| *a == "--call")
        .and_then(|i| args.get(i + 1))?;
    match *call {
        "mps_start" => Some("start"),
        "mps_stop" => Some("stop"),
        _ => None,
    }
}

/// `tesserad sim ARGS` as `nvml-fake-ctl` commands.
fn fake_nvml_commands(args: &[&str]) -> Vec<Vec<String>> {
    let flag = |name: &str| {
        args.iter()
            .position(|a| *a == name)
            .and_then(|i| args.get(i + 1))
            .map(|v| (*v).to_owned())
    };
    let gpu = || flag("--gpu").unwrap_or_else(|| panic!("tesserad sim {args:?}: no --gpu"));
    let cmd = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<String>>();
    match args.first().copied() {
        Some("xid") => {
            let mut c = cmd(&["xid"]);
            c.push(gpu());
            c.push(flag("--xid").unwrap_or_else(|| panic!("no --xid")));
            c.extend(flag("--gi"));
            vec![c]
        }
        Some("ecc") => vec![vec!["ecc".into(), gpu()]],
        Some("lose") => vec![vec!["lose".into(), gpu()]],
        Some("pending-retirement") => vec![vec!["rows".into(), gpu(), "pending".into()]],
        Some("recover") => vec![
            vec!["restore".into(), gpu()],
            vec!["rows".into(), gpu(), "ok".into()],
        ],
        Some("clear-faults") => vec![cmd(&["clear-faults"])],
        Some("show") => vec![cmd(&["show"])],
        Some("fault") => {
            let call = flag("--call").unwrap_or_else(|| panic!("no --call"));
            let rate: f64 = flag("--fail-rate").map_or(1.0, |r| r.parse().unwrap_or(1.0));
            let delay = flag("--delay-ms").unwrap_or_else(|| "0".into());
            assert!(
                rate == 0.0 || rate == 1.0,
                "the fake NVML fails a call always or never (fail rate {rate})"
            );
            nvml_calls_of(&call)
                .iter()
                .flat_map(|c| {
                    let mut out = Vec::new();
                    if delay != "0" {
                        out.push(vec!["hang".into(), (*c).to_owned(), delay.clone()]);
                    }
                    if rate == 1.0 {
                        out.push(vec!["fail".into(), (*c).to_owned(), "999".into()]);
                    }
                    out
                })
                .collect()
        }
        _ => panic!("tesserad sim {args:?}: no fake NVML equivalent"),
    }
}

/// Connect a client to a unix socket.
pub async fn connect(socket: &Path) -> anyhow::Result<TesseraClient<Channel>> {
    Ok(TesseraClient::new(channel(socket).await?))
}

/// A gRPC channel (one HTTP/2 connection) to a unix socket.
pub async fn channel(socket: &Path) -> anyhow::Result<Channel> {
    Ok(tessera_common::unix::channel(socket).await?)
}

/// A `tesserad` process on simulated GPUs in its own temp dir.
pub struct TestDaemon {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub socket: PathBuf,
    child: Option<Child>,
}

/// Two H100-80GB with MIG and one A100-40GB without: the `make run` node.
pub const DEV_GPUS: &str = r#"
[[sim.gpus]]
model = "h100-80gb"
mig = true

[[sim.gpus]]
model = "h100-80gb"
mig = true

[[sim.gpus]]
model = "a100-40gb"
mig = false
"#;

impl TestDaemon {
    /// Start a daemon with `DEV_GPUS` plus `extra` TOML (sections other than
    /// [daemon], [sim] state).
    pub fn start(extra: &str) -> anyhow::Result<TestDaemon> {
        Self::start_with(DEV_GPUS, extra)
    }

    pub fn start_with(gpus: &str, extra: &str) -> anyhow::Result<TestDaemon> {
        let mut d = Self::configure(gpus, extra)?;
        d.spawn()?;
        Ok(d)
    }

    /// The temp dir and config of [`TestDaemon::start_with`], without starting the
    /// process (to prepare its state directory first; then [`TestDaemon::spawn`]).
    ///
    /// With `TESSERA_TEST_BACKEND=nvml` ([`backend`]) the daemon runs the NVML backend
    /// over the fake libnvidia-ml (nvml-fake/) with the same GPUs: the `[sim]`
    /// section stays (unused by the daemon) and the fake's machine is made from it.
    pub fn configure(gpus: &str, extra: &str) -> anyhow::Result<TestDaemon> {
        let dir = tempfile::Builder::new().prefix("tesserad-it").tempdir()?;
        let socket = dir.path().join("tesserad.sock");
        let config = dir.path().join("tesserad.toml");
        let gpu_section = match backend() {
            Backend::Sim => "[gpu]\nbackend = \"sim\"\n".to_owned(),
            Backend::Nvml => fake_nvml_machine(dir.path(), gpus)?,
        };
        // No kernel registered the fake's drivers: their majors are configured, as
        // the simulator's fixed ones.
        let extra = match backend() {
            Backend::Sim => extra.to_owned(),
            Backend::Nvml if extra.contains("[devices]\n") => {
                extra.replacen("[devices]\n", &format!("[devices]\n{FAKE_MAJORS}"), 1)
            }
            Backend::Nvml => format!("{extra}\n[devices]\n{FAKE_MAJORS}"),
        };
        // A test daemon writes no CDI spec unless its test asks: `[cdi]` is on by
        // default where /var/run/cdi exists, and a test daemon's start would bring
        // that (the host's) directory in line with its own leases.
        let cdi_off = if extra.contains("[cdi]") {
            ""
        } else {
            "[cdi]\nenabled = false\n"
        };
        let text = format!(
            "[daemon]\nsocket = {:?}\nstate_dir = {:?}\nrun_dir = {:?}\nshutdown_grace = \"3s\"\n\n{gpu_section}\n[sim]\nstate_file = {:?}\n{gpus}\n{extra}\n{cdi_off}",
            socket,
            dir.path().join("state"),
            dir.path().join("run"),
            dir.path().join("sim-gpus.json"),
        );
        std::fs::write(&config, text)?;
        Ok(TestDaemon {
            dir,
            config,
            socket,
            child: None,
        })
    }

    /// The daemon's state directory (`<dir>/state`).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("tesserad.log")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn sim_state(&self) -> PathBuf {
        self.dir.path().join("sim-gpus.json")
    }

    /// Start the process and wait until its socket answers.
    pub fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = Command::new(bin_path("tesserad")?)
            .arg("--config")
            .arg(&self.config)
            .env("TESSERA_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawn tesserad")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(c) = self.child.as_mut()
                && let Some(status) = c.try_wait()?
            {
                bail!("tesserad exited with {status} at start:\n{}", self.log());
            }
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("tesserad did not open its socket in 30s:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL (a crash) and reap.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// SIGTERM and wait for a clean exit; returns the exit status code.
    pub fn stop(&mut self) -> anyhow::Result<Option<i32>> {
        let Some(mut c) = self.child.take() else {
            return Ok(None);
        };
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = c.try_wait()? {
                return Ok(s.code());
            }
            if Instant::now() > deadline {
                c.kill()?;
                bail!("tesserad did not stop within 20s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub async fn client(&self) -> anyhow::Result<TesseraClient<Channel>> {
        connect(&self.socket).await
    }

    /// `tesserad --config <this daemon's> sim ARGS`: the simulated hardware's side
    /// (health events, faults) for the running daemon. Panics when it fails. Over
    /// the fake NVML the same misfortune is played through `nvml-fake-ctl`.
    pub fn sim(&self, args: &[&str]) {
        if backend() == Backend::Nvml {
            let dir = self.dir.path();
            // MPS is no NVML call: its faults go to the control stand-in.
            if args.first() == Some(&"clear-faults") {
                for which in ["start", "stop"] {
                    let _ = std::fs::remove_file(dir.join(format!("mps-fault-{which}")));
                }
            }
            if let Some(which) = mps_fault_target(args) {
                let flag = |name: &str| {
                    args.iter()
                        .position(|a| *a == name)
                        .and_then(|i| args.get(i + 1))
                        .copied()
                };
                let fail = flag("--fail-rate").is_none_or(|r| r != "0");
                let delay = flag("--delay-ms").unwrap_or("0");
                std::fs::write(
                    dir.join(format!("mps-fault-{which}")),
                    format!("{delay} {}\n", u8::from(fail)),
                )
                .unwrap_or_else(|e| panic!("mps fault: {e}"));
                return;
            }
            for cmd in fake_nvml_commands(args) {
                let refs: Vec<&str> = cmd.iter().map(String::as_str).collect();
                fake_nvml_ctl(dir, &refs).unwrap_or_else(|e| panic!("{e}"));
            }
            return;
        }
        let out = Command::new(bin_path("tesserad").unwrap_or_else(|e| panic!("{e}")))
            .arg("--config")
            .arg(&self.config)
            .arg("sim")
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("tesserad sim: {e}"));
        assert!(
            out.status.success(),
            "tesserad sim {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `tessera --socket <this daemon's> ARGS`: whether it succeeded, and its stdout
    /// and stderr together.
    pub fn cli(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(bin_path("tessera").unwrap_or_else(|e| panic!("{e}")))
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("tessera: {e}"));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// The Prometheus endpoint's address (`[metrics] listen = "127.0.0.1:0"`), from
    /// the daemon's log line; waits up to 10 s for it.
    pub fn metrics_addr(&self) -> anyhow::Result<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = strip_ansi(&self.log())
                .lines()
                .find(|l| l.contains("serving Prometheus metrics"))
                .and_then(|l| l.split("addr=").nth(1))
                .and_then(|s| s.split_whitespace().next())
                .map(str::to_string);
            if let Some(a) = found {
                return Ok(a);
            }
            if Instant::now() > deadline {
                bail!("no metrics address in the log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

/// Text without the terminal colour codes of the daemon's log.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Shape helpers.
pub mod shape {
    use tessera_proto::v1 as pb;

    pub fn mig(profile: &str) -> pb::Shape {
        migs(profile, 0)
    }

    /// `count` MIG instances of `profile` in one lease (0: one, as older clients).
    pub fn migs(profile: &str, count: u32) -> pb::Shape {
        pb::Shape {
            kind: Some(pb::shape::Kind::Mig(pb::MigShape {
                profile: profile.into(),
                compute_profile: String::new(),
                count,
            })),
        }
    }

    pub fn mps(sm_percent: u32, memory_gib: u64) -> pb::Shape {
        pb::Shape {
            kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent,
                memory_bytes: memory_gib << 30,
                ..Default::default()
            })),
        }
    }

    pub fn whole() -> pb::Shape {
        wholes(0)
    }

    /// `count` whole GPUs in one lease (0: one, as older clients).
    pub fn wholes(count: u32) -> pb::Shape {
        pb::Shape {
            kind: Some(pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count })),
        }
    }
}

/// GetLease of `id`, which must answer with the lease (a test's own lease).
#[allow(clippy::unwrap_used)]
pub async fn lease_of(c: &mut TesseraClient<Channel>, id: &str) -> tessera_proto::v1::Lease {
    c.get_lease(tessera_proto::v1::GetLeaseRequest {
        lease_id: id.to_string(),
    })
    .await
    .unwrap()
    .into_inner()
    .lease
    .unwrap()
}

/// A CreateLease request for `tenant` with `shape`.
pub fn create_req(
    tenant: &str,
    shape: tessera_proto::v1::Shape,
) -> tessera_proto::v1::CreateLeaseRequest {
    tessera_proto::v1::CreateLeaseRequest {
        tenant: tenant.into(),
        shape: Some(shape),
        ..Default::default()
    }
}

/// Resident set size of a process in bytes (VmRSS in /proc/<pid>/status), None when
/// the process or the field is gone.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

impl TestDaemon {
    /// The daemon's resident set size in bytes.
    pub fn rss(&self) -> Option<u64> {
        self.pid().and_then(rss_bytes)
    }
}

pub mod validation;
