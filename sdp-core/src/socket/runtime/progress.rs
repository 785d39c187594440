//! The progress thread: moves every connection of a stack along while no caller does, and
//! answers `sdpstat`.

use super::*;

/// Longest a stopped runtime keeps running so its closing connections finish in order.
pub(super) const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// Anything of the stack may be watched from outside a call: a connection's readiness fd or
/// the shim's application fd (its pump too), a listener's fd or doorbell.
pub(super) fn watched<P: Provider>(g: &Inner<P>) -> bool {
    g.socks
        .values()
        .any(|s| s.ready.is_some() || s.app.is_some() || s.pump.is_some())
        || g.lsocks.values().any(|l| l.fd_given || l.bell.is_some())
}

/// The progress thread: [`progress_loop`] until the stack stops, or until a panic fails it
/// (then its connections are failed, never left hanging).
pub(super) fn progress_thread<P: Provider + 'static>(sh: Arc<Shared<P>>, notify: Option<RawFd>) {
    crate::socket::app::run_thread_start_hook();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| progress_loop(&sh, notify)));
    if r.is_err() || sh.failed() {
        sh.fail_stack();
    }
}

pub(super) fn progress_loop<P: Provider + 'static>(sh: &Shared<P>, notify: Option<RawFd>) {
    let mut stopped_at: Option<std::time::Instant> = None;
    loop {
        let deadline = {
            let mut g = sh.inner.lock();
            if sh.failed() {
                // A caller's round of progress panicked.
                return;
            }
            if sh.park.load(Ordering::SeqCst) {
                // The connections move to a fork child (`StackOps::fork_moving`), which starts
                // a progress thread of its own.
                return;
            }
            if sh.stop.load(Ordering::SeqCst) {
                // Every handle is gone; connections closed by the application may still be
                // sending their last bytes and DisConn. Finish them, then go.
                let t = *stopped_at.get_or_insert_with(std::time::Instant::now);
                if g.driver.conn_count() == 0 || t.elapsed() > DRAIN_LIMIT {
                    return;
                }
            }
            if sh.inject_panic.swap(false, Ordering::SeqCst) {
                panic!("sdp: progress thread panic injected by a test");
            }
            // While callers make progress themselves (they poll, and arm the provider when
            // they sleep), the progress thread stands by: it does not arm the provider, so a
            // peer wakes the caller that waits and not this thread too, and it looks only now
            // and then (`STANDBY`) and at timers. Not while anything of the stack may be
            // watched from outside a call (readiness fds, the shim's application fds, pumps,
            // listener fds and doorbells): those need every event at once.
            let standby = stopped_at.is_none() && sh.callers_active() && !watched(&g);
            if !standby {
                let _ = g.driver.arm();
            }
            let act = sh.step(&mut g);
            if act > 0 {
                sh.wake_waiters();
                // Keep going while there is work. With a notify fd armed before this round's
                // look, go to it instead: whatever arrived since the arm makes it readable and
                // the wait returns at once, and a round that would find nothing (most often
                // the case: the application thread just woken wants the lock for its read) is
                // not run. In standby (not armed) or without a notify fd: look again now.
                if standby || notify.is_none() {
                    continue;
                }
            }
            let now = sh.now();
            let cap = if standby {
                STANDBY
            } else if notify.is_some() && stopped_at.is_none() {
                Duration::from_secs(1)
            } else {
                // Nothing to sleep on (the simulator), or draining: look often.
                Duration::from_micros(200)
            };
            let timeout = g
                .driver
                .next_deadline()
                .map_or(cap, |d| d.saturating_since(now).min(cap));
            // Callers compare their timers with this under the lock (`kick_progress_for_timers`).
            sh.progress_until.store(
                now.as_nanos() + timeout.as_nanos() as u64,
                Ordering::Relaxed,
            );
            (timeout, standby)
        };
        let (timeout, standby) = deadline;
        let mut fds = vec![(sh.wake.as_raw_fd(), libc::POLLIN)];
        if let Some(fd) = notify.filter(|_| !standby) {
            fds.push((fd, libc::POLLIN));
        }
        if let Some(s) = &sh.stat {
            fds.push((s.fd(), libc::POLLIN));
        }
        if let Some((rx, _)) = sh.requests.get() {
            fds.push((rx.as_raw_fd(), libc::POLLIN));
        }
        if let Some(ep) = sh.app_hangups.get() {
            fds.push((ep.as_raw_fd(), libc::POLLIN));
        }
        // Shared application fds: wake when an application writes or room comes back.
        {
            let g = sh.inner.lock();
            if g.pumps > 0 {
                fds.extend(g.socks.values().filter_map(|s| {
                    let p = s.pump.as_ref()?;
                    Some((p.fd()?, libc::POLLIN | libc::POLLRDHUP | p.wants_out()))
                }));
            }
        }
        let revents = match sys::poll(&fds, Some(timeout)) {
            Ok(r) => r,
            Err(_) => {
                std::thread::sleep(Duration::from_millis(1));
                Vec::new()
            }
        };
        // Each only when it has something: an accept or a read that finds nothing is a
        // system call on every wakeup.
        let has = |fd: RawFd| {
            fds.iter()
                .zip(&revents)
                .any(|(&(f, _), &r)| f == fd && r != 0)
        };
        if has(sh.wake.as_raw_fd()) {
            sys::eventfd_drain(&sh.wake);
        }
        if let Some(s) = sh.stat.as_ref().filter(|s| has(s.fd())) {
            s.serve(|| sh.stat_lines());
        }
        if sh.requests.get().is_some_and(|(rx, _)| has(rx.as_raw_fd())) {
            sh.serve_requests();
        }
        if sh.app_hangups.get().is_some_and(|ep| has(ep.as_raw_fd())) {
            sh.serve_app_hangups();
        }
    }
}
