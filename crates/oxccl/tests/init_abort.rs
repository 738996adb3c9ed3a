//! Abort during init and init's timeouts (issue 32, item 3), in one process: ranks are
//! threads joined through a store served by the test. An init waiting for a rank that never
//! comes, aborted from another thread after 200 ms, returns promptly with an error naming the
//! missing rank and what it waited for; the other ranks of the same init fail promptly naming
//! the aborted rank; no init thread is left behind. Without an abort, the same inits time out
//! naming the missing ranks, at the join and at the hello exchange.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use oxccl::{Communicator, Error, Options, PendingInit};
use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};

/// The tests of this file run one at a time: they count this process's threads and time
/// aborts on two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// How long an abort may take to stop an init here (the aim is ~20-50 ms; two shared cores
/// run other builds and tests meanwhile).
const ABORT_BOUND: Duration = Duration::from_millis(500);

fn store() -> (StoreServer, Secret) {
    let secret = Secret::new("init-abort test secret").unwrap();
    let server = StoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
    (server, secret)
}

fn config(server: &StoreServer, secret: &Secret, rank: usize, n: usize, t: Duration) -> Config {
    let mut c = Config::new(rank, n, server.addr().to_string(), secret.clone());
    c.serve_store = false;
    c.timeout = t;
    c.job_id = format!("init-abort-{}", server.addr().port());
    c
}

fn opts(timeout: Duration) -> Options {
    Options {
        timeout,
        provider: Some(oxccl::Provider::Shm),
        ..Options::default()
    }
}

/// Threads of this process named `oxccl-init-*` (a [`PendingInit`]'s).
fn init_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("oxccl-init-"))
        .count()
}

/// Open sockets of this process.
fn sockets() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|f| std::fs::read_link(f.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with("socket:"))
        .count()
}

/// Aborts `p` `after` from now (from another thread) and waits for it; the error and how long
/// after the abort it came.
fn abort_after(p: PendingInit, after: Duration) -> (Error, Duration) {
    let h = p.abort_handle();
    let t = std::thread::spawn(move || {
        std::thread::sleep(after);
        let at = Instant::now();
        h.abort_with("the test aborted it");
        at
    });
    let r = p.wait();
    let done = Instant::now();
    let at = t.join().unwrap();
    match r {
        Ok(_) => panic!("an init with a missing rank succeeded"),
        Err(e) => (e, done.saturating_duration_since(at)),
    }
}

fn expect_aborted(e: &Error, rank: usize, waiting: &str) {
    match e {
        Error::Aborted {
            rank: r,
            op,
            reason,
        } => {
            assert_eq!((*r, op.as_str()), (rank, "init"), "{e}");
            assert!(reason.contains("the test aborted it"), "{e}");
            assert!(reason.contains(waiting), "wanted {waiting:?} in: {e}");
        }
        e => panic!("not Aborted: {e}"),
    }
}

/// Rank 2 of 3 never comes: rank 1, aborted at the join, stops at once naming rank 2; rank 0
/// fails at once naming rank 1.
#[test]
fn abort_during_the_join() {
    let _g = serial();
    let (threads, socks) = (init_threads(), sockets());
    let (server, secret) = store();
    let t = Duration::from_secs(30);
    let p0 = Communicator::init_config_async(config(&server, &secret, 0, 3, t), opts(t));
    let p1 = Communicator::init_config_async(config(&server, &secret, 1, 3, t), opts(t));
    assert!(!p0.wait_for(Duration::from_millis(50)));
    assert!(!p1.is_finished());
    let (e1, took1) = abort_after(p1, Duration::from_millis(200));
    let started = Instant::now();
    let e0 = p0.wait().map(|c| c.rank()).unwrap_err();
    let took0 = took1 + started.elapsed();
    println!("abort during the join: rank 1 returned {took1:?} after the abort: {e1}");
    println!("  rank 0 returned {took0:?} after it: {e0}");
    expect_aborted(&e1, 1, "for ranks [2] of 3 to join the store at");
    assert!(took1 < ABORT_BOUND, "{took1:?}");
    let s0 = e0.to_string();
    assert!(
        s0.contains("rank 1 failed: it aborted its join (the test aborted it)"),
        "{s0}"
    );
    assert!(took0 < ABORT_BOUND, "{took0:?}");
    drop(server);
    assert_eq!(init_threads(), threads, "an init thread was left behind");
    assert_eq!(sockets(), socks, "a socket was left open");
}

/// Every rank joins, rank 2 never calls init: rank 0 (not the store's), aborted in the hello
/// exchange, stops naming rank 2; rank 1 fails naming rank 0.
#[test]
fn abort_during_the_hello_exchange() {
    let _g = serial();
    let (threads, socks) = (init_threads(), sockets());
    let (server, secret) = store();
    let t = Duration::from_secs(30);
    let boots: Vec<Bootstrap> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let c = config(&server, &secret, r, 3, t);
                s.spawn(move || Bootstrap::new(c).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut boots = boots.into_iter();
    let p0 = Communicator::init_async(boots.next().unwrap(), opts(t));
    let p1 = Communicator::init_async(boots.next().unwrap(), opts(t));
    let idle = boots.next().unwrap();
    let (e0, took0) = abort_after(p0, Duration::from_millis(200));
    let started = Instant::now();
    let e1 = p1.wait().map(|c| c.rank()).unwrap_err();
    let took1 = took0 + started.elapsed();
    println!("abort during the hello exchange: rank 0 returned {took0:?} after the abort: {e0}");
    println!("  rank 1 returned {took1:?} after it: {e1}");
    expect_aborted(
        &e0,
        0,
        "for ranks [2] of 3 to reach all-gather \"oxccl/hello\" (round 0)",
    );
    assert!(took0 < ABORT_BOUND, "{took0:?}");
    let s1 = e1.to_string();
    assert!(
        s1.contains("rank 0 failed: ") && s1.contains("rank 0: aborted"),
        "{s1}"
    );
    assert!(took1 < ABORT_BOUND, "{took1:?}");
    drop(idle);
    drop(server);
    assert_eq!(init_threads(), threads, "an init thread was left behind");
    assert_eq!(sockets(), socks, "a socket was left open");
}

/// A blocking init stopped through an [`oxccl::AbortHandle`], and a `PendingInit` dropped
/// unfinished (it aborts and joins its thread).
#[test]
fn abort_a_blocking_init_and_drop_a_pending_one() {
    let _g = serial();
    let threads = init_threads();
    let (server, secret) = store();
    let t = Duration::from_secs(30);
    let handle = oxccl::AbortHandle::new();
    let h = handle.clone();
    let c = config(&server, &secret, 0, 2, t);
    let blocking = std::thread::spawn(move || {
        let r = Bootstrap::new_abortable(c, &h)
            .map_err(Error::from)
            .and_then(|b| Communicator::init_abortable(b, opts(t), &h));
        (r.map(|c| c.rank()), Instant::now())
    });
    std::thread::sleep(Duration::from_millis(200));
    let at = Instant::now();
    handle.abort_with("the test aborted it");
    let (r, done) = blocking.join().unwrap();
    let e = r.unwrap_err();
    println!(
        "blocking init aborted: returned {:?} after the abort: {e}",
        done.saturating_duration_since(at)
    );
    // The join's own error (Bootstrap::new_abortable), rank 1 missing.
    assert!(
        e.to_string()
            .contains("rank 0: aborted (the test aborted it) while waiting for ranks [1] of 2"),
        "{e}"
    );
    assert!(done.saturating_duration_since(at) < ABORT_BOUND);
    // A fresh store: the aborted join above spoiled its job (the others would fail at once).
    let (server, secret) = store();
    let p = Communicator::init_config_async(config(&server, &secret, 0, 2, t), opts(t));
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !p.is_finished(),
        "rank 1 is missing: the init must still wait"
    );
    let at = Instant::now();
    drop(p);
    println!("a PendingInit dropped unfinished: {:?}", at.elapsed());
    assert!(at.elapsed() < ABORT_BOUND);
    assert_eq!(init_threads(), threads, "an init thread was left behind");
}

/// Without an abort, init times out naming the missing ranks: at the join (rank 2 of 3 never
/// comes) and at the hello exchange (rank 2 joins but never calls init).
#[test]
fn init_times_out_naming_the_missing_ranks() {
    let _g = serial();
    let (server, secret) = store();
    let t = Duration::from_millis(600);
    let ps: Vec<PendingInit> = (0..2)
        .map(|r| Communicator::init_config_async(config(&server, &secret, r, 3, t), opts(t)))
        .collect();
    for (r, p) in ps.into_iter().enumerate() {
        let e = p.wait().map(|c| c.rank()).unwrap_err();
        println!("join, rank {r}: {e}");
        assert!(
            e.to_string()
                .contains("timed out after 0.6s waiting for ranks [2] of 3 to join the store"),
            "{e}"
        );
    }
    let (server, secret) = store();
    let boots: Vec<Bootstrap> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let c = config(&server, &secret, r, 3, t);
                s.spawn(move || Bootstrap::new(c).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut boots = boots.into_iter();
    let ps: Vec<PendingInit> = (0..2)
        .map(|_| Communicator::init_async(boots.next().unwrap(), opts(t)))
        .collect();
    for (r, p) in ps.into_iter().enumerate() {
        let e = p.wait().map(|c| c.rank()).unwrap_err().to_string();
        println!("hello, rank {r}: {e}");
        // The rank that times out first says so; the other may read its failure notice.
        let own = "waiting for ranks [2] of 3 to reach all-gather \"oxccl/hello\" (round 0)";
        assert!(e.contains(own), "{e}");
    }
}

/// A 2-rank init that nobody aborts completes, and the handle aborted afterwards leaves the
/// communicator working.
#[test]
fn an_unaborted_pending_init_completes() {
    let _g = serial();
    let (server, secret) = store();
    let t = Duration::from_secs(30);
    let ps: Vec<PendingInit> = (0..2)
        .map(|r| Communicator::init_config_async(config(&server, &secret, r, 2, t), opts(t)))
        .collect();
    let handles: Vec<_> = ps.iter().map(PendingInit::abort_handle).collect();
    let comms: Vec<Communicator> = ps.into_iter().map(|p| p.wait().unwrap()).collect();
    for h in &handles {
        h.abort();
    }
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mut v = vec![c.rank() as f32 + 1.0; 1000];
                    c.all_reduce_in_place(&mut v, oxccl::ReduceOp::Sum).unwrap();
                    v
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for v in sums {
        assert!(v.iter().all(|&x| x == 3.0));
    }
}

/// A thread-parking executor for one future.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_secs(1));
    }
}

/// `PendingInit` is a `Future`: two ranks awaited on two threads both complete; an aborted
/// one completes with its error.
#[test]
fn a_pending_init_is_a_future() {
    let _g = serial();
    let (server, secret) = store();
    let t = Duration::from_secs(30);
    let ranks: Vec<usize> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let c = config(&server, &secret, r, 2, t);
                s.spawn(move || {
                    block_on(Communicator::init_config_async(c, opts(t)))
                        .unwrap()
                        .rank()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(ranks, [0, 1]);
    let (server, secret) = store();
    let p = Communicator::init_config_async(config(&server, &secret, 0, 2, t), opts(t));
    let h = p.abort_handle();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        h.abort_with("the test aborted it");
    });
    let e = block_on(p).map(|c| c.rank()).unwrap_err();
    expect_aborted(&e, 0, "for ranks [1] of 2 to join");
}
