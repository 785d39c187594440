//! SDP wire messages (InfiniBand Architecture, Annex A4), parsed and emitted with checks.
//!
//! Two levels, in the style of smoltcp's `wire` module:
//!
//! * [`Packet`] is a view over a byte buffer with field accessors and setters. After
//!   [`Packet::new_checked`] (or a successful [`Packet::check_len`]) no accessor panics.
//! * [`Header`] is the parsed representation (BSDH + extended header). [`Header::parse`] takes the
//!   exact bytes of one received message and either returns a header that satisfies every rule
//!   of the protocol or a typed [`WireError`]; it never panics, whatever the bytes.
//!   [`Header::emit`] writes a header and refuses (with the same typed errors) to write one that
//!   [`Header::parse`] would reject, so every emitted message parses back to the same header.
//!
//! Every byte of every header is either a field or a reserved field that must be zero, so the
//! encoding is canonical: if `parse(bytes)` succeeds, `emit` of the result reproduces `bytes`.
//!
//! The Hello and HelloAck are *compact* forms that fit the private data of an `RDMA_PS_TCP`
//! connection; see `docs/protocol.md` for the layouts and why they deviate from the spec.

use bitflags::bitflags;

/// Length of the Base Sockets Direct Header.
pub const BSDH_LEN: usize = 16;
/// Smallest receive buffer size a peer may negotiate or request (Hello, HelloAck, ChRcvBuf).
pub const MIN_RCV_SIZE: u32 = 1024;
/// Largest receive buffer size a peer may negotiate or request (Hello, HelloAck, ChRcvBuf).
pub const MAX_RCV_SIZE: u32 = 1 << 20;
/// The SDP version this implementation speaks: major 2, minor 2 (high nibble major).
pub const SDP_VERSION: u8 = 0x22;
/// The only SDP major version accepted from a peer (high nibble of the version byte).
pub const SDP_MAJOR_VERSION: u8 = 2;
/// Total length of the compact Hello message (BSDH + 16).
pub const HELLO_LEN: usize = BSDH_LEN + 16;
/// Total length of the compact HelloAck message (BSDH + 12).
pub const HELLO_ACK_LEN: usize = BSDH_LEN + 12;
/// Length of the longest header (SinkAvail: BSDH + 20).
pub const MAX_HEADER_LEN: usize = BSDH_LEN + 20;
/// Bytes of REQ private data left to the consumer under `RDMA_PS_TCP` on IB/RoCE
/// ([`crate::verbs::MAX_PRIVATE_DATA_CONNECT`]). The compact Hello must fit in it.
pub use crate::verbs::MAX_PRIVATE_DATA_CONNECT as TCP_PS_REQ_PRIVATE_DATA_LEN;

// The compact Hello must fit the private data left under RDMA_PS_TCP.
const _: () = assert!(HELLO_LEN <= TCP_PS_REQ_PRIVATE_DATA_LEN);

/// Message identifier (first byte of the BSDH).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Mid {
    Hello = 0x00,
    HelloAck = 0x01,
    DisConn = 0x02,
    AbortConn = 0x03,
    SendSm = 0x04,
    RdmaWrCompl = 0x05,
    RdmaRdCompl = 0x06,
    ModeChange = 0x07,
    SrcAvailCancel = 0x08,
    SinkAvailCancel = 0x09,
    SinkCancelAck = 0x0A,
    ChRcvBuf = 0x0B,
    ChRcvBufAck = 0x0C,
    SuspComm = 0x0D,
    SuspCommAck = 0x0E,
    SinkAvail = 0xFD,
    SrcAvail = 0xFE,
    Data = 0xFF,
}

impl Mid {
    /// Every message identifier, in wire-value order.
    pub const ALL: [Mid; 18] = [
        Mid::Hello,
        Mid::HelloAck,
        Mid::DisConn,
        Mid::AbortConn,
        Mid::SendSm,
        Mid::RdmaWrCompl,
        Mid::RdmaRdCompl,
        Mid::ModeChange,
        Mid::SrcAvailCancel,
        Mid::SinkAvailCancel,
        Mid::SinkCancelAck,
        Mid::ChRcvBuf,
        Mid::ChRcvBufAck,
        Mid::SuspComm,
        Mid::SuspCommAck,
        Mid::SinkAvail,
        Mid::SrcAvail,
        Mid::Data,
    ];

    /// Extended-header bytes that follow the BSDH for this mid.
    pub const fn ext_len(self) -> usize {
        match self {
            Mid::Hello => HELLO_LEN - BSDH_LEN,
            Mid::HelloAck => HELLO_ACK_LEN - BSDH_LEN,
            Mid::SrcAvail => 16,
            Mid::SinkAvail => 20,
            Mid::RdmaWrCompl | Mid::RdmaRdCompl => 4,
            Mid::ChRcvBuf | Mid::ChRcvBufAck => 4,
            Mid::SuspComm => 8,
            Mid::ModeChange => 4,
            Mid::DisConn
            | Mid::AbortConn
            | Mid::SendSm
            | Mid::SrcAvailCancel
            | Mid::SinkAvailCancel
            | Mid::SinkCancelAck
            | Mid::SuspCommAck
            | Mid::Data => 0,
        }
    }

    /// BSDH + extended header bytes for this mid.
    pub const fn header_len(self) -> usize {
        BSDH_LEN + self.ext_len()
    }

    /// Whether messages with this mid may carry payload after the header (only Data).
    pub const fn carries_payload(self) -> bool {
        matches!(self, Mid::Data)
    }
}

impl TryFrom<u8> for Mid {
    type Error = WireError;

    fn try_from(value: u8) -> Result<Self, Self::Error> {
        Ok(match value {
            0x00 => Mid::Hello,
            0x01 => Mid::HelloAck,
            0x02 => Mid::DisConn,
            0x03 => Mid::AbortConn,
            0x04 => Mid::SendSm,
            0x05 => Mid::RdmaWrCompl,
            0x06 => Mid::RdmaRdCompl,
            0x07 => Mid::ModeChange,
            0x08 => Mid::SrcAvailCancel,
            0x09 => Mid::SinkAvailCancel,
            0x0A => Mid::SinkCancelAck,
            0x0B => Mid::ChRcvBuf,
            0x0C => Mid::ChRcvBufAck,
            0x0D => Mid::SuspComm,
            0x0E => Mid::SuspCommAck,
            0xFD => Mid::SinkAvail,
            0xFE => Mid::SrcAvail,
            0xFF => Mid::Data,
            other => return Err(WireError::UnknownMid(other)),
        })
    }
}

impl From<Mid> for u8 {
    fn from(mid: Mid) -> u8 {
        mid as u8
    }
}

/// Extended-header bytes for a mid (same as [`Mid::ext_len`]).
pub fn ext_len(mid: Mid) -> usize {
    mid.ext_len()
}

bitflags! {
    /// BSDH flags. Bits other than these are reserved and must be zero.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct BsdhFlags: u8 {
        /// Out-of-band data present: the last byte of this message's data is urgent data.
        const OOB_PRES = 0x01;
        /// Out-of-band data pending: urgent data is on its way.
        const OOB_PEND = 0x02;
        /// Request to switch the data source to Pipelined mode.
        const REQ_PIPE = 0x04;
    }
}

/// Base Sockets Direct Header, 16 bytes big-endian: mid u8, flags u8, bufs u16, len u32,
/// mseq u32, mseq_ack u32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bsdh {
    pub mid: Mid,
    pub flags: BsdhFlags,
    /// Receive buffers the sender has posted beyond mseq_ack (credit advertisement).
    pub bufs: u16,
    /// Total message length: BSDH + extended header + payload.
    pub len: u32,
    /// Sequence number of this message.
    pub mseq: u32,
    /// Sequence number of the last message received from the peer.
    pub mseq_ack: u32,
}

/// Compact Hello (fits the 56 bytes of private data left under `RDMA_PS_TCP`): BSDH + version u8,
/// ip_version u8 (4 or 6), max_adverts u8, reserved u8 (0), desired_rcv_size u32 (what we want the
/// peer's receive buffers to be), local_rcv_size u32 (our receive buffer size), src_port u16,
/// reserved u16 (0). Total 32 bytes. Addresses come from the CM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Hello {
    pub version: u8,
    pub ip_version: u8,
    pub max_adverts: u8,
    pub desired_rcv_size: u32,
    pub local_rcv_size: u32,
    pub src_port: u16,
}

/// Compact HelloAck: BSDH + version u8, reserved u8, max_adverts u8, reserved u8, actual_rcv_size
/// u32 (our receive buffer size), desired_rcv_size u32. Total 28 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HelloAck {
    pub version: u8,
    pub max_adverts: u8,
    pub actual_rcv_size: u32,
    pub desired_rcv_size: u32,
}

/// Extended header following the BSDH, determined by the mid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ext {
    /// DisConn, AbortConn, SendSm, Data, SrcAvailCancel, SinkAvailCancel, SinkCancelAck,
    /// SuspCommAck.
    None,
    Hello(Hello),
    HelloAck(HelloAck),
    /// 16 bytes.
    SrcAvail {
        len: u32,
        rkey: u32,
        vaddr: u64,
    },
    /// 20 bytes.
    SinkAvail {
        len: u32,
        rkey: u32,
        vaddr: u64,
        non_disc: u32,
    },
    /// 4 bytes.
    RdmaRdCompl {
        len: u32,
    },
    /// 4 bytes.
    RdmaWrCompl {
        len: u32,
    },
    /// 4 bytes.
    ChRcvBuf {
        size: u32,
    },
    /// 4 bytes.
    ChRcvBufAck {
        size: u32,
    },
    /// 8 bytes.
    SuspComm {
        service_id: u64,
    },
    /// 4 bytes on the wire: flags u8 + 3 reserved (0). The flags are passed through uninterpreted.
    ModeChange {
        flags: u8,
    },
}

impl Ext {
    /// Whether this extended header is the one `mid` carries.
    pub const fn fits(&self, mid: Mid) -> bool {
        matches!(
            (mid, self),
            (
                Mid::DisConn
                    | Mid::AbortConn
                    | Mid::SendSm
                    | Mid::Data
                    | Mid::SrcAvailCancel
                    | Mid::SinkAvailCancel
                    | Mid::SinkCancelAck
                    | Mid::SuspCommAck,
                Ext::None
            ) | (Mid::Hello, Ext::Hello(_))
                | (Mid::HelloAck, Ext::HelloAck(_))
                | (Mid::SrcAvail, Ext::SrcAvail { .. })
                | (Mid::SinkAvail, Ext::SinkAvail { .. })
                | (Mid::RdmaRdCompl, Ext::RdmaRdCompl { .. })
                | (Mid::RdmaWrCompl, Ext::RdmaWrCompl { .. })
                | (Mid::ChRcvBuf, Ext::ChRcvBuf { .. })
                | (Mid::ChRcvBufAck, Ext::ChRcvBufAck { .. })
                | (Mid::SuspComm, Ext::SuspComm { .. })
                | (Mid::ModeChange, Ext::ModeChange { .. })
        )
    }

    /// Parse the extended header of a `mid` message from `bytes` (the bytes after the BSDH).
    /// Checks completeness and reserved fields only; value ranges are [`Header::validate`]'s.
    pub fn parse(mid: Mid, bytes: &[u8]) -> Result<Ext, WireError> {
        let mut r = Reader::new(bytes, BSDH_LEN);
        let ext = match mid {
            Mid::DisConn
            | Mid::AbortConn
            | Mid::SendSm
            | Mid::Data
            | Mid::SrcAvailCancel
            | Mid::SinkAvailCancel
            | Mid::SinkCancelAck
            | Mid::SuspCommAck => Ext::None,
            Mid::Hello => {
                let version = r.u8()?;
                let ip_version = r.u8()?;
                let max_adverts = r.u8()?;
                reserved_zero("Hello.reserved1", r.u8()?.into())?;
                let desired_rcv_size = r.u32()?;
                let local_rcv_size = r.u32()?;
                let src_port = r.u16()?;
                reserved_zero("Hello.reserved2", r.u16()?.into())?;
                Ext::Hello(Hello {
                    version,
                    ip_version,
                    max_adverts,
                    desired_rcv_size,
                    local_rcv_size,
                    src_port,
                })
            }
            Mid::HelloAck => {
                let version = r.u8()?;
                reserved_zero("HelloAck.reserved1", r.u8()?.into())?;
                let max_adverts = r.u8()?;
                reserved_zero("HelloAck.reserved2", r.u8()?.into())?;
                let actual_rcv_size = r.u32()?;
                let desired_rcv_size = r.u32()?;
                Ext::HelloAck(HelloAck {
                    version,
                    max_adverts,
                    actual_rcv_size,
                    desired_rcv_size,
                })
            }
            Mid::SrcAvail => Ext::SrcAvail {
                len: r.u32()?,
                rkey: r.u32()?,
                vaddr: r.u64()?,
            },
            Mid::SinkAvail => Ext::SinkAvail {
                len: r.u32()?,
                rkey: r.u32()?,
                vaddr: r.u64()?,
                non_disc: r.u32()?,
            },
            Mid::RdmaRdCompl => Ext::RdmaRdCompl { len: r.u32()? },
            Mid::RdmaWrCompl => Ext::RdmaWrCompl { len: r.u32()? },
            Mid::ChRcvBuf => Ext::ChRcvBuf { size: r.u32()? },
            Mid::ChRcvBufAck => Ext::ChRcvBufAck { size: r.u32()? },
            Mid::SuspComm => Ext::SuspComm {
                service_id: r.u64()?,
            },
            Mid::ModeChange => {
                let flags = r.u8()?;
                let rsvd: [u8; 3] = r.array()?;
                if rsvd != [0; 3] {
                    return Err(WireError::ReservedNonZero {
                        field: "ModeChange.reserved",
                    });
                }
                Ext::ModeChange { flags }
            }
        };
        Ok(ext)
    }

    /// Write this extended header into `bytes` (the bytes after the BSDH); returns the bytes
    /// written. Reserved fields are written as zero.
    pub fn emit(&self, bytes: &mut [u8]) -> Result<usize, WireError> {
        let mut w = Writer::new(bytes, BSDH_LEN);
        match *self {
            Ext::None => {}
            Ext::Hello(h) => {
                w.put(&[h.version, h.ip_version, h.max_adverts, 0])?;
                w.put(&h.desired_rcv_size.to_be_bytes())?;
                w.put(&h.local_rcv_size.to_be_bytes())?;
                w.put(&h.src_port.to_be_bytes())?;
                w.put(&[0, 0])?;
            }
            Ext::HelloAck(h) => {
                w.put(&[h.version, 0, h.max_adverts, 0])?;
                w.put(&h.actual_rcv_size.to_be_bytes())?;
                w.put(&h.desired_rcv_size.to_be_bytes())?;
            }
            Ext::SrcAvail { len, rkey, vaddr } => {
                w.put(&len.to_be_bytes())?;
                w.put(&rkey.to_be_bytes())?;
                w.put(&vaddr.to_be_bytes())?;
            }
            Ext::SinkAvail {
                len,
                rkey,
                vaddr,
                non_disc,
            } => {
                w.put(&len.to_be_bytes())?;
                w.put(&rkey.to_be_bytes())?;
                w.put(&vaddr.to_be_bytes())?;
                w.put(&non_disc.to_be_bytes())?;
            }
            Ext::RdmaRdCompl { len } | Ext::RdmaWrCompl { len } => w.put(&len.to_be_bytes())?,
            Ext::ChRcvBuf { size } | Ext::ChRcvBufAck { size } => w.put(&size.to_be_bytes())?,
            Ext::SuspComm { service_id } => w.put(&service_id.to_be_bytes())?,
            Ext::ModeChange { flags } => w.put(&[flags, 0, 0, 0])?,
        }
        Ok(w.pos)
    }
}

/// A parsed message header (BSDH + extended header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Header {
    pub bsdh: Bsdh,
    pub ext: Ext,
}

impl Header {
    /// Parse one complete received message (exactly the bytes the receive completion reported).
    ///
    /// Checks, in this order: length >= 16 ([`WireError::Truncated`]); known mid
    /// ([`WireError::UnknownMid`]); the extended header for the mid is complete
    /// ([`WireError::Truncated`]); reserved flag bits zero ([`WireError::ReservedFlags`]);
    /// `bsdh.len == buf.len()` ([`WireError::LengthMismatch`]); messages other than Data carry no
    /// payload ([`WireError::UnexpectedPayload`]); reserved fields zero
    /// ([`WireError::ReservedNonZero`]); then the value rules of [`Header::validate`].
    /// Returns the header and the payload slice (empty except for Data).
    pub fn parse(buf: &[u8]) -> Result<(Header, &[u8]), WireError> {
        let header = Header::parse_packet(&Packet::new_unchecked(buf))?;
        let payload = buf.get(header.header_len()..).unwrap_or(&[]);
        Ok((header, payload))
    }

    /// Parse the header of a message viewed through a [`Packet`] (the buffer is the whole
    /// message). Runs [`Packet::check_len`] itself, so an unchecked packet is fine.
    pub fn parse_packet<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<Header, WireError> {
        packet.check_len()?;
        let mid = packet.mid()?;
        let flags = packet.flags()?;
        let actual = packet.buffer.as_ref().len();
        let claimed = packet.msg_len();
        if usize::try_from(claimed).ok() != Some(actual) {
            return Err(WireError::LengthMismatch { claimed, actual });
        }
        let header_len = mid.header_len();
        if !mid.carries_payload() && actual > header_len {
            return Err(WireError::UnexpectedPayload {
                mid,
                len: actual - header_len,
            });
        }
        let ext = Ext::parse(mid, packet.ext())?;
        let header = Header {
            bsdh: Bsdh {
                mid,
                flags,
                bufs: packet.bufs(),
                len: claimed,
                mseq: packet.mseq(),
                mseq_ack: packet.mseq_ack(),
            },
            ext,
        };
        header.validate()?;
        Ok(header)
    }

    /// Parse a Hello or HelloAck from CM private data. The CM may pad private data with trailing
    /// bytes beyond `bsdh.len`; they are ignored. Requires `buf.len() >= bsdh.len` and mid Hello
    /// or HelloAck ([`WireError::UnexpectedMid`] otherwise); `buf[..bsdh.len]` must then pass
    /// [`Header::parse`].
    pub fn parse_private_data(buf: &[u8]) -> Result<Header, WireError> {
        let packet = Packet::new_unchecked(buf);
        if buf.len() < BSDH_LEN {
            return Err(WireError::Truncated {
                need: BSDH_LEN,
                have: buf.len(),
            });
        }
        let mid = packet.mid()?;
        if !matches!(mid, Mid::Hello | Mid::HelloAck) {
            return Err(WireError::UnexpectedMid(mid));
        }
        let claimed = packet.msg_len();
        let message = usize::try_from(claimed)
            .ok()
            .and_then(|n| buf.get(..n))
            .ok_or(WireError::Truncated {
                need: usize::try_from(claimed).unwrap_or(usize::MAX),
                have: buf.len(),
            })?;
        Header::parse(message).map(|(header, _)| header)
    }

    /// Check the value rules a well-formed header obeys (run by both [`Header::parse`] and
    /// [`Header::emit`]): the ext variant fits the mid; no reserved flag bits; `bsdh.len` is at
    /// least the header length and, except for Data, exactly it; Hello/HelloAck version major 2;
    /// Hello ip_version 4 or 6; Hello/HelloAck/ChRcvBuf/ChRcvBufAck sizes within
    /// `MIN_RCV_SIZE..=MAX_RCV_SIZE`; SrcAvail/SinkAvail/RdmaRdCompl/RdmaWrCompl len > 0.
    pub fn validate(&self) -> Result<(), WireError> {
        let mid = self.bsdh.mid;
        if !self.ext.fits(mid) {
            return Err(WireError::ExtMismatch);
        }
        if !BsdhFlags::all().contains(self.bsdh.flags) {
            return Err(WireError::ReservedFlags(self.bsdh.flags.bits()));
        }
        let header_len = self.header_len();
        let len = usize::try_from(self.bsdh.len).unwrap_or(usize::MAX);
        if len < header_len {
            return Err(WireError::LengthMismatch {
                claimed: self.bsdh.len,
                actual: header_len,
            });
        }
        if !mid.carries_payload() && len > header_len {
            return Err(WireError::UnexpectedPayload {
                mid,
                len: len - header_len,
            });
        }
        match self.ext {
            Ext::None | Ext::SuspComm { .. } | Ext::ModeChange { .. } => {}
            Ext::Hello(h) => {
                check_version(h.version)?;
                if h.ip_version != 4 && h.ip_version != 6 {
                    return Err(WireError::OutOfRange {
                        field: "Hello.ip_version",
                        value: h.ip_version.into(),
                    });
                }
                check_rcv_size("Hello.desired_rcv_size", h.desired_rcv_size)?;
                check_rcv_size("Hello.local_rcv_size", h.local_rcv_size)?;
            }
            Ext::HelloAck(h) => {
                check_version(h.version)?;
                check_rcv_size("HelloAck.actual_rcv_size", h.actual_rcv_size)?;
                check_rcv_size("HelloAck.desired_rcv_size", h.desired_rcv_size)?;
            }
            Ext::SrcAvail { len, .. } => check_nonzero("SrcAvail.len", len)?,
            Ext::SinkAvail { len, .. } => check_nonzero("SinkAvail.len", len)?,
            Ext::RdmaRdCompl { len } => check_nonzero("RdmaRdCompl.len", len)?,
            Ext::RdmaWrCompl { len } => check_nonzero("RdmaWrCompl.len", len)?,
            Ext::ChRcvBuf { size } => check_rcv_size("ChRcvBuf.size", size)?,
            Ext::ChRcvBufAck { size } => check_rcv_size("ChRcvBufAck.size", size)?,
        }
        Ok(())
    }

    /// Bytes of BSDH + extended header for this mid.
    pub fn header_len(&self) -> usize {
        self.bsdh.mid.header_len()
    }

    /// Payload bytes that follow the header according to `bsdh.len` (0 if `len` is shorter than
    /// the header).
    pub fn payload_len(&self) -> usize {
        usize::try_from(self.bsdh.len)
            .unwrap_or(usize::MAX)
            .saturating_sub(self.header_len())
    }

    /// Write the header into `buf[..header_len()]` (`bsdh.len` is written as given: the caller
    /// sets it to header_len + payload length). Returns the bytes written.
    ///
    /// Errors: [`WireError::Truncated`] if `buf` is too short; any error of
    /// [`Header::validate`] (e.g. [`WireError::ExtMismatch`]) for a header that
    /// [`Header::parse`] would reject. Never panics; on error nothing is written.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        self.validate()?;
        let header_len = self.header_len();
        let have = buf.len();
        let out = buf.get_mut(..header_len).ok_or(WireError::Truncated {
            need: header_len,
            have,
        })?;
        let mut w = Writer::new(out, 0);
        let b = &self.bsdh;
        w.put(&[b.mid.into(), b.flags.bits()])?;
        w.put(&b.bufs.to_be_bytes())?;
        w.put(&b.len.to_be_bytes())?;
        w.put(&b.mseq.to_be_bytes())?;
        w.put(&b.mseq_ack.to_be_bytes())?;
        let (_, ext) = out.split_at_mut(BSDH_LEN);
        Ok(BSDH_LEN + self.ext.emit(ext)?)
    }

    /// Convenience constructor: a header for `mid`/`ext` with len = header_len + payload_len and
    /// the given credit fields. (A length beyond `u32::MAX` saturates, and [`Header::emit`] of
    /// such a header to a non-Data mid fails; SDP payloads are at most [`MAX_RCV_SIZE`].)
    pub fn new(
        mid: Mid,
        ext: Ext,
        flags: BsdhFlags,
        bufs: u16,
        mseq: u32,
        mseq_ack: u32,
        payload_len: usize,
    ) -> Header {
        let len = u32::try_from(mid.header_len().saturating_add(payload_len)).unwrap_or(u32::MAX);
        Header {
            bsdh: Bsdh {
                mid,
                flags,
                bufs,
                len,
                mseq,
                mseq_ack,
            },
            ext,
        }
    }
}

fn reserved_zero(field: &'static str, value: u32) -> Result<(), WireError> {
    if value == 0 {
        Ok(())
    } else {
        Err(WireError::ReservedNonZero { field })
    }
}

fn check_version(version: u8) -> Result<(), WireError> {
    if version >> 4 == SDP_MAJOR_VERSION {
        Ok(())
    } else {
        Err(WireError::BadVersion(version))
    }
}

fn check_rcv_size(field: &'static str, size: u32) -> Result<(), WireError> {
    if (MIN_RCV_SIZE..=MAX_RCV_SIZE).contains(&size) {
        Ok(())
    } else {
        Err(WireError::OutOfRange {
            field,
            value: size.into(),
        })
    }
}

fn check_nonzero(field: &'static str, value: u32) -> Result<(), WireError> {
    if value > 0 {
        Ok(())
    } else {
        Err(WireError::OutOfRange { field, value: 0 })
    }
}

/// A typed error for a malformed message (parse) or a header that cannot be written (emit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the message (or the header being written) needs.
    #[error("message truncated: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    /// The mid byte names no SDP message.
    #[error("unknown SDP message id 0x{0:02x}")]
    UnknownMid(u8),
    /// Reserved BSDH flag bits are set (the value is the whole flags byte).
    #[error("reserved BSDH flag bits set in flags 0x{0:02x}")]
    ReservedFlags(u8),
    /// BSDH len disagrees with the bytes received (or is shorter than the header, on emit).
    #[error("BSDH length {claimed} does not match the message length {actual}")]
    LengthMismatch { claimed: u32, actual: usize },
    /// A message other than Data carries `len` payload bytes after its header.
    #[error("{mid:?} message carries {len} payload bytes; only Data may carry payload")]
    UnexpectedPayload { mid: Mid, len: usize },
    /// The extended-header variant does not fit the mid (emit).
    #[error("extended header variant does not match the message id")]
    ExtMismatch,
    /// A reserved field is not zero.
    #[error("reserved field {field} is not zero")]
    ReservedNonZero { field: &'static str },
    /// A field holds a value outside its allowed range.
    #[error("field {field} out of range: {value}")]
    OutOfRange { field: &'static str, value: u64 },
    /// The Hello/HelloAck version's major nibble is not 2.
    #[error("unsupported SDP version 0x{0:02x} (major version must be 2)")]
    BadVersion(u8),
    /// A valid message of a kind not allowed here (CM private data must be Hello or HelloAck).
    #[error("unexpected {0:?} message here")]
    UnexpectedMid(Mid),
}

mod field {
    use core::ops::Range;

    pub const MID: usize = 0;
    pub const FLAGS: usize = 1;
    pub const BUFS: Range<usize> = 2..4;
    pub const LEN: Range<usize> = 4..8;
    pub const MSEQ: Range<usize> = 8..12;
    pub const MSEQ_ACK: Range<usize> = 12..16;
}

/// A read/write view of one SDP message in a buffer (smoltcp style).
///
/// After [`Packet::new_checked`] (or a successful [`Packet::check_len`]) no accessor panics.
/// On a packet made with [`Packet::new_unchecked`], accessors of bytes beyond the buffer panic:
/// use `new_unchecked` only to emit into a buffer you sized yourself. Setters that change the mid
/// change what `check_len` requires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap a buffer without checks.
    pub const fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// Wrap a buffer, checking it holds a known mid and that mid's complete header.
    pub fn new_checked(buffer: T) -> Result<Packet<T>, WireError> {
        let packet = Packet::new_unchecked(buffer);
        packet.check_len()?;
        Ok(packet)
    }

    /// Ensure the accessors will not panic: the buffer holds a BSDH with a known mid and the
    /// whole extended header of that mid. (Only lengths and the mid; see [`Header::parse`] for
    /// validation.)
    pub fn check_len(&self) -> Result<(), WireError> {
        let have = self.buffer.as_ref().len();
        if have < BSDH_LEN {
            return Err(WireError::Truncated {
                need: BSDH_LEN,
                have,
            });
        }
        let need = self.mid()?.header_len();
        if have < need {
            return Err(WireError::Truncated { need, have });
        }
        Ok(())
    }

    /// The underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The raw mid byte.
    pub fn mid_raw(&self) -> u8 {
        self.buffer.as_ref()[field::MID]
    }

    /// The mid, or [`WireError::UnknownMid`].
    pub fn mid(&self) -> Result<Mid, WireError> {
        Mid::try_from(self.mid_raw())
    }

    /// The raw flags byte.
    pub fn flags_raw(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }

    /// The flags, or [`WireError::ReservedFlags`] if reserved bits are set.
    pub fn flags(&self) -> Result<BsdhFlags, WireError> {
        let raw = self.flags_raw();
        BsdhFlags::from_bits(raw).ok_or(WireError::ReservedFlags(raw))
    }

    /// The bufs (credits) field.
    pub fn bufs(&self) -> u16 {
        u16::from_be_bytes(array(&self.buffer.as_ref()[field::BUFS]))
    }

    /// The BSDH len field (claimed total message length).
    pub fn msg_len(&self) -> u32 {
        u32::from_be_bytes(array(&self.buffer.as_ref()[field::LEN]))
    }

    /// The mseq field.
    pub fn mseq(&self) -> u32 {
        u32::from_be_bytes(array(&self.buffer.as_ref()[field::MSEQ]))
    }

    /// The mseq_ack field.
    pub fn mseq_ack(&self) -> u32 {
        u32::from_be_bytes(array(&self.buffer.as_ref()[field::MSEQ_ACK]))
    }

    /// BSDH + extended header length for the mid (BSDH only for an unknown mid).
    pub fn header_len(&self) -> usize {
        self.mid().map_or(BSDH_LEN, Mid::header_len)
    }

    /// The extended-header bytes.
    pub fn ext(&self) -> &[u8] {
        &self.buffer.as_ref()[BSDH_LEN..self.header_len()]
    }

    /// The bytes after the header (for a received message: the payload).
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Set the mid byte.
    pub fn set_mid(&mut self, mid: Mid) {
        self.buffer.as_mut()[field::MID] = mid.into();
    }

    /// Set the flags byte.
    pub fn set_flags(&mut self, flags: BsdhFlags) {
        self.buffer.as_mut()[field::FLAGS] = flags.bits();
    }

    /// Set the bufs (credits) field.
    pub fn set_bufs(&mut self, bufs: u16) {
        self.buffer.as_mut()[field::BUFS].copy_from_slice(&bufs.to_be_bytes());
    }

    /// Set the BSDH len field.
    pub fn set_msg_len(&mut self, len: u32) {
        self.buffer.as_mut()[field::LEN].copy_from_slice(&len.to_be_bytes());
    }

    /// Set the mseq field.
    pub fn set_mseq(&mut self, mseq: u32) {
        self.buffer.as_mut()[field::MSEQ].copy_from_slice(&mseq.to_be_bytes());
    }

    /// Set the mseq_ack field.
    pub fn set_mseq_ack(&mut self, mseq_ack: u32) {
        self.buffer.as_mut()[field::MSEQ_ACK].copy_from_slice(&mseq_ack.to_be_bytes());
    }

    /// The extended-header bytes, mutable.
    pub fn ext_mut(&mut self) -> &mut [u8] {
        let end = self.header_len();
        &mut self.buffer.as_mut()[BSDH_LEN..end]
    }

    /// The bytes after the header, mutable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = self.header_len();
        &mut self.buffer.as_mut()[start..]
    }
}

/// Copy a slice whose length is known to be N into an array (zero-filled if it is not, which the
/// field ranges above rule out).
fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    if let Some(src) = bytes.get(..N) {
        out.copy_from_slice(src);
    }
    out
}

/// Bounds-checked big-endian reader; offsets in errors are relative to the message start.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    base: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], base: usize) -> Self {
        Reader { buf, pos: 0, base }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let end = self.pos.saturating_add(N);
        let bytes = self.buf.get(self.pos..end).ok_or(WireError::Truncated {
            need: self.base.saturating_add(end),
            have: self.base.saturating_add(self.buf.len()),
        })?;
        self.pos = end;
        Ok(array(bytes))
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        self.array::<1>().map(|[b]| b)
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        self.array().map(u16::from_be_bytes)
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        self.array().map(u32::from_be_bytes)
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        self.array().map(u64::from_be_bytes)
    }
}

/// Bounds-checked writer; offsets in errors are relative to the message start.
struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
    base: usize,
}

impl<'a> Writer<'a> {
    fn new(buf: &'a mut [u8], base: usize) -> Self {
        Writer { buf, pos: 0, base }
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), WireError> {
        let end = self.pos.saturating_add(bytes.len());
        let have = self.base.saturating_add(self.buf.len());
        let dst = self
            .buf
            .get_mut(self.pos..end)
            .ok_or(WireError::Truncated {
                need: self.base.saturating_add(end),
                have,
            })?;
        dst.copy_from_slice(bytes);
        self.pos = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F0: BsdhFlags = BsdhFlags::empty();

    /// A representative valid header for each mid (Data with `payload_len` 5).
    fn sample(mid: Mid) -> Header {
        let ext = match mid {
            Mid::Hello => Ext::Hello(Hello {
                version: SDP_VERSION,
                ip_version: 4,
                max_adverts: 3,
                desired_rcv_size: 64 * 1024,
                local_rcv_size: 32 * 1024,
                src_port: 40000,
            }),
            Mid::HelloAck => Ext::HelloAck(HelloAck {
                version: SDP_VERSION,
                max_adverts: 2,
                actual_rcv_size: 16 * 1024,
                desired_rcv_size: 8 * 1024,
            }),
            Mid::SrcAvail => Ext::SrcAvail {
                len: 70000,
                rkey: 0xdead_beef,
                vaddr: 0x0000_7f00_1234_5678,
            },
            Mid::SinkAvail => Ext::SinkAvail {
                len: 4096,
                rkey: 0x0102_0304,
                vaddr: 0x1122_3344_5566_7788,
                non_disc: 9,
            },
            Mid::RdmaRdCompl => Ext::RdmaRdCompl { len: 70000 },
            Mid::RdmaWrCompl => Ext::RdmaWrCompl { len: 4096 },
            Mid::ChRcvBuf => Ext::ChRcvBuf { size: 128 * 1024 },
            Mid::ChRcvBufAck => Ext::ChRcvBufAck { size: 96 * 1024 },
            Mid::SuspComm => Ext::SuspComm {
                service_id: 0x0000_0000_0001_1f90,
            },
            Mid::ModeChange => Ext::ModeChange { flags: 0x82 },
            _ => Ext::None,
        };
        let payload_len = if mid == Mid::Data { 5 } else { 0 };
        Header::new(mid, ext, BsdhFlags::OOB_PEND, 7, 100, 99, payload_len)
    }

    /// Emit `h` + payload, check the BSDH bytes, parse back, and return the wire bytes.
    fn roundtrip(mid: Mid) -> Vec<u8> {
        let h = sample(mid);
        assert_eq!(h.bsdh.mid, mid);
        let payload: &[u8] = if mid == Mid::Data { b"hello" } else { b"" };
        let mut buf = vec![0xAA; h.header_len() + payload.len()];
        let n = h.emit(&mut buf).unwrap();
        assert_eq!(n, BSDH_LEN + ext_len(mid));
        buf[n..].copy_from_slice(payload);
        assert_eq!(buf[0], mid as u8);
        assert_eq!(buf[1], BsdhFlags::OOB_PEND.bits());
        assert_eq!(&buf[2..4], &7u16.to_be_bytes());
        assert_eq!(&buf[4..8], &(buf.len() as u32).to_be_bytes());
        assert_eq!(&buf[8..12], &100u32.to_be_bytes());
        assert_eq!(&buf[12..16], &99u32.to_be_bytes());
        let (parsed, got_payload) = Header::parse(&buf).unwrap();
        assert_eq!(parsed, h);
        assert_eq!(got_payload, payload);
        assert_eq!(
            Header::parse_packet(&Packet::new_checked(&buf[..]).unwrap()),
            Ok(h)
        );
        buf
    }

    macro_rules! roundtrip_tests {
        ($($name:ident => $mid:ident),* $(,)?) => {
            $(
                #[test]
                fn $name() {
                    let bytes = roundtrip(Mid::$mid);
                    assert_eq!(bytes.len(), Mid::$mid.header_len() + sample(Mid::$mid).payload_len());
                }
            )*
        };
    }

    roundtrip_tests! {
        roundtrip_hello => Hello,
        roundtrip_hello_ack => HelloAck,
        roundtrip_disconn => DisConn,
        roundtrip_abort_conn => AbortConn,
        roundtrip_send_sm => SendSm,
        roundtrip_rdma_wr_compl => RdmaWrCompl,
        roundtrip_rdma_rd_compl => RdmaRdCompl,
        roundtrip_mode_change => ModeChange,
        roundtrip_src_avail_cancel => SrcAvailCancel,
        roundtrip_sink_avail_cancel => SinkAvailCancel,
        roundtrip_sink_cancel_ack => SinkCancelAck,
        roundtrip_ch_rcv_buf => ChRcvBuf,
        roundtrip_ch_rcv_buf_ack => ChRcvBufAck,
        roundtrip_susp_comm => SuspComm,
        roundtrip_susp_comm_ack => SuspCommAck,
        roundtrip_sink_avail => SinkAvail,
        roundtrip_src_avail => SrcAvail,
        roundtrip_data => Data,
    }

    #[test]
    fn mid_values_and_try_from() {
        let mut known = 0;
        for b in 0..=255u8 {
            match Mid::try_from(b) {
                Ok(mid) => {
                    known += 1;
                    assert_eq!(u8::from(mid), b);
                    assert!(Mid::ALL.contains(&mid));
                }
                Err(e) => assert_eq!(e, WireError::UnknownMid(b)),
            }
        }
        assert_eq!(known, Mid::ALL.len());
        let wire: Vec<u8> = Mid::ALL.iter().map(|&m| m as u8).collect();
        assert_eq!(
            wire,
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0xFD, 0xFE, 0xFF]
        );
    }

    #[test]
    fn ext_lengths() {
        let lens: Vec<usize> = Mid::ALL.iter().map(|&m| ext_len(m)).collect();
        assert_eq!(
            lens,
            [16, 12, 0, 0, 0, 4, 4, 4, 0, 0, 0, 4, 4, 8, 0, 20, 16, 0]
        );
        assert_eq!(Mid::Hello.header_len(), HELLO_LEN);
        assert_eq!(HELLO_LEN, 32);
        assert_eq!(Mid::HelloAck.header_len(), HELLO_ACK_LEN);
        assert_eq!(HELLO_ACK_LEN, 28);
        assert_eq!(
            Mid::ALL.iter().map(|m| m.header_len()).max(),
            Some(MAX_HEADER_LEN)
        );
    }

    #[test]
    fn layout_bsdh() {
        let h = Header::new(
            Mid::DisConn,
            Ext::None,
            BsdhFlags::OOB_PRES | BsdhFlags::REQ_PIPE,
            0x0102,
            0x0A0B_0C0D,
            0x1122_3344,
            0,
        );
        let mut buf = [0u8; 16];
        assert_eq!(h.emit(&mut buf), Ok(16));
        let expected = [
            0x02, 0x05, 0x01, 0x02, // mid, flags, bufs
            0x00, 0x00, 0x00, 0x10, // len = 16
            0x0A, 0x0B, 0x0C, 0x0D, // mseq
            0x11, 0x22, 0x33, 0x44, // mseq_ack
        ];
        assert_eq!(buf, expected);
        assert_eq!(Header::parse(&expected), Ok((h, &[][..])));
    }

    #[test]
    fn layout_data_with_payload() {
        let bytes = [
            0xFF, 0x01, 0x00, 0x03, // Data, OOB_PRES, bufs 3
            0x00, 0x00, 0x00, 0x13, // len 19
            0x00, 0x00, 0x00, 0x01, // mseq
            0x00, 0x00, 0x00, 0x00, // mseq_ack
            b'a', b'b', b'c',
        ];
        let (h, payload) = Header::parse(&bytes).unwrap();
        assert_eq!(
            h,
            Header::new(Mid::Data, Ext::None, BsdhFlags::OOB_PRES, 3, 1, 0, 3)
        );
        assert_eq!(payload, b"abc");
        assert_eq!(h.payload_len(), 3);
    }

    #[test]
    fn layout_src_avail() {
        let h = Header::new(
            Mid::SrcAvail,
            Ext::SrcAvail {
                len: 0x0001_0000,
                rkey: 0xCAFE_BABE,
                vaddr: 0x0011_2233_4455_6677,
            },
            F0,
            1,
            2,
            3,
            0,
        );
        let expected = [
            0xFE, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x20, // mid, flags, bufs, len 32
            0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x03, // mseq, mseq_ack
            0x00, 0x01, 0x00, 0x00, // len
            0xCA, 0xFE, 0xBA, 0xBE, // rkey
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, // vaddr
        ];
        let mut buf = [0u8; 32];
        assert_eq!(h.emit(&mut buf), Ok(32));
        assert_eq!(buf, expected);
        assert_eq!(Header::parse(&expected), Ok((h, &[][..])));
    }

    #[test]
    fn layout_sink_avail() {
        let h = Header::new(
            Mid::SinkAvail,
            Ext::SinkAvail {
                len: 0x0000_2000,
                rkey: 0x0102_0304,
                vaddr: 0x8877_6655_4433_2211,
                non_disc: 0x0000_0005,
            },
            F0,
            0,
            0xFFFF_FFFF,
            0,
            0,
        );
        let expected = [
            0xFD, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x24, // mid, flags, bufs, len 36
            0xFF, 0xFF, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x00, // mseq, mseq_ack
            0x00, 0x00, 0x20, 0x00, // len
            0x01, 0x02, 0x03, 0x04, // rkey
            0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, // vaddr
            0x00, 0x00, 0x00, 0x05, // non_disc
        ];
        let mut buf = [0u8; 36];
        assert_eq!(h.emit(&mut buf), Ok(36));
        assert_eq!(buf, expected);
        assert_eq!(Header::parse(&expected), Ok((h, &[][..])));
    }

    #[test]
    fn layout_hello() {
        let h = Header::new(
            Mid::Hello,
            Ext::Hello(Hello {
                version: 0x22,
                ip_version: 6,
                max_adverts: 4,
                desired_rcv_size: 0x0001_0000,
                local_rcv_size: 0x0000_8000,
                src_port: 0x1F90,
            }),
            F0,
            16,
            0,
            0,
            0,
        );
        let expected = [
            0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x20, // mid, flags, bufs 16, len 32
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // mseq, mseq_ack
            0x22, 0x06, 0x04, 0x00, // version, ip_version, max_adverts, reserved
            0x00, 0x01, 0x00, 0x00, // desired_rcv_size
            0x00, 0x00, 0x80, 0x00, // local_rcv_size
            0x1F, 0x90, 0x00, 0x00, // src_port, reserved
        ];
        let mut buf = [0u8; 32];
        assert_eq!(h.emit(&mut buf), Ok(32));
        assert_eq!(buf, expected);
        assert_eq!(Header::parse(&expected), Ok((h, &[][..])));
        assert_eq!(Header::parse_private_data(&expected), Ok(h));
    }

    #[test]
    fn layout_hello_ack() {
        let h = Header::new(
            Mid::HelloAck,
            Ext::HelloAck(HelloAck {
                version: 0x21,
                max_adverts: 1,
                actual_rcv_size: 0x0010_0000,
                desired_rcv_size: 0x0000_0400,
            }),
            F0,
            8,
            0,
            0,
            0,
        );
        let expected = [
            0x01, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00, 0x1C, // mid, flags, bufs 8, len 28
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // mseq, mseq_ack
            0x21, 0x00, 0x01, 0x00, // version, reserved, max_adverts, reserved
            0x00, 0x10, 0x00, 0x00, // actual_rcv_size
            0x00, 0x00, 0x04, 0x00, // desired_rcv_size
        ];
        let mut buf = [0u8; 28];
        assert_eq!(h.emit(&mut buf), Ok(28));
        assert_eq!(buf, expected);
        assert_eq!(Header::parse(&expected), Ok((h, &[][..])));
    }

    #[test]
    fn layout_four_and_eight_byte_exts() {
        let cases: [(Mid, Ext, [u8; 8]); 6] = [
            (
                Mid::RdmaRdCompl,
                Ext::RdmaRdCompl { len: 0x0102_0304 },
                [1, 2, 3, 4, 0, 0, 0, 0],
            ),
            (
                Mid::RdmaWrCompl,
                Ext::RdmaWrCompl { len: 0x0A0B_0C0D },
                [0xA, 0xB, 0xC, 0xD, 0, 0, 0, 0],
            ),
            (
                Mid::ChRcvBuf,
                Ext::ChRcvBuf { size: 0x0000_4000 },
                [0, 0, 0x40, 0, 0, 0, 0, 0],
            ),
            (
                Mid::ChRcvBufAck,
                Ext::ChRcvBufAck { size: 0x0001_0000 },
                [0, 1, 0, 0, 0, 0, 0, 0],
            ),
            (
                Mid::ModeChange,
                Ext::ModeChange { flags: 0x81 },
                [0x81, 0, 0, 0, 0, 0, 0, 0],
            ),
            (
                Mid::SuspComm,
                Ext::SuspComm {
                    service_id: 0x0102_0304_0506_0708,
                },
                [1, 2, 3, 4, 5, 6, 7, 8],
            ),
        ];
        for (mid, ext, ext_bytes) in cases {
            let h = Header::new(mid, ext, F0, 0, 0, 0, 0);
            let mut buf = vec![0u8; h.header_len()];
            h.emit(&mut buf).unwrap();
            assert_eq!(buf[0], mid as u8);
            assert_eq!(&buf[4..8], &(h.header_len() as u32).to_be_bytes());
            assert_eq!(&buf[16..], &ext_bytes[..ext_len(mid)], "{mid:?}");
            assert_eq!(Header::parse(&buf), Ok((h, &[][..])));
        }
    }

    #[test]
    fn packet_accessors_and_setters() {
        let mut buf = [0u8; 20];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_mid(Mid::RdmaRdCompl);
        p.set_flags(BsdhFlags::OOB_PEND);
        p.set_bufs(0xBEEF);
        p.set_msg_len(20);
        p.set_mseq(5);
        p.set_mseq_ack(4);
        p.ext_mut().copy_from_slice(&[0, 0, 1, 0]);
        assert!(p.payload_mut().is_empty());
        let p = Packet::new_checked(&buf[..]).unwrap();
        assert_eq!(p.mid(), Ok(Mid::RdmaRdCompl));
        assert_eq!(p.flags(), Ok(BsdhFlags::OOB_PEND));
        assert_eq!(p.bufs(), 0xBEEF);
        assert_eq!(p.msg_len(), 20);
        assert_eq!((p.mseq(), p.mseq_ack()), (5, 4));
        assert_eq!(p.header_len(), 20);
        assert_eq!(p.ext(), &[0, 0, 1, 0]);
        assert_eq!(
            Header::parse_packet(&p),
            Ok(Header::new(
                Mid::RdmaRdCompl,
                Ext::RdmaRdCompl { len: 256 },
                BsdhFlags::OOB_PEND,
                0xBEEF,
                5,
                4,
                0
            ))
        );
        assert_eq!(
            Packet::new_checked(&buf[..19]).unwrap_err(),
            WireError::Truncated { need: 20, have: 19 }
        );
    }

    /// Emit `mid`'s sample and let `f` corrupt the bytes.
    fn corrupted(mid: Mid, f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let h = sample(mid);
        let mut buf = vec![0; h.header_len() + h.payload_len()];
        h.emit(&mut buf).unwrap();
        f(&mut buf);
        buf
    }

    fn set_len(buf: &mut [u8], len: usize) {
        buf[4..8].copy_from_slice(&(len as u32).to_be_bytes());
    }

    fn err(buf: &[u8]) -> WireError {
        Header::parse(buf).unwrap_err()
    }

    #[test]
    fn error_truncated_bsdh() {
        for n in 0..BSDH_LEN {
            let buf = corrupted(Mid::DisConn, |b| b.truncate(n));
            assert_eq!(err(&buf), WireError::Truncated { need: 16, have: n });
        }
    }

    #[test]
    fn error_truncated_ext() {
        // A SrcAvail whose len agrees with the 20 bytes received but whose ext needs 16 bytes.
        let buf = corrupted(Mid::SrcAvail, |b| {
            b.truncate(20);
            set_len(b, 20);
        });
        assert_eq!(err(&buf), WireError::Truncated { need: 32, have: 20 });
    }

    #[test]
    fn error_truncated_emit() {
        for mid in Mid::ALL {
            let h = sample(mid);
            let mut buf = vec![0u8; h.header_len() - 1];
            assert_eq!(
                h.emit(&mut buf),
                Err(WireError::Truncated {
                    need: h.header_len(),
                    have: h.header_len() - 1
                })
            );
            assert!(buf.iter().all(|&b| b == 0), "nothing written on error");
        }
    }

    #[test]
    fn error_unknown_mid() {
        for raw in [0x0F, 0x10, 0x80, 0xFC] {
            let buf = corrupted(Mid::DisConn, |b| b[0] = raw);
            assert_eq!(err(&buf), WireError::UnknownMid(raw));
        }
    }

    #[test]
    fn error_reserved_flags() {
        for raw in [0x08, 0x80, 0xFF] {
            let buf = corrupted(Mid::Data, |b| b[1] = raw);
            assert_eq!(err(&buf), WireError::ReservedFlags(raw));
        }
        let h = Header::new(
            Mid::Data,
            Ext::None,
            BsdhFlags::from_bits_retain(0x10),
            0,
            0,
            0,
            0,
        );
        assert_eq!(h.emit(&mut [0; 16]), Err(WireError::ReservedFlags(0x10)));
    }

    #[test]
    fn error_length_mismatch() {
        let buf = corrupted(Mid::DisConn, |b| set_len(b, 17));
        assert_eq!(
            err(&buf),
            WireError::LengthMismatch {
                claimed: 17,
                actual: 16
            }
        );
        let buf = corrupted(Mid::Data, |b| set_len(b, 20));
        assert_eq!(
            err(&buf),
            WireError::LengthMismatch {
                claimed: 20,
                actual: 21
            }
        );
        // A received message longer than its BSDH says.
        let buf = corrupted(Mid::Data, |b| b.push(0));
        assert_eq!(
            err(&buf),
            WireError::LengthMismatch {
                claimed: 21,
                actual: 22
            }
        );
        // Emit: len shorter than the header.
        let mut h = sample(Mid::SrcAvail);
        h.bsdh.len = 31;
        assert_eq!(
            h.emit(&mut [0; 64]),
            Err(WireError::LengthMismatch {
                claimed: 31,
                actual: 32
            })
        );
    }

    #[test]
    fn error_unexpected_payload() {
        for mid in Mid::ALL.into_iter().filter(|m| *m != Mid::Data) {
            let buf = corrupted(mid, |b| {
                b.extend_from_slice(&[1, 2, 3]);
                let n = b.len();
                set_len(b, n);
            });
            assert_eq!(err(&buf), WireError::UnexpectedPayload { mid, len: 3 });
            // Structural errors come before value errors: a bad ext value does not hide it.
            let buf = corrupted(mid, |b| {
                b[16..].fill(0xFF);
                b.extend_from_slice(&[1, 2, 3]);
                let n = b.len();
                set_len(b, n);
            });
            assert_eq!(err(&buf), WireError::UnexpectedPayload { mid, len: 3 });
            let h = Header::new(mid, sample(mid).ext, F0, 0, 0, 0, 3);
            assert_eq!(
                h.emit(&mut [0; 64]),
                Err(WireError::UnexpectedPayload { mid, len: 3 })
            );
        }
    }

    #[test]
    fn error_ext_mismatch() {
        for mid in Mid::ALL {
            for other in Mid::ALL {
                let ext = sample(other).ext;
                let h = Header::new(mid, ext, F0, 0, 0, 0, 0);
                let result = h.emit(&mut [0; 64]);
                if ext.fits(mid) {
                    assert!(result.is_ok(), "{mid:?} with {ext:?}");
                } else {
                    assert_eq!(result, Err(WireError::ExtMismatch), "{mid:?} with {ext:?}");
                }
            }
        }
    }

    #[test]
    fn error_reserved_nonzero() {
        let cases = [
            (Mid::Hello, 19, "Hello.reserved1"),
            (Mid::Hello, 30, "Hello.reserved2"),
            (Mid::Hello, 31, "Hello.reserved2"),
            (Mid::HelloAck, 17, "HelloAck.reserved1"),
            (Mid::HelloAck, 19, "HelloAck.reserved2"),
            (Mid::ModeChange, 17, "ModeChange.reserved"),
            (Mid::ModeChange, 18, "ModeChange.reserved"),
            (Mid::ModeChange, 19, "ModeChange.reserved"),
        ];
        for (mid, at, field) in cases {
            let buf = corrupted(mid, |b| b[at] = 0x01);
            assert_eq!(
                err(&buf),
                WireError::ReservedNonZero { field },
                "{mid:?}@{at}"
            );
        }
    }

    #[test]
    fn error_out_of_range() {
        let u32_at = |mid, at: usize, v: u32| {
            corrupted(mid, |b| b[at..at + 4].copy_from_slice(&v.to_be_bytes()))
        };
        let oor = |field, value| WireError::OutOfRange { field, value };
        for ip in [0u8, 5, 0x40, 0x60] {
            let buf = corrupted(Mid::Hello, |b| b[17] = ip);
            assert_eq!(err(&buf), oor("Hello.ip_version", ip.into()));
        }
        let sizes = [0, MIN_RCV_SIZE - 1, MAX_RCV_SIZE + 1, u32::MAX];
        let fields = [
            (Mid::Hello, 20, "Hello.desired_rcv_size"),
            (Mid::Hello, 24, "Hello.local_rcv_size"),
            (Mid::HelloAck, 20, "HelloAck.actual_rcv_size"),
            (Mid::HelloAck, 24, "HelloAck.desired_rcv_size"),
            (Mid::ChRcvBuf, 16, "ChRcvBuf.size"),
            (Mid::ChRcvBufAck, 16, "ChRcvBufAck.size"),
        ];
        for (mid, at, field) in fields {
            for v in sizes {
                assert_eq!(err(&u32_at(mid, at, v)), oor(field, v.into()));
            }
            for v in [MIN_RCV_SIZE, MAX_RCV_SIZE] {
                assert!(Header::parse(&u32_at(mid, at, v)).is_ok(), "{field}={v}");
            }
        }
        let lens = [
            (Mid::SrcAvail, "SrcAvail.len"),
            (Mid::SinkAvail, "SinkAvail.len"),
            (Mid::RdmaRdCompl, "RdmaRdCompl.len"),
            (Mid::RdmaWrCompl, "RdmaWrCompl.len"),
        ];
        for (mid, field) in lens {
            assert_eq!(err(&u32_at(mid, 16, 0)), oor(field, 0));
            assert!(Header::parse(&u32_at(mid, 16, 1)).is_ok());
        }
    }

    #[test]
    fn error_bad_version() {
        for v in [0x00, 0x12, 0x32, 0xF2] {
            for mid in [Mid::Hello, Mid::HelloAck] {
                let buf = corrupted(mid, |b| b[16] = v);
                assert_eq!(err(&buf), WireError::BadVersion(v));
            }
        }
        for v in [0x20, 0x21, 0x2F] {
            let buf = corrupted(Mid::Hello, |b| b[16] = v);
            assert!(Header::parse(&buf).is_ok());
        }
    }

    #[test]
    fn error_unexpected_mid_in_private_data() {
        for mid in Mid::ALL {
            let buf = corrupted(mid, |_| {});
            let res = Header::parse_private_data(&buf);
            if matches!(mid, Mid::Hello | Mid::HelloAck) {
                assert_eq!(res, Ok(sample(mid)));
            } else {
                assert_eq!(res, Err(WireError::UnexpectedMid(mid)));
            }
        }
    }

    #[test]
    fn private_data_padding_ignored() {
        for mid in [Mid::Hello, Mid::HelloAck] {
            let h = sample(mid);
            let mut buf = vec![0u8; TCP_PS_REQ_PRIVATE_DATA_LEN];
            h.emit(&mut buf).unwrap();
            assert_eq!(Header::parse_private_data(&buf), Ok(h));
            buf[h.header_len()..].fill(0x5A);
            assert_eq!(Header::parse_private_data(&buf), Ok(h));
            // Plain parse refuses the padding.
            assert!(matches!(
                Header::parse(&buf),
                Err(WireError::LengthMismatch { .. })
            ));
        }
    }

    #[test]
    fn private_data_errors() {
        assert_eq!(
            Header::parse_private_data(&[0; 10]),
            Err(WireError::Truncated { need: 16, have: 10 })
        );
        let hello = corrupted(Mid::Hello, |_| {});
        assert_eq!(
            Header::parse_private_data(&hello[..31]),
            Err(WireError::Truncated { need: 32, have: 31 })
        );
        let big = corrupted(Mid::Hello, |b| set_len(b, 0xFFFF_FFFF));
        assert_eq!(
            Header::parse_private_data(&big),
            Err(WireError::Truncated {
                need: usize::try_from(0xFFFF_FFFFu32).unwrap(),
                have: 32
            })
        );
        // bsdh.len shorter than the Hello: the inner parse reports the truncated ext.
        let short = corrupted(Mid::Hello, |b| set_len(b, 20));
        assert_eq!(
            Header::parse_private_data(&short),
            Err(WireError::Truncated { need: 32, have: 20 })
        );
        let bad = corrupted(Mid::Hello, |b| b[16] = 0x11);
        assert_eq!(
            Header::parse_private_data(&bad),
            Err(WireError::BadVersion(0x11))
        );
        assert_eq!(
            Header::parse_private_data(&[0x42; 40]),
            Err(WireError::UnknownMid(0x42))
        );
    }

    #[test]
    fn error_messages() {
        let cases: [(WireError, &str); 10] = [
            (
                WireError::Truncated { need: 32, have: 20 },
                "message truncated: need 32 bytes, have 20",
            ),
            (WireError::UnknownMid(0x42), "unknown SDP message id 0x42"),
            (
                WireError::ReservedFlags(0x88),
                "reserved BSDH flag bits set in flags 0x88",
            ),
            (
                WireError::LengthMismatch {
                    claimed: 17,
                    actual: 16,
                },
                "BSDH length 17 does not match the message length 16",
            ),
            (
                WireError::UnexpectedPayload {
                    mid: Mid::DisConn,
                    len: 3,
                },
                "DisConn message carries 3 payload bytes; only Data may carry payload",
            ),
            (
                WireError::ExtMismatch,
                "extended header variant does not match the message id",
            ),
            (
                WireError::ReservedNonZero {
                    field: "Hello.reserved1",
                },
                "reserved field Hello.reserved1 is not zero",
            ),
            (
                WireError::OutOfRange {
                    field: "ChRcvBuf.size",
                    value: 5,
                },
                "field ChRcvBuf.size out of range: 5",
            ),
            (
                WireError::BadVersion(0x12),
                "unsupported SDP version 0x12 (major version must be 2)",
            ),
            (
                WireError::UnexpectedMid(Mid::Data),
                "unexpected Data message here",
            ),
        ];
        for (e, msg) in cases {
            assert_eq!(e.to_string(), msg);
        }
    }

    #[test]
    fn header_new_lengths() {
        let h = Header::new(Mid::Data, Ext::None, F0, 0, 0, 0, 1000);
        assert_eq!(h.bsdh.len, 1016);
        assert_eq!(h.payload_len(), 1000);
        let h = Header::new(Mid::SinkAvail, sample(Mid::SinkAvail).ext, F0, 0, 0, 0, 0);
        assert_eq!(h.bsdh.len, 36);
        let h = Header::new(Mid::Data, Ext::None, F0, 0, 0, 0, usize::MAX);
        assert_eq!(h.bsdh.len, u32::MAX);
    }
}
