//! The application-fd calls of the LD_PRELOAD shim (`StackOps::app_*`): one nonblocking
//! attempt, a round of progress and one more if it would block, then the application's fd
//! brought up to date under the lock (direct wakeup tokens taken back after a read).

use std::os::fd::AsFd;

use super::*;

impl<P: Provider + 'static> Runtime<P> {
    /// One nonblocking call on a socket in application-fd mode: `op`, and once more after a
    /// round of progress if it would block; then the application's fd `user` is brought up to
    /// date (a socket found not readable or not writable has its fd made so, under the lock).
    /// [`Self::app_call`] for reads and writes: the connection's error is reported once
    /// ([`Self::report_once`]); a call after it gets `later`.
    pub(super) fn app_call_once<T>(
        &self,
        id: ConnId,
        user: RawFd,
        reading: bool,
        later: io::Result<T>,
        op: impl FnMut(&mut Inner<P>, Instant) -> Result<T, CallError>,
    ) -> io::Result<T> {
        self.app_call_inner(id, user, reading, Some(later), op)
    }

    pub(super) fn app_call<T>(
        &self,
        id: ConnId,
        user: RawFd,
        op: impl FnMut(&mut Inner<P>, Instant) -> Result<T, CallError>,
    ) -> io::Result<T> {
        self.app_call_inner(id, user, false, None, op)
    }

    /// The peer of `id`'s application fd may have announced SENDs by a direct wakeup that no
    /// round has taken yet (see `AppReady`).
    pub(super) fn direct_pending(g: &Inner<P>, id: ConnId) -> bool {
        g.socks
            .get(&id)
            .and_then(|s| s.app.as_ref())
            .is_some_and(|a| a.direct)
            && !g.driver.endpoint_quiet(id)
    }

    /// A round of progress on `id` run by an application call on it, which brings its own fd
    /// up to date afterwards (the round leaves that fd alone: `Inner::in_app_call`). Only that
    /// connection: a round over every connection cost each read a look at all of them
    /// (redis-server with 2000 clients spent ~12% of its time there); the progress thread
    /// serves the others.
    pub(super) fn app_call_round(&self, g: &mut Inner<P>, id: ConnId) {
        g.in_app_call = Some(id);
        let act = self.sh.step_for(g, Some(id));
        g.in_app_call = None;
        if act > 0 {
            self.sh.wake_waiters();
        }
    }

    /// One nonblocking attempt (a round of progress first if it would block); with `later`,
    /// a connection error goes through [`Self::report_once`]. A read (`reading`) that leaves
    /// nothing to read takes the peer's direct tokens back (see `AppReady`).
    fn app_call_inner<T>(
        &self,
        id: ConnId,
        user: RawFd,
        reading: bool,
        later: Option<io::Result<T>>,
        mut op: impl FnMut(&mut Inner<P>, Instant) -> Result<T, CallError>,
    ) -> io::Result<T> {
        let mut g = self.lock()?;
        let mut stepped = false;
        if reading && Self::direct_pending(&g, id) {
            // A direct wakeup brought the application here before any round took the SENDs
            // it announced: take them first, so the read returns everything that arrived
            // before the edge, as TCP's does.
            stepped = true;
            self.app_call_round(&mut g, id);
        }
        loop {
            match g.socks.get(&id) {
                None => return Err(io::Error::from_raw_os_error(libc::EBADF)),
                // Another process's request shared it: the caller goes to the kernel file.
                Some(s) if s.app.is_none() => return Err(shared_now()),
                Some(_) => {}
            }
            let r = op(&mut g, self.now());
            self.sh.after_call(&mut g);
            if matches!(r, Err(CallError::WouldBlock)) && !stepped {
                stepped = true;
                self.app_call_round(&mut g, id);
                continue;
            }
            let r = match (r, later) {
                (Err(e @ CallError::Conn(_)), Some(later)) => {
                    Self::report_once(&mut g, id, e, later)
                }
                (r, _) => r.map_err(io_err),
            };
            let Inner { driver, socks, .. } = &mut *g;
            let Some(s) = socks.get_mut(&id) else {
                return r;
            };
            // A read that leaves nothing to read (it took everything, or found nothing) takes
            // the peer's tokens back: left there, the fd would poll readable for nothing.
            let drained = reading && !driver.view(id).is_some_and(|c| c.read_ready());
            let direct = s.app.as_ref().is_some_and(|a| a.direct);
            // (The take-back below takes ours too.)
            refresh_app_taking(driver, id, s, Some(user), !(drained && direct));
            if !drained {
                return r;
            }
            let s = match direct.then(|| driver.direct_settler(id)).flatten() {
                None => s,
                Some(wait) => {
                    // A byte the peer is still writing for a SEND we took would land after the
                    // take-back and make the fd readable for nothing (a level-triggered
                    // poller's next read would get EAGAIN, which TCP never gives it): wait for
                    // it, without the lock (the peer may be descheduled mid-write).
                    drop(g);
                    wait();
                    g = match self.lock() {
                        Ok(g) => g,
                        Err(_) => return r,
                    };
                    let Inner { driver, socks, .. } = &mut *g;
                    let Some(s) = socks.get_mut(&id) else {
                        return r;
                    };
                    if driver.view(id).is_some_and(|c| c.read_ready()) {
                        // Bytes came meanwhile: the fd stays readable for them.
                        refresh_app(driver, id, s, Some(user));
                        return r;
                    }
                    s
                }
            };
            if let Some(a) = s.app.as_mut() {
                a.take_direct_tokens(user);
            }
            // A token taken back may announce a SEND published after our round: look again
            // (the peer rings the bell before it writes the token).
            if Self::direct_pending(&g, id) {
                self.app_call_round(&mut g, id);
                let Inner { driver, socks, .. } = &mut *g;
                if let Some(s) = socks.get_mut(&id) {
                    refresh_app(driver, id, s, Some(user));
                }
            }
            return r;
        }
    }
    /// See [`StackOps::app_poll_readable`]: polls `id` (a round of progress on it, then a
    /// look) for `spin` ([`poll_for`]), as `block_on` polls before it sleeps.
    pub(super) fn poll_app_readable(
        &self,
        id: ConnId,
        spin: Duration,
        stop: &dyn Fn() -> bool,
    ) -> bool {
        let _caller = Caller::enter(&self.sh);
        // Shared meanwhile (another process's request): the read goes to the kernel file.
        let ready = |g: &Inner<P>| {
            let lowat = g.socks.get(&id).map_or(0, |s| s.lowat);
            g.driver
                .view(id)
                .is_none_or(|c| c.read_ready() && !c.rx_below(lowat))
                || g.socks.get(&id).is_none_or(|s| s.app.is_none())
        };
        let min_lost = SpinGuard::min_lost(self.sh.name == "rdma");
        poll_for(spin, min_lost, stop, |t| {
            let Ok(mut g) = self.lock() else {
                return Some(());
            };
            if ready(&g) {
                return Some(());
            }
            if self.sh.step_for_at(&mut g, Some(id), self.sh.at(t)) > 0 {
                self.sh.wake_waiters();
                if ready(&g) {
                    return Some(());
                }
            }
            drop(g);
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            None
        })
        .is_some()
    }
}

/// Application fds closed behind the shim's back. The shim sees `close`, `close_range`, the
/// dup family and exec; not a raw `close` system call (libuv closes so), nor libc's own closes
/// (`fclose`). Then the connection stayed open until the number was reused: the peer never
/// saw the end (a client reading to EOF waited out its timeout). Our end of the readiness
/// pair hangs up once every holder of the application's file closed it: the progress thread
/// watches for that (one epoll set, each end reported once) and closes the connection as the
/// application's `close` would have.
impl<P: Provider + 'static> Shared<P> {
    /// Watch `app`'s end of the pair for the hang-up (see above).
    pub(super) fn watch_app_hangup(&self, app: &AppReady, id: ConnId) {
        let Some(ours) = app.ours_fd() else { return };
        let ep = match self.app_hangups.get() {
            Some(ep) => ep,
            None => {
                let Ok(ep) = sys::epoll_create() else { return };
                sys::close_in_fork_child(ep.as_fd());
                let ep = self.app_hangups.get_or_init(|| ep);
                // Watched by the progress thread from its next wait on (see `requests`).
                sys::eventfd_signal(&self.wake);
                ep
            }
        };
        let _ = sys::epoll_add_hangup(ep.as_fd(), ours.as_raw_fd(), id.as_u64());
    }

    /// The progress thread, when a watched end reported: each connection whose application
    /// file every holder closed (our end hung up while we did not shut it) is closed as the
    /// application's `close` would (`Runtime::close_begin`: with SO_LINGER {1, 0} a reset;
    /// otherwise in the background). Its `AppStream` lives on in the shim's table until the fd's number names
    /// another file; its own close then finds nothing to do.
    pub(super) fn serve_app_hangups(&self) {
        let Some(ep) = self.app_hangups.get() else {
            return;
        };
        let mut ids = Vec::new();
        sys::epoll_drain(ep.as_fd(), |t| ids.push(ConnId::from_u64(t)));
        if ids.is_empty() {
            return;
        }
        let mut g = self.inner.lock();
        let now = self.now();
        let mut closed = false;
        for id in ids {
            let gone = g.socks.get(&id).is_some_and(|s| {
                s.app.as_ref().is_some_and(|a| {
                    !a.shown_hangup() && a.ours_fd().is_some_and(|o| sys::hung_up(o.as_raw_fd()))
                })
            });
            if !gone {
                continue;
            }
            closed = true;
            if let Some(c) = g.driver.view(id) {
                let info = super::ops::info_of(&c);
                g.ended_behind.insert(id, info);
            }
            // No application thread to wait a linger out in: the close goes on in the
            // background, as TCP's for an orphaned socket.
            if Runtime::<P>::close_begin(&mut g, now, id).is_some() {
                Runtime::<P>::close_locked(&mut g, now, id);
            }
        }
        drop(g);
        if closed {
            self.wake_waiters();
        }
    }
}
