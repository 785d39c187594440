//! The runtime's side of the flush at process exit (`socket::exit`): close what the
//! application holds once its zero-copy sends are settled, and run progress until the closing
//! connections delivered everything or the deadline passed.

use super::*;

impl<P: Provider + 'static> crate::socket::exit::ExitFlush for Shared<P> {
    fn exit_flush(&self, deadline: std::time::Instant, wait: bool) -> bool {
        if sys::getpid() != self.pid() || self.failed() {
            // A forked child: the parent's connections are not ours to close. A failed
            // stack: nothing can be delivered.
            return true;
        }
        let Some(mut g) = self.inner.try_lock_until(deadline) else {
            return false;
        };
        loop {
            if self.exit_round(&mut g) {
                return true;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if !wait || left.is_zero() {
                return false;
            }
            if self.step(&mut g) > 0 {
                self.wake_waiters();
                continue;
            }
            // The progress thread moves things along meanwhile and notifies.
            self.cond
                .wait_for(&mut g, left.min(Duration::from_millis(20)));
        }
    }

    fn lock_free_within(&self, within: Duration) -> bool {
        sys::getpid() != self.pid() || self.failed() || self.inner.try_lock_for(within).is_some()
    }

    fn movable(&self) -> bool {
        // (`app::fork_moving` moves the shm stack; queue pairs do not survive a fork.) A
        // stopped peer would not answer the move's pause, and its connection would be reset:
        // then the exit waits for the peers, which deliver once it is continued.
        self.name == "shm"
            && self
                .inner
                .try_lock_for(Duration::from_millis(100))
                .is_some_and(|g| !g.driver.any_peer_stopped())
    }

    fn undelivered(&self) -> u64 {
        if sys::getpid() != self.pid() || self.failed() {
            return 0;
        }
        // (A lock held that long: as if nothing moved.)
        let Some(g) = self.inner.try_lock_for(Duration::from_secs(1)) else {
            return u64::MAX;
        };
        g.driver
            .conn_ids()
            .into_iter()
            .map(|id| g.driver.tx_queued(id) as u64 + u64::from(g.driver.close_pending(id)))
            .sum()
    }
}

impl<P: Provider + 'static> Shared<P> {
    /// One round of [`flush_at_exit`](crate::socket::exit::flush_at_exit): close each
    /// connection the application holds once its queued zero-copy sends are settled (bytes of
    /// one that ended short still go by copy first); true when no closing connection has
    /// anything left to deliver. Connections waiting in a listener's queue (the driver's) are
    /// left alone.
    fn exit_round(&self, g: &mut Inner<P>) -> bool {
        let now = self.now();
        let mut done = true;
        let ids: Vec<ConnId> = g.socks.keys().copied().collect();
        for id in ids {
            if g.socks.get(&id).is_none_or(|s| s.exit_closed) {
                continue;
            }
            let settled = Runtime::<P>::zsends_settled(g, now, id);
            let Inner { driver, socks, .. } = &mut *g;
            let Some(s) = socks.get_mut(&id) else {
                continue;
            };
            if !settled || s.zsends.iter().any(|z| z.done.is_none()) {
                done = false;
                continue;
            }
            s.exit_closed = true;
            // What arrived and no round took yet counts as unread (see `close_begin`).
            driver.poll_one(now, id);
            if s.linger == Some(Duration::ZERO) {
                // As TCP's exit with SO_LINGER {1, 0}: a reset, nothing more delivered.
                driver.abort(now, id);
            } else {
                driver.close_keep(now, id);
            }
            refresh_sock(driver, id, s);
        }
        done && g
            .driver
            .conn_ids()
            .into_iter()
            .all(|id| !g.driver.close_pending(id))
    }
}
