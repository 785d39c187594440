//! The connection: state machine, and the engine's whole public surface: every `pub fn` of
//! [`Conn`] is in this file (application calls, inputs from below, outputs to poll). The
//! sublayers do the work behind them: [`super::credits`] (sequence numbers and credits),
//! [`super::timers`], the send half ([`send`], [`sent`], [`write`](mod@write)) and the receive
//! half ([`recv`], [`rcvd`], [`read`]).
//!
//! Those step modules, with [`timeouts`] (what each timer does), are this module's children,
//! though their files sit beside this one in `proto/`: `Conn`'s fields are private, seen only
//! here and by them; everything else goes through methods.

use std::collections::VecDeque;

use super::advt::Advts;
use super::buff::BufStore;
pub use super::config::Config;
use super::credits::Credits;
pub use super::error::{CallError, ConnError, ProtocolError};
use super::iocb::{Iocbs, Staging, ZSink, ZSrc};
use super::msgs::{self, Ext, Header, Hello, HelloAck, Mid};
use super::rx::{RxHalf, RxItem};
use super::timers::{Timer, TimerTable};
use super::tx::{Inflight, TxHalf};
use super::Instant;
use crate::verbs::{CmEvent, Completion, WcStatus, WorkRequest};

// The protocol steps: files beside this one in `proto/` (the original check-in's file list),
// but child modules of this one, so that they see `Conn`'s private fields. `proto` re-exports
// them under their own names (`proto::send`, ...).
#[path = "rcvd.rs"]
pub mod rcvd;
#[path = "read.rs"]
pub mod read;
#[path = "recv.rs"]
pub mod recv;
#[path = "send.rs"]
pub mod send;
#[path = "sent.rs"]
pub mod sent;
#[path = "timeouts.rs"]
pub mod timeouts;
#[path = "write.rs"]
pub mod write;

/// Where the connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Active side: Hello sent, waiting for the CM to report the HelloAck.
    Connecting,
    /// Passive side: HelloAck sent, waiting for the CM to report established.
    Accepting,
    /// Data flows (each direction may be half-closed: see [`Conn::read_closed`] and
    /// [`Conn::write_closed`]).
    Established,
    /// Both DisConns exchanged (or an abort sent): waiting for the CM disconnect to finish.
    Disconnecting,
    /// Finished; every buffer has been given back to the store.
    Closed,
}

/// Which halves to shut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shutdown {
    Read,
    Write,
    Both,
}

/// What the driver must ask of the connection manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmAction {
    /// Disconnect the endpoint (flushes outstanding work; `Disconnected` follows).
    Disconnect,
}

/// Notifications for the application.
///
/// Readiness is not among them: whether a read or a write would block is read from the
/// connection's state after each round of progress ([`Conn::is_readable`],
/// [`Conn::read_ready`], [`Conn::is_writable`]; the socket layer through the driver's
/// `ConnView`), as often as that changes, so there is no event to miss or to pile up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The connection is established.
    Connected,
    /// Urgent data arrived (SIGURG).
    Urgent,
    /// A zero-copy send finished: `bytes` of it reached the peer. Fewer than offered means the
    /// peer cancelled or the transfer timed out; the rest must be sent again (by copy).
    ZcopySent { token: u64, bytes: usize },
    /// A zero-copy receive finished with `bytes` in the caller's sink (0: nothing was placed there;
    /// read the data the usual way).
    ZcopyReceived { token: u64, bytes: usize },
    /// The connection is finished and its resources are released. `None` for an orderly close.
    Closed(Option<ConnError>),
}

/// Counters of one connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnStats {
    pub msgs_sent: u64,
    pub msgs_rcvd: u64,
    pub data_bytes_sent: u64,
    pub data_bytes_rcvd: u64,
    pub credit_updates_sent: u64,
    pub zcopy_read_bytes: u64,
    pub zcopy_write_bytes: u64,
    /// Zero-copy source bytes sent as Data messages gathered from the source.
    pub zcopy_send_bytes: u64,
    pub srcavail_sent: u64,
    pub srcavail_cancelled: u64,
    /// Plain writes staged (`Config::staged_send_min`): copied into a buffer of ours the
    /// peer reads.
    pub staged_sends: u64,
    /// Data bytes sent as inline payloads, taken by the provider from the writer's memory
    /// ([`Conn::write_inline`]).
    pub inline_send_bytes: u64,
    /// Zero-copy sources that timed out (`srcavail_timeout`, or a plain write's stall bound:
    /// the peer was not taking them).
    pub zcopy_stalls: u64,
    pub sinkavail_sent: u64,
    pub sinkavail_cancelled: u64,
    /// SinkAvails overtaken by the peer's Data (it drops them as stale): done empty at once.
    pub sinkavail_stale: u64,
    pub keepalives_sent: u64,
    pub resizes: u64,
    pub stalls_no_credit: u64,
}

/// What moves a [`ConnStats`] counter ([`Conn::count`]): one variant per counter, with the
/// amount for byte counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Count {
    MsgSent,
    MsgRcvd,
    DataBytesSent(u64),
    DataBytesRcvd(u64),
    CreditUpdateSent,
    ZcopyReadBytes(u64),
    ZcopyWriteBytes(u64),
    ZcopySendBytes(u64),
    SrcAvailSent,
    SrcAvailCancelled(u64),
    StagedSends,
    InlineSendBytes(u64),
    ZcopyStall,
    SinkAvailSent,
    SinkAvailCancelled,
    SinkAvailStale,
    KeepaliveSent,
    Resize,
    StallNoCredit,
}

impl ConnStats {
    #[inline]
    fn record(&mut self, c: Count) {
        match c {
            Count::MsgSent => self.msgs_sent += 1,
            Count::MsgRcvd => self.msgs_rcvd += 1,
            Count::DataBytesSent(n) => self.data_bytes_sent += n,
            Count::DataBytesRcvd(n) => self.data_bytes_rcvd += n,
            Count::CreditUpdateSent => self.credit_updates_sent += 1,
            Count::ZcopyReadBytes(n) => self.zcopy_read_bytes += n,
            Count::ZcopyWriteBytes(n) => self.zcopy_write_bytes += n,
            Count::ZcopySendBytes(n) => self.zcopy_send_bytes += n,
            Count::SrcAvailSent => self.srcavail_sent += 1,
            Count::SrcAvailCancelled(n) => self.srcavail_cancelled += n,
            Count::StagedSends => self.staged_sends += 1,
            Count::InlineSendBytes(n) => self.inline_send_bytes += n,
            Count::ZcopyStall => self.zcopy_stalls += 1,
            Count::SinkAvailSent => self.sinkavail_sent += 1,
            Count::SinkAvailCancelled => self.sinkavail_cancelled += 1,
            Count::SinkAvailStale => self.sinkavail_stale += 1,
            Count::KeepaliveSent => self.keepalives_sent += 1,
            Count::Resize => self.resizes += 1,
            Count::StallNoCredit => self.stalls_no_credit += 1,
        }
    }
}

/// What [`Conn::read_zcopy`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZRecv {
    /// The transfer is under way; [`Event::ZcopyReceived`] reports it.
    Pending,
    /// Data (or EOF) is already queued, the sink is too small, or the peer streams by SEND
    /// (its Data overtook our recent offers, so this one is not made): use [`Conn::read`].
    Copy,
}

/// Which side opened the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Active,
    Passive,
}

/// Work request id layout: the top byte says what kind of work it was.
mod wrid {
    pub const RECV: u64 = 1 << 56;
    pub const SEND: u64 = 2 << 56;
    pub const READ: u64 = 3 << 56;
    pub const WRITE: u64 = 4 << 56;
    pub const KEEPALIVE: u64 = 5 << 56;
    pub const KIND_MASK: u64 = 0xff << 56;
    pub const INDEX_MASK: u64 = !KIND_MASK;
}

/// Bytes of a received message we read to parse its header, and the size of a control
/// message's send buffer: room for the longest header
/// ([`MAX_HEADER_LEN`](super::msgs::MAX_HEADER_LEN), 36 bytes: a SinkAvail) with slack.
const MAX_HDR: usize = 48;
const _: () = assert!(MAX_HDR >= super::msgs::MAX_HEADER_LEN);

/// One SDP connection (see the module docs).
pub struct Conn<S: BufStore> {
    cfg: Config,
    /// Send-side completions handled ([`Conn::send_completions`]).
    send_wcs: u64,
    store: S,
    state: State,
    role: Role,
    error: Option<ConnError>,
    /// Where in the engine `error` was decided (for `sdpstat` and `SDP_TRACE`: which of the
    /// several paths to a reset, say, this connection took).
    error_site: Option<&'static std::panic::Location<'static>>,

    // Negotiated at setup.
    /// Largest message we may send (the peer's receive buffer size).
    send_size: u32,
    /// Advertisements the peer accepts outstanding.
    peer_max_adverts: u8,

    /// Sequence numbers and credits.
    credits: Credits,

    /// The send half (moved along by send.rs, sent.rs, write.rs).
    tx: TxHalf,
    /// The receive half (moved along by recv.rs, rcvd.rs, read.rs).
    rx: RxHalf,
    /// An urgent byte (MSG_OOB) not read yet.
    urgent: Option<u8>,
    /// The urgent mark, as the stream bytes left to read before it (TCP's urgent pointer): a
    /// read stops there, and at 0 the next byte read is the one after the urgent byte
    /// (SIOCATMARK). A read from the mark goes past it and ends it.
    urg_mark: Option<u64>,
    /// SO_OOBINLINE: the urgent byte stays in the stream, at the mark.
    oob_inline: bool,
    /// The urgent byte at the mark (taken out of the stream), read apart or not: a later urgent
    /// byte before the reader reached this mark puts it back in the stream, as Linux's TCP.
    urg_byte: Option<u8>,

    // Zero copy (advt.rs, iocb.rs, read.rs, write.rs).
    advts: Advts,
    iocbs: Iocbs,
    /// Buffers of staged writes (send.rs, write.rs).
    staging: Staging,
    /// Read a peer's SrcAvails into bounce buffers as they arrive ([`Conn::set_read_ahead`]).
    read_ahead: bool,

    // Close.
    shut_rd: bool,
    shut_wr: bool,
    disconn_sent: bool,
    disconn_rcvd: bool,
    app_closed: bool,
    disconnect_issued: bool,
    /// Setup finished once (the connection was established, whatever happened since).
    was_established: bool,
    /// Waiting in a listener's queue for the application to accept it
    /// ([`Conn::accept_queued`]): `min_rx_bufs` receive buffers posted, `unaccepted_rx_bufs`
    /// posted or held at most, no growth, until [`Conn::set_accepted`].
    queued: bool,

    timers: TimerTable,

    // Outputs.
    wrs: VecDeque<WorkRequest>,
    /// The accepting side of a transport whose connecting side sends first
    /// (`Config::initiator_sends_first`): sends stay queued until a receive completes.
    hold_sends: bool,
    cm: VecDeque<CmAction>,
    /// Application events, pushed only by [`Conn::emit`].
    events: VecDeque<Event>,

    /// Counters, moved only by [`Conn::count`] (read with [`Conn::stats`]).
    stats: ConnStats,
}

pub use super::credits::{CTRL_CREDITS, DATA_CREDITS, MIN_RX_POSTED};

impl<S: BufStore> Conn<S> {
    fn new(cfg: Config, store: S, role: Role, now: Instant) -> Conn<S> {
        let rcv = cfg.rcv_size;
        let mut timers = TimerTable::new(now);
        timers.start(Timer::Setup, now + cfg.connect_timeout);
        Conn {
            send_wcs: 0,
            send_size: 0,
            peer_max_adverts: 0,
            credits: Credits::default(),
            tx: TxHalf::new(rcv, MAX_HDR as u32),
            rx: RxHalf::new(rcv, cfg.initial_rx_bufs),
            urgent: None,
            urg_mark: None,
            oob_inline: false,
            urg_byte: None,
            advts: Advts::default(),
            iocbs: Iocbs::default(),
            staging: Staging::default(),
            read_ahead: false,
            shut_rd: false,
            shut_wr: false,
            disconn_sent: false,
            disconn_rcvd: false,
            app_closed: false,
            disconnect_issued: false,
            was_established: false,
            queued: false,
            timers,
            wrs: VecDeque::new(),
            hold_sends: role == Role::Passive && cfg.initiator_sends_first == Some(true),
            cm: VecDeque::new(),
            events: VecDeque::new(),
            stats: ConnStats::default(),
            cfg,
            store,
            state: State::Closed,
            role,
            error: None,
            error_site: None,
        }
    }

    /// Open the active side: posts the first receive buffers and returns the Hello to put in the
    /// CM connect request's private data. `src_port` is our local port (informational).
    pub fn connect(
        cfg: Config,
        store: S,
        now: Instant,
        src_port: u16,
        ipv6: bool,
    ) -> Result<(Conn<S>, Vec<u8>), ConnError> {
        cfg.validate()
            .map_err(|_| ConnError::Protocol(ProtocolError::Setup("bad config")))?;
        let mut c = Conn::new(cfg, store, Role::Active, now);
        c.state = State::Connecting;
        c.fill_rx()?;
        let hello = Hello {
            version: msgs::SDP_VERSION,
            ip_version: if ipv6 { 6 } else { 4 },
            max_adverts: c.cfg.max_adverts,
            desired_rcv_size: c.cfg.rcv_size,
            local_rcv_size: c.cfg.rcv_size,
            src_port,
        };
        let bufs = c.rx_posted_count();
        let (mseq, mseq_ack) = c.credits.hello_sent(bufs);
        let h = Header::new(
            Mid::Hello,
            Ext::Hello(hello),
            msgs::BsdhFlags::empty(),
            bufs,
            mseq,
            mseq_ack,
            0,
        );
        Ok((c, emit_private(&h)))
    }

    /// Open the passive side from the peer's Hello (the connect request's private data). On
    /// success returns the HelloAck to accept with; on error the request must be rejected (the
    /// error says why).
    pub fn accept(
        cfg: Config,
        store: S,
        now: Instant,
        private_data: &[u8],
    ) -> Result<(Conn<S>, Vec<u8>), ConnError> {
        Conn::accept_with(cfg, store, now, private_data, false)
    }

    /// [`Conn::accept`] for a connection that waits in a listener's queue until the
    /// application accepts it: until [`Conn::set_accepted`] it posts `min_rx_bufs` receive
    /// buffers of `rcv_size` at a time, holds at most `unaccepted_rx_bufs` with what the peer
    /// sent before the application accepts (then the peer waits for credits, as a TCP sender
    /// waits for a window), does not grow them (slow start, ChRcvBuf) and reads no zero-copy
    /// source ahead. A connection nobody accepts costs a few buffers, whatever its peer does.
    pub fn accept_queued(
        cfg: Config,
        store: S,
        now: Instant,
        private_data: &[u8],
    ) -> Result<(Conn<S>, Vec<u8>), ConnError> {
        Conn::accept_with(cfg, store, now, private_data, true)
    }

    fn accept_with(
        cfg: Config,
        store: S,
        now: Instant,
        private_data: &[u8],
        queued: bool,
    ) -> Result<(Conn<S>, Vec<u8>), ConnError> {
        cfg.validate()
            .map_err(|_| ConnError::Protocol(ProtocolError::Setup("bad config")))?;
        let h = Header::parse_private_data(private_data).map_err(ProtocolError::from)?;
        let hello = match h.ext {
            Ext::Hello(hello) => hello,
            _ => return Err(ProtocolError::Setup("connect request without a Hello").into()),
        };
        if h.bsdh.mseq != 0 || h.bsdh.mseq_ack != 0 {
            return Err(ProtocolError::Setup("Hello with nonzero sequence numbers").into());
        }
        if h.bsdh.bufs == 0 {
            return Err(ProtocolError::Setup("Hello with no receive buffers").into());
        }
        let mut c = Conn::new(cfg, store, Role::Passive, now);
        c.state = State::Accepting;
        c.queued = queued;
        c.send_size = hello.local_rcv_size;
        c.peer_max_adverts = hello.max_adverts;
        c.credits.hello_rcvd(h.bsdh.bufs);
        // Honour the size the peer would like to send with, within our limits (a queued
        // connection keeps ours; the peer asks again with ChRcvBuf under load).
        let want = if queued {
            c.cfg.rcv_size
        } else {
            hello
                .desired_rcv_size
                .clamp(c.cfg.rcv_size, c.cfg.max_rcv_size)
        };
        c.rx.set_size(want);
        c.tx.set_size(c.send_size);
        c.fill_rx()?;
        let ack = HelloAck {
            version: msgs::SDP_VERSION,
            max_adverts: c.cfg.max_adverts,
            actual_rcv_size: want,
            desired_rcv_size: c.cfg.rcv_size,
        };
        let bufs = c.rx_posted_count();
        let (mseq, mseq_ack) = c.credits.hello_sent(bufs);
        let h = Header::new(
            Mid::HelloAck,
            Ext::HelloAck(ack),
            msgs::BsdhFlags::empty(),
            bufs,
            mseq,
            mseq_ack,
            0,
        );
        Ok((c, emit_private(&h)))
    }

    /// Test hook (feature `harness`): move every sequence number of this connection by `ours`
    /// (its own messages) and `peers` (the peer's), as if the Hellos had carried other initial
    /// sequence numbers (the wire's are 0). Call it on both ends of a quiet connection (no
    /// message in flight) with the offsets swapped on the peer, and the stream runs on across
    /// the wrap at `u32::MAX`.
    #[cfg(feature = "harness")]
    #[doc(hidden)]
    pub fn shift_sequence_numbers(&mut self, ours: u32, peers: u32) {
        self.credits.shift(ours, peers);
        self.advts.shift(ours);
    }
    /// Our next message's sequence number (diagnostics).
    pub fn next_mseq(&self) -> u32 {
        self.credits.next_mseq()
    }
    /// The connection's state.
    pub fn state(&self) -> State {
        self.state
    }

    /// True on the side that opened the connection.
    pub fn is_active(&self) -> bool {
        self.role == Role::Active
    }
    /// Setup finished at some point: the connection was established (it may have ended
    /// since). A passive connection that never was is not one `accept` hands over.
    pub fn was_established(&self) -> bool {
        self.was_established
    }
    /// Still waiting for the application to accept it (see [`Conn::accept_queued`]).
    pub fn is_queued(&self) -> bool {
        self.queued
    }
    /// The application accepted the connection: from now on it posts and grows its receive
    /// buffers as any other (and tells the peer, which may be waiting for credits; if it is
    /// still being set up, once it is established).
    pub fn set_accepted(&mut self, now: Instant) {
        if !self.queued {
            return;
        }
        self.queued = false;
        if self.state != State::Established {
            return;
        }
        self.flush(now);
        self.open_window();
        self.start_eager_reads();
    }
    /// A connection that was queued was told of `min_rx_bufs` buffers at a time: tell the peer
    /// of the others now (unless a message of ours just did), as a TCP receiver opens its
    /// window. Any other connection has told the peer of every buffer it posted.
    fn open_window(&mut self) {
        if self.state == State::Established
            && !self.queued
            && self.credits.peer_unaware(self.rx.posted_len() as u32)
            && self.credits.tx() > 0
            && !self.disconnect_issued
        {
            self.count(Count::CreditUpdateSent);
            self.post_ctrl(Mid::Data, Ext::None);
        }
    }
    /// Receive buffers posted plus held with unread data, at most.
    fn rx_budget(&self) -> usize {
        let cap = self.rx_cap();
        if self.queued {
            self.cfg
                .unaccepted_rx_bufs
                .clamp(self.cfg.min_rx_bufs.min(cap), cap) as usize
        } else {
            cap as usize
        }
    }
    /// Receive buffers to keep posted (the slow-start target).
    fn rx_post_target(&self) -> usize {
        let target = self.rx.target().min(self.rx_cap());
        if self.queued {
            self.cfg.min_rx_bufs.min(target) as usize
        } else {
            target as usize
        }
    }
    /// The most receive buffers this connection may have (posted plus held): the stack's
    /// `max_rx_bufs`, lowered by the application's SO_RCVBUF ([`Conn::set_rcvbuf`]) to that
    /// many bytes of buffers of the current size, never below `MIN_RX_POSTED`.
    fn rx_cap(&self) -> u32 {
        let max = self.cfg.max_rx_bufs;
        match self.cfg.rcvbuf {
            None => max,
            Some(bytes) => {
                let bufs = bytes.div_ceil(self.rcv_size().max(1) as usize);
                (bufs.min(max as usize) as u32).max(MIN_RX_POSTED.min(max))
            }
        }
    }
    /// Everything that decides what the connection waits for, on one line (for `sdpstat`'s
    /// `engine` field and `SDP_TRACE`): state, close flags, sequence numbers and credits, both
    /// halves, advertisements, zero-copy blocks and timers.
    pub fn debug_state(&self) -> String {
        format!(
            "{:?} {:?} error {:?} at {:?}; shut rd {} wr {} disconn sent {} rcvd {} issued {} app closed {} queued {} hold {}; \
             {:?}; {}; {}; {:?}; {:?}; {:?}; {} wrs, {} cm, {} events",
            self.state,
            self.role,
            self.error,
            self.error_site.map(|l| format!("{}:{}", l.file(), l.line())),
            self.shut_rd,
            self.shut_wr,
            self.disconn_sent,
            self.disconn_rcvd,
            self.disconnect_issued,
            self.app_closed,
            self.queued,
            self.hold_sends,
            self.credits,
            self.tx.summary(),
            self.rx.summary(),
            self.advts,
            self.iocbs,
            self.timers,
            self.wrs.len(),
            self.cm.len(),
            self.events.len()
        )
    }
    /// Where in the engine the connection's error was decided (a source location), if it
    /// failed.
    pub fn error_site(&self) -> Option<&'static std::panic::Location<'static>> {
        self.error_site
    }
    /// The error that ended the connection, if any.
    pub fn error(&self) -> Option<&ConnError> {
        self.error.as_ref()
    }
    /// The config in force.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
    /// The buffer store (for the driver's accounting).
    pub fn store(&self) -> &S {
        &self.store
    }
    /// Credits we hold (receive buffers of the peer we may use).
    pub fn tx_credits(&self) -> u32 {
        self.credits.tx()
    }
    /// Largest message we send (the peer's receive buffer size).
    pub fn send_size(&self) -> u32 {
        self.send_size
    }
    /// Size of the receive buffers we post.
    pub fn rcv_size(&self) -> u32 {
        self.rx.size()
    }
    /// Receive buffers posted now.
    pub fn rx_posted_now(&self) -> usize {
        self.rx.posted_len()
    }
    /// Bytes buffered for sending, unacknowledged.
    pub fn tx_queued_bytes(&self) -> usize {
        self.tx.bytes()
    }
    /// Bytes received and not yet read.
    pub fn rx_queued_bytes(&self) -> usize {
        self.rx.bytes()
    }
    /// FIONREAD (SIOCINQ) as Linux answers it: the bytes received and not read, but while an
    /// urgent mark is ahead or here (without SO_OOBINLINE) only those before it (0 at the mark).
    pub fn inq_bytes(&self) -> usize {
        let all = self.rx.bytes();
        match self.urg_mark {
            Some(m) if !self.oob_inline => usize::try_from(m).map_or(all, |m| m.min(all)),
            _ => all,
        }
    }
    /// The peer sent DisConn and every byte before it has been read (reads return 0).
    pub fn read_closed(&self) -> bool {
        (self.disconn_rcvd || self.shut_rd) && self.rx.queue_empty()
    }
    /// Our write half is shut.
    pub fn write_closed(&self) -> bool {
        self.shut_wr
    }
    /// The application closed the connection and something of ours has yet to reach the
    /// peer: queued data, or the DisConn after it (until its send completes). A process that
    /// exits waits for this to clear, as the kernel finishes a closed TCP socket's sends.
    pub fn close_pending(&self) -> bool {
        self.app_closed
            && self.state == State::Established
            && !(self.disconn_sent && self.tx.nothing_inflight())
    }
    /// Bytes of a peer's SrcAvail that come next in the stream and may be read without a copy
    /// into a registered sink ([`Conn::read_zcopy`]); `None` if the next bytes are not one.
    pub fn next_is_zcopy(&self) -> Option<u32> {
        match self.rx.front() {
            Some(RxItem::Src { advt }) => self.advts.src(*advt)?.sink_readable(),
            _ => None,
        }
    }
    /// SO_OOBINLINE: urgent bytes that arrive from now on stay in the stream (at the mark),
    /// instead of waiting apart for a `MSG_OOB` read.
    pub fn set_oob_inline(&mut self, on: bool) {
        self.oob_inline = on;
    }
    /// SIOCATMARK: an urgent byte came and the next byte read is the one after it (with
    /// SO_OOBINLINE: the urgent byte itself).
    pub fn at_mark(&self) -> bool {
        self.urg_mark == Some(0)
    }
    /// TCP_NODELAY: send small writes at once instead of coalescing them.
    pub fn set_nodelay(&mut self, on: bool) {
        self.cfg.nodelay = on;
    }
    /// SO_SNDBUF: bytes the application may have queued and unacknowledged (at least 1).
    pub fn set_sndbuf(&mut self, bytes: usize) {
        self.cfg.sndbuf = bytes.max(1);
    }
    /// SO_RCVBUF: bytes of receive buffers (posted and holding unread data) the connection
    /// may have, within the stack's `max_rx_bufs` and at least `MIN_RX_POSTED` buffers; the
    /// peer's window shrinks as buffers come back (posted receives cannot be taken back), and
    /// grows again by slow start. `None`: the stack's `max_rx_bufs`.
    pub fn set_rcvbuf(&mut self, bytes: Option<usize>) {
        self.cfg.rcvbuf = bytes;
    }
    /// Receive buffer bytes the connection may have now (SO_RCVBUF in force).
    pub fn rcvbuf(&self) -> usize {
        self.rx_cap() as usize * self.rcv_size() as usize
    }
    /// A read would not block: data, EOF or an error.
    pub fn is_readable(&self) -> bool {
        match self.state {
            State::Connecting | State::Accepting => false,
            State::Closed | State::Disconnecting => true,
            State::Established => {
                self.error.is_some()
                    || !self.rx.queue_empty()
                    || self.disconn_rcvd
                    || self.shut_rd
                    || self.urgent.is_some()
            }
        }
    }
    /// A write would not block (or would fail at once).
    pub fn is_writable(&self) -> bool {
        match self.state {
            State::Connecting | State::Accepting => false,
            State::Established => {
                self.shut_wr || self.error.is_some() || self.tx.bytes() < self.cfg.sndbuf
            }
            _ => true,
        }
    }

    // ---- Writing (the send half: send.rs, write.rs) ----

    /// Copy application bytes into the send queue. Returns how many were taken (fewer than
    /// offered when the send buffer fills up).
    pub fn write(&mut self, now: Instant, data: &[u8]) -> Result<usize, CallError> {
        self.queue_bytes(now, data, 0)
    }
    /// [`Conn::write`] for a caller whose provider takes inline SENDs of up to `inline_max`
    /// bytes (header and payload) ([`crate::verbs::Endpoint::post_send_inline`]): while nothing is
    /// queued ahead and credits allow, the bytes go as Data messages whose payload the provider
    /// copies straight from `data` (no copy into a send buffer). Their work requests carry
    /// the payload as an [`crate::verbs::INLINE_LKEY`] element whose `addr` is its offset in
    /// `data`: the caller must post every work request queued before `data` goes, handing
    /// each such payload's bytes over (the driver's `write` does).
    pub fn write_inline(
        &mut self,
        now: Instant,
        data: &[u8],
        inline_max: usize,
    ) -> Result<usize, CallError> {
        self.queue_bytes(now, data, inline_max)
    }
    /// Queue a zero-copy send of registered memory (`src` must grant remote read until
    /// [`Event::ZcopySent`] for `token`). Small sources are refused with `Invalid`: copy them.
    /// Once advertised, a source the peer makes no progress on for `srcavail_timeout` is
    /// cancelled.
    pub fn write_zcopy(&mut self, now: Instant, src: ZSrc, token: u64) -> Result<(), CallError> {
        self.queue_zcopy(now, src, token, None)
    }
    /// Queue a zero-copy send that completes by zero copy only while the peer takes it: if the
    /// peer makes no progress on it for `stall` (from now while it waits in the queue, from its
    /// SrcAvail, and from each acknowledgement), it ends with what went ([`Event::ZcopySent`])
    /// and the application sends the rest by copy. A blocking write uses this, so it never
    /// waits for the peer's application longer than `stall` (TCP's returns once the bytes are
    /// in the send buffer): a cancel waits only for the peer's engine, whose SendSm answers it
    /// (its control messages always have a credit, see `DATA_CREDITS`), and a queued source
    /// ends without a message. Committed advertisements (split zero copy) are never cancelled.
    pub fn write_zcopy_bounded(
        &mut self,
        now: Instant,
        src: ZSrc,
        token: u64,
        stall: std::time::Duration,
    ) -> Result<(), CallError> {
        self.queue_zcopy(now, src, token, Some(stall))
    }
    /// Send one urgent byte (MSG_OOB): it travels as the last byte of a Data message with
    /// OOB_PRES, and the peer sees it apart from the stream.
    pub fn send_urgent(&mut self, now: Instant, byte: u8) -> Result<(), CallError> {
        self.queue_urgent(now, byte)
    }
    /// The application learns of data only from readiness ([`Conn::read_ready`]: an
    /// application fd), never by a read that would start fetching a peer's zero-copy source:
    /// read each SrcAvail at the head of the stream into bounce buffers as it arrives (and as
    /// the reader takes them), as a SEND's bytes land without a read call.
    pub fn set_read_ahead(&mut self, now: Instant) {
        self.read_ahead = true;
        self.start_eager_reads();
        self.flush(now);
    }
    /// Stage no more writes ([`Config::staged_send_min`]): the socket layer turns staging off
    /// for a connection behind an application fd (the LD_PRELOAD shim), where it showed no
    /// gain (docs/findings.md).
    pub fn stop_staging(&mut self) {
        self.cfg.staged_send_min = Some(0);
    }
    /// Bytes the application may still queue.
    pub fn send_room(&self) -> usize {
        self.tx.room(self.cfg.sndbuf)
    }
    /// Give up a queued or advertised zero-copy send. [`Event::ZcopySent`] reports how many
    /// bytes the peer got; the rest (and every later zero-copy send) must be sent again. An
    /// advertised source cancels every outstanding advertisement (one SrcAvailCancel).
    pub fn cancel_write_zcopy(&mut self, now: Instant, token: u64) {
        self.cancel_src(now, token)
    }
    /// How many of our SrcAvails may be outstanding at once (at least 1).
    pub fn src_window(&self) -> usize {
        let peer = self.peer_max_adverts.max(1);
        self.cfg
            .max_srcavail_inflight
            .min(self.cfg.max_adverts)
            .min(peer)
            .max(1) as usize
    }
    /// A zero-copy send is still queued or outstanding (plain writes wait behind it).
    pub fn zcopy_outstanding(&self) -> bool {
        self.iocbs.has_src()
    }
    /// Zero-copy sources (or split pieces) with sends in flight now (gathered SENDs or RDMA
    /// Writes; at most `Config::zcopy_split_sends` in split zero copy).
    pub fn zcopy_sends_inflight(&self) -> usize {
        self.iocbs.src_sending()
    }
    /// Our SrcAvails outstanding now (at most [`Conn::src_window`]).
    pub fn srcavail_inflight(&self) -> usize {
        self.iocbs.src_inflight()
    }

    // ---- Reading (the receive half: recv.rs, read.rs) ----

    /// Copy received bytes into `dst`. `Ok(0)` is end of stream (the peer's DisConn, after all
    /// its data, or our own read shutdown). After a failure the data received before it is
    /// still read first, then the error (as Linux does after a reset).
    pub fn read(&mut self, now: Instant, dst: &mut [u8]) -> Result<usize, CallError> {
        self.read_copy(now, dst)
    }
    /// Copy received bytes into `dst` without consuming them (MSG_PEEK): stops at a peer's
    /// SrcAvail whose bytes have not been fetched. `Ok(0)` is end of stream; an error comes
    /// only when no data is left to peek.
    pub fn peek(&self, dst: &mut [u8]) -> Result<usize, CallError> {
        self.peek_copy(dst)
    }
    /// A read would return at once with data, end of stream or an error (not merely start
    /// fetching a peer's SrcAvail): what a readiness fd reports as readable.
    pub fn read_ready(&self) -> bool {
        self.stream_ready()
    }
    /// SO_RCVLOWAT: fewer than `lowat` bytes wait and more can come, so a reader that wants
    /// `lowat` waits (TCP's readiness and blocking reads with a low-water mark); never for a
    /// `lowat` of 0 or 1, at end of stream, after an error, or when the receive buffers are
    /// full (the peer could send no more).
    pub fn rx_below(&self, lowat: usize) -> bool {
        self.stream_below(lowat)
    }
    /// Whether an urgent byte (MSG_OOB) arrived and was not read yet (with SO_OOBINLINE: the
    /// stream was not read past it yet).
    pub fn urgent_pending(&self) -> bool {
        self.urgent.is_some() || (self.oob_inline && self.urg_mark.is_some())
    }
    /// Take the urgent byte (MSG_OOB), if one arrived and was not read yet.
    pub fn read_urgent(&mut self) -> Option<u8> {
        self.urgent.take()
    }
    /// The urgent byte (MSG_OOB), if one arrived and was not read yet, left in place
    /// (`MSG_OOB | MSG_PEEK`).
    pub(crate) fn peek_urgent(&self) -> Option<u8> {
        self.urgent
    }
    /// Receive into registered memory without copying. If the next stream bytes are a peer's
    /// SrcAvail they are RDMA-Read straight into `sink`; if nothing is queued, a SinkAvail
    /// invites the peer to RDMA-Write its next bytes into `sink`.
    pub fn read_zcopy(
        &mut self,
        now: Instant,
        sink: ZSink,
        token: u64,
    ) -> Result<ZRecv, CallError> {
        self.start_read_zcopy(now, sink, token)
    }
    /// Give up a zero-copy receive (SinkAvailCancel). [`Event::ZcopyReceived`] still reports
    /// how many bytes the peer placed before it saw the cancel.
    pub fn cancel_read_zcopy(&mut self, now: Instant) {
        if self.iocbs.sink_active() {
            self.cancel_sink(now);
            self.flush(now);
        }
    }
    // ---- Inputs from below: CM events, completions, timers ----

    /// Handle a CM event reported on this connection's endpoint.
    pub fn handle_cm(&mut self, now: Instant, ev: CmEvent) {
        match (self.state, ev) {
            (State::Connecting, CmEvent::Established { private_data }) => {
                match self.on_hello_ack(&private_data) {
                    Ok(()) => self.established(now),
                    Err(e) => self.fail(now, e.into(), true),
                }
            }
            (State::Accepting, CmEvent::Established { .. }) => self.established(now),
            (
                State::Connecting,
                CmEvent::Rejected {
                    private_data,
                    consumer,
                },
            ) => {
                let err = if consumer && !private_data.is_empty() {
                    ConnError::Rejected(String::from_utf8_lossy(&private_data).into_owned())
                } else {
                    ConnError::Refused
                };
                self.fail(now, err, false);
            }
            (
                State::Connecting | State::Accepting,
                CmEvent::Unreachable | CmEvent::ConnectError,
            ) => self.fail(now, ConnError::Unreachable, false),
            (State::Connecting, CmEvent::AddrError | CmEvent::RouteError) => {
                self.fail(now, ConnError::Unreachable, false)
            }
            (_, CmEvent::DeviceRemoval) => self.fail(now, ConnError::DeviceRemoved, false),
            (
                State::Disconnecting,
                CmEvent::Unreachable | CmEvent::ConnectError | CmEvent::Rejected { .. },
            ) => {
                // We gave up on a connection still being set up (aborted while accepting):
                // its setup ended in an error, so no Disconnected will follow.
                self.finish(now)
            }
            (State::Closed, _) => {}
            (_, CmEvent::Disconnected) => {
                // The CM says the connection is gone: nothing more can arrive. After the
                // peer's DisConn (its FIN) that is its orderly close finishing: what we hold
                // stays readable, then EOF, as a TCP socket in CLOSE_WAIT. Without one (and
                // without an abort of ours) it is a reset, as in TCP.
                if !self.disconnect_issued && (!self.disconn_rcvd || self.stream_undelivered()) {
                    self.set_error(ConnError::Reset);
                }
                self.finish(now);
            }
            (State::Established, CmEvent::PeerEndedSettled) if !self.disconnect_issued => {
                // As TCP's FIN from a process that ended: what we hold stays readable, then
                // EOF (CLOSE_WAIT); our next send fails on the dead endpoint, which makes it
                // the reset TCP's peer would answer (`on_wc_error_lost`: EPIPE after that).
                self.peer_fin(now);
            }
            (_, CmEvent::PeerEndedSettled) => {
                // Closing already (or not established): the peer's end is its orderly close.
                self.disconn_rcvd = true;
                self.handle_cm(now, CmEvent::Disconnected);
            }
            (_, CmEvent::TimewaitExit | CmEvent::AddrChange) => {}
            (_, _) => {}
        }
    }

    fn on_hello_ack(&mut self, private_data: &[u8]) -> Result<(), ProtocolError> {
        let h = Header::parse_private_data(private_data)?;
        let ack = match h.ext {
            Ext::HelloAck(a) => a,
            _ => return Err(ProtocolError::Setup("accept without a HelloAck")),
        };
        if h.bsdh.mseq != 0 || h.bsdh.mseq_ack != 0 || h.bsdh.bufs == 0 {
            return Err(ProtocolError::Setup(
                "HelloAck with bad sequence or credit fields",
            ));
        }
        self.send_size = ack.actual_rcv_size;
        self.peer_max_adverts = ack.max_adverts;
        self.credits.hello_rcvd(h.bsdh.bufs);
        self.tx.set_size(self.send_size);
        // The acceptor's `desired_rcv_size` (for its own sends) is not acted on here: the
        // buffers already posted keep their size, the peer learned it from the Hello, and a
        // later ChRcvBuf from the peer moves it.
        Ok(())
    }

    fn established(&mut self, now: Instant) {
        self.state = State::Established;
        self.was_established = true;
        self.timers.stop(Timer::Setup);
        self.heard_from_peer(now);
        self.timers
            .start(Timer::IdleCheck, now + self.cfg.idle_shrink);
        self.emit(Event::Connected);
        if self.role == Role::Active && self.cfg.initiator_sends_first == Some(true) {
            // The transport wants our message first (the peer holds its own until then): a
            // credit update, which every peer takes.
            self.count(Count::CreditUpdateSent);
            self.post_ctrl(Mid::Data, Ext::None);
        }
        self.flush(now);
        // Accepted by the application while it was being set up (see `set_accepted`).
        self.open_window();
    }

    /// Handle a work completion from this connection's CQ.
    pub fn handle_completion(&mut self, now: Instant, wc: &Completion) {
        self.handle_completions(now, std::slice::from_ref(wc));
    }

    /// Handle a batch of completions from one CQ poll, in order, then move everything along
    /// once (the work requests they lead to are posted together).
    pub fn handle_completions(&mut self, now: Instant, wcs: &[Completion]) {
        if wcs.is_empty() {
            return;
        }
        for wc in wcs {
            if self.state == State::Closed {
                return;
            }
            self.dispatch_completion(now, wc);
        }
        self.flush(now);
    }

    fn dispatch_completion(&mut self, now: Instant, wc: &Completion) {
        let idx = (wc.wr_id & wrid::INDEX_MASK) as usize;
        if wc.wr_id & wrid::KIND_MASK != wrid::RECV {
            self.send_wcs += 1;
        }
        match wc.wr_id & wrid::KIND_MASK {
            wrid::RECV => self.on_recv_completion(now, idx, wc),
            wrid::SEND | wrid::WRITE => self.on_send_completion(now, idx, wc),
            wrid::READ => self.on_read_completion(now, idx, wc),
            wrid::KEEPALIVE => self.on_keepalive_completion(now, idx, wc),
            _ => {}
        }
    }

    /// A completion with an error status: flushes after we are already going down are expected;
    /// anything else is the transport failing.
    fn on_wc_error(&mut self, now: Instant, status: WcStatus) {
        self.on_wc_error_lost(now, status, false);
    }

    /// [`Conn::on_wc_error`] for a work request that carried stream bytes of ours (`lost`:
    /// they never arrived).
    pub(super) fn on_wc_error_lost(&mut self, now: Instant, status: WcStatus, lost: bool) {
        // After the peer's DisConn an error may be the end of an orderly close, unless bytes
        // of ours can no longer arrive: then the QP died under a stream still in use (a peer
        // gone, a link down, a device that errors a QP silently).
        let orderly = self.disconn_rcvd && !lost && !self.stream_undelivered();
        if status == WcStatus::LocalQpOp && orderly {
            // A message of ours that carried no stream bytes (a credit update, SinkAvail,
            // ...) met the peer's teardown: the peer had both DisConns and its sends done,
            // and closed while this was under way. siw (iWARP over TCP) fails such a send
            // with a local QP error, the TCP stream being reset under it, before its CM
            // reports the disconnect; an IB device flushes it. The peer needed nothing of it:
            // the close is orderly, as after a flush (the CM's Disconnected ends it). Until
            // then siw refuses posts on the QP (ENOTCONN: out of RTS, not yet in the error
            // state that would flush them), which would abort the connection: post nothing
            // more, the connection is going down.
            self.wrs.clear();
            self.issue_disconnect(now);
            return;
        }
        if status == WcStatus::Flushed {
            if self.error.is_none()
                && !self.disconnect_issued
                && !orderly
                && self.state == State::Established
            {
                // The QP went to error under us (peer gone, link down): after the peer's
                // DisConn, as TCP's RST in CLOSE_WAIT.
                let e = if self.disconn_rcvd {
                    ConnError::ResetAfterClose
                } else {
                    ConnError::Reset
                };
                self.fail(now, e, false);
            }
            return;
        }
        if self.error.is_none() {
            let err = match status {
                WcStatus::RetryExceeded | WcStatus::RnrRetryExceeded => ConnError::TimedOut,
                s => ConnError::Transport(s),
            };
            self.fail(now, err, false);
        }
    }

    /// Handle the deadline reported by [`Conn::poll_timeout`] having passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state == State::Closed {
            return;
        }
        self.expire_timers(now);
    }

    /// The earliest time [`Conn::handle_timeout`] must be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_deadline()
    }

    /// The next work request to post. While sends are held (`Config::initiator_sends_first`,
    /// the accepting side before its first receive), only receives.
    pub fn poll_wr(&mut self) -> Option<WorkRequest> {
        if self.hold_sends {
            let i = self
                .wrs
                .iter()
                .position(|w| matches!(w, WorkRequest::Recv(_)))?;
            return self.wrs.remove(i);
        }
        self.wrs.pop_front()
    }
    /// The next CM action to perform.
    pub fn poll_cm(&mut self) -> Option<CmAction> {
        self.cm.pop_front()
    }
    /// The next application event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }
    /// The connection's counters.
    /// Send-side completions (messages, RDMA Reads and Writes, probes) handled so far: the
    /// driver's measure of whether outstanding sends make progress.
    pub fn send_completions(&self) -> u64 {
        self.send_wcs
    }
    /// Sends posted and not completed yet.
    pub fn sends_in_flight(&self) -> usize {
        self.tx.inflight_len()
    }
    /// The driver saw outstanding sends make no progress for `Config::send_stall_timeout`:
    /// fail the connection with `TimedOut`, as TCP's retransmissions giving up.
    pub fn fail_stalled(&mut self, now: Instant) {
        self.fail(now, ConnError::TimedOut, true);
        self.flush(now);
    }

    pub fn stats(&self) -> &ConnStats {
        &self.stats
    }

    /// Queue an event for the application ([`Conn::poll_event`]).
    #[inline]
    fn emit(&mut self, ev: Event) {
        self.events.push_back(ev);
    }
    /// Move a counter ([`Conn::stats`]).
    #[inline]
    fn count(&mut self, c: Count) {
        self.stats.record(c);
    }

    /// Shut one or both halves, like `shutdown(2)`. Queued data is still delivered before the
    /// DisConn (the peer reads EOF after all of it).
    pub fn shutdown(&mut self, now: Instant, how: Shutdown) -> Result<(), CallError> {
        match self.state {
            State::Established => {}
            State::Connecting | State::Accepting => return Err(CallError::NotConnected),
            State::Disconnecting | State::Closed if self.error.is_none() && self.disconn_rcvd => {
                // The peer closed in order and went (TCP's CLOSE_WAIT with the peer gone):
                // shutting our halves succeeds, as TCP's does, with nobody left to tell.
                self.shut_rd |= matches!(how, Shutdown::Read | Shutdown::Both);
                self.shut_wr |= matches!(how, Shutdown::Write | Shutdown::Both);
                return Ok(());
            }
            _ => return Err(CallError::NotConnected),
        }
        // As Linux's TCP: a read half shut ends reads (0) whenever nothing is queued; what is
        // queued, and what comes later, is still received and read.
        if matches!(how, Shutdown::Read | Shutdown::Both) && !self.shut_rd {
            self.shut_rd = true;
        }
        if matches!(how, Shutdown::Write | Shutdown::Both) && !self.shut_wr {
            self.shut_wr = true;
            self.close_tail();
        }
        self.flush(now);
        Ok(())
    }

    /// The application is done with the connection (`close(2)`). Unread received data makes
    /// this an abort (like TCP's reset on close); otherwise queued data keeps flowing for up to
    /// `linger`, then DisConn.
    pub fn close(&mut self, now: Instant) {
        if self.app_closed {
            return;
        }
        self.app_closed = true;
        match self.state {
            State::Closed | State::Disconnecting => {}
            State::Connecting | State::Accepting => self.abort_with(now, ConnError::Aborted),
            State::Established => {
                if self.rx.bytes() > 0 || self.advts.has_src() {
                    self.abort_with(now, ConnError::Aborted);
                    return;
                }
                self.shut_rd = true;
                if !self.shut_wr {
                    self.shut_wr = true;
                    self.close_tail();
                }
                self.timers.start(Timer::Linger, now + self.cfg.linger);
                self.flush(now);
            }
        }
    }

    /// Abort the connection (AbortConn, like a TCP reset).
    #[track_caller]
    pub fn abort(&mut self, now: Instant) {
        self.abort_with(now, ConnError::Aborted);
    }

    #[track_caller]
    fn abort_with(&mut self, now: Instant, err: ConnError) {
        if matches!(self.state, State::Closed) {
            return;
        }
        if self.state == State::Established && !self.disconnect_issued {
            self.send_abort();
        }
        self.fail(now, err, true);
    }

    /// A protocol violation by the peer: AbortConn and a clear error.
    fn protocol_error(&mut self, now: Instant, e: ProtocolError) {
        self.abort_with(now, ConnError::Protocol(e));
    }

    /// Enter the error path: record the error (reads and writes see it), disconnect.
    #[track_caller]
    fn fail(&mut self, now: Instant, err: ConnError, disconnect: bool) {
        if self.state == State::Closed {
            return;
        }
        self.set_error(err);
        match self.state {
            State::Connecting | State::Accepting if !disconnect => self.finish(now),
            _ => {
                self.issue_disconnect(now);
                // Everything queued is dead now.
                self.fail_pending_zcopy();
            }
        }
    }

    fn issue_disconnect(&mut self, now: Instant) {
        if !self.disconnect_issued {
            self.disconnect_issued = true;
            self.cm.push_back(CmAction::Disconnect);
            self.state = State::Disconnecting;
            self.timers
                .start(Timer::Disconnect, now + self.cfg.disconnect_timeout);
            self.timers.stop(Timer::Keepalive);
            self.timers.stop(Timer::Linger);
            self.timers.stop(Timer::IdleCheck);
        }
    }

    /// Both DisConns are through and our sends completed: tear the connection down.
    fn maybe_finish_orderly(&mut self, now: Instant) {
        if self.state == State::Established
            && self.disconn_sent
            && self.disconn_rcvd
            && self.tx.nothing_inflight()
        {
            // The side that sent DisConn last would wait forever for a second disconnect if
            // both waited: both issue it (rdma_disconnect is fine from both ends).
            self.issue_disconnect(now);
        }
    }

    /// Nothing is left either way: established, every message that arrived taken and read
    /// by the application, nothing of ours queued or in flight. If the process ended now, its
    /// TCP kernel would close the connection in order (`Endpoint::set_settled`).
    pub fn settled(&self) -> bool {
        self.state == State::Established
            && self.rx.front().is_none()
            && !self.stream_undelivered()
            && self.tx.inflight_len() == 0
    }

    /// Stream bytes of ours the peer has not acknowledged (queued, in flight, or in a
    /// zero-copy source not finished): lost if the connection ends now.
    fn stream_undelivered(&self) -> bool {
        self.tx.bytes() > 0 || self.iocbs.src_queued() > 0
    }

    /// The connection's error, unless it has one: the first reason stays, with the place in
    /// the engine that decided it (the caller's caller for [`Conn::fail`] and
    /// [`Conn::finish`], both `track_caller`).
    #[track_caller]
    fn set_error(&mut self, err: ConnError) {
        if self.error.is_none() {
            self.error = Some(err);
            self.error_site = Some(std::panic::Location::caller());
        }
    }

    /// Release everything and report the end.
    #[track_caller]
    fn finish(&mut self, _now: Instant) {
        if self.state == State::Closed {
            return;
        }
        self.state = State::Closed;
        self.timers.stop_all();
        self.fail_pending_zcopy();
        if !self.disconn_rcvd {
            self.set_error(ConnError::Reset);
        }
        self.release_all();
        self.emit(Event::Closed(self.error.clone()));
    }

    /// Give every buffer back to the store. Work requests still posted are dead: the driver
    /// destroys the endpoint on [`Event::Closed`].
    fn release_all(&mut self) {
        for inf in self.tx.drain_inflight() {
            if let Inflight::Read(r) = &inf {
                // A read into the application's sink that never completed: reported here,
                // once (the endpoint is destroyed with it, so nothing writes the sink later).
                let token = r.sink_token;
                self.sink_read_failed(token);
            }
            inf.release(&mut self.store);
        }
        self.tx.drop_queue(&mut self.store);
        for b in self.staging.drain() {
            self.store.free(b);
        }
        self.rx.drop_posted(&mut self.store);
        // Received data stays readable, after an orderly close as after a failure (Linux
        // keeps a reset socket's receive queue: the data, then the error, then EOF); `read`
        // frees each buffer as it empties. A peer's advertised source cannot be read any
        // more, so the stream ends before the first one.
        self.rx.cut_at_first_src(&mut self.store);
        self.advts.release(&mut self.store);
        self.iocbs.release(&mut self.store);
        // The pools' counts are moot now: drop their idle buffers.
        self.tx.release_pools(&mut self.store);
        self.rx.release_pool(&mut self.store);
    }

    /// Process a received BSDH's credit fields.
    fn on_bsdh(&mut self, h: &msgs::Bsdh) -> Result<(), ProtocolError> {
        self.credits.on_bsdh(h)?;
        self.count(Count::MsgRcvd);
        Ok(())
    }

    /// Build a message header with the current credit fields, consuming one credit.
    fn next_header(
        &mut self,
        mid: Mid,
        ext: Ext,
        flags: msgs::BsdhFlags,
        payload: usize,
    ) -> Header {
        let bufs = self.rx_posted_count();
        let h = self.credits.next_header(mid, ext, flags, payload, bufs);
        self.count(Count::MsgSent);
        h
    }

    fn rx_posted_count(&self) -> u16 {
        self.rx.posted_count()
    }

    /// Move everything along: post receives, send what credits allow, send a credit update if
    /// the peer would otherwise stall, and finish an orderly close.
    fn flush(&mut self, now: Instant) {
        if self.state != State::Established {
            return;
        }
        if let Err(e) = self.fill_rx() {
            self.fail(now, e, true);
            return;
        }
        self.push_tx(now);
        self.maybe_credit_update();
        self.arm_persist();
        self.maybe_finish_orderly(now);
    }
}

fn emit_private(h: &Header) -> Vec<u8> {
    let mut v = vec![0u8; h.header_len()];
    h.emit(&mut v).expect("buffer sized from header_len");
    v
}
