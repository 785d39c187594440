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

use crate::sys;

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

/// What an application fd should report, derived from the connection under the runtime's lock.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct AppState {
    /// A read returns at once (data, EOF or an error).
    pub readable: bool,
    /// Stream bytes received so far: each new arrival gives a new edge.
    pub rx_total: u64,
    /// A write would not block.
    pub writable: bool,
    /// The peer shut its write half (POLLRDHUP, reads return EOF after the data).
    pub rdhup: bool,
    /// Both halves are done (POLLHUP).
    pub hup: bool,
    /// The connection failed (POLLERR).
    pub err: bool,
    /// A call reported the error (after it, TCP's POLLERR is gone).
    pub err_taken: bool,
    /// An urgent byte waits (POLLPRI, SIGURG).
    pub urgent: bool,
}

/// The readiness pair of a socket whose `user` end *is* the application's socket fd (the
/// LD_PRELOAD shim's "app fd" mode): the runtime keeps only its own end, so the application's
/// dups, forks and closes act on a real kernel file, and poll/select/epoll in every mode see
/// the socket's state natively.
///
/// * readable: token bytes wait in the user end's receive queue. A new token is sent for every
///   new arrival of data, so edge-triggered epoll sees an edge per arrival as with TCP; tokens
///   are taken back (read from the user end) only by an application call on the user fd, under
///   the runtime's lock, when the socket is not readable any more.
/// * writable: the user end's send buffer has room; made unwritable by filling it from the user
///   end (an application call), made writable by draining our end (anyone). One "primer" byte
///   stays in our end's queue for good, so that closing our end resets the user end
///   (ECONNRESET, POLLERR), which is how a failed connection is shown.
/// * rdhup: our end's write half is shut (EOF and POLLRDHUP on the user end).
/// * hup: both halves of our end are shut (POLLHUP).
///
/// Direct wakeups (over shm): the peer's provider holds a dup of our end and writes a token
/// into it itself for each SEND that brings data, while the runtime keeps them on (when the
/// only thing an arriving message needs is a reader: the fd writable, nothing queued to send),
/// so a reader blocked in epoll, poll or a blocking read wakes with one hop instead of two
/// through the progress thread. Such tokens are unknown to `tokens`: a read that finds nothing
/// takes them back ([`AppReady::take_direct_tokens`]) and then must look at the connection once
/// more (the peer publishes its SEND before it writes the token). Because the peer's dup keeps
/// our end alive, a failure also shuts our end down, so the user end hangs up at once.
#[derive(Debug)]
pub(crate) struct AppReady {
    ours: Option<OwnedFd>,
    tokens: bool,
    /// The peer holds a dup of our end for direct wakeups.
    pub(crate) direct: bool,
    /// Direct wakeups are on now.
    pub(crate) direct_on: bool,
    rx_seen: u64,
    writable: bool,
    rdhup: bool,
    hup: bool,
    /// The user end was reset (the connection failed): POLLERR until a call reports the error.
    reset: bool,
    /// ... and a call did: the user end's error was taken (POLLHUP stays).
    reset_reported: bool,
    /// An out-of-band byte waits in the user end (POLLPRI).
    oob: bool,
    /// An out-of-band byte was ever sent into the user end: its mark may still split the
    /// tokens (a receive stops at it), so taking them back reads until EAGAIN.
    had_oob: bool,
    /// The application's fd must see an edge per arrival (an edge-triggered epoll set or
    /// O_ASYNC watches it): a token per arrival, ours and the peer's. Otherwise one token
    /// while any is unread wakes every reader there is (poll, select, level-triggered epoll,
    /// a blocking read) and costs the writer no system call per message.
    pub(crate) edges: bool,
    /// Tells the peer's provider that its direct tokens were taken
    /// (`Endpoint::direct_unread_clear`): called before every receive of tokens.
    pub(crate) unread_clear: Option<UnreadClear>,
}

/// [`AppReady::unread_clear`]'s call.
pub(crate) struct UnreadClear(pub(crate) std::sync::Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for UnreadClear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UnreadClear")
    }
}

impl AppReady {
    /// A new pair: the user end for the application (blocking unless `nonblocking`,
    /// close-on-exec if `cloexec`), and the runtime's state. The user end is above the
    /// application's numbers until the shim puts it under the application's socket's (dup3).
    pub(crate) fn new(nonblocking: bool, cloexec: bool) -> io::Result<(AppReady, OwnedFd)> {
        let (user, ours) = sys::socketpair()?;
        // A fork child's copy of our end would keep its own fd's file open after we are gone.
        sys::close_in_fork_child(std::os::fd::AsFd::as_fd(&ours));
        // A small send buffer, so a few writes fill it; room for the primer byte.
        sys::setsockopt_int(user.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, 16384)?;
        sys::send_nb(user.as_raw_fd(), &[0])?;
        sys::set_fd_flags(user.as_raw_fd(), nonblocking, cloexec)?;
        Ok((
            AppReady {
                ours: Some(ours),
                tokens: false,
                edges: false,
                unread_clear: None,
                direct: false,
                direct_on: false,
                rx_seen: 0,
                writable: true,
                rdhup: false,
                hup: false,
                reset: false,
                reset_reported: false,
                oob: false,
                had_oob: false,
            },
            user,
        ))
    }

    /// The readiness state, for `sdpstat`: `tokens`, `direct` (`on` while direct wakeups are
    /// on), `writable`, `rdhup`, `hup`, and our end's fd.
    pub(crate) fn describe(&self) -> String {
        format!(
            "tokens={} direct={} writable={} rdhup={} hup={} ours={}",
            self.tokens as u8,
            match (self.direct, self.direct_on) {
                (false, _) => "no",
                (true, false) => "off",
                (true, true) => "on",
            },
            self.writable as u8,
            self.rdhup as u8,
            self.hup as u8,
            self.ours.as_ref().map_or(-1, |o| o.as_raw_fd()),
        )
    }

    /// Both halves of our end were shut (the connection's end shown as POLLHUP): our end
    /// hangs up by itself from then on.
    pub(crate) fn shown_hangup(&self) -> bool {
        self.hup
    }

    /// Our end, to give the peer for direct wakeups.
    pub(crate) fn ours_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.ours.as_ref().map(|o| o.as_fd())
    }

    /// A read found nothing: take back every token in the user end, the peer's direct ones
    /// included (`tokens` does not count those) and ours. The caller then looks at the connection once
    /// more and brings the fd up to date.
    pub(crate) fn take_direct_tokens(&mut self, user: RawFd) {
        if !(self.direct || self.tokens) || self.ours.is_none() || self.rdhup || self.hup {
            return;
        }
        self.take_tokens(user);
        self.tokens = false;
    }

    /// Give up the readiness protocol (the fd is shared, real bytes will flow): take back the
    /// tokens and filler, and hand over our end, with whether EOF was already shown on it.
    /// `None` if our end is gone (the connection failed) or both halves were shut.
    pub(crate) fn into_ours(mut self, user: RawFd) -> Option<(OwnedFd, bool)> {
        let ours = self.ours.take()?;
        if self.hup {
            return None;
        }
        let mut b = [0u8; 4096];
        while sys::recv_nb(user, &mut b).unwrap_or(0) > 0 {}
        while sys::recv_nb(ours.as_raw_fd(), &mut b).unwrap_or(0) > 0 {}
        Some((ours, self.rdhup))
    }

    /// After the user end's reset, once a call reported the connection's error: Linux clears
    /// `sk_err` then, and POLLERR goes (POLLHUP stays); taking the user end's error does the
    /// same (`user`: the caller holds it).
    fn reset_reported_if(&mut self, st: AppState, user: Option<RawFd>) {
        if let (true, false, true, Some(u)) = (self.reset, self.reset_reported, st.err_taken, user)
        {
            let _ = sys::getsockopt_int(u, libc::SOL_SOCKET, libc::SO_ERROR);
            self.reset_reported = true;
        }
    }

    /// Take every token out of the user end `user` (see [`AppReady::unread_clear`]).
    fn take_tokens(&self, user: RawFd) {
        if let Some(clear) = &self.unread_clear {
            (clear.0)();
        }
        take_tokens(user, self.had_oob);
    }

    /// Bring the user end to `st`. `user` is the application's fd when an application call
    /// holds it (needed to take tokens back and to fill the send buffer); the progress thread
    /// passes `None` and only makes the fd *more* ready.
    pub(crate) fn update(&mut self, st: AppState, user: Option<RawFd>) {
        self.update_taking(st, user, true)
    }

    /// [`AppReady::update`]; `take` false leaves the tokens for the caller, who takes them all
    /// right after ([`AppReady::take_direct_tokens`]): one receive instead of two.
    pub(crate) fn update_taking(&mut self, st: AppState, user: Option<RawFd>, take: bool) {
        let Some(ours) = self.ours.as_ref().map(|o| o.as_raw_fd()) else {
            self.reset_reported_if(st, user);
            return;
        };
        if st.err {
            self.reset = true;
            // Closing our end with the primer unread resets the user end. A peer's dup for
            // direct wakeups keeps our end open until it drops it: hang the user end up now,
            // the reset follows.
            if self.direct {
                let _ = sys::shutdown(ours, libc::SHUT_RDWR);
            }
            self.ours = None;
            self.reset_reported_if(st, user);
            return;
        }
        if st.hup && !self.hup {
            self.hup = true;
            let _ = sys::shutdown(ours, libc::SHUT_RDWR);
            return;
        }
        if self.hup {
            return;
        }
        if st.rdhup && !self.rdhup {
            self.rdhup = true;
            let _ = sys::shutdown(ours, libc::SHUT_WR);
        }
        if st.urgent && !self.oob {
            // POLLPRI, and SIGURG for an F_SETOWN owner, as TCP's urgent data gives.
            let _ = sys::send_oob(ours);
            self.oob = true;
            self.had_oob = true;
        } else if !st.urgent && self.oob {
            if let Some(u) = user {
                let _ = sys::recv_oob(u);
                self.oob = false;
            }
        }
        if st.readable {
            if !self.rdhup && (!self.tokens || (self.edges && st.rx_total != self.rx_seen)) {
                let _ = sys::send_nb(ours, &[1]);
            }
            self.tokens = true;
            self.rx_seen = st.rx_total;
        } else if self.tokens && take {
            if let Some(u) = user {
                self.take_tokens(u);
                self.tokens = false;
            }
        }
        if st.writable && !self.writable {
            drain_keeping_one(ours);
            self.writable = true;
        } else if !st.writable && self.writable {
            if let Some(u) = user {
                let b = [0u8; 1024];
                for _ in 0..4096 {
                    if sys::send_nb(u, &b).unwrap_or(0) == 0 {
                        break;
                    }
                }
                self.writable = false;
            }
        }
    }
}

/// Read the tokens queued in the user end `fd`. A short read emptied the queue: no second
/// call to see EAGAIN (a token that comes after is for data the caller looks for next),
/// unless an out-of-band mark may have cut it short (`marks`).
fn take_tokens(fd: RawFd, marks: bool) {
    let mut b = [0u8; 256];
    loop {
        match sys::recv_nb(fd, &mut b).unwrap_or(0) {
            0 => return,
            n if n < b.len() && !marks => return,
            _ => {}
        }
    }
}

/// Read everything queued on `fd` but its first byte (the primer).
fn drain_keeping_one(fd: RawFd) {
    let mut b = [0u8; 4096];
    loop {
        let queued = sys::inq(fd).unwrap_or(0);
        if queued <= 1 {
            return;
        }
        let n = (queued - 1).min(b.len());
        if sys::recv_nb(fd, &mut b[..n]).unwrap_or(0) == 0 {
            return;
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
        assert!(sys::is_cloexec(r.fd()).unwrap());
    }
}
