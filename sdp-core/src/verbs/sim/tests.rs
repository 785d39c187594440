//! Unit tests of the world's internals; behaviour is tested in `tests/sim_provider.rs`.

use std::net::{IpAddr, Ipv4Addr};

use super::world::World;
use super::*;

fn ip(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))
}

#[test]
fn event_queue_orders_by_time_then_insertion() {
    let f = SimFabric::new(1);
    assert_eq!(f.next_event_at(), None);
    f.advance(5);
    assert_eq!(f.now(), 5);
    // Going back in time is a no-op.
    f.advance(3);
    assert_eq!(f.now(), 5);
    assert_eq!(f.step(), None);
}

#[test]
fn keys_and_addresses_are_unique_and_seeded() {
    let mut a = World::new(7, SimConfig::default());
    let mut b = World::new(7, SimConfig::default());
    let mut c = World::new(8, SimConfig::default());
    a.host_mut(ip(1));
    b.host_mut(ip(1));
    c.host_mut(ip(1));
    let ra = a.reg_mr(ip(1), 10, Access::LOCAL_WRITE).unwrap();
    let rb = b.reg_mr(ip(1), 10, Access::LOCAL_WRITE).unwrap();
    let rc = c.reg_mr(ip(1), 10, Access::LOCAL_WRITE).unwrap();
    assert_eq!(ra, rb);
    assert_ne!((ra.1, ra.2), (rc.1, rc.2));
    assert_ne!(ra.1, ra.2);
    let r2 = a.reg_mr(ip(1), 5000, Access::LOCAL_WRITE).unwrap();
    assert_eq!(ra.3, MR_BASE);
    assert_eq!(r2.3, MR_BASE + 2 * PAGE, "one page plus one guard page");
    let r3 = a.reg_mr(ip(1), 0, Access::empty()).unwrap();
    assert_eq!(r3.3, r2.3 + 2 * PAGE + PAGE);
}

#[test]
fn dead_host_refuses_everything() {
    let mut w = World::new(1, SimConfig::default());
    w.host_mut(ip(1));
    w.crash(ip(1));
    assert!(matches!(
        w.reg_mr(ip(1), 1, Access::empty()),
        Err(VerbsError::NoDevice(_))
    ));
    let addr = "0.0.0.0:1".parse().unwrap();
    assert!(matches!(
        w.listen(ip(1), addr, 1),
        Err(VerbsError::NoDevice(_))
    ));
    w.restart(ip(1));
    assert!(w.listen(ip(1), addr, 1).is_ok());
}
