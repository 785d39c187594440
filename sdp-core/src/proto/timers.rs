//! The timer table: one deadline per kind of timer, looped over by [`Conn::poll_timeout`] and
//! [`Conn::handle_timeout`] (see [`super::timeouts`] for what each does when it fires).
//!
//! [`Conn::poll_timeout`]: super::Conn::poll_timeout
//! [`Conn::handle_timeout`]: super::Conn::handle_timeout

use std::time::Duration;

use super::Instant;

/// Probe a peer this long after it last sent anything while we wait for its credits.
pub(crate) const PERSIST: Duration = Duration::from_secs(1);

/// A connection's timers, in the order [`Conn::handle_timeout`] serves them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Timer {
    /// Connection setup must finish (`connect_timeout`): the connection fails.
    Setup,
    /// The orderly disconnect must finish (`disconnect_timeout`): torn down.
    Disconnect,
    /// After close, queued data must be gone (`linger`): aborted.
    Linger,
    /// Keepalive or zero-window probe due.
    Keepalive,
    /// A zero-copy source made no progress within its bound. Its deadline is not kept in the
    /// table: each source has its own ([`super::iocb::Iocbs::src_deadline`] is the earliest).
    SrcAvail,
    /// Time to check whether the connection went idle (`idle_shrink`).
    IdleCheck,
}

impl Timer {
    /// Every timer, in the order they are served.
    pub(crate) const ALL: [Timer; 6] = [
        Timer::Setup,
        Timer::Disconnect,
        Timer::Linger,
        Timer::Keepalive,
        Timer::SrcAvail,
        Timer::IdleCheck,
    ];
}

/// The deadlines of a connection's timers, and the times they measure from.
#[derive(Debug, Clone)]
pub(crate) struct TimerTable {
    at: [Option<Instant>; Timer::ALL.len()],
    /// When the peer last showed it is alive (a message or a probe's completion).
    last_rx_at: Instant,
    /// When the connection last moved data (for the idle shrink).
    last_activity: Instant,
    /// Probes sent since the peer last showed it is alive.
    keepalive_outstanding: u32,
    /// The idle check stopped itself (the connection went idle and had nothing left to give
    /// back): the next move of data starts it again ([`TimerTable::touch`]), so an idle
    /// connection has no timer at all and costs its process no wakeup.
    idle_parked: bool,
}

impl TimerTable {
    #[inline]
    pub(crate) fn new(now: Instant) -> TimerTable {
        TimerTable {
            at: [None; Timer::ALL.len()],
            last_rx_at: now,
            last_activity: now,
            keepalive_outstanding: 0,
            idle_parked: false,
        }
    }
    #[inline]
    pub(crate) fn get(&self, t: Timer) -> Option<Instant> {
        self.at[t as usize]
    }
    #[inline]
    pub(crate) fn set(&mut self, t: Timer, at: Option<Instant>) {
        self.at[t as usize] = at;
        if t == Timer::IdleCheck {
            self.idle_parked = false;
        }
    }
    #[inline]
    pub(crate) fn start(&mut self, t: Timer, at: Instant) {
        self.set(t, Some(at));
    }
    #[inline]
    pub(crate) fn stop(&mut self, t: Timer) {
        self.set(t, None);
    }
    #[inline]
    pub(crate) fn stop_all(&mut self) {
        self.at = [None; Timer::ALL.len()];
    }
    #[inline]
    pub(crate) fn is_armed(&self, t: Timer) -> bool {
        self.get(t).is_some()
    }
    /// The data moved now; a parked idle check ([`TimerTable::park_idle`]) is due `idle`
    /// from now.
    #[inline]
    pub(crate) fn touch(&mut self, now: Instant, idle: Duration) {
        self.last_activity = now;
        if self.idle_parked {
            self.start(Timer::IdleCheck, now + idle);
        }
    }
    /// Stop the idle check until the data moves again ([`TimerTable::touch`]). Stopping or
    /// starting it otherwise (a disconnect) ends the parking.
    #[inline]
    pub(crate) fn park_idle(&mut self) {
        self.set(Timer::IdleCheck, None);
        self.idle_parked = true;
    }
    /// How long since the data last moved.
    #[inline]
    pub(crate) fn idle_for(&self, now: Instant) -> Duration {
        now.saturating_since(self.last_activity)
    }
    /// The peer showed it is alive now.
    #[inline]
    pub(crate) fn heard(&mut self, now: Instant) {
        self.last_rx_at = now;
    }
    /// When the peer last showed it is alive.
    #[inline]
    pub(crate) fn last_rx_at(&self) -> Instant {
        self.last_rx_at
    }
    /// Probes sent since the peer last showed it is alive.
    #[inline]
    pub(crate) fn probes_outstanding(&self) -> u32 {
        self.keepalive_outstanding
    }
    /// A probe was sent.
    #[inline]
    pub(crate) fn probe_sent(&mut self) {
        self.keepalive_outstanding += 1;
    }
    /// The probe count starts again (the keepalive timer was rearmed).
    #[inline]
    pub(crate) fn reset_probes(&mut self) {
        self.keepalive_outstanding = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_starts_stops_and_indexes_each_timer_apart() {
        let mut t = TimerTable::new(Instant(0));
        assert!(Timer::ALL.iter().all(|&k| t.get(k).is_none()));
        for (i, k) in Timer::ALL.into_iter().enumerate() {
            t.start(k, Instant(100 + i as u64));
        }
        for (i, k) in Timer::ALL.into_iter().enumerate() {
            assert_eq!(t.get(k), Some(Instant(100 + i as u64)));
        }
        t.stop(Timer::Linger);
        assert!(!t.is_armed(Timer::Linger));
        assert!(t.is_armed(Timer::Keepalive));
        t.stop_all();
        assert!(Timer::ALL.iter().all(|&k| !t.is_armed(k)));
    }
}
