//! The `rdma` provider: real RDMA devices through librdmacm and libibverbs (rdma-sys).
//!
//! All librdmacm/libibverbs FFI of the crate is in `ffi.rs`: owning wrappers of the event
//! channel, CM ids (with their QPs), the device, PD, completion channel, CQs and memory
//! registrations, destroyed on drop in the order the libraries want. This file is safe code
//! over them, but for the three memory registrations (`ffi::Mr::register`: the memory must
//! outlive the registration). The host's system calls are `crate::sys`'s.
//!
//! # Model
//!
//! * **One device per provider.** An [`RdmaProvider`] is one device context (the one the RDMA
//!   CM picks for an IP address, never a device named in code) with its protection domain, one
//!   nonblocking `rdma_event_channel` and one completion channel. Open it with
//!   [`RdmaProvider::for_local_addr`] (binds a CM id to a local IP address: the device that owns
//!   the address) or [`RdmaProvider::for_peer`] (resolves a destination: the device the route
//!   leaves through, and the source address the CM picked). That CM id is kept for the life of
//!   the provider: it holds librdmacm's reference on the device.
//! * **Connections** use ordinary IP addresses and ports in `RDMA_PS_TCP`. `connect` binds the
//!   new id to `src`, or to the provider's address with an ephemeral port, so the connection
//!   always leaves through the provider's device (an id that the CM binds to another device is
//!   refused with [`VerbsError::NoDevice`]). Address and route resolution, QP creation and
//!   `rdma_connect` then proceed from the CM events; the outcome is a [`CmEvent`] on the
//!   endpoint. Receives posted before the QP exists are queued and posted when it is created.
//! * **Listeners** bound to one of the device's addresses only see that device's requests. A
//!   listener on the unspecified address (0.0.0.0 / ::) sees requests from every device; those
//!   that arrive on another device than the provider's are rejected with the private data
//!   `"SDP: wrong RDMA device"` (counted by [`RdmaListener::wrong_device_rejects`]), because the
//!   provider's memory regions cannot be used there. Run one provider per device to serve all.
//! * **CM events** are read from the shared channel by whichever call polls first
//!   ([`Endpoint::poll_cm`], [`Listener::poll_request`], [`Provider::arm`]), copied (private
//!   data included), acknowledged at once (`rdma_ack_cm_event`), and queued on the id they
//!   belong to. Mapping: ADDR_ERROR → `AddrError`, ROUTE_ERROR → `RouteError`, UNREACHABLE →
//!   `Unreachable`, REJECTED → `Rejected { private_data, consumer }` (consumer: the IB CM reject
//!   reason is "consumer defined", 28, i.e. the peer application called `rdma_reject`; anything
//!   else, such as "invalid service id" when nobody listens, is not; zero padding stripped),
//!   CONNECT_ERROR → `ConnectError`, ESTABLISHED → `Established { private_data }`,
//!   DISCONNECTED, DEVICE_REMOVAL, TIMEWAIT_EXIT, ADDR_CHANGE → the same names;
//!   CONNECT_REQUEST becomes a listener request.
//! * **Waiting** ([`Provider::notify_fd`]): an epoll fd watching the CM channel and the
//!   completion channel. [`Provider::arm`] reads the pending CM events into their queues,
//!   drains the completion channel (`ibv_get_cq_event` + `ibv_ack_cq_events`) and calls
//!   `ibv_req_notify_cq` on every live CQ (a registry of them is kept), so anything that
//!   completes after `arm` makes the fd readable.
//! * **Endpoints**: one CQ each (send and receive), an RC QP sized from [`QpCaps`] (listener
//!   endpoints get the caps given to `listen`), one SGE per work request, no inline data, no
//!   immediate data (what IB, RoCE and iWARP all support). Drop destroys the QP, then the CQ,
//!   then the CM id.
//! * **Memory**: [`Provider::reg_mr`] allocates page-aligned zeroed memory and registers it
//!   with the least access asked for. [`MemoryRegion::set_access`] uses `ibv_rereg_mr` with
//!   `IBV_REREG_MR_CHANGE_ACCESS`; if the device refuses (Soft-RoCE does), the region is
//!   deregistered and registered again, which **changes its keys**: always take `lkey()` /
//!   `rkey()` after `set_access`. [`MemoryRegion::advertise`] registers the granted sub-range
//!   once more (`ibv_reg_mr` on `addr + off`, `len` bytes, only the rights asked for): its own
//!   lkey and rkey, deregistered by [`MemoryRegion::revoke`] or with the region. A grant that
//!   gives a peer nothing on this device and asks for no more than the region has (a Read
//!   sink on IB/RoCE) needs no registration: it names the region's lkey and has rkey 0. On
//!   iWARP an RDMA Read sink needs remote write: only memory asked for with
//!   [`Access::READ_SINK`] (engine bounce buffers, zero-copy sink grants) gets it.

mod devices;
mod ffi;
mod map;

use std::collections::{HashMap, VecDeque};
use std::mem::MaybeUninit;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use parking_lot::{MappedRwLockReadGuard, Mutex, RwLock, RwLockReadGuard};
use rdma_sys as rs;

use self::ffi::{errno, CmId, CompChannel, ConnParam, Cq, Device, EventChannel, Mr, Pd, Qp};
use self::map::Transport;
use super::{
    check_grant, Access, CmEvent, Completion, Endpoint, Grant, Listener, MemoryRegion, Provider,
    QpCaps, RecvWr, SendWr, VerbsError, WcOpcode,
};
use crate::sys::{self, Mapping};

/// Address and route resolution time limit.
const RESOLVE_TIMEOUT_MS: i32 = 2000;
// Private data limits of the IB CM with `RDMA_PS_TCP` (the CM header takes the rest).
use super::{
    MAX_PRIVATE_DATA_ACCEPT as MAX_ACCEPT_PRIVATE_DATA,
    MAX_PRIVATE_DATA_CONNECT as MAX_CONNECT_PRIVATE_DATA,
    MAX_PRIVATE_DATA_REJECT as MAX_REJECT_PRIVATE_DATA,
};
/// `RDMA_MAX_RESP_RES` / `RDMA_MAX_INIT_DEPTH`: let librdmacm pick the most both sides allow.
const RDMA_MAX_RESP_RES: u8 = 0xff;
const RDMA_MAX_INIT_DEPTH: u8 = 0xff;
/// Private data of a reject for a request on another device than the provider's.
pub const WRONG_DEVICE_REJECT: &[u8] = b"SDP: wrong RDMA device";
const PAGE: usize = 4096;
/// Inline data a QP is asked for when the driver's request is refused (rsockets' default).
const INLINE_FALLBACK: u32 = 64;

/// An `io::Error` of the host's system calls as its errno.
fn os_errno(e: std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// What holds the device: given back (dropped, in the order of the fields: completion
/// channel, PD, the device with its CM id) when the provider goes, or once it was lost and
/// nothing made on it is left ([`Provider::release_device`]).
struct DevParts {
    comp: Arc<CompChannel>,
    pd: Pd,
    dev: Arc<Device>,
}

/// The device handles of a provider, and the bookkeeping its objects share. The device's
/// handles drop first, then the event channel.
struct Shared {
    /// `None` once the device was given back. Held for reading while anything is made on it.
    parts: RwLock<Option<DevParts>>,
    channel: Arc<EventChannel>,
    epfd: OwnedFd,
    transport: Transport,
    local_ip: IpAddr,
    device: String,
    max_qp_wr: u32,
    max_cqe: u32,
    init_depth: u8,
    resp_res: u8,
    /// The QPs gather two SGEs per send (header + payload).
    gather: bool,
    /// A software device (Soft-RoCE, siw): the kernel builds every packet on the CPU.
    software: bool,
    st: Mutex<State>,
    /// The device went away: a `DEVICE_REMOVAL` event came on one of our CM ids.
    lost: AtomicBool,
    /// [`Provider::release_device`] was called: give the device back as soon as nothing
    /// made on it is left.
    release_wanted: AtomicBool,
    /// Endpoints, listeners and regions alive (each holds a [`Hold`]).
    objects: AtomicUsize,
    /// Looks at the CM channel asked for by polls since the last one read it
    /// ([`Shared::pump_cm_polled`]).
    cm_looks: AtomicU32,
}

/// Polls read the CM channel this often (see [`Shared::pump_cm_polled`]).
const CM_LOOK_EVERY: u32 = 16;

/// An endpoint's, listener's or region's hold on the provider: counted, so that after the
/// device was lost it is given back when the last object made on it goes.
struct Hold(Arc<Shared>);

impl Hold {
    fn new(sh: &Arc<Shared>) -> Hold {
        sh.objects.fetch_add(1, Ordering::SeqCst);
        Hold(sh.clone())
    }
}

impl std::ops::Deref for Hold {
    type Target = Arc<Shared>;
    fn deref(&self) -> &Arc<Shared> {
        &self.0
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        // After the object's own Drop and its other fields: its verbs objects are gone and
        // `st` is let go.
        if self.0.objects.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.try_release();
        }
    }
}

/// `vendor_id` of Soft-RoCE (rdma_rxe) and of siw (soft iWARP).
const SOFTWARE_VENDORS: [u32; 2] = [0x00ff_ffff, 0x0062_6d74];

#[derive(Default)]
struct State {
    ids: HashMap<usize, Slot>,
}

enum Slot {
    Ep(EpSlot),
    Listener(ListenSlot),
}

/// One connection's verbs objects: its CQ and its CM id (with the QP, once made). Dropped
/// with the provider's lock held (the endpoint and the slot drop theirs under it), so no
/// `arm` touches the CQ meanwhile: QP first, then the CQ, then the id.
struct Conn {
    cq: Cq,
    id: CmId,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The QP before the CQ it uses; the fields then drop in order (CQ, id).
        self.id.destroy_qp();
    }
}

struct EpSlot {
    conn: Arc<Conn>,
    events: VecDeque<CmEvent>,
    /// Active side until `rdma_connect`: what to connect with.
    connect: Option<(Vec<u8>, QpCaps)>,
    /// Receives posted before the QP existed.
    pending_recvs: Vec<RecvWr>,
    /// Why the connection attempt failed inside the provider, if it did.
    failure: Option<String>,
}

struct ListenSlot {
    caps: QpCaps,
    requests: VecDeque<Request>,
    wrong_device: u64,
    removed: bool,
}

/// A connect request with its QP, waiting for `poll_request`.
struct Request {
    conn: Arc<Conn>,
    private_data: Vec<u8>,
    local: SocketAddr,
    peer: SocketAddr,
}

impl Shared {
    /// Opens the provider on the device `anchor` (an id of `channel`) is bound to.
    fn open(
        channel: Arc<EventChannel>,
        anchor: CmId,
        local_ip: IpAddr,
    ) -> Result<Shared, VerbsError> {
        // On an error, what was made so far is destroyed in reverse order as it drops.
        let Ok(dev) = Device::open(anchor) else {
            return Err(VerbsError::NoDevice(format!(
                "{local_ip}: not bound to an RDMA device"
            )));
        };
        let info = dev
            .query()
            .map_err(|e| map::errno_error(e, "ibv_query_device"))?;
        let transport = if info.iwarp {
            Transport::Iwarp
        } else {
            Transport::Ib
        };
        let attr = info.attr;
        let pd = Pd::alloc(&dev).map_err(|e| map::errno_error(e, "ibv_alloc_pd"))?;
        let comp =
            CompChannel::new(&dev).map_err(|e| map::errno_error(e, "ibv_create_comp_channel"))?;
        let epfd = sys::epoll_create_plain()
            .map_err(|e| map::errno_error(os_errno(e), "epoll_create1"))?;
        for fd in [channel.as_fd(), comp.as_fd()] {
            sys::set_nonblocking(fd)
                .map_err(|e| map::errno_error(os_errno(e), "fcntl O_NONBLOCK"))?;
            sys::epoll_add_in(epfd.as_fd(), fd.as_raw_fd())
                .map_err(|e| map::errno_error(os_errno(e), "epoll_ctl"))?;
        }
        Ok(Shared {
            parts: RwLock::new(Some(DevParts { comp, pd, dev })),
            channel,
            epfd,
            transport,
            local_ip,
            device: info.name,
            max_qp_wr: attr.max_qp_wr.max(1) as u32,
            max_cqe: attr.max_cqe.max(1) as u32,
            init_depth: attr.max_qp_init_rd_atom.clamp(1, 16) as u8,
            resp_res: attr.max_qp_rd_atom.clamp(1, 16) as u8,
            gather: attr.max_sge >= 2,
            software: SOFTWARE_VENDORS.contains(&attr.vendor_id),
            st: Mutex::new(State::default()),
            lost: AtomicBool::new(false),
            release_wanted: AtomicBool::new(false),
            objects: AtomicUsize::new(0),
            cm_looks: AtomicU32::new(0),
        })
    }

    /// Read every pending CM event, acknowledge it and queue it where it belongs.
    fn pump_cm(&self, st: &mut State) {
        self.cm_looks.store(1, Ordering::Relaxed);
        while let Some(ev) = self.channel.get_event() {
            self.dispatch(st, ev);
        }
    }

    /// [`Shared::pump_cm`] for a poll: every [`CM_LOOK_EVERY`]th time only. Reading the CM
    /// channel is a system call that almost always finds nothing, and a progress round polls
    /// every connection and listener; CM events are rare and none is lost meanwhile (they
    /// wait in the channel, whose fd keeps the notify fd readable, and `arm` reads them all
    /// before anyone sleeps).
    fn pump_cm_polled(&self, st: &mut State) {
        if self
            .cm_looks
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(CM_LOOK_EVERY)
        {
            self.pump_cm(st);
        }
    }

    fn dispatch(&self, st: &mut State, ev: ffi::Event) {
        let kind = ev.kind;
        if kind == map::EV_DEVICE_REMOVAL {
            // On any of our ids (the anchor's included): the whole device is going.
            self.lost.store(true, Ordering::SeqCst);
        }
        if kind == map::EV_CONNECT_REQUEST {
            if let Some(id) = ev.new_id {
                self.on_request(st, id, ev.listen_id, ev.private_data);
            }
            return;
        }
        match st.ids.get_mut(&ev.id) {
            Some(Slot::Ep(ep)) => match kind {
                map::EV_ADDR_RESOLVED => self.on_addr_resolved(ep),
                map::EV_ROUTE_RESOLVED => self.on_route_resolved(ep),
                _ => {
                    if let Some(e) =
                        map::cm_event(kind, ev.status, &ev.private_data, self.transport)
                    {
                        ep.events.push_back(e);
                    }
                }
            },
            Some(Slot::Listener(l)) if kind == map::EV_DEVICE_REMOVAL => l.removed = true,
            Some(Slot::Listener(_)) => {}
            // An id being torn down, or an event type we never asked for.
            None => {}
        }
    }

    fn on_addr_resolved(&self, ep: &mut EpSlot) {
        let id = &ep.conn.id;
        if !self.is_ctx(id.verbs()) {
            ep.failure = Some(format!(
                "the CM resolved the destination through another device than {}",
                self.device
            ));
            ep.events.push_back(CmEvent::AddrError);
            return;
        }
        if let Err(e) = id.resolve_route(RESOLVE_TIMEOUT_MS) {
            ep.failure = Some(format!(
                "rdma_resolve_route: {}",
                std::io::Error::from_raw_os_error(e)
            ));
            ep.events.push_back(CmEvent::RouteError);
        }
    }

    fn on_route_resolved(&self, ep: &mut EpSlot) {
        let Some((private_data, caps)) = ep.connect.take() else {
            return;
        };
        let fail = |ep: &mut EpSlot, what: String| {
            ep.failure = Some(what);
            ep.events.push_back(CmEvent::ConnectError);
        };
        let conn = ep.conn.clone();
        let qp = match self.create_qp(&conn, caps) {
            Ok(qp) => qp,
            Err(e) => return fail(ep, format!("creating the QP: {e}")),
        };
        for wr in std::mem::take(&mut ep.pending_recvs) {
            if let Err(e) = post_recv(qp, &wr) {
                return fail(ep, format!("posting a queued receive: {e}"));
            }
        }
        if let Err(e) = conn.id.connect(&self.conn_param(false), &private_data) {
            if e == libc::ECONNREFUSED {
                // iWARP makes its TCP connection inside rdma_connect: nobody listening (a
                // reset) fails the call itself instead of arriving as REJECTED, as on IB.
                ep.failure = Some("rdma_connect: connection refused".into());
                ep.events.push_back(CmEvent::Rejected {
                    private_data: Vec::new(),
                    consumer: false,
                });
                return;
            }
            fail(
                ep,
                format!("rdma_connect: {}", std::io::Error::from_raw_os_error(e)),
            );
        }
    }

    fn on_request(&self, st: &mut State, id: CmId, listen_id: usize, private_data: Vec<u8>) {
        let caps = match st.ids.get(&listen_id) {
            Some(Slot::Listener(l)) if !l.removed => l.caps,
            _ => return reject_destroy(id, b"SDP: not listening"),
        };
        if !self.is_ctx(id.verbs()) {
            if let Some(Slot::Listener(l)) = st.ids.get_mut(&listen_id) {
                l.wrong_device += 1;
            }
            return reject_destroy(id, WRONG_DEVICE_REJECT);
        }
        let cq = match self.create_cq(caps) {
            Ok(cq) => cq,
            Err(_) => return reject_destroy(id, b"SDP: out of resources"),
        };
        if self.create_qp_on(&id, &cq, caps).is_err() {
            // The CQ first (unused), then the id.
            drop(cq);
            return reject_destroy(id, b"SDP: out of resources");
        }
        let (local, peer) = (id.addr(true), id.addr(false));
        let unspec = SocketAddr::new(self.local_ip, 0);
        let key = id.key();
        let conn = Arc::new(Conn { cq, id });
        st.ids.insert(
            key,
            Slot::Ep(EpSlot {
                conn: conn.clone(),
                events: VecDeque::new(),
                connect: None,
                pending_recvs: Vec::new(),
                failure: None,
            }),
        );
        if let Some(Slot::Listener(l)) = st.ids.get_mut(&listen_id) {
            l.requests.push_back(Request {
                conn,
                private_data,
                local: local.unwrap_or(unspec),
                peer: peer.unwrap_or(unspec),
            });
        }
    }

    /// Whether `ctx` is this provider's device context (never once it was given back).
    fn is_ctx(&self, ctx: *mut rs::ibv_context) -> bool {
        self.parts
            .read()
            .as_ref()
            .is_some_and(|p| p.dev.ctx() == ctx)
    }

    /// The device's handles, held for reading; `NoDevice` once the device went away.
    fn parts(&self) -> Result<MappedRwLockReadGuard<'_, DevParts>, VerbsError> {
        let gone = || VerbsError::NoDevice(format!("the RDMA device {} was removed", self.device));
        if self.lost.load(Ordering::SeqCst) {
            return Err(gone());
        }
        RwLockReadGuard::try_map(self.parts.read(), |p| p.as_ref()).map_err(|_| gone())
    }

    /// Give the device back if it was lost, the provider's owner asked for it
    /// ([`Provider::release_device`]) and nothing made on it is left.
    fn try_release(&self) {
        if !self.lost.load(Ordering::SeqCst) || !self.release_wanted.load(Ordering::SeqCst) {
            return;
        }
        let st = self.st.lock();
        let mut parts = self.parts.write();
        // Objects are made only with `st` or `parts` held: the count cannot grow meanwhile.
        if parts.is_none() || self.objects.load(Ordering::SeqCst) != 0 || !st.ids.is_empty() {
            return;
        }
        let gone = parts.take();
        drop(parts);
        drop(st);
        drop(gone);
        // librdmacm keeps a context it opened until it sees the device gone from the list
        // with no id on it any more: let it look now, so the kernel can finish the removal
        // (and whenever another device goes: devices.rs).
        devices::resync_soon();
    }

    fn create_cq(&self, caps: QpCaps) -> Result<Cq, VerbsError> {
        let cqe = (caps.max_send_wr as u64 + caps.max_recv_wr as u64 + 16).min(self.max_cqe as u64);
        let p = self.parts()?;
        let cq = Cq::new(&p.dev, &p.comp, cqe as i32)
            .map_err(|e| map::errno_error(e, "ibv_create_cq"))?;
        // Armed from the start, so the first completion is notified even before `arm`.
        cq.req_notify();
        Ok(cq)
    }

    fn create_qp<'a>(&self, conn: &'a Conn, caps: QpCaps) -> Result<&'a Qp, VerbsError> {
        self.create_qp_on(&conn.id, &conn.cq, caps)
    }

    fn create_qp_on<'a>(&self, id: &'a CmId, cq: &Cq, caps: QpCaps) -> Result<&'a Qp, VerbsError> {
        let cap = |max_inline_data| rs::ibv_qp_cap {
            max_send_wr: caps.max_send_wr.clamp(1, self.max_qp_wr),
            max_recv_wr: caps.max_recv_wr.clamp(1, self.max_qp_wr),
            max_send_sge: if self.gather { 2 } else { 1 },
            max_recv_sge: 1,
            max_inline_data,
        };
        let pd = &self.parts()?.pd;
        // The inline data asked for, then less: devices take different amounts (siw 80
        // bytes, rxe 400), and say only by refusing. Without gathering, none is used.
        let mut r = Err(libc::EINVAL);
        for want in [caps.max_inline, INLINE_FALLBACK, 0] {
            if want > caps.max_inline || (want > 0 && !self.gather) {
                continue;
            }
            // The id is bound to the provider's device (checked by the callers), the PD its.
            r = id.create_qp(pd, cq, cap(want));
            if r.is_ok() {
                break;
            }
        }
        r.map_err(|e| map::errno_error(e, "rdma_create_qp"))
    }

    fn conn_param(&self, accept: bool) -> ConnParam {
        ConnParam {
            responder_resources: if accept {
                RDMA_MAX_RESP_RES
            } else {
                self.resp_res
            },
            initiator_depth: if accept {
                RDMA_MAX_INIT_DEPTH
            } else {
                self.init_depth
            },
            flow_control: 1,
            retry_count: 7,
            // RNR retries forever, as rsockets does: the engine's credits keep receives posted.
            rnr_retry_count: 7,
        }
    }
}

/// Reject a request's id (which has no QP) and destroy it.
fn reject_destroy(id: CmId, why: &[u8]) {
    let _ = id.reject(&why[..why.len().min(MAX_REJECT_PRIVATE_DATA)]);
}

/// Bind `id` to `addr`.
fn bind_addr(id: &CmId, addr: SocketAddr) -> Result<(), VerbsError> {
    id.bind_addr(addr).map_err(|e| match e {
        libc::EADDRNOTAVAIL | libc::ENODEV => {
            VerbsError::NoDevice(format!("{addr}: no RDMA device has this address"))
        }
        e => map::errno_error(e, "rdma_bind_addr"),
    })
}

/// Memory for a region: pages of its own (an anonymous mapping, never shared with other heap
/// objects), zeroed, and `MADV_DONTFORK`. A `fork` must not make the parent's registered pages
/// copy-on-write: on kernels before 5.13 the device kept the page the child inherited and the
/// parent's next write went to a fresh copy the device never saw (lost receives, stale sends);
/// on newer kernels fork copies pinned pages at once instead, so every fork would copy all
/// registered memory. The child has no use for it: it holds none of the parent's QPs (a child
/// that touches a parent's region gets SIGSEGV).
fn alloc_pages(size: usize) -> Result<Mapping, VerbsError> {
    let m = Mapping::anon(size).map_err(|_| VerbsError::NoResources("memory"))?;
    m.dont_fork()
        .map_err(|e| map::errno_error(os_errno(e), "madvise(MADV_DONTFORK)"))?;
    Ok(m)
}

/// A real RDMA device (context + protection domain + connection manager).
#[derive(Clone)]
pub struct RdmaProvider {
    sh: Arc<Shared>,
}

impl std::fmt::Debug for RdmaProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaProvider")
            .field("device", &self.sh.device)
            .field("local_ip", &self.sh.local_ip)
            .field("transport", &self.sh.transport)
            .finish()
    }
}

impl RdmaProvider {
    /// The device that owns the local address `ip` (a specific address, not 0.0.0.0).
    pub fn for_local_addr(ip: IpAddr) -> Result<RdmaProvider, VerbsError> {
        if ip.is_unspecified() {
            return Err(VerbsError::Invalid(
                "an unspecified address names no device: give one of the device's addresses",
            ));
        }
        let ch = EventChannel::new()?;
        let id = ch.create_id()?;
        bind_addr(&id, SocketAddr::new(ip, 0))?;
        let sh = Shared::open(ch, id, ip)?;
        Ok(RdmaProvider { sh: Arc::new(sh) })
    }

    /// The device through which the CM reaches `dst`; the provider's local address is the
    /// source address the CM picked. Blocks for the address resolution (at most ~2 s).
    pub fn for_peer(dst: SocketAddr) -> Result<RdmaProvider, VerbsError> {
        let ch = EventChannel::new()?;
        let id = ch.create_id()?;
        id.resolve_addr(dst, RESOLVE_TIMEOUT_MS)
            .map_err(|e| map::errno_error(e, "rdma_resolve_addr"))?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            if let Some(ev) = ch.get_event() {
                if ev.kind == map::EV_ADDR_RESOLVED {
                    break;
                }
                return Err(VerbsError::NoDevice(format!(
                    "{dst}: address resolution failed ({})",
                    map::cm_event_name(ev.kind)
                )));
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(VerbsError::NoDevice(format!(
                    "{dst}: address resolution timed out"
                )));
            }
            sys::poll_readable(ch.fd(), left.as_millis().min(1000) as i32);
        }
        let Some(local) = id.addr(true) else {
            return Err(VerbsError::NoDevice(format!("{dst}: no source address")));
        };
        let sh = Shared::open(ch, id, local.ip())?;
        Ok(RdmaProvider { sh: Arc::new(sh) })
    }

    /// The device's name (e.g. `rxe0`, `mlx5_0`).
    pub fn device_name(&self) -> &str {
        &self.sh.device
    }

    /// The local address that chose the device (connections leave from it by default).
    pub fn local_ip(&self) -> IpAddr {
        self.sh.local_ip
    }

    /// Sleep until [`Provider::notify_fd`] is readable or `timeout` passes (the last step of
    /// the waiting protocol, after `arm` and one more poll). True if the fd is readable.
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        // Round up, so a deadline a few microseconds away is not a busy loop.
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        sys::poll_readable(self.sh.epfd.as_raw_fd(), ms)
    }

    /// Whether the device is iWARP (its RDMA Read sinks need remote write access).
    pub fn is_iwarp(&self) -> bool {
        self.sh.transport == Transport::Iwarp
    }
}

impl Provider for RdmaProvider {
    type Mr = RdmaMr;
    type Endpoint = RdmaEndpoint;
    type Listener = RdmaListener;

    fn name(&self) -> &'static str {
        "rdma"
    }

    fn prefers_send_gather(&self) -> bool {
        self.sh.software && self.sh.gather
    }

    /// Not on Soft-RoCE. Its responder replays a retransmitted RDMA Read by looking the
    /// region up again (`rxe_resp.c`, `rxe_recheck_mr`), and one replayed after the source
    /// revoked the advertisement's region (the read had completed, the source was told) is an
    /// R_Key violation that moves the source's QP to the error state with nothing reported but
    /// flushes: the connection resets (ECONNRESET; before 2026-11-27 it hung). The rig's soak
    /// met it in about one 60 s run of five with split zero copy and in none of nine without
    /// (docs/findings.md). Gathered SENDs only on Soft-RoCE; siw (iWARP over TCP) keeps
    /// the split.
    fn prefers_split_zcopy(&self) -> bool {
        self.prefers_send_gather() && self.is_iwarp()
    }

    fn initiator_sends_first(&self) -> bool {
        self.is_iwarp()
    }

    fn reg_mr(&self, len: usize, access: Access) -> Result<RdmaMr, VerbsError> {
        let flags = map::access_flags(access, self.sh.transport)?;
        let size = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or(VerbsError::Invalid("region too large"))?;
        let buf = alloc_pages(size)?;
        // Held until the region counts: the device is not given back under it.
        let parts = self.sh.parts()?;
        // SAFETY: buf holds size >= len.max(1) bytes that stay mapped until the region is
        // dropped, which drops the registration first and the provider (and its PD) after.
        let mr = unsafe { Mr::register(&parts.pd, buf.ptr().as_ptr(), len.max(1), flags) };
        let mr = mr.map_err(|e| match e {
            libc::ENOMEM | libc::EFAULT | libc::EPERM => {
                VerbsError::NoResources("registered memory (RLIMIT_MEMLOCK?)")
            }
            e => map::errno_error(e, "ibv_reg_mr"),
        })?;
        Ok(RdmaMr {
            grants: Vec::new(),
            mr: Some(mr),
            buf,
            sh: Hold::new(&self.sh),
            len,
            access,
            next_grant: 1,
        })
    }

    fn listen(
        &self,
        addr: SocketAddr,
        backlog: u32,
        caps: QpCaps,
    ) -> Result<RdmaListener, VerbsError> {
        let sh = &self.sh;
        let mut st = sh.st.lock();
        drop(sh.parts()?);
        let id = sh.channel.create_id()?;
        bind_addr(&id, addr)?;
        if !addr.ip().is_unspecified() && !sh.is_ctx(id.verbs()) {
            return Err(VerbsError::NoDevice(format!(
                "{addr} belongs to another RDMA device than this provider's {}",
                sh.device
            )));
        }
        id.listen(backlog.min(i32::MAX as u32) as i32)
            .map_err(|e| map::errno_error(e, "rdma_listen"))?;
        let local = id.addr(true).unwrap_or(addr);
        let key = id.key();
        st.ids.insert(
            key,
            Slot::Listener(ListenSlot {
                caps,
                requests: VecDeque::new(),
                wrong_device: 0,
                removed: false,
            }),
        );
        Ok(RdmaListener {
            sh: Hold::new(sh),
            key,
            id: Some(id),
            local,
        })
    }

    fn connect(
        &self,
        dst: SocketAddr,
        src: Option<SocketAddr>,
        caps: QpCaps,
        private_data: &[u8],
    ) -> Result<RdmaEndpoint, VerbsError> {
        if private_data.len() > MAX_CONNECT_PRIVATE_DATA {
            return Err(VerbsError::Invalid("connect private data over 56 bytes"));
        }
        let sh = &self.sh;
        let mut st = sh.st.lock();
        drop(sh.parts()?);
        let id = sh.channel.create_id()?;
        let bind = match src {
            // A port the application bound without an address: the device's address.
            Some(s) if s.ip().is_unspecified() => SocketAddr::new(sh.local_ip, s.port()),
            Some(s) => s,
            None => SocketAddr::new(sh.local_ip, 0),
        };
        bind_addr(&id, bind)?;
        if !sh.is_ctx(id.verbs()) {
            return Err(VerbsError::NoDevice(format!(
                "source {bind} belongs to another RDMA device than this provider's {}",
                sh.device
            )));
        }
        let cq = sh.create_cq(caps)?;
        let local = id.addr(true).unwrap_or(bind);
        if let Err(e) = id.resolve_addr(dst, RESOLVE_TIMEOUT_MS) {
            // The CQ (unused) first, then the id.
            drop(cq);
            return Err(map::errno_error(e, "rdma_resolve_addr"));
        }
        let key = id.key();
        let conn = Arc::new(Conn { cq, id });
        st.ids.insert(
            key,
            Slot::Ep(EpSlot {
                conn: conn.clone(),
                events: VecDeque::new(),
                connect: Some((private_data.to_vec(), caps)),
                pending_recvs: Vec::new(),
                failure: None,
            }),
        );
        Ok(RdmaEndpoint {
            sh: Hold::new(sh),
            key,
            conn: Some(conn),
            has_qp: false,
            caps,
            local,
            peer: dst,
        })
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.sh.epfd.as_raw_fd())
    }

    fn arm(&self) -> Result<(), VerbsError> {
        let sh = &self.sh;
        let mut st = sh.st.lock();
        sh.pump_cm(&mut st);
        match sh.parts.read().as_ref() {
            Some(p) => p.comp.drain(),
            // Given back: no completion channel, no CQ.
            None => return Ok(()),
        }
        // Arm every CQ even if one fails (a CQ of a removed device); report the first error.
        let mut res = Ok(());
        for slot in st.ids.values() {
            let Slot::Ep(ep) = slot else { continue };
            let rc = ep.conn.cq.req_notify();
            if rc != 0 && res.is_ok() {
                res = Err(map::errno_error(rc, "ibv_req_notify_cq"));
            }
        }
        res
    }

    fn device_lost(&self) -> bool {
        self.sh.lost.load(Ordering::SeqCst)
    }

    fn release_device(&self) {
        if self.device_lost() {
            self.sh.release_wanted.store(true, Ordering::SeqCst);
            self.sh.try_release();
        }
    }
}

/// A registered region of page-aligned memory owned by the region. The fields drop in order:
/// the grants' registrations, the region's, the memory, then the provider (with the PD).
pub struct RdmaMr {
    /// Grants not yet revoked, by id; each deregisters its sub-range when dropped.
    grants: Vec<(u64, Mr)>,
    /// `None` only if re-registration failed (then every access fails at the HCA).
    mr: Option<Mr>,
    /// Whole pages, at least `len` bytes.
    buf: Mapping,
    sh: Hold,
    len: usize,
    access: Access,
    next_grant: u64,
}

impl std::fmt::Debug for RdmaMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaMr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .field("access", &self.access)
            .finish()
    }
}

impl RdmaMr {
    fn check(&self, off: usize, n: usize, what: &str) {
        assert!(
            off.checked_add(n).is_some_and(|end| end <= self.len),
            "RdmaMr::{what} out of bounds: {n} bytes at {off} in a {}-byte region",
            self.len
        );
    }

    fn register(&self, flags: u32) -> Option<Mr> {
        // This region counts: the device's handles are there while it lives.
        let parts = self.sh.parts.read();
        let pd = &parts.as_ref()?.pd;
        // SAFETY: buf holds at least len.max(1) bytes owned by self, which drops the
        // registration before the memory and the provider.
        unsafe { Mr::register(pd, self.buf.ptr().as_ptr(), self.len.max(1), flags) }.ok()
    }
}

impl MemoryRegion for RdmaMr {
    fn lkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, |m| m.keys().0)
    }
    fn rkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, |m| m.keys().1)
    }
    fn addr(&self) -> u64 {
        self.buf.ptr().as_ptr() as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn access(&self) -> Access {
        self.access
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.buf.ptr())
    }
    fn set_access(&mut self, access: Access) -> Result<(), VerbsError> {
        let flags = map::access_flags(access, self.sh.transport)?;
        if let Some(mr) = &self.mr {
            if mr.rereg_access(flags) == 0 {
                self.access = access;
                return Ok(());
            }
            // Refused (or left undefined): deregister and register anew; the keys change.
            self.mr = None;
        }
        let Some(mr) = self.register(flags) else {
            let e = map::errno_error(errno(), "ibv_reg_mr (set_access)");
            // Keep a registration with the old rights if we can.
            if let Ok(old) = map::access_flags(self.access, self.sh.transport) {
                self.mr = self.register(old);
            }
            return Err(e);
        };
        self.mr = Some(mr);
        self.access = access;
        Ok(())
    }
    fn advertise(&mut self, off: usize, len: usize, access: Access) -> Result<Grant, VerbsError> {
        check_grant(self.len, off, len, access)?;
        let flags = map::access_flags(access, self.sh.transport)?;
        let addr = self.addr() + off as u64;
        let own = map::access_flags(self.access, self.sh.transport)?;
        if !map::remote_flags(flags) && flags & !own == 0 && self.mr.is_some() {
            // Nothing for a peer, nothing the region lacks: the region's own lkey serves.
            return Ok(Grant {
                addr,
                len,
                lkey: self.lkey(),
                rkey: 0,
                id: 0,
            });
        }
        let parts = self.sh.parts()?;
        // SAFETY: the range is inside the region's memory (checked above), which stays mapped
        // until the region is dropped, and the region drops its grants first (and the
        // provider with the PD after).
        let sub = unsafe {
            Mr::register(
                &parts.pd,
                self.buf.ptr().as_ptr().wrapping_add(off),
                len,
                flags,
            )
        };
        let sub = sub.map_err(|e| match e {
            libc::ENOMEM | libc::EFAULT | libc::EPERM => {
                VerbsError::NoResources("registered memory (RLIMIT_MEMLOCK?)")
            }
            e => map::errno_error(e, "ibv_reg_mr (grant)"),
        })?;
        let (lkey, rkey) = sub.keys();
        let id = self.next_grant;
        self.next_grant += 1;
        self.grants.push((id, sub));
        Ok(Grant {
            addr,
            len,
            lkey,
            rkey,
            id,
        })
    }
    fn revoke(&mut self, grant: &Grant) -> Result<(), VerbsError> {
        if grant.id == 0 {
            // Registered nothing (see advertise).
            return Ok(());
        }
        let Some(i) = self.grants.iter().position(|(id, _)| *id == grant.id) else {
            return Err(VerbsError::Invalid("no such grant"));
        };
        // Dropping the registration deregisters it.
        self.grants.swap_remove(i);
        Ok(())
    }
    fn read(&self, off: usize, dst: &mut [u8]) {
        self.check(off, dst.len(), "read");
        self.buf.read_bytes(off, dst);
    }
    fn write(&mut self, off: usize, src: &[u8]) {
        self.check(off, src.len(), "write");
        self.buf.write_bytes(off, src);
    }
}

fn post_recv(qp: &Qp, wr: &RecvWr) -> Result<(), VerbsError> {
    qp.post_recv(wr)
        .map_err(|rc| map::errno_error(rc, "receive queue"))
}

/// One connection: CM id, RC QP and its CQ.
pub struct RdmaEndpoint {
    sh: Hold,
    /// The id's key in the provider's table.
    key: usize,
    /// `None` only in `drop`, which drops it with the provider's lock held.
    conn: Option<Arc<Conn>>,
    /// The QP exists (active side: after route resolution) and the endpoint has seen it.
    has_qp: bool,
    caps: QpCaps,
    local: SocketAddr,
    peer: SocketAddr,
}

impl std::fmt::Debug for RdmaEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaEndpoint")
            .field("local", &self.local)
            .field("peer", &self.peer)
            .finish()
    }
}

impl RdmaEndpoint {
    fn conn(&self) -> &Arc<Conn> {
        self.conn.as_ref().expect("taken only in drop")
    }

    /// Why the provider itself failed this connection attempt (device mismatch, QP creation,
    /// `rdma_connect`), if it did; the engine only sees the `CmEvent`.
    pub fn failure(&self) -> Option<String> {
        match self.sh.st.lock().ids.get(&self.key) {
            Some(Slot::Ep(ep)) => ep.failure.clone(),
            _ => None,
        }
    }

    /// Whether the QP exists; `Ok(false)` with the receive queued if it does not yet.
    fn qp_or_queue(&mut self, recv: Option<&RecvWr>) -> Result<bool, VerbsError> {
        if self.has_qp {
            return Ok(true);
        }
        let mut st = self.sh.st.lock();
        let Some(Slot::Ep(ep)) = st.ids.get_mut(&self.key) else {
            return Err(VerbsError::NotConnected);
        };
        if ep.conn.id.qp().is_some() {
            self.has_qp = true;
            return Ok(true);
        }
        match recv {
            Some(wr) if ep.failure.is_none() => {
                if ep.pending_recvs.len() >= self.caps.max_recv_wr as usize {
                    return Err(VerbsError::QueueFull("receive queue"));
                }
                ep.pending_recvs.push(*wr);
                Ok(false)
            }
            _ => Err(VerbsError::NotConnected),
        }
    }

    /// The QP; `has_qp` says it exists.
    fn qp(&self) -> &Qp {
        self.conn().id.qp().expect("has_qp")
    }
}

impl Endpoint for RdmaEndpoint {
    fn post_recv(&mut self, wr: &RecvWr) -> Result<(), VerbsError> {
        if self.qp_or_queue(Some(wr))? {
            post_recv(self.qp(), wr)
        } else {
            Ok(())
        }
    }

    fn post_send(&mut self, wr: &SendWr) -> Result<(), VerbsError> {
        self.post_sends(std::slice::from_ref(wr))
    }

    fn inline_max(&self) -> usize {
        // Once the QP exists (an endpoint before its QP queues its posts: none inline).
        if !self.has_qp || !self.sh.gather {
            return 0;
        }
        self.qp().max_inline() as usize
    }

    fn post_send_inline(&mut self, wr: &SendWr, payload: &[u8]) -> Result<(), VerbsError> {
        if !self.qp_or_queue(None)? {
            return Err(VerbsError::NotConnected);
        }
        crate::verbs::inline_payload(wr, payload, self.inline_max())?;
        self.qp()
            .post_send_inline(wr, payload)
            .map_err(|rc| map::errno_error(rc, "send queue"))
    }

    fn post_sends(&mut self, wrs: &[SendWr]) -> Result<(), VerbsError> {
        if !self.qp_or_queue(None)? {
            return Err(VerbsError::NotConnected);
        }
        if !self.sh.gather && wrs.iter().any(|w| w.payload.is_some()) {
            return Err(VerbsError::Invalid("the device gathers one SGE per send"));
        }
        self.qp()
            .post_sends(wrs)
            .map_err(|rc| map::errno_error(rc, "send queue"))
    }

    fn poll_cq(&mut self, out: &mut [Completion]) -> usize {
        const BATCH: usize = 32;
        let cq = &self.conn().cq;
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(BATCH);
            let mut wcs: [MaybeUninit<rs::ibv_wc>; BATCH] =
                [const { MaybeUninit::uninit() }; BATCH];
            let got = cq.poll(&mut wcs[..want]);
            if got.is_empty() {
                break;
            }
            for w in got {
                out[done] = Completion {
                    wr_id: w.wr_id,
                    status: map::wc_status(w.status),
                    opcode: map::wc_opcode(w.opcode, WcOpcode::Send),
                    byte_len: w.byte_len,
                };
                done += 1;
            }
            if got.len() < want {
                break;
            }
        }
        done
    }

    fn poll_cm(&mut self) -> Option<CmEvent> {
        let mut st = self.sh.st.lock();
        self.sh.pump_cm_polled(&mut st);
        match st.ids.get_mut(&self.key) {
            Some(Slot::Ep(ep)) => ep.events.pop_front(),
            _ => None,
        }
    }

    fn accept(&mut self, private_data: &[u8]) -> Result<(), VerbsError> {
        if private_data.len() > MAX_ACCEPT_PRIVATE_DATA {
            return Err(VerbsError::Invalid("accept private data over 196 bytes"));
        }
        self.conn()
            .id
            .accept(&self.sh.conn_param(true), private_data)
            .map_err(|e| map::errno_error(e, "rdma_accept"))
    }

    fn reject(&mut self, private_data: &[u8]) -> Result<(), VerbsError> {
        if private_data.len() > MAX_REJECT_PRIVATE_DATA {
            return Err(VerbsError::Invalid("reject private data over 148 bytes"));
        }
        self.conn()
            .id
            .reject(private_data)
            .map_err(|e| map::errno_error(e, "rdma_reject"))
    }

    fn disconnect(&mut self) -> Result<(), VerbsError> {
        self.conn().id.disconnect().map_err(|e| match e {
            libc::EINVAL | libc::ENOTCONN => VerbsError::NotConnected,
            e => map::errno_error(e, "rdma_disconnect"),
        })
    }

    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }
}

impl Drop for RdmaEndpoint {
    fn drop(&mut self) {
        let mut st = self.sh.st.lock();
        let slot = st.ids.remove(&self.key);
        // The id, its QP and the CQ go with the last reference, here, with `st` held (no
        // `arm` can touch the CQ).
        drop(slot);
        drop(self.conn.take());
        drop(st);
    }
}

/// A listening CM id.
pub struct RdmaListener {
    sh: Hold,
    /// The id's key in the provider's table.
    key: usize,
    /// `None` only in `drop`, which destroys it with the provider's lock held.
    id: Option<CmId>,
    local: SocketAddr,
}

impl std::fmt::Debug for RdmaListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaListener")
            .field("local", &self.local)
            .finish()
    }
}

impl RdmaListener {
    /// Requests rejected because they arrived on another device than the provider's.
    pub fn wrong_device_rejects(&self) -> u64 {
        match self.sh.st.lock().ids.get(&self.key) {
            Some(Slot::Listener(l)) => l.wrong_device,
            _ => 0,
        }
    }

    /// Whether the device went away (DEVICE_REMOVAL): no request will come any more.
    pub fn device_removed(&self) -> bool {
        match self.sh.st.lock().ids.get(&self.key) {
            Some(Slot::Listener(l)) => l.removed,
            _ => true,
        }
    }
}

impl Listener for RdmaListener {
    type Endpoint = RdmaEndpoint;

    fn poll_request(&mut self) -> Option<(RdmaEndpoint, Vec<u8>)> {
        let mut st = self.sh.st.lock();
        self.sh.pump_cm_polled(&mut st);
        let Some(Slot::Listener(l)) = st.ids.get_mut(&self.key) else {
            return None;
        };
        let caps = l.caps;
        let r = l.requests.pop_front()?;
        Some((
            RdmaEndpoint {
                sh: Hold::new(&self.sh),
                key: r.conn.id.key(),
                conn: Some(r.conn),
                has_qp: true,
                caps,
                local: r.local,
                peer: r.peer,
            },
            r.private_data,
        ))
    }

    fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Drop for RdmaListener {
    fn drop(&mut self) {
        let mut st = self.sh.st.lock();
        if let Some(Slot::Listener(l)) = st.ids.remove(&self.key) {
            for r in l.requests {
                // The request's id, QP and CQ were never handed out: rejected, then destroyed
                // here in order (QP, CQ, id) with `st` held, as the last references go.
                let slot = st.ids.remove(&r.conn.id.key());
                let _ = r.conn.id.reject(&[]);
                drop(slot);
                drop(r);
            }
        }
        // The listening id, with `st` held; its events were acknowledged.
        drop(self.id.take());
        drop(st);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The VmFlags of the mapping of this process that holds `addr` (/proc/self/smaps).
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = (a..b).contains(&addr);
                    continue;
                }
            }
            if inside {
                if let Some(f) = line.strip_prefix("VmFlags:") {
                    return f.to_string();
                }
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// Registered memory is left out of forked children (`dc`, VM_DONTCOPY, in its VmFlags:
    /// what MADV_DONTFORK sets; `dd` would be VM_DONTDUMP), zeroed, and
    /// the heap around it is not (the flag must not reach other objects' pages).
    #[test]
    fn region_memory_is_dontfork_and_its_own() {
        let size = 3 * PAGE;
        let p = alloc_pages(size).unwrap();
        let addr = p.ptr().as_ptr() as usize;
        assert_eq!(addr % PAGE, 0);
        for at in [addr, addr + size - 1] {
            let f = vm_flags(at);
            assert!(f.split_whitespace().any(|w| w == "dc"), "{at:#x}: {f}");
        }
        let mut bytes = vec![1u8; size];
        p.read_bytes(0, &mut bytes);
        assert!(bytes.iter().all(|&b| b == 0));
        let heap = Box::new([7u8; 64]);
        let f = vm_flags(heap.as_ptr() as usize);
        assert!(!f.split_whitespace().any(|w| w == "dc"), "heap: {f}");
        drop(p);
    }
}
