//! droplet's protobuf messages (proto/droplet.proto), hand-mirrored with
//! prost's derive so that building needs no `protoc`, and the checks prost
//! leaves to us: proto2 `required` fields must be present (prost would
//! silently default them), and a decoded request becomes a [`Command`].
//!
//! `bucket` and `id` are read as bytes (their wire form is the same as a
//! string's): bucket names are opaque to us, and a name that is not UTF-8 is
//! still a name.

use crate::limiter::droplet_bucket::{Balances, Period, TakeRequest, PERIOD_COUNT};
use prost::Message;

/// `Droplet.Request`, with every field's presence kept.
#[derive(Clone, PartialEq, Message)]
pub struct RequestMessage {
    #[prost(bytes = "vec", optional, tag = "1")]
    pub bucket: Option<Vec<u8>>,
    #[prost(bytes = "vec", optional, tag = "2")]
    pub id: Option<Vec<u8>>,
    #[prost(int32, optional, tag = "3")]
    pub count: Option<i32>,
    #[prost(bool, optional, tag = "4")]
    pub reset: Option<bool>,
    #[prost(uint32, optional, tag = "5")]
    pub ls: Option<u32>,
    #[prost(uint32, optional, tag = "6")]
    pub lm: Option<u32>,
    #[prost(uint32, optional, tag = "7")]
    pub lh: Option<u32>,
    #[prost(uint32, optional, tag = "8")]
    pub ld: Option<u32>,
    #[prost(uint32, optional, tag = "9")]
    pub lw: Option<u32>,
    #[prost(uint32, optional, tag = "10")]
    pub lo: Option<u32>,
    /// `Type`: 0 is TAKE; any other value is a query.
    #[prost(int32, optional, tag = "11")]
    pub r#type: Option<i32>,
}

/// `Droplet.Response`: only the balances that were computed are written.
#[derive(Clone, PartialEq, Message)]
pub struct ResponseMessage {
    #[prost(bool, required, tag = "1")]
    pub accept: bool,
    #[prost(int32, optional, tag = "2")]
    pub ls: Option<i32>,
    #[prost(int32, optional, tag = "3")]
    pub lm: Option<i32>,
    #[prost(int32, optional, tag = "4")]
    pub lh: Option<i32>,
    #[prost(int32, optional, tag = "5")]
    pub ld: Option<i32>,
    #[prost(int32, optional, tag = "6")]
    pub lw: Option<i32>,
    #[prost(int32, optional, tag = "7")]
    pub lo: Option<i32>,
}

/// What a request asks, once decoded and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Take {
        bucket: Vec<u8>,
        request: TakeRequest,
    },
    Query {
        bucket: Vec<u8>,
    },
}

/// Why a binary message is not a request. droplet answers all of these by
/// closing the connection (code 1000).
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("not a protobuf Droplet.Request: {0}")]
    Protobuf(#[from] prost::DecodeError),
    #[error("the required field `{0}` is missing")]
    MissingField(&'static str),
}

impl RequestMessage {
    fn limits(&self) -> [u32; PERIOD_COUNT] {
        let mut limits = [0; PERIOD_COUNT];
        for period in Period::ALL {
            let limit = match period {
                Period::Second => self.ls,
                Period::Minute => self.lm,
                Period::Hour => self.lh,
                Period::Day => self.ld,
                Period::Week => self.lw,
                Period::Month => self.lo,
            };
            limits[period.index()] = limit.unwrap_or(0);
        }
        limits
    }
}

/// Decodes one binary WebSocket message into a command.
pub fn decode_request(bytes: &[u8]) -> Result<Command, DecodeError> {
    let message = RequestMessage::decode(bytes)?;
    if message.id.is_none() {
        return Err(DecodeError::MissingField("id"));
    }
    let limits = message.limits();
    let bucket = message.bucket.ok_or(DecodeError::MissingField("bucket"))?;
    Ok(match message.r#type.unwrap_or(0) {
        0 => Command::Take {
            bucket,
            request: TakeRequest {
                count: message.count.unwrap_or(1),
                reset: message.reset.unwrap_or(false),
                limits,
            },
        },
        _ => Command::Query { bucket },
    })
}

/// Encodes a response: `accept`, then the balances given.
pub fn encode_response(accept: bool, balances: &Balances) -> Vec<u8> {
    ResponseMessage {
        accept,
        ls: balances.get(Period::Second),
        lm: balances.get(Period::Minute),
        lh: balances.get(Period::Hour),
        ld: balances.get(Period::Day),
        lw: balances.get(Period::Week),
        lo: balances.get(Period::Month),
    }
    .encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(bucket: &str, id: Option<&str>) -> RequestMessage {
        RequestMessage {
            bucket: Some(bucket.as_bytes().to_vec()),
            id: id.map(|id| id.as_bytes().to_vec()),
            count: None,
            reset: None,
            ls: None,
            lm: None,
            lh: None,
            ld: None,
            lw: None,
            lo: None,
            r#type: None,
        }
    }

    #[test]
    fn the_spec_example_response_is_08_01_10_09() {
        let mut balances = Balances::default();
        balances.0[Period::Second.index()] = Some(9);
        assert_eq!(encode_response(true, &balances), [0x08, 0x01, 0x10, 0x09]);
        // `accept` is required: written even when false; absent balances are not.
        assert_eq!(encode_response(false, &Balances::default()), [0x08, 0x00]);
        let decoded = ResponseMessage::decode(&[0x08u8, 0x01, 0x10, 0x09][..]).unwrap();
        assert_eq!(
            (decoded.accept, decoded.ls, decoded.lm),
            (true, Some(9), None)
        );
    }

    #[test]
    fn negative_balances_use_ten_byte_varints_as_protobufjs_does() {
        let mut balances = Balances::default();
        balances.0[Period::Minute.index()] = Some(-1);
        assert_eq!(
            encode_response(false, &balances),
            [0x08, 0x00, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
    }

    #[test]
    fn decodes_a_take_with_defaults_and_a_query() {
        // bucket "foo", id "1", ls 10: what droplet's client sends for
        // `take({bucket: 'foo', id: '1', ls: 10})`.
        let bytes = [0x0a, 0x03, b'f', b'o', b'o', 0x12, 0x01, b'1', 0x28, 0x0a];
        let take = decode_request(&bytes).unwrap();
        let mut limits = [0; PERIOD_COUNT];
        limits[Period::Second.index()] = 10;
        assert_eq!(
            take,
            Command::Take {
                bucket: b"foo".to_vec(),
                request: TakeRequest {
                    count: 1,
                    reset: false,
                    limits
                }
            }
        );
        let mut query = request("foo", Some("2"));
        query.r#type = Some(7);
        assert_eq!(
            decode_request(&query.encode_to_vec()).unwrap(),
            Command::Query {
                bucket: b"foo".to_vec()
            }
        );
    }

    #[test]
    fn missing_required_fields_and_garbage_are_errors() {
        let no_id = request("foo", None).encode_to_vec();
        assert!(matches!(
            decode_request(&no_id),
            Err(DecodeError::MissingField("id"))
        ));
        let mut no_bucket = request("foo", Some("1"));
        no_bucket.bucket = None;
        assert!(matches!(
            decode_request(&no_bucket.encode_to_vec()),
            Err(DecodeError::MissingField("bucket"))
        ));
        for garbage in [&b"\xff\xff\xff"[..], b"hello world", b"\x0a\x05ab"] {
            assert!(decode_request(garbage).is_err(), "{garbage:?}");
        }
        // An empty bucket name is a name.
        assert!(decode_request(&request("", Some("")).encode_to_vec()).is_ok());
    }
}
