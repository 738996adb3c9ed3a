//! Whether an address is this host's: what `OXCCL_ENCRYPT=auto` decides by.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Whether `ip` reaches this host without leaving it: a loopback address, or one of the
/// addresses of this host's interfaces (an engine that connects to this host's own IP).
pub(crate) fn on_host(ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    ip.is_loopback() || ip.is_unspecified() || interface_addrs().contains(&ip)
}

/// The addresses of this host's interfaces (`getifaddrs`); none when it fails.
fn interface_addrs() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list that freeifaddrs frees below; every node is
    // read only while the list is alive, and sockaddr pointers are read as the family says.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            return out;
        }
        let mut p = head;
        while !p.is_null() {
            let a = (*p).ifa_addr;
            if !a.is_null() {
                match i32::from((*a).sa_family) {
                    libc::AF_INET => {
                        let s = &*(a as *const libc::sockaddr_in);
                        out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr))));
                    }
                    libc::AF_INET6 => {
                        let s = &*(a as *const libc::sockaddr_in6);
                        out.push(IpAddr::V6(Ipv6Addr::from(s.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            p = (*p).ifa_next;
        }
        libc::freeifaddrs(head);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_the_interfaces_are_on_host_and_others_are_not() {
        assert!(on_host("127.0.0.1".parse().unwrap()));
        assert!(on_host("127.0.0.9".parse().unwrap()));
        assert!(on_host("::1".parse().unwrap()));
        assert!(on_host("::ffff:127.0.0.1".parse().unwrap()));
        // The kernel's list, parsed in the right byte order: lo's addresses are in it.
        let all = interface_addrs();
        assert!(all.contains(&"127.0.0.1".parse().unwrap()), "{all:?}");
        // Every interface address of this host (from the kernel, independently: a socket
        // bound to it works) counts as on-host.
        for ip in interface_addrs() {
            assert!(on_host(ip), "{ip}");
            if ip.is_ipv4() {
                std::net::TcpListener::bind((ip, 0)).unwrap();
            }
        }
        // TEST-NET addresses (RFC 5737, RFC 3849) are nobody's.
        assert!(!on_host("198.51.100.7".parse().unwrap()));
        assert!(!on_host("2001:db8::7".parse().unwrap()));
    }
}
