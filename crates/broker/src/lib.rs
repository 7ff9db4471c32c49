//! # Layout
//! - [`engine`]: the pure job state machine: (state, command) -> (reply, effects, changes).
//! - [`store`]: fjall storage: the Raft log, the engine state with last-applied, snapshots.
//! - [`raft`]: openraft type config and the gRPC network client.

pub mod engine;
pub mod raft;
pub mod store;
