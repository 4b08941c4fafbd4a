//! The gRPC rich error model (`google.rpc.Status` with details) for every refusal:
//! an `ErrorInfo` with a stable reason and the domain `tessera.io` always, and, where
//! they apply, `BadRequest` field violations, `QuotaFailure`, `PreconditionFailure`
//! and `RetryInfo`. The reasons are listed in `proto/tessera/v1/tessera.proto`.

use std::collections::HashMap;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::lease::LeaseError;

/// The `ErrorInfo.domain` of every Tessera refusal.
pub const DOMAIN: &str = "tessera.io";

/// A status with `details` and an `ErrorInfo` of `reason`.
pub fn rich(
    code: Code,
    message: impl Into<String>,
    reason: &str,
    mut details: ErrorDetails,
) -> Status {
    details.set_error_info(reason, DOMAIN, HashMap::new());
    Status::with_error_details(code, message, details)
}

/// A domain error as a status: its code, its stable reason and its details.
pub fn status_of(e: LeaseError) -> Status {
    let msg = e.to_string();
    match &e {
        LeaseError::InvalidArgument { field, message } => rich(
            Code::InvalidArgument,
            msg,
            "INVALID_ARGUMENT",
            ErrorDetails::with_bad_request_violation(*field, message.clone()),
        ),
        LeaseError::NotFound(_) => plain(Code::NotFound, msg, "NOT_FOUND"),
        LeaseError::ResourceExhausted(_) => retry(Code::ResourceExhausted, msg, "NO_CAPACITY", 5),
        LeaseError::QuotaExceeded(m) => rich(
            Code::ResourceExhausted,
            msg,
            "QUOTA_EXCEEDED",
            ErrorDetails::with_quota_failure_violation("tenant quota", m.clone()),
        ),
        LeaseError::BurstWaits(_) => retry(
            Code::ResourceExhausted,
            msg,
            "BURST_WAITS_FOR_PREEMPTION",
            1,
        ),
        LeaseError::FailedPrecondition(m) => precondition(
            msg,
            "FAILED_PRECONDITION",
            ("LEASE_STATE", "lease"),
            m.clone(),
        ),
        LeaseError::ResolutionChanged(m) => precondition(
            msg,
            "RESOLUTION_CHANGED",
            ("RESOLUTION", "lease"),
            m.clone(),
        ),
        LeaseError::Transition(t) => {
            let subject = ("LEASE_STATE", t.from.as_str());
            precondition(msg.clone(), "ILLEGAL_TRANSITION", subject, msg)
        }
        LeaseError::Devices(_) => plain(Code::FailedPrecondition, msg, "DEVICE_MAJOR_UNKNOWN"),
        LeaseError::PermissionDenied(_) => plain(Code::PermissionDenied, msg, "PERMISSION_DENIED"),
        LeaseError::ShuttingDown => retry(Code::Unavailable, msg, "SHUTTING_DOWN", 1),
        LeaseError::Store(s) => store_status(s, msg),
        LeaseError::TopologyUnmet(_) => {
            precondition(msg.clone(), "TOPOLOGY_UNMET", ("TOPOLOGY", "topology"), msg)
        }
        LeaseError::ModeUnavailable(_) => {
            precondition(msg.clone(), "GPU_MODE_MISMATCH", ("GPU_MODE", "gpu"), msg)
        }
        LeaseError::GpuUnhealthy(_) => {
            precondition(msg.clone(), "GPU_UNHEALTHY", ("GPU_HEALTH", "gpu"), msg)
        }
        LeaseError::Hardware(g) if hardware_may_recover(g) => {
            retry(Code::Unavailable, msg, "HARDWARE_UNAVAILABLE", 5)
        }
        LeaseError::Hardware(_) => plain(Code::Internal, msg, "HARDWARE_FAILED"),
        LeaseError::Inconsistent(_) => plain(Code::Internal, msg, "INCONSISTENT_RECORDS"),
        LeaseError::Host(_) => plain(Code::Internal, msg, "HOST_OPERATION_FAILED"),
        LeaseError::Task { .. } => plain(Code::Internal, msg, "TASK_FAILED"),
    }
}

/// A store failure: a full or read-only state directory is the host's state, to
/// be retried; anything else is the daemon's.
fn store_status(s: &crate::store::StoreError, msg: String) -> Status {
    if s.is_disk_full() {
        let msg = format!("the daemon's state directory is full: {msg}");
        retry(Code::ResourceExhausted, msg, "STATE_DISK_FULL", 30)
    } else if s.is_unwritable() {
        let msg = format!("the daemon's state directory refuses writes: {msg}");
        retry(Code::Unavailable, msg, "STATE_UNWRITABLE", 30)
    } else {
        plain(Code::Internal, msg, "STORE_FAILED")
    }
}

/// A status with only its `ErrorInfo`.
fn plain(code: Code, msg: String, reason: &str) -> Status {
    rich(code, msg, reason, ErrorDetails::new())
}

/// A status that tells the caller to retry after `secs` seconds.
fn retry(code: Code, msg: String, reason: &str, secs: u64) -> Status {
    let details = ErrorDetails::with_retry_info(Some(Duration::from_secs(secs)));
    rich(code, msg, reason, details)
}

/// FAILED_PRECONDITION with a violation of `(kind, subject)`.
fn precondition(msg: String, reason: &str, (kind, subject): (&str, &str), why: String) -> Status {
    let details = ErrorDetails::with_precondition_failure_violation(kind, subject, why);
    rich(Code::FailedPrecondition, msg, reason, details)
}

/// NVML failures that are the hardware's state now, not a bug of the request or
/// the daemon: a lost or busy GPU, a driver that is not ready, an unknown error.
fn hardware_may_recover(e: &crate::gpu::GpuError) -> bool {
    use crate::gpu::NvmlCode as C;
    matches!(
        e.nvml_code(),
        Some(
            C::GpuIsLost
                | C::InUse
                | C::Unknown
                | C::DriverNotLoaded
                | C::Uninitialized
                | C::Timeout
                | C::NotReady
        )
    ) || matches!(e, crate::gpu::GpuError::Task(_))
}

/// A request field that does not parse: INVALID_ARGUMENT naming it.
pub fn bad_field(field: &str, e: impl std::fmt::Display) -> Status {
    let msg = e.to_string();
    rich(
        Code::InvalidArgument,
        msg.clone(),
        "INVALID_ARGUMENT",
        ErrorDetails::with_bad_request_violation(field, msg),
    )
}

/// The canonical gRPC name of a status code ("OK", "PERMISSION_DENIED", ...).
pub fn code_name(code: Code) -> &'static str {
    use Code::*;
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

/// A refusal made by the API layer itself (a request that does not decode, a
/// caller without the right): `reason` is the code's name unless the status
/// already carries an `ErrorInfo`.
pub fn with_error_info(st: Status) -> Status {
    if st.code() == Code::Ok || st.get_details_error_info().is_some() {
        return st;
    }
    let mut details = st.get_error_details();
    let reason = code_name(st.code());
    details.set_error_info(reason, DOMAIN, HashMap::new());
    Status::with_error_details(st.code(), st.message(), details)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn info(st: &Status) -> (String, String) {
        let i = st.get_details_error_info().unwrap();
        (i.reason, i.domain)
    }

    #[test]
    fn every_domain_error_gets_its_code_a_stable_reason_and_details() {
        let st = status_of(LeaseError::InvalidArgument {
            field: "tenant",
            message: "bad".into(),
        });
        assert_eq!(st.code(), Code::InvalidArgument);
        assert_eq!(info(&st), ("INVALID_ARGUMENT".into(), DOMAIN.into()));
        let v = st.get_details_bad_request().unwrap().field_violations;
        assert_eq!(
            (v[0].field.as_str(), v[0].description.as_str()),
            ("tenant", "bad")
        );

        let st = status_of(LeaseError::QuotaExceeded("team-a: 8 of 7 slices".into()));
        assert_eq!(st.code(), Code::ResourceExhausted);
        assert_eq!(info(&st).0, "QUOTA_EXCEEDED");
        assert!(st.get_details_quota_failure().is_some());

        let st = status_of(LeaseError::ResourceExhausted("no room".into()));
        assert_eq!(info(&st).0, "NO_CAPACITY");
        assert!(st.get_details_retry_info().is_some());

        let st = status_of(LeaseError::ShuttingDown);
        assert_eq!(
            (st.code(), info(&st).0.as_str()),
            (Code::Unavailable, "SHUTTING_DOWN")
        );

        let st = status_of(LeaseError::FailedPrecondition("pending".into()));
        assert!(st.get_details_precondition_failure().is_some());
    }

    #[test]
    fn a_full_disk_is_resource_exhausted_not_internal() {
        let full = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
            Some("database or disk is full".into()),
        );
        let st = status_of(LeaseError::Store(crate::store::StoreError::Sqlite(full)));
        assert_eq!(st.code(), Code::ResourceExhausted);
        assert_eq!(info(&st).0, "STATE_DISK_FULL");
        let st = status_of(LeaseError::Store(crate::store::StoreError::WriterGone));
        assert_eq!(
            (st.code(), info(&st).0.as_str()),
            (Code::Internal, "STORE_FAILED")
        );
    }

    #[test]
    fn every_code_has_a_grpc_name() {
        assert_eq!(code_name(Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
        assert_eq!(code_name(Code::Unauthenticated), "UNAUTHENTICATED");
    }

    #[test]
    fn api_refusals_get_an_error_info_once() {
        let st = with_error_info(Status::permission_denied("no"));
        assert_eq!(info(&st), ("PERMISSION_DENIED".into(), DOMAIN.into()));
        assert_eq!(st.message(), "no");
        let again = with_error_info(status_of(LeaseError::NotFound("x".into())));
        assert_eq!(info(&again).0, "NOT_FOUND");
    }
}
