//! Closing a listener frees every connection in its queue promptly, including one whose
//! handshake the acceptor finished and whose peer has not confirmed it yet (the shm
//! provider's "ready to use" message not processed): found as a flake of the leak matrix
//! (`tests/tests/leaks.rs`, "listener closed with waiting connections"), where such a
//! connection stayed until `disconnect_timeout`.

use std::net::SocketAddr;
use std::time::Duration;

use sdp_core::driver::Driver;
use sdp_core::proto::{Config, Instant};
use sdp_core::verbs::shm::ShmProvider;

fn localhost(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[test]
fn closing_a_listener_frees_a_connection_its_peer_has_not_confirmed() {
    // Long enough that only a prompt end passes (the bug waited for this timeout).
    let cfg = Config {
        disconnect_timeout: Duration::from_secs(600),
        ..Config::default()
    };
    let t0 = std::time::Instant::now();
    let now = || Instant::from_nanos(t0.elapsed().as_nanos() as u64);
    let mut srv = Driver::new(ShmProvider::new().unwrap(), cfg.clone());
    let l = srv.listen(localhost(0), 16).unwrap();
    let port = srv.listener_addr(l).unwrap().port();
    // The connector sends its request and is never polled again: it never confirms.
    let mut cli = Driver::new(ShmProvider::new().unwrap(), cfg);
    let _id = cli.connect(now(), localhost(port), None).unwrap();
    // The listener takes the request and accepts it.
    while srv.listen_stats(l).unwrap().queued == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "no request arrived");
        srv.poll(now());
        std::thread::sleep(Duration::from_millis(1));
    }
    for _ in 0..20 {
        srv.poll(now());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(srv.conn_count(), 1);
    assert_eq!(srv.listen_stats(l).unwrap().ready, 0, "still being set up");

    srv.close_listener(l);
    let closed = std::time::Instant::now();
    while srv.conn_count() > 0 && closed.elapsed() < Duration::from_secs(5) {
        srv.poll(now());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        srv.conn_count(),
        0,
        "the aborted connection is still there after 5 s: {:?}",
        srv.conn_ids()
            .into_iter()
            .map(|id| srv.conn(id).map(|c| c.state()))
            .collect::<Vec<_>>()
    );
}
