//! Extent maps (seed 2): a file's extents in memory, ordered by file offset.
//!
//! The map is a B+tree held in memory: leaves keep up to [`LEAF_CAP`] extents with
//! their file offsets in one sorted array, internal nodes keep up to [`FANOUT`]
//! children with the first offset of each. A search for a random offset of a map
//! of 65,536 extents reads a few cache lines per level over four levels, where a
//! linked structure (a skip list, an rbtree) takes one cache miss per record it
//! passes, about 25 of them.
//!
//! Dropping a range `[start, end)` is one pass: a descent to `start` that goes on over
//! the leaves the range covers (right to left, so that the indexes of the children
//! still to visit do not move): the extent that reaches into the range from the left
//! is trimmed, each one wholly inside is removed (a run of them in a leaf in one
//! move), and the last one, which may stick out past `end`, keeps its tail in place.
//! Only the first and the last extent are cut, and a record is added only when the
//! range falls inside one extent (its right part). So a drop covering
//! k of n extents costs O(log n + k). A leaf that overflows splits; a node that
//! empties goes; nodes are not merged otherwise, so a map thinned by drops keeps its
//! height until its root is left with one child.

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

/// Most extents in a leaf.
pub const LEAF_CAP: usize = 32;
/// Most children of an internal node.
pub const FANOUT: usize = 32;

/// A node of the in-memory tree. An internal node's `keys[i]` is always the first
/// offset under `kids[i]`; no node but the root is empty.
#[derive(Debug, Clone)]
enum Node {
    Leaf {
        starts: Vec<u64>,
        maps: Vec<Mapping>,
    },
    Internal {
        keys: Vec<u64>,
        kids: Vec<Node>,
    },
}

impl Node {
    fn empty_leaf() -> Node {
        Node::Leaf {
            starts: Vec::new(),
            maps: Vec::new(),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Node::Leaf { starts, .. } => starts.is_empty(),
            Node::Internal { kids, .. } => kids.is_empty(),
        }
    }

    fn first_key(&self) -> u64 {
        match self {
            Node::Leaf { starts, .. } => starts[0],
            Node::Internal { keys, .. } => keys[0],
        }
    }
}

/// The right half of an internal node that holds more than [`FANOUT`] children.
fn split_internal(keys: &mut Vec<u64>, kids: &mut Vec<Node>, appended: bool) -> Option<Node> {
    (kids.len() > FANOUT).then(|| {
        let at = split_point(kids.len(), appended);
        Node::Internal {
            keys: keys.split_off(at),
            kids: kids.split_off(at),
        }
    })
}

/// Where a node of `len` records splits: in the middle, or before the last record
/// when records come in order (a map loaded from the tree), so leaves stay full.
fn split_point(len: usize, appended: bool) -> usize {
    if appended {
        len - 1
    } else {
        len / 2
    }
}

/// Room for a leaf's extents: a pass adds at most two before the leaf splits.
const LEAF_ROOM: usize = LEAF_CAP + 2;

/// The right half of a leaf that holds more than [`LEAF_CAP`] extents. Both halves
/// get room for [`LEAF_ROOM`] extents and never grow past it.
fn split_leaf(starts: &mut Vec<u64>, maps: &mut Vec<Mapping>, appended: bool) -> Option<Node> {
    (starts.len() > LEAF_CAP).then(|| {
        let at = split_point(starts.len(), appended);
        let mut rs = Vec::with_capacity(LEAF_ROOM);
        let mut rm = Vec::with_capacity(LEAF_ROOM);
        rs.extend(starts.drain(at..));
        rm.extend(maps.drain(at..));
        starts.shrink_to(LEAF_ROOM);
        maps.shrink_to(LEAF_ROOM);
        Node::Leaf {
            starts: rs,
            maps: rm,
        }
    })
}

/// Index of the child whose subtree holds the greatest offset `<= key` (the first
/// child when there is none).
fn child_for(keys: &[u64], key: u64) -> usize {
    keys.partition_point(|&k| k <= key).saturating_sub(1)
}

/// What one drop pass over the tree is asked to do and gathers.
struct Pass<'a> {
    start: u64,
    end: u64,
    /// An extent to put at `start` once the range is clear.
    put: Option<Mapping>,
    /// Where to copy the extents that overlapped the range, whole.
    taken: Option<&'a mut Vec<(u64, Mapping)>>,
    /// Extents removed whole.
    removed: usize,
    /// Records added (the right part of a cut extent, the put) less records removed.
    grown: isize,
}

impl Pass<'_> {
    /// Applies the drop to the subtree `n`, which the range's start routes to when
    /// `first` is set; returns a right sibling split off `n`.
    fn apply(&mut self, n: &mut Node, first: bool) -> Option<Node> {
        match n {
            Node::Leaf { starts, maps } => self.leaf(starts, maps, first),
            Node::Internal { keys, kids } => {
                let lo = if first {
                    child_for(keys, self.start)
                } else {
                    0
                };
                let hi = child_for(keys, self.end - 1).max(lo);
                let mut appended = false;
                // Right to left, so that a split or a removal leaves the indexes of
                // the children still to visit as they were.
                for i in (lo..=hi).rev() {
                    let split = self.apply(&mut kids[i], first && i == lo);
                    if kids[i].is_empty() {
                        kids.remove(i);
                        keys.remove(i);
                        continue;
                    }
                    keys[i] = kids[i].first_key();
                    if let Some(r) = split {
                        keys.insert(i + 1, r.first_key());
                        kids.insert(i + 1, r);
                        appended = i + 2 == kids.len();
                    }
                }
                split_internal(keys, kids, appended)
            }
        }
    }

    fn leaf(
        &mut self,
        starts: &mut Vec<u64>,
        maps: &mut Vec<Mapping>,
        first: bool,
    ) -> Option<Node> {
        let (start, end) = (self.start, self.end);
        // The first extent at or after `start`; the one before it may reach in.
        let i = if first {
            starts.partition_point(|&s| s < start)
        } else {
            0
        };
        let mut right = None;
        if i > 0 {
            let (ps, pm) = (starts[i - 1], maps[i - 1]);
            if ps + pm.len > start {
                if let Some(t) = self.taken.as_deref_mut() {
                    t.push((ps, pm));
                }
                maps[i - 1].len = start - ps;
                if ps + pm.len > end {
                    // The range is inside one extent: its right part follows it.
                    right = Some((end, pm.skip(end - ps)));
                }
            }
        }
        let mut j = i;
        while j < starts.len() && starts[j] < end {
            let (s, m) = (starts[j], maps[j]);
            if let Some(t) = self.taken.as_deref_mut() {
                t.push((s, m));
            }
            if s + m.len > end {
                // Sticks out past the range: keep its tail, where it is.
                starts[j] = end;
                maps[j] = m.skip(end - s);
                break;
            }
            j += 1;
        }
        self.removed += j - i;
        self.grown -= (j - i) as isize;
        starts.drain(i..j);
        maps.drain(i..j);
        let put = if first { self.put.take() } else { None };
        let mut appended = false;
        for (s, m) in [right, put.map(|m| (start, m))].into_iter().flatten() {
            appended = i == starts.len();
            starts.insert(i, s);
            maps.insert(i, m);
            self.grown += 1;
        }
        split_leaf(starts, maps, appended)
    }
}

/// One file's extents, non-overlapping, by file offset.
#[derive(Debug, Clone)]
pub struct ExtentMap {
    root: Node,
    len: usize,
}

impl Default for ExtentMap {
    fn default() -> Self {
        ExtentMap {
            root: Node::empty_leaf(),
            len: 0,
        }
    }
}

impl ExtentMap {
    /// Number of extents.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the file has no extents.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The extent holding byte `off`, as (file offset, mapping).
    pub fn lookup(&self, off: u64) -> Option<(u64, Mapping)> {
        let mut n = &self.root;
        loop {
            match n {
                Node::Internal { keys, kids } => n = &kids[child_for(keys, off)],
                Node::Leaf { starts, maps } => {
                    let i = starts.partition_point(|&s| s <= off).checked_sub(1)?;
                    let (s, m) = (starts[i], maps[i]);
                    return (s + m.len > off).then_some((s, m));
                }
            }
        }
    }

    /// The extents overlapping `[start, end)`, in order (none for an empty range).
    pub fn range(&self, start: u64, end: u64) -> Vec<(u64, Mapping)> {
        fn rec(n: &Node, start: u64, end: u64, first: bool, out: &mut Vec<(u64, Mapping)>) {
            match n {
                Node::Internal { keys, kids } => {
                    let lo = if first { child_for(keys, start) } else { 0 };
                    let hi = child_for(keys, end - 1).max(lo);
                    for (i, k) in kids.iter().enumerate().take(hi + 1).skip(lo) {
                        rec(k, start, end, first && i == lo, out);
                    }
                }
                Node::Leaf { starts, maps } => {
                    let mut i = if first {
                        starts.partition_point(|&s| s < start)
                    } else {
                        0
                    };
                    if i > 0 && starts[i - 1] + maps[i - 1].len > start {
                        out.push((starts[i - 1], maps[i - 1]));
                    }
                    while i < starts.len() && starts[i] < end {
                        out.push((starts[i], maps[i]));
                        i += 1;
                    }
                }
            }
        }
        let mut out = Vec::new();
        if start < end {
            rec(&self.root, start, end, true, &mut out);
        }
        out
    }

    /// Every extent, in order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, Mapping)> + '_ {
        fn of(n: &Node) -> Box<dyn Iterator<Item = (u64, Mapping)> + '_> {
            match n {
                Node::Leaf { starts, maps } => {
                    Box::new(starts.iter().copied().zip(maps.iter().copied()))
                }
                Node::Internal { kids, .. } => Box::new(kids.iter().flat_map(of)),
            }
        }
        of(&self.root)
    }

    /// Unmaps `[start, end)`; returns the extents removed whole.
    pub fn drop_range(&mut self, start: u64, end: u64) -> usize {
        self.pass(start, end, None, None)
    }

    /// Maps `[start, start + map.len)` to `map`, replacing what was there: one pass.
    /// An empty `map` changes nothing.
    pub fn replace(&mut self, start: u64, map: Mapping) {
        self.pass(start, start + map.len, Some(map), None);
    }

    /// [`ExtentMap::replace`] that returns what [`ExtentMap::range`] gave before for
    /// the range it maps: the extents that overlapped it, whole. Still one pass.
    pub fn replace_taking(&mut self, start: u64, map: Mapping) -> Vec<(u64, Mapping)> {
        let mut taken = Vec::new();
        self.pass(start, start + map.len, Some(map), Some(&mut taken));
        // The pass visits the leaves right to left and each leaf left to right.
        taken.sort_unstable_by_key(|e| e.0);
        taken
    }

    /// Drops `[start, end)` and puts `put` at `start`, in one descent.
    fn pass(
        &mut self,
        start: u64,
        end: u64,
        put: Option<Mapping>,
        taken: Option<&mut Vec<(u64, Mapping)>>,
    ) -> usize {
        if start >= end {
            return 0;
        }
        let mut d = Pass {
            start,
            end,
            put,
            taken,
            removed: 0,
            grown: 0,
        };
        if let Some(right) = d.apply(&mut self.root, true) {
            let left = std::mem::replace(&mut self.root, Node::empty_leaf());
            self.root = Node::Internal {
                keys: vec![left.first_key(), right.first_key()],
                kids: vec![left, right],
            };
        }
        // A root left with one child hands over to it; an empty one becomes a leaf.
        loop {
            match &mut self.root {
                Node::Internal { kids, .. } if kids.len() == 1 => {
                    self.root = kids.pop().expect("one child");
                }
                Node::Internal { kids, .. } if kids.is_empty() => {
                    self.root = Node::empty_leaf();
                }
                _ => break,
            }
        }
        self.len = (self.len as isize + d.grown) as usize;
        d.removed
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
    /// Most records kept in all maps together (60–90 bytes each: 56 bytes in leaves of room for 34, most of it used).
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

    /// Checks the tree's shape and returns (depth, leaves): exact first keys, no
    /// empty node below the root, capacities, leaves at one depth, ordered extents
    /// that do not overlap, and the count.
    fn check_shape(map: &ExtentMap) -> (usize, usize) {
        fn rec(n: &Node, is_root: bool, depth: usize, out: &mut (Option<usize>, usize)) {
            assert!(is_root || !n.is_empty(), "empty node below the root");
            match n {
                Node::Leaf { starts, maps } => {
                    assert_eq!(starts.len(), maps.len());
                    assert!(starts.len() <= LEAF_CAP);
                    if !is_root {
                        assert!(starts.capacity() <= LEAF_ROOM && maps.capacity() <= LEAF_ROOM);
                    }
                    assert_eq!(*out.0.get_or_insert(depth), depth, "leaves at one depth");
                    out.1 += 1;
                }
                Node::Internal { keys, kids } => {
                    assert_eq!(keys.len(), kids.len());
                    assert!(kids.len() <= FANOUT);
                    assert!(!is_root || kids.len() > 1, "a root with one child");
                    for (k, kid) in keys.iter().zip(kids) {
                        assert_eq!(*k, kid.first_key(), "key is the child's first offset");
                        rec(kid, false, depth + 1, out);
                    }
                }
            }
        }
        let mut out = (None, 0);
        rec(&map.root, true, 0, &mut out);
        let all: Vec<_> = map.iter().collect();
        assert_eq!(all.len(), map.len());
        for w in all.windows(2) {
            assert!(w[0].0 + w[0].1.len <= w[1].0, "ordered, no overlap");
        }
        assert!(all.iter().all(|(_, m)| m.len > 0), "no empty extent");
        (out.0.unwrap_or(0), out.1)
    }

    #[test]
    fn a_map_loaded_in_order_fills_its_leaves() {
        let mut map = ExtentMap::default();
        for i in 0..10_000 {
            map.replace(i * BS, m(i * BS, BS));
        }
        let (depth, leaves) = check_shape(&map);
        assert_eq!(leaves, 10_000usize.div_ceil(LEAF_CAP));
        assert_eq!(depth, 2, "313 full leaves under 10 nodes under the root");
        // Dropping all of it leaves one empty leaf.
        assert_eq!(map.drop_range(0, 10_000 * BS), 10_000);
        assert!(map.is_empty());
        assert_eq!(check_shape(&map), (0, 1));
    }

    #[test]
    fn random_overwrites_and_wide_drops_keep_the_tree_whole() {
        // W3's pattern on a file of 8,192 blocks, with drops that span many leaves
        // and internal nodes, against a per-block model.
        const N: u64 = 8192;
        let mut map = ExtentMap::default();
        map.replace(0, m(1 << 40, N * BS));
        let mut model: BTreeMap<u64, u64> = (0..N).map(|b| (b, (1 << 40) + b * BS)).collect();
        let mut x = 7u64;
        let mut disk = 1u64 << 30;
        let mut max_depth = 0;
        for round in 0..60_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let b = (x >> 33) % N;
            if round % 997 == 996 {
                let len = 1 + (x >> 12) % 3000;
                let before = map.range(b * BS, (b + len) * BS);
                let whole = before
                    .iter()
                    .filter(|(s, mp)| *s >= b * BS && s + mp.len <= (b + len) * BS)
                    .count();
                assert_eq!(map.drop_range(b * BS, (b + len) * BS), whole);
                for k in b..b + len {
                    model.remove(&k);
                }
            } else {
                let len = if round % 5 == 0 {
                    1 + (x >> 12) % 64
                } else {
                    1
                };
                let before = map.range(b * BS, (b + len) * BS);
                assert_eq!(map.replace_taking(b * BS, m(disk, len * BS)), before);
                for k in 0..len {
                    model.insert(b + k, disk + k * BS);
                }
                disk += len * BS;
            }
            if round % 1000 == 0 || round % 997 == 996 {
                max_depth = max_depth.max(check_shape(&map).0);
                assert_eq!(blocks(&map), model, "round {round}");
            }
        }
        assert!(max_depth >= 2, "the test reached internal nodes");
        assert_eq!(blocks(&map), model);
        let probe = 4000 * BS + 5;
        let want = model.get(&4000).copied();
        let got = map
            .lookup(probe)
            .map(|(s, mp)| mp.disk_bytenr + mp.offset + (probe - s) / BS * BS);
        assert_eq!(got, want);
        // Truncating everything empties the tree.
        map.drop_range(0, u64::MAX >> 1);
        assert!(map.is_empty() && map.iter().next().is_none());
        check_shape(&map);
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
        // Empty ranges ask for nothing and change nothing.
        assert!(map.range(M + BS, M + BS).is_empty());
        assert_eq!(map.drop_range(M + BS, M), 0);
        assert!(map.replace_taking(M + BS, m(7 * M, 0)).is_empty());
        assert_eq!(map.len(), 3);
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
            check_shape(&map);
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
