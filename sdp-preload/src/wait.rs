//! Event waits (`epoll_wait`, `poll`, `select` and their kin): the kernel answers them on the
//! real fds; while the process has SDP streams they first poll for a moment instead of
//! sleeping at once (`app::poll_events`, docs/waiting.md §5). `select` needs its sets put back
//! before each try (the kernel overwrites them) and its timeout updated as Linux does.

use std::time::Duration;

use libc::{c_int, fd_set, sigset_t, timespec, timeval};
use sdp_core::socket::app;

use crate::real;

/// The timeout a call was given as (seconds, nanoseconds), or none (a null pointer): `Err` if
/// it is not a valid length (the kernel's EINVAL; the call goes to libc as it is).
fn given(t: Option<(i64, i64)>) -> Result<Option<Duration>, ()> {
    let Some((secs, nanos)) = t else {
        return Ok(None);
    };
    let secs = u64::try_from(secs).map_err(|_| ())?;
    let nanos = u32::try_from(nanos)
        .ok()
        .filter(|&n| n < 1_000_000_000)
        .ok_or(())?;
    Ok(Some(Duration::new(secs, nanos)))
}

fn to_timeval(d: Duration) -> timeval {
    timeval {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_usec: d.subsec_micros() as libc::suseconds_t,
    }
}

fn to_timespec(d: Duration) -> timespec {
    timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    }
}

/// The time left as a timespec for a real call (`None`: no timeout, a null pointer), made by
/// `call` while it lives.
fn with_timespec<R>(left: Option<Duration>, call: impl FnOnce(*const timespec) -> R) -> R {
    let t = left.map(to_timespec);
    call(
        t.as_ref()
            .map_or(std::ptr::null(), |t| t as *const timespec),
    )
}

/// The caller's `select` sets as given, to put back before each try.
struct Sets {
    given: [(*mut fd_set, Vec<u8>); 3],
}

impl Sets {
    /// # Safety
    /// Each non-null set holds at least `nfds` bits (rounded up to whole longs), as `select`
    /// requires of its caller.
    unsafe fn save(nfds: c_int, sets: [*mut fd_set; 3]) -> Sets {
        let bytes = (nfds.max(0) as usize).div_ceil(64) * 8;
        Sets {
            given: sets.map(|p| {
                let copy = if p.is_null() {
                    Vec::new()
                } else {
                    // SAFETY: the caller's set holds `bytes` bytes (see above).
                    unsafe { std::slice::from_raw_parts(p.cast::<u8>(), bytes) }.to_vec()
                };
                (p, copy)
            }),
        }
    }

    fn restore(&self) {
        for (p, copy) in &self.given {
            if !p.is_null() {
                // SAFETY: `p` is the caller's set, `copy.len()` bytes long (see `save`).
                unsafe { std::ptr::copy_nonoverlapping(copy.as_ptr(), p.cast::<u8>(), copy.len()) };
            }
        }
    }
}

/// `select` polling first. Linux writes the time not slept back into `tv`.
///
/// # Safety
/// As for `select(2)`.
pub(crate) unsafe fn select(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    tv: *mut timeval,
) -> c_int {
    // SAFETY: the caller's timeval, if any.
    let Ok(timeout) = given(unsafe { tv.as_ref() }.map(|t| (t.tv_sec, t.tv_usec * 1000))) else {
        // SAFETY: forwards the caller's arguments (the kernel says EINVAL).
        return unsafe { real::select(nfds, r, w, e, tv) };
    };
    // SAFETY: the caller's sets hold `nfds` bits.
    let sets = unsafe { Sets::save(nfds, [r, w, e]) };
    let start = std::time::Instant::now();
    let n = app::poll_events_for(timeout, |left| {
        sets.restore();
        let mut t = left.map(to_timeval);
        let tp = t
            .as_mut()
            .map_or(std::ptr::null_mut(), |t| t as *mut timeval);
        // SAFETY: the caller's sets, our timeval.
        unsafe { real::select(nfds, r, w, e, tp) }
    });
    if let Some(d) = timeout {
        // SAFETY: the caller's timeval.
        unsafe { *tv = to_timeval(d.saturating_sub(start.elapsed())) };
    }
    n
}

/// An event wait made by `call(time left, mask)` (`Some(ZERO)`: a poll), polling first; with
/// the caller's signal mask for the wait if it gave one (`app::poll_events_masked`: polls go
/// without it, the wait after them with it).
fn polling(
    timeout: Option<Duration>,
    mask: *const sigset_t,
    call: impl Fn(Option<Duration>, *const sigset_t) -> c_int,
) -> c_int {
    // SAFETY: the caller's mask, if any, is a live sigset.
    match unsafe { mask.as_ref() } {
        None => app::poll_events_for(timeout, |left| call(left, std::ptr::null())),
        Some(m) => app::poll_events_masked(
            timeout,
            m,
            || call(Some(Duration::ZERO), std::ptr::null()),
            |left| call(left, mask),
        ),
    }
}

/// `pselect` polling first (the timeout is not written back).
///
/// # Safety
/// As for `pselect(2)`.
pub(crate) unsafe fn pselect(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    // SAFETY: the caller's timespec, if any.
    let Ok(timeout) = given(unsafe { ts.as_ref() }.map(|t| (t.tv_sec, t.tv_nsec))) else {
        // SAFETY: forwards the caller's arguments (the kernel says EINVAL).
        return unsafe { real::pselect(nfds, r, w, e, ts, mask) };
    };
    // SAFETY: the caller's sets hold `nfds` bits.
    let sets = unsafe { Sets::save(nfds, [r, w, e]) };
    polling(timeout, mask, |left, mask| {
        sets.restore();
        // SAFETY: the caller's sets and mask, our timespec.
        with_timespec(left, |tp| unsafe { real::pselect(nfds, r, w, e, tp, mask) })
    })
}

/// `ppoll` polling first.
///
/// # Safety
/// As for `ppoll(2)`.
pub(crate) unsafe fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    // SAFETY: the caller's timespec, if any.
    let Ok(timeout) = given(unsafe { ts.as_ref() }.map(|t| (t.tv_sec, t.tv_nsec))) else {
        // SAFETY: forwards the caller's arguments (the kernel says EINVAL).
        return unsafe { real::ppoll(fds, n, ts, mask) };
    };
    polling(timeout, mask, |left, mask| {
        // SAFETY: the caller's pollfds and mask, our timespec.
        with_timespec(left, |tp| unsafe { real::ppoll(fds, n, tp, mask) })
    })
}

/// `epoll_pwait` polling first.
///
/// # Safety
/// As for `epoll_pwait(2)`.
pub(crate) unsafe fn epoll_pwait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    polling(app::timeout_of_ms(timeout), mask, |left, mask| {
        // SAFETY: the caller's epoll fd, events array and mask.
        unsafe { real::epoll_pwait(epfd, ev, max, app::ms_of_timeout(left), mask) }
    })
}

/// `epoll_pwait2` polling first.
///
/// # Safety
/// As for `epoll_pwait2(2)`.
pub(crate) unsafe fn epoll_pwait2(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    // SAFETY: the caller's timespec, if any.
    let Ok(timeout) = given(unsafe { ts.as_ref() }.map(|t| (t.tv_sec, t.tv_nsec))) else {
        // SAFETY: forwards the caller's arguments (the kernel says EINVAL).
        return unsafe { real::epoll_pwait2(epfd, ev, max, ts, mask) };
    };
    polling(timeout, mask, |left, mask| {
        // SAFETY: the caller's epoll fd, events array and mask, our timespec.
        with_timespec(left, |tp| unsafe {
            real::epoll_pwait2(epfd, ev, max, tp, mask)
        })
    })
}
