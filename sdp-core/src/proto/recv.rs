//! Receive path, application side: posting receive buffers (with slow start), and reads that
//! copy out of received buffers or start the RDMA Reads of a peer's SrcAvail.

use super::{wrid, CallError, Conn, ConnError, State};
use crate::proto::buff::{Buf, BufStore};
use crate::proto::rx::RxItem;
use crate::proto::Instant;
use crate::verbs::{RecvWr, WorkRequest};

impl<S: BufStore> Conn<S> {
    /// The error a read reports: none after the peer's orderly close (a reset then, as TCP's
    /// in CLOSE_WAIT, leaves reads at EOF).
    fn read_error(&self) -> Option<&ConnError> {
        self.error
            .as_ref()
            .filter(|e| !matches!(e, ConnError::ResetAfterClose))
    }

    /// Body of [`Conn::read`].
    pub(super) fn read_copy(&mut self, now: Instant, dst: &mut [u8]) -> Result<usize, CallError> {
        if matches!(self.state, State::Connecting | State::Accepting) {
            return Err(CallError::WouldBlock);
        }
        if let Some(e) = self.read_error() {
            if !matches!(self.rx.front(), Some(RxItem::Data { .. })) {
                return Err(CallError::Conn(e.clone()));
            }
        }
        if dst.is_empty() {
            return Ok(0);
        }
        // A read stops at the urgent mark, as TCP's (one from the mark goes past it).
        let lim = self.to_mark(dst.len());
        let dst = &mut dst[..lim];
        let mut copied = 0;
        while copied < dst.len() {
            let Some(item) = self.rx.front_mut() else {
                break;
            };
            match item {
                RxItem::Data { buf, off, len, .. } => {
                    let n = (*len as usize).min(dst.len() - copied);
                    self.store.read(buf, *off, &mut dst[copied..copied + n]);
                    *off += n as u32;
                    *len -= n as u32;
                    copied += n;
                    let emptied = *len == 0;
                    self.rx.bytes_out(n);
                    if emptied {
                        let Some(RxItem::Data { buf, bounce, .. }) = self.rx.pop_front() else {
                            unreachable!()
                        };
                        self.give_back_rx(buf, bounce);
                    }
                }
                RxItem::Src { advt } => {
                    let advt = *advt;
                    if self.error.is_some() {
                        // Nothing more can be read from the peer.
                        break;
                    }
                    if self.advts.src_exhausted(advt) {
                        self.rx.pop_front();
                        self.src_consumed(advt);
                        continue;
                    }
                    // Bring the next part in by RDMA Read into bounce buffers.
                    self.start_bounce_reads();
                    break;
                }
            }
        }
        if copied > 0 {
            self.past_bytes(copied);
            self.touch(now);
            self.flush(now);
            return Ok(copied);
        }
        if self.read_closed() {
            return Ok(0);
        }
        self.flush(now);
        Err(CallError::WouldBlock)
    }

    /// How much of a read of `len` bytes may be taken: up to the urgent mark, if one is ahead.
    fn to_mark(&self, len: usize) -> usize {
        match self.urg_mark {
            Some(m) if m > 0 => usize::try_from(m).map_or(len, |m| m.min(len)),
            _ => len,
        }
    }

    /// `n` stream bytes were read: the urgent mark comes nearer, or is passed (a read from
    /// the mark), which ends it and the urgent byte not read by then (as TCP's).
    fn past_bytes(&mut self, n: usize) {
        match self.urg_mark {
            Some(0) => {
                self.urg_mark = None;
                self.urgent = None;
                self.urg_byte = None;
            }
            Some(m) => self.urg_mark = Some(m.saturating_sub(n as u64)),
            None => {}
        }
    }

    /// Body of [`Conn::peek`].
    pub(super) fn peek_copy(&self, dst: &mut [u8]) -> Result<usize, CallError> {
        if matches!(self.state, State::Connecting | State::Accepting) {
            return Err(CallError::WouldBlock);
        }
        let lim = self.to_mark(dst.len());
        let dst = &mut dst[..lim];
        let mut copied = 0;
        for item in self.rx.items() {
            if copied == dst.len() {
                break;
            }
            match item {
                RxItem::Data { buf, off, len, .. } => {
                    let n = (*len as usize).min(dst.len() - copied);
                    self.store.read(buf, *off, &mut dst[copied..copied + n]);
                    copied += n;
                }
                RxItem::Src { advt } => {
                    if !self.advts.src_exhausted(*advt) {
                        break;
                    }
                }
            }
        }
        if copied > 0 || dst.is_empty() {
            return Ok(copied);
        }
        if let Some(e) = self.read_error() {
            return Err(CallError::Conn(e.clone()));
        }
        if self.read_closed() {
            return Ok(0);
        }
        Err(CallError::WouldBlock)
    }

    /// Body of [`Conn::read_ready`].
    pub(super) fn stream_ready(&self) -> bool {
        match self.state {
            State::Connecting | State::Accepting => return false,
            State::Closed | State::Disconnecting => return true,
            State::Established => {}
        }
        if self.error.is_some() {
            return true;
        }
        for item in self.rx.items() {
            match item {
                RxItem::Data { .. } => return true,
                RxItem::Src { advt } => {
                    if !self.advts.src_exhausted(*advt) {
                        return false;
                    }
                }
            }
        }
        self.disconn_rcvd || self.shut_rd
    }

    /// SO_RCVLOWAT: fewer than `lowat` bytes wait to be read and more can come (the
    /// connection is up, the peer has not closed, nothing but data is queued, and receive
    /// buffers are left for the peer to fill); a `lowat` of 0 or 1 never holds a reader back.
    pub(super) fn stream_below(&self, lowat: usize) -> bool {
        lowat > 1
            && self.state == State::Established
            && self.error.is_none()
            && !self.disconn_rcvd
            && !self.shut_rd
            && self.rx.bytes() < lowat
            && self.rx.items().all(|i| matches!(i, RxItem::Data { .. }))
            && (self.rx.held() as u32) < self.rx_cap()
    }

    /// A consumed receive or bounce buffer goes back to its pool; `fill_rx` reposts.
    pub(super) fn give_back_rx(&mut self, buf: Buf, bounce: bool) {
        if self.state == State::Closed {
            // Reading what an orderly close left behind: nothing will be posted again.
            if !bounce {
                self.rx.unhold();
            }
            self.store.free(buf);
        } else if bounce {
            self.advts.put_bounce(&mut self.store, buf);
            // Room for eager reads again (split zero copy).
            self.start_eager_reads();
        } else {
            self.rx.unhold();
            self.rx.put_buf(&mut self.store, buf);
            // A SrcAvail behind these bytes may be at the head now (read ahead; split zero
            // copy's eager reads need no look per buffer).
            if self.read_ahead {
                self.start_eager_reads();
            }
        }
    }

    /// Post receive buffers up to the slow-start target, within the receive budget
    /// (`max_rx_bufs` posted plus held with unread data).
    pub(super) fn fill_rx(&mut self) -> Result<(), ConnError> {
        if self.disconnect_issued {
            return Ok(());
        }
        let max = self.rx_budget();
        // Never fewer than a peer needs to send data while a credit update crosses it.
        let target = self.rx_post_target().max(super::MIN_RX_POSTED as usize);
        while self.rx.posted_len() < target && self.rx.posted_len() + self.rx.held() < max {
            let Some((key, buf)) = self.rx.post(&mut self.store) else {
                if self.rx.posted_len() == 0 {
                    return Err(ConnError::NoMemory);
                }
                break;
            };
            self.wrs.push_back(WorkRequest::Recv(RecvWr {
                wr_id: wrid::RECV | key as u64,
                sge: buf.sge(buf.size),
            }));
        }
        // Keep up to a target's worth of idle buffers: a buffer the application just read
        // is the one the next arrival's re-post needs, so under load no buffer is registered
        // and deregistered per message. The rest (after an idle shrink lowered the target)
        // is given back.
        let keep = self.rx.target().min(self.rx_cap()) as usize;
        self.rx.trim(&mut self.store, keep);
        Ok(())
    }

    /// Tell the peer we will not read (the rest of) its SrcAvail (SendSm, once reads in flight
    /// finish): it sends the rest by copy.
    pub(super) fn refuse_src(&mut self, advt: usize) {
        self.advts.refuse_src(advt);
        self.maybe_send_sm();
    }
}
