//! The key-value metadata backends against real servers: a `redis-server` started for each test
//! on a free loopback port (Debian's, `--save '' --appendonly no`, in a temporary directory),
//! and an oxccl store server (`oxccl_bootstrap::StoreServer`) in this process.
//!
//! The test bodies are written once, over [`Backend`]; `redis::*` and `store::*` run them.
//! Without `redis-server` on the machine (or at `$OXCCL_TEST_REDIS_SERVER`) the Redis tests say
//! so and pass, except under `CI=true`, where they fail.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use oxccl_bootstrap::{Secret, StoreServer};
use oxccl_kv::meta::{Metadata, RedisMetadata, StoreMetadata, segment_key};
use oxccl_kv::{BufferDesc, DESC_FORMAT, Error, SegmentDesc};

/// How long the backends wait to connect and, for Redis, for each reply.
const TIMEOUT: Duration = Duration::from_millis(500);

/// How much later than its bound a call may return on this (shared, small) machine.
const SLACK: Duration = Duration::from_millis(500);

fn desc(name: &str, version: u64) -> SegmentDesc {
    SegmentDesc {
        format: DESC_FORMAT,
        name: name.into(),
        version,
        handshake: "127.0.0.1:4321".into(),
        host: "boot-id".into(),
        providers: vec!["shm".into(), "tcp".into()],
        buffers: vec![BufferDesc {
            addr: 0x1000 * (version % 1000 + 1),
            len: 4096,
            rkeys: vec![("shm".into(), version), ("tcp".into(), 7)],
        }],
    }
}

/// A port nothing listens on (bound, then released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A fresh temporary directory, removed by [`RedisServer`]'s drop.
fn temp_dir() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "oxccl-kv-metadata-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    dir
}

/// Asserts that `e` is an [`Error::Metadata`] about `backend`.
fn assert_metadata_error<T>(r: oxccl_kv::Result<T>, backend: &str, what: &str) {
    match r {
        Err(Error::Metadata { backend: b, detail }) => {
            eprintln!("{what}: {detail}");
            assert_eq!(b, backend, "{what}: {detail}");
            assert!(!detail.is_empty(), "{what}");
        }
        Err(e) => panic!("{what}: expected Error::Metadata about {backend}, got {e:?}"),
        Ok(_) => panic!("{what}: expected Error::Metadata about {backend}, got Ok"),
    }
}

// ---------------------------------------------------------------------------------------------
// The servers.

/// A `redis-server` child process on a loopback port; killed (and its directory removed) on
/// drop, whether the test passed or not.
struct RedisServer {
    bin: PathBuf,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl RedisServer {
    /// Where `redis-server` is, if anywhere: `$OXCCL_TEST_REDIS_SERVER` when set, else on
    /// `PATH` or in /usr/bin.
    fn binary() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os("OXCCL_TEST_REDIS_SERVER") {
            return Some(PathBuf::from(p)).filter(|p| p.is_file());
        }
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .map(|d| d.join("redis-server"))
            .chain([PathBuf::from("/usr/bin/redis-server")])
            .find(|p| p.is_file())
    }

    /// A server on a free port; `None` (after saying why) when there is no `redis-server`,
    /// and a failure then under `CI=true`.
    fn start() -> Option<RedisServer> {
        let Some(bin) = RedisServer::binary() else {
            let why = "redis-server is not installed (Debian: apt-get install redis-server)";
            if std::env::var("CI").is_ok_and(|v| matches!(v.trim(), "true" | "1")) {
                panic!("{why}: CI must run the Redis metadata tests");
            }
            eprintln!("skipping the Redis metadata test: {why}");
            return None;
        };
        let dir = temp_dir();
        let mut server = RedisServer {
            bin,
            port: 0,
            dir,
            child: None,
        };
        // Another process may take the port between our probe and redis' bind: try others.
        for attempt in 1..=5 {
            server.port = free_port();
            match server.spawn() {
                Ok(()) => return Some(server),
                Err(e) if attempt < 5 => eprintln!("redis-server on {}: {e}", server.port),
                Err(e) => panic!("redis-server did not start: {e}"),
            }
        }
        unreachable!()
    }

    /// Starts redis-server on `self.port` and waits until it accepts connections.
    fn spawn(&mut self) -> Result<(), String> {
        let log = self.dir.join("redis.log");
        let _ = std::fs::remove_file(&log);
        let mut child = Command::new(&self.bin)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(&log)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawning {}: {e}", self.bin.display()))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("Ready to accept connections") {
                self.child = Some(child);
                return Ok(());
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("exited ({status}): {}", tail(&text)));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("not ready within 10 s: {}", tail(&text)));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Kills the server (SIGKILL) and reaps it.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills the server and starts an empty one on the same port.
    fn restart(&mut self) {
        self.kill();
        self.spawn()
            .unwrap_or_else(|e| panic!("redis-server did not restart on {}: {e}", self.port));
    }

    /// Sends `signal` to the server (SIGSTOP: it hangs; SIGCONT: it goes on).
    fn signal(&self, signal: i32) {
        let pid = self.pid();
        assert!(pid > 0, "no redis-server running");
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "kill({pid}, {signal})");
    }
}

/// Sends commands to the Redis server on `port`, in order on one connection of its own, and
/// returns the replies, which must be one line each (`+OK`, `-ERR ...`).
fn raw(port: u16, cmds: &[&[&str]]) -> Vec<String> {
    use std::io::{BufRead, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to redis");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = String::new();
    for args in cmds {
        out += &format!("*{}\r\n", args.len());
        for a in *args {
            out += &format!("${}\r\n{a}\r\n", a.len());
        }
    }
    s.write_all(out.as_bytes()).expect("send to redis");
    let mut r = std::io::BufReader::new(s);
    cmds.iter()
        .map(|_| {
            let mut line = String::new();
            r.read_line(&mut line).expect("a reply from redis");
            line.trim_end().to_string()
        })
        .collect()
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ---------------------------------------------------------------------------------------------
// The backends, behind one interface for the test bodies.

trait Backend {
    /// A new client of the server.
    fn connect(&self) -> Box<dyn Metadata>;
    /// A client's idea of where the server is (its `describe()`).
    fn location(&self) -> String;
    /// Stops the server and starts an empty one at the same address.
    fn restart(&mut self);
    /// Stops the server for good.
    fn stop(&mut self);
    /// Connecting to `port`, where nothing listens; and the location errors should name.
    fn connect_to_nothing(&self, port: u16) -> (oxccl_kv::Result<Box<dyn Metadata>>, String);
    /// How long a call may take when the server is gone (its reconnect's timeout).
    fn dead_call_bound(&self) -> Duration;
}

struct RedisBackend {
    server: RedisServer,
}

impl RedisBackend {
    fn start() -> Option<RedisBackend> {
        RedisServer::start().map(|server| RedisBackend { server })
    }
}

impl Backend for RedisBackend {
    fn connect(&self) -> Box<dyn Metadata> {
        Box::new(RedisMetadata::connect(&self.server.url(), TIMEOUT).expect("connect to redis"))
    }
    fn location(&self) -> String {
        self.server.url()
    }
    fn restart(&mut self) {
        self.server.restart();
    }
    fn stop(&mut self) {
        self.server.kill();
    }
    fn connect_to_nothing(&self, port: u16) -> (oxccl_kv::Result<Box<dyn Metadata>>, String) {
        let r = RedisMetadata::connect(&format!("127.0.0.1:{port}"), TIMEOUT);
        (
            r.map(|m| Box::new(m) as Box<dyn Metadata>),
            format!("redis://127.0.0.1:{port}/0"),
        )
    }
    fn dead_call_bound(&self) -> Duration {
        TIMEOUT
    }
}

struct StoreBackend {
    secret: Secret,
    addr: SocketAddr,
    server: Option<StoreServer>,
}

impl StoreBackend {
    fn start() -> Option<StoreBackend> {
        let secret = Secret::new(b"oxccl-kv metadata test secret".to_vec()).expect("a secret");
        let server = StoreServer::bind("127.0.0.1:0", secret.clone()).expect("bind a store");
        Some(StoreBackend {
            secret,
            addr: server.addr(),
            server: Some(server),
        })
    }
}

impl Backend for StoreBackend {
    fn connect(&self) -> Box<dyn Metadata> {
        Box::new(
            StoreMetadata::connect(&self.addr.to_string(), &self.secret, TIMEOUT)
                .expect("connect to the store"),
        )
    }
    fn location(&self) -> String {
        format!("oxccl store at {}", self.addr)
    }
    fn restart(&mut self) {
        self.stop();
        let server = StoreServer::bind(&self.addr.to_string(), self.secret.clone())
            .unwrap_or_else(|e| panic!("a new store on {}: {e}", self.addr));
        self.server = Some(server);
    }
    fn stop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
    }
    fn connect_to_nothing(&self, port: u16) -> (oxccl_kv::Result<Box<dyn Metadata>>, String) {
        let addr = format!("127.0.0.1:{port}");
        let r = StoreMetadata::connect(&addr, &self.secret, TIMEOUT);
        (
            r.map(|m| Box::new(m) as Box<dyn Metadata>),
            format!("oxccl store at {addr}"),
        )
    }
    fn dead_call_bound(&self) -> Duration {
        // StoreMetadata's reconnect retries for 1 s.
        Duration::from_secs(1)
    }
}

// ---------------------------------------------------------------------------------------------
// The test bodies.

/// publish / lookup / present / remove, and a lookup of a missing name that times out.
fn round_trip(b: &mut dyn Backend) {
    let m = b.connect();
    assert_eq!(m.describe(), b.location());
    let d3 = desc("node-a", 3);
    m.publish(&d3).unwrap();
    assert_eq!(m.lookup("node-a", Duration::ZERO).unwrap(), d3);
    assert_eq!(m.lookup("node-a", Duration::from_secs(1)).unwrap(), d3);
    assert!(m.present("node-a", 3).unwrap());
    assert!(m.present("node-a", 0).unwrap());
    assert!(!m.present("node-a", 4).unwrap());
    assert!(!m.present("node-b", 0).unwrap());

    // Another client sees it, and a newer version replaces it.
    let other = b.connect();
    assert_eq!(other.lookup("node-a", Duration::ZERO).unwrap(), d3);
    let d4 = desc("node-a", 4);
    other.publish(&d4).unwrap();
    assert_eq!(m.lookup("node-a", Duration::ZERO).unwrap(), d4);
    assert!(m.present("node-a", 4).unwrap());

    m.remove("node-a").unwrap();
    assert!(!m.present("node-a", 0).unwrap());
    assert!(!other.present("node-a", 0).unwrap());
    m.remove("node-a").unwrap(); // removing a missing one is fine

    let timeout = Duration::from_millis(300);
    let t = Instant::now();
    let e = m.lookup("node-a", timeout).unwrap_err();
    let took = t.elapsed();
    match &e {
        Error::SegmentNotFound { name, backend, .. } => {
            assert_eq!(name, "node-a");
            assert_eq!(backend, &b.location());
        }
        e => panic!("expected SegmentNotFound, got {e:?}"),
    }
    let text = e.to_string();
    assert!(text.contains(&segment_key("node-a")), "{text}");
    assert!(text.contains(&b.location()), "{text}");
    assert!(
        took >= timeout,
        "gave up after {took:?}, before {timeout:?}"
    );
    assert!(
        took < timeout + SLACK,
        "gave up after {took:?} (timeout {timeout:?})"
    );

    let t = Instant::now();
    let e = m.lookup("node-z", Duration::ZERO).unwrap_err();
    assert!(matches!(e, Error::SegmentNotFound { .. }), "{e:?}");
    assert!(t.elapsed() < SLACK, "{:?}", t.elapsed());
}

/// A lookup waits for a descriptor that another thread (another client) publishes later.
fn lookup_waits_for_a_later_publish(b: &mut dyn Backend) {
    let m = b.connect();
    let publisher: Arc<dyn Metadata> = Arc::from(b.connect());
    let d = desc("late", 1);
    let delay = Duration::from_millis(300);
    let t = Instant::now();
    let p = {
        let d = d.clone();
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            publisher.publish(&d)
        })
    };
    let got = m.lookup("late", Duration::from_secs(10)).unwrap();
    let took = t.elapsed();
    p.join().unwrap().unwrap();
    assert_eq!(got, d);
    assert!(
        took >= delay,
        "found after {took:?}, before it was published"
    );
    assert!(took < delay + SLACK, "found only after {took:?}");
}

/// Publishing an older version does not replace a newer one, whatever the order and however
/// large the versions (compared exactly, not as doubles).
fn older_does_not_overwrite_newer(b: &mut dyn Backend) {
    let m = b.connect();
    m.publish(&desc("s", 5)).unwrap();
    m.publish(&desc("s", 3)).unwrap(); // kept the newer one: not an error
    assert_eq!(m.lookup("s", Duration::ZERO).unwrap(), desc("s", 5));
    assert!(m.present("s", 5).unwrap());
    m.publish(&desc("s", 5)).unwrap(); // the same version again is fine
    m.publish(&desc("s", 10)).unwrap(); // "10" < "5" as text: compared as numbers
    assert_eq!(m.lookup("s", Duration::ZERO).unwrap().version, 10);
    m.publish(&desc("s", 9)).unwrap();
    assert_eq!(m.lookup("s", Duration::ZERO).unwrap().version, 10);

    // Versions that are equal as doubles.
    let big = u64::MAX - 1;
    m.publish(&desc("big", big)).unwrap();
    m.publish(&desc("big", big - 1)).unwrap();
    assert_eq!(m.lookup("big", Duration::ZERO).unwrap().version, big);
    m.publish(&desc("big", u64::MAX)).unwrap();
    assert_eq!(m.lookup("big", Duration::ZERO).unwrap().version, u64::MAX);

    // Racing publishers, each with its own connection: the newest wins.
    let writers: Vec<_> = (0..4u64)
        .map(|w| {
            let m = b.connect();
            std::thread::spawn(move || {
                for i in 0..25u64 {
                    // Each writer its share of 1..=100, in a scrambled order.
                    m.publish(&desc("race", 1 + w + 4 * ((i * 7) % 25)))
                        .unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    assert_eq!(m.lookup("race", Duration::ZERO).unwrap().version, 100);
}

/// The server restarts empty: the next `present` says no, publishing works again, and the
/// descriptor is found.
fn restart_empties_and_republish_works(b: &mut dyn Backend) {
    let m = b.connect();
    let d = desc("node-r", 7);
    m.publish(&d).unwrap();
    assert!(m.present("node-r", 7).unwrap());

    b.restart();
    assert!(
        !m.present("node-r", 7).unwrap(),
        "a restarted server is empty"
    );
    m.publish(&d).unwrap();
    assert!(m.present("node-r", 7).unwrap());
    assert_eq!(m.lookup("node-r", Duration::from_secs(1)).unwrap(), d);

    // Every kind of call reconnects, not only present.
    b.restart();
    m.publish(&d).unwrap();
    assert_eq!(b.connect().lookup("node-r", Duration::ZERO).unwrap(), d);
    b.restart();
    assert!(matches!(
        m.lookup("node-r", Duration::ZERO),
        Err(Error::SegmentNotFound { .. })
    ));
    b.restart();
    m.remove("node-r").unwrap();
}

/// A server that is not there: connecting fails within the timeout, and once connected, every
/// call fails promptly with `Error::Metadata` (no hang), a lookup included.
fn dead_server_is_an_error_not_a_hang(b: &mut dyn Backend) {
    let port = free_port();
    let t = Instant::now();
    let (r, loc) = b.connect_to_nothing(port);
    let took = t.elapsed();
    assert_metadata_error(r, &loc, "connect to nothing");
    assert!(
        took < TIMEOUT + SLACK,
        "connecting to nothing took {took:?}"
    );

    let m = b.connect();
    m.publish(&desc("gone", 1)).unwrap();
    b.stop();
    let bound = b.dead_call_bound() + SLACK;
    let loc = b.location();
    let t = Instant::now();
    assert_metadata_error(m.present("gone", 1), &loc, "present");
    assert!(t.elapsed() < bound, "present took {:?}", t.elapsed());
    let t = Instant::now();
    assert_metadata_error(m.lookup("gone", Duration::from_secs(30)), &loc, "lookup");
    assert!(t.elapsed() < bound, "lookup took {:?}", t.elapsed());
    let t = Instant::now();
    assert_metadata_error(m.publish(&desc("gone", 2)), &loc, "publish");
    assert_metadata_error(m.remove("gone"), &loc, "remove");
    assert!(
        t.elapsed() < 2 * bound,
        "publish+remove took {:?}",
        t.elapsed()
    );
}

/// Runs each body against both backends: `redis::NAME` and `store::NAME`.
macro_rules! for_both_backends {
    ($($body:ident),* $(,)?) => {
        mod redis {
            $(
                #[test]
                fn $body() {
                    if let Some(mut b) = super::RedisBackend::start() {
                        super::$body(&mut b);
                    }
                }
            )*
        }
        mod store {
            $(
                #[test]
                fn $body() {
                    if let Some(mut b) = super::StoreBackend::start() {
                        super::$body(&mut b);
                    }
                }
            )*
        }
    };
}

for_both_backends!(
    round_trip,
    lookup_waits_for_a_later_publish,
    restart_empties_and_republish_works,
    dead_server_is_an_error_not_a_hang,
);

#[test]
fn redis_older_does_not_overwrite_newer() {
    if let Some(mut b) = RedisBackend::start() {
        older_does_not_overwrite_newer(&mut b);
    }
}

#[test]
fn store_older_does_not_overwrite_newer() {
    if let Some(mut b) = StoreBackend::start() {
        older_does_not_overwrite_newer(&mut b);
    }
}

// ---------------------------------------------------------------------------------------------
// Redis only.

/// A server that hangs (SIGSTOP) makes calls fail within the I/O timeout; once it goes on
/// (SIGCONT), the next call works on a fresh connection.
#[test]
fn redis_hung_server_times_out_then_recovers() {
    let Some(b) = RedisBackend::start() else {
        return;
    };
    let m = b.connect();
    m.publish(&desc("h", 1)).unwrap();
    b.server.signal(libc::SIGSTOP);
    let t = Instant::now();
    let r = m.present("h", 1);
    let took = t.elapsed();
    b.server.signal(libc::SIGCONT);
    assert_metadata_error(r, &b.location(), "present on a stopped server");
    assert!(
        took >= TIMEOUT,
        "failed after {took:?}, before the I/O timeout"
    );
    assert!(took < TIMEOUT + SLACK, "took {took:?}");
    assert!(m.present("h", 1).unwrap());
    assert_eq!(m.lookup("h", Duration::ZERO).unwrap(), desc("h", 1));
}

/// Something listens but never answers: connecting fails within the timeout.
#[test]
fn redis_silent_listener_fails_within_the_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let t = Instant::now();
    let r = RedisMetadata::connect(&format!("127.0.0.1:{port}"), TIMEOUT);
    let took = t.elapsed();
    assert_metadata_error(r, &format!("redis://127.0.0.1:{port}/0"), "silent listener");
    assert!(took < TIMEOUT + SLACK, "took {took:?}");
    drop(listener);
}

/// URLs: `host:port`, a database number, and errors that name the server.
#[test]
fn redis_urls_and_databases() {
    let Some(b) = RedisBackend::start() else {
        return;
    };
    let port = b.server.port;
    let plain = RedisMetadata::connect(&format!("127.0.0.1:{port}"), TIMEOUT).unwrap();
    assert_eq!(plain.describe(), format!("redis://127.0.0.1:{port}/0"));
    let db2 = RedisMetadata::connect(&format!("redis://127.0.0.1:{port}/2"), TIMEOUT).unwrap();
    assert_eq!(db2.describe(), format!("redis://127.0.0.1:{port}/2"));
    plain.publish(&desc("db", 1)).unwrap();
    assert!(plain.present("db", 1).unwrap());
    assert!(!db2.present("db", 1).unwrap(), "databases are separate");

    let e = RedisMetadata::connect("not a url at all://", TIMEOUT).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");

    // A value that is not a descriptor: lookup says so, present says no, publish replaces it.
    assert_eq!(
        raw(port, &[&["SET", &segment_key("junk"), "not json"]]),
        ["+OK"]
    );
    let e = plain.lookup("junk", Duration::ZERO).unwrap_err();
    assert!(matches!(e, Error::Metadata { .. }), "{e:?}");
    assert!(!plain.present("junk", 0).unwrap());
    plain.publish(&desc("junk", 1)).unwrap();
    assert_eq!(
        plain.lookup("junk", Duration::ZERO).unwrap(),
        desc("junk", 1)
    );
}

/// A password (`requirepass`) and an ACL user: both authenticate, a wrong password is an
/// `Error::Metadata` naming AUTH (and not the password), and a reconnect authenticates again.
#[test]
fn redis_passwords_and_acl_users() {
    let Some(mut b) = RedisBackend::start() else {
        return;
    };
    let port = b.server.port;
    let require = |port| {
        let set = ["CONFIG", "SET", "requirepass", "s3cret"];
        assert_eq!(raw(port, &[&set]), ["+OK"]);
    };
    require(port);
    let loc = format!("redis://127.0.0.1:{port}/0");

    let e = RedisMetadata::connect(&format!("127.0.0.1:{port}"), TIMEOUT).map(|_| ());
    assert_metadata_error(e, &loc, "no password");
    let e = RedisMetadata::connect(&format!("redis://:wrong-pw@127.0.0.1:{port}/0"), TIMEOUT);
    match e {
        Err(Error::Metadata { detail, .. }) => {
            assert!(detail.contains("AUTH"), "{detail}");
            assert!(!detail.contains("wrong-pw"), "{detail}");
        }
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("a wrong password was accepted"),
    }

    let m = RedisMetadata::connect(&format!("redis://:s3cret@127.0.0.1:{port}/0"), TIMEOUT)
        .expect("the right password");
    assert_eq!(m.describe(), loc, "the location shows no password");
    m.publish(&desc("p", 1)).unwrap();
    b.server.restart();
    require(port);
    assert!(!m.present("p", 1).unwrap(), "reconnected with the password");
    m.publish(&desc("p", 2)).unwrap();

    // A user allowed only what the backend does, on its keys.
    let acl = [
        "ACL",
        "SETUSER",
        "engine",
        "on",
        ">pw2",
        "~oxccl-kv/*",
        "+get",
        "+set",
        "+del",
        "+eval",
        "+ping",
        "+select",
        "+auth",
    ];
    assert_eq!(raw(port, &[&["AUTH", "s3cret"], &acl]), ["+OK", "+OK"]);
    let user = RedisMetadata::connect(&format!("redis://engine:pw2@127.0.0.1:{port}/0"), TIMEOUT)
        .expect("an ACL user");
    assert_eq!(user.lookup("p", Duration::ZERO).unwrap(), desc("p", 2));
    user.publish(&desc("p", 3)).unwrap();
    assert!(m.present("p", 3).unwrap());
}

/// The whole story of a metadata server that restarts empty: the live engine publishes its
/// descriptor again on its own (within its republish period), and a peer that starts afterwards
/// opens the segment and moves data (Mooncake's users lost every segment: its issue #2246).
fn engines_publish_again_after_a_restart(b: &mut dyn Backend) {
    use oxccl_kv::{EngineConfig, Opcode, TransferEngine, TransferRequest};
    let config = |name: &str| {
        let mut c = EngineConfig::new(Secret::new("engine-restart-secret-1").unwrap());
        c.name = Some(name.into());
        c.republish_every = Duration::from_millis(200);
        c.timeout = Duration::from_secs(5);
        c
    };
    let owner = TransferEngine::new(config("owner"), Arc::from(b.connect())).unwrap();
    let buf = owner.allocate_managed_buffer(1 << 20).unwrap();
    owner.write_local(buf, &[0x3c; 1 << 20]).unwrap();
    let probe = b.connect();
    assert!(probe.lookup("owner", TIMEOUT).is_ok());
    b.restart();
    // The keeper notices within a few periods; the fresh server holds the current version.
    let t = Instant::now();
    let desc = loop {
        match probe.lookup("owner", Duration::from_millis(100)) {
            Ok(d) => break d,
            Err(_) if t.elapsed() < Duration::from_secs(5) => continue,
            Err(e) => panic!("{}: not published again within 5 s: {e}", b.location()),
        }
    };
    assert_eq!(desc, owner.descriptor(), "{}", b.location());
    eprintln!(
        "{}: published again {:?} after the restart",
        b.location(),
        t.elapsed()
    );
    let peer = TransferEngine::new(config("peer"), Arc::from(b.connect())).unwrap();
    let local = peer.allocate_managed_buffer(1 << 20).unwrap();
    let seg = peer.open_segment("owner").unwrap();
    peer.transfer_sync(
        &[TransferRequest {
            opcode: Opcode::Read,
            source: local,
            target_id: seg,
            target_offset: buf,
            length: 1 << 20,
        }],
        None,
    )
    .unwrap();
    let mut got = vec![0; 1 << 20];
    peer.read_local(local, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 0x3c));
    // Closing an engine removes its descriptor.
    drop(owner);
    assert!(matches!(
        probe.lookup("owner", Duration::from_millis(100)),
        Err(Error::SegmentNotFound { .. })
    ));
}

#[test]
fn redis_engines_publish_again_after_a_restart() {
    if let Some(mut b) = RedisBackend::start() {
        engines_publish_again_after_a_restart(&mut b);
    }
}

#[test]
fn store_engines_publish_again_after_a_restart() {
    if let Some(mut b) = StoreBackend::start() {
        engines_publish_again_after_a_restart(&mut b);
    }
}
