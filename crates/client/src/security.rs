//! How a client proves itself to a gateway and checks the gateway: TLS (a CA file,
//! or the system's roots for `https://` addresses), and a bearer token, static or
//! fetched from an OAuth 2 token endpoint with client credentials (as Zeebe's
//! clients do) and cached until shortly before it expires.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::transport::Channel;

/// OAuth 2 client credentials, with the names Zeebe's clients give them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OAuthCredentials {
    /// `ZEEBE_CLIENT_ID`.
    pub client_id: String,
    /// `ZEEBE_CLIENT_SECRET`.
    pub client_secret: String,
    /// The token endpoint, `ZEEBE_AUTHORIZATION_SERVER_URL`.
    pub token_url: String,
    /// `ZEEBE_TOKEN_AUDIENCE`; not sent when empty.
    pub audience: String,
    /// `ZEEBE_TOKEN_SCOPE`; not sent when empty.
    pub scope: String,
}

/// The credentials a client sends with every call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Credentials {
    /// None: for a gateway without authentication.
    #[default]
    None,
    /// A static token (`--token`, `COURIER_TOKEN`).
    Token(String),
    /// A token fetched with OAuth client credentials.
    OAuth(OAuthCredentials),
}

/// How to reach a gateway securely.
#[derive(Clone, Debug, Default)]
pub struct Security {
    /// A PEM file of the CA(s) the gateway's certificate chains to: TLS with it.
    pub tls_ca: Option<PathBuf>,
    pub credentials: Credentials,
}

/// Refresh a fetched token this long before it expires, or at half its life if
/// that is shorter.
const REFRESH_MARGIN: Duration = Duration::from_secs(30);
/// How long a token without `expires_in` is used.
const DEFAULT_TOKEN_LIFE: Duration = Duration::from_secs(60);
/// How long one token request may take.
const TOKEN_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the `authorization` header of each call comes from.
#[derive(Debug)]
pub(crate) struct TokenSource {
    kind: TokenKind,
}

#[derive(Debug)]
enum TokenKind {
    Static(http::HeaderValue),
    OAuth {
        credentials: OAuthCredentials,
        http: reqwest::Client,
        cached: tokio::sync::Mutex<Option<(http::HeaderValue, Instant)>>,
    },
}

#[derive(serde::Deserialize)]
struct TokenAnswer {
    access_token: String,
    #[serde(default)]
    expires_in: Option<u64>,
}

impl TokenSource {
    /// The source of `credentials`, or `None` when there are none.
    pub(crate) fn new(credentials: &Credentials) -> Result<Option<Arc<TokenSource>>, String> {
        let kind = match credentials {
            Credentials::None => return Ok(None),
            Credentials::Token(t) => TokenKind::Static(bearer(t)?),
            Credentials::OAuth(c) => {
                if c.client_id.is_empty() || c.client_secret.is_empty() || c.token_url.is_empty() {
                    return Err("OAuth needs a client id, a client secret and the token URL".into());
                }
                let http = reqwest::Client::builder()
                    .timeout(TOKEN_REQUEST_TIMEOUT)
                    .build()
                    .map_err(|e| e.to_string())?;
                TokenKind::OAuth {
                    credentials: c.clone(),
                    http,
                    cached: tokio::sync::Mutex::new(None),
                }
            }
        };
        Ok(Some(Arc::new(TokenSource { kind })))
    }

    /// The header value to send now, fetching a token if the cached one is due.
    async fn header(&self) -> Result<http::HeaderValue, String> {
        let (credentials, http, cached) = match &self.kind {
            TokenKind::Static(v) => return Ok(v.clone()),
            TokenKind::OAuth {
                credentials,
                http,
                cached,
            } => (credentials, http, cached),
        };
        let mut cached = cached.lock().await;
        if let Some((value, until)) = cached.as_ref() {
            if Instant::now() < *until {
                return Ok(value.clone());
            }
        }
        let (value, life) = fetch_token(http, credentials).await?;
        let margin = REFRESH_MARGIN.min(life / 2);
        *cached = Some((value.clone(), Instant::now() + life - margin));
        Ok(value)
    }

    /// The gateway refused the token: fetch another for the next call.
    async fn forget(&self) {
        if let TokenKind::OAuth { cached, .. } = &self.kind {
            *cached.lock().await = None;
        }
    }
}

fn bearer(token: &str) -> Result<http::HeaderValue, String> {
    let mut v = http::HeaderValue::from_str(&format!("Bearer {}", token.trim()))
        .map_err(|_| "the token has characters a header cannot carry".to_string())?;
    v.set_sensitive(true);
    Ok(v)
}

/// One client-credentials request (RFC 6749 4.4), credentials in the form body as
/// Zeebe's clients send them.
async fn fetch_token(
    http: &reqwest::Client,
    c: &OAuthCredentials,
) -> Result<(http::HeaderValue, Duration), String> {
    let mut form = vec![
        ("grant_type", "client_credentials"),
        ("client_id", c.client_id.as_str()),
        ("client_secret", c.client_secret.as_str()),
    ];
    if !c.audience.is_empty() {
        form.push(("audience", c.audience.as_str()));
    }
    if !c.scope.is_empty() {
        form.push(("scope", c.scope.as_str()));
    }
    let why =
        |e: &dyn std::fmt::Display| format!("cannot get an OAuth token from {}: {e}", c.token_url);
    let response = http
        .post(&c.token_url)
        .header("accept", "application/json")
        .form(&form)
        .send()
        .await
        .map_err(|e| why(&e))?;
    let status = response.status();
    let body = response.text().await.map_err(|e| why(&e))?;
    if !status.is_success() {
        let body: String = body.chars().take(200).collect();
        return Err(why(&format!("HTTP {status}: {body}")));
    }
    let answer: TokenAnswer =
        serde_json::from_str(&body).map_err(|e| why(&format!("unexpected answer: {e}")))?;
    let life = answer
        .expires_in
        .map_or(DEFAULT_TOKEN_LIFE, Duration::from_secs);
    Ok((bearer(&answer.access_token)?, life))
}

/// The channel the generated clients run on: each call gets the `authorization`
/// header of its [`TokenSource`], if any. A token that cannot be had ends the call
/// UNAUTHENTICATED, with why; an UNAUTHENTICATED answer makes the next call fetch a
/// new token.
#[derive(Clone, Debug)]
pub struct AuthChannel {
    inner: Channel,
    tokens: Option<Arc<TokenSource>>,
}

impl AuthChannel {
    pub(crate) fn new(inner: Channel, tokens: Option<Arc<TokenSource>>) -> AuthChannel {
        AuthChannel { inner, tokens }
    }
}

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, tonic::transport::Error>> + Send>>;

impl tonic::codegen::Service<http::Request<Body>> for AuthChannel {
    type Response = http::Response<Body>;
    type Error = tonic::transport::Error;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tonic::codegen::Service::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let Some(tokens) = self.tokens.clone() else {
            return Box::pin(tonic::codegen::Service::call(&mut self.inner, request));
        };
        // The clone that was polled ready makes the call, after the token is had; a
        // fresh clone stays here.
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        Box::pin(async move {
            match tokens.header().await {
                Ok(value) => {
                    request
                        .headers_mut()
                        .insert(http::header::AUTHORIZATION, value);
                }
                Err(why) => return Ok(tonic::Status::unauthenticated(why).into_http()),
            }
            let response = tonic::codegen::Service::call(&mut inner, request).await?;
            let refused = response
                .headers()
                .get("grpc-status")
                .is_some_and(|s| s.as_bytes() == b"16");
            if refused {
                tokens.forget().await;
            }
            Ok(response)
        })
    }
}
