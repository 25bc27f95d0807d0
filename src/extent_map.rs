//! Extent maps (seed 2): a file's extents in memory, ordered by file offset.
//!
//! Dropping a range `[start, end)` does one search (which yields the predecessor at
//! every level), trims the extent that reaches into the range from the left, then
//! walks the successors: each one wholly inside goes in O(1), and the last one, which
//! may stick out past `end`, keeps its tail in place. At most two split records are
//! needed (the first and the last extent); their room is reserved before the loop.
//! So a drop covering k of n extents costs O(log n + k).

use crate::skiplist::{Linked, Links, Preds, SkipList};

/// Where one extent of a file lives: `len` bytes at `offset` into the disk extent
/// `[disk_bytenr, disk_bytenr + disk_len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// Start of the disk extent (its refcount key).
    pub disk_bytenr: u64,
    /// Length of the disk extent.
    pub disk_len: u64,
    /// Where this file extent starts inside the disk extent.
    pub offset: u64,
    /// Bytes of the file this extent maps.
    pub len: u64,
    /// Allocated by fallocate and not written (reads as zeros).
    pub prealloc: bool,
    /// The transaction that wrote the extent.
    pub generation: u64,
}

impl Mapping {
    /// The same mapping without its first `n` bytes.
    fn skip(self, n: u64) -> Mapping {
        Mapping {
            offset: self.offset + n,
            len: self.len - n,
            ..self
        }
    }
}

#[derive(Debug, Clone)]
struct Node {
    start: u64,
    links: Links,
    map: Mapping,
}

impl Linked for Node {
    fn key(&self) -> u64 {
        self.start
    }
    fn set_key(&mut self, key: u64) {
        self.start = key;
    }
    fn links(&self) -> &Links {
        &self.links
    }
    fn links_mut(&mut self) -> &mut Links {
        &mut self.links
    }
}

/// One file's extents, non-overlapping, by file offset.
#[derive(Debug, Clone, Default)]
pub struct ExtentMap {
    list: SkipList<Node>,
}

impl ExtentMap {
    /// Number of extents.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether the file has no extents.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The extent holding byte `off`, as (file offset, mapping).
    pub fn lookup(&self, off: u64) -> Option<(u64, Mapping)> {
        let n = self.list.node(self.list.floor(off)?);
        (n.start + n.map.len > off).then_some((n.start, n.map))
    }

    /// The extents overlapping `[start, end)`, in order.
    pub fn range(&self, start: u64, end: u64) -> Vec<(u64, Mapping)> {
        self.overlapping(&self.list.search(start), start, end)
    }

    /// The extents overlapping `[start, end)`, in order, from a search for `start`.
    fn overlapping(&self, p: &Preds, start: u64, end: u64) -> Vec<(u64, Mapping)> {
        let mut out = Vec::new();
        if let Some(prev) = p.prev() {
            let n = self.list.node(prev);
            if n.start + n.map.len > start {
                out.push((n.start, n.map));
            }
        }
        let mut at = self.list.after(p);
        while let Some(i) = at {
            let n = self.list.node(i);
            if n.start >= end {
                break;
            }
            out.push((n.start, n.map));
            at = self.list.next(i);
        }
        out
    }

    /// Every extent, in order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, Mapping)> + '_ {
        self.list.iter().map(|n| (n.start, n.map))
    }

    /// Unmaps `[start, end)`; returns the extents removed whole.
    pub fn drop_range(&mut self, start: u64, end: u64) -> usize {
        if start >= end {
            return 0;
        }
        let mut p = self.list.search(start);
        self.drop_after(&mut p, start, end)
    }

    /// Maps `[start, start + map.len)` to `map`, replacing what was there: one search.
    pub fn replace(&mut self, start: u64, map: Mapping) {
        let mut p = self.list.search(start);
        self.drop_after(&mut p, start, start + map.len);
        self.put_at(&mut p, start, map);
    }

    /// Inserts `map` at `start` right after `p`, where a drop of its range left off.
    fn put_at(&mut self, p: &mut Preds, start: u64, map: Mapping) {
        let node = Node {
            start,
            links: Links::default(),
            map,
        };
        self.list.insert_at(p, node);
    }

    /// [`ExtentMap::replace`] that returns what [`ExtentMap::range`] gave before for
    /// the range it maps: the extents that overlapped it, whole. Still one search.
    pub fn replace_taking(&mut self, start: u64, map: Mapping) -> Vec<(u64, Mapping)> {
        let end = start + map.len;
        let mut p = self.list.search(start);
        let old = self.overlapping(&p, start, end);
        self.drop_after(&mut p, start, end);
        self.put_at(&mut p, start, map);
        old
    }

    fn drop_after(&mut self, p: &mut Preds, start: u64, end: u64) -> usize {
        // The two split records a drop may need, and the record `replace` adds.
        self.list.reserve(3);
        if let Some(prev) = p.prev() {
            let n = self.list.node(prev);
            let (ps, pm) = (n.start, n.map);
            if ps + pm.len > start {
                self.list.node_mut(prev).map.len = start - ps;
                if ps + pm.len > end {
                    // The range is inside one extent: its right part follows the range.
                    let mut q = *p;
                    self.list.insert_at(
                        &mut q,
                        Node {
                            start: end,
                            links: Links::default(),
                            map: pm.skip(end - ps),
                        },
                    );
                    return 0;
                }
            }
        }
        let mut removed = 0;
        while let Some(i) = self.list.after(p) {
            let n = self.list.node(i);
            let (s, m) = (n.start, n.map);
            if s >= end {
                break;
            }
            if s + m.len > end {
                // Sticks out past the range: keep its tail, where it is.
                self.list.rekey_after(p, end);
                self.list.node_mut(i).map = m.skip(end - s);
                break;
            }
            self.list.remove_after(p);
            removed += 1;
        }
        removed
    }
}

/// The extent maps of the files used lately, kept within a bound on records: the
/// map of a file is loaded from the tree on first use and then changed alongside it.
#[derive(Debug, Default)]
pub(crate) struct MapCache {
    maps: rustc_hash::FxHashMap<u64, (ExtentMap, u64)>,
    /// Files with too many extents to keep; served from the tree.
    too_big: rustc_hash::FxHashSet<u64>,
    total: usize,
    tick: u64,
}

impl MapCache {
    /// Most records kept in all maps together (about 100 bytes each).
    const LIMIT: usize = 1 << 18;

    /// The map of `ino`, if it is kept.
    pub(crate) fn get(&mut self, ino: u64) -> Option<&ExtentMap> {
        self.tick += 1;
        let t = self.tick;
        self.maps.get_mut(&ino).map(|e| {
            e.1 = t;
            &e.0
        })
    }

    /// Whether `ino`'s map is too large to keep.
    pub(crate) fn is_too_big(&self, ino: u64) -> bool {
        self.too_big.contains(&ino)
    }

    /// Keeps `map` as the map of `ino`, making room by dropping the least recently
    /// used maps; a map larger than a quarter of the bound is not kept.
    pub(crate) fn put(&mut self, ino: u64, map: ExtentMap) {
        self.forget(ino);
        if map.len() > Self::LIMIT / 4 {
            self.too_big.insert(ino);
            return;
        }
        while self.total + map.len() > Self::LIMIT {
            let Some((&old, _)) = self.maps.iter().min_by_key(|(_, e)| e.1) else {
                break;
            };
            self.forget(old);
        }
        self.tick += 1;
        self.total += map.len();
        self.maps.insert(ino, (map, self.tick));
    }

    /// Changes the map of `ino` (if kept) as its extents changed in the tree.
    pub(crate) fn update(&mut self, ino: u64, f: impl FnOnce(&mut ExtentMap)) {
        self.update_with(ino, f);
    }

    /// [`MapCache::update`] with what `f` returns; `None` when the map is not kept.
    pub(crate) fn update_with<R>(
        &mut self,
        ino: u64,
        f: impl FnOnce(&mut ExtentMap) -> R,
    ) -> Option<R> {
        let (m, _) = self.maps.get_mut(&ino)?;
        let before = m.len();
        let r = f(m);
        self.total = self.total - before + m.len();
        Some(r)
    }

    /// Drops the map of `ino` (the tree is the truth; it is loaded again when used).
    pub(crate) fn forget(&mut self, ino: u64) {
        if let Some((m, _)) = self.maps.remove(&ino) {
            self.total -= m.len();
        }
        self.too_big.remove(&ino);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    const BS: u64 = 4096;

    fn m(disk: u64, len: u64) -> Mapping {
        Mapping {
            disk_bytenr: disk,
            disk_len: len,
            offset: 0,
            len,
            prealloc: false,
            generation: 1,
        }
    }

    /// The disk address of every mapped block.
    fn blocks(map: &ExtentMap) -> BTreeMap<u64, u64> {
        let mut out = BTreeMap::new();
        for (s, mp) in map.iter() {
            for b in 0..mp.len / BS {
                out.insert(s / BS + b, mp.disk_bytenr + mp.offset + b * BS);
            }
        }
        out
    }

    #[test]
    fn seed_two_example_needs_two_splits() {
        // [1M, 3M) [3M, 6M) [6M, 10M); drop [2M, 8M).
        const M: u64 = 1 << 20;
        let mut map = ExtentMap::default();
        map.replace(M, m(100 * M, 2 * M));
        map.replace(3 * M, m(200 * M, 3 * M));
        map.replace(6 * M, m(300 * M, 4 * M));
        assert_eq!(map.drop_range(2 * M, 8 * M), 1);
        let got: Vec<(u64, u64, u64)> = map.iter().map(|(s, x)| (s, x.len, x.offset)).collect();
        assert_eq!(got, vec![(M, M, 0), (8 * M, 2 * M, 2 * M)]);
        assert_eq!(map.lookup(8 * M).unwrap().1.disk_bytenr, 300 * M);
        assert_eq!(map.lookup(2 * M), None);
        // A drop inside one extent keeps both sides.
        map.drop_range(9 * M, 9 * M + BS);
        let got: Vec<(u64, u64)> = map.iter().map(|(s, x)| (s, x.len)).collect();
        assert_eq!(got, vec![(M, M), (8 * M, M), (9 * M + BS, M - BS)]);
    }

    #[test]
    fn matches_a_per_block_model() {
        let mut map = ExtentMap::default();
        let mut model: BTreeMap<u64, u64> = BTreeMap::new();
        let mut x = 99u64;
        let mut disk = 1u64 << 30;
        for round in 0..5000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let start = (x >> 40) % 512;
            let len = 1 + (x >> 20) % 40;
            if round % 3 == 0 {
                map.drop_range(start * BS, (start + len) * BS);
                for b in start..start + len {
                    model.remove(&b);
                }
            } else {
                if round % 3 == 1 {
                    map.replace(start * BS, m(disk, len * BS));
                } else {
                    let before = map.range(start * BS, (start + len) * BS);
                    let taken = map.replace_taking(start * BS, m(disk, len * BS));
                    assert_eq!(taken, before, "round {round}: what replace_taking took");
                }
                for b in 0..len {
                    model.insert(start + b, disk + b * BS);
                }
                disk += len * BS;
            }
            assert_eq!(blocks(&map), model, "round {round}");
            let probe = ((x >> 8) % 600) * BS + 17;
            let want = model.get(&(probe / BS)).copied();
            let got = map
                .lookup(probe)
                .map(|(s, mp)| mp.disk_bytenr + mp.offset + (probe - s) / BS * BS);
            assert_eq!(got, want);
            let r = map.range(start * BS, (start + len) * BS);
            for w in r.windows(2) {
                assert!(w[0].0 + w[0].1.len <= w[1].0, "ordered, no overlap");
            }
        }
    }
}
