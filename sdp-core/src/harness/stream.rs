//! Application stand-ins for the Pair harness: a writer that sends a seeded random byte stream
//! in random message sizes and a reader that reads it back in random sizes and checks every
//! byte, each optionally through zero copy (registered sources and sinks).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::events::EventCheck;
use crate::driver::Driver;
use crate::proto::conn::CallError;
use crate::proto::iocb::{ZSink, ZSrc};
use crate::proto::read::ZRecv;
use crate::proto::table::ConnId;
use crate::proto::{Event, Instant, Shutdown};
use crate::verbs::sim::SimProvider;
use crate::verbs::{Access, Grant, MemoryRegion, Provider};

/// Bytes of a zero-copy source's or sink's region on either side of what is advertised: a peer
/// that reached beyond its grant would fail the transfer (remote access error).
const GUARD: usize = 40;

/// How the application moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Plain `write`/`read`: everything by copy through send and receive buffers.
    BCopy,
    /// Large writes offer registered sources (SrcAvail; the peer RDMA-Reads them).
    ZcopySrc,
    /// Large reads offer registered sinks (SinkAvail; the peer RDMA-Writes into them, or reads
    /// a SrcAvail straight into them).
    ZcopySink,
    /// Both of the above.
    Both,
}

impl Mode {
    fn src(self) -> bool {
        matches!(self, Mode::ZcopySrc | Mode::Both)
    }
    fn sink(self) -> bool {
        matches!(self, Mode::ZcopySink | Mode::Both)
    }
}

/// A seeded byte stream, the same bytes however it is cut into pieces (each 8-byte block is a
/// splitmix64 of the seed and the block number).
pub struct Bytes {
    seed: u64,
    pos: u64,
}

impl Bytes {
    pub fn new(seed: u64) -> Bytes {
        Bytes { seed, pos: 0 }
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf.iter_mut() {
            let block = splitmix64(self.seed ^ (self.pos / 8).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            *b = block.to_le_bytes()[(self.pos % 8) as usize];
            self.pos += 1;
        }
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One side's application: writes one stream and reads the other, over any provider (the
/// simulator in the Pair tests, real devices in the rig's `sdp-rigtest`). Built by
/// [`App::builder`] (or [`Duplex`]); checks every engine event it takes ([`EventCheck`]).
pub struct App<P: Provider = SimProvider> {
    pub mode: Mode,
    /// Bytes to send in all; after the last one the write half is shut.
    pub to_send: u64,
    pub sent: u64,
    pub received: u64,
    pub eof: bool,
    pub shut: bool,
    /// Largest message size the writer uses.
    pub max_msg: usize,
    out: Bytes,
    expect: Bytes,
    sizes: ChaCha8Rng,
    pending: Vec<u8>,
    next_token: u64,
    /// Zero-copy sends outstanding, oldest first.
    src: std::collections::VecDeque<(u64, P::Mr, Grant, Vec<u8>)>,
    /// Bytes of short zero-copy completions to send again (before `pending`).
    redo: Vec<u8>,
    /// Zero-copy sends kept outstanding at once (pipelined zero copy); 1 by default.
    pub src_window: usize,
    sink: Option<(u64, P::Mr, Grant)>,
    /// Errors returned by calls (the test decides whether they are expected; an error end of
    /// the connection is `may_fail`'s).
    pub errors: Vec<CallError>,
    pub events: Vec<Event>,
    /// Don't read (a stalled reader).
    pub paused_reader: bool,
    pub zcopy_min: usize,
    /// Don't shut the write half after the last byte.
    pub keep_open: bool,
    /// The connection may end in an error (`Closed(Some(_))`): the test provokes or accepts
    /// it. Without it such an end fails the test.
    pub may_fail: bool,
    /// The rules the engine's events keep ([`EventCheck`]), checked on every event taken.
    check: EventCheck,
}

/// An [`App`] by named parameters:
/// `App::builder(Mode::BCopy).sends(1 << 20).max_msg(64 << 10).tx_seed(1).rx_seed(2).build()`.
/// Its peer's application has the seeds the other way round (`tx_seed(2).rx_seed(1)`).
#[derive(Debug, Clone, Copy)]
#[must_use]
pub struct AppBuilder {
    mode: Mode,
    sends: u64,
    max_msg: usize,
    tx_seed: u64,
    rx_seed: u64,
}

impl AppBuilder {
    /// Bytes to send in all (default 0: a reader); after the last one the write half is shut.
    pub fn sends(mut self, bytes: u64) -> AppBuilder {
        self.sends = bytes;
        self
    }

    /// Largest message size the writer uses (default 64 KiB).
    pub fn max_msg(mut self, bytes: usize) -> AppBuilder {
        self.max_msg = bytes;
        self
    }

    /// Seeds the stream this side sends, and its message, read and sink sizes (default 0).
    pub fn tx_seed(mut self, seed: u64) -> AppBuilder {
        self.tx_seed = seed;
        self
    }

    /// Seeds the stream this side expects: the peer's `tx_seed` (default 0).
    pub fn rx_seed(mut self, seed: u64) -> AppBuilder {
        self.rx_seed = seed;
        self
    }

    pub fn build<P: Provider>(self) -> App<P> {
        App {
            mode: self.mode,
            to_send: self.sends,
            sent: 0,
            received: 0,
            eof: false,
            shut: false,
            max_msg: self.max_msg,
            out: Bytes::new(self.tx_seed),
            expect: Bytes::new(self.rx_seed),
            sizes: ChaCha8Rng::seed_from_u64(self.tx_seed ^ 0x5eed),
            pending: Vec::new(),
            next_token: 1,
            src: std::collections::VecDeque::new(),
            redo: Vec::new(),
            src_window: 1,
            sink: None,
            errors: Vec::new(),
            events: Vec::new(),
            paused_reader: false,
            zcopy_min: 64 * 1024,
            keep_open: false,
            may_fail: false,
            check: EventCheck::new(),
        }
    }
}

/// Two applications streaming at each other, by named parameters: A writes the stream B checks
/// and the other way round, both seeded from `seed` (each direction its own bytes and sizes).
#[derive(Debug, Clone, Copy)]
pub struct Duplex {
    pub mode: Mode,
    /// Bytes each side sends.
    pub bytes: u64,
    pub seed: u64,
    /// Largest message size the writers use.
    pub max_msg: usize,
}

impl Duplex {
    /// (A's application, B's application).
    pub fn apps<P: Provider>(self) -> (App<P>, App<P>) {
        let (ab, ba) = (self.seed * 2 + 1, self.seed * 2 + 2);
        let side = App::builder(self.mode)
            .sends(self.bytes)
            .max_msg(self.max_msg);
        (
            side.tx_seed(ab).rx_seed(ba).build(),
            side.tx_seed(ba).rx_seed(ab).build(),
        )
    }
}

impl App {
    /// Start an [`AppBuilder`] (the provider is the simulator's unless `build` is told
    /// otherwise).
    pub fn builder(mode: Mode) -> AppBuilder {
        AppBuilder {
            mode,
            sends: 0,
            max_msg: 64 * 1024,
            tx_seed: 0,
            rx_seed: 0,
        }
    }
}

impl<P: Provider> App<P> {
    pub fn done_sending(&self) -> bool {
        self.sent == self.to_send && self.shut
    }

    /// Take the connection's events and make as much progress as the engine allows. Panics
    /// if an event breaks one of [`EventCheck`]'s rules.
    pub fn pump(&mut self, d: &mut Driver<P>, now: Instant, id: ConnId) {
        let evs = d.take_events(id);
        self.take(evs);
        self.write_some(d, now, id);
        if !self.paused_reader {
            self.read_some(d, now, id);
        }
    }

    /// Check and act on the engine's events, and keep them in `events`.
    fn take(&mut self, evs: Vec<Event>) {
        for ev in &evs {
            if let Err(broken) = self.check.event(ev, self.may_fail) {
                let before = &self.events[self.events.len().saturating_sub(8)..];
                panic!(
                    "engine event rule broken: {broken}\n(the last events before: {before:?}; this batch: {evs:?})"
                );
            }
            match *ev {
                Event::ZcopySent { token, bytes } => self.on_sent(token, bytes),
                Event::ZcopyReceived { token, bytes } => self.on_received(token, bytes),
                _ => {}
            }
        }
        self.events.extend(evs);
    }

    /// How the connection ended (its `Closed` event), once it has.
    pub fn closed(&self) -> Option<&Option<crate::proto::ConnError>> {
        self.check.closed()
    }

    /// Record a zero-copy offer the engine accepted.
    fn offered(&mut self, r: Result<(), String>) {
        if let Err(broken) = r {
            panic!("engine event rule broken: {broken}");
        }
    }

    fn on_sent(&mut self, token: u64, bytes: usize) {
        let Some((t, mut mr, grant, data)) = self.src.pop_front() else {
            panic!("ZcopySent without a source")
        };
        mr.revoke(&grant).expect("revoke the source's grant");
        assert_eq!(t, token, "ZcopySent out of order");
        assert!(bytes <= data.len());
        assert!(
            self.redo.is_empty() || bytes == 0,
            "a source after a short one reported {bytes} bytes sent"
        );
        self.sent += bytes as u64;
        // The rest goes again, first (a short write), and so does every later source (they
        // complete with 0 after a short one).
        self.redo.extend_from_slice(&data[bytes..]);
        if self.src.is_empty() && !self.redo.is_empty() {
            let mut rest = std::mem::take(&mut self.redo);
            rest.extend_from_slice(&self.pending);
            self.pending = rest;
        }
    }

    fn on_received(&mut self, token: u64, bytes: usize) {
        let Some((t, mut mr, grant)) = self.sink.take() else {
            panic!("ZcopyReceived without a sink")
        };
        mr.revoke(&grant).expect("revoke the sink's grant");
        assert_eq!(t, token);
        assert!(bytes <= grant.len);
        let mut got = vec![0u8; bytes];
        mr.read(GUARD, &mut got);
        self.check(&got);
    }

    fn check(&mut self, got: &[u8]) {
        let mut want = vec![0u8; got.len()];
        self.expect.fill(&mut want);
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            let end = (i + 16).min(got.len());
            panic!(
                "stream corrupted at byte {} (piece of {} bytes): got {:02x?}, want {:02x?}",
                self.received + i as u64,
                got.len(),
                &got[i..end],
                &want[i..end]
            );
        }
        self.received += got.len() as u64;
    }

    fn write_some(&mut self, d: &mut Driver<P>, now: Instant, id: ConnId) {
        loop {
            if self.src.len() >= self.src_window.max(1) || !self.redo.is_empty() {
                return;
            }
            let generated = self.sent
                + self.pending.len() as u64
                + self.src.iter().map(|s| s.3.len() as u64).sum::<u64>();
            if self.pending.is_empty() {
                if generated >= self.to_send {
                    // Shut only once every zero-copy send is done (a short one sends again).
                    if !self.shut && !self.keep_open && self.src.is_empty() {
                        match d.shutdown(now, id, Shutdown::Write) {
                            Ok(()) => self.shut = true,
                            Err(e) => {
                                self.errors.push(e);
                                self.shut = true;
                            }
                        }
                    }
                    return;
                }
                let n = (self.sizes.random_range(1..=self.max_msg) as u64)
                    .min(self.to_send - generated);
                self.pending.resize(n as usize, 0);
                self.out.fill(&mut self.pending);
            }
            if self.mode.src() && self.pending.len() >= self.zcopy_min {
                let p = d.provider().clone();
                // Least access: the peer may read the source's bytes, only them (not the
                // guard bytes around them), through a grant taken once they are in place.
                let len = self.pending.len();
                let mut mr = p.reg_mr(len + 2 * GUARD, Access::empty()).expect("reg");
                mr.write(GUARD, &self.pending);
                let grant = mr
                    .advertise(GUARD, len, Access::REMOTE_READ)
                    .expect("grant remote read");
                let src = ZSrc {
                    addr: grant.addr,
                    len: len as u32,
                    lkey: grant.lkey,
                    rkey: grant.rkey,
                };
                let token = self.next_token;
                match d.write_zcopy(now, id, src, token) {
                    Ok(()) => {
                        self.next_token += 1;
                        let r = self.check.offer_src(token, len);
                        self.offered(r);
                        let data = std::mem::take(&mut self.pending);
                        self.src.push_back((token, mr, grant, data));
                        continue;
                    }
                    Err(CallError::WouldBlock) => return,
                    Err(e) => {
                        self.errors.push(e);
                        return;
                    }
                }
            }
            match d.write(now, id, &self.pending) {
                Ok(n) => {
                    self.pending.drain(..n);
                    self.sent += n as u64;
                }
                Err(CallError::WouldBlock) => return,
                Err(e) => {
                    self.errors.push(e);
                    return;
                }
            }
        }
    }

    fn read_some(&mut self, d: &mut Driver<P>, now: Instant, id: ConnId) {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            if self.eof || self.sink.is_some() {
                return;
            }
            if self.mode.sink() && self.sizes.random_bool(0.5) {
                let len = self.sizes.random_range(self.zcopy_min..=4 * self.zcopy_min);
                let p = d.provider().clone();
                let mut mr = p.reg_mr(len + 2 * GUARD, Access::LOCAL_WRITE).expect("reg");
                // The peer may write the sink's bytes (SinkAvail), only them; an RDMA Read of
                // its source lands there too.
                let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::READ_SINK;
                let grant = mr
                    .advertise(GUARD, len, access)
                    .expect("grant remote write");
                let sink = ZSink {
                    addr: grant.addr,
                    len: len as u32,
                    lkey: grant.lkey,
                    rkey: grant.rkey,
                };
                let token = self.next_token;
                match d.read_zcopy(now, id, sink, token) {
                    Ok(ZRecv::Pending) => {
                        self.next_token += 1;
                        let r = self.check.offer_sink(token, len);
                        self.offered(r);
                        self.sink = Some((token, mr, grant));
                        return;
                    }
                    Ok(ZRecv::Copy) => mr.revoke(&grant).expect("revoke the sink's grant"),
                    Err(CallError::WouldBlock) => return,
                    Err(e) => {
                        self.errors.push(e);
                        return;
                    }
                }
            }
            let n = self.sizes.random_range(1..=buf.len());
            match d.read(now, id, &mut buf[..n]) {
                Ok(0) => {
                    self.eof = true;
                    return;
                }
                Ok(k) => {
                    let got = buf[..k].to_vec();
                    self.check(&got);
                }
                Err(CallError::WouldBlock) => return,
                Err(e) => {
                    self.errors.push(e);
                    return;
                }
            }
        }
    }
}

/// Pump both applications (A's on `ids.0`, B's on `ids.1`) until each has read the other's
/// whole stream up to EOF, failing on any call error. False if `limit_ns` passed first.
pub fn run_duplex(
    p: &mut super::pair::Pair,
    ids: (ConnId, ConnId),
    x: &mut App<SimProvider>,
    y: &mut App<SimProvider>,
    limit_ns: u64,
) -> bool {
    p.run_until(limit_ns, |p| {
        let now = p.now();
        x.pump(&mut p.a, now, ids.0);
        y.pump(&mut p.b, now, ids.1);
        assert!(x.errors.is_empty(), "A's calls failed: {:?}", x.errors);
        assert!(y.errors.is_empty(), "B's calls failed: {:?}", y.errors);
        x.eof && y.eof
    })
}

/// [`run_duplex`] that must finish within `limit_ns` with each side having read `bytes`: panics
/// otherwise, with `what`, both sides' counts and both connections' state.
pub fn run_duplex_all(
    p: &mut super::pair::Pair,
    ids: (ConnId, ConnId),
    x: &mut App<SimProvider>,
    y: &mut App<SimProvider>,
    limit_ns: u64,
    bytes: u64,
    what: &str,
) {
    let ok = run_duplex(p, ids, x, y, limit_ns);
    assert!(
        ok,
        "transfer stalled ({what}): A sent {} got {}, B sent {} got {}\nA: {}\nB: {}",
        x.sent,
        x.received,
        y.sent,
        y.received,
        p.a.conn(ids.0).map(|c| c.debug_state()).unwrap_or_default(),
        p.b.conn(ids.1).map(|c| c.debug_state()).unwrap_or_default()
    );
    assert_eq!((x.received, y.received), (bytes, bytes), "{what}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::pair::Pair;
    use crate::proto::{Config, ConnError};

    const SEC: u64 = 1_000_000_000;

    /// The App checks what it takes: an event after `Closed` fails the test.
    #[test]
    #[should_panic(expected = "engine event rule broken: Urgent after Closed(None)")]
    fn an_event_after_closed_fails_the_app() {
        let mut app: App = App::builder(Mode::BCopy).build();
        app.take(vec![Event::Connected, Event::Closed(None)]);
        app.take(vec![Event::Urgent]);
    }

    /// A duplex in both zero-copy directions that A aborts once B has read 1 MiB, with zero-copy
    /// sources and sinks outstanding: both connections end in an error, each having reported
    /// every one of them first (the App checks).
    fn abort_mid_transfer(may_fail: bool) -> (App, App) {
        let mut p = Pair::new(1, Config::default());
        let (a, b) = p.connect();
        let (mut x, mut y) = Duplex {
            mode: Mode::Both,
            bytes: 64 << 20,
            seed: 1,
            max_msg: 256 * 1024,
        }
        .apps();
        x.may_fail = may_fail;
        y.may_fail = may_fail;
        let mut aborted = false;
        let mut outstanding = 0;
        let done = p.run_until(10 * SEC, |p| {
            let now = p.now();
            x.pump(&mut p.a, now, a);
            y.pump(&mut p.b, now, b);
            if !aborted && y.received > 1 << 20 {
                outstanding = x.check.outstanding() + y.check.outstanding();
                p.a.abort(now, a);
                aborted = true;
            }
            x.closed().is_some() && y.closed().is_some()
        });
        assert!(done && aborted, "A: {:?}, B: {:?}", x.closed(), y.closed());
        assert!(outstanding > 0, "nothing was outstanding at the abort");
        (x, y)
    }

    #[test]
    fn an_abort_the_test_allows_for_passes() {
        let (x, y) = abort_mid_transfer(true);
        assert!(matches!(x.closed(), Some(Some(_))), "{:?}", x.closed());
        assert_eq!(y.closed(), Some(&Some(ConnError::Reset)));
        assert!(y.received < 64 << 20);
    }

    /// The same abort in a test that did not say the connection may fail: the App fails it.
    #[test]
    #[should_panic(expected = "the test did not say it may")]
    fn an_abort_the_test_did_not_expect_fails_it() {
        abort_mid_transfer(false);
    }
}
