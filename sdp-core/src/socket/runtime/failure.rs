//! A failed stack: a panic in a round of progress (`FailOnUnwind`) or the loss of the
//! provider's device marks it failed, after which every call fails with EIO or ENETDOWN, every
//! connection is aborted and every fd the application may watch shows the failure.

use super::*;

impl<P: Provider + 'static> Shared<P> {
    pub(super) fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// The error of every call on the failed stack (EIO after a panic, ENETDOWN after the
    /// device went away).
    pub(super) fn fail_error(&self) -> io::Error {
        match self.fail_errno.load(Ordering::SeqCst) {
            0 => io::Error::from_raw_os_error(libc::EIO),
            e => io::Error::from_raw_os_error(e),
        }
    }

    /// Mark the stack failed with `errno` (the first reason stays).
    fn mark_failed(&self, errno: i32) {
        let _ = self
            .fail_errno
            .compare_exchange(0, errno, Ordering::SeqCst, Ordering::SeqCst);
        self.failed.store(true, Ordering::SeqCst);
    }

    /// The provider's device went away (`rdma link delete`, a hot-unplugged HCA): fail the
    /// stack with ENETDOWN (its connections are dead with the device; TCP's would have
    /// stalled until a timeout) and drop everything the stack made on the device at once, so
    /// the kernel can finish the removal while the application still holds its sockets (a
    /// device without `disassociate_ucontext`, as Soft-RoCE, waits until then). Listeners
    /// find the device again when it comes back (`SdpListener`).
    pub(super) fn lose_device(&self, g: &mut Inner<P>) {
        self.mark_failed(libc::ENETDOWN);
        self.wake_waiters();
        self.fail_locked(g);
        // Asynchronous zero-copy sends hold their regions until the application collects
        // them, which on a failed stack it cannot: let them go now (a later `wait` reports the
        // failure), or they would hold the device.
        for s in g.socks.values_mut() {
            s.zsends.clear();
        }
        g.driver.release_device();
        self.wake_waiters();
        // The progress thread sees the failure and stops.
        sys::eventfd_signal(&self.wake);
    }

    /// The stack failed: from now on every call fails with EIO, and whoever waits wakes up
    /// to see it. Then, as far as the (possibly broken) state allows, every connection is
    /// aborted so its peer learns at once, and every readiness fd reports hung up.
    pub(super) fn fail_stack(&self) {
        self.mark_failed(libc::EIO);
        self.wake_waiters();
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut g = self.inner.lock();
            self.fail_locked(&mut g);
        }));
        self.wake_waiters();
    }

    /// Abort every connection and show the failure on every fd the application may watch:
    /// readiness fds hung up, application fds (the shim's) reset, listeners readable (their
    /// accept reports it).
    fn fail_locked(&self, g: &mut Inner<P>) {
        let now = self.now();
        for id in g.driver.conn_ids() {
            g.driver.abort(now, id);
        }
        let Inner { socks, lsocks, .. } = g;
        for s in socks.values_mut() {
            if let Some(r) = s.ready.as_mut() {
                r.set(true, true, true);
            }
            if let Some(a) = s.app.as_mut() {
                a.update(
                    crate::socket::ready::AppState {
                        err: true,
                        ..Default::default()
                    },
                    None,
                );
            }
        }
        for ls in lsocks.values_mut() {
            ls.ready.set(true, false, false);
        }
    }
}

/// Marks the stack failed if a round of progress unwinds (see `Shared::step`).
pub(super) struct FailOnUnwind<'a, P: Provider>(pub(super) &'a Shared<P>);

impl<P: Provider> Drop for FailOnUnwind<'_, P> {
    fn drop(&mut self) {
        let _ =
            self.0
                .fail_errno
                .compare_exchange(0, libc::EIO, Ordering::SeqCst, Ordering::SeqCst);
        self.0.failed.store(true, Ordering::SeqCst);
        self.0.wake_waiters();
        // The progress thread sees it and aborts the connections.
        sys::eventfd_signal(&self.0.wake);
    }
}
