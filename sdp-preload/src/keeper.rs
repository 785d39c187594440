//! The keeper: a process that carries an exiting owner's SDP streams for the processes that
//! still hold them.
//!
//! A TCP connection belongs to its kernel file: a fork child that inherited the fd keeps it
//! when its parent exits (`if (fork()) _exit(0)`, hand-written daemonizing; a server that
//! handed a connection to a child and exits; an inetd-style handler spawned with the socket).
//! An SDP connection lives in the process that made it, and other holders' bytes go through the
//! kernel file, pumped by that process (docs/preload.md, "Processes"): when it exited, the
//! connection went with it, and the child's next write got EPIPE.
//!
//! So an owner that exits while a fork child may hold one of its streams (a fork came after the
//! stream was made, or another process already uses it) does not end them: at its exit it forks
//! a keeper with the connections moving to it (`app::fork_moving`, as `daemon()` moves them), and
//! exits at once, as it would over TCP. The keeper is a process of its own (`setsid`, terminal
//! signals ignored, named `sdp-keeper`), holding none of the application's fds: it closes each
//! of its copies of the owner's streams as the owner's close would (a stream nobody else holds
//! closes as TCP's, what was written delivered first; one another process holds is pumped
//! through the kernel file until the last holder closes it), closes every other fd of the
//! application's (a pipe it held would keep the reader of the owner's output waiting), waits
//! until no stream is pumped any more, delivers what is left as an exit does, writes the
//! report lines of the streams it carried, and exits. A process that forked no child while it
//! held streams pays nothing.

use sdp_core::socket::app;
use sdp_core::socket::fd_limit;
use sdp_core::Transport;

use crate::table::{self, Sock};
use crate::{close_owned, log, real, report};

/// Connections not in the table are pumped for other processes (a listener's queued ones,
/// through their doorbells, before an exec: `AppListener::pump_queued`).
static PUMPS_BEYOND_TABLE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The exit to come must leave a keeper: connections outside the table are pumped.
pub(crate) fn want() {
    PUMPS_BEYOND_TABLE.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// In a fork child (not one connections move to): [`want`] was the parent's.
pub(crate) fn forget_in_child() {
    PUMPS_BEYOND_TABLE.store(false, std::sync::atomic::Ordering::SeqCst);
}

/// Whether this process holds a stream of its own over shm that another process may hold too
/// (a fork since it was made, or shared already), or pumps others ([`want`]).
fn wanted() -> bool {
    PUMPS_BEYOND_TABLE.load(std::sync::atomic::Ordering::SeqCst)
        || table::streams().into_iter().any(|(fd, s)| match &*s {
            Sock::Stream(st, _) => {
                !st.is_inherited()
                && st.transport() == Transport::Shm
                && (st.is_exposed() || st.is_shared())
                // Still open: an fd closed behind the shim's back (`fclose` of an `fdopen`ed
                // stream) is dropped here, and its pump already closed the connection.
                && table::get(fd).is_some()
            }
            _ => false,
        })
}

/// At the process's exit (the shim's exit work, before the flush): when other processes may
/// hold its streams, fork the keeper, which takes them; returns in this process (the streams
/// are the keeper's now: the flush and the report pass them by). The keeper never returns.
pub(crate) fn start_if_wanted() {
    if !wanted() {
        return;
    }
    fork_keeper("the SDP streams other processes may hold", "they end here");
}

/// Fork the keeper, which takes the process's connections (`what`, for the log) and never
/// returns; in this process, log where they went, or (`failed`) what became of them.
fn fork_keeper(what: &str, failed: &str) {
    // The program's name for the keeper's report lines, before it renames itself.
    report::program_name();
    match crate::fork_moving() {
        0 => keep(),
        -1 => log(format_args!(
            "exit: no keeper for {what} ({}): {failed}",
            std::io::Error::last_os_error()
        )),
        pid => log(format_args!("exit: {what} go on in keeper {pid}")),
    }
}

/// How long an exit waits for its peers to hold what was written before what is left goes on
/// in a keeper ([`hand_over_undelivered`]): a reading peer takes megabytes in that time.
const EXIT_GRACE: std::time::Duration = std::time::Duration::from_millis(10);

/// At the process's exit, after [`start_if_wanted`]: what the peers do not hold yet of what
/// was written (a peer that reads slowly, or not yet) goes on in a keeper, and the process
/// exits at once, as over TCP, whose kernel finishes an exiting process's connections. Before,
/// the exit waited for the peers to take it, up to `SDP_EXIT_LINGER_MS`, then reset what was
/// left. Over shm (connections over rdma cannot move: then the exit waits as before); nothing
/// when everything was delivered within a short grace. Returns in this process.
pub(crate) fn hand_over_undelivered() {
    if !sdp_core::socket::exit_flush_moves(EXIT_GRACE) {
        return;
    }
    fork_keeper(
        "the bytes the peers do not hold yet",
        "the exit waits for them",
    );
}

/// The keeper's life (see the module docs).
fn keep() -> ! {
    become_own_process();
    // The owner reports what it closed before; the keeper what it carries from here.
    report::forget_done();
    // Every fd of the application's that the shim knows, closed as the application's close
    // would (a stream other processes hold is pumped from now on).
    for fd in table::fds() {
        close_owned(fd);
    }
    // The rest of the application's fds: pipes, files, kernel TCP sockets, the terminal.
    let end = fd_limit::app_fds_end();
    if end > 0 {
        // SAFETY: closes fds of the application's, which nothing in this process uses any
        // more (its code does not run here).
        unsafe { real::close_range(0, end as libc::c_uint - 1, 0) };
    }
    // SAFETY: a constant path; the fd, if any, is at 0 (all low numbers are free).
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null == 0 {
            libc::dup2(0, 1);
            libc::dup2(0, 2);
        }
    }
    app::wait_for_other_holders();
    // As the kernel's orphaned TCP connections: on while the peers take what is left.
    sdp_core::socket::flush_while_progress(sdp_core::socket::exit_linger());
    report::write(Vec::new());
    // SAFETY: ends the process (no atexit handler of the application's may run here).
    unsafe { libc::syscall(libc::SYS_exit_group, 0 as libc::c_long) };
    unreachable!("exit_group returned")
}

/// Out of the owner's session and process group, deaf to the terminal's signals (the child
/// that holds the stream may outlive the terminal, as a TCP connection would), and named so
/// that `ps` and `pgrep PROGRAM` tell it apart.
fn become_own_process() {
    // SAFETY: plain system calls; the signal dispositions are constants, and no handler of
    // the application's may run in this process (its code does not).
    unsafe {
        libc::setsid();
        for sig in 1..libc::SIGRTMIN() {
            let ignore = matches!(
                sig,
                libc::SIGHUP
                    | libc::SIGINT
                    | libc::SIGQUIT
                    | libc::SIGPIPE
                    | libc::SIGTSTP
                    | libc::SIGTTIN
                    | libc::SIGTTOU
            );
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, if ignore { libc::SIG_IGN } else { libc::SIG_DFL });
            }
        }
        let set = {
            let mut s: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut s);
            s
        };
        libc::pthread_sigmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        libc::prctl(
            libc::PR_SET_NAME,
            c"sdp-keeper".as_ptr() as libc::c_ulong,
            0,
            0,
            0,
        );
    }
}
