//! The rules file (`SDP_PRELOAD_CONF`), in the spirit of OFED's libsdp.conf:
//!
//! ```text
//! # use  sdp|tcp|both  server|client|*  PROGRAM  ADDR[/PREFIX][:PORTS]
//! use tcp  client  *      10.0.0.0/8:*
//! use sdp  *       iperf3 *:5201
//! use both server  *      *:1024-65535
//! ```
//!
//! The first rule that matches a socket (its role, the program's name, the peer's address for
//! a client, the listening address for a server) decides; without a match the choice is
//! `both`: SDP where the peer speaks it, kernel TCP otherwise. `PROGRAM` and `ADDR` may be `*`;
//! `PROGRAM` may end in `*` (a prefix); `PORTS` is `*`, a port or `LOW-HIGH`. A malformed line
//! is reported on stderr with its number and skipped: the program still runs.

use std::net::{IpAddr, SocketAddr};

/// What a rule chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    /// SDP only: no fallback.
    Sdp,
    /// Kernel TCP only.
    Tcp,
    /// SDP if the peer speaks it, else TCP (the default).
    Both,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Server,
    Client,
}

/// An address with its prefix length.
type Net = (IpAddr, u8);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    what: Use,
    role: Option<Role>,
    program: String,
    net: Option<Net>,
    ports: (u16, u16),
}

/// Parsed rules, in file order.
#[derive(Debug, Default)]
pub(crate) struct Rules {
    rules: Vec<Rule>,
}

fn parse_net(s: &str) -> Result<Option<Net>, String> {
    if s == "*" {
        return Ok(None);
    }
    let (ip, prefix) = match s.split_once('/') {
        Some((ip, p)) => (ip, Some(p)),
        None => (s, None),
    };
    let ip: IpAddr = ip
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .map_err(|_| format!("bad address {ip:?}"))?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let prefix = match prefix {
        Some(p) => p
            .parse::<u8>()
            .ok()
            .filter(|&p| p <= max)
            .ok_or_else(|| format!("bad prefix length {p:?}"))?,
        None => max,
    };
    Ok(Some((ip, prefix)))
}

fn parse_ports(s: &str) -> Result<(u16, u16), String> {
    if s == "*" {
        return Ok((0, u16::MAX));
    }
    let bad = || format!("bad ports {s:?}");
    match s.split_once('-') {
        Some((a, b)) => {
            let (a, b) = (
                a.parse::<u16>().map_err(|_| bad())?,
                b.parse::<u16>().map_err(|_| bad())?,
            );
            if a > b {
                return Err(bad());
            }
            Ok((a, b))
        }
        None => {
            let p = s.parse::<u16>().map_err(|_| bad())?;
            Ok((p, p))
        }
    }
}

/// `ADDR[/PREFIX][:PORTS]`; IPv6 addresses in brackets when ports follow.
fn parse_target(s: &str) -> Result<(Option<Net>, (u16, u16)), String> {
    if let Some(rest) = s.strip_prefix('[') {
        let (inside, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("bad address {s:?}"))?;
        let (prefix, ports) = match after.split_once(':') {
            Some((pre, ports)) => (pre, ports),
            None => (after, "*"),
        };
        let net = parse_net(&format!("{inside}{prefix}"))?;
        return Ok((net, parse_ports(ports)?));
    }
    match s.rsplit_once(':') {
        Some((addr, ports)) if !addr.contains(':') => Ok((parse_net(addr)?, parse_ports(ports)?)),
        _ => Ok((parse_net(s)?, (0, u16::MAX))),
    }
}

fn parse_line(line: &str) -> Result<Option<Rule>, String> {
    let line = line.split('#').next().unwrap_or("").trim();
    if line.is_empty() {
        return Ok(None);
    }
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() != 5 || f[0] != "use" {
        return Err(
            "expected: use sdp|tcp|both server|client|* PROGRAM ADDR[/PREFIX][:PORTS]".into(),
        );
    }
    let what = match f[1] {
        "sdp" => Use::Sdp,
        "tcp" => Use::Tcp,
        "both" => Use::Both,
        w => return Err(format!("unknown choice {w:?} (sdp, tcp or both)")),
    };
    let role = match f[2] {
        "server" => Some(Role::Server),
        "client" => Some(Role::Client),
        "*" => None,
        r => return Err(format!("unknown role {r:?} (server, client or *)")),
    };
    let (net, ports) = parse_target(f[4])?;
    Ok(Some(Rule {
        what,
        role,
        program: f[3].to_string(),
        net,
        ports,
    }))
}

fn in_net(ip: IpAddr, net: Net) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    match (ip, net.0) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let m = if net.1 == 0 {
                0
            } else {
                u32::MAX << (32 - net.1)
            };
            u32::from(a) & m == u32::from(n) & m
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let m = if net.1 == 0 {
                0
            } else {
                u128::MAX << (128 - net.1)
            };
            u128::from(a) & m == u128::from(n) & m
        }
        _ => false,
    }
}

impl Rules {
    /// Parse a rules file's text; malformed lines are returned as messages and skipped.
    pub(crate) fn parse(text: &str, origin: &str) -> (Rules, Vec<String>) {
        let mut rules = Vec::new();
        let mut errs = Vec::new();
        for (i, line) in text.lines().enumerate() {
            match parse_line(line) {
                Ok(Some(r)) => rules.push(r),
                Ok(None) => {}
                Err(e) => errs.push(format!("{origin}:{}: {e}; line skipped", i + 1)),
            }
        }
        (Rules { rules }, errs)
    }

    /// The choice for a socket of `role` in `program` towards (client) or on (server) `addr`.
    pub(crate) fn choose(&self, role: Role, program: &str, addr: SocketAddr) -> Use {
        for r in &self.rules {
            if r.role.is_some_and(|x| x != role) {
                continue;
            }
            let prog_ok = match r.program.strip_suffix('*') {
                Some(prefix) => program.starts_with(prefix),
                None => r.program == program,
            };
            if !prog_ok {
                continue;
            }
            if r.net.is_some_and(|n| !in_net(addr.ip(), n)) {
                continue;
            }
            if addr.port() < r.ports.0 || addr.port() > r.ports.1 {
                continue;
            }
            return r.what;
        }
        Use::Both
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn first_match_wins_and_default_is_both() {
        let (r, errs) = Rules::parse(
            "# comment\n\
             use tcp client * 10.0.0.0/8:*\n\
             use sdp * iperf* *:5201\n\
             use tcp server redis-server 127.0.0.1:6379\n\
             use both * * *:1000-2000\n",
            "t",
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(r.choose(Role::Client, "curl", a("10.1.2.3:80")), Use::Tcp);
        assert_eq!(r.choose(Role::Server, "curl", a("10.1.2.3:80")), Use::Both);
        assert_eq!(
            r.choose(Role::Client, "iperf3", a("127.0.0.1:5201")),
            Use::Sdp
        );
        assert_eq!(
            r.choose(Role::Client, "iperf3", a("127.0.0.1:5202")),
            Use::Both
        );
        assert_eq!(
            r.choose(Role::Server, "redis-server", a("127.0.0.1:6379")),
            Use::Tcp
        );
        assert_eq!(
            r.choose(Role::Client, "redis-server", a("127.0.0.1:6379")),
            Use::Both
        );
        // IPv4-mapped IPv6 peers match IPv4 rules.
        assert_eq!(
            r.choose(Role::Client, "x", a("[::ffff:10.0.0.1]:1")),
            Use::Tcp
        );
    }

    #[test]
    fn malformed_lines_are_named_and_skipped() {
        let (r, errs) = Rules::parse(
            "use sdp client * *:5201\n\
             use fast client * *\n\
             use tcp nobody * *\n\
             use tcp client * 300.1.1.1\n\
             use tcp client * 10.0.0.0/40\n\
             use tcp client * *:9-1\n\
             use tcp client *\n\
             use tcp client * [fd00::]/8:80\n",
            "rules.conf",
        );
        assert_eq!(errs.len(), 6, "{errs:?}");
        assert!(
            errs[0].starts_with("rules.conf:2: unknown choice"),
            "{errs:?}"
        );
        assert!(
            errs[1].starts_with("rules.conf:3: unknown role"),
            "{errs:?}"
        );
        assert!(errs[5].starts_with("rules.conf:7: expected"), "{errs:?}");
        assert_eq!(r.rules.len(), 2);
        assert_eq!(r.choose(Role::Client, "p", a("[fd12::1]:80")), Use::Tcp);
        assert_eq!(r.choose(Role::Client, "p", a("[fe80::1]:80")), Use::Both);
        assert_eq!(r.choose(Role::Client, "p", a("1.2.3.4:5201")), Use::Sdp);
    }
}
