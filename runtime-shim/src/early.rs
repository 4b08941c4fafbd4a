//! `create` and `run` start runc while the spec is still being judged, and every
//! create's runc runs as a child of the runtime, which waits for it.
//!
//! runc is never given the tenant's bundle: it gets the runtime's own bundle directory
//! (root's, 0700, under the state dir; see [`crate::record::Records::bundle_dir`]),
//! whose `config.json` only the runtime writes. Nothing the tenant can write is opened
//! by runc as its spec.
//!
//! runc spends several milliseconds (its Go runtime, its command line) before it opens
//! `config.json`, and the runtime spends about two deciding what that file will say.
//! The two are done at once:
//!
//! 1. A FIFO is made as `config.json` in the runtime's own (fresh, empty) bundle
//!    directory. The runtime holds the FIFO's write end and nothing else does.
//! 2. runc is started. It opens `config.json` and waits in its read of the FIFO,
//!    having done nothing to the host: before the spec, runc only parses its command
//!    line and opens its log file.
//! 3. The runtime judges the spec, binds the container, and renames the hardened
//!    `config.json` over the FIFO's name. Then it writes the hardened spec into the FIFO
//!    and closes it. A runc that opened the FIFO reads the hardened spec from it; one that
//!    had not opened it yet opens the hardened file. A write that finds no reader (EPIPE)
//!    means runc has not opened the FIFO, and after the rename it never will.
//! 4. The runtime waits for runc, passes on the signals sent to it, and then records
//!    how the create ended (see `commands::create`) and exits as runc did.
//!
//! A refusal kills runc (it has read nothing). runc is started with
//! `PR_SET_PDEATHSIG`: a runtime killed before it fed the spec takes runc with it, and
//! a runtime that dies closes the FIFO, so a runc still reading gets an empty spec and
//! fails.
//!
//! Where runc's version is not yet known to be admitted, the runtime decides first,
//! writes `config.json` in its own bundle, and starts runc after
//! ([`EarlyRunc::spawn_decided`]).

use crate::bundle::CONFIG_JSON;
use crate::plan::{ExecPlan, close_fds_above};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use thiserror::Error;

/// Errors of an early start of runc.
#[derive(Debug, Error)]
pub enum EarlyError {
    #[error("making a FIFO at {path}: {source}")]
    Fifo { path: PathBuf, source: nix::Error },
    #[error("opening the FIFO {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("putting a FIFO at {path}: {source}")]
    Rename {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("blocking signals while runc waits: {0}")]
    Mask(nix::Error),
    #[error("exec {path}: {source}")]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing the hardened spec into the FIFO {path}: {source}")]
    Feed {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("waiting for runc (pid {pid}): {source}")]
    Wait { pid: u32, source: std::io::Error },
}

/// runc, started and waiting in its read of `config.json` (a FIFO) for the spec.
#[derive(Debug)]
pub struct EarlyRunc {
    child: Child,
    /// The FIFO's write end, until the spec is written into it.
    fifo: Option<File>,
    /// `<own bundle>/config.json`.
    config: PathBuf,
    /// The signal mask before [`EarlyRunc::start`] (restored when runc is killed).
    old_mask: SigSet,
    /// The hardened spec went to runc: nothing to undo.
    fed: bool,
    /// runc was killed and reaped.
    aborted: bool,
}

/// The signals the runtime passes on to runc: every one a process can catch, but those
/// the runtime's own faults raise (a fault is the runtime's, not runc's), SIGPIPE (ignored
/// here: a reader that went away is an error to report) and SIGCHLD (runc's own end).
/// glibc keeps its two internal real-time signals out of any mask.
fn forwarded() -> SigSet {
    let mut set = SigSet::all();
    for s in [
        Signal::SIGSEGV,
        Signal::SIGBUS,
        Signal::SIGFPE,
        Signal::SIGILL,
        Signal::SIGTRAP,
        Signal::SIGSYS,
        Signal::SIGABRT,
        Signal::SIGPIPE,
        Signal::SIGKILL,
        Signal::SIGSTOP,
    ] {
        set.remove(s);
    }
    set
}

impl EarlyRunc {
    /// Make `<bundle>/config.json` a FIFO (`bundle`: the runtime's own, fresh bundle
    /// directory) and start runc as `plan` says. From here until runc has ended, the
    /// signals runc would have got are held and then passed on ([`EarlyRunc::wait`]).
    ///
    /// On an error nothing is left behind: no FIFO, no runc, the signal mask as it was.
    /// The caller then decides first and starts runc after.
    pub fn start(bundle: &Path, plan: &ExecPlan) -> Result<Self, EarlyError> {
        let config = bundle.join(CONFIG_JSON);
        nix::unistd::mkfifo(
            &config,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )
        .map_err(|source| EarlyError::Fifo {
            path: config.clone(),
            source,
        })?;
        let fifo = match open_write_end(&config) {
            Ok(f) => f,
            Err(source) => {
                let _ = std::fs::remove_file(&config);
                return Err(EarlyError::Open {
                    path: config,
                    source,
                });
            }
        };
        let mut old_mask = SigSet::empty();
        if let Err(e) = nix::sys::signal::pthread_sigmask(
            SigmaskHow::SIG_BLOCK,
            Some(&forwarded()),
            Some(&mut old_mask),
        ) {
            let _ = std::fs::remove_file(&config);
            return Err(EarlyError::Mask(e));
        }
        let child = match spawn(plan) {
            Ok(c) => c,
            Err(source) => {
                let _ = std::fs::remove_file(&config);
                let _ = nix::sys::signal::pthread_sigmask(
                    SigmaskHow::SIG_SETMASK,
                    Some(&old_mask),
                    None,
                );
                return Err(EarlyError::Spawn {
                    path: plan.program.clone(),
                    source,
                });
            }
        };
        Ok(Self {
            child,
            fifo: Some(fifo),
            config,
            old_mask,
            fed: false,
            aborted: false,
        })
    }

    /// Start runc as `plan` says once its spec is decided and written (no FIFO), to
    /// wait for it as for one started early.
    pub fn spawn_decided(plan: &ExecPlan) -> Result<Self, EarlyError> {
        let mut old_mask = SigSet::empty();
        nix::sys::signal::pthread_sigmask(
            SigmaskHow::SIG_BLOCK,
            Some(&forwarded()),
            Some(&mut old_mask),
        )
        .map_err(EarlyError::Mask)?;
        match spawn(plan) {
            Ok(child) => Ok(Self {
                child,
                fifo: None,
                config: PathBuf::new(),
                old_mask,
                fed: true,
                aborted: false,
            }),
            Err(source) => {
                let _ = nix::sys::signal::pthread_sigmask(
                    SigmaskHow::SIG_SETMASK,
                    Some(&old_mask),
                    None,
                );
                Err(EarlyError::Spawn {
                    path: plan.program.clone(),
                    source,
                })
            }
        }
    }

    /// runc's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Hand runc the hardened spec, `bytes`, which the caller has already renamed over
    /// `config.json`. An error (other than runc not reading the FIFO) leaves the caller
    /// to [`EarlyRunc::abort`].
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), EarlyError> {
        let Some(mut fifo) = self.fifo.take() else {
            return Ok(());
        };
        match fifo.write_all(bytes) {
            Ok(()) => {}
            // No reader: runc has not opened the FIFO, and since the rename it opens
            // the hardened file instead. (Or runc ended; `wait` tells.)
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
            Err(source) => {
                return Err(EarlyError::Feed {
                    path: self.config.clone(),
                    source,
                });
            }
        }
        // Closed: runc's read ends at the spec's end.
        drop(fifo);
        self.fed = true;
        Ok(())
    }

    /// Kill runc, which has read no spec, and reap it.
    pub fn abort(&mut self) -> Result<(), EarlyError> {
        if self.aborted {
            return Ok(());
        }
        self.aborted = true;
        let pid = self.child.id();
        if let Err(source) = self.child.kill() {
            // Only fails when runc has already been reaped, which nothing here does.
            return Err(EarlyError::Wait { pid, source });
        }
        if let Err(source) = self.child.wait() {
            return Err(EarlyError::Wait { pid, source });
        }
        self.fifo = None;
        // Last: a signal held meanwhile (a SIGTERM) may end the process now.
        let _ =
            nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&self.old_mask), None);
        Ok(())
    }

    /// Wait for runc to end, passing on each signal sent to this process (by `kill`,
    /// not by a terminal: runc is in the same process group and gets those itself), and
    /// return how it ended.
    pub fn wait(mut self) -> Result<ExitStatus, EarlyError> {
        let pid = self.child.id();
        let mut set = forwarded();
        set.add(Signal::SIGCHLD);
        let Ok(runc) = i32::try_from(pid) else {
            return self
                .child
                .wait()
                .map_err(|source| EarlyError::Wait { pid, source });
        };
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    self.aborted = true;
                    return Ok(status);
                }
                Ok(None) => {}
                Err(source) => return Err(EarlyError::Wait { pid, source }),
            }
            // SAFETY: `info` is a plain C struct that sigtimedwait fills in; `set` is a
            // valid, initialized signal set and `tick` a valid timespec. The signals in
            // the set are blocked in this thread (since `start`), so none is lost
            // between try_wait and the wait. The runtime has no other thread for
            // SIGCHLD to go to; where a process has (tests), the tick bounds the wait.
            let (signo, code) = unsafe {
                let mut info: libc::siginfo_t = std::mem::zeroed();
                let tick = libc::timespec {
                    tv_sec: 1,
                    tv_nsec: 0,
                };
                let signo = libc::sigtimedwait(set.as_ref(), &mut info, &tick);
                (signo, info.si_code)
            };
            if signo < 0 || signo == libc::SIGCHLD {
                continue;
            }
            // SI_USER, SI_QUEUE, SI_TKILL and the like are <= 0; a terminal's signal
            // (SI_KERNEL) reached runc too.
            if code <= 0 {
                // SAFETY: kill with a valid signal number. `runc` is this process's
                // child and is not reaped until try_wait reports it, so its pid cannot
                // have been reused.
                unsafe {
                    libc::kill(runc, signo);
                }
            }
        }
    }
}

impl Drop for EarlyRunc {
    /// Dropped before its spec was fed (a refusal, an early return, a panic): runc is
    /// killed. The caller reports a refusal itself; an
    /// error here can only go to stderr.
    fn drop(&mut self) {
        if !self.fed
            && !self.aborted
            && let Err(e) = self.abort()
        {
            eprintln!("tessera-runtime: {e}");
        }
    }
}

/// The FIFO's write end, without waiting for a reader: the FIFO is opened for reading
/// and writing first (which never waits), then for writing (a reader is there: this
/// process), and the first is closed. runc's open for reading then finds a writer at
/// once, and a write finds no reader until runc has opened it.
fn open_write_end(path: &Path) -> std::io::Result<File> {
    let both = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)?;
    let write = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    drop(both);
    Ok(write)
}

/// Start runc as `plan` says (no stdin of its own: `create` and `run` forward none),
/// dying with this process until it has read its spec.
fn spawn(plan: &ExecPlan) -> std::io::Result<Child> {
    close_fds_above(plan.keep_fds_through);
    let parent = std::process::id();
    let mut cmd = std::process::Command::new(&plan.program);
    cmd.arg0("runc")
        .args(&plan.args)
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k, v)));
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (prctl, getppid, sigprocmask); it touches no memory
    // shared with the parent.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The runtime died before the prctl: runc must not outlive it.
            if u32::try_from(libc::getppid()).ok() != Some(parent) {
                return Err(std::io::Error::other("the runtime has exited"));
            }
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            Ok(())
        });
    }
    cmd.spawn()
}

/// Exit as runc did: with its code, or by its signal (with no core file of this
/// process's own).
pub fn exit_like(status: ExitStatus) -> ! {
    if let Some(code) = status.code() {
        std::process::exit(code);
    }
    let sig = status.signal().unwrap_or(libc::SIGKILL);
    // SAFETY: setrlimit with a valid struct; signal() to SIG_DFL installs no handler;
    // the unblock and raise act on this process alone, which then ends.
    unsafe {
        let none = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &none);
        libc::signal(sig, libc::SIG_DFL);
        let mut one: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut one);
        libc::sigaddset(&mut one, sig);
        libc::sigprocmask(libc::SIG_UNBLOCK, &one, std::ptr::null_mut());
        libc::raise(sig);
    }
    std::process::exit(128 + sig);
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;
    use std::time::{Duration, Instant};

    const HARDENED: &[u8] = b"{\"ociVersion\":\"1.0.2\",\"hardened\":true}";

    /// The runtime's own (empty) bundle directory.
    fn bundle() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    /// A "runc" that runs `script` in the bundle (`sh -c`).
    fn plan(bundle: &Path, script: &str) -> ExecPlan {
        ExecPlan {
            program: PathBuf::from("/bin/sh"),
            args: vec![
                "-c".into(),
                format!("cd \"$1\" || exit 9\n{script}"),
                "runc".into(),
                bundle.to_string_lossy().into_owned(),
            ],
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            keep_fds_through: 2,
            inherit_fd: None,
        }
    }

    fn wait_for(path: &Path) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(s) = std::fs::read_to_string(path)
                && s.ends_with('\n')
            {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "{} never written",
                path.display()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn start(b: &Path, script: &str) -> EarlyRunc {
        EarlyRunc::start(b, &plan(b, script)).unwrap()
    }

    /// What the runtime does once the spec is admitted: the hardened file over
    /// config.json, then into the FIFO.
    fn admit(bundle: &Path, runc: &mut EarlyRunc) {
        crate::bundle::stage_with_mode(bundle, HARDENED, 0o600)
            .unwrap()
            .commit()
            .unwrap();
        runc.feed(HARDENED).unwrap();
    }

    #[test]
    fn a_runc_that_opened_the_fifo_reads_the_hardened_spec_from_it() {
        let d = bundle();
        let b = d.path();
        let mut runc = start(
            b,
            "exec 3< config.json\necho opened > marker\ncat <&3 > got\nexit 7",
        );
        wait_for(&b.join("marker"));
        let meta = std::fs::symlink_metadata(b.join(CONFIG_JSON)).unwrap();
        assert!(meta.file_type().is_fifo());
        admit(b, &mut runc);
        let status = runc.wait().unwrap();
        assert_eq!(status.code(), Some(7), "runc's exit code is returned");
        assert_eq!(std::fs::read(b.join("got")).unwrap(), HARDENED);
        assert_eq!(std::fs::read(b.join(CONFIG_JSON)).unwrap(), HARDENED);
        assert_eq!(names(b), ["config.json", "got", "marker"]);
    }

    #[test]
    fn a_runc_that_opens_config_json_after_the_decision_reads_the_file() {
        let d = bundle();
        let b = d.path();
        let mut runc = start(
            b,
            "while [ -p config.json ]; do sleep 0.01; done\ncat config.json > got",
        );
        admit(b, &mut runc);
        assert!(runc.wait().unwrap().success());
        assert_eq!(std::fs::read(b.join("got")).unwrap(), HARDENED);
        assert_eq!(names(b), ["config.json", "got"]);
    }

    #[test]
    fn a_refusal_kills_runc_before_it_reads_anything() {
        let d = bundle();
        let b = d.path();
        let mut runc = start(
            b,
            "exec 3< config.json\necho $$ > marker\nexec cat <&3 > got",
        );
        let pid: i32 = wait_for(&b.join("marker")).trim().parse().unwrap();
        assert_eq!(u32::try_from(pid).unwrap(), runc.pid());
        runc.abort().unwrap();
        assert!(!Path::new(&format!("/proc/{pid}")).exists());
        assert_eq!(std::fs::read(b.join("got")).unwrap(), b"");
    }

    #[test]
    fn dropped_unfed_it_kills_runc() {
        let d = bundle();
        let b = d.path();
        let runc = start(b, "echo $$ > marker\nexec cat config.json > got");
        let pid: i32 = wait_for(&b.join("marker")).trim().parse().unwrap();
        drop(runc);
        assert!(!Path::new(&format!("/proc/{pid}")).exists());
        assert_eq!(std::fs::read(b.join("got")).unwrap(), b"");
    }

    #[test]
    fn a_runc_that_cannot_be_started_leaves_nothing_behind() {
        let d = bundle();
        let b = d.path();
        let mut p = plan(b, "");
        p.program = b.join("no-such-runc");
        let e = EarlyRunc::start(b, &p).unwrap_err();
        assert!(matches!(e, EarlyError::Spawn { .. }), "{e}");
        assert!(names(b).is_empty());
        let e = EarlyRunc::start(&b.join("nope"), &plan(b, "")).unwrap_err();
        assert!(matches!(e, EarlyError::Fifo { .. }), "{e}");
    }

    #[test]
    fn a_runc_started_after_the_decision_is_waited_for() {
        let d = bundle();
        let b = d.path();
        std::fs::write(b.join(CONFIG_JSON), HARDENED).unwrap();
        let runc = EarlyRunc::spawn_decided(&plan(b, "cat config.json > got\nexit 3")).unwrap();
        assert_eq!(runc.wait().unwrap().code(), Some(3));
        assert_eq!(std::fs::read(b.join("got")).unwrap(), HARDENED);
    }
}
