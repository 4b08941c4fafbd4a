//! Unix sockets: a gRPC channel to tesserad over its socket (one HTTP/2
//! connection), and binding a server's socket with its mode already set.

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

/// Bind a server's unix socket at `path` with `mode`, replacing what is there (a
/// stale socket of an earlier run): the socket is bound under a temporary name in the
/// same directory, given `mode`, then renamed over `path`, so nothing ever connects
/// to it with the mode the umask gave. The parent directory is made if absent.
pub fn bind_socket(path: &Path, mode: u32) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.as_deref().unwrap_or("socket"),
        std::process::id()
    ));
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(&tmp)?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(listener)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_bound_socket_replaces_a_stale_one_with_its_mode_and_no_temporary_left() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/plugin.sock");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"stale").unwrap();
        let listener = bind_socket(&path, 0o600).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let entries: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(entries, vec![std::ffi::OsString::from("plugin.sock")]);
        let connect = tokio::net::UnixStream::connect(&path);
        let (client, accepted) = tokio::join!(connect, listener.accept());
        client.unwrap();
        accepted.unwrap();
    }

    #[tokio::test]
    async fn a_missing_socket_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let sock = dir.path().join("absent.sock");
        let err = channel(&sock).await.err();
        let msg = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("absent.sock"), "{msg}");
    }
}
