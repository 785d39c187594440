//! Processes: our pid and uid, fork and exit handlers, the clock, and copies to and from a
//! peer process (`process_vm_readv`/`writev`, guarded by a pidfd).

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::AtomicU64;

use super::{hung_up, made, owned, LowFds};

static PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

extern "C" fn forget_pid() {
    PID.store(0, std::sync::atomic::Ordering::Relaxed);
}

extern "C" fn register_forget_pid() {
    atfork(None, None, Some(forget_pid));
    // After `forget_pid` in the child; its prepare runs after every other (reverse order).
    atfork(
        Some(super::fd::fork_closes_prepare),
        Some(super::fd::fork_closes_parent),
        Some(super::fd::fork_closes_child),
    );
}

/// The child's pid must be known before any other atfork child handler runs: those run in the
/// order they were registered, and one may drop sockets the child inherited (the shim's does),
/// which must find the parent's stacks dead (see `Runtime::lock`) rather than wait on a lock
/// another thread of the parent held at the fork. So the handler is registered when the
/// library is loaded, before any code can register its own.
#[used]
#[link_section = ".init_array"]
static REGISTER_FORGET_PID: extern "C" fn() = register_forget_pid;

/// Process id. glibc does not cache it, and a system call on every lock of a runtime adds up:
/// it is cached here and forgotten in a fork child (pthread_atfork, registered at load), so a
/// child sees its own. (A child made by a raw fork system call runs no atfork handler and
/// would see the parent's.)
pub(crate) fn getpid() -> u32 {
    let p = PID.load(std::sync::atomic::Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    // SAFETY: getpid cannot fail.
    let p = unsafe { libc::getpid() as u32 };
    PID.store(p, std::sync::atomic::Ordering::Relaxed);
    p
}

/// The process id from the kernel on every call (see [`getpid`] for the cached one).
pub fn getpid_now() -> i32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

pub fn getuid() -> u32 {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() }
}

type ForkHandler = Option<extern "C" fn()>;

/// Every set of fork handlers registered by [`atfork`], in order, for forks made without
/// glibc's `fork` ([`run_fork_handlers`]).
static FORK_HANDLERS: [std::sync::OnceLock<[ForkHandler; 3]>; 16] =
    [const { std::sync::OnceLock::new() }; 16];
static FORK_HANDLER_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Which of a fork's handlers to run ([`run_fork_handlers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForkStage {
    Prepare,
    Parent,
    Child,
}

/// Run the fork handlers registered by this library ([`atfork`]) for a process made by a raw
/// `clone` or `fork` system call, which runs none (vsftpd starts its per-connection children
/// so): `Prepare` before it, in reverse order of registration, `Parent` or `Child` after it, in
/// order, as glibc's `fork` runs them. Allocates nothing and takes no lock.
pub fn run_fork_handlers(stage: ForkStage) {
    use std::sync::atomic::Ordering::Acquire;
    let n = FORK_HANDLER_COUNT.load(Acquire).min(FORK_HANDLERS.len());
    let at = |i: usize| {
        let h = FORK_HANDLERS[i].get().copied().unwrap_or([None; 3]);
        let f = match stage {
            ForkStage::Prepare => h[0],
            ForkStage::Parent => h[1],
            ForkStage::Child => h[2],
        };
        if let Some(f) = f {
            f();
        }
    };
    match stage {
        ForkStage::Prepare => (0..n).rev().for_each(at),
        _ => (0..n).for_each(at),
    }
}

/// Register fork handlers (`pthread_atfork(3)`): `prepare` runs in the forking thread before
/// the fork, `parent` and `child` after it in each process. Also kept for
/// [`run_fork_handlers`] (the first 16 sets).
pub fn atfork(
    prepare: Option<extern "C" fn()>,
    parent: Option<extern "C" fn()>,
    child: Option<extern "C" fn()>,
) {
    let i = FORK_HANDLER_COUNT.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    if let Some(slot) = FORK_HANDLERS.get(i) {
        let _ = slot.set([prepare, parent, child]);
    }
    // SAFETY: the handlers are safe functions that live as long as the program; being
    // `extern "C"`, one that panics aborts instead of unwinding into libc.
    unsafe {
        libc::pthread_atfork(
            prepare.map(|f| f as unsafe extern "C" fn()),
            parent.map(|f| f as unsafe extern "C" fn()),
            child.map(|f| f as unsafe extern "C" fn()),
        )
    };
}

/// Register `f` to run at process exit (`atexit(3)`): `exit()`, `std::process::exit` and
/// returning from `main` run it; `_exit` and fatal signals do not.
pub(crate) fn atexit(f: extern "C" fn()) {
    // SAFETY: `f` is a plain function that lives as long as the program and never unwinds.
    unsafe { libc::atexit(f) };
}

/// The calling thread's involuntary context switches and CPU time (user + system), and when
/// they were read: a poll compares two of these to tell whether it was preempted, and how much
/// of its time the preemption took.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ThreadSched {
    pub(crate) ivcsw: u64,
    pub(crate) cpu: std::time::Duration,
    pub(crate) at: std::time::Instant,
}

impl ThreadSched {
    pub(crate) fn now() -> Option<ThreadSched> {
        // SAFETY: getrusage fills the zeroed struct it is given.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `ru` is a live rusage struct.
        syscall!(getrusage(libc::RUSAGE_THREAD, &mut ru)).ok()?;
        let tv = |t: libc::timeval| {
            std::time::Duration::from_secs(t.tv_sec.max(0) as u64)
                + std::time::Duration::from_micros(t.tv_usec.max(0) as u64)
        };
        Some(ThreadSched {
            ivcsw: ru.ru_nivcsw as u64,
            cpu: tv(ru.ru_utime) + tv(ru.ru_stime),
            at: std::time::Instant::now(),
        })
    }

    /// Since `before`: whether the thread was preempted, and the wall time it did not run.
    pub(crate) fn since(&self, before: &ThreadSched) -> (bool, std::time::Duration) {
        let wall = self.at.saturating_duration_since(before.at);
        let cpu = self.cpu.saturating_sub(before.cpu);
        (self.ivcsw > before.ivcsw, wall.saturating_sub(cpu))
    }
}

/// Milliseconds of CLOCK_MONOTONIC_COARSE (a few ms of resolution; cheaper to read than the
/// precise clock, which matters where every connection asks it in every progress round).
pub fn coarse_ms() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a live timespec; CLOCK_MONOTONIC_COARSE always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) };
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

/// `SO_PEERPIDFD` (Linux 6.5; the same number on every architecture but sparc, mips, parisc
/// and alpha, which libc 0.2 does not export for them all).
const SO_PEERPIDFD: libc::c_int = 77;

/// The peer process of a connection, by pidfd: every copy to or from it goes through here, so
/// a copy can only reach the very process that connected, never one that got its pid after it
/// died (`process_vm_*` take a pid, not a pidfd: see [`Proc::write`] for the window left).
pub struct Proc {
    pid: i32,
    pidfd: OwnedFd,
    /// When `alive` last saw the process running (ns since `epoch()`; 0: never).
    seen: AtomicU64,
}

/// How long a liveness check is trusted: copies within this of the last check skip the
/// system call (one `poll` costs ~0.3-1 us, a 64 KiB copy ~5 us). A dead peer's pid would
/// have to be reaped and handed out again (the allocator wraps around `pid_max` first) within
/// this time to be written.
pub const LIVENESS_TRUST: std::time::Duration = std::time::Duration::from_millis(1);

fn epoch() -> std::time::Instant {
    static E: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *E.get_or_init(std::time::Instant::now)
}

impl Proc {
    /// The process at the other end of the connected Unix socket `sock`, whose `SO_PEERCRED`
    /// pid is `pid`: `SO_PEERPIDFD` (the kernel's own reference, taken at connect/listen), or
    /// on kernels before 6.5 `pidfd_open(pid)` followed by a check that the peer still holds
    /// its end of the socket (a process that got the pid after the peer died cannot hold it,
    /// unless the peer passed it on before dying: the window of the fallback).
    pub fn of_peer(sock: BorrowedFd<'_>, pid: i32) -> io::Result<Proc> {
        let mut fd: libc::c_int = -1;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        let low = LowFds::hold();
        // SAFETY: `fd` is a live c_int of `len` bytes.
        let r = syscall!(getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len
        ));
        if r.is_ok() && fd >= 0 {
            return Ok(Proc {
                pid,
                pidfd: owned(fd)?,
                seen: AtomicU64::new(0),
            });
        }
        drop(low);
        let p = Proc::open(pid)?;
        if hung_up(sock.as_raw_fd()) || !p.alive() {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(p)
    }

    /// `pidfd_open(pid)`: the process that has `pid` now.
    pub fn open(pid: i32) -> io::Result<Proc> {
        let pidfd = made(|| {
            // SAFETY: pidfd_open takes a pid and flags; no memory is passed.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(fd as RawFd)
        })?;
        Ok(Proc {
            pid,
            pidfd,
            seen: AtomicU64::new(0),
        })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// [`Proc::alive`], trusting a check younger than [`LIVENESS_TRUST`] (for the copies).
    pub fn alive_recently(&self) -> bool {
        let now = epoch().elapsed().as_nanos() as u64 + 1;
        let seen = self.seen.load(std::sync::atomic::Ordering::Relaxed);
        if seen != 0 && now.saturating_sub(seen) < LIVENESS_TRUST.as_nanos() as u64 {
            return true;
        }
        let alive = self.alive();
        if alive {
            self.seen.store(now, std::sync::atomic::Ordering::Relaxed);
        }
        alive
    }

    /// Whether the process is still running: a pidfd polls readable once it has exited (every
    /// thread past `exit_notify`, so none of its system calls, copies included, is still
    /// running), and its pid cannot have been given to another process before that.
    pub fn alive(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `p` is one live pollfd.
        !matches!(syscall!(poll(&mut p, 1, 0)), Ok(n) if n > 0)
    }

    /// Whether the process is stopped (SIGSTOP, a tracer: `T` or `t` in `/proc/PID/stat`):
    /// its threads answer nothing until it is continued.
    pub fn stopped(&self) -> bool {
        let path = format!("/proc/{}/stat", self.pid);
        let Ok(st) = super::with_room(|| std::fs::read_to_string(path)) else {
            return false;
        };
        // The state follows the command's name, which ends at the last ')'.
        st.rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|c| c == 'T' || c == 't')
    }

    /// Wait up to `limit` for the process to exit; whether it did.
    pub fn exits_within(&self, limit: std::time::Duration) -> bool {
        let mut p = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = limit.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `p` is one live pollfd.
        matches!(syscall!(poll(&mut p, 1, ms)), Ok(n) if n > 0)
    }

    fn gone() -> io::Error {
        io::Error::from_raw_os_error(libc::ESRCH)
    }

    /// `Ok` if the process is alive (checked within [`LIVENESS_TRUST`]), else `ESRCH`.
    pub fn check(&self) -> io::Result<()> {
        if self.alive_recently() {
            Ok(())
        } else {
            Err(Proc::gone())
        }
    }

    /// One copy of a batch the caller brackets with [`Proc::check`]: before the first (and,
    /// for reads, after the last) copy; `write`: ours into the process's, else the other way.
    /// `end`: see [`CopyEnd`]; `Ok(true)` if it was written.
    ///
    /// # Safety
    /// As [`vm_copy`].
    pub unsafe fn copy_in_batch(
        &self,
        write: bool,
        local: u64,
        remote: u64,
        len: usize,
        end: Option<CopyEnd>,
    ) -> io::Result<bool> {
        // SAFETY: the caller's contract.
        unsafe { vm_copy(write, self.pid, local, remote, len, end) }
    }

    /// Copy `len` bytes from our `local` address into the process at `remote`; `ESRCH` if it
    /// has exited. What is left: the process may exit, be reaped and its pid be handed to a new
    /// process between the liveness check (at most [`LIVENESS_TRUST`] old) and the copy's
    /// system call (docs/providers.md, "Known gaps"). `end`: see [`CopyEnd`].
    ///
    /// # Safety
    /// As [`vm_copy`] for a write.
    pub unsafe fn write(
        &self,
        local: u64,
        remote: u64,
        len: usize,
        end: Option<CopyEnd>,
    ) -> io::Result<()> {
        self.check()?;
        // SAFETY: the caller's contract.
        unsafe { self.copy_in_batch(true, local, remote, len, end) }.map(drop)
    }

    /// [`Proc::write`] of two local ranges, one after the other, into one remote range (a
    /// header and a payload): one system call where two would do.
    ///
    /// # Safety
    /// As [`vm_copy`] for a write, for both ranges.
    pub unsafe fn write_two(
        &self,
        first: (u64, usize),
        second: (u64, usize),
        remote: u64,
        end: Option<CopyEnd>,
    ) -> io::Result<()> {
        self.check()?;
        let total = first.1 + second.1;
        let l = [
            vec(first.0, first.1),
            vec(second.0, second.1),
            vec(end.map_or(0, |e| e.local), 4),
        ];
        let r = [vec(remote, total), vec(end.map_or(0, |e| e.remote), 4)];
        let (lc, rc) = if end.is_some() { (3, 2) } else { (2, 1) };
        // SAFETY: the kernel reads our ranges, valid per the caller's contract; a bad remote
        // range is an error (EFAULT), not undefined behaviour here.
        let n = syscall!(process_vm_writev(
            self.pid,
            l.as_ptr(),
            lc,
            r.as_ptr(),
            rc,
            0
        ))? as usize;
        if n >= total {
            return Ok(());
        }
        // Short (the remote range crossed an unmapped page, or a signal): the rest piece by
        // piece, as `write` copies.
        // SAFETY: the caller's contract, for what is left of each range.
        unsafe {
            if n < first.1 {
                vm_copy(
                    true,
                    self.pid,
                    first.0 + n as u64,
                    remote + n as u64,
                    first.1 - n,
                    None,
                )?;
            }
            let done2 = n.saturating_sub(first.1);
            vm_copy(
                true,
                self.pid,
                second.0 + done2 as u64,
                remote + (first.1 + done2) as u64,
                second.1 - done2,
                end,
            )
            .map(drop)
        }
    }

    /// Copy `len` bytes from the process at `remote` to our `local` address; `ESRCH` if it has
    /// exited (checked as for [`Proc::write`]).
    ///
    /// # Safety
    /// As [`vm_copy`] for a read.
    pub unsafe fn read(
        &self,
        local: u64,
        remote: u64,
        len: usize,
        end: Option<CopyEnd>,
    ) -> io::Result<()> {
        self.check()?;
        // SAFETY: the caller's contract.
        unsafe { self.copy_in_batch(false, local, remote, len, end) }.map(drop)
    }
}

/// An iovec of `n` bytes at address `a` (ours or the other process's).
fn vec(a: u64, n: usize) -> libc::iovec {
    libc::iovec {
        iov_base: a as usize as *mut libc::c_void,
        iov_len: n,
    }
}

/// Four bytes a copy's own system call moves after the data, in the same direction: from our
/// `local` to the process's `remote` for a write, from its `remote` to our `local` for a read.
/// A word that says "this copy is over" (the end of an announcement, a count of chunks done)
/// is then written by the kernel once the data is, so a process stopped (SIGSTOP, a debugger)
/// or preempted as its system call returns does not leave the word saying the copy still
/// runs. `process_vm_*` copy their vectors in order, each after the one before is done. If
/// the word cannot be written the copy still succeeds (the caller writes it itself, as without).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyEnd {
    pub local: u64,
    pub remote: u64,
}

/// Copy `len` bytes between our `local` and process `pid`'s `remote` (write: ours to theirs;
/// read: theirs to ours), then `end`'s word; `Err` (with errno) unless every data byte moved.
/// `Ok(true)`: the end word was written too (by the system call that moved the last data byte).
///
/// # Safety
/// Our range `local..local + len` (and `end`'s local word) must be mapped: readable for a
/// write; for a read writable and not referenced by Rust references (`end`'s word may be an
/// atomic the kernel stores into, as another thread would).
unsafe fn vm_copy(
    write: bool,
    pid: i32,
    local: u64,
    remote: u64,
    len: usize,
    end: Option<CopyEnd>,
) -> io::Result<bool> {
    if len == 0 && end.is_none() {
        return Ok(false);
    }
    let mut done = 0usize;
    loop {
        let l = [
            vec(local + done as u64, len - done),
            vec(end.map_or(0, |e| e.local), 4),
        ];
        let r = [
            vec(remote + done as u64, len - done),
            vec(end.map_or(0, |e| e.remote), 4),
        ];
        let cnt = if end.is_some() { 2 } else { 1 };
        // SAFETY: the kernel reads (write) or writes (read) our ranges, valid per the
        // caller's contract, and the other process's; a bad remote range is an error
        // (EFAULT), not undefined behaviour here.
        let n = if write {
            syscall!(process_vm_writev(pid, l.as_ptr(), cnt, r.as_ptr(), cnt, 0))?
        } else {
            syscall!(process_vm_readv(pid, l.as_ptr(), cnt, r.as_ptr(), cnt, 0))?
        } as usize;
        if n == 0 && done < len {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        if n >= len - done {
            return Ok(end.is_some() && n == len - done + 4);
        }
        done += n;
    }
}

static PROBE: u64 = 0x5344_505f_5348_4d21;

/// Address of a word the peer reads with process_vm_readv to prove it can reach our memory.
pub fn probe_addr() -> u64 {
    &PROBE as *const u64 as u64
}

/// Whether this process may copy to and from the process's memory at all (ptrace access:
/// Yama's `ptrace_scope`, dumpability), without knowing any of its addresses: a read at
/// address 0, never mapped (`vm.mmap_min_addr`), fails with EFAULT when access is granted and
/// EPERM when it is not (the kernel checks access before it looks at the addresses).
pub fn may_access(p: &Proc) -> bool {
    let mut v: u8 = 0;
    // SAFETY: the local range is the live `v`; the remote address is never mapped.
    let r = unsafe { p.read(&mut v as *mut u8 as u64, 0, 1, None) };
    matches!(r, Err(e) if e.raw_os_error() == Some(libc::EFAULT))
}

/// Whether we can read the probe word at `addr` of the process (ptrace access, right process).
pub fn probe(p: &Proc, addr: u64) -> io::Result<bool> {
    let mut v: u64 = 0;
    // SAFETY: the local range is the live `v`.
    unsafe { p.read((&mut v as *mut u64) as u64, addr, 8, None)? };
    Ok(v == PROBE)
}

/// The host's CPU pressure so far (PSI, `/proc/pressure/cpu`): the microseconds during which
/// some runnable task waited for a CPU. `None` where the kernel does not keep it.
///
/// The file is kept open (above the application's numbers) and read from its start each
/// time: an open and a close per reading cost a few microseconds, and the fd they made sat at
/// the application's lowest free number meanwhile. A number that stops reading as the file
/// (the application closed it behind us and may have reused it) is forgotten, not closed.
pub(crate) fn cpu_pressure_us() -> Option<u64> {
    use std::sync::atomic::{AtomicI32, Ordering::Relaxed};
    static KEPT: AtomicI32 = AtomicI32::new(-1);
    let kept = KEPT.load(Relaxed);
    if kept >= 0 {
        if let Some(us) = read_cpu_pressure(kept) {
            return Some(us);
        }
        KEPT.store(-1, Relaxed);
    }
    let path = c"/proc/pressure/cpu";
    let f = made(|| syscall!(open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC))).ok()?;
    let us = read_cpu_pressure(f.as_raw_fd())?;
    KEPT.store(f.into_raw_fd(), Relaxed);
    Some(us)
}

/// The "some" total of a PSI file open at `fd`, read from its start.
fn read_cpu_pressure(fd: RawFd) -> Option<u64> {
    let mut buf = [0u8; 256];
    // SAFETY: reads into a live buffer of its length.
    let n = syscall!(pread(fd, buf.as_mut_ptr().cast(), buf.len(), 0)).ok()?;
    let text = std::str::from_utf8(&buf[..n as usize]).ok()?;
    let some = text.lines().find(|l| l.starts_with("some "))?;
    some.split_whitespace()
        .find_map(|f| f.strip_prefix("total="))?
        .parse()
        .ok()
}

/// The calling thread's errno.
pub(crate) fn errno() -> i32 {
    // SAFETY: __errno_location gives this thread's errno, always valid to read.
    unsafe { *libc::__errno_location() }
}

/// Set the calling thread's errno (a C function's error report).
pub(crate) fn set_errno(e: i32) {
    // SAFETY: __errno_location gives this thread's errno, always valid to write.
    unsafe { *libc::__errno_location() = e };
}

/// Signals held back from a thread while it polls instead of sleeping in the kernel (a blocking
/// read of the shim's; see `AppStream::read`): a signal that comes meanwhile is not run in the
/// middle of the poll but when [`SignalsHeld::release`] restores the thread's mask, which then
/// says whether the signal interrupts the call, as it would have interrupted a sleep in the
/// kernel. Dropped without `release`, the mask is restored all the same.
pub(crate) struct SignalsHeld {
    old: Option<libc::sigset_t>,
}

impl SignalsHeld {
    /// Block every signal in this thread (`None` if the mask cannot be changed).
    pub(crate) fn hold() -> Option<SignalsHeld> {
        // SAFETY: all-zero sigsets are valid values for sigfillset/pthread_sigmask to fill.
        let (mut all, mut old): (libc::sigset_t, libc::sigset_t) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        // SAFETY: both sets are live; pthread_sigmask only changes this thread's mask.
        let ok = unsafe {
            libc::sigfillset(&mut all) == 0
                && libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old) == 0
        };
        ok.then_some(SignalsHeld { old: Some(old) })
    }

    /// Whether a signal the thread's own mask lets through came since [`Self::hold`].
    pub(crate) fn came(&self) -> bool {
        self.old
            .as_ref()
            .is_some_and(|old| arrived(old).next().is_some())
    }

    /// Whether a signal that `mask` (a call's mask for its wait) lets through came since
    /// [`Self::hold`].
    pub(crate) fn came_through(&self, mask: &libc::sigset_t) -> bool {
        self.old.is_some() && arrived(mask).next().is_some()
    }

    /// Restore the thread's mask (signals that came are handled now, in this thread) and say
    /// which handlers ran: a call sleeping in the kernel would have been interrupted by any
    /// of them (an event wait: epoll_wait, poll) or by one installed without SA_RESTART (a
    /// socket call without a timeout; one with SA_RESTART restarts it). Default and ignored
    /// dispositions interrupt nothing. (A socket call with a timeout would return EINTR under
    /// SA_RESTART too; callers do not hold signals for those.)
    pub(crate) fn release(mut self) -> Handled {
        let mut handled = Handled::default();
        let Some(old) = self.old.take() else {
            return handled;
        };
        for sig in arrived(&old) {
            // SAFETY: an all-zero sigaction is a valid value for sigaction to fill.
            let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: only reads the disposition of `sig` into `sa`.
            if unsafe { libc::sigaction(sig, std::ptr::null(), &mut sa) } != 0
                || sa.sa_sigaction == libc::SIG_DFL
                || sa.sa_sigaction == libc::SIG_IGN
            {
                continue;
            }
            handled.any = true;
            handled.not_restarting |= sa.sa_flags & libc::SA_RESTART == 0;
        }
        restore_mask(&old);
        handled
    }
}

/// Spawn a thread of the library's own (a progress thread, a device watch) with every signal
/// blocked in it from its first instruction: the application's signals must reach the
/// application's threads. A signal sent to the process goes to any thread that does not block
/// it; one of ours would run the application's handler where the application never looks (a
/// `pselect` that unblocks SIGALRM for its wait would never see its EINTR; a single-threaded
/// program's handler would run beside its main thread). The calling thread blocks all
/// signals around the spawn (the new thread starts with the mask it was created under) and
/// gets its own mask back.
pub(crate) fn spawn_without_signals<F, T>(
    builder: std::thread::Builder,
    f: F,
) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let held = SignalsHeld::hold();
    let r = spawn_started(builder, f);
    // Restores this thread's mask; nothing it held came meanwhile that it must report.
    drop(held);
    r
}

/// `builder.spawn(f)`, returning once the thread runs. Until a new thread has started, glibc
/// counts it as being created, and a `setuid`/`setgroups` waits for it to start: in a child
/// made by a raw `clone` (no fork handlers: vsftpd's sessions), whose memory says so while the
/// thread does not exist there, for good (the probe of 2026-11-29: vsftpd's first session
/// hung in `setgroups`, 3 of 8 tries). Waiting here closes that window before the call that
/// made the thread returns to the application.
pub fn spawn_started<F, T>(
    builder: std::thread::Builder,
    f: F,
) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::sync_channel::<()>(1);
    let h = builder.spawn(move || {
        let _ = tx.send(());
        f()
    })?;
    let _ = rx.recv();
    Ok(h)
}

/// The handlers that ran when [`SignalsHeld::release`] restored the mask.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Handled {
    /// Some handler ran (an event wait returns EINTR).
    pub(crate) any: bool,
    /// One installed without SA_RESTART ran (a socket call returns EINTR).
    pub(crate) not_restarting: bool,
}

impl Drop for SignalsHeld {
    fn drop(&mut self) {
        if let Some(old) = self.old.take() {
            restore_mask(&old);
        }
    }
}

/// The signals pending now (for the thread or the process) that `old` (the thread's own mask,
/// or a call's) lets through.
fn arrived(old: &libc::sigset_t) -> impl Iterator<Item = i32> + '_ {
    // SAFETY: an all-zero sigset is a valid value for sigpending to fill.
    let mut pending: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `pending` is live.
    let got = unsafe { libc::sigpending(&mut pending) } == 0;
    (1..libc::SIGRTMAX() + 1).filter(move |&sig| {
        // SAFETY: both sets are live and initialised.
        got && unsafe { libc::sigismember(&pending, sig) == 1 && libc::sigismember(old, sig) == 0 }
    })
}

fn restore_mask(old: &libc::sigset_t) {
    // SAFETY: `old` is the live mask pthread_sigmask gave us.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Access to a live process of ours is granted; to one that exited it is not.
    #[test]
    fn may_access_a_live_process_not_a_gone_one() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let p = Proc::open(child.id() as i32).unwrap();
        assert!(may_access(&p));
        assert!(may_access(&Proc::open(std::process::id() as i32).unwrap()));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!may_access(&p));
    }

    /// A stopped process reads as stopped, a continued one not.
    #[test]
    fn a_stopped_process_is_seen_stopped() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let p = Proc::open(child.id() as i32).unwrap();
        let wait_for = |want: bool| {
            let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while p.stopped() != want && std::time::Instant::now() < end {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            p.stopped() == want
        };
        assert!(wait_for(false), "a sleeping process seen stopped");
        // SAFETY: signals our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGSTOP) };
        assert!(wait_for(true), "a stopped process not seen stopped");
        // SAFETY: as above.
        unsafe { libc::kill(child.id() as i32, libc::SIGCONT) };
        assert!(wait_for(false), "a continued process seen stopped");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A copy's end word is written by the same system call, after the data, and the caller
    /// learns whether it was (a helper must not write its count again when it was).
    #[test]
    fn a_copy_writes_its_end_word_after_the_data() {
        let pid = std::process::id() as i32;
        let src = vec![7u8; 3 * 4096 + 5];
        let mut dst = vec![0u8; src.len()];
        let one: u32 = 1;
        let word = std::sync::atomic::AtomicU32::new(0);
        let end = CopyEnd {
            local: &one as *const u32 as u64,
            remote: word.as_ptr() as u64,
        };
        for read in [false, true] {
            word.store(0, std::sync::atomic::Ordering::SeqCst);
            dst.iter_mut().for_each(|b| *b = 0);
            let (l, r) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
            // SAFETY: both buffers live across the calls; `word` is an atomic the kernel stores
            // into like another thread would.
            let got = unsafe {
                if read {
                    let e = CopyEnd {
                        local: word.as_ptr() as u64,
                        remote: &one as *const u32 as u64,
                    };
                    vm_copy(false, pid, r, l, src.len(), Some(e))
                } else {
                    vm_copy(true, pid, l, r, src.len(), Some(end))
                }
            };
            assert!(got.unwrap(), "read {read}");
            assert_eq!(word.load(std::sync::atomic::Ordering::SeqCst), 1);
            assert!(dst == src);
        }
        // Without an end, or with one that cannot be written: the data moves, no end.
        // SAFETY: as above.
        unsafe {
            let (l, r) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
            assert!(!vm_copy(true, pid, l, r, src.len(), None).unwrap());
            let bad = CopyEnd {
                local: &one as *const u32 as u64,
                remote: 8,
            };
            assert!(!vm_copy(true, pid, l, r, src.len(), Some(bad)).unwrap());
            assert!(!vm_copy(true, pid, l, r, 0, None).unwrap());
        }
    }
}
