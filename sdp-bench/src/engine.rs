//! `sdp-bench engine`: the SDP engine itself, moving data between two connections over the
//! in-memory simulator (engine + simulator CPU cost per GiB, BCopy and ZCopy).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Instant as WallClock;

use sdp_core::driver::Driver;
use sdp_core::proto::conn::CallError;
use sdp_core::proto::iocb::ZSrc;
use sdp_core::proto::{Config, Event, Instant, State};
use sdp_core::verbs::sim::{SimFabric, SimProvider};
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

/// Stream `total` bytes A -> B in `size`-byte writes over the simulator.
fn sim_stream(size: usize, total: u64, zcopy: bool) -> Row {
    let a_ip = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    let b_ip = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
    let fabric = SimFabric::new(7);
    let cfg = Config::default();
    let mut a: Driver<SimProvider> = Driver::new(fabric.provider(a_ip), cfg.clone());
    let mut b: Driver<SimProvider> = Driver::new(fabric.provider(b_ip), cfg);
    let l = b.listen(SocketAddr::new(b_ip, 9000), 16).expect("listen");
    let now = |f: &SimFabric| Instant(f.now());
    let ca = a
        .connect(now(&fabric), SocketAddr::new(b_ip, 9000), None)
        .expect("connect");
    let mut cb = None;
    let payload = vec![0x5au8; size];
    let src_mr = zcopy.then(|| {
        let p = a.provider().clone();
        let mut mr = p
            .reg_mr(size, Access::LOCAL_WRITE | Access::REMOTE_READ)
            .expect("reg");
        mr.write(0, &payload);
        mr
    });
    let (mut sent, mut rcvd, mut inflight) = (0u64, 0u64, false);
    let mut buf = vec![0u8; 1 << 20];
    let (c0, w0, v0) = (cpu_seconds(), WallClock::now(), fabric.now());
    while rcvd < total {
        let t = now(&fabric);
        a.poll(t);
        b.poll(t);
        cb = cb.or_else(|| b.accept(l));
        let Some(cb) = cb else {
            step(&fabric, &a, &b);
            continue;
        };
        if a.conn(ca).map(|c| c.state()) != Some(State::Established) {
            step(&fabric, &a, &b);
            continue;
        }
        for ev in a.take_events(ca) {
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
                match a.write_zcopy(t, ca, src, sent) {
                    Ok(()) => inflight = true,
                    Err(CallError::WouldBlock) => {}
                    Err(e) => panic!("write_zcopy: {e}"),
                }
                break;
            }
            match a.write(t, ca, &payload) {
                Ok(n) => sent += n as u64,
                Err(CallError::WouldBlock) => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        loop {
            match b.read(t, cb, &mut buf) {
                Ok(0) => break,
                Ok(n) => rcvd += n as u64,
                Err(CallError::WouldBlock) => break,
                Err(e) => panic!("read: {e}"),
            }
        }
        step(&fabric, &a, &b);
    }
    Row {
        mode: if zcopy { "zcopy" } else { "bcopy" },
        size,
        bytes: rcvd,
        wall: w0.elapsed().as_secs_f64(),
        cpu: cpu_seconds() - c0,
        virt_ns: fabric.now() - v0,
    }
}

fn step(f: &SimFabric, a: &Driver<SimProvider>, b: &Driver<SimProvider>) {
    let next = [
        f.next_event_at().map(Instant),
        a.next_deadline(),
        b.next_deadline(),
    ]
    .into_iter()
    .flatten()
    .min();
    if let Some(t) = next {
        f.advance(t.0.max(f.now()));
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
