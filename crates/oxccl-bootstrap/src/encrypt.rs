//! The encryption policy, `OXCCL_ENCRYPT=off|on|auto` ([`oxccl_seal::Encrypt`], the one every
//! wire reads), with the bootstrap's errors.

use oxccl_seal::{ENCRYPT_ENV, Encrypt};

use crate::error::{Error, Result};

/// The policy in `OXCCL_ENCRYPT` (unset: [`Encrypt::Auto`]).
pub fn encrypt_from_env() -> Result<Encrypt> {
    encrypt_from_vars(&|v| std::env::var(v).ok())
}

/// [`encrypt_from_env`] over any source of variables; a value that is none of `off`, `on`,
/// `auto` is [`Error::BadEnv`], naming the variable.
pub fn encrypt_from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Encrypt> {
    Encrypt::from_vars(var).map_err(|e| Error::BadEnv {
        var: ENCRYPT_ENV,
        value: e.0,
        reason: "expected off, on or auto".into(),
    })
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
        assert_eq!(with(None).unwrap(), Encrypt::Auto);
        assert_eq!(with(Some("off")).unwrap(), Encrypt::Off);
        assert_eq!(with(Some("ON")).unwrap(), Encrypt::On);
        assert_eq!(with(Some("auto")).unwrap(), Encrypt::Auto);
        match with(Some("maybe")) {
            Err(Error::BadEnv { var, value, .. }) => {
                assert_eq!((var, value.as_str()), (ENCRYPT_ENV, "maybe"))
            }
            r => panic!("{r:?}"),
        }
    }
}
