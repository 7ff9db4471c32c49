//! openraft's storage conformance suite, run against the fjall log store and state
#![allow(clippy::result_large_err)] // the suite returns openraft's StorageError
//! machine, in both durability modes.

use courier_broker::raft::TypeConfig;
use courier_broker::store::log::LogStore;
use courier_broker::store::sm::StateMachine;
use courier_broker::store::{Db, Durability};
use courier_proto::domain::PartitionId;
use openraft::testing::{StoreBuilder, Suite};
use openraft::StorageError;

struct FjallBuilder(Durability);

impl StoreBuilder<TypeConfig, LogStore, StateMachine, tempfile::TempDir> for FjallBuilder {
    async fn build(
        &self,
    ) -> Result<(tempfile::TempDir, LogStore, StateMachine), StorageError<u64>> {
        let dir = tempfile::tempdir().map_err(|e| openraft::StorageIOError::write(&e))?;
        let db = Db::open(dir.path(), self.0).map_err(|e| openraft::StorageIOError::write(&e))?;
        let log = LogStore::open(&db, 1, 1).map_err(|e| openraft::StorageIOError::write(&e))?;
        let sm = StateMachine::open(&db, PartitionId(1), dir.path().join("snapshots"))?
            .with_durable(log.durable());
        Ok((dir, log, sm))
    }
}

#[test]
fn fjall_store_passes_the_openraft_suite_with_fsync() -> Result<(), StorageError<u64>> {
    Suite::test_all(FjallBuilder(Durability::Fsync))
}

#[test]
fn fjall_store_passes_the_openraft_suite_with_replicated_durability(
) -> Result<(), StorageError<u64>> {
    Suite::test_all(FjallBuilder(Durability::Replicated))
}
