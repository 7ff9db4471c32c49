//! The status page a gateway serves on its metrics address: `/` (plain HTML and a
//! little JavaScript, built into the binary) and `/api/status`, the JSON it
//! refreshes from: brokers, partitions and leaders, per-type backlog and age,
//! streams, incidents, and push and poll latency from this process's metrics.

use crate::client_cmds::{inspect::stats_json, job_json, topology_json};
use courier_gateway::service::{Inspector, InspectorSlot};
use courier_proto::courier_v1::JobStatsResponse;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PAGE: &str = include_str!("status_page.html");
/// How long the page's reads of the cluster may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Incidents shown.
const INCIDENTS_SHOWN: u32 = 50;
/// Latency is taken over the observations since a sample at least this old.
const LATENCY_WINDOW: Duration = Duration::from_secs(10);
/// The header a retry must carry: a browser sends it only from the page itself,
/// never from a form on another site.
const ACTION_HEADER: &str = "x-courier-action";

/// The page's state: where the gateway's inspector appears, and samples of the
/// latency histograms.
#[derive(Clone)]
struct Page {
    slot: InspectorSlot,
    samples: Arc<Mutex<VecDeque<(Instant, Latencies)>>>,
}

/// The status page's routes, reading the gateway that fills `slot`.
pub fn router(slot: InspectorSlot) -> axum::Router {
    let page = Page {
        slot,
        samples: Arc::default(),
    };
    axum::Router::new()
        .route(
            "/",
            axum::routing::get(|| async { axum::response::Html(PAGE) }),
        )
        .route("/api/status", axum::routing::get(status))
        .route("/api/jobs/{key}/retries", axum::routing::post(retry))
        .with_state(page)
}

type Answer = (axum::http::StatusCode, axum::Json<Value>);

fn inspector(page: &Page) -> Result<Inspector, Answer> {
    page.slot.get().cloned().ok_or_else(|| {
        (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"error": "the gateway is not serving yet"})),
        )
    })
}

async fn status(axum::extract::State(page): axum::extract::State<Page>) -> Answer {
    let gw = match inspector(&page) {
        Ok(g) => g,
        Err(e) => return e,
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let (stats, incidents) = tokio::join!(
        gw.job_stats(READ_TIMEOUT),
        gw.incidents(INCIDENTS_SHOWN, READ_TIMEOUT)
    );
    let mut errors = Vec::new();
    let types = match stats {
        Ok(types) => stats_json(&JobStatsResponse { types, now })["types"].clone(),
        Err(e) => {
            errors.push(format!("job statistics: {e}"));
            Value::Array(Vec::new())
        }
    };
    let incidents = match incidents {
        Ok(jobs) => jobs.iter().map(job_json).collect(),
        Err(e) => {
            errors.push(format!("incidents: {e}"));
            Vec::new()
        }
    };
    let streams: serde_json::Map<String, Value> = gw
        .streams()
        .into_iter()
        .map(|(t, (streams, clients))| (t, json!({"streams": streams, "clients": clients})))
        .collect();
    let latency = page.latency();
    (
        axum::http::StatusCode::OK,
        axum::Json(json!({
            "now": now,
            "topology": topology_json(&gw.topology()),
            "types": types,
            "incidents": incidents,
            "gateway": {"streams": streams, "parkedPolls": gw.parked_polls()},
            "latency": latency,
            "errors": errors,
        })),
    )
}

/// Gives a job retries (an incident runs again); asked by the page's button.
async fn retry(
    axum::extract::State(page): axum::extract::State<Page>,
    axum::extract::Path(key): axum::extract::Path<i64>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
    headers: axum::http::HeaderMap,
) -> Answer {
    if !headers.contains_key(ACTION_HEADER) {
        return (
            axum::http::StatusCode::FORBIDDEN,
            axum::Json(json!({"error": format!("a retry must carry the {ACTION_HEADER} header")})),
        );
    }
    let gw = match inspector(&page) {
        Ok(g) => g,
        Err(e) => return e,
    };
    let retries = match q.get("retries").map(|r| r.parse::<i32>()) {
        None => 3,
        Some(Ok(r)) => r,
        Some(Err(_)) => {
            return (
                axum::http::StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": "retries must be a number"})),
            )
        }
    };
    match gw.update_retries(key, retries, READ_TIMEOUT).await {
        Ok(()) => (
            axum::http::StatusCode::OK,
            axum::Json(json!({"key": key, "retries": retries})),
        ),
        Err(e) => {
            use courier_gateway::GatewayError as G;
            use courier_proto::domain::BrokerError as B;
            let code = match &e {
                G::Broker(B::NotFound(_)) => axum::http::StatusCode::NOT_FOUND,
                G::InvalidArgument(_)
                | G::Broker(B::InvalidArgument(_) | B::FailedPrecondition(_)) => {
                    axum::http::StatusCode::BAD_REQUEST
                }
                _ => axum::http::StatusCode::SERVICE_UNAVAILABLE,
            };
            (code, axum::Json(json!({"error": e.to_string()})))
        }
    }
}

/// Cumulative bucket counts of the push and poll latency histograms.
#[derive(Clone, Default)]
struct Latencies {
    push: Vec<(f64, u64)>,
    poll: Vec<(f64, u64)>,
}

impl Page {
    /// p50 and p99 (in ms) of create-to-push and of ActivateJobs over the last
    /// [`LATENCY_WINDOW`] or more (since the start, until the page's first look
    /// is that old); null where nothing was observed.
    fn latency(&self) -> Value {
        let now = Instant::now();
        let current = gather();
        let mut samples = courier_proto::sync::lock(&self.samples);
        samples.push_back((now, current.clone()));
        // Keep the newest sample at least a window old, and those after it.
        while samples.len() > 1
            && samples
                .get(1)
                .is_some_and(|(t, _)| now.duration_since(*t) >= LATENCY_WINDOW)
        {
            samples.pop_front();
        }
        // Until a sample is a window old, everything since the process started.
        let base = match samples.front() {
            Some((t, l)) if now.duration_since(*t) >= LATENCY_WINDOW => l.clone(),
            _ => Latencies::default(),
        };
        let q = |cur: &[(f64, u64)], old: &[(f64, u64)], p: f64| -> Value {
            quantile(cur, old, p).map_or(Value::Null, |s| json!(s * 1000.0))
        };
        json!({
            "pushP50": q(&current.push, &base.push, 0.5),
            "pushP99": q(&current.push, &base.push, 0.99),
            "pollP50": q(&current.poll, &base.poll, 0.5),
            "pollP99": q(&current.poll, &base.poll, 0.99),
        })
    }
}

/// The histograms' buckets from this process's metrics.
fn gather() -> Latencies {
    let mut out = Latencies::default();
    for family in prometheus::gather() {
        let target = match family.name() {
            "courier_broker_create_to_push_seconds" => &mut out.push,
            "courier_gateway_request_duration_seconds" => &mut out.poll,
            _ => continue,
        };
        for m in family.get_metric() {
            let activate = m
                .get_label()
                .iter()
                .any(|l| l.name() == "method" && l.value() == "ActivateJobs");
            if family.name().starts_with("courier_gateway") && !activate {
                continue;
            }
            let buckets = m.get_histogram().get_bucket();
            add_buckets(
                target,
                buckets
                    .iter()
                    .map(|b| (b.upper_bound(), b.cumulative_count())),
            );
        }
    }
    out
}

fn add_buckets(into: &mut Vec<(f64, u64)>, buckets: impl Iterator<Item = (f64, u64)>) {
    for (i, (bound, count)) in buckets.enumerate() {
        match into.get_mut(i) {
            Some(b) => b.1 += count,
            None => into.push((bound, count)),
        }
    }
}

/// The `p` quantile (seconds) of the observations between `old` and `cur`, as the
/// upper bound of the bucket it falls in; `None` without observations.
fn quantile(cur: &[(f64, u64)], old: &[(f64, u64)], p: f64) -> Option<f64> {
    let delta: Vec<(f64, u64)> = cur
        .iter()
        .enumerate()
        .map(|(i, (b, c))| (*b, c.saturating_sub(old.get(i).map_or(0, |o| o.1))))
        .collect();
    let total = delta.last().map(|d| d.1)?;
    if total == 0 {
        return None;
    }
    let rank = (p * total as f64).ceil() as u64;
    delta.iter().find(|(_, c)| *c >= rank).map(|(b, _)| *b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quantile_is_the_bucket_its_rank_falls_in_over_the_window() {
        let old = [(0.001, 5), (0.01, 5), (0.1, 5)];
        let cur = [(0.001, 5), (0.01, 95), (0.1, 105)];
        assert_eq!(quantile(&cur, &old, 0.5), Some(0.01));
        assert_eq!(quantile(&cur, &old, 0.99), Some(0.1));
        assert_eq!(quantile(&old, &old, 0.5), None);
    }
}
