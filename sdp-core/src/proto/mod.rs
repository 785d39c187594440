//! The SDP engine: sans-IO, no syscalls, no clock (time is passed in as [`Instant`]).
//!
//! One [`Conn`] is one SDP connection. Its inputs are application calls (`write`, `read`,
//! `shutdown`, ...), work completions ([`Conn::handle_completion`]), CM events
//! ([`Conn::handle_cm`]) and timer expiry ([`Conn::handle_timeout`]). Its outputs are work requests
//! to post ([`Conn::poll_wr`]), CM actions ([`Conn::poll_cm`]), application events
//! ([`Conn::poll_event`]) and the next deadline ([`Conn::poll_timeout`]).
//!
//! The code is split by the SDP sublayers, as in the original kernel check-in:
//!
//! | module  | sublayer |
//! |---------|----------|
//! | [`msgs`] | wire format (BSDH, extended headers, compact Hello) |
//! | [`conn`] | the connection: state machine and the engine's public surface |
//! | [`config`] / [`error`] | tunables / errors (with their errno) |
//! | [`credits`] | sequence numbers and credits (flow control) |
//! | [`timers`] / [`timeouts`] | the timer table / what each timer does: keepalive, zero-window probe, idle shrink, ... |
//! | [`buff`] | registered buffers: the pool a connection sends and receives through |
//! | [`advt`] | peer advertisements (SrcAvail / SinkAvail received) |
//! | [`iocb`] | local zero-copy blocks (our SrcAvail / SinkAvail outstanding) |
//! | `tx` / `rx` | the send half's and the receive half's state (queues, buffers, in flight) |
//! | [`send`] / [`sent`] | application data to SEND work requests / send completions |
//! | [`recv`] / [`rcvd`] | receive posting and application reads / receive completions |
//! | [`read`] / [`write`](mod@write) | RDMA Read (ZCopy read path) / RDMA Write (ZCopy write path) |
//! | [`table`] | the connection table |
//!
//! The protocol steps (`send`, `sent`, `recv`, `rcvd`, `read`, `write`, `timeouts`) are files in
//! this directory, as in the check-in, but child modules of [`conn`] (declared there with
//! `#[path]`, re-exported here under their own names): each adds an `impl Conn` block, and only
//! `conn` and they see `Conn`'s fields, which are private.
#![forbid(unsafe_code)]

pub mod advt;
pub mod buff;
pub mod config;
pub mod conn;
pub mod credits;
pub mod error;
pub mod iocb;
pub mod msgs;
pub(crate) mod rx;
pub mod table;
pub mod timers;
pub(crate) mod tx;

pub use buff::{Buf, BufStore};
pub use conn::{rcvd, read, recv, send, sent, timeouts, write};
pub use conn::{CmAction, Config, Conn, ConnError, Event, ProtocolError, Shutdown, State};

use std::time::Duration;

/// A point in time, in nanoseconds since an arbitrary origin chosen by the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(pub u64);

impl Instant {
    pub fn from_nanos(n: u64) -> Instant {
        Instant(n)
    }
    pub fn as_nanos(self) -> u64 {
        self.0
    }
    /// Time since `earlier`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl std::ops::Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        Instant(
            self.0
                .saturating_add(d.as_nanos().min(u64::MAX as u128) as u64),
        )
    }
}
