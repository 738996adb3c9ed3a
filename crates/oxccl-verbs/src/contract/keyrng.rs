//! The random keys and tokens of a context (region lkeys and rkeys, queue-pair tokens, the shm
//! service's name): unguessable, since an rkey is what lets a peer into a region, and drawn
//! without a system call, since a call of 64 KiB or more registers its buffers and so draws keys.
//!
//! [`KeyRng`] is a fast-key-erasure generator over ChaCha20 (the construction of OpenBSD's
//! `arc4random` and of Bernstein's "Fast-key-erasure random-number generators"), seeded once from
//! the operating system when the context opens. Each refill encrypts a block of zeros with
//! ChaCha20 under the current key (ring's ChaCha20-Poly1305, whose ciphertext of zeros is the
//! raw ChaCha20 keystream from block counter 1; the tag is discarded): the block's first 32 bytes
//! replace the key at once, the rest are handed out 8 bytes at a time and wiped as they go. Each
//! key encrypts exactly one block, so the fixed nonce is never reused under a key, and an
//! attacker who later reads the state learns nothing of keys already handed out.
//!
//! After `fork` the child holds a copy of the parent's state and would hand out the parent's
//! next keys: a `pthread_atfork` child handler counts forks, and a generator that sees the count
//! changed reseeds from the operating system before drawing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use ::ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};

use crate::model::{Error, Result};

/// Bytes of keystream per refill: the next key, then 60 values.
const BLOCK: usize = 512;
const KEY: usize = 32;

/// Forks of this process so far, as the child side of each fork counts them.
static FORKS: AtomicU64 = AtomicU64::new(0);
/// The result of registering [`child_after_fork`] (0: registered).
static ATFORK: OnceLock<i32> = OnceLock::new();

extern "C" fn child_after_fork() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Registers the fork counter once per process.
fn watch_forks() -> Result<()> {
    // SAFETY: `child_after_fork` only increments an atomic (async-signal-safe), and registering
    // a handler has no other precondition.
    let rc =
        *ATFORK.get_or_init(|| unsafe { libc::pthread_atfork(None, None, Some(child_after_fork)) });
    if rc != 0 {
        return Err(Error::os(
            "registering the key generator's fork handler (pthread_atfork)",
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(())
}

/// A context's generator of keys and tokens (see the module's documentation).
pub(crate) struct KeyRng {
    state: Mutex<State>,
}

struct State {
    key: [u8; KEY],
    buf: [u8; BLOCK],
    /// Next unread byte of `buf` (`BLOCK`: empty).
    pos: usize,
    /// [`FORKS`] when `key` was seeded.
    forks: u64,
}

/// ring refusing a 32-byte ChaCha20 key or a 512-byte block (it accepts both by its contract).
fn refused(what: &str) -> Error {
    Error::os(
        "the key generator's ChaCha20 step",
        std::io::Error::other(format!("ring refused the {what}")),
    )
}

impl State {
    fn seed_from_os(&mut self) -> Result<()> {
        let forks = FORKS.load(Ordering::Relaxed);
        getrandom::fill(&mut self.key).map_err(|e| {
            Error::os(
                "seeding the key generator from the operating system (getrandom)",
                std::io::Error::other(e.to_string()),
            )
        })?;
        self.buf.fill(0);
        self.pos = BLOCK;
        self.forks = forks;
        Ok(())
    }

    fn refill(&mut self) -> Result<()> {
        let unbound = UnboundKey::new(&CHACHA20_POLY1305, &self.key).map_err(|_| refused("key"))?;
        self.buf.fill(0);
        // The tag (Poly1305 over the block) is not needed.
        let _tag = LessSafeKey::new(unbound)
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key([0; 12]),
                Aad::empty(),
                &mut self.buf,
            )
            .map_err(|_| refused("block"))?;
        self.key.copy_from_slice(&self.buf[..KEY]);
        self.buf[..KEY].fill(0);
        self.pos = KEY;
        Ok(())
    }

    fn next_u64(&mut self) -> Result<u64> {
        if self.forks != FORKS.load(Ordering::Relaxed) {
            self.seed_from_os()?;
        }
        if self.pos == BLOCK {
            self.refill()?;
        }
        let out: &mut [u8; 8] = (&mut self.buf[self.pos..self.pos + 8])
            .try_into()
            .expect("8 bytes");
        let v = u64::from_le_bytes(*out);
        out.fill(0);
        self.pos += 8;
        Ok(v)
    }
}

impl KeyRng {
    /// A generator seeded from the operating system; an error if it has no randomness to give.
    pub(crate) fn from_os() -> Result<KeyRng> {
        watch_forks()?;
        let mut state = State {
            key: [0; KEY],
            buf: [0; BLOCK],
            pos: BLOCK,
            forks: 0,
        };
        state.seed_from_os()?;
        Ok(KeyRng {
            state: Mutex::new(state),
        })
    }

    /// A random, unguessable 64-bit value.
    pub(crate) fn next_u64(&self) -> Result<u64> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .next_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A generator from a given key (the known-answer test's).
    fn from_key(key: [u8; KEY]) -> KeyRng {
        watch_forks().unwrap();
        KeyRng {
            state: Mutex::new(State {
                key,
                buf: [0; BLOCK],
                pos: BLOCK,
                forks: FORKS.load(Ordering::Relaxed),
            }),
        }
    }

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// RFC 8439, A.1, test vector #2: the ChaCha20 block of the all-zero key and nonce at
    /// counter 1, which the first refill of a zero key must produce: its first 32 bytes become
    /// the next key, the next 32 the first four values.
    #[test]
    fn the_keystream_is_chacha20s() {
        let block = hex(
            "9f 07 e7 be 55 51 38 7a 98 ba 97 7c 73 2d 08 0d cb 0f 29 a0 48 e3 65 69 12 c6 53 3e \
             32 ee 7a ed 29 b7 21 76 9c e6 4e 43 d5 71 33 b0 74 d8 39 d5 31 ed 1f 28 51 0a fb 45 \
             ac e1 0a 1f 4b 79 4d 6f",
        );
        let rng = from_key([0; KEY]);
        for i in 0..4 {
            let want = u64::from_le_bytes(block[32 + 8 * i..40 + 8 * i].try_into().unwrap());
            assert_eq!(rng.next_u64().unwrap(), want, "value {i}");
        }
        let st = rng.state.lock().unwrap();
        assert_eq!(
            &st.key[..],
            &block[..32],
            "the next key is the block's first 32 bytes"
        );
        assert!(
            st.buf[..st.pos].iter().all(|&b| b == 0),
            "handed-out bytes are wiped"
        );
    }

    /// Past a refill the stream goes on under the new key: values all differ over many blocks,
    /// and two generators seeded from the OS share none.
    #[test]
    fn values_differ_across_refills_and_generators() {
        let (a, b) = (KeyRng::from_os().unwrap(), KeyRng::from_os().unwrap());
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10 * BLOCK / 8 {
            assert!(seen.insert(a.next_u64().unwrap()));
            assert!(seen.insert(b.next_u64().unwrap()));
        }
    }

    /// A child after `fork` does not hand out the parent's next values: it reseeds.
    #[test]
    fn a_forked_child_reseeds() {
        const K: usize = 8;
        let rng = KeyRng::from_os().unwrap();
        rng.next_u64().unwrap(); // a block is buffered: the child would continue it
        let mut fds = [0i32; 2];
        // SAFETY: `fds` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only draws from `rng` (a lock no other thread holds, ChaCha20, and
        // at most a getrandom call), writes to the pipe and leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let mut out = [0u64; K];
            for v in out.iter_mut() {
                *v = rng.next_u64().unwrap_or(0);
            }
            // SAFETY: writes `out`'s bytes to the pipe, then ends the child without unwinding.
            unsafe {
                libc::write(fds[1], out.as_ptr().cast(), size_of_val(&out));
                libc::_exit(0);
            }
        }
        let parent: Vec<u64> = (0..K).map(|_| rng.next_u64().unwrap()).collect();
        let mut child = [0u64; K];
        // SAFETY: reads at most `child`'s bytes into it; then reaps the child and closes the
        // pipe's descriptors, which this test owns.
        let (n, status) = unsafe {
            libc::close(fds[1]);
            let n = libc::read(fds[0], child.as_mut_ptr().cast(), size_of_val(&child));
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
            libc::close(fds[0]);
            (n, status)
        };
        assert_eq!(
            n as usize,
            size_of_val(&child),
            "the child's values (status {status})"
        );
        assert!(child.iter().all(|&v| v != 0), "the child drew: {child:x?}");
        for v in &child {
            assert!(
                !parent.contains(v),
                "the child repeated the parent's {v:#x}"
            );
        }
    }
}
