//! The frame decoder, fed what a peer could send: an 8-byte header, then a payload of the
//! kind the header names.
//!
//! The payload is the rest of the input whatever the header's length field says: the
//! length is only compared with the limit (a transport then reads exactly that many
//! bytes), so mutations need not keep it consistent to reach every decoder.
//!
//! Checked: nothing panics; no allocation is out of proportion to the input; a header
//! that parses is the one `header` writes; a payload that decodes is the one
//! `encode_payload` writes for the message (each message has exactly one encoding); a
//! decoded f16 batch widens (what a stage does next) without panicking.
#![no_main]

use baton_fuzz::{check_allocations, LargestAlloc};
use baton_proto::{decode, encode_payload, header, parse_header, Message, ProtoError, DEFAULT_MAX_FRAME, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: LargestAlloc = LargestAlloc;

fuzz_target!(|data: &[u8]| {
    let Some((head, payload)) = data.split_first_chunk::<HEADER_LEN>() else {
        return;
    };
    // A transport with a small limit must refuse what a default one accepts.
    if let Err(ProtoError::FrameTooLarge { len, max }) = parse_header(head, payload.len()) {
        assert!(len > max && max == payload.len());
    }
    let Ok((kind, len)) = parse_header(head, DEFAULT_MAX_FRAME) else {
        return;
    };
    assert_eq!(&header(kind, len), head, "a header that parses is the canonical one");

    let Ok(message) = check_allocations(data.len(), || decode(kind, payload)) else {
        return;
    };
    let mut again = Vec::with_capacity(payload.len());
    assert_eq!(encode_payload(&message, &mut again), kind, "{message:?}");
    assert_eq!(
        again, payload,
        "decode then encode must give back the same bytes: {message:?}"
    );
    if let Message::Forward(forward) = &message {
        let _ = forward.payload.widen_f16();
    }
});
