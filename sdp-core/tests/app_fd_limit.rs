//! An application at its own fd limit under the shim (`fd_limit::app_slot`): a socket it makes
//! past the limit takes the number it would have had over TCP when that number is held only
//! for a moment by an fd of SDP's (made by the kernel at the lowest free number, then moved
//! above the application's numbers), and is EMFILE (`None`) when the application's numbers
//! are all its own; accept's look for room (`fd_limit::app_has_room`) likewise. (Before:
//! EMFILE whenever SDP's progress thread held such an fd at that moment; CI saw the fd-limit
//! corners case make 22 sockets under the shim, 23 over TCP.)
//! A file of its own: the test relies on which fd numbers are free in this process.
#![cfg(target_os = "linux")]

use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::sync::mpsc;
use std::time::Duration;

use sdp_core::socket::fd_limit::{app_has_room, app_slot, LowFds};

fn socket() -> RawFd {
    // SAFETY: plain socket creation; the fd is handed to app_slot or closed by the test.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    fd
}

fn is_open(fd: RawFd) -> bool {
    // SAFETY: F_GETFD on any number only reads its flags.
    unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
}

fn cloexec(fd: RawFd) -> bool {
    // SAFETY: as above.
    unsafe { libc::fcntl(fd, libc::F_GETFD) & libc::FD_CLOEXEC != 0 }
}

#[test]
fn a_number_ours_only_for_a_moment_is_the_applications() {
    // The lowest free number, taken by "one of SDP's" fds: the application's limit is just
    // above it, so it is the application's last number.
    let ours = std::fs::File::open("/dev/null").unwrap();
    let last = ours.as_raw_fd();
    let app = last as u64 + 1;

    // SDP holds it for a moment (as between making an fd and moving it up), then lets go.
    let (held, is_held) = mpsc::channel();
    let mover = std::thread::spawn(move || {
        let low = LowFds::hold();
        held.send(()).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        drop(ours);
        drop(low);
    });
    is_held.recv().unwrap();
    let s = socket();
    assert!(s as u64 >= app, "the socket got {s}, past the limit {app}");
    let got = app_slot(s, app, true);
    mover.join().unwrap();
    assert_eq!(got, Some(last), "the application's last number");
    assert!(cloexec(last), "SOCK_CLOEXEC kept");
    assert!(!is_open(s), "the socket's first number closed");

    // The same number held by the application itself (nothing of SDP's is low): EMFILE at
    // once, and the socket closed; accept has no room either.
    assert!(!app_has_room(last, app), "accept's look: no room");
    let s = socket();
    let got = app_slot(s, app, false);
    assert_eq!(got, None, "the application's numbers are all its own");
    assert!(!is_open(s), "the socket closed");

    // Its number free: it is the application's again (no FD_CLOEXEC asked for, none given).
    // SAFETY: `last` is the socket app_slot gave us above.
    unsafe { libc::close(last) };
    let hold = std::fs::File::open("/dev/null").unwrap().into_raw_fd();
    assert_eq!(hold, last);
    let s = socket();
    // SAFETY: our own fd, freed so the next look finds it.
    unsafe { libc::close(hold) };
    assert!(app_has_room(s, app), "accept's look: room");
    assert!(!is_open(last), "accept's look left nothing open");
    assert_eq!(app_slot(s, app, false), Some(last));
    assert!(!cloexec(last), "no FD_CLOEXEC asked for");
    // SAFETY: our own fd.
    unsafe { libc::close(last) };
}
