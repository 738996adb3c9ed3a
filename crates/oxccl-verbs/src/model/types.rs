//! Plain data types of the verbs model: access flags, remote addresses, operations, states,
//! completions and queue-pair settings. (Work requests name memory regions, so they sit one
//! layer up, in `contract::wr`.)

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Access rights of a memory region, as `ibv_access_flags`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// No access beyond local reads (the source of a WRITE or SEND).
    pub const NONE: Self = Self(0);
    /// The local side may write into the region (READ results, RECV buffers, atomics' results).
    pub const LOCAL_WRITE: Self = Self(1);
    /// Peers may RDMA WRITE into the region.
    pub const REMOTE_WRITE: Self = Self(2);
    /// Peers may RDMA READ from the region.
    pub const REMOTE_READ: Self = Self(4);
    /// Peers may run atomics on 8-byte words of the region.
    pub const REMOTE_ATOMIC: Self = Self(8);
    /// Every flag.
    pub const ALL: Self = Self(15);

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// Flags from raw bits; unknown bits are dropped.
    pub const fn from_bits_truncate(bits: u32) -> Self {
        Self(bits & 15)
    }
    /// Whether every flag of `other` is set in `self`.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for AccessFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl std::ops::BitOrAssign for AccessFlags {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for AccessFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::LOCAL_WRITE, "LOCAL_WRITE"),
            (Self::REMOTE_WRITE, "REMOTE_WRITE"),
            (Self::REMOTE_READ, "REMOTE_READ"),
            (Self::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
        ];
        let set: Vec<&str> = names
            .iter()
            .filter(|(flag, _)| self.contains(*flag))
            .map(|(_, n)| *n)
            .collect();
        if set.is_empty() {
            f.write_str("NONE")
        } else {
            f.write_str(&set.join("|"))
        }
    }
}

impl fmt::Display for AccessFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// What a peer needs to address a region: its address (in the owner's address space), length and rkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteBuffer {
    /// Start address of the region in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key that grants access.
    pub rkey: u64,
}

impl RemoteBuffer {
    /// The address `offset` bytes into the buffer (no bounds check: the target checks).
    pub fn at(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr.wrapping_add(offset),
            rkey: self.rkey,
        }
    }
}

/// A remote address with the key that grants access to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteAddr {
    /// Address in the target's address space.
    pub addr: u64,
    /// Remote key of the target region.
    pub rkey: u64,
}

/// The operation of a send-queue work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrOp {
    /// RDMA WRITE of the gathered bytes to `remote`.
    Write {
        /// Where the bytes land.
        remote: RemoteAddr,
    },
    /// RDMA WRITE followed by an immediate that consumes one RECV at the target.
    WriteWithImm {
        /// Where the bytes land.
        remote: RemoteAddr,
        /// Immediate data delivered in the target's receive completion.
        imm: u32,
    },
    /// RDMA READ of `remote` into the scattered local buffers.
    Read {
        /// Where the bytes come from.
        remote: RemoteAddr,
    },
    /// Two-sided SEND into the next posted RECV.
    Send,
    /// SEND carrying an immediate.
    SendWithImm {
        /// Immediate data delivered in the target's receive completion.
        imm: u32,
    },
    /// 64-bit compare-and-swap on an 8-byte aligned remote word; the old value lands in the local SGE.
    CompareSwap {
        /// The remote word.
        remote: RemoteAddr,
        /// Value expected.
        compare: u64,
        /// Value stored when the word equals `compare`.
        swap: u64,
    },
    /// 64-bit fetch-and-add on an 8-byte aligned remote word; the old value lands in the local SGE.
    FetchAdd {
        /// The remote word.
        remote: RemoteAddr,
        /// Addend (wrapping).
        add: u64,
    },
}

impl WrOp {
    /// The completion opcode this request reports.
    pub fn wc_opcode(&self) -> WcOpcode {
        match self {
            WrOp::Write { .. } | WrOp::WriteWithImm { .. } => WcOpcode::Write,
            WrOp::Read { .. } => WcOpcode::Read,
            WrOp::Send | WrOp::SendWithImm { .. } => WcOpcode::Send,
            WrOp::CompareSwap { .. } => WcOpcode::CompareSwap,
            WrOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }
    /// The remote address the request targets, for one-sided operations.
    pub fn remote(&self) -> Option<RemoteAddr> {
        match *self {
            WrOp::Write { remote }
            | WrOp::WriteWithImm { remote, .. }
            | WrOp::Read { remote }
            | WrOp::CompareSwap { remote, .. }
            | WrOp::FetchAdd { remote, .. } => Some(remote),
            WrOp::Send | WrOp::SendWithImm { .. } => None,
        }
    }
}

/// Completion status, as InfiniBand defines them (`ibv_wc_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u32)]
pub enum WcStatus {
    /// The request completed.
    Success = 0,
    /// A received message was longer than the posted receive buffers.
    LocalLengthError = 1,
    /// A local buffer was not registered, deregistered, out of bounds, or lacked LOCAL_WRITE.
    LocalProtectionError = 2,
    /// The target refused access: bad rkey, range outside the region, or missing access flag.
    RemoteAccessError = 3,
    /// The target could not accept the request (message too long for its RECV, misaligned atomic).
    RemoteInvalidRequest = 4,
    /// The target failed while executing the request (its receive buffer was invalid).
    RemoteOperationError = 5,
    /// The target had no RECV posted for longer than the RNR retries allow.
    RnrRetryExceeded = 6,
    /// The peer is gone (process died, queue pair destroyed) or never became ready.
    RetryExceeded = 7,
    /// The queue pair is in the error state; the request was not executed.
    WorkRequestFlushed = 8,
}

impl WcStatus {
    /// Decodes the raw value used in shared memory.
    pub fn from_u32(v: u32) -> Option<Self> {
        use WcStatus::*;
        Some(match v {
            0 => Success,
            1 => LocalLengthError,
            2 => LocalProtectionError,
            3 => RemoteAccessError,
            4 => RemoteInvalidRequest,
            5 => RemoteOperationError,
            6 => RnrRetryExceeded,
            7 => RetryExceeded,
            8 => WorkRequestFlushed,
            _ => return None,
        })
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// What a completion reports (`ibv_wc_opcode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u32)]
pub enum WcOpcode {
    /// A SEND or SEND_WITH_IMM completed at the initiator.
    Send = 0,
    /// A WRITE or WRITE_WITH_IMM completed at the initiator.
    Write = 1,
    /// A READ completed at the initiator.
    Read = 2,
    /// A compare-and-swap completed at the initiator.
    CompareSwap = 3,
    /// A fetch-and-add completed at the initiator.
    FetchAdd = 4,
    /// A RECV consumed by a SEND or SEND_WITH_IMM.
    Recv = 5,
    /// A RECV consumed by a WRITE_WITH_IMM.
    RecvRdmaWithImm = 6,
}

impl WcOpcode {
    /// Decodes the raw value used in shared memory.
    pub fn from_u32(v: u32) -> Option<Self> {
        use WcOpcode::*;
        Some(match v {
            0 => Send,
            1 => Write,
            2 => Read,
            3 => CompareSwap,
            4 => FetchAdd,
            5 => Recv,
            6 => RecvRdmaWithImm,
            _ => return None,
        })
    }
}

/// A work completion (`ibv_wc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkCompletion {
    /// The `wr_id` of the request.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What it was.
    pub opcode: WcOpcode,
    /// Bytes received (receive completions) or transferred.
    pub byte_len: u32,
    /// Immediate data, for receives consumed by `*_WITH_IMM`.
    pub imm: Option<u32>,
    /// Number of the local queue pair the request belonged to.
    pub qp_num: u32,
}

impl WorkCompletion {
    /// A placeholder, for sizing poll buffers.
    pub const EMPTY: WorkCompletion = WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        qp_num: 0,
    };
    /// Whether the status is `Success`.
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }
}

impl Default for WorkCompletion {
    fn default() -> Self {
        Self::EMPTY
    }
}

/// Queue pair states (`ibv_qp_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[repr(u32)]
pub enum QpState {
    /// Created; nothing may be posted.
    Reset = 0,
    /// Receives may be posted.
    Init = 1,
    /// Ready to receive: connected to the remote endpoint.
    Rtr = 2,
    /// Ready to send.
    Rts = 3,
    /// Failed: every request completes with `WorkRequestFlushed`.
    Err = 4,
    /// Destroyed (only ever seen by a peer).
    Destroyed = 5,
}

impl QpState {
    /// Decodes the raw value used in shared memory.
    pub fn from_u32(v: u32) -> Self {
        match v {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            4 => QpState::Err,
            _ => QpState::Destroyed,
        }
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Err => "ERR",
            QpState::Destroyed => "DESTROYED",
        };
        f.write_str(s)
    }
}

/// Sizes and retry behaviour of a queue pair (`ibv_qp_init_attr` and the RTS attributes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpConfig {
    /// Maximum outstanding send requests (pending ones, waiting for the target's RECV or readiness).
    pub max_send_wr: u32,
    /// Maximum posted, not yet completed receive requests.
    pub max_recv_wr: u32,
    /// Maximum scatter-gather elements per request (at most 16).
    pub max_sge: u32,
    /// RNR retries after the first attempt; 7 means retry forever, as in InfiniBand.
    pub rnr_retry: u8,
    /// Delay between RNR retries (the back-off starts small and doubles up to this).
    pub rnr_timer: Duration,
    /// How long a peer may be unreachable or not ready before requests fail with `RetryExceeded`;
    /// a dead peer is noticed within this time.
    pub timeout: Duration,
    /// tcp: which end opens the connection. Both ends of a pair must agree; the default lets
    /// the endpoints decide (the one with the smaller token connects), which is fine when
    /// every address is reachable from every host. A caller that knows an order (ranks)
    /// makes the choice deterministic, so that an unreachable address fails the same way
    /// every time.
    pub connect: ConnectRole,
    /// Stops the connect when set (it then fails, saying it was cancelled): looked at
    /// between tcp connect attempts (which last at most 1 s while a flag is given, 5 s
    /// otherwise), every 100 ms while waiting for a tcp handshake's reply, and every 100 ms
    /// while waiting for a shm peer's segment service. `None`: wait until `timeout`.
    pub cancel: Option<Cancel>,
    /// tcp: carry every frame of the queue pair's connections in authenticated, encrypted
    /// records ([`oxccl_seal`]), keyed per connection from this job key and both sides' fresh
    /// nonces. Both ends must set it, with the same key; an end without it (or with another
    /// key) is refused at connect. `None`: frames travel in clear. Other providers ignore it
    /// (shm never leaves the host; ofi's wire is the NIC's). Which links to seal is
    /// [`Encrypt`](crate::Encrypt)'s decision.
    pub seal: Option<oxccl_seal::JobKey>,
}

/// A flag that cancels a queue pair's connection setup ([`QpConfig::cancel`]); clones share
/// it. Two compare equal when they are the same flag.
#[derive(Clone, Debug, Default)]
pub struct Cancel(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Cancel {
    /// A flag not yet set.
    pub fn new() -> Cancel {
        Cancel::default()
    }

    /// Sets it.
    pub fn cancel(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether it is set.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl PartialEq for Cancel {
    fn eq(&self, other: &Cancel) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Cancel {}

/// Which end of a tcp queue pair opens the connection ([`QpConfig::connect`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConnectRole {
    /// The end whose endpoint token is smaller connects.
    #[default]
    Auto,
    /// This end connects to the peer's advertised address.
    Active,
    /// This end waits for the peer to connect.
    Passive,
}

impl Default for QpConfig {
    fn default() -> Self {
        Self {
            max_send_wr: 4096,
            max_recv_wr: 1024,
            max_sge: MAX_SGE as u32,
            rnr_retry: 7,
            rnr_timer: Duration::from_millis(1),
            timeout: Duration::from_secs(5),
            connect: ConnectRole::Auto,
            cancel: None,
            seal: None,
        }
    }
}

/// Most scatter-gather elements a request may carry.
pub const MAX_SGE: usize = 16;
