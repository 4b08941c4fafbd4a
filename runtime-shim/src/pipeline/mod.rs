//! What a create (and `check`) does to decide, as a pipeline of small steps, each a
//! module: the spec's [`view`] (its tokens, pod and sandbox status, read once) ->
//! [`resolve`] (each token to an ACTIVE lease, merged into one grant) -> [`admit`]
//! (`harden(spec, grant, host view)`: the policy's decision) -> [`bind`] (the daemon
//! records the container on each lease). Nothing is bound, written or run before every
//! check of the steps before `bind` has passed; the command (`commands::create`) then
//! writes the hardened spec and runs runc.

pub mod admit;
pub mod bind;
pub mod resolve;
pub mod view;
