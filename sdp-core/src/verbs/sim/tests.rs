//! Unit tests of the world's internals; behaviour is tested in `tests/sim_provider.rs`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::world::World;
use super::*;
use crate::verbs::{RemoteBuf, SendOp, WcOpcode, WcStatus};

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

/// A connected pair of endpoints (client on host 1, server on host 2), both ready.
fn pair(f: &SimFabric, port: u16) -> (SimEndpoint, SimEndpoint) {
    let client = f.provider(ip(1));
    let server = f.provider(ip(2));
    let addr = SocketAddr::new(ip(2), port);
    let mut l = server.listen(addr, 4, QpCaps::default()).unwrap();
    let mut a = client.connect(addr, None, QpCaps::default(), b"").unwrap();
    f.run_until_idle(u64::MAX);
    let (mut b, _) = l.poll_request().unwrap();
    b.accept(b"").unwrap();
    f.run_until_idle(u64::MAX);
    assert!(matches!(a.poll_cm(), Some(CmEvent::Established { .. })));
    assert!(matches!(b.poll_cm(), Some(CmEvent::Established { .. })));
    (a, b)
}

/// RDMA Read `len` bytes at `addr` through `rkey` from `ep`'s peer into `sink`; the status.
fn read_status(
    f: &SimFabric,
    ep: &mut SimEndpoint,
    sink: &SimMr,
    addr: u64,
    rkey: u32,
    len: u32,
) -> WcStatus {
    op_status(f, ep, sink, SendOp::Read(RemoteBuf { addr, rkey }), len)
}

/// Post `op` over `len` bytes of `sink` on `ep` and run the fabric; the completion's status.
fn op_status(f: &SimFabric, ep: &mut SimEndpoint, sink: &SimMr, op: SendOp, len: u32) -> WcStatus {
    let wr = SendWr {
        wr_id: 9,
        op,
        sge: Some(sink.sge(0, len)),
        payload: None,
        signaled: true,
        solicited: false,
        wake_engine: false,
    };
    ep.post_send(&wr).unwrap();
    f.run_until_idle(u64::MAX);
    let mut wc = [Completion {
        wr_id: 0,
        status: WcStatus::Flushed,
        opcode: WcOpcode::Send,
        byte_len: 0,
    }];
    assert_eq!(ep.poll_cq(&mut wc), 1);
    assert_eq!(wc[0].wr_id, 9);
    wc[0].status
}

#[test]
fn a_grant_reaches_only_its_range_until_revoked() {
    let f = SimFabric::new(3);
    let server = f.provider(ip(2));
    let client = f.provider(ip(1));
    let mut mr = server.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    let bytes: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
    mr.write(0, &bytes);
    let sink = client.reg_mr(8192, Access::LOCAL_WRITE).unwrap();

    let g = mr.advertise(1000, 3000, Access::REMOTE_READ).unwrap();
    assert_eq!((g.addr, g.len), (mr.addr() + 1000, 3000));
    assert_ne!(g.rkey, mr.rkey());
    let g2 = mr.advertise(1000, 3000, Access::REMOTE_READ).unwrap();
    assert_ne!(g2.rkey, g.rkey, "each grant has its own rkey");
    mr.revoke(&g2).unwrap();

    // Inside the window: the bytes arrive.
    let (mut a, _b) = pair(&f, 7001);
    assert_eq!(
        read_status(&f, &mut a, &sink, g.addr + 100, g.rkey, 2900),
        WcStatus::Success
    );
    let mut got = vec![0u8; 2900];
    sink.read(0, &mut got);
    assert_eq!(got, bytes[1100..4000]);

    // One byte before it, one past it, and the region's own key: refused.
    let (mut a, _b) = pair(&f, 7002);
    assert_eq!(
        read_status(&f, &mut a, &sink, g.addr - 1, g.rkey, 16),
        WcStatus::RemoteAccess
    );
    let (mut a, _b) = pair(&f, 7003);
    assert_eq!(
        read_status(&f, &mut a, &sink, g.addr + 2990, g.rkey, 11),
        WcStatus::RemoteAccess
    );
    let (mut a, _b) = pair(&f, 7004);
    assert_eq!(
        read_status(&f, &mut a, &sink, g.addr, mr.rkey(), 16),
        WcStatus::RemoteAccess
    );
    // Only the access granted: no RDMA Write through a read grant.
    let (mut a, _b) = pair(&f, 7005);
    let write = SendOp::Write(RemoteBuf {
        addr: g.addr,
        rkey: g.rkey,
    });
    assert_eq!(
        op_status(&f, &mut a, &sink, write, 16),
        WcStatus::RemoteAccess
    );

    // Revoked: the same read that worked is refused, and the grant cannot be revoked twice.
    mr.revoke(&g).unwrap();
    assert!(mr.revoke(&g).is_err());
    let (mut a, _b) = pair(&f, 7006);
    assert_eq!(
        read_status(&f, &mut a, &sink, g.addr + 100, g.rkey, 16),
        WcStatus::RemoteAccess
    );

    // Bad arguments.
    assert!(mr.advertise(8000, 193, Access::REMOTE_READ).is_err());
    assert!(mr.advertise(0, 0, Access::REMOTE_READ).is_err());
    assert!(mr.advertise(0, 16, Access::REMOTE_WRITE).is_err());
}
