//! Security for test clusters: a CA and certificates made with the real
//! `courier cert`, a static token file, and a small OAuth 2 provider of the tests'
//! own (a token endpoint for client credentials and a JWKS endpoint) that signs
//! ES256 JWTs with a key generated here.

use super::courier_bin;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The JWT issuer of the test provider.
pub const ISSUER: &str = "https://idp.courier.test/";
/// The audience gateways of secure test clusters ask for.
pub const AUDIENCE: &str = "courier-gateway";
/// The claim that lists a caller's tenants.
pub const TENANTS_CLAIM: &str = "courier_tenants";
/// The static token of the harness's own client (`<default>` tenant).
pub const ADMIN_TOKEN: &str = "admin-token-0123456789";

/// What a secure test cluster is given: files on disk and the OAuth provider.
#[derive(Debug)]
pub struct Secure {
    _files: tempfile::TempDir,
    pub dir: PathBuf,
    pub oauth: OAuthProvider,
    /// Static tokens: name -> (token, tenants).
    pub tokens: BTreeMap<String, (String, Vec<String>)>,
}

impl Secure {
    /// Makes a CA, a certificate for every broker, the gateway and the test client,
    /// a token file with `tokens` (and the harness's admin token), and starts the
    /// OAuth provider with `clients` (client id -> (secret, tenants)).
    pub async fn new(
        tokens: &[(&str, &str, &[&str])],
        clients: &[(&str, &str, &[&str])],
    ) -> Arc<Secure> {
        let files = tempfile::tempdir().expect("temp dir");
        let dir = files.path().to_path_buf();
        run_courier(&["cert", "ca", "--out", &dir.display().to_string()]);
        for name in ["broker", "gateway", "client"] {
            run_courier(&[
                "cert",
                "issue",
                name,
                "--ca",
                &dir.display().to_string(),
                "--out",
                &dir.display().to_string(),
            ]);
        }
        let mut all: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
        all.insert(
            "admin".into(),
            (ADMIN_TOKEN.into(), vec!["<default>".into()]),
        );
        for (name, token, tenants) in tokens {
            all.insert(
                name.to_string(),
                (
                    token.to_string(),
                    tenants.iter().map(|t| t.to_string()).collect(),
                ),
            );
        }
        let file = serde_json::json!({
            "tokens": all.iter().map(|(name, (token, tenants))| serde_json::json!({
                "name": name, "token": token, "tenants": tenants,
            })).collect::<Vec<_>>()
        });
        std::fs::write(dir.join("tokens.json"), file.to_string()).expect("token file");
        let oauth = OAuthProvider::start(clients).await;
        Arc::new(Secure {
            _files: files,
            dir,
            oauth,
            tokens: all,
        })
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    /// `--cluster-*` flags with the certificate `name` ("broker", "gateway", "client").
    pub fn cluster_args(&self, name: &str) -> Vec<String> {
        vec![
            "--cluster-ca".into(),
            self.path("ca.pem"),
            "--cluster-cert".into(),
            self.path(&format!("{name}.pem")),
            "--cluster-key".into(),
            self.path(&format!("{name}-key.pem")),
        ]
    }

    /// The gateway's client-port TLS and authentication flags.
    pub fn gateway_args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.path("gateway.pem"),
            "--tls-key".into(),
            self.path("gateway-key.pem"),
            "--auth-tokens".into(),
            self.path("tokens.json"),
            "--oauth-jwks".into(),
            self.oauth.jwks_url(),
            "--oauth-issuer".into(),
            ISSUER.into(),
            "--oauth-audience".into(),
            AUDIENCE.into(),
            "--oauth-tenants-claim".into(),
            TENANTS_CLAIM.into(),
        ]
    }

    /// The tonic TLS settings of a peer holding the test client's certificate.
    pub fn peer_tls(&self) -> tonic::transport::ClientTlsConfig {
        let read = |f: &str| std::fs::read(self.dir.join(f)).expect("certificate file");
        tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(read("ca.pem")))
            .identity(tonic::transport::Identity::from_pem(
                read("client.pem"),
                read("client-key.pem"),
            ))
    }

    /// Client settings with the static token of `name`.
    pub fn with_token(&self, name: &str) -> courier_client::Security {
        courier_client::Security {
            tls_ca: Some(self.ca()),
            credentials: courier_client::Credentials::Token(self.tokens[name].0.clone()),
        }
    }
}

impl Secure {
    /// The environment a Zeebe client (zbctl, the Node.js SDK, pyzeebe) is given
    /// for TLS against this CA and OAuth client credentials `id`/`secret`, with the
    /// variable names those clients read; `home` keeps token caches apart.
    pub fn zeebe_env(
        &self,
        id: &str,
        secret: &str,
        home: &std::path::Path,
    ) -> Vec<(&'static str, String)> {
        vec![
            ("ZEEBE_CA_CERTIFICATE_PATH", self.path("ca.pem")),
            ("ZEEBE_CLIENT_ID", id.to_string()),
            ("ZEEBE_CLIENT_SECRET", secret.to_string()),
            ("ZEEBE_AUTHORIZATION_SERVER_URL", self.oauth.token_url()),
            ("ZEEBE_TOKEN_AUDIENCE", AUDIENCE.to_string()),
            // The provider is plain HTTP on loopback; oauthlib (pyzeebe) wants leave.
            ("OAUTHLIB_INSECURE_TRANSPORT", "1".to_string()),
            ("HOME", home.display().to_string()),
        ]
    }
}

/// Runs `courier ARGS` to its end; panics with its output if it fails.
pub fn run_courier(args: &[&str]) -> String {
    let out = Command::new(courier_bin())
        .args(args)
        .output()
        .expect("courier runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "courier {args:?} failed: {text}");
    text
}

/// The tests' OAuth 2 provider on loopback: `POST /token` (client credentials, in
/// the form body or as HTTP Basic) answers an ES256 JWT for the audience asked for,
/// with the client's tenants; `GET /jwks` publishes the key.
pub struct OAuthProvider {
    pub addr: std::net::SocketAddr,
    key: Arc<jsonwebtoken::EncodingKey>,
    /// Token requests answered with a token.
    pub issued: Arc<AtomicU64>,
    stop: tokio_util::sync::CancellationToken,
}

impl std::fmt::Debug for OAuthProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuthProvider")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Drop for OAuthProvider {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn b64url(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

struct ProviderState {
    key: Arc<jsonwebtoken::EncodingKey>,
    jwks: String,
    clients: BTreeMap<String, (String, Vec<String>)>,
    issued: Arc<AtomicU64>,
}

impl OAuthProvider {
    pub async fn start(clients: &[(&str, &str, &[&str])]) -> OAuthProvider {
        use axum::routing::{get, post};
        let pair = rcgen::KeyPair::generate().expect("key");
        let raw = pair.public_key_raw();
        assert_eq!(raw.len(), 65, "an uncompressed P-256 point");
        let jwks = serde_json::json!({"keys": [{
            "kty": "EC", "crv": "P-256", "kid": "test-1", "use": "sig", "alg": "ES256",
            "x": b64url(&raw[1..33]), "y": b64url(&raw[33..65]),
        }]})
        .to_string();
        let key = Arc::new(
            jsonwebtoken::EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).expect("key"),
        );
        let issued = Arc::new(AtomicU64::new(0));
        let state = Arc::new(ProviderState {
            key: key.clone(),
            jwks,
            clients: clients
                .iter()
                .map(|(id, secret, tenants)| {
                    (
                        id.to_string(),
                        (
                            secret.to_string(),
                            tenants.iter().map(|t| t.to_string()).collect(),
                        ),
                    )
                })
                .collect(),
            issued: issued.clone(),
        });
        let app = axum::Router::new()
            .route("/jwks", get(jwks_handler))
            .route("/token", post(token_handler))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stop = tokio_util::sync::CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(s.cancelled_owned())
                .await;
        });
        OAuthProvider {
            addr,
            key,
            issued,
            stop,
        }
    }

    pub fn jwks_url(&self) -> String {
        format!("http://{}/jwks", self.addr)
    }

    pub fn token_url(&self) -> String {
        format!("http://{}/token", self.addr)
    }

    /// A token signed by the provider, with `claims` over the usual ones.
    pub fn sign(&self, claims: serde_json::Value) -> String {
        sign(&self.key, claims)
    }
}

fn now() -> i64 {
    courier_proto::domain::epoch_ms() / 1000
}

fn sign(key: &jsonwebtoken::EncodingKey, extra: serde_json::Value) -> String {
    let mut claims = serde_json::json!({
        "iss": ISSUER, "aud": AUDIENCE, "sub": "test", "iat": now(), "exp": now() + 300,
    });
    if let (Some(c), Some(e)) = (claims.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            c.insert(k.clone(), v.clone());
        }
    }
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
    header.kid = Some("test-1".into());
    jsonwebtoken::encode(&header, &claims, key).expect("sign")
}

async fn jwks_handler(
    axum::extract::State(s): axum::extract::State<Arc<ProviderState>>,
) -> impl axum::response::IntoResponse {
    ([("content-type", "application/json")], s.jwks.clone())
}

async fn token_handler(
    axum::extract::State(s): axum::extract::State<Arc<ProviderState>>,
    headers: axum::http::HeaderMap,
    body: String,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let form: BTreeMap<String, String> = url_form(&body);
    let (mut id, mut secret) = (
        form.get("client_id").cloned(),
        form.get("client_secret").cloned(),
    );
    if let Some(basic) = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
    {
        use base64::Engine;
        if let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(basic) {
            if let Some((i, p)) = String::from_utf8_lossy(&decoded).split_once(':') {
                id = Some(percent_decode(i));
                secret = Some(percent_decode(p));
            }
        }
    }
    let known = id
        .as_ref()
        .and_then(|i| s.clients.get(i).map(|c| (i.clone(), c.clone())));
    let Some((id, (expected, tenants))) = known else {
        return (
            axum::http::StatusCode::UNAUTHORIZED,
            r#"{"error":"invalid_client"}"#,
        )
            .into_response();
    };
    if secret.as_deref() != Some(expected.as_str())
        || form.get("grant_type").map(String::as_str) != Some("client_credentials")
    {
        return (
            axum::http::StatusCode::UNAUTHORIZED,
            r#"{"error":"invalid_client"}"#,
        )
            .into_response();
    }
    let audience = form
        .get("audience")
        .cloned()
        .unwrap_or_else(|| AUDIENCE.to_string());
    let token = sign(
        &s.key,
        serde_json::json!({"sub": id, "aud": audience, TENANTS_CLAIM: tenants}),
    );
    s.issued.fetch_add(1, Ordering::SeqCst);
    let answer =
        serde_json::json!({"access_token": token, "token_type": "Bearer", "expires_in": 300});
    ([("content-type", "application/json")], answer.to_string()).into_response()
}

fn url_form(body: &str) -> BTreeMap<String, String> {
    body.split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (percent_decode(k), percent_decode(v)))
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
