//! Reading an image's trees for restore, with stand-ins for damaged nodes.

use std::collections::{BTreeMap, HashSet};

use zerocopy::FromBytes;

use super::namespace::Namespace;
use super::{RestoreOptions, Restored};
use crate::dev::BlockDev;
use crate::error::{Error, Result};
use crate::format::{
    decode_node, kind, objectid, tree, ExtentItem, Key, NodeBody, RootItem, SnapshotItem,
    Superblock, BLOCK_SIZE, EXTENT_FLAG_DATA, EXTENT_FLAG_TREE,
};
use crate::log::LogOp;
use crate::txn::Store;

/// A tree's items, in key order.
type Items = Vec<(Key, Vec<u8>)>;

/// Whether `k` lies in `lo..hi` (no upper bound when `hi` is None).
fn in_range(k: &Key, lo: Key, hi: Option<Key>) -> bool {
    *k >= lo && hi.is_none_or(|h| *k < h)
}

/// A leaf found intact by the device scan.
#[derive(Debug, Clone, Copy)]
struct Leaf {
    addr: u64,
    generation: u64,
    owner: u64,
    first: Key,
    last: Key,
}

/// Reads trees, standing in for damaged nodes.
struct TreeReader<'a> {
    dev: &'a dyn BlockDev,
    sb: Superblock,
    /// Leaves of the whole device, newest first; scanned when first needed.
    leaves: Option<Vec<Leaf>>,
    /// Tree nodes the extent tree counts as allocated, once it is read.
    allocated: Option<HashSet<u64>>,
    /// Data extents (start -> length) the extent tree lists: no tree node lies in one,
    /// so a block there that looks like a leaf is file data, perhaps made to look so.
    data_extents: BTreeMap<u64, u64>,
    /// Generation up to which `allocated` and `data_extents` are complete: the last
    /// commit's for a whole extent tree; for one with stand-ins, the oldest leaf that
    /// stood in (a node written after it may be missing from it).
    known_upto: u64,
    /// Oldest generation of the leaves the stand-ins have taken so far.
    oldest_taken: u64,
    /// Where the device ends: the superblock's size, or less for a truncated image.
    end: u64,
    /// Nodes of the tree being walked: a damaged parent naming one node twice would
    /// otherwise multiply the walk.
    in_tree: HashSet<u64>,
    pub(super) rep: Restored,
}

/// Bytes the device scan reads at a time.
const SCAN_CHUNK: u64 = 8 << 20;

impl TreeReader<'_> {
    fn data_start(&self) -> u64 {
        self.sb.log_start + self.sb.log_len
    }

    /// The node at `addr`, if it is what its parent says it is.
    fn read_node(
        &self,
        addr: u64,
        level: u8,
        owner: u64,
        gen: Option<u64>,
    ) -> std::result::Result<NodeBody, String> {
        let ns = self.sb.node_size as u64;
        if addr % BLOCK_SIZE != 0
            || addr < self.data_start()
            || addr.checked_add(ns).is_none_or(|e| e > self.end)
        {
            return Err(format!("node address {addr:#x} outside the data area"));
        }
        let mut buf = vec![0u8; ns as usize];
        self.dev
            .read_at(&mut buf, addr)
            .map_err(|e| format!("node {addr:#x}: read error {e}"))?;
        let (h, body) = decode_node(&buf, addr, &self.sb.fsid).map_err(|e| e.to_string())?;
        if h.level != level {
            return Err(format!(
                "node {addr:#x}: level {} expected {level}",
                h.level
            ));
        }
        if h.owner != owner {
            return Err(format!("node {addr:#x}: owned by tree {}", h.owner));
        }
        match gen {
            Some(g) if h.generation != g => Err(format!(
                "node {addr:#x}: generation {} but its parent says {g}",
                h.generation
            )),
            _ if h.generation > self.sb.generation => Err(format!(
                "node {addr:#x}: from generation {}, after the last commit",
                h.generation
            )),
            _ => Ok(body),
        }
    }

    /// The items of the tree rooted at `addr`.
    fn tree_items(
        &mut self,
        label: &str,
        owner: u64,
        (addr, level, gen): (u64, u8, Option<u64>),
    ) -> Vec<(Key, Vec<u8>)> {
        let mut out = Vec::new();
        self.in_tree.clear();
        self.walk(label, owner, (addr, level, gen), (Key::MIN, None), &mut out);
        out
    }

    fn walk(
        &mut self,
        label: &str,
        owner: u64,
        (addr, level, gen): (u64, u8, Option<u64>),
        (lo, hi): (Key, Option<Key>),
        out: &mut Vec<(Key, Vec<u8>)>,
    ) {
        if !self.in_tree.insert(addr) {
            self.rep
                .problem(format!("{label}: node {addr:#x} referenced twice; skipped"));
            return;
        }
        match self.read_node(addr, level, owner, gen) {
            Err(why) => {
                self.rep.damaged_nodes += 1;
                let max_gen = gen.unwrap_or(self.sb.generation);
                self.stand_in(label, owner, (lo, hi, Some(level)), max_gen, &why, out);
            }
            Ok(NodeBody::Leaf(items)) => {
                out.extend(items.into_iter().filter(|(k, _)| in_range(k, lo, hi)))
            }
            Ok(NodeBody::Internal(ptrs)) => {
                for (i, &(k, child, cgen)) in ptrs.iter().enumerate() {
                    let chi = match (ptrs.get(i + 1).map(|p| p.0), hi) {
                        (Some(n), Some(h)) => Some(n.min(h)),
                        (n, h) => n.or(h),
                    };
                    let clo = k.max(lo);
                    if level == 0 || chi.is_some_and(|h| h <= clo) {
                        continue;
                    }
                    self.walk(
                        label,
                        owner,
                        (child, level - 1, Some(cgen)),
                        (clo, chi),
                        out,
                    );
                }
            }
        }
    }

    /// Fills the keys `lo..hi` of a damaged node of `owner` (of `level`, when known)
    /// from scanned leaves of generation `max_gen` or older: leaves the extent tree
    /// counts as allocated first, then, for a lost leaf, older copies of its keys.
    fn stand_in(
        &mut self,
        label: &str,
        owner: u64,
        (lo, hi, level): (Key, Option<Key>, Option<u8>),
        max_gen: u64,
        why: &str,
        out: &mut Vec<(Key, Vec<u8>)>,
    ) {
        self.scan_once();
        let known = |l: &Leaf| l.generation <= self.known_upto;
        let in_data = |l: &Leaf| {
            self.data_extents
                .range(..=l.addr)
                .next_back()
                .is_some_and(|(&s, &n)| l.addr < s.saturating_add(n))
        };
        let candidates: Vec<Leaf> = self
            .leaves
            .as_deref()
            .unwrap_or_default()
            .iter()
            .filter(|l| l.owner == owner && l.generation <= max_gen)
            .filter(|l| l.last >= lo && hi.is_none_or(|h| l.first < h))
            .filter(|l| !(known(l) && in_data(l)))
            .copied()
            .collect();
        // A lost leaf was the only one of its tree for its keys: any other leaf holding
        // them (a snapshot's, or one freed since) is an older copy.
        let (live, older): (Vec<Leaf>, Vec<Leaf>) = match &self.allocated {
            _ if level == Some(0) => (Vec::new(), candidates),
            Some(a) => candidates
                .into_iter()
                .partition(|l| a.contains(&l.addr) || !known(l)),
            None => (candidates, Vec::new()),
        };
        // Key ranges taken, first -> last, disjoint.
        let mut taken: BTreeMap<Key, Key> = BTreeMap::new();
        let live = self.take_leaves(owner, (lo, hi), &live, &mut taken, out);
        self.oldest_taken = self.oldest_taken.min(live.1);
        // Older copies only where the parent bounds them: for a lost leaf, not for a
        // lost internal node (whose lost children's ranges are unknown).
        let older = if level == Some(0) {
            self.take_leaves(owner, (lo, hi), &older, &mut taken, out)
        } else {
            (0, 0, 0)
        };
        if older.0 > 0 {
            self.oldest_taken = self.oldest_taken.min(older.1);
        }
        if live.0 == 0 && older.0 == 0 {
            // Nothing stood in: what the node held is unknown, of any generation.
            self.oldest_taken = 0;
        }
        let gens = |(n, a, b): (u64, u64, u64)| match n {
            _ if a == b => format!("{n} leaves of generation {a}"),
            _ => format!("{n} leaves of generations {a} to {b}"),
        };
        let found = match (live.0, older.0) {
            (0, 0) => "no intact copy of its keys was found: what it held is lost".to_string(),
            (_, 0) => format!("{} found by a scan stand in for it", gens(live)),
            (0, _) => format!(
                "{} found by a scan, older copies of its keys, stand in for it (their \
                 contents may be out of date)",
                gens(older)
            ),
            _ => format!(
                "{} found by a scan stand in for it, and {} (older copies, whose contents \
                 may be out of date) for keys none of those hold",
                gens(live),
                gens(older)
            ),
        };
        self.rep.problem(format!("{label}: {why}; {found}"));
    }

    /// Appends the items in `lo..hi` of each leaf in `leaves` (newest first) whose
    /// keys no leaf taken before holds; (leaves taken, oldest and newest generation).
    fn take_leaves(
        &self,
        owner: u64,
        (lo, hi): (Key, Option<Key>),
        leaves: &[Leaf],
        taken: &mut BTreeMap<Key, Key>,
        out: &mut Vec<(Key, Vec<u8>)>,
    ) -> (u64, u64, u64) {
        let (mut used, mut oldest, mut newest) = (0u64, u64::MAX, 0u64);
        for c in leaves {
            let Ok(NodeBody::Leaf(items)) = self.read_node(c.addr, 0, owner, Some(c.generation))
            else {
                continue;
            };
            let items: Vec<(Key, Vec<u8>)> = items
                .into_iter()
                .filter(|(k, _)| in_range(k, lo, hi))
                .collect();
            let (Some(f), Some(l)) = (items.first().map(|x| x.0), items.last().map(|x| x.0)) else {
                continue;
            };
            if taken.range(..=l).next_back().is_some_and(|(_, &e)| e >= f) {
                continue;
            }
            taken.insert(f, l);
            used += 1;
            oldest = oldest.min(c.generation);
            newest = newest.max(c.generation);
            out.extend(items);
        }
        (used, oldest, newest)
    }

    /// The leaf in `node`, read from `addr`, if it is one of this filesystem's.
    fn leaf_at(&self, node: &[u8], addr: u64) -> Option<Leaf> {
        if node[4..20] != self.sb.fsid || node[20..28] != addr.to_le_bytes() {
            return None;
        }
        let Ok((h, NodeBody::Leaf(items))) = decode_node(node, addr, &self.sb.fsid) else {
            return None;
        };
        let (f, l) = (items.first()?, items.last()?);
        (h.generation <= self.sb.generation).then_some(Leaf {
            addr,
            generation: h.generation,
            owner: h.owner,
            first: f.0,
            last: l.0,
        })
    }

    /// Fills `leaves` with every intact leaf on the device, the first time.
    fn scan_once(&mut self) {
        if self.leaves.is_none() {
            let found = self.scan();
            self.leaves = Some(found);
        }
    }

    fn scan(&mut self) -> Vec<Leaf> {
        let ns = self.sb.node_size as u64;
        let end = self.end;
        let mut found = Vec::new();
        let mut at = self.data_start().next_multiple_of(BLOCK_SIZE);
        tracing::info!(
            "scanning {} MiB for intact tree leaves",
            end.saturating_sub(at) >> 20
        );
        let mut buf = vec![0u8; (SCAN_CHUNK + ns) as usize];
        while at.saturating_add(ns) <= end {
            let len = (SCAN_CHUNK + ns).min(end - at) as usize;
            let whole = self.dev.read_at(&mut buf[..len], at).is_ok();
            let mut off = 0usize;
            while off as u64 + ns <= len as u64 && (off as u64) < SCAN_CHUNK {
                let addr = at + off as u64;
                let node = &mut buf[off..off + ns as usize];
                // A chunk with a bad sector: read it a node at a time.
                if whole || self.dev.read_at(node, addr).is_ok() {
                    if let Some(l) = self.leaf_at(node, addr) {
                        found.push(l);
                    }
                } else {
                    self.rep
                        .problem(format!("scan: read error at {addr:#x}; skipped"));
                }
                off += BLOCK_SIZE as usize;
            }
            at += SCAN_CHUNK;
        }
        found.sort_by_key(|l| (std::cmp::Reverse(l.generation), l.addr));
        found
    }
}

/// What restore read of an image.
pub(super) struct Image {
    pub(super) ns: Namespace,
    /// Data block address -> the checksums of the blocks from there.
    pub(super) csums: BTreeMap<u64, Vec<u8>>,
    pub(super) total_bytes: u64,
    pub(super) rep: Restored,
}

/// Reads the tree to restore and the checksums.
pub(super) fn read_image(dev: &dyn BlockDev, opts: &RestoreOptions) -> Result<Image> {
    let sb = Store::read_super(dev)?;
    let end = sb.total_bytes.min(dev.size());
    let mut rd = TreeReader {
        dev,
        sb: sb.clone(),
        leaves: None,
        allocated: None,
        data_extents: BTreeMap::new(),
        known_upto: sb.generation,
        oldest_taken: u64::MAX,
        end,
        in_tree: HashSet::new(),
        rep: Restored::default(),
    };
    if end < sb.total_bytes {
        rd.rep.problem(format!(
            "the image ends at {end:#x}, before the {:#x} its superblock says (cut short?): \
             what lay past its end is lost",
            sb.total_bytes
        ));
    }
    let root_items = rd.tree_items("root tree", tree::ROOT, (sb.root_tree, sb.root_level, None));
    let root_tree_whole = rd.rep.damaged_nodes == 0;
    let mut roots: BTreeMap<u64, RootItem> = BTreeMap::new();
    let mut snaps: BTreeMap<u64, SnapshotItem> = BTreeMap::new();
    for (k, v) in &root_items {
        match k.ty {
            kind::ROOT_ITEM => {
                if let Ok(r) = RootItem::read_from_bytes(v) {
                    roots.insert(k.objectid, r);
                }
            }
            kind::SNAPSHOT if k.objectid == objectid::SNAPSHOTS => {
                if let Some(s) = SnapshotItem::decode(v) {
                    snaps.insert(k.offset, s);
                }
            }
            _ => {}
        }
    }
    // The tree to restore: a root to walk, or None to rebuild it from its newest
    // leaves (its root item is lost, or came from an older copy of the root tree,
    // whose fs-tree root the commits since have freed).
    let (label, root) = match &opts.snapshot {
        Some(name) => {
            let Some((&id, _)) = snaps.iter().find(|(_, s)| &s.name == name) else {
                let have: Vec<String> = snaps
                    .values()
                    .map(|s| String::from_utf8_lossy(&s.name).into_owned())
                    .collect();
                return Err(Error::BadImage(format!(
                    "no snapshot named {:?} (the image has: {})",
                    String::from_utf8_lossy(name),
                    if have.is_empty() {
                        "none".to_string()
                    } else {
                        have.join(", ")
                    }
                )));
            };
            match roots.get(&id) {
                Some(r) => (format!("snapshot tree {id}"), Some(*r)),
                None => {
                    return Err(Error::BadImage(format!(
                        "snapshot {:?} has no root item left",
                        String::from_utf8_lossy(name)
                    )))
                }
            }
        }
        None => (
            "fs tree".to_string(),
            roots.get(&tree::FS).copied().filter(|_| root_tree_whole),
        ),
    };
    let whole =
        |rd: &mut TreeReader<'_>, label: &str, owner: u64, root: Option<RootItem>| match root {
            Some(r) => rd.tree_items(
                label,
                owner,
                (r.bytenr.get(), r.level, Some(r.generation.get())),
            ),
            None => {
                let mut out = Vec::new();
                let g = rd.sb.generation;
                rd.stand_in(
                    label,
                    owner,
                    (Key::MIN, None, None),
                    g,
                    "root lost with the root tree",
                    &mut out,
                );
                out
            }
        };
    // The extent tree tells live nodes from freed ones, and tree nodes from file data,
    // for the stand-ins below: of the nodes as old as the oldest leaf that stood in
    // for a part of it, or all when it is whole.
    let extent_root = roots
        .get(&tree::EXTENT)
        .copied()
        .filter(|_| root_tree_whole);
    rd.oldest_taken = u64::MAX;
    let extent_items = whole(&mut rd, "extent tree", tree::EXTENT, extent_root);
    rd.known_upto = rd.oldest_taken.min(sb.generation);
    let mut allocated = HashSet::new();
    for (k, v) in extent_items
        .iter()
        .filter(|(k, _)| k.ty == kind::EXTENT_ITEM)
    {
        match ExtentItem::read_from_bytes(v).map(|e| e.flags.get()) {
            Ok(f) if f & EXTENT_FLAG_TREE != 0 => {
                allocated.insert(k.objectid);
            }
            Ok(f) if f & EXTENT_FLAG_DATA != 0 => {
                rd.data_extents.insert(k.objectid, k.offset);
            }
            _ => {}
        }
    }
    rd.allocated = (!allocated.is_empty()).then_some(allocated);
    let fs_items = whole(&mut rd, &label, tree::FS, root);
    let csum_root = roots.get(&tree::CSUM).copied().filter(|_| root_tree_whole);
    let csum_items = whole(&mut rd, "checksum tree", tree::CSUM, csum_root);
    let (fs_items, csum_items) = if opts.snapshot.is_none() {
        replay_log(dev, &sb, fs_items, csum_items, &mut rd.rep)
    } else {
        (fs_items, csum_items)
    };
    let mut csums: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    for (k, v) in csum_items {
        if k.objectid == objectid::CSUM && k.ty == kind::EXTENT_CSUM && v.len() % 4 == 0 {
            csums.insert(k.offset, v);
        }
    }
    let TreeReader { mut rep, .. } = rd;
    let ns = Namespace::build(fs_items, &mut rep);
    Ok(Image {
        ns,
        csums,
        total_bytes: end,
        rep,
    })
}

/// The fs and checksum trees' items with the fsyncs since the last commit applied, as
/// a mount replays them: the log holds every item change to those trees, in order.
fn replay_log(
    dev: &dyn BlockDev,
    sb: &Superblock,
    fs_items: Items,
    csum_items: Items,
    rep: &mut Restored,
) -> (Items, Items) {
    let Some(next) = sb.generation.checked_add(1) else {
        return (fs_items, csum_items);
    };
    let batches = match crate::fs::log_batches(dev, sb, next) {
        Ok(found) => {
            if let Some((n, e)) = found.unreadable {
                rep.problem(format!(
                    "log batch {n}: the data it names cannot be read ({e}); \
                     the fsyncs it and the batches after it hold are not restored"
                ));
            }
            if let Some(n) = found.damaged {
                rep.problem(format!(
                    "log batch {n} names blocks outside the data area, or an item larger than a \
                     node holds: it is damaged; \
                     the fsyncs it and the batches after it hold are not restored"
                ));
            }
            if found.batches.is_empty() {
                return (fs_items, csum_items);
            }
            found.batches
        }
        Err(e) => {
            rep.problem(format!(
                "log area cannot be read: {e}; the fsyncs since the last commit are not restored"
            ));
            return (fs_items, csum_items);
        }
    };
    let mut fs: BTreeMap<Key, Vec<u8>> = fs_items.into_iter().collect();
    let mut cs: BTreeMap<Key, Vec<u8>> = csum_items.into_iter().collect();
    for op in batches.iter().flatten() {
        match op {
            LogOp::Insert { tree: t, key, val } => {
                let to = match *t {
                    tree::FS => &mut fs,
                    tree::CSUM => &mut cs,
                    _ => continue,
                };
                to.insert(*key, val.clone());
            }
            LogOp::Delete { tree: t, key } => {
                match *t {
                    tree::FS => fs.remove(key),
                    tree::CSUM => cs.remove(key),
                    _ => None,
                };
            }
            LogOp::DataRef { .. } => {}
        }
    }
    rep.log_batches = batches.len();
    (fs.into_iter().collect(), cs.into_iter().collect())
}
