//! The `tollgate` binary: everything it does is in the library's
//! [`tollgate::cli`] (flags, environment, signals, exit codes) over
//! [`tollgate::app::App`].

/// mimalloc rather than the system allocator: the request path allocates
/// little, but the cluster's batches, frames and answer boards do, from
/// several threads, and glibc's allocator spent about 7 % of a cluster
/// node's CPU under load (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    tollgate::cli::main()
}
