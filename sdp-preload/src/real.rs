//! The real libc functions, found with `dlsym(RTLD_NEXT)` on first use.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Look up `name` (NUL-terminated) in the libraries after this one.
pub(crate) fn lookup(name: &[u8]) -> usize {
    // SAFETY: `name` is a NUL-terminated symbol name; dlsym only reads it.
    unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) as usize }
}

/// Resolve once and cache in `slot`.
#[inline]
pub(crate) fn cached(slot: &AtomicUsize, name: &[u8]) -> usize {
    let p = slot.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    resolve(slot, name)
}

/// The first call's lookup, out of line (a hook's way to libc stays a load and a jump).
#[cold]
#[inline(never)]
fn resolve(slot: &AtomicUsize, name: &[u8]) -> usize {
    let p = lookup(name);
    if p == 0 {
        // Without the real function nothing can work: say so and stop.
        let msg = b"sdp-preload: a libc function is missing\n";
        // SAFETY: writes a static buffer to stderr.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
        // SAFETY: abort never returns.
        unsafe { libc::abort() };
    }
    slot.store(p, Ordering::Relaxed);
    p
}

/// Declare `real::NAME(args) -> ret`, calling the next definition of the C function `NAME`.
macro_rules! real_fns {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty; )*) => {
        $(
            #[allow(clippy::missing_safety_doc)]
            #[inline]
            pub(crate) unsafe fn $name($($arg: $ty),*) -> $ret {
                static SLOT: AtomicUsize = AtomicUsize::new(0);
                /// The first call: look the function up, then call it (out of line, so
                /// that the usual way is a load and a jump, with no frame to set up).
                #[cold]
                #[inline(never)]
                unsafe fn first_call($($arg: $ty),*) -> $ret {
                    let p = cached(&SLOT, concat!(stringify!($name), "\0").as_bytes());
                    // SAFETY: `p` is the address of the C function of this name and
                    // signature.
                    let f: unsafe extern "C" fn($($ty),*) -> $ret =
                        unsafe { std::mem::transmute(p) };
                    // SAFETY: the caller passes the arguments the C function expects.
                    unsafe { f($($arg),*) }
                }
                let p = SLOT.load(Ordering::Relaxed);
                if p == 0 {
                    // SAFETY: the caller's arguments.
                    return unsafe { first_call($($arg),*) };
                }
                // SAFETY: `p` is the address of the C function of this name and signature.
                let f: unsafe extern "C" fn($($ty),*) -> $ret = unsafe { std::mem::transmute(p) };
                // SAFETY: the caller passes the arguments the C function expects.
                unsafe { f($($arg),*) }
            }
        )*
    };
}

use libc::{c_int, c_void, iovec, msghdr, size_t, sockaddr, socklen_t, ssize_t};

/// `epoll_pwait2`: libc's (glibc 2.35 and later), or the system call where libc has none (a
/// program may find ours through the shim on an older libc).
#[allow(clippy::missing_safety_doc)]
pub(crate) unsafe fn epoll_pwait2(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    type F = unsafe extern "C" fn(
        c_int,
        *mut libc::epoll_event,
        c_int,
        *const libc::timespec,
        *const libc::sigset_t,
    ) -> c_int;
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    let mut p = SLOT.load(Ordering::Relaxed);
    if p == 0 {
        p = lookup(b"epoll_pwait2\0").max(1);
        SLOT.store(p, Ordering::Relaxed);
    }
    if p == 1 {
        // SAFETY: the caller's arguments, as the system call takes them (the kernel's
        // sigset is 8 bytes).
        return unsafe { libc::syscall(libc::SYS_epoll_pwait2, epfd, ev, max, ts, mask, 8) }
            as c_int;
    }
    // SAFETY: `p` is libc's epoll_pwait2.
    let f: F = unsafe { std::mem::transmute(p) };
    // SAFETY: the caller passes the arguments epoll_pwait2 expects.
    unsafe { f(epfd, ev, max, ts, mask) }
}

real_fns! {
    fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int;
    fn epoll_wait(epfd: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: c_int) -> c_int;
    fn epoll_pwait(
        epfd: c_int,
        ev: *mut libc::epoll_event,
        max: c_int,
        timeout: c_int,
        mask: *const libc::sigset_t
    ) -> c_int;
    fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int;
    fn ppoll(
        fds: *mut libc::pollfd,
        n: libc::nfds_t,
        ts: *const libc::timespec,
        mask: *const libc::sigset_t
    ) -> c_int;
    fn select(
        nfds: c_int,
        r: *mut libc::fd_set,
        w: *mut libc::fd_set,
        e: *mut libc::fd_set,
        tv: *mut libc::timeval
    ) -> c_int;
    fn pselect(
        nfds: c_int,
        r: *mut libc::fd_set,
        w: *mut libc::fd_set,
        e: *mut libc::fd_set,
        ts: *const libc::timespec,
        mask: *const libc::sigset_t
    ) -> c_int;
    fn __poll_chk(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int, len: size_t) -> c_int;
    fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int;
    fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    fn listen(fd: c_int, backlog: c_int) -> c_int;
    fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    fn close(fd: c_int) -> c_int;
    fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t;
    fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t;
    fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    fn recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    fn sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t;
    fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    fn shutdown(fd: c_int, how: c_int) -> c_int;
    fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn getsockopt(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int;
    fn setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int;
    fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int;
    fn ioctl(fd: c_int, req: libc::c_ulong, arg: usize) -> c_int;
    fn dup(fd: c_int) -> c_int;
    fn close_range(first: libc::c_uint, last: libc::c_uint, flags: c_int) -> c_int;
    fn epoll_create(size: c_int) -> c_int;
    fn epoll_create1(flags: c_int) -> c_int;
    fn closefrom(low: c_int) -> ();
    fn recvmmsg(fd: c_int, v: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int, t: *mut libc::timespec) -> c_int;
    fn sendmmsg(fd: c_int, v: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int) -> c_int;
    fn sendfile(out: c_int, inp: c_int, off: *mut libc::off_t, n: size_t) -> ssize_t;
    fn sendfile64(out: c_int, inp: c_int, off: *mut libc::off64_t, n: size_t) -> ssize_t;
    fn pread64(fd: c_int, buf: *mut c_void, n: size_t, off: libc::off64_t) -> ssize_t;
    fn lseek64(fd: c_int, off: libc::off64_t, whence: c_int) -> libc::off64_t;
    fn dup2(old: c_int, new: c_int) -> c_int;
    fn fork() -> libc::pid_t;
    fn daemon(nochdir: c_int, noclose: c_int) -> c_int;
    fn fdopen(fd: c_int, mode: *const libc::c_char) -> *mut libc::FILE;
    fn splice(fd_in: c_int, off_in: *mut libc::loff_t, fd_out: c_int, off_out: *mut libc::loff_t, len: size_t, flags: libc::c_uint) -> ssize_t;
    fn posix_spawn(pid: *mut libc::pid_t, path: *const libc::c_char, fa: *const libc::posix_spawn_file_actions_t, attr: *const libc::posix_spawnattr_t, argv: *const *mut libc::c_char, envp: *const *mut libc::c_char) -> c_int;
    fn posix_spawnp(pid: *mut libc::pid_t, file: *const libc::c_char, fa: *const libc::posix_spawn_file_actions_t, attr: *const libc::posix_spawnattr_t, argv: *const *mut libc::c_char, envp: *const *mut libc::c_char) -> c_int;
    fn system(cmd: *const libc::c_char) -> c_int;
    fn execve(path: *const libc::c_char, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> c_int;
    fn execvpe(file: *const libc::c_char, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> c_int;
    fn fexecve(fd: c_int, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> c_int;
    fn execveat(dirfd: c_int, path: *const libc::c_char, argv: *const *const libc::c_char, envp: *const *const libc::c_char, flags: c_int) -> c_int;
    fn popen(cmd: *const libc::c_char, mode: *const libc::c_char) -> *mut libc::FILE;
    fn posix_spawn_file_actions_adddup2(fa: *mut libc::posix_spawn_file_actions_t, fd: c_int, newfd: c_int) -> c_int;
    fn posix_spawn_file_actions_destroy(fa: *mut libc::posix_spawn_file_actions_t) -> c_int;
    fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int;
    fn getrlimit(resource: c_int, r: *mut libc::rlimit) -> c_int;
    fn setrlimit(resource: c_int, r: *const libc::rlimit) -> c_int;
    fn prlimit64(pid: libc::pid_t, resource: c_int, new: *const libc::rlimit64, old: *mut libc::rlimit64) -> c_int;
    fn getdtablesize() -> c_int;
    fn sysconf(name: c_int) -> libc::c_long;
    fn __read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t;
    fn __recv_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int) -> ssize_t;
    fn __recvfrom_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    fn sigaction(sig: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int;
    fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
    fn sysv_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
}
