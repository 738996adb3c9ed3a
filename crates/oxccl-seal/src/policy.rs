//! Which links are encrypted: `OXCCL_ENCRYPT=off|on|auto`, the one policy every wire reads
//! (re-exported by oxccl-verbs, read by the bootstrap for values in foreign stores).

use std::fmt;
use std::net::IpAddr;

/// `OXCCL_ENCRYPT` (or an option) holds something other than `off`, `on` or `auto`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyError(pub String);

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{ENCRYPT_ENV}={:?}: expected off, on or auto", self.0)
    }
}

impl std::error::Error for PolicyError {}

type Result<T> = std::result::Result<T, PolicyError>;

/// The variable that chooses the [`Encrypt`] policy.
pub const ENCRYPT_ENV: &str = "OXCCL_ENCRYPT";

/// Which tcp links carry their frames in authenticated, encrypted records
/// (oxccl-verbs' `QpConfig::seal`). The handshakes (the store's, oxccl-kv's, the
/// aggregation service's) are authenticated whatever this says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Encrypt {
    /// No link: frames in clear (a trusted network, or the last bit of speed on one host).
    Off,
    /// Every tcp link, on one host too.
    On,
    /// The tcp links that leave the host ([`is_on_host`] is false for the peer's address);
    /// shared memory and loopback stay as they are. The recommendation across hosts.
    #[default]
    Auto,
}

impl Encrypt {
    /// Parses `off`, `on` or `auto` (also `0`/`1`, `false`/`true`, `no`/`yes`; any case).
    pub fn parse(s: &str) -> Result<Encrypt> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "0" | "false" | "no" => Ok(Encrypt::Off),
            "on" | "1" | "true" | "yes" => Ok(Encrypt::On),
            "auto" | "" => Ok(Encrypt::Auto),
            _ => Err(PolicyError(s.to_string())),
        }
    }

    /// The policy of `OXCCL_ENCRYPT` as `var` reads it (unset: [`Encrypt::Auto`]).
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Encrypt> {
        var(ENCRYPT_ENV).map_or(Ok(Encrypt::default()), |v| Encrypt::parse(&v))
    }

    /// The policy of `OXCCL_ENCRYPT` in this process's environment.
    pub fn from_env() -> Result<Encrypt> {
        Encrypt::from_vars(&|k| std::env::var(k).ok())
    }

    /// Whether a tcp link to `peer` is encrypted under this policy.
    pub fn seals(self, peer: IpAddr) -> bool {
        match self {
            Encrypt::Off => false,
            Encrypt::On => true,
            Encrypt::Auto => !is_on_host(peer),
        }
    }

    /// The policy's name, as `OXCCL_ENCRYPT` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Encrypt::Off => "off",
            Encrypt::On => "on",
            Encrypt::Auto => "auto",
        }
    }
}

impl std::str::FromStr for Encrypt {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Encrypt> {
        Encrypt::parse(s)
    }
}

impl fmt::Display for Encrypt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether `ip` is this host's (in this network namespace): a loopback address, the
/// unspecified address, or one a socket here can bind, which is what the kernel delivers
/// locally. Traffic to such an address never leaves the host. A network namespace is a host
/// of its own: a veth peer's address is not this one's.
pub fn is_on_host(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_and_refuses_the_rest() {
        assert_eq!(Encrypt::parse("OFF").unwrap(), Encrypt::Off);
        assert_eq!(Encrypt::parse(" on ").unwrap(), Encrypt::On);
        assert_eq!(Encrypt::parse("auto").unwrap(), Encrypt::Auto);
        let e = Encrypt::parse("maybe").unwrap_err().to_string();
        assert!(e.contains("OXCCL_ENCRYPT") && e.contains("maybe"), "{e}");
        assert_eq!(Encrypt::from_vars(&|_| None).unwrap(), Encrypt::Auto);
        assert_eq!(
            Encrypt::from_vars(&|_| Some("off".into())).unwrap(),
            Encrypt::Off
        );
    }

    #[test]
    fn auto_seals_only_what_leaves_the_host() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        // TEST-NET-3: documentation addresses no host has.
        let far: IpAddr = "203.0.113.9".parse().unwrap();
        assert!(is_on_host(lo) && !is_on_host(far));
        assert!(!Encrypt::Auto.seals(lo) && Encrypt::Auto.seals(far));
        assert!(Encrypt::On.seals(lo) && !Encrypt::Off.seals(far));
        // One of this host's own interface addresses (the one that routes outward, if any).
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        if s.connect("203.0.113.9:9").is_ok() {
            let mine = s.local_addr().unwrap().ip();
            assert!(is_on_host(mine), "{mine} is this host's own address");
        }
    }
}
