//! The asynchronous registered send (`SdpStream::send_registered_async`) over `shm`, both
//! ends in this process (its own test binary: the process-wide stack is not shared with the
//! other socket tests).

use std::io::{Read, Write};
use std::net::Shutdown;

use sdp_core::socket::{Options, SdpListener, SdpStream, Transport};

/// Several asynchronous zero-copy sends in flight, mixed with plain writes: the peer reads one
/// intact stream in order, and each buffer comes back once the peer has it.
#[test]
fn async_registered_sends_pipelined_and_in_order() {
    let l = SdpListener::bind_with("127.0.0.1:0", &Options::sdp_only()).unwrap();
    let addr = l.local_addr().unwrap();
    let acceptor = std::thread::spawn(move || l.accept().unwrap().0);
    let c = SdpStream::connect_with(addr, &Options::sdp_only()).unwrap();
    let mut s = acceptor.join().unwrap();
    assert_eq!(c.transport(), Transport::Shm);
    const SIZE: usize = 200_000;
    const ROUNDS: usize = 12;
    let pattern = |round: usize, i: usize| ((round * 31 + i * 7) % 251) as u8;
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        got
    });
    let mut want = Vec::new();
    let mut c = c;
    c.write_all(b"head").unwrap();
    want.extend_from_slice(b"head");
    let mut inflight = std::collections::VecDeque::new();
    for round in 0..ROUNDS {
        let mut b = if inflight.len() < 4 {
            c.register(SIZE).unwrap()
        } else {
            let p: sdp_core::socket::PendingSend = inflight.pop_front().unwrap();
            let (b, n) = p.wait().unwrap();
            assert_eq!(n, SIZE);
            b
        };
        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
            *x = pattern(round, i);
        }
        want.extend_from_slice(b.as_slice());
        inflight.push_back(c.send_registered_async(b, 0..SIZE).unwrap());
    }
    // A plain write waits behind the sends and follows them in the stream.
    c.write_all(b"tail").unwrap();
    want.extend_from_slice(b"tail");
    for p in inflight {
        assert_eq!(p.wait().unwrap().1, SIZE);
    }
    c.shutdown(Shutdown::Write).unwrap();
    let got = reader.join().unwrap();
    assert_eq!(got.len(), want.len());
    assert!(got == want, "stream intact");
}
