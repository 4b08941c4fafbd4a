//! The runtime helper: `tessera-runtime serve` keeps one process running that admits
//! `create` and `run` for every later `tessera-runtime` of the same binary and config.
//!
//! A start through the runtime is a new process each time: it parses its config, builds
//! an RPC client, connects to the daemon and judges the spec, all in code and memory
//! touched for the first time, and runc follows it on the same CPUs. The helper does the
//! same work with everything already warm: the config parsed, a connection to the
//! daemon open, the policy code paged in. A start that finds a helper sends it its
//! arguments and gets back what it would have decided itself: exec runc (with this
//! argv) or exit with a code, and the lines for its stderr. It runs the very same
//! function (`app::create`) as a start without a helper; only the process differs.
//!
//! Nothing here weakens a start: the helper is asked only when it can decide exactly
//! as the caller would, and it says so before it acts.
//!
//! - Only root (or the helper's own user) may ask, and the caller trusts only a helper
//!   run by root or itself (`SO_PEERCRED` both ways); the socket is 0600.
//! - The caller must run the same binary (device and inode of `/proc/self/exe`), with
//!   the same config file, in the same namespaces (mount, pid, net, ipc, uts, user,
//!   cgroup), and name its bundle, runc root and log by absolute paths. Otherwise the
//!   helper answers "not served" and the caller admits the start itself.
//! - "Not served" is the only answer after which a caller decides by itself: the helper
//!   has done nothing. A helper that took a start and then gave no answer (it died, or
//!   its answer is unreadable, or late) refuses the start: it may have acted.
//! - No helper at the socket (none configured, none running) costs a start one failed
//!   `connect`.
//! - A config that changed is read again before the next start; a binary that was
//!   replaced makes the helper stop once it has answered (systemd starts the new one).

use crate::app::{self, Env, Outcome, Stderr};
use crate::cli::{self, Command, Invocation};
use crate::config::{ConfigError, RuntimeConfig};
use crate::host::StableFacts;
use crate::lease::DaemonClient;
use crate::runclog::RuncLog;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;

/// The request and reply format; a helper answers "not served" to another.
pub const PROTOCOL: u32 = 1;
/// The largest request or reply (argv, stderr lines).
const MAX_FRAME: u32 = 1 << 20;
/// How long the helper waits for a request, and for its reply to be taken.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a stopping helper lets the starts it took finish.
const DRAIN: Duration = Duration::from_secs(10);
/// How long the helper keeps AppArmor's state and the GPU majors (`StableFacts`).
const STABLE_FACTS_AGE: Duration = Duration::from_secs(1);
/// The namespaces a caller must share with the helper.
const NAMESPACES: [&str; 7] = ["mnt", "pid", "net", "ipc", "uts", "user", "cgroup"];

/// Errors of the helper and of the exchange with it.
#[derive(Debug, Error)]
pub enum HelperError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("helper_socket is empty in {0}: no helper is configured")]
    NoSocket(PathBuf),
    #[error("another helper already serves {0}")]
    Busy(PathBuf),
    #[error("{0} is there and is not a socket")]
    NotASocket(PathBuf),
    #[error("the helper's config must be named by an absolute path, got {0}")]
    RelativeConfig(PathBuf),
    #[error("the message is not usable: {0}")]
    Frame(String),
    #[error("waiting for signals: {0}")]
    Signals(nix::Error),
}

/// A file's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

impl FileId {
    fn of(path: &Path) -> std::io::Result<Self> {
        let m = std::fs::metadata(path)?;
        Ok(Self {
            dev: m.dev(),
            ino: m.ino(),
        })
    }
}

/// What a start sends.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    pub protocol: u32,
    /// The caller's binary (`/proc/self/exe`).
    pub exe: FileId,
    /// The config file the caller found (absolute).
    pub config: PathBuf,
    /// Its arguments after the program name.
    pub args: Vec<String>,
}

/// What the helper answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Reply {
    /// The helper did nothing; the caller decides by itself. Why, for runc's log.
    NotServed(String),
    /// The start decided: what the caller must do, and the lines for its stderr.
    Served { stderr: String, outcome: Outcome },
}

fn write_frame<T: Serialize>(mut w: impl Write, msg: &T) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|n| *n <= MAX_FRAME)
        .ok_or_else(|| std::io::Error::other("message too large"))?;
    let mut buf = Vec::with_capacity(body.len() + 4);
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)
}

/// Why a message could not be read.
#[derive(Debug, Error)]
enum FrameError {
    #[error("the connection closed before a message")]
    Closed,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("a message of {0} bytes (at most {MAX_FRAME})")]
    TooLarge(u32),
    #[error("{0}")]
    Json(#[from] serde_json::Error),
}

fn read_frame<T: for<'de> Deserialize<'de>>(mut r: impl Read) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    let first = r.read(&mut len)?;
    if first == 0 {
        return Err(FrameError::Closed);
    }
    r.read_exact(&mut len[first..])?;
    let len = u32::from_be_bytes(len);
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    Ok(serde_json::from_slice(&body)?)
}

/// Why this invocation cannot be taken by a helper, if it cannot: only `create` and
/// `run` with absolute paths for what the runtime itself reads or writes (the helper
/// runs in another working directory).
fn not_servable(inv: &Invocation) -> Option<String> {
    let Some((cmd, sub)) = &inv.command else {
        return Some("no subcommand".to_string());
    };
    if !matches!(cmd, Command::Create | Command::Run) {
        return Some(format!("{} is not a start", cmd.name()));
    }
    let absolute = |p: Option<&str>| p.is_none_or(|p| Path::new(p).is_absolute());
    match sub.value("bundle") {
        Some(b) if Path::new(b).is_absolute() => {}
        _ => return Some("the bundle is not named by an absolute path".to_string()),
    }
    if !absolute(inv.global.root.as_deref()) || !absolute(inv.global.log.as_deref()) {
        return Some("--root or --log is a relative path".to_string());
    }
    None
}

/// Ask the helper configured for `env` to take this start (`config`: the file `env`'s
/// config came from). `None`: no helper took it, and the caller admits it itself;
/// `Some`: what the caller must do.
pub(crate) fn ask(env: &Env, config: &Path) -> Option<Outcome> {
    let socket = &env.cfg.helper_socket;
    if socket.as_os_str().is_empty() || !config.is_absolute() || not_servable(&env.inv).is_some() {
        return None;
    }
    let exe = FileId::of(Path::new("/proc/self/exe")).ok()?;
    // No helper there (none configured, none running): the start admits itself.
    let stream = UnixStream::connect(socket).ok()?;
    let euid = nix::unistd::geteuid().as_raw();
    match nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials) {
        Ok(c) if c.uid() == 0 || c.uid() == euid => {}
        Ok(c) => {
            env.log.warn(&format!(
                "tessera-runtime: {} is served by uid {}, not root: not asked",
                socket.display(),
                c.uid()
            ));
            return None;
        }
        Err(_) => return None,
    }
    let wait = Duration::from_millis(env.cfg.daemon_timeout_ms.saturating_mul(3))
        .saturating_add(IO_TIMEOUT);
    if stream.set_write_timeout(Some(IO_TIMEOUT)).is_err()
        || stream.set_read_timeout(Some(wait)).is_err()
    {
        return None;
    }
    let req = Request {
        protocol: PROTOCOL,
        exe,
        config: config.to_path_buf(),
        args: env.inv.argv.clone(),
    };
    // A request the helper did not get whole is one it did not act on.
    write_frame(&stream, &req).ok()?;
    let what = env.inv.command.as_ref().map_or_else(String::new, |(c, s)| {
        format!("{} {}", c.name(), s.first_positional().unwrap_or_default())
    });
    let reply = match read_frame::<Reply>(&stream) {
        Ok(r) => r,
        Err(e) => {
            return Some(env.refuse(
                &what,
                &[format!(
                    "the runtime helper at {} took the start and gave no answer ({e}); it may have bound the container, so the start is refused",
                    socket.display()
                )],
            ));
        }
    };
    match reply {
        Reply::NotServed(why) => {
            env.log.info(&format!(
                "tessera-runtime: the runtime helper did not take this start ({why}); deciding it here"
            ));
            None
        }
        Reply::Served { stderr, outcome } => {
            if !stderr.is_empty() {
                eprint!("{stderr}");
            }
            match outcome {
                Outcome::Exec(mut plan) => {
                    if plan.program != env.cfg.runc_path {
                        return Some(env.refuse(
                            &what,
                            &[format!(
                                "the runtime helper planned to exec {}, not the configured runc {}",
                                plan.program.display(),
                                env.cfg.runc_path.display()
                            )],
                        ));
                    }
                    // runc's environment comes from this process, as without a helper.
                    plan.env = app::exec_env(&env.cfg);
                    Some(Outcome::Exec(plan))
                }
                exit => Some(exit),
            }
        }
    }
}

/// The config as last read, and the file's identity then (`None`: the default path,
/// missing, gave the defaults).
struct LoadedConfig {
    cfg: Arc<RuntimeConfig>,
    id: Option<(u64, u64, u64, i64, i64)>,
}

fn config_id(path: &Path) -> Option<(u64, u64, u64, i64, i64)> {
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

/// What every worker shares.
struct Shared {
    config_path: PathBuf,
    explicit: bool,
    config: Mutex<LoadedConfig>,
    exe: FileId,
    exe_path: Option<PathBuf>,
    namespaces: Vec<(&'static str, FileId)>,
    socket: PathBuf,
    stopping: AtomicBool,
    busy: AtomicUsize,
    stable_facts: Arc<StableFacts>,
}

impl Shared {
    /// The config, read again first when its file changed since.
    fn config(&self) -> Result<Arc<RuntimeConfig>, ConfigError> {
        let id = config_id(&self.config_path);
        let mut loaded = self
            .config
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if loaded.id != id {
            let cfg = RuntimeConfig::load(&self.config_path, self.explicit)?;
            eprintln!(
                "tessera-runtime serve: {} changed; read again",
                self.config_path.display()
            );
            *loaded = LoadedConfig {
                cfg: Arc::new(cfg),
                id,
            };
        }
        Ok(Arc::clone(&loaded.cfg))
    }

    /// Whether the binary this helper was started from has been replaced on disk.
    fn replaced(&self) -> bool {
        self.exe_path
            .as_deref()
            .is_some_and(|p| FileId::of(p).map_or(true, |id| id != self.exe))
    }

    /// Why the caller on `stream` may not be served by this helper, if so.
    fn refuse_caller(&self, stream: &UnixStream, req: &Request) -> Option<String> {
        if req.protocol != PROTOCOL {
            return Some(format!(
                "the caller speaks protocol {}, the helper {PROTOCOL}",
                req.protocol
            ));
        }
        let cred = match nix::sys::socket::getsockopt(
            stream,
            nix::sys::socket::sockopt::PeerCredentials,
        ) {
            Ok(c) => c,
            Err(e) => return Some(format!("the caller's credentials: {e}")),
        };
        let euid = nix::unistd::geteuid().as_raw();
        if cred.uid() != 0 && cred.uid() != euid {
            return Some(format!("the caller is uid {}, not root", cred.uid()));
        }
        if req.exe != self.exe {
            if self.replaced() {
                self.stop();
                return Some("the helper's binary was replaced; it stops".to_string());
            }
            return Some("the caller runs another tessera-runtime binary".to_string());
        }
        if req.config != self.config_path {
            return Some(format!(
                "the caller's config is {}, the helper's {}",
                req.config.display(),
                self.config_path.display()
            ));
        }
        for (ty, own) in &self.namespaces {
            let theirs = FileId::of(Path::new(&format!("/proc/{}/ns/{ty}", cred.pid())));
            if theirs.ok() != Some(*own) {
                return Some(format!("the caller is not in the helper's {ty} namespace"));
            }
        }
        None
    }

    /// Stop taking starts: the socket goes (later starts decide by themselves), and
    /// the main thread is woken to drain and exit.
    fn stop(&self) {
        if !self.stopping.swap(true, Ordering::SeqCst) {
            let _ = std::fs::remove_file(&self.socket);
            let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::SIGTERM);
        }
    }
}

/// A worker's daemon client, kept across starts while the config names the same socket.
struct WorkerClient {
    socket: PathBuf,
    timeout_ms: u64,
    client: DaemonClient,
}

fn worker_client<'a>(
    slot: &'a mut Option<WorkerClient>,
    cfg: &RuntimeConfig,
    log: &RuncLog,
) -> Option<&'a DaemonClient> {
    // As without a helper: no socket there, no client.
    if !cfg.daemon_socket.exists() {
        return None;
    }
    let same = slot
        .as_ref()
        .is_some_and(|w| w.socket == cfg.daemon_socket && w.timeout_ms == cfg.daemon_timeout_ms);
    if !same {
        match DaemonClient::new(
            &cfg.daemon_socket,
            Duration::from_millis(cfg.daemon_timeout_ms),
        ) {
            Ok(client) => {
                *slot = Some(WorkerClient {
                    socket: cfg.daemon_socket.clone(),
                    timeout_ms: cfg.daemon_timeout_ms,
                    client,
                });
            }
            Err(e) => {
                log.warn(&format!("tessera-runtime: {e}"));
                *slot = None;
            }
        }
    }
    slot.as_ref().map(|w| &w.client)
}

/// Take one start from `stream`: read it, decide whether it may be served, run it,
/// answer. Returns a line for the helper's own log.
fn take(shared: &Shared, stream: &UnixStream, slot: &mut Option<WorkerClient>) -> String {
    let started = Instant::now();
    let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let req: Request = match read_frame(stream) {
        Ok(r) => r,
        // A connection closed before a byte came is a probe (is anyone there?).
        Err(FrameError::Closed) => return String::new(),
        Err(e) => return format!("a request that could not be read: {e}"),
    };
    let (reply, line) = match serve_one(shared, stream, req, slot) {
        Ok((what, stderr, outcome)) => {
            let result = match &outcome {
                Outcome::Exec(_) => "admitted".to_string(),
                Outcome::Exit(code) => format!("refused (exit {code})"),
            };
            let line = format!(
                "{what}: {result} in {:.2} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
            (Reply::Served { stderr, outcome }, line)
        }
        Err(why) => (Reply::NotServed(why.clone()), format!("not served: {why}")),
    };
    match write_frame(stream, &reply) {
        Ok(()) => line,
        Err(e) => format!("{line}; the answer was not taken: {e}"),
    }
}

/// Decide one start, or say why this helper may not.
fn serve_one(
    shared: &Shared,
    stream: &UnixStream,
    req: Request,
    slot: &mut Option<WorkerClient>,
) -> Result<(String, String, Outcome), String> {
    if shared.stopping.load(Ordering::SeqCst) {
        return Err("the helper is stopping".to_string());
    }
    if let Some(why) = shared.refuse_caller(stream, &req) {
        return Err(why);
    }
    let cfg = shared
        .config()
        .map_err(|e| format!("the helper cannot read its config: {e}"))?;
    let inv = cli::parse_strings(req.args).map_err(|e| e.to_string())?;
    if let Some(why) = not_servable(&inv) {
        return Err(why);
    }
    let Some((cmd, sub)) = inv.command.clone() else {
        return Err("no subcommand".to_string());
    };
    let log = RuncLog::new(inv.global.log.as_deref(), inv.global.log_format.as_deref());
    let what = format!(
        "{} {}",
        cmd.name(),
        sub.first_positional().unwrap_or_default()
    );
    let env = Env {
        inv,
        cfg: Arc::clone(&cfg),
        log,
        stderr: Stderr::Buffer(std::cell::RefCell::new(String::new())),
        stable_facts: Some(Arc::clone(&shared.stable_facts)),
    };
    let client = worker_client(slot, &cfg, &env.log);
    let outcome = app::create(&env, cmd, &sub, client);
    let stderr = match env.stderr {
        Stderr::Buffer(b) => b.into_inner(),
        Stderr::Process => String::new(),
    };
    Ok((what, stderr, outcome))
}

fn worker(shared: Arc<Shared>, listener: Arc<UnixListener>) {
    let mut slot: Option<WorkerClient> = None;
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                eprintln!("tessera-runtime serve: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        shared.busy.fetch_add(1, Ordering::SeqCst);
        let line = take(&shared, &stream, &mut slot);
        drop(stream);
        shared.busy.fetch_sub(1, Ordering::SeqCst);
        if !line.is_empty() {
            eprintln!("tessera-runtime serve: {line}");
        }
    }
}

/// Make the socket: its directory if missing, a stale socket (nobody answers)
/// replaced, a live one left alone.
fn listen(socket: &Path) -> Result<UnixListener, HelperError> {
    let io = |source| HelperError::Io {
        path: socket.to_path_buf(),
        source,
    };
    if let Some(dir) = socket.parent() {
        // Root's alone when it is made here (tmpfiles makes /run/tessera-runtime so).
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| HelperError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
    }
    match std::fs::symlink_metadata(socket) {
        Ok(m) if !m.file_type().is_socket() => {
            return Err(HelperError::NotASocket(socket.to_path_buf()));
        }
        Ok(_) => {
            if UnixStream::connect(socket).is_ok() {
                return Err(HelperError::Busy(socket.to_path_buf()));
            }
            std::fs::remove_file(socket).map_err(io)?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let listener = UnixListener::bind(socket).map_err(io)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    Ok(listener)
}

/// `tessera-runtime serve`: take starts until SIGTERM, SIGINT or SIGHUP (or until the
/// binary is replaced), then let the starts under way finish and remove the socket.
pub fn serve(argv0: Option<&Path>) -> Result<(), HelperError> {
    use nix::sys::signal::{SigSet, Signal};
    let (cfg, found) = RuntimeConfig::load_discovered(argv0)?;
    let config_path = if found.path.is_absolute() {
        found.path.clone()
    } else {
        return Err(HelperError::RelativeConfig(found.path));
    };
    if cfg.helper_socket.as_os_str().is_empty() {
        return Err(HelperError::NoSocket(config_path));
    }
    let exe = FileId::of(Path::new("/proc/self/exe")).map_err(|source| HelperError::Io {
        path: PathBuf::from("/proc/self/exe"),
        source,
    })?;
    let mut namespaces = Vec::with_capacity(NAMESPACES.len());
    for ty in NAMESPACES {
        let path = PathBuf::from(format!("/proc/self/ns/{ty}"));
        let id = FileId::of(&path).map_err(|source| HelperError::Io { path, source })?;
        namespaces.push((ty, id));
    }
    // Every thread made from here on leaves these signals to the main thread's wait.
    let mut signals = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        signals.add(s);
    }
    signals.thread_block().map_err(HelperError::Signals)?;
    let socket = cfg.helper_socket.clone();
    let listener = Arc::new(listen(&socket)?);
    let workers = cfg.helper_workers;
    let shared = Arc::new(Shared {
        config_path,
        explicit: found.explicit,
        config: Mutex::new(LoadedConfig {
            id: config_id(&found.path),
            cfg: Arc::new(cfg),
        }),
        exe,
        exe_path: std::env::current_exe().ok(),
        namespaces,
        socket: socket.clone(),
        stopping: AtomicBool::new(false),
        busy: AtomicUsize::new(0),
        stable_facts: Arc::new(StableFacts::new(STABLE_FACTS_AGE)),
    });
    for i in 0..workers {
        let (s, l) = (Arc::clone(&shared), Arc::clone(&listener));
        std::thread::Builder::new()
            .name(format!("helper-{i}"))
            .spawn(move || worker(s, l))
            .map_err(|source| HelperError::Io {
                path: socket.clone(),
                source,
            })?;
    }
    eprintln!(
        "tessera-runtime serve: taking starts on {} for {} ({workers} at once)",
        socket.display(),
        shared.config_path.display()
    );
    let sig = signals.wait().map_err(HelperError::Signals)?;
    shared.stopping.store(true, Ordering::SeqCst);
    let _ = std::fs::remove_file(&socket);
    let deadline = Instant::now() + DRAIN;
    while shared.busy.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!("tessera-runtime serve: stopped ({sig:?})");
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn inv(args: &[&str]) -> Invocation {
        cli::parse_strings(args.iter().map(ToString::to_string).collect()).unwrap()
    }

    #[test]
    fn only_starts_with_absolute_paths_are_taken() {
        assert_eq!(
            not_servable(&inv(&["create", "--bundle", "/b", "c1"])),
            None
        );
        assert_eq!(
            not_servable(&inv(&[
                "--root", "/run/r", "--log", "/l.json", "run", "-b", "/b", "c1"
            ])),
            None
        );
        for args in [
            &["create", "c1"][..],
            &["create", "--bundle", "b", "c1"],
            &["--root", "r", "create", "--bundle", "/b", "c1"],
            &["--log", "l.json", "run", "--bundle", "/b", "c1"],
            &["delete", "c1"],
            &["exec", "c1", "true"],
            &["state", "c1"],
        ] {
            assert!(not_servable(&inv(args)).is_some(), "{args:?}");
        }
    }

    #[test]
    fn frames_round_trip_and_say_why_they_fail() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &Reply::NotServed("why".into())).unwrap();
        match read_frame::<Reply>(&buf[..]).unwrap() {
            Reply::NotServed(w) => assert_eq!(w, "why"),
            r @ Reply::Served { .. } => panic!("{r:?}"),
        }
        assert!(matches!(
            read_frame::<Reply>(&[][..]),
            Err(FrameError::Closed)
        ));
        assert!(matches!(
            read_frame::<Reply>(&(MAX_FRAME + 1).to_be_bytes()[..]),
            Err(FrameError::TooLarge(_))
        ));
        // Cut short: an IO error, not "closed".
        assert!(matches!(
            read_frame::<Reply>(&buf[..buf.len() - 1]),
            Err(FrameError::Io(_))
        ));
    }

    /// An Env for `create --bundle /b c1` whose helper socket is `socket`.
    fn env_for(socket: &Path) -> Env {
        let cfg = RuntimeConfig {
            helper_socket: socket.to_path_buf(),
            ..RuntimeConfig::default()
        };
        Env {
            inv: inv(&["create", "--bundle", "/b", "c1"]),
            cfg: Arc::new(cfg),
            log: RuncLog::new(None, None),
            stderr: Stderr::Buffer(std::cell::RefCell::new(String::new())),
            stable_facts: None,
        }
    }

    /// A one-shot helper on `socket`: reads one request, then answers what `reply`
    /// gives (nothing when `None`). Returns the request it read.
    fn fake_helper(socket: &Path, reply: Option<Reply>) -> std::thread::JoinHandle<Request> {
        let l = UnixListener::bind(socket).unwrap();
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let req: Request = read_frame(&s).unwrap();
            if let Some(r) = reply {
                write_frame(&s, &r).unwrap();
            }
            req
        })
    }

    fn stderr_of(env: &Env) -> String {
        match &env.stderr {
            Stderr::Buffer(b) => b.borrow().clone(),
            Stderr::Process => String::new(),
        }
    }

    #[test]
    fn no_helper_or_not_served_leaves_the_start_to_decide_by_itself() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("helper.sock");
        let config = Path::new("/etc/tessera/runtime.toml");
        // Nobody there.
        assert_eq!(ask(&env_for(&socket), config), None);
        // Turned off.
        assert_eq!(ask(&env_for(Path::new("")), config), None);
        // A helper that says "not served".
        let h = fake_helper(&socket, Some(Reply::NotServed("another config".into())));
        assert_eq!(ask(&env_for(&socket), config), None);
        let req = h.join().unwrap();
        assert_eq!(req.protocol, PROTOCOL);
        assert_eq!(req.config, config);
        assert_eq!(req.args, ["create", "--bundle", "/b", "c1"]);
        assert_eq!(req.exe, FileId::of(Path::new("/proc/self/exe")).unwrap());
    }

    #[test]
    fn a_helper_that_took_the_start_and_gave_no_answer_refuses_it() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("helper.sock");
        let h = fake_helper(&socket, None);
        let env = env_for(&socket);
        let out = ask(&env, Path::new("/etc/tessera/runtime.toml"));
        h.join().unwrap();
        assert_eq!(out, Some(Outcome::Exit(app::EXIT_REFUSED)));
        let said = stderr_of(&env);
        assert!(said.contains("took the start and gave no answer"), "{said}");
    }

    #[test]
    fn a_helper_s_plan_must_exec_the_configured_runc_with_this_process_s_environment() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("helper.sock");
        let plan = |program: &str| app::ExecPlan {
            program: PathBuf::from(program),
            args: vec!["create".into(), "--bundle".into(), "/b".into(), "c1".into()],
            env: vec![("FROM_THE_HELPER".into(), "1".into())],
            keep_fds_through: 2,
            stdin: None,
        };
        // Another program than runc_path: refused.
        let h = fake_helper(
            &socket,
            Some(Reply::Served {
                stderr: String::new(),
                outcome: Outcome::Exec(plan("/tmp/evil")),
            }),
        );
        let env = env_for(&socket);
        let out = ask(&env, Path::new("/etc/tessera/runtime.toml"));
        h.join().unwrap();
        assert_eq!(out, Some(Outcome::Exit(app::EXIT_REFUSED)));
        assert!(stderr_of(&env).contains("not the configured runc"));
        // The configured runc: taken, with this process's environment for runc.
        std::fs::remove_file(&socket).unwrap();
        let runc = RuntimeConfig::default().runc_path;
        let h = fake_helper(
            &socket,
            Some(Reply::Served {
                stderr: String::new(),
                outcome: Outcome::Exec(plan(runc.to_str().unwrap())),
            }),
        );
        let env = env_for(&socket);
        let Some(Outcome::Exec(p)) = ask(&env, Path::new("/etc/tessera/runtime.toml")) else {
            panic!("not an exec plan");
        };
        h.join().unwrap();
        assert_eq!(p.program, runc);
        assert_eq!(p.env, app::exec_env(&env.cfg));
        // A refusal's lines come back for this process's stderr (printed by ask).
        std::fs::remove_file(&socket).unwrap();
        let h = fake_helper(
            &socket,
            Some(Reply::Served {
                stderr: "tessera-runtime: refused\n".into(),
                outcome: Outcome::Exit(1),
            }),
        );
        let out = ask(&env_for(&socket), Path::new("/etc/tessera/runtime.toml"));
        h.join().unwrap();
        assert_eq!(out, Some(Outcome::Exit(1)));
    }
}
