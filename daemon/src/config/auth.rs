//! `[auth]`: who may call (unix credentials, client certificates, OIDC tokens) and
//! the TLS listener.

use std::path::PathBuf;

use serde::Deserialize;

use super::oidc::{self, OidcConfig};
use super::role::{NamedBy, Role, parse_role};
use super::validator::{ConfigError, Validator};

/// A mapping from unix credentials or a client certificate to a principal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrincipalRule {
    pub name: String,
    pub role: Role,
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
    /// Client certificate common names (mTLS listener).
    pub cert_cns: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    pub listen: std::net::SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA client certificates must chain to. Optional with `[auth.oidc]`: then
    /// a client certificate is optional too (a caller shows a token instead).
    pub client_ca: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthConfig {
    /// Rules in order; the first match wins. uid 0 is always admin.
    pub principals: Vec<PrincipalRule>,
    pub tls: Option<TlsConfig>,
    /// OIDC bearer tokens on the TLS listener.
    pub oidc: Option<OidcConfig>,
    /// The process whose mount and PID namespaces are the host's (default 1, init):
    /// a caller in other namespaces is inside a container.
    pub host_pid: i32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAuth {
    #[serde(default)]
    principals: Vec<RawPrincipal>,
    tls: Option<RawTls>,
    oidc: Option<oidc::RawOidc>,
    host_pid: Option<i32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPrincipal {
    name: String,
    role: String,
    tenant: Option<String>,
    #[serde(default)]
    uids: Vec<u32>,
    #[serde(default)]
    gids: Vec<u32>,
    #[serde(default)]
    cert_cns: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    listen: String,
    cert: PathBuf,
    key: PathBuf,
    client_ca: Option<PathBuf>,
}

pub(super) fn validate_auth(v: &Validator<'_>, raw: RawAuth) -> Result<AuthConfig, ConfigError> {
    let principals = raw
        .principals
        .into_iter()
        .enumerate()
        .map(|(i, p)| validate_principal(v, i, p))
        .collect::<Result<Vec<_>, _>>()?;
    let oidc = match raw.oidc {
        None => None,
        Some(o) => Some(oidc::validate_oidc(v, o)?),
    };
    if oidc.is_some() && raw.tls.is_none() {
        return Err(v.err(
            "auth.oidc",
            "bearer tokens are accepted on the TLS listener only: [auth.oidc] needs [auth.tls]"
                .into(),
        ));
    }
    let tls = match raw.tls {
        None => None,
        Some(t) => Some(validate_tls(v, t, oidc.is_some())?),
    };
    let host_pid = raw.host_pid.unwrap_or(1);
    if host_pid < 1 {
        return Err(v.err(
            "auth.host_pid",
            format!("{host_pid} is not a pid (1 or more)"),
        ));
    }
    Ok(AuthConfig {
        principals,
        tls,
        oidc,
        host_pid,
    })
}

/// One `[[auth.principals]]` rule.
fn validate_principal(
    v: &Validator<'_>,
    i: usize,
    p: RawPrincipal,
) -> Result<PrincipalRule, ConfigError> {
    let field = |k: &str| format!("auth.principals[{i}].{k}");
    if p.name.is_empty() || p.name.len() > 64 {
        return Err(v.err(&field("name"), "must be 1-64 characters".into()));
    }
    let role = parse_role(v, &field, &p.role, p.tenant, NamedBy::Principal)?;
    if p.uids.is_empty() && p.gids.is_empty() && p.cert_cns.is_empty() {
        return Err(v.err(
            &field("uids"),
            "a principal needs at least one of uids, gids or cert_cns".into(),
        ));
    }
    Ok(PrincipalRule {
        name: p.name,
        role,
        uids: p.uids,
        gids: p.gids,
        cert_cns: p.cert_cns,
    })
}

/// `[auth.tls]`: a client CA is required unless tokens say who calls.
fn validate_tls(v: &Validator<'_>, t: RawTls, oidc: bool) -> Result<TlsConfig, ConfigError> {
    let listen: std::net::SocketAddr = t.listen.parse().map_err(|e| {
        v.err(
            "auth.tls.listen",
            format!("{:?} is not an address like 127.0.0.1:7443: {e}", t.listen),
        )
    })?;
    if t.client_ca.is_none() && !oidc {
        return Err(v.err(
            "auth.tls.client_ca",
            "required: without [auth.oidc] a client certificate is the only way to say who calls"
                .into(),
        ));
    }
    Ok(TlsConfig {
        listen,
        cert: t.cert,
        key: t.key,
        client_ca: t.client_ca,
    })
}
