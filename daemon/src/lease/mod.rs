//! Lease manager: admission, placement, the write-ahead protocol, expiry, revocation.

pub mod devices;
pub mod enforce;
pub mod manager;
pub mod model;
pub mod quota;
pub mod token;

pub use manager::{
    CreateRequest, Created, EventKind, GpuReport, LeaseError, LeaseEvent, LeaseManager, now_ms,
};
