//! The progress engine behind the socket API: one [`Runtime`] per provider per process.
//!
//! A runtime owns a [`Driver`] (every SDP connection of that provider) behind one lock, and a
//! progress thread. Progress is made by whoever is there (docs/waiting.md):
//!
//! * an application thread in a blocking call polls the provider itself, for an adaptive time
//!   (50-500 µs, learnt from recent waits; `SDP_SPIN_US` fixes it), so a reply that comes
//!   quickly is seen at once, unless this thread was preempted while polling lately (a busy
//!   host: polling would take the CPU from the peer it waits for; `SpinGuard`);
//! * then it sleeps on the provider's notification fd itself (the `arm`, poll, sleep protocol
//!   of [`Provider::notify_fd`](crate::verbs::Provider::notify_fd)) and its own eventfd, so the
//!   peer's wakeup reaches it directly; whoever else makes progress signals that eventfd;
//! * the progress thread serves everything else: timers, connections nobody is calling on,
//!   readiness fds and the LD_PRELOAD shim's application fds. While callers make progress
//!   themselves and nothing is watched from outside a call, it stands by (does not arm the
//!   provider, looks every millisecond), so a peer's message wakes one thread, not two.
//!
//! An idle process therefore costs no CPU: the progress thread sleeps in `poll(2)` until a
//! completion, a CM event or a timer is due.
//!
//! The runtime remembers the process it was made in. After `fork()` the child's copy of the
//! runtime is dead: calls on streams inherited from the parent fail with EBADF and dropping them
//! does nothing, so the child never disturbs the parent's connections, and new streams in the
//! child get a new runtime (see `stack`).
//!
//! Files: this one holds the runtime's types ([`StackOps`], its per-socket state), starting
//! it, taking its lock, how a call waits (`block_on`) and a round of progress (`step`);
//! `ops` the socket calls (`impl StackOps`); `app_fd` the shim's application-fd calls;
//! `readiness` bringing readiness and application fds up to date; `zcopy` zero-copy waits and
//! asynchronous sends of registered regions; `user_zcopy` zero copy from and into application
//! buffers; `failure` a failed stack; `exit_flush` the runtime's side of the flush at exit;
//! `spin` how a blocking call polls before it sleeps; `progress` the progress thread. Errors
//! become errno in `socket::errors`, the environment knobs are `socket::tunables`.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, MutexGuard};
use rustc_hash::FxHashMap;

use super::errors::{driver_err, io_err, verbs_err, Errno};

mod app_fd;
mod exit_flush;
mod failure;
mod moving;
mod ops;
mod progress;
mod readiness;
mod share;
mod spin;
mod user_zcopy;
mod zcopy;

use self::failure::*;
use self::progress::*;
use self::readiness::*;
pub(crate) use self::share::is_shared_now;
use self::share::*;
use self::spin::*;
pub(crate) use self::spin::{
    ms_of_timeout, poll_events, poll_events_for, poll_events_masked, timeout_of_ms, APP_STREAMS,
};
use self::zcopy::*;
use super::ready::{AppReady, AppState, ReadyFd, UnreadClear};
use crate::driver::{Driver, ListenerId};
use crate::proto::conn::CallError;
use crate::proto::iocb::{ZSink, ZSrc};
use crate::proto::read::ZRecv;
use crate::proto::table::ConnId;
use crate::proto::{Config, ConnError, Event, Instant, Shutdown, State};
use crate::sys;
use crate::verbs::{
    Access, Grant, MemoryRegion, Provider, VerbsError, REJECT_LOCAL_SILENT, REJECT_QUEUE_FULL,
    REJECT_SHARED_SLOW,
};

/// How long a connect that can fall back to kernel TCP waits on a process of this host before
/// it gives up on SDP ([`crate::verbs::Endpoint::local_wait`]): TCP's connect completes in the
/// kernel whether the server's process runs or not (a stopped server, one slow to accept), so
/// a connect waiting for that process must not hold its caller much longer than a local round
/// trip. Past it the connect goes by kernel TCP, and connects there do for a while
/// (`history`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Patience {
    /// For the listener's process to answer the request.
    pub(crate) unanswered: Duration,
    /// For one of the processes sharing the listener to accept a request handed to them.
    pub(crate) handed: Duration,
}

impl Patience {
    /// A nonblocking connect: TCP's returns at once. An idle process answers within a
    /// millisecond, a busy one's progress thread within a few; an idle worker of a shared
    /// listener accepts within a few.
    pub(crate) const NONBLOCKING: Patience = Patience {
        unanswered: Duration::from_millis(100),
        handed: Duration::from_millis(50),
    };
    /// A blocking connect (TCP's completes at once too, and the caller waits for it).
    pub(crate) const BLOCKING: Patience = Patience {
        unanswered: Duration::from_secs(1),
        handed: Duration::from_secs(1),
    };
}

/// How a call waits.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Wait {
    pub nonblocking: bool,
    pub timeout: Option<Duration>,
    /// Large blocking reads and writes may go by zero copy.
    pub zcopy: bool,
    /// Poll this long before sleeping (`None`: `SDP_SPIN_US`).
    pub spin: Option<Duration>,
}

/// A registered memory region of some provider, type-erased.
pub(crate) type DynMr = Box<dyn MemoryRegion>;

/// What the socket layer needs of a runtime, object-safe so streams need not be generic.
pub(crate) trait StackOps: Send + Sync {
    fn name(&self) -> &'static str;
    fn alive(&self) -> bool;
    /// Connect within `timeout` (`None`: the engine's `connect_timeout`). A listener whose
    /// queue is full turns the request away; with `wait_room` the connector tries again until
    /// there is room or the time is up (ETIMEDOUT), as a TCP client whose SYN was dropped
    /// does; without it the connect fails at once with ECONNREFUSED.
    /// `src`: the source address asked for (a port the application bound), if any. With
    /// `patience` (a caller that falls back to kernel TCP) a connect waiting on a process of
    /// this host gives up past it ([`Patience`]; ECONNREFUSED with [`REJECT_LOCAL_SILENT`] or
    /// [`REJECT_SHARED_SLOW`]).
    fn connect(
        &self,
        dst: SocketAddr,
        src: Option<SocketAddr>,
        timeout: Option<Duration>,
        wait_room: bool,
        patience: Option<Patience>,
    ) -> io::Result<ConnId>;
    fn listen(&self, addr: SocketAddr, backlog: u32) -> io::Result<ListenerId>;
    /// A listener that answers only requests other processes hand it ([`StackOps::adopt`]).
    fn listen_adopted(&self, addr: SocketAddr, backlog: u32) -> io::Result<ListenerId>;
    /// Answer a request another process's listener handed off.
    fn adopt(&self, l: ListenerId, request: OwnedFd) -> io::Result<()>;
    /// Whether the listener has connections being set up, ready, or requests taken in and
    /// not answered yet (an accept may still get one).
    fn listener_busy(&self, l: ListenerId) -> bool;
    /// From now on hand every request of `l` down `to`, unanswered, and ring `bell` with how
    /// many went at each round that handed some.
    fn set_handoff(&self, l: ListenerId, to: OwnedFd, bell: Bell) -> io::Result<()>;
    fn listener_addr(&self, l: ListenerId) -> Option<SocketAddr>;
    /// The next connection of the listener, and its peer's address.
    fn accept(&self, l: ListenerId, w: Wait) -> io::Result<(ConnId, SocketAddr)>;
    fn close_listener(&self, l: ListenerId);
    /// The listener's readiness fd, handed out: watched from outside calls from now on (the
    /// progress thread keeps it up to date at once, never standing by).
    fn listener_fd(&self, l: ListenerId) -> io::Result<RawFd>;
    /// The listener's readiness fd for a wait inside a call ([`crate::socket::SdpListener`]'s
    /// blocking accept): not handed out, so it does not keep the progress thread from standing
    /// by while other calls run (they move the listener along themselves).
    fn listener_wait_fd(&self, l: ListenerId) -> io::Result<RawFd>;
    fn read(&self, id: ConnId, buf: &mut [u8], w: Wait) -> io::Result<usize>;
    fn write(&self, id: ConnId, buf: &[u8], w: Wait) -> io::Result<usize>;
    fn send_registered(
        &self,
        id: ConnId,
        mr: &mut DynMr,
        off: usize,
        len: usize,
    ) -> io::Result<usize>;
    fn recv_registered(
        &self,
        id: ConnId,
        mr: &mut DynMr,
        off: usize,
        len: usize,
    ) -> io::Result<usize>;
    fn register(&self, len: usize) -> io::Result<DynMr>;
    /// Start a zero-copy send of `mr[off..off + len]` that completes later
    /// ([`StackOps::send_registered_poll`]); the runtime holds `mr` until then.
    fn send_registered_async(&self, id: ConnId, mr: DynMr, off: usize, len: usize) -> ZStart;
    /// The outcome of an asynchronous send, once it is done (waiting for it if `block`).
    fn send_registered_poll(
        &self,
        id: ConnId,
        ticket: u64,
        block: bool,
    ) -> io::Result<Option<(DynMr, io::Result<usize>)>>;
    /// Whether an asynchronous send is done (without taking it).
    fn send_registered_peek(&self, id: ConnId, ticket: u64) -> io::Result<bool>;
    fn shutdown(&self, id: ConnId, how: Shutdown) -> io::Result<()>;
    /// `close(2)`: in the background, or as SO_LINGER says (see [`StackOps::set_linger`]).
    fn close(&self, id: ConnId);
    /// SO_LINGER for the close: `Some(ZERO)` aborts (the peer gets a reset, what was not
    /// delivered is dropped; at process exit too, as TCP's); `Some(d)` makes the close wait up
    /// to `d` until the peer holds everything written (or the connection ends), then close as
    /// without it; `None` closes in the background.
    fn set_linger(&self, id: ConnId, linger: Option<Duration>) -> io::Result<()>;
    fn linger(&self, id: ConnId) -> io::Result<Option<Duration>>;
    fn ready_fd(&self, id: ConnId) -> io::Result<RawFd>;
    fn addrs(&self, id: ConnId) -> io::Result<(SocketAddr, SocketAddr)>;
    fn set_nodelay(&self, id: ConnId, on: bool) -> io::Result<()>;
    /// SO_OOBINLINE: urgent bytes stay in the stream.
    fn set_oob_inline(&self, id: ConnId, on: bool) -> io::Result<()>;
    fn nodelay(&self, id: ConnId) -> io::Result<bool>;
    fn set_sndbuf(&self, id: ConnId, bytes: usize) -> io::Result<()>;
    fn sndbuf(&self, id: ConnId) -> io::Result<usize>;
    fn set_rcvbuf(&self, id: ConnId, bytes: usize) -> io::Result<()>;
    fn rcvbuf(&self, id: ConnId) -> io::Result<usize>;
    fn take_error(&self, id: ConnId) -> io::Result<Option<io::Error>>;
    /// Bytes written and not yet acknowledged by the peer (SIOCOUTQ).
    fn send_queue_len(&self, id: ConnId) -> io::Result<usize>;
    /// The process whose runtime this is (its creator, or the fork child its connections
    /// moved to): streams in any other process are inherited copies.
    fn owner_pid(&self) -> u32;
    /// Fork with this runtime's connections going on in the child (`daemon()`): every peer
    /// paused ([`crate::verbs::Endpoint::pause_peer`], answers awaited a bounded while), the
    /// progress thread stopped, `fork` called with the runtime locked; the child takes the
    /// runtime over (its pid, a progress thread, each peer told). Returns `fork`'s result: in
    /// the parent (> 0) the runtime stays locked, and the caller must end the process
    /// (`_exit`) without touching it again. A connection whose peer did not answer is reset in
    /// the child. When `fork` fails the connections go on here.
    fn fork_moving(&self, fork: &mut dyn FnMut() -> libc::pid_t) -> libc::pid_t;
    /// Test hook: make the progress thread panic at its next round.
    fn inject_progress_panic(&self);
    /// Test hook: plain reads that took a peer's SrcAvail by zero copy into the caller's
    /// buffer.
    fn user_zcopy_reads(&self) -> u64;
    fn conn_count(&self) -> usize;
    fn registered_bytes(&self) -> usize;

    // The application-fd mode of the LD_PRELOAD shim (see `socket::app`). Each call is one
    // nonblocking attempt; `user` is the application's fd (the readiness pair's user end).
    /// Make the connection's readiness pair with the user end as the application's fd.
    fn app_attach(&self, id: ConnId, nonblocking: bool, cloexec: bool) -> io::Result<OwnedFd>;
    /// Read (or peek) without blocking; on WouldBlock the user fd is left unreadable.
    /// `min` above 1: fewer bytes waiting (SO_RCVLOWAT, [`app_set_rcvlowat`]) is a WouldBlock.
    ///
    /// [`app_set_rcvlowat`]: StackOps::app_set_rcvlowat
    fn app_read(
        &self,
        id: ConnId,
        user: RawFd,
        buf: &mut [u8],
        peek: bool,
        min: usize,
    ) -> io::Result<usize>;
    /// SO_RCVLOWAT: the user fd reads as readable once `lowat` bytes wait (or the stream
    /// ended, failed, or its receive buffers are full); direct wakeups stay off above 1.
    fn app_set_rcvlowat(&self, id: ConnId, user: RawFd, lowat: usize) -> io::Result<()>;
    /// The user fd is watched for edges: a token per arrival (see `AppStream::want_edges`).
    fn app_want_edges(&self, id: ConnId);
    /// Write without blocking (partial writes allowed); on WouldBlock the user fd is left
    /// unwritable.
    fn app_write(&self, id: ConnId, user: RawFd, buf: &[u8]) -> io::Result<usize>;
    /// Shut down a half and bring the user fd up to date.
    fn app_shutdown(&self, id: ConnId, user: RawFd, how: Shutdown) -> io::Result<()>;
    /// Counters and state for TCP_INFO, FIONREAD, SIOCOUTQ and reports.
    fn app_info(&self, id: ConnId) -> io::Result<super::app::AppInfo>;
    /// How long a blocking call on an application fd may poll before it sleeps in the kernel
    /// (`spin`: the adaptive time, `SDP_SPIN_US`, or zero while this thread backs off).
    fn app_poll_time(&self) -> Duration;
    /// A blocking read on `id`'s application fd found nothing: poll the connection for up to
    /// `spin` instead of sleeping in the kernel at once, or until `stop` (asked every few
    /// microseconds) says so; whether a read would now not block. The caller holds signals
    /// back meanwhile (`stop`: one came).
    fn app_poll_readable(&self, id: ConnId, spin: Duration, stop: &dyn Fn() -> bool) -> bool;
    /// A blocking call on an application fd waited `waited` in all (the adaptive poll time
    /// learns from it).
    fn app_waited(&self, waited: Duration);
    /// Ring `bell` with the number of connections ready to accept whenever it changes (called
    /// under the stack's lock, by progress and by accept alike).
    fn set_listener_bell(&self, l: ListenerId, bell: Bell) -> io::Result<()>;
    /// Turn new connect requests to `l` away (connectors fall back to kernel TCP); those
    /// queued stay.
    fn set_listener_refusing(&self, l: ListenerId, on: bool);
    /// TCP_DEFER_ACCEPT of `secs` seconds (0: off) on `l` ([`Driver::set_defer_accept`]).
    fn set_listener_defer(&self, l: ListenerId, secs: u32);
    /// Send one urgent byte (MSG_OOB) after what was written.
    fn app_send_urgent(&self, id: ConnId, user: RawFd, byte: u8) -> io::Result<()>;
    /// Take (or with `peek` look at) the urgent byte; `None` if there is none.
    fn app_read_urgent(&self, id: ConnId, user: RawFd, peek: bool) -> io::Result<Option<u8>>;
    /// The application fd is about to be shared with another process: from now on the
    /// stream's bytes flow through it (see `socket::pump`).
    fn app_share(&self, id: ConnId, user: RawFd) -> io::Result<()>;
    /// A connection just accepted (`id`) goes on through `file`, a kernel stream socket
    /// whose other end another process holds (a listener's doorbell), pumped by this runtime
    /// (`socket::pump`) until that end is closed; no handle of this process's is left.
    fn app_pump_through(&self, id: ConnId, file: OwnedFd) -> io::Result<()>;
    /// A child is being forked, which inherits the application fd (its kernel file `file`):
    /// the stream stays as it is until a process uses it (`runtime::share`); `shared` says
    /// when it became shared, and what the connection carried once its pump ended.
    fn app_expose(
        &self,
        id: ConnId,
        file: (u64, u64),
        shared: Arc<super::app::Sharing>,
    ) -> io::Result<()>;
    /// Make the stream's bytes flow through its file (`user`, an fd of it): in the owning
    /// process at once, in another (a fork child) by asking the owner.
    fn app_join(&self, id: ConnId, user: RawFd) -> io::Result<()>;
    /// Block until no stream of this runtime is pumped for other processes any more (each
    /// ended with its last holder's close; the keeper of an exited owner waits so).
    fn wait_pumps_done(&self);
    /// The application's last fd of an exposed stream in this process is about to close
    /// (`user`): stop the readiness protocol, so the close can tell whether another process
    /// holds the file.
    fn app_quiesce(&self, id: ConnId, user: RawFd);
}

/// How [`StackOps::send_registered_async`] started.
pub(crate) enum ZStart {
    /// Outstanding under this ticket.
    Pending(u64),
    /// Finished already (small sends go by copy at once) or refused: the region back, and the
    /// bytes sent or the error.
    Done(DynMr, io::Result<usize>),
}

/// An asynchronous zero-copy send (see `send_registered_async`).
struct ZSend {
    token: u64,
    mr: DynMr,
    /// What the peer may read of `mr` (the source's bytes), revoked when the engine reports
    /// the source finished.
    grant: Grant,
    off: usize,
    len: usize,
    /// Set once the engine reported the source finished: what reached the peer by zero copy
    /// (the rest went to `zbacklog`), or the error.
    done: Option<io::Result<usize>>,
}

/// Per-socket state of the runtime (beyond the engine's).
#[derive(Default)]
struct Sock {
    ready: Option<ReadyFd>,
    /// Finished zero-copy transfers: token, bytes.
    zdone: Vec<(u64, usize)>,
    /// Asynchronous zero-copy sends, in the order issued.
    zsends: VecDeque<ZSend>,
    /// Bytes of asynchronous sends that ended short (the peer cancelled, or a timeout), in
    /// stream order: they go by copy before anything written after them.
    zbacklog: VecDeque<u8>,
    /// The connection's error was reported (by `take_error`, SO_ERROR, or a read or write):
    /// it is reported once.
    error_taken: bool,
    /// The application's socket fd is our readiness pair's user end (LD_PRELOAD shim).
    app: Option<AppReady>,
    /// The application's fd is shared with other processes: bytes flow through it.
    pump: Option<super::pump::Pump>,
    /// A forked child inherited the application fd (`runtime::share`).
    exposed: Option<Exposed>,
    /// Our end of the readiness pair once the application's last fd of an exposed stream
    /// began to close (`app_quiesce`), with whether EOF was shown on it: pumped if another
    /// process holds the file, else closed with the connection.
    parked: Option<(OwnedFd, bool)>,
    /// Closed by `flush_at_exit` on the application's behalf.
    exit_closed: bool,
    /// SO_LINGER: `Some(ZERO)` resets at close (and at exit), `Some(d)` makes close wait up
    /// to `d` for the peer to hold what was written.
    linger: Option<Duration>,
    /// SO_RCVLOWAT (0 and 1: any byte makes the application fd readable).
    lowat: usize,
}

/// Per-listener state of the runtime (its queue of connections is the driver's).
struct LSock {
    ready: ReadyFd,
    /// The application asked for `ready`'s fd (it may be watching it).
    fd_given: bool,
    /// Told how many connections are ready to accept whenever that is recomputed (the shim's
    /// doorbell for a listener whose application fd is a kernel TCP socket).
    bell: Option<Bell>,
    /// Told how many requests went to other processes at each round that handed some
    /// ([`StackOps::set_handoff`]), with the count told so far.
    handoff_bell: Option<(Bell, u64)>,
}

impl LSock {
    /// The listener has `ready` connections ready to accept: its readiness fd and its bell
    /// say so (under the stack's lock).
    fn set_ready(&mut self, ready: usize) {
        self.ready.set(ready > 0, false, false);
        if let Some(b) = &self.bell {
            b(ready);
        }
    }
}

/// See [`LSock::bell`].
pub(crate) type Bell = Arc<dyn Fn(usize) + Send + Sync>;

struct Inner<P: Provider> {
    driver: Driver<P>,
    /// (Keyed by our own ids, looked up on every call: FxHash, not SipHash.)
    socks: FxHashMap<ConnId, Sock>,
    lsocks: FxHashMap<ListenerId, LSock>,
    next_token: u64,
    /// Scratch for the connections a round of progress looks at ([`Driver::take_touched`]).
    touched: Vec<ConnId>,
    /// The connection whose application call runs the current round, if one does.
    in_app_call: Option<ConnId>,
    /// Sockets with a pump (shared application fds), so rounds without any skip the walk.
    pumps: usize,
    /// Connections closed because every holder closed the application's file behind the
    /// shim's back (`Shared::serve_app_hangups`): what they said last, for the stream's
    /// report until its `AppStream` closes.
    ended_behind: HashMap<ConnId, super::app::AppInfo>,
}

/// Called before each round of progress with the current time (the simulator advances its
/// virtual clock with it).
pub(crate) type Tick = Box<dyn Fn(Instant) + Send + Sync>;

struct Shared<P: Provider> {
    inner: Mutex<Inner<P>>,
    cond: Condvar,
    origin: std::time::Instant,
    wake: OwnedFd,
    /// The provider's notify fd (readable when a peer or the device has news for us), if it
    /// has one: a caller that sleeps waits on it itself, so a peer's wakeup reaches the thread
    /// that waits for it directly instead of through the progress thread.
    notify: Option<RawFd>,
    /// The eventfds of the callers sleeping on `notify` (see `Runtime::block_on`): whoever
    /// makes progress signals them, as it notifies `cond` for the others.
    sleepers: parking_lot::Mutex<Vec<RawFd>>,
    /// Eventfds free for a caller to sleep with (`SLEEP_FDS` of them).
    sleep_fds: parking_lot::Mutex<Vec<OwnedFd>>,
    /// When the progress thread's sleep ends by itself (ns on the stack's clock, under the
    /// inner lock): a caller that set an earlier timer wakes it, others leave it asleep.
    progress_until: AtomicU64,
    /// Callers inside `Runtime::block_on` (spinning, or sleeping on `notify`).
    callers: std::sync::atomic::AtomicUsize,
    /// When the last caller left `block_on` (ns on the stack's clock).
    last_call: AtomicU64,
    /// The process whose runtime this is: its creator, or the fork child its connections
    /// moved to (`StackOps::fork_moving`).
    pid: std::sync::atomic::AtomicU32,
    tick: Option<Tick>,
    stop: AtomicBool,
    /// The progress thread is to return (a move: it is started again in the process that goes
    /// on), and its handle.
    park: AtomicBool,
    progress: parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Test hook: the progress thread panics at its next round.
    inject_panic: AtomicBool,
    /// A panic broke the stack's progress (its state may be inconsistent), or its device went
    /// away: every call fails from now on, with `fail_errno`.
    failed: AtomicBool,
    /// The errno of every call on a failed stack: EIO after a panic, ENETDOWN after the
    /// device went away (0 until it failed).
    fail_errno: std::sync::atomic::AtomicI32,
    /// The provider can register application memory (cleared at its first refusal).
    user_zcopy: AtomicBool,
    /// Plain reads that went by zero copy (`read_user_zcopy` registered the caller's buffer).
    user_zreads: std::sync::atomic::AtomicU64,
    /// The provider's name ("shm", "rdma", "sim").
    name: &'static str,
    /// The engine's zero-copy threshold (its configuration does not change).
    zcopy_threshold: usize,
    spin: AdaptiveSpin,
    /// Answers `sdpstat` (see `socket::stat`).
    stat: Option<super::stat::StatServer>,
    /// Requests of other processes to share a stream (`runtime::share`): receiving and
    /// sending ends, made at the first fork that exposes one.
    requests: std::sync::OnceLock<(OwnedFd, OwnedFd)>,
    /// Our ends of the application fds' readiness pairs, watched for the hang-up that says
    /// every holder closed the application's file behind the shim's back (a raw `close`
    /// system call, as libuv makes; `fclose`): see `Runtime::serve_app_hangups`. Made at the
    /// first application fd.
    app_hangups: std::sync::OnceLock<OwnedFd>,
}

/// A caller inside `Runtime::block_on`: counted while there, its leaving time kept (the
/// progress thread stands by meanwhile; see `progress_loop`).
struct Caller<'a, P: Provider>(&'a Shared<P>);

impl<'a, P: Provider> Caller<'a, P> {
    fn enter(sh: &'a Shared<P>) -> Self {
        sh.callers.fetch_add(1, Ordering::SeqCst);
        Caller(sh)
    }
}

impl<P: Provider> Drop for Caller<'_, P> {
    fn drop(&mut self) {
        self.0
            .last_call
            .store(self.0.now().as_nanos(), Ordering::Relaxed);
        self.0.callers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How long after the last caller left `block_on` the progress thread keeps standing by.
const STANDBY: Duration = Duration::from_millis(1);

/// Callers that can sleep on the provider's notify fd at once (each needs an eventfd of its
/// own; more sleep on the condvar). Made with the runtime, so they are not new fds of a
/// connection, and few: one or two threads per stack usually wait at a time.
const SLEEP_FDS: usize = 4;

/// A runtime over one provider. Dropping the last handle stops the progress thread.
pub(crate) struct Runtime<P: Provider + 'static> {
    sh: Arc<Shared<P>>,
}

impl<P: Provider + 'static> Drop for Runtime<P> {
    fn drop(&mut self) {
        if sys::getpid() != self.sh.pid() {
            // A fork child's copy: no progress thread here, and the fd numbers are not ours.
            return;
        }
        self.sh.stop.store(true, Ordering::SeqCst);
        sys::eventfd_signal(&self.sh.wake);
    }
}

fn dead() -> io::Error {
    io::Error::other("SDP socket inherited across fork(): it belongs to the parent process")
}

impl<P: Provider + 'static> Runtime<P> {
    /// Start a runtime and its progress thread.
    pub(crate) fn start(provider: P, cfg: Config, tick: Option<Tick>) -> io::Result<Arc<Self>> {
        let notify = provider.notify_fd();
        let name = provider.name();
        let zcopy_threshold = cfg.zcopy_threshold;
        let sh = Arc::new(Shared {
            inner: Mutex::new(Inner {
                driver: {
                    let mut d = Driver::new(provider, cfg);
                    d.set_trace(super::tunables::tunables().trace);
                    d
                },
                socks: FxHashMap::default(),
                lsocks: FxHashMap::default(),
                next_token: 1,
                touched: Vec::new(),
                in_app_call: None,
                pumps: 0,
                ended_behind: HashMap::new(),
            }),
            cond: Condvar::new(),
            origin: std::time::Instant::now(),
            wake: sys::eventfd()?,
            notify,
            sleepers: parking_lot::Mutex::new(Vec::new()),
            sleep_fds: parking_lot::Mutex::new(
                (0..SLEEP_FDS)
                    .map(|_| sys::eventfd())
                    .collect::<io::Result<_>>()?,
            ),
            progress_until: AtomicU64::new(0),
            callers: std::sync::atomic::AtomicUsize::new(0),
            last_call: AtomicU64::new(0),
            pid: std::sync::atomic::AtomicU32::new(sys::getpid()),
            tick,
            stop: AtomicBool::new(false),
            park: AtomicBool::new(false),
            progress: parking_lot::Mutex::new(None),
            inject_panic: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            fail_errno: std::sync::atomic::AtomicI32::new(0),
            user_zcopy: AtomicBool::new(true),
            user_zreads: std::sync::atomic::AtomicU64::new(0),
            name,
            zcopy_threshold,
            spin: AdaptiveSpin::new(),
            stat: super::stat::StatServer::new(name),
            requests: std::sync::OnceLock::new(),
            app_hangups: std::sync::OnceLock::new(),
        });
        Self::spawn_progress(&sh)?;
        let weak: std::sync::Weak<Shared<P>> = Arc::downgrade(&sh);
        super::exit::register(weak);
        Ok(Arc::new(Runtime { sh }))
    }

    fn now(&self) -> Instant {
        self.sh.now()
    }

    /// Start the progress thread.
    fn spawn_progress(sh: &Arc<Shared<P>>) -> io::Result<()> {
        let thread_sh = sh.clone();
        let notify = sh.notify;
        let h = sys::spawn_without_signals(
            std::thread::Builder::new().name("sdp-progress".into()),
            move || progress_thread(thread_sh, notify),
        )?;
        *sh.progress.lock() = Some(h);
        Ok(())
    }

    fn lock(&self) -> io::Result<MutexGuard<'_, Inner<P>>> {
        if sys::getpid() != self.sh.pid() {
            return Err(dead());
        }
        if self.sh.failed() {
            return Err(self.sh.fail_error());
        }
        Ok(self.sh.inner.lock())
    }

    /// One connect attempt (see [`StackOps::connect`]): `Err(None)` when the listener's queue
    /// was full.
    fn connect_once(
        &self,
        dst: SocketAddr,
        src: Option<SocketAddr>,
        timeout: Option<Duration>,
        patience: Option<Patience>,
    ) -> Result<ConnId, Option<io::Error>> {
        let id = {
            let mut g = self.lock().map_err(Some)?;
            let now = self.now();
            let id = g
                .driver
                .connect(now, dst, src)
                .map_err(|e| Some(driver_err(e)))?;
            g.socks.insert(id, Sock::default());
            id
        };
        match self.connect_wait(id, timeout, patience) {
            Ok(()) => Ok(id),
            Err(e) => {
                let full = self.lock().is_ok_and(|g| {
                    matches!(g.driver.conn_error(id), Some(ConnError::Rejected(why)) if why == REJECT_QUEUE_FULL)
                });
                self.close(id);
                if full {
                    Err(None)
                } else if e.kind() == io::ErrorKind::WouldBlock {
                    Err(Some(io::Error::from_raw_os_error(libc::ETIMEDOUT)))
                } else {
                    Err(Some(e))
                }
            }
        }
    }

    /// [`Runtime::connect_once`]'s wait: with `patience` in slices, looking between them what
    /// the connect waits on and since when; without, the whole `timeout` at once.
    fn connect_wait(
        &self,
        id: ConnId,
        timeout: Option<Duration>,
        patience: Option<Patience>,
    ) -> io::Result<()> {
        use crate::verbs::LocalWait;
        let start = std::time::Instant::now();
        let slice =
            patience.map(|p| (p.unanswered.min(p.handed) / 2).max(Duration::from_millis(1)));
        let mut handed: Option<std::time::Instant> = None;
        loop {
            let left = timeout.map(|t| t.saturating_sub(start.elapsed()));
            if left.is_some_and(|l| l.is_zero()) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let w = Wait {
                timeout: match (left, slice) {
                    (Some(l), Some(s)) => Some(l.min(s)),
                    (l, s) => l.or(s),
                },
                ..Wait::default()
            };
            let r = self.block_on(w, |g, _| connect_outcome(&g.driver.view(id)?));
            let Some(patience) = patience else {
                return r;
            };
            match r {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            let wait = self.lock()?.driver.local_wait(id);
            let why = match wait {
                Some(LocalWait::Unanswered) if start.elapsed() >= patience.unanswered => {
                    REJECT_LOCAL_SILENT
                }
                Some(LocalWait::Handed)
                    if handed.get_or_insert_with(std::time::Instant::now).elapsed()
                        >= patience.handed =>
                {
                    REJECT_SHARED_SLOW
                }
                _ => continue,
            };
            return Err(io::Error::new(io::ErrorKind::ConnectionRefused, why));
        }
    }

    /// Run `f` until it gives an answer, making progress and waiting in between.
    fn block_on<T>(
        &self,
        w: Wait,
        mut f: impl FnMut(&mut Inner<P>, Instant) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        let start = std::time::Instant::now();
        let mut g = self.lock()?;
        let _caller = Caller::enter(&self.sh);
        let spin = match w.spin {
            Some(d) if SpinGuard::allowed() => d,
            Some(_) => Duration::ZERO,
            None => poll_time(&self.sh.spin, SpinGuard::allowed),
        };
        let guarded = spin_fixed().is_none() && !spin.is_zero();
        // Over RDMA only a costly preemption stops polling (`SpinGuard`).
        let rdma = self.sh.name == "rdma";
        // The thread's context switches and CPU time when polling began (see `SpinGuard`).
        let mut sched0: Option<sys::ThreadSched> = None;
        let mut waited = false;
        loop {
            if self.sh.failed() {
                return Err(self.sh.fail_error());
            }
            // One clock read per look, for the engine's time and the poll's length.
            let t = std::time::Instant::now();
            let now = self.sh.at(t);
            let mut r = f(&mut g, now);
            // Move things along ourselves, then look again.
            if r.is_none() && self.sh.step_for_at(&mut g, None, now) > 0 {
                self.sh.wake_waiters();
                r = f(&mut g, now);
            }
            if let Some(r) = r {
                self.sh.after_call(&mut g);
                if waited && w.spin.is_none() {
                    self.sh.spin.record(start.elapsed());
                }
                if guarded && sched0.is_some() && start.elapsed() <= spin {
                    SpinGuard::ended(start, sched0, SpinGuard::min_lost(rdma));
                }
                return r;
            }
            if w.nonblocking {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let elapsed = t.saturating_duration_since(start);
            let left = match w.timeout {
                Some(t) if elapsed >= t => return Err(io::ErrorKind::WouldBlock.into()),
                Some(t) => t - elapsed,
                None => Duration::from_secs(3600),
            };
            waited = true;
            if elapsed < spin {
                if guarded && sched0.is_none() {
                    sched0 = sys::ThreadSched::now();
                }
                MutexGuard::unlocked(&mut g, std::hint::spin_loop);
                continue;
            }
            if guarded && sched0.is_some() {
                // The poll is over without an answer; was it preempted?
                SpinGuard::ended(start, sched0.take(), SpinGuard::min_lost(rdma));
            }
            // Our call may have set an earlier timer than the one the progress thread sleeps
            // towards.
            self.sh.kick_progress_for_timers(&g);
            let left = left.min(Duration::from_millis(200));
            let sleep_fd = self
                .sh
                .notify
                .and_then(|n| Some((n, self.sh.sleep_fds.lock().pop()?)));
            match sleep_fd {
                Some((notify, fd)) => {
                    let me = fd.as_raw_fd();
                    // Ask the provider to make `notify` readable at the next news, then look
                    // once more (news between our last look and the arming made no wakeup).
                    let _ = g.driver.arm();
                    if self.sh.step(&mut g) > 0 {
                        self.sh.sleep_fds.lock().push(fd);
                        self.sh.wake_waiters();
                        continue;
                    }
                    // Registered before the lock goes: whoever makes progress after that
                    // (the progress thread, another caller) signals `me`.
                    self.sh.sleepers.lock().push(me);
                    let signalled = MutexGuard::unlocked(&mut g, || {
                        sys::poll_two(notify, me, left).map_or(true, |(_, mine)| mine)
                    });
                    self.sh.sleepers.lock().retain(|&f| f != me);
                    // A signal after the poll is taken at the next sleep's poll (it returns
                    // at once; the drain then).
                    if signalled {
                        sys::eventfd_drain(&fd);
                    }
                    self.sh.sleep_fds.lock().push(fd);
                }
                None => {
                    self.sh.cond.wait_for(&mut g, left);
                }
            }
        }
    }

    /// A connection's error is reported once, by the first read, write or SO_ERROR that
    /// meets it, as Linux clears `sk_err`; after that reads see EOF and writes EPIPE
    /// (`later`).
    fn report_once<T>(
        g: &mut Inner<P>,
        id: ConnId,
        e: CallError,
        later: io::Result<T>,
    ) -> io::Result<T> {
        if let (CallError::Conn(_), Some(s)) = (&e, g.socks.get_mut(&id)) {
            if s.error_taken {
                return later;
            }
            s.error_taken = true;
        }
        Err(io_err(e))
    }

    /// A socket option the driver holds for `id` (EBADF for an unknown socket).
    fn option<R>(&self, id: ConnId, f: impl FnOnce(&Driver<P>) -> Option<R>) -> io::Result<R> {
        self.with_sock(id, |g, _| {
            f(&g.driver).ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
        })
    }

    fn with_sock<R>(
        &self,
        id: ConnId,
        f: impl FnOnce(&mut Inner<P>, Instant) -> io::Result<R>,
    ) -> io::Result<R> {
        let mut g = self.lock()?;
        if !g.socks.contains_key(&id) {
            return Err(io::Error::from_raw_os_error(libc::EBADF));
        }
        let now = self.now();
        let r = f(&mut g, now);
        Self::refresh(&mut g, id);
        r
    }
}

impl<P: Provider + 'static> Shared<P> {
    /// The process whose runtime this is.
    pub(super) fn pid(&self) -> u32 {
        self.pid.load(Ordering::Relaxed)
    }

    /// One line per connection for `sdpstat`.
    fn stat_lines(&self) -> String {
        let g = self.inner.lock();
        let pid = self.pid().to_string();
        let mut out = String::new();
        for id in g.driver.conn_ids() {
            let Some(c) = g.driver.view(id) else { continue };
            let addr = |a: Option<SocketAddr>| a.map_or("-".to_string(), |a| a.to_string());
            let s = c.stats();
            out.push_str(&super::stat::line(&[
                ("pid", pid.clone()),
                ("stack", self.name.to_string()),
                ("id", format!("{id:?}")),
                ("state", format!("{:?}", c.state())),
                ("local", addr(g.driver.local_addr(id))),
                ("peer", addr(g.driver.peer_addr(id))),
                ("bytes_in", s.data_bytes_rcvd.to_string()),
                ("bytes_out", s.data_bytes_sent.to_string()),
                (
                    "zcopy_bytes",
                    (s.zcopy_read_bytes + s.zcopy_write_bytes + s.zcopy_send_bytes).to_string(),
                ),
                ("rx_queued", c.rx_queued().to_string()),
                ("tx_queued", c.tx_queued().to_string()),
                ("credits", c.tx_credits().to_string()),
                ("send_size", c.send_size().to_string()),
                (
                    "error",
                    c.error().map_or("-".to_string(), |e| format!("{e:?}")),
                ),
                ("engine", c.debug_state()),
                (
                    "app",
                    g.socks
                        .get(&id)
                        .and_then(|s| s.app.as_ref())
                        .map_or("-".to_string(), |a| a.describe()),
                ),
            ]));
        }
        out
    }

    /// Move the bytes of shared application fds; close those every holder closed.
    fn run_pumps(g: &mut Inner<P>, now: Instant) -> usize {
        let Inner {
            driver,
            socks,
            pumps,
            ..
        } = g;
        let mut act = 0;
        let mut done = Vec::new();
        for (&id, s) in socks.iter_mut() {
            let Some(p) = s.pump.as_mut() else { continue };
            act += p.run(driver, now, id);
            // Every holder closed the file: close as TCP does (the rest goes first).
            let close = p.hup && p.drained() && !p.closed;
            p.closed |= close;
            if p.closed && p.released {
                done.push(id);
            }
            if close {
                note_last_counts(driver, id, s);
                driver.close(now, id);
                if let Some(p) = s.pump.as_mut() {
                    p.finish();
                }
            }
        }
        for id in done {
            socks.remove(&id);
            *pumps -= 1;
        }
        act
    }

    /// Wake the progress thread if the engine's next timer (under the lock `g`) is earlier
    /// than the one it sleeps towards.
    fn kick_progress_for_timers(&self, g: &Inner<P>) {
        if let Some(d) = g.driver.next_deadline() {
            if d.as_nanos() < self.progress_until.load(Ordering::Relaxed) {
                self.progress_until.store(d.as_nanos(), Ordering::Relaxed);
                sys::eventfd_signal(&self.wake);
            }
        }
    }

    /// One round of progress (below). A panic in it, in the progress thread or in a caller's
    /// thread, fails the stack: its connections report EIO and nobody waits on them.
    fn step(&self, g: &mut Inner<P>) -> usize {
        self.step_for(g, None)
    }

    /// [`Shared::step`] for connection `only` (`Driver::poll_one`), or every connection.
    fn step_for(&self, g: &mut Inner<P>, only: Option<ConnId>) -> usize {
        self.step_for_at(g, only, self.now())
    }

    /// [`Shared::step_for`] at the engine's time `now` (a caller that has just read the clock).
    fn step_for_at(&self, g: &mut Inner<P>, only: Option<ConnId>, now: Instant) -> usize {
        let guard = FailOnUnwind(self);
        let act = self.step_inner(g, only, now);
        std::mem::forget(guard);
        if g.driver.device_lost() && !self.failed() {
            self.lose_device(g);
        }
        act
    }

    /// One round of progress: the driver polls everything, then the runtime collects events,
    /// hands accepted connections to their listeners and updates readiness fds.
    fn step_inner(&self, g: &mut Inner<P>, only: Option<ConnId>, now: Instant) -> usize {
        if let Some(t) = &self.tick {
            t(now);
        }
        let mut act = match only {
            Some(id) => g.driver.poll_one(now, id),
            None => g.driver.poll(now),
        };
        if g.pumps > 0 {
            act += Self::run_pumps(g, now);
        }
        if act == 0 {
            // What calls touched since waits for a round with something to do, as before:
            // the calls brought their own sockets up to date.
            return 0;
        }
        let Inner {
            driver,
            socks,
            lsocks,
            touched,
            in_app_call,
            ..
        } = g;
        for (lid, ls) in lsocks.iter_mut() {
            let Some(st) = driver.listen_stats(*lid) else {
                continue;
            };
            ls.set_ready(st.ready);
            if let Some((bell, told)) = ls.handoff_bell.as_mut() {
                if st.handed_off > *told {
                    bell((st.handed_off - *told) as usize);
                    *told = st.handed_off;
                }
            }
        }
        // Only the connections something happened to: the others are as the last round left
        // them (a busy server's idle connections cost nothing here).
        touched.clear();
        driver.take_touched(touched);
        for &id in touched.iter() {
            let Some(s) = socks.get_mut(&id) else {
                continue;
            };
            for ev in driver.take_events(id) {
                match ev {
                    Event::ZcopySent { token, bytes } | Event::ZcopyReceived { token, bytes } => {
                        s.zdone.push((token, bytes))
                    }
                    _ => {}
                }
            }
            settle_zsends(driver, now, id, s);
            if s.app.is_some() && *in_app_call == Some(id) {
                // The application call that runs this round brings its fd up to date itself
                // once it has read: a token now would only be taken back (`app_call_inner`).
                continue;
            }
            refresh_sock(driver, id, s);
        }
        act
    }
}

impl<P: Provider> Shared<P> {
    fn now(&self) -> Instant {
        self.at(std::time::Instant::now())
    }

    /// The engine's time at the clock's `t`.
    fn at(&self, t: std::time::Instant) -> Instant {
        Instant::from_nanos(t.saturating_duration_since(self.origin).as_nanos() as u64)
    }

    /// A caller is in `block_on`, or left it less than `STANDBY` ago.
    fn callers_active(&self) -> bool {
        if self.callers.load(Ordering::SeqCst) > 0 {
            return true;
        }
        let now = self.now().as_nanos();
        now.saturating_sub(self.last_call.load(Ordering::Relaxed)) < STANDBY.as_nanos() as u64
    }

    /// After a call into the driver: completions it handled right after their post
    /// (`Driver::take_inline_done`) may be what another caller waits for (room to write), as
    /// a round's would be.
    fn after_call(&self, g: &mut Inner<P>) {
        if g.driver.take_inline_done() > 0 {
            self.wake_waiters();
        }
    }

    /// Progress was made: wake every caller that waits for it (on the condvar, or on the
    /// notify fd and its own eventfd).
    fn wake_waiters(&self) {
        self.cond.notify_all();
        for &fd in self.sleepers.lock().iter() {
            sys::eventfd_signal_raw(fd);
        }
    }
}

/// What a connect waiting on `c` returns now: `None` while it is under way.
fn connect_outcome<P: Provider>(c: &crate::driver::ConnView<'_, P>) -> Option<io::Result<()>> {
    match c.state() {
        State::Connecting => None,
        State::Established => Some(Ok(())),
        // Established, then reset or closed before the connect looked (a server that
        // accepted and aborted at once): the connect succeeded, as TCP's did at the
        // handshake; the reset shows on the next call.
        _ if c.was_established() => Some(Ok(())),
        _ => Some(Err(c.error().map_or(
            io::Error::from_raw_os_error(libc::ECONNRESET),
            |e| match e {
                // ECONNREFUSED with the listener's reason, for the fallback's log and
                // report (a forking server's is told apart: `app::turned_away`).
                ConnError::Rejected(why) => {
                    io::Error::new(io::ErrorKind::ConnectionRefused, why.clone())
                }
                e => io::Error::from_raw_os_error(e.errno()),
            },
        ))),
    }
}

#[cfg(test)]
mod connect_tests {
    use super::connect_outcome;
    use crate::harness::pair::Pair;
    use crate::proto::{Config, State};

    /// A server that accepts and aborts at once, both seen by the client in one round: its
    /// connect succeeded (TCP's did at the handshake), the reset comes after. Before, the
    /// connect itself failed with ECONNRESET and the shim fell back to kernel TCP.
    #[test]
    fn a_connect_accepted_then_reset_succeeded() {
        let mut p = Pair::new(7, Config::default());
        let (a, b) = p.connect();
        let now = p.now();
        p.b.abort(now, b);
        assert!(p.run_until(1_000_000_000, |p| p
            .a
            .view(a)
            .is_some_and(|c| c.state() == State::Closed)));
        let v = p.a.view(a).expect("the client's connection");
        assert!(matches!(connect_outcome(&v), Some(Ok(()))));
    }

    /// A connect the listener turned away is ECONNREFUSED.
    #[test]
    fn a_refused_connect_fails() {
        let mut p = Pair::new(8, Config::default());
        let now = p.now();
        let wrong = std::net::SocketAddr::new(crate::harness::pair::B_IP, 1);
        let a = p.a.connect(now, wrong, None).expect("connect");
        assert!(p.run_until(1_000_000_000, |p| p
            .a
            .view(a)
            .is_some_and(|c| c.state() == State::Closed)));
        let v = p.a.view(a).expect("the client's connection");
        let e = connect_outcome(&v).expect("an answer").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
    }
}
