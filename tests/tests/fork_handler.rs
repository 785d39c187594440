//! A fork child's own atfork handler may drop sockets it inherited (the LD_PRELOAD shim's
//! does: a listening socket shared with a child is served by kernel TCP only). The parent's
//! stacks are inert in the child: touching them must not wait on a lock another thread of the
//! parent held at the fork (it would never be released). qperf's forked server hung that way
//! under the shim: the child blocked for ever closing the listener it inherited.
//!
//! Its own test binary: the handler below must be registered before the socket layer's first
//! use in the process, as the shim's is.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sdp_core::socket::{Options, SdpListener};

static LISTENER: Mutex<Option<SdpListener>> = Mutex::new(None);

extern "C" fn child_drops_the_listener() {
    // Only the forking thread (the test's) touches LISTENER, so it is not held at the fork.
    let l = LISTENER.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(l);
}

/// Wait for `pid` at most `limit`: its exit status, or None if it is still running.
fn wait_child(pid: libc::pid_t, limit: Duration) -> Option<i32> {
    let t = Instant::now();
    loop {
        let mut st = 0;
        // SAFETY: our own child and a live status word.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        assert!(r >= 0, "waitpid: {}", std::io::Error::last_os_error());
        if r == pid {
            return Some(st);
        }
        if t.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_fork_childs_handler_can_drop_an_inherited_listener() {
    // SAFETY: registers a plain function to run in fork children.
    assert_eq!(
        unsafe { libc::pthread_atfork(None, None, Some(child_drops_the_listener)) },
        0
    );
    let stack = sdp_core::socket::Stack::with_provider(
        sdp_core::verbs::shm::ShmProvider::new().unwrap(),
        Default::default(),
    )
    .unwrap();
    let opts = Options::sdp_only().with_stack(stack);
    let addr: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    // Another thread keeps taking the stack's lock, so a fork often copies it held.
    let busy = SdpListener::bind_with(addr, &opts).unwrap();
    busy.set_nonblocking(true).unwrap();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let spinner = std::thread::spawn(move || {
        while !st.load(Ordering::Relaxed) {
            let _ = busy.accept();
        }
    });
    for i in 0..60 {
        *LISTENER.lock().unwrap() = Some(SdpListener::bind_with(addr, &opts).unwrap());
        // SAFETY: the child runs the atfork handlers and then only _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: ends the child at once, as fork's child should in a threaded program.
            unsafe { libc::_exit(0) };
        }
        let status = wait_child(pid, Duration::from_secs(10));
        if status.is_none() {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            wait_child(pid, Duration::from_secs(10));
        }
        assert_eq!(
            status,
            Some(0),
            "fork {i}: the child hung in its atfork handler dropping the listener"
        );
        LISTENER.lock().unwrap().take();
    }
    stop.store(true, Ordering::Relaxed);
    spinner.join().unwrap();
}
