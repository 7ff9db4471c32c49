//! The gateway's one error type and its one mapping to gRPC statuses.

use courier_proto::domain::BrokerError;

/// Everything that can go wrong in the gateway, from bad client input to a broken
/// listener.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The client's request is malformed; the message names the field.
    #[error("{0}")]
    InvalidArgument(String),
    /// The gateway is at one of its admission bounds (see [`crate::admission`]).
    #[error("{0}")]
    ResourceExhausted(String),
    /// The caller may not act for the tenant the request names.
    #[error("{0}")]
    PermissionDenied(String),
    /// The request reached no broker or a broker refused it.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// A broker address in the configuration cannot be used.
    #[error("broker address '{addr}' is not usable: {reason}")]
    BadBrokerAddress {
        /// The address as configured.
        addr: String,
        /// Why it was refused.
        reason: String,
    },
    /// The configuration names no broker to learn the cluster from.
    #[error("no broker address configured")]
    NoBrokers,
    /// Certificates or keys that cannot be used.
    #[error("TLS: {0}")]
    Tls(#[from] courier_proto::tls::TlsError),
    /// A token file or OAuth keys that cannot be used.
    #[error("authentication: {0}")]
    Auth(#[from] crate::auth::AuthConfigError),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Server(#[from] tonic::transport::Error),
}

impl From<GatewayError> for tonic::Status {
    fn from(e: GatewayError) -> Self {
        match e {
            GatewayError::InvalidArgument(m) => tonic::Status::invalid_argument(m),
            GatewayError::PermissionDenied(m) => tonic::Status::permission_denied(m),
            GatewayError::ResourceExhausted(m) => tonic::Status::resource_exhausted(m),
            GatewayError::Broker(b) => b.into(),
            e @ (GatewayError::BadBrokerAddress { .. }
            | GatewayError::NoBrokers
            | GatewayError::Tls(_)
            | GatewayError::Auth(_)
            | GatewayError::Server(_)) => tonic::Status::internal(e.to_string()),
        }
    }
}
