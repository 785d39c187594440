//! What a connection costs in file descriptors over shm: connections to one peer process share
//! its pidfd and its provider's eventfd (and key table and bell page mappings), so a server
//! with thousands of clients in one process does not hold thousands of copies of each. (Each
//! connection used to hold its own: six fds per connection where TCP has one, and a redis
//! server with 2000 SDP clients of one redis-benchmark ran into its RLIMIT_NOFILE.)
//! A file of its own: the test counts this process's fds, which other tests would disturb.
#![cfg(target_os = "linux")]

use sdp_core::verbs::shm::ShmProvider;
use sdp_core::verbs::*;

mod shm_common;
use shm_common::*;

/// This process's fds whose link names contain `what` (e.g. `[pidfd]`, `[eventfd]`).
fn count(what: &str) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().contains(what))
        .count()
}

#[test]
fn connections_to_one_process_share_its_pidfd_and_eventfd() {
    let a = ShmProvider::new().unwrap();
    let b = ShmProvider::new().unwrap();
    let mut l = b.listen(localhost(0), 64, QpCaps::default()).unwrap();
    let port = l.local_addr().port();
    let connect = |l: &mut _| pair_on(&a, l, port);
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
