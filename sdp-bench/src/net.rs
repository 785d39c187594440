//! The network benchmarks: a server, a client, and `compare`, which runs both over every
//! transport and mode in one run.

use std::io::{self, BufRead, Read, Write};
use std::net::Shutdown;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sdp_core::socket::{Options, SdpListener, SdpStream};

use crate::args::MAX_SIZE;
use crate::engine::cpu_seconds;
use crate::RunOpts;

const MAGIC: u32 = 0x5344_5042; // "SDPB"
const STREAM: u32 = 1;
const PINGPONG: u32 = 2;
/// Zero-copy sends the client keeps in flight (sdp-zcopy stream mode).
const ZCOPY_DEPTH: usize = 4;
/// Bytes of zero-copy sends in flight at most (the window shrinks for large messages).
const ZCOPY_WINDOW_BYTES: usize = 4 << 20;

/// Flags: the client sends from registered buffers (the server receives into one).
const F_REGISTERED: u32 = 1;
/// Flags: no zero copy at all (BCopy only).
const F_NO_ZCOPY: u32 = 2;

const DEFAULT_SIZES: [usize; 7] = [64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
const GIB: f64 = (1u64 << 30) as f64;

fn size_name(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        format!("{n}")
    }
}

fn header(kind: u32, flags: u32, size: usize) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&MAGIC.to_be_bytes());
    h[4..8].copy_from_slice(&kind.to_be_bytes());
    h[8..12].copy_from_slice(&flags.to_be_bytes());
    debug_assert!(size <= MAX_SIZE, "sizes are checked when parsed");
    h[12..16].copy_from_slice(&(size as u32).to_be_bytes());
    h
}

// ---------------------------------------------------------------------------------------------
// Server

pub fn server(addr: &str, print_addr: bool) -> io::Result<()> {
    let l = SdpListener::bind(addr)?;
    let local = l.local_addr()?;
    if print_addr {
        println!("{local}");
        io::stdout().flush()?;
    }
    match l.sdp_status() {
        Ok(t) => eprintln!("sdp-bench server on {local}: SDP over {t} and kernel TCP"),
        Err(e) => eprintln!("sdp-bench server on {local}: kernel TCP only (SDP: {e})"),
    }
    for s in l.incoming() {
        let s = s?;
        std::thread::spawn(move || {
            if let Err(e) = serve(s) {
                eprintln!("sdp-bench server: connection: {e}");
            }
        });
    }
    Ok(())
}

fn serve(mut s: SdpStream) -> io::Result<()> {
    let mut h = [0u8; 16];
    s.read_exact(&mut h)?;
    let word = |i: usize| u32::from_be_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    if word(0) != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not an sdp-bench client",
        ));
    }
    let (kind, flags, size) = (word(4), word(8), word(12) as usize);
    if size == 0 || size > MAX_SIZE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad message size {size} (1 to {MAX_SIZE} bytes)"),
        ));
    }
    s.set_zero_copy(flags & F_NO_ZCOPY == 0);
    let cpu0 = cpu_seconds();
    let count: u64 = match kind {
        STREAM if flags & F_REGISTERED != 0 && s.transport().name() != "tcp" => {
            let mut rb = s.register(size)?;
            let mut total = 0u64;
            loop {
                let n = s.recv_registered(&mut rb, 0..size)?;
                if n == 0 {
                    break total;
                }
                total += n as u64;
            }
        }
        STREAM => {
            let mut buf = vec![0u8; size];
            let mut total = 0u64;
            loop {
                let n = s.read(&mut buf)?;
                if n == 0 {
                    break total;
                }
                total += n as u64;
            }
        }
        PINGPONG => {
            s.set_nodelay(true)?;
            let mut buf = vec![0u8; size];
            let mut iters = 0u64;
            loop {
                // EOF before a message: the client is done.
                let n = s.read(&mut buf)?;
                if n == 0 {
                    break iters;
                }
                s.read_exact(&mut buf[n..])?;
                s.write_all(&buf)?;
                iters += 1;
            }
        }
        _ => return Err(io::Error::new(io::ErrorKind::InvalidData, "unknown test")),
    };
    let cpu_ns = ((cpu_seconds() - cpu0) * 1e9) as u64;
    let mut reply = [0u8; 16];
    reply[..8].copy_from_slice(&count.to_be_bytes());
    reply[8..].copy_from_slice(&cpu_ns.to_be_bytes());
    s.write_all(&reply)
}

// ---------------------------------------------------------------------------------------------
// Client

/// One measured row.
#[derive(Debug, Clone, Default)]
pub struct Row {
    pub transport: String,
    pub mode: String,
    pub size: usize,
    pub bytes_per_sec: Option<f64>,
    pub msgs_per_sec: Option<f64>,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub cpu_s_per_gib: Option<f64>,
}

impl Row {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "transport": self.transport,
            "mode": self.mode,
            "size_bytes": self.size,
            "bytes_per_sec": self.bytes_per_sec,
            "msgs_per_sec": self.msgs_per_sec,
            "p50_us": self.p50_us,
            "p99_us": self.p99_us,
            "cpu_s_per_gib": self.cpu_s_per_gib,
        })
    }
}

/// How the client connects and sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    SdpAuto,
    SdpBcopy,
    SdpZcopy,
    Tcp,
}

impl Mode {
    fn parse(s: &str) -> Result<Mode, String> {
        Ok(match s {
            "sdp-auto" | "auto" | "sdp" => Mode::SdpAuto,
            "sdp-bcopy" | "bcopy" => Mode::SdpBcopy,
            "sdp-zcopy" | "zcopy" => Mode::SdpZcopy,
            "tcp" => Mode::Tcp,
            _ => {
                return Err(format!(
                    "unknown mode {s:?} (sdp-auto, sdp-bcopy, sdp-zcopy, tcp)"
                ))
            }
        })
    }
    fn label(self) -> &'static str {
        match self {
            Mode::SdpAuto => "auto",
            Mode::SdpBcopy => "bcopy",
            Mode::SdpZcopy => "zcopy",
            Mode::Tcp => "kernel",
        }
    }
    fn flags(self) -> u32 {
        match self {
            Mode::SdpZcopy => F_REGISTERED,
            Mode::SdpBcopy => F_NO_ZCOPY,
            _ => 0,
        }
    }
    fn connect(self, addr: &str) -> io::Result<SdpStream> {
        let opts = match self {
            Mode::Tcp => Options::tcp_only(),
            _ => Options::sdp_only(),
        };
        let s = SdpStream::connect_with(addr, &opts)?;
        s.set_zero_copy(self != Mode::SdpBcopy);
        Ok(s)
    }
}

struct Measured {
    count: u64,
    secs: f64,
    cpu: f64,
    server_cpu: f64,
    rtts: Vec<Duration>,
    transport: &'static str,
}

fn finish(mut s: SdpStream) -> io::Result<(u64, f64)> {
    s.shutdown(Shutdown::Write)?;
    let mut reply = [0u8; 16];
    s.read_exact(&mut reply)?;
    let count = u64::from_be_bytes(reply[..8].try_into().expect("8 bytes"));
    let cpu_ns = u64::from_be_bytes(reply[8..].try_into().expect("8 bytes"));
    Ok((count, cpu_ns as f64 / 1e9))
}

fn run_stream(addr: &str, mode: Mode, size: usize, dur: Duration) -> io::Result<Measured> {
    let mut s = mode.connect(addr)?;
    let transport = s.transport().name();
    s.write_all(&header(STREAM, mode.flags(), size))?;
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let mut sent = 0u64;
    if mode == Mode::SdpZcopy {
        // A window of registered buffers in flight, like ib_write_bw's transmit depth: the
        // peer reads one while the next ones are advertised.
        // At most ZCOPY_WINDOW_BYTES in flight (at least one buffer): more buffers than the
        // caches hold cost more than the round trips they hide.
        let depth = (ZCOPY_WINDOW_BYTES / size.max(1)).clamp(1, ZCOPY_DEPTH);
        let mut inflight = std::collections::VecDeque::with_capacity(depth);
        let mut free = Vec::with_capacity(depth);
        for _ in 0..depth {
            let mut rb = s.register(size)?;
            rb.as_mut_slice().fill(0x5a);
            free.push(rb);
        }
        while t0.elapsed() < dur {
            let rb = match free.pop() {
                Some(rb) => rb,
                None => {
                    let p: sdp_core::socket::PendingSend =
                        inflight.pop_front().expect("window is full");
                    let (rb, n) = p.wait()?;
                    sent += n as u64;
                    rb
                }
            };
            inflight.push_back(s.send_registered_async(rb, 0..size)?);
        }
        for p in inflight {
            sent += p.wait()?.1 as u64;
        }
    } else {
        let buf = vec![0x5au8; size];
        while t0.elapsed() < dur {
            s.write_all(&buf)?;
            sent += size as u64;
        }
    }
    let (count, server_cpu) = finish(s)?;
    let secs = t0.elapsed().as_secs_f64();
    if count != sent {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("server received {count} bytes of {sent} sent"),
        ));
    }
    Ok(Measured {
        count,
        secs,
        cpu: cpu_seconds() - cpu0,
        server_cpu,
        rtts: Vec::new(),
        transport,
    })
}

fn run_pingpong(addr: &str, mode: Mode, size: usize, dur: Duration) -> io::Result<Measured> {
    let mut s = mode.connect(addr)?;
    let transport = s.transport().name();
    s.set_nodelay(true)?;
    s.write_all(&header(PINGPONG, mode.flags(), size))?;
    let out = vec![0x33u8; size];
    let mut back = vec![0u8; size];
    let mut rtts = Vec::new();
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    while t0.elapsed() < dur || rtts.len() < 5 {
        let t = Instant::now();
        s.write_all(&out)?;
        s.read_exact(&mut back)?;
        rtts.push(t.elapsed());
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let (count, server_cpu) = finish(s)?;
    if count != rtts.len() as u64 || back != out {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "echo mismatch"));
    }
    Ok(Measured {
        count,
        secs,
        cpu,
        server_cpu,
        rtts,
        transport,
    })
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e6
}

fn measure(addr: &str, mode: Mode, size: usize, opts: &RunOpts) -> io::Result<Row> {
    let dur = Duration::from_secs_f64(opts.duration.max(0.05));
    let mut row = Row {
        mode: mode.label().into(),
        size,
        ..Row::default()
    };
    if opts.tests != "pingpong" {
        let m = run_stream(addr, mode, size, dur)?;
        row.transport = m.transport.into();
        row.bytes_per_sec = Some(m.count as f64 / m.secs);
        row.msgs_per_sec = Some(m.count as f64 / size as f64 / m.secs);
        row.cpu_s_per_gib = Some((m.cpu + m.server_cpu) / (m.count as f64 / GIB));
    }
    if opts.tests != "stream" {
        let m = run_pingpong(addr, mode, size, dur)?;
        row.transport = m.transport.into();
        let mut r = m.rtts;
        r.sort();
        row.p50_us = Some(percentile(&r, 0.5));
        row.p99_us = Some(percentile(&r, 0.99));
        if row.msgs_per_sec.is_none() {
            row.msgs_per_sec = Some(m.count as f64 / m.secs);
        }
    }
    Ok(row)
}

pub fn client(addr: &str, opts: &RunOpts, mode: &str) -> io::Result<()> {
    let mode = Mode::parse(mode).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // Resolve once up front, so that a bad host name is reported as such before any row.
    std::net::ToSocketAddrs::to_socket_addrs(addr)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot resolve {addr}: {e}")))?;
    let sizes = opts.sizes.clone().unwrap_or_else(|| DEFAULT_SIZES.to_vec());
    let mut rows = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        if !opts.json {
            eprintln!(
                "[{}/{}] {} {}",
                i + 1,
                sizes.len(),
                mode.label(),
                size_name(size)
            );
        }
        let row = measure(addr, mode, size, opts)?;
        if opts.json {
            println!("{}", row.json());
        }
        rows.push(row);
    }
    report(&rows, opts, &mut io::stdout().lock())
}

// ---------------------------------------------------------------------------------------------
// Compare

struct ServerChild(Child);

impl Drop for ServerChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spin `threads` threads until the process is killed (`compare --load`).
pub fn burn(threads: usize) -> io::Result<()> {
    let spin = || {
        let mut x = 0u64;
        loop {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    };
    for _ in 1..threads {
        std::thread::spawn(spin);
    }
    if threads > 0 {
        spin();
    }
    Ok(())
}

pub fn compare(opts: &RunOpts, only: Option<Vec<String>>, load: usize) -> io::Result<()> {
    let modes: Vec<Mode> = match only {
        Some(list) => list
            .iter()
            .map(|s| Mode::parse(s))
            .collect::<Result<_, _>>()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
        None => vec![Mode::SdpAuto, Mode::SdpBcopy, Mode::SdpZcopy, Mode::Tcp],
    };
    let sizes = opts.sizes.clone().unwrap_or_else(|| DEFAULT_SIZES.to_vec());
    let mut child = ServerChild(
        Command::new(std::env::current_exe()?)
            .args(["server", "127.0.0.1:0", "--print-addr"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let mut line = String::new();
    io::BufReader::new(child.0.stdout.take().expect("piped")).read_line(&mut line)?;
    let addr = line.trim().to_string();
    if addr.is_empty() {
        return Err(io::Error::other("the server process did not start"));
    }
    // The busy host's load runs for the whole run, in a process of its own (killed on drop).
    let _load = match load {
        0 => None,
        n => Some(ServerChild(
            Command::new(std::env::current_exe()?)
                .args(["burn", &n.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?,
        )),
    };
    let tests = match opts.tests.as_str() {
        "stream" | "pingpong" => 1.0,
        _ => 2.0,
    };
    let total = sizes.len() * modes.len();
    if !opts.json {
        eprintln!(
            "sdp-bench compare: server {addr}, {} sizes x {} modes, about {:.0} s, {}",
            sizes.len(),
            modes.len(),
            total as f64 * tests * opts.duration.max(0.05),
            load_name(load)
        );
    }
    let mut rows = Vec::new();
    let mut n = 0;
    for &size in &sizes {
        for &mode in &modes {
            n += 1;
            if !opts.json {
                eprintln!("[{n}/{total}] {} {}", mode.label(), size_name(size));
            }
            let row = measure(&addr, mode, size, opts)?;
            if opts.json {
                println!("{}", row.json());
            }
            rows.push(row);
        }
    }
    drop(child);
    let mut out = io::stdout().lock();
    if load > 0 && !opts.json {
        writeln!(out, "# {}", load_name(load))?;
    }
    report(&rows, opts, &mut out)
}

/// The header's words for `--load`.
fn load_name(load: usize) -> String {
    match load {
        0 => "no added load".into(),
        n => format!(
            "load: {n} CPU-bound thread{} beside it ({} CPUs online)",
            if n == 1 { "" } else { "s" },
            std::thread::available_parallelism().map_or(0, |n| n.get())
        ),
    }
}

fn fmt_opt(v: Option<f64>, scale: f64, prec: usize) -> String {
    v.map_or("-".into(), |v| format!("{:.*}", prec, v / scale))
}

/// Print the table to `out` (JSON rows are printed as they come), then write the plot: the
/// results are out before anything can go wrong with the plot file, and a failed plot is an
/// error (non-zero exit) that says so.
fn report(rows: &[Row], opts: &RunOpts, out: &mut dyn Write) -> io::Result<()> {
    let printed = if opts.json { Ok(()) } else { table(rows, out) }.and_then(|()| out.flush());
    if let Some(path) = &opts.plot {
        if let Err(e) = std::fs::write(path, crate::plot::svg(rows)) {
            let above = if printed.is_ok() {
                "; the results are printed above"
            } else {
                ""
            };
            return Err(io::Error::new(
                e.kind(),
                format!("could not write the plot to {}: {e}{above}", path.display()),
            ));
        }
        if !opts.json {
            eprintln!("plot written to {}", path.display());
        }
    }
    printed
}

fn table(rows: &[Row], out: &mut dyn Write) -> io::Result<()> {
    let tcp = |size: usize| {
        rows.iter()
            .find(|r| r.size == size && r.transport == "tcp")
            .cloned()
    };
    writeln!(
        out,
        "{:<9} {:<7} {:>6} {:>11} {:>11} {:>9} {:>9} {:>10} {:>8} {:>8}",
        "transport",
        "mode",
        "size",
        "MB/s",
        "msgs/s",
        "p50 us",
        "p99 us",
        "CPU s/GiB",
        "xTCP bw",
        "xTCP p50"
    )?;
    for r in rows {
        let t = tcp(r.size);
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "-".into(),
        };
        writeln!(
            out,
            "{:<9} {:<7} {:>6} {:>11} {:>11} {:>9} {:>9} {:>10} {:>8} {:>8}",
            r.transport,
            r.mode,
            size_name(r.size),
            fmt_opt(r.bytes_per_sec, 1e6, 1),
            fmt_opt(r.msgs_per_sec, 1.0, 0),
            fmt_opt(r.p50_us, 1.0, 1),
            fmt_opt(r.p99_us, 1.0, 1),
            fmt_opt(r.cpu_s_per_gib, 1.0, 3),
            ratio(r.bytes_per_sec, t.as_ref().and_then(|t| t.bytes_per_sec)),
            ratio(r.p50_us, t.as_ref().and_then(|t| t.p50_us)),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Vec<Row> {
        vec![Row {
            transport: "tcp".into(),
            mode: "kernel".into(),
            size: 64 << 10,
            bytes_per_sec: Some(1.5e9),
            msgs_per_sec: Some(22888.0),
            p50_us: Some(12.5),
            p99_us: Some(40.0),
            cpu_s_per_gib: Some(0.25),
        }]
    }

    fn opts(json: bool, plot: &str) -> RunOpts {
        RunOpts {
            sizes: None,
            duration: 2.0,
            json,
            plot: Some(plot.into()),
            tests: "both".into(),
        }
    }

    #[test]
    fn the_results_are_printed_whether_or_not_the_plot_can_be_written() {
        let plot = std::env::temp_dir()
            .join(format!("sdp-bench-gone-{}", std::process::id()))
            .join("x.svg");
        let mut out = Vec::new();
        let e = report(&rows(), &opts(false, plot.to_str().unwrap()), &mut out).unwrap_err();
        let table = String::from_utf8(out).unwrap();
        assert!(table.starts_with("transport"), "{table}");
        assert!(table.contains("64K") && table.contains("1500.0"), "{table}");
        let e = e.to_string();
        assert!(
            e.contains("could not write the plot to") && e.contains("x.svg"),
            "{e}"
        );
        assert!(e.contains("results are printed above"), "{e}");

        let dir = std::env::temp_dir().join(format!("sdp-bench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plot = dir.join("ok.svg");
        let mut out = Vec::new();
        report(&rows(), &opts(false, plot.to_str().unwrap()), &mut out).unwrap();
        assert!(String::from_utf8(out).unwrap().contains("64K"));
        assert!(std::fs::read_to_string(&plot).unwrap().starts_with("<svg"));
        // JSON: the rows went out as they came; the table is not printed.
        let mut out = Vec::new();
        report(&rows(), &opts(true, plot.to_str().unwrap()), &mut out).unwrap();
        assert!(out.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
