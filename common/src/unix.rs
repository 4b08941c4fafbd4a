//! A gRPC channel to tesserad over its unix socket (one HTTP/2 connection).

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Why the daemon's socket could not be reached.
#[derive(Debug, thiserror::Error)]
#[error("cannot connect to {}: {source}", socket.display())]
pub struct ConnectError {
    pub socket: PathBuf,
    #[source]
    pub source: tonic::transport::Error,
}

/// The endpoint every unix-socket channel uses. tonic needs a URI; the connector
/// ignores it and always dials the socket. `localhost` is what the server sees as the
/// HTTP/2 `:authority`.
fn endpoint() -> Endpoint {
    Endpoint::from_static("http://localhost")
}

/// Connect now (not lazily), so that an absent daemon is reported before any work.
pub async fn channel(socket: &Path) -> Result<Channel, ConnectError> {
    let path = socket.to_path_buf();
    endpoint()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(s))
            }
        }))
        .await
        .map_err(|source| ConnectError {
            socket: socket.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_socket_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let sock = dir.path().join("absent.sock");
        let err = channel(&sock).await.err();
        let msg = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("absent.sock"), "{msg}");
    }
}
