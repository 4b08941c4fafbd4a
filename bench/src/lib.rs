//! Tessera's benchmarks, apart from the product: `tessera-bench` (the lease path against
//! a real `tesserad` on simulated GPUs, and the goals table of `make bench`),
//! `runtime-bench` (`tessera-runtime` against plain runc) and `placement-bench` (MIG
//! placement on request traces, against a free-repacking reference).
//!
//! The library holds the trace model `placement-bench` replays ([`trace`]); it uses the
//! daemon's planner through `tesserad`'s public API, as the lease core does.

pub mod reserve;
pub mod trace;
