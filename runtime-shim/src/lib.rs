//! tessera-runtime: a runc-compatible OCI runtime that starts each tenant container on
//! exactly its leased GPU partition, hardened (seccomp, capabilities, no_new_privileges,
//! AppArmor, masked paths, devices cgroup), and then runs the real runc: exec'd once
//! the spec is decided, or started while it is decided and handed the hardened spec
//! then ([`early`]).
//!
//! The binary is thin (`main.rs`); everything here is callable from tests.

pub mod app;
pub mod bundle;
pub mod cli;
pub mod config;
pub mod early;
pub mod harden;
pub mod host;
pub mod lease;
pub mod policy;
pub mod private_file;
pub mod record;
pub mod runc_cves;
pub mod runclog;
