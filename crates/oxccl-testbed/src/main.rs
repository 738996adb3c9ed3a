//! `oxccl-testbed`: the test bed from the command line (what `bench/testbed.sh` drives), and the
//! small TCP tools its tests run inside the hosts.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use oxccl_testbed::{HostSpec, Shaping, Testbed};

const USAGE: &str = "\
usage: oxccl-testbed COMMAND ...

test beds:
  available                       exit 0 if this machine can host a test bed, else say why
  up [--rates R,R,..] [--hosts N] [--mtu M] [--burst-us US] [--queue-us US]
     [--fifo] [--owner-pid PID]
                                  create a bed and print its name; rates in Mbit/s, with an
                                  optional suffix m or g (250m, 1g), or `none`; --hosts N
                                  makes N unshaped hosts; --mtu (default 9000), --burst-us
                                  (2000) and --queue-us (50000) set the links' MTU and the
                                  tbf bucket and queue as time at the link's rate; --fifo
                                  queues small packets with the bulk. The bed
                                  is deleted as stale once PID (default: this process, so at
                                  the next creation) is gone
  down NAME..                     kill what runs in the beds and delete them
  down --owner PID                the same for every bed that PID owns
  exec NAME HOST [--] PROGRAM [ARGS..]
                                  run PROGRAM inside host HOST of bed NAME, with
                                  OXCCL_TESTBED_{HOST,HOSTS,ADDR,ADDRS} set
  rate NAME HOST RATE             reshape a host's link (both directions; default MTU,
                                  bucket and queue sizes, small packets first)
  list                            list the beds on this machine
  gc                              delete the beds whose owner is gone

tools run inside the hosts:
  tcp-echo-server PORT [CONNECTIONS]   echo each connection's bytes back (default 1 connection)
  tcp-echo-client ADDR:PORT MESSAGE    send MESSAGE, expect it back, print `echo ok`
  tcp-sink PORT [WARMUP_SECS]          receive one stream, print `mbit_per_s=..` measured after
                                       the warm-up (default 0.2 s)
  tcp-source ADDR:PORT SECS            send as fast as possible for SECS seconds
  mitm LISTEN TARGET CAPTURE [FLIP_AT] a man in the middle: forward LISTEN (IP:PORT) to TARGET
                                       (IP:PORT) both ways, append every byte forwarded to the
                                       file CAPTURE, and flip a bit of the byte at offset
                                       FLIP_AT of the client's direction; runs until killed
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        eprint!("{USAGE}");
        return ExitCode::from(2);
    };
    let result = match cmd.as_str() {
        "available" => Testbed::available().map(|()| println!("available")),
        "up" => up(rest),
        "down" => down(rest),
        "exec" => exec(rest),
        "rate" => rate(rest),
        "list" => list(),
        "gc" => {
            println!("deleted {} stale test beds", oxccl_testbed::cleanup_stale());
            Ok(())
        }
        "tcp-echo-server" => echo_server(rest),
        "tcp-echo-client" => echo_client(rest),
        "tcp-sink" => sink(rest),
        "tcp-source" => source(rest),
        "mitm" => mitm(rest),
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            Ok(())
        }
        _ => Err(format!("unknown command `{cmd}`\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oxccl-testbed {cmd}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `1000`, `250m`, `1g`, `1.5g` → Mbit/s; `none` → unshaped.
fn parse_rate(s: &str) -> Result<Option<u64>, String> {
    if s == "none" || s == "-" {
        return Ok(None);
    }
    let (num, scale) = match s.to_ascii_lowercase() {
        t if t.ends_with('g') => (t[..t.len() - 1].to_owned(), 1000.0),
        t if t.ends_with('m') => (t[..t.len() - 1].to_owned(), 1.0),
        t => (t, 1.0),
    };
    let v: f64 = num.parse().map_err(|_| format!("bad rate `{s}`"))?;
    let mbit = (v * scale).round();
    if !(1.0..1e9).contains(&mbit) {
        return Err(format!("rate `{s}` out of range (1 Mbit/s and up)"));
    }
    Ok(Some(mbit as u64))
}

fn up(args: &[String]) -> Result<(), String> {
    let mut b = Testbed::builder();
    let mut shaping = Shaping::default();
    let mut it = args.iter();
    let mut any = false;
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--rates" => {
                for r in val()?.split(',') {
                    b = b.host(HostSpec {
                        rate_mbit: parse_rate(r)?,
                    });
                    any = true;
                }
            }
            "--hosts" => {
                let n: usize = val()?.parse().map_err(|e| format!("--hosts: {e}"))?;
                for _ in 0..n {
                    b = b.host(HostSpec::unshaped());
                }
                any = true;
            }
            "--mtu" => shaping.mtu = num(val()?, "--mtu")?,
            "--burst-us" => shaping.burst_us = num(val()?, "--burst-us")?,
            "--queue-us" => shaping.queue_us = num(val()?, "--queue-us")?,
            "--fifo" => shaping.small_first = false,
            "--owner-pid" => {
                b = b.owner_pid(val()?.parse().map_err(|e| format!("--owner-pid: {e}"))?)
            }
            _ => return Err(format!("unknown option `{a}`")),
        }
    }
    if !any {
        return Err("give --rates or --hosts".into());
    }
    let tb = b.shaping(shaping).build().map_err(|e| e.to_string())?;
    println!("{}", tb.leak());
    Ok(())
}

fn down(args: &[String]) -> Result<(), String> {
    if let [opt, pid] = args {
        if opt != "--owner" {
            return down_names(args);
        }
        let pid: u32 = num(pid, "pid")?;
        let beds = oxccl_testbed::list().map_err(|e| e.to_string())?;
        for b in beds.iter().filter(|b| b.owner_pid == pid) {
            oxccl_testbed::destroy(&b.name).map_err(|e| e.to_string())?;
        }
        return Ok(());
    }
    down_names(args)
}

fn down_names(args: &[String]) -> Result<(), String> {
    for name in args {
        oxccl_testbed::destroy(name).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn hosts_of(name: &str) -> Result<usize, String> {
    let beds = oxccl_testbed::list().map_err(|e| e.to_string())?;
    let bed = beds
        .iter()
        .find(|b| b.name == name)
        .ok_or_else(|| format!("no test bed `{name}`"))?;
    Ok(bed.hosts)
}

fn host_index(name: &str, s: &str) -> Result<(usize, usize), String> {
    let n = hosts_of(name)?;
    let i: usize = s.parse().map_err(|_| format!("bad host `{s}`"))?;
    if i >= n {
        return Err(format!("host {i} of a {n}-host test bed"));
    }
    Ok((i, n))
}

fn exec(args: &[String]) -> Result<(), String> {
    let [name, host, rest @ ..] = args else {
        return Err("usage: exec NAME HOST [--] PROGRAM [ARGS..]".into());
    };
    let rest = match rest {
        [dd, rest @ ..] if dd == "--" => rest,
        _ => rest,
    };
    let [program, pargs @ ..] = rest else {
        return Err("no program".into());
    };
    let (i, n) = host_index(name, host)?;
    let err = oxccl_testbed::host_command(name, i, n, program)
        .map_err(|e| e.to_string())?
        .args(pargs)
        .exec();
    Err(format!("exec: {err}"))
}

fn rate(args: &[String]) -> Result<(), String> {
    let [name, host, r] = args else {
        return Err("usage: rate NAME HOST RATE".into());
    };
    // The bucket and queue follow the default shaping (the bed's own is not recorded).
    let (i, _) = host_index(name, host)?;
    let rate = parse_rate(r)?;
    oxccl_testbed::reshape(name, i, rate, oxccl_testbed::Shaping::default())
        .map_err(|e| e.to_string())
}

fn list() -> Result<(), String> {
    for b in oxccl_testbed::list().map_err(|e| e.to_string())? {
        let state = if b.owner_alive { "alive" } else { "gone" };
        println!(
            "{}\towner {} ({state})\t{} hosts",
            b.name, b.owner_pid, b.hosts
        );
    }
    Ok(())
}

fn num<T: std::str::FromStr>(s: &str, what: &str) -> Result<T, String> {
    s.parse().map_err(|_| format!("bad {what} `{s}`"))
}

/// Connects, retrying while the server is not up yet (for up to 10 s).
fn connect(addr: &str) -> Result<TcpStream, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline && retryable(&e) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => return Err(format!("connect {addr}: {e}")),
        }
    }
}

fn retryable(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable
    )
}

fn echo_server(args: &[String]) -> Result<(), String> {
    let port: u16 = num(args.first().ok_or("no port")?, "port")?;
    let conns: usize = args.get(1).map_or(Ok(1), |s| num(s, "count"))?;
    let l = TcpListener::bind(("0.0.0.0", port)).map_err(|e| format!("bind: {e}"))?;
    for _ in 0..conns {
        let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
        let mut buf = [0u8; 64 * 1024];
        loop {
            let n = s.read(&mut buf).map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n]).map_err(|e| format!("write: {e}"))?;
        }
    }
    Ok(())
}

fn echo_client(args: &[String]) -> Result<(), String> {
    let [addr, msg] = args else {
        return Err("usage: tcp-echo-client ADDR:PORT MESSAGE".into());
    };
    let mut s = connect(addr)?;
    let local = s.local_addr().map_err(|e| e.to_string())?;
    s.write_all(msg.as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
    let mut back = Vec::new();
    s.read_to_end(&mut back).map_err(|e| format!("read: {e}"))?;
    if back != msg.as_bytes() {
        return Err(format!(
            "echo mismatch: sent {} bytes, got {:?}",
            msg.len(),
            String::from_utf8_lossy(&back)
        ));
    }
    println!("echo ok {} bytes {local} -> {addr}", back.len());
    Ok(())
}

fn sink(args: &[String]) -> Result<(), String> {
    let port: u16 = num(args.first().ok_or("no port")?, "port")?;
    let warmup: f64 = args.get(1).map_or(Ok(0.2), |s| num(s, "warm-up"))?;
    let l = TcpListener::bind(("0.0.0.0", port)).map_err(|e| format!("bind: {e}"))?;
    let (mut s, peer) = l.accept().map_err(|e| format!("accept: {e}"))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    let mut start: Option<Instant> = None;
    let mut mark: Option<(Instant, u64)> = None;
    loop {
        let n = s.read(&mut buf).map_err(|e| format!("read: {e}"))?;
        let now = Instant::now();
        if n == 0 {
            break;
        }
        total += n as u64;
        let t0 = *start.get_or_insert(now);
        if mark.is_none() && (now - t0).as_secs_f64() >= warmup {
            mark = Some((now, total));
        }
    }
    let end = Instant::now();
    let (t, bytes) = match mark {
        Some((t, b)) => (t, total - b),
        None => return Err(format!("stream shorter than the {warmup} s warm-up")),
    };
    let secs = (end - t).as_secs_f64();
    println!(
        "from={peer} bytes={bytes} secs={secs:.3} mbit_per_s={:.1}",
        bytes as f64 * 8.0 / secs / 1e6
    );
    Ok(())
}

fn source(args: &[String]) -> Result<(), String> {
    let [addr, secs] = args else {
        return Err("usage: tcp-source ADDR:PORT SECS".into());
    };
    let secs: f64 = num(secs, "seconds")?;
    let mut s = connect(addr)?;
    let buf = vec![0x5au8; 256 * 1024];
    let end = Instant::now() + Duration::from_secs_f64(secs);
    while Instant::now() < end {
        s.write_all(&buf).map_err(|e| format!("write: {e}"))?;
    }
    s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
    // Wait for the sink to close, so that the data has arrived when we exit.
    let _ = s.read(&mut [0u8; 1]);
    Ok(())
}

/// `mitm LISTEN TARGET CAPTURE [FLIP_AT]`: oxccl-seal's proxy (the one the tests use in
/// process) inside a host, writing what it forwarded to CAPTURE every 100 ms.
fn mitm(args: &[String]) -> Result<(), String> {
    use oxccl_seal::mitm::{Plan, Proxy, Tamper, Toward};
    let [listen, target, capture, rest @ ..] = args else {
        return Err("usage: mitm LISTEN TARGET CAPTURE [FLIP_AT]".into());
    };
    let addr = |s: &str| {
        s.parse::<std::net::SocketAddr>()
            .map_err(|e| format!("`{s}`: {e}"))
    };
    let tamper = match rest.first() {
        Some(o) => Tamper::FlipAt {
            offset: o.parse().map_err(|e| format!("FLIP_AT `{o}`: {e}"))?,
        },
        None => Tamper::None,
    };
    let proxy = Proxy::start_on(
        addr(listen)?,
        addr(target)?,
        Plan::new(tamper, Toward::Target),
    )
    .map_err(|e| format!("listening on {listen}: {e}"))?;
    println!("mitm: listening on {}", proxy.addr());
    let mut written = 0;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let bytes = proxy.captured();
        if bytes.len() > written {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(capture)
                .map_err(|e| format!("{capture}: {e}"))?;
            f.write_all(&bytes[written..])
                .map_err(|e| format!("{capture}: {e}"))?;
            written = bytes.len();
        }
        if proxy.tampered() && !std::path::Path::new(&format!("{capture}.tampered")).exists() {
            std::fs::write(format!("{capture}.tampered"), b"")
                .map_err(|e| format!("{capture}.tampered: {e}"))?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_rate;

    #[test]
    fn rates() {
        assert_eq!(parse_rate("1000"), Ok(Some(1000)));
        assert_eq!(parse_rate("250m"), Ok(Some(250)));
        assert_eq!(parse_rate("1g"), Ok(Some(1000)));
        assert_eq!(parse_rate("0.25G"), Ok(Some(250)));
        assert_eq!(parse_rate("none"), Ok(None));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("x").is_err());
    }
}
