//! A small async client for the divvy line protocol (`HIT`, `PEEK` and raw
//! lines), with pipelining: many requests written at once, answers read in
//! order. Used by the tests and tools; divvy's own clients work unchanged.

use std::fmt::Write as _;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, ToSocketAddrs};

/// A server's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    Ok {
        allowed: bool,
        credit: i64,
        next_reset_seconds: i64,
    },
    Err {
        code: String,
        message: String,
    },
    /// Any other line (extension commands).
    Other(String),
}

impl Response {
    /// Parses one response line (without its newline).
    pub fn parse(line: &str) -> Response {
        if let Some(rest) = line.strip_prefix("ERR ") {
            let (code, message) = rest.split_once(' ').unwrap_or((rest, ""));
            return Response::Err {
                code: code.to_owned(),
                message: message.trim_matches('"').to_owned(),
            };
        }
        let parts: Vec<&str> = line.split(' ').collect();
        if let ["OK", allowed @ ("true" | "false"), credit, reset] = parts[..] {
            if let (Ok(credit), Ok(next_reset_seconds)) = (credit.parse(), reset.parse()) {
                return Response::Ok {
                    allowed: allowed == "true",
                    credit,
                    next_reset_seconds,
                };
            }
        }
        Response::Other(line.to_owned())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("the server closed the connection")]
    Closed,
    #[error("cannot encode {0:?}: a value that needs quoting cannot contain '\"'")]
    Unencodable(String),
}

/// Appends a token, quoted when it is empty or holds whitespace, `=` or a
/// leading `"`.
fn push_token(line: &mut String, token: &str) -> Result<(), ClientError> {
    let needs_quotes = token.is_empty()
        || token.starts_with('"')
        || token
            .chars()
            .any(|c| c == '=' || crate::protocol::is_whitespace(c));
    if !needs_quotes {
        line.push_str(token);
        return Ok(());
    }
    if token.contains('"') || token.contains('\n') {
        return Err(ClientError::Unencodable(token.to_owned()));
    }
    let _ = write!(line, "\"{token}\"");
    Ok(())
}

/// Formats `VERB k=v …` (without the newline).
pub fn format_request(verb: &str, pairs: &[(&str, &str)]) -> Result<String, ClientError> {
    let mut line = String::from(verb);
    for (key, value) in pairs {
        line.push(' ');
        push_token(&mut line, key)?;
        line.push('=');
        push_token(&mut line, value)?;
    }
    Ok(line)
}

pub struct Client {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    line: String,
}

impl Client {
    pub async fn connect(addr: impl ToSocketAddrs) -> Result<Client, ClientError> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (reader, writer) = stream.into_split();
        Ok(Client {
            reader: BufReader::new(reader),
            writer,
            line: String::new(),
        })
    }

    pub async fn hit(&mut self, pairs: &[(&str, &str)]) -> Result<Response, ClientError> {
        self.send(&format_request("HIT", pairs)?).await
    }

    pub async fn peek(&mut self, pairs: &[(&str, &str)]) -> Result<Response, ClientError> {
        self.send(&format_request("PEEK", pairs)?).await
    }

    /// Sends one raw line and reads one answer.
    pub async fn send(&mut self, line: &str) -> Result<Response, ClientError> {
        self.writer.write_all(line.as_bytes()).await?;
        self.writer.write_all(b"\n").await?;
        self.read_response().await
    }

    /// Writes every line at once, then reads one answer per line, in order.
    /// Stops early if the server closes the connection (after an `ERR`).
    pub async fn pipeline(&mut self, lines: &[String]) -> Result<Vec<Response>, ClientError> {
        let mut batch = String::new();
        for line in lines {
            batch.push_str(line);
            batch.push('\n');
        }
        self.writer.write_all(batch.as_bytes()).await?;
        let mut responses = Vec::with_capacity(lines.len());
        for _ in lines {
            match self.read_response().await {
                Ok(response) => responses.push(response),
                Err(ClientError::Closed) => break,
                Err(error) => return Err(error),
            }
        }
        Ok(responses)
    }

    pub async fn read_response(&mut self) -> Result<Response, ClientError> {
        self.line.clear();
        if self.reader.read_line(&mut self.line).await? == 0 {
            return Err(ClientError::Closed);
        }
        Ok(Response::parse(self.line.trim_end_matches('\n')))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_quotes_like_the_node_client() {
        assert_eq!(format_request("HIT", &[("a", "b")]).unwrap(), "HIT a=b");
        assert_eq!(
            format_request("HIT", &[("a b", ""), ("x", "=")]).unwrap(),
            "HIT \"a b\"=\"\" x=\"=\""
        );
        assert!(format_request("HIT", &[("a", "\"x y")]).is_err());
    }

    #[test]
    fn parses_responses() {
        assert_eq!(
            Response::parse("OK true 999 60"),
            Response::Ok {
                allowed: true,
                credit: 999,
                next_reset_seconds: 60
            }
        );
        assert_eq!(
            Response::parse("ERR unknown-command \"Unrecognized command: FOO\""),
            Response::Err {
                code: "unknown-command".into(),
                message: "Unrecognized command: FOO".into()
            }
        );
        assert_eq!(Response::parse("OK x"), Response::Other("OK x".into()));
    }
}
