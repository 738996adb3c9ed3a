//! The lanes' encryption policy (`OXCCL_ENCRYPT`, [`EngineConfig::encrypt`]): both ends must
//! agree, and a disagreement is refused at the handshake saying which side wants what; `auto`
//! leaves on-host lanes in clear; shm is never encrypted. (The bytes on encrypted lanes are
//! checked through a man in the middle in `tests/mitm.rs`; `auto` across two hosts in
//! `tests/netns.rs`.)

use std::sync::Arc;
use std::time::Duration;

use oxccl_bootstrap::{MemoryStore, Secret};
use oxccl_kv::meta::StoreMetadata;
use oxccl_kv::*;

fn secret() -> Secret {
    Secret::new("kv-encrypt-test-secret-0123").unwrap()
}

fn config(name: &str, protocol: Protocol, encrypt: Encrypt) -> EngineConfig {
    let mut c = EngineConfig::new(secret());
    c.protocol = protocol;
    c.name = Some(name.into());
    c.encrypt = encrypt;
    c.timeout = Duration::from_secs(5);
    c
}

const LEN: usize = 256 << 10;

/// Opens "target" from "client" with the two policies; on success writes a pattern and checks
/// it arrived. Returns whether the lanes are encrypted, or the error.
fn open(protocol: Protocol, target: Encrypt, client: Encrypt) -> Result<bool> {
    let meta: Arc<dyn Metadata> = Arc::new(StoreMetadata::new(Arc::new(MemoryStore::new())));
    let t = TransferEngine::new(config("target", protocol, target), meta.clone()).unwrap();
    let tbuf = t.allocate_managed_buffer(LEN).unwrap();
    let c = TransferEngine::new(config("client", protocol, client), meta).unwrap();
    let src = c.allocate_managed_buffer(LEN).unwrap();
    let data: Vec<u8> = (0..LEN).map(|i| (i * 7 + 3) as u8).collect();
    c.write_local(src, &data).unwrap();
    let seg = c.open_segment("target")?;
    let w = TransferRequest {
        opcode: Opcode::Write,
        source: src,
        target_id: seg,
        target_offset: tbuf,
        length: LEN,
    };
    c.transfer_sync(&[w], Some(b"sealed?")).unwrap();
    let mut got = vec![0; LEN];
    t.read_local(tbuf, &mut got).unwrap();
    assert!(got == data, "the target holds other bytes");
    let n = t.wait_notifies(Duration::from_secs(5));
    assert_eq!(n[0].msg, b"sealed?");
    c.lanes_encrypted(seg)
}

#[test]
fn both_ends_on_encrypt_and_both_off_do_not() {
    assert!(open(Protocol::Tcp, Encrypt::On, Encrypt::On).unwrap());
    assert!(!open(Protocol::Tcp, Encrypt::Off, Encrypt::Off).unwrap());
}

#[test]
fn auto_leaves_on_host_lanes_in_clear_and_agrees_with_off() {
    assert!(!open(Protocol::Tcp, Encrypt::Auto, Encrypt::Auto).unwrap());
    assert!(!open(Protocol::Tcp, Encrypt::Auto, Encrypt::Off).unwrap());
}

#[test]
fn shm_is_never_encrypted() {
    assert!(!open(Protocol::Shm, Encrypt::On, Encrypt::On).unwrap());
    assert!(!open(Protocol::Shm, Encrypt::On, Encrypt::Off).unwrap());
}

#[test]
fn a_disagreement_is_refused_saying_who_wants_what() {
    let err = open(Protocol::Tcp, Encrypt::Off, Encrypt::On)
        .unwrap_err()
        .to_string();
    for want in [
        "engine \"target\" wants the lanes from 127.0.0.1 (\"client\") in clear",
        "OXCCL_ENCRYPT=off here",
        "the peer asked for them encrypted",
    ] {
        assert!(err.contains(want), "{want:?} not in: {err}");
    }
    let err = open(Protocol::Tcp, Encrypt::On, Encrypt::Auto)
        .unwrap_err()
        .to_string();
    for want in [
        "wants the lanes from 127.0.0.1 (\"client\") encrypted",
        "OXCCL_ENCRYPT=on here",
        "the peer asked for them in clear",
    ] {
        assert!(err.contains(want), "{want:?} not in: {err}");
    }
}

#[test]
fn oxccl_encrypt_is_read_and_a_bad_value_named() {
    let vars = |v: &'static str| {
        move |k: &str| match k {
            "OXCCL_SECRET" => Some("kv-encrypt-test-secret-0123".to_string()),
            "OXCCL_ENCRYPT" => Some(v.to_string()),
            _ => None,
        }
    };
    for (v, want) in [
        ("on", Encrypt::On),
        ("off", Encrypt::Off),
        ("auto", Encrypt::Auto),
    ] {
        assert_eq!(EngineConfig::from_vars(&vars(v)).unwrap().encrypt, want);
    }
    let err = EngineConfig::from_vars(&vars("sometimes"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("OXCCL_ENCRYPT") && err.contains("sometimes"),
        "{err}"
    );
    assert_eq!(EngineConfig::new(secret()).encrypt, Encrypt::Auto);
}
