//! LD_PRELOAD shim: the AF_INET/AF_INET6 stream sockets of an unmodified program go over SDP
//! (shm between processes of one host, RDMA over a device), falling back to kernel TCP where
//! the peer or the path cannot do SDP.
//!
//! `LD_PRELOAD=/path/to/libsdp_preload.so PROGRAM ARGS...`
//!
//! Design (see docs/preload.md):
//! * `socket()` makes a kernel TCP socket, as without the shim. `connect()` tries SDP first; on
//!   success the SDP stream's application fd (a real kernel file that polls exactly as the
//!   stream, `sdp_core::socket::app`) replaces the TCP socket under the same fd number, with
//!   its flags; otherwise the kernel TCP socket connects as usual. `listen()` listens on the
//!   kernel TCP socket and, on the same address, over SDP; SDP clients are announced by
//!   doorbells, so the listener's fd polls natively and `accept()` hands out SDP or TCP clients.
//! * poll, select and epoll are answered by the kernel on the real fds; while the process has
//!   SDP streams, the epoll waits, poll, ppoll, select and pselect first poll for a moment instead
//!   of sleeping at once (`wait`, `app::poll_events`).
//! * Each hook is a dispatch: a call on an fd the shim does not own costs one atomic load
//!   before it goes to libc.
//!
//! Environment: `SDP_PRELOAD=0` turns the shim off (everything goes to libc); `SDP_LOG=1`
//! reports each choice and fallback on stderr.

#![allow(clippy::missing_safety_doc)]

/// A JSON string literal for `s` (reports, sdpstat).
#[doc(hidden)]
pub fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

#[macro_use]
mod exec;
mod keeper;
mod limits;
mod real;
mod report;
mod rules;
mod signals;
mod table;
mod wait;

use std::cell::Cell;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use libc::{c_int, c_void, iovec, msghdr, size_t, sockaddr, socklen_t, ssize_t};
use sdp_core::socket::app::{self, AppListener, AppStream, ReadFlags};
use sdp_core::socket::Options;
use sdp_core::socket::{fd_limit, history};

use table::{Opts, Sock};

thread_local! {
    /// Set while the shim itself runs (its calls into sdp-core, and sdp-core's own threads):
    /// hooks then go straight to libc.
    static INTERNAL: Cell<bool> = const { Cell::new(false) };
}

fn internal() -> bool {
    INTERNAL.with(|c| c.get())
}

/// Marks the current thread as the shim's for the guard's life.
pub(crate) struct Internal(bool);
impl Internal {
    pub(crate) fn enter() -> Internal {
        Internal(INTERNAL.with(|c| c.replace(true)))
    }
}
impl Drop for Internal {
    fn drop(&mut self) {
        let prev = self.0;
        INTERNAL.with(|c| c.set(prev));
    }
}

/// Drop what may call into the socket layer (a socket's last handle), as the shim's own work.
pub(crate) fn drop_internal<T>(v: T) {
    let _g = Internal::enter();
    drop(v);
}

fn mark_thread_internal() {
    INTERNAL.with(|c| c.set(true));
}

/// The process the shim's state belongs to (a vfork child shares it and must not use it).
static PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// 0 unknown, 1 on, 2 off.
static ENABLED: AtomicU8 = AtomicU8::new(0);
static LOG: AtomicU8 = AtomicU8::new(0);

fn enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let on = std::env::var("SDP_PRELOAD").map_or(true, |v| v != "0");
            let log = std::env::var("SDP_LOG").is_ok_and(|v| !v.is_empty() && v != "0");
            if std::env::var("SDP_FD_CHECK").is_ok_and(|v| !v.is_empty() && v != "0") {
                table::check_identities();
            }
            LOG.store(log as u8 + 1, Ordering::Relaxed);
            app::set_thread_start_hook(mark_thread_internal);
            PID.store(std::process::id(), Ordering::Relaxed);
            report::init();
            rules();
            program();
            // SAFETY: registers a plain function to run at exit.
            unsafe { libc::atexit(at_exit) };
            // And first in sdp-core's exit work, which runs before ours (registered later).
            sdp_core::socket::set_exit_hook(at_exit_hook);
            // Around fork(), and a raw clone's (`sdp_raw_fork`).
            sdp_core::socket::fork::atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child));
            if on {
                // Room for our fds above the application's fd limit (limits.rs).
                let _ = sdp_core::socket::fd_limit::make_fd_room();
            }
            ENABLED.store(if on { 1 } else { 2 }, Ordering::Relaxed);
            on
        }
    }
}

/// At load, in a program exec'd with SDP streams open (`SDP_EXEC_FDS`): answer their identity
/// from the first call (`exec::adopt_inherited`). Other programs pay one environment lookup.
extern "C" fn at_load() {
    exec::adopt_inherited();
}

#[used]
#[link_section = ".init_array"]
static AT_LOAD: extern "C" fn() = at_load;

/// The exit work has begun (in some thread): a signal that ends the process then ends it at
/// once (`signals`), rather than wait for work that thread may never finish.
pub(crate) static EXITING: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// [`at_exit`] as sdp-core's exit hook.
fn at_exit_hook() {
    at_exit();
}

/// Exit-time work, once: flush the connections, then the report of every socket handled.
pub(crate) extern "C" fn at_exit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        EXITING.store(true, Ordering::SeqCst);
        let _g = Internal::enter();
        // Streams other processes may hold go on in a keeper (keeper.rs), and so does what the
        // peers do not hold yet: the process exits at once, as over TCP.
        keeper::start_if_wanted();
        keeper::hand_over_undelivered();
        // What was written before exit reaches the peers (the socket layer's own atexit
        // handler does the same; `_exit` skips it).
        sdp_core::socket::flush_at_exit(sdp_core::socket::exit_linger());
        if report::wanted() {
            let live = table::streams()
                .into_iter()
                .filter_map(|(_, s)| match &*s {
                    // An inherited stream is its owner's to report.
                    Sock::Stream(st, o) if !st.is_inherited() => {
                        Some(report::of_stream(&o.lock(), st))
                    }
                    _ => None,
                })
                .chain(report::tcp_live())
                .collect();
            report::write(live);
        }
    });
}

/// A fork that moves this process's SDP streams and listeners to the child (`daemon`): the
/// fork handlers neither expose the streams nor share or drop the listeners (the daemon hook
/// shared those that cannot move; the runtime is locked across this fork), and the child keeps
/// its rendezvous sockets and reports the streams as their owner.
pub(crate) static MOVING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn fork_prepare() {
    if !MOVING.load(Ordering::SeqCst) {
        expose_for_fork();
    }
    // The table (and every socket's options) before the report: a socket's drop holds its
    // options while it takes the report's lock.
    table::lock_for_fork();
    report::lock_for_fork();
    signals::lock_for_fork();
}

/// Before a fork: the child inherits the streams: they keep their speed until a process uses
/// the child's copy (then the owner shares it on that process's request: its bytes flow
/// through the kernel file). The runtime's fds the child must not hold it closes at once
/// (sdp-core's own fork handler). Listeners become shared.
fn expose_for_fork() {
    let g = Internal::enter();
    for (fd, s) in table::streams() {
        if let Sock::Stream(st, _) = &*s {
            if !st.is_shared() {
                if let Some(Err(e)) = table::file_id(fd).map(|f| st.expose(f)) {
                    log(format_args!("fork: fd {fd} cannot be inherited: {e}"));
                }
            }
        }
    }
    drop(g);
    share_listeners_for_fork(false);
}

/// Listeners become shared at a fork: whichever process accepts an SDP client sets it up
/// itself. At a move (`moving`), those that can move with the connections stay as they are.
fn share_listeners_for_fork(moving: bool) {
    let _g = Internal::enter();
    for (fd, s) in table::listeners() {
        if let Sock::Listener(l) = &*s {
            if (moving && l.movable()) || l.is_shared() {
                continue;
            }
            match l.share() {
                Ok(()) => log(format_args!(
                    "fork: listening fd {fd} is shared, the process that accepts sets SDP up"
                )),
                Err(e) => log(format_args!(
                    "fork: listening fd {fd} now serves kernel TCP only ({e})"
                )),
            }
        }
    }
}

extern "C" fn fork_parent() {
    signals::unlock_after_fork();
    let gone = table::unlock_after_fork(MOVING.load(Ordering::SeqCst));
    report::unlock_after_fork();
    if !gone.is_empty() {
        log(format_args!(
            "fork: {} listening socket(s) shared with the child now serve kernel TCP only",
            gone.len()
        ));
    }
    let _g = Internal::enter();
    drop(gone);
}

extern "C" fn fork_child() {
    signals::unlock_after_fork();
    table::forget_readers_in_child();
    PID.store(std::process::id(), Ordering::Relaxed);
    let gone = table::unlock_after_fork(MOVING.load(Ordering::SeqCst));
    report::unlock_after_fork();
    if !MOVING.load(Ordering::SeqCst) {
        report::forget_inherited();
        // The parent's pumps stay the parent's.
        keeper::forget_in_child();
    }
    let _g = Internal::enter();
    drop(gone);
    if !MOVING.load(Ordering::SeqCst) {
        close_inherited_rendezvous();
    }
}

/// Close the parent's SDP-over-shm rendezvous sockets (abstract `@sdp-shm/ADDR` listening
/// sockets) that fork() copied into this child: the child cannot serve them, and holding them
/// open would keep connects to the parent's closed listener waiting instead of refused.
fn close_inherited_rendezvous() {
    let Ok(unix) = fd_limit::with_room(|| std::fs::read_to_string("/proc/net/unix")) else {
        return;
    };
    let inodes: std::collections::HashSet<u64> = unix
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Path "@sdp-shm/..." (rendezvous) or "@sdp-stat/..." (sdpstat), listening (01).
            (f.len() >= 8
                && (f[7].starts_with("@sdp-shm/") || f[7].starts_with("@sdp-stat/"))
                && f[5] == "01")
                .then(|| f[6].parse().ok())
                .flatten()
        })
        .collect();
    if inodes.is_empty() {
        return;
    }
    // (The directory's fd is open through the walk.)
    let _room = fd_limit::LowFds::hold();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let mut close = Vec::new();
    for e in dir.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<c_int>().ok()) else {
            continue;
        };
        let Ok(link) = std::fs::read_link(e.path()) else {
            continue;
        };
        let link = link.to_string_lossy();
        if let Some(ino) = link
            .strip_prefix("socket:[")
            .and_then(|r| r.strip_suffix(']'))
            .and_then(|n| n.parse::<u64>().ok())
        {
            if inodes.contains(&ino) {
                close.push(fd);
            }
        }
    }
    for fd in close {
        // SAFETY: an fd of the dead parent runtime's listener, which nothing in this process
        // uses any more.
        unsafe { real::close(fd) };
    }
}

/// `_exit` skips atexit handlers; the shim's exit work runs anyway.
#[no_mangle]
pub unsafe extern "C" fn _exit(status: c_int) -> ! {
    // Not in a vfork child: it shares the parent's memory, and its exit is not the parent's.
    if ENABLED.load(Ordering::Relaxed) == 1
        && !internal()
        && PID.load(Ordering::Relaxed) == std::process::id()
    {
        at_exit();
    }
    // SAFETY: ends the process as the caller asked.
    unsafe { libc::syscall(libc::SYS_exit_group, status as libc::c_long) };
    unreachable!("exit_group returned")
}

/// Same as `_exit`.
#[no_mangle]
pub unsafe extern "C" fn _Exit(status: c_int) -> ! {
    // SAFETY: as `_exit`.
    unsafe { _exit(status) }
}

// Signals whose default action ends the process: in a process with SDP streams the shim
// stands in for SIG_DFL, so that such a death delivers what was written (signals.rs).

#[no_mangle]
pub unsafe extern "C" fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { signals::sigaction(sig, act, old) }
}

#[no_mangle]
pub unsafe extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: the caller's arguments.
    unsafe { signals::signal(sig, handler, false) }
}

#[no_mangle]
pub unsafe extern "C" fn bsd_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: the caller's arguments.
    unsafe { signals::signal(sig, handler, false) }
}

#[no_mangle]
pub unsafe extern "C" fn sysv_signal(
    sig: c_int,
    handler: libc::sighandler_t,
) -> libc::sighandler_t {
    // SAFETY: the caller's arguments.
    unsafe { signals::signal(sig, handler, true) }
}

#[no_mangle]
pub unsafe extern "C" fn __sysv_signal(
    sig: c_int,
    handler: libc::sighandler_t,
) -> libc::sighandler_t {
    // SAFETY: the caller's arguments.
    unsafe { signals::signal(sig, handler, true) }
}

/// The program's name for the rules (argv[0]'s base name).
fn program() -> &'static str {
    static P: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    P.get_or_init(|| {
        std::env::args_os()
            .next()
            .and_then(|a| {
                std::path::Path::new(&a)
                    .file_name()
                    .map(|f| f.to_string_lossy().into_owned())
            })
            .or_else(|| {
                std::fs::read_to_string("/proc/self/comm")
                    .ok()
                    .map(|s| s.trim().to_string())
            })
            .unwrap_or_default()
    })
}

type Choice = (Option<rules::Use>, rules::Rules);

/// `SDP_USE` and the rules file, read when the shim starts (a program may clear its
/// environment later, as nginx does).
fn rules() -> &'static Choice {
    static RULES: std::sync::OnceLock<Choice> = std::sync::OnceLock::new();
    RULES.get_or_init(|| {
        let over = match std::env::var("SDP_USE").as_deref() {
            Ok("sdp") => Some(rules::Use::Sdp),
            Ok("tcp") => Some(rules::Use::Tcp),
            Ok("both") => Some(rules::Use::Both),
            Ok(v) => {
                eprintln!("sdp-preload: SDP_USE={v:?} is not sdp, tcp or both; ignored");
                None
            }
            Err(_) => None,
        };
        let rules = match std::env::var("SDP_PRELOAD_CONF") {
            Ok(path) => match std::fs::read_to_string(&path) {
                Ok(text) => {
                    let (r, errs) = rules::Rules::parse(&text, &path);
                    for e in errs {
                        eprintln!("sdp-preload: {e}");
                    }
                    r
                }
                Err(e) => {
                    eprintln!("sdp-preload: cannot read SDP_PRELOAD_CONF {path}: {e}; no rules");
                    rules::Rules::default()
                }
            },
            Err(_) => rules::Rules::default(),
        };
        (over, rules)
    })
}

/// The choice for a socket: `SDP_USE` (sdp, tcp or both) if set, else the rules file.
fn choose(role: rules::Role, addr: SocketAddr) -> rules::Use {
    let (over, r) = rules();
    over.unwrap_or_else(|| r.choose(role, program(), addr))
}

pub(crate) fn log(msg: std::fmt::Arguments<'_>) {
    if LOG.load(Ordering::Relaxed) == 2 {
        eprintln!("sdp-preload[{}]: {msg}", std::process::id());
    }
}

fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local and always valid to write.
    unsafe { *libc::__errno_location() = e };
}

fn errno_of(e: &io::Error) -> c_int {
    e.raw_os_error().unwrap_or(match e.kind() {
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::ConnectionRefused => libc::ECONNREFUSED,
        io::ErrorKind::InvalidInput => libc::EINVAL,
        _ => libc::EIO,
    })
}

/// -1 with errno set from `e`.
fn fail<T: From<i8>>(e: &io::Error) -> T {
    set_errno(errno_of(e));
    T::from(-1)
}

fn fd_flags(fd: c_int) -> (bool, bool) {
    // SAFETY: fcntl with integer arguments on the caller's fd.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    // SAFETY: as above.
    let fdf = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
    (
        fl >= 0 && fl & libc::O_NONBLOCK != 0,
        fdf >= 0 && fdf & libc::FD_CLOEXEC != 0,
    )
}

/// The socket address at `addr` (AF_INET / AF_INET6), if it is one.
unsafe fn sockaddr_in(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: zeroed sockaddr_storage is valid; we copy at most its size from the caller's.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let n = (len as usize).min(std::mem::size_of::<libc::sockaddr_storage>());
    // SAFETY: the caller's buffer holds `len` bytes; `ss` holds at least `n`.
    unsafe { std::ptr::copy_nonoverlapping(addr.cast::<u8>(), &mut ss as *mut _ as *mut u8, n) };
    let need = match ss.ss_family as c_int {
        libc::AF_INET => std::mem::size_of::<libc::sockaddr_in>(),
        libc::AF_INET6 => std::mem::size_of::<libc::sockaddr_in6>(),
        _ => return None,
    };
    if n < need {
        return None;
    }
    app::from_sockaddr(&ss)
}

/// Write `a` to the caller's (addr, len) as the kernel does (truncating, len = full size).
unsafe fn put_sockaddr(a: SocketAddr, addr: *mut sockaddr, len: *mut socklen_t) {
    if addr.is_null() || len.is_null() {
        return;
    }
    let (ss, full) = app::to_sockaddr(a);
    // SAFETY: `len` is the caller's valid pointer.
    let room = unsafe { *len } as usize;
    let n = room.min(full as usize);
    // SAFETY: the caller's buffer holds `room` bytes; we copy at most that many.
    unsafe { std::ptr::copy_nonoverlapping(&ss as *const _ as *const u8, addr.cast::<u8>(), n) };
    // SAFETY: as above.
    unsafe { *len = full };
}

// ---------------------------------------------------------------------------------------------
// socket, connect, listen, accept

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    let mark = fd_limit::LowMark::now();
    // SAFETY: forwards the caller's arguments.
    let fd = unsafe { real::socket(domain, ty, proto) };
    let cloexec = ty & libc::SOCK_CLOEXEC != 0;
    // (Not for the library's own sockets.)
    let fd = if internal() {
        fd
    } else {
        fd_limit::app_number(fd, mark, cloexec)
    };
    let Some(fd) = limits::within_app_limit(fd, cloexec) else {
        set_errno(libc::EMFILE);
        return -1;
    };
    let stream = ty & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC) == libc::SOCK_STREAM;
    if fd >= 0
        && stream
        && (domain == libc::AF_INET || domain == libc::AF_INET6)
        && (proto == 0 || proto == libc::IPPROTO_TCP)
        && !internal()
        && enabled()
    {
        table::forget_buffers(fd);
        table::insert(
            fd,
            Arc::new(Sock::Fresh(table::OptsLock::new(Opts::default()))),
        );
    }
    fd
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    if !table::owned(fd) || internal() {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::connect(fd, addr, len) };
    }
    // SAFETY: forwards the caller's arguments.
    keeping_errno(|| unsafe { connect_owned(fd, addr, len) })
}

/// `f`'s result, errno as it was before when `f` succeeded (a result of 0 or more): the
/// shim's own calls on the way (an SDP attempt that fell back, a look that found nothing) must
/// not show, as a successful system call leaves errno alone (`nc -z -v` printed "open :
/// Resource temporarily unavailable").
fn keeping_errno(f: impl FnOnce() -> c_int) -> c_int {
    // SAFETY: errno is thread-local and always valid to read.
    let saved = unsafe { *libc::__errno_location() };
    let r = f();
    if r >= 0 {
        set_errno(saved);
    }
    r
}

/// [`connect`] on a socket the shim owns.
unsafe fn connect_owned(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let entry = table::get(fd);
    if entry.as_ref().is_some_and(|s| s.stream_parts().is_some()) {
        // Already connected, as a TCP socket would say.
        set_errno(libc::EISCONN);
        return -1;
    }
    let watches = match entry.as_deref() {
        Some(Sock::Fresh(o)) => Some(std::mem::take(&mut o.lock().epoll)),
        _ => None,
    };
    // SAFETY: the caller's address of `len` bytes.
    let dst = unsafe { sockaddr_in(addr, len) };
    let (Some(dst), Some(watches)) = (dst, watches) else {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::connect(fd, addr, len) };
    };
    let choice = choose(rules::Role::Client, dst);
    if choice == rules::Use::Tcp {
        log(format_args!("connect fd {fd} to {dst}: kernel TCP (rules)"));
        table::remove(fd);
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::connect(fd, addr, len) };
    }
    if choice == rules::Use::Both {
        if let Some(why) = history::advice(dst) {
            return connect_tcp(fd, addr, len, dst, &why.to_string());
        }
    }
    let (nonblocking, cloexec) = fd_flags(fd);
    let bound_port = kernel_sockname(fd).map(|a| a.port()).filter(|&p| p != 0);
    let r = {
        let _g = Internal::enter();
        // A source address the application bound picks the device SDP leaves from, as it
        // picks the interface for TCP.
        let opts = match bound_ip(fd) {
            Some(ip) => Options::default().with_source_ip(ip),
            None => Options::default(),
        };
        // A port it bound is the connection's own, as TCP's.
        let opts = match bound_port {
            Some(p) => opts.with_source_port(p),
            _ => opts,
        };
        AppStream::connect(dst, &opts, nonblocking, cloexec)
    };
    match r {
        Ok((s, user)) => {
            log(format_args!(
                "connect fd {fd} to {dst}: {} (sdp)",
                s.transport()
            ));
            let mut opts = carry_options(fd, &s, &user);
            if s.local_addr().is_ok_and(|a| Some(a.port()) == bound_port) {
                opts.port_hold = hold_port(fd);
            }
            // The application's epoll registrations of the socket go to the file now under
            // its number (the stream's; the socket's again if that failed).
            let watching = epoll_unwatch(fd, watches);
            let replaced = replace_fd(user, fd, cloexec);
            epoll_rewatch(fd, &watching);
            if watching
                .iter()
                .any(|w| w.events & libc::EPOLLET as u32 != 0)
            {
                s.want_edges();
            }
            if let Err(e) = replaced {
                log(format_args!(
                    "connect fd {fd}: cannot take the fd over: {e}"
                ));
                table::remove(fd);
                // SAFETY: forwards the caller's arguments.
                return unsafe { real::connect(fd, addr, len) };
            }
            table::insert(fd, Arc::new(Sock::Stream(s, table::OptsLock::new(opts))));
            if nonblocking {
                // As a nonblocking TCP connect: in progress, then writable with SO_ERROR 0.
                set_errno(libc::EINPROGRESS);
                -1
            } else {
                0
            }
        }
        Err(e) if choice == rules::Use::Sdp => {
            log(format_args!(
                "connect fd {fd} to {dst}: SDP only (rules), failed: {e}"
            ));
            fail(&e)
        }
        Err(e) => {
            if app::turned_away(&e) && choice == rules::Use::Both {
                let _g = Internal::enter();
                history::record_refused(dst);
            }
            connect_tcp(fd, addr, len, dst, &e.to_string())
        }
    }
}

/// An automatic connect that goes by kernel TCP after all, for `why` (logged and reported).
fn connect_tcp(
    fd: c_int,
    addr: *const sockaddr,
    len: socklen_t,
    dst: SocketAddr,
    why: &str,
) -> c_int {
    log(format_args!("connect fd {fd} to {dst}: kernel TCP ({why})"));
    report::tcp_fallback(
        fd,
        report::Record {
            role: "client",
            peer: Some(dst),
            transport: "tcp".into(),
            fallback: Some(why.into()),
            ..Default::default()
        },
    );
    table::remove(fd);
    // SAFETY: forwards the caller's arguments (the connect hook's own).
    unsafe { real::connect(fd, addr, len) }
}

/// A close-on-exec duplicate of the kernel socket `fd`, above the application's numbers, to
/// keep the port it is bound to taken (`Opts::port_hold`).
fn hold_port(fd: c_int) -> Option<OwnedFd> {
    use std::os::fd::FromRawFd;
    // (Made where the application's numbers may all be taken.)
    let _low = fd_limit::LowFds::hold();
    // SAFETY: duplicates an fd of ours; the duplicate is owned below.
    let d = unsafe { real::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if d < 0 {
        return None;
    }
    let hi = fd_limit::high_fd(d).ok()?;
    // SAFETY: `hi` was just made (or moved) for us alone.
    Some(unsafe { OwnedFd::from_raw_fd(hi) })
}

/// The kernel socket `fd`'s own address (libc's getsockname), if it is an inet one.
pub(crate) fn kernel_sockname(fd: c_int) -> Option<SocketAddr> {
    // SAFETY: zeroed storage is valid; the kernel fills in at most its size.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut sl = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: our own storage and length.
    let r =
        unsafe { real::getsockname(fd, (&mut ss as *mut libc::sockaddr_storage).cast(), &mut sl) };
    (r == 0).then(|| app::from_sockaddr(&ss)).flatten()
}

/// The address a not yet connected socket was bound to, if the application bound one.
fn bound_ip(fd: c_int) -> Option<std::net::IpAddr> {
    let a = kernel_sockname(fd)?;
    (!a.ip().is_unspecified()).then_some(a.ip())
}

/// Take `fd`'s registrations in the application's epoll sets off its file (a kernel socket that
/// stays open for `Opts::port_hold` would go on reporting there); those that were there.
/// An EPOLLONESHOT registration already spent (it reported an event, the fresh socket's
/// hang-up, and was not armed again by EPOLL_CTL_MOD) is made again spent: the kernel shows
/// the registration's events as only its flags then (`/proc/self/fdinfo` of the epoll set).
fn epoll_unwatch(fd: c_int, watches: Vec<table::EpollWatch>) -> Vec<table::EpollWatch> {
    watches
        .into_iter()
        .map(|mut w| {
            if w.events & libc::EPOLLONESHOT as u32 != 0 && epoll_spent(w.epfd, fd) {
                w.events &= EPOLL_FLAGS;
            }
            w
        })
        .filter(|w| {
            // SAFETY: EPOLL_CTL_DEL reads no event.
            w.fd == fd
                && unsafe { real::epoll_ctl(w.epfd, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) }
                    == 0
        })
        .collect()
}

/// The flags of an epoll registration (the rest are the events it reports).
const EPOLL_FLAGS: u32 =
    (libc::EPOLLONESHOT | libc::EPOLLET | libc::EPOLLWAKEUP | libc::EPOLLEXCLUSIVE) as u32;

/// Whether `fd`'s registration in the epoll set `epfd` is a spent EPOLLONESHOT one: its line in
/// the set's fdinfo (`tfd: FD events: HEX data: ...`) shows no event left.
fn epoll_spent(epfd: c_int, fd: c_int) -> bool {
    let path = format!("/proc/self/fdinfo/{epfd}");
    let Ok(info) = fd_limit::with_room(|| std::fs::read_to_string(path)) else {
        return false;
    };
    info.lines().any(|l| {
        let mut it = l.split_whitespace();
        it.next() == Some("tfd:")
            && it.next().and_then(|v| v.parse::<c_int>().ok()) == Some(fd)
            && it.next() == Some("events:")
            && it
                .next()
                .and_then(|v| u32::from_str_radix(v, 16).ok())
                .is_some_and(|e| e & !EPOLL_FLAGS == 0)
    })
}

/// Register the file now under `fd` as the application had registered the one before.
fn epoll_rewatch(fd: c_int, watches: &[table::EpollWatch]) {
    for w in watches {
        let mut ev = libc::epoll_event {
            events: w.events,
            u64: w.data,
        };
        // SAFETY: a live event for the kernel to read.
        if unsafe { real::epoll_ctl(w.epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
            log(format_args!(
                "connect fd {fd}: its {w:?} could not be made again: {}",
                io::Error::last_os_error()
            ));
        }
    }
}

/// Put `user` under the number `fd` (replacing the TCP socket there), then close `user`'s own
/// number.
fn replace_fd(user: OwnedFd, fd: c_int, cloexec: bool) -> io::Result<()> {
    let u = user.into_raw_fd();
    let flags = if cloexec { libc::O_CLOEXEC } else { 0 };
    // SAFETY: plain fd calls; `u` is ours and closed right after.
    let r = unsafe { real::dup3(u, fd, flags) };
    let e = io::Error::last_os_error();
    fd_limit::closing(u);
    // SAFETY: `u` is our own fd.
    unsafe { real::close(u) };
    if r < 0 {
        return Err(e);
    }
    Ok(())
}

/// Options the application set on its TCP socket before connecting, carried to the SDP stream
/// and its fd.
fn carry_options(tcp: c_int, s: &AppStream, user: &OwnedFd) -> Opts {
    use std::os::fd::AsRawFd;
    let v6 = kernel_int(tcp, libc::SOL_SOCKET, libc::SO_DOMAIN) == Some(libc::AF_INET6);
    if v6 {
        s.set_v6_socket();
    }
    let mut o = Opts {
        role: "client",
        local: Opts::shown(v6, s.local_addr().ok()),
        peer: Opts::shown(v6, s.peer_addr().ok()),
        v6,
        ..Opts::default()
    };
    carry_from(tcp, s, user.as_raw_fd(), &mut o);
    o
}

/// The options of the kernel socket `tcp` (the application's, before its connect; or the
/// listener, whose options an accepted socket inherits on Linux) onto the SDP stream `s`, its
/// fd `user` and its stored options: timeouts, TCP_NODELAY, buffers, SO_KEEPALIVE and its
/// TCP_KEEP* times, TCP_USER_TIMEOUT, IP_TOS, SO_REUSEADDR, SO_OOBINLINE, SO_LINGER,
/// SO_RCVLOWAT.
fn carry_from(tcp: c_int, s: &AppStream, user: c_int, o: &mut Opts) {
    for name in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        let mut tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        };
        let mut l = std::mem::size_of::<libc::timeval>() as socklen_t;
        // SAFETY: a live timeval and its size.
        let r = unsafe {
            real::getsockopt(
                tcp,
                libc::SOL_SOCKET,
                name,
                (&mut tv as *mut libc::timeval).cast(),
                &mut l,
            )
        };
        if r == 0 && (tv.tv_sec != 0 || tv.tv_usec != 0) {
            // SAFETY: as above.
            unsafe {
                real::setsockopt(
                    user,
                    libc::SOL_SOCKET,
                    name,
                    (&tv as *const libc::timeval).cast(),
                    l,
                )
            };
        }
    }
    for (level, name) in [
        (libc::IPPROTO_TCP, libc::TCP_NODELAY),
        (libc::SOL_SOCKET, libc::SO_SNDBUF),
        (libc::SOL_SOCKET, libc::SO_RCVBUF),
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE),
        (libc::SOL_SOCKET, libc::SO_REUSEADDR),
        (libc::SOL_SOCKET, libc::SO_OOBINLINE),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT),
        (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
        (libc::IPPROTO_IP, libc::IP_TOS),
    ] {
        if let Some(v) = kernel_int(tcp, level, name) {
            o.stored.insert((level, name), v.to_ne_bytes().to_vec());
        }
    }
    let on = |o: &Opts, level, name| o.stored.get(&(level, name)).is_some_and(|v| v != &[0; 4]);
    if on(o, libc::IPPROTO_TCP, libc::TCP_NODELAY) {
        let _g = Internal::enter();
        let _ = s.set_nodelay(true);
    }
    if on(o, libc::SOL_SOCKET, libc::SO_OOBINLINE) {
        let _g = Internal::enter();
        let _ = s.set_oob_inline(true);
    }
    carry_linger(tcp, s, o);
    carry_buffers(tcp, s, o);
    carry_rcvlowat(tcp, s, user, o);
}

/// SO_RCVLOWAT of the kernel socket `from` (as Linux capped it; inherited from a listener
/// as on Linux) onto the SDP stream whose application fd is `user`.
fn carry_rcvlowat(from: c_int, s: &AppStream, user: c_int, o: &mut Opts) {
    if let Some(v) = kernel_int(from, libc::SOL_SOCKET, libc::SO_RCVLOWAT).filter(|&v| v > 1) {
        let _g = Internal::enter();
        let _ = s.set_rcvlowat(user, v as usize);
        o.stored.insert(
            (libc::SOL_SOCKET, libc::SO_RCVLOWAT),
            v.to_ne_bytes().to_vec(),
        );
    }
}

/// SO_SNDBUF and SO_RCVBUF the application set on the kernel socket `from` (the socket
/// connected over SDP, or the listener an accepted socket inherits them from, as on Linux)
/// onto the SDP stream; sizes it did not set stay the stack's.
fn carry_buffers(from: c_int, s: &AppStream, o: &mut Opts) {
    for name in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        if !table::buffer_set(from, name) {
            continue;
        }
        let Some(v) = kernel_int(from, libc::SOL_SOCKET, name).filter(|&v| v > 0) else {
            continue;
        };
        let _g = Internal::enter();
        let _ = if name == libc::SO_SNDBUF {
            s.set_send_buffer_size(v as usize)
        } else {
            s.set_recv_buffer_size(v as usize)
        };
        o.stored
            .insert((libc::SOL_SOCKET, name), v.to_ne_bytes().to_vec());
    }
}

/// An int option of the kernel socket `fd`, as the kernel reports it.
pub(crate) fn kernel_int(fd: c_int, level: c_int, name: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut l = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: a live int and its size.
    let r = unsafe { real::getsockopt(fd, level, name, (&mut v as *mut c_int).cast(), &mut l) };
    (r == 0).then_some(v)
}

/// SO_LINGER of the kernel socket `from` (the socket connected over SDP, or the listener an
/// accepted socket inherits it from, as on Linux) onto the SDP stream.
fn carry_linger(from: c_int, s: &AppStream, o: &mut Opts) {
    let mut l = libc::linger {
        l_onoff: 0,
        l_linger: 0,
    };
    let mut len = std::mem::size_of::<libc::linger>() as socklen_t;
    // SAFETY: a live linger and its size.
    let r = unsafe {
        real::getsockopt(
            from,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&mut l as *mut libc::linger).cast(),
            &mut len,
        )
    };
    if r != 0 || l.l_onoff == 0 {
        return;
    }
    let _ = s.set_linger(Some(std::time::Duration::from_secs(
        l.l_linger.max(0) as u64
    )));
    o.stored.insert(
        (libc::SOL_SOCKET, libc::SO_LINGER),
        opts::linger_bytes(true, l.l_linger),
    );
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments.
    let r = unsafe { real::listen(fd, backlog) };
    if r != 0 || !table::owned(fd) || internal() {
        return r;
    }
    match table::get(fd).as_deref() {
        Some(Sock::Fresh(_)) => {}
        Some(Sock::Listener(_)) => {
            // listen again (a new backlog): keep the doorbells' room.
            doorbell_room(fd, backlog);
            return r;
        }
        _ => return r,
    }
    if kernel_int(fd, libc::SOL_SOCKET, libc::SO_REUSEPORT).is_some_and(|v| v != 0) {
        // The kernel spreads connections over every socket of the port's group: the doorbell
        // that announces an SDP client lands in any of them. A socket of this process's that
        // joins a group with an SDP listener of its own process shares that listener (its
        // accept claims the group's doorbells); one that joins any other group serves kernel
        // TCP only (its owner would take another's doorbell for a TCP client, whose SDP client
        // would wait for ever). A group's only socket (nc.openbsd sets SO_REUSEPORT on its
        // listener) is any listener.
        if let Some((other, l)) = reuseport_sibling(fd) {
            log(format_args!(
                "listen fd {fd}: shares fd {other}'s SDP listener (SO_REUSEPORT group)"
            ));
            table::insert(fd, l);
            doorbell_room(fd, backlog);
            return r;
        }
        if others_listen_on_port(fd) {
            log(format_args!(
                "listen fd {fd}: kernel TCP only (SO_REUSEPORT group with another process's socket)"
            ));
            table::remove(fd);
            return r;
        }
    }
    if let Some(local) = kernel_sockname(fd) {
        if choose(rules::Role::Server, local) == rules::Use::Tcp {
            log(format_args!(
                "listen fd {fd} on {local}: kernel TCP only (rules)"
            ));
            table::remove(fd);
            return r;
        }
    }
    let l = {
        let _g = Internal::enter();
        // As listen(2): a negative backlog means the most the kernel allows (the socket
        // layer caps it at somaxconn), 0 lets one client wait.
        let backlog = u32::try_from(backlog).unwrap_or(u32::MAX);
        AppListener::new(fd, backlog, &Options::default())
    };
    match l {
        Ok(l) => {
            log(format_args!(
                "listen fd {fd}: kernel TCP and {:?}",
                l.transports()
            ));
            table::insert(fd, Arc::new(Sock::Listener(l)));
            doorbell_room(fd, backlog);
        }
        Err(e) => {
            log(format_args!("listen fd {fd}: kernel TCP only ({e})"));
            table::remove(fd);
        }
    }
    r
}

/// A listener of this process on `fd`'s address with SO_REUSEPORT (the group `fd` joins), and
/// its table entry.
fn reuseport_sibling(fd: c_int) -> Option<(c_int, Arc<Sock>)> {
    let me = kernel_sockname(fd)?;
    table::listeners().into_iter().find(|&(other, _)| {
        other != fd
            && kernel_sockname(other) == Some(me)
            && kernel_int(other, libc::SOL_SOCKET, libc::SO_REUSEPORT).is_some_and(|v| v != 0)
    })
}

/// Whether a listening TCP socket other than `fd` has `fd`'s port (any address: a wildcard and
/// a specific one may take the same connections), as the kernel's tables say.
fn others_listen_on_port(fd: c_int) -> bool {
    let (Some(port), Some((_, ino))) = (kernel_sockname(fd).map(|a| a.port()), table::file_id(fd))
    else {
        return true;
    };
    let _g = Internal::enter();
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        fd_limit::with_room(|| std::fs::read_to_string(f))
            .map(|t| listeners_on_port(&t, port).any(|i| i != ino))
            // Unknown: as if another were there.
            .unwrap_or(*f == "/proc/net/tcp")
    })
}

/// The inodes of the listening sockets on `port` in a `/proc/net/tcp` table.
fn listeners_on_port(table: &str, port: u16) -> impl Iterator<Item = u64> + '_ {
    table.lines().skip(1).filter_map(move |l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let p = f.get(1)?.rsplit(':').next()?;
        (u16::from_str_radix(p, 16).ok()? == port && *f.get(3)? == "0A")
            .then(|| f.get(9)?.parse().ok())
            .flatten()
    })
}

/// An SDP client is announced by a doorbell, a loopback TCP connection to the listener's own
/// port, which takes a place in the kernel's accept queue. With only the application's backlog
/// there, a burst of clients filled it and a doorbell's SYN was dropped: its client waited for
/// the kernel's 1 s retransmission, then gave up on SDP (Python's `ForkingTCPServer`, backlog 5,
/// 16 clients at once: 3-9 of 48 stalled 1-2 s; kernel TCP alone stalls in 1 run of 5). The
/// kernel queue gets room for as many doorbells as the SDP queue holds (the backlog) beside the
/// application's own.
fn doorbell_room(fd: c_int, backlog: c_int) {
    if backlog < 0 {
        // The most the kernel allows already.
        return;
    }
    let room = backlog.saturating_mul(2).saturating_add(1);
    // SAFETY: plain fd call on the application's listening socket.
    unsafe { real::listen(fd, room) };
}

unsafe fn accept_common(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    let l = match (!internal()).then(|| table::get(fd)).flatten() {
        Some(s) if matches!(*s, Sock::Listener(_)) => s,
        _ => {
            // SAFETY: forwards the caller's arguments.
            return unsafe { real::accept4(fd, addr, len, flags) };
        }
    };
    let Sock::Listener(l) = &*l else {
        unreachable!()
    };
    if l.sdp_turned_off() {
        log(format_args!(
            "listen fd {fd}: its last {} accepted connections went on in other processes (fork): \
             pumped through the kernel, slower than TCP; new clients go by kernel TCP",
            app::FORK_HANDED
        ));
    }
    {
        // An accept of a shared listener waits for its clients ready to answer them.
        let _g = Internal::enter();
        l.prepare_accept();
    }
    loop {
        if !limits::room_for_accept(fd) {
            set_errno(libc::EMFILE);
            return -1;
        }
        // SAFETY: zeroed storage is valid; the kernel fills in at most its size.
        let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut sl = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
        let mark = fd_limit::LowMark::now();
        // SAFETY: our own storage and length.
        let c = unsafe {
            real::accept4(
                fd,
                (&mut ss as *mut libc::sockaddr_storage).cast(),
                &mut sl,
                flags,
            )
        };
        if c < 0 {
            return c;
        }
        let c = fd_limit::app_number(c, mark, flags & libc::SOCK_CLOEXEC != 0);
        let peer = app::from_sockaddr(&ss);
        if let Some(claim) = peer.and_then(|p| l.claim_doorbell(p)) {
            let taken = {
                let _g = Internal::enter();
                l.take_claimed(
                    claim,
                    flags & libc::SOCK_NONBLOCK != 0,
                    flags & libc::SOCK_CLOEXEC != 0,
                )
            };
            let doorbell = || {
                // SAFETY: `c` was just returned by accept and is ours.
                AppListener::close_doorbell(unsafe {
                    <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(c)
                })
            };
            match taken {
                Some(Ok((s, user, peer))) => {
                    // The doorbell's own address is the connection's (a connection reset
                    // before this accept has none any more; TCP's getsockname still answers).
                    let bell_local = kernel_sockname(c);
                    let nfd = onto_doorbell(user, c, flags & libc::SOCK_CLOEXEC != 0);
                    // An AF_INET6 listener's IPv4 clients show v4-mapped, as the kernel's.
                    let v6 =
                        kernel_int(fd, libc::SOL_SOCKET, libc::SO_DOMAIN) == Some(libc::AF_INET6);
                    let peer = Opts::shown(v6, Some(peer)).unwrap_or(peer);
                    if v6 {
                        s.set_v6_socket();
                    }
                    let mut opts = Opts {
                        role: "server",
                        local: Opts::shown(v6, s.local_addr().ok().or(bell_local)),
                        peer: Some(peer),
                        v6,
                        ..Opts::default()
                    };
                    // What an accepted socket inherits from its listener on Linux.
                    carry_from(fd, &s, nfd, &mut opts);
                    table::inherit_buffers(fd, nfd);
                    if !table::insert(nfd, Arc::new(Sock::Stream(s, table::OptsLock::new(opts)))) {
                        // An fd number the table cannot hold: the stream cannot be served.
                        // SAFETY: our own fd.
                        unsafe { real::close(nfd) };
                        continue;
                    }
                    log(format_args!("accept fd {fd}: {peer} over sdp as fd {nfd}"));
                    share_for_stdio(nfd, "accept");
                    // SAFETY: the caller's buffers.
                    unsafe { put_sockaddr(peer, addr, len) };
                    return nfd;
                }
                Some(Err(e)) if is_exhaustion(&e) => {
                    // As TCP's accept: the error, the connection left for a later accept.
                    doorbell();
                    log(format_args!("accept fd {fd}: {e}"));
                    set_errno(e.raw_os_error().unwrap_or(libc::ENOMEM));
                    return -1;
                }
                // Its client went to kernel TCP instead: its connection is in the queue or
                // on its way.
                None => {
                    doorbell();
                    continue;
                }
                // Our side could not take it: its client, not answered, goes to kernel TCP
                // after its wait and comes again there.
                Some(Err(e)) if !app::is_gone_before_accept(&e) => {
                    doorbell();
                    log(format_args!(
                        "accept fd {fd}: an SDP connection failed: {e}"
                    ));
                    continue;
                }
                // The client went away before it was accepted: TCP's accept hands such a
                // connection out (its client's end read), never waits for the next client.
                // (A connection queued behind it is taken instead.)
                Some(Err(e)) => {
                    if poll_ready(fd) {
                        doorbell();
                        continue;
                    }
                    if let Some(p) = peer {
                        // SAFETY: the caller's buffers.
                        unsafe { put_sockaddr(p, addr, len) };
                    }
                    return gone_before_accept(fd, c, peer, e);
                }
            }
        }
        if let Some(p) = peer {
            // SAFETY: the caller's buffers.
            unsafe { put_sockaddr(p, addr, len) };
        }
        {
            // A kernel TCP client: SDP listeners whose device went away listen again once
            // it is back (clients fell back to TCP meanwhile).
            let _g = Internal::enter();
            l.maintain();
        }
        report::tcp_server(c, peer, "the client connected over kernel TCP");
        return c;
    }
}

/// The accepted SDP stream's fd `user` takes the number of the doorbell `c` it was announced
/// by (the number TCP's accept would have returned), the doorbell closed by reset (no
/// TIME_WAIT); if that cannot be done, the doorbell closes and the stream keeps its own.
fn onto_doorbell(user: OwnedFd, c: c_int, cloexec: bool) -> c_int {
    AppListener::doorbell_resets(c);
    let flags = if cloexec { libc::O_CLOEXEC } else { 0 };
    // SAFETY: both fds are ours; dup3 closes the doorbell in the same step.
    if unsafe { real::dup3(std::os::fd::AsRawFd::as_raw_fd(&user), c, flags) } == c {
        drop(user);
        return c;
    }
    // SAFETY: `c` is ours and nothing else holds it.
    AppListener::close_doorbell(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(c) });
    user.into_raw_fd()
}

/// Whether listening `fd` has a connection to accept right now.
fn poll_ready(fd: c_int) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    unsafe { real::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
}

/// Errors of accept that leave the connection queued (TCP's accept gives them too).
fn is_exhaustion(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// An SDP client whose doorbell listener `fd` accepted as `c` went away before it was
/// accepted (killed; its connection failed or timed out in the queue), its connection gone
/// with it: hand out the doorbell itself, its reading side shut (reads end at once, as a TCP
/// connection whose client closed), where TCP's accept would hand out the dead client's
/// connection.
fn gone_before_accept(fd: c_int, c: c_int, peer: Option<SocketAddr>, e: std::io::Error) -> c_int {
    log(format_args!(
        "accept fd {fd}: an SDP client went away before accept ({e}): fd {c} reads its end"
    ));
    // SAFETY: `c` is the connection just accepted, ours until returned.
    unsafe { real::shutdown(c, libc::SHUT_RD) };
    report::tcp_server(c, peer, "the SDP client went away before accept");
    c
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if !table::owned(fd) {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::accept(fd, addr, len) };
    }
    // SAFETY: forwards the caller's arguments.
    keeping_errno(|| unsafe { accept_common(fd, addr, len, 0) })
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    if !table::owned(fd) {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::accept4(fd, addr, len, flags) };
    }
    // SAFETY: forwards the caller's arguments.
    keeping_errno(|| unsafe { accept_common(fd, addr, len, flags) })
}

// ---------------------------------------------------------------------------------------------
// close and the dup family

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    fd_limit::closing(fd);
    if table::owned(fd) && !internal() {
        return close_owned(fd);
    }
    if report::tcp_watched(fd) && !internal() {
        report::tcp_closing(fd);
    }
    // SAFETY: forwards the caller's argument.
    unsafe { real::close(fd) }
}

/// close(2) of an fd the shim owns.
pub(crate) fn close_owned(fd: c_int) -> c_int {
    let s = table::remove(fd);
    before_last_close(fd, s.as_ref());
    // SAFETY: an fd of the application's, which it closes.
    let r = unsafe { real::close(fd) };
    // The connection ends when its last fd in this process is gone (the Arc's last clone).
    let _g = Internal::enter();
    drop(s);
    r
}

/// `fd` is about to close and `s` (just taken out of the table) was its socket: if that was
/// this process's last fd of a stream a fork exposed, let the stream tell at the close whether
/// another process still holds the file (`AppStream::before_last_close`).
fn before_last_close(fd: c_int, s: Option<&Arc<Sock>>) {
    if let Some(s) = s.filter(|s| Arc::strong_count(s) == 1) {
        last_close(fd, s);
    }
}

/// `fd`, this process's last fd of `s`, is about to close (see [`before_last_close`]).
fn last_close(fd: c_int, s: &Sock) {
    if let Sock::Stream(st, _) = s {
        let _g = Internal::enter();
        st.before_last_close(fd);
    }
}

/// After a dup of `old` to `new` succeeded: `new` refers to what `old` does.
/// Nothing for the shim's own dups (its threads may hold the runtime's lock, which dropping
/// a stale entry's socket takes; a stale number is found by its file anyway).
fn dup_entry(old: c_int, new: c_int) {
    if new < 0 || new == old || internal() {
        return;
    }
    let prev = table::remove(new);
    if let Some(s) = table::get(old) {
        table::insert(new, s);
        share_for_stdio(new, "dup onto a standard stream's fd");
    }
    let _g = Internal::enter();
    drop(prev);
}

// ---------------------------------------------------------------------------------------------
// stdio

/// A stream that stdio may read or write (a `FILE` on its fd: `fdopen`, or the fds of stdin,
/// stdout and stderr, 0 to 2): glibc's stdio calls read, write and close inside libc, where no
/// hook sees them, so the stream's bytes must flow through the kernel file (shared: pumped by
/// the runtime, as for a fork child's use). Before, `fprintf` on an `fdopen`ed SDP socket wrote
/// into the readiness pair and its `fclose` left the connection open: the peer got nothing,
/// then no EOF. Nothing for fds above 2 unless `always`, and for fds that are not streams.
fn share_for_stdio_if(fd: c_int, what: &str, always: bool) {
    if !(always || (0..=2).contains(&fd)) || internal() {
        return;
    }
    let Some(s) = table::get(fd) else { return };
    if let Sock::Stream(st, _) = &*s {
        if !st.is_shared() {
            let _g = Internal::enter();
            match st.share(fd) {
                Ok(()) => log(format_args!(
                    "{what}: fd {fd} is shared for stdio, its bytes go through the kernel file"
                )),
                Err(e) => log(format_args!("{what}: fd {fd} cannot be shared: {e}")),
            }
        }
    }
}

/// [`share_for_stdio_if`] for fds 0 to 2.
fn share_for_stdio(fd: c_int, what: &str) {
    share_for_stdio_if(fd, what, false);
}

/// fdopen(3): a `FILE` on a stream (see `share_for_stdio_if`).
///
/// # Safety
/// As `fdopen(3)`.
#[no_mangle]
pub unsafe extern "C" fn fdopen(fd: c_int, mode: *const libc::c_char) -> *mut libc::FILE {
    if table::owned(fd) {
        // glibc's fclose, freopen and fcloseall close the fd inside libc, where no hook sees
        // it: from now on calls check that their number still names the socket's file.
        table::check_identities();
        share_for_stdio_if(fd, "fdopen", true);
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::fdopen(fd, mode) }
}

// dprintf and its kin: C-variadic (or taking a va_list), so C (src/stdio.c); the symbols are
// jumps to it, as for execl (exec.rs).
extern "C" {
    fn sdp_dprintf();
    fn sdp_dprintf_chk();
    fn sdp_vdprintf();
    fn sdp_vdprintf_chk();
}
variadic_jump!(dprintf, sdp_dprintf);
variadic_jump!(__dprintf_chk, sdp_dprintf_chk);
variadic_jump!(vdprintf, sdp_vdprintf);
variadic_jump!(__vdprintf_chk, sdp_vdprintf_chk);

// syscall and clone: C-variadic too (src/syscall.c): a process they make that copies ours runs
// the fork handlers.
extern "C" {
    fn sdp_syscall();
    fn sdp_clone();
}
variadic_jump!(syscall, sdp_syscall);
variadic_jump!(clone, sdp_clone);

/// For src/stdio.c (`dprintf` and its kin): whether the shim owns `fd`, so that the formatted
/// bytes go through the shim's `write` rather than libc's internal one.
#[no_mangle]
pub extern "C" fn sdp_preload_owns(fd: c_int) -> c_int {
    (table::owned(fd) && !internal()) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: forwards the caller's argument.
    let n = unsafe { real::dup(fd) };
    if table::owned(fd) && n >= 0 {
        dup_entry(fd, n);
    } else {
        tcp_dup_over(fd, n);
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    let closing = before_dup_over(old, new);
    // SAFETY: forwards the caller's arguments.
    let n = unsafe { real::dup2(old, new) };
    if n >= 0 && (table::owned(old) || table::owned(new)) {
        dup_entry(old, n);
    }
    tcp_dup_over(old, n);
    drop_internal(closing);
    n
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    let closing = before_dup_over(old, new);
    // SAFETY: forwards the caller's arguments.
    let n = unsafe { real::dup3(old, new, flags) };
    if n >= 0 && (table::owned(old) || table::owned(new)) {
        dup_entry(old, n);
    }
    tcp_dup_over(old, n);
    drop_internal(closing);
    n
}

/// After a dup of `old` (dup, dup2, dup3, F_DUPFD) gave `n` (-1: it failed): a kernel TCP
/// socket's report line follows the socket to its duplicate.
fn tcp_dup_over(old: c_int, n: c_int) {
    if n >= 0 && old != n && report::tcp_watched(old) && !internal() {
        report::tcp_dup(old, n);
    }
}

/// A dup of `old` onto `new` is about to close `new` (if the dup can succeed: `old` open, not
/// `new` itself), as close would: a socket of ours is taken out of the table first
/// (`before_last_close`) and returned to be dropped after the dup; a kernel TCP socket's
/// report line gets its counts now.
fn before_dup_over(old: c_int, new: c_int) -> Option<Arc<Sock>> {
    let ours = table::owned(new);
    if old == new || !(ours || report::tcp_watched(new)) || internal() {
        return None;
    }
    // SAFETY: F_GETFD on an fd number: no memory is passed.
    if unsafe { real::fcntl(old, libc::F_GETFD, 0) } < 0 {
        return None;
    }
    if !ours {
        report::tcp_closing(new);
        return None;
    }
    let s = table::remove(new);
    before_last_close(new, s.as_ref());
    s
}

/// A hook whose fd the shim may own: `$owned` (out of line) for an fd it owns, else straight to
/// libc's function of the same name (one load and a jump: see [`data`]). The first argument is
/// the fd.
macro_rules! owned_or_libc {
    (fn $name:ident($fd:ident: $fty:ty $(, $arg:ident: $ty:ty)*) -> $ret:ty => $owned:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name($fd: $fty $(, $arg: $ty)*) -> $ret {
            if table::owned($fd) {
                // SAFETY: the caller's arguments.
                return unsafe { $owned($fd $(, $arg)*) };
            }
            // SAFETY: forwards the caller's arguments.
            unsafe { real::$name($fd $(, $arg)*) }
        }
    };
}

/// [`fcntl`] on an fd the shim owns (out of line: the hook's way to libc sets up no frame).
#[inline(never)]
unsafe fn fcntl_owned(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    // SAFETY: forwards the caller's arguments.
    fcntl_done(fd, cmd, arg, unsafe { real::fcntl(fd, cmd, arg) })
}

/// [`fcntl64`] on an fd the shim owns.
#[inline(never)]
unsafe fn fcntl64_owned(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    // SAFETY: forwards the caller's arguments.
    fcntl_done(fd, cmd, arg, unsafe { real::fcntl64(fd, cmd, arg) })
}

/// After libc's fcntl on an owned fd returned `r`: a dup's table entry, edges for O_ASYNC.
fn fcntl_done(fd: c_int, cmd: c_int, arg: usize, r: c_int) -> c_int {
    if internal() {
        return r;
    }
    if r >= 0 && (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) {
        dup_entry(fd, r);
    }
    if r >= 0 && cmd == libc::F_SETFL && arg & libc::O_ASYNC as usize != 0 {
        // SIGIO per arrival, as TCP's.
        want_edges(fd);
    }
    r
}

/// `fcntl`/`fcntl64`: an fd the shim owns goes out of line; so does F_DUPFD of a kernel TCP
/// socket whose report line waits (the line follows the dup); the rest straight to libc.
macro_rules! fcntl_hook {
    ($name:ident, $owned:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(fd: c_int, cmd: c_int, arg: usize) -> c_int {
            if table::owned(fd) {
                // SAFETY: the caller's arguments.
                return unsafe { $owned(fd, cmd, arg) };
            }
            if (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) && report::tcp_watched(fd) {
                // SAFETY: forwards the caller's arguments.
                let r = unsafe { real::$name(fd, cmd, arg) };
                tcp_dup_over(fd, r);
                return r;
            }
            // SAFETY: forwards the caller's arguments.
            unsafe { real::$name(fd, cmd, arg) }
        }
    };
}

fcntl_hook!(fcntl, fcntl_owned);
fcntl_hook!(fcntl64, fcntl64_owned);

// ---------------------------------------------------------------------------------------------
// Reads and writes

/// The SDP stream behind `fd`, if the shim serves calls on it.
fn stream(fd: c_int) -> Option<Arc<Sock>> {
    if internal() {
        return None;
    }
    table::get(fd).filter(|s| s.stream_parts().is_some())
}

/// The SDP stream behind `fd` if its bytes are the shim's to move: not once the fd is shared
/// with another process (then they flow through the kernel file and libc's calls serve).
/// Inlined: for an fd the shim does not own the hook is one load and a tail call into libc.
#[inline(always)]
fn data(fd: c_int) -> Option<Arc<Sock>> {
    if !table::owned(fd) {
        return None;
    }
    data_owned(fd)
}

/// [`data`] for an fd the shim owns (out of line: the hooks' path for other fds stays a load
/// and a tail call). In a fork child, the first such call on a stream it inherited asks the
/// owning process to share it (until then the owner moves its bytes at full speed), and the
/// call goes to the kernel file.
#[inline(never)]
fn data_owned(fd: c_int) -> Option<Arc<Sock>> {
    let s = stream(fd)?;
    match &*s {
        Sock::Stream(st, _) if !st.is_shared() => {
            if !st.is_inherited() {
                return Some(s);
            }
            let _g = Internal::enter();
            match st.share(fd) {
                Ok(()) => log(format_args!(
                    "fd {fd}: inherited stream shared by its owner, its bytes go through the kernel file"
                )),
                Err(e) => log(format_args!(
                    "fd {fd}: the process owning this inherited stream could not share it: {e}"
                )),
            }
            None
        }
        _ => None,
    }
}

fn do_read(s: &Sock, fd: c_int, buf: &mut [u8], flags: c_int) -> ssize_t {
    let Sock::Stream(st, _) = s else {
        unreachable!()
    };
    if flags & libc::MSG_OOB != 0 {
        if buf.is_empty() {
            return 0;
        }
        let _g = Internal::enter();
        return match st.read_urgent(fd, flags & libc::MSG_PEEK != 0) {
            Ok(b) => {
                buf[0] = b;
                1
            }
            Err(e) => fail(&e),
        };
    }
    let f = ReadFlags {
        peek: flags & libc::MSG_PEEK != 0,
        waitall: flags & libc::MSG_WAITALL != 0,
        dontwait: flags & libc::MSG_DONTWAIT != 0,
    };
    let _g = Internal::enter();
    match st.read(fd, buf, f) {
        Ok(n) => n as ssize_t,
        // Another process's request shared it during the call: its bytes are in the file now.
        // SAFETY: the caller's buffer.
        Err(e) if app::is_shared_now(&e) => unsafe {
            real::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags)
        },
        Err(e) => fail(&e),
    }
}

/// Whether a receive's flags ask TCP's MSG_TRUNC: the bytes are taken (with MSG_PEEK, looked
/// at) but not copied, and their count returned; the buffer is not touched (it may be NULL).
fn wants_trunc(flags: c_int) -> bool {
    flags & (libc::MSG_TRUNC | libc::MSG_OOB) == libc::MSG_TRUNC
}

/// Largest piece a MSG_TRUNC receive takes at a time (through the staging buffer).
const TRUNC_CHUNK: usize = 64 * 1024;

/// A receive of up to `n` bytes with MSG_TRUNC on the stream `s` ([`wants_trunc`]): what a
/// read would take, taken into the thread's staging buffer and dropped. One read, as TCP's
/// (a short count), except with MSG_WAITALL, which takes `n` unless the stream ends or fails.
fn do_read_trunc(s: &Sock, fd: c_int, n: usize, flags: c_int) -> ssize_t {
    let flags = flags & !libc::MSG_TRUNC;
    if n == 0 {
        return 0;
    }
    with_stage(n.min(TRUNC_CHUNK), |buf| {
        let mut done = 0usize;
        loop {
            let want = (n - done).min(buf.len());
            let r = do_read(s, fd, &mut buf[..want], flags);
            if r <= 0 {
                return if done > 0 { done as ssize_t } else { r };
            }
            done += r as usize;
            if flags & libc::MSG_WAITALL == 0 || flags & libc::MSG_PEEK != 0 || done >= n {
                return done as ssize_t;
            }
        }
    })
}

fn do_write(s: &Sock, fd: c_int, buf: &[u8], flags: c_int) -> ssize_t {
    let Sock::Stream(st, _) = s else {
        unreachable!()
    };
    let r = {
        let _g = Internal::enter();
        if flags & libc::MSG_OOB != 0 {
            st.write_urgent(fd, buf, flags & libc::MSG_DONTWAIT != 0)
        } else {
            st.write(fd, buf, flags & libc::MSG_DONTWAIT != 0)
        }
    };
    match r {
        Ok(n) => n as ssize_t,
        // Another process's request shared it during the call: write the file.
        // SAFETY: the caller's buffer.
        Err(e) if app::is_shared_now(&e) => unsafe {
            real::send(fd, buf.as_ptr().cast(), buf.len(), flags)
        },
        Err(e) => {
            if errno_of(&e) == libc::EPIPE && flags & libc::MSG_NOSIGNAL == 0 {
                // SAFETY: raising a signal in the calling thread, as the kernel does for TCP.
                unsafe { libc::raise(libc::SIGPIPE) };
            }
            fail(&e)
        }
    }
}

/// The caller's `cnt` iovecs; EINVAL (and `None`) for a count outside 0..=UIO_MAXIOV, as the
/// kernel.
unsafe fn iov_slice<'a>(iov: *const iovec, cnt: c_int) -> Option<&'a [iovec]> {
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) {
        set_errno(libc::EINVAL);
        return None;
    }
    if cnt == 0 || iov.is_null() {
        return Some(&[]);
    }
    // SAFETY: the caller passes `cnt` iovecs.
    Some(unsafe { std::slice::from_raw_parts(iov, cnt as usize) })
}

/// Scatter reads over `iov` as readv/recvmsg do: later buffers only while data is there.
unsafe fn read_iov(s: &Sock, fd: c_int, iov: *const iovec, cnt: c_int, flags: c_int) -> ssize_t {
    // SAFETY: the caller's iovecs.
    let Some(iovs) = (unsafe { iov_slice(iov, cnt) }) else {
        return -1;
    };
    let mut total: ssize_t = 0;
    for v in iovs {
        if v.iov_len == 0 {
            continue;
        }
        // SAFETY: each iovec describes the caller's writable buffer.
        let buf = unsafe { std::slice::from_raw_parts_mut(v.iov_base.cast::<u8>(), v.iov_len) };
        let f = if total > 0 {
            flags | libc::MSG_DONTWAIT
        } else {
            flags
        };
        let n = do_read(s, fd, buf, f);
        if n < 0 {
            return if total > 0 { total } else { n };
        }
        total += n;
        if (n as usize) < v.iov_len || flags & libc::MSG_PEEK != 0 {
            break;
        }
    }
    total
}

/// Gather writes from `iov` in order, as writev/sendmsg do.
unsafe fn write_iov(s: &Sock, fd: c_int, iov: *const iovec, cnt: c_int, flags: c_int) -> ssize_t {
    // SAFETY: the caller's iovecs.
    let Some(iovs) = (unsafe { iov_slice(iov, cnt) }) else {
        return -1;
    };
    let mut total: ssize_t = 0;
    for v in iovs {
        if v.iov_len == 0 {
            continue;
        }
        // SAFETY: each iovec describes the caller's readable buffer.
        let buf = unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len) };
        let n = do_write(
            s,
            fd,
            buf,
            flags | if total > 0 { libc::MSG_NOSIGNAL } else { 0 },
        );
        if n < 0 {
            return if total > 0 { total } else { n };
        }
        total += n;
        if (n as usize) < v.iov_len {
            break;
        }
    }
    total
}

/// The caller's buffer as a slice (EFAULT for a null pointer with a length, as the kernel).
unsafe fn buf_mut<'a>(p: *mut c_void, n: size_t) -> Option<&'a mut [u8]> {
    if n == 0 {
        return Some(&mut []);
    }
    if p.is_null() {
        set_errno(libc::EFAULT);
        return None;
    }
    // SAFETY: the caller passes a writable buffer of `n` bytes.
    Some(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), n) })
}

unsafe fn buf_ref<'a>(p: *const c_void, n: size_t) -> Option<&'a [u8]> {
    if n == 0 {
        return Some(&[]);
    }
    if p.is_null() {
        set_errno(libc::EFAULT);
        return None;
    }
    // SAFETY: the caller passes a readable buffer of `n` bytes.
    Some(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n) })
}

owned_or_libc! { fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t => read_owned }

/// [`read`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn read_owned(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    if let Some(s) = data_owned(fd) {
        // SAFETY: the caller's buffer.
        return match unsafe { buf_mut(buf, n) } {
            Some(b) => do_read(&s, fd, b, 0),
            None => -1,
        };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::read(fd, buf, n) }
}

// Event waits: the kernel answers them on the real fds; while the process has SDP streams they
// poll before they sleep (`app::poll_events`). Not for the shim's own threads and calls.

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    // SAFETY: forwards the caller's arguments.
    let r = unsafe { real::epoll_ctl(epfd, op, fd, ev) };
    if r == 0 && op != libc::EPOLL_CTL_DEL && !ev.is_null() {
        // SAFETY: the kernel just read the caller's event.
        if unsafe { (*ev).events } & libc::EPOLLET as u32 != 0 && !internal() {
            edge_watch(fd);
        }
    }
    // Only fresh sockets' and listeners' registrations need anything (a stream's need no
    // look: an event loop that changes them per request, as redis-benchmark's five times,
    // paid a table look each).
    if r == 0 && table::owned_other(fd) && !internal() {
        // SAFETY: the kernel just read the caller's event (EPOLL_CTL_DEL may pass none).
        let e = (op != libc::EPOLL_CTL_DEL && !ev.is_null()).then(|| unsafe { *ev });
        note_epoll(epfd, op, fd, e);
    }
    r
}

/// `fd` was registered edge-triggered in an epoll set: a stream's fd must see an edge per
/// arrival (`AppStream::want_edges`); an epoll set's (nested sets: the outer one's edges come
/// from the inner one's wakeups), every stream's, from now on.
fn edge_watch(fd: c_int) {
    if table::owned(fd) {
        want_edges(fd);
    } else if table::is_epoll(fd) {
        table::want_all_edges();
    }
}

/// The stream at `fd`, if any, must show an edge per arrival (`AppStream::want_edges`).
fn want_edges(fd: c_int) {
    if let Some(s) = table::get(fd) {
        s.want_edges();
    }
}

/// epoll_create(2): its fd noted as an epoll set's (see `edge_watch`).
#[no_mangle]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    // SAFETY: forwards the caller's argument.
    let fd = unsafe { real::epoll_create(size) };
    table::note_epoll_fd(fd);
    fd
}

/// epoll_create1(2): as [`epoll_create`].
#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: forwards the caller's argument.
    let fd = unsafe { real::epoll_create1(flags) };
    table::note_epoll_fd(fd);
    fd
}

/// A fresh socket's epoll registration made, changed or taken away (see `Opts::epoll`); a
/// shared listener registered gets this process ready to answer its clients.
fn note_epoll(epfd: c_int, op: c_int, fd: c_int, ev: Option<libc::epoll_event>) {
    let Some(s) = table::get(fd) else { return };
    if let Sock::Listener(l) = &*s {
        if op == libc::EPOLL_CTL_ADD {
            let _g = Internal::enter();
            l.prepare_accept();
        }
        return;
    }
    let Sock::Fresh(o) = &*s else { return };
    let mut o = o.lock();
    o.epoll.retain(|w| !(w.epfd == epfd && w.fd == fd));
    if let (Some(e), true) = (ev, op != libc::EPOLL_CTL_DEL) {
        o.epoll.push(table::EpollWatch {
            epfd,
            fd,
            events: e.events,
            data: e.u64,
        });
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    if !app::event_waits_poll() || internal() {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::epoll_wait(epfd, ev, max, timeout) };
    }
    // SAFETY: forwards the caller's arguments.
    app::poll_events(timeout, |t| unsafe { real::epoll_wait(epfd, ev, max, t) })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    if !app::event_waits_poll() || internal() {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::epoll_pwait(epfd, ev, max, timeout, mask) };
    }
    // SAFETY: the caller's arguments, as epoll_pwait takes them.
    unsafe { wait::epoll_pwait(epfd, ev, max, timeout, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if !app::event_waits_poll() || internal() {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::epoll_pwait2(epfd, ev, max, ts, mask) };
    }
    // SAFETY: the caller's arguments, as epoll_pwait2 takes them.
    unsafe { wait::epoll_pwait2(epfd, ev, max, ts, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    if !app::event_waits_poll() || internal() {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::poll(fds, n, timeout) };
    }
    // SAFETY: forwards the caller's arguments.
    app::poll_events(timeout, |t| unsafe { real::poll(fds, n, t) })
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if !app::event_waits_poll() || internal() {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::ppoll(fds, n, ts, mask) };
    }
    // SAFETY: the caller's arguments, as ppoll takes them.
    unsafe { wait::ppoll(fds, n, ts, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    if !app::event_waits_poll() || internal() {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::select(nfds, r, w, e, tv) };
    }
    // SAFETY: the caller's arguments, as select takes them.
    unsafe { wait::select(nfds, r, w, e, tv) }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if !app::event_waits_poll() || internal() {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::pselect(nfds, r, w, e, ts, mask) };
    }
    // SAFETY: the caller's arguments, as pselect takes them.
    unsafe { wait::pselect(nfds, r, w, e, ts, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: c_int,
    len: size_t,
) -> c_int {
    if (len / std::mem::size_of::<libc::pollfd>()) < n as usize {
        // SAFETY: the real checker reports the overflow.
        return unsafe { real::__poll_chk(fds, n, timeout, len) };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: the real checker reports the overflow.
        return unsafe { real::__read_chk(fd, buf, n, buflen) };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { read(fd, buf, n) }
}

owned_or_libc! {
    fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t => recv_owned
}

/// [`recv`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn recv_owned(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    if let Some(s) = data_owned(fd) {
        if wants_trunc(flags) {
            return do_read_trunc(&s, fd, n, flags);
        }
        // SAFETY: the caller's buffer.
        return match unsafe { buf_mut(buf, n) } {
            Some(b) => do_read(&s, fd, b, flags),
            None => -1,
        };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::recv(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if n > buflen {
        // SAFETY: the real checker reports the overflow.
        return unsafe { real::__recv_chk(fd, buf, n, buflen, flags) };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { recv(fd, buf, n, flags) }
}

owned_or_libc! {
    fn recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr,
        len: *mut socklen_t) -> ssize_t => recvfrom_owned
}

/// [`recvfrom`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn recvfrom_owned(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if let Some(s) = data_owned(fd) {
        let r = if wants_trunc(flags) {
            do_read_trunc(&s, fd, n, flags)
        } else {
            // SAFETY: the caller's buffer.
            match unsafe { buf_mut(buf, n) } {
                Some(b) => do_read(&s, fd, b, flags),
                None => -1,
            }
        };
        if r >= 0 && !addr.is_null() && !len.is_null() {
            // A connected stream socket reports no source address.
            // SAFETY: the caller's length pointer.
            unsafe { *len = 0 };
        }
        return r;
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::recvfrom(fd, buf, n, flags, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: the real checker reports the overflow.
        return unsafe { real::__recvfrom_chk(fd, buf, n, buflen, flags, addr, len) };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { recvfrom(fd, buf, n, flags, addr, len) }
}

owned_or_libc! { fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t => readv_owned }

/// [`readv`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn readv_owned(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    if let Some(s) = data_owned(fd) {
        // SAFETY: the caller's iovecs.
        return unsafe { read_iov(&s, fd, iov, cnt, 0) };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::readv(fd, iov, cnt) }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    if table::owned(fd) {
        // SAFETY: the caller's arguments.
        return unsafe { recvmsg_owned(fd, msg, flags) };
    }
    // SAFETY: forwards the caller's arguments.
    let r = unsafe { real::recvmsg(fd, msg, flags) };
    // SAFETY: after a successful recvmsg the kernel wrote the caller's msghdr.
    if r >= 0 && unsafe { (*msg).msg_controllen } != 0 {
        // SAFETY: as above; its control buffer holds what the kernel wrote.
        unsafe { adopt_passed(msg) };
    }
    r
}

/// fds a message received by SCM_RIGHTS (`msg`, the kernel's answer) that are SDP streams
/// another process shared (`app::shared_stream_addrs`): answered as the TCP sockets they
/// stand for from now on, as an exec'd program's inherited ones (`exec::adopt_identity`);
/// their bytes go through the kernel file, pumped by their owner. Before, such a receiver
/// (multiprocessing's `send_handle`, fd-passing servers) saw an AF_UNIX socket: no peer
/// address, SO_DOMAIN 1, TCP_NODELAY refused.
///
/// # Safety
/// `msg` is a msghdr a successful recvmsg filled in.
#[inline(never)]
unsafe fn adopt_passed(msg: *const msghdr) {
    if internal() || !enabled() {
        return;
    }
    // SAFETY: the caller's promise.
    let m = unsafe { &*msg };
    if m.msg_control.is_null() {
        return;
    }
    // SAFETY: the kernel wrote `msg_controllen` bytes of control data there.
    let ctl = unsafe { std::slice::from_raw_parts(m.msg_control as *const u8, m.msg_controllen) };
    for fd in scm_rights_fds(ctl) {
        if table::owned(fd) {
            continue;
        }
        if let Some((local, peer)) = app::shared_stream_addrs(fd) {
            exec::adopt_identity(fd, local, peer, "SCM_RIGHTS");
        }
    }
}

/// The fds of the SCM_RIGHTS messages in control data `ctl`. Walked with checked indexing
/// rather than CMSG_NXTHDR: the lengths may be an application's, and libc's macro adds a huge
/// one without a check.
fn scm_rights_fds(ctl: &[u8]) -> Vec<c_int> {
    let hdr = std::mem::size_of::<libc::cmsghdr>();
    let mut off = 0;
    let mut fds = Vec::new();
    while off + hdr <= ctl.len() {
        // SAFETY: `hdr` bytes at `off` are in `ctl`; read unaligned.
        let c: libc::cmsghdr = unsafe { std::ptr::read_unaligned(ctl[off..].as_ptr().cast()) };
        let len = c.cmsg_len as usize;
        if len < hdr || len > ctl.len() - off {
            break;
        }
        if c.cmsg_level == libc::SOL_SOCKET && c.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN(0) is arithmetic.
            let data = off + unsafe { libc::CMSG_LEN(0) } as usize;
            for f in ctl[data.min(off + len)..off + len].chunks_exact(4) {
                fds.push(c_int::from_ne_bytes([f[0], f[1], f[2], f[3]]));
            }
        }
        // Each header padded to the word size.
        off += (len + std::mem::size_of::<usize>() - 1) & !(std::mem::size_of::<usize>() - 1);
    }
    fds
}

/// [`recvmsg`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn recvmsg_owned(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    if let Some(s) = data_owned(fd) {
        if msg.is_null() {
            set_errno(libc::EFAULT);
            return -1;
        }
        // SAFETY: the caller's msghdr.
        let m = unsafe { &mut *msg };
        let r = if wants_trunc(flags) {
            // SAFETY: the caller's iovecs (their lengths only).
            match unsafe { iov_slice(m.msg_iov, m.msg_iovlen as c_int) } {
                Some(v) => do_read_trunc(&s, fd, v.iter().map(|v| v.iov_len).sum(), flags),
                None => -1,
            }
        } else {
            // SAFETY: the caller's iovecs.
            unsafe { read_iov(&s, fd, m.msg_iov, m.msg_iovlen as c_int, flags) }
        };
        if r >= 0 {
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
        }
        return r;
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::recvmsg(fd, msg, flags) }
}

owned_or_libc! { fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t => write_owned }

/// [`write`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn write_owned(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    if let Some(s) = data_owned(fd) {
        // SAFETY: the caller's buffer.
        return match unsafe { buf_ref(buf, n) } {
            Some(b) => do_write(&s, fd, b, 0),
            None => -1,
        };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::write(fd, buf, n) }
}

owned_or_libc! {
    fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t => send_owned
}

/// [`send`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn send_owned(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    if let Some(s) = data_owned(fd) {
        // SAFETY: the caller's buffer.
        return match unsafe { buf_ref(buf, n) } {
            Some(b) => do_write(&s, fd, b, flags),
            None => -1,
        };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::send(fd, buf, n, flags) }
}

owned_or_libc! {
    fn sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr,
        len: socklen_t) -> ssize_t => sendto_owned
}

/// [`sendto`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn sendto_owned(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    if let Some(s) = data_owned(fd) {
        // A connected stream socket ignores the address, as TCP does.
        // SAFETY: the caller's buffer.
        return match unsafe { buf_ref(buf, n) } {
            Some(b) => do_write(&s, fd, b, flags),
            None => -1,
        };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::sendto(fd, buf, n, flags, addr, len) }
}

owned_or_libc! { fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t => writev_owned }

/// [`writev`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn writev_owned(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    if let Some(s) = data_owned(fd) {
        // SAFETY: the caller's iovecs.
        return unsafe { write_iov(&s, fd, iov, cnt, 0) };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::writev(fd, iov, cnt) }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    if table::owned(fd) {
        // SAFETY: the caller's arguments.
        return unsafe { sendmsg_owned(fd, msg, flags) };
    }
    if app::event_waits_poll() && !internal() {
        share_passed(msg);
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::sendmsg(fd, msg, flags) }
}

/// SDP streams passed to another process (SCM_RIGHTS in `msg`) are shared first: the receiver
/// reads and writes the kernel file, which the owner then pumps (node's cluster module hands
/// each accepted connection to a worker so, then closes its copy). The message is read from
/// our own memory by system call, so a bad pointer gets the kernel's EFAULT from sendmsg, not
/// a crash here; only in a process with SDP streams.
#[inline(never)]
fn share_passed(msg: *const msghdr) {
    // SAFETY: all-zero is a valid msghdr to overwrite.
    let mut m: msghdr = unsafe { std::mem::zeroed() };
    if !read_own(msg as usize, &mut m) || m.msg_control.is_null() || m.msg_controllen == 0 {
        return;
    }
    let mut ctl = vec![0u8; (m.msg_controllen as usize).min(64 * 1024)];
    if !read_own(m.msg_control as usize, &mut ctl[..]) {
        return;
    }
    for fd in scm_rights_fds(&ctl) {
        if let Some(s) = table::owned(fd).then(|| stream(fd)).flatten() {
            if let Sock::Stream(st, _) = &*s {
                let _g = Internal::enter();
                share_stream("SCM_RIGHTS", fd, st);
            }
        }
    }
}

/// Copy `out.len()` bytes of our own memory at `addr` into `out` by system call (a bad address
/// is an error, not a fault).
fn read_own<T: ?Sized>(addr: usize, out: &mut T) -> bool {
    let n = std::mem::size_of_val(out);
    if addr == 0 || n == 0 {
        return false;
    }
    let local = libc::iovec {
        iov_base: (out as *mut T).cast(),
        iov_len: n,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: n,
    };
    // SAFETY: our own buffer of `n` bytes; the kernel checks the other side.
    let r = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    r == n as isize
}

/// [`sendmsg`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn sendmsg_owned(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    if let Some(s) = data_owned(fd) {
        if msg.is_null() {
            set_errno(libc::EFAULT);
            return -1;
        }
        // SAFETY: the caller's msghdr.
        let m = unsafe { &*msg };
        // SAFETY: the caller's iovecs.
        return unsafe { write_iov(&s, fd, m.msg_iov, m.msg_iovlen as c_int, flags) };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::sendmsg(fd, msg, flags) }
}

// ---------------------------------------------------------------------------------------------
// shutdown, names, options, ioctl

owned_or_libc! { fn shutdown(fd: c_int, how: c_int) -> c_int => shutdown_owned }

/// [`shutdown`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn shutdown_owned(fd: c_int, how: c_int) -> c_int {
    let raw_how = how;
    if let Some(s) = data_owned(fd) {
        let Sock::Stream(st, _) = &*s else {
            unreachable!()
        };
        let how = match how {
            libc::SHUT_RD => std::net::Shutdown::Read,
            libc::SHUT_WR => std::net::Shutdown::Write,
            libc::SHUT_RDWR => std::net::Shutdown::Both,
            _ => {
                set_errno(libc::EINVAL);
                return -1;
            }
        };
        let _g = Internal::enter();
        return match st.shutdown(fd, how) {
            Ok(()) => 0,
            // SAFETY: forwards the caller's arguments (shared during the call).
            Err(e) if app::is_shared_now(&e) => unsafe { real::shutdown(fd, raw_how) },
            Err(e) => fail(&e),
        };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::shutdown(fd, how) }
}

/// getsockname (`peer` false) or getpeername of an SDP stream, from the addresses kept when it
/// was made; `None` if `fd` is not one.
unsafe fn stream_name(
    fd: c_int,
    peer: bool,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> Option<c_int> {
    let s = table::owned(fd).then(|| stream(fd)).flatten()?;
    let Some((st, o)) = s.stream_parts() else {
        unreachable!()
    };
    // A connection that failed has no peer (ENOTCONN, as TCP's after a reset), which only
    // the runtime of the process that owns it knows.
    let failed = || {
        st.filter(|st| !st.is_inherited()).is_some_and(|st| {
            let _g = Internal::enter();
            st.peer_addr()
                .is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN))
        })
    };
    let a = if peer {
        o.lock().peer.filter(|_| !failed())
    } else {
        o.lock().local
    };
    Some(match a {
        Some(a) => {
            // SAFETY: the caller's buffers.
            unsafe { put_sockaddr(a, addr, len) };
            0
        }
        None => {
            set_errno(libc::ENOTCONN);
            -1
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: the caller's buffers, forwarded.
    unsafe { stream_name(fd, false, addr, len).unwrap_or_else(|| real::getsockname(fd, addr, len)) }
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: the caller's buffers, forwarded.
    unsafe { stream_name(fd, true, addr, len).unwrap_or_else(|| real::getpeername(fd, addr, len)) }
}

mod opts;

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if let Some(s) = table::owned(fd).then(|| stream(fd)).flatten() {
        let _g = Internal::enter();
        // SAFETY: the caller's buffers.
        return unsafe { opts::get(&s, fd, level, name, val, len) };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::getsockopt(fd, level, name, val, len) }
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if let Some(s) = table::owned(fd).then(|| stream(fd)).flatten() {
        let _g = Internal::enter();
        // SAFETY: the caller's buffers.
        return unsafe { opts::set(&s, fd, level, name, val, len) };
    }
    // SAFETY: forwards the caller's arguments.
    let r = unsafe { real::setsockopt(fd, level, name, val, len) };
    if r == 0
        && table::owned(fd)
        && level == libc::SOL_SOCKET
        && (name == libc::SO_SNDBUF || name == libc::SO_RCVBUF)
    {
        table::note_buffer_set(fd, name);
    }
    if r == 0 && table::owned(fd) && level == libc::IPPROTO_TCP && name == libc::TCP_DEFER_ACCEPT {
        if let Some(Sock::Listener(l)) = table::get(fd).as_deref() {
            // SAFETY: the kernel just read an int there.
            l.set_defer_accept(unsafe { *val.cast::<c_int>() }.max(0) as u32);
        }
    }
    r
}

owned_or_libc! { fn ioctl(fd: c_int, req: libc::c_ulong, arg: usize) -> c_int => ioctl_owned }

/// [`ioctl`] on an fd the shim owns (out of line: see [`data`]).
#[inline(never)]
unsafe fn ioctl_owned(fd: c_int, req: libc::c_ulong, arg: usize) -> c_int {
    if let Some(s) = data_owned(fd) {
        let Sock::Stream(st, _) = &*s else {
            unreachable!()
        };
        let v = match req {
            libc::FIONREAD => {
                let _g = Internal::enter();
                st.info().map(|i| i.rx_queued)
            }
            libc::TIOCOUTQ => {
                let _g = Internal::enter();
                st.info().map(|i| i.tx_queued)
            }
            SIOCATMARK => {
                let _g = Internal::enter();
                st.info().map(|i| i.at_mark as usize)
            }
            libc::FIOASYNC => {
                // SAFETY: forwards the caller's arguments.
                let r = unsafe { real::ioctl(fd, req, arg) };
                // SAFETY: FIOASYNC takes a pointer to an int, which the kernel just read.
                if r == 0
                    && !(arg as *const c_int).is_null()
                    && unsafe { *(arg as *const c_int) } != 0
                {
                    let _g = Internal::enter();
                    st.want_edges();
                }
                return r;
            }
            // FIONBIO and the rest act on the kernel file natively.
            // SAFETY: forwards the caller's arguments.
            _ => return unsafe { real::ioctl(fd, req, arg) },
        };
        return match v {
            Ok(n) => {
                let p = arg as *mut c_int;
                if p.is_null() {
                    set_errno(libc::EFAULT);
                    return -1;
                }
                // SAFETY: these requests take a pointer to an int.
                unsafe { *p = n.min(c_int::MAX as usize) as c_int };
                0
            }
            Err(e) => fail(&e),
        };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::ioctl(fd, req, arg) }
}

/// `SIOCATMARK` (linux/sockios.h), which the libc crate does not export.
const SIOCATMARK: libc::c_ulong = 0x8905;

// ---------------------------------------------------------------------------------------------
// sendfile: the kernel cannot move file pages into an SDP stream, so the shim reads the file
// and writes the stream, with sendfile's semantics (offset or file position advanced by what
// was sent).

thread_local! {
    /// sendfile's and splice's staging buffer, kept by the thread: a fresh zeroed one per call
    /// cost every call of a large file a 256 KiB allocation (an mmap, page faults and the
    /// zeroing).
    static STAGE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f` with `len` bytes of the thread's staging buffer ([`STAGE`]; a buffer of its own for a
/// signal handler's call in the middle of another).
fn with_stage<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    if STAGE.try_with(|_| ()).is_err() {
        // The thread's thread locals are destroyed already (at exit).
        return f(&mut vec![0u8; len]);
    }
    STAGE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut kept) => {
            if kept.len() < len {
                kept.resize(len, 0);
            }
            f(&mut kept[..len])
        }
        Err(_) => f(&mut vec![0u8; len]),
    })
}

/// Largest piece sendfile reads from the file at a time.
const SENDFILE_CHUNK: usize = 256 * 1024;

/// sendfile on the SDP stream `s` (the caller looked it up for `out`).
unsafe fn sendfile_common(
    s: &Sock,
    out: c_int,
    inp: c_int,
    off: *mut i64,
    count: size_t,
) -> ssize_t {
    // SAFETY: the caller's arguments, our buffer.
    with_stage(count.clamp(1, SENDFILE_CHUNK), |buf| unsafe {
        sendfile_with(s, out, inp, off, count, buf)
    })
}

/// [`sendfile_common`] staging through `buf`.
unsafe fn sendfile_with(
    s: &Sock,
    out: c_int,
    inp: c_int,
    off: *mut i64,
    count: size_t,
    buf: &mut [u8],
) -> ssize_t {
    let mut total: ssize_t = 0;
    while (total as usize) < count {
        let want = (count - total as usize).min(buf.len());
        let n = if off.is_null() {
            // SAFETY: reads into our own buffer.
            unsafe { real::read(inp, buf.as_mut_ptr().cast(), want) }
        } else {
            // SAFETY: reads into our own buffer at the caller's offset.
            unsafe { real::pread64(inp, buf.as_mut_ptr().cast(), want, *off + total as i64) }
        };
        if n < 0 {
            return if total > 0 { total } else { -1 };
        }
        if n == 0 {
            break;
        }
        let flags = if total > 0 { libc::MSG_DONTWAIT } else { 0 };
        let w = do_write(s, out, &buf[..n as usize], flags);
        if w < 0 {
            if off.is_null() {
                // Give back what was read and not sent.
                // SAFETY: moves the caller's file position back.
                unsafe { real::lseek64(inp, -(n as i64), libc::SEEK_CUR) };
            }
            if total > 0 {
                break;
            }
            return -1;
        }
        if off.is_null() && w < n {
            // SAFETY: as above.
            unsafe { real::lseek64(inp, -((n - w) as i64), libc::SEEK_CUR) };
        }
        total += w;
        if w < n {
            break;
        }
    }
    if !off.is_null() {
        // SAFETY: the caller's offset.
        unsafe { *off += total as i64 };
    }
    total
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    off: *mut libc::off_t,
    n: size_t,
) -> ssize_t {
    if let Some(s) = data(out) {
        // SAFETY: off_t is i64 on this target; the caller's pointers.
        return unsafe { sendfile_common(&s, out, inp, off.cast(), n) };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::sendfile(out, inp, off, n) }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    off: *mut libc::off64_t,
    n: size_t,
) -> ssize_t {
    if let Some(s) = data(out) {
        // SAFETY: the caller's pointers.
        return unsafe { sendfile_common(&s, out, inp, off, n) };
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::sendfile64(out, inp, off, n) }
}

// ---------------------------------------------------------------------------------------------
// close_range, recvmmsg, sendmmsg

#[no_mangle]
pub unsafe extern "C" fn close_range(
    first: libc::c_uint,
    last: libc::c_uint,
    flags: c_int,
) -> c_int {
    let valid = first <= last
        && flags & !((libc::CLOSE_RANGE_CLOEXEC | libc::CLOSE_RANGE_UNSHARE) as c_int) == 0;
    let mut gone = Vec::new();
    if valid && flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 && !internal() {
        // The fds in the range are about to go: take the shim's out first, as close does
        // (`before_last_close`: a stream a fork exposed tells whether another process holds it).
        let hi = (last as usize).min(table::MAX_FD - 1);
        for fd in (first as usize)..=hi {
            if let Some(s) = table::remove(fd as c_int) {
                gone.push((fd as c_int, s));
            }
        }
        // A socket whose every fd in the process is in the range (dups included): once.
        for (i, (fd, s)) in gone.iter().enumerate() {
            let here = gone.iter().filter(|(_, o)| Arc::ptr_eq(o, s)).count();
            let first_here = gone.iter().position(|(_, o)| Arc::ptr_eq(o, s)) == Some(i);
            if first_here && Arc::strong_count(s) == here {
                last_close(*fd, s);
            }
        }
    }
    let r = if valid {
        close_range_keeping(first, last, flags)
    } else {
        // SAFETY: forwards the caller's arguments.
        unsafe { real::close_range(first, last, flags) }
    };
    drop_internal(gone);
    r
}

/// closefrom(3): glibc's makes the close_range system call itself, where the hook above does
/// not see it (the shim's table kept the closed sockets, whose numbers then named other files).
///
/// # Safety
/// As `closefrom(3)`.
#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    // SAFETY: the hook above, on every fd from `low` up.
    if unsafe { close_range(low.max(0) as libc::c_uint, libc::c_uint::MAX, 0) } == 0 {
        return;
    }
    // (No close_range in the kernel: libc's way, the shim's entries already taken out.)
    // SAFETY: forwards the caller's argument.
    unsafe { real::closefrom(low) }
}

/// For src/syscall.c: a close, dup or close_range made by `syscall()` goes through the hook
/// of the same name (libuv closes so, some runtimes too), so the shim sees every close a
/// program makes through libc. The caller picks the calls (`nr`) on fds the shim owns.
///
/// # Safety
/// As the system call `nr`.
#[no_mangle]
pub unsafe extern "C" fn sdp_fd_syscall(
    nr: libc::c_long,
    a0: libc::c_long,
    a1: libc::c_long,
    a2: libc::c_long,
) -> libc::c_long {
    // SAFETY: the hooks, with the caller's arguments.
    let r = unsafe {
        match nr {
            libc::SYS_close => close(a0 as c_int),
            libc::SYS_dup => dup(a0 as c_int),
            #[cfg(target_arch = "x86_64")]
            libc::SYS_dup2 => dup2(a0 as c_int, a1 as c_int),
            libc::SYS_dup3 => dup3(a0 as c_int, a1 as c_int, a2 as c_int),
            libc::SYS_close_range => {
                close_range(a0 as libc::c_uint, a1 as libc::c_uint, a2 as c_int)
            }
            _ => {
                set_errno(libc::ENOSYS);
                -1
            }
        }
    };
    r as libc::c_long
}

/// close_range, leaving the fds of ours: the runtime's (`fd_limit::ours_in`: a daemon's
/// `closefrom(3)` closed its listeners' SDP rendezvous, and later clients came by kernel TCP;
/// corners `closefrom_keeps_sdp`), and those a fork child needs until it execs
/// (`fd_limit::kept_fds`: Python's `subprocess` closes every fd from 8 up before its exec,
/// whose hook then shares the streams the new program keeps through one of them).
fn close_range_keeping(first: libc::c_uint, last: libc::c_uint, flags: c_int) -> c_int {
    let mut from = first;
    let mut r = 0;
    let hi = last.min(c_int::MAX as libc::c_uint) as c_int;
    let mut keep = fd_limit::kept_fds();
    keep.extend(fd_limit::ours_in(
        first.min(c_int::MAX as libc::c_uint) as c_int,
        hi,
    ));
    keep.sort_unstable();
    keep.dedup();
    for k in keep {
        let k = k as libc::c_uint;
        if k < from || k > last {
            continue;
        }
        if k > from {
            // SAFETY: plain fd calls on the caller's range.
            r = r.min(unsafe { real::close_range(from, k - 1, flags) });
        }
        if k == libc::c_uint::MAX {
            return r;
        }
        from = k + 1;
    }
    if from <= last {
        // SAFETY: as above.
        r = r.min(unsafe { real::close_range(from, last, flags) });
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    v: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
    t: *mut libc::timespec,
) -> c_int {
    if data(fd).is_some() {
        // A stream socket: one message (as TCP fills the first and returns).
        if n == 0 || v.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: the caller's first mmsghdr.
        let m = unsafe { &mut *v };
        // SAFETY: forwards to the recvmsg hook.
        let r = unsafe { recvmsg(fd, &mut m.msg_hdr, flags & !libc::MSG_WAITFORONE) };
        if r < 0 {
            return -1;
        }
        m.msg_len = r as libc::c_uint;
        return 1;
    }
    // SAFETY: forwards the caller's arguments.
    let r = unsafe { real::recvmmsg(fd, v, n, flags, t) };
    for i in 0..r.max(0) as usize {
        // SAFETY: the kernel filled in the caller's first `r` mmsghdrs.
        let m = unsafe { &(*v.add(i)).msg_hdr };
        if m.msg_controllen != 0 {
            // SAFETY: as above.
            unsafe { adopt_passed(m) };
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn sendmmsg(
    fd: c_int,
    v: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
) -> c_int {
    if data(fd).is_some() {
        let mut sent = 0;
        for i in 0..n as usize {
            // SAFETY: the caller passes `n` mmsghdrs.
            let m = unsafe { &mut *v.add(i) };
            let f = if sent > 0 {
                flags | libc::MSG_DONTWAIT
            } else {
                flags
            };
            // SAFETY: forwards to the sendmsg hook.
            let r = unsafe { sendmsg(fd, &m.msg_hdr, f) };
            if r < 0 {
                return if sent > 0 { sent } else { -1 };
            }
            m.msg_len = r as libc::c_uint;
            sent += 1;
        }
        return sent;
    }
    if app::event_waits_poll() && !internal() {
        // Each message's SCM_RIGHTS, as sendmsg's (the kernel looks at no more than
        // UIO_MAXIOV of them). `msg_hdr` is an mmsghdr's first field; the headers are read
        // by system call, so a bad `v` is the kernel's EFAULT below.
        for i in 0..(n as usize).min(1024) {
            share_passed(v.wrapping_add(i).cast::<msghdr>());
        }
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::sendmmsg(fd, v, n, flags) }
}

// Children that exec: posix_spawn(p), vfork, system, popen. None runs the fork handlers, and
// the child's new program knows nothing of the shim's state: an SDP stream's fd it inherits is
// the user end of the readiness pair, which carries real bytes only once the stream is shared
// (as at fork: `socket::pump`). So every stream the child will inherit becomes shared first, and
// listeners it inherits serve kernel TCP only (the child could accept the shim's doorbells).

/// fds the application asked `posix_spawn_file_actions_adddup2` to give a child: (file actions
/// object, fd). Only the shim's own fds are kept.
static SPAWN_DUPS: parking_lot::Mutex<Vec<(usize, c_int, c_int)>> =
    parking_lot::Mutex::new(Vec::new());

/// Before a child that will exec is made: share the streams it inherits (fds without
/// FD_CLOEXEC, and those `dups` gives it), take the listeners it inherits out of SDP.
fn before_spawn(dups: &[(c_int, c_int)]) {
    if internal() {
        return;
    }
    let inherited = |fd: c_int| dups.iter().any(|(from, _)| *from == fd) || kept_by_exec(fd);
    let _g = Internal::enter();
    share_streams("spawn", |fd, _| inherited(fd));
    let gone = table::take_listeners(|fd, _| inherited(fd));
    if !gone.is_empty() {
        log(format_args!(
            "spawn: {} listening socket(s) inherited by the child now serve kernel TCP only",
            gone.len()
        ));
    }
    for s in &gone {
        if let Sock::Listener(l) = &**s {
            // The clients already set up over SDP go on through their doorbells, which the
            // child's accept gets (socket activation by spawn).
            exec::hand_listener_over(l, "spawn");
        }
    }
    drop(gone);
}

/// Whether `fd` stays open across an exec (not close-on-exec).
pub(crate) fn kept_by_exec(fd: c_int) -> bool {
    // SAFETY: F_GETFD on an fd number: no memory is passed.
    let flags = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
    flags & libc::FD_CLOEXEC == 0
}

/// Before an exec or a spawn (`what`): share the streams not shared yet that `pick` chooses
/// (by fd, and the stream): another program is about to hold them, and its bytes must go
/// through the kernel file. The caller is marked internal.
pub(crate) fn share_streams(what: &str, pick: impl Fn(c_int, &AppStream) -> bool) {
    for (fd, s) in table::streams() {
        if let Sock::Stream(st, _) = &*s {
            if pick(fd, st) {
                share_stream(what, fd, st);
            }
        }
    }
}

/// Share the stream `st` at `fd` (its bytes through the kernel file from now on), for `what`.
fn share_stream(what: &str, fd: c_int, st: &AppStream) {
    if st.is_shared() {
        return;
    }
    match st.share(fd) {
        Ok(()) => log(format_args!(
            "{what}: fd {fd} is shared, its bytes go through the kernel file"
        )),
        Err(e) => log(format_args!("{what}: fd {fd} cannot be shared: {e}")),
    }
}

/// The dup2 actions recorded for the file actions object `fa`: (the shim's fd, its number in
/// the child).
fn spawn_dups(fa: *const libc::posix_spawn_file_actions_t) -> Vec<(c_int, c_int)> {
    if fa.is_null() {
        return Vec::new();
    }
    SPAWN_DUPS
        .lock()
        .iter()
        .filter(|(f, ..)| *f == fa as usize)
        .map(|(_, fd, to)| (*fd, *to))
        .collect()
}

/// Run a spawn with `envp` (null: the process's environment) plus the inherited streams'
/// identity (`exec::exec_fds_var`), those `dups` gives the child included.
fn spawn_with_exec_fds(
    dups: &[(c_int, c_int)],
    envp: *const *mut libc::c_char,
    spawn: impl FnOnce(*const *mut libc::c_char) -> c_int,
) -> c_int {
    match exec::exec_fds_var(dups) {
        Some(var) => {
            // SAFETY: `envp` is the caller's environment array (or null); `var` outlives it.
            let env = unsafe { exec::env_with(envp.cast(), &var) };
            spawn(env.as_ptr().cast())
        }
        None => spawn(envp),
    }
}

/// Run `f` (system(), popen(): glibc spawns their shell itself, with the process's
/// environment) with the inherited streams' identity in the environment, then take it out.
fn with_exec_fds_set<T>(f: impl FnOnce() -> T) -> T {
    let Some(v) = exec::exec_fds_value(&[]) else {
        return f();
    };
    std::env::set_var(exec::EXEC_FDS, v);
    let r = f();
    std::env::remove_var(exec::EXEC_FDS);
    r
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawn_file_actions_adddup2(
    fa: *mut libc::posix_spawn_file_actions_t,
    fd: c_int,
    newfd: c_int,
) -> c_int {
    if table::owned(fd) && !internal() {
        SPAWN_DUPS.lock().push((fa as usize, fd, newfd));
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::posix_spawn_file_actions_adddup2(fa, fd, newfd) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawn_file_actions_destroy(
    fa: *mut libc::posix_spawn_file_actions_t,
) -> c_int {
    SPAWN_DUPS.lock().retain(|(f, ..)| *f != fa as usize);
    // SAFETY: forwards the caller's arguments.
    unsafe { real::posix_spawn_file_actions_destroy(fa) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut libc::pid_t,
    path: *const libc::c_char,
    fa: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut libc::c_char,
    envp: *const *mut libc::c_char,
) -> c_int {
    let dups = spawn_dups(fa);
    before_spawn(&dups);
    let _limit = limits::ExecLimit::enter();
    // SAFETY: the caller's arguments, the environment with the streams' identity.
    spawn_with_exec_fds(&dups, envp, |envp| unsafe {
        real::posix_spawn(pid, path, fa, attr, argv, envp)
    })
}

// glibc's system() and popen() spawn their shell internally (no posix_spawn call the shim
// sees), and the shell inherits every fd without FD_CLOEXEC.

#[no_mangle]
pub unsafe extern "C" fn system(cmd: *const libc::c_char) -> c_int {
    // system(NULL) only asks whether a shell exists.
    if cmd.is_null() {
        // SAFETY: forwards the caller's argument.
        return unsafe { real::system(cmd) };
    }
    before_spawn(&[]);
    // SAFETY: forwards the caller's arguments.
    with_exec_fds_set(|| unsafe { real::system(cmd) })
}

#[no_mangle]
pub unsafe extern "C" fn popen(
    cmd: *const libc::c_char,
    mode: *const libc::c_char,
) -> *mut libc::FILE {
    before_spawn(&[]);
    let _limit = limits::ExecLimit::enter();
    // SAFETY: forwards the caller's arguments.
    with_exec_fds_set(|| unsafe { real::popen(cmd, mode) })
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut libc::pid_t,
    file: *const libc::c_char,
    fa: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut libc::c_char,
    envp: *const *mut libc::c_char,
) -> c_int {
    let dups = spawn_dups(fa);
    before_spawn(&dups);
    let _limit = limits::ExecLimit::enter();
    // SAFETY: the caller's arguments, the environment with the streams' identity.
    spawn_with_exec_fds(&dups, envp, |envp| unsafe {
        real::posix_spawnp(pid, file, fa, attr, argv, envp)
    })
}

/// daemon(3) with SDP streams open (`ssh -f`, a client that daemonizes after it connected):
/// the streams, and the listeners over shm not shared yet, move to the child that goes on
/// (`app::fork_moving`: the peers paused across the fork and told the child's pid), where
/// they left with the parent, which exits at once
/// (the child's bytes went through the parent's pump: gone, its writes got EPIPE). Then what
/// glibc's daemon does: the parent `_exit(0)`, the child `setsid`, `chdir("/")` unless
/// `nochdir`, stdin, stdout and stderr onto /dev/null unless `noclose`.
#[no_mangle]
pub unsafe extern "C" fn daemon(nochdir: c_int, noclose: c_int) -> c_int {
    if internal() || !enabled() || !has_movable() {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::daemon(nochdir, noclose) };
    }
    share_listeners_for_fork(true);
    match fork_moving() {
        -1 => return -1,
        0 => {}
        // The parent of daemon(3) ends here, as glibc's does: its runtime copy is locked and
        // its connections are the child's, so not through the shim's `_exit` (which flushes
        // and reports): the system call itself.
        // SAFETY: ends the process.
        _ => unsafe {
            libc::syscall(libc::SYS_exit_group, 0);
            libc::abort()
        },
    }
    log(format_args!(
        "daemon: the SDP streams went on in this process"
    ));
    // SAFETY: plain system calls with no memory passed, or a constant path.
    unsafe {
        if libc::setsid() < 0 {
            return -1;
        }
        if nochdir == 0 {
            let _ = libc::chdir(c"/".as_ptr());
        }
        if noclose == 0 {
            let fd = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            if fd >= 0 {
                for std in 0..3 {
                    dup2(fd, std);
                }
                if fd > 2 {
                    close(fd);
                }
            }
        }
    }
    0
}

/// A fork with this process's SDP connections (and the listeners the fork handlers leave
/// alone, `MOVING`) going on in the child (`app::fork_moving`): `daemon` and the keeper.
pub(crate) fn fork_moving() -> libc::pid_t {
    MOVING.store(true, Ordering::SeqCst);
    let pid = {
        let _g = Internal::enter();
        // SAFETY: fork takes no arguments.
        app::fork_moving(|| unsafe { real::fork() })
    };
    MOVING.store(false, Ordering::SeqCst);
    pid
}

/// Whether this process holds SDP streams of its own (not copies a fork gave it), or
/// listeners that can move with them.
fn has_movable() -> bool {
    let _g = Internal::enter();
    table::streams().into_iter().any(|(_, s)| match &*s {
        Sock::Stream(st, _) => !st.is_inherited(),
        _ => false,
    }) || table::listeners().into_iter().any(|(_, s)| match &*s {
        Sock::Listener(l) => l.movable(),
        _ => false,
    })
}

/// The fork handlers (sdp-core's and ours) around a process made by a raw `clone` or `fork`
/// system call (`syscall()`, hooked in src/syscall.c: vsftpd makes its per-connection children
/// so) or by glibc's `clone()` without CLONE_VM, which glibc runs none for: `stage` 0 before
/// it, 1 in the parent after it, 2 in the child. Without them the parent's close of a
/// connection the child serves ended it.
#[no_mangle]
pub extern "C" fn sdp_raw_fork(stage: c_int) {
    use sdp_core::socket::fork::{run_fork_handlers, ForkStage};
    if stage == 0 {
        // The shim's handlers are registered at its first use: make sure they are.
        enabled();
    }
    run_fork_handlers(match stage {
        0 => ForkStage::Prepare,
        1 => ForkStage::Parent,
        _ => ForkStage::Child,
    });
}

/// vfork is fork here: a vfork child borrows the parent's memory and stack until it execs,
/// which would let it run the shim's hooks on the parent's state; a fork child runs the fork
/// handlers (streams shared, listeners out of SDP) and behaves the same for the exec or _exit
/// a vfork child may do.
#[no_mangle]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    // SAFETY: fork takes no arguments; the caller does only what a vfork child may do.
    unsafe { real::fork() }
}

// splice: one side a pipe, the other an SDP stream. The stream's fd is the readiness pair's user
// end, whose bytes are tokens, not the stream's: splicing it in the kernel would move tokens. So
// the bytes go through a buffer, taken from their source only once they are at their
// destination (a peek of the stream, or a `tee` of the pipe, then the consuming read), so a
// short or failed move loses nothing. Shared streams (after fork) carry real bytes: the kernel
// splices them.

/// The most one emulated splice moves (as a pipe's default size).
const SPLICE_MAX: usize = 64 * 1024;

fn is_pipe(fd: c_int) -> bool {
    // SAFETY: fstat fills the zeroed struct it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live stat struct.
    unsafe { libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFIFO }
}

/// An SDP stream into a pipe: peek, write into the pipe, then take what the pipe took.
fn splice_from_stream(s: &Sock, sock: c_int, pipe: c_int, len: usize, nb: bool) -> ssize_t {
    let mut want = len.min(SPLICE_MAX);
    if nb {
        // A nonblocking splice must not block on a full pipe: move at most its free room.
        // SAFETY: fcntl and ioctl on an fd number, the ioctl into a live int.
        let cap = unsafe { real::fcntl(pipe, libc::F_GETPIPE_SZ, 0) };
        let mut queued: c_int = 0;
        // SAFETY: as above.
        if cap > 0
            && unsafe { real::ioctl(pipe, libc::FIONREAD, &mut queued as *mut c_int as usize) } == 0
        {
            let room = (cap - queued).max(0) as usize;
            if room == 0 {
                set_errno(libc::EAGAIN);
                return -1;
            }
            want = want.min(room);
        }
        return splice_from_stream_nb(s, sock, pipe, want);
    }
    with_stage(want, |buf| {
        // The stream side blocks as its fd says (TCP's splice too: SPLICE_F_NONBLOCK is the
        // pipe's).
        let n = do_read(s, sock, buf, libc::MSG_PEEK);
        if n <= 0 {
            return n;
        }
        // SAFETY: writes from our own buffer.
        let w = unsafe { real::write(pipe, buf.as_ptr().cast(), n as usize) };
        if w <= 0 {
            return w;
        }
        // The bytes are in the pipe: take them from the stream (they are there, in order).
        let taken = do_read(s, sock, &mut buf[..w as usize], libc::MSG_DONTWAIT);
        debug_assert_eq!(taken, w);
        w
    })
}

/// [`splice_from_stream`] with SPLICE_F_NONBLOCK: the pipe must not block the call, whatever
/// its own O_NONBLOCK, and its room is whole pages, not the bytes its size and FIONREAD tell
/// (a page partly read holds its free bytes for nobody): a `write` of that many bytes into a
/// blocking pipe blocked for good when the caller was the pipe's only reader (haproxy's
/// `option splice-response`, backend over SDP, client over TCP: the download stalled). So the
/// peeked bytes go into a scratch pipe of ours, the kernel moves what the caller's pipe takes
/// without blocking (`splice` pipe to pipe, SPLICE_F_NONBLOCK: EAGAIN when it takes nothing),
/// and that much is taken from the stream.
fn splice_from_stream_nb(s: &Sock, sock: c_int, pipe: c_int, want: usize) -> ssize_t {
    with_stage(want, |buf| {
        let n = do_read(s, sock, buf, libc::MSG_PEEK);
        if n <= 0 {
            return n;
        }
        // The scratch pipe only once there are bytes (an event loop's splice often finds
        // none), in the room above the application's limit (a program at its limit splices).
        let mut p = [0 as c_int; 2];
        // SAFETY: pipe2 fills the two-int array it is given.
        if fd_limit::with_room(|| unsafe {
            libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK)
        }) != 0
        {
            return -1;
        }
        // SAFETY: writes from our own buffer into our own (nonblocking, empty) pipe.
        let k = unsafe { real::write(p[1], buf.as_ptr().cast(), n as usize) };
        let m = if k <= 0 {
            k
        } else {
            // SAFETY: pipe to pipe, no memory passed; the caller's pipe as it gave it.
            unsafe {
                real::splice(
                    p[0],
                    std::ptr::null_mut(),
                    pipe,
                    std::ptr::null_mut(),
                    k as usize,
                    libc::SPLICE_F_NONBLOCK,
                )
            }
        };
        // (A successful close leaves errno alone.)
        // SAFETY: our own scratch pipe's fds.
        unsafe {
            real::close(p[0]);
            real::close(p[1]);
        }
        if m > 0 {
            // The bytes are in the caller's pipe: take them from the stream.
            let taken = do_read(s, sock, &mut buf[..m as usize], libc::MSG_DONTWAIT);
            debug_assert_eq!(taken, m);
        }
        m
    })
}

/// A pipe into an SDP stream: `tee` the pipe's bytes (they stay in it), write them to the
/// stream, then take from the pipe what the stream took.
fn splice_to_stream(s: &Sock, pipe: c_int, sock: c_int, len: usize, nb: bool) -> ssize_t {
    let mut p = [0 as c_int; 2];
    // SAFETY: pipe2 fills the two-int array it is given.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return -1;
    }
    let close = |p: &[c_int; 2]| {
        // SAFETY: our own scratch pipe's fds.
        unsafe {
            real::close(p[0]);
            real::close(p[1]);
        }
    };
    let tflags = if nb { libc::SPLICE_F_NONBLOCK } else { 0 };
    // SAFETY: tee between the caller's pipe and our scratch pipe; no memory is passed.
    let t = unsafe { libc::tee(pipe, p[1], len.min(SPLICE_MAX), tflags) };
    if t <= 0 {
        let e = io::Error::last_os_error();
        close(&p);
        if t < 0 {
            set_errno(errno_of(&e));
        }
        return t;
    }
    with_stage(t as usize, |buf| {
        let mut got = 0;
        while got < buf.len() {
            // SAFETY: reads into our own buffer.
            let r = unsafe { real::read(p[0], buf[got..].as_mut_ptr().cast(), buf.len() - got) };
            if r <= 0 {
                break;
            }
            got += r as usize;
        }
        close(&p);
        let w = do_write(s, sock, &buf[..got], 0);
        if w <= 0 {
            return w;
        }
        // The stream took `w` bytes: take them from the pipe (they are its first bytes).
        let mut left = w as usize;
        while left > 0 {
            // SAFETY: reads into our own buffer.
            let r = unsafe { real::read(pipe, buf.as_mut_ptr().cast(), left) };
            if r <= 0 {
                break;
            }
            left -= r as usize;
        }
        w
    })
}

#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: libc::c_uint,
) -> ssize_t {
    let (sin, sout) = (data(fd_in), data(fd_out));
    if sin.is_none() && sout.is_none() {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) };
    }
    // SPLICE_F_NONBLOCK is about the pipe; the stream blocks as its fd's O_NONBLOCK says.
    let nb = flags & libc::SPLICE_F_NONBLOCK != 0;
    // As the kernel: one side must be a pipe; an offset for the pipe is ESPIPE, for the
    // socket EINVAL (it cannot seek).
    let fail = |e: c_int| {
        set_errno(e);
        -1
    };
    match (sin, sout) {
        (Some(s), None) if is_pipe(fd_out) => {
            if !off_out.is_null() {
                return fail(libc::ESPIPE);
            }
            if !off_in.is_null() {
                return fail(libc::EINVAL);
            }
            if len == 0 {
                return 0;
            }
            splice_from_stream(&s, fd_in, fd_out, len, nb)
        }
        (None, Some(s)) if is_pipe(fd_in) => {
            if !off_in.is_null() {
                return fail(libc::ESPIPE);
            }
            if !off_out.is_null() {
                return fail(libc::EINVAL);
            }
            if len == 0 {
                return 0;
            }
            splice_to_stream(&s, fd_in, fd_out, len, nb)
        }
        _ => fail(libc::EINVAL),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn listening_sockets_of_a_port_from_proc_net_tcp() {
        let t = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1DCC 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111 1 0000000000000000 100 0 0 10 0
   1: 00000000:1DCC 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2222 1 0000000000000000 100 0 0 10 0
   2: 0100007F:1DCC 0100007F:A000 01 00000000:00000000 00:00000000 00000000     0        0 3333 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:1DCD 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0000000000000000 100 0 0 10 0
";
        // Port 0x1DCC = 7628: the two listening ones, not the connection, not port 7629's.
        let got: Vec<u64> = super::listeners_on_port(t, 7628).collect();
        assert_eq!(got, vec![1111, 2222]);
        assert_eq!(
            super::listeners_on_port(t, 7629).collect::<Vec<_>>(),
            vec![4444]
        );
        assert_eq!(super::listeners_on_port(t, 1).count(), 0);
    }
}
