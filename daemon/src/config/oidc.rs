//! `[auth.oidc]`: OIDC bearer tokens on the TLS listener. The issuer and audience a
//! token must name, the signature algorithms accepted (asymmetric only), the leeway
//! on its times, where the issuer's keys come from (its discovery document over
//! HTTPS, or a JWKS file) and the rules mapping a claim's values to principals.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::role::{NamedBy, Role, parse_role};
use super::validator::{ConfigError, Validator};

/// Most leeway accepted on `exp`, `nbf` and `iat`: clock skew, not a grace period.
pub const MAX_LEEWAY: Duration = Duration::from_secs(300);

/// A signature algorithm a token may use. Asymmetric only: `none` and the HMAC
/// family (`HS*`, whose key would be the issuer's public key) are not algorithms
/// here at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OidcAlgorithm {
    RS256,
    RS384,
    RS512,
    PS256,
    PS384,
    PS512,
    ES256,
    ES384,
    EdDSA,
}

impl OidcAlgorithm {
    pub const ALL: [OidcAlgorithm; 9] = [
        OidcAlgorithm::RS256,
        OidcAlgorithm::RS384,
        OidcAlgorithm::RS512,
        OidcAlgorithm::PS256,
        OidcAlgorithm::PS384,
        OidcAlgorithm::PS512,
        OidcAlgorithm::ES256,
        OidcAlgorithm::ES384,
        OidcAlgorithm::EdDSA,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OidcAlgorithm::RS256 => "RS256",
            OidcAlgorithm::RS384 => "RS384",
            OidcAlgorithm::RS512 => "RS512",
            OidcAlgorithm::PS256 => "PS256",
            OidcAlgorithm::PS384 => "PS384",
            OidcAlgorithm::PS512 => "PS512",
            OidcAlgorithm::ES256 => "ES256",
            OidcAlgorithm::ES384 => "ES384",
            OidcAlgorithm::EdDSA => "EdDSA",
        }
    }

    pub fn parse(s: &str) -> Option<OidcAlgorithm> {
        Self::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// Where the issuer's signing keys come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwksSource {
    /// `<issuer>/.well-known/openid-configuration` -> `jwks_uri`, over HTTPS,
    /// verified with the system's roots or `ca_file`.
    Discovery { ca_file: Option<PathBuf> },
    /// A JWKS document on disk (air-gapped hosts); read again on an unknown `kid`
    /// and every `jwks_refresh`.
    File(PathBuf),
}

/// One rule: a token whose `claim` holds one of `values` (a string claim equal to
/// one, or an array claim containing one) is principal `name` with `role`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRule {
    pub name: String,
    /// A claim name; a dotted path (`realm_access.roles`) reaches into objects
    /// when no top-level claim has the whole name.
    pub claim: String,
    pub values: Vec<String>,
    /// Admin or Tenant (never Runtime: the runtime is on the node, on the socket).
    pub role: Role,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OidcConfig {
    /// Exactly what tokens carry as `iss` (no trailing-slash normalisation).
    pub issuer: String,
    /// `aud` must contain one of these.
    pub audiences: Vec<String>,
    pub algorithms: Vec<OidcAlgorithm>,
    /// Allowed clock skew on `exp`, `nbf` and `iat`.
    pub leeway: Duration,
    pub jwks: JwksSource,
    /// How often the keys are fetched again while nothing asks.
    pub jwks_refresh: Duration,
    /// At most one fetch per this interval because of an unknown `kid`.
    pub jwks_min_refetch: Duration,
    /// Most keys kept from one JWKS document (the rest are ignored, logged).
    pub max_keys: usize,
    /// Rules in order; the first that matches wins.
    pub rules: Vec<ClaimRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOidc {
    issuer: String,
    audience: AudienceList,
    algorithms: Option<Vec<String>>,
    leeway: Option<String>,
    ca_file: Option<PathBuf>,
    jwks_file: Option<PathBuf>,
    jwks_refresh: Option<String>,
    jwks_min_refetch: Option<String>,
    max_keys: Option<usize>,
    #[serde(default)]
    rules: Vec<RawRule>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum AudienceList {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    claim: String,
    values: Vec<String>,
    role: String,
    tenant: Option<String>,
}

pub(super) fn validate_oidc(v: &Validator<'_>, raw: RawOidc) -> Result<OidcConfig, ConfigError> {
    let f = |k: &str| format!("auth.oidc.{k}");
    let jwks = match (raw.jwks_file, raw.ca_file) {
        (Some(_), Some(_)) => {
            return Err(v.err(
                &f("ca_file"),
                "ca_file is for fetching the issuer's keys over HTTPS; with jwks_file nothing is fetched"
                    .into(),
            ));
        }
        (Some(path), None) => JwksSource::File(path),
        (None, ca_file) => JwksSource::Discovery { ca_file },
    };
    let issuer = validate_issuer(v, raw.issuer, &jwks)?;
    let audiences = match raw.audience {
        AudienceList::One(a) => vec![a],
        AudienceList::Many(a) => a,
    };
    if audiences.is_empty() || audiences.iter().any(String::is_empty) {
        return Err(v.err(
            &f("audience"),
            "needs at least one non-empty audience (the client id the IdP puts in `aud`)".into(),
        ));
    }
    let algorithms = validate_algorithms(v, raw.algorithms)?;
    let leeway = v.duration(&f("leeway"), raw.leeway, "30s")?;
    if leeway > MAX_LEEWAY {
        return Err(v.err(
            &f("leeway"),
            format!("at most {}s: it is for clock skew", MAX_LEEWAY.as_secs()),
        ));
    }
    let jwks_refresh = v.duration(&f("jwks_refresh"), raw.jwks_refresh, "1h")?;
    if jwks_refresh < Duration::from_secs(60) {
        return Err(v.err(&f("jwks_refresh"), "at least 1m".into()));
    }
    let jwks_min_refetch = v.duration(&f("jwks_min_refetch"), raw.jwks_min_refetch, "30s")?;
    let max_keys = raw.max_keys.unwrap_or(32);
    if !(1..=1024).contains(&max_keys) {
        return Err(v.err(&f("max_keys"), "must be 1-1024".into()));
    }
    let rules = raw
        .rules
        .into_iter()
        .enumerate()
        .map(|(i, r)| validate_rule(v, i, r))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(OidcConfig {
        issuer,
        audiences,
        algorithms,
        leeway,
        jwks,
        jwks_refresh,
        jwks_min_refetch,
        max_keys,
        rules,
    })
}

/// The issuer: an https:// URL when its keys are fetched.
fn validate_issuer(
    v: &Validator<'_>,
    issuer: String,
    jwks: &JwksSource,
) -> Result<String, ConfigError> {
    let f = |k: &str| format!("auth.oidc.{k}");
    if issuer.is_empty() || issuer.len() > 1024 {
        return Err(v.err(&f("issuer"), "must be 1-1024 characters".into()));
    }
    if matches!(jwks, JwksSource::Discovery { .. }) {
        let rest = issuer.strip_prefix("https://").unwrap_or_default();
        if rest.is_empty() || rest.starts_with('/') || issuer.contains(['?', '#']) {
            return Err(v.err(
                &f("issuer"),
                format!(
                    "{issuer:?} is not an https:// URL without query or fragment: the issuer's keys are fetched from <issuer>/.well-known/openid-configuration over HTTPS only (or set jwks_file)"
                ),
            ));
        }
    }
    Ok(issuer)
}

fn validate_algorithms(
    v: &Validator<'_>,
    names: Option<Vec<String>>,
) -> Result<Vec<OidcAlgorithm>, ConfigError> {
    let f = |k: &str| format!("auth.oidc.{k}");
    Ok(match names {
        None => vec![OidcAlgorithm::RS256, OidcAlgorithm::ES256],
        Some(names) => {
            if names.is_empty() {
                return Err(v.err(&f("algorithms"), "needs at least one algorithm".into()));
            }
            let mut out = Vec::new();
            for n in names {
                let Some(a) = OidcAlgorithm::parse(&n) else {
                    let why = if n.eq_ignore_ascii_case("none")
                        || n.to_ascii_uppercase().starts_with("HS")
                    {
                        "unsigned and shared-secret (HMAC) tokens are never accepted"
                    } else {
                        "not a known signature algorithm"
                    };
                    let all: Vec<_> = OidcAlgorithm::ALL.iter().map(|a| a.name()).collect();
                    return Err(v.err(
                        &f("algorithms"),
                        format!("{n:?}: {why}; one of {}", all.join(", ")),
                    ));
                };
                if !out.contains(&a) {
                    out.push(a);
                }
            }
            out
        }
    })
}

/// One `[[auth.oidc.rules]]` entry.
fn validate_rule(v: &Validator<'_>, i: usize, r: RawRule) -> Result<ClaimRule, ConfigError> {
    let field = |k: &str| format!("auth.oidc.rules[{i}].{k}");
    if r.name.is_empty() || r.name.len() > 64 {
        return Err(v.err(&field("name"), "must be 1-64 characters".into()));
    }
    if r.claim.is_empty() || r.claim.len() > 256 {
        return Err(v.err(&field("claim"), "must be 1-256 characters".into()));
    }
    if r.values.is_empty() || r.values.iter().any(String::is_empty) {
        return Err(v.err(
            &field("values"),
            "needs at least one non-empty value".into(),
        ));
    }
    let role = parse_role(v, &field, &r.role, r.tenant, NamedBy::Token)?;
    Ok(ClaimRule {
        name: r.name,
        claim: r.claim,
        values: r.values,
        role,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::path::Path;

    const BASE: &str = "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n[auth.tls]\nlisten = \"127.0.0.1:7443\"\ncert = \"/c.pem\"\nkey = \"/k.pem\"\n";
    const OIDC: &str = "[auth.oidc]\nissuer = \"https://idp.example.com/realms/gpu\"\naudience = \"tesserad\"\n[[auth.oidc.rules]]\nname = \"team-a\"\nclaim = \"groups\"\nvalues = [\"tessera-team-a\"]\nrole = \"tenant\"\ntenant = \"team-a\"\n";

    fn parse(text: &str) -> Result<Config, crate::config::ConfigError> {
        Config::parse(Path::new("test.toml"), text)
    }

    #[test]
    fn defaults_are_asymmetric_algorithms_and_a_small_leeway() {
        let c = parse(&format!("{BASE}{OIDC}")).unwrap();
        let o = c.auth.oidc.unwrap();
        assert_eq!(
            o.algorithms,
            vec![OidcAlgorithm::RS256, OidcAlgorithm::ES256]
        );
        assert_eq!(o.leeway, Duration::from_secs(30));
        assert_eq!(o.audiences, vec!["tesserad".to_string()]);
        assert_eq!(o.jwks, JwksSource::Discovery { ca_file: None });
        assert_eq!(o.rules[0].role, Role::Tenant("team-a".into()));
        // With [auth.oidc] the client CA is optional (callers show a token).
        assert_eq!(c.auth.tls.unwrap().client_ca, None);
    }

    #[test]
    fn unsafe_or_inconsistent_settings_are_refused_naming_the_field() {
        let set = |k: &str| {
            format!(
                "{BASE}{}",
                OIDC.replace("[[auth.oidc.rules]]", &format!("{k}\n[[auth.oidc.rules]]"))
            )
        };
        for (extra, field, says) in [
            (
                "algorithms = [\"none\"]",
                "auth.oidc.algorithms",
                "never accepted",
            ),
            (
                "algorithms = [\"HS256\"]",
                "auth.oidc.algorithms",
                "never accepted",
            ),
            ("algorithms = []", "auth.oidc.algorithms", "at least one"),
            ("leeway = \"10m\"", "auth.oidc.leeway", "at most 300s"),
            (
                "ca_file = \"/ca.pem\"\njwks_file = \"/j.json\"",
                "auth.oidc.ca_file",
                "nothing is fetched",
            ),
            ("max_keys = 0", "auth.oidc.max_keys", "1-1024"),
        ] {
            let e = parse(&set(extra)).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(says), "{extra}: {e}");
        }
        let e = parse(&format!(
            "{BASE}{}",
            OIDC.replace("https://idp.example.com", "http://idp.example.com")
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("auth.oidc.issuer") && e.contains("https://"),
            "{e}"
        );
        // With a JWKS file nothing is fetched: the issuer is only compared.
        let c = parse(&format!(
            "{BASE}{}",
            OIDC.replace(
                "https://idp.example.com/realms/gpu\"",
                "corp-idp\"\njwks_file = \"/j.json\""
            )
        ))
        .unwrap();
        assert_eq!(
            c.auth.oidc.unwrap().jwks,
            JwksSource::File("/j.json".into())
        );
        let e = parse(&format!(
            "{BASE}{}",
            OIDC.replace(
                "role = \"tenant\"\ntenant = \"team-a\"",
                "role = \"runtime\""
            )
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("auth.oidc.rules[0].role"), "{e}");
        // Tokens are read on the TLS listener only; without [auth.oidc] a client CA
        // is the only identity there.
        let no_tls = "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n";
        let e = parse(&format!("{no_tls}{OIDC}")).unwrap_err().to_string();
        assert!(e.contains("needs [auth.tls]"), "{e}");
        let e = parse(BASE).unwrap_err().to_string();
        assert!(e.contains("auth.tls.client_ca"), "{e}");
    }
}
