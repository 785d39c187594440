//! The system-call layer of the shm provider: every `unsafe` of the provider lives here.
//!
//! Thin wrappers over libc (memfd, mmap, eventfd, epoll, timerfd, Unix seqpacket sockets with
//! SCM_RIGHTS, SO_PEERCRED, process_vm_readv/writev, getifaddrs), mio-style: the `syscall!`
//! macro turns `-1` into `io::Error`.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// Call a libc function, mapping `-1` to the thread's `errno`.
macro_rules! syscall {
    ($fn:ident ( $($arg:expr),* $(,)? )) => {{
        // SAFETY: every caller passes arguments valid for this system call (pointers to live
        // buffers of the stated length, fds it owns or borrows); see the call sites.
        #[allow(unused_unsafe)]
        let res = unsafe { libc::$fn($($arg),*) };
        if res == -1 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(res)
        }
    }};
}

pub fn getpid() -> i32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

pub fn getuid() -> u32 {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() }
}

fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: `fd` was just returned by a successful system call that created it; nobody
    // else owns it.
    unsafe { OwnedFd::from_raw_fd(high_fd(fd)) }
}

/// Move an fd this library made for itself to a high number (close-on-exec), so the low numbers
/// stay the application's, as they would be without SDP: programs size tables by the fds they
/// get (wrk, select's FD_SETSIZE) or expect the lowest free one. The floor is half the soft
/// RLIMIT_NOFILE, at most 1024; the fd stays where it is if nothing is free there.
pub fn high_fd(fd: RawFd) -> RawFd {
    static FLOOR: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    let floor = *FLOOR.get_or_init(|| {
        // SAFETY: an all-zero rlimit is valid; getrlimit writes into it.
        let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
            return 0;
        }
        (r.rlim_cur / 2).min(1024) as i32
    });
    if fd < 0 || fd >= floor {
        return fd;
    }
    // SAFETY: duplicates an fd we own; the original is closed only if that worked.
    let hi = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, floor) };
    if hi < 0 {
        return fd;
    }
    // SAFETY: `fd` is ours and replaced by `hi`.
    unsafe { libc::close(fd) };
    hi
}

/// A shared mapping of a file (or anonymous memory), unmapped on drop.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory; all shared accesses go through atomics or explicit
// byte copies, so it may be used from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes of `fd` shared, read-write or read-only.
    pub fn map(fd: BorrowedFd<'_>, len: usize, writable: bool) -> io::Result<Mapping> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh mapping at an address the kernel picks; no existing memory affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?,
            len,
        })
    }

    /// `len` zeroed private bytes (at least one page).
    pub fn anon(len: usize) -> io::Result<Mapping> {
        let len = len.max(1);
        // SAFETY: a fresh anonymous mapping; no existing memory affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?,
            len,
        })
    }

    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// The `u32` at byte offset `off` (our own layout constant; checked).
    pub fn u32(&self, off: usize) -> &AtomicU32 {
        assert!(
            off & 3 == 0 && off + 4 <= self.len,
            "u32 at {off} outside mapping"
        );
        // SAFETY: in bounds and aligned (the mapping is page aligned); AtomicU32 has the layout
        // of u32 and tolerates concurrent access from the peer.
        unsafe { &*(self.ptr.as_ptr().add(off) as *const AtomicU32) }
    }

    /// The `u64` at byte offset `off` (checked).
    pub fn u64(&self, off: usize) -> &AtomicU64 {
        assert!(
            off & 7 == 0 && off + 8 <= self.len,
            "u64 at {off} outside mapping"
        );
        // SAFETY: as for `u32`.
        unsafe { &*(self.ptr.as_ptr().add(off) as *const AtomicU64) }
    }

    /// Copy bytes out of the mapping (checked bounds).
    pub fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        assert!(off.checked_add(dst.len()).is_some_and(|e| e <= self.len));
        // SAFETY: the source range is inside the mapping, the destination is a live slice;
        // they cannot overlap (the slice is not inside a shared ring we copy from).
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        }
    }

    /// Copy bytes into the mapping (checked bounds).
    pub fn write_bytes(&self, off: usize, src: &[u8]) {
        assert!(off.checked_add(src.len()).is_some_and(|e| e <= self.len));
        // SAFETY: the destination range is inside the mapping, the source is a live slice.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len())
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range; nobody uses it after the Mapping is gone.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Copy `dst.len()` bytes from the local address `addr`.
///
/// # Safety
/// `addr..addr + dst.len()` must be mapped and readable for the duration of the call.
pub unsafe fn copy_from_addr(addr: u64, dst: &mut [u8]) {
    // SAFETY: the caller guarantees the source range; the destination is a live slice.
    unsafe { std::ptr::copy(addr as usize as *const u8, dst.as_mut_ptr(), dst.len()) }
}

/// Copy `src` to the local address `addr`.
///
/// # Safety
/// `addr..addr + src.len()` must be mapped, writable and not referenced by any Rust reference
/// for the duration of the call.
pub unsafe fn copy_to_addr(addr: u64, src: &[u8]) {
    // SAFETY: the caller guarantees the destination range.
    unsafe { std::ptr::copy(src.as_ptr(), addr as usize as *mut u8, src.len()) }
}

/// A memfd of `len` bytes, sealed against shrinking and growing (so a peer that shares it can
/// never make our mapping fault).
pub fn memfd_sealed(name: &str, len: usize) -> io::Result<OwnedFd> {
    let fd = memfd_sized(name, len)?;
    syscall!(fcntl(
        fd.as_raw_fd(),
        libc::F_ADD_SEALS,
        libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL
    ))?;
    Ok(fd)
}

/// A memfd of `len` bytes sealed against shrinking and growing, still open to more seals:
/// map it writable, then [`seal_future_writes`].
pub fn memfd_sized(name: &str, len: usize) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(|_| io::Error::other("bad memfd name"))?;
    let fd = owned(syscall!(memfd_create(
        cname.as_ptr(),
        libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING
    ))?);
    syscall!(ftruncate(fd.as_raw_fd(), len as libc::off_t))?;
    syscall!(fcntl(
        fd.as_raw_fd(),
        libc::F_ADD_SEALS,
        libc::F_SEAL_SHRINK | libc::F_SEAL_GROW
    ))?;
    Ok(fd)
}

/// Seal a memfd against every later write access (`F_SEAL_FUTURE_WRITE`, then `F_SEAL_SEAL`):
/// mappings that exist keep writing, but nobody holding the file (or reopening it through
/// `/proc/PID/fd`) can `write(2)` it, map it writable, or `mprotect` a mapping writable.
pub fn seal_future_writes(fd: BorrowedFd<'_>) -> io::Result<()> {
    syscall!(fcntl(
        fd.as_raw_fd(),
        libc::F_ADD_SEALS,
        libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL
    ))?;
    Ok(())
}

/// The ways a holder of `fd` could write the file behind it that work (for tests): reopen
/// through `/proc/self/fd` read-write, then `pwrite`, `mmap` writable shared, `mmap` read-only
/// and `mprotect` writable.
#[cfg(test)]
pub fn write_paths(fd: BorrowedFd<'_>) -> Vec<&'static str> {
    use std::os::fd::AsFd;
    let mut ok = Vec::new();
    let path = format!("/proc/self/fd/{}\0", fd.as_raw_fd());
    let Ok(rw) = syscall!(open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC)) else {
        return ok;
    };
    let rw = owned(rw);
    ok.push("reopen O_RDWR");
    let b = [0x77u8; 8];
    // SAFETY: writes 8 bytes from a live array.
    if syscall!(pwrite(rw.as_raw_fd(), b.as_ptr().cast(), 8, 4096)).is_ok_and(|n| n == 8) {
        ok.push("pwrite");
    }
    if Mapping::map(rw.as_fd(), 4096, true).is_ok() {
        ok.push("mmap PROT_WRITE");
    }
    if let Ok(m) = Mapping::map(rw.as_fd(), 4096, false) {
        // SAFETY: changes the protection of our own fresh mapping only.
        if syscall!(mprotect(
            m.ptr().as_ptr().cast(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE
        ))
        .is_ok()
        {
            ok.push("mprotect PROT_WRITE");
        }
    }
    ok
}

/// Size of a file, and whether it is sealed against shrinking (a memfd we may map safely).
pub fn sealed_size(fd: BorrowedFd<'_>) -> io::Result<(usize, bool)> {
    // SAFETY: stat is plain data; zeroed is a valid value.
    let mut st: libc::stat = unsafe { zeroed() };
    // SAFETY: `st` is a live, writable stat buffer.
    syscall!(fstat(fd.as_raw_fd(), &mut st))?;
    let seals = syscall!(fcntl(fd.as_raw_fd(), libc::F_GET_SEALS))?;
    let mode_ok = st.st_mode & libc::S_IFMT == libc::S_IFREG;
    Ok((
        st.st_size as usize,
        mode_ok && seals & libc::F_SEAL_SHRINK != 0,
    ))
}

/// Reopen a memfd read-only (a new open file description the peer cannot map writable).
pub fn reopen_readonly(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}\0", fd.as_raw_fd());
    Ok(owned(syscall!(open(
        path.as_ptr().cast(),
        libc::O_RDONLY | libc::O_CLOEXEC
    ))?))
}

pub fn eventfd() -> io::Result<OwnedFd> {
    Ok(owned(syscall!(eventfd(
        0,
        libc::EFD_NONBLOCK | libc::EFD_CLOEXEC
    ))?))
}

/// Add one to an eventfd (never blocks: a full counter is already readable).
pub fn eventfd_signal(fd: BorrowedFd<'_>) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64.
    let _ = syscall!(write(fd.as_raw_fd(), (&one as *const u64).cast(), 8));
}

/// Read (reset) an eventfd or timerfd counter; nonblocking.
pub fn drain_counter(fd: BorrowedFd<'_>) {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64.
    let _ = syscall!(read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8));
}

pub fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    let fl = syscall!(fcntl(fd.as_raw_fd(), libc::F_GETFL))?;
    syscall!(fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK))?;
    Ok(())
}

pub fn epoll_create() -> io::Result<OwnedFd> {
    Ok(owned(syscall!(epoll_create1(libc::EPOLL_CLOEXEC))?))
}

/// Register `fd` with `token`; `edge`: edge-triggered.
pub fn epoll_add(ep: BorrowedFd<'_>, fd: RawFd, token: u64, edge: bool) -> io::Result<()> {
    let mut events = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
    if edge {
        events |= libc::EPOLLET as u32;
    }
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: `ev` is a live epoll_event.
    syscall!(epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev))?;
    Ok(())
}

/// Remove `fd` from the set.
pub fn epoll_del(ep: BorrowedFd<'_>, fd: RawFd) {
    let mut ev = libc::epoll_event { events: 0, u64: 0 };
    // SAFETY: `ev` is a live epoll_event (ignored by DEL).
    let _ = syscall!(epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut ev));
}

/// Take every ready event without waiting; calls `f(token)` for each.
pub fn epoll_drain(ep: BorrowedFd<'_>, mut f: impl FnMut(u64)) {
    // SAFETY: epoll_event is plain data.
    let mut evs: [libc::epoll_event; 64] = unsafe { zeroed() };
    loop {
        // SAFETY: `evs` is a live array of 64 events.
        let n = match syscall!(epoll_wait(ep.as_raw_fd(), evs.as_mut_ptr(), 64, 0)) {
            Ok(n) => n as usize,
            Err(_) => return,
        };
        for ev in &evs[..n] {
            let token = ev.u64;
            f(token);
        }
        if n < 64 {
            return;
        }
    }
}

/// Wait on an epoll fd (for tests and simple progress loops); returns whether it fired.
pub fn poll_readable(fd: RawFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is one live pollfd.
    matches!(syscall!(poll(&mut p, 1, timeout_ms)), Ok(n) if n > 0)
}

/// Whether `fd` reports a hang-up (or an error) right now.
pub fn hung_up(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    };
    // SAFETY: `p` is one live pollfd.
    matches!(syscall!(poll(&mut p, 1, 0)), Ok(n) if n > 0)
        && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

/// Milliseconds of CLOCK_MONOTONIC_COARSE (a few ms of resolution; cheaper to read than the
/// precise clock, which matters where every connection asks it in every progress round).
pub fn coarse_ms() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a live timespec; CLOCK_MONOTONIC_COARSE always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) };
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

pub fn timerfd() -> io::Result<OwnedFd> {
    Ok(owned(syscall!(timerfd_create(
        libc::CLOCK_MONOTONIC,
        libc::TFD_NONBLOCK | libc::TFD_CLOEXEC
    ))?))
}

/// Fire once after `ns` nanoseconds (0 disarms).
pub fn timerfd_set(fd: BorrowedFd<'_>, ns: u64) {
    let spec = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: (ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (ns % 1_000_000_000) as libc::c_long,
        },
    };
    // SAFETY: `spec` is a live itimerspec; the old value is not wanted.
    let _ = syscall!(timerfd_settime(
        fd.as_raw_fd(),
        0,
        &spec,
        std::ptr::null_mut()
    ));
}

fn unix_addr(name: &[u8]) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data.
    let mut a: libc::sockaddr_un = unsafe { zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() + 1 > a.sun_path.len() {
        return Err(io::Error::other("rendezvous name too long"));
    }
    // Abstract namespace: a leading NUL, then the name (not NUL terminated).
    for (i, b) in name.iter().enumerate() {
        a.sun_path[i + 1] = *b as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + 1 + name.len();
    Ok((a, len as libc::socklen_t))
}

fn seqpacket() -> io::Result<OwnedFd> {
    Ok(owned(syscall!(socket(
        libc::AF_UNIX,
        libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        0
    ))?))
}

/// A listening seqpacket socket on an abstract name.
pub fn seqpacket_listen(name: &[u8], backlog: u32) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let (a, len) = unix_addr(name)?;
    // SAFETY: `a` is a live sockaddr_un of `len` bytes.
    syscall!(bind(
        fd.as_raw_fd(),
        (&a as *const libc::sockaddr_un).cast(),
        len
    ))?;
    syscall!(listen(fd.as_raw_fd(), backlog.clamp(1, 4096) as i32))?;
    Ok(fd)
}

/// Connect (nonblocking) to an abstract name.
pub fn seqpacket_connect(name: &[u8]) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let (a, len) = unix_addr(name)?;
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
    // SAFETY: null address arguments are allowed.
    match syscall!(accept4(
        fd.as_raw_fd(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC
    )) {
        Ok(s) => Ok(Some(owned(s))),
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
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: `msg` describes live buffers.
    let n = match syscall!(recvmsg(
        fd.as_raw_fd(),
        &mut msg,
        libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC
    )) {
        Ok(n) => n as usize,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Recv::Empty,
        Err(e) if e.kind() == io::ErrorKind::Interrupted => return Recv::Empty,
        Err(_) => return Recv::Eof,
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`, within
    // msg_controllen; each SCM_RIGHTS payload holds (cmsg_len - CMSG_LEN(0)) / 4 fds that are
    // now ours.
    unsafe {
        let mut cm = libc::CMSG_FIRSTHDR(&msg);
        while !cm.is_null() {
            if (*cm).cmsg_level == libc::SOL_SOCKET && (*cm).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cm).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(cm) as *const RawFd;
                for i in 0..bytes / size_of::<RawFd>() {
                    fds.push(owned(p.add(i).read_unaligned()));
                }
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
    Recv::Msg(n, fds)
}

/// `SO_PEERPIDFD` (Linux 6.5; the same number on every architecture but sparc, mips, parisc
/// and alpha, which libc 0.2 does not export for them all).
const SO_PEERPIDFD: libc::c_int = 77;

/// The peer process of a connection, by pidfd: every copy to or from it goes through here, so
/// a copy can only reach the very process that connected, never one that got its pid after it
/// died (`process_vm_*` take a pid, not a pidfd: see [`Proc::write`] for the window left).
pub struct Proc {
    pid: i32,
    pidfd: OwnedFd,
    /// When `alive` last saw the process running (ns since `epoch()`; 0: never).
    seen: AtomicU64,
}

/// How long a liveness check is trusted: copies within this of the last check skip the
/// system call (one `poll` costs ~0.3-1 us, a 64 KiB copy ~5 us). A dead peer's pid would
/// have to be reaped and handed out again (the allocator wraps around `pid_max` first) within
/// this time to be written.
pub const LIVENESS_TRUST: std::time::Duration = std::time::Duration::from_millis(1);

fn epoch() -> std::time::Instant {
    static E: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *E.get_or_init(std::time::Instant::now)
}

impl Proc {
    /// The process at the other end of the connected Unix socket `sock`, whose `SO_PEERCRED`
    /// pid is `pid`: `SO_PEERPIDFD` (the kernel's own reference, taken at connect/listen), or
    /// on kernels before 6.5 `pidfd_open(pid)` followed by a check that the peer still holds
    /// its end of the socket (a process that got the pid after the peer died cannot hold it,
    /// unless the peer passed it on before dying: the window of the fallback).
    pub fn of_peer(sock: BorrowedFd<'_>, pid: i32) -> io::Result<Proc> {
        let mut fd: libc::c_int = -1;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `fd` is a live c_int of `len` bytes.
        let r = syscall!(getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len
        ));
        if r.is_ok() && fd >= 0 {
            return Ok(Proc {
                pid,
                pidfd: owned(fd),
                seen: AtomicU64::new(0),
            });
        }
        let p = Proc::open(pid)?;
        if hung_up(sock.as_raw_fd()) || !p.alive() {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(p)
    }

    /// `pidfd_open(pid)`: the process that has `pid` now.
    pub fn open(pid: i32) -> io::Result<Proc> {
        // SAFETY: pidfd_open takes a pid and flags; no memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Proc {
            pid,
            pidfd: owned(fd as RawFd),
            seen: AtomicU64::new(0),
        })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// [`Proc::alive`], trusting a check younger than [`LIVENESS_TRUST`] (for the copies).
    pub fn alive_recently(&self) -> bool {
        let now = epoch().elapsed().as_nanos() as u64 + 1;
        let seen = self.seen.load(std::sync::atomic::Ordering::Relaxed);
        if seen != 0 && now.saturating_sub(seen) < LIVENESS_TRUST.as_nanos() as u64 {
            return true;
        }
        let alive = self.alive();
        if alive {
            self.seen.store(now, std::sync::atomic::Ordering::Relaxed);
        }
        alive
    }

    /// Whether the process is still running: a pidfd polls readable once it has exited (every
    /// thread past `exit_notify`, so none of its system calls, copies included, is still
    /// running), and its pid cannot have been given to another process before that.
    pub fn alive(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `p` is one live pollfd.
        !matches!(syscall!(poll(&mut p, 1, 0)), Ok(n) if n > 0)
    }

    /// Wait up to `limit` for the process to exit; whether it did.
    pub fn exits_within(&self, limit: std::time::Duration) -> bool {
        let mut p = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = limit.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `p` is one live pollfd.
        matches!(syscall!(poll(&mut p, 1, ms)), Ok(n) if n > 0)
    }

    fn gone() -> io::Error {
        io::Error::from_raw_os_error(libc::ESRCH)
    }

    /// `Ok` if the process is alive (checked within [`LIVENESS_TRUST`]), else `ESRCH`.
    pub fn check(&self) -> io::Result<()> {
        if self.alive_recently() {
            Ok(())
        } else {
            Err(Proc::gone())
        }
    }

    /// One copy of a batch the caller brackets with [`Proc::check`]: before the first (and,
    /// for reads, after the last) copy.
    ///
    /// # Safety
    /// As [`vm_write`].
    pub unsafe fn write_in_batch(&self, local: u64, remote: u64, len: usize) -> io::Result<()> {
        // SAFETY: the caller's contract.
        unsafe { vm_write(self.pid, local, remote, len) }
    }

    /// As [`Proc::write_in_batch`], reading.
    ///
    /// # Safety
    /// As [`vm_read`].
    pub unsafe fn read_in_batch(&self, local: u64, remote: u64, len: usize) -> io::Result<()> {
        // SAFETY: the caller's contract.
        unsafe { vm_read(self.pid, local, remote, len) }
    }

    /// Copy `len` bytes from our `local` address into the process at `remote`; `ESRCH` if it
    /// has exited. What is left: the process may exit, be reaped and its pid be handed to a new
    /// process between the liveness check (at most [`LIVENESS_TRUST`] old) and the copy's
    /// system call (the pid allocator would have to wrap around `pid_max` in between).
    ///
    /// # Safety
    /// As [`vm_write`].
    pub unsafe fn write(&self, local: u64, remote: u64, len: usize) -> io::Result<()> {
        if !self.alive_recently() {
            return Err(Proc::gone());
        }
        // SAFETY: the caller's contract.
        unsafe { vm_write(self.pid, local, remote, len) }
    }

    /// Copy `len` bytes from the process at `remote` to our `local` address; `ESRCH` if it has
    /// exited (checked as for [`Proc::write`]).
    ///
    /// # Safety
    /// As [`vm_read`].
    pub unsafe fn read(&self, local: u64, remote: u64, len: usize) -> io::Result<()> {
        if !self.alive_recently() {
            return Err(Proc::gone());
        }
        // SAFETY: the caller's contract.
        unsafe { vm_read(self.pid, local, remote, len) }
    }
}

/// Copy `len` bytes from our `local` address into process `pid` at `remote`.
/// Returns `Err` (with errno) unless every byte was written.
///
/// # Safety
/// `local..local + len` must be mapped and readable in this process.
unsafe fn vm_write(pid: i32, local: u64, remote: u64, len: usize) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let l = libc::iovec {
            iov_base: (local as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let r = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the kernel reads our range (valid per the caller) and writes the other
        // process; a bad remote range is an error (EFAULT), not undefined behaviour here.
        let n = syscall!(process_vm_writev(pid, &l, 1, &r, 1, 0))? as usize;
        if n == 0 {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        done += n;
    }
    Ok(())
}

/// Copy `len` bytes from process `pid` at `remote` to our `local` address.
///
/// # Safety
/// `local..local + len` must be mapped, writable, and not referenced by Rust references.
unsafe fn vm_read(pid: i32, local: u64, remote: u64, len: usize) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let l = libc::iovec {
            iov_base: (local as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let r = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the kernel writes our range (valid per the caller) from the other process.
        let n = syscall!(process_vm_readv(pid, &l, 1, &r, 1, 0))? as usize;
        if n == 0 {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        done += n;
    }
    Ok(())
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

/// Bind (without listening) a kernel TCP socket on `addr` to reserve its port; returns the
/// socket and the port.
pub fn tcp_reserve(addr: SocketAddr) -> io::Result<(OwnedFd, u16)> {
    let fam = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let fd = owned(syscall!(socket(
        fam,
        libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
        0
    ))?);
    // SAFETY: sockaddr_storage is plain data.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            s.sin_family = libc::AF_INET as libc::sa_family_t;
            s.sin_port = a.port().to_be();
            s.sin_addr.s_addr = u32::from(*a.ip()).to_be();
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in6.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            s.sin6_port = a.port().to_be();
            s.sin6_addr.s6_addr = a.ip().octets();
            s.sin6_scope_id = a.scope_id();
            size_of::<libc::sockaddr_in6>()
        }
    };
    // SAFETY: `ss` holds a sockaddr of `len` bytes.
    syscall!(bind(
        fd.as_raw_fd(),
        (&ss as *const libc::sockaddr_storage).cast(),
        len as libc::socklen_t
    ))?;
    let mut out_len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `ss` is a live sockaddr_storage of `out_len` bytes.
    syscall!(getsockname(
        fd.as_raw_fd(),
        (&mut ss as *mut libc::sockaddr_storage).cast(),
        &mut out_len
    ))?;
    let port = match addr {
        // SAFETY: the kernel wrote a sockaddr of our family.
        SocketAddr::V4(_) => {
            u16::from_be(unsafe { (*(&ss as *const _ as *const libc::sockaddr_in)).sin_port })
        }
        // SAFETY: as above.
        SocketAddr::V6(_) => {
            u16::from_be(unsafe { (*(&ss as *const _ as *const libc::sockaddr_in6)).sin6_port })
        }
    };
    Ok((fd, port))
}

/// Memory at a fixed address that the provider does not own (a caller's buffer given to
/// `reg_mr_at`) or owns through a [`Mapping`] held next to it.
pub struct RawBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain memory; copies in and out are explicit.
unsafe impl Send for RawBuf {}
// SAFETY: as above.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// # Safety
    /// `ptr..ptr + len` must stay mapped and writable for the life of the RawBuf.
    pub unsafe fn new(ptr: NonNull<u8>, len: usize) -> RawBuf {
        RawBuf { ptr, len }
    }
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        assert!(
            off.checked_add(dst.len()).is_some_and(|e| e <= self.len),
            "memory region read out of bounds"
        );
        // SAFETY: in bounds of memory valid for our life (constructor contract).
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len()) }
    }
    pub fn write(&self, off: usize, src: &[u8]) {
        assert!(
            off.checked_add(src.len()).is_some_and(|e| e <= self.len),
            "memory region write out of bounds"
        );
        // SAFETY: in bounds of memory valid for our life (constructor contract).
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.as_ptr().add(off), src.len()) }
    }
}

static PROBE: u64 = 0x5344_505f_5348_4d21;

/// Address of a word the peer reads with process_vm_readv to prove it can reach our memory.
pub fn probe_addr() -> u64 {
    &PROBE as *const u64 as u64
}

/// Whether we can read the probe word at `addr` of the process (ptrace access, right process).
pub fn probe(p: &Proc, addr: u64) -> io::Result<bool> {
    let mut v: u64 = 0;
    // SAFETY: the local range is the live `v`.
    unsafe { p.read((&mut v as *mut u64) as u64, addr, 8)? };
    Ok(v == PROBE)
}
