//! A bug found by `sdp-soak` (issue 14), reproduced deterministically over the simulator, and
//! fixed (every zero-copy sink now ends with one report):
//! a zero-copy receive ([`Conn::read_zcopy`] of a peer's SrcAvail, which posts an RDMA Read
//! straight into the caller's sink) is never reported ([`Event::ZcopyReceived`]) when that RDMA
//! Read does not complete successfully (the peer dies or the link breaks while it is in
//! flight): `on_read_completion` takes the error path without an event, and `finish` drops the
//! in-flight read. The socket layer waits for that event without a timeout
//! (`Runtime::zcopy_wait_for`), so `recv_registered` (and a large plain read with zero copy on)
//! hangs forever once the peer is killed at the wrong moment.
//!
//! [`Conn::read_zcopy`]: sdp_core::proto::Conn
//! [`Event::ZcopyReceived`]: sdp_core::proto::Event

use sdp_core::proto::iocb::{ZSink, ZSrc};
use sdp_core::proto::read::ZRecv;
use sdp_core::proto::{Config, Event, State};
use sdp_core::verbs::{Access, MemoryRegion, Provider};
use sdp_tests::pair::{Pair, A_IP, B_IP};

const SEC: u64 = 1_000_000_000;
const N: usize = 1 << 20;

/// B reads A's 1 MiB SrcAvail into its sink; `fault` strikes while the RDMA Read is in flight.
fn sink_read_then(fault: impl FnOnce(&mut Pair)) -> (Vec<Event>, State) {
    let cfg = Config {
        zcopy_by_send: Some(false),
        ..Config::default()
    };
    let mut p = Pair::new(14, cfg);
    let (a, b) = p.connect();
    let mut src_mr = p.a.provider().reg_mr(N, Access::REMOTE_READ).unwrap();
    src_mr.write(0, &vec![0x5a; N]);
    let src = ZSrc {
        addr: src_mr.addr(),
        len: N as u32,
        lkey: src_mr.lkey(),
        rkey: src_mr.rkey(),
    };
    let now = p.now();
    assert_eq!(p.a.write_zcopy(now, a, src, 1), Ok(()));
    // Until B holds the SrcAvail at the head of its stream.
    assert!(p.run_until(SEC, |p| p
        .b
        .conn(b)
        .is_some_and(|c| c.next_is_zcopy().is_some())));
    let sink_mr =
        p.b.provider()
            .reg_mr(N, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let sink = ZSink {
        addr: sink_mr.addr(),
        len: N as u32,
        lkey: sink_mr.lkey(),
        rkey: sink_mr.rkey(),
    };
    let now = p.now();
    assert_eq!(p.b.read_zcopy(now, b, sink, 77), Ok(ZRecv::Pending));
    // The RDMA Read is posted, not completed.
    p.poll();
    fault(&mut p);
    let mut events = Vec::new();
    p.run_until(60 * SEC, |p| {
        events.extend(p.b.take_events(b));
        p.b.conn(b).is_none_or(|c| c.state() == State::Closed)
    });
    events.extend(p.b.take_events(b));
    let state = p.b.conn(b).map_or(State::Closed, |c| c.state());
    (events, state)
}

fn reported(events: &[Event]) -> bool {
    events
        .iter()
        .any(|e| matches!(e, Event::ZcopyReceived { token: 77, .. }))
}

#[test]
fn sink_read_reported_when_the_peer_crashes_mid_read() {
    let (events, state) = sink_read_then(|p| p.fabric.faults().crash(A_IP));
    assert_eq!(state, State::Closed, "B never closed");
    assert!(
        reported(&events),
        "B closed without ZcopyReceived for its sink: {events:?}"
    );
}

#[test]
fn sink_read_reported_when_the_link_breaks_mid_read() {
    let (events, state) = sink_read_then(|p| p.fabric.faults().break_link(A_IP, B_IP));
    assert_eq!(state, State::Closed, "B never closed");
    assert!(
        reported(&events),
        "B closed without ZcopyReceived for its sink: {events:?}"
    );
}

/// The same transfer without a fault reports the sink (the harness itself is sound).
#[test]
fn sink_read_reported_without_a_fault() {
    let cfg = Config {
        zcopy_by_send: Some(false),
        ..Config::default()
    };
    let mut p = Pair::new(14, cfg);
    let (a, b) = p.connect();
    let mut src_mr = p.a.provider().reg_mr(N, Access::REMOTE_READ).unwrap();
    src_mr.write(0, &vec![0x5a; N]);
    let src = ZSrc {
        addr: src_mr.addr(),
        len: N as u32,
        lkey: src_mr.lkey(),
        rkey: src_mr.rkey(),
    };
    let now = p.now();
    assert_eq!(p.a.write_zcopy(now, a, src, 1), Ok(()));
    assert!(p.run_until(SEC, |p| p
        .b
        .conn(b)
        .is_some_and(|c| c.next_is_zcopy().is_some())));
    let sink_mr =
        p.b.provider()
            .reg_mr(N, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let sink = ZSink {
        addr: sink_mr.addr(),
        len: N as u32,
        lkey: sink_mr.lkey(),
        rkey: sink_mr.rkey(),
    };
    let now = p.now();
    assert_eq!(p.b.read_zcopy(now, b, sink, 77), Ok(ZRecv::Pending));
    let mut events = Vec::new();
    assert!(p.run_until(SEC, |p| {
        events.extend(p.b.take_events(b));
        reported(&events)
    }));
}
