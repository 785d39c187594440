//! Helpers the shm provider's test files share: connected pairs and waits.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use sdp_core::verbs::shm::{ShmEndpoint, ShmProvider};
use sdp_core::verbs::*;

pub const T: Duration = Duration::from_secs(5);

pub fn localhost(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

pub fn wait_cm(ep: &mut ShmEndpoint, limit: Duration) -> Option<CmEvent> {
    let end = Instant::now() + limit;
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

pub fn wait_request(l: &mut impl Listener<Endpoint = ShmEndpoint>) -> (ShmEndpoint, Vec<u8>) {
    let end = Instant::now() + T;
    loop {
        if let Some(r) = l.poll_request() {
            return r;
        }
        assert!(Instant::now() < end, "no connect request");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// A connected pair: (active, passive).
pub fn pair(a: &ShmProvider, b: &ShmProvider) -> (ShmEndpoint, ShmEndpoint) {
    let mut l = b
        .listen(localhost(0), 16, QpCaps::default())
        .expect("listen");
    let port = l.local_addr().port();
    pair_on(a, &mut l, port)
}

pub fn pair_on(
    a: &ShmProvider,
    l: &mut impl Listener<Endpoint = ShmEndpoint>,
    port: u16,
) -> (ShmEndpoint, ShmEndpoint) {
    let mut x = a
        .connect(localhost(port), None, QpCaps::default(), b"hello")
        .expect("connect");
    let (mut y, pd) = wait_request(l);
    assert_eq!(pd, b"hello");
    y.accept(b"welcome").unwrap();
    assert_eq!(
        wait_cm(&mut x, T),
        Some(CmEvent::Established {
            private_data: b"welcome".to_vec()
        })
    );
    assert_eq!(
        wait_cm(&mut y, T),
        Some(CmEvent::Established {
            private_data: vec![]
        })
    );
    (x, y)
}
