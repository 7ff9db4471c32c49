//! Encoding of domain and openraft values carried as bytes inside cluster messages
//! and stored by the brokers: postcard (a compact, stable binary serde format), in
//! one place, so the format can change without touching callers.

use serde::{de::DeserializeOwned, Serialize};

/// A payload that could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
#[error("cluster payload codec: {0}")]
pub struct CodecError(#[from] postcard::Error);

/// Encodes a value as a payload.
pub fn encode<T: Serialize>(value: &T) -> Result<bytes::Bytes, CodecError> {
    Ok(to_vec(value)?.into())
}

/// Encodes a value into a new vector.
pub fn to_vec<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
    Ok(postcard::to_stdvec(value)?)
}

/// Decodes a payload; a malformed one is an error, never a panic.
pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, CodecError> {
    Ok(postcard::from_bytes(payload)?)
}

/// Decodes a value from the start of `payload`, and returns what follows it.
pub fn decode_prefix<T: DeserializeOwned>(payload: &[u8]) -> Result<(T, &[u8]), CodecError> {
    Ok(postcard::take_from_bytes(payload)?)
}

/// Decodes one value from `reader`, reading no further than it: a large stored
/// sequence (a snapshot) is read item by item instead of whole. `scratch` must hold
/// the largest single value's encoding; a longer one is an error.
pub fn decode_from<T: DeserializeOwned, R: std::io::Read>(
    reader: &mut R,
    scratch: &mut [u8],
) -> Result<T, CodecError> {
    let (value, _) = postcard::from_io((reader, scratch))?;
    Ok(value)
}
