//! # Layout
//! - [`engine`]: the pure job state machine: (state, command) -> (reply, effects, changes).
pub mod engine;
