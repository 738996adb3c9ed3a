//! Redis as a metadata backend.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::{Client, Connection, ConnectionAddr, RedisError};

use super::{Metadata, segment_key};
use crate::desc::SegmentDesc;
use crate::error::{Error, Result};

/// Publishes a descriptor unless the key holds a newer version.
///
/// `KEYS[1]`: the segment's key; `ARGV[1]`: the descriptor (JSON); `ARGV[2]`: its version, in
/// decimal. The stored version is read from the stored JSON's `"version":N` field and compared
/// as a decimal string (exact for every `u64`, which Lua's doubles are not). A stored value
/// without a readable version is replaced. Returns 1 when `ARGV[1]` was stored, 0 when a newer
/// descriptor was kept.
const PUBLISH_SCRIPT: &str = r#"
local function greater(a, b)
  if #a ~= #b then return #a > #b end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x > y end
  end
  return false
end
local cur = redis.call('GET', KEYS[1])
if cur then
  local v = string.match(cur, '"version"%s*:%s*(%d+)')
  if v then
    v = string.gsub(v, '^0+(%d)', '%1')
    if greater(v, ARGV[2]) then return 0 end
  end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"#;

/// The longest pause between two polls of a [`lookup`](Metadata::lookup).
const MAX_POLL: Duration = Duration::from_millis(50);

/// The shortest connect and I/O timeout (a zero one would mean "none" to the socket).
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// Descriptors kept in a Redis (or Valkey) server under `oxccl-kv/segment/NAME`, as the
/// descriptor's JSON bytes.
///
/// - Every call is bounded: connecting and each command's reads and writes time out after the
///   timeout given to [`RedisMetadata::connect`], so a dead or hung server is an
///   [`Error::Metadata`] naming the server and what failed, never a hang.
/// - It reconnects by itself: a call that finds its connection broken (the server restarted
///   or dropped it) connects again and is retried once, so the first call after a restart
///   works. A restarted server is empty unless it persists: [`Metadata::present`] then says
///   no, and the engines' keepers publish again.
/// - [`Metadata::publish`] never lets an older descriptor replace a newer one: a small Lua
///   script compares versions and sets the key atomically.
/// - [`Metadata::lookup`] polls, with a back-off from 2 ms to 50 ms, until the descriptor
///   appears or the timeout passes.
///
/// Calls from several threads share one connection and take turns.
pub struct RedisMetadata {
    /// Connects only: no credentials, database 0, no `CLIENT SETINFO` (the setup is ours, so
    /// that all of it stays within the timeout).
    client: Client,
    /// `AUTH` arguments (username, password), when the URL has a password.
    auth: Option<(Option<String>, String)>,
    db: i64,
    conn: Mutex<Option<Connection>>,
    timeout: Duration,
    location: String,
}

impl std::fmt::Debug for RedisMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisMetadata")
            .field("location", &self.location)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// `url` with a scheme (`host:port` becomes `redis://host:port`).
fn with_scheme(url: &str) -> String {
    if url.contains("://") {
        url.to_string()
    } else {
        format!("redis://{url}")
    }
}

/// `url` with any password replaced by `***`, for messages about a URL that did not parse.
fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let auth_end = rest.find('/').unwrap_or(rest.len());
    match rest[..auth_end].rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => url.to_string(),
    }
}

/// The server's address as a URL without credentials (`redis://127.0.0.1:6379/0`).
fn location(addr: &ConnectionAddr, db: i64) -> String {
    match addr {
        ConnectionAddr::Unix(path) => format!("redis+unix://{}?db={db}", path.display()),
        ConnectionAddr::TcpTls { host, port, .. } => format!("rediss://{host}:{port}/{db}"),
        addr => format!("redis://{addr}/{db}"),
    }
}

/// Whether `e` means the connection is broken (the server went away or restarted): the call
/// may be retried on a fresh connection.
fn broken(e: &RedisError) -> bool {
    e.is_connection_dropped() || e.is_connection_refusal()
}

/// Whether the connection that gave `e` can no longer be trusted (broken, or a reply that
/// timed out and may still arrive, or one that did not parse).
fn unusable(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_unrecoverable_error()
}

impl RedisMetadata {
    /// Connects to the Redis server at `url`: `redis://[user:password@]host:port/db`,
    /// `redis+unix:///path/to/socket?db=N`, or just `host:port` (database 0). TLS
    /// (`rediss://`) is not built in.
    ///
    /// `timeout` bounds every call: while nothing listens at the address, connecting is
    /// retried until `timeout` has passed, and connecting as a whole (TCP, `AUTH`, `SELECT`,
    /// a `PING`) ends within about `timeout`; afterwards, each reconnect takes at most
    /// `timeout`, and each command's reads and writes time out after `timeout` (at least
    /// 1 ms). A bad URL is an [`Error::InvalidArgument`]; a server that cannot be reached,
    /// does not answer or refuses us is an [`Error::Metadata`] naming the server and the step
    /// that failed.
    pub fn connect(url: &str, timeout: Duration) -> Result<RedisMetadata> {
        let full = with_scheme(url);
        let info = redis::IntoConnectionInfo::into_connection_info(full.as_str()).map_err(|e| {
            Error::arg(format!(
                "{:?} is not a Redis URL (redis://host:port/db or host:port): {e}",
                redacted(&full)
            ))
        })?;
        let settings = info.redis_settings().clone();
        let db = settings.db();
        let auth = settings
            .password()
            .map(|p| (settings.username().map(str::to_string), p.to_string()));
        let location = location(info.addr(), db);
        let bare = info.set_redis_settings(
            redis::RedisConnectionInfo::default()
                .set_protocol(redis::ProtocolVersion::RESP2)
                .set_skip_set_lib_name(),
        );
        let client = Client::open(bare).map_err(|e| Error::Metadata {
            backend: location.clone(),
            detail: format!("setting up the client failed: {e}"),
        })?;
        let me = RedisMetadata {
            client,
            auth,
            db,
            conn: Mutex::new(None),
            timeout: timeout.max(MIN_TIMEOUT),
            location,
        };
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(5);
        let conn = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match me.open(left) {
                Ok(c) => break c,
                Err((_, e)) if e.is_connection_refusal() && !left.is_zero() => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    std::thread::sleep(pause.min(left));
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                Err((step, e)) if e.is_connection_refusal() => {
                    return Err(me.fail(&format!("{step} (retried for {timeout:?})"), &e));
                }
                Err((step, e)) => return Err(me.fail(&step, &e)),
            }
        };
        *me.conn() = Some(conn);
        Ok(me)
    }

    /// A fresh connection, authenticated, on our database, that answered a `PING`, all within
    /// `budget` (at least 1 ms); then with the I/O timeouts set. An error says which step
    /// failed.
    fn open(&self, budget: Duration) -> Result<Connection, (String, RedisError)> {
        let budget = budget.max(MIN_TIMEOUT);
        let start = Instant::now();
        let left = || budget.saturating_sub(start.elapsed()).max(MIN_TIMEOUT);
        let mut conn = self
            .client
            .get_connection_with_timeout(budget)
            .map_err(|e| ("connecting".to_string(), e))?;
        let step = |what: String, cmd: redis::Cmd, conn: &mut Connection| {
            conn.set_read_timeout(Some(left()))
                .and_then(|()| conn.set_write_timeout(Some(left())))
                .and_then(|()| cmd.query::<redis::Value>(conn))
                .map(|_| ())
                .map_err(|e| (what, e))
        };
        if let Some((user, password)) = &self.auth {
            let mut auth = redis::cmd("AUTH");
            if let Some(u) = user {
                auth.arg(u);
            }
            auth.arg(password);
            step("AUTH".into(), auth, &mut conn)?;
        }
        if self.db != 0 {
            let mut select = redis::cmd("SELECT");
            select.arg(self.db);
            step(format!("SELECT {}", self.db), select, &mut conn)?;
        }
        step("PING".into(), redis::cmd("PING"), &mut conn)?;
        conn.set_read_timeout(Some(self.timeout))
            .and_then(|()| conn.set_write_timeout(Some(self.timeout)))
            .map_err(|e| ("setting the I/O timeouts".to_string(), e))?;
        Ok(conn)
    }

    fn conn(&self) -> MutexGuard<'_, Option<Connection>> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the connection (connecting first if there is none). If the connection
    /// turns out broken, connects again and runs `f` once more. A connection that failed is
    /// dropped, so that the next call starts afresh. `what` names the call for errors.
    fn with<T>(
        &self,
        what: &str,
        f: impl Fn(&mut Connection) -> Result<T, RedisError>,
    ) -> Result<T> {
        let mut slot = self.conn();
        let first = match slot.as_mut() {
            Some(c) => f(c),
            None => {
                let mut c = self
                    .open(self.timeout)
                    .map_err(|(step, e)| self.fail(&format!("{what}: {step}"), &e))?;
                let r = f(&mut c);
                *slot = Some(c);
                r
            }
        };
        match first {
            Ok(v) => Ok(v),
            Err(e) if broken(&e) => {
                *slot = None;
                let mut c = self.open(self.timeout).map_err(|(step, e2)| {
                    self.fail(
                        &format!("{what}: the connection broke ({e}); reconnecting: {step}"),
                        &e2,
                    )
                })?;
                let r = f(&mut c);
                match &r {
                    Err(e) if unusable(e) => {}
                    _ => *slot = Some(c),
                }
                r.map_err(|e| self.fail(&format!("{what} (after reconnecting)"), &e))
            }
            Err(e) => {
                if unusable(&e) {
                    *slot = None;
                }
                Err(self.fail(what, &e))
            }
        }
    }

    /// The raw value under `key`, if any.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.with(&format!("GET {key:?}"), |c| {
            redis::cmd("GET").arg(key).query(c)
        })
    }

    fn fail(&self, what: &str, e: &RedisError) -> Error {
        let detail = if e.is_timeout() {
            format!("{what} timed out after {:?} ({e})", self.timeout)
        } else {
            format!("{what} failed: {e}")
        };
        Error::Metadata {
            backend: self.location.clone(),
            detail,
        }
    }
}

impl Metadata for RedisMetadata {
    /// Publishes `desc` under [`segment_key`]`(desc.name)` unless Redis holds a newer version
    /// of it already, atomically (a Lua script compares the versions and sets the key).
    ///
    /// Keeping a newer descriptor is not an error: after `Ok`, the server holds `desc.version`
    /// or newer, and [`Metadata::present`]`(name, desc.version)` says yes. This relies on an
    /// engine's versions only growing; an engine that restarts under the same name must not
    /// number its descriptors below those it published before (or must remove them first).
    fn publish(&self, desc: &SegmentDesc) -> Result<()> {
        let key = segment_key(&desc.name);
        let bytes = desc.to_bytes();
        let version = desc.version.to_string();
        let stored: i64 = self.with(&format!("publishing {key:?}"), |c| {
            redis::cmd("EVAL")
                .arg(PUBLISH_SCRIPT)
                .arg(1)
                .arg(&key)
                .arg(&bytes)
                .arg(&version)
                .query(c)
        })?;
        if stored == 0 {
            tracing::debug!(
                "{}: kept a newer descriptor of {:?} than version {}",
                self.location,
                desc.name,
                desc.version
            );
        }
        Ok(())
    }

    /// The descriptor of segment `name`, polling (every 2 ms at first, backing off to every
    /// 50 ms) until it appears or `timeout` has passed: then
    /// [`Error::SegmentNotFound`](crate::Error::SegmentNotFound), naming the key and the
    /// server. A server that cannot be reached ends the wait at once with an
    /// [`Error::Metadata`], as does a stored value that is not a descriptor.
    fn lookup(&self, name: &str, timeout: Duration) -> Result<SegmentDesc> {
        let key = segment_key(name);
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(2);
        loop {
            if let Some(bytes) = self.get(&key)? {
                return SegmentDesc::from_bytes(&bytes, &self.location);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::SegmentNotFound {
                    name: name.into(),
                    backend: self.describe(),
                    detail: format!("no descriptor under {key:?} within {timeout:?}"),
                });
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(MAX_POLL);
        }
    }

    fn remove(&self, name: &str) -> Result<()> {
        let key = segment_key(name);
        self.with(&format!("DEL {key:?}"), |c| {
            redis::cmd("DEL").arg(&key).query::<i64>(c)
        })
        .map(|_| ())
    }

    fn present(&self, name: &str, version: u64) -> Result<bool> {
        Ok(self
            .get(&segment_key(name))?
            .and_then(|b| SegmentDesc::from_bytes(&b, &self.location).ok())
            .is_some_and(|d| d.version >= version))
    }

    fn describe(&self) -> String {
        self.location.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_get_a_scheme_and_lose_their_password() {
        assert_eq!(with_scheme("127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(with_scheme("redis://h:1/2"), "redis://h:1/2");
        assert_eq!(redacted("redis://u:pw@h:1/0"), "redis://***@h:1/0");
        assert_eq!(redacted("redis://h:1/a@b"), "redis://h:1/a@b");
        let at = |url: &str| {
            let info = redis::IntoConnectionInfo::into_connection_info(url).unwrap();
            location(info.addr(), info.redis_settings().db())
        };
        assert_eq!(
            at("redis://u:pw@127.0.0.1:7000/3"),
            "redis://127.0.0.1:7000/3"
        );
        assert_eq!(
            at(&with_scheme("localhost:7001")),
            "redis://localhost:7001/0"
        );
        assert_eq!(
            at("redis+unix:///tmp/r.sock?db=2"),
            "redis+unix:///tmp/r.sock?db=2"
        );
    }

    #[test]
    fn bad_urls_are_invalid_arguments_without_the_password() {
        let e =
            RedisMetadata::connect("http://u:secret@h:1/", Duration::from_millis(10)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(!e.to_string().contains("secret"), "{e}");
    }
}
