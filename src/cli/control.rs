//! The control socket of a serving `tollgate` process, and `tollgate reload`,
//! its client. SIGHUP reloads too, but a signal cannot say whether the new
//! rules were taken, and a pid file left behind by a dead server makes it hit
//! an unrelated process. So a server listens on a Unix socket named after its
//! pid, in Linux's abstract namespace (nothing on disk to go stale, and it
//! works under systemd's `PrivateTmp=`), answering one request per
//! connection: `RELOAD` gets `OK <what was loaded>` or `ERR <why the rules
//! were refused>`. `tollgate reload` connects to the socket of the pid it is
//! given, checks (with `SO_PEERCRED`) that the process answering is that
//! pid, and exits non-zero with the server's reason when it refuses; when no
//! Tollgate answers for that pid, it signals nothing. Only the server's own
//! user and root may use the socket, as only they may signal the process.

use anyhow::Context;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot};

/// The longest request line.
const REQUEST_BYTES_MAX: u64 = 256;
/// How long a client may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How long `tollgate reload` waits for the answer (loading a large rule file).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// The abstract socket name of the server with process id `pid`.
pub fn socket_name(pid: u32) -> String {
    format!("tollgate/control/{pid}")
}

/// A control request, handed to the thread that owns the running server,
/// with where to send the answer.
pub struct Request {
    pub command: Command,
    pub answer: oneshot::Sender<Result<String, String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Reload,
}

#[cfg(target_os = "linux")]
fn abstract_addr(pid: u32) -> std::io::Result<std::os::unix::net::SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    std::os::unix::net::SocketAddr::from_abstract_name(socket_name(pid).as_bytes())
}

/// Starts listening on this process's control socket, on the current
/// runtime; requests arrive on the returned channel. `None` (with a
/// warning) when the socket cannot be made: SIGHUP still reloads.
pub fn listen() -> Option<mpsc::Receiver<Request>> {
    #[cfg(target_os = "linux")]
    {
        let pid = std::process::id();
        let listener = abstract_addr(pid)
            .and_then(|addr| std::os::unix::net::UnixListener::bind_addr(&addr))
            .and_then(|listener| {
                listener.set_nonblocking(true)?;
                tokio::net::UnixListener::from_std(listener)
            });
        match listener {
            Ok(listener) => {
                let (requests, receiver) = mpsc::channel(4);
                tokio::spawn(accept_loop(listener, requests));
                Some(receiver)
            }
            Err(error) => {
                tracing::warn!(
                    %error,
                    "cannot open the control socket @{}: `tollgate reload` will not reach this process (SIGHUP still reloads)",
                    socket_name(pid)
                );
                None
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

#[cfg(target_os = "linux")]
async fn accept_loop(listener: tokio::net::UnixListener, requests: mpsc::Sender<Request>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(serve(stream, requests.clone()));
    }
}

/// Only the server's user and root may ask it anything.
#[cfg(target_os = "linux")]
fn allowed(stream: &tokio::net::UnixStream) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let own = unsafe { libc::geteuid() };
    stream
        .peer_cred()
        .is_ok_and(|cred| cred.uid() == own || cred.uid() == 0)
}

#[cfg(target_os = "linux")]
async fn serve(stream: tokio::net::UnixStream, requests: mpsc::Sender<Request>) {
    let permitted = allowed(&stream);
    let (reader, mut writer) = stream.into_split();
    let answer = if permitted {
        answer(reader, &requests).await
    } else {
        Err("permission denied: only the server's user and root may control it".to_owned())
    };
    let line = match answer {
        Ok(text) => format!("OK {}\n", one_line(&text)),
        Err(text) => format!("ERR {}\n", one_line(&text)),
    };
    let _ = writer.write_all(line.as_bytes()).await;
}

#[cfg(target_os = "linux")]
async fn answer(
    reader: tokio::net::unix::OwnedReadHalf,
    requests: &mpsc::Sender<Request>,
) -> Result<String, String> {
    let mut line = String::new();
    let mut reader = BufReader::new(reader.take(REQUEST_BYTES_MAX));
    match tokio::time::timeout(REQUEST_TIMEOUT, reader.read_line(&mut line)).await {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => return Err(format!("cannot read the request: {error}")),
        Err(_) => return Err("no request within 2 s".to_owned()),
    }
    let command = match line.trim() {
        "RELOAD" => Command::Reload,
        other => {
            return Err(format!(
                "unknown control request {other:?} (expected RELOAD)"
            ))
        }
    };
    let (answer, answered) = oneshot::channel();
    requests
        .send(Request { command, answer })
        .await
        .map_err(|_| "the server is shutting down".to_owned())?;
    answered
        .await
        .unwrap_or_else(|_| Err("the server is shutting down".to_owned()))
}

/// Newlines would end the answer early.
fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

/// What `tollgate reload` is told about process `pid` when no Tollgate
/// answers for it.
fn not_a_tollgate(pid: u32, why: &str) -> String {
    let what = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|name| format!("process {pid} is `{}`", name.trim()))
        .unwrap_or_else(|_| format!("there is no process {pid}"));
    format!("no Tollgate server answers for process {pid} ({what}; its control socket: {why}); nothing was signalled")
}

/// Asks the server with process id `pid` to reload its rules; `Ok` with its
/// answer, `Err` with why it refused or could not be asked.
pub fn reload(pid: u32) -> anyhow::Result<Result<String, String>> {
    #[cfg(target_os = "linux")]
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start a runtime")?;
        runtime.block_on(ask(pid, "RELOAD"))
    }
    #[cfg(not(target_os = "linux"))]
    {
        anyhow::bail!(
            "`tollgate reload` needs Linux (its control socket is an abstract Unix socket); send SIGHUP instead: kill -HUP {pid}"
        )
    }
}

#[cfg(target_os = "linux")]
async fn ask(pid: u32, request: &str) -> anyhow::Result<Result<String, String>> {
    let stream = abstract_addr(pid)
        .and_then(|addr| std::os::unix::net::UnixStream::connect_addr(&addr))
        .and_then(|stream| {
            stream.set_nonblocking(true)?;
            tokio::net::UnixStream::from_std(stream)
        })
        .map_err(|error| anyhow::anyhow!(not_a_tollgate(pid, &error.to_string())))?;
    let peer = stream.peer_cred().context("cannot tell who answers")?;
    if peer.pid() != Some(pid as i32) {
        anyhow::bail!(not_a_tollgate(
            pid,
            &format!(
                "held by process {}, not {pid}",
                peer.pid().map_or("?".to_owned(), |p| p.to_string())
            )
        ));
    }
    let (reader, mut writer) = stream.into_split();
    writer.write_all(format!("{request}\n").as_bytes()).await?;
    let mut line = String::new();
    tokio::time::timeout(
        ANSWER_TIMEOUT,
        BufReader::new(reader.take(64 * 1024)).read_line(&mut line),
    )
    .await
    .map_err(|_| anyhow::anyhow!("process {pid} did not answer within 60 s"))?
    .with_context(|| format!("no answer from process {pid}"))?;
    let line = line.trim_end();
    if let Some(text) = line.strip_prefix("OK ") {
        Ok(Ok(text.to_owned()))
    } else if let Some(text) = line.strip_prefix("ERR ") {
        Ok(Err(text.to_owned()))
    } else {
        anyhow::bail!("process {pid} answered {line:?}")
    }
}
