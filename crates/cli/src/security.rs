//! The security flags of the servers and clients, `courier cert` (a cluster CA and
//! certificates signed by it), and the in-memory cluster CA of `courier dev`.

use anyhow::{bail, Context};
use courier_client::{Credentials, OAuthCredentials, Security};
use courier_gateway::auth::jwt::{JwtSettings, KeySource};
use courier_proto::tls::ClusterTls;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::path::{Path, PathBuf};

/// TLS on a gateway's client port.
#[derive(clap::Args, Debug, Default)]
pub struct ClientPortTlsArgs {
    /// PEM certificate (chain) the client port presents; with --tls-key the port
    /// speaks TLS only. Read again when the file changes.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

impl ClientPortTlsArgs {
    pub fn config(&self) -> Option<courier_gateway::ClientPortTls> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(courier_gateway::ClientPortTls {
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => None,
        }
    }
}

/// Mutual TLS between brokers, and from gateways to brokers.
#[derive(clap::Args, Debug, Default)]
pub struct ClusterTlsArgs {
    /// PEM certificate of the cluster's CA: with it, a broker takes connections
    /// only from peers whose certificate chains to it (see `courier cert`).
    #[arg(long, requires_all = ["cluster_cert", "cluster_key"])]
    cluster_ca: Option<PathBuf>,
    /// PEM certificate this process presents to brokers, signed by --cluster-ca; a
    /// broker's must name the host it is reached at.
    #[arg(long, requires_all = ["cluster_ca", "cluster_key"])]
    cluster_cert: Option<PathBuf>,
    /// PEM private key of --cluster-cert.
    #[arg(long, requires_all = ["cluster_ca", "cluster_cert"])]
    cluster_key: Option<PathBuf>,
}

impl ClusterTlsArgs {
    pub fn load(&self) -> anyhow::Result<Option<ClusterTls>> {
        match (&self.cluster_ca, &self.cluster_cert, &self.cluster_key) {
            (Some(ca), Some(cert), Some(key)) => Ok(Some(ClusterTls::from_files(ca, cert, key)?)),
            _ => Ok(None),
        }
    }
}

/// Who may call a gateway.
#[derive(clap::Args, Debug, Default)]
pub struct AuthArgs {
    /// A JSON file of static tokens:
    /// {"tokens": [{"name": "...", "token": "...", "tenants": ["<default>"]}]}.
    /// Read again when it changes.
    #[arg(long)]
    auth_tokens: Option<PathBuf>,
    /// The OAuth provider's signing keys: a JWKS file or an http(s) URL (fetched
    /// again every 5 minutes). With it, bearer JWTs are accepted.
    #[arg(long, requires_all = ["oauth_issuer", "oauth_audience"])]
    oauth_jwks: Option<String>,
    /// The `iss` a JWT must carry.
    #[arg(long, requires = "oauth_jwks")]
    oauth_issuer: Option<String>,
    /// The `aud` a JWT must carry (one of).
    #[arg(long, requires = "oauth_jwks")]
    oauth_audience: Option<String>,
    /// The JWT claim listing the caller's tenants (without it: `<default>` only).
    #[arg(long, requires = "oauth_jwks")]
    oauth_tenants_claim: Option<String>,
}

impl AuthArgs {
    pub fn config(&self) -> Option<courier_gateway::AuthConfig> {
        let jwt = match (&self.oauth_jwks, &self.oauth_issuer, &self.oauth_audience) {
            (Some(jwks), Some(issuer), Some(audience)) => Some(JwtSettings {
                keys: KeySource::parse(jwks),
                issuer: issuer.clone(),
                audience: audience.clone(),
                tenants_claim: self.oauth_tenants_claim.clone(),
            }),
            _ => None,
        };
        if jwt.is_none() && self.auth_tokens.is_none() {
            return None;
        }
        Some(courier_gateway::AuthConfig {
            tokens: self.auth_tokens.clone(),
            jwt,
        })
    }

    /// How the banner of `courier dev` names it.
    pub fn describe(&self) -> String {
        match (&self.auth_tokens, &self.oauth_jwks) {
            (None, None) => "off (anyone may call)".into(),
            (Some(_), None) => "static tokens".into(),
            (None, Some(_)) => "OAuth JWTs".into(),
            (Some(_), Some(_)) => "static tokens and OAuth JWTs".into(),
        }
    }
}

/// How a client command reaches its gateway securely.
#[derive(clap::Args, Debug, Default)]
pub struct ClientSecurityArgs {
    /// PEM file of the CA the gateway's certificate chains to: TLS with it (an
    /// https:// address without it is checked against the system's roots).
    #[arg(long, env = "COURIER_TLS_CA", global = true)]
    pub tls_ca: Option<PathBuf>,
    /// A static token the gateway knows (sent as `authorization: Bearer`).
    #[arg(long, env = "COURIER_TOKEN", global = true, hide_env_values = true)]
    pub token: Option<String>,
    /// OAuth client id, for a token from --authz-url (client credentials).
    #[arg(long, env = "ZEEBE_CLIENT_ID", global = true)]
    pub client_id: Option<String>,
    /// OAuth client secret.
    #[arg(
        long,
        env = "ZEEBE_CLIENT_SECRET",
        global = true,
        hide_env_values = true
    )]
    pub client_secret: Option<String>,
    /// OAuth token endpoint.
    #[arg(long, env = "ZEEBE_AUTHORIZATION_SERVER_URL", global = true)]
    pub authz_url: Option<String>,
    /// Audience of the OAuth token.
    #[arg(long, env = "ZEEBE_TOKEN_AUDIENCE", global = true)]
    pub audience: Option<String>,
    /// Scope of the OAuth token.
    #[arg(long, env = "ZEEBE_TOKEN_SCOPE", global = true)]
    pub scope: Option<String>,
}

impl ClientSecurityArgs {
    pub fn security(&self) -> anyhow::Result<Security> {
        let oauth =
            self.client_id.is_some() || self.client_secret.is_some() || self.authz_url.is_some();
        let credentials = match (&self.token, oauth) {
            (Some(_), true) => bail!("give either --token or OAuth client credentials, not both"),
            (Some(t), false) => Credentials::Token(t.clone()),
            (None, true) => {
                let (Some(id), Some(secret), Some(url)) =
                    (&self.client_id, &self.client_secret, &self.authz_url)
                else {
                    bail!("OAuth needs --client-id, --client-secret and --authz-url (or ZEEBE_CLIENT_ID, ZEEBE_CLIENT_SECRET, ZEEBE_AUTHORIZATION_SERVER_URL)");
                };
                Credentials::OAuth(OAuthCredentials {
                    client_id: id.clone(),
                    client_secret: secret.clone(),
                    token_url: url.clone(),
                    audience: self.audience.clone().unwrap_or_default(),
                    scope: self.scope.clone().unwrap_or_default(),
                })
            }
            (None, false) => Credentials::None,
        };
        Ok(Security {
            tls_ca: self.tls_ca.clone(),
            credentials,
        })
    }
}

/// `courier cert`: a CA for the cluster, and certificates it signs.
#[derive(clap::Subcommand, Debug)]
pub enum CertCmd {
    /// Make a new CA: DIR/ca.pem (give it to every process) and DIR/ca-key.pem
    /// (keep it safe: whoever has it can join the cluster).
    Ca {
        /// Where to write the files.
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
    /// Make a certificate signed by the CA: DIR/NAME.pem and DIR/NAME-key.pem, for
    /// both server and client use (a broker is both).
    Issue {
        /// A name for the certificate (its common name and file names).
        name: String,
        /// The CA's folder (ca.pem and ca-key.pem, as `courier cert ca` wrote them).
        #[arg(long, default_value = ".")]
        ca: PathBuf,
        /// Host names and IP addresses the certificate is valid for (repeat the
        /// flag); a broker's must include the host in its --addr.
        #[arg(long = "host", default_values = ["localhost", "127.0.0.1"])]
        hosts: Vec<String>,
        /// Where to write the files.
        #[arg(long, default_value = ".")]
        out: PathBuf,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
}

pub fn cert(cmd: CertCmd) -> anyhow::Result<()> {
    match cmd {
        CertCmd::Ca { out } => {
            let (cert, key) = new_ca("Courier cluster CA", 3650)?;
            write_pair(&out, "ca", &cert, &key)?;
            eprintln!(
                "wrote {} and {}",
                out.join("ca.pem").display(),
                out.join("ca-key.pem").display()
            );
        }
        CertCmd::Issue {
            name,
            ca,
            hosts,
            out,
            days,
        } => {
            let ca_pem = std::fs::read_to_string(ca.join("ca.pem"))
                .with_context(|| format!("cannot read {}", ca.join("ca.pem").display()))?;
            let ca_key = std::fs::read_to_string(ca.join("ca-key.pem"))
                .with_context(|| format!("cannot read {}", ca.join("ca-key.pem").display()))?;
            let (cert, key) = issue(&ca_pem, &ca_key, &name, &hosts, days)?;
            write_pair(&out, &name, &cert, &key)?;
            eprintln!(
                "wrote {} and {} (valid for {})",
                out.join(format!("{name}.pem")).display(),
                out.join(format!("{name}-key.pem")).display(),
                hosts.join(", ")
            );
        }
    }
    Ok(())
}

/// A new CA certificate and its key, as PEM.
pub fn new_ca(name: &str, days: u32) -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    set_validity(&mut params, days);
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A certificate for `hosts`, signed by the CA, and its key, as PEM.
pub fn issue(
    ca_pem: &str,
    ca_key_pem: &str,
    name: &str,
    hosts: &[String],
    days: u32,
) -> anyhow::Result<(String, String)> {
    let ca_key = KeyPair::from_pem(ca_key_pem).context("the CA key does not load")?;
    let issuer =
        Issuer::from_ca_cert_pem(ca_pem, ca_key).context("the CA certificate does not load")?;
    if let Some(bad) = hosts.iter().find(|h| !is_host(h)) {
        bail!("--host '{bad}' is not a host name or IP address");
    }
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(hosts.to_vec())
        .context("a --host is not a host name or IP address")?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    set_validity(&mut params, days);
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// An IP address, or a DNS name: dot-separated labels of letters, digits and
/// hyphens (the first may be `*`).
fn is_host(h: &str) -> bool {
    if h.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').enumerate().all(|(i, label)| {
            (i == 0 && label == "*")
                || (!label.is_empty()
                    && label.len() <= 63
                    && !label.starts_with('-')
                    && !label.ends_with('-')
                    && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        })
}

fn set_validity(params: &mut CertificateParams, days: u32) {
    let now = std::time::SystemTime::now();
    let from = now - std::time::Duration::from_secs(3600);
    let to = now + std::time::Duration::from_secs(u64::from(days) * 86_400);
    params.not_before = from.into();
    params.not_after = to.into();
}

fn write_pair(dir: &Path, name: &str, cert: &str, key: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let cert_path = dir.join(format!("{name}.pem"));
    let key_path = dir.join(format!("{name}-key.pem"));
    std::fs::write(&cert_path, cert)
        .with_context(|| format!("cannot write {}", cert_path.display()))?;
    write_private(&key_path, key)
}

/// Writes a private key readable by its owner only.
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut f = options
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// The cluster TLS of `courier dev`: a CA made for this run, held in memory only,
/// and one certificate of it for the brokers and the gateway on loopback. Its
/// brokers are never open, even on loopback.
pub fn dev_cluster_tls() -> anyhow::Result<ClusterTls> {
    let (ca, ca_key) = new_ca("courier dev cluster CA", 2)?;
    let hosts = ["127.0.0.1".to_string(), "localhost".to_string()];
    let (cert, key) = issue(&ca, &ca_key, "courier-dev", &hosts, 2)?;
    Ok(ClusterTls::from_pem(
        ca.as_bytes(),
        cert.as_bytes(),
        key.as_bytes(),
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_chain_to_their_ca_and_load() {
        let (ca, ca_key) = new_ca("test CA", 1).unwrap();
        let (cert, key) = issue(
            &ca,
            &ca_key,
            "broker-1",
            &["127.0.0.1".into(), "broker-1.example".into()],
            1,
        )
        .unwrap();
        let tls = ClusterTls::from_pem(ca.as_bytes(), cert.as_bytes(), key.as_bytes()).unwrap();
        assert!(tls.server_config().is_ok());
        // A certificate of another CA goes with its key, but not with this CA:
        // that is checked in the handshake, by the cluster tests.
        let (other_ca, other_key) = new_ca("other", 1).unwrap();
        let (cert2, key2) = issue(&other_ca, &other_key, "x", &["localhost".into()], 1).unwrap();
        assert!(ClusterTls::from_pem(ca.as_bytes(), cert2.as_bytes(), key2.as_bytes()).is_ok());
        // A key that is not the certificate's is refused at once.
        let e = ClusterTls::from_pem(ca.as_bytes(), cert.as_bytes(), key2.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("do not go together"), "{e}");
    }

    #[test]
    fn bad_hosts_and_missing_ca_files_say_why() {
        let (ca, ca_key) = new_ca("test CA", 1).unwrap();
        let e = issue(&ca, &ca_key, "b", &["not a host".into()], 1).unwrap_err();
        assert!(e.to_string().contains("'not a host'"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let e = cert(CertCmd::Issue {
            name: "b".into(),
            ca: dir.path().to_path_buf(),
            hosts: vec!["localhost".into()],
            out: dir.path().to_path_buf(),
            days: 1,
        })
        .unwrap_err();
        assert!(format!("{e:#}").contains("ca.pem"), "{e:#}");
    }

    #[test]
    fn client_credentials_are_one_kind_or_the_other() {
        let a = ClientSecurityArgs {
            token: Some("t".into()),
            client_id: Some("id".into()),
            ..Default::default()
        };
        assert!(a.security().unwrap_err().to_string().contains("not both"));
        let a = ClientSecurityArgs {
            client_id: Some("id".into()),
            ..Default::default()
        };
        assert!(a
            .security()
            .unwrap_err()
            .to_string()
            .contains("--authz-url"));
        let a = ClientSecurityArgs {
            client_id: Some("id".into()),
            client_secret: Some("s".into()),
            authz_url: Some("http://127.0.0.1:1/token".into()),
            audience: Some("courier".into()),
            ..Default::default()
        };
        assert!(
            matches!(a.security().unwrap().credentials, Credentials::OAuth(c) if c.audience == "courier")
        );
    }
}
