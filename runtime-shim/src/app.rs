//! The runtime's flow for each runc subcommand: validate first, then act, then exec the
//! real runtime. Returns what `main` must do (exec runc, or exit with a code).

use crate::bundle;
use crate::cli::{self, Command, Invocation, SubArgs};
use crate::config::{ConfigError, RuntimeConfig};
use crate::early::EarlyRunc;
use crate::harden::{
    self, Context, Decision, Findings, exec as hexec, seccomp::Profile, update as hupdate,
};
use crate::host::HostFacts;
use crate::lease::cache::AnswerCache;
use crate::lease::{DaemonClient, ResolvedLease};
use crate::policy::NoToken;
use crate::record::{Record, Records};
use crate::runclog::RuncLog;
use serde_json::Value;
use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tessera_proto::v1 as pb;

/// Exit code for a bad runtime config or seccomp profile (EX_USAGE-like: 64).
pub const EXIT_CONFIG: i32 = 64;
/// Exit code for a refusal.
pub const EXIT_REFUSED: i32 = 1;
/// runc's default state root.
pub const RUNC_DEFAULT_ROOT: &str = "/run/runc";
/// The PATH runc gets.
pub const RUNC_PATH_ENV: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Largest resources JSON `update` reads.
pub const MAX_STDIN: usize = 60 * 1024;
/// Where, under the state dir, the documents the runtime hands runc are made (and
/// unlinked at once).
pub const DOCUMENTS_DIR: &str = "documents";

/// How to exec the real runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecPlan {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// File descriptors 0..=keep_fds_through stay open; the rest are closed on exec.
    pub keep_fds_through: i32,
    /// One more descriptor, above `keep_fds_through`, that runc inherits: the
    /// runtime's own document (exec's process, update's resources) that `args` name
    /// as `/proc/self/fd/N`.
    pub inherit_fd: Option<i32>,
}

/// What `main` must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Exec(ExecPlan),
    Exit(i32),
    /// runc was started as a child ([`crate::early`]) and ended so: exit as it did.
    Mirror(std::process::ExitStatus),
}

struct Env {
    inv: Invocation,
    cfg: RuntimeConfig,
    log: RuncLog,
    /// runc's `--root` (or its default), canonical where it exists ([`canonical_root`]).
    root: String,
}

impl Env {
    /// Refuse in one line, once on stderr and once as the last error of runc's log
    /// (containerd and conmon show that line); reasons left out of it go to the log
    /// first, as a warning.
    fn refuse(&self, what: &str, reasons: &[String]) -> Outcome {
        let (line, cut) = harden::refusal_line(what, reasons);
        if cut {
            self.log.warn(&format!(
                "tessera-runtime: {what}: every reason: {}",
                reasons.join("; ").replace(['\n', '\r'], " ")
            ));
        }
        eprintln!("{line}");
        self.log.error(&line);
        Outcome::Exit(EXIT_REFUSED)
    }

    /// A daemon client, or `None` when the daemon's socket is not there (no RPC runtime
    /// is built for containers that will not talk to the daemon).
    fn client(&self) -> Option<DaemonClient> {
        if !self.cfg.daemon_socket.exists() {
            return None;
        }
        DaemonClient::new(
            &self.cfg.daemon_socket,
            Duration::from_millis(self.cfg.daemon_timeout_ms),
        )
        .map_err(|e| self.log.warn(&format!("tessera-runtime: {e}")))
        .ok()
    }

    /// Whether runc manages cgroups through systemd: `--systemd-cgroup`, or for
    /// `check` (run by hand, without containerd's flags) a spec in systemd's
    /// `slice:prefix:name` form.
    fn systemd_cgroup(&self, spec: &Value) -> bool {
        let checking = matches!(self.inv.command, Some((Command::Check, _)));
        self.inv.global.systemd_cgroup
            || (checking
                && spec
                    .pointer("/linux/cgroupsPath")
                    .and_then(Value::as_str)
                    .is_some_and(|p| p.contains(':')))
    }

    fn runtime_root(&self) -> String {
        self.root.clone()
    }

    /// The plan to run runc for a create-like command, given the runtime's own bundle
    /// directory in place of the caller's `--bundle`.
    fn plan_own_bundle(&self, cmd: Command, sub: &SubArgs, own: &Path, keep: i32) -> Outcome {
        let mut sub = sub.clone();
        sub.flags.retain(|f| f.name != "bundle");
        sub.flags.push(cli::FlagUse {
            name: "bundle",
            value: own.to_string_lossy().into_owned(),
            index: 0,
            value_index: None,
        });
        let args = self.inv.rebuilt_args(cmd, &sub, &[]);
        self.plan_with_args(args, keep, None)
    }

    /// The plan to run runc with the argv the runtime rebuilt from what it parsed
    /// (a command it does not parse: the global flags rebuilt, the rest as given).
    fn plan(&self, keep_extra: i32) -> Outcome {
        let args = match &self.inv.command {
            Some((cmd, sub)) => self.inv.rebuilt_args(*cmd, sub, &[]),
            None => self.inv.passthrough_args(),
        };
        self.plan_with_args(args, keep_extra, None)
    }

    fn plan_with_args(
        &self,
        args: Vec<String>,
        keep_extra: i32,
        inherit_fd: Option<i32>,
    ) -> Outcome {
        if let Err(e) = check_runtime_binary(&self.cfg.runc_path) {
            return self.refuse("exec of the real runtime", &[e]);
        }
        let mut env = vec![("PATH".to_string(), RUNC_PATH_ENV.to_string())];
        for name in &self.cfg.env_passthrough {
            if let Ok(v) = std::env::var(name) {
                env.push((name.clone(), v));
            }
        }
        Outcome::Exec(ExecPlan {
            program: self.cfg.runc_path.clone(),
            args,
            env,
            keep_fds_through: 2 + keep_extra,
            inherit_fd,
        })
    }
}

/// The real runtime must be a regular executable file that only its owner (root or the
/// caller) can change: it runs as root with the container's bundle.
pub fn check_runtime_binary(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let m =
        std::fs::metadata(path).map_err(|e| format!("the real runtime {}: {e}", path.display()))?;
    let euid = nix::unistd::geteuid().as_raw();
    if !m.is_file() || m.mode() & 0o111 == 0 {
        return Err(format!(
            "the real runtime {} is not an executable file",
            path.display()
        ));
    }
    if m.mode() & 0o022 != 0 || (m.uid() != 0 && m.uid() != euid) {
        return Err(format!(
            "the real runtime {} is writable by others than root",
            path.display()
        ));
    }
    Ok(())
}

/// runc's `--root` as the runtime uses it and hands it to runc: absolute, with no `.`
/// or `..` component, and where it exists, canonical (symlinks resolved once) with
/// every directory from it up to `/` owned by root (or the caller) and writable by
/// nobody else (a sticky directory excepted). A create makes a missing root first
/// (0700, as runc would). Records are keyed by this path, so two spellings of one
/// root are one root, and no spelling reaches a root through a missing directory.
pub fn canonical_root(given: &str, create: bool) -> Result<String, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if !given.starts_with('/') {
        return Err(format!("--root {given:?} is not an absolute path"));
    }
    if given.split('/').any(|c| c == "." || c == "..") {
        return Err(format!("--root {given:?} has a '.' or '..' component"));
    }
    let path = Path::new(given);
    if std::fs::symlink_metadata(path).is_err() {
        if !create {
            // Nothing is there for runc to find; it says so itself.
            return Ok(crate::harden::mounts::normalize(given));
        }
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(path)
            .map_err(|e| format!("--root {given}: {e}"))?;
    }
    let canon = std::fs::canonicalize(path).map_err(|e| format!("--root {given}: {e}"))?;
    let euid = nix::unistd::geteuid().as_raw();
    let mut cur = Some(canon.as_path());
    while let Some(p) = cur {
        let m = std::fs::symlink_metadata(p).map_err(|e| format!("--root {}: {e}", p.display()))?;
        if !m.is_dir() {
            return Err(format!("--root {}: not a directory", p.display()));
        }
        let sticky = m.mode() & 0o1000 != 0;
        if (m.uid() != 0 && m.uid() != euid) || (m.mode() & 0o022 != 0 && !sticky) {
            return Err(format!(
                "--root {given}: {} may be changed by others than root (owner {}, mode {:o})",
                p.display(),
                m.uid(),
                m.mode() & 0o7777
            ));
        }
        cur = p.parent();
    }
    Ok(canon.to_string_lossy().into_owned())
}

fn preserve_fds(sub: &SubArgs) -> Result<i32, String> {
    let n = match sub.value("preserve-fds") {
        None => return Ok(0),
        Some(v) => v
            .parse::<i32>()
            .ok()
            .filter(|n| (0..=1024).contains(n))
            .ok_or_else(|| format!("--preserve-fds {v:?} is not a small number"))?,
    };
    for fd in 3..3 + n {
        preserved_fd_ok(fd)?;
    }
    Ok(n)
}

/// A descriptor passed on into the container (`--preserve-fds`) must be a socket, a
/// pipe or a character device opened for I/O: a directory or a regular file (or an
/// `O_PATH` descriptor of anything) would give the container a handle on the host's
/// filesystem outside its rootfs.
fn preserved_fd_ok(fd: i32) -> Result<(), String> {
    // SAFETY: fcntl F_GETFL reads the flags of a descriptor number; it changes nothing.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        // Not open: /dev/null is put there, so that no file the runtime opens later
        // takes that number and is passed on to the container.
        use std::os::fd::AsRawFd;
        let null = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .map_err(|e| format!("--preserve-fds: /dev/null: {e}"))?;
        if null.as_raw_fd() == fd {
            // Opened on that very number (the lowest free one): kept open, and
            // inherited by runc.
            use std::os::fd::IntoRawFd;
            let raw = null.into_raw_fd();
            // SAFETY: F_SETFD only clears the close-on-exec flag of a descriptor this
            // process just opened and keeps.
            if unsafe { libc::fcntl(raw, libc::F_SETFD, 0) } < 0 {
                return Err(format!(
                    "--preserve-fds: fd {fd}: {}",
                    std::io::Error::last_os_error()
                ));
            }
            return Ok(());
        }
        // SAFETY: dup2 onto a descriptor number that is not open; `null` stays
        // valid for the call and is closed after (the copy, without close-on-exec,
        // stays).
        if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
            return Err(format!(
                "--preserve-fds: fd {fd}: {}",
                std::io::Error::last_os_error()
            ));
        }
        return Ok(());
    }
    if flags & libc::O_PATH != 0 {
        return Err(format!(
            "--preserve-fds: fd {fd} is an O_PATH descriptor: refused"
        ));
    }
    // SAFETY: `st` is a plain C struct that fstat fills in for a descriptor number.
    let (rc, mode) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(fd, &mut st), st.st_mode)
    };
    if rc != 0 {
        return Err(format!(
            "--preserve-fds: fd {fd}: {}",
            std::io::Error::last_os_error()
        ));
    }
    match mode & libc::S_IFMT {
        libc::S_IFSOCK | libc::S_IFIFO | libc::S_IFCHR => Ok(()),
        libc::S_IFDIR => Err(format!(
            "--preserve-fds: fd {fd} is a directory: it would reach the host's filesystem from the container"
        )),
        libc::S_IFREG => Err(format!(
            "--preserve-fds: fd {fd} is a regular file: only sockets, pipes and character devices are passed on"
        )),
        _ => Err(format!(
            "--preserve-fds: fd {fd} is not a socket, pipe or character device"
        )),
    }
}

/// Run the runtime's logic for one invocation (`args`: after the program name).
pub fn run(args: Vec<OsString>) -> Outcome {
    run_as(None, args)
}

/// [`run`], started as `argv0` (the config may be found next to it).
pub fn run_as(argv0: Option<PathBuf>, args: Vec<OsString>) -> Outcome {
    let mut inv = match cli::parse(args) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("tessera-runtime: {e}");
            return Outcome::Exit(EXIT_REFUSED);
        }
    };
    let log = RuncLog::new(inv.global.log.as_deref(), inv.global.log_format.as_deref());
    let cfg = match RuntimeConfig::load_discovered(argv0.as_deref()) {
        Ok((c, _)) => c,
        Err(e) => return config_error(&log, &e),
    };
    let creating = matches!(inv.command, Some((Command::Create | Command::Run, _)));
    let given = inv
        .global
        .root
        .clone()
        .unwrap_or_else(|| RUNC_DEFAULT_ROOT.to_string());
    let root = if inv.global.help_or_version {
        given
    } else {
        match canonical_root(&given, creating) {
            Ok(r) => r,
            Err(e) => {
                let msg = format!("tessera-runtime: {e}");
                eprintln!("{msg}");
                log.error(&msg);
                return Outcome::Exit(EXIT_REFUSED);
            }
        }
    };
    if inv.global.root.is_some() {
        inv.global.root = Some(root.clone());
    }
    let env = Env {
        inv,
        cfg,
        log,
        root,
    };
    let Some((cmd, sub)) = env.inv.command.clone() else {
        if let Some(i) = env.inv.command_index
            && env.inv.argv[i] == "checkpoint"
            && !env.inv.global.help_or_version
        {
            // As restore: runc would run CRIU as root, writing the image wherever the
            // command line says; no checkpoint can be restored through the runtime.
            return env.refuse(
                "checkpoint",
                &["checkpoint is refused: CRIU runs as root and writes where its flags say, and restore is refused".to_string()],
            );
        }
        return env.plan(0);
    };
    match cmd {
        Command::Restore => {
            let id = sub.first_positional().unwrap_or_default().to_string();
            env.refuse(
                &format!("restore {id}"),
                &["restore is refused: a CRIU image can carry any process state and mounts, outside the policy table".to_string()],
            )
        }
        Command::Create | Command::Run => create(&env, cmd, &sub),
        Command::Exec => exec(&env, &sub),
        Command::Update => update(&env, &sub),
        Command::Delete => delete(&env, &sub),
        Command::Check => check(&env, &sub),
        // Nothing the tenant wrote is judged here; runc gets the parsed flags.
        Command::Start
        | Command::Kill
        | Command::State
        | Command::Pause
        | Command::Resume
        | Command::Ps
        | Command::Events
        | Command::List
        | Command::Spec
        | Command::Features => env.plan(0),
    }
}

fn config_error(log: &RuncLog, e: &ConfigError) -> Outcome {
    let msg = format!("tessera-runtime: bad runtime config: {e}");
    eprintln!("{msg}");
    log.error(&msg);
    Outcome::Exit(EXIT_CONFIG)
}

/// Everything a create-like command decides before acting.
struct Admission {
    decision: Decision,
    lease: Option<ResolvedLease>,
    /// The tokens of the leases the container runs on, with the answers the spec was
    /// judged against (empty: no lease).
    answers: Vec<Answer>,
}

/// A lease token and the daemon's answer for it that the spec was judged against.
struct Answer {
    token: String,
    judged: pb::ResolveTokenResponse,
    /// Kept from an earlier start (not asked of the daemon this time).
    kept: bool,
}

fn bundle_dir(sub: &SubArgs) -> PathBuf {
    sub.value("bundle")
        .filter(|b| !b.is_empty())
        .map_or_else(|| PathBuf::from("."), PathBuf::from)
}

/// Load the bundle, resolve the token (from `kept` answers where it has one), harden.
/// `Err` carries refusal reasons and the lease id (if one was resolved).
fn admit(
    env: &Env,
    client: Option<&DaemonClient>,
    bundle: &Path,
    id: &str,
    kept: Option<&AnswerCache>,
    tenant: Option<&[u8]>,
) -> Result<Admission, (Vec<String>, String)> {
    // One thread, in order: the profile, the spec and its lease (ResolveToken is a
    // read: nothing is bound, written or run before every check has passed), then the
    // host facts. Helper threads for the profile and the facts made a start slower, not
    // faster: making a thread and waking its joiner cost more on a small VM than the
    // 0.1-0.2 ms of work each took off this one (docs/performance.md, sixth round).
    let profile = Profile::load(env.cfg.policy.seccomp_profile.as_deref())
        .map_err(|e| (vec![format!("bad seccomp profile: {e}")], String::new()))?;
    let Leased {
        spec,
        answers,
        lease,
    } = spec_and_lease(env, client, bundle, id, kept, tenant)?;
    let host = HostFacts::gather(&env.cfg.nvidia_proc_root);
    let runc_root = env.runtime_root();
    let ctx = Context {
        config: &env.cfg,
        seccomp: &profile,
        host: &host,
        lease: lease.as_ref(),
        container_id: id,
        systemd_cgroup: env.systemd_cgroup(&spec),
        bundle,
        runc_root: Path::new(&runc_root),
    };
    let privileged = harden::privileged(&spec);
    let decision = harden::harden(spec, &ctx);
    if !decision.admitted {
        let lease_id = lease.map(|l| l.lease_id).unwrap_or_default();
        let mut reasons = decision.reasons;
        reasons.splice(0..0, privileged);
        return Err((reasons, lease_id));
    }
    Ok(Admission {
        decision,
        lease,
        answers,
    })
}

/// What the spec asks of the daemon: its tokens, their answers, and the lease they
/// resolve to.
struct Leased {
    spec: Value,
    answers: Vec<Answer>,
    lease: Option<ResolvedLease>,
}

/// Load the bundle's spec (parse `tenant`, its bytes as already read, if given), find
/// its tokens and resolve them (every one to an ACTIVE lease, merged into what the
/// container may use).
fn spec_and_lease(
    env: &Env,
    client: Option<&DaemonClient>,
    bundle: &Path,
    id: &str,
    kept: Option<&AnswerCache>,
    tenant: Option<&[u8]>,
) -> Result<Leased, (Vec<String>, String)> {
    let spec = match tenant {
        Some(bytes) => bundle::parse_object(&bundle.join(bundle::CONFIG_JSON), bytes),
        None => bundle::load(bundle, env.cfg.policy.max_config_bytes),
    }
    .map_err(|e| (vec![e.to_string()], String::new()))?;
    let token = harden::find_token(&spec).map_err(|e| (vec![e], String::new()))?;
    // One token, or several joined by ',' (a container with several devices).
    let mut tokens = match &token {
        Some(t) => {
            crate::lease::parse_tokens(t).map_err(|e| (vec![e.to_string()], String::new()))?
        }
        None => Vec::new(),
    };
    // A Kubernetes pod's sandbox (pause) container carries the pod's annotations too; it
    // runs no tenant code, so it gets the baseline hardening and never the GPU.
    let sandbox = harden::is_cri_sandbox(&spec, id, &env.cfg.policy);
    if sandbox {
        tokens.clear();
    }
    let mut answers = Vec::with_capacity(tokens.len());
    let lease = match tokens.as_slice() {
        [] if env.cfg.policy.no_token == NoToken::Refuse && !sandbox => {
            return Err((
                vec![format!(
                    "the container carries no lease token ({}) and the policy refuses such containers",
                    harden::TOKEN_ANNOTATION
                )],
                String::new(),
            ));
        }
        [] => None,
        ts => {
            let Some(c) = client else {
                return Err((
                    vec![format!(
                        "the tessera daemon at {} is unavailable: no socket there",
                        env.cfg.daemon_socket.display()
                    )],
                    String::new(),
                ));
            };
            // Every token must resolve to an ACTIVE lease; then what they grant
            // is merged (refused when it cannot be: two MPS shares, two tenants).
            // An answer kept from an earlier start is judged against as a fresh one
            // would be; the bind then has the daemon confirm it is still current.
            let mut resolved = Vec::with_capacity(ts.len());
            for t in ts {
                let from_kept = kept.and_then(|k| match k.get(t) {
                    Ok(found) => found,
                    Err(e) => {
                        env.log.warn(&format!(
                            "tessera-runtime: kept ResolveToken answer ignored, the daemon is asked: {e}"
                        ));
                        k.forget(t);
                        None
                    }
                });
                let was_kept = from_kept.is_some();
                let (judged, lease) = match from_kept {
                    Some(found) => found,
                    None => c
                        .resolve_answer(t)
                        .map_err(|e| (vec![e.to_string()], String::new()))?,
                };
                resolved.push(lease);
                answers.push(Answer {
                    token: t.clone(),
                    judged,
                    kept: was_kept,
                });
            }
            if let Some(dup) = resolved
                .iter()
                .enumerate()
                .find(|(i, l)| resolved[..*i].iter().any(|o| o.lease_id == l.lease_id))
                .map(|(_, l)| l.lease_id.clone())
            {
                return Err((vec![format!("two tokens name the same lease {dup}")], dup));
            }
            // Validate before binding anything: a lease whose token another pod
            // holds would refuse its bind after the others were made.
            if let (true, Some(pod)) = (resolved.len() > 1, harden::pod_of(&spec)) {
                for l in &resolved {
                    if !l.pod.is_empty() && l.pod != pod {
                        return Err((
                            vec![format!(
                                "the token of lease {} is bound to pod {}; pod {pod} may not use it",
                                l.lease_id, l.pod
                            )],
                            l.lease_id.clone(),
                        ));
                    }
                }
            }
            Some(crate::lease::merge(resolved).map_err(|e| (vec![e.to_string()], String::new()))?)
        }
    };
    Ok(Leased {
        spec,
        answers,
        lease,
    })
}

fn report(
    env: &Env,
    client: Option<&DaemonClient>,
    id: &str,
    lease_id: &str,
    ok: bool,
    reasons: &[String],
    cmd: &str,
) {
    // Best effort, and only when a daemon socket is there to answer.
    if let Some(c) = client
        && let Err(e) = c.report(id, lease_id, ok, reasons, cmd)
    {
        env.log
            .warn(&format!("tessera-runtime: ReportAdmission failed: {e}"));
    }
}

fn create(env: &Env, cmd: Command, sub: &SubArgs) -> Outcome {
    let id = sub.first_positional().unwrap_or_default().to_string();
    let what = format!("{} {id}", cmd.name());
    let keep = match preserve_fds(sub) {
        Ok(n) => n,
        Err(e) => return env.refuse(&what, &[e]),
    };
    let bundle = bundle_dir(sub);
    // The record of this create replaces any of the same root and id: a container
    // runc already has under that id keeps its own, as runc would refuse the create.
    if id.is_empty() || id.contains('/') || id == "." || id == ".." {
        return env.refuse(&what, &[format!("container id {id:?} is not valid")]);
    }
    // runc's create flags: --bundle is what is judged, --console-socket, --pid-file
    // and --preserve-fds the caller's plumbing (forwarded); these two loosen the
    // container for every tenant and are refused.
    for (flag, why) in [
        (
            "no-pivot",
            "the rootfs would be entered with MS_MOVE and chroot, which a process can climb out of",
        ),
        (
            "no-new-keyring",
            "the container would share the caller's session keyring",
        ),
    ] {
        if sub.is_set(flag) {
            return env.refuse(
                &what,
                &[format!("{} --{flag} is refused: {why}", cmd.name())],
            );
        }
    }
    let root = env.runtime_root();
    let records = Records::new(&env.cfg.state_dir);
    // Held until runc has ended and the record says how: no second create of this
    // root and id runs meanwhile.
    let _lock = match records.lock(&root, &id) {
        Ok(l) => l,
        Err(e) => return env.refuse(&what, &[e.to_string()]),
    };
    if std::fs::symlink_metadata(Path::new(&root).join(&id)).is_ok() {
        return env.refuse(
            &what,
            &[format!("container {id} already exists under {root}")],
        );
    }
    // The tenant's config.json, read once. runc never opens it: it gets the runtime's
    // own bundle directory, whose config.json only the runtime writes (crate::early).
    // One that cannot be read is refused below, by admit.
    let tenant = bundle::read_with_mode(
        &bundle.join(bundle::CONFIG_JSON),
        env.cfg.policy.max_config_bytes,
    )
    .ok();
    let mut own = match records.fresh_bundle_dir(&root, &id) {
        Ok(d) => OwnBundle {
            records: &records,
            root: &root,
            id: &id,
            dir: d,
            keep: false,
        },
        Err(e) => {
            return env.refuse(&what, &[format!("making the container's own bundle: {e}")]);
        }
    };
    let plan = match env.plan_own_bundle(cmd, sub, &own.dir, keep) {
        Outcome::Exec(p) => p,
        refused => return refused,
    };
    // runc's version is asked now and judged once the spec is decided, before
    // anything is bound, written or run.
    let cache = crate::runc_cves::VersionCache::new(&env.cfg.state_dir);
    let mut runc_version = Some(crate::runc_cves::start(&env.cfg.runc_path, Some(&cache)));
    let runc_admitted = runc_version
        .as_ref()
        .is_some_and(|v| v.cached_and_admitted(&env.cfg.runc_cve_acknowledged));
    let mut early = match &tenant {
        Some(_) if runc_admitted => match EarlyRunc::start(&own.dir, &plan) {
            Ok(e) => Some(e),
            Err(e) => {
                env.log.info(&format!(
                    "tessera-runtime: {what}: runc is started once the spec is decided: {e}"
                ));
                None
            }
        },
        _ => None,
    };
    let tenant_mode = tenant.as_ref().map(|(_, m)| *m);
    let tenant = tenant.map(|(b, _)| b);
    let client = env.client();
    // Report a refusal to the daemon (audit), then refuse.
    let refuse_reported = |reasons: Vec<String>, lease_id: &str| {
        report(
            env,
            client.as_ref(),
            &id,
            lease_id,
            false,
            &reasons,
            cmd.name(),
        );
        env.refuse(&what, &reasons)
    };
    let answers = AnswerCache::new(&env.cfg.state_dir);
    let mut kept = Some(&answers);
    // At most twice: a bind refused on an answer kept from an earlier start (the
    // daemon's answer has changed since, or the bind is refused for another reason)
    // forgets that answer and decides again on the daemon's current one.
    let (adm, staged, hardened, lease_id, bound) = loop {
        let mut adm = match admit(env, client.as_ref(), &bundle, &id, kept, tenant.as_deref()) {
            Ok(a) => a,
            Err((reasons, lease_id)) => return refuse_reported(reasons, &lease_id),
        };
        // runc resolves a relative root.path in the bundle it is given, the runtime's
        // own: the judged path (inside the tenant's bundle) is written absolute.
        if let Err(e) = absolute_root_path(&mut adm.decision.spec, &bundle) {
            return refuse_reported(vec![e], "");
        }
        let lease_id = adm
            .lease
            .as_ref()
            .map(|l| l.lease_id.clone())
            .unwrap_or_default();
        if let Some(pending) = runc_version.take() {
            let verdict = pending.judge(&env.cfg.runc_cve_acknowledged);
            for n in &verdict.cache_notes {
                env.log.warn(n);
            }
            match verdict.result {
                Err(reason) => return refuse_reported(vec![reason], &lease_id),
                Ok(Some(warning)) => env.log.warn(&warning),
                Ok(None) => {}
            }
        }
        // The new config.json is written in the runtime's own bundle (what runc
        // reads) and beside the tenant's (what the engine sees), then the daemon
        // records the binding, and the renames happen only once the container is
        // bound to every lease. A write that fails binds nothing.
        let (staged, hardened) = match adm
            .decision
            .config_json()
            .map_err(|e| format!("{}: {e}", bundle.join(bundle::CONFIG_JSON).display()))
            .and_then(|bytes| {
                let both = || -> Result<_, bundle::BundleError> {
                    let mine = bundle::stage_with_mode(&own.dir, &bytes, 0o600)?;
                    let theirs = match tenant_mode {
                        Some(mode) => bundle::stage_with_mode(&bundle, &bytes, mode),
                        None => bundle::stage(&bundle, &bytes),
                    }?;
                    Ok((mine, theirs))
                };
                both().map(|s| (s, bytes)).map_err(|e| e.to_string())
            }) {
            Ok(s) => s,
            Err(e) => return refuse_reported(vec![e], &lease_id),
        };
        let bound = if adm.answers.is_empty() {
            Ok(Vec::new())
        } else {
            bind_all(env, client.as_ref(), &adm, &id, cmd)
        };
        let bound = match bound {
            // A kept answer counts only when the daemon says it checked it: an older
            // daemon ignores it. Unbound, forgotten, and decided again.
            Ok(b)
                if kept.is_some()
                    && adm
                        .answers
                        .iter()
                        .zip(&b)
                        .any(|(a, r)| a.kept && !r.resolution_checked) =>
            {
                if let Some(c) = client.as_ref()
                    && let Err(e) = c.unbind(&id, &env.runtime_root())
                {
                    return refuse_reported(
                        vec![format!("UnbindContainer after an unchecked bind: {e}")],
                        &lease_id,
                    );
                }
                for a in adm.answers.iter().filter(|a| a.kept) {
                    answers.forget(&a.token);
                }
                env.log.warn(&format!(
                    "tessera-runtime: {what}: the daemon did not check the kept ResolveToken \
                     answer (an older tesserad?); deciding again on its current answer"
                ));
                kept = None;
                continue;
            }
            Ok(b) => b,
            Err(reason) => {
                // `staged` is dropped with its temp file: config.json stays the tenant's
                // (or the FIFO runc waits on, which a refusal replaces by the tenant's).
                let stale: Vec<&Answer> = adm.answers.iter().filter(|a| a.kept).collect();
                if kept.is_some() && !stale.is_empty() {
                    for a in stale {
                        answers.forget(&a.token);
                    }
                    env.log.info(&format!(
                        "tessera-runtime: {what}: the kept ResolveToken answer was refused at \
                         bind ({reason}); deciding again on the daemon's current answer"
                    ));
                    kept = None;
                    continue;
                }
                return refuse_reported(vec![reason], &lease_id);
            }
        };
        break (adm, staged, hardened, lease_id, bound);
    };
    // What exec and update judge against later is kept in the runtime's own state
    // first, then the hardened file replaces the tenant's (or the FIFO in its place),
    // then an early runc gets it through the FIFO if it opened that already.
    let spec = &adm.decision.spec;
    let record = Record::from_spec(
        &id,
        &env.runtime_root(),
        &bundle,
        spec,
        hexec::lease_id_of(spec),
        hexec::LEASE_ENV_KEYS,
    )
    .map_err(|e| e.to_string())
    .and_then(|r| {
        Records::new(&env.cfg.state_dir)
            .put(&r)
            .map_err(|e| format!("keeping the container's record: {e}"))
    });
    let (mine, theirs) = staged;
    if let Err(e) = record
        .and_then(|()| theirs.commit().map_err(|e| e.to_string()))
        .and_then(|()| mine.commit().map_err(|e| e.to_string()))
        .and_then(|()| {
            early
                .as_mut()
                .map_or(Ok(()), |r| r.feed(&hardened).map_err(|e| e.to_string()))
        })
    {
        let reasons = vec![e];
        if let Err(e) = records.remove(&root, &id) {
            env.log.warn(&format!("tessera-runtime: {what}: {e}"));
        }
        if let Some(c) = client.as_ref()
            && !adm.answers.is_empty()
        {
            let _ = c.unbind(&id, &env.runtime_root());
        }
        report(
            env,
            client.as_ref(),
            &id,
            &lease_id,
            false,
            &reasons,
            cmd.name(),
        );
        return env.refuse(&what, &reasons);
    }
    for n in &adm.decision.notes {
        if n.contains("AppArmor") {
            env.log.warn(&format!("tessera-runtime: {n}"));
        } else {
            env.log.info(&format!("tessera-runtime: {n}"));
        }
    }
    if adm.answers.is_empty() {
        report(env, client.as_ref(), &id, &lease_id, true, &[], cmd.name());
    }
    // The daemon confirmed these answers by binding: the next start on the same
    // lease may judge against them without asking. Kept as the bind left them: a
    // first bind with a pod claims the token for it, which the daemon's answer
    // says from then on.
    for (a, bind) in adm.answers.iter().zip(&bound) {
        let lease = bind.lease.as_ref();
        if a.kept && lease.is_none_or(|l| a.judged.lease.as_ref().is_some_and(|j| j.pod == l.pod)) {
            continue;
        }
        let mut judged = a.judged.clone();
        if let (Some(j), Some(l)) = (judged.lease.as_mut(), lease) {
            j.pod.clone_from(&l.pod);
        }
        if let Err(e) = answers.put(&a.token, &judged) {
            env.log.warn(&format!(
                "tessera-runtime: keeping the ResolveToken answer: {e}"
            ));
        }
    }
    let leased = !adm.answers.is_empty();
    // runc runs as this process's child, so that how its create ended is known: a
    // create that failed leaves no record, no own bundle and no binding behind.
    drop(client);
    let runc = match early {
        Some(r) => r,
        None => match EarlyRunc::spawn_decided(&plan) {
            Ok(r) => r,
            Err(e) => {
                let reasons = vec![e.to_string()];
                finish_create(env, &mut own, leased, false);
                return env.refuse(&what, &reasons);
            }
        },
    };
    // runc runs on; this process waits for it (for `run`, as long as the container).
    match runc.wait() {
        Ok(status) => {
            finish_create(env, &mut own, leased, status.success());
            Outcome::Mirror(status)
        }
        Err(e) => {
            let msg = format!("tessera-runtime: {what}: {e}");
            eprintln!("{msg}");
            env.log.error(&msg);
            finish_create(env, &mut own, leased, false);
            Outcome::Exit(EXIT_REFUSED)
        }
    }
}

/// Make a relative `root.path` (judged inside the tenant's bundle) absolute: the
/// canonical bundle joined with it.
fn absolute_root_path(spec: &mut Value, bundle: &Path) -> Result<(), String> {
    let Some(path) = spec.pointer("/root/path").and_then(Value::as_str) else {
        return Err("the spec has no root.path".to_string());
    };
    if Path::new(path).is_absolute() {
        return Ok(());
    }
    let canon = std::fs::canonicalize(bundle.join(path))
        .map_err(|e| format!("root.path {}: {e}", bundle.join(path).display()))?;
    if let Some(root) = spec.get_mut("root").and_then(Value::as_object_mut) {
        root.insert(
            "path".to_string(),
            Value::String(canon.to_string_lossy().into_owned()),
        );
    }
    Ok(())
}

/// The runtime's own bundle directory of a create: removed when dropped, unless the
/// container was made.
struct OwnBundle<'a> {
    records: &'a Records,
    root: &'a str,
    id: &'a str,
    dir: PathBuf,
    keep: bool,
}

impl Drop for OwnBundle<'_> {
    fn drop(&mut self) {
        if !self.keep {
            let _ = self.records.remove_bundle_dir(self.root, self.id);
        }
    }
}

/// After runc's create (or run) ended: a container runc now has under the root,
/// started after the record was written, gets its init written into the record (exec
/// and update then check it is still that one). Otherwise (runc failed, or `run` ended
/// and runc deleted the container) the record and the own bundle are removed and the
/// container is unbound from its leases.
fn finish_create(env: &Env, own: &mut OwnBundle<'_>, leased: bool, ok: bool) {
    let (root, id) = (own.root, own.id);
    let exists = std::fs::symlink_metadata(Path::new(root).join(id)).is_ok();
    if ok && exists {
        // Kept even when the init cannot be read: the record's start time still ties
        // it to a container made after it.
        own.keep = true;
        let state = crate::harden::identity::read_state(Path::new(root), id);
        match (own.records.get(root, id), state) {
            (Ok(mut r), Ok(st)) if r.matches(st.init_pid, st.init_start).is_ok() => {
                r.instance = Some(crate::record::Instance {
                    init_pid: st.init_pid,
                    init_start: st.init_start,
                });
                if let Err(e) = own.records.put(&r) {
                    env.log
                        .warn(&format!("tessera-runtime: recording {id}'s init: {e}"));
                }
            }
            (Ok(_), Ok(_)) => env.log.warn(&format!(
                "tessera-runtime: {id}: runc's init started before the create's record: not recorded"
            )),
            (r, st) => env.log.warn(&format!(
                "tessera-runtime: recording {id}'s init: {}",
                r.err()
                    .map(|e| e.to_string())
                    .or(st.err())
                    .unwrap_or_default()
            )),
        }
        return;
    }
    if let Err(e) = own.records.remove(root, id) {
        env.log.warn(&format!("tessera-runtime: {id}: {e}"));
    }
    let _ = own.records.remove_bundle_dir(root, id);
    if leased
        && let Some(c) = env.client()
        && let Err(e) = c.unbind(id, root)
    {
        env.log.warn(&format!(
            "tessera-runtime: UnbindContainer {id} after runc's create failed: {e}"
        ));
    }
}

/// Bind the container to every lease of its tokens, or to none: a failed bind unbinds
/// the container from those already bound (UnbindContainer forgets it on every lease).
/// `Ok` has the daemon's answer to each bind (in the answers' order); `Err` is the
/// refusal's reason.
fn bind_all(
    env: &Env,
    client: Option<&DaemonClient>,
    adm: &Admission,
    id: &str,
    cmd: Command,
) -> Result<Vec<pb::BindContainerResponse>, String> {
    // admit() resolved the token, so there is a client; stay closed regardless.
    let Some(c) = client else {
        return Err("no daemon client to bind the container".to_string());
    };
    let spec = &adm.decision.spec;
    let binding = crate::lease::Binding {
        container_id: id.to_string(),
        cgroup_path: spec
            .pointer("/linux/cgroupsPath")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        runtime_root: env.runtime_root(),
        uid: spec
            .pointer("/process/user/uid")
            .and_then(Value::as_u64)
            .and_then(|u| u32::try_from(u).ok()),
        termination_log: harden::termination_log_source(spec).unwrap_or_default(),
        pod: harden::pod_of(spec).unwrap_or_default(),
        // The bind carries the admission report; a failure after it (saving
        // config.json) unbinds and reports the refusal.
        admission_command: cmd.name().to_string(),
    };
    let mut bound = Vec::with_capacity(adm.answers.len());
    for (i, a) in adm.answers.iter().enumerate() {
        match c.bind(&a.token, &binding, Some(&a.judged)) {
            Ok(answer) => bound.push(answer),
            Err(e) => {
                if i > 0
                    && let Err(u) = c.unbind(id, &env.runtime_root())
                {
                    env.log.warn(&format!(
                        "tessera-runtime: UnbindContainer {id} after a failed bind: {u}"
                    ));
                }
                return Err(format!("BindContainer failed: {e}"));
            }
        }
    }
    Ok(bound)
}

/// The container's record of its create, checked to be the record of the container
/// runc has under the root now (its init, as runc's state.json says); a refusal's
/// reason when there is none, or it is another's.
fn record_of(env: &Env, id: &str) -> Result<Record, String> {
    let root = env.runtime_root();
    let record = Records::new(&env.cfg.state_dir)
        .get(&root, id)
        .map_err(|e| e.to_string())?;
    let state = crate::harden::identity::read_state(Path::new(&root), id)
        .map_err(|e| format!("container {id}: runc's state: {e}"))?;
    record
        .matches(state.init_pid, state.init_start)
        .map_err(|e| e.to_string())?;
    Ok(record)
}

/// Hand runc a document the runtime wrote: a root-owned 0600 file under the state
/// dir, unlinked at once, that runc opens as `/proc/self/fd/N` (N above the fds it
/// passes on to the container). Returns N and that path.
fn own_document(env: &Env, bytes: &[u8], keep_extra: i32) -> Result<(i32, String), String> {
    use std::os::fd::IntoRawFd;
    let fd = crate::private_file::unlinked(
        &env.cfg.state_dir.join(DOCUMENTS_DIR),
        bytes,
        3 + keep_extra,
    )
    .map_err(|e| format!("writing the document for runc: {e}"))?;
    // Kept open (close-on-exec cleared at exec) for runc to read.
    let raw = fd.into_raw_fd();
    Ok((raw, format!("/proc/self/fd/{raw}")))
}

/// The exec flags that are the caller's own plumbing, forwarded to runc as parsed;
/// every other one is judged and becomes part of the process JSON.
const EXEC_FORWARDED: &[&str] = &["console-socket", "detach", "pid-file", "preserve-fds"];

fn exec(env: &Env, sub: &SubArgs) -> Outcome {
    let id = sub.first_positional().unwrap_or_default().to_string();
    let what = format!("exec {id}");
    let keep = match preserve_fds(sub) {
        Ok(n) => n,
        Err(e) => return env.refuse(&what, &[e]),
    };
    let record = match record_of(env, &id) {
        Ok(r) => r,
        Err(e) => return env.refuse(&what, &[e]),
    };
    let state = hexec::ContainerState::from_record(&record);
    let mut f = Findings::default();
    hexec::check_flags(sub, &state, &mut f);
    // The tenant's process JSON, or the container's own process with the flags: in
    // either case judged and written anew, with the container's user and groups.
    let asked = match sub.value("process") {
        Some(p) => bundle::load_json(Path::new(p), env.cfg.policy.max_config_bytes)
            .map_err(|e| f.refuse(e.to_string()))
            .ok(),
        None => Some(hexec::process_from_flags(&record, sub, &mut f)),
    };
    let process = asked.map(|p| hexec::harden_process(p, &state, &env.cfg.policy, &mut f));
    let doc = match (process, f.reasons.is_empty()) {
        (Some(p), true) => serde_json::to_vec(&p).map_err(|e| e.to_string()),
        _ => Err(String::new()),
    }
    .and_then(|bytes| own_document(env, &bytes, keep));
    let (fd, path) = match doc {
        Ok(d) => d,
        Err(e) => {
            if !e.is_empty() {
                f.refuse(e);
            }
            let client = env.client();
            report(env, client.as_ref(), &id, "", false, &f.reasons, "exec");
            return env.refuse(&what, &f.reasons);
        }
    };
    let mut forwarded = SubArgs {
        flags: sub
            .flags
            .iter()
            .filter(|fl| EXEC_FORWARDED.contains(&fl.name))
            .cloned()
            .collect(),
        positionals: vec![(0, id)],
    };
    forwarded.flags.push(cli::FlagUse {
        name: "process",
        value: path,
        index: 0,
        value_index: None,
    });
    let args = env.inv.rebuilt_args(Command::Exec, &forwarded, &[]);
    env.plan_with_args(args, keep, Some(fd))
}

fn update(env: &Env, sub: &SubArgs) -> Outcome {
    let id = sub.first_positional().unwrap_or_default().to_string();
    let what = format!("update {id}");
    let mut f = Findings::default();
    let judged = record_of(env, &id)
        .map_err(|e| f.refuse(e))
        .ok()
        .and_then(|record| {
            let state = hexec::ContainerState::from_record(&record);
            let asked = match sub.value("resources") {
                Some(r) => {
                    // runc ignores every other flag with --resources: refused.
                    hupdate::from_flags(sub, &mut f);
                    read_resources(r)
                        .and_then(|b| bundle::parse_strict(&b).map_err(|e| format!("update: {e}")))
                        .map_err(|e| f.refuse(e))
                        .ok()
                        .and_then(|v| hupdate::parse(&v, &mut f))
                }
                None => Some(hupdate::from_flags(sub, &mut f)),
            };
            asked.and_then(|r| hupdate::judge(r, &state, &env.cfg.policy, &mut f))
        });
    let doc = match judged {
        Some(r) if f.reasons.is_empty() => serde_json::to_vec(&r)
            .map_err(|e| e.to_string())
            .and_then(|bytes| own_document(env, &bytes, 0))
            .map_err(|e| f.refuse(e))
            .ok(),
        _ => None,
    };
    let Some((fd, path)) = doc.filter(|_| f.reasons.is_empty()) else {
        let client = env.client();
        report(env, client.as_ref(), &id, "", false, &f.reasons, "update");
        return env.refuse(&what, &f.reasons);
    };
    let forwarded = SubArgs {
        flags: vec![cli::FlagUse {
            name: "resources",
            value: path,
            index: 0,
            value_index: None,
        }],
        positionals: vec![(0, id)],
    };
    let args = env.inv.rebuilt_args(Command::Update, &forwarded, &[]);
    env.plan_with_args(args, 0, Some(fd))
}

/// The bytes of update's `--resources`: a file (no symlink at its last component),
/// or stdin for `-`, at most [`MAX_STDIN`] bytes.
fn read_resources(r: &str) -> Result<Vec<u8>, String> {
    let max = MAX_STDIN as u64;
    if r == "-" {
        let mut buf = Vec::new();
        return match std::io::stdin().take(max + 1).read_to_end(&mut buf) {
            Ok(_) if buf.len() as u64 <= max => Ok(buf),
            Ok(_) => Err(format!(
                "update: the resources JSON is larger than {max} bytes"
            )),
            Err(e) => Err(format!("update: reading stdin: {e}")),
        };
    }
    bundle::read_file_nofollow(Path::new(r), max).map_err(|e| format!("update: {e}"))
}

fn delete(env: &Env, sub: &SubArgs) -> Outcome {
    let id = sub.first_positional().unwrap_or_default();
    let records = Records::new(&env.cfg.state_dir);
    let root = env.runtime_root();
    let plan = match env.plan(0) {
        Outcome::Exec(p) => p,
        other => return other,
    };
    // runc deletes first, as this process's child: only a container runc no longer
    // has under this root loses its record and its lease bindings, and only the one
    // this root's record says this runtime bound (a delete under another root, or of
    // a container runc refuses to delete, unbinds nothing).
    let status = match EarlyRunc::spawn_decided(&plan).and_then(EarlyRunc::wait) {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("tessera-runtime: delete {id}: {e}");
            eprintln!("{msg}");
            env.log.error(&msg);
            return Outcome::Exit(EXIT_REFUSED);
        }
    };
    let gone = std::fs::symlink_metadata(Path::new(&root).join(id)).is_err();
    if status.success()
        && gone
        && let Ok(record) = records.get(&root, id)
    {
        if record.lease_id.is_some()
            && let Some(c) = env.client()
            && let Err(e) = c.unbind(id, &root)
            && !matches!(e, crate::lease::LeaseError::UnknownToken(_))
        {
            env.log
                .warn(&format!("tessera-runtime: UnbindContainer {id}: {e}"));
        }
        if let Err(e) = records.remove(&root, id) {
            env.log.warn(&format!("tessera-runtime: delete {id}: {e}"));
        }
        let _ = records.remove_bundle_dir(&root, id);
    }
    Outcome::Mirror(status)
}

fn check(env: &Env, sub: &SubArgs) -> Outcome {
    let bundle = bundle_dir(sub);
    let id = sub.value("id").unwrap_or("check").to_string();
    let json_out = sub.is_set("json");
    let client = env.client();
    // Always the daemon's current answer: `check` binds nothing that would confirm
    // a kept one.
    let (admitted, reasons, notes, spec) =
        match admit(env, client.as_ref(), &bundle, &id, None, None) {
            Ok(a) => {
                let spec = a.decision.full_spec();
                (true, a.decision.reasons, a.decision.notes, spec)
            }
            Err((reasons, _)) => {
                // Show the spec as far as it could be hardened, for the operator.
                let spec = partial_spec(env, &bundle, &id);
                (false, reasons, Vec::new(), spec)
            }
        };
    let mut text = String::new();
    if json_out {
        let out = serde_json::json!({"admitted": admitted, "reasons": reasons, "spec": spec});
        text.push_str(&format!("{out}\n"));
    } else {
        text.push_str(if admitted { "admitted\n" } else { "refused\n" });
        for r in &reasons {
            text.push_str(&format!("  reason: {r}\n"));
        }
        for n in &notes {
            text.push_str(&format!("  note: {n}\n"));
        }
        let pretty = serde_json::to_string_pretty(&spec).unwrap_or_else(|_| "null".to_string());
        text.push_str(&format!("{pretty}\n"));
    }
    // A reader that goes away (`| head`) is not an error of the decision: no panic.
    let _ = std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes());
    Outcome::Exit(if admitted { 0 } else { EXIT_REFUSED })
}

/// The spec hardened without a lease (for `check` output after a refusal), or the raw
/// spec, or null.
fn partial_spec(env: &Env, bundle: &Path, id: &str) -> Value {
    let Ok(spec) = bundle::load(bundle, env.cfg.policy.max_config_bytes) else {
        return Value::Null;
    };
    let Ok(profile) = Profile::load(env.cfg.policy.seccomp_profile.as_deref()) else {
        return spec;
    };
    let host = HostFacts::gather(&env.cfg.nvidia_proc_root);
    let runc_root = env.runtime_root();
    let ctx = Context {
        config: &env.cfg,
        seccomp: &profile,
        host: &host,
        lease: None,
        container_id: id,
        systemd_cgroup: env.systemd_cgroup(&spec),
        bundle,
        runc_root: Path::new(&runc_root),
    };
    harden::harden(spec, &ctx).full_spec()
}

/// Exec the plan: mark every fd above `keep_fds_through` close-on-exec (but the
/// runtime's own document runc is to read), clear the environment, exec. Returns only
/// on failure.
pub fn exec_plan(plan: &ExecPlan) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    close_fds_above(plan.keep_fds_through);
    if let Some(fd) = plan.inherit_fd {
        // SAFETY: F_SETFD only changes the close-on-exec flag of a descriptor number
        // this process opened for runc (app::own_document); nothing is read or freed.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } != 0 {
            return std::io::Error::last_os_error();
        }
    }
    let err = std::process::Command::new(&plan.program)
        .arg0("runc")
        .args(&plan.args)
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k, v)))
        .exec();
    std::io::Error::new(
        err.kind(),
        format!("exec {}: {err}", plan.program.display()),
    )
}

pub(crate) fn close_fds_above(keep: i32) {
    // One call on Linux >= 5.11; older kernels (ENOSYS, EINVAL) walk /proc/self/fd.
    if let Ok(first) = u32::try_from(keep.saturating_add(1)) {
        // SAFETY: close_range with CLOSE_RANGE_CLOEXEC closes nothing: it only sets the
        // close-on-exec flag of the open descriptors in [first, u32::MAX].
        let rc =
            unsafe { libc::close_range(first, u32::MAX, libc::CLOSE_RANGE_CLOEXEC as libc::c_int) };
        if rc == 0 {
            return;
        }
    }
    let Ok(rd) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = rd
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
        .filter(|fd| *fd > keep)
        .collect();
    for fd in fds {
        // SAFETY: F_SETFD only sets the close-on-exec flag of a descriptor number; a number
        // that is no longer open (the read_dir's own fd) just fails with EBADF.
        unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
}
