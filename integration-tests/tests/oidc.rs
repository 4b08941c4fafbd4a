//! OIDC bearer tokens on tesserad's TLS listener, against an identity provider the
//! test serves itself: its own CA, its own signing keys (made here, now), a
//! discovery document and a JWKS over HTTPS on loopback. Each forged or unfit
//! token gets the refusal that names its fault and creates nothing; a tenant's
//! lease is created, listed and released with a token alone through the real CLI.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};
use tessera_integration_tests::{TestDaemon, bin_path, create_req, rt, shape};
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

const TWO_H100: &str = "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n";

/// The test's CA: signs the daemon's and the identity provider's certificates,
/// and the mTLS client's.
struct Pki {
    ca_pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Pki {
    fn new() -> Pki {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tessera oidc test CA");
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).unwrap();
        Pki {
            ca_pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// (cert pem, key pem) for `cn`, valid for localhost and 127.0.0.1.
    fn leaf(&self, cn: &str) -> (String, String) {
        self.leaf_named(Some(cn))
    }

    /// (cert pem, key pem) whose subject has a common name `cn`, or none at all.
    fn leaf_named(&self, cn: Option<&str>) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        if let Some(cn) = cn {
            p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        }
        p.subject_alt_names
            .push(rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()));
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A signing key of the identity provider.
struct SigningKey {
    kid: String,
    alg: Algorithm,
    encoding: EncodingKey,
    jwk: Value,
}

impl SigningKey {
    /// An ES256 key (P-256), made now.
    fn es256(kid: &str) -> SigningKey {
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let raw = pair.public_key_raw();
        SigningKey {
            kid: kid.into(),
            alg: Algorithm::ES256,
            encoding: EncodingKey::from_ec_der(&pair.serialize_der()),
            jwk: json!({"kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": kid,
                        "x": B64.encode(&raw[1..33]), "y": B64.encode(&raw[33..65])}),
        }
    }

    /// An RS256 key (2048 bits), made now by openssl.
    fn rs256(kid: &str, dir: &Path) -> SigningKey {
        let path = dir.join(format!("{kid}.pem"));
        let run = |args: &[&str]| {
            let out = std::process::Command::new("openssl")
                .args(args)
                .output()
                .expect("openssl");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        };
        let p = path.to_str().unwrap();
        run(&[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            p,
        ]);
        let modulus = run(&["rsa", "-in", p, "-noout", "-modulus"]);
        let hex = modulus.trim().trim_start_matches("Modulus=");
        let n: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let der_path = dir.join(format!("{kid}.der"));
        let der = der_path.to_str().unwrap();
        run(&[
            "rsa",
            "-in",
            p,
            "-traditional",
            "-outform",
            "DER",
            "-out",
            der,
        ]);
        let der = std::fs::read(&der_path).unwrap();
        SigningKey {
            kid: kid.into(),
            alg: Algorithm::RS256,
            encoding: EncodingKey::from_rsa_der(&der),
            jwk: json!({"kty": "RSA", "use": "sig", "alg": "RS256", "kid": kid,
                        "n": B64.encode(n), "e": "AQAB"}),
        }
    }

    fn sign(&self, claims: &Value) -> String {
        let mut h = Header::new(self.alg);
        h.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&h, claims, &self.encoding).unwrap()
    }
}

/// The identity provider: `/.well-known/openid-configuration` and `/jwks` over
/// HTTPS, serving whichever keys it publishes now.
struct Idp {
    issuer: String,
    published: Arc<Mutex<Vec<Value>>>,
    jwks_fetches: Arc<Mutex<usize>>,
    /// When set, the whole HTTP answer to the discovery document's path (status
    /// line, headers and body): a hostile or broken issuer.
    discovery: Arc<Mutex<Option<String>>>,
    /// Keys served at `/realms/gpu/alt-jwks` (only a hostile discovery names it).
    alt: Arc<Mutex<Vec<Value>>>,
}

impl Idp {
    async fn start(pki: &Pki) -> Idp {
        use tokio_rustls::rustls;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let issuer = format!("https://localhost:{port}/realms/gpu");
        let (cert, key) = pki.leaf("idp");
        use rustls::pki_types::pem::PemObject as _;
        let certs =
            vec![rustls::pki_types::CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()];
        let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let published = Arc::new(Mutex::new(Vec::new()));
        let jwks_fetches = Arc::new(Mutex::new(0));
        let discovery = Arc::new(Mutex::new(None::<String>));
        let alt = Arc::new(Mutex::new(Vec::new()));
        let (keys, fetches, iss) = (published.clone(), jwks_fetches.clone(), issuer.clone());
        let (disc, alt_keys) = (discovery.clone(), alt.clone());
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, keys, fetches, iss) =
                    (acceptor.clone(), keys.clone(), fetches.clone(), iss.clone());
                let (disc, alt_keys) = (disc.clone(), alt_keys.clone());
                tokio::spawn(async move {
                    let Ok(mut s) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut req = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => req.extend_from_slice(&buf[..n]),
                        }
                    }
                    let line = String::from_utf8_lossy(&req)
                        .lines()
                        .next()
                        .unwrap_or("")
                        .to_string();
                    let raw = disc.lock().unwrap().clone();
                    if let Some(raw) = raw
                        && line.starts_with("GET /realms/gpu/.well-known/openid-configuration ")
                    {
                        let _ = s.write_all(raw.as_bytes()).await;
                        let _ = s.shutdown().await;
                        return;
                    }
                    let (status, body) = if line
                        .starts_with("GET /realms/gpu/.well-known/openid-configuration ")
                    {
                        let doc = json!({"issuer": iss, "jwks_uri": format!("{iss}/jwks"),
                                         "id_token_signing_alg_values_supported": ["RS256", "ES256"]});
                        ("200 OK", doc.to_string())
                    } else if line.starts_with("GET /realms/gpu/alt-jwks ") {
                        *fetches.lock().unwrap() += 1;
                        let keys = alt_keys.lock().unwrap().clone();
                        ("200 OK", json!({ "keys": keys }).to_string())
                    } else if line.starts_with("GET /realms/gpu/jwks ") {
                        *fetches.lock().unwrap() += 1;
                        let keys = keys.lock().unwrap().clone();
                        ("200 OK", json!({ "keys": keys }).to_string())
                    } else {
                        ("404 Not Found", String::new())
                    };
                    let resp = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(resp.as_bytes()).await;
                    let _ = s.shutdown().await;
                });
            }
        });
        Idp {
            issuer,
            published,
            jwks_fetches,
            discovery,
            alt,
        }
    }

    fn publish(&self, keys: &[&SigningKey]) {
        *self.published.lock().unwrap() = keys.iter().map(|k| k.jwk.clone()).collect();
    }

    fn fetches(&self) -> usize {
        *self.jwks_fetches.lock().unwrap()
    }
}

fn now() -> i64 {
    jsonwebtoken::get_current_timestamp() as i64
}

struct Setup {
    d: TestDaemon,
    _files: tempfile::TempDir,
    idp: Idp,
    pki: Pki,
    port: u16,
    ca: PathBuf,
    key: SigningKey,
}

impl Setup {
    /// The identity provider (publishing one ES256 key), and a daemon whose TLS
    /// listener takes its tokens (and client certificates of the test CA).
    fn start(r: &tokio::runtime::Runtime) -> Setup {
        let pki = Pki::new();
        let idp = r.block_on(Idp::start(&pki));
        let key = SigningKey::es256("k1");
        idp.publish(&[&key]);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let files_dir = tempfile::Builder::new()
            .prefix("oidc-pki")
            .tempdir()
            .unwrap();
        let files = files_dir.path();
        let (cert, key_pem) = pki.leaf("tesserad");
        let ca = files.join("ca.pem");
        std::fs::write(&ca, &pki.ca_pem).unwrap();
        std::fs::write(files.join("cert.pem"), cert).unwrap();
        std::fs::write(files.join("key.pem"), key_pem).unwrap();
        let extra = format!(
            r#"
[tenants.team-a]
guaranteed = {{ mig_slices = 7 }}
[tenants.team-b]
guaranteed = {{ mig_slices = 7 }}

[[auth.principals]]
name = "team-b-cert"
role = "tenant"
tenant = "team-b"
cert_cns = ["team-b-client"]

[auth.tls]
listen = "127.0.0.1:{port}"
cert = {cert:?}
key = {key:?}
client_ca = {ca:?}

[auth.oidc]
issuer = "{issuer}"
audience = "tesserad"
ca_file = {ca:?}
jwks_min_refetch = "0s"

[[auth.oidc.rules]]
name = "gpu-admins"
claim = "groups"
values = ["tessera-admins"]
role = "admin"

[[auth.oidc.rules]]
name = "team-a"
claim = "groups"
values = ["tessera-team-a"]
role = "tenant"
tenant = "team-a"
"#,
            cert = files.join("cert.pem"),
            key = files.join("key.pem"),
            issuer = idp.issuer,
        );
        let d = TestDaemon::start_with(TWO_H100, &extra).unwrap();
        Setup {
            d,
            _files: files_dir,
            idp,
            pki,
            port,
            ca,
            key,
        }
    }

    fn claims(&self) -> Value {
        json!({"iss": self.idp.issuer, "aud": "tesserad", "sub": "f3c1-ada", "exp": now() + 600,
               "iat": now(), "email": "ada@example.com", "preferred_username": "ada",
               "groups": ["staff", "tessera-team-a"]})
    }

    /// A client of the TLS listener sending `token` (and a certificate for `cn`).
    async fn client(
        &self,
        token: &str,
        cn: Option<&str>,
    ) -> TesseraClient<
        tonic::service::interceptor::InterceptedService<
            Channel,
            impl tonic::service::Interceptor + use<>,
        >,
    > {
        self.client_with(token, cn.map(|cn| self.pki.leaf(cn)))
            .await
    }

    /// A client of the TLS listener sending `token` (and the certificate and key
    /// `identity`).
    async fn client_with(
        &self,
        token: &str,
        identity: Option<(String, String)>,
    ) -> TesseraClient<
        tonic::service::interceptor::InterceptedService<
            Channel,
            impl tonic::service::Interceptor + use<>,
        >,
    > {
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.pki.ca_pem))
            .domain_name("localhost");
        if let Some((cert, key)) = identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        let ch = Endpoint::from_shared(format!("https://127.0.0.1:{}", self.port))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(30))
            .connect()
            .await
            .unwrap();
        let value: Option<tonic::metadata::MetadataValue<_>> =
            (!token.is_empty()).then(|| format!("Bearer {token}").parse().unwrap());
        TesseraClient::with_interceptor(ch, move |mut req: tonic::Request<()>| {
            if let Some(v) = &value {
                req.metadata_mut().insert("authorization", v.clone());
            }
            Ok(req)
        })
    }

    /// Every lease the daemon has, as its admin (root on the unix socket) sees them.
    async fn all_leases(&self) -> Vec<pb::Lease> {
        let mut c = self.d.client().await.unwrap();
        c.list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .leases
    }

    fn audit(&self) -> Vec<Value> {
        std::fs::read_to_string(self.d.dir.path().join("state/audit.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

fn with(mut c: Value, k: &str, v: Value) -> Value {
    c[k] = v;
    c
}

#[test]
fn forged_and_unfit_tokens_are_refused_by_name_and_create_nothing() {
    let r = rt();
    let s = Setup::start(&r);
    let stranger = SigningKey::es256("k-unknown");
    let good = s.key.sign(&s.claims());
    let parts: Vec<&str> = good.split('.').collect();
    let payload = B64.encode(s.claims().to_string());
    let none_header = B64.encode(r#"{"alg":"none","typ":"JWT","kid":"k1"}"#);
    let hs256 = {
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("k1".into());
        let public = s.key.jwk.to_string();
        jsonwebtoken::encode(
            &h,
            &s.claims(),
            &EncodingKey::from_secret(public.as_bytes()),
        )
        .unwrap()
    };
    let tampered = format!(
        "{}.{}.{}",
        parts[0],
        B64.encode(with(s.claims(), "groups", json!(["tessera-admins"])).to_string()),
        parts[2]
    );
    let cases: Vec<(&str, String, Code, &str, &str)> = vec![
        (
            "expired",
            s.key.sign(&with(s.claims(), "exp", json!(now() - 3600))),
            Code::Unauthenticated,
            "expired",
            "TOKEN_EXPIRED",
        ),
        (
            "wrong audience",
            s.key.sign(&with(s.claims(), "aud", json!("grafana"))),
            Code::Unauthenticated,
            "wrong audience",
            "TOKEN_WRONG_AUDIENCE",
        ),
        (
            "wrong issuer",
            s.key.sign(&with(
                s.claims(),
                "iss",
                json!("https://evil.example/realms/gpu"),
            )),
            Code::Unauthenticated,
            "wrong issuer",
            "TOKEN_WRONG_ISSUER",
        ),
        (
            "unknown key",
            stranger.sign(&s.claims()),
            Code::Unauthenticated,
            "does not publish",
            "TOKEN_UNKNOWN_KEY",
        ),
        (
            "alg none",
            format!("{none_header}.{payload}."),
            Code::Unauthenticated,
            "\"none\" is not accepted",
            "TOKEN_ALGORITHM_REFUSED",
        ),
        (
            "HS256 with the public key",
            hs256,
            Code::Unauthenticated,
            "\"HS256\" is not accepted",
            "TOKEN_ALGORITHM_REFUSED",
        ),
        (
            "tampered payload",
            tampered,
            Code::Unauthenticated,
            "bad signature",
            "TOKEN_BAD_SIGNATURE",
        ),
        (
            "no mapped group",
            s.key.sign(&with(s.claims(), "groups", json!(["staff"]))),
            Code::PermissionDenied,
            "`groups`",
            "PERMISSION_DENIED",
        ),
        (
            "not a JWT",
            "YWRhOnB3".into(),
            Code::Unauthenticated,
            "not a JWT",
            "TOKEN_MALFORMED",
        ),
    ];
    r.block_on(async {
        for (what, token, code, says, reason) in &cases {
            let mut c = s.client(token, None).await;
            let e = c
                .create_lease(create_req("team-a", shape::mig("1g.10gb")))
                .await
                .expect_err(what);
            assert_eq!(e.code(), *code, "{what}: {}", e.message());
            assert!(e.message().contains(says), "{what}: {}", e.message());
            // Programs read the ErrorInfo reason, not the text.
            use tonic_types::StatusExt as _;
            let info = e.get_details_error_info().expect("an ErrorInfo");
            assert_eq!(info.reason, *reason, "{what}");
            assert!(
                !e.message().contains(token.as_str()),
                "{what}: the token is echoed"
            );
        }
        // A certificate and a token together are two identities: refused, even
        // when each alone would pass.
        let mut both = s.client(&good, Some("team-b-client")).await;
        let e = both
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{}", e.message());
        assert!(e.message().contains("two identities"), "{}", e.message());
        // The tenant a token maps to is the only one it acts for.
        let mut a = s.client(&good, None).await;
        let e = a
            .create_lease(create_req("team-b", shape::mig("1g.10gb")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{}", e.message());
        assert!(
            s.all_leases().await.is_empty(),
            "a refused caller created something: {:?}",
            s.all_leases().await
        );

        // The good token works; mTLS alone still works.
        let l = a
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(l.tenant, "team-a");
        let mut b = s.client("", Some("team-b-client")).await;
        let lb = b
            .create_lease(create_req("", shape::mig("1g.10gb")))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(lb.tenant, "team-b");
        // A tenant's token sees its own tenant's leases only; an admin's all.
        let mine = a
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .leases;
        assert_eq!(
            mine.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(),
            vec![l.id.as_str()]
        );
        let admin = s
            .key
            .sign(&with(s.claims(), "groups", json!(["tessera-admins"])));
        let mut ops = s.client(&admin, None).await;
        let all = ops
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .leases;
        assert_eq!(all.len(), 2);

        // The issuer rotates to an RS256 key: the daemon fetches its keys again
        // for the unknown kid and accepts; the retired key's tokens stop passing.
        let dir = tempfile::tempdir().unwrap();
        let rotated = SigningKey::rs256("k2", dir.path());
        s.idp.publish(&[&rotated]);
        let before = s.idp.fetches();
        let mut a2 = s.client(&rotated.sign(&s.claims()), None).await;
        a2.get_lease(pb::GetLeaseRequest {
            lease_id: l.id.clone(),
        })
        .await
        .unwrap();
        assert!(s.idp.fetches() > before, "the keys were not fetched again");
        let e = a
            .get_lease(pb::GetLeaseRequest {
                lease_id: l.id.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{}", e.message());
        assert!(e.message().contains("does not publish"), "{}", e.message());
    });

    // The audit log names the person behind each token call, and never a token.
    let recs = s.audit();
    let create = recs
        .iter()
        .find(|r| r["action"] == "CreateLease" && r["result"] == "ok" && r["tenant"] == "team-a")
        .expect("an audit record of the token's CreateLease");
    assert_eq!(create["principal"], "team-a");
    assert_eq!(create["oidc"]["issuer"], s.idp.issuer.as_str());
    assert_eq!(create["oidc"]["subject"], "f3c1-ada");
    assert_eq!(create["oidc"]["email"], "ada@example.com");
    assert_eq!(create["oidc"]["preferred_username"], "ada");
    let unmapped = recs
        .iter()
        .find(|r| {
            r["result"] == "PermissionDenied" && r["reasons"].to_string().contains("`groups`")
        })
        .expect("an audit record of the unmapped token");
    assert_eq!(unmapped["oidc"]["subject"], "f3c1-ada");
    let cert = recs
        .iter()
        .find(|r| r["action"] == "CreateLease" && r["result"] == "ok" && r["tenant"] == "team-b")
        .unwrap();
    assert!(cert.get("oidc").is_none(), "{cert}");
    let text = std::fs::read_to_string(s.d.dir.path().join("state/audit.jsonl")).unwrap();
    assert!(
        !text.contains(parts[2]),
        "a token signature is in the audit log"
    );
}

/// `tessera` with a token alone: a tenant's lease created, listed and released;
/// an expired or wrong-audience token is one line saying so.
#[test]
fn a_tenant_creates_lists_and_releases_a_lease_with_a_token_alone_through_the_cli() {
    let r = rt();
    let s = Setup::start(&r);
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, format!("{}\n", s.key.sign(&s.claims()))).unwrap();
    let addr = format!("https://127.0.0.1:{}", s.port);
    let tessera = |token: &Path, args: &[&str]| {
        let out = std::process::Command::new(bin_path("tessera").unwrap())
            .args(["--addr", &addr, "--ca-file", s.ca.to_str().unwrap()])
            .env("TESSERA_TOKEN_FILE", token)
            // Nothing reaches the unix socket: the address decides.
            .env("TESSERA_SOCKET", "/nonexistent/tesserad.sock")
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // No --tenant: the token's tenant is the lease's.
    let (code, out, err) = tessera(&token, &["--json", "lease", "create", "--mig", "1g.10gb"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let created: Value = serde_json::from_str(&out).unwrap();
    let id = created["id"]
        .as_str()
        .or_else(|| created["lease"]["id"].as_str())
        .unwrap()
        .to_string();
    let (code, out, err) = tessera(&token, &["lease", "list"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(&id), "{out}");
    let made = r.block_on(s.all_leases());
    assert!(
        made.iter().any(|l| l.id == id && l.tenant == "team-a"),
        "{made:?}"
    );
    // --token-file wins over the environment's.
    let (code, out, err) = tessera(
        Path::new("/nonexistent/token"),
        &[
            "--token-file",
            token.to_str().unwrap(),
            "lease",
            "release",
            &id,
        ],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    let leases = r.block_on(s.all_leases());
    assert!(
        leases
            .iter()
            .all(|l| l.id != id || l.state != pb::LeaseState::Active as i32),
        "{leases:?}"
    );

    for (claims, says) in [
        (with(s.claims(), "exp", json!(now() - 3600)), "expired"),
        (with(s.claims(), "aud", json!("grafana")), "wrong audience"),
    ] {
        let bad = dir.path().join("bad");
        std::fs::write(&bad, s.key.sign(&claims)).unwrap();
        let (code, out, err) = tessera(&bad, &["lease", "list"]);
        assert_eq!(code, Some(1), "{out}{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            err.contains("Unauthenticated") && err.contains(says),
            "{err}"
        );
    }
    // The rules reload: once team-a's group is renamed in the config, the same
    // token maps to nothing.
    let text = std::fs::read_to_string(&s.d.config).unwrap();
    std::fs::write(
        &s.d.config,
        text.replace("values = [\"tessera-team-a\"]", "values = [\"gpu-team-a\"]"),
    )
    .unwrap();
    let (ok, out) = s.d.cli(&["reload"]);
    assert!(ok && out.contains("2 OIDC rules"), "{out}");
    let (code, out, err) = tessera(&token, &["lease", "list"]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        err.contains("PermissionDenied") && err.contains("`groups`"),
        "{err}"
    );
    // A token is for the TLS listener only: with the socket, a usage error.
    let out = std::process::Command::new(bin_path("tessera").unwrap())
        .args([
            "--socket",
            s.d.socket.to_str().unwrap(),
            "--token-file",
            token.to_str().unwrap(),
            "gpus",
        ])
        .env_remove("TESSERA_ADDR")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Python grpcio with access-token call credentials: the same token works there.
#[test]
fn python_grpcio_signs_in_with_access_token_credentials() {
    use tessera_integration_tests::python::{generate_stubs, pytest, python_or_skip, say};
    let Some(py) = python_or_skip().unwrap() else {
        return;
    };
    let gen_dir = tempfile::tempdir().unwrap();
    generate_stubs(&py, gen_dir.path(), &["tessera/v1/tessera.proto"]).unwrap();
    let r = rt();
    let s = Setup::start(&r);
    let token = s.key.sign(&s.claims());
    let expired = s.key.sign(&with(s.claims(), "exp", json!(now() - 3600)));
    let target = format!("localhost:{}", s.port);
    let run = pytest(
        &py,
        "integration-tests/python/test_oidc_grpcio.py",
        gen_dir.path(),
        &[
            ("TESSERA_TLS_TARGET", target.as_ref()),
            ("TESSERA_CA_FILE", s.ca.as_os_str()),
            ("TESSERA_TOKEN", token.as_ref()),
            ("TESSERA_EXPIRED", expired.as_ref()),
        ],
        Duration::from_secs(120),
    )
    .unwrap();
    let output = &run.output;
    let Some(status) = run.status else {
        panic!(
            "pytest ran past 120 s:\n{output}\n--- tesserad log:\n{}",
            s.d.log()
        );
    };
    assert!(
        status.success(),
        "the grpcio client failed ({status}):\n{output}\n--- tesserad log:\n{}",
        s.d.log()
    );
    say(&format!(
        "python grpcio OIDC client ({}): {}",
        py.display(),
        run.summary()
    ));
    assert!(output.contains("2 passed"), "{output}");
}

/// A client certificate is an identity even without a common name: with a token
/// on the same call, two identities, refused, and nothing created.
#[test]
fn a_certificate_without_a_common_name_and_a_token_are_two_identities() {
    let r = rt();
    let s = Setup::start(&r);
    let good = s.key.sign(&s.claims());
    r.block_on(async {
        let mut both = s.client_with(&good, Some(s.pki.leaf_named(None))).await;
        let e = both
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .expect_err("a certificate and a token are two identities");
        assert_eq!(e.code(), Code::PermissionDenied, "{}", e.message());
        assert!(e.message().contains("two identities"), "{}", e.message());
        assert!(
            s.all_leases().await.is_empty(),
            "a refused caller created a lease"
        );
        // The certificate alone maps to no principal.
        let mut cert = s.client_with("", Some(s.pki.leaf_named(None))).await;
        let e = cert
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{}", e.message());
        assert!(
            s.all_leases().await.is_empty(),
            "a refused caller created a lease"
        );
    });
}

/// A JWKS document without one usable key (empty, or only keys this daemon
/// refuses) is a failed fetch: the keys there were stay. An unknown kid cannot
/// make the daemon drop the issuer's keys at such a moment.
#[test]
fn a_fetched_jwks_without_a_usable_key_keeps_the_keys_there_were() {
    let r = rt();
    let s = Setup::start(&r);
    let good = s.key.sign(&s.claims());
    let stranger = SigningKey::es256("k-unknown");
    r.block_on(async {
        let mut a = s.client(&good, None).await;
        a.list_leases(pb::ListLeasesRequest::default())
            .await
            .expect("the issuer's key verifies");
        for published in [
            json!([]),
            json!([{"kty": "oct", "kid": "k1", "k": B64.encode("shared-secret")}]),
        ] {
            *s.idp.published.lock().unwrap() = published.as_array().unwrap().clone();
            let before = s.idp.fetches();
            // An unknown kid makes the daemon fetch the keys again (min_refetch 0s).
            let mut x = s.client(&stranger.sign(&s.claims()), None).await;
            let e = x
                .list_leases(pb::ListLeasesRequest::default())
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::Unauthenticated, "{}", e.message());
            assert!(s.idp.fetches() > before, "the keys were not fetched again");
            a.list_leases(pb::ListLeasesRequest::default())
                .await
                .unwrap_or_else(|e| panic!("after {published}: the good key was dropped: {e:?}"));
        }
    });
}

/// The issuer's keys come only from its own discovery document, over HTTPS, in
/// one answer: a discovery document naming another issuer, a redirect, a
/// `jwks_uri` over http://, or a JWKS over 1 MiB never brings in a key (an
/// attacker's key is published there each time and its token refused), and the
/// keys there were stay.
#[test]
fn a_hostile_discovery_or_jwks_never_brings_in_a_key() {
    let r = rt();
    let s = Setup::start(&r);
    let good = s.key.sign(&s.claims());
    let evil = SigningKey::es256("k-evil");
    *s.idp.alt.lock().unwrap() = vec![evil.jwk.clone()];
    let alt = format!("{}/alt-jwks", s.idp.issuer);
    let answer = |status: &str, headers: &str, body: &str| {
        format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{headers}connection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let doc =
        |issuer: &str, jwks_uri: &str| json!({"issuer": issuer, "jwks_uri": jwks_uri}).to_string();
    let huge = {
        let mut keys = vec![evil.jwk.clone()];
        keys.extend((0..2000).map(|i| json!({"kty": "EC", "use": "enc", "kid": format!("pad-{i}"), "pad": "x".repeat(600)})));
        json!({ "keys": keys }).to_string()
    };
    assert!(huge.len() > 1 << 20);
    let cases = [
        (
            "another issuer",
            answer("200 OK", "", &doc("https://evil.example/realms/gpu", &alt)),
        ),
        (
            "issuer with a trailing slash",
            answer("200 OK", "", &doc(&format!("{}/", s.idp.issuer), &alt)),
        ),
        (
            "a redirect",
            answer("302 Found", &format!("location: {alt}\r\n"), ""),
        ),
        (
            "an http:// jwks_uri",
            answer(
                "200 OK",
                "",
                &doc(&s.idp.issuer, &alt.replace("https://", "http://")),
            ),
        ),
        ("not JSON", answer("200 OK", "", "<html>")),
    ];
    r.block_on(async {
        let mut a = s.client(&good, None).await;
        a.list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap();
        let mut e = s.client(&evil.sign(&s.claims()), None).await;
        for (what, raw) in &cases {
            *s.idp.discovery.lock().unwrap() = Some(raw.clone());
            let st = e
                .list_leases(pb::ListLeasesRequest::default())
                .await
                .expect_err(what);
            assert_eq!(st.code(), Code::Unauthenticated, "{what}: {}", st.message());
            assert!(
                st.message().contains("does not publish"),
                "{what}: {}",
                st.message()
            );
            a.list_leases(pb::ListLeasesRequest::default())
                .await
                .unwrap_or_else(|st| panic!("{what}: the good key was dropped: {st:?}"));
        }
        // An honest discovery document naming a JWKS over 1 MiB.
        *s.idp.discovery.lock().unwrap() = None;
        s.idp.alt.lock().unwrap().clear();
        *s.idp.published.lock().unwrap() = serde_json::from_str::<Value>(&huge).unwrap()["keys"]
            .as_array()
            .unwrap()
            .clone();
        let before = s.idp.fetches();
        let st = e
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .expect_err("a JWKS over 1 MiB");
        assert!(s.idp.fetches() > before, "the JWKS was not fetched");
        assert_eq!(st.code(), Code::Unauthenticated, "{}", st.message());
        a.list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap_or_else(|st| panic!("over 1 MiB: the good key was dropped: {st:?}"));
        // The control: the issuer's own discovery document naming that JWKS does
        // bring its key in (so each refusal above is the hostile answer's).
        *s.idp.alt.lock().unwrap() = vec![evil.jwk.clone()];
        *s.idp.discovery.lock().unwrap() = Some(answer("200 OK", "", &doc(&s.idp.issuer, &alt)));
        e.list_leases(pb::ListLeasesRequest::default())
            .await
            .expect("the issuer's own discovery document names its keys");
    });
    assert!(r.block_on(s.all_leases()).is_empty());
}

/// What an outsider with no credentials can make the daemon write: one short
/// audit record per refused call, whatever it puts in the token's header (a kid
/// of 9,000 characters included); and a token sent to the unix socket is refused
/// even when the socket's peer is root (a token never adds to a local uid).
#[test]
fn an_outsiders_refusal_is_a_short_audit_record_and_a_token_on_the_socket_is_refused() {
    let r = rt();
    let s = Setup::start(&r);
    let payload = B64.encode(s.claims().to_string());
    let long_kid = format!(
        "{}.{payload}.{}",
        B64.encode(json!({"alg": "ES256", "kid": "K".repeat(9000)}).to_string()),
        B64.encode([1u8; 64])
    );
    let good = s.key.sign(&s.claims());
    r.block_on(async {
        let mut x = s.client(&long_kid, None).await;
        let st = x
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap_err();
        assert_eq!(st.code(), Code::Unauthenticated, "{}", st.message());
        assert!(st.message().len() < 300, "{}", st.message());

        let mut unix = s.d.client().await.unwrap();
        let mut req = tonic::Request::new(pb::ListLeasesRequest::default());
        req.metadata_mut()
            .insert("authorization", format!("Bearer {good}").parse().unwrap());
        let st = unix.list_leases(req).await.unwrap_err();
        assert_eq!(st.code(), Code::Unauthenticated, "{}", st.message());
        assert!(
            st.message().contains("only on the TLS listener"),
            "{}",
            st.message()
        );
        let mut req = tonic::Request::new(create_req("team-a", shape::mig("1g.10gb")));
        req.metadata_mut()
            .insert("authorization", format!("Bearer {good}").parse().unwrap());
        unix.create_lease(req).await.unwrap_err();
        assert!(
            s.all_leases().await.is_empty(),
            "a refused caller created a lease"
        );
    });
    let text = std::fs::read_to_string(s.d.dir.path().join("state/audit.jsonl")).unwrap();
    let refused: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Unauthenticated"))
        .collect();
    assert_eq!(refused.len(), 3, "{text}");
    for l in refused {
        assert!(l.len() < 1024, "{} bytes: {l}", l.len());
        assert!(!l.contains(&good), "a token is in the audit log");
    }
    let sig = good.rsplit('.').next().unwrap();
    assert!(!s.d.log().contains(sig), "a token is in the daemon's log");
}

/// A watch opened with a token lasts only while the token maps to the principal it
/// began as: once `tessera reload` takes the token's group out of the rules, new
/// calls are refused and the open WatchLeases stream ends (PERMISSION_DENIED)
/// before it delivers another event of the tenant.
#[test]
fn a_watch_opened_with_a_token_ends_when_a_reload_unmaps_the_token() {
    let r = rt();
    let s = Setup::start(&r);
    let good = s.key.sign(&s.claims());
    r.block_on(async {
        let mut a = s.client(&good, None).await;
        let mut stream = a
            .watch_leases(pb::WatchLeasesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let text = std::fs::read_to_string(&s.d.config).unwrap();
        std::fs::write(
            &s.d.config,
            text.replace("values = [\"tessera-team-a\"]", "values = [\"gpu-team-a\"]"),
        )
        .unwrap();
        let (ok, out) = s.d.cli(&["reload"]);
        assert!(ok, "{out}");
        // New calls with the token are refused now.
        let st = a
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap_err();
        assert_eq!(st.code(), Code::PermissionDenied, "{}", st.message());
        // team-a gets a lease (made by root on the socket).
        let mut root = s.d.client().await.unwrap();
        let id = root
            .create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap()
            .id;
        loop {
            let next = tokio::time::timeout(Duration::from_secs(60), stream.message())
                .await
                .expect("the watch neither ended nor delivered the new lease");
            match next {
                Ok(Some(ev)) if ev.lease.as_ref().is_some_and(|l| l.id == id) => {
                    panic!("the unmapped token's watch delivered team-a's lease {id}")
                }
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the watch ended without saying why"),
                Err(st) => {
                    assert_eq!(st.code(), Code::PermissionDenied, "{}", st.message());
                    assert!(st.message().contains("the watch ends"), "{}", st.message());
                    break;
                }
            }
        }
    });
}

/// A watch opened with a token ends when the token expires, telling the caller to
/// sign in again and from which revision to go on.
#[test]
fn a_watch_opened_with_a_token_ends_when_the_token_expires() {
    let r = rt();
    let s = Setup::start(&r);
    let short = s.key.sign(&with(s.claims(), "exp", json!(now() + 3)));
    r.block_on(async {
        let mut a = s.client(&short, None).await;
        let mut stream = a
            .watch_leases(pb::WatchLeasesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let end = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                match stream.message().await {
                    Ok(Some(_)) => continue,
                    other => return other,
                }
            }
        })
        .await
        .expect("the watch went on past its token's exp");
        let st = end.unwrap_err();
        assert_eq!(st.code(), Code::Unauthenticated, "{}", st.message());
        assert!(st.message().contains("expired"), "{}", st.message());
        assert!(st.message().contains("from revision"), "{}", st.message());
    });
}
