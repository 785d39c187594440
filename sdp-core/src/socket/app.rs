//! Application-fd mode: SDP sockets whose file descriptor is a real kernel file, for the
//! LD_PRELOAD shim (`sdp-preload`) and any program that wants TCP's fd semantics exactly.
//!
//! An [`AppStream`]'s fd is the user end of an AF_UNIX stream pair that the runtime drives to
//! the connection's state (see `ready::AppReady`): readable when a read would return, writable
//! when a write would not block, POLLRDHUP after the peer's FIN, POLLHUP when both halves are
//! done, POLLERR (ECONNRESET) when the connection failed. So poll, select, epoll in every mode,
//! dup, fork, fd passing, FD_CLOEXEC, O_NONBLOCK and F_SETOWN act on a kernel file natively.
//! The stream's bytes do not pass through that file: reads and writes are made on the SDP
//! connection by [`AppStream::read`] / [`AppStream::write`], which block *in the kernel* on the
//! fd (a `MSG_PEEK` receive, a one-byte send) when they must wait, so O_NONBLOCK, SO_RCVTIMEO,
//! SO_SNDTIMEO, signals and SA_RESTART behave as they do for a TCP socket.
//!
//! An [`AppListener`] serves a kernel TCP listening socket the application owns: SDP clients
//! are accepted on the same address, and each one ready to be accepted is announced by a
//! *doorbell*, a loopback TCP connection to the listener, so the listener's own fd polls
//! readable; [`AppListener::claim_doorbell`] recognises a doorbell among accepted connections
//! and [`AppListener::take_claimed`] hands out the SDP connection instead. A doorbell is rung
//! only for a connection that has none (see `Bells`), so the listener's fd never polls readable
//! for nothing.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::stack::{Options, Stack};
use super::Transport;
use crate::driver::ListenerId;
use crate::proto::table::ConnId;
use crate::proto::{Shutdown, State};
use crate::sys;

static THREAD_START: OnceLock<fn()> = OnceLock::new();

/// Run `f` at the start of every thread the socket layer starts (its progress threads), before
/// anything else there. The shim uses it to mark those threads as its own, so their system
/// calls go straight to libc. Only the first call takes effect.
pub fn set_thread_start_hook(f: fn()) {
    let _ = THREAD_START.set(f);
}

pub(crate) fn run_thread_start_hook() {
    if let Some(f) = THREAD_START.get() {
        f();
    }
}

/// Fork with this process's SDP connections going on in the child, as `daemon()` and
/// `ssh -f` need (the parent ends at once): `fork` is called with the connections ready to
/// move (every peer paused, nothing of the runtime running; see `StackOps::fork_moving`), and
/// in the child they are its own from then on, at full speed. Over shm only: connections over
/// rdma, whose queue pairs do not survive a fork, stay behind as after any fork. Returns
/// `fork`'s result; in the parent (> 0) the caller must end the process (`_exit`) without
/// another SDP call. Listeners are not moved: share them first, as any fork does (the child
/// takes a listener over once its owner is gone).
pub fn fork_moving(mut fork: impl FnMut() -> libc::pid_t) -> libc::pid_t {
    match super::stack::Stack::shm_started() {
        Some(s) => s.0.fork_moving(&mut fork),
        None => fork(),
    }
}

/// In the process this process's connections moved to ([`fork_moving`]), whose application
/// closed every fd of them: wait until no stream is pumped for other processes any more (each
/// ended with its last holder's close). The shim's keeper of an exiting owner whose children
/// hold its streams (`if (fork()) _exit(0)`) waits so, then exits.
pub fn wait_for_other_holders() {
    if let Some(s) = super::stack::Stack::shm_started() {
        s.0.wait_pumps_done();
    }
}

/// A connection's state and counters (TCP_INFO, FIONREAD, SIOCOUTQ, reports).
#[derive(Debug, Clone)]
pub struct AppInfo {
    pub state: State,
    /// Bytes received and not read yet, as FIONREAD counts them (up to an urgent mark ahead).
    pub rx_queued: usize,
    /// Bytes written and not acknowledged yet (SIOCOUTQ).
    pub tx_queued: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// SDP messages received and sent (data and control).
    pub msgs_in: u64,
    pub msgs_out: u64,
    /// Bytes that went by zero copy (either way).
    pub zcopy_bytes: u64,
    /// Send credits (peer receive buffers) available now.
    pub credits: u32,
    /// The largest message the peer receives.
    pub send_size: u32,
    pub read_closed: bool,
    pub write_closed: bool,
    /// The connection's error, as errno.
    pub error: Option<i32>,
    /// An urgent byte waits.
    pub urgent: bool,
    /// SIOCATMARK: the next byte read is the one after the urgent byte.
    pub at_mark: bool,
}

/// Flags of a read: `MSG_PEEK`, `MSG_WAITALL`, `MSG_DONTWAIT`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadFlags {
    pub peek: bool,
    pub waitall: bool,
    pub dontwait: bool,
}

/// How [`AppStream::poll_then_wait`] ended.
enum Waited {
    /// Polling found the connection readable.
    Ready,
    /// A signal came while polling whose handler interrupts a sleeping read.
    Interrupted,
    /// The wait in the kernel, and how it ended.
    Kernel(io::Result<()>),
}

/// An SDP connection whose application fd is a kernel file (see the module docs). Dropping it
/// closes the connection as `close(2)` closes a TCP socket.
pub struct AppStream {
    stack: Stack,
    id: ConnId,
    /// The fd's bytes flow through the kernel file (see [`AppStream::share`]); the runtime sets
    /// it too, when another process's request shares the stream (`runtime::share`).
    shared: Arc<Sharing>,
    /// The destination of a connect, whose end teaches automatic choice (`history`).
    dest: Option<SocketAddr>,
    /// The listener that accepted it, told how it ended ([`Handed`]).
    listener: Option<Arc<Handed>>,
    /// SO_RCVLOWAT ([`AppStream::set_rcvlowat`]; 0 until set).
    lowat: std::sync::atomic::AtomicUsize,
    /// [`AppStream::want_edges`] was called.
    edges: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for AppStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AppStream({}, {:?})", self.stack.transport(), self.id)
    }
}

impl Drop for AppStream {
    fn drop(&mut self) {
        if let (Some(dest), false) = (self.dest, self.is_shared()) {
            if let Ok(i) = self.info() {
                super::history::record_end(dest, i.msgs_in + i.msgs_out, i.bytes_in + i.bytes_out);
            }
        }
        self.stack.0.close(self.id);
        if let Some(l) = self.listener.as_ref().filter(|_| !self.is_inherited()) {
            // (The close shared it if another process still holds the file.)
            l.ended(self.is_shared());
        }
        super::runtime::APP_STREAMS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How an [`AppListener`]'s accepted connections end, for its choice of transport. A
/// connection the accepting process hands to another (accept, fork, the parent closes its copy
/// and the child serves: inetd, sshd, PostgreSQL, rsync's daemon) is pumped through the kernel
/// file by the accepting process for its whole life (`socket::pump`), slower than kernel TCP
/// (PostgreSQL's pgbench TPC-B 0.37-0.52x). After [`FORK_HANDED`] in a row ended so, the
/// listener turns new SDP requests away (connectors fall back to kernel TCP at once; those
/// queued are still accepted); one served to its end in the accepting process resets the count.
#[derive(Default)]
pub struct Handed {
    in_a_row: std::sync::atomic::AtomicU32,
    /// Kernel TCP from now on.
    off: std::sync::atomic::AtomicBool,
    /// The shim was told (`AppListener::sdp_turned_off`).
    told: std::sync::atomic::AtomicBool,
    /// The listener's SDP listeners, to turn away new requests at once.
    subs: Mutex<Vec<(Stack, ListenerId)>>,
}

impl std::fmt::Debug for Handed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handed")
            .field("in_a_row", &self.in_a_row)
            .field("off", &self.off)
            .finish()
    }
}

/// See [`Handed`].
pub const FORK_HANDED: u32 = 4;

impl Handed {
    fn ended(&self, handed_on: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        if !handed_on {
            self.in_a_row.store(0, Relaxed);
        } else if self.in_a_row.fetch_add(1, Relaxed) + 1 >= FORK_HANDED
            && !self.off.swap(true, Relaxed)
        {
            for (s, l) in self.subs.lock().iter() {
                s.0.set_listener_refusing(*l, true);
            }
        }
    }

    /// The listener's SDP listeners are now `subs` (new ones turn requests away if SDP is off).
    fn set_subs(&self, subs: Vec<(Stack, ListenerId)>) {
        let mut g = self.subs.lock();
        if self.off.load(std::sync::atomic::Ordering::Relaxed) {
            for (s, l) in &subs {
                s.0.set_listener_refusing(*l, true);
            }
        }
        *g = subs;
    }
}

/// Whether a stream's bytes go through its kernel file, and what the connection carried in all
/// once its pump ended (see [`AppStream::share`]).
#[derive(Debug, Default)]
pub struct Sharing {
    pub(crate) shared: std::sync::atomic::AtomicBool,
    /// A fork child inherited the stream's fd (see [`AppStream::expose`]).
    pub(crate) exposed: std::sync::atomic::AtomicBool,
    /// Bytes in and out and by zero copy, when the connection's pump ended.
    pub(crate) last: parking_lot::Mutex<Option<(u64, u64, u64)>>,
    /// The application's socket is AF_INET6 ([`AppStream::set_v6_socket`]).
    pub(crate) v6: std::sync::atomic::AtomicBool,
}

impl Sharing {
    /// The stream's bytes go through its kernel file.
    pub fn is_shared(&self) -> bool {
        self.shared.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A fork child inherited the stream's fd: another process may hold its file.
    pub fn is_exposed(&self) -> bool {
        self.exposed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes in, out and by zero copy over the connection's whole life, once the pump of a
    /// shared stream ended (other processes' bytes included); `None` before.
    pub fn last_counts(&self) -> Option<(u64, u64, u64)> {
        *self.last.lock()
    }
}

/// Whether a connect's error says the listener turned SDP away on purpose (a forking
/// server's: [`Handed`]), or the connect gave up on a process of this host that did not answer
/// or accept in time (`runtime::Patience`), rather than that nothing listens there over SDP:
/// worth remembering
/// for a while (`history::record_refused`), since asking cost a round trip to that process.
pub fn turned_away(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::ConnectionRefused
        && e.raw_os_error().is_none()
        && [
            crate::verbs::REJECT_SDP_OFF,
            crate::verbs::REJECT_SHARED_SLOW,
            crate::verbs::REJECT_LOCAL_SILENT,
        ]
        .contains(&e.to_string().as_str())
}

/// Whether an [`AppStream`] call's error says the stream became shared during the call
/// (another process holding its fd asked to use it): the call is to be made again on the kernel
/// file, as for any shared stream.
pub fn is_shared_now(e: &io::Error) -> bool {
    super::runtime::is_shared_now(e)
}

/// Whether event waits poll first: the process has SDP streams. The shim's hooks ask it before
/// anything else, so a program without SDP streams pays one load for its event waits.
#[inline]
pub fn event_waits_poll() -> bool {
    super::runtime::APP_STREAMS.load(std::sync::atomic::Ordering::Relaxed) > 0
}

/// An event wait of the application's (`epoll_wait`, `poll`; the shim's hooks) with
/// `timeout_ms`, made by `wait(timeout)` (the real function: its count, or -1 with errno
/// set): while the process has SDP streams it polls before it sleeps, as their blocking reads
/// do (see the runtime's `poll_events`). Returns what the C function returns.
pub fn poll_events(timeout_ms: i32, wait: impl FnMut(i32) -> i32) -> i32 {
    let n = super::runtime::poll_events(timeout_ms, wait);
    super::exit::park_if_frozen();
    n
}

/// [`poll_events`] for calls with finer timeouts (`select`, `ppoll`): `timeout` `None` waits
/// without one; `wait` gets the time left (`Some(ZERO)`: a poll).
pub fn poll_events_for(
    timeout: Option<std::time::Duration>,
    wait: impl FnMut(Option<std::time::Duration>) -> i32,
) -> i32 {
    let n = super::runtime::poll_events_for(timeout, wait);
    super::exit::park_if_frozen();
    n
}

/// A millisecond timeout of `epoll_wait` or `poll` (negative: none) as a length, for
/// [`poll_events_for`] and [`poll_events_masked`].
pub fn timeout_of_ms(ms: i32) -> Option<std::time::Duration> {
    super::runtime::timeout_of_ms(ms)
}

/// The time left of such a wait as its millisecond timeout (`None`: -1), rounded up as the
/// kernel rounds its own wait up.
pub fn ms_of_timeout(t: Option<std::time::Duration>) -> i32 {
    super::runtime::ms_of_timeout(t)
}

/// [`poll_events_for`] for the calls given a signal mask for their wait (`ppoll`, `pselect`,
/// `epoll_pwait`, `epoll_pwait2` with a mask): `poll()` tries once without waiting and without
/// the mask, `wait(left)` is the real call with the caller's `mask` and the time left. Signals
/// act as on the real call: those `mask` lets through interrupt it, the others wait for the
/// thread's own mask.
pub fn poll_events_masked(
    timeout: Option<std::time::Duration>,
    mask: &libc::sigset_t,
    poll: impl FnMut() -> i32,
    wait: impl FnOnce(Option<std::time::Duration>) -> i32,
) -> i32 {
    let n = super::runtime::poll_events_masked(timeout, mask, poll, wait);
    super::exit::park_if_frozen();
    n
}

/// Errors after which a connector should use kernel TCP: the peer or the path does not do SDP
/// (nobody listens over SDP there, no device or route, the peer refused us).
pub fn falls_back(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ECONNREFUSED | libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EADDRNOTAVAIL)
    ) || e.raw_os_error().is_none()
}

/// `MSG_DONTWAIT` when asked.
fn dontwait(on: bool) -> i32 {
    if on {
        libc::MSG_DONTWAIT
    } else {
        0
    }
}

impl AppStream {
    /// Connect over SDP (the stack [`Options`] picks for `addr`) and make the application fd.
    /// Errors for which [`falls_back`] holds mean: use kernel TCP.
    pub fn connect(
        addr: SocketAddr,
        opts: &Options,
        nonblocking: bool,
        cloexec: bool,
    ) -> io::Result<(AppStream, OwnedFd)> {
        let stack = match opts.stack_for(addr.ip())? {
            Some(s) => s,
            None => return Err(io::Error::from_raw_os_error(libc::ENETUNREACH)),
        };
        // A nonblocking connect cannot wait for room in a full listen queue: it fails
        // (ECONNREFUSED), so the shim's caller goes to kernel TCP, whose SYN waits there; nor
        // long for a process of this host to answer (a stopped server: TCP's completes).
        let patience = if nonblocking {
            super::runtime::Patience::NONBLOCKING
        } else {
            super::runtime::Patience::BLOCKING
        };
        let id = stack.0.connect(
            addr,
            opts.source_for(addr),
            opts.connect_timeout,
            !nonblocking,
            Some(patience),
        )?;
        let mut s = AppStream::new(stack, id);
        s.dest = Some(addr);
        let fd = s.stack.0.app_attach(id, nonblocking, cloexec)?;
        Ok((s, fd))
    }

    pub(crate) fn accepted(
        stack: Stack,
        id: ConnId,
        nonblocking: bool,
        cloexec: bool,
    ) -> io::Result<(AppStream, OwnedFd)> {
        let s = AppStream::new(stack, id);
        let fd = s.stack.0.app_attach(id, nonblocking, cloexec)?;
        Ok((s, fd))
    }

    fn new(stack: Stack, id: ConnId) -> AppStream {
        super::runtime::APP_STREAMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        AppStream {
            stack,
            id,
            shared: Arc::default(),
            dest: None,
            listener: None,
            lowat: Default::default(),
            edges: Default::default(),
        }
    }

    /// SO_RCVLOWAT, as TCP's: the application fd `fd` polls readable once `lowat` bytes wait
    /// (or at end of stream, after an error, or when the receive buffers are full), and a
    /// blocking read waits for `lowat` bytes (at most its length; what came by then when
    /// SO_RCVTIMEO runs out). Nonblocking reads return what there is.
    pub fn set_rcvlowat(&self, fd: RawFd, lowat: usize) -> io::Result<()> {
        self.lowat
            .store(lowat, std::sync::atomic::Ordering::Relaxed);
        self.stack.0.app_set_rcvlowat(self.id, fd, lowat)
    }

    /// The application's fd is watched for edges (an edge-triggered epoll registration, or
    /// O_ASYNC): every arrival of data must make a new edge (and SIGIO), as over TCP, so every
    /// message brings a token. Until then one token while any is unread keeps the fd
    /// readable for the level-triggered waits, the writer making no system call for the
    /// others (nginx's header and body, a stream's messages while the reader reads big
    /// chunks). For the stream's life; nothing for a stream whose bytes go through the kernel
    /// file (real bytes make their edges).
    pub fn want_edges(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.edges.load(Relaxed) || self.edges.swap(true, Relaxed) {
            return;
        }
        if !self.is_inherited() {
            self.stack.0.app_want_edges(self.id);
        }
    }

    /// SO_LINGER for the close that ends the stream (its last fd): `Some(ZERO)` resets the
    /// connection, `Some(d)` waits up to `d` for the peer to hold what was written (see
    /// `SdpStream::set_linger`).
    pub fn set_linger(&self, linger: Option<std::time::Duration>) -> io::Result<()> {
        self.stack.0.set_linger(self.id, linger)
    }

    /// The fd `fd` (this stream's) is about to be shared with another process (exec, fd
    /// passing), or another process holding it wants to use it: from now on the stream's bytes
    /// flow through the kernel file, and every holder reads and writes it natively (`read(2)`,
    /// `send(2)`...); the owning process's runtime pumps them over SDP until the last holder
    /// closes the file. In a process other than the owner (a fork child), the owner is asked
    /// to; the stream is treated as shared here whatever its answer (an error: the owner is
    /// gone, and the file shows the connection's end). [`AppStream::read`] and
    /// [`AppStream::write`] must not be used after this; [`AppStream::is_shared`] says so.
    pub fn share(&self, fd: RawFd) -> io::Result<()> {
        if self
            .shared
            .shared
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Ok(());
        }
        if self.is_inherited() {
            return self.stack.0.app_join(self.id, fd);
        }
        // Other processes hold the file from now on: the runtime keeps what the connection
        // carried in all for this process's report when the pump ends, as for a stream a fork
        // exposed.
        // SAFETY: `fd` is the caller's open fd of this stream, for the call.
        let file = crate::sys::file_identity(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) });
        if let Ok(file) = file {
            self.stack
                .0
                .app_expose(self.id, file, self.shared.clone())?;
        }
        self.stack.0.app_share(self.id, fd)
    }

    /// A child is about to be forked, which inherits this stream's fd, whose kernel file is
    /// `file`: the stream keeps its speed until a process uses the child's copy (that process
    /// calls [`AppStream::share`], which asks this one), so a child that ignores it costs
    /// nothing. Nothing in a process that does not own the stream.
    pub fn expose(&self, file: (u64, u64)) -> io::Result<()> {
        if self.is_inherited() {
            return Ok(());
        }
        self.stack.0.app_expose(self.id, file, self.shared.clone())
    }

    /// The application's last fd of this stream in this process (`fd`) is about to close: a
    /// stream a fork exposed stops its readiness protocol, so the close can tell whether
    /// another process holds the file (then its bytes go on through it) or not (then the
    /// connection closes as TCP's would). Nothing for other streams.
    pub fn before_last_close(&self, fd: RawFd) {
        if !self.is_inherited() && !self.is_shared() {
            self.stack.0.app_quiesce(self.id, fd);
        }
    }

    /// Whether the stream is shared and its counts once its pump ended, to read later (a
    /// report taken at a close that shares the stream).
    pub fn sharing(&self) -> Arc<Sharing> {
        self.shared.clone()
    }

    /// This process got the stream from its parent by fork: the connection is the parent's.
    pub fn is_inherited(&self) -> bool {
        self.stack.0.owner_pid() != crate::sys::getpid()
    }

    /// Whether the fd is shared (its bytes flow through the kernel file).
    pub fn is_shared(&self) -> bool {
        self.shared.is_shared()
    }

    /// The application's socket is AF_INET6 (a dual-stack one, whose IPv4 addresses the
    /// kernel shows v4-mapped): once the stream is shared, a process that receives its fd by
    /// SCM_RIGHTS sees them so too ([`shared_stream_addrs`]). Node's cluster and python's
    /// dual-stack servers listen on `::` and pass IPv4 clients to workers. Set in the owner,
    /// before the stream can be shared.
    pub fn set_v6_socket(&self) {
        self.shared
            .v6
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a fork child inherited the fd since the stream was made (see
    /// [`AppStream::expose`]): another process may hold its file.
    pub fn is_exposed(&self) -> bool {
        self.shared.is_exposed()
    }

    /// What carries the stream.
    pub fn transport(&self) -> Transport {
        self.stack.transport()
    }

    /// Read into `buf` as `recv(2)` on a TCP socket would; `fd` is the stream's application
    /// fd (any dup of it), on which a blocking call waits.
    pub fn read(&self, fd: RawFd, buf: &mut [u8], flags: ReadFlags) -> io::Result<usize> {
        let r = self.read_now(fd, buf, flags);
        super::exit::park_if_frozen();
        r
    }

    fn read_now(&self, fd: RawFd, buf: &mut [u8], flags: ReadFlags) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut got = 0;
        let mut reset_seen = false;
        // SO_RCVLOWAT: a blocking read waits for that many bytes (at most its length).
        let lowat = self.lowat.load(std::sync::atomic::Ordering::Relaxed);
        let min = if lowat > 1
            && !flags.peek
            && !flags.waitall
            && !flags.dontwait
            && sys::is_blocking(fd)
        {
            lowat.min(buf.len())
        } else {
            1
        };
        loop {
            match self
                .stack
                .0
                .app_read(self.id, fd, &mut buf[got..], flags.peek, min)
            {
                Ok(0) => return Ok(got),
                Ok(n) => {
                    got += n;
                    if !flags.waitall || flags.peek || got == buf.len() {
                        return Ok(got);
                    }
                    // MSG_WAITALL returns at the urgent mark, as TCP's.
                    if self.stack.0.app_info(self.id).is_ok_and(|i| i.at_mark) {
                        return Ok(got);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let waited = match self.poll_then_wait(fd, flags.dontwait) {
                        Waited::Ready => continue,
                        Waited::Interrupted if got > 0 => return Ok(got),
                        Waited::Interrupted => {
                            return Err(io::Error::from_raw_os_error(libc::EINTR))
                        }
                        Waited::Kernel(r) => r,
                    };
                    if let Err(e) = waited {
                        if got > 0 {
                            return Ok(got);
                        }
                        if min > 1 && e.kind() == io::ErrorKind::WouldBlock {
                            // SO_RCVTIMEO ran out below the mark: what came, as TCP's.
                            return match self.stack.0.app_read(self.id, fd, buf, false, 1) {
                                Ok(n) => Ok(n),
                                Err(_) => Err(e),
                            };
                        }
                        match e.raw_os_error() {
                            // The runtime closed its end: the connection failed; its own
                            // error (after any data) comes from the next attempt (once: an
                            // end closed while the connection still says nothing to read
                            // must not make this loop spin).
                            Some(libc::ECONNRESET) if !reset_seen => {
                                reset_seen = true;
                                continue;
                            }
                            _ => return Err(e),
                        }
                    }
                }
                // Shared meanwhile: the caller reads the kernel file (`is_shared_now`).
                Err(e) => return if got > 0 { Ok(got) } else { Err(e) },
            }
        }
    }

    /// A read found nothing: wait as a blocking `recv` on a TCP socket would. A read that may
    /// sleep (a blocking fd without SO_RCVTIMEO, no MSG_DONTWAIT) first polls the connection
    /// for the runtime's poll time, as the socket API's blocking calls do: a peer that answers
    /// within it is caught without a sleep and a wakeup (sockperf's ping-pong under the shim,
    /// both ends blocking in `recv`: p50 ~4 us instead of ~34). Signals are held back while it
    /// polls; one that comes ends the poll within microseconds and is handled as a sleeping
    /// `recv` would meet it: a handler without SA_RESTART makes the call fail with EINTR, one
    /// with SA_RESTART (or a default or ignored disposition) lets it wait on. Then, or at
    /// once, it waits in the kernel on `fd` (`sys::wait_readable`).
    fn poll_then_wait(&self, fd: RawFd, dontwait_flag: bool) -> Waited {
        let ops = &self.stack.0;
        let spin = if dontwait_flag {
            std::time::Duration::ZERO
        } else {
            ops.app_poll_time()
        };
        if spin.is_zero() || !sys::read_may_sleep_untimed(fd) {
            return Waited::Kernel(sys::wait_readable(fd, dontwait(dontwait_flag)));
        }
        let start = std::time::Instant::now();
        if let Some(held) = sys::SignalsHeld::hold() {
            let ready = ops.app_poll_readable(self.id, spin, &|| held.came());
            if held.release().not_restarting {
                return Waited::Interrupted;
            }
            if ready {
                ops.app_waited(start.elapsed());
                return Waited::Ready;
            }
        }
        let r = sys::wait_readable(fd, 0);
        ops.app_waited(start.elapsed());
        Waited::Kernel(r)
    }

    /// Write `buf` as `send(2)` on a TCP socket would: a blocking call returns once every byte
    /// is queued (or a signal or SO_SNDTIMEO cut it short after some went).
    pub fn write(&self, fd: RawFd, buf: &[u8], dontwait_flag: bool) -> io::Result<usize> {
        let r = self.write_now(fd, buf, dontwait_flag);
        super::exit::park_if_frozen();
        r
    }

    fn write_now(&self, fd: RawFd, buf: &[u8], dontwait_flag: bool) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut done = 0;
        let mut waited_err = false;
        loop {
            match self.stack.0.app_write(self.id, fd, &buf[done..]) {
                Ok(n) => {
                    done += n;
                    if done == buf.len() {
                        return Ok(done);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if waited_err {
                        return if done > 0 { Ok(done) } else { Err(e) };
                    }
                    if let Err(e) = sys::wait_writable(fd, dontwait(dontwait_flag)) {
                        if done > 0 {
                            return Ok(done);
                        }
                        match e.raw_os_error() {
                            // Our end is gone (the connection failed): its error comes from
                            // the next attempt.
                            Some(libc::EPIPE | libc::ECONNRESET) => waited_err = true,
                            _ => return Err(e),
                        }
                    }
                }
                Err(e) => return if done > 0 { Ok(done) } else { Err(e) },
            }
        }
    }

    /// `send(MSG_OOB)` as TCP: every byte but the last goes in the stream (blocking as
    /// [`AppStream::write`]), the last as urgent data (POLLPRI and SIGURG at the peer).
    pub fn write_urgent(&self, fd: RawFd, buf: &[u8], dontwait: bool) -> io::Result<usize> {
        let Some((&last, head)) = buf.split_last() else {
            return Ok(0);
        };
        let n = self.write(fd, head, dontwait)?;
        if n < head.len() {
            return Ok(n);
        }
        loop {
            match self.stack.0.app_send_urgent(self.id, fd, last) {
                Ok(()) => return Ok(buf.len()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && !dontwait => {
                    if let Err(e) = sys::wait_writable(fd, 0) {
                        return if n > 0 { Ok(n) } else { Err(e) };
                    }
                }
                Err(e) => return if n > 0 { Ok(n) } else { Err(e) },
            }
        }
    }

    /// `recv(MSG_OOB)` as TCP: the urgent byte, or EINVAL if there is none (never blocks).
    pub fn read_urgent(&self, fd: RawFd, peek: bool) -> io::Result<u8> {
        self.stack
            .0
            .app_read_urgent(self.id, fd, peek)?
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))
    }

    pub fn shutdown(&self, fd: RawFd, how: std::net::Shutdown) -> io::Result<()> {
        let how = match how {
            std::net::Shutdown::Read => Shutdown::Read,
            std::net::Shutdown::Write => Shutdown::Write,
            std::net::Shutdown::Both => Shutdown::Both,
        };
        self.stack.0.app_shutdown(self.id, fd, how)
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.stack.0.addrs(self.id).map(|a| a.0)
    }
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.stack.0.addrs(self.id).map(|a| a.1)
    }
    /// SO_ERROR: the connection's error, once.
    pub fn take_error(&self) -> io::Result<Option<io::Error>> {
        self.stack.0.take_error(self.id)
    }
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.stack.0.set_nodelay(self.id, on)
    }
    /// SO_OOBINLINE: urgent bytes that arrive from now on stay in the stream, at the mark.
    pub fn set_oob_inline(&self, on: bool) -> io::Result<()> {
        self.stack.0.set_oob_inline(self.id, on)
    }
    pub fn set_send_buffer_size(&self, bytes: usize) -> io::Result<()> {
        self.stack.0.set_sndbuf(self.id, bytes.max(1))
    }
    pub fn send_buffer_size(&self) -> io::Result<usize> {
        self.stack.0.sndbuf(self.id)
    }
    pub fn set_recv_buffer_size(&self, bytes: usize) -> io::Result<()> {
        self.stack.0.set_rcvbuf(self.id, bytes.max(1))
    }
    pub fn recv_buffer_size(&self) -> io::Result<usize> {
        self.stack.0.rcvbuf(self.id)
    }
    pub fn info(&self) -> io::Result<AppInfo> {
        self.stack.0.app_info(self.id)
    }
}

/// The doorbells of one listener. Invariant kept under the lock: `rung.len() + in_hand` is at
/// least the number of SDP connections ready to be accepted (the sum over the stacks), so every
/// ready connection has a doorbell; and a doorbell is rung only when that sum exceeds them, so
/// the listener's fd does not poll readable for a connection that is not there (an
/// application's `accept` after `select` would block in the kernel).
#[derive(Default)]
struct Bells {
    /// Rung and not yet accepted from the kernel, by their local address.
    rung: HashMap<SocketAddr, OwnedFd>,
    /// Accepted from the kernel by the application ([`AppListener::claim_doorbell`]), their
    /// SDP connection not yet taken: still counted, or the progress thread would ring again
    /// for the connection about to be taken.
    in_hand: usize,
    /// Connections ready to be accepted, per SDP stack, as each stack last said (it says so
    /// under its own lock, after every change: progress and accept alike).
    ready: Vec<usize>,
}

struct BellShared {
    target: SocketAddr,
    bells: Mutex<Bells>,
    /// The application's listening socket's TCP_DEFER_ACCEPT (seconds; 0: none): the kernel
    /// queues a connection for its accept only once data came, so a doorbell carries a byte
    /// (never read: a claimed doorbell is closed by reset); and the SDP listeners hand out a
    /// connection only once it has data, or waited as long ([`crate::driver::Driver::set_defer_accept`]).
    defer_secs: std::sync::atomic::AtomicU32,
}

impl BellShared {
    /// Stack `i` has `ready` connections ready to be accepted.
    fn set_ready(&self, i: usize, ready: usize) {
        let mut b = self.bells.lock();
        if b.ready.len() <= i {
            b.ready.resize(i + 1, 0);
        }
        b.ready[i] = ready;
        self.top_up(&mut b);
    }

    fn knocks(&self) -> bool {
        self.defer() > 0
    }

    fn defer(&self) -> u32 {
        self.defer_secs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Ring until every ready connection has a doorbell (`b`: our bells, locked).
    fn top_up(&self, b: &mut Bells) {
        let want: usize = b.ready.iter().sum();
        while b.rung.len() + b.in_hand < want {
            match ring(self.target, self.knocks()) {
                Ok((local, fd)) => {
                    b.rung.insert(local, fd);
                }
                Err(_) => return,
            }
        }
    }
}

/// A doorbell the application accepted from the kernel, its SDP connection to be taken with
/// [`AppListener::take_claimed`]. Dropping it untaken gives its count back.
pub struct BellClaim {
    /// `None`: a doorbell for a request handed off (a shared listener's; see `Handoff`).
    shared: Option<Arc<BellShared>>,
}

impl Drop for BellClaim {
    fn drop(&mut self) {
        let Some(shared) = &self.shared else { return };
        let mut b = shared.bells.lock();
        b.in_hand = b.in_hand.saturating_sub(1);
        shared.top_up(&mut b);
    }
}

/// A listener of this process's own stack, with the pid it was made in (a forked child's copy
/// is its parent's).
type OwnListener = (u32, Stack, ListenerId);

/// Slots of a shared listener's doorbell table (each a `u32`: 0, or `BELL_LIVE | port`); slot
/// 0 counts the live ones.
const HANDOFF_SLOTS: usize = 4096;
const BELL_LIVE: u32 = 1 << 16;
/// The word after the slots: nonzero once a holder exec'd a program that keeps the listener
/// ([`AppListener::held_across_exec`]).
const BLIND_SLOT: usize = HANDOFF_SLOTS;
/// How long a process that took a handed-off request waits for the connector's part of the
/// setup (a local round trip; a connector that died meanwhile is never handed out).
const ADOPT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// How often that wait looks whether the setup is still under way: a setup this process
/// refused (a connector of another user) ends it without a wakeup, so every accept of such a
/// connector's doorbell waited one slice (20 ms: apache's www-data workers with root's clients,
/// 144 requests/s against TCP's 16 000).
const ADOPT_SLICE: std::time::Duration = std::time::Duration::from_millis(1);

/// A listener shared by processes (after fork: a prefork server's workers, nginx's): any of
/// them may accept, so none can set SDP connections up before its `accept` (the memory and
/// fds of a connection belong to one process). The listener's creator (the *owner*) hands
/// every SDP request, unanswered, into `queue` (a seqpacket pair all holders inherit) and
/// rings a doorbell for it, whose port it writes into `table` (a shared page all holders
/// inherit) before connecting. The process whose `accept` gets the doorbell finds the port
/// there, takes a request from the queue (they are interchangeable, as doorbells are) and
/// answers it on its own stack, so the connection is its own from the start; the connector
/// learns which process answered from the kernel's credentials on the answer.
struct Handoff {
    table: sys::Mapping,
    /// The queue's receiving end (its sending end is the owner's listener's).
    rx: OwnedFd,
    /// A copy of the queue's sending end every holder has: once the owner is gone, the holder
    /// that takes the listener over hands requests with it ([`AppListener::maintain`]).
    tx: OwnedFd,
    /// This process's own rendezvous listener if it took the listener over (with the pid it
    /// did so in), and when it last tried.
    taken_over: Mutex<(Option<OwnListener>, Option<std::time::Instant>)>,
    /// This process's adopting listener (made at the first request it takes) and the process
    /// it was made in (a forked child makes its own).
    adopted: Mutex<Option<OwnListener>>,
    /// The owner's doorbells for handed requests, with their slot and its value, until the
    /// slot no longer holds it (the taker claimed it): then our end closes.
    rung: Mutex<Vec<(usize, u32, OwnedFd)>>,
    /// The owner's listener's doorbell state (its address, whether doorbells knock).
    bells: Arc<BellShared>,
    local: SocketAddr,
    backlog: u32,
}

impl Handoff {
    fn new(
        bells: Arc<BellShared>,
        local: SocketAddr,
        backlog: u32,
    ) -> io::Result<(Handoff, OwnedFd)> {
        let len = (BLIND_SLOT + 1) * 4;
        let mem = sys::memfd_sized("sdp-doorbells", len)?;
        let table = sys::Mapping::map(std::os::fd::AsFd::as_fd(&mem), len, true)?;
        let (tx, rx) = sys::seqpacket_pair()?;
        Ok((
            Handoff {
                table,
                rx,
                tx: sys::dup_high(tx.as_raw_fd())?,
                taken_over: Mutex::new((None, None)),
                adopted: Mutex::new(None),
                rung: Mutex::new(Vec::new()),
                bells,
                local,
                backlog,
            },
            tx,
        ))
    }

    fn slot(&self, i: usize) -> &std::sync::atomic::AtomicU32 {
        self.table.u32(i * 4)
    }

    /// The slots a doorbell from `port` may sit in, in the order it is looked for (slot 0 is
    /// the count).
    fn slots_for(port: u16) -> impl Iterator<Item = usize> {
        let n = HANDOFF_SLOTS - 1;
        (0..n).map(move |k| 1 + (port as usize + k) % n)
    }

    /// Owner: ring a doorbell for each of `n` requests just handed off (a loopback connect
    /// whose port is in the table before the connect starts); close the doorbells claimed.
    fn ring(&self, n: usize) {
        use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};
        let mut rung = self.rung.lock();
        if self.slot(BLIND_SLOT).load(Acquire) != 0 {
            // A program that knows nothing of SDP holds the listener: a doorbell it accepted
            // would be a connection nobody speaks on. The requests go back unanswered (their
            // connectors go to kernel TCP) and the doorbells not claimed yet reset.
            self.send_back_requests();
            for (i, v, fd) in rung.drain(..) {
                if self.slot(i).compare_exchange(v, 0, AcqRel, Relaxed).is_ok() {
                    self.slot(0).fetch_sub(1, AcqRel);
                }
                drop(fd);
            }
            return;
        }
        rung.retain(|(i, v, _)| self.slot(*i).load(Relaxed) == *v);
        for _ in 0..n {
            let Ok((fd, local)) = sys::doorbell_socket(SocketAddr::new(self.bells.target.ip(), 0))
            else {
                return;
            };
            let v = BELL_LIVE | local.port() as u32;
            let Some(i) = Self::slots_for(local.port())
                .find(|&i| self.slot(i).compare_exchange(0, v, AcqRel, Relaxed).is_ok())
            else {
                // Table full: the request waits in the queue for another doorbell's taker.
                return;
            };
            self.slot(0).fetch_add(1, AcqRel);
            if sys::connect_nb(fd.as_raw_fd(), self.bells.target)
                .and_then(|()| knock(fd.as_raw_fd(), self.bells.knocks()))
                .is_err()
            {
                if self.slot(i).compare_exchange(v, 0, AcqRel, Relaxed).is_ok() {
                    self.slot(0).fetch_sub(1, AcqRel);
                }
                return;
            }
            rung.push((i, v, fd));
        }
    }

    /// Take every request waiting in the queue and drop it unanswered: its connector goes to
    /// kernel TCP at once.
    fn send_back_requests(&self) {
        while let sys::Recv::Msg(..) =
            sys::recv_msg(std::os::fd::AsFd::as_fd(&self.rx), &mut [0u8; 8])
        {}
    }

    /// Whether a connection accepted from `peer` is one of the owner's doorbells; if so it is
    /// claimed (cleared from the table: claimed once, by one process).
    fn claim(&self, peer: SocketAddr) -> bool {
        use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};
        if peer.ip() != self.bells.target.ip() || self.slot(0).load(Acquire) == 0 {
            return false;
        }
        let v = BELL_LIVE | peer.port() as u32;
        for i in Self::slots_for(peer.port()) {
            if self.slot(i).load(Relaxed) == v
                && self.slot(i).compare_exchange(v, 0, AcqRel, Relaxed).is_ok()
            {
                self.slot(0).fetch_sub(1, AcqRel);
                return true;
            }
        }
        false
    }

    /// Take a handed-off request from the queue and answer it on this process's own stack;
    /// the connection once set up. `None` if there was no request or its connector, alive,
    /// gave up waiting for an accept (it went to kernel TCP, where its connection will come
    /// from); an error if the connector died ([`gone_before_accept`]).
    fn take(
        &self,
        nonblocking: bool,
        cloexec: bool,
    ) -> Option<io::Result<(AppStream, OwnedFd, SocketAddr)>> {
        let mut buf = [0u8; 8];
        let request = match sys::recv_msg(std::os::fd::AsFd::as_fd(&self.rx), &mut buf) {
            sys::Recv::Msg(_, fds) => fds.into_iter().next()?,
            _ => return None,
        };
        // Looked at only if the setup fails (a pid reused since reads as alive: passed by).
        let connector = sys::peer_cred(std::os::fd::AsFd::as_fd(&request)).map(|(pid, _)| pid);
        let gone = || match connector.map(sys::Proc::open) {
            Ok(Ok(p)) if p.alive() => None,
            _ => Some(Err(gone_before_accept())),
        };
        let (stack, l) = match self.adopting() {
            Ok(x) => x,
            Err(e) => return Some(Err(e)),
        };
        if stack.0.adopt(l, request).is_err() {
            return gone();
        }
        // Until it is set up, or nothing is under way any more (the connector went away), or
        // ADOPT_WAIT passed.
        let start = std::time::Instant::now();
        let w = super::runtime::Wait {
            nonblocking: false,
            timeout: Some(ADOPT_SLICE),
            ..Default::default()
        };
        let (id, peer) = loop {
            match stack.0.accept(l, w) {
                Ok(x) => break x,
                Err(_) if start.elapsed() < ADOPT_WAIT && stack.0.listener_busy(l) => {}
                Err(_) => return gone(),
            }
        };
        Some(AppStream::accepted(stack, id, nonblocking, cloexec).map(|(s, fd)| (s, fd, peer)))
    }

    /// This process's adopting listener, made at the first call.
    fn adopting(&self) -> io::Result<(Stack, ListenerId)> {
        let pid = std::process::id();
        let mut a = self.adopted.lock();
        if let Some((p, s, l)) = a.as_ref() {
            if crate::sys::is_this_process(*p) && s.0.alive() {
                return Ok((s.clone(), *l));
            }
        }
        let s = Stack::shm()?;
        let l = s.0.listen_adopted(self.local, self.backlog)?;
        s.0.set_listener_defer(l, self.bells.defer());
        *a = Some((pid, s.clone(), l));
        Ok((s, l))
    }
}

/// A doorbell `fd` just connecting carries a byte if it must (see `BellShared::knock`).
fn knock(fd: RawFd, must: bool) -> io::Result<()> {
    if !must {
        return Ok(());
    }
    // A loopback connect completes within the connect call as a rule: the wait is for a
    // connect that raced a busy softirq.
    sys::send_byte_when_connected(fd, std::time::Duration::from_millis(50))
}

/// A nonblocking loopback connect to `target` from a bound local address.
fn ring(target: SocketAddr, knock_too: bool) -> io::Result<(SocketAddr, OwnedFd)> {
    let (fd, local) = sys::doorbell_socket(SocketAddr::new(target.ip(), 0))?;
    sys::connect_nb(fd.as_raw_fd(), target)?;
    knock(fd.as_raw_fd(), knock_too)?;
    Ok((local, fd))
}

/// SDP listeners beside an application's kernel TCP listening socket (see the module docs).
pub struct AppListener {
    sdp: Mutex<Vec<AppSub>>,
    shared: Arc<BellShared>,
    local: SocketAddr,
    backlog: u32,
    /// The stacks were chosen here: one whose device went away is made anew when it is back.
    own_stacks: bool,
    /// The process that made it (its stacks are that process's).
    pid: u32,
    /// Shared with other processes ([`AppListener::share`]).
    handoff: OnceLock<Arc<Handoff>>,
    /// How its accepted connections ended ([`Handed`]).
    handed: Arc<Handed>,
}

/// One SDP listener of an [`AppListener`] (its index is its doorbell count's).
struct AppSub {
    stack: Stack,
    id: ListenerId,
    /// Its stack failed (the device went away): when to try listening anew.
    retry_at: Option<std::time::Instant>,
}

impl std::fmt::Debug for AppListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppListener")
            .field("target", &self.shared.target)
            .field(
                "sdp",
                &self
                    .sdp
                    .lock()
                    .iter()
                    .map(|s| s.stack.transport())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Drop for AppListener {
    fn drop(&mut self) {
        for sub in self.sdp.get_mut().iter() {
            sub.stack.0.close_listener(sub.id);
        }
        if let Some(h) = self.handoff.get() {
            for (p, s, l) in [h.adopted.lock().take(), h.taken_over.lock().0.take()]
                .into_iter()
                .flatten()
            {
                if crate::sys::is_this_process(p) {
                    s.0.close_listener(l);
                }
            }
        }
    }
}

impl AppListener {
    /// Listen over SDP on the address of `tcp_fd`, a kernel TCP socket already listening,
    /// with the backlog the application gave `listen(2)` (at most backlog + 1 SDP clients
    /// wait to be accepted, as kernel TCP clients do).
    pub fn new(tcp_fd: RawFd, backlog: u32, opts: &Options) -> io::Result<AppListener> {
        let local = sys::local_addr_of(tcp_fd)?;
        let target = match local.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => {
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), local.port())
            }
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), local.port())
            }
            _ => local,
        };
        let shared = Arc::new(BellShared {
            target,
            bells: Mutex::new(Bells::default()),
            defer_secs: (sys::getsockopt_int(tcp_fd, libc::IPPROTO_TCP, libc::TCP_DEFER_ACCEPT)
                .unwrap_or(0)
                .max(0) as u32)
                .into(),
        });
        if sys::getsockopt_int(tcp_fd, libc::SOL_SOCKET, libc::SO_REUSEPORT).unwrap_or(0) != 0 {
            // An SO_REUSEPORT group's socket: the kernel spreads connections over the group,
            // and a doorbell in another process's socket would be taken for a TCP client (its
            // SDP client would wait for ever). The listener is the group's first socket (the
            // shim makes one an SDP listener only while no other socket listens on the port),
            // number 0, and later ones of other processes serve kernel TCP only: doorbells go
            // to it, clients by the kernel's hash.
            sys::steer_doorbells(tcp_fd, 0)?;
        }
        let mut sdp = Vec::new();
        let mut errs = Vec::new();
        let (stacks, missing) = opts.listen_stacks(local)?;
        errs.extend(missing);
        for s in stacks {
            match s.0.listen(local, backlog) {
                Ok(l) => {
                    let sh = shared.clone();
                    let i = sdp.len();
                    s.0.set_listener_bell(l, Arc::new(move |n| sh.set_ready(i, n)))?;
                    s.0.set_listener_defer(l, shared.defer());
                    sdp.push(AppSub {
                        stack: s,
                        id: l,
                        retry_at: None,
                    });
                }
                Err(e) => errs.push(format!("{}: {e}", s.transport())),
            }
        }
        if sdp.is_empty() {
            return Err(io::Error::other(errs.join("; ")));
        }
        let handed = Arc::new(Handed::default());
        handed.set_subs(sdp.iter().map(|s| (s.stack.clone(), s.id)).collect());
        Ok(AppListener {
            sdp: Mutex::new(sdp),
            shared,
            local,
            backlog,
            own_stacks: opts.stack.is_none(),
            pid: std::process::id(),
            handoff: OnceLock::new(),
            handed,
        })
    }

    /// The application's listening socket got TCP_DEFER_ACCEPT set to `secs` (0: cleared):
    /// the doorbells that announce SDP clients carry a byte from now on, or the kernel would
    /// not queue them for its accept, and SDP clients are announced once they sent data (or
    /// waited the deferral out), as the kernel does for TCP's (the value at
    /// [`AppListener::new`] is read from the socket).
    pub fn set_defer_accept(&self, secs: u32) {
        self.shared
            .defer_secs
            .store(secs, std::sync::atomic::Ordering::Relaxed);
        for s in self.sdp.lock().iter() {
            s.stack.0.set_listener_defer(s.id, secs);
        }
        if let Some(h) = self.handoff.get() {
            // This process's listeners of a shared one: the one it adopts handed requests on,
            // and its own if it took the listener over (not a parent's, copied by a fork).
            let adopted = h.adopted.lock().clone();
            let taken = h.taken_over.lock().0.clone();
            for (p, s, l) in adopted.into_iter().chain(taken) {
                if crate::sys::is_this_process(p) {
                    s.0.set_listener_defer(l, secs);
                }
            }
        }
    }

    /// Whether the listener can move with this process's connections to a fork child
    /// ([`fork_moving`]) instead of being shared: this process's own, not shared yet, and
    /// over shm only (a listener over rdma does not survive a fork).
    pub fn movable(&self) -> bool {
        crate::sys::is_this_process(self.pid)
            && self.handoff.get().is_none()
            && self
                .sdp
                .lock()
                .iter()
                .all(|s| s.stack.transport() == super::Transport::Shm)
    }

    /// A process holding this shared listener is about to wait for connections on it (an
    /// `accept`, an epoll registration): the stack and listener it answers handed-off SDP
    /// requests on are made now, not at its first client, whose connect would wait for them
    /// (a worker's first adoption cost that client 10-20 ms; a nonblocking connect waits only
    /// `runtime::Patience::NONBLOCKING` for an accept). Nothing for a listener not shared.
    pub fn prepare_accept(&self) {
        if let Some(h) = self.handoff.get() {
            let _ = h.adopting();
        }
    }

    /// The listener is about to be shared with other processes (fork): from now on every
    /// process holding it may accept SDP clients (see `Handoff`). Only SDP over shm can go
    /// to another process; other transports' listeners close here (their clients fall back
    /// to kernel TCP). An error leaves it unshared (the caller serves it by kernel TCP only).
    pub fn share(&self) -> io::Result<()> {
        if self.handoff.get().is_some() {
            return Ok(());
        }
        if !crate::sys::is_this_process(self.pid) {
            return Err(io::Error::other("not the listener's own process"));
        }
        let mut subs = self.sdp.lock();
        let Some(i) = subs
            .iter()
            .position(|s| s.stack.transport() == Transport::Shm && s.retry_at.is_none())
        else {
            return Err(io::Error::other("no SDP listener that can be shared"));
        };
        let (h, tx) = Handoff::new(self.shared.clone(), self.local, self.backlog)?;
        let h = Arc::new(h);
        let ringer = h.clone();
        let sub = &subs[i];
        sub.stack
            .0
            .set_handoff(sub.id, tx, Arc::new(move |n| ringer.ring(n)))?;
        let _ = self.handoff.set(h);
        // Those set up already cannot move to the process that will accept their doorbells.
        self.pump_queued_in(&subs);
        for (k, sub) in subs.iter().enumerate() {
            if k != i {
                sub.stack.0.close_listener(sub.id);
                self.shared.set_ready(k, 0);
            }
        }
        let keep = subs.swap_remove(i);
        subs.clear();
        subs.push(keep);
        Ok(())
    }

    /// The listener's fd is about to be held by a program that knows nothing of this
    /// process's SDP connections (an exec in place): the connections waiting to be accepted
    /// go on through their doorbells (`AppListener::pump_queued_in`), and the listener
    /// stops listening over SDP, so new clients go to kernel TCP, where that program accepts
    /// them (a process that carries this one's connections on, the shim's keeper, would
    /// otherwise take them). Returns how many go on through their doorbells.
    pub fn hand_to_exec(&self) -> usize {
        if !crate::sys::is_this_process(self.pid) {
            return 0;
        }
        let mut subs = self.sdp.lock();
        let n = self.pump_queued_in(&subs);
        for (i, sub) in subs.drain(..).enumerate() {
            sub.stack.0.close_listener(sub.id);
            self.shared.set_ready(i, 0);
        }
        n
    }

    /// The SDP connections set up and waiting to be accepted (`subs`: our listeners, locked)
    /// go on through their doorbells: each rung doorbell becomes its connection's kernel
    /// file, a plain loopback TCP connection pumped by this process's runtime
    /// (`socket::pump`). Whichever process accepts it then (a fork child, the program an
    /// exec starts: socket activation, inetd's `wait` services, a prefork server's workers)
    /// gets a working connection, where before only this process's `accept` could take it
    /// (anyone else got a doorbell that never spoke, or a reset after an exec). Slower (the
    /// bytes cross the kernel twice more), for the connections queued at that moment only;
    /// the peer address the acceptor sees is the doorbell's. Not when doorbells knock
    /// (TCP_DEFER_ACCEPT): theirs carried a byte the acceptor would read.
    fn pump_queued_in(&self, subs: &[AppSub]) -> usize {
        if self.shared.knocks() {
            return 0;
        }
        let mut n = 0;
        loop {
            // Counted in hand while its connection is taken (as an accepted doorbell's), so
            // the ready count falling and rising meanwhile rings no doorbell for it.
            let (bell, claim) = {
                let mut b = self.shared.bells.lock();
                let Some(local) = b.rung.keys().next().copied() else {
                    break;
                };
                let Some(fd) = b.rung.remove(&local) else {
                    break;
                };
                b.in_hand += 1;
                (
                    fd,
                    BellClaim {
                        shared: Some(self.shared.clone()),
                    },
                )
            };
            let w = super::runtime::Wait {
                nonblocking: true,
                ..Default::default()
            };
            let taken = subs
                .iter()
                .filter(|s| s.retry_at.is_none())
                .find_map(|s| s.stack.0.accept(s.id, w).ok().map(|(id, _)| (s, id)));
            let Some((sub, id)) = taken else {
                // A doorbell left from a connection that failed in the queue: its acceptor
                // reads a reset, as a client's that went away before accept.
                drop((bell, claim));
                break;
            };
            // Closed as a TCP connection from here (a doorbell resets; this one ends in
            // order once both ends are done).
            let _ = sys::set_linger(bell.as_raw_fd(), None);
            match sub.stack.0.app_pump_through(id, bell) {
                Ok(()) => n += 1,
                // Its doorbell closed with it: the acceptor reads a reset.
                Err(_) => sub.stack.0.close(id),
            }
            drop(claim);
        }
        n
    }

    /// The listener's fd is about to be held by a program exec'd from a process that shares it
    /// (inetd's `wait` services: a fork child execs the server, which accepts): that program
    /// knows nothing of SDP, so from now on the listener's owner sends new SDP clients to
    /// kernel TCP (their connects refused here, as to a listener without SDP). Nothing for a
    /// listener not shared.
    pub fn held_across_exec(&self) {
        if let Some(h) = self.handoff.get() {
            h.slot(BLIND_SLOT)
                .store(1, std::sync::atomic::Ordering::Release);
            // Requests handed meanwhile go back unanswered now: their connectors go to
            // kernel TCP at once rather than after their wait for an accept.
            h.send_back_requests();
        }
    }

    /// Whether the listener is shared with other processes ([`AppListener::share`]).
    pub fn is_shared(&self) -> bool {
        self.handoff.get().is_some()
    }

    /// The SDP transports listening.
    pub fn transports(&self) -> Vec<Transport> {
        self.sdp
            .lock()
            .iter()
            .map(|s| s.stack.transport())
            .collect()
    }

    /// Look after SDP listeners whose stack failed (their device went away): each is made
    /// anew on a fresh stack once the device is back, at most every second. The shim calls
    /// this when the application accepts a kernel TCP client: the SDP clients that came while
    /// nobody listened over SDP fell back to TCP, so they are what brings it back.
    ///
    /// A shared listener whose owner is gone (it exited after the fork: a daemon's parent,
    /// nginx started with `daemon on`) is taken over the same way: the first holder to accept
    /// a kernel TCP client listens on its rendezvous name (free once the owner is gone; taken
    /// while it lives) and hands requests to the holders from then on, itself included.
    pub fn maintain(&self) {
        if let Some(h) = self.handoff.get() {
            if !crate::sys::is_this_process(self.pid) {
                self.take_over(h);
            }
            return;
        }
        if !crate::sys::is_this_process(self.pid) {
            // Another process's stacks (a forked child's copy).
            return;
        }
        let now = std::time::Instant::now();
        let mut subs = self.sdp.lock();
        let mut changed = false;
        for (i, sub) in subs.iter_mut().enumerate() {
            if sub.retry_at.is_none() {
                if sub.stack.0.alive() {
                    continue;
                }
                sub.retry_at = Some(now);
                self.shared.set_ready(i, 0);
            }
            if !self.own_stacks || sub.retry_at.is_some_and(|t| t > now) {
                continue;
            }
            sub.retry_at = Some(now + std::time::Duration::from_secs(1));
            let sh = self.shared.clone();
            let bell = |s: &Stack, id| {
                s.0.set_listener_bell(id, Arc::new(move |n| sh.set_ready(i, n)))
            };
            if super::stack::listen_again(
                &mut sub.stack,
                &mut sub.id,
                self.local,
                self.backlog,
                bell,
            ) {
                sub.retry_at = None;
                changed = true;
            }
        }
        if changed {
            self.handed
                .set_subs(subs.iter().map(|s| (s.stack.clone(), s.id)).collect());
        }
    }

    /// See [`AppListener::maintain`]: at most every second.
    fn take_over(&self, h: &Arc<Handoff>) {
        let pid = std::process::id();
        let now = std::time::Instant::now();
        let mut t = h.taken_over.lock();
        if t.0
            .as_ref()
            .is_some_and(|(p, s, _)| crate::sys::is_this_process(*p) && s.0.alive())
            || t.1
                .is_some_and(|at| now < at + std::time::Duration::from_secs(1))
        {
            return;
        }
        t.1 = Some(now);
        let Ok(stack) = Stack::shm() else { return };
        // The name is taken while the owner (or a holder that took over) lives.
        let Ok(l) = stack.0.listen(self.local, self.backlog) else {
            return;
        };
        stack.0.set_listener_defer(l, h.bells.defer());
        let ringer = h.clone();
        let handed = sys::dup_high(h.tx.as_raw_fd()).and_then(|tx| {
            stack
                .0
                .set_handoff(l, tx, Arc::new(move |n| ringer.ring(n)))
        });
        if handed.is_err() {
            stack.0.close_listener(l);
            return;
        }
        t.0 = Some((pid, stack, l));
    }

    /// Whether a connection accepted from the TCP listener, coming from `peer`, is one of our
    /// doorbells. If so it is claimed: the caller closes the accepted fd (with
    /// [`AppListener::close_doorbell`]) and takes the SDP connection with
    /// [`AppListener::take_claimed`].
    pub fn claim_doorbell(&self, peer: SocketAddr) -> Option<BellClaim> {
        if let Some(h) = self.handoff.get() {
            if h.claim(peer) {
                return Some(BellClaim { shared: None });
            }
        }
        if !crate::sys::is_this_process(self.pid) {
            return None;
        }
        let mut b = self.shared.bells.lock();
        b.rung.remove(&peer)?;
        b.in_hand += 1;
        Some(BellClaim {
            shared: Some(self.shared.clone()),
        })
    }

    /// Close an accepted doorbell connection without leaving TIME_WAIT behind.
    pub fn close_doorbell(fd: OwnedFd) {
        Self::doorbell_resets(fd.as_raw_fd());
        drop(fd);
    }

    /// An accepted doorbell connection `fd` closes by reset (no TIME_WAIT), however it closes.
    pub fn doorbell_resets(fd: RawFd) {
        let _ = sys::set_linger_zero(fd);
    }

    /// Take the SDP connection a doorbell announced (or another one ready: doorbells are
    /// interchangeable), with its application fd. `None`: nothing to take, its client went to
    /// kernel TCP instead (its connection comes there); an error of [`is_gone_before_accept`]:
    /// the client went away before this accept (TCP's accept would hand its connection out,
    /// to read its end), or another error of accept.
    pub fn take_claimed(
        &self,
        claim: BellClaim,
        nonblocking: bool,
        cloexec: bool,
    ) -> Option<io::Result<(AppStream, OwnedFd, SocketAddr)>> {
        if claim.shared.is_none() {
            let r = self.handoff.get()?.take(nonblocking, cloexec);
            return r.map(|r| r.map(|a| self.accepted_here(a)));
        }
        // The stack's accept says the new ready count (under its lock) before the claim's
        // count goes back: never a moment where the connection being taken is counted ready
        // without a doorbell counted for it. None ready: the one this doorbell was rung for
        // failed or timed out in the queue (a doorbell is rung only for a ready connection).
        let r = self.take(nonblocking, cloexec);
        drop(claim);
        Some(r.unwrap_or_else(|| Err(gone_before_accept())))
    }

    /// A stream this listener accepted: it tells the listener how it ended ([`Handed`]).
    fn accepted_here(
        &self,
        (mut s, fd, peer): (AppStream, OwnedFd, SocketAddr),
    ) -> (AppStream, OwnedFd, SocketAddr) {
        s.listener = Some(self.handed.clone());
        (s, fd, peer)
    }

    /// Whether the listener turned SDP off ([`Handed`]: its accepted connections kept going on
    /// in other processes), the first time it is asked after it did (to say so once).
    pub fn sdp_turned_off(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.handed.off.load(Relaxed) && !self.handed.told.swap(true, Relaxed)
    }

    /// Take an SDP connection that is ready to be accepted, if any, with its application fd.
    pub fn take(
        &self,
        nonblocking: bool,
        cloexec: bool,
    ) -> Option<io::Result<(AppStream, OwnedFd, SocketAddr)>> {
        for sub in self.sdp.lock().iter().filter(|s| s.retry_at.is_none()) {
            let w = super::runtime::Wait {
                nonblocking: true,
                ..Default::default()
            };
            match sub.stack.0.accept(sub.id, w) {
                Ok((id, peer)) => {
                    return Some(
                        AppStream::accepted(sub.stack.clone(), id, nonblocking, cloexec)
                            .map(|(s, fd)| self.accepted_here((s, fd, peer))),
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // Its device went away: nothing to take there (`maintain` looks after it).
                Err(_) if !sub.stack.0.alive() => {}
                Err(e) => return Some(Err(e)),
            }
        }
        None
    }
}

/// The addresses (local, peer) of the SDP stream whose application fd `fd` is, when this
/// process got it from another (SCM_RIGHTS) and the stream is shared (its bytes go through the
/// file; `socket::shared_name`); `None` for any other fd. A system call per fd asked about.
pub fn shared_stream_addrs(fd: RawFd) -> Option<(SocketAddr, SocketAddr)> {
    super::shared_name::decode(&sys::peer_abstract_name(fd)?)
}

/// The error [`AppListener::take_claimed`] gives for a client that went away before accept.
fn gone_before_accept() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "the SDP client went away before accept",
    )
}

/// Whether `e`, from [`AppListener::take_claimed`], says the client went away before accept.
pub fn is_gone_before_accept(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::ConnectionAborted
}

/// `sockaddr_storage` for an address, and its length (for the shim's address arguments).
pub fn to_sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    sys::sockaddr_of(a)
}

/// The address in a `sockaddr_storage` (AF_INET or AF_INET6 only).
pub fn from_sockaddr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    sys::sockaddr_to(ss)
}
