//! Partitions and placement: shapes, the placement planner, MPS admission.
//!
//! Pure logic over plain data: it never calls the backend. The lease manager builds a
//! [`GpuView`] per GPU from the backend and its own records, asks [`plan`] where a shape
//! goes, and then performs the hardware change itself.
//!
//! Owns: shapes and placement decisions. May use: gpu (profile and placement types).
//! May not touch: the backend, the store, the lease core: it has no side effects.

pub mod fragmentation;
pub mod mig_mps;
pub mod planner;
#[cfg(test)]
mod planner_props;
pub mod reservation;
#[cfg(test)]
pub(crate) mod test_fixtures;
pub mod topology;
mod view;

pub use fragmentation::{free_capacity, free_static_counts, used_memory_slices};
pub use mig_mps::{MigMpsDecision, MigMpsHost, plan_mig_mps};
pub use planner::{
    COMPACT_MOVES_PER_PASS, EXPIRY_WEIGHT, Expiry, Movable, Move, MovePlan, PlanDecision,
    PlanError, PlanOptions, Strategy, Temporal, compact, mode_unavailable, plan, plan_with_moves,
};

pub use crate::gpu::MpsMode;
pub use reservation::{
    InstanceEnd, RESERVE_DEFAULTS_MS, Reservation, Reservations, ReserveOptions,
};
pub use view::{GpuView, MpsLoad, MpsShare, OccupiedMig, Shape};
