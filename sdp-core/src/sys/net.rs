//! IP sockets: kernel TCP connections and listeners, socket addresses, options and
//! nonblocking sends and receives.

use std::io;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use super::{made, poll};

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

/// Whether `ip` is an address of this host (loopback, or assigned to one of its interfaces).
pub(crate) fn is_local_ip(ip: std::net::IpAddr) -> bool {
    if ip.is_loopback() || ip.is_unspecified() {
        return true;
    }
    // Binding a socket to an address succeeds only for local addresses (EADDRNOTAVAIL
    // otherwise); nothing is sent.
    std::net::UdpSocket::bind(std::net::SocketAddr::new(ip, 0)).is_ok()
}

/// The IP addresses of this host's interfaces.
pub fn local_addrs() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below.
    if syscall!(getifaddrs(&mut ifa)).is_err() {
        return out;
    }
    let mut p = ifa;
    // SAFETY: walking the list getifaddrs returned; each sockaddr is of its family's type.
    unsafe {
        while !p.is_null() {
            let a = (*p).ifa_addr;
            if !a.is_null() {
                match (*a).sa_family as i32 {
                    libc::AF_INET => {
                        let s = &*(a as *const libc::sockaddr_in);
                        out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr))));
                    }
                    libc::AF_INET6 => {
                        let s = &*(a as *const libc::sockaddr_in6);
                        out.push(IpAddr::V6(Ipv6Addr::from(s.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            p = (*p).ifa_next;
        }
        libc::freeifaddrs(ifa);
    }
    out
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

/// Read an integer socket option.
pub(crate) fn getsockopt_int(fd: RawFd, level: i32, name: i32) -> io::Result<i32> {
    let mut v: libc::c_int = 0;
    let mut l = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: passes a live c_int and its length for the kernel to fill in.
    syscall!(getsockopt(
        fd,
        level,
        name,
        (&mut v as *mut libc::c_int).cast(),
        &mut l
    ))?;
    Ok(v)
}

/// SO_LINGER {on, 0}: close resets the connection instead of leaving TIME_WAIT.
pub(crate) fn set_linger_zero(fd: RawFd) -> io::Result<()> {
    set_linger(fd, Some(Duration::ZERO))
}

/// SO_LINGER of a kernel socket (see [`set_linger`]).
pub(crate) fn linger(fd: RawFd) -> io::Result<Option<Duration>> {
    let mut l = libc::linger {
        l_onoff: 0,
        l_linger: 0,
    };
    let mut len = std::mem::size_of::<libc::linger>() as libc::socklen_t;
    // SAFETY: a live linger struct and its size, which the kernel fills in.
    syscall!(getsockopt(
        fd,
        libc::SOL_SOCKET,
        libc::SO_LINGER,
        (&mut l as *mut libc::linger).cast(),
        &mut len
    ))?;
    Ok((l.l_onoff != 0).then(|| Duration::from_secs(l.l_linger.max(0) as u64)))
}

/// SO_LINGER: `None` off, else on with the time in whole seconds (rounded up, as a kernel
/// socket keeps it).
pub(crate) fn set_linger(fd: RawFd, linger: Option<Duration>) -> io::Result<()> {
    let l = libc::linger {
        l_onoff: linger.is_some() as libc::c_int,
        l_linger: linger.map_or(0, |d| {
            (d.as_secs() + (d.subsec_nanos() > 0) as u64).min(libc::c_int::MAX as u64)
                as libc::c_int
        }),
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

/// `shutdown(2)`.
pub(crate) fn shutdown(fd: RawFd, how: i32) -> io::Result<()> {
    // SAFETY: plain call on an fd we own.
    syscall!(shutdown(fd, how))?;
    Ok(())
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

/// Block until `fd` (a socket) has a byte to read or is at EOF, honouring the file's
/// O_NONBLOCK, SO_RCVTIMEO, signals and SA_RESTART exactly as a read on it would, without
/// taking anything (MSG_PEEK). `extra` adds flags (MSG_DONTWAIT).
pub(crate) fn wait_readable(fd: RawFd, extra: i32) -> io::Result<()> {
    let mut b = [0u8; 1];
    // SAFETY: receives at most one byte into a live local buffer.
    syscall!(recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | extra))?;
    Ok(())
}

/// Whether `fd`'s file is in blocking mode (O_NONBLOCK off; `false` if it cannot be told).
pub(crate) fn is_blocking(fd: RawFd) -> bool {
    syscall!(fcntl(fd, libc::F_GETFL)).is_ok_and(|fl| fl & libc::O_NONBLOCK == 0)
}

/// Whether a read on `fd` (a socket) may sleep: O_NONBLOCK off and no SO_RCVTIMEO (a poll
/// before such a read could not keep the timeout exact).
pub(crate) fn read_may_sleep_untimed(fd: RawFd) -> bool {
    let Ok(fl) = syscall!(fcntl(fd, libc::F_GETFL)) else {
        return false;
    };
    fl & libc::O_NONBLOCK == 0 && !recv_timeout_set(fd)
}

/// Whether `fd` (a socket) has a receive timeout (SO_RCVTIMEO); `true` if it cannot be told.
pub(crate) fn recv_timeout_set(fd: RawFd) -> bool {
    let mut tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let mut len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: SO_RCVTIMEO writes at most `len` bytes into the live timeval.
    let r = syscall!(getsockopt(
        fd,
        libc::SOL_SOCKET,
        libc::SO_RCVTIMEO,
        (&mut tv as *mut libc::timeval).cast(),
        &mut len
    ));
    r.is_err() || tv.tv_sec != 0 || tv.tv_usec != 0
}

/// Block until `fd` (a socket) has room to send, honouring O_NONBLOCK, SO_SNDTIMEO, signals
/// and SA_RESTART as a write on it would: sends one filler byte once there is room.
pub(crate) fn wait_writable(fd: RawFd, extra: i32) -> io::Result<()> {
    let b = [0u8; 1];
    // SAFETY: sends one byte from a live local buffer.
    syscall!(send(fd, b.as_ptr().cast(), 1, libc::MSG_NOSIGNAL | extra))?;
    Ok(())
}

/// Bytes queued for reading on a socket (SIOCINQ).
pub(crate) fn inq(fd: RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer to a live local.
    syscall!(ioctl(fd, libc::FIONREAD, &mut n as *mut libc::c_int))?;
    Ok(n.max(0) as usize)
}

/// Bytes in a kernel TCP socket's send queue not yet acknowledged by the peer (`SIOCOUTQ`).
pub(crate) fn tcp_outq(fd: RawFd) -> io::Result<usize> {
    let mut v: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int through the pointer, which is live.
    syscall!(ioctl(fd, libc::TIOCOUTQ, &mut v as *mut libc::c_int))?;
    Ok(v.max(0) as usize)
}

/// A nonblocking, close-on-exec kernel TCP socket bound to `src`.
pub(crate) fn tcp_socket_bound(src: std::net::SocketAddr) -> io::Result<OwnedFd> {
    let family = if src.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let fd = made(|| {
        syscall!(socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0
        ))
    })?;
    let (sa, len) = sockaddr_of(src);
    // SAFETY: `sa` is a valid sockaddr of `len` bytes for the socket's family.
    syscall!(bind(
        fd.as_raw_fd(),
        &sa as *const _ as *const libc::sockaddr,
        len
    ))?;
    Ok(fd)
}

/// The MSS a doorbell (a loopback connection announcing an SDP client to a listener: the socket
/// layer's `AppListener`) asks for in its SYN: how the kernel's SO_REUSEPORT steering tells
/// doorbells from clients ([`steer_doorbells`]). No program asks for this value of its own
/// accord (loopback's is 65483).
pub(crate) const DOORBELL_MSS: u16 = 0x5344;

/// A doorbell's socket: nonblocking, close-on-exec, bound to `src` (port chosen by the kernel),
/// closed by reset (never left in TIME_WAIT; a doorbell nobody takes resets the connection it
/// queued), its SYN marked by [`DOORBELL_MSS`]; with its local address.
pub(crate) fn doorbell_socket(
    src: std::net::SocketAddr,
) -> io::Result<(OwnedFd, std::net::SocketAddr)> {
    let fd = tcp_socket_bound(src)?;
    set_linger_zero(fd.as_raw_fd())?;
    setsockopt_int(
        fd.as_raw_fd(),
        libc::IPPROTO_TCP,
        libc::TCP_MAXSEG,
        DOORBELL_MSS as i32,
    )?;
    let local = local_addr_of(fd.as_raw_fd())?;
    Ok((fd, local))
}

/// SO_ATTACH_REUSEPORT_CBPF (not in the libc crate for glibc targets).
const SO_ATTACH_REUSEPORT_CBPF: libc::c_int = 51;

/// Make the kernel put every doorbell (a SYN whose first option is an MSS of [`DOORBELL_MSS`])
/// for the SO_REUSEPORT group of listening socket `fd` in the group's socket number `index`,
/// and spread other connections by its usual hash: a classic BPF program on the group (the
/// kernel runs it with the packet's data past the TCP header, so it reads the headers from the
/// network header; an index out of range means "by hash").
pub(crate) fn steer_doorbells(fd: RawFd, index: u32) -> io::Result<()> {
    const LDB: u16 = (libc::BPF_LD | libc::BPF_B | libc::BPF_ABS) as u16;
    const LDH: u16 = (libc::BPF_LD | libc::BPF_H | libc::BPF_ABS) as u16;
    const JEQ: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const AND: u16 = (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16;
    const RET: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    const MSS_OPT: u32 = 0x0204; // kind 2, length 4
    let net = |off: i32| (libc::SKF_NET_OFF + off) as u32;
    let op = |code: u16, k: u32, jt: u8, jf: u8| libc::sock_filter { code, jt, jf, k };
    let mss = DOORBELL_MSS as u32;
    // Jumps are relative to the next instruction: to 14 (`index`) or 15 (by hash).
    let prog = [
        /* 0 */ op(LDB, net(0), 0, 0), // IPv4 without options: 0x45
        /* 1 */ op(JEQ, 0x45, 0, 4),
        /* 2 */ op(LDH, net(20 + 20), 0, 0), // the first TCP option
        /* 3 */ op(JEQ, MSS_OPT, 0, 11),
        /* 4 */ op(LDH, net(20 + 22), 0, 0),
        /* 5 */ op(JEQ, mss, 8, 9),
        /* 6 */ op(AND, 0xf0, 0, 0), // IPv6, next header TCP
        /* 7 */ op(JEQ, 0x60, 0, 7),
        /* 8 */ op(LDB, net(6), 0, 0),
        /* 9 */ op(JEQ, libc::IPPROTO_TCP as u32, 0, 5),
        /* 10 */ op(LDH, net(40 + 20), 0, 0),
        /* 11 */ op(JEQ, MSS_OPT, 0, 3),
        /* 12 */ op(LDH, net(40 + 22), 0, 0),
        /* 13 */ op(JEQ, mss, 0, 1),
        /* 14 */ op(RET, index, 0, 0),
        /* 15 */ op(RET, u32::MAX, 0, 0),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: the program and its descriptor live across the call, which copies them.
    syscall!(setsockopt(
        fd,
        libc::SOL_SOCKET,
        SO_ATTACH_REUSEPORT_CBPF,
        &fprog as *const libc::sock_fprog as *const libc::c_void,
        std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t
    ))?;
    Ok(())
}

/// Send one byte on a connecting TCP socket `fd` once its connect completes, waiting at most
/// `within` for that.
pub(crate) fn send_byte_when_connected(fd: RawFd, within: Duration) -> io::Result<()> {
    let until = std::time::Instant::now() + within;
    loop {
        // SAFETY: one byte from a live buffer.
        match syscall!(send(
            fd,
            [0u8].as_ptr().cast(),
            1,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL
        )) {
            Ok(_) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {}
            Err(e) => return Err(e),
        }
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one live pollfd.
        syscall!(poll(&mut p, 1, ms))?;
    }
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
    super::with_room(|| std::fs::read_to_string("/proc/sys/net/core/somaxconn"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(4096)
}

/// Bind (without listening) a kernel TCP socket on `addr` to reserve its port; returns the
/// socket and the port.
pub fn tcp_reserve(addr: SocketAddr) -> io::Result<(OwnedFd, u16)> {
    let fam = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let fd = made(|| syscall!(socket(fam, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0)))?;
    let (sa, len) = sockaddr_of(addr);
    // SAFETY: `sa` holds a sockaddr of `len` bytes for the socket's family.
    syscall!(bind(
        fd.as_raw_fd(),
        (&sa as *const libc::sockaddr_storage).cast(),
        len
    ))?;
    let port = local_addr_of(fd.as_raw_fd())?.port();
    Ok((fd, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddr_round_trip() {
        // The scope id of a link-local IPv6 address survives (the CM needs it to pick the link).
        for s in [
            "192.168.77.2:7471",
            "0.0.0.0:0",
            "[fe80::1%3]:9",
            "[::]:65535",
        ] {
            let a: SocketAddr = s.parse().unwrap();
            let (ss, len) = sockaddr_of(a);
            assert_eq!(sockaddr_to(&ss), Some(a), "{s}");
            let want = match a {
                SocketAddr::V4(_) => std::mem::size_of::<libc::sockaddr_in>(),
                SocketAddr::V6(_) => std::mem::size_of::<libc::sockaddr_in6>(),
            };
            assert_eq!(len as usize, want, "{s}");
        }
        let mut ss = sockaddr_of("[::1]:1".parse().unwrap()).0;
        ss.ss_family = libc::AF_UNIX as libc::sa_family_t;
        assert_eq!(sockaddr_to(&ss), None);
    }
}
