//! The aggregation service (`oxccl::agg`) with in-process jobs: all-reduces through it are
//! exact for every data type and operator (against a reference computed here), the same bits
//! on every rank as a rank-order fold, over shm and tcp, with the slot pool reused many times
//! per call; two jobs share one service; a job the service has no room for runs without it; a
//! stranger is refused; a service that dies fails every rank naming its address.

use std::sync::Mutex;
use std::time::Duration;

use half::{bf16, f16};
use oxccl::agg::{Service, ServiceOptions};
use oxccl::schedule::{Algorithm, Collective};
use oxccl::{Buffers, Communicator, DataType, F8E4M3, F8E5M2, Options, Provider, ReduceOp};
use oxccl_bootstrap::Secret;

mod common;
use common::Rng;

/// One job at a time: a few ranks already outnumber this machine's CPUs.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A service for in-process jobs: `pool_bytes` of slots, `max_jobs` jobs.
fn service(pool_bytes: usize, max_jobs: usize) -> Service {
    let secret = Secret::new(common::IN_PROCESS_SECRET).expect("a secret");
    let mut opts = ServiceOptions::new("127.0.0.1:0".parse().unwrap(), vec![secret]);
    opts.pool_bytes = pool_bytes;
    opts.max_jobs = max_jobs;
    Service::start(opts).expect("the service starts")
}

/// `n` ranks joined to `svc` over `provider` with `chunk`-byte slices, aggregation forced.
fn job(n: usize, svc: &Service, provider: Provider, chunk: usize) -> Vec<Communicator> {
    job_sealed(n, svc, provider, chunk, oxccl_verbs::Encrypt::Auto)
}

/// [`job`] under an `OXCCL_ENCRYPT` policy.
fn job_sealed(
    n: usize,
    svc: &Service,
    provider: Provider,
    chunk: usize,
    encrypt: oxccl_verbs::Encrypt,
) -> Vec<Communicator> {
    let addr = svc.addr().to_string();
    common::in_process(n, &format!("agg over {provider:?}"), |rank| Options {
        timeout: Duration::from_secs(60),
        provider: Some(provider),
        host_id: Some(format!("agg-host-{rank}")),
        algo: Some(Algorithm::Aggregation),
        chunk_size: Some(chunk),
        agg_addr: Some(addr.clone()),
        encrypt,
        ..Options::default()
    })
}

/// The service's stats once it has counted `calls` calls (it counts after its side of a
/// call ends, which may be after the ranks' sides did); at most 10 s.
fn stats_after(svc: &Service, calls: u64) -> oxccl::agg::ServiceStats {
    let t = std::time::Instant::now();
    while svc.stats().calls < calls && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    svc.stats()
}

/// Destroys a job's communicators (a collective: all at once).
fn destroy_all(comms: Vec<Communicator>) {
    let comms: Vec<Mutex<Option<Communicator>>> =
        comms.into_iter().map(|c| Mutex::new(Some(c))).collect();
    common::per_rank(&comms, |_, c| {
        let c = c.lock().unwrap().take().expect("a communicator");
        c.destroy().expect("destroy")
    });
}

/// `v` as one element of `dtype`, little-endian.
fn encode(dtype: DataType, v: f64) -> Vec<u8> {
    match dtype {
        DataType::I8 => (v as i8).to_le_bytes().to_vec(),
        DataType::U8 => (v as u8).to_le_bytes().to_vec(),
        DataType::I32 => (v as i32).to_le_bytes().to_vec(),
        DataType::U32 => (v as u32).to_le_bytes().to_vec(),
        DataType::I64 => (v as i64).to_le_bytes().to_vec(),
        DataType::U64 => (v as u64).to_le_bytes().to_vec(),
        DataType::F16 => f16::from_f64(v).to_le_bytes().to_vec(),
        DataType::Bf16 => bf16::from_f64(v).to_le_bytes().to_vec(),
        DataType::F32 => (v as f32).to_le_bytes().to_vec(),
        DataType::F64 => v.to_le_bytes().to_vec(),
        DataType::F8E4M3 => vec![F8E4M3::from_f64(v).to_bits()],
        DataType::F8E5M2 => vec![F8E5M2::from_f64(v).to_bits()],
    }
}

/// Every rank's all-reduce of its `bytes` (in place); the results.
fn all_reduce(
    comms: &[Communicator],
    dtype: DataType,
    op: ReduceOp,
    inputs: &[Vec<u8>],
) -> Vec<oxccl::Result<Vec<u8>>> {
    let count = inputs[0].len() / dtype.size();
    common::per_rank(comms, |r, c| {
        let mut buf = inputs[r].clone();
        c.run(
            &Collective::AllReduce { count },
            dtype,
            op,
            Buffers::InPlace(&mut buf),
        )
        .map(|()| buf)
    })
}

/// Small integers (exact in every type, their sums and products too, over 3 ranks): rank
/// `r`'s value `i` and the reference result of `op` over the ranks.
fn exact_case(n: usize, count: usize, op: ReduceOp, seed: u64) -> (Vec<Vec<f64>>, Vec<f64>) {
    let mut rng = Rng(seed);
    let vals: Vec<Vec<f64>> = (0..n)
        .map(|_| (0..count).map(|_| (rng.next() % 3) as f64).collect())
        .collect();
    let reference = (0..count)
        .map(|i| {
            let col = vals.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => col.sum(),
                ReduceOp::Prod => col.product(),
                ReduceOp::Min => col.fold(f64::INFINITY, f64::min),
                ReduceOp::Max => col.fold(f64::NEG_INFINITY, f64::max),
            }
        })
        .collect();
    (vals, reference)
}

fn check_every_type(provider: Provider) {
    let _g = serial();
    let svc = service(64 << 10, 2);
    let n = 3;
    // 4 KiB slices and a pool of 8 KiB per job: 2 slots, each reused many times per call.
    let comms = job(n, &svc, provider, 4 << 10);
    for (t, &dtype) in DataType::ALL.iter().enumerate() {
        for (o, &op) in ReduceOp::ALL.iter().enumerate() {
            // Avg is the sum divided afterwards, by the ranks: the sum is checked.
            if op == ReduceOp::Avg {
                continue;
            }
            for count in [0usize, 1, 1000, 9001] {
                let (vals, reference) =
                    exact_case(n, count, op, (t * 8 + o) as u64 * 7919 + count as u64);
                let inputs: Vec<Vec<u8>> = vals
                    .iter()
                    .map(|v| v.iter().flat_map(|&x| encode(dtype, x)).collect())
                    .collect();
                let want: Vec<u8> = reference.iter().flat_map(|&x| encode(dtype, x)).collect();
                for (r, got) in all_reduce(&comms, dtype, op, &inputs)
                    .into_iter()
                    .enumerate()
                {
                    let got =
                        got.unwrap_or_else(|e| panic!("{dtype} {op} count {count}: rank {r}: {e}"));
                    assert!(
                        got == want,
                        "{provider:?} {dtype} {op} count {count}: rank {r} differs from the reference"
                    );
                }
            }
        }
    }
    let stats = stats_after(&svc, 12 * 4 * 3);
    assert_eq!(stats.jobs, 1);
    // In one process (loopback), `auto` seals nothing.
    assert_eq!(stats.sealed_links, 0);
    assert!(
        stats.calls >= 12 * 4 * 3,
        "the service ran {} calls",
        stats.calls
    );
    destroy_all(comms);
}

#[test]
fn every_type_and_op_is_exact_over_tcp() {
    check_every_type(Provider::Tcp);
}

/// `OXCCL_ENCRYPT=on`: the ranks' tcp queue pairs to the service are sealed (the service seals
/// its ends as their joins say), and the all-reduce through it is exact.
#[test]
fn a_sealed_data_link_to_the_service_is_exact() {
    let _g = serial();
    let svc = service(64 << 10, 2);
    let n = 3;
    let comms = job_sealed(n, &svc, Provider::Tcp, 4 << 10, oxccl_verbs::Encrypt::On);
    let (vals, reference) = exact_case(n, 9001, ReduceOp::Sum, 31);
    let dtype = DataType::F32;
    let inputs: Vec<Vec<u8>> = vals
        .iter()
        .map(|v| v.iter().flat_map(|&x| encode(dtype, x)).collect())
        .collect();
    let want: Vec<u8> = reference.iter().flat_map(|&x| encode(dtype, x)).collect();
    for (r, got) in all_reduce(&comms, dtype, ReduceOp::Sum, &inputs)
        .into_iter()
        .enumerate()
    {
        assert!(
            got.unwrap_or_else(|e| panic!("rank {r}: {e}")) == want,
            "rank {r} differs"
        );
    }
    let stats = stats_after(&svc, 1);
    assert!(stats.calls >= 1);
    assert_eq!(
        stats.sealed_links, n as u64,
        "every member's data link sealed"
    );
    assert!(
        comms
            .iter()
            .all(|c| c.encrypted().iter().filter(|&&s| s).count() == n - 1)
    );
    destroy_all(comms);
}

#[test]
fn every_type_and_op_is_exact_over_shm() {
    check_every_type(Provider::Shm);
}

/// Random f32 values: every rank gets the same bits, those of the rank-order fold
/// `((x0 + x1) + x2) + x3` in f32, whatever order the contributions arrived in.
#[test]
fn floats_are_a_rank_order_fold_on_every_rank() {
    let _g = serial();
    let svc = service(1 << 20, 1);
    let n = 4;
    let comms = job(n, &svc, Provider::Tcp, 16 << 10);
    let count = 50_001;
    let mut rng = Rng(42);
    let vals: Vec<Vec<f32>> = (0..n)
        .map(|_| {
            (0..count)
                .map(|_| ((rng.next() >> 40) as f32 / (1u32 << 24) as f32 - 0.5) * 1e3)
                .collect()
        })
        .collect();
    let want: Vec<f32> = (0..count)
        .map(|i| vals[1..].iter().fold(vals[0][i], |a, v| a + v[i]))
        .collect();
    for round in 0..3 {
        let inputs: Vec<Vec<u8>> = vals.iter().map(|v| oxccl::as_bytes(v).to_vec()).collect();
        for (r, got) in all_reduce(&comms, DataType::F32, ReduceOp::Sum, &inputs)
            .into_iter()
            .enumerate()
        {
            let got = got.expect("all-reduce");
            assert!(
                got == oxccl::as_bytes(&want),
                "round {round}: rank {r} is not the fold"
            );
        }
    }
    destroy_all(comms);
}

/// Two jobs at once on one service: both exact. A third, beyond `max_jobs`, is told the
/// service is busy and runs its ring: still exact.
#[test]
fn jobs_share_the_service_and_one_beyond_its_room_runs_without_it() {
    let _g = serial();
    let svc = service(1 << 20, 2);
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| job(2, &svc, Provider::Tcp, 8 << 10));
        let b = s.spawn(|| job(3, &svc, Provider::Tcp, 8 << 10));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(svc.stats().running, 2);
    let c = job(3, &svc, Provider::Tcp, 8 << 10);
    assert_eq!(svc.stats().jobs, 2, "the third job was not admitted");
    std::thread::scope(|s| {
        for comms in [&a, &b, &c] {
            s.spawn(move || {
                let n = comms.len();
                let (vals, reference) = exact_case(n, 20_000, ReduceOp::Sum, n as u64);
                let inputs: Vec<Vec<u8>> = vals
                    .iter()
                    .map(|v| v.iter().flat_map(|&x| encode(DataType::F32, x)).collect())
                    .collect();
                let want: Vec<u8> = reference
                    .iter()
                    .flat_map(|&x| encode(DataType::F32, x))
                    .collect();
                for _ in 0..5 {
                    for got in all_reduce(comms, DataType::F32, ReduceOp::Sum, &inputs) {
                        assert!(got.expect("all-reduce") == want);
                    }
                }
            });
        }
    });
    for comms in [a, b, c] {
        destroy_all(comms);
    }
    // Both jobs end once their members have left.
    let t = std::time::Instant::now();
    while svc.stats().running > 0 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        svc.stats().running,
        0,
        "jobs still running after their members left"
    );
}

/// A service that does not hold the job's secret refuses it: init fails saying so.
#[test]
fn a_stranger_is_refused() {
    let _g = serial();
    let other = Secret::new("another job's secret").unwrap();
    let svc = Service::start(ServiceOptions::new(
        "127.0.0.1:0".parse().unwrap(),
        vec![other],
    ))
    .expect("the service starts");
    let addr = svc.addr().to_string();
    let r = std::panic::catch_unwind(|| {
        common::in_process(2, "stranger", |_| Options {
            timeout: Duration::from_secs(20),
            provider: Some(Provider::Tcp),
            agg_addr: Some(addr.clone()),
            ..Options::default()
        })
    });
    let msg = match r {
        Ok(_) => panic!("a job without the service's secret was admitted"),
        Err(p) => p.downcast_ref::<String>().cloned().unwrap_or_default(),
    };
    assert!(msg.contains("secret was not proven"), "{msg}");
    assert!(msg.contains(&addr), "{msg}");
    assert_eq!(svc.stats().jobs, 0);
}

/// `OXCCL_ALGO=agg` without a service is an error that says what to set.
#[test]
fn agg_without_a_service_says_what_to_set() {
    let _g = serial();
    let r = std::panic::catch_unwind(|| {
        common::in_process(2, "no service", |_| Options {
            timeout: Duration::from_secs(20),
            algo: Some(Algorithm::Aggregation),
            ..Options::default()
        })
    });
    let msg = r
        .err()
        .and_then(|p| p.downcast_ref::<String>().cloned())
        .expect("init without a service fails");
    assert!(msg.contains("OXCCL_AGG_ADDR"), "{msg}");
}

/// The service goes away between calls: every rank's next call fails, naming its address.
#[test]
fn a_dead_service_fails_every_rank_naming_it() {
    let _g = serial();
    let svc = service(1 << 20, 1);
    let addr = svc.addr().to_string();
    let comms = job(3, &svc, Provider::Tcp, 8 << 10);
    let inputs = vec![encode(DataType::F32, 1.0).repeat(10_000); 3];
    for got in all_reduce(&comms, DataType::F32, ReduceOp::Sum, &inputs) {
        assert!(got.expect("before") == encode(DataType::F32, 3.0).repeat(10_000));
    }
    // Its idle job ends within its tick, closing its connections; the drop waits for it.
    drop(svc);
    let t = std::time::Instant::now();
    for (r, got) in all_reduce(&comms, DataType::F32, ReduceOp::Sum, &inputs)
        .into_iter()
        .enumerate()
    {
        let e = got.expect_err("a call through a dead service");
        let msg = e.to_string();
        assert!(
            matches!(e, oxccl::Error::AggregatorFailed { .. }) && msg.contains(&addr),
            "rank {r}: {msg}"
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t.elapsed()
    );
}

/// Rank 1 calls with another count than rank 0 (which named the call to the service): every
/// rank fails with a mismatch, none hangs.
#[test]
fn a_mismatched_call_fails_every_rank() {
    let _g = serial();
    let svc = service(1 << 20, 1);
    let comms = job(3, &svc, Provider::Tcp, 8 << 10);
    for c in &comms {
        c.set_timeout(Duration::from_secs(20));
    }
    let t = std::time::Instant::now();
    let errors: Vec<oxccl::Error> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    let mut buf = vec![1.0f32; if r == 1 { 10_001 } else { 10_000 }];
                    c.all_reduce_in_place(&mut buf, ReduceOp::Sum)
                        .expect_err("a mismatched call succeeded")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, e) in errors.iter().enumerate() {
        assert!(
            matches!(
                e,
                oxccl::Error::Mismatch { .. } | oxccl::Error::PeerFailed { .. }
            ),
            "rank {r}: {e}"
        );
    }
    assert!(
        errors
            .iter()
            .any(|e| matches!(e, oxccl::Error::Mismatch { .. })),
        "nobody named a mismatch: {errors:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t.elapsed()
    );
}

/// The peer processes' entry point (a no-op unless `OXCCL_TEST_CHILD` is set).
#[test]
fn child_entry() {
    // Holds SERIAL like every test here, so that none reads the environment while
    // `the_topology_file_names_the_service` sets a variable.
    let _g = serial();
    common::child_entry(|scenario, _| match scenario {
        "agg_loop" => agg_loop(),
        other => panic!("unknown scenario {other:?}"),
    });
}

/// In a rank: all-reduces through the service until a call fails; reports the error.
fn agg_loop() -> serde_json::Value {
    let (rank, _) = common::env_rank();
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => return serde_json::json!({"init": e.to_string()}),
    };
    let mut buf = vec![1.0f32; 1 << 20];
    let start = std::time::Instant::now();
    let mut calls = 0u64;
    let error = loop {
        if let Err(e) = comm.all_reduce_in_place(&mut buf, ReduceOp::Sum) {
            break e;
        }
        buf.fill(1.0);
        calls += 1;
        if calls == 2 {
            common::touch(&format!("ready-{rank}"));
        }
        if start.elapsed() > Duration::from_secs(90) {
            return serde_json::json!({"error": null, "calls": calls});
        }
    };
    serde_json::json!({
        "error": error.to_string(),
        "kind": common::error_kind(&error),
        "calls": calls,
        "failed_at_ns": common::realtime_ns(),
    })
}

/// A member SIGKILLed in the middle of the stream: the service tells the others, which fail
/// within their timeout naming it.
#[test]
fn a_dead_member_is_named_on_every_other_rank() {
    let _g = serial();
    let secret = common::random_hex();
    let mut opts = ServiceOptions::new(
        "127.0.0.1:0".parse().unwrap(),
        vec![Secret::new(secret.as_str()).unwrap()],
    );
    opts.max_jobs = 1;
    let svc = Service::start(opts).expect("the service starts");
    let addr = svc.addr().to_string();
    let n = 3;
    let victim = 2;
    let env = [
        ("OXCCL_SECRET", secret.as_str()),
        ("OXCCL_AGG_ADDR", addr.as_str()),
        ("OXCCL_ALGO", "agg"),
        ("OXCCL_PROVIDER", "tcp"),
        ("OXCCL_TIMEOUT", "10"),
    ];
    let mut job = common::spawn_job(n, &env, "agg_loop", &serde_json::Value::Null, &|_, exe| {
        std::process::Command::new(exe)
    });
    let ready = job.wait_until(std::time::Instant::now() + Duration::from_secs(60), |j| {
        (0..n).all(|r| j.path(&format!("ready-{r}")).exists())
    });
    assert!(ready, "the ranks did not start streaming");
    let killed_at = common::realtime_ns();
    job.signal(victim, libc::SIGKILL).expect("kill");
    job.touch(&format!("done-{victim}"));
    let outs = job.finish(Duration::from_secs(40));
    for (r, o) in outs.iter().enumerate() {
        if r == victim {
            continue;
        }
        let v = o.result();
        let msg = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("rank {r}: {}", common::report(&outs)));
        assert!(
            msg.contains(&format!("rank {victim}")),
            "rank {r} does not name rank {victim}: {msg}"
        );
        let after = v["failed_at_ns"]
            .as_u64()
            .unwrap()
            .saturating_sub(killed_at);
        assert!(
            after < 12_000_000_000,
            "rank {r} failed {} ms after the kill: {msg}",
            after / 1_000_000
        );
    }
}

/// Two hosts of two ranks (shm inside, tcp across): the ranks of a host reduce first and each
/// rail streams its half through the service, which receives each host's buffer once.
#[test]
fn two_tiers_stream_each_rail_through_the_service() {
    let _g = serial();
    let svc = service(1 << 20, 1);
    let addr = svc.addr().to_string();
    let comms = common::in_process(4, "two tiers", |rank| Options {
        timeout: Duration::from_secs(60),
        host_id: Some(format!("agg-tier-host-{}", rank / 2)),
        algo: Some(Algorithm::Aggregation),
        chunk_size: Some(16 << 10),
        agg_addr: Some(addr.clone()),
        topo_probe: Some(0),
        ..Options::default()
    });
    let count = 100_003;
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Prod] {
        let (vals, reference) = exact_case(4, count, op, 99);
        let inputs: Vec<Vec<u8>> = vals
            .iter()
            .map(|v| v.iter().flat_map(|&x| encode(DataType::F64, x)).collect())
            .collect();
        let want: Vec<u8> = reference
            .iter()
            .flat_map(|&x| encode(DataType::F64, x))
            .collect();
        for (r, got) in all_reduce(&comms, DataType::F64, op, &inputs)
            .into_iter()
            .enumerate()
        {
            assert!(got.expect("all-reduce") == want, "{op}: rank {r}");
        }
    }
    let st = stats_after(&svc, 3);
    assert_eq!(st.calls, 3);
    // Two hosts' buffers per call, not four ranks'.
    assert_eq!(st.bytes_in, 3 * 2 * count as u64 * 8);
    destroy_all(comms);
}

/// A topology file that names the service: the job joins it without `OXCCL_AGG_ADDR`.
#[test]
fn the_topology_file_names_the_service() {
    let _g = serial();
    let svc = service(1 << 20, 1);
    let dir = common::TempDir::new("agg-topo");
    let file = dir.0.join("topo.toml");
    std::fs::write(
        &file,
        format!(
            "aggregator = \"{}\"\n[[hosts]]\nname = \"a\"\nranks = [0]\n\
             [[hosts]]\nname = \"b\"\nranks = [1]\n[[hosts]]\nname = \"c\"\nranks = [2]\n",
            svc.addr()
        ),
    )
    .unwrap();
    // SAFETY: every test of this binary holds SERIAL (child_entry too), so no other thread
    // reads or writes the environment meanwhile.
    unsafe { std::env::set_var("OXCCL_TOPO_FILE", &file) };
    let comms = common::in_process(3, "topology file", |rank| Options {
        timeout: Duration::from_secs(60),
        provider: Some(Provider::Tcp),
        host_id: Some(format!("agg-topo-host-{rank}")),
        algo: Some(Algorithm::Aggregation),
        topo_probe: Some(0),
        ..Options::default()
    });
    unsafe { std::env::remove_var("OXCCL_TOPO_FILE") };
    let inputs = vec![encode(DataType::I32, 2.0).repeat(5000); 3];
    for got in all_reduce(&comms, DataType::I32, ReduceOp::Sum, &inputs) {
        assert!(got.expect("all-reduce") == encode(DataType::I32, 6.0).repeat(5000));
    }
    assert_eq!(
        stats_after(&svc, 1).calls,
        1,
        "the call did not go through the service"
    );
    destroy_all(comms);
}

/// A group of two aggregation all-reduces and an all-gather: the service runs the two as a
/// group too (rank 0 names them together), in the turns the ranks take on their queues.
#[test]
fn a_group_of_aggregation_calls_runs_as_one() {
    let _g = serial();
    let svc = service(1 << 20, 1);
    let n = 3;
    // Small slices: each call streams many, so the two calls' fragments interleave.
    let comms = job(n, &svc, Provider::Tcp, 4 << 10);
    let results: Vec<(Vec<i64>, Vec<f32>, Vec<u32>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    let mut a = vec![r as i64 + 1; 30_000];
                    let mut b = vec![(r * 2) as f32; 20_001];
                    let mine = vec![r as u32; 1000];
                    let mut all = vec![0u32; 1000 * n];
                    let mut g = c.group();
                    g.all_reduce_in_place(&mut a, ReduceOp::Sum).unwrap();
                    g.all_gather(&mine, &mut all).unwrap();
                    g.all_reduce_in_place(&mut b, ReduceOp::Max).unwrap();
                    g.end().expect("the group");
                    (a, b, all)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (a, b, all)) in results.iter().enumerate() {
        assert!(a.iter().all(|&x| x == 6), "rank {r}: sum");
        assert!(b.iter().all(|&x| x == 4.0), "rank {r}: max");
        assert!(
            all.iter().enumerate().all(|(i, &x)| x == (i / 1000) as u32),
            "rank {r}: all-gather"
        );
    }
    assert_eq!(stats_after(&svc, 2).calls, 2);
    destroy_all(comms);
}

/// A call whose schedule would pass the service's `max_call_steps` fails the job (every rank
/// sees the service fail, naming it), where calls under the cap ran exactly before.
#[test]
fn a_call_over_the_step_cap_fails_every_rank_naming_the_service() {
    let _g = serial();
    let secret = Secret::new(common::IN_PROCESS_SECRET).expect("a secret");
    let mut opts = ServiceOptions::new("127.0.0.1:0".parse().unwrap(), vec![secret]);
    opts.pool_bytes = 1 << 20;
    opts.max_jobs = 1;
    // 8 KiB slices of f32 are 2048 elements: 100 slices of 2 members is 200 steps.
    opts.max_call_steps = 100;
    let svc = Service::start(opts).expect("the service starts");
    let addr = svc.addr().to_string();
    let comms = job(2, &svc, Provider::Tcp, 8 << 10);
    for c in &comms {
        c.set_timeout(Duration::from_secs(20));
    }
    let small = vec![encode(DataType::F32, 1.0).repeat(2048 * 40); 2];
    for got in all_reduce(&comms, DataType::F32, ReduceOp::Sum, &small) {
        assert!(got.expect("under the cap") == encode(DataType::F32, 2.0).repeat(2048 * 40));
    }
    let big = vec![encode(DataType::F32, 1.0).repeat(2048 * 100); 2];
    let t = std::time::Instant::now();
    for (r, got) in all_reduce(&comms, DataType::F32, ReduceOp::Sum, &big)
        .into_iter()
        .enumerate()
    {
        let e = got.expect_err("a call over the service's step cap");
        assert!(e.to_string().contains(&addr), "rank {r}: {e}");
    }
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(stats_after(&svc, 1).calls, 1, "the capped call was not run");
}
