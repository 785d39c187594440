//! getsockopt/setsockopt on SDP streams: answered as TCP would. The kernel file is an AF_UNIX
//! socket, so identity (SO_DOMAIN, SO_PROTOCOL), SO_ERROR, buffer sizes and the TCP level are
//! answered here; SO_RCVTIMEO/SO_SNDTIMEO are also applied to the file (blocking calls wait in
//! the kernel on it). Options SDP cannot honour are stored and read back, as TCP accepts them.

use libc::{c_int, c_void, socklen_t};

use crate::real;
use crate::table::Sock;

/// TCP's defaults as Linux reports them on a fresh connected socket.
fn default_int(level: c_int, name: c_int) -> Option<c_int> {
    Some(match (level, name) {
        (libc::SOL_SOCKET, libc::SO_TYPE) => libc::SOCK_STREAM,
        (libc::SOL_SOCKET, libc::SO_PROTOCOL) => libc::IPPROTO_TCP,
        (libc::SOL_SOCKET, libc::SO_ACCEPTCONN) => 0,
        (libc::SOL_SOCKET, libc::SO_RCVBUF) => 131072,
        (libc::SOL_SOCKET, libc::SO_SNDBUF) => 16384,
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE) => 0,
        (libc::SOL_SOCKET, libc::SO_REUSEADDR) => 0,
        (libc::SOL_SOCKET, libc::SO_REUSEPORT) => 0,
        (libc::SOL_SOCKET, libc::SO_OOBINLINE) => 0,
        (libc::SOL_SOCKET, libc::SO_RCVLOWAT) => 1,
        (libc::SOL_SOCKET, libc::SO_SNDLOWAT) => 1,
        (libc::SOL_SOCKET, libc::SO_PRIORITY) => 0,
        (libc::SOL_SOCKET, libc::SO_BROADCAST) => 0,
        (libc::SOL_SOCKET, libc::SO_DONTROUTE) => 0,
        (libc::SOL_SOCKET, libc::SO_MARK) => 0,
        (libc::IPPROTO_TCP, libc::TCP_NODELAY) => 0,
        (libc::IPPROTO_TCP, libc::TCP_CORK) => 0,
        (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => 65483,
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => 7200,
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL) => 75,
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT) => 9,
        (libc::IPPROTO_TCP, libc::TCP_QUICKACK) => 1,
        (libc::IPPROTO_TCP, libc::TCP_DEFER_ACCEPT) => 0,
        (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT) => 0,
        (libc::IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT) => 0,
        (libc::IPPROTO_IP, libc::IP_TOS) => 0,
        (libc::IPPROTO_IP, libc::IP_TTL) => 64,
        (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => 0,
        (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => 0,
        _ => return None,
    })
}

/// Copy `bytes` to the caller's (val, len) as the kernel does (truncating to `*len`).
unsafe fn put(bytes: &[u8], val: *mut c_void, len: *mut socklen_t) -> c_int {
    if len.is_null() {
        crate::set_errno(libc::EFAULT);
        return -1;
    }
    // SAFETY: the caller's length pointer.
    let room = unsafe { *len };
    if (room as i32) < 0 {
        crate::set_errno(libc::EINVAL);
        return -1;
    }
    let n = (room as usize).min(bytes.len());
    if n > 0 {
        if val.is_null() {
            crate::set_errno(libc::EFAULT);
            return -1;
        }
        // SAFETY: the caller's buffer holds `room` >= `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), val.cast::<u8>(), n) };
    }
    // SAFETY: as above.
    unsafe { *len = n as socklen_t };
    0
}

/// `struct tcp_info` as far as SDP knows it (the rest zero), in the kernel's layout.
fn tcp_info(st: &sdp_core::socket::app::AppStream) -> Vec<u8> {
    use sdp_core::proto::State;
    let mut b = vec![0u8; 232];
    let Ok(i) = st.info() else {
        return b;
    };
    // Linux TCP states: 1 ESTABLISHED, 4 FIN_WAIT1, 5 FIN_WAIT2, 7 CLOSE, 8 CLOSE_WAIT. Our
    // end sent (FIN_WAIT2 once nothing of ours is left to deliver: the peer has it).
    b[0] = match (i.state, i.read_closed, i.write_closed) {
        (State::Established, false, false) => 1,
        (State::Established, true, false) => 8,
        (State::Established, false, true) if i.tx_queued == 0 => 5,
        (State::Established, _, true) => 4,
        (State::Closed, ..) => 7,
        _ => 1,
    };
    let mss = i.send_size.max(1);
    // tcpi_snd_mss (offset 16) and tcpi_rcv_mss (20).
    b[16..20].copy_from_slice(&mss.to_ne_bytes());
    b[20..24].copy_from_slice(&mss.to_ne_bytes());
    // tcpi_bytes_acked (120) and tcpi_bytes_received (128).
    let acked = i.bytes_out.saturating_sub(i.tx_queued as u64);
    b[120..128].copy_from_slice(&acked.to_ne_bytes());
    b[128..136].copy_from_slice(&i.bytes_in.to_ne_bytes());
    // tcpi_bytes_sent (200 on recent kernels).
    b[200..208].copy_from_slice(&i.bytes_out.to_ne_bytes());
    b
}

/// `struct tcp_info` of a stream whose counters live in another process: established.
fn established_info() -> Vec<u8> {
    let mut b = vec![0u8; 232];
    b[0] = 1;
    b
}

pub(crate) unsafe fn get(
    s: &Sock,
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let Some((st, opts)) = s.stream_parts() else {
        unreachable!()
    };
    let int = |v: c_int| v.to_ne_bytes().to_vec();
    let bytes = match (level, name) {
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO | libc::SO_SNDTIMEO) => {
            // Held by the kernel file.
            // SAFETY: forwards the caller's buffers.
            return unsafe { real::getsockopt(fd, level, name, val, len) };
        }
        (libc::SOL_SOCKET, libc::SO_DOMAIN) => {
            let o = opts.lock();
            int(if o.v6 || o.local.is_some_and(|a| a.is_ipv6()) {
                libc::AF_INET6
            } else {
                libc::AF_INET
            })
        }
        // A stream got through exec: its errors show on the kernel file (a reset), as its
        // bytes do.
        (libc::SOL_SOCKET, libc::SO_ERROR) => int(match st.map(|st| st.take_error()) {
            Some(Ok(Some(e))) => {
                // Reported: as TCP's `sk_err` once taken, the kernel file's reset (POLLERR)
                // goes too (POLLHUP stays).
                let _ = crate::kernel_int(fd, libc::SOL_SOCKET, libc::SO_ERROR);
                e.raw_os_error().unwrap_or(libc::EIO)
            }
            _ => 0,
        }),
        (libc::IPPROTO_TCP, libc::TCP_INFO) => match st {
            Some(st) => tcp_info(st),
            None => established_info(),
        },
        // Not bound to a device: TCP answers an empty name (sshd logs `rdomain ""` from it).
        (libc::SOL_SOCKET, libc::SO_BINDTODEVICE) => opts
            .lock()
            .stored
            .get(&(level, name))
            .cloned()
            .unwrap_or_default(),
        (libc::SOL_SOCKET, libc::SO_LINGER) => opts
            .lock()
            .stored
            .get(&(level, name))
            .cloned()
            .unwrap_or_else(|| vec![0u8; std::mem::size_of::<libc::linger>()]),
        // The algorithm's name in a TCP_CA_NAME_MAX (16) field: the one set, else the
        // system's default (what a new TCP socket gets).
        (libc::IPPROTO_TCP, libc::TCP_CONGESTION) => {
            let mut name = opts
                .lock()
                .stored
                .get(&(level, name))
                .cloned()
                .unwrap_or_else(|| {
                    sdp_core::socket::fd_limit::with_room(|| {
                        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
                    })
                    .map(|s| s.trim().as_bytes().to_vec())
                    .unwrap_or_else(|_| b"cubic".to_vec())
                });
            if let Some(nul) = name.iter().position(|&c| c == 0) {
                name.truncate(nul);
            }
            name.resize(16, 0);
            name
        }
        _ => match opts.lock().stored.get(&(level, name)) {
            Some(v) => v.clone(),
            None => match default_int(level, name) {
                Some(v) => int(v),
                None => {
                    crate::set_errno(libc::ENOPROTOOPT);
                    return -1;
                }
            },
        },
    };
    // SAFETY: the caller's buffers.
    unsafe { put(&bytes, val, len) }
}

pub(crate) unsafe fn set(
    s: &Sock,
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    let Some((st, opts)) = s.stream_parts() else {
        unreachable!()
    };
    if (len as i32) < 0 || (len > 0 && val.is_null()) {
        crate::set_errno(if val.is_null() {
            libc::EFAULT
        } else {
            libc::EINVAL
        });
        return -1;
    }
    let bytes: Vec<u8> = if len == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller's buffer of `len` bytes.
        unsafe { std::slice::from_raw_parts(val.cast::<u8>(), len as usize) }.to_vec()
    };
    let int = || -> Option<c_int> {
        (bytes.len() >= 4).then(|| c_int::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    };
    match (level, name) {
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO | libc::SO_SNDTIMEO) => {
            // SAFETY: forwards the caller's buffers to the kernel file.
            return unsafe { real::setsockopt(fd, level, name, val, len) };
        }
        (libc::SOL_SOCKET, libc::SO_LINGER) => {
            if bytes.len() < std::mem::size_of::<libc::linger>() {
                crate::set_errno(libc::EINVAL);
                return -1;
            }
            let word = |i: usize| {
                c_int::from_ne_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]])
            };
            let (on, secs) = (word(0) != 0, word(4));
            // As Linux: off keeps the time set before; a negative time is "forever".
            let mut o = opts.lock();
            let secs = if on {
                secs
            } else {
                o.stored
                    .get(&(level, name))
                    .map_or(0, |b| c_int::from_ne_bytes([b[4], b[5], b[6], b[7]]))
            };
            let linger = on.then(|| {
                std::time::Duration::from_secs(if secs < 0 {
                    u32::MAX as u64
                } else {
                    secs as u64
                })
            });
            if let Some(st) = st {
                let _ = st.set_linger(linger);
            }
            o.stored.insert((level, name), linger_bytes(on, secs));
            return 0;
        }
        (
            libc::SOL_SOCKET,
            libc::SO_TYPE | libc::SO_DOMAIN | libc::SO_PROTOCOL | libc::SO_ERROR,
        )
        | (libc::SOL_SOCKET, libc::SO_ACCEPTCONN)
        | (libc::IPPROTO_TCP, libc::TCP_INFO) => {
            crate::set_errno(libc::ENOPROTOOPT);
            return -1;
        }
        _ => {}
    }
    let Some(v) = int() else {
        if level == libc::SOL_SOCKET && name == libc::SO_LINGER {
            crate::set_errno(libc::EINVAL);
            return -1;
        }
        if default_int(level, name).is_some() {
            crate::set_errno(libc::EINVAL);
            return -1;
        }
        opts.lock().stored.insert((level, name), bytes);
        return 0;
    };
    let stored = match (level, name) {
        (libc::IPPROTO_TCP, libc::TCP_NODELAY) => {
            if let Some(st) = st {
                let _ = st.set_nodelay(v != 0);
            }
            int().map(|v| (v != 0) as c_int)
        }
        (libc::SOL_SOCKET, libc::SO_OOBINLINE) => {
            if let Some(st) = st {
                let _ = st.set_oob_inline(v != 0);
            }
            int().map(|v| (v != 0) as c_int)
        }
        // Linux doubles a buffer size (from its minimum) and reports the doubled size; the
        // stream's buffers follow the doubled size (the receive side within the stack's bounds).
        (libc::SOL_SOCKET, libc::SO_SNDBUF) => {
            crate::table::note_buffer_set(fd, name);
            let b = doubled(v, 2304);
            if let Some(st) = st {
                let _ = st.set_send_buffer_size(b as usize);
            }
            Some(b)
        }
        (libc::SOL_SOCKET, libc::SO_RCVBUF) => {
            crate::table::note_buffer_set(fd, name);
            let b = doubled(v, 1152);
            if let Some(st) = st {
                let _ = st.set_recv_buffer_size(b as usize);
            }
            Some(b)
        }
        (libc::SOL_SOCKET, libc::SO_RCVLOWAT) => {
            let b = rcvlowat_as_linux(fd, &opts.lock(), v);
            if let Some(st) = st {
                let _ = st.set_rcvlowat(fd, b as usize);
            }
            Some(b)
        }
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE | libc::SO_REUSEADDR | libc::SO_REUSEPORT)
        | (libc::IPPROTO_TCP, libc::TCP_CORK | libc::TCP_QUICKACK) => Some((v != 0) as c_int),
        // A stream socket's IP_TOS sets its priority too (Linux's `rt_tos2priority`).
        (libc::IPPROTO_IP, libc::IP_TOS) => {
            const TOS2PRIO: [c_int; 8] = [0, 0, 2, 2, 6, 6, 4, 4];
            let prio = TOS2PRIO[((v & 0x1e) >> 2) as usize];
            opts.lock().stored.insert(
                (libc::SOL_SOCKET, libc::SO_PRIORITY),
                prio.to_ne_bytes().to_vec(),
            );
            None
        }
        _ => None,
    };
    let val = match stored {
        Some(x) => x.to_ne_bytes().to_vec(),
        None => bytes,
    };
    opts.lock().stored.insert((level, name), val);
    0
}

/// SO_RCVLOWAT as Linux keeps it (`tcp_set_rcvlowat`): a negative value is `INT_MAX`, 0 is
/// 1, and at most half the receive buffer (SO_RCVBUF where the application set it, else the
/// largest `net.ipv4.tcp_rmem`).
fn rcvlowat_as_linux(fd: c_int, o: &crate::Opts, v: c_int) -> c_int {
    let v = if v < 0 { c_int::MAX } else { v };
    let rcvbuf = crate::table::buffer_set(fd, libc::SO_RCVBUF)
        .then(|| o.stored.get(&(libc::SOL_SOCKET, libc::SO_RCVBUF)))
        .flatten()
        .filter(|b| b.len() >= 4)
        .map(|b| c_int::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .unwrap_or_else(|| {
            sdp_core::socket::fd_limit::with_room(|| {
                std::fs::read_to_string("/proc/sys/net/ipv4/tcp_rmem")
            })
            .ok()
            .and_then(|t| t.split_whitespace().nth(2)?.parse().ok())
            .unwrap_or(6 << 20)
        });
    v.min(rcvbuf >> 1).max(1)
}

/// A buffer size as Linux keeps it: at least `min`, doubled, at most `c_int::MAX`.
fn doubled(v: c_int, min: c_int) -> c_int {
    (v.max(min) as i64 * 2).min(c_int::MAX as i64) as c_int
}

/// SO_LINGER as stored and read back: a `struct linger` (`l_onoff` 0 or 1, `l_linger`).
pub(crate) fn linger_bytes(on: bool, secs: c_int) -> Vec<u8> {
    let mut v = (on as c_int).to_ne_bytes().to_vec();
    v.extend_from_slice(&secs.to_ne_bytes());
    v
}
