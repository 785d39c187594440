//! The name of a shared stream's kernel file (LD_PRELOAD shim): a stream whose bytes go
//! through its application fd (`socket::pump`) can reach a process that knows nothing of it,
//! by SCM_RIGHTS (multiprocessing's `send_handle`, node's cluster, fd-passing servers). That
//! process sees an AF_UNIX socket, which must answer as the TCP socket it stands for
//! (getpeername, SO_DOMAIN, TCP options). So when the runtime starts pumping a stream it gives
//! its own end of the pair an abstract name that carries the connection's addresses; the
//! application's end's getpeername returns that name in every process that holds it, and the
//! shim of a process that received the fd reads the addresses back ([`decode`]).
//!
//! The name, after the abstract namespace's leading NUL: [`MAGIC`], the owner's pid and a
//! number unique among live sockets (the end's inode; names are unique in the network
//! namespace, which processes of several pid namespaces may share), then each address as a
//! family byte (4 or 6), the address, the port (big-endian) and, for IPv6, the scope id.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

const MAGIC: &[u8; 5] = b"sdp\x01s";

/// The name for a stream of process `pid` (`unique`: among live sockets) from `local` to
/// `peer`.
pub(crate) fn encode(pid: u32, unique: u64, local: SocketAddr, peer: SocketAddr) -> Vec<u8> {
    let mut v = Vec::with_capacity(64);
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&pid.to_be_bytes());
    v.extend_from_slice(&unique.to_be_bytes());
    for a in [local, peer] {
        match a {
            SocketAddr::V4(a) => {
                v.push(4);
                v.extend_from_slice(&a.ip().octets());
                v.extend_from_slice(&a.port().to_be_bytes());
            }
            SocketAddr::V6(a) => {
                v.push(6);
                v.extend_from_slice(&a.ip().octets());
                v.extend_from_slice(&a.port().to_be_bytes());
                v.extend_from_slice(&a.scope_id().to_be_bytes());
            }
        }
    }
    v
}

/// `a` as a socket of the application's family shows it: an IPv4 address v4-mapped when the
/// socket is AF_INET6 (`v6`), as the kernel shows a dual-stack socket's IPv4 peers.
pub(crate) fn shown(v6: bool, a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V4(a4) if v6 => {
            SocketAddr::V6(SocketAddrV6::new(a4.ip().to_ipv6_mapped(), a4.port(), 0, 0))
        }
        a => a,
    }
}

/// The addresses (local, peer) a name of [`encode`]'s carries; `None` for any other name.
pub(crate) fn decode(name: &[u8]) -> Option<(SocketAddr, SocketAddr)> {
    let rest = name.strip_prefix(MAGIC.as_slice())?;
    let mut r = rest.get(12..)?;
    let mut addr = || -> Option<SocketAddr> {
        let (&fam, tail) = r.split_first()?;
        let (a, len) = match fam {
            4 => {
                let ip: [u8; 4] = tail.get(..4)?.try_into().ok()?;
                let port = u16::from_be_bytes(tail.get(4..6)?.try_into().ok()?);
                (SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), port), 6)
            }
            6 => {
                let ip: [u8; 16] = tail.get(..16)?.try_into().ok()?;
                let port = u16::from_be_bytes(tail.get(16..18)?.try_into().ok()?);
                let scope = u32::from_be_bytes(tail.get(18..22)?.try_into().ok()?);
                let a = SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, scope);
                (SocketAddr::V6(a), 22)
            }
            _ => return None,
        };
        r = &tail[len..];
        Some(a)
    };
    let local = addr()?;
    let peer = addr()?;
    Some((local, peer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_both_addresses() {
        let l: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let p: SocketAddr = "[fe80::1%3]:65535".parse().unwrap();
        for (a, b) in [(l, p), (p, l), (l, l), (p, p)] {
            let n = encode(u32::MAX, u64::MAX, a, b);
            // The abstract namespace's names hold 107 bytes.
            assert!(n.len() <= 107, "{}", n.len());
            assert_eq!(decode(&n), Some((a, b)));
        }
    }

    #[test]
    fn a_v6_socket_shows_ipv4_v4_mapped() {
        let l: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let p: SocketAddr = "[fe80::1%3]:5000".parse().unwrap();
        let m: SocketAddr = "[::ffff:127.0.0.1]:4000".parse().unwrap();
        assert_eq!(shown(false, l), l);
        assert_eq!(shown(true, l), m);
        assert_eq!(shown(true, p), p);
        let n = encode(1, 2, shown(true, l), shown(true, p));
        assert_eq!(decode(&n), Some((m, p)));
    }

    #[test]
    fn other_names_are_not_streams() {
        let l: SocketAddr = "10.0.0.1:1".parse().unwrap();
        let n = encode(1, 2, l, l);
        for cut in 0..n.len() {
            assert_eq!(decode(&n[..cut]), None, "cut at {cut}");
        }
        assert_eq!(decode(b"sdp-rendezvous"), None);
        let mut bad = n.clone();
        bad[MAGIC.len() + 12] = 5;
        assert_eq!(decode(&bad), None);
    }

    /// What the runtime does to a shared stream's pair (`runtime::share`), in the kernel: an
    /// end of a socketpair takes a name after it was made, and the other end's getpeername
    /// answers it; a pair left unnamed, and a socket that is no AF_UNIX one, answer nothing.
    #[test]
    fn the_other_end_of_a_named_pair_knows_the_stream() {
        use std::os::fd::{AsFd, AsRawFd};
        let l: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let p: SocketAddr = "[::1]:5000".parse().unwrap();
        let (app, ours) = crate::sys::socketpair().unwrap();
        assert_eq!(
            crate::socket::app::shared_stream_addrs(app.as_raw_fd()),
            None
        );
        let (_, ino) = crate::sys::file_identity(ours.as_fd()).unwrap();
        let name = encode(std::process::id(), ino, l, p);
        crate::sys::bind_abstract(ours.as_raw_fd(), &name).unwrap();
        assert_eq!(
            crate::socket::app::shared_stream_addrs(app.as_raw_fd()),
            Some((l, p))
        );
        // A name once given stays (a second share of the same pair leaves it).
        assert!(crate::sys::bind_abstract(ours.as_raw_fd(), &name).is_err());
        // SAFETY: a new socket, owned at once.
        let udp = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
        assert!(udp >= 0);
        assert_eq!(crate::socket::app::shared_stream_addrs(udp), None);
        assert_eq!(crate::socket::app::shared_stream_addrs(-1), None);
        // SAFETY: ours, closed once.
        unsafe { libc::close(udp) };
    }
}
