//! A job stream's life at the gateway, in paused time.

use super::lifetime::{job_stream, Endable, Life};
use crate::admission::{Admission, Bounds};
use crate::metrics::RequestObserver;
use crate::streams::{AggregatedStreams, AttachedLink, Limits};
use courier_proto::cluster::{gateway_message::Kind, GatewayMessage, PushJob};
use courier_proto::gateway_protocol as gw;
use courier_proto::headers::{HEARTBEAT_KEY, STREAM_END_HEADER};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

struct Setup {
    streams: Arc<AggregatedStreams>,
    link: AttachedLink,
    rx: mpsc::Receiver<GatewayMessage>,
    stop: CancellationToken,
}

fn setup() -> Setup {
    let streams = AggregatedStreams::new(Limits {
        client_credit: 32,
        max_inflight_jobs: 1000,
        max_inflight_bytes: 1 << 20,
        spare_percent: 0,
    });
    let hello = GatewayMessage {
        kind: Some(Kind::Hello(Default::default())),
    };
    let (link, rx) = streams.attach_link(1, hello);
    Setup {
        streams,
        link,
        rx,
        stop: CancellationToken::new(),
    }
}

impl Setup {
    /// A stream for type "t" under `life`, and the id of its aggregated stream.
    fn open(&self, life: Life) -> (super::JobStream, u64) {
        let request = gw::StreamActivatedJobsRequest {
            r#type: "t".into(),
            worker: "w".into(),
            timeout: 600_000,
            ..Default::default()
        };
        let props = courier_proto::convert::stream_request(&request).unwrap();
        let client = self.streams.join(props, None);
        let id = client.stream_id().0;
        let place = Admission::new(Bounds::DEFAULT).job_stream().unwrap();
        let s = job_stream(
            client,
            life,
            self.stop.clone(),
            place,
            RequestObserver::start("StreamActivatedJobs"),
        );
        (s, id)
    }

    fn push(&self, stream_id: u64, key: i64) {
        let ack = self
            .link
            .push(PushJob {
                push_id: key as u64,
                stream_id,
                partition_id: 1,
                lease: key as u64 + 500,
                job: Some(gw::ActivatedJob {
                    key,
                    ..Default::default()
                }),
            })
            .unwrap();
        assert!(ack.accepted, "{}", ack.reason);
    }

    /// Keys of the jobs yielded back to the broker so far.
    fn yielded(&mut self) -> Vec<i64> {
        std::iter::from_fn(|| self.rx.try_recv().ok())
            .filter_map(|m| match m.kind {
                Some(Kind::YieldJob(y)) => Some(y.key),
                _ => None,
            })
            .collect()
    }
}

/// The life of a stream whose client reopens (Courier's worker).
fn life(max_age: Option<Duration>, heartbeat: Option<Duration>) -> Life {
    Life {
        max_age,
        reopens: true,
        heartbeat,
        registered: None,
    }
}

fn end_reason(status: &tonic::Status) -> String {
    status
        .metadata()
        .get(STREAM_END_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(start_paused = true)]
async fn an_idle_stream_carries_heartbeats_and_a_job_puts_the_next_off() {
    let s = setup();
    let every = Duration::from_secs(2);
    let (mut jobs, id) = s.open(life(None, Some(every)));
    let start = Instant::now();
    let beat = jobs.next().await.unwrap().unwrap();
    assert_eq!(beat.key, HEARTBEAT_KEY);
    assert_eq!(start.elapsed(), every);

    tokio::time::sleep(Duration::from_millis(1500)).await;
    s.push(id, 7);
    assert_eq!(jobs.next().await.unwrap().unwrap().key, 7);
    let after_job = Instant::now();
    let beat = jobs.next().await.unwrap().unwrap();
    assert_eq!(beat.key, HEARTBEAT_KEY);
    // The tick half an interval after the job is left out; the next one goes.
    assert!(
        after_job.elapsed() >= every && after_job.elapsed() < every * 2,
        "a job puts the heartbeat off by one to two intervals: {:?}",
        after_job.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn without_a_heartbeat_asked_for_an_idle_stream_is_silent() {
    let s = setup();
    let (mut jobs, _) = s.open(life(None, None));
    let waited = tokio::time::timeout(Duration::from_secs(3600), jobs.next()).await;
    assert!(waited.is_err(), "nothing but jobs is sent: {waited:?}");
}

#[tokio::test(start_paused = true)]
async fn a_stream_ends_at_its_age_with_a_status_to_reopen_on_after_what_it_holds() {
    let mut s = setup();
    let age = Duration::from_secs(60);
    let (mut jobs, id) = s.open(life(Some(age), None));
    s.push(id, 1);
    assert_eq!(jobs.next().await.unwrap().unwrap().key, 1);
    let start = Instant::now();
    tokio::time::sleep(age).await;
    // Buffered when the age passed: it goes out ahead of the status, and the
    // client, which reads until the status, takes it.
    s.push(id, 2);
    assert_eq!(jobs.next().await.unwrap().unwrap().key, 2);
    let end = jobs.next().await.unwrap().unwrap_err();
    assert!(start.elapsed() <= age);
    assert_eq!(end.code(), tonic::Code::Unavailable);
    assert_eq!(end_reason(&end), "max-age");
    assert!(jobs.next().await.is_none());
    assert_eq!(s.streams.client_count(), 0);
    assert_eq!(
        s.yielded(),
        Vec::<i64>::new(),
        "nothing was left to give back"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_ends_every_stream_telling_a_client_that_reopens_to_go_elsewhere() {
    let s = setup();
    let (mut a, _) = s.open(life(
        Some(Duration::from_secs(600)),
        Some(Duration::from_secs(1)),
    ));
    let (mut b, _) = s.open(life(None, None));
    let (mut zeebe, _) = s.open(Life {
        max_age: None,
        reopens: false,
        heartbeat: None,
        registered: None,
    });
    s.stop.cancel();
    for jobs in [&mut a, &mut b] {
        let end = jobs.next().await.unwrap().unwrap_err();
        assert_eq!(end.code(), tonic::Code::Unavailable);
        assert_eq!(end_reason(&end), "shutdown");
        assert!(jobs.next().await.is_none());
    }
    assert!(
        zeebe.next().await.is_none(),
        "a Zeebe client's stream ends cleanly, as from Zeebe's gateway"
    );
}

#[test]
fn the_heartbeat_asked_for_is_bounded_and_echoed_and_the_age_jittered_below_the_maximum() {
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert("courier-heartbeat-ms", "5".parse().unwrap());
    let max = Duration::from_secs(100);
    assert_eq!(
        Life::of(Some(max), &md, &Arc::default()).max_age,
        None,
        "a client that does not say it reopens is never ended for its age"
    );
    md.insert("courier-stream-reopens", "1".parse().unwrap());
    let l = Life::of(Some(max), &md, &Arc::default());
    assert_eq!(l.heartbeat, Some(Duration::from_millis(100)));
    let mut echoed = tonic::metadata::MetadataMap::new();
    l.announce(&mut echoed);
    assert_eq!(echoed.get("courier-heartbeat-ms").unwrap(), "100");
    let ages: Vec<Duration> = (0..50)
        .filter_map(|_| Life::of(Some(max), &md, &Arc::default()).max_age)
        .collect();
    assert!(ages.iter().all(|a| *a <= max && *a >= max.mul_f64(0.8)));
    assert!(ages.iter().any(|a| *a != ages[0]), "jittered: {ages:?}");

    md.insert("courier-heartbeat-ms", "soon".parse().unwrap());
    assert_eq!(Life::of(None, &md, &Arc::default()).heartbeat, None);
    assert_eq!(
        Life::of(None, &tonic::metadata::MetadataMap::new(), &Arc::default()).heartbeat,
        None
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_reopens_may_end_its_stream_by_the_id_it_was_told() {
    let mut s = setup();
    let endable = Arc::new(Endable::default());
    let mut md = tonic::metadata::MetadataMap::new();
    assert!(
        Life::of(None, &md, &endable).registered.is_none(),
        "a client that does not reopen gets no id"
    );
    md.insert("courier-stream-reopens", "1".parse().unwrap());
    let life = Life::of(None, &md, &endable);
    let mut told = tonic::metadata::MetadataMap::new();
    life.announce(&mut told);
    let id: u64 = told
        .get("courier-stream-id")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let (mut jobs, stream) = s.open(life);
    s.push(stream, 1);
    assert_eq!(jobs.next().await.unwrap().unwrap().key, 1);
    s.push(stream, 2);
    assert!(!endable.end(id ^ 1), "another id ends nothing");
    assert!(endable.end(id));
    assert_eq!(
        jobs.next().await.unwrap().unwrap().key,
        2,
        "what it holds goes out ahead of the end"
    );
    let end = jobs.next().await.unwrap().unwrap_err();
    assert_eq!(end.code(), tonic::Code::Unavailable);
    assert_eq!(end_reason(&end), "asked");
    assert!(jobs.next().await.is_none());
    assert_eq!(s.yielded(), Vec::<i64>::new());
    assert!(!endable.end(id), "an ended stream is forgotten");
}

/// A stream of a client that reopens, with heartbeats every `every`, and its id.
fn registered(endable: &Arc<Endable>, every: Duration) -> (Life, u64) {
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert("courier-stream-reopens", "1".parse().unwrap());
    md.insert(
        "courier-heartbeat-ms",
        (every.as_millis() as u64).to_string().parse().unwrap(),
    );
    let life = Life::of(None, &md, endable);
    let mut told = tonic::metadata::MetadataMap::new();
    life.announce(&mut told);
    let id = told.get("courier-stream-id").unwrap().to_str().unwrap();
    let id = id.parse().unwrap();
    (life, id)
}

#[tokio::test(start_paused = true)]
async fn a_client_that_said_it_reads_and_went_silent_has_its_stream_ended() {
    let s = setup();
    let endable = Arc::new(Endable::default());
    let every = Duration::from_secs(1);
    let (life, id) = registered(&endable, every);
    let (mut jobs, stream) = s.open(life);
    // Silent from the start: never taken for stalled, it may be a client that
    // does not say so.
    for _ in 0..10 {
        assert_eq!(jobs.next().await.unwrap().unwrap().key, HEARTBEAT_KEY);
    }
    let start = Instant::now();
    assert!(endable.alive(id));
    s.push(stream, 1);
    assert_eq!(jobs.next().await.unwrap().unwrap().key, 1);
    // Its word came once and then no more: a proxy between stopped forwarding.
    // The gateway goes on writing (into buffers that lead nowhere) until the end.
    s.push(stream, 2);
    let mut sent = Vec::new();
    let end = loop {
        match jobs.next().await.unwrap() {
            Ok(job) => sent.push(job.key),
            Err(end) => break end,
        }
    };
    assert_eq!(start.elapsed(), every * 3);
    assert_eq!(sent, [2, HEARTBEAT_KEY, HEARTBEAT_KEY]);
    assert_eq!(end_reason(&end), "stalled");
    assert!(jobs.next().await.is_none());
    assert_eq!(s.streams.client_count(), 0, "no more jobs go its way");
    assert!(!endable.alive(id), "an ended stream is forgotten");
}
