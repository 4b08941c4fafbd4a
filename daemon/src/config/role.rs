//! The roles a caller can have; `[[auth.principals]]` and `[[auth.oidc.rules]]` map
//! callers to them.

use super::validator::{ConfigError, Validator};

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

/// Who names a role: a `[[auth.principals]]` rule may name the runtime; a token
/// never is the runtime (it calls on the node's unix socket).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NamedBy {
    Principal,
    Token,
}

/// The role a rule names: `role`, with `tenant` for a tenant role only. `field`
/// names a key of the rule in errors.
pub(super) fn parse_role(
    v: &Validator<'_>,
    field: &dyn Fn(&str) -> String,
    role: &str,
    tenant: Option<String>,
    by: NamedBy,
) -> Result<Role, ConfigError> {
    let roles = match by {
        NamedBy::Principal => "admin, runtime, tenant",
        NamedBy::Token => "admin, tenant",
    };
    match (role, tenant) {
        ("runtime", _) if by == NamedBy::Token => Err(v.err(
            &field("role"),
            "a token is never the runtime (it calls on the node's unix socket): admin or tenant"
                .into(),
        )),
        ("admin", None) => Ok(Role::Admin),
        ("runtime", None) => Ok(Role::Runtime),
        ("tenant", Some(t)) => {
            crate::names::validate_tenant(&t)
                .map_err(|e| v.err(&field("tenant"), e.to_string()))?;
            Ok(Role::Tenant(t))
        }
        ("tenant", None) => Err(v.err(&field("tenant"), "role \"tenant\" needs a tenant".into())),
        ("admin" | "runtime", Some(_)) => Err(v.err(
            &field("tenant"),
            "only role \"tenant\" takes a tenant".into(),
        )),
        (other, _) => Err(v.err(&field("role"), format!("{other:?} is not one of {roles}"))),
    }
}
