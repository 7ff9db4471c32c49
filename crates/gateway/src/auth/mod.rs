//! Who is calling: static tokens and OAuth 2 bearer JWTs, checked on every request
//! of the job services (the health service stays open for load balancers), and the
//! tenants each caller may work on. See `docs/security.md`.
//!
//! - [`tokens`]: `--auth-tokens FILE`, compared in constant time, reloaded on change.
//! - [`jwt`]: `--oauth-jwks`, signature, expiry, issuer and audience checks.

pub mod jwt;
pub mod tokens;

use crate::error::GatewayError;
use courier_proto::domain::{ActivationProps, NewJob, DEFAULT_TENANT};
use std::sync::Arc;
use tonic::metadata::MetadataMap;
use tonic::Status;

/// The SHA-256 of `data`: how tokens are compared and remembered.
pub(crate) fn sha256(data: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, data);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// An authenticated caller and the tenants whose jobs it may see and make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The token's name, or the JWT's subject: for logs, never for decisions.
    pub name: String,
    /// Never empty; the first is the caller's default tenant.
    pub tenants: Vec<String>,
}

impl Caller {
    /// A caller of `tenants` (`<default>` when none are given).
    pub fn new(name: impl Into<String>, mut tenants: Vec<String>) -> Caller {
        if tenants.is_empty() {
            tenants.push(DEFAULT_TENANT.to_string());
        }
        Caller {
            name: name.into(),
            tenants,
        }
    }

    /// The tenant a request that names none means: `<default>` when the caller
    /// has it (as in Zeebe), otherwise its first tenant.
    pub fn default_tenant(&self) -> &str {
        if self.may(DEFAULT_TENANT) {
            DEFAULT_TENANT
        } else {
            self.tenants.first().map_or(DEFAULT_TENANT, String::as_str)
        }
    }

    /// Whether jobs of `tenant` are this caller's.
    pub fn may(&self, tenant: &str) -> bool {
        self.tenants.iter().any(|t| t == tenant)
    }
}

/// Why a token file or the OAuth signing keys could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum AuthConfigError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{origin}: {reason}")]
    Invalid { origin: String, reason: String },
    #[error("cannot fetch {url}: {reason}")]
    Fetch { url: String, reason: String },
}

impl AuthConfigError {
    fn invalid(origin: impl Into<String>, reason: impl ToString) -> AuthConfigError {
        AuthConfigError::Invalid {
            origin: origin.into(),
            reason: reason.to_string(),
        }
    }
}

/// Why a request was not authenticated. Each is UNAUTHENTICATED to the client.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("no credentials: send 'authorization: Bearer <token>'")]
    Missing,
    #[error("the authorization header is not 'Bearer <token>'")]
    Malformed,
    #[error("unknown token")]
    UnknownToken,
    #[error("invalid JWT: {0}")]
    Jwt(#[from] jwt::JwtError),
}

impl AuthError {
    /// The label of `courier_gateway_auth_refused_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            AuthError::Missing => "missing",
            AuthError::Malformed => "malformed",
            AuthError::UnknownToken => "unknown_token",
            AuthError::Jwt(e) => e.reason(),
        }
    }
}

impl From<AuthError> for Status {
    fn from(e: AuthError) -> Status {
        Status::unauthenticated(e.to_string())
    }
}

/// Checks the credentials of requests against the static tokens and the OAuth
/// settings, whichever are configured (both at once too).
#[derive(Default)]
pub struct Authenticator {
    pub tokens: Option<Arc<tokens::TokenFile>>,
    pub jwt: Option<Arc<jwt::JwtVerifier>>,
}

impl Authenticator {
    /// The caller of a request with `metadata`.
    pub fn check(&self, metadata: &MetadataMap) -> Result<Caller, AuthError> {
        let value = metadata.get("authorization").ok_or(AuthError::Missing)?;
        let value = value.to_str().map_err(|_| AuthError::Malformed)?.trim();
        let (scheme, token) = value.split_once(' ').ok_or(AuthError::Malformed)?;
        let token = token.trim();
        if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
            return Err(AuthError::Malformed);
        }
        if let Some(caller) = self.tokens.as_ref().and_then(|t| t.lookup(token)) {
            return Ok(caller);
        }
        match &self.jwt {
            // A JWT has three dot-separated parts; anything else is an unknown token.
            Some(jwt) if token.split('.').count() == 3 => Ok(jwt.verify(token)?),
            _ => Err(AuthError::UnknownToken),
        }
    }
}

/// The interceptor of the job services: with an authenticator, a request without
/// valid credentials ends UNAUTHENTICATED and one with them carries its [`Caller`]
/// in its extensions; without one, requests pass as they are (every tenant).
#[derive(Clone, Default)]
pub struct Authenticate(pub Option<Arc<Authenticator>>);

impl tonic::service::Interceptor for Authenticate {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        let Some(auth) = &self.0 else {
            return Ok(request);
        };
        match auth.check(request.metadata()) {
            Ok(caller) => {
                request.extensions_mut().insert(Arc::new(caller));
                Ok(request)
            }
            Err(e) => {
                crate::metrics::auth_refused(e.reason());
                tracing::debug!(reason = e.reason(), error = %e, "request refused: not authenticated");
                Err(e.into())
            }
        }
    }
}

/// A job created by `caller` belongs to one of its tenants: one that names none
/// (`unnamed`) gets the caller's default tenant, one that names another is
/// PERMISSION_DENIED.
pub fn own_tenant(
    caller: Option<&Caller>,
    job: &mut NewJob,
    unnamed: bool,
) -> Result<(), GatewayError> {
    let Some(caller) = caller else {
        return Ok(());
    };
    if unnamed {
        job.tenant_id = caller.default_tenant().to_string();
    }
    if caller.may(&job.tenant_id) {
        Ok(())
    } else {
        Err(not_yours(caller, &job.tenant_id))
    }
}

/// The tenants a worker of `caller` takes jobs of: those it asked for, each one
/// of the caller's (PERMISSION_DENIED otherwise), or the caller's default tenant
/// when it asked for none.
pub fn worker_tenants(
    caller: Option<&Caller>,
    props: &mut ActivationProps,
    asked: &[String],
) -> Result<(), GatewayError> {
    let Some(caller) = caller else {
        return Ok(());
    };
    if asked.is_empty() {
        props.tenant_ids = vec![caller.default_tenant().to_string()];
        return Ok(());
    }
    match props.tenant_ids.iter().find(|t| !caller.may(t)) {
        Some(t) => Err(not_yours(caller, t)),
        None => Ok(()),
    }
}

fn not_yours(caller: &Caller, tenant: &str) -> GatewayError {
    GatewayError::PermissionDenied(format!(
        "tenant '{tenant}' is not among this client's tenants ({})",
        caller.tenants.join(", ")
    ))
}

/// The caller of a request that passed [`Authenticate`]: `None` where no
/// authentication is configured (every tenant is open then).
pub fn caller<T>(request: &tonic::Request<T>) -> Option<Arc<Caller>> {
    request.extensions().get::<Arc<Caller>>().cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(value: Option<&str>) -> MetadataMap {
        let mut m = MetadataMap::new();
        if let Some(v) = value {
            m.insert("authorization", v.parse().unwrap());
        }
        m
    }

    fn with_token(token: &str, tenants: &[&str]) -> Authenticator {
        let json =
            serde_json::json!({"tokens": [{"name": "ci", "token": token, "tenants": tenants}]});
        Authenticator {
            tokens: Some(Arc::new(
                tokens::TokenFile::from_json(&json.to_string(), "test").unwrap(),
            )),
            jwt: None,
        }
    }

    #[test]
    fn every_way_to_be_refused_has_its_own_reason() {
        let a = with_token("s3cret-token-of-ci", &["acme"]);
        assert_eq!(a.check(&md(None)), Err(AuthError::Missing));
        assert_eq!(
            a.check(&md(Some("s3cret-token-of-ci"))),
            Err(AuthError::Malformed)
        );
        assert_eq!(
            a.check(&md(Some("Basic s3cret-token-of-ci"))),
            Err(AuthError::Malformed)
        );
        assert_eq!(a.check(&md(Some("Bearer "))), Err(AuthError::Malformed));
        assert_eq!(
            a.check(&md(Some("Bearer nope"))),
            Err(AuthError::UnknownToken)
        );
        // A JWT-shaped token without OAuth configured is just an unknown token.
        assert_eq!(
            a.check(&md(Some("Bearer a.b.c"))),
            Err(AuthError::UnknownToken)
        );
        let c = a.check(&md(Some("bearer s3cret-token-of-ci"))).unwrap();
        assert_eq!(c, Caller::new("ci", vec!["acme".into()]));
    }

    #[test]
    fn the_default_tenant_is_default_when_the_caller_has_it() {
        let c = Caller::new("x", vec!["b".into(), DEFAULT_TENANT.into()]);
        assert_eq!(c.default_tenant(), DEFAULT_TENANT);
        let c = Caller::new("x", vec!["b".into(), "a".into()]);
        assert_eq!(c.default_tenant(), "b");
        assert!(c.may("a") && !c.may(DEFAULT_TENANT));
        assert_eq!(
            Caller::new("x", vec![]).tenants,
            vec![DEFAULT_TENANT.to_string()]
        );
    }

    fn new_job(tenant: &str) -> NewJob {
        NewJob {
            job_type: "t".into(),
            variables: "{}".into(),
            custom_headers: "{}".into(),
            retries: 3,
            tenant_id: tenant.into(),
            process: Default::default(),
        }
    }

    #[test]
    fn a_create_is_for_one_of_the_callers_tenants() {
        let a = Caller::new("a", vec!["a".into(), "b".into()]);
        let mut job = new_job(DEFAULT_TENANT);
        // Named none: the caller's default tenant.
        own_tenant(Some(&a), &mut job, true).unwrap();
        assert_eq!(job.tenant_id, "a");
        let mut job = new_job("b");
        own_tenant(Some(&a), &mut job, false).unwrap();
        let mut job = new_job("c");
        let e = own_tenant(Some(&a), &mut job, false).unwrap_err();
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::PermissionDenied);
        // Without authentication, any tenant.
        own_tenant(None, &mut job, false).unwrap();
        assert_eq!(job.tenant_id, "c");
    }

    #[test]
    fn a_worker_takes_its_callers_tenants_only() {
        let props = |tenants: &[&str]| ActivationProps {
            job_type: "t".into(),
            worker: "w".into(),
            timeout_ms: 1000,
            fetch_variables: vec![],
            tenant_ids: tenants.iter().map(|t| t.to_string()).collect(),
        };
        let a = Caller::new("a", vec!["a".into(), "b".into()]);
        let mut p = props(&[DEFAULT_TENANT]);
        worker_tenants(Some(&a), &mut p, &[]).unwrap();
        assert_eq!(p.tenant_ids, vec!["a".to_string()]);
        let mut p = props(&["a", "b"]);
        worker_tenants(Some(&a), &mut p, &["a".into(), "b".into()]).unwrap();
        let mut p = props(&["a", "c"]);
        let e = worker_tenants(Some(&a), &mut p, &["a".into(), "c".into()]).unwrap_err();
        assert!(e.to_string().contains("'c'"), "{e}");
        let mut p = props(&["c"]);
        worker_tenants(None, &mut p, &["c".into()]).unwrap();
    }

    #[test]
    fn refusals_are_unauthenticated() {
        let s: Status = AuthError::UnknownToken.into();
        assert_eq!(s.code(), tonic::Code::Unauthenticated);
    }
}
