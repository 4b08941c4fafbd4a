//! One module per runc subcommand the runtime judges; every other one is handed to
//! runc with the flags as parsed (`crate::app`). Each `run` returns what `main` must
//! do ([`crate::plan::Outcome`]).

pub mod check;
pub mod create;
pub mod delete;
pub mod exec;
pub mod update;
