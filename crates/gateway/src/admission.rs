//! Admission: the gateway's bounds on what clients may hold at once. Past a bound a
//! request is refused at once with RESOURCE_EXHAUSTED (a connection is closed), so
//! one client's flood costs the others nothing and its own clients back off or move
//! to another gateway; nothing waits in a queue for a place.

use crate::error::GatewayError;
use crate::metrics;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The bounds, each a flag of `courier gateway` (the README lists them all).
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Client connections held at once (`--max-connections`).
    pub max_connections: usize,
    /// Concurrent HTTP/2 streams (calls) per client connection, advertised to the
    /// client in the connection's settings (`--max-calls-per-connection`).
    pub max_calls_per_connection: u32,
    /// StreamActivatedJobs clients at once (`--max-job-streams`).
    pub max_job_streams: usize,
    /// ActivateJobs requests parked waiting for jobs at once (`--max-parked-polls`).
    pub max_parked_polls: usize,
}

impl Bounds {
    /// The defaults of the flags.
    pub const DEFAULT: Bounds = Bounds {
        max_connections: 10_000,
        max_calls_per_connection: 1_000,
        max_job_streams: 100_000,
        max_parked_polls: 10_000,
    };
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds::DEFAULT
    }
}

/// What a bound limits; its label on the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    Connections,
    CallsPerConnection,
    JobStreams,
    ParkedPolls,
    InflightJobs,
    InflightBytes,
}

impl Bound {
    /// Every bound, for the metrics' series.
    pub const ALL: [Bound; 6] = [
        Bound::Connections,
        Bound::CallsPerConnection,
        Bound::JobStreams,
        Bound::ParkedPolls,
        Bound::InflightJobs,
        Bound::InflightBytes,
    ];

    /// The metrics' label.
    pub fn label(self) -> &'static str {
        match self {
            Bound::Connections => "connections",
            Bound::CallsPerConnection => "calls_per_connection",
            Bound::JobStreams => "job_streams",
            Bound::ParkedPolls => "parked_polls",
            Bound::InflightJobs => "inflight_jobs",
            Bound::InflightBytes => "inflight_bytes",
        }
    }
}

/// The counted bounds of one gateway: job streams and parked polls. (Connections
/// are counted where they are accepted, by a [`courier_proto::tls::ConnectionLimit`].)
pub struct Admission {
    job_streams: Counted,
    parked_polls: Counted,
}

/// Places held under one bound.
struct Counted {
    held: AtomicUsize,
    max: usize,
    bound: Bound,
    /// What is held, for the refusal's message.
    what: &'static str,
}

impl Admission {
    pub fn new(bounds: Bounds) -> Arc<Self> {
        let counted = |max, bound, what| Counted {
            held: AtomicUsize::new(0),
            max,
            bound,
            what,
        };
        Arc::new(Admission {
            job_streams: counted(bounds.max_job_streams, Bound::JobStreams, "job streams"),
            parked_polls: counted(
                bounds.max_parked_polls,
                Bound::ParkedPolls,
                "parked ActivateJobs requests",
            ),
        })
    }

    /// A place for one more StreamActivatedJobs client, held until dropped.
    pub fn job_stream(self: &Arc<Self>) -> Result<Place, GatewayError> {
        self.take(|a| &a.job_streams)
    }

    /// StreamActivatedJobs clients held now: one atomic load, cheap on every answer.
    pub fn job_streams_held(&self) -> usize {
        self.job_streams.held.load(Ordering::Relaxed)
    }

    /// A place for one more parked ActivateJobs request, held until dropped.
    pub fn parked_poll(self: &Arc<Self>) -> Result<Place, GatewayError> {
        self.take(|a| &a.parked_polls)
    }

    fn take(self: &Arc<Self>, under: fn(&Admission) -> &Counted) -> Result<Place, GatewayError> {
        let c = under(self);
        let taken = c
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < c.max).then_some(n + 1)
            });
        if taken.is_err() {
            metrics::admission_refused(c.bound);
            return Err(GatewayError::ResourceExhausted(format!(
                "this gateway holds its limit of {} {}; try again later or another gateway",
                c.max, c.what
            )));
        }
        Ok(Place {
            admission: self.clone(),
            under,
        })
    }
}

/// A place under one of the [`Admission`] bounds, given back when dropped.
pub struct Place {
    admission: Arc<Admission>,
    under: fn(&Admission) -> &Counted,
}

impl Drop for Place {
    fn drop(&mut self) {
        (self.under)(&self.admission)
            .held
            .fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_refused_at_the_bound_and_come_back_when_dropped() {
        let a = Admission::new(Bounds {
            max_job_streams: 2,
            max_parked_polls: 1,
            ..Bounds::default()
        });
        let first = a.job_stream().unwrap();
        let _second = a.job_stream().unwrap();
        let e = a.job_stream().err().unwrap();
        assert_eq!(
            tonic::Status::from(e).code(),
            tonic::Code::ResourceExhausted
        );
        // The bounds are counted apart.
        let poll = a.parked_poll().unwrap();
        assert!(a.parked_poll().is_err());
        drop(first);
        assert!(a.job_stream().is_ok());
        drop(poll);
        assert!(a.parked_poll().is_ok());
    }
}
