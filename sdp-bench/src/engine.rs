//! `sdp-bench engine`: the SDP engine itself, moving data between two connections over the
//! in-memory simulator (engine + simulator CPU cost per GiB, BCopy and ZCopy).

use std::time::Instant as WallClock;

use sdp_core::harness::pair::Pair;
use sdp_core::proto::conn::CallError;
use sdp_core::proto::iocb::ZSrc;
use sdp_core::proto::{Config, Event};
use sdp_core::verbs::{Access, MemoryRegion, Provider};

pub fn cpu_seconds() -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a rusage into the pointer we pass, which is valid and aligned.
    let ru = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr());
        ru.assume_init()
    };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

struct Row {
    mode: &'static str,
    size: usize,
    bytes: u64,
    wall: f64,
    cpu: f64,
    virt_ns: u64,
}

/// Stream `total` bytes A -> B in `size`-byte writes over the simulator (the engine harness's
/// Pair: two drivers, virtual time).
fn sim_stream(size: usize, total: u64, zcopy: bool) -> Row {
    let mut p = Pair::new(7, Config::default());
    let (ca, cb) = p.connect();
    let payload = vec![0x5au8; size];
    let src_mr = zcopy.then(|| {
        let prov = p.a.provider().clone();
        let mut mr = prov
            .reg_mr(size, Access::LOCAL_WRITE | Access::REMOTE_READ)
            .expect("reg");
        mr.write(0, &payload);
        mr
    });
    let (mut sent, mut rcvd, mut inflight) = (0u64, 0u64, false);
    let mut buf = vec![0u8; 1 << 20];
    let (c0, w0, v0) = (cpu_seconds(), WallClock::now(), p.fabric.now());
    while rcvd < total {
        p.poll();
        let t = p.now();
        for ev in p.a.take_events(ca) {
            if let Event::ZcopySent { bytes, .. } = ev {
                sent += bytes as u64;
                inflight = false;
            }
        }
        while sent < total {
            if let Some(mr) = &src_mr {
                if inflight {
                    break;
                }
                let src = ZSrc {
                    addr: mr.addr(),
                    len: size as u32,
                    lkey: mr.lkey(),
                    rkey: mr.rkey(),
                };
                match p.a.write_zcopy(t, ca, src, sent) {
                    Ok(()) => inflight = true,
                    Err(CallError::WouldBlock) => {}
                    Err(e) => panic!("write_zcopy: {e}"),
                }
                break;
            }
            match p.a.write(t, ca, &payload) {
                Ok(n) => sent += n as u64,
                Err(CallError::WouldBlock) => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        loop {
            match p.b.read(t, cb, &mut buf) {
                Ok(0) => break,
                Ok(n) => rcvd += n as u64,
                Err(CallError::WouldBlock) => break,
                Err(e) => panic!("read: {e}"),
            }
        }
        p.advance();
    }
    Row {
        mode: if zcopy { "zcopy" } else { "bcopy" },
        size,
        bytes: rcvd,
        wall: w0.elapsed().as_secs_f64(),
        cpu: cpu_seconds() - c0,
        virt_ns: p.fabric.now() - v0,
    }
}

/// `sdp-bench engine`: the SDP engine over the in-memory simulator.
pub fn run(mib: u64) {
    println!("The SDP engine over the in-memory simulator: {mib} MiB streamed between two");
    println!("connections in one process; CPU covers both engines and the simulator's copies.\n");
    println!(
        "{:<6} {:>9} {:>10} {:>12} {:>12} {:>14}",
        "mode", "msg size", "MiB", "wall GiB/s", "CPU s/GiB", "virtual GiB/s"
    );
    for (size, zc) in [
        (64usize, false),
        (65536, false),
        (1 << 20, false),
        (256 << 10, true),
        (1 << 20, true),
    ] {
        let total = if size < 4096 {
            (mib << 20) / 16
        } else {
            mib << 20
        };
        let r = sim_stream(size, total, zc);
        let gib = r.bytes as f64 / (1u64 << 30) as f64;
        println!(
            "{:<6} {:>9} {:>10} {:>12.2} {:>12.3} {:>14.2}",
            r.mode,
            r.size,
            r.bytes >> 20,
            gib / r.wall,
            r.cpu / gib,
            gib / (r.virt_ns as f64 / 1e9)
        );
    }
}
