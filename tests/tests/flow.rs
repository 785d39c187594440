//! Flow control and resources: credit starvation and recovery, bounded memory against a peer
//! that reads nothing, slow start of receive buffers, ChRcvBuf resizing, SrcAvail cancel.

use std::time::Duration;

use sdp_core::proto::conn::{CallError, MIN_RX_POSTED};
use sdp_core::proto::{Config, State};
use sdp_core::verbs::sim::SimConfig;
use sdp_tests::pair::{Pair, A_IP, B_IP};
use sdp_tests::stream::{App, Mode};

const SEC: u64 = 1_000_000_000;

#[test]
fn stalled_reader_bounds_sender_memory_then_recovers() {
    let cfg = Config::default();
    let mut p = Pair::new(50, cfg.clone());
    let (a, b) = p.connect();
    let total = 64u64 << 20;
    let mut wa = App::builder(Mode::BCopy)
        .sends(total)
        .max_msg(256 * 1024)
        .tx_seed(1)
        .rx_seed(2)
        .build();
    let mut rb = App::builder(Mode::BCopy).tx_seed(2).rx_seed(1).build();
    rb.paused_reader = true;
    p.run_until(5 * SEC, |p| {
        let now = p.now();
        wa.pump(&mut p.a, now, a);
        rb.pump(&mut p.b, now, b);
        false
    });
    // The writer is blocked: bounded by sndbuf, and by the receiver's budget of buffers.
    let now = p.now();
    assert_eq!(p.a.write(now, a, b"more"), Err(CallError::WouldBlock));
    assert!(wa.sent < total);
    assert!(p.a.conn(a).unwrap().tx_queued_bytes() <= cfg.sndbuf);
    let reg_a = p.fabric.stats(A_IP).registered_bytes as usize;
    let reg_b = p.fabric.stats(B_IP).registered_bytes as usize;
    assert!(
        reg_a <= cfg.sndbuf + 2 * cfg.max_rcv_size as usize + (1 << 20),
        "sender registered {reg_a}"
    );
    let rx_budget = cfg.max_rx_bufs as usize * cfg.max_rcv_size as usize;
    assert!(
        reg_b <= rx_budget + (1 << 20),
        "receiver registered {reg_b}"
    );
    let stalled_at = wa.sent;
    assert!(stalled_at > 0);
    // Nothing moves while the reader sleeps, and nothing breaks either.
    p.run_for(10 * SEC);
    assert_eq!(p.a.conn(a).unwrap().state(), State::Established);
    // Recovery: the reader wakes and everything arrives intact.
    rb.paused_reader = false;
    let ok = p.run_until(60 * SEC, |p| {
        let now = p.now();
        wa.pump(&mut p.a, now, a);
        rb.pump(&mut p.b, now, b);
        rb.eof
    });
    assert!(ok);
    assert_eq!(rb.received, total);
}

/// What B holds unread (and A has queued) after A writes into a reader that reads nothing,
/// with B's SO_RCVBUF `rcvbuf`; then B reads everything, intact.
fn held_by_a_stalled_reader(seed: u64, rcvbuf: Option<usize>) -> (usize, usize) {
    let cfg = Config::default();
    let mut p = Pair::new(seed, cfg);
    let (a, b) = p.connect();
    let now = p.now();
    p.b.with_conn(now, b, |c| c.set_rcvbuf(rcvbuf)).unwrap();
    let total = 16u64 << 20;
    let mut wa = App::builder(Mode::BCopy)
        .sends(total)
        .max_msg(64 * 1024)
        .tx_seed(1)
        .rx_seed(2)
        .build();
    let mut rb = App::builder(Mode::BCopy).tx_seed(2).rx_seed(1).build();
    rb.paused_reader = true;
    p.run_until(5 * SEC, |p| {
        let now = p.now();
        wa.pump(&mut p.a, now, a);
        rb.pump(&mut p.b, now, b);
        false
    });
    let held = p.b.conn(b).unwrap().rx_queued_bytes();
    let queued = p.a.conn(a).unwrap().tx_queued_bytes();
    rb.paused_reader = false;
    let ok = p.run_until(60 * SEC, |p| {
        let now = p.now();
        wa.pump(&mut p.a, now, a);
        rb.pump(&mut p.b, now, b);
        rb.eof
    });
    assert!(ok, "the stream completes once the reader reads");
    assert_eq!(rb.received, total);
    (held, queued)
}

#[test]
fn so_rcvbuf_bounds_what_a_stalled_reader_holds() {
    // By default the receiver's window grows (slow start) to `max_rx_bufs` buffers.
    let (held_default, _) = held_by_a_stalled_reader(52, None);
    assert!(held_default > 1 << 20, "default window held {held_default}");
    // SO_RCVBUF 100 000: buffers of 32 KiB, at least MIN_RX_POSTED of them.
    let cfg = Config::default();
    let cap = (100_000usize.div_ceil(cfg.rcv_size as usize)).max(MIN_RX_POSTED as usize)
        * cfg.rcv_size as usize;
    let (held, queued) = held_by_a_stalled_reader(52, Some(100_000));
    assert!(held > 0 && held <= cap, "held {held}, cap {cap}");
    // The writer's side still takes what its own SO_SNDBUF allows.
    assert!(queued > 0 && queued <= cfg.sndbuf, "queued {queued}");
}

#[test]
fn both_sides_at_full_speed_never_deadlock_on_credits() {
    // Small buffers and few of them make credits the bottleneck in both directions.
    let cfg = Config {
        rcv_size: 1024,
        max_rcv_size: 1024,
        initial_rx_bufs: 2,
        min_rx_bufs: 2,
        max_rx_bufs: 5,
        ..Config::default()
    };
    let mut p = Pair::new(51, cfg);
    let (a, b) = p.connect();
    let mut x = App::builder(Mode::BCopy)
        .sends(4 << 20)
        .max_msg(5000)
        .tx_seed(1)
        .rx_seed(2)
        .build();
    let mut y = App::builder(Mode::BCopy)
        .sends(4 << 20)
        .max_msg(5000)
        .tx_seed(2)
        .rx_seed(1)
        .build();
    let ok = p.run_until(600 * SEC, |p| {
        let now = p.now();
        x.pump(&mut p.a, now, a);
        y.pump(&mut p.b, now, b);
        x.eof && y.eof
    });
    assert!(
        ok,
        "A: {}\nB: {}",
        p.a.conn(a).unwrap().debug_state(),
        p.b.conn(b).unwrap().debug_state()
    );
    assert!(
        p.a.conn(a).unwrap().stats().stalls_no_credit > 0,
        "credits really were the limit"
    );
    // The simulator's rnr_retry is 0: a SEND without a posted receive would have failed.
    assert_eq!(p.fabric.stats(A_IP).rnr_naks, 0);
    assert_eq!(p.fabric.stats(B_IP).rnr_naks, 0);
}

#[test]
fn slow_start_grows_under_load_and_shrinks_when_idle() {
    let cfg = Config::default();
    // A round trip long enough that credit updates lag behind the sender.
    let sim = SimConfig {
        latency_ns: 50_000,
        ..SimConfig::default()
    };
    let mut p = Pair::with(52, sim, cfg.clone(), cfg.clone());
    let (a, b) = p.connect();
    // (Never fewer than a peer needs to send data while a credit update crosses it.)
    assert_eq!(
        p.b.conn(b).unwrap().rx_posted_now(),
        cfg.initial_rx_bufs.max(MIN_RX_POSTED) as usize
    );
    let mut w = App::builder(Mode::BCopy)
        .sends(256 << 20)
        .max_msg(1 << 20)
        .tx_seed(1)
        .rx_seed(2)
        .build();
    let mut r = App::builder(Mode::BCopy).tx_seed(2).rx_seed(1).build();
    let mut peak = 0;
    p.run_until(60 * SEC, |p| {
        let now = p.now();
        w.pump(&mut p.a, now, a);
        r.pump(&mut p.b, now, b);
        peak = peak.max(p.b.conn(b).unwrap().rx_posted_now());
        r.eof
    });
    assert!(r.eof);
    assert!(
        peak > cfg.initial_rx_bufs as usize * 2,
        "posted receives grew to {peak}"
    );
    assert!(peak <= cfg.max_rx_bufs as usize);
    // ChRcvBuf made the sender's messages larger.
    assert!(
        p.a.conn(a).unwrap().send_size() > cfg.rcv_size,
        "send size {}",
        p.a.conn(a).unwrap().send_size()
    );
    assert!(p.a.conn(a).unwrap().stats().resizes > 0);
}

#[test]
fn idle_connection_gives_memory_back() {
    let cfg = Config::default();
    let mut p = Pair::new(53, cfg.clone());
    let (a, b) = p.connect();
    let mut w = App::builder(Mode::BCopy)
        .sends(64 << 20)
        .max_msg(1 << 20)
        .tx_seed(1)
        .rx_seed(2)
        .build();
    let mut r = App::builder(Mode::BCopy)
        .sends(1 << 20)
        .max_msg(1 << 20)
        .tx_seed(2)
        .rx_seed(1)
        .build();
    w.keep_open = true;
    r.keep_open = true;
    let mut busy_a = 0;
    p.run_until(60 * SEC, |p| {
        let now = p.now();
        w.pump(&mut p.a, now, a);
        r.pump(&mut p.b, now, b);
        busy_a = busy_a.max(p.fabric.stats(A_IP).registered_bytes);
        r.received == 64 << 20 && w.received == 1 << 20
    });
    assert_eq!(r.received, 64 << 20);
    p.run_for(10 * SEC);
    let idle_a = p.fabric.stats(A_IP).registered_bytes;
    // Send and bounce buffers went back; what stays is the receives still posted (a posted
    // receive cannot be taken back from the QP: see TODO.md) and one control buffer.
    let c = p.a.conn(a).unwrap();
    let posted = (c.rx_posted_now() * c.rcv_size() as usize) as u64;
    assert!(idle_a < busy_a, "idle {idle_a} vs busy {busy_a}");
    assert!(
        idle_a <= posted + 4096,
        "idle {idle_a}, posted receives {posted}"
    );
    assert_eq!(c.tx_queued_bytes(), 0);
    assert_eq!(p.a.conn(a).unwrap().state(), State::Established);
    // Nothing is due on either idle connection: no timer wakes its process (an idle server's
    // connections cost no CPU).
    for (d, id) in [(&p.a, a), (&p.b, b)] {
        let c = d.conn(id).unwrap();
        assert_eq!(c.poll_timeout(), None, "{}", c.debug_state());
    }
    // Data moving again starts the idle check again: what it takes goes back once idle.
    w.to_send += 16 << 20;
    p.run_until(60 * SEC, |p| {
        let now = p.now();
        w.pump(&mut p.a, now, a);
        r.pump(&mut p.b, now, b);
        r.received == 80 << 20
    });
    assert_eq!(r.received, 80 << 20);
    assert!(p.a.conn(a).unwrap().poll_timeout().is_some());
    let busy_again = p.fabric.stats(A_IP).registered_bytes;
    p.run_for(10 * SEC);
    let idle_again = p.fabric.stats(A_IP).registered_bytes;
    assert!(
        idle_again < busy_again,
        "idle {idle_again} vs busy {busy_again}"
    );
    assert_eq!(p.a.conn(a).unwrap().poll_timeout(), None);
}

#[test]
fn srcavail_cancel_on_a_stalled_reader_then_rest_by_copy() {
    let cfg = Config {
        srcavail_timeout: Duration::from_millis(100),
        ..Config::default()
    };
    let mut p = Pair::new(54, cfg);
    let (a, b) = p.connect();
    let total = 8u64 << 20;
    let mut w = App::builder(Mode::ZcopySrc)
        .sends(total)
        .max_msg(1 << 20)
        .tx_seed(1)
        .rx_seed(2)
        .build();
    let mut r = App::builder(Mode::BCopy).tx_seed(2).rx_seed(1).build();
    r.paused_reader = true;
    p.run_until(2 * SEC, |p| {
        let now = p.now();
        w.pump(&mut p.a, now, a);
        r.pump(&mut p.b, now, b);
        false
    });
    assert!(
        p.a.conn(a).unwrap().stats().srcavail_cancelled > 0,
        "{}",
        p.a.conn(a).unwrap().debug_state()
    );
    r.paused_reader = false;
    let ok = p.run_until(60 * SEC, |p| {
        let now = p.now();
        w.pump(&mut p.a, now, a);
        r.pump(&mut p.b, now, b);
        r.eof
    });
    assert!(ok);
    assert_eq!(r.received, total);
}

#[test]
fn zcopy_read_path_is_really_used() {
    let mut p = Pair::new(55, Config::default());
    let (a, b) = p.connect();
    let mut w = App::builder(Mode::ZcopySrc)
        .sends(32 << 20)
        .max_msg(1 << 20)
        .tx_seed(1)
        .rx_seed(2)
        .build();
    let mut r = App::builder(Mode::BCopy).tx_seed(2).rx_seed(1).build();
    assert!(p.run_until(60 * SEC, |p| {
        let now = p.now();
        w.pump(&mut p.a, now, a);
        r.pump(&mut p.b, now, b);
        r.eof
    }));
    let sb = p.fabric.stats(B_IP);
    assert!(
        sb.rdma_read_bytes > 16 << 20,
        "receiver RDMA-read {}",
        sb.rdma_read_bytes
    );
    assert!(p.a.conn(a).unwrap().stats().srcavail_sent > 0);
}

#[test]
fn zcopy_write_path_places_bytes_in_the_readers_sink() {
    use sdp_core::proto::iocb::ZSink;
    use sdp_core::proto::read::ZRecv;
    use sdp_core::proto::Event;
    use sdp_core::verbs::{Access, MemoryRegion, Provider};
    let mut p = Pair::new(56, Config::default());
    let (a, b) = p.connect();
    let prov = p.b.provider().clone();
    let mut placed = 0usize;
    for round in 0..8u8 {
        // The reader waits first with a large registered sink: SinkAvail goes out.
        let mr = prov
            .reg_mr(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let sink = ZSink {
            addr: mr.addr(),
            len: 1 << 20,
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        };
        let now = p.now();
        assert_eq!(
            p.b.read_zcopy(now, b, sink, round as u64),
            Ok(ZRecv::Pending)
        );
        p.run_for(SEC / 1000);
        // Then the writer sends: its bytes go by RDMA Write into the sink.
        let msg = vec![round; 300_000];
        let now = p.now();
        assert_eq!(p.a.write(now, a, &msg), Ok(msg.len()));
        let mut got = None;
        assert!(p.run_until(SEC, |p| {
            got = got.or_else(|| {
                p.b.take_events(b).into_iter().find_map(|e| match e {
                    Event::ZcopyReceived { token, bytes } if token == round as u64 => Some(bytes),
                    _ => None,
                })
            });
            got.is_some()
        }));
        let n = got.unwrap();
        assert!(n > 0, "bytes placed in the sink");
        let mut bytes = vec![0u8; n];
        mr.read(0, &mut bytes);
        assert!(bytes.iter().all(|&x| x == round));
        placed += n;
        // The rest (if any) arrives the ordinary way.
        let mut rest = 0;
        p.run_until(SEC, |p| {
            let now = p.now();
            let mut buf = vec![0u8; 1 << 20];
            while let Ok(k) = p.b.read(now, b, &mut buf) {
                assert!(buf[..k].iter().all(|&x| x == round));
                rest += k;
            }
            n + rest == msg.len()
        });
        assert_eq!(n + rest, msg.len());
    }
    assert!(p.fabric.stats(A_IP).rdma_write_bytes as usize >= placed);
    assert!(placed >= 8 * 200_000, "placed {placed}");
}

/// Found by the rig's zcopy benchmark: a source that goes whole into the reader's sink waits
/// for its RDMA Write completions at the front of the source queue; the next source must not be
/// advertised before it is done (the engine used to advertise the finished one again, with a
/// zero length, and panic building the SrcAvail).
#[test]
fn source_after_one_that_filled_the_sink_is_advertised_after_it() {
    use sdp_core::proto::iocb::{ZSink, ZSrc};
    use sdp_core::proto::read::ZRecv;
    use sdp_core::proto::Event;
    use sdp_core::verbs::{Access, MemoryRegion, Provider};
    const N: usize = 64 * 1024;
    let mut p = Pair::new(57, Config::default());
    let (a, b) = p.connect();
    let sink_mr =
        p.b.provider()
            .reg_mr(N, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let sink = ZSink {
        addr: sink_mr.addr(),
        len: N as u32,
        lkey: sink_mr.lkey(),
        rkey: sink_mr.rkey(),
    };
    let now = p.now();
    assert_eq!(p.b.read_zcopy(now, b, sink, 100), Ok(ZRecv::Pending));
    p.run_for(SEC / 1000);
    // Two sources of exactly the sink's size, back to back.
    let pa = p.a.provider().clone();
    let mut srcs = Vec::new();
    for (token, byte) in [(1u64, 0x11u8), (2, 0x22)] {
        let mut mr = pa.reg_mr(N, Access::REMOTE_READ).unwrap();
        mr.write(0, &vec![byte; N]);
        let src = ZSrc {
            addr: mr.addr(),
            len: N as u32,
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        };
        let now = p.now();
        assert_eq!(p.a.write_zcopy(now, a, src, token), Ok(()));
        srcs.push(mr);
    }
    let mut sent = Vec::new();
    let mut got = Vec::new();
    let mut buf = vec![0u8; N];
    assert!(p.run_until(SEC, |p| {
        for e in p.a.take_events(a) {
            if let Event::ZcopySent { token, bytes } = e {
                sent.push((token, bytes));
            }
        }
        for e in p.b.take_events(b) {
            if let Event::ZcopyReceived { bytes, .. } = e {
                let mut v = vec![0u8; bytes];
                sink_mr.read(0, &mut v);
                got.extend_from_slice(&v);
            }
        }
        let now = p.now();
        while let Ok(k) = p.b.read(now, b, &mut buf) {
            if k == 0 {
                break;
            }
            got.extend_from_slice(&buf[..k]);
        }
        got.len() == 2 * N && sent.len() == 2
    }));
    assert_eq!(sent, vec![(1, N), (2, N)]);
    assert!(got[..N].iter().all(|&x| x == 0x11) && got[N..].iter().all(|&x| x == 0x22));
}

/// A 1 MiB sink on B, writable by the peer.
fn mib_sink(p: &Pair) -> (sdp_core::verbs::sim::SimMr, sdp_core::proto::iocb::ZSink) {
    use sdp_core::verbs::{Access, MemoryRegion, Provider};
    let mr =
        p.b.provider()
            .reg_mr(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let sink = sdp_core::proto::iocb::ZSink {
        addr: mr.addr(),
        len: 1 << 20,
        lkey: mr.lkey(),
        rkey: mr.rkey(),
    };
    (mr, sink)
}

/// A reader offers its sink while the writer's Data is already on the way: the Data proves the
/// writer had not seen the SinkAvail, and the writer drops it as stale when it arrives. The
/// sink ends empty at once (no SinkAvailCancel round trip, which used to hold the reader), no
/// byte goes into it, the stream is intact, and the next sink is used normally.
#[test]
fn sink_overtaken_by_data_ends_empty_at_once_without_a_cancel() {
    use sdp_core::proto::read::ZRecv;
    use sdp_core::proto::Event;
    use sdp_core::verbs::MemoryRegion;
    const N: usize = 300_000;
    let mut p = Pair::new(58, Config::default());
    let (a, b) = p.connect();
    let (mr, sink) = mib_sink(&p);
    // Both at the same instant: A's Data and B's SinkAvail cross on the link.
    let first: Vec<u8> = (0..N).map(|i| (i % 251) as u8).collect();
    let now = p.now();
    assert_eq!(p.a.write(now, a, &first), Ok(N));
    assert_eq!(p.b.read_zcopy(now, b, sink, 7), Ok(ZRecv::Pending));
    let mut done = None;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    assert!(p.run_until(SEC, |p| {
        for e in p.b.take_events(b) {
            if let Event::ZcopyReceived { token, bytes } = e {
                assert_eq!(token, 7);
                done = Some(bytes);
            }
        }
        if done.is_some() {
            let now = p.now();
            while let Ok(k) = p.b.read(now, b, &mut buf) {
                got.extend_from_slice(&buf[..k]);
            }
        }
        got.len() == N
    }));
    assert_eq!(done, Some(0), "the sink ended empty");
    assert!(got == first, "stream intact");
    let sb = p.b.conn(b).unwrap().stats().clone();
    assert_eq!((sb.sinkavail_sent, sb.sinkavail_stale), (1, 1));
    assert_eq!(sb.sinkavail_cancelled, 0, "no cancel round trip");
    assert_eq!(
        p.fabric.stats(A_IP).rdma_write_bytes,
        0,
        "A dropped the stale sink"
    );
    let mut v = vec![0xffu8; 1 << 20];
    mr.read(0, &mut v);
    assert!(
        v.iter().all(|&x| x == 0),
        "nothing was written into the sink"
    );
    // One overtaken sink: the next offer is skipped (the peer may still be streaming), the one
    // after is made on the quiet stream and filled by RDMA Write.
    p.run_for(SEC / 1000);
    let now = p.now();
    assert_eq!(p.b.read_zcopy(now, b, sink, 8), Ok(ZRecv::Copy));
    assert_eq!(p.b.read_zcopy(now, b, sink, 8), Ok(ZRecv::Pending));
    p.run_for(SEC / 1000);
    let second = vec![0x5au8; N];
    let now = p.now();
    assert_eq!(p.a.write(now, a, &second), Ok(N));
    let mut placed = None;
    assert!(p.run_until(SEC, |p| {
        for e in p.b.take_events(b) {
            if let Event::ZcopyReceived { token: 8, bytes } = e {
                placed = Some(bytes);
            }
        }
        placed.is_some()
    }));
    let n = placed.unwrap();
    assert!(n > 0 && p.fabric.stats(A_IP).rdma_write_bytes >= n as u64);
    mr.read(0, &mut v[..n]);
    assert!(v[..n].iter().all(|&x| x == 0x5a));
}

/// A reader that offers its sink whenever it has nothing to read, against a writer that streams
/// by SEND: its offers are overtaken, and it backs off (at most one offer in 64 while the peer
/// streams) instead of sending a SinkAvail the writer drops after every other message. Every
/// byte arrives in order, and once the stream goes quiet an offer is filled by RDMA Write.
#[test]
fn reader_backs_off_sink_offers_while_the_peer_streams() {
    use sdp_core::proto::read::ZRecv;
    use sdp_core::proto::Event;
    use sdp_core::verbs::MemoryRegion;
    const TOTAL: usize = 16 << 20;
    let mut p = Pair::new(59, Config::default());
    let (a, b) = p.connect();
    let (mr, sink) = mib_sink(&p);
    let data: Vec<u8> = (0..TOTAL).map(|i| (i * 7 % 253) as u8).collect();
    let (mut off, mut got) = (0usize, Vec::new());
    let (mut busy, mut tries, mut token) = (false, 0u64, 0u64);
    let mut buf = vec![0u8; 64 << 10];
    assert!(p.run_until(60 * SEC, |p| {
        let now = p.now();
        while off < TOTAL {
            match p.a.write(now, a, &data[off..(off + (64 << 10)).min(TOTAL)]) {
                Ok(n) => off += n,
                Err(CallError::WouldBlock) => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        for e in p.b.take_events(b) {
            if let Event::ZcopyReceived { bytes, .. } = e {
                let mut v = vec![0u8; bytes];
                mr.read(0, &mut v);
                got.extend_from_slice(&v);
                busy = false;
            }
        }
        while !busy {
            if got.len() < TOTAL {
                tries += 1;
                token += 1;
                match p.b.read_zcopy(now, b, sink, token) {
                    Ok(ZRecv::Pending) => {
                        busy = true;
                        break;
                    }
                    Ok(ZRecv::Copy) | Err(CallError::WouldBlock) => {}
                    Err(e) => panic!("read_zcopy: {e}"),
                }
            }
            match p.b.read(now, b, &mut buf) {
                Ok(k) => got.extend_from_slice(&buf[..k]),
                Err(CallError::WouldBlock) => break,
                Err(e) => panic!("read: {e}"),
            }
        }
        got.len() == TOTAL
    }));
    assert!(got == data, "stream intact");
    let s = p.b.conn(b).unwrap().stats().clone();
    assert!(s.sinkavail_stale >= 3, "{s:?}");
    assert!(
        s.sinkavail_sent * 8 < tries,
        "{} offers in {tries} tries: {s:?}",
        s.sinkavail_sent
    );
    // Quiet now: offers resume after the skipped ones, and one is filled by RDMA Write.
    let mut placed = None;
    for round in 0..200u64 {
        let now = p.now();
        if let Ok(ZRecv::Pending) = p.b.read_zcopy(now, b, sink, 1000 + round) {
            p.run_for(SEC / 1000);
            let now = p.now();
            assert_eq!(p.a.write(now, a, &[0x77u8; 100_000]), Ok(100_000));
            assert!(p.run_until(SEC, |p| {
                for e in p.b.take_events(b) {
                    if let Event::ZcopyReceived { bytes, .. } = e {
                        placed = Some(bytes);
                    }
                }
                placed.is_some()
            }));
            break;
        }
    }
    assert_eq!(placed, Some(100_000), "a quiet stream's sink is filled");
}

/// Found with a single-threaded echo server over shm (issue 14): B's application waits for its
/// zero-copy send while A's data fills B's receive window (B's application reads nothing
/// meanwhile). A reads part of B's source: its RdmaRdCompl, and the SendSm that answers B's
/// SrcAvailCancel, are control messages, and they must get through a window the peer keeps
/// full of unread data, as TCP's ACKs need no window. They used to wait for a credit that only
/// B's application could free, by reading: B's source never finished, and neither did B's
/// write.
#[test]
fn zero_copy_replies_get_through_a_window_the_peer_keeps_full() {
    use sdp_core::proto::iocb::{ZSink, ZSrc};
    use sdp_core::proto::read::ZRecv;
    use sdp_core::proto::Event;
    use sdp_core::verbs::{Access, MemoryRegion, Provider};
    const PART: usize = 256 << 10;
    let mut p = Pair::new(60, Config::default());
    let (a, b) = p.connect();
    // B streams to A first: A's posted receives grow (slow start). Then both sit idle, and A's
    // receive target shrinks back: A keeps more receives posted than its target (a posted
    // receive cannot be taken back), so the messages B sends A next bring A no new buffer to
    // announce, and A's own control messages need a spare credit.
    let mut w = App::builder(Mode::BCopy)
        .sends(8 << 20)
        .max_msg(1 << 20)
        .tx_seed(3)
        .rx_seed(4)
        .build();
    let mut r = App::builder(Mode::BCopy).tx_seed(4).rx_seed(3).build();
    w.keep_open = true;
    r.keep_open = true;
    assert!(p.run_until(10 * SEC, |p| {
        let now = p.now();
        w.pump(&mut p.b, now, b);
        r.pump(&mut p.a, now, a);
        r.received == 8 << 20
    }));
    p.run_for(3 * SEC);
    // A writes plain data until it blocks: B's receive window and A's send buffer are full.
    let chunk = vec![0x41u8; 64 << 10];
    let mut written = 0usize;
    p.run_until(SEC, |p| {
        let now = p.now();
        while let Ok(n) = p.a.write(now, a, &chunk) {
            written += n;
        }
        false
    });
    let now = p.now();
    assert_eq!(p.a.write(now, a, &chunk), Err(CallError::WouldBlock));
    assert!(written > 0);
    // B (its application still not reading) sends 1 MiB by zero copy.
    let mut src_mr = p.b.provider().reg_mr(1 << 20, Access::empty()).unwrap();
    src_mr.write(0, &vec![0x42u8; 1 << 20]);
    src_mr.set_access(Access::REMOTE_READ).unwrap();
    let src = ZSrc {
        addr: src_mr.addr(),
        len: 1 << 20,
        lkey: src_mr.lkey(),
        rkey: src_mr.rkey(),
    };
    let now = p.now();
    assert_eq!(p.b.write_zcopy(now, b, src, 9), Ok(()));
    assert!(p.run_until(SEC, |p| p.a.conn(a).unwrap().next_is_zcopy().is_some()));
    // A's application reads the first 256 KiB of it straight into its sink, then stops.
    let sink_mr = p.a.provider().reg_mr(PART, Access::LOCAL_WRITE).unwrap();
    let sink = ZSink {
        addr: sink_mr.addr(),
        len: PART as u32,
        lkey: sink_mr.lkey(),
        rkey: sink_mr.rkey(),
    };
    let now = p.now();
    assert_eq!(p.a.read_zcopy(now, a, sink, 5), Ok(ZRecv::Pending));
    // B's source ends (B's timer cancels the rest) with exactly what A read, though B's
    // application never reads.
    let mut sent = None;
    let mut received = None;
    let done = p.run_until(10 * SEC, |p| {
        for e in p.a.take_events(a) {
            if let Event::ZcopyReceived { token: 5, bytes } = e {
                received = Some(bytes);
            }
        }
        for e in p.b.take_events(b) {
            if let Event::ZcopySent { token: 9, bytes } = e {
                sent = Some(bytes);
            }
        }
        sent.is_some()
    });
    assert!(
        done,
        "B's source never ended\nA: {}\nB: {}",
        p.a.conn(a).unwrap().debug_state(),
        p.b.conn(b).unwrap().debug_state()
    );
    assert_eq!((received, sent), (Some(PART), Some(PART)));
    let mut v = vec![0u8; PART];
    sink_mr.read(0, &mut v);
    assert!(v.iter().all(|&x| x == 0x42));
    assert_eq!(p.a.conn(a).unwrap().state(), State::Established);
    assert_eq!(p.b.conn(b).unwrap().state(), State::Established);
}

/// A reads B's 1 MiB source with plain reads (bounce reads: one RdmaRdCompl per piece), so its
/// last messages to B are control messages that use up its credits, and B, answered in full,
/// sends nothing more. Then A writes: data needs more credits than a control message, and B,
/// whose peer only answered its zero copy so far, does not announce its receives unasked. A
/// asks (a credit update), B answers, and the data flows.
#[test]
fn data_after_zero_copy_replies_asks_for_the_credits_it_needs() {
    use sdp_core::proto::iocb::ZSrc;
    use sdp_core::proto::Event;
    use sdp_core::verbs::{Access, MemoryRegion, Provider};
    const N: usize = 1 << 20;
    let mut p = Pair::new(61, Config::default());
    let (a, b) = p.connect();
    let mut src_mr = p.b.provider().reg_mr(N, Access::empty()).unwrap();
    src_mr.write(0, &vec![0x42u8; N]);
    src_mr.set_access(Access::REMOTE_READ).unwrap();
    let src = ZSrc {
        addr: src_mr.addr(),
        len: N as u32,
        lkey: src_mr.lkey(),
        rkey: src_mr.rkey(),
    };
    let now = p.now();
    assert_eq!(p.b.write_zcopy(now, b, src, 1), Ok(()));
    let mut got = 0;
    let mut sent = false;
    let mut buf = vec![0u8; 64 << 10];
    assert!(p.run_until(SEC, |p| {
        let now = p.now();
        while let Ok(n) = p.a.read(now, a, &mut buf) {
            assert!(buf[..n].iter().all(|&x| x == 0x42));
            got += n;
        }
        sent |=
            p.b.take_events(b)
                .iter()
                .any(|e| matches!(e, Event::ZcopySent { token: 1, bytes: N }));
        got == N && sent
    }));
    p.run_for(SEC / 100);
    assert!(
        p.a.conn(a).unwrap().tx_credits() < sdp_core::proto::conn::DATA_CREDITS,
        "A's replies used up its data credits: {}",
        p.a.conn(a).unwrap().debug_state()
    );
    // A writes; B reads whatever comes.
    // (Fewer than four send buffers: no ChRcvBuf, whose answer would bring credits anyway.)
    let data = vec![0x77u8; 60_000];
    let mut off = 0;
    let mut rcvd = 0;
    let ok = p.run_until(5 * SEC, |p| {
        let now = p.now();
        if off < data.len() {
            if let Ok(n) = p.a.write(now, a, &data[off..]) {
                off += n;
            }
        }
        while let Ok(n) = p.b.read(now, b, &mut buf) {
            rcvd += n;
        }
        rcvd == data.len()
    });
    assert!(
        ok,
        "{rcvd} of {} bytes arrived\nA: {}\nB: {}",
        data.len(),
        p.a.conn(a).unwrap().debug_state(),
        p.b.conn(b).unwrap().debug_state()
    );
}
