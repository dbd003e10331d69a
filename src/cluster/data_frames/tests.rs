//! Round trips and bounds of the data frame encoding (`data_frames.rs`):
//! every encoded section reads back as written, and truncated or corrupt
//! bodies are refused without a panic.

use super::*;
use crate::limiter::Refill;

/// A droplet bucket's take as a forwarded op carries it.
fn bucket_take(key: &[u8], request: TakeRequest, cleanup_interval_ms: u64) -> OpView<'_> {
    OpView {
        key,
        algorithm: Algorithm::FixedWindow,
        credit_limit: 0,
        reset_seconds: 0,
        peek: false,
        bucket: Some(BucketOp {
            request,
            cleanup_interval_ms,
        }),
        lease_wanted: 0,
    }
}

#[test]
fn droplet_ops_answers_and_cells_roundtrip() {
    let take = bucket_take(
        b"\x00droplet-bucket",
        TakeRequest {
            count: -7,
            reset: true,
            limits: [10, 0, u32::MAX, 0, 1, 0],
        },
        60_000,
    );
    let query = OpView { peek: true, ..take };
    let answer = WireDecision::Bucket {
        accept: false,
        balances: [Some(-1), None, Some(i32::MAX), None, Some(i32::MIN), None],
    };
    let cell = CounterState::DropletPeriod(PeriodCell {
        version: 3 << 40 | 9,
        forget_at_ms: u64::MAX,
        full_ms: 1_700_000_000_123,
        remainder: 7,
        limit: u32::MAX,
    });
    let mut out = Vec::new();
    put_op(&mut out, &take);
    put_op(&mut out, &query);
    put_decision(&mut out, &answer);
    put_state(&mut out, &cell);
    let mut reader = Reader::new(&out);
    assert_eq!(reader.op().unwrap(), take);
    assert_eq!(reader.op().unwrap(), query);
    assert_eq!(reader.decision().unwrap(), answer);
    assert_eq!(reader.state().unwrap(), cell);
    assert!(reader.is_empty());
    // Every cut is an error, never a panic.
    for cut in 0..out.len() {
        let mut reader = Reader::new(&out[..cut]);
        let read = reader.op().and_then(|_| reader.op()).map(drop);
        let read = read.and_then(|_| reader.decision().map(drop));
        assert!(read.and_then(|_| reader.state().map(drop)).is_err());
    }
    // A count out of range and a bad reset flag are refused.
    let mut bad = Vec::new();
    put_bytes(&mut bad, b"k");
    bad.push(BUCKET_OP_CODE);
    put_signed(&mut bad, i64::from(i32::MAX) + 1);
    assert_eq!(
        Reader::new(&bad).op(),
        Err(FrameError::Invalid("bucket count"))
    );
    let mut bad = Vec::new();
    put_bytes(&mut bad, b"k");
    bad.push(BUCKET_OP_CODE);
    put_signed(&mut bad, 1);
    bad.push(2);
    assert_eq!(
        Reader::new(&bad).op(),
        Err(FrameError::Invalid("bucket reset flag"))
    );
}

#[test]
fn sections_roundtrip() {
    let mut out = Vec::new();
    let op = OpView {
        key: b"\x01\x02actor",
        algorithm: Algorithm::SlidingWindow,
        credit_limit: 1_000_000_000_000,
        reset_seconds: 3600,
        peek: true,
        bucket: None,
        lease_wanted: 0,
    };
    // A fixed window's hit asking for a quota lease (peer protocol 2.3).
    let asking = OpView {
        algorithm: Algorithm::FixedWindow,
        peek: false,
        lease_wanted: u32::MAX,
        ..op
    };
    let at = begin_counted(&mut out, tag::FORWARD, &[77]);
    put_op(&mut out, &op);
    put_op(&mut out, &OpView { peek: false, ..op });
    put_op(&mut out, &asking);
    end_counted(&mut out, at, 3);
    let states = [
        CounterState::Window {
            end_ms: 1_700_000_060_000,
            used: 5,
        },
        CounterState::TokenBucket {
            full_at: FullAt::from_shortfall(Refill::new(10, 1000).unwrap(), 1_700_000_000_000, 3),
        },
        CounterState::SlidingWindow {
            expires_at_ms: 1_700_000_120_000,
            current: 4,
            previous: 9,
        },
    ];
    let at = begin_counted(&mut out, tag::ROUND, &[9, 1_700_000_000_000, 63, 12]);
    for (i, state) in states.iter().enumerate() {
        put_bytes(&mut out, &[i as u8; 10]);
        put_state(&mut out, state);
    }
    end_counted(&mut out, at, states.len() as u32);
    let decisions = [
        WireDecision::Decided {
            allowed: true,
            credit: -1,
            next_reset_seconds: 60,
        },
        WireDecision::Decided {
            allowed: false,
            credit: 0,
            next_reset_seconds: i64::MIN,
        },
        WireDecision::Unavailable {
            shard: 3,
            why: ShardRefusal::CommitTimeout(400),
        },
        WireDecision::Retry {
            shard: 4,
            why: ShardRefusal::Other("because".into()),
        },
        WireDecision::Full { live_keys_max: 7 },
        WireDecision::Leased {
            credit: 900,
            next_reset_seconds: 3_600,
            lease: 15,
        },
    ];
    out.push(tag::ANSWERS);
    put_varint(&mut out, 99);
    put_varint(&mut out, decisions.len() as u64);
    for (i, decision) in decisions.iter().enumerate() {
        put_varint(&mut out, 5);
        put_varint(&mut out, i as u64);
        put_decision(&mut out, decision);
    }
    let at = begin_counted(&mut out, tag::ROUND_ANSWERS, &[99, 9, 63]);
    put_varint(&mut out, 6);
    put_varint(&mut out, 2);
    put_decision(&mut out, &decisions[0]);
    end_counted(&mut out, at, 1);
    put_sample_ack(&mut out);

    let mut reader = Reader::new(&out);
    assert_eq!(reader.u8().unwrap(), tag::FORWARD);
    assert_eq!(reader.varint().unwrap(), 77);
    assert_eq!(reader.count(4).unwrap(), 3);
    assert_eq!(reader.op().unwrap(), op);
    assert_eq!(reader.op().unwrap(), OpView { peek: false, ..op });
    assert_eq!(reader.op().unwrap(), asking);
    assert_eq!(reader.u8().unwrap(), tag::ROUND);
    let header = RoundHeader::read(&mut reader).unwrap();
    assert_eq!(
        (
            header.round,
            header.stamped_ms,
            header.shard,
            header.term,
            header.count
        ),
        (9, 1_700_000_000_000, 63, 12, 3)
    );
    for (i, state) in states.iter().enumerate() {
        assert_eq!(reader.bytes().unwrap(), &[i as u8; 10]);
        assert_eq!(&reader.state().unwrap(), state);
    }
    assert_eq!(reader.u8().unwrap(), tag::ANSWERS);
    assert_eq!(reader.varint().unwrap(), 99);
    assert_eq!(reader.count(3).unwrap(), decisions.len() as u32);
    for (i, decision) in decisions.iter().enumerate() {
        assert_eq!(reader.varint().unwrap(), 5);
        assert_eq!(reader.varint().unwrap(), i as u64);
        assert_eq!(&reader.decision().unwrap(), decision);
    }
    assert_eq!(reader.u8().unwrap(), tag::ROUND_ANSWERS);
    let header = RoundAnswersHeader::read(&mut reader).unwrap();
    assert_eq!(
        (header.boot, header.round, header.shard, header.count),
        (99, 9, 63, 1)
    );
    assert_eq!(reader.varint().unwrap(), 6);
    assert_eq!(reader.varint().unwrap(), 2);
    assert_eq!(&reader.decision().unwrap(), &decisions[0]);
    assert_eq!(reader.u8().unwrap(), tag::ACK);
    let ack = Ack::read(&mut reader).unwrap();
    assert_eq!((ack.boot, ack.upto), (7, 41));
    assert_eq!(
        ack.refused,
        vec![
            (40, 3, ApplyRefusal::Fenced { term: 9 }),
            (41, 1, ApplyRefusal::NotReplica)
        ]
    );
    assert!(reader.is_empty());

    // The walk sees every section and every key, in order.
    let mut keys = Vec::new();
    let sections = walk_keys(&out, |key| {
        keys.push(key.to_vec());
        true
    })
    .unwrap();
    assert_eq!(sections, 5);
    let mut expected = vec![op.key.to_vec(), op.key.to_vec(), op.key.to_vec()];
    expected.extend((0..3).map(|i| vec![i as u8; 10]));
    assert_eq!(keys, expected);
}

#[test]
fn garbled_input_is_an_error_not_a_panic() {
    // A length far beyond the frame.
    let mut reader = Reader::new(&[0xff, 0xff, 0xff, 0xff, 0x0f, 1, 2]);
    assert_eq!(reader.bytes(), Err(FrameError::Truncated));
    // A varint of eleven bytes.
    let mut reader = Reader::new(&[0xff; 11]);
    assert_eq!(reader.varint(), Err(FrameError::Invalid("varint")));
    // A count claiming more items than bytes left.
    let mut reader = Reader::new(&[100, 1, 2, 3]);
    assert_eq!(reader.count(1), Err(FrameError::Truncated));
    // Unknown codes.
    assert!(Reader::new(&[9]).state().is_err());
    assert!(Reader::new(&[1, 0, 0x7f, 1, 1]).op().is_err());
    assert!(Reader::new(&[9]).decision().is_err());
    assert!(Reader::new(&[]).u8().is_err());
}

#[test]
fn counted_sections_hold_any_u32_count() {
    for count in [0, 1, 127, 128, 16_383, 16_384, u32::MAX] {
        let mut out = Vec::new();
        let at = begin_counted(&mut out, tag::FORWARD, &[]);
        end_counted(&mut out, at, count);
        let mut reader = Reader::new(&out[1..]);
        assert_eq!(reader.u32().unwrap(), count);
        assert!(reader.is_empty());
    }
}

#[test]
fn the_fuzz_seed_of_answers_riding_with_a_round_is_a_valid_frame() {
    // fuzz/corpus/peer_frames/round_answers: a ROUND section, then the
    // ROUND_ANSWERS of the hits its receiver forwarded.
    let seed = include_bytes!("../../../fuzz/corpus/peer_frames/round_answers");
    assert_eq!(validate(seed), Ok(2));
}

#[test]
fn varints_round_trip_at_every_length_and_position() {
    let mut values = vec![0, 1, 0x7f, 0x80, 0x3fff, 0x4000, u64::MAX, u64::MAX - 1];
    for bits in 1..64 {
        values.push(1 << bits);
        values.push((1 << bits) - 1);
    }
    for &value in &values {
        // LEB128 by its definition, a byte at a time.
        let mut reference = Vec::new();
        let mut rest = value;
        loop {
            let group = (rest & 0x7f) as u8;
            rest >>= 7;
            if rest == 0 {
                reference.push(group);
                break;
            }
            reference.push(group | 0x80);
        }
        // Alone (the byte-at-a-time path near a body's end), and followed by
        // enough bytes for the eight-byte word; written after other bytes
        // and alone.
        for trailing in [0usize, 3, 12] {
            // Into a buffer that must grow for it, and into one with room.
            let mut out = vec![0x55; trailing];
            put_varint(&mut out, value);
            assert_eq!(out[trailing..], reference, "{value:#x}");
            let mut roomy = Vec::with_capacity(64);
            roomy.resize(trailing, 0x55);
            put_varint(&mut roomy, value);
            assert_eq!(roomy[trailing..], reference, "{value:#x} with room");
            let mut out = Vec::new();
            put_varint(&mut out, value);
            let encoded = out.len();
            out.extend(std::iter::repeat_n(0xaa, trailing));
            let mut reader = Reader::new(&out);
            assert_eq!(reader.varint().unwrap(), value, "{value:#x}");
            assert_eq!(
                reader.remaining(),
                trailing,
                "{value:#x} used {encoded} bytes"
            );
        }
    }
}

#[test]
fn malformed_varints_are_refused_on_both_paths() {
    for trailing in [0usize, 12] {
        // An eleventh byte would be needed: ten bytes all continuing.
        let mut endless = vec![0x80u8; 10];
        endless.extend(std::iter::repeat_n(0, trailing));
        assert!(Reader::new(&endless).varint().is_err(), "{trailing}");
        // The tenth byte may only carry the top bit of a u64.
        let mut too_big = vec![0xffu8; 9];
        too_big.push(0x02);
        too_big.extend(std::iter::repeat_n(0, trailing));
        assert!(Reader::new(&too_big).varint().is_err(), "{trailing}");
        let mut top_bit = vec![0x80u8; 9];
        top_bit.push(0x01);
        top_bit.extend(std::iter::repeat_n(0, trailing));
        assert_eq!(Reader::new(&top_bit).varint().unwrap(), 1 << 63);
    }
    // Cut short.
    assert!(Reader::new(&[0x80, 0x80]).varint().is_err());
    assert!(Reader::new(&[]).varint().is_err());
}

/// An ack of rounds up to 41 of incarnation 7, with both kinds of refusal.
fn put_sample_ack(out: &mut Vec<u8>) {
    put_ack(
        out,
        7,
        41,
        &[
            (40, 3, ApplyRefusal::Fenced { term: 9 }),
            (41, 1, ApplyRefusal::NotReplica),
        ],
    );
}

/// A frame with every section kind and every variant of what they carry.
fn frame_of_every_kind() -> Vec<u8> {
    let mut out = Vec::new();
    let hit = OpView {
        key: b"\x05hit-key",
        algorithm: Algorithm::TokenBucket,
        credit_limit: 300,
        reset_seconds: 1 << 40,
        peek: true,
        bucket: None,
        lease_wanted: 0,
    };
    let take = bucket_take(
        b"\x00bucket",
        TakeRequest {
            count: -3,
            reset: false,
            limits: [1, u32::MAX, 0, 7, 0, 1 << 20],
        },
        1 << 33,
    );
    let at = begin_counted(&mut out, tag::FORWARD, &[u64::MAX]);
    put_op(&mut out, &hit);
    put_op(&mut out, &take);
    put_op(
        &mut out,
        &OpView {
            key: b"\x05leased-key",
            algorithm: Algorithm::FixedWindow,
            peek: false,
            lease_wanted: 40,
            ..hit
        },
    );
    end_counted(&mut out, at, 3);
    let decisions = [
        WireDecision::Decided {
            allowed: true,
            credit: i64::MIN,
            next_reset_seconds: 1,
        },
        WireDecision::Unavailable {
            shard: 63,
            why: ShardRefusal::Other("a refusal's text".into()),
        },
        WireDecision::Retry {
            shard: 1,
            why: ShardRefusal::Superseded(u64::MAX),
        },
        WireDecision::Retry {
            shard: 2,
            why: ShardRefusal::HandingOver,
        },
        WireDecision::Full { live_keys_max: 9 },
        WireDecision::Bucket {
            accept: true,
            balances: [None, Some(-5), None, Some(i32::MAX), None, Some(0)],
        },
        WireDecision::Leased {
            credit: i64::MAX,
            next_reset_seconds: -1,
            lease: u32::MAX,
        },
    ];
    let at = begin_counted(&mut out, tag::ANSWERS, &[3]);
    for (index, decision) in decisions.iter().enumerate() {
        put_varint(&mut out, 11);
        put_varint(&mut out, index as u64);
        put_decision(&mut out, decision);
    }
    end_counted(&mut out, at, decisions.len() as u32);
    let states = [
        CounterState::Window {
            end_ms: 5,
            used: 1 << 50,
        },
        CounterState::SlidingWindow {
            expires_at_ms: 1,
            current: 2,
            previous: 3,
        },
        CounterState::DropletPeriod(PeriodCell {
            version: 1,
            forget_at_ms: 2,
            full_ms: 3,
            remainder: 4,
            limit: 5,
        }),
    ];
    let at = begin_counted(&mut out, tag::ROUND, &[4, 1_700_000_000_000, 2, 8]);
    for (i, state) in states.iter().enumerate() {
        put_bytes(&mut out, &[b'r', i as u8]);
        put_state(&mut out, state);
    }
    end_counted(&mut out, at, states.len() as u32);
    let at = begin_counted(&mut out, tag::ROUND_ANSWERS, &[3, 4, 2]);
    put_varint(&mut out, 12);
    put_varint(&mut out, 0);
    put_decision(&mut out, &decisions[1]);
    end_counted(&mut out, at, 1);
    let at = begin_counted(&mut out, tag::RELAY_ANSWERS, &[5, 6, 4, 2]);
    put_varint(&mut out, 13);
    put_varint(&mut out, 1);
    put_decision(&mut out, &decisions[0]);
    end_counted(&mut out, at, 1);
    let mut batch = BatchAnswersWriter::begin(&mut out, 3, u64::MAX);
    for (index, decision) in decisions.iter().enumerate() {
        batch.put(&mut out, 2 * index as u32, decision);
    }
    batch.end(&mut out);
    put_sample_ack(&mut out);
    out.push(tag::BEAT);
    let at = begin_counted(&mut out, tag::ROUND, &[5, 1, 0, 8]);
    put_bytes(&mut out, b"last");
    put_state(&mut out, &states[0]);
    end_counted(&mut out, at, 1);
    out
}

fn keys_of(walk: impl FnOnce(&mut dyn FnMut(&[u8]) -> bool)) -> Vec<Vec<u8>> {
    let mut keys = Vec::new();
    walk(&mut |key| {
        keys.push(key.to_vec());
        true
    });
    keys
}

#[test]
fn skimming_a_frame_finds_the_keys_the_full_walk_finds() {
    let frame = frame_of_every_kind();
    assert_eq!(validate(&frame), Ok(9));
    let walked = keys_of(|visit| {
        walk_keys(&frame, visit).unwrap();
    });
    let skimmed = keys_of(|visit| skim_keys(&frame, visit));
    assert_eq!(walked.len(), 7, "{walked:?}");
    assert_eq!(skimmed, walked);
    // Cut anywhere, the skim ends without a panic, having found at least
    // the keys the full walk found before its error.
    for cut in 0..frame.len() {
        let mut walked = Vec::new();
        let _ = walk_keys(&frame[..cut], |key| {
            walked.push(key.to_vec());
            true
        });
        let skimmed = keys_of(|visit| skim_keys(&frame[..cut], visit));
        assert!(
            skimmed.starts_with(&walked),
            "cut at {cut}: {skimmed:?} against {walked:?}"
        );
    }
    // A visitor that has seen enough ends the skim.
    let mut seen = 0;
    skim_keys(&frame, |_| {
        seen += 1;
        seen < 2
    });
    assert_eq!(seen, 2);
}

#[test]
fn answers_read_in_place_keep_skip_and_leave_nothing_half_read() {
    let decisions = [
        WireDecision::Decided {
            allowed: true,
            credit: 999,
            next_reset_seconds: 60,
        },
        WireDecision::Retry {
            shard: 7,
            why: ShardRefusal::Other("moving".into()),
        },
        WireDecision::Decided {
            allowed: false,
            credit: -3,
            next_reset_seconds: 0,
        },
    ];
    let mut body = Vec::new();
    for (index, decision) in decisions.iter().enumerate() {
        put_varint(&mut body, 41);
        put_varint(&mut body, index as u64);
        put_decision(&mut body, decision);
    }
    let expected: Vec<(u64, u32, WireDecision)> = decisions
        .iter()
        .enumerate()
        .map(|(index, decision)| (41, index as u32, decision.clone()))
        .collect();
    // Kept: appended after what the list held, each as written.
    let kept_before = (1, 2, WireDecision::Full { live_keys_max: 5 });
    let mut into = vec![kept_before.clone()];
    let mut reader = Reader::new(&body);
    reader.answers_into(3, true, &mut into).unwrap();
    assert!(reader.is_empty());
    assert_eq!(into[0], kept_before);
    assert_eq!(&into[1..], &expected[..]);
    // Skipped: read past, nothing appended.
    let mut into = Vec::new();
    let mut reader = Reader::new(&body);
    reader.answers_into(3, false, &mut into).unwrap();
    assert!(reader.is_empty() && into.is_empty());
    // Cut short anywhere: an error, and the list as it was.
    for cut in 0..body.len() {
        let mut into = vec![kept_before.clone()];
        let mut reader = Reader::new(&body[..cut]);
        assert!(
            reader.answers_into(3, true, &mut into).is_err(),
            "cut at {cut}"
        );
        assert_eq!(into, vec![kept_before.clone()], "cut at {cut}");
    }
}

#[test]
fn an_op_read_into_a_reused_view_replaces_every_field() {
    let bucket = bucket_take(
        b"\x00bucket",
        TakeRequest {
            count: 2,
            reset: false,
            limits: [5, 0, 0, 0, 0, 0],
        },
        1_000,
    );
    let rule_op = OpView {
        key: b"rule-key",
        algorithm: Algorithm::SlidingWindow,
        credit_limit: 100,
        reset_seconds: 60,
        peek: true,
        bucket: None,
        lease_wanted: 0,
    };
    let mut body = Vec::new();
    put_op(&mut body, &bucket);
    put_op(&mut body, &rule_op);
    put_op(&mut body, &bucket);
    let mut reader = Reader::new(&body);
    let mut op = OpView::EMPTY;
    for expected in [bucket, rule_op, bucket] {
        reader.op_into(&mut op).unwrap();
        assert_eq!(op, expected);
    }
    assert!(reader.is_empty());
}

/// A batch-answers section as read back: boot, batch, and each answer's
/// `(index, decision)`.
type ReadBack = (u64, u64, Vec<(u64, WireDecision)>);

/// The answers of one batch's section, read back.
fn batch_answers_of(section: &[u8]) -> Result<ReadBack, FrameError> {
    let mut reader = Reader::new(section);
    assert_eq!(reader.u8()?, tag::BATCH_ANSWERS);
    let header = BatchAnswersHeader::read(&mut reader)?;
    assert!(reader.is_empty(), "the section ends with its entries");
    let mut answers = BatchAnswers::new(header.entries);
    let mut read = Vec::new();
    while let Some(entry) = answers.next_entry()? {
        read.push(entry);
    }
    Ok((header.boot, header.batch, read))
}

#[test]
fn a_batchs_answers_read_back_at_their_indexes_and_an_unfinished_section_goes() {
    let decided = |credit| WireDecision::Decided {
        allowed: credit > 0,
        credit,
        next_reset_seconds: 60,
    };
    let refused = WireDecision::Retry {
        shard: 7,
        why: ShardRefusal::NotLeader(2),
    };
    // Indexes with gaps (ops that wait for their commit are not answered
    // here): 0, 1, then 5, then 300 (a gap of more than one varint byte).
    let written = [
        (0, decided(999)),
        (1, decided(-1)),
        (5, refused.clone()),
        (300, decided(0)),
    ];
    let mut out = vec![tag::BEAT];
    let mut section = BatchAnswersWriter::begin(&mut out, 77, 1 << 40);
    for (index, decision) in &written {
        section.put(&mut out, *index, decision);
    }
    assert_eq!(section.end(&mut out), 4);
    let (boot, batch, read) = batch_answers_of(&out[1..]).unwrap();
    assert_eq!((boot, batch), (77, 1 << 40));
    let expected: Vec<_> = written
        .iter()
        .map(|(i, d)| (u64::from(*i), d.clone()))
        .collect();
    assert_eq!(read, expected);
    assert_eq!(validate(&out), Ok(2));
    // The prefetch's skim steps over the section whole, to what follows.
    let mut framed = out.clone();
    let at = begin_counted(&mut framed, tag::ROUND, &[1, 2, 3, 4]);
    put_bytes(&mut framed, b"after");
    put_state(&mut framed, &CounterState::Window { end_ms: 1, used: 1 });
    end_counted(&mut framed, at, 1);
    assert_eq!(
        keys_of(|visit| skim_keys(&framed, visit)),
        vec![b"after".to_vec()]
    );
    // A section cut inside an entry, or claiming more than there is, is an
    // error, not a panic.
    for cut in 1..out.len() {
        assert!(batch_answers_of(&out[1..cut]).is_err(), "cut at {cut}");
    }
    // A section abandoned half-written leaves what came before it.
    let mut out = vec![tag::BEAT];
    let mut section = BatchAnswersWriter::begin(&mut out, 1, 2);
    section.put(&mut out, 0, &decided(5));
    section.abandon(&mut out);
    assert_eq!(out, vec![tag::BEAT]);
    // An empty section reads as no answers.
    let mut out = Vec::new();
    assert_eq!(BatchAnswersWriter::begin(&mut out, 1, 2).end(&mut out), 0);
    assert_eq!(batch_answers_of(&out).unwrap().2, Vec::new());
}

#[test]
fn the_fuzz_seed_of_a_batchs_answers_is_a_valid_frame() {
    // fuzz/corpus/peer_frames/batch_answers: a FORWARD section of two ops,
    // then a BATCH_ANSWERS section answering both.
    let seed = include_bytes!("../../../fuzz/corpus/peer_frames/batch_answers");
    assert_eq!(validate(seed), Ok(2));
}

#[test]
fn relayed_answers_are_sent_on_as_the_leader_wrote_them() {
    let decisions = [
        WireDecision::from(crate::limiter::Decision {
            allowed: true,
            credit: 41,
            next_reset_seconds: 60,
        }),
        WireDecision::Unavailable {
            shard: 7,
            why: ShardRefusal::CommitTimeout(2000),
        },
    ];
    let mut out = Vec::new();
    let at = begin_counted(&mut out, tag::RELAY_ANSWERS, &[4, 77, 12, 7]);
    for (index, decision) in decisions.iter().enumerate() {
        put_varint(&mut out, 300);
        put_varint(&mut out, index as u64);
        put_decision(&mut out, decision);
    }
    end_counted(&mut out, at, decisions.len() as u32);
    // The fuzz seed fuzz/corpus/peer_frames/relay_answers is this section:
    // the fuzzer starts from a valid one, and a change of its encoding is
    // noticed here.
    let seed = include_bytes!("../../../fuzz/corpus/peer_frames/relay_answers");
    assert_eq!(out, seed);
    assert_eq!(validate(&out), Ok(1));
    let mut reader = Reader::new(&out);
    assert_eq!(reader.u8().unwrap(), tag::RELAY_ANSWERS);
    let header = RelayAnswersHeader::read(&mut reader).unwrap();
    assert_eq!(
        (header.to, header.answers.boot, header.answers.round),
        (4, 77, 12)
    );
    assert_eq!((header.answers.shard, header.answers.count), (7, 2));
    let entries = reader.answers_span(header.answers.count).unwrap();
    assert!(reader.is_empty());
    // Sent on as an ANSWERS section for incarnation 77: the same answers.
    let mut sent_on = Vec::new();
    let at = begin_counted(&mut sent_on, tag::ANSWERS, &[77]);
    sent_on.extend_from_slice(entries);
    end_counted(&mut sent_on, at, header.answers.count);
    let mut reader = Reader::new(&sent_on);
    assert_eq!(reader.u8().unwrap(), tag::ANSWERS);
    assert_eq!(reader.varint().unwrap(), 77);
    let count = reader.count(3).unwrap();
    let mut answers = Vec::new();
    reader.answers_into(count, true, &mut answers).unwrap();
    assert_eq!(
        answers,
        vec![
            (300, 0, decisions[0].clone()),
            (300, 1, decisions[1].clone())
        ]
    );
    // Cut short, the span is an error, not a panic.
    for cut in 0..entries.len() {
        let mut reader = Reader::new(&entries[..cut]);
        assert!(reader.answers_span(2).is_err(), "cut at {cut}");
    }
}
