//! The encryption policy, `OXCCL_ENCRYPT=off|on|auto`, as the bootstrap reads it (the same
//! variable and values as `oxccl_verbs::Encrypt`, which this crate does not depend on).

use crate::error::{Error, Result};

/// The variable that says what is encrypted.
pub const ENCRYPT_ENV: &str = "OXCCL_ENCRYPT";

/// What `OXCCL_ENCRYPT` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EncryptPolicy {
    /// Nothing beyond what is always sealed (the store's own wire is, always).
    Off,
    /// Everything that can be.
    On,
    /// What leaves the host (the default).
    #[default]
    Auto,
}

impl EncryptPolicy {
    /// Whether values set in a store that is not ours are sealed ([`crate::SealedValues`]):
    /// unless `off` (such a store may be reached from anywhere).
    pub fn seals_foreign_stores(self) -> bool {
        self != EncryptPolicy::Off
    }
}

/// The policy in `OXCCL_ENCRYPT` (unset: [`EncryptPolicy::Auto`]).
pub fn encrypt_from_env() -> Result<EncryptPolicy> {
    encrypt_from_vars(&|v| std::env::var(v).ok())
}

/// [`encrypt_from_env`] over any source of variables; a value that is none of `off`, `on`,
/// `auto` (or `0`/`1`) is [`Error::BadEnv`], naming the variable.
pub fn encrypt_from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<EncryptPolicy> {
    let Some(value) = var(ENCRYPT_ENV) else {
        return Ok(EncryptPolicy::default());
    };
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(EncryptPolicy::Auto),
        "off" | "0" | "no" | "false" => Ok(EncryptPolicy::Off),
        "on" | "1" | "yes" | "true" => Ok(EncryptPolicy::On),
        _ => Err(Error::BadEnv {
            var: ENCRYPT_ENV,
            value,
            reason: "expected off, on or auto".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_parses_and_bad_values_name_the_variable() {
        let with = |v: Option<&str>| {
            let v = v.map(str::to_owned);
            encrypt_from_vars(&move |n| (n == ENCRYPT_ENV).then(|| v.clone()).flatten())
        };
        assert_eq!(with(None).unwrap(), EncryptPolicy::Auto);
        assert_eq!(with(Some("off")).unwrap(), EncryptPolicy::Off);
        assert_eq!(with(Some("ON")).unwrap(), EncryptPolicy::On);
        assert_eq!(with(Some("auto")).unwrap(), EncryptPolicy::Auto);
        assert!(!EncryptPolicy::Off.seals_foreign_stores());
        assert!(EncryptPolicy::Auto.seals_foreign_stores());
        match with(Some("maybe")) {
            Err(Error::BadEnv { var, .. }) => assert_eq!(var, ENCRYPT_ENV),
            r => panic!("{r:?}"),
        }
    }
}
