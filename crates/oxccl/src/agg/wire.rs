//! The aggregation service's control protocol: JSON messages, each after a 4-byte
//! little-endian length, on one TCP connection per member (the data travels over verbs).
//! The hello, the join and the answer travel in clear (the proofs are in them); everything
//! else travels in sealed records ([`oxccl_seal::SealedStream`]) keyed by [`session`]: the
//! member's side of the connection (its queue pair's endpoint and its region's rkey) right
//! after its join, the service's right after its accept, and rank 0's calls.

use std::io::{Read, Write};

use oxccl_bootstrap::frame;
use oxccl_bootstrap::handshake::Labels;

use oxccl_verbs::{QpEndpoint, RemoteBuffer};
use serde::{Deserialize, Serialize};

use crate::{DataType, ReduceOp};
use oxccl_core::protocol::Geometry;

/// Largest message accepted (a join with its endpoint is a few hundred bytes).
pub(crate) const MAX_MSG: usize = 64 << 10;

/// What the service says first.
pub(crate) const MAGIC: &str = "oxccl-agg v1";
/// The proofs ([`oxccl_bootstrap::handshake`]): the member's join covers the service's and its
/// own challenge and what it asks for ([`Join::claims`]); the service's accept covers both
/// challenges the other way round.
pub(crate) const LABELS: Labels = Labels::new("oxccl-agg v1 join", "oxccl-agg v1 accept");

/// One control message.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub(crate) enum Msg {
    /// Service → member, first: who it is, its host (a member on it talks shm), a challenge.
    Hello {
        magic: String,
        host: String,
        nonce: [u8; 32],
    },
    /// Member → service: the job it belongs to, and its proof.
    Join(Box<Join>),
    /// Either way, sealed, right after the join (member) or the accept (service): that end's
    /// side of the data connection.
    Side {
        endpoint: QpEndpoint,
        region: RemoteBuffer,
        /// Whether that end's tcp queue pair carries its frames in sealed records
        /// ([`oxccl_verbs::QpConfig::seal`], keyed by [`data_key`]): the member says, the
        /// service follows and says so back.
        #[serde(default)]
        sealed: bool,
    },
    /// Service → member: every member has joined; the service's proof (its side follows,
    /// sealed).
    Accept {
        proof: Vec<u8>,
        /// Aggregation slots this job got.
        pool: usize,
    },
    /// Service → member: not admitted, and why. `busy`: the service has no room now (the
    /// job runs without it); otherwise the job is wrong (a stranger, mismatched members).
    Refused { reason: String, busy: bool },
    /// Rank 0 → service: the next aggregation calls, before their data; several when the
    /// ranks run them as a group (together, in turns on the queues they share).
    Calls { calls: Vec<CallDesc> },
}

/// One aggregation call, as rank 0 names it.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct CallDesc {
    pub seq: u64,
    pub count: u64,
    /// [`dtype_code`].
    pub dtype: u8,
    /// [`op_code`].
    pub op: u8,
    /// Elements per slice.
    pub chunk: u64,
    /// Each rank's host, when the ranks reduce inside their hosts first and stream along
    /// rails (two tiers); empty otherwise.
    #[serde(default)]
    pub hosts: Vec<u32>,
}

/// A member's join.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Join {
    pub nonce: [u8; 32],
    pub proof: Vec<u8>,
    /// The job: its communicator id (rank 0's, the same on every rank).
    pub job: u64,
    pub rank: usize,
    pub world: usize,
    pub geo: Geometry,
    /// `shm` or `tcp`.
    pub provider: String,
    /// How long the member waits for the others (milliseconds): the service waits as long.
    pub timeout_ms: u64,
}

impl Join {
    /// What the member's proof covers, besides the two challenges.
    pub(crate) fn claims(&self) -> [u8; 24] {
        let mut c = [0u8; 24];
        c[..8].copy_from_slice(&self.job.to_le_bytes());
        c[8..16].copy_from_slice(&(self.rank as u64).to_le_bytes());
        c[16..].copy_from_slice(&(self.world as u64).to_le_bytes());
        c
    }
}

/// Writes one message (and flushes it: a sealed stream seals and sends it then).
pub(crate) fn send(s: &mut impl Write, m: &Msg) -> std::io::Result<()> {
    frame::send_json(s, m)?;
    s.flush()
}

/// Reads one message of at most [`MAX_MSG`] bytes.
pub(crate) fn recv(s: &mut impl Read) -> std::io::Result<Msg> {
    frame::recv_json(s, MAX_MSG, "control message")
}

/// An error of a read that waited up to `waited`, saying so when the wait ran out.
pub(crate) fn describe(e: &std::io::Error, waited: std::time::Duration) -> String {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("nothing came within {waited:?}")
        }
        _ => e.to_string(),
    }
}

/// The purpose of the data path's job key: the same as the ranks' tcp queue pairs' (comm's
/// `TCP_KEY_PURPOSE`), so that a rank seals its link to the service as it seals those to
/// its peers.
pub(crate) const DATA_KEY_PURPOSE: &str = "oxccl tcp qp v1";

/// The job key of the tcp queue pairs between the members and the service
/// ([`oxccl_verbs::QpConfig::seal`]).
pub(crate) fn data_key(secret: &oxccl_bootstrap::Secret) -> oxccl_seal::JobKey {
    oxccl_seal::JobKey::derive(secret.as_bytes(), DATA_KEY_PURPOSE)
}

/// The purpose the control connections' record keys are derived for.
pub(crate) const CONTROL_PURPOSE: &str = "oxccl-agg v1 control records";

/// The keys of one member's control connection once it has joined: from the job's secret,
/// both challenges (the member's is the initiator's) and what both saw of the join: the
/// member's claims and its proof.
pub(crate) fn session(
    secret: &oxccl_bootstrap::Secret,
    role: oxccl_seal::Role,
    member_nonce: &[u8; 32],
    service_nonce: &[u8; 32],
    claims: &[u8; 24],
    join_proof: &[u8],
) -> oxccl_seal::Session {
    let mut transcript = Vec::with_capacity(MAGIC.len() + claims.len() + join_proof.len());
    transcript.extend_from_slice(MAGIC.as_bytes());
    transcript.extend_from_slice(claims);
    transcript.extend_from_slice(join_proof);
    oxccl_seal::JobKey::derive(secret.as_bytes(), CONTROL_PURPOSE).session(
        role,
        member_nonce,
        service_nonce,
        &transcript,
    )
}

pub(crate) use frame::nonce;

/// A data type's code: its index in [`DataType::ALL`] (as the fragment header has it).
pub(crate) fn dtype_code(d: DataType) -> u8 {
    d.index()
}

/// An operator's code: its index in [`ReduceOp::ALL`].
pub(crate) fn op_code(o: ReduceOp) -> u8 {
    o.index()
}
