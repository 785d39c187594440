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
    // SAFETY: both fds were just returned by socketpair and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A nonblocking, close-on-exec eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    let fd = syscall!(eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC))?;
    // SAFETY: the fd was just returned by eventfd and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Add `n` to an eventfd's counter.
pub(crate) fn eventfd_signal(fd: &OwnedFd) {
    let v: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64; an error (counter full) is harmless.
    let _ = syscall!(write(fd.as_raw_fd(), (&v as *const u64).cast(), 8));
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

/// Process id (a real syscall; glibc does not cache it).
pub(crate) fn getpid() -> u32 {
    // SAFETY: getpid cannot fail.
    unsafe { libc::getpid() as u32 }
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
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: `ev` is a live epoll_event; `fd` is an open fd owned by the caller.
        syscall!(epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev))?;
    }
    Ok(ep)
}

/// This host's interface addresses.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn local_ips() -> Vec<std::net::IpAddr> {
    crate::verbs::shm::sys::local_addrs()
}
