//! Precise wake-ups for the open-loop schedule. `epoll_wait` only sleeps in whole milliseconds, which
//! would add up to a millisecond of the generator's own lateness to every measured latency; on Linux a
//! `timerfd` registered in the same poll wakes the loop within microseconds of a request's due time.
//! Elsewhere the timer is a no-op and the loop falls back to poll timeouts.

use std::io;

use mio::{Registry, Token};

/// A one-shot timer whose expiry makes the poll return an event with its token.
pub struct Timer {
    #[cfg(target_os = "linux")]
    fd: std::os::fd::OwnedFd,
}

impl Timer {
    /// Whether `arm` really wakes the poll (else callers must bound their poll timeout themselves).
    pub const PRECISE: bool = cfg!(target_os = "linux");

    #[cfg(target_os = "linux")]
    pub fn new(registry: &Registry, token: Token) -> io::Result<Timer> {
        use mio::unix::SourceFd;
        use mio::Interest;
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        // SAFETY: plain syscall; the result is checked before use.
        let raw = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        registry.register(&mut SourceFd(&fd.as_raw_fd()), token, Interest::READABLE)?;
        Ok(Timer { fd })
    }

    #[cfg(not(target_os = "linux"))]
    pub fn new(_registry: &Registry, _token: Token) -> io::Result<Timer> {
        Ok(Timer {})
    }

    /// Fire once, `delay_ns` from now (at least 1 ns: zero would disarm).
    #[cfg(target_os = "linux")]
    pub fn arm(&mut self, delay_ns: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let d = delay_ns.max(1);
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (d / 1_000_000_000) as libc::time_t,
                tv_nsec: (d % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: valid descriptor and a fully initialised itimerspec; old value not requested.
        let rc =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    #[cfg(not(target_os = "linux"))]
    pub fn arm(&mut self, _delay_ns: u64) -> io::Result<()> {
        Ok(())
    }

    /// Consume an expiry (so the next one is reported again).
    #[cfg(target_os = "linux")]
    pub fn ack(&mut self) {
        use std::os::fd::AsRawFd;
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into an 8-byte buffer; EAGAIN is fine (nothing to consume).
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    }

    #[cfg(not(target_os = "linux"))]
    pub fn ack(&mut self) {}
}

/// Ask the kernel to wake this thread within ~1 µs of its timers rather than the default 50 µs slack.
pub fn tighten_timer_slack() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK only changes this thread's timer slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong, 0, 0, 0);
    }
}
