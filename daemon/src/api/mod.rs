//! gRPC API: tonic service implementations. They unpack requests, call the domain,
//! and map errors to `tonic::Status`. No domain logic lives here.
//!
//! Owns: the only use of tonic and the generated proto types in the daemon, caller
//! identity and authorization. May use: every layer below. No layer below may use it
//! (`daemon/tests/layering.rs`).

pub mod auth;
pub mod convert;
pub mod errors;
pub mod oidc;
pub mod paging;
mod service;
mod watch;

pub use service::{
    BoundTls, ReloadHook, ServeError, TesseraService, TlsMaterial, bind_unix, serve_tls,
    serve_unix, uds_authority,
};

/// The canonical gRPC name of a status code ("OK", "PERMISSION_DENIED", ...).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_a_grpc_name() {
        assert_eq!(
            code_name(tonic::Code::ResourceExhausted),
            "RESOURCE_EXHAUSTED"
        );
        assert_eq!(code_name(tonic::Code::Unauthenticated), "UNAUTHENTICATED");
    }
}
