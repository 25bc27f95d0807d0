//! Transactions and commit: the node cache, copy-on-write, delayed-ref processing and
//! the superblock write.
//!
//! ```text
//!   running(N) --commit--> prepare: run delayed refs and root items to a fixed point,
//!                          take the dirty nodes, N+1 starts running [under the fs lock]
//!              --------->  encode and write nodes, flush, write superblocks, flush
//!                                                                   [no lock held]
//!              --------->  unpin extents freed in N                 [under the fs lock]
//! ```
//! Only one commit is in its I/O phase at a time (the caller's commit mutex). Nodes of
//! generation N are never changed after prepare: generation N+1 copies them first, so
//! readers and writers of N+1 run while N's nodes are written.
//!
//! The extent tree changes itself: copying one of its nodes allocates (a new delayed
//! ref) and frees (another). `prepare` runs delayed refs until none is queued; that
//! terminates because a node copied in this generation is edited in place after that.
//!
//! Snapshots: a tree node's refcount is the number of parents (or roots) pointing at
//! it. A snapshot is taken inside `prepare`, once the fs tree is final: its root item
//! names the fs tree's root, which gains a reference. Nothing of the fs tree is dirty
//! after that commit, so the next change copies: a copy of a node with more than one
//! reference adds a reference to each child (or, for a leaf, to each data extent its
//! file extents name) and drops one from the original; a copy of an unshared node just
//! moves its children. Only fs-tree nodes written at or before the newest snapshot's
//! generation can be shared, so a node newer than that is copied without looking its
//! refcount up. Dropping a deleted snapshot is the mirror image (`drop_step`).

use std::collections::BTreeMap;
use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};
use zerocopy::{FromBytes, IntoBytes};

use crate::alloc::Allocator;
use crate::btree::{self, Node, NodeStore, Root};
use crate::dev::BlockDev;
use crate::error::{Error, Result};
use crate::format::{
    decode_node, encode_node, kind, objectid, root_flag, tree, ExtentItem, FileExtent, Key,
    NodeBody, NodeHeader, RootItem, SnapshotItem, SnapshotMeta, Superblock, Timespec,
    DEFAULT_NODE_SIZE, EXTENT_FLAG_DATA, EXTENT_FLAG_TREE, INCOMPAT_BASE, INCOMPAT_CSUM_PIECES,
    INCOMPAT_LARGE_LOG, INCOMPAT_LOG_RING, LOG_MAX, LOG_MAX_PLAIN, LOG_START, LOG_START_HIGH,
    MAX_ITEM_SIZE, MIN_DEVICE_SIZE, SUPER_OFFSETS, SUPER_SIZE,
};
use crate::log::{LogBuffer, LogOp};
use crate::stats::Stats;

/// Nodes kept in the cache before clean ones are dropped, for `usable` bytes of memory
/// (see [`crate::cache::usable_memory`]): a sixteenth of it, from 256 to 32,768 nodes.
fn cache_nodes(usable: u64, node_size: u32) -> usize {
    (usable / 16 / u64::from(node_size.max(4096))).clamp(256, 32768) as usize
}

/// Snapshot tree ids stay below this (they are part of inode numbers seen through FUSE).
pub(crate) const MAX_SNAPSHOT_ID: u64 = 1 << 23;

/// The trees, the node cache and the allocator of one mounted filesystem.
pub(crate) struct Store {
    pub(crate) dev: Arc<dyn BlockDev>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) sb: Superblock,
    /// Generation of the running transaction.
    pub(crate) generation: u64,
    cache: FxHashMap<u64, Arc<Node>>,
    /// Nodes `cache` holds before clean leaves are dropped.
    cache_cap: usize,
    /// Nodes written in the running generation (a hash set: `cow_node` asks it on
    /// every level of every change; the commit sorts them).
    dirty: FxHashSet<u64>,
    pub(crate) alloc: Allocator,
    refs: crate::refs::DelayedRefs,
    roots: BTreeMap<u64, Root>,
    written_roots: BTreeMap<u64, Root>,
    pub(crate) bytes_used: u64,
    /// The newest durable superblock: clean nodes of its generation or older may be
    /// dropped, and a grow writes it to the superblock copies the new size brings in.
    durable_sb: Superblock,
    pub(crate) readonly: bool,
    /// Changes of the running transaction, for fsync (see `log`).
    pub(crate) log: LogBuffer,
    /// Set when a commit failed: the trees in memory are ahead of the disk for good.
    pub(crate) failed: bool,
    /// A prepared commit whose nodes the device refused for want of space (a full
    /// host under a sparse image), and when: the disk still holds the commit before
    /// it, and the next commit writes these nodes with its own (see
    /// [`CommitBatch::absorb`]).
    pub(crate) unwritten: Option<(CommitBatch, std::time::Instant)>,
    /// The next commit writes a superblock even if nothing else changed.
    pub(crate) must_commit: bool,
    /// Live snapshots by tree id.
    pub(crate) snapshots: BTreeMap<u64, SnapshotItem>,
    /// Names of snapshots the next commit takes.
    pending_snapshots: Vec<Vec<u8>>,
    /// Deleted snapshots still being dropped: root and drop progress (every key below
    /// it has been dropped).
    dead: BTreeMap<u64, (Root, Key)>,
    /// Tree id the next snapshot gets.
    next_snapshot_id: u64,
    /// Generation of the newest snapshot: fs-tree nodes of this generation or older
    /// may be shared, newer ones never are.
    last_snapshot: u64,
}

/// What a prepared commit writes, produced under the lock and written without it.
pub(crate) struct CommitBatch {
    /// The dirty nodes by address, encoded only when written (outside the fs lock):
    /// generation N+1 copies a node before changing it, so these stay as they are.
    nodes: Vec<(u64, Arc<Node>)>,
    fsid: [u8; 16],
    node_size: usize,
    supers: Vec<(u64, Vec<u8>)>,
    pinned: Vec<(u64, u64)>,
    /// The superblock it writes.
    sb: Superblock,
    /// The batch that closes the committed generation's log, to write before any
    /// batch of the next (see `LogBuffer::commit_started`).
    pub(crate) closing: Option<crate::log::Batch>,
}

impl CommitBatch {
    /// The extents this commit frees, released once it is durable.
    pub(crate) fn pinned(&self) -> &[(u64, u64)] {
        &self.pinned
    }

    /// Takes in `earlier`, a commit prepared before this one that never reached the
    /// disk: its nodes are written first, and what it freed is released with this
    /// one. Sound because nothing `earlier` wrote or freed was handed out since (a
    /// node it wrote and this commit copied again is pinned until this one is
    /// durable, so rewriting it harms nothing), and this commit's trees may still
    /// point at its nodes.
    pub(crate) fn absorb(&mut self, earlier: CommitBatch) {
        let mut nodes = earlier.nodes;
        nodes.append(&mut self.nodes);
        self.nodes = nodes;
        self.pinned.extend(earlier.pinned);
    }
}

/// A commit that failed: why, and whether the disk still holds the commit before it
/// untouched by a flush, so that writing it again later is sound.
#[derive(Debug)]
pub(crate) struct CommitFailure {
    /// The device's error.
    pub(crate) error: Error,
    /// The device refused a node write for want of space before anything was
    /// flushed: the nodes (kept in memory) can be written again once there is room.
    /// After a failed flush nothing may be retried: the host may have dropped what
    /// it failed to write (its page cache marks such pages clean).
    pub(crate) retryable: bool,
}

fn random_fsid() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut id);
    }
    if id == [0; 16] {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(1);
        id = (t ^ std::process::id() as u128).to_le_bytes();
    }
    id
}

/// The log area (start, length) of `len` bytes that mkfs asks for on a device of
/// `size` bytes, or why it cannot be: whole blocks, 1 MiB to [`LOG_MAX`], below the
/// second superblock copy when it fits there, and at most half the device.
pub fn log_area_sized(size: u64, len: u64) -> Result<(u64, u64)> {
    if len % 4096 != 0 || !(1 << 20..=LOG_MAX).contains(&len) {
        return Err(Error::Invalid(
            "log size must be whole 4 KiB blocks from 1 MiB to 512 MiB",
        ));
    }
    let start = if len <= SUPER_OFFSETS[1] - LOG_START {
        LOG_START
    } else {
        LOG_START_HIGH
    };
    if start + len > size / 2 {
        return Err(Error::Invalid(
            "log area would take more than half the device",
        ));
    }
    Ok((start, len))
}

/// The log area (start, length): 1/16 of the device. From 2 MiB to 62 MiB it fits
/// between [`LOG_START`] and the second superblock copy (64 MiB); on devices of 2 GiB
/// and more it is 128 MiB to [`LOG_MAX`] and starts past that copy, leaving the 63 MiB
/// before it unused (at most 3% of the device). A commit starts when one
/// generation's batches leave less than [`crate::log::COMMIT_HEADROOM`] of the log
/// (or a quarter of a small one), so a larger log means fewer commits under a stream
/// of fsyncs: each commit rewrites every tree node changed since the last, which for
/// random overwrites is nearly every leaf of the file trees (W3 on an 8 GiB image,
/// 30 s: with a 62 MiB log a commit every 2 s and 43% of the bytes written were tree
/// nodes; with 256 MiB, 8% and 5% more throughput; with 512 MiB over io_uring, 3
/// full commits in 30 s instead of 6 and 0.12 bytes of tree nodes per byte fio wrote
/// instead of 0.15, medians of 7 rounds, at no gain in throughput).
fn log_area_for(size: u64) -> (u64, u64) {
    let len = (size / 16) & !4095;
    if len >= 128 << 20 {
        (LOG_START_HIGH, len.min(LOG_MAX))
    } else {
        (LOG_START, len.clamp(1 << 20, 62 << 20))
    }
}

/// Bytes a leaf spends on an item besides its value: key and length.
const ITEM_OVERHEAD: usize = 17 + 4;

/// Largest item value nodes of `node_size` bytes take (see [`Store::max_item_size`]).
pub(crate) fn max_item_size(node_size: u32) -> usize {
    ((node_size as usize).saturating_sub(crate::format::NODE_HEADER_SIZE) / 2)
        .saturating_sub(ITEM_OVERHEAD)
        .min(MAX_ITEM_SIZE)
}

fn reserve_for(size: u64) -> u64 {
    (size / 32).clamp(4 << 20, 256 << 20)
}

/// The superblock copies within a filesystem of `size` bytes: (address, length).
pub(crate) fn super_holes(size: u64) -> Vec<(u64, u64)> {
    SUPER_OFFSETS
        .iter()
        .filter(|&&o| o + SUPER_SIZE as u64 <= size)
        .map(|&o| (o, SUPER_SIZE as u64))
        .collect()
}

/// Whether `[start, start + len)` lies within `[lo, hi)` and off every `(at, len)`
/// of `holes`.
pub(crate) fn in_range(start: u64, len: u64, lo: u64, hi: u64, holes: &[(u64, u64)]) -> bool {
    start >= lo
        && start
            .checked_add(len)
            .is_some_and(|e| e <= hi && holes.iter().all(|&(h, hl)| e <= h || start >= h + hl))
}

impl Store {
    /// Whether `[addr, addr + len)` lies where this filesystem keeps data and tree
    /// nodes: past the log area, within its size, off its superblock copies.
    pub(crate) fn in_data_area(&self, addr: u64, len: u64) -> bool {
        let size = self.sb.total_bytes;
        let lo = self.sb.log_start + self.sb.log_len;
        in_range(addr, len, lo, size, &super_holes(size))
    }

    /// A new, empty filesystem on `dev` (mkfs); the caller fills the fs tree and commits.
    pub(crate) fn create(
        dev: Arc<dyn BlockDev>,
        node_size: Option<u32>,
        log_size: Option<u64>,
    ) -> Result<Store> {
        let size = dev.size() & !4095;
        if size < MIN_DEVICE_SIZE {
            return Err(Error::Invalid("device smaller than 32 MiB"));
        }
        let (log_start, log_len) = match log_size {
            Some(len) => log_area_sized(size, len)?,
            None => log_area_for(size),
        };
        let node_size = node_size.unwrap_or(DEFAULT_NODE_SIZE);
        if !node_size.is_power_of_two() || !(4096..=65536).contains(&node_size) {
            return Err(Error::Invalid(
                "node size must be a power of two from 4K to 64K",
            ));
        }
        let large_log = if log_len > LOG_MAX_PLAIN {
            INCOMPAT_LARGE_LOG
        } else {
            0
        };
        let sb = Superblock {
            incompat: INCOMPAT_BASE | INCOMPAT_LOG_RING | INCOMPAT_CSUM_PIECES | large_log,
            compat: 0,
            fsid: random_fsid(),
            generation: 0,
            total_bytes: size,
            block_size: 4096,
            node_size,
            root_tree: 0,
            root_level: 0,
            log_start,
            log_len,
            bytes_used: 0,
            log_head: 0,
        };
        let alloc = Allocator::new(
            log_start + log_len,
            size,
            &super_holes(size),
            reserve_for(size),
        );
        // Zeros over the first MiB (birchfs's superblock there is written at the
        // commit) and the last, as wipefs would: no signature of another filesystem,
        // volume or partition table outlives mkfs, where blkid, udev or mount would
        // find it and take the device for that (an ext4 superblock at 1080 did).
        crate::dev::write_zeros(dev.as_ref(), 0, LOG_START)?;
        crate::dev::write_zeros(dev.as_ref(), size - (1 << 20), 1 << 20)?;
        // Zeros over the log area, as mkfs.ext4 writes its journal: on a sparse image (or
        // a loop device over one) each fsync's log append would otherwise land in a hole,
        // and the host would allocate the block and commit its own journal before the
        // fsync's flush returned (W4: fsync p50 ~490 µs with holes, ~230 µs without).
        crate::dev::write_zeros(dev.as_ref(), log_start, log_len)?;
        let mut s = Store::with(dev, sb, alloc, 1);
        for id in [tree::ROOT, tree::EXTENT, tree::CSUM, tree::FS] {
            let addr = s.new_node(id, 0, NodeBody::Leaf(Vec::new()))?;
            s.roots.insert(
                id,
                Root {
                    addr,
                    level: 0,
                    owner: id,
                },
            );
        }
        Ok(s)
    }

    fn with(dev: Arc<dyn BlockDev>, sb: Superblock, alloc: Allocator, generation: u64) -> Store {
        let cache_cap = cache_nodes(crate::cache::usable_memory(), sb.node_size);
        Store {
            dev,
            stats: Arc::new(Stats::default()),
            bytes_used: sb.bytes_used,
            durable_sb: sb.clone(),
            sb,
            generation,
            cache_cap,
            cache: FxHashMap::default(),
            dirty: FxHashSet::default(),
            alloc,
            refs: Default::default(),
            roots: BTreeMap::new(),
            written_roots: BTreeMap::new(),
            readonly: false,
            log: LogBuffer::new(0, 0),
            failed: false,
            unwritten: None,
            must_commit: false,
            snapshots: BTreeMap::new(),
            pending_snapshots: Vec::new(),
            dead: BTreeMap::new(),
            next_snapshot_id: objectid::FIRST_SNAPSHOT,
            last_snapshot: 0,
        }
    }

    /// Takes in the device's bytes up to `size` (it grew, or was larger than the
    /// filesystem): they are free from now on, and the next commit writes the
    /// superblock copies that now fit. `size` is rounded down to a block.
    pub(crate) fn grow(&mut self, size: u64) -> Result<()> {
        self.writable()?;
        let size = size & !4095;
        let old = self.sb.total_bytes;
        if size <= old {
            return Err(Error::Invalid("a filesystem only grows"));
        }
        if size > self.dev.size() {
            return Err(Error::Invalid(
                "the device is smaller than the size asked for",
            ));
        }
        // The copies the new size brings in get the last durable commit's superblock
        // first, and are flushed: a power cut in the grow's commit may land its first
        // copy (the new size) without these, and every copy within a size must be
        // valid. (`self.sb` may be a commit the host refused, which names nodes that
        // never reached the disk.)
        for (off, _) in super_holes(size).into_iter().filter(|&(o, _)| o >= old) {
            self.dev.write_at(&self.durable_sb.encode(off), off)?;
        }
        self.dev.flush()?;
        self.alloc
            .grow(old, size, &super_holes(size), reserve_for(size));
        self.sb.total_bytes = size;
        self.must_commit = true;
        Ok(())
    }

    /// Reads the newest valid superblock of `dev`.
    pub(crate) fn read_super(dev: &dyn BlockDev) -> Result<Superblock> {
        let size = dev.size();
        let mut best: Option<Superblock> = None;
        let mut first_err = None;
        for &off in SUPER_OFFSETS
            .iter()
            .filter(|&&o| o + SUPER_SIZE as u64 <= size)
        {
            let mut buf = vec![0u8; SUPER_SIZE];
            dev.read_at(&mut buf, off)?;
            match Superblock::decode(&buf, off) {
                Ok(sb) if best.as_ref().is_none_or(|b| sb.generation > b.generation) => {
                    best = Some(sb)
                }
                Ok(_) => {}
                Err(e) => {
                    if let Error::Corrupt { .. } = e {
                        tracing::warn!("superblock copy at {off:#x}: {e}");
                    }
                    first_err.get_or_insert(e);
                }
            }
        }
        match (best, first_err) {
            (Some(sb), _) => Ok(sb),
            (None, Some(Error::BadImage(m))) => Err(Error::BadImage(
                match crate::check::foreign_signature(dev) {
                    Some(what) if !crate::check::has_birchfs_magic(dev) => {
                        format!("{m}; it appears to hold {what}")
                    }
                    _ => m,
                },
            )),
            (None, Some(e)) => Err(Error::BadImage(format!("no valid superblock: {e}"))),
            (None, None) => Err(Error::BadImage("device too small for birchfs".into())),
        }
    }

    /// Opens the filesystem on `dev` as of its last commit.
    pub(crate) fn open(dev: Arc<dyn BlockDev>, readonly: bool) -> Result<Store> {
        let sb = Store::read_super(dev.as_ref())?;
        if sb.total_bytes > dev.size() {
            return Err(Error::BadImage(format!(
                "image is {} bytes but its superblock says {} (cut short?); \
                 `birchfs restore` copies out what is left",
                dev.size(),
                sb.total_bytes
            )));
        }
        let size = sb.total_bytes;
        let alloc = Allocator::new(
            sb.log_start + sb.log_len,
            size,
            &super_holes(size),
            reserve_for(size),
        );
        let gen = sb.generation + 1;
        let mut s = Store::with(dev, sb.clone(), alloc, gen);
        s.readonly = readonly;
        s.log = LogBuffer::new(sb.log_len, sb.log_head);
        let root = Root {
            addr: sb.root_tree,
            level: sb.root_level,
            owner: tree::ROOT,
        };
        s.roots.insert(tree::ROOT, root);
        s.written_roots.insert(tree::ROOT, root);
        let items = btree::range(
            &mut s,
            &root,
            &Key::new(0, kind::ROOT_ITEM, 0),
            &Key::MAX,
            usize::MAX,
        )?;
        for (k, v) in items {
            match k.ty {
                kind::ROOT_ITEM => {
                    let ri = RootItem::read_from_bytes(&v)
                        .map_err(|_| Error::corrupt("root item", root.addr, "bad size"))?;
                    // Snapshot trees hold the fs tree's nodes: their owner is the fs tree.
                    let owner = if k.objectid >= objectid::FIRST_SNAPSHOT {
                        tree::FS
                    } else {
                        k.objectid
                    };
                    let r = Root {
                        addr: ri.bytenr.get(),
                        level: ri.level,
                        owner,
                    };
                    if ri.flags.get() & root_flag::DEAD != 0 {
                        s.dead.insert(k.objectid, (r, Key::MIN));
                    } else {
                        s.roots.insert(k.objectid, r);
                        s.written_roots.insert(k.objectid, r);
                    }
                }
                kind::DROP_PROGRESS => {
                    let key = Key::decode(&mut crate::format::Reader::new(&v))
                        .ok_or_else(|| Error::corrupt("drop progress", root.addr, "bad size"))?;
                    if let Some(d) = s.dead.get_mut(&k.objectid) {
                        d.1 = key;
                    }
                }
                kind::SNAPSHOT_META => {
                    let m = SnapshotMeta::read_from_bytes(&v)
                        .map_err(|_| Error::corrupt("snapshot meta", root.addr, "bad size"))?;
                    s.next_snapshot_id = m.next_id.get().max(objectid::FIRST_SNAPSHOT);
                    s.last_snapshot = m.last_snapshot.get();
                }
                kind::SNAPSHOT => {
                    let si = SnapshotItem::decode(&v)
                        .ok_or_else(|| Error::corrupt("snapshot item", root.addr, "malformed"))?;
                    if !(objectid::FIRST_SNAPSHOT..MAX_SNAPSHOT_ID).contains(&k.offset) {
                        return Err(Error::corrupt(
                            "snapshot item",
                            root.addr,
                            format!("tree id {} out of range", k.offset),
                        ));
                    }
                    s.snapshots.insert(k.offset, si);
                }
                _ => {}
            }
        }
        s.check_snapshot_books(root.addr)?;
        for id in [tree::EXTENT, tree::CSUM, tree::FS] {
            if !s.roots.contains_key(&id) {
                return Err(Error::corrupt(
                    "root tree",
                    root.addr,
                    format!("tree {id} missing"),
                ));
            }
        }
        let mut start = Key::MIN;
        loop {
            let batch = s.range(tree::EXTENT, &start, &Key::MAX, 4096)?;
            let Some(last) = batch.last() else { break };
            start = Key::new(last.0.objectid, last.0.ty, last.0.offset.saturating_add(1));
            for (k, _) in &batch {
                if k.ty == kind::EXTENT_ITEM {
                    s.alloc.mark_used(k.objectid, k.offset);
                }
            }
        }
        s.evict_clean();
        Ok(s)
    }

    /// Bytes of the data area (what statfs calls the size of the filesystem).
    pub(crate) fn data_bytes(&self) -> u64 {
        self.sb.total_bytes - self.sb.log_start - self.sb.log_len
    }

    pub(crate) fn root(&self, id: u64) -> Root {
        self.roots[&id]
    }

    /// The root of tree `id` for a read: ENOENT for a tree that is not there (a
    /// snapshot deleted while its files were still in use).
    fn read_root(&self, id: u64) -> Result<Root> {
        self.roots.get(&id).copied().ok_or(Error::NotFound)
    }

    pub(crate) fn search(&mut self, id: u64, key: &Key) -> Result<Option<Vec<u8>>> {
        let r = self.read_root(id)?;
        btree::search(self, &r, key)
    }

    pub(crate) fn range(
        &mut self,
        id: u64,
        start: &Key,
        end: &Key,
        limit: usize,
    ) -> Result<Vec<(Key, Vec<u8>)>> {
        let r = self.read_root(id)?;
        btree::range(self, &r, start, end, limit)
    }

    pub(crate) fn seek_le(&mut self, id: u64, key: &Key) -> Result<Option<(Key, Vec<u8>)>> {
        let r = self.read_root(id)?;
        btree::seek_le(self, &r, key)
    }

    pub(crate) fn insert(&mut self, id: u64, key: Key, val: Vec<u8>) -> Result<()> {
        self.writable()?;
        // Callers refuse larger values with their own errors; a node could not hold
        // one, and its commit would fail.
        if val.len() > self.max_item_size() {
            return Err(Error::Invalid("item larger than a tree node holds"));
        }
        let logged = (id == tree::FS || id == tree::CSUM).then(|| LogOp::Insert {
            tree: id,
            key,
            val: val.clone(),
        });
        let mut r = self.root(id);
        let res = btree::insert(self, &mut r, key, val);
        self.roots.insert(id, r);
        self.tree_changed(res, logged)
    }

    pub(crate) fn delete(&mut self, id: u64, key: &Key) -> Result<bool> {
        self.writable()?;
        let logged = (id == tree::FS || id == tree::CSUM).then_some(LogOp::Delete {
            tree: id,
            key: *key,
        });
        let mut r = self.root(id);
        let res = btree::delete(self, &mut r, key);
        self.roots.insert(id, r);
        self.tree_changed(res, logged)
    }

    /// Logs `op` after its tree change succeeded. A change that failed (a node that
    /// would not read, no room for a copy) may have stopped halfway, with copies
    /// queued that its tree does not point at and the operation it was part of half
    /// done, so changes stop until the next mount, as after a failed commit: a commit
    /// would free nodes the tree still names.
    fn tree_changed<T>(&mut self, res: Result<T>, op: Option<LogOp>) -> Result<T> {
        match res {
            Ok(v) => {
                if let Some(op) = op {
                    self.log.record(op);
                }
                Ok(v)
            }
            Err(e) => {
                tracing::error!("a tree change failed ({e}): changes stop until the next mount");
                self.failed = true;
                self.log.overflow = true;
                Err(e)
            }
        }
    }

    /// Marks the image as using incompatible feature `flag`. The first time, the next
    /// fsync commits instead of logging: a build that does not know the feature must
    /// never find what needs it in a log it replays, and the commit's superblock
    /// carries the flag that such a build refuses.
    pub(crate) fn use_feature(&mut self, flag: u64) {
        if self.sb.incompat & flag == 0 {
            self.sb.incompat |= flag;
            self.log.overflow = true;
        }
    }

    pub(crate) fn writable(&self) -> Result<()> {
        if self.readonly {
            return Err(Error::ReadOnly);
        }
        if self.failed {
            return Err(Error::stopped());
        }
        Ok(())
    }

    /// Allocates data space (not from the reserve) and counts the extent's first ref.
    pub(crate) fn alloc_data(&mut self, len: u64) -> Result<(u64, u64)> {
        self.writable()?;
        self.alloc.alloc(len, 4096, false)
    }

    /// Queues a refcount change of a data extent.
    pub(crate) fn data_ref(&mut self, bytenr: u64, len: u64, delta: i64) {
        self.log.record(LogOp::DataRef { bytenr, len, delta });
        self.refs.add(bytenr, len, EXTENT_FLAG_DATA, delta);
    }

    /// Whether the running transaction changed anything.
    pub(crate) fn has_changes(&self) -> bool {
        self.must_commit
            || !self.dirty.is_empty()
            || !self.refs.is_empty()
            || self.roots != self.written_roots
            || !self.pending_snapshots.is_empty()
    }

    /// Number of nodes dirtied in the running transaction.
    pub(crate) fn dirty_nodes(&self) -> usize {
        self.dirty.len()
    }

    fn run_delayed_refs(&mut self) -> Result<()> {
        while !self.refs.is_empty() {
            for h in self.refs.take() {
                self.run_ref_head(h)?;
            }
        }
        Ok(())
    }

    /// Runs the `n` queued refcount changes of lowest address ahead of the commit, so
    /// that the commit (which holds the fs lock while it runs the rest) stays short,
    /// as btrfs runs delayed refs when too many are queued. Like the commit's, these
    /// changes are not logged: replay rebuilds them from the logged data references.
    /// An error leaves the trees half changed: nothing more may be done.
    pub(crate) fn run_some_delayed_refs(&mut self, n: usize) -> Result<()> {
        let heads = self.refs.take_first(n);
        self.unlogged("running delayed refs", |s| {
            heads.into_iter().try_for_each(|h| s.run_ref_head(h))
        })
    }

    /// Runs commit work `f` with logging off (replay rebuilds what it changes from the
    /// logged records). An error leaves delayed refs and snapshots half applied in
    /// memory: nothing may build on that (a snapshot's root could even be changed in
    /// place), so the store refuses further changes.
    fn unlogged(&mut self, what: &str, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        let logging = std::mem::replace(&mut self.log.enabled, false);
        let r = f(self);
        self.log.enabled = logging;
        if let Err(e) = &r {
            tracing::error!("{what} failed, refusing further changes: {e}");
            self.failed = true;
        }
        r
    }

    /// Largest item this filesystem's nodes take: two must fit in one node (so a split
    /// always succeeds), and never more than `MAX_ITEM_SIZE`.
    pub(crate) fn max_item_size(&self) -> usize {
        max_item_size(self.sb.node_size)
    }

    /// Whether the running transaction should be committed now, to give back the
    /// space it pins before the next change: free space is inside the reserve and
    /// no longer covers, twice over, what its commit may copy (a node for each dirty
    /// node and for each queued refcount change, at worst) plus the margin the next
    /// operation needs.
    pub(crate) fn short_of_room(&self) -> bool {
        if !self.alloc.in_reserve() || !self.has_changes() || self.readonly || self.failed {
            return false;
        }
        let ns = self.sb.node_size as u64;
        let pending = (self.dirty.len() as u64 + self.refs.len() as u64).saturating_mul(ns);
        self.alloc.free_bytes()
            < pending
                .saturating_add(self.alloc.op_margin())
                .saturating_mul(2)
    }

    /// Bytes of data extents whose last reference a queued refcount change drops:
    /// space the next commit frees (an `rm` since the last one). That takes in
    /// extents written since the last commit and dropped again (no extent item,
    /// a net change of zero). Reads the extent tree only; an extent it cannot read
    /// counts nothing.
    pub(crate) fn data_freed_by_queued_refs(&mut self) -> u64 {
        let drops: Vec<(u64, u64, i64)> = self
            .refs
            .iter()
            .filter(|h| h.delta <= 0 && h.flags & EXTENT_FLAG_DATA != 0)
            .map(|h| (h.bytenr, h.len, h.delta))
            .collect();
        let mut bytes = 0;
        for (bytenr, len, delta) in drops {
            let refs = match self.extent_item(bytenr, len) {
                Ok(Some(e)) => e.refs.get() as i64,
                Ok(None) => 0,
                Err(_) => i64::MAX,
            };
            if refs.saturating_add(delta) <= 0 {
                bytes += len;
            }
        }
        bytes
    }

    /// Number of refcount changes queued.
    pub(crate) fn queued_refs(&self) -> usize {
        self.refs.len()
    }

    /// The extent item of the extent `len` bytes long at `bytenr`, if it has one.
    fn extent_item(&mut self, bytenr: u64, len: u64) -> Result<Option<ExtentItem>> {
        let key = Key::new(bytenr, kind::EXTENT_ITEM, len);
        self.search(tree::EXTENT, &key)?
            .map(|v| {
                ExtentItem::read_from_bytes(&v)
                    .map_err(|_| Error::corrupt("extent item", bytenr, "bad size"))
            })
            .transpose()
    }

    /// Applies one queued refcount change to the extent tree.
    fn run_ref_head(&mut self, h: crate::refs::DelayedRefHead) -> Result<()> {
        let key = Key::new(h.bytenr, kind::EXTENT_ITEM, h.len);
        let old = self.extent_item(h.bytenr, h.len)?;
        let old_refs = old.map(|o| o.refs.get() as i64).unwrap_or(0);
        let Some(new_refs) = old_refs.checked_add(h.delta).filter(|_| old_refs >= 0) else {
            return Err(Error::corrupt(
                "extent item",
                h.bytenr,
                format!("refcount {} out of range", old.map_or(0, |o| o.refs.get())),
            ));
        };
        if new_refs < 0 {
            return Err(Error::corrupt(
                "extent item",
                h.bytenr,
                format!("refcount would drop below zero ({old_refs} {:+})", h.delta),
            ));
        }
        if new_refs == 0 {
            if old.is_some() {
                self.delete(tree::EXTENT, &key)?;
                // (A damaged superblock may count less than its extents hold.)
                self.bytes_used = self.bytes_used.saturating_sub(h.len);
            }
            if h.flags & EXTENT_FLAG_DATA != 0 {
                // One checksum item for the extent, or one per piece of a
                // preallocated extent written in place.
                let from = Key::new(objectid::CSUM, kind::EXTENT_CSUM, h.bytenr);
                let to = Key::new(
                    objectid::CSUM,
                    kind::EXTENT_CSUM,
                    h.bytenr.saturating_add(h.len),
                );
                loop {
                    let items = self.range(tree::CSUM, &from, &to, 64)?;
                    if items.is_empty() {
                        break;
                    }
                    for (k, _) in items {
                        self.delete(tree::CSUM, &k)?;
                    }
                }
            }
            self.alloc.pin(h.bytenr, h.len);
        } else if new_refs != old_refs {
            let item = ExtentItem {
                refs: (new_refs as u64).into(),
                flags: h.flags.into(),
                generation: old
                    .map(|o| o.generation.get())
                    .unwrap_or(self.generation)
                    .into(),
            };
            if old.is_none() {
                self.bytes_used = self.bytes_used.saturating_add(h.len);
            }
            self.insert(tree::EXTENT, key, item.as_bytes().to_vec())?;
        }
        Ok(())
    }

    /// Runs delayed refs and root-item updates until neither queues anything new.
    fn settle_trees(&mut self) -> Result<()> {
        loop {
            self.run_delayed_refs()?;
            let changed: Vec<(u64, Root)> = self
                .roots
                .iter()
                .filter(|(id, r)| **id != tree::ROOT && self.written_roots.get(id) != Some(r))
                .map(|(id, r)| (*id, *r))
                .collect();
            if changed.is_empty() && self.refs.is_empty() {
                return Ok(());
            }
            for (id, r) in changed {
                self.put_root_item(id, r, self.root_flags(id))?;
                self.written_roots.insert(id, r);
            }
        }
    }

    /// Prepares the commit of the running transaction: settles the trees, encodes
    /// every dirty node and the superblocks, and starts the next generation; with
    /// `chain`, the next generation's log batches may go out before this commit lands
    /// (see `LogBuffer::commit_started`).
    pub(crate) fn prepare_commit(&mut self, chain: bool) -> Result<CommitBatch> {
        self.writable()?;
        let fsid = self.sb.fsid;
        let closing = self.log.commit_started(&fsid, self.generation, chain);
        // What commit itself changes (freed checksums, root items) is not logged.
        self.unlogged("settling the trees for a commit", |s| {
            s.settle_trees()
                .and_then(|_| s.take_snapshots())
                .and_then(|_| s.settle_trees())
        })?;
        self.must_commit = false;
        let root = self.root(tree::ROOT);
        self.written_roots.insert(tree::ROOT, root);
        let mut addrs: Vec<u64> = std::mem::take(&mut self.dirty).into_iter().collect();
        // In address order, so that `write_commit` joins neighbours into one write.
        addrs.sort_unstable();
        let nodes: Vec<(u64, Arc<Node>)> = addrs
            .into_iter()
            .map(|addr| (addr, self.cache[&addr].clone()))
            .collect();
        self.sb.generation = self.generation;
        self.sb.root_tree = root.addr;
        self.sb.root_level = root.level;
        self.sb.bytes_used = self.bytes_used;
        self.sb.log_head = self.log.head_offset();
        self.sb.incompat |= INCOMPAT_LOG_RING | INCOMPAT_CSUM_PIECES;
        let supers = super_holes(self.sb.total_bytes)
            .into_iter()
            .map(|(off, _)| (off, self.sb.encode(off)))
            .collect();
        self.generation += 1;
        Ok(CommitBatch {
            nodes,
            fsid,
            node_size: self.sb.node_size as usize,
            supers,
            pinned: self.alloc.take_pinned(),
            sb: self.sb.clone(),
            closing,
        })
    }

    /// Writes a prepared commit: nodes, flush, superblocks, flush. No lock is held.
    pub(crate) fn write_commit(
        dev: &dyn BlockDev,
        stats: &Stats,
        batch: &CommitBatch,
    ) -> std::result::Result<(), CommitFailure> {
        // Coalesce nodes at consecutive addresses into one write; the device gets
        // them all at once.
        let mut runs: Vec<(u64, crate::dev::AlignedBuf)> = Vec::new();
        for (addr, n) in &batch.nodes {
            let node = &encode_node(&n.hdr, n.body(), &batch.fsid, batch.node_size);
            match runs.last_mut() {
                Some((start, buf))
                    if *start + buf.len() as u64 == *addr && buf.len() < (1 << 20) =>
                {
                    buf.extend_from_slice(node)
                }
                _ => {
                    let mut buf = crate::dev::AlignedBuf::default();
                    buf.extend_from_slice(node);
                    runs.push((*addr, buf));
                }
            }
        }
        let writes: Vec<(&[u8], u64)> = runs.iter().map(|(a, b)| (&b[..], *a)).collect();
        let fatal = |e: std::io::Error| CommitFailure {
            error: e.into(),
            retryable: false,
        };
        dev.write_many(&writes).map_err(|e| CommitFailure {
            retryable: matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)),
            error: e.into(),
        })?;
        let bytes: usize = runs.iter().map(|(_, b)| b.len()).sum();
        Stats::add(&stats.dev_meta_bytes, bytes as u64);
        dev.flush().map_err(fatal)?;
        for (off, buf) in &batch.supers {
            dev.write_at(buf, *off).map_err(fatal)?;
            Stats::add(&stats.dev_super_bytes, buf.len() as u64);
        }
        dev.flush().map_err(fatal)?;
        Stats::add(&stats.flushes, 2);
        Stats::add(&stats.commits, 1);
        Ok(())
    }

    /// Writes one log batch (no flush). No lock is held.
    pub(crate) fn write_log(
        dev: &dyn BlockDev,
        stats: &Stats,
        log_start: u64,
        batch: &crate::log::Batch,
    ) -> Result<()> {
        dev.write_at(&batch.buf, log_start + batch.offset)?;
        Stats::add(&stats.dev_log_bytes, batch.buf.len() as u64);
        Stats::add(&stats.log_commits, 1);
        Ok(())
    }

    /// Releases what the durable commit freed. Called under the fs lock.
    pub(crate) fn finish_commit(&mut self, batch: CommitBatch) {
        self.alloc.unpin(batch.pinned);
        self.durable_sb = batch.sb;
        self.log.commit_done();
        self.evict_clean();
    }

    /// Refuses snapshot bookkeeping that would let shared nodes be changed in place or
    /// ids be given twice (a damaged or hostile image).
    fn check_snapshot_books(&self, at: u64) -> Result<()> {
        let bad = |why: String| Err(Error::corrupt("root tree", at, why));
        if let Some(id) = self
            .snapshots
            .keys()
            .find(|id| !self.roots.contains_key(id))
        {
            return bad(format!("snapshot {id} has no root"));
        }
        let trees: Vec<u64> = self
            .roots
            .keys()
            .chain(self.dead.keys())
            .copied()
            .filter(|&id| id >= objectid::FIRST_SNAPSHOT)
            .collect();
        if let Some(&id) = trees
            .iter()
            .find(|&&id| !self.snapshots.contains_key(&id) && !self.dead.contains_key(&id))
        {
            return bad(format!("tree {id} is neither a snapshot nor deleted"));
        }
        if let Some(&id) = trees
            .iter()
            .find(|&&id| id >= self.next_snapshot_id || id >= MAX_SNAPSHOT_ID)
        {
            return bad(format!(
                "snapshot tree {id} at or past the next id {}",
                self.next_snapshot_id
            ));
        }
        if self.next_snapshot_id > MAX_SNAPSHOT_ID {
            return bad(format!(
                "next snapshot id {} too large",
                self.next_snapshot_id
            ));
        }
        if let Some((id, _)) = self
            .snapshots
            .iter()
            .find(|(_, s)| s.generation > self.last_snapshot)
        {
            return bad(format!(
                "snapshot {id} is newer than the last snapshot generation"
            ));
        }
        Ok(())
    }

    /// References a tree node has, counting changes queued in this transaction.
    fn node_refs(&mut self, addr: u64) -> Result<i64> {
        let ns = self.sb.node_size as u64;
        let base = self
            .extent_item(addr, ns)?
            .map_or(0, |e| e.refs.get() as i64);
        Ok(base + self.refs.find(addr).map_or(0, |h| h.delta))
    }

    /// Queues `delta` on every data extent the file extents of leaf `n` point at.
    fn leaf_data_refs(&mut self, n: &Node, delta: i64) {
        let NodeBody::Leaf(items) = n.body() else {
            return;
        };
        for (k, v) in items {
            if k.ty != kind::EXTENT_DATA {
                continue;
            }
            if let Ok(fe) = FileExtent::read_from_bytes(v) {
                if fe.disk_bytenr.get() != 0 {
                    self.refs.add(
                        fe.disk_bytenr.get(),
                        fe.disk_len.get(),
                        EXTENT_FLAG_DATA,
                        delta,
                    );
                }
            }
        }
    }

    /// Writes the ROOT_ITEM of tree `id`.
    fn put_root_item(&mut self, id: u64, r: Root, flags: u64) -> Result<()> {
        let gen = self.read_node(r.addr)?.hdr.generation;
        let item = RootItem {
            bytenr: r.addr.into(),
            generation: gen.into(),
            level: r.level,
            pad: [0; 7],
            flags: flags.into(),
        };
        self.insert(
            tree::ROOT,
            Key::new(id, kind::ROOT_ITEM, 0),
            item.as_bytes().to_vec(),
        )
    }

    fn root_flags(&self, id: u64) -> u64 {
        if self.snapshots.contains_key(&id) {
            root_flag::RDONLY
        } else {
            0
        }
    }

    /// Whether `name` is a snapshot, taken or about to be.
    pub(crate) fn snapshot_exists(&self, name: &[u8]) -> bool {
        self.pending_snapshots.iter().any(|n| n == name)
            || self.snapshots.values().any(|s| s.name == name)
    }

    /// The tree id of the snapshot called `name`.
    pub(crate) fn snapshot_id(&self, name: &[u8]) -> Option<u64> {
        self.snapshots
            .iter()
            .find(|(_, s)| s.name == name)
            .map(|(id, _)| *id)
    }

    /// Whether a snapshot called `name` could be asked for now: EEXIST if the name is
    /// taken, ENOSPC when the tree ids have run out.
    pub(crate) fn can_snapshot(&self, name: &[u8]) -> Result<()> {
        self.writable()?;
        if self.snapshot_exists(name) {
            return Err(Error::Exists);
        }
        if self.next_snapshot_id + self.pending_snapshots.len() as u64 >= MAX_SNAPSHOT_ID {
            return Err(Error::NoSpace);
        }
        Ok(())
    }

    /// Asks the next commit to take a snapshot of the fs tree called `name`.
    pub(crate) fn request_snapshot(&mut self, name: &[u8]) -> Result<()> {
        self.can_snapshot(name)?;
        self.pending_snapshots.push(name.to_vec());
        Ok(())
    }

    /// Takes the snapshots asked for: each new tree is the fs tree's root as this commit
    /// writes it, with one more reference. Runs after the fs tree is final.
    fn take_snapshots(&mut self) -> Result<()> {
        if self.pending_snapshots.is_empty() {
            return Ok(());
        }
        let fs = self.root(tree::FS);
        let ns = self.sb.node_size as u64;
        for name in std::mem::take(&mut self.pending_snapshots) {
            let id = self.next_snapshot_id;
            self.next_snapshot_id += 1;
            self.refs.add(fs.addr, ns, EXTENT_FLAG_TREE, 1);
            let item = SnapshotItem {
                generation: self.generation,
                ctime: Timespec::now(),
                name,
            };
            self.insert(
                tree::ROOT,
                Key::new(objectid::SNAPSHOTS, kind::SNAPSHOT, id),
                item.encode(),
            )?;
            self.snapshots.insert(id, item);
            self.roots.insert(id, fs);
        }
        self.last_snapshot = self.generation;
        self.put_snapshot_meta()
    }

    fn put_snapshot_meta(&mut self) -> Result<()> {
        let meta = SnapshotMeta {
            next_id: self.next_snapshot_id.into(),
            last_snapshot: self.last_snapshot.into(),
        };
        self.insert(
            tree::ROOT,
            Key::new(objectid::SNAPSHOTS, kind::SNAPSHOT_META, 0),
            meta.as_bytes().to_vec(),
        )
    }

    /// Deletes snapshot `id`: it disappears at once; its nodes and data are freed by
    /// [`Store::drop_step`], which resumes after a remount from the drop progress.
    pub(crate) fn delete_snapshot(&mut self, id: u64) -> Result<()> {
        self.writable()?;
        if !self.snapshots.contains_key(&id) {
            return Err(Error::NotFound);
        }
        let r = self.root(id);
        self.delete(
            tree::ROOT,
            &Key::new(objectid::SNAPSHOTS, kind::SNAPSHOT, id),
        )?;
        self.snapshots.remove(&id);
        self.put_root_item(id, r, root_flag::DEAD)?;
        self.put_drop_progress(id, Key::MIN)?;
        self.roots.remove(&id);
        self.written_roots.remove(&id);
        self.dead.insert(id, (r, Key::MIN));
        Ok(())
    }

    fn put_drop_progress(&mut self, id: u64, progress: Key) -> Result<()> {
        let mut v = Vec::with_capacity(Key::SIZE);
        progress.encode(&mut v);
        self.insert(tree::ROOT, Key::new(id, kind::DROP_PROGRESS, 0), v)
    }

    /// Queues a refcount change nothing justifies, for tests of check.
    #[cfg(test)]
    pub(crate) fn corrupt_ref_for_test(&mut self, addr: u64, len: u64, delta: i64) {
        self.refs.add(addr, len, EXTENT_FLAG_TREE, delta);
    }

    /// Whether deleted snapshots are waiting to be dropped.
    pub(crate) fn has_dead(&self) -> bool {
        !self.dead.is_empty()
    }

    /// Frees what deleted snapshots alone hold, visiting at most about `budget` nodes;
    /// returns whether more is left. Each step's refcount changes and its progress go
    /// into the running transaction together, so a crash resumes where the last commit
    /// left off. Memory is one path of nodes plus the step's queued refs.
    pub(crate) fn drop_step(&mut self, budget: usize) -> Result<bool> {
        self.writable()?;
        let Some((&id, &(root, progress))) = self.dead.iter().next() else {
            return Ok(false);
        };
        let mut progress = progress;
        let mut budget = budget.max(1);
        let span = (Key::MIN, None);
        let done = self.drop_shared(root.addr, span, &mut progress, &mut budget)? || {
            let n = btree::load_root(self, &root)?;
            self.drop_node(n, span, &mut progress, &mut budget)?
        };
        if done {
            self.delete(tree::ROOT, &Key::new(id, kind::ROOT_ITEM, 0))?;
            self.delete(tree::ROOT, &Key::new(id, kind::DROP_PROGRESS, 0))?;
            self.dead.remove(&id);
            tracing::info!("snapshot tree {id} dropped");
        } else {
            self.put_drop_progress(id, progress)?;
            self.dead.insert(id, (root, progress));
        }
        Ok(!self.dead.is_empty())
    }

    /// The first half of dropping the dead tree's reference to the subtree at `addr`
    /// (keys in `span`, `[lo, hi)`): a subtree nobody has entered yet (everything
    /// below `progress` is done) whose root is shared loses that one reference and is
    /// not entered. Returns whether that settled it; if not, [`Store::drop_node`]
    /// enters it. A node entered and left part-way was exclusive, so a resumed walk
    /// enters it again without asking.
    fn drop_shared(
        &mut self,
        addr: u64,
        (lo, hi): (Key, Option<Key>),
        progress: &mut Key,
        budget: &mut usize,
    ) -> Result<bool> {
        if *progress > lo || self.node_refs(addr)? <= 1 {
            return Ok(false);
        }
        self.refs
            .add(addr, self.sb.node_size as u64, EXTENT_FLAG_TREE, -1);
        *budget = budget.saturating_sub(1);
        *progress = hi.unwrap_or(Key::MAX);
        Ok(true)
    }

    /// Enters node `n`, which only the dead tree holds: drops what lies at or after
    /// `progress` below it (children through [`Store::drop_shared`] first), then `n`
    /// itself. Returns whether the subtree is done (false: the budget ran out).
    fn drop_node(
        &mut self,
        n: Arc<Node>,
        (lo, hi): (Key, Option<Key>),
        progress: &mut Key,
        budget: &mut usize,
    ) -> Result<bool> {
        match n.body() {
            NodeBody::Leaf(_) => self.leaf_data_refs(&n, -1),
            NodeBody::Internal(ptrs) => {
                for (i, (k, child, _)) in ptrs.iter().enumerate() {
                    let chi = ptrs.get(i + 1).map(|p| p.0).or(hi);
                    if chi.is_some_and(|h| h <= *progress) {
                        continue;
                    }
                    if *budget == 0 {
                        return Ok(false);
                    }
                    let span = ((*k).max(lo), chi);
                    if self.drop_shared(*child, span, progress, budget)? {
                        continue;
                    }
                    let c = btree::load_child(self, &n, i)?;
                    if !self.drop_node(c, span, progress, budget)? {
                        return Ok(false);
                    }
                }
            }
        }
        let addr = n.hdr.addr;
        self.refs
            .add(addr, self.sb.node_size as u64, EXTENT_FLAG_TREE, -1);
        self.cache.remove(&addr);
        *budget = budget.saturating_sub(1);
        *progress = hi.unwrap_or(Key::MAX);
        Ok(true)
    }

    fn evict_clean(&mut self) {
        if self.cache.len() <= self.cache_cap {
            return;
        }
        let durable = self.durable_sb.generation;
        let dirty = &self.dirty;
        self.cache
            .retain(|a, n| dirty.contains(a) || n.hdr.generation > durable || n.hdr.level > 0);
    }
}

impl NodeStore for Store {
    fn read_node(&mut self, addr: u64) -> Result<Arc<Node>> {
        if let Some(n) = self.cache.get(&addr) {
            return Ok(n.clone());
        }
        let ns = self.sb.node_size as usize;
        if addr % 4096 != 0
            || addr < self.sb.log_start + self.sb.log_len
            || addr
                .checked_add(ns as u64)
                .is_none_or(|end| end > self.sb.total_bytes)
        {
            return Err(Error::corrupt(
                "tree node",
                addr,
                "address outside the data area",
            ));
        }
        let mut buf = vec![0u8; ns];
        self.dev.read_at(&mut buf, addr)?;
        let (hdr, body) = decode_node(&buf, addr, &self.sb.fsid).inspect_err(|e| {
            tracing::error!("{e}");
        })?;
        let n = Arc::new(Node::new(hdr, body));
        if self.cache.len() > self.cache_cap {
            self.evict_clean();
        }
        self.cache.insert(addr, n.clone());
        Ok(n)
    }

    fn cow_node(&mut self, addr: u64) -> Result<u64> {
        if self.dirty.contains(&addr) {
            return Ok(addr);
        }
        self.writable()?;
        let n = self.read_node(addr)?;
        let ns = self.sb.node_size as u64;
        // Only fs-tree nodes written before the newest snapshot can be shared.
        let shared = n.hdr.owner == tree::FS
            && n.hdr.generation <= self.last_snapshot
            && self.node_refs(addr)? > 1;
        let (new, _) = self.alloc.alloc(ns, ns, true)?;
        self.refs.add(new, ns, EXTENT_FLAG_TREE, 1);
        self.refs.add(addr, ns, EXTENT_FLAG_TREE, -1);
        if shared {
            // The copy references everything the shared node does.
            match n.body() {
                NodeBody::Internal(ptrs) => {
                    for (_, child, _) in ptrs {
                        self.refs.add(*child, ns, EXTENT_FLAG_TREE, 1);
                    }
                }
                NodeBody::Leaf(_) => self.leaf_data_refs(&n, 1),
            }
            Stats::add(&self.stats.shared_cows, 1);
        }
        let mut c = if shared {
            // A shared original stays: a snapshot still reads it, maybe before the
            // commit that wrote it has reached the disk.
            (*n).clone()
        } else {
            // The original leaves the cache; when nothing else holds it, its items
            // move into the copy instead of being cloned one allocation each.
            self.cache.remove(&addr);
            Arc::try_unwrap(n).unwrap_or_else(|held| (*held).clone())
        };
        c.hdr.addr = new;
        c.hdr.generation = self.generation;
        self.cache.insert(new, Arc::new(c));
        self.dirty.insert(new);
        Ok(new)
    }

    fn node_mut(&mut self, addr: u64) -> &mut Node {
        debug_assert!(self.dirty.contains(&addr));
        Arc::make_mut(self.cache.get_mut(&addr).expect("writable node is cached"))
    }

    fn new_node(&mut self, owner: u64, level: u8, body: NodeBody) -> Result<u64> {
        self.writable()?;
        let ns = self.sb.node_size as u64;
        let (addr, _) = self.alloc.alloc(ns, ns, true)?;
        self.refs.add(addr, ns, EXTENT_FLAG_TREE, 1);
        let hdr = NodeHeader {
            addr,
            generation: self.generation,
            owner,
            level,
        };
        self.cache.insert(addr, Arc::new(Node::new(hdr, body)));
        self.dirty.insert(addr);
        Ok(addr)
    }

    fn free_node(&mut self, addr: u64) {
        let ns = self.sb.node_size as u64;
        self.refs.add(addr, ns, EXTENT_FLAG_TREE, -1);
        self.dirty.remove(&addr);
        self.cache.remove(&addr);
    }

    fn node_size(&self) -> usize {
        self.sb.node_size as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node cache takes a sixteenth of usable memory: 4,096 nodes of 16 KiB in a
    /// 1 GiB container, never fewer than 256 nor more than 32,768.
    #[test]
    fn the_node_cache_scales_with_memory() {
        assert_eq!(cache_nodes(1 << 30, 16384), 4096);
        assert_eq!(cache_nodes(64 << 20, 16384), 256);
        assert_eq!(cache_nodes(256 << 20, 16384), 1024);
        assert_eq!(cache_nodes(24 << 30, 16384), 32768);
        assert_eq!(cache_nodes(1 << 30, 65536), 1024);
        assert_eq!(cache_nodes(1 << 30, 4096), 16384);
    }

    /// mkfs's `log_size` is placed below the second superblock copy when it fits
    /// there, past it otherwise, and refused off whole blocks, out of 1 MiB to
    /// [`LOG_MAX`], or over half the device.
    #[test]
    fn a_log_size_asked_for_is_placed_or_refused() {
        const M: u64 = 1 << 20;
        const G: u64 = 1 << 30;
        assert_eq!(log_area_sized(32 * M, M).unwrap(), (LOG_START, M));
        assert_eq!(log_area_sized(G, 63 * M).unwrap(), (LOG_START, 63 * M));
        assert_eq!(log_area_sized(G, 64 * M).unwrap(), (LOG_START_HIGH, 64 * M));
        assert_eq!(
            log_area_sized(8 * G, LOG_MAX).unwrap(),
            (LOG_START_HIGH, LOG_MAX)
        );
        for (size, len) in [
            (G, M - 4096),
            (G, M + 1),
            (8 * G, LOG_MAX + 4096),
            (32 * M, 15 * M + 4096),
            (G, 512 * M),
        ] {
            assert!(log_area_sized(size, len).is_err(), "{size} {len}");
        }
        assert!(log_area_sized(32 * M, 15 * M).is_ok());
    }

    #[test]
    fn the_log_area_grows_with_the_device_and_never_covers_a_superblock_copy() {
        const M: u64 = 1 << 20;
        const G: u64 = 1 << 30;
        for (size, start, len) in [
            (32 * M, LOG_START, 2 * M),
            (G, LOG_START, 62 * M),
            (2 * G - 4096, LOG_START, 62 * M),
            (2 * G, LOG_START_HIGH, 128 * M),
            (4 * G, LOG_START_HIGH, 256 * M),
            (8 * G, LOG_START_HIGH, LOG_MAX),
            (16 * G, LOG_START_HIGH, LOG_MAX),
            (1 << 40, LOG_START_HIGH, LOG_MAX),
        ] {
            assert_eq!(log_area_for(size), (start, len), "{size}");
            for o in SUPER_OFFSETS {
                assert!(o + SUPER_SIZE as u64 <= start || o >= start + len, "{size}");
            }
        }
    }
}
