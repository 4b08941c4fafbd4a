//! tessera: operator CLI for tesserad, over its gRPC API on a unix socket, or on
//! its TLS listener with an OIDC bearer token (`--addr`, `--token-file`).
//!
//! Exit codes: 0 ok, 1 refused by the daemon (or another failure), 2 usage error,
//! 3 daemon unreachable.

mod admin;
mod audit;
mod client;
mod docs;
mod doctor;
mod lease;
mod node;
mod output;
mod parse;
mod usage;
mod watch;

/// Tests: parse one subcommand family the way the CLI does.
#[cfg(test)]
mod harness {
    #[derive(Debug, clap::Parser)]
    pub struct Harness<C: clap::Subcommand> {
        #[command(subcommand)]
        pub cmd: C,
    }
}

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::client::{CliError, DEFAULT_SOCKET, Daemon, EXIT_REFUSED, Target};

#[derive(Debug, Parser)]
#[command(
    name = "tessera",
    version,
    about = "Operator CLI for tesserad (GPU partition leases)"
)]
struct Cli {
    /// tesserad's unix socket.
    #[arg(long, global = true, env = "TESSERA_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// tesserad's TLS listener instead of the socket, e.g. https://gpu-node-1:7443.
    #[arg(long, global = true, env = "TESSERA_ADDR", value_name = "URL")]
    addr: Option<String>,
    /// The CA certificate (PEM) that signed the TLS listener's certificate (default:
    /// the system's roots).
    #[arg(long, global = true, env = "TESSERA_CA_FILE", value_name = "FILE")]
    ca_file: Option<PathBuf>,
    /// A file holding an OIDC token (e.g. from your identity provider's login),
    /// sent as `authorization: Bearer ...` to the TLS listener.
    #[arg(long, global = true, env = "TESSERA_TOKEN_FILE", value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// JSON for scripts instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The GPUs: MIG mode, free slices, MPS use, partitions.
    Gpus,
    /// The whole node, with free capacity per profile per GPU.
    Node,
    /// Take a GPU (or one MIG instance) out of service, or return it (admin).
    #[command(subcommand)]
    Gpu(GpuCmd),
    /// Create, list, show, renew and release leases.
    #[command(subcommand)]
    Lease(lease::LeaseCmd),
    /// Stream lease events, one line each.
    Watch {
        /// Only this tenant's leases.
        #[arg(long)]
        tenant: Option<String>,
        /// Resume: every event after this revision (a listing's, or the last event
        /// seen), then live ones.
        #[arg(long, value_name = "REV")]
        since: Option<u64>,
        /// Also a bookmark line (the revision reached) now and then, to resume
        /// from after a quiet spell.
        #[arg(long)]
        bookmarks: bool,
    },
    /// Usage per tenant (partition-seconds weighted by size).
    Usage(usage::UsageArgs),
    /// Show quotas or grant a temporary raise.
    #[command(subcommand)]
    Quota(admin::QuotaCmd),
    /// Make tesserad reload its configuration (like SIGHUP).
    Reload,
    /// Show the audit log (reads the log files; the daemon need not run).
    Audit(audit::AuditArgs),
    /// Check this host is ready for Tessera: driver, MIG, runc, cgroups, AppArmor,
    /// containerd, socket. Prints OK/WARN/FAIL with fixes; exits 1 on any FAIL.
    Doctor {
        /// containerd's config file (checked for the "tessera" runtime).
        #[arg(long, default_value = "/etc/containerd/config.toml")]
        containerd_config: PathBuf,
        /// tesserad's config file: check the host as that daemon would use it (its
        /// backend, its [nvml] library, mig-minors file and MPS control, its
        /// [devices] majors, its socket). Without it the host's defaults.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Print a shell completion script, e.g. `tessera completion bash >
    /// /etc/bash_completion.d/tessera` (the Debian package installs them).
    Completion {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write the man pages (tessera.1 and one page per subcommand) into DIR.
    Manpages {
        /// Where to write them (created when missing).
        dir: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum GpuCmd {
    /// Return a GPU (or one MIG instance) to service after it was repaired or
    /// reset. Audited with the reason.
    MarkHealthy {
        /// The GPU's index (as `tessera gpus` shows it).
        gpu: u32,
        /// One MIG GPU instance only.
        #[arg(long)]
        instance: Option<u32>,
        /// Why (goes to the audit log).
        #[arg(long)]
        reason: String,
    },
    /// Take a GPU (or one MIG instance) out of service: no new leases there.
    /// Audited with the reason.
    MarkUnhealthy {
        gpu: u32,
        #[arg(long)]
        instance: Option<u32>,
        #[arg(long)]
        reason: String,
    },
}

impl Command {
    /// Checks what clap cannot, before connecting: a bad combination is a usage error
    /// (exit 2) whether or not the daemon is up.
    fn validate(&self) -> Result<(), CliError> {
        match self {
            Self::Lease(cmd) => cmd.validate(),
            Self::Usage(args) => args.validate(),
            Self::Quota(cmd) => cmd.validate(),
            Self::Gpu(
                GpuCmd::MarkHealthy { reason, .. } | GpuCmd::MarkUnhealthy { reason, .. },
            ) if reason.trim().is_empty() => Err(CliError::Usage(
                "--reason must say why (it goes to the audit log)".into(),
            )),
            Self::Gpus
            | Self::Gpu(_)
            | Self::Node
            | Self::Watch { .. }
            | Self::Reload
            | Self::Audit(_)
            | Self::Doctor { .. }
            | Self::Completion { .. }
            | Self::Manpages { .. } => Ok(()),
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    cli.command.validate()?;
    if let Command::Audit(a) = &cli.command {
        return audit::run(a, cli.json);
    }
    // Neither needs the daemon.
    if let Command::Completion { shell } = &cli.command {
        use clap::CommandFactory;
        docs::completion(Cli::command(), *shell, &mut std::io::stdout().lock());
        return Ok(());
    }
    if let Command::Manpages { dir } = &cli.command {
        use clap::CommandFactory;
        let written = docs::manpages(Cli::command(), dir)?;
        println!("{} man pages written to {}", written.len(), dir.display());
        return Ok(());
    }
    if let Command::Doctor {
        containerd_config,
        config,
    } = &cli.command
    {
        // Needs no daemon: the socket is one of the things it inspects.
        if !doctor::run_doctor(&cli.socket, containerd_config, config.as_deref(), cli.json)? {
            anyhow::bail!("the host is not ready (see the FAIL lines above)");
        }
        return Ok(());
    }
    let mut daemon = Daemon::connect_to(&Target {
        socket: cli.socket.clone(),
        addr: cli.addr.clone(),
        ca_file: cli.ca_file.clone(),
        token_file: cli.token_file.clone(),
    })
    .await?;
    let json = cli.json;
    match cli.command {
        Command::Gpus => node::gpus(&mut daemon, json).await,
        Command::Node => node::node(&mut daemon, json).await,
        Command::Gpu(GpuCmd::MarkHealthy {
            gpu,
            instance,
            reason,
        }) => node::set_health(&mut daemon, gpu, instance, true, reason, json).await,
        Command::Gpu(GpuCmd::MarkUnhealthy {
            gpu,
            instance,
            reason,
        }) => node::set_health(&mut daemon, gpu, instance, false, reason, json).await,
        Command::Lease(cmd) => lease::run(&mut daemon, cmd, json).await,
        Command::Watch {
            tenant,
            since,
            bookmarks,
        } => watch::run(&mut daemon, tenant, since, bookmarks, json).await,
        Command::Usage(args) => usage::run(&mut daemon, args, json).await,
        Command::Quota(cmd) => admin::quota(&mut daemon, cmd, json).await,
        Command::Reload => admin::reload(&mut daemon, json).await,
        Command::Audit(_) => Ok(()),
        Command::Doctor { .. } | Command::Completion { .. } | Command::Manpages { .. } => Ok(()),
    }
}

fn main() -> ExitCode {
    // clap prints usage errors and exits 2 itself (0 for --help/--version).
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tessera: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_REFUSED);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let code = err
                .downcast_ref::<CliError>()
                .map_or(EXIT_REFUSED, CliError::exit_code);
            eprintln!("tessera: {err:#}");
            ExitCode::from(code)
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn json_flag_is_global() {
        let cli = Cli::try_parse_from(["tessera", "lease", "list", "--json"]).unwrap();
        assert!(cli.json);
        let cli = Cli::try_parse_from(["tessera", "--json", "gpus"]).unwrap();
        assert!(cli.json);
    }

    #[test]
    fn bash_completion_knows_the_subcommands_and_their_flags() {
        let mut out = Vec::new();
        docs::completion(Cli::command(), clap_complete::Shell::Bash, &mut out);
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("complete -F _tessera"), "{text}");
        for word in ["lease", "create", "release", "--tenant", "--mig", "doctor"] {
            assert!(text.contains(word), "{word} missing");
        }
    }

    #[test]
    fn man_pages_cover_every_subcommand() {
        let dir = tempfile::tempdir().unwrap();
        let written = docs::manpages(Cli::command(), dir.path()).unwrap();
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for want in [
            "tessera.1",
            "tessera-lease.1",
            "tessera-lease-create.1",
            "tessera-doctor.1",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
        }
        let create = std::fs::read_to_string(dir.path().join("tessera-lease-create.1")).unwrap();
        assert!(
            create.starts_with(".ie") || create.contains(".TH"),
            "{create}"
        );
        assert!(create.contains("tenant"), "{create}");
    }

    #[test]
    fn usage_errors_exit_2() {
        let err = Cli::try_parse_from(["tessera", "lease", "create"]).unwrap_err();
        assert_eq!(err.exit_code(), 2);
    }
}
