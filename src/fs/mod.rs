//! The filesystem: namespace, inodes, files and extended attributes, over the trees.
//!
//! Lock order: a file's lock (sharded `file_locks`), then `commit_lock`, then
//! `log_lock`, then `inner`.
//! `inner` is never held across a commit's device I/O (see `txn`), nor across the data
//! I/O of reads and writes: lookups, reads and writes go on while a commit flushes, and
//! reads and writes of different files go on together.

mod acl;
mod dir;
mod file;
mod inode;
mod io;
mod snapshot;
mod space;
mod xattr;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use crate::cache::{CacheOptions, PageCache};
use crate::dev::{BlockDev, FileDev};
use crate::error::{Error, Result};
use crate::format::{inode_flag, objectid, tree, DirEntry, Key, Timespec};
use crate::stats::{Stats, StatsSnapshot};
use crate::txn::Store;

/// The inode flags that keep a name and the data from changing.
pub(crate) const FIXED: u64 = inode_flag::IMMUTABLE | inode_flag::APPEND;

pub use acl::{is_acl_name, ACCESS as ACL_ACCESS};
pub use inode::{without_suid, Attr, FileKind, SetAttr, TimeSet};
pub(crate) use snapshot::LIVE_INO_LIMIT;
pub use snapshot::{
    check_snapshot_name, is_snapshot_ino, SnapshotInfo, SNAPSHOTS_INO, SNAPSHOTS_NAME,
};
pub use space::SpaceUsage;

/// Mount-time options of the engine.
#[derive(Debug, Clone)]
pub struct Options {
    /// Refuse every change.
    pub readonly: bool,
    /// Seconds between periodic commits (0: only on demand).
    pub commit_interval: Duration,
    /// The page cache: size, folio size, writeback age, per-block dirty tracking.
    pub cache: CacheOptions,
    /// Online discard: after each commit, discard the runs of at least this many bytes
    /// among what it freed (`None`: off; `fstrim` still works).
    pub discard: Option<u64>,
    /// Leave the log unreplayed: the last commit alone, without the fsyncs since
    /// (read-only mounts only, which leave the log as it is).
    pub no_log_replay: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            readonly: false,
            commit_interval: Duration::from_secs(30),
            cache: CacheOptions::default(),
            discard: None,
            no_log_replay: false,
        }
    }
}

/// mkfs parameters.
#[derive(Debug, Clone, Default)]
pub struct MkfsOptions {
    /// B-tree node size; 16 KiB when `None`.
    pub node_size: Option<u32>,
    /// Owner (uid, gid) of the root directory: (0, 0) by default.
    pub root_owner: (u32, u32),
    /// Size of the log area in bytes (see [`crate::log_area_sized`]); 1/16 of the
    /// device, 2 MiB to 512 MiB, when `None`.
    pub log_size: Option<u64>,
}

/// One entry returned by `readdir`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntryOut {
    /// Inode number.
    pub ino: u64,
    /// File type.
    pub kind: FileKind,
    /// Name.
    pub name: Vec<u8>,
    /// Offset to pass to `readdir` to continue after this entry.
    pub next_offset: u64,
}

/// Space and inode counts (statfs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatFs {
    /// Block size (4096).
    pub bsize: u32,
    /// Total data blocks.
    pub blocks: u64,
    /// Free blocks.
    pub bfree: u64,
    /// Free blocks available to users (free less the metadata reserve).
    pub bavail: u64,
    /// Inodes: those numbered so far (the root's included; numbers are not reused,
    /// so deleted ones still count) plus `ffree`.
    pub files: u64,
    /// Inodes that could still be made: about what the available space holds
    /// ([`INODES_PER_BLOCK`]), within the inode numbers left.
    pub ffree: u64,
    /// Longest name.
    pub namelen: u32,
}

/// Who is creating a node: owner ids applied to new inodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Creds {
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
}

/// `rename` flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RenameFlags {
    /// Fail with EEXIST if the target exists (RENAME_NOREPLACE).
    pub noreplace: bool,
    /// Swap source and target (RENAME_EXCHANGE).
    pub exchange: bool,
}

/// `fallocate` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FallocMode {
    /// Do not change the file size (FALLOC_FL_KEEP_SIZE).
    pub keep_size: bool,
    /// Deallocate the range (FALLOC_FL_PUNCH_HOLE; needs keep_size).
    pub punch_hole: bool,
    /// Zero the range, its whole blocks preallocated (FALLOC_FL_ZERO_RANGE).
    pub zero_range: bool,
}

/// One mapped range of a file (like FIEMAP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtentInfo {
    /// Offset in the file.
    pub offset: u64,
    /// Device byte address of the first byte.
    pub disk_addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Allocated by fallocate and never written (reads as zeros).
    pub prealloc: bool,
}

/// The root directory's inode number.
pub const ROOT_INO: u64 = objectid::ROOT_DIR;

/// Size and times of an inode changed by cached writes and not yet stored in its
/// item: `get_inode` applies them, `put_inode` stores them. The tree only learns a
/// size with (or after) its data: up to `disk_size` while the rest is in the cache.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PendingAttr {
    size: u64,
    mtime: Timespec,
    ctime: Timespec,
    /// The largest size the tree may hold: the end of the data written back so far
    /// (like ext4's `i_disksize`), so a crash never shows a size past its data.
    disk_size: u64,
    /// A write is copying into the cache: `size` already counts it, and only
    /// writeback of its data moves `disk_size` towards it.
    writing: bool,
}

impl PendingAttr {
    /// The entry of an inode whose stored item holds all there is: its size is on disk.
    fn of(i: &crate::format::InodeItem) -> PendingAttr {
        PendingAttr {
            size: i.size.get(),
            mtime: i.mtime,
            ctime: i.ctime,
            disk_size: i.size.get(),
            writing: false,
        }
    }

    /// Whether all the data of `ino`'s size has left the cache: no write is under way
    /// and nothing is dirty (a writeback in flight keeps the inode listed as dirty
    /// until it has mapped), so the tree may take the whole size.
    fn data_written(&self, cache: &PageCache, ino: u64) -> bool {
        !self.writing && !cache.has_dirty(ino)
    }
}

pub(crate) struct Inner {
    pub(crate) store: Store,
    next_ino: u64,
    /// Open handles per inode: an unlinked inode lives until its last one closes.
    pins: rustc_hash::FxHashMap<u64, u64>,
    /// Pinned inodes whose last link was dropped (or was being dropped when that
    /// failed): the last release frees those left without links.
    open_orphans: rustc_hash::FxHashSet<u64>,
    /// See [`PendingAttr`].
    pending: rustc_hash::FxHashMap<u64, PendingAttr>,
    /// Open files truncated to size 0: their next release writes back what was
    /// written since, as btrfs and ext4 do (a file rewritten in place by
    /// open(O_TRUNC), write, close then does not come back empty after a crash).
    flush_on_close: rustc_hash::FxHashSet<u64>,
    /// The page cache, to drop the folios of freed inodes.
    cache: Arc<PageCache>,
    /// Extent maps of the files used lately (seed 2).
    maps: crate::extent_map::MapCache,
}

/// Tests: a function a write calls while under way (see `Fs::write_hook`).
#[cfg(test)]
pub(crate) type WriteHook = Arc<dyn Fn(bool) + Send + Sync>;

/// Tests: runs the hook in `slot`, if any, with `stage`, outside the slot's lock (so
/// that what it waits for may run the hook too).
#[cfg(test)]
pub(crate) fn run_hook(slot: &Mutex<Option<WriteHook>>, stage: bool) {
    let hook = slot.lock().clone();
    if let Some(hook) = hook {
        hook(stage);
    }
}

/// The runs of at least `min_len` bytes in `freed` (extents in any order, none
/// overlapping), adjacent ones joined, in address order.
fn discard_runs(freed: &[(u64, u64)], min_len: u64) -> Vec<(u64, u64)> {
    let mut v = freed.to_vec();
    v.sort_unstable();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (s, l) in v {
        match runs.last_mut() {
            Some((rs, rl)) if *rs + *rl == s => *rl += l,
            _ => runs.push((s, l)),
        }
    }
    runs.retain(|&(_, l)| l >= min_len.max(1));
    runs
}

/// Most bytes [`Fs::trim`] discards under one hold of the fs lock.
const TRIM_PIECE_BYTES: u64 = 1 << 30;
/// Most extents [`Fs::trim`] discards under one hold of the fs lock.
const TRIM_PIECE_EXTENTS: usize = 256;

/// A mounted birchfs: the library's front door. All methods are thread-safe.
pub struct Fs {
    /// Per-file locks, sharded by inode number (taken first).
    file_locks: Vec<RwLock<()>>,
    /// Per-file writeback locks, sharded (after `file_locks`, before `commit_lock`).
    wb_locks: Vec<Mutex<()>>,
    /// Per-file locks of readers filling the cache from the device, sharded (taken
    /// after `file_locks`, before `inner`).
    fill_locks: Vec<Mutex<()>>,
    cache: Arc<PageCache>,
    pub(crate) inner: Mutex<Inner>,
    /// One commit at a time.
    commit_lock: Mutex<()>,
    /// Log batches are taken and written in order under it (flushes go without it).
    log_lock: Mutex<()>,
    /// Notified (with `inner`) when a log flush ends, for fsyncs that share it.
    log_flushed: parking_lot::Condvar,
    /// Set once the device said it cannot discard: online discard stops asking.
    discard_unsupported: std::sync::atomic::AtomicBool,
    dev: Arc<dyn BlockDev>,
    stats: Arc<Stats>,
    opts: Options,
    /// Readahead windows waiting for the readahead thread: (inode, start, end).
    ra_queue: Mutex<std::collections::VecDeque<(u64, u64, u64)>>,
    ra_wake: parking_lot::Condvar,
    /// Whether a readahead thread serves `ra_queue` (else readers fetch the next
    /// window themselves).
    ra_thread: std::sync::atomic::AtomicBool,
    /// Changes users asked for so far (see [`Fs::changes`]).
    changes: std::sync::atomic::AtomicU64,
    /// Tests: runs inside a write under way, before its copy into the cache (with
    /// `false`) and after it (`true`).
    #[cfg(test)]
    pub(crate) write_hook: Mutex<Option<WriteHook>>,
    /// Tests: runs inside a writeback, after it took dirty blocks and before it finds
    /// space for them (with `false`).
    #[cfg(test)]
    pub(crate) writeback_hook: Mutex<Option<WriteHook>>,
    /// Tests: runs inside a commit, before its nodes are written (with `false`).
    #[cfg(test)]
    pub(crate) commit_hook: Mutex<Option<WriteHook>>,
}

/// Shards of the per-file lock table.
const FILE_LOCK_SHARDS: usize = 64;

/// Dirty tree nodes that trigger a commit at the end of an operation.
const DIRTY_COMMIT_NODES: usize = 8192;
/// Queued refcount changes past which each operation runs some of them, so that a
/// commit does not run them all while it holds the fs lock (W3: ~18,000 per commit,
/// up to 120 ms).
const REFS_RUN_AT: usize = 4096;
/// How many an operation runs then (a few milliseconds).
const REFS_RUN_CHUNK: usize = 256;

/// How long after a commit the device refused for want of space the commits that
/// operations start themselves (a large or short-of-room transaction) wait.
const REFUSED_COMMIT_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// Empty files a 4 KiB block of tree space holds, about: an inode item, a name in the
/// directory's two indexes and the inode's back reference, with nodes two-thirds
/// full (20,000 empty files took 577 bytes each). statfs's free inodes are the
/// available blocks times this.
pub const INODES_PER_BLOCK: u64 = 7;

impl Fs {
    /// Writes a new, empty filesystem on `dev`.
    pub fn mkfs(dev: Arc<dyn BlockDev>, opts: &MkfsOptions) -> Result<()> {
        let store = Store::create(dev.clone(), opts.node_size, opts.log_size)?;
        let mut inner = Inner {
            store,
            next_ino: objectid::FIRST_FREE,
            pins: Default::default(),
            open_orphans: Default::default(),
            pending: Default::default(),
            flush_on_close: Default::default(),
            maps: Default::default(),
            cache: Arc::new(PageCache::new(CacheOptions {
                cache_size: 1 << 20,
                ..Default::default()
            })),
        };
        inner.make_root_dir(opts.root_owner)?;
        let batch = inner.store.prepare_commit(false)?;
        Store::write_commit(dev.as_ref(), &inner.store.stats, &batch).map_err(|f| f.error)?;
        Ok(())
    }

    /// Mounts the filesystem on `dev`: the last commit's state, then frees orphans.
    pub fn open(dev: Arc<dyn BlockDev>, opts: Options) -> Result<Fs> {
        opts.cache.validate().map_err(Error::BadOption)?;
        if opts.no_log_replay && !opts.readonly {
            // The first commit would empty the log, and the fsyncs in it would be lost.
            return Err(Error::BadOption(
                "leaving the log unreplayed needs a read-only mount".into(),
            ));
        }
        let store = Store::open(dev.clone(), opts.readonly)?;
        let stats = store.stats.clone();
        let cache = Arc::new(PageCache::new(opts.cache));
        let mut inner = Inner {
            store,
            next_ino: 0,
            pins: Default::default(),
            open_orphans: Default::default(),
            pending: Default::default(),
            flush_on_close: Default::default(),
            maps: Default::default(),
            cache: cache.clone(),
        };
        if opts.no_log_replay {
            tracing::info!("the log is not replayed (norecovery): the last commit alone");
        } else {
            inner.replay_log()?;
        }
        inner.store.log.enabled = !opts.readonly;
        inner.next_ino = inner.find_next_ino()?;
        let fs = Fs {
            file_locks: (0..FILE_LOCK_SHARDS).map(|_| RwLock::new(())).collect(),
            wb_locks: (0..FILE_LOCK_SHARDS).map(|_| Mutex::new(())).collect(),
            fill_locks: (0..FILE_LOCK_SHARDS).map(|_| Mutex::new(())).collect(),
            cache,
            inner: Mutex::new(inner),
            commit_lock: Mutex::new(()),
            log_lock: Mutex::new(()),
            log_flushed: parking_lot::Condvar::new(),
            discard_unsupported: std::sync::atomic::AtomicBool::new(false),
            dev,
            stats,
            opts,
            ra_queue: Mutex::new(Default::default()),
            ra_wake: parking_lot::Condvar::new(),
            ra_thread: std::sync::atomic::AtomicBool::new(false),
            changes: std::sync::atomic::AtomicU64::new(0),
            #[cfg(test)]
            write_hook: Mutex::new(None),
            #[cfg(test)]
            writeback_hook: Mutex::new(None),
            #[cfg(test)]
            commit_hook: Mutex::new(None),
        };
        if !fs.opts.readonly {
            let n = fs.inner.lock().free_orphans()?;
            if n > 0 {
                tracing::info!("freed {n} orphan inodes");
            }
            // A crash can leave batches of the next two generations in the log area
            // (see `log`): the first commit skips a generation, so that none of them is
            // ever read as a batch of the new log. Nothing else runs until it lands.
            {
                let mut g = fs.inner.lock();
                g.store.generation += 1;
                g.store.must_commit = true;
            }
            let _c = fs.commit_lock.lock();
            fs.commit_locked(false)?;
        }
        Ok(fs)
    }

    /// Opens the image file or block device at `path` (locked while open) and mounts it.
    pub fn open_path(path: &Path, opts: Options) -> Result<Fs> {
        let dev = FileDev::open(path, !opts.readonly)?;
        Fs::open(Arc::new(dev), opts)
    }

    /// The options this filesystem was mounted with.
    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// A count that moves with every change users ask for (writes, names,
    /// attributes, xattrs), for a server that commits once they stop.
    pub fn changes(&self) -> u64 {
        self.changes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counters of fsyncs, commits and device traffic.
    pub fn stats(&self) -> StatsSnapshot {
        let mut s = self.stats.snapshot();
        s.cache_bytes = self.cache.bytes();
        s.cache_dirty_bytes = self.cache.dirty_bytes();
        s.cache_limit = self.cache.size_limit();
        s.readonly = self.opts.readonly;
        s
    }

    /// Like `with`, for operations that need space: on ENOSPC while a commit could
    /// free space (frees are only released by a commit), commits and tries once more.
    /// Such operations check for room before they change anything.
    ///
    /// Every change that goes through here starts only with the margin of
    /// `Allocator::has_op_margin` free, so that its node copies never run out
    /// halfway (which would leave it half done): deletions go through here too.
    fn with_space<T>(&self, f: impl Fn(&mut Inner) -> Result<T>) -> Result<T> {
        self.changes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let guarded = |i: &mut Inner| {
            if !i.store.alloc.has_op_margin() {
                return Err(Error::NoSpace);
            }
            f(i)
        };
        match self.with(guarded) {
            Err(Error::NoSpace) if self.space_may_come_back() => {
                self.commit_tree()?;
                self.with(guarded)
            }
            r => r,
        }
    }

    /// Whether a commit could free space: changes not yet committed, or frees waiting
    /// for a commit in flight (its `commit()` waits for that one to finish).
    fn space_may_come_back(&self) -> bool {
        let g = self.inner.lock();
        g.store.has_changes() || g.store.alloc.pinned_bytes() > 0
    }

    /// Runs `f` under the fs lock, then commits when the transaction has grown large
    /// or is short of room.
    ///
    /// Short of room: on a disk whose free space has fallen into the metadata
    /// reserve, copy-on-write pins the old copy of every node a change touches until
    /// a commit, so without one a run of deletions on a full disk used up the reserve
    /// with copies and then failed, and so did the commit that would have freed them.
    /// Committing once what the transaction holds nears what is left
    /// (`Store::short_of_room`) keeps transactions short while space is (btrfs
    /// commits to reclaim pinned space the same way). The check is made under the
    /// lock `f` holds anyway: with an extra lock round per operation before it, W4
    /// (fs_mark) ran slower in each of 4 interleaved rounds (median 10,320 against
    /// 11,245 files/s); checked here, 12,978 against 12,760 in 6 rounds.
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> Result<T>) -> Result<T> {
        let (r, big) = {
            let mut g = self.inner.lock();
            let r = f(&mut g);
            // Short of space, the commit after this operation takes them (it may
            // use the whole reserve; running them here may not).
            if g.store.queued_refs() > REFS_RUN_AT
                && !g.store.readonly
                && !g.store.failed
                && !g.store.alloc.in_reserve()
            {
                // An error here has already logged itself and stopped all changes.
                let _ = g.store.run_some_delayed_refs(REFS_RUN_CHUNK);
            }
            let short = g.store.short_of_room();
            // After a commit the device refused for want of space, these commits wait
            // a while: each would write everything kept since, to be refused again.
            let waiting = g
                .store
                .unwritten
                .as_ref()
                .is_some_and(|(_, at)| at.elapsed() < REFUSED_COMMIT_PAUSE);
            (
                r,
                (g.store.dirty_nodes() > DIRTY_COMMIT_NODES || short) && !waiting,
            )
        };
        if big {
            match self.commit_tree() {
                // The operation is done (in memory, as any before a commit): it
                // succeeded; the commit is kept for the next try.
                Err(e) if r.is_ok() && !self.inner.lock().store.failed => {
                    tracing::debug!("commit after an operation deferred: {e}");
                }
                c => c?,
            }
        }
        r
    }

    /// Grows the filesystem to `size` bytes of its device and commits: the new space
    /// is free, and a superblock copy that now fits is written. An image file is
    /// lengthened to `size` first; a block device must already be that large. Rounded
    /// down to 4 KiB; never shrinks. Mounted or not: changes go on meanwhile.
    pub fn grow(&self, size: u64) -> Result<()> {
        let _c = self.commit_lock.lock();
        self.dev.grow(size & !4095)?;
        self.commit_growing(false, Some(size))
    }

    /// The size of the device as it is now (an image file's length, a block device's
    /// capacity), which may exceed [`Fs::size`]: what a grow can take.
    pub fn device_size(&self) -> Result<u64> {
        Ok(self.dev.current_size()?)
    }

    /// Whether the filesystem lies on a block device (which a grow cannot lengthen).
    pub fn on_block_device(&self) -> bool {
        self.dev.is_block_device()
    }

    /// The filesystem's size in bytes: how much of its device it uses.
    pub fn size(&self) -> u64 {
        self.inner.lock().store.sb.total_bytes
    }

    /// The newest valid superblock of `dev`: what an open would start from.
    pub fn superblock_of(dev: &dyn BlockDev) -> Result<crate::format::Superblock> {
        crate::txn::Store::read_super(dev)
    }

    /// Makes everything done so far durable: writes back the page cache, then a full
    /// commit. A writeback error is returned after the commit of everything else.
    pub fn commit(&self) -> Result<()> {
        let wb = self.writeback_all();
        self.commit_tree()?;
        wb
    }

    /// A full commit of the trees as they are, without writing back cached data.
    fn commit_tree(&self) -> Result<()> {
        let _c = self.commit_lock.lock();
        self.commit_locked(true)
    }

    /// A full commit; the caller holds `commit_lock`. With `chain`, fsyncs go on while
    /// it is written: the log's last batch of this generation is written first, and
    /// the next generation's batches follow it (see `log`); otherwise (or when that
    /// batch does not fit or fails) no batch is written until the commit is durable.
    ///
    /// When the device refuses the commit's nodes for want of space (a full host under
    /// a sparse image), nothing has changed on the disk: the commit is kept and written
    /// with the next one, which does not chain (the log replays only one generation past
    /// the last durable commit), and until one lands every fsync commits (the log
    /// takes no batch), so none is answered on records a crash could not replay.
    fn commit_locked(&self, chain: bool) -> Result<()> {
        self.commit_growing(chain, None)
    }

    /// [`Fs::commit_locked`], growing the filesystem to `grow` bytes first, under the
    /// same locks: no log batch is written between the grow and the commit (which
    /// must not chain then), so none that a crash could replay on the old size uses
    /// the new space.
    fn commit_growing(&self, chain: bool, grow: Option<u64>) -> Result<()> {
        let t0 = std::time::Instant::now();
        let log_guard = self.log_lock.lock();
        let (mut batch, log_start) = {
            let mut g = self.inner.lock();
            if let Some(size) = grow {
                g.store.grow(size)?;
            }
            g.flush_all_pending()?;
            let earlier = g.store.unwritten.take();
            let batch = match earlier {
                None if !g.store.has_changes() => return Ok(()),
                Some((earlier, _)) if !g.store.has_changes() => earlier,
                earlier => {
                    let chain = chain && earlier.is_none();
                    match g.store.prepare_commit(chain) {
                        Ok(mut b) => {
                            if let Some((e, _)) = earlier {
                                b.absorb(e);
                            }
                            b
                        }
                        Err(e) => {
                            g.store.unwritten = earlier;
                            return Err(e);
                        }
                    }
                }
            };
            (batch, g.store.sb.log_start)
        };
        let log_guard = match batch.closing.take() {
            Some(c) => match self.write_batch(log_start, &c) {
                Ok(()) => {
                    drop(log_guard);
                    None
                }
                Err(e) => {
                    tracing::warn!(
                        "closing log batch not written ({e}); fsyncs wait for the commit"
                    );
                    Some(log_guard)
                }
            },
            None => Some(log_guard),
        };
        #[cfg(test)]
        run_hook(&self.commit_hook, false);
        if let Err(f) = Store::write_commit(self.dev.as_ref(), &self.stats, &batch) {
            let mut g = self.inner.lock();
            if f.retryable {
                tracing::error!(
                    "commit failed: {}; it is kept in memory and written with the next \
                     commit, and fsyncs commit until one lands",
                    f.error
                );
                g.store.unwritten = Some((batch, std::time::Instant::now()));
                g.store.log.overflow = true;
                Stats::add(&self.stats.commits_deferred, 1);
            } else {
                tracing::error!("commit failed, refusing further changes: {}", f.error);
                g.store.failed = true;
            }
            return Err(f.error);
        }
        if let Some(min_len) = self.opts.discard {
            // Still pinned: nothing can be handed these ranges until finish_commit.
            self.discard_freed(batch.pinned(), min_len);
        }
        self.inner.lock().store.finish_commit(batch);
        drop(log_guard);
        self.stats.commit_latency.record(t0.elapsed());
        Ok(())
    }

    /// fsync/fdatasync of `ino`: its data, attributes and names survive a crash.
    ///
    /// Returns at once when every change of `ino` is already durable; otherwise writes
    /// the pending log records (every operation's, in order) as one batch and flushes.
    /// fsyncs that arrive while a batch is written wait for the lock and usually find
    /// their records already durable (group commit). When the log is nearly full it
    /// then commits; a failure of that commit is logged, not returned (the fsync is
    /// durable).
    pub fn fsync(&self, ino: u64, datasync: bool) -> Result<()> {
        let t0 = std::time::Instant::now();
        let r = match self.fsync_target(ino, datasync) {
            Ok(None) => Ok(()),
            Ok(Some(t)) => self.sync_to(t),
            Err(e) => Err(e),
        };
        self.stats.fsync_latency.record(t0.elapsed());
        r?;
        // The fsync is durable: a commit that fails here is for the next to report.
        if let Err(e) = self.commit_if_log_full() {
            tracing::error!("commit of a full log failed: {e}");
        }
        Ok(())
    }

    /// The first half of an fsync of `ino`: writes back its cached data, then gives
    /// `None` when everything about it is already durable (the fsync is done), else
    /// the log position [`Fs::sync_to`] must reach.
    /// With `datasync` (fdatasync), changes a read of the data does not depend on
    /// (times, mode, owner, xattrs, names) do not count. Lets a server queue fsyncs and
    /// answer them from one writer (group commit).
    pub fn fsync_target(&self, ino: u64, datasync: bool) -> Result<Option<u64>> {
        let t0 = std::time::Instant::now();
        let r = self.fsync_prepare(ino, datasync);
        self.stats.fsync_prepare_latency.record(t0.elapsed());
        r
    }

    /// [`Fs::fsync_target`] without its timing.
    fn fsync_prepare(&self, ino: u64, datasync: bool) -> Result<Option<u64>> {
        Stats::add(&self.stats.fsyncs, 1);
        if self.opts.readonly {
            Stats::add(&self.stats.fsyncs_noop, 1);
            return Ok(None);
        }
        self.writeback(ino, u64::MAX)?;
        let mut g = self.inner.lock();
        g.flush_pending(ino)?;
        let t = if g.store.log.overflow {
            Some(u64::MAX)
        } else {
            g.store.log.target(ino, datasync)
        };
        match t {
            None => Stats::add(&self.stats.fsyncs_noop, 1),
            Some(_) if g.store.log.logged_before(ino) => Stats::add(&self.stats.fsyncs_relogged, 1),
            Some(_) => {}
        }
        Ok(t)
    }

    /// Makes the log durable up to `target` (from [`Fs::fsync_target`]).
    pub fn sync_to(&self, target: u64) -> Result<()> {
        self.log_sync(target)
    }

    /// Commits when the log area is nearly full (see `LogBuffer::wants_commit`), so
    /// that fsyncs keep finding room in it; servers call this after answering the
    /// fsyncs of a batch.
    pub fn commit_if_log_full(&self) -> Result<()> {
        if self.inner.lock().store.log.wants_commit() {
            self.commit_tree()?;
        }
        Ok(())
    }

    /// Records an fsync's latency, for servers that answer fsyncs themselves.
    pub fn record_fsync_latency(&self, d: std::time::Duration) {
        self.stats.fsync_latency.record(d);
    }

    /// Records how long a ready fsync waited for a group commit to take it, for
    /// servers that queue fsyncs for group commit.
    pub fn record_fsync_queue_latency(&self, d: std::time::Duration) {
        self.stats.fsync_queue_latency.record(d);
    }

    /// Records how long a group commit waited to gather fsyncs before it took its
    /// group, for servers that gather.
    pub fn record_fsync_gather_latency(&self, d: std::time::Duration) {
        self.stats.fsync_gather_latency.record(d);
    }

    /// Counts bytes read through an open that bypasses the kernel's page cache.
    pub fn count_direct_read(&self, bytes: u64) {
        crate::stats::Stats::add(&self.stats.direct_read_bytes, bytes);
    }

    /// Counts a measurement of how a group commit does best: with one committer
    /// that gathers (`Some(true)`), one that does not (`Some(false)`), or two at
    /// once (`None`).
    pub fn count_gather_choice(&self, gather: Option<bool>) {
        let c = match gather {
            Some(true) => &self.stats.gather_chosen,
            Some(false) => &self.stats.gather_declined,
            None => &self.stats.gather_overlap,
        };
        crate::stats::Stats::add(c, 1);
    }

    /// Counts a group commit that began while another was still at work.
    pub fn count_overlapped_log_commit(&self) {
        crate::stats::Stats::add(&self.stats.log_commits_overlapped, 1);
    }

    /// Counts a FUSE request that came through an io_uring queue.
    pub fn count_uring_request(&self) {
        crate::stats::Stats::add(&self.stats.uring_requests, 1);
    }

    /// Counts a FUSE request served by a standby request thread, and whether the
    /// thread parked after it.
    pub fn count_standby_request(&self, parked: bool) {
        crate::stats::Stats::add(&self.stats.standby_served, 1);
        if parked {
            crate::stats::Stats::add(&self.stats.standby_parks, 1);
        }
    }

    /// Counts a FUSE request with opcode `op`, by kind.
    pub fn count_fuse_request(&self, op: u32) {
        self.stats.requests.count(op);
    }

    /// Makes every record up to `target` durable: one log batch, or a full commit when
    /// the log cannot take it.
    ///
    /// Batches are written in log order under `log_lock` (also while a commit is
    /// written: see [`Fs::commit_locked`]); the flush runs without it, so the next
    /// group's batch is written while this one flushes, and several flushes may be in
    /// flight (the device serves them in parallel). A flush makes durable every batch
    /// written before it began (the device's flush covers all completed writes), so
    /// the LSN read before flushing becomes durable after it; replay stops at the first
    /// batch that did not land, so a later batch never counts without the earlier ones.
    fn log_sync(&self, target: u64) -> Result<()> {
        let written = {
            let _l = self.log_lock.lock();
            let (batch, log_start) = {
                let mut g = self.inner.lock();
                if g.store.log.durable_lsn >= target {
                    return Ok(());
                }
                if g.store.failed {
                    // Records of an operation left half done may be pending.
                    return Err(Error::stopped());
                }
                if g.store.log.written_lsn >= target {
                    (None, 0)
                } else {
                    let (fsid, gen) = (g.store.sb.fsid, g.store.generation);
                    match g.store.log.take_batch(&fsid, gen) {
                        Some(b) => (Some(b), g.store.sb.log_start),
                        None => {
                            drop(g);
                            drop(_l);
                            Stats::add(&self.stats.fallbacks, 1);
                            return self.commit_tree();
                        }
                    }
                }
            };
            if let Some(batch) = batch {
                if let Err(e) = self.write_batch(log_start, &batch) {
                    // Later batches would sit behind a damaged one: commit from now on.
                    tracing::error!("log write failed: {e}");
                    self.inner.lock().store.log.overflow = true;
                    return Err(e);
                }
            }
            self.inner.lock().store.log.written_lsn
        };
        {
            // With several group commits at once (FUSE over io_uring), a flush that
            // began after another's batch wrote these records makes them durable
            // too: wait for it rather than flush again (a failure ends the wait).
            let mut g = self.inner.lock();
            while g.store.log.flush_started >= target && g.store.log.durable_lsn < target {
                self.log_flushed.wait(&mut g);
            }
            if g.store.log.durable_lsn >= target {
                Stats::add(&self.stats.log_flushes_shared, 1);
                return Ok(());
            }
            if g.store.failed {
                // The flush waited for failed: flushing again could return 0 with
                // its batch lost (see below).
                return Err(Error::stopped());
            }
            g.store.log.flush_started = g.store.log.flush_started.max(written);
        }
        let t0 = std::time::Instant::now();
        let flushed = self.dev.flush();
        self.stats.log_flush_latency.record(t0.elapsed());
        let r = {
            let mut g = self.inner.lock();
            match flushed {
                Err(e) => {
                    // A device may report a lost write to one flush only (Linux's
                    // fdatasync does, per open file), so a flush after this one could
                    // return 0 with this batch, or data it names, lost; and a commit
                    // does not write data again. Nothing more may count as durable.
                    tracing::error!("log flush failed, refusing further changes: {e}");
                    g.store.failed = true;
                    g.store.log.overflow = true;
                    g.store.log.flush_started = g.store.log.durable_lsn;
                    Err(e.into())
                }
                Ok(()) => {
                    Stats::add(&self.stats.flushes, 1);
                    g.store.log.batch_done(written);
                    Ok(())
                }
            }
        };
        self.log_flushed.notify_all();
        r
    }

    /// Writes a log batch (no flush) and notes it written; the caller holds `log_lock`.
    fn write_batch(&self, log_start: u64, batch: &crate::log::Batch) -> Result<()> {
        let t0 = std::time::Instant::now();
        Store::write_log(self.dev.as_ref(), &self.stats, log_start, batch)?;
        self.stats.log_write_latency.record(t0.elapsed());
        self.inner.lock().store.log.batch_written(batch.end_lsn);
        Ok(())
    }

    /// Commits and releases the device; the same as dropping `Fs` but reports errors.
    pub fn unmount(self) -> Result<()> {
        if !self.opts.readonly {
            self.commit()?;
        }
        Ok(())
    }

    /// Looks `name` up in directory `parent`.
    ///
    /// Lookups do not keep an inode alive: an inode whose last name goes away is freed
    /// at once unless it is open ([`Fs::open_ino`]). The kernel may still hold the inode
    /// number in its caches; requests on it then get ENOENT, as for any deleted file.
    /// Waiting for the kernel's FORGET instead would keep the space of deleted files
    /// unusable for as long as the kernel likes, which a full disk cannot afford.
    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        self.with(|i| i.lookup(parent, name))
    }

    /// Up to `max` names of `ino`, each as its parent directory and name.
    pub fn names_of(&self, ino: u64, max: usize) -> Result<Vec<(u64, Vec<u8>)>> {
        self.with(|i| i.names_of(ino, max))
    }

    /// Same as [`Fs::lookup`] (kept for callers that name the intent).
    pub fn lookup_nopin(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        self.with(|i| i.lookup(parent, name))
    }

    /// Resolves an absolute path inside the filesystem (`/a/b`), following no symlinks.
    pub fn resolve(&self, path: &str) -> Result<Attr> {
        self.with(|i| {
            let mut a = i.getattr(ROOT_INO)?;
            for c in path.split('/').filter(|c| !c.is_empty()) {
                a = i.lookup(a.ino, c.as_bytes())?;
            }
            Ok(a)
        })
    }

    /// The kernel forgot `n` lookups of `ino`: nothing to do (see [`Fs::lookup`]).
    pub fn forget(&self, _ino: u64, _n: u64) {}

    /// Pins `ino` for an open handle; `release` drops it.
    pub fn open_ino(&self, ino: u64) -> Result<Attr> {
        self.with(|i| {
            let a = i.getattr(ino)?;
            i.pin(ino, 1);
            Ok(a)
        })
    }

    /// Undoes an [`Fs::open_ino`] whose open was refused (no handle was made).
    pub fn cancel_open(&self, ino: u64) -> Result<()> {
        self.with(|i| i.unpin(ino, 1))
    }

    /// Releases an open handle of `ino`; writes back its cached data if it was
    /// truncated to size 0 while open (see `Inner::flush_on_close`).
    pub fn release(&self, ino: u64) -> Result<()> {
        let flush = self.with(|i| {
            let flush = i.flush_on_close.remove(&ino);
            i.unpin(ino, 1)?;
            Ok(flush)
        })?;
        if flush {
            self.write_back_replacement(ino, "at its close after a truncate");
        }
        Ok(())
    }

    /// Attributes of `ino`.
    pub fn getattr(&self, ino: u64) -> Result<Attr> {
        self.with(|i| i.getattr(ino))
    }

    /// Creates a node (file, fifo, device, socket) named `name` in `parent`, with
    /// the parent's default POSIX ACL if it has one (as [`Fs::create_inheriting`]
    /// with no umask).
    pub fn mknod(&self, parent: u64, name: &[u8], mode: u32, rdev: u64, cr: Creds) -> Result<Attr> {
        self.create_inheriting(parent, name, mode, rdev, cr, 0)
    }

    /// Creates a node as a FUSE request asks, with the caller's `umask`: the parent's
    /// default POSIX ACL, if it has one, gives the node its ACLs and masks its mode
    /// instead of the umask (see `acl`). Directories when `mode` says so. Under a
    /// setgid directory the node takes the directory's group, not `cr.gid` (and a
    /// directory the setgid bit), as every create here does.
    pub fn create_inheriting(
        &self,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u64,
        cr: Creds,
        umask: u32,
    ) -> Result<Attr> {
        self.create_pinned(parent, name, mode, rdev, cr, umask, false)
    }

    /// [`Fs::create_inheriting`] of a file that is opened at once: the new inode
    /// comes back pinned as by [`Fs::open_ino`] (one [`Fs::release`] unpins it).
    pub fn create_open(
        &self,
        parent: u64,
        name: &[u8],
        mode: u32,
        cr: Creds,
        umask: u32,
    ) -> Result<Attr> {
        self.create_pinned(parent, name, mode, 0, cr, umask, true)
    }

    /// [`Fs::create_inheriting`], pinning the new inode when `pin`.
    #[allow(clippy::too_many_arguments)]
    fn create_pinned(
        &self,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u64,
        cr: Creds,
        umask: u32,
        pin: bool,
    ) -> Result<Attr> {
        let dir = mode & libc::S_IFMT == libc::S_IFDIR;
        if dir && parent == SNAPSHOTS_INO {
            return self.snapshot_create(name);
        }
        Self::live_dir(parent)?;
        self.with_space(|i| {
            let inh = i.inherit(parent, mode, umask)?;
            let mut a = i.create_node(parent, name, inh.mode, rdev, cr, None)?;
            if !inh.xattrs.is_empty() {
                for (n, v) in &inh.xattrs {
                    if let Err(e) = i.setxattr(a.ino, n, v, false, false) {
                        // Undone whole, so that a retry after a commit starts afresh.
                        let _ = i.unlink(parent, name, dir);
                        return Err(e);
                    }
                }
                a = i.getattr(a.ino)?;
            }
            if pin {
                i.pin(a.ino, 1);
            }
            Ok(a)
        })
    }

    /// Sets the POSIX ACL `name` (`system.posix_acl_access` or `_default`) of `ino`
    /// from its xattr bytes, keeping the mode in step (see `acl`). `keep_sgid`: the
    /// caller is in the file's group or has CAP_FSETID; otherwise an access ACL clears
    /// S_ISGID, as Linux's `posix_acl_update_mode` does.
    pub fn set_acl(&self, ino: u64, name: &[u8], value: &[u8], keep_sgid: bool) -> Result<()> {
        if !acl::is_acl_name(name) {
            return Err(Error::Invalid("not a POSIX ACL name"));
        }
        Self::live(ino)?;
        self.with(|i| i.refuse_if_flagged(ino, FIXED))?;
        self.with_space(|i| i.set_acl(ino, name, value, keep_sgid))
    }

    /// Creates a directory, with the parent's default POSIX ACL if it has one (as
    /// [`Fs::create_inheriting`] with no umask); in `.snapshots`, takes a snapshot.
    pub fn mkdir(&self, parent: u64, name: &[u8], mode: u32, cr: Creds) -> Result<Attr> {
        self.create_inheriting(parent, name, libc::S_IFDIR | (mode & 0o7777), 0, cr, 0)
    }

    /// Creates a symlink to `target`.
    pub fn symlink(&self, parent: u64, name: &[u8], target: &[u8], cr: Creds) -> Result<Attr> {
        Self::live_dir(parent)?;
        self.with_space(|i| i.create_node(parent, name, libc::S_IFLNK | 0o777, 0, cr, Some(target)))
    }

    /// The target of a symlink.
    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        self.with(|i| i.readlink(ino))
    }

    /// Adds a name for `ino` in `parent`.
    pub fn link(&self, ino: u64, parent: u64, name: &[u8]) -> Result<Attr> {
        Self::live(ino)?;
        Self::live_dir(parent)?;
        self.with_space(|i| i.link(ino, parent, name))
    }

    /// Removes a non-directory name.
    pub fn unlink(&self, parent: u64, name: &[u8]) -> Result<()> {
        Self::live_dir(parent)?;
        self.with_space(|i| i.unlink(parent, name, false))
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()> {
        if parent == SNAPSHOTS_INO {
            return self.snapshot_delete(name);
        }
        Self::live(parent)?;
        self.with_space(|i| i.unlink(parent, name, true))
    }

    /// Renames, with RENAME_NOREPLACE and RENAME_EXCHANGE semantics.
    pub fn rename(
        &self,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        flags: RenameFlags,
    ) -> Result<()> {
        Self::live_dir(parent)?;
        Self::live_dir(newparent)?;
        if !flags.exchange && !flags.noreplace {
            self.write_back_replacing(parent, name, newparent, newname);
        }
        self.with_space(|i| i.rename(parent, name, newparent, newname, flags))
    }

    /// Before a rename of a regular file over another: writes back the cached data of
    /// the file that takes the name, so that the rename, logged after that data, never
    /// becomes durable without it (ext4's `auto_da_alloc`). Replacing a file by writing
    /// a new one and renaming it over the old without fsync then leaves the old
    /// content or the new after a crash, never an empty or short file. A failed
    /// writeback does not stop the rename (the data stays cached, as before).
    fn write_back_replacing(&self, parent: u64, name: &[u8], newparent: u64, newname: &[u8]) {
        let file = |e: Option<DirEntry>| e.filter(|e| e.dtype == libc::DT_REG).map(|e| e.ino);
        let src = self.with(|i| {
            let src = file(i.find_entry(parent, name)?);
            let old = file(i.find_entry(newparent, newname)?);
            Ok(src.filter(|&s| old.is_some_and(|o| o != s)))
        });
        if let Ok(Some(ino)) = src {
            self.write_back_replacement(ino, "before it replaces another");
        }
    }

    /// Writes back the cached data of `ino`, a file replacing older content (`when`
    /// says how, for the log), and counts it; a failure is logged, not returned: the
    /// data stays cached for a later writeback, as it would have without this.
    fn write_back_replacement(&self, ino: u64, when: &str) {
        if !self.cache.has_dirty(ino) {
            return;
        }
        Stats::add(&self.stats.replace_writebacks, 1);
        if let Err(e) = self.writeback(ino, u64::MAX) {
            tracing::warn!("writeback of inode {ino} {when}: {e}");
        }
    }

    /// rename with RENAME_WHITEOUT (overlayfs's upper layer): moves the entry and puts
    /// a whiteout (a 0:0 character device, mode 0, owned by `cr`) in its place, in one
    /// step. `noreplace` as RENAME_NOREPLACE.
    pub fn rename_whiteout(
        &self,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        noreplace: bool,
        cr: Creds,
    ) -> Result<()> {
        Self::live_dir(parent)?;
        Self::live_dir(newparent)?;
        if !noreplace {
            self.write_back_replacing(parent, name, newparent, newname);
        }
        self.with_space(|i| i.rename_whiteout(parent, name, newparent, newname, noreplace, cr))
    }

    /// Directory entries after `offset` (0 to start), at most `max` of them.
    pub fn readdir(&self, ino: u64, offset: u64, max: usize) -> Result<Vec<DirEntryOut>> {
        self.with(|i| i.readdir(ino, offset, max, u64::MAX))
    }

    /// Opens directory `ino` (pins it like [`Fs::open_ino`]); NotDir for others.
    pub fn opendir(&self, ino: u64) -> Result<Attr> {
        self.with(|i| {
            let a = i.getattr(ino)?;
            if a.kind != FileKind::Dir {
                return Err(Error::NotDir);
            }
            i.pin(ino, 1);
            Ok(a)
        })
    }

    /// The index bound for reading directory `ino` from its start with
    /// [`Fs::readdir_until`]: entries renamed or made from now on are left out, so
    /// that renaming each entry while reading does not list it again (and forever).
    pub fn readdir_bound(&self, ino: u64) -> Result<u64> {
        if ino == SNAPSHOTS_INO {
            return Ok(u64::MAX);
        }
        self.with(|i| i.next_dir_index(ino))
    }

    /// [`Fs::readdir`] without the entries whose index is `end` or more.
    pub fn readdir_until(
        &self,
        ino: u64,
        offset: u64,
        max: usize,
        end: u64,
    ) -> Result<Vec<DirEntryOut>> {
        self.with(|i| i.readdir(ino, offset, max, end))
    }

    /// The lock that orders writes, size changes and reads of one file.
    fn file_lock(&self, ino: u64) -> &RwLock<()> {
        &self.file_locks[(ino % FILE_LOCK_SHARDS as u64) as usize]
    }

    /// Where a file's data lives on the device, in file order (holes are absent).
    pub fn extent_map(&self, ino: u64) -> Result<Vec<ExtentInfo>> {
        self.with(|i| i.extent_map(ino))
    }

    /// Space and inode counts (`df`, `df -i`).
    pub fn statfs(&self) -> StatFs {
        let mut g = self.inner.lock();
        // Data an `rm` freed since the last commit waits in queued refcount drops
        // until then: counted free now, as `df` after `rm` and `sync` shows it on
        // btrfs (a sync that never reaches a FUSE daemon). An allocation that finds
        // no room commits and tries again, so that space is to be had.
        let soon = g.store.data_freed_by_queued_refs();
        let a = &g.store.alloc;
        let all_free = a.free_bytes() + a.pinned_bytes() + soon;
        let free = all_free.saturating_sub(self.cache.promised_bytes());
        // Cached writes hold room for their data and for the tree nodes their
        // writeback will copy: none of it is available.
        let bavail = all_free.saturating_sub(a.reserve() + g.promised_room()) / 4096;
        let numbers = objectid::LAST_INODE.min(snapshot::LIVE_INO_LIMIT) - g.next_ino;
        let ffree = numbers.min(bavail * INODES_PER_BLOCK);
        StatFs {
            bsize: 4096,
            blocks: g.store.data_bytes() / 4096,
            bfree: free / 4096,
            bavail,
            files: g.next_ino - objectid::ROOT_DIR + ffree,
            ffree,
            namelen: crate::format::NAME_MAX as u32,
        }
    }

    /// Discards the free space within `[start, start+len)` in pieces of at least
    /// `min_len` bytes (FITRIM): an image file gets it back as holes, a block device
    /// as discards. Commits first, cached data and all (as `sync` would), so that what
    /// was freed since the last commit is free to discard. Returns the bytes discarded.
    pub fn trim(&self, start: u64, len: u64, min_len: u64) -> Result<u64> {
        if self.opts.readonly {
            return Err(Error::ReadOnly);
        }
        // As ext4 and XFS answer FITRIM: a range that starts past the end, one shorter
        // than a block, or a smallest piece larger than the filesystem asks for nothing
        // that can be done (EINVAL).
        let size = self.dev.size();
        if start >= size || len < 4096 || min_len > size {
            return Err(Error::Invalid(
                "trim range starts past the end, is shorter than a block, or asks for \
                 pieces larger than the filesystem",
            ));
        }
        self.commit()?;
        let end = start.saturating_add(len);
        let (mut pos, mut trimmed) = (start, 0);
        while pos < end {
            // In pieces, each under the fs lock (which every allocation takes, so
            // nothing is handed out of a range while it is discarded), for a while
            // at a time.
            let g = self.inner.lock();
            let mut ranges = g
                .store
                .alloc
                .free_within(pos, end, min_len, TRIM_PIECE_BYTES);
            ranges.truncate(TRIM_PIECE_EXTENTS);
            let Some(&(s, l)) = ranges.last() else {
                break;
            };
            for &(s, l) in &ranges {
                if !self.dev.discard(s, l)? {
                    return Err(Error::NotSupported);
                }
                Stats::add(&self.stats.dev_discarded_bytes, l);
                trimmed += l;
            }
            drop(g);
            pos = s + l;
        }
        Ok(trimmed)
    }

    /// Online discard of what a durable commit freed (`freed`, still pinned): the runs
    /// of at least `min_len` bytes once adjacent pieces are joined. A failure only
    /// leaves space allocated on the host, so it is logged, not returned; a device
    /// that cannot discard is not asked again.
    fn discard_freed(&self, freed: &[(u64, u64)], min_len: u64) {
        if self
            .discard_unsupported
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        for (off, len) in discard_runs(freed, min_len) {
            match self.dev.discard(off, len) {
                Ok(true) => Stats::add(&self.stats.dev_discarded_bytes, len),
                Ok(false) => {
                    tracing::warn!("the device cannot discard: online discard is off");
                    self.discard_unsupported
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    return;
                }
                Err(e) => {
                    tracing::warn!("discard of {len} bytes at {off} failed: {e}");
                    return;
                }
            }
        }
    }

    /// Sets an extended attribute; `create`/`replace` as XATTR_CREATE/XATTR_REPLACE.
    pub fn setxattr(
        &self,
        ino: u64,
        name: &[u8],
        value: &[u8],
        create: bool,
        replace: bool,
    ) -> Result<()> {
        Self::live(ino)?;
        self.with(|i| i.refuse_if_flagged(ino, FIXED))?;
        self.with_space(|i| i.setxattr(ino, name, value, create, replace))
    }

    /// The value of an extended attribute.
    pub fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        self.with(|i| i.getxattr(ino, name))
    }

    /// Names of the extended attributes of `ino`.
    pub fn listxattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        self.with(|i| i.listxattr(ino))
    }

    /// Removes an extended attribute.
    pub fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()> {
        Self::live(ino)?;
        self.with(|i| i.refuse_if_flagged(ino, FIXED))?;
        self.with_space(|i| i.removexattr(ino, name))
    }

    /// The inode flags of `ino` (`lsattr`), as `FS_*_FL` bits.
    pub fn get_flags(&self, ino: u64) -> Result<u32> {
        Ok(self.getattr(ino)?.flags)
    }

    /// Sets the inode flags of `ino` (`chattr`): immutable, append-only, nodump and
    /// noatime ([`inode_flag`]); any other bit is not supported. Who may is the
    /// caller's check (Linux: the owner, and CAP_LINUX_IMMUTABLE for the first two).
    pub fn set_flags(&self, ino: u64, flags: u32) -> Result<Attr> {
        Self::live(ino)?;
        self.with(|i| {
            i.store.writable()?;
            i.set_flags(ino, u64::from(flags))
        })
    }

    /// Refuses (EPERM) an open with `flags` that the file's inode flags forbid, as
    /// Linux does: any write or truncate of an immutable file; of an append-only
    /// one, a truncate or a write without O_APPEND.
    pub fn check_open(a: &Attr, flags: i32) -> Result<()> {
        let acc = flags & libc::O_ACCMODE;
        let write = acc == libc::O_WRONLY || acc == libc::O_RDWR;
        let trunc = flags & libc::O_TRUNC != 0;
        let f = u64::from(a.flags);
        if f & inode_flag::IMMUTABLE != 0 && (write || trunc) {
            return Err(Error::Perm);
        }
        if f & inode_flag::APPEND != 0 && (trunc || (write && flags & libc::O_APPEND == 0)) {
            return Err(Error::Perm);
        }
        Ok(())
    }

    /// Checks `mask` (R_OK|W_OK|X_OK, or F_OK) for a caller with `uid`/`gid`/`groups`.
    pub fn access(&self, ino: u64, mask: i32, uid: u32, gid: u32, groups: &[u32]) -> Result<()> {
        let a = self.getattr(ino)?;
        if mask & libc::W_OK != 0 && is_snapshot_ino(ino) && ino != SNAPSHOTS_INO {
            return Err(Error::ReadOnly);
        }
        if mask & libc::W_OK != 0 && a.flags as u64 & inode_flag::IMMUTABLE != 0 {
            return Err(Error::Perm);
        }
        inode::check_access(&a, mask, uid, gid, groups)
    }
}

impl Drop for Fs {
    fn drop(&mut self) {
        if !self.opts.readonly {
            if let Err(e) = self.commit() {
                tracing::error!("final commit failed: {e}");
            }
        }
    }
}

/// The log a mount would replay (see [`log_batches`]).
pub(crate) struct FoundLog {
    /// The batches, in order.
    pub batches: Vec<Vec<crate::log::LogOp>>,
    /// Bytes of the log area that the batches found take (also those not replayed).
    pub used: u64,
    /// Set when the log ends at a damaged batch (one naming blocks outside the data
    /// area): its index.
    pub damaged: Option<usize>,
    /// Set when the log ends at a batch whose data would not read (a read error, not
    /// data that did not land): its index, and the error.
    pub unreadable: Option<(usize, std::io::Error)>,
}

/// The log batches a mount would replay on `dev` (superblock `sb`, running
/// generation `generation`): those of the running generation, and of the next when
/// a commit was in flight, up to the first whose data did not land, would not read
/// ([`FoundLog::unreadable`]), or that is damaged.
pub(crate) fn log_batches(
    dev: &dyn BlockDev,
    sb: &crate::format::Superblock,
    generation: u64,
) -> Result<FoundLog> {
    let bs = crate::format::BLOCK_SIZE as usize;
    let (start, len, head) = (sb.log_start, sb.log_len, sb.log_head);
    // After a clean unmount the log of the running generation is empty: the block
    // at its head (or at the area's start, where a batch goes that does not fit
    // before the end) tells.
    let mut at_head = vec![0u8; bs.min(len as usize)];
    let mut at_zero = vec![0u8; bs.min(len as usize)];
    dev.read_at(&mut at_head, start + head)?;
    dev.read_at(&mut at_zero, start)?;
    if !crate::log::starts_a_log(&at_head, &at_zero, &sb.fsid, generation) {
        return Ok(FoundLog {
            batches: Vec::new(),
            used: 0,
            damaged: None,
            unreadable: None,
        });
    }
    let mut area = crate::log::DevArea::new(dev, start, len);
    let first = crate::log::parse(&mut area, &sb.fsid, generation, head)?;
    let mut used = first.used;
    let mut found = first.batches;
    if first.closed {
        // A commit was in flight: the next generation's batches follow.
        let next = crate::log::parse(&mut area, &sb.fsid, generation + 1, first.end)?;
        used += next.used;
        found.extend(next.batches);
    }
    // A read that fails is no proof that data did not land: the caller learns of it
    // (a mount fails, the log untouched, rather than drop every later batch for good).
    let mut read = |addr: u64, buf: &mut [u8]| dev.read_at(buf, addr);
    let mut unreadable = None;
    let n = found.len();
    let (lo, hi) = (start + len, sb.total_bytes);
    let holes = crate::txn::super_holes(hi);
    let max_item = crate::txn::max_item_size(sb.node_size);
    let mut outside = false;
    let mut batches = Vec::with_capacity(n);
    for b in found {
        // No batch of this filesystem names blocks past its size or inserts an item
        // no node holds: one that does is damage, and replaying it would make extents
        // no check accepts, or nodes no commit can write.
        outside = !crate::log::within(&b, lo, hi, &holes, max_item);
        if outside {
            break;
        }
        match crate::log::data_landed(&b, &mut read) {
            Ok(true) => batches.push(b),
            Ok(false) => break,
            Err(e) => {
                unreadable = Some((batches.len(), e));
                break;
            }
        }
    }
    let damaged = outside.then_some(batches.len());
    if outside {
        tracing::warn!(
            "log replay stops at batch {} of {n}: it names blocks outside the \
             filesystem's data area ({lo:#x}..{hi:#x}, less its superblock copies), or \
             an item larger than a node holds, so it is damaged",
            batches.len()
        );
    } else if batches.len() < n && unreadable.is_none() {
        // The batches of a flush a crash cut short: answered fsyncs are never among them.
        tracing::info!(
            "log replay stops at batch {} of {n}: data it names did not land",
            batches.len()
        );
    }
    Ok(FoundLog {
        batches,
        used,
        damaged,
        unreadable,
    })
}

impl Inner {
    fn pin(&mut self, ino: u64, n: u64) {
        *self.pins.entry(ino).or_default() += n;
    }

    fn unpin(&mut self, ino: u64, n: u64) -> Result<()> {
        let left = match self.pins.get_mut(&ino) {
            Some(c) => {
                *c = c.saturating_sub(n);
                *c
            }
            None => return Ok(()),
        };
        if left == 0 {
            self.pins.remove(&ino);
            // Only `drop_link` leaves a pinned inode without links, and it notes it:
            // the inode is searched for only then, not at every last release.
            if !self.open_orphans.remove(&ino) || self.store.readonly {
                return Ok(());
            }
            if let Some(item) = self.get_inode_opt(ino)? {
                if item.nlink.get() == 0 {
                    self.free_inode(ino)?;
                }
            }
        }
        Ok(())
    }

    fn pinned(&self, ino: u64) -> bool {
        self.pins.contains_key(&ino)
    }

    /// Applies the log batches of the running generation (what was fsynced after the
    /// last commit), and of the next when a commit was in flight, to the trees;
    /// returns how many. See `log`.
    fn replay_log(&mut self) -> Result<usize> {
        let st = &mut self.store;
        let found = log_batches(st.dev.as_ref(), &st.sb, st.generation)?;
        if let Some((n, e)) = found.unreadable {
            tracing::error!(
                "log replay cannot read the data of batch {n}: {e}; the log is left as it \
                 is (mount read-only with nologreplay to see the last commit, or use \
                 `birchfs restore`)"
            );
            return Err(e.into());
        }
        let FoundLog { batches, used, .. } = found;
        // New batches go after everything found, which stays as it is until the next
        // commit is durable: a crash before that replays the same.
        st.log.skip_found(used);
        if batches.is_empty() {
            return Ok(0);
        }
        // Data the log names is in use before any replayed change allocates a node.
        for op in batches.iter().flatten() {
            if let crate::log::LogOp::DataRef { bytenr, len, delta } = op {
                if *delta > 0 {
                    st.alloc.mark_used(*bytenr, *len);
                }
            }
        }
        let ro = std::mem::replace(&mut st.readonly, false);
        st.log.enabled = false;
        let r = (|| {
            for op in batches.iter().flatten() {
                match op {
                    crate::log::LogOp::Insert { tree, key, val } => {
                        st.insert(*tree, *key, val.clone())?
                    }
                    crate::log::LogOp::Delete { tree, key } => {
                        st.delete(*tree, key)?;
                    }
                    crate::log::LogOp::DataRef { bytenr, len, delta } => {
                        st.data_ref(*bytenr, *len, *delta)
                    }
                }
            }
            Ok::<(), crate::Error>(())
        })();
        st.readonly = ro;
        // The replayed changes went to the trees alone.
        self.maps = Default::default();
        r?;
        tracing::info!("replayed {} log batches", batches.len());
        Ok(batches.len())
    }

    fn find_next_ino(&mut self) -> Result<u64> {
        let last = self
            .store
            .seek_le(tree::FS, &Key::new(objectid::LAST_INODE, 0, 0))?;
        Ok(last
            .map(|(k, _)| k.objectid + 1)
            .unwrap_or(objectid::FIRST_FREE)
            .max(objectid::FIRST_FREE))
    }
}

#[cfg(test)]
mod cache_tests;
#[cfg(test)]
mod reflink_tests;
#[cfg(test)]
mod snapshot_tests;
#[cfg(test)]
mod tests;
