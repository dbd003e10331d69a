//! droplet's WebSocket endpoint over real sockets (SPEC §7): exact response
//! bytes, ordering under pipelining, the close-on-bad-frame rules, ping,
//! subprotocol echo, permessage-deflate offers, plain HTTP, size bounds,
//! shutdown, and buckets shared with the line protocol.

use crate::util;

use futures_util::{SinkExt, StreamExt};
use prost::Message as _;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{connect_async, MaybeTlsStream, WebSocketStream};
use tollgate::clock::{Clock, ManualClock};
use tollgate::droplet::proto::{RequestMessage, ResponseMessage};
use tollgate::droplet::DropletConfig;
use util::droplet::DropletTestServer;

type Client = WebSocketStream<MaybeTlsStream<TcpStream>>;

const WAIT: Duration = util::IO_TIMEOUT;

fn request(bucket: &str) -> RequestMessage {
    RequestMessage {
        bucket: Some(bucket.as_bytes().to_vec()),
        id: Some(b"test".to_vec()),
        count: None,
        reset: None,
        ls: None,
        lm: None,
        lh: None,
        ld: None,
        lw: None,
        lo: None,
        r#type: None,
    }
}

fn take(bucket: &str, ls: u32, count: Option<i32>) -> Vec<u8> {
    RequestMessage {
        ls: Some(ls),
        count,
        ..request(bucket)
    }
    .encode_to_vec()
}

fn query(bucket: &str) -> Vec<u8> {
    RequestMessage {
        r#type: Some(1),
        ..request(bucket)
    }
    .encode_to_vec()
}

async fn connect(server: &DropletTestServer) -> Client {
    let (client, _response) = tokio::time::timeout(WAIT, connect_async(server.ws_url()))
        .await
        .expect("handshake in time")
        .expect("handshake succeeds");
    client
}

async fn next_message(client: &mut Client) -> Message {
    tokio::time::timeout(WAIT, client.next())
        .await
        .expect("an answer in time")
        .expect("the connection is open")
        .expect("a valid frame")
}

/// Sends one binary request and returns the raw response bytes.
async fn ask(client: &mut Client, bytes: Vec<u8>) -> Vec<u8> {
    client.send(Message::Binary(bytes.into())).await.unwrap();
    match next_message(client).await {
        Message::Binary(bytes) => bytes.to_vec(),
        other => panic!("expected a binary response, got {other:?}"),
    }
}

/// `(accept, ls, lm)` of a response.
fn decoded(bytes: &[u8]) -> (bool, Option<i32>, Option<i32>) {
    let response = ResponseMessage::decode(bytes).expect("a Droplet.Response");
    (response.accept, response.ls, response.lm)
}

async fn expect_close(client: &mut Client, code: CloseCode) {
    match next_message(client).await {
        Message::Close(Some(frame)) => assert_eq!(frame.code, code),
        other => panic!("expected a close frame with {code:?}, got {other:?}"),
    }
    // Our close reply completes the handshake; then the server hangs up.
    let end = tokio::time::timeout(WAIT, async {
        while let Some(Ok(_)) = client.next().await {}
    });
    end.await.expect("the server closes the connection");
}

#[tokio::test]
async fn takes_and_queries_answer_the_spec_bytes() {
    let clock = Arc::new(ManualClock::new(1_700_000_040_000));
    let server = DropletTestServer::start(clock.clone());
    let mut client = connect(&server).await;
    // SPEC §7: {accept: true, ls: 9} is 08 01 10 09.
    assert_eq!(
        ask(&mut client, take("a", 10, None)).await,
        [0x08, 0x01, 0x10, 0x09]
    );
    assert_eq!(
        decoded(&ask(&mut client, take("a", 10, Some(9))).await),
        (true, Some(0), None)
    );
    // Rejected, with the post-debit balance: -1, a ten-byte varint.
    assert_eq!(
        ask(&mut client, take("a", 10, None)).await,
        [0x08, 0x00, 0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
    );
    assert_eq!(
        decoded(&ask(&mut client, query("a")).await),
        (true, Some(0), None)
    );
    clock.advance_ms(250);
    assert_eq!(
        decoded(&ask(&mut client, query("a")).await),
        (true, Some(2), None)
    );
    // A query never creates: an unknown bucket answers accept alone.
    assert_eq!(ask(&mut client, query("nobody")).await, [0x08, 0x01]);
    assert!(server.buckets.query(b"nobody", clock.now_ms()).is_none());
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order() {
    let server = DropletTestServer::start(util::manual_clock());
    let mut client = connect(&server).await;
    for _ in 0..200 {
        client
            .feed(Message::Binary(take("p", 1_000, None).into()))
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    for expected in (800..1_000).rev() {
        let Message::Binary(bytes) = next_message(&mut client).await else {
            panic!("binary answers only");
        };
        assert_eq!(decoded(&bytes), (true, Some(expected), None));
    }
}

#[tokio::test]
async fn a_text_frame_gets_close_1000_after_earlier_answers() {
    let server = DropletTestServer::start(util::manual_clock());
    let mut client = connect(&server).await;
    client
        .feed(Message::Binary(take("t", 5, None).into()))
        .await
        .unwrap();
    client.feed(Message::text("take bucket=t")).await.unwrap();
    client
        .feed(Message::Binary(take("t", 5, None).into()))
        .await
        .unwrap();
    client.flush().await.unwrap();
    let Message::Binary(bytes) = next_message(&mut client).await else {
        panic!("the request before the text frame is answered");
    };
    assert_eq!(decoded(&bytes), (true, Some(4), None));
    expect_close(&mut client, CloseCode::Normal).await;
    // The request after the text frame was not executed.
    let line = util::converse(server.line.addr, b"QUERY bucket=t\n");
    assert_eq!(line, "OK true ls=4\n");
}

#[tokio::test]
async fn garbage_gets_close_1000() {
    let server = DropletTestServer::start(util::manual_clock());
    let mut client = connect(&server).await;
    client
        .send(Message::Binary(vec![0xff, 0xff, 0xff, 0x00].into()))
        .await
        .unwrap();
    expect_close(&mut client, CloseCode::Normal).await;
}

#[tokio::test]
async fn a_missing_id_or_bucket_gets_close_1000() {
    let server = DropletTestServer::start(util::manual_clock());
    for message in [
        RequestMessage {
            id: None,
            ..request("x")
        },
        RequestMessage {
            bucket: None,
            ..request("x")
        },
    ] {
        let mut client = connect(&server).await;
        client
            .send(Message::Binary(message.encode_to_vec().into()))
            .await
            .unwrap();
        expect_close(&mut client, CloseCode::Normal).await;
    }
}

#[tokio::test]
async fn ping_gets_pong_and_the_connection_stays_open() {
    let server = DropletTestServer::start(util::manual_clock());
    let mut client = connect(&server).await;
    client
        .send(Message::Ping(b"are you there".to_vec().into()))
        .await
        .unwrap();
    assert_eq!(
        next_message(&mut client).await,
        Message::Pong(b"are you there".to_vec().into())
    );
    assert_eq!(
        ask(&mut client, take("ping", 10, None)).await,
        [0x08, 0x01, 0x10, 0x09]
    );
}

#[tokio::test]
async fn the_first_subprotocol_is_echoed_and_deflate_offers_still_connect() {
    let server = DropletTestServer::start(util::manual_clock());
    let mut request = server.ws_url().into_client_request().unwrap();
    let headers = request.headers_mut();
    headers.insert(
        "Sec-WebSocket-Protocol",
        "droplet.v1, other".parse().unwrap(),
    );
    headers.insert(
        "Sec-WebSocket-Extensions",
        "permessage-deflate; client_max_window_bits"
            .parse()
            .unwrap(),
    );
    let (mut client, response) = tokio::time::timeout(WAIT, connect_async(request))
        .await
        .unwrap()
        .expect("the upgrade is accepted");
    assert_eq!(
        response.headers().get("Sec-WebSocket-Protocol").unwrap(),
        "droplet.v1"
    );
    // The extension is declined by not answering it: frames stay uncompressed.
    assert!(response.headers().get("Sec-WebSocket-Extensions").is_none());
    assert_eq!(
        ask(&mut client, take("sub", 10, None)).await,
        [0x08, 0x01, 0x10, 0x09]
    );
}

fn raw_http(server: &DropletTestServer, request: &[u8]) -> String {
    let mut stream = std::net::TcpStream::connect(server.droplet_addr).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream.write_all(request).unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).unwrap();
    String::from_utf8(answer).unwrap()
}

#[test]
fn connections_beyond_the_limit_get_503_and_are_counted() {
    let config = tollgate::app::ServeConfig {
        limits: tollgate::server::Limits {
            connections_max: 2,
            ..tollgate::server::Limits::default()
        },
        droplet: DropletConfig {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            ..DropletConfig::default()
        },
        ..util::test_config(tollgate::rules::RuleSet::embedded_default())
    };
    let server = util::TestServer::start_app(config, util::on_clock(util::manual_clock()));
    let droplet_addr = server.app.droplet_addr().unwrap();
    // A connection holds its slot from the moment it is accepted.
    let held: Vec<_> = (0..2)
        .map(|_| std::net::TcpStream::connect(droplet_addr).unwrap())
        .collect();
    let deadline = std::time::Instant::now() + WAIT;
    let answer = loop {
        let mut refused = std::net::TcpStream::connect(droplet_addr).unwrap();
        let mut answer = String::new();
        // Accepting is asynchronous: until both held connections are counted,
        // a third may still get in (and then waits for its handshake).
        refused
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        match refused.read_to_string(&mut answer) {
            Ok(_) => break answer,
            Err(_) => assert!(std::time::Instant::now() < deadline, "never refused"),
        }
    };
    assert!(
        answer.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
        "{answer}"
    );
    assert!(server.engine.metrics.connections_refused() >= 1);
    drop(held);
}

#[tokio::test]
async fn plain_http_gets_not_implemented_and_bad_upgrades_400() {
    let server = DropletTestServer::start(util::manual_clock());
    let answer = raw_http(
        &server,
        b"GET /anything HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.ends_with("\r\n\r\nNot implemented"), "{answer}");
    let answer = raw_http(
        &server,
        b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    );
    assert!(
        answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
        "{answer}"
    );
    let mut huge = b"GET / HTTP/1.1\r\n".to_vec();
    while huge.len() < 20_000 {
        huge.extend_from_slice(b"X-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    let answer = raw_http(&server, &huge);
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
}

#[tokio::test]
async fn an_oversized_message_gets_close_1009() {
    let config = DropletConfig {
        message_bytes_max: 1024,
        ..DropletConfig::default()
    };
    let server = DropletTestServer::start_with(util::manual_clock(), config);
    let mut client = connect(&server).await;
    let big = take(&"b".repeat(2_000), 10, None);
    client.send(Message::Binary(big.into())).await.unwrap();
    match next_message(&mut client).await {
        Message::Close(Some(frame)) => assert_eq!(frame.code, CloseCode::Size),
        other => panic!("expected close 1009, got {other:?}"),
    }
}

#[tokio::test]
async fn the_bucket_cap_answers_accept_false() {
    let config = DropletConfig {
        buckets_max: 1,
        ..DropletConfig::default()
    };
    let server = DropletTestServer::start_with(util::manual_clock(), config);
    let mut client = connect(&server).await;
    assert_eq!(
        ask(&mut client, take("one", 10, None)).await,
        [0x08, 0x01, 0x10, 0x09]
    );
    assert_eq!(ask(&mut client, take("two", 10, None)).await, [0x08, 0x00]);
    assert_eq!(
        decoded(&ask(&mut client, take("one", 10, None)).await),
        (true, Some(8), None)
    );
}

#[tokio::test]
async fn line_and_websocket_share_buckets() {
    let server = DropletTestServer::start(util::manual_clock());
    let answers = util::converse(
        server.line.addr,
        b"TAKE bucket=shared ls=10 lm=100 count=3\n",
    );
    assert_eq!(answers, "OK true ls=7 lm=97\n");
    let mut client = connect(&server).await;
    assert_eq!(
        decoded(&ask(&mut client, query("shared")).await),
        (true, Some(7), Some(97))
    );
}

#[tokio::test]
async fn shutdown_closes_connections_with_1001() {
    let server = DropletTestServer::start(util::manual_clock());
    let mut client = connect(&server).await;
    assert_eq!(
        ask(&mut client, take("s", 10, None)).await,
        [0x08, 0x01, 0x10, 0x09]
    );
    let droplet_addr = server.droplet_addr;
    let stopping = tokio::task::spawn_blocking(move || server.stop());
    expect_close(&mut client, CloseCode::Away).await;
    stopping.await.unwrap();
    assert!(std::net::TcpStream::connect(droplet_addr).is_err());
}

#[tokio::test]
async fn frames_sent_with_the_handshake_are_answered() {
    let server = DropletTestServer::start(util::manual_clock());
    let payload = take("eager", 10, None);
    let mut bytes =
        b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
        Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
            .to_vec();
    // One masked binary frame; an all-zero mask leaves the payload as it is.
    bytes.extend_from_slice(&[0x82, 0x80 | payload.len() as u8, 0, 0, 0, 0]);
    bytes.extend_from_slice(&payload);
    let mut stream = std::net::TcpStream::connect(server.droplet_addr).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream.write_all(&bytes).unwrap();
    let answer_frame = [0x82, 0x04, 0x08, 0x01, 0x10, 0x09];
    let mut answer = Vec::new();
    let mut chunk = [0u8; 1024];
    while !answer.ends_with(&answer_frame) {
        let n = stream.read(&mut chunk).expect("the answer in time");
        assert!(
            n > 0,
            "closed early: {:?}",
            String::from_utf8_lossy(&answer)
        );
        answer.extend_from_slice(&chunk[..n]);
    }
    assert!(answer.starts_with(b"HTTP/1.1 101 Switching Protocols\r\n"));
}
