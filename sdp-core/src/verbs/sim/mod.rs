//! The `sim` provider: a deterministic, in-memory RDMA fabric with virtual time and fault
//! injection, for running SDP engines against each other in tests.
//!
//! # Model
//!
//! A [`SimFabric`] is one world of hosts, each named by one IP address. [`SimFabric::provider`]
//! opens a [`SimProvider`] (device + protection domain + connection manager) on a host; the
//! provider implements [`Provider`] with [`SimMr`], [`SimEndpoint`] and [`SimListener`]. All state
//! lives in one `World` behind an `Arc<parking_lot::Mutex<_>>`; there are no threads, no real
//! clock and no unsafe code. Nothing happens by itself: provider calls only *schedule* work, and
//! [`SimFabric::advance`] runs every event due up to a virtual time (nanoseconds), in time order,
//! ties in the order they were scheduled. A harness typically loops
//! `while let Some(t) = fabric.next_event_at() { fabric.advance(t); /* poll and drive */ }`.
//! The same seed and the same sequence of calls give the same events at the same times (the only
//! randomness is link jitter and the first key value, from one seeded ChaCha8 generator).
//!
//! What is modeled, following InfiniBand RC semantics:
//!
//! * **Memory regions.** [`Provider::reg_mr`] allocates zeroed bytes with a unique `lkey` and a
//!   different unique `rkey` (so using one for the other fails) at a fake, host-local address:
//!   regions start at `0x1000_0000`, are 4 KiB aligned and separated by an unmapped 4 KiB page,
//!   and addresses are never reused. `REMOTE_WRITE` without `LOCAL_WRITE` is refused with
//!   [`VerbsError::Invalid`], as `ibv_reg_mr` does. [`MemoryRegion::set_access`] changes the
//!   rights checked by later accesses; dropping the [`SimMr`] deregisters it.
//!   [`MemoryRegion::advertise`] makes a checked window: fresh keys that reach only the
//!   granted range with only the granted rights, until [`MemoryRegion::revoke`] (or the
//!   region's deregistration) withdraws them; `READ_SINK` changes nothing here.
//! * **Send queue execution.** Each posted send WR executes (local SGE checked, bytes sampled)
//!   when the QP's transmit direction is free: serialization takes `bytes / bandwidth`, WRs go out
//!   in order, back to back. A message arrives at the peer `latency + link extra delay + jitter`
//!   after its serialization ends, never before an earlier message of the same QP (jitter does
//!   not reorder a QP's stream). An RDMA Read request has no serialization; its response data is
//!   sampled at the responder when the request arrives and is placed locally when the response
//!   arrives (one response serialization and one more path delay later).
//! * **Completions.** A send-side WR is done when its acknowledgement (or read response) is back
//!   at the requester: arrival + one return path delay. Completions are reported strictly in
//!   posting order (a Write acknowledged before an earlier Read's response waits for it).
//!   Unsignaled successful WRs report nothing but keep their send-queue slot until then; errors
//!   and flushes are always reported. A receive completes when its SEND arrives, with `byte_len`.
//!   `byte_len` of successful Send/Write completions is the WR's length; error and flush
//!   completions carry 0, as IB leaves it undefined. The CQ is unbounded.
//! * **Local checks at execution.** The lkey must name a region on this host, the SGE must lie
//!   inside it, and receive buffers and RDMA Read sinks need `LOCAL_WRITE` (checked on the whole
//!   receive SGE when a SEND consumes it, and for Read sinks both at execution and at placement).
//!   Failure: `LocalProtection` completion and the QP goes to error.
//! * **Remote checks at arrival.** RDMA Write/Read: the rkey must name a region on the peer host
//!   with `REMOTE_WRITE` / `REMOTE_READ` and the range must be inside it; otherwise the responder
//!   QP goes to error and the requester gets `RemoteAccess` (then errors too). A zero-length
//!   Write (`sge: None` or length 0) is not checked and touches nothing, but like everything else
//!   fails with `RetryExceeded` if the peer is unreachable; a zero-length Read likewise.
//! * **SEND.** Consumes the peer's oldest receive. Longer than the receive SGE: the receiver's WR
//!   completes `LocalProtection` (IB's local length error), the sender's `Other(9)`
//!   (`IBV_WC_REM_INV_REQ_ERR`, [`WC_REM_INV_REQ_ERR`]), and both QPs error. A receive WR with a
//!   bad lkey/range/rights: receiver `LocalProtection`, sender `Other(11)`
//!   (`IBV_WC_REM_OP_ERR`, [`WC_REM_OP_ERR`]), both error. No receive posted: RNR NAK; the
//!   requester waits `rnr_delay_ns` and retransmits (the NAKed message and everything the QP sent
//!   after it, in order), up to [`SimConfig::rnr_retry`] times (7 = forever), then the WR
//!   completes `RnrRetryExceeded` and both QPs error.
//! * **Error state.** Once a QP is in error, the failing WR carries its status and every other
//!   outstanding WR completes `Flushed`, send queue first, then receive queue, in order; later
//!   posts complete `Flushed` at once. A connected QP entering error reports
//!   [`CmEvent::Disconnected`] at once and [`CmEvent::TimewaitExit`] `timewait_ns` later, and
//!   (unless the error came from the peer) sends a disconnect request that puts the peer's QP in
//!   error, with `Disconnected`, one path delay later (never overtaking data already sent).
//! * **Connection manager.** `listen` (port 0 = ephemeral; `AddrInUse` if the port is taken,
//!   listeners and active endpoints share a host's port space; an unspecified IP listens on all
//!   the host's addresses, i.e. its own IP and loopback; another host's IP is
//!   `AddrNotAvailable`). `connect` sends a REQ: private data longer than
//!   `max_private_data_connect` is `Invalid`; an IP no host has, a crashed host or a broken link
//!   gives `Unreachable` after `transport_timeout_ns`; no listener on the port, or its backlog
//!   (requests not yet taken by [`Listener::poll_request`]) full, or the destination out of QPs
//!   gives `Rejected { private_data: [], consumer: false }` after one round trip. The listener
//!   yields the passive endpoint and the REQ private data; `accept` (data up to
//!   `max_private_data_accept`) makes the passive QP ready at once and the active side gets
//!   `Established { private_data }` one path delay later; the passive side gets
//!   `Established { [] }` when the RTU arrives, one more path delay later. `reject` (up to
//!   `max_private_data_reject`) gives the active side `Rejected { private_data, consumer: true }`.
//!   The passive QP has the same [`QpCaps`] as the active side asked for. Loopback and
//!   unspecified destination addresses mean the host itself.
//! * **Endpoint lifetime.** `disconnect` errors the QP as above. Dropping a connected endpoint
//!   does the same (the peer sees `Disconnected`); dropping a passive endpoint that was neither
//!   accepted nor rejected rejects it (`consumer: false`); dropping a listener rejects its queued
//!   requests. If the active side vanished before the REP arrives, or a REP is lost, the passive
//!   side gets [`CmEvent::ConnectError`] (its QP errors without `Disconnected`).
//! * **Faults** ([`Faults`]): per-link extra delay and jitter, broken links (everything in flight
//!   and sent while broken is lost; the requester notices when its transport retries run out,
//!   `transport_timeout_ns` after sending), crashed hosts (their QPs vanish silently; peers
//!   notice only through their own traffic failing with `RetryExceeded`, then `Disconnected`;
//!   a crashed host can be restarted empty), corrupted or vanishing SEND payloads.
//! * **Resources.** `max_qps_per_host` and `max_registered_bytes_per_host` give
//!   [`VerbsError::NoResources`]; `max_send_wr`/`max_recv_wr` outstanding give
//!   [`VerbsError::QueueFull`]. [`SimStats`] counts traffic and current usage per host.
//!
//! # Example
//!
//! ```
//! use sdp_core::verbs::sim::SimFabric;
//! use sdp_core::verbs::*;
//!
//! let fabric = SimFabric::new(7);
//! let client = fabric.provider([10, 0, 0, 1].into());
//! let server = fabric.provider([10, 0, 0, 2].into());
//! let mut listener = server.listen("10.0.0.2:5000".parse().unwrap(), 8, QpCaps::default()).unwrap();
//! let dst = "10.0.0.2:5000".parse().unwrap();
//! let mut a = client.connect(dst, None, QpCaps::default(), b"hi").unwrap();
//! fabric.advance(fabric.next_event_at().unwrap()); // the request arrives
//! let (mut b, hello) = listener.poll_request().unwrap();
//! assert_eq!(hello, b"hi");
//! b.accept(b"welcome").unwrap();
//! let rbuf = server.reg_mr(64, Access::LOCAL_WRITE).unwrap();
//! b.post_recv(&RecvWr { wr_id: 1, sge: rbuf.sge(0, 64) }).unwrap();
//! while let Some(t) = fabric.next_event_at() {
//!     fabric.advance(t);
//! }
//! assert_eq!(a.poll_cm(), Some(CmEvent::Established { private_data: b"welcome".to_vec() }));
//! let mut sbuf = client.reg_mr(64, Access::empty()).unwrap();
//! sbuf.write(0, b"ping");
//! let wr = SendWr { wr_id: 2, op: SendOp::Send, sge: Some(sbuf.sge(0, 4)), signaled: true, solicited: false, wake_engine: false, payload: None };
//! a.post_send(&wr).unwrap();
//! fabric.run_until_idle(u64::MAX);
//! let mut wc = [Completion { wr_id: 0, status: WcStatus::Flushed, opcode: WcOpcode::Recv,
//!                            byte_len: 0 }];
//! assert_eq!(b.poll_cq(&mut wc), 1);
//! assert_eq!((wc[0].wr_id, wc[0].status, wc[0].byte_len), (1, WcStatus::Success, 4));
//! ```
//!
//! Note that with `rnr_retry: 7` a SEND that never finds a receive is retransmitted forever, so
//! the event queue never drains: bound [`SimFabric::run_until_idle`] with a time limit.
//!
//! # Not modeled
//!
//! What is not modeled: packets, MTU segmentation and PSNs (a message is one unit);
//! congestion between QPs (each QP direction has its own full bandwidth); `max_rd_atomic`
//! limits on outstanding RDMA Reads; CQ overflow; atomics,
//! immediate data, memory windows, SRQs; fences (WRs start in order, which is at least as
//! strict); the RDMA Read race where the responder's memory changes while the response is
//! streamed (data is sampled at one instant); retransmission after a transient loss (a lost
//! message is always fatal to the QP, except for `drop_next_send`, which is not RC-faithful on
//! purpose); CM retries (a lost disconnect request is simply lost, and a lost RTU leaves the
//! passive side without `Established`); address resolution (`AddrError`/`RouteError` are never
//! produced; `AddrChange` neither; `DeviceRemoval` only from [`Faults::remove_device`]).

mod world;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use parking_lot::Mutex;

use self::world::{Id, World};
use super::{
    check_grant, Access, CmEvent, Completion, Endpoint, Grant, Listener, MemoryRegion, Provider,
    QpCaps, RecvWr, SendWr, VerbsError,
};

pub use self::world::{MR_BASE, PAGE, WC_REM_INV_REQ_ERR, WC_REM_OP_ERR};

/// Fabric-wide parameters. All times in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    /// One-way propagation delay between any two hosts (including a host and itself).
    pub latency_ns: u64,
    /// Per QP direction; a message takes `bytes / bandwidth` to serialize. 0 = infinite.
    pub bandwidth_bytes_per_sec: u64,
    /// RNR retries before `RnrRetryExceeded`; 7 (or more) retries forever, as in IB. The default
    /// 0 makes a SEND that finds no receive an immediate error, which surfaces credit bugs.
    pub rnr_retry: u8,
    /// How long the requester waits after an RNR NAK before retransmitting.
    pub rnr_delay_ns: u64,
    /// How long after sending a lost message (dead peer, broken link) the requester's WR fails
    /// with `RetryExceeded`; also how long an unanswered connect takes to be `Unreachable`.
    pub transport_timeout_ns: u64,
    /// From `Disconnected` to `TimewaitExit`.
    pub timewait_ns: u64,
    /// Largest private data of a connect request (default
    /// [`MAX_PRIVATE_DATA_CONNECT`](super::MAX_PRIVATE_DATA_CONNECT), as `RDMA_PS_TCP` on IB).
    pub max_private_data_connect: usize,
    /// Largest private data of an accept (default
    /// [`MAX_PRIVATE_DATA_ACCEPT`](super::MAX_PRIVATE_DATA_ACCEPT)).
    pub max_private_data_accept: usize,
    /// Largest private data of a reject (default
    /// [`MAX_PRIVATE_DATA_REJECT`](super::MAX_PRIVATE_DATA_REJECT)).
    pub max_private_data_reject: usize,
    /// QPs (endpoints, including passive ones waiting in a listener's queue) per host.
    pub max_qps_per_host: usize,
    /// Registered bytes per host (the memlock limit).
    pub max_registered_bytes_per_host: u64,
    /// Largest `max_send_wr` / `max_recv_wr` an endpoint may ask for.
    pub max_qp_wr: u32,
    /// Largest inline payload a SEND takes ([`Endpoint::post_send_inline`]; an HCA's
    /// `max_inline_data`); 0: none. The default takes any receive buffer's worth, so the
    /// engine's inline path runs in every simulated test.
    pub max_inline: usize,
    /// iWARP's close (soft-iWARP, siw: the connection is a TCP stream). `Some(d)`: a peer's
    /// disconnect reaches a QP `d` ns later than IB's DREQ would (siw learns of the peer's
    /// FIN through its CM's work queue, and its send path may meet the closed stream first),
    /// and a message that reaches a QP no longer connected (disconnected or destroyed, on a
    /// live host) is answered by a reset: its work request completes with
    /// [`WcStatus::LocalQpOp`](crate::verbs::WcStatus::LocalQpOp) and the requester's QP goes
    /// to the error state, as siw's does when its TCP send fails; it refuses further posts
    /// (`NotConnected`, siw's `ENOTCONN` out of RTS) instead of flushing them. `None` (the default): IB's
    /// (the DREQ flushes the QP on arrival; a message to a closed QP is lost and times out).
    pub iwarp_close_ns: Option<u64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            latency_ns: 2_000,
            bandwidth_bytes_per_sec: 10_000_000_000,
            rnr_retry: 0,
            rnr_delay_ns: 100_000,
            transport_timeout_ns: 50_000_000,
            timewait_ns: 10_000_000,
            max_private_data_connect: super::MAX_PRIVATE_DATA_CONNECT,
            max_private_data_accept: super::MAX_PRIVATE_DATA_ACCEPT,
            max_private_data_reject: super::MAX_PRIVATE_DATA_REJECT,
            max_qps_per_host: 65_536,
            max_registered_bytes_per_host: 4 << 30,
            max_qp_wr: 16_384,
            max_inline: 1 << 20,
            iwarp_close_ns: None,
        }
    }
}

/// Per-host counters. Traffic counters count what this host issued (as requester) unless noted;
/// `registered_*` and `qps` are current values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// SENDs put on the wire, and their payload bytes (after `corrupt_next_send`).
    pub sends: u64,
    pub send_bytes: u64,
    /// SENDs received into a receive buffer on this host, and their bytes.
    pub recvs: u64,
    pub recv_bytes: u64,
    pub rdma_writes: u64,
    pub rdma_write_bytes: u64,
    pub rdma_reads: u64,
    pub rdma_read_bytes: u64,
    /// RNR NAKs this host's requesters received.
    pub rnr_naks: u64,
    /// RNR NAKs this host sent as responder (no receive posted).
    pub rnr_naks_sent: u64,
    /// Remote access violations this host refused as responder.
    pub remote_access_errors: u64,
    /// Messages (or their acknowledgements) from this host's requesters lost in the fabric.
    pub messages_lost: u64,
    /// Completions reported, by kind.
    pub completions: u64,
    pub error_completions: u64,
    pub flushed: u64,
    pub connects: u64,
    pub accepts: u64,
    pub rejects: u64,
    pub disconnects: u64,
    /// Currently registered bytes and regions, and the peak of registered bytes.
    pub registered_bytes: u64,
    pub registered_regions: u64,
    pub peak_registered_bytes: u64,
    /// Current QPs (endpoints alive, including unaccepted passive ones) and their peak.
    pub qps: u64,
    pub peak_qps: u64,
}

/// State of a simulated queue pair, as [`SimEndpoint::qp_state`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SimQpState {
    /// Active side, waiting for the REP (receives may be posted, sends may not).
    Connecting,
    /// Passive side, neither accepted nor rejected yet.
    Pending,
    /// Connected (RTS): both queues work.
    Ready,
    /// Error: every post completes `Flushed`.
    Error,
    /// Its host crashed: calls fail with `NoDevice`, nothing is reported any more.
    Dead,
}

/// One recorded event, when tracing is on ([`SimFabric::set_trace`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    pub time: u64,
    pub host: IpAddr,
    /// [`SimEndpoint::id`] of the endpoint it was reported on.
    pub endpoint: u64,
    pub kind: TraceKind,
}

/// What a [`TraceEvent`] records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceKind {
    Completion(Completion),
    Cm(CmEvent),
}

type Shared = Arc<Mutex<World>>;

/// The simulated fabric: a handle on the world (clones share it).
#[derive(Clone)]
pub struct SimFabric {
    world: Shared,
}

impl SimFabric {
    /// A fabric with the default [`SimConfig`].
    pub fn new(seed: u64) -> SimFabric {
        SimFabric::with_config(seed, SimConfig::default())
    }

    pub fn with_config(seed: u64, cfg: SimConfig) -> SimFabric {
        SimFabric {
            world: Arc::new(Mutex::new(World::new(seed, cfg))),
        }
    }

    /// A provider (device + PD + CM) for the host with this IP address (creates the host on
    /// first use). Several providers on one host share its regions, ports and counters.
    pub fn provider(&self, ip: IpAddr) -> SimProvider {
        self.world.lock().host_mut(ip);
        SimProvider {
            world: self.world.clone(),
            ip,
        }
    }

    pub fn config(&self) -> SimConfig {
        self.world.lock().cfg
    }

    /// Virtual time in nanoseconds.
    pub fn now(&self) -> u64 {
        self.world.lock().now
    }

    /// Advance virtual time to `t`, performing every event due by then in time order (ties in
    /// the order they were scheduled). A `t` in the past only runs what is due now.
    pub fn advance(&self, t: u64) {
        self.world.lock().advance(t);
    }

    /// Advance by `dt` nanoseconds.
    pub fn advance_by(&self, dt: u64) {
        let mut w = self.world.lock();
        let t = w.now.saturating_add(dt);
        w.advance(t);
    }

    /// Run the events of the next due instant; returns that time, or `None` if nothing is
    /// scheduled.
    pub fn step(&self) -> Option<u64> {
        let mut w = self.world.lock();
        let t = w.next_event_at()?;
        w.advance(t);
        Some(t)
    }

    /// Run events until none is left or the next one is after `limit`; returns the time reached.
    /// (Stops at whatever is due: it does not jump to `limit` if the queue empties first.)
    pub fn run_until_idle(&self, limit: u64) -> u64 {
        let mut w = self.world.lock();
        while let Some(t) = w.next_event_at() {
            if t > limit {
                break;
            }
            w.advance(t);
        }
        w.now
    }

    /// When the next internal event (execution, delivery, acknowledgement, retry, timeout, CM
    /// message) is due, if any. Events that turn out to be moot (a timeout for a QP already
    /// flushed) still count.
    pub fn next_event_at(&self) -> Option<u64> {
        self.world.lock().next_event_at()
    }

    /// Number of scheduled internal events.
    pub fn pending_events(&self) -> usize {
        self.world.lock().pending_events()
    }

    /// Handle to inject faults.
    pub fn faults(&self) -> Faults {
        Faults {
            world: self.world.clone(),
        }
    }

    /// The counters of the host `ip` (all zero for an unknown host).
    pub fn stats(&self, ip: IpAddr) -> SimStats {
        self.world
            .lock()
            .hosts
            .get(&ip)
            .map(|h| h.stats)
            .unwrap_or_default()
    }

    /// Whether host `ip` exists and has not crashed.
    pub fn host_alive(&self, ip: IpAddr) -> bool {
        self.world.lock().host_alive(ip)
    }

    /// Start (or stop, with `false`) recording every completion and CM event with its time.
    pub fn set_trace(&self, on: bool) {
        let mut w = self.world.lock();
        if on {
            w.trace.get_or_insert_with(Vec::new);
        } else {
            w.trace = None;
        }
    }

    /// The events recorded since the last call.
    pub fn take_trace(&self) -> Vec<TraceEvent> {
        self.world
            .lock()
            .trace
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }
}

/// Fault injection; every fault is deterministic.
#[derive(Clone)]
pub struct Faults {
    world: Shared,
}

impl Faults {
    /// Every message between `a` and `b` (both ways, CM included) takes `extra_ns` longer plus a
    /// uniformly random `0..=jitter_ns`. Jitter never reorders messages of one QP.
    pub fn set_delay(&self, a: IpAddr, b: IpAddr, extra_ns: u64, jitter_ns: u64) {
        self.world.lock().set_delay(a, b, extra_ns, jitter_ns);
    }

    /// Cut the link: messages in flight and sent while it is broken are lost (both ways).
    /// Requesters get `RetryExceeded` `transport_timeout_ns` after sending, their QPs error and
    /// report `Disconnected`; the disconnect request is lost too, so each side learns through
    /// its own traffic. Connects across it end `Unreachable`.
    pub fn break_link(&self, a: IpAddr, b: IpAddr) {
        self.world.lock().break_link(a, b);
    }

    /// Cut the link as [`Faults::break_link`] does, but the requesters' retries never end: no
    /// `RetryExceeded`, no error, no completion (a device whose QPs hang, as Soft-RoCE's do
    /// after a link flap). Only the engine's own bounds can end such a connection.
    pub fn stall_link(&self, a: IpAddr, b: IpAddr) {
        self.world.lock().stall_link(a, b);
    }

    /// Restore the link for messages sent from now on (anything sent before stays lost).
    pub fn heal_link(&self, a: IpAddr, b: IpAddr) {
        self.world.lock().heal_link(a, b);
    }

    /// Crash host `ip`: its QPs and listeners vanish silently (its endpoints report nothing and
    /// their calls fail with `NoDevice`), nothing it had in flight arrives, its registrations are
    /// gone (the [`SimMr`] handles keep their bytes for local reads), and its providers fail
    /// with `NoDevice`. Peers notice only through their own traffic (`RetryExceeded` after
    /// `transport_timeout_ns`, then `Disconnected`).
    pub fn crash(&self, ip: IpAddr) {
        self.world.lock().crash(ip);
    }

    /// Every QP of host `ip` goes to the error state silently: its posted work completes
    /// `Flushed`, and nothing else is reported: no error completion, no CM event, no word to
    /// the peer, whose QP stays ready. This is what Soft-RoCE's responder does after a class C
    /// error on a request that consumes no receive (an RDMA Read replayed after its region was
    /// deregistered: `rxe_resp.c`, `RESPST_ERR_RKEY_VIOLATION`), seen in the rig's soak.
    pub fn error_qps_silently(&self, ip: IpAddr) {
        self.world.lock().error_qps_silently(ip);
    }

    /// Remove host `ip`'s device while its processes live on (`rdma link delete`): every
    /// endpoint errors and reports [`CmEvent::DeviceRemoval`], listeners stop, new objects fail
    /// with `NoDevice`, and [`Provider::device_lost`] says so. Unlike [`Faults::crash`], the
    /// host's stats keep counting endpoints and regions until their handles are dropped.
    pub fn remove_device(&self, ip: IpAddr) {
        self.world.lock().remove_device(ip);
    }

    /// Bring a crashed host back, empty: new registrations, listeners and connections work;
    /// everything from before the crash stays dead.
    pub fn restart(&self, ip: IpAddr) {
        self.world.lock().restart(ip);
    }

    /// Pass the payload of the next SEND leaving host `from` through `f` when it executes (before
    /// it goes on the wire). `f` may change the length; if the result no longer fits the
    /// receive buffer, the usual length error follows. Several calls queue up, one per SEND.
    /// `f` runs with the fabric locked: it must not call into the fabric.
    pub fn corrupt_next_send<F>(&self, from: IpAddr, f: F)
    where
        F: FnMut(&mut Vec<u8>) + Send + 'static,
    {
        self.world.lock().corrupt_next_send(from, Box::new(f));
    }

    /// The next SEND leaving host `from` vanishes at the receiver (no receive consumed, nothing
    /// reported) yet the sender gets a normal completion. This breaks RC's guarantee on purpose,
    /// to test how an engine copes with a message that never came.
    pub fn drop_next_send(&self, from: IpAddr) {
        self.world.lock().drop_next_send(from);
    }
}

/// A device, protection domain and connection manager on one simulated host.
#[derive(Clone)]
pub struct SimProvider {
    world: Shared,
    ip: IpAddr,
}

impl SimProvider {
    /// The host's IP address.
    pub fn ip(&self) -> IpAddr {
        self.ip
    }

    /// A handle on the whole fabric.
    pub fn fabric(&self) -> SimFabric {
        SimFabric {
            world: self.world.clone(),
        }
    }
}

impl Provider for SimProvider {
    fn device_lost(&self) -> bool {
        self.world
            .lock()
            .hosts
            .get(&self.ip)
            .is_some_and(|h| h.device_lost)
    }

    type Mr = SimMr;
    type Endpoint = SimEndpoint;
    type Listener = SimListener;

    fn name(&self) -> &'static str {
        "sim"
    }

    fn reg_mr(&self, len: usize, access: Access) -> Result<SimMr, VerbsError> {
        let (id, lkey, rkey, addr) = self.world.lock().reg_mr(self.ip, len, access)?;
        Ok(SimMr {
            world: self.world.clone(),
            id,
            lkey,
            rkey,
            addr,
            len,
            access,
        })
    }

    fn listen(
        &self,
        addr: SocketAddr,
        backlog: u32,
        _caps: QpCaps,
    ) -> Result<SimListener, VerbsError> {
        let (id, addr) = self.world.lock().listen(self.ip, addr, backlog)?;
        Ok(SimListener {
            world: self.world.clone(),
            id,
            addr,
        })
    }

    fn connect(
        &self,
        dst: SocketAddr,
        src: Option<SocketAddr>,
        caps: QpCaps,
        private_data: &[u8],
    ) -> Result<SimEndpoint, VerbsError> {
        let (id, local) = self
            .world
            .lock()
            .connect(self.ip, dst, src, caps, private_data)?;
        Ok(SimEndpoint {
            world: self.world.clone(),
            id,
            local,
            peer: dst,
        })
    }
}

/// A registered region; its bytes live in the world. Dropping it deregisters it.
pub struct SimMr {
    world: Shared,
    id: Id,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: usize,
    access: Access,
}

impl std::fmt::Debug for SimMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimMr")
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("access", &self.access)
            .finish()
    }
}

impl SimMr {
    /// A copy of all the region's bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len];
        self.read(0, &mut v);
        v
    }

    fn check(&self, off: usize, n: usize, what: &str) {
        assert!(
            off.checked_add(n).is_some_and(|end| end <= self.len),
            "SimMr::{what} out of bounds: {n} bytes at {off} in a {}-byte region",
            self.len
        );
    }
}

impl MemoryRegion for SimMr {
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn access(&self) -> Access {
        self.access
    }
    fn set_access(&mut self, access: Access) -> Result<(), VerbsError> {
        self.world.lock().set_access(self.id, access)?;
        self.access = access;
        Ok(())
    }
    fn advertise(&mut self, off: usize, len: usize, access: Access) -> Result<Grant, VerbsError> {
        check_grant(self.len, off, len, access)?;
        let (id, lkey, rkey) = self.world.lock().advertise(self.id, off, len, access)?;
        Ok(Grant {
            addr: self.addr + off as u64,
            len,
            lkey,
            rkey,
            id,
        })
    }
    fn revoke(&mut self, grant: &Grant) -> Result<(), VerbsError> {
        self.world.lock().revoke(self.id, grant.id)
    }
    fn read(&self, off: usize, dst: &mut [u8]) {
        self.check(off, dst.len(), "read");
        let w = self.world.lock();
        if let Some(mr) = w.mrs.get(&self.id) {
            dst.copy_from_slice(&mr.data[off..off + dst.len()]);
        }
    }
    fn write(&mut self, off: usize, src: &[u8]) {
        self.check(off, src.len(), "write");
        let mut w = self.world.lock();
        if let Some(mr) = w.mrs.get_mut(&self.id) {
            mr.data[off..off + src.len()].copy_from_slice(src);
        }
    }
}

impl Drop for SimMr {
    fn drop(&mut self) {
        self.world.lock().dereg_mr(self.id);
    }
}

/// One connection: CM id, RC QP and its CQ. Dropping it destroys the QP (a connected peer sees
/// `Disconnected`).
pub struct SimEndpoint {
    world: Shared,
    id: Id,
    local: SocketAddr,
    peer: SocketAddr,
}

impl std::fmt::Debug for SimEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimEndpoint")
            .field("id", &self.id)
            .field("local", &self.local)
            .field("peer", &self.peer)
            .finish()
    }
}

impl SimEndpoint {
    /// A fabric-unique number for this endpoint (as in [`TraceEvent::endpoint`]).
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn qp_state(&self) -> SimQpState {
        self.world
            .lock()
            .qps
            .get(&self.id)
            .map_or(SimQpState::Dead, |q| q.state)
    }

    /// Receives posted and not yet consumed.
    pub fn posted_recvs(&self) -> usize {
        self.world
            .lock()
            .qps
            .get(&self.id)
            .map_or(0, |q| q.rq.len())
    }

    /// Send WRs posted and not yet completed (reported or, if unsignaled, retired).
    pub fn outstanding_sends(&self) -> usize {
        self.world
            .lock()
            .qps
            .get(&self.id)
            .map_or(0, |q| q.outstanding_sends())
    }

    /// Completions waiting in the CQ.
    pub fn pending_completions(&self) -> usize {
        self.world
            .lock()
            .qps
            .get(&self.id)
            .map_or(0, |q| q.pending_completions())
    }

    /// CM events waiting to be polled.
    pub fn pending_cm_events(&self) -> usize {
        self.world
            .lock()
            .qps
            .get(&self.id)
            .map_or(0, |q| q.pending_cm_events())
    }

    /// The capacities of this QP (the passive side inherits the active side's).
    pub fn caps(&self) -> QpCaps {
        self.world
            .lock()
            .qps
            .get(&self.id)
            .map_or_else(QpCaps::default, |q| q.caps())
    }

    /// IP address of the host this endpoint lives on.
    pub fn host(&self) -> IpAddr {
        self.world
            .lock()
            .qps
            .get(&self.id)
            .map_or(self.local.ip(), |q| q.host)
    }
}

impl Endpoint for SimEndpoint {
    fn post_recv(&mut self, wr: &RecvWr) -> Result<(), VerbsError> {
        self.world.lock().post_recv(self.id, wr)
    }
    fn post_send(&mut self, wr: &SendWr) -> Result<(), VerbsError> {
        self.world.lock().post_send(self.id, wr)
    }
    fn inline_max(&self) -> usize {
        self.world.lock().cfg.max_inline
    }
    fn post_send_inline(&mut self, wr: &SendWr, payload: &[u8]) -> Result<(), VerbsError> {
        self.world.lock().post_send_inline(self.id, wr, payload)
    }
    fn poll_cq(&mut self, out: &mut [Completion]) -> usize {
        self.world.lock().poll_cq(self.id, out)
    }
    fn poll_cm(&mut self) -> Option<CmEvent> {
        self.world.lock().poll_cm(self.id)
    }
    fn accept(&mut self, private_data: &[u8]) -> Result<(), VerbsError> {
        self.world.lock().accept(self.id, private_data)
    }
    fn reject(&mut self, private_data: &[u8]) -> Result<(), VerbsError> {
        self.world.lock().reject(self.id, private_data)
    }
    fn disconnect(&mut self) -> Result<(), VerbsError> {
        self.world.lock().disconnect(self.id)
    }
    fn local_addr(&self) -> SocketAddr {
        self.local
    }
    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }
}

impl Drop for SimEndpoint {
    fn drop(&mut self) {
        self.world.lock().destroy_qp(self.id);
    }
}

/// A listening CM id. Dropping it frees the port and rejects queued requests.
pub struct SimListener {
    world: Shared,
    id: Id,
    addr: SocketAddr,
}

impl std::fmt::Debug for SimListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimListener")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Listener for SimListener {
    type Endpoint = SimEndpoint;

    fn poll_request(&mut self) -> Option<(SimEndpoint, Vec<u8>)> {
        let (id, local, peer, pd) = self.world.lock().poll_request(self.id)?;
        Some((
            SimEndpoint {
                world: self.world.clone(),
                id,
                local,
                peer,
            },
            pd,
        ))
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for SimListener {
    fn drop(&mut self) {
        self.world.lock().drop_listener(self.id);
    }
}

#[cfg(test)]
mod tests;
