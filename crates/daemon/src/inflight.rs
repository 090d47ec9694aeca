//! Single-flight fetches: a fetch for blocks that another migration is already fetching from
//! the same source, for the same tenant and layout fingerprint, joins that fetch instead of
//! moving the bytes across the WAN again.
//!
//! The rule is [`can_join`] (pure): same source, same tenant, same fingerprint, and every
//! wanted block is among the in-flight fetch's blocks. Blocks land per block (keyed by tenant
//! and hash), so once the in-flight fetch committed, every block it carried is visible to every
//! migration of that tenant, whichever range it asked for.
//!
//! The table ([`Flights`]) only coordinates; it moves no byte. The first migration to want a
//! range *leads* it ([`Entered::Lead`]): it runs the fetch itself and publishes the outcome
//! with [`Lead::finish`] after the commit, so a joiner told `Ok` finds the blocks landed.
//! Joiners ([`Entered::Join`]) wait for that outcome (bounded by their own deadline, by the
//! caller) and get the same verified result or the same typed error. A leader dropped before
//! it finished (a hedge cancelling its fetch) publishes nothing: its joiners see
//! [`Outcome::Abandoned`] and enter again (one of them leads a new fetch). Nothing here decides
//! validity: a joiner succeeds only on the leader's `Ok`, which the leader returns only after
//! every byte was verified and committed.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use kvferry_layout::BlockHash;
use kvferry_peer::FetchReceipt;
use kvferry_pool::sync::LockExt;
use tokio::sync::watch;

use crate::error::DaemonError;

/// What one fetch moves: from whom, for which tenant, in which layout, which blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlightKey {
    /// The source region.
    pub source: String,
    /// The tenant the blocks belong to.
    pub tenant: String,
    /// The layout fingerprint digest.
    pub fingerprint: [u8; 32],
    /// The blocks, in fetch order.
    pub hashes: Vec<BlockHash>,
}

/// Whether a fetch of `want` can be served by the in-flight fetch of `flight`: the same
/// source, tenant and fingerprint, a non-empty want, and every wanted block among the
/// in-flight ones.
pub fn can_join(flight: &FlightKey, want: &FlightKey) -> bool {
    if flight.source != want.source
        || flight.tenant != want.tenant
        || flight.fingerprint != want.fingerprint
        || want.hashes.is_empty()
        || want.hashes.len() > flight.hashes.len()
    {
        return false;
    }
    if want.hashes.len() <= 8 {
        return want.hashes.iter().all(|h| flight.hashes.contains(h));
    }
    let have: HashSet<&BlockHash> = flight.hashes.iter().collect();
    want.hashes.iter().all(|h| have.contains(h))
}

/// Whether a joiner whose leader failed with `e` should lead a fetch of its own rather than
/// take the error: only when the leader ran out of *its* time (a deadline, which may be
/// shorter than the joiner's) and the joiner has time left. Every other error is the same for
/// every migration of those blocks (the source refused or failed, the link broke, the landing
/// zone is full) and is the joiner's answer too.
pub fn lead_again_after(e: &DaemonError, time_left: bool) -> bool {
    time_left && matches!(e, DaemonError::Deadline(_))
}

/// How an in-flight fetch ended, as its joiners see it.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The leader's result: `Ok` only after its blocks were verified and committed.
    Done(Result<FetchReceipt, DaemonError>),
    /// The leader was dropped before it finished (nothing committed): enter again.
    Abandoned,
}

struct Flight {
    key: FlightKey,
    rx: watch::Receiver<Option<Result<FetchReceipt, DaemonError>>>,
}

/// The fetches in flight now. See the module doc.
#[derive(Default)]
pub struct Flights {
    next: AtomicU64,
    by_id: Mutex<HashMap<u64, Flight>>,
}

impl std::fmt::Debug for Flights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flights").field("in_flight", &self.len()).finish()
    }
}

/// The caller leads the fetch: run it, then [`Lead::finish`]. Dropping it unfinished tells
/// the joiners the flight was abandoned.
#[derive(Debug)]
pub struct Lead<'a> {
    flights: &'a Flights,
    id: u64,
    tx: watch::Sender<Option<Result<FetchReceipt, DaemonError>>>,
}

/// Waits for an in-flight fetch led by another migration.
#[derive(Debug)]
pub struct Join {
    rx: watch::Receiver<Option<Result<FetchReceipt, DaemonError>>>,
}

/// What [`Flights::enter`] made of the caller.
#[derive(Debug)]
pub enum Entered<'a> {
    /// No in-flight fetch covers the want: the caller fetches.
    Lead(Lead<'a>),
    /// One does: the caller waits for it.
    Join(Join),
}

impl Flights {
    /// Fetches in flight.
    pub fn len(&self) -> usize {
        self.by_id.locked().len()
    }

    /// True when no fetch is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Joins the first in-flight fetch that covers `want` ([`can_join`]), or registers `want`
    /// as a new flight led by the caller.
    pub fn enter(&self, want: FlightKey) -> Entered<'_> {
        let mut g = self.by_id.locked();
        if let Some(f) = g.values().find(|f| can_join(&f.key, &want)) {
            return Entered::Join(Join { rx: f.rx.clone() });
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = watch::channel(None);
        g.insert(id, Flight { key: want, rx });
        Entered::Lead(Lead { flights: self, id, tx })
    }
}

impl Lead<'_> {
    /// Publishes the fetch's outcome to its joiners (call after the commit) and ends the
    /// flight: a later fetch of the same blocks finds them landed or leads a new one.
    pub fn finish(self, r: &Result<FetchReceipt, DaemonError>) {
        self.flights.by_id.locked().remove(&self.id);
        let _ = self.tx.send(Some(r.clone()));
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        // Finished or not, the flight ends; unfinished, the sender's drop tells the joiners.
        self.flights.by_id.locked().remove(&self.id);
    }
}

impl Join {
    /// The leader's outcome (cancel-safe; bound it with the caller's deadline).
    pub async fn outcome(mut self) -> Outcome {
        match self.rx.wait_for(Option::is_some).await {
            Ok(v) => Outcome::Done(v.clone().expect("waited for Some")),
            Err(_) => Outcome::Abandoned,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        [i; 32]
    }

    fn key(source: &str, tenant: &str, fp: u8, hashes: &[u8]) -> FlightKey {
        FlightKey {
            source: source.into(),
            tenant: tenant.into(),
            fingerprint: [fp; 32],
            hashes: hashes.iter().map(|&i| h(i)).collect(),
        }
    }

    #[test]
    fn a_want_joins_only_a_flight_of_the_same_source_tenant_and_layout_that_covers_it() {
        let f = key("a", "t", 1, &[1, 2, 3, 4]);
        assert!(can_join(&f, &key("a", "t", 1, &[1, 2, 3, 4])), "the same range");
        assert!(can_join(&f, &key("a", "t", 1, &[1, 2])), "a prefix");
        assert!(can_join(&f, &key("a", "t", 1, &[3, 4])), "a tail (blocks land per block)");
        assert!(!can_join(&f, &key("a", "t", 1, &[1, 2, 3, 4, 5])), "more than in flight");
        assert!(!can_join(&f, &key("a", "t", 1, &[1, 9])), "a block not in flight");
        assert!(!can_join(&f, &key("b", "t", 1, &[1, 2])), "another source");
        assert!(!can_join(&f, &key("a", "u", 1, &[1, 2])), "another tenant");
        assert!(!can_join(&f, &key("a", "t", 2, &[1, 2])), "another layout");
        assert!(!can_join(&f, &key("a", "t", 1, &[])), "nothing wanted");
        // Long lists take the set path: same answers.
        let long: Vec<u8> = (0..200).collect();
        let f = key("a", "t", 1, &long);
        assert!(can_join(&f, &key("a", "t", 1, &long[50..120])));
        let mut off = long[..20].to_vec();
        off.push(250);
        assert!(!can_join(&f, &key("a", "t", 1, &off)));
    }

    #[test]
    fn only_a_leaders_deadline_sends_a_joiner_with_time_left_to_fetch_itself() {
        let late = DaemonError::deadline("the fetch did not finish before the deadline");
        assert!(lead_again_after(&late, true));
        assert!(!lead_again_after(&late, false));
        let down = DaemonError::unavailable(crate::error::Origin::Peer, "fetch from a: reset");
        assert!(!lead_again_after(&down, true));
        assert!(!lead_again_after(&DaemonError::exhausted("landing zone full"), true));
    }

    fn receipt(bytes: u64) -> FetchReceipt {
        FetchReceipt {
            blocks: 2,
            bytes,
            wall: std::time::Duration::from_millis(5),
            first_layer: None,
            goodput_bps: 1e9,
            rtt: std::time::Duration::from_millis(1),
            reconnects: 0,
            chunks_refetched: 0,
            link: kvferry_peer::LinkInfo {
                transport: kvferry_peer::Transport::Quic,
                congestion: "cubic".into(),
                channels: 4,
                stripes: 1,
            },
        }
    }

    #[tokio::test]
    async fn joiners_get_the_leaders_result_or_its_error_and_an_abandoned_flight_is_led_again() {
        let fl = Flights::default();
        let Entered::Lead(lead) = fl.enter(key("a", "t", 1, &[1, 2, 3])) else { panic!("first leads") };
        let Entered::Join(j1) = fl.enter(key("a", "t", 1, &[1, 2])) else { panic!("covered: joins") };
        let Entered::Lead(other) = fl.enter(key("a", "u", 1, &[1, 2])) else { panic!("other tenant leads") };
        assert_eq!(fl.len(), 2);
        lead.finish(&Ok(receipt(99)));
        match j1.outcome().await {
            Outcome::Done(Ok(r)) => assert_eq!(r.bytes, 99),
            o => panic!("{o:?}"),
        }
        // The flight ended with its outcome: the next want leads (the blocks are landed now).
        let Entered::Lead(again) = fl.enter(key("a", "t", 1, &[1])) else { panic!("ended flights are gone") };
        // An error reaches every joiner, typed.
        let Entered::Join(j2) = fl.enter(key("a", "u", 1, &[2])) else { panic!("joins") };
        other.finish(&Err(DaemonError::deadline("late")));
        assert!(matches!(j2.outcome().await, Outcome::Done(Err(DaemonError::Deadline(_)))));
        // A leader dropped before it finished: its joiners hear it was abandoned.
        let Entered::Join(j3) = fl.enter(key("a", "t", 1, &[1])) else { panic!("joins") };
        drop(again);
        assert!(matches!(j3.outcome().await, Outcome::Abandoned));
        assert!(fl.is_empty());
    }
}
