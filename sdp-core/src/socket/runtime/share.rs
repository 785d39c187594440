//! Streams whose application fd a forked child inherited (the LD_PRELOAD shim's fork handlers;
//! `socket::pump`).
//!
//! At fork the stream is only *exposed* ([`StackOps::app_expose`]): it stays as it was, its
//! bytes moved by this process's calls, until another process uses it. Most children never do
//! (redis' BGSAVE, a helper that execs with close-on-exec sockets, a daemon's worker): their
//! parent's connections keep their speed. A child that does use its copy asks first
//! ([`StackOps::app_join`]): a message on the runtime's request channel (a seqpacket pair made
//! at the first exposure, whose sending end children inherit) carrying the child's copy of the
//! application fd and an answer socket; the progress thread checks that the fd is the exposed
//! stream's file, shares the stream (its bytes flow through the kernel file from then on, pumped
//! by this runtime) and answers. A process whose owner is gone gets an error at once (the
//! request channel's receiving end is closed in children at fork, so it dies with the owner).
//!
//! When the owner's last fd of an exposed stream closes ([`StackOps::app_quiesce`] then
//! `close`), the readiness protocol is stopped first (its tokens taken back through that fd),
//! and the close then looks at the pair: if no other process holds the file, the connection
//! closes as TCP's would; if one does, the stream is shared and pumped until the last holder
//! closes.

use std::os::fd::AsFd;

use super::*;
use crate::socket::app::Sharing;

/// A shared stream's pump closes its connection (every holder closed the file, everything
/// was sent): keep what the connection carried in all, for the owner's report.
pub(super) fn note_last_counts<P: Provider>(driver: &Driver<P>, id: ConnId, s: &Sock) {
    if let (Some(e), Some(c)) = (&s.exposed, driver.view(id)) {
        let st = c.stats();
        *e.shared.last.lock() = Some((
            st.data_bytes_rcvd,
            st.data_bytes_sent,
            st.zcopy_read_bytes + st.zcopy_write_bytes + st.zcopy_send_bytes,
        ));
    }
}

/// A stream a forked child inherited (see the module docs).
pub(super) struct Exposed {
    /// The application fd's kernel file (device, inode): a request must carry that file.
    file: (u64, u64),
    /// The stream's `AppStream` reads this before each call: set once the stream is shared;
    /// the connection's counts when its pump ends.
    shared: Arc<Sharing>,
}

/// How long a child waits for the owner to share a stream it wants to use.
const JOIN_WAIT: Duration = Duration::from_secs(10);

/// An application call stopped because another process's request shared the stream meanwhile:
/// the caller makes it again on the kernel file ([`is_shared_now`]).
#[derive(Debug)]
struct SharedNow;

impl std::fmt::Display for SharedNow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the stream is now shared: its bytes go through the kernel file")
    }
}

impl std::error::Error for SharedNow {}

pub(super) fn shared_now() -> io::Error {
    io::Error::other(SharedNow)
}

/// Whether `e` says the stream became shared during the call (see [`SharedNow`]).
pub(crate) fn is_shared_now(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<SharedNow>())
}

impl<P: Provider + 'static> Shared<P> {
    /// The request channel (receiving end, sending end), made at the first exposure.
    fn requests(&self) -> io::Result<&(OwnedFd, OwnedFd)> {
        if let Some(r) = self.requests.get() {
            return Ok(r);
        }
        let pair = sys::seqpacket_pair()?;
        // Children keep the sending end; held there, the receiving end would leave a child's
        // request waiting after we are gone instead of failing.
        sys::close_in_fork_child(pair.0.as_fd());
        let r = self.requests.get_or_init(|| pair);
        sys::keep_for_children(r.1.as_raw_fd());
        // The progress thread watches the channel from its next wait on: wake it, or a child's
        // first request waited out its current sleep (up to 1 s: rsync's daemon children, the
        // first use of every inherited stream, 2026-11-29).
        sys::eventfd_signal(&self.wake);
        Ok(r)
    }

    /// Answer every waiting request (the progress thread, when the channel is readable).
    pub(super) fn serve_requests(&self) {
        let Some((rx, _)) = self.requests.get() else {
            return;
        };
        let mut buf = [0u8; 8];
        while let sys::Recv::Msg(_, fds) = sys::recv_msg(rx.as_fd(), &mut buf) {
            let Ok::<[OwnedFd; 2], _>([user, answer]) = fds.try_into() else {
                continue;
            };
            let ok = {
                let mut g = self.inner.lock();
                let now = self.now();
                share_requested(&mut g, now, user.as_raw_fd())
            };
            let _ = sys::send_msg(answer.as_fd(), &[ok as u8], &[]);
            if ok {
                self.wake_waiters();
            }
        }
    }
}

/// A request carried `user`: share the exposed stream whose file it is. Whether one was.
fn share_requested<P: Provider>(g: &mut Inner<P>, now: Instant, user: RawFd) -> bool {
    let Ok(file) = sys::file_identity(borrow_fd(user)) else {
        return false;
    };
    let Some(id) = g
        .socks
        .iter()
        .find(|(_, s)| s.exposed.as_ref().is_some_and(|e| e.file == file))
        .map(|(id, _)| *id)
    else {
        return false;
    };
    share_locked(g, now, id, Some(user));
    true
}

/// A shared file carries real bytes: room for them in its writers' send buffer (the readiness
/// protocol kept it small).
fn room_to_write(user: RawFd) {
    let _ = sys::setsockopt_int(user, libc::SOL_SOCKET, libc::SO_SNDBUF, 1 << 20);
}

fn borrow_fd(fd: RawFd) -> std::os::fd::BorrowedFd<'static> {
    // SAFETY: the callers pass an fd they hold open for the borrow's use (the call).
    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }
}

/// Stop `id`'s readiness protocol: direct wakeups off (real bytes may flow through the file
/// next: no token of the peer's may land among them), tokens and filler taken back through
/// `user`; our end of the pair, with whether EOF was shown on it (`AppReady::into_ours`).
fn end_readiness<P: Provider>(
    driver: &mut Driver<P>,
    id: ConnId,
    app: AppReady,
    user: RawFd,
) -> Option<(OwnedFd, bool)> {
    if app.direct {
        driver.set_direct_wake(id, false, true);
    }
    app.into_ours(user)
}

/// Share `id`'s stream: its bytes flow through the application's file from now on, pumped by
/// this runtime (`user`: an fd of that file, through which the readiness tokens are taken
/// back). Nothing to do if it is shared already.
pub(super) fn share_locked<P: Provider>(
    g: &mut Inner<P>,
    now: Instant,
    id: ConnId,
    user: Option<RawFd>,
) {
    let Inner {
        driver,
        socks,
        pumps,
        ..
    } = g;
    let Some(s) = socks.get_mut(&id) else {
        return;
    };
    if let Some(e) = &s.exposed {
        e.shared.shared.store(true, Ordering::SeqCst);
    }
    let ours = match (s.app.take(), s.parked.take()) {
        (Some(app), _) => user.and_then(|u| end_readiness(driver, id, app, u)),
        (None, parked) => parked,
    };
    if let Some((ours, eof_out)) = ours {
        if let Some(u) = user {
            room_to_write(u);
        }
        let v6 = s
            .exposed
            .as_ref()
            .is_some_and(|e| e.shared.v6.load(Ordering::Relaxed));
        name_shared_end(driver, id, &ours, v6);
        let mut p = crate::socket::pump::Pump::new(ours, eof_out);
        p.run(driver, now, id);
        s.pump = Some(p);
        *pumps += 1;
    }
}

/// Name our end of a stream's pair after the connection's addresses
/// (`socket::shared_name`), so a process that receives the application's fd by SCM_RIGHTS
/// can answer as the TCP socket it stands for; `v6`: the application's socket is AF_INET6,
/// whose IPv4 addresses show v4-mapped. Nothing on failure (a name taken: that receiver sees
/// an AF_UNIX socket, as before).
fn name_shared_end<P: Provider>(driver: &Driver<P>, id: ConnId, ours: &OwnedFd, v6: bool) {
    use std::os::fd::AsRawFd;
    let (Some(local), Some(peer)) = (driver.local_addr(id), driver.peer_addr(id)) else {
        return;
    };
    let shown = |a: SocketAddr| crate::socket::shared_name::shown(v6, a);
    let (local, peer) = (shown(local), shown(peer));
    // The socket's inode rather than our fd number: names are unique per network namespace,
    // which processes of other pid namespaces may share (a pod's containers: pid 1 in each,
    // with the same fd numbers), and the name outlives this process when a keeper pumps on
    // (its pid reused meanwhile). Inodes of live sockets are the kernel's, unique among all.
    let Ok((_, ino)) = sys::file_identity(ours.as_fd()) else {
        return;
    };
    let name = crate::socket::shared_name::encode(std::process::id(), ino, local, peer);
    let _ = sys::bind_abstract(ours.as_raw_fd(), &name);
}

impl<P: Provider + 'static> Runtime<P> {
    pub(super) fn expose(
        &self,
        id: ConnId,
        file: (u64, u64),
        shared: Arc<Sharing>,
    ) -> io::Result<()> {
        let mut g = self.lock()?;
        self.sh.requests()?;
        let s = g
            .socks
            .get_mut(&id)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        if s.pump.is_some() {
            shared.shared.store(true, Ordering::SeqCst);
        }
        shared.exposed.store(true, Ordering::SeqCst);
        s.exposed = Some(Exposed { file, shared });
        // Before the fork the child inherits it from: our death no longer ends it in order.
        g.driver.note_settled(id, false);
        Ok(())
    }

    /// See [`StackOps::wait_pumps_done`]: the progress thread runs the pumps and closes those
    /// every holder closed.
    pub(super) fn pumps_done(&self) {
        let Ok(mut g) = self.lock() else { return };
        while g.pumps > 0 && !self.sh.failed() {
            self.sh.cond.wait_for(&mut g, Duration::from_millis(50));
        }
    }

    /// In another process (a fork child): ask the owner to share the stream (see the module
    /// docs). In the owner: share it.
    pub(super) fn join(&self, id: ConnId, user: RawFd) -> io::Result<()> {
        if sys::getpid() == self.sh.pid() {
            return self.app_share(id, user);
        }
        let gone = || io::Error::from_raw_os_error(libc::EPIPE);
        // Only the channel, made before the fork: the child's copy of the rest of the runtime
        // may be in any state (another thread of the parent may have held its lock).
        let Some((_, tx)) = self.sh.requests.get() else {
            return Err(gone());
        };
        let deadline = std::time::Instant::now() + JOIN_WAIT;
        let (mine, theirs) = sys::seqpacket_pair()?;
        loop {
            match sys::send_msg(tx.as_fd(), &[1], &[borrow_fd(user), theirs.as_fd()]) {
                Ok(()) => break,
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                // The owner is gone (its channel's end closed with it), or never answers.
                Err(_) => return Err(gone()),
            }
        }
        drop(theirs);
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let _ = sys::poll(&[(mine.as_raw_fd(), libc::POLLIN)], Some(left));
        let mut b = [0u8; 1];
        match sys::recv_msg(mine.as_fd(), &mut b) {
            sys::Recv::Msg(1, _) if b[0] == 1 => Ok(()),
            _ => Err(gone()),
        }
    }

    pub(super) fn quiesce(&self, id: ConnId, user: RawFd) {
        let Ok(mut g) = self.lock() else { return };
        let Inner { driver, socks, .. } = &mut *g;
        let Some(s) = socks.get_mut(&id) else { return };
        if s.exposed.is_none() || s.pump.is_some() {
            return;
        }
        let Some(app) = s.app.take() else { return };
        s.parked = end_readiness(driver, id, app, user);
        if s.parked.is_some() {
            room_to_write(user);
        }
    }

    /// At the close of an exposed stream (under the lock): share it if another process still
    /// holds its file (its bytes then flow through it until the last holder closes); reset it
    /// if one does and the readiness tokens could not be taken back (closed without
    /// [`Runtime::quiesce`]: a raw close, dup2 over it), since they would reach that holder as
    /// bytes.
    pub(super) fn close_exposed(g: &mut Inner<P>, now: Instant, id: ConnId) {
        let Some(s) = g.socks.get_mut(&id) else {
            return;
        };
        if s.exposed.is_none() || s.pump.is_some() {
            return;
        }
        if let Some((ours, _)) = &s.parked {
            if sys::hung_up(ours.as_raw_fd()) {
                s.parked = None;
            } else {
                // The file lives on in another process: pump it (tokens were taken back).
                share_locked(g, now, id, None);
            }
            return;
        }
        let held = s
            .app
            .as_ref()
            .and_then(|a| a.ours_fd())
            .is_some_and(|o| !sys::hung_up(o.as_raw_fd()));
        if held {
            g.driver.abort(now, id);
        }
    }
}
