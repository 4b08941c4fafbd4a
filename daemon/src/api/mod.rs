//! gRPC API: the tessera.v1 service. Every call runs in one envelope (`envelope/`:
//! auth, deadline, audit, metrics, status mapping) around its handler (`handlers/`:
//! the call into the lease core); `transport/` is how the API is reached (unix
//! socket, mutual TLS). No domain logic lives here.
//!
//! Owns: the only use of tonic and the generated proto types in the daemon, caller
//! identity and authorization. May use: every layer below. No layer below may use it
//! (`daemon/tests/layering.rs`).

pub mod auth;
pub mod convert;
mod envelope;
pub mod errors;
mod handlers;
pub mod oidc;
pub mod paging;
mod service;
mod state;
pub mod transport;
mod watch;

pub use errors::code_name;
pub use service::TesseraService;
pub use state::ReloadHook;
pub use transport::{
    BoundTls, ServeError, TlsMaterial, bind_unix, serve_tls, serve_unix, uds_authority,
};
