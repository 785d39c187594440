//! RLIMIT_NOFILE as the application set it. An SDP connection holds up to three fds of the
//! shim's beside the application's one; so that a program can hold as many connections as its
//! fd limit allows over kernel TCP, the shim keeps room above the application's limit where the
//! hard one allows (`make_fd_room`, at its start; the kernel's soft limit is raised only while
//! it makes or moves fds of its own, `sys::Room`) and keeps its own fds there; the limit is
//! what the application is told and can change: getrlimit, setrlimit, prlimit (on itself),
//! getdtablesize and sysconf(_SC_OPEN_MAX) speak of it. A program it execs or spawns gets the
//! application's limit back (`fd_limit_for_exec`), as it would without the shim.

use std::sync::atomic::Ordering;

use libc::{c_int, c_long, rlimit, rlimit64};
use sdp_core::socket::fd_limit;

use crate::{fail, internal, real, ENABLED};

/// The shim manages the limit in this process (on, and not its own thread).
fn managing() -> bool {
    ENABLED.load(Ordering::Relaxed) == 1 && !internal()
}

/// The application's soft limit to report in place of the kernel's, if the shim raised it.
fn app_soft() -> Option<u64> {
    if internal() {
        return None;
    }
    fd_limit::app_fd_limit()
}

fn is_nofile(resource: c_int) -> bool {
    resource == libc::RLIMIT_NOFILE as c_int
}

/// Whether `pid` is this process (prlimit's 0 or our own pid).
fn is_self(pid: libc::pid_t) -> bool {
    pid == 0 || pid as u32 == std::process::id()
}

/// setrlimit(RLIMIT_NOFILE) for the application: its limit, with the shim's room above.
fn set_nofile(soft: u64, hard: u64) -> c_int {
    match fd_limit::set_app_fd_limit(soft, hard) {
        Ok(()) => 0,
        Err(e) => fail(&e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn getrlimit(resource: c_int, r: *mut rlimit) -> c_int {
    // SAFETY: forwards the caller's arguments.
    let rc = unsafe { real::getrlimit(resource, r) };
    if rc == 0 && is_nofile(resource) && !r.is_null() {
        if let Some(app) = app_soft() {
            // SAFETY: the kernel just filled in `*r`: it is the caller's valid rlimit.
            unsafe { (*r).rlim_cur = app };
        }
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn getrlimit64(resource: c_int, r: *mut rlimit64) -> c_int {
    // SAFETY: on 64-bit Linux rlimit and rlimit64 are the same layout.
    unsafe { getrlimit(resource, r.cast()) }
}

#[no_mangle]
pub unsafe extern "C" fn setrlimit(resource: c_int, r: *const rlimit) -> c_int {
    if is_nofile(resource) && !r.is_null() && managing() {
        // SAFETY: the caller's valid rlimit.
        let r = unsafe { *r };
        return set_nofile(r.rlim_cur, r.rlim_max);
    }
    // SAFETY: forwards the caller's arguments.
    unsafe { real::setrlimit(resource, r) }
}

#[no_mangle]
pub unsafe extern "C" fn setrlimit64(resource: c_int, r: *const rlimit64) -> c_int {
    // SAFETY: on 64-bit Linux rlimit and rlimit64 are the same layout.
    unsafe { setrlimit(resource, r.cast()) }
}

#[no_mangle]
pub unsafe extern "C" fn prlimit64(
    pid: libc::pid_t,
    resource: c_int,
    new: *const rlimit64,
    old: *mut rlimit64,
) -> c_int {
    if !(is_nofile(resource) && is_self(pid) && managing()) {
        // SAFETY: forwards the caller's arguments.
        return unsafe { real::prlimit64(pid, resource, new, old) };
    }
    let before = match fd_limit::nofile_limit() {
        Ok(l) => l,
        Err(e) => return fail(&e),
    };
    let app_before = fd_limit::app_fd_limit().unwrap_or(before.0);
    if !new.is_null() {
        // SAFETY: the caller's valid rlimit64.
        let n = unsafe { *new };
        if set_nofile(n.rlim_cur, n.rlim_max) != 0 {
            return -1;
        }
    }
    if !old.is_null() {
        // SAFETY: the caller's valid rlimit64 to write.
        unsafe {
            *old = rlimit64 {
                rlim_cur: app_before,
                rlim_max: before.1,
            }
        };
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn prlimit(
    pid: libc::pid_t,
    resource: c_int,
    new: *const rlimit,
    old: *mut rlimit,
) -> c_int {
    // SAFETY: on 64-bit Linux rlimit and rlimit64 are the same layout.
    unsafe { prlimit64(pid, resource, new.cast(), old.cast()) }
}

#[no_mangle]
pub extern "C" fn getdtablesize() -> c_int {
    match app_soft() {
        Some(app) => app.min(c_int::MAX as u64) as c_int,
        // SAFETY: no arguments.
        None => unsafe { real::getdtablesize() },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sysconf(name: c_int) -> c_long {
    if name == libc::_SC_OPEN_MAX {
        if let Some(app) = app_soft() {
            return app.min(c_long::MAX as u64) as c_long;
        }
    }
    // SAFETY: forwards the caller's argument.
    unsafe { real::sysconf(name) }
}

/// `fd`, just made by socket(2) for the application (`cloexec`: with SOCK_CLOEXEC), where
/// the limit the application set is kept: `fd` itself below it; past it (the room above is
/// the shim's), the lower number it would have had over TCP if an fd of the shim's holds one
/// for a moment, or `None` (`fd` closed): EMFILE, as over TCP.
#[inline]
pub(crate) fn within_app_limit(fd: c_int, cloexec: bool) -> Option<c_int> {
    match app_soft() {
        Some(app) if fd >= 0 && fd as u64 >= app => fd_limit::app_slot(fd, app, cloexec),
        _ => Some(fd),
    }
}

/// Whether accept on `listener` (a listening socket the shim owns) may take a connection:
/// where the limit the application set is kept, a number below it must be free, as over TCP,
/// whose accept fails with EMFILE at the limit and leaves the connection queued (the room
/// above is the shim's: a select() loop would overflow its fd_set on a number past 1024).
#[inline]
pub(crate) fn room_for_accept(listener: c_int) -> bool {
    app_soft().is_none_or(|app| fd_limit::app_has_room(listener, app))
}

/// Around an exec or a spawn: the new program gets the application's limit, and the room
/// comes back when the call returns (an exec that failed, a spawn done).
pub(crate) struct ExecLimit(bool);

impl ExecLimit {
    pub(crate) fn enter() -> ExecLimit {
        ExecLimit(fd_limit::fd_limit_for_exec())
    }
}

impl Drop for ExecLimit {
    fn drop(&mut self) {
        if self.0 {
            fd_limit::fd_room_after_exec();
        }
    }
}
