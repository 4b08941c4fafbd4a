//! The runtime's entry: parse runc's argv, load the runtime's config, check runc's
//! root, then hand the invocation to its command (`crate::commands`), or to runc with
//! the flags as parsed. Returns what `main` must do (exec runc, or exit with a code).

use crate::cli::{self, Command, Invocation};
use crate::commands;
use crate::config::{ConfigError, RuntimeConfig};
use crate::refusal::Refusal;
use crate::runc_root::{RUNC_DEFAULT_ROOT, canonical_root};
use crate::runclog::RuncLog;
use crate::session::Session;
use std::ffi::OsString;
use std::path::PathBuf;

pub use crate::plan::{
    EXIT_CONFIG, EXIT_REFUSED, ExecPlan, Outcome, check_runtime_binary, exec_plan,
};

/// Run the runtime's logic for one invocation (`args`: after the program name).
pub fn run(args: Vec<OsString>) -> Outcome {
    run_as(None, args)
}

/// [`run`], started as `argv0` (the config may be found next to it).
pub fn run_as(argv0: Option<PathBuf>, args: Vec<OsString>) -> Outcome {
    match session(argv0, args) {
        Ok(s) => dispatch(&s),
        Err(out) => out,
    }
}

/// The invocation parsed, the config loaded and runc's root checked; or how the
/// runtime ends when one of them fails.
fn session(argv0: Option<PathBuf>, args: Vec<OsString>) -> Result<Session, Outcome> {
    let mut inv = cli::parse(args).map_err(|e| {
        eprintln!("tessera-runtime: {e}");
        Outcome::Exit(EXIT_REFUSED)
    })?;
    let log = RuncLog::new(inv.global.log.as_deref(), inv.global.log_format.as_deref());
    let cfg = match RuntimeConfig::load_discovered(argv0.as_deref()) {
        Ok((c, _)) => c,
        Err(e) => return Err(config_error(&log, &e)),
    };
    let root = match root_of(&inv) {
        Ok(r) => r,
        Err(e) => {
            let msg = format!("tessera-runtime: {e}");
            eprintln!("{msg}");
            log.error(&msg);
            return Err(Outcome::Exit(EXIT_REFUSED));
        }
    };
    if inv.global.root.is_some() {
        inv.global.root = Some(root.clone());
    }
    Ok(Session {
        inv,
        cfg,
        log,
        root,
    })
}

/// runc's `--root` (or its default), canonical ([`canonical_root`]; as given for
/// `--help` and `--version`). A create makes a missing root.
fn root_of(inv: &Invocation) -> Result<String, crate::runc_root::RootError> {
    let creating = matches!(inv.command, Some((Command::Create | Command::Run, _)));
    let given = inv
        .global
        .root
        .clone()
        .unwrap_or_else(|| RUNC_DEFAULT_ROOT.to_string());
    if inv.global.help_or_version {
        return Ok(given);
    }
    canonical_root(&given, creating)
}

/// The command's own logic, or runc with the flags as parsed.
fn dispatch(s: &Session) -> Outcome {
    let Some((cmd, sub)) = s.inv.command.clone() else {
        if let Some(i) = s.inv.command_index
            && s.inv.argv[i] == "checkpoint"
            && !s.inv.global.help_or_version
        {
            // As restore: runc would run CRIU as root, writing the image wherever the
            // command line says; no checkpoint can be restored through the runtime.
            return s.refuse(
                "checkpoint",
                &Refusal::one("checkpoint is refused: CRIU runs as root and writes where its flags say, and restore is refused"),
            );
        }
        return s.plan(0);
    };
    match cmd {
        Command::Restore => {
            let id = sub.first_positional().unwrap_or_default();
            s.refuse(
                &format!("restore {id}"),
                &Refusal::one("restore is refused: a CRIU image can carry any process state and mounts, outside the policy table"),
            )
        }
        Command::Create | Command::Run => commands::create::run(s, cmd, &sub),
        Command::Exec => commands::exec::run(s, &sub),
        Command::Update => commands::update::run(s, &sub),
        Command::Delete => commands::delete::run(s, sub.first_positional().unwrap_or_default()),
        Command::Check => commands::check::run(s, &sub),
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
        | Command::Features => s.plan(0),
    }
}

fn config_error(log: &RuncLog, e: &ConfigError) -> Outcome {
    let msg = format!("tessera-runtime: bad runtime config: {e}");
    eprintln!("{msg}");
    log.error(&msg);
    Outcome::Exit(EXIT_CONFIG)
}
