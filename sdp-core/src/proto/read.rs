//! RDMA Read path (ZCopy read, receiving side): a peer's SrcAvail is read straight into the
//! application's registered sink ([`Conn::read_zcopy`]) or, for a plain `read`, into bounce
//! buffers; each finished read is acknowledged with RdmaRdCompl. Also our own SinkAvail (the
//! write path's receiving side): advertise, cancel, complete.

pub use super::ZRecv;
use super::{wrid, CallError, Conn, Count, Event, ProtocolError, State};
use crate::proto::advt::{BOUNCE_WINDOW, EAGER_BOUNCE_BUFS};
use crate::proto::buff::{Buf, BufStore};
use crate::proto::iocb::ZSink;
use crate::proto::msgs::{Ext, Mid};
use crate::proto::rx::RxItem;
use crate::proto::tx::{Inflight, ReadReq};
use crate::proto::Instant;
use crate::verbs::{Completion, SendOp, SendWr, Sge, WcStatus, WorkRequest};

/// After this many sinks in a row overtaken by the peer's Data, at most one offer in
/// 2^`MAX_SINK_BACKOFF` is made while the peer keeps streaming.
const MAX_SINK_BACKOFF: u8 = 6;

impl<S: BufStore> Conn<S> {
    /// Body of [`Conn::read_zcopy`].
    pub(super) fn start_read_zcopy(
        &mut self,
        now: Instant,
        sink: ZSink,
        token: u64,
    ) -> Result<ZRecv, CallError> {
        if let Some(e) = &self.error {
            return Err(CallError::Conn(e.clone()));
        }
        match self.state {
            State::Established => {}
            State::Connecting | State::Accepting => return Err(CallError::WouldBlock),
            // Closed in order: what is left (or EOF) is read the ordinary way.
            State::Disconnecting | State::Closed => return Ok(ZRecv::Copy),
        }
        if sink.len == 0 {
            return Ok(ZRecv::Copy);
        }
        if let Some(RxItem::Src { advt }) = self.rx.front() {
            let advt = *advt;
            let a = self
                .advts
                .src(advt)
                .expect("an advertisement in the stream is held");
            if let Some(room) = a.sink_readable() {
                let n = sink.len.min(room);
                let local = Sge {
                    addr: sink.addr,
                    len: n,
                    lkey: sink.lkey,
                };
                self.post_read(advt, local, n, None, Some(token));
                self.touch(now);
                return Ok(ZRecv::Pending);
            }
            return Ok(ZRecv::Copy);
        }
        if !self.rx.queue_empty() || self.read_closed() || self.urgent.is_some() {
            return Ok(ZRecv::Copy);
        }
        if (sink.len as usize) < self.cfg.zcopy_threshold {
            return Ok(ZRecv::Copy);
        }
        if self.iocbs.sink_busy() {
            return Err(CallError::WouldBlock);
        }
        if self.iocbs.skip_sink_offer() {
            // The peer streams by SEND: its Data would overtake this offer too.
            return Ok(ZRecv::Copy);
        }
        self.iocbs.offer_sink(token, sink);
        self.count(Count::SinkAvailSent);
        self.queue_ctrl_front(
            Mid::SinkAvail,
            Ext::SinkAvail {
                len: sink.len,
                rkey: sink.rkey,
                vaddr: sink.addr,
                non_disc: 0,
            },
        );
        self.touch(now);
        self.flush(now);
        Ok(ZRecv::Pending)
    }

    fn post_read(
        &mut self,
        advt: usize,
        local: Sge,
        n: u32,
        bounce: Option<Buf>,
        sink_token: Option<u64>,
    ) {
        let remote = self.advts.request(advt, n);
        let key = self.tx.post(Inflight::Read(ReadReq {
            advt,
            len: n,
            bounce,
            sink_token,
        }));
        self.wrs.push_back(WorkRequest::Send(SendWr {
            wr_id: wrid::READ | key as u64,
            op: SendOp::Read(remote),
            sge: Some(local),
            signaled: true,
            solicited: false,
            wake_engine: false,
            payload: None,
        }));
    }

    /// A plain read found a SrcAvail at the head of the stream: read it into bounce buffers.
    /// Once an advertisement is fully requested, reads of the next one (when it follows at
    /// once in the stream) start too, up to [`BOUNCE_WINDOW`] reads in flight in all. RDMA Read
    /// completions come back in the order posted (RC send queue), so the RdmaRdCompls go out in
    /// stream order, as the data source attributes them.
    pub(super) fn start_bounce_reads(&mut self) {
        let ids: Vec<usize> = self.rx.leading_src_ids();
        let mut inflight: u32 = ids
            .iter()
            .filter_map(|id| self.advts.src(*id))
            .map(|a| a.reads_inflight)
            .sum();
        for advt in ids {
            loop {
                let Some(a) = self.advts.src(advt) else {
                    return;
                };
                if a.cancelled {
                    return;
                }
                if a.requested >= a.len {
                    break;
                }
                if inflight >= BOUNCE_WINDOW {
                    return;
                }
                let n = (a.len - a.requested).min(self.advts.bounce_size());
                let Some(buf) = self.advts.bounce_buf(&mut self.store) else {
                    return;
                };
                self.post_read(advt, buf.sge(n), n, Some(buf), None);
                inflight += 1;
            }
        }
    }

    pub(super) fn on_read_completion(&mut self, now: Instant, idx: usize, wc: &Completion) {
        let Some(Inflight::Read(r)) = self.tx.complete(idx) else {
            return;
        };
        if wc.status != WcStatus::Success {
            if let Some(b) = r.bounce {
                self.advts.put_bounce(&mut self.store, b);
            }
            self.sink_read_failed(r.sink_token);
            self.on_wc_error(now, wc.status);
            return;
        }
        if wc.byte_len != r.len {
            if let Some(b) = r.bounce {
                self.advts.put_bounce(&mut self.store, b);
            }
            self.sink_read_failed(r.sink_token);
            self.protocol_error(
                now,
                ProtocolError::BadTransferLength {
                    got: wc.byte_len as u64,
                    want: r.len as u64,
                },
            );
            return;
        }
        if !self.advts.read_done(r.advt, r.len) {
            // The advertisement is gone (connection torn down under us).
            if let Some(b) = r.bounce {
                self.advts.put_bounce(&mut self.store, b);
            }
            self.sink_read_failed(r.sink_token);
            return;
        }
        self.count(Count::ZcopyReadBytes(r.len as u64));
        // Tell the peer (its source memory is free once every byte is acknowledged).
        self.queue_ctrl_front(Mid::RdmaRdCompl, Ext::RdmaRdCompl { len: r.len });
        match (r.bounce, r.sink_token) {
            (Some(buf), _) => {
                // Bytes land in stream order just before the advertisement.
                self.rx.insert_bounce(r.advt, buf, r.len);
            }
            (None, Some(token)) => {
                self.emit(Event::ZcopyReceived {
                    token,
                    bytes: r.len as usize,
                });
            }
            (None, None) => {}
        }
        self.after_src_progress(r.advt);
        self.start_eager_reads();
        self.touch(now);
    }

    /// An RDMA Read into the application's sink ended without its bytes (it failed, or the
    /// connection went down under it): the sink is done, empty. Every sink read ends with
    /// exactly one [`Event::ZcopyReceived`]: here, on success in `on_read_completion`, or, for
    /// reads still posted when the connection is torn down, in `release_all`.
    pub(super) fn sink_read_failed(&mut self, token: Option<u64>) {
        if let Some(token) = token {
            self.emit(Event::ZcopyReceived { token, bytes: 0 });
        }
    }

    /// Split zero copy (`Config::zcopy_split`): read every advertisement that fits one bounce
    /// buffer as soon as it arrives, without waiting for the application, as a SEND's bytes
    /// land without it. The peer may have sent stream bytes behind such an advertisement and
    /// never cancels it; our reads also put its packet work on this end's CPU while the peer
    /// sends. Reads go out in stream order: a larger advertisement not fully requested yet
    /// (read as the application reads) stops the scan, and so does the bounce window. At most
    /// [`EAGER_BOUNCE_BUFS`] bounce buffers are held (read and not yet taken by the
    /// application, or in flight): past that the advertisements wait for the application,
    /// as plain ones do.
    pub(super) fn start_eager_reads(&mut self) {
        if self.app_closed || self.queued {
            return;
        }
        if self.read_ahead {
            // A reader that learns of data only from readiness (an application fd): a
            // SrcAvail at the head is read into bounce buffers at once, as a SEND lands
            // without a read call; within the eager bound, more as the reader takes them.
            if self.advts.bounce_in_use() < EAGER_BOUNCE_BUFS {
                self.start_bounce_reads();
            }
            return;
        }
        if !self.split_zcopy() {
            return;
        }
        let mut inflight: u32 = self.advts.reads_inflight_total();
        let ids: Vec<usize> = self.rx.src_ids();
        for advt in ids {
            let Some(a) = self.advts.src(advt) else {
                continue;
            };
            if a.cancelled || a.requested >= a.len {
                continue;
            }
            if a.requested > 0
                || a.len > self.advts.bounce_size()
                || inflight >= BOUNCE_WINDOW
                || self.advts.bounce_in_use() >= EAGER_BOUNCE_BUFS
            {
                return;
            }
            let n = a.len;
            let Some(buf) = self.advts.bounce_buf(&mut self.store) else {
                return;
            };
            self.post_read(advt, buf.sge(n), n, Some(buf), None);
            inflight += 1;
        }
    }

    /// Drop a finished advertisement from the stream, and answer a cancel once reads are done.
    fn after_src_progress(&mut self, advt: usize) {
        if self.advts.src_exhausted(advt) {
            self.rx.remove_src(advt);
            self.src_consumed(advt);
        }
        self.maybe_send_sm();
    }

    /// Send the SendSm owed once no RDMA Read is in flight (every byte read is acknowledged
    /// before it, so the peer sees exactly what we took).
    pub(super) fn maybe_send_sm(&mut self) {
        if self.advts.take_send_sm_due() {
            self.queue_ctrl_front(Mid::SendSm, Ext::None);
        }
    }

    /// The stream moved past an advertisement.
    pub(super) fn src_consumed(&mut self, advt: usize) {
        self.advts.remove_src(advt);
    }

    /// SrcAvail received: the peer's bytes come next in the stream (unless it is void: sent
    /// before the peer saw our SendSm, which ended it).
    pub(super) fn on_src_avail(
        &mut self,
        now: Instant,
        mseq_ack: u32,
        len: u32,
        rkey: u32,
        vaddr: u64,
    ) -> Result<(), ProtocolError> {
        if vaddr.checked_add(len as u64).is_none() {
            return Err(ProtocolError::Unexpected {
                mid: Mid::SrcAvail,
                context: "address range wraps",
            });
        }
        if self.iocbs.sink_active() {
            self.cancel_sink(now);
        }
        if self.advts.src_void(mseq_ack) {
            return Ok(());
        }
        if self.advts.src_count() >= self.cfg.max_adverts as usize {
            return Err(ProtocolError::TooManyAdverts(self.cfg.max_adverts));
        }
        let id = self.advts.add_src(len, rkey, vaddr);
        if self.app_closed {
            self.refuse_src(id);
            self.abort_with(now, super::ConnError::Aborted);
            return Ok(());
        }
        self.rx.push_src(id);
        self.start_eager_reads();
        Ok(())
    }

    /// SrcAvailCancel received: it covers every advertisement of the peer's we still have. Read
    /// no more of them; SendSm once the reads in flight finish (none if nothing was cut short:
    /// the messages crossed, and our RdmaRdCompls finish the peer's sources).
    pub(super) fn on_src_cancel(&mut self, _now: Instant) -> Result<(), ProtocolError> {
        let ids: Vec<usize> = self.rx.src_ids();
        let mut cut = false;
        for id in ids {
            cut |= self.advts.stop_src(id);
            self.after_src_progress(id);
        }
        if cut {
            self.count(Count::SrcAvailCancelled(1));
            self.advts.owe_send_sm();
            self.maybe_send_sm();
        }
        Ok(())
    }

    /// The peer sent a Data message with stream bytes while our SinkAvail is out. The peer sent
    /// it before it saw the SinkAvail: a source fills a sink it accepted before it sends any
    /// more stream bytes by SEND (only urgent data may go by SEND meanwhile), so when the
    /// SinkAvail reaches it, its `mseq_ack` is behind the stream and the peer drops it as stale
    /// (see `on_sink_avail`). The sink is done, empty, at once: no SinkAvailCancel round trip,
    /// during which a reader waiting for the sink would leave the new bytes unread. Urgent data
    /// still asks for the sink back.
    pub(super) fn sink_overtaken(&mut self, now: Instant, urgent: bool) {
        let posted = self.iocbs.sink_posted();
        if !self.iocbs.sink_active() || !posted || urgent {
            self.cancel_sink(now);
            return;
        }
        self.count(Count::SinkAvailStale);
        self.iocbs.sink_overtaken(MAX_SINK_BACKOFF);
        if let Some(s) = self.iocbs.take_sink() {
            self.emit(Event::ZcopyReceived {
                token: s.token,
                bytes: 0,
            });
        }
    }

    /// The peer sent stream bytes past our SinkAvail: ask for the sink back.
    pub(super) fn cancel_sink(&mut self, _now: Instant) {
        if self.iocbs.sink_active() {
            self.iocbs.start_sink_cancel();
            self.count(Count::SinkAvailCancelled);
            self.queue_ctrl_front(Mid::SinkAvailCancel, Ext::None);
        }
    }

    /// Take back a SinkAvail that was never sent: the sink completes empty, and a cancel queued
    /// for it goes too.
    pub(super) fn withdraw_sink(&mut self) {
        self.tx.unqueue_ctrl(Mid::SinkAvailCancel);
        self.iocbs.end_sink_cancel();
        if let Some(s) = self.iocbs.take_sink() {
            self.emit(Event::ZcopyReceived {
                token: s.token,
                bytes: 0,
            });
        }
    }

    /// RdmaWrCompl received: the peer wrote `len` bytes into our sink.
    pub(super) fn on_wr_compl(&mut self, now: Instant, len: u32) -> Result<(), ProtocolError> {
        let Some(sink_len) = self.iocbs.sink_len() else {
            return Err(ProtocolError::Unexpected {
                mid: Mid::RdmaWrCompl,
                context: "no SinkAvail outstanding",
            });
        };
        // Check before taking the sink: on this error the connection aborts, and the abort
        // reports the sink still outstanding (`fail_pending_zcopy`) exactly once.
        if len > sink_len {
            return Err(ProtocolError::BadComplLength {
                got: len as u64,
                want: sink_len as u64,
            });
        }
        let s = self.iocbs.take_sink().expect("checked");
        if len > 0 {
            self.iocbs.sink_filled();
        }
        self.count(Count::ZcopyWriteBytes(len as u64));
        self.count(Count::DataBytesRcvd(len as u64));
        self.touch(now);
        self.emit(Event::ZcopyReceived {
            token: s.token,
            bytes: len as usize,
        });
        Ok(())
    }

    /// SinkCancelAck received: the sink is ours again.
    pub(super) fn on_sink_cancel_ack(&mut self, _now: Instant) -> Result<(), ProtocolError> {
        if !self.iocbs.sink_cancel_pending() {
            return Err(ProtocolError::Unexpected {
                mid: Mid::SinkCancelAck,
                context: "no SinkAvailCancel outstanding",
            });
        }
        self.iocbs.end_sink_cancel();
        if let Some(s) = self.iocbs.take_sink() {
            self.emit(Event::ZcopyReceived {
                token: s.token,
                bytes: 0,
            });
        }
        Ok(())
    }
}
