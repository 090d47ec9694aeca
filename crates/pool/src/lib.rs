//! The memory-backend boundary. (Skeleton: see crates/pool/TRAIT.md for the agreed contract;
//! the pools issue implements it.)
