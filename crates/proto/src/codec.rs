//! Encoding of domain and openraft values carried as bytes inside cluster messages.
//! JSON today, in one place, so the format can change without touching callers.

use serde::{de::DeserializeOwned, Serialize};

/// A payload that could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
#[error("cluster payload codec: {0}")]
pub struct CodecError(#[from] serde_json::Error);

/// Encodes a value as a payload.
pub fn encode<T: Serialize>(value: &T) -> Result<bytes::Bytes, CodecError> {
    Ok(serde_json::to_vec(value)?.into())
}

/// Decodes a payload; a malformed one is an error, never a panic.
pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, CodecError> {
    Ok(serde_json::from_slice(payload)?)
}
