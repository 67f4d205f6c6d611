//! A small HTTP/1.1 proxy on 127.0.0.1 that stands in front of an EC2
//! endpoint (moto) and, when armed, makes chosen EC2 actions fail.
//!
//! EC2 speaks the query protocol: every call is a `POST /` whose
//! form-encoded body starts with `Action=<Name>`. The proxy reads each
//! request whole (headers and `Content-Length` body), looks up the action,
//! and then
//! - answers with an EC2 error document (`<Response><Errors><Error><Code>`,
//!   the shape the EC2 API reference's "Error responses" shows) and the given
//!   HTTP status, for as many calls as it was armed for ([`Fault::Error`]);
//! - or holds the connection without answering ([`Fault::Stall`]), so the
//!   client's own timeout fires;
//! - or answers with what the upstream said the last time it was asked the
//!   very same request ([`Fault::Stale`]): EC2 is eventually consistent, and
//!   a Describe call may return the state from before a change the caller
//!   has just made or seen;
//! - or forwards the request to the upstream and relays the answer.
//!
//! Every request's form parameters are recorded ([`FaultProxy::requests`]),
//! so a test can check what the client asked for where the upstream ignores
//! it (moto ignores `PrivateIpAddress` in AssociateAddress and
//! `AllowReassignment` in AssignPrivateIpAddresses).
//!
//! One request per connection (the proxy answers with `Connection: close`),
//! which the SDK's client handles by opening a new one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// What an armed action gets instead of the upstream's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// An EC2 error: HTTP `status`, `<Code>` and `<Message>`.
    Error { status: u16, code: String, message: String },
    /// No answer for this long, then the connection is closed.
    Stall(Duration),
    /// The upstream's last answer to the same request (the same form body),
    /// as an eventually consistent read may give; forwarded when there is
    /// none yet.
    Stale,
}

impl Fault {
    /// EC2's throttling answer (503 `RequestLimitExceeded`).
    pub fn throttled() -> Self {
        Self::Error { status: 503, code: "RequestLimitExceeded".into(), message: "Request limit exceeded.".into() }
    }

    /// EC2's answer to a call the credentials may not make (403).
    pub fn unauthorized() -> Self {
        Self::Error {
            status: 403,
            code: "UnauthorizedOperation".into(),
            message: "You are not authorized to perform this operation.".into(),
        }
    }
}

#[derive(Debug, Default)]
struct Rules {
    /// Action -> the fault and how many more calls get it.
    armed: HashMap<String, (Fault, usize)>,
    /// Action -> how many calls got a fault.
    served: HashMap<String, usize>,
    /// Action -> how many calls were forwarded.
    forwarded: HashMap<String, usize>,
    /// Every request's form parameters, in arrival order.
    log: Vec<Vec<(String, String)>>,
    /// The last answer per request body (for [`Fault::Stale`]).
    answers: HashMap<Vec<u8>, Vec<u8>>,
}

/// The running proxy; stops on drop.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    rules: Arc<Mutex<Rules>>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `upstream`.
    /// Must be called inside a tokio runtime.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        Self::serve_on(TcpListener::bind("127.0.0.1:0").await?, upstream)
    }

    /// Serves on `listener`, a socket bound elsewhere (in a lab's network
    /// namespace, where the gateways reach it). Must be called inside a
    /// tokio runtime that keeps running (not a current-thread runtime
    /// driven only now and then).
    pub fn start_on(listener: std::net::TcpListener, upstream: SocketAddr) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        Self::serve_on(TcpListener::from_std(listener)?, upstream)
    }

    fn serve_on(listener: TcpListener, upstream: SocketAddr) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let rules = Arc::new(Mutex::new(Rules::default()));
        let task = tokio::spawn(accept_loop(listener, upstream, rules.clone()));
        Ok(Self { addr, rules, task })
    }

    /// The URL to give the SDK as its endpoint.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next `times` calls of `action` get `fault`.
    pub fn arm(&self, action: &str, fault: Fault, times: usize) {
        self.lock().armed.insert(action.to_owned(), (fault, times));
    }

    /// Every action forwards again.
    pub fn disarm_all(&self) {
        self.lock().armed.clear();
    }

    /// How many calls of `action` got a fault so far.
    pub fn faults_served(&self, action: &str) -> usize {
        self.lock().served.get(action).copied().unwrap_or(0)
    }

    /// How many calls of `action` were forwarded so far.
    pub fn forwarded(&self, action: &str) -> usize {
        self.lock().forwarded.get(action).copied().unwrap_or(0)
    }

    /// The form parameters of every call of `action` so far (the proxy's
    /// faults included), in order.
    pub fn requests(&self, action: &str) -> Vec<Vec<(String, String)>> {
        self.lock()
            .log
            .iter()
            .filter(|params| params.iter().any(|(k, v)| k == "Action" && v == action))
            .cloned()
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Rules> {
        self.rules.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, rules: Arc<Mutex<Rules>>) {
    // Connection tasks are detached: they end with their connection, and a
    // stalled one after its stall.
    while let Ok((conn, _)) = listener.accept().await {
        tokio::spawn(serve(conn, upstream, rules.clone()));
    }
}

/// One request, whole: its head (through the blank line) and body.
struct Request {
    head: String,
    body: Vec<u8>,
}

const MAX_HEAD: usize = 64 * 1024;

async fn read_request(conn: &mut TcpStream) -> std::io::Result<Option<Request>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > MAX_HEAD {
            return Err(std::io::Error::other("request head over 64 KiB"));
        }
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let len = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < len {
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::other("request body cut short"));
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(len);
    Ok(Some(Request { head, body }))
}

/// The form body's `Action` value.
fn action(body: &[u8]) -> Option<String> {
    String::from_utf8_lossy(body).split('&').find_map(|kv| kv.strip_prefix("Action=")).map(str::to_owned)
}

/// The form body's parameters, decoded.
fn params(body: &[u8]) -> Vec<(String, String)> {
    form_urlencoded::parse(body).into_owned().collect()
}

/// One parameter of a recorded request (the first of that name).
pub fn param<'a>(request: &'a [(String, String)], name: &str) -> Option<&'a str> {
    request.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

fn error_response(status: u16, code: &str, message: &str) -> Vec<u8> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors><RequestID>egret-faultproxy</RequestID></Response>"
    );
    let reason = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: text/xml;charset=UTF-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn serve(mut conn: TcpStream, upstream: SocketAddr, rules: Arc<Mutex<Rules>>) {
    let Ok(Some(req)) = read_request(&mut conn).await else { return };
    let name = action(&req.body).unwrap_or_default();
    let fault = {
        let mut r = rules.lock().unwrap_or_else(PoisonError::into_inner);
        r.log.push(params(&req.body));
        let fault = match r.armed.get_mut(&name) {
            Some((fault, left)) if *left > 0 => {
                *left -= 1;
                Some(fault.clone())
            }
            _ => None,
        };
        let counter = if fault.is_some() { &mut r.served } else { &mut r.forwarded };
        *counter.entry(name).or_default() += 1;
        fault
    };
    match fault {
        Some(Fault::Error { status, code, message }) => {
            let _ = conn.write_all(&error_response(status, &code, &message)).await;
        }
        Some(Fault::Stall(d)) => tokio::time::sleep(d).await,
        Some(Fault::Stale) => {
            let old = rules.lock().unwrap_or_else(PoisonError::into_inner).answers.get(&req.body).cloned();
            match old {
                Some(answer) => {
                    let _ = conn.write_all(&answer).await;
                }
                None => relay(&mut conn, upstream, &req, &rules).await,
            }
        }
        None => relay(&mut conn, upstream, &req, &rules).await,
    }
    let _ = conn.shutdown().await;
}

/// Forwards the request, remembers a successful answer for [`Fault::Stale`],
/// and answers 502 when the upstream cannot be reached.
async fn relay(conn: &mut TcpStream, upstream: SocketAddr, req: &Request, rules: &Mutex<Rules>) {
    match forward(upstream, req).await {
        Ok(answer) => {
            if answer.starts_with(b"HTTP/1.1 200") {
                rules.lock().unwrap_or_else(PoisonError::into_inner).answers.insert(req.body.clone(), answer.clone());
            }
            let _ = conn.write_all(&answer).await;
        }
        Err(e) => {
            let _ = conn.write_all(&error_response(502, "ProxyUpstreamError", &e.to_string())).await;
        }
    }
}

/// Sends the request upstream with `Connection: close` and returns the
/// whole answer (read to the upstream's end of stream).
async fn forward(upstream: SocketAddr, req: &Request) -> std::io::Result<Vec<u8>> {
    let mut up = TcpStream::connect(upstream).await?;
    let mut head = String::new();
    for (i, line) in req.head.split("\r\n").enumerate() {
        if line.is_empty() {
            continue;
        }
        if i > 0 && line.split_once(':').is_some_and(|(k, _)| k.trim().eq_ignore_ascii_case("connection")) {
            continue;
        }
        head.push_str(line);
        head.push_str("\r\n");
    }
    head.push_str("Connection: close\r\n\r\n");
    up.write_all(head.as_bytes()).await?;
    up.write_all(&req.body).await?;
    let mut answer = Vec::new();
    up.read_to_end(&mut answer).await?;
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_from_a_form_body() {
        assert_eq!(action(b"Action=DescribeAddresses&Version=2016-11-15").as_deref(), Some("DescribeAddresses"));
        assert_eq!(action(b"Version=2016-11-15&Action=AssociateAddress").as_deref(), Some("AssociateAddress"));
        assert_eq!(action(b"Version=2016-11-15"), None);
    }

    #[test]
    fn parameters_are_decoded() {
        let p =
            params(b"Action=AssignPrivateIpAddresses&PrivateIpAddress.1=203.0.113.40&AllowReassignment=true&X=a%2Fb+c");
        assert_eq!(param(&p, "PrivateIpAddress.1"), Some("203.0.113.40"));
        assert_eq!(param(&p, "AllowReassignment"), Some("true"));
        assert_eq!(param(&p, "X"), Some("a/b c"));
        assert_eq!(param(&p, "Y"), None);
    }

    #[test]
    fn error_document_shape() {
        let r = String::from_utf8(error_response(503, "RequestLimitExceeded", "slow down")).unwrap_or_default();
        assert!(r.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(r.contains("<Errors><Error><Code>RequestLimitExceeded</Code><Message>slow down</Message>"));
        let body = &r[r.find("\r\n\r\n").map_or(0, |i| i + 4)..];
        assert!(r.contains(&format!("Content-Length: {}\r\n", body.len())));
    }
}
