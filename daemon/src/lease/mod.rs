//! The lease core: admission, placement, the write-ahead protocol, expiry,
//! revocation and reconciliation at start. One file per concern:
//!
//! | file | concern |
//! |---|---|
//! | `table.rs`, `index.rs` | the in-memory table (GPUs, leases, partitions, tokens) and its indexes |
//! | `views.rs` | the planner's view of the table |
//! | `validate.rs` | checks of a request that need no state |
//! | `manager.rs` | the manager: the table behind its lock, store, backend; start-up |
//! | `plan.rs` | a CreateLease request, checked (`Ask`), and the `Plan` decided for it |
//! | `create.rs` | CreateLease: check, answer a retry, decide and act until placed |
//! | `admission.rs` | the decision: quota, placement, preemption and moves, pure over the table |
//! | `executor.rs` | runs every plan: reserve, intent, hardware, outcome, publish; runs every change outside a hardware sequence |
//! | `outcome.rs` | an outcome's rows in the store and its effect on the table |
//! | `grants.rs`, `quota.rs` | the tenancy policy in force, temporary grants; quota arithmetic |
//! | `renew.rs`, `end.rs` | a new expiry; release, expiry and revocation with write-ahead teardown |
//! | `binding.rs` | the runtime's side: token -> devices, container bindings |
//! | `housekeeping.rs` | the background loop |
//! | `owner.rs` | a live lease handed to another tenant (the device plugin: reserved -> the pod's tenant) |
//! | `moves.rs` | idle MIG leases moved (write-ahead) to make room for a request |
//! | `exact.rs` | an exact placement (DRA): there or refused, never elsewhere |
//! | `need.rs` | ask by need: memory and isolation to the smallest shape that fits now |
//! | `health.rs` | GPUs and instances out of service: marks, their leases, no new placements |
//! | `reconcile.rs`, `static_layout.rs` | start: store vs hardware, the operator's static layout |
//! | `devices.rs`, `token.rs`, `error.rs` | a lease's grant (the common `Grant`), tokens, errors |
//! | `events.rs`, `publish.rs` | WatchLeases events and their history; sending them |
//! | `queue.rs`, `multi.rs`, `mig_mps.rs` | the admission queue; leases of several partitions; MPS inside MIG |
//!
//! A CreateLease decides, then acts: `admission.rs` decides a `Plan` from the
//! table (`&State`) and the request, without locking or changing anything; the
//! executor (`executor.rs`) runs it. Every placed lease goes through one sequence
//! (invariant 2):
//! 1. reserve in memory (under the state lock the decision read the table with)
//!    so no concurrent call takes the same placement or share;
//! 2. intent: the lease, its partitions, its token and one intent per hardware
//!    step in one durable commit;
//! 3. hardware, each step in order (a failure undoes what was made, all or nothing);
//! 4. outcome: the partitions ready, the lease active, the intents finished, in one
//!    commit;
//! 5. publish in memory and acknowledge.
//!
//! A crash between any two steps leaves an open intent that [`LeaseManager::start`]
//! resolves: it adopts what the daemon created, undoes half-done work, and never
//! touches instances no record explains.
//!
//! May use: names, config, model, gpu, partition, store, host, usage. May not touch:
//! api, tonic or the generated proto types (the API layer converts).

mod admission;
mod binding;
mod create;
pub mod devices;
mod end;
pub mod enforce;
mod error;
mod events;
mod exact;
mod executor;
mod grants;
mod health;
mod housekeeping;
mod index;
mod manager;
mod mig_mps;
mod moves;
mod multi;
mod need;
mod outcome;
mod owner;
mod plan;
mod publish;
mod queries;
mod queue;
pub mod quota;
mod reconcile;
mod renew;
mod static_layout;
mod table;
pub mod token;
mod validate;
mod views;

pub use error::LeaseError;
pub use events::{EventKind, GENERATION_SHIFT, LeaseEvent, ResumeError, Subscription};
pub use health::HealthSource;
pub use manager::LeaseManager;
pub use multi::LeaseLinks;
pub use plan::{CreateRequest, Created, ExactPlacement, Isolation, Need};
pub use queries::{GpuReport, Page};
pub use table::GpuState;
pub use validate::validate_create;

#[cfg(test)]
mod paging_tests;
#[cfg(test)]
mod tests;
