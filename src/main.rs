//! The `tollgate` binary: everything it does is in the library's
//! [`tollgate::cli`] (flags, environment, signals, exit codes) over
//! [`tollgate::app::App`].

fn main() -> std::process::ExitCode {
    tollgate::cli::main()
}
