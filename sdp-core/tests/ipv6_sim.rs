//! IPv6 through the driver over the simulated fabric (issue 17 §2; the rig's `--two-guests` mode
//! runs the same over real rxe devices): the Hello in the connect request says `ip_version` 6 for
//! an IPv6 destination and 4 for an IPv4 one, and two IPv6 hosts move data both ways, with IPv6
//! addresses on both ends.

use std::net::{IpAddr, SocketAddr};

use sdp_core::driver::Driver;
use sdp_core::proto::conn::CallError;
use sdp_core::proto::msgs::{Ext, Header};
use sdp_core::proto::{Config, Instant, State};
use sdp_core::verbs::sim::SimFabric;
use sdp_core::verbs::{Listener, Provider, QpCaps};

const PORT: u16 = 7000;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// The `ip_version` of the Hello a driver on `a` sends when it connects to `b` (read by a raw
/// listener on `b`, as the CM hands it the private data).
fn hello_ip_version(a: IpAddr, b: IpAddr) -> u8 {
    let f = SimFabric::new(7);
    let mut d = Driver::new(f.provider(a), Config::default());
    let mut l = f
        .provider(b)
        .listen(SocketAddr::new(b, PORT), 4, QpCaps::default())
        .unwrap();
    d.connect(Instant(f.now()), SocketAddr::new(b, PORT), None)
        .unwrap();
    for _ in 0..1000 {
        d.poll(Instant(f.now()));
        if let Some((_ep, pd)) = l.poll_request() {
            let h = Header::parse_private_data(&pd).expect("a Hello");
            match h.ext {
                Ext::Hello(hello) => return hello.ip_version,
                other => panic!("not a Hello: {other:?}"),
            }
        }
        f.advance_by(1_000);
    }
    panic!("no connect request arrived at {b}");
}

#[test]
fn hello_carries_the_ip_version_of_the_destination() {
    assert_eq!(hello_ip_version(ip("fd00:79::1"), ip("fd00:79::2")), 6);
    assert_eq!(hello_ip_version(ip("192.168.79.1"), ip("192.168.79.2")), 4);
}

#[test]
fn ipv6_hosts_connect_and_move_data_both_ways() {
    let (ia, ib) = (ip("fd00:79::1"), ip("fd00:79::2"));
    let f = SimFabric::new(11);
    let mut a = Driver::new(f.provider(ia), Config::default());
    let mut b = Driver::new(f.provider(ib), Config::default());
    let l = b.listen(SocketAddr::new(ib, PORT), 8).unwrap();
    let ca = a
        .connect(Instant(f.now()), SocketAddr::new(ib, PORT), None)
        .unwrap();
    let msg_a: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
    let msg_b: Vec<u8> = (0..100_000u32).map(|i| (i * 13 + 1) as u8).collect();
    let (mut sent_a, mut sent_b) = (0, 0);
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    let mut cb = None;
    let mut buf = vec![0u8; 65536];
    for _ in 0..200_000 {
        let now = Instant(f.now());
        a.poll(now);
        b.poll(now);
        if cb.is_none() {
            cb = b.accept(l);
        }
        if a.conn(ca).is_some_and(|c| c.state() == State::Established) && sent_a < msg_a.len() {
            match a.write(now, ca, &msg_a[sent_a..]) {
                Ok(n) => sent_a += n,
                Err(CallError::WouldBlock) => {}
                Err(e) => panic!("A's write: {e:?}"),
            }
        }
        if let Some(cb) = cb {
            if sent_b < msg_b.len() {
                match b.write(now, cb, &msg_b[sent_b..]) {
                    Ok(n) => sent_b += n,
                    Err(CallError::WouldBlock) => {}
                    Err(e) => panic!("B's write: {e:?}"),
                }
            }
            match b.read(now, cb, &mut buf) {
                Ok(n) => got_b.extend_from_slice(&buf[..n]),
                Err(CallError::WouldBlock) => {}
                Err(e) => panic!("B's read: {e:?}"),
            }
        }
        match a.read(now, ca, &mut buf) {
            Ok(n) => got_a.extend_from_slice(&buf[..n]),
            Err(CallError::WouldBlock) => {}
            Err(e) => panic!("A's read: {e:?}"),
        }
        if got_a.len() == msg_b.len() && got_b.len() == msg_a.len() {
            break;
        }
        f.advance_by(1_000);
    }
    assert_eq!(got_b, msg_a, "B received A's bytes");
    assert_eq!(got_a, msg_b, "A received B's bytes");
    let cb = cb.unwrap();
    assert_eq!(a.peer_addr(ca).unwrap(), SocketAddr::new(ib, PORT));
    assert_eq!(a.local_addr(ca).unwrap().ip(), ia);
    assert_eq!(b.peer_addr(cb).unwrap().ip(), ia);
    assert_eq!(b.local_addr(cb).unwrap(), SocketAddr::new(ib, PORT));
}
