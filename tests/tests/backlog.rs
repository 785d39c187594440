//! The listen backlog (issue 14): a listener that does not accept holds at most backlog + 1
//! connections, as kernel TCP does, and they cost little; a connector beyond that waits as a
//! TCP client whose SYN is dropped does (and gets in once the application accepts); nobody
//! accepting for `Config::unaccepted_timeout` resets them. Differential against kernel TCP
//! where TCP defines the behaviour; over shm between two stacks of this process (each stack
//! its own provider, so the listener's registered memory is counted apart from the clients').

use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use sdp_core::proto::Config;
use sdp_core::socket::{Options, SdpListener, SdpStream, Stack, Transport};

fn shm_stack(cfg: Config) -> Stack {
    Stack::with_provider(sdp_core::verbs::shm::ShmProvider::new().unwrap(), cfg).unwrap()
}

/// Listener and client options for one transport: kernel TCP, or SDP over shm with the
/// listener and the clients on stacks of their own.
struct Side {
    transport: Transport,
    listen: Options,
    connect: Options,
    /// The listener's stack (SDP only).
    stack: Option<Stack>,
}

fn sides(backlog: u32, cfg: Config) -> [Side; 2] {
    let ls = shm_stack(cfg);
    let cs = shm_stack(Config::default());
    [
        Side {
            transport: Transport::Tcp,
            listen: Options::tcp_only().with_backlog(backlog),
            connect: Options::tcp_only(),
            stack: None,
        },
        Side {
            transport: Transport::Shm,
            listen: Options::sdp_only()
                .with_stack(ls.clone())
                .with_backlog(backlog),
            connect: Options::sdp_only().with_stack(cs),
            stack: Some(ls),
        },
    ]
}

fn connect(addr: SocketAddr, opts: &Options, timeout: Duration) -> std::io::Result<SdpStream> {
    let mut o = opts.clone();
    o.connect_timeout = Some(timeout);
    SdpStream::connect_with(addr, &o)
}

/// Connect `n` clients one after another, each with `timeout`: the ones that got in, and the
/// error kinds of the others.
fn connect_many(
    addr: SocketAddr,
    opts: &Options,
    n: usize,
    timeout: Duration,
) -> (Vec<SdpStream>, Vec<ErrorKind>) {
    let (mut ok, mut err) = (Vec::new(), Vec::new());
    for _ in 0..n {
        match connect(addr, opts, timeout) {
            Ok(s) => ok.push(s),
            Err(e) => err.push(e.kind()),
        }
    }
    (ok, err)
}

/// Connect `room` clients that the listener has room for (each with a generous timeout, so a
/// loaded machine cannot make one of them miss), then `beyond` more with a short one (the
/// listener is full: over TCP their SYNs are dropped, and the first retry comes after 1 s).
fn connect_to_fill(
    addr: SocketAddr,
    opts: &Options,
    room: usize,
    beyond: usize,
) -> (Vec<SdpStream>, Vec<ErrorKind>) {
    let (mut ok, mut err) = connect_many(addr, opts, room, Duration::from_secs(10));
    let (more, e) = connect_many(addr, opts, beyond, Duration::from_millis(500));
    ok.extend(more);
    err.extend(e);
    (ok, err)
}

/// Wait until `f` holds, at most `limit`.
fn wait_for(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

#[test]
fn a_listener_that_never_accepts_holds_backlog_plus_one_like_tcp() {
    for backlog in [0u32, 3] {
        let mut seen = Vec::new();
        for side in sides(backlog, Config::default()) {
            let t = side.transport;
            let l = SdpListener::bind_with("127.0.0.1:0", &side.listen).unwrap();
            let addr = l.local_addr().unwrap();
            let extra = 3;
            let (ok, err) = connect_to_fill(addr, &side.connect, backlog as usize + 1, extra);
            assert!(ok.iter().all(|s| s.transport() == t), "{t}");
            if let Some(st) = &side.stack {
                // Every connection beyond the backlog was turned away: none is held.
                assert!(
                    wait_for(Duration::from_secs(5), || st.conn_count() == ok.len()),
                    "{t}: listener holds {} connections, {} got in",
                    st.conn_count(),
                    ok.len()
                );
            }
            seen.push((ok.len(), err));
            drop(ok);
            drop(l);
        }
        eprintln!("backlog {backlog}: tcp {:?}, shm {:?}", seen[0], seen[1]);
        assert_eq!(seen[0].0, backlog as usize + 1, "kernel TCP: backlog + 1");
        assert_eq!(seen[0], seen[1], "backlog {backlog}: tcp vs shm");
    }
}

#[test]
fn a_connector_beyond_the_backlog_gets_in_once_the_application_accepts_like_tcp() {
    for side in sides(1, Config::default()) {
        let t = side.transport;
        let l = SdpListener::bind_with("127.0.0.1:0", &side.listen).unwrap();
        let addr = l.local_addr().unwrap();
        let (ok, err) = connect_many(addr, &side.connect, 2, Duration::from_secs(2));
        assert_eq!((ok.len(), err.len()), (2, 0), "{t}");
        // The third waits (TCP: its SYN is dropped and sent again) ...
        let opts = side.connect.clone();
        let started = Instant::now();
        let waiter = std::thread::spawn(move || {
            let r = connect(addr, &opts, Duration::from_secs(8));
            (
                r.map(|mut s| {
                    s.write_all(b"late").unwrap();
                    s
                }),
                started.elapsed(),
            )
        });
        std::thread::sleep(Duration::from_millis(400));
        assert!(
            !waiter.is_finished(),
            "{t}: connect beyond the backlog returned at once"
        );
        // ... until the application takes one.
        let (mut a0, _) = l.accept().unwrap();
        let (r, took) = waiter.join().unwrap();
        let _late = r.unwrap_or_else(|e| panic!("{t}: the waiting connect failed: {e}"));
        eprintln!("{t}: the waiting connect got in after {took:?}");
        assert!(took >= Duration::from_millis(400), "{t}: {took:?}");
        // The two that were queued are still good, and so is the late one.
        let mut c0 = ok.into_iter().next().unwrap();
        c0.write_all(b"zero").unwrap();
        let mut b = [0u8; 4];
        a0.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"zero", "{t}");
        let (_a1, _) = l.accept().unwrap();
        let (mut a2, _) = l.accept().unwrap();
        a2.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"late", "{t}");
    }
}

#[test]
fn waiting_connections_stay_cheap_however_much_their_clients_write() {
    let backlog = 8;
    let ls = shm_stack(Config::default());
    let cs = shm_stack(Config::default());
    let l = SdpListener::bind_with(
        "127.0.0.1:0",
        &Options::sdp_only()
            .with_stack(ls.clone())
            .with_backlog(backlog),
    )
    .unwrap();
    let addr = l.local_addr().unwrap();
    let copts = Options::sdp_only().with_stack(cs);
    let (clients, _) = connect_many(addr, &copts, backlog as usize + 1, Duration::from_secs(2));
    assert_eq!(clients.len(), backlog as usize + 1);
    let idle = ls.registered_bytes() / clients.len();
    // Every client writes as much as the connection takes before anyone accepts (TCP takes
    // up to the receive buffer, then the writer waits).
    let chunk: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let mut sent = vec![0usize; clients.len()];
    for _ in 0..20 {
        for (c, n) in clients.iter().zip(sent.iter_mut()) {
            c.set_nonblocking(true).unwrap();
            loop {
                match (&*c).write(&chunk[*n % chunk.len()..]) {
                    Ok(k) => *n += k,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => panic!("write: {e}"),
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let busy = ls.registered_bytes() / clients.len();
    eprintln!(
        "registered per waiting connection: {} KiB idle, {} KiB after its client wrote {} KiB",
        idle / 1024,
        busy / 1024,
        sent.iter().min().unwrap() / 1024
    );
    // A few receive buffers each: min_rx_bufs posted while the client sends nothing, at most
    // unaccepted_rx_bufs however much it writes (the rest waits in the client), plus a little
    // for control messages.
    let c = Config::default();
    let slack = 8 << 10;
    // Never fewer than MIN_RX_POSTED are posted: a peer needs DATA_CREDITS to send data while
    // keeping credits back for control messages.
    let posted = c.min_rx_bufs.max(sdp_core::proto::conn::MIN_RX_POSTED);
    let idle_bound = (posted * c.rcv_size) as usize + slack;
    let busy_bound = (c.unaccepted_rx_bufs * c.rcv_size) as usize + slack;
    assert!(
        idle <= idle_bound,
        "{idle} bytes per idle waiting connection"
    );
    assert!(
        busy <= busy_bound,
        "{busy} bytes per busy waiting connection"
    );
    // Accepted, each connection delivers everything its client wrote, in order.
    for (i, c) in clients.iter().enumerate() {
        c.set_nonblocking(false).unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = i;
    }
    for _ in 0..clients.len() {
        let (mut a, peer) = l.accept().unwrap();
        let i = clients
            .iter()
            .position(|c| c.local_addr().unwrap() == peer)
            .expect("a client's address");
        let mut got = Vec::new();
        a.read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), sent[i], "client {i}");
        assert!(
            got.iter()
                .enumerate()
                .all(|(k, &b)| b == (k % chunk.len() % 251) as u8),
            "client {i}: data differs"
        );
    }
}

#[test]
fn connections_nobody_accepts_are_reset_after_the_timeout_and_freed() {
    let cfg = Config {
        unaccepted_timeout: Some(Duration::from_millis(600)),
        ..Config::default()
    };
    let ls = shm_stack(cfg);
    let cs = shm_stack(Config::default());
    let l = SdpListener::bind_with(
        "127.0.0.1:0",
        &Options::sdp_only().with_stack(ls.clone()).with_backlog(4),
    )
    .unwrap();
    let addr = l.local_addr().unwrap();
    let copts = Options::sdp_only().with_stack(cs.clone());
    let (clients, _) = connect_many(addr, &copts, 3, Duration::from_secs(2));
    assert_eq!(clients.len(), 3);
    assert!(ls.registered_bytes() > 0);
    // The clients see a reset, the listener's stack gives everything back.
    for mut c in clients {
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let e = c.read(&mut [0u8; 8]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
    }
    assert!(
        wait_for(Duration::from_secs(5), || ls.conn_count() == 0
            && ls.registered_bytes() == 0),
        "listener stack still holds {} connections, {} bytes",
        ls.conn_count(),
        ls.registered_bytes()
    );
    // The listener still works.
    let mut c = connect(addr, &copts, Duration::from_secs(2)).unwrap();
    let (mut a, _) = l.accept().unwrap();
    c.write_all(b"ok").unwrap();
    let mut b = [0u8; 2];
    a.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ok");
}

/// A kernel TCP socket listening on a loopback port, as an application under the shim has,
/// and its address.
fn kernel_listener(backlog: u32) -> (OwnedFd, SocketAddr) {
    // SAFETY: plain socket calls on a fresh socket this test owns.
    let fd = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let mut sa: libc::sockaddr_in = std::mem::zeroed();
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
        assert_eq!(
            libc::bind(
                fd,
                (&sa as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t
            ),
            0
        );
        assert_eq!(libc::listen(fd, backlog as i32), 0);
        OwnedFd::from_raw_fd(fd)
    };
    // SAFETY: sockaddr_in is plain data; zeroes are a valid value.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a live sockaddr_in and its length.
    assert_eq!(
        unsafe {
            libc::getsockname(
                fd.as_raw_fd(),
                (&mut sa as *mut libc::sockaddr_in).cast(),
                &mut len,
            )
        },
        0
    );
    let addr = SocketAddr::from(([127, 0, 0, 1], u16::from_be(sa.sin_port)));
    (fd, addr)
}

/// Whether `fd` polls readable within `ms` milliseconds.
fn readable_within(fd: &OwnedFd, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
    n == 1
}

/// Accept one connection from a kernel listening socket: the fd and the peer's address.
fn kernel_accept(fd: &OwnedFd) -> (OwnedFd, SocketAddr) {
    // SAFETY: zeroed storage is valid; the kernel fills in at most its size.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut sl = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: our own storage and length.
    let c = unsafe {
        libc::accept4(
            fd.as_raw_fd(),
            (&mut ss as *mut libc::sockaddr_storage).cast(),
            &mut sl,
            libc::SOCK_CLOEXEC,
        )
    };
    assert!(c >= 0, "accept: {}", std::io::Error::last_os_error());
    let peer = sdp_core::socket::app::from_sockaddr(&ss).expect("an inet peer");
    // SAFETY: just returned by accept, ours.
    (unsafe { OwnedFd::from_raw_fd(c) }, peer)
}

/// Read exactly `n` bytes from a shim-mode stream.
fn app_read_exact(s: &sdp_core::socket::app::AppStream, fd: &OwnedFd, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    let mut got = 0;
    while got < n {
        let r = s
            .read(fd.as_raw_fd(), &mut b[got..], Default::default())
            .unwrap();
        assert!(r > 0, "EOF after {got} of {n} bytes");
        got += r;
    }
    b
}

#[test]
fn the_shims_listener_keeps_the_applications_backlog() {
    // The LD_PRELOAD shim's listener: SDP beside an application's kernel TCP listening socket,
    // with the backlog the application gave listen(2).
    let backlog = 2;
    let (fd, addr) = kernel_listener(backlog);
    let ls = shm_stack(Config::default());
    let cs = shm_stack(Config::default());
    let al = sdp_core::socket::app::AppListener::new(
        fd.as_raw_fd(),
        backlog,
        &Options::sdp_only().with_stack(ls.clone()),
    )
    .unwrap();
    let copts = Options::sdp_only().with_stack(cs);
    let (ok, err) = connect_to_fill(addr, &copts, backlog as usize + 1, 2);
    assert_eq!(ok.len(), backlog as usize + 1, "errors {err:?}");
    assert!(err.iter().all(|k| *k == ErrorKind::TimedOut), "{err:?}");
    // Taking one makes room for one more.
    let (s, _fd, _) = al.take(false, true).expect("a connection to take").unwrap();
    drop(s);
    connect(addr, &copts, Duration::from_secs(3)).expect("room after a take");
    drop(al);
}

#[test]
fn the_shims_listener_polls_readable_only_for_a_connection_to_accept() {
    // The shim announces each SDP client ready to be accepted by a doorbell (a loopback TCP
    // connection to the application's listening socket). The progress thread used to ring
    // again for a client whose doorbell the application had accepted but whose SDP
    // connection it had not taken yet: the listener then polled readable with nothing behind
    // it, and an application's accept after select blocked in the kernel (iperf3's server
    // hung in accept, its client spinning for 60 s, in about one run in 25).
    let (fd, addr) = kernel_listener(16);
    let ls = shm_stack(Config::default());
    let cs = shm_stack(Config::default());
    let al = sdp_core::socket::app::AppListener::new(
        fd.as_raw_fd(),
        16,
        &Options::sdp_only().with_stack(ls),
    )
    .unwrap();
    let copts = Options::sdp_only().with_stack(cs);
    let mut c1 = connect(addr, &copts, Duration::from_secs(5)).unwrap();
    assert!(readable_within(&fd, 5000), "no doorbell for a ready client");
    let (bell, peer) = kernel_accept(&fd);
    let claim = al
        .claim_doorbell(peer)
        .expect("the connection is a doorbell");
    sdp_core::socket::app::AppListener::close_doorbell(bell);
    // Progress on the listener's stack while the doorbell is in hand and its connection not
    // taken yet: the client's bytes arrive on the waiting connection.
    c1.write_all(b"first").unwrap();
    assert!(
        !readable_within(&fd, 500),
        "the listener polls readable again for the connection whose doorbell is in hand"
    );
    let (s1, s1fd, _) = al
        .take_claimed(claim, false, true)
        .expect("the announced connection")
        .unwrap();
    assert!(
        !readable_within(&fd, 300),
        "the listener polls readable with no connection to accept"
    );
    assert_eq!(app_read_exact(&s1, &s1fd, 5), b"first");
    // The next client gets a doorbell of its own.
    let mut c2 = connect(addr, &copts, Duration::from_secs(5)).unwrap();
    assert!(
        readable_within(&fd, 5000),
        "no doorbell for the second client"
    );
    let (bell, peer) = kernel_accept(&fd);
    let claim = al
        .claim_doorbell(peer)
        .expect("the connection is a doorbell");
    sdp_core::socket::app::AppListener::close_doorbell(bell);
    let (s2, s2fd, _) = al.take_claimed(claim, false, true).unwrap().unwrap();
    assert!(!readable_within(&fd, 300), "readable after both were taken");
    c2.write_all(b"second").unwrap();
    assert_eq!(app_read_exact(&s2, &s2fd, 6), b"second");
    let mut r = [0u8; 1];
    drop((s1, s1fd, s2, s2fd));
    assert_eq!(c1.read(&mut r).unwrap(), 0);
    assert_eq!(c2.read(&mut r).unwrap(), 0);
}
