//! Storage faults are fail-stop. A failed write or fdatasync leaves nothing this
//! broker writes afterwards worth trusting (a later fdatasync may succeed over pages
//! the kernel dropped), and its replicas share one database, so the first fault
//! stops every replica of the broker for good: they leave leadership at once, stand
//! in no election, and the broker reports itself unhealthy until it is restarted.
//! Its peers lead its partitions meanwhile; a restart recovers from what was
//! flushed, which is everything a majority acknowledged.

use super::*;
use openraft::error::Fatal;
use store::Fault;
use tonic_health::ServingStatus;

/// Records a replica's fatal storage error as the broker's fault: openraft stops a
/// replica whose log or state machine fails a write, and the others on the same
/// database would only fail next.
pub(super) fn note_fatal(part: &Partition, fault: &Fault) {
    let failed = match &part.raft.metrics().borrow().running_state {
        Err(Fatal::StorageError(e)) => Some(e.to_string()),
        _ => None,
    };
    if let Some(e) = failed {
        fault.set(&format!("partition {}: {e}", part.id));
    }
}

/// Waits for the broker's storage fault, then stops its replicas for good, marks
/// the broker unhealthy (health service, metric) and says so once, clearly.
pub(super) async fn stop_on_fault(
    node: NodeId,
    fault: Arc<Fault>,
    partitions: service::Partitions,
    health: tonic_health::server::HealthReporter,
    shutdown: CancellationToken,
) {
    let what = tokio::select! {
        _ = shutdown.cancelled() => return,
        what = fault.failed() => what,
    };
    tracing::error!(
        node,
        error = %what,
        "STORAGE FAILED: this broker stops its replicas for good and reports itself \
         unhealthy; the other replicas lead its partitions. Fix the disk (free space, \
         replace it) and restart the broker: it recovers from what it flushed"
    );
    metrics::STORAGE_FAILED
        .with_label_values(&[&node.to_string()])
        .set(1);
    set_health(&health, ServingStatus::NotServing).await;
    let stops = partitions.values().map(|part| async move {
        part.stop_for_good().await;
        metrics::LEADER
            .with_label_values(&[&node.to_string(), &part.id.to_string()])
            .set(0);
    });
    futures::future::join_all(stops).await;
}

/// Sets the status of every service the broker serves, and of the server as a
/// whole (the empty name).
pub(super) async fn set_health(health: &tonic_health::server::HealthReporter, to: ServingStatus) {
    use courier_proto::cluster::{broker_server::BrokerServer, raft_server::RaftServer};
    use tonic::server::NamedService;
    for name in [
        "",
        <BrokerServer<BrokerService> as NamedService>::NAME,
        <RaftServer<RaftService> as NamedService>::NAME,
    ] {
        health.set_service_status(name, to).await;
    }
}
