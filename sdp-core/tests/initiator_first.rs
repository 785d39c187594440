//! `Config::initiator_sends_first` (iWARP: MPA wants the connecting side's message first; the rig's
//! two-guest siw checks failed without it, tests/rig/README.md): the accepting side sends nothing
//! (data, credit updates) before a message of the connecting side has arrived, even when its
//! application writes at once and the connecting application never writes; and the data still
//! flows. Without the setting the accepting side's data arrives first, so the check below tells
//! the two apart.

use std::net::{IpAddr, SocketAddr};

use sdp_core::driver::Driver;
use sdp_core::proto::conn::CallError;
use sdp_core::proto::{Config, Instant, State};
use sdp_core::verbs::sim::{SimFabric, TraceKind};
use sdp_core::verbs::{WcOpcode, WcStatus};

const PORT: u16 = 7000;
const N: usize = 50_000;

/// Server (B) writes N bytes as soon as it accepts; the client (A) only reads. Returns the times
/// of the first successful receive completion on A and on B (if B received anything).
fn first_receives(initiator_first: Option<bool>) -> (u64, Option<u64>) {
    let (ia, ib): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
    let f = SimFabric::new(5);
    f.set_trace(true);
    let cfg = Config {
        initiator_sends_first: initiator_first,
        ..Config::default()
    };
    let mut a = Driver::new(f.provider(ia), cfg.clone());
    let mut b = Driver::new(f.provider(ib), cfg);
    let l = b.listen(SocketAddr::new(ib, PORT), 8).unwrap();
    let ca = a
        .connect(Instant(f.now()), SocketAddr::new(ib, PORT), None)
        .unwrap();
    let msg: Vec<u8> = (0..N as u32).map(|i| (i * 31 + 7) as u8).collect();
    let (mut sent, mut got) = (0, Vec::new());
    let mut cb = None;
    let mut buf = vec![0u8; 65536];
    for _ in 0..100_000 {
        let now = Instant(f.now());
        a.poll(now);
        b.poll(now);
        if cb.is_none() {
            cb = b.accept(l);
        }
        if let Some(cb) = cb {
            if sent < N && b.conn(cb).is_some_and(|c| c.state() == State::Established) {
                match b.write(now, cb, &msg[sent..]) {
                    Ok(n) => sent += n,
                    Err(CallError::WouldBlock) => {}
                    Err(e) => panic!("B's write: {e:?}"),
                }
            }
        }
        match a.read(now, ca, &mut buf) {
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(CallError::WouldBlock) => {}
            Err(e) => panic!("A's read: {e:?}"),
        }
        if got.len() == N {
            break;
        }
        f.advance_by(1_000);
    }
    assert_eq!(got, msg, "A received B's bytes");
    let trace = f.take_trace();
    let t = |host: IpAddr| {
        trace
            .iter()
            .find(|e| {
                e.host == host
                    && matches!(&e.kind, TraceKind::Completion(c)
                        if c.opcode == WcOpcode::Recv && c.status == WcStatus::Success)
            })
            .map(|e| e.time)
    };
    (t(ia).expect("A received"), t(ib))
}

#[test]
fn accepting_side_waits_for_the_connecting_sides_first_message() {
    let (a, b) = first_receives(Some(true));
    let b = b.expect("the connecting side sent a message");
    assert!(
        b < a,
        "the connecting side's message must arrive first: first receive on B at {b} ns, on A at {a} ns"
    );
}

#[test]
fn without_it_the_accepting_side_may_send_first() {
    let (a, b) = first_receives(Some(false));
    assert!(
        b.is_none_or(|b| a < b),
        "first receive on A at {a} ns, on B at {b:?}"
    );
}

/// The engine alone, both halves of the rule: the accepting side, connected and written to,
/// posts receives but no send while it has received nothing; the connecting side posts a
/// message (a credit update) as soon as it is connected, though its application wrote nothing.
/// Without the setting, the accepting side's write goes out at once and the connecting side
/// sends nothing.
fn engine_sends(initiator_first: bool) -> (usize, usize) {
    use sdp_core::proto::buff::VecStore;
    use sdp_core::proto::Conn;
    use sdp_core::verbs::{CmEvent, WorkRequest};
    let cfg = Config {
        initiator_sends_first: Some(initiator_first),
        ..Config::default()
    };
    let now = Instant(0);
    let (mut a, hello) = Conn::connect(cfg.clone(), VecStore::default(), now, 0, false).unwrap();
    let (mut b, hello_ack) = Conn::accept(cfg, VecStore::default(), now, &hello).unwrap();
    let sends = |c: &mut Conn<VecStore>| {
        let mut n = 0;
        while let Some(wr) = c.poll_wr() {
            n += matches!(wr, WorkRequest::Send(_)) as usize;
        }
        n
    };
    assert_eq!((sends(&mut a), sends(&mut b)), (0, 0));
    b.handle_cm(
        now,
        CmEvent::Established {
            private_data: Vec::new(),
        },
    );
    assert_eq!(b.state(), State::Established);
    assert_eq!(
        b.write(now, b"the accepting side writes first").unwrap(),
        31
    );
    let b_sends = sends(&mut b);
    a.handle_cm(
        now,
        CmEvent::Established {
            private_data: hello_ack,
        },
    );
    assert_eq!(a.state(), State::Established);
    (sends(&mut a), b_sends)
}

#[test]
fn engine_holds_the_accepting_side_and_starts_the_connecting_side() {
    assert_eq!(
        engine_sends(true),
        (1, 0),
        "(connecting side's sends, accepting side's)"
    );
    assert_eq!(
        engine_sends(false),
        (0, 1),
        "(connecting side's sends, accepting side's)"
    );
}
