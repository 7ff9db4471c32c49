//! Builders for what the calls send. Each converts into its wire request, so a caller
//! that already has a wire request can pass that instead.

use courier_proto::courier_v1 as v1;
use courier_proto::gateway_protocol as gw;
use std::time::Duration;

/// A JSON document as the wire carries it: text. Text is passed through unchecked;
/// the gateway answers INVALID_ARGUMENT when it is not a JSON object.
pub trait IntoJsonText {
    /// The document as JSON text.
    fn into_json_text(self) -> String;
}

impl IntoJsonText for serde_json::Value {
    fn into_json_text(self) -> String {
        self.to_string()
    }
}

impl IntoJsonText for &serde_json::Value {
    fn into_json_text(self) -> String {
        self.to_string()
    }
}

impl IntoJsonText for String {
    fn into_json_text(self) -> String {
        self
    }
}

impl IntoJsonText for &str {
    fn into_json_text(self) -> String {
        self.to_string()
    }
}

/// A job to create: `NewJob::new("payment").variables(json!({"amount": 42})).retries(5)`.
/// Unset fields take the gateway's defaults: no variables, no headers, 3 retries, the
/// `<default>` tenant.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewJob {
    job_type: String,
    variables: String,
    custom_headers: String,
    retries: Option<i32>,
    tenant_id: String,
}

impl NewJob {
    /// A job of this type.
    pub fn new(job_type: impl Into<String>) -> Self {
        NewJob {
            job_type: job_type.into(),
            ..Default::default()
        }
    }

    /// The job's variables: a JSON object.
    pub fn variables(mut self, variables: impl IntoJsonText) -> Self {
        self.variables = variables.into_json_text();
        self
    }

    /// The job's custom headers: a JSON object of string values.
    pub fn custom_headers(mut self, headers: impl IntoJsonText) -> Self {
        self.custom_headers = headers.into_json_text();
        self
    }

    /// How many times the job may fail before it becomes an incident.
    pub fn retries(mut self, retries: i32) -> Self {
        self.retries = Some(retries);
        self
    }

    /// The tenant the job belongs to.
    pub fn tenant_id(mut self, tenant_id: impl Into<String>) -> Self {
        self.tenant_id = tenant_id.into();
        self
    }
}

impl From<NewJob> for v1::CreateJobRequest {
    fn from(j: NewJob) -> Self {
        v1::CreateJobRequest {
            r#type: j.job_type,
            variables: j.variables,
            custom_headers: j.custom_headers,
            retries: j.retries,
            tenant_id: j.tenant_id,
            ..Default::default()
        }
    }
}

/// A long-poll activation: `ActivateJobs::new("payment").worker("billing").max_jobs(32)`.
/// Defaults follow the Java client: worker `default`, 32 jobs, a 5 minute job timeout,
/// the gateway's own long-poll timeout, all variables, the `<default>` tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActivateJobs {
    job_type: String,
    worker: String,
    max_jobs: i32,
    timeout: Duration,
    /// `None`: the gateway's default long poll.
    request_timeout: Option<Duration>,
    fetch_variables: Vec<String>,
    tenant_ids: Vec<String>,
}

impl ActivateJobs {
    /// Activate jobs of this type.
    pub fn new(job_type: impl Into<String>) -> Self {
        ActivateJobs {
            job_type: job_type.into(),
            worker: "default".to_string(),
            max_jobs: 32,
            timeout: Duration::from_secs(300),
            request_timeout: None,
            fetch_variables: Vec::new(),
            tenant_ids: Vec::new(),
        }
    }

    /// The worker name recorded on the activated jobs.
    pub fn worker(mut self, worker: impl Into<String>) -> Self {
        self.worker = worker.into();
        self
    }

    /// At most this many jobs.
    pub fn max_jobs(mut self, max_jobs: i32) -> Self {
        self.max_jobs = max_jobs;
        self
    }

    /// How long the activation lasts before the job becomes runnable again.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long the gateway may hold the request while no job is there.
    /// `Duration::ZERO` means no long polling: answer at once, possibly with no jobs.
    pub fn request_timeout(mut self, request_timeout: Duration) -> Self {
        self.request_timeout = Some(request_timeout);
        self
    }

    /// Hand over only these variables (all when none is named).
    pub fn fetch_variables(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.fetch_variables = names.into_iter().map(Into::into).collect();
        self
    }

    /// Take jobs of these tenants (`<default>` when none is named).
    pub fn tenant_ids(mut self, tenants: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.tenant_ids = tenants.into_iter().map(Into::into).collect();
        self
    }
}

impl From<ActivateJobs> for gw::ActivateJobsRequest {
    fn from(a: ActivateJobs) -> Self {
        // The wire's 0 is "the gateway's default" and a negative value is "answer at
        // once"; a zero Duration reads as the latter, so it maps to -1.
        let request_timeout = match a.request_timeout {
            None => 0,
            Some(d) if d.is_zero() => -1,
            Some(d) => millis(d),
        };
        gw::ActivateJobsRequest {
            r#type: a.job_type,
            worker: a.worker,
            timeout: millis(a.timeout),
            max_jobs_to_activate: a.max_jobs,
            fetch_variable: a.fetch_variables,
            request_timeout,
            tenant_ids: a.tenant_ids,
        }
    }
}

/// The metadata header that tells a Courier gateway how many pushed jobs a
/// `StreamActivatedJobs` client may hold unfinished (its push credit). Zeebe's clients
/// never send it; a gateway that does not know it ignores it.
pub const MAX_JOBS_ACTIVE_HEADER: &str = "courier-max-jobs-active";

/// The metadata header that tells a Courier gateway which jobs a
/// `StreamActivatedJobs` client holds already (from an earlier stream, or polled):
/// `KEY:DEADLINE_MS` pairs separated by commas. The gateway counts them against the
/// stream's credit until they finish or their deadlines pass, so it does not push
/// jobs the worker has no room for.
pub const JOBS_HELD_HEADER: &str = "courier-jobs-held";

/// The most jobs a [`StreamJobs`] declares in [`JOBS_HELD_HEADER`] (about 8 KiB).
pub const MAX_DECLARED_HELD: usize = 256;

/// A job stream: `StreamJobs::new("payment").worker("billing").max_jobs_active(32)`.
/// Defaults as [`ActivateJobs`]: worker `default`, a 5 minute job timeout, all
/// variables, the `<default>` tenant, and no stated capacity (the gateway's default).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamJobs {
    job_type: String,
    worker: String,
    timeout: Duration,
    fetch_variables: Vec<String>,
    tenant_ids: Vec<String>,
    /// Sent as [`MAX_JOBS_ACTIVE_HEADER`], not in the message: the wire message is
    /// Zeebe's and has no such field.
    max_jobs_active: Option<u32>,
    /// (key, deadline in epoch ms) of jobs held already; sent as
    /// [`JOBS_HELD_HEADER`].
    held: Vec<(i64, i64)>,
    /// Heartbeat interval asked of the gateway.
    heartbeat: Option<Duration>,
    /// The caller reopens a stream the gateway ends on purpose.
    reopens: bool,
}

impl StreamJobs {
    /// Stream jobs of this type.
    pub fn new(job_type: impl Into<String>) -> Self {
        StreamJobs {
            job_type: job_type.into(),
            worker: "default".to_string(),
            timeout: Duration::from_secs(300),
            fetch_variables: Vec::new(),
            tenant_ids: Vec::new(),
            max_jobs_active: None,
            held: Vec::new(),
            heartbeat: None,
            reopens: false,
        }
    }

    /// The worker name recorded on the pushed jobs.
    pub fn worker(mut self, worker: impl Into<String>) -> Self {
        self.worker = worker.into();
        self
    }

    /// How long each activation lasts before the job becomes runnable again.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Hand over only these variables (all when none is named).
    pub fn fetch_variables(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.fetch_variables = names.into_iter().map(Into::into).collect();
        self
    }

    /// Take jobs of these tenants (`<default>` when none is named).
    pub fn tenant_ids(mut self, tenants: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.tenant_ids = tenants.into_iter().map(Into::into).collect();
        self
    }

    /// How many pushed jobs this client holds at most: its push credit.
    pub fn max_jobs_active(mut self, max: u32) -> Self {
        self.max_jobs_active = Some(max);
        self
    }

    /// Jobs this client holds already, as (job key, activation deadline in epoch
    /// ms, as in [`ActivatedJob::deadline`](gw::ActivatedJob)): a worker reopening
    /// its stream while handlers run. A Courier gateway counts them against the
    /// stated credit until they finish through it or their deadlines pass. At most
    /// [`MAX_DECLARED_HELD`] are sent.
    pub fn jobs_held(mut self, held: impl IntoIterator<Item = (i64, i64)>) -> Self {
        self.held = held.into_iter().take(MAX_DECLARED_HELD).collect();
        self
    }

    /// Asks a Courier gateway for a heartbeat whenever the stream carried nothing
    /// for `every` (100 ms to 60 s): an `ActivatedJob` with key 0
    /// ([`courier_proto::headers::HEARTBEAT_KEY`]) and nothing else, which is no
    /// job. A [`JobWorker`](crate::JobWorker) asks for one to see a stream that went
    /// silent (a proxy that stopped forwarding) and reopens it elsewhere.
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = Some(every);
        self
    }

    /// States that the caller reopens the stream when a Courier gateway ends it
    /// with UNAVAILABLE and a [`courier_proto::headers::STREAM_END_HEADER`]
    /// trailer, at once and (after `shutdown`) elsewhere, as a
    /// [`JobWorker`](crate::JobWorker) does. Only then does the gateway end the
    /// stream at its maximum age, so streams spread over the gateways there are.
    pub fn reopens(mut self) -> Self {
        self.reopens = true;
        self
    }

    /// Whether the caller said it reopens.
    pub(crate) fn reopens_stated(&self) -> bool {
        self.reopens
    }

    /// The heartbeat interval asked for, in ms.
    pub(crate) fn heartbeat_ms(&self) -> Option<u64> {
        self.heartbeat.map(|d| d.as_millis() as u64)
    }

    /// The stated credit, if any.
    pub(crate) fn credit(&self) -> Option<u32> {
        self.max_jobs_active
    }

    /// The [`JOBS_HELD_HEADER`] value, if any job is declared.
    pub(crate) fn held_header(&self) -> Option<String> {
        if self.held.is_empty() {
            return None;
        }
        let pairs: Vec<String> = self
            .held
            .iter()
            .map(|(key, deadline)| format!("{key}:{deadline}"))
            .collect();
        Some(pairs.join(","))
    }
}

impl From<StreamJobs> for gw::StreamActivatedJobsRequest {
    fn from(s: StreamJobs) -> Self {
        gw::StreamActivatedJobsRequest {
            r#type: s.job_type,
            worker: s.worker,
            timeout: millis(s.timeout),
            fetch_variable: s.fetch_variables,
            tenant_ids: s.tenant_ids,
        }
    }
}

/// Milliseconds as the wire counts them, saturating rather than wrapping.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_bare_new_job_leaves_defaults_to_the_gateway() {
        let r = v1::CreateJobRequest::from(NewJob::new("payment"));
        assert_eq!(
            r,
            v1::CreateJobRequest {
                r#type: "payment".into(),
                ..Default::default()
            }
        );
        assert_eq!(r.retries, None);
    }

    #[test]
    fn new_job_sets_every_field() {
        let r = v1::CreateJobRequest::from(
            NewJob::new("payment")
                .variables(json!({"amount": 42}))
                .custom_headers(r#"{"k":"v"}"#)
                .retries(5)
                .tenant_id("acme"),
        );
        assert_eq!(r.r#type, "payment");
        assert_eq!(r.variables, r#"{"amount":42}"#);
        assert_eq!(r.custom_headers, r#"{"k":"v"}"#);
        assert_eq!(r.retries, Some(5));
        assert_eq!(r.tenant_id, "acme");
        assert_eq!(r.process_instance_key, 0);
    }

    #[test]
    fn json_text_comes_from_values_and_text() {
        let v = json!({"a": [1, 2]});
        assert_eq!((&v).into_json_text(), r#"{"a":[1,2]}"#);
        assert_eq!(v.into_json_text(), r#"{"a":[1,2]}"#);
        assert_eq!("{}".into_json_text(), "{}");
        assert_eq!(String::new().into_json_text(), "");
    }

    #[test]
    fn activate_jobs_defaults_and_long_poll_modes() {
        let r = gw::ActivateJobsRequest::from(ActivateJobs::new("t"));
        assert_eq!(r.worker, "default");
        assert_eq!(r.max_jobs_to_activate, 32);
        assert_eq!(r.timeout, 300_000);
        assert_eq!(r.request_timeout, 0);
        assert!(r.tenant_ids.is_empty() && r.fetch_variable.is_empty());

        let r = gw::ActivateJobsRequest::from(
            ActivateJobs::new("t")
                .worker("w")
                .max_jobs(3)
                .timeout(Duration::from_secs(10))
                .request_timeout(Duration::from_millis(1500))
                .fetch_variables(["a", "b"])
                .tenant_ids(["acme"]),
        );
        assert_eq!(r.worker, "w");
        assert_eq!(r.max_jobs_to_activate, 3);
        assert_eq!(r.timeout, 10_000);
        assert_eq!(r.request_timeout, 1500);
        assert_eq!(r.fetch_variable, ["a", "b"]);
        assert_eq!(r.tenant_ids, ["acme"]);

        let r =
            gw::ActivateJobsRequest::from(ActivateJobs::new("t").request_timeout(Duration::ZERO));
        assert_eq!(r.request_timeout, -1);
    }

    #[test]
    fn stream_jobs_defaults_and_options() {
        let r = gw::StreamActivatedJobsRequest::from(StreamJobs::new("t"));
        assert_eq!(r.worker, "default");
        assert_eq!(r.timeout, 300_000);
        assert!(r.tenant_ids.is_empty() && r.fetch_variable.is_empty());
        assert_eq!(StreamJobs::new("t").credit(), None);

        let s = StreamJobs::new("t")
            .worker("w")
            .timeout(Duration::from_secs(10))
            .fetch_variables(["a"])
            .tenant_ids(["acme"])
            .max_jobs_active(4);
        assert_eq!(s.credit(), Some(4));
        let r = gw::StreamActivatedJobsRequest::from(s);
        assert_eq!(
            (r.worker.as_str(), r.timeout, r.fetch_variable, r.tenant_ids),
            ("w", 10_000, vec!["a".to_string()], vec!["acme".to_string()])
        );
    }

    #[test]
    fn millis_saturate() {
        assert_eq!(millis(Duration::from_millis(5)), 5);
        assert_eq!(millis(Duration::MAX), i64::MAX);
    }
}
