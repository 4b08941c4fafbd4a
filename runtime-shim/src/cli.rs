//! runc's command line, parsed the way runc (urfave/cli v1 over Go's `flag`) parses it,
//! while keeping the original argv so that anything not changed passes through untouched.
//!
//! Go's flag syntax: `-name`, `--name`, `-name=value`, `--name=value`, `-name value` for
//! value flags; bool flags take no separate value (`-d`, `--detach=false`). `--` ends the
//! flags. urfave/cli v1 moves flags that follow positional arguments in front of them
//! (so `create ID --bundle B` works), except for commands with `SkipArgReorder` (`exec`,
//! whose command line after the container id belongs to the process).

use thiserror::Error;

/// Errors of the command-line parser.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CliError {
    #[error("{command}: unknown flag {flag}")]
    UnknownFlag { command: String, flag: String },
    #[error("{command}: flag {flag} needs a value")]
    MissingValue { command: String, flag: String },
    #[error("{command}: flag {flag} takes true or false, not {value:?}")]
    BadBool {
        command: String,
        flag: String,
        value: String,
    },
    #[error("{command}: the container id is missing")]
    MissingId { command: String },
    #[error("unknown command {command:?}")]
    UnknownCommand { command: String },
    #[error("argument {index} is not valid UTF-8")]
    NotUtf8 { index: usize },
    #[error(
        "{command}: flag --{flag} is given more than once (runc would take the last); give it once"
    )]
    Repeated { command: String, flag: String },
    #[error("{command}: flag {flag} is refused: {why}")]
    Refused {
        command: String,
        flag: String,
        why: &'static str,
    },
}

/// Whether a flag takes a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Bool,
    Value,
}

struct FlagSpec {
    names: &'static [&'static str],
    kind: Kind,
    /// runc takes every use (a string or int slice), not only the last.
    repeatable: bool,
}

const fn b(names: &'static [&'static str]) -> FlagSpec {
    FlagSpec {
        names,
        kind: Kind::Bool,
        repeatable: false,
    }
}
const fn v(names: &'static [&'static str]) -> FlagSpec {
    FlagSpec {
        names,
        kind: Kind::Value,
        repeatable: false,
    }
}
const fn many(names: &'static [&'static str]) -> FlagSpec {
    FlagSpec {
        names,
        kind: Kind::Value,
        repeatable: true,
    }
}

/// runc 1.1's global flags.
const GLOBAL: &[FlagSpec] = &[
    b(&["debug"]),
    v(&["log"]),
    v(&["log-format"]),
    v(&["root"]),
    v(&["criu"]),
    b(&["systemd-cgroup"]),
    v(&["rootless"]),
    b(&["help", "h"]),
    b(&["version", "v"]),
];

const CREATE: &[FlagSpec] = &[
    v(&["bundle", "b"]),
    v(&["console-socket"]),
    v(&["pid-file"]),
    b(&["no-pivot"]),
    b(&["no-new-keyring"]),
    v(&["preserve-fds"]),
    b(&["help", "h"]),
];

const RUN: &[FlagSpec] = &[
    v(&["bundle", "b"]),
    v(&["console-socket"]),
    b(&["detach", "d"]),
    b(&["keep"]),
    v(&["pid-file"]),
    b(&["no-subreaper"]),
    b(&["no-pivot"]),
    b(&["no-new-keyring"]),
    v(&["preserve-fds"]),
    b(&["help", "h"]),
];

const EXEC: &[FlagSpec] = &[
    v(&["console-socket"]),
    v(&["cwd"]),
    many(&["env", "e"]),
    b(&["tty", "t"]),
    v(&["user", "u"]),
    many(&["additional-gids", "g"]),
    v(&["process", "p"]),
    b(&["detach", "d"]),
    v(&["pid-file"]),
    v(&["process-label"]),
    v(&["apparmor"]),
    b(&["no-new-privs"]),
    many(&["cap", "c"]),
    v(&["preserve-fds"]),
    v(&["cgroup"]),
    b(&["ignore-paused"]),
    b(&["help", "h"]),
];

const UPDATE: &[FlagSpec] = &[
    v(&["resources", "r"]),
    v(&["blkio-weight"]),
    v(&["cpu-period"]),
    v(&["cpu-quota"]),
    v(&["cpu-share"]),
    v(&["cpu-rt-period"]),
    v(&["cpu-rt-runtime"]),
    v(&["cpuset-cpus"]),
    v(&["cpuset-mems"]),
    v(&["kernel-memory"]),
    v(&["kernel-memory-tcp"]),
    v(&["memory"]),
    v(&["cpu-idle"]),
    v(&["memory-reservation"]),
    v(&["memory-swap"]),
    v(&["pids-limit"]),
    v(&["l3-cache-schema"]),
    v(&["mem-bw-schema"]),
    b(&["help", "h"]),
];

const RESTORE: &[FlagSpec] = &[
    v(&["console-socket"]),
    v(&["image-path"]),
    v(&["work-path"]),
    b(&["tcp-established"]),
    b(&["ext-unix-sk"]),
    b(&["shell-job"]),
    b(&["file-locks"]),
    v(&["manage-cgroups-mode"]),
    v(&["bundle", "b"]),
    b(&["detach", "d"]),
    v(&["pid-file"]),
    b(&["no-subreaper"]),
    b(&["no-pivot"]),
    v(&["empty-ns"]),
    b(&["auto-dedup"]),
    b(&["lazy-pages"]),
    v(&["lsm-profile"]),
    v(&["lsm-mount-context"]),
    b(&["help", "h"]),
];

const DELETE: &[FlagSpec] = &[b(&["force", "f"]), b(&["help", "h"])];

const HELP_ONLY: &[FlagSpec] = &[b(&["help", "h"])];
const KILL: &[FlagSpec] = &[b(&["all", "a"]), b(&["help", "h"])];
const PS: &[FlagSpec] = &[v(&["format", "f"]), b(&["help", "h"])];
const EVENTS: &[FlagSpec] = &[v(&["interval"]), b(&["stats"]), b(&["help", "h"])];
const LIST: &[FlagSpec] = &[v(&["format", "f"]), b(&["quiet", "q"]), b(&["help", "h"])];
const SPEC: &[FlagSpec] = &[v(&["bundle", "b"]), b(&["rootless"]), b(&["help", "h"])];

/// `tessera-runtime check`: our own subcommand.
const CHECK: &[FlagSpec] = &[
    v(&["bundle", "b"]),
    b(&["json"]),
    v(&["id"]),
    b(&["help", "h"]),
];

/// The subcommands of runc (and `check`, the runtime's own), each parsed with the
/// flags runc takes for it. `help` and `checkpoint` are not parsed (the first passes
/// through, the runtime refuses the second); any other name is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Create,
    Run,
    Exec,
    Update,
    Restore,
    Delete,
    Check,
    Start,
    Kill,
    State,
    Pause,
    Resume,
    Ps,
    Events,
    List,
    Spec,
    Features,
}

impl Command {
    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "create" => Self::Create,
            "run" => Self::Run,
            "exec" => Self::Exec,
            "update" => Self::Update,
            "restore" => Self::Restore,
            "delete" => Self::Delete,
            "check" => Self::Check,
            "start" => Self::Start,
            "kill" => Self::Kill,
            "state" => Self::State,
            "pause" => Self::Pause,
            "resume" => Self::Resume,
            "ps" => Self::Ps,
            "events" => Self::Events,
            "list" => Self::List,
            "spec" => Self::Spec,
            "features" => Self::Features,
            _ => return None,
        })
    }

    /// The name as runc spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Run => "run",
            Self::Exec => "exec",
            Self::Update => "update",
            Self::Restore => "restore",
            Self::Delete => "delete",
            Self::Check => "check",
            Self::Start => "start",
            Self::Kill => "kill",
            Self::State => "state",
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Ps => "ps",
            Self::Events => "events",
            Self::List => "list",
            Self::Spec => "spec",
            Self::Features => "features",
        }
    }

    fn flags(self) -> &'static [FlagSpec] {
        match self {
            Self::Create => CREATE,
            Self::Run => RUN,
            Self::Exec => EXEC,
            Self::Update => UPDATE,
            Self::Restore => RESTORE,
            Self::Delete => DELETE,
            Self::Check => CHECK,
            Self::Start | Self::State | Self::Pause | Self::Resume | Self::Features => HELP_ONLY,
            Self::Kill => KILL,
            Self::Ps => PS,
            Self::Events => EVENTS,
            Self::List => LIST,
            Self::Spec => SPEC,
        }
    }

    /// runc's `exec` and `ps` set urfave's SkipArgReorder: flags end at the container
    /// id (what follows is the process's command line, or `ps`'s options).
    fn reorders(self) -> bool {
        !matches!(self, Self::Exec | Self::Ps)
    }

    /// Whether runc needs a container id after the command.
    fn takes_id(self) -> bool {
        !matches!(self, Self::Check | Self::List | Self::Spec | Self::Features)
    }
}

/// One flag as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlagUse {
    /// The canonical (first, long) name.
    pub name: &'static str,
    /// The value (`"true"`/`"false"` for bool flags).
    pub value: String,
    /// Index in argv of the flag token.
    pub index: usize,
    /// Index in argv of a separate value token (`--flag value`), if any.
    pub value_index: Option<usize>,
}

/// The parsed flags and positional arguments of one subcommand.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubArgs {
    pub flags: Vec<FlagUse>,
    /// Positional arguments, in order, with their argv index.
    pub positionals: Vec<(usize, String)>,
}

impl SubArgs {
    /// The last value of a value flag (Go's flag package keeps the last).
    pub fn value(&self, name: &str) -> Option<&str> {
        self.flags
            .iter()
            .rev()
            .find(|f| f.name == name)
            .map(|f| f.value.as_str())
    }

    /// Every value given for a flag (for repeatable flags such as `--cap`).
    pub fn values(&self, name: &str) -> Vec<&str> {
        self.flags
            .iter()
            .filter(|f| f.name == name)
            .map(|f| f.value.as_str())
            .collect()
    }

    /// Whether a bool flag is set (its last use wins).
    pub fn is_set(&self, name: &str) -> bool {
        self.value(name) == Some("true")
    }

    /// The first positional argument: the container id for runc's commands.
    pub fn first_positional(&self) -> Option<&str> {
        self.positionals.first().map(|(_, s)| s.as_str())
    }
}

/// runc's global options that tessera-runtime uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Global {
    pub root: Option<String>,
    pub log: Option<String>,
    pub log_format: Option<String>,
    pub systemd_cgroup: bool,
    pub debug: bool,
    /// `--rootless` (true, false or auto).
    pub rootless: Option<String>,
    pub help: bool,
    pub version: bool,
    /// `--help` or `--version` was given: pass through.
    pub help_or_version: bool,
}

impl Global {
    /// The global flags as the runtime gives them to runc: what it parsed, one
    /// spelling each (`--name=value`), in a fixed order.
    pub fn args(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.help {
            out.push("--help".to_string());
        }
        if self.version {
            out.push("--version".to_string());
        }
        if self.debug {
            out.push("--debug".to_string());
        }
        for (name, v) in [
            ("root", &self.root),
            ("log", &self.log),
            ("log-format", &self.log_format),
            ("rootless", &self.rootless),
        ] {
            if let Some(v) = v {
                out.push(format!("--{name}={v}"));
            }
        }
        if self.systemd_cgroup {
            out.push("--systemd-cgroup".to_string());
        }
        out
    }
}

impl FlagUse {
    /// The flag as the runtime gives it to runc: `--name=value`, or `--name` for a
    /// set bool (`--name=false` for one set false).
    pub fn arg(&self) -> String {
        if self.value == "true" && is_bool(self.name) {
            format!("--{}", self.name)
        } else {
            format!("--{}={}", self.name, self.value)
        }
    }
}

fn is_bool(name: &str) -> bool {
    [
        CREATE, RUN, EXEC, UPDATE, DELETE, GLOBAL, KILL, EVENTS, LIST, SPEC, HELP_ONLY,
    ]
    .iter()
    .flat_map(|t| t.iter())
    .any(|s| s.kind == Kind::Bool && s.names[0] == name)
}

/// `--` before positional arguments when one could be read as a flag.
fn positional_args(out: &mut Vec<String>, positionals: &[String]) {
    if positionals.iter().any(|p| p.starts_with('-')) {
        out.push("--".to_string());
    }
    out.extend(positionals.iter().cloned());
}

/// A parsed invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// The arguments after the program name, exactly as given.
    pub argv: Vec<String>,
    pub global: Global,
    /// Index in argv of the subcommand name, if there is one.
    pub command_index: Option<usize>,
    /// The subcommand tessera-runtime acts on; `None` for pass-through.
    pub command: Option<(Command, SubArgs)>,
}

impl Invocation {
    /// runc's argv for a command that passes through (not parsed): the global flags
    /// as the runtime parsed them, then the command and its arguments as given.
    pub fn passthrough_args(&self) -> Vec<String> {
        let mut out = self.global.args();
        if let Some(ci) = self.command_index {
            out.extend(self.argv[ci..].iter().cloned());
        }
        out
    }

    /// runc's argv for a parsed command, rebuilt from what was parsed: the global
    /// flags, the command, its flags in the order given (one spelling each; those in
    /// `drop` left out), then its positional arguments (after `--` when one starts
    /// with `-`).
    pub fn rebuilt_args(&self, cmd: Command, sub: &SubArgs, drop: &[&str]) -> Vec<String> {
        let mut out = self.global.args();
        out.push(cmd.name().to_string());
        out.extend(
            sub.flags
                .iter()
                .filter(|f| !drop.contains(&f.name))
                .map(FlagUse::arg),
        );
        let pos: Vec<String> = sub.positionals.iter().map(|(_, p)| p.clone()).collect();
        positional_args(&mut out, &pos);
        out
    }
}

fn parse_bool(command: &str, flag: &str, value: &str) -> Result<bool, CliError> {
    // Go's strconv.ParseBool.
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(CliError::BadBool {
            command: command.to_string(),
            flag: flag.to_string(),
            value: value.to_string(),
        }),
    }
}

/// Split `-name`, `--name`, `-name=value` into (name, inline value); `None` if not a flag.
fn flag_token(tok: &str) -> Option<(&str, Option<&str>)> {
    let body = tok.strip_prefix("--").or_else(|| tok.strip_prefix('-'))?;
    if body.is_empty() || body.starts_with('-') || body.starts_with('=') {
        return None;
    }
    Some(match body.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (body, None),
    })
}

/// Parse flags from `argv[start..]` against `specs`. Returns the flags, positionals and
/// the index where parsing stopped (only for `stop_at_positional`).
fn parse_flags(
    command: &str,
    argv: &[String],
    start: usize,
    specs: &[FlagSpec],
    reorder: bool,
    stop_at_positional: bool,
) -> Result<(SubArgs, usize), CliError> {
    let mut out = SubArgs::default();
    let mut i = start;
    let mut flags_done = false;
    while i < argv.len() {
        let tok = &argv[i];
        if flags_done {
            out.positionals.push((i, tok.clone()));
            i += 1;
            continue;
        }
        if tok == "--" {
            flags_done = true;
            i += 1;
            continue;
        }
        let Some((name, inline)) = flag_token(tok) else {
            if stop_at_positional {
                return Ok((out, i));
            }
            out.positionals.push((i, tok.clone()));
            if !reorder {
                flags_done = true;
            }
            i += 1;
            continue;
        };
        let flag = flag_use(command, argv, i, (name, inline), specs, &out.flags)?;
        i = flag.value_index.unwrap_or(flag.index) + 1;
        out.flags.push(flag);
    }
    Ok((out, i))
}

/// The flag at `argv[i]` (`name`, with its `inline` value if `--name=value`): known to
/// the command, not repeated unless it may be, with its value (the next argument
/// for a value flag given without one).
fn flag_use(
    command: &str,
    argv: &[String],
    i: usize,
    (name, inline): (&str, Option<&str>),
    specs: &[FlagSpec],
    seen: &[FlagUse],
) -> Result<FlagUse, CliError> {
    let tok = &argv[i];
    let Some(spec) = specs.iter().find(|s| s.names.contains(&name)) else {
        return Err(CliError::UnknownFlag {
            command: command.to_string(),
            flag: tok.clone(),
        });
    };
    let canonical = spec.names[0];
    if !spec.repeatable && seen.iter().any(|f| f.name == canonical) {
        return Err(CliError::Repeated {
            command: command.to_string(),
            flag: canonical.to_string(),
        });
    }
    let (value, value_index) = match (spec.kind, inline) {
        (Kind::Bool, Some(v)) => (parse_bool(command, tok, v)?.to_string(), None),
        (Kind::Bool, None) => (true.to_string(), None),
        (Kind::Value, Some(v)) => (v.to_string(), None),
        (Kind::Value, None) => {
            let Some(v) = argv.get(i + 1) else {
                return Err(CliError::MissingValue {
                    command: command.to_string(),
                    flag: tok.clone(),
                });
            };
            (v.clone(), Some(i + 1))
        }
    };
    Ok(FlagUse {
        name: canonical,
        value,
        index: i,
        value_index,
    })
}

/// Parse the arguments after the program name.
pub fn parse(args: Vec<std::ffi::OsString>) -> Result<Invocation, CliError> {
    let argv = args
        .into_iter()
        .enumerate()
        .map(|(i, a)| a.into_string().map_err(|_| CliError::NotUtf8 { index: i }))
        .collect::<Result<Vec<_>, _>>()?;
    parse_strings(argv)
}

/// Parse already-decoded arguments (after the program name).
pub fn parse_strings(argv: Vec<String>) -> Result<Invocation, CliError> {
    let (gflags, cmd_at) = parse_flags("runc", &argv, 0, GLOBAL, false, true)?;
    let mut global = Global::default();
    for f in &gflags.flags {
        match f.name {
            "root" => global.root = Some(f.value.clone()),
            "log" => global.log = Some(f.value.clone()),
            "log-format" => global.log_format = Some(f.value.clone()),
            "systemd-cgroup" => global.systemd_cgroup = f.value == "true",
            "debug" => global.debug = f.value == "true",
            "rootless" => {
                if !matches!(f.value.as_str(), "true" | "false" | "auto") {
                    return Err(CliError::Refused {
                        command: "runc".to_string(),
                        flag: format!("--rootless={}", f.value),
                        why: "true, false or auto only",
                    });
                }
                global.rootless = Some(f.value.clone());
            }
            "criu" => {
                return Err(CliError::Refused {
                    command: "runc".to_string(),
                    flag: "--criu".to_string(),
                    why: "runc would run that program as root (checkpoint and restore are not the tenant's)",
                });
            }
            "help" => global.help |= f.value == "true",
            "version" => global.version |= f.value == "true",
            _ => {}
        }
    }
    global.help_or_version = global.help || global.version;
    let command_index = (cmd_at < argv.len()).then_some(cmd_at);
    let mut command = None;
    if let Some(ci) = command_index
        && !global.help_or_version
        && Command::from_name(&argv[ci]).is_none()
        && !matches!(argv[ci].as_str(), "help" | "h" | "checkpoint")
    {
        return Err(CliError::UnknownCommand {
            command: argv[ci].clone(),
        });
    }
    if let Some(ci) = command_index
        && !global.help_or_version
        && let Some(cmd) = Command::from_name(&argv[ci])
    {
        let (sub, _) = parse_flags(
            cmd.name(),
            &argv,
            ci + 1,
            cmd.flags(),
            cmd.reorders(),
            false,
        )?;
        if !sub.is_set("help") {
            if cmd.takes_id() && sub.positionals.is_empty() {
                return Err(CliError::MissingId {
                    command: cmd.name().to_string(),
                });
            }
            command = Some((cmd, sub));
        }
    }
    Ok(Invocation {
        argv,
        global,
        command_index,
        command,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn p(s: &str) -> Invocation {
        parse_strings(s.split_whitespace().map(String::from).collect()).unwrap()
    }

    #[test]
    fn containerd_create_line() {
        let inv = p(
            "--root /run/containerd/runc/k8s.io --log /b/log.json --log-format json --systemd-cgroup create --bundle /b --pid-file /b/init.pid --console-socket /tmp/s.sock abc",
        );
        assert_eq!(
            inv.global.root.as_deref(),
            Some("/run/containerd/runc/k8s.io")
        );
        assert_eq!(inv.global.log.as_deref(), Some("/b/log.json"));
        assert_eq!(inv.global.log_format.as_deref(), Some("json"));
        assert!(inv.global.systemd_cgroup);
        let (cmd, sub) = inv.command.unwrap();
        assert_eq!(cmd, Command::Create);
        assert_eq!(sub.value("bundle"), Some("/b"));
        assert_eq!(sub.value("pid-file"), Some("/b/init.pid"));
        assert_eq!(sub.first_positional(), Some("abc"));
    }

    #[test]
    fn every_spelling_of_bundle() {
        for line in [
            "create -b /x id",
            "create --bundle /x id",
            "create --bundle=/x id",
            "create -bundle /x id",
            "create -b=/x id",
            "create id --bundle /x",
            "-root=/r create id -b /x",
        ] {
            let inv = p(line);
            let (_, sub) = inv.command.unwrap();
            assert_eq!(sub.value("bundle"), Some("/x"), "{line}");
            assert_eq!(sub.first_positional(), Some("id"), "{line}");
        }
    }

    #[test]
    fn bools_and_terminator() {
        let inv = p("run -d --keep=false --no-pivot -- myid");
        let (cmd, sub) = inv.command.unwrap();
        assert_eq!(cmd, Command::Run);
        assert!(sub.is_set("detach"));
        assert!(!sub.is_set("keep"));
        assert!(sub.is_set("no-pivot"));
        assert_eq!(sub.first_positional(), Some("myid"));
        assert!(parse_strings(vec!["run".into(), "--detach=maybe".into(), "x".into()]).is_err());
    }

    #[test]
    fn exec_stops_flags_at_the_id() {
        let inv = p("exec -t --cap CAP_SYS_ADMIN id sh -c --cap");
        let (cmd, sub) = inv.command.unwrap();
        assert_eq!(cmd, Command::Exec);
        assert_eq!(sub.values("cap"), vec!["CAP_SYS_ADMIN"]);
        let pos: Vec<_> = sub.positionals.iter().map(|(_, s)| s.as_str()).collect();
        assert_eq!(pos, ["id", "sh", "-c", "--cap"]);
    }

    #[test]
    fn unknown_flag_in_intercepted_command_is_an_error() {
        let r = parse_strings(vec!["create".into(), "--bogus".into(), "id".into()]);
        assert!(matches!(r, Err(CliError::UnknownFlag { .. })));
        assert!(matches!(
            parse_strings(vec!["create".into(), "--bundle".into()]),
            Err(CliError::MissingValue { .. })
        ));
        assert!(matches!(
            parse_strings(vec!["create".into(), "-b".into(), "/x".into()]),
            Err(CliError::MissingId { .. })
        ));
    }

    #[test]
    fn every_runc_command_is_parsed_help_passes_and_unknown_ones_are_errors() {
        let inv = p("--root /r kill --all id KILL");
        let (cmd, sub) = inv.command.clone().unwrap();
        assert_eq!(cmd, Command::Kill);
        assert_eq!(
            inv.rebuilt_args(cmd, &sub, &[]),
            ["--root=/r", "kill", "--all", "id", "KILL"]
        );
        let inv = p("ps -f json id -ef");
        let (cmd, sub) = inv.command.clone().unwrap();
        assert_eq!(
            inv.rebuilt_args(cmd, &sub, &[]),
            ["ps", "--format=json", "--", "id", "-ef"]
        );
        for line in [
            "list -q",
            "spec --rootless",
            "features",
            "state id",
            "events --stats id",
        ] {
            assert!(p(line).command.is_some(), "{line}");
        }
        let inv = p("--version");
        assert!(inv.global.help_or_version);
        assert!(inv.command.is_none());
        assert!(p("help exec").command.is_none());
        assert!(p("checkpoint id").command.is_none());
        let e = parse_strings(vec!["pwn".into(), "id".into()]).unwrap_err();
        assert_eq!(
            e,
            CliError::UnknownCommand {
                command: "pwn".into()
            }
        );
        assert!(parse_strings(vec!["kill".into(), "--signal".into(), "id".into()]).is_err());
    }

    #[test]
    fn runc_gets_the_flags_as_parsed_one_spelling_each() {
        let inv = p(
            "-root /r --log=/l -log-format json -systemd-cgroup create -b /x --pid-file=/p --console-socket /s id",
        );
        let (cmd, sub) = inv.command.clone().unwrap();
        assert_eq!(
            inv.rebuilt_args(cmd, &sub, &[]),
            [
                "--root=/r",
                "--log=/l",
                "--log-format=json",
                "--systemd-cgroup",
                "create",
                "--bundle=/x",
                "--pid-file=/p",
                "--console-socket=/s",
                "id"
            ]
        );
        let inv = p("--root /r delete -force -- -odd");
        let (cmd, sub) = inv.command.clone().unwrap();
        assert_eq!(
            inv.rebuilt_args(cmd, &sub, &[]),
            ["--root=/r", "delete", "--force", "--", "-odd"]
        );
        let inv = p("-root /r kill --all abc KILL");
        assert_eq!(
            inv.passthrough_args(),
            ["--root=/r", "kill", "--all", "abc", "KILL"]
        );
    }

    #[test]
    fn repeated_unknown_and_refused_flags_are_errors() {
        let e = |s: &str| parse_strings(s.split_whitespace().map(String::from).collect());
        for (line, want) in [
            (
                "--root /a --root /b exec c1 sh",
                "--root is given more than once",
            ),
            (
                "-root /a --root=/b state c1",
                "--root is given more than once",
            ),
            (
                "update -r /a --resources /b c1",
                "--resources is given more than once",
            ),
            (
                "update --pids-limit 5 --pids-limit -1 c1",
                "--pids-limit is given more than once",
            ),
            (
                "exec -u 1000 --user 0 c1 sh",
                "--user is given more than once",
            ),
            (
                "exec -p /a --process=/b c1",
                "--process is given more than once",
            ),
            (
                "create -b /a --bundle /b c1",
                "--bundle is given more than once",
            ),
            ("--bogus kill c1", "unknown flag --bogus"),
            ("--criu /tmp/x checkpoint c1", "--criu is refused"),
            ("--rootless=maybe list", "--rootless=maybe is refused"),
        ] {
            let err = e(line).unwrap_err().to_string();
            assert!(err.contains(want), "{line}: {err}");
        }
        // Repeatable ones (slices in runc) are not.
        let inv = p("exec -e A=1 --env B=2 -g 1 -g 2 c1 sh");
        let (_, sub) = inv.command.unwrap();
        assert_eq!(sub.values("env"), ["A=1", "B=2"]);
        assert_eq!(sub.values("additional-gids"), ["1", "2"]);
    }
}
