//! Fuzzes oxccl-seal's records (`crates/oxccl-seal`): a genuine sealed stream, changed on the
//! way the way a man in the middle could change it, must give its reader a prefix of what was
//! sent and then an error (or, cut at a record boundary, a clean end), never bytes that were
//! not sent, never a panic.
//!
//! The input: message lengths (u16 LE each, up to 16 messages; a message over 64 KiB spans
//! several records) after a first byte that picks the change: 0 none, 1 flip a bit, 2 drop a
//! record, 3 replay one, 4 swap two, 5 cut the stream, 6 overwrite a byte with the next input
//! byte; the position (u32 LE) follows the first byte. Raw bytes fed to `check_header` and
//! `open_record` (the input itself as a record) must be refused without a panic.
#![no_main]

use std::io::{Read, Write};

use libfuzzer_sys::fuzz_target;
use oxccl_seal::{HEADER_LEN, JobKey, Role, SealedReader, SealedWriter};

fuzz_target!(|data: &[u8]| {
    let Some((&change, rest)) = data.split_first() else {
        return;
    };
    let Some((pos, rest)) = rest.split_first_chunk::<4>() else {
        return;
    };
    let pos = u32::from_le_bytes(*pos) as usize;
    let job = JobKey::derive(b"fuzz", "fuzz v1");
    let (ni, na) = ([1u8; 32], [2u8; 32]);
    let tx = job.session(Role::Initiator, &ni, &na, b"t").tx;
    let mut rx_session = job.session(Role::Acceptor, &ni, &na, b"t");

    // Raw input as a record: refused (a forgery), never a panic.
    if let Some(h) = data.first_chunk::<HEADER_LEN>() {
        let mut body = data[HEADER_LEN..].to_vec();
        assert!(rx_session.rx.open_record(h, &mut body).is_err());
    }

    // The genuine stream.
    let mut sent = Vec::new();
    let mut w = SealedWriter::new(Vec::new(), tx);
    let mut boundaries = vec![0usize];
    for (i, len) in rest.chunks_exact(2).take(16).enumerate() {
        let len = u16::from_le_bytes([len[0], len[1]]) as usize * 2;
        let msg: Vec<u8> = (0..len).map(|j| (i * 31 + j * 7) as u8).collect();
        w.write_all(&msg).unwrap();
        w.flush().unwrap();
        sent.extend_from_slice(&msg);
    }
    let original = w.get_ref().clone();
    let mut wire = original.clone();
    // Record boundaries, from the headers.
    let mut at = 0;
    while at < wire.len() {
        let body = u32::from_le_bytes(wire[at..at + 4].try_into().unwrap()) as usize;
        at += HEADER_LEN + body;
        boundaries.push(at);
    }
    assert_eq!(at, wire.len());
    let records = boundaries.len() - 1;
    let record = |k: usize| boundaries[k]..boundaries[k + 1];
    let changed = match change % 7 {
        1 if !wire.is_empty() => {
            let p = pos % wire.len();
            wire[p] ^= 1 << (pos % 8);
            true
        }
        2 if records > 0 => {
            wire.drain(record(pos % records));
            true
        }
        3 if records > 0 => {
            let r = record(pos % records);
            let copy = wire[r.clone()].to_vec();
            wire.splice(r.end..r.end, copy);
            true
        }
        4 if records > 1 => {
            let k = pos % (records - 1);
            let (a, b) = (record(k), record(k + 1));
            let swapped = [&wire[b.clone()], &wire[a.clone()]].concat();
            wire.splice(a.start..b.end, swapped);
            true
        }
        5 if !wire.is_empty() => {
            wire.truncate(pos % wire.len());
            true
        }
        6 if !wire.is_empty() => {
            let p = pos % wire.len();
            let v = rest.first().copied().unwrap_or(0);
            let old = wire[p];
            wire[p] = v;
            old != v
        }
        _ => false,
    };

    let mut r = SealedReader::new(&wire[..], rx_session.rx, "fuzz");
    let mut got = Vec::new();
    let result = r.read_to_end(&mut got);
    assert!(got.len() <= sent.len() && got == sent[..got.len()], "bytes that were not sent");
    if !changed {
        assert_eq!(got, sent);
        assert!(result.is_ok());
    } else if result.is_ok() {
        // Only a stream cut at a record boundary (a cut, or the last record dropped) ends
        // cleanly: records carry no end of stream, the protocols above them do. The reader then
        // has exactly the records before the cut.
        assert!(
            boundaries.contains(&wire.len()) && wire[..] == original[..wire.len()],
            "a changed stream read without an error"
        );
    }
});
