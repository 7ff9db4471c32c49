//! Metadata headers between Courier's client and its gateway beyond Zeebe's
//! protocol. Zeebe's clients never send them, and ignore those a gateway sends.

/// Request header of `StreamActivatedJobs`: the heartbeat interval the client asks
/// for, in milliseconds. The gateway echoes the interval it will keep in the
/// response's initial metadata, then sends a heartbeat ([`HEARTBEAT_KEY`]) whenever
/// the stream carried nothing for that long, so the client sees a silent stall.
pub const HEARTBEAT_HEADER: &str = "courier-heartbeat-ms";

/// The key of a heartbeat on a job stream: an `ActivatedJob` with this key and
/// nothing else is no job. Keys carry their partition (from 1) in their top bits,
/// so no job has key 0.
pub const HEARTBEAT_KEY: i64 = 0;

/// Request header of `StreamActivatedJobs` (value `1`): the client reopens a stream
/// the gateway ends with [`STREAM_END_HEADER`]. Only such streams are ended at the
/// gateway's maximum stream age: some of Zeebe's clients never reopen a stream.
pub const STREAM_REOPENS_HEADER: &str = "courier-stream-reopens";

/// Response header of `StreamActivatedJobs` for a client that reopens: the id of
/// the stream, which `courier.v1.Jobs/EndStream` on the same gateway takes.
pub const STREAM_ID_HEADER: &str = "courier-stream-id";

/// Trailer of a job stream the gateway ended on purpose (status UNAVAILABLE): its
/// value says why, and the client reopens at once, without back-off.
pub const STREAM_END_HEADER: &str = "courier-stream-end";

/// [`STREAM_END_HEADER`]: the stream reached its maximum age; reopen anywhere.
pub const STREAM_END_MAX_AGE: &str = "max-age";

/// [`STREAM_END_HEADER`]: the client asked for the end (`EndStream`).
pub const STREAM_END_ASKED: &str = "asked";

/// [`STREAM_END_HEADER`]: the client stopped saying it reads the stream.
pub const STREAM_END_STALLED: &str = "stalled";

/// [`STREAM_END_HEADER`]: the gateway is shutting down; reopen on another one.
pub const STREAM_END_SHUTDOWN: &str = "shutdown";

/// Response header of every call: how many job streams the answering gateway holds,
/// so a client opens its next stream on a lighter one.
pub const GATEWAY_STREAMS_HEADER: &str = "courier-gateway-streams";
