//! Shared copies: a large RDMA Read or Write is copied by both processes at once.
//!
//! A one-sided operation over shm is a cross-process copy (`process_vm_readv`/`writev`) that the
//! initiator runs by itself, at the speed of one core. The other process is usually idle at that
//! moment, spinning in a wait for exactly this transfer (the SDP source of a Read waits for the
//! RdmaRdCompl, a Write's target for its sink to fill), so the initiator publishes the operation
//! in its inbox as a row of chunks, and both sides take chunks until none are left:
//!
//! * the initiator claims chunks with `fetch_add` on the claim word and copies them;
//! * the peer, whenever it polls the connection, claims chunks with a compare-and-swap (only of
//!   the generation it read the descriptor under) and copies them the other way round:
//!   `process_vm_writev` from its registered source into the initiator's buffer for a Read,
//!   `process_vm_readv` from the initiator's buffer into its registered sink for a Write;
//! * when every chunk is claimed, the initiator withdraws the descriptor, waits for the chunks
//!   the peer claimed to be counted done, and completes the work request as before.
//!
//! The peer checks the operation against its own key table (rkey, range, REMOTE_READ or
//! REMOTE_WRITE) exactly as the initiator does against the peer's, and holds its registrations'
//! read lock while copying, so it only ever reads or writes memory it registered and
//! advertised, for the time the operation lasts. A peer that never helps (busy, asleep, or an
//! older build) costs nothing: the initiator copies every chunk itself.
//!
//! The descriptor is a seqlock whose sequence is the claim word: the initiator stores a
//! withdrawn word, writes the fields, then publishes `(generation, 0)`; a helper reads the
//! word, the fields, and claims with a compare-and-swap from the word it read, which fails if
//! the fields changed in between.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use super::{COUNTS, OFF_COUNTS};
use crate::sys::{self, CopyEnd, Mapping, Proc};

/// Claim word: generation (high 32 bits) and next chunk (low 32 bits, `IDLE`: withdrawn).
pub(super) const A_CLAIM: usize = 512;
const A_OP: usize = 520;
const A_RKEY: usize = 524;
/// The helper's address (its registered source or sink).
const A_RADDR: usize = 528;
/// The initiator's address (its local buffer).
const A_LADDR: usize = 536;
const A_LEN: usize = 544;
const A_CHUNK: usize = 552;
/// Chunks the helper finished (its own cache line: the initiator polls it).
pub(super) const A_DONE: usize = 576;
/// Set by the helper when one of its copies failed.
const A_ERR: usize = 580;

/// The descriptor's words in the initiator's inbox (name, offset, length), for the check that
/// no other word of the inbox overlaps them.
#[cfg(test)]
pub(super) const LAYOUT: [(&str, usize, usize); 9] = [
    ("assist claim", A_CLAIM, 8),
    ("assist op", A_OP, 4),
    ("assist rkey", A_RKEY, 4),
    ("assist raddr", A_RADDR, 8),
    ("assist laddr", A_LADDR, 8),
    ("assist len", A_LEN, 8),
    ("assist chunk", A_CHUNK, 8),
    ("assist done", A_DONE, 4),
    ("assist err", A_ERR, 4),
];

const IDLE: u32 = u32::MAX;
/// What is being copied, which decides the direction and what the helper checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    /// RDMA Read: the helper's registered source (REMOTE_READ) into the initiator's buffer.
    Read = 1,
    /// RDMA Write: the initiator's buffer into the helper's registered sink (REMOTE_WRITE).
    Write = 2,
    /// SEND: the initiator's buffer into a receive the helper posted.
    Send = 3,
}

impl Op {
    fn from_u32(v: u32) -> Option<Op> {
        match v {
            1 => Some(Op::Read),
            2 => Some(Op::Write),
            3 => Some(Op::Send),
            _ => None,
        }
    }
}

/// RDMA Reads and Writes at least this long are shared.
pub(super) const ASSIST_MIN: usize = 256 * 1024;
/// SENDs at least this long are shared.
pub(super) const ASSIST_MIN_SEND: usize = 32 * 1024;
const CHUNK_MIN: u64 = 16 * 1024;
const CHUNK_MAX: u64 = 512 * 1024;
const MAX_CHUNKS: u64 = 1 << 16;
/// How long the initiator spins on the helper's last chunks before it also yields the CPU.
#[cfg(test)]
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(200);

/// Chunks for an operation of `len` bytes: SENDs in halves (they are short and the receiver
/// may be busy), one-sided operations in eighths; whole pages, within bounds.
fn chunk_for(op: Op, len: u64) -> u64 {
    let parts = if op == Op::Send { 2 } else { 8 };
    ((len.div_ceil(parts)).clamp(CHUNK_MIN, CHUNK_MAX) + 4095) & !4095
}

/// How long the initiator waits by itself (polling) for the helper's last chunks before it
/// leaves them to later polls (`Pending`): the helper copies a chunk right after claiming it, so
/// this covers a helper that runs; one that was preempted or stopped must not hold us.
const SETTLE_SPIN: Duration = Duration::from_micros(20);

/// An operation whose own chunks are done, waiting for chunks the peer claimed: it must not
/// complete before they are (the peer's copy may still touch our buffer).
#[derive(Debug)]
pub(super) struct Pending {
    theirs: u64,
    res: io::Result<()>,
}

/// How [`start_shared`] left an operation.
pub(super) enum Started {
    Done(io::Result<()>),
    Waiting(Pending),
}

impl Pending {
    /// The operation's result once the peer's chunks are done; `None` while they are not.
    /// `sock` is the connection's rendezvous socket: a peer that is gone (hung up) takes its
    /// memory with it, and its chunks will never be counted.
    pub(super) fn poll(
        &mut self,
        inbox: &Mapping,
        sock: Option<BorrowedFd<'_>>,
    ) -> Option<io::Result<()>> {
        if u64::from(inbox.u32(A_DONE).load(Ordering::Acquire)) >= self.theirs {
            let res = std::mem::replace(&mut self.res, Ok(()));
            if inbox.u32(A_ERR).load(Ordering::Acquire) != 0 && res.is_ok() {
                return Some(Err(io::Error::from_raw_os_error(libc::EFAULT)));
            }
            return Some(res);
        }
        if sock.is_some_and(|s| sys::hung_up(s.as_raw_fd())) {
            return Some(Err(io::Error::from_raw_os_error(libc::ESRCH)));
        }
        None
    }

    /// The count of the helper's chunks done (`A_DONE`) that ends the operation.
    pub(super) fn theirs(&self) -> u32 {
        self.theirs.min(u64::from(u32::MAX)) as u32
    }

    /// Wait until [`Pending::poll`] has the result (tests).
    #[cfg(test)]
    pub(super) fn wait(mut self, inbox: &Mapping, sock: Option<BorrowedFd<'_>>) -> io::Result<()> {
        let start = Instant::now();
        loop {
            if let Some(r) = self.poll(inbox, sock) {
                return r;
            }
            if start.elapsed() > SPIN_BEFORE_YIELD {
                std::thread::sleep(Duration::from_micros(200));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// The initiator's side of one operation: copy `len` bytes between our `local` buffer and the
/// peer's `remote` address (a Read: peer to us), sharing the chunks with the peer if it polls.
/// `rkey` is the peer's key of the remote range (unused for a SEND).
/// `sock` is the connection's rendezvous socket, whose hang-up tells the peer is gone (its
/// memory with it), the one case where we stop waiting for chunks it claimed. `still_ok` is
/// asked before each of our chunks whether the remote range may still be touched (the peer
/// may deregister or revoke it meanwhile: then we copy no more and fail with `EACCES`); it
/// announces each chunk first. `end`: the word each chunk's system call writes after its data
/// (the end of that announcement, `sys::CopyEnd`).
/// Our own chunks are done when this returns; chunks the peer claimed may not be (it was
/// preempted, or stopped): then the operation is `Waiting`, and must not complete (nor its
/// buffer be reused) before [`Pending::poll`] says so. Nothing here waits for long on the peer.
///
/// # Safety
/// `local..local + len` is valid memory of this process until the operation is over (this
/// returned `Done`, or its `Pending` gave a result), readable for a Write and a SEND, writable
/// and not referenced by Rust references for a Read, inside a registration that stays live
/// that long.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn start_shared(
    inbox: &Mapping,
    gen: &mut u32,
    ask: &dyn Fn(),
    peer: &Proc,
    sock: Option<BorrowedFd<'_>>,
    still_ok: &mut dyn FnMut() -> bool,
    end: Option<CopyEnd>,
    op: Op,
    rkey: u32,
    local: u64,
    remote: u64,
    len: usize,
) -> Started {
    let len64 = len as u64;
    let read = op == Op::Read;
    let chunk = chunk_for(op, len64);
    let n = len64.div_ceil(chunk);
    *gen = gen.wrapping_add(1).max(1);
    let g = *gen;
    let claim = inbox.u64(A_CLAIM);
    // Ask the peer's help now (a head start: it is often asleep or busy) and again once the
    // copy is published below (a peer that looked in between saw nothing to help with).
    ask();
    // Withdrawn (it already is, unless a peer scribbled on our inbox), then the fields.
    claim.store(u64::from(g) << 32 | u64::from(IDLE), Ordering::Relaxed);
    fence(Ordering::Release);
    inbox.u32(A_OP).store(op as u32, Ordering::Relaxed);
    inbox.u32(A_RKEY).store(rkey, Ordering::Relaxed);
    inbox.u64(A_RADDR).store(remote, Ordering::Relaxed);
    inbox.u64(A_LADDR).store(local, Ordering::Relaxed);
    inbox.u64(A_LEN).store(len64, Ordering::Relaxed);
    inbox.u64(A_CHUNK).store(chunk, Ordering::Relaxed);
    inbox.u32(A_DONE).store(0, Ordering::Relaxed);
    inbox.u32(A_ERR).store(0, Ordering::Relaxed);
    claim.store(u64::from(g) << 32, Ordering::Release);
    ask();

    let mut mine = 0u64;
    // One liveness check for our chunks.
    let mut res = peer.check();
    // At most `n` claims: a peer that writes the claim word back (it can write our inbox)
    // cannot keep us copying.
    for _ in 0..n {
        let c = claim.fetch_add(1, Ordering::AcqRel);
        let i = u64::from(c as u32);
        if (c >> 32) as u32 != g || i >= n {
            break;
        }
        mine += 1;
        if res.is_err() {
            continue; // claim the rest so the peer stops, but copy no more
        }
        if !still_ok() {
            res = Err(io::Error::from_raw_os_error(libc::EACCES));
            continue;
        }
        let off = i * chunk;
        let l = (len64 - off).min(chunk) as usize;
        // SAFETY: a sub-range of the caller's buffer (see the function's contract); the
        // remote range is the peer's, checked against its key table by the caller.
        res = unsafe {
            peer.copy_in_batch(!read, local + off, remote + off, l, end)
                .map(drop)
        };
    }
    claim.store(u64::from(g) << 32 | u64::from(IDLE), Ordering::Release);

    // The peer's chunks: it copies each one right after claiming it, so this is short unless
    // it was preempted or stopped; then the operation waits without us.
    let mut p = Pending {
        theirs: n - mine.min(n),
        res,
    };
    let start = Instant::now();
    loop {
        if let Some(r) = p.poll(inbox, sock) {
            return Started::Done(r);
        }
        if start.elapsed() > SETTLE_SPIN {
            return Started::Waiting(p);
        }
        std::hint::spin_loop();
    }
}

/// [`start_shared`], then wait for the peer's chunks however long they take (tests).
///
/// # Safety
/// As [`start_shared`].
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn copy_shared(
    inbox: &Mapping,
    gen: &mut u32,
    peer: &Proc,
    sock: Option<BorrowedFd<'_>>,
    still_ok: &mut dyn FnMut() -> bool,
    op: Op,
    rkey: u32,
    local: u64,
    remote: u64,
    len: usize,
) -> io::Result<()> {
    // SAFETY: the caller's contract is start_shared's.
    match unsafe {
        start_shared(
            inbox,
            gen,
            &|| {},
            peer,
            sock,
            still_ok,
            None,
            op,
            rkey,
            local,
            remote,
            len,
        )
    } {
        Started::Done(r) => r,
        Started::Waiting(p) => p.wait(inbox, sock),
    }
}

/// What a helper checks before it copies: `check(op, rkey, addr, len)` is true if our memory
/// `addr..addr + len` is inside our registration `rkey` with REMOTE_READ (a Read) or
/// REMOTE_WRITE (a Write), or inside a receive we posted (a SEND).
pub(super) type CheckRange<'a> = &'a dyn Fn(Op, u32, u64, u64) -> bool;

/// Whether the peer has an operation published (one load: this runs at every poll).
pub(super) fn pending(peer_inbox: &Mapping) -> bool {
    let c = peer_inbox.u64(A_CLAIM).load(Ordering::Relaxed);
    c >> 32 != 0 && c as u32 != IDLE
}

/// The helper's side: take and copy chunks of the peer's published operation, if any.
/// `peer_inbox` is the peer's inbox (at `peer_va` in the peer's memory, 0 if unknown); the
/// caller keeps what `check` says true (holds the registrations' lock) until this returns.
/// Returns the chunks copied.
///
/// Our count of chunks done (`A_DONE`, which only we write during an operation) is written by
/// each chunk's own system call after its data (`sys::CopyEnd`): a helper stopped or preempted
/// as that call returns does not hold the initiator, which waits for the count.
pub(super) fn help(peer_inbox: &Mapping, peer_va: u64, peer: &Proc, check: CheckRange<'_>) -> u32 {
    let claim = peer_inbox.u64(A_CLAIM);
    let mut c = claim.load(Ordering::Acquire);
    let g = (c >> 32) as u32;
    if g == 0 || c as u32 == IDLE {
        return 0;
    }
    let op = peer_inbox.u32(A_OP).load(Ordering::Relaxed);
    let rkey = peer_inbox.u32(A_RKEY).load(Ordering::Relaxed);
    let raddr = peer_inbox.u64(A_RADDR).load(Ordering::Relaxed);
    let laddr = peer_inbox.u64(A_LADDR).load(Ordering::Relaxed);
    let len = peer_inbox.u64(A_LEN).load(Ordering::Relaxed);
    let chunk = peer_inbox.u64(A_CHUNK).load(Ordering::Relaxed);
    fence(Ordering::Acquire);
    // A torn or hostile descriptor is simply not helped with (the initiator copies alone).
    let Some(op) = Op::from_u32(op) else {
        return 0;
    };
    let read = op == Op::Read;
    if chunk < 4096 || len == 0 || len.div_ceil(chunk) > MAX_CHUNKS || !check(op, rkey, raddr, len)
    {
        return 0;
    }
    let n = len.div_ceil(chunk);
    // The initiator is alive for as long as it is counting our chunks, unless it died: then
    // its pid must not be written (its descriptor claims are checked below, copies skipped).
    let alive = peer.alive_recently();
    let done_word = peer_inbox.u32(A_DONE);
    let mut copied = 0;
    loop {
        // At most `n` chunks: an initiator that writes its claim word back cannot keep us
        // copying (with our registrations' lock held).
        if (c >> 32) as u32 != g || u64::from(c as u32) >= n || u64::from(copied) >= n {
            return copied;
        }
        match claim.compare_exchange_weak(c, c + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                let off = u64::from(c as u32) * chunk;
                let l = (len - off).min(chunk) as usize;
                let count = done_word.load(Ordering::Relaxed).wrapping_add(1);
                // The count's new value: from our stack into the initiator's inbox (we write
                // its memory), or from its table of counts into our mapping of its inbox.
                let end = if peer_va == 0 {
                    None
                } else if read {
                    Some(CopyEnd {
                        local: &count as *const u32 as u64,
                        remote: peer_va + A_DONE as u64,
                    })
                } else {
                    ((count as usize) < COUNTS).then(|| CopyEnd {
                        local: peer_inbox.ptr().as_ptr() as u64 + A_DONE as u64,
                        remote: peer_va + (OFF_COUNTS + 4 * count as usize) as u64,
                    })
                };
                // SAFETY: `raddr + off .. + l` is inside our registration `rkey` (checked
                // above, kept live by the caller); the kernel checks the peer's range; `count`
                // lives across the call.
                let r = if !alive {
                    Err(io::Error::from_raw_os_error(libc::ESRCH))
                } else {
                    // SAFETY: see above.
                    unsafe {
                        peer.copy_in_batch(read, raddr + off, laddr.wrapping_add(off), l, end)
                    }
                };
                match r {
                    // The system call wrote the count: not again (the initiator may already
                    // have completed and started its next operation, whose count starts at 0).
                    Ok(true) => {}
                    Ok(false) => done_word.store(count, Ordering::Release),
                    Err(_) => {
                        peer_inbox.u32(A_ERR).store(1, Ordering::Relaxed);
                        done_word.store(count, Ordering::Release);
                    }
                }
                copied += 1;
                c = claim.load(Ordering::Acquire);
            }
            Err(now) => c = now,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU32};
    use std::sync::Arc;

    /// Both sides of a shared copy in one process (the "peer" is a thread polling our inbox):
    /// every byte arrives in both directions, and the helper's chunks are counted.
    #[test]
    fn shared_copy_with_a_helper_thread() {
        let inbox = Arc::new(Mapping::anon(8192).unwrap());
        let n = (3 << 20) + 4321;
        let theirs: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4096) as u8).collect();
        let theirs_addr = theirs.as_ptr() as u64;
        let stop = Arc::new(AtomicBool::new(false));
        let helped = Arc::new(AtomicU32::new(0));
        let h = {
            let (inbox, stop, helped) = (inbox.clone(), stop.clone(), helped.clone());
            std::thread::spawn(move || {
                let me = Proc::open(sys::getpid_now()).unwrap();
                // The helper's only registration: `theirs`, rkey 7.
                let check = |_op: Op, rkey: u32, addr: u64, len: u64| {
                    rkey == 7 && addr >= theirs_addr && addr + len <= theirs_addr + n as u64
                };
                // Our count of chunks done written by the copies' own system calls.
                let va = inbox.ptr().as_ptr() as u64;
                while !stop.load(Ordering::Relaxed) {
                    helped.fetch_add(help(&inbox, va, &me, &check), Ordering::Relaxed);
                }
            })
        };
        let mut gen = 0;
        let me = Proc::open(sys::getpid_now()).unwrap();
        let mut mine = vec![0u8; n];
        // At least 20 rounds, and on until the helper took a chunk: on a loaded machine its
        // thread may not get a CPU during the first ones (bounded, then the assert below says).
        for round in 0..2000u32 {
            if round >= 20 && helped.load(Ordering::Relaxed) > 0 {
                break;
            }
            let round = round as u8;
            mine.iter_mut().for_each(|b| *b = round);
            // SAFETY: `mine` is live and not borrowed across the call; `theirs` is only read.
            let r = unsafe {
                copy_shared(
                    &inbox,
                    &mut gen,
                    &me,
                    None,
                    &mut || true,
                    Op::Read,
                    7,
                    mine.as_mut_ptr() as u64,
                    theirs_addr,
                    n,
                )
            };
            r.unwrap();
            assert!(mine == theirs, "round {round}");
        }
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
        assert!(
            helped.load(Ordering::Relaxed) > 0,
            "the helper thread took no chunk in 2000 copies"
        );
    }

    /// A child process that does nothing with its memory (the helper's writes go there), and
    /// its pidfd.
    fn idle_child() -> (std::process::Child, Proc) {
        let child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let peer = Proc::open(child.id() as i32).unwrap();
        (child, peer)
    }

    /// An initiator that keeps writing its claim word back (it can write the inbox we help
    /// with) cannot keep the helper copying: at most the operation's chunks are taken.
    #[test]
    fn a_claim_word_written_back_does_not_hold_the_helper() {
        let inbox = Arc::new(Mapping::anon(8192).unwrap());
        let buf = vec![0u8; 1 << 20];
        let base = buf.as_ptr() as u64;
        let (mut child, peer) = idle_child();
        let n = 8u64;
        inbox.u32(A_OP).store(Op::Read as u32, Ordering::Relaxed);
        inbox.u32(A_RKEY).store(7, Ordering::Relaxed);
        inbox.u64(A_RADDR).store(base, Ordering::Relaxed);
        inbox.u64(A_LADDR).store(0x10000, Ordering::Relaxed);
        inbox.u64(A_LEN).store(n * 65536, Ordering::Relaxed);
        inbox.u64(A_CHUNK).store(65536, Ordering::Relaxed);
        inbox.u64(A_CLAIM).store(1 << 32, Ordering::Release);
        // For 100 ms (a helper without the bound copies until then, then returns).
        let t = {
            let inbox = inbox.clone();
            std::thread::spawn(move || {
                let start = Instant::now();
                while start.elapsed() < Duration::from_millis(100) {
                    inbox.u64(A_CLAIM).store(1 << 32, Ordering::Release);
                    std::hint::spin_loop();
                }
            })
        };
        // (The writer runs first.)
        std::thread::sleep(Duration::from_millis(5));
        let check = |_op: Op, rkey: u32, addr: u64, len: u64| {
            rkey == 7 && addr >= base && addr + len <= base + buf.len() as u64
        };
        let copied = help(&inbox, 0, &peer, &check);
        t.join().unwrap();
        let _ = child.kill();
        let _ = child.wait();
        assert!(u64::from(copied) <= n, "{copied} chunks of {n}");
    }

    /// Random descriptors in a peer's inbox never make the helper panic, never copy without
    /// the check passing, and every chunk it claims is counted done.
    #[test]
    fn garbage_descriptors_are_survived() {
        let inbox = Mapping::anon(8192).unwrap();
        let buf = vec![0u8; 1 << 20];
        let base = buf.as_ptr() as u64;
        let (mut child, peer) = idle_child();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut copied = 0;
        for i in 0..20_000u64 {
            let pick = |v: u64, good: u64| if v.is_multiple_of(3) { good } else { v };
            let c = pick(next(), (i + 1) << 32 | (next() % 4));
            inbox.u64(A_CLAIM).store(c, Ordering::Relaxed);
            inbox
                .u32(A_OP)
                .store(pick(next(), 1 + next() % 3) as u32, Ordering::Relaxed);
            inbox
                .u32(A_RKEY)
                .store(pick(next(), 7) as u32, Ordering::Relaxed);
            inbox
                .u64(A_RADDR)
                .store(pick(next(), base + next() % 4096), Ordering::Relaxed);
            inbox.u64(A_LADDR).store(next(), Ordering::Relaxed);
            inbox
                .u64(A_LEN)
                .store(pick(next(), next() % (1 << 19)), Ordering::Relaxed);
            inbox
                .u64(A_CHUNK)
                .store(pick(next(), 4096 << (next() % 6)), Ordering::Relaxed);
            inbox.u32(A_DONE).store(0, Ordering::Relaxed);
            let checked = std::cell::Cell::new(false);
            let check = |_op: Op, rkey: u32, addr: u64, len: u64| {
                let ok = rkey == 7
                    && addr >= base
                    && addr
                        .checked_add(len)
                        .is_some_and(|e| e <= base + buf.len() as u64);
                checked.set(checked.get() || ok);
                ok
            };
            let n = help(&inbox, 0, &peer, &check);
            assert!(n == 0 || checked.get());
            assert_eq!(inbox.u32(A_DONE).load(Ordering::Relaxed), n);
            copied += n;
        }
        let _ = child.kill();
        let _ = child.wait();
        // Some descriptors were well formed: the helper did copy (into the child).
        assert!(copied > 0);
    }

    #[test]
    fn chunks_are_page_multiples_within_bounds() {
        let lens = [ASSIST_MIN_SEND as u64, 1 << 20, 3 << 20, 64 << 20, 12345];
        for (op, len) in [Op::Read, Op::Write, Op::Send]
            .into_iter()
            .flat_map(|op| lens.map(|l| (op, l)))
        {
            let c = chunk_for(op, len);
            assert_eq!(c % 4096, 0);
            assert!((CHUNK_MIN..=CHUNK_MAX).contains(&c), "{len}: {c}");
            assert!(len.div_ceil(c) <= MAX_CHUNKS);
        }
    }
}
