//! What every Tessera binary shares, so that one rule holds everywhere: how a byte
//! size is written ([`size`]), the wall clock in unix milliseconds ([`clock`]), how a
//! client reaches tesserad's unix socket ([`unix`]), and how `/proc/devices` is read
//! ([`procdevices`]), and CDI specs: their rules and the NVIDIA Container Toolkit's
//! list of the driver's files ([`cdi`]); and the contracts between the binaries: the
//! annotation and variable names a lease travels under ([`contract`]).
//!
//! This crate knows nothing of leases, GPUs or policy; it may not depend on any other
//! crate of the workspace.

pub mod cdi;
pub mod clock;
pub mod contract;
pub mod procdevices;
pub mod runc;
pub mod size;
pub mod unix;
