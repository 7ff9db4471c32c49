//! The one error type of the client.

use tonic::Code;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address is not usable (malformed, unsupported scheme, no Tokio runtime).
    /// Unreachable gateways show up as `Status(UNAVAILABLE)` instead: connecting is lazy.
    #[error("cannot connect to {addr:?}: {reason}")]
    Connect {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The gateway (or the transport below it) answered with this status.
    // Not a `#[source]`: the status's own Display and debug-laden source chain would
    // repeat in every `{:#}` report; `status_text` picks what is worth reading.
    #[error("{}", status_text(.0))]
    Status(tonic::Status),
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> Self {
        ClientError::Status(status)
    }
}

impl ClientError {
    /// Whether the call may have been carried out although it failed: the
    /// connection broke while it was out (`UNKNOWN`, as tonic reports a transport
    /// error mid-call), it was cancelled, or its deadline passed. A refusal, or an
    /// `UNAVAILABLE` for a gateway that could not be reached, did nothing.
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self.code(),
            Some(Code::Unknown | Code::Cancelled | Code::DeadlineExceeded)
        )
    }

    /// The gRPC code of a `Status` error; `None` for `Connect`.
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Connect { .. } => None,
            ClientError::Status(s) => Some(s.code()),
        }
    }
}

/// `CODE: message`, plus the innermost cause when the transport failed (for example
/// `Connection refused`), which is the part that says what went wrong.
pub(crate) fn status_text(status: &tonic::Status) -> String {
    // A server without the method says nothing more; the usual cause is an address
    // that is not a gateway's (a broker's, or another service's).
    let message = if status.code() == Code::Unimplemented && status.message().is_empty() {
        "the server does not serve this method: is the address a Courier gateway's?"
    } else {
        status.message()
    };
    let mut text = format!("{}: {}", code_name(status.code()), message);
    let mut cause = std::error::Error::source(status);
    let mut innermost = None;
    while let Some(c) = cause {
        innermost = Some(c);
        cause = c.source();
    }
    if let Some(c) = innermost.map(ToString::to_string) {
        if c != status.message() {
            text.push_str(": ");
            text.push_str(&c);
        }
    }
    if let Some(hint) = tls_hint(&text) {
        text.push_str(hint);
    }
    text
}

/// What a plaintext client at a TLS port, or a TLS client at a plaintext port,
/// reads in its error, explained.
fn tls_hint(text: &str) -> Option<&'static str> {
    if text.contains("frame with invalid size") || text.contains("invalid HTTP version") {
        Some(" (the gateway may speak TLS: use --tls-ca FILE or an https:// address)")
    } else if text.contains("InvalidContentType") || text.contains("corrupt message") {
        Some(" (the gateway may not speak TLS: use a plain host:port address)")
    } else {
        None
    }
}

/// The code's name as gRPC spells it (`NOT_FOUND`), which is what users search for;
/// `Code`'s own `Display` gives a prose description instead.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_connection_or_a_passed_deadline_leaves_the_outcome_unknown() {
        let of = |code| ClientError::from(tonic::Status::new(code, "x")).outcome_unknown();
        assert!(of(Code::Unknown) && of(Code::Cancelled) && of(Code::DeadlineExceeded));
        assert!(!of(Code::NotFound) && !of(Code::InvalidArgument) && !of(Code::Unavailable));
        let connect = ClientError::Connect {
            addr: "x".into(),
            reason: "y".into(),
        };
        assert!(!connect.outcome_unknown());
    }

    #[test]
    fn an_error_from_the_wrong_side_of_tls_says_so() {
        let at_tls_port = "INTERNAL: h2 protocol error: http2 error: connection error detected: frame with invalid size";
        assert!(tls_hint(at_tls_port).is_some_and(|h| h.contains("may speak TLS")));
        let at_plain_port =
            "UNAVAILABLE: tcp connect error: received corrupt message of type InvalidContentType";
        assert!(tls_hint(at_plain_port).is_some_and(|h| h.contains("may not speak TLS")));
        assert_eq!(tls_hint("UNAVAILABLE: connection refused"), None);
    }

    #[test]
    fn status_errors_read_like_grpc() {
        let e = ClientError::from(tonic::Status::not_found("job 2251799813685249 not found"));
        assert_eq!(e.to_string(), "NOT_FOUND: job 2251799813685249 not found");
        assert_eq!(e.code(), Some(Code::NotFound));
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = ClientError::from(tonic::Status::from_error(Box::new(io)));
        assert_eq!(e.to_string(), "UNKNOWN: refused");
        let e = ClientError::Connect {
            addr: "x".into(),
            reason: "bad".into(),
        };
        assert_eq!(e.code(), None);
        let e = ClientError::from(tonic::Status::unimplemented(""));
        assert_eq!(
            e.to_string(),
            "UNIMPLEMENTED: the server does not serve this method: is the address a Courier gateway's?"
        );
        let e = ClientError::from(tonic::Status::unimplemented("no deploy here"));
        assert_eq!(e.to_string(), "UNIMPLEMENTED: no deploy here");
    }
}
