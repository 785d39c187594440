//! Stacks (a runtime over one provider) and the transport choice.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use super::runtime::{Runtime, StackOps};
use super::Transport;
use crate::proto::Config;
use crate::sys;
use crate::verbs::Provider;

/// An SDP stack: the progress engine of one provider in this process. Cheap to clone.
#[derive(Clone)]
pub struct Stack(pub(crate) Arc<dyn StackOps>);

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stack({})", self.0.name())
    }
}

/// The process's shm stack, made afresh after fork().
static SHM: sys::ForkMutex<Option<Stack>> = sys::ForkMutex::new(None);

impl Stack {
    /// A stack over any provider, with its own progress thread.
    pub fn with_provider<P: Provider + 'static>(provider: P, cfg: Config) -> io::Result<Stack> {
        let rt: Arc<Runtime<P>> = Runtime::start(provider, cfg, None)?;
        Ok(Stack(rt))
    }

    /// A stack over the simulated fabric, its virtual clock driven by real time: only with the
    /// `harness` feature (the crate's own tests), never in a user's build.
    #[cfg(feature = "harness")]
    #[doc(hidden)]
    pub fn sim(provider: crate::verbs::sim::SimProvider, cfg: Config) -> io::Result<Stack> {
        let fabric = provider.fabric();
        let tick = Box::new(move |now: crate::proto::Instant| {
            if now.as_nanos() > fabric.now() {
                fabric.advance(now.as_nanos());
            }
        });
        let rt = Runtime::start(provider, cfg, Some(tick))?;
        Ok(Stack(rt))
    }

    /// The process's shared-memory stack (SDP between processes of this host).
    pub fn shm() -> io::Result<Stack> {
        guard_fork();
        let mut g = SHM.lock();
        if let Some(s) = g.as_ref() {
            if s.0.alive() {
                return Ok(s.clone());
            }
        }
        let s = shm_stack()?;
        *g = Some(s.clone());
        Ok(s)
    }

    /// Which transport this stack's streams use.
    /// This process's shm stack, if it started one (and it is this process's: not a fork
    /// child's copy of its parent's).
    pub(crate) fn shm_started() -> Option<Stack> {
        SHM.lock().as_ref().filter(|s| s.0.alive()).cloned()
    }

    pub fn transport(&self) -> Transport {
        Transport::from_provider(self.0.name())
    }

    /// Connections the stack holds (including ones closing in the background).
    pub fn conn_count(&self) -> usize {
        self.0.conn_count()
    }

    /// Bytes of memory the stack's connections have registered now.
    pub fn registered_bytes(&self) -> usize {
        self.0.registered_bytes()
    }

    /// Test hook: make this stack's progress thread panic at its next round (what a bug in
    /// the engine or a provider would do), to check that its connections fail instead of
    /// hanging. Not for use outside tests.
    #[doc(hidden)]
    pub fn inject_progress_panic(&self) {
        self.0.inject_progress_panic()
    }

    /// Test hook: how many plain reads of this stack's streams took a peer's zero-copy source
    /// straight into the caller's buffer (zero copy) rather than by copy.
    #[doc(hidden)]
    pub fn user_zcopy_reads(&self) -> u64 {
        self.0.user_zcopy_reads()
    }
}

/// fork() must not copy the stack registries while another thread holds one: the child could
/// then never make a socket. They are held across every fork (`pthread_atfork`).
fn guard_fork() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        sys::atfork(Some(fork_prepare), Some(fork_release), Some(fork_release));
    });
}

extern "C" fn fork_prepare() {
    std::mem::forget(SHM.lock());
    #[cfg(feature = "rdma")]
    std::mem::forget(RDMA.lock());
}

extern "C" fn fork_release() {
    // SAFETY: this thread locked both in fork_prepare (the child is that thread's copy) and
    // forgot the guards.
    unsafe {
        SHM.force_unlock();
        #[cfg(feature = "rdma")]
        RDMA.force_unlock();
    }
}

/// Which transport a connector or listener uses.
#[derive(Debug, Clone, Default)]
pub enum Choice {
    /// SDP when the peer and path can do it, kernel TCP otherwise; listeners accept both.
    #[default]
    Auto,
    /// SDP only: fail rather than fall back.
    Sdp,
    /// Kernel TCP only.
    Tcp,
}

/// How to connect or listen.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub choice: Choice,
    /// The SDP stack to use; by default the one that fits the address (shm for this host's
    /// addresses, else the RDMA device the route picks).
    pub stack: Option<Stack>,
    /// Connect timeout (`None`: the engine's default, 10 s).
    pub connect_timeout: Option<Duration>,
    /// Source address of an SDP connection over RDMA (its device carries the connection);
    /// `None`: the one the route to the peer picks.
    pub source_ip: Option<IpAddr>,
    /// Source port (as `bind(2)` before `connect(2)` gives a TCP socket); `None`: one the
    /// provider picks.
    pub source_port: Option<u16>,
    /// A listener's backlog, as `listen(2)`'s (`None`: 128, as `std::net::TcpListener`). At
    /// most backlog + 1 connections wait to be accepted, over SDP as over kernel TCP
    /// (docs/providers.md, "Listen backlog").
    pub backlog: Option<u32>,
}

impl Options {
    pub fn auto() -> Options {
        Options::default()
    }
    pub fn sdp_only() -> Options {
        Options {
            choice: Choice::Sdp,
            ..Options::default()
        }
    }
    pub fn tcp_only() -> Options {
        Options {
            choice: Choice::Tcp,
            ..Options::default()
        }
    }
    pub fn with_stack(mut self, stack: Stack) -> Options {
        self.stack = Some(stack);
        self
    }
    pub fn with_source_ip(mut self, ip: IpAddr) -> Options {
        self.source_ip = Some(ip);
        self
    }
    pub fn with_source_port(mut self, port: u16) -> Options {
        self.source_port = Some(port);
        self
    }
    /// The source address a connect to `dst` asks for: a port the caller chose (with its
    /// source IP, else unspecified: the provider's own address), or none.
    pub(crate) fn source_for(&self, dst: SocketAddr) -> Option<SocketAddr> {
        let port = self.source_port.filter(|&p| p != 0)?;
        let unspecified = match dst {
            SocketAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            SocketAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        };
        Some(SocketAddr::new(self.source_ip.unwrap_or(unspecified), port))
    }
    pub fn with_backlog(mut self, backlog: u32) -> Options {
        self.backlog = Some(backlog);
        self
    }

    /// The SDP stack for a peer at `ip`, if any: the one given; else, in the order of
    /// [`providers`], shm for this host's own addresses and the RDMA device the route to `ip`
    /// (or [`Options::source_ip`]) leaves through.
    pub(crate) fn stack_for(&self, ip: IpAddr) -> io::Result<Option<Stack>> {
        if let Some(s) = &self.stack {
            return Ok(Some(s.clone()));
        }
        let mut last = None;
        for p in providers() {
            let r = match p {
                Prov::Shm if sys::is_local_ip(ip) && self.source_ip.is_none() => Stack::shm(),
                Prov::Shm => continue,
                Prov::Rdma => rdma_stack(Some(ip), self.source_ip, self.iwarp_allowed()),
            };
            match r {
                Ok(s) => return Ok(Some(s)),
                Err(e) => last = Some(e),
            }
        }
        // A source address on a host without a device for it: a local peer is still reached
        // over shm (the address names no device to leave from).
        if self.source_ip.is_some() && sys::is_local_ip(ip) && providers().contains(&Prov::Shm) {
            return Stack::shm().map(Some);
        }
        match last {
            // Only the shm stack itself can fail outright; an RDMA miss means "no route".
            Some(e) if e.raw_os_error().is_none() && e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(None),
        }
    }

    /// Whether SDP may go over an iWARP device. iWARP's connections are kernel TCP connections
    /// on the application's own port (the CM's port space is TCP's): an automatic listener
    /// cannot listen there beside its kernel TCP socket (EADDRINUSE), and an automatic
    /// connect would reach whatever TCP server owns the port and write an MPA request into
    /// its stream. So only an explicit SDP choice ([`Options::sdp_only`]) uses iWARP;
    /// automatic mode keeps to kernel TCP (or shm) there.
    fn iwarp_allowed(&self) -> bool {
        matches!(self.choice, Choice::Sdp)
    }

    /// The SDP stacks a listener on `addr` listens on: the one given, else shm and (for a
    /// device address, or 0.0.0.0) the RDMA device, as [`providers`] allows, with why each
    /// other allowed provider has none. Errors only if there is none.
    pub(crate) fn listen_stacks(&self, addr: SocketAddr) -> io::Result<(Vec<Stack>, Vec<String>)> {
        if let Some(s) = &self.stack {
            return Ok((vec![s.clone()], Vec::new()));
        }
        let mut out = Vec::new();
        let mut errs = Vec::new();
        for p in providers() {
            let r = match p {
                Prov::Shm => Stack::shm(),
                Prov::Rdma => {
                    let ip = addr.ip();
                    if ip.is_loopback() {
                        continue;
                    }
                    rdma_stack(
                        None,
                        (!ip.is_unspecified()).then_some(ip),
                        self.iwarp_allowed(),
                    )
                }
            };
            match r {
                Ok(s) => out.push(s),
                Err(e) => errs.push(e.to_string()),
            }
        }
        if out.is_empty() {
            return Err(io::Error::other(if errs.is_empty() {
                "no SDP provider allowed (SDP_PROVIDERS)".to_string()
            } else {
                errs.join("; ")
            }));
        }
        Ok((out, errs))
    }
}

/// A stack of the same transport as `dead` (one that failed: its device went away) for a
/// listener on `addr`, made anew: `NotFound` while the device is not back. Only RDMA stacks
/// lose devices.
fn stack_again(dead: &Stack, addr: SocketAddr) -> io::Result<Stack> {
    match dead.transport() {
        super::Transport::Rdma => {
            let ip = addr.ip();
            // Only an explicit SDP listener had an iWARP stack (an automatic one holds the
            // kernel TCP port, which an iWARP listen would fail on anyway).
            rdma_stack(None, (!ip.is_unspecified()).then_some(ip), true)
        }
        _ => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "only RDMA stacks are made anew",
        )),
    }
}

/// Listen anew on `addr` for a listener whose stack failed (its device went away): on a fresh
/// stack ([`stack_again`]), finished by `attach` (a doorbell, an epoll set), then put in place
/// of the old one, which is closed. False (nothing changed) while the device is not back.
pub(crate) fn listen_again(
    stack: &mut Stack,
    id: &mut crate::driver::ListenerId,
    addr: SocketAddr,
    backlog: u32,
    attach: impl FnOnce(&Stack, crate::driver::ListenerId) -> io::Result<()>,
) -> bool {
    let Ok(new) = stack_again(stack, addr) else {
        return false;
    };
    let Ok(nid) = new.0.listen(addr, backlog) else {
        return false;
    };
    if attach(&new, nid).is_err() {
        new.0.close_listener(nid);
        return false;
    }
    let old = std::mem::replace(stack, new);
    old.0.close_listener(*id);
    *id = nid;
    true
}

/// An SDP provider kind the automatic choice may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prov {
    Shm,
    Rdma,
}

/// The providers automatic choice tries, in order: `SDP_PROVIDERS` (a comma list of `shm`
/// and `rdma`), by default `shm,rdma` (`rdma` only in builds with the `rdma` feature). A peer
/// on this host is reached over shm unless `SDP_PROVIDERS` leaves it out.
fn providers() -> Vec<Prov> {
    // Read once: a program may clear its environment after starting (nginx does).
    let list = &super::tunables::tunables().providers;
    let mut v = Vec::new();
    for name in list.split(',').map(str::trim) {
        let p = match name {
            "shm" => Prov::Shm,
            "rdma" if cfg!(feature = "rdma") => Prov::Rdma,
            _ => continue,
        };
        if !v.contains(&p) {
            v.push(p);
        }
    }
    v
}

fn shm_stack() -> io::Result<Stack> {
    let p = crate::verbs::shm::ShmProvider::new()
        .map_err(|e| io::Error::other(format!("shm provider: {e}")))?;
    Stack::with_provider(
        p,
        Config {
            inline_sends: super::tunables::tunables().inline_sends,
            ..Config::default()
        },
    )
}

/// The process's RDMA stacks, one per (device, local address), made afresh after fork().
#[cfg(feature = "rdma")]
static RDMA: sys::ForkMutex<Vec<(String, IpAddr, Stack)>> = sys::ForkMutex::new(Vec::new());

/// The RDMA stack for a connection to `peer` (the device the route picks) or from `local`
/// (the device owning that address), or for a wildcard listener (`None, None`: the first
/// device with an address, iWARP ones only if `iwarp`). `NotFound` if there is no device or
/// route, or the device is iWARP and `iwarp` is false ([`Options::iwarp_allowed`]).
#[cfg(feature = "rdma")]
fn rdma_stack(peer: Option<IpAddr>, local: Option<IpAddr>, iwarp: bool) -> io::Result<Stack> {
    use crate::verbs::rdma::RdmaProvider;
    let not_found =
        |e: &dyn std::fmt::Display| io::Error::new(io::ErrorKind::NotFound, e.to_string());
    // A stack whose device went away leaves the list first, even while its device is missing
    // (an `SdpListener` asks every second until it is back), so that it goes as soon as its
    // sockets do.
    RDMA.lock().retain(|(_, _, s)| s.0.alive());
    let p = match (local, peer) {
        (Some(ip), _) => RdmaProvider::for_local_addr(ip).map_err(|e| not_found(&e))?,
        (None, Some(ip)) => {
            RdmaProvider::for_peer(SocketAddr::new(ip, 1)).map_err(|e| not_found(&e))?
        }
        (None, None) => {
            let mut found = None;
            let mut why = String::from("no RDMA device has an address");
            for ip in sys::local_addrs() {
                if ip.is_loopback() {
                    continue;
                }
                match RdmaProvider::for_local_addr(ip) {
                    Ok(p) if p.is_iwarp() && !iwarp => why = iwarp_refused(&p),
                    Ok(p) => {
                        found = Some(p);
                        break;
                    }
                    Err(e) => why = e.to_string(),
                }
            }
            found.ok_or_else(|| not_found(&why))?
        }
    };
    if p.is_iwarp() && !iwarp {
        return Err(not_found(&iwarp_refused(&p)));
    }
    let (dev, ip) = (p.device_name().to_string(), p.local_ip());
    guard_fork();
    let mut g = RDMA.lock();
    g.retain(|(_, _, s)| s.0.alive());
    if let Some((_, _, s)) = g.iter().find(|(d, i, _)| *d == dev && *i == ip) {
        return Ok(s.clone());
    }
    let cfg = Config {
        send_stall_timeout: Some(RDMA_SEND_STALL),
        zcopy_split: super::tunables::tunables().zcopy_split,
        inline_sends: super::tunables::tunables().inline_sends,
        ..Config::default()
    };
    let s = Stack::with_provider(p, cfg)?;
    g.push((dev, ip, s.clone()));
    Ok(s)
}

/// How long an RDMA connection's outstanding sends may go without a completion before it fails
/// with ETIMEDOUT (`Config::send_stall_timeout`): beyond any RC retry budget a device uses
/// (seconds), so it ends only a QP that hangs (Soft-RoCE after a link flap; TODO.md).
#[cfg(feature = "rdma")]
const RDMA_SEND_STALL: std::time::Duration = std::time::Duration::from_secs(60);

/// Why automatic mode does not use an iWARP device ([`Options::iwarp_allowed`]).
#[cfg(feature = "rdma")]
fn iwarp_refused(p: &crate::verbs::rdma::RdmaProvider) -> String {
    format!(
        "{} is iWARP, whose connections use TCP's ports: automatic mode uses kernel TCP there \
         (SDP over iWARP needs an explicit SDP choice on both ends)",
        p.device_name()
    )
}

#[cfg(not(feature = "rdma"))]
fn rdma_stack(_peer: Option<IpAddr>, _local: Option<IpAddr>, _iwarp: bool) -> io::Result<Stack> {
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        "built without the rdma feature",
    ))
}
