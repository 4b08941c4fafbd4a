//! The roles a caller can have; `[[auth.principals]]` and `[[auth.oidc.rules]]` map
//! callers to them.

/// What a caller may do (see `api::auth`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Everything.
    Admin,
    /// ResolveToken, container binding and admission reports only.
    Runtime,
    /// Its own tenant's leases, usage and quota only.
    Tenant(String),
}
