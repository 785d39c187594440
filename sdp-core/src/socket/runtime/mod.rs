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
//! Files: this one holds the runtime, its per-socket state and the socket calls
//! ([`StackOps`]); `spin` how a blocking call polls before it sleeps; `progress` the progress
//! thread; `user_zcopy` zero copy from and into application buffers. Errors become errno in
//! `socket::errors`, the environment knobs are `socket::tunables`.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::errors::{driver_err, io_err, verbs_err, Errno};

mod progress;
mod spin;
mod user_zcopy;

use self::progress::*;
use self::spin::*;
use super::ready::{AppReady, AppState, ReadyFd};
use crate::driver::{Driver, ListenerId};
use crate::proto::conn::CallError;
use crate::proto::iocb::{ZSink, ZSrc};
use crate::proto::read::ZRecv;
use crate::proto::table::ConnId;
use crate::proto::{Config, ConnError, Event, Instant, Shutdown, State};
use crate::sys;
use crate::verbs::{Access, Grant, MemoryRegion, Provider, VerbsError, REJECT_QUEUE_FULL};

/// Bytes per nanosecond a peer is assumed to copy a zero-copy transfer at (sizing the poll
/// before a zero-copy wait sleeps).
const COPY_RATE: usize = 8;
/// The longest a zero-copy wait polls before it sleeps.
const MAX_ZCOPY_SPIN: Duration = Duration::from_millis(1);

/// A connector turned away by a full listen queue tries again after this, then after twice
/// as long each time ...
const QUEUE_FULL_RETRY_FIRST: Duration = Duration::from_millis(25);
/// ... up to this (TCP sends its first SYN again after 1 s; a listener on this host or fabric
/// answers a new try cheaply, so a waiting connector gets in sooner after an accept).
const QUEUE_FULL_RETRY_MAX: Duration = Duration::from_secs(1);

/// Reads at least this big may take a peer's zero-copy source straight into the caller's
/// buffer.
const ZREAD_MIN: usize = 16 * 1024;

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
    fn connect(
        &self,
        dst: SocketAddr,
        timeout: Option<Duration>,
        wait_room: bool,
    ) -> io::Result<ConnId>;
    fn listen(&self, addr: SocketAddr, backlog: u32) -> io::Result<ListenerId>;
    fn listener_addr(&self, l: ListenerId) -> Option<SocketAddr>;
    /// The next connection of the listener, and its peer's address.
    fn accept(&self, l: ListenerId, w: Wait) -> io::Result<(ConnId, SocketAddr)>;
    fn close_listener(&self, l: ListenerId);
    fn listener_fd(&self, l: ListenerId) -> io::Result<RawFd>;
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
    fn nodelay(&self, id: ConnId) -> io::Result<bool>;
    fn set_sndbuf(&self, id: ConnId, bytes: usize) -> io::Result<()>;
    fn sndbuf(&self, id: ConnId) -> io::Result<usize>;
    fn set_rcvbuf(&self, id: ConnId, bytes: usize) -> io::Result<()>;
    fn rcvbuf(&self, id: ConnId) -> io::Result<usize>;
    fn take_error(&self, id: ConnId) -> io::Result<Option<io::Error>>;
    /// Bytes written and not yet acknowledged by the peer (SIOCOUTQ).
    fn send_queue_len(&self, id: ConnId) -> io::Result<usize>;
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
    fn app_read(&self, id: ConnId, user: RawFd, buf: &mut [u8], peek: bool) -> io::Result<usize>;
    /// Write without blocking (partial writes allowed); on WouldBlock the user fd is left
    /// unwritable.
    fn app_write(&self, id: ConnId, user: RawFd, buf: &[u8]) -> io::Result<usize>;
    /// Shut down a half and bring the user fd up to date.
    fn app_shutdown(&self, id: ConnId, user: RawFd, how: Shutdown) -> io::Result<()>;
    /// Counters and state for TCP_INFO, FIONREAD, SIOCOUTQ and reports.
    fn app_info(&self, id: ConnId) -> io::Result<super::app::AppInfo>;
    /// Ring `bell` with the number of connections ready to accept whenever it changes (called
    /// under the stack's lock, by progress and by accept alike).
    fn set_listener_bell(&self, l: ListenerId, bell: Bell) -> io::Result<()>;
    /// Send one urgent byte (MSG_OOB) after what was written.
    fn app_send_urgent(&self, id: ConnId, user: RawFd, byte: u8) -> io::Result<()>;
    /// Take (or with `peek` look at) the urgent byte; `None` if there is none.
    fn app_read_urgent(&self, id: ConnId, user: RawFd, peek: bool) -> io::Result<Option<u8>>;
    /// The application fd is about to be shared with another process: from now on the
    /// stream's bytes flow through it (see `socket::pump`).
    fn app_share(&self, id: ConnId, user: RawFd) -> io::Result<()>;
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
    /// Closed by `flush_at_exit` on the application's behalf.
    exit_closed: bool,
    /// SO_LINGER: `Some(ZERO)` resets at close (and at exit), `Some(d)` makes close wait up
    /// to `d` for the peer to hold what was written.
    linger: Option<Duration>,
}

/// Per-listener state of the runtime (its queue of connections is the driver's).
struct LSock {
    ready: ReadyFd,
    /// The application asked for `ready`'s fd (it may be watching it).
    fd_given: bool,
    /// Told how many connections are ready to accept whenever that is recomputed (the shim's
    /// doorbell for a listener whose application fd is a kernel TCP socket).
    bell: Option<Bell>,
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
    socks: HashMap<ConnId, Sock>,
    lsocks: HashMap<ListenerId, LSock>,
    next_token: u64,
    /// Scratch for the connections a round of progress looks at ([`Driver::take_touched`]).
    touched: Vec<ConnId>,
    /// The connection whose application call runs the current round, if one does.
    in_app_call: Option<ConnId>,
    /// Sockets with a pump (shared application fds), so rounds without any skip the walk.
    pumps: usize,
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
    pid: u32,
    tick: Option<Tick>,
    stop: AtomicBool,
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
                driver: Driver::new(provider, cfg),
                socks: HashMap::new(),
                lsocks: HashMap::new(),
                next_token: 1,
                touched: Vec::new(),
                in_app_call: None,
                pumps: 0,
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
            pid: sys::getpid(),
            tick,
            stop: AtomicBool::new(false),
            inject_panic: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            fail_errno: std::sync::atomic::AtomicI32::new(0),
            user_zcopy: AtomicBool::new(true),
            user_zreads: std::sync::atomic::AtomicU64::new(0),
            name,
            zcopy_threshold,
            spin: AdaptiveSpin::new(),
            stat: super::stat::StatServer::new(name),
        });
        let thread_sh = sh.clone();
        std::thread::Builder::new()
            .name("sdp-progress".into())
            .spawn(move || progress_thread(thread_sh, notify))?;
        let weak: std::sync::Weak<Shared<P>> = Arc::downgrade(&sh);
        super::exit::register(weak);
        Ok(Arc::new(Runtime { sh }))
    }

    fn now(&self) -> Instant {
        self.sh.now()
    }

    fn lock(&self) -> io::Result<MutexGuard<'_, Inner<P>>> {
        if sys::getpid() != self.sh.pid {
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
        timeout: Option<Duration>,
    ) -> Result<ConnId, Option<io::Error>> {
        let id = {
            let mut g = self.lock().map_err(Some)?;
            let now = self.now();
            let id = g
                .driver
                .connect(now, dst, None)
                .map_err(|e| Some(driver_err(e)))?;
            g.socks.insert(id, Sock::default());
            id
        };
        let r: io::Result<()> = self.block_on(
            Wait {
                timeout,
                ..Wait::default()
            },
            |g, _| {
                let c = g.driver.view(id)?;
                match c.state() {
                    State::Connecting => None,
                    State::Established => Some(Ok(())),
                    _ => Some(Err(c
                        .error()
                        .map_or(io::Error::from_raw_os_error(libc::ECONNRESET), |e| {
                            io::Error::from_raw_os_error(e.errno())
                        }))),
                }
            },
        );
        match r {
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

    /// Run `f` until it gives an answer, making progress and waiting in between.
    fn block_on<T>(
        &self,
        w: Wait,
        mut f: impl FnMut(&mut Inner<P>, Instant) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        let start = std::time::Instant::now();
        let mut g = self.lock()?;
        let _caller = Caller::enter(&self.sh);
        let spin = match (w.spin, spin_fixed()) {
            (Some(d), _) if SpinGuard::allowed() => d,
            (None, Some(d)) => d,
            (None, None) if SpinGuard::allowed() => self.sh.spin.get(),
            _ => Duration::ZERO,
        };
        let guarded = spin_fixed().is_none() && !spin.is_zero();
        // Involuntary context switches when polling began (see `SpinGuard`).
        let mut ivcsw0: Option<u64> = None;
        let mut waited = false;
        loop {
            if self.sh.failed() {
                return Err(self.sh.fail_error());
            }
            let now = self.now();
            let mut r = f(&mut g, now);
            // Move things along ourselves, then look again.
            if r.is_none() && self.sh.step(&mut g) > 0 {
                self.sh.wake_waiters();
                r = f(&mut g, self.now());
            }
            if let Some(r) = r {
                self.sh.after_call(&mut g);
                if waited && w.spin.is_none() {
                    self.sh.spin.record(start.elapsed());
                }
                if guarded && ivcsw0.is_some() && start.elapsed() <= spin {
                    SpinGuard::ended(start, ivcsw0);
                }
                return r;
            }
            if w.nonblocking {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let elapsed = start.elapsed();
            let left = match w.timeout {
                Some(t) if elapsed >= t => return Err(io::ErrorKind::WouldBlock.into()),
                Some(t) => t - elapsed,
                None => Duration::from_secs(3600),
            };
            waited = true;
            if elapsed < spin {
                if guarded && ivcsw0.is_none() {
                    ivcsw0 = sys::involuntary_switches();
                }
                MutexGuard::unlocked(&mut g, std::hint::spin_loop);
                continue;
            }
            if guarded && ivcsw0.is_some() {
                // The poll is over without an answer; was it preempted?
                SpinGuard::ended(start, ivcsw0.take());
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
                    MutexGuard::unlocked(&mut g, || {
                        let _ = sys::poll_two(notify, me, left);
                    });
                    self.sh.sleepers.lock().retain(|&f| f != me);
                    sys::eventfd_drain(&fd);
                    self.sh.sleep_fds.lock().push(fd);
                }
                None => {
                    self.sh.cond.wait_for(&mut g, left);
                }
            }
        }
    }

    /// Bring one socket's readiness fd up to date after an application call.
    fn refresh(g: &mut Inner<P>, id: ConnId) {
        let Inner { driver, socks, .. } = g;
        if let Some(s) = socks.get_mut(&id) {
            refresh_sock(driver, id, s);
        }
    }

    fn zcopy_wait(&self, id: ConnId, token: u64) -> io::Result<usize> {
        self.zcopy_wait_for(id, token, 0)
    }

    /// Wait for the zero-copy transfer `token` of `len` bytes. The peer must copy all of them
    /// before it answers, so the caller polls for about that long (at [`COPY_RATE`]) on top
    /// of the usual spin before it sleeps: a sleep and a wakeup cost more than the wait they
    /// would save, and the reply usually comes within it.
    fn zcopy_wait_for(&self, id: ConnId, token: u64, len: usize) -> io::Result<usize> {
        let copy = Duration::from_nanos((len / COPY_RATE) as u64);
        let w = Wait {
            spin: Some((spin_time() + copy).min(MAX_ZCOPY_SPIN)),
            ..Wait::default()
        };
        // No timeout: the peer may be reading or writing the memory until the engine says it
        // is done, which it always does (finished, cancelled, or the connection failed: every
        // source and sink in flight is reported once).
        self.block_on(w, |g, _| {
            Self::collect_zdone(g, id);
            let Some(s) = g.socks.get_mut(&id) else {
                return Some(Err(io::Error::from_raw_os_error(libc::EBADF)));
            };
            if let Some(i) = s.zdone.iter().position(|&(t, _)| t == token) {
                return Some(Ok(s.zdone.swap_remove(i).1));
            }
            // The engine is gone (closed and released), and its endpoint with it: nothing
            // reaches the memory any more, and no report will come.
            g.driver
                .view(id)
                .is_none()
                .then(|| Err(io::Error::from_raw_os_error(libc::ECONNRESET)))
        })
    }

    /// Move the socket's zero-copy reports from the engine to `zdone` (an application call,
    /// such as a cancel, may produce one without a round of progress to collect it).
    fn collect_zdone(g: &mut Inner<P>, id: ConnId) {
        let Inner { driver, socks, .. } = g;
        let Some(s) = socks.get_mut(&id) else {
            return;
        };
        for ev in driver.take_events(id) {
            if let Event::ZcopySent { token, bytes } | Event::ZcopyReceived { token, bytes } = ev {
                s.zdone.push((token, bytes));
            }
        }
    }

    /// Send `len` bytes of registered memory at `mr[off..]` by zero copy, waiting until the peer
    /// has them; returns bytes sent (fewer if the peer cancelled, or, with a `stall` bound, if
    /// the peer stopped taking them: send the rest again). The peer may read those bytes, and
    /// nothing else of `mr`, through a grant of their own, until the call returns.
    fn zcopy_send(
        &self,
        id: ConnId,
        mr: &mut DynMr,
        off: usize,
        len: usize,
        stall: Option<Duration>,
    ) -> io::Result<usize> {
        let grant = mr
            .advertise(off, len, Access::REMOTE_READ)
            .map_err(verbs_err)?;
        let r = self.zcopy_send_granted(id, &grant, stall);
        // Every way out (finished, cancelled, failed, never queued): the engine is done with
        // the source, so the peer's access ends here.
        let revoke = mr.revoke(&grant);
        let sent = r?;
        revoke.map_err(verbs_err)?;
        Ok(sent)
    }

    /// Body of [`Self::zcopy_send`]: advertise `grant` and wait for the engine to end it.
    fn zcopy_send_granted(
        &self,
        id: ConnId,
        grant: &Grant,
        stall: Option<Duration>,
    ) -> io::Result<usize> {
        let len = grant.len;
        let src = ZSrc {
            addr: grant.addr,
            len: len as u32,
            lkey: grant.lkey,
            rkey: grant.rkey,
        };
        let mut token = 0;
        self.block_on(Wait::default(), |g, now| {
            if !Self::zsends_settled(g, now, id) {
                return None;
            }
            if token == 0 {
                token = g.next_token;
                g.next_token += 1;
            }
            let r = match stall {
                Some(d) => g.driver.write_zcopy_bounded(now, id, src, token, d),
                None => g.driver.write_zcopy(now, id, src, token),
            };
            match r {
                Ok(()) => Some(Ok(())),
                Err(CallError::WouldBlock) => None,
                Err(e) => Some(Err(io_err(e))),
            }
        })?;
        // (The wait polls the engine itself, timers included, and wakes the progress thread,
        // whose next deadline may now be the stall bound, before it sleeps.)
        self.zcopy_wait_for(id, token, len)
    }

    /// Receive the next bytes straight into registered memory when they are a peer's zero-copy
    /// source. `Ok(None)`: they are not; read by copy. The sink is `len` bytes at `mr[off..]`
    /// under a grant of their own (an RDMA Read sink: on iWARP the peer's read response
    /// writes it), revoked before the call returns.
    fn zcopy_recv(
        &self,
        id: ConnId,
        mr: &mut DynMr,
        off: usize,
        len: usize,
    ) -> io::Result<Option<usize>> {
        // Registering a grant costs more than a look: only when there is a source to read.
        if !self.next_is_zcopy(id)? {
            return Ok(None);
        }
        let len = len.min(u32::MAX as usize);
        let grant = mr
            .advertise(off, len, Access::LOCAL_WRITE | Access::READ_SINK)
            .map_err(verbs_err)?;
        let r = self.zcopy_recv_granted(id, &grant);
        let revoke = mr.revoke(&grant);
        let n = r?;
        revoke.map_err(verbs_err)?;
        Ok(n)
    }

    /// Whether the next stream bytes of `id` are a peer's zero-copy source we may read.
    fn next_is_zcopy(&self, id: ConnId) -> io::Result<bool> {
        self.lock()?.driver.next_is_zcopy(id).map_err(driver_err)
    }

    /// Body of [`Self::zcopy_recv`]: read into `grant` and wait for the engine to end it.
    fn zcopy_recv_granted(&self, id: ConnId, grant: &Grant) -> io::Result<Option<usize>> {
        let sink = ZSink {
            addr: grant.addr,
            len: grant.len as u32,
            lkey: grant.lkey,
            rkey: grant.rkey,
        };
        let token = {
            let mut g = self.lock()?;
            let now = self.now();
            if !g.driver.next_is_zcopy(id).map_err(driver_err)? {
                return Ok(None);
            }
            let token = g.next_token;
            g.next_token += 1;
            match g.driver.read_zcopy(now, id, sink, token) {
                Ok(ZRecv::Pending) => token,
                Ok(ZRecv::Copy) => return Ok(None),
                Err(CallError::WouldBlock) => return Ok(None),
                Err(e) => return Err(io_err(e)),
            }
        };
        match self.zcopy_wait(id, token)? {
            0 => Ok(None),
            n => Ok(Some(n)),
        }
    }

    /// Collect the socket's zero-copy events and settle its asynchronous sends; true when no
    /// bytes of a short one wait to go (so a new write keeps stream order).
    fn zsends_settled(g: &mut Inner<P>, now: Instant, id: ConnId) -> bool {
        let Inner { driver, socks, .. } = g;
        let Some(s) = socks.get_mut(&id) else {
            return true;
        };
        if s.zsends.is_empty() && s.zbacklog.is_empty() {
            return true;
        }
        for ev in driver.take_events(id) {
            if let Event::ZcopySent { token, bytes } | Event::ZcopyReceived { token, bytes } = ev {
                s.zdone.push((token, bytes));
            }
        }
        settle_zsends(driver, now, id, s);
        s.zbacklog.is_empty()
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
    /// One line per connection for `sdpstat`.
    fn stat_lines(&self) -> String {
        let g = self.inner.lock();
        let pid = self.pid.to_string();
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
            if p.hup && p.drained() && !p.closed {
                // Every holder closed the file: close as TCP does (the rest goes first).
                p.closed = true;
                driver.close(now, id);
            }
            if p.closed && p.released {
                done.push(id);
            }
        }
        for id in done {
            socks.remove(&id);
            *pumps -= 1;
        }
        act
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// The error of every call on the failed stack (EIO after a panic, ENETDOWN after the
    /// device went away).
    fn fail_error(&self) -> io::Error {
        match self.fail_errno.load(Ordering::SeqCst) {
            0 => io::Error::from_raw_os_error(libc::EIO),
            e => io::Error::from_raw_os_error(e),
        }
    }

    /// Mark the stack failed with `errno` (the first reason stays).
    fn mark_failed(&self, errno: i32) {
        let _ = self
            .fail_errno
            .compare_exchange(0, errno, Ordering::SeqCst, Ordering::SeqCst);
        self.failed.store(true, Ordering::SeqCst);
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
        let guard = FailOnUnwind(self);
        let act = self.step_inner(g);
        std::mem::forget(guard);
        if g.driver.device_lost() && !self.failed() {
            self.lose_device(g);
        }
        act
    }

    /// The provider's device went away (`rdma link delete`, a hot-unplugged HCA): fail the
    /// stack with ENETDOWN (its connections are dead with the device; TCP's would have
    /// stalled until a timeout) and drop everything the stack made on the device at once, so
    /// the kernel can finish the removal while the application still holds its sockets (a
    /// device without `disassociate_ucontext`, as Soft-RoCE, waits until then). Listeners
    /// find the device again when it comes back (`SdpListener`).
    fn lose_device(&self, g: &mut Inner<P>) {
        self.mark_failed(libc::ENETDOWN);
        self.wake_waiters();
        self.fail_locked(g);
        // Asynchronous zero-copy sends hold their regions until the application collects
        // them, which on a failed stack it cannot: let them go now (a later `wait` reports the
        // failure), or they would hold the device.
        for s in g.socks.values_mut() {
            s.zsends.clear();
        }
        g.driver.release_device();
        self.wake_waiters();
        // The progress thread sees the failure and stops.
        sys::eventfd_signal(&self.wake);
    }

    /// The stack failed: from now on every call fails with EIO, and whoever waits wakes up
    /// to see it. Then, as far as the (possibly broken) state allows, every connection is
    /// aborted so its peer learns at once, and every readiness fd reports hung up.
    fn fail_stack(&self) {
        self.mark_failed(libc::EIO);
        self.wake_waiters();
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut g = self.inner.lock();
            self.fail_locked(&mut g);
        }));
        self.wake_waiters();
    }

    /// Abort every connection and show the failure on every fd the application may watch:
    /// readiness fds hung up, application fds (the shim's) reset, listeners readable (their
    /// accept reports it).
    fn fail_locked(&self, g: &mut Inner<P>) {
        let now = self.now();
        for id in g.driver.conn_ids() {
            g.driver.abort(now, id);
        }
        let Inner { socks, lsocks, .. } = g;
        for s in socks.values_mut() {
            if let Some(r) = s.ready.as_mut() {
                r.set(true, true, true);
            }
            if let Some(a) = s.app.as_mut() {
                a.update(
                    super::ready::AppState {
                        err: true,
                        ..Default::default()
                    },
                    None,
                );
            }
        }
        for ls in lsocks.values_mut() {
            ls.ready.set(true, false, false);
        }
    }

    /// One round of progress: the driver polls everything, then the runtime collects events,
    /// hands accepted connections to their listeners and updates readiness fds.
    fn step_inner(&self, g: &mut Inner<P>) -> usize {
        let now = self.now();
        if let Some(t) = &self.tick {
            t(now);
        }
        let mut act = g.driver.poll(now);
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
            ls.set_ready(driver.listen_stats(*lid).map_or(0, |s| s.ready));
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
        Instant::from_nanos(self.origin.elapsed().as_nanos() as u64)
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

/// Marks the stack failed if a round of progress unwinds (see `Shared::step`).
struct FailOnUnwind<'a, P: Provider>(&'a Shared<P>);

impl<P: Provider> Drop for FailOnUnwind<'_, P> {
    fn drop(&mut self) {
        let _ =
            self.0
                .fail_errno
                .compare_exchange(0, libc::EIO, Ordering::SeqCst, Ordering::SeqCst);
        self.0.failed.store(true, Ordering::SeqCst);
        self.0.wake_waiters();
        // The progress thread sees it and aborts the connections.
        sys::eventfd_signal(&self.0.wake);
    }
}

/// Collect finished asynchronous zero-copy sends of one socket: revoke the peer's access, and
/// queue what did not reach the peer (the rest of a short one, all of each later one: the
/// engine ends them together, in stream order) for sending by copy; then feed that backlog to
/// the engine as room allows.
fn settle_zsends<P: Provider>(driver: &mut Driver<P>, now: Instant, id: ConnId, s: &mut Sock) {
    let Sock {
        zdone,
        zsends,
        zbacklog,
        ..
    } = s;
    for z in zsends.iter_mut().filter(|z| z.done.is_none()) {
        let Some(i) = zdone.iter().position(|&(t, _)| t == z.token) else {
            continue;
        };
        let bytes = zdone.swap_remove(i).1.min(z.len);
        let revoke = z.mr.revoke(&z.grant);
        let failed = driver.conn_error(id).cloned();
        z.done = Some(match (revoke, failed) {
            (Err(e), _) => Err(verbs_err(e)),
            (Ok(()), Some(e)) if bytes < z.len => Err(io::Error::from_raw_os_error(e.errno())),
            (Ok(()), _) => {
                if bytes < z.len {
                    let mut rest = vec![0u8; z.len - bytes];
                    z.mr.read(z.off + bytes, &mut rest);
                    zbacklog.extend(rest);
                }
                Ok(z.len)
            }
        });
    }
    while !zbacklog.is_empty() {
        let chunk = zbacklog.as_slices().0;
        match driver.write(now, id, chunk) {
            Ok(n) => {
                zbacklog.drain(..n);
            }
            Err(CallError::WouldBlock) => break,
            Err(_) => {
                // The connection failed: the application's next call reports it.
                zbacklog.clear();
            }
        }
    }
}

fn refresh_sock<P: Provider>(driver: &Driver<P>, id: ConnId, s: &mut Sock) {
    refresh_app(driver, id, s, None);
    let Some(r) = s.ready.as_mut() else {
        return;
    };
    match driver.view(id) {
        Some(c) => {
            let hup = c.state() == State::Closed || (c.read_closed() && c.write_closed());
            r.set(c.is_readable(), c.is_writable(), hup)
        }
        None => r.set(true, true, true),
    }
}

/// What an application fd of the connection should report.
fn app_state<P: Provider>(driver: &Driver<P>, id: ConnId) -> AppState {
    match driver.view(id) {
        Some(c) => AppState {
            readable: c.read_ready(),
            rx_total: c.stats().data_bytes_rcvd,
            writable: c.is_writable(),
            rdhup: c.read_closed() || c.state() == State::Closed,
            hup: c.state() == State::Closed && c.error().is_none()
                || (c.read_closed() && c.write_closed()),
            err: c.error().is_some() && c.read_closed(),
            urgent: c.urgent_pending(),
        },
        None => AppState {
            readable: true,
            writable: true,
            rdhup: true,
            hup: true,
            ..AppState::default()
        },
    }
}

/// Bring a socket's application fd up to date; `user` when an application call holds it.
/// Direct wakeups (`AppReady`) are on while an arriving message needs nothing but a reader:
/// the fd writable and nothing of ours queued to send (both wait on the peer's messages, which
/// then go through the progress thread).
fn refresh_app<P: Provider>(driver: &Driver<P>, id: ConnId, s: &mut Sock, user: Option<RawFd>) {
    if let Some(a) = s.app.as_mut() {
        let st = app_state(driver, id);
        a.update(st, user);
        if a.direct {
            let want = st.writable
                && !st.rdhup
                && !st.hup
                && !st.err
                && s.zbacklog.is_empty()
                && driver.tx_queued(id) == 0;
            if want != a.direct_on {
                a.direct_on = want;
                driver.set_direct_wake(id, want, false);
            }
        }
    }
}

impl<P: Provider + 'static> super::exit::ExitFlush for Shared<P> {
    fn exit_flush(&self, deadline: std::time::Instant, wait: bool) -> bool {
        if sys::getpid() != self.pid || self.failed() {
            // A forked child: the parent's connections are not ours to close. A failed
            // stack: nothing can be delivered.
            return true;
        }
        let Some(mut g) = self.inner.try_lock_until(deadline) else {
            return false;
        };
        loop {
            if self.exit_round(&mut g) {
                return true;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if !wait || left.is_zero() {
                return false;
            }
            if self.step(&mut g) > 0 {
                self.wake_waiters();
                continue;
            }
            // The progress thread moves things along meanwhile and notifies.
            self.cond
                .wait_for(&mut g, left.min(Duration::from_millis(20)));
        }
    }
}

impl<P: Provider + 'static> Shared<P> {
    /// One round of [`flush_at_exit`](super::exit::flush_at_exit): close each connection the
    /// application holds once its queued zero-copy sends are settled (bytes of one that ended
    /// short still go by copy first); true when no closing connection has anything left to
    /// deliver. Connections waiting in a listener's queue (the driver's) are left alone.
    fn exit_round(&self, g: &mut Inner<P>) -> bool {
        let now = self.now();
        let mut done = true;
        let ids: Vec<ConnId> = g.socks.keys().copied().collect();
        for id in ids {
            if g.socks.get(&id).is_none_or(|s| s.exit_closed) {
                continue;
            }
            let settled = Runtime::<P>::zsends_settled(g, now, id);
            let Inner { driver, socks, .. } = &mut *g;
            let Some(s) = socks.get_mut(&id) else {
                continue;
            };
            if !settled || s.zsends.iter().any(|z| z.done.is_none()) {
                done = false;
                continue;
            }
            s.exit_closed = true;
            if s.linger == Some(Duration::ZERO) {
                // As TCP's exit with SO_LINGER {1, 0}: a reset, nothing more delivered.
                driver.abort(now, id);
            } else {
                driver.close_keep(now, id);
            }
            refresh_sock(driver, id, s);
        }
        done && g
            .driver
            .conn_ids()
            .into_iter()
            .all(|id| !g.driver.close_pending(id))
    }
}

/// Closing (see [`StackOps::close`]).
impl<P: Provider + 'static> Runtime<P> {
    /// `close(2)` without a linger, under the lock.
    fn close_locked(g: &mut Inner<P>, now: Instant, id: ConnId) {
        if let Some(p) = g.socks.get_mut(&id).and_then(|s| s.pump.as_mut()) {
            // Other processes may still hold the file: the pump closes when they all did.
            p.released = true;
            if !p.closed {
                return;
            }
            g.socks.remove(&id);
            g.pumps -= 1;
            return;
        }
        g.socks.remove(&id);
        g.driver.close(now, id);
    }
}

impl<P: Provider + 'static> StackOps for Runtime<P> {
    fn name(&self) -> &'static str {
        // No lock: after fork() the child may ask, and the parent's lock may be held forever.
        self.sh.name
    }
    fn alive(&self) -> bool {
        sys::getpid() == self.sh.pid && !self.sh.failed()
    }

    fn connect(
        &self,
        dst: SocketAddr,
        timeout: Option<Duration>,
        wait_room: bool,
    ) -> io::Result<ConnId> {
        // The whole connect, tries again included, within the timeout.
        let start = std::time::Instant::now();
        let limit = match timeout {
            Some(t) => t,
            None => self.lock()?.driver.config().connect_timeout,
        };
        let mut pause = QUEUE_FULL_RETRY_FIRST;
        loop {
            let left = limit.saturating_sub(start.elapsed());
            match self.connect_once(dst, Some(left)) {
                Err(None) if wait_room => {
                    let left = limit.saturating_sub(start.elapsed());
                    if left.is_zero() {
                        return Err(io::Error::from_raw_os_error(libc::ETIMEDOUT));
                    }
                    std::thread::sleep(pause.min(left));
                    pause = (pause * 2).min(QUEUE_FULL_RETRY_MAX);
                }
                Err(None) => return Err(io::Error::from_raw_os_error(libc::ECONNREFUSED)),
                Err(Some(e)) => return Err(e),
                Ok(id) => return Ok(id),
            }
        }
    }

    fn listen(&self, addr: SocketAddr, backlog: u32) -> io::Result<ListenerId> {
        let mut g = self.lock()?;
        // As listen(2): the kernel caps the backlog at somaxconn.
        let backlog = backlog.min(sys::somaxconn());
        let l = g.driver.listen(addr, backlog).map_err(driver_err)?;
        g.lsocks.insert(
            l,
            LSock {
                fd_given: false,
                ready: ReadyFd::new()?,
                bell: None,
            },
        );
        // Make the listener's readiness fd unwritable: only POLLIN means something.
        if let Some(ls) = g.lsocks.get_mut(&l) {
            ls.ready.set(false, false, false);
        }
        Ok(l)
    }

    fn listener_addr(&self, l: ListenerId) -> Option<SocketAddr> {
        self.lock().ok()?.driver.listener_addr(l)
    }

    fn accept(&self, l: ListenerId, w: Wait) -> io::Result<(ConnId, SocketAddr)> {
        self.block_on(w, |g, _| {
            let Inner {
                driver,
                lsocks,
                socks,
                ..
            } = g;
            let Some(ls) = lsocks.get_mut(&l) else {
                return Some(Err(io::Error::from_raw_os_error(libc::EBADF)));
            };
            // The first one set up, in arrival order (the driver's queue; one whose setup
            // failed is never handed over, one established and reset or closed since is).
            let id = driver.accept_established(l)?;
            socks.insert(id, Sock::default());
            ls.set_ready(driver.listen_stats(l).map_or(0, |s| s.ready));
            let peer = driver
                .peer_addr(id)
                .unwrap_or_else(|| SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), 0));
            Some(Ok((id, peer)))
        })
    }

    fn close_listener(&self, l: ListenerId) {
        let Ok(mut g) = self.lock() else { return };
        g.lsocks.remove(&l);
        // The driver aborts the connections nobody accepted (their peers see a reset).
        g.driver.close_listener(l);
    }

    fn listener_fd(&self, l: ListenerId) -> io::Result<RawFd> {
        let g = self.lock()?;
        let mut g = g;
        g.lsocks
            .get_mut(&l)
            .map(|ls| {
                ls.fd_given = true;
                ls.ready.fd()
            })
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
    }

    fn read(&self, id: ConnId, buf: &mut [u8], w: Wait) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        // A blocking read of a peer's zero-copy source takes it straight into `buf`, unless
        // the stream has zero copy off (`SdpStream::set_zero_copy(false)`).
        let mut try_z = !w.nonblocking
            && w.zcopy
            && buf.len() >= ZREAD_MIN
            && self.sh.user_zcopy.load(Ordering::Relaxed);
        loop {
            let r = self.block_on(w, |g, now| {
                if try_z && g.driver.next_is_zcopy(id) == Ok(true) {
                    return Some(Ok(None));
                }
                let r = match g.driver.read(now, id, buf) {
                    Ok(n) => Some(Ok(Some(n))),
                    Err(CallError::WouldBlock) => None,
                    Err(e) => Some(Self::report_once(g, id, e, Ok(0)).map(Some)),
                };
                Self::refresh(g, id);
                r
            })?;
            match r {
                Some(n) => return Ok(n),
                None => {
                    if let Some(n) = self.read_user_zcopy(id, buf)? {
                        return Ok(n);
                    }
                    try_z = false;
                }
            }
        }
    }

    fn write(&self, id: ConnId, buf: &[u8], w: Wait) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        // Zero copy holds the caller until the peer has the bytes, so only blocking writes
        // without a timeout use it.
        if !w.nonblocking
            && w.zcopy
            && w.timeout.is_none()
            && buf.len() >= self.user_zcopy_min()
            && buf.len() <= u32::MAX as usize
            && self.sh.user_zcopy.load(Ordering::Relaxed)
        {
            if let Some(n) = self.write_user_zcopy(id, buf)? {
                return Ok(n);
            }
        }
        self.write_copy(id, buf, w)
    }

    fn send_registered(
        &self,
        id: ConnId,
        mr: &mut DynMr,
        off: usize,
        len: usize,
    ) -> io::Result<usize> {
        check_range(mr, off, len)?;
        let zmin = self.sh.zcopy_threshold;
        if len < zmin.max(1) {
            // Small: a copy costs less than the round trip of an advertisement.
            let mut tmp = vec![0u8; len];
            mr.read(off, &mut tmp);
            return self.write_copy(id, &tmp, Wait::default());
        }
        // The peer reads these bytes (only these) while the transfer is outstanding.
        let sent = self.zcopy_send(id, mr, off, len.min(u32::MAX as usize), None)?;
        if sent < len {
            let mut tmp = vec![0u8; len - sent];
            mr.read(off + sent, &mut tmp);
            self.write_copy(id, &tmp, Wait::default())?;
        }
        Ok(len)
    }

    fn recv_registered(
        &self,
        id: ConnId,
        mr: &mut DynMr,
        off: usize,
        len: usize,
    ) -> io::Result<usize> {
        check_range(mr, off, len)?;
        if len == 0 {
            return Ok(0);
        }
        // Wait for something to read, then take it straight into the region if it is a
        // zero-copy source, by copy otherwise.
        self.block_on(Wait::default(), |g, _| {
            let c = g.driver.view(id)?;
            c.is_readable().then_some(Ok(()))
        })?;
        if let Some(n) = self.zcopy_recv(id, mr, off, len)? {
            return Ok(n);
        }
        let mut tmp = vec![0u8; len];
        let n = self.read(id, &mut tmp, Wait::default())?;
        mr.write(off, &tmp[..n]);
        Ok(n)
    }

    fn register(&self, len: usize) -> io::Result<DynMr> {
        let g = self.lock()?;
        let mr = g
            .driver
            .reg_mr(len, Access::LOCAL_WRITE)
            .map_err(verbs_err)?;
        Ok(Box::new(mr))
    }

    fn send_registered_async(&self, id: ConnId, mut mr: DynMr, off: usize, len: usize) -> ZStart {
        if let Err(e) = check_range(&mr, off, len) {
            return ZStart::Done(mr, Err(e));
        }
        let zmin = match self.lock() {
            Ok(g) => g.driver.config().zcopy_threshold,
            Err(e) => return ZStart::Done(mr, Err(e)),
        };
        if len < zmin.max(1) || len > u32::MAX as usize {
            // Small (or too large for one source): the synchronous path copies or splits.
            let r = self.send_registered(id, &mut mr, off, len);
            return ZStart::Done(mr, r);
        }
        // The peer reads these bytes (only these) until the engine reports the source done.
        let grant = match mr.advertise(off, len, Access::REMOTE_READ) {
            Ok(g) => g,
            Err(e) => return ZStart::Done(mr, Err(verbs_err(e))),
        };
        let src = ZSrc {
            addr: grant.addr,
            len: len as u32,
            lkey: grant.lkey,
            rkey: grant.rkey,
        };
        let mut slot = Some(mr);
        let mut token = 0;
        let r = self.block_on(Wait::default(), |g, now| {
            if !Self::zsends_settled(g, now, id) {
                return None;
            }
            if token == 0 {
                token = g.next_token;
                g.next_token += 1;
            }
            match g.driver.write_zcopy(now, id, src, token) {
                Ok(()) => {
                    let Some(s) = g.socks.get_mut(&id) else {
                        return Some(Err(io::Error::from_raw_os_error(libc::EBADF)));
                    };
                    let mr = slot.take().expect("taken once");
                    s.zsends.push_back(ZSend {
                        token,
                        mr,
                        grant,
                        off,
                        len,
                        done: None,
                    });
                    Some(Ok(()))
                }
                Err(CallError::WouldBlock) => None,
                Err(e) => Some(Err(io_err(e))),
            }
        });
        match (r, slot) {
            (Ok(()), _) => ZStart::Pending(token),
            (Err(e), Some(mut mr)) => {
                // Never advertised: take the peer's access back.
                let _ = mr.revoke(&grant);
                ZStart::Done(mr, Err(e))
            }
            (Err(e), None) => {
                // Queued in the engine yet the call failed: cannot happen (the push is the last
                // step), but the region stays with the runtime until the engine ends it.
                let _ = e;
                ZStart::Pending(token)
            }
        }
    }

    fn send_registered_poll(
        &self,
        id: ConnId,
        ticket: u64,
        block: bool,
    ) -> io::Result<Option<(DynMr, io::Result<usize>)>> {
        let w = Wait {
            nonblocking: !block,
            ..Wait::default()
        };
        // No timeout when blocking: the peer may read the memory until the engine says it is
        // done, which it always does (finished, cancelled, or the connection failed).
        let r = self.block_on(w, |g, now| {
            Self::zsends_settled(g, now, id);
            let Some(s) = g.socks.get_mut(&id) else {
                return Some(Err(io::Error::from_raw_os_error(libc::EBADF)));
            };
            let i = s.zsends.iter().position(|z| z.token == ticket)?;
            s.zsends[i].done.as_ref()?;
            let z = s.zsends.remove(i).expect("found");
            Some(Ok((z.mr, z.done.expect("checked"))))
        });
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e) if !block && e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn send_registered_peek(&self, id: ConnId, ticket: u64) -> io::Result<bool> {
        let mut g = self.lock()?;
        if self.sh.step(&mut g) > 0 {
            self.sh.wake_waiters();
        }
        let now = self.now();
        Self::zsends_settled(&mut g, now, id);
        let Some(s) = g.socks.get(&id) else {
            return Ok(true);
        };
        Ok(s.zsends
            .iter()
            .find(|z| z.token == ticket)
            .is_none_or(|z| z.done.is_some()))
    }

    fn shutdown(&self, id: ConnId, how: Shutdown) -> io::Result<()> {
        self.with_sock(id, |g, now| g.driver.shutdown(now, id, how).map_err(io_err))
    }

    fn set_linger(&self, id: ConnId, linger: Option<Duration>) -> io::Result<()> {
        self.with_sock(id, |g, _| {
            if let Some(s) = g.socks.get_mut(&id) {
                s.linger = linger;
            }
            Ok(())
        })
    }
    fn linger(&self, id: ConnId) -> io::Result<Option<Duration>> {
        self.with_sock(id, |g, _| Ok(g.socks.get(&id).and_then(|s| s.linger)))
    }

    fn close(&self, id: ConnId) {
        let linger = {
            let Ok(mut g) = self.lock() else { return };
            let now = self.now();
            // A stream shared with other processes (pumped) ends with its last holder's close,
            // as a TCP file does: no linger.
            match g
                .socks
                .get(&id)
                .filter(|s| s.pump.is_none())
                .and_then(|s| s.linger)
            {
                None => return Self::close_locked(&mut g, now, id),
                Some(l) if l.is_zero() => {
                    g.socks.remove(&id);
                    g.driver.abort(now, id);
                    g.driver.release(now, id);
                    return;
                }
                Some(l) => l,
            }
        };
        let w = Wait {
            timeout: Some(linger),
            ..Wait::default()
        };
        // As TCP's close with a linger: blocks (nonblocking or not) until the peer has
        // acknowledged every byte or the time is up; the close goes on either way.
        let _ = self.block_on(w, |g, _| {
            let backlog = g.socks.get(&id).map_or(0, |s| s.zbacklog.len());
            let open = g
                .driver
                .view(id)
                .is_some_and(|c| c.state() != State::Closed);
            (!open || backlog + g.driver.tx_queued(id) == 0).then_some(Ok(()))
        });
        if let Ok(mut g) = self.lock() {
            let now = self.now();
            Self::close_locked(&mut g, now, id);
        }
    }

    fn ready_fd(&self, id: ConnId) -> io::Result<RawFd> {
        let mut g = self.lock()?;
        let s = g
            .socks
            .get_mut(&id)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        if s.ready.is_none() {
            s.ready = Some(ReadyFd::new()?);
        }
        let fd = s.ready.as_ref().map(|r| r.fd()).unwrap_or(-1);
        Self::refresh(&mut g, id);
        Ok(fd)
    }

    fn addrs(&self, id: ConnId) -> io::Result<(SocketAddr, SocketAddr)> {
        let g = self.lock()?;
        // After a failure there is no peer (getpeername gives ENOTCONN on a reset TCP socket).
        let failed = g
            .driver
            .view(id)
            .is_some_and(|c| c.state() == State::Closed && c.error().is_some());
        match (g.driver.local_addr(id), g.driver.peer_addr(id)) {
            (Some(l), Some(p)) if !failed => Ok((l, p)),
            _ => Err(io::Error::from_raw_os_error(libc::ENOTCONN)),
        }
    }

    fn set_nodelay(&self, id: ConnId, on: bool) -> io::Result<()> {
        self.with_sock(id, |g, now| {
            g.driver.set_nodelay(now, id, on).map_err(driver_err)
        })
    }
    fn nodelay(&self, id: ConnId) -> io::Result<bool> {
        self.with_sock(id, |g, _| {
            g.driver
                .nodelay(id)
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
        })
    }
    fn set_sndbuf(&self, id: ConnId, bytes: usize) -> io::Result<()> {
        self.with_sock(id, |g, now| {
            g.driver.set_sndbuf(now, id, bytes).map_err(driver_err)
        })
    }
    fn sndbuf(&self, id: ConnId) -> io::Result<usize> {
        self.with_sock(id, |g, _| {
            g.driver
                .sndbuf(id)
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
        })
    }
    fn set_rcvbuf(&self, id: ConnId, bytes: usize) -> io::Result<()> {
        self.with_sock(id, |g, now| {
            g.driver.set_rcvbuf(now, id, bytes).map_err(driver_err)
        })
    }
    fn rcvbuf(&self, id: ConnId) -> io::Result<usize> {
        self.with_sock(id, |g, _| {
            g.driver
                .rcvbuf(id)
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
        })
    }
    fn take_error(&self, id: ConnId) -> io::Result<Option<io::Error>> {
        self.with_sock(id, |g, _| {
            let Inner { driver, socks, .. } = g;
            let s = socks.get_mut(&id).expect("checked by with_sock");
            if s.error_taken {
                return Ok(None);
            }
            let e: Option<ConnError> = driver.conn_error(id).cloned();
            Ok(e.map(|e| {
                s.error_taken = true;
                io::Error::from_raw_os_error(e.errno())
            }))
        })
    }
    fn send_queue_len(&self, id: ConnId) -> io::Result<usize> {
        self.with_sock(id, |g, _| {
            let backlog = g.socks.get(&id).map_or(0, |s| s.zbacklog.len());
            let queued = g.driver.tx_queued(id);
            Ok(queued + backlog)
        })
    }
    fn inject_progress_panic(&self) {
        self.sh.inject_panic.store(true, Ordering::SeqCst);
        sys::eventfd_signal(&self.sh.wake);
    }
    fn user_zcopy_reads(&self) -> u64 {
        self.sh.user_zreads.load(Ordering::Relaxed)
    }
    fn conn_count(&self) -> usize {
        self.lock().map_or(0, |g| g.driver.conn_count())
    }
    fn app_attach(&self, id: ConnId, nonblocking: bool, cloexec: bool) -> io::Result<OwnedFd> {
        let mut g = self.lock()?;
        let Inner { driver, socks, .. } = &mut *g;
        let s = socks
            .get_mut(&id)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        if s.app.is_some() {
            return Err(io::Error::from_raw_os_error(libc::EEXIST));
        }
        let (mut app, user) = AppReady::new(nonblocking, cloexec)?;
        if super::tunables::tunables().direct_wake {
            if let Some(fd) = app.ours_fd() {
                app.direct = driver.give_direct_wake(id, fd);
            }
        }
        s.app = Some(app);
        refresh_app(driver, id, s, Some(user.as_raw_fd()));
        Ok(user)
    }

    fn app_read(&self, id: ConnId, user: RawFd, buf: &mut [u8], peek: bool) -> io::Result<usize> {
        // As TCP's: a connection's error is reported once; reads after it see EOF.
        self.app_call_once(id, user, true, Ok(0), |g, now| {
            if peek {
                g.driver
                    .peek(id, buf)
                    .unwrap_or(Err(CallError::Conn(ConnError::Reset)))
            } else {
                g.driver.read(now, id, buf)
            }
        })
    }

    fn app_write(&self, id: ConnId, user: RawFd, buf: &[u8]) -> io::Result<usize> {
        // ... and writes after it EPIPE.
        let later = Err(io::Error::from_raw_os_error(libc::EPIPE));
        self.app_call_once(id, user, false, later, |g, now| {
            if !Self::zsends_settled(g, now, id) {
                return Err(CallError::WouldBlock);
            }
            g.driver.write(now, id, buf)
        })
    }

    fn app_shutdown(&self, id: ConnId, user: RawFd, how: Shutdown) -> io::Result<()> {
        self.app_call(id, user, |g, now| g.driver.shutdown(now, id, how))
    }

    fn app_info(&self, id: ConnId) -> io::Result<super::app::AppInfo> {
        let mut g = self.lock()?;
        // FIONREAD after a direct wakeup counts what the wakeup announced, as TCP's counts what
        // made the fd readable.
        if Self::direct_pending(&g, id) && self.sh.step(&mut g) > 0 {
            self.sh.wake_waiters();
        }
        let c = g
            .driver
            .view(id)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        let s = c.stats();
        Ok(super::app::AppInfo {
            state: c.state(),
            rx_queued: c.rx_queued(),
            tx_queued: c.tx_queued(),
            bytes_in: s.data_bytes_rcvd,
            bytes_out: s.data_bytes_sent,
            zcopy_bytes: s.zcopy_read_bytes + s.zcopy_write_bytes + s.zcopy_send_bytes,
            credits: c.tx_credits(),
            send_size: c.send_size(),
            read_closed: c.read_closed(),
            write_closed: c.write_closed(),
            error: c.error().map(|e| e.errno()),
            urgent: c.urgent_pending(),
        })
    }

    fn app_send_urgent(&self, id: ConnId, user: RawFd, byte: u8) -> io::Result<()> {
        self.app_call(id, user, |g, now| {
            g.driver
                .send_urgent(now, id, byte)
                .unwrap_or(Err(CallError::Conn(ConnError::Reset)))
        })
    }

    fn app_read_urgent(&self, id: ConnId, user: RawFd, peek: bool) -> io::Result<Option<u8>> {
        self.app_call(id, user, |g, now| {
            g.driver
                .read_urgent(now, id, peek)
                .map_err(|_| CallError::Conn(ConnError::Reset))
        })
    }

    fn app_share(&self, id: ConnId, user: RawFd) -> io::Result<()> {
        let mut g = self.lock()?;
        let now = self.now();
        let Inner {
            driver,
            socks,
            pumps,
            ..
        } = &mut *g;
        let s = socks
            .get_mut(&id)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        let Some(app) = s.app.take() else {
            return Ok(());
        };
        if app.direct {
            // Real bytes will flow through the file: no token of the peer's may land among
            // them.
            driver.set_direct_wake(id, false, true);
        }
        if let Some((ours, eof_out)) = app.into_ours(user) {
            let _ = sys::setsockopt_int(user, libc::SOL_SOCKET, libc::SO_SNDBUF, 1 << 20);
            let mut p = super::pump::Pump::new(ours, eof_out);
            p.run(driver, now, id);
            s.pump = Some(p);
            *pumps += 1;
        }
        drop(g);
        sys::eventfd_signal(&self.sh.wake);
        Ok(())
    }

    fn set_listener_bell(&self, l: ListenerId, bell: Bell) -> io::Result<()> {
        let mut g = self.lock()?;
        let ls = g
            .lsocks
            .get_mut(&l)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        ls.bell = Some(bell);
        Ok(())
    }

    fn registered_bytes(&self) -> usize {
        self.lock().map_or(0, |g| g.driver.registered_bytes())
    }
}

fn check_range(mr: &DynMr, off: usize, len: usize) -> io::Result<()> {
    if off.checked_add(len).is_none_or(|end| end > mr.len()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "range outside the registered buffer",
        ));
    }
    Ok(())
}

impl<P: Provider + 'static> Runtime<P> {
    /// One nonblocking call on a socket in application-fd mode: `op`, and once more after a
    /// round of progress if it would block; then the application's fd `user` is brought up to
    /// date (a socket found not readable or not writable has its fd made so, under the lock).
    /// [`Self::app_call`] for reads and writes: the connection's error is reported once
    /// ([`Self::report_once`]); a call after it gets `later`.
    fn app_call_once<T>(
        &self,
        id: ConnId,
        user: RawFd,
        reading: bool,
        later: io::Result<T>,
        op: impl FnMut(&mut Inner<P>, Instant) -> Result<T, CallError>,
    ) -> io::Result<T> {
        self.app_call_inner(id, user, reading, Some(later), op)
    }

    fn app_call<T>(
        &self,
        id: ConnId,
        user: RawFd,
        op: impl FnMut(&mut Inner<P>, Instant) -> Result<T, CallError>,
    ) -> io::Result<T> {
        self.app_call_inner(id, user, false, None, op)
    }

    /// The peer of `id`'s application fd may have announced SENDs by a direct wakeup that no
    /// round has taken yet (see `AppReady`).
    fn direct_pending(g: &Inner<P>, id: ConnId) -> bool {
        g.socks
            .get(&id)
            .and_then(|s| s.app.as_ref())
            .is_some_and(|a| a.direct)
            && !g.driver.endpoint_quiet(id)
    }

    /// A round of progress run by an application call on `id`, which brings its own fd up to
    /// date afterwards (the round leaves that fd alone: `Inner::in_app_call`).
    fn app_call_round(&self, g: &mut Inner<P>, id: ConnId) {
        g.in_app_call = Some(id);
        let act = self.sh.step(g);
        g.in_app_call = None;
        if act > 0 {
            self.sh.wake_waiters();
        }
    }

    /// One nonblocking attempt (a round of progress first if it would block); with `later`,
    /// a connection error goes through [`Self::report_once`]. A read (`reading`) that leaves
    /// nothing to read takes the peer's direct tokens back (see `AppReady`).
    fn app_call_inner<T>(
        &self,
        id: ConnId,
        user: RawFd,
        reading: bool,
        later: Option<io::Result<T>>,
        mut op: impl FnMut(&mut Inner<P>, Instant) -> Result<T, CallError>,
    ) -> io::Result<T> {
        let mut g = self.lock()?;
        let mut stepped = false;
        if reading && Self::direct_pending(&g, id) {
            // A direct wakeup brought the application here before any round took the SENDs
            // it announced: take them first, so the read returns everything that arrived
            // before the edge, as TCP's does.
            stepped = true;
            self.app_call_round(&mut g, id);
        }
        loop {
            if !g.socks.contains_key(&id) {
                return Err(io::Error::from_raw_os_error(libc::EBADF));
            }
            let r = op(&mut g, self.now());
            self.sh.after_call(&mut g);
            if matches!(r, Err(CallError::WouldBlock)) && !stepped {
                stepped = true;
                self.app_call_round(&mut g, id);
                continue;
            }
            let r = match (r, later) {
                (Err(e @ CallError::Conn(_)), Some(later)) => {
                    Self::report_once(&mut g, id, e, later)
                }
                (r, _) => r.map_err(io_err),
            };
            let Inner { driver, socks, .. } = &mut *g;
            let Some(s) = socks.get_mut(&id) else {
                return r;
            };
            refresh_app(driver, id, s, Some(user));
            // A read that leaves nothing to read (it took everything, or found nothing) takes
            // the peer's tokens back: left there, the fd would poll readable for nothing.
            if !reading || driver.view(id).is_some_and(|c| c.read_ready()) {
                return r;
            }
            if let Some(a) = s.app.as_mut() {
                a.take_direct_tokens(user);
            }
            // A token taken back may announce a SEND published after our round: look again
            // (the peer rings the bell before it writes the token).
            if Self::direct_pending(&g, id) {
                self.app_call_round(&mut g, id);
                let Inner { driver, socks, .. } = &mut *g;
                if let Some(s) = socks.get_mut(&id) {
                    refresh_app(driver, id, s, Some(user));
                }
            }
            return r;
        }
    }
}
