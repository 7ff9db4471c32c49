//! Every answer carries how many job streams this gateway holds
//! ([`GATEWAY_STREAMS_HEADER`]), so clients open their next stream on a lighter
//! gateway: the load reports of per-call balancing, with no extra call.

use crate::admission::Admission;
use courier_proto::headers::GATEWAY_STREAMS_HEADER;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::codegen::http;

/// `S` with the gateway's stream count on each of its answers.
#[derive(Clone)]
pub struct ReportLoad<S> {
    inner: S,
    admission: Arc<Admission>,
}

impl<S> ReportLoad<S> {
    pub fn new(inner: S, admission: Arc<Admission>) -> Self {
        ReportLoad { inner, admission }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for ReportLoad<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tonic::codegen::Service<http::Request<tonic::body::Body>> for ReportLoad<S>
where
    S: tonic::codegen::Service<http::Request<tonic::body::Body>, Response = http::Response<B>>,
    S::Future: Unpin,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = WithLoad<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        WithLoad {
            inner: self.inner.call(request),
            streams: self.admission.job_streams_held(),
        }
    }
}

/// The answer of one call, the header added when it comes.
pub struct WithLoad<F> {
    inner: F,
    streams: usize,
}

impl<F, B, E> Future for WithLoad<F>
where
    F: Future<Output = Result<http::Response<B>, E>> + Unpin,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let streams = self.streams;
        Pin::new(&mut self.inner).poll(cx).map_ok(|mut response| {
            response
                .headers_mut()
                .insert(GATEWAY_STREAMS_HEADER, http::HeaderValue::from(streams));
            response
        })
    }
}
