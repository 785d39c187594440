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
/// involuntary context switch during its poll), something else wanted that CPU, possibly the
/// peer it waits for, and polling on would take the CPU from it. Then this thread's blocking
/// calls sleep at once for a while (20 ms, doubling while it happens again, up to 1 s), after
/// which one poll probes again (over RDMA, a preemption that took less than [`PREEMPT_COSTLY`]
/// of the poll does not count). The back-off is forgotten only after [`SPIN_FORGIVE`] without
/// a preemption: a busy host leaves some polls clean, and forgetting at the first one let
/// polling come back every 20 ms, each return costing a preempted waiter a scheduler slice
/// (p99 of 0.6-1 ms under `sdp-bench compare --load 1`). Per thread: a busy host's threads
/// each learn it by themselves. (A fixed `SDP_SPIN_US` is used as it is.)
pub(super) struct SpinGuard;

/// The shortest and longest time a thread does not poll after it was preempted polling.
pub(super) const SPIN_OFF_MIN: Duration = Duration::from_millis(20);
pub(super) const SPIN_OFF_MAX: Duration = Duration::from_secs(1);
/// Over RDMA, a preempted poll backs off only if the preemption took at least this much of
/// its time. There the peer runs on another host, so a poller takes no CPU from it; what
/// preempts it for a moment is mostly the device's kernel work for the very message it waits
/// for (Soft-RoCE's and siw's packet processing: in the rig most round trips), no reason to
/// stop polling, while a CPU-bound neighbour takes a scheduler slice (milliseconds). Over shm
/// the peer shares our CPUs, and under a CPU-bound load even a short preemption foretells long
/// ones (`sdp-bench compare --load 1` with this rule: p99 at 64 KiB 460-490 us against 78-87):
/// every preemption counts there.
pub(super) const PREEMPT_COSTLY: Duration = Duration::from_micros(100);
/// Over shm, a poll that found its answer backs off only if a preemption took at least this
/// much of it. When one end sleeps, the wakeup its peer sends puts it on the peer's CPU
/// (the scheduler's wake-affine placement), preempting the peer's poll for the few
/// microseconds it takes to answer: that preemption is the answer coming, not a busy host
/// (whose CPU-bound processes take scheduler slices, 0.75 ms and more). Counted, it made both
/// ends of a ping-pong back off together and sleep on every message (sockperf under the shim:
/// p50 10.8 us instead of 4.3).
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
    /// RDMA ([`PREEMPT_COSTLY`]); over shm none when the poll found nothing, and
    /// [`PREEMPT_PEER`] when it found its answer.
    pub(super) fn min_lost(rdma: bool, answered: bool) -> Duration {
        match (rdma, answered) {
            (true, _) => PREEMPT_COSTLY,
            (false, true) => PREEMPT_PEER,
            (false, false) => Duration::ZERO,
        }
    }

    /// Whether a poll's preemption (`preempted`, for `lost` of its time) stops polling for a
    /// while: only one that took at least `min_lost`.
    fn counts(preempted: bool, lost: Duration, min_lost: Duration) -> bool {
        preempted && lost >= min_lost
    }

    /// A poll that ran from `start` (its thread's scheduling as it began: `sched0`) ended; a
    /// preemption counts only if it took `min_lost` of the poll ([`Self::min_lost`]).
    pub(super) fn ended(
        start: std::time::Instant,
        sched0: Option<sys::ThreadSched>,
        min_lost: Duration,
    ) {
        let (Some(before), Some(after)) = (sched0, sys::ThreadSched::now()) else {
            return;
        };
        let (preempted, lost) = after.since(&before);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Over shm a preemption of a poll that found nothing stops polling for a while, and one
    /// of a poll that found its answer only if it took a scheduler slice's worth; over RDMA
    /// only one that took the poll [`PREEMPT_COSTLY`] or more (the device's packet work
    /// preempts a poller for moments), measured as wall time the thread did not run.
    #[test]
    fn which_preemptions_stop_polling() {
        let short = Duration::from_micros(20);
        let (rdma, shm_found, shm_none) = (
            SpinGuard::min_lost(true, false),
            SpinGuard::min_lost(false, true),
            SpinGuard::min_lost(false, false),
        );
        assert_eq!(SpinGuard::min_lost(true, true), rdma);
        assert!(SpinGuard::counts(true, short, shm_none));
        assert!(!SpinGuard::counts(true, short, rdma));
        assert!(!SpinGuard::counts(true, short, shm_found));
        assert!(SpinGuard::counts(true, PREEMPT_COSTLY, rdma));
        assert!(SpinGuard::counts(
            true,
            Duration::from_micros(750),
            shm_found
        ));
        for min_lost in [rdma, shm_found, shm_none] {
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
