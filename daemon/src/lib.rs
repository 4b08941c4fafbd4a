//! tesserad: the Tessera node daemon as a library (the binary is a thin `main`).

pub mod api;
pub mod audit;
pub mod cdi;
pub mod config;
pub mod dra;
pub mod gpu;
pub mod host;
pub mod k8s;
pub mod lease;
pub mod metrics;
pub mod model;
pub mod mps;
pub mod names;
pub mod partition;
pub mod store;
pub mod usage;
