//! Live socket statistics, for `sdpstat` (as `ss -t` for TCP).
//!
//! Each stack's progress thread listens on an abstract Unix socket named
//! `sdp-stat/<uid>/<pid>/<stack>` and answers a connection from a process of the same user with
//! one line per connection it holds, then closes it. [`query_all`] finds every such socket on
//! the host (`/proc/net/unix`), asks each, and keeps the answers of the caller's own user.
//! `SDP_STAT=0` turns the listening off.
//!
//! A line is tab-separated `key=value` fields: `pid`, `stack` (shm, rdma), `id`, `state`,
//! `local`, `peer`, `bytes_in`, `bytes_out`, `zcopy_bytes`, `rx_queued`, `tx_queued`,
//! `credits`, `send_size`, `error`, `app`, `engine` (the engine's state on one line:
//! `Conn::debug_state`).

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::sys;

/// One connection of one process, as `key -> value`.
pub type StatLine = BTreeMap<String, String>;

const PREFIX: &str = "sdp-stat/";

fn uid() -> u32 {
    sys::getuid()
}

/// A stack's statistics socket (see the module docs).
#[derive(Debug)]
pub(crate) struct StatServer {
    fd: OwnedFd,
}

impl StatServer {
    /// Listen for the stack `name` of this process; `None` if turned off or impossible.
    pub(crate) fn new(name: &str) -> Option<StatServer> {
        if !super::tunables::tunables().stat {
            return None;
        }
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = format!("{PREFIX}{}/{}/{name}.{n}", uid(), sys::getpid());
        let fd = sys::abstract_listener(path.as_bytes()).ok()?;
        Some(StatServer { fd })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Answer every waiting query with `lines` (made only if someone asks).
    pub(crate) fn serve(&self, lines: impl Fn() -> String) {
        while let Ok(Some(c)) = sys::accept_nb(self.fd.as_raw_fd()) {
            if sys::peer_uid(c.as_raw_fd()).ok() != Some(uid()) {
                continue;
            }
            let mut s = UnixStream::from(c);
            let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
            let _ = s.write_all(lines().as_bytes());
        }
    }
}

/// Format one connection's line.
pub(crate) fn line(fields: &[(&str, String)]) -> String {
    let mut s = String::new();
    for (i, (k, v)) in fields.iter().enumerate() {
        if i > 0 {
            s.push('\t');
        }
        s.push_str(k);
        s.push('=');
        s.push_str(&v.replace(['\t', '\n'], " "));
    }
    s.push('\n');
    s
}

/// Ask every stack of every process of this user on the host for its connections.
pub fn query_all() -> io::Result<Vec<StatLine>> {
    let table = std::fs::read_to_string("/proc/net/unix")?;
    let mine = format!("@{PREFIX}{}/", uid());
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for l in table.lines().skip(1) {
        let Some(path) = l.split_whitespace().nth(7) else {
            continue;
        };
        if !path.starts_with(&mine) || !seen.insert(path.to_string()) {
            continue;
        }
        let Ok(fd) = sys::abstract_connect(&path.as_bytes()[1..]) else {
            continue;
        };
        let mut s = UnixStream::from(fd);
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let mut text = String::new();
        if s.read_to_string(&mut text).is_err() {
            continue;
        }
        for l in text.lines() {
            let m: StatLine = l
                .split('\t')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            if !m.is_empty() {
                out.push(m);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stack_answers_its_user() {
        let s = StatServer::new("test").expect("listening");
        let t = std::thread::spawn(move || {
            for _ in 0..200 {
                s.serve(|| line(&[("pid", "1".into()), ("stack", "test".into())]));
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let all = query_all().unwrap();
        t.join().unwrap();
        assert!(
            all.iter()
                .any(|l| l.get("stack").map(String::as_str) == Some("test")),
            "{all:?}"
        );
    }
}
