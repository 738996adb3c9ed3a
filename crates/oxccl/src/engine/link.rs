//! One connected peer: its queue pair, receive and staging regions, and the peer's regions.

use super::*;

/// One connected peer.
pub(crate) struct Link {
    pub(crate) peer: usize,
    pub(crate) provider: Provider,
    pub(crate) qp: QueuePair,
    /// Index of the provider context ([`Engine::cqs`]) this link belongs to.
    pub(crate) ctx: usize,
    /// Where the peer writes to us: slots, then credit words.
    pub(super) slots: MemoryRegion,
    /// Our headers, inline data and credit source words.
    pub(super) stage: MemoryRegion,
    /// The peer's receive region for our fragments.
    pub(super) remote: RemoteBuffer,
    /// The same region mapped into this process, where the provider maps it (shm): mailbox
    /// messages are stored straight into it ([`crate::mailbox`]).
    pub(super) outbox: Option<RemoteMapping>,
    /// Why the connection failed, once it has.
    pub(super) failed: Option<String>,
    /// Mailbox messages sent to and received from this peer.
    pub(super) mbox_sent: u64,
    pub(super) mbox_recv: u64,
    /// Mailbox messages from this peer whose write has landed (a link without
    /// [`Link::outbox`]: its mailboxes are written, and taken only once landed).
    pub(super) mbox_landed: u64,
    /// What our data fragments to this peer delivered (tcp links only; see [`crate::meter`]).
    pub(crate) meter: Option<LinkMeter>,
}

impl Link {
    /// Allocates this side's regions; [`Link::connect`] completes it.
    pub(crate) fn new(
        peer: usize,
        provider: Provider,
        ctx: usize,
        pd: &ProtectionDomain,
        qp: QueuePair,
        geo: &Geometry,
    ) -> oxccl_verbs::Result<Link> {
        let slots = pd.alloc_mr(
            geo.recv_region(),
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )?;
        let stage = pd.alloc_mr(geo.stage_region(), AccessFlags::LOCAL_WRITE)?;
        Ok(Link {
            peer,
            provider,
            qp,
            ctx,
            slots,
            stage,
            remote: RemoteBuffer {
                addr: 0,
                len: 0,
                rkey: 0,
            },
            outbox: None,
            failed: None,
            mbox_sent: 0,
            mbox_recv: 0,
            mbox_landed: 0,
            meter: (provider == Provider::Tcp).then(LinkMeter::default),
        })
    }

    /// What the peer needs to write to us.
    pub(crate) fn local_region(&self) -> RemoteBuffer {
        self.slots.remote()
    }

    /// Records the peer's region (mapping it where the provider can), and posts the receive
    /// queue. The queue pair is connected.
    pub(crate) fn connect(
        &mut self,
        remote: RemoteBuffer,
        geo: &Geometry,
        index: usize,
    ) -> oxccl_verbs::Result<()> {
        self.remote = remote;
        self.outbox = self.qp.map_remote(remote, AccessFlags::REMOTE_WRITE)?;
        let wrs: Vec<RecvWr<'_>> = (0..geo.recv_depth())
            .map(|_| RecvWr::new(WR_RECV | index as u64, &[]))
            .collect();
        self.qp.post_recv(&wrs)
    }

    /// Records a failure the queue pair shows (ERR, even before a completion says so).
    pub(super) fn refresh_failed(&mut self) {
        if self.failed.is_none()
            && matches!(
                self.qp.state(),
                oxccl_verbs::QpState::Err | oxccl_verbs::QpState::Destroyed
            )
        {
            let d = self.qp.error_detail();
            self.failed = Some(d.unwrap_or_else(|| "the connection failed".into()));
        }
    }

    /// The fragment header at byte `off` of the receive region.
    pub(super) fn header_at(&self, off: usize) -> oxccl_verbs::Result<Header> {
        let mut hb = [0u8; SLOT_HEADER];
        self.slots.read(off, &mut hb)?;
        Ok(Header::decode(&hb))
    }

    /// The mailbox the peer's next message arrives in.
    pub(super) fn inbox(&self, geo: &Geometry) -> Inbox<'_> {
        Inbox::new(
            &self.slots,
            geo.mailbox_offset((self.mbox_recv % 2) as usize),
        )
    }

    /// Whether the header of the peer's next mailbox message has arrived (on a link whose
    /// mailboxes are written: whether the whole message has).
    pub(super) fn mailbox_arrived(&self, geo: &Geometry) -> bool {
        (self.outbox.is_some() || self.mbox_landed > self.mbox_recv)
            && self.inbox(geo).header_arrived(self.mbox_recv + 1)
    }

    pub(super) fn credit_word(&self, ch: usize, geo: &Geometry) -> u64 {
        self.slots
            .atomic_u64(geo.credit_offset(ch))
            .map(|a| a.load(Ordering::Acquire))
            .unwrap_or(0)
    }
}
