//! Encoding a read batch's forwarded ops (`forward.rs`): ops sharing a
//! rule's parameters encode as each alone would, and read back as written.

use super::*;
use crate::limiter::droplet_bucket::TakeRequest;
use crate::rules::Algorithm;

fn rule_op(key: &[u8], algorithm: Algorithm, credit_limit: u64, peek: bool) -> OpView<'_> {
    OpView {
        key,
        algorithm,
        credit_limit,
        reset_seconds: 3_600,
        peek,
        bucket: None,
        lease_wanted: 0,
    }
}

#[test]
fn ops_sharing_parameters_encode_as_each_alone_would() {
    let ops = [
        rule_op(b"k1", Algorithm::FixedWindow, 1_000_000_000, false),
        rule_op(b"key-2", Algorithm::FixedWindow, 1_000_000_000, false),
        rule_op(b"k3", Algorithm::FixedWindow, 1_000_000_000, true),
        rule_op(b"k4", Algorithm::TokenBucket, 1_000_000_000, true),
        rule_op(b"k5", Algorithm::TokenBucket, 7, true),
        // A droplet bucket's take between two ops of one rule: encoded
        // whole, and the next op still copies the rule's parameters.
        OpView {
            bucket: Some(super::super::data_frames::BucketOp {
                request: TakeRequest {
                    count: 2,
                    reset: false,
                    limits: [10, 0, 0, 0, 0, 1],
                },
                cleanup_interval_ms: 60_000,
            }),
            reset_seconds: 0,
            ..rule_op(b"bucket", Algorithm::FixedWindow, 0, false)
        },
        rule_op(b"k6", Algorithm::TokenBucket, 7, true),
        rule_op(b"", Algorithm::SlidingWindow, 7, false),
        // Asking for a lease, then the same rule without asking.
        OpView {
            lease_wanted: 13,
            ..rule_op(b"k7", Algorithm::FixedWindow, 1_000, false)
        },
        OpView {
            lease_wanted: 13,
            ..rule_op(b"k8", Algorithm::FixedWindow, 1_000, false)
        },
        rule_op(b"k9", Algorithm::FixedWindow, 1_000, false),
    ];
    let (mut bytes, mut last) = (Vec::new(), None);
    // Each op as the batch encodes it, then each alone: the same bytes,
    // which read back as the op.
    let at: Vec<(u32, u32)> = ops
        .iter()
        .map(|op| encode_op(&mut bytes, &mut last, op))
        .collect();
    for (op, (start, end)) in ops.iter().zip(at) {
        let mut alone = Vec::new();
        put_op(&mut alone, op);
        assert_eq!(&bytes[start as usize..end as usize], &alone[..]);
        assert_eq!(Reader::new(&alone).op().unwrap(), *op);
    }
}
