//! Trace context for OpenTelemetry: a job carries its producer's W3C
//! `traceparent` in its custom headers (as a message carries it in its headers in
//! OpenTelemetry's messaging conventions), so the spans of the gateway, the broker
//! and the worker that handles it join the producer's trace. Also read by Zeebe
//! workers with OpenTelemetry of their own.
//!
//! Spans are exported only by a process that installs an exporter (`courier ...
//! --otlp-endpoint`); it calls [`enable`], and the job path looks into a job's
//! headers only then.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The custom header, and the gRPC metadata key, holding a W3C trace context.
pub const TRACEPARENT: &str = "traceparent";

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Says that this process exports spans: jobs' trace contexts are looked at.
pub fn enable() {
    ENABLED.store(true, Relaxed);
}

/// Whether this process exports spans.
pub fn enabled() -> bool {
    ENABLED.load(Relaxed)
}

/// The span context of a W3C `traceparent` (version 00): `None` for anything
/// else, or for an all-zero trace or span id.
pub fn parse(traceparent: &str) -> Option<SpanContext> {
    let mut parts = traceparent.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || parts.next().is_some() || trace.len() != 32 || span.len() != 16 {
        return None;
    }
    let hex = |s: &str| s.bytes().all(|b| b.is_ascii_hexdigit());
    if flags.len() != 2 || !hex(trace) || !hex(span) || !hex(flags) {
        return None;
    }
    let trace = TraceId::from_bytes(u128::from_str_radix(trace, 16).ok()?.to_be_bytes());
    let span = SpanId::from_bytes(u64::from_str_radix(span, 16).ok()?.to_be_bytes());
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()?);
    let cx = SpanContext::new(trace, span, flags, true, TraceState::default());
    cx.is_valid().then_some(cx)
}

/// The `traceparent` of a span context; `None` when it is not valid.
pub fn format(cx: &SpanContext) -> Option<String> {
    cx.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            cx.trace_id(),
            cx.span_id(),
            cx.trace_flags().to_u8()
        )
    })
}

/// The `traceparent` of `span`, when OpenTelemetry records it.
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    format(span.context().span().span_context())
}

/// Makes `span` a child of the span `traceparent` names; a malformed one is
/// ignored (the span starts a trace of its own).
pub fn set_parent(span: &tracing::Span, traceparent: &str) {
    if let Some(cx) = parse(traceparent) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(cx));
    }
}

/// The `traceparent` in a job's custom headers (a JSON object), if any.
pub fn in_headers(custom_headers: &str) -> Option<String> {
    if !custom_headers.contains(TRACEPARENT) {
        return None;
    }
    let headers: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(custom_headers).ok()?;
    headers.get(TRACEPARENT)?.as_str().map(str::to_owned)
}

/// `custom_headers` (a JSON object, or empty) with `traceparent` added, unless it
/// has one already or is not a JSON object (it is then refused as it stands).
pub fn with_traceparent(custom_headers: &str, traceparent: &str) -> Option<String> {
    let mut headers: serde_json::Map<String, serde_json::Value> =
        if custom_headers.trim().is_empty() {
            serde_json::Map::new()
        } else {
            serde_json::from_str(custom_headers).ok()?
        };
    if headers.contains_key(TRACEPARENT) {
        return None;
    }
    headers.insert(TRACEPARENT.into(), traceparent.into());
    serde_json::to_string(&headers).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_reads_back_as_written_and_bad_ones_are_none() {
        let cx = parse(TP).expect("valid");
        assert!(cx.is_remote() && cx.is_sampled());
        assert_eq!(
            format!("{}", cx.trace_id()),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(format(&cx).as_deref(), Some(TP));
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_traceparent_is_added_to_headers_once_and_found_there() {
        let added = with_traceparent(r#"{"region":"eu"}"#, TP).expect("added");
        assert_eq!(in_headers(&added).as_deref(), Some(TP));
        assert!(added.contains(r#""region":"eu""#));
        assert_eq!(
            in_headers(&with_traceparent("", TP).expect("added")).as_deref(),
            Some(TP)
        );
        // The producer's own is kept; what is not an object is left to validation.
        assert_eq!(with_traceparent(&added, "00-other"), None);
        assert_eq!(with_traceparent("[1]", TP), None);
        assert_eq!(in_headers(r#"{"region":"eu"}"#), None);
        assert_eq!(in_headers(r#"{"traceparent":7}"#), None);
    }
}
