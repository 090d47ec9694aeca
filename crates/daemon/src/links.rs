//! Per-peer link state: the configured expectation until measured, then the live estimator
//! (RTT from the connection and queries, goodput from completed fetches and probes, and the
//! prediction error of past migrations). The decision reads [`LinkTable::figures`], never
//! constants, once samples exist.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use kvferry_wire::estimator::{EstimatorConfig, LinkEstimator};

use crate::config::Peer;
use kvferry_pool::sync::LockExt;

/// Live figures for one peer, as the decision uses them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    pub rtt_s: f64,
    pub goodput_bps: f64,
    pub age_s: f64,
    pub confidence: f64,
    pub samples: u64,
    pub prediction_error: f64,
    /// Whether the goodput is measured (false: the configured expectation).
    pub measured: bool,
    /// Transfers in flight to/from this peer right now.
    pub active: u32,
}

struct PeerLink {
    cfg: Peer,
    est: Mutex<LinkEstimator>,
    active: AtomicU32,
}

/// All peers' links.
pub struct LinkTable {
    t0: Instant,
    peers: HashMap<String, PeerLink>,
}

impl std::fmt::Debug for LinkTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkTable").field("peers", &self.peers.len()).finish()
    }
}

impl LinkTable {
    /// One entry per configured peer.
    pub fn new(peers: &[Peer]) -> Self {
        let peers = peers
            .iter()
            .map(|p| {
                let link = PeerLink {
                    cfg: p.clone(),
                    est: Mutex::new(LinkEstimator::new(EstimatorConfig::default())),
                    active: AtomicU32::new(0),
                };
                (p.region.clone(), link)
            })
            .collect();
        Self { t0: Instant::now(), peers }
    }

    fn now_ns(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    /// The configured peer.
    pub fn peer(&self, region: &str) -> Option<&Peer> {
        self.peers.get(region).map(|p| &p.cfg)
    }

    /// Configured regions, sorted.
    pub fn regions(&self) -> Vec<String> {
        let mut v: Vec<String> = self.peers.keys().cloned().collect();
        v.sort();
        v
    }

    /// Records an RTT sample.
    pub fn record_rtt(&self, region: &str, rtt_s: f64) {
        let now = self.now_ns();
        if let Some(p) = self.peers.get(region) {
            let _ = p.est.locked().record_rtt(now, rtt_s);
        }
    }

    /// Records a completed transfer's goodput.
    pub fn record_goodput(&self, region: &str, bytes: u64, seconds: f64) {
        let now = self.now_ns();
        if let Some(p) = self.peers.get(region) {
            let _ = p.est.locked().record_goodput(now, bytes, seconds);
        }
    }

    /// Records a migration's predicted vs measured seconds.
    pub fn record_prediction(&self, region: &str, predicted_s: f64, measured_s: f64) {
        if let Some(p) = self.peers.get(region) {
            let _ = p.est.locked().record_prediction(predicted_s, measured_s);
        }
    }

    /// Marks a transfer in flight until the guard drops.
    pub fn begin(&self, region: &str) -> Option<ActiveGuard<'_>> {
        let p = self.peers.get(region)?;
        p.active.fetch_add(1, Ordering::Relaxed);
        Some(ActiveGuard(&p.active))
    }

    /// The figures a decision uses now.
    pub fn figures(&self, region: &str) -> Option<Figures> {
        let p = self.peers.get(region)?;
        let est = p.est.locked().estimate(self.now_ns());
        let measured = est.goodput_bps.is_some();
        Some(Figures {
            rtt_s: est.rtt_s.unwrap_or(p.cfg.rtt_ms / 1000.0),
            goodput_bps: est.goodput_bps.unwrap_or(p.cfg.gbps * 1e9),
            age_s: if measured { est.age_s } else { f64::INFINITY },
            confidence: est.confidence,
            samples: est.samples,
            prediction_error: est.prediction_error.unwrap_or(0.0),
            measured,
            active: p.active.load(Ordering::Relaxed),
        })
    }

    /// Whether the estimator asks for an active probe.
    pub fn needs_probe(&self, region: &str) -> bool {
        let now = self.now_ns();
        self.peers.get(region).is_some_and(|p| p.est.locked().needs_probe(now))
    }
}

/// Decrements the in-flight count on drop.
#[derive(Debug)]
pub struct ActiveGuard<'a>(&'a AtomicU32);

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
