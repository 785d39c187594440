//! A process killed by a signal whose default action ends it delivers what it wrote, as over
//! TCP.
//!
//! When a signal ends a process (SIGTERM from `kill`, `timeout` or systemd, SIGINT from
//! Ctrl-C, SIGHUP, SIGPIPE, SIGALRM, SIGUSR1/2 left at their default), the kernel closes its
//! TCP sockets and finishes them on its own: the bytes it holds still go out, then the FIN,
//! and a fork child that holds a copy of the socket keeps the connection. An SDP connection
//! lives in the process, so without help its queued bytes died with it, the peer read a reset,
//! and a child's copy failed (EPIPE).
//!
//! So while a process holds SDP streams of its own, the shim catches these signals where the
//! program left them at SIG_DFL: its handler hands the signal to a thread of the shim's
//! (`sdp-signals`, all signals blocked), which does the exit work an `exit` does (the keeper
//! for streams other processes hold, the flush of the rest within the exit linger, the report)
//! and then the handler puts the default action back and lets the signal come again: the
//! process ends by it, and its parent's `waitpid` sees the signal, as over TCP. The program
//! sees SIG_DFL: `sigaction` and `signal` report and keep the application's own setting (a
//! handler it installs replaces the shim's; setting SIG_DFL again brings the shim's back). An
//! `exec` resets caught signals to SIG_DFL, so a new program never inherits the handler.
//!
//! Differences from TCP: the process ends once the exit work is done (within the exit linger),
//! not at once, and its other threads run meanwhile. The thread the signal stopped may hold a
//! lock the exit work needs (it was inside the shim): then the work is not tried (as before,
//! the peers see a reset). SIGKILL cannot be caught: its peers still see a reset.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use libc::c_int;

use crate::real;

/// The signals whose default action ends the process without a core dump, and that a
/// program commonly gets.
const ENDING: [c_int; 7] = [
    libc::SIGHUP,
    libc::SIGINT,
    libc::SIGPIPE,
    libc::SIGALRM,
    libc::SIGTERM,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

const NSIG: usize = 65;

/// The process whose `sdp-signals` thread serves the handler (0: none yet).
static SERVED: AtomicU32 = AtomicU32::new(0);
/// The write end of the pipe to that thread, and its read end.
static PIPE: AtomicI32 = AtomicI32::new(-1);
static PIPE_RX: AtomicI32 = AtomicI32::new(-1);
/// A signal was handed to the thread (the first one does the work).
static TAKEN: AtomicBool = AtomicBool::new(false);
/// The thread is done with the exit work (or gave it up).
static DONE: AtomicBool = AtomicBool::new(false);
/// How long a handler waits for it (the exit linger and a second), in milliseconds.
static WAIT_MS: AtomicU64 = AtomicU64::new(0);
/// Per signal: the shim's handler is the real disposition, where the application's is SIG_DFL.
static OURS: [AtomicBool; NSIG] = [const { AtomicBool::new(false) }; NSIG];

/// The application's own action for each signal the shim's handler stands in for (SIG_DFL,
/// with its mask and flags), which `sigaction` reports.
struct Saved([libc::sigaction; NSIG]);
// SAFETY: plain data, only reached under the spin lock.
unsafe impl Send for Saved {}
static SAVED: spin::Mutex<Option<Box<Saved>>> = spin::Mutex::new(None);

/// One `install` at a time.
static ONE: spin::Mutex<()> = spin::Mutex::new(());

/// Before a fork: no thread is inside `install` or the `sigaction` hook while it happens (a
/// spin lock a fork child inherited held would never be let go there).
pub(crate) fn lock_for_fork() {
    std::mem::forget(ONE.lock());
    std::mem::forget(SAVED.lock());
}

/// After a fork, in the parent and in the child: the locks [`lock_for_fork`] took.
pub(crate) fn unlock_after_fork() {
    // SAFETY: this thread took both in `lock_for_fork`, and holds them no more.
    unsafe {
        SAVED.force_unlock();
        ONE.force_unlock();
    }
}

fn ending(sig: c_int) -> bool {
    ENDING.contains(&sig)
}

fn is_default(a: &libc::sigaction) -> bool {
    a.sa_sigaction == libc::SIG_DFL
}

/// Every signal held in this thread while it lives: a handler of the application's that
/// calls `sigaction` must not come while this thread holds [`SAVED`].
struct Held(libc::sigset_t);

impl Held {
    fn all() -> Held {
        // SAFETY: our own sets; the mask is this thread's.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            Held(old)
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: restores this thread's mask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

/// In a process that holds SDP streams of its own: catch the ending signals it leaves at
/// SIG_DFL (once per process; a fork child that makes streams of its own does it again).
pub(crate) fn install() {
    let me = std::process::id();
    if SERVED.load(Ordering::Acquire) == me {
        return;
    }
    let _g = ONE.lock();
    if SERVED.load(Ordering::Acquire) == me || !wanted() {
        return;
    }
    let mut fds = [0; 2];
    // Counted while at the application's numbers (`fd_limit::app_slot` waits for them).
    let _low = sdp_core::socket::fd_limit::LowFds::hold();
    // SAFETY: a pipe into our own array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return;
    }
    // Out of the application's numbers, as every fd of the shim's.
    let (rx, tx) = (
        sdp_core::socket::fd_limit::high_fd(fds[0]),
        sdp_core::socket::fd_limit::high_fd(fds[1]),
    );
    drop(_low);
    let (Ok(rx), Ok(tx)) = (&rx, &tx) else {
        for fd in [rx, tx].into_iter().flatten() {
            // SAFETY: our own pipe's fd, unused.
            unsafe { libc::close(fd) };
        }
        return;
    };
    let fds = [*rx, *tx];
    let wait = sdp_core::socket::exit_linger() + Duration::from_secs(1);
    WAIT_MS.store(wait.as_millis() as u64, Ordering::Relaxed);
    TAKEN.store(false, Ordering::SeqCst);
    DONE.store(false, Ordering::SeqCst);
    let rx = fds[0];
    // Running before the call that made it returns (see `spawn_started`: a raw clone's child
    // that calls setgroups would wait for it for good).
    let spawned = sdp_core::socket::fork::spawn_started(
        std::thread::Builder::new()
            .name("sdp-signals".into())
            .stack_size(256 * 1024),
        move || serve(rx),
    );
    if spawned.is_err() {
        // SAFETY: our own pipe's fds.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        return;
    }
    for (slot, fd) in [(&PIPE, fds[1]), (&PIPE_RX, fds[0])] {
        let old = slot.swap(fd, Ordering::SeqCst);
        if old >= 0 {
            // A fork child's copy of its parent's pipe.
            // SAFETY: that fd is ours and unused here.
            unsafe { libc::close(old) };
        }
    }
    SERVED.store(me, Ordering::Release);
    let _held = Held::all();
    let mut saved = SAVED.lock();
    let saved = saved.get_or_insert_with(|| {
        // SAFETY: all-zero sigactions are valid values.
        Box::new(Saved(unsafe { std::mem::zeroed() }))
    });
    for sig in ENDING {
        if OURS[sig as usize].load(Ordering::SeqCst) {
            continue;
        }
        // SAFETY: all-zero is a valid sigaction to overwrite; the real sigaction reads and
        // writes our own structs.
        unsafe {
            let mut cur: libc::sigaction = std::mem::zeroed();
            if real::sigaction(sig, std::ptr::null(), &mut cur) != 0 || !is_default(&cur) {
                continue;
            }
            if real::sigaction(sig, &handler_action(), std::ptr::null_mut()) == 0 {
                saved.0[sig as usize] = cur;
                OURS[sig as usize].store(true, Ordering::SeqCst);
            }
        }
    }
}

/// `SDP_SIGNALS=0` leaves the signals alone (a death by one then resets the connections).
fn wanted() -> bool {
    static W: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *W.get_or_init(|| std::env::var_os("SDP_SIGNALS").is_none_or(|v| v != "0"))
}

fn handler_action() -> libc::sigaction {
    // SAFETY: all-zero is a valid sigaction; sigfillset writes its mask.
    let mut a: libc::sigaction = unsafe { std::mem::zeroed() };
    a.sa_sigaction = on_signal as *const () as usize;
    a.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
    // SAFETY: fills our own set.
    unsafe { libc::sigfillset(&mut a.sa_mask) };
    a
}

/// The handler (async-signal-safe: atomics, `write`, `nanosleep`, `sigaction`, `tgkill`).
extern "C" fn on_signal(sig: c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: errno is this thread's; plain system calls with our own arguments.
    unsafe {
        let errno = *libc::__errno_location();
        let me = libc::syscall(libc::SYS_getpid) as u32;
        if SERVED.load(Ordering::Acquire) == me {
            if !TAKEN.swap(true, Ordering::SeqCst) {
                let b = sig.to_ne_bytes();
                let fd = PIPE.load(Ordering::SeqCst);
                if libc::write(fd, b.as_ptr().cast(), b.len()) != b.len() as isize {
                    DONE.store(true, Ordering::SeqCst);
                }
            }
            let tick = libc::timespec {
                tv_sec: 0,
                tv_nsec: 1_000_000,
            };
            let mut left = WAIT_MS.load(Ordering::Relaxed);
            while !DONE.load(Ordering::SeqCst) && left > 0 {
                libc::nanosleep(&tick, std::ptr::null_mut());
                left -= 1;
            }
        }
        // The default action, as the program has it: the signal comes again once this
        // handler returns (it is blocked here) and ends the process.
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        real::sigaction(sig, &dfl, std::ptr::null_mut());
        OURS[sig as usize].store(false, Ordering::SeqCst);
        libc::syscall(
            libc::SYS_tgkill,
            libc::syscall(libc::SYS_getpid),
            libc::syscall(libc::SYS_gettid),
            sig,
        );
        *libc::__errno_location() = errno;
    }
}

/// The `sdp-signals` thread: waits for a handler's signal, does the exit work, says so.
fn serve(rx: c_int) {
    crate::mark_thread_internal();
    // SAFETY: blocks every signal in this thread only (the handler runs in the
    // application's threads).
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, std::ptr::null_mut());
    }
    let mut b = [0u8; 4];
    loop {
        // SAFETY: reads into our own buffer.
        let r = unsafe { libc::read(rx, b.as_mut_ptr().cast(), b.len()) };
        if r == b.len() as isize {
            break;
        }
        if r == 0 || (r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR))
        {
            return;
        }
    }
    let sig = c_int::from_ne_bytes(b);
    // The thread the signal stopped may hold a lock the exit work takes, and never let go.
    let free = Duration::from_millis(200);
    if crate::EXITING.load(Ordering::SeqCst) || sdp_core::socket::exit_under_way() {
        // An exit's work is under way (perhaps in the thread the signal stopped): the signal
        // ends the process now, as it would a TCP program's exit.
        DONE.store(true, Ordering::SeqCst);
        crate::log(format_args!(
            "signal {sig} ends the process during its exit work: its SDP connections end with it"
        ));
    } else if crate::table::free_within(free) && sdp_core::socket::exit_can_run(free) {
        crate::log(format_args!(
            "signal {sig} ends the process: its SDP streams are finished first, as the kernel finishes TCP's"
        ));
        // Over TCP the process is gone now: its threads do not see what the flush does to
        // their sockets.
        sdp_core::socket::freeze_app_calls();
        crate::at_exit();
    } else {
        crate::log(format_args!(
            "signal {sig} ends the process while a thread it stopped holds the socket layer: its SDP connections end with it"
        ));
    }
    DONE.store(true, Ordering::SeqCst);
}

/// `sigaction` for a signal the shim may stand in for (see the module docs).
///
/// # Safety
/// As `sigaction(2)`.
pub(crate) unsafe fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    if !ending(sig) {
        // SAFETY: the caller's arguments.
        return unsafe { real::sigaction(sig, act, old) };
    }
    let _held = Held::all();
    let mut saved = SAVED.lock();
    if OURS[sig as usize].load(Ordering::SeqCst) {
        let Some(s) = saved.as_mut() else {
            // SAFETY: the caller's arguments.
            return unsafe { real::sigaction(sig, act, old) };
        };
        let mine = s.0[sig as usize];
        // SAFETY: the caller's pointers, as libc's sigaction reads and writes them.
        unsafe {
            if !act.is_null() && !is_default(&*act) {
                // The application's own handler (or SIG_IGN) replaces the shim's.
                let r = real::sigaction(sig, act, std::ptr::null_mut());
                if r != 0 {
                    return r;
                }
                OURS[sig as usize].store(false, Ordering::SeqCst);
            } else if !act.is_null() {
                s.0[sig as usize] = *act;
            }
            if !old.is_null() {
                *old = mine;
            }
        }
        return 0;
    }
    // SAFETY: the caller's arguments.
    let r = unsafe { real::sigaction(sig, act, old) };
    // Back to SIG_DFL in a process the shim serves: its handler stands in again.
    // SAFETY: `act` was read by libc's sigaction above.
    if r == 0
        && !act.is_null()
        && unsafe { is_default(&*act) }
        && SERVED.load(Ordering::Acquire) == std::process::id()
    {
        if let Some(s) = saved.as_mut() {
            // SAFETY: our own struct.
            if unsafe { real::sigaction(sig, &handler_action(), std::ptr::null_mut()) } == 0 {
                // SAFETY: as above.
                s.0[sig as usize] = unsafe { *act };
                OURS[sig as usize].store(true, Ordering::SeqCst);
            }
        }
    }
    r
}

/// `signal` (BSD semantics, as glibc's: the signal held in its handler, calls restarted) and
/// `sysv_signal` (`reset`: one-shot, not held), through [`sigaction`] for the signals the shim
/// may stand in for.
///
/// # Safety
/// As `signal(3)`.
pub(crate) unsafe fn signal(
    sig: c_int,
    handler: libc::sighandler_t,
    reset: bool,
) -> libc::sighandler_t {
    if !ending(sig) {
        // SAFETY: the caller's arguments.
        return unsafe {
            if reset {
                real::sysv_signal(sig, handler)
            } else {
                real::signal(sig, handler)
            }
        };
    }
    // SAFETY: all-zero is a valid sigaction; the set functions write our own sets.
    let mut a: libc::sigaction = unsafe { std::mem::zeroed() };
    a.sa_sigaction = handler;
    if reset {
        a.sa_flags = libc::SA_RESETHAND | libc::SA_NODEFER;
    } else {
        a.sa_flags = libc::SA_RESTART;
        // SAFETY: as above.
        unsafe { libc::sigaddset(&mut a.sa_mask, sig) };
    }
    // SAFETY: all-zero is a valid sigaction to overwrite.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: our own structs.
    if unsafe { sigaction(sig, &a, &mut old) } != 0 {
        return libc::SIG_ERR;
    }
    old.sa_sigaction
}
