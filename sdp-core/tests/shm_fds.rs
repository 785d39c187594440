//! What a connection costs in file descriptors over shm: connections to one peer process share
//! its pidfd and its provider's eventfd (and key table and bell page mappings), so a server
//! with thousands of clients in one process does not hold thousands of copies of each. (Each
//! connection used to hold its own: six fds per connection where TCP has one, and a redis
//! server with 2000 SDP clients of one redis-benchmark ran into its RLIMIT_NOFILE.)
//! A file of its own: the test counts this process's fds, which other tests would disturb.
#![cfg(target_os = "linux")]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use sdp_core::verbs::shm::{ShmEndpoint, ShmProvider};
use sdp_core::verbs::*;

/// This process's fds whose link names contain `what` (e.g. `[pidfd]`, `[eventfd]`).
fn count(what: &str) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().contains(what))
        .count()
}

fn wait_cm(ep: &mut ShmEndpoint) -> Option<CmEvent> {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let _ = ep.poll_cq(&mut []);
        if let Some(ev) = ep.poll_cm() {
            return Some(ev);
        }
        if Instant::now() > end {
            return None;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn connections_to_one_process_share_its_pidfd_and_eventfd() {
    let a = ShmProvider::new().unwrap();
    let b = ShmProvider::new().unwrap();
    let mut l = b
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)), 64, QpCaps::default())
        .unwrap();
    let port = l.local_addr().port();
    let connect = |l: &mut <ShmProvider as Provider>::Listener| -> (ShmEndpoint, ShmEndpoint) {
        let mut x = a
            .connect(
                SocketAddr::from(([127, 0, 0, 1], port)),
                None,
                QpCaps::default(),
                b"",
            )
            .unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        let (mut y, _) = loop {
            if let Some(r) = l.poll_request() {
                break r;
            }
            assert!(Instant::now() < end, "no connect request");
            std::thread::sleep(Duration::from_micros(200));
        };
        y.accept(b"").unwrap();
        assert!(matches!(wait_cm(&mut x), Some(CmEvent::Established { .. })));
        assert!(matches!(wait_cm(&mut y), Some(CmEvent::Established { .. })));
        (x, y)
    };
    // The first connection brings the peer's pidfd and eventfd (one each way).
    let first = connect(&mut l);
    let (pidfds, evfds, sockets) = (count("[pidfd]"), count("[eventfd]"), count("socket:"));
    let mut more = Vec::new();
    for _ in 0..16 {
        more.push(connect(&mut l));
    }
    assert_eq!(count("[pidfd]"), pidfds, "pidfds for 16 more connections");
    assert_eq!(
        count("[eventfd]"),
        evfds,
        "eventfds for 16 more connections"
    );
    // Each connection still has its own sockets (the rendezvous connection, and the direct
    // wakeup socket once given), nothing else.
    let per = (count("socket:") - sockets) as f64 / 16.0;
    assert!(per <= 2.0, "{per} sockets per connection");
    drop(more);
    drop(first);
}
