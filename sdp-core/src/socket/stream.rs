//! [`SdpStream`]: a connected stream socket over SDP or, as a fallback, kernel TCP.

use std::cell::Cell;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown as NetShutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::runtime::{DynMr, Wait, ZStart};
use super::stack::{Choice, Options, Stack};
use super::Transport;
use crate::proto::table::ConnId;
use crate::proto::Shutdown;
use crate::sys;

/// The SDP side of a stream, shared by its clones; the connection closes when the last clone
/// goes (as with a dup'd fd).
pub(crate) struct Core {
    pub(crate) stack: Stack,
    pub(crate) id: ConnId,
    nonblocking: AtomicBool,
    zcopy: AtomicBool,
    read_timeout: Mutex<Option<Duration>>,
    write_timeout: Mutex<Option<Duration>>,
}

impl Drop for Core {
    fn drop(&mut self) {
        self.stack.0.close(self.id);
    }
}

impl Core {
    pub(crate) fn new(stack: Stack, id: ConnId) -> Core {
        Core {
            stack,
            id,
            nonblocking: AtomicBool::new(false),
            zcopy: AtomicBool::new(true),
            read_timeout: Mutex::new(None),
            write_timeout: Mutex::new(None),
        }
    }
    fn wait(&self, timeout: Option<Duration>) -> Wait {
        Wait {
            nonblocking: self.nonblocking.load(Ordering::Relaxed),
            timeout,
            zcopy: self.zcopy.load(Ordering::Relaxed),
            spin: None,
        }
    }
}

#[derive(Clone)]
enum Inner {
    Sdp(Arc<Core>),
    Tcp(Arc<TcpStream>),
}

/// A stream socket: SDP when possible, kernel TCP otherwise (see [`SdpStream::transport`]).
///
/// `Read` and `Write` are implemented for `SdpStream` and `&SdpStream`: one thread may read
/// while another writes.
#[derive(Clone)]
pub struct SdpStream {
    inner: Inner,
}

impl std::fmt::Debug for SdpStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("SdpStream");
        d.field("transport", &self.transport());
        if let Ok(a) = self.local_addr() {
            d.field("local", &a);
        }
        if let Ok(a) = self.peer_addr() {
            d.field("peer", &a);
        }
        d.finish()
    }
}

fn invalid(msg: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Errors after which automatic mode tries kernel TCP: the peer or path does not do SDP.
fn falls_back(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ECONNREFUSED | libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EADDRNOTAVAIL)
    )
}

impl SdpStream {
    pub(crate) fn from_core(core: Core) -> SdpStream {
        SdpStream {
            inner: Inner::Sdp(Arc::new(core)),
        }
    }
    pub(crate) fn from_tcp(s: TcpStream) -> SdpStream {
        SdpStream {
            inner: Inner::Tcp(Arc::new(s)),
        }
    }

    /// Connect in automatic mode: SDP if the peer speaks it, kernel TCP otherwise.
    pub fn connect(addr: impl ToSocketAddrs) -> io::Result<SdpStream> {
        SdpStream::connect_with(addr, &Options::default())
    }

    /// Connect with a timeout (per address tried), like `TcpStream::connect_timeout`.
    pub fn connect_timeout(addr: &SocketAddr, timeout: Duration) -> io::Result<SdpStream> {
        if timeout.is_zero() {
            return Err(invalid("cannot set a 0 duration timeout"));
        }
        let opts = Options {
            connect_timeout: Some(timeout),
            ..Options::default()
        };
        SdpStream::connect_with(addr, &opts)
    }

    /// Connect with explicit options (transport choice, stack, timeout).
    pub fn connect_with(addr: impl ToSocketAddrs, opts: &Options) -> io::Result<SdpStream> {
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match SdpStream::connect_one(a, opts) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| invalid("could not resolve to any addresses")))
    }

    fn connect_one(a: SocketAddr, opts: &Options) -> io::Result<SdpStream> {
        if !matches!(opts.choice, Choice::Tcp) {
            let sdp = match opts.stack_for(a.ip()) {
                Ok(Some(stack)) => stack
                    .0
                    .connect(
                        a,
                        opts.source_for(a),
                        opts.connect_timeout,
                        true,
                        // Automatic: kernel TCP if a process of this host does not answer.
                        matches!(opts.choice, Choice::Auto)
                            .then_some(super::runtime::Patience::BLOCKING),
                    )
                    .map(|id| SdpStream::from_core(Core::new(stack, id))),
                Ok(None) => Err(io::Error::from_raw_os_error(libc::ENETUNREACH)),
                Err(e) => Err(e),
            };
            match sdp {
                Ok(s) => return Ok(s),
                Err(e) if matches!(opts.choice, Choice::Auto) && falls_back(&e) => {}
                Err(e) if matches!(opts.choice, Choice::Auto) && e.raw_os_error().is_none() => {
                    // The stack itself is unavailable (e.g. no shm support), or the listener
                    // refused us with its reason: TCP.
                }
                // As TCP's connect says a refusal: the errno (the listener's reason is the
                // shim's, for its fallback's log).
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    return Err(io::Error::from_raw_os_error(libc::ECONNREFUSED))
                }
                Err(e) => return Err(e),
            }
        }
        let s = match (opts.source_ip, opts.connect_timeout) {
            (Some(src), t) => sys::tcp_connect_from(src, a, t)?,
            (None, Some(t)) => TcpStream::connect_timeout(&a, t)?,
            (None, None) => TcpStream::connect(a)?,
        };
        Ok(SdpStream::from_tcp(s))
    }

    /// What carries this stream.
    pub fn transport(&self) -> Transport {
        match &self.inner {
            Inner::Sdp(c) => c.stack.transport(),
            Inner::Tcp(_) => Transport::Tcp,
        }
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.addrs(c.id).map(|a| a.1),
            Inner::Tcp(s) => s.peer_addr(),
        }
    }
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.addrs(c.id).map(|a| a.0),
            Inner::Tcp(s) => s.local_addr(),
        }
    }

    /// Shut down the read, write or both halves (write: the peer reads EOF after all data).
    pub fn shutdown(&self, how: NetShutdown) -> io::Result<()> {
        match &self.inner {
            Inner::Sdp(c) => {
                let how = match how {
                    NetShutdown::Read => Shutdown::Read,
                    NetShutdown::Write => Shutdown::Write,
                    NetShutdown::Both => Shutdown::Both,
                };
                c.stack.0.shutdown(c.id, how)
            }
            Inner::Tcp(s) => s.shutdown(how),
        }
    }

    /// A second handle to the same connection (shares mode, timeouts and the connection).
    pub fn try_clone(&self) -> io::Result<SdpStream> {
        match &self.inner {
            Inner::Sdp(c) => {
                if !c.stack.0.alive() {
                    return Err(io::Error::from_raw_os_error(libc::EBADF));
                }
                Ok(self.clone())
            }
            Inner::Tcp(s) => Ok(SdpStream::from_tcp(s.try_clone()?)),
        }
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match &self.inner {
            Inner::Sdp(c) => {
                c.nonblocking.store(on, Ordering::Relaxed);
                Ok(())
            }
            Inner::Tcp(s) => s.set_nonblocking(on),
        }
    }

    /// Whether large blocking reads and writes may go by zero copy (the default). Off, every
    /// byte goes through the connection's registered buffers (BCopy).
    pub fn set_zero_copy(&self, on: bool) {
        if let Inner::Sdp(c) = &self.inner {
            c.zcopy.store(on, Ordering::Relaxed);
        }
    }

    /// SO_RCVTIMEO: a blocking read that waits longer fails with `WouldBlock` (EAGAIN).
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(invalid("cannot set a 0 duration timeout"));
        }
        match &self.inner {
            Inner::Sdp(c) => {
                *c.read_timeout.lock() = t;
                Ok(())
            }
            Inner::Tcp(s) => s.set_read_timeout(t),
        }
    }
    pub fn read_timeout(&self) -> io::Result<Option<Duration>> {
        match &self.inner {
            Inner::Sdp(c) => Ok(*c.read_timeout.lock()),
            Inner::Tcp(s) => s.read_timeout(),
        }
    }
    /// SO_SNDTIMEO.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(invalid("cannot set a 0 duration timeout"));
        }
        match &self.inner {
            Inner::Sdp(c) => {
                *c.write_timeout.lock() = t;
                Ok(())
            }
            Inner::Tcp(s) => s.set_write_timeout(t),
        }
    }
    pub fn write_timeout(&self) -> io::Result<Option<Duration>> {
        match &self.inner {
            Inner::Sdp(c) => Ok(*c.write_timeout.lock()),
            Inner::Tcp(s) => s.write_timeout(),
        }
    }

    /// TCP_NODELAY: SDP coalesces small writes while a send is outstanding unless set.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.set_nodelay(c.id, on),
            Inner::Tcp(s) => s.set_nodelay(on),
        }
    }
    pub fn nodelay(&self) -> io::Result<bool> {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.nodelay(c.id),
            Inner::Tcp(s) => s.nodelay(),
        }
    }

    /// SO_LINGER, applied when the last handle of the stream is dropped: `None` (the default)
    /// closes in the background (what was written is still delivered); `Some(ZERO)` aborts,
    /// as TCP's reset (the peer's calls fail with ECONNRESET, undelivered bytes are dropped;
    /// at process exit too); `Some(d)` makes that drop wait up to `d` until the peer has
    /// everything written, then closes as without it.
    pub fn set_linger(&self, linger: Option<Duration>) -> io::Result<()> {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.set_linger(c.id, linger),
            Inner::Tcp(s) => sys::set_linger(s.as_raw_fd(), linger),
        }
    }
    pub fn linger(&self) -> io::Result<Option<Duration>> {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.linger(c.id),
            Inner::Tcp(s) => sys::linger(s.as_raw_fd()),
        }
    }

    /// SO_SNDBUF: bytes that may be queued and not yet acknowledged by the peer.
    pub fn set_send_buffer_size(&self, bytes: usize) -> io::Result<()> {
        if bytes == 0 {
            return Err(invalid("buffer size must be positive"));
        }
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.set_sndbuf(c.id, bytes),
            Inner::Tcp(s) => sys::setsockopt_int(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                bytes.min(i32::MAX as usize) as i32,
            ),
        }
    }
    pub fn send_buffer_size(&self) -> io::Result<usize> {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.sndbuf(c.id),
            Inner::Tcp(s) => {
                Ok(sys::getsockopt_int(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF)? as usize)
            }
        }
    }

    /// SO_RCVBUF: bytes the receive side may hold (received and not read, plus room the peer
    /// may still fill). Over SDP, receive buffers of the connection's buffer size, within the
    /// stack's `Config::max_rx_bufs` and at least `MIN_RX_POSTED` of them; over TCP the
    /// kernel's (which doubles the value).
    pub fn set_recv_buffer_size(&self, bytes: usize) -> io::Result<()> {
        if bytes == 0 {
            return Err(invalid("buffer size must be positive"));
        }
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.set_rcvbuf(c.id, bytes),
            Inner::Tcp(s) => sys::setsockopt_int(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                bytes.min(i32::MAX as usize) as i32,
            ),
        }
    }
    /// The receive buffer size in force (see [`SdpStream::set_recv_buffer_size`]).
    pub fn recv_buffer_size(&self) -> io::Result<usize> {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.rcvbuf(c.id),
            Inner::Tcp(s) => {
                Ok(sys::getsockopt_int(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF)? as usize)
            }
        }
    }

    /// Bytes written and not yet acknowledged by the peer (Linux `SIOCOUTQ`): 0 once the
    /// peer holds everything written so far (in its receive buffers, read or not).
    pub fn send_queue_len(&self) -> io::Result<usize> {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.send_queue_len(c.id),
            Inner::Tcp(s) => sys::tcp_outq(s.as_raw_fd()),
        }
    }

    /// SO_ERROR: the connection's error, once.
    pub fn take_error(&self) -> io::Result<Option<io::Error>> {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.take_error(c.id),
            Inner::Tcp(s) => s.take_error(),
        }
    }

    /// Register a buffer of `len` bytes on this stream's stack for zero-copy sends and
    /// receives ([`SdpStream::send_registered`], [`SdpStream::recv_registered`]).
    pub fn register(&self, len: usize) -> io::Result<RegisteredBuf> {
        match &self.inner {
            Inner::Sdp(c) => {
                let mr = c.stack.0.register(len)?;
                if mr.host_ptr().is_none() {
                    return Err(io::Error::new(
                        io::ErrorKind::Unsupported,
                        "this transport's memory is not in the process",
                    ));
                }
                Ok(RegisteredBuf {
                    mr,
                    stack: Some(c.stack.clone()),
                })
            }
            Inner::Tcp(_) => Ok(RegisteredBuf {
                mr: Box::new(HeapMr::new(len)),
                stack: None,
            }),
        }
    }

    /// Send `buf[range]` without copying (large ranges) and return once the peer has the
    /// bytes. The memory is reachable by the peer only during the call.
    pub fn send_registered(
        &self,
        buf: &mut RegisteredBuf,
        range: std::ops::Range<usize>,
    ) -> io::Result<usize> {
        let len = range_len(&range)?;
        match &self.inner {
            Inner::Sdp(c) => {
                buf.check_stack(&c.stack)?;
                c.stack
                    .0
                    .send_registered(c.id, &mut buf.mr, range.start, len)
            }
            Inner::Tcp(s) => {
                let bytes = buf
                    .as_slice()
                    .get(range)
                    .ok_or_else(|| invalid("bad range"))?;
                (&**s).write_all(bytes)?;
                Ok(bytes.len())
            }
        }
    }

    /// Start sending `buf[range]` without copying and return at once, so several zero-copy
    /// sends can be in flight (the peer reads the next while we advertise more, like an RDMA
    /// benchmark's transmit depth). The [`PendingSend`] owns the buffer until the peer has the
    /// bytes: [`PendingSend::wait`] gives it back with the bytes sent (all of `range`; a part
    /// the peer did not take by zero copy, after a cancel or timeout, is sent by copy, in order).
    /// The peer may read the memory only while the send is pending (remote read is granted at
    /// the start and revoked when the engine reports it done).
    ///
    /// Sends complete in the order issued, and bytes written afterwards (by `write` or another
    /// send) follow them in the stream. Small ranges (below the zero-copy threshold) are sent by
    /// copy before this returns. Over a TCP-fallback stream the bytes are written at once.
    /// Dropping a `PendingSend` waits until the send is done, so the memory is never
    /// reachable after it is freed. On an error at the start the buffer is dropped.
    ///
    /// ```no_run
    /// # use sdp_core::socket::{SdpStream, PendingSend};
    /// # fn main() -> std::io::Result<()> {
    /// let s = SdpStream::connect("127.0.0.1:7000")?;
    /// const SIZE: usize = 64 * 1024;
    /// let mut inflight = std::collections::VecDeque::new();
    /// for _ in 0..4 {
    ///     let mut b = s.register(SIZE)?;
    ///     b.as_mut_slice().fill(7);
    ///     inflight.push_back(s.send_registered_async(b, 0..SIZE)?);
    /// }
    /// for _ in 0..100 {
    ///     // Refill the oldest buffer once the peer has it, and send it again.
    ///     let (mut b, _sent) = inflight.pop_front().unwrap().wait()?;
    ///     b.as_mut_slice().fill(8);
    ///     inflight.push_back(s.send_registered_async(b, 0..SIZE)?);
    /// }
    /// for p in inflight {
    ///     p.wait()?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn send_registered_async(
        &self,
        mut buf: RegisteredBuf,
        range: std::ops::Range<usize>,
    ) -> io::Result<PendingSend> {
        let len = range_len(&range)?;
        match &self.inner {
            Inner::Sdp(c) => {
                buf.check_stack(&c.stack)?;
                let RegisteredBuf { mr, stack } = buf;
                match c.stack.0.send_registered_async(c.id, mr, range.start, len) {
                    ZStart::Pending(ticket) => Ok(PendingSend {
                        state: Some(PendingState::Sdp {
                            core: c.clone(),
                            ticket,
                            stack,
                        }),
                    }),
                    ZStart::Done(mr, r) => {
                        let n = r?;
                        Ok(PendingSend {
                            state: Some(PendingState::Ready(RegisteredBuf { mr, stack }, n)),
                        })
                    }
                }
            }
            Inner::Tcp(_) => {
                let n = self.send_registered(&mut buf, range)?;
                Ok(PendingSend {
                    state: Some(PendingState::Ready(buf, n)),
                })
            }
        }
    }

    /// Receive into `buf[range]`: a peer's zero-copy send lands there directly. Returns the
    /// bytes received (0 at EOF).
    pub fn recv_registered(
        &self,
        buf: &mut RegisteredBuf,
        range: std::ops::Range<usize>,
    ) -> io::Result<usize> {
        let len = range_len(&range)?;
        match &self.inner {
            Inner::Sdp(c) => {
                buf.check_stack(&c.stack)?;
                c.stack
                    .0
                    .recv_registered(c.id, &mut buf.mr, range.start, len)
            }
            Inner::Tcp(s) => {
                let dst = buf
                    .as_mut_slice()
                    .get_mut(range)
                    .ok_or_else(|| invalid("bad range"))?;
                (&**s).read(dst)
            }
        }
    }

    fn sdp_read(c: &Core, buf: &mut [u8]) -> io::Result<usize> {
        let t = *c.read_timeout.lock();
        c.stack.0.read(c.id, buf, c.wait(t))
    }
    fn sdp_write(c: &Core, buf: &[u8]) -> io::Result<usize> {
        let t = *c.write_timeout.lock();
        c.stack.0.write(c.id, buf, c.wait(t))
    }
}

impl Read for &SdpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &self.inner {
            Inner::Sdp(c) => SdpStream::sdp_read(c, buf),
            Inner::Tcp(s) => (&**s).read(buf),
        }
    }
}

impl Write for &SdpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &self.inner {
            Inner::Sdp(c) => SdpStream::sdp_write(c, buf),
            Inner::Tcp(s) => (&**s).write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match &self.inner {
            Inner::Sdp(c) => {
                let b = bufs
                    .iter()
                    .find(|b| !b.is_empty())
                    .map_or(&[][..], |b| &**b);
                SdpStream::sdp_write(c, b)
            }
            Inner::Tcp(s) => (&**s).write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for SdpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for SdpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for SdpStream {
    /// The readiness fd (SDP) or the socket (TCP). For SDP it polls readable, writable and
    /// hung up as the stream does; it is not for reading or writing data. -1 if it cannot be
    /// made (out of fds).
    fn as_raw_fd(&self) -> RawFd {
        match &self.inner {
            Inner::Sdp(c) => c.stack.0.ready_fd(c.id).unwrap_or(-1),
            Inner::Tcp(s) => s.as_raw_fd(),
        }
    }
}

impl AsFd for SdpStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        let fd = self.as_raw_fd();
        assert!(fd >= 0, "SDP readiness fd could not be created");
        // SAFETY: the readiness fd lives as long as the connection's entry in the stack,
        // which lasts at least as long as this stream (it is removed when the last clone
        // drops).
        unsafe { BorrowedFd::borrow_raw(fd) }
    }
}

/// Memory registered for zero-copy sends and receives on one stack.
pub struct RegisteredBuf {
    mr: DynMr,
    stack: Option<Stack>,
}

impl std::fmt::Debug for RegisteredBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuf")
            .field("len", &self.mr.len())
            .finish()
    }
}

impl RegisteredBuf {
    fn check_stack(&self, s: &Stack) -> io::Result<()> {
        match &self.stack {
            Some(mine) if Arc::ptr_eq(&mine.0, &s.0) => Ok(()),
            _ => Err(invalid("buffer registered on another stream's stack")),
        }
    }
    pub fn len(&self) -> usize {
        self.mr.len()
    }
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }
    pub fn as_slice(&self) -> &[u8] {
        let p = self.mr.host_ptr().expect("checked at registration");
        // SAFETY: the region's memory is valid for len() bytes while the region lives, and
        // no remote access is granted outside send/recv calls, which borrow `self` mutably.
        unsafe { std::slice::from_raw_parts(p.as_ptr(), self.mr.len()) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let p = self.mr.host_ptr().expect("checked at registration");
        // SAFETY: as in as_slice, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), self.mr.len()) }
    }
}

/// A zero-copy send in flight ([`SdpStream::send_registered_async`]); it owns the buffer
/// until the peer has the bytes. Dropping it waits for that.
pub struct PendingSend {
    state: Option<PendingState>,
}

enum PendingState {
    /// Outstanding in the runtime, which holds the region. The stream's core is kept so the
    /// connection is not closed under the send.
    Sdp {
        core: Arc<Core>,
        ticket: u64,
        stack: Option<Stack>,
    },
    /// Done already (copied, or over TCP).
    Ready(RegisteredBuf, usize),
}

impl std::fmt::Debug for PendingSend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSend")
            .field("done", &self.is_done())
            .finish()
    }
}

impl PendingSend {
    /// The peer has the bytes (or the send failed): [`PendingSend::wait`] returns at once.
    pub fn is_done(&self) -> bool {
        match &self.state {
            Some(PendingState::Sdp { core, ticket, .. }) => core
                .stack
                .0
                .send_registered_peek(core.id, *ticket)
                .unwrap_or(true),
            _ => true,
        }
    }

    /// Wait until the peer has the bytes; the buffer back and the bytes sent.
    pub fn wait(mut self) -> io::Result<(RegisteredBuf, usize)> {
        match self.state.take() {
            Some(PendingState::Sdp {
                core,
                ticket,
                stack,
            }) => {
                let (mr, r) = core
                    .stack
                    .0
                    .send_registered_poll(core.id, ticket, true)?
                    .ok_or_else(|| io::Error::from(io::ErrorKind::WouldBlock))?;
                let n = r?;
                Ok((RegisteredBuf { mr, stack }, n))
            }
            Some(PendingState::Ready(buf, n)) => Ok((buf, n)),
            None => Err(invalid("send already taken")),
        }
    }
}

impl Drop for PendingSend {
    fn drop(&mut self) {
        if let Some(PendingState::Sdp { core, ticket, .. }) = self.state.take() {
            // The region is freed only once the engine is done with it.
            let _ = core.stack.0.send_registered_poll(core.id, ticket, true);
        }
    }
}

/// Plain heap memory standing in for a registered buffer on a TCP stream.
///
/// The bytes are `Cell`s because [`MemoryRegion::host_ptr`](crate::verbs::MemoryRegion::host_ptr)
/// hands out a pointer from `&self` that [`RegisteredBuf::as_mut_slice`] writes through: the
/// memory has to allow writes behind a shared reference, which a `Box<[u8]>` does not.
struct HeapMr {
    buf: Box<[Cell<u8>]>,
}

impl HeapMr {
    fn new(len: usize) -> HeapMr {
        HeapMr {
            buf: vec![Cell::new(0u8); len].into_boxed_slice(),
        }
    }
    fn ptr(&self) -> std::ptr::NonNull<u8> {
        // `Cell<u8>` has the layout of `u8`.
        std::ptr::NonNull::from(&*self.buf).cast::<u8>()
    }
}

impl crate::verbs::MemoryRegion for HeapMr {
    fn lkey(&self) -> u32 {
        0
    }
    fn rkey(&self) -> u32 {
        0
    }
    fn addr(&self) -> u64 {
        self.ptr().as_ptr() as u64
    }
    fn len(&self) -> usize {
        self.buf.len()
    }
    fn access(&self) -> crate::verbs::Access {
        crate::verbs::Access::LOCAL_WRITE
    }
    fn host_ptr(&self) -> Option<std::ptr::NonNull<u8>> {
        Some(self.ptr())
    }
    fn set_access(&mut self, _: crate::verbs::Access) -> Result<(), crate::verbs::VerbsError> {
        Ok(())
    }
    fn advertise(
        &mut self,
        _: usize,
        _: usize,
        _: crate::verbs::Access,
    ) -> Result<crate::verbs::Grant, crate::verbs::VerbsError> {
        // A TCP stream moves bytes by copy: nothing is ever advertised to a peer.
        Err(crate::verbs::VerbsError::Invalid(
            "plain memory has no remote keys",
        ))
    }
    fn revoke(&mut self, _: &crate::verbs::Grant) -> Result<(), crate::verbs::VerbsError> {
        Err(crate::verbs::VerbsError::Invalid(
            "plain memory has no remote keys",
        ))
    }
    fn read(&self, off: usize, dst: &mut [u8]) {
        let src = &self.buf[off..off + dst.len()];
        for (d, c) in dst.iter_mut().zip(src) {
            *d = c.get();
        }
    }
    fn write(&mut self, off: usize, src: &[u8]) {
        for (c, s) in self.buf[off..off + src.len()].iter_mut().zip(src) {
            *c.get_mut() = *s;
        }
    }
}

/// The length of a byte range a caller gave (EINVAL if it runs backwards).
fn range_len(range: &std::ops::Range<usize>) -> io::Result<usize> {
    range
        .end
        .checked_sub(range.start)
        .ok_or_else(|| invalid("bad range"))
}

#[cfg(test)]
mod tests {
    use super::HeapMr;
    use crate::verbs::MemoryRegion;

    #[test]
    fn heap_mr_bytes_written_through_host_ptr_read_back() {
        let mut mr = HeapMr::new(16);
        assert_eq!(mr.len(), 16);
        let p = mr.host_ptr().unwrap();
        assert_eq!(mr.addr(), p.as_ptr() as u64);
        // As RegisteredBuf::as_mut_slice does: write through the host pointer.
        // SAFETY: p is valid for len() bytes while mr lives, and nothing else refers to them.
        let s = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), mr.len()) };
        s.copy_from_slice(&[7u8; 16]);
        mr.write(4, &[1, 2, 3]);
        let mut out = [0u8; 8];
        mr.read(2, &mut out);
        assert_eq!(out, [7, 7, 1, 2, 3, 7, 7, 7]);
        let empty = HeapMr::new(0);
        assert!(empty.is_empty());
        assert!(empty.host_ptr().is_some());
    }
}
