//! The tessera.v1 handlers: one [`super::envelope::Handler`] per RPC, on its
//! request type. A handler is the call into the lease core and what its audit
//! record names; auth, deadline, audit, metrics and error mapping are the
//! envelope's.

mod lease;
mod node;
mod runtime;
