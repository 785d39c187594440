//! What a process's recent connections to a destination teach automatic transport choice: a
//! destination whose connections over SDP keep ending after a handful of messages is served
//! better by kernel TCP for a while.
//!
//! Setting an SDP connection up costs more than TCP's handshake (over shm ~0.1 ms of CPU on
//! each side and a rendezvous; over RDMA the CM's exchange, a QP, registered buffers), and a
//! connection that carries one request and its answer never wins that back: nginx with one
//! request per connection ran at 0.08x kernel TCP under the shim. So, as SMC's handshake limit
//! and TCP Fast Open's blackhole cache adapt per destination, a process whose application-fd
//! connects ([`AppStream::connect`](super::app::AppStream::connect); the shim asks [`advice`]
//! before its automatic ones, an explicit SDP choice never does) made
//! `SDP_SHORT_CONNS` (default 8) connections in a row to one address and port
//! over SDP, each ending with fewer than [`SHORT_MSGS`] messages and [`SHORT_BYTES`] bytes
//! both ways, connects there over kernel TCP for [`HOLD`]; then SDP is tried again, and one
//! more short connection renews the hold at once, while a connection that carried more clears
//! it. A long-lived pool among short ones keeps SDP: any connection past the limits restarts
//! the count.
//!
//! Pure state with the clock passed in; the socket layer keeps one per process
//! ([`advice`], [`record_end`]). Its lock is only ever tried, never waited for: a child forked
//! while another thread held it sees no history (SDP for every connection), never a hang.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A connection that exchanged fewer messages than this (both ways: the Hello, data, credit
/// updates, the close) is short...
pub const SHORT_MSGS: u64 = 32;
/// ...when it also carried fewer bytes than this (both ways).
pub const SHORT_BYTES: u64 = 1 << 20;
/// How long a destination's connections go by kernel TCP after a run of short ones.
pub const HOLD: Duration = Duration::from_secs(1);
/// Destinations remembered; past this the oldest are forgotten.
const MAX_DESTS: usize = 1024;

/// Why a connection goes by kernel TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShortLived {
    /// Short connections in a row over SDP to the destination.
    pub run: u32,
    /// The destination refused SDP lately instead ([`History::record_refused`]).
    pub refused: bool,
}

impl std::fmt::Display for ShortLived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.refused {
            return f.write_str(
                "SDP turned away by this address lately (the server takes it by kernel TCP, \
                 or its processes were slow to accept)",
            );
        }
        write!(
            f,
            "short-lived connections: the last {} over SDP to this address each ended within \
             {SHORT_MSGS} messages (SDP_SHORT_CONNS)",
            self.run
        )
    }
}

#[derive(Debug, Clone, Copy)]
struct Dest {
    /// Short connections in a row.
    run: u32,
    /// Connections go by kernel TCP until then.
    tcp_until: Option<Instant>,
    /// Because an SDP connect there was refused.
    refused: bool,
    /// The last time this destination was told or taught anything (for forgetting).
    seen: Instant,
}

/// The destinations of one process. `limit`: short connections in a row that start a hold
/// (0: never).
#[derive(Debug)]
pub struct History {
    limit: u32,
    dests: HashMap<SocketAddr, Dest>,
}

impl History {
    pub fn new(limit: u32) -> History {
        History {
            limit,
            dests: HashMap::new(),
        }
    }

    /// Whether a connection to `addr` made at `now` should go by kernel TCP, and why.
    pub fn advice(&mut self, addr: SocketAddr, now: Instant) -> Option<ShortLived> {
        let d = self.dests.get_mut(&addr)?;
        d.seen = now;
        match d.tcp_until {
            Some(t) if now < t => Some(ShortLived {
                run: d.run,
                refused: d.refused,
            }),
            _ => None,
        }
    }

    /// A connection to `addr` over SDP ended at `now` after `msgs` messages and `bytes` bytes
    /// (both ways).
    pub fn record_end(&mut self, addr: SocketAddr, now: Instant, msgs: u64, bytes: u64) {
        if self.limit == 0 {
            return;
        }
        let short = msgs < SHORT_MSGS && bytes < SHORT_BYTES;
        if !short {
            // Nothing to remember about a destination whose connections pay off.
            self.dests.remove(&addr);
            return;
        }
        let limit = self.limit;
        let d = self.dest(addr, now);
        d.run = d.run.saturating_add(1);
        d.seen = now;
        if d.run >= limit {
            d.tcp_until = Some(now + HOLD);
            d.refused = false;
        }
    }

    /// An SDP connect to `addr` was turned away by its listener at `now` (a forking server's,
    /// `app::Handed`): connects there go by kernel TCP for [`HOLD`] without asking (a refusal
    /// that takes the listener's answer costs a round trip between the processes; one where
    /// nothing listens over SDP costs less than remembering would save, and a listener may
    /// come any moment).
    pub fn record_refused(&mut self, addr: SocketAddr, now: Instant) {
        if self.limit == 0 {
            return;
        }
        let d = self.dest(addr, now);
        d.refused = true;
        d.seen = now;
        d.tcp_until = Some(now + HOLD);
    }

    /// `addr`'s entry, made if new (the oldest forgotten past [`MAX_DESTS`]).
    fn dest(&mut self, addr: SocketAddr, now: Instant) -> &mut Dest {
        if !self.dests.contains_key(&addr) && self.dests.len() >= MAX_DESTS {
            self.forget_oldest();
        }
        self.dests.entry(addr).or_insert(Dest {
            run: 0,
            tcp_until: None,
            refused: false,
            seen: now,
        })
    }

    fn forget_oldest(&mut self) {
        let mut seen: Vec<Instant> = self.dests.values().map(|d| d.seen).collect();
        seen.sort_unstable();
        let cut = seen[seen.len() / 2];
        self.dests.retain(|_, d| d.seen > cut);
    }
}

/// The process's history, made at first use with `SDP_SHORT_CONNS`.
static HISTORY: Mutex<Option<History>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut History) -> R) -> Option<R> {
    let mut g = HISTORY.try_lock()?;
    let h = g.get_or_insert_with(|| History::new(super::tunables::tunables().short_conns));
    Some(f(h))
}

/// [`History::advice`] for this process (`None` too when the history is busy).
pub fn advice(addr: SocketAddr) -> Option<ShortLived> {
    with(|h| h.advice(addr, Instant::now())).flatten()
}

/// [`History::record_end`] for this process (skipped when the history is busy).
pub fn record_end(addr: SocketAddr, msgs: u64, bytes: u64) {
    with(|h| h.record_end(addr, Instant::now(), msgs, bytes));
}

/// [`History::record_refused`] for this process (skipped when the history is busy).
pub fn record_refused(addr: SocketAddr) {
    with(|h| h.record_refused(addr, Instant::now()));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn a_run_of_short_connections_holds_the_destination_on_tcp_for_a_while() {
        let mut h = History::new(3);
        let t = Instant::now();
        for i in 0..2 {
            h.record_end(addr(1), t, 9, 100);
            assert_eq!(h.advice(addr(1), t), None, "after {} short", i + 1);
        }
        h.record_end(addr(1), t, 9, 100);
        assert_eq!(
            h.advice(addr(1), t),
            Some(ShortLived {
                run: 3,
                refused: false
            })
        );
        assert_eq!(
            h.advice(addr(2), t),
            None,
            "another port is another destination"
        );
        let later = t + HOLD - Duration::from_millis(1);
        assert!(h.advice(addr(1), later).is_some());
        // The hold over, SDP is tried again; one more short connection renews the hold.
        let after = t + HOLD;
        assert_eq!(h.advice(addr(1), after), None);
        h.record_end(addr(1), after, 9, 100);
        assert_eq!(
            h.advice(addr(1), after),
            Some(ShortLived {
                run: 4,
                refused: false
            })
        );
    }

    #[test]
    fn a_connection_past_either_limit_clears_the_count_and_the_hold() {
        let t = Instant::now();
        for (msgs, bytes) in [(SHORT_MSGS, 10), (3, SHORT_BYTES)] {
            let mut h = History::new(2);
            h.record_end(addr(1), t, 3, 10);
            h.record_end(addr(1), t, msgs, bytes);
            h.record_end(addr(1), t, 3, 10);
            assert_eq!(h.advice(addr(1), t), None, "{msgs} messages, {bytes} bytes");
            h.record_end(addr(1), t, 3, 10);
            assert!(h.advice(addr(1), t).is_some());
            h.record_end(addr(1), t, msgs, bytes);
            assert_eq!(h.advice(addr(1), t), None, "{msgs} messages, {bytes} bytes");
        }
    }

    #[test]
    fn a_limit_of_zero_never_holds() {
        let mut h = History::new(0);
        let t = Instant::now();
        for _ in 0..100 {
            h.record_end(addr(1), t, 1, 1);
        }
        assert_eq!(h.advice(addr(1), t), None);
    }

    #[test]
    fn the_oldest_destinations_are_forgotten_first() {
        let mut h = History::new(1);
        let t = Instant::now();
        for p in 0..MAX_DESTS as u16 {
            h.record_end(addr(p), t + Duration::from_millis(p.into()), 1, 1);
        }
        h.record_end(addr(60000), t + Duration::from_secs(2), 1, 1);
        assert!(h.dests.len() <= MAX_DESTS);
        let now = t + Duration::from_millis(1500);
        assert!(h.advice(addr(60000), now).is_some());
        assert!(h.advice(addr(MAX_DESTS as u16 - 1), now).is_some());
        assert_eq!(h.advice(addr(0), t), None, "the oldest went");
    }

    #[test]
    fn a_refused_connect_holds_the_destination_on_tcp_for_a_while() {
        let mut h = History::new(8);
        let t = Instant::now();
        h.record_refused(addr(2), t);
        let a = h.advice(addr(2), t + Duration::from_millis(10)).unwrap();
        assert!(a.refused && a.to_string().contains("turned away"), "{a}");
        assert_eq!(h.advice(addr(2), t + HOLD + Duration::from_millis(1)), None);
        assert_eq!(h.advice(addr(3), t), None);
        // Learning off: nothing held.
        let mut off = History::new(0);
        off.record_refused(addr(2), t);
        assert_eq!(off.advice(addr(2), t), None);
    }
}
