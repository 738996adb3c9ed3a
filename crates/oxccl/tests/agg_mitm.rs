//! The aggregation service's control connection through a man in the middle
//! (`oxccl_seal::Proxy`, between rank 0 and the service; the other ranks reach the service
//! directly). After the join, the connection carries sealed records: each end's side (queue
//! pair endpoint, region and rkey) and rank 0's calls. The untampered job works through the
//! proxy, exact, and the proxy saw none of the endpoints, rkeys or calls; a call record
//! flipped or replayed fails the job with the service naming rank 0 and the record, and no
//! tampered call is run; the service's side flipped on its way fails rank 0's init naming
//! the service.

use std::sync::Mutex;
use std::time::Duration;

use oxccl::agg::{Service, ServiceOptions};
use oxccl::schedule::Algorithm;
use oxccl::{Communicator, Options, Provider, ReduceOp};
use oxccl_bootstrap::Secret;
use oxccl_seal::mitm::{Plan, Proxy, Tamper, Toward, holds};

mod common;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Elements of each call: 20 slices of 8 KiB.
const COUNT: usize = 20 * 2048;

fn service() -> Service {
    let secret = Secret::new(common::IN_PROCESS_SECRET).expect("a secret");
    let mut opts = ServiceOptions::new("127.0.0.1:0".parse().unwrap(), vec![secret]);
    opts.pool_bytes = 1 << 20;
    opts.max_jobs = 1;
    Service::start(opts).expect("the service starts")
}

/// The control connection's cleartext: toward the service, the member's join; toward the
/// member, the service's hello and accept. Each frame is a 4-byte length and its body.
fn control_handshake(dir: Toward, seen: &[u8]) -> Option<usize> {
    let frames = match dir {
        Toward::Target => 1,
        Toward::Client => 2,
    };
    let mut at = 0;
    for _ in 0..frames {
        let len: [u8; 4] = seen.get(at..at + 4)?.try_into().ok()?;
        at += 4 + u32::from_le_bytes(len) as usize;
    }
    (seen.len() >= at).then_some(at)
}

fn proxy(svc: &Service, tamper: Tamper, toward: Toward) -> Proxy {
    Proxy::start(
        svc.addr(),
        Plan {
            tamper,
            toward,
            connection: 0,
            handshake: control_handshake,
        },
    )
    .expect("the proxy starts")
}

/// A job of `n` tcp ranks, rank 0 reaching the service through `via`.
fn job(n: usize, svc: &Service, via: &Proxy) -> Vec<Communicator> {
    let direct = svc.addr().to_string();
    let through = via.addr().to_string();
    let comms = common::in_process(n, "agg through a proxy", |rank| Options {
        timeout: Duration::from_secs(20),
        provider: Some(Provider::Tcp),
        host_id: Some(format!("mitm-host-{rank}")),
        algo: Some(Algorithm::Aggregation),
        chunk_size: Some(8 << 10),
        agg_addr: Some(if rank == 0 {
            through.clone()
        } else {
            direct.clone()
        }),
        ..Options::default()
    });
    for c in &comms {
        c.set_timeout(Duration::from_secs(10));
    }
    comms
}

/// Every rank's all-reduce of `rank + 1` (sum: `n(n+1)/2` everywhere).
fn all_reduce(comms: &[Communicator]) -> Vec<oxccl::Result<Vec<f32>>> {
    common::per_rank(comms, |r, c| {
        let mut buf = vec![r as f32 + 1.0; COUNT];
        c.all_reduce_in_place(&mut buf, ReduceOp::Sum).map(|()| buf)
    })
}

/// The service's failures, once one names `what` (up to 10 s).
fn failure_naming(svc: &Service, what: &str) -> String {
    let t = std::time::Instant::now();
    loop {
        if let Some(f) = svc.failures().into_iter().find(|f| f.contains(what)) {
            return f;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no failure names {what:?}: {:?}",
            svc.failures()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn the_untampered_job_works_and_the_proxy_sees_no_endpoint_or_call() {
    let _g = serial();
    let svc = service();
    let p = proxy(&svc, Tamper::None, Toward::Target);
    let comms = job(3, &svc, &p);
    for _ in 0..3 {
        for got in all_reduce(&comms) {
            assert!(got.expect("all-reduce").iter().all(|&x| x == 6.0));
        }
    }
    assert_eq!(svc.stats().jobs, 1);
    let seen = p.captured();
    assert!(!seen.is_empty());
    // The join is in clear (its claims are what the proof covers); the endpoints, regions,
    // rkeys and calls are not.
    assert!(holds(&seen, b"\"world\""), "the proxy saw no join");
    for needle in [
        &b"endpoint"[..],
        b"rkey",
        b"qp_token",
        b"127.0.0.1",
        b"\"count\"",
        b"calls",
    ] {
        assert!(
            !holds(&seen, needle),
            "{:?} crossed the proxy in clear",
            String::from_utf8_lossy(needle)
        );
    }
    drop(comms);
}

#[test]
fn a_flipped_or_replayed_call_fails_the_job_and_is_not_run() {
    let _g = serial();
    // Record 0 toward the service is rank 0's side; record 1 its first call.
    for tamper in [Tamper::FlipBit { record: 1 }, Tamper::Replay { record: 1 }] {
        let svc = service();
        let p = proxy(&svc, tamper, Toward::Target);
        let comms = job(2, &svc, &p);
        let addr = svc.addr().to_string();
        let first = all_reduce(&comms);
        assert!(
            p.tampered_within(Duration::from_secs(2)),
            "{tamper:?}: the proxy did not tamper"
        );
        let failure = failure_naming(&svc, "rank 0");
        assert!(failure.contains("record 1"), "{tamper:?}: {failure}");
        // A flipped call never runs; a replayed one runs once (its original), and the ranks'
        // next call fails.
        let results = match tamper {
            Tamper::FlipBit { .. } => first,
            _ => {
                assert!(svc.stats().calls <= 1, "{tamper:?}: the replay ran");
                all_reduce(&comms)
            }
        };
        // Each rank names the service at the address it reached it at.
        let through = p.addr().to_string();
        for (r, got) in results.into_iter().enumerate() {
            let e = got.expect_err("a call after a tampered record");
            let at = if r == 0 { &through } else { &addr };
            assert!(
                e.to_string().contains(at.as_str()),
                "{tamper:?}: rank {r}: {e}"
            );
        }
        if matches!(tamper, Tamper::FlipBit { .. }) {
            assert_eq!(svc.stats().calls, 0, "the flipped call ran");
        }
        drop(comms);
    }
}

#[test]
fn a_flipped_service_side_fails_rank_zero_naming_the_service() {
    let _g = serial();
    let svc = service();
    // Record 0 toward rank 0 is the service's side: its endpoint and region.
    let p = proxy(&svc, Tamper::FlipBit { record: 0 }, Toward::Client);
    let through = p.addr().to_string();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(2, &svc, &p)));
    let msg = match r {
        Ok(_) => panic!("rank 0 took a tampered side"),
        Err(e) => e.downcast_ref::<String>().cloned().unwrap_or_default(),
    };
    assert!(
        p.tampered_within(Duration::from_secs(2)),
        "the proxy did not flip a bit"
    );
    assert!(msg.contains("rank 0"), "{msg}");
    assert!(msg.contains(&through), "{msg}");
    assert!(msg.contains("its side"), "{msg}");
}
