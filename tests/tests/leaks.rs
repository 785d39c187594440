//! Every resource a connection takes (fds, memory regions, the shm inboxes' memfd mappings,
//! engine buffers, connection entries) is given back on every error path (issue 14): the
//! process's counts are taken before a fault matrix over shm between processes, and after each
//! fault (given the runtime a bounded time to settle) they must be back where they were.
//!
//! One test in this binary: the counts are the whole process's (open fds, mappings), so
//! nothing else may run beside it.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sdp_core::proto::Config;
use sdp_core::socket::{Options, SdpListener, SdpStream, Stack};
use sdp_core::verbs::shm::ShmProvider;

const PEER: &str = env!("CARGO_BIN_EXE_sdp-peer");

/// A stack of its own (counted apart from anything else) and its provider.
struct Counted {
    stack: Stack,
    provider: ShmProvider,
}

impl Counted {
    fn new(cfg: Config) -> Counted {
        let provider = ShmProvider::new().unwrap();
        let stack = Stack::with_provider(provider.clone(), cfg).unwrap();
        Counted { stack, provider }
    }
    fn opts(&self) -> Options {
        Options::sdp_only().with_stack(self.stack.clone())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Counts {
    /// Open fds of the process (`/proc/self/fd`).
    fds: usize,
    /// Mappings of shm inboxes (ours and peers') and of peers' key tables (`/proc/self/maps`).
    inbox_maps: usize,
    key_maps: usize,
    /// Per stack: connections, bytes the engines registered, regions registered on the
    /// provider (engine buffers and application memory registered for zero copy).
    conns: Vec<usize>,
    engine_bytes: Vec<usize>,
    regions: Vec<usize>,
}

fn counts(stacks: &[&Counted]) -> Counts {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    Counts {
        fds: std::fs::read_dir("/proc/self/fd").unwrap().count(),
        inbox_maps: maps.lines().filter(|l| l.contains("sdp-shm-inbox")).count(),
        key_maps: maps.lines().filter(|l| l.contains("sdp-shm-keys")).count(),
        conns: stacks.iter().map(|s| s.stack.conn_count()).collect(),
        engine_bytes: stacks.iter().map(|s| s.stack.registered_bytes()).collect(),
        regions: stacks
            .iter()
            .map(|s| s.provider.registered_regions())
            .collect(),
    }
}

/// After a fault: within `SETTLE` every count is back at `base`.
const SETTLE: Duration = Duration::from_secs(4);

fn settled(what: &str, stacks: &[&Counted], base: &Counts) {
    let t = Instant::now();
    loop {
        let now = counts(stacks);
        if now == *base {
            eprintln!("{what}: back to the baseline after {:?}", t.elapsed());
            return;
        }
        assert!(
            t.elapsed() < SETTLE,
            "{what}: resources not given back within {SETTLE:?}:\n  baseline {base:?}\n  now      {now:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn peer(args: &[&str]) -> Child {
    Command::new(PEER)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// The peer's first line of output.
fn first_line(c: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(c.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    line.trim().to_string()
}

/// Wait for the peer to end (killing it after `limit`); its remaining output.
fn finish(c: Child, limit: Duration) -> String {
    let t = Instant::now();
    let mut c = c;
    while c.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            let _ = c.kill();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = c.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn kill(c: Child) {
    let mut c = c;
    c.kill().unwrap();
    c.wait().unwrap();
}

fn listen(on: &Counted) -> (SdpListener, String) {
    let l = SdpListener::bind_with("127.0.0.1:0", &on.opts()).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

/// Accept within `limit`.
fn accept(l: &SdpListener, limit: Duration) -> Option<SdpStream> {
    l.set_nonblocking(true).unwrap();
    let t = Instant::now();
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).unwrap();
                return Some(s);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock && t.elapsed() < limit => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return None,
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// Read until EOF or an error; bytes read and how it ended.
fn drain(s: &mut SdpStream) -> (u64, String) {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (got, "eof".into()),
            Ok(n) => got += n as u64,
            Err(e) => return (got, format!("{:?}", e.kind())),
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn every_fault_gives_back_every_resource() {
    let ls = Counted::new(Config::default());
    let cs = Counted::new(Config::default());
    let ts = Counted::new(Config {
        unaccepted_timeout: Some(Duration::from_millis(500)),
        ..Config::default()
    });
    let all = [&ls, &cs, &ts];
    // Warm up (first use of each stack), then take the baseline.
    {
        let (l, addr) = listen(&ls);
        let mut c = SdpStream::connect_with(addr.as_str(), &cs.opts()).unwrap();
        let mut a = accept(&l, Duration::from_secs(5)).unwrap();
        c.write_all(b"warm").unwrap();
        let mut b = [0u8; 4];
        a.read_exact(&mut b).unwrap();
        let (l2, addr2) = listen(&ts);
        let c2 = SdpStream::connect_with(addr2.as_str(), &cs.opts()).unwrap();
        let a2 = accept(&l2, Duration::from_secs(5)).unwrap();
        drop((c, a, c2, a2, l, l2));
    }
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    // The connections gone, and the peer providers each stack kept a while after them (their
    // mappings and eventfds, for connections that follow) let go.
    while all
        .iter()
        .any(|s| s.stack.conn_count() > 0 || s.provider.kept_peer_providers() > 0)
    {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "warm-up connections linger"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let base = counts(&all);
    eprintln!("baseline {base:?}");
    assert!(base.conns.iter().all(|&n| n == 0));

    // 1. Connect refused: nobody listens there.
    {
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let e = SdpStream::connect_with(addr, &cs.opts()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED));
        settled("connect refused", &all, &base);
    }

    // 2. The listener dies in the handshake: it takes our connect request and is killed.
    {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut p = peer(&["fake-listen", &addr, "kill"]);
        assert_eq!(first_line(&mut p), "ready");
        let e = SdpStream::connect_with(addr.as_str(), &cs.opts()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED), "{e}");
        finish(p, Duration::from_secs(5));
        settled("listener killed mid-handshake", &all, &base);
    }

    // 3. The listener never answers: our connect times out and gives up.
    {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut p = peer(&["fake-listen", &addr, "hang"]);
        assert_eq!(first_line(&mut p), "ready");
        let mut o = cs.opts();
        o.connect_timeout = Some(Duration::from_millis(300));
        // (The pipe from the peer is an fd of ours too.)
        drop(p.stdout.take());
        let e = SdpStream::connect_with(addr.as_str(), &o).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        settled("connect timed out (listener silent)", &all, &base);
        kill(p);
        settled("connect timed out, listener gone", &all, &base);
    }

    // 3b. The listener's queue is full: our connect waits, trying again, and gives up.
    {
        let mut o = ls.opts().with_backlog(0);
        let l = SdpListener::bind_with("127.0.0.1:0", &o).unwrap();
        let addr = l.local_addr().unwrap();
        let first = SdpStream::connect_with(addr, &cs.opts()).unwrap();
        o = cs.opts();
        o.connect_timeout = Some(Duration::from_millis(400));
        let e = SdpStream::connect_with(addr, &o).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        drop((first, l));
        settled("connect beyond a full queue gave up", &all, &base);
    }

    // 4. The connector dies right after the handshake, before or after we accept.
    {
        let (l, addr) = listen(&ls);
        for round in 0..4 {
            let p = peer(&["connect-kill", &addr]);
            if round % 2 == 0 {
                finish(p, Duration::from_secs(10));
                // Established before it died: accept hands it over (as TCP), reset.
                while let Some(mut s) = accept(&l, Duration::from_millis(300)) {
                    let _ = drain(&mut s);
                }
            } else if let Some(mut s) = accept(&l, Duration::from_secs(5)) {
                let _ = drain(&mut s);
                finish(p, Duration::from_secs(10));
            }
        }
        drop(l);
        settled("connector killed after the handshake", &all, &base);
    }

    // 5. The peer is killed mid-transfer: it writes by copy, by zero copy; it reads what we
    //    write by zero copy (blocking writes, and registered sends in flight).
    for chunk in ["65536", "1048576"] {
        let (l, addr) = listen(&ls);
        let p = peer(&["flood", &addr, chunk]);
        let mut s = accept(&l, Duration::from_secs(10)).expect("flood connects");
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        while got < 16 << 20 {
            got += s.read(&mut buf).unwrap();
        }
        kill(p);
        let (_, end) = drain(&mut s);
        assert!(end == "eof" || end == "ConnectionReset", "{end}");
        drop((s, l));
        settled(
            &format!("writer killed mid-transfer ({chunk}-byte writes)"),
            &all,
            &base,
        );
    }
    {
        let (l, addr) = listen(&ls);
        let mut p = peer(&["hold", &addr]);
        let s = accept(&l, Duration::from_secs(10)).expect("hold connects");
        assert_eq!(first_line(&mut p), "connected");
        let w = s.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            let data = vec![3u8; 1 << 20];
            let mut sent = 0u64;
            loop {
                match (&w).write(&data) {
                    Ok(n) => sent += n as u64,
                    Err(_) => return sent,
                }
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        kill(p);
        writer.join().unwrap();
        drop((s, l));
        settled("reader killed mid-transfer (zero-copy writes)", &all, &base);
    }
    {
        let (l, addr) = listen(&ls);
        let mut p = peer(&["hold", &addr]);
        let s = accept(&l, Duration::from_secs(10)).expect("hold connects");
        assert_eq!(first_line(&mut p), "connected");
        let mut pending = Vec::new();
        for _ in 0..4 {
            let rb = s.register(4 << 20).unwrap();
            pending.push(s.send_registered_async(rb, 0..(4 << 20)).unwrap());
        }
        kill(p);
        for ps in pending {
            let _ = ps.wait();
        }
        drop((s, l));
        settled("reader killed with registered sends in flight", &all, &base);
    }

    // 6. We close mid-transfer: with the peer's data unread (a reset, as TCP's close with
    //    unread data: the abort path), and with our own writes still queued (they go first).
    {
        let (l, addr) = listen(&ls);
        let p = peer(&["flood", &addr]);
        let mut s = accept(&l, Duration::from_secs(10)).expect("flood connects");
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        while got < 4 << 20 {
            got += s.read(&mut buf).unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
        drop(s);
        let out = finish(p, Duration::from_secs(10));
        assert_eq!(out, "shm", "the writer ends with an error after the reset");
        drop(l);
        settled("closed with unread data (abort)", &all, &base);
    }
    {
        let (l, addr) = listen(&ls);
        let mut p = peer(&["hold", &addr]);
        let s = accept(&l, Duration::from_secs(10)).expect("hold connects");
        assert_eq!(first_line(&mut p), "connected");
        s.set_nonblocking(true).unwrap();
        let data = vec![5u8; 1 << 20];
        let mut sent = 0u64;
        for _ in 0..64 {
            match (&s).write(&data) {
                Ok(n) => sent += n as u64,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        drop(s);
        let out = finish(p, Duration::from_secs(20));
        assert_eq!(
            out,
            format!("eof {sent}"),
            "closed with writes queued: all of it, then EOF"
        );
        drop(l);
        settled("closed with our writes queued", &all, &base);
    }

    // 7. Shutdown, then close.
    {
        let (l, addr) = listen(&ls);
        let mut p = peer(&["hold", &addr]);
        let mut s = accept(&l, Duration::from_secs(10)).expect("hold connects");
        assert_eq!(first_line(&mut p), "connected");
        s.write_all(&vec![9u8; 3 << 20]).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(
            finish(p, Duration::from_secs(20)),
            format!("eof {}", 3 << 20)
        );
        let (_, end) = drain(&mut s);
        assert_eq!(end, "eof");
        drop((s, l));
        settled("shutdown then close", &all, &base);
    }

    // 8. Connections nobody accepts time out (Config::unaccepted_timeout on that stack).
    {
        let (l, addr) = listen(&ts);
        let listening = counts(&all);
        let mut ps: Vec<Child> = (0..3).map(|_| peer(&["hold", &addr])).collect();
        for p in &mut ps {
            assert_eq!(first_line(p), "connected");
        }
        for p in ps {
            let out = finish(p, Duration::from_secs(10));
            assert_eq!(out, format!("errno {} 0", libc::ECONNRESET));
        }
        settled("unaccepted connections timed out", &all, &listening);
        drop(l);
        settled(
            "unaccepted connections timed out, listener closed",
            &all,
            &base,
        );
    }

    // 9. The listener is closed with connections waiting in its queue.
    {
        let (l, addr) = listen(&ls);
        let mut ps: Vec<Child> = (0..3).map(|_| peer(&["hold", &addr])).collect();
        for p in &mut ps {
            assert_eq!(first_line(p), "connected");
        }
        drop(l);
        for p in ps {
            let out = finish(p, Duration::from_secs(10));
            assert_eq!(out, format!("errno {} 0", libc::ECONNRESET));
        }
        settled("listener closed with waiting connections", &all, &base);
    }
}
