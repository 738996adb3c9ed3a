//! The `oxccl` binary: a thin wrapper around the library's [`oxccl_cli::main_with_args`].

use std::process::ExitCode;

fn main() -> ExitCode {
    oxccl_cli::main_with_args(std::env::args_os())
}
