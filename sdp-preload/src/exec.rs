//! exec without fork. The SDP connections live in the process image an exec replaces, so before
//! it the shim does what an exit does (`at_exit`): what was written reaches the peers, then each
//! connection closes as TCP's would when its last fd goes (the exec closes FD_CLOEXEC sockets;
//! a stream without FD_CLOEXEC, which TCP would keep open in the new program, ends too: see
//! TODO.md). Only when the exec can succeed (the file is there and executable), so a program
//! that tries paths in turn keeps its connections through the failures. Without this, bytes
//! still queued were lost and a peer could copy into the new image's memory until it noticed.

use std::ffi::CStr;
use std::sync::atomic::Ordering;

use libc::{c_char, c_int};

use crate::limits::ExecLimit;
use crate::{internal, real, ENABLED, PID};

/// Whether `path` (relative to `dirfd`) names a file we may execute.
fn executable_at(dirfd: c_int, path: *const c_char, flags: c_int) -> bool {
    if path.is_null() {
        return false;
    }
    let f = if flags & libc::AT_EMPTY_PATH != 0 {
        libc::AT_EMPTY_PATH
    } else {
        0
    };
    // SAFETY: `path` is the caller's NUL-terminated string; faccessat only reads it.
    unsafe { libc::faccessat(dirfd, path, libc::X_OK, f | libc::AT_EACCESS) == 0 }
}

/// As `execvp` looks for `file`: itself if it has a slash, else along `PATH`.
fn findable(file: *const c_char) -> bool {
    if file.is_null() {
        return false;
    }
    // SAFETY: the caller's NUL-terminated string.
    let name = unsafe { CStr::from_ptr(file) }.to_bytes();
    if name.is_empty() {
        return false;
    }
    if name.contains(&b'/') {
        return executable_at(libc::AT_FDCWD, file, 0);
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
    use std::os::unix::ffi::OsStrExt;
    path.as_bytes().split(|&b| b == b':').any(|dir| {
        let dir = if dir.is_empty() { &b"."[..] } else { dir };
        let mut full = dir.to_vec();
        full.push(b'/');
        full.extend_from_slice(name);
        full.push(0);
        executable_at(libc::AT_FDCWD, full.as_ptr().cast(), 0)
    })
}

/// The shim's work before an exec that `can` says will succeed; the guard gives the new
/// program the application's fd limit (limits.rs), and the room back if the exec returns.
#[must_use]
fn before_exec(can: impl FnOnce() -> bool) -> ExecLimit {
    if ENABLED.load(Ordering::Relaxed) == 1
        && !internal()
        && PID.load(Ordering::Relaxed) == std::process::id()
        && can()
    {
        crate::at_exit();
    }
    ExecLimit::enter()
}

/// # Safety
/// As `execve(2)`.
#[no_mangle]
pub unsafe extern "C" fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    let _limit = before_exec(|| executable_at(libc::AT_FDCWD, path, 0));
    // SAFETY: forwards the caller's arguments.
    unsafe { real::execve(path, argv, envp) }
}

/// # Safety
/// As `execv(3)`.
#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    let _limit = before_exec(|| executable_at(libc::AT_FDCWD, path, 0));
    // SAFETY: forwards the caller's arguments.
    unsafe { real::execv(path, argv) }
}

/// # Safety
/// As `execvp(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    let _limit = before_exec(|| findable(file));
    // SAFETY: forwards the caller's arguments.
    unsafe { real::execvp(file, argv) }
}

/// # Safety
/// As `execvpe(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    let _limit = before_exec(|| findable(file));
    // SAFETY: forwards the caller's arguments.
    unsafe { real::execvpe(file, argv, envp) }
}

/// # Safety
/// As `fexecve(3)`.
#[no_mangle]
pub unsafe extern "C" fn fexecve(
    fd: c_int,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    let _limit = before_exec(|| executable_at(fd, c"".as_ptr(), libc::AT_EMPTY_PATH));
    // SAFETY: forwards the caller's arguments.
    unsafe { real::fexecve(fd, argv, envp) }
}

/// # Safety
/// As `execveat(2)`.
#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    let _limit = before_exec(|| executable_at(dirfd, path, flags));
    // SAFETY: forwards the caller's arguments.
    unsafe { real::execveat(dirfd, path, argv, envp, flags) }
}

// execl, execlp, execle: C-variadic. Each exported symbol is a bare jump to the C function of
// src/execl.c, which receives the caller's registers and stack untouched (the variadic calling
// convention included), gathers the arguments and calls our execv, execvp or execve above.
extern "C" {
    fn sdp_execl();
    fn sdp_execlp();
    fn sdp_execle();
}

macro_rules! variadic_jump {
    ($name:ident, $target:ident) => {
        /// # Safety
        /// As the libc function of this name (a jump to its implementation in src/execl.c).
        #[unsafe(naked)]
        #[no_mangle]
        pub unsafe extern "C" fn $name() {
            #[cfg(target_arch = "x86_64")]
            core::arch::naked_asm!("jmp {}", sym $target);
            #[cfg(target_arch = "aarch64")]
            core::arch::naked_asm!("b {}", sym $target);
        }
    };
}
variadic_jump!(execl, sdp_execl);
variadic_jump!(execlp, sdp_execlp);
variadic_jump!(execle, sdp_execle);
