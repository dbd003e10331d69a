//! From Envoy's `RateLimitRequest` to divvy operations, and from divvy's
//! decisions back to Envoy's `RateLimitResponse`, with no I/O (so that the
//! fuzz target `envoy_mapping` can drive it). Each descriptor becomes one
//! operation `domain=<domain> k1=v1 k2=v2 …`, matched by the ordered rules
//! like a `HIT` line; its hits are the descriptor's `hits_addend`, else the
//! request's, else 1; an explicit descriptor `hits_addend` of 0 asks what a
//! hit would get without counting it (`PEEK`). Every descriptor is decided
//! and counted whether or not another one is over its limit, as
//! envoyproxy/ratelimit does; the request is `OVER_LIMIT` when any is.
//!
//! Requests whose shape is outside [`EnvoyLimits`], or that cannot be an
//! operation (empty domain, no descriptors, a descriptor without entries, an
//! entry named `domain`, negative hits), are refused whole, before anything
//! is counted, with a [`MappingError`] that becomes `INVALID_ARGUMENT`.

pub use super::wire::{RequestView, WireError};
use crate::engine::{OperationAnswer, Reply};
use crate::limiter::Decision;
use crate::protocol::Pairs;
use crate::rules::Quota;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::Duration;
use smallvec::SmallVec;

/// The key the request's domain takes in each operation.
pub const DOMAIN_KEY: &str = "domain";

/// Bounds on one request's shape, each refused with `INVALID_ARGUMENT`
/// beyond (the message size itself is bounded by the server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvoyLimits {
    /// Most descriptors in one request.
    pub descriptors_max: usize,
    /// Most entries in one descriptor.
    pub entries_per_descriptor_max: usize,
    /// Largest `hits_addend` (request or descriptor): a request of `n` hits
    /// is decided as `n` hits in a row, so this bounds a request's work.
    pub hits_addend_max: u64,
}

impl Default for EnvoyLimits {
    fn default() -> Self {
        EnvoyLimits {
            descriptors_max: 64,
            entries_per_descriptor_max: 64,
            hits_addend_max: 1_000,
        }
    }
}

/// Why a request cannot be mapped; answered `INVALID_ARGUMENT` with this text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    #[error("rate limit domain must not be empty")]
    EmptyDomain,
    #[error("rate limit descriptor list must not be empty")]
    NoDescriptors,
    #[error(
        "{count} descriptors in one request, more than the {max} allowed (--grpc-descriptors-max)"
    )]
    TooManyDescriptors { count: usize, max: usize },
    #[error("descriptor {index} has no entries")]
    EmptyDescriptor { index: usize },
    #[error(
        "descriptor {index} has {count} entries, more than the {max} allowed (--grpc-entries-max)"
    )]
    TooManyEntries {
        index: usize,
        count: usize,
        max: usize,
    },
    #[error("descriptor {index}: the entry key `domain` is reserved for the request's domain")]
    ReservedKey { index: usize },
    #[error("descriptor {index}: hits_addend {hits} is more than the {max} allowed (--grpc-hits-addend-max)")]
    TooManyHits { index: usize, hits: u64, max: u64 },
    #[error("descriptor {index}: negative hits (is_negative_hits) are not supported: divvy's windows only count up")]
    NegativeHits { index: usize },
}

/// One descriptor as a divvy operation: which descriptor of its request
/// (its pairs are the domain, then the descriptor's entries), how many hits
/// it counts, and whether it only looks (`PEEK`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operation<'a> {
    pub domain: &'a str,
    /// The descriptor's index in its request.
    pub descriptor: usize,
    pub hits: u32,
    pub peek: bool,
}

impl<'a> Operation<'a> {
    /// The operation's entries, from its request.
    pub fn entries<'v>(&self, request: &'v RequestView<'a>) -> &'v [(&'a str, &'a str)] {
        request
            .descriptors
            .get(self.descriptor)
            .map_or(&[], |descriptor| request.entries(descriptor))
    }

    /// The operation's pairs, as a `HIT` line of them would have.
    pub fn pairs(&self, request: &RequestView<'a>) -> Pairs<'a> {
        pairs_of(self.domain, self.entries(request))
    }
}

/// A descriptor's pairs: the domain, then its entries in order.
pub fn pairs_of<'a>(domain: &'a str, entries: &[(&'a str, &'a str)]) -> Pairs<'a> {
    let domain = std::iter::once((DOMAIN_KEY, domain));
    domain.chain(entries.iter().copied()).collect()
}

/// Reads a `RateLimitRequest` message (the gRPC frame's payload) in place;
/// every failure, strings that are not UTF-8 included, is the client's.
pub fn decode_request(bytes: &[u8]) -> Result<RequestView<'_>, WireError> {
    super::wire::decode_request(bytes)
}

/// The operations of `request`, one per descriptor in order, or why there
/// are none. Nothing is counted for a refused request.
pub fn operations<'a>(
    request: &RequestView<'a>,
    limits: &EnvoyLimits,
) -> Result<SmallVec<[Operation<'a>; 2]>, MappingError> {
    if request.domain.is_empty() {
        return Err(MappingError::EmptyDomain);
    }
    let count = request.descriptors.len();
    if count == 0 {
        return Err(MappingError::NoDescriptors);
    }
    if count > limits.descriptors_max {
        return Err(MappingError::TooManyDescriptors {
            count,
            max: limits.descriptors_max,
        });
    }
    let hits_max = limits.hits_addend_max.min(u64::from(u32::MAX));
    let mut operations = SmallVec::with_capacity(count);
    for (index, descriptor) in request.descriptors.iter().enumerate() {
        let entries = request.entries(descriptor);
        if entries.is_empty() {
            return Err(MappingError::EmptyDescriptor { index });
        }
        if entries.len() > limits.entries_per_descriptor_max {
            return Err(MappingError::TooManyEntries {
                index,
                count: entries.len(),
                max: limits.entries_per_descriptor_max,
            });
        }
        if descriptor.is_negative_hits {
            return Err(MappingError::NegativeHits { index });
        }
        // proto3 cannot tell the request's 0 from unset: 0 is Envoy's
        // default of 1. The descriptor's wrapper can: 0 there is a look.
        let (hits, peek) = match descriptor.hits_addend {
            Some(value) => (value, value == 0),
            None => (u64::from(request.hits_addend.max(1)), false),
        };
        if hits > hits_max {
            return Err(MappingError::TooManyHits {
                index,
                hits,
                max: hits_max,
            });
        }
        if entries.iter().any(|(key, _)| *key == DOMAIN_KEY) {
            return Err(MappingError::ReservedKey { index });
        }
        operations.push(Operation {
            domain: request.domain,
            descriptor: index,
            // Bounded by `hits_max` above, itself at most `u32::MAX`.
            hits: u32::try_from(hits.max(1)).unwrap_or(u32::MAX),
            peek,
        });
    }
    Ok(operations)
}

/// Envoy's unit for a window of `reset_seconds`, when it has one: the four
/// of the issue plus week, and month and year as envoyproxy/ratelimit
/// counts them (30 and 365 days).
pub fn unit_of(reset_seconds: u64) -> Option<Unit> {
    match reset_seconds {
        1 => Some(Unit::Second),
        60 => Some(Unit::Minute),
        3_600 => Some(Unit::Hour),
        86_400 => Some(Unit::Day),
        604_800 => Some(Unit::Week),
        2_592_000 => Some(Unit::Month),
        31_536_000 => Some(Unit::Year),
        _ => None,
    }
}

fn clamp_u32(value: i64) -> u32 {
    u32::try_from(value.max(0)).unwrap_or(u32::MAX)
}

/// What a descriptor's status says, taken from the decision of its
/// operation: the one computation behind both [`descriptor_status`] (prost's
/// message) and [`encode_response`] (the bytes the server sends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StatusFields<'a> {
    over: bool,
    /// The rule's label, its limit and unit.
    limit: Option<(&'a str, u32, Unit)>,
    remaining: u32,
    reset_seconds: Option<i64>,
}

/// A descriptor's fields, or, for a backend failure (`ERR` on a line), its
/// message.
fn status_fields(answer: &OperationAnswer) -> Result<StatusFields<'_>, String> {
    let decision: Decision = match &answer.reply {
        Reply::Decision(decision) => *decision,
        Reply::Error { message, .. } => return Err(message.to_string()),
        Reply::Line(line) => return Err(format!("unexpected answer: {line}")),
    };
    let label = answer.label.as_deref().unwrap_or("");
    let requests = |limit: u64| u32::try_from(limit).unwrap_or(u32::MAX);
    let (limit, reset_seconds) = match answer.quota {
        // Unlimited: envoyproxy/ratelimit sends no limit for these either.
        Some(Quota::AlwaysAllow { .. }) | None => (None, None),
        // `creditLimit = 0`: zero per whatever unit (none fits "never").
        Some(Quota::AlwaysDeny) => (Some((label, 0, Unit::Unknown)), None),
        // A window without an Envoy unit keeps its limit and says `UNKNOWN`
        // rather than a rate it does not enforce.
        Some(Quota::Limited {
            credit_limit,
            reset_seconds,
        }) => (
            Some((
                label,
                requests(credit_limit),
                unit_of(reset_seconds).unwrap_or(Unit::Unknown),
            )),
            Some(decision.next_reset_seconds.max(0)),
        ),
    };
    Ok(StatusFields {
        over: !decision.allowed,
        limit,
        remaining: clamp_u32(decision.credit),
        reset_seconds,
    })
}

fn code_of(over: bool) -> Code {
    if over {
        Code::OverLimit
    } else {
        Code::Ok
    }
}

/// A descriptor's status from the decision of its operation, or, for a
/// backend failure (`ERR` on a line), its message.
pub fn descriptor_status(answer: &OperationAnswer) -> Result<DescriptorStatus, String> {
    let fields = status_fields(answer)?;
    Ok(DescriptorStatus {
        code: code_of(fields.over) as i32,
        current_limit: fields.limit.map(|(name, requests, unit)| RateLimit {
            name: name.to_owned(),
            requests_per_unit: requests,
            unit: unit as i32,
        }),
        limit_remaining: fields.remaining,
        duration_until_reset: fields
            .reset_seconds
            .map(|seconds| Duration { seconds, nanos: 0 }),
        quota: None,
    })
}

/// The `RateLimitResponse` for the answers of a request's descriptors, in
/// order, written as gRPC's prefixed message into `out` (cleared first):
/// what [`response`] of their [`descriptor_status`]es encodes to, written
/// directly (no message structs, no allocation beyond `out`). A backend
/// failure of any descriptor fails the call with its message.
pub fn encode_response<'a>(
    answers: impl IntoIterator<Item = &'a OperationAnswer>,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    out.clear();
    out.extend_from_slice(&[0; 5]);
    // The overall code is field 1: written first, once the statuses are known.
    out.extend_from_slice(&[0; 2]);
    let mut over = false;
    for answer in answers {
        let fields = status_fields(answer)?;
        over |= fields.over;
        let mut status = Sink::<128>::new();
        status.varint_field(1, code_of(fields.over) as u64);
        if let Some((name, requests, unit)) = fields.limit {
            let mut limit = Sink::<64>::new();
            if !name.is_empty() {
                limit.bytes_field(3, name.as_bytes());
            }
            limit.varint_field(1, u64::from(requests));
            limit.varint_field(2, unit as u64);
            status.bytes_field(2, &limit.0);
        }
        status.varint_field(3, u64::from(fields.remaining));
        if let Some(seconds) = fields.reset_seconds {
            let mut duration = Sink::<16>::new();
            duration.varint_field(1, seconds as u64);
            status.bytes_field(4, &duration.0);
        }
        let mut field = Sink::<16>::new();
        field.varint(2 << 3 | 2);
        field.varint(status.0.len() as u64);
        out.extend_from_slice(&field.0);
        out.extend_from_slice(&status.0);
    }
    out[5] = 1 << 3;
    out[6] = code_of(over) as u8;
    let length = u32::try_from(out.len() - 5).unwrap_or(u32::MAX);
    out[1..5].copy_from_slice(&length.to_be_bytes());
    Ok(())
}

/// Protobuf fields written into a buffer on the stack (spilling to the heap
/// only past `N` bytes), as prost writes them.
struct Sink<const N: usize>(SmallVec<[u8; N]>);

impl<const N: usize> Sink<N> {
    fn new() -> Self {
        Sink(SmallVec::new())
    }

    fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.0.push((value as u8) | 0x80);
            value >>= 7;
        }
        self.0.push(value as u8);
    }

    /// A varint field, left out when 0 (proto3's default).
    fn varint_field(&mut self, tag: u32, value: u64) {
        if value != 0 {
            self.varint(u64::from(tag << 3));
            self.varint(value);
        }
    }

    /// A length-delimited field (a string, or an embedded message: written
    /// even when empty, since its presence is what it says).
    fn bytes_field(&mut self, tag: u32, bytes: &[u8]) {
        self.varint(u64::from(tag << 3 | 2));
        self.varint(bytes.len() as u64);
        self.0.extend_from_slice(bytes);
    }
}

/// The response for every descriptor's status, in request order:
/// `OVER_LIMIT` when any is.
pub fn response(statuses: Vec<DescriptorStatus>) -> RateLimitResponse {
    let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
    RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
        statuses,
        ..RateLimitResponse::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use envoy_types::pb::google::protobuf::UInt64Value;
    use proptest::prelude::*;

    fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            ..RateLimitDescriptor::default()
        }
    }

    fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
        RateLimitRequest {
            domain: domain.into(),
            descriptors,
            hits_addend: 0,
        }
    }

    /// An operation with owned strings, to outlive the request's bytes.
    #[derive(Debug, PartialEq)]
    struct Owned {
        pairs: Vec<(String, String)>,
        hits: u32,
        peek: bool,
    }

    /// `request`'s operations as the server maps them: encoded by prost,
    /// read in place, mapped.
    fn operations_of(
        request: &RateLimitRequest,
        limits: &EnvoyLimits,
    ) -> Result<Vec<Owned>, MappingError> {
        let bytes = prost::Message::encode_to_vec(request);
        let view = decode_request(&bytes).unwrap();
        let operations = operations(&view, limits)?;
        Ok(operations
            .iter()
            .map(|op| Owned {
                pairs: op
                    .pairs(&view)
                    .iter()
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect(),
                hits: op.hits,
                peek: op.peek,
            })
            .collect())
    }

    fn pairs(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn each_descriptor_is_one_operation_with_the_domain_first() {
        let request = request(
            "edge",
            vec![
                descriptor(&[("path", "/a"), ("ip", "1.2.3.4")]),
                descriptor(&[("user", "u")]),
            ],
        );
        let ops = operations_of(&request, &EnvoyLimits::default()).unwrap();
        assert_eq!(ops.len(), 2);
        assert_eq!(
            ops[0].pairs,
            pairs(&[("domain", "edge"), ("path", "/a"), ("ip", "1.2.3.4")])
        );
        assert_eq!((ops[0].hits, ops[0].peek), (1, false));
        assert_eq!(ops[1].pairs, pairs(&[("domain", "edge"), ("user", "u")]));
    }

    #[test]
    fn hits_come_from_the_descriptor_then_the_request_and_zero_peeks() {
        let mut request = request("d", vec![descriptor(&[("k", "v")]); 3]);
        request.hits_addend = 5;
        request.descriptors[1].hits_addend = Some(UInt64Value { value: 7 });
        request.descriptors[2].hits_addend = Some(UInt64Value { value: 0 });
        let ops = operations_of(&request, &EnvoyLimits::default()).unwrap();
        let hits: Vec<_> = ops.iter().map(|op| (op.hits, op.peek)).collect();
        assert_eq!(hits, vec![(5, false), (7, false), (1, true)]);
    }

    #[test]
    fn bad_shapes_are_refused_whole() {
        let limits = EnvoyLimits::default();
        let ok = || descriptor(&[("k", "v")]);
        let cases = [
            (request("", vec![ok()]), MappingError::EmptyDomain),
            (request("d", vec![]), MappingError::NoDescriptors),
            (
                request("d", vec![ok(); 65]),
                MappingError::TooManyDescriptors { count: 65, max: 64 },
            ),
            (
                request("d", vec![ok(), descriptor(&[])]),
                MappingError::EmptyDescriptor { index: 1 },
            ),
            (
                request("d", vec![descriptor(&[("domain", "other")])]),
                MappingError::ReservedKey { index: 0 },
            ),
        ];
        for (request, expected) in cases {
            assert_eq!(operations_of(&request, &limits), Err(expected));
        }
        let many: Vec<(String, String)> = (0..10_000)
            .map(|i| (format!("k{i}"), "v".to_owned()))
            .collect();
        let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (&**k, &**v)).collect();
        assert_eq!(
            operations_of(&request("d", vec![descriptor(&many)]), &limits),
            Err(MappingError::TooManyEntries {
                index: 0,
                count: 10_000,
                max: 64
            })
        );
        let mut huge = request("d", vec![ok()]);
        huge.hits_addend = u32::MAX;
        assert_eq!(
            operations_of(&huge, &limits),
            Err(MappingError::TooManyHits {
                index: 0,
                hits: u64::from(u32::MAX),
                max: 1_000
            })
        );
        let mut negative = request("d", vec![ok()]);
        negative.descriptors[0].is_negative_hits = true;
        assert_eq!(
            operations_of(&negative, &limits),
            Err(MappingError::NegativeHits { index: 0 })
        );
    }

    fn answer(reply: Reply, quota: Option<Quota>) -> OperationAnswer {
        OperationAnswer {
            reply,
            quota,
            label: Some("api".into()),
        }
    }

    #[test]
    fn statuses_carry_the_limit_the_remaining_credit_and_the_reset() {
        let limited = |reset_seconds| Quota::Limited {
            credit_limit: 10,
            reset_seconds,
        };
        let decided = |allowed, credit, next| {
            Reply::Decision(Decision {
                allowed,
                credit,
                next_reset_seconds: next,
            })
        };
        let status = descriptor_status(&answer(decided(true, 7, 42), Some(limited(60)))).unwrap();
        assert_eq!(status.code, Code::Ok as i32);
        assert_eq!(
            status.current_limit,
            Some(RateLimit {
                name: "api".into(),
                requests_per_unit: 10,
                unit: Unit::Minute as i32
            })
        );
        assert_eq!(status.limit_remaining, 7);
        assert_eq!(status.duration_until_reset.unwrap().seconds, 42);

        let odd = descriptor_status(&answer(decided(false, 0, 20), Some(limited(30)))).unwrap();
        assert_eq!(odd.code, Code::OverLimit as i32);
        assert_eq!(odd.current_limit.unwrap().unit, Unit::Unknown as i32);

        let deny = descriptor_status(&answer(
            Reply::Decision(Decision::ALWAYS_DENY),
            Some(Quota::AlwaysDeny),
        ))
        .unwrap();
        assert_eq!(deny.code, Code::OverLimit as i32);
        assert_eq!(deny.current_limit.unwrap().requests_per_unit, 0);
        assert_eq!(deny.duration_until_reset, None);

        let allow = descriptor_status(&answer(
            Reply::Decision(Decision::always_allow(5)),
            Some(Quota::AlwaysAllow { credit_limit: 5 }),
        ))
        .unwrap();
        assert_eq!(
            (allow.code, allow.current_limit, allow.limit_remaining),
            (Code::Ok as i32, None, 5)
        );

        assert_eq!(
            descriptor_status(&answer(Reply::error("backend timed out after 5 ms"), None)),
            Err("backend timed out after 5 ms".to_owned())
        );
    }

    fn answer_strategy() -> impl Strategy<Value = OperationAnswer> {
        let quota = prop_oneof![
            Just(None),
            Just(Some(Quota::AlwaysDeny)),
            any::<u64>().prop_map(|credit_limit| Some(Quota::AlwaysAllow { credit_limit })),
            (
                any::<u64>(),
                prop_oneof![
                    Just(0u64),
                    Just(1),
                    Just(60),
                    Just(3_600),
                    Just(86_400),
                    any::<u64>()
                ]
            )
                .prop_map(|(credit_limit, reset_seconds)| Some(Quota::Limited {
                    credit_limit,
                    reset_seconds,
                })),
        ];
        let reply = prop_oneof![
            8 => (any::<bool>(), any::<i64>(), any::<i64>()).prop_map(|(allowed, credit, next)| {
                Reply::Decision(Decision {
                    allowed,
                    credit,
                    next_reset_seconds: next,
                })
            }),
            1 => Just(Reply::error("backend down")),
        ];
        (reply, quota, prop::option::of(".{0,40}")).prop_map(|(reply, quota, label)| {
            OperationAnswer {
                reply,
                quota,
                label,
            }
        })
    }

    proptest! {
        /// The bytes the server writes are prost's encoding of the statuses
        /// `descriptor_status` builds.
        #[test]
        fn the_encoded_response_is_the_statuses_response(
            answers in prop::collection::vec(answer_strategy(), 0..6),
        ) {
            let mut out = vec![9; 3];
            let encoded = encode_response(&answers, &mut out);
            let statuses: Result<Vec<_>, String> = answers.iter().map(descriptor_status).collect();
            match statuses {
                Err(error) => prop_assert_eq!(encoded, Err(error)),
                Ok(statuses) => {
                    prop_assert_eq!(encoded, Ok(()));
                    prop_assert_eq!(out[0], 0);
                    let length = u32::from_be_bytes([out[1], out[2], out[3], out[4]]) as usize;
                    prop_assert_eq!(length, out.len() - 5);
                    let decoded = <RateLimitResponse as prost::Message>::decode(&out[5..]).unwrap();
                    prop_assert_eq!(decoded, response(statuses));
                }
            }
        }
    }

    #[test]
    fn the_response_is_over_limit_when_any_descriptor_is() {
        let status = |code: Code| DescriptorStatus {
            code: code as i32,
            ..DescriptorStatus::default()
        };
        assert_eq!(
            response(vec![status(Code::Ok), status(Code::Ok)]).overall_code,
            Code::Ok as i32
        );
        assert_eq!(
            response(vec![status(Code::Ok), status(Code::OverLimit)]).overall_code,
            Code::OverLimit as i32
        );
    }
}
