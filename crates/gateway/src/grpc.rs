//! Brokers reached over gRPC: the [`BrokerApi`] a gateway uses in production, on
//! one lazily connected channel per broker address.

use courier_proto::api::{BrokerApi, Connect, Inbound, Outbound};
use courier_proto::cluster::{
    broker_client::BrokerClient, BrokerMessage, BrokerTopology, BrokerTopologyRequest,
    ExecuteReply, ExecuteRequest, GatewayMessage,
};
use courier_proto::MAX_CLUSTER_MESSAGE_BYTES;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::Status;

/// Bound on establishing a TCP connection to a broker.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// HTTP/2 pings on broker connections, so a dead broker is noticed on an idle link.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to brokers over gRPC, with the cluster's mutual TLS when it has one.
pub struct GrpcConnect {
    pub tls: Option<ClientTlsConfig>,
}

impl Connect for GrpcConnect {
    fn connect(&self, addr: &str) -> Result<Arc<dyn BrokerApi>, String> {
        Ok(Arc::new(GrpcBroker {
            endpoint: endpoint(addr, self.tls.as_ref())?,
            channel: std::sync::OnceLock::new(),
        }))
    }
}

/// The endpoint for a broker address, "host:port" or a full URI; https with the
/// cluster's TLS.
fn endpoint(addr: &str, tls: Option<&ClientTlsConfig>) -> Result<Endpoint, String> {
    let uri = courier_proto::tls::peer_uri(addr, tls.is_some());
    let mut e = Endpoint::from_shared(uri).map_err(|e| e.to_string())?;
    if let Some(tls) = tls {
        e = e.tls_config(tls.clone()).map_err(|e| e.to_string())?;
    }
    if e.uri().port_u16().is_none() {
        return Err("no port given".to_string());
    }
    Ok(e.tcp_nodelay(true)
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true))
}

/// One broker over gRPC. Pushed jobs and commands carry up to 4 MiB of variables,
/// so both directions allow the cluster's message size.
struct GrpcBroker {
    endpoint: Endpoint,
    /// Made on first use, on the runtime of that call.
    channel: std::sync::OnceLock<Channel>,
}

impl GrpcBroker {
    fn client(&self) -> BrokerClient<Channel> {
        let channel = self
            .channel
            .get_or_init(|| self.endpoint.connect_lazy())
            .clone();
        BrokerClient::new(channel)
            .max_decoding_message_size(MAX_CLUSTER_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_CLUSTER_MESSAGE_BYTES)
    }
}

#[tonic::async_trait]
impl BrokerApi for GrpcBroker {
    async fn execute(
        &self,
        gateway_id: Option<Arc<str>>,
        requests: Outbound<ExecuteRequest>,
    ) -> Result<Inbound<ExecuteReply>, Status> {
        let mut request = tonic::Request::new(Owned(requests));
        // An id that is not ASCII is not sent: brokers then tell this gateway about
        // every end of a job it holds, which is only more messages.
        if let Some(id) = gateway_id.and_then(|id| id.parse().ok()) {
            request
                .metadata_mut()
                .insert(courier_proto::GATEWAY_ID_HEADER, id);
        }
        let replies = self.client().execute(request).await?;
        Ok(Box::pin(replies.into_inner()))
    }

    async fn topology(&self) -> Result<BrokerTopology, Status> {
        Ok(self
            .client()
            .topology(BrokerTopologyRequest {})
            .await?
            .into_inner())
    }

    async fn link(
        &self,
        outbound: Outbound<GatewayMessage>,
    ) -> Result<Inbound<BrokerMessage>, Status> {
        let replies = self.client().link(Owned(outbound)).await?;
        Ok(Box::pin(replies.into_inner()))
    }
}

/// A stream the gateway sends, as a named type: tonic's client calls cannot prove
/// a boxed `dyn Stream` argument `Send` inside an `async_trait` method.
struct Owned<T>(Outbound<T>);

impl<T> futures::Stream for Owned<T> {
    type Item = T;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        self.0.as_mut().poll_next(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_addresses_need_a_port() {
        assert!(endpoint("127.0.0.1:26501", None).is_ok());
        assert!(endpoint("http://broker-1:26501", None).is_ok());
        assert!(endpoint("broker-1", None).is_err());
        assert!(endpoint("not an address", None).is_err());
    }
}
