//! The host's system calls: thin, safe wrappers over libc, mio-style (the `syscall!` macro
//! turns `-1` into the thread's `errno` as an `io::Error`), by topic: [`fd`] (our fds,
//! eventfd, timerfd, epoll, poll), [`mem`] (mappings, memfds, raw memory), [`net`] (kernel TCP
//! sockets and addresses), [`unix`] (Unix sockets, fd passing) and [`process`] (pid, fork and
//! exit handlers, the clock, copies to and from a peer process). Everything is re-exported
//! here: callers write `sys::eventfd()`.
//!
//! Every libc call of the crate is made here; the calls into librdmacm/libibverbs are the RDMA
//! provider's (`verbs::rdma::ffi`). The unsafe code elsewhere is not system calls: the socket
//! layer's registered-buffer slices and borrowed readiness fd (`socket::stream`), its
//! fork-time unlock of the stack registries (`socket::stack`) and its registration of caller
//! memory (`socket::runtime`); the shm provider's copies to and from registered memory and
//! its copy assists (`verbs::shm`); the RDMA provider's memory registrations
//! (`verbs::rdma`).

/// Call a libc function that returns -1 and sets errno on failure.
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

pub(crate) mod fd;
pub(crate) mod mem;
pub(crate) mod net;
pub(crate) mod process;
pub(crate) mod unix;

pub(crate) use self::fd::*;
pub(crate) use self::mem::*;
pub(crate) use self::net::*;
pub(crate) use self::process::*;
pub(crate) use self::unix::*;
