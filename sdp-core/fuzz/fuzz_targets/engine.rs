//! Fuzz one SDP engine (`sdp_core::proto::Conn`) against a hostile peer.
//!
//! The input decodes (`arbitrary`) into a config, the peer's Hello or HelloAck, and a script of
//! steps: peer messages built with the wire module, with sequence numbers, acknowledgements and
//! credits that are mostly plausible (the peer's next `mseq`, an `mseq_ack` of a message the
//! engine really sent, credits near what it really has) and sometimes not; raw garbage;
//! completions of the engine's posted work requests (success or an error status); CM events;
//! application calls (write, read, peek, write_zcopy/read_zcopy with tokens, cancels, shutdown,
//! close, abort, urgent data, options); the clock moving and the deadlines it passes. A
//! model of an RC queue pair feeds the engine only what a real transport could: receives
//! complete in posting order and only into posted buffers, send-queue work completes in posting
//! order, and after an error or a disconnect everything flushes. After the script the
//! application closes and the peer goes silent; the engine must reach `Closed` by its deadlines.
//!
//! Checked (see `fuzz/README.md` for the precise list): no panic; no wait without a deadline;
//! every zero-copy token reported exactly once by `Closed`; and what the engine sends and
//! posts is sound (sequence, credits, sizes, buffers, remote ranges).
#![no_main]

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::rc::Rc;
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::arbitrary::{self, Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use sdp_core::proto::buff::{Buf, BufStore};
use sdp_core::proto::iocb::{ZSink, ZSrc};
use sdp_core::proto::msgs::{self, BsdhFlags, Ext, Header, Hello, HelloAck, Mid, BSDH_LEN};
use sdp_core::proto::read::ZRecv;
use sdp_core::proto::{Config, Conn, Event, Instant, Shutdown, State};
use sdp_core::verbs::{
    CmEvent, Completion, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkRequest,
};

// ---------------------------------------------------------------------------------------------
// Registered memory: a store the harness shares with the engine, so it can write what the peer
// sends into posted receives and read what the engine sends, and check every buffer use.

#[derive(Default)]
struct Mem {
    bufs: HashMap<u32, Vec<u8>>,
    next: u32,
    allocated: usize,
    /// Refuse allocations beyond this many bytes (0: no limit).
    limit: usize,
}

impl Mem {
    /// The live buffer holding `[addr, addr + len)`, if any: (id, offset).
    fn locate(&self, addr: u64, len: u32) -> Option<(u32, usize)> {
        let id = (addr >> 32).checked_sub(1)? as u32;
        let off = (addr & 0xffff_ffff) as usize;
        let b = self.bufs.get(&id)?;
        (off + len as usize <= b.len()).then_some((id, off))
    }
}

#[derive(Clone, Default)]
struct Store(Rc<RefCell<Mem>>);

impl BufStore for Store {
    fn alloc(&mut self, size: u32) -> Option<Buf> {
        let mut m = self.0.borrow_mut();
        if m.limit != 0 && m.allocated + size as usize > m.limit {
            return None;
        }
        m.next += 1;
        let id = m.next;
        m.bufs.insert(id, vec![0; size as usize]);
        m.allocated += size as usize;
        Some(Buf {
            id,
            addr: (id as u64 + 1) << 32,
            lkey: 0x1000 + id,
            size,
        })
    }
    fn free(&mut self, buf: Buf) {
        let mut m = self.0.borrow_mut();
        match m.bufs.remove(&buf.id) {
            Some(b) => {
                assert_eq!(b.len(), buf.size as usize, "freed with another size");
                m.allocated -= b.len();
            }
            None => panic!("double free (or free of a foreign buffer): {buf:?}"),
        }
    }
    fn write(&mut self, buf: &Buf, off: u32, src: &[u8]) {
        let mut m = self.0.borrow_mut();
        let b = m.bufs.get_mut(&buf.id).expect("write to a freed buffer");
        let off = off as usize;
        assert!(off + src.len() <= b.len(), "write beyond the buffer");
        b[off..off + src.len()].copy_from_slice(src);
    }
    fn read(&self, buf: &Buf, off: u32, dst: &mut [u8]) {
        let m = self.0.borrow();
        let b = m.bufs.get(&buf.id).expect("read of a freed buffer");
        let off = off as usize;
        assert!(off + dst.len() <= b.len(), "read beyond the buffer");
        dst.copy_from_slice(&b[off..off + dst.len()]);
    }
}

// ---------------------------------------------------------------------------------------------
// Known engine bugs (fuzz/README.md): `SDP_FUZZ_KNOWN=name,...` lets a run step over them to
// look for others. Without it every check is strict.

fn known(name: &str) -> bool {
    static K: OnceLock<Vec<String>> = OnceLock::new();
    K.get_or_init(|| {
        std::env::var("SDP_FUZZ_KNOWN")
            .map(|v| v.split(',').map(str::to_string).collect())
            .unwrap_or_default()
    })
    .iter()
    .any(|k| k == name)
}

// ---------------------------------------------------------------------------------------------
// The input.

#[derive(Arbitrary, Debug)]
struct Input {
    cfg: CfgIn,
    peer: PeerIn,
    steps: Vec<Step>,
    /// At the end, the CM reports the disconnect the engine asks for (else only its
    /// disconnect timeout ends it).
    cm_answers_disconnect: bool,
}

#[derive(Arbitrary, Debug)]
struct CfgIn {
    active: bool,
    rcv: u8,
    max_rcv: u8,
    init_rx: u8,
    max_rx: u8,
    sndbuf: u8,
    zthr: u8,
    by_send: bool,
    split: bool,
    split_reads: u8,
    split_sends: u8,
    inflight: u8,
    adverts: u8,
    keepalive: u8,
    nodelay: bool,
    store_limit: u8,
}

#[derive(Arbitrary, Debug)]
struct PeerIn {
    rcv: u8,
    desired: u8,
    adverts: u8,
    bufs: u8,
    /// Rarely: a Hello/HelloAck with odd values.
    odd: u8,
}

/// Weighted completion status: mostly success.
#[derive(Debug, Clone, Copy)]
struct Status(WcStatus);

impl<'a> Arbitrary<'a> for Status {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let b = u8::arbitrary(u)?;
        Ok(Status(match b {
            0..=223 => WcStatus::Success,
            224..=231 => WcStatus::Flushed,
            232..=235 => WcStatus::LocalProtection,
            236..=239 => WcStatus::RemoteAccess,
            240..=243 => WcStatus::RnrRetryExceeded,
            244..=251 => WcStatus::RetryExceeded,
            _ => WcStatus::Other(u32::from(b)),
        }))
    }
}

/// How a peer message's BSDH deviates from the plausible one.
#[derive(Arbitrary, Debug, Clone, Copy)]
struct Tweak {
    /// 0-239: the next mseq; above: off by -8..=7.
    seq: u8,
    /// 0-199: acknowledge the engine's last message the peer has (its send completed);
    /// 200-239: its last message posted; above: that less 1..16 (or beyond it).
    ack: u8,
    /// Credits to grant: 0..=16 mostly; 250 and above: a raw `bufs` value.
    credits: u8,
    raw_bufs: u16,
    /// 0-239: no flags; above: `flags & 0x07`, or a reserved bit.
    flags: u8,
}

/// A length near what is outstanding (`frac` of it), or any.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Len {
    Fit(u8),
    All,
    Raw(u32),
}

#[derive(Arbitrary, Debug)]
enum PeerMsg {
    Data { len: u16, oob: bool },
    DisConn,
    AbortConn,
    SendSm,
    RdmaWrCompl(Len),
    RdmaRdCompl(Len),
    ModeChange(u8),
    SrcAvailCancel,
    SinkAvailCancel,
    SinkCancelAck,
    ChRcvBuf(u8),
    ChRcvBufAck(u8),
    SuspComm(u64),
    SuspCommAck,
    SinkAvail { len: Len, rkey: u32 },
    SrcAvail { len: u32 },
    Hello,
    HelloAck,
}

#[derive(Arbitrary, Debug)]
enum Cm {
    Established,
    EstablishedGarbage(Vec<u8>),
    Rejected { consumer: bool, pd: Vec<u8> },
    Unreachable,
    ConnectError,
    AddrError,
    RouteError,
    Disconnected,
    DeviceRemoval,
    TimewaitExit,
    AddrChange,
}

#[derive(Arbitrary, Debug)]
enum Step {
    Msg(PeerMsg, Tweak),
    Msg2(PeerMsg, Tweak),
    Msg3(PeerMsg, Tweak),
    Garbage(Vec<u8>),
    /// Complete the `n + 1` oldest send-queue work requests.
    SendDone(u8, Status),
    SendDone2(u8, Status),
    /// The oldest posted receive completes with an error.
    RecvFail(Status),
    Cm(Cm),
    Advance(u16),
    AdvanceSecs(u8),
    Deadline,
    Write(u16),
    Write2(u16),
    WriteZcopy(u32),
    Read(u16),
    Read2(u16),
    ReadZcopy(u32),
    Peek(u16),
    CancelWrite(u8),
    CancelRead,
    Shutdown(u8),
    Close,
    Abort,
    Urgent(u8),
    ReadUrgent,
    Nodelay(bool),
    Sndbuf(u32),
}

// ---------------------------------------------------------------------------------------------
// The model of the peer and the queue pair.

const SEC: u64 = 1_000_000_000;
static ZEROS: [u8; 1 << 16] = [0; 1 << 16];

struct Harness {
    conn: Conn<Store>,
    mem: Store,
    now: Instant,
    active: bool,
    split: bool,

    // Queue pair.
    posted_recvs: VecDeque<RecvWr>,
    sends: VecDeque<SendWr>,
    /// The QP is in error (an error completion, or a disconnect): everything flushes, nothing
    /// more arrives.
    qp_error: bool,
    disconnect_asked: bool,
    disconnected: bool,
    established_sent: bool,

    // The peer.
    /// The peer's last mseq (Hello/HelloAck is 0).
    peer_mseq: u32,
    /// The engine's messages: last mseq posted, and last one whose send completed (the peer
    /// has it).
    engine_posted: u32,
    engine_delivered: u32,
    /// Highest mseq the peer's credits ever allowed the engine.
    granted: u32,
    /// Largest receive size the peer ever announced.
    peer_rcv: u32,
    /// The engine's outstanding SrcAvails as the peer saw them: (vaddr, rkey, len, read).
    engine_srcs: VecDeque<(u64, u32, u32)>,
    engine_sink: Option<(u64, u32, u32)>,
    /// The peer's own advertisements: SrcAvails (vaddr, rkey, len) and its sink.
    peer_srcs: Vec<(u64, u32, u32)>,
    /// Every sink the peer advertised (a hostile peer may offer several).
    peer_sinks: Vec<(u64, u32, u32)>,
    next_peer_key: u32,

    // Application.
    next_token: u64,
    /// Zero-copy sends accepted, in order: token -> len.
    tx_tokens: BTreeMap<u64, u32>,
    rx_tokens: BTreeMap<u64, u32>,
    closed_seen: bool,
    app_closed: bool,
    /// Tokens whose sink an RDMA Read was posted into (known bug `sink-read-lost`).
    sink_reads: Vec<u64>,
    /// The peer sent an RdmaWrCompl longer than the engine's sink (known bug
    /// `wrcompl-too-long`).
    long_wrcompl: bool,
    /// Application read buffer.
    scratch: Vec<u8>,
    /// A known bug was met: stop this input here.
    abandon: bool,
}

fn status_opcode(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Send => WcOpcode::Send,
        SendOp::Write(_) => WcOpcode::RdmaWrite,
        SendOp::Read(_) => WcOpcode::RdmaRead,
    }
}

impl Harness {
    fn state(&self) -> State {
        self.conn.state()
    }

    fn why(&self) -> String {
        self.conn.debug_state()
    }

    /// Take everything the engine produced and check it.
    fn drain(&mut self) {
        while let Some(wr) = self.conn.poll_wr() {
            match wr {
                WorkRequest::Recv(r) => {
                    assert!(
                        self.mem.0.borrow().locate(r.sge.addr, r.sge.len).is_some(),
                        "receive posted outside a live buffer: {r:?}"
                    );
                    self.posted_recvs.push_back(r);
                }
                WorkRequest::Send(s) => self.posted_send(s),
            }
        }
        while self.conn.poll_cm().is_some() {
            self.disconnect_asked = true;
            self.qp_error = true;
        }
        while let Some(ev) = self.conn.poll_event() {
            self.event(ev);
        }
        self.check_waits();
    }

    fn posted_send(&mut self, s: SendWr) {
        if let Some(sge) = s.sge {
            assert!(
                self.mem.0.borrow().locate(sge.addr, sge.len).is_some() || is_app_memory(sge.addr),
                "send work request outside a live buffer: {s:?}"
            );
        }
        match s.op {
            SendOp::Send => self.engine_message(&s),
            SendOp::Read(remote) => {
                let len = s.sge.map_or(0, |g| g.len);
                if let Some(g) = s.sge.filter(|g| is_app_memory(g.addr)) {
                    self.sink_reads.push((g.addr & 0x0fff_ffff_ffff_ffff) >> 24);
                }
                let ok = self.peer_srcs.iter().any(|&(va, rkey, l)| {
                    rkey == remote.rkey
                        && remote.addr >= va
                        && remote.addr + u64::from(len) <= va + u64::from(l)
                });
                assert!(
                    ok,
                    "RDMA Read outside what the peer advertised: {s:?}, advertised {:?}",
                    self.peer_srcs
                );
            }
            SendOp::Write(remote) => {
                let len = s.sge.map_or(0, |g| g.len);
                if len > 0 {
                    let ok = self.peer_sinks.iter().any(|&(va, rkey, l)| {
                        rkey == remote.rkey
                            && remote.addr >= va
                            && remote.addr + u64::from(len) <= va + u64::from(l)
                    });
                    assert!(
                        ok,
                        "RDMA Write outside the peer's sinks: {s:?}, sinks {:?}",
                        self.peer_sinks
                    );
                }
            }
        }
        self.sends.push_back(s);
    }

    /// A SEND of the engine: it must parse and follow sequence, credit and size rules.
    fn engine_message(&mut self, s: &SendWr) {
        let sge = s.sge.expect("a SEND without local memory");
        let total = sge.len as usize + s.payload.map_or(0, |p| p.len as usize);
        let mut bytes = vec![0u8; total];
        {
            let m = self.mem.0.borrow();
            let (id, off) = m.locate(sge.addr, sge.len).expect("checked");
            bytes[..sge.len as usize].copy_from_slice(&m.bufs[&id][off..off + sge.len as usize]);
        }
        let (h, _) = Header::parse(&bytes)
            .unwrap_or_else(|e| panic!("the engine sent a malformed message ({e}): {s:?}"));
        assert_eq!(
            h.bsdh.mseq,
            self.engine_posted.wrapping_add(1),
            "engine mseq out of sequence: {h:?}"
        );
        self.engine_posted = h.bsdh.mseq;
        assert!(
            h.bsdh.mseq_ack == self.peer_mseq
                || h.bsdh.mseq_ack.wrapping_sub(self.peer_mseq) as i32 <= 0,
            "engine acknowledged peer message {} but the peer sent up to {}",
            h.bsdh.mseq_ack,
            self.peer_mseq
        );
        assert!(
            h.bsdh.mseq.wrapping_sub(self.granted) as i32 <= 0,
            "engine sent message {} with credits only up to {} ({h:?}; {})",
            h.bsdh.mseq,
            self.granted,
            self.why()
        );
        assert!(
            total <= self.peer_rcv as usize,
            "engine sent {total} bytes, the peer's receives hold {}",
            self.peer_rcv
        );
        match h.ext {
            Ext::SrcAvail { len, rkey, vaddr } => self.engine_srcs.push_back((vaddr, rkey, len)),
            Ext::SinkAvail {
                len, rkey, vaddr, ..
            } => self.engine_sink = Some((vaddr, rkey, len)),
            _ => {}
        }
        if h.bsdh.mid == Mid::SendSm {
            // The engine refused the peer's SrcAvails: they are over.
            self.peer_srcs.clear();
        }
    }

    fn event(&mut self, ev: Event) {
        match ev {
            Event::ZcopySent { token, bytes } => {
                let Some(len) = self.tx_tokens.remove(&token) else {
                    panic!("ZcopySent for token {token} not outstanding (twice, or never given)");
                };
                assert!(
                    bytes <= len as usize,
                    "ZcopySent {bytes} of a {len}-byte source"
                );
                if let Some((&first, _)) = self.tx_tokens.first_key_value() {
                    assert!(
                        first > token,
                        "ZcopySent {token} before the earlier source {first}"
                    );
                }
            }
            Event::ZcopyReceived { token, bytes } => {
                let Some(len) = self.rx_tokens.remove(&token) else {
                    panic!(
                        "ZcopyReceived for token {token} not outstanding (twice, or never given)"
                    );
                };
                assert!(
                    bytes <= len as usize,
                    "ZcopyReceived {bytes} into a {len}-byte sink"
                );
            }
            Event::Closed(_) => {
                assert!(!self.closed_seen, "Closed reported twice");
                self.closed_seen = true;
                self.forgive_sink_reads();
                assert!(
                    self.tx_tokens.is_empty() && self.rx_tokens.is_empty(),
                    "Closed with zero-copy tokens never reported: sends {:?}, receives {:?}",
                    self.tx_tokens,
                    self.rx_tokens
                );
            }
            _ => {}
        }
    }

    /// Known bug `sink-read-lost`: a zero-copy receive whose RDMA Read into the sink failed or
    /// was still in flight is never reported.
    /// Known bug `wrcompl-too-long`: an RdmaWrCompl longer than the sink takes the sink away
    /// before it is refused, so the sink is never reported.
    fn forgive_sink_reads(&mut self) {
        if known("sink-read-lost") {
            let reads = std::mem::take(&mut self.sink_reads);
            self.rx_tokens.retain(|t, _| !reads.contains(t));
            self.sink_reads = reads;
        }
        if known("wrcompl-too-long") && self.long_wrcompl {
            self.rx_tokens.clear();
        }
    }

    /// No wait without a deadline (README: W1-W5).
    fn check_waits(&self) {
        let st = self.state();
        let deadline = self.conn.poll_timeout();
        match st {
            State::Connecting | State::Accepting | State::Disconnecting => assert!(
                deadline.is_some(),
                "W1: {st:?} without a deadline: {}",
                self.why()
            ),
            State::Closed => {
                assert!(
                    deadline.is_none(),
                    "W5: a deadline after Closed: {deadline:?}"
                );

                assert!(
                    self.tx_tokens.is_empty() && self.rx_tokens.is_empty(),
                    "Closed with zero-copy tokens outstanding: {:?} {:?}",
                    self.tx_tokens,
                    self.rx_tokens
                );
            }
            State::Established => {
                if self.app_closed {
                    assert!(
                        deadline.is_some(),
                        "W2: closed by the application, established, no deadline: {}",
                        self.why()
                    );
                }
                if self.conn.tx_queued_bytes() > 0
                    && self.conn.tx_credits() < 2
                    && self.sends.is_empty()
                    && !self.conn.zcopy_outstanding()
                {
                    assert!(
                        deadline.is_some(),
                        "W3: data queued without credits and nothing in flight, no deadline: {}",
                        self.why()
                    );
                }
                if !self.split && self.conn.srcavail_inflight() > 0 {
                    assert!(
                        deadline.is_some(),
                        "W4: a SrcAvail outstanding without a deadline: {}",
                        self.why()
                    );
                }
            }
        }
    }

    /// Handle every deadline that is due; it must move on (W6: no busy timer).
    fn timers(&mut self) {
        if self.abandon {
            return;
        }
        for _ in 0..16 {
            match self.conn.poll_timeout() {
                Some(t) if t <= self.now => {
                    self.conn.handle_timeout(self.now);
                    self.drain();
                }
                _ => return,
            }
        }
        if known("committed-deadline") && self.split && self.conn.srcavail_inflight() > 0 {
            // A committed advertisement got a deadline it cannot act on.
            self.abandon = true;
            return;
        }
        panic!(
            "W6: a deadline stays due after 16 rounds at {:?}: {:?} ({})",
            self.now,
            self.conn.poll_timeout(),
            self.why()
        );
    }

    fn advance(&mut self, ns: u64) {
        self.now = Instant(self.now.0 + ns);
        self.timers();
    }

    /// Can the peer's messages reach the engine now?
    fn deliverable(&self) -> bool {
        !self.qp_error
            && self.state() != State::Closed
            && !(self.active && self.state() == State::Connecting)
    }

    /// Put `bytes` into the oldest posted receive and complete it. True if it arrived whole.
    fn deliver(&mut self, bytes: &[u8]) -> bool {
        if !self.deliverable() {
            return false;
        }
        let Some(r) = self.posted_recvs.pop_front() else {
            return false; // RNR: the peer's SEND waits.
        };
        let (status, len) = if bytes.len() > r.sge.len as usize {
            // A message longer than the receive: a local length error.
            self.qp_error = true;
            (WcStatus::LocalProtection, 0)
        } else {
            let mut m = self.mem.0.borrow_mut();
            let (id, off) = m
                .locate(r.sge.addr, r.sge.len)
                .unwrap_or_else(|| panic!("receive {r:?} completes into a freed buffer"));
            m.bufs.get_mut(&id).unwrap()[off..off + bytes.len()].copy_from_slice(bytes);
            (WcStatus::Success, bytes.len() as u32)
        };
        let wc = Completion {
            wr_id: r.wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len: len,
        };
        self.conn.handle_completion(self.now, &wc);
        self.drain();
        status == WcStatus::Success
    }

    fn message(&mut self, m: &PeerMsg, t: Tweak) {
        if !self.deliverable() || self.posted_recvs.is_empty() {
            return;
        }
        let room = self.posted_recvs.front().map_or(0, |r| r.sge.len) as usize;
        let near = |l: Len, out: u32| -> u32 {
            match l {
                Len::Fit(f) => ((u64::from(out) * (u64::from(f) + 1)) / 256).max(1) as u32,
                Len::All => out.max(1),
                Len::Raw(x) => x,
            }
        };
        let mut payload = 0usize;
        let (mid, ext) = match *m {
            PeerMsg::Data { len, .. } => {
                payload = (len as usize) % (room.saturating_sub(BSDH_LEN) + 1);
                if len == u16::MAX {
                    payload = room; // one too many
                }
                (Mid::Data, Ext::None)
            }
            PeerMsg::DisConn => (Mid::DisConn, Ext::None),
            PeerMsg::AbortConn => (Mid::AbortConn, Ext::None),
            PeerMsg::SendSm => (Mid::SendSm, Ext::None),
            PeerMsg::RdmaWrCompl(l) => {
                let out = self.engine_sink.map_or(1, |s| s.2);
                let len = near(l, out);
                // Longer than a sink the application offered (posted or still queued).
                if self.rx_tokens.values().any(|&l| len > l) {
                    self.long_wrcompl = true;
                }
                (Mid::RdmaWrCompl, Ext::RdmaWrCompl { len })
            }
            PeerMsg::RdmaRdCompl(l) => {
                let out = self.engine_srcs.front().map_or(1, |s| s.2);
                (Mid::RdmaRdCompl, Ext::RdmaRdCompl { len: near(l, out) })
            }
            PeerMsg::ModeChange(f) => (Mid::ModeChange, Ext::ModeChange { flags: f }),
            PeerMsg::SrcAvailCancel => (Mid::SrcAvailCancel, Ext::None),
            PeerMsg::SinkAvailCancel => (Mid::SinkAvailCancel, Ext::None),
            PeerMsg::SinkCancelAck => (Mid::SinkCancelAck, Ext::None),
            PeerMsg::ChRcvBuf(s) => (Mid::ChRcvBuf, Ext::ChRcvBuf { size: rcv_size(s) }),
            PeerMsg::ChRcvBufAck(s) => (Mid::ChRcvBufAck, Ext::ChRcvBufAck { size: rcv_size(s) }),
            PeerMsg::SuspComm(id) => (Mid::SuspComm, Ext::SuspComm { service_id: id }),
            PeerMsg::SuspCommAck => (Mid::SuspCommAck, Ext::None),
            PeerMsg::SinkAvail { len, rkey } => {
                let len = near(len, 1 << 20).max(1);
                self.next_peer_key += 1;
                let vaddr = 0x7000_0000_0000 + (u64::from(self.next_peer_key) << 24);
                let rkey = rkey | 1;
                (
                    Mid::SinkAvail,
                    Ext::SinkAvail {
                        len,
                        rkey,
                        vaddr,
                        non_disc: 0,
                    },
                )
            }
            PeerMsg::SrcAvail { len } => {
                let len = (len % (1 << 20)).max(1);
                self.next_peer_key += 1;
                let vaddr = 0x6000_0000_0000 + (u64::from(self.next_peer_key) << 24);
                (
                    Mid::SrcAvail,
                    Ext::SrcAvail {
                        len,
                        rkey: self.next_peer_key,
                        vaddr,
                    },
                )
            }
            PeerMsg::Hello => (
                Mid::Hello,
                Ext::Hello(Hello {
                    version: msgs::SDP_VERSION,
                    ip_version: 4,
                    max_adverts: 4,
                    desired_rcv_size: 4096,
                    local_rcv_size: 4096,
                    src_port: 1,
                }),
            ),
            PeerMsg::HelloAck => (
                Mid::HelloAck,
                Ext::HelloAck(HelloAck {
                    version: msgs::SDP_VERSION,
                    max_adverts: 4,
                    actual_rcv_size: 4096,
                    desired_rcv_size: 4096,
                }),
            ),
        };
        let mut flags = BsdhFlags::empty();
        let mut raw_flags = None;
        if t.flags >= 240 {
            if t.flags >= 252 {
                raw_flags = Some(t.flags);
            } else {
                flags = BsdhFlags::from_bits_truncate(t.flags & 0x07);
            }
        }
        if let PeerMsg::Data { oob: true, .. } = m {
            if payload > 0 {
                flags |= BsdhFlags::OOB_PRES | BsdhFlags::OOB_PEND;
            }
        }
        let mseq = if t.seq < 240 {
            self.peer_mseq.wrapping_add(1)
        } else {
            self.peer_mseq
                .wrapping_add(1)
                .wrapping_add(i32::from(t.seq - 240) as u32)
                .wrapping_sub(8)
        };
        let ack = match t.ack {
            0..=199 => self.engine_delivered,
            200..=239 => self.engine_posted,
            x => self.engine_posted.wrapping_sub(u32::from(x - 239)),
        };
        // The engine's messages the peer has not seen take credits first.
        let unacked = self.engine_posted.wrapping_sub(ack);
        let bufs = if t.credits >= 250 {
            t.raw_bufs
        } else {
            (unacked.min(60_000) + u32::from(t.credits % 17)) as u16
        };
        let h = Header::new(mid, ext, flags, bufs, mseq, ack, payload);
        let mut bytes = vec![0u8; h.header_len() + payload];
        if h.emit(&mut bytes).is_err() {
            return; // e.g. an extended header the wire refuses (length 0)
        }
        if let Some(f) = raw_flags {
            bytes[1] = f;
        }
        for (i, b) in bytes[h.header_len()..].iter_mut().enumerate() {
            *b = i as u8;
        }
        // The peer's view: what it sent and the credits it granted (only when the message is
        // plausible: an engine that accepts a wrong one aborts or ignores it anyway).
        let plausible = mseq == self.peer_mseq.wrapping_add(1) && raw_flags.is_none();
        if self.steps_on_known(&h) {
            return;
        }
        // The engine may answer while it takes the message (inside `deliver`), so the peer's
        // view moves first, and back if the message did not arrive.
        let saved = self.peer_view(&h, plausible);
        if !self.deliver(&bytes) {
            self.restore(saved);
            return;
        }
        if plausible {
            match ext {
                Ext::RdmaRdCompl { len } => {
                    if let Some(front) = self.engine_srcs.front_mut() {
                        if len >= front.2 {
                            self.engine_srcs.pop_front();
                        } else {
                            front.2 -= len;
                        }
                    }
                }
                Ext::RdmaWrCompl { .. } => self.engine_sink = None,
                _ => {}
            }
        }
    }

    /// Known bug `sink-split-overflow`: a ChRcvBufAck below the current send size is taken, and
    /// then a SinkAvail makes `fill_sink` copy the rest of an old, larger send buffer into a
    /// smaller one. With the bug known, such an ack is not sent.
    fn steps_on_known(&self, h: &Header) -> bool {
        matches!(h.ext, Ext::ChRcvBufAck { size } if size < self.conn.send_size())
            && known("sink-split-overflow")
    }

    /// Take a message the peer is about to send into its view: advertisements always (the
    /// remote ranges the engine may touch), sequence, credits and receive size if `plausible`.
    fn peer_view(&mut self, h: &Header, plausible: bool) -> Saved {
        let saved = Saved {
            peer_mseq: self.peer_mseq,
            granted: self.granted,
            peer_rcv: self.peer_rcv,
            srcs: self.peer_srcs.len(),
            sinks: self.peer_sinks.len(),
        };
        match h.ext {
            Ext::SrcAvail { len, rkey, vaddr } => self.peer_srcs.push((vaddr, rkey, len)),
            Ext::SinkAvail {
                len, rkey, vaddr, ..
            } => self.peer_sinks.push((vaddr, rkey, len)),
            _ => {}
        }
        if plausible {
            let b = &h.bsdh;
            self.peer_mseq = b.mseq;
            let unacked = self.engine_posted.wrapping_sub(b.mseq_ack);
            let limit = b.mseq_ack.wrapping_add(u32::from(b.bufs));
            if limit.wrapping_sub(self.granted) as i32 > 0 && unacked <= u32::from(b.bufs) {
                self.granted = limit;
            }
            if let Ext::ChRcvBufAck { size } = h.ext {
                self.peer_rcv = self.peer_rcv.max(size);
            }
        }
        saved
    }

    fn restore(&mut self, s: Saved) {
        self.peer_mseq = s.peer_mseq;
        self.granted = s.granted;
        self.peer_rcv = s.peer_rcv;
        self.peer_srcs.truncate(s.srcs);
        self.peer_sinks.truncate(s.sinks);
    }

    /// Complete the `n` oldest send-queue work requests, in order.
    fn complete_sends(&mut self, n: usize, status: WcStatus) {
        for _ in 0..n {
            if self.state() == State::Closed {
                return;
            }
            let Some(s) = self.sends.pop_front() else {
                return;
            };
            let status = if self.qp_error {
                WcStatus::Flushed
            } else {
                status
            };
            if status != WcStatus::Success {
                self.qp_error = true;
            }
            let byte_len = match s.op {
                SendOp::Read(_) => s.sge.map_or(0, |g| g.len),
                _ => 0,
            };
            if let (SendOp::Read(_), Some(sge), WcStatus::Success) = (s.op, s.sge, status) {
                // The peer's bytes land in the local buffer (a bounce buffer, or the app's sink).
                let mut m = self.mem.0.borrow_mut();
                if let Some((id, off)) = m.locate(sge.addr, sge.len) {
                    let b = m.bufs.get_mut(&id).unwrap();
                    b[off..off + sge.len as usize].fill(0xab);
                } else {
                    assert!(
                        is_app_memory(sge.addr),
                        "RDMA Read completes into a freed buffer: {s:?}"
                    );
                }
            }
            if status == WcStatus::Success && s.op == SendOp::Send {
                // The peer has this message now.
                if let Some(sge) = s.sge {
                    if let Some(mseq) = self.sent_mseq(sge) {
                        self.engine_delivered = mseq;
                    }
                }
            }
            if let Some(sge) = s.sge {
                if !is_app_memory(sge.addr) {
                    assert!(
                        self.mem.0.borrow().locate(sge.addr, sge.len).is_some(),
                        "a work request completes on a buffer freed while it was posted: {s:?}"
                    );
                }
            }
            let wc = Completion {
                wr_id: s.wr_id,
                status,
                opcode: status_opcode(&s.op),
                byte_len,
            };
            self.conn.handle_completion(self.now, &wc);
            self.drain();
        }
    }

    fn sent_mseq(&self, sge: Sge) -> Option<u32> {
        let m = self.mem.0.borrow();
        let (id, off) = m.locate(sge.addr, sge.len)?;
        let b = &m.bufs[&id][off..];
        (b.len() >= 12).then(|| u32::from_be_bytes(b[8..12].try_into().unwrap()))
    }

    fn fail_recv(&mut self, status: WcStatus) {
        if self.state() == State::Closed || self.active && self.state() == State::Connecting {
            return;
        }
        let Some(r) = self.posted_recvs.pop_front() else {
            return;
        };
        let status = if status == WcStatus::Success {
            WcStatus::Flushed
        } else {
            status
        };
        self.qp_error = true;
        let wc = Completion {
            wr_id: r.wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len: 0,
        };
        self.conn.handle_completion(self.now, &wc);
        self.drain();
    }

    /// After an error or a disconnect, the receives posted now complete flushed (in order).
    /// Receives the engine posts meanwhile flush in a later round (as a driver sees them).
    fn flush_recvs(&mut self) {
        let n = self.posted_recvs.len();
        for _ in 0..n {
            if !self.qp_error || self.state() == State::Closed {
                return;
            }
            let Some(r) = self.posted_recvs.pop_front() else {
                return;
            };
            let wc = Completion {
                wr_id: r.wr_id,
                status: WcStatus::Flushed,
                opcode: WcOpcode::Recv,
                byte_len: 0,
            };
            self.conn.handle_completion(self.now, &wc);
            self.drain();
        }
    }

    fn cm(&mut self, c: &Cm, peer: &PeerIn) {
        let st = self.state();
        if st == State::Closed {
            return;
        }
        let setup = matches!(st, State::Connecting | State::Accepting);
        let ev = match c {
            Cm::Established if setup && !self.established_sent => {
                self.established_sent = true;
                CmEvent::Established {
                    private_data: if self.active {
                        self.hello_ack(peer)
                    } else {
                        Vec::new()
                    },
                }
            }
            Cm::EstablishedGarbage(pd) if setup && self.active && !self.established_sent => {
                self.established_sent = true;
                if let Ok(h) = Header::parse_private_data(pd) {
                    if let Ext::HelloAck(a) = h.ext {
                        self.peer_rcv = a.actual_rcv_size;
                        self.granted = u32::from(h.bsdh.bufs);
                    }
                }
                CmEvent::Established {
                    private_data: pd.clone(),
                }
            }
            Cm::Rejected { consumer, pd } if st == State::Connecting => CmEvent::Rejected {
                private_data: pd.clone(),
                consumer: *consumer,
            },
            Cm::Unreachable if setup => CmEvent::Unreachable,
            Cm::ConnectError if setup => CmEvent::ConnectError,
            Cm::AddrError if st == State::Connecting => CmEvent::AddrError,
            Cm::RouteError if st == State::Connecting => CmEvent::RouteError,
            Cm::Disconnected if !self.disconnected && (!setup || self.established_sent) => {
                self.disconnected = true;
                self.qp_error = true;
                // The CM reports a disconnect after the flushed completions.
                self.complete_sends(self.sends.len(), WcStatus::Flushed);
                self.flush_recvs();
                if self.state() == State::Closed {
                    return;
                }
                CmEvent::Disconnected
            }
            Cm::DeviceRemoval => {
                self.qp_error = true;
                CmEvent::DeviceRemoval
            }
            Cm::TimewaitExit => CmEvent::TimewaitExit,
            Cm::AddrChange => CmEvent::AddrChange,
            _ => return,
        };
        self.conn.handle_cm(self.now, ev);
        self.drain();
    }

    fn hello_ack(&mut self, peer: &PeerIn) -> Vec<u8> {
        let rcv = rcv_size(peer.rcv);
        let bufs = 1 + u16::from(peer.bufs % 16);
        let (version, rcv_field) = match peer.odd {
            250 => (0x12, rcv),
            251 => (msgs::SDP_VERSION, 0),
            _ => (msgs::SDP_VERSION, rcv),
        };
        let ack = HelloAck {
            version,
            max_adverts: peer.adverts % 9,
            actual_rcv_size: rcv_field,
            desired_rcv_size: rcv_size(peer.desired),
        };
        let h = Header::new(
            Mid::HelloAck,
            Ext::HelloAck(ack),
            BsdhFlags::empty(),
            if peer.odd == 252 { 0 } else { bufs },
            0,
            0,
            0,
        );
        let mut v = vec![0u8; msgs::HELLO_ACK_LEN];
        if h.emit(&mut v).is_err() {
            // Invalid on purpose: write the fields by hand.
            v[0] = Mid::HelloAck as u8;
            v[4..8].copy_from_slice(&(msgs::HELLO_ACK_LEN as u32).to_be_bytes());
            v[16] = version;
        }
        self.peer_rcv = rcv;
        self.granted = u32::from(bufs);
        // IB pads the REP's private data.
        v.resize(196, 0);
        v
    }

    fn app(&mut self, step: &Step) {
        let now = self.now;
        let mut buf = std::mem::take(&mut self.scratch);
        match *step {
            Step::Write(n) | Step::Write2(n) => {
                let _ = self.conn.write(now, &ZEROS[..n as usize]);
            }
            Step::WriteZcopy(len) => {
                let len = len % (1 << 20);
                self.next_token += 1;
                let token = self.next_token;
                let src = ZSrc {
                    addr: app_addr(token),
                    len,
                    lkey: 0xa000 + token as u32,
                    rkey: 0xb000 + token as u32,
                };
                let closed = self.state() == State::Closed;
                if self.conn.write_zcopy(now, src, token).is_ok() {
                    assert!(!closed, "write_zcopy accepted after Closed");
                    self.tx_tokens.insert(token, len);
                }
            }
            Step::Read(n) | Step::Read2(n) => {
                let _ = self.conn.read(now, &mut buf[..n as usize]);
            }
            Step::ReadZcopy(len) => {
                let len = len % (1 << 20);
                self.next_token += 1;
                let token = self.next_token;
                let sink = ZSink {
                    addr: app_addr(token),
                    len,
                    lkey: 0xa000 + token as u32,
                    rkey: 0xb000 + token as u32,
                };
                let closed = self.state() == State::Closed;
                if let Ok(ZRecv::Pending) = self.conn.read_zcopy(now, sink, token) {
                    assert!(!closed, "read_zcopy pending after Closed");
                    self.rx_tokens.insert(token, len);
                }
            }
            Step::Peek(n) => {
                let _ = self.conn.peek(&mut buf[..n as usize]);
            }
            Step::CancelWrite(i) => {
                let tok = self
                    .tx_tokens
                    .keys()
                    .nth(i as usize % self.tx_tokens.len().max(1))
                    .copied();
                if let Some(t) = tok {
                    self.conn.cancel_write_zcopy(now, t);
                }
            }
            Step::CancelRead => self.conn.cancel_read_zcopy(now),
            Step::Shutdown(k) => {
                let how = match k % 3 {
                    0 => Shutdown::Read,
                    1 => Shutdown::Write,
                    _ => Shutdown::Both,
                };
                let _ = self.conn.shutdown(now, how);
            }
            Step::Close => {
                self.conn.close(now);
                self.app_closed = true;
            }
            Step::Abort => self.conn.abort(now),
            Step::Urgent(b) => {
                let _ = self.conn.send_urgent(now, b);
            }
            Step::ReadUrgent => {
                let _ = self.conn.read_urgent();
            }
            Step::Nodelay(on) => self.conn.set_nodelay(on),
            Step::Sndbuf(b) => self.conn.set_sndbuf(b as usize % (8 << 20)),
            _ => unreachable!(),
        }
        self.scratch = buf;
        self.drain();
    }

    /// The end: the application closes, the peer goes silent, the transport completes what was
    /// posted (or flushes it after an error) and the CM answers a disconnect if
    /// `cm_answers`. The engine must reach Closed by its deadlines (W7), within the time its
    /// timers allow, and report every token by then.
    fn finish(&mut self, cm_answers: bool) {
        if !self.app_closed {
            self.conn.close(self.now);
            self.app_closed = true;
            self.drain();
        }
        let closed_at = self.now;
        let cfg = self.conn.config().clone();
        let limit = cfg.linger
            + cfg.disconnect_timeout
            + cfg.connect_timeout
            + cfg.srcavail_timeout
            + cfg.keepalive_interval * (cfg.keepalive_probes + 2)
            + cfg.keepalive_idle.unwrap_or_default()
            + Duration::from_secs(10);
        for _ in 0..100_000 {
            if self.abandon {
                return;
            }
            if self.state() == State::Closed {
                break;
            }
            // One round of the transport: what is posted now completes (or flushes).
            let sends = self.sends.len();
            self.complete_sends(sends, WcStatus::Success);
            let recvs = if self.qp_error {
                self.posted_recvs.len()
            } else {
                0
            };
            self.flush_recvs();
            let setup = matches!(self.state(), State::Connecting | State::Accepting);
            let mut answered = false;
            if cm_answers
                && self.disconnect_asked
                && !self.disconnected
                && (!setup || self.established_sent)
                && self.state() != State::Closed
            {
                self.cm(
                    &Cm::Disconnected,
                    &PeerIn {
                        rcv: 0,
                        desired: 0,
                        adverts: 0,
                        bufs: 0,
                        odd: 0,
                    },
                );
                answered = true;
            }
            if self.state() == State::Closed {
                break;
            }
            let moved = sends > 0 || recvs > 0 || answered;
            // Completions on a QP in error are instant: time must still move on.
            if moved && !self.qp_error {
                continue;
            }
            let Some(t) = self.conn.poll_timeout() else {
                if moved {
                    continue;
                }
                panic!(
                    "W7: after close, with a silent peer, the engine waits in {:?} with no deadline: {}",
                    self.state(),
                    self.why()
                );
            };
            assert!(
                t.saturating_since(closed_at) <= limit,
                "W7: after close the engine still runs {:?} later (limit {limit:?}): {}",
                t.saturating_since(closed_at),
                self.why()
            );
            self.now = Instant(self.now.0.max(t.0));
            self.timers();
        }
        if self.abandon {
            return;
        }
        assert_eq!(self.state(), State::Closed, "never closed: {}", self.why());
        assert!(self.closed_seen, "Closed state without a Closed event");
        // What was received stays readable; reading it all gives every buffer back.
        let mut buf = std::mem::take(&mut self.scratch);
        for _ in 0..100_000 {
            match self.conn.read(self.now, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        self.drain();
        let m = self.mem.0.borrow();
        assert!(
            m.bufs.is_empty(),
            "{} buffers ({} bytes) never given back after Closed and reading to the end: {}",
            m.bufs.len(),
            m.allocated,
            self.conn.debug_state()
        );
    }
}

/// The peer's view before a message, to go back to if it does not arrive.
struct Saved {
    peer_mseq: u32,
    granted: u32,
    peer_rcv: u32,
    srcs: usize,
    sinks: usize,
}

fn app_addr(token: u64) -> u64 {
    0xA000_0000_0000_0000 | (token << 24)
}

fn is_app_memory(addr: u64) -> bool {
    addr >> 60 == 0xA
}

fn rcv_size(b: u8) -> u32 {
    match b % 8 {
        0 => 1024,
        1 => 2048,
        2 => 4096,
        3 => 8192,
        4 => 32 * 1024,
        5 => 64 * 1024,
        6 => 256 * 1024,
        _ => 1 << 20,
    }
}

fn config(c: &CfgIn) -> Config {
    let rcv = [1024, 2048, 4096, 32 * 1024][c.rcv as usize % 4];
    let init = 2 + u32::from(c.init_rx % 6);
    Config {
        rcv_size: rcv,
        max_rcv_size: (rcv << (c.max_rcv % 3)).min(64 << 10).max(rcv),
        initial_rx_bufs: init,
        min_rx_bufs: 2,
        max_rx_bufs: init + u32::from(c.max_rx % 16),
        sndbuf: [4 << 10, 64 << 10, 1 << 20, 4 << 20][c.sndbuf as usize % 4],
        zcopy_threshold: [1024, 4096, 64 << 10][c.zthr as usize % 3],
        zcopy_by_send: Some(c.by_send),
        zcopy_split: Some(c.split),
        zcopy_split_reads: 1 + c.split_reads % 3,
        zcopy_split_sends: c.split_sends % 3,
        nodelay: c.nodelay,
        max_adverts: 1 + c.adverts % 8,
        max_srcavail_inflight: 1 + c.inflight % 4,
        keepalive_idle: match c.keepalive % 4 {
            0 => Some(Duration::from_secs(1 + u64::from(c.keepalive % 7))),
            _ => None,
        },
        ..Config::default()
    }
}

fn run(input: &Input) {
    let cfg = config(&input.cfg);
    if cfg.validate().is_err() {
        return;
    }
    let split = cfg.zcopy_by_send == Some(true) && cfg.zcopy_split == Some(true);
    let mem = Store::default();
    mem.0.borrow_mut().limit = match input.cfg.store_limit {
        0..=239 => 0,
        x => usize::from(x - 239) * (16 << 10),
    };
    let now = Instant(SEC);
    let peer = &input.peer;
    let (conn, peer_rcv, granted) = if input.cfg.active {
        match Conn::connect(cfg, mem.clone(), now, 4000, false) {
            Ok((c, hello)) => {
                Header::parse_private_data(&hello).expect("our own Hello parses");
                (c, 0, 0)
            }
            Err(_) => return,
        }
    } else {
        let rcv = rcv_size(peer.rcv);
        let bufs = 1 + u16::from(peer.bufs % 16);
        let hello = Hello {
            version: if peer.odd == 250 {
                0x13
            } else {
                msgs::SDP_VERSION
            },
            ip_version: 4,
            max_adverts: peer.adverts % 9,
            desired_rcv_size: rcv_size(peer.desired),
            local_rcv_size: rcv,
            src_port: 1234,
        };
        let h = Header::new(
            Mid::Hello,
            Ext::Hello(hello),
            BsdhFlags::empty(),
            if peer.odd == 252 { 0 } else { bufs },
            0,
            u32::from(peer.odd == 253),
            0,
        );
        let mut pd = vec![0u8; msgs::TCP_PS_REQ_PRIVATE_DATA_LEN];
        if h.emit(&mut pd).is_err() {
            return;
        }
        match Conn::accept(cfg, mem.clone(), now, &pd) {
            Ok((c, ack)) => {
                Header::parse_private_data(&ack).expect("our own HelloAck parses");
                (c, rcv, u32::from(bufs))
            }
            Err(_) => return,
        }
    };
    let mut h = Harness {
        conn,
        mem,
        now,
        active: input.cfg.active,
        split,
        posted_recvs: VecDeque::new(),
        sends: VecDeque::new(),
        qp_error: false,
        disconnect_asked: false,
        disconnected: false,
        established_sent: false,
        peer_mseq: 0,
        engine_posted: 0,
        engine_delivered: 0,
        granted,
        peer_rcv,
        engine_srcs: VecDeque::new(),
        engine_sink: None,
        peer_srcs: Vec::new(),
        peer_sinks: Vec::new(),
        next_peer_key: 0,
        next_token: 0,
        tx_tokens: BTreeMap::new(),
        rx_tokens: BTreeMap::new(),
        closed_seen: false,
        app_closed: false,
        sink_reads: Vec::new(),
        long_wrcompl: false,
        scratch: vec![0; 1 << 16],
        abandon: false,
    };
    h.drain();
    for step in &input.steps {
        if h.abandon {
            return;
        }
        match step {
            Step::Msg(m, t) | Step::Msg2(m, t) | Step::Msg3(m, t) => h.message(m, *t),
            Step::Garbage(g) => {
                let g: Vec<u8> = g.iter().copied().take(64).collect();
                // Garbage may happen to be the next message: the peer's view follows it.
                match Header::parse(&g) {
                    Ok((m, _)) if h.steps_on_known(&m) => {}
                    Ok((m, _)) => {
                        let plausible = m.bsdh.mseq == h.peer_mseq.wrapping_add(1);
                        let saved = h.peer_view(&m, plausible);
                        if !h.deliver(&g) {
                            h.restore(saved);
                        }
                    }
                    Err(_) => {
                        h.deliver(&g);
                    }
                }
            }
            Step::SendDone(n, s) | Step::SendDone2(n, s) => h.complete_sends(*n as usize + 1, s.0),
            Step::RecvFail(s) => h.fail_recv(s.0),
            Step::Cm(c) => h.cm(c, peer),
            Step::Advance(ms) => h.advance(u64::from(*ms) * 1_000_000),
            Step::AdvanceSecs(s) => h.advance(u64::from(*s) * SEC),
            Step::Deadline => {
                if let Some(t) = h.conn.poll_timeout() {
                    h.now = Instant(h.now.0.max(t.0));
                    h.timers();
                }
            }
            other => h.app(other),
        }
    }
    if !h.abandon {
        h.finish(input.cm_answers_disconnect);
    }
}

fuzz_target!(|input: Input| {
    run(&input);
});
