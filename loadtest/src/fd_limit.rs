//! The open-files limit (`RLIMIT_NOFILE`, what `ulimit -n` shows): every connection is a file
//! descriptor, and the usual soft limit of 1024 is below what a soak with thousands of connections
//! needs. Before connecting, the generator raises its soft limit towards the hard limit as far as
//! the run needs, and refuses to start, naming the numbers, when even the hard limit is too low.
//! Elsewhere than Linux nothing is checked (a connect failing for want of descriptors is still
//! reported as such).

use anyhow::Result;

/// Descriptors needed besides the connections: stdio, each thread's poll and timer, the preflight
/// connection, output files, and what the runtime opens.
pub const SPARE_FDS: u64 = 64;

/// The descriptors a run with `connections` over `threads` needs.
pub fn needed(connections: usize, threads: usize) -> u64 {
    connections as u64 + 2 * threads as u64 + SPARE_FDS
}

/// The current soft limit, when known.
pub fn soft_limit() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        get().map(|(soft, _)| soft)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

#[cfg(target_os = "linux")]
#[allow(clippy::unnecessary_cast)] // rlim_t is u64 on 64-bit Linux, not on every target.
fn get() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    (rc == 0).then_some((lim.rlim_cur as u64, lim.rlim_max as u64))
}

/// Make sure `needed` descriptors can be open at once, raising the soft limit if that is enough.
#[allow(clippy::unnecessary_cast)] // rlim_t is u64 on 64-bit Linux, not on every target.
pub fn ensure(needed: u64) -> Result<()> {
    #[cfg(target_os = "linux")]
    {
        let Some((soft, hard)) = get() else {
            return Ok(());
        };
        if soft >= needed {
            return Ok(());
        }
        if hard < needed {
            anyhow::bail!(
                "this run needs about {needed} file descriptors (one per connection, plus {SPARE_FDS} spare), \
                 but the open-files limit is {soft} (hard limit {hard}): raise it (`ulimit -Hn {needed}` as \
                 root, or LimitNOFILE= for a service) or use fewer --connections"
            );
        }
        let lim = libc::rlimit {
            rlim_cur: needed as libc::rlim_t,
            rlim_max: hard as libc::rlim_t,
        };
        // SAFETY: setrlimit reads the struct it is given; raising the soft limit up to the hard one
        // needs no privilege.
        let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
        if rc != 0 {
            anyhow::bail!(
                "this run needs about {needed} file descriptors but the open-files limit is {soft}, and \
                 raising it failed: {}; run `ulimit -n {needed}` first",
                std::io::Error::last_os_error()
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = needed;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_runs_fit_and_absurd_ones_are_refused_clearly() {
        assert!(ensure(needed(10, 1)).is_ok());
        #[cfg(target_os = "linux")]
        {
            let soft = soft_limit().unwrap();
            assert!(soft >= needed(10, 1));
            let err = ensure(u64::MAX / 2).unwrap_err().to_string();
            assert!(err.contains("file descriptors"), "{err}");
        }
    }
}
