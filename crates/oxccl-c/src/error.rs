//! Errors at the C boundary: the result codes, the thread's last error message, and the one
//! wrapper every entry point runs its body in ([`guard`]), which turns errors and panics into
//! a code and a message.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use oxccl::Error;

use crate::types::oxcclResult_t::{self, *};

/// A failed call: its code and what to say about it.
#[derive(Debug)]
pub(crate) struct Failure {
    pub code: oxcclResult_t,
    pub msg: String,
}

impl Failure {
    /// An invalid argument.
    pub(crate) fn invalid(msg: impl Into<String>) -> Failure {
        Failure {
            code: oxcclInvalidArgument,
            msg: msg.into(),
        }
    }

    /// The library used wrongly.
    pub(crate) fn usage(msg: impl Into<String>) -> Failure {
        Failure {
            code: oxcclInvalidUsage,
            msg: msg.into(),
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure {
            code: code_of(&e),
            msg: e.to_string(),
        }
    }
}

impl From<oxccl_bootstrap::Error> for Failure {
    fn from(e: oxccl_bootstrap::Error) -> Failure {
        Failure::from(Error::Bootstrap(e))
    }
}

/// The result code of an oxccl error.
pub(crate) fn code_of(e: &Error) -> oxcclResult_t {
    match e {
        Error::InvalidArgument { .. } => oxcclInvalidArgument,
        Error::Config(_) | Error::Mismatch { .. } | Error::Poisoned { .. } => oxcclInvalidUsage,
        Error::Bootstrap(_) | Error::Verbs { .. } => oxcclSystemError,
        Error::Timeout { .. } | Error::WaitTimeout { .. } => oxcclTimeout,
        Error::PeerFailed { .. }
        | Error::AggregatorFailed { .. }
        | Error::Unreachable { .. }
        | Error::Aborted { .. } => oxcclRemoteError,
        _ => oxcclUnhandledError,
    }
}

thread_local! {
    /// The message of the last call that failed on this thread.
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as this thread's last error.
pub(crate) fn set_last_error(msg: &str) {
    // A NUL inside the message would end it early: show it instead.
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = c);
}

/// This thread's last error message; valid until the next failing oxccl call on this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

/// This thread's last error message, copied (for tests).
#[cfg(test)]
pub(crate) fn last_error() -> String {
    LAST.with(|l| l.borrow().to_string_lossy().into_owned())
}

/// What a panic carried, as text.
fn panic_text(p: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = p.downcast_ref::<&str>() {
        s
    } else if let Some(s) = p.downcast_ref::<String>() {
        s
    } else {
        "(a panic without a message)"
    }
}

/// Runs an entry point's body: `Ok` is `oxcclSuccess`; an error or a panic is its code, with
/// `what()` (the call and its arguments) and the reason kept as the thread's last error. No
/// panic crosses into C.
#[inline]
pub(crate) fn guard(
    what: impl FnOnce() -> String,
    body: impl FnOnce() -> Result<(), Failure>,
) -> oxcclResult_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => oxcclSuccess,
        Ok(Err(f)) => fail(what, f),
        Err(p) => fail(
            what,
            Failure {
                code: oxcclInternalError,
                msg: format!("internal error (a panic in oxccl): {}", panic_text(&*p)),
            },
        ),
    }
}

/// Records a failure as the last error and returns its code.
#[cold]
fn fail(what: impl FnOnce() -> String, f: Failure) -> oxcclResult_t {
    // Describing the call must not panic out either.
    let what = catch_unwind(AssertUnwindSafe(what)).unwrap_or_else(|_| "oxccl call".into());
    set_last_error(&format!("{what}: {}", f.msg));
    f.code
}

/// The text of a result code (`oxcclGetErrorString`), as a static C string.
pub(crate) fn error_string(code: i64) -> &'static CStr {
    match code {
        0 => c"no error",
        1 => c"unhandled error",
        2 => c"system error (a socket, shared memory, the store, or registering memory failed)",
        3 => c"internal error (a bug in oxccl)",
        4 => c"invalid argument",
        5 => c"invalid usage",
        6 => c"remote process exited, aborted, or failed",
        7 => c"operation in progress",
        8 => c"timeout",
        _ => c"unknown result code",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let r = guard(
            || "oxcclTest(count=3)".into(),
            || panic!("the reason {}", 42),
        );
        assert_eq!(r, oxcclInternalError);
        let msg = last_error();
        assert!(
            msg.starts_with("oxcclTest(count=3): internal error"),
            "{msg}"
        );
        assert!(msg.contains("the reason 42"), "{msg}");
    }

    #[test]
    fn a_panic_while_describing_the_call_is_caught_too() {
        let r = guard(|| panic!("in what"), || Err(Failure::invalid("bad")));
        assert_eq!(r, oxcclInvalidArgument);
        assert_eq!(last_error(), "oxccl call: bad");
    }

    #[test]
    fn errors_keep_their_codes() {
        let e = Error::PeerFailed {
            rank: 1,
            op: "all_reduce".into(),
            peer: 3,
            detail: "gone".into(),
        };
        assert_eq!(guard(|| "x".into(), || Err(e.into())), oxcclRemoteError);
        assert!(last_error().contains("peer rank 3"));
        assert_eq!(guard(|| "x".into(), || Ok(())), oxcclSuccess);
        // Success leaves the last error as it was.
        assert!(last_error().contains("peer rank 3"));
        let nul = Failure::invalid("a\0b");
        guard(|| "x".into(), || Err(nul));
        assert_eq!(last_error(), "x: a\\0b");
    }
}
