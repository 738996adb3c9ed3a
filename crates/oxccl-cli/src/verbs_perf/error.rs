//! The error type of `verbs-perf`: a message that says what failed, in words a user can act on.

use std::fmt;

/// What went wrong in a `verbs-perf` run.
#[derive(Debug)]
pub struct Error {
    /// The message.
    msg: String,
    /// Writing our own output failed because its reader went away (`| head`): not worth a message.
    broken_pipe: bool,
    /// Already reported to the other side (the server child told its parent); print nothing more.
    reported: bool,
}

/// Result of a `verbs-perf` step.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error with this message.
    pub fn new(msg: impl Into<String>) -> Self {
        Error {
            msg: msg.into(),
            broken_pipe: false,
            reported: false,
        }
    }

    /// Prefixes the message with what was being done.
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.msg = format!("{what}: {}", self.msg);
        self
    }

    /// Appends a detail (for example how the server process ended).
    pub fn with_note(mut self, note: impl fmt::Display) -> Self {
        self.msg = format!("{}; {note}", self.msg);
        self
    }

    /// A failed write to our standard output; a closed pipe (`| head`) ends the run quietly.
    pub fn stdout(e: std::io::Error) -> Self {
        let mut err = Error::new(format!("writing to standard output: {e}"));
        err.broken_pipe = e.kind() == std::io::ErrorKind::BrokenPipe;
        err
    }

    /// Marks the error as already reported to the peer, so the process exits quietly.
    pub fn reported(mut self) -> Self {
        self.reported = true;
        self
    }

    /// Whether the error is a closed standard output (nothing to say about it).
    pub fn is_broken_pipe(&self) -> bool {
        self.broken_pipe
    }

    /// Whether the error was already reported elsewhere.
    pub fn is_reported(&self) -> bool {
        self.reported
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {}

impl From<oxccl_verbs::Error> for Error {
    fn from(e: oxccl_verbs::Error) -> Self {
        Error::new(e.to_string())
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::new(e.to_string())
    }
}
