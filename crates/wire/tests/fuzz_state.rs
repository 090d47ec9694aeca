//! Fuzz target for the transfer state machine (`state::Machine`).
//!
//! Arbitrary event sequences: every accepted event follows exactly one row of `TRANSITIONS`,
//! every refused one has no row and leaves the state unchanged, and a terminal state
//! (`Committed`, `Aborted`) is never left. Runs bounded under `cargo test`; with a real engine:
//!
//! ```text
//! cargo +nightly bolero test -p kvferry-wire --test fuzz_state arbitrary_events_follow_the_table \
//!     --engine libfuzzer
//! ```

use std::time::Duration;

use bolero::check;
use kvferry_wire::state::{Event, IllegalTransition, Machine, State, TRANSITIONS};

const ITERATIONS: usize = 100_000;
const TIME: Duration = Duration::from_secs(2);

fn terminal(s: State) -> bool {
    matches!(s, State::Committed | State::Aborted)
}

#[test]
fn arbitrary_events_follow_the_table() {
    // Each byte picks an event of `Event::ALL`.
    check!().with_type::<Vec<u8>>().with_iterations(ITERATIONS).with_test_time(TIME).for_each(|events| {
        let mut m = Machine::default();
        assert_eq!(m.state(), State::Requested);
        for &b in events {
            let event = Event::ALL[b as usize % Event::ALL.len()];
            let from = m.state();
            let rows: Vec<_> = TRANSITIONS.iter().filter(|(f, e, _)| *f == from && *e == event).collect();
            assert!(rows.len() <= 1, "the table is not a function at {from:?} {event:?}");
            match m.apply(event) {
                Ok(to) => {
                    assert_eq!(rows, [&(from, event, to)], "{from:?} --{event:?}--> {to:?} is not a row");
                    assert_eq!(m.state(), to);
                    assert!(!terminal(from), "left terminal state {from:?}");
                    if to == State::Committed {
                        assert_eq!((from, event), (State::Verifying, Event::DigestOk));
                    }
                }
                Err(e) => {
                    assert_eq!(e, IllegalTransition { from, event });
                    assert!(rows.is_empty(), "{from:?} {event:?} refused despite a row");
                    assert_eq!(m.state(), from, "a refused event changed the state");
                }
            }
            assert_eq!(m.is_terminal(), terminal(m.state()));
        }
    });
}
