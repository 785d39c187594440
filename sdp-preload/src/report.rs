//! `SDP_REPORT=FILE`: at exit each process appends one JSON line per socket it handled (pid,
//! program, local, peer, transport shm|rdma|tcp, bytes in/out, zero-copy bytes, fallback
//! reason, whether the stream's bytes went through its kernel file because another process
//! used the fd), so a run can prove which transport carried its bytes.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use sdp_core::socket::app::AppStream;

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
    pub(crate) shared: std::sync::Arc<AtomicBool>,
}

static DONE: Mutex<Vec<Record>> = Mutex::new(Vec::new());
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

/// A stream's record from its live state.
pub(crate) fn of_stream(role: &'static str, s: &AppStream) -> Record {
    let info = s.info().ok();
    Record {
        role,
        local: s.local_addr().ok(),
        peer: s.peer_addr().ok(),
        transport: s.transport().to_string(),
        bytes_in: info.as_ref().map_or(0, |i| i.bytes_in),
        bytes_out: info.as_ref().map_or(0, |i| i.bytes_out),
        zcopy_bytes: info.as_ref().map_or(0, |i| i.zcopy_bytes),
        fallback: None,
        shared: s.shared_flag(),
    }
}

/// In a forked child: the parent's finished sockets are the parent's to report.
pub(crate) fn forget_inherited() {
    if DONE.is_locked() {
        // SAFETY: only the forking thread runs in the child; a holder of the lock was another
        // thread of the parent (fork came amid its push), which the child does not have, so
        // nothing here uses the guarded list.
        unsafe { DONE.force_unlock() };
    }
    DONE.lock().clear();
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
    let program = std::fs::read_to_string("/proc/self/comm")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let pid = std::process::id();
    let mut lines = String::new();
    let done = std::mem::take(&mut *DONE.lock());
    for r in done.into_iter().chain(live) {
        lines.push_str(&format!(
            "{{\"pid\":{pid},\"program\":{},\"role\":{},\"local\":{},\"peer\":{},\"transport\":{},\"bytes_in\":{},\"bytes_out\":{},\"zcopy_bytes\":{},\"fallback\":{},\"shared\":{}}}\n",
            json_str(&program),
            json_str(r.role),
            opt_addr(r.local),
            opt_addr(r.peer),
            json_str(&r.transport),
            r.bytes_in,
            r.bytes_out,
            r.zcopy_bytes,
            r.fallback.as_deref().map_or("null".into(), json_str),
            r.shared.load(Ordering::SeqCst),
        ));
    }
    if lines.is_empty() {
        return;
    }
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        // One write, so lines of concurrent processes do not interleave.
        let _ = f.write_all(lines.as_bytes());
    }
}
