//! The names the daemon, the runtime, the CLI and the tests must spell alike: the
//! annotation and the environment variable that carry a lease token into a container
//! spec, the variables and annotation the runtime writes back, and the CDI kind of a
//! lease. One definition each; every binary uses these.

/// The OCI annotation carrying the lease token (one, or several joined by ',').
pub const LEASE_TOKEN_ANNOTATION: &str = "tessera.io/lease-token";
/// The variable in `process.env` that may carry the lease token instead.
pub const LEASE_TOKEN_ENV: &str = "TESSERA_LEASE_TOKEN";
/// The annotation the runtime adds to a hardened spec with the lease id.
pub const LEASE_ID_ANNOTATION: &str = "tessera.io/lease-id";
/// The variable a leased container gets with its lease id (ids joined by ',').
pub const LEASE_ID_ENV: &str = "TESSERA_LEASE_ID";
/// The CDI kind of a lease's device (`tessera.io/lease=<lease id>`).
pub const CDI_KIND: &str = "tessera.io/lease";
/// The variable that names the runtime's config file.
pub const RUNTIME_CONFIG_ENV: &str = "TESSERA_RUNTIME_CONFIG";
