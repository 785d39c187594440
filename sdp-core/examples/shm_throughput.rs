//! One-way throughput of the SDP engine over the shm provider, against kernel TCP loopback
//! measured the same way (two threads, fixed-size writes, the reader counts bytes).
//!
//! ```text
//! cargo run --release -p sdp-core --example shm_throughput -- [bcopy|zcopy|tcp] MSG_BYTES TOTAL_BYTES
//! ```

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use sdp_core::driver::Driver;
use sdp_core::proto::iocb::{ZSink, ZSrc};
use sdp_core::proto::read::ZRecv;
use sdp_core::proto::{Config, Event, Shutdown};
use sdp_core::verbs::shm::ShmProvider;
use sdp_core::verbs::{Access, MemoryRegion, Provider};

fn tcp(msg: usize, total: u64) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; msg.max(1 << 20)];
        let mut got = 0u64;
        let t0 = Instant::now();
        while got < total {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0);
            got += n as u64;
        }
        t0.elapsed()
    });
    let mut s = TcpStream::connect(addr).unwrap();
    let buf = vec![7u8; msg];
    let mut sent = 0u64;
    while sent < total {
        s.write_all(&buf).unwrap();
        sent += msg as u64;
    }
    let el = h.join().unwrap();
    total as f64 / el.as_secs_f64() / 1e6
}

fn clock(t0: Instant) -> sdp_core::proto::Instant {
    sdp_core::proto::Instant(t0.elapsed().as_nanos() as u64)
}

/// Poll until `f` says done; arm and sleep on the notify fd when nothing moves.
fn run(
    d: &mut Driver<ShmProvider>,
    t0: Instant,
    mut f: impl FnMut(&mut Driver<ShmProvider>) -> (bool, bool),
) {
    let mut idle = 0;
    loop {
        d.poll(clock(t0));
        let (done, moved) = f(d);
        if done {
            return;
        }
        idle = if moved { 0 } else { idle + 1 };
        if idle > 256 {
            idle = 0;
            d.provider().arm().unwrap();
            d.poll(clock(t0));
            let (done, moved) = f(d);
            if done {
                return;
            }
            let soon = d
                .next_deadline()
                .is_some_and(|t| t.0 <= clock(t0).0 + 1_000_000);
            if !moved && !soon {
                d.provider().wait(1);
            }
        }
    }
}

fn sdp(zcopy: bool, msg: usize, total: u64) -> f64 {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let t0 = Instant::now();
        let mut d = Driver::new(ShmProvider::new().unwrap(), Config::default());
        let l = d.listen("127.0.0.1:0".parse().unwrap(), 16).unwrap();
        tx.send(d.listener_addr(l).unwrap()).unwrap();
        let mut id = None;
        let mut buf = vec![0u8; msg.max(1 << 20)];
        let p = d.provider().clone();
        let sink_mr = p
            .reg_mr(msg, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let mut sink_busy = false;
        let mut got = 0u64;
        let mut start = None;
        run(&mut d, t0, |d| {
            let now = clock(t0);
            if id.is_none() {
                id = d.accept(l);
            }
            let Some(c) = id else { return (false, false) };
            let before = got;
            for ev in d.take_events(c) {
                if let Event::ZcopyReceived { bytes, .. } = ev {
                    got += bytes as u64;
                    sink_busy = false;
                }
            }
            loop {
                if zcopy && !sink_busy {
                    let s = ZSink {
                        addr: sink_mr.addr(),
                        len: msg as u32,
                        lkey: sink_mr.lkey(),
                        rkey: sink_mr.rkey(),
                    };
                    match d.read_zcopy(now, c, s, 1) {
                        Ok(ZRecv::Pending) => {
                            sink_busy = true;
                            break;
                        }
                        Ok(ZRecv::Copy) => {}
                        Err(_) => break,
                    }
                }
                if sink_busy {
                    break;
                }
                match d.read(now, c, &mut buf) {
                    Ok(0) => break,
                    Ok(n) => got += n as u64,
                    Err(_) => break,
                }
            }
            if got > 0 && start.is_none() {
                start = Some(Instant::now());
            }
            (got >= total, got != before)
        });
        (start.unwrap().elapsed(), d)
    });
    let addr: SocketAddr = rx.recv().unwrap();
    let t0 = Instant::now();
    let mut d = Driver::new(ShmProvider::new().unwrap(), Config::default());
    let c = d.connect(clock(t0), addr, None).unwrap();
    let p = d.provider().clone();
    let mut src = p
        .reg_mr(msg, Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    src.write(0, &vec![7u8; msg]);
    let buf = vec![7u8; msg];
    let mut sent = 0u64;
    let mut inflight: Option<usize> = None; // zcopy offset in `src` offered
    let mut off = 0usize;
    run(&mut d, t0, |d| {
        let now = clock(t0);
        let before = sent;
        for ev in d.take_events(c) {
            if let Event::ZcopySent { bytes, .. } = ev {
                sent += bytes as u64;
                off = inflight.take().unwrap() + bytes;
            }
        }
        while sent < total && inflight.is_none() {
            let left = (msg - off).min((total - sent) as usize);
            if zcopy && left >= 64 * 1024 {
                let s = ZSrc {
                    addr: src.addr() + off as u64,
                    len: left as u32,
                    lkey: src.lkey(),
                    rkey: src.rkey(),
                };
                match d.write_zcopy(now, c, s, 1) {
                    Ok(()) => inflight = Some(off),
                    Err(_) => break,
                }
            } else {
                match d.write(now, c, &buf[off..off + left]) {
                    Ok(n) => {
                        sent += n as u64;
                        off += n;
                    }
                    Err(_) => break,
                }
            }
            if off == msg {
                off = 0;
            }
        }
        if sent >= total {
            let _ = d.shutdown(now, c, Shutdown::Write);
        }
        (sent >= total, sent != before)
    });
    // Keep the engine going until the reader has everything.
    let mut rh = Some(h);
    let mut el = Duration::ZERO;
    while let Some(h) = rh.take() {
        if h.is_finished() {
            el = h.join().unwrap().0;
        } else {
            d.poll(clock(t0));
            rh = Some(h);
        }
    }
    total as f64 / el.as_secs_f64() / 1e6
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map_or("bcopy", |s| s.as_str());
    let msg: usize = args.get(2).map_or(65536, |s| s.parse().unwrap());
    let total: u64 = args.get(3).map_or(1 << 30, |s| s.parse().unwrap());
    let mbs = match mode {
        "tcp" => tcp(msg, total),
        "bcopy" => sdp(false, msg, total),
        "zcopy" => sdp(true, msg, total),
        _ => panic!("mode: tcp, bcopy or zcopy"),
    };
    println!("{mode} msg={msg} total={total}: {mbs:.0} MB/s");
}
