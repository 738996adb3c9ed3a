//! Fuzzes the tcp provider's wire decoder (`crates/oxccl-verbs/src/tcp/frame.rs`).
//!
//! The input is read the way a connection's receive side reads its stream: an optional
//! `HELLO_LEN`-byte hello, then 64-byte headers, each followed by its payload. Every header
//! that decodes must re-encode to the very same bytes and satisfy the per-opcode rules (payload caps, fixed lengths,
//! NAK status, flags and the fields of a striped part); every rejection must name what is wrong
//! with the bytes. `decode_hello` is also fed the first `HELLO_LEN` bytes of every input, hello or
//! not.
#![no_main]

use libfuzzer_sys::fuzz_target;
use oxccl_verbs::fuzzing::{
    ACK_REQ, FrameError, HEADER_LEN, HELLO_LEN, Header, MAX_PARTS, MAX_PAYLOAD, Opcode, PART,
    decode_hello, encode_hello,
};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    if let Some(prefix) = rest.first_chunk::<HELLO_LEN>() {
        if let Some(hello) = decode_hello(prefix) {
            assert_eq!(&encode_hello(&hello), prefix);
            assert!(hello.index < hello.count && hello.count as u64 <= MAX_PARTS);
            rest = &rest[HELLO_LEN..];
        } else if &prefix[..8] == b"OXTHELO3" {
            // Refused only for a connection index or count out of range, or a malformed
            // seal field: flags other than 0 (plain) or 1 (sealed), a non-zero reserved word,
            // or a plain hello with a nonce.
            let u32_at = |o: usize| u32::from_le_bytes(prefix[o..o + 4].try_into().unwrap());
            let (index, count, flags, reserved) = (u32_at(32), u32_at(36), u32_at(40), u32_at(44));
            let nonce_set = prefix[48..80].iter().any(|&b| b != 0);
            assert!(
                count == 0
                    || count as u64 > MAX_PARTS
                    || index >= count
                    || flags > 1
                    || reserved != 0
                    || (flags == 0 && nonce_set),
                "a hello with its magic and valid fields was refused"
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
    // Reserved bytes are zero; flags are known and fit the opcode.
    assert_eq!(&bytes[6..8], &[0; 2]);
    assert_eq!(hdr.flags, bytes[5]);
    assert_eq!(hdr.flags & !(ACK_REQ | PART), 0, "{hdr:?}: unknown flags");
    if hdr.flags & ACK_REQ != 0 {
        assert!(hdr.opcode.is_request(), "{hdr:?}: ACK_REQ on an answer");
    }
    if hdr.flags & PART != 0 {
        assert!(
            matches!(
                hdr.opcode,
                Opcode::Write | Opcode::WriteImm | Opcode::ReadResp
            ),
            "{hdr:?}"
        );
        let p = hdr.part().expect("a PART header has a part");
        assert!(p.index < p.count && (2..=MAX_PARTS as u32).contains(&p.count));
        assert!(hdr.addr >= p.base && hdr.addr + hdr.len as u64 <= p.base + p.total as u64);
    }
    assert_eq!(hdr.ack.to_le_bytes(), bytes[56..64]);
    // Lengths and payloads.
    assert!(hdr.len <= MAX_PAYLOAD, "{hdr:?}: length over the cap");
    assert!(hdr.payload_len() <= MAX_PAYLOAD as usize);
    match hdr.opcode {
        Opcode::Cas | Opcode::Faa => assert_eq!(hdr.len, 8, "{hdr:?}"),
        Opcode::Ack | Opcode::Nak | Opcode::AtomicResp | Opcode::AckReq => {
            assert_eq!(hdr.len, 0, "{hdr:?}")
        }
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
    let magic_ok = &bytes[..4] == b"OXT2";
    match e {
        FrameError::BadMagic => assert!(!magic_ok),
        FrameError::BadOpcode(op) => {
            assert!(magic_ok);
            assert_eq!(op, bytes[4]);
        }
        FrameError::Reserved => {
            assert!(magic_ok);
            assert!(bytes[6..8].iter().any(|&b| b != 0));
        }
        FrameError::BadFlags(flags) => {
            assert!(magic_ok);
            assert_eq!(flags, bytes[5]);
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
