//! Unix sockets: socket pairs, abstract-name stream and seqpacket sockets, peer credentials
//! and fd passing (SCM_RIGHTS).

use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

use super::{high_owned, made, owned, LowFds};

/// A connected pair of nonblocking, close-on-exec AF_UNIX sockets of type `ty`, as the
/// kernel numbered them.
fn raw_pair(ty: libc::c_int) -> io::Result<[OwnedFd; 2]> {
    let mut fds = [-1 as libc::c_int; 2];
    // SAFETY: `fds` is a valid array of two ints the kernel fills in.
    syscall!(socketpair(
        libc::AF_UNIX,
        ty | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        0,
        fds.as_mut_ptr()
    ))?;
    // SAFETY: both fds were just returned by socketpair and are owned by nobody else.
    Ok(fds.map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// [`raw_pair`], both ends moved out of the application's numbers.
fn pair_high(ty: libc::c_int) -> io::Result<(OwnedFd, OwnedFd)> {
    let _low = LowFds::hold();
    let [a, b] = raw_pair(ty)?;
    Ok((high_owned(a)?, high_owned(b)?))
}

/// A connected pair of nonblocking, close-on-exec AF_UNIX stream sockets, above the
/// application's numbers (an application's end takes its number later, by dup3: held at the
/// lowest free one meanwhile, it would give another thread's socket or open the next).
pub(crate) fn socketpair() -> io::Result<(OwnedFd, OwnedFd)> {
    pair_high(libc::SOCK_STREAM)
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

/// Give the AF_UNIX socket `fd` (an end of a pair, unnamed) the abstract name `name` (no
/// leading NUL), which getpeername on its peer then answers.
pub(crate) fn bind_abstract(fd: RawFd, name: &[u8]) -> io::Result<()> {
    let (a, len) = abstract_addr(name)?;
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
    syscall!(bind(fd, &a as *const _ as *const libc::sockaddr, len))?;
    Ok(())
}

/// The abstract name (without its leading NUL) of the AF_UNIX socket `fd` is connected to;
/// `None` for any other socket or peer (not AF_UNIX, unnamed, a path), or not a socket.
pub(crate) fn peer_abstract_name(fd: RawFd) -> Option<Vec<u8>> {
    // SAFETY: an all-zero sockaddr_un is a valid value.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: `a` and `len` are live and describe its size; the kernel writes at most that.
    syscall!(getpeername(
        fd,
        &mut a as *mut _ as *mut libc::sockaddr,
        &mut len
    ))
    .ok()?;
    let base = std::mem::size_of::<libc::sa_family_t>();
    let len = (len as usize).min(std::mem::size_of::<libc::sockaddr_un>());
    if a.sun_family as i32 != libc::AF_UNIX || len <= base + 1 || a.sun_path[0] != 0 {
        return None;
    }
    Some(a.sun_path[1..len - base].iter().map(|&c| c as u8).collect())
}

/// A nonblocking, close-on-exec AF_UNIX stream socket listening on an abstract name.
pub(crate) fn abstract_listener(name: &[u8]) -> io::Result<OwnedFd> {
    let (a, len) = abstract_addr(name)?;
    let fd = made(|| {
        syscall!(socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0
        ))
    })?;
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
    let _low = LowFds::hold();
    // SAFETY: no address is asked for.
    match syscall!(accept4(
        fd,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        libc::SOCK_CLOEXEC
    )) {
        Ok(c) => owned(c).map(Some),
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

/// A new seqpacket socket, at the number the kernel gave it.
fn seqpacket_here() -> io::Result<OwnedFd> {
    let fd = syscall!(socket(
        libc::AF_UNIX,
        libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        0
    ))?;
    // SAFETY: a new socket, owned at once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A new seqpacket socket above the application's fds.
fn seqpacket() -> io::Result<OwnedFd> {
    made(|| Ok(seqpacket_here()?.into_raw_fd()))
}

/// A listening seqpacket socket on an abstract name.
pub fn seqpacket_listen(name: &[u8], backlog: u32) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let (a, len) = abstract_addr(name).map_err(|_| io::Error::other("rendezvous name too long"))?;
    // SAFETY: `a` is a live sockaddr_un of `len` bytes.
    syscall!(bind(
        fd.as_raw_fd(),
        (&a as *const libc::sockaddr_un).cast(),
        len
    ))?;
    syscall!(listen(fd.as_raw_fd(), backlog.clamp(1, 4096) as i32))?;
    Ok(fd)
}

/// A connected pair of nonblocking, close-on-exec seqpacket sockets (a queue of messages
/// with fds between processes that inherit both ends).
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    pair_high(libc::SOCK_SEQPACKET)
}

/// SO_PASSCRED: every message received on `fd` carries its sender's credentials, as the
/// kernel knows them ([`recv_msg_cred`]).
pub fn set_passcred(fd: BorrowedFd<'_>) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: `one` is a live c_int of the size given.
    syscall!(setsockopt(
        fd.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_PASSCRED,
        (&one as *const libc::c_int).cast(),
        size_of::<libc::c_int>() as libc::socklen_t
    ))?;
    Ok(())
}

/// Connect (nonblocking) a seqpacket socket to the first of `names` (abstract) a listener
/// holds. One socket serves every try (a refused connect leaves it unconnected) and is moved
/// above the application's fds only once connected, so a refusal costs a socket, a connect per
/// name and a close. A full queue (EAGAIN) ends the tries; otherwise the last name's error.
pub fn seqpacket_connect_first(names: &[Vec<u8>]) -> io::Result<OwnedFd> {
    let _low = LowFds::hold();
    let fd = seqpacket_here()?;
    let mut last = io::Error::from_raw_os_error(libc::ECONNREFUSED);
    for name in names {
        let (a, len) =
            abstract_addr(name).map_err(|_| io::Error::other("rendezvous name too long"))?;
        // SAFETY: `a` is a live sockaddr_un of `len` bytes.
        match syscall!(connect(
            fd.as_raw_fd(),
            (&a as *const libc::sockaddr_un).cast(),
            len
        )) {
            Ok(_) => return owned(fd.into_raw_fd()),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return Err(e),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Connect (nonblocking) to an abstract name.
#[cfg(test)]
pub fn seqpacket_connect(name: &[u8]) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let (a, len) = abstract_addr(name).map_err(|_| io::Error::other("rendezvous name too long"))?;
    // SAFETY: `a` is a live sockaddr_un of `len` bytes.
    syscall!(connect(
        fd.as_raw_fd(),
        (&a as *const libc::sockaddr_un).cast(),
        len
    ))?;
    Ok(fd)
}

/// Accept one pending connection (nonblocking); `None` if there is none.
pub fn accept(fd: BorrowedFd<'_>) -> io::Result<Option<OwnedFd>> {
    let _low = LowFds::hold();
    // SAFETY: null address arguments are allowed.
    match syscall!(accept4(
        fd.as_raw_fd(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC
    )) {
        Ok(s) => owned(s).map(Some),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The peer's (pid, uid) as the kernel recorded them at connect/listen time.
pub fn peer_cred(fd: BorrowedFd<'_>) -> io::Result<(i32, u32)> {
    // SAFETY: ucred is plain data.
    let mut c: libc::ucred = unsafe { zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `c` is a live ucred of `len` bytes.
    syscall!(getsockopt(
        fd.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_PEERCRED,
        (&mut c as *mut libc::ucred).cast(),
        &mut len
    ))?;
    Ok((c.pid, c.uid))
}

const MAX_FDS: usize = 4;

/// Send one message with up to four fds; never blocks (`WouldBlock` if the socket is full).
pub fn send_msg(fd: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS);
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE((fds.len() * size_of::<RawFd>()) as u32) } as usize;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: msg_control points at `cbuf` (64 bytes, 8-aligned), which holds `space`
        // bytes for up to four fds; the first header is inside it.
        unsafe {
            let cm = libc::CMSG_FIRSTHDR(&msg);
            (*cm).cmsg_level = libc::SOL_SOCKET;
            (*cm).cmsg_type = libc::SCM_RIGHTS;
            (*cm).cmsg_len = libc::CMSG_LEN((fds.len() * size_of::<RawFd>()) as u32) as usize;
            let p = libc::CMSG_DATA(cm) as *mut RawFd;
            for (i, f) in fds.iter().enumerate() {
                p.add(i).write_unaligned(f.as_raw_fd());
            }
        }
    }
    // SAFETY: `msg` describes live buffers (iov over `data`, control over `cbuf`).
    let n = syscall!(sendmsg(
        fd.as_raw_fd(),
        &msg,
        libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT
    ))?;
    if n as usize != data.len() {
        return Err(io::Error::other("short seqpacket send"));
    }
    Ok(())
}

/// What [`recv_msg`] got.
pub enum Recv {
    /// Nothing to read now.
    Empty,
    /// The peer closed (or died).
    Eof,
    /// A message of this many bytes, with the fds it carried.
    Msg(usize, Vec<OwnedFd>),
}

/// Receive one message (nonblocking) with the fds it carries.
pub fn recv_msg(fd: BorrowedFd<'_>, buf: &mut [u8]) -> Recv {
    recv_msg_cred(fd, buf, &mut None)
}

/// [`recv_msg`], and the sender's (pid, uid) in `cred` when the message carries them
/// (SCM_CREDENTIALS: the kernel's, on a socket with [`set_passcred`]).
pub fn recv_msg_cred(fd: BorrowedFd<'_>, buf: &mut [u8], cred: &mut Option<(i32, u32)>) -> Recv {
    recv_msg_inner(fd, buf, cred, true)
}

fn recv_msg_inner(
    fd: BorrowedFd<'_>,
    buf: &mut [u8],
    cred: &mut Option<(i32, u32)>,
    after_reset: bool,
) -> Recv {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // Room for four fds and one set of credentials.
    let mut cbuf = [0u64; 12];
    // SAFETY: msghdr is plain data.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // Fds the message carries come at the lowest free numbers, until moved below.
    let _low = LowFds::hold();
    // SAFETY: `msg` describes live buffers.
    let n = match syscall!(recvmsg(
        fd.as_raw_fd(),
        &mut msg,
        libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC
    )) {
        Ok(n) => n as usize,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Recv::Empty,
        Err(e) if e.kind() == io::ErrorKind::Interrupted => return Recv::Empty,
        Err(e) if after_reset && e.raw_os_error() == Some(libc::ECONNRESET) => {
            // The peer closed with a message of ours unread, and the kernel reports that
            // before the messages it sent first (a listener's REJ, then its close): the error
            // is reported once, so the next receive gets them; then the end.
            return match recv_msg_inner(fd, buf, cred, false) {
                Recv::Empty => Recv::Eof,
                r => r,
            };
        }
        Err(_) => return Recv::Eof,
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`, within
    // msg_controllen; each SCM_RIGHTS payload holds (cmsg_len - CMSG_LEN(0)) / 4 fds that are
    // now ours, an SCM_CREDENTIALS one a ucred (its length checked).
    unsafe {
        let mut cm = libc::CMSG_FIRSTHDR(&msg);
        while !cm.is_null() {
            if (*cm).cmsg_level == libc::SOL_SOCKET && (*cm).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cm).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(cm) as *const RawFd;
                for i in 0..bytes / size_of::<RawFd>() {
                    // One with no number out of the application's range: the message is
                    // lost below, as if the peer had gone (what it sets up fails).
                    fds.push(owned(p.add(i).read_unaligned()));
                }
            } else if (*cm).cmsg_level == libc::SOL_SOCKET
                && (*cm).cmsg_type == libc::SCM_CREDENTIALS
                && (*cm).cmsg_len as usize
                    >= libc::CMSG_LEN(size_of::<libc::ucred>() as u32) as usize
            {
                let c = (libc::CMSG_DATA(cm) as *const libc::ucred).read_unaligned();
                *cred = Some((c.pid, c.uid));
            }
            cm = libc::CMSG_NXTHDR(&msg, cm);
        }
    }
    if n == 0 && fds.is_empty() {
        return Recv::Eof;
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        // Oversized or with too many fds: drop it (the fds close with the Vec).
        return Recv::Msg(0, Vec::new());
    }
    match fds.into_iter().collect::<io::Result<Vec<_>>>() {
        Ok(fds) => Recv::Msg(n, fds),
        Err(_) => Recv::Eof,
    }
}
