//! Send path: application data into registered send buffers (BCopy), the send queue, and
//! posting SENDs as credits allow. Small writes coalesce into the buffer at the tail of the queue.

use super::{wrid, CallError, Conn, ConnError, Count, State, CTRL_CREDITS};
use crate::proto::buff::{Buf, BufStore};
use crate::proto::iocb::{SrcState, ZSrc};
use crate::proto::msgs::{BsdhFlags, Ext, Mid, BSDH_LEN};
use crate::proto::tx::{Inflight, TxItem};
use crate::proto::Instant;
use crate::verbs::{SendOp, SendWr, Sge, WorkRequest, INLINE_LKEY};

/// Split zero copy cuts no piece smaller than this: below it a source goes whole (its
/// SrcAvail and RdmaRdCompl would cost more than the read saves the sender).
const MIN_SPLIT_PIECE: u32 = 32 * 1024;

impl<S: BufStore> Conn<S> {
    /// Body of [`Conn::write`].
    pub(super) fn queue_bytes(
        &mut self,
        now: Instant,
        data: &[u8],
        inline_max: usize,
    ) -> Result<usize, CallError> {
        self.check_writable()?;
        if data.is_empty() {
            return Ok(0);
        }
        if self.iocbs.has_app_src() {
            // Plain bytes may not overtake a zero-copy send that may still end short.
            return Err(CallError::WouldBlock);
        }
        let room = self.tx.room(self.cfg.sndbuf);
        if room == 0 {
            self.count(Count::StallNoCredit);
            return Err(CallError::WouldBlock);
        }
        let want = data.len().min(room);
        if let Some(n) = self.stage(now, &data[..want]) {
            return Ok(n);
        }
        let mut taken = self.send_inline(&data[..want], inline_max);
        let cap = self.send_size - BSDH_LEN as u32;
        while taken < want {
            // Append to the tail buffer if it has room and carries no urgent byte.
            let appended = self
                .tx
                .append(&mut self.store, self.send_size, &data[taken..want]);
            if appended > 0 {
                taken += appended;
                continue;
            }
            let Some(buf) = self.tx.data_buf(&mut self.store) else {
                break;
            };
            let n = (cap as usize).min(want - taken);
            self.store
                .write(&buf, BSDH_LEN as u32, &data[taken..taken + n]);
            self.tx.push(TxItem::Data {
                buf,
                len: n as u32,
                flags: BsdhFlags::empty(),
            });
            taken += n;
        }
        if taken == 0 {
            // Registered memory is exhausted. With sends outstanding their completions free
            // buffers; with none, this is a hard error for the call (not the connection).
            return if self.tx.is_idle() {
                Err(CallError::Conn(ConnError::NoMemory))
            } else {
                Err(CallError::WouldBlock)
            };
        }
        self.tx.bytes_in(taken);
        self.count(Count::DataBytesSent(taken as u64));
        self.touch(now);
        self.maybe_grow_send_size();
        self.flush(now);
        Ok(taken)
    }

    /// Send the head of a write as Data messages whose payload the provider takes from the
    /// writer's memory as the caller posts them (`Conn::write_inline`): the bytes are not
    /// copied into a send buffer first. Only while they would go at once anyway: established,
    /// nothing queued or advertised ahead of them, no sink of the peer's to fill, a credit per
    /// message, and (unless `nodelay`) no partial message while a data send is outstanding
    /// (those coalesce in a send buffer, as `push_queue` holds them). Where the provider's
    /// inline limit is below the peer's receive size, only a rest that fits one message goes
    /// inline. Returns the bytes sent; the rest of the write queues by copy.
    fn send_inline(&mut self, data: &[u8], inline_max: usize) -> usize {
        if inline_max == 0
            || self.state != State::Established
            || self.hold_sends
            || self.tx.has_queued()
            || self.iocbs.src_advertised()
            || self.advts.sink_usable()
        {
            return 0;
        }
        let full = (self.send_size as usize).saturating_sub(BSDH_LEN);
        let cap = full.min(inline_max.saturating_sub(BSDH_LEN));
        if cap == 0 {
            return 0;
        }
        let mut off = 0;
        while off < data.len() {
            let n = cap.min(data.len() - off);
            if n < data.len() - off && cap < full {
                // The provider's inline messages are smaller than the peer's buffers (an
                // HCA's max_inline_data): a write is not cut into them; what does not fit one
                // goes by copy, in messages of the peer's size.
                break;
            }
            if !self.cfg.nodelay && n < full && self.tx.data_outstanding() > 0 {
                break;
            }
            if !self.credits.can_send_data() {
                break;
            }
            let Some(hdr) = self.tx.ctrl_buf(&mut self.store) else {
                break;
            };
            let h = self.next_header(Mid::Data, Ext::None, BsdhFlags::empty(), n);
            let mut bytes = [0u8; BSDH_LEN];
            h.emit(&mut bytes).expect("BSDH fits");
            self.store.write(&hdr, 0, &bytes);
            self.advts.note_data_sent(h.bsdh.mseq);
            self.tx.data_posted();
            let key = self.tx.post(Inflight::Inline { hdr, len: n as u32 });
            self.wrs.push_back(WorkRequest::Send(SendWr {
                wr_id: wrid::SEND | key as u64,
                op: SendOp::Send,
                sge: Some(hdr.sge(BSDH_LEN as u32)),
                payload: Some(Sge {
                    addr: off as u64,
                    len: n as u32,
                    lkey: INLINE_LKEY,
                }),
                signaled: true,
                solicited: true,
                wake_engine: self.spent_data_credits(),
            }));
            off += n;
        }
        if off > 0 {
            self.count(Count::InlineSendBytes(off as u64));
        }
        off
    }

    /// A staged send (BZCopy, `Config::staged_send_min`): copy `data` (what the send buffer
    /// takes) once into a registered buffer of ours and queue it as a source the peer reads
    /// by RDMA Read, under a grant of that buffer alone, revoked when the source ends. Like
    /// Data it counts in the send buffer until the peer has it, and what is written after it
    /// queues behind it; a peer that does not read it within `srcavail_timeout` gets the rest
    /// as Data after all (the cancel gives it back to us, [`Conn::requeue_staged`]), so the
    /// bytes reach the peer's receive buffers without its application, as Data would.
    /// `None`: not staged (too small, no window, no buffer or grant): send by copy.
    fn stage(&mut self, now: Instant, data: &[u8]) -> Option<usize> {
        let min = self.cfg.staged_send_min.unwrap_or(0);
        if min == 0
            || self.split_zcopy()
            || data.len() < min.max(self.cfg.zcopy_threshold)
            || data.len() > u32::MAX as usize
            || self.iocbs.src_queued() >= self.cfg.max_adverts as usize
        {
            return None;
        }
        let len = data.len() as u32;
        let buf = match self.staging.take_spare(len) {
            Some(b) => b,
            None => self.store.alloc(len)?,
        };
        self.store.write(&buf, 0, data);
        let Some((addr, rkey)) = self.store.grant_read(&buf, len) else {
            self.store.free(buf);
            return None;
        };
        let src = ZSrc {
            addr,
            len,
            lkey: buf.lkey,
            rkey,
        };
        let token = self.staging.hold(buf, addr);
        let key = self.iocbs.add_staged_src(token, src);
        self.tx.push(TxItem::Src { key });
        self.tx.bytes_in(data.len());
        self.count(Count::DataBytesSent(data.len() as u64));
        self.count(Count::StagedSends);
        self.touch(now);
        self.flush(now);
        Some(data.len())
    }

    /// Staged sources among `keys` (ended, in stream order) that ended short: their unsent
    /// rest goes again as Data, from our copy, in their place in the stream: an advertised
    /// source is ahead of everything still queued, a queued one where its item is. False if
    /// registered memory ran out (the caller fails the connection).
    pub(super) fn requeue_staged(&mut self, keys: &[u64]) -> bool {
        let mut front = 0;
        for (key, token, at, len) in self.iocbs.staged_rests(keys) {
            let Some((staging, off)) = self.staging.find(token, at) else {
                continue;
            };
            let mut rest = vec![0u8; len as usize];
            self.store.read(&staging, off, &mut rest);
            let cap = (self.send_size - BSDH_LEN as u32) as usize;
            let mut items = Vec::with_capacity(rest.len().div_ceil(cap));
            for chunk in rest.chunks(cap) {
                let Some(buf) = self.tx.data_buf(&mut self.store) else {
                    for it in items {
                        if let TxItem::Data { buf, .. } = it {
                            self.tx.put_data_buf(&mut self.store, buf);
                        }
                    }
                    return false;
                };
                self.store.write(&buf, BSDH_LEN as u32, chunk);
                items.push(TxItem::Data {
                    buf,
                    len: chunk.len() as u32,
                    flags: BsdhFlags::empty(),
                });
            }
            let at = match self.tx.position_of_src(key) {
                Some(i) => {
                    self.tx.unqueue_src(key);
                    i
                }
                // Advertised (its item went): behind the rests put at the front before it.
                None => {
                    let at = front;
                    front += items.len();
                    at
                }
            };
            for (i, it) in items.into_iter().enumerate() {
                self.tx.insert_at(at + i, it);
            }
            self.tx.bytes_in(len as usize);
        }
        true
    }

    /// A staged source ended (read, or the connection is over): take the peer's access
    /// back and keep or free its buffer.
    pub(super) fn end_staged(&mut self, token: u64) {
        let Some(buf) = self.staging.release(token) else {
            return;
        };
        self.store.revoke_read(&buf);
        if let Some(extra) = self.staging.keep_spare(buf) {
            self.store.free(extra);
        }
    }

    pub(super) fn queue_zcopy(
        &mut self,
        now: Instant,
        src: ZSrc,
        token: u64,
        stall: Option<std::time::Duration>,
    ) -> Result<(), CallError> {
        self.check_writable()?;
        if self.iocbs.has_staged_src() {
            // One kind of source at a time: an application's waits until the staged sends
            // are read (or given back as Data), as plain bytes wait behind its own.
            return Err(CallError::WouldBlock);
        }
        if (src.len as usize) < self.cfg.zcopy_threshold.min(self.send_size as usize)
            || src.len == 0
        {
            return Err(CallError::Invalid("zero-copy source below the threshold"));
        }
        if self.iocbs.src_queued() >= self.cfg.max_adverts as usize {
            return Err(CallError::WouldBlock);
        }
        let key = self
            .iocbs
            .add_src(token, src, stall, stall.map(|d| now + d));
        self.tx.push(TxItem::Src { key });
        self.tx.bytes_in(src.len as usize);
        self.count(Count::DataBytesSent(src.len as u64));
        self.touch(now);
        self.flush(now);
        Ok(())
    }

    /// Body of [`Conn::send_urgent`].
    pub(super) fn queue_urgent(&mut self, now: Instant, byte: u8) -> Result<(), CallError> {
        self.check_writable()?;
        let Some(buf) = self.tx.data_buf(&mut self.store) else {
            return Err(CallError::WouldBlock);
        };
        self.store.write(&buf, BSDH_LEN as u32, &[byte]);
        self.tx.push(TxItem::Data {
            buf,
            len: 1,
            flags: BsdhFlags::OOB_PRES | BsdhFlags::OOB_PEND,
        });
        self.tx.bytes_in(1);
        self.flush(now);
        Ok(())
    }

    fn check_writable(&self) -> Result<(), CallError> {
        if let Some(e) = &self.error {
            return Err(CallError::Conn(e.clone()));
        }
        match self.state {
            State::Connecting | State::Accepting => Err(CallError::WouldBlock),
            State::Established if !self.shut_wr => Ok(()),
            State::Established => Err(CallError::BrokenPipe),
            _ => Err(CallError::BrokenPipe),
        }
    }

    /// Queue DisConn after everything already queued (orderly close of our write half).
    pub(super) fn close_tail(&mut self) {
        self.tx.push(TxItem::Ctrl {
            mid: Mid::DisConn,
            ext: Ext::None,
        });
    }

    /// Queue a control message ahead of data (replies that must not wait behind a stalled
    /// stream, like SinkCancelAck or RdmaRdCompl).
    pub(super) fn queue_ctrl_front(&mut self, mid: Mid, ext: Ext) {
        self.tx.queue_ctrl_front(mid, ext);
    }

    /// Post what the credits allow, in stream order (see `push_queue`). When stream items went,
    /// the peer is taking the stream: a bounded source queued behind them is not stalled.
    pub(super) fn push_tx(&mut self, now: Instant) {
        let before = self.tx.stream_posts();
        self.push_queue(now);
        if self.tx.stream_posts() != before {
            self.stream_moved(now);
        }
    }

    /// Post what the credits allow, in stream order. While SrcAvails are outstanding only
    /// further sources (within [`Conn::src_window`]) and replies to the peer go out; data and
    /// DisConn wait until every outstanding source is finished (see [`super::write`]).
    fn push_queue(&mut self, now: Instant) {
        loop {
            let Some(front) = self.tx.front() else {
                return;
            };
            let outstanding = self.iocbs.src_advertised();
            match front {
                TxItem::Data { .. } if outstanding => return,
                TxItem::Ctrl { mid, .. } if outstanding && !is_reply(*mid) => return,
                TxItem::Data { len, flags, .. } => {
                    if self.advts.sink_usable() && flags.is_empty() {
                        if !self.fill_sink(now) {
                            return;
                        }
                        continue;
                    }
                    if !self.credits.can_send_data() {
                        self.count(Count::StallNoCredit);
                        self.ask_credits();
                        return;
                    }
                    // Coalesce: hold a lone partial buffer while a send is outstanding.
                    let full = *len + BSDH_LEN as u32 >= self.send_size;
                    if !self.cfg.nodelay
                        && !full
                        && self.tx.queue_len() == 1
                        && self.tx.data_outstanding() > 0
                        && flags.is_empty()
                    {
                        return;
                    }
                    let Some(TxItem::Data { buf, len, flags }) = self.tx.pop_front() else {
                        unreachable!()
                    };
                    self.post_data(buf, len, flags);
                }
                TxItem::Ctrl { mid, .. } => {
                    // A control message is consumed and reposted at once by the peer, so when
                    // it also tells the peer about buffers it does not know of, it does all a
                    // credit update would: it may take the last credit, like the update.
                    let carries_credits = self.credits.peer_unaware(self.rx.posted_len() as u32);
                    let need = if *mid == Mid::AbortConn || carries_credits {
                        1
                    } else {
                        CTRL_CREDITS
                    };
                    if self.credits.tx() < need {
                        return;
                    }
                    let Some(TxItem::Ctrl { mid, ext }) = self.tx.pop_front() else {
                        unreachable!()
                    };
                    if mid == Mid::SinkAvail && !self.rx.queue_empty() {
                        // Data arrived while the SinkAvail waited for a credit: bytes written
                        // into the sink would overtake it. Withdraw the offer unsent.
                        self.withdraw_sink();
                        continue;
                    }
                    if mid == Mid::DisConn {
                        self.disconn_sent = true;
                    }
                    if !self.post_ctrl(mid, ext) {
                        self.tx.push_front(TxItem::Ctrl { mid, ext });
                        return;
                    }
                    if mid == Mid::SinkAvail {
                        self.iocbs.sink_sent();
                    }
                }
                TxItem::Src { key } => {
                    let key = *key;
                    let staged = self.iocbs.find_src(key).is_some_and(|s| s.staged);
                    if self.advts.sink_usable() && !staged {
                        if outstanding {
                            // The peer offered its sink after consuming every advertisement
                            // it had seen: those finish soon; fill the sink after them.
                            return;
                        }
                        if !self.fill_sink(now) {
                            return;
                        }
                        continue;
                    }
                    if self.split_zcopy() {
                        self.cut_piece(key);
                        // Split zero copy: a source that fits a bounce buffer goes by SrcAvail
                        // while fewer than `zcopy_split_reads` are outstanding (the peer's CPU
                        // does its packet work), the rest as gathered SENDs, which may follow a
                        // committed advertisement.
                        let reads =
                            (self.cfg.zcopy_split_reads.max(1) as usize).min(self.src_window());
                        if self.iocbs.src_committed_inflight() < reads
                            && !self.iocbs.src_cancelling()
                            && self.split_candidate(key)
                        {
                            if self.credits.tx() < CTRL_CREDITS {
                                self.count(Count::StallNoCredit);
                                return;
                            }
                            if !self.advertise_src(now, key) {
                                return;
                            }
                            if let Some(s) = self.iocbs.find_src(key) {
                                s.commit();
                            }
                            self.tx.pop_front();
                            continue;
                        }
                        let sends = self.cfg.zcopy_split_sends as usize;
                        if sends > 0
                            && self.iocbs.src_sending() >= sends
                            && self.iocbs.find_src(key).is_some_and(|s| s.written == 0)
                        {
                            // Enough on the SEND path: the next piece goes to whichever path
                            // frees first.
                            return;
                        }
                        if !self.send_src(now, key) {
                            return;
                        }
                        continue;
                    }
                    if self.cfg.zcopy_by_send == Some(true) {
                        // As Data messages: after every advertised source, like plain data.
                        if outstanding || !self.send_src(now, key) {
                            return;
                        }
                        continue;
                    }
                    if self.iocbs.src_writing() {
                        // An earlier source went whole into the peer's sink and waits for its
                        // RDMA Write completions: sources finish in stream order.
                        return;
                    }
                    if self.iocbs.src_cancelling() || self.iocbs.src_inflight() >= self.src_window()
                    {
                        return;
                    }
                    if self.credits.tx() < CTRL_CREDITS {
                        return;
                    }
                    if !self.advertise_src(now, key) {
                        return;
                    }
                    // The source stays in `iocbs` until the peer is done with it; the stream
                    // moves on to the next item (only another source may go before it ends).
                    self.tx.pop_front();
                }
            }
        }
    }

    /// Split zero copy is on (see `Config::zcopy_split`).
    pub(super) fn split_zcopy(&self) -> bool {
        self.cfg.zcopy_by_send == Some(true) && self.cfg.zcopy_split == Some(true)
    }

    /// The largest source split zero copy advertises: one the peer reads whole into one
    /// bounce buffer, and that one Data message could carry.
    pub(super) fn split_cap(&self) -> u32 {
        (self.send_size - BSDH_LEN as u32).min(crate::proto::advt::BOUNCE_SIZE)
    }

    /// Split zero copy: cut a queued source at the head of the send queue that is larger than
    /// [`Conn::split_cap`] (and not started) into an even piece that fits and the rest, so each
    /// piece is read or sent on its own. The rest stays queued right behind it and is cut in
    /// turn. Not when pieces would be smaller than [`MIN_SPLIT_PIECE`] (the source goes whole).
    fn cut_piece(&mut self, key: u64) {
        let cap = self.split_cap();
        if cap < MIN_SPLIT_PIECE {
            return;
        }
        let Some(s) = self.iocbs.find_src(key) else {
            return;
        };
        if s.state != SrcState::Queued || s.written != 0 || s.src.len <= cap {
            return;
        }
        let n = s.src.len.div_ceil(cap);
        let piece = s.src.len.div_ceil(n);
        if let Some(rest) = self.iocbs.cut_src(key, piece) {
            self.tx.insert_second(TxItem::Src { key: rest });
        }
    }

    /// A queued source the peer can read whole into one bounce buffer, not started yet.
    fn split_candidate(&mut self, key: u64) -> bool {
        let cap = self.split_cap();
        self.iocbs
            .find_src(key)
            .is_some_and(|s| s.state == SrcState::Queued && s.written == 0 && s.src.len <= cap)
    }

    /// Post a Data message from a filled send buffer.
    pub(super) fn post_data(&mut self, buf: Buf, len: u32, flags: BsdhFlags) {
        let h = self.next_header(Mid::Data, Ext::None, flags, len as usize);
        let mut hdr = [0u8; BSDH_LEN];
        h.emit(&mut hdr).expect("BSDH fits");
        self.store.write(&buf, 0, &hdr);
        self.advts.note_data_sent(h.bsdh.mseq);
        self.tx.data_posted();
        let key = self.tx.post(Inflight::Msg {
            buf,
            ctrl: false,
            data: len,
        });
        self.wrs.push_back(WorkRequest::Send(SendWr {
            wr_id: wrid::SEND | key as u64,
            op: SendOp::Send,
            sge: Some(buf.sge(BSDH_LEN as u32 + len)),
            signaled: true,
            // Urgent data must reach the peer's runtime at once (SIGURG, POLLPRI), not only
            // its reader.
            solicited: !flags.intersects(BsdhFlags::OOB_PRES | BsdhFlags::OOB_PEND),
            wake_engine: self.spent_data_credits(),
            payload: None,
        }));
    }

    /// The message just built left us too few credits for another Data message: the peer's
    /// engine, not only its reader, must see it (`SendWr::wake_engine`). A provider with
    /// direct wakeups sends a solicited SEND's wakeup to the peer's reader alone
    /// (`Endpoint::give_direct_wake`); a reader that reads nothing then never runs its engine,
    /// which would take the data into its receive buffer (up to SO_RCVBUF) and give credits
    /// back, so its writer stopped after the receives the reader happened to have posted and
    /// got room back at some later wake, where TCP's writer fills the receive buffer at once
    /// and gets no room after. (The message stays solicited: a reader waiting for it wakes
    /// with one hop, as for any other.)
    fn spent_data_credits(&self) -> bool {
        !self.credits.can_send_data()
    }

    /// Send the queued source at the head of the queue as Data messages whose payload the HCA
    /// gathers straight from the registered memory (a header from the control pool, then up
    /// to a receive buffer's worth of the source). Each takes a credit like any Data message.
    /// True when every byte is posted (the item leaves the queue; the source finishes when
    /// the last send completes), false while it waits for credits or a header buffer.
    pub(super) fn send_src(&mut self, now: Instant, key: u64) -> bool {
        let cap = self.send_size - BSDH_LEN as u32;
        loop {
            let Some(s) = self.iocbs.find_src(key) else {
                return false;
            };
            if s.state != SrcState::Queued {
                return false;
            }
            if s.written == s.src.len {
                // Nothing left (a source is never empty; kept for robustness).
                s.end_at_written();
                self.tx.pop_front();
                return true;
            }
            if !self.credits.can_send_data() {
                self.count(Count::StallNoCredit);
                self.ask_credits();
                return false;
            }
            let Some(hdr) = self.tx.ctrl_buf(&mut self.store) else {
                return false;
            };
            let s = self.iocbs.find_src(key).expect("found above");
            let (payload, done) = s.take(cap);
            let n = payload.len;
            let h = self.next_header(Mid::Data, Ext::None, BsdhFlags::empty(), n as usize);
            let mut bytes = [0u8; BSDH_LEN];
            h.emit(&mut bytes).expect("BSDH fits");
            self.store.write(&hdr, 0, &bytes);
            self.advts.note_data_sent(h.bsdh.mseq);
            self.tx.data_posted();
            self.count(Count::ZcopySendBytes(u64::from(n)));
            self.touch(now);
            let key = self.tx.post(Inflight::SendSrc { hdr, key, len: n });
            self.wrs.push_back(WorkRequest::Send(SendWr {
                wr_id: wrid::SEND | key as u64,
                op: SendOp::Send,
                sge: Some(hdr.sge(BSDH_LEN as u32)),
                payload: Some(payload),
                signaled: true,
                solicited: true,
                wake_engine: self.spent_data_credits(),
            }));
            if done {
                self.tx.pop_front();
                return true;
            }
        }
    }

    /// Post a control message now (the caller checked the credit). False if no buffer.
    pub(super) fn post_ctrl(&mut self, mid: Mid, ext: Ext) -> bool {
        let Some(buf) = self.tx.ctrl_buf(&mut self.store) else {
            return false;
        };
        let h = self.next_header(mid, ext, BsdhFlags::empty(), 0);
        let mut hdr = [0u8; super::MAX_HDR];
        let n = h.emit(&mut hdr).expect("header fits");
        self.store.write(&buf, 0, &hdr[..n]);
        if mid == Mid::RdmaWrCompl {
            self.advts.note_data_sent(h.bsdh.mseq);
        }
        if mid == Mid::SendSm {
            // SrcAvails the peer sends before it sees this are void (see `Advts::src_void`).
            self.advts.send_sm_sent(h.bsdh.mseq);
        }
        let key = self.tx.post(Inflight::Msg {
            buf,
            ctrl: true,
            data: 0,
        });
        self.wrs.push_back(WorkRequest::Send(SendWr {
            wr_id: wrid::SEND | key as u64,
            op: SendOp::Send,
            sge: Some(buf.sge(n as u32)),
            signaled: true,
            // An offer of data wakes the reader as data does.
            solicited: mid == Mid::SrcAvail,
            wake_engine: false,
            payload: None,
        }));
        true
    }

    /// Send AbortConn at once if any credit is left (best effort: the CM disconnect that
    /// follows tells the peer anyway).
    pub(super) fn send_abort(&mut self) {
        if self.credits.tx() >= 1 {
            self.post_ctrl(Mid::AbortConn, Ext::None);
        }
    }

    /// Send a standalone credit update when the peer is about to run dry and we have buffers
    /// posted it does not know about. This may use the last credit.
    pub(super) fn maybe_credit_update(&mut self) {
        if self.state != State::Established || self.disconnect_issued || self.credits.tx() == 0 {
            return;
        }
        // See `Credits::update_due` (a peer asks for data credits with an update of its own,
        // see `ask_credits`).
        if self.credits.update_due(self.rx.posted_len() as u32) {
            self.count(Count::CreditUpdateSent);
            self.post_ctrl(Mid::Data, Ext::None);
        }
    }

    /// Data waits for credits: if our last message was not Data, the peer may think we need
    /// only a control message's credits and not announce the buffers it has; a credit update
    /// (a Data message) tells it we want data credits (it answers with an update of its own).
    ///
    /// The ask takes the last credit only when it also tells the peer of receives it does not
    /// know of (as any control message): an ask that carries no news and takes the last
    /// credit leaves us unable to send the update the peer may be waiting for, and two such
    /// asks crossing deadlocked a duplex transfer (both sides at 0 credits with receives
    /// posted: each had sent Data, ChRcvBuf, an ask, SinkAvail, then an ask with its last
    /// credit).
    fn ask_credits(&mut self) {
        let need = if self.credits.peer_unaware(self.rx.posted_len() as u32) {
            1
        } else {
            CTRL_CREDITS
        };
        if self.credits.sent_data_last()
            || self.credits.tx() < need
            || self.state != State::Established
            || self.disconnect_issued
        {
            return;
        }
        self.count(Count::CreditUpdateSent);
        self.post_ctrl(Mid::Data, Ext::None);
    }

    /// When the application's writes take more than one buffer, ask the peer for larger
    /// receive buffers (ChRcvBuf): fewer, larger messages. One write's worth is enough: a
    /// 64 KiB request in 32 KiB buffers reaches a waiting reader as several messages, each
    /// a wakeup (64 KiB ping-pong over shm beside a CPU-bound process, p50: 80 us in 32 KiB
    /// buffers, 33-36 us in 128 KiB ones, kernel TCP 31 us; the trigger was four queued
    /// buffers, which only streams reach).
    fn maybe_grow_send_size(&mut self) {
        if self.tx.resize_pending() || self.send_size >= self.cfg.max_rcv_size {
            return;
        }
        if self.tx.queued_data_bufs() >= 2 {
            let want = (self.send_size.saturating_mul(4)).min(self.cfg.max_rcv_size);
            self.tx.ask_resize(want);
            self.count(Count::Resize);
            self.queue_ctrl_front(Mid::ChRcvBuf, Ext::ChRcvBuf { size: want });
        }
    }

    /// The peer acknowledged our ChRcvBuf: every buffer it has posted is `size` now.
    pub(super) fn on_resize_ack(&mut self, size: u32) -> Result<(), super::ProtocolError> {
        let Some(asked) = self.tx.take_resize() else {
            return Err(super::ProtocolError::Unexpected {
                mid: Mid::ChRcvBufAck,
                context: "no ChRcvBuf outstanding",
            });
        };
        // The peer grants at most what we asked for, and never less than the size it already
        // receives: our queued messages and the split of one into a SinkAvail (`fill_sink`)
        // were built for that size. Anything else is a protocol error (abort).
        if size > asked.max(self.send_size) {
            return Err(super::ProtocolError::Unexpected {
                mid: Mid::ChRcvBufAck,
                context: "acknowledged size larger than requested",
            });
        }
        if size < self.send_size {
            return Err(super::ProtocolError::Unexpected {
                mid: Mid::ChRcvBufAck,
                context: "acknowledged size below the current one",
            });
        }
        self.send_size = size;
        self.tx.resize(&mut self.store, size);
        Ok(())
    }
}

/// Control messages that may overtake an outstanding SrcAvail: everything but DisConn, which
/// must follow every byte of the stream.
fn is_reply(mid: Mid) -> bool {
    mid != Mid::DisConn
}
