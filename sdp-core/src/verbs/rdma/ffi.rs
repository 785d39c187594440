//! Owning wrappers of the librdmacm and libibverbs objects the provider uses: every call into
//! those libraries is made here, so that the provider (`mod.rs`) is safe code over them, but
//! for registering memory ([`Mr::register`], whose memory must outlive the registration).
//!
//! Ownership encodes the order in which the libraries want things destroyed: a [`CmId`] holds
//! its [`EventChannel`]; a [`Device`] is the CM id that opened the device context (it holds
//! librdmacm's reference on it), and a [`Pd`] or [`CompChannel`] holds its device; a [`Cq`]
//! holds its completion channel. A CM id's QP ([`Qp`]) is the id's, destroyed with it (or
//! before, by [`CmId::destroy_qp`]).

use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use rdma_sys as rs;

use super::map;
use crate::sys;
use crate::verbs::{RecvWr, SendOp, SendWr, VerbsError};

/// The thread's errno after a failed librdmacm/libibverbs call.
pub(super) fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> Result<(), VerbsError> {
    crate::sys::set_nonblocking(fd)
        .map_err(|e| map::errno_error(e.raw_os_error().unwrap_or(libc::EIO), "fcntl O_NONBLOCK"))
}

/// A nonblocking `rdma_event_channel`, destroyed on drop (after every id made on it, which
/// hold it).
pub(super) struct EventChannel(NonNull<rs::rdma_event_channel>);

// SAFETY: librdmacm locks internally; the channel may be used from any thread.
unsafe impl Send for EventChannel {}
// SAFETY: as above.
unsafe impl Sync for EventChannel {}

/// One CM event, copied out of librdmacm's and acknowledged.
pub(super) struct Event {
    pub kind: u32,
    pub status: i32,
    /// The id it belongs to, as a key ([`CmId::key`]).
    pub id: usize,
    /// The listening id, for a connect request.
    pub listen_id: usize,
    pub private_data: Vec<u8>,
    /// For a connect request: the new id, ours from now on.
    pub new_id: Option<CmId>,
}

impl EventChannel {
    pub fn new() -> Result<Arc<EventChannel>, VerbsError> {
        // Before the first verbs call of the process: libibverbs then keeps its own queue
        // memory and registered ranges out of forked children on kernels without copy-on-fork
        // for pinned pages (since rdma-core 35 a no-op where the kernel handles fork). An
        // application that used verbs before us gets EINVAL: ignored, our regions are
        // DONTFORK anyway.
        static FORK_INIT: std::sync::Once = std::sync::Once::new();
        // SAFETY: no arguments.
        FORK_INIT.call_once(|| unsafe {
            rs::ibv_fork_init();
        });
        // SAFETY: no arguments; NULL on failure.
        let ch = unsafe { rs::rdma_create_event_channel() };
        let Some(ch) = NonNull::new(ch) else {
            return Err(VerbsError::NoDevice(format!(
                "rdma_create_event_channel: {} (is rdma_ucm loaded?)",
                std::io::Error::from_raw_os_error(errno())
            )));
        };
        let ch = EventChannel(ch);
        set_nonblocking(ch.as_fd())?;
        Ok(Arc::new(ch))
    }

    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is live while self is.
        unsafe { (*self.0.as_ptr()).fd }
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel's fd stays open until the channel is destroyed, with self.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }

    /// A new CM id in `RDMA_PS_TCP` on this channel.
    pub fn create_id(self: &Arc<Self>) -> Result<CmId, VerbsError> {
        let mut id = ptr::null_mut();
        // SAFETY: the channel is live; id receives the new CM id.
        if unsafe {
            rs::rdma_create_id(
                self.0.as_ptr(),
                &mut id,
                ptr::null_mut(),
                rs::rdma_port_space::RDMA_PS_TCP,
            )
        } != 0
        {
            return Err(map::errno_error(errno(), "rdma_create_id"));
        }
        let id = NonNull::new(id).ok_or(VerbsError::Invalid("rdma_create_id"))?;
        Ok(CmId::own(id, self.clone()))
    }

    /// The next pending CM event, copied (private data included) and acknowledged; `None`
    /// when nothing is pending (the channel is nonblocking).
    pub fn get_event(self: &Arc<Self>) -> Option<Event> {
        let mut ev: *mut rs::rdma_cm_event = ptr::null_mut();
        // SAFETY: the channel is live; its fd is nonblocking, so this returns at once
        // (-1/EAGAIN) when nothing is pending.
        if unsafe { rs::rdma_get_cm_event(self.0.as_ptr(), &mut ev) } != 0 {
            return None;
        }
        // SAFETY: ev is valid until rdma_ack_cm_event; the private data pointer (if any)
        // points to private_data_len bytes owned by the event, copied before the ack.
        let (kind, status, id, listen_id, private_data) = unsafe {
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
        // A connect request's id is a new id of this channel that the application owns (it
        // must accept or reject and destroy it).
        let new_id = match NonNull::new(id) {
            Some(id) if kind == map::EV_CONNECT_REQUEST => Some(CmId::own(id, self.clone())),
            _ => None,
        };
        Some(Event {
            kind,
            status,
            id: id as usize,
            listen_id: listen_id as usize,
            private_data,
            new_id,
        })
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id made on the channel holds it, so none is left; destroyed once.
        unsafe { rs::rdma_destroy_event_channel(self.0.as_ptr()) };
    }
}

/// A CM id (`rdma_cm_id`), with the QP made on it if any; destroyed on drop (QP first).
pub(super) struct CmId {
    ptr: NonNull<rs::rdma_cm_id>,
    qp: OnceLock<Qp>,
    /// Serializes `rdma_create_qp` on the id.
    qp_lock: Mutex<()>,
    _channel: Arc<EventChannel>,
}

// SAFETY: librdmacm locks internally and the id may be used from any thread; the QP is set
// once under `qp_lock` and read through the OnceLock.
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}

/// The parameters of `rdma_connect` / `rdma_accept` but the private data.
pub(super) struct ConnParam {
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
}

/// `Err(errno)` unless `rc` is 0.
fn rc_errno(rc: i32) -> Result<(), i32> {
    if rc != 0 {
        Err(errno())
    } else {
        Ok(())
    }
}

impl CmId {
    fn own(ptr: NonNull<rs::rdma_cm_id>, channel: Arc<EventChannel>) -> CmId {
        CmId {
            ptr,
            qp: OnceLock::new(),
            qp_lock: Mutex::new(()),
            _channel: channel,
        }
    }

    fn raw(&self) -> *mut rs::rdma_cm_id {
        self.ptr.as_ptr()
    }

    /// The id's address, the key CM events name it by ([`Event::id`]).
    pub fn key(&self) -> usize {
        self.raw() as usize
    }

    /// The device context the id is bound to (null if none), to compare with a device's.
    pub fn verbs(&self) -> *mut rs::ibv_context {
        // SAFETY: the id is live while self is.
        unsafe { (*self.raw()).verbs }
    }

    /// The address in the id's route (`src`: local side; else the peer's).
    pub fn addr(&self, src: bool) -> Option<SocketAddr> {
        // SAFETY: the id is live; the address unions are plain old data of the size of a
        // sockaddr_storage.
        unsafe {
            let a = &(*self.raw()).route.addr;
            sys::sockaddr_to(if src {
                &a.src_addr_union.src_storage
            } else {
                &a.dst_addr_union.dst_storage
            })
        }
    }

    /// `rdma_bind_addr`; `Err(errno)`.
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<(), i32> {
        let (mut ss, _) = sys::sockaddr_of(addr);
        // SAFETY: the id is live; ss is a valid socket address of its family.
        rc_errno(unsafe {
            rs::rdma_bind_addr(self.raw(), &mut ss as *mut _ as *mut libc::sockaddr)
        })
    }

    /// `rdma_resolve_addr` from the bound address (src NULL); `Err(errno)`.
    pub fn resolve_addr(&self, dst: SocketAddr, timeout_ms: i32) -> Result<(), i32> {
        let (mut ss, _) = sys::sockaddr_of(dst);
        // SAFETY: the id is live; ss is a valid socket address.
        rc_errno(unsafe {
            rs::rdma_resolve_addr(
                self.raw(),
                ptr::null_mut(),
                &mut ss as *mut _ as *mut libc::sockaddr,
                timeout_ms,
            )
        })
    }

    /// `rdma_resolve_route` (starts the resolution); `Err(errno)`.
    pub fn resolve_route(&self, timeout_ms: i32) -> Result<(), i32> {
        // SAFETY: the id is live.
        rc_errno(unsafe { rs::rdma_resolve_route(self.raw(), timeout_ms) })
    }

    /// `rdma_listen`; `Err(errno)`.
    pub fn listen(&self, backlog: i32) -> Result<(), i32> {
        // SAFETY: the id is live.
        rc_errno(unsafe { rs::rdma_listen(self.raw(), backlog) })
    }

    /// Create the id's RC QP on `pd`, with `cq` for sends and receives (`rdma_create_qp`);
    /// `Err(errno)`, EINVAL if it has one already.
    pub fn create_qp(&self, pd: &Pd, cq: &Cq, cap: rs::ibv_qp_cap) -> Result<&Qp, i32> {
        let _g = self.qp_lock.lock();
        if self.qp.get().is_some() {
            return Err(libc::EINVAL);
        }
        // SAFETY: ibv_qp_init_attr is plain old data (pointers and integers); zero is valid.
        let mut attr: rs::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq.ptr.as_ptr();
        attr.recv_cq = cq.ptr.as_ptr();
        attr.qp_type = rs::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        attr.cap = cap;
        // SAFETY: the id, pd and cq are live; librdmacm stores the QP in the id.
        rc_errno(unsafe { rs::rdma_create_qp(self.raw(), pd.ptr.as_ptr(), &mut attr) })?;
        // SAFETY: rdma_create_qp succeeded, so the id holds its QP.
        let qp = NonNull::new(unsafe { (*self.raw()).qp }).ok_or(libc::EINVAL)?;
        // (The provider wrote back what it gave, at least what was asked.)
        let max_inline = attr.cap.max_inline_data;
        Ok(self.qp.get_or_init(|| Qp(qp, max_inline)))
    }

    /// The QP, once [`CmId::create_qp`] made it.
    pub fn qp(&self) -> Option<&Qp> {
        self.qp.get()
    }

    /// Destroy the QP now, if there is one.
    pub fn destroy_qp(&mut self) {
        if self.qp.take().is_some() {
            // SAFETY: the id's QP, destroyed once; `&mut self` means no `&Qp` is left.
            unsafe { rs::rdma_destroy_qp(self.raw()) };
        }
    }

    fn param(p: &ConnParam, private_data: &[u8]) -> rs::rdma_conn_param {
        rs::rdma_conn_param {
            private_data: private_data.as_ptr() as *const libc::c_void,
            private_data_len: private_data.len() as u8,
            responder_resources: p.responder_resources,
            initiator_depth: p.initiator_depth,
            flow_control: p.flow_control,
            retry_count: p.retry_count,
            rnr_retry_count: p.rnr_retry_count,
            srq: 0,
            qp_num: 0,
        }
    }

    /// `rdma_connect`; `Err(errno)`.
    pub fn connect(&self, p: &ConnParam, private_data: &[u8]) -> Result<(), i32> {
        let mut param = CmId::param(p, private_data);
        // SAFETY: the id is live; param points to private_data, which outlives the call
        // (librdmacm copies it).
        rc_errno(unsafe { rs::rdma_connect(self.raw(), &mut param) })
    }

    /// `rdma_accept`; `Err(errno)`.
    pub fn accept(&self, p: &ConnParam, private_data: &[u8]) -> Result<(), i32> {
        let mut param = CmId::param(p, private_data);
        // SAFETY: the id is live; param points to private_data for the call (librdmacm
        // copies it).
        rc_errno(unsafe { rs::rdma_accept(self.raw(), &mut param) })
    }

    /// `rdma_reject` with `private_data` (its length as given, cut to a u8); `Err(errno)`.
    pub fn reject(&self, private_data: &[u8]) -> Result<(), i32> {
        let data = if private_data.is_empty() {
            ptr::null()
        } else {
            private_data.as_ptr() as *const libc::c_void
        };
        // SAFETY: the id is live; the private data is valid for the call.
        rc_errno(unsafe { rs::rdma_reject(self.raw(), data, private_data.len() as u8) })
    }

    /// `rdma_disconnect`; `Err(errno)`.
    pub fn disconnect(&self) -> Result<(), i32> {
        // SAFETY: the id is live.
        rc_errno(unsafe { rs::rdma_disconnect(self.raw()) })
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        self.destroy_qp();
        // SAFETY: the id is ours and destroyed once; every CM event of it was acknowledged
        // when read (EventChannel::get_event), so rdma_destroy_id does not wait.
        unsafe { rs::rdma_destroy_id(self.raw()) };
    }
}

/// A QP, owned by the [`CmId`] it was made on.
pub(super) struct Qp(NonNull<rs::ibv_qp>, u32);

// SAFETY: libibverbs' post calls lock the QP; it may be used from any thread.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    /// Post one receive; `Err(rc)`.
    pub fn post_recv(&self, wr: &RecvWr) -> Result<(), i32> {
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
        // SAFETY: the QP is live; rwr and sge are valid for the call (the provider copies
        // them).
        let rc = unsafe { rs::ibv_post_recv(self.0.as_ptr(), &mut rwr, &mut bad) };
        if rc != 0 {
            return Err(rc);
        }
        Ok(())
    }

    /// The largest inline SEND (`IBV_SEND_INLINE`, all its elements together) the QP takes.
    pub fn max_inline(&self) -> u32 {
        self.1
    }

    /// Post one SEND whose payload is `payload`, copied by the provider during the call
    /// (`IBV_SEND_INLINE`); the caller checked it fits [`Qp::max_inline`].
    pub fn post_send_inline(&self, wr: &SendWr, payload: &[u8]) -> Result<(), i32> {
        let zero = rs::ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        let mut sges = [zero; 2];
        // SAFETY: ibv_send_wr is plain old data; zero is a valid value for every field.
        let mut swr: rs::ibv_send_wr = unsafe { std::mem::zeroed() };
        fill_send_wr(&mut swr, &mut sges, wr);
        if swr.num_sge != 2 {
            return Err(libc::EINVAL);
        }
        sges[1] = rs::ibv_sge {
            addr: payload.as_ptr() as u64,
            length: payload.len() as u32,
            lkey: 0,
        };
        swr.sg_list = sges.as_mut_ptr();
        swr.send_flags |= rs::ibv_send_flags::IBV_SEND_INLINE.0;
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is live; swr and its sg_list (`sges`, pointing at the caller's live
        // bytes) are valid for the call, during which the provider copies the inline data.
        let rc = unsafe { rs::ibv_post_send(self.0.as_ptr(), &mut swr, &mut bad) };
        if rc != 0 {
            return Err(rc);
        }
        Ok(())
    }

    /// Post `wrs` as linked lists of up to 16; `Err(rc)` of the first list refused.
    pub fn post_sends(&self, wrs: &[SendWr]) -> Result<(), i32> {
        const CHAIN: usize = 16;
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
            // SAFETY: the QP is live; swrs[..part.len()] form a null-terminated list whose
            // sg_list pointers point into `sges`; both arrays live across the call (the
            // provider copies them).
            let rc = unsafe { rs::ibv_post_send(self.0.as_ptr(), base, &mut bad) };
            if rc != 0 {
                return Err(rc);
            }
        }
        Ok(())
    }
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

/// A device context, opened by the CM id bound to it (which holds librdmacm's reference on
/// the device, and is destroyed with this).
pub(super) struct Device {
    ctx: NonNull<rs::ibv_context>,
    /// Destroyed with the device: it holds librdmacm's reference on the context.
    _anchor: CmId,
}

// SAFETY: libibverbs contexts may be used from any thread.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

/// What [`Device::query`] reports.
pub(super) struct DeviceInfo {
    pub name: String,
    pub iwarp: bool,
    pub attr: rs::ibv_device_attr,
}

impl Device {
    /// The device `anchor` is bound to; `Err(anchor)` if it is bound to none.
    pub fn open(anchor: CmId) -> Result<Arc<Device>, CmId> {
        match NonNull::new(anchor.verbs()) {
            Some(ctx) => Ok(Arc::new(Device {
                ctx,
                _anchor: anchor,
            })),
            None => Err(anchor),
        }
    }

    /// The context, to compare with an id's [`CmId::verbs`].
    pub fn ctx(&self) -> *mut rs::ibv_context {
        self.ctx.as_ptr()
    }

    /// The device's name, transport and attributes (`ibv_query_device`); `Err(errno)`.
    pub fn query(&self) -> Result<DeviceInfo, i32> {
        // SAFETY: the context is live while the anchor is; its device is a live
        // ibv_device with a NUL-terminated name; ibv_device_attr is plain old data.
        unsafe {
            let dev = (*self.ctx.as_ptr()).device;
            let name = CStr::from_ptr((*dev).name.as_ptr())
                .to_string_lossy()
                .into_owned();
            let iwarp = (*dev).transport_type == rs::ibv_transport_type::IBV_TRANSPORT_IWARP;
            let mut attr: rs::ibv_device_attr = std::mem::zeroed();
            if rs::ibv_query_device(self.ctx.as_ptr(), &mut attr) != 0 {
                return Err(errno());
            }
            Ok(DeviceInfo { name, iwarp, attr })
        }
    }
}

/// A protection domain, deallocated on drop.
pub(super) struct Pd {
    ptr: NonNull<rs::ibv_pd>,
    /// Kept alive while this lives.
    _dev: Arc<Device>,
}

// SAFETY: libibverbs objects may be used from any thread.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    /// `ibv_alloc_pd`; `Err(errno)`.
    pub fn alloc(dev: &Arc<Device>) -> Result<Pd, i32> {
        // SAFETY: the context is live while dev is.
        let pd = unsafe { rs::ibv_alloc_pd(dev.ctx.as_ptr()) };
        NonNull::new(pd)
            .map(|ptr| Pd {
                ptr,
                _dev: dev.clone(),
            })
            .ok_or_else(errno)
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated in Pd::alloc, deallocated once; the regions and QPs on it (which
        // hold the provider that holds the PD) are gone.
        unsafe { rs::ibv_dealloc_pd(self.ptr.as_ptr()) };
    }
}

/// A nonblocking completion channel, destroyed on drop (after its CQs, which hold it).
pub(super) struct CompChannel {
    ptr: NonNull<rs::ibv_comp_channel>,
    /// Kept alive while this lives.
    _dev: Arc<Device>,
}

// SAFETY: libibverbs objects may be used from any thread.
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    /// `ibv_create_comp_channel`; `Err(errno)`.
    pub fn new(dev: &Arc<Device>) -> Result<Arc<CompChannel>, i32> {
        // SAFETY: the context is live while dev is.
        let c = unsafe { rs::ibv_create_comp_channel(dev.ctx.as_ptr()) };
        NonNull::new(c)
            .map(|ptr| {
                Arc::new(CompChannel {
                    ptr,
                    _dev: dev.clone(),
                })
            })
            .ok_or_else(errno)
    }

    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is live while self is.
        unsafe { (*self.ptr.as_ptr()).fd }
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel's fd stays open until the channel is destroyed, with self.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }

    /// Take every pending completion event, acknowledging each (`ibv_get_cq_event` +
    /// `ibv_ack_cq_events`); the channel must be nonblocking.
    pub fn drain(&self) {
        loop {
            let mut cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: the channel is live and nonblocking; returns -1 when no event is
            // pending. The CQ it names is live: a CQ holds its channel, and ibv_destroy_cq
            // waits until the events of the CQ that were read are acknowledged (the provider
            // also destroys CQs only with its lock held, which its callers of drain hold).
            if unsafe { rs::ibv_get_cq_event(self.ptr.as_ptr(), &mut cq, &mut ctx) } != 0 {
                break;
            }
            // SAFETY: one event of cq was received above.
            unsafe { rs::ibv_ack_cq_events(cq, 1) };
        }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: created in CompChannel::new, destroyed once; its CQs (which hold it) are
        // gone.
        unsafe { rs::ibv_destroy_comp_channel(self.ptr.as_ptr()) };
    }
}

/// A completion queue on a completion channel, destroyed on drop.
pub(super) struct Cq {
    ptr: NonNull<rs::ibv_cq>,
    /// Kept alive while this lives.
    _comp: Arc<CompChannel>,
}

// SAFETY: libibverbs objects may be used from any thread; polling locks the CQ.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// `ibv_create_cq` with `cqe` entries, reporting to `comp`; `Err(errno)`.
    pub fn new(dev: &Device, comp: &Arc<CompChannel>, cqe: i32) -> Result<Cq, i32> {
        // SAFETY: the context and the channel are live.
        let cq = unsafe {
            rs::ibv_create_cq(dev.ctx.as_ptr(), cqe, ptr::null_mut(), comp.ptr.as_ptr(), 0)
        };
        NonNull::new(cq)
            .map(|ptr| Cq {
                ptr,
                _comp: comp.clone(),
            })
            .ok_or_else(errno)
    }

    /// `ibv_req_notify_cq` (every completion): the return code.
    pub fn req_notify(&self) -> i32 {
        // SAFETY: the CQ is live while self is.
        unsafe { rs::ibv_req_notify_cq(self.ptr.as_ptr(), 0) }
    }

    /// Poll up to `wcs.len()` completions into `wcs`; the ones taken.
    pub fn poll<'a>(&self, wcs: &'a mut [MaybeUninit<rs::ibv_wc>]) -> &'a [rs::ibv_wc] {
        let want = wcs.len().min(i32::MAX as usize) as i32;
        // SAFETY: the CQ is live; wcs has room for `want` entries, of which the provider
        // initializes the first n it returns.
        let n = unsafe { rs::ibv_poll_cq(self.ptr.as_ptr(), want, wcs.as_mut_ptr().cast()) };
        if n <= 0 {
            return &[];
        }
        // SAFETY: the first n entries were initialized by ibv_poll_cq (n <= want).
        unsafe { std::slice::from_raw_parts(wcs.as_ptr().cast(), n as usize) }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created in Cq::new and destroyed once, after the QP that used it (the
        // provider destroys the QP first).
        unsafe { rs::ibv_destroy_cq(self.ptr.as_ptr()) };
    }
}

/// A memory registration, deregistered on drop (after which the HCA refuses its keys).
pub(super) struct Mr(NonNull<rs::ibv_mr>);

// SAFETY: libibverbs objects may be used from any thread.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Register `len` bytes at `addr` with `flags` on `pd` (`ibv_reg_mr`); `Err(errno)`.
    ///
    /// # Safety
    /// `addr..addr + len` must stay allocated until the result is dropped, and the result
    /// must be dropped before `pd`.
    pub unsafe fn register(pd: &Pd, addr: *mut u8, len: usize, flags: u32) -> Result<Mr, i32> {
        // SAFETY: pd is live; the memory outlives the registration per the caller.
        let mr = unsafe { rs::ibv_reg_mr(pd.ptr.as_ptr(), addr.cast(), len, flags as i32) };
        NonNull::new(mr).map(Mr).ok_or_else(errno)
    }

    /// (lkey, rkey).
    pub fn keys(&self) -> (u32, u32) {
        // SAFETY: the registration is live while self is.
        unsafe { ((*self.0.as_ptr()).lkey, (*self.0.as_ptr()).rkey) }
    }

    /// Change the access rights in place (`ibv_rereg_mr` with `IBV_REREG_MR_CHANGE_ACCESS`):
    /// the return code (0: done).
    pub fn rereg_access(&self, flags: u32) -> i32 {
        // SAFETY: the registration is live; with CHANGE_ACCESS only, pd/addr/length are
        // ignored.
        unsafe {
            rs::ibv_rereg_mr(
                self.0.as_ptr(),
                rs::ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0 as i32,
                ptr::null_mut(),
                ptr::null_mut(),
                0,
                flags as i32,
            )
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in Mr::register, deregistered once, here.
        unsafe { rs::ibv_dereg_mr(self.0.as_ptr()) };
    }
}

/// Have librdmacm look at the device list again (`rdma_get_devices`, freed at once): a
/// context it opened for a device that went away is closed then, once no id is on it, so the
/// kernel can finish removing the device. It opens every device still there, as any
/// `rdma_get_devices` caller does: devices.rs watches them from then on.
pub(super) fn resync_devices() {
    // SAFETY: no arguments; the list (possibly NULL) goes straight back to rdma_free_devices.
    unsafe {
        let list = rs::rdma_get_devices(std::ptr::null_mut());
        if !list.is_null() {
            rs::rdma_free_devices(list);
        }
    }
}
