//! The socket API: [`SdpStream`] and [`SdpListener`], shaped like `std::net`'s TCP types.
//!
//! ```no_run
//! use std::io::{Read, Write};
//! use sdp_core::socket::{SdpListener, SdpStream, Transport};
//!
//! let listener = SdpListener::bind("127.0.0.1:0")?;
//! let addr = listener.local_addr()?;
//! let t = std::thread::spawn(move || -> std::io::Result<()> {
//!     let (mut s, _) = listener.accept()?;
//!     let mut buf = [0u8; 5];
//!     s.read_exact(&mut buf)?;
//!     s.write_all(&buf)
//! });
//! let mut s = SdpStream::connect(addr)?;
//! // On one host without RDMA, SDP runs over shared memory.
//! assert_ne!(s.transport(), Transport::Tcp);
//! s.write_all(b"hello")?;
//! let mut echo = [0u8; 5];
//! s.read_exact(&mut echo)?;
//! assert_eq!(&echo, b"hello");
//! t.join().unwrap()?;
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! **Transports.** A stream runs over SDP on some provider ([`Transport::Shm`] between
//! processes of one host, [`Transport::Rdma`] over an RDMA device) or over kernel TCP
//! ([`Transport::Tcp`]). In automatic mode ([`Choice::Auto`], the default) a connector tries
//! SDP first and falls back to kernel TCP when the peer does not speak SDP (no SDP listener,
//! no device or route, or the peer refused us, e.g. another user's process); a listener
//! accepts SDP and kernel TCP clients on the same port. [`SdpStream::transport`] always tells
//! which one a stream uses.
//!
//! **Readiness.** [`AsRawFd`](std::os::fd::AsRawFd) gives an fd that polls readable, writable
//! and hung-up exactly when the stream is, so SDP streams work with `poll`, `epoll`, mio and
//! tokio's `AsyncFd`. Use it in nonblocking mode, as with any socket.
//!
//! **Zero copy.** Blocking writes of at least 128 KiB over shm and 1 MiB over RDMA
//! (`SDP_ZCOPY_MIN` sets it; below, a copy beats a round trip per write) are sent without
//! copying: the reader's side reads them straight out of the writer's buffer, and the write
//! returns once the peer has the bytes. [`SdpStream::register`] gives a
//! [`RegisteredBuf`] to send from and receive into without per-call registration.
//!
//! **Listen backlog.** As over TCP, at most backlog + 1 connections ([`Options::backlog`],
//! default 128) wait for a listener's `accept`; a client beyond that waits in `connect` until
//! there is room or its connect timeout passes (ETIMEDOUT). Waiting connections hold a few
//! receive buffers and wait, as TCP's, until accepted or the listener closes (with
//! [`Config::unaccepted_timeout`](crate::proto::Config::unaccepted_timeout) set, they are
//! reset if nobody accepts them within it).
//!
//! **fork().** Streams keep working in the parent. In the child, streams inherited from the
//! parent fail with an error and closing them does nothing to the parent's connections; the
//! child can open new streams. Every fd the socket layer makes is close-on-exec.
//!
//! **Exit.** As the kernel does for TCP sockets, what a process wrote before it exits reaches
//! the peer, closed or not: at exit ([`flush_at_exit`], registered with `atexit`) every
//! connection is closed and the process waits until the peer holds the data and the close, up
//! to `SDP_EXIT_LINGER_MS` (default 10 s). After a crash, a peer reads what had reached it and
//! then ECONNRESET. Received data stays readable after a reset, then the error is reported
//! once, then EOF, as on Linux.

pub mod app;
mod errors;
mod exit;
pub mod history;
mod listener;
mod pump;
mod ready;
mod runtime;
mod shared_name;
mod stack;
pub mod stat;
mod stream;
pub(crate) mod tunables;
pub use errors::{errno_of, Errno};

/// RLIMIT_NOFILE and the fds SDP holds beside the application's (for the shim): room is made
/// above the application's limit, which is what the application is told.
pub mod fd_limit {
    pub use crate::sys::fd::{
        app_fd_limit, app_fds_end, app_has_room, app_number, app_slot, closing, fd_limit_for_exec,
        fd_room_after_exec, high_fd, kept_fds, make_fd_room, nofile_limit, ours_in,
        set_app_fd_limit, with_room, LowFds, LowMark,
    };
}

/// Fork handlers (for the shim): registered through here, they also run around a process made
/// by a raw `clone` or `fork` system call, which glibc's handlers miss.
pub mod fork {
    pub use crate::sys::process::{atfork, run_fork_handlers, spawn_started, ForkStage};
}

pub use exit::{
    exit_can_run, exit_flush_moves, exit_linger, exit_under_way, flush_at_exit,
    flush_while_progress, freeze_app_calls, set_exit_hook, DEFAULT_EXIT_LINGER,
};
pub use listener::{Incoming, SdpListener};
pub use stack::{Choice, Options, Stack};
pub use stream::{PendingSend, RegisteredBuf, SdpStream};

/// What carries a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transport {
    /// SDP over shared memory between two processes of one host.
    Shm,
    /// SDP over an RDMA device (or another provider given to [`Stack::with_provider`]).
    Rdma,
    /// SDP over the deterministic simulator: only with the `harness` feature (the crate's own
    /// tests and benches), never in a user's build.
    #[cfg(feature = "harness")]
    #[doc(hidden)]
    Sim,
    /// Kernel TCP (fallback, or chosen).
    Tcp,
}

impl Transport {
    pub(crate) fn from_provider(name: &str) -> Transport {
        match name {
            "shm" => Transport::Shm,
            #[cfg(feature = "harness")]
            "sim" => Transport::Sim,
            _ => Transport::Rdma,
        }
    }
    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Rdma => "rdma",
            #[cfg(feature = "harness")]
            Transport::Sim => "sim",
            Transport::Tcp => "tcp",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
