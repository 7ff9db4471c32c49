//! Static tokens from `--auth-tokens FILE`:
//! `{"tokens": [{"name": "...", "token": "...", "tenants": ["<default>", ...]}]}`.
//! A presented token is hashed and compared with every known token's hash in
//! constant time, so neither its content nor its length shows in the answer time.
//! The file is read again when it changes; one that does not parse leaves the
//! previous tokens in force.

use super::{sha256, AuthConfigError, Caller};
use courier_proto::sync::{read_lock, write_lock};
use courier_proto::tls::{stamp, Stamp};
use courier_proto::validate;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::RwLock;
use std::time::Duration;
use subtle::ConstantTimeEq;
use tokio_util::sync::CancellationToken;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileFormat {
    tokens: Vec<TokenEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    token: String,
    #[serde(default)]
    tenants: Vec<String>,
}

struct Known {
    hash: [u8; 32],
    caller: Caller,
}

/// Shortest token accepted in the file: a guessable token is no credential.
pub const MIN_TOKEN_CHARS: usize = 16;

/// The static tokens in force.
pub struct TokenFile {
    path: Option<PathBuf>,
    state: RwLock<(Vec<Known>, Stamp)>,
}

impl TokenFile {
    /// Tokens from the JSON text of a token file; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<TokenFile, AuthConfigError> {
        Ok(TokenFile {
            path: None,
            state: RwLock::new((parse(text, origin)?, None)),
        })
    }

    /// Tokens from the file at `path`.
    pub fn load(path: &Path) -> Result<TokenFile, AuthConfigError> {
        let modified = stamp(path);
        let text = std::fs::read_to_string(path).map_err(|source| AuthConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(TokenFile {
            path: Some(path.to_path_buf()),
            state: RwLock::new((parse(&text, &path.display().to_string())?, modified)),
        })
    }

    /// The caller whose token `token` is. Every known token is compared, found or not.
    pub fn lookup(&self, token: &str) -> Option<Caller> {
        let hash = sha256(token.as_bytes());
        let state = read_lock(&self.state);
        let mut found = None;
        for k in &state.0 {
            if bool::from(k.hash.ct_eq(&hash)) && found.is_none() {
                found = Some(k.caller.clone());
            }
        }
        found
    }

    /// Reads the file again if it changed: `Ok(true)` when new tokens are in force.
    pub fn reload_if_changed(&self) -> Result<bool, AuthConfigError> {
        let Some(path) = &self.path else {
            return Ok(false);
        };
        let now = stamp(path);
        if read_lock(&self.state).1 == now {
            return Ok(false);
        }
        let text = std::fs::read_to_string(path).map_err(|source| AuthConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let known = parse(&text, &path.display().to_string())?;
        *write_lock(&self.state) = (known, now);
        Ok(true)
    }

    /// Looks at the file every `every` until `shutdown`.
    pub async fn watch(self: std::sync::Arc<Self>, every: Duration, shutdown: CancellationToken) {
        courier_proto::tls::keep_reloading("auth token file", every, shutdown, || {
            self.reload_if_changed()
        })
        .await
    }
}

fn parse(text: &str, origin: &str) -> Result<Vec<Known>, AuthConfigError> {
    let file: FileFormat = serde_json::from_str(text)
        .map_err(|e| AuthConfigError::invalid(origin, format!("not a token file: {e}")))?;
    let mut known = Vec::with_capacity(file.tokens.len());
    for (i, t) in file.tokens.into_iter().enumerate() {
        let at = format!("{origin}: tokens[{i}]");
        let bad = |reason: String| AuthConfigError::invalid(at.clone(), reason);
        if t.name.trim().is_empty() {
            return Err(bad("name must not be empty".into()));
        }
        if t.token.chars().count() < MIN_TOKEN_CHARS || t.token.contains(char::is_whitespace) {
            return Err(bad(format!(
                "({}) a token must be at least {MIN_TOKEN_CHARS} characters without spaces",
                t.name
            )));
        }
        let mut tenants = Vec::with_capacity(t.tenants.len());
        for tenant in &t.tenants {
            if tenant.is_empty() {
                return Err(bad(format!("({}) a tenant must not be empty", t.name)));
            }
            tenants
                .push(validate::tenant_id(tenant).map_err(|e| bad(format!("({}) {e}", t.name)))?);
        }
        let hash = sha256(t.token.as_bytes());
        if known.iter().any(|k: &Known| k.hash == hash) {
            return Err(bad(format!("({}) the same token is listed twice", t.name)));
        }
        known.push(Known {
            hash,
            caller: Caller::new(t.name, tenants),
        });
    }
    Ok(known)
}

#[cfg(test)]
mod tests {
    use super::*;
    use courier_proto::domain::DEFAULT_TENANT;

    const FILE: &str = r#"{"tokens": [
        {"name": "billing", "token": "billing-0123456789abcdef", "tenants": ["billing", "<default>"]},
        {"name": "ops", "token": "ops-0123456789abcdefgh"}
    ]}"#;

    #[test]
    fn tokens_name_their_caller_and_tenants() {
        let f = TokenFile::from_json(FILE, "t").unwrap();
        let c = f.lookup("billing-0123456789abcdef").unwrap();
        assert_eq!(c.name, "billing");
        assert_eq!(
            c.tenants,
            vec!["billing".to_string(), DEFAULT_TENANT.to_string()]
        );
        assert_eq!(
            f.lookup("ops-0123456789abcdefgh").unwrap().tenants,
            vec![DEFAULT_TENANT.to_string()]
        );
        assert!(f.lookup("billing-0123456789abcde").is_none());
        assert!(f.lookup("").is_none());
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let cases = [
            ("{}", "not a token file"),
            (
                r#"{"tokens": [{"name": "", "token": "0123456789abcdef0"}]}"#,
                "name must not be empty",
            ),
            (
                r#"{"tokens": [{"name": "a", "token": "short"}]}"#,
                "at least 16",
            ),
            (
                r#"{"tokens": [{"name": "a", "token": "0123456789abcdef0", "tenants": ["a b"]}]}"#,
                "' '",
            ),
            (
                r#"{"tokens": [{"name": "a", "token": "0123456789abcdef0", "tenant": ["x"]}]}"#,
                "unknown field",
            ),
            (
                r#"{"tokens": [{"name": "a", "token": "0123456789abcdef0"}, {"name": "b", "token": "0123456789abcdef0"}]}"#,
                "listed twice",
            ),
        ];
        for (text, expected) in cases {
            let e = TokenFile::from_json(text, "f.json")
                .err()
                .unwrap()
                .to_string();
            assert!(
                e.contains(expected) && e.starts_with("f.json"),
                "{text}: {e}"
            );
        }
    }

    #[test]
    fn a_changed_file_is_read_again_and_a_broken_one_keeps_the_old_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.json");
        std::fs::write(&path, FILE).unwrap();
        let f = TokenFile::load(&path).unwrap();
        assert!(!f.reload_if_changed().unwrap());
        let new = r#"{"tokens": [{"name": "new", "token": "new-0123456789abcdef"}]}"#;
        // Each write is dated later, so the change shows even where mtimes are coarse.
        let rewrite = |text: &str, secs: u64| {
            std::fs::write(&path, text).unwrap();
            let later = std::time::SystemTime::now() + Duration::from_secs(secs);
            let file = std::fs::File::options().write(true).open(&path).unwrap();
            file.set_modified(later).unwrap();
        };
        rewrite(new, 5);
        assert!(f.reload_if_changed().unwrap());
        assert!(f.lookup("billing-0123456789abcdef").is_none());
        assert_eq!(f.lookup("new-0123456789abcdef").unwrap().name, "new");
        rewrite("{ broken", 10);
        assert!(f.reload_if_changed().is_err());
        assert_eq!(f.lookup("new-0123456789abcdef").unwrap().name, "new");
    }
}
