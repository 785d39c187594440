//! Malformed and out-of-place peer messages: each ends that one connection with AbortConn and
//! a clear protocol error; the sender sees a reset; another connection between the same hosts
//! keeps working.

use std::net::SocketAddr;

use sdp_core::proto::conn::CallError;
use sdp_core::proto::msgs::{Mid, WireError};
use sdp_core::proto::table::ConnId;
use sdp_core::proto::ProtocolError::{self, Wire};
use sdp_core::proto::{Config, ConnError, State};
use sdp_core::socket::Errno;
use sdp_core::verbs::WcStatus;
use sdp_tests::pair::{Pair, A_IP, B_IP, PORT};

const SEC: u64 = 1_000_000_000;

/// Keep the BSDH's credit fields, replace mid and extended header (len fixed up).
fn rewrite(mid: u8, ext: &[u8]) -> impl FnMut(&mut Vec<u8>) + Send + 'static {
    let ext = ext.to_vec();
    move |v: &mut Vec<u8>| {
        v.truncate(16);
        v[0] = mid;
        v.extend_from_slice(&ext);
        let len = v.len() as u32;
        v[4..8].copy_from_slice(&len.to_be_bytes());
    }
}

fn second_conn(p: &mut Pair) -> (ConnId, ConnId) {
    let now = p.now();
    let a = p.a.connect(now, SocketAddr::new(B_IP, PORT), None).unwrap();
    let mut b = None;
    let l = p.listener;
    assert!(p.run_until(SEC, |p| {
        b = b.or_else(|| p.b.accept(l));
        b.is_some() && p.a.conn(a).unwrap().state() == State::Established
    }));
    (a, b.unwrap())
}

/// Corrupt the next message A sends on connection 1 with `f`; check the outcome.
fn check_abort(
    seed: u64,
    f: impl FnMut(&mut Vec<u8>) + Send + 'static,
    want: fn(&ConnError) -> bool,
) {
    let mut p = Pair::new(seed, Config::default());
    let (a1, b1) = p.connect();
    let (a2, b2) = second_conn(&mut p);
    p.fabric.faults().corrupt_next_send(A_IP, f);
    let now = p.now();
    p.a.write(now, a1, b"this message gets mangled").unwrap();
    let ok = p.run_until(5 * SEC, |p| {
        p.b.conn(b1).unwrap().state() == State::Closed
            && p.a.conn(a1).unwrap().state() == State::Closed
    });
    assert!(ok, "B: {}", p.b.conn(b1).unwrap().debug_state());
    let eb = p.b.conn(b1).unwrap().error().cloned().unwrap();
    assert!(want(&eb), "B's error: {eb:?}");
    if matches!(eb, ConnError::Protocol(_)) {
        assert_eq!(CallError::Conn(eb.clone()).errno(), 71, "EPROTO");
    }
    let ea = p.a.conn(a1).unwrap().error().cloned().unwrap();
    assert_eq!(ea, ConnError::Reset, "A sees a reset");
    // The other connection is untouched.
    let now = p.now();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let mut off = 0;
    let mut got_b = Vec::new();
    let mut got_a = Vec::new();
    assert_eq!(p.b.write(now, b2, b"pong").unwrap(), 4);
    let ok = p.run_until(5 * SEC, |p| {
        let now = p.now();
        if off < data.len() {
            if let Ok(n) = p.a.write(now, a2, &data[off..]) {
                off += n;
            }
        }
        let mut buf = [0u8; 8192];
        while let Ok(n) = p.b.read(now, b2, &mut buf) {
            if n == 0 {
                break;
            }
            got_b.extend_from_slice(&buf[..n]);
        }
        while let Ok(n) = p.a.read(now, a2, &mut buf) {
            if n == 0 {
                break;
            }
            got_a.extend_from_slice(&buf[..n]);
        }
        got_b.len() == data.len() && got_a.len() == 4
    });
    assert!(ok);
    assert_eq!(got_b, data);
    assert_eq!(got_a, b"pong");
}

/// The peer's message is valid but not allowed in this state: `Unexpected` naming its mid.
fn unexpected(e: &ConnError, want: Mid) -> bool {
    matches!(e, ConnError::Protocol(ProtocolError::Unexpected { mid, .. }) if *mid == want)
}

#[test]
fn unknown_mid() {
    check_abort(
        30,
        |v| v[0] = 0x42,
        |e| matches!(e, ConnError::Protocol(Wire(WireError::UnknownMid(0x42)))),
    );
}

#[test]
fn reserved_flag_bits() {
    check_abort(
        31,
        |v| v[1] |= 0x80,
        |e| matches!(e, ConnError::Protocol(Wire(WireError::ReservedFlags(f))) if f & 0x80 != 0),
    );
}

#[test]
fn length_field_mismatch() {
    check_abort(
        32,
        |v| {
            let l = u32::from_be_bytes([v[4], v[5], v[6], v[7]]) + 3;
            v[4..8].copy_from_slice(&l.to_be_bytes());
        },
        |e| {
            matches!(e, ConnError::Protocol(Wire(WireError::LengthMismatch { claimed, actual }))
                if *claimed as usize == actual + 3)
        },
    );
}

#[test]
fn truncated_header() {
    check_abort(
        33,
        |v| v.truncate(9),
        |e| {
            matches!(
                e,
                ConnError::Protocol(Wire(WireError::Truncated { need: 16, have: 9 }))
            )
        },
    );
}

#[test]
fn sequence_gap() {
    check_abort(
        34,
        |v| {
            let m = u32::from_be_bytes([v[8], v[9], v[10], v[11]]) + 5;
            v[8..12].copy_from_slice(&m.to_be_bytes());
        },
        |e| {
            matches!(e, ConnError::Protocol(ProtocolError::Sequence { got, want })
                if *got == want + 5)
        },
    );
}

#[test]
fn ack_of_messages_never_sent() {
    check_abort(
        35,
        |v| v[12..16].copy_from_slice(&0x4000_0000u32.to_be_bytes()),
        |e| {
            matches!(
                e,
                ConnError::Protocol(ProtocolError::BadAck {
                    mseq_ack: 0x4000_0000
                })
            )
        },
    );
}

#[test]
fn payload_on_a_control_message() {
    check_abort(
        36,
        |v| v[0] = 0x02,
        |e| {
            matches!(
                e,
                ConnError::Protocol(Wire(WireError::UnexpectedPayload {
                    mid: Mid::DisConn,
                    ..
                }))
            )
        },
    );
}

#[test]
fn hello_on_an_established_connection() {
    check_abort(
        37,
        rewrite(
            0x00,
            &[0x22, 4, 8, 0, 0, 0, 0x80, 0, 0, 0, 0x80, 0, 0, 80, 0, 0],
        ),
        |e| unexpected(e, Mid::Hello),
    );
}

#[test]
fn rdma_rd_compl_without_src_avail() {
    check_abort(38, rewrite(0x06, &100u32.to_be_bytes()), |e| {
        unexpected(e, Mid::RdmaRdCompl)
    });
}

#[test]
fn rdma_wr_compl_without_sink_avail() {
    check_abort(39, rewrite(0x05, &100u32.to_be_bytes()), |e| {
        unexpected(e, Mid::RdmaWrCompl)
    });
}

#[test]
fn sink_cancel_ack_without_cancel() {
    check_abort(40, rewrite(0x0A, &[]), |e| {
        unexpected(e, Mid::SinkCancelAck)
    });
}

#[test]
fn resize_ack_without_request() {
    check_abort(41, rewrite(0x0C, &65536u32.to_be_bytes()), |e| {
        unexpected(e, Mid::ChRcvBufAck)
    });
}

#[test]
fn unsupported_mode_change() {
    check_abort(42, rewrite(0x07, &[1, 0, 0, 0]), |e| {
        unexpected(e, Mid::ModeChange)
    });
}

#[test]
fn src_avail_with_zero_length() {
    let mut ext = vec![0u8; 16];
    ext[4..8].copy_from_slice(&7u32.to_be_bytes());
    check_abort(43, rewrite(0xFE, &ext), |e| {
        matches!(
            e,
            ConnError::Protocol(Wire(WireError::OutOfRange {
                field: "SrcAvail.len",
                value: 0
            }))
        )
    });
}

#[test]
fn src_avail_naming_memory_never_registered_fails_the_read() {
    // A valid-looking SrcAvail whose rkey the peer never registered: our RDMA Read is refused
    // by the (simulated) HCA, so the connection fails; nothing is read.
    let mut ext = Vec::new();
    ext.extend_from_slice(&4096u32.to_be_bytes());
    ext.extend_from_slice(&0xdead_beefu32.to_be_bytes());
    ext.extend_from_slice(&0x1000_0000u64.to_be_bytes());
    let mut p = Pair::new(44, Config::default());
    let (a1, b1) = p.connect();
    p.fabric
        .faults()
        .corrupt_next_send(A_IP, rewrite(0xFE, &ext));
    let now = p.now();
    p.a.write(now, a1, b"x").unwrap();
    p.run_for(SEC / 10);
    let now = p.now();
    let mut buf = [0u8; 16];
    let _ = p.b.read(now, b1, &mut buf);
    let ok = p.run_until(5 * SEC, |p| p.b.conn(b1).unwrap().state() == State::Closed);
    assert!(ok);
    let e = p.b.conn(b1).unwrap().error().cloned().unwrap();
    assert_eq!(e, ConnError::Transport(WcStatus::RemoteAccess));
    assert_eq!(p.b.conn(b1).unwrap().stats().zcopy_read_bytes, 0);
}

#[test]
fn garbage_hello_is_rejected_and_the_listener_keeps_serving() {
    use sdp_core::verbs::{Endpoint, Provider, QpCaps};
    let mut p = Pair::new(45, Config::default());
    let prov = p.fabric.provider(A_IP);
    let mut ep = prov
        .connect(
            SocketAddr::new(B_IP, PORT),
            None,
            QpCaps::default(),
            b"GET / HTTP/1.1\r\n",
        )
        .unwrap();
    let mut ev = None;
    p.run_until(SEC, |_| {
        ev = ev.take().or_else(|| ep.poll_cm());
        ev.is_some()
    });
    match ev {
        Some(sdp_core::verbs::CmEvent::Rejected {
            consumer: true,
            private_data,
        }) => {
            let why = String::from_utf8_lossy(&private_data).into_owned();
            assert!(why.starts_with("SDP:"), "{why}");
        }
        other => panic!("expected a reject, got {other:?}"),
    }
    assert_eq!(p.b.refused(p.listener).len(), 1);
    // A well-formed client still gets in.
    let (a, b) = p.connect();
    let now = p.now();
    p.a.write(now, a, b"ok").unwrap();
    p.run_for(SEC / 10);
    let now = p.now();
    let mut buf = [0u8; 4];
    assert_eq!(p.b.read(now, b, &mut buf), Ok(2));
}

/// Random well-formed-looking and random garbage messages, hundreds of them, into an
/// established connection: the engine never panics, and ends either still established or
/// closed with an error; the connection next to it is never disturbed.
#[test]
fn random_messages_never_crash_the_engine() {
    use rand::{Rng, SeedableRng};
    use sdp_core::proto::msgs::{BsdhFlags, Ext, Header, Mid};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(46);
    let mut aborted = 0;
    for round in 0..400u64 {
        let mut p = Pair::new(1000 + round, Config::default());
        let (a1, b1) = p.connect();
        let (a2, b2) = second_conn(&mut p);
        let garbage = rng.random_bool(0.3);
        let mid = Mid::ALL[rng.random_range(0..Mid::ALL.len())];
        let r = |rng: &mut rand_chacha::ChaCha8Rng| -> u32 {
            if rng.random_bool(0.5) {
                rng.random_range(0..70_000)
            } else {
                rng.random()
            }
        };
        let ext = match mid {
            Mid::SrcAvail => Ext::SrcAvail {
                len: r(&mut rng).max(1),
                rkey: r(&mut rng),
                vaddr: rng.random(),
            },
            Mid::SinkAvail => Ext::SinkAvail {
                len: r(&mut rng).max(1),
                rkey: r(&mut rng),
                vaddr: rng.random(),
                non_disc: 0,
            },
            Mid::RdmaRdCompl => Ext::RdmaRdCompl {
                len: r(&mut rng).max(1),
            },
            Mid::RdmaWrCompl => Ext::RdmaWrCompl {
                len: r(&mut rng).max(1),
            },
            Mid::ChRcvBuf => Ext::ChRcvBuf {
                size: rng.random_range(1024..=1 << 20),
            },
            Mid::ChRcvBufAck => Ext::ChRcvBufAck {
                size: rng.random_range(1024..=1 << 20),
            },
            Mid::SuspComm => Ext::SuspComm {
                service_id: rng.random(),
            },
            Mid::ModeChange => Ext::ModeChange { flags: 0 },
            _ => Ext::None,
        };
        let noise: Vec<u8> = (0..rng.random_range(0..64)).map(|_| rng.random()).collect();
        let bufs_delta: i32 = rng.random_range(-3..=3);
        let seq_delta: i32 = if rng.random_bool(0.8) {
            0
        } else {
            rng.random_range(-2..=2)
        };
        p.fabric
            .faults()
            .corrupt_next_send(A_IP, move |v: &mut Vec<u8>| {
                if garbage {
                    *v = noise.clone();
                    return;
                }
                // Keep the real credit fields (nudged), so the message gets past sequencing.
                let bufs =
                    (u16::from_be_bytes([v[2], v[3]]) as i32 + bufs_delta).clamp(0, 65535) as u16;
                let mseq = (u32::from_be_bytes([v[8], v[9], v[10], v[11]]) as i64
                    + seq_delta as i64) as u32;
                let ack = u32::from_be_bytes([v[12], v[13], v[14], v[15]]);
                let payload = if mid == Mid::Data { noise.len() } else { 0 };
                let h = Header::new(mid, ext, BsdhFlags::empty(), bufs, mseq, ack, payload);
                let mut out = vec![0u8; h.header_len() + payload];
                if h.emit(&mut out).is_ok() {
                    out[h.header_len()..].copy_from_slice(&noise[..payload]);
                    *v = out;
                } else {
                    *v = noise.clone();
                }
            });
        let now = p.now();
        p.a.write(now, a1, b"x").unwrap();
        p.run_until(2 * SEC, |p| {
            // Read whatever arrives, so SrcAvails get exercised too.
            let now = p.now();
            let mut buf = [0u8; 4096];
            let _ = p.b.read(now, b1, &mut buf);
            false
        });
        let c = p.b.conn(b1).unwrap();
        match c.state() {
            State::Established => assert!(c.error().is_none()),
            State::Closed => {
                assert!(c.error().is_some());
                aborted += 1;
            }
            s => panic!("round {round}: stuck in {s:?}: {}", c.debug_state()),
        }
        // The neighbour still works.
        let now = p.now();
        p.a.write(now, a2, b"alive").unwrap();
        let mut got = Vec::new();
        assert!(p.run_until(SEC, |p| {
            let now = p.now();
            let mut buf = [0u8; 16];
            if let Ok(n) = p.b.read(now, b2, &mut buf) {
                got.extend_from_slice(&buf[..n]);
            }
            got == b"alive"
        }));
    }
    assert!(
        aborted > 100,
        "most random messages are rejected ({aborted})"
    );
}
