//! Peer advertisements: a SrcAvail we received (peer memory we may RDMA-Read) and a SinkAvail
//! we received (peer memory we may RDMA-Write). Every access the engine makes stays inside the
//! advertised range, and ends with the transfer.

use super::buff::{Buf, BufStore, Pool};
use super::credits::seq_gt;
use crate::verbs::RemoteBuf;

/// Size of the bounce buffers a plain `read` RDMA-Reads a SrcAvail into.
pub(crate) const BOUNCE_SIZE: u32 = 128 * 1024;
/// RDMA Reads into bounce buffers in flight at once per connection.
pub(crate) const BOUNCE_WINDOW: u32 = 4;
/// Bounce buffers split zero copy's eager reads may hold per connection (1 MiB): what the
/// peer's engine reads ahead of the application, beside the receive buffers.
pub(crate) const EAGER_BOUNCE_BUFS: usize = 8;

/// A SrcAvail received (a plain record: [`Advts`] changes it, others read it).
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

impl SrcAdvt {
    /// Bytes a read into the application's sink may take now: none while reads are in flight,
    /// once it is cut short, or once every byte was requested.
    pub(crate) fn sink_readable(&self) -> Option<u32> {
        if self.reads_inflight == 0 && !self.cancelled && self.requested < self.len {
            Some(self.len - self.requested)
        } else {
            None
        }
    }
    /// Read no more than was requested. True if that cut it short.
    fn stop(&mut self) -> bool {
        let cut = !self.cancelled && self.requested < self.len;
        self.cancelled = true;
        self.len = self.requested;
        cut
    }
}

/// A SinkAvail received and judged current (a plain record).
#[derive(Debug)]
pub(crate) struct SinkAdvt {
    pub len: u32,
    pub rkey: u32,
    pub vaddr: u64,
}

/// A connection's peer advertisements.
#[derive(Debug)]
pub struct Advts {
    srcs: slab::Slab<SrcAdvt>,
    sink: Option<SinkAdvt>,
    /// mseq of the last message we sent that put bytes in the stream: a SinkAvail that did not
    /// see it is stale.
    last_stream_mseq: u32,
    bounce_pool: Pool,
    /// A SendSm is owed to the peer once every RDMA Read in flight finished.
    send_sm_due: bool,
    /// A SendSm is queued and not sent yet.
    send_sm_queued: bool,
    /// mseq of the last SendSm we sent.
    send_sm_mseq: Option<u32>,
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

    // --- SrcAvails received ---

    pub(crate) fn has_src(&self) -> bool {
        !self.srcs.is_empty()
    }
    /// Advertisements held.
    pub(crate) fn src_count(&self) -> usize {
        self.srcs.len()
    }
    /// The advertisement `id`, if still held.
    pub(crate) fn src(&self, id: usize) -> Option<&SrcAdvt> {
        self.srcs.get(id)
    }
    /// A SrcAvail arrived: hold it; returns its id.
    pub(crate) fn add_src(&mut self, len: u32, rkey: u32, vaddr: u64) -> usize {
        self.srcs.insert(SrcAdvt {
            len,
            rkey,
            vaddr,
            requested: 0,
            done: 0,
            reads_inflight: 0,
            cancelled: false,
        })
    }
    /// The stream moved past the advertisement `id`: drop it.
    pub(crate) fn remove_src(&mut self, id: usize) {
        self.srcs.try_remove(id);
    }
    /// An RDMA Read of the next `n` bytes of `id` is posted: where they are in the peer's
    /// memory. Panics if `id` is not held.
    pub(crate) fn request(&mut self, id: usize, n: u32) -> RemoteBuf {
        let a = &mut self.srcs[id];
        let remote = RemoteBuf {
            addr: a.vaddr + a.requested as u64,
            rkey: a.rkey,
        };
        a.requested += n;
        a.reads_inflight += 1;
        remote
    }
    /// An RDMA Read of `n` bytes of `id` completed. False if the advertisement is gone (the
    /// connection was torn down under the read).
    pub(crate) fn read_done(&mut self, id: usize, n: u32) -> bool {
        let Some(a) = self.srcs.get_mut(id) else {
            return false;
        };
        a.done += n;
        a.reads_inflight -= 1;
        true
    }
    /// Every byte of the advertisement was read (or it was cut short) and nothing is in flight.
    pub(crate) fn src_exhausted(&self, id: usize) -> bool {
        self.srcs
            .get(id)
            .is_none_or(|a| a.reads_inflight == 0 && (a.done == a.len || a.cancelled))
    }
    /// The peer cancelled `id` (SrcAvailCancel): read no more of it than was requested. True if
    /// that cut it short. It stays held (see [`Advts::src_exhausted`]).
    pub(crate) fn stop_src(&mut self, id: usize) -> bool {
        self.srcs.get_mut(id).is_some_and(SrcAdvt::stop)
    }
    /// We will read no more of this advertisement than was requested (a refusal or the peer's
    /// cancel). True if that cut it short (the peer must then be told with SendSm). An
    /// advertisement with no reads in flight is dropped at once.
    pub(crate) fn cut_src(&mut self, id: usize) -> bool {
        let Some(a) = self.srcs.get_mut(id) else {
            return false;
        };
        let cut = a.stop();
        if a.reads_inflight == 0 {
            self.srcs.remove(id);
        }
        cut
    }
    /// We refuse the advertisement `id`: [`Advts::cut_src`], and a SendSm is owed if that cut it
    /// short.
    pub(crate) fn refuse_src(&mut self, id: usize) {
        if self.cut_src(id) {
            self.send_sm_due = true;
        }
    }
    /// RDMA Reads in flight on any advertisement.
    pub(crate) fn reads_inflight(&self) -> bool {
        self.srcs.iter().any(|(_, a)| a.reads_inflight > 0)
    }
    /// How many RDMA Reads are in flight on all advertisements.
    pub(crate) fn reads_inflight_total(&self) -> u32 {
        self.srcs.iter().map(|(_, a)| a.reads_inflight).sum()
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

    // --- SendSm ---

    /// A SendSm is owed to the peer (sent once no RDMA Read is in flight).
    pub(crate) fn owe_send_sm(&mut self) {
        self.send_sm_due = true;
    }
    /// True, once, when the owed SendSm may be queued now (no RDMA Read in flight); it then
    /// counts as queued until [`Advts::send_sm_sent`].
    pub(crate) fn take_send_sm_due(&mut self) -> bool {
        if self.send_sm_due && !self.reads_inflight() {
            self.send_sm_due = false;
            self.send_sm_queued = true;
            return true;
        }
        false
    }
    /// The queued SendSm went out with `mseq`: SrcAvails the peer sends before it sees it are
    /// void (see [`Advts::src_void`]).
    pub(crate) fn send_sm_sent(&mut self, mseq: u32) {
        self.send_sm_queued = false;
        self.send_sm_mseq = Some(mseq);
    }

    // --- bounce buffers ---

    /// The size of a bounce buffer.
    pub(crate) fn bounce_size(&self) -> u32 {
        self.bounce_pool.size()
    }
    /// Bounce buffers taken and not given back (in flight, or holding unread bytes).
    pub(crate) fn bounce_in_use(&self) -> usize {
        self.bounce_pool.in_use()
    }
    /// A bounce buffer to read into (`None`: the store has none).
    pub(crate) fn bounce_buf(&mut self, store: &mut impl BufStore) -> Option<Buf> {
        self.bounce_pool.get(store)
    }
    /// A bounce buffer is free again.
    pub(crate) fn put_bounce(&mut self, store: &mut impl BufStore, buf: Buf) {
        self.bounce_pool.put(store, buf);
    }
    /// The connection went idle: give back every idle bounce buffer.
    pub(crate) fn trim_bounce(&mut self, store: &mut impl BufStore) {
        self.bounce_pool.trim(store, 0);
    }

    // --- the SinkAvail received ---

    /// The peer's sink can take our bytes.
    pub(crate) fn sink_usable(&self) -> bool {
        self.sink.is_some()
    }
    /// A SinkAvail that acknowledged `mseq_ack` did not see our last stream bytes: stale.
    pub(crate) fn sink_stale(&self, mseq_ack: u32) -> bool {
        seq_gt(self.last_stream_mseq, mseq_ack)
    }
    /// Hold the peer's sink (it was judged current).
    pub(crate) fn set_sink(&mut self, sink: SinkAdvt) {
        self.sink = Some(sink);
    }
    /// Take the peer's sink to fill it (give it back with [`Advts::set_sink`] if unused).
    pub(crate) fn take_sink(&mut self) -> Option<SinkAdvt> {
        self.sink.take()
    }
    /// The peer cancelled its sink.
    pub(crate) fn drop_sink(&mut self) {
        self.sink = None;
    }

    pub(crate) fn release(&mut self, store: &mut impl BufStore) {
        self.srcs.clear();
        self.sink = None;
        self.bounce_pool.release(store);
    }
}
