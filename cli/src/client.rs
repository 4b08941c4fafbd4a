//! Connection to tesserad over its unix socket, or over its TLS listener with an
//! OIDC bearer token, and the mapping of failures to the messages and exit codes
//! the CLI promises: 1 refused by the daemon, 3 unreachable.

use std::error::Error as _;
use std::path::{Path, PathBuf};

use tessera_proto::v1::tessera_client::TesseraClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

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

/// Largest token file read (IdP tokens with many groups are a few KiB).
const MAX_TOKEN_BYTES: u64 = 16 * 1024;

/// Adds `authorization: Bearer <token>` to every call when there is a token.
#[derive(Debug, Clone, Default)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

impl Bearer {
    /// The token in `path`: one line of visible ASCII (surrounding whitespace and
    /// the newline are dropped). Its content is never printed.
    pub fn from_file(path: &Path) -> Result<Bearer, CliError> {
        use std::io::Read as _;
        let usage =
            |why: String| CliError::Usage(format!("--token-file {}: {why}", path.display()));
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_TOKEN_BYTES + 1).read_to_string(&mut text))
            .map_err(|e| usage(root_cause(&e)))?;
        if text.len() as u64 > MAX_TOKEN_BYTES {
            return Err(usage(format!("longer than {MAX_TOKEN_BYTES} bytes")));
        }
        let token = text.trim();
        if token.is_empty() {
            return Err(usage("empty".into()));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(usage(
                "not one token (only visible ASCII, no spaces or line breaks)".into(),
            ));
        }
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| usage("not a valid header value".into()))?;
        Ok(Bearer(Some(value)))
    }
}

/// The client every command uses.
pub type Client = TesseraClient<InterceptedService<Channel, Bearer>>;

/// Where tesserad is: its unix socket, or its TLS listener (`https://host:port`)
/// with the CA that signed its certificate (else the system's roots) and a
/// bearer token.
#[derive(Debug, Clone)]
pub struct Target {
    pub socket: PathBuf,
    pub addr: Option<String>,
    pub ca_file: Option<PathBuf>,
    pub token_file: Option<PathBuf>,
}

/// A connected client plus where it is connected (the socket path, or the
/// listener's address), for error messages.
#[derive(Debug, Clone)]
pub struct Daemon {
    pub client: Client,
    pub socket: PathBuf,
}

impl Daemon {
    /// Connects to a socket now (tests; the CLI uses [`Self::connect_to`]).
    #[cfg(test)]
    pub async fn connect(socket: &Path) -> Result<Self, CliError> {
        Self::connect_to(&Target {
            socket: socket.to_path_buf(),
            addr: None,
            ca_file: None,
            token_file: None,
        })
        .await
    }

    /// Connects now (not lazily) so that an absent daemon is reported before any
    /// work: to the socket, or to the TLS listener when `addr` is set.
    pub async fn connect_to(target: &Target) -> Result<Self, CliError> {
        let Some(addr) = &target.addr else {
            if target.token_file.is_some() {
                return Err(CliError::Usage(
                    "a bearer token is sent only to tesserad's TLS listener: set --addr https://HOST:PORT (or TESSERA_ADDR) too; on the unix socket your uid decides".into(),
                ));
            }
            let socket = &target.socket;
            let channel =
                tessera_common::unix::channel(socket)
                    .await
                    .map_err(|e| CliError::Unreachable {
                        socket: socket.to_path_buf(),
                        reason: root_cause(&e.source),
                        hint: hint_for(&e.source),
                    })?;
            return Ok(Self {
                client: TesseraClient::with_interceptor(channel, Bearer::default()),
                socket: socket.to_path_buf(),
            });
        };
        if !addr.starts_with("https://") {
            return Err(CliError::Usage(format!(
                "--addr {addr:?}: tesserad's network listener is TLS only: https://HOST:PORT"
            )));
        }
        let bearer = match &target.token_file {
            Some(path) => Bearer::from_file(path)?,
            None => Bearer::default(),
        };
        let mut tls = ClientTlsConfig::new();
        tls = match &target.ca_file {
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| {
                    CliError::Usage(format!("--ca-file {}: {}", path.display(), root_cause(&e)))
                })?;
                tls.ca_certificate(Certificate::from_pem(pem))
            }
            None => tls.with_native_roots(),
        };
        let unreachable = |e: &(dyn std::error::Error + 'static)| CliError::Unreachable {
            socket: PathBuf::from(addr),
            reason: root_cause(e),
            hint: HINT_TLS,
        };
        let endpoint = Endpoint::from_shared(addr.clone())
            .map_err(|e| CliError::Usage(format!("--addr {addr:?}: {}", root_cause(&e))))?
            .tls_config(tls)
            .map_err(|e| unreachable(&e))?
            .connect_timeout(std::time::Duration::from_secs(10));
        let channel = endpoint.connect().await.map_err(|e| unreachable(&e))?;
        Ok(Self {
            client: TesseraClient::with_interceptor(channel, bearer),
            socket: PathBuf::from(addr),
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
const HINT_TLS: &str = "is it running with [auth.tls] there? check --addr, and --ca-file for the CA that signed its certificate";
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

    fn target(addr: Option<&str>, token_file: Option<PathBuf>) -> Target {
        Target {
            socket: "/nonexistent/tesserad.sock".into(),
            addr: addr.map(str::to_string),
            ca_file: None,
            token_file,
        }
    }

    /// The token file holds one token; what is sent is `Bearer <token>`, and a bad
    /// file is a usage error naming the file, never showing its content.
    #[tokio::test]
    async fn a_token_file_is_one_token_sent_only_to_the_tls_listener() {
        use tonic::service::Interceptor as _;
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("token");
        std::fs::write(&good, "eyJhbGciOiJFUzI1NiJ9.e30.c2ln\n").unwrap();
        let mut b = Bearer::from_file(&good).unwrap();
        let req = b.call(tonic::Request::new(())).unwrap();
        assert_eq!(
            req.metadata().get("authorization").unwrap(),
            "Bearer eyJhbGciOiJFUzI1NiJ9.e30.c2ln"
        );
        let bad = dir.path().join("bad");
        for content in ["", "  \n", "two tokens", "secret-\u{e9}"] {
            std::fs::write(&bad, content).unwrap();
            let e = Bearer::from_file(&bad).unwrap_err();
            assert_eq!(e.exit_code(), EXIT_USAGE, "{content:?}");
            assert!(e.to_string().contains("--token-file"), "{e}");
            assert!(!e.to_string().contains("secret"), "{e}");
        }
        let e = Bearer::from_file(&dir.path().join("absent")).unwrap_err();
        assert!(e.to_string().contains("No such file"), "{e}");
        // A token is never sent over the unix socket.
        let e = Daemon::connect_to(&target(None, Some(good.clone())))
            .await
            .unwrap_err();
        assert_eq!(e.exit_code(), EXIT_USAGE);
        assert!(e.to_string().contains("--addr"), "{e}");
        // The network listener is TLS only.
        let e = Daemon::connect_to(&target(Some("http://127.0.0.1:1"), Some(good)))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("TLS only"), "{e}");
    }
}
