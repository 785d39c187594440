//! The socket API over the simulated fabric (virtual time driven by the real clock).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr};
use std::time::Duration;

use sdp_core::proto::Config;
use sdp_core::socket::{Options, SdpListener, SdpStream, Stack, Transport};
use sdp_core::verbs::sim::SimFabric;

fn ip(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))
}

fn stacks() -> (Stack, Stack) {
    let f = SimFabric::new(1);
    let a = Stack::sim(f.provider(ip(1)), Config::default()).unwrap();
    let b = Stack::sim(f.provider(ip(2)), Config::default()).unwrap();
    (a, b)
}

fn pair() -> (SdpStream, SdpStream) {
    let (a, b) = stacks();
    let l = SdpListener::bind_with(
        SocketAddr::new(ip(2), 5000),
        &Options::sdp_only().with_stack(b),
    )
    .unwrap();
    let t = std::thread::spawn(move || l.accept().unwrap().0);
    let c = SdpStream::connect_with(
        SocketAddr::new(ip(2), 5000),
        &Options::sdp_only().with_stack(a),
    )
    .unwrap();
    (c, t.join().unwrap())
}

#[test]
fn echo_and_eof() {
    let (mut c, mut s) = pair();
    assert_eq!(c.transport(), Transport::Sim);
    c.write_all(b"hello").unwrap();
    let mut b = [0u8; 5];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"hello");
    assert_eq!(s.peer_addr().unwrap().ip(), ip(1));
    c.shutdown(Shutdown::Write).unwrap();
    assert_eq!(s.read(&mut b).unwrap(), 0);
}

#[test]
fn bulk_both_ways() {
    let (c, s) = pair();
    let n = 8 << 20;
    let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    let d2 = data.clone();
    let mut c2 = c.try_clone().unwrap();
    let w = std::thread::spawn(move || {
        c2.write_all(&d2).unwrap();
    });
    let mut got = vec![0u8; n];
    (&s).read_exact(&mut got).unwrap();
    assert!(got == data);
    w.join().unwrap();
}

#[test]
fn readiness_fd_follows_the_stream() {
    use std::os::fd::AsRawFd;
    let (mut c, s) = pair();
    s.set_nonblocking(true).unwrap();
    let fd = s.as_raw_fd();
    let poll = |ms| {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        unsafe { libc::poll(&mut p, 1, ms) };
        p.revents
    };
    assert_eq!(poll(0) & libc::POLLIN, 0);
    let mut b = [0u8; 8];
    assert_eq!(
        (&s).read(&mut b).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock
    );
    c.write_all(b"x").unwrap();
    assert_ne!(poll(5000) & libc::POLLIN, 0);
    assert_eq!((&s).read(&mut b).unwrap(), 1);
    assert_eq!(poll(0) & libc::POLLIN, 0);
    drop(c);
    assert_ne!(poll(5000) & libc::POLLIN, 0);
    let r = (&s).read(&mut b);
    assert_eq!(r.as_ref().ok(), Some(&0), "{r:?}");
}

#[test]
fn read_timeout() {
    let (_c, s) = pair();
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let t = std::time::Instant::now();
    let e = (&s).read(&mut [0u8; 4]).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    assert!(t.elapsed() >= Duration::from_millis(50));
}

/// `Options::source_ip` on a kernel TCP connection (chosen, or the automatic fallback when no
/// SDP provider reaches the source address) binds it like `bind()` before `connect()`; errors
/// are TCP's.
#[test]
fn source_ip_binds_the_tcp_connection() {
    let src = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut opts = vec![Options::tcp_only().with_source_ip(src)];
    if !cfg!(feature = "rdma") {
        // Without RDMA nothing carries SDP from a chosen source address: TCP it is.
        opts.push(Options::auto().with_source_ip(src));
    }
    for o in opts {
        let mut c = SdpStream::connect_with(addr, &o).unwrap();
        assert_eq!(c.transport(), Transport::Tcp);
        let (mut s, peer) = l.accept().unwrap();
        assert_eq!(peer.ip(), src);
        assert_eq!(c.local_addr().unwrap().ip(), src);
        c.write_all(b"from .2").unwrap();
        let mut b = [0u8; 7];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"from .2");
    }
    // Nobody listening: the same error as std's connect, with and without a timeout.
    drop(l);
    let want = std::net::TcpStream::connect(addr).unwrap_err().kind();
    for t in [None, Some(Duration::from_secs(2))] {
        let o = Options {
            connect_timeout: t,
            ..Options::tcp_only().with_source_ip(src)
        };
        let e = SdpStream::connect_with(addr, &o).unwrap_err();
        assert_eq!(e.kind(), want);
    }
    // A source address that is not this host's: bind's EADDRNOTAVAIL, as for a TCP socket.
    let e = SdpStream::connect_with(
        addr,
        &Options::tcp_only().with_source_ip(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1))),
    )
    .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EADDRNOTAVAIL));
}
