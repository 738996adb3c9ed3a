//! A rank's side of the aggregation service: contact, join, and naming each call.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use oxccl_bootstrap::Secret;
use oxccl_verbs::{QpEndpoint, RemoteBuffer};

use super::wire::{self, CallDesc, Join, LABELS, MAGIC, Msg};
use crate::engine::Aggregator;
use crate::error::{Error, OpDesc, Result};
use oxccl_core::protocol::Geometry;

/// A connection to the service that has said hello.
pub(crate) struct Contact {
    stream: TcpStream,
    addr: String,
    /// The service's host (ranks on it talk shm to it).
    pub(crate) host: String,
    nonce: [u8; 32],
    /// Whether this rank's tcp queue pair to the service is sealed ([`Contact::seal_data`]).
    sealed: bool,
}

/// What joining gave.
pub(crate) enum Joined {
    /// Admitted: the service's queue pair and region, and the membership.
    Accepted {
        membership: Membership,
        endpoint: QpEndpoint,
        region: RemoteBuffer,
        pool: usize,
    },
    /// The service has no room now; the job runs without it.
    Busy(String),
}

/// A rank's membership: its control connection, over which rank 0 names each call (sealed
/// records, [`wire::session`]).
pub(crate) struct Membership {
    ctl: Box<oxccl_seal::SealedStream<TcpStream>>,
    /// The service's address, as the user gave it.
    pub(crate) addr: String,
    /// Whether this rank names the calls (rank 0).
    names_calls: bool,
}

/// Connects to the service at `addr` and reads its hello.
pub(crate) fn contact(addr: &str, rank: usize, timeout: Duration) -> Result<Contact> {
    let fail = |what: String| {
        Error::Config(format!(
            "rank {rank}: the aggregation service at {addr} (OXCCL_AGG_ADDR): {what}"
        ))
    };
    let sa = addr
        .to_socket_addrs()
        .map_err(|e| fail(format!("not an address: {e}")))?
        .next()
        .ok_or_else(|| fail("resolves to no address".into()))?;
    let mut stream = TcpStream::connect_timeout(&sa, timeout.min(Duration::from_secs(10)))
        .map_err(|e| fail(format!("cannot connect: {e}")))?;
    let _ = stream.set_nodelay(true);
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| fail(e.to_string()))?;
    match wire::recv(&mut stream) {
        Ok(Msg::Hello { magic, host, nonce }) if magic == MAGIC => Ok(Contact {
            stream,
            addr: addr.to_string(),
            host,
            nonce,
            sealed: false,
        }),
        Ok(m) => Err(fail(format!(
            "not an oxccl aggregation service (it said {m:?})"
        ))),
        Err(e) => Err(fail(format!("no hello: {e}"))),
    }
}

impl Contact {
    /// Says that this rank's tcp queue pair to the service seals its frames: the caller
    /// created it with [`QpConfig::seal`](oxccl_verbs::QpConfig::seal) set to the key
    /// [`Contact::data_seal`] gives; the service then seals its end too. The policy's
    /// decision (`OXCCL_ENCRYPT`; `auto`: the service is on another host, see
    /// [`Contact::service_ip`]) is the caller's, as for its peers.
    pub(crate) fn seal_data(mut self, sealed: bool) -> Contact {
        self.sealed = sealed;
        self
    }

    /// The service's IP as this rank reaches it (for `OXCCL_ENCRYPT=auto`).
    pub(crate) fn service_ip(&self) -> Option<std::net::IpAddr> {
        self.stream.peer_addr().ok().map(|a| a.ip())
    }

    /// The key this rank's tcp queue pair to the service is sealed with under `encrypt`
    /// (`on`: always; `auto`: when the service is not on this host; `off`: never), given the
    /// job's `secret` (none: not sealed). Create the queue pair with it as
    /// [`QpConfig::seal`](oxccl_verbs::QpConfig::seal), and say so with
    /// [`Contact::seal_data`]`(key.is_some())`.
    pub(crate) fn data_seal(
        &self,
        encrypt: oxccl_verbs::Encrypt,
        secret: Option<&Secret>,
    ) -> Option<oxccl_seal::JobKey> {
        let ip = self.service_ip()?;
        (encrypt.seals(ip)).then(|| secret.map(wire::data_key))?
    }

    /// Joins job `job` as `rank` of `world`, handing over this rank's side of the connection;
    /// waits (up to `timeout`) until every member has joined.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn join(
        mut self,
        secret: &Secret,
        job: u64,
        rank: usize,
        world: usize,
        geo: Geometry,
        provider: &str,
        endpoint: QpEndpoint,
        region: RemoteBuffer,
        timeout: Duration,
    ) -> Result<Joined> {
        let addr = self.addr.clone();
        let fail = |what: String| {
            Error::Config(format!(
                "rank {rank}: the aggregation service at {addr}: {what}"
            ))
        };
        let nc = wire::nonce().map_err(|e| fail(e.to_string()))?;
        let mut join = Join {
            nonce: nc,
            proof: Vec::new(),
            job,
            rank,
            world,
            geo,
            provider: provider.to_string(),
            timeout_ms: timeout.as_millis().min(u64::MAX as u128) as u64,
        };
        join.proof = LABELS
            .client_proof(secret, &self.nonce, &nc, &join.claims())
            .to_vec();
        let session = wire::session(
            secret,
            oxccl_seal::Role::Initiator,
            &nc,
            &self.nonce,
            &join.claims(),
            &join.proof,
        );
        wire::send(&mut self.stream, &Msg::Join(Box::new(join)))
            .map_err(|e| fail(format!("cannot join: {e}")))?;
        // This rank's side (its endpoint, its region's rkey) goes sealed.
        let peer = format!("the aggregation service at {}", self.addr);
        let mut ctl = oxccl_seal::SealedStream::new(self.stream, session, peer);
        let sealed = self.sealed;
        let side = Msg::Side {
            endpoint,
            region,
            sealed,
        };
        wire::send(&mut ctl, &side)
            .map_err(|e| fail(format!("cannot send this rank's side: {e}")))?;
        // The service answers once every member has joined (or it gave up waiting): its
        // proof in clear, then its side sealed.
        let _ = ctl
            .get_ref()
            .set_read_timeout(Some(timeout + Duration::from_secs(5)));
        match wire::recv(ctl.get_mut()) {
            Ok(Msg::Accept { proof, pool }) => {
                if !LABELS.server_proven(secret, &self.nonce, &nc, &proof) {
                    return Err(fail(
                        "it did not prove the job's secret: not the service this job trusts".into(),
                    ));
                }
                let (endpoint, region) = match wire::recv(&mut ctl) {
                    Ok(Msg::Side {
                        endpoint,
                        region,
                        sealed: theirs,
                    }) if theirs == sealed => (endpoint, region),
                    Ok(Msg::Side { .. }) => {
                        return Err(fail(format!(
                            "this rank seals its queue pair to it (OXCCL_ENCRYPT) and it does \
                             not (sealed: {sealed}): an older service?"
                        )));
                    }
                    Ok(m) => return Err(fail(format!("sent {m:?} where its side belongs"))),
                    Err(e) => {
                        let waited = timeout + Duration::from_secs(5);
                        return Err(fail(format!("its side: {}", wire::describe(&e, waited))));
                    }
                };
                // From now on, reads only tell that the service is gone.
                let _ = ctl.get_ref().set_read_timeout(None);
                Ok(Joined::Accepted {
                    membership: Membership {
                        ctl: Box::new(ctl),
                        addr: self.addr,
                        names_calls: rank == 0,
                    },
                    endpoint,
                    region,
                    pool,
                })
            }
            Ok(Msg::Refused { reason, busy: true }) => Ok(Joined::Busy(reason)),
            Ok(Msg::Refused { reason, .. }) => Err(fail(format!("refused this rank: {reason}"))),
            Ok(m) => Err(fail(format!("answered the join with {m:?}"))),
            Err(e) => Err(fail(format!(
                "no answer to the join: {}",
                wire::describe(&e, timeout + Duration::from_secs(5))
            ))),
        }
    }
}

impl Aggregator for Membership {
    fn addr(&self) -> &str {
        &self.addr
    }

    /// Names aggregation calls to the service before their data (rank 0 only; the others'
    /// data carries their fingerprints, which the service checks against these): `calls`,
    /// each with its slice (elements) and host table, run as one group.
    fn announce(&mut self, rank: usize, calls: &[(OpDesc, usize, &[u32])]) -> Result<()> {
        if !self.names_calls || calls.is_empty() {
            return Ok(());
        }
        let m = Msg::Calls {
            calls: calls
                .iter()
                .map(|(desc, chunk, hosts)| CallDesc {
                    seq: desc.seq,
                    count: desc.count,
                    dtype: wire::dtype_code(desc.dtype),
                    op: wire::op_code(desc.op),
                    chunk: *chunk as u64,
                    hosts: hosts.to_vec(),
                })
                .collect(),
        };
        wire::send(&mut self.ctl, &m).map_err(|e| Error::AggregatorFailed {
            rank,
            op: calls[0].0.to_string(),
            addr: self.addr.clone(),
            detail: format!("cannot name the call to it: {e}"),
        })
    }
}
