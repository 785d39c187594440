//! Errors as a TCP socket reports them: the one place the engine's, the driver's and the
//! providers' errors become errno values (the sans-IO engine has none of its own).

use std::io;

use crate::driver::DriverError;
use crate::proto::conn::CallError;
use crate::proto::ConnError;
use crate::verbs::VerbsError;

/// Errors that have the errno a TCP socket gives for the same failure.
pub trait Errno {
    /// The errno.
    fn errno(&self) -> i32;
}

impl Errno for ConnError {
    fn errno(&self) -> i32 {
        match self {
            ConnError::Refused | ConnError::Rejected(_) => libc::ECONNREFUSED,
            ConnError::Reset => libc::ECONNRESET,
            // Linux: a reset in CLOSE_WAIT sets EPIPE.
            ConnError::ResetAfterClose => libc::EPIPE,
            ConnError::TimedOut | ConnError::Transport(_) => libc::ETIMEDOUT,
            ConnError::Unreachable => libc::EHOSTUNREACH,
            ConnError::Aborted => libc::ECONNABORTED,
            ConnError::DeviceRemoved => libc::ENETDOWN,
            ConnError::Protocol(_) => libc::EPROTO,
            ConnError::NoMemory => libc::ENOBUFS,
        }
    }
}

impl Errno for CallError {
    fn errno(&self) -> i32 {
        match self {
            CallError::WouldBlock => libc::EAGAIN,
            CallError::BrokenPipe => libc::EPIPE,
            CallError::NotConnected => libc::ENOTCONN,
            CallError::Invalid(_) => libc::EINVAL,
            CallError::Conn(e) => e.errno(),
        }
    }
}

impl Errno for VerbsError {
    fn errno(&self) -> i32 {
        match self {
            VerbsError::NoDevice(_) => libc::ENETUNREACH,
            VerbsError::AddrInUse => libc::EADDRINUSE,
            VerbsError::AddrNotAvailable => libc::EADDRNOTAVAIL,
            VerbsError::QueueFull(_) | VerbsError::NoResources(_) => libc::ENOBUFS,
            VerbsError::Invalid(_) => libc::EINVAL,
            VerbsError::NotConnected => libc::ENOTCONN,
            VerbsError::Refused => libc::ECONNREFUSED,
            VerbsError::Os(_) => libc::EIO,
        }
    }
}

impl Errno for DriverError {
    fn errno(&self) -> i32 {
        match self {
            DriverError::BadId => libc::EBADF,
            DriverError::Verbs(v) => v.errno(),
            DriverError::Conn(c) => c.errno(),
            DriverError::Call(c) => c.errno(),
        }
    }
}

/// The errno a TCP socket gives for `e`.
pub fn errno_of(e: &impl Errno) -> i32 {
    e.errno()
}

/// A call's error as `io::Error` (EAGAIN as `WouldBlock`).
pub(crate) fn io_err(e: CallError) -> io::Error {
    match e {
        CallError::WouldBlock => io::ErrorKind::WouldBlock.into(),
        e => io::Error::from_raw_os_error(e.errno()),
    }
}

/// A provider's error as `io::Error`: its errno, with the provider's words kept.
pub(crate) fn verbs_err(e: VerbsError) -> io::Error {
    let errno = e.errno();
    if let VerbsError::Refused = e {
        // As TCP's connect says it: a plain errno (the shim's callers see ECONNREFUSED).
        return io::Error::from_raw_os_error(errno);
    }
    io::Error::new(
        io::Error::from_raw_os_error(errno).kind(),
        format!("{e} (os error {errno})"),
    )
}

/// A driver call's error as `io::Error`.
pub(crate) fn driver_err(e: DriverError) -> io::Error {
    match e {
        DriverError::Verbs(v) => verbs_err(v),
        DriverError::Call(c) => io_err(c),
        e => io::Error::from_raw_os_error(e.errno()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_errno_for_each_failure() {
        assert_eq!(ConnError::Refused.errno(), libc::ECONNREFUSED);
        assert_eq!(ConnError::DeviceRemoved.errno(), libc::ENETDOWN);
        assert_eq!(CallError::Conn(ConnError::Reset).errno(), libc::ECONNRESET);
        assert_eq!(ConnError::ResetAfterClose.errno(), libc::EPIPE);
        assert_eq!(DriverError::BadId.errno(), libc::EBADF);
        assert_eq!(
            io_err(CallError::WouldBlock).kind(),
            io::ErrorKind::WouldBlock
        );
        let e = verbs_err(VerbsError::AddrInUse);
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        assert!(e.to_string().contains("os error"), "{e}");
    }
}
