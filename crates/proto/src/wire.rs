//! The protobuf codec of every gRPC service here: prost's, except that a message
//! that does not decode (a string that is not UTF-8, a broken field) is the
//! sender's error, INVALID_ARGUMENT with what was wrong, not INTERNAL.

use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec as TonicCodec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::ProstEncoder;

/// Encodes `T`, decodes `U`.
#[derive(Debug)]
pub struct Codec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(PhantomData)
    }
}

impl<T, U> TonicCodec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = MessageDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        MessageDecoder(PhantomData)
    }
}

/// Decodes `U`; a malformed message is INVALID_ARGUMENT.
#[derive(Debug)]
pub struct MessageDecoder<U>(PhantomData<U>);

impl<U: prost::Message + Default> Decoder for MessageDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(malformed)
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// The status for a message that does not decode.
pub fn malformed(e: prost::DecodeError) -> Status {
    Status::invalid_argument(format!("malformed message: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn a_string_that_is_not_utf8_is_the_senders_error() {
        // ActivateJobsRequest.type (field 1, length-delimited) = [0xff, 0xfe].
        let bytes = [0x0a, 0x02, 0xff, 0xfe];
        let e = crate::gateway_protocol::ActivateJobsRequest::decode(&bytes[..]).unwrap_err();
        let status = malformed(e);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains("UTF-8"), "{}", status.message());
    }
}
