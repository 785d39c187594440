//! Sequence numbers across the wrap at `u32::MAX`: two engines whose sequence numbers are moved
//! (as if the Hellos had carried initial sequence numbers just below the wrap) stream both ways
//! through every path, and every byte is checked.

use sdp_core::proto::table::ConnId;
use sdp_core::proto::{Config, State};
use sdp_tests::pair::{Pair, PairSpec};
use sdp_tests::stream::{run_duplex_all, Duplex, Mode};

/// Connect, let the pair go quiet, then move A's numbers so that its next message is `a_next`
/// and B's so that its next is `b_next`.
fn shifted_pair(seed: u64, cfg: Config, a_next: u32, b_next: u32) -> (Pair, (ConnId, ConnId)) {
    let mut p = PairSpec {
        seed,
        ..PairSpec::default()
    }
    .config(cfg)
    .build();
    let (a, b) = p.connect();
    p.run_for(50_000_000);
    let na = p.a.conn(a).unwrap().next_mseq();
    let nb = p.b.conn(b).unwrap().next_mseq();
    let (da, db) = (a_next.wrapping_sub(na), b_next.wrapping_sub(nb));
    let now = p.now();
    p.a.with_conn(now, a, |c| c.shift_sequence_numbers(da, db))
        .unwrap();
    p.b.with_conn(now, b, |c| c.shift_sequence_numbers(db, da))
        .unwrap();
    (p, (a, b))
}

fn wrap_duplex(seed: u64, mode: Mode, a_next: u32, b_next: u32) {
    let bytes = 4 << 20;
    let (mut p, (a, b)) = shifted_pair(seed, Config::default(), a_next, b_next);
    let (mut app_a, mut app_b) = Duplex {
        mode,
        bytes,
        seed,
        max_msg: 200_000,
    }
    .apps();
    run_duplex_all(
        &mut p,
        (a, b),
        &mut app_a,
        &mut app_b,
        600_000_000_000,
        bytes,
        &format!("{mode:?}"),
    );
    // Both crossed the wrap (well past it: thousands of messages went each way).
    let na = p.a.conn(a).map(|c| c.next_mseq()).unwrap();
    let nb = p.b.conn(b).map(|c| c.next_mseq()).unwrap();
    assert!(na < 1 << 30 && nb < 1 << 30, "A at {na}, B at {nb}");
    p.run_until(10_000_000_000, |p| {
        p.a.conn(a).is_none_or(|c| c.state() == State::Closed)
            && p.b.conn(b).is_none_or(|c| c.state() == State::Closed)
    });
    assert_eq!(p.a.conn(a).map(|c| c.state()), Some(State::Closed));
    assert_eq!(p.a.conn(a).unwrap().error(), None, "A closed in order");
    assert_eq!(p.b.conn(b).unwrap().error(), None, "B closed in order");
}

#[test]
fn bcopy_across_the_wrap() {
    wrap_duplex(1, Mode::BCopy, u32::MAX - 20, u32::MAX - 3);
}

#[test]
fn zcopy_across_the_wrap() {
    for mode in [Mode::ZcopySrc, Mode::ZcopySink, Mode::Both] {
        wrap_duplex(2, mode, u32::MAX - 7, u32::MAX - 30);
    }
}
