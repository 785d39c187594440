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

/// The lock for data a fork may copy while another thread holds it or waits for it (the stack
/// registries, the fork child's close list): a pure-atomic spin lock that yields while it
/// waits. A parking_lot lock force-unlocked in a fork child can hand itself to a waiter the
/// child does not have (its fair unlock), and the child's next lock then waits for ever; this
/// one keeps no waiters, so unlocking it in the child is one store. Hold it only briefly.
pub(crate) type ForkMutex<T> = spin::mutex::SpinMutex<T, spin::relax::Yield>;

#[cfg(test)]
mod tests {
    use super::ForkMutex;
    use std::time::{Duration, Instant};

    /// A fork lock held by the forking thread (as the fork handlers hold theirs) while another
    /// thread waits for it comes out usable in the child: unlocked there, the child can take
    /// it again. (parking_lot's mutex, unlocked in the child, handed itself to the waiting
    /// thread the child does not have, and the child's next lock waited for ever: the
    /// corners suite's hang in a forking server's child.)
    #[test]
    fn a_fork_child_takes_a_fork_lock_another_thread_waited_for() {
        static L: ForkMutex<u32> = ForkMutex::new(0);
        let held = L.lock();
        let waiter = std::thread::spawn(|| *L.lock() += 1);
        std::thread::sleep(Duration::from_millis(50));
        std::mem::forget(held);
        // SAFETY: the child makes no allocation and takes no lock but `L` before `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: the forking thread held it (the guard forgotten); it is this one.
            unsafe { L.force_unlock() };
            *L.lock() += 10;
            let ok = *L.lock() == 10;
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        // SAFETY: as in the child.
        unsafe { L.force_unlock() };
        waiter.join().unwrap();
        assert_eq!(*L.lock(), 1);
        let start = Instant::now();
        let mut status = 0;
        loop {
            // SAFETY: waits for our own child without blocking.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            if start.elapsed() > Duration::from_secs(10) {
                // SAFETY: our own child.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                panic!("the fork child's lock waited for ever");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }
}
