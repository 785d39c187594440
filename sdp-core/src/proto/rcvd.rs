//! Receive completions: parse each message the peer sent, check it, and act on it.
//!
//! Everything here handles untrusted input: a malformed or out-of-place message ends the
//! connection with AbortConn and a [`ProtocolError`] saying what was wrong; it never panics and
//! never touches other connections.

use super::{Conn, Count, Event, ProtocolError, State, MAX_HDR};
use crate::proto::buff::BufStore;
use crate::proto::msgs::{BsdhFlags, Ext, Header, Mid, BSDH_LEN, MIN_RCV_SIZE};
use crate::proto::Instant;
use crate::verbs::{Completion, WcStatus};

/// Bounce buffers taken at most when an urgent byte goes back in the stream in a buffer of its
/// own (`RxHalf::put_back`).
const MAX_PUT_BACK_BOUNCES: usize = 16;

impl<S: BufStore> Conn<S> {
    pub(super) fn on_recv_completion(&mut self, now: Instant, idx: usize, wc: &Completion) {
        let Some(buf) = self.rx.complete(idx) else {
            return;
        };
        if wc.status != WcStatus::Success {
            self.rx.put_buf(&mut self.store, buf);
            self.on_wc_error(now, wc.status);
            return;
        }
        if self.state == State::Accepting {
            // A message of the peer's before the CM said established (an RC QP's first receive
            // is its COMM_EST; over shm the connector's data, even its abort, may be taken in
            // the round that also reports its RTU): the peer is connected, so are we. Taken as
            // an abort first, the connection was never established and was dropped from the
            // accept queue: TCP's accept returns it, with its bytes and then the reset.
            self.established(now);
        }
        // The peer has sent: whatever we held for it may go (`Config::initiator_sends_first`).
        self.hold_sends = false;
        let len = wc.byte_len as usize;
        if len > buf.size as usize {
            self.rx.put_buf(&mut self.store, buf);
            self.protocol_error(now, ProtocolError::TooLong { len, max: buf.size });
            return;
        }
        let mut hdr = [0u8; MAX_HDR];
        let n = len.min(MAX_HDR);
        self.store.read(&buf, 0, &mut hdr[..n]);
        let h = match parse_received(&hdr[..n], len) {
            Ok(h) => h,
            Err(e) => {
                self.rx.put_buf(&mut self.store, buf);
                self.protocol_error(now, e.into());
                return;
            }
        };
        self.heard_from_peer(now);
        if let Err(e) = self.on_bsdh(&h.bsdh) {
            self.rx.put_buf(&mut self.store, buf);
            self.protocol_error(now, e);
            return;
        }
        if let Some(size) = self.rx.resize_ack_ready() {
            self.queue_ctrl_front(Mid::ChRcvBufAck, Ext::ChRcvBufAck { size });
        }
        let payload = len - h.header_len();
        if self.disconn_rcvd && carries_stream(h.bsdh.mid, payload) {
            self.rx.put_buf(&mut self.store, buf);
            self.protocol_error(
                now,
                ProtocolError::Unexpected {
                    mid: h.bsdh.mid,
                    context: "after DisConn",
                },
            );
            return;
        }
        let res = match h.ext {
            Ext::None if h.bsdh.mid == Mid::Data => {
                if payload == 0 {
                    // A pure credit update.
                    self.rx.put_buf(&mut self.store, buf);
                    Ok(())
                } else {
                    self.on_data(now, buf, payload as u32, h.bsdh.flags)
                }
            }
            _ => {
                self.rx.put_buf(&mut self.store, buf);
                self.on_control(now, &h)
            }
        };
        if let Err(e) = res {
            self.protocol_error(now, e);
        }
    }

    fn on_data(
        &mut self,
        now: Instant,
        buf: crate::proto::buff::Buf,
        mut len: u32,
        flags: BsdhFlags,
    ) -> Result<(), ProtocolError> {
        self.slow_start_grow();
        self.count(Count::DataBytesRcvd(len as u64));
        if self.iocbs.sink_active() && len > 0 {
            // The peer sent data past our SinkAvail (it had not seen it).
            self.sink_overtaken(now, !flags.is_empty());
        }
        if flags.contains(BsdhFlags::OOB_PRES) && len > 0 {
            if let (Some(m), Some(prev), false) = (self.urg_mark, self.urg_byte, self.oob_inline) {
                if m > 0 {
                    // A mark ahead of the reader moves on: the urgent byte there is stream data
                    // again (Linux's TCP reads it in line).
                    // (A bounce buffer only while few are taken: a peer sending urgent bytes
                    // one after another to a reader that reads nothing must not pin memory
                    // beyond its credits; past that the byte goes, as before.)
                    let spare = (self.advts.bounce_in_use() < MAX_PUT_BACK_BOUNCES)
                        .then(|| self.advts.bounce_buf(&mut self.store))
                        .flatten();
                    let at = usize::try_from(m).unwrap_or(usize::MAX);
                    if let Some(b) = self.rx.put_back(at, prev, &mut self.store, spare) {
                        self.advts.put_bounce(&mut self.store, b);
                    }
                }
            }
            // The urgent byte is the message's last: the mark is after the bytes before it.
            self.urg_mark = Some(self.rx.bytes() as u64 + u64::from(len - 1));
            if !self.oob_inline {
                let mut b = [0u8; 1];
                self.store.read(&buf, BSDH_LEN as u32 + len - 1, &mut b);
                len -= 1;
                self.urgent = Some(b[0]);
                self.urg_byte = Some(b[0]);
            }
            self.emit(Event::Urgent);
        }
        if len > 0 && self.app_closed {
            // Data for a socket the application closed: nobody will read it. TCP answers
            // with a reset, so the writer learns at once; so do we (AbortConn).
            self.rx.put_buf(&mut self.store, buf);
            self.abort_with(now, super::ConnError::Aborted);
            return Ok(());
        }
        if len == 0 {
            self.rx.put_buf(&mut self.store, buf);
            return Ok(());
        }
        self.rx.push_data(buf, BSDH_LEN as u32, len);
        Ok(())
    }

    /// The peer's end of stream (its DisConn, or its process ended settled: TCP's FIN):
    /// nothing more arrives, a sink we offered is cancelled.
    pub(super) fn peer_fin(&mut self, now: Instant) {
        self.disconn_rcvd = true;
        if self.iocbs.sink_active() {
            self.cancel_sink(now);
        }
    }

    fn on_control(&mut self, now: Instant, h: &Header) -> Result<(), ProtocolError> {
        let mid = h.bsdh.mid;
        match h.ext {
            Ext::None => match mid {
                Mid::DisConn => {
                    self.peer_fin(now);
                    Ok(())
                }
                Mid::AbortConn => {
                    // After the peer's DisConn, as TCP's RST in CLOSE_WAIT.
                    let e = if self.disconn_rcvd {
                        super::ConnError::ResetAfterClose
                    } else {
                        super::ConnError::Reset
                    };
                    self.fail(now, e, true);
                    Ok(())
                }
                Mid::SendSm => self.on_send_sm(now),
                Mid::SrcAvailCancel => self.on_src_cancel(now),
                Mid::SinkAvailCancel => self.on_sink_cancel(now),
                Mid::SinkCancelAck => self.on_sink_cancel_ack(now),
                _ => Err(ProtocolError::Unexpected {
                    mid,
                    context: "not supported",
                }),
            },
            Ext::SrcAvail { len, rkey, vaddr } => {
                self.on_src_avail(now, h.bsdh.mseq_ack, len, rkey, vaddr)
            }
            Ext::SinkAvail {
                len, rkey, vaddr, ..
            } => self.on_sink_avail(now, h.bsdh.mseq_ack, len, rkey, vaddr),
            Ext::RdmaRdCompl { len } => self.on_rd_compl(now, len),
            Ext::RdmaWrCompl { len } => self.on_wr_compl(now, len),
            Ext::ChRcvBuf { size } => {
                // The peer wants to send larger (or smaller) messages. Post buffers of the size
                // we grant from now on, and ack once every buffer still posted has that size.
                // A queued connection keeps its size (the ack says so) until it is accepted.
                let grant = if self.queued {
                    self.rx.size()
                } else {
                    size.clamp(MIN_RCV_SIZE, self.cfg.max_rcv_size)
                };
                if self.rx.resize(&mut self.store, grant) {
                    self.queue_ctrl_front(Mid::ChRcvBufAck, Ext::ChRcvBufAck { size: grant });
                }
                self.count(Count::Resize);
                Ok(())
            }
            Ext::ChRcvBufAck { size } => self.on_resize_ack(size),
            _ => Err(ProtocolError::Unexpected {
                mid,
                context: "not supported on an established connection",
            }),
        }
    }

    /// Slow start: when the peer sent this at its last data credit (it is stalled waiting for
    /// our updates, so the window is smaller than the round trip needs), post more receive
    /// buffers next time (up to the budget).
    fn slow_start_grow(&mut self) {
        // The peer sent at its last data credit (it keeps DATA_CREDITS - 1 for replies).
        if self.credits.peer_at_last_data_credit() && !self.queued {
            self.rx.grow_target(self.rx_cap());
        }
    }
}

/// Messages that put bytes in the stream (not allowed after the peer's DisConn).
fn carries_stream(mid: Mid, payload: usize) -> bool {
    matches!(mid, Mid::SrcAvail | Mid::RdmaWrCompl) || (mid == Mid::Data && payload > 0)
}

/// Parse a received message of `total` bytes from its first bytes (`prefix`, all of it when
/// the message is short). Only Data can be longer than a header: its BSDH is checked against
/// the completion's length, then parsed on its own.
fn parse_received(prefix: &[u8], total: usize) -> Result<Header, crate::proto::msgs::WireError> {
    use crate::proto::msgs::{Packet, WireError};
    if total <= prefix.len() {
        return Header::parse(&prefix[..total]).map(|(h, _)| h);
    }
    if prefix.len() < BSDH_LEN {
        return Err(WireError::Truncated {
            need: BSDH_LEN,
            have: prefix.len(),
        });
    }
    let p = Packet::new_unchecked(prefix);
    let claimed = p.msg_len();
    if usize::try_from(claimed).ok() != Some(total) {
        return Err(WireError::LengthMismatch {
            claimed,
            actual: total,
        });
    }
    let mid = p.mid()?;
    if mid != Mid::Data {
        return Err(WireError::UnexpectedPayload {
            mid,
            len: total.saturating_sub(mid.header_len()),
        });
    }
    let mut bsdh = [0u8; BSDH_LEN];
    bsdh.copy_from_slice(&prefix[..BSDH_LEN]);
    let mut view = Packet::new_unchecked(&mut bsdh[..]);
    view.set_msg_len(BSDH_LEN as u32);
    let (mut h, _) = Header::parse(&bsdh)?;
    h.bsdh.len = claimed;
    Ok(h)
}
