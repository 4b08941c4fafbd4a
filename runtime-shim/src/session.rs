//! One invocation of the runtime as every command sees it: what was parsed from argv,
//! the runtime's config, runc's log, and runc's root. It says how to run runc (the
//! [`ExecPlan`]), how to refuse (one line, on stderr and in runc's log) and how to
//! report a refusal to the daemon.

use crate::cli::{self, Command, Invocation, SubArgs};
use crate::config::RuntimeConfig;
use crate::host::HostFacts;
use crate::lease::DaemonClient;
use crate::plan::{EXIT_REFUSED, ExecPlan, Outcome, RUNC_PATH_ENV, check_runtime_binary};
use crate::private_file::FileError;
use crate::record::{Record, RecordError, Records};
use crate::refusal::Refusal;
use crate::runclog::RuncLog;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;
use thiserror::Error;

/// Where, under the state dir, the documents the runtime hands runc are made (and
/// unlinked at once).
pub const DOCUMENTS_DIR: &str = "documents";

/// Errors of what a session reads and writes for its commands.
#[derive(Debug, Error)]
pub enum SessionError {
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error("container {id}: runc's state: {reason}")]
    RuncState {
        id: String,
        reason: crate::harden::identity::RuncStateError,
    },
    #[error("writing the document for runc: {0}")]
    Document(#[source] FileError),
}

/// The invocation, parsed and checked, with what every command needs.
pub struct Session {
    pub inv: Invocation,
    pub cfg: RuntimeConfig,
    pub log: RuncLog,
    /// runc's `--root` (or its default), canonical where it exists
    /// ([`crate::runc_root::canonical_root`]).
    pub root: String,
}

impl Session {
    /// Refuse in one line, once on stderr and once as the last error of runc's log
    /// (containerd and conmon show that line); reasons left out of it go to the log
    /// first, as a warning.
    pub fn refuse(&self, what: &str, refusal: &Refusal) -> Outcome {
        let (line, cut) = refusal.line(what);
        if cut {
            self.log.warn(&format!(
                "tessera-runtime: {what}: every reason: {}",
                refusal.reasons.join("; ").replace(['\n', '\r'], " ")
            ));
        }
        eprintln!("{line}");
        self.log.error(&line);
        Outcome::Exit(EXIT_REFUSED)
    }

    /// Report a refusal to the daemon (audit, best effort), then refuse.
    pub fn refuse_reported(
        &self,
        client: Option<&DaemonClient>,
        id: &str,
        cmd: &str,
        what: &str,
        refusal: &Refusal,
    ) -> Outcome {
        self.report(client, id, &refusal.lease_id, false, &refusal.reasons, cmd);
        self.refuse(what, refusal)
    }

    /// An error the command cannot go on after: on stderr and in runc's log, exit 1.
    pub fn fail(&self, what: &str, e: &dyn std::fmt::Display) -> Outcome {
        let msg = format!("tessera-runtime: {what}: {e}");
        eprintln!("{msg}");
        self.log.error(&msg);
        Outcome::Exit(EXIT_REFUSED)
    }

    /// Tell the daemon how an admission ended: best effort, and only when a daemon
    /// socket is there to answer.
    pub fn report(
        &self,
        client: Option<&DaemonClient>,
        id: &str,
        lease_id: &str,
        ok: bool,
        reasons: &[String],
        cmd: &str,
    ) {
        if let Some(c) = client
            && let Err(e) = c.report(id, lease_id, ok, reasons, cmd)
        {
            self.log
                .warn(&format!("tessera-runtime: ReportAdmission failed: {e}"));
        }
    }

    /// A daemon client, or `None` when the daemon's socket is not there (no RPC runtime
    /// is built for containers that will not talk to the daemon).
    pub fn client(&self) -> Option<DaemonClient> {
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
    pub fn systemd_cgroup(&self, spec: &Value) -> bool {
        let checking = matches!(self.inv.command, Some((Command::Check, _)));
        self.inv.global.systemd_cgroup
            || (checking
                && spec
                    .pointer("/linux/cgroupsPath")
                    .and_then(Value::as_str)
                    .is_some_and(|p| p.contains(':')))
    }

    /// runc's root, as the runtime hands it to runc.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// The container records of this runtime.
    pub fn records(&self) -> Records {
        Records::new(&self.cfg.state_dir)
    }

    /// The plan to run runc for a create-like command, given the runtime's own bundle
    /// directory in place of the caller's `--bundle`.
    pub fn plan_own_bundle(&self, cmd: Command, sub: &SubArgs, own: &Path, keep: i32) -> Outcome {
        let mut sub = sub.clone();
        sub.flags.retain(|f| f.name != "bundle");
        sub.flags
            .push(flag("bundle", own.to_string_lossy().into_owned()));
        let args = self.inv.rebuilt_args(cmd, &sub, &[]);
        self.plan_with_args(args, keep, None)
    }

    /// The plan to run runc with the argv the runtime rebuilt from what it parsed
    /// (a command it does not parse: the global flags rebuilt, the rest as given).
    pub fn plan(&self, keep_extra: i32) -> Outcome {
        let args = match &self.inv.command {
            Some((cmd, sub)) => self.inv.rebuilt_args(*cmd, sub, &[]),
            None => self.inv.passthrough_args(),
        };
        self.plan_with_args(args, keep_extra, None)
    }

    /// The plan to run runc on `id` with only `forwarded` flags and one more, `name`,
    /// naming the runtime's own document (`fd`) that runc inherits.
    pub fn plan_with_document(
        &self,
        cmd: Command,
        mut forwarded: SubArgs,
        name: &'static str,
        (fd, path): (i32, String),
        keep_extra: i32,
    ) -> Outcome {
        forwarded.flags.push(flag(name, path));
        let args = self.inv.rebuilt_args(cmd, &forwarded, &[]);
        self.plan_with_args(args, keep_extra, Some(fd))
    }

    fn plan_with_args(
        &self,
        args: Vec<String>,
        keep_extra: i32,
        inherit_fd: Option<i32>,
    ) -> Outcome {
        if let Err(e) = check_runtime_binary(&self.cfg.runc_path) {
            return self.refuse("exec of the real runtime", &e.into());
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

    /// The container's record of its create, checked to be the record of the container
    /// runc has under the root now (its init, as runc's state.json says); an error when
    /// there is none, or it is another's.
    pub fn record_of(&self, id: &str) -> Result<Record, SessionError> {
        let record = self.records().get(&self.root, id)?;
        let state =
            crate::harden::identity::read_state(&HostFacts::default(), Path::new(&self.root), id)
                .map_err(|reason| SessionError::RuncState {
                id: id.to_string(),
                reason,
            })?;
        record.matches(state.init_pid, state.init_start)?;
        Ok(record)
    }

    /// Hand runc a document the runtime wrote: a root-owned 0600 file under the state
    /// dir, unlinked at once, that runc opens as `/proc/self/fd/N` (N above the fds it
    /// passes on to the container). Returns N and that path.
    pub fn own_document(
        &self,
        bytes: &[u8],
        keep_extra: i32,
    ) -> Result<(i32, String), SessionError> {
        use std::os::fd::IntoRawFd;
        let fd = crate::private_file::unlinked(
            &self.cfg.state_dir.join(DOCUMENTS_DIR),
            bytes,
            3 + keep_extra,
        )
        .map_err(SessionError::Document)?;
        // Kept open (close-on-exec cleared at exec) for runc to read.
        let raw = fd.into_raw_fd();
        Ok((raw, format!("/proc/self/fd/{raw}")))
    }
}

/// A flag the runtime adds to runc's command line.
fn flag(name: &'static str, value: String) -> cli::FlagUse {
    cli::FlagUse {
        name,
        value,
        index: 0,
        value_index: None,
    }
}

/// The caller's `--bundle` (the current directory when none is given).
pub fn bundle_dir(sub: &SubArgs) -> PathBuf {
    sub.value("bundle")
        .filter(|b| !b.is_empty())
        .map_or_else(|| PathBuf::from("."), PathBuf::from)
}
