//! # Layout
//! - [`gateway_protocol`]: Zeebe's job API (generated), spoken to workers.
//! - [`courier_v1`]: Courier's producer API (generated).
//! - [`cluster`]: broker <-> broker and gateway <-> broker traffic (generated).
//! - [`domain`]: the types every other crate works with (job keys, requests,
//!   replies, errors), independent of the wire.
//! - [`validate`]: checks on client input that map to INVALID_ARGUMENT.
//! - [`codec`]: the one place that turns domain values into cluster payloads and back.
//! - [`mux`]: request/reply calls multiplexed on one long-lived gRPC stream.
//! - [`headers`]: metadata headers between Courier's client and gateway.
//! - [`backoff`]: full-jitter exponential back-off, for every retry loop.
//! - [`sync`]: the one way a lock is taken.
//! - [`tls`]: TLS on the client port and mutual TLS inside the cluster.
//! - [`push_refusal`]: why a gateway refuses a pushed job.

#![allow(clippy::derive_partial_eq_without_eq)]

pub mod api;
pub mod backoff;
pub mod codec;
pub mod convert;
pub mod domain;
pub mod headers;
pub mod mux;
pub mod sync;
pub mod tls;
pub mod trace;
pub mod validate;
pub mod wire;

/// Zeebe's gateway protocol, job part.
#[allow(missing_docs, clippy::all)]
pub mod gateway_protocol {
    tonic::include_proto!("gateway_protocol");
}

/// Courier's own packages, nested as in the .proto files so generated references
/// between packages (`super::super::gateway_protocol`) resolve.
pub mod courier {
    /// Courier's producer API.
    #[allow(missing_docs, clippy::all)]
    pub mod v1 {
        tonic::include_proto!("courier.v1");
    }

    /// Traffic inside a cluster.
    #[allow(missing_docs, clippy::all)]
    pub mod cluster {
        tonic::include_proto!("courier.cluster");
    }
}

pub use courier::cluster;
pub use courier::v1 as courier_v1;

/// Largest message between brokers, and between gateways and brokers, each way: a
/// command may carry documents of up to 4 MiB and a Raft append carries many
/// commands. Both ends of every cluster call use this one bound.
pub const MAX_CLUSTER_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// Metadata on a gateway's command stream to a broker: the gateway's id, as in the
/// hello of its link. A broker does not tell a gateway about the end of a pushed
/// job's activation when that gateway itself sent the command that ended it.
pub const GATEWAY_ID_HEADER: &str = "courier-gateway-id";

/// Metadata on a broker's Raft stream and snapshot chunks to a peer: the data format
/// its log entries and snapshots are written in. A peer of another format refuses
/// them (FAILED_PRECONDITION) rather than misread them.
pub const DATA_FORMAT_HEADER: &str = "courier-data-format";

/// Why a gateway refused a push: the `reason` of a `PushAck` that is not accepted.
/// Shared so that brokers and gateways count pushes by the same reasons on
/// `/metrics`.
pub mod push_refusal {
    /// The stream has no client.
    pub const NO_CLIENT: &str = "no_client";
    /// The push names a stream the gateway does not have (any more: it may have just
    /// lost its last client).
    pub const UNKNOWN_STREAM: &str = "unknown_stream";
    /// No client of the stream had free credit.
    pub const CLIENTS_FULL: &str = "clients_full";
    /// The gateway holds its most jobs or bytes in flight.
    pub const GATEWAY_FULL: &str = "gateway_full";
    /// A push of an activation the gateway already told a newer leader it does not
    /// hold: that leader has made the job runnable again, so this late push from its
    /// predecessor must not run it (nor be tried elsewhere or yielded).
    pub const DISOWNED: &str = "disowned";
    /// Every reason, for counters that start at zero.
    pub const ALL: [&str; 5] = [
        NO_CLIENT,
        UNKNOWN_STREAM,
        CLIENTS_FULL,
        GATEWAY_FULL,
        DISOWNED,
    ];
}

macro_rules! frame {
    ($($t:ty),*) => {$(
        impl mux::Frame for $t {
            fn id(&self) -> u64 {
                self.id
            }
            fn set_id(&mut self, id: u64) {
                self.id = id;
            }
        }
    )*};
}
frame!(
    cluster::RaftFrame,
    cluster::ExecuteRequest,
    cluster::ExecuteReply
);
