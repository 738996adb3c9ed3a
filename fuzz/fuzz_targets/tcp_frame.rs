//! Fuzzes the tcp provider's wire decoder (`crates/oxccl-verbs/src/tcp/frame.rs`).
//!
//! The input is read the way a connection's receive side reads its stream: an optional 32-byte
//! hello, then 64-byte headers, each followed by its payload. Every header that decodes must
//! re-encode to the very same bytes and satisfy the per-opcode rules (payload caps, fixed lengths,
//! NAK status); every rejection must name what is wrong with the bytes. `decode_hello` is also fed
//! the first 32 bytes of every input, hello or not.
#![no_main]

use libfuzzer_sys::fuzz_target;
use oxccl_verbs::fuzzing::{
    FrameError, HEADER_LEN, HELLO_LEN, Header, MAX_PAYLOAD, Opcode, decode_hello, encode_hello,
};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    if let Some(prefix) = rest.first_chunk::<HELLO_LEN>() {
        if let Some((target, initiator, rnr_us)) = decode_hello(prefix) {
            assert_eq!(&encode_hello(target, initiator, rnr_us), prefix);
            rest = &rest[HELLO_LEN..];
        } else {
            assert_ne!(
                &prefix[..8],
                b"OXTHELO1",
                "a hello with its magic was refused"
            );
        }
    }
    while let Some(bytes) = rest.first_chunk::<HEADER_LEN>() {
        rest = &rest[HEADER_LEN..];
        match Header::decode(bytes) {
            Ok(hdr) => {
                check_header(bytes, &hdr);
                let payload = hdr.payload_len();
                rest = &rest[payload.min(rest.len())..];
            }
            Err(e) => {
                check_rejection(bytes, e);
                break;
            }
        }
    }
});

/// A header the decoder accepted.
fn check_header(bytes: &[u8; HEADER_LEN], hdr: &Header) {
    // Round trip, both ways.
    assert_eq!(&hdr.encode(), bytes, "{hdr:?} re-encodes differently");
    assert_eq!(Header::decode(&hdr.encode()), Ok(*hdr));
    // Reserved bytes are zero.
    assert_eq!(&bytes[5..8], &[0; 3]);
    assert_eq!(&bytes[56..64], &[0; 8]);
    // Lengths and payloads.
    assert!(hdr.len <= MAX_PAYLOAD, "{hdr:?}: length over the cap");
    assert!(hdr.payload_len() <= MAX_PAYLOAD as usize);
    match hdr.opcode {
        Opcode::Cas | Opcode::Faa => assert_eq!(hdr.len, 8, "{hdr:?}"),
        Opcode::Ack | Opcode::Nak | Opcode::AtomicResp => assert_eq!(hdr.len, 0, "{hdr:?}"),
        _ => {}
    }
    if hdr.opcode.has_payload() {
        assert_eq!(hdr.payload_len(), hdr.len as usize);
    } else {
        assert_eq!(hdr.payload_len(), 0);
    }
    if hdr.opcode == Opcode::Nak {
        assert!((1..=8).contains(&hdr.a), "{hdr:?}: NAK status");
    }
    assert_eq!(hdr.opcode.is_request(), bytes[4] < 16);
    assert_eq!(hdr.opcode as u8, bytes[4]);
}

/// A header the decoder refused: the error must match the bytes.
fn check_rejection(bytes: &[u8; HEADER_LEN], e: FrameError) {
    assert!(!e.to_string().is_empty());
    let magic_ok = &bytes[..4] == b"OXT1";
    match e {
        FrameError::BadMagic => assert!(!magic_ok),
        FrameError::BadOpcode(op) => {
            assert!(magic_ok);
            assert_eq!(op, bytes[4]);
        }
        FrameError::Reserved => {
            assert!(magic_ok);
            assert!(bytes[5..8].iter().chain(&bytes[56..64]).any(|&b| b != 0));
        }
        FrameError::BadLength(op, len) => {
            assert!(magic_ok);
            assert_eq!(op as u8, bytes[4]);
            assert_eq!(len.to_le_bytes(), bytes[16..20]);
        }
        FrameError::BadStatus(status) => {
            assert!(magic_ok);
            assert_eq!(bytes[4], Opcode::Nak as u8);
            assert_eq!(status.to_le_bytes(), bytes[40..48]);
            assert!(!(1..=8).contains(&status));
        }
    }
}
