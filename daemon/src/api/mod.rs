//! gRPC API: tonic service implementations. They unpack requests, call the domain,
//! and map errors to `tonic::Status`. No domain logic lives here.

pub mod auth;
pub mod convert;
mod service;

pub use service::{
    BoundTls, ServeError, TesseraService, TlsMaterial, bind_unix, serve_tls, serve_unix,
};
