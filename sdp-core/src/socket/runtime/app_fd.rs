//! The application-fd calls of the LD_PRELOAD shim (`StackOps::app_*`): one nonblocking
//! attempt, a round of progress and one more if it would block, then the application's fd
//! brought up to date under the lock (direct wakeup tokens taken back after a read).

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
    fn app_call_round(&self, g: &mut Inner<P>, id: ConnId) {
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
            refresh_app(driver, id, s, Some(user));
            // A read that leaves nothing to read (it took everything, or found nothing) takes
            // the peer's tokens back: left there, the fd would poll readable for nothing.
            if !reading || driver.view(id).is_some_and(|c| c.read_ready()) {
                return r;
            }
            let direct = s.app.as_ref().is_some_and(|a| a.direct);
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
            g.driver.view(id).is_none_or(|c| c.read_ready())
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
