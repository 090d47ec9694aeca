//! The engine-wide prefix cache: content key (chained block hash, tenant-salted) → physical
//! block id, with a reference count per cached block (requests using it now) and an LRU over
//! the unreferenced ones, which are the only eviction candidates. Blocks computed by a request
//! or loaded from the daemon join it when the request ends; a second request with the same
//! prefix then reuses those blocks instead of computing or loading them.
//!
//! Each entry remembers its tenant, so the whole cache can be published again
//! ([`PrefixCache::held`]) to a daemon that restarted and lost its index.
//!
//! Pure bookkeeping over ids: it never touches pool bytes and never owns the free list (the
//! core's allocator does). A block id is in exactly one of three places: free (core
//! allocator), owned by one running request, or here.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use kvferry_layout::BlockHash;

#[derive(Debug, Clone)]
struct Entry {
    hash: BlockHash,
    tenant: Arc<str>,
    refs: u32,
    tick: u64,
}

/// One tenant's cached blocks: the tenant and its (hash, block id) pairs.
pub type TenantBlocks = (Arc<str>, Vec<(BlockHash, u32)>);

/// Hash → block, refcounts and LRU. See the module doc.
#[derive(Debug, Default)]
pub struct PrefixCache {
    by_hash: HashMap<BlockHash, u32>,
    entries: HashMap<u32, Entry>,
    /// `(tick, block)` of entries with `refs == 0`; the smallest tick is evicted first.
    lru: BTreeSet<(u64, u32)>,
    tick: u64,
}

impl PrefixCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Cached blocks no request uses (what eviction can free).
    pub fn evictable(&self) -> usize {
        self.lru.len()
    }

    /// The block holding `hash`, if cached.
    pub fn block_of(&self, hash: &BlockHash) -> Option<u32> {
        self.by_hash.get(hash).copied()
    }

    /// References on a cached block (`None`: not cached).
    pub fn refs(&self, block: u32) -> Option<u32> {
        self.entries.get(&block).map(|e| e.refs)
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// The longest prefix of `hashes` that is cached; takes one reference on each block and
    /// returns their ids in prefix order.
    pub fn acquire_prefix(&mut self, hashes: &[BlockHash]) -> Vec<u32> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&b) = self.by_hash.get(h) else { break };
            let e = self.entries.get_mut(&b).expect("by_hash and entries agree");
            if e.refs == 0 {
                self.lru.remove(&(e.tick, b));
            }
            e.refs += 1;
            out.push(b);
        }
        out
    }

    /// Drops one reference on a cached block; at zero it becomes the most recently used
    /// evictable block. Returns false (and changes nothing) for a block that is not cached or
    /// not referenced.
    pub fn release(&mut self, block: u32) -> bool {
        let tick = self.next_tick();
        let Some(e) = self.entries.get_mut(&block) else { return false };
        if e.refs == 0 {
            return false;
        }
        e.refs -= 1;
        if e.refs == 0 {
            e.tick = tick;
            self.lru.insert((tick, block));
        }
        true
    }

    /// Offers `block` (which holds `tenant`'s K/V keyed by `hash` and is owned by the caller)
    /// to the cache, unreferenced and most recently used. Returns false when `hash` is already
    /// cached in another block: the caller keeps `block` (and should free it).
    pub fn insert(&mut self, tenant: &str, hash: BlockHash, block: u32) -> bool {
        if self.by_hash.contains_key(&hash) || self.entries.contains_key(&block) {
            return false;
        }
        let tick = self.next_tick();
        self.by_hash.insert(hash, block);
        self.entries.insert(block, Entry { hash, tenant: Arc::from(tenant), refs: 0, tick });
        self.lru.insert((tick, block));
        true
    }

    /// Every cached block, grouped by tenant (tenants in name order, blocks by id): what a
    /// re-attached engine publishes again.
    pub fn held(&self) -> Vec<TenantBlocks> {
        let mut by: std::collections::BTreeMap<Arc<str>, Vec<(BlockHash, u32)>> = Default::default();
        for (&b, e) in &self.entries {
            by.entry(e.tenant.clone()).or_default().push((e.hash, b));
        }
        by.into_iter()
            .map(|(t, mut v)| {
                v.sort_by_key(|&(_, b)| b);
                (t, v)
            })
            .collect()
    }

    fn remove(&mut self, block: u32) -> Option<(u32, BlockHash)> {
        let e = self.entries.remove(&block)?;
        self.lru.remove(&(e.tick, block));
        self.by_hash.remove(&e.hash);
        Some((block, e.hash))
    }

    /// Evicts up to `n` unreferenced blocks, least recently used first; returns them (the
    /// caller frees the ids and reports the hashes removed).
    pub fn evict_lru(&mut self, n: usize) -> Vec<(u32, BlockHash)> {
        let victims: Vec<u32> = self.lru.iter().take(n).map(|&(_, b)| b).collect();
        victims.into_iter().filter_map(|b| self.remove(b)).collect()
    }

    /// Evicts the listed hashes where cached and unreferenced (an eviction hint); returns
    /// what was evicted.
    pub fn evict_hashes(&mut self, hashes: &[BlockHash]) -> Vec<(u32, BlockHash)> {
        let victims: Vec<u32> = hashes
            .iter()
            .filter_map(|h| self.by_hash.get(h).copied())
            .filter(|b| self.entries.get(b).is_some_and(|e| e.refs == 0))
            .collect();
        victims.into_iter().filter_map(|b| self.remove(b)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        [i; 32]
    }

    #[test]
    fn prefix_hits_stop_at_the_first_miss_and_take_references() {
        let mut c = PrefixCache::new();
        assert!(c.insert("t", h(1), 10));
        assert!(c.insert("t", h(2), 11));
        assert!(c.insert("t", h(4), 13));
        assert_eq!(c.acquire_prefix(&[h(1), h(2), h(3), h(4)]), vec![10, 11]);
        assert_eq!(c.refs(10), Some(1));
        assert_eq!(c.evictable(), 1);
        // Referenced blocks are never evicted.
        assert_eq!(c.evict_lru(5), vec![(13, h(4))]);
        assert_eq!(c.evict_hashes(&[h(1)]), vec![]);
        assert!(c.release(11));
        assert!(c.release(10));
        assert!(!c.release(10), "no reference left");
        assert!(!c.release(99), "not cached");
        assert_eq!(c.evictable(), 2);
    }

    #[test]
    fn lru_order_follows_release_order_and_duplicates_are_refused() {
        let mut c = PrefixCache::new();
        for (i, b) in [(1, 1), (2, 2), (3, 3)] {
            assert!(c.insert("t", h(i), b));
        }
        assert!(!c.insert("t", h(2), 7), "hash already cached elsewhere");
        assert!(!c.insert("t", h(9), 3), "block already cached");
        // Use 1 again: it becomes the most recent.
        assert_eq!(c.acquire_prefix(&[h(1)]), vec![1]);
        c.release(1);
        assert_eq!(c.evict_lru(1), vec![(2, h(2))]);
        assert_eq!(c.evict_lru(1), vec![(3, h(3))]);
        assert_eq!(c.block_of(&h(1)), Some(1));
        assert_eq!(c.evict_hashes(&[h(1), h(5)]), vec![(1, h(1))]);
        assert!(c.is_empty());
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn held_lists_every_cached_block_by_tenant_referenced_or_not() {
        let mut c = PrefixCache::new();
        assert!(c.insert("b", h(1), 7));
        assert!(c.insert("a", h(2), 9));
        assert!(c.insert("a", h(3), 4));
        assert_eq!(c.acquire_prefix(&[h(2)]), vec![9]);
        let held: Vec<(String, Vec<(BlockHash, u32)>)> =
            c.held().into_iter().map(|(t, v)| (t.to_string(), v)).collect();
        assert_eq!(
            held,
            vec![("a".to_owned(), vec![(h(3), 4), (h(2), 9)]), ("b".to_owned(), vec![(h(1), 7)])]
        );
        c.evict_lru(1);
        assert_eq!(c.held().iter().map(|(_, v)| v.len()).sum::<usize>(), 2);
        assert!(PrefixCache::new().held().is_empty());
    }
}
