//! Transport security, on rustls with ring: TLS on a gateway's client port (its
//! certificate reloaded when the files change) and mutual TLS inside the cluster
//! (every broker and gateway presents a certificate of the cluster's CA, and a
//! broker's port takes no connection without one). See `docs/security.md`.

use crate::sync::{read_lock, write_lock};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// How long a client may take over its TLS handshake before it is dropped: a peer
/// that connects and says nothing must not hold a slot for ever.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed accept (e.g. out of file descriptors), so the accept loop
/// does not spin while the condition lasts.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// How often certificate files are looked at for a change.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// Why certificates or keys could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{origin}: {reason}")]
    Pem { origin: String, reason: String },
    #[error("{origin}: {reason}")]
    Config { origin: String, reason: String },
}

fn pem_error(origin: &str, reason: impl ToString) -> TlsError {
    TlsError::Pem {
        origin: origin.to_string(),
        reason: reason.to_string(),
    }
}

fn config_error(origin: &str, reason: impl ToString) -> TlsError {
    TlsError::Config {
        origin: origin.to_string(),
        reason: reason.to_string(),
    }
}

/// The one crypto provider Courier uses, named explicitly so that no process-wide
/// default has to be installed.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a file whole, naming it in the error.
pub fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Every certificate in a PEM document; at least one.
pub fn parse_certs(pem: &[u8], origin: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(origin, e))?;
    if certs.is_empty() {
        return Err(pem_error(origin, "no CERTIFICATE block found"));
    }
    Ok(certs)
}

/// The private key in a PEM document (PKCS#8, PKCS#1 or SEC1).
pub fn parse_key(pem: &[u8], origin: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem)
        .map_err(|e| pem_error(origin, format!("no usable private key: {e}")))
}

/// A certificate chain with its key, checked to belong together.
pub fn certified_key(
    cert_pem: &[u8],
    key_pem: &[u8],
    origin: &str,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let certs = parse_certs(cert_pem, origin)?;
    let key = parse_key(key_pem, origin)?;
    CertifiedKey::from_der(certs, key, &provider())
        .map(Arc::new)
        .map_err(|e| {
            config_error(
                origin,
                format!("certificate and key do not go together: {e}"),
            )
        })
}

/// When a file was last written, and how long it is: a change in either is a new
/// file. How every reloaded file (certificates, token files, key sets) is watched.
pub type Stamp = Option<(SystemTime, u64)>;

/// The [`Stamp`] of the file at `path` now (`None` if it cannot be read).
pub fn stamp(path: &Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// A server certificate read from two PEM files, read again when they change, so a
/// certificate is rotated without a restart. A pair that does not load (one file
/// written, the other not yet) leaves the previous one in use.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<(Arc<CertifiedKey>, [Stamp; 2])>,
}

impl ReloadingCert {
    /// Loads the pair; an error says which file is wrong and why.
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Arc<ReloadingCert>, TlsError> {
        let stamps = [stamp(cert_path), stamp(key_path)];
        let key = Self::read_pair(cert_path, key_path)?;
        Ok(Arc::new(ReloadingCert {
            cert_path: cert_path.to_path_buf(),
            key_path: key_path.to_path_buf(),
            current: RwLock::new((key, stamps)),
        }))
    }

    fn read_pair(cert_path: &Path, key_path: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
        let origin = format!("{} with {}", cert_path.display(), key_path.display());
        certified_key(&read(cert_path)?, &read(key_path)?, &origin)
    }

    /// Reads the files again if either changed since the last load: `Ok(true)` when
    /// a new pair is in use.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let stamps = [stamp(&self.cert_path), stamp(&self.key_path)];
        if read_lock(&self.current).1 == stamps {
            return Ok(false);
        }
        let key = Self::read_pair(&self.cert_path, &self.key_path)?;
        *write_lock(&self.current) = (key, stamps);
        Ok(true)
    }

    /// Looks at the files every `every` until `shutdown`.
    pub async fn watch(self: Arc<Self>, every: Duration, shutdown: CancellationToken) {
        keep_reloading("TLS certificate", every, shutdown, || {
            self.reload_if_changed()
        })
        .await
    }
}

/// Calls `reload` every `every` until `shutdown`: `Ok(true)` when it loaded
/// something new (logged), an error when what changed does not load (logged
/// once per distinct error; the previous `what` stays in force).
pub async fn keep_reloading<E: std::fmt::Display>(
    what: &'static str,
    every: Duration,
    shutdown: CancellationToken,
    mut reload: impl FnMut() -> Result<bool, E>,
) {
    let mut reported: Option<String> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        match reload().map_err(|e| e.to_string()) {
            Ok(true) => {
                reported = None;
                tracing::info!("{what} reloaded");
            }
            Ok(false) => {}
            Err(e) => {
                if reported.as_deref() != Some(e.as_str()) {
                    tracing::warn!(error = %e, "{what} changed but does not load; the previous one stays in force");
                    reported = Some(e);
                }
            }
        }
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(read_lock(&self.current).0.clone())
    }
}

/// A server certificate that never changes.
#[derive(Debug)]
struct FixedCert(Arc<CertifiedKey>);

impl ResolvesServerCert for FixedCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// A rustls server configuration speaking HTTP/2 (gRPC clients insist on ALPN
/// `h2`), presenting `cert`; with `client_ca`, a client must present a certificate
/// that chains to one of those.
pub fn server_config(
    cert: Arc<dyn ResolvesServerCert>,
    client_ca: Option<&[CertificateDer<'static>]>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error("TLS", e))?;
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in ca {
                roots
                    .add(c.clone())
                    .map_err(|e| config_error("cluster CA", e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| config_error("cluster CA", e))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(cert);
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// The cluster's mutual TLS: the CA every broker and gateway certificate chains
/// to, and this process's own certificate and key. Brokers require it of every
/// connection; brokers and gateways present it when they connect.
#[derive(Clone)]
pub struct ClusterTls {
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca: Vec<CertificateDer<'static>>,
    key: Arc<CertifiedKey>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterTls").finish_non_exhaustive()
    }
}

impl ClusterTls {
    /// From PEM documents: the CA certificate(s), this process's certificate chain
    /// and its private key.
    pub fn from_pem(
        ca_pem: &[u8],
        cert_pem: &[u8],
        key_pem: &[u8],
    ) -> Result<ClusterTls, TlsError> {
        let ca = parse_certs(ca_pem, "cluster CA")?;
        let key = certified_key(cert_pem, key_pem, "cluster certificate")?;
        Ok(ClusterTls {
            ca_pem: ca_pem.to_vec(),
            cert_pem: cert_pem.to_vec(),
            key_pem: key_pem.to_vec(),
            ca,
            key,
        })
    }

    /// From the files `--cluster-ca`, `--cluster-cert`, `--cluster-key`.
    pub fn from_files(ca: &Path, cert: &Path, key: &Path) -> Result<ClusterTls, TlsError> {
        Self::from_pem(&read(ca)?, &read(cert)?, &read(key)?)
    }

    /// What a broker's port serves with: its certificate, and a client
    /// certificate of the cluster's CA required of every peer.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        server_config(Arc::new(FixedCert(self.key.clone())), Some(&self.ca))
    }

    /// What a broker or gateway connects to a broker with: the cluster's CA to check
    /// the broker by (its certificate must name the host it is reached at), and
    /// this process's certificate to present.
    pub fn client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
    }
}

/// The URI of a peer at `addr` ("host:port" or a full URI): https with cluster TLS.
pub fn peer_uri(addr: &str, tls: bool) -> String {
    match addr.split_once("://") {
        Some((_, rest)) if tls => format!("https://{rest}"),
        Some(_) => addr.to_string(),
        None if tls => format!("https://{addr}"),
        None => format!("http://{addr}"),
    }
}

/// A connection a server accepted: plain TCP, or TLS over it, holding its place
/// under the server's [`ConnectionLimit`] (if any) until it is dropped.
pub struct ServerIo {
    io: Io,
    _slot: Option<ConnectionSlot>,
}

enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connected for ServerIo {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match &self.io {
            Io::Plain(s) => s.connect_info(),
            Io::Tls(s) => s.get_ref().0.connect_info(),
        }
    }
}

impl AsyncRead for ServerIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ServerIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A bound on the connections a server holds at once, TLS handshakes included. A
/// connection past it is closed as soon as it is accepted: the client sees
/// UNAVAILABLE and tries again (or another server) instead of waiting in a queue,
/// and a flood of connections costs the server a socket for an instant each.
pub struct ConnectionLimit {
    max: usize,
    open: AtomicUsize,
    /// Told of each change of the open count (+1 or -1), e.g. for a gauge.
    on_change: fn(i64),
    /// Told of each connection closed for the bound.
    on_refused: fn(),
}

impl ConnectionLimit {
    /// At most `max` connections; `on_change` and `on_refused` keep the metrics.
    pub fn new(max: usize, on_change: fn(i64), on_refused: fn()) -> Arc<Self> {
        Arc::new(ConnectionLimit {
            max,
            open: AtomicUsize::new(0),
            on_change,
            on_refused,
        })
    }

    /// Connections held now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// A place for one more connection, or `None` (counted as refused) at the bound.
    fn admit(self: &Arc<Self>) -> Option<ConnectionSlot> {
        let admitted = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < self.max).then_some(n + 1)
            })
            .is_ok();
        if !admitted {
            (self.on_refused)();
            return None;
        }
        (self.on_change)(1);
        Some(ConnectionSlot(self.clone()))
    }
}

/// One connection's place under a [`ConnectionLimit`], given back when dropped.
struct ConnectionSlot(Arc<ConnectionLimit>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        (self.0.on_change)(-1);
    }
}

/// The connections `listener` accepts, with TCP_NODELAY set (latency is the
/// product), and with `tls` completed handshakes only: each handshake runs on its
/// own task, so a slow or silent client holds up no one, and one that fails (a
/// plaintext client, a peer without a certificate of the cluster) is dropped with
/// a debug line and counted by `on_refused`. Past `limit` a connection is closed at
/// once (see [`ConnectionLimit`]). Accepting stops on `shutdown` or when the stream
/// is dropped.
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<ServerConfig>>,
    on_refused: fn(),
    limit: Option<Arc<ConnectionLimit>>,
    shutdown: CancellationToken,
) -> ReceiverStream<io::Result<ServerIo>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    tokio::spawn(async move {
        let mut handshakes = tokio::task::JoinSet::new();
        loop {
            let (tcp, peer) = tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tx.closed() => break,
                Some(_) = handshakes.join_next(), if !handshakes.is_empty() => continue,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                        continue;
                    }
                },
            };
            let slot = match &limit {
                Some(limit) => match limit.admit() {
                    Some(slot) => Some(slot),
                    None => {
                        tracing::debug!(%peer, max = limit.max, "connection limit reached; connection closed");
                        continue;
                    }
                },
                None => None,
            };
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY");
            }
            let Some(acceptor) = acceptor.clone() else {
                let io = ServerIo {
                    io: Io::Plain(tcp),
                    _slot: slot,
                };
                if tx.send(Ok(io)).await.is_err() {
                    break;
                }
                continue;
            };
            let tx = tx.clone();
            handshakes.spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => {
                        let io = ServerIo {
                            io: Io::Tls(Box::new(s)),
                            _slot: slot,
                        };
                        let _ = tx.send(Ok(io)).await;
                    }
                    Ok(Err(e)) => {
                        on_refused();
                        tracing::debug!(%peer, error = %e, "TLS handshake failed; connection dropped");
                    }
                    Err(_) => {
                        on_refused();
                        tracing::debug!(%peer, "TLS handshake timed out; connection dropped");
                    }
                }
            });
        }
        handshakes.shutdown().await;
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_uris_are_https_with_cluster_tls() {
        assert_eq!(peer_uri("b1:26501", true), "https://b1:26501");
        assert_eq!(peer_uri("b1:26501", false), "http://b1:26501");
        assert_eq!(peer_uri("http://b1:26501", true), "https://b1:26501");
        assert_eq!(peer_uri("http://b1:26501", false), "http://b1:26501");
    }

    #[test]
    fn bad_pem_says_what_is_wrong() {
        let e = parse_certs(b"not a certificate", "x.pem")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.pem") && e.contains("no CERTIFICATE"), "{e}");
        let e = parse_key(b"", "k.pem").unwrap_err().to_string();
        assert!(
            e.contains("k.pem") && e.contains("no usable private key"),
            "{e}"
        );
    }
}
