//! How the API is reached, apart from what it answers: the unix socket (with the
//! `:authority` rewrite grpc-core clients need, [`uds_authority`]), the mutual-TLS
//! listener, and the server every listener shares (gRPC health, reflection, the
//! request size limit answered as RESOURCE_EXHAUSTED, the latency layer).
//!
//! Owns: sockets, TLS and the tonic server builder. May use: the service, the
//! envelope's latency layer, auth (the connection's peer), config.

pub mod uds_authority;

use std::path::Path;
use std::time::Duration;

use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_server::TesseraServer;
use tonic::Status;
use tonic::codegen::http;
use tracing::info;

use super::envelope::timing;
use super::service::TesseraService;

/// Errors of binding the API socket.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: a live tesserad already answers on this socket")]
    InUse { path: std::path::PathBuf },
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("reflection service: {0}")]
    Reflection(String),
}

/// Bind the unix socket (removing a stale one), set its mode, and return the listener.
pub fn bind_unix(path: &Path, mode: u32) -> Result<tokio::net::UnixListener, ServeError> {
    let io = |source| ServeError::Io {
        path: path.to_path_buf(),
        source,
    };
    if path.exists() && std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(ServeError::InUse {
            path: path.to_path_buf(),
        });
    }
    tessera_common::unix::bind_socket(path, mode).map_err(io)
}

async fn router(service: TesseraService) -> Result<tonic::service::Routes, ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<TesseraServer<TesseraService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let routes = tonic::service::Routes::new(health_service).add_service(reflection);
    Ok(match service.metrics() {
        Some(m) => routes.add_service(timing::Timed::new(service.into_server(), m)),
        None => routes.add_service(service.into_server()),
    })
}

/// The start of tonic's answer to a request over the decode limit.
const TOO_LARGE: &str = "Error, decoded message length too large";

/// tonic answers a request over the decode limit with OUT_OF_RANGE; gRPC's status code
/// table gives RESOURCE_EXHAUSTED to "server max receive message size exceeded", and
/// that is what grpc-core and grpc-go servers answer, so clients written against them
/// see the code they expect. The message is kept. (The refusal comes before any
/// handler runs, so it is a trailers-only answer: the status is in the headers.)
fn too_large_is_resource_exhausted<B>(mut resp: http::Response<B>) -> http::Response<B> {
    if let Some(st) = Status::from_header_map(resp.headers())
        && st.code() == tonic::Code::OutOfRange
        && st.message().starts_with(TOO_LARGE)
    {
        let exhausted = Status::resource_exhausted(st.message());
        if exhausted.add_header(resp.headers_mut()).is_err() {
            resp.headers_mut().insert(
                "grpc-status",
                http::HeaderValue::from(tonic::Code::ResourceExhausted as i32),
            );
        }
    }
    resp
}

type TooLargeLayer = tower::util::MapResponseLayer<
    fn(http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body>,
>;

fn builder()
-> tonic::transport::Server<tower::layer::util::Stack<TooLargeLayer, tower::layer::util::Identity>>
{
    let map: fn(http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body> =
        too_large_is_resource_exhausted;
    tonic::transport::Server::builder()
        .concurrency_limit_per_connection(256)
        .max_concurrent_streams(Some(1024))
        .timeout(Duration::from_secs(120))
        .layer(tower::util::MapResponseLayer::new(map))
}

/// Serve the API (with grpc.health.v1 and reflection) on `listener` until `shutdown`.
pub async fn serve_unix(
    service: TesseraService,
    listener: tokio::net::UnixListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    use tokio_stream::StreamExt;
    // grpc-core clients (Python grpcio, C++, ...) send the socket path as :authority,
    // which h2 refuses: normalized before h2 reads it (see uds_authority).
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
        .map(|conn| conn.map(uds_authority::NormalizeAuthority::new));
    builder()
        .add_routes(router(service).await?)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

/// The mutual-TLS listener's material, read and checked: a certificate and key
/// that parse and match, and the CA client certificates must chain to.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    listen: std::net::SocketAddr,
    config: tonic::transport::ServerTlsConfig,
}

impl TlsMaterial {
    /// Read and check the files `[auth.tls]` names (before anything is touched).
    pub fn load(tls: &crate::config::TlsConfig, oidc: bool) -> Result<TlsMaterial, ServeError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| ServeError::Io {
                path: p.to_path_buf(),
                source,
            })
        };
        let identity = tonic::transport::Identity::from_pem(read(&tls.cert)?, read(&tls.key)?);
        let mut config = tonic::transport::ServerTlsConfig::new().identity(identity);
        // Without a client CA (only with [auth.oidc]) no certificate is asked for;
        // with one and [auth.oidc], a caller shows a certificate or a token.
        if let Some(ca) = &tls.client_ca {
            config = config
                .client_ca_root(tonic::transport::Certificate::from_pem(read(ca)?))
                .client_auth_optional(oidc);
        }
        // Building the server's TLS settings parses the certificate, the key and
        // the CA: a bad file fails here, not after the daemon said READY.
        builder().tls_config(config.clone())?;
        Ok(TlsMaterial {
            listen: tls.listen,
            config,
        })
    }

    /// Bind the TCP listener.
    pub async fn bind(self) -> Result<BoundTls, ServeError> {
        let listener = tokio::net::TcpListener::bind(self.listen)
            .await
            .map_err(|source| ServeError::Io {
                path: self.listen.to_string().into(),
                source,
            })?;
        Ok(BoundTls {
            material: self,
            listener,
        })
    }
}

/// A bound mutual-TLS listener, not yet serving.
#[derive(Debug)]
pub struct BoundTls {
    material: TlsMaterial,
    listener: tokio::net::TcpListener,
}

/// Serve the API over TCP with TLS: the caller presents a certificate signed by
/// `client_ca` (its common name selects the principal) or, with `[auth.oidc]`, a
/// bearer token that the token layer verifies before any handler runs.
pub async fn serve_tls(
    service: TesseraService,
    tls: BoundTls,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let oidc = service.token_verifier();
    let how = if oidc.is_some() {
        "TLS (client certificates or OIDC bearer tokens)"
    } else {
        "mutual TLS"
    };
    info!(listen = %tls.material.listen, "serving the tessera.v1 API over {how}");
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(tls.listener);
    builder()
        .tls_config(tls.material.config)?
        .layer(super::oidc::OidcLayer::new(oidc))
        .add_routes(router(service).await?)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}
