//! The per-transfer state machine as a declared transition table.
//!
//! Both ends of a transfer walk `requested → manifest → streaming → verifying → committed`, or
//! end in `aborted`. Every legal move is one row of [`TRANSITIONS`]; anything else is an
//! [`IllegalTransition`] error, never a silent mutation. The requester may fall back to
//! `requested` when a connection is lost (resume).

use thiserror::Error;

/// Where a transfer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Request sent (requester) or received (owner); no manifest yet.
    Requested,
    /// Manifest sent/received; no chunk yet.
    Manifest,
    /// Chunks moving.
    Streaming,
    /// Every chunk verified (requester) or sent (owner); waiting for the digest exchange.
    Verifying,
    /// Digest matched; blocks valid. Terminal.
    Committed,
    /// Failed or cancelled; nothing it touched is valid. Terminal.
    Aborted,
}

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Manifest sent (owner) or received and accepted (requester).
    Manifest,
    /// A chunk was sent or verified.
    Chunk,
    /// All chunks sent (owner) / verified (requester).
    AllChunks,
    /// The digests matched and the peer confirmed.
    DigestOk,
    /// Connection lost; the requester re-requests the missing chunks.
    Reconnect,
    /// Refusal, digest mismatch, deadline, too many retries, cancel.
    Fail,
}

impl Event {
    /// Every event, in declaration order (for tests and fuzzers that pick one).
    pub const ALL: [Event; 6] =
        [Self::Manifest, Self::Chunk, Self::AllChunks, Self::DigestOk, Self::Reconnect, Self::Fail];
}

/// Every legal transition. A row `(from, event, to)`.
pub const TRANSITIONS: &[(State, Event, State)] = &[
    (State::Requested, Event::Manifest, State::Manifest),
    (State::Manifest, Event::Chunk, State::Streaming),
    (State::Manifest, Event::AllChunks, State::Verifying),
    (State::Streaming, Event::Chunk, State::Streaming),
    (State::Streaming, Event::AllChunks, State::Verifying),
    (State::Verifying, Event::Chunk, State::Verifying),
    (State::Verifying, Event::DigestOk, State::Committed),
    (State::Requested, Event::Reconnect, State::Requested),
    (State::Manifest, Event::Reconnect, State::Requested),
    (State::Streaming, Event::Reconnect, State::Requested),
    (State::Verifying, Event::Reconnect, State::Requested),
    (State::Requested, Event::Fail, State::Aborted),
    (State::Manifest, Event::Fail, State::Aborted),
    (State::Streaming, Event::Fail, State::Aborted),
    (State::Verifying, Event::Fail, State::Aborted),
];

/// A move the table does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("illegal transition: {event:?} in state {from:?}")]
pub struct IllegalTransition {
    pub from: State,
    pub event: Event,
}

/// A state that only changes through the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    state: State,
}

impl Default for Machine {
    fn default() -> Self {
        Self { state: State::Requested }
    }
}

impl Machine {
    /// The current state.
    pub fn state(&self) -> State {
        self.state
    }

    /// Applies `event`, or refuses it.
    pub fn apply(&mut self, event: Event) -> Result<State, IllegalTransition> {
        let from = self.state;
        let to = TRANSITIONS
            .iter()
            .find(|(f, e, _)| *f == from && *e == event)
            .map(|(_, _, t)| *t)
            .ok_or(IllegalTransition { from, event })?;
        self.state = to;
        Ok(to)
    }

    /// Whether the transfer has ended.
    pub fn is_terminal(&self) -> bool {
        matches!(self.state, State::Committed | State::Aborted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATES: [State; 6] = [
        State::Requested,
        State::Manifest,
        State::Streaming,
        State::Verifying,
        State::Committed,
        State::Aborted,
    ];

    #[test]
    fn terminal_states_accept_nothing_and_the_table_is_a_function() {
        for s in STATES {
            for e in Event::ALL {
                let rows = TRANSITIONS.iter().filter(|(f, ev, _)| *f == s && *ev == e).count();
                assert!(rows <= 1, "{s:?} {e:?} has {rows} rows");
                let mut m = Machine { state: s };
                let r = m.apply(e);
                if matches!(s, State::Committed | State::Aborted) {
                    assert_eq!(r, Err(IllegalTransition { from: s, event: e }));
                    assert_eq!(m.state(), s, "a refused event must not change the state");
                }
            }
        }
    }

    #[test]
    fn committed_only_through_verifying() {
        for (from, event, to) in TRANSITIONS {
            if *to == State::Committed {
                assert_eq!((*from, *event), (State::Verifying, Event::DigestOk));
            }
        }
        let mut m = Machine::default();
        assert!(m.apply(Event::DigestOk).is_err());
        assert_eq!(m.state(), State::Requested);
    }
}
