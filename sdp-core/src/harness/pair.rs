//! Two drivers over one simulated fabric, in virtual time, like quinn-proto's `Pair`.
//!
//! Host A (10.0.0.1) connects, host B (10.0.0.2) listens. [`Pair::step`] polls both drivers and
//! advances the fabric to the next thing due (a delivery or an engine deadline), so a test runs
//! as fast as the CPU allows and is fully deterministic for a seed.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::driver::{Driver, ListenerId};
use crate::proto::table::ConnId;
use crate::proto::{Config, Event, Instant};
use crate::verbs::sim::{SimConfig, SimFabric, SimProvider};

pub const A_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
pub const B_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
pub const PORT: u16 = 7000;

/// A [`Pair`] by named parameters: `PairSpec { seed: 3, sim, ..PairSpec::default() }.build()`.
#[derive(Clone, Default)]
pub struct PairSpec {
    /// Seeds the fabric (latency jitter, fault choices): the same seed, the same run.
    pub seed: u64,
    pub sim: SimConfig,
    /// A's (the connector's) engine configuration.
    pub a: Config,
    /// B's (the listener's) engine configuration.
    pub b: Config,
}

impl PairSpec {
    /// Both engines with `cfg`.
    pub fn config(mut self, cfg: Config) -> PairSpec {
        self.a = cfg.clone();
        self.b = cfg;
        self
    }

    pub fn build(self) -> Pair {
        Pair::with(self.seed, self.sim, self.a, self.b)
    }
}

pub struct Pair {
    pub fabric: SimFabric,
    pub a: Driver<SimProvider>,
    pub b: Driver<SimProvider>,
    pub listener: ListenerId,
}

impl Pair {
    pub fn new(seed: u64, cfg: Config) -> Pair {
        Pair::with(seed, SimConfig::default(), cfg.clone(), cfg)
    }

    pub fn with(seed: u64, sim: SimConfig, cfg_a: Config, cfg_b: Config) -> Pair {
        let fabric = SimFabric::with_config(seed, sim);
        let a = Driver::new(fabric.provider(A_IP), cfg_a);
        let mut b = Driver::new(fabric.provider(B_IP), cfg_b);
        let listener = b.listen(SocketAddr::new(B_IP, PORT), 1024).expect("listen");
        Pair {
            fabric,
            a,
            b,
            listener,
        }
    }

    pub fn now(&self) -> Instant {
        Instant(self.fabric.now())
    }

    /// Poll both sides at the current time.
    pub fn poll(&mut self) {
        let now = self.now();
        self.a.poll(now);
        self.b.poll(now);
    }

    /// Move time to the next delivery or deadline. False when nothing at all is pending.
    pub fn advance(&mut self) -> bool {
        let now = self.now();
        let next = [
            self.fabric.next_event_at().map(Instant),
            self.a.next_deadline(),
            self.b.next_deadline(),
        ]
        .into_iter()
        .flatten()
        .min();
        match next {
            Some(t) => {
                self.fabric.advance(t.0.max(now.0));
                true
            }
            None => false,
        }
    }

    /// Poll both sides, then move time to the next delivery or deadline. False when nothing at
    /// all is pending.
    pub fn step(&mut self) -> bool {
        self.poll();
        self.advance()
    }

    /// Poll, let `done` look (and act, like an application would), and move time on, until
    /// `done` says so or `limit_ns` of virtual time pass. Returns whether `done`.
    pub fn run_until(&mut self, limit_ns: u64, mut done: impl FnMut(&mut Pair) -> bool) -> bool {
        let end = self.fabric.now() + limit_ns;
        loop {
            self.poll();
            if done(self) {
                return true;
            }
            // What the application did may have work to post before time moves.
            self.poll();
            if self.fabric.now() >= end || !self.advance() {
                return done(self);
            }
        }
    }

    /// Run for `ns` of virtual time.
    pub fn run_for(&mut self, ns: u64) {
        self.run_until(ns, |_| false);
    }

    /// Read what B's `b` has (by copy, in 64 KiB pieces) until `want` bytes came or nothing
    /// more comes (EOF, or 10 s of virtual time).
    pub fn read_b(&mut self, b: ConnId, want: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        self.run_until(10_000_000_000, |p| {
            let now = p.now();
            loop {
                match p.b.read(now, b, &mut buf) {
                    Ok(0) => return true,
                    Ok(n) => out.extend_from_slice(&buf[..n]),
                    Err(crate::proto::conn::CallError::WouldBlock) => return out.len() >= want,
                    Err(e) => panic!("read: {e:?}"),
                }
            }
        });
        out
    }

    /// Connect A to B and wait until both sides are established: (A's id, B's id).
    pub fn connect(&mut self) -> (ConnId, ConnId) {
        let now = self.now();
        let a = self
            .a
            .connect(now, SocketAddr::new(B_IP, PORT), None)
            .expect("connect");
        let mut b = None;
        let l = self.listener;
        let ok = self.run_until(1_000_000_000, |p| {
            if b.is_none() {
                b = p.b.accept(l);
            }
            b.is_some()
                && p.a
                    .conn(a)
                    .is_some_and(|c| c.state() == crate::proto::State::Established)
                && p.b
                    .conn(b.unwrap())
                    .is_some_and(|c| c.state() == crate::proto::State::Established)
        });
        assert!(ok, "connection not established");
        (a, b.unwrap())
    }
}

/// `n` bytes of a pattern that differs with `seed` (test data whose order shows).
pub fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Whether an event list holds `Closed`, and with what.
pub fn closed(events: &[Event]) -> Option<Option<crate::proto::ConnError>> {
    events.iter().find_map(|e| match e {
        Event::Closed(err) => Some(err.clone()),
        _ => None,
    })
}
