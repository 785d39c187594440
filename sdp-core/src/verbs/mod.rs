//! The provider layer: one trait set for what the SDP engine needs of an RDMA device.
//!
//! The idea is the kernel's rdmavt: the engine and the progress loop are written once against
//! these traits, and each provider supplies the device-specific parts:
//!
//! * [`sim`]: deterministic, in-memory, virtual time, fault injection (tests).
//! * `rdma` (cargo feature `rdma`): librdmacm + libibverbs through rdma-sys (real fabrics).
//! * [`shm`]: two processes (or threads) on one host, through shared memory (Linux).
//!
//! The model follows the RDMA CM: a [`Provider`] is opened once per process; the connection manager
//! creates endpoints ([`Provider::Endpoint`]), each bundling a CM id, an RC queue pair and its
//! completion queue, the way `rdma_create_ep` does. Memory is registered on the provider's protection
//! domain ([`Provider::reg_mr`]). Work requests and completions are plain data ([`SendWr`],
//! [`RecvWr`], [`Completion`]) so the sans-IO engine in `proto` can produce and consume them.

#[cfg(feature = "rdma")]
pub mod rdma;
#[cfg(target_os = "linux")]
pub mod shm;
pub mod sim;

use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, RawFd};

/// Private data of the consumer reject that answers a connect request when the listener's
/// queue is full (its backlog: see `driver`, and docs/providers.md, "Listen backlog"). A
/// connector that gets it waits and tries again, as a TCP client whose SYN was dropped does;
/// a provider that finds the listener's own queue full before the request reaches it (shm:
/// the rendezvous socket's) reports the same.
pub const REJECT_QUEUE_FULL: &str = "SDP: listen queue full";

/// The reason a listener gives when its process takes that address by kernel TCP from now on
/// (the LD_PRELOAD shim's listener whose accepted connections all went to forked children):
/// the connector falls back to TCP, as on any refusal.
pub const REJECT_SDP_OFF: &str = "SDP: the server takes this address by kernel TCP";
/// A nonblocking connect's own reason to give up: the listener is shared by processes (after
/// fork) and none accepted within the short wait such a connect allows (the socket layer's,
/// not a listener's answer).
pub const REJECT_SHARED_SLOW: &str = "SDP: the listener is shared and no process accepted in time";
/// A connect's own reason to give up: the listener's process (on this host) did not answer in
/// time: stopped, or too busy (the socket layer's, not a listener's answer).
pub const REJECT_LOCAL_SILENT: &str =
    "SDP: the listener's process did not answer in time (stopped or busy)";

/// What a connect to a peer on this host waits for ([`Endpoint::local_wait`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalWait {
    /// The listener's process has not answered the request.
    Unanswered,
    /// The request went to the processes sharing the listener; none accepted it yet.
    Handed,
}

bitflags::bitflags! {
    /// Access rights of a memory region, as in `ibv_access_flags`. A region grants the least each
    /// use needs: remote read only while advertised in SrcAvail, remote write only while advertised
    /// in SinkAvail.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// The local HCA may write the region (receive buffers, RDMA Read sinks).
        const LOCAL_WRITE = 1 << 0;
        /// A peer may RDMA Write into the region.
        const REMOTE_WRITE = 1 << 1;
        /// A peer may RDMA Read from the region.
        const REMOTE_READ = 1 << 2;
        /// The memory receives RDMA Read responses (a Read's local SGE; needs `LOCAL_WRITE`).
        /// IB and RoCE need nothing more for that; iWARP places read data as a remote write
        /// tagged with the sink's key, so there the `rdma` provider adds remote write, and
        /// only to what asked for this flag: engine bounce buffers and a zero-copy sink's
        /// [`Grant`], never every locally writable region.
        const READ_SINK = 1 << 3;
    }
}

/// A window of a registered region advertised to a peer (SrcAvail, SinkAvail): its own keys,
/// reaching only `len` bytes at `addr` with only the access it was asked for, until
/// [`MemoryRegion::revoke`] (or the region's deregistration). A peer Read or Write through
/// `rkey` outside the window, without its right, or after the revocation fails with
/// [`WcStatus::RemoteAccess`]. `lkey` names the same window locally (an RDMA Read sink's SGE
/// uses it: on iWARP the responder tags its data with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Grant {
    /// First byte of the window, as in [`Sge::addr`] and [`RemoteBuf::addr`].
    pub addr: u64,
    pub len: usize,
    pub lkey: u32,
    pub rkey: u32,
    /// The provider's name for the grant within its region.
    pub id: u64,
}

impl Grant {
    /// The SGE covering `len` bytes at `off` of the window.
    pub fn sge(&self, off: usize, len: u32) -> Sge {
        assert!(off + len as usize <= self.len, "sge out of the grant");
        Sge {
            addr: self.addr + off as u64,
            len,
            lkey: self.lkey,
        }
    }
}

/// A scatter/gather element: `len` bytes at `addr` inside the region whose local key is `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// The local key of a SEND's payload that is not registered memory but the bytes the caller of
/// [`Endpoint::post_send_inline`] hands over with the work request (verbs' `IBV_SEND_INLINE`):
/// the provider takes them during that call. In the work request the engine queues, the
/// payload's `addr` is the bytes' offset in the data of the write that made it.
pub const INLINE_LKEY: u32 = u32::MAX;

/// The payload element of `wr` if `payload` is the inline payload it carries ([`INLINE_LKEY`],
/// `payload`'s length, a SEND) and the SEND takes at most `max` bytes in all; the error every
/// provider's [`Endpoint::post_send_inline`] gives otherwise.
pub(crate) fn inline_payload(wr: &SendWr, payload: &[u8], max: usize) -> Result<Sge, VerbsError> {
    let total = wr.sge.map_or(0, |s| s.len as usize) + payload.len();
    wr.payload
        .filter(|p| {
            wr.op == SendOp::Send
                && p.lkey == INLINE_LKEY
                && p.len as usize == payload.len()
                && total <= max
        })
        .ok_or(VerbsError::Invalid(
            "an inline payload that does not match its request",
        ))
}

/// The far side of an RDMA Read or Write: an address and remote key the peer advertised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteBuf {
    pub addr: u64,
    pub rkey: u32,
}

/// What a send work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SendOp {
    /// Two-sided SEND of the local bytes; consumes one receive at the peer.
    Send,
    /// RDMA Write of the local bytes into the peer's memory (`len == 0` is the keepalive probe).
    Write(RemoteBuf),
    /// RDMA Read of the peer's memory into the local buffer.
    Read(RemoteBuf),
}

/// A work request for the send queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SendWr {
    pub wr_id: u64,
    pub op: SendOp,
    /// Local memory; `None` only for zero-length RDMA Writes.
    pub sge: Option<Sge>,
    /// SEND only: more local memory gathered after `sge` into the same message (a header
    /// from one registration, the payload from another, without copying them together).
    pub payload: Option<Sge>,
    /// Ask for a completion even on success (SDP signals every send it needs to account for).
    pub signaled: bool,
    /// SEND only: the message brings the peer's reader something (`IBV_SEND_SOLICITED`): data
    /// or an offer of it. A provider with direct wakeups ([`Endpoint::give_direct_wake`]) wakes
    /// the reader straight for these; the rest (credits, acknowledgements) go to the peer's
    /// notify fd.
    pub solicited: bool,
    /// SEND only: the peer's engine must see this message at once, not only its reader: it
    /// takes the last receives the peer gave us credits for, and a reader that reads nothing
    /// would leave them unreplaced. A provider that wakes the reader alone for solicited
    /// SENDs wakes the peer's notify fd too for these; others need do nothing.
    pub wake_engine: bool,
}

/// A work request for the receive queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecvWr {
    pub wr_id: u64,
    pub sge: Sge,
}

/// A work request the engine wants posted, in the order it wants them posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkRequest {
    Send(SendWr),
    Recv(RecvWr),
}

/// Which work request a completion reports on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    Send,
    RdmaWrite,
    RdmaRead,
    Recv,
}

/// Completion status, as in `ibv_wc_status` folded to what the engine must tell apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    Success,
    /// The QP went to the error state and this request was flushed without being executed.
    Flushed,
    /// Local protection/length error: a bad lkey or SGE.
    LocalProtection,
    /// The device could not carry the request out on the QP's connection
    /// (`IBV_WC_LOC_QP_OP_ERR`). soft-iWARP (siw) completes a send so when its TCP stream
    /// failed under it: the peer closed or reset the connection (after an orderly close, a
    /// message still under way when the peer tore down).
    LocalQpOp,
    /// The peer refused the access: bad rkey, out of bounds, or access flags forbid it.
    RemoteAccess,
    /// The peer had no receive posted for too long (RNR retries exhausted).
    RnrRetryExceeded,
    /// Transport retries exhausted: the peer or the path is gone.
    RetryExceeded,
    /// Anything else the provider reports (kept for the error message).
    Other(u32),
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Completion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    /// Bytes received (receives) or transferred (RDMA Read).
    pub byte_len: u32,
}

/// Largest private data of a connect request: what the RDMA CM leaves under `RDMA_PS_TCP` on
/// IB/RoCE (92 bytes of CM REQ private data less the CM's own 36-byte header). Every provider
/// keeps the three limits, so SDP's messages fit whichever carries them.
pub const MAX_PRIVATE_DATA_CONNECT: usize = 56;
/// Largest private data of an accept (CM REP, `RDMA_PS_TCP`).
pub const MAX_PRIVATE_DATA_ACCEPT: usize = 196;
/// Largest private data of a reject (CM REJ, `RDMA_PS_TCP`).
pub const MAX_PRIVATE_DATA_REJECT: usize = 148;

/// Why a connection attempt or a connection ended, as the CM reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmEvent {
    /// The connection is up; active side gets the acceptor's private data.
    Established { private_data: Vec<u8> },
    /// The peer rejected us (or nobody listens on that port: `private_data` is empty and
    /// `consumer` is false).
    Rejected {
        private_data: Vec<u8>,
        consumer: bool,
    },
    /// Address resolution failed.
    AddrError,
    /// Route resolution failed.
    RouteError,
    /// The peer could not be reached during connection setup.
    Unreachable,
    /// An error after the connect request went out.
    ConnectError,
    /// The connection was disconnected (by either side, or by the fabric).
    Disconnected,
    /// The peer's process ended while its side was quiet: it had taken every message we sent
    /// and its application had read all of it, and nothing of its own was left to deliver
    /// (`Endpoint::set_settled`). Over TCP its kernel would have closed the connection in
    /// order (a FIN): we read what came, then EOF; a write of ours then meets the dead end (a
    /// reset: EPIPE). Nothing more arrives; the endpoint fails what is posted after this.
    PeerEndedSettled,
    /// The device went away: everything on it is dead.
    DeviceRemoval,
    /// The local address changed.
    AddrChange,
    /// The QP left the time-wait state; its number may be reused.
    TimewaitExit,
}

/// Errors from provider calls (not from completions, which carry a [`WcStatus`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    #[error("no RDMA device or route for {0}")]
    NoDevice(String),
    #[error("address in use")]
    AddrInUse,
    #[error("address not available")]
    AddrNotAvailable,
    #[error("queue full: {0}")]
    QueueFull(&'static str),
    #[error("out of resources: {0}")]
    NoResources(&'static str),
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("endpoint is not connected")]
    NotConnected,
    /// Nobody listens over SDP at the address, known at once (shm's rendezvous): the connect
    /// fails before any endpoint exists.
    #[error("connection refused: nobody listens over SDP there")]
    Refused,
    #[error("provider error: {0}")]
    Os(String),
}

/// Sizes an endpoint is created with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    /// Inline data asked for (a provider may give less: [`Endpoint::inline_max`]).
    pub max_inline: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_inline: 0,
        }
    }
}

/// A registered memory region.
pub trait MemoryRegion: Send {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
    /// Address of the first byte, as used in [`Sge::addr`] and [`RemoteBuf::addr`].
    fn addr(&self) -> u64;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn access(&self) -> Access;
    /// The region's bytes in this process's memory, when they live there (real providers).
    /// The pointer is valid for `len()` bytes for the life of the region. `None` for the
    /// simulator, whose memory lives in the simulated fabric.
    fn host_ptr(&self) -> Option<std::ptr::NonNull<u8>> {
        None
    }
    /// Change the access rights (`ibv_rereg_mr`); revoking remote access makes later peer
    /// accesses fail with [`WcStatus::RemoteAccess`]. This changes the whole region: to let a
    /// peer reach one transfer's bytes, use [`MemoryRegion::advertise`].
    fn set_access(&mut self, access: Access) -> Result<(), VerbsError>;
    /// Grant `access` to `len` bytes at `off` (and nothing else) under keys of their own, for
    /// one advertisement, whatever the region's own rights. `len` 0 or a range out of the
    /// region is [`VerbsError::Invalid`]; so is `REMOTE_WRITE` or `READ_SINK` without
    /// `LOCAL_WRITE`. Each grant gets a distinct rkey. Dropping the region revokes its grants.
    fn advertise(&mut self, off: usize, len: usize, access: Access) -> Result<Grant, VerbsError>;
    /// End a grant: once this returns no peer access through its keys succeeds, and none that
    /// started before is still running (providers whose peers copy by themselves wait for
    /// such copies, as a deregistration does). A grant already revoked, or of another region,
    /// is [`VerbsError::Invalid`].
    fn revoke(&mut self, grant: &Grant) -> Result<(), VerbsError>;
    /// Copy `dst.len()` bytes out of the region starting at `off`. Panics if out of bounds
    /// (a local programming error, never reachable from peer input).
    fn read(&self, off: usize, dst: &mut [u8]);
    /// Copy `src` into the region starting at `off`. Panics if out of bounds.
    fn write(&mut self, off: usize, src: &[u8]);
    /// The SGE covering `len` bytes at `off`.
    fn sge(&self, off: usize, len: u32) -> Sge {
        assert!(off + len as usize <= self.len(), "sge out of bounds");
        Sge {
            addr: self.addr() + off as u64,
            len,
            lkey: self.lkey(),
        }
    }
}

/// One connection's CM id, RC queue pair and completion queue.
pub trait Endpoint: Send {
    /// Post a receive.
    fn post_recv(&mut self, wr: &RecvWr) -> Result<(), VerbsError>;
    /// Post a SEND, RDMA Write or RDMA Read. A provider that executes work requests in the
    /// caller (shm) may complete them at once: those completions wait in the CQ and do not
    /// make the notify fd readable (the driver takes them right after it posts,
    /// [`Endpoint::poll_inline`]; [`Endpoint::notify_pending`] when it leaves some behind).
    fn post_send(&mut self, wr: &SendWr) -> Result<(), VerbsError>;
    /// The largest SEND [`Endpoint::post_send_inline`] takes, its first element and inline
    /// payload together (an HCA's `max_inline_data`; 0: none, the default).
    fn inline_max(&self) -> usize {
        0
    }
    /// Post a SEND whose payload (`wr.payload`, local key [`INLINE_LKEY`]) is `payload`, the
    /// caller's bytes, which need not be registered: the provider is done with them when this
    /// returns (it copied them into the peer's receive buffer or kept a copy of its own), so
    /// the caller may reuse them at once, as a send buffer after its completion. Only where
    /// [`Endpoint::inline_max`] is not 0, for up to that many bytes in all.
    fn post_send_inline(&mut self, _wr: &SendWr, _payload: &[u8]) -> Result<(), VerbsError> {
        Err(VerbsError::Invalid(
            "this provider takes no inline payloads",
        ))
    }
    /// Post several send-queue work requests in order. A provider whose doorbell costs a
    /// system call (Soft-RoCE) rings it once for the whole list. On error, the requests
    /// before the failing one may have been posted.
    fn post_sends(&mut self, wrs: &[SendWr]) -> Result<(), VerbsError> {
        wrs.iter().try_for_each(|wr| self.post_send(wr))
    }
    /// Poll up to `out.len()` completions; returns how many were written.
    fn poll_cq(&mut self, out: &mut [Completion]) -> usize;
    /// The next CM event on this endpoint, if any.
    fn poll_cm(&mut self) -> Option<CmEvent>;
    /// Connector: whether the connect waits on a process of this host (shm), and on what: its
    /// request not answered yet by the listener's process, or handed on, unanswered, to the
    /// processes that share the listener (after a fork; the connect completes when one of them
    /// accepts). `None`: not connecting, or a peer elsewhere (its fabric's time).
    fn local_wait(&self) -> Option<LocalWait> {
        None
    }
    /// Direct wakeups (a provider whose peer runs on this host: shm). Give the peer `fd`, a
    /// socket; while direct wakeups are on ([`Endpoint::set_direct_wake`]) the peer writes one
    /// byte into it for each solicited SEND it delivers here instead of making our notify fd
    /// readable, so the thread that waits on the socket's other end wakes with one hop, not
    /// two through a progress thread. False where the provider has no such path.
    fn give_direct_wake(&mut self, _fd: BorrowedFd<'_>) -> bool {
        false
    }
    /// Turn direct wakeups on or off. Once off, SENDs wake the notify fd again, and any that
    /// went by a direct wakeup only has been made known to it; with `settle`, also returns
    /// only once no byte of the peer's can arrive in the socket any more.
    fn set_direct_wake(&self, _on: bool, _settle: bool) {}
    /// Whether the reader behind the socket given by [`Endpoint::give_direct_wake`] needs a
    /// byte per SEND (`level` false: an edge-triggered epoll set or O_ASYNC watches its fd,
    /// which must see an edge per arrival) or only one while any is unread (`level`: poll,
    /// select, level-triggered epoll and blocking reads see the same fd readable). Off (a byte
    /// per SEND) until set.
    fn set_direct_level(&self, _level: bool) {}
    /// With [`Endpoint::set_direct_level`] on, the peer writes no byte while one of its bytes
    /// is unread: this says none is any more. The reader calls it (with no lock: it is a store
    /// to shared memory) before every receive that takes bytes out of the socket, then looks
    /// for SENDs announced meanwhile; `None` where the provider has no direct wakeups.
    fn direct_unread_clear(&self) -> Option<std::sync::Arc<dyn Fn() + Send + Sync>> {
        None
    }
    /// A wait, to run without any lock, that ends once every direct wakeup byte of the SENDs
    /// taken so far is in the socket (or a short bound passed); `None` if there is nothing to
    /// wait for. A reader that took every SEND and then takes the bytes back leaves none behind
    /// that announces nothing.
    fn direct_settler(&self) -> Option<Box<dyn FnOnce() + Send>> {
        None
    }
    /// Our side is settled (or not any more): the engine took every message that arrived,
    /// the application read all of it, and nothing of ours is left to deliver. A provider
    /// that can tell the peer so (shm: a word of the inbox the peer maps) lets it end the
    /// connection as TCP's FIN would if this process ends now (`CmEvent::PeerEndedSettled`:
    /// a SIGKILL, a crash), not as a reset. Called after every change; cheap when nothing
    /// changed.
    fn set_settled(&self, _settled: bool) {}
    /// Completions a post made at once (a provider that executes work requests in the
    /// caller), taken without looking for anything new from the peer (no receive is
    /// harvested): the driver hands them to the engine right after it posts. Providers whose
    /// completions come later have none.
    fn poll_inline(&mut self, _out: &mut [Completion]) -> usize {
        0
    }
    /// The caller leaves completions in the CQ that a post made at once: make the notify fd
    /// readable if the owner armed, as for any other completion. (Providers whose completions
    /// always come through the notify fd have nothing to do.)
    fn notify_pending(&self) {}
    /// True when nothing happened to the endpoint since it was last polled: `poll_cq` and
    /// `poll_cm` would find nothing and the provider has no work of its own pending on it
    /// (queued sends, a copy in progress, a check that is due). A cheap look (a few loads)
    /// that lets a progress round pass idle connections by. `false` is always correct (the
    /// default: the endpoint is polled every round).
    fn quiet(&self) -> bool {
        false
    }
    /// The index under which [`Provider::take_news`] reports this endpoint, if the provider
    /// reports it there (`None`: it must be looked at in every round).
    fn news_token(&self) -> Option<usize> {
        None
    }
    /// The connection is to go on in a fork child of this process (`daemon()`): ask the peer
    /// to pause its copies into and out of our memory until the child says where it is
    /// ([`Endpoint::moved_here`]). False where the connection cannot move (not connected, or a
    /// provider whose state does not survive a fork: rdma's queue pairs).
    fn pause_peer(&mut self) -> bool {
        false
    }
    /// The peer answered [`Endpoint::pause_peer`]: none of its copies is under way and none
    /// starts until [`Endpoint::moved_here`].
    fn peer_paused(&self) -> bool {
        false
    }
    /// The peer's process is stopped (SIGSTOP, a tracer): it would answer no
    /// [`Endpoint::pause_peer`] until continued. False where the provider cannot tell.
    fn peer_stopped(&self) -> bool {
        false
    }
    /// In the process that goes on with the connection (the fork child, or the mover itself
    /// when its fork failed): tell the peer, which resumes with this process. False if the
    /// peer was not paused or could not be told (the connection cannot go on).
    fn moved_here(&mut self) -> bool {
        false
    }
    /// Passive side: accept the connect request with our private data.
    fn accept(&mut self, private_data: &[u8]) -> Result<(), VerbsError>;
    /// Passive side: refuse the connect request.
    fn reject(&mut self, private_data: &[u8]) -> Result<(), VerbsError>;
    /// Start a disconnect; outstanding work is flushed and `Disconnected` follows.
    fn disconnect(&mut self) -> Result<(), VerbsError>;
    fn local_addr(&self) -> SocketAddr;
    fn peer_addr(&self) -> SocketAddr;
}

/// A listening CM id.
pub trait Listener: Send {
    type Endpoint: Endpoint;
    /// The next connect request: a new endpoint (not yet accepted) and the peer's private data.
    fn poll_request(&mut self) -> Option<(Self::Endpoint, Vec<u8>)>;
    fn local_addr(&self) -> SocketAddr;
    /// Hand every request from now on, unanswered, to whichever process takes it from `to`
    /// (a seqpacket socket whose other end processes sharing the listener hold: a forked
    /// worker's [`Listener::adopt`] answers it). Providers whose requests cannot move between
    /// processes refuse.
    fn set_handoff(&mut self, to: std::os::fd::OwnedFd) -> Result<(), VerbsError> {
        let _ = to;
        Err(VerbsError::Invalid(
            "this provider cannot hand requests to another process",
        ))
    }
    /// Refuse new requests from now on (`on`) with [`REJECT_SDP_OFF`], as early as the
    /// provider can (shm: at the rendezvous, before a request is handed to another process);
    /// requests taken in already are answered. Providers without an earlier point leave it to
    /// the driver, which refuses what [`Listener::poll_request`] brings.
    fn set_refusing(&mut self, on: bool) {
        let _ = on;
    }
    /// Requests handed off so far ([`Listener::set_handoff`]).
    fn handed_off(&self) -> u64 {
        0
    }
    /// Requests taken in but not yet answered (their connect request still to come).
    fn unanswered(&self) -> usize {
        0
    }
    /// Answer a request another process's listener handed off (from its queue): it comes out
    /// of [`Listener::poll_request`] as this listener's own.
    fn adopt(&mut self, request: std::os::fd::OwnedFd) -> Result<(), VerbsError> {
        let _ = request;
        Err(VerbsError::Invalid(
            "this provider cannot adopt another process's requests",
        ))
    }
}

/// A device context with its protection domain and connection manager.
pub trait Provider: Send + Sync {
    type Mr: MemoryRegion;
    type Endpoint: Endpoint;
    type Listener: Listener<Endpoint = Self::Endpoint>;

    /// A short name ("sim", "rdma", "shm").
    fn name(&self) -> &'static str;
    /// Whether a zero-copy send should go as SENDs whose payload is gathered straight from
    /// the registered source (the receiver copies it out of its receive buffers) rather than
    /// SrcAvail + RDMA Read. True for software RDMA devices (Soft-RoCE, siw): their kernel
    /// copies every byte into packets anyway, so an RDMA Read saves no copy, costs a round
    /// trip and puts all the packet work on the reader's CPU, while a SEND splits the work
    /// between the two ends. `Config::zcopy_by_send` overrides it.
    fn prefers_send_gather(&self) -> bool {
        false
    }
    /// Whether split zero copy (`Config::zcopy_split`: some sources by the peer's RDMA Read,
    /// the rest by gathered SENDs) suits the device, where [`Provider::prefers_send_gather`]
    /// holds. False where the device's RDMA Reads are not safe against the source's prompt
    /// revocation (Soft-RoCE: see the rdma provider). `Config::zcopy_split` overrides it.
    fn prefers_split_zcopy(&self) -> bool {
        self.prefers_send_gather()
    }
    /// The smallest plain write worth staging (`Config::staged_send_min`): a copy into a
    /// registered buffer of ours the peer RDMA-reads, in place of Data messages; 0: never.
    fn staged_send_min(&self) -> usize {
        0
    }
    /// Whether the connecting side must send the first message of a connection before the
    /// accepting side sends anything (iWARP: MPA requires it; `Config::initiator_sends_first`).
    fn initiator_sends_first(&self) -> bool {
        false
    }
    /// Register `len` zeroed bytes with the given access.
    fn reg_mr(&self, len: usize, access: Access) -> Result<Self::Mr, VerbsError>;
    /// Register memory the caller owns (`ibv_reg_mr` on an existing buffer), for zero-copy
    /// from and into application buffers. Dropping the region deregisters it and leaves the
    /// memory alone. Providers that cannot do this return [`VerbsError::Invalid`].
    ///
    /// # Safety
    /// `addr..addr + len` must stay allocated for the life of the returned region, and while
    /// the region grants remote access the caller must expect the peer to read or write it.
    unsafe fn reg_mr_at(
        &self,
        addr: std::ptr::NonNull<u8>,
        len: usize,
        access: Access,
    ) -> Result<Self::Mr, VerbsError> {
        let _ = (addr, len, access);
        Err(VerbsError::Invalid(
            "this provider cannot register caller memory",
        ))
    }
    /// Listen on `addr` (port 0 picks one); endpoints for incoming requests get `caps`.
    fn listen(
        &self,
        addr: SocketAddr,
        backlog: u32,
        caps: QpCaps,
    ) -> Result<Self::Listener, VerbsError>;
    /// A listener for `addr` that takes no requests of its own, only those other processes
    /// sharing a listener on `addr` hand it ([`Listener::adopt`]).
    fn listen_adopted(
        &self,
        addr: SocketAddr,
        backlog: u32,
        caps: QpCaps,
    ) -> Result<Self::Listener, VerbsError> {
        let _ = (addr, backlog, caps);
        Err(VerbsError::Invalid(
            "this provider cannot adopt another process's requests",
        ))
    }
    /// Start connecting to `dst` with our private data; `Established` or an error follows as a
    /// CM event on the endpoint.
    fn connect(
        &self,
        dst: SocketAddr,
        src: Option<SocketAddr>,
        caps: QpCaps,
        private_data: &[u8],
    ) -> Result<Self::Endpoint, VerbsError>;

    /// An fd that polls readable when any endpoint or listener of this provider may have
    /// something new (a completion, a CM event, a connect request) since the last [`arm`].
    /// `None`: the provider cannot notify and must be polled (the simulator).
    ///
    /// The waiting protocol of a progress loop: `arm()`, then poll every endpoint and
    /// listener once more, then sleep on this fd only if that found nothing. Anything that
    /// arrives after `arm()` makes the fd readable, so no wakeup is lost.
    ///
    /// [`arm`]: Provider::arm
    fn notify_fd(&self) -> Option<RawFd> {
        None
    }
    /// Consume the notifications pending on [`Provider::notify_fd`] and ask for a
    /// notification at the next completion or event on every endpoint and listener.
    fn arm(&self) -> Result<(), VerbsError> {
        Ok(())
    }
    /// Append the [`Endpoint::news_token`]s of endpoints something may have happened to since
    /// they were last polled (a peer's change, activity on their socket that [`arm`] saw), so
    /// that a round of progress can look at those alone; an endpoint that is not
    /// [`Endpoint::quiet`] for its own reasons (queued completions, sends or events) is the
    /// caller's to remember. A token may be reported needlessly, never missed. `false`: the
    /// provider cannot tell, every endpoint must be looked at (the default).
    ///
    /// [`arm`]: Provider::arm
    fn take_news(&self, out: &mut Vec<usize>) -> bool {
        let _ = out;
        false
    }
    /// Whether the device went away (RDMA: a `DEVICE_REMOVAL` event on any of the provider's
    /// CM ids). Every endpoint and listener of it is dead (each reports
    /// [`CmEvent::DeviceRemoval`]); the device itself is freed only when everything made on it
    /// is gone: drop every endpoint, listener and region, then call
    /// [`Provider::release_device`]. Until then the kernel cannot finish removing it (`rdma
    /// link delete` waits on a device without `disassociate_ucontext`, as Soft-RoCE).
    fn device_lost(&self) -> bool {
        false
    }
    /// After [`Provider::device_lost`], once every endpoint, listener and region made on it is
    /// dropped: give up the provider's own hold on the device (its protection domain,
    /// completion channel, CM id). Every later call fails with [`VerbsError::NoDevice`]; the
    /// notify fd stays valid. Objects still alive keep the device until they are dropped.
    fn release_device(&self) {}
}

/// The checks every provider's [`MemoryRegion::advertise`] makes of its arguments.
pub(crate) fn check_grant(
    region_len: usize,
    off: usize,
    len: usize,
    access: Access,
) -> Result<(), VerbsError> {
    if len == 0 || off.checked_add(len).is_none_or(|end| end > region_len) {
        return Err(VerbsError::Invalid("grant out of the region"));
    }
    if access.intersects(Access::REMOTE_WRITE | Access::READ_SINK)
        && !access.contains(Access::LOCAL_WRITE)
    {
        return Err(VerbsError::Invalid(
            "REMOTE_WRITE and READ_SINK need LOCAL_WRITE",
        ));
    }
    Ok(())
}
