//! A fault-injecting HTTP proxy between the driver and the EC2 emulator.
//!
//! moto answers every call promptly and never says IncorrectState, VolumeLimitExceeded or
//! IdempotentParameterMismatch; real EC2 does all of that, throttles, fails with 5xx and loses
//! answers. The proxy forwards EC2 query-API requests to the emulator, counts them per `Action`
//! (the benchmark's "EC2 calls per lifecycle" come from here, so they include every retry), and
//! applies injected faults to chosen calls:
//!
//! - [`Fault::Throttle`], [`Fault::ServerError`], [`Fault::Error`]: answered by the proxy, the
//!   emulator never sees the call;
//! - [`Fault::LoseAnswer`]: the emulator carries the call out, then the connection is closed
//!   without an answer (the case that duplicates volumes when a client retries blindly);
//! - [`Fault::Slow`]: carried out, answered late.
//!
//! It runs on a thread of its own, so a test that blocks its runtime does not stall it.

use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// HTTP 503 `RequestLimitExceeded`, as EC2 throttles.
    Throttle,
    /// HTTP 500 `InternalError`.
    ServerError,
    /// Any EC2 error answer, e.g. 400 `IncorrectState`.
    Error {
        status: u16,
        code: String,
        message: String,
    },
    /// Forward the call, then drop the connection without answering.
    LoseAnswer,
    /// Forward the call and answer after this delay.
    Slow(Duration),
}

impl Fault {
    pub fn error(code: &str, message: &str) -> Fault {
        Fault::Error {
            status: 400,
            code: code.into(),
            message: message.into(),
        }
    }
}

struct Rule {
    action: String,
    fault: Fault,
    /// Matching calls to let through before the fault applies.
    skip: u32,
    /// Matching calls the fault applies to after that.
    times: u32,
}

#[derive(Default)]
struct State {
    rules: Vec<Rule>,
    calls: BTreeMap<String, u64>,
    faults_applied: u64,
}

impl State {
    /// Counts the call and picks the fault, if any, for it.
    fn on_call(&mut self, action: &str) -> Option<Fault> {
        *self.calls.entry(action.to_string()).or_default() += 1;
        let rule = self
            .rules
            .iter_mut()
            .find(|r| r.action == action && r.times > 0)?;
        if rule.skip > 0 {
            rule.skip -= 1;
            return None;
        }
        rule.times -= 1;
        self.faults_applied += 1;
        Some(rule.fault.clone())
    }
}

/// The proxy; stops when dropped.
pub struct FaultProxy {
    pub endpoint: String,
    state: Arc<Mutex<State>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on `bind` (port 0: any free port) and forwards to the emulator at `upstream`
    /// (`http://host:port`).
    pub fn start_on(bind: SocketAddr, upstream: &str) -> Result<FaultProxy> {
        let upstream: SocketAddr = upstream
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .parse()
            .with_context(|| format!("upstream {upstream:?} is not http://ip:port"))?;
        let listener = std::net::TcpListener::bind(bind)?;
        listener.set_nonblocking(true)?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let state = Arc::new(Mutex::new(State::default()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let st = state.clone();
        let thread = std::thread::Builder::new()
            .name("fault-proxy".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        eprintln!("fault proxy: no runtime: {e}");
                        return;
                    }
                };
                rt.block_on(async move {
                    let Ok(listener) = TcpListener::from_std(listener) else {
                        return;
                    };
                    let accept = async {
                        loop {
                            let Ok((conn, _)) = listener.accept().await else {
                                continue;
                            };
                            let _ = conn.set_nodelay(true);
                            tokio::spawn(serve(conn, upstream, st.clone()));
                        }
                    };
                    tokio::select! {
                        _ = accept => {}
                        _ = stopped => {}
                    }
                });
            })?;
        Ok(FaultProxy {
            endpoint,
            state,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// On a free loopback port.
    pub fn start(upstream: &str) -> Result<FaultProxy> {
        Self::start_on(([127, 0, 0, 1], 0).into(), upstream)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies `fault` to the next `times` calls of `action`.
    pub fn inject(&self, action: &str, fault: Fault, times: u32) {
        self.inject_after(action, 0, fault, times);
    }

    /// Lets `skip` calls of `action` through, then applies `fault` to the next `times`.
    pub fn inject_after(&self, action: &str, skip: u32, fault: Fault, times: u32) {
        self.state().rules.push(Rule {
            action: action.into(),
            fault,
            skip,
            times,
        });
    }

    /// Removes every fault not yet applied.
    pub fn clear(&self) {
        self.state().rules.clear();
    }

    /// Faults injected so far.
    pub fn faults_applied(&self) -> u64 {
        self.state().faults_applied
    }

    /// Calls received per `Action` (faulted ones included).
    pub fn calls(&self) -> BTreeMap<String, u64> {
        self.state().calls.clone()
    }

    pub fn calls_of(&self, action: &str) -> u64 {
        self.state().calls.get(action).copied().unwrap_or(0)
    }

    pub fn reset_calls(&self) {
        self.state().calls.clear();
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Request {
    head: String,
    body: Vec<u8>,
}

/// Serves one client connection, keeping it alive across requests as the SDK expects.
async fn serve(mut client: TcpStream, upstream: SocketAddr, state: Arc<Mutex<State>>) {
    while let Ok(Some(req)) = read_request(&mut client).await {
        let action = form_value(&req.body, "Action").unwrap_or_else(|| "(none)".into());
        let fault = state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .on_call(&action);
        let answer = match fault {
            None => forward(&req, upstream).await,
            Some(Fault::Throttle) => Ok(error_answer(
                503,
                "RequestLimitExceeded",
                "Request limit exceeded.",
            )),
            Some(Fault::ServerError) => Ok(error_answer(
                500,
                "InternalError",
                "An internal error has occurred.",
            )),
            Some(Fault::Error {
                status,
                code,
                message,
            }) => Ok(error_answer(status, &code, &message)),
            Some(Fault::LoseAnswer) => {
                let _ = forward(&req, upstream).await;
                return;
            }
            Some(Fault::Slow(delay)) => {
                let answer = forward(&req, upstream).await;
                tokio::time::sleep(delay).await;
                answer
            }
        };
        let Ok(answer) = answer else {
            // The emulator is gone: so is the answer.
            return;
        };
        if client.write_all(&answer).await.is_err() {
            return;
        }
    }
}

/// Reads one request (head and Content-Length body); `None` at a clean end of the connection.
async fn read_request(conn: &mut TcpStream) -> std::io::Result<Option<Request>> {
    let mut buf = Vec::with_capacity(4096);
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i;
        }
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let len = header(&head, "content-length")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let mut chunk = vec![0u8; len - body.len()];
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(len);
    Ok(Some(Request { head, body }))
}

/// Sends the request to the emulator as HTTP/1.0 (one connection per call, never a chunked
/// answer) and re-frames its answer with a Content-Length for the client's kept-alive
/// connection.
async fn forward(req: &Request, upstream: SocketAddr) -> std::io::Result<Vec<u8>> {
    let mut lines = req.head.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let request_line = match request_line.rsplit_once(' ') {
        Some((start, _version)) => format!("{start} HTTP/1.0"),
        None => request_line.to_string(),
    };
    let mut out = format!("{request_line}\r\n");
    for l in lines {
        if !l.to_ascii_lowercase().starts_with("connection:") {
            out.push_str(l);
            out.push_str("\r\n");
        }
    }
    out.push_str("Connection: close\r\n\r\n");
    let mut up = TcpStream::connect(upstream).await?;
    up.write_all(out.as_bytes()).await?;
    up.write_all(&req.body).await?;
    let mut answer = Vec::new();
    up.read_to_end(&mut answer).await?;
    let head_end = find(&answer, b"\r\n\r\n").ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "answer without a head")
    })?;
    let head = String::from_utf8_lossy(&answer[..head_end]).into_owned();
    let body = &answer[head_end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status_line = match status_line.split_once(' ') {
        Some((_version, rest)) => format!("HTTP/1.1 {rest}"),
        None => status_line.to_string(),
    };
    let mut framed = format!("{status_line}\r\n");
    for l in lines {
        let lower = l.to_ascii_lowercase();
        if !(lower.starts_with("connection:")
            || lower.starts_with("content-length:")
            || lower.starts_with("transfer-encoding:")
            || lower.starts_with("keep-alive:"))
        {
            framed.push_str(l);
            framed.push_str("\r\n");
        }
    }
    framed.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut framed = framed.into_bytes();
    framed.extend_from_slice(body);
    Ok(framed)
}

/// An EC2 query-API error answer.
fn error_answer(status: u16, code: &str, message: &str) -> Vec<u8> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors><RequestID>fault-proxy</RequestID></Response>"
    );
    let reason = match status {
        400 => "Bad Request",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: text/xml;charset=UTF-8\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn header(head: &str, name: &str) -> Option<String> {
    head.split("\r\n").skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_string())
    })
}

/// The value of `key` in a form-encoded body (EC2 actions are plain ASCII words).
fn form_value(body: &[u8], key: &str) -> Option<String> {
    let body = std::str::from_utf8(body).ok()?;
    body.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then(|| v.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_apply_to_the_chosen_calls_only() {
        let mut s = State::default();
        s.rules.push(Rule {
            action: "CreateVolume".into(),
            fault: Fault::Throttle,
            skip: 1,
            times: 2,
        });
        assert_eq!(s.on_call("DescribeVolumes"), None);
        assert_eq!(s.on_call("CreateVolume"), None);
        assert_eq!(s.on_call("CreateVolume"), Some(Fault::Throttle));
        assert_eq!(s.on_call("CreateVolume"), Some(Fault::Throttle));
        assert_eq!(s.on_call("CreateVolume"), None);
        assert_eq!(s.calls["CreateVolume"], 4);
        assert_eq!(s.faults_applied, 2);
    }

    #[test]
    fn reads_the_action_of_a_query_request() {
        assert_eq!(
            form_value(b"Action=CreateVolume&Version=2016-11-15", "Action").as_deref(),
            Some("CreateVolume")
        );
        assert_eq!(form_value(b"Version=1", "Action"), None);
    }
}
