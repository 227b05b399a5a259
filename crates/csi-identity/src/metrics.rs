//! Opt-in Prometheus endpoint (`--metrics-address`) and the per-RPC latency layer.
//!
//! The endpoint speaks just enough HTTP/1.1 to answer `GET /metrics`; a web framework would
//! cost more build time than the whole driver.

use cloud_backend::metrics;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::codegen::http;

/// Serves the registry on `addr` until the process ends.
pub async fn serve(addr: std::net::SocketAddr) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving metrics on /metrics");
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut n = 0;
                while n < buf.len() {
                    match tokio::time::timeout(
                        std::time::Duration::from_secs(5),
                        sock.read(&mut buf[n..]),
                    )
                    .await
                    {
                        Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
                        Ok(Ok(m)) => n += m,
                    }
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let req = String::from_utf8_lossy(&buf[..n]);
                let (status, body) =
                    if req.starts_with("GET /metrics ") || req.starts_with("GET /metrics?") {
                        ("200 OK", metrics::global().render())
                    } else {
                        ("404 Not Found", "not found; try /metrics\n".to_string())
                    };
                let head = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = sock.write_all(head.as_bytes()).await;
                let _ = sock.write_all(body.as_bytes()).await;
            });
        }
    });
    Ok(())
}

/// A tower layer timing every gRPC call by method.
#[derive(Debug, Clone, Copy, Default)]
pub struct RpcMetricsLayer;

impl<S> tower::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetrics<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RpcMetrics { inner }
    }
}

#[derive(Debug, Clone)]
pub struct RpcMetrics<S> {
    inner: S,
}

impl<S, B, R> tower::Service<http::Request<B>> for RpcMetrics<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>> + Send,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = req
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or("unknown")
            .to_string();
        let start = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await;
            // Errors from handlers travel in the headers ("trailers-only"); successes carry
            // their status in trailers, which we do not wait for: absent means OK.
            let code = match &res {
                Ok(r) => r
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("0")
                    .to_string(),
                Err(_) => "transport".into(),
            };
            metrics::global().observe(
                "ferrovol_csi_operation_duration_seconds",
                vec![("method", method), ("grpc_code", code)],
                start.elapsed().as_secs_f64(),
            );
            res
        })
    }
}
