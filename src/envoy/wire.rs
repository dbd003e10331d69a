//! Envoy's `RateLimitRequest` read in place from its protobuf bytes: the
//! domain and every entry's key and value are `&str`s into the message, the
//! descriptors and entries small vectors that stay inline for the common
//! request, so a call allocates nothing to be read (prost's generated
//! decoder allocated a `String` per domain, key and value and a `Vec` per
//! descriptor: a tenth of the server's CPU per call). It reads what prost
//! reads, with the same rules: a repeated field appends, a scalar's last
//! occurrence wins, an embedded message's occurrences merge, unknown fields
//! are skipped, strings must be UTF-8; `tests` checks it against prost's own
//! encoding of arbitrary requests.

use smallvec::SmallVec;
use std::ops::Range;

/// How deep groups (a proto2 relic no Envoy sends) may nest before the
/// message is refused.
const GROUP_DEPTH_MAX: u32 = 100;

/// A request as its bytes hold it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestView<'a> {
    pub domain: &'a str,
    pub descriptors: SmallVec<[DescriptorView; 2]>,
    /// The request's `hits_addend` (0: unset).
    pub hits_addend: u32,
    /// Every descriptor's entries, one after the other.
    entries: SmallVec<[(&'a str, &'a str); 8]>,
}

/// One descriptor: its entries' place in the request's, and its options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DescriptorView {
    entries: Range<usize>,
    /// The descriptor's `hits_addend` wrapper, when present.
    pub hits_addend: Option<u64>,
    pub is_negative_hits: bool,
}

impl<'a> RequestView<'a> {
    /// `descriptor`'s entries, in order, as (key, value).
    pub fn entries(&self, descriptor: &DescriptorView) -> &[(&'a str, &'a str)] {
        &self.entries[descriptor.entries.clone()]
    }
}

/// Why bytes are not a `RateLimitRequest`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed RateLimitRequest: {0}")]
pub struct WireError(&'static str);

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LENGTH_DELIMITED: u8 = 2;
const START_GROUP: u8 = 3;
const END_GROUP: u8 = 4;
const FIXED32: u8 = 5;

/// Protobuf's wire format, read forward.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let mut value = 0u64;
        for (index, byte) in self.bytes.iter().enumerate().take(10) {
            value |= u64::from(byte & 0x7f) << (7 * index);
            if byte & 0x80 == 0 {
                if index == 9 && *byte > 1 {
                    break;
                }
                self.bytes = &self.bytes[index + 1..];
                return Ok(value);
            }
        }
        Err(WireError("invalid varint"))
    }

    /// The next field's number and wire type.
    fn key(&mut self) -> Result<(u32, u8), WireError> {
        let key = self.varint()?;
        if key > u64::from(u32::MAX) {
            return Err(WireError("invalid key value"));
        }
        let tag = (key >> 3) as u32;
        if tag == 0 {
            return Err(WireError("invalid tag value: 0"));
        }
        Ok((tag, (key & 0x7) as u8))
    }

    fn take(&mut self, length: u64) -> Result<&'a [u8], WireError> {
        let length = usize::try_from(length)
            .ok()
            .filter(|length| *length <= self.bytes.len())
            .ok_or(WireError("buffer underflow"))?;
        let (taken, rest) = self.bytes.split_at(length);
        self.bytes = rest;
        Ok(taken)
    }

    fn length_delimited(&mut self, wire_type: u8) -> Result<&'a [u8], WireError> {
        if wire_type != LENGTH_DELIMITED {
            return Err(WireError("invalid wire type for a length-delimited field"));
        }
        let length = self.varint()?;
        self.take(length)
    }

    fn string(&mut self, wire_type: u8) -> Result<&'a str, WireError> {
        let bytes = self.length_delimited(wire_type)?;
        if bytes.is_ascii() {
            // SAFETY: ASCII is UTF-8. (The check is inlined; the general
            // one, for the rest, is a call per string.)
            return Ok(unsafe { std::str::from_utf8_unchecked(bytes) });
        }
        std::str::from_utf8(bytes)
            .map_err(|_| WireError("invalid string value: data is not UTF-8 encoded"))
    }

    fn scalar(&mut self, wire_type: u8) -> Result<u64, WireError> {
        if wire_type != VARINT {
            return Err(WireError("invalid wire type for a varint field"));
        }
        self.varint()
    }

    /// Skips a field this reader does not use.
    fn skip(&mut self, tag: u32, wire_type: u8, depth: u32) -> Result<(), WireError> {
        match wire_type {
            VARINT => self.varint().map(drop),
            FIXED64 => self.take(8).map(drop),
            FIXED32 => self.take(4).map(drop),
            LENGTH_DELIMITED => self.length_delimited(wire_type).map(drop),
            START_GROUP => {
                if depth >= GROUP_DEPTH_MAX {
                    return Err(WireError("recursion limit reached"));
                }
                loop {
                    let (inner_tag, inner_type) = self.key()?;
                    if inner_type == END_GROUP {
                        return if inner_tag == tag {
                            Ok(())
                        } else {
                            Err(WireError("unexpected end group tag"))
                        };
                    }
                    self.skip(inner_tag, inner_type, depth + 1)?;
                }
            }
            END_GROUP => Err(WireError("unexpected end group tag")),
            _ => Err(WireError("invalid wire type value")),
        }
    }
}

/// Reads a `RateLimitRequest` (gRPC's message, its prefix removed).
pub fn decode_request(bytes: &[u8]) -> Result<RequestView<'_>, WireError> {
    let mut request = RequestView::default();
    decode_request_into(bytes, &mut request)?;
    Ok(request)
}

/// [`decode_request`] into `request` (emptied first), where it is to stay:
/// a view is a few hundred bytes, not worth moving.
pub fn decode_request_into<'a>(
    bytes: &'a [u8],
    request: &mut RequestView<'a>,
) -> Result<(), WireError> {
    request.domain = "";
    request.descriptors.clear();
    request.hits_addend = 0;
    request.entries.clear();
    let mut reader = Reader { bytes };
    while !reader.is_empty() {
        let (tag, wire_type) = reader.key()?;
        match tag {
            1 => request.domain = reader.string(wire_type)?,
            2 => {
                let bytes = reader.length_delimited(wire_type)?;
                let descriptor = decode_descriptor(bytes, &mut request.entries)?;
                request.descriptors.push(descriptor);
            }
            3 => request.hits_addend = reader.scalar(wire_type)? as u32,
            _ => reader.skip(tag, wire_type, 0)?,
        }
    }
    Ok(())
}

fn decode_descriptor<'a>(
    bytes: &'a [u8],
    entries: &mut SmallVec<[(&'a str, &'a str); 8]>,
) -> Result<DescriptorView, WireError> {
    let mut reader = Reader { bytes };
    let first = entries.len();
    let mut descriptor = DescriptorView::default();
    while !reader.is_empty() {
        let (tag, wire_type) = reader.key()?;
        match tag {
            1 => {
                let bytes = reader.length_delimited(wire_type)?;
                entries.push(decode_entry(bytes)?);
            }
            3 => {
                // google.protobuf.UInt64Value; occurrences merge.
                let bytes = reader.length_delimited(wire_type)?;
                let mut wrapper = Reader { bytes };
                let mut value = descriptor.hits_addend.unwrap_or(0);
                while !wrapper.is_empty() {
                    let (tag, wire_type) = wrapper.key()?;
                    match tag {
                        1 => value = wrapper.scalar(wire_type)?,
                        _ => wrapper.skip(tag, wire_type, 0)?,
                    }
                }
                descriptor.hits_addend = Some(value);
            }
            4 => descriptor.is_negative_hits = reader.scalar(wire_type)? != 0,
            2 => {
                // `limit` (RateLimitOverride) is not used, but must be one.
                let bytes = reader.length_delimited(wire_type)?;
                let mut limit = Reader { bytes };
                while !limit.is_empty() {
                    let (tag, wire_type) = limit.key()?;
                    match tag {
                        1 | 2 => drop(limit.scalar(wire_type)?),
                        _ => limit.skip(tag, wire_type, 0)?,
                    }
                }
            }
            _ => reader.skip(tag, wire_type, 0)?,
        }
    }
    descriptor.entries = first..entries.len();
    Ok(descriptor)
}

fn decode_entry(bytes: &[u8]) -> Result<(&str, &str), WireError> {
    let mut reader = Reader { bytes };
    let (mut key, mut value) = ("", "");
    while !reader.is_empty() {
        let (tag, wire_type) = reader.key()?;
        match tag {
            1 => key = reader.string(wire_type)?,
            2 => value = reader.string(wire_type)?,
            _ => reader.skip(tag, wire_type, 0)?,
        }
    }
    Ok((key, value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use envoy_types::pb::google::protobuf::UInt64Value;
    use proptest::prelude::*;
    use prost::Message;

    /// Domain, request hits, and each descriptor's entries, hits and sign.
    type Decoded = (String, u32, Vec<(Vec<(String, String)>, Option<u64>, bool)>);

    /// What prost decodes, in the view's terms.
    fn expected(request: &RateLimitRequest) -> Decoded {
        let descriptors = request
            .descriptors
            .iter()
            .map(|d| {
                let entries = d
                    .entries
                    .iter()
                    .map(|e| (e.key.clone(), e.value.clone()))
                    .collect();
                (
                    entries,
                    d.hits_addend.as_ref().map(|w| w.value),
                    d.is_negative_hits,
                )
            })
            .collect();
        (request.domain.clone(), request.hits_addend, descriptors)
    }

    fn seen(view: &RequestView<'_>) -> Decoded {
        let descriptors = view
            .descriptors
            .iter()
            .map(|d| {
                let entries = view
                    .entries(d)
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect();
                (entries, d.hits_addend, d.is_negative_hits)
            })
            .collect();
        (view.domain.to_owned(), view.hits_addend, descriptors)
    }

    fn descriptor_strategy() -> impl Strategy<Value = RateLimitDescriptor> {
        (
            prop::collection::vec((".{0,6}", ".{0,6}"), 0..5),
            prop::option::of(any::<u64>()),
            any::<bool>(),
            prop::option::of(any::<u32>()),
        )
            .prop_map(|(entries, hits, negative, limit)| RateLimitDescriptor {
                entries: entries
                    .into_iter()
                    .map(|(key, value)| Entry { key, value })
                    .collect(),
                hits_addend: hits.map(|value| UInt64Value { value }),
                is_negative_hits: negative,
                limit: limit.map(|requests_per_unit| RateLimitOverride {
                    requests_per_unit,
                    unit: 2,
                }),
            })
    }

    proptest! {
        #[test]
        fn reads_what_prost_writes(
            domain in ".{0,12}",
            hits in any::<u32>(),
            descriptors in prop::collection::vec(descriptor_strategy(), 0..5),
        ) {
            let request = RateLimitRequest { domain, descriptors, hits_addend: hits };
            let bytes = request.encode_to_vec();
            let view = decode_request(&bytes).unwrap();
            prop_assert_eq!(seen(&view), expected(&request));
        }

        #[test]
        fn refuses_what_prost_refuses(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let ours = decode_request(&bytes);
            let prosts = RateLimitRequest::decode(&bytes[..]);
            prop_assert_eq!(ours.is_ok(), prosts.is_ok(), "{:?} / {:?}", ours, prosts);
            if let (Ok(view), Ok(request)) = (ours, prosts) {
                prop_assert_eq!(seen(&view), expected(&request));
            }
        }
    }

    #[test]
    fn repeated_scalars_take_the_last_and_wrappers_merge() {
        // domain "a" then "b"; a descriptor whose hits wrapper comes twice,
        // the second empty (so the first value stands), and an unknown field.
        let bytes = [
            0x0a, 1, b'a', 0x0a, 1, b'b', 0x12, 8, 0x1a, 2, 0x08, 5, 0x1a, 0, 0x28, 1, 0x18, 7,
        ];
        let view = decode_request(&bytes).unwrap();
        assert_eq!(view.domain, "b");
        assert_eq!(view.descriptors[0].hits_addend, Some(5));
        assert_eq!(view.hits_addend, 7);
        assert_eq!(
            RateLimitRequest::decode(&bytes[..]).unwrap().descriptors[0].hits_addend,
            Some(UInt64Value { value: 5 })
        );
    }

    #[test]
    fn strings_that_are_not_utf8_are_refused() {
        let error = decode_request(&[0x0a, 2, 0xff, 0xfe]).unwrap_err();
        assert!(error.to_string().contains("UTF-8"), "{error}");
    }
}
