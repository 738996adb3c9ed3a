//! The tcp provider's congestion control ([`DeviceConfig::tcp_congestion`]): what each
//! connection of a queue pair gets, read back from the kernel with `getsockopt(TCP_CONGESTION)`
//! on every connected TCP socket of this process, and the error a refused name gives.

use std::os::fd::{BorrowedFd, RawFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use oxccl_verbs::*;

/// The tests read every socket of the process: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

struct End {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn end(cfg: &DeviceConfig) -> End {
    let ctx = Device::by_name("tcp").unwrap().open_with(cfg).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
    End {
        _ctx: ctx,
        pd,
        cq,
        qp,
    }
}

fn config(cc: TcpCongestion, nsocks: usize) -> DeviceConfig {
    DeviceConfig {
        tcp_congestion: cc,
        tcp_nsocks: nsocks,
        ..DeviceConfig::default()
    }
}

/// The congestion control of every connected TCP socket of this process whose two ends are on
/// loopback (the listeners and other descriptors are skipped).
fn loopback_controls() -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(fd) = e.file_name().to_string_lossy().parse::<RawFd>() else {
            continue;
        };
        // SAFETY: the descriptor is only read (getsockopt, getpeername) while the queue pairs
        // that own it are alive; one that closed meanwhile makes these calls fail, not UB.
        let b = unsafe { BorrowedFd::borrow_raw(fd) };
        let (Ok(cc), Ok(Some(peer))) = (
            rustix::net::sockopt::tcp_congestion(b),
            rustix::net::getpeername(b),
        ) else {
            continue;
        };
        let Ok(peer) = std::net::SocketAddr::try_from(peer) else {
            continue;
        };
        if peer.ip().is_loopback() {
            out.push(cc);
        }
    }
    out
}

/// Moves 1 MiB + 3 bytes over the pair and checks every byte, so the connections carry data.
fn check_transfer(a: &End, b: &End) {
    let len = (1 << 20) + 3;
    let src = a.pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = b.pd.alloc_mr(len, AccessFlags::ALL).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    src.write(0, &data).unwrap();
    let sge = [Sge::new(&src, 0, len)];
    let op = WrOp::Write {
        remote: dst.remote().at(0),
    };
    a.qp.post_send(&[SendWr::new(1, op, &sge)]).unwrap();
    let mut wc = [WorkCompletion::default(); 4];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "the WRITE did not complete in 20 s");
        if a.cq.wait(&mut wc, left).unwrap_or(0) > 0 {
            assert_eq!(wc[0].status, WcStatus::Success, "{:?}", wc[0]);
            break;
        }
    }
    let mut seen = vec![0u8; len];
    dst.read(0, &mut seen).unwrap();
    assert!(seen == data, "the WRITE's bytes differ at the target");
    let _ = &b.cq;
}

fn connect(cfg: &DeviceConfig) -> (End, End, Result<()>) {
    let (a, b) = (end(cfg), end(cfg));
    let (ea, eb) = (a.qp.endpoint(), b.qp.endpoint());
    let r = a.qp.connect(&eb).and_then(|()| b.qp.connect(&ea));
    (a, b, r)
}

/// `auto` gives every loopback connection of a queue pair (two connections each way here)
/// `reno`, whatever the system's default is, and the data still lands.
#[test]
fn auto_gives_loopback_connections_reno() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b, r) = connect(&config(TcpCongestion::Auto, 2));
    r.unwrap();
    check_transfer(&a, &b);
    let ccs = loopback_controls();
    // Two queue pairs' ends of 2 connections each: 4 sockets.
    assert_eq!(ccs.len(), 4, "{ccs:?}");
    assert!(ccs.iter().all(|c| c == "reno"), "{ccs:?}");
}

/// `system` leaves the kernel's default (`net.ipv4.tcp_congestion_control`) on every
/// connection.
#[test]
fn system_keeps_the_kernels_default() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let default = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .unwrap()
        .trim()
        .to_string();
    let (a, b, r) = connect(&config(TcpCongestion::System, 1));
    r.unwrap();
    check_transfer(&a, &b);
    let ccs = loopback_controls();
    assert_eq!(ccs.len(), 2, "{ccs:?}");
    assert!(
        ccs.iter().all(|c| *c == default),
        "{ccs:?} against {default}"
    );
}

/// A name the kernel refuses fails the connection with an error naming the algorithm and
/// the peer's address.
#[test]
fn a_refused_name_fails_the_connection_naming_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b, r) = connect(&config(TcpCongestion::Named("no_such_cc".into()), 1));
    let e = r
        .expect_err("a connection with an unknown congestion control")
        .to_string();
    assert!(e.contains("\"no_such_cc\""), "{e}");
    // Whichever side fails first names the other end's listener.
    let addrs: Vec<String> = [&a, &b]
        .iter()
        .map(|x| match x.qp.endpoint().addr {
            EndpointAddr::Tcp { addr, .. } => addr,
            other => panic!("a tcp endpoint with {other:?}"),
        })
        .collect();
    assert!(
        addrs.iter().any(|p| e.contains(p.as_str())),
        "{e} ({addrs:?})"
    );
}

/// The variable's forms: `auto`, `system`, a name; anything else is refused naming it.
#[test]
fn the_variable_parses_and_refuses_bad_names() {
    let get = |v: &'static str| {
        DeviceConfig::from_vars(&move |k| (k == "OXCCL_TCP_CONGESTION").then(|| v.to_string()))
    };
    assert_eq!(get("auto").unwrap().tcp_congestion, TcpCongestion::Auto);
    assert_eq!(
        get(" system ").unwrap().tcp_congestion,
        TcpCongestion::System
    );
    assert_eq!(
        get("cubic").unwrap().tcp_congestion,
        TcpCongestion::Named("cubic".into())
    );
    assert_eq!(DeviceConfig::default().tcp_congestion, TcpCongestion::Auto);
    for bad in ["bbr;rm", "a-b", "sixteen_letters_", "re no"] {
        let e = get(bad).expect_err(bad).to_string();
        assert!(e.contains("OXCCL_TCP_CONGESTION") && e.contains(bad), "{e}");
    }
}
