//! Local zero-copy blocks: our registered memory that the peer may reach while a transfer is
//! outstanding. A source ([`ZSrc`]) is advertised with SrcAvail and read by the peer; a sink
//! ([`ZSink`]) is advertised with SinkAvail and written by the peer. The driver grants remote
//! access to the memory before handing it to the engine and revokes it on the matching
//! [`super::Event::ZcopySent`] / [`super::Event::ZcopyReceived`].

use std::collections::VecDeque;

use super::buff::BufStore;
use super::Instant;
use crate::verbs::Sge;

/// Registered memory to send from without copying (remote read granted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ZSrc {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// Registered memory to receive into without copying (local and remote write granted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ZSink {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// How far a source is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SrcState {
    /// Queued behind earlier stream contents.
    Queued,
    /// SrcAvail sent; the peer reads it.
    Advertised,
    /// SrcAvailCancel sent; waiting for the peer's SendSm.
    Cancelling,
    /// Written into the peer's sink in full; waiting for the write completions.
    Written,
    /// Finished (`done_bytes` went), reported once every earlier source is: a source sent by
    /// SEND may finish before a committed advertisement ahead of it (split zero copy).
    Done,
}

#[derive(Debug)]
pub(crate) struct SrcIocb {
    /// The engine's name for this source or piece (the send queue and work requests use it).
    pub key: u64,
    /// The application's token ([`super::Event::ZcopySent`]).
    pub token: u64,
    /// The last piece of the application's source. Split zero copy cuts a source larger than
    /// a bounce buffer into pieces, each read or sent on its own; the application hears of the
    /// source once, when its last piece is reported. A source not cut is one last piece.
    pub last: bool,
    /// The piece's length as queued (`src.len` shrinks when a send ends short).
    pub full: u32,
    pub src: ZSrc,
    pub state: SrcState,
    /// Bytes the peer reported read (RdmaRdCompl).
    pub acked: u32,
    /// Bytes we RDMA-wrote into the peer's sinks.
    pub written: u32,
    /// RDMA Writes from this source not yet completed.
    pub writes_inflight: u32,
    pub deadline: Option<Instant>,
    /// A source the peer must keep taking (a plain blocking write, see
    /// [`super::Conn::write_zcopy_bounded`]): cancelled when the peer makes no progress on it
    /// for this long, queued or advertised. `None`: `srcavail_timeout`, once advertised.
    pub stall: Option<std::time::Duration>,
    /// Advertised in split zero copy: stream bytes may follow it at once, so it is never
    /// cancelled (no timeout; the peer reads it in full).
    pub committed: bool,
    /// Bytes that went, once `Done`.
    pub done_bytes: usize,
}

impl SrcIocb {
    fn queued(key: u64, token: u64, last: bool, src: ZSrc) -> SrcIocb {
        SrcIocb {
            key,
            token,
            last,
            full: src.len,
            src,
            state: SrcState::Queued,
            acked: 0,
            written: 0,
            writes_inflight: 0,
            deadline: None,
            stall: None,
            committed: false,
            done_bytes: 0,
        }
    }
    /// Its deadline counts: advertised, or queued with a stall bound.
    pub(crate) fn timed(&self) -> bool {
        match self.state {
            SrcState::Advertised => true,
            SrcState::Queued => self.stall.is_some(),
            _ => false,
        }
    }
    /// Advertised and not finished.
    pub(crate) fn outstanding(&self) -> bool {
        matches!(self.state, SrcState::Advertised | SrcState::Cancelling)
    }
    /// Bytes of the source the peer has not acknowledged (read or written).
    pub(crate) fn unacked(&self) -> u32 {
        self.src.len - self.acked - self.written
    }
    /// Take the next at most `max` bytes not yet sent (by RDMA Write or gathered SEND) as the
    /// local SGE of one work request, counted in flight. True if they were the last: the source
    /// is then `Written` and finishes when its work requests complete.
    pub(crate) fn take(&mut self, max: u32) -> (Sge, bool) {
        let n = (self.src.len - self.written).min(max);
        let sge = Sge {
            addr: self.src.addr + u64::from(self.written),
            len: n,
            lkey: self.src.lkey,
        };
        self.written += n;
        self.writes_inflight += 1;
        let done = self.written == self.src.len;
        if done {
            self.state = SrcState::Written;
        }
        (sge, done)
    }
}

#[derive(Debug)]
pub(crate) struct SinkIocb {
    pub token: u64,
    pub sink: ZSink,
    /// Its SinkAvail went out (it is not waiting in the send queue).
    pub posted: bool,
}

/// A connection's outstanding zero-copy blocks.
///
/// Sources are kept in stream order, and their states follow that order: first sources written
/// whole into a peer's sink and waiting for their RDMA Write completions (`Written`), then
/// sources advertised with SrcAvail (`Advertised`, or `Cancelling` once SrcAvailCancel went),
/// then sources not advertised yet (`Queued`). Several may be advertised at once (pipelined
/// zero copy, see [`super::write`] for the rules).
#[derive(Debug, Default)]
pub struct Iocbs {
    /// Sources in stream order.
    pub(crate) srcs: VecDeque<SrcIocb>,
    /// Our advertised sink, if any.
    pub(crate) sink: Option<SinkIocb>,
    /// We sent SinkAvailCancel and wait for SinkCancelAck.
    pub(crate) sink_cancel_pending: bool,
    /// Sinks in a row that the peer's Data overtook (it streams by SEND faster than we read).
    pub(crate) sinks_overtaken: u8,
    /// Sink offers still to skip after that: 2^`sinks_overtaken` - 1, so a streaming peer is
    /// not sent a SinkAvail it will drop after every other message.
    pub(crate) sink_skip: u32,
    /// Next [`SrcIocb::key`].
    pub(crate) next_key: u64,
    /// Bytes of the pieces reported so far of the source being reported.
    pub(crate) report_bytes: usize,
    /// One of those pieces ended short: later pieces add nothing (the peer got a prefix).
    pub(crate) report_short: bool,
}

impl Iocbs {
    /// Queue a source; returns its key.
    pub(crate) fn add_src(&mut self, token: u64, src: ZSrc) -> u64 {
        let key = self.next_key;
        self.next_key += 1;
        self.srcs.push_back(SrcIocb::queued(key, token, true, src));
        key
    }
    /// Cut the queued source `key` after its first `at` bytes: the rest becomes a new source
    /// right behind it (same token; it is the last piece if the source was). Returns its key.
    pub(crate) fn cut_src(&mut self, key: u64, at: u32) -> Option<u64> {
        let pos = self.srcs.iter().position(|s| s.key == key)?;
        let s = &mut self.srcs[pos];
        if s.state != SrcState::Queued || s.written != 0 || at == 0 || at >= s.src.len {
            return None;
        }
        let rest = ZSrc {
            addr: s.src.addr + u64::from(at),
            len: s.src.len - at,
            ..s.src
        };
        let (token, last, stall, deadline) = (s.token, s.last, s.stall, s.deadline);
        s.src.len = at;
        s.full = at;
        s.last = false;
        let new = self.next_key;
        self.next_key += 1;
        let mut piece = SrcIocb::queued(new, token, last, rest);
        piece.stall = stall;
        piece.deadline = deadline;
        self.srcs.insert(pos + 1, piece);
        Some(new)
    }
    /// The application's sources queued or outstanding.
    pub(crate) fn src_queued(&self) -> usize {
        self.srcs.iter().filter(|s| s.last).count()
    }
    /// A SrcAvail is out and not finished: no data or DisConn may pass it (only further
    /// SrcAvails, within the window, and replies to the peer).
    pub(crate) fn src_advertised(&self) -> bool {
        self.srcs.iter().any(SrcIocb::outstanding)
    }
    /// SrcAvails out and not finished.
    pub(crate) fn src_inflight(&self) -> usize {
        self.srcs.iter().filter(|s| s.outstanding()).count()
    }
    /// A SrcAvailCancel is out: nothing more is advertised until the peer's SendSm (or the
    /// last RdmaRdCompl) ends every advertisement.
    pub(crate) fn src_cancelling(&self) -> bool {
        self.srcs.iter().any(|s| s.state == SrcState::Cancelling)
    }
    /// A committed advertisement (split zero copy) is outstanding.
    pub(crate) fn src_committed(&self) -> bool {
        self.srcs.iter().any(|s| s.committed && s.outstanding())
    }
    /// Committed advertisements outstanding.
    pub(crate) fn src_committed_inflight(&self) -> usize {
        self.srcs
            .iter()
            .filter(|s| s.committed && s.outstanding())
            .count()
    }
    /// Sources with sends (gathered SENDs or RDMA Writes) in flight.
    pub(crate) fn src_sending(&self) -> usize {
        self.srcs.iter().filter(|s| s.writes_inflight > 0).count()
    }
    /// A source went whole into the peer's sink and waits for its RDMA Write completions.
    pub(crate) fn src_writing(&self) -> bool {
        self.srcs.iter().any(|s| s.state == SrcState::Written)
    }
    /// When the advertised sources, or queued ones with a stall bound, time out (the earliest
    /// deadline: every deadline moves on when the peer makes progress).
    pub(crate) fn src_deadline(&self) -> Option<Instant> {
        self.srcs
            .iter()
            .filter(|s| s.timed())
            .filter_map(|s| s.deadline)
            .min()
    }
    pub(crate) fn find_src(&mut self, key: u64) -> Option<&mut SrcIocb> {
        self.srcs.iter_mut().find(|s| s.key == key)
    }
    /// Account a finished piece, in stream order: the bytes of the application's source once
    /// its last piece is in, else None.
    pub(crate) fn report(&mut self, s: &SrcIocb) -> Option<usize> {
        if !self.report_short {
            self.report_bytes += s.done_bytes;
            self.report_short = s.done_bytes < s.full as usize;
        }
        if !s.last {
            return None;
        }
        let bytes = std::mem::take(&mut self.report_bytes);
        self.report_short = false;
        Some(bytes)
    }
    /// Our sink is out and no cancel is under way.
    pub(crate) fn sink_active(&self) -> bool {
        self.sink.is_some() && !self.sink_cancel_pending
    }
    /// The engine holds no memory of its own for iocbs; the driver owns it.
    pub(crate) fn release(&mut self, _store: &mut impl BufStore) {}
}
