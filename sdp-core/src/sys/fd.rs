//! File descriptors: our own fds kept out of the application's numbers, flags, eventfd,
//! timerfd, epoll and poll.

use std::io;
use std::mem::zeroed;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// How many of our fds may be at the application's numbers right now: made by the kernel at
/// the lowest free number and not yet moved above them ([`high_fd`]) or closed. While one is,
/// an application at its fd limit may find its last number taken for a moment
/// ([`app_slot`]).
static LOW_FDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Held from before a system call makes fds of SDP's until they are above the application's
/// numbers or closed: while any is held, [`app_slot`] and [`app_has_room`] wait for a number
/// below the application's limit that looks taken (it may be one of those fds).
/// It also opens the room (`Room`) above the application's limit, where those fds go.
#[must_use]
pub struct LowFds {
    _room: Room,
    /// Its slot in [`HOLDS`].
    slot: Option<usize>,
}

std::thread_local! {
    /// The holds this thread has: its own system calls (the library's, through the
    /// shim's hooks) never wait for them ([`app_number`]).
    static HOLDS_HERE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

impl LowFds {
    /// For the few system calls that make fds of ours and move them up ([`app_number`] waits
    /// for it).
    pub fn hold() -> LowFds {
        let room = Room::open();
        let gen = LOW_GEN.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        LOW_FDS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        HOLDS_HERE.with(|c| c.set(c.get() + 1));
        let slot = HOLDS.iter().position(|h| {
            h.compare_exchange(
                0,
                gen,
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
            )
            .is_ok()
        });
        LowFds { _room: room, slot }
    }
}

impl Drop for LowFds {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            HOLDS[i].store(0, std::sync::atomic::Ordering::SeqCst);
        }
        HOLDS_HERE.with(|c| c.set(c.get().saturating_sub(1)));
        LOW_FDS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// How many [`LowFds`] holds were ever taken: one that came and went during an
/// application's call shows here ([`app_number`]).
static LOW_GEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The holds under way, by their number in [`LOW_GEN`] (0: a free slot; a hold finding
/// none is not waited for).
static HOLDS: [std::sync::atomic::AtomicU64; 32] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 32];

/// Where [`LowFds`] stood before an application's call that makes an fd ([`app_number`]).
#[derive(Clone, Copy, Debug)]
pub struct LowMark(usize, u64);

impl LowMark {
    /// Taken right before the application's system call.
    pub fn now() -> LowMark {
        use std::sync::atomic::Ordering::SeqCst;
        LowMark(LOW_FDS.load(SeqCst), LOW_GEN.load(SeqCst))
    }
}

/// `fd`, which the kernel just made for the application (socket, accept) at the lowest free
/// number, where an fd of ours may have held a lower one for a moment ([`LowFds`] since
/// `mark`): the number it would have had without ours, once the holds under way when
/// it was made ended (waited for a bounded while), `fd` moved there (`cloexec`: its
/// FD_CLOEXEC). A number a thread of the application freed meanwhile is taken as well, as
/// its call could have over TCP. Without that, a connection's setup in the progress thread
/// made a socket or an accept get a number past the lowest free (corners `fd_numbers`, ~1
/// run in 10 under load).
pub fn app_number(fd: RawFd, mark: LowMark, cloexec: bool) -> RawFd {
    use std::sync::atomic::Ordering::SeqCst;
    if fd < 0
        || (mark.0 == 0 && LOW_FDS.load(SeqCst) == 0 && LOW_GEN.load(SeqCst) == mark.1)
        || HOLDS_HERE.with(|c| c.get()) != 0
    {
        return fd;
    }
    let made = LOW_GEN.load(SeqCst);
    let start = std::time::Instant::now();
    while HOLDS.iter().any(|h| (1..=made).contains(&h.load(SeqCst)))
        && start.elapsed() < APP_NUMBER_WAIT
    {
        std::thread::yield_now();
    }
    let d = dup_lowest(fd, cloexec);
    if d < 0 {
        return fd;
    }
    let (keep, spare) = if d < fd { (d, fd) } else { (fd, d) };
    // SAFETY: the caller's fd, replaced by its duplicate, or the duplicate not needed.
    unsafe { libc::close(spare) };
    keep
}

/// `f`, which opens a file for a moment (a /proc file, the report): under a hold, so it
/// finds room where the application's numbers are all taken and the application's own socket
/// or accept meanwhile waits for its number ([`app_number`]).
pub fn with_room<T>(f: impl FnOnce() -> T) -> T {
    let _low = LowFds::hold();
    f()
}

/// How long [`app_number`] waits for holds to end (each is a few system calls).
const APP_NUMBER_WAIT: Duration = Duration::from_millis(20);

/// An fd `make` creates (a system call's result), owned and moved out of the application's
/// numbers, counted in [`LOW_FDS`] meanwhile.
pub(crate) fn made(make: impl FnOnce() -> io::Result<RawFd>) -> io::Result<OwnedFd> {
    let _low = LowFds::hold();
    owned(make()?)
}

/// `fd`, a socket the application just made at or past its own fd limit (`app`), where over
/// TCP it would have had a lower number if our fds were not there: the number it would have
/// had, or `None` when the application's numbers are all its own (EMFILE, as over TCP).
/// `cloexec` is the socket's FD_CLOEXEC. `fd` is closed either way.
pub fn app_slot(fd: RawFd, app: u64, cloexec: bool) -> Option<RawFd> {
    let slot = dup_below(fd, app, cloexec);
    // SAFETY: the caller's fd, given to us to close (its duplicate, if any, replaces it).
    unsafe { libc::close(fd) };
    slot
}

/// Whether the application has a free number below its own fd limit `app` (`fd`: any open
/// fd, duplicated to look): accept's check, which over TCP fails with EMFILE at the limit
/// before it takes a connection from the queue.
pub fn app_has_room(fd: RawFd, app: u64) -> bool {
    match dup_below(fd, app, true) {
        Some(d) => {
            // SAFETY: the duplicate just made, nobody else's.
            unsafe { libc::close(d) };
            true
        }
        None => false,
    }
}

/// A duplicate of `fd` at the lowest free number if that is below `app` (close-on-exec if
/// `cloexec`). An fd of ours at one of those numbers only for a moment ([`LowFds`]) is
/// waited for (a bounded while).
fn dup_below(fd: RawFd, app: u64, cloexec: bool) -> Option<RawFd> {
    let start = std::time::Instant::now();
    for tries in 0u32.. {
        // Read before looking: an fd of ours made after it cannot hold a number that was free
        // when the application's socket was made (it got the lowest free one).
        let ours_low = LOW_FDS.load(std::sync::atomic::Ordering::SeqCst) != 0;
        let d = dup_lowest(fd, cloexec);
        if d >= 0 && (d as u64) < app {
            return Some(d);
        }
        if d >= 0 {
            // SAFETY: the duplicate just made, nobody else's.
            unsafe { libc::close(d) };
        }
        if !ours_low || start.elapsed() >= APP_SLOT_WAIT {
            break;
        }
        if tries < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    None
}

/// A duplicate of `fd` at the lowest free number (close-on-exec if `cloexec`); -1 if none.
fn dup_lowest(fd: RawFd, cloexec: bool) -> RawFd {
    let cmd = if cloexec {
        libc::F_DUPFD_CLOEXEC
    } else {
        libc::F_DUPFD
    };
    // SAFETY: duplicates the caller's fd at the lowest free number; no memory passed.
    unsafe { libc::fcntl(fd, cmd, 0) }
}

/// How long [`dup_below`] waits while fds of ours are at the application's numbers: each is
/// there for a few system calls, or a connection's setup (the shim's stream fd, made before it
/// takes the application's socket's number).
const APP_SLOT_WAIT: Duration = Duration::from_millis(200);

/// Own an fd a system call just created, moved out of the application's numbers ([`high_fd`]).
pub(crate) fn owned(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: `fd` was just returned by a successful system call that created it; nobody
    // else owns it. high_fd() returns it or its replacement, or closed it.
    high_fd(fd).map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Move an fd this library made for itself to a high number (close-on-exec), so the low numbers
/// stay the application's, as they would be without SDP: programs size tables by the fds they
/// get (wrk, select's FD_SETSIZE, redis' event loop of `maxclients` + 128) or expect the
/// lowest free one. The floor is the application's own limit where the shim made room above it
/// ([`set_app_fd_limit`]), else half the soft RLIMIT_NOFILE as it is now (a program may raise
/// it after its first socket); at most `HIGH_FD_MAX_FLOOR`.
///
/// Nothing free from the floor up: `fd` is closed and the error is EMFILE. Our fds never take
/// the application's numbers: what needed the fd fails instead (an SDP connection that cannot
/// be made falls back to kernel TCP, which needs one fd), where taking a low number would make
/// the application run out of fds before it would over TCP.
pub fn high_fd(fd: RawFd) -> io::Result<RawFd> {
    let floor = high_fd_floor();
    if fd < 0 || fd >= floor {
        note_ours(fd);
        return Ok(fd);
    }
    let moved = dup_at(fd, floor);
    // SAFETY: `fd` is ours: replaced by its duplicate, or given up.
    unsafe { libc::close(fd) };
    match moved {
        Ok(hi) => Ok(note_ours(hi.into_raw_fd())),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            // The floor is at or past the hard limit.
            Err(io::Error::from_raw_os_error(libc::EMFILE))
        }
        Err(e) => Err(e),
    }
}

/// Highest floor of [`high_fd`]: the kernel sizes a process's fd table by its highest fd, so a
/// soft limit of a million does not put our fds at half a million.
pub const HIGH_FD_MAX_FLOOR: i32 = 32768;

/// Where [`high_fd`] puts our fds: half the soft RLIMIT_NOFILE, at most [`HIGH_FD_MAX_FLOOR`].
/// (It once stopped at 1024: with a few hundred connections our fds filled the numbers above
/// it and the application's next sockets got numbers among them, past what redis' event loop
/// holds: its clients were accepted and never served.)
///
/// The limit is read again at most every `FLOOR_REFRESH_MS` (a connection's setup moves a
/// dozen fds: a getrlimit for each was ~2% of a short connection's cost).
pub fn high_fd_floor() -> RawFd {
    use std::sync::atomic::Ordering::Relaxed;
    const FLOOR_REFRESH_MS: u64 = 50;
    let app = APP_FD_LIMIT.load(Relaxed);
    if app != 0 {
        return app.min(HIGH_FD_MAX_FLOOR as u64) as RawFd;
    }
    let now = super::coarse_ms() & 0xffff_ffff;
    let c = FLOOR_CACHE.load(Relaxed);
    if c != 0 && now.wrapping_sub(c >> 32) & 0xffff_ffff < FLOOR_REFRESH_MS {
        return c as u32 as RawFd;
    }
    let Ok((soft, _)) = nofile_limit() else {
        return 0;
    };
    let floor = (soft / 2).min(HIGH_FD_MAX_FLOOR as u64) as i32;
    FLOOR_CACHE.store((now << 32) | floor as u32 as u64, Relaxed);
    floor
}

/// [`high_fd_floor`]'s last reading (low 32 bits) and when it was read (coarse ms, high 32
/// bits); 0: never.
static FLOOR_CACHE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The soft RLIMIT_NOFILE the application set (or started with) where [`make_fd_room`] keeps
/// room for our fds above it ([`Room`]); 0: no room (our fds go above half the limit).
static APP_FD_LIMIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How far past the application's limit our fds may go: an SDP connection holds up to three
/// fds of ours beside the application's one, plus a few per stack.
fn fd_room(app_soft: u64, hard: u64) -> u64 {
    app_soft.saturating_mul(4).saturating_add(256).min(hard)
}

/// Less room than this past the application's limit is not worth keeping apart: the limit
/// stays as the application set it and our fds go above half of it.
const MIN_FD_ROOM: u64 = 64;

/// RLIMIT_NOFILE (soft, hard) as the kernel has it (a system call: no library hook between).
pub fn nofile_limit() -> io::Result<(u64, u64)> {
    // SAFETY: an all-zero rlimit is valid.
    let mut r: libc::rlimit64 = unsafe { zeroed() };
    // SAFETY: prlimit64 on ourselves (pid 0) writes the old limit into `r`; no new limit.
    syscall!(syscall(
        libc::SYS_prlimit64,
        0,
        libc::RLIMIT_NOFILE,
        std::ptr::null::<libc::rlimit64>(),
        &mut r as *mut libc::rlimit64
    ))?;
    Ok((r.rlim_cur, r.rlim_max))
}

fn set_nofile_limit(soft: u64, hard: u64) -> io::Result<()> {
    let r = libc::rlimit64 {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: prlimit64 on ourselves (pid 0) reads the new limit from `r`.
    syscall!(syscall(
        libc::SYS_prlimit64,
        0,
        libc::RLIMIT_NOFILE,
        &r as *const libc::rlimit64,
        std::ptr::null_mut::<libc::rlimit64>()
    ))?;
    Ok(())
}

/// Make room for our fds above the application's fd numbers: set RLIMIT_NOFILE to (`soft`,
/// `hard`) as the application asks, but with the soft limit raised where the hard limit
/// allows, so that `high_fd` puts our fds at or above the application's `soft` and the
/// application can open as many fds as it could without SDP. Afterwards
/// [`app_fd_limit`] is what the application must be told (getrlimit); `None` when there was
/// no room (the limit is exactly as asked, and our fds go above half of it).
/// `soft > hard` and a hard limit above the allowed one fail as setrlimit(2) fails.
pub fn set_app_fd_limit(soft: u64, hard: u64) -> io::Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    let room = if soft <= hard {
        fd_room(soft, hard)
    } else {
        soft
    };
    let open = ROOMS.lock();
    if room >= soft.saturating_add(MIN_FD_ROOM) {
        // The application's limit, or the room's while one is open ([`Room`]).
        let now = if *open > 0 { room } else { soft };
        set_nofile_limit(now, hard)?;
        LAST_SOFT.store(now, Relaxed);
        HARD_FD_LIMIT.store(hard, Relaxed);
        APP_FD_LIMIT.store(soft.max(1), Relaxed);
    } else {
        set_nofile_limit(soft, hard)?;
        APP_FD_LIMIT.store(0, Relaxed);
    }
    FLOOR_CACHE.store(0, Relaxed);
    Ok(())
}

/// The room above the application's fd limit, open: while any `Room` lives (in any thread),
/// the kernel's soft RLIMIT_NOFILE is the room's ([`fd_room`]), so our fds can be made and
/// moved there; when the last goes, it is the application's own again. So the application's
/// own calls (open, pipe, dup, epoll_create: the shim does not see them) fail with EMFILE at
/// its limit as without SDP, and never get a number past it (a select() loop would overflow
/// its fd_set past 1023), except while our fds are being made or moved. (The limit used to
/// stay raised for good: a program at a soft limit of 1024 opened files up to the hard one.)
#[must_use]
pub struct Room(bool);

/// How many [`Room`]s are open in the process.
static ROOMS: super::ForkMutex<u32> = super::ForkMutex::new(0);

std::thread_local! {
    /// How many of [`ROOMS`] this thread holds (a fork child keeps only the forking thread's).
    static ROOMS_HERE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// The hard RLIMIT_NOFILE as last set where [`APP_FD_LIMIT`] is kept.
static HARD_FD_LIMIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Room {
    /// Open the room (a no-op where the application's limit is not kept apart).
    pub fn open() -> Room {
        use std::sync::atomic::Ordering::Relaxed;
        if APP_FD_LIMIT.load(Relaxed) == 0 {
            return Room(false);
        }
        ROOMS_HERE.with(|c| c.set(c.get() + 1));
        let mut n = ROOMS.lock();
        *n += 1;
        if *n == 1 {
            apply_room(true);
        }
        Room(true)
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        ROOMS_HERE.with(|c| c.set(c.get().saturating_sub(1)));
        let mut n = ROOMS.lock();
        *n = n.saturating_sub(1);
        if *n == 0 {
            apply_room(false);
        }
    }
}

/// Set the kernel's soft limit to the room's (`open`) or the application's (callers hold
/// [`ROOMS`]).
fn apply_room(open: bool) {
    use std::sync::atomic::Ordering::Relaxed;
    if APP_FD_LIMIT.load(Relaxed) == 0 {
        return;
    }
    if open {
        // A limit the application set by a system call of its own (Go's runtime raises its
        // soft limit to the hard one so, at its start) is its limit from now on.
        match nofile_limit() {
            Ok((soft, hard)) if soft != LAST_SOFT.load(Relaxed) => {
                if fd_room(soft, hard) < soft.saturating_add(MIN_FD_ROOM) {
                    APP_FD_LIMIT.store(0, Relaxed);
                    FLOOR_CACHE.store(0, Relaxed);
                    return;
                }
                APP_FD_LIMIT.store(soft.max(1), Relaxed);
                HARD_FD_LIMIT.store(hard, Relaxed);
                FLOOR_CACHE.store(0, Relaxed);
            }
            _ => {}
        }
    }
    let app = APP_FD_LIMIT.load(Relaxed);
    let hard = HARD_FD_LIMIT.load(Relaxed);
    let soft = if open { fd_room(app, hard) } else { app };
    if set_nofile_limit(soft, hard).is_ok() {
        LAST_SOFT.store(soft, Relaxed);
    }
}

/// The soft limit [`apply_room`] or [`set_app_fd_limit`] last gave the kernel.
static LAST_SOFT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// In a fork child: only the forking thread's rooms are open (the others' threads are not
/// here), and the limit follows.
pub(super) fn rooms_fork_child() {
    // SAFETY: a thread the child does not have may have held it at the fork; the child is
    // this thread alone.
    unsafe { ROOMS.force_unlock() };
    let here = ROOMS_HERE.with(|c| c.get());
    let mut n = ROOMS.lock();
    *n = here;
    apply_room(here > 0);
}

/// [`set_app_fd_limit`] with the limit as it is now (at the start: the application's).
pub fn make_fd_room() -> io::Result<()> {
    if APP_FD_LIMIT.load(std::sync::atomic::Ordering::Relaxed) != 0 {
        return Ok(());
    }
    let (soft, hard) = nofile_limit()?;
    set_app_fd_limit(soft, hard)
}

/// The application's own soft RLIMIT_NOFILE where [`make_fd_room`] raised the process's.
pub fn app_fd_limit() -> Option<u64> {
    match APP_FD_LIMIT.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        n => Some(n),
    }
}

/// Before an exec (or a spawn) whose program must see the application's own limit: put the
/// soft limit back to it (`true`: it was raised, call [`fd_room_after_exec`] if the exec
/// returned).
pub fn fd_limit_for_exec() -> bool {
    if app_fd_limit().is_none() {
        return false;
    }
    // (It is the application's already unless another thread has the room open.)
    let _n = ROOMS.lock();
    apply_room(false);
    true
}

/// After [`fd_limit_for_exec`], when the exec failed or the spawn is done: the room again if
/// another thread has it open.
pub fn fd_room_after_exec() {
    let n = ROOMS.lock();
    apply_room(*n > 0);
}

/// Whether `k` more fds of ours fit: the `k` numbers below the soft limit are free. Ours are
/// taken lowest first from [`high_fd_floor`], so the numbers above the highest one taken are
/// all free: a duplicate asked for at 2`k` below the limit lands less than `k` above that
/// while the line is lower (the slack is for other threads looking at the same time). `fd` is
/// any fd of ours (duplicated once to look, and closed again).
///
/// Far from the limit (the lowest free number from the floor up more than [`SPARE_NEAR`] below
/// it) that is all: a duplicate near the limit grows the process's fd table to the limit (the
/// kernel sizes it by the highest fd), which in a process with threads waits for an RCU grace
/// period (4-5 ms here: a prefork worker's first SDP client waited that long) and at a limit of
/// a million takes 8 MiB of kernel memory.
pub fn fds_to_spare(fd: BorrowedFd<'_>, k: u32) -> bool {
    let _room = Room::open();
    let Ok((soft, _)) = nofile_limit() else {
        return true;
    };
    let floor = high_fd_floor();
    match dup_at(fd.as_raw_fd(), floor) {
        Ok(d) if (d.as_raw_fd() as u64).saturating_add(SPARE_NEAR + 2 * k as u64) < soft => {
            return true
        }
        Ok(_) => {}
        Err(_) => return false,
    }
    let Some(at) = soft
        .checked_sub(2 * k as u64)
        .filter(|&at| at >= high_fd_floor() as u64 && at <= i32::MAX as u64)
    else {
        return false;
    };
    dup_at(fd.as_raw_fd(), at as RawFd).is_ok_and(|d| (d.as_raw_fd() as u64) < at + k as u64)
}

/// How far below the fd limit [`fds_to_spare`] looks at the limit itself.
const SPARE_NEAR: u64 = 256;

/// A close-on-exec duplicate of `fd`, at a high number ([`high_fd`]).
pub fn dup_high(fd: RawFd) -> io::Result<OwnedFd> {
    dup_at(fd, high_fd_floor()).inspect(|d| {
        note_ours(d.as_raw_fd());
    })
}

/// The lowest number [`high_fd`] ever gave one of our fds (`i32::MAX`: none yet).
static LOWEST_OURS: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(i32::MAX);

fn note_ours(fd: RawFd) -> RawFd {
    use std::sync::atomic::Ordering::Relaxed;
    if fd >= 0 {
        LOWEST_OURS.fetch_min(fd, Relaxed);
        if (fd as usize) < OURS_MAX {
            OURS[fd as usize].store(true, Relaxed);
            HIGHEST_OURS.fetch_max(fd, Relaxed);
        }
    }
    fd
}

/// The fds [`high_fd`] placed, by number (below `OURS_MAX`), until they close (the LD_PRELOAD
/// shim's `close` tells: [`closing`]): a `close_range` or `closefrom` of the application's
/// over its whole range (a daemon's `closefrom(3)`) leaves them ([`ours_in`]), where it closed
/// the runtime's own fds (a listener's SDP rendezvous among them: later clients came by
/// kernel TCP).
const OURS_MAX: usize = 1 << 16;
static OURS: [std::sync::atomic::AtomicBool; OURS_MAX] =
    [const { std::sync::atomic::AtomicBool::new(false) }; OURS_MAX];
/// The highest number [`note_ours`] ever noted (-1: none).
static HIGHEST_OURS: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// `fd` is being closed (the shim's `close` hook, for every fd: one load unless it is ours).
#[inline]
pub fn closing(fd: RawFd) {
    use std::sync::atomic::Ordering::Relaxed;
    if (fd as u32 as usize) < OURS_MAX && OURS[fd as usize].load(Relaxed) {
        OURS[fd as usize].store(false, Relaxed);
    }
}

/// Our fds (those `high_fd` placed, still open) from `first` to `last`, ascending.
pub fn ours_in(first: RawFd, last: RawFd) -> Vec<RawFd> {
    use std::sync::atomic::Ordering::Relaxed;
    let from = first
        .max(LOWEST_OURS.load(Relaxed).min(OURS_MAX as RawFd))
        .max(0);
    let to = last.min(HIGHEST_OURS.load(Relaxed));
    (from..=to)
        .filter(|&fd| OURS[fd as usize].load(Relaxed))
        .collect()
}

/// Fds of ours a fork child needs until it execs (the request channel's sending end, through
/// which its exec shares the streams the new program keeps: `runtime::share`). A child that
/// closes every fd from some number up before it execs (Python's `subprocess`:
/// `close_range(8, ~0)`) must leave these: the shim's `close_range` skips them ([`kept_fds`]).
/// Atomics only: read in fork children, whatever another thread of the parent held.
static KEPT: [std::sync::atomic::AtomicI32; 4] =
    [const { std::sync::atomic::AtomicI32::new(-1) }; 4];

/// Keep `fd` from a fork child's `close_range` (see [`KEPT`]); false if there is no room.
pub(crate) fn keep_for_children(fd: RawFd) -> bool {
    KEPT.iter().any(|k| {
        k.compare_exchange(
            -1,
            fd,
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
        )
        .is_ok()
    })
}

/// The fds `keep_for_children` kept, ascending.
pub fn kept_fds() -> Vec<RawFd> {
    let mut v: Vec<RawFd> = KEPT
        .iter()
        .map(|k| k.load(std::sync::atomic::Ordering::SeqCst))
        .filter(|&fd| fd >= 0)
        .collect();
    v.sort_unstable();
    v
}

/// Every fd below this number is the application's (ours are at or above it, as
/// `high_fd` placed them; the application's own may be above it too).
pub fn app_fds_end() -> RawFd {
    high_fd_floor().min(LOWEST_OURS.load(std::sync::atomic::Ordering::Relaxed))
}

/// A close-on-exec duplicate of `fd` at the lowest free number from `floor` up.
fn dup_at(fd: RawFd, floor: RawFd) -> io::Result<OwnedFd> {
    let _room = Room::open();
    // SAFETY: duplicates an fd the caller holds; no memory is passed.
    let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, floor) };
    if d < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(d) })
}

/// [`high_fd`] for an owned fd.
pub(crate) fn high_owned(fd: OwnedFd) -> io::Result<OwnedFd> {
    owned(fd.into_raw_fd())
}

/// Set or clear O_NONBLOCK and FD_CLOEXEC on an fd.
pub(crate) fn set_fd_flags(fd: RawFd, nonblocking: bool, cloexec: bool) -> io::Result<()> {
    // SAFETY: fcntl on an fd the caller owns, with integer arguments only.
    let fl = syscall!(fcntl(fd, libc::F_GETFL))?;
    let want = if nonblocking {
        fl | libc::O_NONBLOCK
    } else {
        fl & !libc::O_NONBLOCK
    };
    if want != fl {
        // SAFETY: as above.
        syscall!(fcntl(fd, libc::F_SETFL, want))?;
    }
    // SAFETY: as above.
    syscall!(fcntl(
        fd,
        libc::F_SETFD,
        if cloexec { libc::FD_CLOEXEC } else { 0 }
    ))?;
    Ok(())
}

pub fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    let fl = syscall!(fcntl(fd.as_raw_fd(), libc::F_GETFL))?;
    syscall!(fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK))?;
    Ok(())
}

pub fn eventfd() -> io::Result<OwnedFd> {
    made(|| syscall!(eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)))
}

/// Add 1 to an eventfd's counter (never blocks: a full counter is already readable).
pub(crate) fn eventfd_signal(fd: impl AsFd) {
    eventfd_signal_raw(fd.as_fd().as_raw_fd());
}

/// Add 1 to the counter of an eventfd known by number only (it must stay open meanwhile).
pub(crate) fn eventfd_signal_raw(fd: RawFd) {
    let v: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64; an error (counter full) is harmless.
    let _ = syscall!(write(fd, (&v as *const u64).cast(), 8));
}

/// Read (reset) an eventfd or timerfd counter; nonblocking (EAGAIN, counter zero, is
/// harmless).
pub(crate) fn eventfd_drain(fd: impl AsFd) {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64.
    let _ = syscall!(read(fd.as_fd().as_raw_fd(), (&mut v as *mut u64).cast(), 8));
}

pub fn timerfd() -> io::Result<OwnedFd> {
    made(|| {
        syscall!(timerfd_create(
            libc::CLOCK_MONOTONIC,
            libc::TFD_NONBLOCK | libc::TFD_CLOEXEC
        ))
    })
}

/// Fire once after `ns` nanoseconds (0 disarms).
pub fn timerfd_set(fd: BorrowedFd<'_>, ns: u64) {
    let spec = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: (ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (ns % 1_000_000_000) as libc::c_long,
        },
    };
    // SAFETY: `spec` is a live itimerspec; the old value is not wanted.
    let _ = syscall!(timerfd_settime(
        fd.as_raw_fd(),
        0,
        &spec,
        std::ptr::null_mut()
    ));
}

pub fn epoll_create() -> io::Result<OwnedFd> {
    made(|| syscall!(epoll_create1(libc::EPOLL_CLOEXEC)))
}

/// Register `fd` with `token`; `edge`: edge-triggered.
pub fn epoll_add(ep: BorrowedFd<'_>, fd: RawFd, token: u64, edge: bool) -> io::Result<()> {
    let mut events = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
    if edge {
        events |= libc::EPOLLET as u32;
    }
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: `ev` is a live epoll_event.
    syscall!(epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev))?;
    Ok(())
}

/// Watch `fd` in the set for a hang-up or an error only (reported once: EPOLLONESHOT).
pub fn epoll_add_hangup(ep: BorrowedFd<'_>, fd: RawFd, token: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLONESHOT as u32,
        u64: token,
    };
    // SAFETY: `ev` is a live epoll_event.
    syscall!(epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev))?;
    Ok(())
}

/// Remove `fd` from the set.
pub fn epoll_del(ep: BorrowedFd<'_>, fd: RawFd) {
    let mut ev = libc::epoll_event { events: 0, u64: 0 };
    // SAFETY: `ev` is a live epoll_event (ignored by DEL).
    let _ = syscall!(epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut ev));
}

/// Take every ready event without waiting; calls `f(token)` for each.
pub fn epoll_drain(ep: BorrowedFd<'_>, mut f: impl FnMut(u64)) {
    // SAFETY: epoll_event is plain data.
    let mut evs: [libc::epoll_event; 64] = unsafe { zeroed() };
    loop {
        // SAFETY: `evs` is a live array of 64 events.
        let n = match syscall!(epoll_wait(ep.as_raw_fd(), evs.as_mut_ptr(), 64, 0)) {
            Ok(n) => n as usize,
            Err(_) => return,
        };
        for ev in &evs[..n] {
            let token = ev.u64;
            f(token);
        }
        if n < 64 {
            return;
        }
    }
}

/// A close-on-exec epoll fd watching `fds` for POLLIN (level-triggered): it polls readable
/// while any of them does.
pub(crate) fn epoll_of(fds: &[RawFd]) -> io::Result<OwnedFd> {
    let ep = epoll_create_plain()?;
    for &fd in fds {
        epoll_add_in(ep.as_fd(), fd)?;
    }
    Ok(ep)
}

/// A close-on-exec epoll fd, left at the number the kernel gave.
pub(crate) fn epoll_create_plain() -> io::Result<OwnedFd> {
    let ep = syscall!(epoll_create1(libc::EPOLL_CLOEXEC))?;
    // SAFETY: the fd was just returned by epoll_create1 and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(ep) })
}

/// Watch `fd` for POLLIN (level-triggered), with the fd number as the token.
pub(crate) fn epoll_add_in(ep: BorrowedFd<'_>, fd: RawFd) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: fd as u64,
    };
    // SAFETY: `ev` is a live epoll_event; `fd` is an open fd owned by the caller.
    syscall!(epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev))?;
    Ok(())
}

/// Wait until one of `fds` polls for `events` or the timeout passes (`None`: forever).
/// Returns the revents of each fd.
pub(crate) fn poll(fds: &[(RawFd, i16)], timeout: Option<Duration>) -> io::Result<Vec<i16>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&(fd, events)| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    let ms = match timeout {
        None => -1,
        // Round up so a short timeout does not become a busy loop.
        Some(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
    };
    // SAFETY: `pfds` is a live array of `pfds.len()` pollfd structs.
    match syscall!(poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms)) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
        Err(e) => return Err(e),
    }
    Ok(pfds.iter().map(|p| p.revents).collect())
}

/// Wait until `a` or `b` is readable or `timeout` passes (no allocation: a hot path); whether
/// each polled (both false when a signal cut the wait short).
pub(crate) fn poll_two(a: RawFd, b: RawFd, timeout: Duration) -> io::Result<(bool, bool)> {
    let mut pfds = [
        libc::pollfd {
            fd: a,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: b,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: `pfds` is a live array of two pollfd structs.
    match syscall!(poll(pfds.as_mut_ptr(), 2, ms)) {
        Ok(_) => Ok((pfds[0].revents != 0, pfds[1].revents != 0)),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok((false, false)),
        Err(e) => Err(e),
    }
}

/// One fd's poll events now (no waiting).
pub(crate) fn poll_now(fd: RawFd, events: i16) -> io::Result<i16> {
    Ok(poll(&[(fd, events)], Some(Duration::ZERO))?[0])
}

/// Wait on an epoll fd (for tests and simple progress loops); returns whether it fired.
pub fn poll_readable(fd: RawFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is one live pollfd.
    matches!(syscall!(poll(&mut p, 1, timeout_ms)), Ok(n) if n > 0)
}

/// fds a fork child must close at once ([`close_in_fork_child`]), with their files' identities.
/// A spin lock ([`super::ForkMutex`]): held across fork, it must come out unlocked in the child
/// even when another thread of the parent was waiting for it.
static FORK_CLOSES: super::ForkMutex<Vec<(RawFd, (u64, u64))>> = super::ForkMutex::new(Vec::new());
/// [`FORK_CLOSES`]' length at which stale entries (fds closed since) are taken out next.
static FORK_CLOSES_PRUNE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(64);

/// Note an fd of ours that a fork child must not keep: one whose copy would keep a connection
/// of this process going after the process is gone, where its peer must see it go (shm's
/// connection sockets and the peers' direct-wakeup sockets, the application fds' readiness
/// pairs, the runtime's request channel). A child runs no runtime of its parent's, so it
/// closes them at once (an atfork handler registered at load), each only if the number still
/// names that file: a fork child that held them kept its parent's connections alive after the
/// parent died (`daemon()` after connecting: its own reads then waited for ever).
pub(crate) fn close_in_fork_child(fd: BorrowedFd<'_>) {
    use std::sync::atomic::Ordering::Relaxed;
    let Ok(id) = super::file_identity(fd) else {
        return;
    };
    let mut g = FORK_CLOSES.lock();
    if g.len() >= FORK_CLOSES_PRUNE.load(Relaxed) {
        g.retain(|&(f, id)| {
            // SAFETY: only looked at (fstat), never used.
            super::file_identity(unsafe { BorrowedFd::borrow_raw(f) }).ok() == Some(id)
        });
        FORK_CLOSES_PRUNE.store(2 * g.len() + 64, Relaxed);
    }
    g.push((fd.as_raw_fd(), id));
}

/// The mover's pid when the next fork's child goes on with this process's connections (they
/// move to it: see `Endpoint::pause_peer`), else 0: that child keeps the fds
/// [`close_in_fork_child`] noted, and reads the pid here (its parent may be gone by then).
/// Set just before that fork by the thread that makes it ([`next_fork_moves`]); the fork
/// handlers clear it.
static NEXT_FORK_MOVES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The next fork of this thread's is a move: its child keeps our fds (see [`NEXT_FORK_MOVES`]).
pub(crate) fn next_fork_moves() {
    NEXT_FORK_MOVES.store(super::getpid(), std::sync::atomic::Ordering::SeqCst);
}

/// The processes whose SDP state this one took over by a move ([`next_fork_moves`]): a fork
/// child that goes on with its parent's connections is that parent for them (objects that
/// note the process they were made in compare with [`is_this_process`]). Cleared in the child
/// of any other fork. Atomics, not a lock: a fork child must find them as they were, whatever
/// another thread of the parent did at the fork; the oldest is forgotten past
/// `MOVED_FROM_MAX` moves in a row.
static MOVED_FROM: [std::sync::atomic::AtomicU32; MOVED_FROM_MAX] =
    [const { std::sync::atomic::AtomicU32::new(0) }; MOVED_FROM_MAX];
const MOVED_FROM_MAX: usize = 8;

/// Whether `pid` names this process: its own pid, or one whose SDP state it took over by a
/// move (see [`MOVED_FROM`]).
pub(crate) fn is_this_process(pid: u32) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    pid == super::getpid() || (pid != 0 && MOVED_FROM.iter().any(|p| p.load(Relaxed) == pid))
}

/// In a fork child (single-threaded): `parent` is this process from now on (`Some`), or no
/// other process is (`None`).
fn note_moved_from(parent: Option<u32>) {
    use std::sync::atomic::Ordering::Relaxed;
    match parent {
        Some(p) => {
            for i in (1..MOVED_FROM_MAX).rev() {
                MOVED_FROM[i].store(MOVED_FROM[i - 1].load(Relaxed), Relaxed);
            }
            MOVED_FROM[0].store(p, Relaxed);
        }
        None => MOVED_FROM.iter().for_each(|p| p.store(0, Relaxed)),
    }
}

/// After the fork [`next_fork_moves`] was for (the handlers cleared it; also when the fork
/// failed).
pub(crate) fn next_fork_moved() {
    NEXT_FORK_MOVES.store(0, std::sync::atomic::Ordering::SeqCst);
}

/// Held across fork, so the child's copy of the list is whole.
pub(super) extern "C" fn fork_closes_prepare() {
    std::mem::forget(FORK_CLOSES.lock());
}

pub(super) extern "C" fn fork_closes_parent() {
    NEXT_FORK_MOVES.store(0, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: this thread locked it in `fork_closes_prepare` and forgot the guard.
    unsafe { FORK_CLOSES.force_unlock() };
}

pub(super) extern "C" fn fork_closes_child() {
    // SAFETY: as in the parent: the child is the forking thread's copy.
    unsafe { FORK_CLOSES.force_unlock() };
    rooms_fork_child();
    let mover = NEXT_FORK_MOVES.swap(0, std::sync::atomic::Ordering::SeqCst);
    if mover != 0 {
        // The connections go on here: their fds stay, and so does the list (for this
        // process's own forks). The parent is this process for them from now on.
        note_moved_from(Some(mover));
        return;
    }
    note_moved_from(None);
    let list = std::mem::take(&mut *FORK_CLOSES.lock());
    for (fd, id) in list {
        // SAFETY: only looked at (fstat) first.
        if super::file_identity(unsafe { BorrowedFd::borrow_raw(fd) }).ok() == Some(id) {
            // SAFETY: the parent's fd, which nothing in this process uses: the objects that
            // own it are the parent runtime's, dead here and never dropped.
            unsafe { libc::close(fd) };
        }
    }
}

/// Whether `fd` reports a hang-up (or an error) right now.
pub fn hung_up(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    };
    // SAFETY: `p` is one live pollfd.
    matches!(syscall!(poll(&mut p, 1, 0)), Ok(n) if n > 0)
        && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

/// Whether `fd` is close-on-exec (for tests).
#[cfg(test)]
pub(crate) fn is_cloexec(fd: RawFd) -> io::Result<bool> {
    // SAFETY: fcntl on an fd the caller owns, with integer arguments only.
    let flags = syscall!(fcntl(fd, libc::F_GETFD))?;
    Ok(flags & libc::FD_CLOEXEC != 0)
}
