//! Pipelined zero copy: several SrcAvails outstanding at once. Every byte arrives intact and in
//! order (mixed with plain writes), acknowledgements beyond what was advertised abort the
//! connection, a cancel or timeout with several sources outstanding reports exact byte counts
//! and the resent rest arrives in order, and a peer that accepts one advertisement still works.

use std::time::Duration;

use sdp_core::driver::Driver;
use sdp_core::proto::conn::CallError;
use sdp_core::proto::iocb::ZSrc;
use sdp_core::proto::table::ConnId;
use sdp_core::proto::{Config, ConnError, Event, ProtocolError, State};
use sdp_core::verbs::sim::{SimConfig, SimMr, SimProvider};
use sdp_core::verbs::{Access, MemoryRegion, Provider};
use sdp_tests::pair::{Pair, A_IP, B_IP};
use sdp_tests::stream::{run_duplex, App, Bytes, Duplex, Mode};

const SEC: u64 = 1_000_000_000;

/// A registered source holding `data`, readable by the peer.
fn source(d: &Driver<SimProvider>, data: &[u8]) -> (SimMr, ZSrc) {
    let mut mr = d
        .provider()
        .reg_mr(data.len(), Access::empty())
        .expect("reg");
    mr.write(0, data);
    mr.set_access(Access::REMOTE_READ).expect("grant");
    let src = ZSrc {
        addr: mr.addr(),
        len: data.len() as u32,
        lkey: mr.lkey(),
        rkey: mr.rkey(),
    };
    (mr, src)
}

/// Queue `count` zero-copy sources of `n` bytes each on A (tokens `first`, `first` + 1, ...),
/// holding one stream of seeded random bytes; returns the stream and the registrations (kept
/// alive until the sources complete).
fn write_sources(
    p: &mut Pair,
    a: ConnId,
    seed: u64,
    count: usize,
    n: usize,
    first: u64,
) -> (Vec<u8>, Vec<SimMr>) {
    let mut all = vec![0u8; count * n];
    Bytes::new(seed).fill(&mut all);
    let mut mrs = Vec::new();
    for t in 0..count {
        let (mr, src) = source(&p.a, &all[t * n..(t + 1) * n]);
        let now = p.now();
        assert_eq!(p.a.write_zcopy(now, a, src, t as u64 + first), Ok(()));
        mrs.push(mr);
    }
    (all, mrs)
}

/// After a cancel: A sends `all[from..]` again by copy; B, holding `got` already, must end
/// with the whole stream intact, and the connection stays up.
fn resend_rest(p: &mut Pair, (a, b): (ConnId, ConnId), all: &[u8], from: usize, got: &mut Vec<u8>) {
    write_all_copy(p, a, b, &all[from..], got);
    assert!(p.run_until(30 * SEC, |p| {
        drain(p, b, got);
        got.len() == all.len()
    }));
    assert!(got == all, "stream intact after the cancel");
    assert_eq!(p.a.conn(a).unwrap().state(), State::Established);
}

/// Everything B can read now.
fn drain(p: &mut Pair, b: ConnId, into: &mut Vec<u8>) {
    let now = p.now();
    let mut buf = vec![0u8; 100_000];
    while let Ok(n) = p.b.read(now, b, &mut buf) {
        if n == 0 {
            break;
        }
        into.extend_from_slice(&buf[..n]);
    }
}

fn zcopy_sent(events: &[Event]) -> Vec<(u64, usize)> {
    events
        .iter()
        .filter_map(|e| match *e {
            Event::ZcopySent { token, bytes } => Some((token, bytes)),
            _ => None,
        })
        .collect()
}

/// Write all of `data` by copy (waiting for room as needed), reading on B meanwhile.
fn write_all_copy(p: &mut Pair, a: ConnId, b: ConnId, data: &[u8], got: &mut Vec<u8>) {
    let mut off = 0;
    assert!(p.run_until(30 * SEC, |p| {
        let now = p.now();
        while off < data.len() {
            match p.a.write(now, a, &data[off..]) {
                Ok(n) => off += n,
                Err(CallError::WouldBlock) => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        drain(p, b, got);
        off == data.len()
    }));
}

#[test]
fn several_sources_in_flight_arrive_in_order_between_plain_writes() {
    const N: usize = 200_000;
    let mut p = Pair::new(90, Config::default());
    let (a, b) = p.connect();
    assert_eq!(p.a.conn(a).unwrap().src_window(), 4);
    let mut stream = Bytes::new(7);
    let mut all = vec![0u8; 3000 + 6 * N + 5000];
    stream.fill(&mut all);
    let mut got = Vec::new();
    // Plain bytes first, then six sources (more than the window), then plain bytes again.
    let now = p.now();
    assert_eq!(p.a.write(now, a, &all[..3000]), Ok(3000));
    let mut mrs = Vec::new();
    for i in 0..6 {
        let (mr, src) = source(&p.a, &all[3000 + i * N..3000 + (i + 1) * N]);
        let now = p.now();
        assert_eq!(p.a.write_zcopy(now, a, src, i as u64 + 1), Ok(()));
        mrs.push(mr);
    }
    // Plain bytes may not pass the sources.
    let now = p.now();
    assert_eq!(
        p.a.write(now, a, &all[3000 + 6 * N..]),
        Err(CallError::WouldBlock)
    );
    let mut most = 0;
    let mut sent = Vec::new();
    assert!(p.run_until(30 * SEC, |p| {
        most = most.max(p.a.conn(a).unwrap().srcavail_inflight());
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        drain(p, b, &mut got);
        sent.len() == 6
    }));
    assert_eq!(
        sent,
        (1..=6).map(|t| (t, N)).collect::<Vec<_>>(),
        "every source in full, in order"
    );
    assert_eq!(most, 4, "the window was used");
    write_all_copy(&mut p, a, b, &all[3000 + 6 * N..], &mut got);
    assert!(p.run_until(10 * SEC, |p| {
        drain(p, b, &mut got);
        got.len() == all.len()
    }));
    assert!(got == all, "stream intact");
    let sa = p.a.conn(a).unwrap().stats().clone();
    assert_eq!(sa.srcavail_sent, 6);
    assert_eq!(sa.srcavail_cancelled, 0);
    assert!(p.fabric.stats(B_IP).rdma_read_bytes >= 6 * N as u64);
}

/// Duplex transfers with a window of four sources, every mode, link jitter, several seeds.
#[test]
fn pipelined_duplex_sweep_with_jitter() {
    for seed in 0..8u64 {
        for mode in [Mode::ZcopySrc, Mode::Both] {
            let sim = SimConfig {
                latency_ns: 1_000 + seed * 1_777,
                ..SimConfig::default()
            };
            let mut p = Pair::with(100 + seed, sim, Config::default(), Config::default());
            p.fabric
                .faults()
                .set_delay(A_IP, B_IP, 0, 5_000 + seed * 3_000);
            let (a, b) = p.connect();
            let bytes = 6 << 20;
            let (mut x, mut y) = Duplex {
                mode,
                bytes,
                seed,
                max_msg: 512 * 1024,
            }
            .apps();
            x.src_window = 4;
            y.src_window = 4;
            assert!(
                run_duplex(&mut p, (a, b), &mut x, &mut y, 120 * SEC),
                "seed {seed} {mode:?}: {}",
                p.a.conn(a).unwrap().debug_state()
            );
            assert_eq!((x.received, y.received), (bytes, bytes));
            assert!(p.a.conn(a).unwrap().stats().srcavail_sent > 0);
        }
    }
}

#[test]
fn read_completion_beyond_the_advertised_bytes_aborts_the_connection() {
    const N: usize = 100_000;
    let mut p = Pair::new(91, Config::default());
    let (a, b) = p.connect();
    let data = vec![0x33u8; N];
    let mut mrs = Vec::new();
    for t in 1..=3u64 {
        let (mr, src) = source(&p.a, &data);
        let now = p.now();
        assert_eq!(p.a.write_zcopy(now, a, src, t), Ok(()));
        mrs.push(mr);
    }
    // B reads nothing; A's three SrcAvails arrive.
    assert!(p.run_until(SEC, |p| p.a.conn(a).unwrap().srcavail_inflight() == 3));
    p.run_for(SEC / 100);
    // B's next message becomes an RdmaRdCompl for one byte more than the three sources hold.
    let over = (3 * N + 1) as u32;
    p.fabric
        .faults()
        .corrupt_next_send(B_IP, move |v: &mut Vec<u8>| {
            v.truncate(16);
            v[0] = 0x06;
            v.extend_from_slice(&over.to_be_bytes());
            let len = v.len() as u32;
            v[4..8].copy_from_slice(&len.to_be_bytes());
        });
    let now = p.now();
    p.b.write(now, b, b"x").unwrap();
    assert!(p.run_until(5 * SEC, |p| {
        p.a.conn(a).unwrap().state() == State::Closed
            && p.b.conn(b).unwrap().state() == State::Closed
    }));
    assert_eq!(
        p.a.conn(a).unwrap().error(),
        Some(&ConnError::Protocol(ProtocolError::BadComplLength {
            got: over as u64,
            want: 3 * N as u64,
        }))
    );
    assert_eq!(p.b.conn(b).unwrap().error(), Some(&ConnError::Reset));
    // Every source is reported, none in full.
    let sent = zcopy_sent(&p.a.take_events(a));
    assert_eq!(sent, vec![(1, 0), (2, 0), (3, 0)]);
}

/// Three sources outstanding; B reads part of them into bounce buffers and stalls. The
/// timeout cancels all three: the first completes with what B acknowledged, the later ones
/// with 0; the application sends the rest by copy and B reads one intact stream.
#[test]
fn timeout_with_three_sources_outstanding_reports_exact_counts() {
    const N: usize = 640 * 1024;
    let cfg = Config {
        srcavail_timeout: Duration::from_millis(100),
        ..Config::default()
    };
    let mut p = Pair::new(92, cfg);
    let (a, b) = p.connect();
    let mut all = vec![0u8; 3 * N + 10_000];
    Bytes::new(11).fill(&mut all);
    let mut mrs = Vec::new();
    for t in 0..3 {
        let (mr, src) = source(&p.a, &all[t * N..(t + 1) * N]);
        let now = p.now();
        assert_eq!(p.a.write_zcopy(now, a, src, t as u64 + 1), Ok(()));
        mrs.push(mr);
    }
    assert!(p.run_until(SEC, |p| p.a.conn(a).unwrap().srcavail_inflight() == 3));
    assert!(p.run_until(SEC, |p| p.b.conn(b).unwrap().next_is_zcopy().is_some()));
    // One read starts the bounce reads of the first source; then B stalls.
    let mut got = Vec::new();
    let now = p.now();
    let mut one = [0u8; 1];
    assert_eq!(p.b.read(now, b, &mut one), Err(CallError::WouldBlock));
    let mut sent = Vec::new();
    assert!(p.run_until(5 * SEC, |p| {
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        sent.len() == 3
    }));
    let acked = p.b.conn(b).unwrap().rx_queued_bytes();
    assert!(
        acked > 0 && acked < N,
        "B read {acked} bytes of the first source"
    );
    assert_eq!(sent, vec![(1, acked), (2, 0), (3, 0)]);
    assert!(p.a.conn(a).unwrap().stats().srcavail_cancelled >= 3);
    assert!(p.b.conn(b).unwrap().stats().srcavail_cancelled > 0);
    assert!(!p.a.conn(a).unwrap().zcopy_outstanding());
    // The rest goes again by copy, then more bytes after it.
    resend_rest(&mut p, (a, b), &all, acked, &mut got);
}

/// The application cancels the second of three outstanding sources: the cancel covers every
/// outstanding advertisement. B has read none of them, so all complete with 0.
#[test]
fn application_cancel_covers_every_outstanding_source() {
    const N: usize = 300_000;
    let mut p = Pair::new(93, Config::default());
    let (a, b) = p.connect();
    let (all, _mrs) = write_sources(&mut p, a, 12, 3, N, 1);
    assert!(p.run_until(SEC, |p| p.a.conn(a).unwrap().srcavail_inflight() == 3));
    let now = p.now();
    p.a.with_conn(now, a, |c| c.cancel_write_zcopy(now, 2))
        .unwrap();
    let mut sent = Vec::new();
    assert!(p.run_until(5 * SEC, |p| {
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        sent.len() == 3
    }));
    assert_eq!(sent, vec![(1, 0), (2, 0), (3, 0)]);
    // Nothing of the cancelled advertisements is left on B; the resent stream reads intact.
    let mut got = Vec::new();
    write_all_copy(&mut p, a, b, &all, &mut got);
    assert!(p.run_until(30 * SEC, |p| {
        drain(p, b, &mut got);
        got.len() == all.len()
    }));
    assert!(got == all);
}

/// B shuts its read half with advertisements queued: as Linux's TCP, it still reads every
/// byte (its reads end, 0, only while nothing is queued) and A's sources complete in full.
/// Before, the shutdown discarded what was queued and refused the sources (one SendSm ended
/// them all: A's sources completed with 0 bytes).
#[test]
fn a_read_half_shut_still_reads_queued_sources() {
    const N: usize = 100_000;
    let mut p = Pair::new(94, Config::default());
    let (a, b) = p.connect();
    let data = vec![0x44u8; N];
    let mut mrs = Vec::new();
    for t in 1..=6u64 {
        let (mr, src) = source(&p.a, &data);
        let now = p.now();
        assert_eq!(p.a.write_zcopy(now, a, src, t), Ok(()));
        mrs.push(mr);
    }
    assert!(p.run_until(SEC, |p| p.a.conn(a).unwrap().srcavail_inflight() == 4));
    let now = p.now();
    p.b.shutdown(now, b, sdp_core::proto::Shutdown::Read)
        .unwrap();
    let (mut got, mut sent) = (Vec::new(), Vec::new());
    assert!(p.run_until(10 * SEC, |p| {
        drain(p, b, &mut got);
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        got.len() == 6 * N && sent.len() == 6
    }));
    assert!(got.iter().all(|&x| x == 0x44));
    assert_eq!(sent, (1..=6).map(|t| (t, N)).collect::<Vec<_>>());
    p.run_for(SEC / 10);
    assert_eq!(p.a.conn(a).unwrap().state(), State::Established);
    assert_eq!(p.b.conn(b).unwrap().state(), State::Established);
    assert_eq!(p.a.conn(a).unwrap().srcavail_inflight(), 0);
    // Nothing queued: the shut read half reads 0.
    let now = p.now();
    assert_eq!(p.b.read(now, b, &mut [0u8; 16]), Ok(0));
}

/// A peer that accepts one advertisement at a time (max_adverts 1 in its Hello): we never have
/// more than one SrcAvail outstanding, and everything arrives.
#[test]
fn peer_with_max_adverts_one_gets_one_at_a_time() {
    let cfg_b = Config {
        max_adverts: 1,
        ..Config::default()
    };
    let mut p = Pair::with(95, SimConfig::default(), Config::default(), cfg_b);
    let (a, b) = p.connect();
    assert_eq!(p.a.conn(a).unwrap().src_window(), 1);
    let bytes = 8 << 20;
    let mut x = App::builder(Mode::ZcopySrc)
        .sends(bytes)
        .max_msg(512 * 1024)
        .tx_seed(21)
        .rx_seed(22)
        .build();
    let mut y = App::builder(Mode::BCopy).tx_seed(22).rx_seed(21).build();
    x.src_window = 4;
    let mut most = 0;
    assert!(p.run_until(60 * SEC, |p| {
        let now = p.now();
        x.pump(&mut p.a, now, a);
        y.pump(&mut p.b, now, b);
        most = most.max(p.a.conn(a).unwrap().srcavail_inflight());
        assert!(x.errors.is_empty() && y.errors.is_empty());
        y.eof
    }));
    assert_eq!(y.received, bytes);
    assert_eq!(most, 1);
    assert!(p.a.conn(a).unwrap().stats().srcavail_sent > 1);
}

/// `max_srcavail_inflight: 1` is the old one-at-a-time behaviour; 0 is refused.
#[test]
fn max_srcavail_inflight_is_configurable_and_validated() {
    let bad = Config {
        max_srcavail_inflight: 0,
        ..Config::default()
    };
    assert_eq!(bad.validate(), Err("max_srcavail_inflight"));
    let one = Config {
        max_srcavail_inflight: 1,
        ..Config::default()
    };
    let mut p = Pair::new(96, one);
    let (a, b) = p.connect();
    let mut x = App::builder(Mode::ZcopySrc)
        .sends(4 << 20)
        .max_msg(512 * 1024)
        .tx_seed(31)
        .rx_seed(32)
        .build();
    let mut y = App::builder(Mode::BCopy).tx_seed(32).rx_seed(31).build();
    x.src_window = 4;
    let mut most = 0;
    assert!(p.run_until(60 * SEC, |p| {
        let now = p.now();
        x.pump(&mut p.a, now, a);
        y.pump(&mut p.b, now, b);
        most = most.max(p.a.conn(a).unwrap().srcavail_inflight());
        y.eof
    }));
    assert_eq!(y.received, 4 << 20);
    assert_eq!(most, 1);
}

/// Sources sent as gathered Data messages (`zcopy_by_send`): B reads nothing, so the first
/// source stops part way when B's receive buffers are full. Cancelling it reports exactly the
/// bytes that went (only after their sends completed), the source queued behind it completes
/// with 0, and the resent rest arrives in order behind the part that went.
#[test]
fn cancel_of_a_partly_gathered_source_reports_what_went() {
    const N: usize = 4 << 20;
    let cfg = Config {
        zcopy_by_send: Some(true),
        zcopy_split: Some(false),
        ..Config::default()
    };
    let mut p = Pair::new(97, cfg);
    let (a, b) = p.connect();
    let (all, _mrs) = write_sources(&mut p, a, 21, 2, N, 1);
    // A stalls without credits once B's buffers are full.
    p.run_for(SEC);
    let gathered = p.a.conn(a).unwrap().stats().zcopy_send_bytes as usize;
    assert!(gathered > 0 && gathered < N, "gathered {gathered}");
    assert!(zcopy_sent(&p.a.take_events(a)).is_empty());
    let now = p.now();
    p.a.with_conn(now, a, |c| c.cancel_write_zcopy(now, 1))
        .unwrap();
    let mut sent = Vec::new();
    assert!(p.run_until(5 * SEC, |p| {
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        sent.len() == 2
    }));
    assert_eq!(sent, vec![(1, gathered), (2, 0)]);
    assert_eq!(p.a.conn(a).unwrap().send_room(), Config::default().sndbuf);
    // B gets exactly the part that went, then the rest A sends again by copy.
    let mut got = Vec::new();
    resend_rest(&mut p, (a, b), &all, gathered, &mut got);
}

/// Split zero copy (`zcopy_split`, software devices): the first of four 64 KiB sources goes by
/// SrcAvail, the ones behind it as gathered SENDs at once, without waiting for it. B's
/// application reads nothing, yet B's engine reads the advertisement into a bounce buffer at
/// once, so all four complete, in stream order, and nothing is cancelled when the SrcAvail
/// timeout passes. Then B reads the four intact and in order.
#[test]
fn split_source_is_read_at_once_and_sends_follow_it() {
    const N: usize = 64 * 1024;
    let cfg = Config {
        zcopy_by_send: Some(true),
        zcopy_split: Some(true),
        zcopy_split_reads: 1,
        rcv_size: 256 * 1024,
        ..Config::default()
    };
    let mut p = Pair::new(98, cfg);
    let (a, b) = p.connect();
    let (all, _mrs) = write_sources(&mut p, a, 22, 4, N, 1);
    let mut sent = Vec::new();
    assert!(p.run_until(SEC, |p| {
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        sent.len() == 4
    }));
    assert_eq!(sent, (1..=4).map(|t| (t, N)).collect::<Vec<_>>());
    p.run_for(3 * SEC);
    let sa = p.a.conn(a).unwrap().stats().clone();
    let sb = p.b.conn(b).unwrap().stats().clone();
    // The first went by SrcAvail, the next ones by SEND behind it; the last may wait for a
    // credit, and by then the advertisement is read and it is advertised in turn.
    let by_read = sa.srcavail_sent;
    assert!((1..=2).contains(&by_read), "{by_read} SrcAvails");
    assert_eq!(
        sa.zcopy_send_bytes,
        (4 - by_read) * N as u64,
        "the rest by SEND"
    );
    assert_eq!(sa.srcavail_cancelled, 0);
    assert_eq!(
        sb.zcopy_read_bytes,
        by_read * N as u64,
        "read without B's application"
    );
    assert_eq!(p.fabric.stats(B_IP).rdma_read_bytes, by_read * N as u64);
    let mut got = Vec::new();
    assert!(p.run_until(5 * SEC, |p| {
        drain(p, b, &mut got);
        got.len() == all.len()
    }));
    assert!(got == all, "stream intact");
}

/// A writer in split zero copy facing a reader that does not read advertisements ahead (its
/// own `zcopy_split` off): the committed SrcAvail outlives the SrcAvail timeout without a
/// cancel (bytes already follow it), the sources sent behind it wait to be reported until it
/// is read, and once B reads, everything arrives in order and completes in order.
#[test]
fn committed_source_is_never_cancelled_and_reports_stay_in_order() {
    const N: usize = 100 * 1024;
    let base = Config {
        zcopy_by_send: Some(true),
        rcv_size: 256 * 1024,
        ..Config::default()
    };
    let cfg_a = Config {
        zcopy_split: Some(true),
        zcopy_split_reads: 1,
        ..base.clone()
    };
    let cfg_b = Config {
        zcopy_split: Some(false),
        ..base
    };
    let mut p = Pair::with(99, SimConfig::default(), cfg_a, cfg_b);
    let (a, b) = p.connect();
    let (all, _mrs) = write_sources(&mut p, a, 23, 3, N, 10);
    p.run_for(5 * SEC);
    let st = p.a.conn(a).unwrap().stats().clone();
    assert_eq!(st.srcavail_sent, 1);
    assert_eq!(
        st.zcopy_send_bytes,
        2 * N as u64,
        "sent behind the advertisement"
    );
    assert_eq!(st.srcavail_cancelled, 0, "no cancel after the timeout");
    assert!(
        zcopy_sent(&p.a.take_events(a)).is_empty(),
        "nothing reported before the first source is read"
    );
    let mut got = Vec::new();
    let mut sent = Vec::new();
    assert!(p.run_until(5 * SEC, |p| {
        drain(p, b, &mut got);
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        got.len() == all.len() && sent.len() == 3
    }));
    assert!(got == all, "stream intact");
    assert_eq!(sent, vec![(10, N), (11, N), (12, N)]);
    assert_eq!(p.a.conn(a).unwrap().send_room(), Config::default().sndbuf);
}

/// Split zero copy cuts a source larger than a bounce buffer into pieces, each read by the
/// peer's engine or sent by SEND on its own. Two 1 MiB sources with B's application reading
/// nothing: B's engine reads ahead at most its eager bounce budget, so the sources stall part
/// way with nothing reported; then B reads and each source is reported once, whole, in order,
/// both paths carried pieces, and the stream is intact.
#[test]
fn split_pieces_of_a_large_source_are_reported_once_in_order() {
    const N: usize = 1 << 20;
    let cfg = Config {
        zcopy_by_send: Some(true),
        zcopy_split: Some(true),
        rcv_size: 64 * 1024,
        max_rx_bufs: 5,
        ..Config::default()
    };
    let mut p = Pair::new(100, cfg);
    let (a, b) = p.connect();
    let (all, _mrs) = write_sources(&mut p, a, 24, 2, N, 1);
    p.run_for(3 * SEC);
    assert!(
        zcopy_sent(&p.a.take_events(a)).is_empty(),
        "nothing reported while B reads nothing"
    );
    let read_ahead = p.b.conn(b).unwrap().stats().zcopy_read_bytes;
    assert!(read_ahead > 0, "B's engine read ahead");
    assert!(
        read_ahead <= 1 << 20,
        "eager reads stay within their budget: {read_ahead}"
    );
    assert_eq!(p.a.conn(a).unwrap().stats().srcavail_cancelled, 0);
    let mut got = Vec::new();
    let mut sent = Vec::new();
    assert!(p.run_until(10 * SEC, |p| {
        drain(p, b, &mut got);
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        got.len() == all.len() && sent.len() == 2
    }));
    assert!(got == all, "stream intact");
    assert_eq!(sent, vec![(1, N), (2, N)]);
    let sa = p.a.conn(a).unwrap().stats().clone();
    let sb = p.b.conn(b).unwrap().stats().clone();
    assert!(
        sa.srcavail_sent >= 2,
        "{} pieces advertised",
        sa.srcavail_sent
    );
    assert!(sa.zcopy_send_bytes > 0, "pieces sent by SEND");
    assert_eq!(
        sa.zcopy_send_bytes + sb.zcopy_read_bytes,
        2 * N as u64,
        "every piece went one way or the other"
    );
    assert_eq!(p.a.conn(a).unwrap().send_room(), Config::default().sndbuf);
}

/// Cancelling a split source part way: the pieces ahead that went (committed advertisements,
/// pieces sent by SEND) finish, the rest of the source and the source behind it end, and the
/// report is exactly the prefix B gets: the rest, sent again by copy, follows it intact.
#[test]
fn cancel_of_a_split_source_reports_the_prefix_that_went() {
    const N: usize = 4 << 20;
    let cfg = Config {
        zcopy_by_send: Some(true),
        zcopy_split: Some(true),
        rcv_size: 256 * 1024,
        max_rx_bufs: 8,
        ..Config::default()
    };
    let mut p = Pair::new(101, cfg);
    let (a, b) = p.connect();
    let (all, _mrs) = write_sources(&mut p, a, 25, 2, N, 1);
    // A stalls once B's receive buffers and eager bounce budget are full.
    p.run_for(SEC);
    let went = p.a.conn(a).unwrap().stats().zcopy_send_bytes;
    assert!(went > 0 && (went as usize) < N, "gathered {went}");
    let now = p.now();
    p.a.with_conn(now, a, |c| c.cancel_write_zcopy(now, 1))
        .unwrap();
    let mut got = Vec::new();
    let mut sent = Vec::new();
    assert!(p.run_until(10 * SEC, |p| {
        drain(p, b, &mut got);
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        sent.len() == 2
    }));
    let reported = sent[0].1;
    assert!(reported > 0 && reported < N, "reported {reported}");
    assert_eq!(sent, vec![(1, reported), (2, 0)]);
    assert_eq!(p.a.conn(a).unwrap().send_room(), Config::default().sndbuf);
    resend_rest(&mut p, (a, b), &all, reported, &mut got);
}

/// A reader in split zero copy reads small advertisements ahead of its application, but holds
/// at most its eager bounce budget (1 MiB): a writer that advertises every source (its own
/// split off, pipelined SrcAvails) against an application that reads nothing gets no further
/// than that and the advertisements outstanding. Once B reads, the stream completes intact.
#[test]
fn eager_reads_stay_within_the_bounce_budget() {
    let base = Config {
        rcv_size: 64 * 1024,
        max_rx_bufs: 5,
        srcavail_timeout: Duration::from_secs(30),
        ..Config::default()
    };
    let cfg_a = Config {
        zcopy_by_send: Some(false),
        zcopy_split: Some(false),
        zcopy_threshold: 1,
        ..base.clone()
    };
    let cfg_b = Config {
        zcopy_by_send: Some(true),
        zcopy_split: Some(true),
        ..base
    };
    let mut p = Pair::with(102, SimConfig::default(), cfg_a, cfg_b);
    let (a, b) = p.connect();
    let total = 8u64 << 20;
    let mut x = App::builder(Mode::ZcopySrc)
        .sends(total)
        .max_msg(128 * 1024)
        .tx_seed(60)
        .rx_seed(61)
        .build();
    // Every write is a source: nothing blocks A but B's reads.
    x.zcopy_min = 1;
    x.src_window = 8;
    let mut y = App::builder(Mode::BCopy).tx_seed(61).rx_seed(60).build();
    y.paused_reader = true;
    let mut most = 0u64;
    p.run_until(5 * SEC, |p| {
        let now = p.now();
        x.pump(&mut p.a, now, a);
        y.pump(&mut p.b, now, b);
        most = most.max(p.b.conn(b).unwrap().stats().zcopy_read_bytes);
        false
    });
    assert!(most > 0, "B read ahead");
    // Read ahead: the eager budget; beyond it only what the source advertised is pending.
    assert!(most <= 1 << 20, "B's engine read {most} bytes ahead");
    assert!(x.errors.is_empty(), "{:?}", x.errors);
    y.paused_reader = false;
    assert!(run_duplex(&mut p, (a, b), &mut x, &mut y, 60 * SEC));
    assert_eq!(y.received, total);
}

/// Split zero copy with a bound on the SEND path (`zcopy_split_sends`): never more sources or
/// pieces with SENDs in flight than the bound, so the pieces the sender would otherwise hand to
/// SEND far ahead go to the reads as they free. With a bound of 1 the reads carry a larger
/// share of the same stream than with no bound, and every byte arrives intact, in order.
#[test]
fn split_send_bound_shifts_pieces_to_the_reads() {
    const N: usize = 1 << 20;
    let run = |sends: u8| {
        let cfg = Config {
            zcopy_by_send: Some(true),
            zcopy_split: Some(true),
            zcopy_split_sends: sends,
            rcv_size: 128 * 1024,
            ..Config::default()
        };
        let mut p = Pair::new(103, cfg);
        let (a, b) = p.connect();
        let (all, _mrs) = write_sources(&mut p, a, 26, 8, N, 1);
        let mut got = Vec::new();
        let mut sent = Vec::new();
        let mut most = 0;
        assert!(p.run_until(30 * SEC, |p| {
            most = most.max(p.a.conn(a).unwrap().zcopy_sends_inflight());
            drain(p, b, &mut got);
            sent.extend(zcopy_sent(&p.a.take_events(a)));
            got.len() == all.len() && sent.len() == 8
        }));
        assert!(got == all, "sends {sends}: stream intact");
        assert_eq!(sent, (1..=8).map(|t| (t, N)).collect::<Vec<_>>());
        let read = p.b.conn(b).unwrap().stats().zcopy_read_bytes;
        let gathered = p.a.conn(a).unwrap().stats().zcopy_send_bytes;
        assert_eq!(read + gathered, all.len() as u64, "sends {sends}");
        (most, read)
    };
    let (most_free, read_free) = run(0);
    let (most_one, read_one) = run(1);
    assert!(most_free > 1, "no bound: {most_free} in flight");
    assert_eq!(most_one, 1, "bound 1");
    assert!(
        read_one > read_free,
        "bound 1 read {read_one} bytes, no bound {read_free}"
    );
}

/// A bounded source (a plain blocking write): A sends 1 MiB by zero copy with a 5 ms stall
/// bound. `b_reads` is what B's application reads of it before it stops reading (0: it never
/// starts). A's source ends as soon as B stops taking it (long before `srcavail_timeout`),
/// with exactly what B read; the rest, sent again by copy, follows it intact.
fn bounded_source_against_a_reader_that_stops(seed: u64, b_reads: usize) {
    const N: usize = 1 << 20;
    let stall = Duration::from_millis(5);
    let mut p = Pair::new(seed, Config::default());
    let (a, b) = p.connect();
    let mut all = vec![0u8; N];
    Bytes::new(seed).fill(&mut all);
    let (_mr, src) = source(&p.a, &all);
    let now = p.now();
    assert_eq!(p.a.write_zcopy_bounded(now, a, src, 1, stall), Ok(()));
    let mut got = Vec::new();
    if b_reads > 0 {
        assert!(p.run_until(SEC, |p| {
            let now = p.now();
            let mut buf = vec![0u8; b_reads - got.len()];
            if let Ok(n) = p.b.read(now, b, &mut buf) {
                got.extend_from_slice(&buf[..n]);
            }
            got.len() == b_reads
        }));
    }
    let start = p.now();
    let mut sent = Vec::new();
    assert!(p.run_until(SEC, |p| {
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        !sent.is_empty()
    }));
    let took = p.now().saturating_since(start);
    assert!(
        took < Config::default().srcavail_timeout / 10,
        "ended by the stall bound, not the timer: {took:?}"
    );
    // What B acknowledged: what it read, and what its bounce reads in flight brought in.
    let acked = sent[0].1;
    assert!(
        acked >= b_reads && acked < N,
        "acked {acked}, read {b_reads}"
    );
    assert_eq!(sent, vec![(1, acked)]);
    assert_eq!(p.a.conn(a).unwrap().stats().zcopy_stalls, 1);
    drain(&mut p, b, &mut got);
    resend_rest(&mut p, (a, b), &all, acked, &mut got);
}

#[test]
fn bounded_source_ends_when_the_peer_never_reads() {
    bounded_source_against_a_reader_that_stops(110, 0);
}

#[test]
fn bounded_source_ends_with_what_the_peer_read_when_it_stops() {
    bounded_source_against_a_reader_that_stops(111, 300_000);
}

/// A bounded source queued behind plain data that B's full receive window holds back (B's
/// application reads nothing): it ends unsent once the stall bound passes, without a message
/// to B, and the bytes go by copy behind the data, in order.
#[test]
fn bounded_source_queued_behind_a_full_window_ends_unsent() {
    const N: usize = 1 << 20;
    let mut p = Pair::new(112, Config::default());
    let (a, b) = p.connect();
    let mut data = vec![0u8; 8 << 20];
    Bytes::new(112).fill(&mut data);
    let mut off = 0;
    p.run_until(SEC / 10, |p| {
        let now = p.now();
        while let Ok(n) = p.a.write(now, a, &data[off..]) {
            off += n;
        }
        false
    });
    assert!(off > 0 && off + N <= data.len());
    let (_mr, src) = source(&p.a, &data[off..off + N]);
    let now = p.now();
    let sent_before = p.a.conn(a).unwrap().stats().msgs_sent;
    assert_eq!(
        p.a.write_zcopy_bounded(now, a, src, 1, Duration::from_millis(5)),
        Ok(())
    );
    let mut sent = Vec::new();
    assert!(p.run_until(SEC / 10, |p| {
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        !sent.is_empty()
    }));
    assert_eq!(sent, vec![(1, 0)]);
    assert_eq!(p.a.conn(a).unwrap().stats().srcavail_sent, 0);
    assert_eq!(p.a.conn(a).unwrap().stats().msgs_sent, sent_before);
    // B reads again: the data, then the source's bytes sent by copy, then the rest.
    let mut got = Vec::new();
    resend_rest(&mut p, (a, b), &data[..off + N], off, &mut got);
}

/// A reader that takes the bytes: a bounded source goes whole by zero copy, no stall.
#[test]
fn bounded_source_read_by_a_reading_peer_goes_whole_by_zero_copy() {
    const N: usize = 4 << 20;
    let mut p = Pair::new(113, Config::default());
    let (a, b) = p.connect();
    let mut all = vec![0u8; N];
    Bytes::new(113).fill(&mut all);
    let (_mr, src) = source(&p.a, &all);
    let now = p.now();
    assert_eq!(
        p.a.write_zcopy_bounded(now, a, src, 1, Duration::from_millis(5)),
        Ok(())
    );
    let mut got = Vec::new();
    let mut sent = Vec::new();
    assert!(p.run_until(SEC, |p| {
        drain(p, b, &mut got);
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        !sent.is_empty() && got.len() == N
    }));
    assert_eq!(sent, vec![(1, N)]);
    assert!(got == all);
    let s = p.a.conn(a).unwrap().stats().clone();
    assert_eq!((s.zcopy_stalls, s.srcavail_cancelled), (0, 0));
    assert!(p.fabric.stats(B_IP).rdma_read_bytes >= N as u64);
}

/// A bounded source queued behind 4 MiB of plain data that B's application is reading, at
/// about 1.3 GB/s through a small receive window: the data takes ~3 ms to go, three times the
/// stall bound, but the stream ahead of the source keeps moving (its Data messages go out as
/// B frees buffers), so the source is not stalled: it waits its turn and goes whole by zero
/// copy.
#[test]
fn bounded_source_behind_data_the_peer_is_reading_waits_its_turn() {
    const N: usize = 1 << 20;
    let cfg_b = Config {
        max_rx_bufs: 8,
        ..Config::default()
    };
    let mut p = Pair::with(114, SimConfig::default(), Config::default(), cfg_b);
    let (a, b) = p.connect();
    let mut all = vec![0u8; (4 << 20) + N];
    Bytes::new(114).fill(&mut all);
    let now = p.now();
    let ahead = p.a.write(now, a, &all[..4 << 20]).unwrap();
    assert_eq!(ahead, 4 << 20);
    let (_mr, src) = source(&p.a, &all[ahead..]);
    assert_eq!(
        p.a.write_zcopy_bounded(now, a, src, 1, Duration::from_millis(1)),
        Ok(())
    );
    let start = p.now();
    let mut got = Vec::new();
    let mut sent = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    // B reads at most 64 KiB every 50 us.
    for _ in 0..20_000 {
        p.poll();
        let now = p.now();
        if let Ok(n) = p.b.read(now, b, &mut buf) {
            got.extend_from_slice(&buf[..n]);
        }
        p.poll();
        sent.extend(zcopy_sent(&p.a.take_events(a)));
        if !sent.is_empty() && got.len() == all.len() {
            break;
        }
        p.fabric.advance_by(50_000);
    }
    assert!(
        p.now().saturating_since(start) > Duration::from_millis(3),
        "the data took longer than the stall bound"
    );
    assert_eq!(sent, vec![(1, N)], "{}", p.a.conn(a).unwrap().debug_state());
    assert!(got == all);
    assert_eq!(p.a.conn(a).unwrap().stats().zcopy_stalls, 0);
}
