//! RDMA Write path and the sending side of zero copy: SrcAvail advertisement of our sources
//! and its completion (RdmaRdCompl), cancel (SrcAvailCancel / SendSm); RDMA Writes into a
//! peer's SinkAvail followed by RdmaWrCompl. (The keepalive probe, also an RDMA Write,
//! is in [`timers`](crate::proto::timers).)
//!
//! # Pipelined zero copy (several SrcAvails outstanding)
//!
//! The data source may have up to [`Conn::src_window`] SrcAvails outstanding at once (our
//! `max_srcavail_inflight` and `max_adverts`, and the `max_adverts` the peer announced in its
//! Hello/HelloAck; the IBTA Annex A4 pipelined mode). The rules:
//!
//! * **Order.** Sources are advertised in stream order, each only after every earlier stream
//!   item went out. Plain data (Data messages, RDMA Writes into a sink) and DisConn never pass
//!   an unfinished source: [`Conn::write`] returns WouldBlock while any zero-copy send is queued
//!   or outstanding, so a short completion behaves like a short write. Replies (RdmaRdCompl,
//!   SendSm, SinkCancelAck, ChRcvBuf(Ack), credit updates, ...) carry no stream bytes and may
//!   pass. A source is not advertised while an earlier one, written whole into the peer's sink,
//!   waits for its RDMA Write completions, nor while a cancel is out.
//! * **Acknowledgement.** The data sink reads advertisements in stream order and a read never
//!   spans two of them, so RdmaRdCompl lengths are attributed in stream order: to the oldest
//!   advertised source not fully acknowledged, the excess to the next. An acknowledgement
//!   beyond every byte advertised is [`ProtocolError::BadComplLength`] (the connection aborts).
//!   A source is finished ([`Event::ZcopySent`] with its full length) when every byte is
//!   acknowledged.
//! * **Cancel.** A cancel (the application's [`Conn::cancel_write_zcopy`] of an advertised
//!   source, or `srcavail_timeout` without progress) covers every outstanding advertisement:
//!   one SrcAvailCancel goes out, and nothing is advertised until the sink's SendSm (or its last
//!   RdmaRdCompl, when the messages crossed) ends them. The timeout restarts whenever the peer
//!   acknowledges bytes.
//! * **SendSm** (the answer to a cancel, or a sink refusing zero copy) ends every advertisement
//!   the source made before it received the SendSm. The sink sends it only once the reads it
//!   has in flight finished and were acknowledged, so when it arrives the acknowledged bytes are
//!   a prefix of the advertised ones: the oldest unfinished source completes with the bytes
//!   acknowledged, every later source (advertised or queued) with 0 (plus what went into a
//!   sink), and the application sends the rest again, in order. The sink in turn ignores every
//!   SrcAvail sent before the source saw its SendSm (its `mseq_ack` is older than the SendSm),
//!   so an advertisement that crossed the SendSm is void on both sides.
//! * **Split zero copy** (`Config::zcopy_split`, with gathered SENDs): an advertisement is
//!   *committed*: gathered SENDs of later sources follow it at once, it is never cancelled, and
//!   the peer reads it in full without waiting for its application. Sources are still reported
//!   in stream order (a later one finished by SEND waits as `Done`).
//! * A peer's SinkAvail is filled only while none of our sources is outstanding (the sink was
//!   offered after the peer consumed every advertisement it had seen, so those finish soon).

use super::{wrid, Conn, Count, Event, ProtocolError, CTRL_CREDITS};
use crate::proto::advt::SinkAdvt;
use crate::proto::buff::BufStore;
use crate::proto::iocb::{EndedSrcs, SrcState, Staging};
use crate::proto::msgs::{BsdhFlags, Ext, Mid, BSDH_LEN};
use crate::proto::tx::Inflight;
use crate::proto::tx::TxItem;
use crate::proto::Instant;
use crate::verbs::{RemoteBuf, SendOp, SendWr, Sge, WorkRequest};

impl<S: BufStore> Conn<S> {
    /// Send SrcAvail for a queued source (the caller checked the credit, the window and that
    /// every earlier stream item went out).
    pub(super) fn advertise_src(&mut self, now: Instant, key: u64) -> bool {
        let Some(s) = self.iocbs.find_src(key) else {
            return false;
        };
        if s.state != SrcState::Queued || s.written >= s.src.len {
            return false;
        }
        let timeout = s.stall.unwrap_or(self.cfg.srcavail_timeout);
        let off = s.written;
        let ext = Ext::SrcAvail {
            len: s.src.len - off,
            rkey: s.src.rkey,
            vaddr: s.src.addr + off as u64,
        };
        let queued_deadline = s.advertise(now + timeout);
        if !self.post_ctrl(Mid::SrcAvail, ext) {
            if let Some(s) = self.iocbs.find_src(key) {
                s.unadvertise(queued_deadline);
            }
            return false;
        }
        self.advts.note_data_sent(self.credits.last_sent_mseq());
        self.count(Count::SrcAvailSent);
        self.tx.stream_posted();
        true
    }

    /// Body of [`Conn::cancel_write_zcopy`].
    pub(super) fn cancel_src(&mut self, now: Instant, token: u64) {
        // The first piece of the source that can still end short (a source not cut is one
        // piece): pieces ahead of it that are committed advertisements or already sent in full
        // finish as they are, and the source ends after them.
        let Some(s) = self.iocbs.src_to_cancel(token) else {
            return;
        };
        let key = s.key;
        match s.state {
            SrcState::Advertised => self.cancel_advertised(),
            SrcState::Queued if s.written > 0 => {
                // Part of it went already (by SEND or into the peer's sink): it ends there,
                // once those work requests complete (the memory is in use until then).
                let (len, written, inflight) = (s.src.len, s.written, s.writes_inflight);
                s.end_at_written();
                self.tx.bytes_out((len - written) as usize);
                self.tx.unqueue_src(key);
                self.count(Count::SrcAvailCancelled(1));
                let next = self.iocbs.key_after(key);
                if inflight == 0 {
                    self.finish_src(key, written as usize);
                }
                if let Some(next) = next {
                    self.complete_srcs_from(now, next, 0);
                }
            }
            SrcState::Queued => {
                self.complete_srcs_from(now, key, 0);
            }
            _ => {}
        }
        self.flush(now);
    }

    /// Send SrcAvailCancel for every outstanding advertisement (once).
    fn cancel_advertised(&mut self) {
        if self.iocbs.src_cancelling() || self.iocbs.src_committed() {
            // A committed advertisement (split zero copy) may have stream bytes behind it:
            // it cannot end short. The peer reads it in full.
            return;
        }
        if self.iocbs.start_cancel() {
            self.queue_ctrl_front(Mid::SrcAvailCancel, Ext::None);
        }
    }

    /// The peer read `len` more bytes of our advertised sources, attributed in stream order.
    pub(super) fn on_rd_compl(&mut self, now: Instant, len: u32) -> Result<(), ProtocolError> {
        let default_timeout = self.cfg.srcavail_timeout;
        if !self.iocbs.src_advertised() {
            return Err(ProtocolError::Unexpected {
                mid: Mid::RdmaRdCompl,
                context: "no SrcAvail outstanding",
            });
        }
        let advertised: u64 = self.iocbs.advertised_unacked();
        if len as u64 > advertised {
            return Err(ProtocolError::BadComplLength {
                got: len as u64,
                want: advertised,
            });
        }
        let finished = self.iocbs.ack_read(now, len, default_timeout);
        self.touch(now);
        for (key, bytes) in finished {
            self.finish_src(key, bytes);
        }
        self.stream_moved(now);
        Ok(())
    }

    /// The peer took more of the stream (we posted stream items, or it acknowledged a read):
    /// bounded sources still queued behind start their stall bound over.
    pub(super) fn stream_moved(&mut self, now: Instant) {
        self.iocbs.restart_stalls(now);
    }

    /// SendSm received: the peer will read no more of any SrcAvail we sent before this arrived
    /// (its answer to our cancel, or a refusal). The oldest unfinished source completes with
    /// what the peer acknowledged, every later one with 0.
    pub(super) fn on_send_sm(&mut self, now: Instant) -> Result<(), ProtocolError> {
        let Some(s) = self.iocbs.first_outstanding() else {
            return Ok(());
        };
        let (key, bytes) = (s.key, (s.acked + s.written) as usize);
        self.complete_srcs_from(now, key, bytes);
        Ok(())
    }

    /// Sources made no progress within their bound (`srcavail_timeout`, or the stall bound of
    /// a plain write): a queued one ends unsent (the application sends it by copy), advertised
    /// ones are cancelled (one SrcAvailCancel covers them all, the peer's engine answers).
    pub(super) fn srcavail_timed_out(&mut self, now: Instant) {
        // The pieces of one source are next to each other: one cancel ends the source.
        let queued = self.iocbs.stalled_queued(now);
        for token in queued {
            self.count(Count::ZcopyStall);
            self.cancel_write_zcopy(now, token);
        }
        if self.iocbs.advertised_due(now) {
            self.count(Count::ZcopyStall);
            self.cancel_advertised();
        }
        // What could not be cancelled now (a committed advertisement, or a cancel already
        // out) has no timeout left: the timer must not fire again at once.
        self.iocbs.clear_passed_deadlines(now);
    }

    /// A source (or piece) is done: drop it from the queue and report it.
    /// Sources are reported in stream order: one that finishes before an earlier one (sent by
    /// SEND behind a committed advertisement) waits as `Done`.
    fn finish_src(&mut self, key: u64, bytes: usize) {
        if let Some(s) = self.iocbs.find_src(key) {
            if let Some(unsent) = s.finish(bytes) {
                self.tx.bytes_out(unsent);
            }
        }
        self.tx.unqueue_src(key);
        self.report_done();
    }

    /// Report the finished sources at the front, in stream order ([`Event::ZcopySent`] once
    /// per application source, when its last piece is in).
    fn report_done(&mut self) {
        for (token, bytes) in self.iocbs.take_done() {
            if Staging::is_staged(token) {
                // The engine's own: nobody to tell.
                self.end_staged(token);
                continue;
            }
            self.emit(Event::ZcopySent { token, bytes });
        }
    }

    /// A source ended short: it and every later source complete with what reached the peer
    /// (0 for the later ones, or what went into a sink), so the application resends the rest
    /// in order, like after a short write. Sources whose work requests are still in flight
    /// (SENDs behind a committed advertisement, split zero copy) end at the bytes that went
    /// once those complete; reports keep stream order.
    fn complete_srcs_from(&mut self, now: Instant, key: u64, bytes: usize) {
        let Some(EndedSrcs {
            keys,
            unsent,
            cancelled,
        }) = self.iocbs.end_srcs_from(key, bytes)
        else {
            return;
        };
        self.tx.bytes_out(unsent);
        // Our own copies (staged sends) go again as Data, before their buffers are let go.
        let requeued = self.requeue_staged(&keys);
        for k in &keys {
            self.tx.unqueue_src(*k);
        }
        self.count(Count::SrcAvailCancelled(cancelled));
        self.report_done();
        if !requeued {
            self.fail(now, super::ConnError::NoMemory, true);
        }
    }

    /// SinkAvail received. Honoured only if the peer had seen every stream byte we sent
    /// (otherwise it will cancel when those bytes arrive).
    pub(super) fn on_sink_avail(
        &mut self,
        _now: Instant,
        mseq_ack: u32,
        len: u32,
        rkey: u32,
        vaddr: u64,
    ) -> Result<(), ProtocolError> {
        if self.advts.sink_usable() {
            return Err(ProtocolError::TooManyAdverts(1));
        }
        if vaddr.checked_add(len as u64).is_none() {
            return Err(ProtocolError::Unexpected {
                mid: Mid::SinkAvail,
                context: "address range wraps",
            });
        }
        let stale = self.advts.sink_stale(mseq_ack);
        if !stale && !self.shut_wr {
            self.advts.set_sink(SinkAdvt { len, rkey, vaddr });
        }
        Ok(())
    }

    /// SinkAvailCancel received: give the sink back (we never hold a partly filled one).
    pub(super) fn on_sink_cancel(&mut self, _now: Instant) -> Result<(), ProtocolError> {
        self.advts.drop_sink();
        self.queue_ctrl_front(Mid::SinkCancelAck, Ext::None);
        Ok(())
    }

    /// RDMA-Write the queued stream bytes at the head of the queue into the peer's sink, then
    /// RdmaWrCompl. False if it must wait (credits).
    pub(super) fn fill_sink(&mut self, now: Instant) -> bool {
        // The bytes go into the peer's sink, not a receive buffer: the RdmaWrCompl after them
        // is a control message.
        if self.credits.tx() < CTRL_CREDITS {
            return false;
        }
        let Some(sink) = self.advts.take_sink() else {
            return true;
        };
        let mut placed: u32 = 0;
        while placed < sink.len {
            let room = sink.len - placed;
            let remote = RemoteBuf {
                addr: sink.vaddr + placed as u64,
                rkey: sink.rkey,
            };
            match self.tx.front() {
                Some(TxItem::Data { len, flags, .. }) if flags.is_empty() => {
                    let len = *len;
                    let Some(TxItem::Data { buf, .. }) = self.tx.pop_front() else {
                        unreachable!()
                    };
                    let n = len.min(room);
                    if n < len {
                        // The rest goes into a fresh buffer as ordinary data.
                        let mut rest = vec![0u8; (len - n) as usize];
                        self.store.read(&buf, BSDH_LEN as u32 + n, &mut rest);
                        // A pool buffer smaller than the rest (never, as ChRcvBufAck only
                        // grows the send size; checked so no peer input writes beyond one)
                        // counts as none.
                        let nb = self.tx.data_buf(&mut self.store).and_then(|nb| {
                            if nb.size >= BSDH_LEN as u32 + (len - n) {
                                Some(nb)
                            } else {
                                self.tx.put_data_buf(&mut self.store, nb);
                                None
                            }
                        });
                        match nb {
                            Some(nb) => {
                                self.store.write(&nb, BSDH_LEN as u32, &rest);
                                self.tx.push_front(TxItem::Data {
                                    buf: nb,
                                    len: len - n,
                                    flags: BsdhFlags::empty(),
                                });
                            }
                            None => {
                                // No buffer for the split: keep the item whole, sink unused.
                                self.tx.push_front(TxItem::Data {
                                    buf,
                                    len,
                                    flags: BsdhFlags::empty(),
                                });
                                break;
                            }
                        }
                    }
                    self.post_write(
                        Inflight::WriteData { buf, data: n },
                        remote,
                        buf.sge_at(BSDH_LEN as u32, n),
                    );
                    placed += n;
                }
                Some(TxItem::Src { key }) => {
                    let key = *key;
                    let Some(s) = self.iocbs.find_src(key) else {
                        break;
                    };
                    if s.state != SrcState::Queued || s.staged {
                        // (A staged source goes by SrcAvail only: its rest is ours to resend.)
                        break;
                    }
                    let (local, done) = s.take(room);
                    let n = local.len;
                    if done {
                        self.tx.pop_front();
                    }
                    self.post_write(Inflight::WriteSrc { key, len: n }, remote, local);
                    placed += n;
                }
                _ => break,
            }
        }
        if placed == 0 {
            self.advts.set_sink(sink);
            return false;
        }
        self.count(Count::ZcopyWriteBytes(placed as u64));
        self.tx.stream_posted();
        self.touch(now);
        self.post_ctrl(Mid::RdmaWrCompl, Ext::RdmaWrCompl { len: placed });
        true
    }

    /// Post an RDMA Write of `local` into the peer's `remote`, tracked as `inf`.
    fn post_write(&mut self, inf: Inflight, remote: RemoteBuf, local: Sge) {
        let key = self.tx.post(inf);
        self.wrs.push_back(WorkRequest::Send(SendWr {
            wr_id: wrid::WRITE | key as u64,
            op: SendOp::Write(remote),
            sge: Some(local),
            signaled: true,
            solicited: false,
            wake_engine: false,
            payload: None,
        }));
    }

    /// An RDMA Write from a zero-copy source completed.
    pub(super) fn src_written(&mut self, _now: Instant, key: u64, len: u32, ok: bool) {
        let Some(s) = self.iocbs.find_src(key) else {
            return;
        };
        let last = s.write_completed();
        let _ = len;
        if ok && last {
            let bytes = s.src.len as usize;
            // tx_bytes was reduced per write completion; finish_src subtracts only the
            // unwritten part (zero here).
            self.finish_src(key, bytes);
        }
    }

    /// Zero-copy work can never finish now: report what reached the peer.
    pub(super) fn fail_pending_zcopy(&mut self) {
        self.iocbs.fail_srcs();
        self.report_done();
        if let Some(s) = self.iocbs.take_sink() {
            self.emit(Event::ZcopyReceived {
                token: s.token,
                bytes: 0,
            });
        }
        self.iocbs.end_sink_cancel();
    }
}
