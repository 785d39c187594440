//! librdmacm's device list kept in step with the kernel's, so that no device removal waits
//! on this process.
//!
//! A provider without `disassociate_ucontext` (Soft-RoCE, siw) cannot finish removing a
//! device while a process has a verbs context open on it: `rdma link delete` waits. librdmacm
//! keeps a context for every device it opened and closes one only when a look at the device
//! list (`rdma_get_devices`) finds it gone and no id on it. Such a look also opens every
//! device still there, each of which librdmacm then keeps open too, with no event at all
//! when one of them goes away (the kernel tells the CM ids on a device, and this process may
//! have none there). So once the process has looked, it keeps looking: a thread watches the
//! kernel's list of verbs devices (`/sys/class/infiniband_verbs`, which loses a device as
//! its removal starts) and looks again whenever one is gone, within [`EVERY`].

use std::collections::BTreeSet;
use std::os::unix::fs::DirEntryExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use super::ffi;

/// How often the watcher reads the kernel's device list.
const EVERY: Duration = Duration::from_secs(1);

const VERBS_CLASS: &str = "/sys/class/infiniband_verbs";

/// The watcher: the process it runs in (a child after fork() starts its own) and its thread.
static WATCHER: Mutex<Option<(u32, std::thread::Thread)>> = Mutex::new(None);

/// A look was asked for since the watcher's last.
static ASKED: AtomicBool = AtomicBool::new(false);

/// Have librdmacm look at the device list soon (on the watcher's thread: a look opens
/// devices, slow, and waits on the kernel while one is being added or removed; the caller may
/// hold any of the socket layer's locks), and from then on whenever a device goes away.
pub(super) fn resync_soon() {
    ASKED.store(true, Ordering::SeqCst);
    let me = std::process::id();
    let mut w = WATCHER.lock();
    if let Some((pid, t)) = w.as_ref() {
        if *pid == me {
            t.unpark();
            return;
        }
    }
    match crate::sys::spawn_without_signals(
        std::thread::Builder::new().name("sdp-rdma-devices".into()),
        watch,
    ) {
        Ok(h) => *w = Some((me, h.thread().clone())),
        // No thread (resource exhaustion): look here, once.
        Err(_) => {
            drop(w);
            ASKED.store(false, Ordering::SeqCst);
            ffi::resync_devices();
        }
    }
}

/// The kernel's verbs devices, each by name and sysfs inode (a device removed and added
/// again under the same name between two reads is a different entry).
fn kernel_devices() -> BTreeSet<(String, u64)> {
    std::fs::read_dir(VERBS_CLASS)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.ino()))
        .collect()
}

fn watch() {
    let mut known = kernel_devices();
    loop {
        let now = kernel_devices();
        let gone = known.difference(&now).next().is_some();
        if ASKED.swap(false, Ordering::SeqCst) || gone {
            ffi::resync_devices();
        }
        known = now;
        std::thread::park_timeout(EVERY);
    }
}
