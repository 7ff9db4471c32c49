//! gRPC health checking (`grpc.health.v1.Health`), which Zeebe's gateway serves too, for
//! load balancers and Kubernetes probes. The gateway as a whole (`""`) and each of its
//! services are SERVING while it runs and NOT_SERVING once it stops; a `Watch` stream
//! sends the change and then ends, so an open watch never holds a shutdown up.

use futures::{future, stream, Stream, StreamExt};
use std::pin::Pin;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// The health service of a gateway that serves `services` until `stop`.
pub(crate) fn service(
    services: &'static [&'static str],
    stop: CancellationToken,
) -> HealthServer<GatewayHealth> {
    HealthServer::new(GatewayHealth { services, stop })
}

pub(crate) struct GatewayHealth {
    services: &'static [&'static str],
    stop: CancellationToken,
}

impl GatewayHealth {
    fn status_of(&self, service: &str) -> Result<ServingStatus, Status> {
        if !service.is_empty() && !self.services.contains(&service) {
            return Err(Status::not_found(format!(
                "this gateway serves no service '{service}'; it serves {}",
                self.services.join(", ")
            )));
        }
        Ok(if self.stop.is_cancelled() {
            ServingStatus::NotServing
        } else {
            ServingStatus::Serving
        })
    }
}

fn answer(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status as i32,
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for GatewayHealth {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let status = self.status_of(&request.get_ref().service)?;
        Ok(Response::new(answer(status)))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        // As the health protocol asks: an unknown service is watched too, and is
        // SERVICE_UNKNOWN for as long as the call lasts (until the gateway stops).
        let now = self
            .status_of(&request.get_ref().service)
            .unwrap_or(ServingStatus::ServiceUnknown);
        let stop = self.stop.clone();
        let first = stream::once(future::ready(Ok(answer(now))));
        let stream: WatchStream = match now {
            ServingStatus::Serving => Box::pin(first.chain(stream::once(async move {
                stop.cancelled().await;
                Ok(answer(ServingStatus::NotServing))
            }))),
            // Nothing will change: held open until the gateway stops.
            ServingStatus::ServiceUnknown => Box::pin(first.chain(
                stream::once(async move { stop.cancelled().await }).filter_map(|()| async { None }),
            )),
            _ => Box::pin(first),
        };
        Ok(Response::new(stream))
    }
}
