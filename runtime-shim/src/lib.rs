//! tessera-runtime: a runc-compatible OCI runtime that starts each tenant container on
//! exactly its leased GPU partition, hardened (seccomp, capabilities, no_new_privileges,
//! AppArmor, masked paths, devices cgroup), and then runs the real runc: exec'd once
//! the spec is decided, or started while it is decided and handed the hardened spec
//! then ([`early`]).
//!
//! The binary is thin (`main.rs`); everything here is callable from tests. One
//! invocation goes: [`app`] (argv, config, runc's root: a [`session::Session`]) ->
//! its command in [`commands`] -> for a create, the [`pipeline`] (spec view -> resolve
//! -> harden against a [`host::HostView`] -> bind) -> the hardened spec written -> runc
//! ([`plan`], [`early`]). Every refusal is one [`refusal::Refusal`].

pub mod app;
pub mod bundle;
pub mod cgroup_names;
pub mod cli;
pub mod commands;
pub mod config;
pub mod early;
pub mod fds;
pub mod harden;
pub mod host;
pub mod lease;
pub mod pipeline;
pub mod plan;
pub mod policy;
pub mod private_file;
pub mod record;
pub mod refusal;
pub mod resources;
pub mod runc_cves;
pub mod runc_root;
pub mod runclog;
pub mod session;
