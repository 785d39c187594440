//! The simulated world: hosts, memory regions, queue pairs, listeners, links, in-flight messages
//! and the event queue. Everything here runs under the fabric's one mutex; the public handles in
//! the parent module are thin wrappers that lock it and call in.
//!
//! Determinism: every collection that is ever iterated is a `BTreeMap`/`BTreeSet`/`VecDeque`, the
//! event queue is ordered by `(time, insertion sequence)`, and the only randomness (jitter, the
//! first key value) comes from one seeded ChaCha8 generator that is drawn from in event order.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{IpAddr, SocketAddr};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{SimConfig, SimQpState, SimStats, TraceEvent, TraceKind};
use crate::verbs::{
    Access, CmEvent, Completion, QpCaps, RecvWr, RemoteBuf, SendOp, SendWr, Sge, VerbsError,
    WcOpcode, WcStatus,
};

pub(crate) type Id = u64;
pub(crate) type CorruptFn = Box<dyn FnMut(&mut Vec<u8>) + Send>;

/// `IBV_WC_REM_INV_REQ_ERR`: what a requester sees when its SEND did not fit the receive buffer.
pub const WC_REM_INV_REQ_ERR: u32 = 9;
/// `IBV_WC_REM_OP_ERR`: what a requester sees when the responder failed to place a SEND (its
/// receive WR named a bad lkey / range / access).
pub const WC_REM_OP_ERR: u32 = 11;

/// First address handed out for memory regions on each host.
pub const MR_BASE: u64 = 0x1000_0000;
/// Region alignment; one unmapped page is also left between regions.
pub const PAGE: u64 = 4096;
const EPHEMERAL_FIRST: u16 = 32768;
const EPHEMERAL_LAST: u16 = 60999;

pub(crate) struct Host {
    pub alive: bool,
    /// The device was removed ([`World::remove_device`]): nothing new is made on it.
    pub device_lost: bool,
    /// Key → the region it names, and the grant within it (`None`: the region's own key).
    by_lkey: BTreeMap<u32, (Id, Option<Id>)>,
    by_rkey: BTreeMap<u32, (Id, Option<Id>)>,
    next_addr: u64,
    ports: BTreeSet<u16>,
    listeners: BTreeMap<u16, Id>,
    qps: BTreeSet<Id>,
    next_ephemeral: u16,
    pub stats: SimStats,
}

impl Host {
    fn new() -> Host {
        Host {
            alive: true,
            device_lost: false,
            by_lkey: BTreeMap::new(),
            by_rkey: BTreeMap::new(),
            next_addr: MR_BASE,
            ports: BTreeSet::new(),
            listeners: BTreeMap::new(),
            qps: BTreeSet::new(),
            next_ephemeral: EPHEMERAL_FIRST,
            stats: SimStats::default(),
        }
    }
}

pub(crate) struct Mr {
    host: IpAddr,
    pub addr: u64,
    pub data: Vec<u8>,
    pub access: Access,
    lkey: u32,
    rkey: u32,
    /// Still registered on a live host (false once the host crashed: keys are gone, the handle
    /// keeps its bytes for local reads and writes).
    live: bool,
    /// Windows advertised with their own keys ([`crate::verbs::MemoryRegion::advertise`]).
    grants: BTreeMap<Id, Window>,
}

/// A grant: `len` bytes at `off` of its region, reachable through its own keys with `access`.
#[derive(Debug, Clone, Copy)]
struct Window {
    off: u64,
    len: u64,
    access: Access,
    lkey: u32,
    rkey: u32,
}

struct SqEntry {
    seq: u64,
    wr: SendWr,
    /// An inline payload's bytes, copied at the post (`Endpoint::post_send_inline`).
    inline: Option<Vec<u8>>,
    /// The completion once the WR is done (acknowledged / read data placed); it is reported when
    /// every earlier WR is done too.
    done: Option<Completion>,
}

enum Body {
    Send(Vec<u8>),
    /// RDMA Write; empty data = zero-length write (no remote checks).
    Write(RemoteBuf, Vec<u8>),
    Read(RemoteBuf, u32),
}

struct Msg {
    seq: u64,
    body: Body,
    /// When the message (or its latest retransmission) left the requester.
    sent_at: u64,
    /// Scheduled arrival.
    at: u64,
    /// Link generation at send time; a break, heal, crash or restart in between loses it.
    gen: u64,
    rnr_retries: u32,
    /// `drop_next_send`: vanishes at the responder but is acknowledged.
    void: bool,
}

pub(crate) struct Qp {
    pub host: IpAddr,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    peer_host: IpAddr,
    peer_qp: Option<Id>,
    caps: QpCaps,
    pub state: SimQpState,
    /// Reached the connected state (so a later error is reported as `Disconnected`).
    connected: bool,
    port: Option<u16>,
    sq: VecDeque<SqEntry>,
    pub rq: VecDeque<RecvWr>,
    cq: VecDeque<Completion>,
    cm: VecDeque<CmEvent>,
    next_seq: u64,
    tx_free_at: u64,
    last_arrival: u64,
    tx_epoch: u64,
    tx_halted: bool,
    inflight: VecDeque<Msg>,
    /// When the QP entered the error state: nothing is transmitted after that (retransmissions
    /// scheduled for later are dropped), though messages already on the wire still arrive.
    errored_at: Option<u64>,
    /// The handle is gone but messages it sent are still on the wire: kept (unaccounted) until
    /// they have arrived.
    zombie: bool,
    /// iWARP: a reset failed a send (`SimConfig::iwarp_close_ns`). siw's QP is then neither
    /// ready nor in the error state (which would flush new work requests) until its CM has
    /// closed it: posts fail with `ENOTCONN`.
    refuses_posts: bool,
}

impl Qp {
    pub fn outstanding_sends(&self) -> usize {
        self.sq.len()
    }
    pub fn pending_completions(&self) -> usize {
        self.cq.len()
    }
    pub fn pending_cm_events(&self) -> usize {
        self.cm.len()
    }
    pub fn caps(&self) -> QpCaps {
        self.caps
    }
}

pub(crate) struct Lis {
    host: IpAddr,
    pub addr: SocketAddr,
    backlog: usize,
    pending: VecDeque<(Id, Vec<u8>)>,
    live: bool,
}

#[derive(Default)]
struct Link {
    extra: u64,
    jitter: u64,
    broken: bool,
    /// Broken, and its requesters never time out (a stuck device: see `stall_link`).
    stalled: bool,
    gen: u64,
}

enum Outcome {
    Ok,
    ReadData(Vec<u8>),
    Fail(WcStatus),
}

enum CmMsg {
    Req {
        active: Id,
        dst: SocketAddr,
        src: SocketAddr,
        caps: QpCaps,
        pd: Vec<u8>,
    },
    Rep {
        active: Id,
        passive: Id,
        pd: Vec<u8>,
    },
    Rtu {
        passive: Id,
    },
    Rej {
        active: Id,
        pd: Vec<u8>,
        consumer: bool,
    },
    Dreq {
        to: Id,
    },
    ConnErr {
        passive: Id,
    },
}

enum Ev {
    /// A send-queue WR reaches the head of the wire: local checks, data sampled, sent.
    Exec {
        qp: Id,
        seq: u64,
    },
    /// The head in-flight message of `qp` reaches its peer.
    Arrive {
        qp: Id,
        epoch: u64,
        seq: u64,
    },
    /// The responder's answer (ack, NAK or read response) reaches the requester.
    Ack {
        qp: Id,
        seq: u64,
        from: IpAddr,
        gen: u64,
        sent_at: u64,
        outcome: Outcome,
    },
    /// Transport retries for a lost message are exhausted.
    Timeout {
        qp: Id,
        seq: u64,
    },
    /// RNR retries are exhausted (the final RNR NAK reached the requester).
    RnrFail {
        qp: Id,
        seq: u64,
    },
    Cm {
        from: IpAddr,
        to: IpAddr,
        sent_at: u64,
        gen: u64,
        msg: CmMsg,
    },
    /// The active side's connect attempt fails with this event (if it is still connecting).
    ConnectFailed {
        qp: Id,
        ev: CmEvent,
    },
    /// The passive side's connection never completed.
    PassiveFailed {
        qp: Id,
    },
    Timewait {
        qp: Id,
    },
}

pub(crate) struct World {
    pub now: u64,
    pub cfg: SimConfig,
    rng: ChaCha8Rng,
    seq: u64,
    events: BTreeMap<(u64, u64), Ev>,
    pub hosts: BTreeMap<IpAddr, Host>,
    pub qps: BTreeMap<Id, Qp>,
    pub mrs: BTreeMap<Id, Mr>,
    pub listeners: BTreeMap<Id, Lis>,
    links: BTreeMap<(IpAddr, IpAddr), Link>,
    corrupt: BTreeMap<IpAddr, VecDeque<CorruptFn>>,
    drop_next: BTreeMap<IpAddr, u32>,
    next_id: Id,
    next_key: u32,
    pub trace: Option<Vec<TraceEvent>>,
}

fn opcode(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Send => WcOpcode::Send,
        SendOp::Write(_) => WcOpcode::RdmaWrite,
        SendOp::Read(_) => WcOpcode::RdmaRead,
    }
}

fn wr_len(wr: &SendWr) -> u32 {
    wr.sge.map_or(0, |s| s.len) + wr.payload.map_or(0, |s| s.len)
}

/// The host a destination address names, seen from `me`: loopback and unspecified mean `me`.
fn route(me: IpAddr, dst: IpAddr) -> IpAddr {
    if dst.is_loopback() || dst.is_unspecified() {
        me
    } else {
        dst
    }
}

impl World {
    pub fn new(seed: u64, cfg: SimConfig) -> World {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // Keys start at a seeded point so tests cannot hard-code them by accident.
        let next_key = rng.random_range(0x100u32..0x0100_0000);
        World {
            now: 0,
            cfg,
            rng,
            seq: 0,
            events: BTreeMap::new(),
            hosts: BTreeMap::new(),
            qps: BTreeMap::new(),
            mrs: BTreeMap::new(),
            listeners: BTreeMap::new(),
            links: BTreeMap::new(),
            corrupt: BTreeMap::new(),
            drop_next: BTreeMap::new(),
            next_id: 1,
            next_key,
            trace: None,
        }
    }

    // ---------------------------------------------------------------- plumbing

    fn new_id(&mut self) -> Id {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn new_key(&mut self) -> u32 {
        let k = self.next_key;
        self.next_key = self.next_key.wrapping_add(1).max(1);
        k
    }

    fn schedule(&mut self, at: u64, ev: Ev) {
        let at = at.max(self.now);
        self.seq += 1;
        self.events.insert((at, self.seq), ev);
    }

    pub fn next_event_at(&self) -> Option<u64> {
        self.events.keys().next().map(|&(t, _)| t)
    }

    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    pub fn advance(&mut self, t: u64) {
        let t = t.max(self.now);
        while let Some(entry) = self.events.first_entry() {
            if entry.key().0 > t {
                break;
            }
            let at = entry.key().0;
            let ev = entry.remove();
            self.now = at;
            self.dispatch(ev);
        }
        self.now = t;
    }

    pub fn host_mut(&mut self, ip: IpAddr) -> &mut Host {
        self.hosts.entry(ip).or_insert_with(Host::new)
    }

    fn stats_mut(&mut self, ip: IpAddr) -> Option<&mut SimStats> {
        self.hosts.get_mut(&ip).map(|h| &mut h.stats)
    }

    pub fn host_alive(&self, ip: IpAddr) -> bool {
        self.hosts.get(&ip).is_some_and(|h| h.alive)
    }

    fn live_host(&mut self, ip: IpAddr) -> Result<&mut Host, VerbsError> {
        match self.hosts.get_mut(&ip) {
            Some(h) if h.device_lost => Err(VerbsError::NoDevice(format!(
                "sim host {ip}: device removed"
            ))),
            Some(h) if h.alive => Ok(h),
            _ => Err(VerbsError::NoDevice(format!("sim host {ip} crashed"))),
        }
    }

    fn link_key(a: IpAddr, b: IpAddr) -> (IpAddr, IpAddr) {
        if a <= b {
            (a, b)
        } else {
            (b, a)
        }
    }

    fn link(&mut self, a: IpAddr, b: IpAddr) -> &mut Link {
        self.links.entry(Self::link_key(a, b)).or_default()
    }

    fn link_gen(&self, a: IpAddr, b: IpAddr) -> u64 {
        self.links.get(&Self::link_key(a, b)).map_or(0, |l| l.gen)
    }

    /// Whether a message sent from `a` to `b` at link generation `gen` gets through now.
    fn path_ok(&self, a: IpAddr, b: IpAddr, gen: u64) -> bool {
        if !self.host_alive(a) || !self.host_alive(b) {
            return false;
        }
        match self.links.get(&Self::link_key(a, b)) {
            Some(l) => !l.broken && l.gen == gen,
            None => gen == 0,
        }
    }

    /// One-way propagation delay from `a` to `b`: latency + the link's extra delay + jitter.
    fn path_delay(&mut self, a: IpAddr, b: IpAddr) -> u64 {
        let (extra, jitter) = self
            .links
            .get(&Self::link_key(a, b))
            .map_or((0, 0), |l| (l.extra, l.jitter));
        let j = if jitter > 0 {
            self.rng.random_range(0..=jitter)
        } else {
            0
        };
        self.cfg.latency_ns.saturating_add(extra).saturating_add(j)
    }

    /// Serialization delay of `len` bytes.
    fn ser(&self, len: u64) -> u64 {
        let bw = self.cfg.bandwidth_bytes_per_sec;
        if bw == 0 {
            return 0;
        }
        let ns = (u128::from(len) * 1_000_000_000).div_ceil(u128::from(bw));
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    fn push_cq(&mut self, id: Id, c: Completion) {
        let Some(q) = self.qps.get_mut(&id) else {
            return;
        };
        q.cq.push_back(c);
        let host = q.host;
        if let Some(s) = self.stats_mut(host) {
            match c.status {
                WcStatus::Success => s.completions += 1,
                WcStatus::Flushed => s.flushed += 1,
                _ => s.error_completions += 1,
            }
        }
        if let Some(tr) = &mut self.trace {
            tr.push(TraceEvent {
                time: self.now,
                host,
                endpoint: id,
                kind: TraceKind::Completion(c),
            });
        }
    }

    fn push_cm(&mut self, id: Id, ev: CmEvent) {
        let Some(q) = self.qps.get_mut(&id) else {
            return;
        };
        if q.state == SimQpState::Dead {
            return;
        }
        let host = q.host;
        if let Some(tr) = &mut self.trace {
            tr.push(TraceEvent {
                time: self.now,
                host,
                endpoint: id,
                kind: TraceKind::Cm(ev.clone()),
            });
        }
        q.cm.push_back(ev);
    }

    // ---------------------------------------------------------------- memory

    pub fn reg_mr(
        &mut self,
        ip: IpAddr,
        len: usize,
        access: Access,
    ) -> Result<(Id, u32, u32, u64), VerbsError> {
        check_access(access)?;
        let max = self.cfg.max_registered_bytes_per_host;
        let h = self.live_host(ip)?;
        let len64 = len as u64;
        if h.stats.registered_bytes.saturating_add(len64) > max {
            return Err(VerbsError::NoResources("registered memory"));
        }
        let span = len64.max(1).div_ceil(PAGE).saturating_mul(PAGE);
        let addr = h.next_addr;
        let Some(next) = addr.checked_add(span).and_then(|a| a.checked_add(PAGE)) else {
            return Err(VerbsError::NoResources("address space"));
        };
        h.next_addr = next;
        let id = self.new_id();
        let lkey = self.new_key();
        let rkey = self.new_key();
        let h = self.host_mut(ip);
        h.by_lkey.insert(lkey, (id, None));
        h.by_rkey.insert(rkey, (id, None));
        h.stats.registered_bytes += len64;
        h.stats.registered_regions += 1;
        h.stats.peak_registered_bytes = h.stats.peak_registered_bytes.max(h.stats.registered_bytes);
        self.mrs.insert(
            id,
            Mr {
                host: ip,
                addr,
                data: vec![0; len],
                access,
                lkey,
                rkey,
                live: true,
                grants: BTreeMap::new(),
            },
        );
        Ok((id, lkey, rkey, addr))
    }

    /// A grant of `access` to `len` bytes at `off` of region `id`, under fresh keys; returns
    /// the grant's id and keys. Arguments are checked by the caller (`check_grant`).
    pub fn advertise(
        &mut self,
        id: Id,
        off: usize,
        len: usize,
        access: Access,
    ) -> Result<(Id, u32, u32), VerbsError> {
        let (host, live) = match self.mrs.get(&id) {
            Some(mr) => (mr.host, mr.live),
            None => return Err(VerbsError::Invalid("memory region is gone")),
        };
        if !live {
            return Err(dead_err());
        }
        self.live_host(host)?;
        let gid = self.new_id();
        let lkey = self.new_key();
        let rkey = self.new_key();
        let h = self.host_mut(host);
        h.by_lkey.insert(lkey, (id, Some(gid)));
        h.by_rkey.insert(rkey, (id, Some(gid)));
        let w = Window {
            off: off as u64,
            len: len as u64,
            access,
            lkey,
            rkey,
        };
        self.mrs
            .get_mut(&id)
            .expect("checked above")
            .grants
            .insert(gid, w);
        Ok((gid, lkey, rkey))
    }

    /// End grant `gid` of region `id`: its keys name nothing any more.
    pub fn revoke(&mut self, id: Id, gid: Id) -> Result<(), VerbsError> {
        let Some(mr) = self.mrs.get_mut(&id) else {
            return Err(VerbsError::Invalid("memory region is gone"));
        };
        let Some(w) = mr.grants.remove(&gid) else {
            return Err(VerbsError::Invalid("no such grant"));
        };
        let (host, live) = (mr.host, mr.live);
        if live {
            if let Some(h) = self.hosts.get_mut(&host) {
                h.by_lkey.remove(&w.lkey);
                h.by_rkey.remove(&w.rkey);
            }
        }
        Ok(())
    }

    pub fn dereg_mr(&mut self, id: Id) {
        let Some(mr) = self.mrs.remove(&id) else {
            return;
        };
        if !mr.live {
            return;
        }
        if let Some(h) = self.hosts.get_mut(&mr.host) {
            h.by_lkey.remove(&mr.lkey);
            h.by_rkey.remove(&mr.rkey);
            for w in mr.grants.values() {
                h.by_lkey.remove(&w.lkey);
                h.by_rkey.remove(&w.rkey);
            }
            h.stats.registered_bytes -= mr.data.len() as u64;
            h.stats.registered_regions -= 1;
        }
    }

    pub fn set_access(&mut self, id: Id, access: Access) -> Result<(), VerbsError> {
        check_access(access)?;
        match self.mrs.get_mut(&id) {
            Some(mr) => {
                mr.access = access;
                Ok(())
            }
            None => Err(VerbsError::Invalid("memory region is gone")),
        }
    }

    /// Find the region a key names on `ip` and check range and rights; the offset on success.
    fn resolve(
        &self,
        ip: IpAddr,
        key: u32,
        remote: bool,
        addr: u64,
        len: u32,
        need: Access,
    ) -> Option<(Id, usize)> {
        let h = self.hosts.get(&ip)?;
        let (id, grant) = *if remote {
            h.by_rkey.get(&key)
        } else {
            h.by_lkey.get(&key)
        }?;
        let mr = self.mrs.get(&id)?;
        // The window the key reaches: a grant's, or the whole region.
        let (start, size, access) = match grant {
            Some(g) => {
                let w = mr.grants.get(&g)?;
                (w.off, w.len, w.access)
            }
            None => (0, mr.data.len() as u64, mr.access),
        };
        if !mr.live || !access.contains(need) {
            return None;
        }
        let off = addr.checked_sub(mr.addr)?;
        let end = off.checked_add(u64::from(len))?;
        if off < start || end > start + size {
            return None;
        }
        Some((id, usize::try_from(off).ok()?))
    }

    fn resolve_local(&self, ip: IpAddr, sge: &Sge, need: Access) -> Option<(Id, usize)> {
        self.resolve(ip, sge.lkey, false, sge.addr, sge.len, need)
    }

    fn mr_bytes(&self, id: Id, off: usize, len: usize) -> Vec<u8> {
        self.mrs
            .get(&id)
            .map_or_else(Vec::new, |m| m.data[off..off + len].to_vec())
    }

    fn mr_put(&mut self, id: Id, off: usize, data: &[u8]) {
        if let Some(m) = self.mrs.get_mut(&id) {
            m.data[off..off + data.len()].copy_from_slice(data);
        }
    }

    // ---------------------------------------------------------------- connection manager

    fn alloc_port(&mut self, ip: IpAddr, want: u16) -> Result<u16, VerbsError> {
        let h = self.host_mut(ip);
        if want != 0 {
            if h.ports.contains(&want) {
                return Err(VerbsError::AddrInUse);
            }
            h.ports.insert(want);
            return Ok(want);
        }
        let span = u32::from(EPHEMERAL_LAST - EPHEMERAL_FIRST) + 1;
        for _ in 0..span {
            let p = h.next_ephemeral;
            h.next_ephemeral = if p >= EPHEMERAL_LAST {
                EPHEMERAL_FIRST
            } else {
                p + 1
            };
            if !h.ports.contains(&p) {
                h.ports.insert(p);
                return Ok(p);
            }
        }
        Err(VerbsError::AddrNotAvailable)
    }

    fn check_local_ip(ip: IpAddr, want: IpAddr) -> Result<(), VerbsError> {
        if want.is_unspecified() || want.is_loopback() || want == ip {
            Ok(())
        } else {
            Err(VerbsError::AddrNotAvailable)
        }
    }

    pub fn listen(
        &mut self,
        ip: IpAddr,
        addr: SocketAddr,
        backlog: u32,
    ) -> Result<(Id, SocketAddr), VerbsError> {
        self.live_host(ip)?;
        Self::check_local_ip(ip, addr.ip())?;
        let port = self.alloc_port(ip, addr.port())?;
        let id = self.new_id();
        let bound = SocketAddr::new(addr.ip(), port);
        self.host_mut(ip).listeners.insert(port, id);
        self.listeners.insert(
            id,
            Lis {
                host: ip,
                addr: bound,
                backlog: backlog.max(1) as usize,
                pending: VecDeque::new(),
                live: true,
            },
        );
        Ok((id, bound))
    }

    pub fn poll_request(&mut self, lid: Id) -> Option<(Id, SocketAddr, SocketAddr, Vec<u8>)> {
        let lis = self.listeners.get_mut(&lid)?;
        if !lis.live {
            return None;
        }
        let (qp, pd) = lis.pending.pop_front()?;
        let q = self.qps.get(&qp)?;
        Some((qp, q.local, q.peer, pd))
    }

    pub fn drop_listener(&mut self, lid: Id) {
        let Some(lis) = self.listeners.remove(&lid) else {
            return;
        };
        if !lis.live {
            return;
        }
        if let Some(h) = self.hosts.get_mut(&lis.host) {
            h.listeners.remove(&lis.addr.port());
            h.ports.remove(&lis.addr.port());
        }
        for (qp, _) in lis.pending {
            self.destroy_qp(qp);
        }
    }

    fn new_qp(
        &mut self,
        host: IpAddr,
        local: SocketAddr,
        peer: SocketAddr,
        peer_host: IpAddr,
        caps: QpCaps,
        state: SimQpState,
    ) -> Id {
        let id = self.new_id();
        let h = self.host_mut(host);
        h.qps.insert(id);
        h.stats.qps += 1;
        h.stats.peak_qps = h.stats.peak_qps.max(h.stats.qps);
        self.qps.insert(
            id,
            Qp {
                host,
                local,
                peer,
                peer_host,
                peer_qp: None,
                caps,
                state,
                connected: false,
                port: None,
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                cq: VecDeque::new(),
                cm: VecDeque::new(),
                next_seq: 0,
                tx_free_at: 0,
                last_arrival: 0,
                tx_epoch: 0,
                tx_halted: false,
                inflight: VecDeque::new(),
                errored_at: None,
                refuses_posts: false,
                zombie: false,
            },
        );
        id
    }

    pub fn connect(
        &mut self,
        ip: IpAddr,
        dst: SocketAddr,
        src: Option<SocketAddr>,
        caps: QpCaps,
        pd: &[u8],
    ) -> Result<(Id, SocketAddr), VerbsError> {
        self.live_host(ip)?;
        if pd.len() > self.cfg.max_private_data_connect {
            return Err(VerbsError::Invalid(
                "private data too long for a connect request",
            ));
        }
        if caps.max_send_wr > self.cfg.max_qp_wr || caps.max_recv_wr > self.cfg.max_qp_wr {
            return Err(VerbsError::Invalid(
                "queue pair capacity above the device maximum",
            ));
        }
        if let Some(s) = src {
            Self::check_local_ip(ip, s.ip())?;
        }
        let max_qps = self.cfg.max_qps_per_host;
        if self.host_mut(ip).qps.len() >= max_qps {
            return Err(VerbsError::NoResources("queue pairs"));
        }
        let local_ip = match src {
            Some(s) if !s.ip().is_unspecified() => s.ip(),
            _ if dst.ip().is_loopback() => dst.ip(),
            _ => ip,
        };
        let port = self.alloc_port(ip, src.map_or(0, |s| s.port()))?;
        let local = SocketAddr::new(local_ip, port);
        let peer_host = route(ip, dst.ip());
        let id = self.new_qp(ip, local, dst, peer_host, caps, SimQpState::Connecting);
        if let Some(q) = self.qps.get_mut(&id) {
            q.port = Some(port);
        }
        self.host_mut(ip).stats.connects += 1;
        let msg = CmMsg::Req {
            active: id,
            dst,
            src: local,
            caps,
            pd: pd.to_vec(),
        };
        self.send_cm(ip, peer_host, msg, 0);
        Ok((id, local))
    }

    /// Send a CM message; it arrives no earlier than `min_at`. Returns the arrival time.
    fn send_cm(&mut self, from: IpAddr, to: IpAddr, msg: CmMsg, min_at: u64) -> u64 {
        let d = self.path_delay(from, to);
        let at = self.now.saturating_add(d).max(min_at);
        let gen = self.link_gen(from, to);
        self.schedule(
            at,
            Ev::Cm {
                from,
                to,
                sent_at: self.now,
                gen,
                msg,
            },
        );
        at
    }

    pub fn accept(&mut self, id: Id, pd: &[u8]) -> Result<(), VerbsError> {
        let max = self.cfg.max_private_data_accept;
        let q = self.qps.get(&id).ok_or(VerbsError::NotConnected)?;
        match q.state {
            SimQpState::Pending => {}
            SimQpState::Dead => return Err(dead_err()),
            _ => return Err(VerbsError::Invalid("not a pending connect request")),
        }
        if pd.len() > max {
            return Err(VerbsError::Invalid("private data too long for an accept"));
        }
        let (host, peer_host) = (q.host, q.peer_host);
        let Some(active) = q.peer_qp else {
            return Err(VerbsError::Invalid("not a pending connect request"));
        };
        let msg = CmMsg::Rep {
            active,
            passive: id,
            pd: pd.to_vec(),
        };
        let at = self.send_cm(host, peer_host, msg, 0);
        if let Some(q) = self.qps.get_mut(&id) {
            q.state = SimQpState::Ready;
            q.connected = true;
            // Our data must not overtake the REP.
            q.last_arrival = q.last_arrival.max(at);
        }
        if let Some(s) = self.stats_mut(host) {
            s.accepts += 1;
        }
        Ok(())
    }

    pub fn reject(&mut self, id: Id, pd: &[u8]) -> Result<(), VerbsError> {
        let max = self.cfg.max_private_data_reject;
        let q = self.qps.get(&id).ok_or(VerbsError::NotConnected)?;
        match q.state {
            SimQpState::Pending => {}
            SimQpState::Dead => return Err(dead_err()),
            _ => return Err(VerbsError::Invalid("not a pending connect request")),
        }
        if pd.len() > max {
            return Err(VerbsError::Invalid("private data too long for a reject"));
        }
        let (host, peer_host, active) = (q.host, q.peer_host, q.peer_qp);
        if let Some(active) = active {
            let msg = CmMsg::Rej {
                active,
                pd: pd.to_vec(),
                consumer: true,
            };
            self.send_cm(host, peer_host, msg, 0);
        }
        self.fail_quietly(id, None);
        if let Some(s) = self.stats_mut(host) {
            s.rejects += 1;
        }
        Ok(())
    }

    pub fn disconnect(&mut self, id: Id) -> Result<(), VerbsError> {
        let q = self.qps.get(&id).ok_or(VerbsError::NotConnected)?;
        match q.state {
            SimQpState::Ready => {
                let host = q.host;
                if let Some(s) = self.stats_mut(host) {
                    s.disconnects += 1;
                }
                self.qp_error(id, None, true);
                Ok(())
            }
            SimQpState::Error => Ok(()),
            SimQpState::Dead => Err(dead_err()),
            SimQpState::Connecting | SimQpState::Pending => Err(VerbsError::NotConnected),
        }
    }

    /// The endpoint handle is gone (or a never-handed-out passive QP is dropped).
    pub fn destroy_qp(&mut self, id: Id) {
        let Some(q) = self.qps.get(&id) else { return };
        let (state, host, peer_host, peer_qp) = (q.state, q.host, q.peer_host, q.peer_qp);
        match state {
            SimQpState::Ready => self.qp_error(id, None, true),
            SimQpState::Pending => {
                if let Some(active) = peer_qp {
                    let msg = CmMsg::Rej {
                        active,
                        pd: Vec::new(),
                        consumer: false,
                    };
                    self.send_cm(host, peer_host, msg, 0);
                }
            }
            _ => {}
        }
        let Some(mut q) = self.qps.remove(&id) else {
            return;
        };
        if q.state == SimQpState::Dead {
            return; // already unaccounted by the crash
        }
        if let Some(h) = self.hosts.get_mut(&q.host) {
            if let Some(p) = q.port.take() {
                h.ports.remove(&p);
            }
            if h.qps.remove(&id) {
                h.stats.qps -= 1;
            }
        }
        if !q.inflight.is_empty() {
            // Packets already on the wire still arrive; the record goes when they have.
            q.zombie = true;
            q.cq.clear();
            q.cm.clear();
            self.qps.insert(id, q);
        }
    }

    /// The QP leaves the connection attempt: error state, receives flushed, `ev` reported (if any).
    /// No `Disconnected`: it never was connected.
    fn fail_quietly(&mut self, id: Id, ev: Option<CmEvent>) {
        let Some(q) = self.qps.get_mut(&id) else {
            return;
        };
        if matches!(q.state, SimQpState::Dead | SimQpState::Error) {
            return;
        }
        q.state = SimQpState::Error;
        q.tx_halted = true;
        q.errored_at = Some(self.now);
        let rq: Vec<RecvWr> = q.rq.drain(..).collect();
        let sq: Vec<SqEntry> = q.sq.drain(..).collect();
        for e in sq {
            let c = Completion {
                wr_id: e.wr.wr_id,
                status: WcStatus::Flushed,
                opcode: opcode(&e.wr.op),
                byte_len: 0,
            };
            self.push_cq(id, c);
        }
        for r in rq {
            let c = Completion {
                wr_id: r.wr_id,
                status: WcStatus::Flushed,
                opcode: WcOpcode::Recv,
                byte_len: 0,
            };
            self.push_cq(id, c);
        }
        if let Some(ev) = ev {
            self.push_cm(id, ev);
        }
    }

    /// Move a QP to the error state: `failing` (if any) completes with its status, everything
    /// else outstanding on the send queue then the receive queue completes `Flushed`. A connected
    /// QP reports `Disconnected` (and `TimewaitExit` later); with `notify_peer` a DREQ tells the
    /// peer, which errors the same way when it arrives.
    fn qp_error(&mut self, id: Id, failing: Option<(u64, WcStatus)>, notify_peer: bool) {
        self.qp_error_with(id, failing, notify_peer, true);
    }

    /// [`World::qp_error`], with or without the `Disconnected` a connected QP reports.
    fn qp_error_with(
        &mut self,
        id: Id,
        failing: Option<(u64, WcStatus)>,
        notify_peer: bool,
        cm_event: bool,
    ) {
        let Some(q) = self.qps.get_mut(&id) else {
            return;
        };
        if matches!(q.state, SimQpState::Error | SimQpState::Dead) {
            return;
        }
        let connected = q.connected;
        q.state = SimQpState::Error;
        q.tx_halted = true;
        q.errored_at = Some(self.now);
        let sq: Vec<SqEntry> = q.sq.drain(..).collect();
        let rq: Vec<RecvWr> = q.rq.drain(..).collect();
        let (host, peer_host, peer_qp, min_at) = (q.host, q.peer_host, q.peer_qp, q.last_arrival);
        for e in sq {
            let status = match failing {
                Some((seq, st)) if seq == e.seq => st,
                _ => WcStatus::Flushed,
            };
            // As in IB, byte_len means nothing in an error completion: report 0.
            let c = Completion {
                wr_id: e.wr.wr_id,
                status,
                opcode: opcode(&e.wr.op),
                byte_len: 0,
            };
            self.push_cq(id, c);
        }
        for r in rq {
            let c = Completion {
                wr_id: r.wr_id,
                status: WcStatus::Flushed,
                opcode: WcOpcode::Recv,
                byte_len: 0,
            };
            self.push_cq(id, c);
        }
        if connected && cm_event {
            self.push_cm(id, CmEvent::Disconnected);
            let at = self.now.saturating_add(self.cfg.timewait_ns);
            self.schedule(at, Ev::Timewait { qp: id });
            if notify_peer {
                if let Some(p) = peer_qp {
                    // iWARP: the peer learns of the close later (see `SimConfig::iwarp_close_ns`).
                    let late = self.cfg.iwarp_close_ns.map_or(0, |d| {
                        self.now
                            .saturating_add(self.path_delay(host, peer_host))
                            .saturating_add(d)
                    });
                    self.send_cm(host, peer_host, CmMsg::Dreq { to: p }, min_at.max(late));
                }
            }
        }
    }

    /// iWARP: the CM closes a QP whose stream a reset failed: `Disconnected` (and
    /// `TimewaitExit` later); from now on it flushes what is posted, as in the error state.
    fn cm_closes_reset(&mut self, id: Id) {
        let Some(q) = self.qps.get_mut(&id) else {
            return;
        };
        q.refuses_posts = false;
        if q.connected {
            self.push_cm(id, CmEvent::Disconnected);
            let at = self.now.saturating_add(self.cfg.timewait_ns);
            self.schedule(at, Ev::Timewait { qp: id });
        }
    }

    fn dispatch_cm(&mut self, from: IpAddr, to: IpAddr, sent_at: u64, gen: u64, msg: CmMsg) {
        let deadline = sent_at.saturating_add(self.cfg.transport_timeout_ns);
        if !self.path_ok(from, to, gen) {
            match msg {
                CmMsg::Req { active, .. } | CmMsg::Rej { active, .. } => {
                    self.schedule(
                        deadline,
                        Ev::ConnectFailed {
                            qp: active,
                            ev: CmEvent::Unreachable,
                        },
                    );
                }
                CmMsg::Rep {
                    active, passive, ..
                } => {
                    self.schedule(
                        deadline,
                        Ev::ConnectFailed {
                            qp: active,
                            ev: CmEvent::Unreachable,
                        },
                    );
                    self.schedule(deadline, Ev::PassiveFailed { qp: passive });
                }
                CmMsg::Rtu { .. } | CmMsg::Dreq { .. } | CmMsg::ConnErr { .. } => {}
            }
            return;
        }
        match msg {
            CmMsg::Req {
                active,
                dst,
                src,
                caps,
                pd,
            } => self.on_req(from, to, active, dst, src, caps, pd),
            CmMsg::Rep {
                active,
                passive,
                pd,
            } => {
                let ok = self
                    .qps
                    .get(&active)
                    .is_some_and(|q| q.state == SimQpState::Connecting);
                if !ok {
                    self.send_cm(to, from, CmMsg::ConnErr { passive }, 0);
                    return;
                }
                if let Some(q) = self.qps.get_mut(&active) {
                    q.state = SimQpState::Ready;
                    q.connected = true;
                    q.peer_qp = Some(passive);
                }
                self.push_cm(active, CmEvent::Established { private_data: pd });
                self.send_cm(to, from, CmMsg::Rtu { passive }, 0);
            }
            CmMsg::Rtu { passive } => {
                if self
                    .qps
                    .get(&passive)
                    .is_some_and(|q| q.state == SimQpState::Ready)
                {
                    self.push_cm(
                        passive,
                        CmEvent::Established {
                            private_data: Vec::new(),
                        },
                    );
                }
            }
            CmMsg::Rej {
                active,
                pd,
                consumer,
            } => {
                if self
                    .qps
                    .get(&active)
                    .is_some_and(|q| q.state == SimQpState::Connecting)
                {
                    let ev = CmEvent::Rejected {
                        private_data: pd,
                        consumer,
                    };
                    self.fail_quietly(active, Some(ev));
                }
            }
            CmMsg::Dreq { to: qp } if self.qps.get(&qp).is_some_and(|q| q.refuses_posts) => {
                self.cm_closes_reset(qp)
            }
            CmMsg::Dreq { to: qp } => self.qp_error(qp, None, false),
            CmMsg::ConnErr { passive } => self.passive_failed(passive),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_req(
        &mut self,
        from: IpAddr,
        to: IpAddr,
        active: Id,
        dst: SocketAddr,
        src: SocketAddr,
        caps: QpCaps,
        pd: Vec<u8>,
    ) {
        let max_qps = self.cfg.max_qps_per_host;
        let h = self.host_mut(to);
        let lid = h.listeners.get(&dst.port()).copied();
        let qps_full = h.qps.len() >= max_qps;
        let lis = lid
            .and_then(|l| self.listeners.get(&l))
            .filter(|l| l.live && (l.addr.ip().is_unspecified() || l.addr.ip() == dst.ip()));
        let refuse = match lis {
            None => true,
            Some(l) => l.pending.len() >= l.backlog || qps_full,
        };
        if refuse {
            let msg = CmMsg::Rej {
                active,
                pd: Vec::new(),
                consumer: false,
            };
            self.send_cm(to, from, msg, 0);
            return;
        }
        let Some(lid) = lid else { return };
        let local_ip = if dst.ip().is_unspecified() {
            to
        } else {
            dst.ip()
        };
        let local = SocketAddr::new(local_ip, dst.port());
        let passive = self.new_qp(to, local, src, from, caps, SimQpState::Pending);
        if let Some(q) = self.qps.get_mut(&passive) {
            q.peer_qp = Some(active);
        }
        if let Some(q) = self.qps.get_mut(&active) {
            q.peer_qp = Some(passive);
        }
        if let Some(l) = self.listeners.get_mut(&lid) {
            l.pending.push_back((passive, pd));
        }
    }

    fn passive_failed(&mut self, id: Id) {
        let Some(q) = self.qps.get_mut(&id) else {
            return;
        };
        match q.state {
            SimQpState::Ready | SimQpState::Pending => {
                // Report ConnectError rather than Disconnected: the connection never completed.
                q.connected = false;
                self.fail_quietly(id, Some(CmEvent::ConnectError));
            }
            _ => {}
        }
    }

    // ---------------------------------------------------------------- data path

    pub fn post_recv(&mut self, id: Id, wr: &RecvWr) -> Result<(), VerbsError> {
        let q = self.qps.get_mut(&id).ok_or(VerbsError::NotConnected)?;
        match q.state {
            SimQpState::Dead => Err(dead_err()),
            SimQpState::Error if q.refuses_posts => Err(VerbsError::NotConnected),
            SimQpState::Error => {
                let c = Completion {
                    wr_id: wr.wr_id,
                    status: WcStatus::Flushed,
                    opcode: WcOpcode::Recv,
                    byte_len: 0,
                };
                self.push_cq(id, c);
                Ok(())
            }
            _ => {
                if q.rq.len() >= q.caps.max_recv_wr as usize {
                    return Err(VerbsError::QueueFull("receive queue"));
                }
                q.rq.push_back(*wr);
                Ok(())
            }
        }
    }

    pub fn post_send(&mut self, id: Id, wr: &SendWr) -> Result<(), VerbsError> {
        self.post_send_with(id, wr, None)
    }

    /// A SEND whose payload is `payload`, copied now as an HCA copies inline data into the
    /// work request ([`crate::verbs::Endpoint::post_send_inline`]).
    pub fn post_send_inline(
        &mut self,
        id: Id,
        wr: &SendWr,
        payload: &[u8],
    ) -> Result<(), VerbsError> {
        crate::verbs::inline_payload(wr, payload, self.cfg.max_inline)?;
        self.post_send_with(id, wr, Some(payload.to_vec()))
    }

    fn post_send_with(
        &mut self,
        id: Id,
        wr: &SendWr,
        inline: Option<Vec<u8>>,
    ) -> Result<(), VerbsError> {
        let now = self.now;
        let len = u64::from(wr_len(wr));
        let ser = if matches!(wr.op, SendOp::Read(_)) {
            0
        } else {
            self.ser(len)
        };
        let q = self.qps.get_mut(&id).ok_or(VerbsError::NotConnected)?;
        match q.state {
            SimQpState::Dead => Err(dead_err()),
            SimQpState::Connecting | SimQpState::Pending => Err(VerbsError::NotConnected),
            SimQpState::Error if q.refuses_posts => Err(VerbsError::NotConnected),
            SimQpState::Error => {
                let c = Completion {
                    wr_id: wr.wr_id,
                    status: WcStatus::Flushed,
                    opcode: opcode(&wr.op),
                    byte_len: 0,
                };
                self.push_cq(id, c);
                Ok(())
            }
            SimQpState::Ready => {
                if q.sq.len() >= q.caps.max_send_wr as usize {
                    return Err(VerbsError::QueueFull("send queue"));
                }
                let seq = q.next_seq;
                q.next_seq += 1;
                let start = q.tx_free_at.max(now);
                q.tx_free_at = start.saturating_add(ser);
                q.sq.push_back(SqEntry {
                    seq,
                    wr: *wr,
                    inline,
                    done: None,
                });
                self.schedule(start, Ev::Exec { qp: id, seq });
                Ok(())
            }
        }
    }

    pub fn poll_cq(&mut self, id: Id, out: &mut [Completion]) -> usize {
        let Some(q) = self.qps.get_mut(&id) else {
            return 0;
        };
        let n = out.len().min(q.cq.len());
        for (slot, c) in out.iter_mut().zip(q.cq.drain(..n)) {
            *slot = c;
        }
        n
    }

    pub fn poll_cm(&mut self, id: Id) -> Option<CmEvent> {
        self.qps.get_mut(&id)?.cm.pop_front()
    }

    fn find_entry(&mut self, id: Id, seq: u64) -> Option<&mut SqEntry> {
        let q = self.qps.get_mut(&id)?;
        let i = q.sq.binary_search_by_key(&seq, |e| e.seq).ok()?;
        q.sq.get_mut(i)
    }

    /// Report every completed WR at the head of the send queue, in order.
    fn drain_sq(&mut self, id: Id) {
        loop {
            let Some(q) = self.qps.get_mut(&id) else {
                return;
            };
            let Some(front) = q.sq.front() else { return };
            let Some(c) = front.done else { return };
            let signaled = front.wr.signaled;
            q.sq.pop_front();
            if signaled || c.status != WcStatus::Success {
                self.push_cq(id, c);
            }
        }
    }

    fn exec(&mut self, id: Id, seq: u64) {
        let Some(q) = self.qps.get(&id) else { return };
        if q.state != SimQpState::Ready || q.tx_halted {
            return;
        }
        let (host, peer_host) = (q.host, q.peer_host);
        let Some(i) = q.sq.binary_search_by_key(&seq, |e| e.seq).ok() else {
            return;
        };
        let wr = q.sq[i].wr;
        let inline = q.sq[i].inline.clone();
        let len = wr_len(&wr);
        // Local checks and data sampling.
        let need = match wr.op {
            SendOp::Read(_) => Access::LOCAL_WRITE,
            _ => Access::empty(),
        };
        let mut data = Vec::new();
        if wr.payload.is_some() && (wr.sge.is_none() || wr.op != SendOp::Send) {
            // A gathered payload is for SENDs only, after a first SGE.
            self.qp_error(id, Some((seq, WcStatus::LocalProtection)), true);
            return;
        }
        for (i, sge) in [wr.sge, wr.payload].into_iter().enumerate() {
            let Some(sge) = sge else {
                continue;
            };
            if sge.len == 0 {
                continue;
            }
            if let (1, Some(bytes)) = (i, inline.as_ref()) {
                data.extend_from_slice(bytes);
                continue;
            }
            match self.resolve_local(host, &sge, need) {
                Some((mr, off)) => {
                    if !matches!(wr.op, SendOp::Read(_)) {
                        data.extend(self.mr_bytes(mr, off, sge.len as usize));
                    }
                }
                None => {
                    self.qp_error(id, Some((seq, WcStatus::LocalProtection)), true);
                    return;
                }
            }
        }
        let mut void = false;
        let body = match wr.op {
            SendOp::Send => {
                if let Some(f) = self.corrupt.get_mut(&host).and_then(|q| q.pop_front()) {
                    let mut f = f;
                    f(&mut data);
                }
                if let Some(n) = self.drop_next.get_mut(&host).filter(|n| **n > 0) {
                    *n -= 1;
                    void = true;
                }
                if let Some(s) = self.stats_mut(host) {
                    s.sends += 1;
                    s.send_bytes += data.len() as u64;
                }
                Body::Send(data)
            }
            SendOp::Write(rb) => {
                if let Some(s) = self.stats_mut(host) {
                    s.rdma_writes += 1;
                    s.rdma_write_bytes += data.len() as u64;
                }
                Body::Write(rb, data)
            }
            SendOp::Read(rb) => {
                if let Some(s) = self.stats_mut(host) {
                    s.rdma_reads += 1;
                    s.rdma_read_bytes += u64::from(len);
                }
                Body::Read(rb, len)
            }
        };
        let ser = match &body {
            Body::Send(d) | Body::Write(_, d) => self.ser(d.len() as u64),
            Body::Read(..) => 0,
        };
        let delay = self.path_delay(host, peer_host);
        let gen = self.link_gen(host, peer_host);
        let now = self.now;
        let Some(q) = self.qps.get_mut(&id) else {
            return;
        };
        let at = now
            .saturating_add(ser)
            .saturating_add(delay)
            .max(q.last_arrival);
        q.last_arrival = at;
        let epoch = q.tx_epoch;
        q.inflight.push_back(Msg {
            seq,
            body,
            sent_at: now,
            at,
            gen,
            rnr_retries: 0,
            void,
        });
        self.schedule(at, Ev::Arrive { qp: id, epoch, seq });
    }

    fn lost(&mut self, src: Id, seq: u64, sent_at: u64) {
        let host = self.qps.get(&src).map(|q| q.host);
        if let Some(s) = host.and_then(|h| self.stats_mut(h)) {
            s.messages_lost += 1;
        }
        let stalled = self.qps.get(&src).is_some_and(|q| {
            self.links
                .get(&Self::link_key(q.host, q.peer_host))
                .is_some_and(|l| l.stalled)
        });
        if stalled {
            // A stuck device: no retry ever ends in an error.
            return;
        }
        let at = sent_at.saturating_add(self.cfg.transport_timeout_ns);
        self.schedule(at, Ev::Timeout { qp: src, seq });
    }

    fn ack(
        &mut self,
        src: Id,
        responder: IpAddr,
        seq: u64,
        sent_at: u64,
        extra: u64,
        outcome: Outcome,
    ) {
        let Some(q) = self.qps.get(&src) else { return };
        let host = q.host;
        let delay = self.path_delay(responder, host);
        let gen = self.link_gen(responder, host);
        let at = self.now.saturating_add(extra).saturating_add(delay);
        self.schedule(
            at,
            Ev::Ack {
                qp: src,
                seq,
                from: responder,
                gen,
                sent_at,
                outcome,
            },
        );
    }

    fn arrive(&mut self, src: Id, epoch: u64, seq: u64) {
        let Some(q) = self.qps.get_mut(&src) else {
            return;
        };
        if q.tx_epoch != epoch || q.inflight.front().map(|m| m.seq) != Some(seq) {
            return; // superseded by an RNR retransmission
        }
        let Some(msg) = q.inflight.pop_front() else {
            return;
        };
        let reap = q.zombie && q.inflight.is_empty();
        let dead = q.state == SimQpState::Dead;
        // A retransmission due after the requester went to error is never sent.
        let unsent = q.errored_at.is_some_and(|t| msg.sent_at > t);
        if !dead && !unsent {
            self.deliver(src, msg);
        }
        if reap {
            self.qps.remove(&src);
        }
    }

    /// `msg` from `src` reaches the responder.
    fn deliver(&mut self, src: Id, msg: Msg) {
        let Some(q) = self.qps.get(&src) else {
            return;
        };
        let seq = msg.seq;
        let (host, peer_host, peer_qp) = (q.host, q.peer_host, q.peer_qp);
        let dst_ready = peer_qp
            .and_then(|p| self.qps.get(&p))
            .is_some_and(|d| d.state == SimQpState::Ready);
        let path_ok = self.path_ok(host, peer_host, msg.gen);
        let (Some(dst), true) = (peer_qp, dst_ready && path_ok) else {
            let peer_up = self.hosts.get(&peer_host).is_some_and(|h| h.alive);
            if self.cfg.iwarp_close_ns.is_some() && path_ok && peer_up {
                // iWARP: the peer's closed TCP stream answers with a reset.
                let st = WcStatus::LocalQpOp;
                self.ack(src, peer_host, seq, msg.sent_at, 0, Outcome::Fail(st));
                return;
            }
            self.lost(src, seq, msg.sent_at);
            return;
        };
        if msg.void {
            self.ack(src, peer_host, seq, msg.sent_at, 0, Outcome::Ok);
            return;
        }
        match msg.body {
            Body::Send(ref data) => {
                let Some(d) = self.qps.get_mut(&dst) else {
                    return;
                };
                let Some(recv) = d.rq.front().copied() else {
                    self.rnr(src, dst, msg);
                    return;
                };
                d.rq.pop_front();
                let len = data.len();
                let fail = |status| Completion {
                    wr_id: recv.wr_id,
                    status,
                    opcode: WcOpcode::Recv,
                    byte_len: 0,
                };
                if len > recv.sge.len as usize {
                    self.push_cq(dst, fail(WcStatus::LocalProtection));
                    self.qp_error(dst, None, false);
                    let st = WcStatus::Other(WC_REM_INV_REQ_ERR);
                    self.ack(src, peer_host, seq, msg.sent_at, 0, Outcome::Fail(st));
                    return;
                }
                // The whole receive SGE must be valid, whatever the message length.
                let target = self.resolve_local(peer_host, &recv.sge, Access::LOCAL_WRITE);
                let Some((mr, off)) = target else {
                    self.push_cq(dst, fail(WcStatus::LocalProtection));
                    self.qp_error(dst, None, false);
                    let st = WcStatus::Other(WC_REM_OP_ERR);
                    self.ack(src, peer_host, seq, msg.sent_at, 0, Outcome::Fail(st));
                    return;
                };
                self.mr_put(mr, off, data);
                if let Some(s) = self.stats_mut(peer_host) {
                    s.recvs += 1;
                    s.recv_bytes += len as u64;
                }
                let c = Completion {
                    wr_id: recv.wr_id,
                    status: WcStatus::Success,
                    opcode: WcOpcode::Recv,
                    byte_len: len as u32,
                };
                self.push_cq(dst, c);
                self.ack(src, peer_host, seq, msg.sent_at, 0, Outcome::Ok);
            }
            Body::Write(rb, ref data) => {
                if data.is_empty() {
                    self.ack(src, peer_host, seq, msg.sent_at, 0, Outcome::Ok);
                    return;
                }
                let len = data.len() as u32;
                match self.resolve(peer_host, rb.rkey, true, rb.addr, len, Access::REMOTE_WRITE) {
                    Some((mr, off)) => {
                        self.mr_put(mr, off, data);
                        self.ack(src, peer_host, seq, msg.sent_at, 0, Outcome::Ok);
                    }
                    None => self.remote_access_error(src, dst, peer_host, seq, msg.sent_at),
                }
            }
            Body::Read(rb, len) => {
                if len == 0 {
                    self.ack(
                        src,
                        peer_host,
                        seq,
                        msg.sent_at,
                        0,
                        Outcome::ReadData(Vec::new()),
                    );
                    return;
                }
                match self.resolve(peer_host, rb.rkey, true, rb.addr, len, Access::REMOTE_READ) {
                    Some((mr, off)) => {
                        let data = self.mr_bytes(mr, off, len as usize);
                        let ser = self.ser(u64::from(len));
                        let outcome = Outcome::ReadData(data);
                        self.ack(src, peer_host, seq, msg.sent_at, ser, outcome);
                    }
                    None => self.remote_access_error(src, dst, peer_host, seq, msg.sent_at),
                }
            }
        }
    }

    fn remote_access_error(&mut self, src: Id, dst: Id, responder: IpAddr, seq: u64, sent_at: u64) {
        if let Some(s) = self.stats_mut(responder) {
            s.remote_access_errors += 1;
        }
        // The responder's QP goes to error too; the NAK tells the requester.
        self.qp_error(dst, None, false);
        self.ack(
            src,
            responder,
            seq,
            sent_at,
            0,
            Outcome::Fail(WcStatus::RemoteAccess),
        );
    }

    /// The responder has no receive posted for `msg`: RNR NAK. Everything the requester sent after
    /// it is discarded by the responder and retransmitted after it (RC ordering).
    fn rnr(&mut self, src: Id, dst: Id, mut msg: Msg) {
        let Some(q) = self.qps.get(&src) else { return };
        let (host, peer_host, requester_ok) = (q.host, q.peer_host, q.state == SimQpState::Ready);
        let _ = dst;
        if let Some(s) = self.stats_mut(peer_host) {
            s.rnr_naks_sent += 1;
        }
        if let Some(s) = self.stats_mut(host) {
            s.rnr_naks += 1;
        }
        if !requester_ok {
            return;
        }
        let back = self.path_delay(peer_host, host);
        let limit = self.cfg.rnr_retry;
        if limit < 7 && msg.rnr_retries >= u32::from(limit) {
            let at = self.now.saturating_add(back);
            if let Some(q) = self.qps.get_mut(&src) {
                q.tx_epoch += 1;
                q.tx_halted = true;
                q.inflight.clear();
            }
            self.schedule(
                at,
                Ev::RnrFail {
                    qp: src,
                    seq: msg.seq,
                },
            );
            return;
        }
        let fwd = self.path_delay(host, peer_host);
        let resend = self
            .now
            .saturating_add(back)
            .saturating_add(self.cfg.rnr_delay_ns);
        let r = resend.saturating_add(fwd);
        msg.rnr_retries = msg.rnr_retries.saturating_add(1);
        msg.sent_at = resend;
        msg.at = r;
        let Some(q) = self.qps.get_mut(&src) else {
            return;
        };
        q.tx_epoch += 1;
        q.inflight.push_front(msg);
        let epoch = q.tx_epoch;
        let mut t = r;
        let mut plan = Vec::with_capacity(q.inflight.len());
        for m in q.inflight.iter_mut() {
            t = t.max(m.at);
            m.at = t;
            plan.push((t, m.seq));
        }
        q.last_arrival = q.last_arrival.max(t);
        for (at, seq) in plan {
            self.schedule(
                at,
                Ev::Arrive {
                    qp: src,
                    epoch,
                    seq,
                },
            );
        }
    }

    fn on_ack(&mut self, id: Id, seq: u64, from: IpAddr, gen: u64, sent_at: u64, outcome: Outcome) {
        let Some(q) = self.qps.get(&id) else { return };
        if q.state != SimQpState::Ready {
            return;
        }
        let host = q.host;
        if !self.path_ok(from, host, gen) {
            self.lost(id, seq, sent_at);
            return;
        }
        let Some(e) = self.find_entry(id, seq) else {
            return;
        };
        if e.done.is_some() {
            return;
        }
        let wr = e.wr;
        let mk = |status, byte_len| Completion {
            wr_id: wr.wr_id,
            status,
            opcode: opcode(&wr.op),
            byte_len,
        };
        match outcome {
            Outcome::Ok => {
                if let Some(e) = self.find_entry(id, seq) {
                    e.done = Some(mk(WcStatus::Success, wr_len(&wr)));
                }
            }
            Outcome::ReadData(data) => {
                if !data.is_empty() {
                    let sink = wr.sge.map(|s| Sge {
                        len: data.len() as u32,
                        ..s
                    });
                    let target =
                        sink.and_then(|s| self.resolve_local(host, &s, Access::LOCAL_WRITE));
                    let Some((mr, off)) = target else {
                        self.qp_error(id, Some((seq, WcStatus::LocalProtection)), true);
                        return;
                    };
                    self.mr_put(mr, off, &data);
                }
                if let Some(e) = self.find_entry(id, seq) {
                    e.done = Some(mk(WcStatus::Success, data.len() as u32));
                }
            }
            Outcome::Fail(WcStatus::LocalQpOp) => {
                // iWARP: the peer's closed stream reset ours (see `SimConfig::iwarp_close_ns`).
                // The CM tells of the close later (its own DREQ to this QP, unless the peer's
                // comes first).
                self.qp_error_with(id, Some((seq, WcStatus::LocalQpOp)), false, false);
                if let Some(q) = self.qps.get_mut(&id) {
                    q.refuses_posts = true;
                    let host = q.host;
                    let at = self
                        .now
                        .saturating_add(self.cfg.iwarp_close_ns.unwrap_or(0));
                    self.send_cm(host, host, CmMsg::Dreq { to: id }, at);
                }
                return;
            }
            Outcome::Fail(st) => {
                self.qp_error(id, Some((seq, st)), false);
                return;
            }
        }
        self.drain_sq(id);
    }

    fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::Exec { qp, seq } => self.exec(qp, seq),
            Ev::Arrive { qp, epoch, seq } => self.arrive(qp, epoch, seq),
            Ev::Ack {
                qp,
                seq,
                from,
                gen,
                sent_at,
                outcome,
            } => self.on_ack(qp, seq, from, gen, sent_at, outcome),
            Ev::Timeout { qp, seq } | Ev::RnrFail { qp, seq } => {
                let status = if matches!(ev, Ev::Timeout { .. }) {
                    WcStatus::RetryExceeded
                } else {
                    WcStatus::RnrRetryExceeded
                };
                let ready = self
                    .qps
                    .get(&qp)
                    .is_some_and(|q| q.state == SimQpState::Ready);
                let pending = self.find_entry(qp, seq).is_some_and(|e| e.done.is_none());
                if ready && pending {
                    self.qp_error(qp, Some((seq, status)), true);
                }
            }
            Ev::Cm {
                from,
                to,
                sent_at,
                gen,
                msg,
            } => self.dispatch_cm(from, to, sent_at, gen, msg),
            Ev::ConnectFailed { qp, ev } => {
                if self
                    .qps
                    .get(&qp)
                    .is_some_and(|q| q.state == SimQpState::Connecting)
                {
                    self.fail_quietly(qp, Some(ev));
                }
            }
            Ev::PassiveFailed { qp } => self.passive_failed(qp),
            Ev::Timewait { qp } => self.push_cm(qp, CmEvent::TimewaitExit),
        }
    }

    // ---------------------------------------------------------------- faults

    pub fn set_delay(&mut self, a: IpAddr, b: IpAddr, extra: u64, jitter: u64) {
        let l = self.link(a, b);
        l.extra = extra;
        l.jitter = jitter;
    }

    pub fn break_link(&mut self, a: IpAddr, b: IpAddr) {
        let l = self.link(a, b);
        l.broken = true;
        l.gen += 1;
    }

    pub fn heal_link(&mut self, a: IpAddr, b: IpAddr) {
        let l = self.link(a, b);
        if l.broken {
            l.broken = false;
            l.stalled = false;
            l.gen += 1;
        }
    }

    pub fn stall_link(&mut self, a: IpAddr, b: IpAddr) {
        let l = self.link(a, b);
        l.broken = true;
        l.stalled = true;
        l.gen += 1;
    }

    fn bump_links_of(&mut self, ip: IpAddr) {
        let others: Vec<IpAddr> = self.hosts.keys().copied().collect();
        for o in others {
            self.link(ip, o).gen += 1;
        }
    }

    pub fn crash(&mut self, ip: IpAddr) {
        let Some(h) = self.hosts.get_mut(&ip) else {
            return;
        };
        if !h.alive {
            return;
        }
        h.alive = false;
        h.by_lkey.clear();
        h.by_rkey.clear();
        h.ports.clear();
        h.stats.registered_bytes = 0;
        h.stats.registered_regions = 0;
        h.stats.qps = 0;
        let qps = std::mem::take(&mut h.qps);
        let lis: Vec<Id> = std::mem::take(&mut h.listeners).into_values().collect();
        for id in qps {
            if let Some(q) = self.qps.get_mut(&id) {
                q.state = SimQpState::Dead;
                q.tx_halted = true;
                q.sq.clear();
                q.rq.clear();
                q.cq.clear();
                q.cm.clear();
                q.inflight.clear();
            }
        }
        for lid in lis {
            if let Some(l) = self.listeners.get_mut(&lid) {
                l.live = false;
                let pending: Vec<Id> = l.pending.drain(..).map(|(q, _)| q).collect();
                for q in pending {
                    self.qps.remove(&q);
                }
            }
        }
        for mr in self.mrs.values_mut().filter(|m| m.host == ip) {
            mr.live = false;
        }
        self.corrupt.remove(&ip);
        self.drop_next.remove(&ip);
        self.bump_links_of(ip);
    }

    /// Host `ip`'s QPs go to the error state with only their posted work flushed: no error
    /// completion, no CM event, nothing to the peer ([`super::Faults::error_qps_silently`]).
    pub fn error_qps_silently(&mut self, ip: IpAddr) {
        let qps: Vec<Id> = match self.hosts.get(&ip) {
            Some(h) if h.alive => h.qps.iter().copied().collect(),
            _ => return,
        };
        for id in qps {
            self.qp_error_with(id, None, false, false);
        }
    }

    /// The host's device goes away while its processes live on: every QP errors (its work
    /// requests flushed, its peer told) and reports `DeviceRemoval`, listeners stop (their
    /// queued requests dropped), new objects fail with `NoDevice`. Regions and endpoints stay
    /// counted in the host's stats until their handles are dropped.
    pub fn remove_device(&mut self, ip: IpAddr) {
        let Some(h) = self.hosts.get_mut(&ip) else {
            return;
        };
        if !h.alive || h.device_lost {
            return;
        }
        h.device_lost = true;
        let qps: Vec<Id> = h.qps.iter().copied().collect();
        let lis: Vec<Id> = h.listeners.values().copied().collect();
        for id in qps {
            self.qp_error(id, None, true);
            self.push_cm(id, CmEvent::DeviceRemoval);
        }
        for lid in lis {
            let pending: Vec<Id> = match self.listeners.get_mut(&lid) {
                Some(l) => {
                    l.live = false;
                    l.pending.drain(..).map(|(q, _)| q).collect()
                }
                None => Vec::new(),
            };
            for q in pending {
                self.destroy_qp(q);
            }
        }
    }

    pub fn restart(&mut self, ip: IpAddr) {
        let Some(h) = self.hosts.get_mut(&ip) else {
            return;
        };
        if h.alive {
            return;
        }
        h.alive = true;
        self.bump_links_of(ip);
    }

    pub fn corrupt_next_send(&mut self, from: IpAddr, f: CorruptFn) {
        self.corrupt.entry(from).or_default().push_back(f);
    }

    pub fn drop_next_send(&mut self, from: IpAddr) {
        *self.drop_next.entry(from).or_default() += 1;
    }
}

fn check_access(access: Access) -> Result<(), VerbsError> {
    if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE) {
        return Err(VerbsError::Invalid("REMOTE_WRITE requires LOCAL_WRITE"));
    }
    Ok(())
}

fn dead_err() -> VerbsError {
    VerbsError::NoDevice("sim host crashed".into())
}
