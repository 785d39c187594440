//! Connections moving to a fork child (`StackOps::fork_moving`: the shim's `daemon()`): the
//! peers paused, the progress thread stopped, the fork made with the runtime locked, and the
//! child taking the runtime over (docs/preload.md, "Moving connections to another process").

use super::*;

/// How long a move waits for its peers to answer the pause (a peer that does not is left
/// behind: its connection is reset in the child).
const PAUSE_WAIT: Duration = Duration::from_secs(2);

impl<P: Provider + 'static> Runtime<P> {
    pub(super) fn fork_moving_here(&self, fork: &mut dyn FnMut() -> libc::pid_t) -> libc::pid_t {
        let Ok(mut g) = self.lock() else {
            // Not this process's runtime (or a failed one): nothing to move.
            return fork();
        };
        let asked = g.driver.pause_peers();
        drop(g);
        // The answers come on the connections' sockets, which the progress thread's rounds
        // read.
        let end = std::time::Instant::now() + PAUSE_WAIT;
        while asked > 0 && std::time::Instant::now() < end {
            if self.sh.inner.lock().driver.peers_paused() >= asked {
                break;
            }
            sys::eventfd_signal(&self.sh.wake);
            std::thread::sleep(Duration::from_millis(1));
        }
        // Nothing of the runtime may run across the fork: the progress thread returns, and
        // the forking thread holds the lock (callers of other threads wait for it).
        self.sh.park.store(true, Ordering::SeqCst);
        sys::eventfd_signal(&self.sh.wake);
        let handle = self.sh.progress.lock().take();
        if let Some(h) = handle {
            let _ = h.join();
        }
        let mut g = self.sh.inner.lock();
        sys::next_fork_moves();
        let pid = fork();
        sys::next_fork_moved();
        if pid > 0 {
            // The mover ends at once. Its copy of the runtime stays locked until then and
            // names the child as its process: every call here fails as in any process that
            // is not the runtime's (no flush or report at its exit waits for the lock).
            self.sh.pid.store(pid as u32, Ordering::SeqCst);
            std::mem::forget(g);
            return pid;
        }
        if pid == 0 {
            self.sh.pid.store(sys::getpid(), Ordering::SeqCst);
        }
        let now = self.now();
        g.driver.moved_here(now);
        drop(g);
        self.sh.park.store(false, Ordering::SeqCst);
        if Self::spawn_progress(&self.sh).is_err() {
            // No progress thread: the stack cannot go on.
            self.sh.fail_stack();
        }
        self.sh.wake_waiters();
        pid
    }
}
