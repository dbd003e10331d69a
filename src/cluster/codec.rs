//! The peer protocol's frames, and the only place that names bincode: a
//! frame is `u32 LE length` (of what follows), `u64 LE request id`, then the
//! body: a control message in bincode's standard configuration (varint
//! integers), or, under the id [`DATA_FRAME_ID`](super::data_frames::DATA_FRAME_ID),
//! data sections ([`data_frames`](super::data_frames)). Frames are bounded
//! by [`FRAME_BYTES_MAX`], checked before anything is allocated.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt};

/// Largest frame accepted, in bytes.
pub const FRAME_BYTES_MAX: usize = 64 * 1024 * 1024;

/// Bytes of a frame header: length and request id.
const HEADER_BYTES: usize = 12;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("cannot encode a peer message: {0}")]
    Encode(String),
    #[error("cannot decode a peer message: {0}")]
    Decode(String),
    #[error("peer frame of {0} bytes exceeds the limit of {FRAME_BYTES_MAX} bytes")]
    TooLarge(usize),
    #[error("peer connection: {0}")]
    Io(#[from] std::io::Error),
}

/// The encoding of frames. The limit makes the decoder refuse a length
/// claimed inside a message (a string, a list) beyond the frame's bound
/// before it allocates for it: without it, a 19-byte message claiming a
/// 2.5 GB string made the decoder try to allocate that much (found by the
/// `peer_frames` fuzz target).
fn config() -> bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<FRAME_BYTES_MAX>,
> {
    bincode::config::standard().with_limit::<FRAME_BYTES_MAX>()
}

/// Appends one frame carrying `message` under `request_id` to `out`.
pub fn encode_frame<T: Serialize>(
    out: &mut Vec<u8>,
    request_id: u64,
    message: &T,
) -> Result<(), CodecError> {
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_BYTES]);
    let written = bincode::serde::encode_into_std_write(message, out, config())
        .map_err(|error| CodecError::Encode(error.to_string()));
    let length = out.len() - start - 4;
    match written {
        Ok(_) if length <= FRAME_BYTES_MAX => {}
        Ok(_) => {
            out.truncate(start);
            return Err(CodecError::TooLarge(length));
        }
        Err(error) => {
            out.truncate(start);
            return Err(error);
        }
    }
    out[start..start + 4].copy_from_slice(&(length as u32).to_le_bytes());
    out[start + 4..start + HEADER_BYTES].copy_from_slice(&request_id.to_le_bytes());
    Ok(())
}

/// Reads one frame: its request id and message. `buf` is reused between calls.
pub async fn read_frame<T: DeserializeOwned>(
    reader: &mut (impl AsyncRead + Unpin),
    buf: &mut Vec<u8>,
) -> Result<(u64, T), CodecError> {
    let id = read_raw_frame(reader, buf).await?;
    Ok((id, decode(buf)?))
}

/// The frame at the start of `bytes`, if all of it is there: its request
/// id and where its body lies in `bytes` (checked as [`read_raw_frame`]
/// checks a frame). Lets a reader handle a frame where its read buffer holds
/// it, instead of copying it out first.
pub fn whole_frame_at(bytes: &[u8]) -> Result<Option<(u64, std::ops::Range<usize>)>, CodecError> {
    let Some(header) = bytes.get(..HEADER_BYTES) else {
        return Ok(None);
    };
    let length = frame_length(header)?;
    let end = HEADER_BYTES + (length - 8);
    if bytes.len() < end {
        return Ok(None);
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&header[4..HEADER_BYTES]);
    Ok(Some((u64::from_le_bytes(id), HEADER_BYTES..end)))
}

/// The length a frame's header declares (its id and body), refused when it
/// is over [`FRAME_BYTES_MAX`] or too short to hold the id.
fn frame_length(header: &[u8]) -> Result<usize, CodecError> {
    let length = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    if length > FRAME_BYTES_MAX {
        return Err(CodecError::TooLarge(length));
    }
    if length < 8 {
        return Err(CodecError::Decode(format!(
            "frame of {length} bytes is too short"
        )));
    }
    Ok(length)
}

/// Reads one frame's request id, leaving its body in `buf`.
pub async fn read_raw_frame(
    reader: &mut (impl AsyncRead + Unpin),
    buf: &mut Vec<u8>,
) -> Result<u64, CodecError> {
    let mut header = [0u8; HEADER_BYTES];
    reader.read_exact(&mut header).await?;
    let length = frame_length(&header)?;
    let mut id = [0u8; 8];
    id.copy_from_slice(&header[4..]);
    buf.clear();
    buf.resize(length - 8, 0);
    reader.read_exact(buf).await?;
    Ok(u64::from_le_bytes(id))
}

/// Decodes one message (a frame's body, after its header): the whole of
/// `bytes` or an error. Public for the peer-frame fuzz target.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    let (value, used) = bincode::serde::decode_from_slice(bytes, config())
        .map_err(|error| CodecError::Decode(error.to_string()))?;
    if used != bytes.len() {
        return Err(CodecError::Decode(format!(
            "{} trailing bytes after the message",
            bytes.len() - used
        )));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::storage::TollgateRaft;
    use crate::cluster::wire::{ApplyRefusal, PeerRequest, PeerResponse};
    use crate::limiter::CounterState;
    use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse};
    use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Vote};

    async fn roundtrip<T: Serialize + DeserializeOwned>(message: &T) -> T {
        let mut bytes = Vec::new();
        encode_frame(&mut bytes, 7, message).unwrap();
        encode_frame(&mut bytes, 8, message).unwrap();
        let mut reader = &bytes[..];
        let mut buf = Vec::new();
        let (id, _first): (u64, T) = read_frame(&mut reader, &mut buf).await.unwrap();
        assert_eq!(id, 7);
        let (id, second) = read_frame(&mut reader, &mut buf).await.unwrap();
        assert_eq!(id, 8);
        assert!(reader.is_empty());
        second
    }

    #[tokio::test]
    async fn peer_messages_roundtrip() {
        let log_id = LogId::new(CommittedLeaderId::new(3, 1), 42);
        let entry = Entry::<TollgateRaft> {
            log_id,
            payload: EntryPayload::Normal(()),
        };
        let rpc = AppendEntriesRequest::<TollgateRaft> {
            vote: Vote::new_committed(3, 1),
            prev_log_id: Some(log_id),
            leader_commit: Some(log_id),
            entries: vec![entry.clone()],
        };
        match roundtrip(&PeerRequest::Append { shard: 5, rpc }).await {
            PeerRequest::Append { shard, rpc } => {
                assert_eq!(shard, 5);
                assert_eq!(rpc.entries, vec![entry]);
                assert_eq!(rpc.vote, Vote::new_committed(3, 1));
            }
            other => panic!("{other:?}"),
        }
        let response = PeerResponse::Append(Ok(AppendEntriesResponse::Success));
        assert!(matches!(
            roundtrip(&response).await,
            PeerResponse::Append(Ok(AppendEntriesResponse::Success))
        ));
        let counters = vec![(
            b"k".to_vec(),
            CounterState::Window {
                end_ms: 1_700_000_060_000,
                used: 5,
            },
        )];
        match roundtrip(&PeerRequest::Sync {
            shard: 2,
            term: 9,
            stamped_ms: 1_700_000_000_000,
            counters: counters.clone(),
        })
        .await
        {
            PeerRequest::Sync {
                shard: 2,
                term: 9,
                counters: back,
                ..
            } => assert_eq!(back, counters),
            other => panic!("{other:?}"),
        }
        let fenced = PeerResponse::Collected(Err(ApplyRefusal::Fenced { term: 4 }));
        assert!(matches!(
            roundtrip(&fenced).await,
            PeerResponse::Collected(Err(ApplyRefusal::Fenced { term: 4 }))
        ));
    }

    #[tokio::test]
    async fn oversized_and_garbled_frames_are_errors_not_panics() {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&(u32::MAX).to_le_bytes());
        bytes.extend_from_slice(&[0u8; 8]);
        let mut buf = Vec::new();
        let result: Result<(u64, PeerRequest), _> = read_frame(&mut &bytes[..], &mut buf).await;
        assert!(matches!(result, Err(CodecError::TooLarge(_))));

        let mut bytes = Vec::new();
        bytes.extend_from_slice(&12u32.to_le_bytes());
        bytes.extend_from_slice(&[0u8; 8]);
        bytes.extend_from_slice(&[0xff, 0xff, 0xff, 0xff]);
        let result: Result<(u64, PeerRequest), _> = read_frame(&mut &bytes[..], &mut buf).await;
        assert!(matches!(result, Err(CodecError::Decode(_))), "{result:?}");

        let result: Result<(u64, PeerRequest), _> = read_frame(&mut &bytes[..5], &mut buf).await;
        assert!(matches!(result, Err(CodecError::Io(_))));
    }

    #[test]
    fn a_frame_is_found_in_place_only_when_all_of_it_is_there() {
        let mut bytes = Vec::new();
        encode_frame(&mut bytes, 7, &PeerResponse::Refused("no".into())).unwrap();
        let first_end = bytes.len();
        encode_frame(&mut bytes, 9, &PeerResponse::Refused("again".into())).unwrap();
        let (id, body) = whole_frame_at(&bytes)
            .unwrap()
            .expect("the first frame is whole");
        assert_eq!((id, body.start, body.end), (7, HEADER_BYTES, first_end));
        assert!(matches!(
            decode::<PeerResponse>(&bytes[body]).unwrap(),
            PeerResponse::Refused(why) if why == "no"
        ));
        let (id, body) = whole_frame_at(&bytes[first_end..]).unwrap().unwrap();
        assert_eq!((id, body.end), (9, bytes.len() - first_end));
        // Short of its last byte, or of its header: not there yet.
        assert!(whole_frame_at(&bytes[..first_end - 1]).unwrap().is_none());
        assert!(whole_frame_at(&bytes[..HEADER_BYTES - 1])
            .unwrap()
            .is_none());
        // A header claiming too much, or too little to hold the id: refused
        // before anything else is read.
        let mut huge = (u32::MAX).to_le_bytes().to_vec();
        huge.extend_from_slice(&[0u8; 8]);
        assert!(matches!(
            whole_frame_at(&huge),
            Err(CodecError::TooLarge(_))
        ));
        let mut short = 7u32.to_le_bytes().to_vec();
        short.extend_from_slice(&[0u8; 8]);
        assert!(matches!(whole_frame_at(&short), Err(CodecError::Decode(_))));
    }

    #[test]
    fn a_claimed_length_beyond_the_bound_is_refused_before_allocating() {
        // Found by the peer_frames fuzz target: a string claiming 2.5 GB.
        let bytes = [
            0u8, 0, 0, 128, 252, 153, 153, 153, 153, 153, 153, 153, 153, 153, 153, 153, 153, 153, 0,
        ];
        assert!(decode::<PeerResponse>(&bytes).is_err());
        assert!(decode::<PeerRequest>(&bytes).is_err());
    }
}
