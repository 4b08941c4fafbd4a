//! Connection to tesserad over its unix socket, and the mapping of failures to the
//! messages and exit codes the CLI promises: 1 refused by the daemon, 3 unreachable.

use std::error::Error as _;
use std::path::{Path, PathBuf};

use tessera_proto::v1::tessera_client::TesseraClient;
use tonic::transport::Channel;

/// The socket tesserad listens on when installed by the systemd unit.
pub const DEFAULT_SOCKET: &str = "/run/tessera/tesserad.sock";

/// Exit code when the daemon answered with a refusal (or any other failure).
pub const EXIT_REFUSED: u8 = 1;
/// Exit code for a usage error (clap uses the same).
pub const EXIT_USAGE: u8 = 2;
/// Exit code when the daemon cannot be reached.
pub const EXIT_UNREACHABLE: u8 = 3;

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(
        "cannot reach tesserad at {}: {reason} — {hint}",
        .socket.display()
    )]
    Unreachable {
        socket: PathBuf,
        reason: String,
        hint: &'static str,
    },
    #[error("{}", refusal_text(.rpc, .status))]
    Refused {
        rpc: &'static str,
        status: tonic::Status,
    },
    /// Arguments that parse but do not make sense together; found before connecting.
    #[error("{0}")]
    Usage(String),
    #[error("tesserad at {} closed the event stream", .socket.display())]
    StreamEnded { socket: PathBuf },
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Unreachable { .. } | Self::StreamEnded { .. } => EXIT_UNREACHABLE,
            Self::Refused { .. } => EXIT_REFUSED,
            Self::Usage(_) => EXIT_USAGE,
        }
    }
}

fn refusal_text(rpc: &str, status: &tonic::Status) -> String {
    let code = status.code();
    let message = if status.message().is_empty() {
        code.description()
    } else {
        status.message()
    };
    if code == tonic::Code::Unimplemented {
        format!("refused (Unimplemented): this tesserad does not implement {rpc} yet: {message}")
    } else {
        format!("refused ({code:?}): {message}")
    }
}

/// A connected client plus the socket path, for error messages.
#[derive(Debug, Clone)]
pub struct Daemon {
    pub client: TesseraClient<Channel>,
    pub socket: PathBuf,
}

impl Daemon {
    /// Connects now (not lazily) so that an absent daemon is reported before any work.
    pub async fn connect(socket: &Path) -> Result<Self, CliError> {
        let channel =
            tessera_common::unix::channel(socket)
                .await
                .map_err(|e| CliError::Unreachable {
                    socket: socket.to_path_buf(),
                    reason: root_cause(&e.source),
                    hint: hint_for(&e.source),
                })?;
        Ok(Self {
            client: TesseraClient::new(channel),
            socket: socket.to_path_buf(),
        })
    }

    /// Maps a failed call: a transport failure (the daemon went away) is "unreachable",
    /// anything the daemon answered is a refusal naming its code and message.
    pub fn fail(&self, rpc: &'static str, status: tonic::Status) -> CliError {
        if status.code() == tonic::Code::Unavailable && status.source().is_some() {
            let (reason, hint) = status.source().map_or_else(
                || (status.message().to_owned(), HINT_NOT_RUNNING),
                |e| (root_cause(e), hint_for(e)),
            );
            return CliError::Unreachable {
                socket: self.socket.clone(),
                reason,
                hint,
            };
        }
        CliError::Refused { rpc, status }
    }
}

const HINT_NOT_RUNNING: &str = "is it running? set --socket or TESSERA_SOCKET";
const HINT_PERMISSION: &str =
    "the socket is for root and group tessera: run as root or join group tessera";

/// What to suggest: a permission problem is not solved by starting the daemon.
fn hint_for(err: &(dyn std::error::Error + 'static)) -> &'static str {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::PermissionDenied
        {
            return HINT_PERMISSION;
        }
        cur = e.source();
    }
    HINT_NOT_RUNNING
}

/// The innermost cause of an error as one short phrase; an OS error without its
/// "(os error N)" suffix, e.g. "No such file or directory".
fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = err;
    while let Some(next) = cur.source() {
        cur = next;
    }
    let text = cur.to_string();
    match text.rfind(" (os error ") {
        Some(i) => text[..i].to_owned(),
        None => text,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn missing_socket_is_unreachable_with_a_hint() {
        let dir = std::env::temp_dir().join(format!("tessera-cli-test-{}", std::process::id()));
        let socket = dir.join("absent.sock");
        let err = Daemon::connect(&socket).await.unwrap_err();
        assert_eq!(err.exit_code(), EXIT_UNREACHABLE);
        assert_eq!(
            err.to_string(),
            format!(
                "cannot reach tesserad at {}: No such file or directory — is it running? set --socket or TESSERA_SOCKET",
                socket.display()
            )
        );
    }

    #[test]
    fn permission_denied_suggests_the_group_not_starting_the_daemon() {
        let err = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert_eq!(hint_for(&err), HINT_PERMISSION);
        let err = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(hint_for(&err), HINT_NOT_RUNNING);
    }

    #[test]
    fn refusals_name_code_and_message() {
        let err = CliError::Refused {
            rpc: "CreateLease",
            status: tonic::Status::resource_exhausted("tenant team-a: no 1g.10gb free"),
        };
        assert_eq!(err.exit_code(), EXIT_REFUSED);
        assert_eq!(
            err.to_string(),
            "refused (ResourceExhausted): tenant team-a: no 1g.10gb free"
        );
        let err = CliError::Refused {
            rpc: "GetUsage",
            status: tonic::Status::unimplemented("not yet"),
        };
        assert_eq!(
            err.to_string(),
            "refused (Unimplemented): this tesserad does not implement GetUsage yet: not yet"
        );
    }
}
