//! The cipher's speed on one core: sealing and opening records of [`MAX_RECORD`] bytes, from a
//! buffer that stays in cache and from one that does not (64 MiB), and the link rate one core
//! keeps up with.
//!
//! ```sh
//! cargo run --release -p oxccl-seal --example cipher_speed [SECONDS_PER_ROW]
//! ```

use std::time::{Duration, Instant};

use oxccl_seal::{HEADER_LEN, JobKey, MAX_RECORD, Role, SealError, TAG_LEN, fresh_nonce};

fn main() -> Result<(), SealError> {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    let job = JobKey::derive(b"speed", "cipher speed v1");
    let (ni, na) = (fresh_nonce()?, fresh_nonce()?);
    println!(
        "# one core; records of {MAX_RECORD} bytes; GB/s of plaintext; Gbit/s = link rate kept up with"
    );
    println!("{:<30} {:>10} {:>10}", "what", "GB/s", "Gbit/s");
    for (label, total) in [
        ("in cache (256 KiB)", 256 << 10),
        ("from memory (64 MiB)", 64 << 20),
    ] {
        let records = total / MAX_RECORD;
        let mut buf = vec![0u8; records * (HEADER_LEN + MAX_RECORD + TAG_LEN)];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = i as u8;
        }
        let mut tx = job.session(Role::Initiator, &ni, &na, b"").tx;
        let rec = HEADER_LEN + MAX_RECORD + TAG_LEN;
        let deadline = Duration::from_secs_f64(secs);
        // Seal.
        let (mut bytes, t) = (0usize, Instant::now());
        let mut passes = 0;
        while t.elapsed() < deadline || passes == 0 {
            for r in buf.chunks_exact_mut(rec) {
                tx.seal_record(r)?;
            }
            bytes += records * MAX_RECORD;
            passes += 1;
        }
        let seal = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
        // Open: each pass a fresh connection (numbering from 0), sealed untimed, opened timed.
        let (mut bytes, mut spent) = (0usize, Duration::ZERO);
        while spent < deadline || bytes == 0 {
            let mut s = job.session(Role::Initiator, &ni, &na, b"");
            let mut rx = job.session(Role::Acceptor, &ni, &na, b"").rx;
            for r in buf.chunks_exact_mut(rec) {
                s.tx.seal_record(r)?;
            }
            let t = Instant::now();
            for r in buf.chunks_exact_mut(rec) {
                let (h, body) = r.split_at_mut(HEADER_LEN);
                let h: [u8; HEADER_LEN] = (&*h).try_into().unwrap();
                rx.open_record(&h, body)?;
            }
            spent += t.elapsed();
            bytes += records * MAX_RECORD;
        }
        let open = bytes as f64 / spent.as_secs_f64() / 1e9;
        println!(
            "{:<30} {:>10.2} {:>10.1}",
            format!("seal, {label}"),
            seal,
            seal * 8.0
        );
        println!(
            "{:<30} {:>10.2} {:>10.1}",
            format!("open, {label}"),
            open,
            open * 8.0
        );
    }
    Ok(())
}
