//! Delivering what a process wrote before it exits.
//!
//! When a process exits, the kernel closes its TCP sockets and finishes them on its own: queued
//! data still goes out, then the FIN, and the peer reads everything and then EOF. SDP
//! connections live in the process, so the socket layer does this itself:
//! [`flush_at_exit`] closes every connection the application still holds (as `close(2)`
//! would: queued data, then DisConn; a reset instead if unread data is waiting, as TCP does)
//! and waits, up to a bound (the *exit linger*), until every closing connection's last send
//! has completed, i.e. the peer holds the data and the DisConn. After that the process may go:
//! the peer reads the data, then EOF, whether or not it has noticed the process is gone.
//!
//! It runs by itself: the first stack a process starts registers [`flush_at_exit`] with
//! `atexit(3)`, so `std::process::exit` and returning from `main` both run it (a crash, or
//! `_exit`, does not: the peer then reads what had reached it, then ECONNRESET). The exit
//! linger is [`exit_linger`]: `SDP_EXIT_LINGER_MS`, by default 10 s.

use std::sync::{Once, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::sys;

/// What [`flush_at_exit`] needs of a stack.
pub(crate) trait ExitFlush: Send + Sync {
    /// Close the connections the application holds (those whose queued zero-copy sends are
    /// settled; the rest on a later call) and report whether every closing connection has
    /// delivered everything. With `wait`, keep at it until then or until `deadline`. Does
    /// nothing (true) in a process other than the stack's own, e.g. a forked child.
    fn exit_flush(&self, deadline: Instant, wait: bool) -> bool;

    /// Whether the stack's lock can be had within `within` (true in a process other than the
    /// stack's own): a thread stopped while it holds it (in a signal handler that never
    /// returns) would keep [`flush_at_exit`] waiting for its whole linger.
    fn lock_free_within(&self, within: Duration) -> bool;
    /// Whether the stack's connections can move to a fork child now (`app::fork_moving`: shm,
    /// every peer able to answer).
    fn movable(&self) -> bool;
    /// What the stack's connections have not delivered yet: bytes written and not acknowledged
    /// by the peer, plus one for each closing connection not finished (0 in a process other
    /// than the stack's own). [`flush_while_progress`] watches it fall.
    fn undelivered(&self) -> u64;
}

/// Every stack this process started (dead ones are pruned as new ones come).
static STACKS: Mutex<Vec<Weak<dyn ExitFlush>>> = Mutex::new(Vec::new());

/// Note a new stack, and register [`flush_at_exit`] with `atexit` the first time.
pub(crate) fn register(stack: Weak<dyn ExitFlush>) {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| sys::atexit(at_exit));
    let mut g = STACKS.lock();
    g.retain(|w| w.strong_count() > 0);
    g.push(stack);
}

/// Run first by this module's exit handler ([`set_exit_hook`]).
static EXIT_HOOK: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// `f` runs at the start of the exit work this module registers with `atexit`, before any
/// stream is flushed: the shim's own exit work (its keeper takes the streams other processes
/// hold), registered earlier and so run after this module's (`atexit` handlers run last
/// registered first), which had flushed and ended those streams by then (a fork child's bytes
/// written after its parent's `exit()` were lost). `f` must be idempotent: it may also run from
/// its own `atexit` registration.
pub fn set_exit_hook(f: fn()) {
    let _ = EXIT_HOOK.set(f);
}

extern "C" fn at_exit() {
    if let Some(f) = EXIT_HOOK.get() {
        // Never unwind into libc.
        let _ = std::panic::catch_unwind(f);
    }
    EXITING.store(true, std::sync::atomic::Ordering::SeqCst);
    // Never unwind into libc.
    let _ = std::panic::catch_unwind(|| flush_at_exit(exit_linger()));
}

/// The process's exit (its `atexit` handlers) has begun.
static EXITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The process (by pid) whose application calls park for good ([`freeze_app_calls`]).
static FROZEN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A signal is ending this process (the LD_PRELOAD shim, before its exit work for a signal
/// left at SIG_DFL): from now on an application thread that a call of the socket layer would
/// hand back to the application (a read, a write, an event wait of the shim's) parks there
/// instead until the process ends. Over TCP the process would be gone already: its threads
/// must not go on with what the flush does to their sockets (a poll woken by the reset of a
/// connection with unread bytes, a server's thread logging the client's departure). Only in
/// this process (a fork child, a keeper, goes on).
pub fn freeze_app_calls() {
    FROZEN.store(std::process::id(), std::sync::atomic::Ordering::SeqCst);
}

/// Park the calling thread for good if [`freeze_app_calls`] was called in this process.
#[inline]
pub(crate) fn park_if_frozen() {
    let f = FROZEN.load(std::sync::atomic::Ordering::Relaxed);
    if f != 0 && f == std::process::id() {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// Whether the process's exit has begun: the flush this module registered with `atexit` runs
/// (or ran). A signal that ends the process meanwhile need not wait for that flush again.
pub fn exit_under_way() -> bool {
    EXITING.load(std::sync::atomic::Ordering::SeqCst)
}

/// How long an exiting process waits for its SDP connections to deliver what was written:
/// `SDP_EXIT_LINGER_MS` (milliseconds), by default 10 s.
pub fn exit_linger() -> Duration {
    super::tunables::tunables().exit_linger
}

pub use super::tunables::DEFAULT_EXIT_LINGER;

/// Whether [`flush_at_exit`] can run now: no lock it needs stays held for `within` (each
/// stack's is tried in turn). The LD_PRELOAD shim asks before it does a program's exit work
/// for a signal that ends it: the thread the signal stopped may hold one, and never let go.
pub fn exit_can_run(within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let stacks: Vec<_> = match STACKS.try_lock_for(within) {
        Some(g) => g.iter().filter_map(Weak::upgrade).collect(),
        None => return false,
    };
    stacks
        .iter()
        .all(|s| s.lock_free_within(deadline.saturating_duration_since(Instant::now())))
}

/// The first part of an exit that need not wait for its peers (the LD_PRELOAD shim's): what
/// [`flush_at_exit`] does, for at most `grace`; then true when something is left to deliver
/// and all of it is on stacks whose connections can move to a fork child (shm), which carries
/// them on while this process exits at once, as a process exits over TCP and its kernel
/// finishes the connections (`app::fork_moving`; the shim's keeper). False when everything
/// was delivered, or what is left cannot move (the caller then waits as
/// [`flush_at_exit`] does).
pub fn exit_flush_moves(grace: Duration) -> bool {
    if flush_at_exit(grace) {
        return false;
    }
    let stacks: Vec<_> = match STACKS.try_lock_for(grace) {
        Some(g) => g.iter().filter_map(Weak::upgrade).collect(),
        None => return false,
    };
    let now = Instant::now();
    stacks
        .iter()
        .all(|s| s.movable() || s.exit_flush(now, false))
}

/// [`flush_at_exit`] for as long as the peers take what is left: it gives up only after a
/// whole `idle` in which they took nothing more, as the kernel keeps an orphaned TCP connection
/// going while its peer acknowledges (a reader slower than the linger gets everything, then
/// EOF, where a fixed bound reset it short). For a process nobody waits for (the shim's
/// keeper); an exit of the application's own keeps to [`flush_at_exit`]'s bound. Returns
/// whether everything was delivered.
pub fn flush_while_progress(idle: Duration) -> bool {
    let mut left = undelivered();
    loop {
        if flush_at_exit(idle) {
            return true;
        }
        let now = undelivered();
        if now >= left {
            return false;
        }
        left = now;
    }
}

/// The sum of every stack's [`ExitFlush::undelivered`].
fn undelivered() -> u64 {
    let stacks: Vec<_> = STACKS.lock().iter().filter_map(Weak::upgrade).collect();
    stacks
        .iter()
        .fold(0u64, |n, s| n.saturating_add(s.undelivered()))
}

/// Finish this process's SDP connections as the kernel finishes a process's TCP sockets when
/// it exits: every connection the application still holds is closed (its queued data is sent,
/// then DisConn, so the peer reads all of it and then EOF; with unread received data it is
/// reset instead, as `close(2)` does), and the call waits until every closing connection,
/// these and those closed earlier that are still finishing in the background, has handed its
/// last bytes to the peer, or until `linger` has passed. Returns whether everything was
/// delivered in time.
///
/// Registered with `atexit(3)` when the first stack starts (with [`exit_linger`]), so programs
/// need not call it. It is idempotent, and safe from an `atexit` handler or a library
/// destructor and while other threads still use sockets (their streams then behave as closed:
/// reads see EOF, writes fail with EPIPE). It never waits beyond `linger`, and in a forked
/// child it leaves the parent's connections alone. Listeners are left as they are: clients not
/// yet accepted see the process go as a reset, as with TCP.
pub fn flush_at_exit(linger: Duration) -> bool {
    let deadline = Instant::now() + linger;
    let stacks: Vec<_> = match STACKS.try_lock_for(linger) {
        Some(g) => g.iter().filter_map(Weak::upgrade).collect(),
        None => return false,
    };
    // Close everything first, then wait for each stack in turn (all within one deadline).
    let mut done = true;
    for s in &stacks {
        done &= s.exit_flush(deadline, false);
    }
    if done {
        return true;
    }
    let mut done = true;
    for s in &stacks {
        done &= s.exit_flush(deadline, true);
    }
    done
}
