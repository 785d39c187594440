//! Criterion benchmarks of the engine's hot paths.
//!
//! * `msgs`: BSDH + extended header encode ([`Header::emit`]) and decode ([`Header::parse`]) for
//!   the data-path messages, and the parse error path.
//! * `credit`: per-message cost of small (64-byte) messages: the send path and the
//!   receive-completion path of one engine against a scripted peer (no fabric), two engines
//!   over an in-memory loopback wire, and two drivers over the simulated fabric.
//! * `pool`: [`Pool`] get/put cycles over a [`VecStore`].
//! * `e2e`: 64 KiB and 1 MiB transfers through two drivers over the simulated fabric, by copy
//!   and by zero copy.
//!
//! Everything runs in virtual time (the sim) or no time at all (the scripted peer and the
//! loopback wire), so the numbers are the CPU cost of the engine (plus the driver and the
//! simulator where they are in the loop), not of any network.
//!
//! Run: `cargo bench -p sdp-core --bench engine -- --quick`. Under `cargo test --benches`
//! criterion runs each benchmark once, as a smoke test.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::hint::black_box;
use std::rc::Rc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use sdp_core::harness::pair::{Pair, A_IP, B_IP};
use sdp_core::proto::buff::{Buf, BufStore, Pool, VecStore};
use sdp_core::proto::conn::CallError;
use sdp_core::proto::iocb::{ZSink, ZSrc};
use sdp_core::proto::msgs::{BsdhFlags, Ext, Header, Hello, Mid, MAX_HEADER_LEN, SDP_VERSION};
use sdp_core::proto::read::ZRecv;
use sdp_core::proto::table::ConnId;
use sdp_core::proto::{Config, Conn, Event, Instant, State};
use sdp_core::verbs::sim::SimMr;
use sdp_core::verbs::{
    Access, CmEvent, Completion, MemoryRegion, Provider, RecvWr, SendOp, Sge, WcOpcode, WcStatus,
    WorkRequest,
};

const SMALL: usize = 64;

// ---------------------------------------------------------------------------------------------
// msgs: header encode / decode

/// The data-path headers: (name, header, payload bytes after it).
fn sample_headers() -> Vec<(&'static str, Header)> {
    let f = BsdhFlags::empty();
    vec![
        (
            "Data",
            Header::new(Mid::Data, Ext::None, f, 16, 1234, 1200, SMALL),
        ),
        (
            "SrcAvail",
            Header::new(
                Mid::SrcAvail,
                Ext::SrcAvail {
                    len: 1 << 20,
                    rkey: 0xdead_beef,
                    vaddr: 0x7f00_1234_5000,
                },
                f,
                16,
                1234,
                1200,
                0,
            ),
        ),
        (
            "SinkAvail",
            Header::new(
                Mid::SinkAvail,
                Ext::SinkAvail {
                    len: 1 << 20,
                    rkey: 0xfeed_f00d,
                    vaddr: 0x7f00_9876_0000,
                    non_disc: 0,
                },
                f,
                16,
                1234,
                1200,
                0,
            ),
        ),
        (
            "RdmaRdCompl",
            Header::new(
                Mid::RdmaRdCompl,
                Ext::RdmaRdCompl { len: 1 << 20 },
                f,
                16,
                1234,
                1200,
                0,
            ),
        ),
    ]
}

/// A whole message on the wire: header, then the payload the header announces (zeros).
fn wire(h: &Header) -> Vec<u8> {
    let mut v = vec![0u8; h.bsdh.len as usize];
    h.emit(&mut v).expect("valid header");
    v
}

fn bench_msgs(c: &mut Criterion) {
    let mut g = c.benchmark_group("msgs");
    for (name, h) in sample_headers() {
        g.throughput(Throughput::Bytes(h.header_len() as u64));
        g.bench_function(BenchmarkId::new("emit", name), |b| {
            let mut out = [0u8; MAX_HEADER_LEN];
            b.iter(|| black_box(black_box(&h).emit(&mut out)).unwrap())
        });
        let msg = wire(&h);
        assert_eq!(Header::parse(&msg).expect("round trip").0, h);
        g.bench_function(BenchmarkId::new("parse", name), |b| {
            b.iter(|| black_box(Header::parse(black_box(&msg))).unwrap())
        });
    }

    // The error path: what a receive completion of a malformed message costs before the
    // connection is aborted.
    let data = wire(&sample_headers()[0].1);
    let src = wire(&sample_headers()[1].1);
    let mut unknown_mid = data.clone();
    unknown_mid[0] = 0x42;
    let mut len_mismatch = data.clone();
    len_mismatch[4..8].copy_from_slice(&9999u32.to_be_bytes());
    let mut reserved_flags = data.clone();
    reserved_flags[1] = 0x80;
    // A SrcAvail of zero bytes: well framed, rejected by the value rules at the very end.
    let mut zero_len_src = src.clone();
    zero_len_src[16..20].copy_from_slice(&0u32.to_be_bytes());
    let bad: [(&str, &[u8]); 5] = [
        ("truncated", &data[..10]),
        ("unknown_mid", &unknown_mid),
        ("reserved_flags", &reserved_flags),
        ("len_mismatch", &len_mismatch),
        ("zero_len_srcavail", &zero_len_src),
    ];
    g.throughput(Throughput::Elements(1));
    for (name, msg) in bad {
        assert!(Header::parse(msg).is_err(), "{name} must not parse");
        g.bench_function(BenchmarkId::new("parse_err", name), |b| {
            b.iter(|| black_box(Header::parse(black_box(msg))).unwrap_err())
        });
    }
    g.finish();
}

// ---------------------------------------------------------------------------------------------
// An in-memory wire for engines without a provider: one shared address space for every buffer
// store, so a SEND (or RDMA op) is a copy from one address to another.

#[derive(Default)]
struct Mem {
    bufs: Vec<Vec<u8>>,
    free: Vec<usize>,
}

impl Mem {
    fn locate(addr: u64) -> (usize, usize) {
        (((addr >> 32) - 1) as usize, (addr & 0xffff_ffff) as usize)
    }
    fn copy(&mut self, from: u64, to: u64, len: usize) {
        let (fi, fo) = Mem::locate(from);
        let (ti, to) = Mem::locate(to);
        if fi == ti {
            self.bufs[fi].copy_within(fo..fo + len, to);
        } else {
            let (src, dst) = if fi < ti {
                let (l, r) = self.bufs.split_at_mut(ti);
                (&l[fi], &mut r[0])
            } else {
                let (l, r) = self.bufs.split_at_mut(fi);
                (&r[0], &mut l[ti])
            };
            dst[to..to + len].copy_from_slice(&src[fo..fo + len]);
        }
    }
    fn write(&mut self, addr: u64, src: &[u8]) {
        let (i, o) = Mem::locate(addr);
        self.bufs[i][o..o + src.len()].copy_from_slice(src);
    }
    fn read(&self, addr: u64, dst: &mut [u8]) {
        let (i, o) = Mem::locate(addr);
        dst.copy_from_slice(&self.bufs[i][o..o + dst.len()]);
    }
}

/// A [`BufStore`] over the shared [`Mem`]; buffer addresses are `(index + 1) << 32`.
#[derive(Clone, Default)]
struct SharedStore(Rc<RefCell<Mem>>);

impl BufStore for SharedStore {
    fn alloc(&mut self, size: u32) -> Option<Buf> {
        let mut m = self.0.borrow_mut();
        let id = match m.free.pop() {
            Some(id) => {
                m.bufs[id] = vec![0; size as usize];
                id
            }
            None => {
                m.bufs.push(vec![0; size as usize]);
                m.bufs.len() - 1
            }
        };
        Some(Buf {
            id: id as u32,
            addr: (id as u64 + 1) << 32,
            lkey: 1,
            size,
        })
    }
    fn free(&mut self, buf: Buf) {
        let mut m = self.0.borrow_mut();
        m.bufs[buf.id as usize] = Vec::new();
        m.free.push(buf.id as usize);
    }
    fn write(&mut self, buf: &Buf, off: u32, src: &[u8]) {
        self.0.borrow_mut().write(buf.addr + off as u64, src);
    }
    fn read(&self, buf: &Buf, off: u32, dst: &mut [u8]) {
        self.0.borrow().read(buf.addr + off as u64, dst);
    }
}

/// One engine's queue pair on the wire: receives posted, completions not yet handed over.
#[derive(Default)]
struct Qp {
    posted: VecDeque<RecvWr>,
    sends: VecDeque<sdp_core::verbs::SendWr>,
    cq: Vec<Completion>,
}

impl Qp {
    /// Take the engine's work requests: receives are posted at once, sends queue up.
    fn take(&mut self, conn: &mut Conn<SharedStore>) -> bool {
        let mut any = false;
        while let Some(wr) = conn.poll_wr() {
            any = true;
            match wr {
                WorkRequest::Recv(r) => self.posted.push_back(r),
                WorkRequest::Send(s) => self.sends.push_back(s),
            }
        }
        any
    }

    fn complete(&mut self, wr_id: u64, opcode: WcOpcode, byte_len: u32) {
        self.cq.push(Completion {
            wr_id,
            status: WcStatus::Success,
            opcode,
            byte_len,
        });
    }
}

/// Carry out `from`'s queued sends against `to` (RC semantics, zero latency). SEND needs a
/// posted receive: finding none means the credit accounting let the engine overrun its peer.
fn transmit(mem: &RefCell<Mem>, from: &mut Qp, to: &mut Qp) {
    while let Some(s) = from.sends.pop_front() {
        let sge = s.sge.unwrap_or(Sge {
            addr: 0,
            len: 0,
            lkey: 0,
        });
        let len = sge.len as usize;
        let opcode = match s.op {
            SendOp::Send => {
                let r = to
                    .posted
                    .pop_front()
                    .expect("SEND without a posted receive");
                assert!(
                    sge.len <= r.sge.len,
                    "message longer than the receive buffer"
                );
                if len > 0 {
                    mem.borrow_mut().copy(sge.addr, r.sge.addr, len);
                }
                to.complete(r.wr_id, WcOpcode::Recv, sge.len);
                WcOpcode::Send
            }
            SendOp::Write(remote) => {
                mem.borrow_mut().copy(sge.addr, remote.addr, len);
                WcOpcode::RdmaWrite
            }
            SendOp::Read(remote) => {
                mem.borrow_mut().copy(remote.addr, sge.addr, len);
                WcOpcode::RdmaRead
            }
        };
        if s.signaled {
            from.complete(s.wr_id, opcode, sge.len);
        }
    }
}

fn deliver(conn: &mut Conn<SharedStore>, qp: &mut Qp, now: Instant) -> bool {
    if qp.cq.is_empty() {
        return false;
    }
    for wc in std::mem::take(&mut qp.cq) {
        conn.handle_completion(now, &wc);
    }
    true
}

/// Two engines joined by the loopback wire.
struct Loopback {
    mem: Rc<RefCell<Mem>>,
    a: Conn<SharedStore>,
    b: Conn<SharedStore>,
    qa: Qp,
    qb: Qp,
    now: Instant,
}

impl Loopback {
    fn new(cfg: Config) -> Loopback {
        let store = SharedStore::default();
        let now = Instant(0);
        let (mut a, hello) = Conn::connect(cfg.clone(), store.clone(), now, 7000, false).unwrap();
        let (mut b, ack) = Conn::accept(cfg, store.clone(), now, &hello).unwrap();
        let (mut qa, mut qb) = (Qp::default(), Qp::default());
        qa.take(&mut a);
        qb.take(&mut b);
        a.handle_cm(now, CmEvent::Established { private_data: ack });
        b.handle_cm(
            now,
            CmEvent::Established {
                private_data: Vec::new(),
            },
        );
        let mut l = Loopback {
            mem: store.0,
            a,
            b,
            qa,
            qb,
            now,
        };
        l.settle();
        assert_eq!(l.a.state(), State::Established);
        assert_eq!(l.b.state(), State::Established);
        l
    }

    /// Move everything along until neither engine has anything left to post or to learn.
    fn settle(&mut self) {
        loop {
            // Receives of both sides are posted before any send goes, as a driver's post_all
            // after every call would have done.
            let mut any = self.qa.take(&mut self.a) | self.qb.take(&mut self.b);
            transmit(&self.mem, &mut self.qa, &mut self.qb);
            transmit(&self.mem, &mut self.qb, &mut self.qa);
            any |= deliver(&mut self.a, &mut self.qa, self.now);
            any |= deliver(&mut self.b, &mut self.qb, self.now);
            if !any {
                return;
            }
        }
    }
}

/// One engine against a scripted peer that never runs out of buffers: it sends credit updates
/// or 64-byte Data messages on demand and swallows whatever the engine sends. Isolates one
/// engine's send path or receive-completion path.
struct Scripted {
    mem: Rc<RefCell<Mem>>,
    conn: Conn<SharedStore>,
    qp: Qp,
    /// The peer's next mseq.
    next_mseq: u32,
    /// The last mseq the peer saw from the engine.
    seen: u32,
    now: Instant,
    scratch: Vec<u8>,
}

/// Receive buffers the scripted peer claims to have posted.
const PEER_BUFS: u16 = 64;

impl Scripted {
    fn new(cfg: Config) -> Scripted {
        let store = SharedStore::default();
        let now = Instant(0);
        let hello = Header::new(
            Mid::Hello,
            Ext::Hello(Hello {
                version: SDP_VERSION,
                ip_version: 4,
                max_adverts: 8,
                desired_rcv_size: cfg.rcv_size,
                local_rcv_size: cfg.rcv_size,
                src_port: 7000,
            }),
            BsdhFlags::empty(),
            PEER_BUFS,
            0,
            0,
            0,
        );
        let (mut conn, _ack) = Conn::accept(cfg, store.clone(), now, &wire(&hello)).unwrap();
        let mut qp = Qp::default();
        qp.take(&mut conn);
        conn.handle_cm(
            now,
            CmEvent::Established {
                private_data: Vec::new(),
            },
        );
        let mut s = Scripted {
            mem: store.0,
            conn,
            qp,
            next_mseq: 1,
            seen: 0,
            now,
            scratch: vec![0; 64 * 1024],
        };
        s.settle();
        assert_eq!(s.conn.state(), State::Established);
        s
    }

    /// Swallow the engine's sends (checking their headers and sequence numbers, as the peer's
    /// receive path would) and hand it their completions.
    fn settle(&mut self) {
        loop {
            let any = self.qp.take(&mut self.conn);
            while let Some(s) = self.qp.sends.pop_front() {
                let sge = s.sge.expect("SEND with data");
                assert!(matches!(s.op, SendOp::Send), "no RDMA in this script");
                let msg = &mut self.scratch[..sge.len as usize];
                self.mem.borrow().read(sge.addr, msg);
                let (h, _) = Header::parse(msg).expect("engine sent a malformed message");
                assert_eq!(h.bsdh.mseq, self.seen.wrapping_add(1));
                self.seen = h.bsdh.mseq;
                if s.signaled {
                    self.qp.complete(s.wr_id, WcOpcode::Send, sge.len);
                }
            }
            if !(deliver(&mut self.conn, &mut self.qp, self.now) | any) {
                return;
            }
        }
    }

    /// The peer sends one Data message with `payload` bytes (0: a pure credit update) that
    /// acknowledges everything and advertises [`PEER_BUFS`] buffers.
    fn inject(&mut self, payload: &[u8]) {
        let h = Header::new(
            Mid::Data,
            Ext::None,
            BsdhFlags::empty(),
            PEER_BUFS,
            self.next_mseq,
            self.seen,
            payload.len(),
        );
        self.next_mseq = self.next_mseq.wrapping_add(1);
        let r = self
            .qp
            .posted
            .pop_front()
            .expect("engine has a receive posted");
        let mut hdr = [0u8; MAX_HEADER_LEN];
        let n = h.emit(&mut hdr).unwrap();
        {
            let mut m = self.mem.borrow_mut();
            m.write(r.sge.addr, &hdr[..n]);
            m.write(r.sge.addr + n as u64, payload);
        }
        self.qp.complete(r.wr_id, WcOpcode::Recv, h.bsdh.len);
        self.settle();
    }
}

fn small_cfg() -> Config {
    Config {
        // Every 64-byte write goes out as its own message while credits allow.
        nodelay: true,
        ..Config::default()
    }
}

/// Messages per iteration of the credit benches.
const BATCH: u64 = 256;

fn bench_credit(c: &mut Criterion) {
    let mut g = c.benchmark_group("credit");
    let msg = [0x5au8; SMALL];
    let mut buf = [0u8; SMALL];

    // Send path: write() of one 64-byte message through to its send completion. The peer
    // returns credits with an update whenever the engine has fewer than a Data message needs.
    g.throughput(Throughput::Elements(BATCH));
    g.bench_function("engine_send_64B", |b| {
        let mut s = Scripted::new(small_cfg());
        b.iter(|| {
            for _ in 0..BATCH {
                if s.conn.tx_credits() < sdp_core::proto::conn::DATA_CREDITS {
                    s.inject(&[]);
                }
                assert_eq!(s.conn.write(s.now, black_box(&msg)), Ok(SMALL));
                s.settle();
            }
        })
    });

    // Receive-completion path: a 64-byte Data message from the peer, parsed, credited and
    // read by the application; the engine reposts the buffer and sends credit updates.
    g.bench_function("engine_recv_64B", |b| {
        let mut s = Scripted::new(small_cfg());
        b.iter(|| {
            for _ in 0..BATCH {
                s.inject(black_box(&msg));
                let now = s.now;
                assert_eq!(s.conn.read(now, &mut buf), Ok(SMALL));
                s.settle();
            }
        })
    });

    // Both engines: A's send path, B's receive path and B's credit updates back to A.
    for (name, tp) in [
        ("loopback_64B/msgs", Throughput::Elements(BATCH)),
        (
            "loopback_64B/bytes",
            Throughput::Bytes(BATCH * SMALL as u64),
        ),
    ] {
        g.throughput(tp);
        g.bench_function(name, |b| {
            let mut l = Loopback::new(small_cfg());
            let sent = l.a.stats().msgs_sent - l.a.stats().credit_updates_sent;
            l.a.write(l.now, &msg).unwrap();
            l.settle();
            l.b.read(l.now, &mut buf).unwrap();
            assert_eq!(
                l.a.stats().msgs_sent - l.a.stats().credit_updates_sent,
                sent + 1
            );
            b.iter(|| {
                for _ in 0..BATCH {
                    assert_eq!(l.a.write(l.now, black_box(&msg)), Ok(SMALL));
                    l.settle();
                    assert_eq!(l.b.read(l.now, &mut buf), Ok(SMALL));
                    l.settle();
                }
            })
        });
    }

    // The same over drivers and the simulated fabric (2 us latency, virtual time): adds the
    // driver's posting/polling and the simulator's queue pairs.
    for (name, tp) in [
        ("sim_pair_64B/msgs", Throughput::Elements(BATCH)),
        (
            "sim_pair_64B/bytes",
            Throughput::Bytes(BATCH * SMALL as u64),
        ),
    ] {
        g.throughput(tp);
        g.bench_function(name, |b| {
            let mut p = SimPair::new(small_cfg());
            let before = p.pair.a.conn(p.ia).unwrap().stats().clone();
            p.small_messages(BATCH, &msg);
            let after = &p.pair.a.conn(p.ia).unwrap().stats();
            // One Data message per write (plus any credit updates of A's own).
            assert_eq!(
                after.msgs_sent
                    - before.msgs_sent
                    - (after.credit_updates_sent - before.credit_updates_sent),
                BATCH
            );
            b.iter(|| p.small_messages(BATCH, &msg))
        });
    }
    g.finish();
}

// ---------------------------------------------------------------------------------------------
// pool

fn bench_pool(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    const CYCLES: u64 = 64;
    for size in [64u32, 4 * 1024, 32 * 1024, 256 * 1024] {
        g.throughput(Throughput::Elements(CYCLES));
        // Warm: buffers come off the free list (the steady state of a busy connection).
        g.bench_with_input(BenchmarkId::new("get_put_warm", size), &size, |b, &size| {
            let mut store = VecStore::default();
            let mut pool = Pool::new(size);
            let mut held = Vec::with_capacity(CYCLES as usize);
            b.iter(|| {
                for _ in 0..CYCLES {
                    held.push(pool.get(&mut store).unwrap());
                }
                for buf in held.drain(..) {
                    pool.put(&mut store, buf);
                }
            })
        });
        // Cold: every get registers (allocates) and trim gives everything back, as after an
        // idle shrink.
        g.bench_with_input(
            BenchmarkId::new("get_put_trim_cold", size),
            &size,
            |b, &size| {
                let mut store = VecStore::default();
                let mut pool = Pool::new(size);
                let mut held = Vec::with_capacity(CYCLES as usize);
                b.iter(|| {
                    for _ in 0..CYCLES {
                        held.push(pool.get(&mut store).unwrap());
                    }
                    for buf in held.drain(..) {
                        pool.put(&mut store, buf);
                    }
                    pool.trim(&mut store, 0);
                })
            },
        );
    }
    g.finish();
}

// ---------------------------------------------------------------------------------------------
// Two drivers over the simulated fabric: the harness's Pair, connected, with B's read buffer.

struct SimPair {
    pair: Pair,
    ia: ConnId,
    ib: ConnId,
    rbuf: Vec<u8>,
    next_token: u64,
}

impl SimPair {
    fn new(cfg: Config) -> SimPair {
        let mut pair = Pair::new(1, cfg);
        let (ia, ib) = pair.connect();
        SimPair {
            pair,
            ia,
            ib,
            rbuf: vec![0; 256 * 1024],
            next_token: 1,
        }
    }

    /// Poll, let `done` act, and move virtual time to the next delivery or deadline, until
    /// `done` says so; panics if everything stalls first.
    fn run_until(&mut self, mut done: impl FnMut(&mut SimPair) -> bool) {
        loop {
            self.pair.poll();
            if done(self) {
                return;
            }
            self.pair.poll();
            assert!(self.pair.advance(), "stalled: nothing pending");
        }
    }

    /// Drain B's readable bytes; returns how many.
    fn read_b(&mut self) -> usize {
        let mut got = 0;
        loop {
            let now = self.pair.now();
            match self.pair.b.read(now, self.ib, &mut self.rbuf) {
                Ok(0) => panic!("unexpected EOF"),
                Ok(n) => got += n,
                Err(CallError::WouldBlock) => return got,
                Err(e) => panic!("read: {e:?}"),
            }
        }
    }

    /// `n` small messages A -> B, each written when A can post it at once (the credits data
    /// needs, nothing queued), so each is its own Data message.
    fn small_messages(&mut self, n: u64, msg: &[u8]) {
        let total = n as usize * msg.len();
        let (mut sent, mut got) = (0u64, 0usize);
        self.run_until(|p| {
            let now = p.pair.now();
            while sent < n {
                let c = p.pair.a.conn(p.ia).unwrap();
                if c.tx_credits() < sdp_core::proto::conn::DATA_CREDITS || c.tx_queued_bytes() > 0 {
                    break;
                }
                assert_eq!(p.pair.a.write(now, p.ia, msg), Ok(msg.len()));
                sent += 1;
            }
            got += p.read_b();
            p.pair.a.take_events(p.ia);
            p.pair.b.take_events(p.ib);
            got >= total
        });
        assert_eq!(got, total);
    }

    /// `data` A -> B by copy: A writes as the send buffer allows, B reads.
    fn bcopy(&mut self, data: &[u8]) {
        let (mut sent, mut got) = (0usize, 0usize);
        self.run_until(|p| {
            let now = p.pair.now();
            while sent < data.len() {
                match p.pair.a.write(now, p.ia, &data[sent..]) {
                    Ok(n) => sent += n,
                    Err(CallError::WouldBlock) => break,
                    Err(e) => panic!("write: {e:?}"),
                }
            }
            got += p.read_b();
            p.pair.a.take_events(p.ia);
            p.pair.b.take_events(p.ib);
            got >= data.len()
        });
        assert_eq!(got, data.len());
    }

    /// A registered source on A (remote read) holding `data`, and a sink of the same size on B.
    fn zcopy_buffers(&self, data: &[u8]) -> (SimMr, SimMr) {
        let mut src = self
            .pair
            .a
            .provider()
            .reg_mr(data.len(), Access::LOCAL_WRITE | Access::REMOTE_READ)
            .unwrap();
        src.write(0, data);
        let sink = self
            .pair
            .b
            .provider()
            .reg_mr(data.len(), Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        (src, sink)
    }

    fn token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    /// ZCopy read path: A offers its source (SrcAvail), B RDMA-Reads it straight into its sink.
    fn zcopy_read(&mut self, src: &SimMr, sink: &SimMr) {
        let len = src.len();
        let (ta, tb) = (self.token(), self.token());
        let now = self.pair.now();
        let z = ZSrc {
            addr: src.addr(),
            len: len as u32,
            lkey: src.lkey(),
            rkey: src.rkey(),
        };
        self.pair.a.write_zcopy(now, self.ia, z, ta).unwrap();
        let (mut offered, mut sent, mut got) = (false, 0usize, 0usize);
        self.run_until(|p| {
            let now = p.pair.now();
            // Offer the sink once the SrcAvail heads B's stream (earlier, it would go out as
            // a SinkAvail and turn this into the write path).
            if !offered && p.pair.b.conn(p.ib).unwrap().is_readable() {
                let s = ZSink {
                    addr: sink.addr(),
                    len: len as u32,
                    lkey: sink.lkey(),
                    rkey: sink.rkey(),
                };
                match p.pair.b.read_zcopy(now, p.ib, s, tb) {
                    Ok(ZRecv::Pending) => offered = true,
                    other => panic!("read_zcopy: {other:?}"),
                }
            }
            for ev in p.pair.a.take_events(p.ia) {
                if let Event::ZcopySent { token, bytes } = ev {
                    assert_eq!(token, ta);
                    sent += bytes;
                }
            }
            for ev in p.pair.b.take_events(p.ib) {
                if let Event::ZcopyReceived { token, bytes } = ev {
                    assert_eq!(token, tb);
                    got += bytes;
                }
            }
            sent == len && got == len
        });
    }

    /// ZCopy write path: B offers its sink (SinkAvail) first, then A writes plain bytes, which
    /// the engine RDMA-Writes into the sink.
    fn zcopy_write(&mut self, data: &[u8], sink: &SimMr) {
        let len = data.len();
        let tb = self.token();
        let now = self.pair.now();
        let s = ZSink {
            addr: sink.addr(),
            len: len as u32,
            lkey: sink.lkey(),
            rkey: sink.rkey(),
        };
        assert_eq!(
            self.pair.b.read_zcopy(now, self.ib, s, tb),
            Ok(ZRecv::Pending)
        );
        // Let the SinkAvail reach A before it writes.
        self.run_until(|p| p.pair.fabric.pending_events() == 0);
        let (mut sent, mut got) = (0usize, 0usize);
        self.run_until(|p| {
            let now = p.pair.now();
            while sent < len {
                match p.pair.a.write(now, p.ia, &data[sent..]) {
                    Ok(n) => sent += n,
                    Err(CallError::WouldBlock) => break,
                    Err(e) => panic!("write: {e:?}"),
                }
            }
            p.pair.a.take_events(p.ia);
            for ev in p.pair.b.take_events(p.ib) {
                if let Event::ZcopyReceived { token, bytes } = ev {
                    assert_eq!(token, tb);
                    assert_eq!(bytes, len, "the whole write went into the sink");
                    got += bytes;
                }
            }
            got == len
        });
    }
}

fn bench_e2e(c: &mut Criterion) {
    let mut g = c.benchmark_group("e2e");
    g.sample_size(10);
    for size in [64usize << 10, 1 << 20] {
        let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        let label = if size < (1 << 20) {
            format!("{}KiB", size >> 10)
        } else {
            format!("{}MiB", size >> 20)
        };
        g.throughput(Throughput::Bytes(size as u64));

        g.bench_function(BenchmarkId::new("bcopy", &label), |b| {
            let mut p = SimPair::new(Config::default());
            p.bcopy(&data);
            let (sa, sb) = (p.pair.fabric.stats(A_IP), p.pair.fabric.stats(B_IP));
            assert_eq!(sa.rdma_read_bytes + sb.rdma_read_bytes, 0);
            assert_eq!(sa.rdma_write_bytes + sb.rdma_write_bytes, 0);
            b.iter(|| p.bcopy(&data))
        });

        g.bench_function(BenchmarkId::new("zcopy_read", &label), |b| {
            let mut p = SimPair::new(Config::default());
            let (src, sink) = p.zcopy_buffers(&data);
            p.zcopy_read(&src, &sink);
            let mut check = vec![0u8; size];
            sink.read(0, &mut check);
            assert!(check == data, "sink holds the source's bytes");
            let (sa, sb) = (p.pair.fabric.stats(A_IP), p.pair.fabric.stats(B_IP));
            assert_eq!(sa.rdma_read_bytes + sb.rdma_read_bytes, size as u64);
            assert_eq!(sa.rdma_write_bytes + sb.rdma_write_bytes, 0);
            b.iter(|| p.zcopy_read(&src, &sink))
        });

        g.bench_function(BenchmarkId::new("zcopy_write", &label), |b| {
            let mut p = SimPair::new(Config::default());
            let (_src, sink) = p.zcopy_buffers(&data);
            p.zcopy_write(&data, &sink);
            let mut check = vec![0u8; size];
            sink.read(0, &mut check);
            assert!(check == data, "sink holds the written bytes");
            let (sa, sb) = (p.pair.fabric.stats(A_IP), p.pair.fabric.stats(B_IP));
            assert_eq!(sa.rdma_write_bytes + sb.rdma_write_bytes, size as u64);
            assert_eq!(sa.rdma_read_bytes + sb.rdma_read_bytes, 0);
            b.iter(|| p.zcopy_write(&data, &sink))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_msgs, bench_credit, bench_pool, bench_e2e);
criterion_main!(benches);
