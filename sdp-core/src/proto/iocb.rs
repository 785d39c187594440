//! Local zero-copy blocks: our registered memory that the peer may reach while a transfer is
//! outstanding. A source ([`ZSrc`]) is advertised with SrcAvail and read by the peer; a sink
//! ([`ZSink`]) is advertised with SinkAvail and written by the peer. The driver grants remote
//! access to the memory before handing it to the engine and revokes it on the matching
//! [`super::Event::ZcopySent`] / [`super::Event::ZcopyReceived`].

use std::collections::VecDeque;

use super::buff::BufStore;
use super::Instant;

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
}

#[derive(Debug)]
pub(crate) struct SrcIocb {
    pub token: u64,
    pub src: ZSrc,
    pub state: SrcState,
    /// Bytes the peer reported read (RdmaRdCompl).
    pub acked: u32,
    /// Bytes we RDMA-wrote into the peer's sinks.
    pub written: u32,
    /// RDMA Writes from this source not yet completed.
    pub writes_inflight: u32,
    pub deadline: Option<Instant>,
}

#[derive(Debug)]
pub(crate) struct SinkIocb {
    pub token: u64,
    pub sink: ZSink,
}

/// A connection's outstanding zero-copy blocks.
#[derive(Debug, Default)]
pub struct Iocbs {
    /// Sources in stream order; only the first can be advertised.
    pub(crate) srcs: VecDeque<SrcIocb>,
    /// Our advertised sink, if any.
    pub(crate) sink: Option<SinkIocb>,
    /// We sent SinkAvailCancel and wait for SinkCancelAck.
    pub(crate) sink_cancel_pending: bool,
}

impl Iocbs {
    pub(crate) fn add_src(&mut self, token: u64, src: ZSrc) {
        self.srcs.push_back(SrcIocb {
            token,
            src,
            state: SrcState::Queued,
            acked: 0,
            written: 0,
            writes_inflight: 0,
            deadline: None,
        });
    }
    /// Sources queued or outstanding.
    pub(crate) fn src_queued(&self) -> usize {
        self.srcs.len()
    }
    /// A SrcAvail is out and not finished: nothing else in the stream may pass it.
    pub(crate) fn src_advertised(&self) -> bool {
        self.srcs
            .front()
            .is_some_and(|s| matches!(s.state, SrcState::Advertised | SrcState::Cancelling))
    }
    pub(crate) fn src_deadline(&self) -> Option<Instant> {
        self.srcs.front().and_then(|s| {
            if s.state == SrcState::Advertised {
                s.deadline
            } else {
                None
            }
        })
    }
    pub(crate) fn find_src(&mut self, token: u64) -> Option<&mut SrcIocb> {
        self.srcs.iter_mut().find(|s| s.token == token)
    }
    /// Our sink is out and no cancel is under way.
    pub(crate) fn sink_active(&self) -> bool {
        self.sink.is_some() && !self.sink_cancel_pending
    }
    /// The engine holds no memory of its own for iocbs; the driver owns it.
    pub(crate) fn release(&mut self, _store: &mut impl BufStore) {}
}
