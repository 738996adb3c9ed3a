//! In-network aggregation: a service that stands where the switch stands (SHARP, SwitchML),
//! and the ranks' side of it.
//!
//! The [`Service`] (`oxccl agg --listen ADDR`) is a member of each job that joins it, with
//! rank number `world`: the peer [`Algorithm::Aggregation`](crate::schedule::Algorithm)
//! schedules send to. It runs the same executor and protocol as the ranks: every rank sends
//! each slice of its input to the service, which folds the slices into an aggregation slot in
//! rank order (so the sum is the same bits on every rank and every run), and sends the sum
//! back to every rank. Its slots are a pool ([`crate::schedule::build_aggregator`]): a slot
//! is reused only once every member has taken its result, so the stream clocks itself. Each
//! member moves its buffer up once and down once, where a ring moves `2(n-1)/n` of it each
//! way: at most `2(n-1)/n` times the ring's bus bandwidth when the links are the bottleneck.
//!
//! How a job joins: at init, with [`Options::agg_addr`](crate::Options::agg_addr)
//! (`OXCCL_AGG_ADDR`), every rank connects to the service, proves the job's secret
//! (HMAC-SHA256 challenge-response both ways; the service holds the secrets of the jobs it
//! serves, so a stranger is refused), and hands over a queue pair and its receive region,
//! sealed (AES-256-GCM records of `oxccl_seal`, keyed from the secret and both challenges:
//! nobody on the path reads an endpoint or rkey, or changes a call unnoticed). Once every rank
//! of the job has joined, the service answers each with its own, sealed too, and the job runs.
//! Rank 0's control connection then names each aggregation call before its data flows (the
//! service builds its schedule from it); the data carries each rank's fingerprint, so a rank
//! whose call differs is found as between ranks. A service with no room for the job (its
//! [`ServiceOptions::max_jobs`] are running) says so, and the job runs its other algorithms,
//! saying so at `OXCCL_DEBUG=INFO`.
//!
//! What a member that proved its secret can make the service hold is capped
//! ([`ServiceOptions::max_members`], [`ServiceOptions::max_pending`],
//! [`ServiceOptions::max_join_wait`], [`ServiceOptions::max_call_steps`]), each named in the
//! error of a request past it; [`Service::failures`] tells how the last failed jobs failed.
//!
//! Only all-reduces go through it: a reduce-scatter through a service moves `N` up and `N/n`
//! down per rank where a ring moves `(n-1)/n · N` each way, an all-gather `N/n` up and `N`
//! down; on full-duplex links neither carries less than its ring.
//!
//! ```
//! use std::time::Duration;
//! use oxccl::agg::{Service, ServiceOptions};
//! use oxccl::schedule::Algorithm;
//! use oxccl::{Communicator, Options, ReduceOp};
//! use oxccl_bootstrap::{Bootstrap, Config, Secret, StoreServer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let secret = Secret::new("the job's shared secret")?;
//! let service = Service::start(ServiceOptions::new("127.0.0.1:0".parse()?, vec![secret.clone()]))?;
//! let store = StoreServer::bind("127.0.0.1:0", secret.clone())?;
//! let ranks: Vec<_> = (0..3)
//!     .map(|rank| {
//!         let mut config = Config::new(rank, 3, store.addr().to_string(), secret.clone());
//!         config.serve_store = false;
//!         config.timeout = Duration::from_secs(20);
//!         let options = Options {
//!             agg_addr: Some(service.addr().to_string()),
//!             algo: Some(Algorithm::Aggregation),
//!             ..Options::default()
//!         };
//!         std::thread::spawn(move || -> oxccl::Result<Vec<f32>> {
//!             let comm = Communicator::init(Bootstrap::new(config)?, options)?;
//!             let mut grad = vec![rank as f32 + 1.0; 100_000];
//!             comm.all_reduce_in_place(&mut grad, ReduceOp::Sum)?;
//!             comm.destroy()?;
//!             Ok(grad)
//!         })
//!     })
//!     .collect();
//! for r in ranks {
//!     assert!(r.join().unwrap()?.iter().all(|&x| x == 6.0));
//! }
//! # Ok(()) }
//! ```

mod member;
mod service;
mod wire;

pub(crate) use member::{Contact, Joined, Membership, contact};
pub use service::{Service, ServiceOptions, ServiceStats};
