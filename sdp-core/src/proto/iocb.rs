//! Local zero-copy blocks: our registered memory that the peer may reach while a transfer is
//! outstanding. A source ([`ZSrc`]) is advertised with SrcAvail and read by the peer; a sink
//! ([`ZSink`]) is advertised with SinkAvail and written by the peer. The driver grants remote
//! access to the memory before handing it to the engine and revokes it on the matching
//! [`super::Event::ZcopySent`] / [`super::Event::ZcopyReceived`].

use std::collections::VecDeque;

use super::buff::{Buf, BufStore};
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
    /// The engine's own copy of a plain write (a staged send, `Config::staged_send_min`): when
    /// it ends short (the peer did not read it within `srcavail_timeout` and the cancel took it
    /// back), the engine sends the rest itself, as Data, in its place in the stream.
    pub staged: bool,
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
            staged: false,
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
    /// Its deadline passed by `now`.
    fn due(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| d <= now)
    }
    /// Advertised and not finished.
    pub(crate) fn outstanding(&self) -> bool {
        matches!(self.state, SrcState::Advertised | SrcState::Cancelling)
    }
    /// Bytes of the source the peer has not acknowledged (read or written).
    pub(crate) fn unacked(&self) -> u32 {
        self.src.len - self.acked - self.written
    }
    /// SrcAvail goes out for it: advertised, timing out at `deadline`. Returns the deadline it
    /// had while queued (for [`SrcIocb::unadvertise`]).
    pub(crate) fn advertise(&mut self, deadline: Instant) -> Option<Instant> {
        let queued = self.deadline;
        self.state = SrcState::Advertised;
        self.deadline = Some(deadline);
        queued
    }
    /// Its SrcAvail could not go after all: queued again, with its queued `deadline`.
    pub(crate) fn unadvertise(&mut self, deadline: Option<Instant>) {
        self.state = SrcState::Queued;
        self.deadline = deadline;
    }
    /// Advertised in split zero copy: committed, never cancelled, no timeout.
    pub(crate) fn commit(&mut self) {
        self.committed = true;
        self.deadline = None;
    }
    /// It ends at the bytes sent so far: `Written`, it finishes when their work requests
    /// complete.
    pub(crate) fn end_at_written(&mut self) {
        self.src.len = self.written;
        self.state = SrcState::Written;
    }
    /// It is `Done`, `bytes` went: returns the bytes never sent (`None` if it was done
    /// already).
    pub(crate) fn finish(&mut self, bytes: usize) -> Option<usize> {
        if self.state == SrcState::Done {
            return None;
        }
        let unsent = (self.src.len - self.written) as usize;
        self.state = SrcState::Done;
        self.done_bytes = bytes;
        Some(unsent)
    }
    /// One of its sends (RDMA Write or gathered SEND) completed. True if it was the last of a
    /// source sent in full (`Written`).
    pub(crate) fn write_completed(&mut self) -> bool {
        self.writes_inflight -= 1;
        self.state == SrcState::Written && self.writes_inflight == 0
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

/// Staged sends' buffers (`Config::staged_send_min`): registered buffers of the connection's
/// own holding a plain write's bytes until the peer has read them, by the engine's token for
/// the source, and a few let go, kept for the next staged write.
#[derive(Debug, Default)]
pub(crate) struct Staging {
    /// Token, buffer, and the address its grant advertises (pieces' addresses are within).
    held: Vec<(u64, Buf, u64)>,
    next: u64,
    spare: Vec<Buf>,
}

/// Spare staging buffers a connection keeps while busy (registering a buffer per write costs
/// more than the copy it saves): as many as staged sends may be queued (`max_adverts`, 8 by
/// default); an idle connection gives them back ([`Staging::take_spares`]).
const STAGING_SPARE: usize = 8;

impl Staging {
    /// Tokens of staged sources have this bit set (the application's never do: the socket
    /// layer counts its tokens up from 1).
    const TOKEN: u64 = 1 << 63;

    /// Whether `token` is a staged source's.
    pub(crate) fn is_staged(token: u64) -> bool {
        token & Self::TOKEN != 0
    }
    /// A spare buffer of at least `len` bytes (the smallest that fits), if one is kept.
    pub(crate) fn take_spare(&mut self, len: u32) -> Option<Buf> {
        let i = (0..self.spare.len())
            .filter(|&i| self.spare[i].size >= len)
            .min_by_key(|&i| self.spare[i].size)?;
        Some(self.spare.swap_remove(i))
    }
    /// `buf` holds a new staged source, advertised at `addr`: its token.
    pub(crate) fn hold(&mut self, buf: Buf, addr: u64) -> u64 {
        self.next += 1;
        let token = Self::TOKEN | self.next;
        self.held.push((token, buf, addr));
        token
    }
    /// The buffer of staged source `token`, and the offset in it of advertised address `at`.
    pub(crate) fn find(&self, token: u64, at: u64) -> Option<(Buf, u32)> {
        let &(_, buf, addr) = self.held.iter().find(|h| h.0 == token)?;
        let off = at.checked_sub(addr)?;
        Some((buf, u32::try_from(off).ok()?))
    }
    /// The staged source `token` ended: its buffer.
    pub(crate) fn release(&mut self, token: u64) -> Option<Buf> {
        let i = self.held.iter().position(|h| h.0 == token)?;
        Some(self.held.swap_remove(i).1)
    }
    /// Keep `buf` (its grant revoked) for a later staged write; the buffer to free if none
    /// is kept instead (the smallest goes when the spares are full).
    pub(crate) fn keep_spare(&mut self, buf: Buf) -> Option<Buf> {
        self.spare.push(buf);
        if self.spare.len() <= STAGING_SPARE {
            return None;
        }
        let i = (0..self.spare.len()).min_by_key(|&i| self.spare[i].size)?;
        Some(self.spare.swap_remove(i))
    }
    /// The spare buffers (the connection went idle).
    pub(crate) fn take_spares(&mut self) -> Vec<Buf> {
        std::mem::take(&mut self.spare)
    }
    /// Every buffer, held or spare (the connection is over).
    pub(crate) fn drain(&mut self) -> Vec<Buf> {
        let mut all: Vec<Buf> = self.held.drain(..).map(|(_, b, _)| b).collect();
        all.append(&mut self.spare);
        all
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
    srcs: VecDeque<SrcIocb>,
    /// Our advertised sink, if any.
    sink: Option<SinkIocb>,
    /// We sent SinkAvailCancel and wait for SinkCancelAck.
    sink_cancel_pending: bool,
    /// Sinks in a row that the peer's Data overtook (it streams by SEND faster than we read).
    sinks_overtaken: u8,
    /// Sink offers still to skip after that: 2^`sinks_overtaken` - 1, so a streaming peer is
    /// not sent a SinkAvail it will drop after every other message.
    sink_skip: u32,
    /// Next [`SrcIocb::key`].
    next_key: u64,
    /// Bytes of the pieces reported so far of the source being reported.
    report_bytes: usize,
    /// One of those pieces ended short: later pieces add nothing (the peer got a prefix).
    report_short: bool,
}

/// What [`Iocbs::end_srcs_from`] ended: the caller takes the sources out of the send queue and
/// the send budget.
#[derive(Debug)]
pub(crate) struct EndedSrcs {
    /// Keys of the source it started at and of every later one.
    pub keys: Vec<u64>,
    /// Bytes of them that were never sent.
    pub unsent: usize,
    /// Sources that ended at once (the others end when their sends complete).
    pub cancelled: u64,
}

impl Iocbs {
    /// A new key for a source or piece.
    fn next_key(&mut self) -> u64 {
        let key = self.next_key;
        self.next_key += 1;
        key
    }

    // --- sources ---

    /// Queue a source; returns its key. With a stall bound it must keep moving (see
    /// [`SrcIocb::stall`]); its first deadline is `deadline`.
    pub(crate) fn add_src(
        &mut self,
        token: u64,
        src: ZSrc,
        stall: Option<std::time::Duration>,
        deadline: Option<Instant>,
    ) -> u64 {
        let key = self.next_key();
        let mut s = SrcIocb::queued(key, token, true, src);
        s.stall = stall;
        s.deadline = deadline;
        self.srcs.push_back(s);
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
        let staged = s.staged;
        s.src.len = at;
        s.full = at;
        s.last = false;
        let new = self.next_key();
        let mut piece = SrcIocb::queued(new, token, last, rest);
        piece.stall = stall;
        piece.deadline = deadline;
        piece.staged = staged;
        self.srcs.insert(pos + 1, piece);
        Some(new)
    }
    /// A source is queued or outstanding.
    pub(crate) fn has_src(&self) -> bool {
        !self.srcs.is_empty()
    }
    /// Queue a staged send (`token` is the engine's).
    pub(crate) fn add_staged_src(&mut self, token: u64, src: ZSrc) -> u64 {
        let key = self.next_key();
        let mut s = SrcIocb::queued(key, token, true, src);
        s.staged = true;
        self.srcs.push_back(s);
        key
    }
    /// An application's source is queued or outstanding (plain bytes may not pass it: it may
    /// still end short).
    pub(crate) fn has_app_src(&self) -> bool {
        self.srcs.iter().any(|s| !s.staged)
    }
    /// A staged send is queued or outstanding.
    pub(crate) fn has_staged_src(&self) -> bool {
        self.srcs.iter().any(|s| s.staged)
    }
    /// Staged sources (or pieces) among `keys` that ended short: key, token, and the unsent
    /// part as offset from the source's start and length.
    pub(crate) fn staged_rests(&self, keys: &[u64]) -> Vec<(u64, u64, u64, u32)> {
        keys.iter()
            .filter_map(|k| self.srcs.iter().find(|s| s.key == *k))
            .filter(|s| s.staged && s.state == SrcState::Done && s.done_bytes < s.src.len as usize)
            .map(|s| {
                let from = s.done_bytes as u32;
                (
                    s.key,
                    s.token,
                    s.src.addr + u64::from(from),
                    s.src.len - from,
                )
            })
            .collect()
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
    /// The oldest SrcAvail out and not finished.
    pub(crate) fn first_outstanding(&self) -> Option<&SrcIocb> {
        self.srcs.iter().find(|s| s.outstanding())
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
    /// The first piece of the application's source `token` that can still end short (a
    /// source not cut is one piece): queued, or advertised and not committed.
    pub(crate) fn src_to_cancel(&mut self, token: u64) -> Option<&mut SrcIocb> {
        self.srcs.iter_mut().find(|s| {
            s.token == token
                && match s.state {
                    SrcState::Queued => true,
                    SrcState::Advertised => !s.committed,
                    _ => false,
                }
        })
    }
    /// The key of the source right behind `key`.
    pub(crate) fn key_after(&self, key: u64) -> Option<u64> {
        self.srcs
            .iter()
            .skip_while(|s| s.key != key)
            .nth(1)
            .map(|s| s.key)
    }
    /// SrcAvailCancel goes out: every advertised source is `Cancelling` (no timeout). False if
    /// none was advertised.
    pub(crate) fn start_cancel(&mut self) -> bool {
        let mut any = false;
        for s in self.srcs.iter_mut() {
            if s.state == SrcState::Advertised {
                s.state = SrcState::Cancelling;
                s.deadline = None;
                any = true;
            }
        }
        any
    }
    /// Bytes of the outstanding advertisements the peer has not acknowledged.
    pub(crate) fn advertised_unacked(&self) -> u64 {
        self.srcs
            .iter()
            .filter(|s| s.outstanding())
            .map(|s| s.unacked() as u64)
            .sum()
    }
    /// The peer read `len` more bytes (RdmaRdCompl), attributed in stream order: the key and
    /// length of every source that finished. Those still outstanding start their timeout over
    /// (`default_timeout` if they have no stall bound).
    pub(crate) fn ack_read(
        &mut self,
        now: Instant,
        len: u32,
        default_timeout: std::time::Duration,
    ) -> Vec<(u64, usize)> {
        let mut left = len;
        let mut finished = Vec::new();
        for s in self.srcs.iter_mut().filter(|s| s.outstanding()) {
            let n = left.min(s.unacked());
            s.acked += n;
            left -= n;
            if s.unacked() == 0 {
                finished.push((s.key, s.src.len as usize));
            } else if s.state == SrcState::Advertised && !s.committed {
                // Progress: the timeout starts over for what is still outstanding (a committed
                // advertisement has none: it is never cancelled).
                s.deadline = Some(now + s.stall.unwrap_or(default_timeout));
            }
        }
        finished
    }
    /// The stream moved: queued sources with a stall bound start it over.
    pub(crate) fn restart_stalls(&mut self, now: Instant) {
        for s in self.srcs.iter_mut() {
            if s.state == SrcState::Queued {
                if let Some(stall) = s.stall {
                    s.deadline = Some(now + stall);
                }
            }
        }
    }
    /// Tokens of the queued sources whose stall bound ran out by `now` (once per application
    /// source: its pieces are next to each other).
    pub(crate) fn stalled_queued(&self, now: Instant) -> Vec<u64> {
        let mut tokens: Vec<u64> = self
            .srcs
            .iter()
            .filter(|s| s.state == SrcState::Queued && s.timed() && s.due(now))
            .map(|s| s.token)
            .collect();
        tokens.dedup();
        tokens
    }
    /// An advertised source's timeout ran out by `now`.
    pub(crate) fn advertised_due(&self, now: Instant) -> bool {
        self.srcs
            .iter()
            .any(|s| s.state == SrcState::Advertised && s.due(now))
    }
    /// Timed sources whose deadline passed and that could not be ended have no timeout left.
    pub(crate) fn clear_passed_deadlines(&mut self, now: Instant) {
        for s in self.srcs.iter_mut() {
            if s.timed() && s.due(now) {
                s.deadline = None;
            }
        }
    }
    /// The source `key` (from its start) and every later one end: it with `bytes`, the later
    /// ones with what reached the peer; those with sends in flight end once these complete.
    /// `None` if `key` is gone.
    pub(crate) fn end_srcs_from(&mut self, key: u64, bytes: usize) -> Option<EndedSrcs> {
        let pos = self.srcs.iter().position(|s| s.key == key)?;
        let keys: Vec<u64> = self.srcs.iter().skip(pos).map(|s| s.key).collect();
        let mut unsent = 0;
        let mut cancelled = 0;
        for (i, s) in self.srcs.iter_mut().skip(pos).enumerate() {
            if s.state == SrcState::Done {
                // Finished already (by SEND), waiting to be reported in order.
                continue;
            }
            unsent += (s.src.len - s.written) as usize;
            if i > 0 && s.writes_inflight > 0 {
                // Its memory is in use until its sends complete: it ends at the bytes that
                // went, then.
                s.end_at_written();
                continue;
            }
            cancelled += 1;
            s.done_bytes = if i == 0 { bytes } else { s.written as usize };
            s.state = SrcState::Done;
        }
        Some(EndedSrcs {
            keys,
            unsent,
            cancelled,
        })
    }
    /// Zero-copy work can never finish now: every source is done with what reached the peer.
    pub(crate) fn fail_srcs(&mut self) {
        for s in self.srcs.iter_mut() {
            if s.state != SrcState::Done {
                s.done_bytes = (s.acked + s.written) as usize;
                s.state = SrcState::Done;
            }
        }
    }
    /// Take the finished sources at the front, in stream order: the token and bytes of every
    /// application source whose last piece is in.
    pub(crate) fn take_done(&mut self) -> Vec<(u64, usize)> {
        let mut reports = Vec::new();
        while self.srcs.front().is_some_and(|s| s.state == SrcState::Done) {
            let s = self.srcs.pop_front().expect("front checked");
            if let Some(bytes) = self.report(&s) {
                reports.push((s.token, bytes));
            }
        }
        reports
    }
    /// Account a finished piece, in stream order: the bytes of the application's source once
    /// its last piece is in, else None.
    fn report(&mut self, s: &SrcIocb) -> Option<usize> {
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

    // --- our sink ---

    /// Our sink is out and no cancel is under way.
    pub(crate) fn sink_active(&self) -> bool {
        self.sink.is_some() && !self.sink_cancel_pending
    }
    /// Our sink is out, or its cancel is (no new one may be offered).
    pub(crate) fn sink_busy(&self) -> bool {
        self.sink.is_some() || self.sink_cancel_pending
    }
    /// The length of our sink out, if one is.
    pub(crate) fn sink_len(&self) -> Option<u32> {
        self.sink.as_ref().map(|s| s.sink.len)
    }
    /// Our sink's SinkAvail went out.
    pub(crate) fn sink_posted(&self) -> bool {
        self.sink.as_ref().is_some_and(|s| s.posted)
    }
    /// True (once per offer skipped) while the offers to skip after overtaken sinks last.
    pub(crate) fn skip_sink_offer(&mut self) -> bool {
        if self.sink_skip > 0 {
            self.sink_skip -= 1;
            return true;
        }
        false
    }
    /// Offer `sink` (its SinkAvail is queued).
    pub(crate) fn offer_sink(&mut self, token: u64, sink: ZSink) {
        self.sink = Some(SinkIocb {
            token,
            sink,
            posted: false,
        });
    }
    /// The queued SinkAvail went out.
    pub(crate) fn sink_sent(&mut self) {
        if let Some(s) = self.sink.as_mut() {
            s.posted = true;
        }
    }
    /// The peer's Data overtook another sink: skip the next 2^n - 1 offers (n, the sinks
    /// overtaken in a row, at most `max`).
    pub(crate) fn sink_overtaken(&mut self, max: u8) {
        self.sinks_overtaken = (self.sinks_overtaken + 1).min(max);
        self.sink_skip = (1 << self.sinks_overtaken) - 1;
    }
    /// The peer wrote bytes into a sink: offers are no longer skipped after the next overtaken
    /// one.
    pub(crate) fn sink_filled(&mut self) {
        self.sinks_overtaken = 0;
    }
    /// Our sink is done (filled, cancelled or given up).
    pub(crate) fn take_sink(&mut self) -> Option<SinkIocb> {
        self.sink.take()
    }
    /// SinkAvailCancel goes out.
    pub(crate) fn start_sink_cancel(&mut self) {
        self.sink_cancel_pending = true;
    }
    /// A SinkAvailCancel of ours waits for its SinkCancelAck.
    pub(crate) fn sink_cancel_pending(&self) -> bool {
        self.sink_cancel_pending
    }
    /// No SinkAvailCancel is (or will be) waited for.
    pub(crate) fn end_sink_cancel(&mut self) {
        self.sink_cancel_pending = false;
    }

    /// The engine holds no memory of its own for iocbs; the driver owns it.
    pub(crate) fn release(&mut self, _store: &mut impl BufStore) {}
}
