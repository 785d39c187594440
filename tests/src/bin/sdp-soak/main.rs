//! sdp-soak: move checksummed random data over SDP between processes for a long time, in every
//! mode, with faults injected on a schedule, and report what moved, what was verified, which
//! faults were survived and what leaked (issue 14). `tests/soak` builds and runs it.
//!
//! ```text
//! sdp-soak [--gib N] [--seconds S] [--workers W] [--seed X] [--faults on|off] [--json] ...
//! ```
//!
//! The parent listens and runs one session at a time with each of W worker processes (this
//! binary again, `sdp-soak worker ...`), which connect, say hello, and get a session header:
//! two stream seeds and lengths (0 to `--max-session` bytes each way) and the modes. Both sides
//! then send their stream and read and check the other's at once, in random piece sizes: writes
//! in auto (zero copy on), bcopy (off), zcopy (`send_registered`) or async
//! (`send_registered_async`, several in flight) mode, reads plain or into a registered buffer
//! (`recv_registered`). Every byte read is compared with the stream (`pattern`); a worker
//! reports its side of each session on stdout (`R ...`).
//!
//! Faults (`--faults on`, one every `--fault-interval` seconds, on a session under way, in
//! turn): `kill` (SIGKILL of the worker: the parent's side must end, by EOF or an error, within
//! `--fault-bound` seconds), `stop` (SIGSTOP, 50-1500 ms, SIGCONT: the session must complete and
//! verify), `pclose` (the parent drops its end mid-transfer: the worker must see EOF or an error
//! within the bound), `preset` (the same with SO_LINGER {1, 0}: a reset), `wclose` (the worker drops its end: the same for the parent), and with
//! `--fault-cmd CMD` (e.g. the rig's link removal) `cmd`, which runs CMD and lets every session
//! under way fail (within the bound of CMD's start), and those that start while it runs; one
//! of those still under way when CMD is over was not ended by it and is unfaulted again. A
//! killed worker is replaced. A side that moves no byte for `--hang-secs`, or
//! does not end within the bound after a fault, is a hang (the worker is then killed to free
//! it; first both ends' connections are printed as `sdpstat` shows them, and `--hang-cmd CMD`
//! runs, e.g. the rig's `rdma res show qp`). Every session without a fault that ended it must
//! deliver every byte both ways, then EOF.
//!
//! At the end the parent compares its open fds and its stack's connections, registered bytes
//! and registered regions with what it had before the first session (they must come back), and
//! looks for worker processes left; each worker does the same for itself when it stops (`W
//! ...`). Exit status 0 only with no bad byte, no hang, no failed session and no leak.

mod pattern;
mod xfer;

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sdp_core::proto::Config;
use sdp_core::socket::{Options, SdpListener, SdpStream, Stack, Transport};
use sdp_core::verbs::shm::ShmProvider;

use xfer::{now_ms, Ctl, End, RxMode, SideResult, SideSpec, TxMode, RX_MODES, TX_MODES};

const HELLO_MAGIC: u32 = 0x534f_4b48; // "SOKH"
const HEADER_MAGIC: u32 = 0x534f_414b; // "SOAK"
const HELLO_LEN: usize = 16;
const HEADER_LEN: usize = 64;

/// The monotonic clock in ms (the uptime of the rig's guest), the trace's times: they line up
/// with the times a `--fault-cmd` may log.
fn mono_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: one live timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// The last [`TRACE_KEEP`] events (sessions started and ended, faults, commands), printed
/// when the soak fails.
static TRACE: Mutex<VecDeque<String>> = Mutex::new(VecDeque::new());
const TRACE_KEEP: usize = 40;

/// One event of the trace.
fn ev(msg: String) {
    let mut t = TRACE.lock().unwrap();
    if t.len() == TRACE_KEEP {
        t.pop_front();
    }
    t.push_back(format!("{:.3} {msg}", mono_ms() as f64 / 1000.0));
}

fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("sdp-soak: {msg}");
    std::process::exit(2)
}

// ---------------------------------------------------------------------------------------------
// Arguments

#[derive(Debug, Clone)]
struct Args {
    gib: f64,
    seconds: f64,
    workers: usize,
    seed: u64,
    /// Fault kinds to inject, in turn (empty: none).
    faults: Vec<Fault>,
    fault_interval: f64,
    /// Modes sessions pick from.
    tx_modes: Vec<TxMode>,
    rx_modes: Vec<RxMode>,
    fault_bound: u64,
    hang_secs: u64,
    max_session: u64,
    json: bool,
    quiet: bool,
    /// `shm`: a shm stack of the soak's own (its counts are checked for leaks); `sdp`: the
    /// stack the socket layer picks (`SDP_PROVIDERS`; the rig's rdma), fds checked only.
    transport: String,
    listen: String,
    source_ip: Option<IpAddr>,
    fault_cmd: Option<String>,
    hang_cmd: Option<String>,
}

const USAGE: &str = "usage: sdp-soak [--gib N] [--seconds S] [--workers W] [--seed X] \
[--faults on|off|KIND,...] [--fault-interval SECS] [--tx-modes auto,bcopy,zcopy,async] \
[--rx-modes plain,registered] [--fault-bound SECS] [--hang-secs SECS] \
[--max-session BYTES] [--transport shm|sdp] [--listen IP:PORT] [--source-ip IP] \
[--fault-cmd CMD] [--hang-cmd CMD] [--json] [--quiet]";

fn parse_bytes(s: &str) -> Result<u64, String> {
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'k' | 'K')) => (&s[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&s[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("bad size {s:?}"))
}

fn parse_args(v: &[String]) -> Result<Args, String> {
    let mut a = Args {
        gib: 1.0,
        seconds: 60.0,
        workers: 3,
        seed: 1,
        faults: vec![
            Fault::Kill,
            Fault::Stop,
            Fault::PClose,
            Fault::PReset,
            Fault::WClose,
        ],
        fault_interval: 1.0,
        tx_modes: TX_MODES.to_vec(),
        rx_modes: RX_MODES.to_vec(),
        fault_bound: 10,
        hang_secs: 30,
        max_session: 256 << 20,
        json: false,
        quiet: false,
        transport: "shm".into(),
        listen: "127.0.0.1:0".into(),
        source_ip: None,
        fault_cmd: None,
        hang_cmd: None,
    };
    let mut i = 0;
    while i < v.len() {
        let flag = v[i].as_str();
        let mut val = || -> Result<String, String> {
            i += 1;
            v.get(i)
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        let num = |s: String| -> Result<f64, String> {
            match s.parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(format!("{flag}: {s:?} is not a positive number")),
            }
        };
        match flag {
            "--gib" => a.gib = num(val()?)?,
            "--seconds" => a.seconds = num(val()?)?,
            "--workers" => {
                a.workers = val()?
                    .parse()
                    .ok()
                    .filter(|&n| (1..=64).contains(&n))
                    .ok_or("--workers: 1 to 64")?
            }
            "--seed" => a.seed = val()?.parse().map_err(|_| "--seed: a number")?,
            "--faults" => {
                a.faults = match val()?.as_str() {
                    "on" => vec![
                        Fault::Kill,
                        Fault::Stop,
                        Fault::PClose,
                        Fault::PReset,
                        Fault::WClose,
                    ],
                    "off" => Vec::new(),
                    list => list
                        .split(',')
                        .map(|k| {
                            FAULTS
                                .into_iter()
                                .find(|f| f.name() == k)
                                .ok_or_else(|| format!("--faults: unknown kind {k:?}"))
                        })
                        .collect::<Result<_, _>>()?,
                }
            }
            "--fault-interval" => a.fault_interval = num(val()?)?,
            "--tx-modes" => {
                a.tx_modes = val()?
                    .split(',')
                    .map(|k| {
                        TX_MODES
                            .into_iter()
                            .find(|m| m.name() == k)
                            .ok_or_else(|| format!("--tx-modes: unknown mode {k:?}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--rx-modes" => {
                a.rx_modes = val()?
                    .split(',')
                    .map(|k| {
                        RX_MODES
                            .into_iter()
                            .find(|m| m.name() == k)
                            .ok_or_else(|| format!("--rx-modes: unknown mode {k:?}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--fault-bound" => a.fault_bound = num(val()?)?.ceil() as u64,
            "--hang-secs" => a.hang_secs = num(val()?)?.ceil() as u64,
            "--max-session" => a.max_session = parse_bytes(&val()?)?.max(1),
            "--transport" => {
                a.transport = val()?;
                if a.transport != "shm" && a.transport != "sdp" {
                    return Err("--transport: shm or sdp".into());
                }
            }
            "--listen" => a.listen = val()?,
            "--source-ip" => {
                a.source_ip = Some(val()?.parse().map_err(|_| "--source-ip: an IP address")?)
            }
            "--fault-cmd" => a.fault_cmd = Some(val()?),
            "--hang-cmd" => a.hang_cmd = Some(val()?),
            "--json" => a.json = true,
            "--quiet" => a.quiet = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0)
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
        i += 1;
    }
    if a.fault_cmd.is_some() && !a.faults.is_empty() && !a.faults.contains(&Fault::Cmd) {
        a.faults.push(Fault::Cmd);
    }
    if a.faults.contains(&Fault::Cmd) && a.fault_cmd.is_none() {
        return Err("--faults cmd needs --fault-cmd CMD".into());
    }
    Ok(a)
}

// ---------------------------------------------------------------------------------------------
// Wire: the worker's hello and the session header (both before the streams' bytes).

/// What the parent decided for one session.
#[derive(Debug, Clone, Copy)]
struct Plan {
    session: u64,
    p2w_seed: u64,
    p2w_len: u64,
    w2p_seed: u64,
    w2p_len: u64,
    parent_tx: TxMode,
    parent_rx: RxMode,
    parent_depth: u8,
    worker_tx: TxMode,
    worker_rx: RxMode,
    worker_depth: u8,
}

impl Plan {
    fn header(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&HEADER_MAGIC.to_be_bytes());
        h[4..6].copy_from_slice(&1u16.to_be_bytes());
        h[8..16].copy_from_slice(&self.session.to_be_bytes());
        h[16..24].copy_from_slice(&self.p2w_seed.to_be_bytes());
        h[24..32].copy_from_slice(&self.p2w_len.to_be_bytes());
        h[32..40].copy_from_slice(&self.w2p_seed.to_be_bytes());
        h[40..48].copy_from_slice(&self.w2p_len.to_be_bytes());
        h[48] = self.worker_tx.index() as u8;
        h[49] = self.worker_rx.index() as u8;
        h[50] = self.worker_depth;
        h
    }

    fn stop_header() -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&HEADER_MAGIC.to_be_bytes());
        h[4..6].copy_from_slice(&1u16.to_be_bytes());
        h
    }

    /// The worker's side of a header (session 0: stop).
    fn worker_side(h: &[u8; HEADER_LEN]) -> Result<(u64, SideSpec), String> {
        let u = |r: std::ops::Range<usize>| u64::from_be_bytes(h[r].try_into().unwrap());
        if u32::from_be_bytes(h[0..4].try_into().unwrap()) != HEADER_MAGIC {
            return Err("bad header magic".into());
        }
        let tx_mode = TxMode::from_index(h[48]).ok_or("bad tx mode")?;
        let rx_mode = RxMode::from_index(h[49]).ok_or("bad rx mode")?;
        Ok((
            u(8..16),
            SideSpec {
                tx_seed: u(32..40),
                tx_len: u(40..48),
                tx_mode,
                depth: h[50].max(1) as usize,
                rx_seed: u(16..24),
                rx_len: u(24..32),
                rx_mode,
            },
        ))
    }

    fn parent_side(&self) -> SideSpec {
        SideSpec {
            tx_seed: self.p2w_seed,
            tx_len: self.p2w_len,
            tx_mode: self.parent_tx,
            depth: self.parent_depth as usize,
            rx_seed: self.w2p_seed,
            rx_len: self.w2p_len,
            rx_mode: self.parent_rx,
        }
    }

    fn describe(&self) -> String {
        format!(
            "session {} p2w seed {:#x} {} B {}->{} | w2p seed {:#x} {} B {}->{} (depths {}/{})",
            self.session,
            self.p2w_seed,
            self.p2w_len,
            self.parent_tx.name(),
            self.worker_rx.name(),
            self.w2p_seed,
            self.w2p_len,
            self.worker_tx.name(),
            self.parent_rx.name(),
            self.parent_depth,
            self.worker_depth
        )
    }
}

/// Stream lengths: some empty, a quarter up to 64 KiB, the rest 64 KiB up to `max`
/// (log-uniform, so every size class shows up).
fn pick_len(rng: &mut ChaCha8Rng, max: u64) -> u64 {
    if rng.random_ratio(1, 20) {
        return 0;
    }
    let top = max.ilog2();
    let bits = if rng.random_ratio(1, 4) {
        rng.random_range(0..=top.min(16))
    } else {
        rng.random_range(top.min(16)..=top)
    };
    rng.random_range(1..=(1u64 << bits)).min(max)
}

// ---------------------------------------------------------------------------------------------
// Resources (leak check)

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Res {
    fds: usize,
    conns: usize,
    reg_bytes: usize,
    regions: usize,
}

/// Open fds, verbs contexts left out ([`is_context_fd`]).
fn open_fds() -> usize {
    fd_targets().iter().filter(|t| !is_context_fd(t)).count()
}

/// What the open fds are, by kind (`anon_inode:[eventfd]`, `/dev/infiniband/uverbs0`,
/// `socket:`...), counted: a leak report says what leaked.
fn fd_kinds() -> std::collections::BTreeMap<String, usize> {
    let mut kinds = std::collections::BTreeMap::new();
    for t in fd_targets() {
        // socket:[1234], pipe:[5678]: the kind without the inode.
        let kind = match t.find(":[") {
            Some(i)
                if t[i + 2..]
                    .trim_end_matches(']')
                    .bytes()
                    .all(|b| b.is_ascii_digit()) =>
            {
                t[..i + 1].to_string()
            }
            _ => t,
        };
        *kinds.entry(kind).or_insert(0) += 1;
    }
    kinds
}

fn fd_targets() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            std::fs::read_link(e.path()).map_or_else(|_| "?".into(), |t| t.to_string_lossy().into())
        })
        .collect()
}

/// An fd of a verbs context (its command fd, or its async event fd). librdmacm keeps one
/// context per device it has opened, for the life of the device, and a look at the device
/// list (the stack has one after losing a device) opens every device there: these are not
/// counted as the process's fds but checked by [`contexts_wrong`].
fn is_context_fd(t: &str) -> bool {
    t.starts_with("/dev/infiniband/uverbs") || t == "anon_inode:[infinibandevent]"
}

/// What is wrong with the verbs contexts the process holds: more than one on a device, or one
/// on a device that is gone (which `rdma link delete` would wait for).
fn contexts_wrong() -> Option<String> {
    let mut seen = HashSet::new();
    let mut wrong = Vec::new();
    for t in fd_targets() {
        if !t.starts_with("/dev/infiniband/uverbs") {
            continue;
        }
        if t.ends_with("(deleted)") || !std::path::Path::new(&t).exists() {
            wrong.push(format!("{t}: device gone"));
        } else if !seen.insert(t.clone()) {
            wrong.push(format!("{t}: a second context"));
        }
    }
    (!wrong.is_empty()).then(|| wrong.join(", "))
}

/// The kinds of fd there are more of now than in `base`.
fn fds_over(base: &std::collections::BTreeMap<String, usize>) -> String {
    fd_kinds()
        .into_iter()
        .filter(|(k, _)| !is_context_fd(k))
        .filter_map(|(k, n)| {
            let b = base.get(&k).copied().unwrap_or(0);
            (n > b).then(|| format!("{} x{}", k, n - b))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn measure(stack: Option<&(Stack, ShmProvider)>) -> Res {
    Res {
        fds: open_fds(),
        conns: stack.map_or(0, |s| s.0.conn_count()),
        reg_bytes: stack.map_or(0, |s| s.0.registered_bytes()),
        regions: stack.map_or(0, |s| s.1.registered_regions()),
    }
}

/// Wait (up to `limit`) until the resources are back to `base`; what is still above it.
fn settle(stack: Option<&(Stack, ShmProvider)>, base: Res, limit: Duration) -> Res {
    let t = std::time::Instant::now();
    loop {
        let now = measure(stack);
        let over = Res {
            fds: now.fds.saturating_sub(base.fds),
            conns: now.conns.saturating_sub(base.conns),
            reg_bytes: now.reg_bytes.saturating_sub(base.reg_bytes),
            regions: now.regions.saturating_sub(base.regions),
        };
        if over == Res::default() || t.elapsed() >= limit {
            return over;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The resources once they stop changing (a closed connection lets go within moments).
fn steady(stack: Option<&(Stack, ShmProvider)>) -> Res {
    let mut last = measure(stack);
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(50));
        let now = measure(stack);
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

fn own_stack() -> (Stack, ShmProvider) {
    let p = ShmProvider::new().unwrap_or_else(|e| die(format!("shm provider: {e}")));
    let s = Stack::with_provider(p.clone(), Config::default())
        .unwrap_or_else(|e| die(format!("stack: {e}")));
    (s, p)
}

/// Child processes of this process still there (live or zombie).
fn children_left() -> Vec<u32> {
    let me = std::process::id();
    let mut v = Vec::new();
    if let Ok(d) = std::fs::read_dir("/proc") {
        for e in d.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(me) {
                v.push(pid);
            }
        }
    }
    v
}

fn signal(pid: u32, sig: i32) {
    if pid > 0 {
        // SAFETY: kill(2) on a pid of a child we started; no memory involved.
        unsafe { libc::kill(pid as i32, sig) };
    }
}

// ---------------------------------------------------------------------------------------------
// Worker

/// Per-session report line of a worker: `R key=value ...`.
#[derive(Debug, Clone)]
struct Report {
    session: u64,
    side: SideResult,
    /// The worker stopped on a close request (`wclose`).
    closed: bool,
    /// `now_ms()` of the parent when the line arrived.
    at: u64,
}

fn report_line(session: u64, r: &SideResult) -> String {
    format!(
        "R session={session} tx={} tx_end={} rx={} rx_end={} bad={} first_bad={} overrun={} closed={}",
        r.tx,
        r.tx_end.label(),
        r.rx,
        r.rx_end.label(),
        r.bad,
        r.first_bad.map_or("-".to_string(), |f| f.to_string()),
        r.overrun,
        u8::from(r.tx_end == End::Closed || r.rx_end == End::Closed),
    )
}

fn parse_report(line: &str) -> Option<Report> {
    let kv: HashMap<&str, &str> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.split_once('='))
        .collect();
    let n = |k: &str| kv.get(k).and_then(|v| v.parse::<u64>().ok());
    Some(Report {
        session: n("session")?,
        side: SideResult {
            tx: n("tx")?,
            tx_end: End::parse(kv.get("tx_end")?),
            rx: n("rx")?,
            rx_end: End::parse(kv.get("rx_end")?),
            bad: n("bad")?,
            first_bad: n("first_bad"),
            overrun: n("overrun")?,
        },
        closed: n("closed")? == 1,
        at: now_ms(),
    })
}

/// A worker's session under way: its id and counters.
type Current = Option<(u64, Arc<Ctl>)>;

fn worker_main(argv: &[String]) -> ! {
    // Die with the parent (a parent that crashes must not leave workers behind, least of all
    // stopped ones).
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    let mut addr = None;
    let mut slot = 0u32;
    let mut transport = "shm".to_string();
    let mut source_ip: Option<IpAddr> = None;
    let mut it = argv.iter();
    while let Some(f) = it.next() {
        let v = it
            .next()
            .unwrap_or_else(|| die(format!("worker: {f} needs a value")));
        match f.as_str() {
            "--addr" => addr = Some(v.clone()),
            "--slot" => slot = v.parse().unwrap_or_else(|_| die("worker: bad --slot")),
            "--transport" => transport = v.clone(),
            "--source-ip" => source_ip = v.parse().ok(),
            other => die(format!("worker: unknown argument {other}")),
        }
    }
    let addr = addr.unwrap_or_else(|| die("worker: --addr missing"));
    let stack = (transport == "shm").then(own_stack);
    let mut opts = Options::sdp_only();
    if let Some((s, _)) = &stack {
        opts = opts.with_stack(s.clone());
    }
    if let Some(ip) = source_ip {
        opts = opts.with_source_ip(ip);
    }
    // With a stack of our own the baseline is now; with the socket layer's stacks (made at
    // the first connect) it is after the first session.
    let mut base = stack.is_some().then(|| measure(stack.as_ref()));

    let stop = Arc::new(AtomicBool::new(false));
    // The session under way, and a close request for a session (it may come before the
    // worker has read that session's header).
    let current: Arc<Mutex<Current>> = Arc::new(Mutex::new(None));
    let close_req = Arc::new(AtomicU64::new(0));
    {
        let (stop, current, close_req) = (stop.clone(), current.clone(), close_req.clone());
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if let Some(id) = line
                    .strip_prefix("close ")
                    .and_then(|s| s.trim().parse().ok())
                {
                    close_req.store(id, Relaxed);
                    if let Some((cur, ctl)) = current.lock().unwrap().as_ref() {
                        if *cur == id {
                            ctl.close.store(true, Relaxed);
                        }
                    }
                }
            }
            stop.store(true, Relaxed);
        });
    }
    {
        // The worker's own watchdog (the parent's fires first, with more to say).
        let current = current.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_secs(1));
            if let Some((id, ctl)) = current.lock().unwrap().as_ref() {
                let idle = now_ms().saturating_sub(ctl.last_progress.load(Relaxed));
                if !ctl.done() && idle > 60_000 {
                    eprintln!(
                        "sdp-soak worker {slot}: session {id} made no progress for {} s (tx {} rx {}): hang",
                        idle / 1000,
                        ctl.tx.load(Relaxed),
                        ctl.rx.load(Relaxed)
                    );
                    std::process::exit(3);
                }
            }
        });
    }

    let pid = std::process::id();
    // Each connection's number, in its hello: a handshake that fails names it to the parent
    // (`H attempt=N` on stdout), whose side may have sent the session's header already.
    let mut attempt: u32 = 0;
    'sessions: while !stop.load(Relaxed) {
        attempt += 1;
        let mut tries = 0;
        let s = loop {
            match SdpStream::connect_with(addr.as_str(), &opts) {
                Ok(s) => break s,
                Err(_) if stop.load(Relaxed) => break 'sessions,
                Err(e) if tries < 100 => {
                    tries += 1;
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => die(format!("worker {slot}: connect {addr}: {e}")),
            }
        };
        if s.transport() == Transport::Tcp {
            die(format!("worker {slot}: connected over TCP"));
        }
        let mut hello = [0u8; HELLO_LEN];
        hello[0..4].copy_from_slice(&HELLO_MAGIC.to_be_bytes());
        hello[4..8].copy_from_slice(&slot.to_be_bytes());
        hello[8..12].copy_from_slice(&pid.to_be_bytes());
        hello[12..16].copy_from_slice(&attempt.to_be_bytes());
        let mut h = [0u8; HEADER_LEN];
        let got = (&s).write_all(&hello).and_then(|()| {
            s.set_read_timeout(Some(Duration::from_secs(30)))?;
            (&s).read_exact(&mut h)?;
            s.set_read_timeout(None)
        });
        if let Err(e) = got {
            eprintln!("sdp-soak worker {slot}: handshake: {e}");
            println!("H attempt={attempt}");
            continue;
        }
        let (session, spec) = Plan::worker_side(&h).unwrap_or_else(|e| die(e));
        if session == 0 {
            break;
        }
        let ctl = Ctl::new();
        *current.lock().unwrap() = Some((session, ctl.clone()));
        if close_req.load(Relaxed) == session {
            ctl.close.store(true, Relaxed);
        }
        let r = xfer::duplex(s, spec, ctl);
        println!("{}", report_line(session, &r));
        if base.is_none() {
            base = Some(steady(stack.as_ref()));
        }
        *current.lock().unwrap() = None;
    }
    let over = base.map_or(Res::default(), |b| {
        settle(stack.as_ref(), b, Duration::from_secs(10))
    });
    let leak = over != Res::default();
    println!(
        "W slot={slot} leak={} fds={} conns={} reg_bytes={} regions={}",
        u8::from(leak),
        over.fds,
        over.conns,
        over.reg_bytes,
        over.regions
    );
    let _ = std::io::stdout().flush();
    std::process::exit(if leak { 4 } else { 0 })
}

// ---------------------------------------------------------------------------------------------
// Parent

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Stop,
    PClose,
    /// As `pclose`, with SO_LINGER {1, 0}: the parent resets the connection.
    PReset,
    WClose,
    Cmd,
}

const FAULTS: [Fault; 6] = [
    Fault::Kill,
    Fault::Stop,
    Fault::PClose,
    Fault::PReset,
    Fault::WClose,
    Fault::Cmd,
];

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Stop => "stop",
            Fault::PClose => "pclose",
            Fault::PReset => "preset",
            Fault::WClose => "wclose",
            Fault::Cmd => "cmd",
        }
    }
}

struct Sess {
    plan: Plan,
    slot: usize,
    pid: u32,
    ctl: Arc<Ctl>,
    /// The fault injected into this session, and when (`now_ms`).
    fault: Mutex<Option<(Fault, u64)>>,
    /// `now_ms` when the parent's side ended (0 while under way).
    ended: AtomicU64,
    hang: AtomicBool,
    /// `now_ms` when our header went.
    started: u64,
    /// Marked with the `--fault-cmd` running when it started (not one under way at the
    /// command's start): the command may not touch it at all.
    cmd_at_start: AtomicBool,
}

struct Slot {
    pid: AtomicU32,
    stdin: Mutex<Option<ChildStdin>>,
}

#[derive(Debug, Default)]
struct Stats {
    sessions: u64,
    sessions_faulted: u64,
    failures: u64,
    /// Bytes the write calls accepted, both sides (a killed worker's are not known).
    written: u64,
    /// Bytes read by the receiving sides, both directions (every one checked).
    moved: u64,
    /// Read bytes equal to the stream (`moved` less the bad ones).
    verified: u64,
    bad: u64,
    injected: [u64; FAULTS.len()],
    survived: [u64; FAULTS.len()],
    missed: [u64; FAULTS.len()],
    hangs: u64,
    worker_crashes: u64,
    workers_spawned: u64,
    worker_leaks: u64,
    handshakes_lost: u64,
    reports_lost: u64,
    tx_mode_bytes: [u64; 4],
    rx_mode_bytes: [u64; 2],
    notes: Vec<String>,
}

impl Stats {
    fn note(&mut self, msg: String) {
        eprintln!("sdp-soak: {msg}");
        if self.notes.len() < 100 {
            self.notes.push(msg);
        }
    }
    fn fail(&mut self, msg: String) {
        self.failures += 1;
        self.note(format!("FAIL: {msg}"));
    }
}

struct Soak {
    args: Args,
    exe: PathBuf,
    addr: String,
    stopping: AtomicBool,
    rng: Mutex<ChaCha8Rng>,
    next_session: AtomicU64,
    sessions: Mutex<HashMap<u64, Arc<Sess>>>,
    slots: Vec<Slot>,
    killed: Mutex<HashSet<u32>>,
    last_kill: AtomicU64,
    reports: Mutex<HashMap<u64, Report>>,
    /// Workers' handshakes that failed (`H` lines): (pid, attempt). Their sessions' headers may
    /// have left our side, so those sessions wait for no report.
    failed_handshakes: Mutex<HashSet<(u32, u32)>>,
    /// When the last `--fault-cmd` ended (0: none yet, or one running: `cmd_running`).
    last_cmd: AtomicU64,
    reports_cv: Condvar,
    stats: Mutex<Stats>,
    /// A `--fault-cmd` is running (from the marking of the sessions under way to its end):
    /// sessions that start meanwhile may fail with it too.
    cmd_running: AtomicBool,
}

impl Soak {
    /// A worker was killed or a `--fault-cmd` ran in the last 15 s (or runs now).
    fn fault_around(&self) -> bool {
        let recent = |t: u64| t != 0 && now_ms().saturating_sub(t) <= 15_000;
        recent(self.last_kill.load(Relaxed))
            || recent(self.last_cmd.load(Relaxed))
            || self.cmd_running.load(Relaxed)
    }

    fn killed(&self, pid: u32) -> bool {
        self.killed.lock().unwrap().contains(&pid)
    }

    fn kill(&self, pid: u32) {
        if pid == 0 {
            return;
        }
        self.killed.lock().unwrap().insert(pid);
        self.last_kill.store(now_ms(), Relaxed);
        signal(pid, libc::SIGKILL);
    }

    fn new_plan(&self) -> Plan {
        let mut r = self.rng.lock().unwrap();
        let max = self.args.max_session;
        let (tx, rx) = (&self.args.tx_modes, &self.args.rx_modes);
        Plan {
            session: self.next_session.fetch_add(1, Relaxed),
            p2w_seed: r.random(),
            p2w_len: pick_len(&mut r, max),
            w2p_seed: r.random(),
            w2p_len: pick_len(&mut r, max),
            parent_tx: tx[r.random_range(0..tx.len())],
            parent_rx: rx[r.random_range(0..rx.len())],
            parent_depth: r.random_range(1..=6),
            worker_tx: tx[r.random_range(0..tx.len())],
            worker_rx: rx[r.random_range(0..rx.len())],
            worker_depth: r.random_range(1..=6),
        }
    }

    /// The hang of a session: count it once and kill its worker to free the parent's side.
    fn hang(&self, sess: &Sess, why: String) {
        if sess.hang.swap(true, Relaxed) {
            return;
        }
        {
            let mut st = self.stats.lock().unwrap();
            st.hangs += 1;
            st.note(format!(
                "HANG: {why}; {} (worker {} pid {}); parent side tx {} rx {} done tx {} rx {}",
                sess.plan.describe(),
                sess.slot,
                sess.pid,
                sess.ctl.tx.load(Relaxed),
                sess.ctl.rx.load(Relaxed),
                sess.ctl.tx_done.load(Relaxed),
                sess.ctl.rx_done.load(Relaxed),
            ));
        }
        // Both ends' engines as they stand, for the diagnosis (`sdpstat`; asked without the
        // stats lock, as the stacks answer over sockets).
        let pids = [std::process::id().to_string(), sess.pid.to_string()];
        let dump: Vec<String> = match sdp_core::socket::stat::query_all() {
            Ok(lines) => lines
                .iter()
                .filter(|l| l.get("pid").is_some_and(|p| pids.contains(p)))
                .map(|l| {
                    let get = |k: &str| l.get(k).map_or("-", String::as_str);
                    format!(
                        "  sdpstat pid {} {} {} -> {}: {}",
                        get("pid"),
                        get("id"),
                        get("local"),
                        get("peer"),
                        get("engine")
                    )
                })
                .collect(),
            Err(e) => vec![format!("  sdpstat: {e}")],
        };
        {
            let mut st = self.stats.lock().unwrap();
            for line in dump {
                st.note(line);
            }
        }
        if let Some(cmd) = &self.args.hang_cmd {
            let _ = Command::new("sh").args(["-c", cmd]).status();
        }
        self.kill(sess.pid);
    }

    fn verified_now(&self) -> u64 {
        self.stats.lock().unwrap().verified
    }
}

/// The parent's side of one connection from a worker.
fn serve(soak: Arc<Soak>, s: SdpStream) {
    let mut hello = [0u8; HELLO_LEN];
    let got = s
        .set_read_timeout(Some(Duration::from_secs(10)))
        .and_then(|()| (&s).read_exact(&mut hello))
        .and_then(|()| s.set_read_timeout(None));
    let lost = |why: String| {
        let mut st = soak.stats.lock().unwrap();
        st.handshakes_lost += 1;
        // A worker killed, or a `--fault-cmd` (a device deleted), around then explains it.
        if !soak.fault_around() {
            st.fail(format!("handshake with no kill or command around: {why}"));
        }
    };
    if let Err(e) = got {
        return lost(format!("hello: {e}"));
    }
    let u32at = |i: usize| u32::from_be_bytes(hello[i..i + 4].try_into().unwrap());
    if u32at(0) != HELLO_MAGIC {
        return soak
            .stats
            .lock()
            .unwrap()
            .fail("bad hello magic".to_string());
    }
    let (slot, pid, attempt) = (u32at(4) as usize, u32at(8), u32at(12));
    if soak.args.transport == "shm" && s.transport() != Transport::Shm {
        soak.stats
            .lock()
            .unwrap()
            .fail(format!("worker {slot} connected over {}", s.transport()));
    }
    if soak.stopping.load(Relaxed) {
        let _ = (&s).write_all(&Plan::stop_header());
        return;
    }
    let plan = soak.new_plan();
    if let Err(e) = (&s).write_all(&plan.header()) {
        return lost(format!("header: {e}"));
    }
    let sess = Arc::new(Sess {
        plan,
        slot,
        pid,
        ctl: Ctl::new(),
        fault: Mutex::new(None),
        ended: AtomicU64::new(0),
        hang: AtomicBool::new(false),
        started: now_ms(),
        cmd_at_start: AtomicBool::new(false),
    });
    {
        let mut sessions = soak.sessions.lock().unwrap();
        let during = soak.cmd_running.load(Relaxed);
        if during {
            *sess.fault.lock().unwrap() = Some((Fault::Cmd, now_ms()));
            sess.cmd_at_start.store(true, Relaxed);
        }
        sessions.insert(plan.session, sess.clone());
        ev(format!(
            "start session {} slot {} pid {} p2w {} w2p {}{}",
            plan.session,
            slot,
            pid,
            plan.p2w_len,
            plan.w2p_len,
            if during {
                " (marked cmd: the command runs)"
            } else {
                ""
            }
        ));
    }
    let mine = xfer::duplex(s, plan.parent_side(), sess.ctl.clone());
    let ended = now_ms();
    ev(format!(
        "end session {} parent tx {} {} rx {} {} fault {:?}",
        plan.session,
        mine.tx,
        mine.tx_end.label(),
        mine.rx,
        mine.rx_end.label(),
        sess.fault.lock().unwrap().map(|f| f.0.name())
    ));
    sess.ended.store(ended, Relaxed);
    let fault = *sess.fault.lock().unwrap();
    // The worker's report: at once after a normal end; within the bound after we closed.
    let limit = match fault {
        Some((Fault::PClose | Fault::PReset, _)) => soak.args.fault_bound * 1000,
        _ => 30_000,
    };
    let mut handshake_failed = false;
    let report = {
        let mut g = soak.reports.lock().unwrap();
        loop {
            if let Some(r) = g.remove(&plan.session) {
                break Some(r);
            }
            // The worker's side of this connection failed before it read our header (a reset
            // then): the session never ran there.
            if soak
                .failed_handshakes
                .lock()
                .unwrap()
                .remove(&(pid, attempt))
            {
                handshake_failed = true;
                break None;
            }
            if soak.killed(pid) || now_ms() > ended + limit {
                break None;
            }
            g = soak
                .reports_cv
                .wait_timeout(g, Duration::from_millis(100))
                .unwrap()
                .0;
        }
    };
    if handshake_failed {
        lost(format!(
            "the worker's handshake failed after our header of session {} went",
            plan.session
        ));
        soak.sessions.lock().unwrap().remove(&plan.session);
        return;
    }
    if report.is_none() && !soak.killed(pid) {
        soak.hang(
            &sess,
            format!(
                "the worker did not end its side within {} s of the parent's",
                limit / 1000
            ),
        );
    }
    judge(&soak, &sess, &mine, report.as_ref());
    soak.sessions.lock().unwrap().remove(&plan.session);
}

fn judge(soak: &Soak, sess: &Sess, mine: &SideResult, theirs: Option<&Report>) {
    let plan = &sess.plan;
    let fault = *sess.fault.lock().unwrap();
    let killed = soak.killed(sess.pid);
    let hang = sess.hang.load(Relaxed);
    let ended = sess.ended.load(Relaxed);
    let bound = soak.args.fault_bound * 1000;
    // A `now_ms` time on the trace's clock, in seconds.
    let mono = |t: u64| (mono_ms() - now_ms() + t) as f64 / 1000.0;
    let mut st = soak.stats.lock().unwrap();
    st.sessions += 1;
    let w = theirs.map(|r| &r.side);
    st.written += mine.tx + w.map_or(0, |w| w.tx);
    let read = mine.rx + w.map_or(0, |w| w.rx);
    st.moved += read;
    st.tx_mode_bytes[plan.worker_tx.index()] += mine.rx;
    st.rx_mode_bytes[plan.parent_rx.index()] += mine.rx;
    if let Some(w) = w {
        st.tx_mode_bytes[plan.parent_tx.index()] += w.rx;
        st.rx_mode_bytes[plan.worker_rx.index()] += w.rx;
    }
    let bad = mine.bad + mine.overrun + w.map_or(0, |w| w.bad + w.overrun);
    st.verified += read - bad;
    if bad > 0 {
        st.bad += bad;
        st.fail(format!(
            "{bad} BAD BYTES: {}; parent read {} (first bad at {:?}, {} beyond the end), worker read {:?} (first bad at {:?}, {:?} beyond the end)",
            plan.describe(),
            mine.rx,
            mine.first_bad,
            mine.overrun,
            w.map(|w| w.rx),
            w.and_then(|w| w.first_bad),
            w.map(|w| w.overrun),
        ));
    }
    // Did the fault take effect?
    let applied = match fault {
        None => false,
        Some((Fault::Kill, _)) => killed,
        Some((Fault::PClose | Fault::PReset, _)) => {
            mine.tx_end == End::Closed || mine.rx_end == End::Closed
        }
        Some((Fault::WClose, _)) => theirs.is_some_and(|r| r.closed) || killed,
        Some((Fault::Stop | Fault::Cmd, _)) => true,
    };
    // A session that ends early is fine only after a fault that ends sessions.
    let may_end_early = killed
        || (applied
            && matches!(
                fault,
                Some((
                    Fault::Kill | Fault::PClose | Fault::PReset | Fault::WClose | Fault::Cmd,
                    _
                ))
            ));
    let mut ok = bad == 0 && !hang;
    if !may_end_early {
        let full = |r: &SideResult, tx_len: u64, rx_len: u64| {
            r.tx_end == End::Ok && r.tx == tx_len && r.rx_end == End::Ok && r.rx == rx_len
        };
        let mine_ok = full(mine, plan.p2w_len, plan.w2p_len);
        let theirs_ok = w.is_some_and(|w| full(w, plan.w2p_len, plan.p2w_len));
        if !(mine_ok && theirs_ok) {
            ok = false;
            if w.is_none() {
                st.reports_lost += 1;
            }
            st.fail(format!(
                "session did not complete: {}; fault {:?}; parent tx {} {} rx {} {}; worker {}",
                plan.describe(),
                fault.map(|f| f.0.name()),
                mine.tx,
                mine.tx_end.label(),
                mine.rx,
                mine.rx_end.label(),
                w.map_or("no report".to_string(), |w| format!(
                    "tx {} {} rx {} {}",
                    w.tx,
                    w.tx_end.label(),
                    w.rx,
                    w.rx_end.label()
                )),
            ));
        }
    }
    // The bound after a fault that ends sessions.
    if let Some((f, at)) = fault {
        let took = match f {
            Fault::Kill | Fault::WClose | Fault::Cmd => Some(ended.saturating_sub(at)),
            Fault::PClose | Fault::PReset => theirs.map(|r| r.at.saturating_sub(ended)),
            Fault::Stop => None,
        };
        if applied && !hang {
            if let Some(t) = took.filter(|&t| t > bound) {
                ok = false;
                st.fail(format!(
                    "{} ended {} ms after {}, over the {} s bound (session started at {:.3}, {} at {:.3}, ended at {:.3}; parent tx {} {} rx {} {}): {}",
                    if matches!(f, Fault::PClose | Fault::PReset) {
                        "the worker's side"
                    } else {
                        "the parent's side"
                    },
                    t,
                    f.name(),
                    bound / 1000,
                    mono(sess.started),
                    f.name(),
                    mono(at),
                    mono(ended),
                    mine.tx,
                    mine.tx_end.label(),
                    mine.rx,
                    mine.rx_end.label(),
                    plan.describe()
                ));
            }
        }
    }
    // A reset is not an orderly close: a worker still reading must see an error, not only EOF
    // (as over TCP, the error is reported once: to its writer, if that saw it first, and then
    // its reader sees EOF).
    if let (Some((Fault::PReset, _)), true, Some(w)) = (fault, applied, w) {
        if w.rx_end == End::ShortEof && !matches!(w.tx_end, End::Err(_)) {
            ok = false;
            st.fail(format!(
                "the parent reset the connection and the worker saw no error (EOF after {} bytes, writer {}): {}",
                w.rx,
                w.tx_end.label(),
                plan.describe()
            ));
        }
    }
    if let Some((f, _)) = fault {
        let k = f as usize;
        if applied {
            st.injected[k] += 1;
            st.sessions_faulted += 1;
            if ok {
                st.survived[k] += 1;
            }
        } else {
            st.missed[k] += 1;
        }
    }
}

fn acceptor(soak: Arc<Soak>, l: SdpListener, done: Arc<AtomicBool>) {
    use std::os::fd::AsRawFd;
    l.set_nonblocking(true).unwrap_or_else(|e| die(e));
    while !done.load(Relaxed) {
        let mut p = libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut p, 1, 100) };
        loop {
            match l.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).unwrap_or_else(|e| die(e));
                    let soak = soak.clone();
                    std::thread::Builder::new()
                        .name("soak-session".into())
                        .spawn(move || serve(soak, s))
                        .expect("spawn session");
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    soak.stats.lock().unwrap().fail(format!("accept: {e}"));
                    std::thread::sleep(Duration::from_millis(100));
                    break;
                }
            }
        }
    }
}

/// Keep one worker running in `slot` (a new one after each kill) until the soak stops.
fn run_slot(soak: Arc<Soak>, slot: usize) {
    while !soak.stopping.load(Relaxed) {
        let mut cmd = Command::new(&soak.exe);
        cmd.args([
            "worker",
            "--addr",
            &soak.addr,
            "--slot",
            &slot.to_string(),
            "--transport",
            &soak.args.transport,
        ]);
        if let Some(ip) = soak.args.source_ip {
            cmd.args(["--source-ip", &ip.to_string()]);
        }
        let mut child = match cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn() {
            Ok(c) => c,
            Err(e) => {
                soak.stats
                    .lock()
                    .unwrap()
                    .fail(format!("spawn worker: {e}"));
                return;
            }
        };
        let pid = child.id();
        soak.stats.lock().unwrap().workers_spawned += 1;
        *soak.slots[slot].stdin.lock().unwrap() = child.stdin.take();
        soak.slots[slot].pid.store(pid, Relaxed);
        if soak.stopping.load(Relaxed) {
            // Stopping began while it started: let it go at once.
            soak.slots[slot].stdin.lock().unwrap().take();
        }
        let out = BufReader::new(child.stdout.take().expect("piped"));
        for line in out.lines() {
            let Ok(line) = line else { break };
            if line.starts_with("R ") {
                match parse_report(&line) {
                    Some(r) => {
                        soak.reports.lock().unwrap().insert(r.session, r);
                        soak.reports_cv.notify_all();
                    }
                    None => soak
                        .stats
                        .lock()
                        .unwrap()
                        .fail(format!("worker {slot}: bad report {line:?}")),
                }
            } else if let Some(a) = line.strip_prefix("H attempt=") {
                match a.trim().parse::<u32>() {
                    Ok(a) => {
                        // Under the reports' lock: a session's wait looks at both.
                        let _g = soak.reports.lock().unwrap();
                        soak.failed_handshakes.lock().unwrap().insert((pid, a));
                        soak.reports_cv.notify_all();
                    }
                    Err(_) => soak
                        .stats
                        .lock()
                        .unwrap()
                        .fail(format!("worker {slot}: bad line {line:?}")),
                }
            } else if line.starts_with("W ") {
                if line.contains("leak=1") {
                    let mut st = soak.stats.lock().unwrap();
                    st.worker_leaks += 1;
                    st.fail(format!("worker {slot} (pid {pid}) leaked: {line}"));
                }
            } else {
                println!("[worker {slot}] {line}");
            }
        }
        let status = child.wait();
        soak.slots[slot].pid.store(0, Relaxed);
        soak.slots[slot].stdin.lock().unwrap().take();
        use std::os::unix::process::ExitStatusExt;
        let mut st = soak.stats.lock().unwrap();
        match status {
            Ok(s) if s.success() => {
                if !soak.stopping.load(Relaxed) {
                    st.fail(format!("worker {slot} (pid {pid}) exited early"));
                }
            }
            Ok(s) if s.signal() == Some(libc::SIGKILL) && soak.killed(pid) => {}
            Ok(s) if s.code() == Some(3) => {
                st.hangs += 1;
                st.note(format!(
                    "HANG: worker {slot} (pid {pid}) found its session stuck"
                ));
            }
            Ok(s) if s.code() == Some(4) => {} // counted from its W line
            Ok(s) => {
                st.worker_crashes += 1;
                st.fail(format!("worker {slot} (pid {pid}) ended: {s}"));
            }
            Err(e) => st.fail(format!("wait for worker {slot}: {e}")),
        }
    }
}

/// Inject a fault every `--fault-interval` (randomised by half) into a session under way, the
/// kinds in turn.
fn scheduler(soak: Arc<Soak>) {
    let mut rng = ChaCha8Rng::seed_from_u64(soak.args.seed ^ 0xfa17_fa17);
    let kinds = soak.args.faults.clone();
    let mut turn = 0usize;
    let nap = |secs: f64| {
        let end = now_ms() + (secs * 1000.0) as u64;
        while now_ms() < end && !soak.stopping.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    nap(soak.args.fault_interval);
    while !soak.stopping.load(Relaxed) {
        let cands: Vec<Arc<Sess>> = soak
            .sessions
            .lock()
            .unwrap()
            .values()
            .filter(|s| {
                s.ended.load(Relaxed) == 0
                    && !s.ctl.done()
                    && s.fault.lock().unwrap().is_none()
                    && s.ctl.tx.load(Relaxed) + s.ctl.rx.load(Relaxed) > 0
                    && soak.slots[s.slot].pid.load(Relaxed) == s.pid
            })
            .cloned()
            .collect();
        if cands.is_empty() {
            nap(0.02);
            continue;
        }
        let sess = &cands[rng.random_range(0..cands.len())];
        let kind = kinds[turn % kinds.len()];
        turn += 1;
        *sess.fault.lock().unwrap() = Some((kind, now_ms()));
        ev(format!(
            "fault {} on session {}",
            kind.name(),
            sess.plan.session
        ));
        match kind {
            Fault::Kill => soak.kill(sess.pid),
            Fault::Stop => {
                signal(sess.pid, libc::SIGSTOP);
                std::thread::sleep(Duration::from_millis(rng.random_range(50..=1500)));
                signal(sess.pid, libc::SIGCONT);
            }
            Fault::PClose => sess.ctl.close.store(true, Relaxed),
            Fault::PReset => {
                sess.ctl.reset.store(true, Relaxed);
                sess.ctl.close.store(true, Relaxed);
            }
            Fault::WClose => {
                if let Some(w) = soak.slots[sess.slot].stdin.lock().unwrap().as_mut() {
                    let _ = writeln!(w, "close {}", sess.plan.session).and_then(|()| w.flush());
                }
            }
            Fault::Cmd => {
                // Every session under way may fail now, and those that start before the
                // command is over.
                soak.cmd_running.store(true, Relaxed);
                for s in soak.sessions.lock().unwrap().values() {
                    let mut f = s.fault.lock().unwrap();
                    if f.is_none() && s.ended.load(Relaxed) == 0 {
                        *f = Some((Fault::Cmd, now_ms()));
                        ev(format!("cmd marks session {}", s.plan.session));
                    }
                }
                let cmd = soak.args.fault_cmd.as_deref().unwrap_or("true");
                let st = Command::new("sh").args(["-c", cmd]).status();
                ev("cmd ended".to_string());
                soak.last_cmd.store(now_ms(), Relaxed);
                // Sessions that started while it ran and are still under way now that it is
                // over were not ended by it (the rig's: they started after the device came
                // back): they are unfaulted again, to complete in full or to meet a later
                // fault, whose bound then counts from that fault (with their start as the
                // fault's time, a later deletion ended them past the bound). Under the
                // sessions' lock, where a starting session looks at `cmd_running`.
                {
                    let sessions = soak.sessions.lock().unwrap();
                    soak.cmd_running.store(false, Relaxed);
                    for s in sessions.values() {
                        let mut f = s.fault.lock().unwrap();
                        if s.cmd_at_start.swap(false, Relaxed) && s.ended.load(Relaxed) == 0 {
                            *f = None;
                            ev(format!(
                                "session {} under way after the command: unmarked",
                                s.plan.session
                            ));
                        }
                    }
                }
                if !matches!(&st, Ok(s) if s.success()) {
                    soak.stats
                        .lock()
                        .unwrap()
                        .note(format!("--fault-cmd {cmd:?}: {st:?}"));
                }
            }
        }
        nap(soak.args.fault_interval * rng.random_range(0.5..1.5));
    }
}

/// Sessions that stop moving, or outlive a fault's bound, are hangs.
fn watchdog(soak: Arc<Soak>, done: Arc<AtomicBool>) {
    let hang_ms = soak.args.hang_secs * 1000;
    let bound = soak.args.fault_bound * 1000;
    while !done.load(Relaxed) {
        std::thread::sleep(Duration::from_millis(250));
        let now = now_ms();
        let live: Vec<Arc<Sess>> = soak.sessions.lock().unwrap().values().cloned().collect();
        for s in live {
            if s.ended.load(Relaxed) != 0 || s.hang.load(Relaxed) {
                continue;
            }
            let idle = now.saturating_sub(s.ctl.last_progress.load(Relaxed));
            if idle > hang_ms {
                soak.hang(&s, format!("no byte moved for {} s", idle / 1000));
                continue;
            }
            let fault = *s.fault.lock().unwrap();
            if let Some((Fault::Kill | Fault::WClose | Fault::PClose, at)) = fault {
                if now.saturating_sub(at) > bound + 1000 {
                    soak.hang(
                        &s,
                        format!(
                            "the parent's side still running {} ms after {}",
                            now - at,
                            fault.unwrap().0.name()
                        ),
                    );
                }
            }
        }
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    now_ms();
    if argv.first().map(String::as_str) == Some("worker") {
        worker_main(&argv[1..]);
    }
    let args = parse_args(&argv).unwrap_or_else(|e| die(e));
    let stack = (args.transport == "shm").then(own_stack);
    let mut opts = Options::sdp_only();
    if let Some((s, _)) = &stack {
        opts = opts.with_stack(s.clone());
    }
    let listener = SdpListener::bind_with(args.listen.as_str(), &opts)
        .unwrap_or_else(|e| die(format!("listen on {}: {e}", args.listen)));
    let addr = listener.local_addr().unwrap_or_else(|e| die(e)).to_string();
    let base = measure(stack.as_ref());
    let base_kinds = fd_kinds();
    let exe = std::env::current_exe().unwrap_or_else(|e| die(e));
    let soak = Arc::new(Soak {
        exe,
        addr: addr.clone(),
        stopping: AtomicBool::new(false),
        rng: Mutex::new(ChaCha8Rng::seed_from_u64(args.seed)),
        next_session: AtomicU64::new(1),
        sessions: Mutex::new(HashMap::new()),
        slots: (0..args.workers)
            .map(|_| Slot {
                pid: AtomicU32::new(0),
                stdin: Mutex::new(None),
            })
            .collect(),
        killed: Mutex::new(HashSet::new()),
        last_kill: AtomicU64::new(0),
        reports: Mutex::new(HashMap::new()),
        failed_handshakes: Mutex::new(HashSet::new()),
        last_cmd: AtomicU64::new(0),
        reports_cv: Condvar::new(),
        stats: Mutex::new(Stats::default()),
        cmd_running: AtomicBool::new(false),
        args: args.clone(),
    });
    println!(
        "sdp-soak: {} workers over {} at {addr}, until {} GiB verified or {} s, seed {}, faults {} (every ~{} s), sessions up to {} bytes each way",
        args.workers,
        args.transport,
        args.gib,
        args.seconds,
        args.seed,
        if args.faults.is_empty() {
            "off".to_string()
        } else {
            args.faults
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(",")
        },
        args.fault_interval,
        args.max_session
    );
    let start = now_ms();
    let accept_done = Arc::new(AtomicBool::new(false));
    let acceptor_t = {
        let (soak, done) = (soak.clone(), accept_done.clone());
        std::thread::spawn(move || acceptor(soak, listener, done))
    };
    let watchdog_t = {
        let (soak, done) = (soak.clone(), accept_done.clone());
        std::thread::spawn(move || watchdog(soak, done))
    };
    let slot_ts: Vec<_> = (0..args.workers)
        .map(|i| {
            let soak = soak.clone();
            std::thread::spawn(move || run_slot(soak, i))
        })
        .collect();
    let sched_t = (!args.faults.is_empty()).then(|| {
        let soak = soak.clone();
        std::thread::spawn(move || scheduler(soak))
    });

    let target = (args.gib * (1u64 << 30) as f64) as u64;
    let limit_ms = (args.seconds * 1000.0) as u64;
    let mut last_status = start;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = now_ms();
        let verified = soak.verified_now();
        if verified >= target || now - start >= limit_ms {
            break;
        }
        if !args.quiet && now - last_status >= 10_000 {
            last_status = now;
            let st = soak.stats.lock().unwrap();
            let secs = (now - start) as f64 / 1000.0;
            println!(
                "[{:6.0} s] verified {:.2} GiB ({:.0} MB/s), {} sessions, faults {}, failures {}, hangs {}",
                secs,
                gib(st.verified),
                st.verified as f64 / secs / 1e6,
                st.sessions,
                st.injected.iter().sum::<u64>(),
                st.failures,
                st.hangs
            );
        }
    }
    // Stop: no new faults, then no new sessions; workers finish the one under way.
    soak.stopping.store(true, Relaxed);
    if let Some(t) = sched_t {
        let _ = t.join();
    }
    for s in &soak.slots {
        s.stdin.lock().unwrap().take();
    }
    let stop_at = now_ms();
    let wait_limit = 120_000 + args.max_session / (1 << 20) * 100;
    while slot_ts.iter().any(|t| !t.is_finished()) && now_ms() - stop_at < wait_limit {
        std::thread::sleep(Duration::from_millis(50));
    }
    if slot_ts.iter().any(|t| !t.is_finished()) {
        let mut st = soak.stats.lock().unwrap();
        st.fail("workers did not stop: killing them".into());
        drop(st);
        for s in &soak.slots {
            soak.kill(s.pid.load(Relaxed));
        }
    }
    for t in slot_ts {
        let _ = t.join();
    }
    // Sessions still under way on the parent's side (the watchdog reports them as hangs).
    let t = now_ms();
    while !soak.sessions.lock().unwrap().is_empty()
        && now_ms() - t < (args.hang_secs + args.fault_bound + 35) * 1000
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    // Sessions that never ended: their faults count as injected and not survived.
    let stuck: Vec<(String, Option<Fault>)> = soak
        .sessions
        .lock()
        .unwrap()
        .values()
        .map(|s| (s.plan.describe(), s.fault.lock().unwrap().map(|f| f.0)))
        .collect();
    accept_done.store(true, Relaxed);
    let _ = acceptor_t.join();
    let _ = watchdog_t.join();
    let elapsed = (now_ms() - start) as f64 / 1000.0;

    // Leaks: everything back to what it was before the first session.
    let over = settle(stack.as_ref(), base, Duration::from_secs(30));
    let procs = children_left();
    let mut st = soak.stats.lock().unwrap();
    for (s, fault) in &stuck {
        if let Some(f) = fault {
            st.injected[*f as usize] += 1;
            st.sessions_faulted += 1;
        }
        st.fail(format!(
            "session never ended: {s} (fault {})",
            fault.map_or("none", |f| f.name())
        ));
    }
    let contexts = contexts_wrong();
    let leaked =
        over != Res::default() || !procs.is_empty() || st.worker_leaks > 0 || contexts.is_some();
    if over != Res::default() {
        st.fail(format!(
            "parent leaked: {} fds ({}), {} connections, {} registered bytes, {} regions",
            over.fds,
            fds_over(&base_kinds),
            over.conns,
            over.reg_bytes,
            over.regions
        ));
    }
    if !procs.is_empty() {
        st.fail(format!("worker processes left: {procs:?}"));
    }
    if let Some(w) = &contexts {
        st.fail(format!("parent's verbs contexts: {w}"));
    }
    let injected: u64 = st.injected.iter().sum();
    let survived: u64 = st.survived.iter().sum();
    let pass = st.bad == 0 && st.hangs == 0 && st.failures == 0 && !leaked;
    let per = |v: &[u64]| -> String {
        FAULTS
            .iter()
            .zip(v)
            .filter(|(f, _)| **f != Fault::Cmd || args.fault_cmd.is_some())
            .map(|(f, n)| format!("{} {n}", f.name()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !pass {
        println!("  the last events (seconds on the monotonic clock):");
        for l in TRACE.lock().unwrap().iter() {
            println!("  trace {l}");
        }
    }
    println!(
        "sdp-soak: {} after {:.1} s",
        if pass { "PASS" } else { "FAIL" },
        elapsed
    );
    println!(
        "  bytes moved (read by the receivers) {} ({:.2} GiB), verified {} ({:.2} GiB, {:.0} MB/s), bad {}; written (accepted by writes, killed workers' unknown) {} ({:.2} GiB)",
        st.moved,
        gib(st.moved),
        st.verified,
        gib(st.verified),
        st.verified as f64 / elapsed / 1e6,
        st.bad,
        st.written,
        gib(st.written),
    );
    println!(
        "  verified by write mode: {}; by read mode: {}",
        TX_MODES
            .iter()
            .map(|m| format!("{} {:.2} GiB", m.name(), gib(st.tx_mode_bytes[m.index()])))
            .collect::<Vec<_>>()
            .join(", "),
        RX_MODES
            .iter()
            .map(|m| format!("{} {:.2} GiB", m.name(), gib(st.rx_mode_bytes[m.index()])))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "  sessions {} ({} with a fault), failed {}; workers started {}",
        st.sessions, st.sessions_faulted, st.failures, st.workers_spawned
    );
    println!(
        "  faults injected {injected} ({}), survived {survived} ({}); missed (session over first) {}",
        per(&st.injected),
        per(&st.survived),
        st.missed.iter().sum::<u64>()
    );
    println!(
        "  hangs {}, worker crashes {}, handshakes lost to faults {}, reports lost {}",
        st.hangs, st.worker_crashes, st.handshakes_lost, st.reports_lost
    );
    println!(
        "  leaked: parent {} fds, {} connections, {} registered bytes, {} regions; worker processes left {}; workers that leaked {}",
        over.fds,
        over.conns,
        over.reg_bytes,
        over.regions,
        procs.len(),
        st.worker_leaks
    );
    if args.json {
        let obj = |v: &[u64]| -> String {
            FAULTS
                .iter()
                .zip(v)
                .map(|(f, n)| format!("\"{}\":{n}", f.name()))
                .collect::<Vec<_>>()
                .join(",")
        };
        println!(
            "{{\"pass\":{pass},\"seconds\":{elapsed:.1},\"workers\":{},\"seed\":{},\"transport\":\"{}\",\"faults\":\"{}\",\
\"bytes_moved\":{},\"bytes_verified\":{},\"bytes_written\":{},\"bad_bytes\":{},\"sessions\":{},\"sessions_faulted\":{},\"failures\":{},\
\"faults_injected\":{{{}}},\"faults_survived\":{{{}}},\"faults_missed\":{{{}}},\"hangs\":{},\"worker_crashes\":{},\
\"leaked\":{{\"fds\":{},\"connections\":{},\"registered_bytes\":{},\"regions\":{},\"processes\":{},\"workers\":{}}},\
\"verified_by_write_mode\":{{{}}},\"verified_by_read_mode\":{{{}}}}}",
            args.workers,
            args.seed,
            args.transport,
            args.faults
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(","),
            st.moved,
            st.verified,
            st.written,
            st.bad,
            st.sessions,
            st.sessions_faulted,
            st.failures,
            obj(&st.injected),
            obj(&st.survived),
            obj(&st.missed),
            st.hangs,
            st.worker_crashes,
            over.fds,
            over.conns,
            over.reg_bytes,
            over.regions,
            procs.len(),
            st.worker_leaks,
            TX_MODES
                .iter()
                .map(|m| format!("\"{}\":{}", m.name(), st.tx_mode_bytes[m.index()]))
                .collect::<Vec<_>>()
                .join(","),
            RX_MODES
                .iter()
                .map(|m| format!("\"{}\":{}", m.name(), st.rx_mode_bytes[m.index()]))
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    let _ = std::io::stdout().flush();
    // Threads stuck in a hung session cannot be joined: leave without them.
    std::process::exit(if pass { 0 } else { 1 })
}
