//! Readiness fds: a kernel fd per socket that polls readable, writable and hung-up exactly when
//! the SDP socket is, so SDP sockets work with poll, epoll, mio and tokio's `AsyncFd`.
//!
//! The fd is one end (`user`) of an AF_UNIX stream socketpair; the runtime drives it from the
//! other end (`ours`):
//!
//! * readable: one byte waits in `user`'s receive queue (sent from `ours`; taken back by
//!   reading `user` when the socket stops being readable);
//! * writable: `user`'s tiny send buffer has room. To make it unwritable the runtime fills it
//!   (writes from `user` into `ours` until EAGAIN); to make it writable again it drains `ours`;
//! * hung up: both directions of `ours` are shut, so `user` polls POLLHUP | POLLIN | POLLRDHUP.
//!
//! Only transitions cost a system call, and a socket's pair is only created once the
//! application asks for its fd, so programs that never poll pay nothing.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use super::sys;

/// The readiness pair of one socket.
#[derive(Debug)]
pub(crate) struct ReadyFd {
    user: OwnedFd,
    ours: OwnedFd,
    readable: bool,
    writable: bool,
    hup: bool,
}

impl ReadyFd {
    /// A pair that starts not readable, writable (the kernel's default), not hung up; call
    /// [`ReadyFd::set`] right away with the socket's state.
    pub(crate) fn new() -> io::Result<ReadyFd> {
        let (user, ours) = sys::socketpair()?;
        // The smallest send buffer the kernel allows, so a few bytes fill it.
        sys::setsockopt_int(user.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, 1)?;
        Ok(ReadyFd {
            user,
            ours,
            readable: false,
            writable: true,
            hup: false,
        })
    }

    /// The fd the application polls.
    pub(crate) fn fd(&self) -> RawFd {
        self.user.as_raw_fd()
    }

    /// Bring the fd to the socket's readiness. Errors are ignored: at worst the fd reports
    /// readiness the socket does not have, and the application's call returns WouldBlock.
    pub(crate) fn set(&mut self, readable: bool, writable: bool, hup: bool) {
        if self.hup {
            return;
        }
        if hup {
            self.hup = true;
            let _ = sys::shutdown(self.ours.as_raw_fd(), libc::SHUT_RDWR);
            return;
        }
        if readable != self.readable {
            if readable {
                let _ = sys::send_nb(self.ours.as_raw_fd(), &[1]);
            } else {
                let mut b = [0u8; 64];
                while sys::recv_nb(self.user.as_raw_fd(), &mut b).unwrap_or(0) > 0 {}
            }
            self.readable = readable;
        }
        if writable != self.writable {
            if writable {
                let mut b = [0u8; 4096];
                while sys::recv_nb(self.ours.as_raw_fd(), &mut b).unwrap_or(0) > 0 {}
            } else {
                let b = [0u8; 512];
                // Bounded: the send buffer is tiny, EAGAIN comes after a few writes.
                for _ in 0..4096 {
                    if sys::send_nb(self.user.as_raw_fd(), &b).unwrap_or(0) == 0 {
                        break;
                    }
                }
            }
            self.writable = writable;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn revents(r: &ReadyFd) -> i16 {
        let ev = libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP;
        sys::poll(&[(r.fd(), ev)], Some(Duration::ZERO)).unwrap()[0]
    }

    #[test]
    fn follows_every_combination_then_hangs_up() {
        let mut r = ReadyFd::new().unwrap();
        for &(rd, wr) in &[
            (false, false),
            (true, false),
            (true, true),
            (false, true),
            (false, false),
            (true, true),
            (false, false),
        ] {
            r.set(rd, wr, false);
            let ev = revents(&r);
            assert_eq!(
                ev & libc::POLLIN != 0,
                rd,
                "readable {rd} writable {wr}: {ev:#x}"
            );
            assert_eq!(
                ev & libc::POLLOUT != 0,
                wr,
                "readable {rd} writable {wr}: {ev:#x}"
            );
            assert_eq!(ev & libc::POLLHUP, 0);
        }
        r.set(false, false, true);
        let ev = revents(&r);
        assert_ne!(ev & libc::POLLHUP, 0, "{ev:#x}");
        assert_ne!(ev & libc::POLLIN, 0, "{ev:#x}");
        // Final: later calls change nothing.
        r.set(false, false, false);
        assert_ne!(revents(&r) & libc::POLLHUP, 0);
    }

    #[test]
    fn close_on_exec() {
        let r = ReadyFd::new().unwrap();
        let flags = sys::syscall!(fcntl(r.fd(), libc::F_GETFD)).unwrap();
        assert_ne!(flags & libc::FD_CLOEXEC, 0);
    }
}
