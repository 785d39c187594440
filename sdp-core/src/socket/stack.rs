//! Stacks (a runtime over one provider) and the transport choice.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::runtime::{Runtime, StackOps};
use super::{sys, Transport};
use crate::proto::Config;
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
static SHM: Mutex<Option<Stack>> = Mutex::new(None);

impl Stack {
    /// A stack over any provider, with its own progress thread.
    pub fn with_provider<P: Provider + 'static>(provider: P, cfg: Config) -> io::Result<Stack> {
        let rt: Arc<Runtime<P>> = Runtime::start(provider, cfg, None)?;
        Ok(Stack(rt))
    }

    /// A stack over the simulated fabric, its virtual clock driven by real time (tests).
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
    /// The SDP stack to use; by default the one that fits the address (shm for this host).
    pub stack: Option<Stack>,
    /// Connect timeout (`None`: the engine's default, 10 s).
    pub connect_timeout: Option<Duration>,
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

    /// The SDP stack for a peer at `ip`, if any: the one given, else shm for this host's
    /// addresses. (RDMA devices: see TODO.md.)
    pub(crate) fn stack_for(&self, ip: IpAddr) -> io::Result<Option<Stack>> {
        if let Some(s) = &self.stack {
            return Ok(Some(s.clone()));
        }
        if sys::is_local_ip(ip) {
            return Stack::shm().map(Some);
        }
        Ok(None)
    }

    pub(crate) fn listen_stack(&self, _addr: SocketAddr) -> io::Result<Stack> {
        match &self.stack {
            Some(s) => Ok(s.clone()),
            None => Stack::shm(),
        }
    }
}

fn shm_stack() -> io::Result<Stack> {
    let p = crate::verbs::shm::ShmProvider::new()
        .map_err(|e| io::Error::other(format!("shm provider: {e}")))?;
    Stack::with_provider(p, Config::default())
}
