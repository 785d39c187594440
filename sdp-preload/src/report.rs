//! `SDP_REPORT=FILE`: at exit each process appends one JSON line per socket it handled (pid,
//! program, local, peer, transport shm|rdma|tcp, bytes in/out, zero-copy bytes, fallback
//! reason, whether the stream's bytes went through its kernel file because another process
//! used the fd), so a run can prove which transport carried its bytes.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use sdp_core::socket::app::AppStream;

use crate::table;

/// A fork child may find these lists locked by a thread it does not have: a spin lock is
/// unlocked there by one store (a parking_lot one could hand itself to that thread).
type ForkMutex<T> = spin::mutex::SpinMutex<T, spin::relax::Yield>;

/// One socket's line.
#[derive(Debug, Clone, Default)]
pub(crate) struct Record {
    pub(crate) role: &'static str,
    pub(crate) local: Option<std::net::SocketAddr>,
    pub(crate) peer: Option<std::net::SocketAddr>,
    pub(crate) transport: String,
    pub(crate) bytes_in: u64,
    pub(crate) bytes_out: u64,
    pub(crate) zcopy_bytes: u64,
    pub(crate) fallback: Option<String>,
    /// The stream's bytes went through its kernel file (another process used the fd), pumped
    /// by this process: read when the line is written (a stream closed by its owner may be
    /// shared at that close, after its record was taken).
    pub(crate) shared: Option<std::sync::Arc<sdp_core::socket::app::Sharing>>,
}

static DONE: ForkMutex<Vec<Record>> = ForkMutex::new(Vec::new());
static WRITTEN: AtomicBool = AtomicBool::new(false);

/// `SDP_REPORT`, read when the shim starts (a program may clear its environment later, as
/// nginx does).
static PATH: std::sync::OnceLock<Option<std::ffi::OsString>> = std::sync::OnceLock::new();

/// Read the environment now.
pub(crate) fn init() {
    PATH.get_or_init(|| std::env::var_os("SDP_REPORT").filter(|v| !v.is_empty()));
}

pub(crate) fn wanted() -> bool {
    init();
    PATH.get().is_some_and(|p| p.is_some())
}

/// A stream's record from its live state (the addresses kept in its options where the runtime
/// no longer has the connection: a shared one its pump closed).
pub(crate) fn of_stream(o: &crate::table::Opts, s: &AppStream) -> Record {
    let info = s.info().ok();
    Record {
        role: o.role,
        local: s.local_addr().ok().or(o.local),
        peer: s.peer_addr().ok().or(o.peer),
        transport: s.transport().to_string(),
        bytes_in: info.as_ref().map_or(0, |i| i.bytes_in),
        bytes_out: info.as_ref().map_or(0, |i| i.bytes_out),
        zcopy_bytes: info.as_ref().map_or(0, |i| i.zcopy_bytes),
        fallback: None,
        shared: Some(s.sharing()),
    }
}

/// `c`, accepted by a listener of ours from `peer`, is a kernel TCP connection, for `why`.
pub(crate) fn tcp_server(c: i32, peer: Option<std::net::SocketAddr>, why: &str) {
    tcp_fallback(
        c,
        Record {
            role: "server",
            peer,
            transport: "tcp".into(),
            fallback: Some(why.into()),
            ..Default::default()
        },
    );
}

/// Kernel TCP sockets the shim let go (fallbacks), whose lines wait for their byte counts:
/// (fd, its file, the record). The counts come from the kernel's TCP_INFO when the fd closes
/// (the close hook asks [`tcp_watched`] first) or at exit.
static TCP: ForkMutex<Vec<TcpLine>> = ForkMutex::new(Vec::new());
/// A kernel TCP socket's waiting line.
struct TcpLine {
    /// The process's fds of the socket (its dups too), in the order they came: the line is
    /// finished when the last closes (or at exit).
    fds: Vec<i32>,
    /// The fd's file.
    id: (u64, u64),
    r: Record,
    /// Inherited at a fork: the socket's counts then. A line says the socket's counts when
    /// this process let it go; an inherited socket nothing moved on since the fork gets none
    /// (a BGSAVE child's copies of every client), one that did gets the whole (a forking
    /// server's child: its line has the connection, the server's what went before its close).
    at_fork: Option<(u64, u64)>,
}

impl TcpLine {
    /// Its record with its counts (read through `fd`, one of its fds still open); `None` for an
    /// inherited socket nothing moved on since.
    fn finish(self, fd: i32) -> Option<Record> {
        for &f in &self.fds {
            TCP_WATCHED[f as usize].store(false, Ordering::Relaxed);
        }
        let r = with_tcp_counts(fd, self.id, self.r);
        (self.at_fork != Some((r.bytes_in, r.bytes_out))).then_some(r)
    }
}
static TCP_WATCHED: [AtomicBool; table::MAX_FD] = [const { AtomicBool::new(false) }; table::MAX_FD];

/// A connection went by kernel TCP on `fd` (`r`: its record without counts): its line is
/// written once its counts are known (at its close or at exit).
pub(crate) fn tcp_fallback(fd: i32, r: Record) {
    if !wanted() {
        return;
    }
    let Some(id) = table::file_id(fd).filter(|_| (fd as u32 as usize) < table::MAX_FD) else {
        push(r);
        return;
    };
    let mut g = TCP.lock();
    // (A line whose fd was closed behind our back, by a raw system call: that fd is not its.)
    for l in g.iter_mut() {
        l.fds.retain(|&f| f != fd);
    }
    g.retain(|l| !l.fds.is_empty());
    g.push(TcpLine {
        fds: vec![fd],
        id,
        r,
        at_fork: None,
    });
    TCP_WATCHED[fd as usize].store(true, Ordering::Relaxed);
}

/// Whether `fd` is a kernel TCP socket whose line waits for its counts (one load: the close
/// hook's path for other fds).
#[inline]
pub(crate) fn tcp_watched(fd: i32) -> bool {
    (fd as u32 as usize) < table::MAX_FD && TCP_WATCHED[fd as usize].load(Ordering::Relaxed)
}

/// `fd`, a watched kernel TCP socket, is about to close: its line gets its counts now, unless
/// another fd of the process still holds the socket (a dup: the line follows it).
pub(crate) fn tcp_closing(fd: i32) {
    TCP_WATCHED[fd as usize].store(false, Ordering::Relaxed);
    let taken = {
        let mut g = TCP.lock();
        let Some(i) = g.iter().position(|l| l.fds.contains(&fd)) else {
            return;
        };
        g[i].fds.retain(|&f| f != fd);
        if !g[i].fds.is_empty() {
            return;
        }
        g.swap_remove(i)
    };
    if let Some(r) = taken.finish(fd) {
        push(r);
    }
}

/// `new` was made a duplicate of `old`, a watched kernel TCP socket (dup, dup2, dup3,
/// F_DUPFD): the line follows the socket to it, so what goes through the dup counts after
/// `old` closes (before, the line was finished at the first close, without it).
pub(crate) fn tcp_dup(old: i32, new: i32) {
    if old == new || (new as u32 as usize) >= table::MAX_FD {
        return;
    }
    let mut g = TCP.lock();
    let Some(l) = g.iter_mut().find(|l| l.fds.contains(&old)) else {
        return;
    };
    if table::file_id(new) != Some(l.id) || l.fds.contains(&new) {
        return;
    }
    l.fds.push(new);
    TCP_WATCHED[new as usize].store(true, Ordering::Relaxed);
}

/// `r` with the byte counts of the kernel TCP socket `fd` if it is still the file `id`.
fn with_tcp_counts(fd: i32, id: (u64, u64), mut r: Record) -> Record {
    if table::file_id(fd) != Some(id) {
        return r;
    }
    if let Some((i, o)) = tcp_counts(fd) {
        (r.bytes_in, r.bytes_out) = (i, o);
    }
    if r.local.is_none() {
        r.local = crate::kernel_sockname(fd);
    }
    r
}

/// The data bytes the kernel TCP socket `fd` received and sent (TCP_INFO), if it says.
fn tcp_counts(fd: i32) -> Option<(u64, u64)> {
    let mut b = [0u8; 232];
    let mut len = b.len() as libc::socklen_t;
    // SAFETY: our own buffer and its length.
    let ok = unsafe {
        crate::real::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            b.as_mut_ptr().cast(),
            &mut len,
        )
    } == 0;
    if !ok || (len as usize) < 136 {
        return None;
    }
    let u64_at = |o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap());
    // tcpi_bytes_acked (120) and tcpi_bytes_received (128) count a FIN as one byte: not data.
    // tcpi_bytes_sent (200, kernels since 4.19) counts data only (with retransmits). The peer's
    // FIN was received in Linux states 6 TIME_WAIT, 7 CLOSE (after LAST_ACK), 8 CLOSE_WAIT, 9
    // LAST_ACK and 11 CLOSING; ours is acknowledged in 5 FIN_WAIT2 and 6.
    let state = b[0];
    let fin_in = matches!(state, 6..=9 | 11) as u64;
    let bytes_out = if len as usize >= 208 {
        u64_at(120).min(u64_at(200))
    } else {
        u64_at(120).saturating_sub(matches!(state, 5 | 6) as u64)
    };
    Some((u64_at(128).saturating_sub(fin_in), bytes_out))
}

/// The lines of the kernel TCP sockets still open (at exit), with their counts.
pub(crate) fn tcp_live() -> Vec<Record> {
    let all = std::mem::take(&mut *TCP.lock());
    all.into_iter()
        .filter_map(|l| {
            let fd = l.fds[0];
            l.finish(fd)
        })
        .collect()
}

/// Before fork(): hold the lists, so the child gets them whole.
pub(crate) fn lock_for_fork() {
    std::mem::forget(DONE.lock());
    std::mem::forget(TCP.lock());
}

/// After fork(), in both processes.
pub(crate) fn unlock_after_fork() {
    // SAFETY: this thread locked both in `lock_for_fork` (the child is its copy) and forgot
    // the guards.
    unsafe {
        TCP.force_unlock();
        DONE.force_unlock();
    }
}

/// In a forked child (after [`unlock_after_fork`]): the parent's finished sockets are the
/// parent's to report. Its kernel TCP sockets still open are the child's too: a forking
/// server's child serves the connection its parent accepted and closed, so it reports those
/// something moves on from now on (`TcpLine::at_fork`).
pub(crate) fn forget_inherited() {
    DONE.lock().clear();
    if !wanted() {
        return;
    }
    let mut g = TCP.lock();
    for l in g.iter_mut() {
        let fd = l.fds[0];
        let same = table::file_id(fd) == Some(l.id);
        l.at_fork = Some(same.then(|| tcp_counts(fd)).flatten().unwrap_or((0, 0)));
    }
}

/// In the keeper (keeper.rs): what the owner closed before is the owner's to report.
pub(crate) fn forget_done() {
    DONE.lock().clear();
}

/// The program's name (`/proc/self/comm`), read once: the keeper's lines carry its owner's.
pub(crate) fn program_name() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        std::fs::read_to_string("/proc/self/comm")
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    })
}

/// Remember a finished socket for the report.
pub(crate) fn push(r: Record) {
    if wanted() {
        DONE.lock().push(r);
    }
}

use crate::json_str;

fn opt_addr(a: Option<std::net::SocketAddr>) -> String {
    a.map_or("null".into(), |a| json_str(&a.to_string()))
}

/// Append the lines (once per process), with `live` records of sockets still open.
pub(crate) fn write(live: Vec<Record>) {
    if !wanted() || WRITTEN.swap(true, Ordering::SeqCst) {
        return;
    }
    let Some(Some(path)) = PATH.get() else {
        return;
    };
    let program = program_name();
    let pid = std::process::id();
    let mut lines = String::new();
    let done = std::mem::take(&mut *DONE.lock());
    for mut r in done.into_iter().chain(live) {
        let shared = r.shared.as_ref().is_some_and(|s| s.is_shared());
        if let Some((i, o, z)) = r.shared.as_ref().and_then(|s| s.last_counts()) {
            // A shared stream's whole connection, other processes' bytes included.
            (r.bytes_in, r.bytes_out, r.zcopy_bytes) = (i, o, z);
        }
        lines.push_str(&format!(
            "{{\"pid\":{pid},\"program\":{},\"role\":{},\"local\":{},\"peer\":{},\"transport\":{},\"bytes_in\":{},\"bytes_out\":{},\"zcopy_bytes\":{},\"fallback\":{},\"shared\":{}}}\n",
            json_str(program),
            json_str(r.role),
            opt_addr(r.local),
            opt_addr(r.peer),
            json_str(&r.transport),
            r.bytes_in,
            r.bytes_out,
            r.zcopy_bytes,
            r.fallback.as_deref().map_or("null".into(), json_str),
            shared,
        ));
    }
    if lines.is_empty() {
        return;
    }
    // (The application's fd numbers may all be taken at its exit.)
    if let Ok(mut f) = sdp_core::socket::fd_limit::with_room(|| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    }) {
        // One write, so lines of concurrent processes do not interleave.
        let _ = f.write_all(lines.as_bytes());
    }
}
