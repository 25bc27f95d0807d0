//! The page cache: folios of file data by (inode, folio index), bounded in memory.
//!
//! Lock order: the cache's `state` lock, then a folio's lock; both are leaves below
//! the fs lock (`Inner`): nothing takes another lock while holding either, except
//! `state` → folio. No device I/O happens under either lock.
//!
//! A folio in use is pinned by its `Arc`: whoever took it from the map holds a strong
//! reference, and eviction (under `state`) only drops folios nobody else holds, so a
//! writer can never dirty a folio that has already left the cache.
//!
//! Dirty bytes double as the delayed-allocation reservation: a write is refused with
//! ENOSPC when the free space could not hold every dirty block once more.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::folio::{Folio, FolioBuf, MAX_BLOCKS};
use crate::format::BLOCK_SIZE;

const BS: u64 = BLOCK_SIZE;

/// The readahead window a sequential stream starts with.
const RA_INITIAL: u64 = 128 << 10;
/// The largest readahead window.
const RA_MAX: u64 = 4 << 20;

/// Most dirty bytes before writers write back themselves, however large the cache
/// (half of it otherwise). Through FUSE, data a writer sends is in the kernel's page
/// cache already, so more dirty data here only takes fresh memory; past this the
/// request threads write back beside the flusher. A 4 GiB sequential write on a 2-CPU VM
/// (`cache_size` 2.9 GiB; 3 interleaved rounds) went from 816-1,146 to 850-1,251
/// MiB/s with this and [`WINDOW_MAX`], the daemon's CPU from 2.6-3.2 s to 2.2-2.3 s;
/// uncapped, 280 MiB piled up dirty and the daemon spent 18% of its CPU clearing
/// fresh pages.
const DIRTY_MAX: u64 = 64 << 20;
/// Largest background-writeback threshold and drop-behind window (1/32 of the
/// cache otherwise): a stream's folios go to the device and leave soon after they
/// are written, and new folios take their buffers instead of fresh memory.
const WINDOW_MAX: u64 = 8 << 20;

/// How the cache is sized and when it writes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheOptions {
    /// Bytes of cached file data the cache may hold (folios, clean and dirty).
    pub cache_size: u64,
    /// Folio size in bytes: a power of two from 4 KiB to 1 MiB.
    pub folio_size: u64,
    /// Dirty data older than this is written back.
    pub dirty_expire: Duration,
    /// Track dirty state per 4 KiB block (seed 5); when off, a write dirties its whole
    /// folio and writeback writes whole folios (for comparison only).
    pub block_dirty: bool,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            cache_size: default_cache_size(),
            folio_size: 64 << 10,
            dirty_expire: Duration::from_secs(30),
            block_dirty: true,
        }
    }
}

/// The default cache size: an eighth of the memory this process may use, at least
/// 64 MiB (or a quarter of that memory, when that is less).
pub fn default_cache_size() -> u64 {
    let usable = super::memory::usable_memory();
    (usable / 8).max((64 << 20).min(usable / 4))
}

impl CacheOptions {
    /// Checks the sizes; the error names the bad option.
    pub fn validate(&self) -> Result<(), String> {
        let f = self.folio_size;
        if !f.is_power_of_two() || !(BS..=MAX_BLOCKS as u64 * BS).contains(&f) {
            return Err(format!(
                "folio_size must be a power of two from 4K to 1M, not {f}"
            ));
        }
        if self.cache_size < 4 * f {
            return Err(format!(
                "cache_size must hold at least four folios ({} bytes), not {}",
                4 * f,
                self.cache_size
            ));
        }
        Ok(())
    }
}

/// A folio in the cache, with its last use for LRU eviction.
#[derive(Debug)]
pub(crate) struct CachedFolio {
    pub(crate) folio: Mutex<Folio>,
    last_used: AtomicU64,
    /// Signalled when a writeback of the folio ends (see [`Folio::writeback`]).
    wb_done: Condvar,
}

impl CachedFolio {
    /// Waits, with the folio locked (`g`), until no writeback is writing it: its bytes
    /// may then change.
    pub(crate) fn wait_writeback(&self, g: &mut parking_lot::MutexGuard<'_, Folio>) {
        while g.writeback {
            self.wb_done.wait(g);
        }
    }

    /// Ends a writeback of the folio begun by setting [`Folio::writeback`]: its writers
    /// go on.
    pub(crate) fn end_writeback(&self) {
        self.folio.lock().writeback = false;
        self.wb_done.notify_all();
    }
}

/// How far ahead to read for a sequential reader.
#[derive(Debug, Clone, Copy)]
struct Readahead {
    window: u64,
    /// The furthest end of the stream's reads so far.
    next: u64,
}

/// The dirty state of one inode.
#[derive(Debug)]
struct DirtyInode {
    /// When it became dirty (for `dirty_expire`).
    since: Instant,
    /// Dirty blocks.
    blocks: u64,
    /// Folios that may hold dirty blocks; a folio dirtied again after writeback
    /// took it comes back in.
    folios: BTreeSet<u64>,
}

#[derive(Default)]
struct State {
    folios: BTreeMap<(u64, u64), Arc<CachedFolio>>,
    /// Inodes with dirty blocks (or a writeback that took them and may fail).
    dirty_inos: rustc_hash::FxHashMap<u64, DirtyInode>,
    readahead: rustc_hash::FxHashMap<u64, Readahead>,
}

/// The page cache of one mounted filesystem.
pub(crate) struct PageCache {
    opts: CacheOptions,
    state: Mutex<State>,
    /// Bytes of all folios.
    bytes: AtomicU64,
    /// Bytes of dirty blocks.
    dirty_bytes: AtomicU64,
    /// Bytes of dirty blocks plus the room held for data not counted dirty (see
    /// [`PageCache::hold`]), in one counter: bytes that move between the two (a
    /// write's copy, a writeback's take) are added before they are subtracted, so a
    /// read never finds them in neither, as two separate loads could.
    promised: AtomicU64,
    tick: AtomicU64,
    /// Wakes the flusher when dirty data passes the background threshold.
    kick: (Mutex<bool>, Condvar),
    /// Buffers of evicted folios, reused for new ones: the daemon's memory then stays
    /// near `cache_size` instead of growing with the allocator's per-thread slack.
    spare: Mutex<Spare>,
    /// Folios written back whole, oldest first, with the use they were queued at:
    /// dropped behind the writer once more than `behind_limit` bytes of them wait,
    /// unless used since (see [`PageCache::drop_behind`]).
    behind: Mutex<std::collections::VecDeque<(u64, u64, u64)>>,
    /// A size below `cache_size` the cache keeps to while the system is short of
    /// memory (`u64::MAX`: none); see [`PageCache::squeeze`].
    squeeze: AtomicU64,
}

/// Room [`PageCache::hold`] holds, released when this drops (or before, in part by
/// [`Held::sub`] or whole by [`Held::release`]).
pub(crate) struct Held<'a> {
    cache: &'a PageCache,
    n: AtomicU64,
}

impl Held<'_> {
    /// Holds `n` bytes more.
    pub(crate) fn add(&self, n: u64) {
        self.n.fetch_add(n, Ordering::Relaxed);
        self.cache.promised.fetch_add(n, Ordering::Relaxed);
    }

    /// Holds `n` bytes less (not below zero).
    pub(crate) fn sub(&self, n: u64) {
        let was = self
            .n
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
                Some(h.saturating_sub(n))
            })
            .unwrap_or(0);
        self.cache.unpromise(was.min(n));
    }

    /// Releases what it holds now.
    pub(crate) fn release(&self) {
        self.cache.unpromise(self.n.swap(0, Ordering::Relaxed));
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Buffers of evicted folios, kept for new ones, by kind.
#[derive(Default)]
struct Spare {
    /// Slots of huge-page chunks.
    contiguous: Vec<FolioBuf>,
    /// Pages of their own (or heap).
    paged: Vec<FolioBuf>,
}

impl Spare {
    fn len(&self) -> usize {
        self.contiguous.len() + self.paged.len()
    }
}

impl PageCache {
    pub(crate) fn new(opts: CacheOptions) -> PageCache {
        PageCache {
            opts,
            state: Mutex::new(State::default()),
            bytes: AtomicU64::new(0),
            dirty_bytes: AtomicU64::new(0),
            promised: AtomicU64::new(0),
            tick: AtomicU64::new(0),
            kick: (Mutex::new(false), Condvar::new()),
            spare: Mutex::new(Spare::default()),
            behind: Mutex::new(Default::default()),
            squeeze: AtomicU64::new(u64::MAX),
        }
    }

    /// The size the cache keeps to now: `cache_size`, or less while squeezed.
    pub(crate) fn size_limit(&self) -> u64 {
        self.opts
            .cache_size
            .min(self.squeeze.load(Ordering::Relaxed))
    }

    /// Under memory pressure (`short`), sets the size the cache keeps to at half of
    /// what it holds now (not below 16 MiB) and gives up its spare buffers; without
    /// it, doubles that size back towards `cache_size`. Freed folio memory goes back
    /// to the system while the cache is squeezed. Returns the size it keeps to now;
    /// the caller writes back and evicts to reach it.
    pub(crate) fn squeeze(&self, short: bool) -> u64 {
        let now = self.size_limit();
        let next = if short {
            (self.bytes().min(now) / 2).max(16 << 20).min(now)
        } else {
            now.saturating_mul(2)
        };
        let squeezed = next < self.opts.cache_size;
        self.squeeze
            .store(if squeezed { next } else { u64::MAX }, Ordering::Relaxed);
        super::arena::release_freed(squeezed);
        if short {
            let mut sp = self.spare.lock();
            sp.contiguous.clear();
            sp.paged.clear();
        }
        self.size_limit()
    }

    /// Bytes of written-back, unused folios kept before they are dropped behind.
    fn behind_limit(&self) -> u64 {
        (self.size_limit() / 32)
            .min(WINDOW_MAX)
            .max(4 * self.opts.folio_size)
    }

    /// The use count of `f`, for [`PageCache::drop_behind`].
    pub(crate) fn last_used(f: &CachedFolio) -> u64 {
        f.last_used.load(Ordering::Relaxed)
    }

    /// Drop-behind for streaming writers: `folios` of `ino` (index, use count when
    /// taken) were just written back whole. The kernel's page cache holds that data
    /// already, so keeping every such folio until the cache is full only costs fresh
    /// memory per folio; instead the oldest of them leave once more than
    /// `behind_limit` bytes wait, unless used, dirtied or held since.
    pub(crate) fn drop_behind(&self, ino: u64, folios: &[(u64, u64)]) {
        let fsz = self.opts.folio_size;
        let over: Vec<(u64, u64, u64)> = {
            let mut q = self.behind.lock();
            q.extend(folios.iter().map(|&(idx, used)| (ino, idx, used)));
            let keep = (self.behind_limit() / fsz) as usize;
            let n = q.len().saturating_sub(keep);
            q.drain(..n).collect()
        };
        if over.is_empty() {
            return;
        }
        let mut st = self.state.lock();
        for (ino, idx, used) in over {
            let Some(f) = st.folios.get(&(ino, idx)) else {
                continue;
            };
            let idle = Arc::strong_count(f) == 1
                && f.last_used.load(Ordering::Relaxed) == used
                && f.folio.try_lock().is_some_and(|g| !g.dirty.any());
            if idle {
                if let Some(f) = st.folios.remove(&(ino, idx)) {
                    self.bytes.fetch_sub(fsz, Ordering::Relaxed);
                    self.recycle(f);
                }
            }
        }
    }

    /// Most spare buffers kept: one eviction pass's worth.
    fn spare_cap(&self) -> usize {
        ((self.size_limit() / self.opts.folio_size / 8) as usize).max(4)
    }

    /// A folio buffer, reused when one is spare (and then not zeroed: a folio's
    /// bytes count only in blocks made uptodate, which are written whole). `whole`:
    /// the caller fills the whole folio, so it gets contiguous memory (see
    /// [`FolioBuf`]).
    fn buffer(&self, whole: bool) -> FolioBuf {
        let spare = {
            let mut sp = self.spare.lock();
            if whole {
                sp.contiguous.pop()
            } else {
                sp.paged.pop().or_else(|| sp.contiguous.pop())
            }
        };
        match spare {
            Some(b) => b,
            None if whole => FolioBuf::contiguous(self.opts.folio_size as usize),
            None => FolioBuf::new(self.opts.folio_size as usize),
        }
    }

    /// Keeps the buffer of a folio that left the cache, if nobody else holds it.
    fn recycle(&self, f: Arc<CachedFolio>) {
        if let Ok(f) = Arc::try_unwrap(f) {
            let mut spare = self.spare.lock();
            if spare.len() < self.spare_cap() {
                let b = f.folio.into_inner().data;
                if b.is_contiguous() {
                    spare.contiguous.push(b);
                } else {
                    spare.paged.push(b);
                }
            }
        }
    }

    pub(crate) fn opts(&self) -> &CacheOptions {
        &self.opts
    }

    pub(crate) fn folio_size(&self) -> u64 {
        self.opts.folio_size
    }

    /// Blocks per folio.
    pub(crate) fn blocks(&self) -> usize {
        (self.opts.folio_size / BS) as usize
    }

    /// Bytes of all cached folios.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Bytes of dirty blocks.
    pub(crate) fn dirty_bytes(&self) -> u64 {
        self.dirty_bytes.load(Ordering::Relaxed)
    }

    /// Bytes cached data holds room for (the delayed-allocation reservation): its
    /// dirty blocks and what [`PageCache::hold`] holds.
    pub(crate) fn promised_bytes(&self) -> u64 {
        self.promised.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes off the promise (never below zero).
    fn unpromise(&self, n: u64) {
        let _ = self
            .promised
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| {
                Some(p.saturating_sub(n))
            });
    }

    /// Holds room for `n` bytes of data not counted dirty, until the guard releases
    /// it: a write admitted and not yet copied into its folios, or dirty blocks a
    /// writeback took and has not yet found space for. Without it a write admitted
    /// meanwhile could take that room, and a writeback fail for want of it.
    pub(crate) fn hold(&self, n: u64) -> Held<'_> {
        self.promised.fetch_add(n, Ordering::Relaxed);
        Held {
            cache: self,
            n: AtomicU64::new(n),
        }
    }

    /// Dirty bytes past which writers write back before returning.
    pub(crate) fn dirty_limit(&self) -> u64 {
        (self.size_limit() / 2).min(DIRTY_MAX)
    }

    /// Dirty bytes past which the flusher starts writing back: early, so a streaming
    /// writer's data goes to the device while it writes and little is left for its
    /// closing fsync.
    pub(crate) fn background_limit(&self) -> u64 {
        (self.size_limit() / 32)
            .min(WINDOW_MAX)
            .max(self.opts.folio_size)
    }

    /// Counts `blocks` of folio `idx` of `ino` newly dirtied (after marking them in
    /// the folio, so a writeback that took the folio earlier either copies them or
    /// the folio is listed again here).
    pub(crate) fn add_dirty(&self, ino: u64, idx: u64, blocks: usize) {
        self.dirty_bytes
            .fetch_add(blocks as u64 * BS, Ordering::Relaxed);
        self.promised
            .fetch_add(blocks as u64 * BS, Ordering::Relaxed);
        let mut st = self.state.lock();
        let d = st.dirty_inos.entry(ino).or_insert_with(|| DirtyInode {
            since: Instant::now(),
            blocks: 0,
            folios: BTreeSet::new(),
        });
        d.blocks += blocks as u64;
        d.folios.insert(idx);
        drop(st);
        if self.dirty_bytes() > self.background_limit() {
            self.wake_flusher();
        }
    }

    /// Takes up to `max` folios of `ino` below index `below` that may be dirty, in
    /// file order, for writeback (which then counts what it copies with `sub_dirty`).
    pub(crate) fn take_dirty(
        &self,
        ino: u64,
        max: usize,
        below: u64,
    ) -> Vec<(u64, Arc<CachedFolio>)> {
        let mut st = self.state.lock();
        let st = &mut *st;
        let Some(d) = st.dirty_inos.get_mut(&ino) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        while out.len() < max {
            let Some(idx) = d.folios.pop_first() else {
                break;
            };
            if idx >= below {
                d.folios.insert(idx);
                break;
            }
            if let Some(f) = st.folios.get(&(ino, idx)) {
                out.push((idx, f.clone()));
            }
        }
        out
    }

    /// Counts `blocks` of `ino` no longer dirty.
    pub(crate) fn sub_dirty(&self, ino: u64, blocks: usize) {
        self.sub_dirty_locked(&mut self.state.lock(), ino, blocks);
    }

    fn sub_dirty_locked(&self, st: &mut State, ino: u64, blocks: usize) {
        let n = blocks as u64 * BS;
        let was = self
            .dirty_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                Some(d.saturating_sub(n))
            })
            .unwrap_or_default();
        // What left the dirty count leaves the promise.
        self.unpromise(was.min(n));
        if let Some(d) = st.dirty_inos.get_mut(&ino) {
            d.blocks = d.blocks.saturating_sub(blocks as u64);
        }
    }

    /// Forgets `ino` as dirty when nothing of it is (after a writeback finished, under
    /// the inode's writeback lock, so no other writeback of it is in flight).
    pub(crate) fn settle(&self, ino: u64) {
        let mut st = self.state.lock();
        if let Some(d) = st.dirty_inos.get(&ino) {
            if d.folios.is_empty() {
                // A count left over belongs to a folio dropped while a writer held it.
                let left = d.blocks;
                st.dirty_inos.remove(&ino);
                self.sub_dirty_locked(&mut st, ino, left as usize);
            }
        }
    }

    /// Byte ranges (offset, length) of the dirty blocks of `ino`, or `None` when more
    /// than `max` folios may hold some (the caller then makes do with the count).
    pub(crate) fn dirty_ranges_of(&self, ino: u64, max: usize) -> Option<Vec<(u64, u64)>> {
        let folios: Vec<(u64, Arc<CachedFolio>)> = {
            let st = self.state.lock();
            let Some(d) = st.dirty_inos.get(&ino) else {
                return Some(Vec::new());
            };
            if d.folios.len() > max {
                return None;
            }
            d.folios
                .iter()
                .filter_map(|&i| st.folios.get(&(ino, i)).map(|f| (i, f.clone())))
                .collect()
        };
        let (fsz, nb) = (self.folio_size(), self.blocks());
        let mut out = Vec::new();
        for (idx, f) in folios {
            let g = f.folio.lock();
            for (a, b) in g.dirty.runs(nb) {
                out.push((idx * fsz + a as u64 * BS, (b - a) as u64 * BS));
            }
        }
        Some(out)
    }

    /// Dirty blocks of `ino`.
    pub(crate) fn dirty_blocks_of(&self, ino: u64) -> u64 {
        self.state
            .lock()
            .dirty_inos
            .get(&ino)
            .map_or(0, |d| d.blocks)
    }

    fn touch(&self, f: &CachedFolio) {
        let t = self.tick.fetch_add(1, Ordering::Relaxed);
        f.last_used.store(t, Ordering::Relaxed);
    }

    /// The cached folio `idx` of `ino`, if any.
    #[cfg(test)]
    pub(crate) fn get(&self, ino: u64, idx: u64) -> Option<Arc<CachedFolio>> {
        let f = self.state.lock().folios.get(&(ino, idx)).cloned()?;
        self.touch(&f);
        Some(f)
    }

    /// The folio `idx` of `ino`, created empty when it is not cached; `whole`: the
    /// caller is about to fill all of it (a new folio then gets contiguous memory).
    pub(crate) fn get_or_create(&self, ino: u64, idx: u64, whole: bool) -> Arc<CachedFolio> {
        let f = {
            let mut st = self.state.lock();
            st.folios
                .entry((ino, idx))
                .or_insert_with(|| {
                    self.bytes
                        .fetch_add(self.opts.folio_size, Ordering::Relaxed);
                    Arc::new(CachedFolio {
                        folio: Mutex::new(Folio::with_buffer(self.buffer(whole))),
                        last_used: AtomicU64::new(0),
                        wb_done: Condvar::new(),
                    })
                })
                .clone()
        };
        self.touch(&f);
        f
    }

    /// The cached folios of `ino` with index in `[from, to)`, in order.
    #[cfg(test)]
    pub(crate) fn folios_of(&self, ino: u64, from: u64, to: u64) -> Vec<(u64, Arc<CachedFolio>)> {
        if from >= to {
            return Vec::new();
        }
        self.state
            .lock()
            .folios
            .range((ino, from)..(ino, to))
            .map(|(&(_, i), f)| (i, f.clone()))
            .collect()
    }

    /// Whether `ino` may have dirty folios.
    pub(crate) fn has_dirty(&self, ino: u64) -> bool {
        self.state.lock().dirty_inos.contains_key(&ino)
    }

    /// Inodes with dirty folios, oldest first.
    pub(crate) fn dirty_inodes(&self) -> Vec<(u64, Instant)> {
        let mut v: Vec<_> = self
            .state
            .lock()
            .dirty_inos
            .iter()
            .map(|(&i, d)| (i, d.since))
            .collect();
        v.sort_by_key(|&(i, t)| (t, i));
        v
    }

    /// Drops the folios of `ino` with indexes `from..to`, dirty or not (truncate,
    /// delete).
    pub(crate) fn discard(&self, ino: u64, from: u64, to: u64) {
        let mut st = self.state.lock();
        let keys: Vec<_> = st
            .folios
            .range((ino, from)..(ino, to.max(from)))
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            if let Some(f) = st.folios.remove(&k) {
                let mut g = f.folio.lock();
                let n = g.dirty.count();
                g.clear_dirty(0, MAX_BLOCKS);
                drop(g);
                self.sub_dirty_locked(&mut st, ino, n);
                if let Some(d) = st.dirty_inos.get_mut(&ino) {
                    d.folios.remove(&k.1);
                }
                self.bytes
                    .fetch_sub(self.opts.folio_size, Ordering::Relaxed);
                self.recycle(f);
            }
        }
        if from == 0 && to == u64::MAX {
            st.dirty_inos.remove(&ino);
            st.readahead.remove(&ino);
        }
    }

    /// Drops every folio of the inodes numbered `lo..=hi` (a deleted snapshot's).
    pub(crate) fn discard_inodes(&self, lo: u64, hi: u64) {
        let inos: BTreeSet<u64> = self
            .state
            .lock()
            .folios
            .range((lo, 0)..=(hi, u64::MAX))
            .map(|(k, _)| k.0)
            .collect();
        for ino in inos {
            self.discard(ino, 0, u64::MAX);
        }
    }

    /// Evicts clean folios nobody holds, least recently used first, when the cache
    /// is over its size; returns whether it is still over (too much is dirty).
    pub(crate) fn evict(&self) -> bool {
        let limit = self.size_limit();
        if self.bytes() <= limit {
            return false;
        }
        let target = limit - limit / 8;
        let mut st = self.state.lock();
        let mut clean: Vec<(u64, (u64, u64))> = st
            .folios
            .iter()
            .filter(|(_, f)| {
                Arc::strong_count(f) == 1 && f.folio.try_lock().is_some_and(|g| !g.dirty.any())
            })
            .map(|(k, f)| (f.last_used.load(Ordering::Relaxed), *k))
            .collect();
        clean.sort_unstable();
        for (_, k) in clean {
            if self.bytes() <= target {
                break;
            }
            if let Some(f) = st.folios.remove(&k) {
                self.recycle(f);
            }
            self.bytes
                .fetch_sub(self.opts.folio_size, Ordering::Relaxed);
        }
        self.bytes() > limit
    }

    /// How far past its end to read for the read `start..end` of `ino`: a window
    /// that doubles while reads continue a stream, and nothing for a random read.
    ///
    /// A read continues a stream when it is `adjacent` (what comes before it is
    /// cached, or it starts the file) or starts within [`RA_MAX`] of the furthest
    /// end the stream reached: the kernel sends a stream's reads from several
    /// threads at once, so they arrive out of order by up to its own readahead.
    pub(crate) fn readahead(&self, ino: u64, start: u64, end: u64, adjacent: bool) -> u64 {
        let mut st = self.state.lock();
        let ra = st
            .readahead
            .entry(ino)
            .or_insert(Readahead { window: 0, next: 0 });
        let near = ra.window > 0 && start.abs_diff(ra.next) <= RA_MAX;
        ra.window = match (adjacent || near, ra.window) {
            (false, _) => 0,
            (true, 0) => RA_INITIAL,
            (true, w) => (w * 2).min(RA_MAX),
        };
        ra.next = if ra.window > 0 { ra.next.max(end) } else { end };
        ra.window
    }

    /// Whether folio `idx` of `ino` is in the cache.
    pub(crate) fn has_folio(&self, ino: u64, idx: u64) -> bool {
        self.state.lock().folios.contains_key(&(ino, idx))
    }

    /// Wakes the flusher.
    pub(crate) fn wake_flusher(&self) {
        *self.kick.0.lock() = true;
        self.kick.1.notify_one();
    }

    /// Waits up to `d` for a wake-up.
    pub(crate) fn wait_flusher(&self, d: Duration) {
        let mut k = self.kick.0.lock();
        if !*k {
            self.kick.1.wait_for(&mut k, d);
        }
        *k = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(size: u64) -> PageCache {
        PageCache::new(CacheOptions {
            cache_size: size,
            folio_size: 16 << 10,
            ..Default::default()
        })
    }

    #[test]
    fn options_are_checked() {
        let ok = CacheOptions::default();
        assert!(ok.validate().is_ok());
        for f in [0, 2048, 3 << 12, 2 << 20] {
            let o = CacheOptions {
                folio_size: f,
                ..ok
            };
            assert!(o.validate().is_err(), "{f}");
        }
        let o = CacheOptions {
            cache_size: 64 << 10,
            ..ok
        };
        assert!(o.validate().is_err());
    }

    #[test]
    fn folios_filled_whole_get_contiguous_memory_and_spares_keep_their_kind() {
        let c = cache(4 << 20);
        let contiguous = |ino, idx| {
            c.get_or_create(ino, idx, false)
                .folio
                .lock()
                .data
                .is_contiguous()
        };
        let whole = c.get_or_create(1, 0, true);
        assert!(whole.folio.lock().data.is_contiguous());
        // A folio written in part gets pages of its own, so that a 4 KiB write does
        // not have the kernel clear a whole huge page.
        assert!(!contiguous(1, 1));
        // Evicted, each buffer is kept as what it is: the contiguous one goes to the
        // next folio filled whole, the paged one to a partly written one.
        let (w, p) = (
            whole.folio.lock().data.as_ptr(),
            c.get_or_create(1, 1, false).folio.lock().data.as_ptr(),
        );
        drop(whole);
        for idx in [0, 1] {
            let f = c.state.lock().folios.remove(&(1, idx)).unwrap();
            c.recycle(f);
        }
        assert_eq!(
            {
                let sp = c.spare.lock();
                (sp.contiguous.len(), sp.paged.len())
            },
            (1, 1)
        );
        assert_eq!(c.get_or_create(2, 0, true).folio.lock().data.as_ptr(), w);
        assert_eq!(c.get_or_create(2, 1, false).folio.lock().data.as_ptr(), p);
        // With no paged spare left, a partly written folio takes a contiguous one.
        let f = c.state.lock().folios.remove(&(2, 0)).unwrap();
        c.recycle(f);
        assert_eq!(c.get_or_create(3, 0, false).folio.lock().data.as_ptr(), w);
    }

    /// Bytes that move between held and dirty (a write's copy, a writeback's take)
    /// stay promised at every moment a reader may look.
    #[test]
    fn bytes_moving_between_held_and_dirty_stay_promised() {
        let c = cache(4 << 20);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let first = c.hold(BS);
        std::thread::scope(|sc| {
            let mover = sc.spawn(|| {
                let mut h = first;
                for _ in 0..200_000 {
                    // A write's copy: dirty, then no longer held.
                    c.add_dirty(1, 0, 1);
                    drop(h);
                    // A writeback's take: held, then no longer dirty.
                    h = c.hold(BS);
                    c.sub_dirty(1, 1);
                }
                stop.store(true, Ordering::Relaxed);
                h
            });
            let mut looks = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let p = c.promised_bytes();
                assert!(p >= BS, "promised {p} after {looks} looks");
                looks += 1;
            }
            assert_eq!(c.promised_bytes(), BS);
            drop(mover.join().unwrap());
        });
        assert_eq!(c.promised_bytes(), 0);
        assert_eq!(c.dirty_bytes(), 0);
    }

    #[test]
    fn drop_behind_frees_the_oldest_unused_written_folios_past_its_budget() {
        // 4 MiB cache of 16 KiB folios: the budget is 128 KiB, eight folios.
        let c = cache(4 << 20);
        let keep = (c.behind_limit() / c.folio_size()) as usize;
        assert_eq!(keep, 8);
        let queue = |idx: u64| {
            let f = c.get_or_create(1, idx, false);
            (idx, PageCache::last_used(&f))
        };
        // Folios 0..4 are each left in a state that must keep them.
        let q: Vec<_> = (0..20).map(queue).collect();
        let held = c.get_or_create(1, 0, false);
        c.get(1, 1); // read again since it was written back
        {
            let d = c.get_or_create(1, 2, false);
            let mut g = d.folio.lock();
            g.uptodate.set_range(0, 1);
            g.mark_dirty(0, 1); // written again
        }
        c.drop_behind(1, &q[..2]);
        c.drop_behind(1, &q[2..]);
        // Twelve past the budget were due: 0..12 minus the three kept.
        let left: Vec<u64> = (0..20).filter(|&i| c.has_folio(1, i)).collect();
        assert_eq!(
            left,
            [0, 1, 2].into_iter().chain(12..20).collect::<Vec<_>>()
        );
        assert_eq!(c.bytes(), 11 * c.folio_size());
        // What left went to the spare buffers, so new folios reuse that memory.
        assert_eq!(c.spare.lock().len(), 9);
        drop(held);
        // The queue holds only the last eight; nothing is dropped twice.
        assert_eq!(c.behind.lock().len(), keep);
        c.drop_behind(1, &[]);
        assert_eq!(c.bytes(), 11 * c.folio_size());
    }

    #[test]
    fn eviction_keeps_dirty_and_held_folios_and_drops_the_oldest_clean() {
        let c = cache(64 << 10); // four folios of 16 KiB
        let held = c.get_or_create(1, 0, false);
        {
            let d = c.get_or_create(1, 1, false);
            let mut g = d.folio.lock();
            g.uptodate.set_range(0, 1);
            g.mark_dirty(0, 1);
        }
        for i in 2..8 {
            c.get_or_create(1, i, false);
        }
        c.get(1, 2); // used again: younger than 3..8
        assert_eq!(c.bytes(), 8 * (16 << 10));
        assert!(!c.evict());
        let left: Vec<u64> = c.folios_of(1, 0, 100).iter().map(|x| x.0).collect();
        assert!(left.contains(&0), "held folio evicted: {left:?}");
        assert!(left.contains(&1), "dirty folio evicted: {left:?}");
        assert!(!left.contains(&3), "oldest clean folio kept: {left:?}");
        assert!(c.bytes() <= 64 << 10);
        drop(held);
    }

    #[test]
    fn eviction_reports_a_cache_full_of_dirty_folios() {
        let c = cache(64 << 10);
        for i in 0..6 {
            let f = c.get_or_create(7, i, false);
            let mut g = f.folio.lock();
            g.uptodate.set_range(0, 4);
            g.mark_dirty(0, 4);
        }
        assert!(c.evict());
        assert_eq!(c.folios_of(7, 0, 10).len(), 6);
    }

    #[test]
    fn discard_returns_the_reservation_and_settle_forgets_clean_inodes() {
        let c = cache(1 << 20);
        for i in 0..3 {
            let f = c.get_or_create(5, i, false);
            let mut g = f.folio.lock();
            g.uptodate.set_range(0, 2);
            let n = g.mark_dirty(0, 2);
            drop(g);
            c.add_dirty(5, i, n);
        }
        assert_eq!(c.dirty_bytes(), 6 * BS);
        assert_eq!(c.dirty_blocks_of(5), 6);
        c.discard(5, 1, u64::MAX);
        assert_eq!(c.dirty_bytes(), 2 * BS);
        assert_eq!(c.dirty_blocks_of(5), 2);
        assert!(c.has_dirty(5));
        c.settle(5);
        assert!(c.has_dirty(5), "folio 0 is still dirty");
        let taken = c.take_dirty(5, 10, u64::MAX);
        assert_eq!(taken.len(), 1);
        assert_eq!(taken[0].0, 0);
        {
            let mut g = taken[0].1.folio.lock();
            g.clear_dirty(0, 2);
            c.sub_dirty(5, 2);
        }
        assert!(c.take_dirty(5, 10, u64::MAX).is_empty());
        c.settle(5);
        assert!(!c.has_dirty(5));
        assert_eq!(c.dirty_bytes(), 0);
    }

    #[test]
    fn readahead_grows_with_a_stream_and_stops_for_random_reads() {
        let c = cache(1 << 20);
        const MB: u64 = 1 << 20;
        let windows: Vec<u64> = (0..8)
            .map(|k| c.readahead(9, k * MB, (k + 1) * MB, true))
            .collect();
        assert_eq!(windows[0], RA_INITIAL);
        assert!(windows.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(*windows.last().unwrap(), RA_MAX);
        // Far from the stream and nothing cached before it: a random read.
        assert_eq!(c.readahead(9, 100 * MB, 100 * MB + 4096, false), 0);
        assert_eq!(c.readahead(9, 0, MB, true), RA_INITIAL);
    }

    #[test]
    fn readahead_keeps_a_stream_whose_reads_arrive_out_of_order() {
        let c = cache(1 << 20);
        const MB: u64 = 1 << 20;
        assert_eq!(c.readahead(9, 0, MB, true), RA_INITIAL);
        // The read after next overtook the next one: not adjacent, but near.
        assert_eq!(c.readahead(9, 2 * MB, 3 * MB, false), 2 * RA_INITIAL);
        assert_eq!(c.readahead(9, MB, 2 * MB, false), 4 * RA_INITIAL);
        // A read beyond the stream's reach starts over.
        assert_eq!(
            c.readahead(9, 3 * MB + RA_MAX + 1, 4 * MB + RA_MAX, false),
            0
        );
        // And a read near where that one ended does not count as the old stream's.
        assert_eq!(c.readahead(9, 2 * MB, 3 * MB, false), 0);
    }
}
