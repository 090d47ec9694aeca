//! The daemon's small HTTP/1.1 endpoint: `/metrics` (Prometheus text), `/healthz` (the process
//! is up), `/readyz` (listeners bound and at least the configured peers known). Hand-rolled on
//! a tokio listener: three fixed GET routes need no framework. Requests are bounded in size
//! and time.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Renders a route's body; `None` = 404.
pub trait Routes: Send + Sync + 'static {
    fn metrics(&self) -> String;
    fn ready(&self) -> bool;
}

/// Serves until the listener fails.
pub async fn serve(listener: TcpListener, routes: Arc<dyn Routes>) {
    {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else { return };
            let routes = routes.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let n = match tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf)).await {
                    Ok(Ok(n)) => n,
                    _ => return,
                };
                let req = String::from_utf8_lossy(&buf[..n]);
                let path = req.split_whitespace().nth(1).unwrap_or("/");
                let (status, ctype, body) = match path {
                    "/metrics" => ("200 OK", "text/plain; version=0.0.4", routes.metrics()),
                    "/healthz" => ("200 OK", "text/plain", "ok\n".to_owned()),
                    "/readyz" if routes.ready() => ("200 OK", "text/plain", "ready\n".to_owned()),
                    "/readyz" => ("503 Service Unavailable", "text/plain", "not ready\n".to_owned()),
                    _ => ("404 Not Found", "text/plain", "not found\n".to_owned()),
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    }
}
