//! The receive half's state: receive buffers posted, received stream contents not read yet,
//! and the slow-start target. No protocol decisions here (those are in [`super::recv`],
//! [`super::rcvd`] and [`super::read`]).

use std::collections::VecDeque;

use super::buff::{Buf, BufStore, Pool};

/// Received stream contents, in order.
#[derive(Debug)]
pub(crate) enum RxItem {
    /// Bytes in a receive buffer (`bounce`: in an RDMA Read bounce buffer instead).
    Data {
        buf: Buf,
        off: u32,
        len: u32,
        bounce: bool,
    },
    /// A peer's SrcAvail (index into [`super::advt::Advts`]): its bytes come next in the stream.
    Src { advt: usize },
}

impl RxItem {
    /// The advertisement a `Src` item stands for.
    #[inline]
    fn src(&self) -> Option<usize> {
        match self {
            RxItem::Src { advt } => Some(*advt),
            RxItem::Data { .. } => None,
        }
    }

    #[inline]
    pub(crate) fn release(self, store: &mut impl BufStore) {
        if let RxItem::Data { buf, .. } = self {
            store.free(buf);
        }
    }
}

/// The receive half of a connection.
#[derive(Debug)]
pub(crate) struct RxHalf {
    /// Receive buffers (our receive size).
    pool: Pool,
    /// Receives posted, by the index in their wr_id.
    posted: slab::Slab<Buf>,
    /// Posted receives still of an old size (after a resize), oldest first.
    old_posted: usize,
    /// Receives to keep posted (slow start).
    target: u32,
    /// Received stream contents not read yet, in order.
    queue: VecDeque<RxItem>,
    /// Receive buffers holding unread data.
    held: usize,
    /// Unread bytes in `queue`.
    bytes: usize,
    /// The peer asked us for a new receive size; we ack once every posted buffer has it.
    resize_ack_due: Option<u32>,
}

impl RxHalf {
    /// A one-line account of the receive half, for diagnostics (`Conn::debug_state`).
    pub(crate) fn summary(&self) -> String {
        let srcs = self.queue.iter().filter(|i| i.src().is_some()).count();
        format!(
            "rx {} posted (target {}, {} old), queue {} items ({srcs} srcs) {} B in {} bufs, resize ack {:?}",
            self.posted.len(),
            self.target,
            self.old_posted,
            self.queue.len(),
            self.bytes,
            self.held,
            self.resize_ack_due
        )
    }
    #[inline]
    pub(crate) fn new(size: u32, target: u32) -> RxHalf {
        RxHalf {
            pool: Pool::new(size),
            posted: slab::Slab::new(),
            old_posted: 0,
            target,
            queue: VecDeque::new(),
            held: 0,
            bytes: 0,
            resize_ack_due: None,
        }
    }
    /// Receive buffers of `size` from now on (setup: nothing is posted yet).
    #[inline]
    pub(crate) fn set_size(&mut self, size: u32) {
        self.pool = Pool::new(size);
    }
    /// The size of the receive buffers we post.
    #[inline]
    pub(crate) fn size(&self) -> u32 {
        self.pool.size()
    }
    /// Receives posted now.
    #[inline]
    pub(crate) fn posted_len(&self) -> usize {
        self.posted.len()
    }
    /// Post one more receive buffer: its index (for the wr_id) and the buffer, `None` if the
    /// store has none.
    #[inline]
    pub(crate) fn post(&mut self, store: &mut impl BufStore) -> Option<(usize, Buf)> {
        let buf = self.pool.get(store)?;
        Some((self.posted.insert(buf), buf))
    }
    /// A receive buffer is free again (back to the pool, for `fill_rx` to post).
    #[inline]
    pub(crate) fn put_buf(&mut self, store: &mut impl BufStore, buf: Buf) {
        self.pool.put(store, buf);
    }
    /// Keep at most `keep` idle receive buffers; give the rest back.
    #[inline]
    pub(crate) fn trim(&mut self, store: &mut impl BufStore, keep: usize) {
        self.pool.trim(store, keep);
    }
    /// Give the pool's idle buffers back (the connection is finished).
    #[inline]
    pub(crate) fn release_pool(&mut self, store: &mut impl BufStore) {
        self.pool.release(store);
    }
    /// The receive posted under `idx` completed: take its buffer (`None` if it is not posted).
    #[inline]
    pub(crate) fn complete(&mut self, idx: usize) -> Option<Buf> {
        let buf = self.posted.try_remove(idx)?;
        if buf.size != self.pool.size() {
            self.old_posted = self.old_posted.saturating_sub(1);
        }
        Some(buf)
    }
    /// The peer asked for receive buffers of another size and we grant `size`: post that size
    /// from now on. True if every posted buffer has it already (ack now); otherwise the ack
    /// is due once the last old one completes ([`RxHalf::resize_ack_ready`]).
    #[inline]
    pub(crate) fn resize(&mut self, store: &mut impl BufStore, size: u32) -> bool {
        self.pool.resize(store, size);
        self.old_posted = self.posted.iter().filter(|(_, b)| b.size != size).count();
        if self.old_posted == 0 {
            return true;
        }
        self.resize_ack_due = Some(size);
        false
    }
    /// The size to acknowledge now that no receive of an old size is posted, once.
    #[inline]
    pub(crate) fn resize_ack_ready(&mut self) -> Option<u32> {
        if self.old_posted == 0 {
            self.resize_ack_due.take()
        } else {
            None
        }
    }
    /// Receives to keep posted (the slow-start target).
    #[inline]
    pub(crate) fn target(&self) -> u32 {
        self.target
    }
    /// Slow start: double the target, up to `max`.
    #[inline]
    pub(crate) fn grow_target(&mut self, max: u32) {
        if self.target < max {
            self.target = (self.target * 2).min(max);
        }
    }
    /// Idle: back to `initial` receives at most, `min` at least.
    #[inline]
    pub(crate) fn shrink_target(&mut self, min: u32, initial: u32) {
        self.target = min.max(initial.min(self.target));
    }
    /// Receive buffers holding unread data.
    #[inline]
    pub(crate) fn held(&self) -> usize {
        self.held
    }
    /// A receive buffer with `len` unread bytes joins the end of the stream.
    #[inline]
    pub(crate) fn push_data(&mut self, buf: Buf, off: u32, len: u32) {
        self.held += 1;
        self.bytes += len as usize;
        self.queue.push_back(RxItem::Data {
            buf,
            off,
            len,
            bounce: false,
        });
    }
    /// Put `byte` back into the stream after its first `at` unread bytes (an urgent byte that
    /// is stream data again): the item that ends there grows by it when its buffer still holds
    /// it right after (the message it came in), else `spare` (a bounce buffer, given back as
    /// one) takes it. Returns `spare` if it was not used (nor the byte put back: `at` not at
    /// the end of an item, or no spare).
    pub(crate) fn put_back(
        &mut self,
        at: usize,
        byte: u8,
        store: &mut impl BufStore,
        spare: Option<Buf>,
    ) -> Option<Buf> {
        let mut sum = 0usize;
        let mut idx = self.queue.len();
        for (i, item) in self.queue.iter_mut().enumerate() {
            if sum == at {
                idx = i;
                break;
            }
            let RxItem::Data { buf, off, len, .. } = item else {
                return spare;
            };
            sum += *len as usize;
            if sum > at {
                return spare;
            }
            if sum == at {
                let mut b = [0u8; 1];
                if *off + *len < buf.size {
                    store.read(buf, *off + *len, &mut b);
                    if b[0] == byte {
                        *len += 1;
                        self.bytes += 1;
                        return spare;
                    }
                }
                idx = i + 1;
                break;
            }
        }
        if sum != at {
            return spare;
        }
        let buf = spare?;
        store.write(&buf, 0, &[byte]);
        self.queue.insert(
            idx,
            RxItem::Data {
                buf,
                off: 0,
                len: 1,
                bounce: true,
            },
        );
        self.bytes += 1;
        None
    }
    /// A peer's SrcAvail joins the end of the stream.
    #[inline]
    pub(crate) fn push_src(&mut self, advt: usize) {
        self.queue.push_back(RxItem::Src { advt });
    }
    /// `len` bytes of the advertisement `advt` were read into the bounce buffer `buf`: they
    /// come in the stream just before it (at the end if it is gone).
    #[inline]
    pub(crate) fn insert_bounce(&mut self, advt: usize, buf: Buf, len: u32) {
        let pos = self
            .queue
            .iter()
            .position(|i| matches!(i, RxItem::Src { advt: a } if *a == advt))
            .unwrap_or(self.queue.len());
        self.queue.insert(
            pos,
            RxItem::Data {
                buf,
                off: 0,
                len,
                bounce: true,
            },
        );
        self.bytes += len as usize;
    }
    /// The advertisement `advt` leaves the stream (if it is in it).
    #[inline]
    pub(crate) fn remove_src(&mut self, advt: usize) {
        if let Some(pos) = self
            .queue
            .iter()
            .position(|i| matches!(i, RxItem::Src { advt: a } if *a == advt))
        {
            self.queue.remove(pos);
        }
    }
    /// The next stream contents.
    #[inline]
    pub(crate) fn front(&self) -> Option<&RxItem> {
        self.queue.front()
    }
    /// The next stream contents, to read from.
    #[inline]
    pub(crate) fn front_mut(&mut self) -> Option<&mut RxItem> {
        self.queue.front_mut()
    }
    /// Take the next stream contents.
    #[inline]
    pub(crate) fn pop_front(&mut self) -> Option<RxItem> {
        self.queue.pop_front()
    }
    /// Nothing received is left unread (no bytes, no advertisement).
    #[inline]
    pub(crate) fn queue_empty(&self) -> bool {
        self.queue.is_empty()
    }
    /// The unread stream contents, in order.
    #[inline]
    pub(crate) fn items(&self) -> impl Iterator<Item = &RxItem> {
        self.queue.iter()
    }
    /// The advertisements in the stream, in order.
    #[inline]
    pub(crate) fn src_ids(&self) -> Vec<usize> {
        self.queue.iter().filter_map(RxItem::src).collect()
    }
    /// The advertisements at the head of the stream, up to the first bytes.
    #[inline]
    pub(crate) fn leading_src_ids(&self) -> Vec<usize> {
        self.queue.iter().map_while(RxItem::src).collect()
    }
    /// The stream ends before its first advertisement (it can no longer be read): drop that
    /// and everything behind it.
    #[inline]
    pub(crate) fn cut_at_first_src(&mut self, store: &mut impl BufStore) {
        if let Some(cut) = self
            .queue
            .iter()
            .position(|i| matches!(i, RxItem::Src { .. }))
        {
            for item in self.queue.split_off(cut) {
                if let RxItem::Data { len, bounce, .. } = &item {
                    self.bytes_out(*len as usize);
                    if !*bounce {
                        self.unhold();
                    }
                }
                item.release(store);
            }
        }
    }
    /// A receive buffer with unread data left the queue.
    #[inline]
    pub(crate) fn unhold(&mut self) {
        self.held -= 1;
    }
    /// Unread bytes.
    #[inline]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
    /// `n` unread bytes left the queue (read or dropped).
    #[inline]
    pub(crate) fn bytes_out(&mut self, n: usize) {
        self.bytes -= n;
    }
    /// Receives posted, as a BSDH's `bufs` announces them.
    #[inline]
    pub(crate) fn posted_count(&self) -> u16 {
        self.posted.len().min(u16::MAX as usize) as u16
    }
    /// Give every posted receive back (the connection is finished).
    #[inline]
    pub(crate) fn drop_posted(&mut self, store: &mut impl BufStore) {
        for (_, b) in std::mem::take(&mut self.posted) {
            store.free(b);
        }
    }
}
