//! Sends a request to the leader of a partition, retrying while the partition is
//! between leaders or its leader is unreachable, until the request's deadline.

use crate::metrics;
use crate::topology::Topology;
use courier_proto::backoff::Backoff;
use courier_proto::cluster::{ExecuteReply, ExecuteRequest};
use courier_proto::codec;
use courier_proto::domain::{
    BrokerError, Command, NodeId, PartitionId, Reply, Request, RESEND_FOR_MS,
};
use courier_proto::mux::{CallError, Mux};
use courier_proto::sync::lock;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

const RETRY_BASE: Duration = Duration::from_millis(10);
const RETRY_CAP: Duration = Duration::from_millis(500);
/// A partition without a known leader for this long is not between two leaders (an
/// election takes about a second) but in an outage, most likely without a majority:
/// requests for it are answered at once (UNAVAILABLE, which clients retry) rather
/// than held until their deadline.
pub const LEADERLESS_OUTAGE: Duration = Duration::from_secs(4);
/// No deadline lies further out than this, so adding a client's timeout to `now`
/// can never overflow.
const FAR_FUTURE: Duration = Duration::from_secs(365 * 24 * 3600);

/// Why a routed request failed in the end.
#[derive(Debug)]
pub struct RouteFailure {
    /// What the client is told.
    pub error: BrokerError,
    /// True when every attempt failed before a leader could act on it: refused as
    /// NotLeader, no leader known, or connection refused. Only then may the same
    /// request go to a different partition without risk of applying it twice.
    pub not_applied: bool,
}

/// The outcome of one attempt that did not produce a broker answer.
enum Failed {
    /// No leader known for the partition, or no address for it.
    NoLeader,
    /// The connection could not be made: the request was never sent.
    Unreachable(String),
    /// The request may have been sent: the call failed or timed out midway.
    Transport(String),
    /// The request was sent to a leader that another broker has replaced since,
    /// and it has not answered (see [`Router::unless_deposed`]): it may have been
    /// applied, by the new leader if the old one replicated it in time.
    Deposed(String),
    /// The broker's answer could not be understood, or it failed in a way that
    /// retrying does not fix.
    Fatal(String),
}

/// The command stream to one broker.
type Commands = Mux<ExecuteRequest, ExecuteReply>;

/// Routes requests to partition leaders, on one command stream per broker.
#[derive(Clone)]
pub struct Router {
    topology: Arc<Topology>,
    /// Sent with every command stream (see [`courier_proto::GATEWAY_ID_HEADER`]).
    gateway_id: Arc<str>,
    /// Cancelled when the gateway stops serving clients: retries stop then.
    clients: CancellationToken,
    /// Cancelled when the gateway's own tasks stop: the command streams end then,
    /// after the last give-back.
    stop: CancellationToken,
    /// By broker address.
    streams: Arc<Mutex<HashMap<String, Arc<Commands>>>>,
}

impl Router {
    /// A router over `topology`; retries stop on `clients`, command streams on `stop`.
    pub fn new(
        topology: Arc<Topology>,
        gateway_id: &str,
        clients: CancellationToken,
        stop: CancellationToken,
    ) -> Self {
        Router {
            topology,
            gateway_id: Arc::from(gateway_id),
            clients,
            stop,
            streams: Arc::default(),
        }
    }

    /// The command stream to the broker at `addr` (opened by its first call).
    fn commands(&self, addr: &str) -> Arc<Commands> {
        let mut streams = lock(&self.streams);
        streams
            .entry(addr.to_string())
            .or_insert_with(|| Arc::new(Mux::new(self.stop.clone())))
            .clone()
    }

    /// Runs `request` on `partition`'s leader, retrying until `deadline`.
    pub async fn execute(
        &self,
        partition: PartitionId,
        request: &Request,
        deadline: Instant,
    ) -> Result<Reply, BrokerError> {
        self.execute_in(partition, request, None, deadline).await
    }

    /// [`Router::execute`] for a caller limited to `tenants` (when given): the
    /// broker treats a job of another tenant as one that does not exist.
    pub async fn execute_in(
        &self,
        partition: PartitionId,
        request: &Request,
        tenants: Option<&[String]>,
        deadline: Instant,
    ) -> Result<Reply, BrokerError> {
        self.route(partition, request, tenants, deadline, deadline)
            .await
            .map_err(|f| f.error)
    }

    /// Like [`Router::execute`], but starts no new attempt after `retry_until`
    /// (an attempt in flight still runs until `deadline`), and says whether the
    /// request can have been applied. Once it may have been (an attempt's answer
    /// was lost), it is retried here until `deadline`: the caller could not move
    /// it elsewhere without doing it twice, so it waits out the failover. A
    /// [`Command::Once`] is sent again for at most [`RESEND_FOR_MS`] from now,
    /// while partitions still remember its id.
    pub async fn execute_until(
        &self,
        partition: PartitionId,
        request: &Request,
        retry_until: Instant,
        deadline: Instant,
    ) -> Result<Reply, RouteFailure> {
        self.route(partition, request, None, retry_until, deadline)
            .await
    }

    async fn route(
        &self,
        partition: PartitionId,
        request: &Request,
        tenants: Option<&[String]>,
        retry_until: Instant,
        deadline: Instant,
    ) -> Result<Reply, RouteFailure> {
        let execute = ExecuteRequest {
            scope: tenants.map(|t| courier_proto::cluster::TenantScope {
                tenants: t.to_vec(),
            }),
            partition_id: partition.0,
            // Another partition would fail the same way: not worth moving on for.
            request: codec::encode(request).map_err(|e| RouteFailure {
                error: BrokerError::Internal(e.to_string()),
                not_applied: false,
            })?,
            id: 0,
        };
        let resend_until = match request {
            Request::Command(Command::Once { .. }) => {
                deadline.min(instant_after(Duration::from_millis(RESEND_FOR_MS)))
            }
            _ => deadline,
        };
        let mut backoff = Backoff::new(RETRY_BASE, RETRY_CAP).attempts();
        // A retry waiting for a leader goes as soon as the gateway learns of one
        // (watched from the first failure on: most commands need no retry).
        let mut leader_changes = None;
        let mut not_applied = true;
        // An attempt's answer was lost where its command may have been applied.
        let mut maybe_applied = false;
        loop {
            let (reason, last) = match self.attempt(partition, &execute, deadline).await {
                Ok(Ok(reply)) => return Ok(reply),
                Ok(Err(BrokerError::NotLeader { leader, .. })) => {
                    ("not_leader", format!("not leader (hint: {leader:?})"))
                }
                Ok(Err(e @ BrokerError::Unavailable(_))) => {
                    not_applied = false;
                    maybe_applied = true;
                    ("unavailable", e.to_string())
                }
                // Refused before it was queued, by a leader that will not commit
                // anything until its majority is back: no use waiting on it.
                Ok(Err(e @ BrokerError::NoMajority(_))) => {
                    return Err(RouteFailure {
                        error: unsettled(request, maybe_applied, e),
                        not_applied,
                    })
                }
                Ok(Err(e @ BrokerError::ResourceExhausted(_))) => {
                    not_applied = false;
                    ("resource_exhausted", e.to_string())
                }
                Ok(Err(e)) => {
                    if let Some(reply) = settled_earlier(request, maybe_applied, &e) {
                        tracing::info!(%partition, "a retry found its command's work done by an earlier attempt");
                        return Ok(reply);
                    }
                    return Err(RouteFailure {
                        error: e,
                        not_applied: false,
                    });
                }
                Err(Failed::NoLeader) => {
                    if let Some(d) = self
                        .topology
                        .leaderless_for(partition)
                        .filter(|d| *d >= LEADERLESS_OUTAGE)
                    {
                        let e = BrokerError::NoMajority(format!(
                            "partition {partition} has had no leader for {} s: too few \
                             of its replicas are up to elect one",
                            d.as_secs()
                        ));
                        return Err(RouteFailure {
                            error: unsettled(request, maybe_applied, e),
                            not_applied,
                        });
                    }
                    ("no_leader", "no leader known".to_string())
                }
                Err(Failed::Unreachable(m)) => ("unreachable", m),
                Err(Failed::Transport(m)) => {
                    not_applied = false;
                    maybe_applied = true;
                    ("transport", m)
                }
                Err(Failed::Deposed(m)) => {
                    not_applied = false;
                    maybe_applied = true;
                    ("deposed", m)
                }
                Err(Failed::Fatal(m)) => {
                    return Err(RouteFailure {
                        error: BrokerError::Internal(m),
                        not_applied: false,
                    })
                }
            };
            let wake = Instant::now() + backoff.next_delay();
            let until = if maybe_applied {
                resend_until
            } else {
                retry_until
            };
            if wake >= until.min(deadline) || self.clients.is_cancelled() {
                tracing::debug!(%partition, reason, last, "giving up");
                return Err(RouteFailure {
                    error: unsettled(request, maybe_applied, given_up(partition, reason, last)),
                    not_applied,
                });
            }
            metrics::broker_retry(reason);
            tracing::trace!(%partition, reason, last, "retrying");
            let changes = leader_changes.get_or_insert_with(|| self.topology.leader_changes());
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = changes.changed() => {}
                _ = self.clients.cancelled() => {}
            }
        }
    }

    /// One attempt against the leader as currently known. The outer `Result` is the
    /// routing, the inner one the broker's answer.
    async fn attempt(
        &self,
        partition: PartitionId,
        execute: &ExecuteRequest,
        deadline: Instant,
    ) -> Result<Result<Reply, BrokerError>, Failed> {
        let Some(node) = self.topology.leader(partition) else {
            self.topology.request_refresh();
            return Err(Failed::NoLeader);
        };
        let Some((broker, addr)) = self
            .topology
            .node_addr(node)
            .and_then(|addr| Some((self.topology.broker(&addr)?, addr)))
        else {
            self.topology.request_refresh();
            return Err(Failed::NoLeader);
        };
        let gateway_id = self.gateway_id.clone();
        let open = |requests: ReceiverStream<ExecuteRequest>| async move {
            broker.execute(Some(gateway_id), Box::pin(requests)).await
        };
        // Cloning shares the encoded payload (`Bytes`), it does not copy it.
        let commands = self.commands(&addr);
        let call = commands.call(open, execute.clone(), deadline);
        let Some(reply) = self.unless_deposed(partition, node, call).await else {
            return Err(Failed::Deposed(format!(
                "broker {node} no longer leads partition {partition} and has not answered"
            )));
        };
        let reply = match reply {
            Ok(reply) => reply,
            Err(CallError::Open(status)) => return Err(self.classify(node, &status)),
            Err(CallError::NotSent) => {
                self.topology.request_refresh();
                return Err(Failed::Unreachable(format!(
                    "broker {node}: the command stream had ended"
                )));
            }
            Err(CallError::Lost) => {
                self.topology.request_refresh();
                return Err(Failed::Transport(format!(
                    "broker {node}: the command stream ended before the reply"
                )));
            }
            Err(CallError::TimedOut) => {
                return Err(Failed::Transport(format!("broker {node} timed out")))
            }
        };
        if !reply.error.is_empty() {
            let status = tonic::Status::new(tonic::Code::from(reply.error_code), reply.error);
            return Err(self.classify(node, &status));
        }
        let answer: Result<Reply, BrokerError> = codec::decode(&reply.reply)
            .map_err(|e| Failed::Fatal(format!("broker {node} sent a bad reply: {e}")))?;
        if let Err(BrokerError::NotLeader { leader, .. }) = &answer {
            self.topology.hint(partition, node, *leader);
            if leader.is_none() {
                self.topology.request_refresh();
            }
        }
        Ok(answer)
    }

    /// Awaits `call` to `node`, unless the gateway learns meanwhile that another
    /// broker leads `partition` (`None`). A leader that froze or was cut off from the
    /// gateway may not answer for as long as that lasts, where its successor,
    /// elected in about a second, answers at once.
    async fn unless_deposed<F: std::future::Future>(
        &self,
        partition: PartitionId,
        node: NodeId,
        call: F,
    ) -> Option<F::Output> {
        let mut changes = self.topology.leader_changes();
        tokio::pin!(call);
        loop {
            tokio::select! {
                biased;
                reply = &mut call => return Some(reply),
                changed = changes.changed() => {
                    if changed.is_err() {
                        return Some(call.await);
                    }
                    if self.topology.leader(partition).is_some_and(|l| l != node) {
                        return None;
                    }
                }
            }
        }
    }

    fn classify(&self, node: NodeId, status: &tonic::Status) -> Failed {
        let what = format!("broker {node}: {:?}: {}", status.code(), status.message());
        // The leader may have died: learn who leads now rather than in a full round.
        self.topology.request_refresh();
        if is_connect_error(status) {
            return Failed::Unreachable(what);
        }
        use tonic::Code::*;
        match status.code() {
            Unavailable | Unknown | Internal | Cancelled | Aborted | DeadlineExceeded => {
                Failed::Transport(what)
            }
            // The broker's gRPC layer refused the call itself (too large, not served):
            // the same call would be refused again.
            _ => Failed::Fatal(what),
        }
    }
}

/// Whether the call failed while connecting, i.e. before anything was sent.
fn is_connect_error(status: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(e) = source {
        if e.is::<tonic::ConnectError>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// The deadline of an incoming request: its `grpc-timeout` if it has a valid one,
/// else `default` from now.
pub fn request_deadline(metadata: &tonic::metadata::MetadataMap, default: Duration) -> Instant {
    instant_after(stated_timeout(metadata).unwrap_or(default))
}

/// The request's valid `grpc-timeout`, if it has one.
pub fn stated_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    metadata
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_grpc_timeout)
}

/// `now + d`, saturating at a year from now.
pub fn instant_after(d: Duration) -> Instant {
    Instant::now() + d.min(FAR_FUTURE)
}

/// Parses a `grpc-timeout` header value: up to 8 ASCII digits and a unit, one of
/// `H` `M` `S` `m` `u` `n` (hours down to nanoseconds).
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let digits = value.get(..value.len().checked_sub(1)?)?;
    let unit = value.get(digits.len()..)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The answer to a retried command whose earlier attempt may have been applied (its
/// answer was lost with the leader that took it) and whose retry finds the job gone:
/// a CompleteJob or a Cancel did its work then, so it succeeded. Without this, a
/// worker whose completion landed just before a failover is told NOT_FOUND.
fn settled_earlier(request: &Request, maybe_applied: bool, error: &BrokerError) -> Option<Reply> {
    let ends_the_job = matches!(
        request,
        Request::Command(Command::Complete { .. } | Command::Cancel { .. })
    );
    (maybe_applied && ends_the_job && matches!(error, BrokerError::NotFound(_)))
        .then_some(Reply::Done)
}

/// The error for a command given up on after an attempt whose answer was lost: a
/// "not now" (UNAVAILABLE, RESOURCE_EXHAUSTED) would tell the client to send it
/// again, but the lost attempt may yet be applied (a completion sent again would
/// then be refused as NOT_FOUND, a fail would fail the job's next run). The client
/// is told the outcome is unknown instead. An activation is left as it is: the
/// jobs of a lost one come back after their timeout, and the caller polls again.
fn unsettled(request: &Request, maybe_applied: bool, error: BrokerError) -> BrokerError {
    let command = match request {
        Request::Command(c) => c.inner(),
        _ => return error,
    };
    if !maybe_applied || command.activation().is_some() || !error.is_retryable() {
        return error;
    }
    let what = match command {
        Command::Create(_) => "the job may have been created: look for it before creating it again",
        _ => {
            "an earlier attempt may have been carried out, its answer was lost: look before \
              sending it again"
        }
    };
    BrokerError::OutcomeUnknown(format!("{error}; {what}"))
}

/// The error a request gets when its retries run out, from the reason of the last
/// attempt. Back pressure stays back pressure (RESOURCE_EXHAUSTED), so the client backs
/// off and retries as it would against Zeebe; anything else is UNAVAILABLE.
fn given_up(partition: PartitionId, reason: &str, last: String) -> BrokerError {
    if reason == "resource_exhausted" {
        BrokerError::ResourceExhausted(last)
    } else {
        BrokerError::Unavailable(format!("partition {partition} is unavailable: {last}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_whose_earlier_attempt_may_have_landed_is_done_when_the_job_is_gone() {
        use courier_proto::domain::JobKey;
        let complete = Request::Command(Command::Complete {
            key: JobKey(1 << 51),
            variables: None,
        });
        let cancel = Request::Command(Command::Cancel {
            key: JobKey(1 << 51),
        });
        let fail = Request::Command(Command::Fail {
            key: JobKey(1 << 51),
            retries: 1,
            error_message: String::new(),
            retry_backoff_ms: 0,
            variables: None,
        });
        let gone = BrokerError::NotFound("no such job".into());
        assert_eq!(settled_earlier(&complete, true, &gone), Some(Reply::Done));
        assert_eq!(settled_earlier(&cancel, true, &gone), Some(Reply::Done));
        // No attempt can have landed: the job was never there (or ended elsewhere).
        assert_eq!(settled_earlier(&complete, false, &gone), None);
        // A failed job is still there: NOT_FOUND after a fail means something else.
        assert_eq!(settled_earlier(&fail, true, &gone), None);
        let busy = BrokerError::FailedPrecondition("not activated".into());
        assert_eq!(settled_earlier(&complete, true, &busy), None);
    }

    #[test]
    fn a_command_given_up_after_a_lost_answer_has_an_unknown_outcome() {
        use courier_proto::domain::{ActivationProps, JobKey};
        let complete = Request::Command(Command::Complete {
            key: JobKey(1 << 51),
            variables: None,
        });
        let down = || BrokerError::Unavailable("partition 1 is unavailable".into());
        let e = unsettled(&complete, true, down());
        assert!(matches!(e, BrokerError::OutcomeUnknown(_)), "{e:?}");
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::DeadlineExceeded);
        let e = unsettled(&complete, true, BrokerError::NoMajority("no leader".into()));
        assert!(matches!(e, BrokerError::OutcomeUnknown(_)), "{e:?}");
        let create = Request::Command(Command::Create(vec![]));
        let status = tonic::Status::from(unsettled(
            &create,
            true,
            BrokerError::Unavailable("broker 3 timed out".into()),
        ));
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
        assert!(
            status.message().contains("broker 3 timed out")
                && status.message().contains("may have been created"),
            "{}",
            status.message()
        );
        let bad = BrokerError::InvalidArgument("bad variables".into());
        assert_eq!(unsettled(&create, true, bad.clone()), bad);
        // Nothing was sent that could have landed: the client may send it again.
        assert_eq!(unsettled(&complete, false, down()), down());
        // A refusal is the answer itself.
        let gone = BrokerError::NotFound("no such job".into());
        assert_eq!(unsettled(&complete, true, gone.clone()), gone);
        // Reads and activations are sent again harmlessly.
        let read = Request::GetJob {
            key: JobKey(1 << 51),
        };
        assert_eq!(unsettled(&read, true, down()), down());
        let poll = Request::Command(Command::Activate {
            props: ActivationProps {
                job_type: "t".into(),
                worker: "w".into(),
                timeout_ms: 1000,
                fetch_variables: vec![],
                tenant_ids: vec!["<default>".into()],
            },
            max_jobs: 1,
        });
        assert_eq!(unsettled(&poll, true, down()), down());
    }

    #[test]
    fn retries_that_run_out_under_back_pressure_say_so() {
        let p = PartitionId(2);
        let busy = "partition 2 has 4096 commands waiting; retry later".to_string();
        let e = given_up(p, "resource_exhausted", busy.clone());
        assert_eq!(e, BrokerError::ResourceExhausted(busy));
        assert_eq!(
            tonic::Status::from(e).code(),
            tonic::Code::ResourceExhausted
        );
        let e = given_up(p, "no_leader", "no leader known".into());
        assert_eq!(
            tonic::Status::from(e.clone()).code(),
            tonic::Code::Unavailable
        );
        assert!(e
            .to_string()
            .contains("partition 2 is unavailable: no leader known"));
    }

    #[test]
    fn grpc_timeouts_in_every_unit() {
        assert_eq!(parse_grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_grpc_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_grpc_timeout("15S"), Some(Duration::from_secs(15)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        assert_eq!(parse_grpc_timeout("0m"), Some(Duration::ZERO));
    }

    #[test]
    fn malformed_grpc_timeouts_are_ignored() {
        for bad in [
            "",
            "S",
            "10",
            "10s",
            "10x",
            "-1S",
            "1.5S",
            "123456789S",
            " 1S",
            "1 S",
            "1é",
        ] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn a_refused_connection_is_known_to_be_unsent() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let topology = Topology::new(std::slice::from_ref(&addr)).unwrap();
        let broker = topology.broker(&addr).unwrap();
        let Err(status) = broker
            .execute(None, Box::pin(tokio_stream::empty::<ExecuteRequest>()))
            .await
        else {
            panic!("a refused connection opened a stream");
        };
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(is_connect_error(&status), "{status:?}");
        assert!(!is_connect_error(&tonic::Status::unavailable("reset")));
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_come_from_the_header_or_the_default() {
        let default = Duration::from_secs(15);
        let mut md = tonic::metadata::MetadataMap::new();
        let now = Instant::now();
        assert_eq!(request_deadline(&md, default), now + default);
        md.insert("grpc-timeout", "500m".parse().unwrap());
        assert_eq!(
            request_deadline(&md, default),
            now + Duration::from_millis(500)
        );
        md.insert("grpc-timeout", "bogus".parse().unwrap());
        assert_eq!(request_deadline(&md, default), now + default);
        // The largest legal header value does not overflow.
        md.insert("grpc-timeout", "99999999H".parse().unwrap());
        assert_eq!(request_deadline(&md, default), now + FAR_FUTURE);
    }
}
