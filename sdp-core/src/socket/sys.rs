//! The few system calls the socket layer makes itself, each behind a safe wrapper. All
//! `unsafe` of the socket layer is in this file.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Call a libc function that returns -1 and sets errno on failure.
macro_rules! syscall {
    ($fn:ident ( $($arg:expr),* $(,)? )) => {{
        #[allow(unused_unsafe)]
        // SAFETY: the caller of the macro states why the arguments are valid.
        let res = unsafe { libc::$fn($($arg),*) };
        if res == -1 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(res)
        }
    }};
}
pub(crate) use syscall;

/// A connected pair of nonblocking, close-on-exec AF_UNIX stream sockets.
pub(crate) fn socketpair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [-1 as libc::c_int; 2];
    // SAFETY: `fds` is a valid array of two ints the kernel fills in.
    syscall!(socketpair(
        libc::AF_UNIX,
        libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        0,
        fds.as_mut_ptr()
    ))?;
    // SAFETY: both fds were just returned by socketpair and are owned by nobody else. The
    // first is the application's; the second, ours, moves out of the application's numbers.
    Ok(unsafe {
        (
            OwnedFd::from_raw_fd(fds[0]),
            OwnedFd::from_raw_fd(high(fds[1])),
        )
    })
}

/// A nonblocking, close-on-exec eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    let fd = syscall!(eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC))?;
    // SAFETY: the fd was just returned by eventfd and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(high(fd)) })
}

/// Add `n` to an eventfd's counter.
pub(crate) fn eventfd_signal(fd: &OwnedFd) {
    eventfd_signal_raw(fd.as_raw_fd());
}

/// Add 1 to the counter of an eventfd known by number only (it must stay open meanwhile).
pub(crate) fn eventfd_signal_raw(fd: RawFd) {
    let v: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64; an error (counter full) is harmless.
    let _ = syscall!(write(fd, (&v as *const u64).cast(), 8));
}

/// Wait until `a` or `b` is readable or `timeout` passes (no allocation: a hot path).
pub(crate) fn poll_two(a: RawFd, b: RawFd, timeout: Duration) -> io::Result<()> {
    let mut pfds = [
        libc::pollfd {
            fd: a,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: b,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: `pfds` is a live array of two pollfd structs.
    match syscall!(poll(pfds.as_mut_ptr(), 2, ms)) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
        Err(e) => Err(e),
    }
}

/// This thread's involuntary context switches so far (`None` if the kernel does not say).
pub(crate) fn involuntary_switches() -> Option<u64> {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a live rusage struct.
    syscall!(getrusage(libc::RUSAGE_THREAD, &mut ru)).ok()?;
    Some(ru.ru_nivcsw as u64)
}

/// Reset an eventfd's counter.
pub(crate) fn eventfd_drain(fd: &OwnedFd) {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64; EAGAIN (counter zero) is harmless.
    let _ = syscall!(read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8));
}

/// Send bytes without blocking; returns bytes sent (0 on EAGAIN).
pub(crate) fn send_nb(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live slice of `buf.len()` bytes.
    match syscall!(send(
        fd,
        buf.as_ptr().cast(),
        buf.len(),
        libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL
    )) {
        Ok(n) => Ok(n as usize),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        Err(e) => Err(e),
    }
}

/// Receive bytes without blocking; returns bytes received (0 on EAGAIN or EOF).
pub(crate) fn recv_nb(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, writable slice of `buf.len()` bytes.
    match syscall!(recv(
        fd,
        buf.as_mut_ptr().cast(),
        buf.len(),
        libc::MSG_DONTWAIT
    )) {
        Ok(n) => Ok(n as usize),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        Err(e) => Err(e),
    }
}

/// Set an integer socket option.
pub(crate) fn setsockopt_int(fd: RawFd, level: i32, name: i32, val: i32) -> io::Result<()> {
    // SAFETY: passes a pointer to a live c_int and its size.
    syscall!(setsockopt(
        fd,
        level,
        name,
        (&val as *const i32).cast(),
        std::mem::size_of::<i32>() as libc::socklen_t
    ))?;
    Ok(())
}

/// `shutdown(2)`.
pub(crate) fn shutdown(fd: RawFd, how: i32) -> io::Result<()> {
    // SAFETY: plain call on an fd we own.
    syscall!(shutdown(fd, how))?;
    Ok(())
}

/// Wait until one of `fds` polls for `events` or the timeout passes (`None`: forever).
/// Returns the revents of each fd.
pub(crate) fn poll(fds: &[(RawFd, i16)], timeout: Option<Duration>) -> io::Result<Vec<i16>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&(fd, events)| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    let ms = match timeout {
        None => -1,
        // Round up so a short timeout does not become a busy loop.
        Some(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
    };
    // SAFETY: `pfds` is a live array of `pfds.len()` pollfd structs.
    match syscall!(poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms)) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
        Err(e) => return Err(e),
    }
    Ok(pfds.iter().map(|p| p.revents).collect())
}

static PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

extern "C" fn forget_pid() {
    PID.store(0, std::sync::atomic::Ordering::Relaxed);
}

extern "C" fn register_forget_pid() {
    // SAFETY: registers a plain function that stores to an atomic.
    unsafe { libc::pthread_atfork(None, None, Some(forget_pid)) };
}

/// The child's pid must be known before any other atfork child handler runs: those run in the
/// order they were registered, and one may drop sockets the child inherited (the shim's does),
/// which must find the parent's stacks dead (see `Runtime::lock`) rather than wait on a lock
/// another thread of the parent held at the fork. So the handler is registered when the
/// library is loaded, before any code can register its own.
#[used]
#[link_section = ".init_array"]
static REGISTER_FORGET_PID: extern "C" fn() = register_forget_pid;

/// Process id. glibc does not cache it, and a system call on every lock of a runtime adds up:
/// it is cached here and forgotten in a fork child (pthread_atfork, registered at load), so a
/// child sees its own. (A child made by a raw fork system call runs no atfork handler and
/// would see the parent's.)
pub(crate) fn getpid() -> u32 {
    let p = PID.load(std::sync::atomic::Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    // SAFETY: getpid cannot fail.
    let p = unsafe { libc::getpid() as u32 };
    PID.store(p, std::sync::atomic::Ordering::Relaxed);
    p
}

/// Whether `ip` is an address of this host (loopback, or assigned to one of its interfaces).
pub(crate) fn is_local_ip(ip: std::net::IpAddr) -> bool {
    if ip.is_loopback() || ip.is_unspecified() {
        return true;
    }
    // Binding a socket to an address succeeds only for local addresses (EADDRNOTAVAIL
    // otherwise); nothing is sent.
    std::net::UdpSocket::bind(std::net::SocketAddr::new(ip, 0)).is_ok()
}

/// A close-on-exec epoll fd watching `fds` for POLLIN (level-triggered): it polls readable
/// while any of them does.
pub(crate) fn epoll_of(fds: &[RawFd]) -> io::Result<OwnedFd> {
    let ep = syscall!(epoll_create1(libc::EPOLL_CLOEXEC))?;
    // SAFETY: the fd was just returned by epoll_create1 and is owned by nobody else.
    let ep = unsafe { OwnedFd::from_raw_fd(ep) };
    for &fd in fds {
        epoll_add(ep.as_raw_fd(), fd)?;
    }
    Ok(ep)
}

/// Watch `fd` for POLLIN (level-triggered) in the epoll set `ep`.
pub(crate) fn epoll_add(ep: RawFd, fd: RawFd) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: fd as u64,
    };
    // SAFETY: `ev` is a live epoll_event; the fds are the caller's.
    syscall!(epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev))?;
    Ok(())
}

/// Stop watching `fd` in the epoll set `ep`.
pub(crate) fn epoll_del(ep: RawFd, fd: RawFd) -> io::Result<()> {
    // SAFETY: the fds are the caller's; DEL takes no event.
    syscall!(epoll_ctl(ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()))?;
    Ok(())
}

/// This host's interface addresses.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn local_ips() -> Vec<std::net::IpAddr> {
    crate::verbs::shm::sys::local_addrs()
}

/// `sockaddr_storage` for `a`, and its length.
pub(crate) fn sockaddr_of(a: std::net::SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all zeroes is a valid (unspecified) value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        std::net::SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            let sin = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        std::net::SocketAddr::V6(v6) => {
            // SAFETY: as above.
            let sin6 = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
            sin6.sin6_flowinfo = v6.flowinfo();
            sin6.sin6_scope_id = v6.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// A kernel TCP connection to `dst` leaving from `src` (port chosen by the kernel), within
/// `timeout` if given: what `TcpStream::connect(_timeout)` does, with a bind first.
pub(crate) fn tcp_connect_from(
    src: std::net::IpAddr,
    dst: std::net::SocketAddr,
    timeout: Option<Duration>,
) -> io::Result<std::net::TcpStream> {
    let family = if dst.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let fd = syscall!(socket(
        family,
        libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
        0
    ))?;
    // SAFETY: the fd was just returned by socket() and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let (sa, len) = sockaddr_of(std::net::SocketAddr::new(src, 0));
    // SAFETY: `sa` is a valid sockaddr of `len` bytes for the socket's family.
    syscall!(bind(
        fd.as_raw_fd(),
        &sa as *const _ as *const libc::sockaddr,
        len
    ))?;
    let (da, dlen) = sockaddr_of(dst);
    // SAFETY: as above, for the destination.
    match syscall!(connect(
        fd.as_raw_fd(),
        &da as *const _ as *const libc::sockaddr,
        dlen
    )) {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {
            let deadline = timeout.map(|t| std::time::Instant::now() + t);
            loop {
                let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
                if left.is_some_and(|l| l.is_zero()) {
                    return Err(io::Error::from(io::ErrorKind::TimedOut));
                }
                let r = poll(&[(fd.as_raw_fd(), libc::POLLOUT)], left)?;
                if r.first().is_some_and(|&ev| ev != 0) {
                    break;
                }
            }
            let mut err: libc::c_int = 0;
            let mut elen = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: `err` and `elen` are live and sized for SO_ERROR's int.
            syscall!(getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                &mut err as *mut _ as *mut libc::c_void,
                &mut elen
            ))?;
            if err != 0 {
                return Err(io::Error::from_raw_os_error(err));
            }
        }
        Err(e) => return Err(e),
    }
    let s = std::net::TcpStream::from(fd);
    s.set_nonblocking(false)?;
    Ok(s)
}

/// An fd of our own, moved out of the application's low numbers (see the shm provider's
/// `high_fd`).
fn high(fd: RawFd) -> RawFd {
    crate::verbs::shm::sys::high_fd(fd)
}

/// [`high`] for an owned fd.
pub(crate) fn high_owned(fd: OwnedFd) -> OwnedFd {
    use std::os::fd::IntoRawFd;
    // SAFETY: the fd was ours; high() returns it or its replacement, which we own.
    unsafe { OwnedFd::from_raw_fd(high(fd.into_raw_fd())) }
}

/// Set or clear O_NONBLOCK and FD_CLOEXEC on an fd.
pub(crate) fn set_fd_flags(fd: RawFd, nonblocking: bool, cloexec: bool) -> io::Result<()> {
    // SAFETY: fcntl on an fd the caller owns, with integer arguments only.
    let fl = syscall!(fcntl(fd, libc::F_GETFL))?;
    let want = if nonblocking {
        fl | libc::O_NONBLOCK
    } else {
        fl & !libc::O_NONBLOCK
    };
    if want != fl {
        // SAFETY: as above.
        syscall!(fcntl(fd, libc::F_SETFL, want))?;
    }
    // SAFETY: as above.
    syscall!(fcntl(
        fd,
        libc::F_SETFD,
        if cloexec { libc::FD_CLOEXEC } else { 0 }
    ))?;
    Ok(())
}

/// Bytes queued for reading on a socket (SIOCINQ).
pub(crate) fn inq(fd: RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer to a live local.
    syscall!(ioctl(fd, libc::FIONREAD, &mut n as *mut libc::c_int))?;
    Ok(n.max(0) as usize)
}

/// Block until `fd` (a socket) has a byte to read or is at EOF, honouring the file's
/// O_NONBLOCK, SO_RCVTIMEO, signals and SA_RESTART exactly as a read on it would, without
/// taking anything (MSG_PEEK). `extra` adds flags (MSG_DONTWAIT).
pub(crate) fn wait_readable(fd: RawFd, extra: i32) -> io::Result<()> {
    let mut b = [0u8; 1];
    // SAFETY: receives at most one byte into a live local buffer.
    syscall!(recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | extra))?;
    Ok(())
}

/// Block until `fd` (a socket) has room to send, honouring O_NONBLOCK, SO_SNDTIMEO, signals
/// and SA_RESTART as a write on it would: sends one filler byte once there is room.
pub(crate) fn wait_writable(fd: RawFd, extra: i32) -> io::Result<()> {
    let b = [0u8; 1];
    // SAFETY: sends one byte from a live local buffer.
    syscall!(send(fd, b.as_ptr().cast(), 1, libc::MSG_NOSIGNAL | extra))?;
    Ok(())
}

/// A nonblocking, close-on-exec kernel TCP socket bound to `src`.
pub(crate) fn tcp_socket_bound(src: std::net::SocketAddr) -> io::Result<OwnedFd> {
    let family = if src.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let fd = syscall!(socket(
        family,
        libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
        0
    ))?;
    // SAFETY: the fd was just returned by socket() and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(high(fd)) };
    let (sa, len) = sockaddr_of(src);
    // SAFETY: `sa` is a valid sockaddr of `len` bytes for the socket's family.
    syscall!(bind(
        fd.as_raw_fd(),
        &sa as *const _ as *const libc::sockaddr,
        len
    ))?;
    Ok(fd)
}

/// A kernel TCP listening socket on `addr` with `listen(2)`'s `backlog`, bound as
/// `std::net::TcpListener::bind` binds (SO_REUSEADDR, close-on-exec).
pub(crate) fn tcp_listen(
    addr: std::net::SocketAddr,
    backlog: u32,
) -> io::Result<std::net::TcpListener> {
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let fd = syscall!(socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0))?;
    // SAFETY: the fd was just returned by socket() and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    setsockopt_int(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    let (sa, len) = sockaddr_of(addr);
    // SAFETY: `sa` is a valid sockaddr of `len` bytes for the socket's family.
    syscall!(bind(
        fd.as_raw_fd(),
        &sa as *const _ as *const libc::sockaddr,
        len
    ))?;
    // listen(2) takes an int; the kernel caps it at somaxconn.
    syscall!(listen(fd.as_raw_fd(), backlog.min(i32::MAX as u32) as i32))?;
    Ok(std::net::TcpListener::from(fd))
}

/// The kernel's cap on a listen backlog (`net.core.somaxconn`; 4096 if it cannot be read).
pub(crate) fn somaxconn() -> u32 {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(4096)
}

/// Start a nonblocking connect (EINPROGRESS counts as started).
pub(crate) fn connect_nb(fd: RawFd, dst: std::net::SocketAddr) -> io::Result<()> {
    let (da, dlen) = sockaddr_of(dst);
    // SAFETY: `da` is a valid sockaddr of `dlen` bytes.
    match syscall!(connect(fd, &da as *const _ as *const libc::sockaddr, dlen)) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(()),
        Err(e) => Err(e),
    }
}

/// A socket's local address (getsockname).
pub(crate) fn local_addr_of(fd: RawFd) -> io::Result<std::net::SocketAddr> {
    // SAFETY: an all-zero sockaddr_storage is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `ss` and `len` are live and describe the storage's size.
    syscall!(getsockname(
        fd,
        &mut ss as *mut _ as *mut libc::sockaddr,
        &mut len
    ))?;
    sockaddr_to(&ss).ok_or_else(|| io::Error::from_raw_os_error(libc::EAFNOSUPPORT))
}

/// A socket address from a sockaddr_storage (AF_INET / AF_INET6).
pub(crate) fn sockaddr_to(ss: &libc::sockaddr_storage) -> Option<std::net::SocketAddr> {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
    match ss.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let a: &libc::sockaddr_in = unsafe { &*(ss as *const _ as *const libc::sockaddr_in) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let a: &libc::sockaddr_in6 = unsafe { &*(ss as *const _ as *const libc::sockaddr_in6) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// SO_LINGER {on, 0}: close resets the connection instead of leaving TIME_WAIT.
pub(crate) fn set_linger_zero(fd: RawFd) -> io::Result<()> {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: passes a live linger struct and its size.
    syscall!(setsockopt(
        fd,
        libc::SOL_SOCKET,
        libc::SO_LINGER,
        (&l as *const libc::linger).cast(),
        std::mem::size_of::<libc::linger>() as libc::socklen_t
    ))?;
    Ok(())
}
/// Receive without blocking: `Some(0)` at EOF, `None` when nothing is queued.
pub(crate) fn recv_nb_eof(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: `buf` is a live, writable slice of `buf.len()` bytes.
    match syscall!(recv(
        fd,
        buf.as_mut_ptr().cast(),
        buf.len(),
        libc::MSG_DONTWAIT
    )) {
        Ok(n) => Ok(Some(n as usize)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}

/// Send one out-of-band byte (MSG_OOB) without blocking.
pub(crate) fn send_oob(fd: RawFd) -> io::Result<()> {
    let b = [b'!'];
    // SAFETY: sends one byte from a live local buffer.
    syscall!(send(
        fd,
        b.as_ptr().cast(),
        1,
        libc::MSG_OOB | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL
    ))?;
    Ok(())
}

/// Take the out-of-band byte, if any, without blocking.
pub(crate) fn recv_oob(fd: RawFd) -> io::Result<()> {
    let mut b = [0u8; 1];
    // SAFETY: receives at most one byte into a live local buffer.
    syscall!(recv(
        fd,
        b.as_mut_ptr().cast(),
        1,
        libc::MSG_OOB | libc::MSG_DONTWAIT
    ))?;
    Ok(())
}

/// One fd's poll events now (no waiting).
pub(crate) fn poll_now(fd: RawFd, events: i16) -> io::Result<i16> {
    Ok(poll(&[(fd, events)], Some(Duration::ZERO))?[0])
}

/// Bytes in a kernel TCP socket's send queue not yet acknowledged by the peer (`SIOCOUTQ`).
pub(crate) fn tcp_outq(fd: RawFd) -> io::Result<usize> {
    let mut v: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int through the pointer, which is live.
    syscall!(ioctl(fd, libc::TIOCOUTQ, &mut v as *mut libc::c_int))?;
    Ok(v.max(0) as usize)
}

/// Register `f` to run at process exit (`atexit(3)`): `exit()`, `std::process::exit` and
/// returning from `main` run it; `_exit` and fatal signals do not.
pub(crate) fn atexit(f: extern "C" fn()) {
    // SAFETY: `f` is a plain function that lives as long as the program and never unwinds.
    unsafe { libc::atexit(f) };
}

/// `sockaddr_un` for an abstract name (no leading NUL in `name`), and its length.
fn abstract_addr(name: &[u8]) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: an all-zero sockaddr_un is a valid value.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() + 1 > a.sun_path.len() {
        return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    for (i, &b) in name.iter().enumerate() {
        a.sun_path[i + 1] = b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    Ok((a, len as libc::socklen_t))
}

/// A nonblocking, close-on-exec AF_UNIX stream socket listening on an abstract name.
pub(crate) fn abstract_listener(name: &[u8]) -> io::Result<OwnedFd> {
    let (a, len) = abstract_addr(name)?;
    let fd = syscall!(socket(
        libc::AF_UNIX,
        libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        0
    ))?;
    // SAFETY: the fd was just returned by socket() and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(high(fd)) };
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
    syscall!(bind(
        fd.as_raw_fd(),
        &a as *const _ as *const libc::sockaddr,
        len
    ))?;
    syscall!(listen(fd.as_raw_fd(), 16))?;
    Ok(fd)
}

/// A blocking, close-on-exec AF_UNIX stream connection to an abstract name.
pub(crate) fn abstract_connect(name: &[u8]) -> io::Result<OwnedFd> {
    let (a, len) = abstract_addr(name)?;
    let fd = syscall!(socket(
        libc::AF_UNIX,
        libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
        0
    ))?;
    // SAFETY: the fd was just returned by socket() and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
    syscall!(connect(
        fd.as_raw_fd(),
        &a as *const _ as *const libc::sockaddr,
        len
    ))?;
    Ok(fd)
}

/// Accept one waiting connection without blocking (`None`: none waits).
pub(crate) fn accept_nb(fd: RawFd) -> io::Result<Option<OwnedFd>> {
    // SAFETY: no address is asked for.
    match syscall!(accept4(
        fd,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        libc::SOCK_CLOEXEC
    )) {
        // SAFETY: the fd was just returned by accept4 and is owned by nobody else.
        Ok(c) => Ok(Some(unsafe { OwnedFd::from_raw_fd(c) })),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}

/// The uid of a connected AF_UNIX socket's peer (SO_PEERCRED).
pub(crate) fn peer_uid(fd: RawFd) -> io::Result<u32> {
    // SAFETY: an all-zero ucred is a valid value.
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut l = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `c` and `l` are live and describe the struct's size.
    syscall!(getsockopt(
        fd,
        libc::SOL_SOCKET,
        libc::SO_PEERCRED,
        (&mut c as *mut libc::ucred).cast(),
        &mut l
    ))?;
    Ok(c.uid)
}
