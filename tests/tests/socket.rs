//! The socket API between real processes on this host (the shm transport), checked against
//! kernel TCP wherever TCP defines the behaviour: the same scenario runs over both and must
//! give the same observable result.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sdp_core::socket::{Options, SdpListener, SdpStream, Stack, Transport};

const PEER: &str = env!("CARGO_BIN_EXE_sdp-peer");

fn listen(opts: &Options) -> SdpListener {
    SdpListener::bind_with("127.0.0.1:0", opts).expect("bind")
}

/// A connected pair in this process over the transport `opts` chooses.
fn pair(opts: &Options) -> (SdpStream, SdpStream) {
    let l = listen(opts);
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || l.accept().unwrap().0);
    let c = SdpStream::connect_with(addr, opts).unwrap();
    (c, t.join().unwrap())
}

fn both() -> [(Options, Transport); 2] {
    [
        (Options::tcp_only(), Transport::Tcp),
        (Options::sdp_only(), Transport::Shm),
    ]
}

#[test]
fn integrity_both_directions_at_once_between_processes_in_every_mode() {
    for (i, mode) in ["auto", "bcopy", "zcopy"].into_iter().enumerate() {
        let l = listen(&Options::sdp_only());
        let addr = l.local_addr().unwrap().to_string();
        let bytes: u64 = 48 << 20;
        let (a, b) = (100 + i as u64, 200 + i as u64);
        let child = Command::new(PEER)
            .args([
                "duplex",
                &addr,
                mode,
                &a.to_string(),
                &b.to_string(),
                &bytes.to_string(),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let (s, _) = l.accept().unwrap();
        assert_eq!(s.transport(), Transport::Shm);
        s.set_zero_copy(mode != "bcopy");
        sdp_peer_duplex(s, mode, b, a, bytes).unwrap_or_else(|e| panic!("{mode}: {e}"));
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{mode}: peer failed");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    }
}

// The peer's routines, compiled into the test too.
#[path = "../src/bin/sdp-peer.rs"]
#[allow(dead_code)]
mod peer;
use peer::duplex as sdp_peer_duplex;

/// Run `side` (this process's end of a scenario) on a thread beside the peer process `child`.
/// Both must be done within `limit` (kernel TCP takes milliseconds): otherwise the child is
/// killed and the test fails, naming `what`. Returns `side`'s result and the child's stdout.
fn bounded<T: Send + 'static>(
    limit: Duration,
    mut child: Child,
    what: &str,
    side: impl FnOnce() -> T + Send + 'static,
) -> (T, String) {
    let t = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(side());
    });
    let r = match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(_) => {
            let _ = child.kill();
            panic!("{what}: this end did not finish within {limit:?}");
        }
    };
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            panic!("{what}: the peer process did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{what}: peer failed: {out:?}");
    (r, String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A stack of its own over shm whose zero-copy sends are never cancelled by the engine's
/// timer (`srcavail_timeout` an hour), with the peer process set up the same way: what a
/// test shows then does not rest on that safety net.
fn shm_without_srcavail_timeout() -> Options {
    let cfg = sdp_core::proto::Config {
        srcavail_timeout: Duration::from_secs(3600),
        ..sdp_core::proto::Config::default()
    };
    let stack =
        Stack::with_provider(sdp_core::verbs::shm::ShmProvider::new().unwrap(), cfg).unwrap();
    Options::sdp_only().with_stack(stack)
}
const PEER_NO_SRCAVAIL_TIMEOUT: (&str, &str) = ("SDP_PEER_SRCAVAIL_TIMEOUT_MS", "3600000");

fn choice(t: Transport) -> &'static str {
    if t == Transport::Tcp {
        "tcp"
    } else {
        "sdp"
    }
}

/// Both ends single-threaded: each writes a 2 MiB message in one call, then reads the
/// other's. A blocking write returns once its bytes are in the send buffer (they fit), never
/// waiting for the peer's application to read them, so over TCP this just works; over SDP a
/// zero-copy write must not wait for a reader that is itself blocked writing (not even until
/// a timer fires: the engine's `srcavail_timeout` is an hour here, at both ends). 2 MiB, not
/// 4: over loopback TCP one direction holds about 4 MiB before a writer blocks (the send
/// buffer autotunes up to `tcp_wmem`'s 4 MiB, plus a receive window nobody reads), so a 4 MiB
/// exchange deadlocks over TCP itself now and then (always, from Python); 2 MiB fits with
/// room, and is far above the 64 KiB zero-copy threshold.
#[test]
fn single_threaded_exchange_of_large_messages_same_as_tcp() {
    for (opts, transport) in [
        (Options::tcp_only(), Transport::Tcp),
        (shm_without_srcavail_timeout(), Transport::Shm),
    ] {
        let l = listen(&opts);
        let addr = l.local_addr().unwrap().to_string();
        let bytes = 2 << 20;
        let child = Command::new(PEER)
            .args([
                "exchange",
                &addr,
                choice(transport),
                &bytes.to_string(),
                "3",
            ])
            .env(PEER_NO_SRCAVAIL_TIMEOUT.0, PEER_NO_SRCAVAIL_TIMEOUT.1)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let what = format!("{transport}: exchange of 2 MiB messages");
        let (r, out) = bounded(Duration::from_secs(20), child, &what, move || {
            let (s, _) = l.accept().unwrap();
            assert_eq!(s.transport(), transport);
            peer::exchange(&s, bytes, 3, 2, 1)
        });
        r.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(out.starts_with("ok"), "{what}: {out}");
    }
}

/// A single-threaded echo server that reads 256 KiB at a time and writes each piece straight
/// back, against a client that writes a 4 MiB request in one call and only then reads: over
/// TCP the echo fits the buffers and it takes milliseconds; it must not hang over SDP.
#[test]
fn single_threaded_echo_of_a_large_request_same_as_tcp() {
    for (opts, transport) in both() {
        let l = listen(&opts);
        let addr = l.local_addr().unwrap().to_string();
        let bytes = 4 << 20;
        let child = Command::new(PEER)
            .args(["echo", &addr, choice(transport), &(256 << 10).to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let what = format!("{transport}: echo of a 4 MiB request");
        let (got, out) = bounded(Duration::from_secs(20), child, &what, move || {
            let (mut s, _) = l.accept().unwrap();
            assert_eq!(s.transport(), transport);
            let data: Vec<u8> = (0..bytes).map(|i| (i * 7 % 251) as u8).collect();
            s.write_all(&data).unwrap();
            let mut got = vec![0u8; bytes];
            s.read_exact(&mut got).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
            assert_eq!(s.read(&mut [0u8; 16]).unwrap(), 0);
            got == data
        });
        assert!(got, "{what}: the echo differs");
        assert_eq!(out, format!("ok {bytes}"), "{what}");
    }
}

#[test]
fn nonblocking_through_poll_same_as_tcp() {
    for (opts, transport) in both() {
        let (c, s) = pair(&opts);
        assert_eq!(c.transport(), transport);
        c.set_nonblocking(true).unwrap();
        s.set_nonblocking(true).unwrap();
        // Nothing to read: WouldBlock, and the fd does not poll readable.
        let mut b = [0u8; 16];
        assert_eq!((&s).read(&mut b).unwrap_err().kind(), ErrorKind::WouldBlock);
        let total = 6 << 20;
        let data: Vec<u8> = (0..total).map(|i| (i % 253) as u8).collect();
        let (mut sent, mut got) = (0usize, Vec::with_capacity(total));
        let (cfd, sfd) = (c.as_raw_fd(), s.as_raw_fd());
        let start = Instant::now();
        let mut buf = vec![0u8; 256 << 10];
        while got.len() < total {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{transport}: stuck"
            );
            let mut p = [
                libc::pollfd {
                    fd: cfd,
                    events: if sent < total { libc::POLLOUT } else { 0 },
                    revents: 0,
                },
                libc::pollfd {
                    fd: sfd,
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: a live array of two pollfds.
            let n = unsafe { libc::poll(p.as_mut_ptr(), 2, 5000) };
            assert!(
                n > 0,
                "{transport}: poll timed out with {sent} sent, {} read",
                got.len()
            );
            if p[0].revents & libc::POLLOUT != 0 {
                match (&c).write(&data[sent..(sent + (1 << 20)).min(total)]) {
                    Ok(k) => sent += k,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => panic!("{transport}: write {e}"),
                }
            }
            if p[1].revents & libc::POLLIN != 0 {
                match (&s).read(&mut buf) {
                    Ok(0) => panic!("{transport}: early EOF"),
                    Ok(k) => got.extend_from_slice(&buf[..k]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => panic!("{transport}: read {e}"),
                }
            }
        }
        assert!(got == data, "{transport}: data differs");
        // EOF polls readable and reads 0; then the fd stays readable.
        c.shutdown(Shutdown::Write).unwrap();
        let mut p = libc::pollfd {
            fd: sfd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        assert_eq!(unsafe { libc::poll(&mut p, 1, 5000) }, 1, "{transport}");
        assert_eq!((&s).read(&mut buf).unwrap(), 0, "{transport}");
    }
}

#[test]
fn timeouts_same_as_tcp() {
    for (opts, transport) in both() {
        let (c, s) = pair(&opts);
        s.set_read_timeout(Some(Duration::from_millis(80))).unwrap();
        assert_eq!(s.read_timeout().unwrap(), Some(Duration::from_millis(80)));
        let t = Instant::now();
        let e = (&s).read(&mut [0u8; 8]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::WouldBlock, "{transport}");
        assert!(t.elapsed() >= Duration::from_millis(75), "{transport}");
        assert!(t.elapsed() < Duration::from_secs(5), "{transport}");
        // Zero is refused, as by std.
        assert_eq!(
            s.set_read_timeout(Some(Duration::ZERO)).unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
        // A write into a peer that never reads times out once the send buffer is full.
        c.set_send_buffer_size(256 << 10).unwrap();
        c.set_write_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let chunk = vec![1u8; 64 << 10];
        let t = Instant::now();
        let err = loop {
            match (&c).write(&chunk) {
                Ok(_n) => assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "{transport}: never full"
                ),
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), ErrorKind::WouldBlock, "{transport}");
    }
}

#[test]
fn half_close_with_data_in_flight_same_as_tcp() {
    for (opts, transport) in both() {
        let (mut c, mut s) = pair(&opts);
        // Written before the peer reads anything: it must fit the send and receive buffers
        // (over SDP a large write goes by zero copy only while the peer takes it; the peer is
        // not reading, so after a short stall the rest goes by copy).
        let data: Vec<u8> = (0..(3 << 20)).map(|i| (i * 31 % 256) as u8).collect();
        c.write_all(&data).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        // Writing after our own shutdown fails with EPIPE.
        assert_eq!(
            c.write(b"late").unwrap_err().kind(),
            ErrorKind::BrokenPipe,
            "{transport}"
        );
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        assert!(got == data, "{transport}");
        // The other half still works both ways.
        s.write_all(b"reply").unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        let mut r = Vec::new();
        c.read_to_end(&mut r).unwrap();
        assert_eq!(r, b"reply", "{transport}");
    }
}

#[test]
fn peer_killed_mid_transfer_ends_in_eof_or_reset_within_seconds() {
    let l = listen(&Options::sdp_only());
    let addr = l.local_addr().unwrap().to_string();
    let mut child = Command::new(PEER)
        .args(["flood", &addr])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut s, _) = l.accept().unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0;
    while got < 32 << 20 {
        got += s.read(&mut buf).unwrap();
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let t = Instant::now();
    let end = loop {
        match s.read(&mut buf) {
            Ok(0) => break "eof",
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break "reset",
            Err(e) => panic!("unexpected error {e}"),
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no end seen");
    };
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "{end} after {:?}",
        t.elapsed()
    );
}

/// kill -9 of a writer in the middle of zero-copy transfers (8 MiB writes, one after another,
/// which the reader takes 1 MiB at a time straight into its buffer by RDMA Read): the reader's
/// `read` must return the data that came and then an error (or an error), never block for
/// good; EOF only if the kill came between two writes with everything written delivered (TCP's
/// kernel then closes in order). Repeated, so the kill lands inside a read in some tries.
#[test]
fn writer_killed_mid_zero_copy_transfer_never_leaves_the_reader_blocked() {
    for round in 0..12u64 {
        let l = listen(&Options::sdp_only());
        let addr = l.local_addr().unwrap().to_string();
        let mut child = Command::new(PEER)
            .args(["zsend", &addr, "sdp", &(8u64 << 20).to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let (s, _) = l.accept().unwrap();
        let got = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        let counter = got.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            let end = loop {
                match (&s).read(&mut buf) {
                    Ok(0) => break Ok(()),
                    Ok(n) => {
                        counter.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
                    }
                    Err(e) => break Err(e),
                }
            };
            let _ = tx.send(end);
        });
        // Kill it somewhere in the transfers: after 1 to 12 MiB have been read.
        let at = (round as usize + 1) << 20;
        let t = Instant::now();
        while got.load(std::sync::atomic::Ordering::SeqCst) < at {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "round {round}: no data"
            );
            std::thread::yield_now();
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let end = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_else(|_| {
            panic!(
                "round {round}: the reader is still blocked 20 s after the writer died ({} bytes read)",
                got.load(std::sync::atomic::Ordering::SeqCst)
            )
        });
        let n = got.load(std::sync::atomic::Ordering::SeqCst);
        match end {
            Err(e) => assert!(
                matches!(
                    e.kind(),
                    ErrorKind::ConnectionReset | ErrorKind::TimedOut | ErrorKind::ConnectionAborted
                ),
                "round {round}: {e}"
            ),
            // Killed between two writes, with everything it wrote delivered: as TCP's kernel
            // does for a killed process with nothing left to send, an orderly end.
            Ok(()) => assert!(
                n > 0 && n.is_multiple_of(8 << 20),
                "round {round}: EOF after {n} bytes of a writer that was killed mid-write"
            ),
        }
    }
}

fn raise_fd_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit on a live struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
}

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

#[test]
fn a_thousand_connections_in_one_process_with_bounded_memory() {
    raise_fd_limit();
    // A stack of its own: the process-wide shm stack also carries the connections of the
    // tests running beside this one, which would blur the counts.
    let stack = sdp_core::socket::Stack::with_provider(
        sdp_core::verbs::shm::ShmProvider::new().unwrap(),
        sdp_core::proto::Config::default(),
    )
    .unwrap();
    let opts = Options::sdp_only().with_stack(stack.clone());
    let l = listen(&opts);
    let addr = l.local_addr().unwrap();
    let n = 1000;
    let rss0 = rss_bytes();
    let acceptor = std::thread::spawn(move || {
        let mut v = Vec::new();
        for _ in 0..n {
            v.push(l.accept().unwrap().0);
        }
        v
    });
    let clients: Vec<SdpStream> = (0..n)
        .map(|_| SdpStream::connect_with(addr, &opts).unwrap())
        .collect();
    let servers = acceptor.join().unwrap();
    for (i, c) in clients.iter().enumerate() {
        (&*c).write_all(&(i as u32).to_be_bytes()).unwrap();
    }
    let mut seen = vec![false; n];
    for s in &servers {
        let mut b = [0u8; 4];
        (&*s).read_exact(&mut b).unwrap();
        let i = u32::from_be_bytes(b) as usize;
        assert!(!seen[i]);
        seen[i] = true;
        (&*s).write_all(&b).unwrap();
    }
    for (i, c) in clients.iter().enumerate() {
        let mut b = [0u8; 4];
        (&*c).read_exact(&mut b).unwrap();
        assert_eq!(u32::from_be_bytes(b) as usize, i);
    }
    assert_eq!(stack.conn_count(), 2 * n);
    let reg = stack.registered_bytes();
    let rss = rss_bytes().saturating_sub(rss0);
    eprintln!(
        "{} connections (both ends): registered {} KiB each, RSS growth {} KiB each",
        2 * n,
        reg / 2 / n / 1024,
        rss / 2 / n as u64 / 1024
    );
    // Idle connections stay cheap: a few receive buffers each, not the full window.
    assert!(reg / (2 * n) <= 256 << 10, "registered {reg}");
    assert!(rss < 4 << 30, "RSS grew by {rss}");
    drop(clients);
    drop(servers);
    let t = Instant::now();
    while stack.conn_count() > 0 && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(stack.conn_count(), 0, "connections not freed after close");
}

/// Needs root (the peer runs as uid 65534): `tests/run-all` runs it when it runs as root, as CI
/// does; by hand: `cargo test -p sdp-tests --test socket -- --ignored`.
#[test]
#[ignore = "needs root: runs a peer as another user (tests/run-all runs it as root)"]
fn another_users_peer_is_refused_and_falls_back_to_tcp() {
    // SAFETY: geteuid cannot fail.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "needs root to run a peer as another user"
    );
    use std::os::unix::process::CommandExt;
    let l = SdpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let acceptor = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 2];
        s.read_exact(&mut b).unwrap();
        s.transport()
    });
    let run = |choice: &str| {
        let out = Command::new(PEER)
            .args(["connect", &addr, choice])
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    // SDP only: refused, as TCP refuses a port nobody listens on.
    assert_eq!(run("sdp"), format!("errno {}", libc::ECONNREFUSED));
    // Automatic: falls back to kernel TCP, which the listener also accepts.
    assert_eq!(run("auto"), "tcp");
    assert_eq!(acceptor.join().unwrap(), Transport::Tcp);
}

#[test]
fn automatic_mode_falls_back_to_tcp_and_accepts_tcp_clients() {
    // A plain kernel TCP server: the SDP connector falls back and says so.
    let tl = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = tl.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = tl.accept().unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
    });
    let mut c = SdpStream::connect(addr).unwrap();
    assert_eq!(c.transport(), Transport::Tcp);
    c.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ping");
    t.join().unwrap();
    // SDP-only refuses instead.
    let tl = TcpListener::bind("127.0.0.1:0").unwrap();
    let e = SdpStream::connect_with(tl.local_addr().unwrap(), &Options::sdp_only()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED));

    // An automatic listener takes a plain TCP client and an SDP client on one port.
    let l = SdpListener::bind("127.0.0.1:0").unwrap();
    assert_eq!(l.sdp_status(), Ok(Transport::Shm));
    let addr: SocketAddr = l.local_addr().unwrap();
    let mut k = TcpStream::connect(addr).unwrap();
    let (mut a, _) = l.accept().unwrap();
    assert_eq!(a.transport(), Transport::Tcp);
    k.write_all(b"kern").unwrap();
    a.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"kern");
    let mut sd = SdpStream::connect(addr).unwrap();
    let (mut a2, _) = l.accept().unwrap();
    assert_eq!(
        (sd.transport(), a2.transport()),
        (Transport::Shm, Transport::Shm)
    );
    sd.write_all(b"sdp!").unwrap();
    a2.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"sdp!");
}

#[test]
fn connecting_where_nobody_listens_is_refused_like_tcp() {
    let port = {
        let t = TcpListener::bind("127.0.0.1:0").unwrap();
        t.local_addr().unwrap().port()
    };
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    for (opts, transport) in both() {
        let t = Instant::now();
        let e = SdpStream::connect_with(addr, &opts).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED), "{transport}");
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{transport}: {:?}",
            t.elapsed()
        );
    }
}

/// SO_LINGER as TCP's: zero resets the connection at the last drop (the peer's read fails
/// with ECONNRESET, after what it had already received), a time keeps the close graceful
/// (everything written arrives, then EOF), and the option reads back as set.
#[test]
fn linger_zero_resets_and_linger_time_delivers_like_tcp() {
    for (opts, transport) in both() {
        // zero: reset
        let (c, mut s) = pair(&opts);
        assert_eq!(c.linger().unwrap(), None, "{transport}");
        c.set_linger(Some(Duration::ZERO)).unwrap();
        assert_eq!(c.linger().unwrap(), Some(Duration::ZERO), "{transport}");
        (&c).write_all(b"x").unwrap();
        let mut b = [0u8; 8];
        assert_eq!(s.read(&mut b).unwrap(), 1, "{transport}");
        drop(c);
        let e = s.read(&mut b).expect_err("a read after the peer's reset");
        assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{transport}: {e}");

        // a time: graceful, everything written arrives
        let (c, mut s) = pair(&opts);
        c.set_linger(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(
            c.linger().unwrap(),
            Some(Duration::from_secs(5)),
            "{transport}"
        );
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            s.read_to_end(&mut all).map(|_| all.len())
        });
        let data = vec![7u8; 1 << 20];
        (&c).write_all(&data).unwrap();
        let t = Instant::now();
        drop(c);
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{transport}: close waited the linger out"
        );
        assert_eq!(reader.join().unwrap().unwrap(), 1 << 20, "{transport}");
    }
}

#[test]
fn peer_close_then_write_fails_like_tcp() {
    for (opts, transport) in both() {
        let (mut c, s) = pair(&opts);
        drop(s);
        let mut b = [0u8; 4];
        assert_eq!(
            c.read(&mut b).unwrap(),
            0,
            "{transport}: EOF after the peer closed"
        );
        // Writes into a closed peer fail within a few tries (EPIPE or ECONNRESET).
        let t = Instant::now();
        let err = loop {
            match c.write(&[0u8; 4096]) {
                Ok(_n) => {
                    assert!(
                        t.elapsed() < Duration::from_secs(5),
                        "{transport}: writes keep working"
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => break e,
            }
        };
        assert!(
            matches!(
                err.kind(),
                ErrorKind::BrokenPipe | ErrorKind::ConnectionReset
            ),
            "{transport}: {err}"
        );
    }
}

#[test]
fn one_thread_reads_while_another_writes() {
    let (c, s) = pair(&Options::sdp_only());
    let c2 = c.try_clone().unwrap();
    let n = 32 << 20;
    let w = std::thread::spawn(move || {
        let buf = vec![9u8; 1 << 16];
        let mut left = n;
        while left > 0 {
            let k = left.min(buf.len());
            (&c2).write_all(&buf[..k]).unwrap();
            left -= k;
        }
    });
    // The server echoes on its own threads; the client reads the echo while it writes.
    let s2 = s.try_clone().unwrap();
    let e = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        let mut left = n;
        while left > 0 {
            let k = (&s2).read(&mut buf).unwrap();
            assert!(k > 0);
            (&s2).write_all(&buf[..k]).unwrap();
            left -= k;
        }
    });
    let mut buf = vec![0u8; 1 << 16];
    let mut got = 0;
    while got < n {
        let k = (&c).read(&mut buf).unwrap();
        assert!(k > 0 && buf[..k].iter().all(|&b| b == 9));
        got += k;
    }
    w.join().unwrap();
    e.join().unwrap();
}

#[test]
fn fork_and_exec() {
    // An echo server for the peer's parent and child streams.
    let l = listen(&Options::sdp_only());
    let addr = l.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let (s, _) = l.accept().unwrap();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match (&s).read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => (&s).write_all(&buf[..k]).unwrap(),
                    }
                }
                let _ = s.shutdown(Shutdown::Write);
            });
        }
    });
    let out = Command::new(PEER).args(["fork", &addr]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    server.join().unwrap();
}
