//! The sockets the shim owns, by fd number. A call on any other fd costs one relaxed atomic
//! load (no lock, no allocation) before it goes to libc.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use sdp_core::socket::app::{AppListener, AppStream};

/// fds at or above this are never taken over (they stay kernel TCP).
pub(crate) const MAX_FD: usize = 1 << 16;

/// What the shim owns at each fd: [`NOT_OWNED`], [`STREAM`] (an SDP stream, or one got
/// through exec) or [`OTHER`] (a fresh socket, a listener).
static OWNED: [AtomicU8; MAX_FD] = [const { AtomicU8::new(NOT_OWNED) }; MAX_FD];
const NOT_OWNED: u8 = 0;
const STREAM: u8 = 1;
const OTHER: u8 = 2;

/// Calls on owned fds check that the number still names the file it had (`get`): off until
/// something may close an owned fd where no hook sees it. Every close the program makes
/// through libc's close, close_range, closefrom, dup2, dup3 and `syscall()` goes through the
/// shim's hooks, which take the entry out first; what remains is stdio (glibc's `fclose`,
/// `freopen` and `fcloseall` close inside libc): a `FILE` on an owned fd (`fdopen`, or a
/// socket at fds 0 to 2) turns the checks on for the process's life, as does
/// `SDP_FD_CHECK=1` (a program that closes by inline system calls). The check is an `fstat`
/// per call: it was two of the five system calls of a redis-server request.
static CHECK: AtomicBool = AtomicBool::new(false);

/// The fds epoll_create made (by number: a stale one only makes [`want_all_edges`] come
/// sooner, which costs speed, never an edge).
static EPOLL_FDS: [AtomicBool; MAX_FD] = [const { AtomicBool::new(false) }; MAX_FD];

/// Every stream shows an edge per arrival (an epoll set was registered edge-triggered in
/// another): set for good.
static ALL_EDGES: AtomicBool = AtomicBool::new(false);

pub(crate) fn note_epoll_fd(fd: i32) {
    if (0..MAX_FD as i32).contains(&fd) {
        EPOLL_FDS[fd as usize].store(true, Ordering::Relaxed);
    }
}

pub(crate) fn is_epoll(fd: i32) -> bool {
    (0..MAX_FD as i32).contains(&fd) && EPOLL_FDS[fd as usize].load(Ordering::Relaxed)
}

/// From now on every stream, the process's and those to come, wants an edge per arrival.
pub(crate) fn want_all_edges() {
    if ALL_EDGES.swap(true, Ordering::SeqCst) {
        return;
    }
    for (_, s) in streams() {
        s.want_edges();
    }
}

/// Turn on the identity checks of [`CHECK`] (for good).
pub(crate) fn check_identities() {
    CHECK.store(true, Ordering::Relaxed);
}

/// Whether calls on owned fds check the file's identity ([`CHECK`]).
pub(crate) fn checking_identities() -> bool {
    CHECK.load(Ordering::Relaxed)
}
/// SO_SNDBUF (bit 0) and SO_RCVBUF (bit 1) the application set on a socket the shim owns
/// before it became an SDP stream (a fresh socket, a listener), by fd number: carried to the
/// stream (a connected one, or one accepted from the listener), as Linux keeps a buffer size
/// set explicitly and autotunes the others.
static BUFS_SET: [AtomicU8; MAX_FD] = [const { AtomicU8::new(0) }; MAX_FD];

fn buf_bit(name: i32) -> u8 {
    match name {
        libc::SO_SNDBUF => 1,
        libc::SO_RCVBUF => 2,
        _ => 0,
    }
}

/// The application set SO_SNDBUF or SO_RCVBUF (`name`) on `fd`, which the shim owns.
pub(crate) fn note_buffer_set(fd: i32, name: i32) {
    if (fd as u32 as usize) < MAX_FD {
        BUFS_SET[fd as usize].fetch_or(buf_bit(name), Ordering::Relaxed);
    }
}

/// A new socket at `fd`: nothing set on it yet.
pub(crate) fn forget_buffers(fd: i32) {
    if (fd as u32 as usize) < MAX_FD {
        BUFS_SET[fd as usize].store(0, Ordering::Relaxed);
    }
}

/// An accepted socket at `to` has what the application set on its listener `from`, as
/// Linux's inherits the listener's locked buffer sizes.
pub(crate) fn inherit_buffers(from: i32, to: i32) {
    if (from as u32 as usize) < MAX_FD && (to as u32 as usize) < MAX_FD {
        let v = BUFS_SET[from as usize].load(Ordering::Relaxed);
        BUFS_SET[to as usize].store(v, Ordering::Relaxed);
    }
}

/// Whether the application set SO_SNDBUF or SO_RCVBUF (`name`) on `fd`.
pub(crate) fn buffer_set(fd: i32, name: i32) -> bool {
    (fd as u32 as usize) < MAX_FD
        && BUFS_SET[fd as usize].load(Ordering::Relaxed) & buf_bit(name) != 0
}

/// fd -> the socket and the identity (device, inode) of the file the fd had when it was
/// entered: a number closed behind the shim's back (a raw system call, libc's own close) and
/// reused for another file is recognised and forgotten. A spin lock, as every lock a fork
/// crosses (sdp-core's `ForkMutex`): held across the fork, it is unlocked in the child by one
/// store, where a parking_lot lock could hand itself to a waiting thread the child lacks.
static MAP: spin::rwlock::RwLock<Option<Map>, spin::relax::Yield> = spin::rwlock::RwLock::new(None);

type Map = rustc_hash::FxHashMap<i32, (Arc<Sock>, FileId)>;

/// A kernel file's identity.
type FileId = (u64, u64);

pub(crate) fn file_id(fd: i32) -> Option<FileId> {
    // SAFETY: an all-zero stat is a valid value for the kernel to overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // The fstat system call itself where there is one: glibc's fstat is fstatat(fd, "",
    // AT_EMPTY_PATH), which costs the kernel a look at the empty path on every owned-fd call
    // (~80 ns of ~380).
    #[cfg(target_arch = "x86_64")]
    // SAFETY: fstat writes into our own struct.
    let r = unsafe { libc::syscall(libc::SYS_fstat, fd, &mut st as *mut libc::stat) } as i32;
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: fstat writes into our own struct.
    let r = unsafe { libc::fstat(fd, &mut st) };
    (r == 0).then_some((st.st_dev, st.st_ino))
}

/// Socket options of an SDP stream the kernel file cannot hold (it is an AF_UNIX socket),
/// kept as TCP would report them.
#[derive(Debug, Default)]
pub(crate) struct Opts {
    pub(crate) stored: HashMap<(i32, i32), Vec<u8>>,
    /// "client" or "server", for reports.
    pub(crate) role: &'static str,
    /// getsockname / getpeername (kept: a forked child's runtime cannot answer).
    pub(crate) local: Option<std::net::SocketAddr>,
    pub(crate) peer: Option<std::net::SocketAddr>,
    /// The application's socket is AF_INET6: `local` and `peer` are IPv6 (an IPv4 peer of a
    /// dual-stack socket v4-mapped, as the kernel shows it), SO_DOMAIN says so.
    pub(crate) v6: bool,
    /// The kernel socket the application bound to a port before connecting over SDP, held (at
    /// a high number) while the stream lives: the port stays taken, as a TCP connection's.
    pub(crate) port_hold: Option<std::os::fd::OwnedFd>,
    /// A fresh socket's epoll registrations (`epoll_ctl` on it before `connect`), made again on
    /// the stream's file when `connect` puts that file under the socket's number.
    pub(crate) epoll: Vec<EpollWatch>,
}

/// One epoll registration of a fresh socket: the epoll set, the socket's number, its events.
#[derive(Clone, Copy)]
pub(crate) struct EpollWatch {
    pub(crate) epfd: i32,
    pub(crate) fd: i32,
    pub(crate) events: u32,
    pub(crate) data: u64,
}

impl std::fmt::Debug for EpollWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "epoll {} fd {} events {:#x}",
            self.epfd, self.fd, self.events
        )
    }
}

impl Opts {
    /// `a` as a socket of this family shows it (see [`Opts::v6`]).
    pub(crate) fn shown(v6: bool, a: Option<std::net::SocketAddr>) -> Option<std::net::SocketAddr> {
        match a {
            Some(std::net::SocketAddr::V4(a4)) if v6 => Some(std::net::SocketAddr::V6(
                std::net::SocketAddrV6::new(a4.ip().to_ipv6_mapped(), a4.port(), 0, 0),
            )),
            a => a,
        }
    }
}

/// A socket's options' lock: a spin lock, as every lock a fork crosses (the fork handlers hold
/// them all, see `lock_for_fork`): a parking_lot lock another thread was parked on at the fork
/// could hand itself, when the child lets it go, to that thread, which the child lacks (a fork
/// child of a thread calling getsockname in a loop hung in its own getsockname, 1 in ~10 000
/// forks on a loaded host).
pub(crate) type OptsLock = spin::mutex::SpinMutex<Opts, spin::relax::Yield>;

/// What an fd the shim owns is.
pub(crate) enum Sock {
    /// A kernel TCP socket not yet connected or listening: SDP may take it over. Its options
    /// hold only its epoll registrations (`Opts::epoll`).
    Fresh(OptsLock),
    /// A kernel TCP listening socket with SDP listeners on the same address.
    Listener(AppListener),
    /// An SDP stream whose fd is its readiness pair's user end.
    Stream(AppStream, OptsLock),
    /// An SDP stream this program got through exec (the program before it held the fd): its
    /// bytes flow through the kernel file, which the process owning the connection pumps;
    /// the shim answers its identity (addresses, options) as TCP would (`exec.rs`).
    Exec(OptsLock),
}

impl Sock {
    /// A stream's engine stream (none for one got through exec) and options; `None` for a
    /// socket that is no stream.
    pub(crate) fn stream_parts(&self) -> Option<(Option<&AppStream>, &OptsLock)> {
        match self {
            Sock::Stream(st, o) => Some((Some(st), o)),
            Sock::Exec(o) => Some((None, o)),
            _ => None,
        }
    }

    /// A stream's fd must show an edge per arrival (`AppStream::want_edges`); nothing for
    /// other sockets.
    pub(crate) fn want_edges(&self) {
        if let Sock::Stream(st, _) = self {
            let _g = crate::Internal::enter();
            st.want_edges();
        }
    }

    /// The socket's options, whatever it is (a listener has none).
    pub(crate) fn opts(&self) -> Option<&OptsLock> {
        match self {
            Sock::Fresh(o) | Sock::Stream(_, o) | Sock::Exec(o) => Some(o),
            Sock::Listener(_) => None,
        }
    }
}

impl Drop for Sock {
    fn drop(&mut self) {
        if let Sock::Stream(s, o) = self {
            if s.is_inherited() {
                // Its owner reports it.
                return;
            }
            crate::report::push(crate::report::of_stream(&o.lock(), s));
        }
    }
}

/// Whether the shim owns `fd` (fast path for everything else).
#[inline]
pub(crate) fn owned(fd: i32) -> bool {
    kind(fd) != NOT_OWNED
}

#[inline]
fn kind(fd: i32) -> u8 {
    if (fd as u32 as usize) < MAX_FD {
        OWNED[fd as usize].load(Ordering::Relaxed)
    } else {
        NOT_OWNED
    }
}

/// Whether the shim owns `fd` as a fresh socket or a listener (not a stream): one load.
#[inline]
pub(crate) fn owned_other(fd: i32) -> bool {
    kind(fd) == OTHER
}

pub(crate) fn get(fd: i32) -> Option<Arc<Sock>> {
    if !owned(fd) {
        return None;
    }
    let (s, id) = MAP.read().as_ref()?.get(&fd).cloned()?;
    if !checking_identities() || file_id(fd) == Some(id) {
        return Some(s);
    }
    // The number now names another file (or none): the socket was closed behind our back.
    let stale = {
        let mut m = MAP.write();
        match m.as_mut().and_then(|m| m.get(&fd)) {
            Some((_, cur)) if *cur == id => {
                OWNED[fd as usize].store(NOT_OWNED, Ordering::Relaxed);
                m.as_mut().and_then(|m| m.remove(&fd))
            }
            _ => None,
        }
    };
    // Both handles dropped as the shim's own work (the socket's last one ends its stream).
    crate::drop_internal((s, stale));
    None
}

pub(crate) fn insert(fd: i32, s: Arc<Sock>) -> bool {
    if fd < 0 || fd as usize >= MAX_FD {
        return false;
    }
    if matches!(&*s, Sock::Stream(st, _) if !st.is_inherited()) {
        // A signal that ends the process delivers what was written from now on.
        crate::signals::install();
    }
    let Some(id) = file_id(fd) else {
        return false;
    };
    if fd <= 2 {
        // stdio's fds: glibc may close or replace this one inside libc (`freopen`, `fclose`).
        check_identities();
    }
    let k = if s.stream_parts().is_some() {
        STREAM
    } else {
        OTHER
    };
    let mut m = MAP.write();
    m.get_or_insert_with(Map::default)
        .insert(fd, (s.clone(), id));
    OWNED[fd as usize].store(k, Ordering::Relaxed);
    drop(m);
    // (After the entry: `want_all_edges` sets the flag, then walks the table.)
    if ALL_EDGES.load(Ordering::SeqCst) {
        s.want_edges();
    }
    true
}

/// Whether the table's lock can be had within `within` (see `signals`).
pub(crate) fn free_within(within: std::time::Duration) -> bool {
    let end = std::time::Instant::now() + within;
    loop {
        if MAP.try_write().is_some() {
            return true;
        }
        if std::time::Instant::now() >= end {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

pub(crate) fn remove(fd: i32) -> Option<Arc<Sock>> {
    if !owned(fd) {
        return None;
    }
    let mut m = MAP.write();
    OWNED[fd as usize].store(NOT_OWNED, Ordering::Relaxed);
    m.as_mut()?.remove(&fd).map(|(s, _)| s)
}

/// The sockets `pick` chooses, with their fds.
fn pick(pick: impl Fn(&Sock) -> bool) -> Vec<(i32, Arc<Sock>)> {
    MAP.read().as_ref().map_or(Vec::new(), |m| {
        m.iter()
            .filter(|(_, (s, _))| pick(s))
            .map(|(fd, (s, _))| (*fd, s.clone()))
            .collect()
    })
}

/// Every fd the shim owns.
pub(crate) fn fds() -> Vec<i32> {
    pick(|_| true).into_iter().map(|(fd, _)| fd).collect()
}

/// Every SDP stream the process holds (for reports and exit).
pub(crate) fn streams() -> Vec<(i32, Arc<Sock>)> {
    pick(|s| matches!(s, Sock::Stream(..)))
}

/// Every SDP stream whose identity the shim answers, its own and those it got through exec.
pub(crate) fn identities() -> Vec<(i32, Arc<Sock>)> {
    pick(|s| s.stream_parts().is_some())
}

/// Before fork(): hold the table so the child gets it in a consistent state.
pub(crate) fn lock_for_fork() {
    // Every socket's options too: a fork child of a threaded process would wait for ever on
    // one another thread held at the fork (a getsockname in a loop: 22 of 200 children hung).
    // Taken with the table held, each by a try, all let go again whenever one is busy (its
    // holder may be waiting for the table), so this never waits holding one.
    for round in 0.. {
        let g = MAP.write();
        let opts = g.as_ref().map(fork_opts).unwrap_or_default();
        let mut taken = 0;
        for o in &opts {
            // A holder lets go within moments (it cannot take another socket's options
            // meanwhile: a new call waits for the table); one that waits for the table while
            // it holds them does not, so after a while the table is let go and taken again.
            let until = std::time::Instant::now() + std::time::Duration::from_micros(200);
            let got = loop {
                if let Some(guard) = o.try_lock() {
                    break Some(guard);
                }
                if std::time::Instant::now() > until {
                    break None;
                }
                std::hint::spin_loop();
            };
            match got {
                Some(guard) => {
                    std::mem::forget(guard);
                    taken += 1;
                }
                None => break,
            }
        }
        if taken == opts.len() || round == 1_000 {
            // (After 1 000 rounds, a thread that never lets go: the fork goes on with the
            // options taken so far, as before.) The options taken are the first `taken` of
            // this order, which `unlock_after_fork` finds again through the same guard.
            FORK_OPTS_TAKEN.store(taken, Ordering::SeqCst);
            drop(opts);
            *FORK_HELD.lock() = Some(HeldForFork(g));
            return;
        }
        for o in &opts[..taken] {
            // SAFETY: taken just above by this thread, its guard forgotten.
            unsafe { o.force_unlock() };
        }
        drop(g);
        std::thread::yield_now();
    }
}

/// Every socket's options lock of the table, once each (a socket under two fds, `dup`, has
/// one), in one order: what [`lock_for_fork`] takes and [`unlock_after_fork`] lets go. Taking
/// a dup'd socket's twice failed every round (its second try met its own first), and the fork
/// waited out 1 000 rounds, 0.2-0.4 s per fork (`tests/preload/repro/repro-dup-fork-stall.sh`);
/// the let-go walked streams only, so a fresh socket's lock taken at a fork stayed taken.
fn fork_opts(m: &Map) -> Vec<&OptsLock> {
    let mut v: Vec<&OptsLock> = m.values().filter_map(|(s, _)| s.opts()).collect();
    v.sort_by_key(|o| *o as *const OptsLock as usize);
    v.dedup_by_key(|o| *o as *const OptsLock as usize);
    v
}

/// In a fork child, before [`unlock_after_fork`]: readers of the table that were only trying
/// (another thread of the parent's, which counted itself in while the table was held for the
/// fork, and would have counted itself out) do not exist here: their counts go, or the table
/// stayed taken for good (a child calling getsockname while another thread of its parent did
/// in a loop: 22 of 200 hung in `take_listeners`).
pub(crate) fn forget_readers_in_child() {
    // (At most one per thread of the parent; nobody takes the table upgradeable, which
    // `reader_count` would count too.)
    for _ in 0..4096 {
        if MAP.reader_count() == 0 {
            break;
        }
        // SAFETY: a fork child has one thread, and it holds no read guard of the table.
        unsafe { MAP.force_read_decrement() };
    }
}

/// The table's write guard across a fork (one fork at a time: the guard itself serializes
/// them), let go by dropping it, as any guard; a fork child's copy is its own. A static, not a
/// thread local: a fork from the exit work (the keeper's) comes after the exiting thread's
/// thread locals were destroyed, and touching one then panicked (rsync's client aborted at
/// exit, SIGABRT, and a fork child's last bytes were lost).
static FORK_HELD: spin::mutex::SpinMutex<Option<HeldForFork>, spin::relax::Yield> =
    spin::mutex::SpinMutex::new(None);

/// [`FORK_HELD`]'s guard.
struct HeldForFork(
    #[allow(dead_code)] spin::rwlock::RwLockWriteGuard<'static, Option<Map>, spin::relax::Yield>,
);

// SAFETY: the guard is taken and let go around one fork, by the forking thread (or in the
// child, by the copy of that thread); the static only carries it between the fork handlers,
// which run in that thread. Dropping it from another thread would only release a lock nobody
// else holds.
unsafe impl Send for HeldForFork {}

/// How many sockets' options [`lock_for_fork`] took, in the table's order.
static FORK_OPTS_TAKEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Every listener the process holds (to share them before fork).
pub(crate) fn listeners() -> Vec<(i32, Arc<Sock>)> {
    pick(|s| matches!(s, Sock::Listener(_)))
}

/// After fork(), in both processes: let the table go again, then take out every listener that
/// could not be shared (`AppListener::share`; the kernel TCP socket stays, served by kernel
/// TCP only from now on). Returns them to drop. After a fork that moved the process's sockets
/// to the child (`moving`: `daemon`), the listeners not shared moved with them: they stay.
pub(crate) fn unlock_after_fork(moving: bool) -> Vec<Arc<Sock>> {
    // The options `lock_for_fork` took: the table is still held, so its order is the same.
    let g = FORK_HELD.lock().take().map(|h| h.0);
    if let Some(m) = g.as_ref().and_then(|g| g.as_ref()) {
        let taken = FORK_OPTS_TAKEN.swap(0, Ordering::SeqCst);
        for o in fork_opts(m).into_iter().take(taken) {
            // SAFETY: taken by this thread in `lock_for_fork` (in a fork child: the copy of
            // that thread), its guard forgotten.
            unsafe { o.force_unlock() };
        }
    }
    drop(g);
    if moving {
        return Vec::new();
    }
    take_listeners(|_, s| !matches!(s, Sock::Listener(l) if l.is_shared()))
}

/// Take out the listeners that `pick` chooses (the kernel TCP socket stays, served by kernel
/// TCP only from now on). Returns them to drop.
pub(crate) fn take_listeners(pick: impl Fn(i32, &Sock) -> bool) -> Vec<Arc<Sock>> {
    let mut m = MAP.write();
    let Some(map) = m.as_mut() else {
        return Vec::new();
    };
    let fds: Vec<i32> = map
        .iter()
        .filter(|(fd, (s, _))| matches!(**s, Sock::Listener(_)) && pick(**fd, s))
        .map(|(fd, _)| *fd)
        .collect();
    let mut out = Vec::new();
    for fd in fds {
        OWNED[fd as usize].store(NOT_OWNED, Ordering::Relaxed);
        out.extend(map.remove(&fd).map(|(s, _)| s));
    }
    out
}
