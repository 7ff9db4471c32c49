//! Request/reply calls multiplexed on one long-lived bidirectional gRPC stream, for
//! the busiest traffic inside a cluster (Raft between brokers, commands from a
//! gateway to a broker): a unary call costs a new HTTP/2 stream, its headers and a
//! task on each side per request; a frame on an open stream costs none of that.
//!
//! Every frame carries an id: the caller's [`Mux`] picks it, the serving side
//! ([`serve`]) copies it into the reply, and replies may come back in any order.

use dashmap::DashMap;
use futures::{Stream, StreamExt};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// A message that travels on a multiplexed stream: a request or its reply.
pub trait Frame: Send + 'static {
    fn id(&self) -> u64;
    fn set_id(&mut self, id: u64);
}

/// Requests in flight on one stream a [`Mux`] may queue before a sender waits.
const QUEUE: usize = 1024;

/// Why a multiplexed call failed.
#[derive(Debug)]
pub enum CallError {
    /// The stream could not be opened: the request was not sent.
    Open(Status),
    /// The stream had ended before the request was handed to it: not sent.
    NotSent,
    /// The stream ended after the request was handed to it: it may have been
    /// served.
    Lost,
    /// No reply by the deadline: the request may have been served.
    TimedOut,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Open(s) => write!(f, "opening the stream failed: {}", s.message()),
            CallError::NotSent => f.write_str("the stream had ended; request not sent"),
            CallError::Lost => f.write_str("the stream ended before the reply"),
            CallError::TimedOut => f.write_str("no reply in time"),
        }
    }
}

/// One open stream and the calls waiting on it.
struct OpenStream<Req, Rep> {
    requests: mpsc::Sender<Req>,
    waiting: DashMap<u64, oneshot::Sender<Rep>>,
    /// Cancelled when the stream ended: the next call opens another.
    ended: CancellationToken,
}

/// The caller's side: calls from any task go out on one stream, opened on first
/// use and again after it breaks; a reader task hands each reply to its call.
pub struct Mux<Req, Rep> {
    next_id: AtomicU64,
    current: tokio::sync::Mutex<Option<Arc<OpenStream<Req, Rep>>>>,
    /// Ends the reader tasks.
    shutdown: CancellationToken,
}

impl<Req: Frame, Rep: Frame> Mux<Req, Rep> {
    pub fn new(shutdown: CancellationToken) -> Self {
        Mux {
            next_id: AtomicU64::new(0),
            current: tokio::sync::Mutex::new(None),
            shutdown,
        }
    }

    /// The open stream, or a new one started by `open`.
    async fn stream<F, Fut>(&self, open: F) -> Result<Arc<OpenStream<Req, Rep>>, CallError>
    where
        F: FnOnce(ReceiverStream<Req>) -> Fut,
        Fut: Future<Output = Result<Replies<Rep>, Status>>,
    {
        let mut current = self.current.lock().await;
        if let Some(s) = current.as_ref().filter(|s| !s.ended.is_cancelled()) {
            return Ok(s.clone());
        }
        let (requests, rx) = mpsc::channel(QUEUE);
        let replies = open(ReceiverStream::new(rx))
            .await
            .map_err(CallError::Open)?;
        let s = Arc::new(OpenStream {
            requests,
            waiting: DashMap::new(),
            ended: CancellationToken::new(),
        });
        tokio::spawn(read_replies(replies, s.clone(), self.shutdown.clone()));
        *current = Some(s.clone());
        Ok(s)
    }

    /// Sends `request` on the stream (opened with `open` if there is none) and
    /// waits for its reply until `deadline`.
    pub async fn call<F, Fut>(
        &self,
        open: F,
        mut request: Req,
        deadline: Instant,
    ) -> Result<Rep, CallError>
    where
        F: FnOnce(ReceiverStream<Req>) -> Fut,
        Fut: Future<Output = Result<Replies<Rep>, Status>>,
    {
        let s = tokio::time::timeout_at(deadline, self.stream(open))
            .await
            .map_err(|_| CallError::Open(Status::deadline_exceeded("opening the stream")))??;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        request.set_id(id);
        let (tx, rx) = oneshot::channel();
        s.waiting.insert(id, tx);
        // The reader empties `waiting` once the stream ended: checked after the
        // insert, so no call waits on a stream nobody reads any more. A full queue
        // (the peer reads slowly) holds the call only until its deadline.
        let sent = if s.ended.is_cancelled() {
            Err(CallError::NotSent)
        } else {
            match tokio::time::timeout_at(deadline, s.requests.send(request)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(_)) => {
                    s.ended.cancel();
                    Err(CallError::NotSent)
                }
                // Not sent, but past its deadline: nothing retries it either way.
                Err(_) => Err(CallError::TimedOut),
            }
        };
        if let Err(e) = sent {
            s.waiting.remove(&id);
            return Err(e);
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err(CallError::Lost),
            Err(_) => {
                s.waiting.remove(&id);
                Err(CallError::TimedOut)
            }
        }
    }
}

/// Hands the replies of one stream to their calls until it ends (peer gone, its
/// shutdown or ours), then fails every call still waiting on it.
async fn read_replies<Req, Rep: Frame>(
    mut replies: Replies<Rep>,
    s: Arc<OpenStream<Req, Rep>>,
    shutdown: CancellationToken,
) {
    loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = s.ended.cancelled() => break,
            next = replies.next() => next,
        };
        match next {
            Some(Ok(reply)) => {
                if let Some((_, call)) = s.waiting.remove(&reply.id()) {
                    let _ = call.send(reply);
                }
            }
            None => break,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "multiplexed stream ended");
                break;
            }
        }
    }
    s.ended.cancel();
    s.waiting.clear();
}

/// The replies of a served stream.
pub type Replies<Rep> = Pin<Box<dyn Stream<Item = Result<Rep, Status>> + Send>>;

/// The serving side: runs `handle` on each request of `inbound` as it comes (a
/// slow one never holds up the next) and returns the stream of replies, each
/// with its request's id. Ends when the caller closes its side, or on `shutdown`.
pub fn serve<Req, Rep, H, Fut, S>(
    mut inbound: S,
    shutdown: CancellationToken,
    handle: H,
) -> Replies<Rep>
where
    Req: Frame,
    Rep: Frame,
    H: Fn(Req) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Rep> + Send + 'static,
    S: Stream<Item = Result<Req, Status>> + Send + Unpin + 'static,
{
    let (tx, rx) = mpsc::channel::<Result<Rep, Status>>(QUEUE);
    let reading = shutdown.clone();
    tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                _ = reading.cancelled() => break,
                next = inbound.next() => next,
            };
            let request = match next {
                Some(Ok(request)) => request,
                None => break,
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "multiplexed stream from a peer ended");
                    break;
                }
            };
            let (handle, tx) = (handle.clone(), tx.clone());
            tokio::spawn(async move {
                let id = request.id();
                let mut reply = handle(request).await;
                reply.set_id(id);
                // The caller is gone if this fails: nobody waits for the reply.
                let _ = tx.send(Ok(reply)).await;
            });
        }
    });
    Box::pin(futures::StreamExt::take_until(
        ReceiverStream::new(rx),
        shutdown.cancelled_owned(),
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used)]

    use super::*;
    use crate::cluster::broker_client::BrokerClient;
    use crate::cluster::broker_server::{Broker, BrokerServer};
    use crate::cluster::{
        BrokerMessage, BrokerTopology, BrokerTopologyRequest, ExecuteReply, ExecuteRequest,
        GatewayMessage,
    };
    use std::time::Duration;
    use tonic::{Request, Response, Streaming};

    /// A peer that takes the command stream and then neither reads it nor answers.
    struct Deaf;

    #[tonic::async_trait]
    impl Broker for Deaf {
        type ExecuteStream = Replies<ExecuteReply>;
        type LinkStream = Pin<Box<dyn Stream<Item = Result<BrokerMessage, Status>> + Send>>;

        async fn execute(
            &self,
            request: Request<Streaming<ExecuteRequest>>,
        ) -> Result<Response<Self::ExecuteStream>, Status> {
            let inbound = request.into_inner();
            // Holds the inbound stream unread for as long as the replies are open.
            let replies = futures::stream::pending::<Result<ExecuteReply, Status>>();
            let replies = futures::StreamExt::map(replies, move |r| {
                let _keep = &inbound;
                r
            });
            Ok(Response::new(Box::pin(replies)))
        }

        async fn topology(
            &self,
            _: Request<BrokerTopologyRequest>,
        ) -> Result<Response<BrokerTopology>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn link(
            &self,
            _: Request<Streaming<GatewayMessage>>,
        ) -> Result<Response<Self::LinkStream>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_to_a_peer_that_stops_reading_end_at_their_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(BrokerServer::new(Deaf))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    stop.clone().cancelled_owned(),
                ),
        );
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy();
        let mux = Arc::new(Mux::<ExecuteRequest, ExecuteReply>::new(stop.clone()));
        // More than the peer's HTTP/2 window (16 KiB requests) and the queue
        // take: the last calls find the queue full and wait for room that never
        // comes.
        let calls = QUEUE + 200;
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut waiting = Vec::new();
        for _ in 0..calls {
            let (mux, channel) = (mux.clone(), channel.clone());
            waiting.push(tokio::spawn(async move {
                let open = |requests| async move {
                    let replies = BrokerClient::new(channel).execute(requests).await?;
                    Ok(Box::pin(replies.into_inner()) as Replies<ExecuteReply>)
                };
                let request = ExecuteRequest {
                    partition_id: 1,
                    request: vec![0u8; 16 * 1024].into(),
                    id: 0,
                    scope: None,
                };
                mux.call(open, request, deadline).await
            }));
        }
        let all = futures::future::join_all(waiting);
        let results = tokio::time::timeout(Duration::from_secs(5), all)
            .await
            .expect("every call ends soon after its deadline");
        for r in results {
            assert!(matches!(r.expect("call task"), Err(CallError::TimedOut)));
        }
        // The deaf stream never ends, so a graceful shutdown would wait forever.
        server.abort();
    }
}
