//! The HTTP endpoint for operators: the Prometheus exposition at the
//! configured metrics path (matched exactly against the request target, as
//! divvy did), `/healthz` and `/readyz`; every other target answers 404. It
//! runs on its own thread with a small single-threaded runtime (hyper,
//! HTTP/1.1), so scrapes never share a runtime with the hit path. Bounded:
//! at most `connections_max` connections at once (more are closed at
//! accept), and a client must finish its request headers within
//! `header_read_timeout_ms`.

use super::exposition::{PrometheusExporter, CONTENT_TYPE};
use super::health::Readiness;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::CONTENT_TYPE as CONTENT_TYPE_HEADER;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot listen for HTTP on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start the HTTP thread: {0}")]
    Thread(std::io::Error),
}

#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub listen: SocketAddr,
    /// The request target that serves metrics, e.g. `/metrics`.
    pub metrics_path: String,
    /// Most HTTP connections open at once.
    pub connections_max: usize,
    /// How long a client may take to send its request headers.
    pub header_read_timeout_ms: u64,
}

impl HttpConfig {
    pub fn new(listen: SocketAddr, metrics_path: String) -> HttpConfig {
        HttpConfig {
            listen,
            metrics_path,
            connections_max: 64,
            header_read_timeout_ms: 10_000,
        }
    }
}

/// What the endpoint answers from.
pub struct HttpState {
    pub exporter: PrometheusExporter,
    pub readiness: Arc<Readiness>,
    pub metrics_path: String,
}

/// A running HTTP endpoint; stops when [`HttpEndpoint::stop`] is called or
/// it is dropped.
pub struct HttpEndpoint {
    local_addr: SocketAddr,
    metrics_path: String,
    shutdown: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HttpEndpoint {
    /// Binds now (so a bad address fails the start) and serves on a new
    /// thread.
    pub fn start(config: HttpConfig, state: HttpState) -> Result<HttpEndpoint, HttpError> {
        let bind_error = |source| HttpError::Bind {
            addr: config.listen,
            source,
        };
        let listener = std::net::TcpListener::bind(config.listen).map_err(bind_error)?;
        listener.set_nonblocking(true).map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let (shutdown, stopped) = watch::channel(false);
        let metrics_path = state.metrics_path.clone();
        let state = Arc::new(state);
        let thread = std::thread::Builder::new()
            .name("tollgate-http".into())
            .spawn(move || run(listener, config, state, stopped))
            .map_err(HttpError::Thread)?;
        Ok(HttpEndpoint {
            local_addr,
            metrics_path,
            shutdown,
            thread: Some(thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn metrics_path(&self) -> &str {
        &self.metrics_path
    }

    /// Stops accepting, closes open connections, and waits for the thread.
    pub fn stop(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for HttpEndpoint {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

fn run(
    listener: std::net::TcpListener,
    config: HttpConfig,
    state: Arc<HttpState>,
    mut stopped: watch::Receiver<bool>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot start the HTTP runtime; metrics and health are not served");
            return;
        }
    };
    runtime.block_on(async move {
        let listener = match tokio::net::TcpListener::from_std(listener) {
            Ok(listener) => listener,
            Err(error) => {
                tracing::error!(%error, "cannot register the HTTP listener");
                return;
            }
        };
        let slots = Arc::new(Semaphore::new(config.connections_max.max(1)));
        let header_read_timeout = Duration::from_millis(config.header_read_timeout_ms.max(1));
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((stream, _peer)) = accepted else { continue };
                    // Over the limit: drop the stream, which closes it.
                    let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else { continue };
                    let state = Arc::clone(&state);
                    connections.spawn(async move {
                        let _slot = slot;
                        let service = hyper::service::service_fn(move |request| {
                            let response = respond(&state, &request);
                            async move { Ok::<_, Infallible>(response) }
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .timer(TokioTimer::new())
                            .header_read_timeout(header_read_timeout)
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                _ = stopped.changed() => break,
            }
        }
        connections.abort_all();
    });
}

fn respond(state: &HttpState, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    let target = request
        .uri()
        .path_and_query()
        .map_or("", |target| target.as_str());
    if target == state.metrics_path {
        return match state.exporter.render() {
            Ok(body) => text(StatusCode::OK, CONTENT_TYPE, body),
            Err(error) => {
                tracing::error!(%error, "cannot render metrics");
                plain(StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
            }
        };
    }
    match request.uri().path() {
        "/healthz" => plain(StatusCode::OK, "ok\n".into()),
        "/readyz" => match state.readiness.check() {
            Ok(()) => plain(StatusCode::OK, "ready\n".into()),
            Err(reason) => plain(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {reason}\n"),
            ),
        },
        _ => text(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            Vec::new(),
        ),
    }
}

fn plain(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    text(status, "text/plain; charset=utf-8", body.into_bytes())
}

fn text(status: StatusCode, content_type: &'static str, body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE_HEADER,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}
