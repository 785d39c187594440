//! The shm provider against the verbs semantics (mirrors sim_provider.rs where it applies),
//! plus what only a real intra-host transport has: other processes, other users, kill -9,
//! the notify fd, and the SDP engine driven over it with a real clock.
#![cfg(target_os = "linux")]

use std::net::{SocketAddr, TcpListener};
use std::os::fd::RawFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sdp_core::verbs::shm::{ShmConfig, ShmEndpoint, ShmProvider, WC_REM_INV_REQ_ERR};
use sdp_core::verbs::*;

mod shm_common;
use shm_common::*;

fn prov() -> ShmProvider {
    ShmProvider::new().expect("provider")
}

/// A scratch array for `poll_cq`.
fn wc_buf() -> [Completion; 16] {
    [Completion {
        wr_id: 0,
        status: WcStatus::Flushed,
        opcode: WcOpcode::Recv,
        byte_len: 0,
    }; 16]
}

fn poll_n(ep: &mut ShmEndpoint, n: usize, limit: Duration) -> Vec<Completion> {
    let end = Instant::now() + limit;
    let mut out = Vec::new();
    let mut buf = wc_buf();
    while out.len() < n {
        let k = ep.poll_cq(&mut buf);
        out.extend_from_slice(&buf[..k]);
        if k == 0 {
            if Instant::now() > end {
                break;
            }
            std::thread::yield_now();
        }
    }
    out
}

fn send_wr(wr_id: u64, op: SendOp, sge: Option<Sge>) -> SendWr {
    SendWr {
        wr_id,
        op,
        sge,
        signaled: true,
        solicited: false,
        wake_engine: false,
        payload: None,
    }
}

#[test]
fn listen_connect_accept_with_private_data() {
    let a = prov();
    let b = prov();
    let mut l = b
        .listen("0.0.0.0:0".parse().unwrap(), 8, QpCaps::default())
        .unwrap();
    let port = l.local_addr().port();
    assert_ne!(port, 0);
    // The port is reserved as a kernel TCP port too.
    assert!(TcpListener::bind(("0.0.0.0", port)).is_err());
    let (x, y) = pair_on(&a, &mut l, port);
    assert_eq!(x.peer_addr().port(), port);
    assert_eq!(y.local_addr().port(), port);
    assert_eq!(x.peer_pid(), std::process::id() as i32);
}

#[test]
fn reject_with_private_data() {
    let a = prov();
    let b = prov();
    let mut l = b.listen(localhost(0), 8, QpCaps::default()).unwrap();
    let port = l.local_addr().port();
    let mut x = a
        .connect(localhost(port), None, QpCaps::default(), b"hi")
        .unwrap();
    let (mut y, _) = wait_request(&mut l);
    y.reject(b"go away").unwrap();
    assert_eq!(
        wait_cm(&mut x, T),
        Some(CmEvent::Rejected {
            private_data: b"go away".to_vec(),
            consumer: true
        })
    );
}

/// A connect where nobody listens over shm (the address, 0.0.0.0, [::]) is refused by the call
/// itself: no endpoint and no inbox are made. (Before, an endpoint and its inbox were made to
/// carry a rejection event, which the runtime then tore down: ~70 us of a shim client's
/// connect to every kernel TCP server.)
#[test]
fn refused_port_is_prompt() {
    let a = prov();
    // A port nobody shm-listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t0 = Instant::now();
    assert!(matches!(
        a.connect(localhost(port), None, QpCaps::default(), b"hi"),
        Err(VerbsError::Refused)
    ));
    assert!(t0.elapsed() < Duration::from_millis(200));
}

#[test]
fn dropped_listener_and_dropped_request_refuse() {
    let a = prov();
    let b = prov();
    let mut l = b.listen(localhost(0), 8, QpCaps::default()).unwrap();
    let port = l.local_addr().port();
    let mut x = a
        .connect(localhost(port), None, QpCaps::default(), b"hi")
        .unwrap();
    let (y, _) = wait_request(&mut l);
    drop(y);
    assert_eq!(
        wait_cm(&mut x, T),
        Some(CmEvent::Rejected {
            private_data: vec![],
            consumer: false
        })
    );
    let mut x = a
        .connect(localhost(port), None, QpCaps::default(), b"hi")
        .unwrap();
    drop(l);
    assert_eq!(
        wait_cm(&mut x, T),
        Some(CmEvent::Rejected {
            private_data: vec![],
            consumer: false
        })
    );
}

#[test]
fn addressing() {
    let a = prov();
    let b = prov();
    // Not an address of this host.
    assert!(matches!(
        a.connect(
            "203.0.113.7:80".parse().unwrap(),
            None,
            QpCaps::default(),
            b""
        ),
        Err(VerbsError::NoDevice(_))
    ));
    assert!(matches!(
        b.listen("203.0.113.7:80".parse().unwrap(), 8, QpCaps::default()),
        Err(VerbsError::AddrNotAvailable)
    ));
    // An explicit port: a second listener on the same key is refused, and no TCP socket is held.
    // The port is a free TCP port at the time of the pick; another process (tests run in
    // parallel) may take it before the TCP bind below: then the test picks again, a few times.
    let mut tries = 0;
    let (port, mut l) = loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let l = b.listen(localhost(port), 8, QpCaps::default()).unwrap();
        assert_eq!(l.local_addr(), localhost(port));
        assert!(matches!(
            b.listen(localhost(port), 8, QpCaps::default()),
            Err(VerbsError::AddrInUse)
        ));
        match TcpListener::bind(localhost(port)) {
            Ok(tcp) => {
                drop(tcp);
                break (port, l);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 20 => tries += 1,
            Err(e) => panic!("TCP may share the port: {e}"),
        }
    };
    // A listener on 127.0.0.1 is not reachable at 127.0.0.2.
    assert!(matches!(
        a.connect(
            "127.0.0.2:0"
                .parse::<SocketAddr>()
                .map(|mut s| {
                    s.set_port(port);
                    s
                })
                .unwrap(),
            None,
            QpCaps::default(),
            b"",
        ),
        Err(VerbsError::Refused)
    ));
    // But it is at 127.0.0.1; and a wildcard listener is reachable at 127.0.0.2 and [::1].
    pair_on(&a, &mut l, port);
    let mut w = b
        .listen("[::]:0".parse().unwrap(), 8, QpCaps::default())
        .unwrap();
    let wport = w.local_addr().port();
    for dst in [
        format!("127.0.0.2:{wport}"),
        format!("[::1]:{wport}"),
        format!("127.0.0.1:{wport}"),
    ] {
        let mut x = a
            .connect(dst.parse().unwrap(), None, QpCaps::default(), b"x")
            .unwrap();
        let (mut y, _) = wait_request(&mut w);
        y.accept(b"").unwrap();
        assert!(matches!(
            wait_cm(&mut x, T),
            Some(CmEvent::Established { .. })
        ));
    }
    // Private data limits as the RDMA CM.
    assert!(matches!(
        a.connect(localhost(port), None, QpCaps::default(), &[0; 57]),
        Err(VerbsError::Invalid(_))
    ));
}

fn fill(mr: &mut ShmMr, seed: u8) {
    let v: Vec<u8> = (0..mr.len())
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    mr.write(0, &v);
}

use sdp_core::verbs::shm::ShmMr;

#[test]
fn send_recv_order_and_byte_len() {
    let a = prov();
    let b = prov();
    let (mut x, mut y) = pair(&a, &b);
    let sizes = [1usize, 100, 448, 449, 4096, 65536, 1 << 20, 0, 7];
    let mut rbufs = Vec::new();
    for (i, _) in sizes.iter().enumerate() {
        let mr = b.reg_mr(1 << 20, Access::LOCAL_WRITE).unwrap();
        y.post_recv(&RecvWr {
            wr_id: 100 + i as u64,
            sge: mr.sge(0, 1 << 20),
        })
        .unwrap();
        rbufs.push(mr);
    }
    let mut sbufs = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let mut mr = a.reg_mr(n.max(1), Access::empty()).unwrap();
        fill(&mut mr, i as u8);
        x.post_send(&send_wr(i as u64, SendOp::Send, Some(mr.sge(0, n as u32))))
            .unwrap();
        sbufs.push(mr);
    }
    let sc = poll_n(&mut x, sizes.len(), T);
    for (i, c) in sc.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (i as u64, WcStatus::Success, WcOpcode::Send, sizes[i] as u32)
        );
    }
    let rc = poll_n(&mut y, sizes.len(), T);
    assert_eq!(rc.len(), sizes.len());
    for (i, c) in rc.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (
                100 + i as u64,
                WcStatus::Success,
                WcOpcode::Recv,
                sizes[i] as u32
            )
        );
        let mut want = vec![0u8; sizes[i]];
        sbufs[i].read(0, &mut want);
        let mut got = vec![0u8; sizes[i]];
        rbufs[i].read(0, &mut got);
        assert!(got == want, "payload {i} differs");
    }
}

#[test]
fn send_longer_than_receive_errors_both() {
    let a = prov();
    let b = prov();
    let (mut x, mut y) = pair(&a, &b);
    let r = b.reg_mr(16, Access::LOCAL_WRITE).unwrap();
    y.post_recv(&RecvWr {
        wr_id: 1,
        sge: r.sge(0, 16),
    })
    .unwrap();
    y.post_recv(&RecvWr {
        wr_id: 2,
        sge: r.sge(0, 16),
    })
    .unwrap();
    let s = a.reg_mr(32, Access::empty()).unwrap();
    x.post_send(&send_wr(7, SendOp::Send, Some(s.sge(0, 32))))
        .unwrap();
    let c = poll_n(&mut x, 1, T);
    assert_eq!(c[0].status, WcStatus::Other(WC_REM_INV_REQ_ERR));
    assert_eq!(wait_cm(&mut x, T), Some(CmEvent::Disconnected));
    let c = poll_n(&mut y, 2, T);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::LocalProtection), (2, WcStatus::Flushed)]
    );
    assert_eq!(wait_cm(&mut y, T), Some(CmEvent::Disconnected));
}

#[test]
fn rdma_write_and_read() {
    let a = prov();
    let b = prov();
    let (mut x, _y) = pair(&a, &b);
    let n = 3 << 20;
    let mut src = a.reg_mr(n, Access::empty()).unwrap();
    fill(&mut src, 9);
    let dst = b
        .reg_mr(n + 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let rb = RemoteBuf {
        addr: dst.addr() + 4096,
        rkey: dst.rkey(),
    };
    x.post_send(&send_wr(1, SendOp::Write(rb), Some(src.sge(0, n as u32))))
        .unwrap();
    // Zero-length write: the keepalive probe.
    x.post_send(&send_wr(2, SendOp::Write(rb), None)).unwrap();
    let c = poll_n(&mut x, 2, T);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode, c[0].byte_len),
        (1, WcStatus::Success, WcOpcode::RdmaWrite, n as u32)
    );
    assert_eq!((c[1].wr_id, c[1].status), (2, WcStatus::Success));
    let mut got = vec![0u8; n];
    dst.read(4096, &mut got);
    let mut want = vec![0u8; n];
    src.read(0, &mut want);
    assert!(got == want);

    let mut rsrc = b.reg_mr(n, Access::REMOTE_READ).unwrap();
    fill(&mut rsrc, 77);
    let sink = a.reg_mr(n, Access::LOCAL_WRITE).unwrap();
    let rb = RemoteBuf {
        addr: rsrc.addr(),
        rkey: rsrc.rkey(),
    };
    x.post_send(&send_wr(3, SendOp::Read(rb), Some(sink.sge(0, n as u32))))
        .unwrap();
    let c = poll_n(&mut x, 1, T);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode, c[0].byte_len),
        (3, WcStatus::Success, WcOpcode::RdmaRead, n as u32)
    );
    let mut got = vec![0u8; n];
    sink.read(0, &mut got);
    let mut want = vec![0u8; n];
    rsrc.read(0, &mut want);
    assert!(got == want);
}

/// Large RDMA Reads and Writes are copied by both processes when the peer polls (`assist`):
/// every byte arrives, odd lengths included, in both directions, and the peer did take part.
/// Large SENDs likewise, into the receives the peer posted.
#[test]
fn shared_copies_with_a_polling_peer() {
    use std::sync::atomic::AtomicBool;
    let a = prov();
    let b = prov();
    let (mut x, mut y) = pair(&a, &b);
    let n = (4 << 20) + 777;
    let mut src = b.reg_mr(n, Access::REMOTE_READ).unwrap();
    let sink = b
        .reg_mr(n, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let mut local = a.reg_mr(n, Access::LOCAL_WRITE).unwrap();
    // Receives for the SENDs, at odd offsets inside one region.
    let rsize = 160 * 1024;
    let rbuf = b.reg_mr(16 * rsize, Access::LOCAL_WRITE).unwrap();
    for i in 0..16 {
        y.post_recv(&RecvWr {
            wr_id: 200 + i as u64,
            sge: rbuf.sge(i * rsize + 8, (rsize - 8) as u32),
        })
        .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let helper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = y.poll_cq(&mut []);
            }
            y
        })
    };
    let mut got = vec![0u8; n];
    let mut want = vec![0u8; n];
    for round in 0..16u8 {
        // Read: the peer's source into our buffer.
        fill(&mut src, round);
        let rb = RemoteBuf {
            addr: src.addr(),
            rkey: src.rkey(),
        };
        x.post_send(&send_wr(1, SendOp::Read(rb), Some(local.sge(0, n as u32))))
            .unwrap();
        let c = poll_n(&mut x, 1, T);
        assert_eq!((c[0].status, c[0].byte_len), (WcStatus::Success, n as u32));
        local.read(0, &mut got);
        src.read(0, &mut want);
        assert!(got == want, "read, round {round}");
        // Write: our buffer into the peer's sink, at an offset.
        fill(&mut local, round.wrapping_add(100));
        let off = 4096 * usize::from(round % 3);
        let len = n - off;
        let rb = RemoteBuf {
            addr: sink.addr() + off as u64,
            rkey: sink.rkey(),
        };
        x.post_send(&send_wr(
            2,
            SendOp::Write(rb),
            Some(local.sge(0, len as u32)),
        ))
        .unwrap();
        let c = poll_n(&mut x, 1, T);
        assert_eq!(
            (c[0].status, c[0].byte_len),
            (WcStatus::Success, len as u32)
        );
        sink.read(off, &mut got[..len]);
        local.read(0, &mut want[..len]);
        assert!(got[..len] == want[..len], "write, round {round}");
    }
    // SENDs of 32 KiB and more are shared too: every byte lands in its receive.
    let sizes: Vec<usize> = (0..16).map(|i| 32 * 1024 + i * 8191).collect();
    for (i, &len) in sizes.iter().enumerate() {
        fill(&mut local, i as u8 ^ 0x5a);
        x.post_send(&send_wr(
            300 + i as u64,
            SendOp::Send,
            Some(local.sge(0, len as u32)),
        ))
        .unwrap();
        let c = poll_n(&mut x, 1, T);
        assert_eq!(
            (c[0].wr_id, c[0].status),
            (300 + i as u64, WcStatus::Success)
        );
    }
    stop.store(true, Ordering::Relaxed);
    let mut y = helper.join().unwrap();
    let c = poll_n(&mut y, 16, T);
    assert_eq!(c.len(), 16);
    for (i, (c, &len)) in c.iter().zip(&sizes).enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.byte_len),
            (200 + i as u64, WcStatus::Success, len as u32)
        );
        let want: Vec<u8> = (0..len)
            .map(|k| (k as u8).wrapping_mul(31).wrapping_add(i as u8 ^ 0x5a))
            .collect();
        rbuf.read(i * rsize + 8, &mut got[..len]);
        assert!(got[..len] == want[..], "send {i}");
    }
    // The peer polled all along: it copied chunks (a 4 MiB operation has 8 of them).
    assert!(b.assisted_chunks() > 0);
    assert_eq!(a.assisted_chunks(), 0);
}

/// Post a bad RDMA op: RemoteAccess, the WRs after it and the receives flushed, both sides
/// Disconnected.
fn expect_remote_access(
    a: &ShmProvider,
    b: &ShmProvider,
    op: impl Fn(&ShmMr) -> SendOp,
    mr: &ShmMr,
) {
    let (mut x, mut y) = pair(a, b);
    let local = a.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    x.post_recv(&RecvWr {
        wr_id: 50,
        sge: local.sge(0, 64),
    })
    .unwrap();
    x.post_send(&send_wr(1, op(mr), Some(local.sge(0, 4096))))
        .unwrap();
    x.post_send(&send_wr(2, SendOp::Send, Some(local.sge(0, 8))))
        .unwrap();
    let c = poll_n(&mut x, 3, T);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        // The failing WR executes at once, so the QP is in error by the time WR 2 is
        // posted: it flushes at post time, after the receive flushed by the error.
        vec![
            (1, WcStatus::RemoteAccess),
            (50, WcStatus::Flushed),
            (2, WcStatus::Flushed)
        ]
    );
    assert_eq!(wait_cm(&mut x, T), Some(CmEvent::Disconnected));
    assert_eq!(wait_cm(&mut y, T), Some(CmEvent::Disconnected));
}

#[test]
fn rdma_access_violations() {
    let a = prov();
    let b = prov();
    let mut mr = b
        .reg_mr(8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    // Bad rkey (the lkey is not an rkey).
    expect_remote_access(
        &a,
        &b,
        |m| {
            SendOp::Write(RemoteBuf {
                addr: m.addr(),
                rkey: m.lkey(),
            })
        },
        &mr,
    );
    expect_remote_access(
        &a,
        &b,
        |m| {
            SendOp::Write(RemoteBuf {
                addr: m.addr(),
                rkey: m.rkey() ^ 0x10000,
            })
        },
        &mr,
    );
    // Out of bounds.
    expect_remote_access(
        &a,
        &b,
        |m| {
            SendOp::Write(RemoteBuf {
                addr: m.addr() + 4097,
                rkey: m.rkey(),
            })
        },
        &mr,
    );
    expect_remote_access(
        &a,
        &b,
        |m| {
            SendOp::Write(RemoteBuf {
                addr: m.addr() - 1,
                rkey: m.rkey(),
            })
        },
        &mr,
    );
    // Access: a write region cannot be read.
    expect_remote_access(
        &a,
        &b,
        |m| {
            SendOp::Read(RemoteBuf {
                addr: m.addr(),
                rkey: m.rkey(),
            })
        },
        &mr,
    );
    // Revoked.
    mr.set_access(Access::LOCAL_WRITE).unwrap();
    expect_remote_access(
        &a,
        &b,
        |m| {
            SendOp::Write(RemoteBuf {
                addr: m.addr(),
                rkey: m.rkey(),
            })
        },
        &mr,
    );
    // Granted again: works.
    mr.set_access(Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let (mut x, _y) = pair(&a, &b);
    let src = a.reg_mr(4096, Access::empty()).unwrap();
    x.post_send(&send_wr(
        1,
        SendOp::Write(RemoteBuf {
            addr: mr.addr(),
            rkey: mr.rkey(),
        }),
        Some(src.sge(0, 4096)),
    ))
    .unwrap();
    assert_eq!(poll_n(&mut x, 1, T)[0].status, WcStatus::Success);
    // Deregistered.
    let (addr, rkey) = (mr.addr(), mr.rkey());
    drop(mr);
    let dummy = b.reg_mr(1, Access::empty()).unwrap();
    expect_remote_access(
        &a,
        &b,
        move |_| SendOp::Write(RemoteBuf { addr, rkey }),
        &dummy,
    );
    // Local protection: an RDMA Read into memory without LOCAL_WRITE.
    let (mut x, _y) = pair(&a, &b);
    let rs = b.reg_mr(64, Access::REMOTE_READ).unwrap();
    let ro = a.reg_mr(64, Access::empty()).unwrap();
    x.post_send(&send_wr(
        1,
        SendOp::Read(RemoteBuf {
            addr: rs.addr(),
            rkey: rs.rkey(),
        }),
        Some(ro.sge(0, 64)),
    ))
    .unwrap();
    assert_eq!(poll_n(&mut x, 1, T)[0].status, WcStatus::LocalProtection);
}

/// A grant (`advertise`) has a key-table entry of its own: a peer reaches only its range,
/// with only its rights, until `revoke`; the region's own key gives nothing remote.
#[test]
fn a_grant_reaches_only_its_range_until_revoked() {
    let a = prov();
    let b = prov();
    let mut mr = b.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    let bytes: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
    mr.write(0, &bytes);
    let before = b.registered_regions();
    let g = mr.advertise(1000, 4096, Access::REMOTE_READ).unwrap();
    assert_eq!((g.addr, g.len), (mr.addr() + 1000, 4096));
    assert_ne!(g.rkey, mr.rkey());
    let g2 = mr.advertise(1000, 4096, Access::REMOTE_READ).unwrap();
    assert_ne!(g2.rkey, g.rkey, "each grant has its own rkey");
    assert_eq!(b.registered_regions(), before + 2);
    mr.revoke(&g2).unwrap();
    assert_eq!(b.registered_regions(), before + 1);

    // Inside the window: the bytes arrive.
    let (mut x, _y) = pair(&a, &b);
    let sink = a.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let rb = RemoteBuf {
        addr: g.addr + 100,
        rkey: g.rkey,
    };
    x.post_send(&send_wr(1, SendOp::Read(rb), Some(sink.sge(0, 2900))))
        .unwrap();
    assert_eq!(poll_n(&mut x, 1, T)[0].status, WcStatus::Success);
    let mut got = vec![0u8; 2900];
    sink.read(0, &mut got);
    assert_eq!(got, bytes[1100..4000]);

    let read_at = |addr: u64, rkey: u32| move |_: &ShmMr| SendOp::Read(RemoteBuf { addr, rkey });
    // The whole window (`expect_remote_access` reads 4096 bytes): fine.
    let (mut x, _y) = pair(&a, &b);
    x.post_send(&send_wr(
        1,
        SendOp::Read(RemoteBuf {
            addr: g.addr,
            rkey: g.rkey,
        }),
        Some(sink.sge(0, 4096)),
    ))
    .unwrap();
    assert_eq!(poll_n(&mut x, 1, T)[0].status, WcStatus::Success);
    // One byte before the window, one byte past it, and the region's own key: refused.
    expect_remote_access(&a, &b, read_at(g.addr - 1, g.rkey), &mr);
    expect_remote_access(&a, &b, read_at(g.addr + 1, g.rkey), &mr);
    expect_remote_access(&a, &b, read_at(g.addr, mr.rkey()), &mr);
    // Only the rights granted: no RDMA Write through a read grant.
    let (addr, rkey) = (g.addr, g.rkey);
    expect_remote_access(
        &a,
        &b,
        move |_| SendOp::Write(RemoteBuf { addr, rkey }),
        &mr,
    );

    // Revoked: refused, and not revocable twice.
    mr.revoke(&g).unwrap();
    assert!(mr.revoke(&g).is_err());
    expect_remote_access(&a, &b, read_at(g.addr + 100, g.rkey), &mr);
    assert_eq!(b.registered_regions(), before);

    // Bad arguments; grants die with their region.
    assert!(mr.advertise(8000, 193, Access::REMOTE_READ).is_err());
    assert!(mr.advertise(0, 0, Access::REMOTE_READ).is_err());
    assert!(mr.advertise(0, 16, Access::REMOTE_WRITE).is_err());
    let _g = mr.advertise(0, 16, Access::REMOTE_READ).unwrap();
    drop(mr);
    assert_eq!(b.registered_regions(), before - 1);
}

/// Deregistering or revoking a region (or a grant of it) while a peer's large RDMA Write into
/// it is under way returns only once no more of it can land (the owner waits for the copy in
/// flight, the writer looks at the key again before each chunk): after `drop(mr)` /
/// `set_access` / `revoke` the memory is the owner's alone.
#[test]
fn dereg_and_revoke_wait_for_a_copy_in_flight() {
    use std::ptr::NonNull;
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum How {
        Dereg,
        SetAccess,
        Grant,
    }
    for how in [How::Dereg, How::SetAccess, How::Grant] {
        let a = prov();
        let b = prov();
        let (mut x, _y) = pair(&a, &b);
        let n = 64 << 20;
        let mut src = a.reg_mr(n, Access::empty()).unwrap();
        src.write(0, &vec![0xab; n]);
        let mut sink = vec![0u8; n];
        let base = sink.as_mut_ptr() as usize;
        // SAFETY: `sink` outlives the region (dropped or revoked below, freed at the end).
        let base_access = match how {
            How::Grant => Access::LOCAL_WRITE,
            _ => Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        };
        let mut mr =
            unsafe { b.reg_mr_at(NonNull::new(base as *mut u8).unwrap(), n, base_access) }.unwrap();
        let grant = (how == How::Grant).then(|| {
            mr.advertise(0, n, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap()
        });
        let rb = match grant {
            Some(g) => RemoteBuf {
                addr: g.addr,
                rkey: g.rkey,
            },
            None => RemoteBuf {
                addr: mr.addr(),
                rkey: mr.rkey(),
            },
        };
        let sge = src.sge(0, n as u32);
        let mut mr = Some(mr);
        let last = base + n - 4096;
        std::thread::scope(|s| {
            let w = s.spawn(move || {
                x.post_send(&send_wr(1, SendOp::Write(rb), Some(sge)))
                    .unwrap();
                poll_n(&mut x, 1, T)
            });
            let end = Instant::now() + T;
            // SAFETY: reads of our own buffer, which the peer's copy writes concurrently.
            while unsafe { std::ptr::read_volatile(base as *const u8) } == 0 {
                assert!(Instant::now() < end, "the write did not start");
                std::hint::spin_loop();
            }
            match how {
                How::SetAccess => mr
                    .as_mut()
                    .unwrap()
                    .set_access(Access::LOCAL_WRITE)
                    .unwrap(),
                How::Grant => mr.as_mut().unwrap().revoke(&grant.unwrap()).unwrap(),
                How::Dereg => drop(mr.take()),
            }
            // The memory is ours again: mark its last page (the write had not got there).
            for i in 0..4096 {
                // SAFETY: inside `sink`.
                unsafe { std::ptr::write_volatile((last + i) as *mut u8, 0x11) };
            }
            let c = w.join().unwrap();
            assert_eq!(c.len(), 1);
            let landed = (0..4096)
                // SAFETY: inside `sink`.
                .filter(|i| unsafe { std::ptr::read_volatile((last + i) as *const u8) } != 0x11)
                .count();
            assert_eq!(
                landed, 0,
                "{how:?}: the write landed after the region was withdrawn ({:?})",
                c[0].status
            );
        });
        drop(mr);
        drop(sink);
    }
}

#[test]
fn rnr_waits_then_succeeds_or_times_out() {
    let cfg = ShmConfig {
        rnr_timeout: Duration::from_millis(300),
        ..ShmConfig::default()
    };
    let a = ShmProvider::with_config(cfg).unwrap();
    let b = prov();
    let (mut x, mut y) = pair(&a, &b);
    let s = a.reg_mr(1000, Access::empty()).unwrap();
    x.post_send(&send_wr(1, SendOp::Send, Some(s.sge(0, 1000))))
        .unwrap();
    x.post_send(&send_wr(2, SendOp::Send, Some(s.sge(0, 10))))
        .unwrap();
    assert!(poll_n(&mut x, 1, Duration::from_millis(100)).is_empty());
    let r = b.reg_mr(1000, Access::LOCAL_WRITE).unwrap();
    y.post_recv(&RecvWr {
        wr_id: 9,
        sge: r.sge(0, 1000),
    })
    .unwrap();
    let c = poll_n(&mut x, 1, T);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::Success));
    // The second waits for another receive, then gives up.
    let t0 = Instant::now();
    let c = poll_n(&mut x, 1, T);
    let waited = t0.elapsed();
    assert_eq!((c[0].wr_id, c[0].status), (2, WcStatus::RnrRetryExceeded));
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert_eq!(wait_cm(&mut x, T), Some(CmEvent::Disconnected));
    let c = poll_n(&mut y, 1, T);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].byte_len),
        (9, WcStatus::Success, 1000)
    );
    assert_eq!(wait_cm(&mut y, T), Some(CmEvent::Disconnected));
}

#[test]
fn disconnect_either_side() {
    let a = prov();
    let b = prov();
    for active_first in [true, false] {
        let (mut x, mut y) = pair(&a, &b);
        let r = a.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        let r2 = b.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        x.post_recv(&RecvWr {
            wr_id: 1,
            sge: r.sge(0, 64),
        })
        .unwrap();
        y.post_recv(&RecvWr {
            wr_id: 2,
            sge: r2.sge(0, 64),
        })
        .unwrap();
        let (first, second) = if active_first {
            (&mut x, &mut y)
        } else {
            (&mut y, &mut x)
        };
        first.disconnect().unwrap();
        assert_eq!(wait_cm(first, T), Some(CmEvent::Disconnected));
        assert_eq!(wait_cm(second, T), Some(CmEvent::Disconnected));
        for ep in [&mut x, &mut y] {
            let c = poll_n(ep, 1, T);
            assert_eq!(c[0].status, WcStatus::Flushed);
            // Later posts flush at once.
            ep.post_send(&send_wr(5, SendOp::Send, None)).unwrap();
            assert_eq!(poll_n(ep, 1, T)[0].status, WcStatus::Flushed);
        }
    }
    // Dropping a connected endpoint disconnects the peer.
    let (x, mut y) = pair(&a, &b);
    drop(x);
    assert_eq!(wait_cm(&mut y, T), Some(CmEvent::Disconnected));
}

fn readable(fd: RawFd, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

#[test]
fn notify_fd_after_arm() {
    let a = prov();
    let b = prov();
    let (mut x, mut y) = pair(&a, &b);
    let fd = b.notify_fd().expect("fd");
    let r = b.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let s = a.reg_mr(64, Access::empty()).unwrap();
    for round in 0..3u64 {
        y.post_recv(&RecvWr {
            wr_id: round,
            sge: r.sge(0, 64),
        })
        .unwrap();
        b.arm().unwrap();
        assert!(poll_n(&mut y, 1, Duration::ZERO).is_empty());
        while y.poll_cm().is_some() {}
        assert!(
            !readable(fd, 20),
            "readable with nothing new (round {round})"
        );
        x.post_send(&send_wr(round, SendOp::Send, Some(s.sge(0, 64))))
            .unwrap();
        assert!(readable(fd, 2000), "no wakeup after a send (round {round})");
        b.arm().unwrap();
        assert_eq!(poll_n(&mut y, 1, T)[0].wr_id, round);
        assert_eq!(poll_n(&mut x, 1, T)[0].wr_id, round);
    }
    // Once the wakeup is written, a busy peer sends without system calls until we arm again.
    let before = a.wakeups_sent();
    for i in 0..10 {
        y.post_recv(&RecvWr {
            wr_id: 10 + i,
            sge: r.sge(0, 64),
        })
        .unwrap();
        x.post_send(&send_wr(10 + i, SendOp::Send, Some(s.sge(0, 64))))
            .unwrap();
    }
    assert!(a.wakeups_sent() - before <= 1);
    assert_eq!(poll_n(&mut y, 10, T).len(), 10);
    // A disconnect wakes us through the socket.
    b.arm().unwrap();
    x.disconnect().unwrap();
    assert!(readable(fd, 2000));
    b.arm().unwrap();
    assert_eq!(wait_cm(&mut y, Duration::ZERO), Some(CmEvent::Disconnected));
}

/// Posting receives writes the peer's eventfd only when its SENDs wait for a receive: before,
/// every reposted receive woke the peer's progress thread, a wakeup per message (issue 15).
#[test]
fn posted_receives_wake_the_peer_only_when_its_sends_wait() {
    let a = prov();
    let b = prov();
    let (mut x, mut y) = pair(&a, &b);
    let r = b.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let s = a.reg_mr(64, Access::empty()).unwrap();
    a.arm().unwrap();
    let before = b.wakeups_sent();
    for i in 0..3 {
        y.post_recv(&RecvWr {
            wr_id: i,
            sge: r.sge(0, 64),
        })
        .unwrap();
    }
    assert_eq!(
        b.wakeups_sent(),
        before,
        "receives woke a peer with nothing waiting"
    );
    for i in 0..3 {
        x.post_send(&send_wr(i, SendOp::Send, Some(s.sge(0, 64))))
            .unwrap();
    }
    assert_eq!(poll_n(&mut y, 3, T).len(), 3);
    assert_eq!(poll_n(&mut x, 3, T).len(), 3);
    // No receive left: the next SEND waits for one, and the receive posted then wakes x.
    x.post_send(&send_wr(9, SendOp::Send, Some(s.sge(0, 64))))
        .unwrap();
    assert!(poll_n(&mut x, 1, Duration::ZERO).is_empty());
    a.arm().unwrap();
    let before = b.wakeups_sent();
    y.post_recv(&RecvWr {
        wr_id: 9,
        sge: r.sge(0, 64),
    })
    .unwrap();
    assert_eq!(b.wakeups_sent(), before + 1, "a waiting SEND was not woken");
    assert_eq!(poll_n(&mut x, 1, T)[0].wr_id, 9);
    assert_eq!(poll_n(&mut y, 1, T)[0].wr_id, 9);
}

/// Direct wakeups (issue 15): while the owner has them on, a solicited SEND writes one byte
/// into the socket the owner gave its peer and leaves the owner's notify fd alone (unless it
/// asks for the owner's engine too: `SendWr::wake_engine`, which wakes both); unsolicited
/// SENDs, and every SEND once they are off, wake the notify fd; turning them off after a SEND
/// that went by the byte only makes the notify fd readable, so nothing is lost.
/// Two connected endpoints, `y` with 8 receives posted and direct wakeups on into `user`'s
/// socket pair (its other end given to `x`'s provider, which has taken it).
struct Direct {
    a: ShmProvider,
    b: ShmProvider,
    x: ShmEndpoint,
    y: ShmEndpoint,
    s: sdp_core::verbs::shm::ShmMr,
    user: std::os::unix::net::UnixStream,
    _r: sdp_core::verbs::shm::ShmMr,
    _ours: std::os::unix::net::UnixStream,
}

impl Direct {
    fn new() -> Direct {
        use std::os::fd::AsFd;
        let a = prov();
        let b = prov();
        let (mut x, mut y) = pair(&a, &b);
        let r = b.reg_mr(64 * 8, Access::LOCAL_WRITE).unwrap();
        let s = a.reg_mr(64, Access::empty()).unwrap();
        for i in 0..8 {
            y.post_recv(&RecvWr {
                wr_id: i,
                sge: r.sge(64 * i as usize, 64),
            })
            .unwrap();
        }
        let (user, ours) = std::os::unix::net::UnixStream::pair().unwrap();
        user.set_nonblocking(true).unwrap();
        assert!(y.give_direct_wake(ours.as_fd()));
        y.set_direct_wake(true, false);
        // x's provider takes the socket from the rendezvous socket when it looks there.
        let until = Instant::now() + Duration::from_millis(300);
        while Instant::now() < until {
            a.arm().unwrap();
            while x.poll_cm().is_some() {}
            std::thread::sleep(Duration::from_millis(10));
        }
        Direct {
            a,
            b,
            x,
            y,
            s,
            user,
            _r: r,
            _ours: ours,
        }
    }

    /// A solicited SEND of `x`'s 64 bytes.
    fn solicited(&self, wr_id: u64) -> SendWr {
        SendWr {
            solicited: true,
            wake_engine: false,
            ..send_wr(wr_id, SendOp::Send, Some(self.s.sge(0, 64)))
        }
    }

    /// The bytes waiting in the user end, taken.
    fn bytes(&mut self) -> usize {
        use std::io::Read;
        let mut b = [0u8; 16];
        self.user.read(&mut b).unwrap_or(0)
    }
}

#[test]
fn direct_wakeups_go_to_the_given_socket_while_on() {
    let mut d = Direct::new();
    let fd = d.b.notify_fd().expect("fd");

    // On: a solicited SEND goes by the byte only.
    d.b.arm().unwrap();
    let direct = d.a.direct_wakeups_sent();
    d.x.post_send(&d.solicited(0)).unwrap();
    assert_eq!(d.a.direct_wakeups_sent(), direct + 1);
    assert_eq!(d.bytes(), 1, "no byte in the given socket");
    assert!(!readable(fd, 20), "the notify fd woke for a direct SEND");
    assert_eq!(poll_n(&mut d.y, 1, T)[0].wr_id, 0);

    // On, a solicited SEND that asks for the engine too (it takes the owner's last credits):
    // the byte for the reader, and the notify fd for the engine.
    d.b.arm().unwrap();
    let direct = d.a.direct_wakeups_sent();
    d.x.post_send(&SendWr {
        wake_engine: true,
        ..d.solicited(1)
    })
    .unwrap();
    assert_eq!(d.a.direct_wakeups_sent(), direct + 1);
    assert_eq!(d.bytes(), 1, "no byte in the given socket");
    assert!(readable(fd, 2000), "the engine was not woken");
    assert_eq!(poll_n(&mut d.y, 1, T)[0].wr_id, 1);

    // An unsolicited SEND (credits, acknowledgements) wakes the notify fd.
    d.b.arm().unwrap();
    d.x.post_send(&send_wr(2, SendOp::Send, Some(d.s.sge(0, 64))))
        .unwrap();
    assert!(readable(fd, 2000), "no wakeup for an unsolicited SEND");
    assert_eq!(d.bytes(), 0);
    assert_eq!(poll_n(&mut d.y, 1, T)[0].wr_id, 2);

    // On, a SEND by the byte only, then off: the notify fd knows of it.
    d.b.arm().unwrap();
    d.x.post_send(&d.solicited(3)).unwrap();
    assert_eq!(d.bytes(), 1);
    assert!(!readable(fd, 0));
    d.y.set_direct_wake(false, true);
    assert!(
        readable(fd, 0),
        "a SEND announced by the byte only was lost"
    );
    assert_eq!(poll_n(&mut d.y, 1, T)[0].wr_id, 3);

    // Off: solicited SENDs wake the notify fd, no byte.
    d.b.arm().unwrap();
    d.x.post_send(&d.solicited(4)).unwrap();
    assert!(readable(fd, 2000));
    assert_eq!(d.bytes(), 0);
    assert_eq!(poll_n(&mut d.y, 1, T)[0].wr_id, 4);
    assert_eq!(poll_n(&mut d.x, 5, T).len(), 5);
}

/// A reader that needs no edge per arrival (`Endpoint::set_direct_level`) gets one direct
/// byte while one is unread: the SENDs after it go by the bell only (no byte, no notify fd);
/// once the reader says it took the byte (`direct_unread_clear`) the next SEND writes one
/// again. With a byte per SEND asked again (an edge-triggered reader), every SEND writes one.
#[test]
fn a_level_reader_gets_one_direct_byte_while_one_is_unread() {
    let mut d = Direct::new();
    let fd = d.b.notify_fd().expect("fd");
    d.y.set_direct_level(true);
    let clear = d.y.direct_unread_clear().expect("shm has direct wakeups");
    d.b.arm().unwrap();
    let sent = d.a.direct_wakeups_sent();
    for i in 0..3 {
        d.x.post_send(&d.solicited(i)).unwrap();
    }
    assert_eq!(
        d.a.direct_wakeups_sent(),
        sent + 1,
        "one byte for three SENDs"
    );
    assert!(
        !readable(fd, 20),
        "the notify fd woke for a SEND a byte announced"
    );
    assert_eq!(poll_n(&mut d.y, 3, T).len(), 3);
    assert_eq!(d.bytes(), 1);

    // The reader took its byte: the next SEND writes one.
    clear();
    d.x.post_send(&d.solicited(3)).unwrap();
    d.x.post_send(&d.solicited(4)).unwrap();
    assert_eq!(d.a.direct_wakeups_sent(), sent + 2);
    assert_eq!(d.bytes(), 1);
    assert_eq!(poll_n(&mut d.y, 2, T).len(), 2);

    // A byte per SEND again.
    d.y.set_direct_level(false);
    d.x.post_send(&d.solicited(5)).unwrap();
    d.x.post_send(&d.solicited(6)).unwrap();
    assert_eq!(d.a.direct_wakeups_sent(), sent + 4);
    assert_eq!(d.bytes(), 2);
    assert_eq!(poll_n(&mut d.y, 2, T).len(), 2);
    assert_eq!(poll_n(&mut d.x, 7, T).len(), 7);
}

#[test]
fn many_connections() {
    let a = prov();
    let b = prov();
    let mut l = b.listen(localhost(0), 1024, QpCaps::default()).unwrap();
    let port = l.local_addr().port();
    let n = 200;
    let mut xs: Vec<ShmEndpoint> = (0..n)
        .map(|i| {
            a.connect(localhost(port), None, QpCaps::default(), &[i as u8])
                .unwrap()
        })
        .collect();
    let mut ys: Vec<Option<ShmEndpoint>> = (0..n).map(|_| None).collect();
    let mut got = 0;
    let end = Instant::now() + Duration::from_secs(20);
    while got < n {
        if let Some((mut y, pd)) = l.poll_request() {
            y.accept(&pd).unwrap();
            ys[pd[0] as usize] = Some(y);
            got += 1;
        } else {
            assert!(Instant::now() < end, "only {got} requests");
            std::thread::yield_now();
        }
    }
    let mut ys: Vec<ShmEndpoint> = ys.into_iter().map(Option::unwrap).collect();
    for (i, x) in xs.iter_mut().enumerate() {
        assert_eq!(
            wait_cm(x, T),
            Some(CmEvent::Established {
                private_data: vec![i as u8]
            })
        );
    }
    let ra = a.reg_mr(n * 8, Access::LOCAL_WRITE).unwrap();
    let rb = b.reg_mr(n * 8, Access::LOCAL_WRITE).unwrap();
    let mut sa = a.reg_mr(n * 8, Access::empty()).unwrap();
    let mut sb = b.reg_mr(n * 8, Access::empty()).unwrap();
    for i in 0..n {
        sa.write(i * 8, &(i as u64).to_le_bytes());
        sb.write(i * 8, &(1000 + i as u64).to_le_bytes());
        xs[i]
            .post_recv(&RecvWr {
                wr_id: i as u64,
                sge: ra.sge(i * 8, 8),
            })
            .unwrap();
        ys[i]
            .post_recv(&RecvWr {
                wr_id: i as u64,
                sge: rb.sge(i * 8, 8),
            })
            .unwrap();
    }
    for i in 0..n {
        xs[i]
            .post_send(&send_wr(i as u64, SendOp::Send, Some(sa.sge(i * 8, 8))))
            .unwrap();
        ys[i]
            .post_send(&send_wr(i as u64, SendOp::Send, Some(sb.sge(i * 8, 8))))
            .unwrap();
    }
    for i in 0..n {
        assert!(
            wait_cm(&mut ys[i], Duration::ZERO)
                == Some(CmEvent::Established {
                    private_data: vec![]
                })
        );
        assert_eq!(poll_n(&mut xs[i], 2, T).len(), 2);
        assert_eq!(poll_n(&mut ys[i], 2, T).len(), 2);
        let mut v = [0u8; 8];
        ra.read(i * 8, &mut v);
        assert_eq!(u64::from_le_bytes(v), 1000 + i as u64);
        rb.read(i * 8, &mut v);
        assert_eq!(u64::from_le_bytes(v), i as u64);
    }
}

/// The entry point of child processes spawned by the tests below (a no-op in a normal run).
#[test]
fn child_entry() {
    let Ok(what) = std::env::var("SDP_SHM_CHILD") else {
        return;
    };
    if let Some(addr) = what.strip_prefix("victim:") {
        victim(u64::from_str_radix(addr, 16).unwrap());
        return;
    }
    let (mode, port) = what.split_once(':').unwrap();
    let port: u16 = port.parse().unwrap();
    let a = prov();
    let mut x = a
        .connect(localhost(port), None, QpCaps::default(), b"child")
        .unwrap();
    let ev = wait_cm(&mut x, T);
    match mode {
        "hold-big" => {
            // A 64 KiB receive: a SEND into it is copied by process_vm_writev.
            let r = a.reg_mr(64 << 10, Access::LOCAL_WRITE).unwrap();
            x.post_recv(&RecvWr {
                wr_id: 1,
                sge: r.sge(0, 64 << 10),
            })
            .unwrap();
            println!("CHILD {ev:?} addr={:x}", r.addr());
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        "hold" => {
            let r = a.reg_mr(64, Access::LOCAL_WRITE).unwrap();
            x.post_recv(&RecvWr {
                wr_id: 1,
                sge: r.sge(0, 64),
            })
            .unwrap();
            println!("CHILD {ev:?}");
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        _ => match ev {
            Some(CmEvent::Rejected {
                private_data,
                consumer,
            }) => {
                println!(
                    "CHILD rejected consumer={consumer} reason={}",
                    String::from_utf8_lossy(&private_data)
                );
            }
            other => println!("CHILD {other:?}"),
        },
    }
}

/// A process that maps 64 KiB of zeros at `addr`, says so, and after a line on stdin tells
/// whether anything wrote there (the pid-reuse test's bystander).
fn victim(addr: u64) {
    use std::io::BufRead;
    let len = 64 << 10;
    // SAFETY: a fresh private mapping at an address nothing of ours uses (NOREPLACE fails
    // otherwise).
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if p as u64 != addr {
        println!("VICTIM busy");
        return;
    }
    println!("VICTIM ready");
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    // SAFETY: the mapping above, `len` bytes.
    let mem = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
    if mem.iter().all(|&b| b == 0) {
        println!("VICTIM clean");
    } else {
        println!("VICTIM dirty");
    }
}

/// The child's next line that starts with `prefix` (the harness prints its own lines too).
fn child_line(out: &mut impl std::io::BufRead, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child ended early");
        // The harness's "test child_entry ... " may precede it on the same line.
        if let Some(i) = line.find(prefix) {
            return line[i..].to_string();
        }
    }
}

fn spawn_child(mode: &str, port: u16, uid: Option<u32>) -> std::process::Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("SDP_SHM_CHILD", format!("{mode}:{port}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(uid) = uid {
        use std::os::unix::process::CommandExt;
        c.uid(uid).gid(uid);
    }
    c.spawn().expect("spawn child")
}

#[test]
fn peer_killed_is_noticed() {
    use std::io::BufRead;
    let b = prov();
    let mut l = b.listen(localhost(0), 8, QpCaps::default()).unwrap();
    let port = l.local_addr().port();
    let mut child = spawn_child("hold", port, None);
    let (mut y, pd) = wait_request(&mut l);
    assert_eq!(pd, b"child");
    assert_eq!(y.peer_pid(), child.id() as i32);
    y.accept(b"ok").unwrap();
    let r = b.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    y.post_recv(&RecvWr {
        wr_id: 3,
        sge: r.sge(0, 64),
    })
    .unwrap();
    let mut line = String::new();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    // Skip the harness's own lines until the child's.
    while !line.contains("CHILD") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child ended early");
    }
    assert!(line.contains("Established"), "{line}");
    assert_eq!(
        wait_cm(&mut y, T),
        Some(CmEvent::Established {
            private_data: vec![]
        })
    );
    // Sleep on the notify fd like a progress loop would.
    let fd = b.notify_fd().unwrap();
    b.arm().unwrap();
    assert_eq!(y.poll_cm(), None);
    child.kill().unwrap();
    let t0 = Instant::now();
    assert!(readable(fd, 3000), "no wakeup on the peer's death");
    b.arm().unwrap();
    assert_eq!(
        wait_cm(&mut y, Duration::from_secs(3)),
        Some(CmEvent::Disconnected)
    );
    assert!(t0.elapsed() < Duration::from_secs(3));
    let c = poll_n(&mut y, 1, T);
    assert_eq!((c[0].wr_id, c[0].status), (3, WcStatus::Flushed));
    let _ = child.wait();
}

/// A peer killed and reaped, its pid handed to another process of the same user before we
/// noticed the death: a SEND posted to the dead peer must not be written into that process
/// (every copy is tied to the connected process by a pidfd). Needs root (ns_last_pid):
/// `tests/run-all` runs it when it runs as root, as CI does.
#[test]
#[ignore = "needs root: chooses the next pid (tests/run-all runs it as root)"]
fn dead_peers_reused_pid_is_not_written() {
    use std::io::{BufReader, Write};
    assert!(
        std::fs::OpenOptions::new()
            .write(true)
            .open("/proc/sys/kernel/ns_last_pid")
            .is_ok(),
        "needs root to choose the next pid (ns_last_pid)"
    );
    let b = prov();
    let mut l = b.listen(localhost(0), 8, QpCaps::default()).unwrap();
    let port = l.local_addr().port();
    let mut child = spawn_child("hold-big", port, None);
    let (mut y, _) = wait_request(&mut l);
    y.accept(b"ok").unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let line = child_line(&mut out, "CHILD");
    assert!(line.contains("Established"), "{line}");
    let addr = line.trim().rsplit_once("addr=").unwrap().1.to_string();
    assert_eq!(
        wait_cm(&mut y, T),
        Some(CmEvent::Established {
            private_data: vec![]
        })
    );
    let pid = child.id() as i32;
    child.kill().unwrap();
    child.wait().unwrap();
    // The same pid for a bystander that maps memory where the dead peer's receive was.
    let mut victim = None;
    for _ in 0..200 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", format!("{}", pid - 1)).unwrap();
        let mut v = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("SDP_SHM_CHILD", format!("victim:{addr}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if v.id() as i32 == pid {
            let mut vout = BufReader::new(v.stdout.take().unwrap());
            if child_line(&mut vout, "VICTIM").starts_with("VICTIM ready") {
                victim = Some((v, vout));
                break;
            }
        }
        let _ = v.kill();
        let _ = v.wait();
    }
    let (mut v, mut vout) = victim.expect("could not give the dead peer's pid to a bystander");
    // We have not looked at the connection since the death: post a SEND to the dead peer,
    // one too large for the peer's inline ring (a copy into its memfd, never into a pid's
    // memory), so it goes by process_vm_writev into the receive.
    let len = sdp_core::verbs::shm::RING_MSG_MAX + 4096;
    let src = b.reg_mr(len, Access::empty()).unwrap();
    let mut pattern = vec![0x5au8; len];
    pattern[0] = 1;
    let mut src = src;
    src.write(0, &pattern);
    y.post_send(&send_wr(9, SendOp::Send, Some(src.sge(0, len as u32))))
        .unwrap();
    let c = poll_n(&mut y, 1, T);
    writeln!(v.stdin.as_mut().unwrap()).unwrap();
    let verdict = child_line(&mut vout, "VICTIM");
    let _ = v.kill();
    let _ = v.wait();
    assert_eq!(
        verdict.trim(),
        "VICTIM clean",
        "the SEND landed in another process"
    );
    // The peer is gone (ESRCH, or its pidfd says so): the queue pair fails as when a peer
    // closes, the SEND flushed and a Disconnected for the engine (a reset, as TCP gives for a
    // killed process), not a retry timeout.
    assert_eq!((c[0].wr_id, c[0].status), (9, WcStatus::Flushed));
    assert_eq!(wait_cm(&mut y, T), Some(CmEvent::Disconnected));
}

/// Needs root (the child runs as uid 65534): `tests/run-all` runs it when it runs as root, as
/// CI does; by hand: `cargo test -p sdp-core --test shm_provider -- --ignored`.
#[test]
#[ignore = "needs root: runs a child as another user (tests/run-all runs it as root)"]
fn other_uid_is_refused() {
    use std::io::Read;
    // SAFETY: getuid has no preconditions.
    assert_eq!(
        unsafe { libc::getuid() },
        0,
        "needs root to run a child as nobody"
    );
    let b = prov();
    let mut l = b.listen(localhost(0), 8, QpCaps::default()).unwrap();
    let port = l.local_addr().port();
    let mut child = spawn_child("once", port, Some(65534));
    let end = Instant::now() + T;
    loop {
        assert!(
            l.poll_request().is_none(),
            "another user's request was offered"
        );
        if child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(Instant::now() < end, "child hangs");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(
        out.contains(
            "CHILD rejected consumer=true reason=SDP shm: the listener runs as another user"
        ),
        "child said: {out}"
    );
    // Let the listener see the connection, if it has not yet.
    let end = Instant::now() + T;
    while b.refused_uid_count() == 0 && Instant::now() < end {
        assert!(l.poll_request().is_none());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(b.refused_uid_count(), 1);
}

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use sdp_core::driver::{Driver, ListenerId};
use sdp_core::harness::stream::{App, Mode};
use sdp_core::proto::table::ConnId;
use sdp_core::proto::Config;

/// One side of an engine transfer on its own thread, with a real clock and the notify-fd
/// waiting protocol when nothing moves.
fn drive_side(
    d: &mut Driver<ShmProvider>,
    l: Option<ListenerId>,
    mut id: Option<ConnId>,
    app: &mut App<ShmProvider>,
    done: &AtomicUsize,
) {
    let t0 = Instant::now();
    let clock = || sdp_core::proto::Instant(t0.elapsed().as_nanos() as u64);
    let mut finished = false;
    let mut idle = 0u32;
    let end = Instant::now() + Duration::from_secs(240);
    loop {
        let now = clock();
        d.poll(now);
        if id.is_none() {
            id = l.and_then(|l| d.accept(l));
        }
        let before = (app.sent, app.received);
        if let Some(id) = id {
            app.pump(d, now, id);
            assert!(app.errors.is_empty(), "calls failed: {:?}", app.errors);
            if let Some(e) = app.events.iter().find_map(|e| match e {
                sdp_core::proto::Event::Closed(Some(err)) => Some(err.clone()),
                _ => None,
            }) {
                panic!("connection failed: {e:?}");
            }
        }
        if !finished && app.eof && app.done_sending() {
            finished = true;
            done.fetch_add(1, Ordering::SeqCst);
        }
        if done.load(Ordering::SeqCst) == 2 {
            return;
        }
        assert!(
            Instant::now() < end,
            "transfer stalled: sent {} received {}",
            app.sent,
            app.received
        );
        if (app.sent, app.received) == before {
            idle += 1;
        } else {
            idle = 0;
        }
        if idle > 64 {
            idle = 0;
            d.provider().arm().unwrap();
            d.poll(clock());
            if let Some(id) = id {
                app.pump(d, clock(), id);
            }
            if (app.sent, app.received) == before {
                d.provider().wait(1);
            }
        }
    }
}

fn engine_transfer(mode: Mode, bytes: u64, max_msg: usize) {
    let cfg = Config::default();
    let done = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let done_b = done.clone();
    let cfg_b = cfg.clone();
    let hb = std::thread::spawn(move || {
        let mut d = Driver::new(prov(), cfg_b);
        let l = d.listen(localhost(0), 16).unwrap();
        tx.send(d.listener_addr(l).unwrap().port()).unwrap();
        let mut app = App::builder(mode)
            .sends(bytes)
            .max_msg(max_msg)
            .tx_seed(2)
            .rx_seed(1)
            .build();
        drive_side(&mut d, Some(l), None, &mut app, &done_b);
        (app.sent, app.received)
    });
    let port = rx.recv().unwrap();
    let mut d = Driver::new(prov(), cfg);
    let id = d
        .connect(sdp_core::proto::Instant(0), localhost(port), None)
        .unwrap();
    let mut app = App::builder(mode)
        .sends(bytes)
        .max_msg(max_msg)
        .tx_seed(1)
        .rx_seed(2)
        .build();
    drive_side(&mut d, None, Some(id), &mut app, &done);
    let (bs, br) = hb.join().unwrap();
    assert_eq!(
        (app.sent, app.received, bs, br),
        (bytes, bytes, bytes, bytes)
    );
}

#[test]
fn engine_bcopy_64mib_both_ways() {
    engine_transfer(Mode::BCopy, 64 << 20, 256 * 1024);
}

#[test]
fn engine_zcopy_64mib_both_ways() {
    engine_transfer(Mode::Both, 64 << 20, 1 << 20);
}

/// SENDs that gather a payload after a header from another registration: small (inline) and
/// large (copied into the peer) messages arrive as header + payload; a payload outside any
/// registration fails the send with a local protection error.
#[test]
fn gathered_sends_arrive_whole() {
    let a = prov();
    let b = prov();
    let (mut x, mut y) = pair(&a, &b);
    let mut hdr = a.reg_mr(16, Access::empty()).unwrap();
    hdr.write(0, b"0123456789abcdef");
    let mut body = a.reg_mr(300_000, Access::empty()).unwrap();
    fill(&mut body, 9);
    let sizes = [10usize, 200, 70_000, 299_000];
    let mut rbufs = Vec::new();
    for i in 0..sizes.len() {
        let mr = b.reg_mr(1 << 20, Access::LOCAL_WRITE).unwrap();
        y.post_recv(&RecvWr {
            wr_id: 100 + i as u64,
            sge: mr.sge(0, 1 << 20),
        })
        .unwrap();
        rbufs.push(mr);
    }
    for (i, &n) in sizes.iter().enumerate() {
        let wr = SendWr {
            payload: Some(body.sge(i, n as u32)),
            ..send_wr(i as u64, SendOp::Send, Some(hdr.sge(0, 16)))
        };
        x.post_send(&wr).unwrap();
    }
    let sc = poll_n(&mut x, sizes.len(), T);
    let rc = poll_n(&mut y, sizes.len(), T);
    assert_eq!((sc.len(), rc.len()), (sizes.len(), sizes.len()));
    for (i, &n) in sizes.iter().enumerate() {
        assert_eq!(
            (sc[i].status, sc[i].byte_len),
            (WcStatus::Success, 16 + n as u32)
        );
        assert_eq!(
            (rc[i].status, rc[i].byte_len),
            (WcStatus::Success, 16 + n as u32)
        );
        let mut want = b"0123456789abcdef".to_vec();
        let mut p = vec![0u8; n];
        body.read(i, &mut p);
        want.extend_from_slice(&p);
        let mut got = vec![0u8; 16 + n];
        rbufs[i].read(0, &mut got);
        assert!(got == want, "message {i} differs");
    }
    // A payload SGE that names no registration.
    let mut bad = body.sge(0, 64);
    bad.lkey ^= 0x5a5a;
    y.post_recv(&RecvWr {
        wr_id: 200,
        sge: rbufs[0].sge(0, 1 << 20),
    })
    .unwrap();
    x.post_send(&SendWr {
        payload: Some(bad),
        ..send_wr(50, SendOp::Send, Some(hdr.sge(0, 16)))
    })
    .unwrap();
    let c = poll_n(&mut x, 1, T);
    assert_eq!(c[0].status, WcStatus::LocalProtection);
}

/// A connector that exits right after its handshake, before the acceptor looked at its RTU
/// (its memory, which the acceptor's probe reads, is gone): the acceptor sees the connection
/// established, then closed by the peer, as TCP hands such a connection to accept with its
/// data and EOF; not a failed setup (which left the application's accept waiting forever).
#[test]
fn connector_gone_before_its_rtu_is_looked_at_is_established_then_closed() {
    use std::io::BufReader;
    let b = prov();
    let mut l = b.listen(localhost(0), 8, QpCaps::default()).unwrap();
    let port = l.local_addr().port();
    let mut child = spawn_child("once", port, None);
    let (mut y, _) = wait_request(&mut l);
    y.accept(b"ok").unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let line = child_line(&mut out, "CHILD");
    assert!(line.contains("Established"), "{line}");
    assert!(child.wait().unwrap().success());
    assert_eq!(
        wait_cm(&mut y, T),
        Some(CmEvent::Established {
            private_data: vec![]
        })
    );
    assert_eq!(wait_cm(&mut y, T), Some(CmEvent::Disconnected));
}

/// Poll until the endpoint reports quiet (nothing left to look at); false if it never does.
fn settle(ep: &mut ShmEndpoint) -> bool {
    let end = Instant::now() + T;
    let mut buf = wc_buf();
    while Instant::now() < end {
        while ep.poll_cq(&mut buf) > 0 {}
        while ep.poll_cm().is_some() {}
        if ep.quiet() {
            return true;
        }
        std::thread::yield_now();
    }
    false
}

/// `quiet` (a round of progress passes the endpoint by) holds only while nothing happened:
/// each thing the peer does (posting receives, a SEND, a disconnect) and each completion of our
/// own ends it until we polled.
#[test]
fn quiet_until_the_peer_or_a_completion_says_otherwise() {
    let a = prov();
    let b = prov();
    let (mut x, mut y) = pair(&a, &b);
    assert!(settle(&mut x) && settle(&mut y), "a fresh pair settles");

    let rmr = b.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    y.post_recv(&RecvWr {
        wr_id: 7,
        sge: rmr.sge(0, 4096),
    })
    .unwrap();
    assert!(!x.quiet(), "the peer posted a receive");
    assert!(settle(&mut x));

    let mut smr = a.reg_mr(1000, Access::empty()).unwrap();
    fill(&mut smr, 3);
    x.post_send(&send_wr(1, SendOp::Send, Some(smr.sge(0, 1000))))
        .unwrap();
    assert!(!x.quiet(), "our SEND's completion is to be polled");
    assert!(!y.quiet(), "the peer's SEND landed");
    let rc = poll_n(&mut y, 1, T);
    assert_eq!((rc[0].wr_id, rc[0].byte_len), (7, 1000));
    let sc = poll_n(&mut x, 1, T);
    assert_eq!((sc[0].wr_id, sc[0].status), (1, WcStatus::Success));
    assert!(settle(&mut x) && settle(&mut y));

    x.disconnect().unwrap();
    assert!(!y.quiet(), "the peer disconnected");
    assert_eq!(wait_cm(&mut y, T), Some(CmEvent::Disconnected));
}

/// Letting a region go looks only at the inboxes that can matter: the endpoint that posted
/// receives in it (a receive buffer), none for a region no peer copies (no RDMA copy under
/// way). It used to read every connection's inbox for every region, which a server with two
/// thousand connections spent 30% of its time on.
#[test]
fn a_deregistration_looks_only_at_the_inboxes_that_can_matter() {
    let (a, b) = (prov(), prov());
    let mut l = b.listen(localhost(0), 64, QpCaps::default()).unwrap();
    let port = l.local_addr().port();
    let mut eps: Vec<_> = (0..8).map(|_| pair_on(&a, &mut l, port)).collect();
    // A receive buffer one endpoint posted: its inbox only.
    let mr = b.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    eps[3]
        .1
        .post_recv(&RecvWr {
            wr_id: 1,
            sge: Sge {
                addr: mr.addr(),
                len: 4096,
                lkey: mr.lkey(),
            },
        })
        .unwrap();
    let before = b.inboxes_drained();
    drop(mr);
    assert_eq!(
        b.inboxes_drained() - before,
        1,
        "inboxes looked at for a posted receive buffer"
    );
    // A region peers may read, with no RDMA copy under way: none.
    let mr = b.reg_mr(4096, Access::REMOTE_READ).unwrap();
    let before = b.inboxes_drained();
    drop(mr);
    assert_eq!(
        b.inboxes_drained() - before,
        0,
        "inboxes looked at for an unused region"
    );
}

/// Inline payloads (`post_send_inline`, verbs' IBV_SEND_INLINE): the caller's bytes, not
/// registered, gathered after a registered header into one message. The provider is done with
/// them when the post returns: bytes overwritten right after arrive as they were at the post,
/// whether the SEND went at once (slot, ring or cross-process copy) or had to wait for a
/// receive (then it went from the provider's own copy). A payload that does not match its
/// request is refused.
#[test]
fn inline_payloads_are_taken_at_the_post() {
    let a = prov();
    let b = prov();
    let (mut x, mut y) = pair(&a, &b);
    assert!(x.inline_max() >= 1 << 20);
    let mut hdr = a.reg_mr(16, Access::empty()).unwrap();
    hdr.write(0, b"header-16-bytes!");
    let inline_wr = |id: u64, n: usize| SendWr {
        payload: Some(Sge {
            addr: 0,
            len: n as u32,
            lkey: INLINE_LKEY,
        }),
        ..send_wr(id, SendOp::Send, Some(hdr.sge(0, 16)))
    };
    let pattern = |n: usize, seed: u8| -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect()
    };
    // In the slot, in the ring, by cross-process copy; then three more with no receive posted.
    let sizes = [100usize, 8000, 200_000, 100, 8000, 200_000];
    let mut rbufs = Vec::new();
    let mut post_recvs = |y: &mut ShmEndpoint, ids: std::ops::Range<u64>| {
        for i in ids {
            let mr = b.reg_mr(1 << 20, Access::LOCAL_WRITE).unwrap();
            y.post_recv(&RecvWr {
                wr_id: 100 + i,
                sge: mr.sge(0, 1 << 20),
            })
            .unwrap();
            rbufs.push(mr);
        }
    };
    post_recvs(&mut y, 0..3);
    let mut sent = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let mut bytes = pattern(n, i as u8);
        x.post_send_inline(&inline_wr(i as u64, n), &bytes).unwrap();
        sent.push(bytes.clone());
        // The caller's buffer is its own again at once.
        bytes.fill(0xee);
    }
    // The first three completed in the post; the rest wait for receives.
    let sc = poll_n(&mut x, 3, T);
    assert_eq!(sc.len(), 3, "{sc:?}");
    assert!(poll_n(&mut x, 1, Duration::from_millis(50)).is_empty());
    post_recvs(&mut y, 3..6);
    let sc2 = poll_n(&mut x, 3, T);
    for (i, c) in sc.iter().chain(&sc2).enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.byte_len),
            (i as u64, WcStatus::Success, 16 + sizes[i] as u32)
        );
    }
    let rc = poll_n(&mut y, 6, T);
    assert_eq!(rc.len(), 6);
    for (i, c) in rc.iter().enumerate() {
        assert_eq!((c.wr_id, c.status), (100 + i as u64, WcStatus::Success));
        let mut got = vec![0u8; 16 + sizes[i]];
        rbufs[i].read(0, &mut got);
        assert_eq!(&got[..16], b"header-16-bytes!");
        assert!(got[16..] == sent[i][..], "payload {i} differs");
    }
    // Refused: a length that does not match, a registered payload.
    let bytes = pattern(10, 0);
    assert!(x.post_send_inline(&inline_wr(9, 11), &bytes).is_err());
    let plain = send_wr(9, SendOp::Send, Some(hdr.sge(0, 16)));
    assert!(x.post_send_inline(&plain, &bytes).is_err());
}
