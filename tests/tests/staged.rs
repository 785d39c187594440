//! Staged sends (BZCopy, `Config::staged_send_min`): a plain write that fits the send buffer
//! is copied once into a registered buffer of the connection's own, which the peer reads by
//! RDMA Read. The write returns once the bytes are staged (as TCP's returns once they are in
//! its send buffer, whatever the peer's application does); the bytes arrive in stream order
//! with what is written after them; a peer that does not read them within `srcavail_timeout`
//! gets them as Data (into its receive buffers, without its application, as TCP's data
//! reaches the peer's kernel); and every staging buffer goes back to the store. Over the
//! simulator.

use sdp_core::proto::conn::CallError;
use sdp_core::proto::table::ConnId;
use sdp_core::proto::{Config, Event, State};
use sdp_tests::pair::{pattern, Pair};

const SEC: u64 = 1_000_000_000;
const BIG: usize = 300 * 1024;

fn staged_cfg() -> Config {
    Config {
        staged_send_min: Some(128 * 1024),
        ..Config::default()
    }
}

fn read_some(p: &mut Pair, b: ConnId, want: usize) -> Vec<u8> {
    p.read_b(b, want)
}

#[test]
fn a_large_write_is_staged_and_arrives_in_order_with_what_follows() {
    let mut p = Pair::new(40, staged_cfg());
    let (a, b) = p.connect();
    let idle = p.a.registered_bytes();
    let big = pattern(BIG, 1);
    let small = pattern(1000, 7);
    let now = p.now();
    // The whole write is taken at once (staged), and the small one behind it too, before the
    // peer's application read anything.
    assert_eq!(p.a.write(now, a, &big), Ok(BIG));
    assert_eq!(p.a.write(now, a, &small), Ok(small.len()));
    let stats = p.a.conn(a).unwrap().stats().clone();
    assert_eq!(stats.staged_sends, 1, "{stats:?}");
    p.run_for(SEC / 10);
    let got = read_some(&mut p, b, BIG + small.len());
    assert_eq!(got.len(), BIG + small.len());
    assert!(got[..BIG] == big[..], "the staged bytes");
    assert!(got[BIG..] == small[..], "the bytes written after them");
    p.run_for(SEC / 10);
    // Read in full: nothing of it is outstanding, and the application heard nothing of it.
    let c = p.a.conn(a).unwrap();
    assert!(!c.zcopy_outstanding());
    assert_eq!(c.tx_queued_bytes(), 0);
    assert!(
        !p.a.take_events(a)
            .iter()
            .any(|e| matches!(e, Event::ZcopySent { .. })),
        "a staged send is the engine's own"
    );
    // Its buffer is kept for the next staged write at most until the connection idles.
    p.run_for(3 * SEC);
    // (A control buffer or two may differ from before the write; a staging buffer is BIG.)
    assert!(
        p.a.registered_bytes() < idle + 4096,
        "staging buffers not given back when idle: {} bytes registered, {idle} before",
        p.a.registered_bytes()
    );
}

/// Staged bytes count in the send buffer until the peer reads them: a writer into a peer
/// that reads nothing is held at the send buffer's size, as by copy.
#[test]
fn staged_bytes_count_in_the_send_buffer() {
    let cfg = Config {
        sndbuf: 1 << 20,
        ..staged_cfg()
    };
    let mut p = Pair::new(41, cfg);
    let (a, _b) = p.connect();
    let chunk = pattern(BIG, 3);
    let mut taken = 0;
    p.run_until(5 * SEC, |p| {
        let now = p.now();
        match p.a.write(now, a, &chunk) {
            Ok(n) => {
                taken += n;
                false
            }
            Err(CallError::WouldBlock) => true,
            Err(e) => panic!("write: {e:?}"),
        }
    });
    assert!(p.a.conn(a).unwrap().stats().staged_sends >= 2);
    // Beyond the send buffer only what went by Data into the peer's receive buffers (at most
    // `max_rx_bufs` of `max_rcv_size`): staged bytes stay counted until read.
    let cfg = p.a.conn(a).unwrap().config().clone();
    let rx = cfg.max_rx_bufs as usize * cfg.max_rcv_size as usize;
    assert!(
        taken <= (1 << 20) + rx,
        "took {taken} bytes with a 1 MiB send buffer"
    );
    assert!(taken >= 1 << 20, "took only {taken}");
}

/// A connection that ends with staged sends unread gives their buffers back.
#[test]
fn an_abort_gives_staging_buffers_back() {
    let mut p = Pair::new(42, staged_cfg());
    let (a, _b) = p.connect();
    let before = p.a.registered_bytes();
    let now = p.now();
    assert_eq!(p.a.write(now, a, &pattern(BIG, 5)), Ok(BIG));
    assert!(p.a.registered_bytes() >= before + BIG);
    let now = p.now();
    p.a.abort(now, a);
    p.run_until(5 * SEC, |p| {
        p.a.conn(a).is_none_or(|c| c.state() == State::Closed)
    });
    assert_eq!(p.a.conn(a).unwrap().state(), State::Closed);
    assert!(
        p.a.registered_bytes() < BIG,
        "{} bytes still registered",
        p.a.registered_bytes()
    );
}

/// Without staging (`Some(0)`), the same write goes by Data messages: the control for the
/// counter the tests above read.
#[test]
fn staging_off_sends_by_copy() {
    let cfg = Config {
        staged_send_min: Some(0),
        ..Config::default()
    };
    let mut p = Pair::new(43, cfg);
    let (a, b) = p.connect();
    let big = pattern(BIG, 9);
    let now = p.now();
    let mut off = 0;
    p.run_until(5 * SEC, |p| {
        let now2 = p.now();
        if let Ok(n) = p.a.write(now2.max(now), a, &big[off..]) {
            off += n;
        }
        off == BIG
    });
    assert_eq!(p.a.conn(a).unwrap().stats().staged_sends, 0);
    assert_eq!(read_some(&mut p, b, BIG), big);
}

/// A peer whose application does not read: past `srcavail_timeout` the staged bytes are taken
/// back (SrcAvailCancel, the peer's engine answers) and go as Data, each rest in its place:
/// the first staged write's ahead of the small write queued behind it, the second's after.
#[test]
fn unread_staged_bytes_go_as_data_in_order() {
    let mut p = Pair::new(44, staged_cfg());
    let (a, b) = p.connect();
    let (big1, small, big2) = (pattern(BIG, 11), pattern(5000, 12), pattern(BIG, 13));
    let now = p.now();
    assert_eq!(p.a.write(now, a, &big1), Ok(BIG));
    assert_eq!(p.a.write(now, a, &small), Ok(small.len()));
    assert_eq!(p.a.write(now, a, &big2), Ok(BIG));
    assert_eq!(p.a.conn(a).unwrap().stats().staged_sends, 2);
    // B's application reads nothing for longer than the SrcAvail timeout (2 s).
    p.run_for(4 * SEC);
    let st = p.a.conn(a).unwrap().stats().clone();
    assert!(st.srcavail_cancelled >= 1, "nothing was taken back: {st:?}");
    let want: Vec<u8> = [&big1[..], &small[..], &big2[..]].concat();
    let got = read_some(&mut p, b, want.len());
    assert_eq!(got.len(), want.len());
    assert!(got == want, "bytes out of order or wrong");
    p.run_for(SEC / 10);
    assert_eq!(p.a.conn(a).unwrap().tx_queued_bytes(), 0);
}

/// A reader behind an application fd (the shim) learns of data only from readiness, which
/// reports bytes that are here, not a SrcAvail still to fetch: its engine reads SrcAvails at
/// the head ahead (`Conn::set_read_ahead`). Found: a crate's large writes into `socat` under
/// the shim moved 5-10 MB in 3 s; nothing fetched a SrcAvail that arrived behind bytes the
/// reader had not taken yet, once it took them (1.6 GB in 3 s after the fix).
#[test]
fn a_read_ahead_reader_fetches_a_src_avail_behind_data_it_took() {
    let mut p = Pair::new(45, staged_cfg());
    let (a, b) = p.connect();
    let now = p.now();
    p.b.set_read_ahead(now, b).unwrap();
    let (small, big) = (pattern(1000, 2), pattern(BIG, 3));
    assert_eq!(p.a.write(now, a, &small), Ok(small.len()));
    p.run_for(SEC / 100);
    assert_eq!(p.a.write(p.now(), a, &big), Ok(BIG));
    p.run_for(SEC / 100);
    // B takes exactly the small write's bytes: the SrcAvail behind them is at the head now.
    let mut buf = vec![0u8; small.len()];
    let now = p.now();
    assert_eq!(p.b.read(now, b, &mut buf), Ok(small.len()));
    assert_eq!(buf, small);
    // Without a read call, the staged bytes come in and make the reader ready.
    p.run_for(SEC / 10);
    assert!(
        p.b.conn(b).unwrap().read_ready(),
        "the SrcAvail behind the bytes taken was not fetched"
    );
    assert_eq!(read_some(&mut p, b, BIG), big);
}
