//! The tunables of a connection.

use std::time::Duration;

use super::credits::MIN_RX_POSTED;
use super::msgs;

/// Tunables of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Size of our receive buffers at start (what the peer may send in one message).
    pub rcv_size: u32,
    /// Largest receive buffer size a peer may ask for with ChRcvBuf.
    pub max_rcv_size: u32,
    /// Receive buffers posted at start (slow start begins here; never fewer than
    /// `MIN_RX_POSTED`, 5, are posted).
    pub initial_rx_bufs: u32,
    /// Fewest receive buffers kept posted when idle (never fewer than `MIN_RX_POSTED`).
    pub min_rx_bufs: u32,
    /// Receive buffers posted plus held with unread data, at most (SO_RCVBUF / buffer size; at
    /// least 5: a peer needs four credits to send data, see `DATA_CREDITS`).
    pub max_rx_bufs: u32,
    /// Bytes the application may have queued and unacknowledged on the send side (SO_SNDBUF).
    pub sndbuf: usize,
    /// SO_RCVBUF: receive buffer bytes (posted plus holding unread data) a connection may
    /// have, within `max_rx_bufs`; `None`: `max_rx_bufs` buffers.
    pub rcvbuf: Option<usize>,
    /// Sends of at least this many bytes go by zero copy (SrcAvail) when the caller offers
    /// registered memory.
    pub zcopy_threshold: usize,
    /// How a zero-copy send travels: `Some(true)` as Data messages whose payload the HCA
    /// gathers straight from the registered source (no copy here, the peer copies out of its
    /// receive buffers, no round trip), `Some(false)` by SrcAvail + the peer's RDMA Read (no
    /// copy at either end). `None`: the provider decides (`Provider::prefers_send_gather`;
    /// the driver fills it in). A peer's SinkAvail is filled by RDMA Write either way.
    pub zcopy_by_send: Option<bool>,
    /// Split zero copy between the two ends (with `zcopy_by_send` only): a source that fits
    /// one bounce buffer goes by SrcAvail + the peer's RDMA Read whenever no such advertisement
    /// is outstanding, and the sources behind it go on as gathered SENDs at once. On a software
    /// device the packet work of a SEND runs on the sender's CPU and that of an RDMA Read on the
    /// reader's, so both CPUs work on one stream. The peer reads such an advertisement at once
    /// and in full (into a bounce buffer), so it is never cancelled. `None`: with
    /// `zcopy_by_send` where the provider suits it (`Provider::prefers_split_zcopy`; the
    /// driver fills it in).
    pub zcopy_split: Option<bool>,
    /// The transport requires the connecting side to send the first message (iWARP's MPA, RFC
    /// 5044; RFC 6581 added a ready-to-receive handshake for the other order, which the CM does
    /// not use here): the connecting side sends a credit update as soon as it is connected, and
    /// the accepting side posts no send (a message, an RDMA Read or Write) until its first
    /// receive completes. Otherwise a peer's early message reaches the connecting side while it
    /// still reads the CM's reply and its kernel fails the connection (siw: "peer sent extra
    /// data", EPROTO). `None`: the provider decides (`Provider::initiator_sends_first`; the
    /// driver fills it in).
    pub initiator_sends_first: Option<bool>,
    /// Split zero copy: committed advertisements outstanding at once (at least 1; also bounded
    /// by the SrcAvail window; default 3). More hands the reader's CPU a larger share.
    pub zcopy_split_reads: u8,
    /// Split zero copy: sources (or pieces) sent by gathered SEND and not yet completed, at
    /// most (0: no bound beyond the credits; default 2). A bound keeps the sender from handing every
    /// queued piece to SEND while the reads are out, so the next piece goes to whichever path
    /// frees first and the two ends' CPUs share the stream by their rates.
    pub zcopy_split_sends: u8,
    /// Disable coalescing of small writes while a send is outstanding (TCP_NODELAY).
    pub nodelay: bool,
    /// Writes that go at once go as inline SENDs where the provider takes them
    /// (`Conn::write_inline`; the driver asks the endpoint); off: every write is copied into
    /// a send buffer first.
    pub inline_sends: bool,
    /// Peer advertisements (SrcAvail/SinkAvail) we accept outstanding at once.
    pub max_adverts: u8,
    /// Our SrcAvails outstanding at once (pipelined zero copy): the data source advertises the
    /// next queued zero-copy send while the peer still reads earlier ones. Bounded further by
    /// `max_adverts` and by the peer's `max_adverts` from its Hello/HelloAck. 1 waits for each
    /// advertisement to finish before the next (a round trip per zero-copy send).
    pub max_srcavail_inflight: u8,
    /// Idle time before keepalive probes start; `None` disables keepalive.
    pub keepalive_idle: Option<Duration>,
    /// Interval between keepalive probes.
    pub keepalive_interval: Duration,
    /// Failed probes (no completion within the interval) before the peer is declared dead.
    pub keepalive_probes: u32,
    /// Connection setup must finish within this.
    pub connect_timeout: Duration,
    /// After close with data still queued, keep sending this long before aborting.
    pub linger: Duration,
    /// How long an orderly disconnect may take before the connection is torn down.
    pub disconnect_timeout: Duration,
    /// A SrcAvail not fully read by the peer within this is cancelled (SrcAvailCancel) and the
    /// rest goes by BCopy.
    pub srcavail_timeout: Duration,
    /// A connection without traffic this long shrinks its buffers (slow start starts over).
    pub idle_shrink: Duration,
    /// Receive buffers a connection waiting in a listen queue posts plus holds with unread
    /// data, at most (within `min_rx_bufs..=max_rx_bufs`); it posts `min_rx_bufs` at a time
    /// and does not grow until the application accepts it. The default, 12 of `rcv_size`,
    /// holds 8 messages (256 KiB, what a TCP socket not yet accepted takes and then some: its
    /// initial receive buffer is 128 KiB on Linux) and leaves the peer the credits it keeps
    /// back for control messages (`DATA_CREDITS` - 1) and its DisConn: a client may write a
    /// request, or write and exit, before the server accepts, and loses nothing
    /// (docs/providers.md, "Listen backlog").
    pub unaccepted_rx_bufs: u32,
    /// A connection a listener set up and the application did not accept within this is
    /// aborted (its peer sees a reset) and its resources freed (docs/providers.md, "Listen
    /// backlog"). `None` (the default): it waits until accepted or the listener closes, as
    /// a TCP connection in the accept queue (the backlog bounds what waiting connections
    /// hold, as it bounds TCP's).
    pub unaccepted_timeout: Option<Duration>,
    /// Sends (messages, RDMA Reads and Writes) outstanding with no completion for this long
    /// fail the connection with `TimedOut` (checked by the driver). A healthy RC QP completes
    /// or errors within its retry budget (seconds); this bounds a device whose QPs hang
    /// instead (Soft-RoCE after a link flap). `None` (the default): no bound, as over shm,
    /// where a stopped peer holds sends legitimately.
    pub send_stall_timeout: Option<Duration>,
    /// Plain writes of at least this many bytes that fit the send buffer are staged (BZCopy):
    /// copied once into a registered buffer of the connection's own, which the peer reads by
    /// RDMA Read straight into its reader's memory, instead of going as Data messages the
    /// peer copies out of its receive buffers (what a peer leaves unread past
    /// `srcavail_timeout` goes as Data after all). The write returns once the bytes are
    /// staged, as a TCP write returns once its bytes are in the send buffer. `Some(0)`:
    /// never. `None`: the provider decides (`Provider::staged_send_min`; the driver fills it
    /// in).
    pub staged_send_min: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            rcv_size: 32 * 1024,
            max_rcv_size: 256 * 1024,
            initial_rx_bufs: 4,
            min_rx_bufs: 2,
            max_rx_bufs: 64,
            sndbuf: 4 << 20,
            rcvbuf: None,
            zcopy_threshold: 64 * 1024,
            zcopy_by_send: None,
            zcopy_split: None,
            initiator_sends_first: None,
            zcopy_split_reads: 3,
            zcopy_split_sends: 2,
            nodelay: false,
            inline_sends: true,
            max_adverts: 8,
            max_srcavail_inflight: 4,
            keepalive_idle: None,
            keepalive_interval: Duration::from_secs(1),
            keepalive_probes: 3,
            connect_timeout: Duration::from_secs(10),
            linger: Duration::from_secs(30),
            disconnect_timeout: Duration::from_secs(5),
            srcavail_timeout: Duration::from_secs(2),
            idle_shrink: Duration::from_secs(1),
            unaccepted_rx_bufs: 12,
            unaccepted_timeout: None,
            send_stall_timeout: None,
            staged_send_min: None,
        }
    }
}

impl Config {
    /// Check the values are usable; the error names the field.
    pub fn validate(&self) -> Result<(), &'static str> {
        let ok_size = |s: u32| (msgs::MIN_RCV_SIZE..=msgs::MAX_RCV_SIZE).contains(&s);
        if !ok_size(self.rcv_size) {
            return Err("rcv_size");
        }
        if !ok_size(self.max_rcv_size) || self.max_rcv_size < self.rcv_size {
            return Err("max_rcv_size");
        }
        if self.min_rx_bufs < 2 || self.initial_rx_bufs < self.min_rx_bufs {
            return Err("initial_rx_bufs/min_rx_bufs");
        }
        if self.max_rx_bufs < self.initial_rx_bufs
            || self.max_rx_bufs < MIN_RX_POSTED
            || self.max_rx_bufs > u16::MAX as u32
        {
            return Err("max_rx_bufs");
        }
        if self.sndbuf == 0 {
            return Err("sndbuf");
        }
        if self.zcopy_threshold == 0 {
            return Err("zcopy_threshold");
        }
        if self.max_adverts == 0 {
            return Err("max_adverts");
        }
        if self.max_srcavail_inflight == 0 {
            return Err("max_srcavail_inflight");
        }
        Ok(())
    }
}
