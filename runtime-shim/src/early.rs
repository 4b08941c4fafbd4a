//! `create` and `run` start runc while the spec is still being judged.
//!
//! runc spends several milliseconds (its Go runtime, its command line) before it opens
//! the bundle's `config.json`, and the runtime spends about two deciding what that file
//! will say. The two are done at once:
//!
//! 1. The tenant's `config.json` is read, and a FIFO is renamed over its name. The
//!    runtime holds the FIFO's write end and nothing else does.
//! 2. runc is started with the caller's arguments. It opens `config.json` and waits in
//!    its read of the FIFO, having done nothing to the host: before the spec, runc only
//!    parses its command line and opens its log file.
//! 3. The runtime judges the spec, binds the container, and renames the hardened
//!    `config.json` over the FIFO's name. Then it writes the hardened spec into the FIFO
//!    and closes it. A runc that opened the FIFO reads the hardened spec from it; one that
//!    had not opened it yet opens the hardened file. A write that finds no reader (EPIPE)
//!    means runc has not opened the FIFO, and after the rename it never will.
//! 4. The runtime waits for runc, passes on the signals sent to it, and exits as runc
//!    did.
//!
//! A refusal kills runc (it has read nothing) and, once runc is reaped, puts the
//! tenant's `config.json` back, byte for byte. runc is started with `PR_SET_PDEATHSIG`:
//! a runtime killed before it fed the spec takes runc with it (and one killed later
//! does too, as killing runc did when the runtime exec'd it), and a runtime that dies
//! closes the FIFO, so a runc still reading gets an empty spec and fails.
//!
//! Where a FIFO cannot be made in the bundle, the runtime decides first and execs runc
//! after, as before (see [`EarlyRunc::start`]).

use crate::app::{ExecPlan, close_fds_above};
use crate::bundle::{self, BundleError, CONFIG_JSON};
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
    #[error("putting the tenant's config.json back: {0}")]
    Restore(BundleError),
    #[error("waiting for runc (pid {pid}): {source}")]
    Wait { pid: u32, source: std::io::Error },
}

/// runc, started and waiting in its read of `config.json` (a FIFO) for the spec.
#[derive(Debug)]
pub struct EarlyRunc {
    child: Child,
    /// The FIFO's write end, until the spec is written into it.
    fifo: Option<File>,
    /// `<bundle>/config.json`.
    config: PathBuf,
    /// The tenant's `config.json`, to put back on a refusal.
    tenant: Vec<u8>,
    mode: u32,
    /// The signal mask before [`EarlyRunc::start`] (restored when runc is killed).
    old_mask: SigSet,
    /// The hardened spec went to runc: nothing to undo.
    fed: bool,
    /// runc was killed and reaped, and the tenant's file put back.
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
    /// Put a FIFO in place of `<bundle>/config.json` (whose `tenant` bytes and `mode`
    /// were read), and start runc as `plan` says. From here until runc has ended, the
    /// signals runc would have got are held and then passed on ([`EarlyRunc::wait`]).
    ///
    /// On an error nothing is left behind: no FIFO, the tenant's `config.json` in place,
    /// no runc, the signal mask as it was (but for [`EarlyError::Restore`]: the tenant's
    /// file could not be put back over the FIFO). The caller then decides first and
    /// execs runc after.
    pub fn start(
        bundle: &Path,
        tenant: Vec<u8>,
        mode: u32,
        plan: &ExecPlan,
    ) -> Result<Self, EarlyError> {
        let config = bundle.join(CONFIG_JSON);
        let tmp = bundle.join(format!(
            ".{CONFIG_JSON}.tessera-fifo-{:016x}",
            bundle::temp_suffix()
        ));
        nix::unistd::mkfifo(
            &tmp,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )
        .map_err(|source| EarlyError::Fifo {
            path: tmp.clone(),
            source,
        })?;
        let fifo = match open_write_end(&tmp) {
            Ok(f) => f,
            Err(source) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(EarlyError::Open { path: tmp, source });
            }
        };
        let mut old_mask = SigSet::empty();
        if let Err(e) = nix::sys::signal::pthread_sigmask(
            SigmaskHow::SIG_BLOCK,
            Some(&forwarded()),
            Some(&mut old_mask),
        ) {
            let _ = std::fs::remove_file(&tmp);
            return Err(EarlyError::Mask(e));
        }
        let undo = |e: EarlyError| {
            let _ = std::fs::remove_file(&tmp);
            let _ =
                nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old_mask), None);
            e
        };
        // Renamed over the tenant's file only now: until here a failure leaves it as it
        // was.
        if let Err(source) = std::fs::rename(&tmp, &config) {
            return Err(undo(EarlyError::Rename {
                path: config,
                source,
            }));
        }
        let child = match spawn(plan) {
            Ok(c) => c,
            Err(source) => {
                // runc never ran: the tenant's file goes back in the FIFO's place.
                let e = EarlyError::Spawn {
                    path: plan.program.clone(),
                    source,
                };
                return Err(match put_back(&config, &tenant, mode) {
                    Ok(()) => undo(e),
                    Err(r) => undo(r),
                });
            }
        };
        Ok(Self {
            child,
            fifo: Some(fifo),
            config,
            tenant,
            mode,
            old_mask,
            fed: false,
            aborted: false,
        })
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

    /// Kill runc, which has read no spec, reap it, and put the tenant's `config.json`
    /// back in the FIFO's place (in that order: no runc is left to read it).
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
        // The tenant's file goes back before the FIFO's write end closes: whoever opens
        // config.json from now on gets the file, and a reader of the FIFO an end of
        // file, never a FIFO without a writer to wait on.
        let restored = if self.fed {
            Ok(())
        } else {
            put_back(&self.config, &self.tenant, self.mode)
        };
        self.fifo = None;
        // Last: a signal held meanwhile (a SIGTERM) may end the process now, with the
        // tenant's file back in place.
        let _ =
            nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&self.old_mask), None);
        restored
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
    /// killed and the tenant's file put back. The caller reports a refusal itself; an
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

/// The tenant's `config.json` (`tenant`, `mode`) renamed back over `config`, the FIFO.
fn put_back(config: &Path, tenant: &[u8], mode: u32) -> Result<(), EarlyError> {
    let bundle = config.parent().unwrap_or(Path::new("."));
    bundle::stage_with_mode(bundle, tenant, mode)
        .and_then(bundle::Staged::commit)
        .map_err(EarlyError::Restore)
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
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use std::time::{Duration, Instant};

    const TENANT: &[u8] = b"{\"ociVersion\":\"1.0.2\",\"tenant\":true}";
    const HARDENED: &[u8] = b"{\"ociVersion\":\"1.0.2\",\"hardened\":true}";

    /// A bundle whose config.json is the tenant's, mode 0640.
    fn bundle() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let c = d.path().join(CONFIG_JSON);
        std::fs::write(&c, TENANT).unwrap();
        std::fs::set_permissions(&c, std::fs::Permissions::from_mode(0o640)).unwrap();
        d
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
        EarlyRunc::start(b, TENANT.to_vec(), 0o640, &plan(b, script)).unwrap()
    }

    /// config.json is a regular file holding `want`, with the tenant's mode.
    fn assert_config(b: &Path, want: &[u8]) {
        assert_eq!(std::fs::read(b.join(CONFIG_JSON)).unwrap(), want);
        let meta = std::fs::symlink_metadata(b.join(CONFIG_JSON)).unwrap();
        assert!(meta.file_type().is_file());
        assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
    }

    /// What the runtime does once the spec is admitted: the hardened file over
    /// config.json, then into the FIFO.
    fn admit(bundle: &Path, runc: &mut EarlyRunc) {
        bundle::stage_with_mode(bundle, HARDENED, 0o640)
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
        // runc has config.json open, and it is the FIFO: the tenant's spec is not
        // there to read.
        wait_for(&b.join("marker"));
        let meta = std::fs::symlink_metadata(b.join(CONFIG_JSON)).unwrap();
        assert!(meta.file_type().is_fifo());
        admit(b, &mut runc);
        let status = runc.wait().unwrap();
        assert_eq!(status.code(), Some(7), "runc's exit code is returned");
        assert_eq!(std::fs::read(b.join("got")).unwrap(), HARDENED);
        assert_config(b, HARDENED);
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
        // No reader on the FIFO: the write finds none, and runc reads the file.
        admit(b, &mut runc);
        assert!(runc.wait().unwrap().success());
        assert_eq!(std::fs::read(b.join("got")).unwrap(), HARDENED);
        assert_eq!(names(b), ["config.json", "got"]);
    }

    #[test]
    fn a_refusal_kills_runc_before_it_reads_and_puts_the_tenants_file_back() {
        let d = bundle();
        let b = d.path();
        let mut runc = start(
            b,
            "exec 3< config.json\necho $$ > marker\nexec cat <&3 > got",
        );
        let pid: i32 = wait_for(&b.join("marker")).trim().parse().unwrap();
        assert_eq!(u32::try_from(pid).unwrap(), runc.pid());
        runc.abort().unwrap();
        // Killed and reaped, having read nothing.
        assert!(!Path::new(&format!("/proc/{pid}")).exists());
        assert_eq!(std::fs::read(b.join("got")).unwrap(), b"");
        // The tenant's file, byte for byte, with its mode.
        assert_config(b, TENANT);
        assert_eq!(names(b), ["config.json", "got", "marker"]);
    }

    #[test]
    fn dropped_unfed_it_kills_runc_and_puts_the_tenants_file_back() {
        let d = bundle();
        let b = d.path();
        let runc = start(b, "echo $$ > marker\nexec cat config.json > got");
        let pid: i32 = wait_for(&b.join("marker")).trim().parse().unwrap();
        drop(runc);
        assert!(!Path::new(&format!("/proc/{pid}")).exists());
        assert_eq!(std::fs::read(b.join("got")).unwrap(), b"");
        assert_config(b, TENANT);
    }

    #[test]
    fn a_runc_that_cannot_be_started_leaves_the_bundle_as_it_was() {
        let d = bundle();
        let b = d.path();
        let mut p = plan(b, "");
        p.program = b.join("no-such-runc");
        let e = EarlyRunc::start(b, TENANT.to_vec(), 0o640, &p).unwrap_err();
        assert!(matches!(e, EarlyError::Spawn { .. }), "{e}");
        assert_config(b, TENANT);
        assert_eq!(names(b), ["config.json"]);
        // No FIFO can be made where the bundle is not a directory: nothing changes.
        let e =
            EarlyRunc::start(&b.join("nope"), TENANT.to_vec(), 0o640, &plan(b, "")).unwrap_err();
        assert!(matches!(e, EarlyError::Fifo { .. }), "{e}");
        assert_eq!(names(b), ["config.json"]);
    }
}
