//! One side of a soak session: a writer thread sends its direction's stream in random pieces
//! in one of the write modes while the calling thread reads and checks the other direction's
//! stream in one of the read modes. Both count what they did in a [`Ctl`] that the watchdog
//! and the fault scheduler look at; its `close` flag makes both stop at their next piece and
//! drop their handles (a close in the middle of the transfer).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sdp_core::socket::{PendingSend, RegisteredBuf, SdpStream};

use crate::pattern;

/// Largest piece written or read at once (and the size of every registered buffer).
pub const PIECE_MAX: usize = 4 << 20;

static START: OnceLock<Instant> = OnceLock::new();

/// Milliseconds since the process started (monotonic).
pub fn now_ms() -> u64 {
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// How a side writes its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxMode {
    /// Plain writes, zero copy on (large blocking writes go by zero copy).
    Auto,
    /// Plain writes, zero copy off: every byte through the connection's buffers.
    Bcopy,
    /// `send_registered` from a registered buffer, one at a time.
    Zcopy,
    /// `send_registered_async`: up to `depth` registered buffers in flight.
    Async,
}

pub const TX_MODES: [TxMode; 4] = [TxMode::Auto, TxMode::Bcopy, TxMode::Zcopy, TxMode::Async];

impl TxMode {
    pub fn name(self) -> &'static str {
        match self {
            TxMode::Auto => "auto",
            TxMode::Bcopy => "bcopy",
            TxMode::Zcopy => "zcopy",
            TxMode::Async => "async",
        }
    }
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn from_index(i: u8) -> Option<TxMode> {
        TX_MODES.get(i as usize).copied()
    }
}

/// How a side reads its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxMode {
    /// Plain reads into ordinary memory.
    Plain,
    /// `recv_registered` into a registered buffer (a peer's zero-copy source lands there).
    Registered,
}

pub const RX_MODES: [RxMode; 2] = [RxMode::Plain, RxMode::Registered];

impl RxMode {
    pub fn name(self) -> &'static str {
        match self {
            RxMode::Plain => "plain",
            RxMode::Registered => "registered",
        }
    }
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn from_index(i: u8) -> Option<RxMode> {
        RX_MODES.get(i as usize).copied()
    }
}

/// What one side does in a session.
#[derive(Debug, Clone, Copy)]
pub struct SideSpec {
    pub tx_seed: u64,
    pub tx_len: u64,
    pub tx_mode: TxMode,
    /// Registered sends in flight at most (async mode).
    pub depth: usize,
    pub rx_seed: u64,
    pub rx_len: u64,
    pub rx_mode: RxMode,
}

/// Live counters of one side of a session.
#[derive(Debug, Default)]
pub struct Ctl {
    pub tx: AtomicU64,
    pub rx: AtomicU64,
    /// `now_ms()` of the last byte moved (or of the start).
    pub last_progress: AtomicU64,
    /// Stop at the next piece and drop the stream (close mid-transfer).
    pub close: AtomicBool,
    /// With `close`: reset the connection (SO_LINGER {1, 0}) instead of closing it.
    pub reset: AtomicBool,
    pub tx_done: AtomicBool,
    pub rx_done: AtomicBool,
}

impl Ctl {
    pub fn new() -> Arc<Ctl> {
        let c = Ctl::default();
        c.last_progress.store(now_ms(), Ordering::Relaxed);
        Arc::new(c)
    }
    fn progress(&self) {
        self.last_progress.store(now_ms(), Ordering::Relaxed);
    }
    pub fn done(&self) -> bool {
        self.tx_done.load(Ordering::Relaxed) && self.rx_done.load(Ordering::Relaxed)
    }
    pub fn closing(&self) -> bool {
        self.close.load(Ordering::Relaxed)
    }
}

/// How a direction ended on this side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// Writer: every byte accepted and the write half shut. Reader: EOF right after the last byte.
    Ok,
    /// Reader: EOF before the last byte.
    ShortEof,
    /// We stopped on a close request.
    Closed,
    /// An error (its kind, as `io::ErrorKind` prints it, or a description).
    Err(String),
}

impl End {
    pub fn label(&self) -> String {
        match self {
            End::Ok => "ok".into(),
            End::ShortEof => "eof".into(),
            End::Closed => "closed".into(),
            End::Err(e) => format!("err:{}", e.replace(char::is_whitespace, "_")),
        }
    }
    pub fn parse(s: &str) -> End {
        match s {
            "ok" => End::Ok,
            "eof" => End::ShortEof,
            "closed" => End::Closed,
            other => End::Err(other.strip_prefix("err:").unwrap_or(other).to_string()),
        }
    }
}

/// What one side of a session did.
#[derive(Debug, Clone)]
pub struct SideResult {
    /// Bytes the write calls accepted (async: completed).
    pub tx: u64,
    pub tx_end: End,
    /// Bytes read, all of them checked.
    pub rx: u64,
    /// Read bytes that differ from the stream.
    pub bad: u64,
    pub first_bad: Option<u64>,
    /// Bytes read beyond the stream's length (each counts as bad).
    pub overrun: u64,
    pub rx_end: End,
}

fn err_label(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => format!("{:?}({n})", e.kind()),
        None => format!("{:?}:{e}", e.kind()),
    }
}

/// Piece sizes: many small, many around the zero-copy thresholds (64-128 KiB), some up to
/// [`PIECE_MAX`].
pub fn pick_piece(rng: &mut ChaCha8Rng) -> usize {
    let max = match rng.random_range(0..10u32) {
        0..=2 => 4 << 10,
        3..=5 => 160 << 10,
        6..=8 => 1 << 20,
        _ => PIECE_MAX,
    };
    rng.random_range(1..=max)
}

/// Run both directions of one side; returns once both are done.
pub fn duplex(s: SdpStream, spec: SideSpec, ctl: Arc<Ctl>) -> SideResult {
    s.set_zero_copy(spec.tx_mode != TxMode::Bcopy);
    let w = match s.try_clone() {
        Ok(w) => w,
        Err(e) => {
            ctl.tx_done.store(true, Ordering::Relaxed);
            ctl.rx_done.store(true, Ordering::Relaxed);
            return SideResult {
                tx: 0,
                tx_end: End::Err(format!("try_clone:{}", err_label(&e))),
                rx: 0,
                bad: 0,
                first_bad: None,
                overrun: 0,
                rx_end: End::Err("try_clone".into()),
            };
        }
    };
    let wctl = ctl.clone();
    let writer = std::thread::Builder::new()
        .name("soak-writer".into())
        .spawn(move || {
            let r = write_side(&w, &spec, &wctl);
            if r.1 == End::Closed && wctl.reset.load(Ordering::Relaxed) {
                // Stopped by the reset request (the reader may have finished before it).
                let _ = w.set_linger(Some(std::time::Duration::ZERO));
            }
            drop(w);
            wctl.tx_done.store(true, Ordering::Relaxed);
            r
        })
        .expect("spawn writer");
    let (rx, bad, first_bad, overrun, rx_end) = read_side(&s, &spec, &ctl);
    if rx_end == End::Closed && ctl.reset.load(Ordering::Relaxed) {
        // Stopped by the reset request; applied by whichever of the stream's handles goes
        // last (the writer's may).
        let _ = s.set_linger(Some(std::time::Duration::ZERO));
    }
    drop(s);
    ctl.rx_done.store(true, Ordering::Relaxed);
    let (tx, tx_end) = writer
        .join()
        .unwrap_or_else(|_| (0, End::Err("writer panicked".into())));
    SideResult {
        tx,
        tx_end,
        rx,
        bad,
        first_bad,
        overrun,
        rx_end,
    }
}

fn write_side(s: &SdpStream, spec: &SideSpec, ctl: &Ctl) -> (u64, End) {
    let mut sizes = ChaCha8Rng::seed_from_u64(spec.tx_seed ^ 0x5151_7e57_0000_0001);
    let mut sent = 0u64;
    let len = spec.tx_len;
    let count = |n: usize, sent: &mut u64| {
        *sent += n as u64;
        ctl.tx.fetch_add(n as u64, Ordering::Relaxed);
        ctl.progress();
    };
    match spec.tx_mode {
        TxMode::Auto | TxMode::Bcopy => {
            let mut buf = vec![0u8; PIECE_MAX];
            while sent < len {
                if ctl.closing() {
                    return (sent, End::Closed);
                }
                let n = (pick_piece(&mut sizes) as u64).min(len - sent) as usize;
                pattern::fill(spec.tx_seed, sent, &mut buf[..n]);
                let mut o = 0;
                while o < n {
                    match (&*s).write(&buf[o..n]) {
                        Ok(0) => return (sent, End::Err("write returned 0".into())),
                        Ok(k) => {
                            o += k;
                            count(k, &mut sent);
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) => return (sent, End::Err(err_label(&e))),
                    }
                }
            }
        }
        TxMode::Zcopy => {
            let mut rb = match s.register(PIECE_MAX) {
                Ok(b) => b,
                Err(e) => return (0, End::Err(format!("register:{}", err_label(&e)))),
            };
            while sent < len {
                if ctl.closing() {
                    return (sent, End::Closed);
                }
                let n = (pick_piece(&mut sizes) as u64).min(len - sent) as usize;
                pattern::fill(spec.tx_seed, sent, &mut rb.as_mut_slice()[..n]);
                let mut o = 0;
                while o < n {
                    match s.send_registered(&mut rb, o..n) {
                        Ok(0) => return (sent, End::Err("send_registered returned 0".into())),
                        Ok(k) => {
                            o += k;
                            count(k, &mut sent);
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) => return (sent, End::Err(err_label(&e))),
                    }
                }
            }
        }
        TxMode::Async => {
            let depth = spec.depth.max(1);
            let mut inflight: VecDeque<(PendingSend, usize)> = VecDeque::new();
            let mut free: Vec<RegisteredBuf> = Vec::new();
            // Bytes handed to send_registered_async so far (`sent` counts completed ones).
            let mut queued = 0u64;
            let finish = |p: PendingSend, n: usize, sent: &mut u64| -> Result<RegisteredBuf, End> {
                match p.wait() {
                    Ok((b, k)) if k == n => {
                        count(k, sent);
                        Ok(b)
                    }
                    Ok((_, k)) => Err(End::Err(format!("async send of {n} completed {k}"))),
                    Err(e) => Err(End::Err(err_label(&e))),
                }
            };
            while queued < len {
                if ctl.closing() {
                    break;
                }
                let mut b = match free.pop() {
                    Some(b) => b,
                    None if inflight.len() < depth => match s.register(PIECE_MAX) {
                        Ok(b) => b,
                        Err(e) => return (sent, End::Err(format!("register:{}", err_label(&e)))),
                    },
                    None => {
                        let (p, n) = inflight.pop_front().expect("depth >= 1");
                        match finish(p, n, &mut sent) {
                            Ok(b) => b,
                            Err(end) => return (sent, end),
                        }
                    }
                };
                let n = (pick_piece(&mut sizes) as u64).min(len - queued) as usize;
                pattern::fill(spec.tx_seed, queued, &mut b.as_mut_slice()[..n]);
                match s.send_registered_async(b, 0..n) {
                    Ok(p) => {
                        queued += n as u64;
                        if p.is_done() {
                            match finish(p, n, &mut sent) {
                                Ok(b) => free.push(b),
                                Err(end) => return (sent, end),
                            }
                        } else {
                            inflight.push_back((p, n));
                        }
                    }
                    Err(e) => return (sent, End::Err(err_label(&e))),
                }
            }
            while let Some((p, n)) = inflight.pop_front() {
                if let Err(end) = finish(p, n, &mut sent) {
                    return (sent, end);
                }
            }
            if ctl.closing() && sent < len {
                return (sent, End::Closed);
            }
        }
    }
    match s.shutdown(Shutdown::Write) {
        Ok(()) => (sent, End::Ok),
        Err(e) => (sent, End::Err(format!("shutdown:{}", err_label(&e)))),
    }
}

type ReadOutcome = (u64, u64, Option<u64>, u64, End);

fn read_side(s: &SdpStream, spec: &SideSpec, ctl: &Ctl) -> ReadOutcome {
    let mut sizes = ChaCha8Rng::seed_from_u64(spec.rx_seed ^ 0x5151_7e57_0000_0002);
    let (seed, len) = (spec.rx_seed, spec.rx_len);
    let mut got = 0u64;
    let mut bad = 0u64;
    let mut first_bad = None;
    let mut overrun = 0u64;
    let mut take = |data: &[u8], got: &mut u64| {
        let n = data.len() as u64;
        let inside = n.min(len.saturating_sub(*got));
        let (b, f) = pattern::check(seed, *got, &data[..inside as usize]);
        bad += b;
        if first_bad.is_none() {
            first_bad = f;
        }
        overrun += n - inside;
        *got += n;
        ctl.rx.fetch_add(n, Ordering::Relaxed);
        ctl.progress();
    };
    let mut plain = Vec::new();
    let mut reg = None;
    match spec.rx_mode {
        RxMode::Plain => plain = vec![0u8; PIECE_MAX],
        RxMode::Registered => match s.register(PIECE_MAX) {
            Ok(b) => reg = Some(b),
            Err(e) => {
                let end = End::Err(format!("register:{}", err_label(&e)));
                return (0, 0, None, 0, end);
            }
        },
    }
    let end = loop {
        if ctl.closing() {
            break End::Closed;
        }
        let cap = pick_piece(&mut sizes);
        let r = match reg.as_mut() {
            Some(rb) => s.recv_registered(rb, 0..cap).inspect(|&n| {
                if n > 0 {
                    take(&rb.as_slice()[..n], &mut got);
                }
            }),
            None => (&*s).read(&mut plain[..cap]).inspect(|&n| {
                if n > 0 {
                    take(&plain[..n], &mut got);
                }
            }),
        };
        match r {
            Ok(0) if got >= len => break End::Ok,
            Ok(0) => break End::ShortEof,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => break End::Err(err_label(&e)),
        }
    };
    (got, bad, first_bad, overrun, end)
}
