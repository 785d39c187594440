//! Errors: the peer's protocol violations, why a connection failed, and why an application
//! call did not go through (the errno a TCP socket gives for each is the socket layer's:
//! `socket::errno_of`).

use super::msgs::{Mid, WireError};
use crate::verbs::WcStatus;

/// Why the peer's behaviour broke the protocol. Each one ends the connection with AbortConn.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("malformed message: {0}")]
    Wire(#[from] WireError),
    #[error("message {mid:?} not allowed in this state ({context})")]
    Unexpected { mid: Mid, context: &'static str },
    #[error("message sequence number {got} where {want} was due")]
    Sequence { got: u32, want: u32 },
    #[error("peer acknowledged message {mseq_ack} that was never sent")]
    BadAck { mseq_ack: u32 },
    #[error("peer advertised an impossible credit count ({0})")]
    BadCredits(i64),
    #[error("message of {len} bytes exceeds the negotiated receive size {max}")]
    TooLong { len: usize, max: u32 },
    #[error("peer sent more advertisements than the {0} negotiated")]
    TooManyAdverts(u8),
    #[error("completion length {got} does not match the {want} bytes requested")]
    BadTransferLength { got: u64, want: u64 },
    #[error("peer acknowledged {got} bytes of a {want}-byte zero-copy transfer")]
    BadComplLength { got: u64, want: u64 },
    #[error("connection setup: {0}")]
    Setup(&'static str),
}

/// Why a connection failed (the socket layer gives the errno a TCP socket would:
/// `socket::errno_of`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnError {
    #[error("connection refused")]
    Refused,
    #[error("connection rejected by the peer: {0}")]
    Rejected(String),
    #[error("connection reset by peer")]
    Reset,
    /// Reset after the peer's orderly close had come (TCP's RST in CLOSE_WAIT): reads see
    /// what came, then EOF; writes EPIPE.
    #[error("connection reset by peer after its close")]
    ResetAfterClose,
    #[error("connection timed out")]
    TimedOut,
    #[error("no route to host")]
    Unreachable,
    #[error("connection aborted locally")]
    Aborted,
    #[error("the RDMA device was removed")]
    DeviceRemoved,
    #[error("protocol violation by the peer: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("transport error: {0:?}")]
    Transport(WcStatus),
    #[error("out of registered memory")]
    NoMemory,
}

/// Errors of application calls.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// Nothing can be done now; try again after the next event (EAGAIN).
    #[error("operation would block")]
    WouldBlock,
    /// The write half is shut (EPIPE).
    #[error("broken pipe")]
    BrokenPipe,
    /// Not connected yet, or the call does not fit the state (ENOTCONN / EINVAL).
    #[error("not connected")]
    NotConnected,
    /// An argument is out of range (EINVAL).
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    /// The connection failed.
    #[error(transparent)]
    Conn(#[from] ConnError),
}
