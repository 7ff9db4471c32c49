//! The gateways behind a [`Client`](crate::Client): a channel to each, and a choice
//! per call by power of two choices (fewer calls outstanding, then lower recent
//! latency), passing over a gateway that could not be reached a moment ago. No call
//! is pinned to a connection, so load follows gateways as they come and go.
//!
//! An address list is comma-separated. A host name is resolved to all its addresses,
//! each a gateway of its own, and resolved again every [`RESOLVE_EVERY`].

use crate::error::ClientError;
use crate::security::{AuthChannel, Security, TokenSource};
use courier_proto::courier_v1::jobs_client::JobsClient;
use courier_proto::gateway_protocol::gateway_client::GatewayClient;
use courier_proto::headers::GATEWAY_STREAMS_HEADER;
use rand::Rng;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;
use tokio::time::Instant;
use tonic::codegen::http;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
use tonic::Status;

/// Largest answer the client takes: an ActivateJobs answer carries up to 4 MiB of
/// jobs, a GetJob answer a job and its last error message.
const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// How long an `EndStream` call may take.
const END_STREAM_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a gateway that could not be reached is passed over while others can be.
const PASS_OVER_FOR: Duration = Duration::from_secs(5);

/// How fast a gateway's answer time fades while none of its calls is timed.
const LATENCY_HALF_LIFE: Duration = Duration::from_secs(1);

/// How often host names are resolved again, so gateways added behind a name are used.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(30);

/// One gateway: its channel and how its calls have gone.
pub(crate) struct Member {
    /// The address dialled: as given, or a resolved `ip:port`.
    addr: String,
    jobs: JobsClient<AuthChannel>,
    gateway: GatewayClient<AuthChannel>,
    outstanding: AtomicU32,
    /// Moving average of unary answer times in µs; 0 until one is seen.
    latency_us: AtomicU64,
    /// When the average last took a sample, in ms since the pool began.
    sampled_at: AtomicU64,
    /// When it was last found unreachable, in ms since the pool began, plus one; 0: not.
    unreachable_at: AtomicU64,
    /// Job streams it reported holding in its last answer, plus those this client
    /// opened on it since; 0 until it answers.
    streams: AtomicU64,
}

impl Member {
    fn new(addr: String, channel: AuthChannel) -> Member {
        Member {
            addr,
            // A job fits in 4 MiB, but GetJob also carries its last error message,
            // which no limit bounds: tonic's default of 4 MiB would refuse it.
            jobs: JobsClient::new(channel.clone()).max_decoding_message_size(MAX_ANSWER_BYTES),
            gateway: GatewayClient::new(channel).max_decoding_message_size(MAX_ANSWER_BYTES),
            outstanding: AtomicU32::new(0),
            latency_us: AtomicU64::new(0),
            sampled_at: AtomicU64::new(0),
            unreachable_at: AtomicU64::new(0),
            streams: AtomicU64::new(0),
        }
    }

    /// Takes note of the stream count an answer of this gateway reports.
    fn learn(&self, metadata: &tonic::metadata::MetadataMap) {
        let reported = metadata
            .get(GATEWAY_STREAMS_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(n) = reported {
            self.streams.store(n, Ordering::Relaxed);
        }
    }

    fn pass_over(&self, pool: &Pool) {
        self.unreachable_at
            .store(pool.now_ms() + 1, Ordering::Relaxed);
    }

    fn passed_over(&self, now_ms: u64) -> bool {
        let at = self.unreachable_at.load(Ordering::Relaxed);
        at != 0 && now_ms.saturating_sub(at - 1) < PASS_OVER_FOR.as_millis() as u64
    }

    /// Lower is better: calls outstanding (this one included) times the usual answer
    /// time, so a slow gateway gets fewer calls and an idle one more. The answer time
    /// fades the longer no call was timed, so a gateway passed over for one slow
    /// answer (a connection being set up) is tried again.
    fn cost(&self, now_ms: u64) -> f64 {
        let outstanding = f64::from(self.outstanding.load(Ordering::Relaxed)) + 1.0;
        let idle = now_ms.saturating_sub(self.sampled_at.load(Ordering::Relaxed));
        let fade = 0.5f64.powf(idle as f64 / LATENCY_HALF_LIFE.as_millis() as f64);
        let latency = self.latency_us.load(Ordering::Relaxed) as f64 * fade;
        outstanding * latency.max(100.0)
    }
}

struct Pool {
    members: RwLock<Arc<Vec<Arc<Member>>>>,
    began: Instant,
}

impl Pool {
    fn now_ms(&self) -> u64 {
        self.began.elapsed().as_millis() as u64
    }

    fn members(&self) -> Arc<Vec<Arc<Member>>> {
        self.members
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// The gateways of a client; clones share them.
#[derive(Clone)]
pub(crate) struct Gateways {
    pool: Arc<Pool>,
}

impl std::fmt::Debug for Gateways {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.pool.members().iter().map(|m| &m.addr))
            .finish()
    }
}

/// A gateway chosen for one call; counts as outstanding on it until dropped.
pub(crate) struct Picked {
    member: Arc<Member>,
    pool: Arc<Pool>,
    started: Instant,
}

impl Picked {
    pub(crate) fn jobs(&self) -> JobsClient<AuthChannel> {
        self.member.jobs.clone()
    }

    pub(crate) fn gateway(&self) -> GatewayClient<AuthChannel> {
        self.member.gateway.clone()
    }

    /// Records how the call went: a gateway that could not be reached is passed over
    /// for a while; an answer clears that, tells how many streams the gateway holds
    /// and, when `timed` (a unary call, not a long poll or a stream), feeds the
    /// latency average.
    pub(crate) fn record<T: Answer>(&self, outcome: &Result<T, Status>, timed: bool) {
        match outcome {
            Err(s) if unreachable(s) => self.member.pass_over(&self.pool),
            _ => {
                self.member.unreachable_at.store(0, Ordering::Relaxed);
                let metadata = match outcome {
                    Ok(answer) => answer.metadata(),
                    Err(status) => Some(status.metadata()),
                };
                if let Some(m) = metadata {
                    self.member.learn(m);
                }
                if timed {
                    let took = self.started.elapsed().as_micros() as u64;
                    let old = self.member.latency_us.load(Ordering::Relaxed);
                    let new = if old == 0 { took } else { (old * 7 + took) / 8 };
                    self.member.latency_us.store(new.max(1), Ordering::Relaxed);
                    let now = self.pool.now_ms();
                    self.member.sampled_at.store(now, Ordering::Relaxed);
                }
            }
        }
    }

    /// The gateway a stream was opened on, for as long as the stream lives; counts
    /// the stream on it at once, before its next answer says so.
    pub(crate) fn stream_opened(&self) -> StreamGateway {
        self.member.streams.fetch_add(1, Ordering::Relaxed);
        StreamGateway {
            member: self.member.clone(),
            pool: self.pool.clone(),
        }
    }

    /// Passes this gateway over for a while: it refused for reasons of its own
    /// (shutting down, or at a bound).
    pub(crate) fn pass_over(&self) {
        self.member.pass_over(&self.pool);
    }
}

/// What a call answered, as [`Picked::record`] reads it.
pub(crate) trait Answer {
    fn metadata(&self) -> Option<&tonic::metadata::MetadataMap>;
}

impl<T> Answer for tonic::Response<T> {
    fn metadata(&self) -> Option<&tonic::metadata::MetadataMap> {
        Some(tonic::Response::metadata(self))
    }
}

impl Answer for () {
    fn metadata(&self) -> Option<&tonic::metadata::MetadataMap> {
        None
    }
}

/// The gateway a job stream is open on.
pub(crate) struct StreamGateway {
    member: Arc<Member>,
    pool: Arc<Pool>,
}

impl StreamGateway {
    /// The address dialled.
    pub(crate) fn addr(&self) -> &str {
        &self.member.addr
    }

    /// Passes the gateway over for a while: the stream stalled on it, or it said
    /// it is leaving.
    pub(crate) fn pass_over(&self) {
        self.member.pass_over(&self.pool);
    }

    /// Asks this gateway to end its stream `id` after the jobs it already sent;
    /// true when it did.
    pub(crate) async fn end_stream(&self, id: u64) -> bool {
        let mut jobs = self.member.jobs.clone();
        let mut request =
            tonic::Request::new(courier_proto::courier_v1::EndStreamRequest { stream_id: id });
        request.set_timeout(END_STREAM_TIMEOUT);
        match jobs.end_stream(request).await {
            Ok(r) => r.into_inner().ended,
            Err(s) => {
                tracing::debug!(code = ?s.code(), message = s.message(), "EndStream failed");
                false
            }
        }
    }

    /// Tells this gateway every `every` (the stream's heartbeat) that stream `id` is
    /// read, through the same connection: when that connection stops carrying
    /// anything, the gateway notices and gives the stream's jobs back. Runs until
    /// dropped, or until the gateway no longer knows the stream.
    pub(crate) fn say_alive(
        &self,
        id: u64,
        every: Duration,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut jobs = self.member.jobs.clone();
        async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let mut request =
                    tonic::Request::new(courier_proto::courier_v1::StreamAliveRequest {
                        stream_id: id,
                    });
                request.set_timeout(every);
                match jobs.stream_alive(request).await {
                    Ok(r) if !r.get_ref().open => return,
                    Ok(_) => {}
                    // A gateway without StreamAlive never will have it.
                    Err(s) if s.code() == tonic::Code::Unimplemented => return,
                    Err(_) => {}
                }
            }
        }
    }

    /// Takes note of how the stream broke: a gateway that is gone is passed over.
    pub(crate) fn broke(&self, status: &Status) {
        if unreachable(status) {
            self.pass_over();
        }
    }
}

impl Drop for Picked {
    fn drop(&mut self) {
        self.member.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether `status` says the gateway was not reached (connection refused or lost),
/// rather than answered: the transport's own errors carry their cause.
fn unreachable(status: &Status) -> bool {
    if crate::retry::never_sent(status) {
        return true;
    }
    // A transport error breaks a call as UNAVAILABLE, or as UNKNOWN when the
    // connection died under it (a broken pipe): either way the gateway is gone.
    if !matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown
    ) {
        return false;
    }
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if e.is::<tonic::transport::Error>() || e.is::<hyper::Error>() || e.is::<std::io::Error>() {
            return true;
        }
        source = e.source();
    }
    false
}

impl Gateways {
    /// The gateways at `addrs` (comma-separated) under `security`; connects lazily.
    /// Host names are resolved in the background, at once and then periodically.
    pub(crate) fn connect(addrs: &str, security: &Security) -> Result<Gateways, ClientError> {
        let targets = addrs
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(Target::parse)
            .collect::<Result<Vec<_>, _>>()?;
        if targets.is_empty() {
            return Err(connect_error(addrs, "no gateway address given"));
        }
        let tls_ca = match &security.tls_ca {
            Some(path) => Some(std::fs::read(path).map_err(|e| {
                connect_error(
                    addrs,
                    format!("cannot read the TLS CA file {}: {e}", path.display()),
                )
            })?),
            None => None,
        };
        let tokens =
            TokenSource::new(&security.credentials).map_err(|e| connect_error(addrs, e))?;
        // A channel spawns its worker task at once; without a runtime that panics.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(connect_error(addrs, "not inside a Tokio runtime"));
        }
        let dialer = Dialer { tls_ca, tokens };
        let mut members = Vec::with_capacity(targets.len());
        for t in &targets {
            let endpoint = dialer.endpoint(t, None, addrs)?;
            members.push(Arc::new(Member::new(
                t.given.clone(),
                dialer.channel(endpoint),
            )));
        }
        let gateways = Gateways::from_members(members);
        if targets.iter().any(|t| t.ip().is_none()) {
            tokio::spawn(resolve(Arc::downgrade(&gateways.pool), targets, dialer));
        }
        Ok(gateways)
    }

    /// One gateway over a channel built elsewhere.
    pub(crate) fn single(channel: AuthChannel) -> Gateways {
        Gateways::from_members(vec![Arc::new(Member::new("channel".into(), channel))])
    }

    fn from_members(members: Vec<Arc<Member>>) -> Gateways {
        Gateways {
            pool: Arc::new(Pool {
                members: RwLock::new(Arc::new(members)),
                began: Instant::now(),
            }),
        }
    }

    /// Gateways known now.
    pub(crate) fn count(&self) -> usize {
        self.pool.members().len()
    }

    /// The addresses of the gateways not passed over now.
    pub(crate) fn live_addresses(&self) -> Vec<String> {
        let now = self.pool.now_ms();
        self.pool
            .members()
            .iter()
            .filter(|m| !m.passed_over(now))
            .map(|m| m.addr.clone())
            .collect()
    }

    /// The addresses dialled, in order.
    pub(crate) fn addresses(&self) -> Vec<String> {
        self.pool.members().iter().map(|m| m.addr.clone()).collect()
    }

    /// The gateway for a job stream. Clients spread streams without a coordinator:
    /// each gateway's share is judged by the stream counts its answers report.
    /// Reopening a stream that `from` ended at its age, a client stays unless that
    /// gateway holds more than a fair share, and then leaves with probability
    /// excess / count, so that together clients move about the excess and no more
    /// (all leaving at once would only pile onto the next gateway). A stream that
    /// moves, or is new, goes to a gateway drawn with weight 1 + its deficit below
    /// the fair share: the lightest are likeliest, yet clients acting on the same
    /// counts do not all land on one. Gateways in `avoid` (those of the same
    /// worker's other streams) are taken only when no other is live.
    pub(crate) fn pick_for_stream(&self, from: Option<&StreamGateway>, avoid: &[String]) -> Picked {
        let members = self.pool.members();
        let now = self.pool.now_ms();
        let mut live: Vec<&Arc<Member>> = members.iter().filter(|m| !m.passed_over(now)).collect();
        if live.is_empty() {
            return self.pick();
        }
        if live.iter().any(|m| !avoid.contains(&m.addr)) {
            live.retain(|m| !avoid.contains(&m.addr));
        }
        let count = |m: &Member| m.streams.load(Ordering::Relaxed) as f64;
        let fair = live.iter().map(|m| count(m)).sum::<f64>() / live.len() as f64;
        let mut rng = rand::rng();
        if let Some(from) = from.filter(|f| live.iter().any(|m| Arc::ptr_eq(m, &f.member))) {
            let c = count(&from.member);
            if live.len() == 1 || c <= fair + 1.0 || rng.random::<f64>() >= (c - fair) / c {
                return self.picked(from.member.clone());
            }
            live.retain(|m| !Arc::ptr_eq(m, &from.member));
        }
        let weights: Vec<f64> = live
            .iter()
            .map(|m| (fair - count(m)).max(0.0) + 1.0)
            .collect();
        let mut draw = rng.random::<f64>() * weights.iter().sum::<f64>();
        let mut chosen = live[live.len() - 1];
        for (m, w) in live.iter().zip(&weights) {
            if draw < *w {
                chosen = m;
                break;
            }
            draw -= w;
        }
        self.picked(chosen.clone())
    }

    fn picked(&self, member: Arc<Member>) -> Picked {
        member.outstanding.fetch_add(1, Ordering::Relaxed);
        Picked {
            member,
            pool: self.pool.clone(),
            started: Instant::now(),
        }
    }

    /// The gateway for the next call: the better of two drawn at random, passing
    /// over those found unreachable a moment ago while any other is not.
    pub(crate) fn pick(&self) -> Picked {
        let members = self.pool.members();
        let now = self.pool.now_ms();
        let n = members.len();
        let mut rng = rand::rng();
        let member = if n == 1 {
            members[0].clone()
        } else {
            let a = rng.random_range(0..n);
            let mut b = rng.random_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            let (a, b) = (&members[a], &members[b]);
            match (a.passed_over(now), b.passed_over(now)) {
                (false, true) => a.clone(),
                (true, false) => b.clone(),
                (false, false) => {
                    if b.cost(now) < a.cost(now) {
                        b.clone()
                    } else {
                        a.clone()
                    }
                }
                (true, true) => {
                    // Both were unreachable: any that is not, from a random start.
                    let start = rng.random_range(0..n);
                    (0..n)
                        .map(|i| &members[(start + i) % n])
                        .find(|m| !m.passed_over(now))
                        .unwrap_or(a)
                        .clone()
                }
            }
        };
        self.picked(member)
    }
}

/// Resolves the host names among `targets` now and every [`RESOLVE_EVERY`], making
/// each address a gateway (those already known keep their channels), until the
/// client is dropped. A name that does not resolve keeps the gateways it had.
async fn resolve(pool: Weak<Pool>, targets: Vec<Target>, dialer: Dialer) {
    // What each target dials: its addresses as last resolved, at first as given.
    let mut last: Vec<Vec<(String, Option<SocketAddr>)>> = targets
        .iter()
        .map(|t| vec![(t.given.clone(), None)])
        .collect();
    loop {
        let mut resolved = Vec::with_capacity(targets.len());
        for t in &targets {
            let addrs = match t.ip() {
                Some(_) => None,
                None => match tokio::net::lookup_host((t.host.as_str(), t.port)).await {
                    Ok(found) => {
                        let mut found: Vec<SocketAddr> = found.collect();
                        found.sort();
                        found.dedup();
                        Some(found).filter(|f| !f.is_empty())
                    }
                    Err(e) => {
                        tracing::debug!(host = %t.host, error = %e, "gateway name did not resolve");
                        None
                    }
                },
            };
            resolved.push(addrs);
        }
        let Some(pool) = pool.upgrade() else {
            return;
        };
        let old = pool.members();
        let mut next: Vec<Arc<Member>> = Vec::new();
        for ((t, found), dial) in targets.iter().zip(resolved).zip(last.iter_mut()) {
            if let Some(found) = found {
                *dial = found
                    .into_iter()
                    .map(|a| (a.to_string(), Some(a)))
                    .collect();
            }
            for (addr, ip) in dial.iter() {
                if next.iter().any(|m| &m.addr == addr) {
                    continue;
                }
                if let Some(m) = old.iter().find(|m| &m.addr == addr) {
                    next.push(m.clone());
                    continue;
                }
                match dialer.endpoint(t, *ip, &t.given) {
                    Ok(e) => next.push(Arc::new(Member::new(addr.clone(), dialer.channel(e)))),
                    Err(e) => tracing::warn!(error = %e, "cannot dial a resolved gateway"),
                }
            }
        }
        if !next.is_empty() {
            let changed = next.len() != old.len()
                || next.iter().zip(old.iter()).any(|(a, b)| a.addr != b.addr);
            if changed {
                tracing::debug!(gateways = ?next.iter().map(|m| &m.addr).collect::<Vec<_>>(), "gateways resolved");
                *pool.members.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(next);
            }
        }
        drop(pool);
        tokio::time::sleep(RESOLVE_EVERY).await;
    }
}

/// One address as given: `host:port`, `http://host:port` or `https://host:port`.
#[derive(Clone, Debug)]
struct Target {
    given: String,
    https: bool,
    /// The host as in a URI (an IPv6 address in brackets).
    host: String,
    port: u16,
}

impl Target {
    fn parse(addr: &str) -> Result<Target, ClientError> {
        let (https, rest) = match addr.split_once("://") {
            None => (None, addr),
            Some(("http", rest)) => (Some(false), rest),
            Some(("https", rest)) => (Some(true), rest),
            Some((scheme, _)) => {
                return Err(connect_error(
                    addr,
                    format!(
                        "unsupported scheme {scheme}:// (use host:port, http://host:port or https://host:port)"
                    ),
                ))
            }
        };
        let uri: http::Uri = format!("http://{rest}")
            .parse()
            .map_err(|e| connect_error(addr, e))?;
        // Without an explicit port the URI would mean port 80, never a gateway.
        let (Some(host), Some(port)) = (uri.host().filter(|h| !h.is_empty()), uri.port_u16())
        else {
            return Err(connect_error(addr, "expected host:port"));
        };
        if uri.path() != "/" && !uri.path().is_empty() {
            return Err(connect_error(addr, "expected host:port"));
        }
        Ok(Target {
            given: addr.to_string(),
            // Without a scheme: TLS when a CA is given (decided when dialling).
            https: https.unwrap_or(false),
            host: host.to_string(),
            port,
        })
    }

    fn ip(&self) -> Option<IpAddr> {
        self.host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .ok()
    }
}

/// What every channel of a client shares: its TLS root and its tokens.
struct Dialer {
    tls_ca: Option<Vec<u8>>,
    tokens: Option<Arc<TokenSource>>,
}

impl Dialer {
    fn channel(&self, endpoint: Endpoint) -> AuthChannel {
        AuthChannel::new(endpoint.connect_lazy(), self.tokens.clone())
    }

    /// The endpoint of `t`, or of its resolved address `ip` (TLS still checks the
    /// certificate against `t`'s host name).
    fn endpoint(
        &self,
        t: &Target,
        ip: Option<SocketAddr>,
        given: &str,
    ) -> Result<Endpoint, ClientError> {
        let explicit_http = t.given.starts_with("http://");
        if explicit_http && self.tls_ca.is_some() {
            return Err(connect_error(
                given,
                "a TLS CA is given but the address says http://: use https:// or host:port",
            ));
        }
        let https = t.https || (self.tls_ca.is_some() && !explicit_http);
        let authority = match ip {
            Some(a) => a.to_string(),
            None => format!("{}:{}", t.host, t.port),
        };
        let scheme = if https { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{authority}"))
            .map_err(|e| connect_error(given, e))?;
        if https {
            let tls = match &self.tls_ca {
                Some(pem) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)),
                None => ClientTlsConfig::new().with_native_roots(),
            };
            let tls = if ip.is_some() {
                tls.domain_name(t.host.clone())
            } else {
                tls
            };
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| connect_error(given, e))?;
        }
        Ok(endpoint
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            // Pings find a dead connection (a gateway that vanished without a FIN)
            // before a long poll or stream waits on it forever. 30 s is the least
            // interval Zeebe gateways accept.
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true))
    }
}

/// A channel for `addr` built the way every client's are, for tests.
#[cfg(test)]
pub(crate) fn endpoint(addr: &str) -> Result<Endpoint, ClientError> {
    let t = Target::parse(addr.trim())?;
    Dialer {
        tls_ca: None,
        tokens: None,
    }
    .endpoint(&t, None, addr)
}

/// A channel to nothing in particular, for tests that need a [`Gateways`].
#[cfg(test)]
pub(crate) fn lazy(addr: &str) -> tonic::transport::Channel {
    endpoint(addr)
        .map(|e| e.connect_lazy())
        .unwrap_or_else(|e| panic!("{e}"))
}

pub(crate) fn connect_error(addr: &str, reason: impl ToString) -> ClientError {
    ClientError::Connect {
        addr: addr.to_string(),
        reason: reason.to_string(),
    }
}

#[cfg(test)]
#[path = "gateways_tests.rs"]
mod tests;
