//! `birchfs check`: verifies an image through the format layer alone.
//!
//! Checks: every superblock copy; every node's checksum, fsid, address, level, owner,
//! generation (against its parent), key order and key bounds; extent refcounts
//! against every reference (tree nodes and file extents); overlapping extents; the
//! superblock's bytes_used; each data extent's checksum item and every data block
//! against it; directory entries (DIR_ITEM, DIR_INDEX, INODE_REF agree and point at
//! inodes of the right type); inode link counts; orphan items; stray items.

use std::collections::{BTreeMap, HashMap, HashSet};

use zerocopy::FromBytes;

use crate::dev::BlockDev;
use crate::error::Result;
use crate::format::{
    decode_dir_entries, decode_inode_extrefs, decode_inode_refs, decode_node, decode_xattrs, kind,
    objectid, root_flag, tree, ExtentItem, FileExtent, InodeItem, Key, NodeBody, RootItem,
    SnapshotItem, SnapshotMeta, Superblock, EXTENT_FLAG_DATA, EXTENT_FLAG_TREE,
    FILE_EXTENT_PREALLOC, MAGIC, SUPER_OFFSETS, SUPER_SIZE,
};
use crate::txn::Store;

/// What check found.
#[derive(Debug, Default)]
pub struct Report {
    /// One line per problem; empty when the image is clean.
    pub problems: Vec<String>,
    /// Tree nodes read.
    pub nodes: u64,
    /// Inodes seen.
    pub inodes: u64,
    /// Data blocks verified against their checksums.
    pub data_blocks: u64,
    /// Log batches (fsyncs since the last commit) a mount would replay; the check
    /// sees the last commit only, without them.
    pub pending_log_batches: usize,
}

impl Report {
    /// One line of totals.
    pub fn summary(&self) -> String {
        format!(
            "{} problems; {} nodes, {} inodes, {} data blocks checked",
            self.problems.len(),
            self.nodes,
            self.inodes,
            self.data_blocks
        )
    }
}

/// Whether any superblock copy of `dev` carries birchfs's magic.
pub fn has_birchfs_magic(dev: &dyn BlockDev) -> bool {
    SUPER_OFFSETS.iter().any(|&off| {
        let mut b = [0u8; 12];
        off + SUPER_SIZE as u64 <= dev.size()
            && dev.read_at(&mut b, off).is_ok()
            && b[4..12] == MAGIC
    })
}

/// Signatures of other filesystems, volumes and partition tables, as blkid finds
/// them: what they are, the offset, the bytes there.
const FOREIGN: &[(&str, u64, &[u8])] = &[
    ("an ext2/3/4 filesystem", 1080, &[0x53, 0xef]),
    ("an XFS filesystem", 0, b"XFSB"),
    ("a btrfs filesystem", 0x10040, b"_BHRfS_M"),
    ("an F2FS filesystem", 1024, &[0x10, 0x20, 0xf5, 0xf2]),
    ("an NTFS filesystem", 3, b"NTFS    "),
    ("a squashfs image", 0, b"hsqs"),
    ("an ISO 9660 image", 0x8001, b"CD001"),
    ("a swap area", 4086, b"SWAPSPACE2"),
    ("a LUKS volume", 0, b"LUKS\xba\xbe"),
    ("an LVM physical volume", 512, b"LABELONE"),
    ("a GPT partition table", 512, b"EFI PART"),
    (
        "an MBR partition table or a FAT boot sector",
        510,
        &[0x55, 0xaa],
    ),
];

/// What other filesystem, volume or partition table `dev` seems to hold (by the
/// signatures blkid looks for), if any: mkfs refuses to overwrite it unforced.
pub fn foreign_signature(dev: &dyn BlockDev) -> Option<&'static str> {
    FOREIGN.iter().find_map(|&(what, off, magic)| {
        let mut b = vec![0u8; magic.len()];
        let found = off + magic.len() as u64 <= dev.size()
            && dev.read_at(&mut b, off).is_ok()
            && b == magic;
        found.then_some(what)
    })
}

struct Walker<'a> {
    dev: &'a dyn BlockDev,
    sb: Superblock,
    rep: Report,
    /// Tree node address -> references seen (parent pointers and roots, in all trees).
    node_refs: HashMap<u64, u64>,
    /// Nodes whose own references (children, file extents) have been counted: a node
    /// shared by several trees counts them once.
    entered: HashSet<u64>,
    /// File extents of the leaves counted, each leaf once.
    counted_extents: Vec<(Key, FileExtent)>,
}

/// How to walk one tree.
struct Walk {
    /// Owner every node must carry (the fs tree for snapshots).
    owner: u64,
    /// Tree id, for messages.
    label: u64,
    /// Whether to return the leaf items (a dropped tree's are not needed).
    collect: bool,
    /// For a snapshot being dropped: subtrees wholly below this key are gone.
    progress: Option<Key>,
}

impl Walker<'_> {
    fn problem(&mut self, s: String) {
        if self.rep.problems.len() < 10_000 {
            self.rep.problems.push(s);
        }
    }

    /// Walks a tree, returning its leaf items in key order (unreadable subtrees are
    /// reported and skipped).
    fn walk(&mut self, root: u64, level: u8, gen: Option<u64>, wk: &Walk) -> Vec<(Key, Vec<u8>)> {
        let mut out = Vec::new();
        let mut in_tree = HashSet::new();
        self.walk_rec(
            root,
            level,
            gen,
            (Key::MIN, None),
            true,
            wk,
            &mut in_tree,
            &mut out,
        );
        out
    }

    /// `counting`: this reference counts (the parent's references were not counted
    /// before, through another tree).
    #[allow(clippy::too_many_arguments)]
    fn walk_rec(
        &mut self,
        addr: u64,
        level: u8,
        gen: Option<u64>,
        (lo, hi): (Key, Option<Key>),
        counting: bool,
        wk: &Walk,
        in_tree: &mut HashSet<u64>,
        out: &mut Vec<(Key, Vec<u8>)>,
    ) {
        let label = wk.label;
        if counting {
            *self.node_refs.entry(addr).or_default() += 1;
        }
        if !in_tree.insert(addr) {
            self.problem(format!(
                "tree {label}: node {addr:#x} referenced more than once"
            ));
            return;
        }
        let first = counting && self.entered.insert(addr);
        if !first && !wk.collect {
            return;
        }
        let ns = self.sb.node_size as usize;
        let data_start = self.sb.log_start + self.sb.log_len;
        if addr % 4096 != 0 || addr < data_start || addr + ns as u64 > self.sb.total_bytes {
            self.problem(format!(
                "tree {label}: node address {addr:#x} outside the data area"
            ));
            return;
        }
        let mut buf = vec![0u8; ns];
        if let Err(e) = self.dev.read_at(&mut buf, addr) {
            self.problem(format!("tree {label}: node {addr:#x}: read error {e}"));
            return;
        }
        self.rep.nodes += 1;
        let (h, body) = match decode_node(&buf, addr, &self.sb.fsid) {
            Ok(x) => x,
            Err(e) => {
                self.problem(format!("tree {label}: {e}"));
                return;
            }
        };
        if h.level != level {
            self.problem(format!(
                "tree {label}: node {addr:#x} level {} expected {level}",
                h.level
            ));
            return;
        }
        if h.owner != wk.owner {
            self.problem(format!(
                "tree {label}: node {addr:#x} owned by tree {}",
                h.owner
            ));
        }
        if let Some(g) = gen {
            if h.generation != g {
                self.problem(format!(
                    "tree {label}: node {addr:#x} generation {} but parent says {g}",
                    h.generation
                ));
            }
        }
        if h.generation > self.sb.generation {
            self.problem(format!(
                "tree {label}: node {addr:#x} from a future generation {}",
                h.generation
            ));
        }
        let keys: Vec<Key> = match &body {
            NodeBody::Leaf(v) => v.iter().map(|x| x.0).collect(),
            NodeBody::Internal(v) => v.iter().map(|x| x.0).collect(),
        };
        if keys.first().is_some_and(|k| *k < lo)
            || hi.is_some_and(|hi| keys.last().is_some_and(|k| *k >= hi))
        {
            self.problem(format!(
                "tree {label}: node {addr:#x} has keys outside its parent's range"
            ));
        }
        match body {
            NodeBody::Leaf(items) => {
                if first {
                    for (k, v) in items.iter().filter(|(k, _)| k.ty == kind::EXTENT_DATA) {
                        match FileExtent::read_from_bytes(v) {
                            Ok(fe) => self.counted_extents.push((*k, fe)),
                            Err(_) => self.problem(format!(
                                "tree {label}: inode {}: malformed file extent at {}",
                                k.objectid, k.offset
                            )),
                        }
                    }
                }
                if wk.collect {
                    out.extend(items);
                }
            }
            NodeBody::Internal(ptrs) => {
                for (i, (k, child, cgen)) in ptrs.iter().enumerate() {
                    let next = ptrs.get(i + 1).map(|p| p.0).or(hi);
                    if wk
                        .progress
                        .is_some_and(|p| next.is_some_and(|next| next <= p))
                    {
                        continue;
                    }
                    self.walk_rec(
                        *child,
                        level - 1,
                        Some(*cgen),
                        ((*k).max(lo), next),
                        first,
                        wk,
                        in_tree,
                        out,
                    );
                }
            }
        }
    }
}

/// A tree's leaf items in key order.
type Items = Vec<(Key, Vec<u8>)>;

/// File extents among a tree's items.
fn file_extents_of(items: &[(Key, Vec<u8>)]) -> Vec<(Key, FileExtent)> {
    items
        .iter()
        .filter(|(k, _)| k.ty == kind::EXTENT_DATA)
        .filter_map(|(k, v)| FileExtent::read_from_bytes(v).ok().map(|fe| (*k, fe)))
        .collect()
}

/// Checks the filesystem on `dev`; `Err` only when it cannot be read at all.
pub fn check(dev: &dyn BlockDev) -> Result<Report> {
    let sb = Store::read_super(dev)?;
    let mut w = Walker {
        dev,
        sb: sb.clone(),
        rep: Report::default(),
        node_refs: HashMap::new(),
        entered: HashSet::new(),
        counted_extents: Vec::new(),
    };
    if sb.total_bytes > dev.size() {
        w.problem(format!(
            "the image is {} bytes but its superblock says {} (cut short?): a mount \
             refuses it, and what lay past its end is lost; `birchfs restore` copies \
             out the rest",
            dev.size(),
            sb.total_bytes
        ));
    }
    for &off in SUPER_OFFSETS
        .iter()
        .filter(|&&o| o + SUPER_SIZE as u64 <= sb.total_bytes)
    {
        let mut buf = vec![0u8; SUPER_SIZE];
        dev.read_at(&mut buf, off)?;
        // A valid copy one generation behind is what a power cut between the
        // superblock writes of a commit leaves; the next commit rewrites it.
        match Superblock::decode(&buf, off) {
            Err(e) => w.problem(format!("superblock copy at {off:#x}: {e}")),
            Ok(s) if s.generation + 1 < sb.generation || s.fsid != sb.fsid => w.problem(format!(
                "superblock copy at {off:#x} has generation {} but the newest is {}",
                s.generation, sb.generation
            )),
            Ok(_) => {}
        }
    }
    let plain = |id: u64| Walk {
        owner: id,
        label: id,
        collect: true,
        progress: None,
    };
    let root_items = w.walk(sb.root_tree, sb.root_level, None, &plain(tree::ROOT));
    let mut roots = BTreeMap::new();
    let mut progress: BTreeMap<u64, Key> = BTreeMap::new();
    let mut snaps: BTreeMap<u64, SnapshotItem> = BTreeMap::new();
    let mut meta = None;
    for (k, v) in &root_items {
        match k.ty {
            kind::ROOT_ITEM => match RootItem::read_from_bytes(v) {
                Ok(r) => {
                    roots.insert(k.objectid, r);
                }
                Err(_) => w.problem(format!("root tree: bad item {k:?}")),
            },
            kind::DROP_PROGRESS => match Key::decode(&mut crate::format::Reader::new(v)) {
                Some(p) => {
                    progress.insert(k.objectid, p);
                }
                None => w.problem(format!("root tree: bad drop progress {k:?}")),
            },
            kind::SNAPSHOT if k.objectid == objectid::SNAPSHOTS => match SnapshotItem::decode(v) {
                Some(s) => {
                    snaps.insert(k.offset, s);
                }
                None => w.problem(format!("root tree: bad snapshot item {k:?}")),
            },
            kind::SNAPSHOT_META if k.objectid == objectid::SNAPSHOTS => {
                match SnapshotMeta::read_from_bytes(v) {
                    Ok(m) => meta = Some(m),
                    Err(_) => w.problem(format!("root tree: bad snapshot meta {k:?}")),
                }
            }
            _ => w.problem(format!("root tree: bad item {k:?}")),
        }
    }
    let mut trees: HashMap<u64, Vec<(Key, Vec<u8>)>> = HashMap::new();
    for id in [tree::EXTENT, tree::CSUM, tree::FS] {
        match roots.get(&id) {
            None => w.problem(format!("root tree: tree {id} missing")),
            Some(r) => {
                let items = w.walk(
                    r.bytenr.get(),
                    r.level,
                    Some(r.generation.get()),
                    &plain(id),
                );
                trees.insert(id, items);
            }
        }
    }
    // Snapshots, and deleted snapshots part-way through their drop.
    let mut snap_items: Vec<(u64, Items)> = Vec::new();
    let mut names = HashSet::new();
    for (&id, r) in &roots {
        if [tree::EXTENT, tree::CSUM, tree::FS].contains(&id) {
            continue;
        }
        if id < objectid::FIRST_SNAPSHOT {
            w.problem(format!("root tree: unknown tree {id}"));
            continue;
        }
        let dead = r.flags.get() & root_flag::DEAD != 0;
        if let Some(m) = &meta {
            if id >= m.next_id.get() {
                w.problem(format!(
                    "snapshot tree {id} at or past the next id {}",
                    m.next_id.get()
                ));
            }
        }
        let wk = Walk {
            owner: tree::FS,
            label: id,
            collect: !dead,
            progress: if dead {
                progress.get(&id).copied()
            } else {
                None
            },
        };
        if dead {
            if snaps.contains_key(&id) {
                w.problem(format!("snapshot {id} is listed but marked deleted"));
            }
            if !progress.contains_key(&id) {
                w.problem(format!("deleted snapshot {id} has no drop progress"));
            }
            w.walk(r.bytenr.get(), r.level, Some(r.generation.get()), &wk);
            continue;
        }
        match snaps.get(&id) {
            None => w.problem(format!("tree {id} is no snapshot and not deleted")),
            Some(s) => {
                if r.flags.get() & root_flag::RDONLY == 0 {
                    w.problem(format!("snapshot {id} is not marked read-only"));
                }
                if !names.insert(s.name.clone()) {
                    w.problem(format!(
                        "two snapshots named {:?}",
                        String::from_utf8_lossy(&s.name)
                    ));
                }
                if meta.is_none_or(|m| m.last_snapshot.get() < s.generation) {
                    w.problem(format!(
                        "snapshot {id} is newer than the last snapshot generation"
                    ));
                }
            }
        }
        let items = w.walk(r.bytenr.get(), r.level, Some(r.generation.get()), &wk);
        snap_items.push((id, items));
    }
    for id in snaps.keys().filter(|id| !roots.contains_key(id)) {
        w.problem(format!("snapshot {id} has no root"));
    }
    for id in progress.keys().filter(|id| !roots.contains_key(id)) {
        w.problem(format!("drop progress of tree {id}, which has no root"));
    }
    let fs_items = trees.remove(&tree::FS).unwrap_or_default();
    let extent_items = trees.remove(&tree::EXTENT).unwrap_or_default();
    let csum_items = trees.remove(&tree::CSUM).unwrap_or_default();

    // Expected references: each parent pointer or root of a node, each file extent item
    // of each distinct leaf.
    let mut expect: BTreeMap<u64, (u64, u64, u64)> = BTreeMap::new(); // bytenr -> (len, flags, refs)
    for (&addr, &n) in &w.node_refs {
        expect.insert(addr, (sb.node_size as u64, EXTENT_FLAG_TREE, n));
    }
    let file_extents = std::mem::take(&mut w.counted_extents);
    for (k, fe) in &file_extents {
        let e =
            expect
                .entry(fe.disk_bytenr.get())
                .or_insert((fe.disk_len.get(), EXTENT_FLAG_DATA, 0));
        if e.0 != fe.disk_len.get() || e.1 != EXTENT_FLAG_DATA {
            w.problem(format!(
                "inode {}: file extent at {} disagrees on extent {:#x}",
                k.objectid,
                k.offset,
                fe.disk_bytenr.get()
            ));
        }
        e.2 += 1;
    }
    let mut used = 0u64;
    let mut prev_end = 0u64;
    let data_start = sb.log_start + sb.log_len;
    let mut seen = HashSet::new();
    for (k, v) in &extent_items {
        if k.ty != kind::EXTENT_ITEM {
            w.problem(format!("extent tree: unexpected item {k:?}"));
            continue;
        }
        let Ok(ei) = ExtentItem::read_from_bytes(v) else {
            w.problem(format!("extent tree: malformed item {k:?}"));
            continue;
        };
        let (start, len) = (k.objectid, k.offset);
        used += len;
        if start < prev_end {
            w.problem(format!(
                "extent {start:#x}+{len} overlaps the previous extent"
            ));
        }
        if start < data_start || start + len > sb.total_bytes {
            w.problem(format!("extent {start:#x}+{len} outside the data area"));
        }
        if SUPER_OFFSETS
            .iter()
            .any(|&o| o < start + len && start < o + SUPER_SIZE as u64)
        {
            w.problem(format!("extent {start:#x}+{len} covers a superblock"));
        }
        prev_end = prev_end.max(start + len);
        seen.insert(start);
        match expect.get(&start) {
            None => w.problem(format!(
                "extent {start:#x}+{len} has refcount {} but nothing references it (leaked)",
                ei.refs.get()
            )),
            Some(&(elen, flags, refs)) => {
                if elen != len || flags != ei.flags.get() {
                    w.problem(format!("extent {start:#x}: item says len {len} flags {} but references say len {elen} flags {flags}", ei.flags.get()));
                }
                if refs != ei.refs.get() {
                    w.problem(format!(
                        "extent {start:#x}: refcount {} but {refs} references found",
                        ei.refs.get()
                    ));
                }
            }
        }
    }
    for (start, (len, flags, refs)) in &expect {
        if !seen.contains(start) {
            let what = if *flags == EXTENT_FLAG_TREE {
                "tree node"
            } else {
                "data extent"
            };
            w.problem(format!(
                "{what} {start:#x}+{len} has {refs} references but no extent item"
            ));
        }
    }
    if used != sb.bytes_used {
        w.problem(format!(
            "superblock bytes_used {} but extents add up to {used}",
            sb.bytes_used
        ));
    }

    // Data checksums: items that do not overlap, each inside one data extent (one
    // for the whole extent, or one per piece of a preallocated extent written in
    // place); every block a written file extent maps has one, and every block
    // with one matches it.
    let mut csums: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut csum_end = 0u64;
    for (k, v) in csum_items {
        if k.objectid != objectid::CSUM || k.ty != kind::EXTENT_CSUM {
            w.problem(format!("checksum tree: unexpected item {k:?}"));
            continue;
        }
        let end = k.offset.saturating_add(v.len() as u64 / 4 * 4096);
        if v.is_empty() || v.len() % 4 != 0 {
            w.problem(format!("checksums for {:#x}: {} bytes", k.offset, v.len()));
            continue;
        }
        let inside = expect
            .range(..=k.offset)
            .next_back()
            .is_some_and(|(&s, &(l, f, _))| f == EXTENT_FLAG_DATA && end <= s.saturating_add(l));
        if !inside {
            w.problem(format!(
                "checksums for {:#x}+{}, which lie in no data extent",
                k.offset,
                end - k.offset
            ));
            continue;
        }
        if k.offset < csum_end {
            w.problem(format!(
                "checksums for {:#x} overlap the ones before",
                k.offset
            ));
            continue;
        }
        csum_end = end;
        csums.insert(k.offset, v);
    }
    let mut seen_extents = HashSet::new();
    let mut seen_ranges = HashSet::new();
    for (_, fe) in &file_extents {
        let (b, l) = (fe.disk_bytenr.get(), fe.disk_len.get());
        if seen_extents.insert(b)
            && (l > crate::format::MAX_PREALLOC_SIZE
                || b.checked_add(l).is_none_or(|e| e > w.sb.total_bytes))
        {
            w.problem(format!(
                "data extent {b:#x}+{l} is too large or outside the device"
            ));
        }
        let (from, n) = (b.saturating_add(fe.offset.get()), fe.num_bytes.get());
        if fe.kind == FILE_EXTENT_PREALLOC || !seen_ranges.insert((from, n)) {
            continue;
        }
        let mut at = from;
        while at < from.saturating_add(n) {
            let covering = csums
                .range(..=at)
                .next_back()
                .map(|(&s, v)| s + v.len() as u64 / 4 * 4096)
                .filter(|&e| e > at);
            match covering {
                Some(e) => at = e,
                None => {
                    w.problem(format!(
                        "data extent {b:#x}: no checksums for block {at:#x}"
                    ));
                    break;
                }
            }
        }
    }
    for (&start, sums) in &csums {
        let mut buf = vec![0u8; sums.len() / 4 * 4096];
        if dev.read_at(&mut buf, start).is_err() {
            w.problem(format!("data blocks {start:#x}+{}: read error", buf.len()));
            continue;
        }
        for (i, blk) in buf.chunks(4096).enumerate() {
            w.rep.data_blocks += 1;
            let want = u32::from_le_bytes(sums[i * 4..i * 4 + 4].try_into().unwrap());
            if crate::format::csum(blk) != want {
                w.problem(format!(
                    "data block {:#x}: checksum mismatch",
                    start + i as u64 * 4096
                ));
            }
        }
    }

    check_namespace(&mut w, &fs_items, &file_extents_of(&fs_items));
    for (id, items) in &snap_items {
        let before = w.rep.problems.len();
        let inodes = w.rep.inodes;
        check_namespace(&mut w, items, &file_extents_of(items));
        w.rep.inodes += inodes;
        for p in &mut w.rep.problems[before..] {
            *p = format!("snapshot {id}: {p}");
        }
    }
    match crate::fs::log_batches(dev, &sb, sb.generation + 1) {
        Ok(found) => {
            w.rep.pending_log_batches = found.batches.len();
            if let Some((n, e)) = found.unreadable {
                w.problem(format!(
                    "log batch {n}: the data it names cannot be read ({e}), so a mount fails \
                     until it can; the {n} batches before it replay"
                ));
            }
            if let Some(n) = found.damaged {
                w.problem(format!(
                    "log batch {n} names blocks outside the data area, or an item larger than a \
                     node holds: it is damaged, and \
                     a mount replays only the {n} batches before it"
                ));
            }
        }
        Err(e) => w.problem(format!("log area cannot be read: {e}")),
    }
    Ok(w.rep)
}

fn check_namespace(
    w: &mut Walker<'_>,
    items: &[(Key, Vec<u8>)],
    file_extents: &[(Key, FileExtent)],
) {
    let mut inodes: BTreeMap<u64, InodeItem> = BTreeMap::new();
    let mut names: HashMap<u64, u64> = HashMap::new(); // ino -> names (INODE_REF, EXTREF)
    let mut subdirs: HashMap<u64, u64> = HashMap::new();
    let mut dir_items: HashSet<(u64, Vec<u8>, u64, u64)> = HashSet::new(); // dir,name,ino,index
    let mut dir_index: HashSet<(u64, Vec<u8>, u64, u64)> = HashSet::new();
    let mut refs: HashSet<(u64, u64, Vec<u8>, u64)> = HashSet::new(); // ino,parent,name,index
    let mut entry_types: Vec<(u64, u64, u8)> = Vec::new(); // dir, ino, dtype
    let mut orphans = HashSet::new();
    let mut owners = HashSet::new();
    let mut chunked: Vec<(u64, Vec<u8>, u64, u32)> = Vec::new(); // ino, name, base, len
    let mut chunks: BTreeMap<(u64, u64), usize> = BTreeMap::new(); // (ino, offset) -> bytes
    for (k, v) in items {
        if k.objectid == objectid::ORPHAN {
            if k.ty == kind::ORPHAN_ITEM {
                orphans.insert(k.offset);
            } else {
                w.problem(format!("unexpected item {k:?} in the orphan range"));
            }
            continue;
        }
        owners.insert(k.objectid);
        let bad = |w: &mut Walker<'_>, what: &str| {
            w.problem(format!("inode {}: malformed {what} {k:?}", k.objectid))
        };
        match k.ty {
            kind::INODE_ITEM => match InodeItem::read_from_bytes(v) {
                Ok(i) => {
                    let unknown = i.flags.get() & !crate::format::inode_flag::KNOWN;
                    if unknown != 0 {
                        w.problem(format!(
                            "inode {}: unknown inode flags {unknown:#x}",
                            k.objectid
                        ));
                    }
                    inodes.insert(k.objectid, i);
                }
                Err(_) => bad(w, "inode item"),
            },
            kind::INODE_REF => match decode_inode_refs(v) {
                Some(l) => {
                    for r in l {
                        *names.entry(k.objectid).or_default() += 1;
                        refs.insert((k.objectid, k.offset, r.name, r.index));
                    }
                }
                None => bad(w, "inode ref"),
            },
            kind::INODE_EXTREF => match decode_inode_extrefs(v) {
                Some(l) => {
                    if w.sb.incompat & crate::format::INCOMPAT_EXTREF == 0 {
                        w.problem(format!(
                            "inode {}: extended ref {k:?} in an image without the feature flag",
                            k.objectid
                        ));
                    }
                    for x in l {
                        if crate::format::extref_hash(x.parent, &x.name) != k.offset {
                            w.problem(format!(
                                "inode {}: extended ref {:?} in dir {} under the wrong hash",
                                k.objectid,
                                String::from_utf8_lossy(&x.name),
                                x.parent
                            ));
                        }
                        *names.entry(k.objectid).or_default() += 1;
                        refs.insert((k.objectid, x.parent, x.name, x.index));
                    }
                }
                None => bad(w, "inode extref"),
            },
            kind::DIR_ITEM => match decode_dir_entries(v) {
                Some(l) => {
                    for e in l {
                        if crate::format::name_hash(&e.name) != k.offset {
                            w.problem(format!(
                                "dir {}: entry {:?} under the wrong hash",
                                k.objectid,
                                String::from_utf8_lossy(&e.name)
                            ));
                        }
                        if e.ino >= crate::fs::LIVE_INO_LIMIT {
                            w.problem(format!(
                                "dir {}: entry {:?} names inode {}, past the largest",
                                k.objectid,
                                String::from_utf8_lossy(&e.name),
                                e.ino
                            ));
                        }
                        if e.dtype == libc::DT_DIR {
                            *subdirs.entry(k.objectid).or_default() += 1;
                        }
                        entry_types.push((k.objectid, e.ino, e.dtype));
                        dir_items.insert((k.objectid, e.name, e.ino, e.index));
                    }
                }
                None => bad(w, "dir item"),
            },
            kind::DIR_INDEX => match decode_dir_entries(v) {
                Some(l) if l.len() == 1 && l[0].index == k.offset => {
                    let e = &l[0];
                    dir_index.insert((k.objectid, e.name.clone(), e.ino, e.index));
                }
                _ => bad(w, "dir index"),
            },
            kind::XATTR_ITEM => match decode_xattrs(v) {
                Some(l) => {
                    for e in l {
                        if let Some((base, len)) = e.chunks {
                            chunked.push((k.objectid, e.name, base, len));
                        }
                    }
                }
                None => bad(w, "xattr item"),
            },
            kind::XATTR_CHUNK => {
                chunks.insert((k.objectid, k.offset), v.len());
            }
            kind::SYMLINK | kind::EXTENT_DATA => {}
            _ => w.problem(format!("unknown item {k:?}")),
        }
    }
    w.rep.inodes = inodes.len() as u64;
    // Each chunked xattr value has its chunks, in a row from its base and adding up
    // to its length; every chunk belongs to one.
    for (ino, name, base, len) in chunked {
        let mut sum = 0;
        let mut off = base;
        while let Some(n) = chunks.remove(&(ino, off)) {
            sum += n;
            match off.checked_add(1) {
                Some(o) => off = o,
                None => break,
            }
        }
        if sum != len as usize {
            w.problem(format!(
                "inode {ino}: xattr {:?} holds {sum} of its {len} bytes in chunks",
                String::from_utf8_lossy(&name)
            ));
        }
    }
    for (ino, off) in chunks.keys() {
        w.problem(format!(
            "inode {ino}: xattr chunk {off:#x} belongs to no xattr"
        ));
    }
    for o in &owners {
        if !inodes.contains_key(o) {
            w.problem(format!("items of inode {o}, which has no inode item"));
        }
    }
    for e in dir_items.difference(&dir_index) {
        w.problem(format!(
            "dir {}: entry {:?} (ino {}) has no dir index",
            e.0,
            String::from_utf8_lossy(&e.1),
            e.2
        ));
    }
    for e in dir_index.difference(&dir_items) {
        w.problem(format!(
            "dir {}: index {} ({:?}) has no dir item",
            e.0,
            e.3,
            String::from_utf8_lossy(&e.1)
        ));
    }
    for (dir, name, ino, index) in &dir_items {
        if !refs.contains(&(*ino, *dir, name.clone(), *index)) {
            w.problem(format!(
                "dir {dir}: entry {:?} has no back reference in inode {ino}",
                String::from_utf8_lossy(name)
            ));
        }
    }
    for (ino, parent, name, index) in &refs {
        if !dir_items.contains(&(*parent, name.clone(), *ino, *index)) {
            w.problem(format!(
                "inode {ino}: name {:?} in dir {parent} has no dir entry",
                String::from_utf8_lossy(name)
            ));
        }
    }
    for (dir, ino, dtype) in &entry_types {
        match inodes.get(ino) {
            None => w.problem(format!("dir {dir}: entry points at missing inode {ino}")),
            Some(i) => {
                let want = crate::fs::FileKind::from_mode(i.mode.get()).map(|k| k.dtype());
                if want != Some(*dtype) {
                    w.problem(format!(
                        "dir {dir}: entry for inode {ino} has type {dtype}, inode says {want:?}"
                    ));
                }
            }
        }
        if inodes
            .get(dir)
            .is_none_or(|d| d.mode.get() & libc::S_IFMT != libc::S_IFDIR)
        {
            w.problem(format!("entries under {dir}, which is not a directory"));
        }
    }
    let mut nbytes: HashMap<u64, u64> = HashMap::new();
    let mut last_end: HashMap<u64, u64> = HashMap::new();
    // Where each file's written (not preallocated) data ends.
    let mut data_end: HashMap<u64, u64> = HashMap::new();
    for (k, fe) in file_extents {
        if let Some(why) = fe.flaw(k.offset) {
            w.problem(format!(
                "inode {}: file extent at {} is {why}",
                k.objectid, k.offset
            ));
        }
        *nbytes.entry(k.objectid).or_default() += fe.num_bytes.get();
        if fe.kind != crate::format::FILE_EXTENT_PREALLOC {
            let d = data_end.entry(k.objectid).or_default();
            *d = (*d).max(k.offset + fe.num_bytes.get());
        }
        let e = last_end.entry(k.objectid).or_default();
        if k.offset < *e {
            w.problem(format!(
                "inode {}: file extents overlap at {}",
                k.objectid, k.offset
            ));
        }
        *e = k.offset + fe.num_bytes.get();
    }
    for (ino, i) in &inodes {
        let is_dir = i.mode.get() & libc::S_IFMT == libc::S_IFDIR;
        let n = names.get(ino).copied().unwrap_or(0);
        let nlink = i.nlink.get() as u64;
        if is_dir {
            let want_names = if *ino == objectid::ROOT_DIR { 0 } else { 1 };
            if nlink != 0 && n != want_names {
                w.problem(format!("dir {ino}: {n} names, expected {want_names}"));
            }
            let want = 2 + subdirs.get(ino).copied().unwrap_or(0);
            if nlink != 0 && nlink != want {
                w.problem(format!("dir {ino}: link count {nlink}, expected {want}"));
            }
        } else if nlink != n {
            w.problem(format!("inode {ino}: link count {nlink} but {n} names"));
        }
        if nlink == 0 && !orphans.contains(ino) {
            w.problem(format!("inode {ino}: no links and no orphan item (leaked)"));
        }
        // Data past the block holding the end of the file would show through a later
        // extension instead of zeros.
        let bs = crate::format::BLOCK_SIZE;
        let data = data_end.get(ino).copied().unwrap_or(0);
        if data > i.size.get().div_ceil(bs) * bs {
            w.problem(format!(
                "inode {ino}: data extents reach {data}, past its size {}",
                i.size.get()
            ));
        }
        let nb = nbytes.get(ino).copied().unwrap_or(0);
        if nb != i.nbytes.get() {
            w.problem(format!(
                "inode {ino}: nbytes {} but extents add up to {nb}",
                i.nbytes.get()
            ));
        }
    }
    for o in &orphans {
        if !inodes.contains_key(o) {
            w.problem(format!("orphan item for missing inode {o}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::dev::MemDev;
    use crate::{Creds, Fs, MkfsOptions, Options, ROOT_INO};

    fn populated() -> Arc<MemDev> {
        let dev = Arc::new(MemDev::new(64 << 20));
        Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let fs = Fs::open(dev.clone(), Options::default()).unwrap();
        let c = Creds::default();
        let d = fs.mkdir(ROOT_INO, b"d", 0o755, c).unwrap();
        for i in 0..300 {
            let f = fs
                .mknod(d.ino, format!("f{i}").as_bytes(), 0o644, 0, c)
                .unwrap();
            fs.write(f.ino, 0, &vec![i as u8; 5000]).unwrap();
        }
        fs.link(
            fs.lookup_nopin(d.ino, b"f1").unwrap().ino,
            ROOT_INO,
            b"hard",
        )
        .unwrap();
        fs.unmount().unwrap();
        dev
    }

    #[test]
    fn a_fresh_and_a_used_filesystem_are_clean() {
        let dev = populated();
        let rep = check(dev.as_ref()).unwrap();
        assert!(rep.problems.is_empty(), "{:#?}", rep.problems);
        assert!(rep.nodes > 3 && rep.inodes == 302 && rep.data_blocks >= 600);
    }

    #[test]
    fn other_filesystems_and_partition_tables_are_recognised() {
        let dev = MemDev::new(64 << 20);
        assert_eq!(foreign_signature(&dev), None);
        dev.write_at(&[0x53, 0xef], 1080).unwrap();
        assert_eq!(foreign_signature(&dev), Some("an ext2/3/4 filesystem"));
        let dev = MemDev::new(64 << 20);
        dev.write_at(b"_BHRfS_M", 0x10040).unwrap();
        assert_eq!(foreign_signature(&dev), Some("a btrfs filesystem"));
        // Nor is birchfs one, nor a device too small to hold a signature.
        assert_eq!(foreign_signature(populated().as_ref()), None);
        assert_eq!(foreign_signature(&MemDev::new(16)), None);
        // Which the refusal to check (or mount) it says.
        let dev = MemDev::new(64 << 20);
        dev.write_at(b"XFSB", 0).unwrap();
        let e = check(&dev).unwrap_err().to_string();
        assert!(
            e.contains("no magic") && e.contains("an XFS filesystem"),
            "{e}"
        );
    }

    /// An image cut short is a problem although every node it still holds is whole
    /// (the mount refuses it), and the check still checks what is left.
    #[test]
    fn an_image_cut_short_is_a_problem() {
        let mut img = populated().image();
        img.truncate(img.len() - (8 << 20));
        let rep = check(&MemDev::from_image(img)).unwrap();
        assert!(
            rep.problems.iter().any(|p| p.contains("cut short")),
            "{:#?}",
            rep.problems
        );
        assert!(rep.inodes == 302, "{rep:?}");
    }

    /// After a crash, fsyncs since the last commit sit in the log: the check says so
    /// (it sees the commit without them), and after a mount replayed them, not.
    #[test]
    fn counts_the_log_batches_a_mount_would_replay() {
        let dev = populated();
        let fs = Fs::open(dev.clone(), Options::default()).unwrap();
        assert_eq!(check(dev.as_ref()).unwrap().pending_log_batches, 0);
        for i in 0..3 {
            let f = fs
                .mknod(
                    ROOT_INO,
                    format!("new{i}").as_bytes(),
                    0o644,
                    0,
                    Creds::default(),
                )
                .unwrap();
            fs.write(f.ino, 0, b"fsynced").unwrap();
            fs.fsync(f.ino, false).unwrap();
        }
        let crashed = Arc::new(MemDev::from_image(dev.image()));
        drop(fs);
        let rep = check(crashed.as_ref()).unwrap();
        assert!(rep.problems.is_empty(), "{:#?}", rep.problems);
        assert_eq!(rep.inodes, 302, "the check sees the last commit");
        assert!(rep.pending_log_batches >= 1, "{rep:?}");
        Fs::open(crashed.clone(), Options::default())
            .unwrap()
            .unmount()
            .unwrap();
        let rep = check(crashed.as_ref()).unwrap();
        assert!(rep.problems.is_empty(), "{:#?}", rep.problems);
        assert_eq!((rep.inodes, rep.pending_log_batches), (305, 0));
    }

    #[test]
    fn finds_a_corrupted_node_and_a_corrupted_data_block() {
        let dev = populated();
        let sb = Store::read_super(dev.as_ref()).unwrap();
        let mut img = dev.image();
        // flip a byte in the middle of the root tree's root node
        img[sb.root_tree as usize + 200] ^= 0x40;
        let rep = check(&MemDev::from_image(img)).unwrap();
        assert!(
            rep.problems.iter().any(|p| p.contains("checksum mismatch")),
            "{:#?}",
            rep.problems
        );

        // find a data block through a file extent and flip one bit of it
        let fs = Fs::open(
            dev.clone(),
            Options {
                readonly: true,
                ..Default::default()
            },
        )
        .unwrap();
        let ino = fs.resolve("/d/f7").unwrap().ino;
        let addr = {
            let mut g = fs.inner.lock();
            let (_, v) = g
                .store
                .seek_le(tree::FS, &Key::new(ino, kind::EXTENT_DATA, 0))
                .unwrap()
                .unwrap();
            FileExtent::read_from_bytes(&v).unwrap().disk_bytenr.get()
        };
        drop(fs);
        let mut img = dev.image();
        img[addr as usize + 10] ^= 1;
        let bad = Arc::new(MemDev::from_image(img));
        let rep = check(bad.as_ref()).unwrap();
        assert!(
            rep.problems
                .iter()
                .any(|p| p.contains(&format!("data block {addr:#x}"))),
            "{:#?}",
            rep.problems
        );
        let fs = Fs::open(bad, Options::default()).unwrap();
        let ino = fs.resolve("/d/f7").unwrap().ino;
        assert!(matches!(
            fs.read(ino, 0, 100),
            Err(crate::Error::Corrupt { .. })
        ));
        let other = fs.resolve("/d/f8").unwrap().ino;
        assert_eq!(fs.read(other, 0, 3).unwrap(), vec![8; 3]);
    }

    #[test]
    fn unreadable_images_are_errors_not_reports() {
        assert!(check(&MemDev::new(64 << 20)).is_err());
        let dev = populated();
        let mut img = dev.image();
        let n = img.len();
        for &o in SUPER_OFFSETS
            .iter()
            .filter(|&&o| o as usize + SUPER_SIZE <= n)
        {
            img[o as usize + 50] ^= 1;
        }
        assert!(check(&MemDev::from_image(img)).is_err());
    }
}
