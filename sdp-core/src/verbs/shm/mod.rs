//! The `shm` provider: RDMA RC semantics between processes (or threads) of one host, without
//! RDMA hardware. See `docs/providers.md` ("shm") for the design; in brief:
//!
//! * **Rendezvous.** A listener binds an abstract Unix seqpacket socket named after its address
//!   and port (`sdp-shm/0.0.0.0:5000`); a connector tries the exact address, then the wildcard
//!   listeners of the port. The socket stays open for the life of the connection: the CM
//!   messages (REQ, ACC, REJ, RTU, DISC) travel on it, and its hang-up tells a peer died.
//! * **Credentials.** `SO_PEERCRED` on both sides: only the same uid is served. The peer
//!   process is held by a pidfd (`SO_PEERPIDFD`), checked alive before every copy, so a copy
//!   never reaches a process that got a dead peer's pid. Fds are exchanged only after each side
//!   read the other's memory (REQ none, ACC the acceptor's, RTU the connector's).
//! * **Queues.** Each side owns an *inbox*, a sealed memfd shared with the peer through
//!   SCM_RIGHTS: a ring of receive slots (posted by the owner, filled by the peer) and the
//!   owner's state and wake flag. A SEND is executed by the sender: small payloads go inline in
//!   the slot, larger ones straight into the posted receive buffer with `process_vm_writev`.
//! * **RDMA Read/Write.** The initiator checks the peer's key table (a memfd sealed against
//!   writes, `F_SEAL_FUTURE_WRITE`: rkey → address, length, access, seqlock) and copies once
//!   with `process_vm_readv`/`process_vm_writev`. It announces the copy in the owner's inbox
//!   first (`OFF_INFLIGHT`), and a deregistration or revocation waits for it to end.
//! * **Notification.** [`Provider::notify_fd`] is an epoll fd holding the provider's eventfd,
//!   the connection sockets and the listeners. Each provider has a *bell page* every peer maps:
//!   a peer rings its connection's bell after each change it makes, and writes the eventfd only
//!   when it finds the page's wake flag set ([`Provider::arm`] sets it). A round of progress
//!   passes connections whose bell is silent by ([`Endpoint::quiet`]).

mod assist;

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::{
    check_grant, Access, CmEvent, Completion, Endpoint, Grant, Listener, MemoryRegion, Provider,
    QpCaps, RecvWr, RemoteBuf, SendOp, SendWr, Sge, VerbsError, WcOpcode, WcStatus, INLINE_LKEY,
};
use crate::sys::{self, Mapping, Proc, RawBuf, Recv};

/// `IBV_WC_REM_INV_REQ_ERR`: the SEND was longer than the receive buffer.
pub const WC_REM_INV_REQ_ERR: u32 = 9;
/// `IBV_WC_REM_OP_ERR`: the peer's receive buffer was unusable.
pub const WC_REM_OP_ERR: u32 = 11;

// Largest private data of a connect request, accept and reject (as the RDMA CM under
// `RDMA_PS_TCP`).
use super::{
    MAX_PRIVATE_DATA_ACCEPT as MAX_PD_ACCEPT, MAX_PRIVATE_DATA_CONNECT as MAX_PD_CONNECT,
    MAX_PRIVATE_DATA_REJECT as MAX_PD_REJECT,
};

// Inbox layout: a header page, then the receive slots. The header's words, one cache line
// each for those two sides write: 0 magic and slots, 64 head, 128 tail, 192 state, 320 copy in
// flight, 384 RNR, 448 direct switch, 512-584 the shared copy's descriptor (`assist`), 640
// direct done, 704 direct busy, 768 the inline ring's tail, 832 the inbox's own address, 896
// zero, 960 settled, 1024-2048 counts (test `an_inbox_header_has_no_overlapping_words`).
const HDR: usize = 4096;
const INBOX_MAGIC: u32 = 0x5344_5049;
const OFF_MAGIC: usize = 0;
const OFF_NSLOTS: usize = 4;
/// Receives posted (owner writes).
const OFF_HEAD: usize = 64;
/// Receives consumed (peer writes).
const OFF_TAIL: usize = 128;
/// Owner's state: 0 open, 1 closed.
const OFF_STATE: usize = 192;
// 256: unused (the wake flag, now in the bell page).
/// The peer's copies into or out of the owner's memory (written by the peer): odd while one
/// runs. The peer raises it before it checks the owner's key table (or receive slot) and
/// lowers it after its copy; the owner, after it invalidated a region, waits for an odd value
/// it saw to change (`Inner::drain_copies`), so no copy lands after a deregistration returns.
const OFF_INFLIGHT: usize = 320;
/// The rkey of the region that copy touches (0: a posted receive, for a SEND), written before
/// the odd value: an owner waits only for copies of the region it withdrew.
const OFF_INFLIGHT_KEY: usize = 324;
/// The peer has SENDs waiting for a posted receive (written by the peer, taken by the owner):
/// posting receives writes the peer's eventfd only then, not for every receive.
const OFF_RNR: usize = 384;
/// Direct wakeups (`Endpoint::give_direct_wake`): the owner's switch, 1 on (owner writes).
const OFF_DIRECT: usize = 448;
/// A direct wakeup byte of the peer's may be unread (the peer sets it when it writes one while
/// `OFF_DIRECT_LEVEL` is on; the owner clears it before it takes bytes out of the socket,
/// `Endpoint::direct_unread_clear`). On the switch's line: the peer reads all three at once.
const OFF_DIRECT_UNREAD: usize = 452;
/// The owner's reader needs no byte per SEND, only one while any is unread (owner writes:
/// `Endpoint::set_direct_level`): level-triggered readers, which a byte already there wakes.
const OFF_DIRECT_LEVEL: usize = 456;
/// Direct wakeups under way: the peer raises it before it looks at `OFF_DIRECT` and lowers it
/// once its byte is written, so an owner turning them off can wait until no byte can come.
const OFF_DIRECT_BUSY: usize = 704;
/// Each connection's socket is read on its own every this many `ShmConfig::liveness_interval`s
/// while it is polled (its news comes through the epoll set: this is in case the set missed
/// it). Every 100 ms before, which cost a server's progress thread a system call per idle
/// connection at every round.
const LIVENESS_BACKSTOP: u64 = 50;
/// Longest `set_direct_wake(false, settle)` waits for a live peer's byte in flight.
const DIRECT_SETTLE_MAX: Duration = Duration::from_millis(250);
/// Longest a read that leaves nothing to read waits for the peer's direct wakeups under way to
/// land before it takes the tokens back (`Endpoint::direct_settler`, without the stack's lock:
/// a peer descheduled longer mid-wakeup may leave one token that announces nothing).
const DIRECT_READ_SETTLE: Duration = Duration::from_millis(5);
/// The receives consumed whose wakeup is over (written by the peer after each slot's wakeup,
/// its direct byte written if it sent one): see `Endpoint::direct_settler`.
const OFF_DIRECT_DONE: usize = 640;
/// Bytes of the inbox's inline ring the owner has taken (owner writes; see [`RING_LEN`]).
const OFF_RING_TAIL: usize = 768;
/// The inbox's address in its owner's memory (owner writes once): where a peer's copy system
/// call writes the end of its announcement or its count of chunks done (`sys::CopyEnd`).
const OFF_SELF: usize = 832;
/// Always 0: what a peer's read system call copies into `OFF_INFLIGHT` to end its announcement.
const OFF_ZERO: usize = 896;
/// The owner's side is settled (`Endpoint::set_settled`; owner writes, the peer reads it when
/// the owner's process is gone): bit 63 set, with the receives it had taken (its `rq_done`) in
/// the low 32 bits; 0 while not settled. A peer that finds it set with its latest solicited
/// SEND among those taken ends the connection as TCP's FIN would, not as a reset
/// (`ShmEndpoint::peer_gone`).
const OFF_SETTLED: usize = 960;
const SETTLED_BIT: u64 = 1 << 63;
/// `COUNTS` words holding 0, 1, 2...: what a peer's read system call copies into the shared
/// copy's done count (`assist`).
const OFF_COUNTS: usize = 1024;
const COUNTS: usize = 256;
/// Longest a deregistration waits for a peer's copy in flight whose process is alive (a peer
/// stopped in the middle of its copy, SIGSTOP or a debugger; a dead one ends the wait at once).
const COPY_DRAIN_MAX: Duration = Duration::from_millis(250);
// The bell page: one per provider, a sealed memfd every peer maps writable. A peer rings the
// bell of the connection it changed (SEND, receives posted, close, a copy to help with) and then,
// if the owner armed, writes its eventfd: a round of progress passes every connection whose bell
// is silent by with one load from this page, instead of a look at each connection's inbox (a
// page per connection; the cache and TLB misses of hundreds of them were most of a busy server's
// round). A peer can ring any bell of the page: that costs the owner a needless look, no more.
const BELLS_LEN: usize = 16384;
const BELLS_MAGIC: u32 = 0x5344_5043;
const B_MAGIC: usize = 0;
/// The owner wants an eventfd write at the next change of any of its connections (`arm`).
const B_WAKE: usize = 64;
/// RDMA Reads and Writes peers have under way on our memory: a peer adds one before it
/// announces such a copy in an inbox of ours (`InFlight::begin`) and takes it back after. A
/// deregistration that finds it 0 (after its invalidation) has no copy to wait for and does not
/// look at every connection's inbox (`Inner::drain_copies`).
const B_COPIES: usize = 96;
const B_BASE: usize = 128;
/// Bells on the page (4 bytes each); an endpoint whose token is beyond has none and is looked
/// at in every round.
const NBELLS: usize = (BELLS_LEN - B_BASE) / 4;
/// "No bell" in the handshake.
const NO_BELL: u16 = u16::MAX;
const _: () = assert!(NBELLS < NO_BELL as usize);

fn bell_off(token: usize) -> Option<usize> {
    (token < NBELLS).then_some(B_BASE + 4 * token)
}

const SLOT: usize = 512;
const S_ADDR: usize = 0;
const S_LEN: usize = 8;
/// 1: the owner posted a receive that is not valid local memory.
const S_BAD: usize = 12;
const S_RESULT: usize = 16;
const S_STATUS: usize = 20;
/// Where in the inline ring a SEND's bytes are (`ST_RING`), and the ring bytes it takes
/// (its length rounded up, and the ring's end it skipped to start at 0).
const S_RING_OFF: usize = 24;
const S_RING_USED: usize = 28;
const S_INLINE: usize = 64;
/// Largest SEND carried inline in the slot.
pub const INLINE_MAX: usize = SLOT - S_INLINE;
/// The inline ring, after the slots: SENDs larger than a slot holds and up to [`RING_MSG_MAX`]
/// are copied into it by the sender and out of it by the owner when it takes the receive,
/// in slot order (two `memcpy`s cost less than a `process_vm_writev` up to tens of KiB: at
/// 1 KiB, ~0.1 us against ~1.7 us; at 16 KiB ~1 us against ~2.7 us). A sender that finds no room copies with
/// `process_vm_writev` as for larger SENDs, so the ring never holds a SEND back.
const RING_LEN: usize = 64 << 10;
/// Largest SEND the inline ring takes: a 16 KiB write with its header. (8 KiB in a 32 KiB ring
/// first; 16 KiB ping-pong beside a CPU-bound process went from 20-23 us at p50 to 15-19 us,
/// kernel TCP's 16-18, and streams of 16 KiB from 3.1-3.3 to 3.9-4.6 GB/s. A ring's pages
/// are only touched by connections that send such messages.)
pub const RING_MSG_MAX: usize = 17 << 10;
/// Largest inline payload a SEND takes ([`Endpoint::post_send_inline`]): larger than any
/// receive buffer SDP posts.
const INLINE_SEND_MAX: usize = 4 << 20;
/// Ring space is taken in units of this (a cache line).
const RING_ALIGN: usize = 64;
const MAX_SLOTS: u32 = 1 << 14;
const ST_OK: u32 = 1;
const ST_INLINE: u32 = 2;
const ST_LEN_ERR: u32 = 3;
const ST_REM_OP: u32 = 4;
const ST_RING: u32 = 5;

// Key table layout: a header page, then 32-byte entries indexed by the low 16 bits of a key.
const KT_HDR: usize = 4096;
const KT_ENTRY: usize = 32;
const KT_SLOTS: usize = 1 << 16;
const KT_LEN: usize = KT_HDR + KT_SLOTS * KT_ENTRY;
const E_SEQ: usize = 0;
const E_RKEY: usize = 4;
const E_ACCESS: usize = 8;
const E_ADDR: usize = 16;
const E_LEN: usize = 24;

// Handshake messages on the rendezvous socket.
const M_REQ: u8 = 1;
const M_ACC: u8 = 2;
const M_REJ: u8 = 3;
const M_RTU: u8 = 4;
/// How long an acceptor whose check of the connector failed at the RTU waits for it to have
/// exited (a connector that connects and exits at once is half gone when we look).
const RTU_EXIT_WAIT: std::time::Duration = std::time::Duration::from_millis(100);
const M_DISC: u8 = 5;
/// After the handshake: the sender's direct-wakeup socket (one fd; `give_direct_wake`).
const M_WAKE: u8 = 6;
/// Listener to connector: the request went, unanswered, to the processes sharing the listener
/// (after fork); the ACC comes from the one that accepts it (`HANDED_WAIT`).
const M_HND: u8 = 7;
/// A connection moving to another process (`ShmEndpoint::pause_peer`): the mover asks its peer
/// to start no copy into or out of its memory and to take no exit of its process as the end
/// (`M_SUSP`); the peer answers once none of its copies is under way (`M_SUSP_ACK`); the
/// process that goes on with the connection, a fork child of the mover, tells the peer its pid
/// (`M_MOVED`, with its credentials as the kernel gives them), and the peer resumes with it.
const M_SUSP: u8 = 8;
const M_SUSP_ACK: u8 = 9;
const M_MOVED: u8 = 10;

/// How long a connector whose request was handed on waits for a process to accept it before
/// it gives up as refused (so the application falls back to kernel TCP, where its connect
/// would have completed at once and waited in the backlog).
const HANDED_WAIT_MS: u64 = 1000;
/// 2: fds only after the sender probed the other side (REQ none, ACC the acceptor's, RTU the
/// connector's). 3: a fourth fd, the bell page, and the sender's bell.
/// 4: the inline ring after the slots (`RING_LEN`). 5: `OFF_DIRECT_DONE`, `M_HND`.
/// 6: `OFF_DIRECT_BUSY` and `OFF_RING_TAIL` moved off the shared copy's descriptor; copies end
/// their announcements by their own system call (`OFF_SELF`, `OFF_ZERO`, `OFF_COUNTS`).
/// 7: `M_SUSP`, `M_SUSP_ACK`, `M_MOVED` (a connection moving to another process).
const M_VERSION: u8 = 7;
const M_HDR: usize = 40;

/// A busy listener looks for new connections at least this often (epoll's hint brings them at
/// once to an idle one).
const LISTEN_CHECK: Duration = Duration::from_millis(1);

const TOKEN_EVFD: u64 = 0;
const TOKEN_TIMER: u64 = 1;
const TOKEN_BASE: u64 = 2;

/// Tunables of a [`ShmProvider`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmConfig {
    /// A SEND that finds no receive posted is retried this long, then fails with
    /// `RnrRetryExceeded`.
    pub rnr_timeout: Duration,
    /// The connections' sockets' news (a hang-up, a CM message) is collected from the epoll
    /// set at least this often while the provider is polled (besides before every sleep,
    /// [`Provider::arm`]); each socket is also read on its own every
    /// `LIVENESS_BACKSTOP` times this, should epoll not have it.
    pub liveness_interval: Duration,
    /// A peer that paused for a move (`M_SUSP`) takes the mover as gone (a reset) when the
    /// process that goes on has not said where it is (`M_MOVED`) within this.
    pub move_wait: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            rnr_timeout: Duration::from_secs(4),
            liveness_interval: Duration::from_millis(100),
            move_wait: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Reg {
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: u64,
    access: Access,
}

struct Regs {
    slots: Vec<Option<Reg>>,
    /// Per slot: the endpoint (its token + 1) that posted receives in the region, `POSTED_MANY`
    /// if several did, 0 if none: a deregistration marks receives bad, and waits for SENDs into
    /// them, in those endpoints' inboxes only.
    posted: Vec<AtomicU32>,
    gens: Vec<u16>,
    free: Vec<u32>,
    salt: u16,
}

/// [`Regs::posted`]: receives of the region were posted by more than one endpoint.
const POSTED_MANY: u32 = u32::MAX;

impl Regs {
    /// An endpoint (`token`) posts a receive in the region of `lkey`.
    fn note_posted(&self, lkey: u32, token: usize) {
        let Some(w) = self.posted.get((lkey & 0xffff) as usize) else {
            return;
        };
        let me = (token as u32).saturating_add(1).min(POSTED_MANY - 1);
        let cur = w.load(Ordering::Relaxed);
        if cur == me || cur == POSTED_MANY {
            return;
        }
        let _ = w.compare_exchange(0, me, Ordering::Relaxed, Ordering::Relaxed);
        if w.load(Ordering::Relaxed) != me {
            w.store(POSTED_MANY, Ordering::Relaxed);
        }
    }

    /// Whether our memory `addr..addr + len` lies in the registration `rkey` with `need`.
    fn check_remote(&self, rkey: u32, addr: u64, len: u64, need: Access) -> bool {
        let Some(Some(r)) = self.slots.get((rkey & 0xffff) as usize) else {
            return false;
        };
        r.rkey == rkey
            && r.access.contains(need)
            && addr >= r.addr
            && addr.checked_add(len).is_some_and(|e| e <= r.addr + r.len)
    }

    /// The registration covering `sge` with at least `need`, by lkey.
    fn check(&self, sge: &Sge, need: Access) -> bool {
        let idx = (sge.lkey & 0xffff) as usize;
        let Some(Some(r)) = self.slots.get(idx) else {
            return false;
        };
        r.lkey == sge.lkey
            && r.access.contains(need)
            && sge.addr >= r.addr
            && sge
                .addr
                .checked_add(u64::from(sge.len))
                .is_some_and(|e| e <= r.addr + r.len)
    }
}

/// What an endpoint or listener shares with the provider for [`Provider::arm`].
struct Ctl {
    /// Set when epoll reported activity on the owner's socket.
    hint: AtomicBool,
    /// The endpoint's inbox, whose wake flag `arm` sets.
    inbox: Option<Arc<Mapping>>,
    /// Its receive slots (our own count: the peer can write the inbox header).
    nslots: u32,
    /// The peer process, once known (its death ends waits for its copies); replaced when
    /// the connection moves to another process of the peer's (`M_MOVED`).
    peer: parking_lot::Mutex<Option<Arc<Proc>>>,
}

impl Ctl {
    fn peer(&self) -> Option<Arc<Proc>> {
        self.peer.lock().clone()
    }

    fn set_peer(&self, p: Arc<Proc>) {
        *self.peer.lock() = Some(p);
    }
}

/// How a wait for a peer's copy in flight ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyWait {
    /// The copy was done (the word moved on).
    Done,
    /// The peer process exited (none of its copies can still run).
    PeerGone,
    /// `COPY_DRAIN_MAX` passed with the peer alive and the copy still announced.
    TimedOut,
}

/// How a withdrawal of memory treats the peers' copies it finds in flight (`Inner::drain_copies`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drain {
    /// Wait for each up to `COPY_DRAIN_MAX` (the memory stays with its owner: a live region
    /// whose rights were reduced, under whatever lock the caller holds).
    Bounded,
    /// Wait until each ends or its peer exits, however long: the caller's own memory, let go
    /// outside any lock others need (a stopped peer holds only that call).
    Unbounded,
    /// Do not wait: return them, and the caller keeps the memory out of use until they end
    /// (`Inner::park`).
    Collect,
}

/// A peer's copy into or out of our memory, under way when we withdrew memory it may touch,
/// not yet seen to end: one it announced in an inbox of ours (`OFF_INFLIGHT` odd), or the
/// chunks it claimed of a shared RDMA Read of ours (it writes them into our buffer).
#[derive(Clone)]
struct Linger {
    inbox: Arc<Mapping>,
    until: Until,
    /// The region it touches: the rkey (`OFF_INFLIGHT_KEY`; 0: a posted receive).
    key: u32,
    peer: Option<Arc<Proc>>,
}

#[derive(Debug, Clone, Copy)]
enum Until {
    /// `OFF_INFLIGHT` no longer holds this (odd) value.
    Moves(u32),
    /// The shared copy of generation `gen` (the high half of `assist::A_CLAIM`) has the
    /// helper's chunks done (`assist::A_DONE`) reach `n`; a later generation means it ended
    /// (an endpoint starts its next shared copy only once the one before completed).
    Counts { gen: u32, n: u32 },
}

impl Linger {
    fn ended(&self, x: u32) -> bool {
        match self.until {
            Until::Moves(v) => x != v,
            Until::Counts { gen, n } => {
                let claim = self.inbox.u64(assist::A_CLAIM).load(Ordering::Acquire);
                x >= n || (claim >> 32) as u32 != gen
            }
        }
    }

    fn word(&self) -> &AtomicU32 {
        self.inbox.u32(match self.until {
            Until::Moves(_) => OFF_INFLIGHT,
            Until::Counts { .. } => assist::A_DONE,
        })
    }

    /// The copy ended or its process exited.
    fn over(&self) -> bool {
        self.ended(self.word().load(Ordering::Acquire))
            || self.peer.as_ref().is_some_and(|p| !p.alive())
    }

    /// After `over`: a peer that died in the middle of an RDMA copy never took back the count
    /// it raised in our bell page (`B_COPIES`, `InFlight::begin`); take it back for it, or
    /// every later deregistration would look at every inbox. Called once per connection's
    /// announcement (the note its teardown made), never for the copies parked memory waits on.
    fn settle(&self, bells: &Mapping) {
        if let Until::Moves(v) = self.until {
            if self.key != 0 && self.inbox.u32(OFF_INFLIGHT).load(Ordering::Acquire) == v {
                let _ = bells
                    .u32(B_COPIES)
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |x| x.checked_sub(1));
            }
        }
    }

    /// Wait up to `max` for the copy to end (without a peer to watch, at most
    /// `COPY_DRAIN_MAX`: none is known before a connection's handshake, when none copies).
    fn wait(&self, max: Duration) -> CopyWait {
        let max = if self.peer.is_none() {
            max.min(COPY_DRAIN_MAX)
        } else {
            max
        };
        wait_word(self.word(), |x| self.ended(x), self.peer.as_deref(), max)
    }
}

/// Wait until the in-flight word `w` no longer holds `v` (the copy announced by `v` is done),
/// the peer exits, or `max` passes. Spins briefly, then yields and sleeps.
#[cfg(test)]
fn wait_copy(w: &AtomicU32, v: u32, peer: Option<&Proc>, max: Duration) -> CopyWait {
    wait_word(w, |x| x != v, peer, max)
}

/// How long [`wait_word`] only spins before it yields the CPU between its looks: what it
/// waits for is mostly a peer in the middle of a system call (a read waiting for the peer's
/// wakeup byte, `direct_settler`): on another CPU it is done within a few microseconds, but
/// a peer that our own wakeup preempted on our CPU runs only once we yield (20 us of spinning
/// first looked slower in a rough A/B on a loaded host, 2026-11-29).
const WAIT_SPIN_ONLY: Duration = Duration::from_micros(3);

/// Wait until the peer-written word `w` satisfies `done`, the peer exits, or `max` passes.
fn wait_word(
    w: &AtomicU32,
    done: impl Fn(u32) -> bool,
    peer: Option<&Proc>,
    max: Duration,
) -> CopyWait {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if done(w.load(Ordering::Acquire)) {
            return CopyWait::Done;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            // A check up to `LIVENESS_TRUST` old will do (a dead peer only makes the wait go
            // on that much longer): a read that waits here for the peer's wakeup byte paid a
            // `poll` of the pidfd per request before (redis-server under the shim, 2026-11-29).
            if peer.is_some_and(|p| !p.alive_recently()) {
                return CopyWait::PeerGone;
            }
            let t = start.elapsed();
            if t > max {
                return CopyWait::TimedOut;
            }
            if t > Duration::from_micros(200) {
                std::thread::sleep(Duration::from_micros(50));
            } else if t > WAIT_SPIN_ONLY {
                std::thread::yield_now();
            }
        }
        std::hint::spin_loop();
    }
}

/// Our copy into or out of the peer's memory, announced in its inbox (`OFF_INFLIGHT`) from
/// before we check its key table (or receive slot) until the copy is done.
struct InFlight<'a> {
    word: &'a AtomicU32,
    seq: &'a mut u32,
    /// The peer's `B_COPIES`, for an RDMA copy (a region's key, not a posted receive).
    count: Option<&'a AtomicU32>,
}

impl<'a> InFlight<'a> {
    /// Announce a copy touching the peer's region `rkey` (0: one of its posted receives) in
    /// its inbox `ib`; an RDMA copy (`rkey` not 0) is counted in the peer's bell page `bells`
    /// first.
    fn begin(ib: &'a Mapping, bells: &'a Mapping, rkey: u32, seq: &'a mut u32) -> InFlight<'a> {
        let count = (rkey != 0).then(|| bells.u32(B_COPIES));
        if let Some(c) = count {
            c.fetch_add(1, Ordering::SeqCst);
        }
        let word = ib.u32(OFF_INFLIGHT);
        ib.u32(OFF_INFLIGHT_KEY).store(rkey, Ordering::Relaxed);
        *seq = seq.wrapping_add(1) | 1;
        word.store(*seq, Ordering::Release);
        // Our announcement before our reads of the peer's table: pairs with the owner's fence
        // between its invalidation and its read of the word (one of us sees the other).
        fence(Ordering::SeqCst);
        InFlight { word, seq, count }
    }

    /// Announce the next copy of the same region (the one before was ended by its system call,
    /// `sys::CopyEnd`): a new odd value, then the caller looks at the key table again.
    fn again(&mut self) {
        *self.seq = self.seq.wrapping_add(1) | 1;
        self.word.store(*self.seq, Ordering::Release);
        fence(Ordering::SeqCst);
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        *self.seq = self.seq.wrapping_add(1);
        self.word.store(*self.seq, Ordering::Release);
        if let Some(c) = self.count {
            c.fetch_sub(1, Ordering::Release);
        }
    }
}

struct Inner {
    cfg: ShmConfig,
    uid: u32,
    epoll: OwnedFd,
    evfd: OwnedFd,
    timer: OwnedFd,
    keys: Mapping,
    _keys_fd: OwnedFd,
    keys_ro: OwnedFd,
    /// Our bell page (`BELLS_LEN`) and the fd peers map it with.
    bells: Mapping,
    bells_fd: OwnedFd,
    regs: RwLock<Regs>,
    ctls: Mutex<slab::Slab<Weak<Ctl>>>,
    /// Tokens whose socket epoll reported in `arm` (their `Ctl::hint` set), for `take_news`.
    hinted: Mutex<Vec<usize>>,
    /// When the epoll set was last drained (`sys::coarse_ms`): `take_news` drains it once
    /// `cfg.liveness_interval` passed, for a progress thread too busy to sleep (`arm`).
    drained_ms: AtomicU64,
    /// One more than the highest token ever handed out (the slab reuses the lowest free ones):
    /// `take_news` looks at the bells below it.
    tokens_high: AtomicUsize,
    rnr_waiting: AtomicUsize,
    next_port: AtomicU32,
    refused_uid: AtomicU64,
    wakeups: Arc<AtomicU64>,
    direct_wakeups: Arc<AtomicU64>,
    /// Chunks of peers' RDMA Reads and Writes this provider copied for them (`assist`).
    assisted: AtomicU64,
    /// SENDs this provider put in peers' inline rings.
    ring_sends: AtomicU64,
    /// Peer processes (by pid) and peer providers (by their bell page's identity), shared by
    /// the connections to them.
    procs: Mutex<HashMap<i32, Weak<Proc>>>,
    providers: Mutex<HashMap<(u64, u64), Weak<PeerProvider>>>,
    /// Peer providers used lately, held a while after their last connection ended
    /// (`PEER_KEEP`): a run of connections to one process, one after another, maps its key
    /// table and bell page once, not once per connection (a map and an unmap each, the unmap's
    /// TLB shootdown included).
    recent_providers: Mutex<VecDeque<(Instant, Arc<PeerProvider>)>>,
    /// Inboxes `drain_copies` looked at (`ShmProvider::inboxes_drained`).
    drain_looks: AtomicU64,
    /// Direct wakeups turned off whose settle wait ran out (`ShmProvider::settles_timed_out`).
    settle_timeouts: AtomicU64,
    /// Waits for a peer's copy in flight that ran out (`ShmProvider::drains_timed_out`).
    drain_timeouts: AtomicU64,
    /// Copies peers had under way into or out of our memory when their connection was torn
    /// down (`ShmEndpoint::drain_own`), not yet seen to end: a region let go later waits for
    /// (or parks behind) those of its key and, if receives were posted in it, those of
    /// receives (the connection's inbox is no longer among `ctls`).
    lingering: Mutex<Vec<Linger>>,
    /// Memory of regions let go while a peer's copy that may touch it was under way: kept
    /// mapped (never reused, never unmapped) until every one of those copies ended, so a peer
    /// stopped in the middle of one (SIGSTOP, a debugger, preempted) for however long cannot
    /// land it in memory that serves something else. Looked at by `reap`.
    parked: Mutex<Vec<(Mapping, Vec<Linger>)>>,
    /// `lingering` is not empty (kept under its lock): most withdrawals take no lock for it.
    lingering_any: AtomicBool,
    /// `parked` is not empty (kept under its lock).
    parked_any: AtomicBool,
    /// The memory of regions deregistered, kept for new regions of the same size (with new
    /// keys): a connection's receive buffers cost no mmap, page faults and zeroing, and their
    /// release no munmap and TLB shootdown (a short connection paid ~20 of each). At most
    /// `MAP_CACHE_BYTES`, only regions up to `MAP_CACHE_MAX_REGION`.
    map_cache: Mutex<(usize, Vec<Mapping>)>,
}

/// See `Inner::map_cache`.
const MAP_CACHE_BYTES: usize = 16 << 20;
const MAP_CACHE_MAX_REGION: usize = 1 << 20;

fn os(e: std::io::Error) -> VerbsError {
    VerbsError::Os(e.to_string())
}

impl Inner {
    /// A cached mapping of exactly `len` bytes (see `map_cache`).
    fn cached_map(&self, len: usize) -> Option<Mapping> {
        self.reap();
        let mut c = self.map_cache.lock();
        let i = c.1.iter().rposition(|m| m.len() == len)?;
        let m = c.1.swap_remove(i);
        c.0 -= len;
        Some(m)
    }

    /// Keep a deregistered region's memory for a later region, room permitting.
    fn recycle_map(&self, m: Mapping) {
        let len = m.len();
        if len > MAP_CACHE_MAX_REGION {
            return;
        }
        let mut c = self.map_cache.lock();
        if c.0 + len <= MAP_CACHE_BYTES {
            c.0 += len;
            c.1.push(m);
        }
    }

    /// The peer process `p` (a pidfd just taken from a connection), or the one of an earlier
    /// connection to the same process: if that one's process is alive now, the pid is still
    /// its, so `p` is the same process (a pid is not handed out again while its process lives).
    fn shared_proc(&self, p: Proc) -> Arc<Proc> {
        let mut m = self.procs.lock();
        if let Some(old) = m.get(&p.pid()).and_then(Weak::upgrade) {
            if old.alive() {
                return old;
            }
        }
        m.retain(|_, w| w.strong_count() > 0);
        let p = Arc::new(p);
        m.insert(p.pid(), Arc::downgrade(&p));
        p
    }

    /// The peer provider whose key table, bell page and eventfd a handshake brought: the one
    /// an earlier connection mapped if both memfds are the same files, else mapped now.
    fn peer_provider(
        &self,
        keys_fd: OwnedFd,
        bells_fd: OwnedFd,
        evfd: OwnedFd,
    ) -> Result<Arc<PeerProvider>, String> {
        let id = |fd: &OwnedFd| {
            sys::file_identity(fd.as_fd())
                .map_err(|e| format!("SDP shm: bad handshake (memfd): {e}"))
        };
        let ids = [id(&keys_fd)?, id(&bells_fd)?];
        let mut m = self.providers.lock();
        if let Some(p) = m.get(&ids[1]).and_then(Weak::upgrade) {
            if p.ids == ids {
                self.keep_provider(&p);
                return Ok(p);
            }
        }
        let bells = Mapping::map(bells_fd.as_fd(), BELLS_LEN, true)
            .map_err(|e| format!("SDP shm: cannot map the peer's bell page: {e}"))?;
        if bells.u32(B_MAGIC).load(Ordering::Relaxed) != BELLS_MAGIC {
            return Err("SDP shm: bad handshake (bell page magic)".into());
        }
        let keys = Mapping::map(keys_fd.as_fd(), KT_LEN, false)
            .map_err(|e| format!("SDP shm: cannot map the peer's key table: {e}"))?;
        sys::set_nonblocking(evfd.as_fd())
            .map_err(|e| format!("SDP shm: bad handshake (eventfd): {e}"))?;
        // Kept while connections to the provider live: out of the application's range of fd
        // numbers.
        let evfd = sys::high_owned(evfd)
            .map_err(|e| format!("SDP shm: no fd for the peer's eventfd: {e}"))?;
        let p = Arc::new(PeerProvider {
            keys,
            bells,
            evfd,
            ids,
        });
        m.retain(|_, w| w.strong_count() > 0);
        m.insert(ids[1], Arc::downgrade(&p));
        drop(m);
        self.keep_provider(&p);
        Ok(p)
    }

    /// Let go of the peer providers kept past [`PEER_KEEP`] (a process that makes no new
    /// connections gives them back when its progress thread next sleeps).
    fn expire_providers(&self) {
        let Some(mut r) = self.recent_providers.try_lock() else {
            return;
        };
        let Some((oldest, _)) = r.front() else {
            return;
        };
        let now = Instant::now();
        if now.duration_since(*oldest) < PEER_KEEP {
            return;
        }
        r.retain(|(t, _)| now.duration_since(*t) < PEER_KEEP);
    }

    /// Hold `p` for [`PEER_KEEP`] from now (see `recent_providers`); let go of those held
    /// longer, and of the oldest beyond [`PEER_KEEP_MAX`].
    fn keep_provider(&self, p: &Arc<PeerProvider>) {
        let now = Instant::now();
        let mut r = self.recent_providers.lock();
        r.retain(|(t, q)| !Arc::ptr_eq(q, p) && now.duration_since(*t) < PEER_KEEP);
        r.push_back((now, p.clone()));
        while r.len() > PEER_KEEP_MAX {
            r.pop_front();
        }
    }

    fn add_ctl(&self, ctl: &Arc<Ctl>, fd: Option<(RawFd, bool)>) -> Result<usize, VerbsError> {
        let token = self.ctls.lock().insert(Arc::downgrade(ctl));
        self.tokens_high.fetch_max(token + 1, Ordering::Relaxed);
        if let Some((fd, edge)) = fd {
            if let Err(e) = sys::epoll_add(self.epoll.as_fd(), fd, token as u64 + TOKEN_BASE, edge)
            {
                self.ctls.lock().remove(token);
                return Err(os(e));
            }
        }
        Ok(token)
    }

    fn add_fd(&self, token: usize, fd: RawFd, edge: bool) {
        let _ = sys::epoll_add(self.epoll.as_fd(), fd, token as u64 + TOKEN_BASE, edge);
    }

    fn remove_ctl(&self, token: usize) {
        self.ctls.lock().try_remove(token);
    }

    fn write_entry(&self, idx: usize, rkey: u32, access: Access, addr: u64, len: u64) {
        let off = KT_HDR + idx * KT_ENTRY;
        let seq = self.keys.u32(off + E_SEQ);
        let s = seq.load(Ordering::Relaxed);
        seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.keys.u32(off + E_RKEY).store(rkey, Ordering::Relaxed);
        self.keys
            .u32(off + E_ACCESS)
            .store(access.bits(), Ordering::Relaxed);
        self.keys.u64(off + E_ADDR).store(addr, Ordering::Relaxed);
        self.keys.u64(off + E_LEN).store(len, Ordering::Relaxed);
        seq.store(s.wrapping_add(2), Ordering::Release);
    }

    /// How often each connection's socket is read on its own (`LIVENESS_BACKSTOP`).
    fn backstop_ms(&self) -> u64 {
        self.cfg.liveness_interval.as_millis() as u64 * LIVENESS_BACKSTOP
    }

    /// Take what the epoll set reported: the sockets with news get their hint set and join
    /// `hinted` (for `take_news`), the RNR timer is read.
    fn drain_events(&self) {
        self.drained_ms.store(sys::coarse_ms(), Ordering::Relaxed);
        let ctls = self.ctls.lock();
        let mut hinted = self.hinted.lock();
        sys::epoll_drain(self.epoll.as_fd(), |tok| match tok {
            // Edge-triggered: taking the event is enough.
            TOKEN_EVFD => {}
            TOKEN_TIMER => sys::eventfd_drain(self.timer.as_fd()),
            t => {
                let token = (t - TOKEN_BASE) as usize;
                if let Some(c) = ctls.get(token).and_then(Weak::upgrade) {
                    // Once until the endpoint looks (`poll_cm` takes the hint back): the list
                    // holds each token at most once.
                    if !c.hint.swap(true, Ordering::Relaxed) {
                        hinted.push(token);
                    }
                }
            }
        });
    }

    /// Let go of parked memory whose peers' copies ended, and forget copies that ended.
    fn reap(&self) {
        if self.lingering_any.load(Ordering::Acquire) {
            let mut l = self.lingering.lock();
            l.retain(|c| {
                let over = c.over();
                if over {
                    c.settle(&self.bells);
                }
                !over
            });
            self.lingering_any.store(!l.is_empty(), Ordering::Release);
        }
        if !self.parked_any.load(Ordering::Acquire) {
            return;
        }
        let done: Vec<(Mapping, Vec<Linger>)> = {
            let mut p = self.parked.lock();
            let done = p
                .extract_if(.., |(_, ls)| {
                    ls.retain(|c| !c.over());
                    ls.is_empty()
                })
                .collect();
            self.parked_any.store(!p.is_empty(), Ordering::Release);
            done
        };
        for (m, _) in done {
            self.recycle_map(m);
        }
    }

    /// Note a copy under way into or out of our memory that no inbox of `ctls` may show any
    /// more (`lingering`), unless it ended.
    fn linger(&self, c: Linger) {
        if c.over() {
            c.settle(&self.bells);
        } else {
            let mut l = self.lingering.lock();
            l.push(c);
            self.lingering_any.store(true, Ordering::SeqCst);
        }
    }

    /// Keep `m` out of use until `lingers` ended (`parked`).
    fn park(&self, m: Mapping, lingers: Vec<Linger>) {
        let mut p = self.parked.lock();
        p.push((m, lingers));
        self.parked_any.store(true, Ordering::Release);
    }

    fn register(&self, addr: u64, len: usize, access: Access) -> Result<Reg, VerbsError> {
        self.reap();
        if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE) {
            return Err(VerbsError::Invalid("REMOTE_WRITE needs LOCAL_WRITE"));
        }
        let mut regs = self.regs.write();
        let idx = match regs.free.pop() {
            Some(i) => i as usize,
            None => {
                if regs.slots.len() >= KT_SLOTS {
                    return Err(VerbsError::NoResources("memory regions"));
                }
                regs.slots.push(None);
                regs.posted.push(AtomicU32::new(0));
                regs.gens.push(0);
                regs.slots.len() - 1
            }
        };
        let gen = regs.gens[idx].wrapping_add(1) & 0x7fff;
        regs.gens[idx] = gen;
        let g = u32::from((gen ^ regs.salt) & 0x7fff);
        let lkey = idx as u32 | (g << 16);
        let rkey = lkey | 0x8000_0000;
        let r = Reg {
            lkey,
            rkey,
            addr,
            len: len as u64,
            access,
        };
        regs.slots[idx] = Some(r);
        regs.posted[idx].store(0, Ordering::Relaxed);
        self.write_entry(idx, rkey, access, addr, len as u64);
        Ok(r)
    }

    /// Deregister: the key is withdrawn and receives posted in the region are marked bad (a
    /// SEND then fails instead of landing); copies peers had in flight are then treated as
    /// `how` says (`drain_copies`), and those still under way returned (`Drain::Collect`).
    fn deregister(&self, lkey: u32, how: Drain) -> Vec<Linger> {
        let mut regs = self.regs.write();
        let idx = (lkey & 0xffff) as usize;
        let Some(r) = regs.slots.get(idx).copied().flatten() else {
            return Vec::new();
        };
        if r.lkey != lkey {
            return Vec::new();
        }
        regs.slots[idx] = None;
        regs.free.push(idx as u32);
        let posted = regs.posted[idx].load(Ordering::Relaxed);
        self.write_entry(idx, 0, Access::empty(), 0, 0);
        drop(regs);
        let bad = r
            .access
            .contains(Access::LOCAL_WRITE)
            .then_some((r.addr, r.len));
        self.drain_copies(r.rkey, bad, posted, how)
    }

    /// After our memory was withdrawn from peers (a key invalidated or its access reduced;
    /// `bad`: a range whose posted receives must no longer be written), find the copies of
    /// that region (`rkey`; with `bad` also SENDs into a receive) peers had announced in our
    /// inboxes (`OFF_INFLIGHT`) when they could still have seen it valid: not copies of other
    /// regions (a pipelined read of the next source). Copies of torn-down connections
    /// (`lingering`) count too. Then wait for them or return them, as `how` says; no lock is
    /// held while waiting. Returns the copies still under way (all of them for `Collect`,
    /// those the bounded wait gave up on for `Bounded`, none for `Unbounded`).
    ///
    /// Only the inboxes that can matter are looked at: with `bad`, those of the endpoints that
    /// posted receives in the region (`posted`, from [`Regs::posted`]); for RDMA copies of the
    /// region, every inbox, but only while peers have any under way (`B_COPIES`). A server
    /// with thousands of connections otherwise read every inbox for each buffer it let go.
    fn drain_copies(
        &self,
        rkey: u32,
        bad: Option<(u64, u64)>,
        posted: u32,
        how: Drain,
    ) -> Vec<Linger> {
        // Our invalidation before our reads of the words: pairs with `InFlight::begin`.
        fence(Ordering::SeqCst);
        let rdma_busy = self.bells.u32(B_COPIES).load(Ordering::SeqCst) != 0;
        let every = rdma_busy || (bad.is_some() && posted == POSTED_MANY);
        let mut busy: Vec<Linger> = Vec::new();
        if every || (bad.is_some() && posted != 0) {
            let ctls = self.ctls.lock();
            let one = (!every).then(|| posted as usize - 1);
            let picked: Box<dyn Iterator<Item = &Weak<Ctl>>> = match one {
                Some(t) => Box::new(ctls.get(t).into_iter()),
                None => Box::new(ctls.iter().map(|(_, w)| w)),
            };
            for w in picked {
                let Some(c) = w.upgrade() else { continue };
                self.drain_looks.fetch_add(1, Ordering::Relaxed);
                let Some(ib) = c.inbox.as_ref() else { continue };
                if let Some((addr, len)) = bad {
                    mark_bad_recvs(ib, c.nslots, addr, len);
                    // The marks before our read of the word: pairs with the peer's fence
                    // between its announcement and its look at the receive (one of us sees
                    // the other's store; without it the store could wait in our store buffer).
                    fence(Ordering::SeqCst);
                }
                let v = ib.u32(OFF_INFLIGHT).load(Ordering::Acquire);
                // The key written before `v` (or a later one: then `v`'s copy is over).
                let k = ib.u32(OFF_INFLIGHT_KEY).load(Ordering::Relaxed);
                if v & 1 == 1 && (k == rkey || (k == 0 && bad.is_some())) {
                    busy.push(Linger {
                        inbox: ib.clone(),
                        until: Until::Moves(v),
                        key: k,
                        peer: c.peer(),
                    });
                }
            }
        }
        // Then the copies of connections gone (after the inboxes: an endpoint notes its copy
        // here before it leaves `ctls`, so one of the two looks finds it).
        if self.lingering_any.load(Ordering::SeqCst) {
            let l = self.lingering.lock();
            for c in l.iter() {
                if (c.key == rkey || (c.key == 0 && bad.is_some() && posted != 0)) && !c.over() {
                    busy.push(c.clone());
                }
            }
        }
        if bad.is_some() && !busy.is_empty() {
            fence(Ordering::SeqCst);
        }
        let max = match how {
            Drain::Collect => return busy,
            Drain::Bounded => COPY_DRAIN_MAX,
            Drain::Unbounded => Duration::MAX,
        };
        busy.retain(|c| {
            let w = c.wait(max);
            if w == CopyWait::TimedOut {
                self.drain_timeouts.fetch_add(1, Ordering::Relaxed);
            }
            w == CopyWait::TimedOut
        });
        busy
    }

    fn set_access(&self, lkey: u32, access: Access) -> Result<(), VerbsError> {
        if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE) {
            return Err(VerbsError::Invalid("REMOTE_WRITE needs LOCAL_WRITE"));
        }
        let mut regs = self.regs.write();
        let idx = (lkey & 0xffff) as usize;
        match regs.slots.get_mut(idx) {
            Some(Some(r)) if r.lkey == lkey => {
                let reduced = !access.contains(r.access);
                let old_access = r.access;
                let lost_local_write =
                    r.access.contains(Access::LOCAL_WRITE) && !access.contains(Access::LOCAL_WRITE);
                r.access = access;
                let r = *r;
                let posted = regs.posted[idx].load(Ordering::Relaxed);
                self.write_entry(idx, r.rkey, access, r.addr, r.len);
                drop(regs);
                if reduced {
                    // A revocation: as a deregistration, no access of the old rights after.
                    // A write right taken away: no late write may land in memory that stays
                    // in use, however long that takes.
                    let how = if old_access.contains(Access::REMOTE_WRITE)
                        && !access.contains(Access::REMOTE_WRITE)
                    {
                        Drain::Unbounded
                    } else {
                        Drain::Bounded
                    };
                    self.drain_copies(
                        r.rkey,
                        lost_local_write.then_some((r.addr, r.len)),
                        posted,
                        how,
                    );
                }
                Ok(())
            }
            _ => Err(VerbsError::Invalid("memory region not registered")),
        }
    }
}

/// Mark the receives posted in `inbox` (`nslots` slots) that overlap `addr..addr + len` bad,
/// so a peer's SEND into them fails (its receive status `ST_REM_OP`) instead of landing.
fn mark_bad_recvs(inbox: &Mapping, nslots: u32, addr: u64, len: u64) {
    if nslots == 0 {
        return;
    }
    let head = inbox.u32(OFF_HEAD).load(Ordering::Relaxed);
    let tail = inbox.u32(OFF_TAIL).load(Ordering::Acquire);
    let n = head.wrapping_sub(tail).min(nslots);
    let end = addr.saturating_add(len);
    for i in 0..n {
        let base = HDR + (tail.wrapping_add(i) % nslots) as usize * SLOT;
        let a = inbox.u64(base + S_ADDR).load(Ordering::Relaxed);
        let l = u64::from(inbox.u32(base + S_LEN).load(Ordering::Relaxed));
        if a < end && a.saturating_add(l) > addr {
            inbox.u32(base + S_BAD).store(1, Ordering::Relaxed);
        }
    }
}

/// A device context for intra-host connections. Clones share the protection domain, the key
/// table and the notify fd.
#[derive(Clone)]
pub struct ShmProvider {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ShmProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmProvider").finish_non_exhaustive()
    }
}

impl ShmProvider {
    pub fn new() -> Result<ShmProvider, VerbsError> {
        ShmProvider::with_config(ShmConfig::default())
    }

    pub fn with_config(cfg: ShmConfig) -> Result<ShmProvider, VerbsError> {
        // Our mapping is the only writable one there will ever be: sealed after it, the
        // table cannot be written through any fd a peer holds or reopens.
        let keys_fd = sys::memfd_sized("sdp-shm-keys", KT_LEN).map_err(os)?;
        let keys = Mapping::map(keys_fd.as_fd(), KT_LEN, true).map_err(os)?;
        sys::seal_future_writes(keys_fd.as_fd()).map_err(os)?;
        let keys_ro = sys::reopen_readonly(keys_fd.as_fd()).map_err(os)?;
        let bells_fd = sys::memfd_sealed("sdp-shm-bells", BELLS_LEN).map_err(os)?;
        let bells = Mapping::map(bells_fd.as_fd(), BELLS_LEN, true).map_err(os)?;
        bells.u32(B_MAGIC).store(BELLS_MAGIC, Ordering::Relaxed);
        let epoll = sys::epoll_create().map_err(os)?;
        let evfd = sys::eventfd().map_err(os)?;
        let timer = sys::timerfd().map_err(os)?;
        // Edge-triggered: each write (a peer's or ours, `signal_if_armed`) reports once and
        // nobody reads the count back (a read per wakeup saved; 2^64 writes to fill it).
        sys::epoll_add(epoll.as_fd(), evfd.as_raw_fd(), TOKEN_EVFD, true).map_err(os)?;
        sys::epoll_add(epoll.as_fd(), timer.as_raw_fd(), TOKEN_TIMER, false).map_err(os)?;
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let salt = (t
            ^ u64::from(sys::getpid_now() as u32).wrapping_mul(0x9e37_79b9)
            ^ (&keys as *const Mapping as u64)) as u16;
        Ok(ShmProvider {
            inner: Arc::new(Inner {
                cfg,
                uid: sys::getuid(),
                epoll,
                evfd,
                timer,
                keys,
                _keys_fd: keys_fd,
                keys_ro,
                bells,
                bells_fd,
                regs: RwLock::new(Regs {
                    slots: vec![None],
                    posted: vec![AtomicU32::new(0)],
                    gens: vec![0],
                    free: Vec::new(),
                    salt,
                }),
                ctls: Mutex::new(slab::Slab::new()),
                hinted: Mutex::new(Vec::new()),
                drained_ms: AtomicU64::new(0),
                tokens_high: AtomicUsize::new(0),
                rnr_waiting: AtomicUsize::new(0),
                next_port: AtomicU32::new(sys::getpid_now() as u32),
                refused_uid: AtomicU64::new(0),
                wakeups: Arc::new(AtomicU64::new(0)),
                direct_wakeups: Arc::new(AtomicU64::new(0)),
                assisted: AtomicU64::new(0),
                ring_sends: AtomicU64::new(0),
                procs: Mutex::new(HashMap::new()),
                providers: Mutex::new(HashMap::new()),
                recent_providers: Mutex::new(VecDeque::new()),
                drain_looks: AtomicU64::new(0),
                settle_timeouts: AtomicU64::new(0),
                drain_timeouts: AtomicU64::new(0),
                lingering: Mutex::new(Vec::new()),
                parked: Mutex::new(Vec::new()),
                lingering_any: AtomicBool::new(false),
                parked_any: AtomicBool::new(false),
                map_cache: Mutex::new((0, Vec::new())),
            }),
        })
    }

    pub fn config(&self) -> ShmConfig {
        self.inner.cfg
    }

    /// Connect requests refused because the peer ran as another user, by any listener of
    /// this provider.
    pub fn refused_uid_count(&self) -> u64 {
        self.inner.refused_uid.load(Ordering::Relaxed)
    }

    /// Inboxes this provider's deregistrations and revocations read for copies in flight
    /// (see `Inner::drain_copies`: only those that can matter).
    pub fn inboxes_drained(&self) -> u64 {
        self.inner.drain_looks.load(Ordering::Relaxed)
    }

    /// Eventfd writes this provider made to wake peers (a busy peer gets none).
    pub fn wakeups_sent(&self) -> u64 {
        self.inner.wakeups.load(Ordering::Relaxed)
    }

    /// Bytes this provider wrote into peers' direct-wakeup sockets instead of their eventfds
    /// (`Endpoint::give_direct_wake`).
    pub fn direct_wakeups_sent(&self) -> u64 {
        self.inner.direct_wakeups.load(Ordering::Relaxed)
    }

    /// Chunks of peers' large RDMA Reads and Writes this provider copied for them while
    /// polling (see `assist`: both processes share such copies).
    pub fn assisted_chunks(&self) -> u64 {
        self.inner.assisted.load(Ordering::Relaxed)
    }

    /// Times turning direct wakeups off gave up waiting for a peer's wakeup under way
    /// (`DIRECT_SETTLE_MAX`): a peer stopped in the middle of one.
    pub fn settles_timed_out(&self) -> u64 {
        self.inner.settle_timeouts.load(Ordering::Relaxed)
    }

    /// Times a revocation (or a reduction of rights) gave up waiting for a peer's copy in
    /// flight (`COPY_DRAIN_MAX`, read-only grants of our own memory): a live peer stopped
    /// between its look at our key table and its copy's system call.
    pub fn drains_timed_out(&self) -> u64 {
        self.inner.drain_timeouts.load(Ordering::Relaxed)
    }

    /// SENDs this provider copied through peers' inline rings (larger than a slot holds, up
    /// to [`RING_MSG_MAX`], when the ring had room).
    pub fn ring_sends(&self) -> u64 {
        self.inner.ring_sends.load(Ordering::Relaxed)
    }

    /// Peer providers held past their last connection's setup (their mappings and eventfd),
    /// let go within about a second (`PEER_KEEP`).
    pub fn kept_peer_providers(&self) -> usize {
        self.inner.recent_providers.lock().len()
    }

    /// Regions registered now.
    pub fn registered_regions(&self) -> usize {
        self.inner.regs.read().slots.iter().flatten().count()
    }

    /// Wait up to `timeout_ms` for the notify fd to be readable (a helper for simple loops).
    pub fn wait(&self, timeout_ms: i32) -> bool {
        sys::poll_readable(self.inner.epoll.as_raw_fd(), timeout_ms)
    }
}

fn normalize(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => ip,
        },
        v4 => v4,
    }
}

fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || sys::local_addrs().contains(&ip)
}

fn rendezvous_name(addr: SocketAddr) -> Vec<u8> {
    format!("sdp-shm/{addr}").into_bytes()
}

/// Bytes of an inbox of `nslots` slots: the header, the slots, the inline ring.
fn inbox_len(nslots: u32) -> usize {
    HDR + nslots as usize * SLOT + RING_LEN
}

/// Where the inline ring starts in an inbox of `nslots` slots.
fn ring_base(nslots: u32) -> usize {
    HDR + nslots as usize * SLOT
}

/// Create our inbox: a sealed memfd with `nslots` receive slots and the inline ring.
fn new_inbox(max_recv_wr: u32) -> Result<(OwnedFd, Arc<Mapping>, u32), VerbsError> {
    let nslots = max_recv_wr.max(1).next_power_of_two().min(MAX_SLOTS);
    let len = inbox_len(nslots);
    let fd = sys::memfd_sealed("sdp-shm-inbox", len).map_err(os)?;
    let m = Mapping::map(fd.as_fd(), len, true).map_err(os)?;
    m.u32(OFF_MAGIC).store(INBOX_MAGIC, Ordering::Relaxed);
    m.u32(OFF_NSLOTS).store(nslots, Ordering::Relaxed);
    m.u64(OFF_SELF)
        .store(m.ptr().as_ptr() as u64, Ordering::Relaxed);
    for k in 0..COUNTS {
        m.u32(OFF_COUNTS + 4 * k).store(k as u32, Ordering::Relaxed);
    }
    Ok((fd, Arc::new(m), nslots))
}

/// What we know of the other side once it sent its REQ or ACC.
struct Peer {
    /// The peer process: every copy goes through its pidfd's liveness check (one pidfd per
    /// peer process, shared by its connections: `Inner::shared_proc`).
    proc: Arc<Proc>,
    inbox: Mapping,
    /// The peer's inbox at its own address (`OFF_SELF`; 0: unknown, copies end their
    /// announcements themselves).
    inbox_va: u64,
    nslots: u32,
    /// The peer provider's key table, bell page and eventfd (shared by its connections).
    prov: Arc<PeerProvider>,
    /// The offset of our connection's bell in the peer's bell page (if it has one).
    bell: Option<usize>,
    wakeups: Arc<AtomicU64>,
    /// The peer's direct-wakeup socket (`M_WAKE`), used while its `OFF_DIRECT` is on.
    direct: Option<OwnedFd>,
    direct_wakeups: Arc<AtomicU64>,
}

/// How long a peer provider's mappings are kept after a connection to it was set up (see
/// `Inner::recent_providers`).
const PEER_KEEP: Duration = Duration::from_secs(1);
/// Most peer providers kept that way.
const PEER_KEEP_MAX: usize = 16;

/// What every connection to one peer provider shares: its key table and bell page (mapped once)
/// and its eventfd (one fd). Connections of one process to another used to hold each their own
/// copies: four fds and two mappings (2 MiB of address space) more per connection, which at a
/// few thousand connections ran into RLIMIT_NOFILE (`Inner::peer_provider`).
struct PeerProvider {
    keys: Mapping,
    bells: Mapping,
    evfd: OwnedFd,
    /// Identities of the key table's and the bell page's memfds.
    ids: [(u64, u64); 2],
}

impl Peer {
    fn attach(
        inner: &Inner,
        proc: Arc<Proc>,
        m: &Msg<'_>,
        fds: Vec<OwnedFd>,
    ) -> Result<Peer, String> {
        let (nslots, probe) = (m.nslots, m.probe);
        let [inbox_fd, evfd, keys_fd, bells_fd]: [OwnedFd; 4] = fds
            .try_into()
            .map_err(|_| "SDP shm: bad handshake (fds)".to_string())?;
        if nslots == 0 || nslots > MAX_SLOTS {
            return Err("SDP shm: bad handshake (ring size)".into());
        }
        let len = inbox_len(nslots);
        match sys::sealed_size(inbox_fd.as_fd()) {
            Ok((sz, true)) if sz >= len => {}
            _ => return Err("SDP shm: bad handshake (inbox not a sealed memfd)".into()),
        }
        match sys::sealed_size(keys_fd.as_fd()) {
            Ok((sz, true)) if sz >= KT_LEN => {}
            _ => return Err("SDP shm: bad handshake (key table not a sealed memfd)".into()),
        }
        match sys::sealed_size(bells_fd.as_fd()) {
            Ok((sz, true)) if sz >= BELLS_LEN => {}
            _ => return Err("SDP shm: bad handshake (bell page not a sealed memfd)".into()),
        }
        let prov = inner.peer_provider(keys_fd, bells_fd, evfd)?;
        let bell = match m.bell {
            NO_BELL => None,
            b if (b as usize) < NBELLS => bell_off(b as usize),
            _ => return Err("SDP shm: bad handshake (bell)".into()),
        };
        let inbox = Mapping::map(inbox_fd.as_fd(), len, true)
            .map_err(|e| format!("SDP shm: cannot map the peer's inbox: {e}"))?;
        if inbox.u32(OFF_MAGIC).load(Ordering::Relaxed) != INBOX_MAGIC {
            return Err("SDP shm: bad handshake (inbox magic)".into());
        }
        match sys::probe(&proc, probe) {
            Ok(true) => {}
            Ok(false) => return Err("SDP shm: peer memory probe mismatch".into()),
            Err(e) => {
                return Err(format!(
                    "SDP shm: cannot access peer memory ({e}; see kernel.yama.ptrace_scope)"
                ))
            }
        }
        // Where our copies' system calls end their announcements (`sys::CopyEnd`): a value
        // that is not a page of the peer's (a hostile or broken peer) only makes those ends
        // fail, and we end them ourselves.
        let va = inbox.u64(OFF_SELF).load(Ordering::Relaxed);
        let inbox_va = if va != 0 && va.is_multiple_of(4096) && va < 1 << 56 {
            va
        } else {
            0
        };
        Ok(Peer {
            proc,
            inbox,
            inbox_va,
            nslots,
            prov,
            bell,
            wakeups: inner.wakeups.clone(),
            direct: None,
            direct_wakeups: inner.direct_wakeups.clone(),
        })
    }

    /// For a copy into the peer's memory: its system call writes 0 over our announcement in
    /// the peer's inbox after the data (`sys::CopyEnd`).
    fn end_write(&self) -> Option<sys::CopyEnd> {
        static ZERO: u32 = 0;
        (self.inbox_va != 0).then(|| sys::CopyEnd {
            local: &ZERO as *const u32 as u64,
            remote: self.inbox_va + OFF_INFLIGHT as u64,
        })
    }

    /// For a copy out of the peer's memory: its system call copies the peer's zero word over
    /// our announcement (through our mapping of its inbox) after the data.
    fn end_read(&self) -> Option<sys::CopyEnd> {
        (self.inbox_va != 0).then(|| sys::CopyEnd {
            local: self.inbox.ptr().as_ptr() as u64 + OFF_INFLIGHT as u64,
            remote: self.inbox_va + OFF_ZERO as u64,
        })
    }

    /// Whether an RDMA copy of `len` bytes at the peer's `rb` (with `need`) may run now, after
    /// it was announced: the key grants it, and the peer is still open (one tearing the
    /// connection down marks its inbox closed, then looks at our announcement: `drain_own`;
    /// without this look, the chunks of a shared copy after the first went on landing).
    fn may_copy(&self, rb: RemoteBuf, len: u32, need: Access) -> bool {
        !self.closed() && self.covers(rb, len, need)
    }

    /// Whether the peer's key `rb.rkey` grants `need` on `len` bytes at `rb.addr`.
    fn covers(&self, rb: RemoteBuf, len: u32, need: Access) -> bool {
        self.lookup(rb.rkey).is_some_and(|(a, l, acc)| {
            acc.contains(need)
                && rb.addr >= a
                && rb
                    .addr
                    .checked_add(u64::from(len))
                    .is_some_and(|e| e <= a.saturating_add(l))
        })
    }

    /// Look `rkey` up in the peer's key table: (addr, len, access).
    fn lookup(&self, rkey: u32) -> Option<(u64, u64, Access)> {
        let idx = (rkey & 0xffff) as usize;
        if idx == 0 {
            return None;
        }
        let off = KT_HDR + idx * KT_ENTRY;
        let k = &self.prov.keys;
        for _ in 0..1000 {
            let s1 = k.u32(off + E_SEQ).load(Ordering::Acquire);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let key = k.u32(off + E_RKEY).load(Ordering::Relaxed);
            let access = k.u32(off + E_ACCESS).load(Ordering::Relaxed);
            let addr = k.u64(off + E_ADDR).load(Ordering::Relaxed);
            let len = k.u64(off + E_LEN).load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if k.u32(off + E_SEQ).load(Ordering::Relaxed) != s1 {
                continue;
            }
            return (key == rkey).then(|| (addr, len, Access::from_bits_truncate(access)));
        }
        None
    }

    fn closed(&self) -> bool {
        self.inbox.u32(OFF_STATE).load(Ordering::Acquire) != 0
    }

    /// Ring our connection's bell in the peer's page: its next round looks at the connection.
    fn ring(&self) {
        if let Some(b) = self.bell {
            self.prov.bells.u32(b).store(1, Ordering::Release);
        }
    }

    /// After a solicited SEND: while the peer has direct wakeups on, one byte into its socket
    /// wakes its reader with one hop (the bell rung first, the eventfd left alone unless
    /// `engine_too`); else as [`Peer::wake`]. The byte goes only to a socket the peer gave us
    /// for this connection.
    fn wake_solicited(&self, engine_too: bool) {
        let Some(fd) = self.direct.as_ref() else {
            return self.wake();
        };
        self.ring();
        let busy = self.inbox.u32(OFF_DIRECT_BUSY);
        // The raise is a full barrier: the bell above is visible before we read the switch,
        // so an owner that turns it off and then looks at its bell sees this SEND.
        busy.fetch_add(1, Ordering::SeqCst);
        let mut wrote = false;
        let sent = self.inbox.u32(OFF_DIRECT).load(Ordering::SeqCst) != 0
            && (self.byte_unread()
                || match sys::send_nb(fd.as_raw_fd(), &[1]) {
                    Ok(_) => {
                        wrote = true;
                        true
                    }
                    // Bytes wait in the socket already: the reader will look.
                    Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                });
        busy.fetch_sub(1, Ordering::SeqCst);
        if wrote {
            self.direct_wakeups.fetch_add(1, Ordering::Relaxed);
        }
        if !sent || engine_too {
            self.signal();
        }
    }

    /// A reader that needs no byte per SEND (`OFF_DIRECT_LEVEL`) has one of ours unread: the
    /// SEND just published needs none (the reader's take-back clears the word first, then looks
    /// for SENDs: the publication came before this look, the SeqCst swap orders the two).
    /// Otherwise the word is set for the byte about to be written.
    fn byte_unread(&self) -> bool {
        self.inbox.u32(OFF_DIRECT_LEVEL).load(Ordering::Relaxed) != 0
            && self.inbox.u32(OFF_DIRECT_UNREAD).swap(1, Ordering::SeqCst) != 0
    }

    /// Ring the bell, then write the peer's eventfd if it asked to be woken.
    fn wake(&self) {
        self.ring();
        self.signal();
    }

    /// Write the peer's eventfd if it asked to be woken.
    fn signal(&self) {
        if signal_if_armed(&self.prov.bells, self.prov.evfd.as_fd()) {
            self.wakeups.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// After a change: if the owner of `bells` armed (`arm`), take its wake flag and write its
/// eventfd `evfd`. True if it wrote.
fn signal_if_armed(bells: &Mapping, evfd: BorrowedFd<'_>) -> bool {
    fence(Ordering::SeqCst);
    let w = bells.u32(B_WAKE);
    if w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0 {
        sys::eventfd_signal(evfd);
        return true;
    }
    false
}

struct Msg<'a> {
    kind: u8,
    consumer: bool,
    /// The sender's bell for this connection in its bell page (`NO_BELL`: none).
    bell: u16,
    nslots: u32,
    probe: u64,
    addr: SocketAddr,
    pd: &'a [u8],
}

fn encode(m: &Msg<'_>) -> Vec<u8> {
    let mut b = vec![0u8; M_HDR + m.pd.len()];
    b[0] = m.kind;
    b[1] = M_VERSION;
    b[2] = m.consumer as u8;
    b[4..8].copy_from_slice(&m.nslots.to_le_bytes());
    b[8..16].copy_from_slice(&m.probe.to_le_bytes());
    let (ip, v4) = match m.addr.ip() {
        IpAddr::V4(a) => (a.to_ipv6_mapped().octets(), 1),
        IpAddr::V6(a) => (a.octets(), 0),
    };
    b[16..32].copy_from_slice(&ip);
    b[32..34].copy_from_slice(&m.addr.port().to_le_bytes());
    b[34] = v4;
    b[36..38].copy_from_slice(&(m.pd.len() as u16).to_le_bytes());
    b[38..40].copy_from_slice(&m.bell.to_le_bytes());
    b[M_HDR..].copy_from_slice(m.pd);
    b
}

fn decode(b: &[u8]) -> Option<Msg<'_>> {
    if b.len() < M_HDR || b[1] != M_VERSION {
        return None;
    }
    let pd_len = u16::from_le_bytes([b[36], b[37]]) as usize;
    let pd = b.get(M_HDR..M_HDR + pd_len)?;
    let ip6 = Ipv6Addr::from(<[u8; 16]>::try_from(&b[16..32]).ok()?);
    let ip = if b[34] == 1 {
        IpAddr::V4(ip6.to_ipv4_mapped()?)
    } else {
        IpAddr::V6(ip6)
    };
    Some(Msg {
        kind: b[0],
        consumer: b[2] != 0,
        bell: u16::from_le_bytes([b[38], b[39]]),
        nslots: u32::from_le_bytes(b[4..8].try_into().ok()?),
        probe: u64::from_le_bytes(b[8..16].try_into().ok()?),
        addr: SocketAddr::new(ip, u16::from_le_bytes([b[32], b[33]])),
        pd,
    })
}

fn send_simple(sock: &OwnedFd, kind: u8, consumer: bool, pd: &[u8]) -> bool {
    let m = encode(&Msg {
        kind,
        consumer,
        bell: NO_BELL,
        nslots: 0,
        probe: 0,
        addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        pd,
    });
    sys::send_msg(sock.as_fd(), &m, &[]).is_ok()
}

/// Smallest plain write staged over shm (`Config::staged_send_min`).
const STAGED_SEND_MIN: usize = 128 * 1024;

impl Provider for ShmProvider {
    type Mr = ShmMr;
    type Endpoint = ShmEndpoint;
    type Listener = ShmListener;

    fn name(&self) -> &'static str {
        "shm"
    }

    fn staged_send_min(&self) -> usize {
        // A Data message costs the peer a copy out of its receive buffer on top of ours into
        // the send buffer (and the copy between them); a staged write is our copy and the
        // peer's read straight into its reader's memory.
        STAGED_SEND_MIN
    }

    fn reg_mr(&self, len: usize, access: Access) -> Result<ShmMr, VerbsError> {
        let map = match self.inner.cached_map(len) {
            Some(m) => m,
            None => Mapping::anon(len).map_err(|_| VerbsError::NoResources("memory"))?,
        };
        // SAFETY: the mapping is at least `len` bytes and lives in the ShmMr with the RawBuf.
        let mem = unsafe { RawBuf::new(map.ptr(), len) };
        let reg = self
            .inner
            .register(map.ptr().as_ptr() as u64, len, access)?;
        Ok(ShmMr {
            inner: self.inner.clone(),
            reg,
            grants: Vec::new(),
            mem,
            _map: Some(map),
        })
    }

    unsafe fn reg_mr_at(
        &self,
        addr: NonNull<u8>,
        len: usize,
        access: Access,
    ) -> Result<ShmMr, VerbsError> {
        // SAFETY: the caller keeps `addr..addr + len` allocated for the region's life.
        let mem = unsafe { RawBuf::new(addr, len) };
        let reg = self.inner.register(addr.as_ptr() as u64, len, access)?;
        Ok(ShmMr {
            inner: self.inner.clone(),
            reg,
            grants: Vec::new(),
            mem,
            _map: None,
        })
    }

    fn listen(
        &self,
        addr: SocketAddr,
        backlog: u32,
        caps: QpCaps,
    ) -> Result<ShmListener, VerbsError> {
        let ip = normalize(addr.ip());
        if !ip.is_unspecified() && !is_local(ip) {
            return Err(VerbsError::AddrNotAvailable);
        }
        let (sock, port, tcp) = if addr.port() == 0 {
            let mut tries = 0;
            loop {
                let (tcp, port) = sys::tcp_reserve(SocketAddr::new(ip, 0)).map_err(|e| {
                    if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) {
                        VerbsError::AddrNotAvailable
                    } else {
                        os(e)
                    }
                })?;
                match sys::seqpacket_listen(&rendezvous_name(SocketAddr::new(ip, port)), backlog) {
                    Ok(s) => break (s, port, Some(tcp)),
                    Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) && tries < 16 => {
                        tries += 1;
                    }
                    Err(e) => return Err(os(e)),
                }
            }
        } else {
            let s =
                sys::seqpacket_listen(&rendezvous_name(SocketAddr::new(ip, addr.port())), backlog)
                    .map_err(|e| {
                        if e.raw_os_error() == Some(libc::EADDRINUSE) {
                            VerbsError::AddrInUse
                        } else {
                            os(e)
                        }
                    })?;
            (s, addr.port(), None)
        };
        ShmListener::new(
            &self.inner,
            Some(sock),
            SocketAddr::new(ip, port),
            backlog,
            caps,
            tcp,
        )
    }

    fn listen_adopted(
        &self,
        addr: SocketAddr,
        backlog: u32,
        caps: QpCaps,
    ) -> Result<ShmListener, VerbsError> {
        let addr = SocketAddr::new(normalize(addr.ip()), addr.port());
        ShmListener::new(&self.inner, None, addr, backlog, caps, None)
    }

    fn connect(
        &self,
        dst: SocketAddr,
        src: Option<SocketAddr>,
        caps: QpCaps,
        private_data: &[u8],
    ) -> Result<ShmEndpoint, VerbsError> {
        if private_data.len() > MAX_PD_CONNECT {
            return Err(VerbsError::Invalid("private data too long"));
        }
        let mut ip = normalize(dst.ip());
        if ip.is_unspecified() {
            ip = if ip.is_ipv4() {
                IpAddr::V4(Ipv4Addr::LOCALHOST)
            } else {
                IpAddr::V6(Ipv6Addr::LOCALHOST)
            };
        }
        if !is_local(ip) {
            return Err(VerbsError::NoDevice(format!(
                "{dst}: shm connects only to addresses of this host"
            )));
        }
        let port = dst.port();
        let mut names = vec![SocketAddr::new(ip, port)];
        if ip.is_ipv4() {
            names.push(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port));
        }
        names.push(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port));
        let names: Vec<Vec<u8>> = names.into_iter().map(rendezvous_name).collect();
        // `None`: the rendezvous socket's own queue is full (a burst the listener has not
        // taken yet), answered as the listener's full queue answers.
        let sock = match sys::seqpacket_connect_first(&names) {
            Ok(s) => Some(s),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => None,
            // Nobody listens over shm there: refused at once, before an endpoint and its
            // inbox exist (a program under the shim connecting to kernel TCP servers pays
            // this on every connect).
            Err(_) => return Err(VerbsError::Refused),
        };
        let local = match src.filter(|s| s.port() != 0) {
            // A port the application bound (its IP, or ours where it bound none).
            Some(s) if s.ip().is_unspecified() => SocketAddr::new(ip, s.port()),
            Some(s) => s,
            None => {
                let p = self.inner.next_port.fetch_add(1, Ordering::Relaxed);
                SocketAddr::new(ip, 32768 + (p % 28232) as u16)
            }
        };
        let (inbox_fd, inbox, nslots) = new_inbox(caps.max_recv_wr)?;
        let mut ep = ShmEndpoint::new(
            self.inner.clone(),
            None,
            inbox,
            Some(inbox_fd),
            nslots,
            caps,
            local,
            SocketAddr::new(ip, port),
            true,
        )?;
        let Some(sock) = sock else {
            ep.state = QpState::Error;
            ep.cm.push_back(CmEvent::Rejected {
                private_data: crate::verbs::REJECT_QUEUE_FULL.as_bytes().to_vec(),
                consumer: true,
            });
            return Ok(ep);
        };
        match sys::peer_cred(sock.as_fd()) {
            Ok((pid, uid)) if uid == self.inner.uid => match Proc::of_peer(sock.as_fd(), pid) {
                // The listening socket's creator is gone: the listener moved with its
                // connections to a process that went on (`daemon()`): its ACC's credentials
                // name the acceptor (`check_socket`), whose memory is probed then.
                Ok(p) if !p.alive() => {}
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Ok(p) if !sys::may_access(&p) => {
                    // We could not prove we reach its memory after its ACC (Yama's
                    // ptrace_scope, a child connecting to its parent): ask nothing. The
                    // acceptor of a handed request is established at its ACC, so a connect that
                    // failed after it would leave the application a connection that only resets
                    // (and, with the shim's fallback, a second one for the same client).
                    drop(p);
                    ep.state = QpState::Error;
                    ep.cm.push_back(CmEvent::Rejected {
                        private_data: b"SDP shm: cannot access the listener's memory (see kernel.yama.ptrace_scope)".to_vec(),
                        consumer: true,
                    });
                    return Ok(ep);
                }
                Ok(p) => {
                    // The listener's process: the acceptor unless it hands the request to
                    // another process sharing the listener (then its ACC says who: `check_socket`).
                    // `ctl.peer` is set when the ACC came.
                    ep.peer_proc = Some(self.inner.shared_proc(p));
                }
                Err(_) => {
                    ep.state = QpState::Error;
                    ep.cm.push_back(CmEvent::Rejected {
                        private_data: Vec::new(),
                        consumer: false,
                    });
                    return Ok(ep);
                }
            },
            Ok((_, uid)) => {
                ep.state = QpState::Error;
                ep.cm.push_back(CmEvent::Rejected {
                    private_data: format!(
                        "SDP shm: the listener runs as another user (uid {uid}): not reached"
                    )
                    .into_bytes(),
                    consumer: true,
                });
                return Ok(ep);
            }
            Err(e) => return Err(os(e)),
        }
        let m = encode(&Msg {
            kind: M_REQ,
            bell: NO_BELL,
            consumer: false,
            nslots,
            probe: sys::probe_addr(),
            addr: local,
            pd: private_data,
        });
        // No fds yet: they go once both sides proved they reach each other (M_PRB, M_FDS).
        // The ACC's sender is known by the kernel's credentials on it.
        if sys::set_passcred(sock.as_fd()).is_err() || sys::send_msg(sock.as_fd(), &m, &[]).is_err()
        {
            // A listener that refuses at once may have answered and closed before our request
            // went: its REJ (with its reason) is waiting.
            let why = queued_reject(sock.as_fd());
            ep.state = QpState::Error;
            ep.cm.push_back(CmEvent::Rejected {
                consumer: why.is_some(),
                private_data: why.unwrap_or_default(),
            });
            return Ok(ep);
        }
        self.inner.add_fd(ep.token, sock.as_raw_fd(), true);
        sys::close_in_fork_child(sock.as_fd());
        ep.sock = Some(sock);
        Ok(ep)
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.inner.epoll.as_raw_fd())
    }

    fn arm(&self) -> Result<(), VerbsError> {
        let inner = &self.inner;
        // (Before the progress thread sleeps: copies of connections gone that ended, and
        // memory parked behind them, are let go; so are peer providers kept past their time.)
        inner.reap();
        inner.expire_providers();
        inner.drain_events();
        // One flag for every connection: the first peer to ring a bell after it writes the
        // eventfd. (Stored only when taken: peers read it at each of their sends.)
        let w = inner.bells.u32(B_WAKE);
        if w.load(Ordering::Relaxed) == 0 {
            w.store(1, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        if inner.rnr_waiting.load(Ordering::Relaxed) > 0 {
            sys::timerfd_set(inner.timer.as_fd(), 10_000_000);
        }
        Ok(())
    }

    fn take_news(&self, out: &mut Vec<usize>) -> bool {
        // Every rung bell (a peer's change to that connection since its owner last looked:
        // one pass over the bells of the tokens handed out), then the sockets epoll reported
        // (to `arm`, or here when a busy progress thread has not slept for a while).
        let now = sys::coarse_ms();
        if now.saturating_sub(self.inner.drained_ms.load(Ordering::Relaxed))
            >= self.inner.cfg.liveness_interval.as_millis() as u64
        {
            self.inner.drain_events();
        }
        let bells = &self.inner.bells;
        let high = self.inner.tokens_high.load(Ordering::Relaxed).min(NBELLS);
        for token in 0..high {
            if bells.u32(B_BASE + 4 * token).load(Ordering::Acquire) != 0 {
                out.push(token);
            }
        }
        out.append(&mut self.inner.hinted.lock());
        true
    }
}

/// A registered region: memory we allocated (`reg_mr`) or the caller's (`reg_mr_at`).
pub struct ShmMr {
    inner: Arc<Inner>,
    reg: Reg,
    /// Grants not yet revoked: one key-table entry each, covering only the granted range
    /// (deregistered with the region).
    grants: Vec<Reg>,
    mem: RawBuf,
    _map: Option<Mapping>,
}

impl std::fmt::Debug for ShmMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmMr")
            .field("lkey", &self.reg.lkey)
            .field("rkey", &self.reg.rkey)
            .field("addr", &format_args!("{:#x}", self.reg.addr))
            .field("len", &self.reg.len)
            .field("access", &self.reg.access)
            .finish()
    }
}

impl MemoryRegion for ShmMr {
    fn lkey(&self) -> u32 {
        self.reg.lkey
    }
    fn rkey(&self) -> u32 {
        self.reg.rkey
    }
    fn addr(&self) -> u64 {
        self.reg.addr
    }
    fn len(&self) -> usize {
        self.reg.len as usize
    }
    fn access(&self) -> Access {
        self.reg.access
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.mem.ptr())
    }
    fn set_access(&mut self, access: Access) -> Result<(), VerbsError> {
        self.inner.set_access(self.reg.lkey, access)?;
        self.reg.access = access;
        Ok(())
    }
    fn advertise(&mut self, off: usize, len: usize, access: Access) -> Result<Grant, VerbsError> {
        check_grant(self.reg.len as usize, off, len, access)?;
        // An entry of its own in the key table: a peer checks the range and rights of the
        // rkey it was given, so it reaches this range and nothing else of the region.
        let r = self
            .inner
            .register(self.reg.addr + off as u64, len, access)?;
        self.grants.push(r);
        Ok(Grant {
            addr: r.addr,
            len,
            lkey: r.lkey,
            rkey: r.rkey,
            id: u64::from(r.lkey),
        })
    }
    fn revoke(&mut self, grant: &Grant) -> Result<(), VerbsError> {
        let Some(i) = self
            .grants
            .iter()
            .position(|r| u64::from(r.lkey) == grant.id && r.rkey == grant.rkey)
        else {
            return Err(VerbsError::Invalid("no such grant"));
        };
        let r = self.grants.swap_remove(i);
        // As a deregistration: the entry is withdrawn, then the copies peers had announced
        // on it are waited for, so none lands (or reads) after this returns: however long
        // for the caller's own memory and for any grant a peer may write (revoked outside the
        // runtime's lock: a late write would land in memory that serves again); within
        // `COPY_DRAIN_MAX` for a read-only grant on ours (the engine's staging buffers,
        // revoked under the lock: a late read takes this connection's own bytes, which the
        // reader then discards, `read_still_good`).
        self.inner.deregister(r.lkey, self.drain(r.access, false));
        Ok(())
    }
    fn read(&self, off: usize, dst: &mut [u8]) {
        self.mem.read(off, dst);
    }
    fn write(&mut self, off: usize, src: &[u8]) {
        self.mem.write(off, src);
    }
}

impl ShmMr {
    /// How a withdrawal of a grant or region with `access` treats peers' copies in flight
    /// (`Drain`); `end`: the region itself goes. The caller's memory (`reg_mr_at`) is waited
    /// for until they end, since it goes back to the caller; ours at its end not at all (parked
    /// instead); a grant of ours a peer may write until they end; any other grant of ours
    /// within `COPY_DRAIN_MAX`.
    fn drain(&self, access: Access, end: bool) -> Drain {
        if self._map.is_none() {
            Drain::Unbounded
        } else if end {
            Drain::Collect
        } else if access.contains(Access::REMOTE_WRITE) {
            Drain::Unbounded
        } else {
            Drain::Bounded
        }
    }
}

impl Drop for ShmMr {
    fn drop(&mut self) {
        // Deregister (under the write lock) before the memory goes away, grants first. Our
        // own memory waits for no peer: if a copy that may touch it is still under way (a
        // peer stopped in the middle of one), it is parked until that ends, never reused
        // before; the caller's is waited for (it goes back to the caller).
        let how = self.drain(self.reg.access, true);
        let mut lingers = Vec::new();
        for r in std::mem::take(&mut self.grants) {
            lingers.extend(self.inner.deregister(r.lkey, how));
        }
        lingers.extend(self.inner.deregister(self.reg.lkey, how));
        if let Some(m) = self._map.take() {
            if lingers.is_empty() {
                // No peer reaches it any more: its memory may serve a new region, under new
                // keys.
                self.inner.recycle_map(m);
            } else {
                self.inner.park(m, lingers);
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QpState {
    /// Active side waiting for the ACC.
    Connecting,
    /// Passive side, neither accepted nor rejected.
    Pending,
    Ready,
    Error,
}

/// One connection: CM id, RC queue pair and completion queue.
pub struct ShmEndpoint {
    inner: Arc<Inner>,
    ctl: Arc<Ctl>,
    token: usize,
    sock: Option<OwnedFd>,
    state: QpState,
    /// Passive side accepted, waiting for the RTU.
    await_rtu: bool,
    /// Acceptor of a request another process's listener handed over (a shared listener's):
    /// established at its ACC, not at the RTU (`accept`).
    early: bool,
    active: bool,
    caps: QpCaps,
    local: SocketAddr,
    peer_addr: SocketAddr,
    /// The peer process (pidfd), from the handshake's socket (its pid is `peer_pid`).
    peer_proc: Option<Arc<Proc>>,
    /// Our last `OFF_INFLIGHT` value in the peer's inbox.
    copy_seq: u32,
    inbox: Arc<Mapping>,
    inbox_fd: Option<OwnedFd>,
    nslots: u32,
    peer: Option<Peer>,
    recvs: VecDeque<RecvWr>,
    rq_head: u32,
    rq_done: u32,
    sq_tail: u32,
    /// Bytes of the peer's inline ring we took (`ring_alloc`).
    ring_head: u32,
    /// Bytes of our inline ring we took back from the peer's SENDs (`OFF_RING_TAIL`).
    ring_tail: u32,
    pending: VecDeque<SendWr>,
    /// During `post_send_inline`: the caller's payload (address, length), valid for that call.
    inline_now: Option<(u64, u32)>,
    /// Inline payloads of SENDs that could not go during their post (queued behind others,
    /// or no receive posted): our copies, by work request id, until the SEND leaves `pending`.
    inline_kept: Vec<(u64, Box<[u8]>)>,
    rnr_since: Option<Instant>,
    rnr_counted: bool,
    cq: VecDeque<Completion>,
    cm: VecDeque<CmEvent>,
    /// When the peer's socket was last checked (`sys::coarse_ms`).
    last_check_ms: u64,
    /// Connector: when the listener said it handed our request on (`M_HND`); 0: it did not.
    handed_ms: u64,
    /// Generation of our last shared copy (`assist`).
    assist_gen: u32,
    /// The first queued send's shared copy, waiting for the peer's chunks.
    copying: Option<Copying>,
    /// When the peer asked us to pause (`M_SUSP`: it moves to another process; coarse ms, 0:
    /// it did not). From then on no copy of ours into or out of its memory starts; answered
    /// (`M_SUSP_ACK`, `paused`) once none is under way; over at its `M_MOVED`.
    pause_asked_ms: u64,
    paused: bool,
    /// We move (`pause_peer`): the peer answered that it paused.
    peer_paused: bool,
    /// The peer's process ended settled (`PeerEndedSettled` reported): what is posted from
    /// now on fails the endpoint.
    peer_ended: bool,
    /// The peer's `OFF_TAIL` once our latest solicited SEND (data, or an offer of it) is in
    /// its ring (0: none yet).
    solicited_tail: u32,
}

impl std::fmt::Debug for ShmEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmEndpoint")
            .field("local", &self.local)
            .field("peer", &self.peer_addr)
            .field("state", &self.state)
            .finish()
    }
}

fn opcode(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Send => WcOpcode::Send,
        SendOp::Write(_) => WcOpcode::RdmaWrite,
        SendOp::Read(_) => WcOpcode::RdmaRead,
    }
}

fn wc(wr: &SendWr, status: WcStatus) -> Completion {
    Completion {
        wr_id: wr.wr_id,
        status,
        opcode: opcode(&wr.op),
        byte_len: 0,
    }
}

enum Exec {
    Done(Option<Completion>),
    Rnr,
    Fail(Completion),
    /// A shared copy whose peer chunks are not done yet: the WR stays first in the queue and
    /// completes once they are (`ShmEndpoint::run_sends`).
    Wait(Copying),
}

/// A shared copy (`assist`) waiting for the chunks the peer claimed, and what completes the
/// work request once they are done.
#[derive(Debug)]
struct Copying {
    pending: assist::Pending,
    /// SEND: the peer's slot to publish and the message length; else the bytes read or written.
    then: Then,
}

#[derive(Debug, Clone, Copy)]
enum Then {
    Send {
        base: usize,
        len: u32,
    },
    /// `rb`: the peer's range, looked up again after a Read (`Peer::covers`).
    Rdma {
        len: u32,
        read: bool,
        rb: RemoteBuf,
    },
}

/// After a Read's copy: the source must still be advertised, as it was when we looked before
/// it. A source withdrawn meanwhile (its owner gave up waiting for us: we were stopped between
/// that look and our copy's system call longer than `COPY_DRAIN_MAX`) may have been changed
/// under the copy: its bytes are not delivered (RemoteAccess), never delivered torn.
fn read_still_good(peer: &Peer, read: bool, rb: RemoteBuf, len: u32) -> Result<(), WcStatus> {
    if !read || peer.covers(rb, len, Access::REMOTE_READ) {
        Ok(())
    } else {
        Err(WcStatus::RemoteAccess)
    }
}

/// How a published SEND wakes its receiver: its reader (`SendWr::solicited`), its engine too
/// (`SendWr::wake_engine`).
#[derive(Debug, Clone, Copy)]
struct Wake {
    reader: bool,
    engine: bool,
}

impl Wake {
    fn of(wr: &SendWr) -> Wake {
        Wake {
            reader: wr.solicited,
            engine: wr.wake_engine,
        }
    }
}

/// A SEND's data is in the peer's receive (or failed to get there): publish the slot's result
/// and status, then the new tail, and wake the peer.
fn publish_send(
    peer: &Peer,
    sq_tail: &mut u32,
    base: usize,
    len: u32,
    wake: Wake,
    r: std::io::Result<()>,
) -> Result<(), WcStatus> {
    let (status, ret) = match r {
        Ok(()) => (ST_OK, Ok(())),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
            (ST_REM_OP, Err(WcStatus::RetryExceeded))
        }
        Err(_) => (ST_REM_OP, Err(WcStatus::Other(WC_REM_OP_ERR))),
    };
    publish_slot(peer, sq_tail, base, len, wake, status);
    ret
}

/// Publish one slot of the peer's inbox (result, status), then the tail; wake the peer as
/// `wake` says.
fn publish_slot(peer: &Peer, sq_tail: &mut u32, base: usize, len: u32, wake: Wake, status: u32) {
    let ib = &peer.inbox;
    ib.u32(base + S_RESULT).store(len, Ordering::Relaxed);
    ib.u32(base + S_STATUS).store(status, Ordering::Relaxed);
    *sq_tail = sq_tail.wrapping_add(1);
    ib.u32(OFF_TAIL).store(*sq_tail, Ordering::Release);
    if wake.reader && matches!(status, ST_OK | ST_INLINE | ST_RING) {
        peer.wake_solicited(wake.engine);
    } else {
        peer.wake();
    }
    // This slot's wakeup is over (its byte, if any, is in the socket): an owner that took it
    // and settles (`Endpoint::direct_settler`) before it takes tokens back never has our byte
    // land after, announcing nothing.
    ib.u32(OFF_DIRECT_DONE).store(*sq_tail, Ordering::Release);
}

/// Copy a SEND's local memory (its SGE, then the gathered payload) into the peer's inbox `ib`
/// at `at`, where the slot's inline bytes or the inline ring put it.
///
/// # Safety
/// Every local range of `wr` must lie in a live registration (the registrations' read lock
/// held), never in `ib`.
unsafe fn gather_into(ib: &Mapping, mut at: usize, wr: &SendWr) {
    for s in [wr.sge, wr.payload].into_iter().flatten() {
        // SAFETY: the caller's contract.
        unsafe { ib.write_from_addr(at, s.addr, s.len as usize) };
        at += s.len as usize;
    }
}

/// Room for a SEND of `len` bytes in the peer's inline ring, if it is one the ring takes and
/// the owner has taken back enough of what we put there: (offset in the ring, ring bytes it
/// takes). A message never wraps: one that would is put at the ring's start, and the end it
/// skips counts as taken.
fn ring_alloc(peer: &Peer, head: &mut u32, len: u32) -> Option<(usize, u32)> {
    let len = len as usize;
    if len <= INLINE_MAX || len > RING_MSG_MAX {
        return None;
    }
    let tail = peer.inbox.u32(OFF_RING_TAIL).load(Ordering::Acquire);
    let in_use = head.wrapping_sub(tail) as usize;
    let pos = *head as usize % RING_LEN;
    let n = len.next_multiple_of(RING_ALIGN);
    let (off, need) = if pos + n <= RING_LEN {
        (pos, n)
    } else {
        (0, RING_LEN - pos + n)
    };
    // (An owner that reports more taken back than we put there is confused: no ring.)
    if in_use > RING_LEN || need > RING_LEN - in_use {
        return None;
    }
    *head = head.wrapping_add(need as u32);
    Some((off, need as u32))
}

/// A work request that went through: its completion if it asked for one.
fn succeeded(wr: &SendWr, byte_len: u32) -> Exec {
    Exec::Done(wr.signaled.then_some(Completion {
        wr_id: wr.wr_id,
        status: WcStatus::Success,
        opcode: opcode(&wr.op),
        byte_len,
    }))
}

/// What a finished RDMA Read or Write completes with.
fn rdma_result(r: std::io::Result<()>) -> Result<(), WcStatus> {
    match r {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Err(WcStatus::RetryExceeded),
        Err(_) => Err(WcStatus::RemoteAccess),
    }
}

impl ShmEndpoint {
    #[allow(clippy::too_many_arguments)]
    fn new(
        inner: Arc<Inner>,
        peer: Option<Peer>,
        inbox: Arc<Mapping>,
        inbox_fd: Option<OwnedFd>,
        nslots: u32,
        caps: QpCaps,
        local: SocketAddr,
        peer_addr: SocketAddr,
        active: bool,
    ) -> Result<ShmEndpoint, VerbsError> {
        let ctl = Arc::new(Ctl {
            hint: AtomicBool::new(false),
            inbox: Some(inbox.clone()),
            nslots,
            peer: parking_lot::Mutex::new(peer.as_ref().map(|p| p.proc.clone())),
        });
        let token = inner.add_ctl(&ctl, None)?;
        Ok(ShmEndpoint {
            inner,
            ctl,
            token,
            sock: None,
            state: if active {
                QpState::Connecting
            } else {
                QpState::Pending
            },
            await_rtu: false,
            early: false,
            active,
            caps,
            local,
            peer_addr,
            peer_proc: peer.as_ref().map(|p| p.proc.clone()),
            copy_seq: 0,
            inbox,
            inbox_fd,
            nslots,
            peer,
            recvs: VecDeque::new(),
            rq_head: 0,
            rq_done: 0,
            sq_tail: 0,
            ring_head: 0,
            ring_tail: 0,
            pending: VecDeque::new(),
            inline_now: None,
            inline_kept: Vec::new(),
            rnr_since: None,
            rnr_counted: false,
            cq: VecDeque::new(),
            cm: VecDeque::new(),
            last_check_ms: sys::coarse_ms(),
            handed_ms: 0,
            assist_gen: 0,
            copying: None,
            pause_asked_ms: 0,
            paused: false,
            peer_paused: false,
            peer_ended: false,
            solicited_tail: 0,
        })
    }

    /// Whether the queue pair is connected and usable.
    pub fn is_ready(&self) -> bool {
        self.state == QpState::Ready
    }

    /// Receives posted and not yet consumed.
    pub fn posted_recvs(&self) -> usize {
        self.recvs.len()
    }

    /// The peer's process id (0 before the connection is set up).
    pub fn peer_pid(&self) -> i32 {
        self.peer_proc.as_ref().map_or(0, |p| p.pid())
    }

    /// A message of `kind` after the handshake, with our address and `probe`.
    fn plain_msg(&self, kind: u8, probe: u64) -> Vec<u8> {
        encode(&Msg {
            kind,
            consumer: false,
            bell: NO_BELL,
            nslots: 0,
            probe,
            addr: self.local,
            pd: &[],
        })
    }

    /// The peer asked us to pause (`M_SUSP`): answer once no copy of ours is under way (a
    /// shared copy waits for its chunks first); a mover that does not say where it went
    /// within `ShmConfig::move_wait` is taken as gone.
    fn pause_step(&mut self) {
        if self.pause_asked_ms == 0 || self.state != QpState::Ready {
            return;
        }
        if !self.paused && self.copying.is_none() {
            let Some(s) = self.sock.as_ref() else {
                return self.fail(None);
            };
            // Its M_MOVED must bring the credentials of the process that sends it.
            if sys::set_passcred(s.as_fd()).is_err() || !send_simple(s, M_SUSP_ACK, false, &[]) {
                return self.fail(None);
            }
            self.paused = true;
        }
        let waited = sys::coarse_ms().saturating_sub(self.pause_asked_ms);
        if waited > self.inner.cfg.move_wait.as_millis() as u64 {
            // As for a peer that died: a reset.
            self.pause_asked_ms = 0;
            self.paused = false;
            self.fail(None);
        }
    }

    /// The mover's `M_MOVED` (`cred`: the sender's pid and uid, as the kernel gave them):
    /// a process of our user that holds the connection's socket and whose memory we reach at
    /// the probe address, as at the handshake, becomes the peer; copies resume.
    fn take_mover(&mut self, cred: Option<(i32, u32)>, probe: u64) -> Result<(), ()> {
        let (pid, uid) = cred.ok_or(())?;
        if uid != self.inner.uid || pid <= 0 || !self.paused {
            return Err(());
        }
        let p = Proc::open(pid).map_err(|_| ())?;
        if !matches!(sys::probe(&p, probe), Ok(true)) {
            return Err(());
        }
        let p = self.inner.shared_proc(p);
        self.peer_proc = Some(p.clone());
        self.ctl.set_peer(p.clone());
        if let Some(peer) = self.peer.as_mut() {
            peer.proc = p;
        }
        self.pause_asked_ms = 0;
        self.paused = false;
        Ok(())
    }

    /// Our inbox was just marked closed (a peer looks at the state after announcing a copy, so
    /// none starts after): note the peer's copy in flight into our memory, if any, for the
    /// regions it may touch (`Inner::lingering`).
    fn drain_own(&self) {
        fence(Ordering::SeqCst);
        let w = self.inbox.u32(OFF_INFLIGHT);
        let v = w.load(Ordering::Relaxed);
        if v & 1 == 1 {
            // Not waited for here (under the runtime's lock): the regions it may touch, let go
            // later, wait for it or are parked behind it (`Inner::lingering`).
            // (One note per connection: its teardown is the one place that settles a dead
            // peer's count, `Linger::settle`.)
            self.inner.linger(Linger {
                inbox: self.inbox.clone(),
                until: Until::Moves(v),
                key: self.inbox.u32(OFF_INFLIGHT_KEY).load(Ordering::Relaxed),
                peer: self.peer_proc.clone(),
            });
        }
    }

    /// Completions or events appeared locally (not through the peer): if the owner armed,
    /// make the notify fd readable, so the arm-poll-sleep protocol loses nothing.
    fn self_notify(&self) {
        signal_if_armed(&self.inner.bells, self.inner.evfd.as_fd());
    }

    /// Tell the attached peer that receives were posted: wake it if a SEND of its found none
    /// and asked (`OFF_RNR`), else only ring its bell. Only a peer whose SENDs wait for a
    /// receive needs waking; SDP's credits keep that rare, and a wakeup per reposted receive
    /// cost the peer's progress thread a round per message. Called after `post_recv` and when
    /// the peer is attached at its RTU (receives posted before then told nobody).
    fn tell_receives(&self) {
        let Some(p) = &self.peer else { return };
        fence(Ordering::SeqCst);
        let w = self.inbox.u32(OFF_RNR);
        if w.load(Ordering::Relaxed) != 0 {
            w.store(0, Ordering::Relaxed);
            p.wake();
        } else {
            p.ring();
        }
    }

    /// Execute one send-queue WR now if possible.
    fn exec(&mut self, wr: &SendWr) -> Exec {
        let Some(peer) = self.peer.as_ref() else {
            return Exec::Fail(wc(wr, WcStatus::Flushed));
        };
        if peer.closed() {
            return Exec::Fail(wc(wr, WcStatus::Flushed));
        }
        let len = wr.sge.map_or(0, |s| s.len) + wr.payload.map_or(0, |s| s.len);
        if wr.payload.is_some() && (wr.sge.is_none() || wr.op != SendOp::Send) {
            // A gathered payload is for SENDs only, after a first SGE.
            return Exec::Fail(wc(wr, WcStatus::LocalProtection));
        }
        // An inline payload (`post_send_inline`): the caller's bytes during its call, or our
        // copy of them.
        let inline_ok = wr.op == SendOp::Send
            && wr.payload.is_some_and(|p| {
                p.lkey == INLINE_LKEY
                    && (self.inline_now == Some((p.addr, p.len))
                        || self.inline_kept.iter().any(|(id, b)| {
                            *id == wr.wr_id
                                && b.as_ptr() as u64 == p.addr
                                && b.len() == p.len as usize
                        }))
            });
        let regs = self.inner.regs.read();
        let local_ok = |need: Access| {
            wr.sge.iter().all(|s| s.len == 0 || regs.check(s, need))
                && wr
                    .payload
                    .iter()
                    .all(|s| s.len == 0 || inline_ok || regs.check(s, need))
        };
        let done = |byte_len: u32| succeeded(wr, byte_len);
        match wr.op {
            SendOp::Send => {
                if !local_ok(Access::empty()) {
                    return Exec::Fail(wc(wr, WcStatus::LocalProtection));
                }
                let mut head = peer.inbox.u32(OFF_HEAD).load(Ordering::Acquire);
                if head == self.sq_tail {
                    // Ask the owner to wake us when it posts receives, then look once more:
                    // it may have posted between our look and our ask (`post_recv`).
                    peer.inbox.u32(OFF_RNR).store(1, Ordering::Relaxed);
                    fence(Ordering::SeqCst);
                    head = peer.inbox.u32(OFF_HEAD).load(Ordering::Acquire);
                    if head == self.sq_tail {
                        return Exec::Rnr;
                    }
                }
                let avail = head.wrapping_sub(self.sq_tail);
                if avail > peer.nslots {
                    return Exec::Fail(wc(wr, WcStatus::Other(WC_REM_OP_ERR)));
                }
                let base = HDR + (self.sq_tail % peer.nslots) as usize * SLOT;
                if wr.solicited {
                    // (The peer's tail once this SEND is there: `peer_gone`.)
                    self.solicited_tail = self.sq_tail.wrapping_add(1);
                }
                let ib = &peer.inbox;
                let raddr = ib.u64(base + S_ADDR).load(Ordering::Relaxed);
                let rlen = ib.u32(base + S_LEN).load(Ordering::Relaxed);
                let bad = ib.u32(base + S_BAD).load(Ordering::Relaxed) != 0;
                let (status, ret) = if bad {
                    (ST_REM_OP, Err(WcStatus::Other(WC_REM_OP_ERR)))
                } else if len > rlen {
                    (ST_LEN_ERR, Err(WcStatus::Other(WC_REM_INV_REQ_ERR)))
                } else if len as usize <= INLINE_MAX {
                    // SAFETY: the local ranges lie inside live registrations (checked above
                    // under the read lock we still hold; deregistration takes the write lock),
                    // or are an inline payload: the caller's bytes during `post_send_inline`,
                    // or our copy of them (`inline_ok`).
                    unsafe { gather_into(ib, base + S_INLINE, wr) };
                    (ST_INLINE, Ok(()))
                } else if let Some((off, used)) = ring_alloc(peer, &mut self.ring_head, len) {
                    // SAFETY: as for the inline copy just above.
                    unsafe { gather_into(ib, ring_base(peer.nslots) + off, wr) };
                    ib.u32(base + S_RING_OFF)
                        .store(off as u32, Ordering::Relaxed);
                    ib.u32(base + S_RING_USED).store(used, Ordering::Relaxed);
                    self.inner.ring_sends.fetch_add(1, Ordering::Relaxed);
                    (ST_RING, Ok(()))
                } else {
                    let s = wr.sge.expect("len > 0 has an sge");
                    let mut copy = InFlight::begin(ib, &peer.prov.bells, 0, &mut self.copy_seq);
                    // Announced: now the receive must still be good (the owner marks the
                    // receives of a region it deregisters bad) and the peer open. The copy's
                    // system call ends the announcement (`Peer::end_write`).
                    let still_ok =
                        || !peer.closed() && ib.u32(base + S_BAD).load(Ordering::Relaxed) == 0;
                    let end = peer.end_write();
                    // SAFETY: the local ranges are inside live registrations (read lock held)
                    // or an inline payload (as for the inline copy above).
                    let r = unsafe {
                        if !still_ok() {
                            Err(std::io::Error::from_raw_os_error(libc::EACCES))
                        } else if let Some(p) = wr.payload {
                            // Gathered: header, then payload right after it, in one copy.
                            peer.proc.write_two(
                                (s.addr, s.len as usize),
                                (p.addr, p.len as usize),
                                raddr,
                                end,
                            )
                        } else if len as usize >= assist::ASSIST_MIN_SEND {
                            // Asks the peer's help (`start_shared` rings its bell): its next round
                            // looks at this connection.
                            match assist::start_shared(
                                &self.inbox,
                                &mut self.assist_gen,
                                &|| peer.ring(),
                                &peer.proc,
                                self.sock.as_ref().map(|s| s.as_fd()),
                                &mut || {
                                    copy.again();
                                    still_ok()
                                },
                                end,
                                assist::Op::Send,
                                0,
                                s.addr,
                                raddr,
                                len as usize,
                            ) {
                                assist::Started::Done(r) => r,
                                assist::Started::Waiting(pending) => {
                                    return Exec::Wait(Copying {
                                        pending,
                                        then: Then::Send { base, len },
                                    });
                                }
                            }
                        } else {
                            peer.proc.write(s.addr, raddr, len as usize, end)
                        }
                    };
                    drop(copy);
                    let ret = publish_send(peer, &mut self.sq_tail, base, len, Wake::of(wr), r);
                    match ret {
                        Ok(()) => return done(len),
                        Err(st) => return Exec::Fail(wc(wr, st)),
                    }
                };
                publish_slot(peer, &mut self.sq_tail, base, len, Wake::of(wr), status);
                match ret {
                    Ok(()) => done(len),
                    Err(st) => Exec::Fail(wc(wr, st)),
                }
            }
            SendOp::Write(rb) | SendOp::Read(rb) => {
                let is_read = matches!(wr.op, SendOp::Read(_));
                let need_local = if is_read {
                    Access::LOCAL_WRITE
                } else {
                    Access::empty()
                };
                if !local_ok(need_local) {
                    return Exec::Fail(wc(wr, WcStatus::LocalProtection));
                }
                if len == 0 {
                    return done(0);
                }
                let need = if is_read {
                    Access::REMOTE_READ
                } else {
                    Access::REMOTE_WRITE
                };
                let mut copy =
                    InFlight::begin(&peer.inbox, &peer.prov.bells, rb.rkey, &mut self.copy_seq);
                // The copy's system call ends the announcement (`Peer::end_read`/`end_write`).
                let end = if is_read {
                    peer.end_read()
                } else {
                    peer.end_write()
                };
                // Announced before the key is looked up: a deregistration or revocation that
                // we miss here waits for our copy (`Inner::drain_copies`); a large copy looks
                // again before each of its chunks.
                let still_ok = || peer.may_copy(rb, len, need);
                if !still_ok() {
                    return Exec::Fail(wc(wr, WcStatus::RemoteAccess));
                }
                let s = wr.sge.expect("len > 0 has an sge");
                // SAFETY: the local range is inside a live registration (read lock held),
                // with LOCAL_WRITE for a Read.
                let r = unsafe {
                    if len as usize >= assist::ASSIST_MIN {
                        match assist::start_shared(
                            &self.inbox,
                            &mut self.assist_gen,
                            &|| peer.ring(),
                            &peer.proc,
                            self.sock.as_ref().map(|s| s.as_fd()),
                            &mut || {
                                copy.again();
                                still_ok()
                            },
                            end,
                            if is_read {
                                assist::Op::Read
                            } else {
                                assist::Op::Write
                            },
                            rb.rkey,
                            s.addr,
                            rb.addr,
                            len as usize,
                        ) {
                            assist::Started::Done(r) => r,
                            assist::Started::Waiting(pending) => {
                                if is_read {
                                    // The peer's chunks write into our buffer until they are
                                    // done: its region, if let go meanwhile (the connection
                                    // torn down), waits for them or is parked behind them.
                                    self.inner.linger(Linger {
                                        inbox: self.inbox.clone(),
                                        until: Until::Counts {
                                            gen: self.assist_gen,
                                            n: pending.theirs(),
                                        },
                                        key: s.lkey | 0x8000_0000,
                                        peer: self.peer_proc.clone(),
                                    });
                                }
                                return Exec::Wait(Copying {
                                    pending,
                                    then: Then::Rdma {
                                        len,
                                        read: is_read,
                                        rb,
                                    },
                                });
                            }
                        }
                    } else if is_read {
                        peer.proc.read(s.addr, rb.addr, len as usize, end)
                    } else {
                        peer.proc.write(s.addr, rb.addr, len as usize, end)
                    }
                };
                drop(copy);
                match rdma_result(r).and_then(|()| read_still_good(peer, is_read, rb, len)) {
                    Ok(()) => done(len),
                    Err(st) => Exec::Fail(wc(wr, st)),
                }
            }
        }
    }

    /// The first queued send's shared copy: its completion once the peer's chunks are done,
    /// `None` (and still waiting) before.
    fn finish_copy(&mut self, wr: &SendWr) -> Option<Exec> {
        let mut c = self.copying.take()?;
        let sock = self.sock.as_ref().map(|s| s.as_fd());
        let Some(r) = c.pending.poll(&self.inbox, sock) else {
            self.copying = Some(c);
            return None;
        };
        let ret = match c.then {
            Then::Send { base, len } => match self.peer.as_ref() {
                Some(peer) => {
                    publish_send(peer, &mut self.sq_tail, base, len, Wake::of(wr), r).map(|()| len)
                }
                None => Err(WcStatus::Flushed),
            },
            Then::Rdma { len, read, rb } => match self.peer.as_ref() {
                Some(peer) => rdma_result(r)
                    .and_then(|()| read_still_good(peer, read, rb, len))
                    .map(|()| len),
                None => Err(WcStatus::Flushed),
            },
        };
        Some(match ret {
            Ok(len) => succeeded(wr, len),
            Err(st) => Exec::Fail(wc(wr, st)),
        })
    }

    /// Run queued sends in order until one must wait for a receive or for the peer's share
    /// of a copy.
    fn run_sends(&mut self) {
        if self.peer_ended && !self.pending.is_empty() {
            // Nobody takes them: the peer's process is gone (its end was settled).
            self.fail(None);
            self.self_notify();
            return;
        }
        while let Some(wr) = self.pending.front().copied() {
            // Acceptor before the RTU (the connector's fds): sends wait.
            if self.state != QpState::Ready || self.peer.is_none() {
                break;
            }
            if self.pause_asked_ms != 0 && self.copying.is_none() {
                // The peer moves: nothing new into or out of its memory until it says where.
                break;
            }
            let ex = if self.copying.is_some() {
                match self.finish_copy(&wr) {
                    Some(ex) => ex,
                    None => break,
                }
            } else {
                self.exec(&wr)
            };
            match ex {
                Exec::Wait(c) => {
                    self.copying = Some(c);
                    break;
                }
                Exec::Done(c) => {
                    self.pending.pop_front();
                    self.rnr_since = None;
                    if let Some(c) = c {
                        self.cq.push_back(c);
                    }
                }
                Exec::Rnr => {
                    let since = *self.rnr_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= self.inner.cfg.rnr_timeout {
                        self.pending.pop_front();
                        self.fail(Some(wc(&wr, WcStatus::RnrRetryExceeded)));
                    }
                    break;
                }
                Exec::Fail(c) => {
                    self.pending.pop_front();
                    // `RetryExceeded` is what `exec` makes of ESRCH: the peer's process is
                    // gone (its memory goes before its fds close, so the rendezvous socket
                    // may not have hung up yet). Like a peer that closed: a reset, as TCP's
                    // kernel gives for a killed process, not a timeout.
                    let gone = c.status == WcStatus::RetryExceeded;
                    if gone || self.peer.as_ref().is_some_and(|p| p.closed()) {
                        // The peer went away: like a QP error from the other side.
                        self.pending.push_front(wr);
                        self.peer_closed();
                    } else {
                        self.fail(Some(c));
                    }
                    break;
                }
            }
        }
        self.forget_kept();
        // (Sends that wait for the RTU need no retry timer: the RTU is news on our socket.)
        let waiting =
            !self.pending.is_empty() && self.state == QpState::Ready && self.peer.is_some();
        if waiting != self.rnr_counted {
            self.rnr_counted = waiting;
            if waiting {
                self.inner.rnr_waiting.fetch_add(1, Ordering::Relaxed);
            } else {
                self.inner.rnr_waiting.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Let go of our copies of inline payloads whose SENDs left `pending`.
    fn forget_kept(&mut self) {
        if !self.inline_kept.is_empty() {
            let p = &self.pending;
            self.inline_kept
                .retain(|(id, _)| p.iter().any(|w| w.wr_id == *id));
        }
    }

    /// Turn receives the peer filled into completions. `Err` if the peer broke the protocol
    /// or a receive failed (the QP must go to error).
    fn harvest(&mut self) -> Result<(), ()> {
        let tail = self.inbox.u32(OFF_TAIL).load(Ordering::Acquire);
        let n = tail.wrapping_sub(self.rq_done);
        if n == 0 {
            return Ok(());
        }
        if n > self.rq_head.wrapping_sub(self.rq_done) {
            return Err(());
        }
        let regs = self.inner.regs.read();
        let mut ring_taken = false;
        for _ in 0..n {
            let base = HDR + (self.rq_done % self.nslots) as usize * SLOT;
            let status = self.inbox.u32(base + S_STATUS).load(Ordering::Relaxed);
            let result = self.inbox.u32(base + S_RESULT).load(Ordering::Relaxed);
            let Some(wr) = self.recvs.pop_front() else {
                return Err(());
            };
            self.rq_done = self.rq_done.wrapping_add(1);
            let mut c = Completion {
                wr_id: wr.wr_id,
                status: WcStatus::Success,
                opcode: WcOpcode::Recv,
                byte_len: result,
            };
            let ok = match status {
                ST_OK => result <= wr.sge.len,
                ST_INLINE => {
                    let n = result as usize;
                    if n <= INLINE_MAX
                        && result <= wr.sge.len
                        && regs.check(&wr.sge, Access::LOCAL_WRITE)
                    {
                        // SAFETY: the receive buffer is inside a live registration with
                        // LOCAL_WRITE (checked under the read lock we hold), never our inbox.
                        unsafe { self.inbox.read_to_addr(base + S_INLINE, wr.sge.addr, n) };
                        true
                    } else {
                        false
                    }
                }
                ST_RING => {
                    let n = result as usize;
                    let off = self.inbox.u32(base + S_RING_OFF).load(Ordering::Relaxed) as usize;
                    let used = self.inbox.u32(base + S_RING_USED).load(Ordering::Relaxed);
                    if n <= RING_MSG_MAX
                        && off + n <= RING_LEN
                        && (n..=RING_LEN).contains(&(used as usize))
                        && result <= wr.sge.len
                        && regs.check(&wr.sge, Access::LOCAL_WRITE)
                    {
                        // SAFETY: the receive buffer is inside a live registration with
                        // LOCAL_WRITE (checked under the read lock we hold), never our inbox.
                        unsafe {
                            self.inbox
                                .read_to_addr(ring_base(self.nslots) + off, wr.sge.addr, n)
                        };
                        self.ring_tail = self.ring_tail.wrapping_add(used);
                        ring_taken = true;
                        true
                    } else {
                        false
                    }
                }
                _ => false,
            };
            if !ok {
                c.status = WcStatus::LocalProtection;
                c.byte_len = 0;
                self.cq.push_back(c);
                return Err(());
            }
            self.cq.push_back(c);
        }
        if ring_taken {
            // Copied out: the sender may use the space again.
            self.inbox
                .u32(OFF_RING_TAIL)
                .store(self.ring_tail, Ordering::Release);
        }
        Ok(())
    }

    /// Move to the error state: report `first`, flush everything else, tell the peer.
    fn fail(&mut self, first: Option<Completion>) {
        if self.state == QpState::Error {
            if let Some(c) = first {
                self.cq.push_back(c);
            }
            return;
        }
        let was = self.state;
        if let Some(c) = first {
            self.cq.push_back(c);
        }
        self.state = QpState::Error;
        // A shared RDMA Read whose peer chunks are not done: the peer may still write into our
        // buffer, so its WR is flushed only once they are (`progress`, or the drop waits). A
        // SEND's or a Write's peer chunks only read our buffer, into the peer's own memory,
        // and the SEND's slot is never published: they are let go.
        let keep = match &self.copying {
            Some(Copying {
                then: Then::Rdma { read: true, .. },
                ..
            }) => self.pending.pop_front(),
            _ => {
                self.copying = None;
                None
            }
        };
        for wr in std::mem::take(&mut self.pending) {
            self.cq.push_back(wc(&wr, WcStatus::Flushed));
        }
        self.pending.extend(keep);
        self.forget_kept();
        for wr in std::mem::take(&mut self.recvs) {
            self.cq.push_back(Completion {
                wr_id: wr.wr_id,
                status: WcStatus::Flushed,
                opcode: WcOpcode::Recv,
                byte_len: 0,
            });
        }
        if self.rnr_counted {
            self.rnr_counted = false;
            self.inner.rnr_waiting.fetch_sub(1, Ordering::Relaxed);
        }
        self.inbox.u32(OFF_STATE).store(1, Ordering::Release);
        self.drain_own();
        if let Some(s) = &self.sock {
            send_simple(s, M_DISC, false, &[]);
        }
        if let Some(p) = &self.peer {
            p.wake();
        }
        if was == QpState::Ready {
            // An acceptor still waiting for the RTU was never established, unless early
            // (Established at `accept`).
            let never = self.await_rtu && !self.early;
            self.await_rtu = false;
            self.cm.push_back(if never {
                CmEvent::ConnectError
            } else {
                CmEvent::Disconnected
            });
        }
    }

    /// The peer's process is gone (its end of the socket hung up without a DISC): if its side
    /// was settled (`OFF_SETTLED`) with every solicited SEND of ours taken (a credit update or
    /// an acknowledgement it did not take yet is TCP's ACK arriving at a closed socket, no
    /// unread data) and none of ours waits to go, the engine hears `PeerEndedSettled` after
    /// what the peer completed, and the endpoint stays up until something is posted (which
    /// fails it: `run_sends`); otherwise as [`ShmEndpoint::peer_closed`].
    fn peer_gone(&mut self) {
        let settled = self.peer.as_ref().is_some_and(|p| {
            let v = p.inbox.u64(OFF_SETTLED).load(Ordering::Acquire);
            let taken = v as u32;
            let tail = p.inbox.u32(OFF_TAIL).load(Ordering::Relaxed);
            // Slots are counted with wrapping u32s (compared as signed distances: a wrap
            // misread only as not settled): `taken` at most `tail`, and our latest solicited
            // SEND's slot among those taken.
            v & SETTLED_BIT != 0
                && tail.wrapping_sub(taken) as i32 >= 0
                && taken.wrapping_sub(self.solicited_tail) as i32 >= 0
        });
        if !settled || self.peer_ended || !self.pending.is_empty() {
            self.peer_closed();
            return;
        }
        if self.harvest().is_err() {
            self.fail(None);
            return;
        }
        self.peer_ended = true;
        self.cm.push_back(CmEvent::PeerEndedSettled);
    }

    /// The peer closed or died: deliver what it completed, then error and flush.
    fn peer_closed(&mut self) {
        // An error is reported by harvest itself; flush the rest either way.
        let _ = self.harvest();
        self.fail(None);
    }

    /// Our bell's number for the handshake.
    fn bell(&self) -> u16 {
        bell_off(self.token).map_or(NO_BELL, |_| self.token as u16)
    }

    fn progress(&mut self) {
        // Silence our bell before looking: a peer's change from now on rings it again.
        if let Some(b) = bell_off(self.token) {
            let bell = self.inner.bells.u32(b);
            if bell.load(Ordering::Relaxed) != 0 {
                bell.store(0, Ordering::Relaxed);
                fence(Ordering::SeqCst);
            }
        }
        if self.state == QpState::Error {
            // A shared Read kept by `fail` until the peer's chunks are done.
            if let Some(wr) = self.pending.front().copied() {
                let sock = self.sock.as_ref().map(|s| s.as_fd());
                let over = match self.copying.as_mut() {
                    Some(c) => c.pending.poll(&self.inbox, sock).is_some(),
                    None => true,
                };
                if over {
                    self.copying = None;
                    self.pending.pop_front();
                    self.cq.push_back(wc(&wr, WcStatus::Flushed));
                }
            }
            return;
        }
        if self.await_rtu {
            // The connector's RTU attaches it, whoever polls first (an early acceptor is in
            // the application's hands already).
            self.check_socket();
            if self.state == QpState::Error {
                return;
            }
        }
        if self.harvest().is_err() {
            self.fail(None);
            return;
        }
        if !self.pending.is_empty() {
            self.run_sends();
        }
        if self.pause_asked_ms != 0 {
            self.pause_step();
        } else {
            self.help_peer();
        }
    }

    /// Take a share of the copy the peer is running against our memory, if any (`assist`).
    fn help_peer(&self) {
        let Some(peer) = self.peer.as_ref() else {
            return;
        };
        if self.state != QpState::Ready || !assist::pending(&peer.inbox) {
            return;
        }
        let regs = self.inner.regs.read();
        let check = |op: assist::Op, rkey: u32, addr: u64, len: u64| match op {
            assist::Op::Read => regs.check_remote(rkey, addr, len, Access::REMOTE_READ),
            assist::Op::Write => regs.check_remote(rkey, addr, len, Access::REMOTE_WRITE),
            // A SEND lands in one of our posted receives (the peer's next slot).
            assist::Op::Send => self.recvs.iter().any(|r| {
                addr >= r.sge.addr
                    && addr
                        .checked_add(len)
                        .is_some_and(|e| e <= r.sge.addr + u64::from(r.sge.len))
                    && regs.check(&r.sge, Access::LOCAL_WRITE)
            }),
        };
        let n = assist::help(&peer.inbox, peer.inbox_va, &peer.proc, &check);
        if n > 0 {
            self.inner
                .assisted
                .fetch_add(u64::from(n), Ordering::Relaxed);
            // The initiator may have left the operation waiting for our chunks: tell it they
            // are done (if it sleeps).
            peer.wake();
        }
    }

    /// Look at the socket: handshake messages, DISC, hang-up.
    fn check_socket(&mut self) {
        let mut buf = [0u8; 512];
        loop {
            let Some(sock) = self.sock.as_ref() else {
                return;
            };
            let mut cred = None;
            match sys::recv_msg_cred(sock.as_fd(), &mut buf, &mut cred) {
                Recv::Empty => return,
                Recv::Eof => {
                    self.sock = None;
                    match self.state {
                        QpState::Connecting => {
                            self.state = QpState::Error;
                            self.cm.push_back(CmEvent::Rejected {
                                private_data: Vec::new(),
                                consumer: false,
                            });
                        }
                        QpState::Pending => {
                            self.state = QpState::Error;
                            self.cm.push_back(CmEvent::ConnectError);
                        }
                        QpState::Ready => self.peer_gone(),
                        QpState::Error => {}
                    }
                    return;
                }
                Recv::Msg(n, fds) => {
                    let Some(m) = decode(&buf[..n]) else {
                        continue;
                    };
                    match (self.state, m.kind) {
                        (QpState::Connecting, M_ACC) => {
                            if m.pd.len() > MAX_PD_ACCEPT {
                                self.abort_connect();
                                return;
                            }
                            let Some(proc) = self.acceptor(cred) else {
                                self.abort_connect();
                                return;
                            };
                            match Peer::attach(&self.inner, proc, &m, fds) {
                                Ok(p) => {
                                    // We reached the acceptor's memory: now our fds, with
                                    // the RTU.
                                    if !self.send_rtu() {
                                        self.abort_connect();
                                        return;
                                    }
                                    self.peer = Some(p);
                                    self.inbox_fd = None;
                                    self.state = QpState::Ready;
                                    self.cm.push_back(CmEvent::Established {
                                        private_data: m.pd.to_vec(),
                                    });
                                }
                                Err(_) => {
                                    self.abort_connect();
                                    return;
                                }
                            }
                        }
                        (QpState::Connecting, M_HND) => {
                            self.handed_ms = sys::coarse_ms().max(1);
                        }
                        (QpState::Connecting, M_REJ) => {
                            self.state = QpState::Error;
                            self.sock = None;
                            let pd = &m.pd[..m.pd.len().min(MAX_PD_REJECT)];
                            self.cm.push_back(CmEvent::Rejected {
                                private_data: pd.to_vec(),
                                consumer: m.consumer,
                            });
                            return;
                        }
                        (QpState::Ready, M_RTU) if self.await_rtu => {
                            let proc = self.peer_proc.clone();
                            match proc
                                .clone()
                                .ok_or_else(String::new)
                                .and_then(|p| Peer::attach(&self.inner, p, &m, fds))
                            {
                                Ok(p) => self.peer = Some(p),
                                Err(_) if proc.is_some_and(|p| p.exits_within(RTU_EXIT_WAIT)) => {
                                    // The connector is gone already: it connected, perhaps
                                    // wrote and closed, and exited before we looked (its
                                    // memory, which the probe reads, goes first). As TCP hands
                                    // such a connection to accept with its data and then EOF,
                                    // it is established, then closed by the peer: what it
                                    // sent is in our own inbox.
                                    self.await_rtu = false;
                                    if !self.early {
                                        self.cm.push_back(CmEvent::Established {
                                            private_data: Vec::new(),
                                        });
                                    }
                                    self.peer_closed();
                                    return;
                                }
                                Err(_) => {
                                    self.fail(None);
                                    return;
                                }
                            }
                            self.await_rtu = false;
                            // A SEND of the connector's may have met none of the receives
                            // posted before now, which woke nobody.
                            self.tell_receives();
                            if !self.early {
                                self.cm.push_back(CmEvent::Established {
                                    private_data: Vec::new(),
                                });
                            }
                            if !self.pending.is_empty() {
                                self.run_sends();
                            }
                        }
                        (QpState::Ready, M_DISC) => self.peer_closed(),
                        (QpState::Ready, M_SUSP) if !self.await_rtu => {
                            self.pause_asked_ms = sys::coarse_ms().max(1);
                            self.pause_step();
                        }
                        (QpState::Ready, M_SUSP_ACK) => self.peer_paused = true,
                        (QpState::Ready, M_MOVED) if self.pause_asked_ms != 0 => {
                            if self.take_mover(cred, m.probe).is_err() {
                                self.fail(None);
                                return;
                            }
                            // What waited for the move: our sends, and the receives we
                            // posted meanwhile (the mover's SENDs may wait for them).
                            self.tell_receives();
                            if !self.pending.is_empty() {
                                self.run_sends();
                            }
                        }
                        (QpState::Ready, M_WAKE) => {
                            if let (Some(p), 1) = (self.peer.as_mut(), fds.len()) {
                                // Out of the application's range of fd numbers at once, as
                                // every fd of ours (a program's double close must not hit it).
                                p.direct =
                                    fds.into_iter().next().and_then(|f| sys::high_owned(f).ok());
                                if let Some(d) = &p.direct {
                                    sys::close_in_fork_child(d.as_fd());
                                }
                            }
                        }
                        (QpState::Pending, M_DISC) => {
                            self.state = QpState::Error;
                            self.cm.push_back(CmEvent::ConnectError);
                        }
                        _ => {}
                    }
                }
            }
        }
    }

    /// Connector: the process that sent the ACC (its credentials, `cred`, as the kernel gave
    /// them). The listener's own process as a rule; another process of ours that shares the
    /// listener (a forked worker) when the listener handed it our request: then ours only if
    /// it runs as our user. `ctl.peer` names it from now on.
    fn acceptor(&mut self, cred: Option<(i32, u32)>) -> Option<Arc<Proc>> {
        let proc = match (cred, self.peer_proc.clone()) {
            (Some((pid, _)), Some(p)) if pid == p.pid() => p,
            (Some((pid, uid)), _) if uid == self.inner.uid && pid > 0 => {
                let p = Proc::open(pid).ok().filter(|p| p.alive())?;
                let p = self.inner.shared_proc(p);
                self.peer_proc = Some(p.clone());
                p
            }
            (Some(_), _) => return None,
            (None, p) => p?,
        };
        self.ctl.set_peer(proc.clone());
        Some(proc)
    }

    /// Connector: the RTU, with our three fds (sent once we probed the acceptor's memory).
    fn send_rtu(&self) -> bool {
        let (Some(s), Some(ib)) = (self.sock.as_ref(), self.inbox_fd.as_ref()) else {
            return false;
        };
        let m = encode(&Msg {
            kind: M_RTU,
            bell: self.bell(),
            consumer: false,
            nslots: self.nslots,
            probe: sys::probe_addr(),
            addr: self.local,
            pd: &[],
        });
        let fds = [
            ib.as_fd(),
            self.inner.evfd.as_fd(),
            self.inner.keys_ro.as_fd(),
            self.inner.bells_fd.as_fd(),
        ];
        sys::send_msg(s.as_fd(), &m, &fds).is_ok()
    }

    /// The ACC was unusable: tell the acceptor and fail the connect.
    fn abort_connect(&mut self) {
        if let Some(s) = self.sock.take() {
            send_simple(&s, M_DISC, false, &[]);
        }
        self.state = QpState::Error;
        self.cm.push_back(CmEvent::ConnectError);
    }
}

impl Endpoint for ShmEndpoint {
    fn post_recv(&mut self, wr: &RecvWr) -> Result<(), VerbsError> {
        if self.state == QpState::Error {
            self.cq.push_back(Completion {
                wr_id: wr.wr_id,
                status: WcStatus::Flushed,
                opcode: WcOpcode::Recv,
                byte_len: 0,
            });
            self.self_notify();
            return Ok(());
        }
        if self.recvs.len() >= self.caps.max_recv_wr.max(1) as usize
            || self.rq_head.wrapping_sub(self.rq_done) >= self.nslots
        {
            return Err(VerbsError::QueueFull("receive queue"));
        }
        // The key table's read lock is held until the receive is published: a deregistration
        // on another thread then either comes first (the check fails, the slot is marked bad
        // here) or marks the slot itself (`mark_bad_recvs` sees the new head), never neither.
        let regs = self.inner.regs.read();
        let valid = regs.check(&wr.sge, Access::LOCAL_WRITE);
        if valid {
            regs.note_posted(wr.sge.lkey, self.token);
        }
        let base = HDR + (self.rq_head % self.nslots) as usize * SLOT;
        let ib = &self.inbox;
        ib.u64(base + S_ADDR).store(wr.sge.addr, Ordering::Relaxed);
        ib.u32(base + S_LEN).store(wr.sge.len, Ordering::Relaxed);
        ib.u32(base + S_BAD)
            .store(u32::from(!valid), Ordering::Relaxed);
        ib.u32(base + S_STATUS).store(0, Ordering::Relaxed);
        self.rq_head = self.rq_head.wrapping_add(1);
        ib.u32(OFF_HEAD).store(self.rq_head, Ordering::Release);
        drop(regs);
        self.recvs.push_back(*wr);
        self.tell_receives();
        Ok(())
    }

    fn post_send(&mut self, wr: &SendWr) -> Result<(), VerbsError> {
        match self.state {
            QpState::Connecting | QpState::Pending => return Err(VerbsError::NotConnected),
            QpState::Error => {
                self.cq.push_back(wc(wr, WcStatus::Flushed));
                self.self_notify();
                return Ok(());
            }
            QpState::Ready => {}
        }
        if self.pending.len() >= self.caps.max_send_wr.max(1) as usize {
            return Err(VerbsError::QueueFull("send queue"));
        }
        self.pending.push_back(*wr);
        self.run_sends();
        // Completions made here are the caller's to poll (`Endpoint::post_send`): waking our
        // own progress thread for them cost a wakeup per message.
        if !self.cm.is_empty() {
            self.self_notify();
        }
        Ok(())
    }

    fn set_settled(&self, settled: bool) {
        // Receives harvested and not taken by the engine yet are not settled.
        let v = if settled
            && self.state == QpState::Ready
            && !self
                .cq
                .iter()
                .any(|c| c.opcode == WcOpcode::Recv && c.status == WcStatus::Success)
        {
            SETTLED_BIT | u64::from(self.rq_done)
        } else {
            0
        };
        let w = self.inbox.u64(OFF_SETTLED);
        if w.load(Ordering::Relaxed) != v {
            w.store(v, Ordering::Release);
        }
    }

    fn inline_max(&self) -> usize {
        // Whatever the peer's receive buffer holds: the copy goes straight from the caller's
        // bytes into it (by the inline ring or `process_vm_writev`).
        INLINE_SEND_MAX
    }

    fn post_send_inline(&mut self, wr: &SendWr, payload: &[u8]) -> Result<(), VerbsError> {
        let p = super::inline_payload(wr, payload, INLINE_SEND_MAX)?;
        let at = |addr: u64| SendWr {
            payload: Some(Sge { addr, ..p }),
            ..*wr
        };
        let w = at(payload.as_ptr() as u64);
        self.inline_now = Some((w.payload.expect("set").addr, p.len));
        let r = self.post_send(&w);
        self.inline_now = None;
        if let Some(q) = self.pending.iter_mut().find(|q| q.wr_id == w.wr_id) {
            // Not gone yet: it goes from our copy of the bytes.
            let kept: Box<[u8]> = payload.into();
            *q = at(kept.as_ptr() as u64);
            self.inline_kept.push((w.wr_id, kept));
        }
        r
    }

    fn poll_inline(&mut self, out: &mut [Completion]) -> usize {
        let n = out.len().min(self.cq.len());
        for (slot, c) in out.iter_mut().zip(self.cq.drain(..n)) {
            *slot = c;
        }
        n
    }

    fn notify_pending(&self) {
        if !self.cq.is_empty() {
            self.self_notify();
        }
    }

    fn give_direct_wake(&mut self, fd: BorrowedFd<'_>) -> bool {
        // (Before the RTU too: the connector was probed before our ACC, which went first on
        // the same socket.)
        let (QpState::Ready, Some(sock)) = (self.state, self.sock.as_ref()) else {
            return false;
        };
        let m = self.plain_msg(M_WAKE, 0);
        sys::send_msg(sock.as_fd(), &m, &[fd]).is_ok()
    }

    fn direct_settler(&self) -> Option<Box<dyn FnOnce() + Send>> {
        // Only the wakeups of the SENDs we took: a peer streaming more is not waited for.
        let took = self.rq_done;
        let past = move |done: u32| done.wrapping_sub(took) as i32 >= 0;
        if past(self.inbox.u32(OFF_DIRECT_DONE).load(Ordering::Acquire)) {
            return None;
        }
        let (inbox, peer) = (self.inbox.clone(), self.peer_proc.clone());
        Some(Box::new(move || {
            wait_word(
                inbox.u32(OFF_DIRECT_DONE),
                past,
                peer.as_deref(),
                DIRECT_READ_SETTLE,
            );
        }))
    }

    fn peer_stopped(&self) -> bool {
        self.peer_proc.as_ref().is_some_and(|p| p.stopped())
    }

    fn set_direct_level(&self, level: bool) {
        self.inbox
            .u32(OFF_DIRECT_LEVEL)
            .store(level as u32, Ordering::SeqCst);
    }

    fn direct_unread_clear(&self) -> Option<Arc<dyn Fn() + Send + Sync>> {
        let inbox = self.inbox.clone();
        Some(Arc::new(move || {
            inbox.u32(OFF_DIRECT_UNREAD).store(0, Ordering::SeqCst)
        }))
    }

    fn set_direct_wake(&self, on: bool, settle: bool) {
        let sw = self.inbox.u32(OFF_DIRECT);
        if on {
            sw.store(1, Ordering::SeqCst);
            return;
        }
        sw.store(0, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // A SEND the peer announced by a direct byte only (it read the switch before we
        // turned it off) rang our bell first: make it known to the notify fd as well.
        let rung = bell_off(self.token)
            .is_none_or(|b| self.inner.bells.u32(b).load(Ordering::Relaxed) != 0);
        if rung {
            self.self_notify();
        }
        if settle {
            let busy = self.inbox.u32(OFF_DIRECT_BUSY);
            let w = wait_word(
                busy,
                |n| n == 0,
                self.peer_proc.as_deref(),
                DIRECT_SETTLE_MAX,
            );
            if w == CopyWait::TimedOut {
                self.inner.settle_timeouts.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn poll_cq(&mut self, out: &mut [Completion]) -> usize {
        self.progress();
        self.poll_inline(out)
    }

    fn news_token(&self) -> Option<usize> {
        bell_off(self.token).map(|_| self.token)
    }

    fn quiet(&self) -> bool {
        // The bell covers what the peer does (`Peer::wake` rings it after every change it makes
        // to our inbox or its own state; `progress` silences it before it looks); the rest is
        // ours: queued completions, events and sends, a copy under way, the socket (epoll's hint
        // and the liveness check).
        let Some(b) = bell_off(self.token) else {
            return false;
        };
        self.state == QpState::Ready
            && !self.await_rtu
            && self.peer.is_some()
            && self.cq.is_empty()
            && self.cm.is_empty()
            && self.pending.is_empty()
            && self.copying.is_none()
            && (self.pause_asked_ms == 0 || self.paused)
            && self.inner.bells.u32(b).load(Ordering::Relaxed) == 0
            && !self.ctl.hint.load(Ordering::Relaxed)
            && (self.sock.is_none()
                || sys::coarse_ms().saturating_sub(self.last_check_ms) < self.inner.backstop_ms())
    }

    fn poll_cm(&mut self) -> Option<CmEvent> {
        if let Some(ev) = self.cm.pop_front() {
            return Some(ev);
        }
        if self.state == QpState::Ready && self.peer.as_ref().is_some_and(|p| p.closed()) {
            self.peer_closed();
        }
        if self.sock.is_some() {
            let hint = self.ctl.hint.swap(false, Ordering::Relaxed);
            let now = sys::coarse_ms();
            if hint
                || self.await_rtu
                || self.state == QpState::Connecting
                || now.saturating_sub(self.last_check_ms) >= self.inner.backstop_ms()
            {
                self.last_check_ms = now;
                self.check_socket();
            }
            if self.state == QpState::Connecting
                && self.handed_ms != 0
                && now.saturating_sub(self.handed_ms) > HANDED_WAIT_MS
            {
                // Nobody accepted it: our close tells whoever takes the request later.
                self.sock = None;
                self.state = QpState::Error;
                self.cm.push_back(CmEvent::Rejected {
                    private_data:
                        b"SDP shm: the listener is shared and no process accepted us within 1 s"
                            .to_vec(),
                    consumer: true,
                });
            }
        }
        self.cm.pop_front()
    }

    fn local_wait(&self) -> Option<crate::verbs::LocalWait> {
        use crate::verbs::LocalWait;
        (self.state == QpState::Connecting).then_some(if self.handed_ms != 0 {
            LocalWait::Handed
        } else {
            LocalWait::Unanswered
        })
    }

    fn pause_peer(&mut self) -> bool {
        if self.state != QpState::Ready || self.await_rtu || self.peer.is_none() {
            return false;
        }
        let Some(s) = self.sock.as_ref() else {
            return false;
        };
        self.peer_paused = false;
        send_simple(s, M_SUSP, false, &[])
    }

    fn peer_paused(&self) -> bool {
        self.peer_paused
    }

    fn moved_here(&mut self) -> bool {
        if !std::mem::take(&mut self.peer_paused) {
            return false;
        }
        let Some(s) = self.sock.as_ref() else {
            return false;
        };
        let m = self.plain_msg(M_MOVED, sys::probe_addr());
        sys::send_msg(s.as_fd(), &m, &[]).is_ok()
    }

    fn accept(&mut self, private_data: &[u8]) -> Result<(), VerbsError> {
        if self.state != QpState::Pending {
            return Err(VerbsError::Invalid(
                "endpoint is not a pending connect request",
            ));
        }
        if private_data.len() > MAX_PD_ACCEPT {
            return Err(VerbsError::Invalid("private data too long"));
        }
        let (Some(sock), Some(inbox_fd)) = (self.sock.as_ref(), self.inbox_fd.as_ref()) else {
            return Err(VerbsError::NotConnected);
        };
        let m = encode(&Msg {
            kind: M_ACC,
            bell: self.bell(),
            consumer: false,
            nslots: self.nslots,
            probe: sys::probe_addr(),
            addr: self.local,
            pd: private_data,
        });
        let fds = [
            inbox_fd.as_fd(),
            self.inner.evfd.as_fd(),
            self.inner.keys_ro.as_fd(),
            self.inner.bells_fd.as_fd(),
        ];
        sys::send_msg(sock.as_fd(), &m, &fds).map_err(|_| VerbsError::NotConnected)?;
        self.inbox_fd = None;
        self.state = QpState::Ready;
        self.await_rtu = true;
        if self.early {
            // A handed request: the process that took it answers from inside the
            // application's `accept`, which must not wait on the connector (a stopped one held
            // a shared listener's nonblocking accept up to 2 s). Established now, as a kernel
            // queues a connection for accept once its side of the handshake is done: the
            // connector's SENDs can land in our inbox from here on, ours wait for its RTU (its
            // fds), and an RTU that fails ends the connection as a peer's reset would. A
            // listener of our own keeps the connection until the RTU, as TCP's accept returns a
            // connection only after the client's final ACK.
            self.cm.push_back(CmEvent::Established {
                private_data: Vec::new(),
            });
        }
        Ok(())
    }

    fn reject(&mut self, private_data: &[u8]) -> Result<(), VerbsError> {
        if self.state != QpState::Pending {
            return Err(VerbsError::Invalid(
                "endpoint is not a pending connect request",
            ));
        }
        if private_data.len() > MAX_PD_REJECT {
            return Err(VerbsError::Invalid("private data too long"));
        }
        if let Some(s) = self.sock.take() {
            send_simple(&s, M_REJ, true, private_data);
        }
        self.state = QpState::Error;
        Ok(())
    }

    fn disconnect(&mut self) -> Result<(), VerbsError> {
        match self.state {
            QpState::Ready => {
                let _ = self.harvest();
                self.fail(None);
                self.self_notify();
                Ok(())
            }
            QpState::Error => Ok(()),
            QpState::Connecting | QpState::Pending => Err(VerbsError::NotConnected),
        }
    }

    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }
}

impl Drop for ShmEndpoint {
    fn drop(&mut self) {
        // (A shared Read whose helper's chunks are not done was noted when it started to wait
        // for them, `exec`: its buffer's region, let go before or after this, waits for them or
        // is parked behind them. Nothing here waits.)
        self.copying = None;
        match self.state {
            QpState::Pending => {
                if let Some(s) = &self.sock {
                    send_simple(s, M_REJ, false, &[]);
                }
            }
            QpState::Ready | QpState::Connecting => {
                self.inbox.u32(OFF_STATE).store(1, Ordering::Release);
                // The receives we flush go back to their owner: no SEND may land after.
                self.drain_own();
                if let Some(s) = &self.sock {
                    send_simple(s, M_DISC, false, &[]);
                }
                if let Some(p) = &self.peer {
                    p.wake();
                }
            }
            QpState::Error => {}
        }
        if self.rnr_counted {
            self.inner.rnr_waiting.fetch_sub(1, Ordering::Relaxed);
        }
        self.inner.remove_ctl(self.token);
        let _ = self.active;
    }
}

struct Half {
    sock: OwnedFd,
    proc: Arc<Proc>,

    since: Instant,
}

/// The reason of a REJ waiting on a rendezvous connection the listener closed, if one is.
fn queued_reject(sock: BorrowedFd<'_>) -> Option<Vec<u8>> {
    let mut buf = [0u8; 512];
    loop {
        match sys::recv_msg(sock, &mut buf) {
            Recv::Msg(n, _) => match decode(&buf[..n]) {
                Some(m) if m.kind == M_REJ => {
                    return Some(m.pd[..m.pd.len().min(MAX_PD_REJECT)].to_vec())
                }
                _ => {}
            },
            Recv::Empty | Recv::Eof => return None,
        }
    }
}

/// Send a request (a rendezvous connection, its connect request unread) to the process that
/// will answer it; its queue full: refuse it as a full listen queue. Whether it went.
fn hand_off(q: BorrowedFd<'_>, s: OwnedFd) -> bool {
    send_simple(&s, M_HND, false, &[]);
    let sent = sys::send_msg(q, b"H", &[s.as_fd()]).is_ok();
    if !sent {
        send_simple(&s, M_REJ, true, crate::verbs::REJECT_QUEUE_FULL.as_bytes());
    }
    // Our copy goes: the process that answers holds the only one (its exit is what the
    // connector sees).
    sent
}

/// A listening endpoint: an abstract Unix socket named after the address and port (none for
/// a listener that only adopts requests another process's listener handed over).
pub struct ShmListener {
    inner: Arc<Inner>,
    _ctl: Arc<Ctl>,
    token: usize,
    sock: Option<OwnedFd>,
    addr: SocketAddr,
    caps: QpCaps,
    tcp: Option<OwnedFd>,
    half: VecDeque<Half>,
    backlog: usize,
    /// When the rendezvous socket was last looked at.
    last_check: Instant,
    /// Requests go there unanswered (`Listener::set_handoff`).
    handoff: Option<OwnedFd>,
    /// Shared listener: requests whose connect request has not arrived yet, with when they
    /// came (handed on once it has: `hand_ready`).
    unready: Vec<(OwnedFd, Instant)>,
    /// Requests handed off so far.
    handed: u64,
    /// New requests are refused (`Listener::set_refusing`).
    refusing: bool,
}

impl std::fmt::Debug for ShmListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmListener")
            .field("addr", &self.addr)
            .finish()
    }
}

impl ShmListener {
    /// A listener on `addr`, taking requests on the rendezvous socket `sock` (none: only those
    /// handed to it, `Listener::adopt`).
    fn new(
        inner: &Arc<Inner>,
        sock: Option<OwnedFd>,
        addr: SocketAddr,
        backlog: u32,
        caps: QpCaps,
        tcp: Option<OwnedFd>,
    ) -> Result<ShmListener, VerbsError> {
        let ctl = Arc::new(Ctl {
            hint: AtomicBool::new(false),
            inbox: None,
            nslots: 0,
            peer: parking_lot::Mutex::new(None),
        });
        let token = inner.add_ctl(&ctl, sock.as_ref().map(|s| (s.as_raw_fd(), false)))?;
        Ok(ShmListener {
            inner: inner.clone(),
            _ctl: ctl,
            token,
            sock,
            addr,
            caps,
            tcp,
            half: VecDeque::new(),
            backlog: backlog.clamp(1, 4096) as usize,
            last_check: Instant::now(),
            handoff: None,
            unready: Vec::new(),
            handed: 0,
            refusing: false,
        })
    }

    /// The kernel TCP socket bound (not listening) to reserve an ephemeral port, if listen
    /// picked the port. The socket layer may take it (e.g. to listen for TCP fallback on the
    /// same port).
    pub fn take_reserved_tcp_socket(&mut self) -> Option<OwnedFd> {
        self.tcp.take()
    }

    /// Requests refused because the peer runs as another user (provider-wide).
    pub fn refused_uid_count(&self) -> u64 {
        self.inner.refused_uid.load(Ordering::Relaxed)
    }

    fn take_new(&mut self) {
        // This runs at every progress round, and a caller spinning for a reply makes many: look
        // at the socket when epoll reported it (the hint), else at most every LISTEN_CHECK.
        // And ask poll(2) first: a nonblocking accept(2) that finds nobody still allocates and
        // frees a socket file.
        let Some(sock) = self.sock.as_ref().map(|s| s.as_raw_fd()) else {
            return;
        };
        let hint = self._ctl.hint.swap(false, Ordering::Relaxed);
        let now = Instant::now();
        if (!self.has_room() && self.handoff.is_none())
            || (!hint && now.duration_since(self.last_check) < LISTEN_CHECK)
        {
            return;
        }
        self.last_check = now;
        self.hand_ready();
        if !sys::poll_readable(sock, 0) {
            return;
        }
        while self.has_room() {
            let Some(Ok(Some(s))) = self.sock.as_ref().map(|k| sys::accept(k.as_fd())) else {
                return;
            };
            if self.refusing {
                // At once, before anything is made for it (the connector falls back).
                send_simple(&s, M_REJ, true, crate::verbs::REJECT_SDP_OFF.as_bytes());
                continue;
            }
            if self.handoff.is_some() {
                self.hand_when_asked(s);
                continue;
            }
            self.admit(s);
        }
    }

    /// Whether another request may be taken in; when not, the kernel's queue holds the rest
    /// until there is room (a handed-off listener's room is requests whose connect request has
    /// not come, `unready`; another's, requests not answered yet, `half`).
    fn has_room(&self) -> bool {
        let held = if self.handoff.is_some() {
            self.unready.len()
        } else {
            self.half.len()
        };
        held < self.backlog
    }

    /// Shared listener: hand a request on once its connect request is there (or its connector
    /// hung up), never before. The process that takes it answers at once and its `accept`
    /// returns; a request handed before the connector sent anything (it was stopped or
    /// preempted between its connect and its send) made that `accept` wait for it, up to 2 s,
    /// even on a nonblocking listener, where TCP's kernel queues only finished handshakes.
    fn hand_when_asked(&mut self, s: OwnedFd) {
        let Some(q) = &self.handoff else { return };
        // Another user's connection is refused here, not held (any user reaches the abstract
        // rendezvous name; held ones would count against our fds and the queue).
        match sys::peer_cred(s.as_fd()) {
            Ok((_, uid)) if uid == self.inner.uid => {}
            Ok((_, uid)) => return self.refuse_uid(&s, uid),
            Err(_) => return,
        }
        if sys::poll_readable(s.as_raw_fd(), 0) {
            self.handed += hand_off(q.as_fd(), s) as u64;
        } else {
            // Its connect request will be news (the listener's token).
            self.inner.add_fd(self.token, s.as_raw_fd(), true);
            self.unready.push((s, Instant::now()));
        }
    }

    /// Hand on the requests of `unready` whose connect request came; drop those that sent
    /// none in 10 s (as unanswered requests are).
    fn hand_ready(&mut self) {
        let Some(q) = &self.handoff else { return };
        let mut i = 0;
        while i < self.unready.len() {
            let (s, since) = &self.unready[i];
            let ready = sys::poll_readable(s.as_raw_fd(), 0);
            if ready || since.elapsed() > Duration::from_secs(10) {
                let (s, _) = self.unready.swap_remove(i);
                sys::epoll_del(self.inner.epoll.as_fd(), s.as_raw_fd());
                if ready {
                    self.handed += hand_off(q.as_fd(), s) as u64;
                }
            } else {
                i += 1;
            }
        }
    }

    /// Take a new rendezvous connection as a request to answer: one of our user's.
    fn admit(&mut self, s: OwnedFd) {
        match sys::peer_cred(s.as_fd()) {
            Ok((pid, uid)) if uid == self.inner.uid => {
                // The connector gone already (or its pid taken since): drop it.
                let Ok(proc) = Proc::of_peer(s.as_fd(), pid) else {
                    return;
                };
                self.inner.add_fd(self.token, s.as_raw_fd(), true);
                self.half.push_back(Half {
                    sock: s,
                    proc: self.inner.shared_proc(proc),
                    since: Instant::now(),
                });
            }
            Ok((_, uid)) => self.refuse_uid(&s, uid),
            Err(_) => {}
        }
    }

    /// Refuse a connector of another user (`uid`), and count it.
    fn refuse_uid(&self, s: &OwnedFd, uid: u32) {
        self.inner.refused_uid.fetch_add(1, Ordering::Relaxed);
        let reason = format!("SDP shm: the listener serves only its own user, not uid {uid}");
        send_simple(s, M_REJ, true, reason.as_bytes());
    }

    fn endpoint_for(
        &self,
        h: Half,
        msg: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Option<(ShmEndpoint, Vec<u8>)> {
        let refuse = |why: &str| {
            send_simple(
                &h.sock,
                M_REJ,
                true,
                &why.as_bytes()[..why.len().min(MAX_PD_REJECT)],
            );
            None
        };
        let Some(m) = decode(msg) else {
            return refuse("SDP shm: bad connect request");
        };
        // No fds before we proved we reach the connector's memory (it sends them with its
        // RTU, once it reached ours).
        if m.kind != M_REQ || m.pd.len() > MAX_PD_CONNECT || !fds.is_empty() {
            return refuse("SDP shm: bad connect request");
        }
        match sys::probe(&h.proc, m.probe) {
            Ok(true) => {}
            Ok(false) => return refuse("SDP shm: peer memory probe mismatch"),
            Err(e) => {
                return refuse(&format!(
                    "SDP shm: cannot access peer memory ({e}; see kernel.yama.ptrace_scope)"
                ))
            }
        }
        // Out of fds (the process's limit, or the room above the application's): refused now,
        // so the connector falls back to kernel TCP (one fd), not set up and then dropped at
        // accept for want of the fds the connection, its doorbell and its application fd take.
        if !sys::fds_to_spare(h.sock.as_fd(), FDS_PER_ACCEPT) {
            return refuse("SDP shm: out of file descriptors");
        }
        let Ok((inbox_fd, inbox, nslots)) = new_inbox(self.caps.max_recv_wr) else {
            return refuse("SDP shm: out of resources");
        };
        let mut local = self.addr;
        if local.ip().is_unspecified() {
            local.set_ip(if m.addr.is_ipv4() {
                IpAddr::V4(Ipv4Addr::LOCALHOST)
            } else {
                IpAddr::V6(Ipv6Addr::LOCALHOST)
            });
        }
        let pd = m.pd.to_vec();
        let mut ep = match ShmEndpoint::new(
            self.inner.clone(),
            None,
            inbox,
            Some(inbox_fd),
            nslots,
            self.caps,
            local,
            m.addr,
            false,
        ) {
            Ok(ep) => ep,
            Err(_) => return refuse("SDP shm: out of resources"),
        };
        // Its fds come with the RTU (`check_socket`).
        ep.early = self.sock.is_none();
        ep.ctl.set_peer(h.proc.clone());
        ep.peer_proc = Some(h.proc);
        // Re-register the socket under the endpoint's token.
        let sock = h.sock;
        sys::epoll_del(self.inner.epoll.as_fd(), sock.as_raw_fd());
        self.inner.add_fd(ep.token, sock.as_raw_fd(), true);
        sys::close_in_fork_child(sock.as_fd());
        ep.sock = Some(sock);
        Some((ep, pd))
    }
}

/// Spare fds a connection request needs to be accepted: its own (inbox, the peer's eventfd,
/// key table and bell page, its direct wakeup), the socket layer's doorbell and readiness pair.
const FDS_PER_ACCEPT: u32 = 10;

impl Listener for ShmListener {
    type Endpoint = ShmEndpoint;

    fn set_refusing(&mut self, on: bool) {
        self.refusing = on;
    }

    fn poll_request(&mut self) -> Option<(ShmEndpoint, Vec<u8>)> {
        self.take_new();
        let mut buf = [0u8; 512];
        let mut i = 0;
        while i < self.half.len() {
            match sys::recv_msg(self.half[i].sock.as_fd(), &mut buf) {
                Recv::Empty => {
                    if self.half[i].since.elapsed() > Duration::from_secs(10) {
                        self.half.remove(i);
                    } else {
                        i += 1;
                    }
                }
                Recv::Eof => {
                    self.half.remove(i);
                }
                Recv::Msg(n, fds) => {
                    let h = self.half.remove(i).expect("index in range");
                    if let Some(r) = self.endpoint_for(h, &buf[..n], fds) {
                        return Some(r);
                    }
                }
            }
        }
        None
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn set_handoff(&mut self, to: OwnedFd) -> Result<(), VerbsError> {
        if self.sock.is_none() {
            return Err(VerbsError::Invalid(
                "an adopting listener has no requests to hand off",
            ));
        }
        // Requests taken but not answered yet go too (their connect request still unread).
        self.handoff = Some(to);
        for h in std::mem::take(&mut self.half) {
            sys::epoll_del(self.inner.epoll.as_fd(), h.sock.as_raw_fd());
            self.hand_when_asked(h.sock);
        }
        self._ctl.hint.store(true, Ordering::Relaxed);
        Ok(())
    }

    fn handed_off(&self) -> u64 {
        self.handed
    }

    fn unanswered(&self) -> usize {
        self.half.len()
    }

    fn adopt(&mut self, request: OwnedFd) -> Result<(), VerbsError> {
        if self.half.len() >= self.backlog {
            send_simple(
                &request,
                M_REJ,
                true,
                crate::verbs::REJECT_QUEUE_FULL.as_bytes(),
            );
            return Err(VerbsError::Invalid("listen queue full"));
        }
        let fd = request.as_raw_fd();
        if sys::getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_DOMAIN).ok() != Some(libc::AF_UNIX)
            || sys::getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_TYPE).ok()
                != Some(libc::SOCK_SEQPACKET)
        {
            return Err(VerbsError::Invalid("not a rendezvous connection"));
        }
        if sys::hung_up(fd) {
            // The connector gave up waiting (`HANDED_WAIT_MS`) or died: nothing to answer.
            return Err(VerbsError::NotConnected);
        }
        self.admit(request);
        Ok(())
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        self.inner.remove_ctl(self.token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that dies with a copy announced (the word left odd) does not hold a
    /// deregistration: the wait ends on its pidfd, not on the time bound.
    #[test]
    fn a_dead_peers_copy_does_not_hold_the_owner() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let p = Proc::open(child.id() as i32).unwrap();
        let w = AtomicU32::new(7);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(
            wait_copy(&w, 7, Some(&p), Duration::from_secs(3600)),
            CopyWait::PeerGone
        );
        // A live peer's copy that completes ends the wait as done.
        let me = Proc::open(sys::getpid_now()).unwrap();
        let w = Arc::new(AtomicU32::new(9));
        let w2 = w.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            w2.store(10, Ordering::Release);
        });
        assert_eq!(
            wait_copy(&w, 9, Some(&me), Duration::from_secs(3600)),
            CopyWait::Done
        );
        t.join().unwrap();
    }

    /// The key table a peer receives cannot be written by it, not even by reopening it
    /// read-write through /proc (issue 14: the read-only fd alone did not stop that).
    #[test]
    fn the_peers_key_table_fd_cannot_write() {
        let p = ShmProvider::new().unwrap();
        let paths = sys::write_paths(p.inner.keys_ro.as_fd());
        let writes: Vec<_> = paths.iter().filter(|w| **w != "reopen O_RDWR").collect();
        assert!(writes.is_empty(), "the key table is writable by: {paths:?}");
        // And our own entries still work.
        let mr = p.reg_mr(64, Access::REMOTE_READ).unwrap();
        let off = KT_HDR + (mr.rkey() & 0xffff) as usize * KT_ENTRY;
        assert_eq!(
            p.inner.keys.u32(off + E_RKEY).load(Ordering::Relaxed),
            mr.rkey()
        );
    }

    /// Receive one message on `s`, waiting up to 5 s.
    fn recv_wait(s: &OwnedFd, buf: &mut [u8]) -> Option<(usize, Vec<OwnedFd>)> {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            match sys::recv_msg(s.as_fd(), buf) {
                Recv::Msg(n, fds) => return Some((n, fds)),
                Recv::Eof => return None,
                Recv::Empty => {
                    assert!(Instant::now() < end, "nothing received");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    /// The connector hands over its fds (inbox, eventfd, key table) only after it proved it
    /// reaches the acceptor's memory: not in its REQ, and not to an acceptor whose probe
    /// fails (issue 14: the REQ carried them before any probe).
    #[test]
    fn fds_only_after_the_mutual_probe() {
        let p = ShmProvider::new().unwrap();
        let (_tcp, port) = sys::tcp_reserve("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let l = sys::seqpacket_listen(&rendezvous_name(addr), 4).unwrap();
        let mut ep = p.connect(addr, None, QpCaps::default(), b"x").unwrap();
        let s = loop {
            if let Some(s) = sys::accept(l.as_fd()).unwrap() {
                break s;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let mut buf = [0u8; 512];
        let (n, fds) = recv_wait(&s, &mut buf).expect("a REQ");
        assert_eq!(decode(&buf[..n]).map(|m| m.kind), Some(M_REQ));
        assert!(fds.is_empty(), "the REQ carried {} fds", fds.len());
        // An acceptor whose memory the connector cannot read (its probe word is not there),
        // with well-formed fds otherwise.
        let other = ShmProvider::new().unwrap();
        let (ib_fd, _ib, nslots) = new_inbox(8).unwrap();
        let acc = encode(&Msg {
            kind: M_ACC,
            bell: NO_BELL,
            consumer: false,
            nslots,
            probe: 8,
            addr,
            pd: &[],
        });
        let fds = [
            ib_fd.as_fd(),
            other.inner.evfd.as_fd(),
            other.inner.keys_ro.as_fd(),
            other.inner.bells_fd.as_fd(),
        ];
        sys::send_msg(s.as_fd(), &acc, &fds).unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        let ev = loop {
            if let Some(ev) = ep.poll_cm() {
                break ev;
            }
            assert!(Instant::now() < end, "the connect did not fail");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(ev, CmEvent::ConnectError);
        while let Some((n, fds)) = recv_wait(&s, &mut buf) {
            let kind = decode(&buf[..n]).map(|m| m.kind);
            assert!(fds.is_empty(), "{kind:?} carried {} fds", fds.len());
            if kind == Some(M_DISC) {
                break;
            }
        }
    }

    /// A connector of one provider and the endpoint that accepted its request on a listener of
    /// another (both of this process), before either looked at the other's answer.
    fn accepted_pair() -> (ShmProvider, ShmEndpoint, ShmProvider, ShmEndpoint) {
        accepted_pair_with(ShmConfig::default())
    }

    /// [`accepted_pair`] with the listening side's provider configured by `cfg_b`.
    fn accepted_pair_with(
        cfg_b: ShmConfig,
    ) -> (ShmProvider, ShmEndpoint, ShmProvider, ShmEndpoint) {
        let (a, b) = (
            ShmProvider::new().unwrap(),
            ShmProvider::with_config(cfg_b).unwrap(),
        );
        let (_tcp, port) = sys::tcp_reserve("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut l = b.listen(addr, 4, QpCaps::default()).unwrap();
        let ca = a.connect(addr, None, QpCaps::default(), b"x").unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let cb = loop {
            if let Some((mut ep, _)) = l.poll_request() {
                ep.accept(b"y").unwrap();
                break ep;
            }
            assert!(Instant::now() < end, "no request");
            std::thread::sleep(Duration::from_millis(1));
        };
        (a, ca, b, cb)
    }

    /// Two endpoints of one process connected through a listener of another provider.
    fn connected_pair() -> (ShmProvider, ShmEndpoint, ShmProvider, ShmEndpoint) {
        connected_pair_with(ShmConfig::default())
    }

    /// [`connected_pair`] with the listening side's provider configured by `cfg_b`.
    fn connected_pair_with(
        cfg_b: ShmConfig,
    ) -> (ShmProvider, ShmEndpoint, ShmProvider, ShmEndpoint) {
        let (a, mut ca, b, mut cb) = accepted_pair_with(cfg_b);
        let end = Instant::now() + Duration::from_secs(10);
        let (mut ua, mut ub) = (false, false);
        while !(ua && ub) {
            ua |= matches!(ca.poll_cm(), Some(CmEvent::Established { .. }));
            ub |= matches!(cb.poll_cm(), Some(CmEvent::Established { .. }));
            assert!(Instant::now() < end, "not established");
            std::thread::sleep(Duration::from_millis(1));
        }
        (a, ca, b, cb)
    }

    /// A copy of the peer's region `rkey` announced (and its key looked at) as `exec` does,
    /// whose copier is then "stopped" for longer than `COPY_DRAIN_MAX` before the copy ends (the
    /// word moves on, from a thread). Returns whether it ended, and the thread to join.
    fn a_late_copy(
        peer: &Peer,
        rkey: u32,
        seq: &mut u32,
    ) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
        let copy = InFlight::begin(&peer.inbox, &peer.prov.bells, rkey, seq);
        assert!(peer.lookup(rkey).is_some());
        std::mem::forget(copy);
        let word = peer.inbox.u32(OFF_INFLIGHT) as *const AtomicU32 as usize;
        let ended = Arc::new(AtomicBool::new(false));
        let t = {
            let ended = ended.clone();
            std::thread::spawn(move || {
                std::thread::sleep(COPY_DRAIN_MAX + Duration::from_millis(100));
                ended.store(true, Ordering::SeqCst);
                // SAFETY: the inbox mapping outlives this thread (the caller joins it).
                unsafe { &*(word as *const AtomicU32) }.fetch_add(1, Ordering::Release);
            })
        };
        (ended, t)
    }

    /// A SEND of the first `len` bytes of `src`.
    fn send_wr(wr_id: u64, src: &ShmMr, len: usize, solicited: bool) -> SendWr {
        SendWr {
            wr_id,
            op: SendOp::Send,
            sge: Some(Sge {
                addr: src.addr(),
                len: len as u32,
                lkey: src.lkey(),
            }),
            payload: None,
            signaled: true,
            solicited,
            wake_engine: false,
        }
    }

    /// An RDMA Read of `len` bytes from the peer's `remote` into our `local`.
    fn read_wr(wr_id: u64, remote: &ShmMr, local: &ShmMr, len: usize) -> SendWr {
        SendWr {
            wr_id,
            op: SendOp::Read(RemoteBuf {
                addr: remote.addr(),
                rkey: remote.rkey(),
            }),
            sge: Some(Sge {
                addr: local.addr(),
                len: len as u32,
                lkey: local.lkey(),
            }),
            payload: None,
            signaled: true,
            solicited: false,
            wake_engine: false,
        }
    }

    fn poll_one(ep: &mut ShmEndpoint, what: &str) -> Completion {
        let end = Instant::now() + Duration::from_secs(10);
        let mut c = [Completion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: 0,
        }];
        loop {
            ep.progress();
            if ep.poll_cq(&mut c) == 1 {
                return c[0];
            }
            assert!(Instant::now() < end, "no completion for {what}");
            std::thread::yield_now();
        }
    }

    /// A connection moves to a fork child of its process, as `daemon()` and `ssh -f` need: the
    /// mover pauses its peer (`M_SUSP`, answered once the peer's copies stopped), forks, and
    /// the child says where it went (`M_MOVED`): the SEND the peer held during the pause is
    /// then copied into the child's memory, and the child's SEND reaches the peer. (Without
    /// the move the peer's copy went into the parent's memory, where the child never sees it.)
    #[test]
    fn a_connection_moves_to_a_fork_child() {
        let (pa, mut a, pb, mut b) = connected_pair();
        // Past the inline ring (a `process_vm_writev` into the receiver's memory) and below
        // the shared copies.
        const LEN: usize = 24 << 10;
        let ra = pa.reg_mr(LEN, Access::LOCAL_WRITE).unwrap();
        let sa = pa.reg_mr(LEN, Access::empty()).unwrap();
        let rb = pb.reg_mr(LEN, Access::LOCAL_WRITE).unwrap();
        let sb = pb.reg_mr(LEN, Access::empty()).unwrap();
        let recv = |mr: &ShmMr| RecvWr {
            wr_id: 7,
            sge: Sge {
                addr: mr.addr(),
                len: LEN as u32,
                lkey: mr.lkey(),
            },
        };
        a.post_recv(&recv(&ra)).unwrap();
        b.post_recv(&recv(&rb)).unwrap();
        let pattern = |seed: u8| (0..LEN).map(|i| (i as u8) ^ seed).collect::<Vec<u8>>();
        // SAFETY: our own regions, `LEN` bytes each.
        unsafe {
            sys::copy_to_addr(sb.addr(), &pattern(0x5a));
            sys::copy_to_addr(sa.addr(), &pattern(0xa5));
        }
        let end = Instant::now() + Duration::from_secs(10);
        let turn = |a: &mut ShmEndpoint, b: &mut ShmEndpoint| {
            assert!(Instant::now() < end, "stuck");
            pa.arm().unwrap();
            pb.arm().unwrap();
            let _ = (a.poll_cm(), b.poll_cm());
            a.progress();
            b.progress();
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(a.pause_peer());
        while !a.peer_paused() {
            turn(&mut a, &mut b);
        }
        // Paused: the peer's SEND waits.
        b.post_send(&send_wr(1, &sb, LEN, true)).unwrap();
        for _ in 0..20 {
            turn(&mut a, &mut b);
        }
        let mut c = [poll_one_none()];
        assert_eq!(b.poll_cq(&mut c), 0, "the peer's SEND ran during the pause");
        // The child keeps the connection's fds (a fork child closes them otherwise).
        sys::next_fork_moves();
        // SAFETY: the child only drives its copy of `a` and exits with `_exit`.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                assert!(a.moved_here());
                let c = poll_one(&mut a, "the peer's SEND in the child");
                let mut got = vec![0u8; LEN];
                // SAFETY: inside our registered region.
                unsafe { sys::copy_from_addr(ra.addr(), &mut got) };
                let arrived = c.status == WcStatus::Success && got == pattern(0x5a);
                a.post_send(&send_wr(2, &sa, LEN, true)).unwrap();
                let sent = poll_one(&mut a, "the child's SEND").status == WcStatus::Success;
                arrived && sent
            }));
            // SAFETY: ends the child without running the parent's test harness.
            unsafe { libc::_exit(if matches!(ok, Ok(true)) { 0 } else { 1 }) };
        }
        // The parent goes on as the peer only (its copy of `a` is the child's now).
        std::mem::forget(a);
        while b.peer_pid() != child {
            pb.arm().unwrap();
            let _ = b.poll_cm();
            b.progress();
            assert!(Instant::now() < end, "no M_MOVED");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut st = 0;
        let c1 = poll_one(&mut b, "one of the SEND and the child's");
        let c2 = poll_one(&mut b, "the other");
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(child, &mut st, 0) }, child);
        assert!(
            libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
            "the child: {st:#x}"
        );
        let mut by = [c1, c2];
        by.sort_by_key(|c| c.wr_id);
        assert_eq!(
            by.map(|c| (c.wr_id, c.status, c.opcode)),
            [
                (1, WcStatus::Success, WcOpcode::Send),
                (7, WcStatus::Success, WcOpcode::Recv)
            ]
        );
        let mut got = vec![0u8; LEN];
        // SAFETY: inside our registered region.
        unsafe { sys::copy_from_addr(rb.addr(), &mut got) };
        assert!(got == pattern(0xa5), "the child's SEND arrived changed");
    }

    /// A mover that paused its peer and never says where it went (it died between its fork
    /// and its `M_MOVED`, or forked no child that goes on) is taken as gone after
    /// `ShmConfig::move_wait`: the peer's connection fails, as for a dead peer, and the SEND
    /// it held fails with it, never left waiting.
    #[test]
    fn a_peer_paused_for_a_move_that_never_comes_resets() {
        let cfg = ShmConfig {
            move_wait: Duration::from_millis(200),
            ..ShmConfig::default()
        };
        let (a, mut ca, b, mut cb) = connected_pair_with(cfg);
        let end = Instant::now() + Duration::from_secs(10);
        // The peer's wait starts when it takes the pause, after this.
        let asked_at = Instant::now();
        assert!(ca.pause_peer());
        while !ca.peer_paused() {
            a.arm().unwrap();
            b.arm().unwrap();
            let _ = (ca.poll_cm(), cb.poll_cm());
            assert!(Instant::now() < end, "no answer to the pause");
            std::thread::sleep(Duration::from_millis(1));
        }
        let src = b.reg_mr(64, Access::empty()).unwrap();
        cb.post_send(&send_wr(1, &src, 64, false)).unwrap();
        let c = poll_one(&mut cb, "the held SEND");
        assert_ne!(c.status, WcStatus::Success, "{c:?}");
        // (The coarse clock the wait is timed on may be a few ms behind.)
        assert!(
            asked_at.elapsed() >= Duration::from_millis(180),
            "it failed before the move's wait: {:?}",
            asked_at.elapsed()
        );
        assert!(!cb.is_ready(), "the connection failed");
    }

    fn poll_one_none() -> Completion {
        Completion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: 0,
        }
    }

    /// SENDs of every size around the slot's inline limit and the inline ring's limit arrive
    /// whole, in order, with their lengths, through many turns of the ring; the ring carries
    /// those between the limits, and a sender that finds it full (the owner not taking its
    /// receives) copies with `process_vm_writev` instead of waiting.
    #[test]
    fn sends_around_the_inline_limits_arrive_whole() {
        let (pa, mut a, pb, mut b) = connected_pair();
        const BUF: usize = 32 << 10;
        const N: usize = 24;
        let src = pa.reg_mr(BUF, Access::empty()).unwrap();
        let dst = pb.reg_mr(BUF * N, Access::LOCAL_WRITE).unwrap();
        let sizes = [
            1,
            INLINE_MAX,
            INLINE_MAX + 1,
            1000,
            RING_MSG_MAX - 1,
            RING_MSG_MAX,
            RING_MSG_MAX + 1,
            BUF,
        ];
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut sent = 0u64;
        for round in 0..40 {
            for (i, &len) in sizes.iter().enumerate() {
                let k = (round * sizes.len() + i) % N;
                let rbuf = dst.addr() + (k * BUF) as u64;
                b.post_recv(&RecvWr {
                    wr_id: k as u64,
                    sge: Sge {
                        addr: rbuf,
                        len: BUF as u32,
                        lkey: dst.lkey(),
                    },
                })
                .unwrap();
                let mut data = vec![0u8; len];
                for x in data.iter_mut() {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    *x = rng as u8;
                }
                // SAFETY: the region is ours and `len` <= its size.
                unsafe { sys::copy_to_addr(src.addr(), &data) };
                a.post_send(&send_wr(1, &src, len, true)).unwrap();
                let c = poll_one(&mut a, "the send");
                assert_eq!(c.status, WcStatus::Success, "send of {len}");
                sent += 1;
                let c = poll_one(&mut b, "the receive");
                assert_eq!(
                    (c.status, c.wr_id, c.byte_len),
                    (WcStatus::Success, k as u64, len as u32)
                );
                let mut got = vec![0u8; len];
                // SAFETY: inside our registered region, not referenced elsewhere.
                unsafe { sys::copy_from_addr(rbuf, &mut got) };
                assert!(got == data, "round {round}: {len} bytes arrived changed");
            }
        }
        let in_ring = 40 * 4; // INLINE_MAX + 1, 1000, RING_MSG_MAX - 1, RING_MSG_MAX
        assert_eq!(pa.ring_sends(), in_ring, "of {sent} sends");
        // The owner takes nothing: the ring fills, and the rest go by process_vm_writev.
        let before = pa.ring_sends();
        for k in 0..N {
            b.post_recv(&RecvWr {
                wr_id: k as u64,
                sge: Sge {
                    addr: dst.addr() + (k * BUF) as u64,
                    len: BUF as u32,
                    lkey: dst.lkey(),
                },
            })
            .unwrap();
        }
        for k in 0..N {
            // SAFETY: the region is ours.
            unsafe { sys::copy_to_addr(src.addr(), &[k as u8; RING_MSG_MAX]) };
            a.post_send(&send_wr(k as u64, &src, RING_MSG_MAX, false))
                .unwrap();
            assert_eq!(poll_one(&mut a, "a send").status, WcStatus::Success);
        }
        assert!(
            pa.ring_sends() - before <= (RING_LEN / RING_MSG_MAX) as u64,
            "{} sends went into a ring of {} bytes nobody emptied",
            pa.ring_sends() - before,
            RING_LEN
        );
        for k in 0..N {
            let c = poll_one(&mut b, "a receive");
            assert_eq!((c.status, c.wr_id), (WcStatus::Success, k as u64));
            let mut got = vec![0u8; RING_MSG_MAX];
            // SAFETY: inside our registered region.
            unsafe { sys::copy_from_addr(dst.addr() + (k * BUF) as u64, &mut got) };
            assert!(got.iter().all(|&x| x == k as u8), "receive {k} changed");
        }
    }

    /// A sender that writes a slot pointing outside the inline ring (or claiming more than
    /// the ring or the receive holds) errors the receiver's queue pair with LocalProtection:
    /// the receiver copies nothing and does not panic.
    #[test]
    fn a_ring_slot_outside_the_ring_errors_the_receive() {
        for (off, n, used) in [
            (RING_LEN as u32 - 10, 1000u32, 1024u32),
            (0, RING_MSG_MAX as u32 + 1, RING_MSG_MAX as u32 + 64),
            (0, 1000, RING_LEN as u32 + 64),
            (0, 1000, 10),
            (u32::MAX - 8, 1000, 1024),
        ] {
            let (_pa, mut a, pb, mut b) = connected_pair();
            let dst = pb.reg_mr(64 << 10, Access::LOCAL_WRITE).unwrap();
            b.post_recv(&RecvWr {
                wr_id: 7,
                sge: Sge {
                    addr: dst.addr(),
                    len: 64 << 10,
                    lkey: dst.lkey(),
                },
            })
            .unwrap();
            // What a hostile sender's `exec` would publish for that receive.
            let peer = a.peer.as_ref().unwrap();
            let base = HDR + (a.sq_tail % peer.nslots) as usize * SLOT;
            peer.inbox
                .u32(base + S_RING_OFF)
                .store(off, Ordering::Relaxed);
            peer.inbox
                .u32(base + S_RING_USED)
                .store(used, Ordering::Relaxed);
            publish_slot(
                peer,
                &mut a.sq_tail,
                base,
                n,
                Wake {
                    reader: true,
                    engine: false,
                },
                ST_RING,
            );
            let c = poll_one(&mut b, "the bad receive");
            assert_eq!(
                (c.wr_id, c.status, c.byte_len),
                (7, WcStatus::LocalProtection, 0),
                "off {off} len {n} used {used}"
            );
            let mut got = vec![1u8; 64 << 10];
            // SAFETY: inside our registered region, not referenced elsewhere.
            unsafe { sys::copy_from_addr(dst.addr(), &mut got) };
            assert!(got.iter().all(|&x| x == 0), "bytes landed for off {off}");
        }
    }

    /// The words of an inbox's header page do not overlap: the shared copy's descriptor
    /// (`assist`) and the inbox's own fields are written by different sides for different
    /// things (the direct-wakeup count and the inline ring's tail once sat on the descriptor's
    /// claim word and done count).
    #[test]
    fn an_inbox_header_has_no_overlapping_words() {
        let mut words: Vec<(&str, usize, usize)> = vec![
            ("magic", OFF_MAGIC, 4),
            ("nslots", OFF_NSLOTS, 4),
            ("head", OFF_HEAD, 4),
            ("tail", OFF_TAIL, 4),
            ("state", OFF_STATE, 4),
            ("inflight", OFF_INFLIGHT, 4),
            ("inflight key", OFF_INFLIGHT_KEY, 4),
            ("rnr", OFF_RNR, 4),
            ("direct", OFF_DIRECT, 4),
            ("direct unread", OFF_DIRECT_UNREAD, 4),
            ("direct level", OFF_DIRECT_LEVEL, 4),
            ("direct busy", OFF_DIRECT_BUSY, 4),
            ("direct done", OFF_DIRECT_DONE, 4),
            ("ring tail", OFF_RING_TAIL, 4),
            ("self", OFF_SELF, 8),
            ("zero", OFF_ZERO, 4),
            ("settled", OFF_SETTLED, 8),
            ("counts", OFF_COUNTS, 4 * COUNTS),
        ];
        words.extend(assist::LAYOUT.iter().copied());
        words.sort_by_key(|w| w.1);
        for p in words.windows(2) {
            assert!(
                p[0].1 + p[0].2 <= p[1].1,
                "inbox words {:?} and {:?} overlap",
                p[0],
                p[1]
            );
        }
        assert!(words.last().is_some_and(|w| w.1 + w.2 <= HDR));
    }

    /// The inline ring keeps carrying SENDs after the receiver ran a shared copy of its own
    /// (its descriptor's reset once zeroed the ring's tail, so the sender saw a full ring and
    /// copied every later SEND with `process_vm_writev`).
    #[test]
    fn a_shared_copy_leaves_the_inline_ring_alone() {
        let (pa, mut a, pb, mut b) = connected_pair();
        const BUF: usize = 32 << 10;
        let src = pa.reg_mr(BUF, Access::empty()).unwrap();
        let dst = pb.reg_mr(BUF, Access::LOCAL_WRITE).unwrap();
        let send = |a: &mut ShmEndpoint, b: &mut ShmEndpoint| {
            b.post_recv(&RecvWr {
                wr_id: 1,
                sge: Sge {
                    addr: dst.addr(),
                    len: BUF as u32,
                    lkey: dst.lkey(),
                },
            })
            .unwrap();
            a.post_send(&send_wr(2, &src, RING_MSG_MAX, false)).unwrap();
            assert_eq!(poll_one(a, "a send").status, WcStatus::Success);
            assert_eq!(poll_one(b, "a receive").status, WcStatus::Success);
        };
        // More than a ring's worth through the ring, every one taken.
        for _ in 0..2 * RING_LEN / RING_MSG_MAX {
            send(&mut a, &mut b);
        }
        let before = pa.ring_sends();
        assert!(before > 0);
        // The receiver reads from the sender, a copy large enough to be shared.
        let len = assist::ASSIST_MIN;
        let remote = pa.reg_mr(len, Access::REMOTE_READ).unwrap();
        let local = pb.reg_mr(len, Access::LOCAL_WRITE).unwrap();
        b.post_send(&read_wr(3, &remote, &local, len)).unwrap();
        assert_eq!(poll_one(&mut b, "the read").status, WcStatus::Success);
        send(&mut a, &mut b);
        assert_eq!(
            pa.ring_sends(),
            before + 1,
            "the SEND after the copy missed the ring"
        );
    }

    /// Turning direct wakeups off after a shared copy does not wait out the settle bound for
    /// a count that was never the peer's (the descriptor's claim word sat on it).
    #[test]
    fn direct_wakeups_settle_at_once_after_a_shared_copy() {
        let (pa, mut a, _pb, b) = connected_pair();
        let len = assist::ASSIST_MIN;
        let remote = _pb.reg_mr(len, Access::REMOTE_READ).unwrap();
        let local = pa.reg_mr(len, Access::LOCAL_WRITE).unwrap();
        a.post_send(&read_wr(3, &remote, &local, len)).unwrap();
        assert_eq!(poll_one(&mut a, "the read").status, WcStatus::Success);
        a.set_direct_wake(true, false);
        a.set_direct_wake(false, true);
        assert_eq!(pa.settles_timed_out(), 0);
        drop(b);
    }

    /// A peer stopped (SIGSTOP, a debugger) or preempted right as its copy's system call
    /// returns, before its own code ends the announcement, does not hold a revocation of the
    /// grant for `COPY_DRAIN_MAX`: the system call ended it (a Write and a Read, each as `exec`
    /// runs them, then "stopped": the announcement's guard is never dropped).
    #[test]
    fn a_copy_ended_by_its_system_call_does_not_hold_a_revocation() {
        let (pa, mut a, pb, _b) = connected_pair();
        let src = pa.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
        for read in [false, true] {
            let access = if read {
                Access::REMOTE_READ
            } else {
                Access::LOCAL_WRITE | Access::REMOTE_WRITE
            };
            let mut theirs = pb.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
            let g = theirs.advertise(0, 8192, access).unwrap();
            let peer = a.peer.as_ref().unwrap();
            let copy = InFlight::begin(&peer.inbox, &peer.prov.bells, g.rkey, &mut a.copy_seq);
            assert!(peer.lookup(g.rkey).is_some());
            // SAFETY: both ranges are live registrations of this process, not borrowed.
            unsafe {
                if read {
                    peer.proc
                        .read(src.addr(), g.addr, 8192, peer.end_read())
                        .unwrap();
                } else {
                    peer.proc
                        .write(src.addr(), g.addr, 8192, peer.end_write())
                        .unwrap();
                }
            }
            std::mem::forget(copy);
            theirs.revoke(&g).unwrap();
            assert_eq!(pb.drains_timed_out(), 0, "read {read}");
        }
    }

    /// A peer stopped between its look at our key table and its copy's system call, however
    /// long: the region's end neither waits for it (under the runtime's lock) nor hands the
    /// memory to a new region while the copy may still land: the memory is parked, the late
    /// copy lands there, and only then is the memory used again.
    #[test]
    fn memory_a_stopped_peer_may_still_write_is_parked_not_reused() {
        let (pa, mut a, pb, _b) = connected_pair();
        let src = pa.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
        // SAFETY: our own region.
        unsafe { sys::copy_to_addr(src.addr(), &[0xab; 8192]) };
        let len = 64 << 10;
        let theirs = pb
            .reg_mr(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let (addr, rkey) = (theirs.addr(), theirs.rkey());
        let peer = a.peer.as_ref().unwrap();
        let copy = InFlight::begin(&peer.inbox, &peer.prov.bells, rkey, &mut a.copy_seq);
        assert!(peer.lookup(rkey).is_some());
        // "Stopped" here. The region goes: no wait, and its memory is not reused.
        drop(theirs);
        assert_eq!(pb.drains_timed_out(), 0);
        let next = pb.reg_mr(len, Access::LOCAL_WRITE).unwrap();
        assert_ne!(next.addr(), addr, "the parked memory served a new region");
        // "Resumed": the copy lands in the parked memory, and its system call ends it.
        // SAFETY: `addr` is still mapped (parked), not referenced by any Rust reference.
        unsafe {
            peer.proc
                .write(src.addr(), addr, 8192, peer.end_write())
                .unwrap();
        }
        drop(copy);
        let mut got = vec![0u8; 8192];
        next.read(0, &mut got);
        assert!(
            got.iter().all(|&x| x == 0),
            "the late copy reached a live region"
        );
        // Then the memory serves again.
        let again = pb.reg_mr(len, Access::LOCAL_WRITE).unwrap();
        assert_eq!(
            again.addr(),
            addr,
            "the memory stayed parked after the copy ended"
        );
    }

    /// A grant a peer may write is revoked only once a stopped peer's copy into it ended,
    /// however long past `COPY_DRAIN_MAX` (the region lives on: a late write would land in
    /// memory that serves again).
    #[test]
    fn a_writable_grant_is_revoked_only_after_a_stopped_peers_copy() {
        let (_pa, mut a, pb, _b) = connected_pair();
        let mut theirs = pb.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
        let g = theirs
            .advertise(0, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let peer = a.peer.as_ref().unwrap();
        let (ended, t) = a_late_copy(peer, g.rkey, &mut a.copy_seq);
        theirs.revoke(&g).unwrap();
        assert!(
            ended.load(Ordering::SeqCst),
            "revoked before the copy ended"
        );
        t.join().unwrap();
        assert_eq!(pb.drains_timed_out(), 0);
    }

    /// An RDMA copy (each chunk of a shared one) may run only while the peer is open: one
    /// tearing the connection down marks its inbox closed and then notes only the copy
    /// announced before that (`drain_own`), so a chunk announced after must not run, though
    /// the region's key is still good.
    #[test]
    fn no_rdma_copy_runs_into_a_closed_peer() {
        let (_pa, a, pb, b) = connected_pair();
        let theirs = pb
            .reg_mr(8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let peer = a.peer.as_ref().unwrap();
        let rb = RemoteBuf {
            addr: theirs.addr(),
            rkey: theirs.rkey(),
        };
        assert!(peer.may_copy(rb, 8192, Access::REMOTE_WRITE));
        // The first step of the owner's teardown (`fail`, the drop), its region still there.
        b.inbox.u32(OFF_STATE).store(1, Ordering::SeqCst);
        assert!(peer.covers(rb, 8192, Access::REMOTE_WRITE));
        assert!(!peer.may_copy(rb, 8192, Access::REMOTE_WRITE));
    }

    /// A shared RDMA Read whose helper claimed a chunk and has not copied it (stopped, or
    /// preempted) parks the sink's memory if the sink is let go meanwhile (the connection
    /// torn down): the helper's late chunk cannot land in memory that serves another region.
    #[test]
    fn a_shared_reads_sink_waits_for_the_helpers_chunks() {
        let (pa, mut a, pb, _b) = connected_pair();
        let len = assist::ASSIST_MIN;
        let remote = pb.reg_mr(len, Access::REMOTE_READ).unwrap();
        // The "helper": claims one chunk of our descriptor as soon as one is published, then
        // stops; the test ends its chunk later.
        let inbox = a.inbox.clone();
        let claimed = Arc::new(AtomicBool::new(false));
        let sink = loop {
            let local = pa.reg_mr(len, Access::LOCAL_WRITE).unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let t = {
                let (inbox, claimed, stop) = (inbox.clone(), claimed.clone(), stop.clone());
                std::thread::spawn(move || {
                    let claim = inbox.u64(assist::A_CLAIM);
                    let seen = claim.load(Ordering::Acquire) >> 32;
                    while !stop.load(Ordering::Relaxed) {
                        let c = claim.load(Ordering::Acquire);
                        if c >> 32 != seen
                            && c as u32 != u32::MAX
                            && (c as u32) < 4
                            && claim
                                .compare_exchange(c, c + 1, Ordering::AcqRel, Ordering::Acquire)
                                .is_ok()
                        {
                            claimed.store(true, Ordering::SeqCst);
                            return;
                        }
                        std::hint::spin_loop();
                    }
                })
            };
            a.post_send(&read_wr(5, &remote, &local, len)).unwrap();
            stop.store(true, Ordering::Relaxed);
            t.join().unwrap();
            if claimed.load(Ordering::SeqCst) {
                break local;
            }
            // The helper thread got no chunk this time (we copied them all): again.
            poll_one(&mut a, "a read nobody helped with");
        };
        // The connection goes (its sink with it) while the helper's chunk is outstanding.
        let addr = sink.addr();
        drop(sink);
        let next = pb.reg_mr(len, Access::LOCAL_WRITE).unwrap();
        let next_a = pa.reg_mr(len, Access::LOCAL_WRITE).unwrap();
        assert_ne!(
            next_a.addr(),
            addr,
            "the sink's memory served again under a live chunk"
        );
        // The helper's chunk ends (its count reaches the one the initiator waits for).
        a.inbox.u32(assist::A_DONE).store(1, Ordering::Release);
        let again = pa.reg_mr(len, Access::LOCAL_WRITE).unwrap();
        assert_eq!(
            again.addr(),
            addr,
            "the memory stayed parked after the chunk ended"
        );
        drop((next, next_a, again));
    }

    /// A peer that died in the middle of an RDMA copy of our memory leaves the count it raised
    /// in our bell page (`B_COPIES`): the connection's teardown takes it back, so later
    /// deregistrations do not look at every inbox for ever.
    #[test]
    fn a_dead_peers_copy_count_is_taken_back() {
        let (_pa, mut a, pb, b) = connected_pair();
        let theirs = pb
            .reg_mr(8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let peer = a.peer.as_ref().unwrap();
        let copy = InFlight::begin(
            &peer.inbox,
            &peer.prov.bells,
            theirs.rkey(),
            &mut a.copy_seq,
        );
        std::mem::forget(copy);
        assert_eq!(pb.inner.bells.u32(B_COPIES).load(Ordering::SeqCst), 1);
        // The copier "dies": the teardown's note names a peer that exited.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let dead = Arc::new(Proc::open(child.id() as i32).unwrap());
        child.kill().unwrap();
        child.wait().unwrap();
        let v = b.inbox.u32(OFF_INFLIGHT).load(Ordering::SeqCst);
        assert_eq!(v & 1, 1);
        pb.inner.linger(Linger {
            inbox: b.inbox.clone(),
            until: Until::Moves(v),
            key: theirs.rkey(),
            peer: Some(dead),
        });
        assert_eq!(pb.inner.bells.u32(B_COPIES).load(Ordering::SeqCst), 0);
        let looks = pb.inboxes_drained();
        drop(
            pb.reg_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap(),
        );
        assert_eq!(
            pb.inboxes_drained(),
            looks,
            "a deregistration looked at every inbox"
        );
        drop(theirs);
    }

    /// A Read's bytes are delivered only if the source was still advertised after the copy:
    /// a source whose owner withdrew it meanwhile (it gave up waiting for a reader stopped
    /// before its copy's system call, then changed the buffer) fails the Read.
    #[test]
    fn a_read_of_a_withdrawn_source_is_not_delivered() {
        let (_pa, a, pb, _b) = connected_pair();
        let mut theirs = pb.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
        let g = theirs.advertise(4096, 4096, Access::REMOTE_READ).unwrap();
        let peer = a.peer.as_ref().unwrap();
        let rb = RemoteBuf {
            addr: g.addr,
            rkey: g.rkey,
        };
        assert_eq!(read_still_good(peer, true, rb, 4096), Ok(()));
        // Past the grant's range: not covered.
        assert_eq!(
            read_still_good(peer, true, rb, 4097),
            Err(WcStatus::RemoteAccess)
        );
        theirs.revoke(&g).unwrap();
        assert_eq!(
            read_still_good(peer, true, rb, 4096),
            Err(WcStatus::RemoteAccess)
        );
        // A new grant of the same bytes has a key of its own: the old one stays dead.
        let g2 = theirs.advertise(4096, 4096, Access::REMOTE_READ).unwrap();
        assert_ne!(g2.rkey, g.rkey);
        assert_eq!(
            read_still_good(peer, true, rb, 4096),
            Err(WcStatus::RemoteAccess)
        );
        // Writes are not looked at again (the owner's drain covers them).
        assert_eq!(read_still_good(peer, false, rb, 4096), Ok(()));
    }

    /// The caller's own memory (`reg_mr_at`) is waited for however long a stopped peer's copy
    /// takes, past `COPY_DRAIN_MAX`, since the caller gets it back: the region's end returns
    /// only after that copy ended.
    #[test]
    fn the_callers_memory_is_let_go_only_after_a_stopped_peers_copy() {
        let (_pa, mut a, pb, _b) = connected_pair();
        let mut buf = vec![0u8; 4096];
        // SAFETY: `buf` outlives the region (dropped below, before `buf`).
        let theirs = unsafe {
            pb.reg_mr_at(
                NonNull::new(buf.as_mut_ptr()).unwrap(),
                4096,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )
        }
        .unwrap();
        let peer = a.peer.as_ref().unwrap();
        let (ended, t) = a_late_copy(peer, theirs.rkey(), &mut a.copy_seq);
        drop(theirs);
        assert!(ended.load(Ordering::SeqCst), "let go before the copy ended");
        t.join().unwrap();
        assert_eq!(pb.drains_timed_out(), 0);
        drop(buf);
    }

    /// Deregistering a region marks the receives posted in it bad (and only those).
    #[test]
    fn a_freed_regions_memory_serves_the_next_under_new_keys() {
        let p = ShmProvider::new().unwrap();
        let a = p
            .reg_mr(32 << 10, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let (addr, rkey) = (a.addr(), a.rkey());
        drop(a);
        let b = p
            .reg_mr(32 << 10, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        // The same memory (no mmap, no page faults), reached only through the new key.
        assert_eq!(b.addr(), addr);
        assert_ne!(b.rkey(), rkey);
        let regs = p.inner.regs.read();
        assert!(!regs.check_remote(rkey, addr, 64, Access::REMOTE_WRITE));
        assert!(regs.check_remote(b.rkey(), addr, 64, Access::REMOTE_WRITE));
        drop(regs);
        // Another size gets fresh memory; the cache is bounded.
        let c = p.reg_mr(64 << 10, Access::LOCAL_WRITE).unwrap();
        assert_ne!(c.addr(), addr);
        drop((b, c));
        assert!(p.inner.map_cache.lock().0 <= MAP_CACHE_BYTES);
    }

    /// A shared listener hands a request on only once its connect request came, and holds at
    /// most its backlog of requests waiting for theirs (the kernel's queue keeps the rest): a
    /// review found the bound never applied (any local process can reach the rendezvous name).
    #[test]
    fn a_shared_listener_holds_at_most_its_backlog_of_silent_requests() {
        let p = ShmProvider::new().unwrap();
        let (_tcp, port) = sys::tcp_reserve("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut l = p.listen(addr, 2, QpCaps::default()).unwrap();
        let (tx, rx) = sys::seqpacket_pair().unwrap();
        l.set_handoff(tx).unwrap();
        let silent: Vec<OwnedFd> = (0..5)
            .filter_map(|_| sys::seqpacket_connect(&rendezvous_name(addr)).ok())
            .collect();
        assert!(silent.len() >= 3, "the kernel took only {}", silent.len());
        for _ in 0..20 {
            assert!(l.poll_request().is_none());
            std::thread::sleep(LISTEN_CHECK * 2);
        }
        assert_eq!(l.unready.len(), 2, "held beyond the backlog");
        assert_eq!(l.handed_off(), 0, "handed before their connect request");
        // One speaks: it is handed on, and room is made for one more.
        sys::send_msg(silent[0].as_fd(), b"REQ", &[]).unwrap();
        for _ in 0..20 {
            assert!(l.poll_request().is_none());
            std::thread::sleep(LISTEN_CHECK * 2);
        }
        assert_eq!(l.handed_off(), 1);
        assert_eq!(l.unready.len(), 2);
        let mut buf = [0u8; 8];
        assert!(matches!(sys::recv_msg(rx.as_fd(), &mut buf), Recv::Msg(1, fds) if fds.len() == 1));
    }

    /// A connector whose SEND met no receive before the acceptor took its RTU (it asked to be
    /// woken, `OFF_RNR`) is woken when the acceptor, having posted a receive meanwhile,
    /// attaches it at the RTU: not left to its retry timer (a review's finding, 2026-11-26).
    #[test]
    fn a_send_that_met_no_receive_before_the_rtu_is_woken_at_it() {
        let (a, mut ca, b, mut cb) = accepted_pair();
        let end = Instant::now() + Duration::from_secs(10);
        // The connector is established (it sent its RTU); the acceptor has not looked yet.
        while !matches!(ca.poll_cm(), Some(CmEvent::Established { .. })) {
            assert!(Instant::now() < end, "connector not established");
            std::thread::sleep(Duration::from_millis(1));
        }
        let src = a.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        ca.post_send(&send_wr(1, &src, 64, false)).unwrap();
        ca.progress();
        assert_eq!(cb.inbox.u32(OFF_RNR).load(Ordering::Relaxed), 1, "no RNR");
        // The connector's progress thread goes to sleep; the acceptor posts a receive, then
        // takes the RTU.
        a.arm().unwrap();
        let notify = a.notify_fd().unwrap();
        assert!(!sys::poll_readable(notify, 0), "woken before the receive");
        let dst = b.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        cb.post_recv(&RecvWr {
            wr_id: 2,
            sge: Sge {
                addr: dst.addr(),
                len: 64,
                lkey: dst.lkey(),
            },
        })
        .unwrap();
        // The RTU attaches the connector and establishes the acceptor.
        while !matches!(cb.poll_cm(), Some(CmEvent::Established { .. })) {
            assert!(Instant::now() < end, "acceptor not established");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(cb.peer.is_some());
        assert!(
            sys::poll_readable(notify, 0),
            "the connector waiting on RNR was not woken at the RTU"
        );
        assert_eq!(cb.inbox.u32(OFF_RNR).load(Ordering::Relaxed), 0);
        assert_eq!(poll_one(&mut ca, "the send").status, WcStatus::Success);
    }

    #[test]
    fn dereg_marks_posted_receives_in_the_region_bad() {
        let (_fd, ib, nslots) = new_inbox(8).unwrap();
        for (i, (addr, len)) in [(0x1000u64, 64u32), (0x9000, 64), (0x1f00, 0x200)]
            .iter()
            .enumerate()
        {
            let base = HDR + i * SLOT;
            ib.u64(base + S_ADDR).store(*addr, Ordering::Relaxed);
            ib.u32(base + S_LEN).store(*len, Ordering::Relaxed);
        }
        ib.u32(OFF_HEAD).store(3, Ordering::Relaxed);
        mark_bad_recvs(&ib, nslots, 0x1000, 0x1000);
        let bad: Vec<u32> = (0..3)
            .map(|i| ib.u32(HDR + i * SLOT + S_BAD).load(Ordering::Relaxed))
            .collect();
        assert_eq!(bad, [1, 0, 1]);
    }
}
