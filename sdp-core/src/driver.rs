//! Runs SDP engines over a provider: the glue between the sans-IO [`Conn`] and a
//! [`Provider`]'s endpoints.
//!
//! [`Driver::poll`] does one round of progress: for each connection with news, CM events in,
//! completions in, timers, then the engine's work requests posted and CM actions performed. A
//! provider that can say which endpoints something happened to ([`Provider::take_news`]: shm's
//! bell page) lets a round skip the rest (it still looks at those with work of their own and
//! those whose timer is due, and at every connection every `FULL_ROUND_EVERY`); for the others
//! every round looks at every connection. The driver is
//! synchronous and holds no clock: the caller passes `now` (virtual time in tests, a monotonic
//! clock in the socket layer), so the same code runs under the deterministic simulator and over
//! real devices.
//!
//! Each connection's buffers live in an [`MrStore`]: one memory region per engine buffer,
//! registered with local access only (the engine's buffers are never advertised to a peer).
//!
//! **Listen queues.** A listener's connections wait in its queue, being set up or established,
//! until the application takes one ([`Driver::accept_established`], as TCP's `accept`, or
//! [`Driver::accept`]); at most backlog + 1 of them, as
//! Linux's accept queue (`sk_acceptq_is_full`). A request beyond that is rejected at once with
//! [`REJECT_QUEUE_FULL`] through the provider's reject, for every provider alike (the socket
//! layer's connector waits and tries again, as a TCP client whose SYN was dropped). A queued
//! connection posts only a few receive buffers ([`Conn::accept_queued`]) and waits, as TCP's,
//! until accepted or the listener closes (with [`Config::unaccepted_timeout`] set, one the
//! application has not taken within it is aborted: its peer sees a reset, its memory and
//! endpoint are freed).
//!
//! **The one door.** The socket layer (`socket::runtime`) reaches engines and the provider only
//! through the driver: its calls (`connect`, `write`, `read_zcopy`, `set_nodelay`, ...), a
//! connection's [`ConnView`] (state, error, readiness, queues, counters), a few named queries
//! ([`Driver::next_is_zcopy`], [`Driver::conn_error`], [`Driver::close_pending`],
//! [`Driver::tx_queued`]) and the provider calls it needs ([`Driver::arm`],
//! [`Driver::device_lost`], [`Driver::reg_mr`], [`Driver::caller_memory`]). `Driver::conn`,
//! `Driver::with_conn` and `Driver::provider` hand out the engine and the provider
//! themselves, for tests, benches and the harness only: they exist only with the `harness`
//! feature (and a unit test keeps them out of `socket/`). An engine's events reach the socket
//! layer through [`Driver::take_events`] (zero-copy reports; `Closed`); readiness is no event,
//! the socket layer reads it from the [`ConnView`] of each connection a round or a call
//! touched ([`Driver::take_touched`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use crate::proto::buff::{Buf, BufStore};
use crate::proto::conn::CallError;
use crate::proto::conn::ConnStats;
use crate::proto::iocb::{ZSink, ZSrc};
use crate::proto::read::ZRecv;
use crate::proto::table::{ConnId, Table};
use crate::proto::{Config, Conn, ConnError, Event, Instant, Shutdown, State};
use crate::verbs::{
    Access, Completion, Endpoint, Grant, Listener, MemoryRegion, Provider, QpCaps, SendWr,
    VerbsError, WorkRequest, INLINE_LKEY, REJECT_QUEUE_FULL, REJECT_SDP_OFF,
};

/// A [`BufStore`] of memory regions registered on a provider, one region per buffer.
pub struct MrStore<P: Provider> {
    provider: Arc<P>,
    mrs: slab::Slab<P::Mr>,
    /// Grants of remote read on buffers (staged sends), by buffer id.
    grants: HashMap<u32, Grant>,
    bytes: usize,
}

impl<P: Provider> MrStore<P> {
    pub fn new(provider: Arc<P>) -> MrStore<P> {
        MrStore {
            provider,
            mrs: slab::Slab::new(),
            grants: HashMap::new(),
            bytes: 0,
        }
    }
    /// Bytes registered through this store now.
    pub fn registered_bytes(&self) -> usize {
        self.bytes
    }
}

impl<P: Provider> BufStore for MrStore<P> {
    fn alloc(&mut self, size: u32) -> Option<Buf> {
        // Receive and bounce buffers; bounce buffers are RDMA Read sinks (on iWARP that
        // takes remote write: READ_SINK asks for it there, and only for these).
        let mr = self
            .provider
            .reg_mr(size as usize, Access::LOCAL_WRITE | Access::READ_SINK)
            .ok()?;
        let buf = Buf {
            id: 0,
            addr: mr.addr(),
            lkey: mr.lkey(),
            size,
        };
        let id = self.mrs.insert(mr);
        self.bytes += size as usize;
        Some(Buf {
            id: id as u32,
            ..buf
        })
    }
    fn free(&mut self, buf: Buf) {
        self.revoke_read(&buf);
        if self.mrs.try_remove(buf.id as usize).is_some() {
            self.bytes -= buf.size as usize;
        }
    }
    fn write(&mut self, buf: &Buf, off: u32, src: &[u8]) {
        self.mrs[buf.id as usize].write(off as usize, src);
    }
    fn read(&self, buf: &Buf, off: u32, dst: &mut [u8]) {
        self.mrs[buf.id as usize].read(off as usize, dst);
    }
    fn grant_read(&mut self, buf: &Buf, len: u32) -> Option<(u64, u32)> {
        self.revoke_read(buf);
        let mr = self.mrs.get_mut(buf.id as usize)?;
        let g = mr.advertise(0, len as usize, Access::REMOTE_READ).ok()?;
        let out = (g.addr, g.rkey);
        self.grants.insert(buf.id, g);
        Some(out)
    }
    fn revoke_read(&mut self, buf: &Buf) {
        if let Some(g) = self.grants.remove(&buf.id) {
            if let Some(mr) = self.mrs.get_mut(buf.id as usize) {
                // The engine revokes only once the peer is done with the buffer (its reads
                // acknowledged) or the connection is over; a provider's refusal leaves the
                // region's deregistration (at free) to end the access.
                let _ = mr.revoke(&g);
            }
        }
    }
}

struct Entry<P: Provider> {
    conn: Conn<MrStore<P>>,
    /// Dropped (QP destroyed) when the engine reaches `Closed`.
    ep: Option<P::Endpoint>,
    events: Vec<Event>,
    /// The application let go of the id: remove the entry once the engine is done.
    released: bool,
    /// Local and peer address, kept when the endpoint goes (`accept` reports them, as TCP
    /// does for a connection that ended before it was accepted).
    addrs: Option<(SocketAddr, SocketAddr)>,
    /// In [`Driver::touched`] since the socket layer last took it.
    touched: bool,
    /// Since when the engine's outstanding sends made no progress (`Config::send_stall_timeout`),
    /// and its send completion count then.
    stall: Option<(Instant, u64)>,
    /// When the connection next needs a visit whatever its endpoint says: the engine's next
    /// timer or the send stall bound. Set by every pump (every change to the engine goes
    /// through one), so a round tells an idle connection by this and its endpoint's
    /// [`Endpoint::quiet`] without asking the engine.
    deadline: Option<Instant>,
    /// Where the provider reports news of its endpoint ([`Endpoint::news_token`]).
    news: Option<usize>,
    /// In [`Driver::dirty`]: the next round looks at it whatever the provider reports.
    dirty: bool,
    /// The deadline last put in [`Driver::heap`], and the heap's epoch then.
    heap_at: Option<(Instant, u64)>,
    /// The last selective round that looked at it (one look per round).
    round: u64,
}

impl<P: Provider> Entry<P> {
    fn new(conn: Conn<MrStore<P>>, ep: Option<P::Endpoint>) -> Entry<P> {
        Entry {
            conn,
            ep,
            events: Vec::new(),
            released: false,
            addrs: None,
            touched: false,
            stall: None,
            deadline: None,
            news: None,
            dirty: false,
            heap_at: None,
            round: 0,
        }
    }
}

/// A round of progress looks only at the connections with news (the provider's report, those
/// with work of their own, due timers: [`Driver::poll`]); every this often it looks at all of
/// them, for what the endpoints check on their own clock (shm: a peer's socket, every
/// `liveness_interval`).
const FULL_ROUND_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

struct ListenEntry<P: Provider> {
    listener: P::Listener,
    /// Connections not yet taken by [`Driver::accept`] (being set up or established), in
    /// arrival order, with when each arrived.
    queue: std::collections::VecDeque<(ConnId, Instant)>,
    /// Most connections `queue` holds: the backlog + 1.
    limit: usize,
    /// Requests refused, with why (for diagnostics and tests; the latest [`MAX_REFUSED`]).
    refused: Vec<ConnError>,
    stats: ListenStats,
    /// `Listener::handed_off` at the last round.
    handed_seen: u64,
    /// New requests are turned away ([`Driver::set_refusing`]); those queued stay.
    refusing: bool,
    /// TCP_DEFER_ACCEPT ([`Driver::set_defer_accept`]): an established connection is handed
    /// out once it has something to read, or once it waited this long.
    defer: Option<Duration>,
    /// How long a connection waits in `queue` before it is aborted (`None`: until accepted,
    /// as TCP's): `Config::unaccepted_timeout`, or [`SHARED_QUEUE_TIMEOUT`] once shared.
    unaccepted: Option<Duration>,
    /// When the queue was last tended (a deferred connection whose wait ended since is news).
    tended: Instant,
}

/// Whether the queued connection `c`, there since `since`, is handed out at `now` by a listener
/// that defers by `defer` (TCP_DEFER_ACCEPT, [`Driver::set_defer_accept`]).
fn deliverable<S: BufStore>(
    defer: Option<Duration>,
    c: &Conn<S>,
    since: Instant,
    now: Instant,
) -> bool {
    c.was_established() && defer.is_none_or(|d| now >= since + d || c.is_readable())
}

/// How long a connection set up before its listener was shared with other processes
/// ([`Driver::set_handoff`]) waits for this process's accept before it is aborted: the
/// others cannot take it, and a prefork parent never accepts (docs/preload.md).
pub const SHARED_QUEUE_TIMEOUT: Duration = Duration::from_secs(60);

/// Requests refused for another reason than a full queue, kept for [`Driver::refused`].
const MAX_REFUSED: usize = 64;

/// Counters of a listener ([`Driver::listen_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListenStats {
    /// Connections waiting to be accepted now (being set up or established).
    pub queued: usize,
    /// Of those, established (what [`Driver::accept_established`] hands out).
    pub ready: usize,
    /// Requests rejected because the queue was full.
    pub overflows: u64,
    /// Connections aborted because nobody accepted them within `Config::unaccepted_timeout`.
    pub timed_out: u64,
    /// Requests handed to other processes ([`Driver::set_handoff`]).
    pub handed_off: u64,
    /// Requests taken in whose connect request has not come yet (not in `queued`).
    pub unanswered: usize,
}

/// Identifies a listener in a [`Driver`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ListenerId(ConnId);

/// Engines and endpoints of one provider.
pub struct Driver<P: Provider> {
    provider: Arc<P>,
    cfg: Config,
    /// Write a line on stderr for each connection that ends with an error
    /// ([`Driver::set_trace`]).
    trace: bool,
    caps: QpCaps,
    conns: Table<Entry<P>>,
    listeners: Table<ListenEntry<P>>,
    scratch: Vec<Completion>,
    /// Completions handled right after their post (`pump`), not yet counted by a round.
    inline_done: usize,
    /// Send work requests gathered for one `post_sends`.
    sends: Vec<SendWr>,
    /// The time of the latest call that passed one (for calls that take none).
    now: Instant,
    /// Connections something happened to (a round of progress found work, or a call ran on
    /// them) since [`Driver::take_touched`]: the socket layer looks at these, not at all.
    touched: Vec<ConnId>,
    /// Scratch for a round's connection ids.
    ids: Vec<ConnId>,
    /// The earliest engine timer, as of the last round and every pump since: never later than
    /// the true one (a timer stopped since leaves it early: one needless wakeup), so
    /// [`Driver::next_deadline`] need not look at every connection.
    timers: Option<Instant>,
    /// Connections the next round looks at whatever the provider reports: an endpoint with
    /// work of its own (not [`Endpoint::quiet`]) or one the provider does not report.
    dirty: Vec<ConnId>,
    /// Connections' deadlines (a deadline that moved leaves its old entry behind: popped, it
    /// costs a look). Rebuilt by every full round (`heap_epoch`).
    heap: std::collections::BinaryHeap<std::cmp::Reverse<(Instant, ConnId)>>,
    heap_epoch: u64,
    /// [`Endpoint::news_token`] -> the connection.
    news_map: Vec<Option<ConnId>>,
    /// Scratch for [`Provider::take_news`].
    news: Vec<usize>,
    /// Selective rounds so far (`Entry::round`).
    round: u64,
    /// When the last round that looked at every connection ran.
    last_full: Option<Instant>,
    /// Connections rounds looked at, in all ([`Driver::looked_at`]).
    looked: u64,
}

/// Errors of driver calls.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverError {
    #[error("unknown connection or listener id")]
    BadId,
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    #[error(transparent)]
    Conn(#[from] ConnError),
    #[error(transparent)]
    Call(#[from] CallError),
}

impl<P: Provider> Driver<P> {
    pub fn new(provider: P, mut cfg: Config) -> Driver<P> {
        cfg.zcopy_by_send = Some(
            cfg.zcopy_by_send
                .unwrap_or_else(|| provider.prefers_send_gather()),
        );
        cfg.zcopy_split =
            Some(cfg.zcopy_split.unwrap_or_else(|| {
                cfg.zcopy_by_send == Some(true) && provider.prefers_split_zcopy()
            }));
        cfg.staged_send_min = Some(
            cfg.staged_send_min
                .unwrap_or_else(|| provider.staged_send_min()),
        );
        cfg.initiator_sends_first = Some(
            cfg.initiator_sends_first
                .unwrap_or_else(|| provider.initiator_sends_first()),
        );
        let caps = QpCaps {
            max_send_wr: 4 * cfg.max_rx_bufs + 64,
            max_recv_wr: cfg.max_rx_bufs + 8,
            // Small messages go inline where the device copies them at the post (rdma): a
            // 64-byte write with its header.
            max_inline: 128,
        };
        Driver {
            provider: Arc::new(provider),
            cfg,
            trace: false,
            caps,
            conns: Table::default(),
            listeners: Table::default(),
            scratch: vec![
                Completion {
                    wr_id: 0,
                    status: crate::verbs::WcStatus::Success,
                    opcode: crate::verbs::WcOpcode::Send,
                    byte_len: 0
                };
                64
            ],
            inline_done: 0,
            sends: Vec::with_capacity(POST_BATCH),
            now: Instant::default(),
            touched: Vec::new(),
            ids: Vec::new(),
            timers: None,
            dirty: Vec::new(),
            heap: std::collections::BinaryHeap::new(),
            heap_epoch: 0,
            news_map: Vec::new(),
            news: Vec::new(),
            round: 0,
            last_full: None,
            looked: 0,
        }
    }

    /// How many connections rounds of progress ([`Driver::poll`]) have looked at so far (for
    /// tests and diagnostics: a round passes idle connections by without a look when the
    /// provider reports news, [`Provider::take_news`]).
    pub fn looked_at(&self) -> u64 {
        self.looked
    }

    /// A new connection's entry: remember where its endpoint's news come from, and look at it
    /// in the next round.
    fn insert_entry(&mut self, entry: Entry<P>) -> ConnId {
        let token = entry.ep.as_ref().and_then(|ep| ep.news_token());
        let id = self.conns.insert(entry);
        if let Some(e) = self.conns.get_mut(id) {
            e.news = token;
            e.dirty = true;
            self.dirty.push(id);
        }
        if let Some(t) = token {
            if self.news_map.len() <= t {
                self.news_map.resize(t + 1, None);
            }
            self.news_map[t] = Some(id);
        }
        id
    }

    /// The provider itself.
    ///
    /// Not for the socket layer, which reaches the provider only through the calls below
    /// ([`Driver::arm`], [`Driver::device_lost`], [`Driver::reg_mr`],
    /// [`Driver::caller_memory`]): with the `harness` feature only, for the tests, the benches,
    /// the harness and the examples, which register memory and drive waits themselves.
    #[cfg(feature = "harness")]
    #[doc(hidden)]
    pub fn provider(&self) -> &Arc<P> {
        &self.provider
    }
    /// `on`: each connection that ends with an error writes one line on stderr: the error,
    /// where the engine decided it, the addresses and the engine's state (`SDP_TRACE`).
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on;
    }

    /// The engine's state carries where the error was decided (`Conn::error_site`).
    fn trace_end(provider: &P, id: ConnId, conn: &Conn<MrStore<P>>, err: &ConnError) {
        eprintln!(
            "sdp[{} {}]: connection {id:?} ended: {err}; {}",
            std::process::id(),
            provider.name(),
            conn.debug_state()
        );
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Start connecting to `dst`.
    pub fn connect(
        &mut self,
        now: Instant,
        dst: SocketAddr,
        src: Option<SocketAddr>,
    ) -> Result<ConnId, DriverError> {
        self.now = self.now.max(now);
        let store = MrStore::new(self.provider.clone());
        let port = src.map_or(0, |s| s.port());
        let (conn, hello) = Conn::connect(self.cfg.clone(), store, now, port, dst.is_ipv6())?;
        let ep = self.provider.connect(dst, src, self.caps, &hello)?;
        let id = self.insert_entry(Entry::new(conn, Some(ep)));
        self.pump(now, id);
        Ok(id)
    }

    /// Listen on `addr`: at most `backlog` + 1 connections wait to be accepted (see the module
    /// docs; callers cap `backlog` as they see fit, the socket layer at somaxconn).
    pub fn listen(&mut self, addr: SocketAddr, backlog: u32) -> Result<ListenerId, DriverError> {
        let listener = self.provider.listen(addr, backlog, self.caps)?;
        Ok(self.add_listener(listener, backlog))
    }

    fn add_listener(&mut self, listener: P::Listener, backlog: u32) -> ListenerId {
        ListenerId(self.listeners.insert(ListenEntry {
            listener,
            queue: Default::default(),
            limit: (backlog as usize).saturating_add(1),
            refused: Vec::new(),
            stats: ListenStats::default(),
            handed_seen: 0,
            refusing: false,
            defer: None,
            unaccepted: self.cfg.unaccepted_timeout,
            tended: self.now,
        }))
    }

    /// A listener on `addr` that takes only requests handed over by another process sharing
    /// a listener there ([`Driver::adopt`]); as [`Driver::listen`] otherwise.
    pub fn listen_adopted(
        &mut self,
        addr: SocketAddr,
        backlog: u32,
    ) -> Result<ListenerId, DriverError> {
        let listener = self.provider.listen_adopted(addr, backlog, self.caps)?;
        Ok(self.add_listener(listener, backlog))
    }

    /// Answer a request another process's listener handed off (`Listener::set_handoff`): it
    /// joins `l`'s queue as its own.
    pub fn adopt(&mut self, l: ListenerId, request: OwnedFd) -> Result<(), DriverError> {
        let e = self.listeners.get_mut(l.0).ok_or(DriverError::BadId)?;
        e.listener.adopt(request)?;
        Ok(())
    }

    /// From now on `l` hands every request, unanswered, down `to` for other processes sharing
    /// the listener to answer; [`ListenStats::handed_off`] counts them.
    pub fn set_handoff(&mut self, l: ListenerId, to: OwnedFd) -> Result<(), DriverError> {
        let e = self.listeners.get_mut(l.0).ok_or(DriverError::BadId)?;
        e.listener.set_handoff(to)?;
        // What waits in this queue now waits for this process's accept alone (a prefork
        // parent never accepts): bounded, as before TCP's unbounded wait was kept.
        e.unaccepted = Some(e.unaccepted.unwrap_or(SHARED_QUEUE_TIMEOUT));
        Ok(())
    }

    /// Turn new connect requests to `l` away (`on`) with [`REJECT_SDP_OFF`], so connectors go
    /// elsewhere (kernel TCP); connections already queued stay to be accepted.
    pub fn set_refusing(&mut self, l: ListenerId, on: bool) {
        if let Some(e) = self.listeners.get_mut(l.0) {
            e.refusing = on;
            e.listener.set_refusing(on);
        }
    }

    /// TCP_DEFER_ACCEPT of `secs` seconds (0: off): an established connection waits in the
    /// queue, not handed out nor counted ready, until it has data to read (or EOF, or an error)
    /// or has waited as long as Linux defers (the SYN-ACK retransmissions that cover `secs`:
    /// 1, 3, 7, 15, 31 s).
    pub fn set_defer_accept(&mut self, l: ListenerId, secs: u32) {
        if let Some(e) = self.listeners.get_mut(l.0) {
            e.defer = (secs > 0).then(|| {
                let mut wait = 1u64;
                while wait < u64::from(secs) && wait < 31 {
                    wait = wait * 2 + 1;
                }
                Duration::from_secs(wait)
            });
        }
    }

    pub fn listener_addr(&self, l: ListenerId) -> Option<SocketAddr> {
        self.listeners.get(l.0).map(|e| e.listener.local_addr())
    }

    /// Stop listening: connections not yet accepted are aborted (their peers see a reset, as
    /// TCP resets the connections of a closed listener's queue), requests not yet answered
    /// are rejected.
    pub fn close_listener(&mut self, l: ListenerId) {
        if let Some(e) = self.listeners.remove(l.0) {
            let now = self.now;
            for (id, _) in e.queue {
                self.abort(now, id);
                self.release(now, id);
            }
        }
    }

    /// Requests this listener refused for another reason than a full queue, and why (the
    /// latest few).
    pub fn refused(&self, l: ListenerId) -> &[ConnError] {
        self.listeners.get(l.0).map_or(&[], |e| &e.refused)
    }

    /// The listener's queue and counters.
    pub fn listen_stats(&self, l: ListenerId) -> Option<ListenStats> {
        let e = self.listeners.get(l.0)?;
        let ready = e
            .queue
            .iter()
            .filter(|&&(id, since)| {
                self.conns
                    .get(id)
                    .is_some_and(|c| deliverable(e.defer, &c.conn, since, self.now))
            })
            .count();
        Some(ListenStats {
            queued: e.queue.len(),
            ready,
            handed_off: e.listener.handed_off(),
            unanswered: e.listener.unanswered(),
            ..e.stats
        })
    }

    /// Take the first connection of the listener's queue, in arrival order: established or
    /// still being set up (not one whose setup failed). From now on it grows its buffers as
    /// any connection. The socket layer uses [`Driver::accept_established`].
    pub fn accept(&mut self, l: ListenerId) -> Option<ConnId> {
        self.take_queued(l, |c, _| {
            c.was_established() || c.state() == State::Accepting
        })
    }

    /// Take the first established connection of the listener's queue, in arrival order, as
    /// TCP's `accept` does (one reset or closed by its peer since is handed over too; one
    /// still being set up waits, one whose setup failed never comes).
    /// With TCP_DEFER_ACCEPT ([`Driver::set_defer_accept`]) only one with something to read
    /// or that waited the deferral out.
    pub fn accept_established(&mut self, l: ListenerId) -> Option<ConnId> {
        let (now, defer) = (self.now, self.listeners.get(l.0)?.defer);
        self.take_queued(l, |c, since| deliverable(defer, c, since, now))
    }

    fn take_queued(
        &mut self,
        l: ListenerId,
        pick: impl Fn(&Conn<MrStore<P>>, Instant) -> bool,
    ) -> Option<ConnId> {
        let conns = &self.conns;
        let e = self.listeners.get_mut(l.0)?;
        let i = e
            .queue
            .iter()
            .position(|&(id, since)| conns.get(id).is_some_and(|c| pick(&c.conn, since)))?;
        let (id, _) = e.queue.remove(i)?;
        let now = self.now;
        let _ = self.apply(now, id, |c| c.set_accepted(now));
        Some(id)
    }

    /// Drop the queue's connections whose setup failed; abort those waiting longer than
    /// `unaccepted_timeout`. Returns how many were aborted, and how many deferred connections
    /// became ready to hand out by waiting the deferral out (news for the listener's readiness).
    fn tend_queue(&mut self, now: Instant, lid: ConnId) -> usize {
        let conns = &self.conns;
        let Some(e) = self.listeners.get_mut(lid) else {
            return 0;
        };
        let timeout = e.unaccepted;
        let waited_out = e.defer.map_or(0, |d| {
            let since_tended = e.tended;
            e.queue
                .iter()
                .filter(|&&(_, since)| since + d > since_tended && since + d <= now)
                .count()
        });
        e.tended = now;
        let mut gone = Vec::new();
        let mut expired = Vec::new();
        e.queue.retain(|&(id, since)| {
            let live = conns
                .get(id)
                .is_some_and(|c| c.conn.was_established() || c.conn.state() == State::Accepting);
            if !live {
                gone.push(id);
                false
            } else if timeout.is_some_and(|t| now >= since + t) {
                expired.push(id);
                false
            } else {
                true
            }
        });
        e.stats.timed_out += expired.len() as u64;
        for &id in &expired {
            self.abort(now, id);
        }
        for id in gone.into_iter().chain(expired.iter().copied()) {
            self.release(now, id);
        }
        expired.len() + waited_out
    }

    /// One round of progress on every listener and connection. Returns how many inputs
    /// (completions, CM events, connect requests, expired timers) it handled: zero means
    /// nothing happened, so a progress loop may go to sleep.
    pub fn poll(&mut self, now: Instant) -> usize {
        self.now = self.now.max(now);
        let mut activity = self.take_inline_done();
        for lid in self.listeners.ids() {
            activity += self.tend_queue(now, lid);
            while let Some(le) = self.listeners.get_mut(lid) {
                let Some((mut ep, pd)) = le.listener.poll_request() else {
                    // Requests handed to other processes are news for the bell.
                    let handed = le.listener.handed_off();
                    activity += (handed - le.handed_seen) as usize;
                    le.handed_seen = handed;
                    break;
                };
                activity += 1;
                if le.refusing {
                    let _ = ep.reject(REJECT_SDP_OFF.as_bytes());
                    continue;
                }
                if le.queue.len() >= le.limit {
                    // Full: turn the request away at once (the endpoint goes with it), as
                    // Linux drops a SYN when the accept queue is full.
                    le.stats.overflows += 1;
                    let _ = ep.reject(REJECT_QUEUE_FULL.as_bytes());
                    continue;
                }
                let store = MrStore::new(self.provider.clone());
                match Conn::accept_queued(self.cfg.clone(), store, now, &pd) {
                    Ok((conn, ack)) => {
                        // Receives go on the QP before the accept, so the peer's first
                        // message always finds one.
                        let mut entry = Entry::new(conn, None);
                        entry.deadline = entry.conn.poll_timeout();
                        let posted = post_all(&mut entry.conn, &mut ep, &mut self.sends, None);
                        if posted.is_err() || ep.accept(&ack).is_err() {
                            note_refused(&mut le.refused, ConnError::NoMemory);
                            let _ = ep.reject(b"SDP: out of resources");
                            continue;
                        }
                        entry.ep = Some(ep);
                        let id = self.insert_entry(entry);
                        if let Some(le) = self.listeners.get_mut(lid) {
                            le.queue.push_back((id, now));
                        }
                    }
                    Err(e) => {
                        let reason = format!("SDP: {e}");
                        let _ = ep.reject(
                            &reason.as_bytes()
                                [..reason.len().min(crate::verbs::MAX_PRIVATE_DATA_REJECT)],
                        );
                        note_refused(&mut le.refused, e);
                    }
                }
            }
        }
        let recent = self
            .last_full
            .is_some_and(|t| now.saturating_since(t) < FULL_ROUND_EVERY);
        // (Asked every round, so what the provider keeps for the report never piles up.)
        self.news.clear();
        if self.provider.take_news(&mut self.news) && recent {
            return activity + self.poll_news(now);
        }
        self.last_full = Some(now);
        // Every connection: what is dirty now is looked at anyway, and the deadline heap is
        // rebuilt as the round passes each connection (`progress`, `pump`).
        for id in std::mem::take(&mut self.dirty) {
            if let Some(e) = self.conns.get_mut(id) {
                e.dirty = false;
            }
        }
        self.heap.clear();
        self.heap_epoch += 1;
        let mut ids = std::mem::take(&mut self.ids);
        self.conns.ids_into(&mut ids);
        // Each connection's timer folds in as the round passes it (`progress`, `pump`).
        self.timers = None;
        self.looked += ids.len() as u64;
        for &id in &ids {
            activity += self.progress(now, id);
        }
        self.ids = ids;
        activity
    }

    /// A round that looks only at the connections with news: those the provider reported
    /// (`self.news`), those with work of their own (`dirty`), those whose deadline came. A busy
    /// server's thousands of idle connections cost nothing here (one pass over the provider's
    /// bells), where a look at each cost ~100 ns of cache misses.
    fn poll_news(&mut self, now: Instant) -> usize {
        self.round += 1;
        let round = self.round;
        let mut ids = std::mem::take(&mut self.ids);
        ids.clear();
        for id in self.dirty.drain(..) {
            if let Some(e) = self.conns.get_mut(id) {
                e.dirty = false;
                ids.push(id);
            }
        }
        for &t in &self.news {
            if let Some(Some(id)) = self.news_map.get(t) {
                ids.push(*id);
            }
        }
        while let Some(&std::cmp::Reverse((t, id))) = self.heap.peek() {
            if t > now {
                break;
            }
            self.heap.pop();
            if let Some(e) = self.conns.get_mut(id) {
                if e.heap_at.is_some_and(|(at, _)| at == t) {
                    e.heap_at = None;
                }
                ids.push(id);
            }
        }
        let mut activity = 0;
        for &id in &ids {
            match self.conns.get_mut(id) {
                Some(e) if e.round != round => e.round = round,
                _ => continue,
            }
            self.looked += 1;
            activity += self.progress(now, id);
        }
        self.ids = ids;
        // Every deadline is in the heap (or was popped and looked at just now).
        self.timers = self.heap.peek().map(|r| r.0 .0);
        activity
    }

    /// Keep `id`'s deadline in the heap.
    fn heap_deadline(
        heap: &mut std::collections::BinaryHeap<std::cmp::Reverse<(Instant, ConnId)>>,
        epoch: u64,
        e: &mut Entry<P>,
        id: ConnId,
    ) {
        if let Some(d) = e.deadline {
            if e.heap_at != Some((d, epoch)) {
                e.heap_at = Some((d, epoch));
                heap.push(std::cmp::Reverse((d, id)));
            }
        }
    }

    /// [`Driver::poll`] for one connection only (an application call on it that would block,
    /// or that follows a direct wakeup): its completions, CM events and due timers, and the
    /// completions other calls handled inline. The other connections wait for the next round
    /// (the progress thread's), so a call costs the same with ten connections or ten
    /// thousand.
    pub fn poll_one(&mut self, now: Instant, id: ConnId) -> usize {
        self.now = self.now.max(now);
        self.take_inline_done() + self.progress(now, id)
    }

    fn progress(&mut self, now: Instant, id: ConnId) -> usize {
        let Some(e) = self.conns.get_mut(id) else {
            return 0;
        };
        // An idle connection costs a few loads: its endpoint saw nothing new and nothing of
        // it is due (its deadline, kept by `pump`). Everything else that changes an engine
        // (the application's calls) pumps it at once (`apply`), so there is nothing left to
        // post either.
        let deadline = e.deadline;
        if e.ep.as_ref().is_some_and(|ep| ep.quiet()) && deadline.is_none_or(|t| t > now) {
            self.timers = earliest(self.timers, deadline);
            Self::heap_deadline(&mut self.heap, self.heap_epoch, e, id);
            return 0;
        }
        let mut activity = 0;
        if let Some(ep) = e.ep.as_mut() {
            // Completions first: they happened before any disconnect the CM reports now, and
            // an error completion says more about why than the disconnect does.
            activity += drain_cq(&mut e.conn, ep, &mut self.scratch, now);
            while let Some(ev) = ep.poll_cm() {
                activity += 1;
                // On a real device a CM event can be read before completions that happened
                // before it (the peer's last messages, then its DREQ): look at the CQ again
                // after taking the event, so the engine sees them first.
                activity += drain_cq(&mut e.conn, ep, &mut self.scratch, now);
                e.conn.handle_cm(now, ev);
            }
        }
        if e.conn.poll_timeout().is_some_and(|t| t <= now) {
            activity += 1;
            e.conn.handle_timeout(now);
        }
        if let (Some((since, n)), Some(bound)) = (e.stall, self.cfg.send_stall_timeout) {
            // (A completion handled just now is progress: the pump below starts over.)
            if now.saturating_since(since) >= bound
                && e.conn.send_completions() == n
                && e.conn.sends_in_flight() > 0
                && e.conn.state() != State::Closed
            {
                activity += 1;
                e.conn.fail_stalled(now);
            }
        }
        self.pump(now, id);
        activity
    }

    /// Post the engine's work requests, perform its CM actions, collect its events.
    fn pump(&mut self, now: Instant, id: ConnId) {
        self.pump_with(now, id, None)
    }

    /// [`Driver::pump`] after a write that may have queued inline payloads
    /// ([`Conn::write_inline`]): `data` is that write's bytes, which they are taken from.
    fn pump_with(&mut self, now: Instant, id: ConnId, data: Option<&[u8]>) {
        let Some(e) = self.conns.get_mut(id) else {
            return;
        };
        if !e.touched {
            e.touched = true;
            self.touched.push(id);
        }
        if let Some(ep) = e.ep.as_mut() {
            if !e.conn.settled() {
                // Before anything new goes out: a side that said it was settled (the runtime
                // says so after a call or a round) is not any more once it has bytes to send
                // or unread ones (a death now must be a reset, not an orderly end).
                ep.set_settled(false);
            }
            post_or_abort(&mut e.conn, ep, &mut self.sends, now, data);
            // A provider that runs work requests in the caller (shm) completed them already:
            // hand the completions to the engine now (freed buffers let queued data go), so
            // nobody has to be woken for them (`Endpoint::post_send`). They count as activity
            // of the next round (`Driver::poll`), whose callers wake waiters for it.
            let mut rounds = 0;
            loop {
                let n = drain_inline(&mut e.conn, ep, &mut self.scratch, now);
                if n == 0 {
                    break;
                }
                self.inline_done += n;
                rounds += 1;
                post_or_abort(&mut e.conn, ep, &mut self.sends, now, None);
                if rounds == MAX_POST_ROUNDS {
                    ep.notify_pending();
                    break;
                }
            }
            while let Some(crate::proto::CmAction::Disconnect) = e.conn.poll_cm() {
                let r = ep.disconnect();
                if matches!(r, Err(VerbsError::NotConnected)) && !e.conn.was_established() {
                    // Nothing to disconnect: the connection was never set up (a connect given
                    // up, timed out or aborted before the peer answered). It is over now, and
                    // the endpoint goes at once (its peer learns from the CM), instead of
                    // lingering, still able to complete the handshake, for
                    // `disconnect_timeout`.
                    e.conn.handle_cm(now, crate::verbs::CmEvent::Disconnected);
                }
            }
        }
        while let Some(ev) = e.conn.poll_event() {
            if let (true, Event::Closed(Some(err))) = (self.trace, &ev) {
                Self::trace_end(&self.provider, id, &e.conn, err);
            }
            // Nobody takes the events of a connection waiting in a listen queue: keep them
            // from piling up (the application looks at the state once it accepts).
            if e.conn.is_queued()
                && e.events.len() >= MAX_QUEUED_EVENTS
                && !matches!(ev, Event::Closed(_))
            {
                continue;
            }
            e.events.push(ev);
        }
        // Outstanding sends must make progress (`Config::send_stall_timeout`): the watch
        // starts when sends are outstanding and starts over at each send completion.
        if self.cfg.send_stall_timeout.is_some() {
            let done = e.conn.send_completions();
            e.stall = match e.stall {
                _ if e.conn.sends_in_flight() == 0 || e.conn.state() == State::Closed => None,
                Some((since, n)) if n == done => Some((since, n)),
                _ => Some((now, done)),
            };
        }
        // Whatever this pump follows (a round, a call) may have moved the engine's timers.
        let stall_bound = e
            .stall
            .zip(self.cfg.send_stall_timeout)
            .map(|((since, _), bound)| since + bound);
        e.deadline = earliest(e.conn.poll_timeout(), stall_bound);
        self.timers = earliest(self.timers, e.deadline);
        Self::heap_deadline(&mut self.heap, self.heap_epoch, e, id);
        // The next round looks at it if its endpoint has work of its own (completions left in
        // the queue, sends waiting, an event) or nothing reports its news.
        if !e.dirty
            && e.ep
                .as_ref()
                .is_some_and(|ep| e.news.is_none() || !ep.quiet())
        {
            e.dirty = true;
            self.dirty.push(id);
        }
        if e.conn.state() == State::Closed {
            // Destroy the QP; the engine already gave its buffers back.
            if let Some(ep) = e.ep.take() {
                e.addrs = Some((ep.local_addr(), ep.peer_addr()));
                if let Some(t) = e.news.take() {
                    if self.news_map.get(t) == Some(&Some(id)) {
                        self.news_map[t] = None;
                    }
                }
            }
            if e.released {
                self.conns.remove(id);
            }
        }
    }

    /// The earliest deadline of any connection or listen queue (possibly earlier than any:
    /// see `timers`).
    pub fn next_deadline(&self) -> Option<Instant> {
        let mut best = self.timers;
        for lid in self.listeners.ids() {
            let Some(e) = self.listeners.get(lid) else {
                continue;
            };
            // The queue is in arrival order: its first connection times out first.
            if let (Some(&(_, since)), Some(t)) = (e.queue.front(), e.unaccepted) {
                best = earliest(best, Some(since + t));
            }
            // The first deferred connection whose deferral is still to end.
            if let Some(d) = e.defer {
                let next = e.queue.iter().map(|&(_, s)| s + d).find(|&t| t > e.tended);
                best = earliest(best, next);
            }
        }
        best
    }

    fn entry(&mut self, id: ConnId) -> Result<&mut Entry<P>, DriverError> {
        self.conns.get_mut(id).ok_or(DriverError::BadId)
    }

    /// Run `f` on a connection's engine, then post what it produced.
    ///
    /// Not for the socket layer, which changes an engine only through the driver's named
    /// calls: public for the tests, which reach engine calls the socket layer has no use for
    /// (cancels, sequence-number shifts); with the `harness` feature only.
    #[cfg(feature = "harness")]
    #[doc(hidden)]
    pub fn with_conn<R>(
        &mut self,
        now: Instant,
        id: ConnId,
        f: impl FnOnce(&mut Conn<MrStore<P>>) -> R,
    ) -> Result<R, DriverError> {
        self.apply(now, id, f)
    }

    /// Run `f` on a connection's engine, then post what it produced (the named calls' body).
    fn apply<R>(
        &mut self,
        now: Instant,
        id: ConnId,
        f: impl FnOnce(&mut Conn<MrStore<P>>) -> R,
    ) -> Result<R, DriverError> {
        let r = f(&mut self.entry(id)?.conn);
        self.pump(now, id);
        Ok(r)
    }

    /// Read-only access to a connection's engine.
    ///
    /// Not for the socket layer, which reads a connection only through [`Driver::view`] and
    /// the named queries below: public for the tests, the benches and the harness, which
    /// look at the engine's internals (sequence numbers, counters, `debug_state`); with the
    /// `harness` feature only.
    #[cfg(feature = "harness")]
    #[doc(hidden)]
    pub fn conn(&self, id: ConnId) -> Option<&Conn<MrStore<P>>> {
        self.conns.get(id).map(|e| &e.conn)
    }

    // ---- What the socket layer reads and asks of a connection and of the provider ----
    //
    // The socket layer (`socket::runtime`) reaches the engine and the provider only through
    // these and the calls above (`connect`, `write`, `read`, ...), never through
    // [`Driver::conn`], [`Driver::with_conn`] or [`Driver::provider`].

    /// What the socket layer reads of a connection at once (its state, error, readiness and
    /// counters); `None` for an unknown id.
    pub fn view(&self, id: ConnId) -> Option<ConnView<'_, P>> {
        self.conns.get(id).map(|e| ConnView(&e.conn))
    }

    /// Completions handled right after their post since the last call (or round): a caller
    /// that made some wakes other waiters, as a round of progress would have.
    pub fn take_inline_done(&mut self) -> usize {
        std::mem::take(&mut self.inline_done)
    }

    /// Direct wakeups ([`Endpoint::give_direct_wake`]): give the connection's peer `fd`.
    /// False where the provider has none (or the id is unknown).
    pub fn give_direct_wake(&mut self, id: ConnId, fd: std::os::fd::BorrowedFd<'_>) -> bool {
        self.conns
            .get_mut(id)
            .and_then(|e| e.ep.as_mut())
            .is_some_and(|ep| ep.give_direct_wake(fd))
    }

    /// The connection's endpoint, if it has one.
    fn endpoint(&self, id: ConnId) -> Option<&P::Endpoint> {
        self.conns.get(id).and_then(|e| e.ep.as_ref())
    }

    /// Turn the connection's direct wakeups on or off ([`Endpoint::set_direct_wake`]).
    pub fn set_direct_wake(&self, id: ConnId, on: bool, settle: bool) {
        if let Some(ep) = self.endpoint(id) {
            ep.set_direct_wake(on, settle);
        }
    }

    /// Tell the connection's endpoint whether its side is settled ([`Conn::settled`],
    /// [`Endpoint::set_settled`]; never unless `may`): after every change the application or
    /// a round made.
    pub fn note_settled(&self, id: ConnId, may: bool) {
        if let Some(e) = self.conns.get(id) {
            if let Some(ep) = e.ep.as_ref() {
                ep.set_settled(may && e.conn.settled());
            }
        }
    }

    /// Whether the connection's reader needs a direct wakeup per SEND
    /// ([`Endpoint::set_direct_level`]).
    pub fn set_direct_level(&self, id: ConnId, level: bool) {
        if let Some(ep) = self.endpoint(id) {
            ep.set_direct_level(level);
        }
    }

    /// [`Endpoint::direct_unread_clear`] of the connection.
    pub fn direct_unread_clear(
        &self,
        id: ConnId,
    ) -> Option<std::sync::Arc<dyn Fn() + Send + Sync>> {
        self.endpoint(id).and_then(|ep| ep.direct_unread_clear())
    }

    /// A wait for the connection's peer's direct wakeups of the SENDs taken so far
    /// ([`Endpoint::direct_settler`]), to run without the caller's locks.
    pub fn direct_settler(&self, id: ConnId) -> Option<Box<dyn FnOnce() + Send>> {
        self.endpoint(id).and_then(|ep| ep.direct_settler())
    }

    /// Whether the connection's endpoint has nothing new ([`Endpoint::quiet`]); false for an
    /// unknown id.
    pub fn endpoint_quiet(&self, id: ConnId) -> bool {
        self.endpoint(id).is_some_and(|ep| ep.quiet())
    }

    /// The connection's error, if it failed; `None` also for an unknown id.
    pub fn conn_error(&self, id: ConnId) -> Option<&ConnError> {
        self.conns.get(id).and_then(|e| e.conn.error())
    }

    /// What a connect under way waits on, when that is a process of this host
    /// ([`Endpoint::local_wait`]).
    pub fn local_wait(&self, id: ConnId) -> Option<crate::verbs::LocalWait> {
        self.endpoint(id).and_then(|ep| ep.local_wait())
    }

    /// Whether the next stream bytes are a peer's zero-copy source that
    /// [`Driver::read_zcopy`] may take ([`Conn::next_is_zcopy`]).
    pub fn next_is_zcopy(&self, id: ConnId) -> Result<bool, DriverError> {
        let e = self.conns.get(id).ok_or(DriverError::BadId)?;
        Ok(e.conn.next_is_zcopy().is_some())
    }

    /// The application closed the connection and something of ours has yet to reach the peer
    /// ([`Conn::close_pending`]); false for an unknown id.
    pub fn close_pending(&self, id: ConnId) -> bool {
        self.conns.get(id).is_some_and(|e| e.conn.close_pending())
    }

    /// Bytes written and not yet acknowledged by the peer; 0 for an unknown id.
    pub fn tx_queued(&self, id: ConnId) -> usize {
        self.conns.get(id).map_or(0, |e| e.conn.tx_queued_bytes())
    }

    /// Copy received bytes without consuming them (`MSG_PEEK`).
    pub fn peek(
        &self,
        id: ConnId,
        dst: &mut [u8],
    ) -> Result<Result<usize, CallError>, DriverError> {
        let e = self.conns.get(id).ok_or(DriverError::BadId)?;
        Ok(e.conn.peek(dst))
    }

    /// TCP_NODELAY in force; `None` for an unknown id.
    pub fn nodelay(&self, id: ConnId) -> Option<bool> {
        self.conns.get(id).map(|e| e.conn.config().nodelay)
    }
    /// TCP_NODELAY.
    pub fn set_nodelay(&mut self, now: Instant, id: ConnId, on: bool) -> Result<(), DriverError> {
        self.apply(now, id, |c| c.set_nodelay(on))
    }
    /// SO_OOBINLINE ([`Conn::set_oob_inline`]).
    pub fn set_oob_inline(
        &mut self,
        now: Instant,
        id: ConnId,
        on: bool,
    ) -> Result<(), DriverError> {
        self.apply(now, id, |c| c.set_oob_inline(on))
    }
    /// SO_SNDBUF in force; `None` for an unknown id.
    pub fn sndbuf(&self, id: ConnId) -> Option<usize> {
        self.conns.get(id).map(|e| e.conn.config().sndbuf)
    }
    /// SO_SNDBUF.
    pub fn set_sndbuf(
        &mut self,
        now: Instant,
        id: ConnId,
        bytes: usize,
    ) -> Result<(), DriverError> {
        self.apply(now, id, |c| c.set_sndbuf(bytes))
    }
    /// Receive buffer bytes the connection may have (SO_RCVBUF in force); `None` for an
    /// unknown id.
    pub fn rcvbuf(&self, id: ConnId) -> Option<usize> {
        self.conns.get(id).map(|e| e.conn.rcvbuf())
    }
    /// The application reads only what readiness reports ([`Conn::set_read_ahead`]).
    pub fn set_read_ahead(&mut self, now: Instant, id: ConnId) -> Result<(), DriverError> {
        self.apply(now, id, |c| c.set_read_ahead(now))
    }

    /// Stage no more writes on the connection ([`Conn::stop_staging`]).
    pub fn stop_staging(&mut self, now: Instant, id: ConnId) -> Result<(), DriverError> {
        self.apply(now, id, |c| c.stop_staging())
    }

    /// SO_RCVBUF: receive buffer bytes the connection may have (within the stack's
    /// `max_rx_bufs`).
    pub fn set_rcvbuf(
        &mut self,
        now: Instant,
        id: ConnId,
        bytes: usize,
    ) -> Result<(), DriverError> {
        self.apply(now, id, |c| c.set_rcvbuf(Some(bytes)))
    }

    /// Send one urgent byte (MSG_OOB) after what was written.
    pub fn send_urgent(
        &mut self,
        now: Instant,
        id: ConnId,
        byte: u8,
    ) -> Result<Result<(), CallError>, DriverError> {
        self.apply(now, id, |c| c.send_urgent(now, byte))
    }
    /// Take the urgent byte (MSG_OOB), or with `peek` look at it; `None` if there is none.
    pub fn read_urgent(
        &mut self,
        now: Instant,
        id: ConnId,
        peek: bool,
    ) -> Result<Option<u8>, DriverError> {
        self.apply(now, id, |c| {
            if peek {
                c.peek_urgent()
            } else {
                c.read_urgent()
            }
        })
    }

    /// Ask the provider for a notification at its next news ([`Provider::arm`]).
    pub fn arm(&self) -> Result<(), VerbsError> {
        self.provider.arm()
    }
    /// Whether the provider's device went away ([`Provider::device_lost`]; then
    /// [`Driver::release_device`]).
    pub fn device_lost(&self) -> bool {
        self.provider.device_lost()
    }
    /// Register `len` zeroed bytes on the provider ([`Provider::reg_mr`]).
    pub fn reg_mr(&self, len: usize, access: Access) -> Result<P::Mr, VerbsError> {
        self.provider.reg_mr(len, access)
    }
    /// A handle that registers the caller's own memory on the provider for one call
    /// ([`CallerMemory::reg_mr_at`]), usable after the lock that guards the driver is let go
    /// (a registration can take long: nobody else's progress should wait for it).
    pub fn caller_memory(&self) -> CallerMemory<P> {
        CallerMemory(self.provider.clone())
    }

    /// `write(2)`. Where the endpoint takes inline payloads ([`Endpoint::inline_max`]), bytes
    /// that can go at once go as SENDs whose payload the provider copies from `data` while
    /// this call posts them ([`Conn::write_inline`]), without a copy into a send buffer first.
    pub fn write(&mut self, now: Instant, id: ConnId, data: &[u8]) -> Result<usize, CallError> {
        let inline_on = self.cfg.inline_sends;
        let Ok(e) = self.entry(id) else {
            return Err(CallError::NotConnected);
        };
        let inline_max = match e.ep.as_ref() {
            Some(ep) if inline_on => ep.inline_max(),
            _ => 0,
        };
        let r = e.conn.write_inline(now, data, inline_max);
        self.pump_with(now, id, Some(data));
        r
    }
    pub fn read(&mut self, now: Instant, id: ConnId, buf: &mut [u8]) -> Result<usize, CallError> {
        self.call(now, id, |c| c.read(now, buf))
    }
    pub fn write_zcopy(
        &mut self,
        now: Instant,
        id: ConnId,
        src: ZSrc,
        token: u64,
    ) -> Result<(), CallError> {
        self.call(now, id, |c| c.write_zcopy(now, src, token))
    }
    pub fn write_zcopy_bounded(
        &mut self,
        now: Instant,
        id: ConnId,
        src: ZSrc,
        token: u64,
        stall: std::time::Duration,
    ) -> Result<(), CallError> {
        self.call(now, id, |c| c.write_zcopy_bounded(now, src, token, stall))
    }
    pub fn read_zcopy(
        &mut self,
        now: Instant,
        id: ConnId,
        sink: ZSink,
        token: u64,
    ) -> Result<ZRecv, CallError> {
        self.call(now, id, |c| c.read_zcopy(now, sink, token))
    }
    pub fn shutdown(&mut self, now: Instant, id: ConnId, how: Shutdown) -> Result<(), CallError> {
        self.call(now, id, |c| c.shutdown(now, how))
    }
    pub fn abort(&mut self, now: Instant, id: ConnId) {
        let _ = self.apply(now, id, |c| c.abort(now));
    }
    /// `close(2)`: the engine finishes in the background; the id stays valid for
    /// [`Driver::take_events`] until the engine is done.
    pub fn close(&mut self, now: Instant, id: ConnId) {
        let _ = self.apply(now, id, |c| c.close(now));
        self.release(now, id);
    }

    /// `close(2)` on the application's behalf while it keeps the id (process exit): the engine
    /// finishes as after [`Driver::close`], and the id stays valid until released.
    pub fn close_keep(&mut self, now: Instant, id: ConnId) {
        let _ = self.apply(now, id, |c| c.close(now));
    }

    /// Let go of an id; the entry goes away once its engine is closed.
    pub fn release(&mut self, _now: Instant, id: ConnId) {
        if let Some(e) = self.conns.get_mut(id) {
            e.released = true;
            if e.conn.state() == State::Closed {
                self.conns.remove(id);
            }
        }
    }

    fn call<R>(
        &mut self,
        now: Instant,
        id: ConnId,
        f: impl FnOnce(&mut Conn<MrStore<P>>) -> Result<R, CallError>,
    ) -> Result<R, CallError> {
        match self.apply(now, id, f) {
            Ok(r) => r,
            Err(_) => Err(CallError::NotConnected),
        }
    }

    /// Events of a connection since the last call.
    pub fn take_events(&mut self, id: ConnId) -> Vec<Event> {
        self.conns
            .get_mut(id)
            .map(|e| std::mem::take(&mut e.events))
            .unwrap_or_default()
    }

    /// The connections something happened to since the last call (each once, in no order;
    /// some may be gone from the table since). Appends to `out`.
    pub fn take_touched(&mut self, out: &mut Vec<ConnId>) {
        for id in self.touched.drain(..) {
            if let Some(e) = self.conns.get_mut(id) {
                e.touched = false;
            }
            out.push(id);
        }
    }

    /// The provider's device went away ([`Provider::device_lost`]): drop every connection
    /// (endpoint and buffers) and every listener at once, so nothing of this driver holds the
    /// device, and let the provider give it back ([`Provider::release_device`]). Their ids are
    /// unknown from now on: the socket layer has failed them first.
    pub fn release_device(&mut self) {
        self.conns = Table::default();
        self.listeners = Table::default();
        self.touched.clear();
        self.timers = None;
        self.provider.release_device();
    }

    /// This process's connections are to go on in a fork child (`daemon()`): ask every
    /// connection's peer to pause ([`Endpoint::pause_peer`]). Returns how many were asked
    /// (those that cannot move are reset in the child, [`Driver::moved_here`]).
    pub fn pause_peers(&mut self) -> usize {
        let mut n = 0;
        for id in self.conns.ids() {
            if let Some(ep) = self.conns.get_mut(id).and_then(|e| e.ep.as_mut()) {
                n += ep.pause_peer() as usize;
            }
        }
        n
    }

    /// Whether some connection's peer process is stopped ([`Endpoint::peer_stopped`]): a
    /// move would wait for its answer in vain and reset the connection.
    pub fn any_peer_stopped(&self) -> bool {
        self.endpoints().any(|ep| ep.peer_stopped())
    }

    /// Every connection's endpoint (those finishing in the background included).
    fn endpoints(&self) -> impl Iterator<Item = &P::Endpoint> + '_ {
        self.conns
            .ids()
            .into_iter()
            .filter_map(|id| self.endpoint(id))
    }

    /// How many of the peers asked by [`Driver::pause_peers`] answered (a connection whose
    /// peer did not cannot move).
    pub fn peers_paused(&self) -> usize {
        self.endpoints().filter(|ep| ep.peer_paused()).count()
    }

    /// In the process that goes on with the connections after [`Driver::pause_peers`] (the
    /// fork child, or the mover when its fork failed): tell each paused peer
    /// ([`Endpoint::moved_here`]); a connection that could not move is reset, as a peer's
    /// death would reset it. Returns how many were reset.
    pub fn moved_here(&mut self, now: Instant) -> usize {
        let mut lost = Vec::new();
        for id in self.conns.ids() {
            if let Some(e) = self.conns.get_mut(id) {
                let moved = e.ep.as_mut().is_some_and(|ep| ep.moved_here());
                if !moved && e.ep.is_some() && e.conn.state() != State::Closed {
                    lost.push(id);
                }
            }
        }
        for &id in &lost {
            self.abort(now, id);
        }
        lost.len()
    }

    /// Ids of the connections in the table (including ones finishing in the background).
    pub fn conn_ids(&self) -> Vec<ConnId> {
        self.conns.ids()
    }

    /// Connections in the table (including ones finishing in the background).
    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }

    /// Bytes registered by all connections' buffer stores.
    pub fn registered_bytes(&self) -> usize {
        let mut n = 0;
        for id in self.conns.ids() {
            if let Some(e) = self.conns.get(id) {
                n += e.conn.store().registered_bytes();
            }
        }
        n
    }

    /// The connection's local address (also after it closed).
    pub fn local_addr(&self, id: ConnId) -> Option<SocketAddr> {
        let e = self.conns.get(id)?;
        e.ep.as_ref()
            .map(|ep| ep.local_addr())
            .or(e.addrs.map(|a| a.0))
    }
    /// The connection's peer address (also after it closed).
    pub fn peer_addr(&self, id: ConnId) -> Option<SocketAddr> {
        let e = self.conns.get(id)?;
        e.ep.as_ref()
            .map(|ep| ep.peer_addr())
            .or(e.addrs.map(|a| a.1))
    }
}

/// A connection as the socket layer sees it ([`Driver::view`]): the engine's state, error,
/// readiness, queues and counters, read-only.
pub struct ConnView<'a, P: Provider>(&'a Conn<MrStore<P>>);

impl<P: Provider> ConnView<'_, P> {
    /// Whether the connection was established at some point (a connect that saw its peer's
    /// answer succeeded, whatever came after it).
    pub fn was_established(&self) -> bool {
        self.0.was_established()
    }
    pub fn state(&self) -> State {
        self.0.state()
    }
    /// Why the connection failed, if it did.
    pub fn error(&self) -> Option<&ConnError> {
        self.0.error()
    }
    /// The engine's state on one line ([`Conn::debug_state`]).
    pub fn debug_state(&self) -> String {
        self.0.debug_state()
    }
    /// A read would not block: data, EOF or an error ([`Conn::is_readable`]).
    pub fn is_readable(&self) -> bool {
        self.0.is_readable()
    }
    /// A read would return at once with data, end of stream or an error, not merely start
    /// fetching a peer's zero-copy source ([`Conn::read_ready`]).
    pub fn read_ready(&self) -> bool {
        self.0.read_ready()
    }
    /// Fewer than `lowat` bytes to read and more may come ([`Conn::rx_below`]).
    pub fn rx_below(&self, lowat: usize) -> bool {
        self.0.rx_below(lowat)
    }
    /// A write would not block ([`Conn::is_writable`]).
    pub fn is_writable(&self) -> bool {
        self.0.is_writable()
    }
    /// Bytes a write may still queue ([`Conn::send_room`]).
    pub fn send_room(&self) -> usize {
        self.0.send_room()
    }
    /// The peer's DisConn (or our read shutdown) and every byte before it read.
    pub fn read_closed(&self) -> bool {
        self.0.read_closed()
    }
    /// Our write half is shut.
    pub fn write_closed(&self) -> bool {
        self.0.write_closed()
    }
    /// An urgent byte (MSG_OOB) arrived and was not read yet.
    pub fn urgent_pending(&self) -> bool {
        self.0.urgent_pending()
    }
    /// SIOCATMARK ([`Conn::at_mark`]).
    pub fn at_mark(&self) -> bool {
        self.0.at_mark()
    }
    /// Bytes received and not yet read.
    pub fn rx_queued(&self) -> usize {
        self.0.rx_queued_bytes()
    }
    /// FIONREAD as Linux answers it ([`Conn::inq_bytes`]).
    pub fn inq(&self) -> usize {
        self.0.inq_bytes()
    }
    /// Bytes written and not yet acknowledged by the peer.
    pub fn tx_queued(&self) -> usize {
        self.0.tx_queued_bytes()
    }
    /// Credits held (receive buffers of the peer we may use).
    pub fn tx_credits(&self) -> u32 {
        self.0.tx_credits()
    }
    /// Largest message sent (the peer's receive buffer size).
    pub fn send_size(&self) -> u32 {
        self.0.send_size()
    }
    /// The engine's counters.
    pub fn stats(&self) -> &ConnStats {
        self.0.stats()
    }
}

/// Registers the caller's own memory on a driver's provider ([`Driver::caller_memory`]).
pub struct CallerMemory<P: Provider>(Arc<P>);

impl<P: Provider> CallerMemory<P> {
    /// Register memory the caller owns, for one call ([`Provider::reg_mr_at`]): dropping the
    /// region deregisters it and leaves the memory alone. Providers that cannot do this
    /// return [`VerbsError::Invalid`].
    ///
    /// # Safety
    /// As [`Provider::reg_mr_at`]: `addr..addr + len` must stay allocated for the life of the
    /// returned region, and while the region grants remote access the caller must expect the
    /// peer to read or write it.
    pub unsafe fn reg_mr_at(
        &self,
        addr: NonNull<u8>,
        len: usize,
        access: Access,
    ) -> Result<P::Mr, VerbsError> {
        // SAFETY: the caller keeps `Provider::reg_mr_at`'s contract, which this one repeats.
        unsafe { self.0.reg_mr_at(addr, len, access) }
    }
}

/// Feed the engine every completion `poll` gives (none while connecting); how many.
fn drain_with<S: BufStore>(
    conn: &mut Conn<S>,
    scratch: &mut [Completion],
    now: Instant,
    mut poll: impl FnMut(&mut [Completion]) -> usize,
) -> usize {
    if conn.state() == State::Connecting {
        return 0;
    }
    let mut total = 0;
    loop {
        let n = poll(scratch);
        total += n;
        conn.handle_completions(now, &scratch[..n]);
        if n < scratch.len() {
            return total;
        }
    }
}

/// Every completion waiting in the endpoint's CQ, into the engine.
fn drain_cq<S: BufStore, E: Endpoint>(
    conn: &mut Conn<S>,
    ep: &mut E,
    scratch: &mut [Completion],
    now: Instant,
) -> usize {
    drain_with(conn, scratch, now, |out| ep.poll_cq(out))
}

/// The completions a post made at once ([`Endpoint::poll_inline`]), into the engine.
fn drain_inline<S: BufStore, E: Endpoint>(
    conn: &mut Conn<S>,
    ep: &mut E,
    scratch: &mut [Completion],
    now: Instant,
) -> usize {
    drain_with(conn, scratch, now, |out| ep.poll_inline(out))
}

/// The earlier of two optional instants.
fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Send-queue work requests posted with one call (one doorbell) at most.
const POST_BATCH: usize = 16;

/// Post-and-poll rounds of one pump at most; completions left then wake the progress thread.
const MAX_POST_ROUNDS: usize = 64;

/// Events kept for a connection waiting in a listen queue (besides `Closed`).
const MAX_QUEUED_EVENTS: usize = 16;

/// Keep a refusal for [`Driver::refused`], dropping the oldest beyond [`MAX_REFUSED`].
fn note_refused(refused: &mut Vec<ConnError>, e: ConnError) {
    if refused.len() >= MAX_REFUSED {
        refused.remove(0);
    }
    refused.push(e);
}

/// [`post_all`]; a refusal aborts the connection (the engine never posts beyond the caps it
/// sized, so the endpoint is unusable) and posts what the abort queued.
fn post_or_abort<S: BufStore, E: Endpoint>(
    conn: &mut Conn<S>,
    ep: &mut E,
    sends: &mut Vec<SendWr>,
    now: Instant,
    data: Option<&[u8]>,
) {
    if post_all(conn, ep, sends, data).is_err() {
        conn.abort(now);
        let _ = post_all(conn, ep, sends, data);
    }
}

/// Post what the engine queued. Receives go at once; sends are gathered in `sends` and posted
/// in order with one `post_sends` per batch. A send that tells the peer about receives comes
/// after them in the engine's order, and gathering only delays sends, so it still follows them.
/// A SEND with an inline payload goes on its own, after those gathered before it, with its
/// bytes from `data` (the write that queued it; see [`Conn::write_inline`]).
fn post_all<S: BufStore, E: Endpoint>(
    conn: &mut Conn<S>,
    ep: &mut E,
    sends: &mut Vec<SendWr>,
    data: Option<&[u8]>,
) -> Result<(), VerbsError> {
    sends.clear();
    while let Some(wr) = conn.poll_wr() {
        match wr {
            WorkRequest::Recv(r) => ep.post_recv(&r)?,
            WorkRequest::Send(s) if s.payload.is_some_and(|p| p.lkey == INLINE_LKEY) => {
                if !sends.is_empty() {
                    ep.post_sends(sends)?;
                    sends.clear();
                }
                let p = s.payload.expect("matched above");
                let bytes = usize::try_from(p.addr)
                    .ok()
                    .and_then(|off| data?.get(off..off.checked_add(p.len as usize)?))
                    .ok_or(VerbsError::Invalid("an inline payload outside its write"))?;
                ep.post_send_inline(&s, bytes)?;
            }
            WorkRequest::Send(s) => {
                sends.push(s);
                if sends.len() == POST_BATCH {
                    ep.post_sends(sends)?;
                    sends.clear();
                }
            }
        }
    }
    if !sends.is_empty() {
        ep.post_sends(sends)?;
        sends.clear();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The socket layer reaches engines and the provider only through the driver's narrow
    /// calls (the module docs' "one door"): none of its sources hands itself the engine or
    /// the provider.
    #[test]
    fn the_socket_layer_goes_through_the_driver() {
        fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
            for e in std::fs::read_dir(dir).expect("socket/ is readable") {
                let path = e.expect("a directory entry").path();
                if path.is_dir() {
                    sources(&path, out);
                } else if path.extension().is_some_and(|x| x == "rs") {
                    out.push(path);
                }
            }
        }
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/socket");
        let mut files = Vec::new();
        sources(&root, &mut files);
        assert!(files.len() > 10, "socket/ sources found: {files:?}");
        let mut found = Vec::new();
        for f in &files {
            let text = std::fs::read_to_string(f).expect("a readable source");
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                for door in [".conn(", ".with_conn(", ".provider()"] {
                    if code.contains(door) {
                        found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                    }
                }
            }
        }
        // A call split over lines (`g.driver` then `.conn(id)`) still has the method on one.
        assert!(
            found.is_empty(),
            "the socket layer reaches past the driver:\n{}",
            found.join("\n")
        );
    }
}
