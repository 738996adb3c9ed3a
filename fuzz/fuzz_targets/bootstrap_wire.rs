//! Fuzzes the bootstrap store's wire decoder (`crates/oxccl-bootstrap/src/wire.rs`).
//!
//! The input is read as a stream of frames, the way a connection reads them: decode one, skip the
//! bytes it used, repeat until an error. Every message that decodes must re-encode to the very
//! same bytes and respect the caps (key, value, text and frame lengths, key counts); every error
//! must be consistent with the bytes (an `Incomplete` asks for more than there is, a `TooLarge`
//! names the announced length).
#![no_main]

use libfuzzer_sys::fuzz_target;
use oxccl_bootstrap::wire::{
    DecodeError, MAX_FRAME_LEN, MAX_KEY_LEN, MAX_KEYS, MAX_TEXT_LEN, MAX_VALUE_LEN, Msg, decode,
    encode, frame_len,
};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    loop {
        match decode(rest) {
            Ok((msg, used)) => {
                check_message(rest, &msg, used);
                rest = &rest[used..];
            }
            Err(e) => {
                check_error(rest, &e);
                break;
            }
        }
    }
});

/// A frame the decoder accepted, using `used` bytes of `buf`.
fn check_message(buf: &[u8], msg: &Msg, used: usize) {
    // At least the 4-byte length and the 1-byte tag, within the buffer, as announced.
    assert!(
        (5..=buf.len()).contains(&used),
        "used {used} of {}",
        buf.len()
    );
    assert_eq!(frame_len(buf), Some(used - 4));
    assert!(used - 4 <= MAX_FRAME_LEN);
    // Round trip, both ways.
    let frame = &buf[..used];
    let again = encode(msg).unwrap_or_else(|e| panic!("{msg:?} decoded but does not encode: {e}"));
    assert_eq!(again, frame, "{msg:?} re-encodes differently");
    assert_eq!(decode(frame), Ok((msg.clone(), used)));
    // Any strict prefix is incomplete.
    for cut in [0, 3, 4, used - 1] {
        match decode(&frame[..cut]) {
            Err(DecodeError::Incomplete { needed }) => assert!(needed > cut && needed <= used),
            other => panic!("{msg:?} cut at {cut}: {other:?}"),
        }
    }
    // Caps.
    let key = |k: &String| assert!(k.len() <= MAX_KEY_LEN, "key of {} bytes", k.len());
    let keys = |ks: &Vec<String>| {
        assert!(ks.len() <= MAX_KEYS, "{} keys", ks.len());
        ks.iter().for_each(key);
    };
    let value = |v: &Vec<u8>| assert!(v.len() <= MAX_VALUE_LEN, "value of {} bytes", v.len());
    let text = |t: &String| assert!(t.len() <= MAX_TEXT_LEN, "text of {} bytes", t.len());
    match msg {
        Msg::Hello { .. } | Msg::AuthOk { .. } | Msg::Done | Msg::Int(_) | Msg::Bool(_) => {}
        Msg::Auth { label, .. } | Msg::Name { label } => text(label),
        Msg::AuthFail { reason } => text(reason),
        Msg::Failed { message } => text(message),
        Msg::Set { key: k, value: v } => {
            key(k);
            value(v);
        }
        Msg::Get { keys: ks, .. } | Msg::Wait { keys: ks, .. } => keys(ks),
        Msg::TimedOut { missing } => keys(missing),
        Msg::Add { key: k, .. } | Msg::Delete { key: k } => key(k),
        Msg::CompareSet {
            key: k,
            expected,
            desired,
        } => {
            key(k);
            expected.iter().for_each(value);
            value(desired);
        }
        Msg::Values(vs) => {
            assert!(vs.len() <= MAX_KEYS, "{} values", vs.len());
            vs.iter().for_each(value);
        }
        Msg::Cas { current, .. } => current.iter().for_each(value),
    }
    assert!(!msg.kind().is_empty());
}

/// A decode error on `buf`: it must be consistent with the bytes.
fn check_error(buf: &[u8], e: &DecodeError) {
    assert!(!e.to_string().is_empty());
    match *e {
        DecodeError::Incomplete { needed } => {
            assert!(needed > buf.len(), "needs {needed} but has {}", buf.len());
            assert!(needed <= 4 + MAX_FRAME_LEN);
            if let Some(len) = frame_len(buf) {
                assert_eq!(needed, 4 + len);
            } else {
                assert_eq!(needed, 4);
            }
        }
        DecodeError::TooLarge { len, max } => {
            assert_eq!(max, MAX_FRAME_LEN);
            assert!(len > max);
            assert_eq!(frame_len(buf), Some(len));
        }
        DecodeError::Invalid(_) => {
            // The whole frame was there and within the cap: the body itself is bad.
            let len = frame_len(buf).expect("Invalid without a length");
            assert!(len <= MAX_FRAME_LEN && 4 + len <= buf.len());
        }
    }
}
