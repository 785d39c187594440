//! A stopped shm peer (SIGSTOP, a debugger, a frozen cgroup) must not freeze the other
//! connections of the process that talks to it (issue 14, section 1): nothing may wait on a
//! peer while holding what other connections need. Found: a large SEND is copied by both
//! processes at once (`verbs/shm/assist.rs`), and the sender waited for the chunks the peer
//! had claimed while holding the runtime's lock, so a peer stopped mid-chunk froze every
//! connection of the sender until SIGCONT.
//!
//! Here one thread writes 64 KiB messages to a reader that is stopped and continued again and
//! again, while the main thread runs small round trips with another peer: each batch of round
//! trips must finish while the reader is stopped. The bound on a batch only guards against
//! the hang (a frozen connection waits until SIGCONT, which comes after the bound).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use sdp_core::socket::{Options, SdpListener, Transport};

const PEER: &str = env!("CARGO_BIN_EXE_sdp-peer");

fn peer(args: &[&str]) -> Child {
    Command::new(PEER)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn signal(c: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(c.id() as libc::pid_t, sig) }, 0);
}

#[test]
fn a_stopped_reader_does_not_freeze_other_connections() {
    let l = SdpListener::bind_with("127.0.0.1:0", &Options::sdp_only()).unwrap();
    let addr = l.local_addr().unwrap().to_string();

    let mut reader = peer(&["drain", &addr]);
    let (to_reader, _) = l.accept().unwrap();
    assert_eq!(to_reader.transport(), Transport::Shm);
    let mut echo = peer(&["echo", &addr, "sdp", "64"]);
    let (mut pinger, _) = l.accept().unwrap();
    assert_eq!(pinger.transport(), Transport::Shm);

    // The writer: 64 KiB messages (shared copies) to the reader, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let mut s = to_reader;
        std::thread::spawn(move || {
            let buf = vec![5u8; 64 << 10];
            while !stop.load(Ordering::Relaxed) {
                if s.write_all(&buf).is_err() {
                    break;
                }
            }
            s
        })
    };

    // Round trips with the echo peer run in a thread that reports each finished batch.
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let pings = std::thread::spawn(move || {
        let mut b = [0u8; 64];
        while go_rx.recv().is_ok() {
            for _ in 0..100 {
                pinger.write_all(&[9u8; 64]).unwrap();
                pinger.read_exact(&mut b).unwrap();
            }
            done_tx.send(()).unwrap();
        }
        pinger
    });

    let mut frozen = 0;
    for _ in 0..200 {
        std::thread::sleep(Duration::from_millis(3));
        signal(&reader, libc::SIGSTOP);
        go_tx.send(()).unwrap();
        // A frozen process would finish this batch only after SIGCONT below.
        if done_rx.recv_timeout(Duration::from_secs(10)).is_err() {
            frozen += 1;
        }
        signal(&reader, libc::SIGCONT);
        if frozen > 0 {
            done_rx.recv().unwrap();
            break;
        }
    }
    assert_eq!(
        frozen, 0,
        "round trips with one peer waited for another peer that was stopped"
    );

    drop(go_tx);
    let pinger = pings.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let to_reader = writer.join().unwrap();
    drop((pinger, to_reader));
    for c in [&mut reader, &mut echo] {
        let mut line = String::new();
        BufReader::new(c.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("ok"), "peer said {line:?}");
        c.wait().unwrap();
    }
}

/// A blocking write returns once its bytes are in the send buffer, as TCP's does, even while
/// the reader is stopped (issue 14, section 2): a 1 MiB write over kernel TCP into a stopped
/// reader returns at once (its send buffer grows to 4 MiB). Found: over shm such a write went
/// by zero copy, which holds the caller until the peer's engine has taken the bytes or given
/// them back; a stopped peer does neither until SIGCONT. The bound only guards the hang.
#[test]
fn a_write_the_send_buffer_holds_returns_while_the_reader_is_stopped() {
    for choice in ["tcp", "sdp"] {
        let opts = match choice {
            "tcp" => Options::tcp_only(),
            _ => Options::sdp_only(),
        };
        let l = SdpListener::bind_with("127.0.0.1:0", &opts).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let mut reader = peer(&["drain", &addr, choice]);
        let (mut s, _) = l.accept().unwrap();
        if choice == "sdp" {
            assert_eq!(s.transport(), Transport::Shm);
        }
        signal(&reader, libc::SIGSTOP);
        let (tx, rx) = mpsc::channel::<()>();
        let writer = std::thread::spawn(move || {
            let buf = vec![7u8; 1 << 20];
            s.write_all(&buf).unwrap();
            tx.send(()).unwrap();
            s
        });
        let returned = rx.recv_timeout(Duration::from_secs(10)).is_ok();
        signal(&reader, libc::SIGCONT);
        drop(writer.join().unwrap());
        let mut line = String::new();
        BufReader::new(reader.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        reader.wait().unwrap();
        assert_eq!(
            line.trim(),
            format!("ok {}", 1 << 20),
            "{choice}: the reader"
        );
        assert!(
            returned,
            "{choice}: a 1 MiB write into a stopped reader waited for it to run again"
        );
    }
}
