//! What each timer does when it fires: connection setup, the orderly disconnect, linger
//! after close, keepalive and the zero-window probe (both a zero-byte RDMA Write), zero-copy
//! sources that stall, and the idle shrink of the buffers. The deadlines are in the
//! timer table ([`timers`](crate::proto::timers)).

use std::ops::ControlFlow;
use std::time::Duration;

use super::{wrid, Conn, Count};
use crate::proto::buff::BufStore;
use crate::proto::error::ConnError;
use crate::proto::timers::{Timer, PERSIST};
use crate::proto::tx::Inflight;
use crate::proto::Instant;
use crate::verbs::{Completion, RemoteBuf, SendOp, SendWr, WcStatus, WorkRequest};

impl<S: BufStore> Conn<S> {
    /// When timer `t` fires, if it is armed.
    fn deadline(&self, t: Timer) -> Option<Instant> {
        match t {
            Timer::SrcAvail => self.iocbs.src_deadline(),
            t => self.timers.get(t),
        }
    }

    /// The earliest time [`Conn::handle_timeout`] must be called.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        Timer::ALL
            .into_iter()
            .filter_map(|t| self.deadline(t))
            .min()
    }

    /// Serve every timer whose deadline passed, in order; the ones that end the connection
    /// stop the round.
    pub(super) fn expire_timers(&mut self, now: Instant) {
        for t in Timer::ALL {
            if self.deadline(t).is_some_and(|d| now >= d) && self.on_timer(now, t).is_break() {
                return;
            }
        }
        self.flush(now);
    }

    fn on_timer(&mut self, now: Instant, t: Timer) -> ControlFlow<()> {
        match t {
            Timer::Setup => {
                self.timers.stop(t);
                self.fail(now, ConnError::TimedOut, true);
                ControlFlow::Break(())
            }
            Timer::Disconnect => {
                self.timers.stop(t);
                self.finish(now);
                ControlFlow::Break(())
            }
            Timer::Linger => {
                self.timers.stop(t);
                self.abort_with(now, ConnError::TimedOut);
                ControlFlow::Break(())
            }
            Timer::Keepalive => {
                self.keepalive_due(now);
                ControlFlow::Continue(())
            }
            Timer::SrcAvail => {
                self.srcavail_timed_out(now);
                ControlFlow::Continue(())
            }
            Timer::IdleCheck => {
                self.idle_check(now);
                ControlFlow::Continue(())
            }
        }
    }

    pub(super) fn arm_keepalive(&mut self, now: Instant) {
        let at = self.probe_idle().map(|d| now + d);
        self.timers.set(Timer::Keepalive, at);
        self.timers.reset_probes();
    }

    /// The connection moved data now (the idle shrink measures from the last time).
    #[inline]
    pub(super) fn touch(&mut self, now: Instant) {
        self.timers.touch(now, self.cfg.idle_shrink);
    }

    /// The peer showed it is alive: a message arrived.
    pub(super) fn heard_from_peer(&mut self, now: Instant) {
        self.timers.heard(now);
        self.touch(now);
        self.arm_keepalive(now);
    }

    /// Keepalive timer: probe an idle peer with a zero-byte RDMA Write.
    fn keepalive_due(&mut self, now: Instant) {
        let Some(idle) = self.probe_idle() else {
            self.timers.stop(Timer::Keepalive);
            return;
        };
        let last_rx_at = self.timers.last_rx_at();
        if now.saturating_since(last_rx_at) < idle {
            self.timers.start(Timer::Keepalive, last_rx_at + idle);
            return;
        }
        if self.timers.probes_outstanding() >= self.cfg.keepalive_probes {
            self.fail(now, ConnError::TimedOut, true);
            return;
        }
        self.timers.probe_sent();
        self.count(Count::KeepaliveSent);
        let key = self.tx.post(Inflight::Keepalive);
        self.wrs.push_back(WorkRequest::Send(SendWr {
            wr_id: wrid::KEEPALIVE | key as u64,
            op: SendOp::Write(RemoteBuf { addr: 0, rkey: 0 }),
            sge: None,
            signaled: true,
            solicited: false,
            wake_engine: false,
            payload: None,
        }));
        self.timers
            .start(Timer::Keepalive, now + self.cfg.keepalive_interval);
    }

    /// How long without hearing from the peer before probing it: the keepalive setting, or,
    /// while we wait for credits with data queued (the peer may be dead, and nothing of ours
    /// is in flight to find out), the persist interval, like TCP's zero-window probes.
    fn probe_idle(&self) -> Option<Duration> {
        let persist = self.credit_stalled().then_some(PERSIST);
        match (self.cfg.keepalive_idle, persist) {
            (Some(k), Some(p)) => Some(k.min(p)),
            (k, p) => k.or(p),
        }
    }

    /// Data is queued, no credit to send it, and nothing in flight.
    fn credit_stalled(&self) -> bool {
        !self.credits.can_send_data() && self.tx.has_queued() && self.tx.nothing_inflight()
    }

    /// Keep the probe timer in step with the credit state (called after every round of work).
    pub(super) fn arm_persist(&mut self) {
        if !self.timers.is_armed(Timer::Keepalive) && self.credit_stalled() {
            self.timers
                .start(Timer::Keepalive, self.timers.last_rx_at() + PERSIST);
        }
    }

    pub(super) fn on_keepalive_completion(&mut self, now: Instant, idx: usize, wc: &Completion) {
        self.tx.complete(idx);
        if wc.status == WcStatus::Success {
            // The peer's HCA answered: it is alive.
            self.timers.heard(now);
            self.arm_keepalive(now);
        } else {
            self.on_wc_error(now, wc.status);
        }
    }

    /// No traffic for `idle_shrink`: shrink back to the initial buffer count and give idle
    /// send buffers back.
    fn idle_check(&mut self, now: Instant) {
        let idle = self.timers.idle_for(now) >= self.cfg.idle_shrink;
        if idle {
            self.rx
                .shrink_target(self.cfg.min_rx_bufs, self.cfg.initial_rx_bufs);
            self.tx.trim_idle(&mut self.store);
            for b in self.staging.take_spares() {
                self.store.free(b);
            }
            self.advts.trim_bounce(&mut self.store);
            self.rx.trim(&mut self.store, 0);
            if self.tx.nothing_inflight() {
                // Nothing can come back to give up later: no timer until the data moves
                // again (an idle server's thousands of connections wake nobody).
                self.timers.park_idle();
                return;
            }
        }
        self.timers
            .start(Timer::IdleCheck, now + self.cfg.idle_shrink);
    }
}
