//! A job stream's life at the gateway. A client that states it reopens
//! ([`STREAM_REOPENS_HEADER`]) has its stream ended at a jittered maximum age, and
//! when the gateway shuts down, with UNAVAILABLE and a [`STREAM_END_HEADER`]
//! trailer saying why: it reopens at once (elsewhere, when this gateway is leaving),
//! and streams spread again over the gateways there are now. Jobs it buffered go
//! back to the brokers; those its worker took are declared held on the reopen. Such
//! a client may also ask for the end of one of its streams (`EndStream`, by the id
//! it was told), to reopen it with other credit or close it without losing the
//! jobs on their way. A client that asks gets heartbeats, so it notices a stream
//! that went silent; one that also says now and then that it reads the stream
//! (`StreamAlive`) has it ended when it stops, so the gateway notices too.

use super::*;
use crate::admission::Place;
use crate::streams::ClientStream;
use courier_proto::headers::{
    HEARTBEAT_HEADER, HEARTBEAT_KEY, STREAM_END_ASKED, STREAM_END_HEADER, STREAM_END_MAX_AGE,
    STREAM_END_SHUTDOWN, STREAM_END_STALLED, STREAM_ID_HEADER, STREAM_REOPENS_HEADER,
};
use std::collections::HashMap;
use std::sync::Mutex;
use std::task::Poll;

/// The shortest and longest heartbeat interval a client may ask for.
const HEARTBEAT_BOUNDS: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(60));
/// The share of the maximum age taken off at random, so streams opened together
/// (after a gateway restart) do not all end together.
const AGE_JITTER: f64 = 0.2;

/// The open streams of clients that reopen, by id, for `EndStream`. Ids are random,
/// so one client cannot guess another's.
#[derive(Default)]
pub(crate) struct Endable(Mutex<HashMap<u64, Handle>>);

/// What a client can do to its stream from another call.
#[derive(Clone, Default)]
struct Handle {
    end: CancellationToken,
    alive: Arc<tokio::sync::Notify>,
}

impl Endable {
    /// Ends stream `id`, if it is open here.
    pub fn end(&self, id: u64) -> bool {
        let handle = self.lock().get(&id).cloned();
        handle.map(|h| h.end.cancel()).is_some()
    }

    /// Stream `id`'s client reads it: from the first such word on, the stream ends
    /// when the word does not come for [`STALL_AFTER_BEATS`] heartbeat intervals.
    pub fn alive(&self, id: u64) -> bool {
        let handle = self.lock().get(&id).cloned();
        handle.map(|h| h.alive.notify_one()).is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Handle>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn register(self: &Arc<Self>) -> Registered {
        let handle = Handle::default();
        let mut map = self.lock();
        let mut id = rand::random::<u64>();
        while id == 0 || map.contains_key(&id) {
            id = rand::random::<u64>();
        }
        map.insert(id, handle.clone());
        Registered {
            endable: self.clone(),
            id,
            handle,
        }
    }
}

/// Heartbeat intervals without a word from a client that said its stream is
/// alive, after which the stream is taken for stalled (a proxy between that
/// stopped forwarding while keeping the connection up).
const STALL_AFTER_BEATS: u32 = 3;

/// A stream's place in [`Endable`], given up when dropped.
pub(super) struct Registered {
    endable: Arc<Endable>,
    id: u64,
    handle: Handle,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.endable.lock().remove(&self.id);
    }
}

/// What a stream's life is bounded by.
pub(super) struct Life {
    /// When the gateway ends it; `None`: never (until shutdown).
    pub max_age: Option<Duration>,
    /// Its client reopens a stream ended with a reason; others see a shutdown as a
    /// clean end, as from Zeebe's gateway, and are never ended for their age.
    pub reopens: bool,
    /// Heartbeat interval the client asked for.
    pub heartbeat: Option<Duration>,
    /// Its id, by which its client may end it.
    pub registered: Option<Registered>,
}

impl Life {
    /// The life of a stream opened now under `max_age` (when its client reopens),
    /// with the heartbeat its request asks for.
    pub fn of(
        max_age: Option<Duration>,
        metadata: &tonic::metadata::MetadataMap,
        endable: &Arc<Endable>,
    ) -> Life {
        let reopens = metadata
            .get(STREAM_REOPENS_HEADER)
            .is_some_and(|v| v.as_bytes() == b"1");
        Life {
            max_age: max_age.filter(|_| reopens).map(jittered),
            reopens,
            heartbeat: stated_heartbeat(metadata),
            registered: reopens.then(|| endable.register()),
        }
    }

    /// The response's initial metadata: the heartbeat interval kept, if any, and
    /// the stream's id, if it has one.
    pub fn announce(&self, md: &mut tonic::metadata::MetadataMap) {
        if let Some(h) = self.heartbeat {
            md.insert(HEARTBEAT_HEADER, (h.as_millis() as u64).into());
        }
        if let Some(r) = &self.registered {
            md.insert(STREAM_ID_HEADER, r.id.into());
        }
    }
}

/// `max_age` less up to [`AGE_JITTER`] of it, at random.
fn jittered(max_age: Duration) -> Duration {
    max_age.mul_f64(1.0 - AGE_JITTER * rand::random::<f64>())
}

/// The heartbeat interval a request asks for, within [`HEARTBEAT_BOUNDS`]; an
/// invalid header asks for none.
fn stated_heartbeat(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let ms = metadata
        .get(HEARTBEAT_HEADER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(Duration::from_millis(ms).clamp(HEARTBEAT_BOUNDS.0, HEARTBEAT_BOUNDS.1))
}

/// Why a stream ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Its aggregated stream removed the client.
    Removed,
    /// Its client asked for the end.
    Asked,
    /// Its client stopped saying it is alive.
    Stalled,
    MaxAge,
    Shutdown,
}

impl End {
    /// The status the stream ends with: none (a clean end) when its client was
    /// removed, or when it does not reopen on a reason.
    fn status(self, reopens: bool) -> Option<Status> {
        let (value, message) = match self {
            End::Removed => return None,
            _ if !reopens => return None,
            End::Asked => (
                STREAM_END_ASKED,
                "the job stream was ended as its client asked",
            ),
            End::Stalled => (
                STREAM_END_STALLED,
                "the job stream's client stopped saying it reads it",
            ),
            End::MaxAge => (
                STREAM_END_MAX_AGE,
                "the job stream reached its maximum age on this gateway; reopen it",
            ),
            End::Shutdown => (
                STREAM_END_SHUTDOWN,
                "this gateway is shutting down; reopen the job stream on another gateway",
            ),
        };
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert(
            STREAM_END_HEADER,
            tonic::metadata::MetadataValue::from_static(value),
        );
        Some(Status::with_metadata(tonic::Code::Unavailable, message, md))
    }
}

/// One stream while it lives.
struct Live {
    client: Option<ClientStream>,
    /// Resolves with the end the stream's life sets (shutdown, age, the client's
    /// word or its silence). Kept across items, so a job costs no registration of
    /// waiters; polled before the jobs only every [`CONTROL_EVERY`] items while
    /// jobs keep coming.
    control: Pin<Box<dyn Future<Output = End> + Send>>,
    heartbeat: Option<tokio::time::Interval>,
    /// When the last job went out, to leave out heartbeats while jobs flow.
    last_job: Instant,
    every: Duration,
    /// Items since the control was last looked at first.
    turn: u32,
    place: Option<Place>,
    observer: Option<RequestObserver>,
    reopens: bool,
}

/// While jobs keep coming, the control is looked at first once in this many items.
const CONTROL_EVERY: u32 = 32;

/// What ends a stream other than its client leaving, as one future.
fn control(
    stop: CancellationToken,
    max_age: Option<Duration>,
    registered: Option<Registered>,
    stall_after: Option<Duration>,
) -> Pin<Box<dyn Future<Output = End> + Send>> {
    // The age counts from now, not from the control's first poll.
    let old = max_age.map(tokio::time::sleep);
    Box::pin(async move {
        let asked = async {
            match &registered {
                Some(r) => r.handle.end.cancelled().await,
                None => std::future::pending().await,
            }
        };
        // From the client's first word that it reads on, silence for
        // `stall_after` ends the stream.
        let silent = async {
            let (Some(r), Some(after)) = (&registered, stall_after) else {
                return std::future::pending().await;
            };
            r.handle.alive.notified().await;
            loop {
                tokio::select! {
                    () = r.handle.alive.notified() => {}
                    () = tokio::time::sleep(after) => return,
                }
            }
        };
        let old = async {
            match old {
                Some(sleep) => sleep.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = stop.cancelled() => End::Shutdown,
            () = old => End::MaxAge,
            () = asked => End::Asked,
            () = silent => End::Stalled,
        }
    })
}

/// The response stream of `client`: its jobs, heartbeats while it has none, and
/// the end `life` and `stop` (the gateway's shutdown) set.
pub(super) fn job_stream(
    client: ClientStream,
    life: Life,
    stop: CancellationToken,
    place: Place,
    observer: RequestObserver,
) -> JobStream {
    let beats = life.heartbeat.map(|every| {
        let mut i = tokio::time::interval_at(Instant::now() + every, every);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    let stall_after = life.heartbeat.map(|h| h * STALL_AFTER_BEATS);
    let live = Live {
        client: Some(client),
        control: control(stop, life.max_age, life.registered, stall_after),
        heartbeat: beats,
        last_job: Instant::now(),
        every: life.heartbeat.unwrap_or_default(),
        turn: 0,
        place: Some(place),
        observer: Some(observer),
        reopens: life.reopens,
    };
    Box::pin(futures::stream::unfold(live, move |mut l| async move {
        let client = l.client.as_mut()?;
        l.turn = l.turn.wrapping_add(1);
        let early = if l.turn % CONTROL_EVERY == 0 {
            match futures::poll!(l.control.as_mut()) {
                Poll::Ready(end) => Some(end),
                Poll::Pending => None,
            }
        } else {
            None
        };
        let event = match early {
            Some(end) => Err(end),
            None => loop {
                // Jobs first: a job waiting costs no look at anything else.
                break tokio::select! {
                    biased;
                    job = client.next() => job.ok_or(End::Removed),
                    end = l.control.as_mut() => Err(end),
                    () = tick(&mut l.heartbeat) => {
                        // A job went out within the interval: no heartbeat needed
                        // yet (one goes at the latest two intervals after it).
                        if l.last_job.elapsed() < l.every {
                            continue;
                        }
                        Ok(heartbeat())
                    }
                };
            },
        };
        match event {
            Ok(job) => {
                if job.key != HEARTBEAT_KEY && l.heartbeat.is_some() {
                    l.last_job = Instant::now();
                }
                Some((Ok(job), l))
            }
            Err(end) => {
                // Dropping the client gives back what it buffered; what it took is
                // on the wire ahead of the status, and its worker declares it held.
                l.client = None;
                l.place = None;
                // Gives up the stream's id with it.
                l.control = Box::pin(std::future::pending());
                if let Some(o) = l.observer.take() {
                    // An end the gateway chose is a normal end of the call.
                    o.finish(tonic::Code::Ok);
                }
                match end {
                    End::MaxAge => metrics::stream_ended(metrics::STREAM_END_MAX_AGE),
                    End::Shutdown => metrics::stream_ended(metrics::STREAM_END_SHUTDOWN),
                    End::Asked => metrics::stream_ended(metrics::STREAM_END_ASKED),
                    End::Stalled => {
                        tracing::info!(
                            silent_for = ?stall_after.unwrap_or_default(),
                            "a job stream's client went silent; ending it and giving back its jobs"
                        );
                        metrics::stream_ended(metrics::STREAM_END_STALLED)
                    }
                    End::Removed => {}
                }
                end.status(l.reopens).map(|s| (Err(s), l))
            }
        }
    }))
}

/// Resolves at the next heartbeat; never without heartbeats.
async fn tick(heartbeat: &mut Option<tokio::time::Interval>) {
    match heartbeat {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// A heartbeat: an `ActivatedJob` with [`HEARTBEAT_KEY`] and nothing else.
fn heartbeat() -> gw::ActivatedJob {
    gw::ActivatedJob {
        key: HEARTBEAT_KEY,
        ..Default::default()
    }
}
