//! Sequence numbers and credits (flow control), on their own: no buffers, no queues.
//!
//! Credits follow the SDP rule: every message is a SEND that consumes one receive buffer the
//! peer posted. Each BSDH carries `bufs` (receive buffers the sender has posted), `mseq` (its
//! sequence number) and `mseq_ack` (the last sequence number it received), so on every message
//! received `credits = mseq_ack + 1 + bufs - next_mseq` exactly. A control message needs two
//! credits ([`CTRL_CREDITS`]): the last one is kept for a credit update, so two sides that both
//! run out can always tell each other about new buffers and never deadlock. A message with
//! stream bytes needs four ([`DATA_CREDITS`]): the peer keeps three receives posted however
//! much unread data its application leaves, so replies (RdmaRdCompl, SendSm, ...) get through a
//! full receive window, as TCP's ACKs need no window.
//!
//! Sequence numbers wrap at `u32::MAX`; every comparison goes through `seq_lt` / `seq_gt` /
//! `seq_le` (serial number arithmetic over half the space). The initial sequence numbers are
//! the Hello/HelloAck's (0 on the wire today); `Credits::new` takes them, so the wrap is
//! testable.

use std::collections::VecDeque;

use super::error::ProtocolError;
use super::msgs::{Bsdh, BsdhFlags, Ext, Header, Mid};

/// Most messages a receive queue holds; bounds what a peer can make us track.
pub(crate) const MAX_CREDITS: i64 = u16::MAX as i64;

/// Credits a control message needs (all but AbortConn and the credit update, and one that
/// announces receives the peer does not know of): the last is kept for a credit update.
pub const CTRL_CREDITS: u32 = 2;

/// Credits a message carrying stream bytes (Data with a payload, a gathered SEND of a
/// zero-copy source) needs. Data is the only message that holds a receive buffer until the
/// peer's application reads it; a control message is consumed and reposted at once. Data
/// leaves the peer three receives, however full of unread data its application keeps its
/// window: a control message and a credit update can pass each way even while credit updates
/// cross (each consumes one of the other side's receives). So a reply to a zero-copy transfer
/// (RdmaRdCompl, SendSm, SrcAvailCancel, ...) always finds a credit, and a zero-copy send never
/// waits for the peer's application to read something else first.
pub const DATA_CREDITS: u32 = 4;

/// Fewest receives a connection keeps posted (within its budget of `max_rx_bufs` posted plus
/// held): one more than [`DATA_CREDITS`], so data still flows while a credit update crosses it.
pub const MIN_RX_POSTED: u32 = DATA_CREDITS + 1;

/// `a` comes before `b` in sequence space (serial number arithmetic).
#[inline]
pub(crate) fn seq_lt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// `a` comes after `b` in sequence space.
#[inline]
pub(crate) fn seq_gt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// `a` is `b` or comes before it in sequence space.
#[inline]
pub(crate) fn seq_le(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) <= 0
}

/// One connection's sequence numbers and credits, both ways.
#[derive(Debug, Clone)]
pub(crate) struct Credits {
    /// Sequence number of our next message.
    next_mseq: u32,
    /// Sequence number of the peer's last message.
    last_rx_mseq: u32,
    /// Credits we hold: receive buffers of the peer we may use.
    tx: u32,
    /// Credits the peer has as far as we know: `bufs` we last sent, less the messages received
    /// since.
    peer: u32,
    /// For each message we sent and the peer has not acknowledged: (mseq, bufs, last_rx_mseq).
    /// Tells us exactly how many credits the peer had left when it sent each message.
    sent_log: VecDeque<(u32, u16, u32)>,
    /// Credits the peer had left after its last message (exact, from `sent_log`).
    peer_left: i64,
    /// The peer's last message was a Data message (stream bytes or a credit update): it may
    /// want the credits data needs, not just those of a control message.
    peer_sent_data: bool,
    /// Our last message was a Data message (so the peer knows we may want data credits).
    sent_data_last: bool,
}

impl Default for Credits {
    fn default() -> Self {
        Credits::new(0, 0)
    }
}

impl Credits {
    /// Before the Hello exchange: our Hello (or HelloAck) carries `isn`, the peer's carries
    /// `peer_isn` (both 0 on the wire today).
    #[inline]
    pub(crate) fn new(isn: u32, peer_isn: u32) -> Credits {
        Credits {
            next_mseq: isn,
            last_rx_mseq: peer_isn,
            tx: 0,
            peer: 0,
            sent_log: VecDeque::new(),
            peer_left: i64::MAX,
            peer_sent_data: true,
            sent_data_last: false,
        }
    }

    /// Our Hello or HelloAck goes out announcing `bufs` receives: its `(mseq, mseq_ack)`.
    #[inline]
    pub(crate) fn hello_sent(&mut self, bufs: u16) -> (u32, u32) {
        let (mseq, ack) = (self.next_mseq, self.last_rx_mseq);
        self.sent_log.push_back((mseq, bufs, ack));
        self.peer = bufs as u32;
        self.next_mseq = mseq.wrapping_add(1);
        (mseq, ack)
    }

    /// The peer's Hello or HelloAck announced `bufs` receives.
    #[inline]
    pub(crate) fn hello_rcvd(&mut self, bufs: u16) {
        self.tx = bufs as u32;
    }

    /// Check a received BSDH's sequence and credit fields and take them in.
    #[inline]
    pub(crate) fn on_bsdh(&mut self, h: &Bsdh) -> Result<(), ProtocolError> {
        let want = self.last_rx_mseq.wrapping_add(1);
        if h.mseq != want {
            return Err(ProtocolError::Sequence { got: h.mseq, want });
        }
        self.last_rx_mseq = h.mseq;
        // Messages we sent that the peer had not seen when it sent this one.
        // No more can be in flight than the peer ever had buffers for.
        let unacked = self.next_mseq.wrapping_sub(1).wrapping_sub(h.mseq_ack);
        if unacked as i64 > MAX_CREDITS {
            return Err(ProtocolError::BadAck {
                mseq_ack: h.mseq_ack,
            });
        }
        let credits = h.bufs as i64 - unacked as i64;
        if !(0..=MAX_CREDITS).contains(&credits) {
            return Err(ProtocolError::BadCredits(credits));
        }
        self.tx = credits as u32;
        self.peer = self.peer.saturating_sub(1);
        self.peer_sent_data = h.mid == Mid::Data;
        // How many credits the peer had left after sending this: the bufs of our message it had
        // seen last, less its messages since we sent that one.
        while self.sent_log.len() > 1 && seq_le(self.sent_log[1].0, h.mseq_ack) {
            self.sent_log.pop_front();
        }
        self.peer_left = match self.sent_log.front() {
            Some(&(m, bufs, rx)) if m == h.mseq_ack => bufs as i64 - h.mseq.wrapping_sub(rx) as i64,
            _ => i64::MAX,
        };
        Ok(())
    }

    /// Build a message header announcing `bufs` posted receives, consuming one credit (the
    /// caller checked there is one).
    #[inline]
    pub(crate) fn next_header(
        &mut self,
        mid: Mid,
        ext: Ext,
        flags: BsdhFlags,
        payload: usize,
        bufs: u16,
    ) -> Header {
        let h = Header::new(
            mid,
            ext,
            flags,
            bufs,
            self.next_mseq,
            self.last_rx_mseq,
            payload,
        );
        self.sent_log
            .push_back((self.next_mseq, bufs, self.last_rx_mseq));
        self.sent_data_last = mid == Mid::Data;
        self.next_mseq = self.next_mseq.wrapping_add(1);
        self.tx -= 1;
        self.peer = bufs as u32;
        h
    }

    /// Move every sequence number by `ours` (our messages) and `peers` (the peer's), as if the
    /// Hellos had carried other initial sequence numbers (a test hook, see
    /// `Conn::shift_sequence_numbers`).
    #[cfg(feature = "harness")]
    pub(crate) fn shift(&mut self, ours: u32, peers: u32) {
        self.next_mseq = self.next_mseq.wrapping_add(ours);
        self.last_rx_mseq = self.last_rx_mseq.wrapping_add(peers);
        for (m, _, rx) in self.sent_log.iter_mut() {
            *m = m.wrapping_add(ours);
            *rx = rx.wrapping_add(peers);
        }
    }

    /// Credits we hold.
    #[inline]
    pub(crate) fn tx(&self) -> u32 {
        self.tx
    }
    /// Enough credits for a message with stream bytes.
    #[inline]
    pub(crate) fn can_send_data(&self) -> bool {
        self.tx >= DATA_CREDITS
    }
    /// We have `posted` receives the peer does not know of (a message of ours would tell it).
    #[inline]
    pub(crate) fn peer_unaware(&self, posted: u32) -> bool {
        posted > self.peer
    }
    /// Sequence number of our last message.
    #[inline]
    pub(crate) fn last_sent_mseq(&self) -> u32 {
        self.next_mseq.wrapping_sub(1)
    }
    #[inline]
    pub(crate) fn next_mseq(&self) -> u32 {
        self.next_mseq
    }
    /// Credits the peer has as far as we know.
    #[cfg(test)]
    pub(crate) fn peer(&self) -> u32 {
        self.peer
    }
    #[cfg(test)]
    pub(crate) fn last_rx_mseq(&self) -> u32 {
        self.last_rx_mseq
    }
    /// Credits the peer had left after its last message (`i64::MAX` if unknown).
    #[cfg(test)]
    pub(crate) fn peer_left(&self) -> i64 {
        self.peer_left
    }
    /// The peer sent its last message at its last data credit (it keeps `DATA_CREDITS` - 1 for
    /// replies): it waits for our updates, the window is smaller than the round trip needs.
    #[inline]
    pub(crate) fn peer_at_last_data_credit(&self) -> bool {
        self.peer_left < DATA_CREDITS as i64
    }
    /// Our last message was a Data message.
    #[inline]
    pub(crate) fn sent_data_last(&self) -> bool {
        self.sent_data_last
    }

    /// With `posted` receives posted, the peer is about to run dry and does not know of
    /// buffers we have: a standalone credit update is due (it may use our last credit).
    ///
    /// The peer needs DATA_CREDITS to send data, CTRL_CREDITS for anything else: below that
    /// it is starving. It wants data credits if its last message was Data (it streams, or it
    /// asked); a peer that only answers our zero copy (SrcAvail, RdmaRdCompl) needs no update
    /// per round trip. Never more than all our receives but one: an update consumes one of the
    /// peer's, which it reposts and announces back, and updates crossing each other would go
    /// on forever.
    #[inline]
    pub(crate) fn update_due(&self, posted: u32) -> bool {
        let need = if self.peer_sent_data {
            DATA_CREDITS
        } else {
            CTRL_CREDITS
        };
        let want = need.min(posted.saturating_sub(1));
        posted > self.peer && (self.peer < want || self.peer * 2 < posted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bsdh(mid: Mid, bufs: u16, mseq: u32, mseq_ack: u32) -> Bsdh {
        Header::new(mid, Ext::None, BsdhFlags::empty(), bufs, mseq, mseq_ack, 0).bsdh
    }

    /// Two ends after the Hello exchange, with `a_bufs` / `b_bufs` receives announced.
    fn pair(a_isn: u32, b_isn: u32, a_bufs: u16, b_bufs: u16) -> (Credits, Credits) {
        let mut a = Credits::new(a_isn, b_isn);
        let mut b = Credits::new(b_isn, a_isn);
        let (m, ack) = a.hello_sent(a_bufs);
        assert_eq!((m, ack), (a_isn, b_isn));
        b.hello_rcvd(a_bufs);
        let (m, ack) = b.hello_sent(b_bufs);
        assert_eq!((m, ack), (b_isn, a_isn));
        a.hello_rcvd(b_bufs);
        (a, b)
    }

    /// `from` sends a Data message announcing `bufs`; `to` takes it in.
    fn send(from: &mut Credits, to: &mut Credits, bufs: u16) -> Result<Header, ProtocolError> {
        let h = from.next_header(Mid::Data, Ext::None, BsdhFlags::empty(), 1, bufs);
        to.on_bsdh(&h.bsdh).map(|()| h)
    }

    #[test]
    fn serial_comparisons_wrap() {
        assert!(seq_lt(u32::MAX, 0));
        assert!(seq_gt(0, u32::MAX));
        assert!(seq_le(u32::MAX, u32::MAX));
        assert!(seq_le(u32::MAX - 5, 3));
        assert!(!seq_lt(3, u32::MAX - 5));
        assert!(seq_gt(3, u32::MAX - 5));
        assert!(!seq_lt(7, 7) && !seq_gt(7, 7));
    }

    #[test]
    fn credits_are_exact_from_the_hello_on() {
        let (mut a, mut b) = pair(0, 0, 8, 6);
        assert_eq!((a.tx(), b.tx()), (6, 8));
        assert_eq!((a.peer(), b.peer()), (8, 6));
        // A sends three, each consuming one of B's receives.
        for i in 0..3 {
            let h = send(&mut a, &mut b, 8).unwrap();
            assert_eq!(h.bsdh.mseq, 1 + i);
            assert_eq!(h.bsdh.mseq_ack, 0);
        }
        assert_eq!(a.tx(), 3);
        assert!(!a.can_send_data());
        assert_eq!(b.peer(), 3);
        // B answers announcing its 6 receives (reposted): it has seen all three of A's.
        let h = send(&mut b, &mut a, 6).unwrap();
        assert_eq!(h.bsdh.mseq_ack, 3);
        assert_eq!(a.tx(), 6);
        assert!(a.can_send_data());
        // B used one of A's 8 receives.
        assert_eq!(b.tx(), 7);
        assert_eq!(a.peer_left(), 7);
    }

    #[test]
    fn sequence_and_credits_wrap_at_u32_max() {
        for (a_isn, b_isn) in [
            (u32::MAX, u32::MAX),
            (u32::MAX - 2, 5),
            (7, u32::MAX - 1),
            (i32::MAX as u32, u32::MAX),
        ] {
            let (mut a, mut b) = pair(a_isn, b_isn, 16, 16);
            let mut sent = 0u32;
            for round in 0..40u32 {
                // A sends until it is down to a data message's worth, B answers once.
                while a.tx() > DATA_CREDITS {
                    let h = send(&mut a, &mut b, 16).unwrap();
                    sent += 1;
                    assert_eq!(h.bsdh.mseq, a_isn.wrapping_add(sent), "round {round}");
                }
                let h = send(&mut b, &mut a, 16).unwrap();
                assert_eq!(h.bsdh.mseq_ack, a_isn.wrapping_add(sent));
                // Every message of A's is acknowledged: B's 16 receives are all A's again.
                assert_eq!(a.tx(), 16, "round {round}");
                assert_eq!(a.last_rx_mseq(), h.bsdh.mseq);
                assert_eq!(a.last_sent_mseq(), a_isn.wrapping_add(sent));
                assert_eq!(a.next_mseq(), a_isn.wrapping_add(sent + 1));
            }
            assert!(sent > 400);
        }
    }

    #[test]
    fn out_of_sequence_is_refused_across_the_wrap() {
        let (_, mut b) = pair(u32::MAX - 1, 0, 16, 16);
        // A's Hello was u32::MAX - 1; its first message is u32::MAX, then 0.
        assert_eq!(
            b.on_bsdh(&bsdh(Mid::Data, 16, 0, 0)),
            Err(ProtocolError::Sequence {
                got: 0,
                want: u32::MAX
            })
        );
        b.on_bsdh(&bsdh(Mid::Data, 16, u32::MAX, 0)).unwrap();
        b.on_bsdh(&bsdh(Mid::Data, 16, 0, 0)).unwrap();
        assert_eq!(
            b.on_bsdh(&bsdh(Mid::Data, 16, 0, 0)),
            Err(ProtocolError::Sequence { got: 0, want: 1 })
        );
    }

    #[test]
    fn acks_of_unsent_messages_and_impossible_credits_are_refused_across_the_wrap() {
        let (mut a, _) = pair(u32::MAX - 1, 3, 16, 16);
        // A sent its Hello (u32::MAX - 1) and two more: u32::MAX and 0.
        a.next_header(Mid::Data, Ext::None, BsdhFlags::empty(), 1, 16);
        a.next_header(Mid::Data, Ext::None, BsdhFlags::empty(), 1, 16);
        assert_eq!(a.last_sent_mseq(), 0);
        // An ack of message 1 (never sent) reads as 2^32 - 1 messages unacknowledged.
        let mut x = a.clone();
        assert_eq!(
            x.on_bsdh(&bsdh(Mid::Data, 16, 4, 1)),
            Err(ProtocolError::BadAck { mseq_ack: 1 })
        );
        // Acking u32::MAX leaves one (0) in flight: 1 buffer announced is 0 credits, fine ...
        let mut x = a.clone();
        x.on_bsdh(&bsdh(Mid::Data, 1, 4, u32::MAX)).unwrap();
        assert_eq!(x.tx(), 0);
        // ... 0 buffers announced with one in flight is impossible.
        let mut x = a.clone();
        assert_eq!(
            x.on_bsdh(&bsdh(Mid::Data, 0, 4, u32::MAX)),
            Err(ProtocolError::BadCredits(-1))
        );
        // Acking the Hello only (u32::MAX - 1): two in flight.
        let mut x = a.clone();
        x.on_bsdh(&bsdh(Mid::Data, 10, 4, u32::MAX - 1)).unwrap();
        assert_eq!(x.tx(), 8);
    }

    #[test]
    fn peer_left_is_exact_across_the_wrap() {
        for isn in [0, u32::MAX - 1, u32::MAX, u32::MAX - 3] {
            let (mut a, mut b) = pair(isn, isn, 8, 8);
            // A announces 8 receives in its Hello; B sends 4 messages without hearing from A:
            // after each, A knows exactly how many of A's receives B still has.
            for left in (4..8).rev() {
                send(&mut b, &mut a, 8).unwrap();
                assert_eq!(a.peer_left(), left, "isn {isn}");
            }
            assert!(!a.peer_at_last_data_credit());
            send(&mut b, &mut a, 8).unwrap();
            assert_eq!(a.peer_left(), 3);
            assert!(a.peer_at_last_data_credit());
            // A answers announcing 8 again; B's next message acks it: 7 left.
            send(&mut a, &mut b, 8).unwrap();
            send(&mut b, &mut a, 8).unwrap();
            assert_eq!(a.peer_left(), 7, "isn {isn}");
        }
    }

    #[test]
    fn peer_left_uses_the_message_the_peer_acked_across_the_wrap() {
        let (mut a, mut b) = pair(u32::MAX - 2, 0, 8, 8);
        // A sends u32::MAX - 1, u32::MAX, 0 and 1, announcing 10, 11, 12 and 13 receives; B
        // has seen only the first two when it sends.
        let hs: Vec<Header> = (10..14)
            .map(|bufs| a.next_header(Mid::Data, Ext::None, BsdhFlags::empty(), 1, bufs))
            .collect();
        b.on_bsdh(&hs[0].bsdh).unwrap();
        b.on_bsdh(&hs[1].bsdh).unwrap();
        let h = b.next_header(Mid::Data, Ext::None, BsdhFlags::empty(), 1, 8);
        assert_eq!(h.bsdh.mseq_ack, u32::MAX);
        a.on_bsdh(&h.bsdh).unwrap();
        // B had A's 11 after A's u32::MAX, less the one it just used.
        assert_eq!(a.peer_left(), 10);
        // Two of A's in flight: 8 announced, 6 credits.
        assert_eq!(a.tx(), 6);
    }

    #[test]
    fn credit_update_is_due_when_the_peer_starves_for_what_it_wants() {
        let (mut a, mut b) = pair(u32::MAX, u32::MAX, 8, 8);
        // B knows A has 8; A's receives are 8: nothing to tell.
        assert!(!b.update_due(8));
        // A streams: after 5 Data messages B thinks A has 3 < DATA_CREDITS, and B has 8 posted.
        for _ in 0..5 {
            send(&mut a, &mut b, 8).unwrap();
        }
        assert_eq!(b.peer(), 3);
        assert!(b.update_due(8));
        // Not when B has no receive A does not know of.
        assert!(!b.update_due(3));
        // A peer that last sent a control message needs only CTRL_CREDITS.
        let h = a.next_header(Mid::RdmaRdCompl, Ext::None, BsdhFlags::empty(), 0, 8);
        b.on_bsdh(&h.bsdh).unwrap();
        assert_eq!(b.peer(), 2);
        assert!(!b.update_due(4), "2 credits, 4 posted: half are known");
        assert!(
            b.update_due(5),
            "2 credits, 5 posted: fewer than half are known"
        );
    }
}
