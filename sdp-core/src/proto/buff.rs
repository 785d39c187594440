//! Buffers: registered memory a connection sends and receives through (BCopy).
//!
//! The engine never owns the memory itself: a driver supplies a [`BufStore`] backed by memory
//! regions of its provider, and the engine names buffers by [`Buf`] descriptors. All access to the
//! bytes goes through the store's `read`/`write`, so no reference to memory the HCA may write is
//! ever held by the engine.
//!
//! [`Pool`] keeps a connection's buffers of one role (send or receive) and their free list, so a
//! busy connection reuses registrations instead of registering per message, and an idle one gives
//! them back ([`Pool::trim`]).

use crate::verbs::Sge;

/// A registered buffer: the store's id for it and where it is for the HCA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Buf {
    pub id: u32,
    pub addr: u64,
    pub lkey: u32,
    pub size: u32,
}

impl Buf {
    /// The SGE covering `len` bytes from the start of the buffer.
    pub fn sge(&self, len: u32) -> Sge {
        debug_assert!(len <= self.size);
        Sge {
            addr: self.addr,
            len,
            lkey: self.lkey,
        }
    }
    /// The SGE covering `len` bytes at `off`.
    pub fn sge_at(&self, off: u32, len: u32) -> Sge {
        debug_assert!(off + len <= self.size);
        Sge {
            addr: self.addr + off as u64,
            len,
            lkey: self.lkey,
        }
    }
}

/// Registered memory supplied by the driver.
pub trait BufStore {
    /// A buffer of at least `size` bytes usable as a local SGE for SEND, RECV and RDMA
    /// Read/Write (local write access). `None` when registered memory is exhausted.
    fn alloc(&mut self, size: u32) -> Option<Buf>;
    /// Give a buffer back. The engine frees a buffer only when no work request uses it.
    fn free(&mut self, buf: Buf);
    /// Copy `src` into the buffer at `off`.
    fn write(&mut self, buf: &Buf, off: u32, src: &[u8]);
    /// Copy bytes of the buffer at `off` into `dst`.
    fn read(&self, buf: &Buf, off: u32, dst: &mut [u8]);
    /// Let the peer RDMA-read the first `len` bytes of `buf`, and nothing else of it, until
    /// [`BufStore::revoke_read`] or [`BufStore::free`]: the address and key to advertise.
    /// `None`: this store cannot grant (the engine then sends by copy).
    fn grant_read(&mut self, buf: &Buf, len: u32) -> Option<(u64, u32)> {
        let _ = (buf, len);
        None
    }
    /// End `buf`'s grant, if it has one: no peer access through it succeeds after this.
    fn revoke_read(&mut self, buf: &Buf) {
        let _ = buf;
    }
}

/// A plain in-memory store (for engine unit tests and benchmarks: no provider behind it).
#[derive(Debug, Default)]
pub struct VecStore {
    bufs: slab::Slab<Vec<u8>>,
    /// Bytes currently allocated.
    pub allocated: usize,
    /// Refuse allocations that would take `allocated` above this (0 = no limit).
    pub limit: usize,
}

impl BufStore for VecStore {
    fn alloc(&mut self, size: u32) -> Option<Buf> {
        if self.limit != 0 && self.allocated + size as usize > self.limit {
            return None;
        }
        let id = self.bufs.insert(vec![0; size as usize]);
        self.allocated += size as usize;
        Some(Buf {
            id: id as u32,
            addr: (id as u64 + 1) << 32,
            lkey: 1,
            size,
        })
    }
    fn free(&mut self, buf: Buf) {
        if self.bufs.try_remove(buf.id as usize).is_some() {
            self.allocated -= buf.size as usize;
        }
    }
    fn write(&mut self, buf: &Buf, off: u32, src: &[u8]) {
        let b = &mut self.bufs[buf.id as usize];
        b[off as usize..off as usize + src.len()].copy_from_slice(src);
    }
    fn read(&self, buf: &Buf, off: u32, dst: &mut [u8]) {
        let b = &self.bufs[buf.id as usize];
        dst.copy_from_slice(&b[off as usize..off as usize + dst.len()]);
    }
}

/// A connection's buffers of one size class with a free list.
#[derive(Debug, Default)]
pub struct Pool {
    size: u32,
    free: Vec<Buf>,
    /// Buffers handed out and not yet returned.
    in_use: usize,
}

impl Pool {
    pub fn new(size: u32) -> Pool {
        Pool {
            size,
            free: Vec::new(),
            in_use: 0,
        }
    }
    /// Size of the buffers this pool hands out.
    pub fn size(&self) -> u32 {
        self.size
    }
    /// Buffers handed out and not yet returned.
    pub fn in_use(&self) -> usize {
        self.in_use
    }
    /// Buffers registered and idle.
    pub fn idle(&self) -> usize {
        self.free.len()
    }
    /// A buffer from the free list, or a new registration.
    pub fn get(&mut self, store: &mut impl BufStore) -> Option<Buf> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => store.alloc(self.size)?,
        };
        self.in_use += 1;
        Some(b)
    }
    /// Return a buffer; buffers of another size (after a resize) are freed at once.
    pub fn put(&mut self, store: &mut impl BufStore, b: Buf) {
        self.in_use -= 1;
        if b.size == self.size {
            self.free.push(b);
        } else {
            store.free(b);
        }
    }
    /// Keep at most `keep` idle buffers registered.
    pub fn trim(&mut self, store: &mut impl BufStore, keep: usize) {
        while self.free.len() > keep {
            let b = self.free.pop().expect("len checked");
            store.free(b);
        }
    }
    /// Change the size class: idle buffers of the old size are freed, buffers in use are freed
    /// when they come back.
    pub fn resize(&mut self, store: &mut impl BufStore, size: u32) {
        self.size = size;
        self.trim(store, 0);
    }
    /// Free every idle buffer (buffers still in use must be returned first by the caller).
    pub fn release(&mut self, store: &mut impl BufStore) {
        self.trim(store, 0);
    }
}
