//! The send half's state: what is queued for sending, what is in flight on the send queue,
//! and the buffers it sends from. No protocol decisions here (those are in [`super::send`],
//! [`super::sent`] and [`super::write`], which move items through it).

use std::collections::VecDeque;

use super::buff::{Buf, BufStore, Pool};
use super::msgs::{BsdhFlags, Ext, Mid, BSDH_LEN};

/// Something queued for sending, in stream order.
#[derive(Debug)]
pub(crate) enum TxItem {
    /// Application bytes in a send buffer, payload at [`BSDH_LEN`].
    Data {
        buf: Buf,
        len: u32,
        flags: BsdhFlags,
    },
    /// A control message without payload.
    Ctrl { mid: Mid, ext: Ext },
    /// A zero-copy source or piece (by key in [`super::iocb::Iocbs`]) to advertise with
    /// SrcAvail or send by gathered SENDs.
    Src { key: u64 },
}

impl TxItem {
    #[inline]
    pub(crate) fn release(self, store: &mut impl BufStore) {
        if let TxItem::Data { buf, .. } = self {
            store.free(buf);
        }
    }
}

/// An RDMA Read in flight.
#[derive(Debug)]
pub(crate) struct ReadReq {
    pub advt: usize,
    pub len: u32,
    /// Bounce buffer the bytes land in (plain reads).
    pub bounce: Option<Buf>,
    /// The application's sink token (zero-copy reads).
    pub sink_token: Option<u64>,
}

/// A send-queue work request in flight (SEND, RDMA Write, RDMA Read or keepalive).
#[derive(Debug)]
pub(crate) enum Inflight {
    /// A SEND from a send buffer (`ctrl`: from the control pool); `data` payload bytes.
    Msg { buf: Buf, ctrl: bool, data: u32 },
    /// RDMA Write of queued bytes from a send buffer into the peer's sink.
    WriteData { buf: Buf, data: u32 },
    /// RDMA Write of part of a zero-copy source into the peer's sink.
    WriteSrc { key: u64, len: u32 },
    /// A Data message: header from a control buffer, `len` payload bytes gathered from a
    /// zero-copy source.
    SendSrc { hdr: Buf, key: u64, len: u32 },
    /// A Data message: header from a control buffer, `len` payload bytes the provider took
    /// from the writer's memory as it was posted (`Conn::write_inline`).
    Inline { hdr: Buf, len: u32 },
    /// RDMA Read of a peer's source: into a bounce buffer, or into the application's sink.
    Read(ReadReq),
    /// Zero-byte RDMA Write keepalive probe.
    Keepalive,
}

impl Inflight {
    #[inline]
    pub(crate) fn release(self, store: &mut impl BufStore) {
        match self {
            Inflight::Msg { buf, .. }
            | Inflight::WriteData { buf, .. }
            | Inflight::SendSrc { hdr: buf, .. }
            | Inflight::Inline { hdr: buf, .. } => store.free(buf),
            Inflight::Read(r) => {
                if let Some(b) = r.bounce {
                    store.free(b);
                }
            }
            Inflight::WriteSrc { .. } | Inflight::Keepalive => {}
        }
    }
}

/// The send half of a connection.
#[derive(Debug)]
pub(crate) struct TxHalf {
    /// Send buffers for Data messages (the peer's receive size).
    pool: Pool,
    /// Buffers for control messages and gathered SENDs' headers.
    ctrl_pool: Pool,
    /// Stream items and control messages waiting to go, in order.
    queue: VecDeque<TxItem>,
    /// Send-queue work requests posted and not completed, by the index in their wr_id.
    inflight: slab::Slab<Inflight>,
    /// Data bytes accepted from the application and not yet acknowledged by a completion.
    bytes: usize,
    /// Data sends posted and not yet completed (for coalescing).
    data_outstanding: usize,
    /// Stream items posted so far (Data messages with bytes, gathered SENDs, SrcAvails, RDMA
    /// Writes into a sink): while it moves, the peer is taking the stream.
    stream_posts: u64,
    /// A ChRcvBuf we sent is waiting for its ack.
    resize_pending: Option<u32>,
}

impl TxHalf {
    /// A one-line account of the send half, for diagnostics (`Conn::debug_state`).
    pub(crate) fn summary(&self) -> String {
        let (mut data, mut ctrl, mut src) = (0, 0, 0);
        for i in &self.queue {
            match i {
                TxItem::Data { .. } => data += 1,
                TxItem::Ctrl { .. } => ctrl += 1,
                TxItem::Src { .. } => src += 1,
            }
        }
        let first = self.queue.front().map(|i| match i {
            TxItem::Data { len, .. } => format!("data {len}"),
            TxItem::Ctrl { mid, .. } => format!("{mid:?}"),
            TxItem::Src { key } => format!("src {key}"),
        });
        let inflight: Vec<String> = self
            .inflight
            .iter()
            .take(8)
            .map(|(_, f)| match f {
                Inflight::Msg { ctrl, data, .. } => format!("msg(ctrl {ctrl}, {data} B)"),
                Inflight::WriteData { data, .. } => format!("write({data} B)"),
                Inflight::WriteSrc { key, len } => format!("writesrc({key}, {len} B)"),
                Inflight::SendSrc { key, len, .. } => format!("sendsrc({key}, {len} B)"),
                Inflight::Inline { len, .. } => format!("inline({len} B)"),
                Inflight::Read(r) => format!("read(advt {}, {} B)", r.advt, r.len),
                Inflight::Keepalive => "keepalive".into(),
            })
            .collect();
        format!(
            "tx queue {data} data/{ctrl} ctrl/{src} src (first {first:?}), {} in flight {inflight:?}, \
             {} B unacked, {} data outstanding, {} stream posts, resize {:?}",
            self.inflight.len(),
            self.bytes,
            self.data_outstanding,
            self.stream_posts,
            self.resize_pending
        )
    }
    #[inline]
    pub(crate) fn new(size: u32, ctrl_size: u32) -> TxHalf {
        TxHalf {
            pool: Pool::new(size),
            ctrl_pool: Pool::new(ctrl_size),
            queue: VecDeque::new(),
            inflight: slab::Slab::new(),
            bytes: 0,
            data_outstanding: 0,
            stream_posts: 0,
            resize_pending: None,
        }
    }
    /// The peer's receive size, learned at setup: data buffers of `size` from now on.
    #[inline]
    pub(crate) fn set_size(&mut self, size: u32) {
        self.pool = Pool::new(size);
    }
    /// The peer acknowledged our ChRcvBuf: data buffers of `size` from now on.
    #[inline]
    pub(crate) fn resize(&mut self, store: &mut impl BufStore, size: u32) {
        self.pool.resize(store, size);
    }
    /// A send buffer for a Data message (`None`: the store has none).
    #[inline]
    pub(crate) fn data_buf(&mut self, store: &mut impl BufStore) -> Option<Buf> {
        self.pool.get(store)
    }
    /// A Data message's send buffer is free again.
    #[inline]
    pub(crate) fn put_data_buf(&mut self, store: &mut impl BufStore, buf: Buf) {
        self.pool.put(store, buf);
    }
    /// A buffer for a control message or a gathered SEND's header (`None`: the store has
    /// none).
    #[inline]
    pub(crate) fn ctrl_buf(&mut self, store: &mut impl BufStore) -> Option<Buf> {
        self.ctrl_pool.get(store)
    }
    /// A control buffer is free again.
    #[inline]
    pub(crate) fn put_ctrl_buf(&mut self, store: &mut impl BufStore, buf: Buf) {
        self.ctrl_pool.put(store, buf);
    }
    /// The connection went idle: give back the idle send buffers (one control buffer kept).
    #[inline]
    pub(crate) fn trim_idle(&mut self, store: &mut impl BufStore) {
        self.pool.trim(store, 0);
        self.ctrl_pool.trim(store, 1);
    }
    /// Data bytes accepted from the application and not yet acknowledged.
    #[inline]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
    /// `n` more bytes accepted from the application.
    #[inline]
    pub(crate) fn bytes_in(&mut self, n: usize) {
        self.bytes += n;
    }
    /// `n` bytes acknowledged by a completion, or given up.
    #[inline]
    pub(crate) fn bytes_out(&mut self, n: usize) {
        self.bytes -= n;
    }
    /// Data sends posted and not yet completed.
    #[inline]
    pub(crate) fn data_outstanding(&self) -> usize {
        self.data_outstanding
    }
    /// A data send (a Data message with bytes, or a gathered SEND) was posted: one more
    /// outstanding, and the stream moved.
    #[inline]
    pub(crate) fn data_posted(&mut self) {
        self.data_outstanding += 1;
        self.stream_posts += 1;
    }
    /// A data send completed.
    #[inline]
    pub(crate) fn data_completed(&mut self) {
        self.data_outstanding -= 1;
    }
    /// Stream items posted so far (compare two readings to see whether the stream moved).
    #[inline]
    pub(crate) fn stream_posts(&self) -> u64 {
        self.stream_posts
    }
    /// Another stream item (not a data send: a SrcAvail, an RDMA Write into a sink) was posted.
    #[inline]
    pub(crate) fn stream_posted(&mut self) {
        self.stream_posts += 1;
    }
    /// A ChRcvBuf of ours waits for its ack.
    #[inline]
    pub(crate) fn resize_pending(&self) -> bool {
        self.resize_pending.is_some()
    }
    /// We asked the peer for receive buffers of `size` (ChRcvBuf).
    #[inline]
    pub(crate) fn ask_resize(&mut self, size: u32) {
        self.resize_pending = Some(size);
    }
    /// The size our outstanding ChRcvBuf asked for, which its ack ends (`None`: none is).
    #[inline]
    pub(crate) fn take_resize(&mut self) -> Option<u32> {
        self.resize_pending.take()
    }
    /// Bytes the application may still queue within `sndbuf`.
    #[inline]
    pub(crate) fn room(&self, sndbuf: usize) -> usize {
        sndbuf.saturating_sub(self.bytes)
    }
    /// Nothing queued and nothing in flight.
    #[inline]
    pub(crate) fn is_idle(&self) -> bool {
        self.inflight.is_empty() && self.queue.is_empty()
    }
    // --- the queue ---

    /// Queue an item at the end of the stream.
    #[inline]
    pub(crate) fn push(&mut self, item: TxItem) {
        self.queue.push_back(item);
    }
    /// Put an item taken from the front back (it could not go yet), or queue the rest of one
    /// in its place.
    #[inline]
    pub(crate) fn push_front(&mut self, item: TxItem) {
        self.queue.push_front(item);
    }
    /// Queue an item right behind the front one.
    #[inline]
    pub(crate) fn insert_second(&mut self, item: TxItem) {
        self.queue.insert(1, item);
    }
    /// The item next to go.
    #[inline]
    pub(crate) fn front(&self) -> Option<&TxItem> {
        self.queue.front()
    }
    /// Take the item next to go.
    #[inline]
    pub(crate) fn pop_front(&mut self) -> Option<TxItem> {
        self.queue.pop_front()
    }
    /// Items queued.
    #[inline]
    pub(crate) fn queue_len(&self) -> usize {
        self.queue.len()
    }
    /// Something is queued.
    #[inline]
    pub(crate) fn has_queued(&self) -> bool {
        !self.queue.is_empty()
    }
    /// Append the first of `bytes` to the last queued item if it is a data buffer of `size`
    /// with room that carries no urgent byte; returns how many went.
    #[inline]
    pub(crate) fn append(&mut self, store: &mut impl BufStore, size: u32, bytes: &[u8]) -> usize {
        let cap = size - BSDH_LEN as u32;
        match self.queue.back_mut() {
            Some(TxItem::Data { buf, len, flags })
                if *len < cap && flags.is_empty() && buf.size == size =>
            {
                let n = ((cap - *len) as usize).min(bytes.len());
                store.write(buf, BSDH_LEN as u32 + *len, &bytes[..n]);
                *len += n as u32;
                n
            }
            _ => 0,
        }
    }
    /// Drop the queued control messages `mid` (not sent after all).
    #[inline]
    pub(crate) fn unqueue_ctrl(&mut self, mid: Mid) {
        self.queue
            .retain(|i| !matches!(i, TxItem::Ctrl { mid: m, .. } if *m == mid));
    }
    /// Data buffers waiting in the queue.
    #[inline]
    pub(crate) fn queued_data_bufs(&self) -> usize {
        self.queue
            .iter()
            .filter(|i| matches!(i, TxItem::Data { .. }))
            .count()
    }
    /// Where the queued source `key` is in the queue.
    pub(crate) fn position_of_src(&self, key: u64) -> Option<usize> {
        self.queue
            .iter()
            .position(|i| matches!(i, TxItem::Src { key: k } if *k == key))
    }
    /// Queue an item at `i` (0: the front).
    pub(crate) fn insert_at(&mut self, i: usize, item: TxItem) {
        self.queue.insert(i.min(self.queue.len()), item);
    }
    /// Take a source's item out of the queue (if still there).
    #[inline]
    pub(crate) fn unqueue_src(&mut self, key: u64) {
        if let Some(pos) = self.position_of_src(key) {
            self.queue.remove(pos);
        }
    }
    /// Queue a control message ahead of data (replies that must not wait behind a stalled
    /// stream, like SinkCancelAck or RdmaRdCompl), behind control messages already at the
    /// front (in order).
    #[inline]
    pub(crate) fn queue_ctrl_front(&mut self, mid: Mid, ext: Ext) {
        let pos = self
            .queue
            .iter()
            .position(|i| !matches!(i, TxItem::Ctrl { mid, .. } if *mid != Mid::DisConn))
            .unwrap_or(self.queue.len());
        self.queue.insert(pos, TxItem::Ctrl { mid, ext });
    }
    // --- in flight ---

    /// A work request was posted: it is in flight under the returned index (its wr_id's).
    #[inline]
    pub(crate) fn post(&mut self, inf: Inflight) -> usize {
        self.inflight.insert(inf)
    }
    /// The work request posted under `idx` completed: take it (`None` if it is not in
    /// flight).
    #[inline]
    pub(crate) fn complete(&mut self, idx: usize) -> Option<Inflight> {
        self.inflight.try_remove(idx)
    }
    /// Work requests in flight.
    #[inline]
    pub(crate) fn inflight_len(&self) -> usize {
        self.inflight.len()
    }
    /// No work request is in flight.
    #[inline]
    pub(crate) fn nothing_inflight(&self) -> bool {
        self.inflight.is_empty()
    }
    /// Every work request in flight is dead (the connection is finished): take them all.
    #[inline]
    pub(crate) fn drain_inflight(&mut self) -> impl Iterator<Item = Inflight> {
        std::mem::take(&mut self.inflight)
            .into_iter()
            .map(|(_, inf)| inf)
    }
    /// Everything queued is dropped (the connection is finished): `bytes` is zero again.
    #[inline]
    pub(crate) fn drop_queue(&mut self, store: &mut impl BufStore) {
        for item in std::mem::take(&mut self.queue) {
            item.release(store);
        }
        self.bytes = 0;
    }
    /// Give the idle buffers of both pools back.
    #[inline]
    pub(crate) fn release_pools(&mut self, store: &mut impl BufStore) {
        self.pool.release(store);
        self.ctrl_pool.release(store);
    }
}
