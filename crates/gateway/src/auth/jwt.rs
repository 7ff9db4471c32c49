//! OAuth 2 / OIDC bearer JWTs, as Zeebe's clients send them: the signature is
//! checked against the identity provider's keys (a JWKS file or URL, refreshed),
//! then `exp` and `nbf` (with [`LEEWAY_SECS`] of leeway), the issuer and the
//! audience. The caller's tenants come from a claim, when one is named.

use super::{AuthConfigError, Caller};
use courier_proto::sync::{lock, read_lock, write_lock};
use courier_proto::tls::{stamp, Stamp};
use courier_proto::validate;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::RwLock;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Clock skew allowed on `exp` and `nbf`.
pub const LEEWAY_SECS: u64 = 30;
/// How often keys are fetched again from a JWKS URL.
pub const KEYS_REFRESH: Duration = Duration::from_secs(300);
/// How soon after a fetch a token signed by an unknown key may cause another (a
/// provider rotating its keys), and how soon a failed fetch is tried again.
pub const KEYS_RETRY: Duration = Duration::from_secs(10);
/// How often a JWKS file is looked at for a change.
const FILE_CHECK: Duration = Duration::from_secs(2);

/// Why a JWT was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JwtError {
    #[error("cannot be read: {0}")]
    Unreadable(String),
    #[error("algorithm {0} is not accepted (RS256/384/512, PS256/384/512, ES256/384, EdDSA are)")]
    Algorithm(String),
    #[error("signed by an unknown key (kid {0:?})")]
    UnknownKey(Option<String>),
    #[error("bad signature")]
    Signature,
    #[error("expired")]
    Expired,
    #[error("not valid yet (nbf)")]
    NotYetValid,
    #[error("wrong issuer")]
    Issuer,
    #[error("wrong audience")]
    Audience,
    #[error("no '{0}' claim")]
    MissingClaim(String),
    #[error("tenants claim '{0}' is not a list of tenant ids")]
    Tenants(String),
    #[error("the gateway has no signing keys from the identity provider yet")]
    NoKeys,
}

impl JwtError {
    /// The label of `courier_gateway_auth_refused_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            JwtError::Unreadable(_) => "jwt_unreadable",
            JwtError::Algorithm(_) => "jwt_algorithm",
            JwtError::UnknownKey(_) => "jwt_unknown_key",
            JwtError::Signature => "jwt_signature",
            JwtError::Expired => "jwt_expired",
            JwtError::NotYetValid => "jwt_not_yet_valid",
            JwtError::Issuer => "jwt_issuer",
            JwtError::Audience => "jwt_audience",
            JwtError::MissingClaim(_) => "jwt_missing_claim",
            JwtError::Tenants(_) => "jwt_tenants",
            JwtError::NoKeys => "jwt_no_keys",
        }
    }

    /// Every label, so each is on `/metrics` from the start.
    pub const REASONS: [&'static str; 11] = [
        "jwt_unreadable",
        "jwt_algorithm",
        "jwt_unknown_key",
        "jwt_signature",
        "jwt_expired",
        "jwt_not_yet_valid",
        "jwt_issuer",
        "jwt_audience",
        "jwt_missing_claim",
        "jwt_tenants",
        "jwt_no_keys",
    ];
}

/// Where the identity provider's public keys are.
#[derive(Clone, Debug)]
pub enum KeySource {
    File(PathBuf),
    Url(String),
}

impl KeySource {
    /// `--oauth-jwks`: an http(s) URL or a file path.
    pub fn parse(s: &str) -> KeySource {
        if s.starts_with("http://") || s.starts_with("https://") {
            KeySource::Url(s.to_string())
        } else {
            KeySource::File(PathBuf::from(s))
        }
    }
}

/// What a JWT must say to be accepted.
#[derive(Clone, Debug)]
pub struct JwtSettings {
    pub keys: KeySource,
    pub issuer: String,
    pub audience: String,
    /// The claim listing the caller's tenants; without one, or when a token lacks
    /// it, the caller has `<default>` only.
    pub tenants_claim: Option<String>,
}

struct Key {
    kid: Option<String>,
    key: DecodingKey,
    algorithms: Vec<Algorithm>,
}

struct Keys {
    keys: Vec<Key>,
    loaded: Stamp,
}

/// Checks JWTs against the provider's keys, which [`JwtVerifier::run`] keeps fresh.
pub struct JwtVerifier {
    settings: JwtSettings,
    keys: RwLock<Keys>,
    /// Asked when a token names a key not known here.
    refresh_wanted: Notify,
    /// The least time between two fetches of a JWKS URL ([`KEYS_RETRY`]).
    min_refetch: Duration,
    /// Tokens that passed, by their SHA-256, with their caller and `exp`: a client
    /// sends the same token on every call until it expires, and a signature check
    /// costs far more than a hash. Emptied when the keys change.
    verified: std::sync::Mutex<HashMap<[u8; 32], (Caller, i64)>>,
}

/// Most tokens remembered as verified; past that the memory starts anew.
const MAX_VERIFIED: usize = 10_000;

/// The algorithms a JWK's key can verify.
fn algorithms_of(jwk: &Jwk) -> Vec<Algorithm> {
    use Algorithm::*;
    let all = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => vec![RS256, RS384, RS512, PS256, PS384, PS512],
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => vec![ES256],
            EllipticCurve::P384 => vec![ES384],
            _ => vec![],
        },
        AlgorithmParameters::OctetKeyPair(_) => vec![EdDSA],
        // Shared secrets are never taken from a key set.
        AlgorithmParameters::OctetKey(_) => vec![],
    };
    // A key that names its algorithm verifies that one only.
    match jwk
        .common
        .key_algorithm
        .and_then(|a| a.to_string().parse::<Algorithm>().ok())
    {
        Some(named) => all.into_iter().filter(|a| *a == named).collect(),
        None => all,
    }
}

fn parse_keys(text: &str, origin: &str) -> Result<Vec<Key>, AuthConfigError> {
    let set: JwkSet = serde_json::from_str(text)
        .map_err(|e| AuthConfigError::invalid(origin, format!("not a JWKS document: {e}")))?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        let algorithms = algorithms_of(jwk);
        if algorithms.is_empty() {
            continue;
        }
        let key = DecodingKey::from_jwk(jwk).map_err(|e| {
            AuthConfigError::invalid(origin, format!("key {:?}: {e}", jwk.common.key_id))
        })?;
        keys.push(Key {
            kid: jwk.common.key_id.clone(),
            key,
            algorithms,
        });
    }
    if keys.is_empty() {
        return Err(AuthConfigError::invalid(
            origin,
            "the key set holds no RSA, EC or Ed25519 key",
        ));
    }
    Ok(keys)
}

impl JwtVerifier {
    /// A verifier with no keys yet; [`JwtVerifier::load`] or [`JwtVerifier::run`]
    /// gets them.
    pub fn new(settings: JwtSettings) -> JwtVerifier {
        JwtVerifier {
            settings,
            keys: RwLock::new(Keys {
                keys: Vec::new(),
                loaded: None,
            }),
            refresh_wanted: Notify::new(),
            min_refetch: KEYS_RETRY,
            verified: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The same, fetching a JWKS URL at most every `d` (tests).
    pub fn with_min_refetch(mut self, d: Duration) -> JwtVerifier {
        self.min_refetch = d;
        self
    }

    /// A verifier with the keys of a JWKS document (tests, and files read at start).
    pub fn with_jwks(settings: JwtSettings, jwks: &str) -> Result<JwtVerifier, AuthConfigError> {
        let v = JwtVerifier::new(settings);
        v.set_keys(parse_keys(jwks, "JWKS")?, None);
        Ok(v)
    }

    fn set_keys(&self, keys: Vec<Key>, modified: Stamp) {
        *write_lock(&self.keys) = Keys {
            keys,
            loaded: modified,
        };
        // A token of a key that is gone must not pass on the strength of the past.
        self.verified_tokens().clear();
    }

    fn verified_tokens(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], (Caller, i64)>> {
        lock(&self.verified)
    }

    /// Loads the keys once from their source.
    pub async fn load(&self) -> Result<(), AuthConfigError> {
        match &self.settings.keys {
            KeySource::File(path) => {
                let modified = stamp(path);
                let text = tokio::fs::read_to_string(path).await.map_err(|source| {
                    AuthConfigError::Read {
                        path: path.clone(),
                        source,
                    }
                })?;
                let keys = parse_keys(&text, &path.display().to_string())?;
                self.set_keys(keys, modified);
            }
            KeySource::Url(url) => {
                let text = fetch(url).await?;
                let keys = parse_keys(&text, url)?;
                self.set_keys(keys, None);
            }
        }
        Ok(())
    }

    /// Keeps the keys fresh until `shutdown`: a file is read again when it changes;
    /// a URL is fetched every [`KEYS_REFRESH`], sooner when a token names an unknown
    /// key (at most every [`KEYS_RETRY`]), and again after a failure.
    pub async fn run(self: std::sync::Arc<Self>, shutdown: CancellationToken) {
        let mut last_fetch = Instant::now();
        let mut failing = false;
        loop {
            let wait = match (&self.settings.keys, failing) {
                (KeySource::File(_), _) => FILE_CHECK,
                (KeySource::Url(_), true) => self.min_refetch,
                (KeySource::Url(_), false) => KEYS_REFRESH,
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                _ = self.refresh_wanted.notified() => {
                    let soonest = last_fetch + self.min_refetch;
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep_until(soonest.into()) => {}
                    }
                }
            }
            if let KeySource::File(path) = &self.settings.keys {
                let modified = stamp(path);
                if modified == read_lock(&self.keys).loaded {
                    continue;
                }
            }
            last_fetch = Instant::now();
            match self.load().await {
                Ok(()) => {
                    if failing {
                        tracing::info!("OAuth signing keys loaded");
                    }
                    failing = false;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "cannot load the OAuth signing keys; the previous ones stay in use");
                    }
                    failing = true;
                }
            }
        }
    }

    /// The caller a JWT speaks for, or why it is refused.
    pub fn verify(&self, token: &str) -> Result<Caller, JwtError> {
        let digest = super::sha256(token.as_bytes());
        let now = courier_proto::domain::epoch_ms() / 1000;
        let leeway = i64::try_from(LEEWAY_SECS).unwrap_or(0);
        if let Some((caller, exp)) = self.verified_tokens().get(&digest) {
            if now <= exp.saturating_add(leeway) {
                return Ok(caller.clone());
            }
        }
        let (caller, exp) = self.check(token)?;
        let mut verified = self.verified_tokens();
        if verified.len() >= MAX_VERIFIED {
            verified.clear();
        }
        verified.insert(digest, (caller.clone(), exp));
        Ok(caller)
    }

    /// Every check of a token: its caller and its `exp`.
    fn check(&self, token: &str) -> Result<(Caller, i64), JwtError> {
        use Algorithm::*;
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| JwtError::Unreadable(e.to_string()))?;
        if !matches!(
            header.alg,
            RS256 | RS384 | RS512 | PS256 | PS384 | PS512 | ES256 | ES384 | EdDSA
        ) {
            return Err(JwtError::Algorithm(format!("{:?}", header.alg)));
        }
        let keys = read_lock(&self.keys);
        if keys.keys.is_empty() {
            self.refresh_wanted.notify_one();
            return Err(JwtError::NoKeys);
        }
        let key = keys
            .keys
            .iter()
            .filter(|k| k.algorithms.contains(&header.alg))
            .find(|k| header.kid.is_none() || k.kid == header.kid);
        let Some(key) = key else {
            self.refresh_wanted.notify_one();
            return Err(JwtError::UnknownKey(header.kid));
        };
        let mut validation = Validation::new(header.alg);
        validation.leeway = LEEWAY_SECS;
        validation.validate_nbf = true;
        validation.set_issuer(&[&self.settings.issuer]);
        validation.set_audience(&[&self.settings.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        let data = jsonwebtoken::decode::<serde_json::Value>(token, &key.key, &validation)
            .map_err(|e| {
                use jsonwebtoken::errors::ErrorKind as K;
                match e.kind() {
                    K::ExpiredSignature => JwtError::Expired,
                    K::ImmatureSignature => JwtError::NotYetValid,
                    K::InvalidIssuer => JwtError::Issuer,
                    K::InvalidAudience => JwtError::Audience,
                    K::InvalidSignature
                    | K::InvalidEcdsaKey
                    | K::InvalidRsaKey(_)
                    | K::InvalidAlgorithm => JwtError::Signature,
                    K::MissingRequiredClaim(c) => JwtError::MissingClaim(c.clone()),
                    _ => JwtError::Unreadable(e.to_string()),
                }
            })?;
        drop(keys);
        let claims = data.claims;
        let name = ["sub", "azp", "client_id"]
            .iter()
            .find_map(|c| claims.get(*c).and_then(|v| v.as_str()))
            .unwrap_or("oauth")
            .to_string();
        let tenants = match &self.settings.tenants_claim {
            None => Vec::new(),
            Some(claim) => tenants_from(claims.get(claim), claim)?,
        };
        // Required and checked above: a number.
        let exp = claims
            .get("exp")
            .and_then(serde_json::Value::as_i64)
            .unwrap_or(0);
        Ok((Caller::new(name, tenants), exp))
    }
}

/// The tenants a claim lists: a list of tenant ids, or one.
fn tenants_from(value: Option<&serde_json::Value>, claim: &str) -> Result<Vec<String>, JwtError> {
    let bad = || JwtError::Tenants(claim.to_string());
    let ids: Vec<&str> = match value {
        None | Some(serde_json::Value::Null) => return Ok(Vec::new()),
        Some(serde_json::Value::String(s)) => vec![s.as_str()],
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().ok_or_else(bad))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad()),
    };
    ids.into_iter()
        .map(|t| {
            if t.is_empty() {
                return Err(bad());
            }
            validate::tenant_id(t).map_err(|_| bad())
        })
        .collect()
}

/// GETs a key set.
async fn fetch(url: &str) -> Result<String, AuthConfigError> {
    let failed = |reason: String| AuthConfigError::Fetch {
        url: url.to_string(),
        reason,
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| failed(e.to_string()))?;
    let response = client
        .get(url)
        .send()
        .await
        .map_err(|e| failed(e.to_string()))?;
    if !response.status().is_success() {
        return Err(failed(format!("HTTP {}", response.status())));
    }
    response.text().await.map_err(|e| failed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{encode, EncodingKey, Header};
    use serde_json::json;
    use std::sync::Arc;

    const JWKS: &str = include_str!("testdata/jwks.json");
    const RSA: &[u8] = include_bytes!("testdata/rsa.pem");
    const RSA_OTHER: &[u8] = include_bytes!("testdata/rsa-other.pem");
    const EC: &[u8] = include_bytes!("testdata/ec.pem");

    fn settings(tenants_claim: Option<&str>) -> JwtSettings {
        JwtSettings {
            keys: KeySource::File("unused".into()),
            issuer: "https://idp.test/".into(),
            audience: "courier".into(),
            tenants_claim: tenants_claim.map(str::to_string),
        }
    }

    fn now() -> i64 {
        courier_proto::domain::epoch_ms() / 1000
    }

    fn claims(extra: serde_json::Value) -> serde_json::Value {
        let mut c = json!({
            "iss": "https://idp.test/",
            "aud": "courier",
            "sub": "worker-app",
            "exp": now() + 300,
            "iat": now(),
        });
        if let (Some(c), Some(extra)) = (c.as_object_mut(), extra.as_object()) {
            for (k, v) in extra {
                c.insert(k.clone(), v.clone());
            }
        }
        c
    }

    fn rs256(kid: Option<&str>, key: &[u8], claims: &serde_json::Value) -> String {
        let mut h = Header::new(Algorithm::RS256);
        h.kid = kid.map(str::to_string);
        encode(&h, claims, &EncodingKey::from_rsa_pem(key).unwrap()).unwrap()
    }

    fn es256(kid: Option<&str>, claims: &serde_json::Value) -> String {
        let mut h = Header::new(Algorithm::ES256);
        h.kid = kid.map(str::to_string);
        encode(&h, claims, &EncodingKey::from_ec_pem(EC).unwrap()).unwrap()
    }

    fn verifier(tenants_claim: Option<&str>) -> JwtVerifier {
        JwtVerifier::with_jwks(settings(tenants_claim), JWKS).unwrap()
    }

    #[test]
    fn rs256_and_es256_tokens_of_the_provider_are_accepted() {
        let v = verifier(None);
        let c = v
            .verify(&rs256(Some("rsa-1"), RSA, &claims(json!({}))))
            .unwrap();
        assert_eq!(c, Caller::new("worker-app", vec![]));
        let c = v.verify(&es256(Some("ec-1"), &claims(json!({})))).unwrap();
        assert_eq!(c.name, "worker-app");
        // Without a kid, the key is found by its algorithm.
        assert!(v.verify(&es256(None, &claims(json!({})))).is_ok());
        // An audience list that contains ours is fine.
        let c = claims(json!({"aud": ["other", "courier"]}));
        assert!(v.verify(&rs256(Some("rsa-1"), RSA, &c)).is_ok());
    }

    #[test]
    fn every_rejection_reason() {
        let v = verifier(Some("tenants"));
        let ok = claims(json!({}));
        let cases: Vec<(String, JwtError)> = vec![
            ("not-a-jwt".into(), JwtError::Unreadable(String::new())),
            (
                encode(
                    &Header::new(Algorithm::HS256),
                    &ok,
                    &EncodingKey::from_secret(b"k"),
                )
                .unwrap(),
                JwtError::Algorithm("HS256".into()),
            ),
            (
                rs256(Some("rsa-9"), RSA, &ok),
                JwtError::UnknownKey(Some("rsa-9".into())),
            ),
            (rs256(Some("rsa-1"), RSA_OTHER, &ok), JwtError::Signature),
            (
                rs256(
                    Some("rsa-1"),
                    RSA,
                    &claims(json!({"exp": now() - LEEWAY_SECS as i64 - 60})),
                ),
                JwtError::Expired,
            ),
            (
                rs256(
                    Some("rsa-1"),
                    RSA,
                    &claims(json!({"nbf": now() + LEEWAY_SECS as i64 + 60})),
                ),
                JwtError::NotYetValid,
            ),
            (
                rs256(
                    Some("rsa-1"),
                    RSA,
                    &claims(json!({"iss": "https://evil.test/"})),
                ),
                JwtError::Issuer,
            ),
            (
                rs256(Some("rsa-1"), RSA, &claims(json!({"aud": "someone-else"}))),
                JwtError::Audience,
            ),
            (
                {
                    let mut c = claims(json!({}));
                    c.as_object_mut().unwrap().remove("exp");
                    rs256(Some("rsa-1"), RSA, &c)
                },
                JwtError::MissingClaim("exp".into()),
            ),
            (
                rs256(Some("rsa-1"), RSA, &claims(json!({"tenants": [1, 2]}))),
                JwtError::Tenants("tenants".into()),
            ),
            (
                rs256(Some("rsa-1"), RSA, &claims(json!({"tenants": ["a b"]}))),
                JwtError::Tenants("tenants".into()),
            ),
        ];
        for (token, expected) in cases {
            let got = v.verify(&token).unwrap_err();
            match (&got, &expected) {
                (JwtError::Unreadable(_), JwtError::Unreadable(_)) => {}
                _ => assert_eq!(got, expected, "{token}"),
            }
        }
    }

    #[test]
    fn a_verified_token_is_remembered_until_it_expires_or_the_keys_change() {
        let v = verifier(None);
        let token = rs256(Some("rsa-1"), RSA, &claims(json!({})));
        assert!(v.verify(&token).is_ok());
        assert_eq!(v.verified_tokens().len(), 1);
        // What is remembered answers for a token (this one would fail its check)
        // until the `exp` remembered with it, and not after.
        let forged = rs256(Some("rsa-1"), RSA_OTHER, &claims(json!({})));
        let remember = |exp: i64| {
            let digest = super::super::sha256(forged.as_bytes());
            v.verified_tokens()
                .insert(digest, (Caller::new("x", vec![]), exp));
        };
        remember(now() + 60);
        assert_eq!(v.verify(&forged).map(|c| c.name), Ok("x".to_string()));
        remember(now() - LEEWAY_SECS as i64 - 1);
        assert_eq!(v.verify(&forged), Err(JwtError::Signature));
        // New keys forget every token checked with the old ones.
        assert!(!v.verified_tokens().is_empty());
        v.set_keys(parse_keys(JWKS, "t").unwrap(), None);
        assert!(v.verified_tokens().is_empty());
    }

    #[test]
    fn a_token_within_the_leeway_still_passes() {
        let v = verifier(None);
        let c = claims(json!({"exp": now() - 5, "nbf": now() + 5}));
        assert!(v.verify(&rs256(Some("rsa-1"), RSA, &c)).is_ok());
    }

    #[test]
    fn tenants_come_from_the_named_claim() {
        let v = verifier(Some("courier_tenants"));
        let c = claims(json!({"courier_tenants": ["acme", "<default>"]}));
        let caller = v.verify(&rs256(Some("rsa-1"), RSA, &c)).unwrap();
        assert_eq!(
            caller.tenants,
            vec!["acme".to_string(), "<default>".to_string()]
        );
        let c = claims(json!({"courier_tenants": "acme"}));
        assert_eq!(
            v.verify(&es256(Some("ec-1"), &c)).unwrap().tenants,
            vec!["acme".to_string()]
        );
        // No claim: the default tenant only.
        let caller = v.verify(&es256(Some("ec-1"), &claims(json!({})))).unwrap();
        assert_eq!(caller.tenants, vec!["<default>".to_string()]);
    }

    #[test]
    fn without_keys_every_token_is_refused() {
        let v = JwtVerifier::new(settings(None));
        assert_eq!(
            v.verify(&rs256(Some("rsa-1"), RSA, &claims(json!({})))),
            Err(JwtError::NoKeys)
        );
    }

    /// Serves `body()` to every GET on a loopback port, as a provider's JWKS URL.
    async fn jwks_server(body: Arc<std::sync::Mutex<String>>) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let text = body.lock().unwrap().clone();
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                    text.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
            }
        });
        format!("http://{addr}/jwks")
    }

    #[tokio::test]
    async fn a_token_of_a_new_key_makes_the_gateway_fetch_the_keys_again() {
        let all: serde_json::Value = serde_json::from_str(JWKS).unwrap();
        let only_ec = json!({"keys": [all["keys"][1].clone()]}).to_string();
        let body = Arc::new(std::sync::Mutex::new(only_ec));
        let url = jwks_server(body.clone()).await;
        let settings = JwtSettings {
            keys: KeySource::parse(&url),
            ..settings(None)
        };
        let v = Arc::new(JwtVerifier::new(settings).with_min_refetch(Duration::from_millis(50)));
        v.load().await.unwrap();
        let rsa = rs256(Some("rsa-1"), RSA, &claims(json!({})));
        assert_eq!(
            v.verify(&rsa),
            Err(JwtError::UnknownKey(Some("rsa-1".into())))
        );
        // The provider rotates in the RSA key; the refused token asked for a fetch.
        *body.lock().unwrap() = JWKS.to_string();
        let stop = CancellationToken::new();
        let task = tokio::spawn(v.clone().run(stop.clone()));
        let _ = v.verify(&rsa);
        let deadline = Instant::now() + Duration::from_secs(10);
        while v.verify(&rsa).is_err() {
            assert!(Instant::now() < deadline, "the new key was never fetched");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.cancel();
        task.await.unwrap();
    }

    #[test]
    fn key_sets_without_usable_keys_are_refused() {
        assert!(parse_keys("{}", "t")
            .err()
            .unwrap()
            .to_string()
            .contains("JWKS"));
        let secret = r#"{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}"#;
        assert!(parse_keys(secret, "t")
            .err()
            .unwrap()
            .to_string()
            .contains("no RSA"));
    }
}
