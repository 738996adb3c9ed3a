//! # oxccl-bootstrap: how the ranks of a job find each other
//!
//! A small TCP rendezvous store (set, get, wait, add, compare-and-set, delete, every blocking
//! call with a timeout), served by rank 0 or by a standalone `oxccl store`; a client that
//! authenticates both ways with the job's shared secret; and [`Bootstrap`], which reads the
//! launcher's environment (torchrun, Slurm, Open MPI, PMI, or explicit options), joins every
//! rank, and all-gathers what the ranks need to connect, such as queue pair endpoints.
//!
//! ```
//! use std::time::Duration;
//! use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};
//!
//! # fn main() -> Result<(), oxccl_bootstrap::Error> {
//! let secret = Secret::new("the job's shared secret")?;
//! // A standalone store on a free port (in a real job, rank 0 serves it on MASTER_PORT).
//! let server = StoreServer::bind("127.0.0.1:0", secret.clone())?;
//! let addr = server.addr().to_string();
//!
//! let ranks: Vec<_> = (0..2)
//!     .map(|rank| {
//!         let mut config = Config::new(rank, 2, addr.clone(), secret.clone());
//!         config.serve_store = false;
//!         config.timeout = Duration::from_secs(10);
//!         std::thread::spawn(move || -> Result<Vec<String>, oxccl_bootstrap::Error> {
//!             let b = Bootstrap::new(config)?;
//!             let all: Vec<String> = b.all_gather_serde("hello", &format!("rank {rank}"))?;
//!             b.barrier("done", Duration::from_secs(10))?;
//!             b.close()?;
//!             Ok(all)
//!         })
//!     })
//!     .collect();
//! for r in ranks {
//!     assert_eq!(r.join().unwrap()?, ["rank 0", "rank 1"]);
//! }
//! # Ok(()) }
//! ```
//!
//! ## Security
//!
//! Every store connection starts with a mutual challenge-response: the server sends a random
//! nonce, the client answers HMAC-SHA256(secret, nonces, its label) and sends its own nonce,
//! and the server answers that. A peer without the secret is refused, the refusal is logged
//! (a `tracing` warning), and it never receives a stored value: no endpoint or rkey reaches an
//! unauthenticated peer. A client sends nothing to a server that fails to answer its challenge.
//! The secret comes from `OXCCL_SECRET` or the file named by `OXCCL_SECRET_FILE`; a launcher
//! without one generates it ([`Secret::from_env_or_generate`]) and hands it to its children
//! ([`Secret::export_to`]). A rank with neither, outside such a launcher (torchrun, Slurm,
//! mpirun), uses the per-user secret file ([`Secret::user_default`]:
//! `~/.config/oxccl/secret`, created with mode 0600 on first use), which every process of the
//! user on the host shares, and every host sharing the home directory. A secret file that other
//! users may read is refused. After the handshake every request and reply travels in
//! AES-256-GCM records (`oxccl_seal`) under keys derived from the secret and bound to both
//! challenges and the handshake's messages ([`STORE_PURPOSE`]): a stranger on the path reads
//! nothing of the keys, values or client names, and a record changed, replayed, dropped or
//! reordered fails that connection (the server applies no such request, logs the client and
//! the record, and tells the client which record; the client's error names the store). Use a long random secret ([`Secret::generate`], `openssl
//! rand -hex 32`): a short one could be guessed offline from an observed handshake.
//!
//! A store that is not ours (torch's, Redis) holds what the ranks set in it in clear, for
//! whoever reaches it: wrapped in [`SealedValues`] (as [`SealedValues::per_policy`] does unless
//! `OXCCL_ENCRYPT=off`), its values are sealed with the job's key before they are set and
//! opened after they are got; a value that does not open is [`Error::ValueNotAuthentic`],
//! naming the key.
//!
//! What one job may keep in a store is capped ([`StoreCaps`]: `OXCCL_STORE_MAX_KEYS`,
//! `OXCCL_STORE_MAX_BYTES`): a request past a cap fails naming the cap, its variable and the
//! job, and stores nothing.
//!
//! ## Wire format
//!
//! Length-prefixed binary frames, described in [`wire`]; its [`wire::decode`] is a pure
//! function, ready for a fuzzer.
#![deny(missing_docs)]

mod abort;
mod bootstrap;
mod client;
mod config;
mod error;
pub mod frame;
pub mod handshake;
pub mod hostlist;
#[cfg(test)]
mod net_tests;
mod sealed_values;
mod secret;
mod server;
mod store;
pub mod wire;

pub use abort::{ABORT_POLL, AbortHandle, AbortHook};
pub use bootstrap::{Bootstrap, route_to};
pub use client::{ClientOptions, Interrupter, TcpStore};
pub use config::{Config, DEFAULT_PORT, DEFAULT_TIMEOUT, Launcher, parse_size};
pub use error::{Error, Result};
pub use oxccl_seal::{ENCRYPT_ENV, Encrypt};
pub use sealed_values::{SealedValues, VALUES_PURPOSE};
pub use secret::{SECRET_ENV, SECRET_FILE_ENV, Secret, SecretSource};
pub use server::{SERVICE_LABEL_PREFIX, STORE_PURPOSE, StoreServer};
pub use store::{
    CasOutcome, DEFAULT_STORE_MAX_BYTES, DEFAULT_STORE_MAX_KEYS, MemoryStore, STORE_MAX_BYTES_ENV,
    STORE_MAX_KEYS_ENV, Store, StoreCaps,
};
