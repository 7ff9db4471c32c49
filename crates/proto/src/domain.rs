//! Domain types shared by brokers, gateways and clients. Nothing here knows the wire.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Tenant of every job when multi-tenancy is not used (Zeebe's name for it).
pub const DEFAULT_TENANT: &str = "<default>";
/// Job keys carry their partition in the bits above this shift (Zeebe's layout).
pub const KEY_PARTITION_SHIFT: u32 = 51;
/// The most partitions a cluster may have: a larger id would not fit a job key's
/// top bits (a key is a positive `i64`).
pub const MAX_PARTITIONS: u32 = (i64::MAX >> KEY_PARTITION_SHIFT) as u32;
/// Largest variables document a job may carry.
pub const MAX_VARIABLES_BYTES: usize = 4 * 1024 * 1024;
/// Most bytes of a job's own text: its type, tenant, variables, custom headers and
/// process fields together. An activated job must fit in one message of the 4 MiB
/// that Zeebe's clients receive by default (a job that does not could never be
/// handed out, and would time out and come back for ever); 64 KiB are left for the
/// worker's name, the numbers and the framing.
pub const MAX_JOB_BYTES: usize = MAX_VARIABLES_BYTES - 64 * 1024;
/// Longest worker name an activation or a stream may give: an activated job carries
/// it beside its own text, in the 64 KiB that [`MAX_JOB_BYTES`] leaves.
pub const MAX_WORKER_BYTES: usize = 8 * 1024;
/// Longest error code a thrown error may give (codes are names, matched by BPMN
/// error events).
pub const MAX_ERROR_CODE_BYTES: usize = 8 * 1024;
/// Longest error message a job keeps: a longer one (a whole log, by mistake) is cut
/// to this, at a character boundary, and says so, rather than refused, which would
/// leave the failure unrecorded. Every failure writes its message to the log and
/// replicates it, and `GetJob` answers it beside the job.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 32 * 1024;
/// Retries of a job created without an explicit count.
pub const DEFAULT_RETRIES: i32 = 3;

/// A broker's id in the static cluster configuration.
pub type NodeId = u64;

/// The brokers holding `partition`'s replicas: `replication_factor` brokers, taken
/// round-robin from `brokers` (every broker's id, in ascending order), starting each
/// partition on the next broker so that preferred leaders (the first of each list)
/// spread evenly. Brokers place replicas by it; `courier status` uses it to name the
/// replicas of a broker that did not answer.
pub fn replicas_of(brokers: &[NodeId], partition: u32, replication_factor: u32) -> Vec<NodeId> {
    if brokers.is_empty() {
        return Vec::new();
    }
    let start = (partition.saturating_sub(1) as usize) % brokers.len();
    (0..replication_factor as usize)
        .map(|i| brokers[(start + i) % brokers.len()])
        .collect()
}

/// A partition's id; partitions are numbered from 1.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PartitionId(pub u32);

impl fmt::Display for PartitionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A job's key: `(partition << 51) + counter`, unique in the cluster.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct JobKey(pub i64);

impl JobKey {
    /// The key of the `counter`-th job of `partition` (counter starts at 1).
    pub fn new(partition: PartitionId, counter: u64) -> Self {
        let base = i64::from(partition.0) << KEY_PARTITION_SHIFT;
        let low = (counter & ((1u64 << KEY_PARTITION_SHIFT) - 1)) as i64;
        JobKey(base + low)
    }

    /// The partition this key lives on, or `None` for a key no broker could have made.
    pub fn partition(self) -> Option<PartitionId> {
        if self.0 <= 0 {
            return None;
        }
        let p = (self.0 >> KEY_PARTITION_SHIFT) as u32;
        (p > 0).then_some(PartitionId(p))
    }
}

impl fmt::Display for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A `u64` number with a meaning of its own: a newtype that prints as the number
/// and is stored as it.
macro_rules! number_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

number_id!(
    /// One activation of a job: a number unique per activation in its partition, so
    /// that word about an older activation (its push answered, its end, a yield) is
    /// told apart from the current one.
    Lease
);
number_id!(
    /// A gateway's aggregated stream (one per set of activation properties), as the
    /// gateway numbers it and names it on its links.
    StreamId
);
number_id!(
    /// A gateway's link to a broker, as that broker numbers its links (per process).
    LinkId
);

/// Process fields a producer may attach to a job; copied unchanged onto every activation.
/// Courier has no processes, so these are zero/empty unless the producer set them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessContext {
    pub process_instance_key: i64,
    pub bpmn_process_id: String,
    pub process_definition_version: i32,
    pub process_definition_key: i64,
    pub element_id: String,
    pub element_instance_key: i64,
}

/// A job to create, already validated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewJob {
    pub job_type: String,
    /// A JSON object, as text.
    pub variables: String,
    /// A JSON object, as text.
    pub custom_headers: String,
    pub retries: i32,
    pub tenant_id: String,
    pub process: ProcessContext,
}

impl ProcessContext {
    /// Bytes of its text fields.
    pub fn text_bytes(&self) -> usize {
        self.bpmn_process_id.len() + self.element_id.len()
    }
}

/// The wall clock in epoch milliseconds, as job deadlines are given (0 if the clock
/// reads before 1970).
pub fn epoch_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Bytes of a job's own text, as [`MAX_JOB_BYTES`] counts them.
pub fn job_text_bytes(
    job_type: &str,
    tenant_id: &str,
    variables: &str,
    custom_headers: &str,
    process: &ProcessContext,
) -> usize {
    job_type.len() + tenant_id.len() + variables.len() + custom_headers.len() + process.text_bytes()
}

/// The INVALID_ARGUMENT message for a job of `bytes` over [`MAX_JOB_BYTES`].
pub fn job_too_large(bytes: usize) -> String {
    format!(
        "the job would be {bytes} bytes (type, tenant, variables, custom headers and \
         process fields together), more than the limit of {MAX_JOB_BYTES}: a job must \
         fit in the 4 MiB message a Zeebe client receives"
    )
}

/// What a worker asks for when it activates jobs (poll) or opens a stream.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ActivationProps {
    pub job_type: String,
    pub worker: String,
    /// How long an activation lasts before the job becomes runnable again.
    pub timeout_ms: i64,
    /// Variable names to hand over; empty means all.
    pub fetch_variables: Vec<String>,
    /// Tenants whose jobs the worker takes; never empty (defaults to `<default>`).
    pub tenant_ids: Vec<String>,
}

/// A job as handed to a worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivatedJob {
    pub key: JobKey,
    pub job_type: String,
    pub worker: String,
    pub retries: i32,
    /// Epoch ms after which the activation times out.
    pub deadline: i64,
    /// A JSON object, filtered by the activation's fetch variables.
    pub variables: String,
    pub custom_headers: String,
    pub tenant_id: String,
    pub process: ProcessContext,
}

/// Where a job stands, as reported by GetJob.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobStateKind {
    Activatable,
    Activated,
    FailedBackOff,
    Incident,
    ErrorThrown,
}

/// A job's full record, as reported by GetJob.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobView {
    pub key: JobKey,
    pub job_type: String,
    pub state: JobStateKind,
    pub retries: i32,
    pub worker: String,
    pub deadline: i64,
    pub retry_at: i64,
    pub error_message: String,
    pub error_code: String,
    pub variables: String,
    pub custom_headers: String,
    pub tenant_id: String,
    pub created_at: i64,
}

/// A change a client asks a partition to make; each is replicated through the log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Create jobs, all on this partition, in one log entry.
    Create(Vec<NewJob>),
    /// Activate up to `max_jobs` activatable jobs (long polling), however many bytes
    /// they hold: what a gateway of format 3 sent, read from logs of that format and
    /// carried out as then. Gateways now send [`Command::ActivateWithin`].
    Activate {
        props: ActivationProps,
        max_jobs: u32,
    },
    Complete {
        key: JobKey,
        variables: Option<String>,
    },
    Fail {
        key: JobKey,
        retries: i32,
        error_message: String,
        retry_backoff_ms: i64,
        variables: Option<String>,
    },
    ThrowError {
        key: JobKey,
        error_code: String,
        error_message: String,
        variables: Option<String>,
    },
    UpdateRetries {
        key: JobKey,
        retries: i32,
    },
    UpdateTimeout {
        key: JobKey,
        timeout_ms: i64,
    },
    Cancel {
        key: JobKey,
    },
    /// `command` (a create, an activation, a fail or a thrown error), carried out
    /// once per `request`: a command with the id of one applied within
    /// [`ONCE_WINDOW_MS`] before it changes nothing and answers as that one did (a
    /// create with the keys it made, an activation with the jobs it activated that
    /// it still holds). A gateway sends those commands of its clients this way, so
    /// one sent again to a new leader, after the answer of an attempt that was
    /// applied got lost, neither creates the jobs twice, nor leaves activated jobs
    /// to their timeout, nor fails the job's next activation. Last of the
    /// variants: entries written before it read the same.
    Once {
        request: RequestId,
        #[serde(deserialize_with = "once_inner")]
        command: Box<Command>,
    },
    /// Activate up to `max_jobs` activatable jobs, oldest first, as long as their
    /// sizes ([`activated_size_bound`]) add up to at most `max_bytes`: the answer
    /// then fits in one message, and a backlog of large jobs goes out over several
    /// polls instead of in one answer larger than any transport takes. A job always
    /// fits in [`MAX_ACTIVATE_BYTES`] alone. Last of the variants: entries written
    /// before it read the same.
    ActivateWithin {
        props: ActivationProps,
        max_jobs: u32,
        max_bytes: u64,
    },
}

/// Most bytes of jobs one ActivateJobs answer carries, as [`activated_size_bound`]
/// counts them: the 4 MiB that Zeebe's gateway allows and that gRPC clients accept
/// by default (Java, Go, Node.js, tonic). The largest job ([`MAX_JOB_BYTES`] with a
/// worker name of [`MAX_WORKER_BYTES`]) fits alone.
pub const MAX_ACTIVATE_BYTES: usize = 4 * 1024 * 1024;

/// What an activated job takes in an answer, at most: its text (see
/// [`job_text_bytes`]), the worker's name, and room for the numbers and framing.
pub fn activated_size_bound(text_bytes: usize, worker: &str) -> usize {
    text_bytes + worker.len() + 256
}

const _: () = assert!(MAX_JOB_BYTES + MAX_WORKER_BYTES + 256 <= MAX_ACTIVATE_BYTES);

thread_local! {
    /// Whether the decoder is inside a [`Command::Once`] on this thread.
    static IN_ONCE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Decodes the command a [`Command::Once`] wraps, refusing another `Once` inside:
/// the protocol nests one level only, and a crafted chain of them would otherwise
/// recurse until the decoder overflowed the stack.
fn once_inner<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Box<Command>, D::Error> {
    if IN_ONCE.with(|c| c.replace(true)) {
        return Err(serde::de::Error::custom(
            "a once-only command may not wrap another",
        ));
    }
    let inner = Box::<Command>::deserialize(d);
    IN_ONCE.with(|c| c.set(false));
    inner
}

impl Command {
    /// The command itself: the one a [`Command::Once`] wraps, or this one.
    pub fn inner(&self) -> &Command {
        match self {
            Command::Once { command, .. } => command,
            other => other,
        }
    }

    /// An activation's properties, most jobs and most bytes (unbounded for a
    /// [`Command::Activate`]).
    pub fn activation(&self) -> Option<(&ActivationProps, u32, u64)> {
        match self {
            Command::Activate { props, max_jobs } => Some((props, *max_jobs, u64::MAX)),
            Command::ActivateWithin {
                props,
                max_jobs,
                max_bytes,
            } => Some((props, *max_jobs, *max_bytes)),
            _ => None,
        }
    }

    /// The request id of a [`Command::Once`].
    pub fn once_request(&self) -> Option<RequestId> {
        match self {
            Command::Once { request, .. } => Some(*request),
            _ => None,
        }
    }
}

/// A gateway's id of one request; the same in every attempt to carry it out.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u128);

/// How long (ms of the leaders' clocks) a partition remembers the request id of a
/// [`Command::Once`] it applied. A gateway sends one again only within
/// [`RESEND_FOR_MS`] of its first attempt; the rest of the window allows for the
/// clocks of two leaders telling different times.
pub const ONCE_WINDOW_MS: i64 = 120_000;

/// How long after its first attempt a gateway may still send a [`Command::Once`]
/// again.
pub const RESEND_FOR_MS: u64 = 60_000;

/// A request from a gateway to the leader of one partition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// A change, replicated through the log.
    Command(Command),
    /// Read one job from the leader's state.
    GetJob { key: JobKey },
    /// Jobs of the partition matching `filter`, in key order after `after`, at
    /// most `limit` (without their variables and headers). Last of the variants:
    /// an older gateway's requests read the same.
    ListJobs {
        filter: JobFilter,
        after: Option<JobKey>,
        limit: u32,
    },
    /// Counts per job type and tenant of the jobs matching `filter`.
    JobStats { filter: JobFilter },
}

/// Which jobs a listing, statistics or bulk change is about; an empty field
/// matches every job.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobFilter {
    pub job_type: Option<String>,
    pub states: Vec<JobStateKind>,
    pub tenants: Vec<String>,
    /// Epoch ms; created at or after.
    pub created_after: Option<i64>,
    /// Epoch ms; created before.
    pub created_before: Option<i64>,
}

impl JobFilter {
    /// Whether a job of these properties matches.
    pub fn matches(
        &self,
        job_type: &str,
        tenant: &str,
        state: JobStateKind,
        created_at: i64,
    ) -> bool {
        self.job_type.as_deref().is_none_or(|t| t == job_type)
            && (self.states.is_empty() || self.states.contains(&state))
            && (self.tenants.is_empty() || self.tenants.iter().any(|t| t == tenant))
            && self.created_after.is_none_or(|a| created_at >= a)
            && self.created_before.is_none_or(|b| created_at < b)
    }
}

/// Jobs of one type and tenant on one partition (or, merged, the cluster).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TypeStats {
    pub job_type: String,
    pub tenant_id: String,
    pub activatable: u64,
    pub activated: u64,
    pub failed_back_off: u64,
    pub incident: u64,
    pub error_thrown: u64,
    /// Epoch ms of creation of the oldest activatable job, if any.
    pub oldest_waiting: Option<i64>,
    /// Jobs activated (pushed or polled) per second by the partition's leader,
    /// over the last few seconds.
    pub activations_per_second: f64,
    /// Worker streams registered with the leader for this type and tenant, by
    /// gateway id.
    pub streams: BTreeMap<String, u32>,
}

impl TypeStats {
    /// Nothing counted yet for `job_type` and `tenant_id`.
    pub fn new(job_type: String, tenant_id: String) -> TypeStats {
        TypeStats {
            job_type,
            tenant_id,
            ..TypeStats::default()
        }
    }

    /// Adds `other`'s counts (another partition's) to these.
    pub fn merge(&mut self, other: &TypeStats) {
        self.activatable += other.activatable;
        self.activated += other.activated;
        self.failed_back_off += other.failed_back_off;
        self.incident += other.incident;
        self.error_thrown += other.error_thrown;
        self.oldest_waiting = match (self.oldest_waiting, other.oldest_waiting) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.activations_per_second += other.activations_per_second;
        // Every broker knows every gateway's streams: the most any partition saw.
        for (g, n) in &other.streams {
            let e = self.streams.entry(g.clone()).or_default();
            *e = (*e).max(*n);
        }
    }

    /// Counts a job in `state`.
    pub fn count(&mut self, state: JobStateKind) {
        match state {
            JobStateKind::Activatable => self.activatable += 1,
            JobStateKind::Activated => self.activated += 1,
            JobStateKind::FailedBackOff => self.failed_back_off += 1,
            JobStateKind::Incident => self.incident += 1,
            JobStateKind::ErrorThrown => self.error_thrown += 1,
        }
    }
}

/// The successful answer to a [`Request`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Created(Vec<JobKey>),
    Activated(Vec<ActivatedJob>),
    Done,
    Job(JobView),
    /// A page of [`Request::ListJobs`]: `resume` is the key to list on from, or
    /// `None` once the partition's last job was looked at.
    Jobs {
        jobs: Vec<JobView>,
        resume: Option<JobKey>,
    },
    Stats(Vec<TypeStats>),
}

/// Why a broker refused a request. Each kind maps to one gRPC status code.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum BrokerError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    Unavailable(String),
    /// This broker does not lead the partition; `leader` is its best guess of who does.
    #[error("broker does not lead partition {partition} (leader hint: {leader:?})")]
    NotLeader {
        partition: PartitionId,
        leader: Option<NodeId>,
    },
    #[error("internal error: {0}")]
    Internal(String),
    /// This broker leads the partition but has lost its majority: it refused the
    /// command before queueing it. UNAVAILABLE to clients; a gateway does not wait
    /// on such a leader, and may create elsewhere.
    #[error("{0}")]
    NoMajority(String),
    /// No answer came in time where the command may have been carried out (a create
    /// appended by a leader that then lost its majority commits under the next
    /// one). DEADLINE_EXCEEDED to clients, which gRPC defines as "may have
    /// completed": a client must not simply send it again.
    #[error("{0}")]
    OutcomeUnknown(String),
}

impl BrokerError {
    /// Whether a caller may retry the same request (elsewhere or later).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            BrokerError::Unavailable(_)
                | BrokerError::NoMajority(_)
                | BrokerError::NotLeader { .. }
                | BrokerError::ResourceExhausted(_)
        )
    }
}

/// The one mapping from broker errors to gRPC statuses, used by gateway and broker.
impl From<BrokerError> for tonic::Status {
    fn from(e: BrokerError) -> Self {
        use tonic::Status;
        match e {
            BrokerError::InvalidArgument(m) => Status::invalid_argument(m),
            BrokerError::NotFound(m) => Status::not_found(m),
            BrokerError::FailedPrecondition(m) => Status::failed_precondition(m),
            BrokerError::ResourceExhausted(m) => Status::resource_exhausted(m),
            BrokerError::Unavailable(m) | BrokerError::NoMajority(m) => Status::unavailable(m),
            e @ BrokerError::NotLeader { .. } => Status::unavailable(e.to_string()),
            BrokerError::Internal(m) => Status::internal(m),
            BrokerError::OutcomeUnknown(m) => Status::deadline_exceeded(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_once_wraps_one_command_and_a_chain_of_them_is_refused_not_a_stack_overflow() {
        let once = |c: Command| Command::Once {
            request: RequestId(7),
            command: Box::new(c),
        };
        let ok = once(Command::Cancel { key: JobKey(5) });
        let bytes = crate::codec::to_vec(&ok).unwrap();
        assert_eq!(crate::codec::decode::<Command>(&bytes).unwrap(), ok);
        let twice = crate::codec::to_vec(&once(ok.clone())).unwrap();
        let e = crate::codec::decode::<Command>(&twice)
            .unwrap_err()
            .to_string();
        assert!(e.contains("codec"), "{e}");
        // A million nested Onces, written by hand (the encoder would recurse too):
        // variant 8 (Once), the request id as a one-byte varint, then the next one.
        let mut crafted = Vec::new();
        for _ in 0..1_000_000 {
            crafted.extend_from_slice(&[8u8, 7]);
        }
        assert_eq!(&crafted[..2], &bytes[..2], "the layout of a Once changed");
        crafted
            .extend_from_slice(&crate::codec::to_vec(&Command::Cancel { key: JobKey(5) }).unwrap());
        assert!(crate::codec::decode::<Command>(&crafted).is_err());
        // The decoder is usable again after a refusal.
        assert_eq!(crate::codec::decode::<Command>(&bytes).unwrap(), ok);
    }

    #[test]
    fn keys_round_trip_their_partition() {
        for p in [1u32, 2, 3, 1000] {
            let k = JobKey::new(PartitionId(p), 42);
            assert_eq!(k.partition(), Some(PartitionId(p)));
            assert_eq!(k.0 & ((1 << KEY_PARTITION_SHIFT) - 1), 42);
        }
        // Zeebe's published layout: partition 1, counter 1.
        assert_eq!(JobKey::new(PartitionId(1), 1).0, 2251799813685249);
        assert_eq!(JobKey(0).partition(), None);
        assert_eq!(JobKey(-5).partition(), None);
        assert_eq!(JobKey(17).partition(), None);
    }
}
