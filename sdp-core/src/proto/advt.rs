//! Peer advertisements: a SrcAvail we received (peer memory we may RDMA-Read) and a SinkAvail
//! we received (peer memory we may RDMA-Write). Every access the engine makes stays inside the
//! advertised range, and ends with the transfer.

use super::buff::{BufStore, Pool};

/// Size of the bounce buffers a plain `read` RDMA-Reads a SrcAvail into.
pub(crate) const BOUNCE_SIZE: u32 = 128 * 1024;
/// RDMA Reads into bounce buffers in flight at once per connection.
pub(crate) const BOUNCE_WINDOW: u32 = 4;
/// Bounce buffers split zero copy's eager reads may hold per connection (1 MiB): what the
/// peer's engine reads ahead of the application, beside the receive buffers.
pub(crate) const EAGER_BOUNCE_BUFS: usize = 8;

/// A SrcAvail received.
#[derive(Debug)]
pub(crate) struct SrcAdvt {
    pub len: u32,
    pub rkey: u32,
    pub vaddr: u64,
    /// Bytes for which RDMA Reads were posted.
    pub requested: u32,
    /// Bytes read (completed).
    pub done: u32,
    pub reads_inflight: u32,
    /// The peer cancelled (SrcAvailCancel) or we refused: no further reads.
    pub cancelled: bool,
}

/// A SinkAvail received and judged current.
#[derive(Debug)]
pub(crate) struct SinkAdvt {
    pub len: u32,
    pub rkey: u32,
    pub vaddr: u64,
}

/// A connection's peer advertisements.
#[derive(Debug)]
pub struct Advts {
    pub(crate) srcs: slab::Slab<SrcAdvt>,
    pub(crate) sink: Option<SinkAdvt>,
    /// mseq of the last message we sent that put bytes in the stream: a SinkAvail that did not
    /// see it is stale.
    pub(crate) last_stream_mseq: u32,
    pub(crate) bounce_pool: Pool,
    /// A SendSm is owed to the peer once every RDMA Read in flight finished.
    pub(crate) send_sm_due: bool,
    /// A SendSm is queued and not sent yet.
    pub(crate) send_sm_queued: bool,
    /// mseq of the last SendSm we sent.
    pub(crate) send_sm_mseq: Option<u32>,
}

impl Default for Advts {
    fn default() -> Self {
        Advts {
            srcs: slab::Slab::new(),
            sink: None,
            last_stream_mseq: 0,
            bounce_pool: Pool::new(BOUNCE_SIZE),
            send_sm_due: false,
            send_sm_queued: false,
            send_sm_mseq: None,
        }
    }
}

impl Advts {
    /// Our sequence numbers moved by `ours` (see `Credits::shift`).
    #[cfg(feature = "harness")]
    pub(crate) fn shift(&mut self, ours: u32) {
        self.last_stream_mseq = self.last_stream_mseq.wrapping_add(ours);
        if let Some(m) = self.send_sm_mseq.as_mut() {
            *m = m.wrapping_add(ours);
        }
    }
    pub(crate) fn note_data_sent(&mut self, mseq: u32) {
        self.last_stream_mseq = mseq;
    }
    pub(crate) fn has_src(&self) -> bool {
        !self.srcs.is_empty()
    }
    /// Every byte of the advertisement was read (or it was cut short) and nothing is in flight.
    pub(crate) fn src_exhausted(&self, id: usize) -> bool {
        self.srcs
            .get(id)
            .is_none_or(|a| a.reads_inflight == 0 && (a.done == a.len || a.cancelled))
    }
    /// We will read no more of this advertisement than was requested (a refusal or the peer's
    /// cancel). True if that cut it short (the peer must then be told with SendSm). An
    /// advertisement with no reads in flight is dropped at once.
    pub(crate) fn cut_src(&mut self, id: usize) -> bool {
        let Some(a) = self.srcs.get_mut(id) else {
            return false;
        };
        let cut = !a.cancelled && a.requested < a.len;
        a.cancelled = true;
        a.len = a.requested;
        if a.reads_inflight == 0 {
            self.srcs.remove(id);
        }
        cut
    }
    /// RDMA Reads in flight on any advertisement.
    pub(crate) fn reads_inflight(&self) -> bool {
        self.srcs.iter().any(|(_, a)| a.reads_inflight > 0)
    }
    /// A SrcAvail whose BSDH acknowledged `mseq_ack` was sent before the peer saw our last
    /// SendSm (or one still owed or queued): the SendSm ended it on the peer's side, so it is
    /// void and must not be read.
    pub(crate) fn src_void(&self, mseq_ack: u32) -> bool {
        self.send_sm_due
            || self.send_sm_queued
            || self
                .send_sm_mseq
                .is_some_and(|m| super::credits::seq_lt(mseq_ack, m))
    }
    /// The peer's sink can take our bytes.
    pub(crate) fn sink_usable(&self) -> bool {
        self.sink.is_some()
    }
    pub(crate) fn release(&mut self, store: &mut impl BufStore) {
        self.srcs.clear();
        self.sink = None;
        self.bounce_pool.release(store);
    }
}
