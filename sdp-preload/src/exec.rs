//! exec without fork. The SDP connections live in the process image an exec replaces, so before
//! it the shim does what an exit does (`at_exit`): what was written reaches the peers, then each
//! connection closes as TCP's would when its last fd goes (the exec closes FD_CLOEXEC sockets).
//! A stream over shm without FD_CLOEXEC, which TCP keeps open in the new program, is shared
//! first and goes on in a keeper the exit work forks (keeper.rs), which pumps it for the new
//! program (over rdma it ends). Only when the exec can succeed (the file is there and executable), so a program
//! that tries paths in turn keeps its connections through the failures. Without this, bytes
//! still queued were lost and a peer could copy into the new image's memory until it noticed.

use std::ffi::{CStr, CString};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use libc::{c_char, c_int};

use crate::limits::ExecLimit;
use crate::table::{self, Opts, Sock};
use crate::{internal, real, ENABLED, PID};

/// The variable that carries, through an exec, the identity of the SDP streams the new program
/// inherits (as systemd's `LISTEN_FDS` carries sockets): `FD=DEV.INO=LOCAL>PEER>ROLE,...` (the
/// kernel file's identity; `-` for an address not known). The new program's shim takes it out
/// of its environment at load and, for each fd that is still that file (the spawned shell of
/// `system()` and whatever it runs included), answers getsockname, getpeername and options as
/// TCP would; their bytes flow
/// through the kernel file, pumped by the process that owns the connection. Without it, sshd's
/// per-connection re-exec saw an AF_UNIX socket: no client address in its log and
/// `SSH_CONNECTION`, keys with `from="..."` refused.
pub(crate) const EXEC_FDS: &str = "SDP_EXEC_FDS";

/// `SDP_EXEC_FDS=...` for a new program's environment ([`exec_fds_value`]).
pub(crate) fn exec_fds_var(dups: &[(c_int, c_int)]) -> Option<CString> {
    CString::new(format!("{EXEC_FDS}={}", exec_fds_value(dups)?)).ok()
}

/// The value of `SDP_EXEC_FDS` for a new program: the streams whose fds it inherits (no
/// FD_CLOEXEC), and `dups` (an fd, and the number a spawn's file action gives it in the
/// child). `None` when there are none.
pub(crate) fn exec_fds_value(dups: &[(c_int, c_int)]) -> Option<String> {
    if internal() || ENABLED.load(Ordering::Relaxed) != 1 {
        return None;
    }
    // The entry of the stream `s` on our `fd`, known as `child_fd` in the new program.
    let describe = |child_fd: c_int, fd: c_int, s: &Sock| -> Option<String> {
        let (st, o) = s.stream_parts()?;
        // Only a stream shared with others lives on beyond this program.
        if st.is_some_and(|st| !st.is_shared()) {
            return None;
        }
        let (dev, ino) = table::file_id(fd)?;
        let o = o.lock();
        let a = |a: Option<SocketAddr>| a.map_or("-".to_string(), |a| a.to_string());
        Some(format!(
            "{child_fd}={dev}.{ino}={}>{}>{}",
            a(o.local),
            a(o.peer),
            o.role
        ))
    };
    let all = table::identities();
    let mut entries: Vec<String> = all
        .iter()
        // SAFETY: F_GETFD on an fd number: no memory is passed.
        .filter(|(fd, _)| unsafe { real::fcntl(*fd, libc::F_GETFD, 0) } & libc::FD_CLOEXEC == 0)
        .filter_map(|(fd, s)| describe(*fd, *fd, s))
        .collect();
    for (from, to) in dups {
        if let Some((_, s)) = all.iter().find(|(fd, _)| fd == from) {
            entries.extend(describe(*to, *from, s));
        }
    }
    (!entries.is_empty()).then(|| entries.join(","))
}

/// An environment for a new program: `envp` (null: this process's) without any
/// `SDP_EXEC_FDS`, with `var`. The vector of pointers ends with a null and points into `var`
/// and `envp`'s strings: both must outlive its use.
pub(crate) unsafe fn env_with(envp: *const *const c_char, var: &CString) -> Vec<*const c_char> {
    let envp = if envp.is_null() {
        // SAFETY: the process's environment, a null-terminated array.
        unsafe { environ }
    } else {
        envp
    };
    let mut out = Vec::new();
    let prefix = format!("{EXEC_FDS}=");
    let mut i = 0;
    loop {
        // SAFETY: a null-terminated array of C strings (the caller's or the environment).
        let p = unsafe { *envp.add(i) };
        if p.is_null() {
            break;
        }
        // SAFETY: one of its NUL-terminated strings.
        if !unsafe { CStr::from_ptr(p) }
            .to_bytes()
            .starts_with(prefix.as_bytes())
        {
            out.push(p);
        }
        i += 1;
    }
    out.push(var.as_ptr());
    out.push(std::ptr::null());
    out
}

extern "C" {
    static environ: *const *const c_char;
}

/// At load: take `SDP_EXEC_FDS` out of the environment and answer the identity of each fd it
/// names that is still the kernel file it names.
pub(crate) fn adopt_inherited() {
    let Some(v) = std::env::var_os(EXEC_FDS) else {
        return;
    };
    std::env::remove_var(EXEC_FDS);
    let Some(list) = v.to_str() else {
        return;
    };
    if !crate::enabled() {
        return;
    }
    for e in list.split(',') {
        let mut f = e.splitn(3, '=');
        let (Some(fd), Some(id), Some(rest)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let mut parts = rest.split('>');
        let (Some(fd), Some(id), Some(local), Some(peer), Some(role)) = (
            fd.parse::<c_int>().ok(),
            id.split_once('.')
                .and_then(|(d, i)| Some((d.parse::<u64>().ok()?, i.parse::<u64>().ok()?))),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            continue;
        };
        // Still the stream's file (its AF_UNIX socket), not a number closed and reused since.
        if table::file_id(fd) != Some(id) {
            continue;
        }
        let o = Opts {
            role: if role == "server" { "server" } else { "client" },
            local: local.parse().ok(),
            peer: peer.parse().ok(),
            ..Opts::default()
        };
        adopt(fd, o, "exec");
    }
}

/// `fd`, received by SCM_RIGHTS (`what`), is a shared SDP stream from `local` to `peer`:
/// answer its identity as TCP would from now on (as an exec'd program's inherited streams).
pub(crate) fn adopt_identity(fd: c_int, local: SocketAddr, peer: SocketAddr, what: &str) {
    let o = Opts {
        local: Some(local),
        peer: Some(peer),
        ..Opts::default()
    };
    adopt(fd, o, what);
}

/// Enter `fd` as a stream known by its identity `o` alone ([`Sock::Exec`]).
fn adopt(fd: c_int, o: Opts, what: &str) {
    let (local, peer) = (o.local, o.peer);
    if table::insert(fd, Arc::new(Sock::Exec(table::OptsLock::new(o)))) {
        let a = |a: Option<SocketAddr>| a.map_or("-".to_string(), |a| a.to_string());
        crate::log(format_args!(
            "{what}: fd {fd} is an SDP stream ({} to {}), its bytes go through the kernel file",
            a(local),
            a(peer)
        ));
    }
}

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
        share_own_for_exec();
        crate::at_exit();
    }
    ExecLimit::enter()
}

/// Before an exec without a fork: this process's own streams over shm that the new program
/// keeps (no FD_CLOEXEC) become shared, so their bytes go through the kernel file; the exit
/// work that follows then sees them held by another process and hands them to a keeper, which
/// pumps them for the new program (keeper.rs), where the exec ended them. Over rdma they end
/// as before (a queue pair cannot move).
fn share_own_for_exec() {
    let _g = crate::Internal::enter();
    crate::share_streams("exec", |fd, st| {
        !st.is_inherited() && st.transport() == sdp_core::Transport::Shm && crate::kept_by_exec(fd)
    });
    // A listener the new program keeps (socket activation in place, as
    // systemd-socket-activate): the clients already set up over SDP cannot move into it, and
    // its accept would get their doorbells: they go on through them, in the keeper. New
    // clients go to kernel TCP.
    for (fd, s) in table::listeners() {
        if let Sock::Listener(l) = &*s {
            if crate::kept_by_exec(fd) {
                hand_listener_over(l, "exec");
            }
        }
    }
}

/// A listener of ours is about to be held by a program that knows nothing of SDP (`what`: an
/// exec, a spawn): its clients set up over SDP and not accepted go on through their doorbells,
/// pumped by this process or, once it exits or its image is replaced, by its keeper; new
/// clients go by kernel TCP (`AppListener::hand_to_exec`).
pub(crate) fn hand_listener_over(l: &sdp_core::socket::app::AppListener, what: &str) {
    let n = l.hand_to_exec();
    if n > 0 {
        crate::keeper::want();
        crate::log(format_args!(
            "{what}: {n} SDP connection(s) not accepted yet go on through their doorbells"
        ));
    }
}

/// In a fork child about to exec: the streams it inherited and the new program keeps (no
/// FD_CLOEXEC) become shared first (their owner is asked), since the new program uses the
/// kernel file directly.
fn share_inherited_for_exec() {
    if internal() || ENABLED.load(Ordering::Relaxed) != 1 {
        return;
    }
    let _g = crate::Internal::enter();
    crate::share_streams("exec", |fd, st| {
        st.is_inherited() && crate::kept_by_exec(fd)
    });
    // A shared listener the new program keeps (inetd's `wait` services): its SDP clients go
    // to kernel TCP from now on, the new program's accept knowing nothing of SDP.
    for (fd, s) in table::listeners() {
        if let Sock::Listener(l) = &*s {
            if crate::kept_by_exec(fd) && l.is_shared() {
                l.held_across_exec();
                crate::log(format_args!(
                    "exec: listening fd {fd} is kept by the new program: its SDP clients go to kernel TCP"
                ));
            }
        }
    }
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
    // SAFETY: the caller's arguments, the environment given with the streams' identity.
    with_exec_fds(envp, |envp| unsafe { real::execve(path, argv, envp) })
}

/// Run `exec(envp)` with `envp` plus the inherited streams' identity ([`exec_fds_var`]) when
/// there are any (`envp` null: this process's environment).
fn with_exec_fds(
    envp: *const *const c_char,
    exec: impl FnOnce(*const *const c_char) -> c_int,
) -> c_int {
    share_inherited_for_exec();
    match exec_fds_var(&[]) {
        Some(var) => {
            // SAFETY: `envp` is the caller's environment array (or null); `var` outlives it.
            let env = unsafe { env_with(envp, &var) };
            exec(env.as_ptr())
        }
        None if envp.is_null() => {
            // SAFETY: the process's environment.
            exec(unsafe { environ })
        }
        None => exec(envp),
    }
}

/// # Safety
/// As `execv(3)`.
#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    let _limit = before_exec(|| executable_at(libc::AT_FDCWD, path, 0));
    // SAFETY: the caller's arguments; execv is execve with the process's environment.
    with_exec_fds(std::ptr::null(), |envp| unsafe {
        real::execve(path, argv, envp)
    })
}

/// # Safety
/// As `execvp(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    let _limit = before_exec(|| findable(file));
    // SAFETY: the caller's arguments; execvp is execvpe with the process's environment.
    with_exec_fds(std::ptr::null(), |envp| unsafe {
        real::execvpe(file, argv, envp)
    })
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
    // SAFETY: the caller's arguments, the environment with the streams' identity.
    with_exec_fds(envp, |envp| unsafe { real::execvpe(file, argv, envp) })
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
    // SAFETY: the caller's arguments, the environment with the streams' identity.
    with_exec_fds(envp, |envp| unsafe { real::fexecve(fd, argv, envp) })
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
    // SAFETY: the caller's arguments, the environment with the streams' identity.
    with_exec_fds(envp, |envp| unsafe {
        real::execveat(dirfd, path, argv, envp, flags)
    })
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
