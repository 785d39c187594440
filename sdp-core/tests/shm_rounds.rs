//! Rounds of progress over shm look only at the connections with news: a peer's message, work
//! of their own, a due timer (`Driver::poll`, `Provider::take_news`), and still serve each of
//! those.

use std::net::SocketAddr;

use sdp_core::driver::Driver;
use sdp_core::proto::{Config, Instant, State};
use sdp_core::verbs::shm::ShmProvider;

/// Rounds at `now` on both sides until `done` or 10 s of wall clock (`now` itself stays put:
/// the drivers judge their periodic full round by the time they are given).
fn rounds(
    a: &mut Driver<ShmProvider>,
    b: &mut Driver<ShmProvider>,
    now: Instant,
    mut done: impl FnMut(&mut Driver<ShmProvider>, &mut Driver<ShmProvider>) -> bool,
) -> bool {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::time::Instant::now() < end {
        a.poll(now);
        b.poll(now);
        if done(a, b) {
            return true;
        }
        std::thread::yield_now();
    }
    false
}

#[test]
fn a_round_looks_only_at_connections_with_news() {
    const N: usize = 40;
    let mut a = Driver::new(ShmProvider::new().unwrap(), Config::default());
    let mut b = Driver::new(ShmProvider::new().unwrap(), Config::default());
    let l = b
        .listen("127.0.0.1:0".parse::<SocketAddr>().unwrap(), 64)
        .unwrap();
    let to = b.listener_addr(l).unwrap();
    let t0 = Instant::from_nanos(1_000_000_000);
    let ids: Vec<_> = (0..N).map(|_| a.connect(t0, to, None).unwrap()).collect();
    let mut accepted = Vec::new();
    assert!(
        rounds(&mut a, &mut b, t0, |a, b| {
            while let Some(id) = b.accept(l) {
                accepted.push(id);
            }
            let up = |d: &Driver<ShmProvider>, id| {
                d.conn(id).map(|c| c.state()) == Some(State::Established)
            };
            accepted.len() == N
                && ids.iter().all(|&id| up(a, id))
                && accepted.iter().all(|&id| up(b, id))
        }),
        "{} of {N} connections set up",
        accepted.len()
    );
    // Settle (credit updates and the like), with one full round on each side at `t1`.
    let t1 = Instant::from_nanos(2_000_000_000);
    for _ in 0..50 {
        a.poll(t1);
        b.poll(t1);
    }
    // One connection gets bytes: B's rounds look at it (and deliver), not at all N. (The
    // accepted connections came in the order they were made: one connector, one listener.)
    let k = N / 2;
    assert_eq!(a.write(t1, ids[k], b"hello").unwrap(), 5);
    let before = b.looked_at();
    let mut buf = [0u8; 16];
    let mut got = 0;
    let mut polls = 0;
    assert!(rounds(&mut a, &mut b, t1, |_, b| {
        polls += 1;
        if let Ok(n) = b.read(t1, accepted[k], &mut buf) {
            got += n;
        }
        got == 5
    }));
    let looked = b.looked_at() - before;
    assert!(
        looked <= 4 * polls as u64 && looked < (N as u64) * polls as u64 / 4,
        "B's {polls} rounds looked at {looked} connections, with {N} open and one busy"
    );
}
