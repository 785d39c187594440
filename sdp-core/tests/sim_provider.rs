//! Behaviour of the `sim` verbs provider: CM, RC data path, protection, errors, faults,
//! determinism and resource limits.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use sdp_core::verbs::sim::{
    SimConfig, SimEndpoint, SimFabric, SimListener, SimMr, SimProvider, SimQpState, TraceKind,
    WC_REM_INV_REQ_ERR, WC_REM_OP_ERR,
};
use sdp_core::verbs::{
    Access, CmEvent, Completion, Endpoint, Listener, MemoryRegion, Provider, QpCaps, RecvWr,
    RemoteBuf, SendOp, SendWr, VerbsError, WcOpcode, WcStatus,
};

/// Default one-way latency.
const L: u64 = 2_000;
/// Default transport timeout.
const TO: u64 = 50_000_000;

fn ip(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))
}

fn sa(n: u8, port: u16) -> SocketAddr {
    SocketAddr::new(ip(n), port)
}

/// Default config with infinite bandwidth, so times are exact multiples of the latency.
fn cfg0() -> SimConfig {
    SimConfig {
        bandwidth_bytes_per_sec: 0,
        ..SimConfig::default()
    }
}

fn run(f: &SimFabric) {
    f.run_until_idle(u64::MAX);
}

fn cq(ep: &mut SimEndpoint) -> Vec<Completion> {
    let blank = Completion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
    };
    let mut buf = [blank; 3];
    let mut out = Vec::new();
    loop {
        let n = ep.poll_cq(&mut buf);
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

fn cm(ep: &mut SimEndpoint) -> Vec<CmEvent> {
    std::iter::from_fn(|| ep.poll_cm()).collect()
}

fn ok(wr_id: u64, opcode: WcOpcode, byte_len: u32) -> Completion {
    Completion {
        wr_id,
        status: WcStatus::Success,
        opcode,
        byte_len,
    }
}

fn wc(wr_id: u64, status: WcStatus, opcode: WcOpcode) -> Completion {
    Completion {
        wr_id,
        status,
        opcode,
        byte_len: 0,
    }
}

fn send(wr_id: u64, mr: &SimMr, off: usize, len: u32) -> SendWr {
    SendWr {
        wr_id,
        op: SendOp::Send,
        sge: Some(mr.sge(off, len)),
        signaled: true,
        solicited: false,
        wake_engine: false,
        payload: None,
    }
}

fn write(wr_id: u64, mr: &SimMr, off: usize, len: u32, to: RemoteBuf) -> SendWr {
    SendWr {
        wr_id,
        op: SendOp::Write(to),
        sge: Some(mr.sge(off, len)),
        signaled: true,
        solicited: false,
        wake_engine: false,
        payload: None,
    }
}

fn read(wr_id: u64, mr: &SimMr, off: usize, len: u32, from: RemoteBuf) -> SendWr {
    SendWr {
        wr_id,
        op: SendOp::Read(from),
        sge: Some(mr.sge(off, len)),
        signaled: true,
        solicited: false,
        wake_engine: false,
        payload: None,
    }
}

fn recv(wr_id: u64, mr: &SimMr, off: usize, len: u32) -> RecvWr {
    RecvWr {
        wr_id,
        sge: mr.sge(off, len),
    }
}

fn rb(mr: &SimMr, off: u64) -> RemoteBuf {
    RemoteBuf {
        addr: mr.addr() + off,
        rkey: mr.rkey(),
    }
}

const RW: Access = Access::LOCAL_WRITE;

/// Two connected endpoints: `a` on 10.0.0.1 (active), `b` on 10.0.0.2 (passive).
struct Pair {
    f: SimFabric,
    pa: SimProvider,
    pb: SimProvider,
    a: SimEndpoint,
    b: SimEndpoint,
    _l: SimListener,
}

fn pair_caps(seed: u64, cfg: SimConfig, caps: QpCaps) -> Pair {
    let f = SimFabric::with_config(seed, cfg);
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let mut l = pb.listen(sa(2, 7000), 16, QpCaps::default()).unwrap();
    let mut a = pa.connect(sa(2, 7000), None, caps, b"hi").unwrap();
    let mut req = None;
    while req.is_none() {
        assert!(f.step().is_some(), "request never arrived");
        req = l.poll_request();
    }
    let (mut b, _) = req.unwrap();
    b.accept(b"ok").unwrap();
    run(&f);
    assert_eq!(
        cm(&mut a),
        vec![CmEvent::Established {
            private_data: b"ok".to_vec()
        }]
    );
    assert_eq!(
        cm(&mut b),
        vec![CmEvent::Established {
            private_data: vec![]
        }]
    );
    Pair {
        f,
        pa,
        pb,
        a,
        b,
        _l: l,
    }
}

fn pair_cfg(cfg: SimConfig) -> Pair {
    pair_caps(1, cfg, QpCaps::default())
}

fn pair() -> Pair {
    pair_cfg(cfg0())
}

// ------------------------------------------------------------------------------------------ CM

#[test]
fn connect_accept_with_private_data_both_ways() {
    let f = SimFabric::with_config(3, cfg0());
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let mut l = pb
        .listen("0.0.0.0:7000".parse().unwrap(), 4, QpCaps::default())
        .unwrap();
    assert_eq!(l.local_addr(), "0.0.0.0:7000".parse().unwrap());
    let mut a = pa
        .connect(sa(2, 7000), None, QpCaps::default(), b"hello")
        .unwrap();
    assert_eq!(a.qp_state(), SimQpState::Connecting);
    assert_eq!(a.peer_addr(), sa(2, 7000));
    assert_eq!(a.local_addr().ip(), ip(1));
    assert!(a.local_addr().port() >= 32768);
    // Receives may be posted before the connection is up, sends may not.
    let amr = pa.reg_mr(64, RW).unwrap();
    a.post_recv(&recv(1, &amr, 0, 64)).unwrap();
    assert_eq!(
        a.post_send(&send(2, &amr, 0, 1)),
        Err(VerbsError::NotConnected)
    );

    f.advance(L - 1);
    assert!(l.poll_request().is_none());
    f.advance(L);
    let (mut b, pd) = l.poll_request().expect("request");
    assert_eq!(pd, b"hello");
    assert!(l.poll_request().is_none());
    assert_eq!(b.qp_state(), SimQpState::Pending);
    assert_eq!(b.local_addr(), sa(2, 7000));
    assert_eq!(b.peer_addr(), a.local_addr());
    assert_eq!(b.disconnect(), Err(VerbsError::NotConnected));
    b.accept(b"world").unwrap();
    assert_eq!(b.qp_state(), SimQpState::Ready);
    assert_eq!(
        b.accept(b"again"),
        Err(VerbsError::Invalid("not a pending connect request"))
    );

    f.advance(2 * L - 1);
    assert!(cm(&mut a).is_empty());
    f.advance(2 * L);
    assert_eq!(
        cm(&mut a),
        vec![CmEvent::Established {
            private_data: b"world".to_vec()
        }]
    );
    assert_eq!(a.qp_state(), SimQpState::Ready);
    assert!(cm(&mut b).is_empty(), "passive side waits for the RTU");
    f.advance(3 * L);
    assert_eq!(
        cm(&mut b),
        vec![CmEvent::Established {
            private_data: vec![]
        }]
    );
    assert_eq!(a.posted_recvs(), 1);
    assert_eq!(f.stats(ip(1)).qps, 1);
    assert_eq!(f.stats(ip(2)).qps, 1);
    assert_eq!(f.next_event_at(), None);

    // A second connection gets another ephemeral port.
    let a2 = pa
        .connect(sa(2, 7000), None, QpCaps::default(), &[])
        .unwrap();
    assert_ne!(a2.local_addr().port(), a.local_addr().port());
}

#[test]
fn refused_port_is_rejected_after_one_round_trip() {
    let f = SimFabric::with_config(1, cfg0());
    let pa = f.provider(ip(1));
    let _pb = f.provider(ip(2));
    let mr = pa.reg_mr(64, RW).unwrap();
    let mut a = pa.connect(sa(2, 9), None, QpCaps::default(), b"x").unwrap();
    a.post_recv(&recv(5, &mr, 0, 64)).unwrap();
    f.advance(2 * L - 1);
    assert!(cm(&mut a).is_empty());
    f.advance(2 * L);
    assert_eq!(
        cm(&mut a),
        vec![CmEvent::Rejected {
            private_data: vec![],
            consumer: false
        }]
    );
    assert_eq!(a.qp_state(), SimQpState::Error);
    assert_eq!(cq(&mut a), vec![wc(5, WcStatus::Flushed, WcOpcode::Recv)]);
    run(&f);
    assert!(cm(&mut a).is_empty(), "never connected: no Disconnected");
}

#[test]
fn reject_with_private_data() {
    let f = SimFabric::with_config(1, cfg0());
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let mut l = pb.listen(sa(2, 80), 4, QpCaps::default()).unwrap();
    let mut a = pa
        .connect(sa(2, 80), None, QpCaps::default(), b"let me in")
        .unwrap();
    f.advance(L);
    let (mut b, pd) = l.poll_request().unwrap();
    assert_eq!(pd, b"let me in");
    assert_eq!(
        b.reject(&[0; 149]),
        Err(VerbsError::Invalid("private data too long for a reject"))
    );
    b.reject(b"go away").unwrap();
    assert_eq!(b.qp_state(), SimQpState::Error);
    f.advance(2 * L);
    assert_eq!(
        cm(&mut a),
        vec![CmEvent::Rejected {
            private_data: b"go away".to_vec(),
            consumer: true
        }]
    );
    // The listener still works.
    let mut a2 = pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
    run(&f);
    let (mut b2, _) = l.poll_request().unwrap();
    b2.accept(&[]).unwrap();
    run(&f);
    assert_eq!(
        cm(&mut a2),
        vec![CmEvent::Established {
            private_data: vec![]
        }]
    );
}

#[test]
fn backlog_full_and_dropped_requests_are_refused() {
    let f = SimFabric::with_config(1, cfg0());
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let mut l = pb.listen(sa(2, 80), 1, QpCaps::default()).unwrap();
    let mut a1 = pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
    let mut a2 = pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
    run(&f);
    assert!(cm(&mut a1).is_empty());
    assert_eq!(
        cm(&mut a2),
        vec![CmEvent::Rejected {
            private_data: vec![],
            consumer: false
        }]
    );
    // Taking the request frees the backlog slot; dropping it unanswered rejects it.
    let (b1, _) = l.poll_request().unwrap();
    let mut a3 = pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
    run(&f);
    assert!(cm(&mut a3).is_empty());
    assert_eq!(f.stats(ip(2)).qps, 2);
    drop(b1);
    run(&f);
    assert_eq!(
        cm(&mut a1),
        vec![CmEvent::Rejected {
            private_data: vec![],
            consumer: false
        }]
    );
    // Dropping the listener rejects what it still holds and frees the port.
    drop(l);
    run(&f);
    assert_eq!(
        cm(&mut a3),
        vec![CmEvent::Rejected {
            private_data: vec![],
            consumer: false
        }]
    );
    assert_eq!(f.stats(ip(2)).qps, 0);
    let mut a4 = pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
    run(&f);
    assert_eq!(
        cm(&mut a4),
        vec![CmEvent::Rejected {
            private_data: vec![],
            consumer: false
        }]
    );
    let _l = pb.listen(sa(2, 80), 1, QpCaps::default()).unwrap();
}

#[test]
fn listen_and_bind_addresses() {
    let f = SimFabric::new(1);
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let l = pb.listen(sa(2, 80), 1, QpCaps::default()).unwrap();
    assert_eq!(
        pb.listen(sa(2, 80), 1, QpCaps::default()).unwrap_err(),
        VerbsError::AddrInUse
    );
    assert_eq!(
        pb.listen("0.0.0.0:80".parse().unwrap(), 1, QpCaps::default())
            .unwrap_err(),
        VerbsError::AddrInUse
    );
    assert_eq!(
        pb.listen(sa(3, 81), 1, QpCaps::default()).unwrap_err(),
        VerbsError::AddrNotAvailable
    );
    let eph = pb.listen(sa(2, 0), 1, QpCaps::default()).unwrap();
    assert_ne!(eph.local_addr().port(), 0);
    assert_eq!(eph.local_addr().ip(), ip(2));
    drop(l);
    let _l = pb.listen(sa(2, 80), 1, QpCaps::default()).unwrap();
    // Explicit source addresses.
    let a = pa
        .connect(sa(2, 80), Some(sa(1, 5555)), QpCaps::default(), &[])
        .unwrap();
    assert_eq!(a.local_addr(), sa(1, 5555));
    assert_eq!(
        pa.connect(sa(2, 80), Some(sa(1, 5555)), QpCaps::default(), &[])
            .unwrap_err(),
        VerbsError::AddrInUse
    );
    assert_eq!(
        pa.connect(sa(2, 80), Some(sa(2, 0)), QpCaps::default(), &[])
            .unwrap_err(),
        VerbsError::AddrNotAvailable
    );
    drop(a);
    pa.connect(sa(2, 80), Some(sa(1, 5555)), QpCaps::default(), &[])
        .unwrap();
}

#[test]
fn listener_on_one_address_ignores_the_others() {
    let f = SimFabric::with_config(1, cfg0());
    let p = f.provider(ip(1));
    let mut l = p.listen(sa(1, 80), 4, QpCaps::default()).unwrap();
    let mut lo = p
        .connect(
            "127.0.0.1:80".parse().unwrap(),
            None,
            QpCaps::default(),
            &[],
        )
        .unwrap();
    run(&f);
    assert_eq!(
        cm(&mut lo),
        vec![CmEvent::Rejected {
            private_data: vec![],
            consumer: false
        }]
    );
    drop(l);
    // An unspecified listener takes loopback connections from its own host.
    l = p
        .listen("0.0.0.0:80".parse().unwrap(), 4, QpCaps::default())
        .unwrap();
    let mut a = p
        .connect(
            "127.0.0.1:80".parse().unwrap(),
            None,
            QpCaps::default(),
            &[],
        )
        .unwrap();
    assert_eq!(a.local_addr().ip(), "127.0.0.1".parse::<IpAddr>().unwrap());
    run(&f);
    let (mut b, _) = l.poll_request().unwrap();
    assert_eq!(b.local_addr(), "127.0.0.1:80".parse().unwrap());
    assert_eq!(b.peer_addr(), a.local_addr());
    b.accept(&[]).unwrap();
    run(&f);
    assert_eq!(
        cm(&mut a),
        vec![CmEvent::Established {
            private_data: vec![]
        }]
    );
    assert_eq!(
        f.stats(ip(1)).qps,
        3,
        "the rejected endpoint counts until dropped"
    );
    drop(lo);
    assert_eq!(f.stats(ip(1)).qps, 2);
}

#[test]
fn private_data_limits() {
    let f = SimFabric::new(1);
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let mut l = pb.listen(sa(2, 80), 4, QpCaps::default()).unwrap();
    assert_eq!(
        pa.connect(sa(2, 80), None, QpCaps::default(), &[0; 57])
            .unwrap_err(),
        VerbsError::Invalid("private data too long for a connect request")
    );
    assert_eq!(
        f.stats(ip(1)).qps,
        0,
        "a refused connect leaves nothing behind"
    );
    let mut a = pa
        .connect(sa(2, 80), None, QpCaps::default(), &[7; 56])
        .unwrap();
    run(&f);
    let (mut b, pd) = l.poll_request().unwrap();
    assert_eq!(pd, vec![7; 56]);
    assert_eq!(
        b.accept(&[0; 197]),
        Err(VerbsError::Invalid("private data too long for an accept"))
    );
    b.accept(&[9; 196]).unwrap();
    run(&f);
    assert_eq!(
        cm(&mut a),
        vec![CmEvent::Established {
            private_data: vec![9; 196]
        }]
    );
}

#[test]
fn unknown_host_is_unreachable_after_the_transport_timeout() {
    let f = SimFabric::with_config(1, cfg0());
    let pa = f.provider(ip(1));
    let mut a = pa
        .connect(sa(99, 80), None, QpCaps::default(), &[])
        .unwrap();
    f.advance(TO - 1);
    assert!(cm(&mut a).is_empty());
    f.advance(TO);
    assert_eq!(cm(&mut a), vec![CmEvent::Unreachable]);
    assert_eq!(a.qp_state(), SimQpState::Error);
}

#[test]
fn active_side_gone_before_the_reply_gives_passive_connect_error() {
    let f = SimFabric::with_config(1, cfg0());
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let mut l = pb.listen(sa(2, 80), 4, QpCaps::default()).unwrap();
    let a = pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
    f.advance(L);
    drop(a);
    let (mut b, _) = l.poll_request().unwrap();
    b.accept(&[]).unwrap();
    run(&f);
    assert_eq!(cm(&mut b), vec![CmEvent::ConnectError]);
    assert_eq!(b.qp_state(), SimQpState::Error);
}

// ---------------------------------------------------------------------------------- data path

#[test]
fn send_recv_in_order_with_byte_len() {
    let mut p = pair();
    let amr = p.pa.reg_mr(256, Access::empty()).unwrap();
    let mut abuf = amr;
    abuf.write(0, b"first message!");
    abuf.write(64, &[0xAB; 64]);
    let bmr = p.pb.reg_mr(3 * 64, RW).unwrap();
    for i in 0..3 {
        p.b.post_recv(&recv(100 + i, &bmr, 64 * i as usize, 64))
            .unwrap();
    }
    assert_eq!(p.b.posted_recvs(), 3);
    let t0 = p.f.now();
    p.a.post_send(&send(1, &abuf, 0, 14)).unwrap();
    p.a.post_send(&send(2, &abuf, 64, 64)).unwrap();
    p.a.post_send(&SendWr {
        wr_id: 3,
        op: SendOp::Send,
        sge: None,
        signaled: true,
        solicited: false,
        wake_engine: false,
        payload: None,
    })
    .unwrap();
    assert_eq!(p.a.outstanding_sends(), 3);
    p.f.advance(t0 + L - 1);
    assert!(cq(&mut p.b).is_empty());
    p.f.advance(t0 + L);
    assert_eq!(
        cq(&mut p.b),
        vec![
            ok(100, WcOpcode::Recv, 14),
            ok(101, WcOpcode::Recv, 64),
            ok(102, WcOpcode::Recv, 0)
        ]
    );
    assert!(cq(&mut p.a).is_empty(), "send completions wait for the ack");
    p.f.advance(t0 + 2 * L);
    assert_eq!(
        cq(&mut p.a),
        vec![
            ok(1, WcOpcode::Send, 14),
            ok(2, WcOpcode::Send, 64),
            ok(3, WcOpcode::Send, 0)
        ]
    );
    assert_eq!(p.a.outstanding_sends(), 0);
    let got = bmr.to_vec();
    assert_eq!(&got[..14], b"first message!");
    assert_eq!(&got[14..64], &[0; 50][..]);
    assert_eq!(&got[64..128], &[0xAB; 64][..]);
    let (sa_, sb) = (p.f.stats(ip(1)), p.f.stats(ip(2)));
    assert_eq!((sa_.sends, sa_.send_bytes), (3, 78));
    assert_eq!((sb.recvs, sb.recv_bytes), (3, 78));
    assert_eq!(p.b.posted_recvs(), 0);
}

#[test]
fn both_directions_and_unsignaled_sends() {
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.a.post_recv(&recv(10, &amr, 32, 32)).unwrap();
    p.b.post_recv(&recv(20, &bmr, 32, 32)).unwrap();
    p.b.post_recv(&recv(21, &bmr, 32, 32)).unwrap();
    let mut quiet = send(1, &amr, 0, 4);
    quiet.signaled = false;
    p.a.post_send(&quiet).unwrap();
    p.a.post_send(&send(2, &amr, 0, 4)).unwrap();
    p.b.post_send(&send(3, &bmr, 0, 8)).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.a),
        vec![ok(10, WcOpcode::Recv, 8), ok(2, WcOpcode::Send, 4)]
    );
    assert_eq!(
        cq(&mut p.b),
        vec![
            ok(20, WcOpcode::Recv, 4),
            ok(21, WcOpcode::Recv, 4),
            ok(3, WcOpcode::Send, 8)
        ]
    );
    assert_eq!(p.a.outstanding_sends(), 0);
}

#[test]
fn queue_caps_are_enforced() {
    let caps = QpCaps {
        max_send_wr: 2,
        max_recv_wr: 2,
        max_inline: 0,
    };
    let mut p = pair_caps(1, cfg0(), caps);
    assert_eq!(
        p.b.caps(),
        caps,
        "the passive side mirrors the requested caps"
    );
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.b.post_recv(&recv(1, &bmr, 0, 8)).unwrap();
    p.b.post_recv(&recv(2, &bmr, 8, 8)).unwrap();
    assert_eq!(
        p.b.post_recv(&recv(3, &bmr, 16, 8)),
        Err(VerbsError::QueueFull("receive queue"))
    );
    let mut quiet = send(1, &amr, 0, 1);
    quiet.signaled = false;
    p.a.post_send(&quiet).unwrap();
    p.a.post_send(&send(2, &amr, 0, 1)).unwrap();
    assert_eq!(
        p.a.post_send(&send(3, &amr, 0, 1)),
        Err(VerbsError::QueueFull("send queue"))
    );
    run(&p.f);
    assert_eq!(cq(&mut p.a), vec![ok(2, WcOpcode::Send, 1)]);
    p.b.post_recv(&recv(3, &bmr, 16, 8)).unwrap();
    p.a.post_send(&send(3, &amr, 0, 1)).unwrap();
    let f = SimFabric::new(1);
    let big = QpCaps {
        max_send_wr: 16_385,
        ..QpCaps::default()
    };
    assert!(matches!(
        f.provider(ip(1)).connect(sa(2, 1), None, big, &[]),
        Err(VerbsError::Invalid(_))
    ));
}

#[test]
fn rnr_with_no_retries_is_an_immediate_error() {
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.a.post_recv(&recv(9, &amr, 32, 32)).unwrap();
    let t0 = p.f.now();
    p.a.post_send(&send(1, &amr, 0, 8)).unwrap();
    p.a.post_send(&send(2, &amr, 0, 8)).unwrap();
    p.f.advance(t0 + L);
    // The receiver posts right after the NAK went out: too late.
    p.b.post_recv(&recv(50, &bmr, 0, 64)).unwrap();
    p.f.advance(t0 + 2 * L - 1);
    assert!(cq(&mut p.a).is_empty());
    p.f.advance(t0 + 2 * L);
    assert_eq!(
        cq(&mut p.a),
        vec![
            wc(1, WcStatus::RnrRetryExceeded, WcOpcode::Send),
            wc(2, WcStatus::Flushed, WcOpcode::Send),
            wc(9, WcStatus::Flushed, WcOpcode::Recv),
        ]
    );
    assert_eq!(cm(&mut p.a), vec![CmEvent::Disconnected]);
    assert_eq!(p.a.qp_state(), SimQpState::Error);
    p.f.advance(t0 + 3 * L);
    assert_eq!(cm(&mut p.b), vec![CmEvent::Disconnected]);
    assert_eq!(
        cq(&mut p.b),
        vec![wc(50, WcStatus::Flushed, WcOpcode::Recv)]
    );
    assert_eq!(p.b.qp_state(), SimQpState::Error);
    assert_eq!(p.f.stats(ip(1)).rnr_naks, 1);
    assert_eq!(p.f.stats(ip(2)).rnr_naks_sent, 1);
    assert_eq!(&bmr.to_vec()[..8], &[0; 8], "the second send never landed");
}

#[test]
fn rnr_retry_forever_succeeds_after_a_late_post_and_keeps_order() {
    let cfg = SimConfig {
        rnr_retry: 7,
        rnr_delay_ns: 10_000,
        ..cfg0()
    };
    let mut p = pair_cfg(cfg);
    let mut amr = p.pa.reg_mr(64, RW).unwrap();
    amr.write(0, b"AAAABBBBWWWW");
    let bmr = p.pb.reg_mr(64, RW | Access::REMOTE_WRITE).unwrap();
    let t0 = p.f.now();
    p.a.post_send(&send(1, &amr, 0, 4)).unwrap();
    p.a.post_send(&write(2, &amr, 8, 4, rb(&bmr, 40))).unwrap();
    p.a.post_send(&send(3, &amr, 4, 4)).unwrap();
    // Several NAK rounds pass; the Write behind the NAKed SEND must not overtake it.
    p.f.advance(t0 + 100_000);
    assert_eq!(&bmr.to_vec()[40..44], &[0; 4]);
    assert!(p.f.stats(ip(1)).rnr_naks >= 3);
    assert!(cq(&mut p.a).is_empty());
    p.b.post_recv(&recv(10, &bmr, 0, 8)).unwrap();
    p.b.post_recv(&recv(11, &bmr, 8, 8)).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.b),
        vec![ok(10, WcOpcode::Recv, 4), ok(11, WcOpcode::Recv, 4)]
    );
    assert_eq!(
        cq(&mut p.a),
        vec![
            ok(1, WcOpcode::Send, 4),
            ok(2, WcOpcode::RdmaWrite, 4),
            ok(3, WcOpcode::Send, 4)
        ]
    );
    let got = bmr.to_vec();
    assert_eq!(
        (&got[0..4], &got[8..12], &got[40..44]),
        (&b"AAAA"[..], &b"BBBB"[..], &b"WWWW"[..])
    );
    assert_eq!(p.a.qp_state(), SimQpState::Ready);
}

#[test]
fn rnr_retry_count_is_honoured() {
    let cfg = SimConfig {
        rnr_retry: 3,
        rnr_delay_ns: 10_000,
        ..cfg0()
    };
    let mut p = pair_cfg(cfg);
    let amr = p.pa.reg_mr(64, RW).unwrap();
    p.a.post_send(&send(1, &amr, 0, 4)).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.a),
        vec![wc(1, WcStatus::RnrRetryExceeded, WcOpcode::Send)]
    );
    assert_eq!(
        p.f.stats(ip(1)).rnr_naks,
        4,
        "one original try plus three retries"
    );
    assert_eq!(cm(&mut p.b)[0], CmEvent::Disconnected);
}

#[test]
fn rdma_write_and_read_move_bytes() {
    let mut p = pair();
    let mut amr = p.pa.reg_mr(128, RW).unwrap();
    amr.write(0, &[1; 100]);
    let sink = p.pb.reg_mr(256, RW | Access::REMOTE_WRITE).unwrap();
    let mut src = p.pb.reg_mr(64, Access::REMOTE_READ).unwrap();
    src.write(0, b"remote bytes");
    let t0 = p.f.now();
    p.a.post_send(&write(1, &amr, 0, 100, rb(&sink, 100)))
        .unwrap();
    p.f.advance(t0);
    // The Write's bytes were taken when it executed; later local changes do not travel.
    amr.write(0, &[2; 100]);
    p.f.advance(t0 + L);
    assert_eq!(&sink.to_vec()[100..200], &[1; 100][..]);
    assert_eq!(&sink.to_vec()[..100], &[0; 100][..]);
    p.f.advance(t0 + 2 * L);
    assert_eq!(cq(&mut p.a), vec![ok(1, WcOpcode::RdmaWrite, 100)]);

    // RDMA Read: data sampled at the responder when the request arrives (t1 + L), placed at the
    // requester when the response arrives (t1 + 2L).
    let t1 = p.f.now();
    p.a.post_send(&read(2, &amr, 10, 12, rb(&src, 0))).unwrap();
    p.f.advance(t1 + L - 1);
    src.write(0, b"REMOTE");
    p.f.advance(t1 + L);
    src.write(0, b"xxxxxx");
    p.f.advance(t1 + 2 * L - 1);
    assert!(cq(&mut p.a).is_empty());
    assert_eq!(&amr.to_vec()[10..22], &[2; 12][..]);
    p.f.advance(t1 + 2 * L);
    assert_eq!(cq(&mut p.a), vec![ok(2, WcOpcode::RdmaRead, 12)]);
    assert_eq!(&amr.to_vec()[10..22], b"REMOTE bytes");
    let s = p.f.stats(ip(1));
    assert_eq!(
        (
            s.rdma_writes,
            s.rdma_write_bytes,
            s.rdma_reads,
            s.rdma_read_bytes
        ),
        (1, 100, 1, 12)
    );
    assert!(
        cq(&mut p.b).is_empty(),
        "one-sided operations report nothing to the target"
    );
}

#[test]
fn completions_are_reported_in_posting_order() {
    // 1 byte per ns: a long Read's response comes back after a later short Write's ack.
    let cfg = SimConfig {
        bandwidth_bytes_per_sec: 1_000_000_000,
        ..SimConfig::default()
    };
    let mut p = pair_cfg(cfg);
    let amr = p.pa.reg_mr(20_000, RW).unwrap();
    let src = p.pb.reg_mr(10_000, Access::REMOTE_READ).unwrap();
    let sink = p.pb.reg_mr(64, RW | Access::REMOTE_WRITE).unwrap();
    let t0 = p.f.now();
    p.a.post_send(&read(1, &amr, 0, 10_000, rb(&src, 0)))
        .unwrap();
    p.a.post_send(&write(2, &amr, 10_000, 10, rb(&sink, 0)))
        .unwrap();
    p.f.advance(t0 + 10 + 2 * L);
    assert!(
        cq(&mut p.a).is_empty(),
        "the Write is acked but waits for the Read"
    );
    p.f.advance(t0 + 10_000 + 2 * L);
    assert_eq!(
        cq(&mut p.a),
        vec![
            ok(1, WcOpcode::RdmaRead, 10_000),
            ok(2, WcOpcode::RdmaWrite, 10)
        ]
    );
}

#[test]
fn bandwidth_serializes_messages_per_qp() {
    let cfg = SimConfig {
        bandwidth_bytes_per_sec: 1_000_000_000,
        ..SimConfig::default()
    };
    let mut p = pair_cfg(cfg);
    let amr = p.pa.reg_mr(2000, RW).unwrap();
    let bmr = p.pb.reg_mr(2000, RW).unwrap();
    p.b.post_recv(&recv(1, &bmr, 0, 1000)).unwrap();
    p.b.post_recv(&recv(2, &bmr, 1000, 1000)).unwrap();
    let t0 = p.f.now();
    p.a.post_send(&send(1, &amr, 0, 1000)).unwrap();
    p.a.post_send(&send(2, &amr, 1000, 1000)).unwrap();
    p.f.advance(t0 + 1000 + L - 1);
    assert!(cq(&mut p.b).is_empty());
    p.f.advance(t0 + 1000 + L);
    assert_eq!(cq(&mut p.b), vec![ok(1, WcOpcode::Recv, 1000)]);
    p.f.advance(t0 + 2000 + L - 1);
    assert!(cq(&mut p.b).is_empty());
    p.f.advance(t0 + 2000 + L);
    assert_eq!(cq(&mut p.b), vec![ok(2, WcOpcode::Recv, 1000)]);
}

// ------------------------------------------------------------------------- protection errors

/// Post `wr` on a fresh pair where `b` offers `target` (registered with `access`), expect
/// RemoteAccess on `a`, both QPs in error, everything else flushed, Disconnected on both sides.
fn expect_remote_access(access: Access, wr: impl Fn(&SimMr, &SimMr) -> SendWr) {
    let mut p = pair();
    let amr = p.pa.reg_mr(8192, RW).unwrap();
    let target = p.pb.reg_mr(4096, access).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.a.post_recv(&recv(7, &amr, 0, 64)).unwrap();
    p.b.post_recv(&recv(8, &bmr, 0, 64)).unwrap();
    let first = wr(&amr, &target);
    p.a.post_send(&first).unwrap();
    p.a.post_send(&send(99, &amr, 0, 4)).unwrap();
    run(&p.f);
    let op = match first.op {
        SendOp::Read(_) => WcOpcode::RdmaRead,
        _ => WcOpcode::RdmaWrite,
    };
    let got = cq(&mut p.a);
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(
        (got[0].wr_id, got[0].status, got[0].opcode),
        (first.wr_id, WcStatus::RemoteAccess, op)
    );
    assert_eq!(got[1], wc(99, WcStatus::Flushed, WcOpcode::Send));
    assert_eq!(got[2], wc(7, WcStatus::Flushed, WcOpcode::Recv));
    assert_eq!(cq(&mut p.b), vec![wc(8, WcStatus::Flushed, WcOpcode::Recv)]);
    assert_eq!(p.a.qp_state(), SimQpState::Error);
    assert_eq!(p.b.qp_state(), SimQpState::Error);
    assert_eq!(
        cm(&mut p.a),
        vec![CmEvent::Disconnected, CmEvent::TimewaitExit]
    );
    assert_eq!(
        cm(&mut p.b),
        vec![CmEvent::Disconnected, CmEvent::TimewaitExit]
    );
    assert_eq!(p.f.stats(ip(2)).remote_access_errors, 1);
    assert!(
        target.to_vec().iter().all(|&b| b == 0),
        "nothing was written"
    );
    // Later posts complete Flushed at once.
    p.a.post_send(&send(100, &amr, 0, 4)).unwrap();
    assert_eq!(
        cq(&mut p.a),
        vec![wc(100, WcStatus::Flushed, WcOpcode::Send)]
    );
}

#[test]
fn bad_rkey_is_a_remote_access_error() {
    let all = RW | Access::REMOTE_WRITE | Access::REMOTE_READ;
    expect_remote_access(all, |a, t| {
        write(
            1,
            a,
            0,
            8,
            RemoteBuf {
                addr: t.addr(),
                rkey: t.rkey() ^ 0x5555,
            },
        )
    });
    expect_remote_access(all, |a, t| {
        read(
            1,
            a,
            0,
            8,
            RemoteBuf {
                addr: t.addr(),
                rkey: t.lkey(),
            },
        )
    });
}

#[test]
fn out_of_bounds_is_a_remote_access_error() {
    let all = RW | Access::REMOTE_WRITE | Access::REMOTE_READ;
    expect_remote_access(all, |a, t| write(1, a, 0, 8, rb(t, 4096 - 7)));
    expect_remote_access(all, |a, t| read(1, a, 0, 4097, rb(t, 0)));
    expect_remote_access(all, |a, t| {
        write(
            1,
            a,
            0,
            8,
            RemoteBuf {
                addr: t.addr() - 1,
                rkey: t.rkey(),
            },
        )
    });
    expect_remote_access(all, |a, t| {
        read(
            1,
            a,
            0,
            8,
            RemoteBuf {
                addr: u64::MAX - 2,
                rkey: t.rkey(),
            },
        )
    });
}

#[test]
fn missing_access_flags_are_remote_access_errors() {
    expect_remote_access(RW | Access::REMOTE_READ, |a, t| write(1, a, 0, 8, rb(t, 0)));
    expect_remote_access(RW | Access::REMOTE_WRITE, |a, t| read(1, a, 0, 8, rb(t, 0)));
    expect_remote_access(RW, |a, t| write(1, a, 0, 8, rb(t, 0)));
}

#[test]
fn set_access_grants_and_revokes_remote_rights() {
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let mut src = p.pb.reg_mr(64, Access::empty()).unwrap();
    src.write(0, b"secret");
    src.set_access(Access::REMOTE_READ).unwrap();
    assert_eq!(src.access(), Access::REMOTE_READ);
    p.a.post_send(&read(1, &amr, 0, 6, rb(&src, 0))).unwrap();
    run(&p.f);
    assert_eq!(cq(&mut p.a), vec![ok(1, WcOpcode::RdmaRead, 6)]);
    assert_eq!(&amr.to_vec()[..6], b"secret");
    src.set_access(Access::empty()).unwrap();
    p.a.post_send(&read(2, &amr, 0, 6, rb(&src, 0))).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.a)[0],
        wc(2, WcStatus::RemoteAccess, WcOpcode::RdmaRead)
    );
    assert_eq!(
        src.set_access(Access::REMOTE_WRITE),
        Err(VerbsError::Invalid("REMOTE_WRITE requires LOCAL_WRITE"))
    );
    assert_eq!(src.access(), Access::empty());
}

#[test]
fn deregistered_regions_are_unreachable() {
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let target = p.pb.reg_mr(64, RW | Access::REMOTE_WRITE).unwrap();
    let stale = rb(&target, 0);
    drop(target);
    p.a.post_send(&write(1, &amr, 0, 8, stale)).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.a),
        vec![wc(1, WcStatus::RemoteAccess, WcOpcode::RdmaWrite)]
    );

    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let wr = send(1, &amr, 0, 8);
    drop(amr);
    p.a.post_send(&wr).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.a),
        vec![wc(1, WcStatus::LocalProtection, WcOpcode::Send)]
    );
    assert_eq!(cm(&mut p.b)[0], CmEvent::Disconnected);
}

#[test]
fn local_protection_errors() {
    // Bad lkey.
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let mut wr = send(1, &amr, 0, 8);
    wr.sge.as_mut().unwrap().lkey = amr.rkey();
    p.a.post_send(&wr).unwrap();
    p.a.post_send(&send(2, &amr, 0, 8)).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.a),
        vec![
            wc(1, WcStatus::LocalProtection, WcOpcode::Send),
            wc(2, WcStatus::Flushed, WcOpcode::Send)
        ]
    );
    assert_eq!(p.a.qp_state(), SimQpState::Error);
    assert_eq!(p.b.qp_state(), SimQpState::Error);

    // Local SGE past the end of its region.
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let mut wr = send(1, &amr, 0, 8);
    wr.sge.as_mut().unwrap().len = 65;
    p.a.post_send(&wr).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.a),
        vec![wc(1, WcStatus::LocalProtection, WcOpcode::Send)]
    );

    // RDMA Read sink without LOCAL_WRITE.
    let mut p = pair();
    let sink = p.pa.reg_mr(64, Access::empty()).unwrap();
    let src = p.pb.reg_mr(64, Access::REMOTE_READ).unwrap();
    p.a.post_send(&read(1, &sink, 0, 8, rb(&src, 0))).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.a),
        vec![wc(1, WcStatus::LocalProtection, WcOpcode::RdmaRead)]
    );

    // Receive buffer without LOCAL_WRITE: the receiver fails, the sender sees a remote op error.
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, Access::REMOTE_READ).unwrap();
    p.b.post_recv(&recv(5, &bmr, 0, 64)).unwrap();
    p.b.post_recv(&recv(6, &bmr, 0, 64)).unwrap();
    p.a.post_send(&send(1, &amr, 0, 8)).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.b),
        vec![
            wc(5, WcStatus::LocalProtection, WcOpcode::Recv),
            wc(6, WcStatus::Flushed, WcOpcode::Recv)
        ]
    );
    assert_eq!(cq(&mut p.a)[0].status, WcStatus::Other(WC_REM_OP_ERR));
    assert_eq!(p.a.qp_state(), SimQpState::Error);
}

#[test]
fn send_longer_than_the_receive_buffer_errors_both_sides() {
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.b.post_recv(&recv(5, &bmr, 0, 16)).unwrap();
    p.a.post_send(&send(1, &amr, 0, 17)).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.b),
        vec![wc(5, WcStatus::LocalProtection, WcOpcode::Recv)]
    );
    assert_eq!(
        cq(&mut p.a),
        vec![Completion {
            wr_id: 1,
            status: WcStatus::Other(WC_REM_INV_REQ_ERR),
            opcode: WcOpcode::Send,
            byte_len: 0
        }]
    );
    assert_eq!(p.a.qp_state(), SimQpState::Error);
    assert_eq!(p.b.qp_state(), SimQpState::Error);
    assert_eq!(cm(&mut p.a)[0], CmEvent::Disconnected);
    assert_eq!(cm(&mut p.b)[0], CmEvent::Disconnected);
}

#[test]
fn zero_length_write_is_a_probe() {
    let mut p = pair();
    let target = p.pb.reg_mr(64, RW | Access::REMOTE_WRITE).unwrap();
    let probe = |wr_id, to| SendWr {
        wr_id,
        op: SendOp::Write(to),
        sge: None,
        signaled: true,
        solicited: false,
        wake_engine: false,
        payload: None,
    };
    let t0 = p.f.now();
    p.a.post_send(&probe(1, rb(&target, 0))).unwrap();
    // Not checked against any region: a bogus key is fine too.
    p.a.post_send(&probe(
        2,
        RemoteBuf {
            addr: 0,
            rkey: 0xdead,
        },
    ))
    .unwrap();
    p.f.advance(t0 + 2 * L);
    assert_eq!(
        cq(&mut p.a),
        vec![ok(1, WcOpcode::RdmaWrite, 0), ok(2, WcOpcode::RdmaWrite, 0)]
    );
    assert!(target.to_vec().iter().all(|&b| b == 0));
    assert_eq!(p.a.qp_state(), SimQpState::Ready);
    // A dead peer makes the probe fail after the transport timeout.
    p.f.faults().crash(ip(2));
    let t1 = p.f.now();
    p.a.post_send(&probe(3, RemoteBuf { addr: 0, rkey: 0 }))
        .unwrap();
    p.f.advance(t1 + TO - 1);
    assert!(cq(&mut p.a).is_empty());
    p.f.advance(t1 + TO);
    assert_eq!(
        cq(&mut p.a),
        vec![wc(3, WcStatus::RetryExceeded, WcOpcode::RdmaWrite)]
    );
    assert_eq!(cm(&mut p.a), vec![CmEvent::Disconnected]);
}

// ----------------------------------------------------------------------- disconnect and drop

#[test]
fn disconnect_flushes_and_notifies_both_sides() {
    let cfg = cfg0();
    let mut p = pair_cfg(cfg);
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.a.post_recv(&recv(1, &amr, 0, 64)).unwrap();
    p.b.post_recv(&recv(2, &bmr, 0, 64)).unwrap();
    p.b.post_recv(&recv(3, &bmr, 0, 64)).unwrap();
    p.a.post_send(&send(4, &amr, 0, 4)).unwrap();
    let t0 = p.f.now();
    p.a.disconnect().unwrap();
    assert_eq!(p.a.qp_state(), SimQpState::Error);
    assert_eq!(
        cq(&mut p.a),
        vec![
            wc(4, WcStatus::Flushed, WcOpcode::Send),
            wc(1, WcStatus::Flushed, WcOpcode::Recv)
        ]
    );
    assert_eq!(cm(&mut p.a), vec![CmEvent::Disconnected]);
    assert_eq!(p.a.disconnect(), Ok(()));
    p.f.advance(t0 + L - 1);
    assert!(cm(&mut p.b).is_empty());
    assert_eq!(p.b.qp_state(), SimQpState::Ready);
    p.f.advance(t0 + L);
    assert_eq!(cm(&mut p.b), vec![CmEvent::Disconnected]);
    assert_eq!(
        cq(&mut p.b),
        vec![
            wc(2, WcStatus::Flushed, WcOpcode::Recv),
            wc(3, WcStatus::Flushed, WcOpcode::Recv)
        ],
        "the flushed send never arrived"
    );
    p.f.advance(t0 + cfg.timewait_ns);
    assert_eq!(cm(&mut p.a), vec![CmEvent::TimewaitExit]);
    p.f.advance(t0 + L + cfg.timewait_ns);
    assert_eq!(cm(&mut p.b), vec![CmEvent::TimewaitExit]);
    p.b.post_recv(&recv(5, &bmr, 0, 64)).unwrap();
    assert_eq!(cq(&mut p.b), vec![wc(5, WcStatus::Flushed, WcOpcode::Recv)]);
    assert_eq!(p.f.stats(ip(1)).disconnects, 1);
}

#[test]
fn data_sent_before_a_disconnect_arrives_first() {
    // 1 byte per ns: the 10 kB message is still serializing when the disconnect starts.
    let cfg = SimConfig {
        bandwidth_bytes_per_sec: 1_000_000_000,
        ..SimConfig::default()
    };
    let mut p = pair_cfg(cfg);
    let amr = p.pa.reg_mr(10_000, RW).unwrap();
    let bmr = p.pb.reg_mr(10_000, RW).unwrap();
    p.b.post_recv(&recv(2, &bmr, 0, 10_000)).unwrap();
    p.a.post_send(&send(1, &amr, 0, 10_000)).unwrap();
    let t0 = p.f.now();
    p.f.advance(t0); // executes: on the wire
    p.a.disconnect().unwrap();
    run(&p.f);
    assert_eq!(cq(&mut p.b), vec![ok(2, WcOpcode::Recv, 10_000)]);
    assert_eq!(cq(&mut p.a), vec![wc(1, WcStatus::Flushed, WcOpcode::Send)]);
    assert_eq!(
        cm(&mut p.b),
        vec![CmEvent::Disconnected, CmEvent::TimewaitExit]
    );
}

#[test]
fn dropping_an_endpoint_disconnects_the_peer() {
    let mut p = pair();
    assert_eq!((p.f.stats(ip(1)).qps, p.f.stats(ip(2)).qps), (1, 1));
    let t0 = p.f.now();
    drop(p.a);
    assert_eq!(p.f.stats(ip(1)).qps, 0);
    p.f.advance(t0 + L);
    assert_eq!(cm(&mut p.b), vec![CmEvent::Disconnected]);
    assert_eq!(p.f.stats(ip(1)).peak_qps, 1);
    drop(p.b);
    assert_eq!(p.f.stats(ip(2)).qps, 0);
    run(&p.f);
}

// ------------------------------------------------------------------------------------- faults

#[test]
fn broken_link_loses_messages_and_times_out() {
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.b.post_recv(&recv(9, &bmr, 0, 64)).unwrap();
    let faults = p.f.faults();
    let t0 = p.f.now();
    p.a.post_send(&send(1, &amr, 0, 4)).unwrap();
    p.f.advance(t0 + L / 2);
    // In flight while the link breaks, even briefly: lost.
    faults.break_link(ip(1), ip(2));
    faults.heal_link(ip(2), ip(1));
    p.f.advance(t0 + TO - 1);
    assert!(cq(&mut p.a).is_empty());
    assert_eq!(p.b.posted_recvs(), 1);
    p.f.advance(t0 + TO);
    assert_eq!(
        cq(&mut p.a),
        vec![wc(1, WcStatus::RetryExceeded, WcOpcode::Send)]
    );
    assert_eq!(cm(&mut p.a), vec![CmEvent::Disconnected]);
    assert_eq!(p.f.stats(ip(1)).messages_lost, 1);
    faults.break_link(ip(2), ip(1));
    // The other side learns only through its own traffic (its keepalive probe).
    p.f.advance(t0 + 10 * TO);
    assert!(cm(&mut p.b).is_empty());
    assert_eq!(p.b.qp_state(), SimQpState::Ready);
    let t1 = p.f.now();
    p.b.post_send(&SendWr {
        wr_id: 7,
        op: SendOp::Write(rb(&amr, 0)),
        sge: None,
        signaled: false,
        solicited: false,
        wake_engine: false,
        payload: None,
    })
    .unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.b),
        vec![
            wc(7, WcStatus::RetryExceeded, WcOpcode::RdmaWrite),
            wc(9, WcStatus::Flushed, WcOpcode::Recv)
        ]
    );
    assert_eq!(cm(&mut p.b)[0], CmEvent::Disconnected);
    assert!(p.f.now() >= t1 + TO);
    // Connecting across the broken link is Unreachable; after healing it works.
    let mut a2 =
        p.pa.connect(sa(2, 7000), None, QpCaps::default(), &[])
            .unwrap();
    run(&p.f);
    assert_eq!(cm(&mut a2), vec![CmEvent::Unreachable]);
    faults.heal_link(ip(1), ip(2));
    let mut a3 =
        p.pa.connect(sa(2, 7000), None, QpCaps::default(), &[])
            .unwrap();
    run(&p.f);
    let (mut b3, _) = p._l.poll_request().unwrap();
    b3.accept(&[]).unwrap();
    run(&p.f);
    assert_eq!(
        cm(&mut a3),
        vec![CmEvent::Established {
            private_data: vec![]
        }]
    );
}

#[test]
fn lost_acknowledgement_also_times_out() {
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.b.post_recv(&recv(9, &bmr, 0, 64)).unwrap();
    let t0 = p.f.now();
    p.a.post_send(&send(1, &amr, 0, 4)).unwrap();
    p.f.advance(t0 + L);
    assert_eq!(cq(&mut p.b), vec![ok(9, WcOpcode::Recv, 4)]);
    p.f.faults().break_link(ip(1), ip(2));
    p.f.advance(t0 + TO);
    assert_eq!(
        cq(&mut p.a),
        vec![wc(1, WcStatus::RetryExceeded, WcOpcode::Send)]
    );
}

#[test]
fn crashed_host_vanishes_silently() {
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.a.post_recv(&recv(1, &amr, 0, 64)).unwrap();
    p.b.post_recv(&recv(2, &bmr, 0, 64)).unwrap();
    // b's message is on the wire when b crashes: it never arrives.
    p.b.post_send(&send(3, &bmr, 0, 4)).unwrap();
    p.f.advance(p.f.now() + L / 2);
    p.f.faults().crash(ip(2));
    assert!(!p.f.host_alive(ip(2)));
    assert_eq!(p.b.qp_state(), SimQpState::Dead);
    assert!(matches!(
        p.b.post_send(&send(4, &bmr, 0, 4)),
        Err(VerbsError::NoDevice(_))
    ));
    assert!(matches!(
        p.b.post_recv(&recv(4, &bmr, 0, 4)),
        Err(VerbsError::NoDevice(_))
    ));
    assert!(matches!(p.b.disconnect(), Err(VerbsError::NoDevice(_))));
    assert!(matches!(p.pb.reg_mr(8, RW), Err(VerbsError::NoDevice(_))));
    assert!(matches!(
        p.pb.listen(sa(2, 1), 1, QpCaps::default()),
        Err(VerbsError::NoDevice(_))
    ));
    let s = p.f.stats(ip(2));
    assert_eq!((s.qps, s.registered_bytes), (0, 0));
    // The survivor notices nothing until it sends.
    let t0 = p.f.now() + TO;
    p.f.advance(t0);
    assert_eq!(p.a.posted_recvs(), 1);
    assert!(cq(&mut p.a).is_empty());
    assert!(cm(&mut p.a).is_empty());
    assert!(cq(&mut p.b).is_empty() && cm(&mut p.b).is_empty());
    p.a.post_send(&send(5, &amr, 0, 4)).unwrap();
    p.f.advance(t0 + TO - 1);
    assert!(cq(&mut p.a).is_empty());
    p.f.advance(t0 + TO);
    assert_eq!(
        cq(&mut p.a),
        vec![
            wc(5, WcStatus::RetryExceeded, WcOpcode::Send),
            wc(1, WcStatus::Flushed, WcOpcode::Recv)
        ]
    );
    assert_eq!(cm(&mut p.a), vec![CmEvent::Disconnected]);
    run(&p.f);
    assert!(cm(&mut p.b).is_empty(), "a dead endpoint reports nothing");
    // The local bytes of a crashed host's region stay readable; dropping handles is fine.
    assert_eq!(bmr.to_vec().len(), 64);
    drop(p.b);
    drop(bmr);
    assert_eq!(p.f.stats(ip(2)).registered_bytes, 0);

    // Restarted, the host is empty and usable again.
    p.f.faults().restart(ip(2));
    let mut l = p.pb.listen(sa(2, 7000), 4, QpCaps::default()).unwrap();
    let mut a2 =
        p.pa.connect(sa(2, 7000), None, QpCaps::default(), &[])
            .unwrap();
    run(&p.f);
    let (mut b2, _) = l.poll_request().unwrap();
    b2.accept(&[]).unwrap();
    run(&p.f);
    assert_eq!(
        cm(&mut a2),
        vec![CmEvent::Established {
            private_data: vec![]
        }]
    );
}

#[test]
fn connect_to_a_crashed_host_is_unreachable() {
    let f = SimFabric::with_config(1, cfg0());
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let _l = pb.listen(sa(2, 80), 1, QpCaps::default()).unwrap();
    f.faults().crash(ip(2));
    let mut a = pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
    f.advance(TO - 1);
    assert!(cm(&mut a).is_empty());
    f.advance(TO);
    assert_eq!(cm(&mut a), vec![CmEvent::Unreachable]);
}

#[test]
fn corrupt_next_send_rewrites_one_payload() {
    let mut p = pair();
    let mut amr = p.pa.reg_mr(64, RW).unwrap();
    amr.write(0, b"hello world");
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    for i in 0..2 {
        p.b.post_recv(&recv(i, &bmr, 32 * i as usize, 32)).unwrap();
    }
    p.f.faults().corrupt_next_send(ip(1), |m: &mut Vec<u8>| {
        m[0] = b'J';
        m.truncate(5);
    });
    p.a.post_send(&send(1, &amr, 0, 11)).unwrap();
    p.a.post_send(&send(2, &amr, 0, 11)).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.b),
        vec![ok(0, WcOpcode::Recv, 5), ok(1, WcOpcode::Recv, 11)]
    );
    let got = bmr.to_vec();
    assert_eq!(
        (&got[..5], &got[32..43]),
        (&b"Jello"[..], &b"hello world"[..])
    );
    assert_eq!(
        &amr.to_vec()[..11],
        b"hello world",
        "the sender's memory is untouched"
    );

    // Growing past the receive buffer gives the usual length error.
    p.b.post_recv(&recv(3, &bmr, 0, 32)).unwrap();
    p.f.faults()
        .corrupt_next_send(ip(1), Box::new(|m: &mut Vec<u8>| m.resize(33, 0)));
    p.a.post_send(&send(4, &amr, 0, 11)).unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.b)[0],
        wc(3, WcStatus::LocalProtection, WcOpcode::Recv)
    );
    assert_eq!(
        cq(&mut p.a)[..2],
        [ok(1, WcOpcode::Send, 11), ok(2, WcOpcode::Send, 11)]
    );
    assert_eq!(p.a.qp_state(), SimQpState::Error);
}

#[test]
fn drop_next_send_vanishes_but_completes() {
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.b.post_recv(&recv(1, &bmr, 0, 64)).unwrap();
    p.f.faults().drop_next_send(ip(1));
    p.a.post_send(&send(1, &amr, 0, 4)).unwrap();
    run(&p.f);
    assert_eq!(cq(&mut p.a), vec![ok(1, WcOpcode::Send, 4)]);
    assert!(cq(&mut p.b).is_empty());
    assert_eq!(p.b.posted_recvs(), 1);
    p.a.post_send(&send(2, &amr, 0, 4)).unwrap();
    run(&p.f);
    assert_eq!(cq(&mut p.b), vec![ok(1, WcOpcode::Recv, 4)]);
}

#[test]
fn extra_link_delay_applies_both_ways() {
    let f = SimFabric::with_config(1, cfg0());
    f.faults().set_delay(ip(2), ip(1), 5_000, 0);
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let mut l = pb.listen(sa(2, 80), 1, QpCaps::default()).unwrap();
    let mut a = pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
    f.advance(L + 5_000 - 1);
    assert!(l.poll_request().is_none());
    f.advance(L + 5_000);
    let (mut b, _) = l.poll_request().unwrap();
    b.accept(&[]).unwrap();
    f.advance(2 * (L + 5_000));
    assert_eq!(
        cm(&mut a),
        vec![CmEvent::Established {
            private_data: vec![]
        }]
    );
    // Other links are unaffected.
    let pc = f.provider(ip(3));
    let mut lc = pc.listen(sa(3, 80), 1, QpCaps::default()).unwrap();
    let _ac = pa.connect(sa(3, 80), None, QpCaps::default(), &[]).unwrap();
    let t = f.now();
    f.advance(t + L);
    assert!(lc.poll_request().is_some());
}

// ------------------------------------------------------------------------------ determinism

/// A jittery exchange: both sides send numbered messages; returns the trace and checks order.
fn jittery_run(seed: u64) -> Vec<(u64, u64, String)> {
    let f = SimFabric::with_config(
        seed,
        SimConfig {
            rnr_retry: 7,
            ..SimConfig::default()
        },
    );
    f.set_trace(true);
    f.faults().set_delay(ip(1), ip(2), 1_000, 50_000);
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let mut l = pb.listen(sa(2, 80), 1, QpCaps::default()).unwrap();
    let mut a = pa
        .connect(sa(2, 80), None, QpCaps::default(), b"x")
        .unwrap();
    run(&f);
    let (mut b, _) = l.poll_request().unwrap();
    b.accept(b"y").unwrap();
    run(&f);
    let mut amr = pa.reg_mr(64 * 40, RW).unwrap();
    let bmr = pb.reg_mr(64 * 40, RW).unwrap();
    for i in 0..40u64 {
        amr.write(64 * i as usize, &i.to_le_bytes());
        b.post_recv(&recv(i, &bmr, 64 * i as usize, 64)).unwrap();
    }
    for i in 0..40u64 {
        a.post_send(&send(i, &amr, 64 * i as usize, 8)).unwrap();
        if i % 7 == 0 {
            f.advance(f.now() + 3_000);
        }
    }
    run(&f);
    let got = cq(&mut b);
    assert_eq!(got.len(), 40);
    for (i, c) in got.iter().enumerate() {
        assert_eq!(
            *c,
            ok(i as u64, WcOpcode::Recv, 8),
            "jitter must not reorder a QP"
        );
        let mut n = [0; 8];
        bmr.read(64 * i, &mut n);
        assert_eq!(u64::from_le_bytes(n), i as u64);
    }
    assert_eq!(cq(&mut a).len(), 40);
    a.disconnect().unwrap();
    run(&f);
    f.take_trace()
        .into_iter()
        .map(|e| {
            let what = match e.kind {
                TraceKind::Completion(c) => format!("{c:?}"),
                TraceKind::Cm(ev) => format!("{ev:?}"),
            };
            (e.time, e.endpoint, what)
        })
        .collect()
}

#[test]
fn same_seed_same_events_at_the_same_times() {
    let one = jittery_run(42);
    let two = jittery_run(42);
    assert!(one.len() > 80);
    assert_eq!(one, two);
    let other = jittery_run(43);
    assert_eq!(one.len(), other.len());
    assert_ne!(
        one.iter().map(|e| e.0).collect::<Vec<_>>(),
        other.iter().map(|e| e.0).collect::<Vec<_>>(),
        "the seed drives the jitter"
    );
}

// ---------------------------------------------------------------------------------- resources

#[test]
fn registered_memory_is_limited_and_accounted() {
    let cfg = SimConfig {
        max_registered_bytes_per_host: 10_000,
        ..SimConfig::default()
    };
    let f = SimFabric::with_config(1, cfg);
    let p = f.provider(ip(1));
    let a = p.reg_mr(8_000, RW).unwrap();
    assert_eq!(
        p.reg_mr(2_001, RW).unwrap_err(),
        VerbsError::NoResources("registered memory")
    );
    let b = p.reg_mr(2_000, RW).unwrap();
    let s = f.stats(ip(1));
    assert_eq!((s.registered_bytes, s.registered_regions), (10_000, 2));
    drop(a);
    assert_eq!(f.stats(ip(1)).registered_bytes, 2_000);
    let c = p.reg_mr(8_000, RW).unwrap();
    assert_eq!(f.stats(ip(1)).peak_registered_bytes, 10_000);
    // Regions never overlap and are page aligned; keys are unique.
    let (x, y) = (&b, &c);
    assert!(x.addr() % 4096 == 0 && y.addr() % 4096 == 0);
    assert!(x.addr() + x.len() as u64 <= y.addr() || y.addr() + y.len() as u64 <= x.addr());
    assert_ne!(x.lkey(), y.lkey());
    assert_ne!(x.rkey(), y.rkey());
    assert_ne!(x.lkey(), x.rkey());
    assert_eq!(
        p.reg_mr(1, Access::REMOTE_WRITE).unwrap_err(),
        VerbsError::Invalid("REMOTE_WRITE requires LOCAL_WRITE")
    );
    drop((b, c));
    assert_eq!(f.stats(ip(1)).registered_bytes, 0);
}

#[test]
fn queue_pairs_are_limited() {
    let cfg = SimConfig {
        max_qps_per_host: 1,
        ..cfg0()
    };
    let f = SimFabric::with_config(1, cfg);
    let pa = f.provider(ip(1));
    let pb = f.provider(ip(2));
    let pc = f.provider(ip(3));
    let mut l = pb.listen(sa(2, 80), 4, QpCaps::default()).unwrap();
    let a = pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
    assert_eq!(
        pa.connect(sa(2, 80), None, QpCaps::default(), &[])
            .unwrap_err(),
        VerbsError::NoResources("queue pairs")
    );
    run(&f);
    let (_b, _) = l.poll_request().unwrap();
    // The passive host is full too: a further request is refused.
    let mut c = pc.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
    run(&f);
    assert_eq!(
        cm(&mut c),
        vec![CmEvent::Rejected {
            private_data: vec![],
            consumer: false
        }]
    );
    drop(a);
    pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
}

#[test]
fn mr_local_access_bounds_panic() {
    let f = SimFabric::new(1);
    let p = f.provider(ip(1));
    let mut mr = p.reg_mr(16, RW).unwrap();
    mr.write(8, &[1; 8]);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| mr.write(9, &[1; 8])));
    assert!(r.is_err());
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        mr.read(usize::MAX, &mut [0; 2])
    }));
    assert!(r.is_err());
    assert_eq!(p.name(), "sim");
}

#[test]
fn data_on_the_wire_outlives_a_dropped_endpoint() {
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    p.b.post_recv(&recv(2, &bmr, 0, 64)).unwrap();
    p.b.post_recv(&recv(3, &bmr, 0, 64)).unwrap();
    p.a.post_send(&send(1, &amr, 0, 4)).unwrap();
    p.f.advance(p.f.now()); // on the wire
    drop(p.a);
    assert_eq!(p.f.stats(ip(1)).qps, 0);
    run(&p.f);
    assert_eq!(
        cq(&mut p.b),
        vec![
            ok(2, WcOpcode::Recv, 4),
            wc(3, WcStatus::Flushed, WcOpcode::Recv)
        ]
    );
    assert_eq!(
        cm(&mut p.b),
        vec![CmEvent::Disconnected, CmEvent::TimewaitExit]
    );
    assert_eq!(p.f.pending_events(), 0);
}

#[test]
fn no_rnr_retransmission_after_the_requester_errors() {
    let cfg = SimConfig {
        rnr_retry: 7,
        rnr_delay_ns: 10_000,
        ..cfg0()
    };
    let mut p = pair_cfg(cfg);
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let bmr = p.pb.reg_mr(64, RW).unwrap();
    let t0 = p.f.now();
    p.a.post_send(&send(1, &amr, 0, 4)).unwrap();
    p.f.advance(t0 + L + 1);
    assert_eq!(p.f.stats(ip(1)).rnr_naks, 1);
    p.b.post_recv(&recv(2, &bmr, 0, 64)).unwrap();
    p.a.disconnect().unwrap();
    run(&p.f);
    assert_eq!(cq(&mut p.a), vec![wc(1, WcStatus::Flushed, WcOpcode::Send)]);
    assert_eq!(cq(&mut p.b), vec![wc(2, WcStatus::Flushed, WcOpcode::Recv)]);
    assert_eq!(p.f.stats(ip(2)).recvs, 0);
}

#[test]
fn passive_data_never_overtakes_the_accept() {
    // With jitter, the passive side's first SEND (posted right after accept) could beat the REP;
    // it must not: the active side would drop it.
    for seed in 0..20 {
        let f = SimFabric::new(seed);
        f.faults().set_delay(ip(1), ip(2), 0, 20_000);
        let pa = f.provider(ip(1));
        let pb = f.provider(ip(2));
        let mut l = pb.listen(sa(2, 80), 1, QpCaps::default()).unwrap();
        let mut a = pa.connect(sa(2, 80), None, QpCaps::default(), &[]).unwrap();
        let amr = pa.reg_mr(64, RW).unwrap();
        a.post_recv(&recv(1, &amr, 0, 64)).unwrap();
        run(&f);
        let (mut b, _) = l.poll_request().unwrap();
        let bmr = pb.reg_mr(64, RW).unwrap();
        b.accept(&[]).unwrap();
        b.post_send(&send(2, &bmr, 0, 8)).unwrap();
        run(&f);
        assert_eq!(cq(&mut b), vec![ok(2, WcOpcode::Send, 8)], "seed {seed}");
        assert_eq!(cq(&mut a), vec![ok(1, WcOpcode::Recv, 8)], "seed {seed}");
    }
}

/// A SEND gathers its payload SGE after the first one (header and payload from different
/// registrations): the receiver gets them as one message; a payload outside any registration
/// or on an RDMA Write is a local protection error.
#[test]
fn gathered_send_concatenates_and_checks_both_sges() {
    let mut p = pair();
    let mut hdr = p.pa.reg_mr(64, Access::empty()).unwrap();
    hdr.write(0, b"HEAD");
    let mut body = p.pa.reg_mr(4096, Access::empty()).unwrap();
    let data: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
    body.write(100, &data);
    let bmr = p.pb.reg_mr(8192, RW).unwrap();
    p.b.post_recv(&recv(9, &bmr, 0, 8192)).unwrap();
    let wr = SendWr {
        payload: Some(body.sge(100, 3000)),
        ..send(1, &hdr, 0, 4)
    };
    p.a.post_send(&wr).unwrap();
    run(&p.f);
    assert_eq!(cq(&mut p.b), vec![ok(9, WcOpcode::Recv, 3004)]);
    assert_eq!(cq(&mut p.a), vec![ok(1, WcOpcode::Send, 3004)]);
    let got = bmr.to_vec();
    assert_eq!(&got[..4], b"HEAD");
    assert_eq!(&got[4..3004], &data[..]);
    assert_eq!(p.f.stats(ip(1)).send_bytes, 3004);

    // The payload's lkey names nothing registered.
    let mut p = pair();
    let hdr = p.pa.reg_mr(64, Access::empty()).unwrap();
    let body = p.pa.reg_mr(64, Access::empty()).unwrap();
    let mut bad = body.sge(0, 8);
    bad.lkey ^= 0x5555;
    p.a.post_send(&SendWr {
        payload: Some(bad),
        ..send(1, &hdr, 0, 4)
    })
    .unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.a),
        vec![wc(1, WcStatus::LocalProtection, WcOpcode::Send)]
    );

    // A gathered payload is for SENDs only.
    let mut p = pair();
    let amr = p.pa.reg_mr(64, RW).unwrap();
    let target = p.pb.reg_mr(64, RW | Access::REMOTE_WRITE).unwrap();
    p.a.post_send(&SendWr {
        payload: Some(amr.sge(8, 8)),
        ..write(1, &amr, 0, 8, rb(&target, 0))
    })
    .unwrap();
    run(&p.f);
    assert_eq!(
        cq(&mut p.a),
        vec![wc(1, WcStatus::LocalProtection, WcOpcode::RdmaWrite)]
    );
}
