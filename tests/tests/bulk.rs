//! The big one: both sides send 1 GiB of seeded random data at once, in random message sizes,
//! through BCopy, the ZCopy read path and the ZCopy write path, and every byte is checked.
//! `SDP_BULK_BYTES` overrides the size (for quick local runs).

use sdp_core::proto::{Config, State};
use sdp_tests::pair::{Pair, A_IP, B_IP};
use sdp_tests::stream::{run_duplex, App, Mode};

fn bytes() -> u64 {
    std::env::var("SDP_BULK_BYTES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1 << 30)
}

fn run(
    seed: u64,
    mode: Mode,
) -> (
    Pair,
    sdp_core::proto::table::ConnId,
    sdp_core::proto::table::ConnId,
) {
    let total = bytes();
    let mut p = Pair::new(seed, Config::default());
    let (a, b) = p.connect();
    let mut x = App::builder(mode)
        .sends(total)
        .max_msg(2 << 20)
        .tx_seed(100 + seed)
        .rx_seed(200 + seed)
        .build();
    let mut y = App::builder(mode)
        .sends(total)
        .max_msg(2 << 20)
        .tx_seed(200 + seed)
        .rx_seed(100 + seed)
        .build();
    let ok = run_duplex(&mut p, (a, b), &mut x, &mut y, 3_600_000_000_000);
    assert!(
        ok,
        "A: {}\nB: {}",
        p.a.conn(a).unwrap().debug_state(),
        p.b.conn(b).unwrap().debug_state()
    );
    assert_eq!((x.received, y.received), (total, total));
    p.run_until(10_000_000_000, |p| {
        p.a.conn(a).unwrap().state() == State::Closed
            && p.b.conn(b).unwrap().state() == State::Closed
    });
    assert_eq!(p.a.conn(a).unwrap().error(), None);
    assert_eq!(p.b.conn(b).unwrap().error(), None);
    assert_eq!(
        p.fabric.stats(A_IP).rnr_naks + p.fabric.stats(B_IP).rnr_naks,
        0
    );
    (p, a, b)
}

#[test]
fn one_gib_each_way_bcopy() {
    let (p, _, _) = run(1, Mode::BCopy);
    assert_eq!(
        p.fabric.stats(A_IP).rdma_read_bytes + p.fabric.stats(A_IP).rdma_write_bytes,
        0
    );
}

#[test]
fn one_gib_each_way_zcopy_read() {
    let (p, _, _) = run(2, Mode::ZcopySrc);
    assert!(
        p.fabric.stats(A_IP).rdma_read_bytes > bytes() / 2,
        "A read {}",
        p.fabric.stats(A_IP).rdma_read_bytes
    );
    assert!(p.fabric.stats(B_IP).rdma_read_bytes > bytes() / 2);
}

#[test]
fn one_gib_each_way_zcopy_read_and_write() {
    let (p, a, b) = run(3, Mode::Both);
    let s = p.fabric.stats(A_IP);
    let t = p.fabric.stats(B_IP);
    assert!(s.rdma_read_bytes + t.rdma_read_bytes > 0);
    assert!(
        s.rdma_write_bytes + t.rdma_write_bytes > 0,
        "write path used"
    );
    // Sinks offered while the peer was streaming ended empty (overtaken by its Data, or
    // cancelled and acknowledged), and the stream stayed intact (checked byte by byte above).
    let (ca, cb) = (&p.a.conn(a).unwrap().stats(), &p.b.conn(b).unwrap().stats());
    assert!(ca.sinkavail_sent + cb.sinkavail_sent > 0);
    assert!(
        ca.sinkavail_cancelled + cb.sinkavail_cancelled + ca.sinkavail_stale + cb.sinkavail_stale
            > 0,
        "{ca:?} {cb:?}"
    );
}
