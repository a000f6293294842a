//! Frames and the byte layout of every message. No I/O: transports call [`encode_payload`]
//! and [`header`] to send, [`parse_header`] and [`decode`] to receive.
//!
//! # Frame
//!
//! | bytes | field                           |
//! |-------|---------------------------------|
//! | 0..4  | payload length, u32             |
//! | 4..6  | message kind, u16 (table below) |
//! | 6..8  | flags, u16, always 0 (reserved) |
//! | 8..   | payload                         |
//!
//! After a handshake with a token, each frame's payload is sealed and followed by a
//! 16-byte tag (not counted in the length): [`auth::FrameSeal`](crate::auth::FrameSeal),
//! AES-256-GCM keyed per connection and direction, nonce the frame's sequence number,
//! the header authenticated as associated data. Both ends know from the handshake
//! whether frames are sealed, so nothing in the frame says so (a flag would only invite
//! a peer to clear it).
//!
//! # Primitives
//!
//! Every integer and float is little-endian; f32 travels as its bit pattern. `bool` is one
//! byte, 0 or 1. `role` is one byte: 0 Head, 1 Worker, 2 Ring, 3 Heartbeat,
//! 4 Member. `[32]` is 32 raw bytes.
//! `str` is a u32 byte length then UTF-8 (at most 64 KiB); `bytes` a u32 length then the
//! bytes; `opt<T>` a byte 0 (absent) or 1 followed by `T`; `[T]` a u32 count then the
//! elements. Nothing is padded or aligned. Decoding is strict: any other byte value,
//! a short payload and trailing bytes are all errors, so each message has exactly one
//! encoding (decode followed by encode gives back the same bytes).
//!
//! # Messages
//!
//! Kind numbers are stable: a new message takes a new number and a retired one is never
//! reused (the one list of kinds is `kinds!` below). `Hello` must keep its layout in every
//! version: a worker refusing a peer of another version sends its own `Hello` before the
//! `Refused`, so the peer reads which version this end speaks whatever it makes of the rest.
//! `Refused` only grows at its end (version 4 appended the code), and refusal codes are
//! stable like kind numbers. A test walks every sample message with these tables and
//! checks that this text is what they render to.
//!
//! Each link carries one conversation (the last table, rendered from the conversation
//! types: [`Ring`](crate::Ring), [`Control`](crate::Control), …): a receiver turns a
//! frame into its link's conversation, and a frame of another is a
//! [`WrongConversation`](crate::WrongConversation). A kind keeps its number and layout
//! on every link it may cross.
//!
//! ```text
//! | kind | message      | payload, in order                                                        |
//! |------|--------------|--------------------------------------------------------------------------|
//! | 1    | Hello        | version u32, role, nonce [32]                                            |
//! | 2    | Auth         | proof [32]                                                               |
//! | 3    | Refused      | reason str, code u16                                                     |
//! | 4    | Describe     | model: ModelRef                                                          |
//! | 5    | Capabilities | devices [DeviceCaps], threads u32, models [HeldModel], ring_addr str,    |
//! |      |              | session u64                                                              |
//! | 6    | LoadPlan     | model: ModelRef, layer_start u32, layer_end u32, first bool, last bool,  |
//! |      |              | n_ctx u32, n_seq u32, next opt<str>, next_session u64, stream bool,      |
//! |      |              | wire_f16 bool, repack bool, devices [DeviceRange], tp opt<TpPlace>,      |
//! |      |              | cache_type_k str, cache_type_v str                                       |
//! | 7    | StreamStart  | header bytes, tensors [TensorEntry]                                      |
//! | 8    | TensorChunk  | index u32, offset u64, data bytes                                        |
//! | 9    | Loaded       | resident u64, received u64                                               |
//! | 10   | StartSeq     | seq u32, keep u32, params: SamplingParams, history [u32],                |
//! |      |              | top_logprobs u8, logprobs bool, drawn u32, grammar opt<str>, pooling u8, |
//! |      |              | budget opt<ReasoningBudget>                                              |
//! | 11   | TruncateSeq  | seq u32, len u32                                                         |
//! | 12   | EndSeq       | seq u32                                                                  |
//! | 13   | Forward      | step u64, payload: Payload, positions [i32], seq_ids [u32],              |
//! |      |              | sample_rows [u32], row_tokens [u32]                                      |
//! | 14   | Sampled      | step u64, tokens [SampledToken]                                          |
//! | 15   | Done         | (empty)                                                                  |
//! | 16   | Error        | first_layer u32, fault u16, message str                                  |
//! | 17   | Stats        | resident [u64], kv_used [u32], busy_us [u64], rows [u64],                |
//! |      |              | link_sent [u64], link_rtt_us [u64]                                       |
//! | 18   | Shutdown     | (empty)                                                                  |
//! | 19   | Ping         | timeout_ms u32, session u64                                              |
//! | 20   | Pong         | (empty)                                                                  |
//! | 21   | Partial      | sum u64, values [f32]                                                    |
//! | 22   | JoinGroup    | group u64, rank u32                                                      |
//! | 23   | Probe        | data bytes                                                               |
//! | 24   | ForwardBest  | step u64, payload: Payload, positions [i32], seq_ids [u32],              |
//! |      |              | sample_rows [u32], row_tokens [u32]                                      |
//! | 25   | Share        | step u64, values [f32]                                                   |
//! | 26   | Checkpoint   | seq u32, len u32                                                         |
//! | 27   | Pooled       | step u64, seq u32, values [f32]                                          |
//! | 28   | FetchFrom    | peer str, tensors [u32]                                                  |
//! | 29   | JoinRing     | session u64                                                              |
//!
//! | structure      | fields, in order                                                            |
//! |----------------|-----------------------------------------------------------------------------|
//! | ModelRef       | file_name str, identity [32], size u64                                      |
//! | HeldModel      | file_name str, identity [32], size u64, complete bool, content opt<[32]>    |
//! | DeviceCaps     | name str, memory u64, secs_per_layer opt<f32>                               |
//! | DeviceRange    | device str, layer_end u32                                                   |
//! | TensorEntry    | name str, offset u64, len u64, sha256 [32]                                  |
//! | SamplingParams | temperature f32, top_k i32, top_p f32, min_p f32, repeat_penalty f32,       |
//! |                | repeat_last_n u64, frequency_penalty f32, presence_penalty f32, seed u64    |
//! | ReasoningBudget | tokens u32, start [u32], ends [[u32]], forced [u32], prefill [u32]          |
//! | Payload        | tag u8, then 0: Tokens (tokens [u32]), 1: Hidden (hidden [f32]),            |
//! |                | 2: HiddenF16 (values [u16], row_exps [u8])                                  |
//! | SampledToken   | seq u32, token u32, logprob f32, top [TopLogprob]                           |
//! | TopLogprob     | token u32, logprob f32                                                      |
//! | TpPlace        | group u64, rank u32, members [str]                                          |
//!
//! Refusal codes (Refused.code): 1 Busy, 2 Auth, 3 Version, 4 TlsRequired, 5 BadRequest, 6 LoadFailed, 7 Leaving
//! Stage faults (Error.fault): 1 Request, 2 CacheFull, 3 Compute, 4 Protocol
//! Poolings (StartSeq.pooling): 0 none, 1 Mean, 2 Cls, 3 Last
//!
//! | conversation | messages that may cross it                                                    |
//! |--------------|-------------------------------------------------------------------------------|
//! | handshake    | Hello, Auth, Refused                                                          |
//! | control      | Describe, Capabilities, Probe, LoadPlan, StreamStart, TensorChunk, FetchFrom, |
//! |              | Loaded, Shutdown, Refused, Auth                                               |
//! | fetch        | StreamStart, TensorChunk, Refused                                             |
//! | heartbeat    | Ping, Pong, Refused, Auth                                                     |
//! | ring         | JoinRing, StartSeq, TruncateSeq, Checkpoint, EndSeq, Forward, Sampled,        |
//! |              | Pooled, Done, Error, Stats, Shutdown                                          |
//! | group        | JoinGroup, Partial, Forward, ForwardBest, Share, TruncateSeq, EndSeq, Done,   |
//! |              | Error, Shutdown                                                               |
//! ```
//!
//! Checks beyond the layout: a `Forward` has at least one row, as many positions as
//! sequence ids, a payload of one token per row or a whole number of hidden values per
//! row, and sample rows that exist; sampling parameters pass
//! [`SamplingParams::validate`](baton_sample::SamplingParams::validate); no f32 is NaN
//! except a log-probability (a NaN hidden state would silently poison every later
//! stage, so it is stopped at the first hop); a tensor's offset plus length fits in u64;
//! a worker offers at least one device, and a `LoadPlan`'s device ranges are non-empty,
//! in order, and end where the stage ends; a `Pooled` vector holds 1 to
//! [`MAX_POOLED_WIDTH`](crate::MAX_POOLED_WIDTH) values.

mod read;
mod write;

#[cfg(test)]
mod schema;
#[cfg(test)]
pub(crate) mod tests;

pub use read::decode;
pub use write::{encode, encode_payload, header};

use crate::{Message, Role};

/// Length of a frame header in bytes.
pub const HEADER_LEN: usize = 8;

/// A sensible frame-size limit (64 MiB) for transports that are not told otherwise; it
/// bounds what a peer can make us allocate.
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;

/// Longest string accepted in any field; names, addresses and error texts are far shorter.
const MAX_STRING: usize = 64 << 10;

/// The one list of message kinds: stable number, the constant `decode` matches on, and
/// the message's name. Numbers run from 1 without gaps (kind 0 is never used, so a
/// zeroed header is rejected); the compiler checks that.
macro_rules! kinds {
    ($($number:literal $constant:ident $name:ident,)*) => {
        /// Kind numbers, from the list above.
        mod kind {
            $(pub const $constant: u16 = $number;)*
        }

        /// Message names indexed by kind number − 1.
        pub(crate) const KIND_NAMES: [&str; [$($number),*].len()] = [$(stringify!($name)),*];

        const _: () = {
            let numbers = [$($number),*];
            let mut i = 0;
            while i < numbers.len() {
                assert!(numbers[i] as usize == i + 1, "kind numbers run from 1 without gaps");
                i += 1;
            }
        };

        /// The kind number of `msg`.
        fn kind_of(msg: &Message) -> u16 {
            match msg {
                $(Message::$name { .. } => kind::$constant,)*
            }
        }
    };
}

kinds! {
    1 HELLO Hello,
    2 AUTH Auth,
    3 REFUSED Refused,
    4 DESCRIBE Describe,
    5 CAPABILITIES Capabilities,
    6 LOAD_PLAN LoadPlan,
    7 STREAM_START StreamStart,
    8 TENSOR_CHUNK TensorChunk,
    9 LOADED Loaded,
    10 START_SEQ StartSeq,
    11 TRUNCATE_SEQ TruncateSeq,
    12 END_SEQ EndSeq,
    13 FORWARD Forward,
    14 SAMPLED Sampled,
    15 DONE Done,
    16 ERROR Error,
    17 STATS Stats,
    18 SHUTDOWN Shutdown,
    19 PING Ping,
    20 PONG Pong,
    21 PARTIAL Partial,
    22 JOIN_GROUP JoinGroup,
    23 PROBE Probe,
    24 FORWARD_BEST ForwardBest,
    25 SHARE Share,
    26 CHECKPOINT Checkpoint,
    27 POOLED Pooled,
    28 FETCH_FROM FetchFrom,
    29 JOIN_RING JoinRing,
}

/// The name of `msg`'s kind (see [`Message::kind`]).
pub(crate) fn name_of(msg: &Message) -> &'static str {
    KIND_NAMES[usize::from(kind_of(msg)) - 1]
}

/// The name of message kind `kind`, or `None` when no message has that number.
fn kind_name(kind: u16) -> Option<&'static str> {
    KIND_NAMES.get(usize::from(kind).checked_sub(1)?).copied()
}

/// Why a frame or message was refused. Each names the message and the field at fault,
/// since these end up in the log of whoever dropped the connection.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProtoError {
    /// The header announces more payload than the transport accepts.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    FrameTooLarge {
        /// Announced payload length.
        len: usize,
        /// The transport's maximum.
        max: usize,
    },
    /// No message has this kind number (a newer or a confused peer).
    #[error("unknown message kind {0}")]
    UnknownKind(u16),
    /// The header's flags are not zero; this version defines no flags.
    #[error("frame flags {0:#06x} are not zero (this protocol version defines no flags)")]
    BadFlags(u16),
    /// The payload ended, or a count promised more elements than bytes remain.
    #[error("message {kind} is truncated while reading {what}")]
    Truncated {
        /// The message being decoded.
        kind: &'static str,
        /// The field being read.
        what: &'static str,
    },
    /// Bytes remained after the last field.
    #[error("message {kind} has {extra} trailing bytes")]
    TrailingBytes {
        /// The message decoded.
        kind: &'static str,
        /// How many bytes were left over.
        extra: usize,
    },
    /// A string field is not UTF-8.
    #[error("message {kind}: {what} is not valid UTF-8")]
    BadUtf8 {
        /// The message being decoded.
        kind: &'static str,
        /// The field.
        what: &'static str,
    },
    /// A string field is longer than allowed.
    #[error("message {kind}: {what} is {len} bytes long, more than the maximum of {max}")]
    TooLong {
        /// The message being decoded.
        kind: &'static str,
        /// The field.
        what: &'static str,
        /// Its announced length.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// A field is well-formed but its value is not allowed (or fields disagree).
    #[error("message {kind}: invalid {what}: {reason}")]
    Invalid {
        /// The message being decoded.
        kind: &'static str,
        /// The field or structure.
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// Parses a frame header; returns the message kind and the payload length. Refuses a
/// payload longer than `max_frame` before the caller allocates for it.
pub fn parse_header(bytes: &[u8; HEADER_LEN], max_frame: usize) -> Result<(u16, usize), ProtoError> {
    let [l0, l1, l2, l3, k0, k1, f0, f1] = *bytes;
    let len = u32::from_le_bytes([l0, l1, l2, l3]) as usize;
    let kind = u16::from_le_bytes([k0, k1]);
    let flags = u16::from_le_bytes([f0, f1]);
    if len > max_frame {
        return Err(ProtoError::FrameTooLarge { len, max: max_frame });
    }
    if flags != 0 {
        return Err(ProtoError::BadFlags(flags));
    }
    if kind_name(kind).is_none() {
        return Err(ProtoError::UnknownKind(kind));
    }
    Ok((kind, len))
}

/// The wire byte of a role (shared with the authentication, which signs it).
pub(crate) fn role_byte(role: Role) -> u8 {
    match role {
        Role::Head => 0,
        Role::Worker => 1,
        Role::Ring => 2,
        Role::Heartbeat => 3,
        Role::Member => 4,
        Role::Fetch => 5,
    }
}

/// The role of a wire byte, if any.
fn role_from_byte(byte: u8) -> Option<Role> {
    match byte {
        0 => Some(Role::Head),
        1 => Some(Role::Worker),
        2 => Some(Role::Ring),
        3 => Some(Role::Heartbeat),
        4 => Some(Role::Member),
        5 => Some(Role::Fetch),
        _ => None,
    }
}
