//! A device that goes away under live sockets (`rdma link delete`, a hot-unplugged HCA), over
//! the simulator through the socket API (issue 14, "no hang"): the stack fails its sockets
//! with ENETDOWN at once (a blocked read wakes), and lets go of everything it made on the
//! device while the application still holds its listener, streams and stack, so the kernel
//! can finish the removal (`rdma link delete` waits for that on Soft-RoCE). Before this, the
//! stack kept every QP and region, and a process holding a listener blocked the removal for
//! good (the rig's soak with the link-removal fault hung).

use std::io::{Read, Write};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use sdp_core::proto::Config;
use sdp_core::socket::{Options, SdpListener, SdpStream, Stack};
use sdp_core::verbs::sim::SimFabric;

const A: [u8; 4] = [10, 0, 0, 1];
const B: [u8; 4] = [10, 0, 0, 2];

/// Wait (real time, bounded) until `f` holds.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < end, "{what}: not within 20 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_removed_device_fails_its_sockets_and_is_let_go_while_they_are_held() {
    let fabric = SimFabric::new(11);
    let (a_ip, b_ip): (IpAddr, IpAddr) = (A.into(), B.into());
    let sa = Stack::sim(fabric.provider(a_ip), Config::default()).unwrap();
    let sb = Stack::sim(fabric.provider(b_ip), Config::default()).unwrap();
    let l = SdpListener::bind_with("10.0.0.2:5000", &Options::sdp_only().with_stack(sb.clone()))
        .unwrap();
    let mut c =
        SdpStream::connect_with("10.0.0.2:5000", &Options::sdp_only().with_stack(sa.clone()))
            .unwrap();
    let (mut s, _) = l.accept().unwrap();
    c.write_all(b"before").unwrap();
    let mut got = [0u8; 6];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"before");
    let before = fabric.stats(b_ip);
    assert!(
        before.qps >= 1 && before.registered_regions >= 1,
        "{before:?}"
    );

    // A reader blocked on B's side when the device goes.
    let mut s2 = s.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        let mut b = [0u8; 16];
        s2.read(&mut b)
    });
    std::thread::sleep(Duration::from_millis(50));
    fabric.faults().remove_device(b_ip);

    let r = reader.join().unwrap();
    let e = r.expect_err("a read on a removed device must fail");
    assert_eq!(e.raw_os_error(), Some(libc::ENETDOWN), "{e:?}");
    // Later calls say the same, at once.
    let e = s.write(b"after").expect_err("write after the removal");
    assert_eq!(e.raw_os_error(), Some(libc::ENETDOWN), "{e:?}");

    // Everything made on B's device is given back, though the listener, the stream and the
    // stack are all still held.
    eventually("B's QPs and regions given back", || {
        let st = fabric.stats(b_ip);
        st.qps == 0 && st.registered_regions == 0 && st.registered_bytes == 0
    });

    // The listener does not hang nor spin: nothing to accept.
    l.set_nonblocking(true).unwrap();
    match l.accept() {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!("accept on a listener whose device went: {other:?}"),
    }

    // The peer learns: its read ends (reset or EOF), it does not hang.
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut b = [0u8; 16];
    match c.read(&mut b) {
        Ok(0) => {}
        Err(e)
            if e.kind() != std::io::ErrorKind::WouldBlock
                && e.kind() != std::io::ErrorKind::TimedOut => {}
        other => panic!("the peer's read after the removal: {other:?}"),
    }
    drop((s, l, c, sa, sb));
}
