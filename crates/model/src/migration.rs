//! What a migration does, as the daemon carries it out: the model's three actions plus
//! *already local* (nothing to move). Pure data; the daemon matches on it exhaustively, so a new
//! action is a compile error wherever it must be handled.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::decision::Action;

/// The action a migration executes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationAction {
    /// The prefix is already ready in this region; nothing moves.
    AlreadyLocal,
    /// Fetch blocks from the source region.
    Fetch,
    /// Recompute the prefix at the target.
    Recompute,
    /// Recompute `[0, k)` while fetching the rest.
    Split,
}

impl MigrationAction {
    /// Every action, in the order the API documents them.
    pub const ALL: [Self; 4] = [Self::Fetch, Self::Recompute, Self::Split, Self::AlreadyLocal];

    /// The action's name on the wire and in logs (`already_local`, `fetch`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AlreadyLocal => "already_local",
            Self::Fetch => "fetch",
            Self::Recompute => "recompute",
            Self::Split => "split",
        }
    }
}

impl From<Action> for MigrationAction {
    fn from(a: Action) -> Self {
        match a {
            Action::Fetch => Self::Fetch,
            Action::Recompute => Self::Recompute,
            Action::Split => Self::Split,
        }
    }
}

impl fmt::Display for MigrationAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_the_model_and_serde() {
        for a in [Action::Fetch, Action::Recompute, Action::Split] {
            assert_eq!(MigrationAction::from(a).as_str(), a.to_string());
        }
        for a in MigrationAction::ALL {
            assert_eq!(serde_json::to_string(&a).unwrap(), format!("\"{a}\""));
        }
    }
}
