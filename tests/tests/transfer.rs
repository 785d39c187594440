//! Data integrity: both sides send seeded random streams at once, in random message sizes,
//! through every path (BCopy, ZCopy read, ZCopy write), and every byte is checked.

use sdp_core::proto::table::ConnId;
use sdp_core::proto::{Config, State};
use sdp_core::verbs::sim::SimConfig;
use sdp_tests::pair::{Pair, A_IP, B_IP};
use sdp_tests::stream::{run_duplex, App, Mode};

/// Both directions at once; returns the pair for further checks.
fn duplex(seed: u64, cfg: Config, mode: Mode, bytes: u64, max_msg: usize) -> (Pair, App, App) {
    let mut p = Pair::new(seed, cfg);
    let (a, b) = p.connect();
    let mut app_a = App::new(mode, bytes, seed * 2 + 1, seed * 2 + 2, max_msg);
    let mut app_b = App::new(mode, bytes, seed * 2 + 2, seed * 2 + 1, max_msg);
    let ok = run_duplex(&mut p, (a, b), &mut app_a, &mut app_b, 600_000_000_000);
    assert!(
        ok,
        "transfer stalled: A sent {} got {}, B sent {} got {}\nA: {}\nB: {}",
        app_a.sent,
        app_a.received,
        app_b.sent,
        app_b.received,
        p.a.conn(a).map(|c| c.debug_state()).unwrap_or_default(),
        p.b.conn(b).map(|c| c.debug_state()).unwrap_or_default()
    );
    assert_eq!(app_a.received, bytes);
    assert_eq!(app_b.received, bytes);
    // Both DisConns crossed: the connections close in order.
    p.run_until(10_000_000_000, |p| {
        p.a.conn(a).is_none_or(|c| c.state() == State::Closed)
            && p.b.conn(b).is_none_or(|c| c.state() == State::Closed)
    });
    assert_eq!(p.a.conn(a).map(|c| c.state()), Some(State::Closed));
    assert_eq!(
        p.a.conn(a).unwrap().error(),
        None,
        "orderly close has no error"
    );
    assert_eq!(p.b.conn(b).unwrap().error(), None);
    (p, app_a, app_b)
}

#[test]
fn bcopy_small_duplex() {
    duplex(1, Config::default(), Mode::BCopy, 1 << 20, 3000);
}

#[test]
fn bcopy_large_messages_duplex() {
    let (p, _, _) = duplex(2, Config::default(), Mode::BCopy, 16 << 20, 1 << 20);
    let _ = p;
}

#[test]
fn zcopy_read_path_duplex() {
    let (p, a, _) = duplex(3, Config::default(), Mode::ZcopySrc, 16 << 20, 1 << 20);
    let _ = (p, a);
}

#[test]
fn zcopy_write_path_duplex() {
    duplex(4, Config::default(), Mode::ZcopySink, 16 << 20, 1 << 20);
}

#[test]
fn zcopy_both_duplex() {
    duplex(5, Config::default(), Mode::Both, 16 << 20, 1 << 20);
}

/// A connected pair for seed `seed`: link latency and jitter that depend on the seed, and two
/// applications streaming about 2 MiB at each other in `mode`.
fn jittered(seed: u64, mode: Mode, cfg: Config) -> (Pair, ConnId, ConnId, u64, App, App) {
    let sim = SimConfig {
        latency_ns: 1_000 + seed * 997,
        ..SimConfig::default()
    };
    let mut p = Pair::with(seed, sim, cfg.clone(), cfg);
    p.fabric
        .faults()
        .set_delay(A_IP, B_IP, 0, 5_000 + seed * 300);
    let (a, b) = p.connect();
    let total = (2 << 20) + seed * 77_777;
    let x = App::new(mode, total, seed * 2 + 1, seed * 2 + 2, 300_000);
    let y = App::new(mode, total, seed * 2 + 2, seed * 2 + 1, 300_000);
    (p, a, b, total, x, y)
}

/// Many seeds, every mode, smaller transfers with random delays and jitter on the link: the
/// interleavings differ each time, the stream never does.
#[test]
fn seed_sweep_every_mode_with_jitter() {
    let seeds: u64 = std::env::var("SDP_SWEEP_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    for seed in 0..seeds {
        let mode = [Mode::BCopy, Mode::ZcopySrc, Mode::ZcopySink, Mode::Both][(seed % 4) as usize];
        eprintln!("seed {seed} mode {mode:?}");
        let (mut p, a, b, total, mut x, mut y) = jittered(seed, mode, Config::default());
        let ok = run_duplex(&mut p, (a, b), &mut x, &mut y, 600_000_000_000);
        assert!(
            ok,
            "seed {seed} stalled:\nA: {}\nB: {}",
            p.a.conn(a).unwrap().debug_state(),
            p.b.conn(b).unwrap().debug_state()
        );
        assert_eq!((x.received, y.received), (total, total), "seed {seed}");
    }
}

/// Zero-copy sources sent as Data messages gathered straight from the registered memory
/// (`zcopy_by_send`, what software RDMA devices get by default): every byte intact both ways,
/// no RDMA Read at all, and the gathered path really carried the sources.
#[test]
fn zcopy_by_send_duplex() {
    let cfg = Config {
        zcopy_by_send: Some(true),
        zcopy_split: Some(false),
        ..Config::default()
    };
    let mut p = Pair::new(6, cfg);
    let (a, b) = p.connect();
    let bytes = 16u64 << 20;
    let mut x = App::new(Mode::ZcopySrc, bytes, 13, 14, 1 << 20);
    let mut y = App::new(Mode::ZcopySrc, bytes, 14, 13, 1 << 20);
    assert!(run_duplex(&mut p, (a, b), &mut x, &mut y, 600_000_000_000));
    assert_eq!((x.received, y.received), (bytes, bytes));
    for (ip, id, d) in [(A_IP, a, &p.a), (B_IP, b, &p.b)] {
        let st = &d.conn(id).unwrap().stats;
        assert!(
            st.zcopy_send_bytes > bytes / 2,
            "{ip}: {} bytes gathered from sources",
            st.zcopy_send_bytes
        );
        assert_eq!(st.srcavail_sent, 0, "{ip}: no SrcAvail");
        assert_eq!(p.fabric.stats(ip).rdma_read_bytes, 0, "{ip}: no RDMA Read");
    }
}

/// Split zero copy (`zcopy_split`): sources that fit a bounce buffer (and the pieces larger
/// sources are cut into) alternate between SrcAvail + RDMA Read (read by the peer's engine at
/// once) and gathered SENDs that follow the advertisement without waiting, both ways at once,
/// with jitter on the link: every byte intact, each source reported once and in order (the
/// App checks), both paths carried data, nothing cancelled.
#[test]
fn split_zcopy_duplex_with_jitter() {
    let cfg = Config {
        zcopy_by_send: Some(true),
        zcopy_split: Some(true),
        rcv_size: 256 * 1024,
        ..Config::default()
    };
    for seed in 0..8u64 {
        let (mut p, a, b, _, _, _) = jittered(seed, Mode::ZcopySrc, cfg.clone());
        let bytes = 8u64 << 20;
        // Odd seeds write sources up to 1 MiB, cut into pieces.
        let max_msg = if seed % 2 == 1 { 1 << 20 } else { 128 * 1024 };
        let mut x = App::new(Mode::ZcopySrc, bytes, seed + 40, seed + 41, max_msg);
        let mut y = App::new(Mode::ZcopySrc, bytes, seed + 41, seed + 40, max_msg);
        x.src_window = 8;
        y.src_window = 8;
        assert!(
            run_duplex(&mut p, (a, b), &mut x, &mut y, 600_000_000_000),
            "seed {seed} stalled:\nA: {}\nB: {}",
            p.a.conn(a).unwrap().debug_state(),
            p.b.conn(b).unwrap().debug_state()
        );
        assert_eq!((x.received, y.received), (bytes, bytes), "seed {seed}");
        for (ip, id, d) in [(A_IP, a, &p.a), (B_IP, b, &p.b)] {
            let st = &d.conn(id).unwrap().stats;
            assert!(st.srcavail_sent > 0, "seed {seed} {ip}: no SrcAvail");
            assert!(
                st.zcopy_send_bytes > 0,
                "seed {seed} {ip}: nothing gathered"
            );
            assert_eq!(st.srcavail_cancelled, 0, "seed {seed} {ip}");
            assert!(p.fabric.stats(ip).rdma_read_bytes > 0, "seed {seed} {ip}");
        }
    }
}

/// Gathered sources mixed with sinks (the reader offers registered sinks, which the writer
/// fills by RDMA Write) and with jitter on the link: the stream stays intact for many seeds.
#[test]
fn zcopy_by_send_with_sinks_and_jitter() {
    let cfg = Config {
        zcopy_by_send: Some(true),
        ..Config::default()
    };
    for seed in 0..16u64 {
        let mode = [Mode::ZcopySrc, Mode::Both][(seed % 2) as usize];
        let (mut p, a, b, total, mut x, mut y) = jittered(seed, mode, cfg.clone());
        assert!(
            run_duplex(&mut p, (a, b), &mut x, &mut y, 600_000_000_000),
            "seed {seed} stalled:\nA: {}\nB: {}",
            p.a.conn(a).unwrap().debug_state(),
            p.b.conn(b).unwrap().debug_state()
        );
        assert_eq!((x.received, y.received), (total, total), "seed {seed}");
        assert!(
            p.a.conn(a).unwrap().stats.zcopy_send_bytes > 0,
            "seed {seed}"
        );
    }
}
