//! The seam between a gateway and its brokers: the three calls a gateway makes of a
//! broker ([`BrokerApi`]), and how it reaches one by address ([`Connect`]). Gateways
//! reach brokers over gRPC; a test may hand a gateway brokers running in its own
//! process instead ([`InProcess`]), and so test gateway behaviour against real
//! brokers without starting processes.

use crate::cluster::{BrokerMessage, BrokerTopology, ExecuteReply, ExecuteRequest, GatewayMessage};
use dashmap::DashMap;
use futures::Stream;
use std::pin::Pin;
use std::sync::Arc;
use tonic::Status;

/// Messages a gateway sends on a stream it opened.
pub type Outbound<T> = Pin<Box<dyn Stream<Item = T> + Send>>;

/// What a broker sends back on a stream; an error ends it.
pub type Inbound<T> = crate::mux::Replies<T>;

/// What a gateway asks of one broker.
#[tonic::async_trait]
pub trait BrokerApi: Send + Sync + 'static {
    /// Opens a command stream: `requests` go out, each answered on the returned
    /// stream under its id, in any order (see [`crate::mux`]). `gateway_id` names
    /// the gateway (see [`crate::GATEWAY_ID_HEADER`]).
    async fn execute(
        &self,
        gateway_id: Option<Arc<str>>,
        requests: Outbound<ExecuteRequest>,
    ) -> Result<Inbound<ExecuteReply>, Status>;

    /// The broker's view of the cluster and of its partitions.
    async fn topology(&self) -> Result<BrokerTopology, Status>;

    /// Opens the gateway's link: registrations, credit and answers go out; pushes
    /// and notices come back.
    async fn link(
        &self,
        outbound: Outbound<GatewayMessage>,
    ) -> Result<Inbound<BrokerMessage>, Status>;
}

/// Reaches the broker at an address.
pub trait Connect: Send + Sync + 'static {
    /// The broker at `addr` ("host:port"), not yet connected: it connects on first
    /// use. An address that can never work is refused with why.
    fn connect(&self, addr: &str) -> Result<Arc<dyn BrokerApi>, String>;
}

/// Brokers in this process, by the address each was configured with: each
/// registers itself when it starts, and a gateway given this as its [`Connect`]
/// calls them directly. An address with no broker (yet) gets UNAVAILABLE, as an
/// unreachable one would.
#[derive(Clone, Default)]
pub struct InProcess {
    brokers: Arc<DashMap<String, Arc<dyn BrokerApi>>>,
}

impl InProcess {
    /// Makes `broker` reachable at `addr` (in place of one registered there before).
    pub fn register(&self, addr: &str, broker: Arc<dyn BrokerApi>) {
        self.brokers.insert(addr.to_string(), broker);
    }

    /// Makes `addr` unreachable, as a broker that stopped.
    pub fn unregister(&self, addr: &str) {
        self.brokers.remove(addr);
    }
}

impl Connect for InProcess {
    fn connect(&self, addr: &str) -> Result<Arc<dyn BrokerApi>, String> {
        Ok(Arc::new(InProcessBroker {
            brokers: self.clone(),
            addr: addr.to_string(),
        }))
    }
}

/// An address of [`InProcess`]: looked up on every call, so a broker that
/// registers later, or again after a restart, is found.
struct InProcessBroker {
    brokers: InProcess,
    addr: String,
}

impl InProcessBroker {
    fn broker(&self) -> Result<Arc<dyn BrokerApi>, Status> {
        self.brokers
            .brokers
            .get(&self.addr)
            .map(|b| b.value().clone())
            .ok_or_else(|| Status::unavailable(format!("no broker at {}", self.addr)))
    }
}

#[tonic::async_trait]
impl BrokerApi for InProcessBroker {
    async fn execute(
        &self,
        gateway_id: Option<Arc<str>>,
        requests: Outbound<ExecuteRequest>,
    ) -> Result<Inbound<ExecuteReply>, Status> {
        self.broker()?.execute(gateway_id, requests).await
    }

    async fn topology(&self) -> Result<BrokerTopology, Status> {
        self.broker()?.topology().await
    }

    async fn link(
        &self,
        outbound: Outbound<GatewayMessage>,
    ) -> Result<Inbound<BrokerMessage>, Status> {
        self.broker()?.link(outbound).await
    }
}
