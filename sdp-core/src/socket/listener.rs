//! [`SdpListener`]: accepts SDP clients and, in automatic mode, kernel TCP clients on the same
//! port.

use std::io;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::runtime::Wait;
use super::stack::{Choice, Options, Stack};
use super::stream::{Core, SdpStream};
use crate::driver::ListenerId;
use crate::sys;

/// The backlog of a listener without [`Options::backlog`] (`std::net::TcpListener`'s).
const DEFAULT_BACKLOG: u32 = 128;

/// A listening socket.
pub struct SdpListener {
    /// SDP listeners on the same address: shm, and an RDMA device.
    sdp: Mutex<Vec<Sub>>,
    tcp: Option<TcpListener>,
    local: SocketAddr,
    backlog: u32,
    /// The stacks were chosen here (not given with [`Options::with_stack`]): one whose device
    /// went away is made anew when the device comes back.
    own_stacks: bool,
    nonblocking: AtomicBool,
    /// Why SDP is not listening, in automatic mode (visible through `sdp_error`).
    sdp_error: Option<String>,
    /// The readiness fd handed out by `as_raw_fd` when both kinds listen, or RDMA does (an
    /// epoll set: it stays the same fd when a listener is made anew).
    ready: std::sync::OnceLock<Option<std::os::fd::OwnedFd>>,
}

/// One SDP listener of an [`SdpListener`].
struct Sub {
    stack: Stack,
    id: ListenerId,
    /// Its readiness fd, while it is in the `ready` epoll set.
    fd: Option<RawFd>,
    /// Its stack failed (the device went away): when to try listening anew.
    retry_at: Option<Instant>,
}

/// How often a listener whose device went away looks for it again (at `accept`).
const RELISTEN_EVERY: Duration = Duration::from_secs(1);

impl std::fmt::Debug for SdpListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SdpListener")
            .field("local", &self.local)
            .field(
                "sdp",
                &self
                    .sdp
                    .lock()
                    .iter()
                    .map(|s| s.stack.transport())
                    .collect::<Vec<_>>(),
            )
            .field("tcp", &self.tcp.is_some())
            .finish()
    }
}

impl Drop for SdpListener {
    fn drop(&mut self) {
        for sub in self.sdp.get_mut().iter() {
            sub.stack.0.close_listener(sub.id);
        }
    }
}

impl SdpListener {
    /// Listen in automatic mode: SDP and kernel TCP clients on the same port.
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<SdpListener> {
        SdpListener::bind_with(addr, &Options::default())
    }

    /// Listen with explicit options.
    pub fn bind_with(addr: impl ToSocketAddrs, opts: &Options) -> io::Result<SdpListener> {
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match SdpListener::bind_one(a, opts) {
                Ok(l) => return Ok(l),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "could not resolve to any addresses",
            )
        }))
    }

    fn bind_one(a: SocketAddr, opts: &Options) -> io::Result<SdpListener> {
        // The kernel TCP socket claims the port (port 0 picks one) so SDP and TCP clients
        // find us on the same one.
        let backlog = opts.backlog.unwrap_or(DEFAULT_BACKLOG);
        let tcp = match opts.choice {
            Choice::Sdp => None,
            Choice::Auto | Choice::Tcp => {
                let t = sys::tcp_listen(a, backlog)?;
                t.set_nonblocking(true)?;
                Some(t)
            }
        };
        let mut local = match &tcp {
            Some(t) => t.local_addr()?,
            None => a,
        };
        let mut sdp = Vec::new();
        let mut sdp_error = None;
        if !matches!(opts.choice, Choice::Tcp) {
            let mut errs = Vec::new();
            match opts.listen_stacks(local) {
                Ok((stacks, missing)) => {
                    errs.extend(missing);
                    for s in stacks {
                        // The first listener fixes the port (port 0 without TCP); the others
                        // listen on the same one.
                        match s.0.listen(local, backlog) {
                            Ok(l) => {
                                if let Some(la) = s.0.listener_addr(l) {
                                    local = la;
                                }
                                sdp.push(Sub {
                                    stack: s,
                                    id: l,
                                    fd: None,
                                    retry_at: None,
                                });
                            }
                            Err(e) => errs.push(format!("{}: {e}", s.transport().name())),
                        }
                    }
                }
                Err(e) => errs.push(e.to_string()),
            }
            if sdp.is_empty() {
                let msg = errs.join("; ");
                match opts.choice {
                    Choice::Auto => sdp_error = Some(msg),
                    _ => return Err(io::Error::other(msg)),
                }
            } else if !errs.is_empty() {
                sdp_error = Some(errs.join("; "));
            }
        }
        Ok(SdpListener {
            sdp: Mutex::new(sdp),
            tcp,
            local,
            backlog,
            own_stacks: opts.stack.is_none(),
            nonblocking: AtomicBool::new(false),
            sdp_error,
            ready: std::sync::OnceLock::new(),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    /// Whether SDP clients are accepted (the first SDP transport listening), and if not why
    /// (automatic mode keeps serving TCP).
    pub fn sdp_status(&self) -> Result<super::Transport, String> {
        match (self.sdp.lock().first(), &self.sdp_error) {
            (Some(sub), _) => Ok(sub.stack.transport()),
            (None, Some(e)) => Err(e.clone()),
            (None, None) => Err("SDP not requested".into()),
        }
    }

    /// Every SDP transport this listener accepts clients on (shm, RDMA), and why others are
    /// missing, if any were tried and failed.
    pub fn sdp_transports(&self) -> (Vec<super::Transport>, Option<String>) {
        (
            self.sdp
                .lock()
                .iter()
                .map(|s| s.stack.transport())
                .collect(),
            self.sdp_error.clone(),
        )
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.nonblocking.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Accept the next client, SDP or TCP.
    pub fn accept(&self) -> io::Result<(SdpStream, SocketAddr)> {
        loop {
            let mut fds = Vec::with_capacity(3);
            {
                let mut subs = self.sdp.lock();
                self.revive(&mut subs);
                for sub in subs.iter().filter(|s| s.retry_at.is_none()) {
                    match sub.stack.0.accept(
                        sub.id,
                        Wait {
                            nonblocking: true,
                            ..Wait::default()
                        },
                    ) {
                        Ok((id, peer)) => {
                            let s = SdpStream::from_core(Core::new(sub.stack.clone(), id));
                            return Ok((s, peer));
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        // Its device went away since `revive` looked: the next round does.
                        Err(_) if !sub.stack.0.alive() => {}
                        Err(e) => return Err(e),
                    }
                }
                if !self.nonblocking.load(Ordering::Relaxed) {
                    for sub in subs.iter().filter(|s| s.retry_at.is_none()) {
                        // (A wait of ours, not an fd handed out: a server that accepted and
                        // now reads keeps its progress thread standing by while it reads.)
                        if let Ok(fd) = sub.stack.0.listener_wait_fd(sub.id) {
                            fds.push((fd, libc::POLLIN));
                        }
                    }
                }
            }
            if let Some(t) = &self.tcp {
                match t.accept() {
                    Ok((s, peer)) => {
                        s.set_nonblocking(false)?;
                        return Ok((SdpStream::from_tcp(s), peer));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            if self.nonblocking.load(Ordering::Relaxed) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            if let Some(t) = &self.tcp {
                fds.push((t.as_raw_fd(), libc::POLLIN));
            }
            sys::poll(&fds, Some(Duration::from_millis(500)))?;
        }
    }

    /// SDP listeners whose stack failed (their device went away: the stack let go of
    /// everything on it) leave the `ready` set; each is made anew on a fresh stack when the
    /// device is back (looked for at most every [`RELISTEN_EVERY`]), as a TCP listener on an
    /// address serves again when the address comes back.
    fn revive(&self, subs: &mut [Sub]) {
        let now = Instant::now();
        for sub in subs.iter_mut() {
            if sub.retry_at.is_none() {
                if sub.stack.0.alive() {
                    continue;
                }
                // Just noticed: out of the epoll set (its fd reports the failure for good).
                if let (Some(fd), Some(Some(ep))) = (sub.fd.take(), self.ready.get()) {
                    sys::epoll_del(ep.as_fd(), fd);
                }
                sub.retry_at = Some(now);
            }
            if !self.own_stacks || sub.retry_at.is_some_and(|t| t > now) {
                continue;
            }
            sub.retry_at = Some(now + RELISTEN_EVERY);
            // In the epoll set handed out, if there is one.
            let fd = &mut sub.fd;
            let watch = |s: &Stack, id| match self.ready.get() {
                Some(Some(ep)) => {
                    let f = s.0.listener_fd(id)?;
                    sys::epoll_add(ep.as_fd(), f, f as u64, false)?;
                    *fd = Some(f);
                    Ok(())
                }
                _ => Ok(()),
            };
            if super::stack::listen_again(
                &mut sub.stack,
                &mut sub.id,
                self.local,
                self.backlog,
                watch,
            ) {
                sub.retry_at = None;
            }
        }
    }

    /// An endless iterator of accepted streams.
    pub fn incoming(&self) -> Incoming<'_> {
        Incoming { l: self }
    }

    /// SO_ERROR: listeners report none.
    pub fn take_error(&self) -> io::Result<Option<io::Error>> {
        match &self.tcp {
            Some(t) => t.take_error(),
            None => Ok(None),
        }
    }
}

impl AsRawFd for SdpListener {
    /// An fd that polls readable when `accept` would not block: the SDP listener's readiness
    /// fd, the TCP socket, or (several listening) an epoll set holding them all.
    fn as_raw_fd(&self) -> RawFd {
        let mut subs = self.sdp.lock();
        match (subs.as_mut_slice(), &self.tcp) {
            // One shm listener: its own fd (shm has no device to lose).
            ([sub], None) if sub.stack.transport() == super::Transport::Shm => {
                sub.stack.0.listener_fd(sub.id).unwrap_or(-1)
            }
            ([], Some(t)) => t.as_raw_fd(),
            ([], None) => -1,
            (sdp, tcp) => {
                let ep = self.ready.get_or_init(|| {
                    let mut fds = Vec::with_capacity(sdp.len() + 1);
                    for sub in sdp.iter_mut().filter(|s| s.retry_at.is_none()) {
                        let fd = sub.stack.0.listener_fd(sub.id).ok()?;
                        sub.fd = Some(fd);
                        fds.push(fd);
                    }
                    fds.extend(tcp.as_ref().map(|t| t.as_raw_fd()));
                    sys::epoll_of(&fds).ok()
                });
                ep.as_ref().map_or(-1, |e| e.as_raw_fd())
            }
        }
    }
}

/// Iterator of [`SdpListener::incoming`].
pub struct Incoming<'a> {
    l: &'a SdpListener,
}

impl Iterator for Incoming<'_> {
    type Item = io::Result<SdpStream>;
    fn next(&mut self) -> Option<Self::Item> {
        Some(self.l.accept().map(|(s, _)| s))
    }
}
