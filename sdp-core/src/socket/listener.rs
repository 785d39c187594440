//! [`SdpListener`]: accepts SDP clients and, in automatic mode, kernel TCP clients on the same
//! port.

use std::io;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

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
    sdp: Vec<(Stack, ListenerId)>,
    tcp: Option<TcpListener>,
    local: SocketAddr,
    nonblocking: AtomicBool,
    /// Why SDP is not listening, in automatic mode (visible through `sdp_error`).
    sdp_error: Option<String>,
    /// The readiness fd handed out by `as_raw_fd` when both kinds listen (an epoll set).
    ready: std::sync::OnceLock<Option<std::os::fd::OwnedFd>>,
}

impl std::fmt::Debug for SdpListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SdpListener")
            .field("local", &self.local)
            .field(
                "sdp",
                &self.sdp.iter().map(|s| s.0.transport()).collect::<Vec<_>>(),
            )
            .field("tcp", &self.tcp.is_some())
            .finish()
    }
}

impl Drop for SdpListener {
    fn drop(&mut self) {
        for (stack, l) in &self.sdp {
            stack.0.close_listener(*l);
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
                Ok(stacks) => {
                    for s in stacks {
                        // The first listener fixes the port (port 0 without TCP); the others
                        // listen on the same one.
                        match s.0.listen(local, backlog) {
                            Ok(l) => {
                                if let Some(la) = s.0.listener_addr(l) {
                                    local = la;
                                }
                                sdp.push((s, l));
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
            sdp,
            tcp,
            local,
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
        match (self.sdp.first(), &self.sdp_error) {
            (Some((s, _)), _) => Ok(s.transport()),
            (None, Some(e)) => Err(e.clone()),
            (None, None) => Err("SDP not requested".into()),
        }
    }

    /// Every SDP transport this listener accepts clients on (shm, RDMA), and why others are
    /// missing, if any were tried and failed.
    pub fn sdp_transports(&self) -> (Vec<super::Transport>, Option<String>) {
        (
            self.sdp.iter().map(|(s, _)| s.transport()).collect(),
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
            for (stack, l) in &self.sdp {
                match stack.0.accept(
                    *l,
                    Wait {
                        nonblocking: true,
                        ..Wait::default()
                    },
                ) {
                    Ok((id, peer)) => {
                        let s = SdpStream::from_core(Core::new(stack.clone(), id));
                        return Ok((s, peer));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
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
            let mut fds = Vec::with_capacity(3);
            for (stack, l) in &self.sdp {
                fds.push((stack.0.listener_fd(*l)?, libc::POLLIN));
            }
            if let Some(t) = &self.tcp {
                fds.push((t.as_raw_fd(), libc::POLLIN));
            }
            sys::poll(&fds, Some(Duration::from_millis(500)))?;
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
        match (self.sdp.as_slice(), &self.tcp) {
            ([(s, l)], None) => s.0.listener_fd(*l).unwrap_or(-1),
            ([], Some(t)) => t.as_raw_fd(),
            ([], None) => -1,
            (sdp, tcp) => {
                let ep = self.ready.get_or_init(|| {
                    let mut fds = Vec::with_capacity(sdp.len() + 1);
                    for (s, l) in sdp {
                        fds.push(s.0.listener_fd(*l).ok()?);
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
