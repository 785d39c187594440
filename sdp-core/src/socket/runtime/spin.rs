//! How a blocking call waits: how long it polls before it sleeps (adaptive, or
//! `SDP_SPIN_US`), and how a thread preempted while polling stops polling for a while.

use super::*;

/// `SDP_SPIN_US` if set: a fixed time a blocking call polls by itself before it sleeps.
pub(super) fn spin_fixed() -> Option<Duration> {
    crate::socket::tunables::tunables().spin
}

/// The least a blocking call polls before it sleeps (`SDP_SPIN_US` if set).
pub(super) fn spin_time() -> Duration {
    spin_fixed().unwrap_or(SPIN_BASE)
}

/// The adaptive poll time starts here and never goes below it.
pub(super) const SPIN_BASE: Duration = Duration::from_micros(50);
/// The adaptive poll time never goes above this.
pub(super) const SPIN_MAX: Duration = Duration::from_micros(500);

/// How long blocking calls poll before they sleep, learnt from how long recent waits took
/// (like an adaptive mutex): waits that end within a millisecond raise it towards 1.5 times
/// their length (at most [`SPIN_MAX`]), so a peer that answers quickly is caught without a
/// sleep and a wakeup, which cost more than the poll; longer waits bring it back to
/// [`SPIN_BASE`], so an idle connection does not burn CPU. A fixed `SDP_SPIN_US` turns it off.
#[derive(Debug)]
pub(super) struct AdaptiveSpin {
    ns: std::sync::atomic::AtomicU64,
}

impl AdaptiveSpin {
    pub(super) fn new() -> AdaptiveSpin {
        AdaptiveSpin {
            ns: std::sync::atomic::AtomicU64::new(spin_time().as_nanos() as u64),
        }
    }
    pub(super) fn get(&self) -> Duration {
        match spin_fixed() {
            Some(d) => d,
            None => Duration::from_nanos(self.ns.load(Ordering::Relaxed)),
        }
    }
    /// A blocking call's wait ended after `waited`.
    pub(super) fn record(&self, waited: Duration) {
        if spin_fixed().is_some() {
            return;
        }
        let base = SPIN_BASE.as_nanos() as u64;
        let max = SPIN_MAX.as_nanos() as u64;
        let w = waited.as_nanos() as u64;
        let target = if w < 1_000_000 {
            (w + w / 2).clamp(base, max)
        } else {
            base
        };
        let old = self.ns.load(Ordering::Relaxed);
        self.ns.store((old * 3 + target) / 4, Ordering::Relaxed);
    }
}

/// Polling pays only while the CPUs have room: when a thread that polls is preempted (an
/// involuntary context switch during its poll) for a while ([`SpinGuard::min_lost`]),
/// something else wanted that CPU, possibly the peer it waits for, and polling on would take
/// the CPU from it. Then this thread's blocking calls sleep at once for a while (20 ms,
/// doubling while it happens again, up to 1 s), after which one poll probes again. The
/// back-off is forgotten only after [`SPIN_FORGIVE`] without such a preemption: a busy host
/// leaves some polls clean, and forgetting at the first one let polling come back every 20 ms,
/// each return costing a preempted waiter a scheduler slice (p99 of 0.6-1 ms under `sdp-bench
/// compare --load 1`). Per thread: a busy host's threads each learn it by themselves; the
/// host's CPU pressure ([`CpuRoom`]) stops the whole process. (A fixed `SDP_SPIN_US` is used
/// as it is.)
pub(super) struct SpinGuard;

/// The shortest and longest time a thread does not poll after it was preempted polling.
pub(super) const SPIN_OFF_MIN: Duration = Duration::from_millis(20);
pub(super) const SPIN_OFF_MAX: Duration = Duration::from_secs(1);
/// Over RDMA, a preempted poll backs off only if the preemption took at least this much of
/// its time. There the peer runs on another host, so a poller takes no CPU from it; what
/// preempts it for a moment is mostly the device's kernel work for the very message it waits
/// for (Soft-RoCE's and siw's packet processing: in the rig most round trips), no reason to
/// stop polling, while a CPU-bound neighbour takes a scheduler slice (milliseconds).
pub(super) const PREEMPT_COSTLY: Duration = Duration::from_micros(100);
/// Over shm, a preempted poll backs off only if the preemption took at least this much of it.
/// A CPU-bound neighbour takes scheduler slices (0.75 ms and more); the short preemptions of a
/// quiet host are no reason to stop: the wakeup a sleeping end gets puts it on its peer's CPU
/// (the scheduler's wake-affine placement), preempting the peer's poll for the few
/// microseconds it takes to answer, and the progress threads' standby looks (every
/// millisecond) preempt pollers on a small host. Counting every preemption, as first built,
/// made both ends back off together and sleep on every message: `sdp-bench compare` quiet
/// p50 at 64 B 47-53 us instead of 2.5-2.7 (kernel TCP 66), sockperf under the shim 10.8 us
/// instead of 4.3. The price (2026-11-27, `--load 1`, two runs): p50 unchanged, p99 at 64 KiB
/// 86-488 us against ~70 (at 64 B 33-39 against 12-17).
pub(super) const PREEMPT_PEER: Duration = Duration::from_micros(50);
/// A thread not preempted while polling for this long starts again from no back-off.
pub(super) const SPIN_FORGIVE: Duration = Duration::from_secs(2);

/// One thread's polling back-off (see [`SpinGuard`]).
#[derive(Clone, Copy)]
pub(super) struct SpinOff {
    /// No polling before this.
    until: Option<std::time::Instant>,
    /// The last back-off given.
    backoff: Duration,
    /// When a poll was last preempted.
    preempted: Option<std::time::Instant>,
}

thread_local! {
    pub(super) static SPIN_OFF: std::cell::Cell<SpinOff> = const {
        std::cell::Cell::new(SpinOff { until: None, backoff: Duration::ZERO, preempted: None })
    };
}

impl SpinGuard {
    /// May this thread poll now?
    pub(super) fn allowed() -> bool {
        SPIN_OFF.with(|c| match c.get().until {
            Some(t) => std::time::Instant::now() >= t,
            None => true,
        })
    }

    /// How much of a poll a preemption must take to stop polling (see [`Self::ended`]): over
    /// RDMA [`PREEMPT_COSTLY`], over shm [`PREEMPT_PEER`].
    pub(super) fn min_lost(rdma: bool) -> Duration {
        if rdma {
            PREEMPT_COSTLY
        } else {
            PREEMPT_PEER
        }
    }

    /// Whether a poll's preemption (`preempted`, for `lost` of its time) stops polling for a
    /// while: only one that took at least `min_lost`.
    fn counts(preempted: bool, lost: Duration, min_lost: Duration) -> bool {
        preempted && lost >= min_lost
    }

    /// A poll that ran from `start` (its thread's scheduling as it began: `sched0`) ended; a
    /// preemption counts only if it took `min_lost` of the poll ([`Self::min_lost`]). A poll
    /// shorter than that cannot have lost as much: it reads nothing more (one `getrusage` per
    /// message less, of two: 64-byte ping-pong p50 over shm 2.2-2.3 us against 2.4).
    pub(super) fn ended(
        start: std::time::Instant,
        sched0: Option<sys::ThreadSched>,
        min_lost: Duration,
    ) {
        let Some(before) = sched0 else {
            return;
        };
        let (preempted, lost) = if start.elapsed() < min_lost {
            (false, Duration::ZERO)
        } else {
            match sys::ThreadSched::now() {
                Some(after) => after.since(&before),
                None => return,
            }
        };
        SPIN_OFF.with(|c| {
            let mut s = c.get();
            let now = std::time::Instant::now();
            if Self::counts(preempted, lost, min_lost) {
                s.backoff = (s.backoff * 2).clamp(SPIN_OFF_MIN, SPIN_OFF_MAX);
                s.until = Some(now + s.backoff);
                s.preempted = Some(now);
            } else if start.elapsed() > Duration::from_micros(5)
                && s.preempted
                    .is_none_or(|t| now.duration_since(t) >= SPIN_FORGIVE)
            {
                // Clean polls for a while: the CPUs have room again.
                s = SpinOff {
                    until: None,
                    backoff: Duration::ZERO,
                    preempted: None,
                };
            }
            c.set(s);
        });
    }
}

/// Whether the host's CPUs have room for polling, from its CPU pressure (PSI `some`: the share
/// of time some runnable task waited for a CPU), sampled every [`CpuRoom::SAMPLE`] by one
/// thread of the process: when it was above [`CpuRoom::BUSY`] of a window in which this
/// process polled, nobody in this process polls for a while (20 ms, doubling while it stays
/// so, up to 1 s; halved at each sample under it). A thread sees its own preemptions
/// ([`SpinGuard`]); the pressure shows the others' waits too: a poller that keeps a CPU makes
/// its peer or a neighbour wait for one without being preempted itself. Measured with
/// redis-benchmark -c 1 under the shim, both ends polling: 3% quiet, 47% beside one CPU-bound
/// process, 67% beside two (where polling cost the requests per second 2-4x). Used by the
/// shim's waits (its programs' reads and event loops), not by the socket API's `block_on`:
/// under `sdp-bench compare`, whose processes also sleep and wake between rows, a VM's slowly
/// waking idle vCPUs make PSI high for sleepers (sleep-and-wake ping-pong alone shows
/// 40-98%) and quiet p50 at 64 B went from 2.5 to 50 us. Without PSI in the kernel,
/// [`SpinGuard`] alone decides.
pub(crate) struct CpuRoom;

/// [`CpuRoom`]'s state (process-wide: the pressure is the host's).
struct CpuRoomState {
    /// When (ns after `base`) the last sample was taken, and the pressure total then (us).
    at: AtomicU64,
    total: AtomicU64,
    /// No polling before this (ns after `base`), and the last back-off given (ns).
    until: AtomicU64,
    backoff: AtomicU64,
    /// A thread is sampling; PSI is missing (never sample again); some thread polled since
    /// the last sample.
    sampling: AtomicBool,
    missing: AtomicBool,
    polled: AtomicBool,
}

static CPU_ROOM: CpuRoomState = CpuRoomState {
    at: AtomicU64::new(0),
    total: AtomicU64::new(0),
    until: AtomicU64::new(0),
    backoff: AtomicU64::new(0),
    sampling: AtomicBool::new(false),
    missing: AtomicBool::new(false),
    polled: AtomicBool::new(false),
};

impl CpuRoom {
    /// How often the pressure is read.
    const SAMPLE: Duration = Duration::from_millis(10);
    /// The share of time (percent) of waiting tasks above which polling stops.
    const BUSY: u64 = 10;
    const OFF_MIN: Duration = Duration::from_millis(20);
    const OFF_MAX: Duration = Duration::from_secs(1);

    fn now_ns() -> u64 {
        static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        BASE.get_or_init(std::time::Instant::now)
            .elapsed()
            .as_nanos() as u64
            + 1
    }

    /// May this process poll now?
    pub(crate) fn allows() -> bool {
        let st = &CPU_ROOM;
        let now = Self::now_ns();
        if now < st.until.load(Ordering::Relaxed) {
            return false;
        }
        let at = st.at.load(Ordering::Relaxed);
        // A window in which this process did not poll (it began before the back-off ended, or
        // nobody polled) measured the host without our polling: waking sleepers wait for a CPU
        // too (in a VM whose idle vCPUs wake slowly, sleep-and-wake ping-pong alone shows
        // 40-98%), so it says nothing about polling. Such a window is only restarted.
        let fresh =
            at == 0 || at < st.until.load(Ordering::Relaxed) || !st.polled.load(Ordering::Relaxed);
        let due = fresh || now.saturating_sub(at) >= Self::SAMPLE.as_nanos() as u64;
        if due && !st.missing.load(Ordering::Relaxed) && !st.sampling.swap(true, Ordering::Acquire)
        {
            Self::sample(st, now, !fresh);
            st.sampling.store(false, Ordering::Release);
        }
        now >= st.until.load(Ordering::Relaxed)
    }

    /// A thread of this process begins a poll (the window it falls in is judged).
    pub(crate) fn polling() {
        CPU_ROOM.polled.store(true, Ordering::Relaxed);
    }

    /// Read the pressure; with `judge`, decide on the window since the last reading.
    fn sample(st: &CpuRoomState, now: u64, judge: bool) {
        let Some(total) = sys::cpu_pressure_us() else {
            st.missing.store(true, Ordering::Relaxed);
            return;
        };
        let (at, before) = (
            st.at.load(Ordering::Relaxed),
            st.total.load(Ordering::Relaxed),
        );
        st.at.store(now, Ordering::Relaxed);
        st.total.store(total, Ordering::Relaxed);
        st.polled.store(false, Ordering::Relaxed);
        if !judge {
            return;
        }
        let waited = Duration::from_micros(total.saturating_sub(before));
        let wall = Duration::from_nanos(now.saturating_sub(at));
        let backoff = Duration::from_nanos(st.backoff.load(Ordering::Relaxed));
        let (backoff, off) = Self::judge(waited, wall, backoff);
        st.backoff
            .store(backoff.as_nanos() as u64, Ordering::Relaxed);
        if let Some(off) = off {
            st.until
                .store(now + off.as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// A window of `wall` in which some task `waited` for a CPU, after the back-off `backoff`:
    /// the back-off now, and how long polling stops (`None`: it goes on).
    fn judge(waited: Duration, wall: Duration, backoff: Duration) -> (Duration, Option<Duration>) {
        if waited.as_nanos() * 100 > wall.as_nanos().max(1) * Self::BUSY as u128 {
            let off = (backoff * 2).clamp(Self::OFF_MIN, Self::OFF_MAX);
            (off, Some(off))
        } else {
            (backoff / 2, None)
        }
    }
}

/// Live application-fd streams of this process (the shim's SDP sockets): event waits poll only
/// while there are some ([`poll_events`]).
pub(crate) static APP_STREAMS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// The poll time of event waits, learnt as blocking calls' is ([`AdaptiveSpin`]).
static EVENT_SPIN: std::sync::OnceLock<AdaptiveSpin> = std::sync::OnceLock::new();

/// How often a poll asks whether a signal came: one is handled this much later at most (a
/// kernel wakeup takes about as long).
pub(super) const SIGNAL_CHECK: Duration = Duration::from_micros(10);

/// How long a wait polls before it sleeps: `SDP_SPIN_US` if set, else `adaptive`'s time while
/// `may` (the back-off rules) allows it, else not at all.
pub(super) fn poll_time(adaptive: &AdaptiveSpin, may: impl FnOnce() -> bool) -> Duration {
    match spin_fixed() {
        Some(d) => d,
        None if may() => adaptive.get(),
        None => Duration::ZERO,
    }
}

/// One poll of a waiting thread (the shim's reads and event waits): `attempt(t)` (`t`: the
/// clock's time as it begins, read once per look) again and again until it gives an answer,
/// `spin` is over or `stop` (asked every [`SIGNAL_CHECK`]) says so.
/// The process counts as polling for [`CpuRoom`]; the poll's preemption goes to [`SpinGuard`]
/// (counted from `min_lost`) unless `SDP_SPIN_US` fixes the time.
pub(super) fn poll_for<T>(
    spin: Duration,
    min_lost: Duration,
    stop: &dyn Fn() -> bool,
    mut attempt: impl FnMut(std::time::Instant) -> Option<T>,
) -> Option<T> {
    let guarded = spin_fixed().is_none();
    CpuRoom::polling();
    let start = std::time::Instant::now();
    let sched0 = if guarded {
        sys::ThreadSched::now()
    } else {
        None
    };
    let mut next_check = SIGNAL_CHECK;
    let answer = loop {
        let t = std::time::Instant::now();
        if let Some(a) = attempt(t) {
            break Some(a);
        }
        let elapsed = t.saturating_duration_since(start);
        if elapsed >= spin {
            break None;
        }
        if elapsed >= next_check {
            if stop() {
                break None;
            }
            next_check = elapsed + SIGNAL_CHECK;
        }
    };
    if guarded {
        SpinGuard::ended(start, sched0, min_lost);
    }
    answer
}

/// The adaptive poll time of event waits ([`EVENT_SPIN`]).
fn event_spin() -> &'static AdaptiveSpin {
    EVENT_SPIN.get_or_init(AdaptiveSpin::new)
}

/// One thread's record of its event waits' polls: a thread whose polls keep finding nothing
/// (a timer thread, a loop whose events are not SDP's) polls before fewer and fewer waits:
/// after [`EventPolls::WASTED`] such polls in a row it skips 1, then 2, 4... up to 64 waits
/// between polls, until one finds its events.
#[derive(Clone, Copy, Default)]
struct EventPolls {
    /// Polls in a row that found nothing.
    wasted: u32,
    /// Waits left that do not poll.
    skip: u32,
}

impl EventPolls {
    const WASTED: u32 = 4;

    thread_local! {
        static THIS: std::cell::Cell<EventPolls> = const {
            std::cell::Cell::new(EventPolls { wasted: 0, skip: 0 })
        };
    }

    /// Whether this wait polls (counting a skipped one).
    fn polls() -> bool {
        Self::THIS.with(|c| {
            let mut s = c.get();
            let go = s.skip == 0;
            s.skip = s.skip.saturating_sub(1);
            c.set(s);
            go
        })
    }

    /// A poll found its events (`found`) or not.
    fn ended(found: bool) {
        Self::THIS.with(|c| {
            let mut s = c.get();
            if found {
                s = EventPolls::default();
            } else {
                s.wasted += 1;
                if s.wasted >= Self::WASTED {
                    s.skip = 1 << (s.wasted - Self::WASTED).min(6);
                }
            }
            c.set(s);
        });
    }
}

/// An event wait of the application's (`epoll_wait`, `poll`) with `timeout_ms` (negative:
/// none), made by `wait(timeout)`, a call of the real function that returns its count or -1
/// with errno set. While the process has SDP streams, it first polls: the real call with a
/// zero timeout, again and again, for the adaptive poll time (or `SDP_SPIN_US`, within the
/// timeout), as a blocking read polls its connection: a peer that answers within it is caught
/// without a sleep and a wakeup (`redis-benchmark -c 1` under the shim: 4x the requests of
/// kernel TCP, against 0.8x without). The kernel still answers every poll: nothing about the
/// events is emulated. Signals are held back while it polls; one that comes ends the poll and
/// acts as on the sleeping call: a handler makes it fail with EINTR (these calls are never
/// restarted), a default or ignored disposition lets it wait on. The thread's back-off rules
/// apply ([`SpinGuard`], [`CpuRoom`], [`EventPolls`]).
pub(crate) fn poll_events(timeout_ms: i32, mut wait: impl FnMut(i32) -> i32) -> i32 {
    poll_events_for(timeout_of_ms(timeout_ms), |t| wait(ms_of_timeout(t)))
}

/// A millisecond timeout as the event waits take it (negative: none) as a length.
pub(crate) fn timeout_of_ms(ms: i32) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

/// A length as a millisecond timeout (`None`: -1, none): whole milliseconds, rounded up, as
/// the kernel rounds its own wait up.
pub(crate) fn ms_of_timeout(t: Option<Duration>) -> i32 {
    match t {
        None => -1,
        Some(t) => t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
    }
}

/// Whether an event wait with `timeout` may poll at all: it waits, and the process has SDP
/// streams.
fn may_poll(timeout: Option<Duration>) -> bool {
    use std::sync::atomic::Ordering;
    timeout != Some(Duration::ZERO) && APP_STREAMS.load(Ordering::Relaxed) != 0
}

/// How long an event wait with `timeout` polls before it waits (`None`: not at all: the
/// process has no SDP streams, the call does not wait, or the back-off rules say no).
fn event_poll_time(timeout: Option<Duration>) -> Option<Duration> {
    if !may_poll(timeout) {
        return None;
    }
    let spin = poll_time(event_spin(), || {
        SpinGuard::allowed() && CpuRoom::allows() && EventPolls::polls()
    });
    let spin = timeout.map_or(spin, |l| spin.min(l));
    (!spin.is_zero()).then_some(spin)
}

/// An event wait's poll: `attempt()` (the real call without waiting) again and again for
/// `spin` or until `stop()`; its count and errno once it is not 0. Records the poll for
/// [`EventPolls`] and, when it found events, for the adaptive poll time.
fn event_poll(
    spin: Duration,
    stop: &dyn Fn() -> bool,
    mut attempt: impl FnMut() -> i32,
) -> Option<(i32, i32)> {
    let start = std::time::Instant::now();
    let got = poll_for(spin, SpinGuard::min_lost(false), stop, |_| {
        let n = attempt();
        (n != 0).then(|| (n, sys::errno()))
    });
    let found = got.is_some_and(|(n, _)| n > 0);
    if spin_fixed().is_none() {
        EventPolls::ended(found);
    }
    if found {
        event_spin().record(start.elapsed());
    }
    got
}

/// [`poll_events`] for calls with finer timeouts (`select`, `ppoll`): `timeout` `None` waits
/// without one, and `wait` gets the time left (`Some(ZERO)`: a poll).
pub(crate) fn poll_events_for(
    timeout: Option<Duration>,
    mut wait: impl FnMut(Option<Duration>) -> i32,
) -> i32 {
    // A wait that will not poll is the real call at once: it returns at once if events are
    // there (a try first cost redis-server under the shim one `epoll_wait` more per request
    // whenever the back-off rules said no poll, 2026-11-29).
    let Some(spin) = event_poll_time(timeout) else {
        return wait(timeout);
    };
    // Events there already: one try answers, as the real call would, before any cost of
    // polling (the signals held, the thread's and the CPU's figures read).
    let n = wait(Some(Duration::ZERO));
    if n != 0 {
        return n;
    }
    let Some(held) = sys::SignalsHeld::hold() else {
        return wait(timeout);
    };
    let start = std::time::Instant::now();
    let got = event_poll(spin, &|| held.came(), || wait(Some(Duration::ZERO)));
    // The handlers run here, and may leave errno changed: the poll's own goes back after.
    let handled = held.release();
    if let Some((n, err)) = got {
        sys::set_errno(err);
        return n;
    }
    if handled.any {
        sys::set_errno(libc::EINTR);
        return -1;
    }
    let left = match timeout {
        None => None,
        Some(l) => match l.checked_sub(start.elapsed()) {
            Some(left) if !left.is_zero() => Some(left),
            _ => return 0,
        },
    };
    let n = wait(left);
    event_spin().record(start.elapsed());
    n
}

/// [`poll_events_for`] for the calls given a signal mask for their wait (`ppoll`, `pselect`,
/// `epoll_pwait`, `epoll_pwait2`): `poll()` tries once without waiting, `wait(left)` is the
/// real call with the caller's mask and the time left. Every signal is held while polling
/// (zero-timeout tries deliver none); a signal the call's mask lets through ends the poll, and
/// the real call, made while they are still held, installs the caller's mask as it would
/// have at once: the kernel delivers what that mask lets through (EINTR, the handler run
/// with the call's mask) and leaves the rest pending until the thread's own mask comes back
/// after it, as after any such call. Nothing here turns a handler into EINTR itself.
pub(crate) fn poll_events_masked(
    timeout: Option<Duration>,
    mask: &libc::sigset_t,
    mut poll: impl FnMut() -> i32,
    wait: impl FnOnce(Option<Duration>) -> i32,
) -> i32 {
    // As in `poll_events_for`: no try for a wait that will not poll.
    let Some(spin) = event_poll_time(timeout) else {
        return wait(timeout);
    };
    // The try uses the call's mask, as the real call would.
    let n = poll();
    if n != 0 {
        return n;
    }
    let Some(held) = sys::SignalsHeld::hold() else {
        return wait(timeout);
    };
    let start = std::time::Instant::now();
    let got = event_poll(spin, &|| held.came_through(mask), poll);
    let (n, err) = match got {
        Some(answer) => answer,
        None => {
            let left = timeout.map(|l| l.saturating_sub(start.elapsed()));
            let n = wait(left);
            event_spin().record(start.elapsed());
            (n, sys::errno())
        }
    };
    // Signals the call's mask held back and the thread's own lets through run now, after
    // the call, as they would after the real one.
    drop(held);
    sys::set_errno(err);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A preemption stops polling only if it took the poll's thread off its CPU for long
    /// enough: a scheduler slice's worth over shm ([`PREEMPT_PEER`]), [`PREEMPT_COSTLY`]
    /// over RDMA (the device's packet work preempts a poller for moments), measured as wall
    /// time the thread did not run.
    #[test]
    fn which_preemptions_stop_polling() {
        let short = Duration::from_micros(20);
        let (rdma, shm) = (SpinGuard::min_lost(true), SpinGuard::min_lost(false));
        assert!(!SpinGuard::counts(true, short, rdma));
        assert!(!SpinGuard::counts(true, short, shm));
        assert!(SpinGuard::counts(true, PREEMPT_PEER, shm));
        assert!(!SpinGuard::counts(true, PREEMPT_PEER, rdma));
        assert!(SpinGuard::counts(true, PREEMPT_COSTLY, rdma));
        assert!(SpinGuard::counts(true, Duration::from_micros(750), shm));
        for min_lost in [rdma, shm] {
            assert!(!SpinGuard::counts(
                false,
                Duration::from_millis(5),
                min_lost
            ));
        }
        let at = std::time::Instant::now();
        let before = sys::ThreadSched {
            ivcsw: 3,
            cpu: Duration::from_micros(1000),
            at,
        };
        let after = sys::ThreadSched {
            ivcsw: 4,
            cpu: Duration::from_micros(1060),
            at: at + Duration::from_micros(300),
        };
        assert_eq!(after.since(&before), (true, Duration::from_micros(240)));
        assert_eq!(before.since(&before), (false, Duration::ZERO));
    }

    /// Polling stops for 20 ms when tasks waited for a CPU more than a tenth of a window,
    /// doubling while it stays so, up to 1 s; a calm window halves the back-off and lets
    /// polling go on.
    #[test]
    fn cpu_pressure_stops_polling_and_calm_brings_it_back() {
        let ms = Duration::from_millis;
        let wall = ms(10);
        let (b, off) = CpuRoom::judge(Duration::from_micros(300), wall, Duration::ZERO);
        assert_eq!((b, off), (Duration::ZERO, None), "3% is quiet");
        let (b, off) = CpuRoom::judge(ms(5), wall, Duration::ZERO);
        assert_eq!((b, off), (ms(20), Some(ms(20))));
        let (b, off) = CpuRoom::judge(ms(5), wall, b);
        assert_eq!((b, off), (ms(40), Some(ms(40))));
        let (b, off) = CpuRoom::judge(ms(9), wall, ms(900));
        assert_eq!((b, off), (ms(1000), Some(ms(1000))));
        let (b, off) = CpuRoom::judge(ms(0), wall, ms(40));
        assert_eq!((b, off), (ms(20), None));
        // Exactly a tenth is not over it.
        assert_eq!(CpuRoom::judge(ms(1), wall, ms(0)).1, None);
    }

    /// A thread whose event waits' polls keep finding nothing polls before fewer and fewer
    /// waits (after 4 in a row: 1 in 2, then 1 in 3, 1 in 5... at most 1 in 65), and polls
    /// before every wait again once one finds its events.
    #[test]
    fn event_polls_that_find_nothing_come_rarer() {
        std::thread::spawn(|| {
            let mut polled = Vec::new();
            for _ in 0..40 {
                let p = EventPolls::polls();
                polled.push(p);
                if p {
                    EventPolls::ended(false);
                }
            }
            // Four wasted polls, then skips of 1, 2, 4, 8 between polls.
            let at: Vec<usize> = polled
                .iter()
                .enumerate()
                .filter(|(_, &p)| p)
                .map(|(i, _)| i)
                .collect();
            assert_eq!(&at[..8], &[0, 1, 2, 3, 5, 8, 13, 22], "{polled:?}");
            // Skips never pass 64.
            for _ in 0..2000 {
                if EventPolls::polls() {
                    EventPolls::ended(false);
                }
            }
            let mut gap = 0;
            while !EventPolls::polls() {
                gap += 1;
            }
            assert!(gap <= 64, "{gap}");
            EventPolls::ended(true);
            assert!((0..10).all(|_| EventPolls::polls()));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn adaptive_spin_follows_short_waits_and_falls_back_after_long_ones() {
        if spin_fixed().is_some() {
            // SDP_SPIN_US fixes the poll time: nothing adapts.
            let s = AdaptiveSpin::new();
            s.record(Duration::from_micros(300));
            assert_eq!(s.get(), spin_fixed().unwrap());
            return;
        }
        let s = AdaptiveSpin::new();
        assert_eq!(s.get(), SPIN_BASE);
        // Replies that come after ~200 us: the poll grows towards 300 us, never past it.
        for _ in 0..50 {
            s.record(Duration::from_micros(200));
        }
        let grown = s.get();
        assert!(grown > Duration::from_micros(280) && grown <= Duration::from_micros(300));
        // Very short waits never push it under the base.
        for _ in 0..50 {
            s.record(Duration::from_micros(1));
        }
        assert_eq!(s.get(), SPIN_BASE);
        // Waits near a millisecond are capped at SPIN_MAX.
        for _ in 0..50 {
            s.record(Duration::from_micros(900));
        }
        assert!(s.get() <= SPIN_MAX && s.get() > SPIN_MAX - Duration::from_micros(5));
        // An idle connection (long waits) brings it back to the base.
        for _ in 0..50 {
            s.record(Duration::from_secs(2));
        }
        assert!(s.get() < SPIN_BASE + Duration::from_micros(1));
    }
}
