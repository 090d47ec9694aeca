//! TODO(bench): being written.
