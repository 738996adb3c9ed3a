use std::io::{Read, Write};

use super::*;

fn pair(secret_b: &[u8]) -> (Session, Session) {
    let (ni, na) = (fresh_nonce().unwrap(), fresh_nonce().unwrap());
    let a = JobKey::derive(b"secret", "test v1").session(Role::Initiator, &ni, &na, b"t");
    let b = JobKey::derive(secret_b, "test v1").session(Role::Acceptor, &ni, &na, b"t");
    (a, b)
}

fn header(r: &[u8]) -> [u8; HEADER_LEN] {
    r[..HEADER_LEN].try_into().unwrap()
}

#[test]
fn records_round_trip_and_hide_the_plaintext() {
    let (mut a, mut b) = pair(b"secret");
    let text: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut wire = Vec::new();
    a.tx.seal(&text, &mut wire).unwrap();
    // Four records: 3 × 64 KiB and the rest.
    assert_eq!(wire.len(), text.len() + 4 * (HEADER_LEN + TAG_LEN));
    assert!(
        !wire
            .windows(32)
            .any(|w| text.windows(32).take(1000).any(|t| t == w))
    );
    let mut got = Vec::new();
    let mut at = 0;
    while at < wire.len() {
        let h = header(&wire[at..]);
        let len = b.rx.check_header(&h).unwrap();
        let body = &mut wire[at + HEADER_LEN..at + HEADER_LEN + len];
        got.extend_from_slice(b.rx.open_record(&h, body).unwrap());
        at += HEADER_LEN + len;
    }
    assert_eq!(got, text);
    assert_eq!((a.tx.records_sealed(), b.rx.records_opened()), (4, 4));
}

#[test]
fn each_direction_and_each_connection_has_its_own_key() {
    let (mut a, mut b) = pair(b"secret");
    let mut from_a = Vec::new();
    a.tx.seal(b"same", &mut from_a).unwrap();
    let mut from_b = Vec::new();
    b.tx.seal(b"same", &mut from_b).unwrap();
    assert_ne!(from_a, from_b);
    // Another connection (other nonces) of the same job: another ciphertext.
    let (mut c, _) = pair(b"secret");
    let mut from_c = Vec::new();
    c.tx.seal(b"same", &mut from_c).unwrap();
    assert_ne!(from_a, from_c);
    // Opening A's record as if it came from B fails.
    let h = header(&from_a);
    let mut body = from_a[HEADER_LEN..].to_vec();
    assert_eq!(
        a.rx.open_record(&h, &mut body),
        Err(SealError::Tampered { seq: 0 })
    );
}

#[test]
fn a_stranger_a_flipped_bit_a_replay_a_drop_and_a_bad_length_are_refused() {
    let (ni, na) = (fresh_nonce().unwrap(), fresh_nonce().unwrap());
    let job = JobKey::derive(b"secret", "test v1");
    let mut a = job.session(Role::Initiator, &ni, &na, b"t");
    let receiver =
        |secret: &[u8]| JobKey::derive(secret, "test v1").session(Role::Acceptor, &ni, &na, b"t");
    let mut wire = Vec::new();
    a.tx.seal(b"first", &mut wire).unwrap();
    let first = wire.clone();
    a.tx.seal(b"second", &mut wire).unwrap();
    let second = wire[first.len()..].to_vec();
    // The untouched record opens (so the failures below are the tampering's).
    let mut r = first.clone();
    assert_eq!(
        receiver(b"secret")
            .rx
            .open_record(&header(&first), &mut r[HEADER_LEN..])
            .unwrap(),
        b"first"
    );

    // A stranger (another secret) opens nothing.
    let mut s = receiver(b"another secret");
    let mut body = first[HEADER_LEN..].to_vec();
    assert_eq!(
        s.rx.open_record(&header(&first), &mut body),
        Err(SealError::Tampered { seq: 0 })
    );

    // Every bit of a record matters: header (length, number), ciphertext, tag.
    for bit in 0..first.len() * 8 {
        let mut b = receiver(b"secret");
        let mut r = first.clone();
        r[bit / 8] ^= 1 << (bit % 8);
        let h = header(&r);
        let e = b.rx.check_header(&h).and_then(|len| {
            if len != r.len() - HEADER_LEN {
                return Err(SealError::TooLong { len, max: 0 });
            }
            b.rx.open_record(&h, &mut r[HEADER_LEN..]).map(|_| ())
        });
        assert!(e.is_err(), "flipping bit {bit} went unnoticed");
        assert_eq!(b.rx.records_opened(), 0);
    }

    // Replay: the first record again after it was opened.
    let mut b = receiver(b"secret");
    let mut r = first.clone();
    b.rx.open_record(&header(&first), &mut r[HEADER_LEN..])
        .unwrap();
    assert_eq!(
        b.rx.check_header(&header(&first)),
        Err(SealError::OutOfOrder {
            expected: 1,
            got: 0
        })
    );
    // Drop: the second record first.
    let b = receiver(b"secret");
    assert_eq!(
        b.rx.check_header(&header(&second)),
        Err(SealError::OutOfOrder {
            expected: 0,
            got: 1
        })
    );
    // A forged length, too long or too short.
    for len in [
        0u32,
        TAG_LEN as u32 - 1,
        (MAX_RECORD + TAG_LEN + 1) as u32,
        u32::MAX,
    ] {
        let mut h = header(&first);
        h[..4].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(
            b.rx.check_header(&h),
            Err(SealError::TooLong { .. })
        ));
    }
    for e in [
        SealError::Tampered { seq: 3 },
        SealError::OutOfOrder {
            expected: 4,
            got: 2,
        },
        SealError::OutOfOrder {
            expected: 4,
            got: 7,
        },
    ] {
        let text = e.to_string();
        assert!(text.contains("record"), "{text}");
    }
}

#[test]
fn a_transcript_changed_on_the_path_leaves_different_keys() {
    let (ni, na) = (fresh_nonce().unwrap(), fresh_nonce().unwrap());
    let job = JobKey::derive(b"secret", "test v1");
    let mut a = job.session(Role::Initiator, &ni, &na, b"hello: token 7");
    let mut b = job.session(Role::Acceptor, &ni, &na, b"hello: token 8");
    let mut wire = Vec::new();
    a.tx.seal(b"x", &mut wire).unwrap();
    let h = header(&wire);
    assert!(b.rx.open_record(&h, &mut wire[HEADER_LEN..]).is_err());
    // Purposes separate keys too.
    assert_ne!(
        JobKey::derive(b"secret", "a"),
        JobKey::derive(b"secret", "b")
    );
    assert_eq!(format!("{:?}", job), "JobKey(..)");
}

#[test]
fn values_open_only_under_their_name_and_key() {
    let job = JobKey::derive(b"secret", "store v1");
    let v = job
        .seal_value(b"rank0/endpoint", b"10.0.0.1:4000 rkey=77")
        .unwrap();
    assert!(!v.windows(4).any(|w| w == b"rkey"));
    assert_eq!(
        job.open_value(b"rank0/endpoint", &v).unwrap(),
        b"10.0.0.1:4000 rkey=77"
    );
    assert!(job.open_value(b"rank1/endpoint", &v).is_err());
    assert!(
        JobKey::derive(b"other", "store v1")
            .open_value(b"rank0/endpoint", &v)
            .is_err()
    );
    let mut bad = v.clone();
    *bad.last_mut().unwrap() ^= 1;
    assert!(job.open_value(b"rank0/endpoint", &bad).is_err());
    assert!(job.open_value(b"k", b"plain value").is_err());
    assert!(job.open_value(b"k", b"").is_err());
    // Two seals of one value differ (random nonces).
    assert_ne!(
        v,
        job.seal_value(b"rank0/endpoint", b"10.0.0.1:4000 rkey=77")
            .unwrap()
    );
}

#[test]
fn a_stream_carries_large_and_small_writes_and_resumes_after_a_timeout() {
    use std::os::unix::net::UnixStream;
    let (x, y) = UnixStream::pair().unwrap();
    let (a, b) = pair(b"secret");
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let d2 = data.clone();
    let t = std::thread::spawn(move || {
        let mut w = SealedStream::new(x, a, "b");
        w.write_all(&d2[..5]).unwrap();
        w.flush().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(150));
        w.write_all(&d2[5..]).unwrap();
        w.flush().unwrap();
    });
    y.set_read_timeout(Some(std::time::Duration::from_millis(20)))
        .unwrap();
    let mut r = SealedStream::new(y, b, "a");
    let mut got = vec![0u8; data.len()];
    let mut at = 0;
    let mut timeouts = 0;
    while at < got.len() {
        match r.read(&mut got[at..]) {
            Ok(0) => panic!("closed early"),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => timeouts += 1,
            Err(e) => panic!("{e}"),
        }
    }
    t.join().unwrap();
    assert_eq!(got, data);
    assert!(
        timeouts > 0,
        "the reader never waited: the test did not test resuming"
    );
    assert_eq!(r.read(&mut [0u8; 1]).unwrap(), 0);
}

#[test]
fn a_stream_names_the_peer_and_stays_failed() {
    use std::os::unix::net::UnixStream;
    let (mut x, y) = UnixStream::pair().unwrap();
    let (mut a, b) = pair(b"secret");
    let mut wire = Vec::new();
    a.tx.seal(b"hello", &mut wire).unwrap();
    wire[HEADER_LEN + 1] ^= 4;
    x.write_all(&wire).unwrap();
    let mut r = SealedStream::new(y, b, "rank 3 at 10.0.0.3:29500");
    let e = r.read(&mut [0u8; 5]).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    let text = e.to_string();
    assert!(
        text.contains("rank 3 at 10.0.0.3:29500") && text.contains("record 0"),
        "{text}"
    );
    assert_eq!(r.read(&mut [0u8; 5]).unwrap_err().to_string(), text);
}

/// Through the man in the middle: every tamper of a sealed stream is caught, by kind, and
/// nothing of the tampered record (or after it) is read.
#[cfg(feature = "mitm")]
#[test]
fn the_man_in_the_middle_is_caught_by_kind() {
    use crate::mitm::{Plan, Proxy, Tamper, Toward};
    use std::net::{TcpListener, TcpStream};
    let cases = [
        (Tamper::None, None, &b"ABCD"[..]),
        (
            Tamper::FlipBit { record: 1 },
            Some("record 1 failed authentication"),
            b"A",
        ),
        // A replay comes after the record itself, which was read.
        (
            Tamper::Replay { record: 1 },
            Some("record 1 arrived where record 2 was due"),
            b"AB",
        ),
        (
            Tamper::Drop { record: 1 },
            Some("record 2 arrived where record 1 was due"),
            b"A",
        ),
        (
            Tamper::Swap { record: 1 },
            Some("record 2 arrived where record 1 was due"),
            b"A",
        ),
    ];
    for (tamper, want, read) in cases {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let proxy = Proxy::start(
            server.local_addr().unwrap(),
            Plan::new(tamper, Toward::Target),
        )
        .unwrap();
        let (a, b) = pair(b"secret");
        let mut c = SealedStream::new(TcpStream::connect(proxy.addr()).unwrap(), a, "server");
        let (s, _) = server.accept().unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut s = SealedStream::new(s, b, "client at 127.0.0.1");
        for i in 0..4u8 {
            c.write_all(&[b'A' + i; 100]).unwrap();
            c.flush().unwrap();
        }
        let mut got = Vec::new();
        let mut buf = [0u8; 100];
        let err = loop {
            match s.read_exact(&mut buf) {
                Ok(()) => got.push(buf[0]),
                Err(e) => break e,
            }
            if got.len() == 4 {
                break std::io::ErrorKind::Other.into();
            }
        };
        assert_eq!(got, read, "{tamper:?}");
        match want {
            None => {}
            Some(text) => {
                assert!(proxy.tampered(), "{tamper:?} never happened");
                assert!(err.to_string().contains(text), "{tamper:?}: {err}");
                assert!(err.to_string().contains("client at 127.0.0.1"), "{err}");
            }
        }
        let wire = proxy.captured();
        assert!(
            !wire
                .windows(8)
                .any(|w| w.iter().all(|&x| (b'A'..=b'D').contains(&x)))
        );
    }
}

#[test]
fn a_buffer_that_is_not_a_record_is_refused_without_using_a_number() {
    let (mut a, mut b) = pair(b"secret");
    // Shorter than a header, shorter than a header and a tag, and a body past MAX_RECORD.
    for len in [
        0,
        HEADER_LEN - 1,
        HEADER_LEN + TAG_LEN - 1,
        HEADER_LEN + MAX_RECORD + TAG_LEN + 1,
    ] {
        let mut buf = vec![7u8; len];
        let e = a.tx.seal_record(&mut buf).unwrap_err();
        assert_eq!(e, SealError::RecordSize { len });
        assert!(
            e.to_string().contains(&format!("a {len}-byte buffer")),
            "{e}"
        );
        assert!(
            buf.iter().all(|&x| x == 7),
            "a refused buffer is left as it was"
        );
    }
    assert_eq!(a.tx.records_sealed(), 0);
    // The smallest and the largest record seal, numbered from 0, and open.
    for n in [0, MAX_RECORD] {
        let mut record = vec![0u8; HEADER_LEN + n + TAG_LEN];
        record[HEADER_LEN..HEADER_LEN + n].fill(0x5a);
        a.tx.seal_record(&mut record).unwrap();
        let (h, body) = record.split_at_mut(HEADER_LEN);
        let text = b.rx.open_record(&header(h), body).unwrap();
        assert!(text.len() == n && text.iter().all(|&x| x == 0x5a));
    }
    assert_eq!((a.tx.records_sealed(), b.rx.records_opened()), (2, 2));
}

#[test]
fn a_direction_out_of_record_numbers_refuses_to_seal_rather_than_reuse_one() {
    let (mut a, mut b) = pair(b"secret");
    a.tx.seq = u64::MAX - 1;
    b.rx.seq = u64::MAX - 1;
    let mut wire = Vec::new();
    a.tx.seal(b"last", &mut wire).unwrap();
    let (h, body) = wire.split_at_mut(HEADER_LEN);
    assert_eq!(b.rx.open_record(&header(h), body).unwrap(), b"last");
    // Number u64::MAX is never used: the sealer refuses, leaving `out` as it was.
    let before = wire.clone();
    let e = a.tx.seal(b"one more", &mut wire).unwrap_err();
    assert_eq!(e, SealError::Exhausted);
    assert!(e.to_string().contains("used up"), "{e}");
    assert_eq!(wire, before);
    assert_eq!(a.tx.records_sealed(), u64::MAX);
    // A blocking stream reports it as an error of the write or flush, not a panic.
    let (x, _y) = std::os::unix::net::UnixStream::pair().unwrap();
    let mut session = pair(b"secret").0;
    session.tx.seq = u64::MAX;
    let mut s = SealedStream::new(x, session, "peer");
    s.write_all(b"data").unwrap();
    let e = s.flush().unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    assert!(e.to_string().contains("used up"), "{e}");
}

#[test]
fn truncated_and_foreign_values_say_what_is_wrong() {
    let job = JobKey::derive(b"secret", "store v1");
    let v = job.seal_value(b"k", b"value").unwrap();
    // Every prefix of a sealed value too short to hold version, nonce and tag.
    for len in 0..1 + 12 + TAG_LEN {
        let e = job.open_value(b"k", &v[..len.min(v.len())]).unwrap_err();
        assert_eq!(e, SealError::Value("shorter than a sealed value"), "{len}");
        assert!(e.to_string().contains("shorter than a sealed value"), "{e}");
    }
    // Cut after the tag's start: the tag does not check.
    let e = job.open_value(b"k", &v[..v.len() - 1]).unwrap_err();
    assert!(e.to_string().contains("tag did not check"), "{e}");
    // Another version byte.
    let mut other = v.clone();
    other[0] ^= 0xff;
    let e = job.open_value(b"k", &other).unwrap_err();
    assert!(e.to_string().contains("not a sealed value"), "{e}");
    // An empty value seals and opens.
    let empty = job.seal_value(b"k", b"").unwrap();
    assert_eq!(empty.len(), 1 + 12 + TAG_LEN);
    assert_eq!(job.open_value(b"k", &empty).unwrap(), b"");
}

#[test]
fn a_failing_random_source_is_named_in_the_error() {
    // getrandom cannot be made to fail here; the error the two draws return reads so.
    let e = SealError::Random {
        what: "a handshake nonce",
        source: getrandom::Error::UNSUPPORTED,
    };
    let text = e.to_string();
    assert!(
        text.contains("random source failed drawing a handshake nonce"),
        "{text}"
    );
    assert!(std::error::Error::source(&e).is_some());
    let io: std::io::Error = e.into();
    assert_eq!(io.kind(), std::io::ErrorKind::InvalidData);
}
