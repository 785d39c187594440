//! Connection lifecycle over the simulator: setup failures, half-close, simultaneous close,
//! abort, close with data in flight, dead peers (crash, broken link, keepalive).

use std::net::SocketAddr;
use std::time::Duration;

use sdp_core::proto::conn::CallError;
use sdp_core::proto::{Config, ConnError, Shutdown, State};
use sdp_core::socket::Errno;
use sdp_tests::pair::{closed, Pair, A_IP, B_IP, PORT};

const SEC: u64 = 1_000_000_000;

fn read_all(
    p: &mut Pair,
    b: bool,
    id: sdp_core::proto::table::ConnId,
) -> Result<(Vec<u8>, bool), CallError> {
    let now = p.now();
    let d = if b { &mut p.b } else { &mut p.a };
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match d.read(now, id, &mut buf) {
            Ok(0) => return Ok((out, true)),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(CallError::WouldBlock) => return Ok((out, false)),
            Err(e) => return Err(e),
        }
    }
}

#[test]
fn refused_when_nobody_listens() {
    let mut p = Pair::new(10, Config::default());
    let now = p.now();
    let id =
        p.a.connect(now, SocketAddr::new(B_IP, PORT + 1), None)
            .unwrap();
    let ok = p.run_until(SEC, |p| {
        p.a.conn(id).is_some_and(|c| c.state() == State::Closed)
    });
    assert!(ok);
    let err = p.a.conn(id).unwrap().error().cloned().unwrap();
    assert_eq!(err, ConnError::Refused);
    assert_eq!(err.errno(), libc_econnrefused());
    // Fails fast: one round trip, not a timeout.
    assert!(p.fabric.now() < SEC / 100, "took {} ns", p.fabric.now());
}

fn libc_econnrefused() -> i32 {
    111
}

#[test]
fn unreachable_host_times_out_cleanly() {
    let mut p = Pair::new(11, Config::default());
    let now = p.now();
    let id =
        p.a.connect(now, "10.9.9.9:80".parse().unwrap(), None)
            .unwrap();
    let ok = p.run_until(30 * SEC, |p| {
        p.a.conn(id).is_some_and(|c| c.state() == State::Closed)
    });
    assert!(ok);
    assert!(matches!(
        p.a.conn(id).unwrap().error(),
        Some(ConnError::Unreachable | ConnError::TimedOut)
    ));
}

#[test]
fn half_close_delivers_everything_then_eof_and_other_half_keeps_working() {
    let mut p = Pair::new(12, Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7) as u8).collect();
    let mut off = 0;
    while off < data.len() {
        match p.a.write(now, a, &data[off..]) {
            Ok(n) => off += n,
            Err(CallError::WouldBlock) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(off, data.len(), "sndbuf takes it all");
    // Shut while most of it is still queued.
    p.a.shutdown(now, a, Shutdown::Write).unwrap();
    assert_eq!(p.a.write(now, a, b"x"), Err(CallError::BrokenPipe));
    let mut got = Vec::new();
    let ok = p.run_until(10 * SEC, |p| {
        let (chunk, eof) = read_all(p, true, b).unwrap();
        got.extend(chunk);
        eof
    });
    assert!(ok, "no EOF");
    assert_eq!(got, data, "every byte before the EOF");
    // B can still send to A.
    let now = p.now();
    assert_eq!(p.b.write(now, b, b"reply"), Ok(5));
    p.b.shutdown(now, b, Shutdown::Write).unwrap();
    let mut back = Vec::new();
    let ok = p.run_until(10 * SEC, |p| {
        let (chunk, eof) = read_all(p, false, a).unwrap();
        back.extend(chunk);
        eof
    });
    assert!(ok);
    assert_eq!(back, b"reply");
    p.run_for(SEC);
    assert_eq!(p.a.conn(a).unwrap().state(), State::Closed);
    assert_eq!(p.b.conn(b).unwrap().state(), State::Closed);
    assert_eq!(p.a.conn(a).unwrap().error(), None);
    assert_eq!(p.b.conn(b).unwrap().error(), None);
}

#[test]
fn simultaneous_close() {
    let mut p = Pair::new(13, Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    p.a.write(now, a, b"from a").unwrap();
    p.b.write(now, b, b"from b").unwrap();
    p.a.shutdown(now, a, Shutdown::Write).unwrap();
    p.b.shutdown(now, b, Shutdown::Write).unwrap();
    let (mut ga, mut gb) = (Vec::new(), Vec::new());
    let (mut ea, mut eb) = (false, false);
    let ok = p.run_until(10 * SEC, |p| {
        if !ea {
            let (c, e) = read_all(p, false, a).unwrap();
            ga.extend(c);
            ea = e;
        }
        if !eb {
            let (c, e) = read_all(p, true, b).unwrap();
            gb.extend(c);
            eb = e;
        }
        ea && eb
            && p.a.conn(a).unwrap().state() == State::Closed
            && p.b.conn(b).unwrap().state() == State::Closed
    });
    assert!(ok);
    assert_eq!(ga, b"from b");
    assert_eq!(gb, b"from a");
    assert_eq!(p.a.conn(a).unwrap().error(), None);
    assert_eq!(p.b.conn(b).unwrap().error(), None);
    assert_eq!(closed(&p.a.take_events(a)), Some(None));
    assert_eq!(closed(&p.b.take_events(b)), Some(None));
}

#[test]
fn close_with_data_in_flight_still_delivers_it() {
    let mut p = Pair::new(14, Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    let data = vec![0xabu8; 1 << 20];
    let mut off = 0;
    while off < data.len() {
        off += p.a.write(now, a, &data[off..]).unwrap();
    }
    p.a.close(now, a);
    let mut got = 0usize;
    let ok = p.run_until(10 * SEC, |p| {
        let (c, eof) = read_all(p, true, b).unwrap();
        assert!(c.iter().all(|&x| x == 0xab));
        got += c.len();
        eof
    });
    assert!(ok);
    assert_eq!(got, data.len());
    let now = p.now();
    p.b.close(now, b);
    p.run_for(SEC);
    assert_eq!(
        p.a.conn_count(),
        0,
        "A's closed connection is gone from the table"
    );
    assert_eq!(p.b.conn_count(), 0);
    assert_eq!(
        p.fabric.stats(A_IP).registered_bytes,
        0,
        "A freed every registration"
    );
    assert_eq!(p.fabric.stats(B_IP).registered_bytes, 0);
    assert_eq!(p.fabric.stats(A_IP).qps, 0);
}

#[test]
fn close_with_unread_data_resets_like_tcp() {
    let mut p = Pair::new(15, Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    p.a.write(now, a, b"unread").unwrap();
    p.run_for(SEC / 10);
    let now = p.now();
    p.b.close(now, b);
    p.run_for(SEC);
    let now = p.now();
    let mut buf = [0u8; 8];
    assert_eq!(
        p.a.read(now, a, &mut buf),
        Err(CallError::Conn(ConnError::Reset))
    );
    assert_eq!(CallError::Conn(ConnError::Reset).errno(), 104);
}

#[test]
fn abort_mid_transfer() {
    let mut p = Pair::new(16, Config::default());
    let (a, b) = p.connect();
    let chunk = vec![1u8; 100_000];
    let mut got = 0;
    p.run_until(SEC / 100, |p| {
        let now = p.now();
        let _ = p.a.write(now, a, &chunk);
        got += read_all(p, true, b).unwrap().0.len();
        false
    });
    assert!(got > 0, "transfer under way");
    let now = p.now();
    p.a.abort(now, a);
    let ok = p.run_until(5 * SEC, |p| p.b.conn(b).unwrap().state() == State::Closed);
    assert!(
        ok,
        "A: {}\nB: {}",
        p.a.conn(a).unwrap().debug_state(),
        p.b.conn(b).unwrap().debug_state()
    );
    assert_eq!(p.b.conn(b).unwrap().error(), Some(&ConnError::Reset));
    assert_eq!(p.a.conn(a).unwrap().error(), Some(&ConnError::Aborted));
    let now = p.now();
    assert_eq!(
        p.b.write(now, b, b"x"),
        Err(CallError::Conn(ConnError::Reset))
    );
}

#[test]
fn peer_crash_mid_transfer_is_noticed() {
    let mut p = Pair::new(17, Config::default());
    let (a, _b) = p.connect();
    let chunk = vec![1u8; 100_000];
    p.run_until(SEC / 100, |p| {
        let now = p.now();
        let _ = p.a.write(now, a, &chunk);
        false
    });
    p.fabric.faults().crash(B_IP);
    let ok = p.run_until(5 * SEC, |p| {
        let now = p.now();
        let _ = p.a.write(now, a, &chunk);
        p.a.conn(a).unwrap().state() == State::Closed
    });
    assert!(
        ok,
        "crash not noticed: {}",
        p.a.conn(a).unwrap().debug_state()
    );
    let e = p.a.conn(a).unwrap().error().cloned().unwrap();
    assert!(matches!(e, ConnError::TimedOut | ConnError::Reset), "{e:?}");
}

#[test]
fn keepalive_detects_a_dead_idle_peer() {
    let cfg = Config {
        keepalive_idle: Some(Duration::from_secs(2)),
        ..Config::default()
    };
    let mut p = Pair::new(18, cfg.clone());
    let (a, _b) = p.connect();
    // Alive and idle: probes succeed, nothing breaks.
    p.run_for(10 * SEC);
    assert_eq!(p.a.conn(a).unwrap().state(), State::Established);
    assert!(p.a.conn(a).unwrap().stats().keepalives_sent >= 3);
    p.fabric.faults().crash(B_IP);
    let ok = p.run_until(20 * SEC, |p| p.a.conn(a).unwrap().state() == State::Closed);
    assert!(ok, "dead peer not detected");
    assert!(matches!(
        p.a.conn(a).unwrap().error(),
        Some(ConnError::TimedOut | ConnError::Reset)
    ));
}

#[test]
fn idle_connection_without_keepalive_stays_up() {
    let mut p = Pair::new(19, Config::default());
    let (a, b) = p.connect();
    p.run_for(60 * SEC);
    assert_eq!(p.a.conn(a).unwrap().state(), State::Established);
    assert_eq!(p.b.conn(b).unwrap().state(), State::Established);
    let now = p.now();
    assert_eq!(p.a.write(now, a, b"still here"), Ok(10));
}

#[test]
fn broken_link_ends_in_a_clear_error() {
    let mut p = Pair::new(20, Config::default());
    let (a, b) = p.connect();
    p.fabric.faults().break_link(A_IP, B_IP);
    let chunk = vec![1u8; 10_000];
    let ok = p.run_until(5 * SEC, |p| {
        let now = p.now();
        let _ = p.a.write(now, a, &chunk);
        p.a.conn(a).unwrap().state() == State::Closed
    });
    assert!(ok);
    assert!(p.a.conn(a).unwrap().error().is_some());
    let _ = b;
}

/// A device whose QPs hang (no completion, no error: Soft-RoCE after a link flap) is bounded by
/// `send_stall_timeout`: the writer's connection fails with `TimedOut` after it, not never.
#[test]
fn stalled_sends_end_in_timed_out_with_a_bound_and_hang_without() {
    let cfg = Config {
        send_stall_timeout: Some(Duration::from_secs(3)),
        ..Config::default()
    };
    for (bound, cfg) in [(false, Config::default()), (true, cfg)] {
        let mut p = Pair::new(23, cfg);
        let (a, _b) = p.connect();
        p.fabric.faults().stall_link(A_IP, B_IP);
        let chunk = vec![1u8; 10_000];
        let closed = p.run_until(20 * SEC, |p| {
            let now = p.now();
            let _ = p.a.write(now, a, &chunk);
            p.a.conn(a).unwrap().state() == State::Closed
        });
        if bound {
            assert!(closed, "the bound did not end the connection");
            assert_eq!(p.a.conn(a).unwrap().error(), Some(&ConnError::TimedOut));
        } else {
            // What the bound is for: without it nothing ends the connection.
            assert!(!closed);
            assert_eq!(p.a.conn(a).unwrap().state(), State::Established);
        }
    }
}

/// The stall bound holds for a connection nobody calls on: one write whose sends then hang,
/// and only the progress rounds after it. Found: a round passed a connection whose endpoint
/// was quiet and whose engine had no timer due without looking at the stall bound, so the
/// connection lived on until some engine timer came due (never, with no keepalive).
#[test]
fn stalled_sends_end_at_the_bound_without_further_calls() {
    let bound = Duration::from_secs(3);
    let cfg = Config {
        send_stall_timeout: Some(bound),
        ..Config::default()
    };
    let mut p = Pair::new(24, cfg);
    let (a, _b) = p.connect();
    p.fabric.faults().stall_link(A_IP, B_IP);
    let now = p.now();
    let start = now;
    p.a.write(now, a, &[1u8; 10_000]).unwrap();
    let closed = p.run_until(20 * SEC, |p| p.a.conn(a).unwrap().state() == State::Closed);
    assert!(closed, "nothing ended the stalled connection");
    assert_eq!(p.a.conn(a).unwrap().error(), Some(&ConnError::TimedOut));
    // Simulated time: the failure comes at the bound (a round at the deadline), not later.
    let took = p.now().saturating_since(start);
    assert!(
        took < bound + Duration::from_secs(1),
        "failed after {took:?}"
    );
}

#[test]
fn urgent_byte_travels_apart_from_the_stream() {
    let mut p = Pair::new(21, Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    p.a.write(now, a, b"before").unwrap();
    p.a.with_conn(now, a, |c| c.send_urgent(now, b'!'))
        .unwrap()
        .unwrap();
    p.a.write(now, a, b"after").unwrap();
    p.run_for(SEC / 10);
    let evs = p.b.take_events(b);
    assert!(evs.contains(&sdp_core::proto::Event::Urgent));
    let now = p.now();
    assert_eq!(
        p.b.with_conn(now, b, |c| c.read_urgent()).unwrap(),
        Some(b'!')
    );
    let (got, _) = read_all(&mut p, true, b).unwrap();
    assert_eq!(got, b"beforeafter");
}

/// The urgent mark as TCP keeps it: a read stops at it, `at_mark` holds from there until a
/// read goes past it, and that read ends the urgent byte not read by then. With SO_OOBINLINE
/// the byte stays in the stream, right at the mark, and is pending until read.
#[test]
fn urgent_mark_stops_a_read_and_oob_inline_keeps_the_byte() {
    for inline in [false, true] {
        let mut p = Pair::new(23, Config::default());
        let (a, b) = p.connect();
        let now = p.now();
        p.b.set_oob_inline(now, b, inline).unwrap();
        p.a.write(now, a, b"abc").unwrap();
        p.a.with_conn(now, a, |c| c.send_urgent(now, b'X'))
            .unwrap()
            .unwrap();
        p.a.write(now, a, b"def").unwrap();
        p.run_for(SEC / 10);
        let now = p.now();
        let mark = |p: &Pair| p.b.view(b).unwrap().at_mark();
        let urgent = |p: &Pair| p.b.view(b).unwrap().urgent_pending();
        assert!(!mark(&p) && urgent(&p), "inline {inline}");
        let mut buf = [0u8; 64];
        assert_eq!(p.b.read(now, b, &mut buf), Ok(3));
        assert_eq!(&buf[..3], b"abc");
        assert!(
            mark(&p),
            "inline {inline}: at the mark after the bytes before it"
        );
        let rest: &[u8] = if inline { b"Xdef" } else { b"def" };
        assert_eq!(p.b.read(now, b, &mut buf), Ok(rest.len()));
        assert_eq!(&buf[..rest.len()], rest);
        assert!(!mark(&p) && !urgent(&p), "inline {inline}: past the mark");
        // Not read apart before the read went past it: gone, as TCP's.
        assert_eq!(p.b.with_conn(now, b, |c| c.read_urgent()).unwrap(), None);
    }
}

/// A second urgent byte before the reader reached the first mark moves the mark on, and the
/// first urgent byte is stream data again, as Linux's TCP reads it (abc X def Y gh: `abcXdef`,
/// then Y apart, then `gh`); before, X was lost. (This engine sends an urgent byte alone in its
/// message: X goes back in a buffer of its own.)
#[test]
fn a_second_urgent_byte_puts_the_first_back_in_the_stream() {
    let mut p = Pair::new(25, Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    p.a.write(now, a, b"abc").unwrap();
    p.a.with_conn(now, a, |c| c.send_urgent(now, b'X'))
        .unwrap()
        .unwrap();
    p.a.write(now, a, b"def").unwrap();
    p.a.with_conn(now, a, |c| c.send_urgent(now, b'Y'))
        .unwrap()
        .unwrap();
    p.a.write(now, a, b"gh").unwrap();
    p.run_for(SEC / 10);
    let now = p.now();
    let mut buf = [0u8; 64];
    let n = p.b.read(now, b, &mut buf).unwrap();
    assert_eq!(&buf[..n], b"abcXdef");
    assert_eq!(
        p.b.with_conn(now, b, |c| c.read_urgent()).unwrap(),
        Some(b'Y')
    );
    let n = p.b.read(now, b, &mut buf).unwrap();
    assert_eq!(&buf[..n], b"gh");
}

/// TCP_DEFER_ACCEPT (`Driver::set_defer_accept`): an established connection is neither
/// counted ready nor handed out until it has data, or until it waited as long as Linux defers
/// (1 s for a value of 1); a listener without it hands out at once.
#[test]
fn a_deferring_listener_hands_out_connections_at_their_data_or_after_the_wait() {
    let mut p = Pair::new(24, Config::default());
    let l = p.listener;
    p.b.set_defer_accept(l, 1);
    let now = p.now();
    let a = p.a.connect(now, SocketAddr::new(B_IP, PORT), None).unwrap();
    let up = p.run_until(SEC / 10, |p| {
        p.a.conn(a).is_some_and(|c| c.state() == State::Established)
            && p.b.listen_stats(l).unwrap().queued == 1
    });
    assert!(up);
    // (Virtual time jumps to the next deadline, the deferral's end among them: look at once.)
    let ready = |p: &Pair| p.b.listen_stats(l).unwrap().ready;
    assert_eq!(ready(&p), 0, "established, nothing sent: deferred");
    assert_eq!(p.b.accept_established(l), None);
    let now = p.now();
    p.a.write(now, a, b"hello").unwrap();
    assert!(p.run_until(SEC / 10, |p| ready(p) == 1), "its data came");
    let b = p.b.accept_established(l).expect("handed out with its data");
    let mut buf = [0u8; 8];
    let now = p.now();
    assert_eq!(p.b.read(now, b, &mut buf), Ok(5));
    // One that never writes: handed out once the deferral is out, not before.
    let now = p.now();
    let a2 = p.a.connect(now, SocketAddr::new(B_IP, PORT), None).unwrap();
    let up = p.run_until(SEC / 10, |p| {
        p.a.conn(a2)
            .is_some_and(|c| c.state() == State::Established)
            && p.b.listen_stats(l).unwrap().queued == 1
    });
    assert!(up);
    let queued_at = p.now();
    assert_eq!(ready(&p), 0);
    assert!(
        p.run_until(2 * SEC, |p| ready(p) == 1),
        "the deferral is out"
    );
    let waited = p.now().saturating_since(queued_at);
    assert!(
        waited >= Duration::from_millis(990) && waited < Duration::from_millis(1100),
        "{waited:?}"
    );
    assert!(p.b.accept_established(l).is_some());
    // Off again: at once.
    p.b.set_defer_accept(l, 0);
    let now = p.now();
    let a3 = p.a.connect(now, SocketAddr::new(B_IP, PORT), None).unwrap();
    let handed = p.run_until(SEC, |p| {
        p.a.conn(a3)
            .is_some_and(|c| c.state() == State::Established)
            && p.b.listen_stats(l).unwrap().ready == 1
    });
    assert!(handed);
}

#[test]
fn writes_before_established_would_block_and_reads_too() {
    let mut p = Pair::new(22, Config::default());
    let now = p.now();
    let id = p.a.connect(now, SocketAddr::new(B_IP, PORT), None).unwrap();
    assert_eq!(p.a.write(now, id, b"x"), Err(CallError::WouldBlock));
    let mut buf = [0u8; 4];
    assert_eq!(p.a.read(now, id, &mut buf), Err(CallError::WouldBlock));
    assert_eq!(
        p.a.shutdown(now, id, Shutdown::Write),
        Err(CallError::NotConnected)
    );
}

/// Read until the stream ends or fails: the bytes, and how it ended.
fn read_to_failure(
    p: &mut Pair,
    id: sdp_core::proto::table::ConnId,
) -> (Vec<u8>, Result<(), CallError>) {
    let now = p.now();
    let mut out = Vec::new();
    let mut buf = [0u8; 7000];
    loop {
        match p.b.read(now, id, &mut buf) {
            Ok(0) => return (out, Ok(())),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) => return (out, Err(e)),
        }
    }
}

/// B holds `data` from A, unread; then `kill` ends A abnormally. B must still read all of
/// it, then the error (as Linux does after a reset), and the error again after that.
fn unread_data_survives(seed: u64, cfg: Config, kill: impl FnOnce(&mut Pair, ConnIdOf)) {
    let mut p = Pair::new(seed, cfg);
    let (a, b) = p.connect();
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut off = 0;
    let ok = p.run_until(5 * SEC, |p| {
        let now = p.now();
        if off < data.len() {
            off += p.a.write(now, a, &data[off..]).unwrap_or(0);
        }
        p.b.conn(b).unwrap().rx_queued_bytes() == data.len()
    });
    assert!(ok, "B never held the data");
    kill(&mut p, a);
    let ok = p.run_until(30 * SEC, |p| p.b.conn(b).unwrap().state() == State::Closed);
    assert!(ok, "B: {}", p.b.conn(b).unwrap().debug_state());
    let err = p.b.conn(b).unwrap().error().cloned().expect("an error");
    let (got, end) = read_to_failure(&mut p, b);
    assert!(got == data, "read {} of {} bytes", got.len(), data.len());
    assert_eq!(end, Err(CallError::Conn(err.clone())));
    let now = p.now();
    assert_eq!(
        p.b.read(now, b, &mut [0u8; 8]),
        Err(CallError::Conn(err.clone()))
    );
    // Every buffer goes back once read.
    let c = p.b.conn(b).unwrap();
    assert_eq!((c.rx_queued_bytes(), c.store().registered_bytes()), (0, 0));
}

type ConnIdOf = sdp_core::proto::table::ConnId;

#[test]
fn unread_data_stays_readable_after_the_peer_aborts() {
    unread_data_survives(23, Config::default(), |p, a| {
        let now = p.now();
        p.a.abort(now, a);
    });
}

#[test]
fn unread_data_stays_readable_after_the_peer_crashes() {
    let cfg = Config {
        keepalive_idle: Some(Duration::from_secs(1)),
        ..Config::default()
    };
    unread_data_survives(24, cfg, |p, _| p.fabric.faults().crash(A_IP));
}

/// How a zero-copy read into A's sink is cut short (see `zero_copy_read_cut_short`).
#[derive(Debug, Clone, Copy)]
enum CutShort {
    /// B advertises memory it never granted remote read on: the RDMA Read fails.
    ReadRefused,
    /// B crashes while A's RDMA Read is on its way.
    PeerDies,
    /// A's application aborts the connection while its RDMA Read is on its way.
    LocalAbort,
}

/// A reads B's 4 MiB source straight into its sink, and the read never completes normally.
/// The sink must end with exactly one report (an application waits on it, and its memory is
/// B's to write until then), and the connection with an error: nothing waits forever.
fn zero_copy_read_cut_short(seed: u64, how: CutShort) {
    use sdp_core::proto::iocb::{ZSink, ZSrc};
    use sdp_core::proto::read::ZRecv;
    use sdp_core::proto::Event;
    use sdp_core::verbs::{Access, MemoryRegion, Provider};
    const N: usize = 4 << 20;
    let mut p = Pair::new(seed, Config::default());
    let (a, b) = p.connect();
    let mut src_mr = p.b.provider().reg_mr(N, Access::empty()).unwrap();
    src_mr.write(0, &vec![0x5au8; N]);
    if !matches!(how, CutShort::ReadRefused) {
        src_mr.set_access(Access::REMOTE_READ).unwrap();
    }
    let src = ZSrc {
        addr: src_mr.addr(),
        len: N as u32,
        lkey: src_mr.lkey(),
        rkey: src_mr.rkey(),
    };
    let now = p.now();
    assert_eq!(p.b.write_zcopy(now, b, src, 1), Ok(()));
    assert!(p.run_until(SEC, |p| p.a.conn(a).unwrap().next_is_zcopy().is_some()));
    let sink_mr = p.a.provider().reg_mr(N, Access::LOCAL_WRITE).unwrap();
    let sink = ZSink {
        addr: sink_mr.addr(),
        len: N as u32,
        lkey: sink_mr.lkey(),
        rkey: sink_mr.rkey(),
    };
    let now = p.now();
    assert_eq!(p.a.read_zcopy(now, a, sink, 7), Ok(ZRecv::Pending));
    // The read is posted (the driver posts what the call produced) and on its way.
    match how {
        CutShort::ReadRefused => {}
        CutShort::PeerDies => p.fabric.faults().crash(B_IP),
        CutShort::LocalAbort => {
            let now = p.now();
            p.a.abort(now, a);
        }
    }
    let mut reports = Vec::new();
    let mut events = Vec::new();
    let ended = p.run_until(10 * SEC, |p| {
        for e in p.a.take_events(a) {
            if let Event::ZcopyReceived { token, bytes } = e {
                reports.push((token, bytes));
            }
            events.push(e);
        }
        p.a.conn(a).unwrap().state() == State::Closed
    });
    assert!(
        ended,
        "{how:?}: connection not ended: {}",
        p.a.conn(a).unwrap().debug_state()
    );
    // Long after, still exactly one report.
    p.run_for(SEC);
    for e in p.a.take_events(a) {
        if let Event::ZcopyReceived { token, bytes } = e {
            reports.push((token, bytes));
        }
    }
    assert_eq!(reports, vec![(7, 0)], "{how:?}: {events:?}");
    let err = p.a.conn(a).unwrap().error().cloned();
    assert!(err.is_some(), "{how:?}: ended without an error");
}

#[test]
fn zero_copy_read_refused_by_the_peer_reports_its_sink_once() {
    zero_copy_read_cut_short(21, CutShort::ReadRefused);
}

#[test]
fn zero_copy_read_from_a_peer_that_dies_reports_its_sink_once() {
    zero_copy_read_cut_short(22, CutShort::PeerDies);
}

#[test]
fn zero_copy_read_under_a_local_abort_reports_its_sink_once() {
    zero_copy_read_cut_short(23, CutShort::LocalAbort);
}

/// A connection whose B end shut its write side, once A has read B's DisConn: (the pair, A's id).
fn half_closed_by_b(seed: u64) -> (Pair, sdp_core::proto::table::ConnId) {
    let mut p = Pair::new(seed, Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    p.b.shutdown(now, b, Shutdown::Write).unwrap();
    assert!(p.run_until(SEC, |p| p.a.conn(a).unwrap().read_closed()));
    (p, a)
}

/// A QP that goes to error silently (only its posted work flushed: no error completion, no CM
/// event, the peer not told, as Soft-RoCE's responder does after a replayed RDMA Read met a
/// deregistered region) after the peer's DisConn must still fail the connection when bytes of
/// ours can no longer arrive. Found by the rig's soak: the flushes were taken for the end of an
/// orderly close (the peer had sent DisConn), and a writer whose zero-copy source was still out
/// waited forever (`sdp-soak: HANG: no byte moved for 30 s`).
#[test]
fn a_silent_qp_error_after_the_peers_disconn_fails_a_writer() {
    let (mut p, a) = half_closed_by_b(25);
    // Bytes of A's in flight when its QP dies.
    let now = p.now();
    assert_eq!(p.a.write(now, a, &[7u8; 10_000]).unwrap(), 10_000);
    p.fabric.faults().error_qps_silently(A_IP);
    let closed = p.run_until(20 * SEC, |p| p.a.conn(a).unwrap().state() == State::Closed);
    assert!(closed, "the writer's connection outlived its QP");
    // After the peer's DisConn, as TCP's RST in CLOSE_WAIT: EPIPE (reads stay at EOF).
    let c = p.a.conn(a).unwrap();
    assert_eq!(c.error(), Some(&ConnError::ResetAfterClose));
    assert_eq!(c.error().unwrap().errno(), libc::EPIPE);
}

/// The same on a quiet half-closed connection: nothing of ours is lost, so nothing is reported
/// (TCP's reader sees EOF, not an error) until the application writes, which fails as a write
/// to a peer that is gone does over TCP.
#[test]
fn a_silent_qp_error_on_a_quiet_half_closed_connection_surfaces_at_the_next_write() {
    let (mut p, a) = half_closed_by_b(26);
    p.fabric.faults().error_qps_silently(A_IP);
    p.run_for(SEC);
    {
        let c = p.a.conn(a).unwrap();
        assert_eq!(c.error(), None);
        assert!(c.read_closed(), "the reader still sees EOF");
    }
    let now = p.now();
    let _ = p.a.write(now, a, &[7u8; 10_000]);
    let closed = p.run_until(20 * SEC, |p| p.a.conn(a).unwrap().state() == State::Closed);
    assert!(closed, "a write on the dead QP did not end the connection");
    assert_eq!(
        p.a.conn(a).unwrap().error(),
        Some(&ConnError::ResetAfterClose)
    );
}

/// iWARP (siw in the rig: `siw-sdp-zsend` and `siw-sdp-zcopy` failed about once in 60-200
/// runs with "transport error: LocalProtection" after every byte had moved). The peer closes in
/// order (both DisConns through, its sends done) and tears the connection down while a control
/// message of ours is under way: here a SinkAvail, offered by a read that ran before we took
/// the peer's last bytes and DisConn from the CQ. On iWARP the message meets the peer's closed
/// TCP stream, and its send fails with a local QP error (siw: the stream was reset under it)
/// before the CM tells of the disconnect. The peer needed nothing of it: the close is orderly,
/// every byte readable, then EOF, no error.
#[test]
fn a_send_the_peers_orderly_teardown_resets_is_no_error() {
    use sdp_core::proto::iocb::ZSink;
    use sdp_core::proto::read::ZRecv;
    use sdp_core::verbs::sim::SimConfig;
    use sdp_core::verbs::{Access, MemoryRegion, Provider};

    let sim = SimConfig {
        iwarp_close_ns: Some(1_000_000),
        ..SimConfig::default()
    };
    let mut p = Pair::with(12, sim, Config::default(), Config::default());
    let (a, b) = p.connect();
    let now = p.now();
    assert_eq!(p.a.write(now, a, b"request").unwrap(), 7);
    p.a.shutdown(now, a, Shutdown::Write).unwrap();
    let mut got = Vec::new();
    let ok = p.run_until(SEC, |p| {
        let (bytes, eof) = read_all(p, true, b).expect("B reads");
        got.extend_from_slice(&bytes);
        eof
    });
    assert!(ok && got == b"request", "B got {got:?}");
    let now = p.now();
    assert_eq!(p.b.write(now, b, b"answer").unwrap(), 6);
    p.b.shutdown(now, b, Shutdown::Write).unwrap();
    // B finishes (its answer and DisConn reach A's receive queue, A's engine does not look)
    // and tears the connection down.
    let mut b_done = false;
    for _ in 0..10_000 {
        let now = p.now();
        p.b.poll(now);
        b_done = p.b.conn(b).is_none_or(|c| c.state() != State::Established);
        if b_done || !p.advance() {
            break;
        }
    }
    assert!(
        b_done,
        "B did not finish: {}",
        p.b.conn(b).unwrap().debug_state()
    );
    // A's application offers a sink before its engine saw any of that: a SinkAvail goes.
    let now = p.now();
    let prov = p.a.provider().clone();
    let mut mr = prov.reg_mr(1 << 20, Access::LOCAL_WRITE).unwrap();
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::READ_SINK;
    let g = mr.advertise(0, 1 << 20, access).unwrap();
    let sink = ZSink {
        addr: g.addr,
        len: g.len as u32,
        lkey: g.lkey,
        rkey: g.rkey,
    };
    let r = p.a.read_zcopy(now, a, sink, 1);
    assert!(matches!(r, Ok(ZRecv::Pending)), "{r:?}");
    // The reset comes back within a few latencies, long before A's CM tells of the close.
    // Then A's engine takes its completions: B's bytes and DisConn, the failed SinkAvail
    // (and would repost the receives they used: siw refuses posts on that QP).
    let until = p.fabric.now() + 50_000;
    while p.fabric.next_event_at().is_some_and(|t| t <= until) {
        p.fabric.step();
    }
    let mut events = Vec::new();
    let mut got = Vec::new();
    let mut eof = false;
    let ok = p.run_until(SEC, |p| {
        if let Ok((bytes, end)) = read_all(p, false, a) {
            got.extend_from_slice(&bytes);
            eof |= end;
        }
        events.extend(p.a.take_events(a));
        closed(&events).is_some() && eof
    });
    assert_eq!(closed(&events), Some(None), "A's events: {events:?}");
    assert!(ok, "A did not finish");
    assert_eq!(got, b"answer");
}
