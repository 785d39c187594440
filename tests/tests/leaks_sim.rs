//! Engine-level resources over the simulator (issue 14): after each fault of a matrix, once
//! the application let go of its ids and the engines settled (bounded virtual time), every
//! host that is still up holds no connection, no engine buffer, no registered region and no
//! QP. (tests/tests/leaks.rs does the same between processes over shm, with fds and memfds.)

use std::net::SocketAddr;
use std::time::Duration;

use sdp_core::driver::Driver;
use sdp_core::proto::conn::CallError;
use sdp_core::proto::iocb::ZSrc;
use sdp_core::proto::table::ConnId;
use sdp_core::proto::{Config, ConnError, Shutdown, State};
use sdp_core::verbs::sim::SimProvider;
use sdp_core::verbs::{Access, MemoryRegion, Provider, REJECT_QUEUE_FULL};
use sdp_tests::pair::{Pair, A_IP, B_IP, PORT};

const SEC: u64 = 1_000_000_000;

/// What a host holds: connections, engine bytes (driver), regions, bytes and QPs (fabric).
fn held(p: &Pair, a: bool) -> (usize, usize, u64, u64, u64) {
    let (d, ip) = if a { (&p.a, A_IP) } else { (&p.b, B_IP) };
    let s = p.fabric.stats(ip);
    (
        d.conn_count(),
        d.registered_bytes(),
        s.registered_regions,
        s.registered_bytes,
        s.qps,
    )
}

/// Let the engines settle (at most a minute of virtual time); then `hosts` (A, B) hold nothing.
fn settled(p: &mut Pair, what: &str, hosts: [bool; 2]) {
    let zero = (0, 0, 0, 0, 0);
    let ok = p.run_until(60 * SEC, |p| {
        (!hosts[0] || held(p, true) == zero) && (!hosts[1] || held(p, false) == zero)
    });
    assert!(
        ok,
        "{what}: not given back: A {:?}, B {:?} (connections, engine bytes, regions, region bytes, QPs)",
        held(p, true),
        held(p, false)
    );
}

/// Wait until the connection is closed (bounded); its error.
fn wait_closed(p: &mut Pair, a: bool, id: ConnId) -> Option<ConnError> {
    let ok = p.run_until(60 * SEC, |p| {
        let d = if a { &p.a } else { &p.b };
        d.conn(id).is_none_or(|c| c.state() == State::Closed)
    });
    assert!(ok, "connection never closed");
    let d = if a { &p.a } else { &p.b };
    d.conn(id).and_then(|c| c.error().cloned())
}

fn write_some(d: &mut Driver<SimProvider>, now: sdp_core::proto::Instant, id: ConnId, n: usize) {
    let data = vec![0x5au8; n];
    let mut off = 0;
    while off < n {
        match d.write(now, id, &data[off..]) {
            Ok(k) => off += k,
            Err(CallError::WouldBlock) => return,
            Err(e) => panic!("write: {e}"),
        }
    }
}

/// Read what there is (true at EOF or an error).
fn read_some(d: &mut Driver<SimProvider>, now: sdp_core::proto::Instant, id: ConnId) -> bool {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match d.read(now, id, &mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(CallError::WouldBlock) => return false,
            Err(_) => return true,
        }
    }
}

/// Run a transfer A -> B until B read about `bytes`.
fn transfer(p: &mut Pair, a: ConnId, b: ConnId, bytes: usize) {
    let mut got = 0usize;
    let ok = p.run_until(60 * SEC, |p| {
        let now = p.now();
        write_some(&mut p.a, now, a, 256 << 10);
        let mut buf = vec![0u8; 1 << 20];
        while let Ok(n) = p.b.read(now, b, &mut buf) {
            if n == 0 {
                break;
            }
            got += n;
        }
        got >= bytes
    });
    assert!(ok, "transfer stalled at {got}");
}

#[test]
fn connect_failures_give_everything_back() {
    // Refused: nobody listens on the port.
    let mut p = Pair::new(1, Config::default());
    let now = p.now();
    let id =
        p.a.connect(now, SocketAddr::new(B_IP, PORT + 1), None)
            .unwrap();
    assert_eq!(wait_closed(&mut p, true, id), Some(ConnError::Refused));
    p.a.close(p.now(), id);
    settled(&mut p, "refused", [true, true]);

    // The listener's host crashes in the handshake.
    let mut p = Pair::new(2, Config::default());
    let now = p.now();
    let id = p.a.connect(now, SocketAddr::new(B_IP, PORT), None).unwrap();
    p.fabric.faults().crash(B_IP);
    assert!(matches!(
        wait_closed(&mut p, true, id),
        Some(ConnError::Unreachable | ConnError::TimedOut)
    ));
    p.a.close(p.now(), id);
    settled(&mut p, "listener crashed in the handshake", [true, false]);

    // The connector gives up before the answer (its application closes at once).
    let mut p = Pair::new(3, Config::default());
    let now = p.now();
    let id = p.a.connect(now, SocketAddr::new(B_IP, PORT), None).unwrap();
    p.a.close(now, id);
    settled(&mut p, "connect given up", [true, true]);

    // The listen queue is full: the request beyond it is turned away.
    let mut p = Pair::new(4, Config::default());
    let l = p.b.listen(SocketAddr::new(B_IP, PORT + 2), 0).unwrap();
    let now = p.now();
    let first =
        p.a.connect(now, SocketAddr::new(B_IP, PORT + 2), None)
            .unwrap();
    assert!(p.run_until(SEC, |p| p.a.conn(first).unwrap().state()
        == State::Established));
    let now = p.now();
    let second =
        p.a.connect(now, SocketAddr::new(B_IP, PORT + 2), None)
            .unwrap();
    assert_eq!(
        wait_closed(&mut p, true, second),
        Some(ConnError::Rejected(REJECT_QUEUE_FULL.into()))
    );
    let st = p.b.listen_stats(l).unwrap();
    assert_eq!((st.queued, st.ready, st.overflows), (1, 1, 1));
    p.a.close(p.now(), second);
    // Then the listener closes with the first still waiting: reset.
    p.b.close_listener(l);
    assert_eq!(wait_closed(&mut p, true, first), Some(ConnError::Reset));
    p.a.close(p.now(), first);
    settled(&mut p, "queue full, then listener closed", [true, true]);
}

#[test]
fn faults_mid_transfer_give_everything_back() {
    // The reader's host crashes while the writer copies.
    let mut p = Pair::new(5, Config::default());
    let (a, b) = p.connect();
    transfer(&mut p, a, b, 2 << 20);
    p.fabric.faults().crash(B_IP);
    // (A writer notices by its own traffic, as over TCP.)
    let now = p.now();
    write_some(&mut p.a, now, a, 1 << 20);
    assert!(wait_closed(&mut p, true, a).is_some());
    p.a.close(p.now(), a);
    settled(&mut p, "reader crashed (copy)", [true, false]);

    // The reader's host crashes while it reads a zero-copy source; then the writer's host
    // crashes while the reader reads one.
    for crash_reader in [true, false] {
        let mut p = Pair::new(6, Config::default());
        let (a, b) = p.connect();
        let data = vec![7u8; 4 << 20];
        let mut mr = p.a.provider().reg_mr(data.len(), Access::empty()).unwrap();
        mr.write(0, &data);
        mr.set_access(Access::REMOTE_READ).unwrap();
        let src = ZSrc {
            addr: mr.addr(),
            len: data.len() as u32,
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        };
        let now = p.now();
        p.a.write_zcopy(now, a, src, 1).unwrap();
        let mut got = 0;
        assert!(p.run_until(10 * SEC, |p| {
            let now = p.now();
            let mut buf = vec![0u8; 64 << 10];
            if let Ok(n) = p.b.read(now, b, &mut buf) {
                got += n;
            }
            got >= 1 << 20
        }));
        let (victim, survivor) = if crash_reader {
            (B_IP, true)
        } else {
            (A_IP, false)
        };
        p.fabric.faults().crash(victim);
        let id = if survivor { a } else { b };
        // (The survivor notices by its own traffic, as over TCP.)
        let now = p.now();
        if survivor {
            write_some(&mut p.a, now, a, 1 << 20);
        } else {
            write_some(&mut p.b, now, b, 1 << 20);
        }
        assert!(wait_closed(&mut p, survivor, id).is_some());
        if survivor {
            p.a.close(p.now(), a);
        } else {
            p.b.close(p.now(), b);
        }
        drop(mr);
        let hosts = if survivor {
            [true, false]
        } else {
            [false, true]
        };
        settled(
            &mut p,
            &format!("crash mid zero copy (reader crashed: {crash_reader})"),
            hosts,
        );
    }

    // The link breaks: both ends time out.
    let mut p = Pair::new(7, Config::default());
    let (a, b) = p.connect();
    transfer(&mut p, a, b, 1 << 20);
    p.fabric.faults().break_link(A_IP, B_IP);
    let now = p.now();
    write_some(&mut p.a, now, a, 1 << 20);
    write_some(&mut p.b, now, b, 1 << 20);
    assert!(wait_closed(&mut p, true, a).is_some());
    assert!(wait_closed(&mut p, false, b).is_some());
    p.a.close(p.now(), a);
    p.b.close(p.now(), b);
    settled(&mut p, "link broken", [true, true]);

    // A message is corrupted: the receiver aborts the connection.
    let mut p = Pair::new(8, Config::default());
    let (a, b) = p.connect();
    transfer(&mut p, a, b, 256 << 10);
    p.fabric
        .faults()
        .corrupt_next_send(A_IP, |v| v.iter_mut().take(4).for_each(|x| *x ^= 0xff));
    let now = p.now();
    write_some(&mut p.a, now, a, 64 << 10);
    assert!(wait_closed(&mut p, false, b).is_some());
    assert!(wait_closed(&mut p, true, a).is_some());
    p.a.close(p.now(), a);
    p.b.close(p.now(), b);
    settled(&mut p, "corrupted message", [true, true]);
}

#[test]
fn closing_and_aborting_give_everything_back() {
    // Close with data queued: it is delivered, then both ends close.
    let mut p = Pair::new(9, Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    write_some(&mut p.a, now, a, 3 << 20);
    p.a.close(now, a);
    assert!(p.run_until(60 * SEC, |p| {
        let now = p.now();
        read_some(&mut p.b, now, b)
    }));
    p.b.close(p.now(), b);
    settled(&mut p, "close with data queued", [true, true]);

    // Close with the peer's data unread (a reset) and abort mid-transfer.
    for abort in [false, true] {
        let mut p = Pair::new(10, Config::default());
        let (a, b) = p.connect();
        transfer(&mut p, a, b, 512 << 10);
        let now = p.now();
        write_some(&mut p.a, now, a, 1 << 20);
        p.run_for(SEC / 1000);
        let now = p.now();
        if abort {
            p.b.abort(now, b);
        }
        p.b.close(now, b);
        assert_eq!(wait_closed(&mut p, true, a), Some(ConnError::Reset));
        p.a.close(p.now(), a);
        settled(
            &mut p,
            &format!("reset by the reader (abort: {abort})"),
            [true, true],
        );
    }

    // Shutdown, then close.
    let mut p = Pair::new(11, Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    write_some(&mut p.a, now, a, 1 << 20);
    p.a.shutdown(now, a, Shutdown::Write).unwrap();
    assert!(p.run_until(60 * SEC, |p| {
        let now = p.now();
        read_some(&mut p.b, now, b)
    }));
    let now = p.now();
    p.b.shutdown(now, b, Shutdown::Write).unwrap();
    assert!(p.run_until(60 * SEC, |p| {
        let now = p.now();
        read_some(&mut p.a, now, a)
    }));
    p.a.close(p.now(), a);
    p.b.close(p.now(), b);
    settled(&mut p, "shutdown then close", [true, true]);
}

#[test]
fn connections_nobody_accepts_wait_as_tcps_do() {
    // By default (as TCP's accept queue) a connection waits until it is accepted, however
    // long: five minutes here, its client's bytes kept. Before, it was reset after 60 s.
    let mut p = Pair::new(13, Config::default());
    let l = p.b.listen(SocketAddr::new(B_IP, PORT + 4), 8).unwrap();
    let now = p.now();
    let id =
        p.a.connect(now, SocketAddr::new(B_IP, PORT + 4), None)
            .unwrap();
    assert!(p.run_until(SEC, |p| p.a.conn(id).unwrap().state() == State::Established));
    let now = p.now();
    assert_eq!(p.a.write(now, id, b"waited").unwrap(), 6);
    p.run_for(300 * SEC);
    let st = p.b.listen_stats(l).unwrap();
    assert_eq!((st.queued, st.timed_out), (1, 0));
    let b = p.b.accept(l).expect("the waiting connection");
    let mut got = Vec::new();
    assert!(p.run_until(SEC, |p| {
        let mut buf = [0u8; 64];
        if let Ok(n) = p.b.read(p.now(), b, &mut buf) {
            got.extend_from_slice(&buf[..n]);
        }
        got.len() >= 6
    }));
    assert_eq!(got, b"waited");
    assert_eq!(p.a.conn(id).unwrap().state(), State::Established);
    p.a.close(p.now(), id);
    p.b.close(p.now(), b);
    settled(
        &mut p,
        "a connection accepted after five minutes",
        [true, true],
    );
    p.b.close_listener(l);
}

#[test]
fn connections_nobody_accepts_give_everything_back() {
    // With Config::unaccepted_timeout set (60 s here) they time out with a reset.
    let mut p = Pair::new(
        12,
        Config {
            unaccepted_timeout: Some(Duration::from_secs(60)),
            ..Config::default()
        },
    );
    let l = p.b.listen(SocketAddr::new(B_IP, PORT + 3), 8).unwrap();
    let now = p.now();
    let ids: Vec<ConnId> = (0..3)
        .map(|_| {
            p.a.connect(now, SocketAddr::new(B_IP, PORT + 3), None)
                .unwrap()
        })
        .collect();
    assert!(p.run_until(SEC, |p| ids
        .iter()
        .all(|&id| p.a.conn(id).unwrap().state() == State::Established)));
    // A little data waits in each (cheaply: a few buffers).
    for &id in &ids {
        let now = p.now();
        write_some(&mut p.a, now, id, 1 << 20);
    }
    p.run_for(SEC);
    let cfg = Config::default();
    let per = p.b.registered_bytes() / ids.len();
    assert!(
        per <= (cfg.unaccepted_rx_bufs * cfg.rcv_size) as usize + (8 << 10),
        "{per} bytes per waiting connection"
    );
    assert_eq!(p.b.listen_stats(l).unwrap().queued, 3);
    p.run_for(55 * SEC);
    assert_eq!(
        p.b.listen_stats(l).unwrap().queued,
        3,
        "not before the timeout"
    );
    for &id in &ids {
        assert_eq!(wait_closed(&mut p, true, id), Some(ConnError::Reset));
        p.a.close(p.now(), id);
    }
    let st = p.b.listen_stats(l).unwrap();
    assert_eq!((st.queued, st.timed_out), (0, 3));
    settled(&mut p, "unaccepted connections timed out", [true, true]);
    p.b.close_listener(l);
}
