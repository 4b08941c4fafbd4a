//! OIDC bearer tokens on the TLS listener (`[auth.oidc]`).
//!
//! A request that carries `authorization: Bearer <jwt>` has the token verified
//! before the service sees it ([`OidcLayer`]): its header's `alg` must be one of
//! the configured asymmetric algorithms (never `none`, never `HS*`), its `kid`
//! must name a key of the issuer's JWKS whose type and `alg` agree, the signature
//! must verify, and `exp`, `nbf`, `iat` (with the leeway), `iss` and `aud` must
//! hold. The verdict goes into the request's extensions; [`super::auth::caller_of`]
//! turns it into the caller, and [`map_claims`] turns the verified claims into a
//! principal by the `[[auth.oidc.rules]]`, first match wins.
//!
//! Keys: from the issuer's discovery document (`jwks_uri`) over HTTPS, verified
//! with the system's roots or `ca_file`, or from `jwks_file`. They are fetched
//! again every `jwks_refresh`, and when a token names an unknown `kid` (at most
//! once per `jwks_min_refetch`); one document keeps at most `max_keys` keys, and a
//! failed fetch keeps the keys there were.
//!
//! Owns: token verification and the JWKS cache. May use: config, audit (the
//! subject's shape). May not touch: leases.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use base64::Engine as _;
use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};
use tonic::codegen::http;
use tracing::{info, warn};

use crate::audit::OidcSubject;
use crate::config::{ClaimRule, JwksSource, OidcAlgorithm, OidcConfig};

/// Largest token looked at (IdP tokens with many groups are a few KiB).
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;
/// Most characters of a header field (`alg`, `kid`) a refusal repeats: the
/// field is the caller's, and a refusal's message goes into the audit log.
const MAX_ECHO_CHARS: usize = 64;
/// Largest discovery or JWKS document read.
const MAX_DOCUMENT_BYTES: usize = 1024 * 1024;
/// One fetch (connect, TLS, request, body) takes at most this long.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum OidcError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: no certificate in it (PEM expected)")]
    NoCa { path: PathBuf },
    #[error("{path}: {message}")]
    BadCa { path: PathBuf, message: String },
    #[error("no system root certificates could be loaded: set [auth.oidc] ca_file")]
    NoRoots,
    #[error("{what}: {message}")]
    Document { what: String, message: String },
    #[error("{url}: {message}")]
    Fetch { url: String, message: String },
}

/// A verified token: who it names and its claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub subject: Arc<OidcSubject>,
    pub claims: Map<String, Value>,
}

impl Verified {
    /// How long until the token's `exp` (verified to be there and a number; zero
    /// once past).
    pub fn expires_in(&self) -> Duration {
        let exp = self
            .claims
            .get("exp")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        let now = jsonwebtoken::get_current_timestamp() as f64;
        Duration::try_from_secs_f64(exp - now).unwrap_or(Duration::ZERO)
    }
}

/// Why a bearer token was not accepted: the status the caller gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: tonic::Code,
    /// The status's ErrorInfo reason (`TOKEN_EXPIRED`, ...), for programs.
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    fn token(reason: &'static str, why: impl std::fmt::Display) -> Refusal {
        Refusal {
            code: tonic::Code::Unauthenticated,
            reason,
            message: format!("bearer token refused: {why}"),
        }
    }

    /// A client certificate and a token on one call: two identities, refused.
    pub fn two_identities(common_name: &str) -> Refusal {
        Refusal {
            code: tonic::Code::PermissionDenied,
            reason: "TWO_IDENTITIES",
            message: format!(
                "the call shows two identities, certificate CN={common_name:?} and a bearer token: a caller is one principal, so present one of them"
            ),
        }
    }

    /// A token where tokens are not read (the unix socket, or a TLS listener
    /// without `[auth.oidc]`).
    pub fn not_accepted_here() -> Refusal {
        Refusal {
            code: tonic::Code::Unauthenticated,
            reason: "TOKEN_NOT_ACCEPTED_HERE",
            message: "bearer tokens are accepted only on the TLS listener with [auth.oidc] configured; on the unix socket the caller's uid decides: send no token".into(),
        }
    }

    pub fn status(&self) -> tonic::Status {
        use tonic_types::StatusExt as _;
        let mut details = tonic_types::ErrorDetails::new();
        details.set_error_info(self.reason, super::errors::DOMAIN, HashMap::new());
        if self.code == tonic::Code::Unavailable {
            details.set_retry_info(Some(Duration::from_secs(5)));
        }
        tonic::Status::with_error_details(self.code, self.message.clone(), details)
    }
}

/// What [`OidcLayer`] found about a request's bearer token.
#[derive(Debug, Clone)]
pub struct TokenVerdict(pub Result<Arc<Verified>, Refusal>);

fn jwt_alg(a: OidcAlgorithm) -> Algorithm {
    match a {
        OidcAlgorithm::RS256 => Algorithm::RS256,
        OidcAlgorithm::RS384 => Algorithm::RS384,
        OidcAlgorithm::RS512 => Algorithm::RS512,
        OidcAlgorithm::PS256 => Algorithm::PS256,
        OidcAlgorithm::PS384 => Algorithm::PS384,
        OidcAlgorithm::PS512 => Algorithm::PS512,
        OidcAlgorithm::ES256 => Algorithm::ES256,
        OidcAlgorithm::ES384 => Algorithm::ES384,
        OidcAlgorithm::EdDSA => Algorithm::EdDSA,
    }
}

/// One signing key of the issuer.
struct Key {
    decoding: DecodingKey,
    /// The JWK's own `alg`, when it names one: then only that algorithm.
    alg: Option<Algorithm>,
}

#[derive(Default)]
struct KeySet {
    by_kid: HashMap<String, Arc<Key>>,
    /// Keys without a `kid` (usable by a token without one only when alone).
    unnamed: Vec<Arc<Key>>,
    loaded: bool,
}

impl KeySet {
    /// Parse a JWKS document: keys it cannot use (encryption keys, unknown types)
    /// are skipped, at most `max` are kept.
    fn parse(doc: &[u8], max: usize) -> Result<KeySet, String> {
        #[derive(serde::Deserialize)]
        struct Doc {
            keys: Vec<Value>,
        }
        let doc: Doc =
            serde_json::from_slice(doc).map_err(|e| format!("not a JWKS document: {e}"))?;
        let mut set = KeySet {
            loaded: true,
            ..KeySet::default()
        };
        let mut skipped = 0usize;
        for raw in doc.keys {
            if set.by_kid.len() + set.unnamed.len() >= max {
                skipped += 1;
                continue;
            }
            if raw
                .get("use")
                .and_then(Value::as_str)
                .is_some_and(|u| u != "sig")
            {
                continue;
            }
            let Ok(jwk) = serde_json::from_value::<Jwk>(raw) else {
                skipped += 1;
                continue;
            };
            if !usable(&jwk.algorithm) {
                skipped += 1;
                continue;
            }
            let alg = jwk
                .common
                .key_algorithm
                .and_then(|a| a.to_string().parse::<Algorithm>().ok());
            let Ok(decoding) = DecodingKey::from_jwk(&jwk) else {
                skipped += 1;
                continue;
            };
            let key = Arc::new(Key { decoding, alg });
            match jwk.common.key_id {
                Some(kid) => {
                    set.by_kid.insert(kid, key);
                }
                None => set.unnamed.push(key),
            }
        }
        if skipped > 0 {
            warn!(
                skipped,
                max, "oidc: JWKS keys not used (unsupported, malformed or over max_keys)"
            );
        }
        Ok(set)
    }

    fn find(&self, kid: Option<&str>) -> Option<Arc<Key>> {
        match kid {
            Some(kid) => self.by_kid.get(kid).cloned(),
            None if self.by_kid.len() + self.unnamed.len() == 1 => self
                .unnamed
                .first()
                .or_else(|| self.by_kid.values().next())
                .cloned(),
            None => None,
        }
    }
}

/// Whether a JWK is a public key this daemon verifies with: never a shared secret
/// (`oct`), never an RSA modulus under 2048 bits.
fn usable(params: &jsonwebtoken::jwk::AlgorithmParameters) -> bool {
    use jsonwebtoken::jwk::AlgorithmParameters as P;
    match params {
        P::RSA(rsa) => base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(rsa.n.trim_end_matches('='))
            .is_ok_and(|n| n.iter().skip_while(|b| **b == 0).count() >= 256),
        P::EllipticCurve(_) | P::OctetKeyPair(_) => true,
        _ => false,
    }
}

/// Verifies bearer tokens against the configured issuer; holds its keys.
pub struct Verifier {
    cfg: OidcConfig,
    tls: Option<Arc<tokio_rustls::rustls::ClientConfig>>,
    keys: RwLock<Arc<KeySet>>,
    /// When keys were last fetched for an unknown `kid` (the rate limit).
    refetch: tokio::sync::Mutex<Option<Instant>>,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("issuer", &self.cfg.issuer)
            .finish_non_exhaustive()
    }
}

impl Verifier {
    /// Check what can be checked before serving: the CA file parses, or the JWKS
    /// file reads and holds keys. The issuer is not contacted here.
    pub fn new(cfg: OidcConfig) -> Result<Arc<Verifier>, OidcError> {
        let (tls, keys) = match &cfg.jwks {
            JwksSource::File(path) => {
                let keys = read_jwks_file(path, cfg.max_keys)?;
                (None, keys)
            }
            JwksSource::Discovery { ca_file } => {
                (Some(client_tls(ca_file.as_ref())?), KeySet::default())
            }
        };
        Ok(Arc::new(Verifier {
            cfg,
            tls,
            keys: RwLock::new(Arc::new(keys)),
            refetch: tokio::sync::Mutex::new(None),
        }))
    }

    pub fn config(&self) -> &OidcConfig {
        &self.cfg
    }

    fn keys(&self) -> Arc<KeySet> {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Fetch (or re-read) the keys now; on failure the old ones stay.
    pub async fn refresh(&self) -> Result<usize, OidcError> {
        let set = match (&self.cfg.jwks, &self.tls) {
            (JwksSource::File(path), _) => read_jwks_file(path, self.cfg.max_keys)?,
            (JwksSource::Discovery { .. }, Some(tls)) => {
                fetch_jwks(&self.cfg.issuer, tls.clone(), self.cfg.max_keys).await?
            }
            (JwksSource::Discovery { .. }, None) => {
                return Err(OidcError::NoRoots);
            }
        };
        let n = set.by_kid.len() + set.unnamed.len();
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(set);
        Ok(n)
    }

    /// Keep the keys fresh: now (for the discovery document) and every
    /// `jwks_refresh`, until `stop`. A failed fetch is tried again sooner: after
    /// 5 s, doubling up to `jwks_refresh`.
    pub async fn run_refresh(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        let mut wait = match self.cfg.jwks {
            JwksSource::Discovery { .. } => Duration::ZERO,
            JwksSource::File(_) => self.cfg.jwks_refresh,
        };
        let mut retry = Duration::from_secs(5);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.changed() => return,
            }
            match self.refresh().await {
                Ok(n) => {
                    info!(issuer = %self.cfg.issuer, keys = n, "oidc: issuer keys loaded");
                    wait = self.cfg.jwks_refresh;
                    retry = Duration::from_secs(5);
                }
                Err(e) => {
                    wait = retry.min(self.cfg.jwks_refresh);
                    retry = retry.saturating_mul(2);
                    warn!(issuer = %self.cfg.issuer, error = %e, retry_in = ?wait, "oidc: issuer keys not refreshed; the previous ones stay");
                }
            }
            if *stop.borrow() {
                return;
            }
        }
    }

    /// The key a token's header names, fetching the keys again when it is not
    /// known (at most once per `jwks_min_refetch`).
    async fn key_for(&self, kid: Option<&str>) -> Result<Arc<Key>, Refusal> {
        if let Some(k) = self.keys().find(kid) {
            return Ok(k);
        }
        {
            let mut last = self.refetch.lock().await;
            // Another call may have fetched while this one waited.
            if let Some(k) = self.keys().find(kid) {
                return Ok(k);
            }
            if last.is_none_or(|t| t.elapsed() >= self.cfg.jwks_min_refetch) {
                *last = Some(Instant::now());
                if let Err(e) = self.refresh().await {
                    warn!(issuer = %self.cfg.issuer, error = %e, "oidc: issuer keys not refreshed for an unknown kid");
                }
            }
        }
        let keys = self.keys();
        if let Some(k) = keys.find(kid) {
            return Ok(k);
        }
        if !keys.loaded {
            return Err(Refusal {
                code: tonic::Code::Unavailable,
                reason: "ISSUER_KEYS_UNAVAILABLE",
                message: "bearer token not checked: the issuer's signing keys could not be fetched yet; retry later".into(),
            });
        }
        Err(Refusal::token(
            "TOKEN_UNKNOWN_KEY",
            match kid {
                Some(kid) => format!(
                    "signed with a key the issuer does not publish (kid {})",
                    echo(kid)
                ),
                None => "it names no key (kid) and the issuer has several".into(),
            },
        ))
    }

    /// The token's algorithm, if configured, and the key id it names; a header with
    /// critical extensions is refused.
    fn algorithm_and_kid<'h>(
        &self,
        header: &'h Map<String, Value>,
    ) -> Result<(jsonwebtoken::Algorithm, Option<&'h str>), Refusal> {
        let alg_name = header.get("alg").and_then(Value::as_str).unwrap_or("");
        let allowed = self
            .cfg
            .algorithms
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>()
            .join(", ");
        let Some(alg) = OidcAlgorithm::parse(alg_name).filter(|a| self.cfg.algorithms.contains(a))
        else {
            return Err(Refusal::token(
                "TOKEN_ALGORITHM_REFUSED",
                format!(
                    "its algorithm {} is not accepted (allowed: {allowed})",
                    echo(alg_name)
                ),
            ));
        };
        // RFC 7515 4.1.11: extensions marked critical must be understood; none are.
        if header.contains_key("crit") {
            return Err(Refusal::token(
                "TOKEN_MALFORMED",
                "its header names critical extensions (crit), which this daemon does not implement",
            ));
        }
        let kid = match header.get("kid") {
            None => None,
            Some(Value::String(k)) => Some(k.as_str()),
            Some(_) => return Err(Refusal::token("TOKEN_MALFORMED", "its kid is not a string")),
        };
        Ok((jwt_alg(alg), kid))
    }

    /// Verify `token`: the header, the key, the signature, then the claims.
    pub async fn verify(&self, token: &str) -> Result<Verified, Refusal> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Refusal::token(
                "TOKEN_MALFORMED",
                format!("longer than {MAX_TOKEN_BYTES} bytes"),
            ));
        }
        let header = raw_header(token).ok_or_else(|| {
            Refusal::token("TOKEN_MALFORMED", "not a JWT (header.payload.signature)")
        })?;
        let (alg, kid) = self.algorithm_and_kid(&header)?;
        let alg_name = format!("{alg:?}");
        let key = self.key_for(kid).await?;
        if key.alg.is_some_and(|a| a != alg) || key.decoding.family() != alg.family() {
            return Err(Refusal::token(
                "TOKEN_ALGORITHM_REFUSED",
                format!("its algorithm {alg_name} does not match the key it names"),
            ));
        }
        let mut v = Validation::new(alg);
        v.leeway = self.cfg.leeway.as_secs();
        v.validate_exp = true;
        v.validate_nbf = true;
        v.set_issuer(&[&self.cfg.issuer]);
        v.set_audience(&self.cfg.audiences);
        v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        let data =
            jsonwebtoken::decode::<Map<String, Value>>(token, &key.decoding, &v).map_err(|e| {
                let (reason, why) = self.why(e.kind());
                Refusal::token(reason, why)
            })?;
        let claims = data.claims;
        // RFC 7519 4.1.1: `iss` is one string (the library also takes an array
        // naming the issuer among others).
        if !matches!(claims.get("iss"), Some(Value::String(_))) {
            return Err(Refusal::token("TOKEN_MALFORMED", "its iss is not a string"));
        }
        check_iat(&claims, v.leeway)?;
        let text = |k: &str| claims.get(k).and_then(Value::as_str).map(str::to_string);
        let subject = text("sub").filter(|s| !s.is_empty()).ok_or_else(|| {
            Refusal::token("TOKEN_MALFORMED", "its sub is not a non-empty string")
        })?;
        let subject = OidcSubject {
            issuer: self.cfg.issuer.clone(),
            subject,
            email: text("email"),
            preferred_username: text("preferred_username"),
        };
        Ok(Verified {
            subject: Arc::new(subject),
            claims,
        })
    }

    /// What failed, in words for the caller: which check, not the token's content
    /// nor what this daemon expects (its issuer and audience are the operator's to
    /// tell, not an unauthenticated caller's to learn).
    fn why(&self, kind: &jsonwebtoken::errors::ErrorKind) -> (&'static str, String) {
        use jsonwebtoken::errors::ErrorKind as K;
        let leeway = self.cfg.leeway.as_secs();
        match kind {
            K::ExpiredSignature => (
                "TOKEN_EXPIRED",
                format!("expired (exp is past, beyond the {leeway}s leeway): get a new token"),
            ),
            K::ImmatureSignature => (
                "TOKEN_NOT_YET_VALID",
                format!("not valid yet (nbf is ahead, beyond the {leeway}s leeway)"),
            ),
            K::InvalidAudience => (
                "TOKEN_WRONG_AUDIENCE",
                "wrong audience: its aud does not name this daemon".into(),
            ),
            K::InvalidIssuer => (
                "TOKEN_WRONG_ISSUER",
                "wrong issuer: its iss is not the issuer this daemon trusts".into(),
            ),
            K::InvalidSignature => ("TOKEN_BAD_SIGNATURE", "bad signature".into()),
            K::MissingRequiredClaim(c) => ("TOKEN_MALFORMED", format!("it has no {c} claim")),
            K::InvalidClaimFormat(c) => ("TOKEN_MALFORMED", format!("its {c} claim is malformed")),
            K::InvalidAlgorithm
            | K::InvalidKeyFormat
            | K::InvalidEcdsaKey
            | K::InvalidRsaKey(_) => (
                "TOKEN_ALGORITHM_REFUSED",
                "its algorithm does not match the key it names".into(),
            ),
            _ => ("TOKEN_MALFORMED", "malformed token".into()),
        }
    }

    /// The verdict on an `authorization` header value.
    pub async fn check_header(&self, value: &http::HeaderValue) -> TokenVerdict {
        let token = value
            .to_str()
            .ok()
            .and_then(|v| {
                let (scheme, rest) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            })
            .filter(|t| !t.is_empty());
        let Some(token) = token else {
            return TokenVerdict(Err(Refusal::token(
                "TOKEN_MALFORMED",
                "the authorization header is not \"Bearer <token>\"",
            )));
        };
        TokenVerdict(self.verify(token).await.map(Arc::new))
    }
}

/// A header field as a refusal repeats it: quoted, escaped, and cut to
/// [`MAX_ECHO_CHARS`] characters.
fn echo(field: &str) -> String {
    match field.char_indices().nth(MAX_ECHO_CHARS) {
        Some((end, _)) => format!("{:?}...", &field[..end]),
        None => format!("{field:?}"),
    }
}

/// The JOSE header of a compact JWT, parsed as JSON (before any library decides
/// what it means: `alg: none` and `HS*` are refused by name).
fn raw_header(token: &str) -> Option<Map<String, Value>> {
    let mut parts = token.split('.');
    let (h, _, _) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(h)
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The principal rule a verified token matches (first match wins), or the
/// PERMISSION_DENIED text naming the claims looked at.
pub fn map_claims<'a>(rules: &'a [ClaimRule], token: &Verified) -> Result<&'a ClaimRule, String> {
    if let Some(r) = rules.iter().find(|r| {
        claim(&token.claims, &r.claim).is_some_and(|v| match v {
            Value::String(s) => r.values.contains(s),
            Value::Array(items) => items
                .iter()
                .filter_map(Value::as_str)
                .any(|s| r.values.iter().any(|want| want == s)),
            _ => false,
        })
    }) {
        return Ok(r);
    }
    let mut looked: Vec<&str> = rules.iter().map(|r| r.claim.as_str()).collect();
    looked.dedup();
    let s = &token.subject;
    Err(if looked.is_empty() {
        format!(
            "OIDC subject {:?} of {:?} maps to no tenant: [auth.oidc] has no rules",
            s.subject, s.issuer
        )
    } else {
        let what: Vec<String> = looked
            .iter()
            .map(|c| match claim(&token.claims, c) {
                None => format!("it has no `{c}` claim"),
                Some(_) => format!("no value of its `{c}` claim is in a rule"),
            })
            .collect();
        format!(
            "OIDC subject {:?} of {:?} maps to no tenant in [[auth.oidc.rules]]: {}",
            s.subject,
            s.issuer,
            what.join("; ")
        )
    })
}

/// A claim by name, or by a dotted path into objects when no claim has the name.
fn claim<'a>(claims: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    if let Some(v) = claims.get(name) {
        return Some(v);
    }
    let mut parts = name.split('.');
    let mut cur = claims.get(parts.next()?)?;
    for p in parts {
        cur = cur.as_object()?.get(p)?;
    }
    Some(cur)
}

fn read_jwks_file(path: &PathBuf, max: usize) -> Result<KeySet, OidcError> {
    let bytes = std::fs::read(path).map_err(|source| OidcError::Io {
        path: path.clone(),
        source,
    })?;
    let set = KeySet::parse(&bytes, max).map_err(|message| OidcError::Document {
        what: path.display().to_string(),
        message,
    })?;
    if set.by_kid.is_empty() && set.unnamed.is_empty() {
        return Err(OidcError::Document {
            what: path.display().to_string(),
            message: "no signing key this daemon can use".into(),
        });
    }
    Ok(set)
}

/// TLS settings for fetching from the issuer: `ca_file`, or the system's roots.
fn client_tls(
    ca_file: Option<&PathBuf>,
) -> Result<Arc<tokio_rustls::rustls::ClientConfig>, OidcError> {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::CertificateDer;
    use tokio_rustls::rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let pem = std::fs::read(path).map_err(|source| OidcError::Io {
                path: path.clone(),
                source,
            })?;
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| OidcError::BadCa {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
                roots.add(cert).map_err(|e| OidcError::BadCa {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            }
            if roots.is_empty() {
                return Err(OidcError::NoCa { path: path.clone() });
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(OidcError::NoRoots);
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| OidcError::Document {
            what: "TLS".into(),
            message: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The discovery document, then the JWKS it names.
async fn fetch_jwks(
    issuer: &str,
    tls: Arc<tokio_rustls::rustls::ClientConfig>,
    max: usize,
) -> Result<KeySet, OidcError> {
    let url = format!(
        "{}/.well-known/openid-configuration",
        issuer.trim_end_matches('/')
    );
    let doc = https_get(&url, tls.clone()).await?;
    let doc: Map<String, Value> =
        serde_json::from_slice(&doc).map_err(|e| OidcError::Document {
            what: url.clone(),
            message: format!("not a JSON object: {e}"),
        })?;
    // OpenID Connect Discovery 1.0, 4.3: the document's issuer is the one asked.
    if doc.get("issuer").and_then(Value::as_str) != Some(issuer) {
        return Err(OidcError::Document {
            what: url,
            message: format!("its issuer is not {issuer:?}"),
        });
    }
    let Some(jwks_uri) = doc.get("jwks_uri").and_then(Value::as_str) else {
        return Err(OidcError::Document {
            what: url,
            message: "it has no jwks_uri".into(),
        });
    };
    let jwks = https_get(jwks_uri, tls).await?;
    let set = KeySet::parse(&jwks, max).map_err(|message| OidcError::Document {
        what: jwks_uri.to_string(),
        message,
    })?;
    // A document without a key this daemon can use is a failed fetch (as a
    // `jwks_file` without one is): the keys there were stay.
    if set.by_kid.is_empty() && set.unnamed.is_empty() {
        return Err(OidcError::Document {
            what: jwks_uri.to_string(),
            message: "no signing key this daemon can use".into(),
        });
    }
    Ok(set)
}

/// GET an https:// URL: one HTTP/1.1 request, no redirects, a bounded body, a
/// deadline.
async fn https_get(
    url: &str,
    tls: Arc<tokio_rustls::rustls::ClientConfig>,
) -> Result<Vec<u8>, OidcError> {
    let fail = |message: String| OidcError::Fetch {
        url: url.to_string(),
        message,
    };
    match tokio::time::timeout(FETCH_TIMEOUT, https_get_inner(url, tls)).await {
        Ok(r) => r.map_err(fail),
        Err(_) => Err(fail(format!(
            "no answer within {}s",
            FETCH_TIMEOUT.as_secs()
        ))),
    }
}

async fn https_get_inner(
    url: &str,
    tls: Arc<tokio_rustls::rustls::ClientConfig>,
) -> Result<Vec<u8>, String> {
    use http_body_util::BodyExt as _;
    use tokio_rustls::rustls::pki_types::ServerName;
    let uri: http::Uri = url.parse().map_err(|e| format!("not a URL: {e}"))?;
    if uri.scheme_str() != Some("https") {
        return Err("only https:// is fetched".into());
    }
    let host = uri.host().ok_or("no host")?.to_string();
    let port = uri.port_u16().unwrap_or(443);
    let bare = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let name = ServerName::try_from(bare.clone()).map_err(|e| format!("host {host:?}: {e}"))?;
    let tcp = tokio::net::TcpStream::connect((bare.as_str(), port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP: {e}"))?;
    // The connection's task ends with this fetch, however it ends (the deadline
    // included).
    struct AbortOnDrop(tokio::task::JoinHandle<Result<(), hyper::Error>>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let _driver = AbortOnDrop(tokio::spawn(conn));
    let authority = match uri.port_u16() {
        Some(p) => format!("{host}:{p}"),
        None => host,
    };
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let req = http::Request::get(path)
        .header(http::header::HOST, authority)
        .header(http::header::ACCEPT, "application/json")
        .header(http::header::USER_AGENT, "tesserad")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| format!("request: {e}"))?;
    let resp = send
        .send_request(req)
        .await
        .map_err(|e| format!("HTTP: {e}"))?;
    if resp.status() != http::StatusCode::OK {
        return Err(format!("HTTP status {}", resp.status()));
    }
    let body = http_body_util::Limited::new(resp.into_body(), MAX_DOCUMENT_BYTES)
        .collect()
        .await
        .map_err(|e| format!("body (at most {MAX_DOCUMENT_BYTES} bytes): {e}"))?
        .to_bytes();
    Ok(body.to_vec())
}

/// Verifies a request's bearer token before the service sees it (the TLS
/// listener's stack). Without a verifier a token passes unread, and the service
/// refuses it ([`Refusal::not_accepted_here`]).
#[derive(Debug, Clone)]
pub struct OidcLayer {
    verifier: Option<Arc<Verifier>>,
}

impl OidcLayer {
    pub fn new(verifier: Option<Arc<Verifier>>) -> OidcLayer {
        OidcLayer { verifier }
    }
}

impl<S> tower::Layer<S> for OidcLayer {
    type Service = OidcService<S>;

    fn layer(&self, inner: S) -> OidcService<S> {
        OidcService {
            inner,
            verifier: self.verifier.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct OidcService<S> {
    inner: S,
    verifier: Option<Arc<Verifier>>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for OidcService<S>
where
    S: tower::Service<http::Request<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        // The service that was polled ready serves this request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let verifier = self.verifier.clone();
        Box::pin(async move {
            let mut headers = req.headers().get_all(http::header::AUTHORIZATION).iter();
            let (first, more) = (headers.next().cloned(), headers.next().is_some());
            if let Some(v) = verifier
                && let Some(h) = first
            {
                let verdict = if more {
                    TokenVerdict(Err(Refusal::token(
                        "TOKEN_MALFORMED",
                        "the call carries several authorization headers",
                    )))
                } else {
                    v.check_header(&h).await
                };
                req.extensions_mut().insert(verdict);
            }
            inner.call(req).await
        })
    }
}

/// `iat`, when present, is a number not beyond now plus the leeway.
fn check_iat(claims: &Map<String, Value>, leeway: u64) -> Result<(), Refusal> {
    let now = jsonwebtoken::get_current_timestamp();
    match claims.get("iat") {
        None => {}
        Some(Value::Number(n)) => match n.as_f64() {
            Some(iat) if iat <= (now + leeway) as f64 => {}
            Some(_) => {
                return Err(Refusal::token(
                    "TOKEN_NOT_YET_VALID",
                    "issued in the future (iat), beyond the leeway",
                ));
            }
            None => return Err(Refusal::token("TOKEN_MALFORMED", "its iat is not a number")),
        },
        Some(_) => return Err(Refusal::token("TOKEN_MALFORMED", "its iat is not a number")),
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
    use jsonwebtoken::{EncodingKey, Header};
    use serde_json::json;

    const ISSUER: &str = "https://idp.example.com/realms/gpu";

    /// An ES256 signing key of the test's issuer.
    struct Signer {
        kid: String,
        pair: rcgen::KeyPair,
    }

    impl Signer {
        fn new(kid: &str) -> Signer {
            Signer {
                kid: kid.into(),
                pair: rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap(),
            }
        }

        fn jwk(&self) -> Value {
            let raw = self.pair.public_key_raw();
            json!({"kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": self.kid,
                   "x": B64.encode(&raw[1..33]), "y": B64.encode(&raw[33..65])})
        }

        fn sign(&self, claims: &Value) -> String {
            let mut h = Header::new(Algorithm::ES256);
            h.kid = Some(self.kid.clone());
            let key = EncodingKey::from_ec_der(&self.pair.serialize_der());
            jsonwebtoken::encode(&h, claims, &key).unwrap()
        }
    }

    fn now() -> i64 {
        jsonwebtoken::get_current_timestamp() as i64
    }

    fn claims() -> Value {
        json!({"iss": ISSUER, "aud": "tesserad", "sub": "u-123", "exp": now() + 300,
               "iat": now(), "email": "ada@example.com", "preferred_username": "ada",
               "groups": ["tessera-team-a"]})
    }

    fn with(mut c: Value, k: &str, v: Value) -> Value {
        c[k] = v;
        c
    }

    fn write_jwks(path: &std::path::Path, keys: &[&Signer]) {
        let doc = json!({"keys": keys.iter().map(|k| k.jwk()).collect::<Vec<_>>()});
        std::fs::write(path, doc.to_string()).unwrap();
    }

    fn verifier(path: &std::path::Path, min_refetch: Duration) -> Arc<Verifier> {
        Verifier::new(OidcConfig {
            issuer: ISSUER.into(),
            audiences: vec!["tesserad".into()],
            algorithms: vec![OidcAlgorithm::RS256, OidcAlgorithm::ES256],
            leeway: Duration::from_secs(30),
            jwks: JwksSource::File(path.to_path_buf()),
            jwks_refresh: Duration::from_secs(3600),
            jwks_min_refetch: min_refetch,
            max_keys: 8,
            rules: vec![],
        })
        .unwrap()
    }

    fn refused(r: Result<Verified, Refusal>) -> String {
        let e = r.expect_err("the token must be refused");
        assert_eq!(e.code, tonic::Code::Unauthenticated, "{}", e.message);
        e.message
    }

    /// Every check a token must pass, each failing on its own with a message that
    /// names the check (and not the token).
    #[tokio::test]
    async fn tokens_are_accepted_only_when_every_check_holds() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        let key = Signer::new("k1");
        write_jwks(&jwks, &[&key]);
        let v = verifier(&jwks, Duration::from_secs(3600));

        let ok = v.verify(&key.sign(&claims())).await.unwrap();
        assert_eq!(ok.subject.issuer, ISSUER);
        assert_eq!(ok.subject.subject, "u-123");
        assert_eq!(ok.subject.email.as_deref(), Some("ada@example.com"));
        assert_eq!(ok.subject.preferred_username.as_deref(), Some("ada"));
        // Inside the leeway: a just-expired token still passes, an older one not.
        v.verify(&key.sign(&with(claims(), "exp", json!(now() - 10))))
            .await
            .unwrap();
        let m = refused(
            v.verify(&key.sign(&with(claims(), "exp", json!(now() - 3600))))
                .await,
        );
        assert!(m.contains("expired"), "{m}");
        let e = v
            .verify(&key.sign(&with(claims(), "exp", json!(now() - 3600))))
            .await
            .unwrap_err();
        assert_eq!(e.reason, "TOKEN_EXPIRED");
        use tonic_types::StatusExt as _;
        let st = e.status();
        assert_eq!(st.get_details_error_info().unwrap().reason, "TOKEN_EXPIRED");
        let m = refused(
            v.verify(&key.sign(&with(claims(), "aud", json!("other-app"))))
                .await,
        );
        assert!(m.contains("wrong audience"), "{m}");
        let m = refused(
            v.verify(&key.sign(&with(claims(), "iss", json!("https://evil.example"))))
                .await,
        );
        assert!(m.contains("wrong issuer"), "{m}");
        let m = refused(
            v.verify(&key.sign(&with(claims(), "nbf", json!(now() + 3600))))
                .await,
        );
        assert!(m.contains("not valid yet"), "{m}");
        let m = refused(
            v.verify(&key.sign(&with(claims(), "iat", json!(now() + 3600))))
                .await,
        );
        assert!(m.contains("issued in the future"), "{m}");
        let mut no_sub = claims();
        no_sub.as_object_mut().unwrap().remove("sub");
        let m = refused(v.verify(&key.sign(&no_sub)).await);
        assert!(m.contains("sub"), "{m}");
        let mut no_exp = claims();
        no_exp.as_object_mut().unwrap().remove("exp");
        let m = refused(v.verify(&key.sign(&no_exp)).await);
        assert!(m.contains("exp"), "{m}");

        // A key the issuer does not publish.
        let m = refused(v.verify(&Signer::new("k9").sign(&claims())).await);
        assert!(m.contains("does not publish"), "{m}");
        // Signed by another key under a published kid.
        let impostor = Signer {
            kid: "k1".into(),
            ..Signer::new("x")
        };
        let m = refused(v.verify(&impostor.sign(&claims())).await);
        assert!(m.contains("bad signature"), "{m}");

        // A payload changed after signing.
        let good = key.sign(&claims());
        let parts: Vec<&str> = good.split('.').collect();
        let admin = B64.encode(with(claims(), "groups", json!(["tessera-admins"])).to_string());
        let m = refused(
            v.verify(&format!("{}.{admin}.{}", parts[0], parts[2]))
                .await,
        );
        assert!(m.contains("bad signature"), "{m}");

        // alg none, signed or not.
        let none = B64.encode(r#"{"alg":"none","kid":"k1"}"#);
        let payload = B64.encode(claims().to_string());
        for t in [
            format!("{none}.{payload}."),
            format!("{none}.{payload}.{}", parts[2]),
        ] {
            let m = refused(v.verify(&t).await);
            assert!(m.contains("\"none\" is not accepted"), "{m}");
        }
        // HS256 with the issuer's public key as the secret (algorithm confusion).
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("k1".into());
        let public = key.jwk().to_string();
        let forged =
            jsonwebtoken::encode(&h, &claims(), &EncodingKey::from_secret(public.as_bytes()))
                .unwrap();
        let m = refused(v.verify(&forged).await);
        assert!(m.contains("\"HS256\" is not accepted"), "{m}");
        // ES384 is a real algorithm, but not configured here.
        let es384 = format!(
            "{}.{payload}.{}",
            B64.encode(r#"{"alg":"ES384","kid":"k1"}"#),
            parts[2]
        );
        let m = refused(v.verify(&es384).await);
        assert!(m.contains("allowed: RS256, ES256"), "{m}");
        // A critical header extension nobody here implements.
        let crit = format!(
            "{}.{payload}.{}",
            B64.encode(r#"{"alg":"ES256","kid":"k1","crit":["b64"],"b64":false}"#),
            parts[2]
        );
        let m = refused(v.verify(&crit).await);
        assert!(m.contains("crit"), "{m}");
        // Not a JWT at all.
        let m = refused(v.verify("not-a-token").await);
        assert!(m.contains("not a JWT"), "{m}");
    }

    /// A rotated key is picked up when a token names it, but the keys are read
    /// again at most once per `jwks_min_refetch`.
    #[tokio::test]
    async fn an_unknown_kid_refreshes_the_keys_at_most_once_per_interval() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        let old = Signer::new("old");
        let new = Signer::new("new");
        write_jwks(&jwks, &[&old]);
        let limited = verifier(&jwks, Duration::from_secs(3600));
        let eager = verifier(&jwks, Duration::ZERO);
        // Each looks once for an unknown kid (not there yet).
        refused(limited.verify(&new.sign(&claims())).await);
        refused(eager.verify(&new.sign(&claims())).await);
        // The issuer rotates.
        write_jwks(&jwks, &[&new]);
        let m = refused(limited.verify(&new.sign(&claims())).await);
        assert!(m.contains("does not publish"), "{m}");
        eager.verify(&new.sign(&claims())).await.unwrap();
        // The old key is gone from the issuer's set: its tokens no longer pass.
        let m = refused(eager.verify(&old.sign(&claims())).await);
        assert!(m.contains("does not publish"), "{m}");
    }

    #[test]
    fn a_jwks_keeps_at_most_max_keys_and_skips_what_it_cannot_use() {
        let keys: Vec<Signer> = (0..5).map(|i| Signer::new(&format!("k{i}"))).collect();
        let mut docs: Vec<Value> = keys.iter().map(Signer::jwk).collect();
        docs.insert(0, json!({"kty": "EC", "use": "enc", "kid": "enc"}));
        docs.insert(0, json!({"kty": "weird", "kid": "weird"}));
        docs.insert(
            0,
            json!({"kty": "oct", "kid": "secret", "k": B64.encode("shared")}),
        );
        docs.insert(
            0,
            json!({"kty": "RSA", "kid": "rsa-1024", "n": B64.encode([0xc5u8; 128]), "e": "AQAB"}),
        );
        let set = KeySet::parse(json!({ "keys": docs }).to_string().as_bytes(), 3).unwrap();
        assert_eq!(set.by_kid.len(), 3);
        for skipped in ["enc", "weird", "secret", "rsa-1024"] {
            assert!(!set.by_kid.contains_key(skipped), "{skipped}");
        }
        assert!(KeySet::parse(b"[]", 3).is_err());
    }

    fn rule(name: &str, claim: &str, value: &str, role: crate::config::Role) -> ClaimRule {
        ClaimRule {
            name: name.into(),
            claim: claim.into(),
            values: vec![value.into()],
            role,
        }
    }

    fn verified(claims: Value) -> Verified {
        Verified {
            subject: Arc::new(OidcSubject {
                issuer: ISSUER.into(),
                subject: "u-123".into(),
                email: None,
                preferred_username: None,
            }),
            claims: claims.as_object().unwrap().clone(),
        }
    }

    #[test]
    fn claims_map_to_the_first_rule_they_match_or_name_the_claims_looked_at() {
        use crate::config::Role;
        let rules = vec![
            rule("admins", "groups", "tessera-admins", Role::Admin),
            rule(
                "team-a",
                "groups",
                "tessera-team-a",
                Role::Tenant("team-a".into()),
            ),
            rule(
                "kc-b",
                "realm_access.roles",
                "team-b",
                Role::Tenant("team-b".into()),
            ),
            rule(
                "by-claim",
                "tenant",
                "team-c",
                Role::Tenant("team-c".into()),
            ),
        ];
        let t = verified(json!({"groups": ["x", "tessera-team-a"]}));
        assert_eq!(map_claims(&rules, &t).unwrap().name, "team-a");
        let t = verified(json!({"groups": ["tessera-team-a", "tessera-admins"]}));
        assert_eq!(
            map_claims(&rules, &t).unwrap().name,
            "admins",
            "first match wins"
        );
        let t = verified(json!({"realm_access": {"roles": ["team-b"]}}));
        assert_eq!(map_claims(&rules, &t).unwrap().name, "kc-b");
        let t = verified(json!({"tenant": "team-c"}));
        assert_eq!(map_claims(&rules, &t).unwrap().name, "by-claim");
        // A prefix or a different type never matches.
        let t = verified(
            json!({"groups": "tessera-team-a-evil", "tenant": ["team-cc"], "realm_access": "team-b"}),
        );
        let m = map_claims(&rules, &t).unwrap_err();
        assert!(m.contains("no value of its `groups` claim"), "{m}");
        assert!(m.contains("`realm_access.roles`"), "{m}");
        let m = map_claims(&rules, &verified(json!({}))).unwrap_err();
        assert!(m.contains("it has no `groups` claim"), "{m}");
        assert!(m.contains("u-123"), "{m}");
    }

    /// A verified token is the caller and maps by the OIDC rules; a token where
    /// none is read (the unix socket) is refused, never ignored.
    #[test]
    fn the_caller_is_the_token_and_a_token_where_none_is_read_is_refused() {
        use super::super::auth::{Authenticator, Caller, Principal, caller_of};
        use crate::config::Role;
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        write_jwks(&jwks, &[&Signer::new("k1")]);
        let mut cfg = verifier(&jwks, Duration::ZERO).config().clone();
        cfg.rules = vec![rule(
            "team-a",
            "groups",
            "tessera-team-a",
            Role::Tenant("team-a".into()),
        )];
        let a = Authenticator::new(vec![]).with_oidc(Verifier::new(cfg).unwrap());

        let mut req = tonic::Request::new(());
        let token = Arc::new(verified(json!({"groups": ["tessera-team-a"]})));
        req.extensions_mut().insert(TokenVerdict(Ok(token.clone())));
        let caller = caller_of(&req);
        assert_eq!(caller, Caller::Token(token));
        match a.identify(&caller).unwrap() {
            Principal::Tenant { tenant, oidc, .. } => {
                assert_eq!(tenant, "team-a");
                assert_eq!(oidc.unwrap().subject, "u-123");
            }
            other => panic!("{other:?}"),
        }
        let e = a
            .identify(&Caller::Token(Arc::new(verified(
                json!({"groups": ["other"]}),
            ))))
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("`groups`"), "{}", e.message());

        let mut req = tonic::Request::new(());
        req.metadata_mut()
            .insert("authorization", "Bearer abc".parse().unwrap());
        let e = a.identify(&caller_of(&req)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(
            e.message().contains("only on the TLS listener"),
            "{}",
            e.message()
        );
    }

    /// Until the issuer's keys could be fetched, a token is not judged: the caller
    /// is told to retry (UNAVAILABLE), not that the token is bad.
    #[tokio::test]
    async fn a_token_before_any_keys_could_be_fetched_is_unavailable_not_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let pair = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .self_signed(&pair)
            .unwrap();
        std::fs::write(&ca, cert.pem()).unwrap();
        // Nothing listens on port 1.
        let v = Verifier::new(OidcConfig {
            issuer: "https://127.0.0.1:1/realms/gpu".into(),
            jwks: JwksSource::Discovery {
                ca_file: Some(ca.clone()),
            },
            ..verifier(&write_one_key(dir.path()), Duration::ZERO)
                .config()
                .clone()
        })
        .unwrap();
        let e = v
            .verify(&Signer::new("k1").sign(&claims()))
            .await
            .unwrap_err();
        assert_eq!(e.code, tonic::Code::Unavailable, "{}", e.message);
        assert!(e.message.contains("could not be fetched"), "{}", e.message);
        // A CA file without a certificate stops the start.
        std::fs::write(&ca, "not a certificate").unwrap();
        let cfg = v.config().clone();
        assert!(matches!(Verifier::new(cfg), Err(OidcError::NoCa { .. })));
    }

    fn write_one_key(dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("jwks.json");
        write_jwks(&path, &[&Signer::new("k0")]);
        path
    }

    /// The layer judges a request's token before the service sees it; a request
    /// without one passes untouched, several authorization headers are refused.
    #[tokio::test]
    async fn the_layer_puts_its_verdict_on_requests_that_carry_a_token() {
        use tower::{Layer as _, ServiceExt as _};
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        let key = Signer::new("k1");
        write_jwks(&jwks, &[&key]);
        let svc = OidcLayer::new(Some(verifier(&jwks, Duration::ZERO))).layer(tower::service_fn(
            |req: http::Request<()>| async move {
                Ok::<_, std::convert::Infallible>(
                    req.extensions()
                        .get::<TokenVerdict>()
                        .map(|t| t.0.clone().map_err(|r| r.reason)),
                )
            },
        ));
        let call = |headers: Vec<String>| {
            let svc = svc.clone();
            async move {
                let mut req = http::Request::new(());
                for h in headers {
                    req.headers_mut()
                        .append(http::header::AUTHORIZATION, h.parse().unwrap());
                }
                svc.oneshot(req).await.unwrap()
            }
        };
        assert!(call(vec![]).await.is_none());
        let good = format!("Bearer {}", key.sign(&claims()));
        let ok = call(vec![good.clone()]).await.unwrap().unwrap();
        assert_eq!(ok.subject.subject, "u-123");
        assert_eq!(
            call(vec![good.replace("Bearer", "bearer")])
                .await
                .unwrap()
                .map(|_| ()),
            Ok(())
        );
        for bad in [
            vec![good.clone(), good.clone()],
            vec!["Basic YWRhOnB3".into()],
        ] {
            assert_eq!(call(bad).await.unwrap().map(|_| ()), Err("TOKEN_MALFORMED"));
        }
        // Without [auth.oidc] a token passes unread (and the service refuses it).
        let plain =
            OidcLayer::new(None).layer(tower::service_fn(|req: http::Request<()>| async move {
                Ok::<_, std::convert::Infallible>(req.extensions().get::<TokenVerdict>().is_some())
            }));
        let mut req = http::Request::new(());
        req.headers_mut()
            .insert(http::header::AUTHORIZATION, good.parse().unwrap());
        assert!(!plain.oneshot(req).await.unwrap());
    }

    /// A token signed over any header and payload text, by `key`.
    fn sign_raw(key: &Signer, header: &str, payload: &str) -> String {
        let msg = format!("{}.{}", B64.encode(header), B64.encode(payload));
        let ek = EncodingKey::from_ec_der(&key.pair.serialize_der());
        let sig = jsonwebtoken::crypto::sign(msg.as_bytes(), &ek, Algorithm::ES256).unwrap();
        format!("{msg}.{sig}")
    }

    /// An unauthenticated caller chooses the header's `kid` and `alg`: a refusal
    /// repeats a short start of them, never kilobytes (each refusal is an audit
    /// record, and its message goes there).
    #[tokio::test]
    async fn a_refusal_repeats_at_most_a_short_start_of_the_callers_header() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        let key = Signer::new("k1");
        write_jwks(&jwks, &[&key]);
        let v = verifier(&jwks, Duration::from_secs(3600));
        let long = "A".repeat(9000);
        let payload = claims().to_string();
        for (header, says) in [
            (json!({"alg": "ES256", "kid": long}), "does not publish"),
            (json!({"alg": long, "kid": "k1"}), "is not accepted"),
        ] {
            let m = refused(
                v.verify(&sign_raw(&key, &header.to_string(), &payload))
                    .await,
            );
            assert!(m.contains(says), "{m}");
            assert!(m.len() < 300, "{} bytes: {m}", m.len());
            assert!(m.contains("\"AAAA"), "{m}");
        }
    }

    /// `iss` is one string: an array that names the issuer among others is
    /// refused, though the library would take it.
    #[tokio::test]
    async fn an_issuer_array_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        let key = Signer::new("k1");
        write_jwks(&jwks, &[&key]);
        let v = verifier(&jwks, Duration::from_secs(3600));
        for iss in [json!([ISSUER]), json!(["https://other.example", ISSUER])] {
            let m = refused(v.verify(&key.sign(&with(claims(), "iss", iss))).await);
            assert!(m.contains("iss"), "{m}");
        }
        v.verify(&key.sign(&claims())).await.unwrap();
    }

    /// Header tricks an outsider tries, each refused: an algorithm of another
    /// family than the key its kid names, no kid while the issuer has several keys,
    /// a key of its own in the header (`jwk`, `jku`, `x5u`), a kid given twice.
    #[tokio::test]
    async fn header_tricks_never_choose_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        let key = Signer::new("k1");
        let other = Signer::new("k2");
        write_jwks(&jwks, &[&key, &other]);
        let v = verifier(&jwks, Duration::from_secs(3600));
        let payload = claims().to_string();
        let attacker = Signer::new("k1");
        let cases = [
            // RS256 is configured, but k1 is an EC key.
            (
                sign_raw(&key, r#"{"alg":"RS256","kid":"k1"}"#, &payload),
                "TOKEN_ALGORITHM_REFUSED",
            ),
            (
                sign_raw(&key, r#"{"alg":"ES256"}"#, &payload),
                "TOKEN_UNKNOWN_KEY",
            ),
            (
                sign_raw(
                    &attacker,
                    &json!({"alg": "ES256", "kid": "k1", "jwk": attacker.jwk(),
                            "jku": "https://evil.example/jwks", "x5u": "https://evil.example/c"})
                    .to_string(),
                    &payload,
                ),
                "TOKEN_BAD_SIGNATURE",
            ),
            (
                sign_raw(
                    &attacker,
                    &json!({"alg": "ES256", "kid": "unknown", "jwk": attacker.jwk()}).to_string(),
                    &payload,
                ),
                "TOKEN_UNKNOWN_KEY",
            ),
            (
                sign_raw(&key, r#"{"alg":"ES256","kid":"zz","kid":"k1"}"#, &payload),
                "TOKEN_MALFORMED",
            ),
            (
                sign_raw(
                    &key,
                    r#"{"alg":"ES256","alg":"RS256","kid":"k1"}"#,
                    &payload,
                ),
                "TOKEN_ALGORITHM_REFUSED",
            ),
        ];
        for (token, reason) in cases {
            let e = v.verify(&token).await.expect_err(reason);
            assert_eq!(e.reason, reason, "{}", e.message);
        }
        // The same header, honest, passes: the refusals above are the tricks'.
        v.verify(&sign_raw(&key, r#"{"alg":"ES256","kid":"k1"}"#, &payload))
            .await
            .unwrap();
    }

    /// Claim values match byte for byte: case, look-alike letters, surrounding
    /// space, an empty value, a nested array, an object keyed by the value, a
    /// number or a bool never match a rule.
    #[test]
    fn claim_values_of_another_shape_or_spelling_never_match() {
        use crate::config::Role;
        let rules = vec![
            rule("admins", "groups", "tessera-admins", Role::Admin),
            rule("nested", "a.b", "x", Role::Admin),
            rule("num", "level", "1", Role::Admin),
        ];
        for claims in [
            json!({"groups": "Tessera-Admins"}),
            json!({"groups": ["tessera-admins "]}),
            json!({"groups": ["tessera\u{2010}admins"]}),
            json!({"groups": ["tessera-admins\u{0}"]}),
            json!({"groups": [""]}),
            json!({"groups": [["tessera-admins"]]}),
            json!({"groups": {"tessera-admins": true}}),
            json!({"groups": [{"name": "tessera-admins"}]}),
            json!({"level": 1}),
            json!({"level": true}),
            json!({"a": [{"b": "x"}]}),
            json!({"a": {"b": {"x": 1}}}),
        ] {
            assert!(
                map_claims(&rules, &verified(claims.clone())).is_err(),
                "{claims} matched"
            );
        }
        assert_eq!(
            map_claims(&rules, &verified(json!({"groups": "tessera-admins"})))
                .unwrap()
                .name,
            "admins"
        );
    }
}
