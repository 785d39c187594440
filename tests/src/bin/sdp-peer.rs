//! A peer process for the socket API tests (tests/tests/socket.rs): the other end of a
//! connection in another process, so the tests exercise SDP between real processes.
//!
//! * `duplex ADDR MODE SEED_TX SEED_RX BYTES`: connect, send BYTES of the seeded stream SEED_TX
//!   in random sizes while reading and checking BYTES of the seeded stream SEED_RX; then EOF.
//! * `flood ADDR [CHUNK]`: connect and write CHUNK bytes at a time (default 64 KiB; 1 MiB
//!   writes go by zero copy) until killed or the connection fails.
//! * `connect ADDR CHOICE`: connect (auto | sdp), print the transport or the errno, exit.
//! * `serve ADDR MODE SEED_TX SEED_RX BYTES`: listen (automatic mode) on ADDR, print
//!   `listening T1,T2 (why others are missing)`, accept one client, print `accepted T`, then
//!   the duplex exchange as above (the rig runs this against `duplex` over RDMA).
//! * `write-exit ADDR CHOICE MODE BYTES END`: connect (tcp | sdp), write BYTES of the seeded
//!   stream 7 (MODE auto: large writes may go by zero copy; bcopy: by copy), then END:
//!   `exit` calls `process::exit` with the stream still open (no close), `close` drops it and
//!   returns from main, `abort` waits until the peer holds every byte (`send_queue_len` 0) and
//!   then resets the connection (SO_LINGER {1, 0} and close), `kill` waits the same and then
//!   kills this process with SIGKILL (a crash: TCP's kernel closes the connection in order).
//! * `fork ADDR`: the fork() checks (parent keeps its stream, child opens a new one, the
//!   child's inherited copy fails and does not disturb the parent), exec leaves no fd behind.
//! * `hold ADDR`: connect over SDP, print `connected`, read (1 MiB reads: zero copy where the
//!   peer sends so) until EOF or an error, print `eof BYTES` or `errno N BYTES`, exit.
//! * `connect-kill ADDR`: connect over SDP and SIGKILL this process at once (a peer that
//!   dies right after the handshake).
//! * `fake-listen ADDR END`: a listener that dies in the handshake: bind the shm rendezvous
//!   socket of ADDR itself, print `ready`, take one connection and then (END `kill`) read the
//!   connect request and SIGKILL this process without answering, or (END `hang`) never
//!   answer (until killed).
//! * `exchange ADDR CHOICE BYTES ROUNDS`: single-threaded, each round writes BYTES of pattern
//!   1 in one `write_all`, then reads BYTES of pattern 2 (the other end does the same with the
//!   patterns swapped); prints `ok MS` (the milliseconds taken).
//! * `echo ADDR CHOICE PIECE`: single-threaded echo: read up to PIECE bytes, write them back,
//!   until EOF; then shut the write half and print `ok BYTES`.
//! * `zsend ADDR CHOICE BYTES`: write BYTES of pattern 3 in one blocking write (a zero-copy
//!   source in auto mode), again and again until killed.
//!
//! * `pp-serve ADDR SIZE`: listen, accept one client and echo SIZE-byte messages until EOF.
//! * `pp ADDR CHOICE SIZE ITERS`: ping-pong SIZE-byte messages (after a warm-up) through the
//!   blocking socket API, as an application would; prints `PP-CLIENT transport=T size=...
//!   rtt_p50_usec=...` (sdp-rigtest's ping-pong drives the driver itself, with its own wait).
//!
//! `SDP_PEER_LISTEN=sdp` makes `serve` and `pp-serve` listen over SDP only (no kernel TCP listener: what SDP
//! over iWARP needs, whose connections use TCP's ports). `SDP_PEER_SRC=IP` sets the
//! connector's source address (`Options::source_ip`), so over RDMA the connection leaves
//! through that address's device; `SDP_PEER_SHOW=1` makes `duplex`
//! print the stream's transport before `ok`. `SDP_PEER_SRCAVAIL_TIMEOUT_MS=N` gives SDP over
//! shm a stack of its own with `srcavail_timeout` N ms (tests take that safety net away to
//! show a behaviour does not rest on it).

use std::io::{Read, Write};
use std::net::Shutdown;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sdp_core::socket::{Options, SdpListener, SdpStream};
use sdp_tests::context_switches;

fn die(msg: String) -> ! {
    eprintln!("sdp-peer: {msg}");
    std::process::exit(2)
}

/// The seeded byte stream both sides agree on, the same however it is cut into pieces (the
/// generator makes whole blocks; pieces are served out of them).
pub struct Pattern {
    rng: ChaCha8Rng,
    block: Box<[u8; 4096]>,
    pos: usize,
}
impl Pattern {
    pub fn new(seed: u64) -> Pattern {
        Pattern {
            rng: ChaCha8Rng::seed_from_u64(seed),
            block: Box::new([0; 4096]),
            pos: 4096,
        }
    }
    pub fn fill(&mut self, mut b: &mut [u8]) {
        while !b.is_empty() {
            if self.pos == self.block.len() {
                self.rng.fill(&mut self.block[..]);
                self.pos = 0;
            }
            let n = b.len().min(self.block.len() - self.pos);
            b[..n].copy_from_slice(&self.block[self.pos..self.pos + n]);
            self.pos += n;
            b = &mut b[n..];
        }
    }
}

fn options(choice: &str) -> Options {
    let mut opts = match choice {
        "tcp" => Options::tcp_only(),
        "auto" => Options::auto(),
        _ => Options::sdp_only(),
    };
    if let Ok(ms) = std::env::var("SDP_PEER_SRCAVAIL_TIMEOUT_MS") {
        let ms: u64 = ms
            .parse()
            .unwrap_or_else(|e| die(format!("SDP_PEER_SRCAVAIL_TIMEOUT_MS: {e}")));
        let cfg = sdp_core::proto::Config {
            srcavail_timeout: std::time::Duration::from_millis(ms),
            ..sdp_core::proto::Config::default()
        };
        let provider = sdp_core::verbs::shm::ShmProvider::new()
            .unwrap_or_else(|e| die(format!("shm provider: {e}")));
        let stack = sdp_core::socket::Stack::with_provider(provider, cfg)
            .unwrap_or_else(|e| die(format!("stack: {e}")));
        opts = opts.with_stack(stack);
    }
    match std::env::var("SDP_PEER_SRC") {
        Ok(ip) => opts.with_source_ip(
            ip.parse()
                .unwrap_or_else(|e| die(format!("SDP_PEER_SRC {ip:?}: {e}"))),
        ),
        Err(_) => opts,
    }
}

fn connect(addr: &str, mode: &str) -> SdpStream {
    let opts = options(mode);
    let s = SdpStream::connect_with(addr, &opts).unwrap_or_else(|e| die(format!("connect: {e}")));
    s.set_zero_copy(mode != "bcopy");
    s
}

/// Send `bytes` of pattern `tx` in random sizes; read and check `bytes` of pattern `rx`.
pub fn duplex(s: SdpStream, mode: &str, tx: u64, rx: u64, bytes: u64) -> Result<(), String> {
    let w = s.try_clone().map_err(|e| e.to_string())?;
    let registered = mode == "zcopy";
    let writer = std::thread::spawn(move || -> Result<(), String> {
        let mut p = Pattern::new(tx);
        let mut sizes = ChaCha8Rng::seed_from_u64(tx ^ 0x55);
        let mut rb = if registered {
            Some(w.register(1 << 20).map_err(|e| e.to_string())?)
        } else {
            None
        };
        let mut buf = vec![0u8; 1 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = (sizes.random_range(1..=1usize << 20) as u64).min(left) as usize;
            match rb.as_mut() {
                Some(rb) => {
                    p.fill(&mut rb.as_mut_slice()[..n]);
                    let sent = w.send_registered(rb, 0..n).map_err(|e| e.to_string())?;
                    if sent != n {
                        return Err(format!("send_registered sent {sent} of {n}"));
                    }
                }
                None => {
                    p.fill(&mut buf[..n]);
                    (&w).write_all(&buf[..n]).map_err(|e| e.to_string())?;
                }
            }
            left -= n as u64;
        }
        w.shutdown(Shutdown::Write).map_err(|e| e.to_string())
    });
    let mut p = Pattern::new(rx);
    let mut sizes = ChaCha8Rng::seed_from_u64(rx ^ 0xaa);
    let mut buf = vec![0u8; 1 << 20];
    let mut want = vec![0u8; 1 << 20];
    let mut rb = if registered {
        Some(s.register(1 << 20).map_err(|e| e.to_string())?)
    } else {
        None
    };
    let mut got = 0u64;
    loop {
        let cap = sizes.random_range(1..=1usize << 20);
        let n = match rb.as_mut() {
            Some(rb) => {
                let n = s.recv_registered(rb, 0..cap).map_err(|e| e.to_string())?;
                buf[..n].copy_from_slice(&rb.as_slice()[..n]);
                n
            }
            None => (&s).read(&mut buf[..cap]).map_err(|e| e.to_string())?,
        };
        if n == 0 {
            break;
        }
        p.fill(&mut want[..n]);
        if buf[..n] != want[..n] {
            let i = (0..n).find(|&i| buf[i] != want[i]).unwrap_or(0);
            return Err(format!("byte {} differs", got + i as u64));
        }
        got += n as u64;
    }
    if got != bytes {
        return Err(format!("EOF after {got} of {bytes} bytes"));
    }
    writer.join().map_err(|_| "writer panicked".to_string())?
}

/// Single-threaded rounds: write `bytes` of pattern `tx` in one `write_all`, then read and
/// check `bytes` of pattern `rx`.
pub fn exchange(
    mut s: &SdpStream,
    bytes: usize,
    rounds: usize,
    tx: u64,
    rx: u64,
) -> Result<(), String> {
    let (mut ptx, mut prx) = (Pattern::new(tx), Pattern::new(rx));
    let mut out = vec![0u8; bytes];
    let mut got = vec![0u8; bytes];
    let mut want = vec![0u8; bytes];
    for r in 0..rounds {
        ptx.fill(&mut out);
        s.write_all(&out)
            .map_err(|e| format!("round {r}: write: {e}"))?;
        s.read_exact(&mut got)
            .map_err(|e| format!("round {r}: read: {e}"))?;
        prx.fill(&mut want);
        if got != want {
            return Err(format!("round {r}: data differs"));
        }
    }
    Ok(())
}

/// Single-threaded echo: read up to `piece` bytes, write them straight back, until EOF; then
/// shut the write half. Returns the bytes echoed.
pub fn echo(mut s: &SdpStream, piece: usize) -> Result<u64, String> {
    let mut buf = vec![0u8; piece];
    let mut total = 0u64;
    loop {
        let n = s.read(&mut buf).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            break;
        }
        s.write_all(&buf[..n]).map_err(|e| format!("write: {e}"))?;
        total += n as u64;
    }
    s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
    Ok(total)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| {
        args.get(i)
            .cloned()
            .unwrap_or_else(|| die(format!("missing argument {i}")))
    };
    match arg(0).as_str() {
        "duplex" => {
            let mode = arg(2);
            let s = connect(&arg(1), &mode);
            let n = |i| {
                arg(i)
                    .parse::<u64>()
                    .unwrap_or_else(|e| die(format!("{e}")))
            };
            if std::env::var_os("SDP_PEER_SHOW").is_some() {
                println!("transport {}", s.transport());
            }
            match duplex(s, &mode, n(3), n(4), n(5)) {
                Ok(()) => println!("ok"),
                Err(e) => die(e),
            }
        }
        "serve" => {
            let mode = arg(2);
            let n = |i| {
                arg(i)
                    .parse::<u64>()
                    .unwrap_or_else(|e| die(format!("{e}")))
            };
            let l = listen(&arg(1));
            let (ts, why) = l.sdp_transports();
            let names: Vec<String> = ts.iter().map(|t| t.to_string()).collect();
            println!(
                "listening {} ({})",
                names.join(","),
                why.unwrap_or_else(|| "all SDP providers listening".into())
            );
            let _ = std::io::stdout().flush();
            let (s, _) = l.accept().unwrap_or_else(|e| die(format!("accept: {e}")));
            println!("accepted {}", s.transport());
            let _ = std::io::stdout().flush();
            s.set_zero_copy(mode != "bcopy");
            match duplex(s, &mode, n(3), n(4), n(5)) {
                Ok(()) => println!("ok"),
                Err(e) => die(e),
            }
        }
        "flood" => {
            let mut s = connect(&arg(1), "sdp");
            println!("{}", s.transport());
            let _ = std::io::stdout().flush();
            let chunk = args.get(2).map_or(64 << 10, |c| {
                c.parse().unwrap_or_else(|e| die(format!("{e}")))
            });
            let buf = vec![7u8; chunk];
            loop {
                if let Err(e) = s.write_all(&buf) {
                    die(format!("write: {e}"));
                }
            }
        }
        "connect" => {
            let opts = options(if arg(2) == "auto" { "auto" } else { "sdp" });
            match SdpStream::connect_with(arg(1).as_str(), &opts) {
                Ok(mut s) => {
                    let _ = s.write_all(b"hi");
                    println!("{}", s.transport());
                }
                Err(e) => println!("errno {}", e.raw_os_error().unwrap_or(-1)),
            }
        }
        "write-exit" => {
            let bytes = arg(4)
                .parse::<usize>()
                .unwrap_or_else(|e| die(format!("{e}")));
            write_exit(&arg(1), &arg(2), &arg(3), bytes, &arg(5))
        }
        "fork" => fork_checks(&arg(1)),
        "hold" => hold(&arg(1)),
        "connect-kill" => {
            let s = connect(&arg(1), "sdp");
            // SAFETY: kills this very process, as a crash right after connect would.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            drop(s);
        }
        "fake-listen" => fake_listen(&arg(1), &arg(2)),
        "exchange" => {
            let n = |i| {
                arg(i)
                    .parse::<usize>()
                    .unwrap_or_else(|e| die(format!("{e}")))
            };
            let s = connect(&arg(1), &arg(2));
            let t = std::time::Instant::now();
            match exchange(&s, n(3), n(4), 1, 2) {
                Ok(()) => println!("ok {}", t.elapsed().as_millis()),
                Err(e) => die(e),
            }
        }
        "drain" => {
            // Read everything until EOF or an error, then say how many bytes (over SDP, or
            // over the transport named by a second argument).
            let mut s = connect(&arg(1), args.get(2).map_or("sdp", |c| c.as_str()));
            let mut buf = vec![0u8; 1 << 20];
            let mut total = 0u64;
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    break;
                }
                total += n as u64;
            }
            println!("ok {total}");
        }
        "echo" => {
            let piece = arg(3)
                .parse::<usize>()
                .unwrap_or_else(|e| die(format!("{e}")));
            let s = connect(&arg(1), &arg(2));
            match echo(&s, piece) {
                Ok(n) => println!("ok {n}"),
                Err(e) => die(e),
            }
        }
        "zsend" => {
            let n = arg(3)
                .parse::<usize>()
                .unwrap_or_else(|e| die(format!("{e}")));
            let mut s = connect(&arg(1), &arg(2));
            let mut buf = vec![0u8; n];
            Pattern::new(3).fill(&mut buf);
            loop {
                if let Err(e) = s.write_all(&buf) {
                    die(format!("write: {e}"));
                }
            }
        }
        "pp-serve" => {
            let l = listen(&arg(1));
            let (mut s, _) = l.accept().unwrap_or_else(|e| die(format!("accept: {e}")));
            let _ = s.set_nodelay(true);
            let mut buf = vec![0u8; num(&arg(2)) as usize];
            let mut n = 0u64;
            let cs0 = context_switches();
            loop {
                match read_full(&mut s, &mut buf) {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => die(format!("read: {e}")),
                }
                s.write_all(&buf)
                    .unwrap_or_else(|e| die(format!("write: {e}")));
                n += 1;
            }
            println!(
                "PP-SERVER transport={} exchanges={n} {}",
                s.transport(),
                switches_per(cs0, n)
            );
        }
        "pp" => {
            let (size, iters) = (num(&arg(3)) as usize, num(&arg(4)));
            let mut s = connect(&arg(1), &arg(2));
            let _ = s.set_nodelay(true);
            let warm = (iters / 10).clamp(5, 100);
            let mut out = vec![0u8; size];
            let mut back = vec![0u8; size];
            let mut rtts = Vec::with_capacity(iters as usize);
            let mut cs0 = context_switches();
            for i in 0..warm + iters {
                if i == warm {
                    cs0 = context_switches();
                }
                for (k, b) in out.iter_mut().enumerate() {
                    *b = (i as usize * 7 + k * 131) as u8;
                }
                let t = std::time::Instant::now();
                s.write_all(&out)
                    .unwrap_or_else(|e| die(format!("write: {e}")));
                match read_full(&mut s, &mut back) {
                    Ok(true) => {}
                    Ok(false) => die(format!("exchange {i}: EOF")),
                    Err(e) => die(format!("exchange {i}: read: {e}")),
                }
                if i >= warm {
                    rtts.push(t.elapsed().as_secs_f64() * 1e6);
                }
                if back != out {
                    die(format!("exchange {i}: the echo differs from what was sent"));
                }
            }
            s.shutdown(Shutdown::Write)
                .unwrap_or_else(|e| die(format!("shutdown: {e}")));
            rtts.sort_by(f64::total_cmp);
            let pct = |p: f64| rtts[((rtts.len() as f64 - 1.0) * p).round() as usize];
            let avg = rtts.iter().sum::<f64>() / rtts.len() as f64;
            println!(
                "PP-CLIENT transport={} size={size} iters={iters} rtt_p50_usec={:.1} rtt_p99_usec={:.1} rtt_min_usec={:.1} rtt_avg_usec={avg:.1} {}",
                s.transport(),
                pct(0.5),
                pct(0.99),
                rtts[0],
                switches_per(cs0, iters)
            );
        }
        other => die(format!("unknown command {other}")),
    }
}

/// The process's context switches since `from`, per exchange of `n`.
fn switches_per(from: (i64, i64), n: u64) -> String {
    let now = context_switches();
    let n = n.max(1) as f64;
    format!(
        "csw_per_exchange={:.2}/{:.2}",
        (now.0 - from.0) as f64 / n,
        (now.1 - from.1) as f64 / n
    )
}

fn num(s: &str) -> u64 {
    s.parse().unwrap_or_else(|e| die(format!("{s:?}: {e}")))
}

/// A listener on `addr`: automatic, or SDP only with `SDP_PEER_LISTEN=sdp`.
fn listen(addr: &str) -> SdpListener {
    match std::env::var("SDP_PEER_LISTEN").as_deref() {
        Ok("sdp") => SdpListener::bind_with(addr, &Options::sdp_only()),
        _ => SdpListener::bind(addr),
    }
    .unwrap_or_else(|e| die(format!("bind: {e}")))
}

/// Fill `buf` from `s`: true when full, false at EOF before the first byte.
fn read_full(s: &mut SdpStream, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..])? {
            0 if got == 0 => return Ok(false),
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    Ok(true)
}

/// fork(): the parent's stream keeps working, the child's inherited copy fails without
/// touching the connection, the child opens a stream of its own; exec leaves no fd behind.
fn fds_across_exec() -> Vec<String> {
    let out = std::process::Command::new("/bin/ls")
        .arg("/proc/self/fd")
        .output()
        .unwrap_or_else(|e| die(format!("exec ls: {e}")));
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

fn fork_checks(addr: &str) {
    // What a child inherits before any SDP socket exists (the test runner may pass some).
    let before = fds_across_exec();
    let mut s = connect(addr, "sdp");
    s.write_all(b"parent-1")
        .unwrap_or_else(|e| die(format!("write before fork: {e}")));
    // SAFETY: the child only makes new streams (a new runtime), reads /proc and exits or
    // execs; it never touches locks another thread of the parent might hold, except through
    // the socket layer, which makes a fresh runtime after fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        die("fork failed".into());
    }
    if pid == 0 {
        let code = (|| -> Result<(), String> {
            // The inherited stream belongs to the parent.
            if (&s).write(b"x").is_ok() {
                return Err("inherited stream worked in the child".into());
            }
            let mut c = connect(addr, "sdp");
            c.write_all(b"child").map_err(|e| e.to_string())?;
            c.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
            let mut rest = Vec::new();
            c.read_to_end(&mut rest).map_err(|e| e.to_string())?;
            if rest != b"child" {
                return Err(format!("child echo {rest:?}"));
            }
            Ok(())
        })();
        let code = match code {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("sdp-peer child: {e}");
                3
            }
        };
        // SAFETY: leave without running the parent's destructors in the child, but through
        // exit(3), so the socket layer's exit flush runs here too and must leave the parent's
        // connection alone.
        unsafe { libc::exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child we just forked.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        die(format!("child failed: status {status:#x}"));
    }
    // The parent's stream still works.
    s.write_all(b"parent-2")
        .unwrap_or_else(|e| die(format!("write after fork: {e}")));
    // exec: every fd the socket layer made is close-on-exec.
    let after = fds_across_exec();
    let leaked: Vec<&String> = after.iter().filter(|f| !before.contains(f)).collect();
    if !leaked.is_empty() {
        die(format!(
            "fds left open across exec: {leaked:?} (before: {before:?})"
        ));
    }
    s.shutdown(Shutdown::Write)
        .unwrap_or_else(|e| die(format!("shutdown: {e}")));
    let mut rest = Vec::new();
    s.read_to_end(&mut rest)
        .unwrap_or_else(|e| die(format!("read: {e}")));
    if rest != b"parent-1parent-2" {
        die(format!("parent echo {:?}", String::from_utf8_lossy(&rest)));
    }
    println!("ok");
}

/// Write `bytes` of pattern 7 and end as `end` says (see the header).
fn write_exit(addr: &str, choice: &str, mode: &str, bytes: usize, end: &str) {
    let mut s = connect(addr, choice);
    s.set_zero_copy(mode != "bcopy");
    let mut data = vec![0u8; bytes];
    Pattern::new(7).fill(&mut data);
    s.write_all(&data)
        .unwrap_or_else(|e| die(format!("write: {e}")));
    match end {
        "exit" => std::process::exit(0),
        "close" => drop(s),
        "abort" | "kill" => {
            let t = std::time::Instant::now();
            while s.send_queue_len().unwrap_or(0) > 0 {
                if t.elapsed() > std::time::Duration::from_secs(20) {
                    die("the peer never took the data".into());
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if end == "abort" {
                s.set_linger(Some(std::time::Duration::ZERO))
                    .unwrap_or_else(|e| die(format!("SO_LINGER: {e}")));
                drop(s);
                std::process::exit(0);
            }
            // SAFETY: kills this very process, as a crash would.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            unreachable!("SIGKILL returned");
        }
        other => die(format!("unknown end {other}")),
    }
}

/// `hold ADDR` (see the header).
fn hold(addr: &str) {
    let mut s = connect(addr, "sdp");
    println!("connected");
    let _ = std::io::stdout().flush();
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    loop {
        match s.read(&mut buf) {
            Ok(0) => {
                println!("eof {got}");
                return;
            }
            Ok(n) => got += n as u64,
            Err(e) => {
                println!("errno {} {got}", e.raw_os_error().unwrap_or(-1));
                return;
            }
        }
    }
}

/// `fake-listen ADDR END` (see the header): the shm provider's rendezvous is an abstract
/// SOCK_SEQPACKET socket named `sdp-shm/ADDR`.
fn fake_listen(addr: &str, end: &str) {
    let name = format!("sdp-shm/{addr}");
    // SAFETY: plain socket calls on a socket this process owns; sockaddr_un is plain data and
    // the name fits (checked).
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            die("socket failed".into());
        }
        let mut a: libc::sockaddr_un = std::mem::zeroed();
        a.sun_family = libc::AF_UNIX as libc::sa_family_t;
        if name.len() + 1 > a.sun_path.len() {
            die("name too long".into());
        }
        for (i, b) in name.bytes().enumerate() {
            a.sun_path[i + 1] = b as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
        if libc::bind(
            fd,
            (&a as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        ) != 0
            || libc::listen(fd, 8) != 0
        {
            die(format!("bind {name}: {}", std::io::Error::last_os_error()));
        }
        println!("ready");
        let _ = std::io::stdout().flush();
        let c = libc::accept(fd, std::ptr::null_mut(), std::ptr::null_mut());
        if c < 0 {
            die("accept failed".into());
        }
        match end {
            "kill" => {
                // The connect request (with the connector's fds), then die unanswered.
                let mut buf = [0u8; 512];
                let mut cmsg = [0u8; 256];
                let mut iov = libc::iovec {
                    iov_base: buf.as_mut_ptr().cast(),
                    iov_len: buf.len(),
                };
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = &mut iov;
                msg.msg_iovlen = 1;
                msg.msg_control = cmsg.as_mut_ptr().cast();
                msg.msg_controllen = cmsg.len() as _;
                libc::recvmsg(c, &mut msg, 0);
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            _ => loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            },
        }
    }
}
