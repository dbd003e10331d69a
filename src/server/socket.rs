//! The client socket and its read buffer, with exactly the syscalls a
//! request needs. Readiness is tracked with tokio's `AsyncFd` so that a short
//! read (fewer bytes than asked: the kernel queue is empty) clears read
//! readiness at once, instead of proving it with one more `read` that fails
//! with `EAGAIN`: a request costs one `read` and one `write`, as in Redis.
//! Closing after an `ERR` lingers briefly so the client reads the error
//! instead of a reset.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::unix::AsyncFd;

/// How long a closing connection keeps draining what the client still sends,
/// so the kernel answers with FIN after our last line rather than RST.
const LINGER_MS: u64 = 500;
/// Most bytes drained while lingering.
const LINGER_BYTES_MAX: usize = 1 << 20;

pub struct ClientSocket {
    fd: AsyncFd<std::net::TcpStream>,
}

impl ClientSocket {
    /// Takes over an accepted stream (must belong to the current runtime).
    pub fn new(stream: tokio::net::TcpStream) -> io::Result<ClientSocket> {
        let _ = stream.set_nodelay(true);
        let stream = stream.into_std()?;
        stream.set_nonblocking(true)?;
        // SAFETY: the `TcpStream` owns a valid descriptor, and nothing replaces
        // or closes it while the `AsyncFd` owns the stream.
        let fd = unsafe { AsyncFd::register(stream)? };
        Ok(ClientSocket { fd })
    }

    /// Reads what the kernel has into `buffer`'s free space; `Ok(0)` is end of
    /// stream.
    pub async fn read(&self, buffer: &mut InputBuffer) -> io::Result<usize> {
        std::future::poll_fn(|cx| self.poll_read(cx, buffer)).await
    }

    /// [`ClientSocket::read`], polled: while the socket has nothing, the
    /// task's waker waits in the descriptor's one reader slot. (Awaiting
    /// `readable()` instead queues a waiter that is added and removed under
    /// a lock at every turn of a connection's loop that ends another way.)
    pub fn poll_read(
        &self,
        cx: &mut Context<'_>,
        buffer: &mut InputBuffer,
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut ready = ready!(self.fd.poll_read_ready(cx))?;
            let spare = buffer.spare();
            let asked = spare.len();
            match ready.try_io(|fd| fd.get_ref().read(spare)) {
                Ok(Ok(n)) => {
                    if n > 0 && n < asked {
                        // A short read drained the queue: no need to prove it with EAGAIN.
                        ready.clear_ready();
                    }
                    buffer.filled(n);
                    return Poll::Ready(Ok(n));
                }
                Ok(Err(error)) if error.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(error)) => return Poll::Ready(Err(error)),
                // Readiness was cleared: the next poll waits for the socket.
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `data`, waiting while the kernel's send buffer is full.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            // Try first: the send buffer is almost always free.
            match self.fd.get_ref().write(data) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    data = &data[n..];
                    continue;
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) if error.kind() != io::ErrorKind::WouldBlock => return Err(error),
                Err(_) => {}
            }
            let mut ready = self.fd.writable().await?;
            match ready.try_io(|fd| fd.get_ref().write(data)) {
                Ok(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(error)) if error.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(error)) => return Err(error),
                Err(_would_block) => {}
            }
        }
        Ok(())
    }

    /// Closes after our last line: half-close, then discard what the client
    /// still sends for a moment (bounded in time and bytes), then close.
    pub async fn linger_close(self) {
        let _ = self.fd.get_ref().shutdown(Shutdown::Write);
        let drain = async {
            let mut scratch = [0u8; 4096];
            let mut drained = 0usize;
            while drained < LINGER_BYTES_MAX {
                let Ok(mut ready) = self.fd.readable().await else {
                    return;
                };
                match ready.try_io(|fd| fd.get_ref().read(&mut scratch)) {
                    Ok(Ok(0)) | Ok(Err(_)) => return,
                    Ok(Ok(n)) => drained += n,
                    Err(_would_block) => {}
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_millis(LINGER_MS), drain).await;
    }
}

/// A connection's read buffer: initialised once, reused for every read, so a
/// read costs no allocation or zeroing. Unread bytes are `bytes[start..end]`.
pub struct InputBuffer {
    bytes: Vec<u8>,
    start: usize,
    end: usize,
    /// The most the buffer may grow to (a line at the limit plus one read).
    capacity_max: usize,
    read_chunk: usize,
}

impl InputBuffer {
    pub fn new(read_chunk: usize, capacity_max: usize) -> InputBuffer {
        InputBuffer {
            bytes: vec![0; read_chunk],
            start: 0,
            end: 0,
            capacity_max: capacity_max.max(read_chunk),
            read_chunk,
        }
    }

    /// The bytes received and not yet consumed.
    pub fn unread(&self) -> &[u8] {
        &self.bytes[self.start..self.end]
    }

    pub fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Free space for the next read: compacts, and grows (up to the cap)
    /// when a long line fills the buffer.
    pub(crate) fn spare(&mut self) -> &mut [u8] {
        if self.bytes.len() - self.end < self.read_chunk / 4 && self.start > 0 {
            self.bytes.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.bytes.len() - self.end < self.read_chunk / 4 && self.bytes.len() < self.capacity_max
        {
            let grown = (self.bytes.len() * 2).min(self.capacity_max);
            self.bytes.resize(grown, 0);
        }
        &mut self.bytes[self.end..]
    }

    pub(crate) fn filled(&mut self, n: usize) {
        self.end += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_compacts_and_grows_up_to_its_cap() {
        let mut buffer = InputBuffer::new(16, 40);
        assert_eq!(buffer.spare().len(), 16);
        buffer.spare()[..14].copy_from_slice(b"HIT a=1\nHIT b=");
        buffer.filled(14);
        buffer.consume(8);
        assert_eq!(buffer.unread(), b"HIT b=");
        // Compaction moves the partial line to the front.
        assert_eq!(buffer.spare().len(), 10);
        assert_eq!(buffer.unread(), b"HIT b=");
        buffer.spare()[..10].copy_from_slice(b"2222222222");
        buffer.filled(10);
        // Full: grows to 32, then to the cap of 40, never beyond.
        assert_eq!(buffer.spare().len(), 16);
        buffer.filled(16);
        assert_eq!(buffer.spare().len(), 8);
        buffer.filled(8);
        assert!(buffer.spare().is_empty());
        buffer.consume(usize::MAX);
        assert!(buffer.unread().is_empty());
        assert_eq!(buffer.spare().len(), 40);
    }
}
