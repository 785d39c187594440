//! The `rdma` provider: real RDMA devices through librdmacm and libibverbs (rdma-sys).
//!
//! All librdmacm/libibverbs FFI of the crate lives in this module (the host's system calls are
//! `crate::sys`'s); every `unsafe` block says why it is sound.
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

mod map;

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::CStr;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use parking_lot::Mutex;
use rdma_sys as rs;

use self::map::Transport;
use super::{
    check_grant, Access, CmEvent, Completion, Endpoint, Grant, Listener, MemoryRegion, Provider,
    QpCaps, RecvWr, SendOp, SendWr, VerbsError, WcOpcode,
};

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

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn set_nonblocking(fd: RawFd) -> Result<(), VerbsError> {
    // SAFETY: fcntl on an fd we own; F_GETFL/F_SETFL take and return plain integers.
    let rc = unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 {
            -1
        } else {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK)
        }
    };
    if rc < 0 {
        return Err(map::errno_error(errno(), "fcntl O_NONBLOCK"));
    }
    Ok(())
}

/// The address in a CM id's route (`src`: local side; else the peer's).
///
/// # Safety
/// `id` must be a live CM id.
unsafe fn id_addr(id: *mut rs::rdma_cm_id, src: bool) -> Option<SocketAddr> {
    // SAFETY: per the caller, id is live; the address unions are plain old data of the size
    // of a sockaddr_storage.
    unsafe {
        let a = &(*id).route.addr;
        let bytes = if src {
            map::storage_bytes(&a.src_addr_union.src_storage)
        } else {
            map::storage_bytes(&a.dst_addr_union.dst_storage)
        };
        map::from_sockaddr_bytes(bytes)
    }
}

/// The device handles of a provider, and the bookkeeping its objects share.
struct Shared {
    ctx: *mut rs::ibv_context,
    pd: *mut rs::ibv_pd,
    channel: *mut rs::rdma_event_channel,
    comp: *mut rs::ibv_comp_channel,
    /// The id that selected the device; it keeps librdmacm's reference on it.
    anchor: *mut rs::rdma_cm_id,
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
    lost: std::sync::atomic::AtomicBool,
    /// `true` once the device was given back (`pd`, `comp` and `anchor` destroyed). Held for
    /// reading while a CM id or region is made, for writing to release.
    released: parking_lot::RwLock<bool>,
    /// [`Provider::release_device`] was called: give the device back as soon as no object
    /// made on it is left.
    release_wanted: std::sync::atomic::AtomicBool,
    /// Endpoints, listeners and regions alive (each holds a [`Hold`]).
    objects: std::sync::atomic::AtomicUsize,
}

/// An endpoint's, listener's or region's hold on the provider: counted, so that after the
/// device was lost it is given back when the last object made on it goes.
struct Hold(Arc<Shared>);

impl Hold {
    fn new(sh: &Arc<Shared>) -> Hold {
        sh.objects.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Hold(sh.clone())
    }
}

impl std::ops::Deref for Hold {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        // After the object's own Drop: its verbs objects are destroyed, `st` is let go.
        if self
            .0
            .objects
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            self.0.try_release();
        }
    }
}

/// `vendor_id` of Soft-RoCE (rdma_rxe) and of siw (soft iWARP).
const SOFTWARE_VENDORS: [u32; 2] = [0x00ff_ffff, 0x0062_6d74];

// SAFETY: the verbs and CM objects behind the pointers may be used from any thread (libibverbs
// and librdmacm lock internally); the provider's own mutable bookkeeping is behind `st`, and
// objects are only destroyed with `st` held or when the last reference is gone.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

#[derive(Default)]
struct State {
    ids: HashMap<usize, Slot>,
    /// Every live CQ, for `arm`.
    cqs: HashSet<usize>,
}

enum Slot {
    Ep(EpSlot),
    Listener(ListenSlot),
}

struct EpSlot {
    events: VecDeque<CmEvent>,
    cq: *mut rs::ibv_cq,
    qp: *mut rs::ibv_qp,
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
    id: *mut rs::rdma_cm_id,
    cq: *mut rs::ibv_cq,
    qp: *mut rs::ibv_qp,
    private_data: Vec<u8>,
    local: SocketAddr,
    peer: SocketAddr,
}

impl Shared {
    /// Opens the provider on the device `anchor` is bound to.
    ///
    /// # Safety
    /// `channel` and `anchor` must be live, `anchor` created on `channel`; on success they are
    /// owned by the result, on error they are destroyed.
    unsafe fn open(
        channel: *mut rs::rdma_event_channel,
        anchor: *mut rs::rdma_cm_id,
        local_ip: IpAddr,
    ) -> Result<Shared, VerbsError> {
        // SAFETY: per the caller, anchor and channel are live; everything created here is
        // destroyed on the error path in reverse order.
        unsafe {
            let fail = |e: VerbsError, pd: *mut rs::ibv_pd, comp: *mut rs::ibv_comp_channel| {
                if !comp.is_null() {
                    rs::ibv_destroy_comp_channel(comp);
                }
                if !pd.is_null() {
                    rs::ibv_dealloc_pd(pd);
                }
                rs::rdma_destroy_id(anchor);
                rs::rdma_destroy_event_channel(channel);
                Err(e)
            };
            let ctx = (*anchor).verbs;
            if ctx.is_null() {
                return fail(
                    VerbsError::NoDevice(format!("{local_ip}: not bound to an RDMA device")),
                    ptr::null_mut(),
                    ptr::null_mut(),
                );
            }
            let dev = (*ctx).device;
            let device = CStr::from_ptr((*dev).name.as_ptr())
                .to_string_lossy()
                .into_owned();
            let transport = if (*dev).transport_type == rs::ibv_transport_type::IBV_TRANSPORT_IWARP
            {
                Transport::Iwarp
            } else {
                Transport::Ib
            };
            let mut attr: rs::ibv_device_attr = std::mem::zeroed();
            if rs::ibv_query_device(ctx, &mut attr) != 0 {
                return fail(
                    map::errno_error(errno(), "ibv_query_device"),
                    ptr::null_mut(),
                    ptr::null_mut(),
                );
            }
            let pd = rs::ibv_alloc_pd(ctx);
            if pd.is_null() {
                return fail(
                    map::errno_error(errno(), "ibv_alloc_pd"),
                    ptr::null_mut(),
                    ptr::null_mut(),
                );
            }
            let comp = rs::ibv_create_comp_channel(ctx);
            if comp.is_null() {
                return fail(
                    map::errno_error(errno(), "ibv_create_comp_channel"),
                    pd,
                    ptr::null_mut(),
                );
            }
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            if ep < 0 {
                return fail(map::errno_error(errno(), "epoll_create1"), pd, comp);
            }
            let epfd = OwnedFd::from_raw_fd(ep);
            for fd in [(*channel).fd, (*comp).fd] {
                if let Err(e) = set_nonblocking(fd) {
                    return fail(e, pd, comp);
                }
                let mut ev = libc::epoll_event {
                    events: libc::EPOLLIN as u32,
                    u64: fd as u64,
                };
                if libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) != 0 {
                    return fail(map::errno_error(errno(), "epoll_ctl"), pd, comp);
                }
            }
            Ok(Shared {
                ctx,
                pd,
                channel,
                comp,
                anchor,
                epfd,
                transport,
                local_ip,
                device,
                max_qp_wr: attr.max_qp_wr.max(1) as u32,
                max_cqe: attr.max_cqe.max(1) as u32,
                init_depth: attr.max_qp_init_rd_atom.clamp(1, 16) as u8,
                resp_res: attr.max_qp_rd_atom.clamp(1, 16) as u8,
                gather: attr.max_sge >= 2,
                software: SOFTWARE_VENDORS.contains(&attr.vendor_id),
                st: Mutex::new(State::default()),
                lost: std::sync::atomic::AtomicBool::new(false),
                released: parking_lot::RwLock::new(false),
                release_wanted: std::sync::atomic::AtomicBool::new(false),
                objects: std::sync::atomic::AtomicUsize::new(0),
            })
        }
    }

    /// Read every pending CM event, acknowledge it and queue it where it belongs.
    fn pump_cm(&self, st: &mut State) {
        loop {
            let mut ev: *mut rs::rdma_cm_event = ptr::null_mut();
            // SAFETY: the channel lives as long as self; its fd is nonblocking, so this returns
            // at once (-1/EAGAIN) when nothing is pending.
            if unsafe { rs::rdma_get_cm_event(self.channel, &mut ev) } != 0 {
                break;
            }
            // SAFETY: ev is valid until rdma_ack_cm_event; the private data pointer (if any)
            // points to private_data_len bytes owned by the event, copied before the ack.
            let (kind, status, id, listen_id, pd) = unsafe {
                let e = &*ev;
                let conn = &e.param.conn;
                let pd = if conn.private_data.is_null() || conn.private_data_len == 0 {
                    Vec::new()
                } else {
                    std::slice::from_raw_parts(
                        conn.private_data as *const u8,
                        conn.private_data_len as usize,
                    )
                    .to_vec()
                };
                (e.event, e.status, e.id, e.listen_id, pd)
            };
            // SAFETY: ev came from rdma_get_cm_event and is acknowledged exactly once.
            unsafe { rs::rdma_ack_cm_event(ev) };
            self.dispatch(st, kind, status, id, listen_id, pd);
        }
    }

    fn dispatch(
        &self,
        st: &mut State,
        kind: u32,
        status: i32,
        id: *mut rs::rdma_cm_id,
        listen_id: *mut rs::rdma_cm_id,
        pd: Vec<u8>,
    ) {
        if kind == map::EV_CONNECT_REQUEST {
            self.on_request(st, id, listen_id, pd);
            return;
        }
        if kind == map::EV_DEVICE_REMOVAL {
            // On any of our ids (the anchor's included): the whole device is going.
            self.lost.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        match st.ids.get_mut(&(id as usize)) {
            Some(Slot::Ep(ep)) => match kind {
                map::EV_ADDR_RESOLVED => self.on_addr_resolved(ep, id),
                map::EV_ROUTE_RESOLVED => self.on_route_resolved(ep, id),
                _ => {
                    if let Some(ev) = map::cm_event(kind, status, &pd, self.transport) {
                        ep.events.push_back(ev);
                    }
                }
            },
            Some(Slot::Listener(l)) if kind == map::EV_DEVICE_REMOVAL => l.removed = true,
            Some(Slot::Listener(_)) => {}
            // An id being torn down, or an event type we never asked for.
            None => {}
        }
    }

    fn on_addr_resolved(&self, ep: &mut EpSlot, id: *mut rs::rdma_cm_id) {
        // SAFETY: id is live (its slot exists, and slots are removed before ids are destroyed).
        let verbs = unsafe { (*id).verbs };
        if verbs != self.ctx {
            ep.failure = Some(format!(
                "the CM resolved the destination through another device than {}",
                self.device
            ));
            ep.events.push_back(CmEvent::AddrError);
            return;
        }
        // SAFETY: as above; resolve_route only starts the resolution.
        if unsafe { rs::rdma_resolve_route(id, RESOLVE_TIMEOUT_MS) } != 0 {
            ep.failure = Some(format!(
                "rdma_resolve_route: {}",
                std::io::Error::from_raw_os_error(errno())
            ));
            ep.events.push_back(CmEvent::RouteError);
        }
    }

    fn on_route_resolved(&self, ep: &mut EpSlot, id: *mut rs::rdma_cm_id) {
        let Some((private_data, caps)) = ep.connect.take() else {
            return;
        };
        let fail = |ep: &mut EpSlot, what: String| {
            ep.failure = Some(what);
            ep.events.push_back(CmEvent::ConnectError);
        };
        let qp = match self.create_qp(id, ep.cq, caps) {
            Ok(qp) => qp,
            Err(e) => return fail(ep, format!("creating the QP: {e}")),
        };
        ep.qp = qp;
        for wr in std::mem::take(&mut ep.pending_recvs) {
            if let Err(e) = post_recv(qp, &wr) {
                return fail(ep, format!("posting a queued receive: {e}"));
            }
        }
        let mut param = self.conn_param(&private_data, false);
        // SAFETY: id is live with a QP; param points to private_data, which outlives the call
        // (librdmacm copies it).
        if unsafe { rs::rdma_connect(id, &mut param) } != 0 {
            let e = errno();
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

    fn on_request(
        &self,
        st: &mut State,
        id: *mut rs::rdma_cm_id,
        listen_id: *mut rs::rdma_cm_id,
        private_data: Vec<u8>,
    ) {
        let caps = match st.ids.get(&(listen_id as usize)) {
            Some(Slot::Listener(l)) if !l.removed => l.caps,
            _ => {
                // SAFETY: a new id from a request event: ours to reject and destroy.
                unsafe { reject_destroy(id, b"SDP: not listening") };
                return;
            }
        };
        // SAFETY: id is the live new id of the request.
        let verbs = unsafe { (*id).verbs };
        if verbs != self.ctx {
            if let Some(Slot::Listener(l)) = st.ids.get_mut(&(listen_id as usize)) {
                l.wrong_device += 1;
            }
            // SAFETY: as above.
            unsafe { reject_destroy(id, WRONG_DEVICE_REJECT) };
            return;
        }
        let cq = match self.create_cq(caps) {
            Ok(cq) => cq,
            Err(_) => {
                // SAFETY: as above.
                unsafe { reject_destroy(id, b"SDP: out of resources") };
                return;
            }
        };
        let qp = match self.create_qp(id, cq, caps) {
            Ok(qp) => qp,
            Err(_) => {
                // SAFETY: cq was just created and is unused; id as above.
                unsafe {
                    rs::ibv_destroy_cq(cq);
                    reject_destroy(id, b"SDP: out of resources");
                }
                return;
            }
        };
        // SAFETY: id is live.
        let (local, peer) = unsafe { (id_addr(id, true), id_addr(id, false)) };
        let unspec = SocketAddr::new(self.local_ip, 0);
        st.cqs.insert(cq as usize);
        st.ids.insert(
            id as usize,
            Slot::Ep(EpSlot {
                events: VecDeque::new(),
                cq,
                qp,
                connect: None,
                pending_recvs: Vec::new(),
                failure: None,
            }),
        );
        if let Some(Slot::Listener(l)) = st.ids.get_mut(&(listen_id as usize)) {
            l.requests.push_back(Request {
                id,
                cq,
                qp,
                private_data,
                local: local.unwrap_or(unspec),
                peer: peer.unwrap_or(unspec),
            });
        }
    }

    fn create_cq(&self, caps: QpCaps) -> Result<*mut rs::ibv_cq, VerbsError> {
        let cqe = (caps.max_send_wr as u64 + caps.max_recv_wr as u64 + 16).min(self.max_cqe as u64);
        // SAFETY: ctx and comp are live for the life of self.
        let cq = unsafe { rs::ibv_create_cq(self.ctx, cqe as i32, ptr::null_mut(), self.comp, 0) };
        if cq.is_null() {
            return Err(map::errno_error(errno(), "ibv_create_cq"));
        }
        // Armed from the start, so the first completion is notified even before `arm`.
        // SAFETY: cq was just created.
        unsafe { rs::ibv_req_notify_cq(cq, 0) };
        Ok(cq)
    }

    fn create_qp(
        &self,
        id: *mut rs::rdma_cm_id,
        cq: *mut rs::ibv_cq,
        caps: QpCaps,
    ) -> Result<*mut rs::ibv_qp, VerbsError> {
        // SAFETY: ibv_qp_init_attr is plain old data (pointers and integers); zero is valid.
        let mut attr: rs::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq;
        attr.recv_cq = cq;
        attr.qp_type = rs::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        attr.cap.max_send_wr = caps.max_send_wr.clamp(1, self.max_qp_wr);
        attr.cap.max_recv_wr = caps.max_recv_wr.clamp(1, self.max_qp_wr);
        attr.cap.max_send_sge = if self.gather { 2 } else { 1 };
        attr.cap.max_recv_sge = 1;
        attr.cap.max_inline_data = caps.max_inline;
        // SAFETY: id is live and bound to self.ctx (checked by the callers), pd belongs to it.
        if unsafe { rs::rdma_create_qp(id, self.pd, &mut attr) } != 0 {
            return Err(map::errno_error(errno(), "rdma_create_qp"));
        }
        // SAFETY: rdma_create_qp stored the QP in the id.
        Ok(unsafe { (*id).qp })
    }

    fn conn_param(&self, private_data: &[u8], accept: bool) -> rs::rdma_conn_param {
        rs::rdma_conn_param {
            private_data: private_data.as_ptr() as *const libc::c_void,
            private_data_len: private_data.len() as u8,
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
            srq: 0,
            qp_num: 0,
        }
    }

    fn create_id(&self) -> Result<*mut rs::rdma_cm_id, VerbsError> {
        self.check_device()?;
        let mut id = ptr::null_mut();
        // SAFETY: the channel is live; id receives the new CM id.
        if unsafe {
            rs::rdma_create_id(
                self.channel,
                &mut id,
                ptr::null_mut(),
                rs::rdma_port_space::RDMA_PS_TCP,
            )
        } != 0
        {
            return Err(map::errno_error(errno(), "rdma_create_id"));
        }
        Ok(id)
    }
}

/// Reject a request's id and destroy it.
///
/// # Safety
/// `id` must be a live id of a connect request with no QP, not used afterwards.
unsafe fn reject_destroy(id: *mut rs::rdma_cm_id, why: &[u8]) {
    // SAFETY: per the caller.
    unsafe {
        rs::rdma_reject(
            id,
            why.as_ptr() as *const libc::c_void,
            why.len().min(MAX_REJECT_PRIVATE_DATA) as u8,
        );
        rs::rdma_destroy_id(id);
    }
}

/// Bind `id` to `addr`.
fn bind_addr(id: *mut rs::rdma_cm_id, addr: SocketAddr) -> Result<(), VerbsError> {
    let mut ss = map::to_sockaddr(addr);
    // SAFETY: id is live; ss is a valid socket address of its family.
    let rc = unsafe { rs::rdma_bind_addr(id, &mut ss as *mut _ as *mut libc::sockaddr) };
    if rc != 0 {
        return Err(match errno() {
            libc::EADDRNOTAVAIL | libc::ENODEV => {
                VerbsError::NoDevice(format!("{addr}: no RDMA device has this address"))
            }
            e => map::errno_error(e, "rdma_bind_addr"),
        });
    }
    Ok(())
}

impl Shared {
    /// Give the device back if it was lost, the provider's owner asked for it
    /// ([`Provider::release_device`]) and no object made on it is left.
    fn try_release(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.lost.load(SeqCst) || !self.release_wanted.load(SeqCst) {
            return;
        }
        let st = self.st.lock();
        let mut released = self.released.write();
        // Objects are made only with `st` or `released` held: the count cannot grow meanwhile.
        if *released || self.objects.load(SeqCst) != 0 || !st.ids.is_empty() || !st.cqs.is_empty() {
            return;
        }
        // SAFETY: nothing made on the device is alive (above), and nothing is made after:
        // `released` is set before the locks are let go.
        unsafe { self.destroy_device_handles() };
        *released = true;
        drop(released);
        drop(st);
        // librdmacm keeps a context it opened until it sees the device gone from the list
        // (`sync_devices_list`, run by `rdma_get_devices`) with no id on it any more: let it
        // close ours now, so the kernel can finish the removal. (It opens the devices still
        // there, as any `rdma_get_devices` caller does.)
        // SAFETY: no arguments; the list (possibly NULL) goes back to rdma_free_devices.
        unsafe {
            let list = rs::rdma_get_devices(ptr::null_mut());
            if !list.is_null() {
                rs::rdma_free_devices(list);
            }
        }
    }

    /// `NoDevice` once the device went away (nothing new is made on it).
    fn check_device(&self) -> Result<(), VerbsError> {
        if self.lost.load(std::sync::atomic::Ordering::SeqCst) || *self.released.read() {
            return Err(VerbsError::NoDevice(format!(
                "the RDMA device {} was removed",
                self.device
            )));
        }
        Ok(())
    }

    /// Destroy the handles that hold the device (completion channel, protection domain, the
    /// anchor id). Called once, with nothing made on them left.
    ///
    /// # Safety
    /// No endpoint, listener or region of this provider is alive, and none is made after.
    unsafe fn destroy_device_handles(&self) {
        // SAFETY: per the caller, the handles are live and unused; destroyed in reverse
        // order of creation.
        unsafe {
            rs::ibv_destroy_comp_channel(self.comp);
            rs::ibv_dealloc_pd(self.pd);
            rs::rdma_destroy_id(self.anchor);
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Every endpoint, listener and region holds an Arc of self: all are gone.
        if !*self.released.get_mut() {
            // SAFETY: nothing made on the handles is left (see above), and they are live
            // (not released).
            unsafe { self.destroy_device_handles() };
        }
        // SAFETY: the channel is live and has no ids left.
        unsafe { rs::rdma_destroy_event_channel(self.channel) };
    }
}

/// Memory for a region: pages of its own (an anonymous mapping, never shared with other heap
/// objects), zeroed, and `MADV_DONTFORK`. A `fork` must not make the parent's registered pages
/// copy-on-write: on kernels before 5.13 the device kept the page the child inherited and the
/// parent's next write went to a fresh copy the device never saw (lost receives, stale sends);
/// on newer kernels fork copies pinned pages at once instead, so every fork would copy all
/// registered memory. The child has no use for it: it holds none of the parent's QPs (a child
/// that touches a parent's region gets SIGSEGV).
fn alloc_pages(size: usize) -> Result<NonNull<u8>, VerbsError> {
    // SAFETY: a fresh anonymous mapping at an address the kernel picks.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(VerbsError::NoResources("memory"));
    }
    // SAFETY: the mapping just made, `size` bytes.
    if unsafe { libc::madvise(p, size, libc::MADV_DONTFORK) } != 0 {
        let e = map::errno_error(errno(), "madvise(MADV_DONTFORK)");
        // SAFETY: the mapping just made, unused.
        unsafe { libc::munmap(p, size) };
        return Err(e);
    }
    NonNull::new(p.cast()).ok_or(VerbsError::NoResources("memory"))
}

/// # Safety
/// `buf`, `size` come from [`alloc_pages`] and nothing (no registration) uses the memory.
unsafe fn free_pages(buf: NonNull<u8>, size: usize) {
    // SAFETY: the caller's contract.
    unsafe { libc::munmap(buf.as_ptr().cast(), size) };
}

fn new_channel() -> Result<*mut rs::rdma_event_channel, VerbsError> {
    // Before the first verbs call of the process: libibverbs then keeps its own queue memory
    // and registered ranges out of forked children on kernels without copy-on-fork for pinned
    // pages (since rdma-core 35 a no-op where the kernel handles fork). An application that
    // used verbs before us gets EINVAL: ignored, our regions are DONTFORK anyway.
    static FORK_INIT: std::sync::Once = std::sync::Once::new();
    // SAFETY: no arguments.
    FORK_INIT.call_once(|| unsafe {
        rs::ibv_fork_init();
    });
    // SAFETY: no arguments; NULL on failure.
    let ch = unsafe { rs::rdma_create_event_channel() };
    if ch.is_null() {
        return Err(VerbsError::NoDevice(format!(
            "rdma_create_event_channel: {} (is rdma_ucm loaded?)",
            std::io::Error::from_raw_os_error(errno())
        )));
    }
    // SAFETY: ch is live.
    if let Err(e) = set_nonblocking(unsafe { (*ch).fd }) {
        // SAFETY: ch is live and unused.
        unsafe { rs::rdma_destroy_event_channel(ch) };
        return Err(e);
    }
    Ok(ch)
}

fn new_id(ch: *mut rs::rdma_event_channel) -> Result<*mut rs::rdma_cm_id, VerbsError> {
    let mut id = ptr::null_mut();
    // SAFETY: ch is live.
    if unsafe {
        rs::rdma_create_id(
            ch,
            &mut id,
            ptr::null_mut(),
            rs::rdma_port_space::RDMA_PS_TCP,
        )
    } != 0
    {
        let e = map::errno_error(errno(), "rdma_create_id");
        // SAFETY: ch is live and has no ids.
        unsafe { rs::rdma_destroy_event_channel(ch) };
        return Err(e);
    }
    Ok(id)
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
        let ch = new_channel()?;
        let id = new_id(ch)?;
        if let Err(e) = bind_addr(id, SocketAddr::new(ip, 0)) {
            // SAFETY: id and ch are live and unused.
            unsafe {
                rs::rdma_destroy_id(id);
                rs::rdma_destroy_event_channel(ch);
            }
            return Err(e);
        }
        // SAFETY: ch and id are live, id was created on ch; open takes them over.
        let sh = unsafe { Shared::open(ch, id, ip)? };
        Ok(RdmaProvider { sh: Arc::new(sh) })
    }

    /// The device through which the CM reaches `dst`; the provider's local address is the
    /// source address the CM picked. Blocks for the address resolution (at most ~2 s).
    pub fn for_peer(dst: SocketAddr) -> Result<RdmaProvider, VerbsError> {
        let ch = new_channel()?;
        let id = new_id(ch)?;
        let cleanup = || {
            // SAFETY: id and ch are live and unused once we give up.
            unsafe {
                rs::rdma_destroy_id(id);
                rs::rdma_destroy_event_channel(ch);
            }
        };
        let mut ss = map::to_sockaddr(dst);
        // SAFETY: id is live; ss is a valid socket address.
        if unsafe {
            rs::rdma_resolve_addr(
                id,
                ptr::null_mut(),
                &mut ss as *mut _ as *mut libc::sockaddr,
                RESOLVE_TIMEOUT_MS,
            )
        } != 0
        {
            let e = map::errno_error(errno(), "rdma_resolve_addr");
            cleanup();
            return Err(e);
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let mut ev: *mut rs::rdma_cm_event = ptr::null_mut();
            // SAFETY: ch is live and nonblocking.
            if unsafe { rs::rdma_get_cm_event(ch, &mut ev) } == 0 {
                // SAFETY: ev is valid until acknowledged, once.
                let kind = unsafe {
                    let k = (*ev).event;
                    rs::rdma_ack_cm_event(ev);
                    k
                };
                if kind == map::EV_ADDR_RESOLVED {
                    break;
                }
                cleanup();
                return Err(VerbsError::NoDevice(format!(
                    "{dst}: address resolution failed ({})",
                    map::cm_event_name(kind)
                )));
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                cleanup();
                return Err(VerbsError::NoDevice(format!(
                    "{dst}: address resolution timed out"
                )));
            }
            let mut pfd = libc::pollfd {
                // SAFETY: ch is live.
                fd: unsafe { (*ch).fd },
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(1000) as i32) };
        }
        // SAFETY: id is live and resolved.
        let local = unsafe { id_addr(id, true) };
        let Some(local) = local else {
            cleanup();
            return Err(VerbsError::NoDevice(format!("{dst}: no source address")));
        };
        // SAFETY: ch and id are live, id was created on ch; open takes them over.
        let sh = unsafe { Shared::open(ch, id, local.ip())? };
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
        let mut pfd = libc::pollfd {
            fd: self.sh.epfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Round up, so a deadline a few microseconds away is not a busy loop.
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, ms) > 0 }
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

    fn initiator_sends_first(&self) -> bool {
        self.is_iwarp()
    }

    fn reg_mr(&self, len: usize, access: Access) -> Result<RdmaMr, VerbsError> {
        let flags = map::access_flags(access, self.sh.transport)?;
        // Held while registering: the device is not released under us.
        let gate = self.sh.released.read();
        if *gate {
            return Err(VerbsError::NoDevice(format!(
                "the RDMA device {} was removed",
                self.sh.device
            )));
        }
        let size = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or(VerbsError::Invalid("region too large"))?;
        let buf = alloc_pages(size)?;
        // SAFETY: pd is live; buf points to size >= len.max(1) bytes that stay allocated (and
        // registered) until the region is dropped.
        let mr = unsafe {
            rs::ibv_reg_mr(
                self.sh.pd,
                buf.as_ptr() as *mut libc::c_void,
                len.max(1),
                flags as i32,
            )
        };
        if mr.is_null() {
            let e = errno();
            // SAFETY: allocated above with this size, not registered.
            unsafe { free_pages(buf, size) };
            return Err(match e {
                libc::ENOMEM | libc::EFAULT | libc::EPERM => {
                    VerbsError::NoResources("registered memory (RLIMIT_MEMLOCK?)")
                }
                e => map::errno_error(e, "ibv_reg_mr"),
            });
        }
        Ok(RdmaMr {
            sh: Hold::new(&self.sh),
            mr,
            buf,
            size,
            len,
            access,
            grants: Vec::new(),
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
        let id = sh.create_id()?;
        let destroy = |e| {
            // SAFETY: id is live and unused.
            unsafe { rs::rdma_destroy_id(id) };
            Err(e)
        };
        if let Err(e) = bind_addr(id, addr) {
            return destroy(e);
        }
        // SAFETY: id is live and bound.
        let verbs = unsafe { (*id).verbs };
        if !addr.ip().is_unspecified() && verbs != sh.ctx {
            return destroy(VerbsError::NoDevice(format!(
                "{addr} belongs to another RDMA device than this provider's {}",
                sh.device
            )));
        }
        // SAFETY: id is live and bound.
        if unsafe { rs::rdma_listen(id, backlog.min(i32::MAX as u32) as i32) } != 0 {
            return destroy(map::errno_error(errno(), "rdma_listen"));
        }
        // SAFETY: id is live.
        let local = unsafe { id_addr(id, true) }.unwrap_or(addr);
        st.ids.insert(
            id as usize,
            Slot::Listener(ListenSlot {
                caps,
                requests: VecDeque::new(),
                wrong_device: 0,
                removed: false,
            }),
        );
        Ok(RdmaListener {
            sh: Hold::new(sh),
            id,
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
        let id = sh.create_id()?;
        let destroy = |e| {
            // SAFETY: id is live and has no QP.
            unsafe { rs::rdma_destroy_id(id) };
            Err(e)
        };
        let bind = src.unwrap_or(SocketAddr::new(sh.local_ip, 0));
        if let Err(e) = bind_addr(id, bind) {
            return destroy(e);
        }
        // SAFETY: id is live and bound.
        if unsafe { (*id).verbs } != sh.ctx {
            return destroy(VerbsError::NoDevice(format!(
                "source {bind} belongs to another RDMA device than this provider's {}",
                sh.device
            )));
        }
        let cq = match sh.create_cq(caps) {
            Ok(cq) => cq,
            Err(e) => return destroy(e),
        };
        // SAFETY: id is live and bound.
        let local = unsafe { id_addr(id, true) }.unwrap_or(bind);
        let mut ss = map::to_sockaddr(dst);
        // SAFETY: id is live and bound (src NULL: resolve from the bound address); ss valid.
        if unsafe {
            rs::rdma_resolve_addr(
                id,
                ptr::null_mut(),
                &mut ss as *mut _ as *mut libc::sockaddr,
                RESOLVE_TIMEOUT_MS,
            )
        } != 0
        {
            let e = map::errno_error(errno(), "rdma_resolve_addr");
            // SAFETY: cq is unused.
            unsafe { rs::ibv_destroy_cq(cq) };
            return destroy(e);
        }
        st.cqs.insert(cq as usize);
        st.ids.insert(
            id as usize,
            Slot::Ep(EpSlot {
                events: VecDeque::new(),
                cq,
                qp: ptr::null_mut(),
                connect: Some((private_data.to_vec(), caps)),
                pending_recvs: Vec::new(),
                failure: None,
            }),
        );
        Ok(RdmaEndpoint {
            sh: Hold::new(sh),
            id,
            cq,
            qp: ptr::null_mut(),
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
        if *sh.released.read() {
            // No completion channel any more (nor CQs: they went first).
            return Ok(());
        }
        loop {
            let mut cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: comp is live and nonblocking; returns -1 when no event is pending. The
            // CQ it names is live: CQs are destroyed only with `st` held.
            if unsafe { rs::ibv_get_cq_event(sh.comp, &mut cq, &mut ctx) } != 0 {
                break;
            }
            // SAFETY: one event of cq was received above.
            unsafe { rs::ibv_ack_cq_events(cq, 1) };
        }
        // Arm every CQ even if one fails (a CQ of a removed device); report the first error.
        let mut res = Ok(());
        for &cq in &st.cqs {
            // SAFETY: the registry holds live CQs only (removed before destruction).
            let rc = unsafe { rs::ibv_req_notify_cq(cq as *mut rs::ibv_cq, 0) };
            if rc != 0 && res.is_ok() {
                res = Err(map::errno_error(rc, "ibv_req_notify_cq"));
            }
        }
        res
    }

    fn device_lost(&self) -> bool {
        self.sh.lost.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn release_device(&self) {
        if self.device_lost() {
            self.sh
                .release_wanted
                .store(true, std::sync::atomic::Ordering::SeqCst);
            self.sh.try_release();
        }
    }
}

/// A registered region of page-aligned memory owned by the region.
pub struct RdmaMr {
    sh: Hold,
    /// Null only if re-registration failed (then every access fails at the HCA).
    mr: *mut rs::ibv_mr,
    buf: NonNull<u8>,
    /// Bytes mapped at `buf` (whole pages).
    size: usize,
    len: usize,
    access: Access,
    /// Grants not yet revoked, by id; each deregisters its sub-range when dropped, which the
    /// region does before it frees its memory.
    grants: Vec<(u64, SubMr)>,
    next_grant: u64,
}

/// A registration of part of a region's memory (a grant), deregistered on drop.
struct SubMr(NonNull<rs::ibv_mr>);

impl SubMr {
    /// Register `len` bytes at `addr` with `flags` on `pd`.
    ///
    /// # Safety
    /// `pd` must be live, and `addr..addr + len` must stay allocated until the result is
    /// dropped.
    unsafe fn register(
        pd: *mut rs::ibv_pd,
        addr: *mut u8,
        len: usize,
        flags: u32,
    ) -> Result<SubMr, VerbsError> {
        // SAFETY: per the caller, pd is live and the memory outlives the registration.
        let mr = unsafe { rs::ibv_reg_mr(pd, addr.cast(), len, flags as i32) };
        match NonNull::new(mr) {
            Some(mr) => Ok(SubMr(mr)),
            None => Err(match errno() {
                libc::ENOMEM | libc::EFAULT | libc::EPERM => {
                    VerbsError::NoResources("registered memory (RLIMIT_MEMLOCK?)")
                }
                e => map::errno_error(e, "ibv_reg_mr (grant)"),
            }),
        }
    }
    fn keys(&self) -> (u32, u32) {
        // SAFETY: the registration is live while self is.
        unsafe { ((*self.0.as_ptr()).lkey, (*self.0.as_ptr()).rkey) }
    }
}

impl Drop for SubMr {
    fn drop(&mut self) {
        // SAFETY: registered in SubMr::register, deregistered once, here. Once it returns the
        // HCA refuses the keys (a peer's access fails with a remote access error).
        unsafe { rs::ibv_dereg_mr(self.0.as_ptr()) };
    }
}

// SAFETY: the region owns its memory; ibv_mr handles may be used from any thread.
unsafe impl Send for RdmaMr {}

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

    fn register(&self, flags: u32) -> *mut rs::ibv_mr {
        // SAFETY: pd is live; buf holds at least len.max(1) bytes owned by self.
        unsafe {
            rs::ibv_reg_mr(
                self.sh.pd,
                self.buf.as_ptr() as *mut libc::c_void,
                self.len.max(1),
                flags as i32,
            )
        }
    }
}

impl MemoryRegion for RdmaMr {
    fn lkey(&self) -> u32 {
        if self.mr.is_null() {
            return 0;
        }
        // SAFETY: mr is live while self is.
        unsafe { (*self.mr).lkey }
    }
    fn rkey(&self) -> u32 {
        if self.mr.is_null() {
            return 0;
        }
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
    fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn access(&self) -> Access {
        self.access
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.buf)
    }
    fn set_access(&mut self, access: Access) -> Result<(), VerbsError> {
        let flags = map::access_flags(access, self.sh.transport)?;
        if !self.mr.is_null() {
            // SAFETY: mr is live; with CHANGE_ACCESS only, pd/addr/length are ignored.
            let rc = unsafe {
                rs::ibv_rereg_mr(
                    self.mr,
                    rs::ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0 as i32,
                    ptr::null_mut(),
                    ptr::null_mut(),
                    0,
                    flags as i32,
                )
            };
            if rc == 0 {
                self.access = access;
                return Ok(());
            }
            // Refused (or left undefined): deregister and register anew; the keys change.
            // SAFETY: mr is live and deregistered once; cleared right after.
            unsafe { rs::ibv_dereg_mr(self.mr) };
            self.mr = ptr::null_mut();
        }
        let mr = self.register(flags);
        if mr.is_null() {
            let e = map::errno_error(errno(), "ibv_reg_mr (set_access)");
            // Keep a registration with the old rights if we can.
            if let Ok(old) = map::access_flags(self.access, self.sh.transport) {
                self.mr = self.register(old);
            }
            return Err(e);
        }
        self.mr = mr;
        self.access = access;
        Ok(())
    }
    fn advertise(&mut self, off: usize, len: usize, access: Access) -> Result<Grant, VerbsError> {
        check_grant(self.len, off, len, access)?;
        let flags = map::access_flags(access, self.sh.transport)?;
        let addr = self.addr() + off as u64;
        let own = map::access_flags(self.access, self.sh.transport)?;
        if !map::remote_flags(flags) && flags & !own == 0 && !self.mr.is_null() {
            // Nothing for a peer, nothing the region lacks: the region's own lkey serves.
            return Ok(Grant {
                addr,
                len,
                lkey: self.lkey(),
                rkey: 0,
                id: 0,
            });
        }
        // SAFETY: pd is live; the range is inside the region's memory (checked above), which
        // stays allocated until the region is dropped, and the region drops its grants first.
        let sub = unsafe { SubMr::register(self.sh.pd, self.buf.as_ptr().add(off), len, flags) }?;
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
        // SAFETY: bounds checked; buf is valid for len bytes; dst does not alias it.
        unsafe {
            ptr::copy_nonoverlapping(self.buf.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        };
    }
    fn write(&mut self, off: usize, src: &[u8]) {
        self.check(off, src.len(), "write");
        // SAFETY: bounds checked; buf is valid for len bytes; src does not alias it.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.buf.as_ptr().add(off), src.len()) };
    }
}

impl Drop for RdmaMr {
    fn drop(&mut self) {
        // The grants' registrations go before the memory they cover.
        self.grants.clear();
        // SAFETY: mr (if any) is live and deregistered once, before its memory is freed; buf
        // was allocated by alloc_pages with size.
        unsafe {
            if !self.mr.is_null() {
                rs::ibv_dereg_mr(self.mr);
            }
            free_pages(self.buf, self.size);
        }
    }
}

fn post_recv(qp: *mut rs::ibv_qp, wr: &RecvWr) -> Result<(), VerbsError> {
    let mut sge = rs::ibv_sge {
        addr: wr.sge.addr,
        length: wr.sge.len,
        lkey: wr.sge.lkey,
    };
    let mut rwr = rs::ibv_recv_wr {
        wr_id: wr.wr_id,
        next: ptr::null_mut(),
        sg_list: &mut sge,
        num_sge: 1,
    };
    let mut bad = ptr::null_mut();
    // SAFETY: qp is live; rwr and sge are valid for the call (the provider copies them).
    let rc = unsafe { rs::ibv_post_recv(qp, &mut rwr, &mut bad) };
    if rc != 0 {
        return Err(map::errno_error(rc, "receive queue"));
    }
    Ok(())
}

/// Fill one send work request (not linked, `sg_list` not set: the caller points it at `sge`
/// once the arrays are in place).
fn fill_send_wr(swr: &mut rs::ibv_send_wr, sge: &mut [rs::ibv_sge; 2], wr: &SendWr) {
    let ib = |s: crate::verbs::Sge| rs::ibv_sge {
        addr: s.addr,
        length: s.len,
        lkey: s.lkey,
    };
    swr.wr_id = wr.wr_id;
    swr.next = ptr::null_mut();
    swr.sg_list = ptr::null_mut();
    swr.num_sge = 0;
    if let Some(s) = wr.sge {
        if s.len > 0 || wr.op == SendOp::Send {
            sge[0] = ib(s);
            swr.num_sge = 1;
            if let (Some(p), SendOp::Send) = (wr.payload, wr.op) {
                sge[1] = ib(p);
                swr.num_sge = 2;
            }
        }
    }
    let (opcode, remote) = match wr.op {
        SendOp::Send => (rs::ibv_wr_opcode::IBV_WR_SEND, None),
        SendOp::Write(r) => (rs::ibv_wr_opcode::IBV_WR_RDMA_WRITE, Some(r)),
        SendOp::Read(r) => (rs::ibv_wr_opcode::IBV_WR_RDMA_READ, Some(r)),
    };
    swr.opcode = opcode;
    if let Some(r) = remote {
        swr.wr.rdma = rs::rdma_t {
            remote_addr: r.addr,
            rkey: r.rkey,
        };
    }
    swr.send_flags = if wr.signaled {
        rs::ibv_send_flags::IBV_SEND_SIGNALED.0
    } else {
        0
    };
}

/// One connection: CM id, RC QP and its CQ.
pub struct RdmaEndpoint {
    sh: Hold,
    id: *mut rs::rdma_cm_id,
    cq: *mut rs::ibv_cq,
    /// Null until the QP exists (active side: after route resolution).
    qp: *mut rs::ibv_qp,
    caps: QpCaps,
    local: SocketAddr,
    peer: SocketAddr,
}

// SAFETY: the id/QP/CQ are owned by this endpoint and usable from any thread; shared
// bookkeeping is behind the provider's mutex.
unsafe impl Send for RdmaEndpoint {}

impl std::fmt::Debug for RdmaEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaEndpoint")
            .field("local", &self.local)
            .field("peer", &self.peer)
            .finish()
    }
}

impl RdmaEndpoint {
    /// Why the provider itself failed this connection attempt (device mismatch, QP creation,
    /// `rdma_connect`), if it did; the engine only sees the `CmEvent`.
    pub fn failure(&self) -> Option<String> {
        match self.sh.st.lock().ids.get(&(self.id as usize)) {
            Some(Slot::Ep(ep)) => ep.failure.clone(),
            _ => None,
        }
    }

    /// The QP, once it exists; `Err` with the receive queued if it does not yet.
    fn qp_or_queue(
        &mut self,
        recv: Option<&RecvWr>,
    ) -> Result<Option<*mut rs::ibv_qp>, VerbsError> {
        if !self.qp.is_null() {
            return Ok(Some(self.qp));
        }
        let mut st = self.sh.st.lock();
        let Some(Slot::Ep(ep)) = st.ids.get_mut(&(self.id as usize)) else {
            return Err(VerbsError::NotConnected);
        };
        if !ep.qp.is_null() {
            self.qp = ep.qp;
            return Ok(Some(self.qp));
        }
        match recv {
            Some(wr) if ep.failure.is_none() => {
                if ep.pending_recvs.len() >= self.caps.max_recv_wr as usize {
                    return Err(VerbsError::QueueFull("receive queue"));
                }
                ep.pending_recvs.push(*wr);
                Ok(None)
            }
            _ => Err(VerbsError::NotConnected),
        }
    }
}

impl Endpoint for RdmaEndpoint {
    fn post_recv(&mut self, wr: &RecvWr) -> Result<(), VerbsError> {
        match self.qp_or_queue(Some(wr))? {
            Some(qp) => post_recv(qp, wr),
            None => Ok(()),
        }
    }

    fn post_send(&mut self, wr: &SendWr) -> Result<(), VerbsError> {
        self.post_sends(std::slice::from_ref(wr))
    }

    fn post_sends(&mut self, wrs: &[SendWr]) -> Result<(), VerbsError> {
        const CHAIN: usize = 16;
        let Some(qp) = self.qp_or_queue(None)? else {
            return Err(VerbsError::NotConnected);
        };
        if !self.sh.gather && wrs.iter().any(|w| w.payload.is_some()) {
            return Err(VerbsError::Invalid("the device gathers one SGE per send"));
        }
        for part in wrs.chunks(CHAIN) {
            let zero = rs::ibv_sge {
                addr: 0,
                length: 0,
                lkey: 0,
            };
            let mut sges = [[zero; 2]; CHAIN];
            // SAFETY: ibv_send_wr is plain old data (integers, pointers, unions of them); zero
            // is a valid value for every field.
            let mut swrs: [rs::ibv_send_wr; CHAIN] = unsafe { std::mem::zeroed() };
            for (i, wr) in part.iter().enumerate() {
                fill_send_wr(&mut swrs[i], &mut sges[i], wr);
            }
            // Link the list only now: the array does not move while the provider reads it.
            let base = swrs.as_mut_ptr();
            for i in 0..part.len() {
                let sw = &mut swrs[i];
                if sw.num_sge > 0 {
                    sw.sg_list = sges[i].as_mut_ptr();
                }
                sw.next = if i + 1 < part.len() {
                    // SAFETY: i + 1 < part.len() <= CHAIN, so the pointer stays in the array.
                    unsafe { base.add(i + 1) }
                } else {
                    ptr::null_mut()
                };
            }
            let mut bad = ptr::null_mut();
            // SAFETY: qp is live; swrs[..part.len()] form a null-terminated list whose
            // sg_list pointers point into `sges`; both arrays live across the call (the
            // provider copies them).
            let rc = unsafe { rs::ibv_post_send(qp, base, &mut bad) };
            if rc != 0 {
                return Err(map::errno_error(rc, "send queue"));
            }
        }
        Ok(())
    }

    fn poll_cq(&mut self, out: &mut [Completion]) -> usize {
        const BATCH: usize = 32;
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(BATCH);
            let mut wcs: [std::mem::MaybeUninit<rs::ibv_wc>; BATCH] =
                [const { std::mem::MaybeUninit::uninit() }; BATCH];
            // SAFETY: cq is live; wcs has room for `want` entries, of which the provider
            // initializes the first n it returns.
            let n = unsafe { rs::ibv_poll_cq(self.cq, want as i32, wcs.as_mut_ptr().cast()) };
            if n <= 0 {
                break;
            }
            for w in &wcs[..n as usize] {
                // SAFETY: initialized by ibv_poll_cq.
                let w = unsafe { w.assume_init_ref() };
                out[done] = Completion {
                    wr_id: w.wr_id,
                    status: map::wc_status(w.status),
                    opcode: map::wc_opcode(w.opcode, WcOpcode::Send),
                    byte_len: w.byte_len,
                };
                done += 1;
            }
            if (n as usize) < want {
                break;
            }
        }
        done
    }

    fn poll_cm(&mut self) -> Option<CmEvent> {
        let mut st = self.sh.st.lock();
        self.sh.pump_cm(&mut st);
        match st.ids.get_mut(&(self.id as usize)) {
            Some(Slot::Ep(ep)) => ep.events.pop_front(),
            _ => None,
        }
    }

    fn accept(&mut self, private_data: &[u8]) -> Result<(), VerbsError> {
        if private_data.len() > MAX_ACCEPT_PRIVATE_DATA {
            return Err(VerbsError::Invalid("accept private data over 196 bytes"));
        }
        let mut param = self.sh.conn_param(private_data, true);
        // SAFETY: id is a live request id with a QP; param points to private_data for the
        // call (librdmacm copies it).
        if unsafe { rs::rdma_accept(self.id, &mut param) } != 0 {
            return Err(map::errno_error(errno(), "rdma_accept"));
        }
        Ok(())
    }

    fn reject(&mut self, private_data: &[u8]) -> Result<(), VerbsError> {
        if private_data.len() > MAX_REJECT_PRIVATE_DATA {
            return Err(VerbsError::Invalid("reject private data over 148 bytes"));
        }
        // SAFETY: id is live; the private data is valid for the call.
        if unsafe {
            rs::rdma_reject(
                self.id,
                private_data.as_ptr() as *const libc::c_void,
                private_data.len() as u8,
            )
        } != 0
        {
            return Err(map::errno_error(errno(), "rdma_reject"));
        }
        Ok(())
    }

    fn disconnect(&mut self) -> Result<(), VerbsError> {
        // SAFETY: id is live.
        if unsafe { rs::rdma_disconnect(self.id) } != 0 {
            return Err(match errno() {
                libc::EINVAL | libc::ENOTCONN => VerbsError::NotConnected,
                e => map::errno_error(e, "rdma_disconnect"),
            });
        }
        Ok(())
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
        st.ids.remove(&(self.id as usize));
        st.cqs.remove(&(self.cq as usize));
        // SAFETY: id, its QP (if any) and cq are owned by this endpoint; destroyed with `st`
        // held (no `arm` can touch the CQ), QP before CQ, then the id. Every CM event of the
        // id was acknowledged when read, so rdma_destroy_id does not wait.
        unsafe {
            if !(*self.id).qp.is_null() {
                rs::rdma_destroy_qp(self.id);
            }
            rs::ibv_destroy_cq(self.cq);
            rs::rdma_destroy_id(self.id);
        }
    }
}

/// A listening CM id.
pub struct RdmaListener {
    sh: Hold,
    id: *mut rs::rdma_cm_id,
    local: SocketAddr,
}

// SAFETY: the id is owned by the listener; shared bookkeeping is behind the provider's mutex.
unsafe impl Send for RdmaListener {}

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
        match self.sh.st.lock().ids.get(&(self.id as usize)) {
            Some(Slot::Listener(l)) => l.wrong_device,
            _ => 0,
        }
    }

    /// Whether the device went away (DEVICE_REMOVAL): no request will come any more.
    pub fn device_removed(&self) -> bool {
        match self.sh.st.lock().ids.get(&(self.id as usize)) {
            Some(Slot::Listener(l)) => l.removed,
            _ => true,
        }
    }
}

impl Listener for RdmaListener {
    type Endpoint = RdmaEndpoint;

    fn poll_request(&mut self) -> Option<(RdmaEndpoint, Vec<u8>)> {
        let mut st = self.sh.st.lock();
        self.sh.pump_cm(&mut st);
        let Some(Slot::Listener(l)) = st.ids.get_mut(&(self.id as usize)) else {
            return None;
        };
        let caps = l.caps;
        let r = l.requests.pop_front()?;
        Some((
            RdmaEndpoint {
                sh: Hold::new(&self.sh.0),
                id: r.id,
                cq: r.cq,
                qp: r.qp,
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
        if let Some(Slot::Listener(l)) = st.ids.remove(&(self.id as usize)) {
            for r in l.requests {
                st.ids.remove(&(r.id as usize));
                st.cqs.remove(&(r.cq as usize));
                // SAFETY: the request's id, QP and CQ were never handed out; rejected and
                // destroyed here in order (QP, CQ, id) with `st` held.
                unsafe {
                    rs::rdma_reject(r.id, ptr::null(), 0);
                    rs::rdma_destroy_qp(r.id);
                    rs::ibv_destroy_cq(r.cq);
                    rs::rdma_destroy_id(r.id);
                }
            }
        }
        // SAFETY: the listening id is live and owned by self; its events were acknowledged.
        unsafe { rs::rdma_destroy_id(self.id) };
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
        let addr = p.as_ptr() as usize;
        assert_eq!(addr % PAGE, 0);
        for at in [addr, addr + size - 1] {
            let f = vm_flags(at);
            assert!(f.split_whitespace().any(|w| w == "dc"), "{at:#x}: {f}");
        }
        // SAFETY: inside the mapping just made.
        let bytes = unsafe { std::slice::from_raw_parts(p.as_ptr(), size) };
        assert!(bytes.iter().all(|&b| b == 0));
        let heap = Box::new([7u8; 64]);
        let f = vm_flags(heap.as_ptr() as usize);
        assert!(!f.split_whitespace().any(|w| w == "dc"), "heap: {f}");
        // SAFETY: from alloc_pages, unused.
        unsafe { free_pages(p, size) };
    }
}
