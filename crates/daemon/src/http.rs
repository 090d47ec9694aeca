//! The daemon's small HTTP/1.1 endpoint: `/metrics` (Prometheus text), `/healthz` (the process
//! is up) and the readiness checks ([`Readiness`]):
//!
//! - `/readyz`: the configuration is loaded and every listener is bound and serving (the
//!   Engine API, the router API, this endpoint). 200 or 503; the body reports every check.
//! - `/readyz/engines`: and at least one engine is registered with its Attach stream open (a
//!   migration to this region has an engine to warm).
//! - `/readyz/peers`: and every configured peer region is reachable now (a peer not connected
//!   is dialled, bounded in time; the connection stays for the next query).
//!
//! Hand-rolled on a tokio listener: a few fixed GET routes need no framework. Requests are
//! bounded in size and time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the readiness checks see, gathered by the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Readiness {
    /// The configuration is loaded and every listener is bound and serving.
    pub listening: bool,
    /// Engines registered, and how many of them have their Attach stream open.
    pub engines_registered: usize,
    pub engines_attached: usize,
    /// Each configured peer region and whether it is reachable.
    pub peers: Vec<(String, bool)>,
}

/// One readiness check: a route under `/readyz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// `/readyz`.
    Serving,
    /// `/readyz/engines`.
    Engines,
    /// `/readyz/peers`.
    Peers,
}

impl Check {
    /// The check a path names.
    pub fn of_path(path: &str) -> Option<Self> {
        match path {
            "/readyz" => Some(Self::Serving),
            "/readyz/engines" => Some(Self::Engines),
            "/readyz/peers" => Some(Self::Peers),
            _ => None,
        }
    }
}

impl Readiness {
    /// Whether `check` passes: every check needs the listeners; the others add their state.
    pub fn passes(&self, check: Check) -> bool {
        self.listening
            && match check {
                Check::Serving => true,
                Check::Engines => self.engines_attached > 0,
                Check::Peers => self.peers.iter().all(|(_, up)| *up),
            }
    }

    /// The body: `ready` or `not ready`, then one line per state.
    pub fn render(&self, check: Check) -> String {
        let mut out = String::from(if self.passes(check) { "ready\n" } else { "not ready\n" });
        out += &format!("listeners: {}\n", if self.listening { "serving" } else { "not serving" });
        out +=
            &format!("engines: {} registered, {} attached\n", self.engines_registered, self.engines_attached);
        let up = self.peers.iter().filter(|(_, up)| *up).count();
        out += &format!("peers: {up} of {} reachable", self.peers.len());
        for (region, reachable) in &self.peers {
            out += &format!("; {region} {}", if *reachable { "reachable" } else { "unreachable" });
        }
        out.push('\n');
        out
    }
}

/// A boxed future, for [`Routes::readiness`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the routes serve.
pub trait Routes: Send + Sync + 'static {
    fn metrics(&self) -> String;
    /// The state the readiness checks see; `dial_peers`: try to reach each peer that is not
    /// connected (for [`Check::Peers`]), else report connections as they are.
    fn readiness(&self, dial_peers: bool) -> BoxFuture<'_, Readiness>;
}

/// Bounds on the HTTP listener (from `[listeners]`).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Connections served at once; one more is closed at once.
    pub max_connections: usize,
    /// The request must arrive within this, and the response be written within it again.
    pub timeout: Duration,
}

/// Serves until the listener fails: one request per connection, at most
/// `bounds.max_connections` connections at once, each bounded in time.
pub async fn serve(listener: TcpListener, routes: Arc<dyn Routes>, bounds: Bounds) {
    let slots = Arc::new(tokio::sync::Semaphore::new(bounds.max_connections));
    loop {
        let Ok((mut sock, _)) = listener.accept().await else { return };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(
                max = bounds.max_connections,
                "HTTP connection refused (listeners.max_connections)"
            );
            continue;
        };
        let routes = routes.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut buf = [0u8; 2048];
            let n = match tokio::time::timeout(bounds.timeout, sock.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("/");
            let (status, ctype, body) = match (path, Check::of_path(path)) {
                ("/metrics", _) => ("200 OK", "text/plain; version=0.0.4", routes.metrics()),
                ("/healthz", _) => ("200 OK", "text/plain", "ok\n".to_owned()),
                (_, Some(check)) => {
                    let r = routes.readiness(check == Check::Peers).await;
                    let status = if r.passes(check) { "200 OK" } else { "503 Service Unavailable" };
                    (status, "text/plain", r.render(check))
                }
                _ => ("404 Not Found", "text/plain", "not found\n".to_owned()),
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = tokio::time::timeout(bounds.timeout, sock.write_all(resp.as_bytes())).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_check_needs_the_listeners_and_its_own_state() {
        let all = [Check::Serving, Check::Engines, Check::Peers];
        let up = Readiness {
            listening: true,
            engines_registered: 2,
            engines_attached: 1,
            peers: vec![("b".into(), true), ("c".into(), true)],
        };
        assert!(all.iter().all(|&c| up.passes(c)));
        let down = Readiness { listening: false, ..up.clone() };
        assert!(all.iter().all(|&c| !down.passes(c)));
        let detached = Readiness { engines_attached: 0, ..up.clone() };
        assert_eq!(all.map(|c| detached.passes(c)), [true, false, true]);
        let one_peer_down = Readiness { peers: vec![("b".into(), true), ("c".into(), false)], ..up.clone() };
        assert_eq!(all.map(|c| one_peer_down.passes(c)), [true, true, false]);
        assert_eq!(
            one_peer_down.render(Check::Peers),
            "not ready\nlisteners: serving\nengines: 2 registered, 1 attached\npeers: 1 of 2 reachable; b reachable; c unreachable\n"
        );
        // No peers configured: nothing to be unreachable.
        assert!(Readiness { peers: vec![], ..up }.passes(Check::Peers));
        assert_eq!(Check::of_path("/readyz/other"), None);
    }
}
