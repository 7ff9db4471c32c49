//! Cluster and compatibility tests on real processes: `courier broker`, `courier
//! gateway` and `courier dev`, real Zeebe clients (zbctl, the Node.js SDK, pyzeebe)
//! and Courier's own client and CLI. One test binary, one module per subject, so
//! the workspace links them once.

// Test code: a failed expectation is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

mod bounds;
mod cluster;
mod flow;
mod gateways;
mod inspect;
mod node_sdk;
mod otel;
mod push;
mod pyzeebe;
mod security;
mod spread;
mod storage;
mod worker;
mod zbctl;
