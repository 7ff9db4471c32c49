//! A broker's storage fault: the first failed write or fdatasync, kept for good.

use courier_proto::domain::NodeId;
use openraft::StorageError;
use std::sync::Arc;

/// The first storage failure of a broker (a failed write or fdatasync), kept for
/// good: after one, nothing this broker writes can be counted on (the kernel may
/// have dropped the pages a failed fdatasync held, and a later one would succeed
/// over the hole), so the broker stops its replicas instead of going on.
#[derive(Debug, Default)]
pub struct Fault(tokio::sync::watch::Sender<Option<Arc<str>>>);

impl Fault {
    /// Records `what` went wrong, unless a failure was recorded before; whether this
    /// one was the first.
    pub fn set(&self, what: &str) -> bool {
        self.0.send_if_modified(|f| match f {
            Some(_) => false,
            None => {
                *f = Some(what.into());
                true
            }
        })
    }

    /// Passes `r` on, recording its error as the fault: openraft stops a replica on
    /// a storage error, and the others on the same database would only fail next.
    pub(crate) fn note<T>(
        &self,
        r: Result<T, StorageError<NodeId>>,
    ) -> Result<T, StorageError<NodeId>> {
        if let Err(e) = &r {
            self.set(&e.to_string());
        }
        r
    }

    /// The failure, if one was recorded.
    pub fn get(&self) -> Option<Arc<str>> {
        self.0.borrow().clone()
    }

    /// Resolves with the failure once one is recorded.
    pub async fn failed(&self) -> Arc<str> {
        let mut rx = self.0.subscribe();
        loop {
            if let Some(f) = rx.borrow_and_update().clone() {
                return f;
            }
            if rx.changed().await.is_err() {
                // The sender is `self`, alive while this borrow is: never here.
                std::future::pending::<()>().await;
            }
        }
    }
}
