//! Inline sends (`Conn::write_inline`, `Endpoint::post_send_inline`): where the provider takes
//! a SEND's payload from the caller's memory as it is posted (shm, and the simulator by
//! default), a write that can go at once goes without a copy into a send buffer. The write
//! still returns once its bytes are the transport's (the caller may reuse its buffer at once),
//! the bytes arrive in order with what was queued by copy around them, and a provider without
//! inline payloads carries the same stream by copy. Over the simulator.

use sdp_core::proto::conn::CallError;
use sdp_core::proto::table::ConnId;
use sdp_core::proto::Config;
use sdp_core::verbs::sim::SimConfig;
use sdp_tests::pair::{pattern, Pair};

fn read_all(p: &mut Pair, b: ConnId, want: usize) -> Vec<u8> {
    p.read_b(b, want)
}

/// Writes of every size class, each buffer overwritten right after its write returned: the
/// peer reads what was written, in order. Returns the writer's inline byte count.
fn stream_with(max_inline: usize, cfg: Config) -> u64 {
    let sim = SimConfig {
        max_inline,
        ..SimConfig::default()
    };
    let mut p = Pair::with(7, sim, cfg.clone(), cfg);
    let (a, b) = p.connect();
    let mut want = Vec::new();
    let mut got = Vec::new();
    for (i, n) in [1usize, 64, 1000, 16 << 10, 100 << 10, 3, 700 << 10, 5]
        .into_iter()
        .enumerate()
    {
        let mut data = pattern(n, i as u8);
        let mut off = 0;
        while off < n {
            let now = p.now();
            match p.a.write(now, a, &data[off..]) {
                Ok(k) => {
                    off += k;
                    // Completions and credits come back while the peer reads.
                    let have = got.len();
                    got.extend(read_all(&mut p, b, have + 1));
                }
                Err(CallError::WouldBlock) => {
                    // Make room: the reader takes what arrived.
                    let have = got.len();
                    got.extend(read_all(&mut p, b, have + 1));
                }
                Err(e) => panic!("write: {e:?}"),
            }
        }
        want.extend_from_slice(&data);
        data.fill(0xa5);
    }
    let rest = read_all(&mut p, b, want.len() - got.len());
    got.extend(rest);
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the stream differs");
    p.a.conn(a).unwrap().stats().inline_send_bytes
}

#[test]
fn inline_writes_carry_the_stream_and_free_the_buffer_at_once() {
    let nodelay = Config {
        nodelay: true,
        ..Config::default()
    };
    let inline = stream_with(1 << 20, nodelay.clone());
    assert!(inline > 0, "no write went inline");
    // A small inline limit (an HCA's max_inline_data): only that much per message.
    let small = stream_with(256, nodelay.clone());
    assert!(small > 0 && small < inline, "{small} vs {inline}");
    // Without inline payloads the same stream goes by copy.
    assert_eq!(stream_with(0, nodelay), 0);
    // Nagle's rule holds: partial messages while one is outstanding coalesce by copy.
    assert!(stream_with(1 << 20, Config::default()) > 0);
}

/// An idle connection's small write goes inline: one message, no send buffer taken.
#[test]
fn an_idle_small_write_goes_inline() {
    let mut p = Pair::new(3, Config::default());
    let (a, b) = p.connect();
    let data = pattern(300, 1);
    let now = p.now();
    assert_eq!(p.a.write(now, a, &data), Ok(300));
    assert_eq!(p.a.conn(a).unwrap().stats().inline_send_bytes, 300);
    assert_eq!(read_all(&mut p, b, 300), data);
}

/// A provider whose inline messages are smaller than the peer's buffers (an HCA's
/// max_inline_data): a write that does not fit one goes by copy in messages of the peer's size,
/// not cut into inline pieces (over Soft-RoCE, 4 KiB ping-pong went from ~0.45 ms to ~3.3 ms
/// when a 128-byte limit cut each write into 112-byte messages); one that fits goes inline.
#[test]
fn a_small_inline_limit_does_not_cut_writes() {
    let sim = SimConfig {
        max_inline: 256,
        ..SimConfig::default()
    };
    let mut p = Pair::with(5, sim, Config::default(), Config::default());
    let (a, b) = p.connect();
    let big = pattern(4096, 3);
    let now = p.now();
    let sent_before = p.a.conn(a).unwrap().stats().msgs_sent;
    assert_eq!(p.a.write(now, a, &big), Ok(4096));
    p.run_for(1_000_000);
    let s = p.a.conn(a).unwrap().stats().clone();
    assert_eq!(s.inline_send_bytes, 0, "{s:?}");
    assert!(s.msgs_sent - sent_before <= 2, "{s:?}");
    assert_eq!(read_all(&mut p, b, 4096), big);
    let small = pattern(200, 4);
    let now = p.now();
    assert_eq!(p.a.write(now, a, &small), Ok(200));
    assert_eq!(p.a.conn(a).unwrap().stats().inline_send_bytes, 200);
    assert_eq!(read_all(&mut p, b, 200), small);
}
