//! Process exit, crash and reset between real processes, checked against kernel TCP: data
//! written before a normal exit arrives (with or without close), data the reader already
//! received stays readable after the peer resets or dies, `accept()` hands over a client that
//! is already gone, and a stack whose progress thread panics fails its connections instead of
//! hanging them.

use std::io::{ErrorKind, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sdp_core::socket::{Options, SdpListener, SdpStream, Stack, Transport};

const PEER: &str = env!("CARGO_BIN_EXE_sdp-peer");

// The peer's seeded pattern, compiled into the test too.
#[path = "../src/bin/sdp-peer.rs"]
#[allow(dead_code)]
mod peer;

fn both() -> [(Options, Transport, &'static str); 2] {
    [
        (Options::tcp_only(), Transport::Tcp, "tcp"),
        (Options::sdp_only(), Transport::Shm, "sdp"),
    ]
}

fn pattern(bytes: usize) -> Vec<u8> {
    let mut v = vec![0u8; bytes];
    peer::Pattern::new(7).fill(&mut v);
    v
}

/// Start `sdp-peer write-exit` against `l`.
fn write_exit(l: &SdpListener, choice: &str, mode: &str, bytes: usize, end: &str) -> Child {
    let addr = l.local_addr().unwrap().to_string();
    Command::new(PEER)
        .args(["write-exit", &addr, choice, mode, &bytes.to_string(), end])
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// Accept within 20 s (a lost connection fails the test instead of hanging it).
fn accept_within(l: &SdpListener, what: &str) -> SdpStream {
    l.set_nonblocking(true).unwrap();
    let t = Instant::now();
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).unwrap();
                return s;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "{what}: accept() never returned the connection"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("{what}: accept: {e}"),
        }
    }
}

/// Wait (bounded) for the child to end; true if it exited with status 0.
fn reap(child: &mut Child, what: &str) -> bool {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st.success();
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{what}: peer did not end"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// What a reader sees: the bytes, then the results of the next three reads after the data
/// ended ("eof", an errno, or "timeout"); then what a write gives.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    bytes: usize,
    intact: bool,
    ends: Vec<String>,
    write: String,
}

fn end_name(r: std::io::Result<usize>) -> String {
    match r {
        Ok(0) => "eof".into(),
        Ok(n) => format!("{n} bytes"),
        Err(e) if e.kind() == ErrorKind::WouldBlock => "timeout".into(),
        Err(e) => match e.raw_os_error() {
            Some(libc::ECONNRESET) => "ECONNRESET".into(),
            Some(libc::EPIPE) => "EPIPE".into(),
            Some(libc::EIO) => "EIO".into(),
            Some(n) => format!("errno {n}"),
            None => format!("{e}"),
        },
    }
}

/// Read everything (at most 30 s without progress), then three more reads and a write.
fn observe(s: &mut SdpStream, want: &[u8]) -> Seen {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut got = Vec::with_capacity(want.len());
    let mut buf = vec![0u8; 256 << 10];
    let mut ends = Vec::new();
    while ends.len() < 3 {
        match s.read(&mut buf) {
            Ok(n) if n > 0 && ends.is_empty() => got.extend_from_slice(&buf[..n]),
            r => {
                let timed_out = matches!(&r, Err(e) if e.kind() == ErrorKind::WouldBlock);
                ends.push(end_name(r));
                if timed_out {
                    break;
                }
            }
        }
    }
    let write = end_name(s.write(b"late"));
    Seen {
        bytes: got.len(),
        intact: want.starts_with(&got),
        ends,
        write,
    }
}

/// The reader's view when the peer wrote `bytes` and ended normally.
fn clean(bytes: usize) -> Seen {
    Seen {
        bytes,
        intact: true,
        ends: vec!["eof".into(); 3],
        // Our own end is still open; the peer is gone: EPIPE or ECONNRESET, normalised below.
        write: "gone".into(),
    }
}

fn normalise_write(mut s: Seen) -> Seen {
    if matches!(s.write.as_str(), "EPIPE" | "ECONNRESET" | "4 bytes") {
        // A first write into a peer that closed may still be taken (TCP takes it and the
        // peer answers with a reset); either way it is not an error we compare.
        s.write = "gone".into();
    }
    s
}

/// What a reader sees of data the peer wrote before it reset the connection: all of it, then
/// ECONNRESET once, then EOF; a write fails with EPIPE (Linux).
fn after_reset(bytes: usize) -> Seen {
    Seen {
        bytes,
        intact: true,
        ends: vec!["ECONNRESET".into(), "eof".into(), "eof".into()],
        write: "EPIPE".into(),
    }
}

#[test]
fn data_written_before_exit_arrives_with_or_without_close_same_as_tcp() {
    for (opts, transport, choice) in both() {
        for bytes in [200_000, 8 << 20] {
            let want = pattern(bytes);
            for mode in ["auto", "bcopy"] {
                for end in ["exit", "close"] {
                    let what = format!("{transport} {bytes} bytes {mode}, then {end}");
                    let l = SdpListener::bind_with("127.0.0.1:0", &opts).unwrap();
                    let mut child = write_exit(&l, choice, mode, bytes, end);
                    let mut s = accept_within(&l, &what);
                    assert_eq!(s.transport(), transport, "{what}");
                    let seen = normalise_write(observe(&mut s, &want));
                    assert!(reap(&mut child, &what), "{what}: peer failed");
                    assert_eq!(seen, clean(bytes), "{what}");
                }
            }
        }
    }
}

#[test]
fn received_data_stays_readable_after_the_peer_resets_same_as_tcp() {
    // Small enough for a fresh TCP connection's receive window (the peer waits until the
    // reader's side holds every byte before it resets: SO_LINGER 0).
    let bytes = 100_000;
    let want = pattern(bytes);
    let mut seen = Vec::new();
    for (opts, transport, choice) in both() {
        let what = format!("{transport}");
        let l = SdpListener::bind_with("127.0.0.1:0", &opts).unwrap();
        let mut child = write_exit(&l, choice, "bcopy", bytes, "abort");
        let mut s = accept_within(&l, &what);
        reap(&mut child, &what);
        // Let the reset reach us before the first read.
        std::thread::sleep(Duration::from_millis(200));
        let v = observe(&mut s, &want);
        assert_eq!(v, after_reset(bytes), "{what}");
        seen.push(v);
    }
    assert_eq!(seen[0], seen[1]);
}

/// A peer killed by SIGKILL once the reader's side held every byte (nothing unread on its
/// side either): TCP's kernel closes its connection in order, and so does SDP's survivor
/// (shm: the dead side was settled): all of it, then EOF. Before, SDP gave ECONNRESET.
#[test]
fn a_peer_killed_when_settled_ends_in_order_same_as_tcp() {
    let bytes = 100_000;
    let want = pattern(bytes);
    for (opts, transport, choice) in both() {
        let what = format!("{transport}");
        let l = SdpListener::bind_with("127.0.0.1:0", &opts).unwrap();
        let mut child = write_exit(&l, choice, "bcopy", bytes, "kill");
        let mut s = accept_within(&l, &what);
        assert_eq!(s.transport(), transport, "{what}");
        reap(&mut child, &what);
        std::thread::sleep(Duration::from_millis(200));
        let v = normalise_write(observe(&mut s, &want));
        assert_eq!(v, clean(bytes), "{what}");
    }
}

#[test]
fn accept_returns_a_client_that_reset_before_it_was_accepted_same_as_tcp() {
    let bytes = 100_000;
    let want = pattern(bytes);
    for (opts, transport, choice) in both() {
        for round in 0..3 {
            let what = format!("{transport} round {round}");
            let l = SdpListener::bind_with("127.0.0.1:0", &opts).unwrap();
            let mut child = write_exit(&l, choice, "bcopy", bytes, "abort");
            // The client is gone before accept() is called.
            reap(&mut child, &what);
            std::thread::sleep(Duration::from_millis(100));
            let mut s = accept_within(&l, &what);
            assert_eq!(s.transport(), transport, "{what}");
            assert_eq!(observe(&mut s, &want), after_reset(bytes), "{what}");
        }
    }
}

#[test]
fn accept_never_loses_a_client_that_wrote_and_exited_at_once() {
    let bytes = 200_000;
    let want = pattern(bytes);
    for (opts, transport, choice) in both() {
        let l = SdpListener::bind_with("127.0.0.1:0", &opts).unwrap();
        for round in 0..30 {
            // (A large write in auto mode that nobody reads waits 2 s before it copies: only
            // one round accepts such a client after it is gone.)
            let late = round % 3 == 0;
            let mode = match round {
                3 => "auto",
                _ if late => "bcopy",
                _ => ["bcopy", "auto"][round % 2],
            };
            let end = ["exit", "close"][(round / 2) % 2];
            let what = format!("{transport} round {round} ({mode}, {end})");
            let mut child = write_exit(&l, choice, mode, bytes, end);
            if late {
                // Sometimes accept only once the client is gone.
                reap(&mut child, &what);
            }
            let mut s = accept_within(&l, &what);
            let seen = normalise_write(observe(&mut s, &want));
            assert!(reap(&mut child, &what), "{what}: peer failed");
            assert_eq!(seen, clean(bytes), "{what}");
        }
    }
}

#[test]
fn exit_waits_no_longer_than_the_exit_linger_for_a_peer_that_does_not_read() {
    // A reader whose stack holds little (5 receive buffers of 32 KiB, the fewest a connection
    // may have) and that reads nothing until the writer is gone: the writer's exit cannot
    // deliver 1 MiB, and must give up after SDP_EXIT_LINGER_MS (the default, 10 s, would fail
    // the bound below).
    let cfg = sdp_core::proto::Config {
        initial_rx_bufs: sdp_core::proto::conn::MIN_RX_POSTED,
        max_rx_bufs: sdp_core::proto::conn::MIN_RX_POSTED,
        max_rcv_size: 32 * 1024,
        ..sdp_core::proto::Config::default()
    };
    let stack =
        Stack::with_provider(sdp_core::verbs::shm::ShmProvider::new().unwrap(), cfg).unwrap();
    let l = SdpListener::bind_with("127.0.0.1:0", &Options::sdp_only().with_stack(stack)).unwrap();
    let bytes = 1 << 20;
    let addr = l.local_addr().unwrap().to_string();
    let t = Instant::now();
    let mut child = Command::new(PEER)
        .args([
            "write-exit",
            &addr,
            "sdp",
            "bcopy",
            &bytes.to_string(),
            "exit",
        ])
        .env("SDP_EXIT_LINGER_MS", "300")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut s = accept_within(&l, "linger");
    assert!(reap(&mut child, "linger"), "peer failed");
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "exit took {:?}",
        t.elapsed()
    );
    // What reached us before the writer gave up, then the reset.
    let seen = observe(&mut s, &pattern(bytes));
    assert!(seen.intact && seen.bytes < bytes, "{seen:?}");
    assert_eq!(seen.ends[0], "ECONNRESET", "{seen:?}");
}

#[test]
fn a_panicking_progress_thread_fails_its_connections_instead_of_hanging_them() {
    let stack = |_| {
        Stack::with_provider(
            sdp_core::verbs::shm::ShmProvider::new().unwrap(),
            sdp_core::proto::Config::default(),
        )
        .unwrap()
    };
    let (a, b) = (stack(0), stack(1));
    let l = SdpListener::bind_with("127.0.0.1:0", &Options::sdp_only().with_stack(b)).unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || l.accept().unwrap().0);
    let c = SdpStream::connect_with(addr, &Options::sdp_only().with_stack(a.clone())).unwrap();
    let srv = t.join().unwrap();
    (&c).write_all(b"ping").unwrap();
    let mut four = [0u8; 4];
    (&srv).read_exact(&mut four).unwrap();

    // Blocked readers on both ends.
    let (tx, rx) = std::sync::mpsc::channel();
    let c2 = c.clone();
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        let _ = tx2.send(("client", end_name((&c2).read(&mut [0u8; 16]))));
    });
    let s2 = srv.clone();
    std::thread::spawn(move || {
        let _ = tx.send(("server", end_name((&s2).read(&mut [0u8; 16]))));
    });
    std::thread::sleep(Duration::from_millis(200));
    a.inject_progress_panic();
    let mut ends = std::collections::HashMap::new();
    for _ in 0..2 {
        let (who, r) = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("a blocked read hangs; so far {ends:?}"));
        ends.insert(who, r);
    }
    // The failed stack's connection reports EIO; its peer sees the connection end.
    assert_eq!(ends["client"], "EIO");
    assert!(
        matches!(ends["server"].as_str(), "ECONNRESET" | "eof"),
        "{ends:?}"
    );
    // Later calls fail at once too.
    assert_eq!(end_name((&c).write(b"more")), "EIO");
    assert_eq!(end_name((&c).read(&mut [0u8; 4])), "EIO");
}
