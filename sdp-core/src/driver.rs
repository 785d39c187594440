//! Runs SDP engines over a provider: the glue between the sans-IO [`proto::Conn`] and a
//! [`Provider`]'s endpoints.
//!
//! [`Driver::poll`] does one round of progress for every connection: CM events in, completions
//! in, timers, then the engine's work requests posted and CM actions performed. The driver is
//! synchronous and holds no clock: the caller passes `now` (virtual time in tests, a monotonic
//! clock in the socket layer), so the same code runs under the deterministic simulator and over
//! real devices.
//!
//! Each connection's buffers live in an [`MrStore`]: one memory region per engine buffer,
//! registered with local access only (the engine's buffers are never advertised to a peer).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::proto::buff::{Buf, BufStore};
use crate::proto::conn::CallError;
use crate::proto::iocb::{ZSink, ZSrc};
use crate::proto::read::ZRecv;
use crate::proto::table::{ConnId, Table};
use crate::proto::{Config, Conn, ConnError, Event, Instant, Shutdown, State};
use crate::verbs::{
    Access, Completion, Endpoint, Listener, MemoryRegion, Provider, QpCaps, SendWr, VerbsError,
    WorkRequest,
};

/// A [`BufStore`] of memory regions registered on a provider, one region per buffer.
pub struct MrStore<P: Provider> {
    provider: Arc<P>,
    mrs: slab::Slab<P::Mr>,
    bytes: usize,
}

impl<P: Provider> MrStore<P> {
    pub fn new(provider: Arc<P>) -> MrStore<P> {
        MrStore {
            provider,
            mrs: slab::Slab::new(),
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
        let mr = self
            .provider
            .reg_mr(size as usize, Access::LOCAL_WRITE)
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
}

struct Entry<P: Provider> {
    conn: Conn<MrStore<P>>,
    /// Dropped (QP destroyed) when the engine reaches `Closed`.
    ep: Option<P::Endpoint>,
    events: Vec<Event>,
    /// The application let go of the id: remove the entry once the engine is done.
    released: bool,
}

struct ListenEntry<P: Provider> {
    listener: P::Listener,
    ready: std::collections::VecDeque<ConnId>,
    /// Requests refused, with why (for diagnostics and tests).
    refused: Vec<ConnError>,
}

/// Identifies a listener in a [`Driver`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ListenerId(ConnId);

/// Engines and endpoints of one provider.
pub struct Driver<P: Provider> {
    provider: Arc<P>,
    cfg: Config,
    caps: QpCaps,
    conns: Table<Entry<P>>,
    listeners: Table<ListenEntry<P>>,
    scratch: Vec<Completion>,
    /// Send work requests gathered for one `post_sends`.
    sends: Vec<SendWr>,
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
        cfg.zcopy_split = Some(cfg.zcopy_split.unwrap_or(cfg.zcopy_by_send == Some(true)));
        let caps = QpCaps {
            max_send_wr: 4 * cfg.max_rx_bufs + 64,
            max_recv_wr: cfg.max_rx_bufs + 8,
            max_inline: 0,
        };
        Driver {
            provider: Arc::new(provider),
            cfg,
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
            sends: Vec::with_capacity(POST_BATCH),
        }
    }

    pub fn provider(&self) -> &Arc<P> {
        &self.provider
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
        let store = MrStore::new(self.provider.clone());
        let port = src.map_or(0, |s| s.port());
        let (conn, hello) = Conn::connect(self.cfg.clone(), store, now, port, dst.is_ipv6())?;
        let ep = self.provider.connect(dst, src, self.caps, &hello)?;
        let id = self.conns.insert(Entry {
            conn,
            ep: Some(ep),
            events: Vec::new(),
            released: false,
        });
        self.pump(now, id);
        Ok(id)
    }

    /// Listen on `addr`.
    pub fn listen(&mut self, addr: SocketAddr, backlog: u32) -> Result<ListenerId, DriverError> {
        let listener = self.provider.listen(addr, backlog, self.caps)?;
        Ok(ListenerId(self.listeners.insert(ListenEntry {
            listener,
            ready: Default::default(),
            refused: Vec::new(),
        })))
    }

    pub fn listener_addr(&self, l: ListenerId) -> Option<SocketAddr> {
        self.listeners.get(l.0).map(|e| e.listener.local_addr())
    }

    /// Stop listening (requests not yet accepted are dropped).
    pub fn close_listener(&mut self, l: ListenerId) {
        if let Some(e) = self.listeners.remove(l.0) {
            for id in e.ready {
                self.release(Instant::default(), id);
            }
        }
    }

    /// Requests this listener refused, and why.
    pub fn refused(&self, l: ListenerId) -> &[ConnError] {
        self.listeners.get(l.0).map_or(&[], |e| &e.refused)
    }

    /// Take an accepted connection (it may still be completing setup).
    pub fn accept(&mut self, l: ListenerId) -> Option<ConnId> {
        self.listeners.get_mut(l.0)?.ready.pop_front()
    }

    /// One round of progress on every listener and connection. Returns how many inputs
    /// (completions, CM events, connect requests, expired timers) it handled: zero means
    /// nothing happened, so a progress loop may go to sleep.
    pub fn poll(&mut self, now: Instant) -> usize {
        let mut activity = 0;
        for lid in self.listeners.ids() {
            while let Some(le) = self.listeners.get_mut(lid) {
                let Some((mut ep, pd)) = le.listener.poll_request() else {
                    break;
                };
                activity += 1;
                let store = MrStore::new(self.provider.clone());
                match Conn::accept(self.cfg.clone(), store, now, &pd) {
                    Ok((conn, ack)) => {
                        // Receives go on the QP before the accept, so the peer's first
                        // message always finds one.
                        let mut entry = Entry {
                            conn,
                            ep: None,
                            events: Vec::new(),
                            released: false,
                        };
                        let posted = post_all(&mut entry.conn, &mut ep, &mut self.sends);
                        if posted.is_err() || ep.accept(&ack).is_err() {
                            le.refused.push(ConnError::NoMemory);
                            let _ = ep.reject(b"SDP: out of resources");
                            continue;
                        }
                        entry.ep = Some(ep);
                        let id = self.conns.insert(entry);
                        if let Some(le) = self.listeners.get_mut(lid) {
                            le.ready.push_back(id);
                        }
                    }
                    Err(e) => {
                        let reason = format!("SDP: {e}");
                        let _ = ep.reject(&reason.as_bytes()[..reason.len().min(148)]);
                        le.refused.push(e);
                    }
                }
            }
        }
        for id in self.conns.ids() {
            activity += self.progress(now, id);
        }
        activity
    }

    fn progress(&mut self, now: Instant, id: ConnId) -> usize {
        let Some(e) = self.conns.get_mut(id) else {
            return 0;
        };
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
        self.pump(now, id);
        activity
    }

    /// Post the engine's work requests, perform its CM actions, collect its events.
    fn pump(&mut self, now: Instant, id: ConnId) {
        let Some(e) = self.conns.get_mut(id) else {
            return;
        };
        if let Some(ep) = e.ep.as_mut() {
            if let Err(err) = post_all(&mut e.conn, ep, &mut self.sends) {
                // The engine never posts beyond the caps it sized; a refusal means the
                // endpoint is unusable.
                let _ = err;
                e.conn.abort(now);
                let _ = post_all(&mut e.conn, ep, &mut self.sends);
            }
            while let Some(crate::proto::CmAction::Disconnect) = e.conn.poll_cm() {
                let _ = ep.disconnect();
            }
        }
        while let Some(ev) = e.conn.poll_event() {
            e.events.push(ev);
        }
        if e.conn.state() == State::Closed {
            // Destroy the QP; the engine already gave its buffers back.
            e.ep = None;
            if e.released {
                self.conns.remove(id);
            }
        }
    }

    /// The earliest deadline of any connection.
    pub fn next_deadline(&self) -> Option<Instant> {
        let mut best: Option<Instant> = None;
        for id in self.conns.ids() {
            if let Some(t) = self.conns.get(id).and_then(|e| e.conn.poll_timeout()) {
                best = Some(best.map_or(t, |b| b.min(t)));
            }
        }
        best
    }

    fn entry(&mut self, id: ConnId) -> Result<&mut Entry<P>, DriverError> {
        self.conns.get_mut(id).ok_or(DriverError::BadId)
    }

    /// Run `f` on a connection's engine, then post what it produced.
    pub fn with_conn<R>(
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
    pub fn conn(&self, id: ConnId) -> Option<&Conn<MrStore<P>>> {
        self.conns.get(id).map(|e| &e.conn)
    }

    pub fn write(&mut self, now: Instant, id: ConnId, data: &[u8]) -> Result<usize, CallError> {
        self.call(now, id, |c| c.write(now, data))
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
        let _ = self.with_conn(now, id, |c| c.abort(now));
    }
    /// `close(2)`: the engine finishes in the background; the id stays valid for
    /// [`Driver::take_events`] until the engine is done.
    pub fn close(&mut self, now: Instant, id: ConnId) {
        let _ = self.with_conn(now, id, |c| c.close(now));
        self.release(now, id);
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
        match self.with_conn(now, id, f) {
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

    pub fn local_addr(&self, id: ConnId) -> Option<SocketAddr> {
        self.conns.get(id)?.ep.as_ref().map(|ep| ep.local_addr())
    }
    pub fn peer_addr(&self, id: ConnId) -> Option<SocketAddr> {
        self.conns.get(id)?.ep.as_ref().map(|ep| ep.peer_addr())
    }
}

/// Feed the engine every completion waiting in the endpoint's CQ (none while connecting).
fn drain_cq<S: BufStore, E: Endpoint>(
    conn: &mut Conn<S>,
    ep: &mut E,
    scratch: &mut [Completion],
    now: Instant,
) -> usize {
    if conn.state() == State::Connecting {
        return 0;
    }
    let mut total = 0;
    loop {
        let n = ep.poll_cq(scratch);
        total += n;
        conn.handle_completions(now, &scratch[..n]);
        if n < scratch.len() {
            return total;
        }
    }
}

/// Send-queue work requests posted with one call (one doorbell) at most.
const POST_BATCH: usize = 16;

/// Post what the engine queued. Receives go at once; sends are gathered in `sends` and posted
/// in order with one `post_sends` per batch. A send that tells the peer about receives comes
/// after them in the engine's order, and gathering only delays sends, so it still follows them.
fn post_all<S: BufStore, E: Endpoint>(
    conn: &mut Conn<S>,
    ep: &mut E,
    sends: &mut Vec<SendWr>,
) -> Result<(), VerbsError> {
    sends.clear();
    while let Some(wr) = conn.poll_wr() {
        match wr {
            WorkRequest::Recv(r) => ep.post_recv(&r)?,
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
