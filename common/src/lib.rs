//! What every Tessera binary shares, so that one rule holds everywhere: how a byte
//! size is written ([`size`]), the wall clock in unix milliseconds ([`clock`]), how a
//! client reaches tesserad's unix socket ([`unix`]), and how `/proc/devices` is read
//! ([`procdevices`]), and CDI specs: their rules and the NVIDIA Container Toolkit's
//! list of the driver's files ([`cdi`]); and the contracts between the binaries: the
//! annotation and variable names a lease travels under ([`contract`]) and the grant a
//! lease's token resolves to, its protobuf form and the one merge of several ([`grant`]).
//!
//! This crate knows no lease state machine, GPU or policy; of the workspace it depends
//! only on the wire types (`tessera-proto`), which depend on nothing of it.

pub mod cdi;
pub mod clock;
pub mod contract;
pub mod grant;
pub mod mig;
pub mod procdevices;
pub mod runc;
pub mod size;
pub mod unix;
