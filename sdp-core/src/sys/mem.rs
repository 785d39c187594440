//! Memory: shared mappings, memfds and their seals, and raw memory regions.

use std::io;
use std::mem::zeroed;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use super::made;

/// A shared mapping of a file (or anonymous memory), unmapped on drop.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory; all shared accesses go through atomics or explicit
// byte copies, so it may be used from any thread.
unsafe impl Send for Mapping {}

// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes of `fd` shared, read-write or read-only.
    pub fn map(fd: BorrowedFd<'_>, len: usize, writable: bool) -> io::Result<Mapping> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh mapping at an address the kernel picks; no existing memory affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?,
            len,
        })
    }

    /// `len` zeroed private bytes (at least one page).
    pub fn anon(len: usize) -> io::Result<Mapping> {
        let len = len.max(1);
        // SAFETY: a fresh anonymous mapping; no existing memory affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?,
            len,
        })
    }

    /// The length asked for when it was made.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Leave the mapping out of forked children (`MADV_DONTFORK`; the rdma provider's regions).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub fn dont_fork(&self) -> io::Result<()> {
        // SAFETY: advises on exactly our own mapping; no memory is accessed.
        syscall!(madvise(
            self.ptr.as_ptr().cast(),
            self.len,
            libc::MADV_DONTFORK
        ))?;
        Ok(())
    }

    /// The `u32` at byte offset `off` (our own layout constant; checked).
    pub fn u32(&self, off: usize) -> &AtomicU32 {
        assert!(
            off & 3 == 0 && off + 4 <= self.len,
            "u32 at {off} outside mapping"
        );
        // SAFETY: in bounds and aligned (the mapping is page aligned); AtomicU32 has the layout
        // of u32 and tolerates concurrent access from the peer.
        unsafe { &*(self.ptr.as_ptr().add(off) as *const AtomicU32) }
    }

    /// The `u64` at byte offset `off` (checked).
    pub fn u64(&self, off: usize) -> &AtomicU64 {
        assert!(
            off & 7 == 0 && off + 8 <= self.len,
            "u64 at {off} outside mapping"
        );
        // SAFETY: as for `u32`.
        unsafe { &*(self.ptr.as_ptr().add(off) as *const AtomicU64) }
    }

    /// Copy bytes out of the mapping (checked bounds).
    #[cfg(feature = "rdma")]
    pub fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        // SAFETY: the destination is a live slice, which cannot be inside the mapping (the
        // mapping is never lent out as a Rust slice).
        unsafe { self.read_to_addr(off, dst.as_mut_ptr() as u64, dst.len()) }
    }

    /// Copy bytes into the mapping (checked bounds).
    #[cfg(feature = "rdma")]
    pub fn write_bytes(&self, off: usize, src: &[u8]) {
        // SAFETY: the source is a live slice, not inside the mapping (as above).
        unsafe { self.write_from_addr(off, src.as_ptr() as u64, src.len()) }
    }

    /// Copy `len` bytes from our address `addr` into the mapping at `off` (checked bounds on
    /// the mapping's side).
    ///
    /// # Safety
    /// `addr..addr + len` must be mapped and readable, and not inside this mapping.
    pub unsafe fn write_from_addr(&self, off: usize, addr: u64, len: usize) {
        assert!(off.checked_add(len).is_some_and(|e| e <= self.len));
        // SAFETY: the destination range is inside the mapping; the source is the caller's.
        unsafe {
            std::ptr::copy_nonoverlapping(
                addr as usize as *const u8,
                self.ptr.as_ptr().add(off),
                len,
            )
        }
    }

    /// Copy `len` bytes of the mapping at `off` to our address `addr` (checked bounds on the
    /// mapping's side).
    ///
    /// # Safety
    /// `addr..addr + len` must be mapped, writable, not referenced by any Rust reference for
    /// the duration of the call, and not inside this mapping.
    pub unsafe fn read_to_addr(&self, off: usize, addr: u64, len: usize) {
        assert!(off.checked_add(len).is_some_and(|e| e <= self.len));
        // SAFETY: the source range is inside the mapping; the destination is the caller's.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), addr as usize as *mut u8, len)
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range; nobody uses it after the Mapping is gone.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Memory at a fixed address that the provider does not own (a caller's buffer given to
/// `reg_mr_at`) or owns through a [`Mapping`] held next to it.
pub struct RawBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain memory; copies in and out are explicit.
unsafe impl Send for RawBuf {}

// SAFETY: as above.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// # Safety
    /// `ptr..ptr + len` must stay mapped and writable for the life of the RawBuf.
    pub unsafe fn new(ptr: NonNull<u8>, len: usize) -> RawBuf {
        RawBuf { ptr, len }
    }
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        assert!(
            off.checked_add(dst.len()).is_some_and(|e| e <= self.len),
            "memory region read out of bounds"
        );
        // SAFETY: in bounds of memory valid for our life (constructor contract).
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len()) }
    }
    pub fn write(&self, off: usize, src: &[u8]) {
        assert!(
            off.checked_add(src.len()).is_some_and(|e| e <= self.len),
            "memory region write out of bounds"
        );
        // SAFETY: in bounds of memory valid for our life (constructor contract).
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.as_ptr().add(off), src.len()) }
    }
}

/// Copy `dst.len()` bytes from the local address `addr`.
///
/// # Safety
/// `addr..addr + dst.len()` must be mapped and readable for the duration of the call.
#[cfg(test)]
pub unsafe fn copy_from_addr(addr: u64, dst: &mut [u8]) {
    // SAFETY: the caller guarantees the source range; the destination is a live slice.
    unsafe { std::ptr::copy(addr as usize as *const u8, dst.as_mut_ptr(), dst.len()) }
}

/// Copy `src` to the local address `addr`.
///
/// # Safety
/// `addr..addr + src.len()` must be mapped, writable and not referenced by any Rust reference
/// for the duration of the call.
#[cfg(test)]
pub unsafe fn copy_to_addr(addr: u64, src: &[u8]) {
    // SAFETY: the caller guarantees the destination range.
    unsafe { std::ptr::copy(src.as_ptr(), addr as usize as *mut u8, src.len()) }
}

/// A memfd of `len` bytes, sealed against shrinking and growing (so a peer that shares it can
/// never make our mapping fault).
pub fn memfd_sealed(name: &str, len: usize) -> io::Result<OwnedFd> {
    let fd = memfd_sized(name, len)?;
    syscall!(fcntl(
        fd.as_raw_fd(),
        libc::F_ADD_SEALS,
        libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL
    ))?;
    Ok(fd)
}

/// A memfd of `len` bytes sealed against shrinking and growing, still open to more seals:
/// map it writable, then [`seal_future_writes`].
pub fn memfd_sized(name: &str, len: usize) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(|_| io::Error::other("bad memfd name"))?;
    let fd = made(|| {
        syscall!(memfd_create(
            cname.as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING
        ))
    })?;
    syscall!(ftruncate(fd.as_raw_fd(), len as libc::off_t))?;
    syscall!(fcntl(
        fd.as_raw_fd(),
        libc::F_ADD_SEALS,
        libc::F_SEAL_SHRINK | libc::F_SEAL_GROW
    ))?;
    Ok(fd)
}

/// Seal a memfd against every later write access (`F_SEAL_FUTURE_WRITE`, then `F_SEAL_SEAL`):
/// mappings that exist keep writing, but nobody holding the file (or reopening it through
/// `/proc/PID/fd`) can `write(2)` it, map it writable, or `mprotect` a mapping writable.
pub fn seal_future_writes(fd: BorrowedFd<'_>) -> io::Result<()> {
    syscall!(fcntl(
        fd.as_raw_fd(),
        libc::F_ADD_SEALS,
        libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL
    ))?;
    Ok(())
}

/// The ways a holder of `fd` could write the file behind it that work (for tests): reopen
/// through `/proc/self/fd` read-write, then `pwrite`, `mmap` writable shared, `mmap` read-only
/// and `mprotect` writable.
#[cfg(test)]
pub fn write_paths(fd: BorrowedFd<'_>) -> Vec<&'static str> {
    use std::os::fd::AsFd;
    let mut ok = Vec::new();
    let path = format!("/proc/self/fd/{}\0", fd.as_raw_fd());
    let Ok(rw) = made(|| syscall!(open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC)))
    else {
        return ok;
    };
    ok.push("reopen O_RDWR");
    let b = [0x77u8; 8];
    // SAFETY: writes 8 bytes from a live array.
    if syscall!(pwrite(rw.as_raw_fd(), b.as_ptr().cast(), 8, 4096)).is_ok_and(|n| n == 8) {
        ok.push("pwrite");
    }
    if Mapping::map(rw.as_fd(), 4096, true).is_ok() {
        ok.push("mmap PROT_WRITE");
    }
    if let Ok(m) = Mapping::map(rw.as_fd(), 4096, false) {
        // SAFETY: changes the protection of our own fresh mapping only.
        if syscall!(mprotect(
            m.ptr().as_ptr().cast(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE
        ))
        .is_ok()
        {
            ok.push("mprotect PROT_WRITE");
        }
    }
    ok
}

/// A file's identity (device, inode): two fds with the same one are the same file.
pub fn file_identity(fd: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    // SAFETY: stat is plain data; zeroed is a valid value.
    let mut st: libc::stat = unsafe { zeroed() };
    // SAFETY: `st` is a live, writable stat buffer.
    syscall!(fstat(fd.as_raw_fd(), &mut st))?;
    Ok((st.st_dev, st.st_ino))
}

/// Size of a file, and whether it is sealed against shrinking (a memfd we may map safely).
pub fn sealed_size(fd: BorrowedFd<'_>) -> io::Result<(usize, bool)> {
    // SAFETY: stat is plain data; zeroed is a valid value.
    let mut st: libc::stat = unsafe { zeroed() };
    // SAFETY: `st` is a live, writable stat buffer.
    syscall!(fstat(fd.as_raw_fd(), &mut st))?;
    let seals = syscall!(fcntl(fd.as_raw_fd(), libc::F_GET_SEALS))?;
    let mode_ok = st.st_mode & libc::S_IFMT == libc::S_IFREG;
    Ok((
        st.st_size as usize,
        mode_ok && seals & libc::F_SEAL_SHRINK != 0,
    ))
}

/// Reopen a memfd read-only (a new open file description the peer cannot map writable).
pub fn reopen_readonly(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}\0", fd.as_raw_fd());
    made(|| syscall!(open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC)))
}
