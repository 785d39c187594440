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
    pub(crate) pool: Pool,
    /// Receives posted, by the index in their wr_id.
    pub(crate) posted: slab::Slab<Buf>,
    /// Posted receives still of an old size (after a resize), oldest first.
    pub(crate) old_posted: usize,
    /// Receives to keep posted (slow start).
    pub(crate) target: u32,
    /// Received stream contents not read yet, in order.
    pub(crate) queue: VecDeque<RxItem>,
    /// Receive buffers holding unread data.
    pub(crate) held: usize,
    /// Unread bytes in `queue`.
    pub(crate) bytes: usize,
    /// The peer asked us for a new receive size; we ack once every posted buffer has it.
    pub(crate) resize_ack_due: Option<u32>,
}

impl RxHalf {
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
