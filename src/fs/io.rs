//! Reads and writes through the page cache, and writeback with delayed allocation.
//!
//! A write copies into folios and marks only the blocks it touches dirty; it reads a
//! block first only when it covers part of it and the block is not cached (seed 5).
//! No space is allocated and no tree changes: the new size and times wait in
//! `Inner::pending` (every inode read sees them). Writeback takes runs of contiguous
//! dirty blocks, allocates each run's space in one piece (or takes the file's own
//! preallocated blocks under it, see `file`), writes it without the fs lock and
//! maps it; so sequential writes make large extents and random overwrites stay
//! block-sized.
//!
//! Locks: writeback of one inode at a time (`wb_locks`, sharded, taken after the file
//! lock and before `commit_lock`). Writers do not take it: writeback clears the dirty
//! bits of what it copies, and a block dirtied again meanwhile is simply written again
//! later. A write notes the size it makes before it copies, so writeback never maps
//! blocks past a size it does not know. Truncate, hole punching and preallocation take
//! both the file lock and the writeback lock, write back, and drop the folios they
//! change. Cloning takes those of both files, each pair in shard order, and drops the
//! target's folios.

use std::sync::Arc;

use super::Fs;
use crate::cache::{CachedFolio, Folio, Held, PageCache};
use crate::error::{Error, Result};
use crate::format::{inode_flag, BLOCK_SIZE, MAX_EXTENT_SIZE, MAX_FILE_SIZE};
use crate::stats::Stats;

const BS: u64 = BLOCK_SIZE;

/// Most dirty bytes one writeback pass takes from the cache before writing them.
const WB_CHUNK: u64 = 8 << 20;

/// Files whose writeback failed that one pass at bringing the cache within its limits
/// passes over before it gives up (a full host fails them all).
const PASSED_OVER: usize = 4;

/// Readahead windows queued at most (older ones are dropped first): four streams'.
const RA_QUEUE_MAX: usize = 16;

/// Stretch of a file whose fills take turns (see `Fs::fill_missing`): the largest
/// readahead window.
const FILL_SPAN: u64 = 4 << 20;

/// Readahead windows the readahead threads keep ahead of a sequential reader (four
/// 4 MiB windows keep about three device reads in flight).
const RA_AHEAD: u64 = 4;

/// Most extents one clone step shares under the fs lock.
const CLONE_STEP_EXTENTS: usize = 512;

/// Most bytes one copy_file_range copies by reading and writing (a short copy is
/// allowed; callers loop).
const COPY_MAX: u64 = 64 << 20;

/// Byte chunk of such a copy.
const COPY_CHUNK: u64 = 1 << 20;

/// Contiguous dirty blocks taken from the cache, with where they came from. They are
/// written from the folios' own buffers, under writeback (see [`InWriteback`]).
struct DirtyRun {
    off: u64,
    /// Bytes in the run.
    len: u64,
    /// (folio, its index, first block, end block)
    parts: Vec<(Arc<CachedFolio>, u64, usize, usize)>,
}

/// Folios a writeback writes from: their [`crate::cache::Folio::writeback`] is set,
/// and dropping this ends it, whether the writes succeeded or not.
struct InWriteback(Vec<Arc<CachedFolio>>);

impl Drop for InWriteback {
    fn drop(&mut self) {
        for f in self.0.drain(..) {
            f.end_writeback();
        }
    }
}

impl DirtyRun {
    /// The run's bytes, a segment per part.
    ///
    /// SAFETY: each part's folio must be under writeback by the caller, which keeps
    /// the bytes of its dirty blocks from changing or going away until the writeback
    /// ends, and the slices must not be used after that.
    unsafe fn segments(&self) -> Vec<&[u8]> {
        self.parts
            .iter()
            .map(|(f, _, a, b)| {
                let g = f.folio.lock();
                debug_assert!(g.writeback, "a run's folio is not under writeback");
                let (s, e) = (*a * BS as usize, *b * BS as usize);
                let ptr = g.data[s..e].as_ptr();
                // SAFETY: the folio's buffer lives as long as the `Arc` the run holds
                // (a folio is recycled only when unshared), and while it is under
                // writeback no one writes these blocks (writers wait; fills touch only
                // blocks that are not uptodate; truncates and hole punches hold the
                // writeback lock); the caller keeps it so.
                unsafe { std::slice::from_raw_parts(ptr, e - s) }
            })
            .collect()
    }
}

/// Blocks of one folio a read must fetch from the device: `[a, b)`.
struct Missing {
    folio: Arc<CachedFolio>,
    /// File offset of block `a`.
    off: u64,
    a: usize,
    b: usize,
}

impl Missing {
    /// The parts of the runs `missing` that lie in the file range `from..to`.
    fn within(missing: &[Missing], from: u64, to: u64) -> Vec<Missing> {
        missing
            .iter()
            .filter_map(|m| {
                let base = m.off - m.a as u64 * BS;
                let a = m.a.max((from.saturating_sub(base) / BS) as usize);
                let b = m.b.min((to.saturating_sub(base)).div_ceil(BS) as usize);
                (a < b).then(|| Missing {
                    folio: m.folio.clone(),
                    off: base + a as u64 * BS,
                    a,
                    b,
                })
            })
            .collect()
    }
}

/// Two locks of one shard table in table order; the second is `None` when both are
/// the same lock (two inodes of one shard).
fn in_order<'a, T>(a: &'a T, b: &'a T) -> (&'a T, Option<&'a T>) {
    match (a as *const T).cmp(&(b as *const T)) {
        std::cmp::Ordering::Equal => (a, None),
        std::cmp::Ordering::Less => (a, Some(b)),
        std::cmp::Ordering::Greater => (b, Some(a)),
    }
}

/// The parts of `[from, to)` that none of `covered` (sorted by start) covers.
pub(super) fn gaps(covered: &[(u64, u64)], from: u64, to: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut pos = from;
    for &(s, e) in covered {
        if e <= pos {
            continue;
        }
        if s >= to {
            break;
        }
        if s > pos {
            out.push((pos, s));
        }
        pos = pos.max(e);
    }
    if pos < to {
        out.push((pos, to));
    }
    out
}

/// Groups sorted block numbers into runs `[a, b)`.
fn runs_of(blocks: &[usize]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &k in blocks {
        match out.last_mut() {
            Some(r) if r.1 == k => r.1 += 1,
            _ => out.push((k, k + 1)),
        }
    }
    out
}

impl Fs {
    /// The lock that keeps two writebacks of one inode apart.
    fn wb_lock(&self, ino: u64) -> &parking_lot::Mutex<()> {
        &self.wb_locks[(ino % self.wb_locks.len() as u64) as usize]
    }

    /// Writes `data` at `offset`; returns the bytes written (fewer only when an error
    /// stopped it after some of them).
    ///
    /// The data lands in the page cache; space is reserved (ENOSPC comes here, not at
    /// writeback) but allocated only at writeback.
    pub fn write(&self, ino: u64, offset: u64, data: &[u8]) -> Result<usize> {
        self.write_as(ino, offset, data, true)
    }

    /// [`Fs::write`] of data the kernel's writeback cache sends: the kernel keeps the
    /// file's mtime and ctime itself and sends them when they change (a SETATTR at
    /// fsync, close or writeback), so this write leaves them alone. Stamping them
    /// here would store a time the kernel never showed (the write may come long
    /// after the `write(2)`, or after the kernel's SETATTR).
    pub fn write_cached(&self, ino: u64, offset: u64, data: &[u8]) -> Result<usize> {
        self.write_as(ino, offset, data, false)
    }

    /// [`Fs::write`], stamping the file's times with the time of the write if `stamp`.
    fn write_as(&self, ino: u64, offset: u64, data: &[u8], stamp: bool) -> Result<usize> {
        Self::live(ino)?;
        let _f = self.file_lock(ino).write();
        let len = data.len() as u64;
        let end = offset.checked_add(len).ok_or(Error::TooBig)?;
        if end > MAX_FILE_SIZE {
            return Err(Error::TooBig);
        }
        let cache = &self.cache;
        if len > 0 {
            // Room in memory before anything changes: a cache that failing writebacks
            // keep past its size refuses the write whole, with their error, rather
            // than grow without bound or fail it after its bytes went in.
            self.make_room()?;
        }
        let fsz = cache.folio_size();
        let span = if cache.opts().block_dirty {
            (offset / BS * BS, end.div_ceil(BS) * BS)
        } else {
            (offset / fsz * fsz, end.div_ceil(fsz) * fsz)
        };
        // The room admitted is held until the copy counts it dirty, a folio at a
        // time: a write to another file admitted meanwhile sees it taken.
        let (size, held) = self.with_space(|i| {
            let own = stamp.then_some(offset);
            let size = i.write_begin(
                ino,
                span,
                cache.promised_bytes(),
                (len > 0).then_some(end),
                own,
            )?;
            Ok((size, cache.hold(span.1 - span.0)))
        })?;
        if len == 0 {
            return Ok(0);
        }
        #[cfg(test)]
        super::run_hook(&self.write_hook, false);
        let mut pos = offset;
        let mut err = None;
        while pos < end {
            if let Err(e) = self.write_folio(ino, size, pos, end, &data[(pos - offset) as usize..])
            {
                err = Some(e);
                break;
            }
            // This folio's share of the room now counts as dirty: hold it no longer,
            // so a write admitted meanwhile is not refused for room this one uses.
            let fstart = pos / fsz * fsz;
            held.sub((fstart + fsz).min(span.1) - fstart.max(span.0));
            pos = fstart + fsz;
        }
        let pos = pos.min(end);
        #[cfg(test)]
        super::run_hook(&self.write_hook, true);
        drop(held);
        // A write that copied nothing (its first block would not read) leaves the
        // size as it was, also past the end.
        let reached = if pos > offset { pos } else { size };
        self.with(|i| i.note_write(ino, size, reached, stamp && pos > offset))?;
        Stats::add(&self.stats.user_bytes, pos - offset);
        if let Some(e) = err {
            if pos == offset {
                return Err(e);
            }
            tracing::warn!("short write of inode {ino} at {pos}: {e}");
        }
        self.balance(ino);
        Ok((pos - offset) as usize)
    }

    /// Copies the part of a write that falls in the folio holding `pos`; `data` starts
    /// at `pos` and the write ends at `end`; `size` is the file size before the write.
    fn write_folio(&self, ino: u64, size: u64, pos: u64, end: u64, data: &[u8]) -> Result<()> {
        let cache = &self.cache;
        let fsz = cache.folio_size();
        let idx = pos / fsz;
        let fstart = idx * fsz;
        let wend = end.min(fstart + fsz);
        let a = ((pos - fstart) / BS) as usize;
        let b = (wend - fstart).div_ceil(BS) as usize;
        // The blocks this write makes dirty: the ones it touches, or with per-block
        // tracking off, every block of the folio up to the end of the file.
        let (da, db) = if cache.opts().block_dirty {
            (a, b)
        } else {
            let in_file = size.max(end).saturating_sub(fstart).div_ceil(BS) as usize;
            (0, b.max(in_file.min(cache.blocks())))
        };
        let covered =
            |k: usize| fstart + k as u64 * BS >= pos && fstart + (k as u64 + 1) * BS <= wend;
        let f = cache.get_or_create(ino, idx, a == 0 && b == cache.blocks());
        let need: Vec<usize> = {
            let g = f.folio.lock();
            (da..db)
                .filter(|&k| !g.uptodate.get(k) && !covered(k) && fstart + (k as u64) * BS < size)
                .collect()
        };
        let mut fetched = Vec::new();
        if !need.is_empty() {
            let runs = runs_of(&need);
            let plans = self.with(|i| {
                runs.iter()
                    .map(|&(x, y)| {
                        i.plan_range(ino, fstart + x as u64 * BS, fstart + y as u64 * BS)
                    })
                    .collect::<Result<Vec<_>>>()
            })?;
            for ((x, _), p) in runs.into_iter().zip(plans) {
                let buf = p.execute(self.dev.as_ref())?;
                Stats::add(&self.stats.dev_read_bytes, buf.len() as u64);
                fetched.push((x, buf));
            }
        }
        let mut g = f.folio.lock();
        // The bytes of a folio being written back stay as they are until it ends.
        f.wait_writeback(&mut g);
        for (x, buf) in fetched {
            for (n, block) in buf.chunks(BS as usize).enumerate() {
                let k = x + n;
                if !g.uptodate.get(k) {
                    g.data
                        .range_mut(k * BS as usize..(k + 1) * BS as usize)
                        .copy_from_slice(block);
                    g.uptodate.set_range(k, k + 1);
                }
            }
        }
        // Blocks still not uptodate in [da, db) are covered by the write or lie past
        // the end of the file: zeros plus what is copied below.
        for k in da..db {
            if !g.uptodate.get(k) && !covered(k) {
                g.data
                    .range_mut(k * BS as usize..(k + 1) * BS as usize)
                    .fill(0);
            }
        }
        let s = (pos - fstart) as usize;
        g.data
            .range_mut(s..s + (wend - pos) as usize)
            .copy_from_slice(&data[..(wend - pos) as usize]);
        g.uptodate.set_range(da, db);
        let newly = g.mark_dirty(da, db);
        drop(g);
        cache.add_dirty(ino, idx, newly);
        Ok(())
    }

    /// Reads up to `size` bytes at `offset`, from the cache where it can; a sequential
    /// stream also brings the following blocks in (readahead).
    ///
    /// Only blocks that are not uptodate are read from the device. They are not dirty,
    /// so no writeback moves them meanwhile, and the file's lock (shared) keeps writes,
    /// truncates and hole punches of this file out until the read is done.
    pub fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.read_into(ino, offset, size, &mut out)?;
        Ok(out)
    }

    /// [`Fs::read`] into `out` (its contents replaced), so that a caller can keep one
    /// buffer for many reads: a fresh large buffer per read costs a page fault per
    /// 4 KiB (the FUSE server reuses one per thread).
    pub fn read_into(&self, ino: u64, offset: u64, size: u32, out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        let _f = self.file_lock(ino).read();
        let fsize = self.with(|i| i.check_file(ino).map(|it| it.size.get()))?;
        if offset >= fsize || size == 0 {
            return Ok(());
        }
        let end = (offset + size as u64).min(fsize);
        let cache = &self.cache;
        let fsz = cache.folio_size();
        // Part of a stream when the folio of the byte before the read is in the cache
        // (or at the start), or near where the stream's reads reached (see
        // `PageCache::readahead`).
        let adjacent = offset == 0 || cache.has_folio(ino, (offset - 1) / fsz);
        let ra = cache.readahead(ino, offset, end, adjacent);
        // The window is fetched in aligned pieces of its own size, so a stream reads
        // the device in large requests rather than one request-sized slice at a time.
        // With a readahead thread, this read fetches (what is missing of) the window
        // it ends in and queues the next one, which the thread reads from the device
        // while the kernel takes this one; without, it fetches both.
        let window_end = if ra == 0 { end } else { end.div_ceil(ra) * ra }.min(fsize);
        let async_ra = ra > 0 && self.ra_thread.load(std::sync::atomic::Ordering::Relaxed);
        let fill_end = if ra == 0 || async_ra {
            window_end
        } else {
            (end + ra).div_ceil(ra) * ra
        }
        .min(fsize);
        let mut held: Vec<(u64, Arc<CachedFolio>)> = Vec::new();
        let missing = self.missing_in(ino, offset, fill_end, end, &mut held);
        if missing.iter().any(|m| m.off < end) {
            Stats::add(&self.stats.read_waits, 1);
        }
        if let Err(e) = self.fill_missing(ino, &missing) {
            // A bad block in the readahead must not fail a read of good ones: fill
            // just what was asked for (as the kernel rereads a failed readahead's pages
            // one by one).
            let own = Missing::within(&missing, offset, end);
            let blocks = |v: &[Missing]| v.iter().map(|m| m.b - m.a).sum::<usize>();
            if blocks(&own) == blocks(&missing) {
                return Err(e);
            }
            tracing::debug!("readahead of inode {ino} failed ({e}); reading the request alone");
            self.fill_missing(ino, &own)?;
        }
        drop(missing);
        // The thread stays RA_AHEAD windows ahead, so a reader crossing into the next
        // window finds it read rather than waiting for the device.
        if async_ra {
            let mut w = window_end;
            for _ in 0..RA_AHEAD {
                if w >= fsize {
                    break;
                }
                self.queue_readahead(ino, w, (w + ra).min(fsize));
                w += ra;
            }
        }
        // The held folios cover the read in order: append each one's part (no
        // zeroing of `out` first).
        out.reserve((end - offset) as usize);
        for (idx, f) in &held {
            let fstart = idx * fsz;
            let s = offset.max(fstart);
            let e = end.min(fstart + fsz);
            debug_assert_eq!(out.len() as u64, s - offset);
            let g = f.folio.lock();
            out.extend_from_slice(&g.data[(s - fstart) as usize..(e - fstart) as usize]);
        }
        debug_assert_eq!(out.len() as u64, end - offset);
        Stats::add(&self.stats.user_read_bytes, out.len() as u64);
        // A stream's reader leaves behind folios it read to their end: the kernel
        // caches what it read, so they may drop behind like a streaming writer's.
        let behind: Vec<(u64, u64)> = if ra > 0 {
            held.iter()
                .filter(|(idx, _)| end >= (idx + 1) * fsz)
                .map(|(idx, f)| (*idx, PageCache::last_used(f)))
                .collect()
        } else {
            Vec::new()
        };
        drop(held);
        if !behind.is_empty() {
            cache.drop_behind(ino, &behind);
        }
        self.balance(ino);
        Ok(())
    }

    /// The blocks of `ino` in `from..to` that are not uptodate, as runs within their
    /// folios (created as needed); the folios before `keep_end` are pushed to `held`.
    fn missing_in(
        &self,
        ino: u64,
        from: u64,
        to: u64,
        keep_end: u64,
        held: &mut Vec<(u64, Arc<CachedFolio>)>,
    ) -> Vec<Missing> {
        let cache = &self.cache;
        let fsz = cache.folio_size();
        let mut missing: Vec<Missing> = Vec::new();
        for idx in from / fsz..to.div_ceil(fsz) {
            let fstart = idx * fsz;
            let a = (from.max(fstart) - fstart) / BS;
            let b = (to.min(fstart + fsz) - fstart).div_ceil(BS);
            let whole = a == 0 && b as usize == cache.blocks();
            let f = cache.get_or_create(ino, idx, whole);
            {
                let g = f.folio.lock();
                let want: Vec<usize> = (a as usize..b as usize)
                    .filter(|&k| !g.uptodate.get(k))
                    .collect();
                for (x, y) in runs_of(&want) {
                    missing.push(Missing {
                        folio: f.clone(),
                        off: fstart + x as u64 * BS,
                        a: x,
                        b: y,
                    });
                }
            }
            if fstart < keep_end {
                held.push((idx, f));
            }
        }
        missing
    }

    /// Queues `start..end` of `ino` for the readahead thread, unless it is queued or
    /// already (being) cached.
    pub(crate) fn queue_readahead(&self, ino: u64, start: u64, end: u64) {
        if self.cache.has_folio(ino, start / self.cache.folio_size()) {
            return;
        }
        let mut q = self.ra_queue.lock();
        if q.iter().any(|&(i, s, _)| i == ino && s == start) {
            return;
        }
        // A stream that ran away from its readahead leaves stale windows: keep few.
        if q.len() >= RA_QUEUE_MAX {
            q.pop_front();
        }
        q.push_back((ino, start, end));
        self.ra_wake.notify_one();
    }

    /// One step of the readahead thread: waits up to `wait` for a queued window, then
    /// reads what of it is not cached. A daemon calls it in a loop on its own thread;
    /// from the first call on, sequential readers leave the next window to it.
    pub fn readahead_step(&self, wait: std::time::Duration) -> Result<()> {
        self.ra_thread
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let job = {
            let mut q = self.ra_queue.lock();
            if q.is_empty() {
                self.ra_wake.wait_for(&mut q, wait);
            }
            q.pop_front()
        };
        let Some((ino, start, end)) = job else {
            return Ok(());
        };
        let _f = self.file_lock(ino).read();
        // The file may have shrunk or gone since the window was queued.
        let Ok(fsize) = self.with(|i| i.check_file(ino).map(|it| it.size.get())) else {
            return Ok(());
        };
        let end = end.min(fsize);
        if start >= end {
            return Ok(());
        }
        let missing = self.missing_in(ino, start, end, 0, &mut Vec::new());
        if missing.is_empty() {
            return Ok(());
        }
        self.fill_missing(ino, &missing)?;
        Stats::add(&self.stats.readahead_async, 1);
        drop(missing);
        self.balance(ino);
        Ok(())
    }

    /// Reads the `missing` blocks of `ino` from the device into their folios, the
    /// pieces of each contiguous range (ranges may span folios) in flight together,
    /// straight into the folios' buffers (their locks held meanwhile).
    ///
    /// Readers filling the same stretch of a file ([`FILL_SPAN`], where the first
    /// missing block lies) take turns (`fill_locks`), and each looks again once it
    /// has the lock: the kernel sends a sequential stream's reads from several threads
    /// at once, and their readahead windows overlap. Stretches apart fill in parallel
    /// (the readahead thread reads the next window while a reader fills this one).
    /// Two fills of one block (ranges reaching into the next stretch) would only read
    /// it twice: writers, which change blocks, hold the file's lock exclusively.
    fn fill_missing(&self, ino: u64, missing: &[Missing]) -> Result<()> {
        if missing.is_empty() {
            return Ok(());
        }
        let span = missing[0].off / FILL_SPAN;
        let shard = (ino.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ span) % self.fill_locks.len() as u64;
        let _l = self.fill_locks[shard as usize].lock();
        let mut still = Vec::with_capacity(missing.len());
        for m in missing {
            let g = m.folio.folio.lock();
            let want: Vec<usize> = (m.a..m.b).filter(|&k| !g.uptodate.get(k)).collect();
            for (x, y) in runs_of(&want) {
                still.push(Missing {
                    folio: m.folio.clone(),
                    off: m.off + (x - m.a) as u64 * BS,
                    a: x,
                    b: y,
                });
            }
        }
        let missing = &still[..];
        // (file offset, end, first and last index into `missing`)
        let mut ranges: Vec<(u64, u64, usize, usize)> = Vec::new();
        for (n, m) in missing.iter().enumerate() {
            let e = m.off + (m.b - m.a) as u64 * BS;
            match ranges.last_mut() {
                Some(r) if r.1 == m.off && r.1 - r.0 < MAX_EXTENT_SIZE * 4 => {
                    r.1 = e;
                    r.3 = n + 1;
                }
                _ => ranges.push((m.off, e, n, n + 1)),
            }
        }
        let plans = self.with(|i| {
            ranges
                .iter()
                .map(|r| i.plan_range(ino, r.0, r.1))
                .collect::<Result<Vec<_>>>()
        })?;
        thread_local! {
            /// Each thread's device read buffer, reused (pieces are at most an extent).
            static SCRATCH: std::cell::RefCell<crate::dev::AlignedBuf> =
                std::cell::RefCell::new(crate::dev::AlignedBuf::default());
        }
        for (r, plan) in ranges.iter().zip(plans) {
            let group = &missing[r.2..r.3];
            // Straight into the folios (their locks held, in file order: a range has
            // one run per folio), unless a piece needs a buffer of its own.
            {
                let mut guards: Vec<_> = group.iter().map(|m| m.folio.folio.lock()).collect();
                let mut bufs: Vec<(usize, &mut [u8])> = group
                    .iter()
                    .zip(guards.iter_mut())
                    .map(|(m, g)| {
                        let (a, b) = (m.a * BS as usize, m.b * BS as usize);
                        ((m.off - r.0) as usize, g.data.range_mut(a..b))
                    })
                    .collect();
                if let Some(read) = plan.read_direct(self.dev.as_ref(), &mut bufs)? {
                    drop(bufs);
                    let filled: Vec<(u64, u64)> = read
                        .iter()
                        .map(|&(s, e)| (r.0 + s as u64, r.0 + e as u64))
                        .collect();
                    let bytes = filled.iter().map(|(s, e)| e - s).sum();
                    Stats::add(&self.stats.dev_read_bytes, bytes);
                    for (m, g) in group.iter().zip(guards.iter_mut()) {
                        Self::settle_filled(m, g, &filled);
                    }
                    continue;
                }
            }
            // File ranges the device filled; the rest of the range is holes.
            let mut filled: Vec<(u64, u64)> = Vec::new();
            // Copies verified bytes at `at` (from the range start) into the folios.
            let mut put = |at: usize, bytes: &[u8]| {
                let (s, e) = (r.0 + at as u64, r.0 + (at + bytes.len()) as u64);
                filled.push((s, e));
                for m in group {
                    let me = m.off + (m.b - m.a) as u64 * BS;
                    let (cs, ce) = (s.max(m.off), e.min(me));
                    if cs >= ce {
                        continue;
                    }
                    let mut g = m.folio.folio.lock();
                    let fo = (m.a as u64 * BS + cs - m.off) as usize;
                    g.data
                        .range_mut(fo..fo + (ce - cs) as usize)
                        .copy_from_slice(&bytes[(cs - s) as usize..(ce - s) as usize]);
                }
                Stats::add(&self.stats.dev_read_bytes, bytes.len() as u64);
            };
            SCRATCH
                .with(|b| plan.for_each_piece(self.dev.as_ref(), &mut b.borrow_mut(), &mut put))?;
            filled.sort_unstable();
            for m in group {
                Self::settle_filled(m, &mut m.folio.folio.lock(), &filled);
            }
        }
        Ok(())
    }

    /// Marks the run `m` of a folio (`g`, locked) uptodate once the device `filled`
    /// those file ranges (sorted) of it: the rest are holes, which read as zeros (a
    /// folio buffer may hold an older folio's bytes).
    fn settle_filled(m: &Missing, g: &mut Folio, filled: &[(u64, u64)]) {
        let me = m.off + (m.b - m.a) as u64 * BS;
        let base = m.off - m.a as u64 * BS;
        for (hs, he) in gaps(filled, m.off, me) {
            g.data
                .range_mut((hs - base) as usize..(he - base) as usize)
                .fill(0);
        }
        g.uptodate.set_range(m.a, m.b);
    }

    /// Keeps the cache within its limits after a read or a write of `ino`; a failure
    /// is logged. Past the dirty limit the writer writes back its own file first,
    /// then [`Fs::shed`] a chunk of each file at a time.
    fn balance(&self, ino: u64) {
        let cache = &self.cache;
        if cache.dirty_bytes() > cache.dirty_limit() && cache.has_dirty(ino) {
            self.soft_writeback(ino, WB_CHUNK);
        }
        // The caller's bytes were copied: a failure is for the next write (which it
        // refuses whole, see `write_as`), an fsync or the flusher to report.
        if let Err(e) = self.shed(WB_CHUNK) {
            tracing::debug!("the page cache stays past its size: {e}");
        }
    }

    /// Brings the cache within its limits: past the dirty limit the oldest dirty files
    /// are written back, up to `per_file` bytes of each; past its size clean folios
    /// are evicted, and when too much is dirty for that, the oldest dirty files are
    /// written back first. Only a failure of the latter is an error: the cache's size
    /// is the bound, the dirty limit only a point to start writing back.
    fn shed(&self, per_file: u64) -> Result<()> {
        let cache = &self.cache;
        if cache.dirty_bytes() > cache.dirty_limit() {
            let mut failures = 0;
            for (other, _) in cache.dirty_inodes() {
                if cache.dirty_bytes() <= cache.dirty_limit() || failures == PASSED_OVER {
                    break;
                }
                // A file whose writeback fails is passed over for the next.
                if !self.soft_writeback(other, per_file) {
                    failures += 1;
                }
            }
        }
        self.make_room()
    }

    /// Brings the cache within its size: evicts clean folios, and when too much is
    /// dirty for that, writes back the oldest dirty files first. Fails only when the
    /// cache stays past its size because writebacks failed, with the first error.
    fn make_room(&self) -> Result<()> {
        let cache = &self.cache;
        let (mut first, mut failures) = (None, 0);
        if cache.evict() {
            for (other, _) in cache.dirty_inodes() {
                // A file whose writeback fails is passed over for the next (it freed
                // nothing to evict).
                if let Err(e) = self.writeback(other, WB_CHUNK) {
                    first.get_or_insert(e);
                    failures += 1;
                    if failures == PASSED_OVER {
                        break;
                    }
                    continue;
                }
                if !cache.evict() {
                    return Ok(());
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// A writeback past the dirty limit, which the writer that pays it does not fail
    /// on: what could not be written stays dirty for the flusher, an fsync or a sync
    /// to try again and report (a full host keeps taking writes into the cache, as
    /// Limits says). Returns whether it wrote.
    fn soft_writeback(&self, ino: u64, max: u64) -> bool {
        match self.writeback(ino, max) {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!("writeback of inode {ino} past the dirty limit failed: {e}");
                false
            }
        }
    }

    /// Where the data (`data`: SEEK_DATA) or the hole (SEEK_HOLE) at or after `offset`
    /// of file `ino` begins, once its dirty blocks are written back: written extents
    /// are data; gaps between them and preallocated extents read as zeros and are
    /// holes, as on btrfs, and the end of the file starts one. [`Error::PastEnd`]
    /// (ENXIO) when `offset` is at or past the end, or no data follows it.
    pub fn seek_data_hole(&self, ino: u64, offset: u64, data: bool) -> Result<u64> {
        let a = self.getattr(ino)?;
        if a.kind != super::FileKind::File {
            return Err(Error::Invalid("not a regular file"));
        }
        if offset >= a.size {
            return Err(Error::PastEnd);
        }
        self.writeback(ino, u64::MAX)?;
        let size = a.size;
        // The extents are read a window at a time, from 1 MiB doubling, so that an
        // answer costs a search and the extents up to it, not every extent to the end
        // of the file: `cp` of a file of n extents seeks 2n times (150,000 extents
        // took 6 minutes when each seek listed all of them).
        let mut pos = offset;
        let mut window: u64 = 1 << 20;
        while pos < size {
            let end = pos.saturating_add(window).min(size);
            let mut written: Vec<(u64, u64)> = self
                .with(|i| i.extents_in(ino, pos, end))?
                .into_iter()
                .filter(|(_, fe)| fe.kind != crate::format::FILE_EXTENT_PREALLOC)
                .map(|(off, fe)| (off, off.saturating_add(fe.num_bytes.get())))
                .collect();
            written.sort_unstable();
            for (start, stop) in written {
                if data && stop > pos {
                    return Ok(start.max(pos));
                }
                if !data {
                    if start > pos {
                        return Ok(pos.min(size));
                    }
                    pos = pos.max(stop);
                }
            }
            if !data && pos < end {
                // Nothing written in [pos, end): a hole.
                return Ok(pos);
            }
            pos = pos.max(end);
            window = window.saturating_mul(2);
        }
        if data {
            Err(Error::PastEnd)
        } else {
            Ok(size)
        }
    }

    /// Bytes of `ino`'s data dirty in the cache, waiting for writeback.
    pub fn dirty_bytes_of(&self, ino: u64) -> u64 {
        self.cache.dirty_blocks_of(ino) * BS
    }

    /// Writes back up to about `max` bytes of the dirty blocks of `ino` (all of them
    /// with `u64::MAX`); returns the bytes written.
    ///
    /// The writeback lock is taken before looking: a writeback of `ino` in flight
    /// elsewhere has taken its blocks from the cache, and an fsync must wait for it.
    pub(crate) fn writeback(&self, ino: u64, max: u64) -> Result<u64> {
        let _w = self.wb_lock(ino).lock();
        if !self.cache.has_dirty(ino) {
            return Ok(0);
        }
        self.writeback_locked(ino, max, u64::MAX)
    }

    /// [`Fs::writeback`] for a caller that holds the writeback lock of `ino`, of the
    /// folios below index `below`.
    fn writeback_locked(&self, ino: u64, max: u64, below: u64) -> Result<u64> {
        let cache = &self.cache;
        let fsz = cache.folio_size();
        let nb = cache.blocks();
        let mut done = 0;
        while done < max {
            let mut runs: Vec<DirtyRun> = Vec::new();
            let mut taken = 0u64;
            let want = (WB_CHUNK.min(max - done) / fsz).max(1) as usize;
            let folios = cache.take_dirty(ino, want, below);
            if folios.is_empty() {
                break;
            }
            // Blocks taken keep their room until `write_runs` has space for them.
            let held = cache.hold(0);
            let mut busy = InWriteback(Vec::with_capacity(folios.len()));
            for (idx, f) in folios {
                let mut g = f.folio.lock();
                let dirty = g.dirty.runs(nb);
                if dirty.is_empty() {
                    continue;
                }
                // One writeback of an inode at a time (the writeback lock).
                debug_assert!(
                    !g.writeback,
                    "folio {idx} of inode {ino} written back twice"
                );
                g.writeback = true;
                busy.0.push(f.clone());
                for &(a, b) in &dirty {
                    let off = idx * fsz + a as u64 * BS;
                    let len = (b - a) as u64 * BS;
                    match runs.last_mut() {
                        // A run is at most one extent long.
                        Some(r) if r.off + r.len == off && r.len + len <= MAX_EXTENT_SIZE => {
                            r.len += len;
                            r.parts.push((f.clone(), idx, a, b));
                        }
                        _ => runs.push(DirtyRun {
                            off,
                            len,
                            parts: vec![(f.clone(), idx, a, b)],
                        }),
                    }
                    taken += len;
                }
                let n = g.dirty.count();
                g.clear_dirty(0, nb);
                drop(g);
                held.add(n as u64 * BS);
                cache.sub_dirty(ino, n);
            }
            if runs.is_empty() {
                continue;
            }
            #[cfg(test)]
            super::run_hook(&self.writeback_hook, false);
            if let Err(e) = self.write_runs(ino, &runs, &held) {
                // The blocks are dirty again, so a later writeback (or fsync) retries.
                for r in &runs {
                    for (f, idx, a, b) in &r.parts {
                        let n = f.folio.lock().mark_dirty(*a, *b);
                        cache.add_dirty(ino, *idx, n);
                    }
                }
                return Err(e);
            }
            drop(busy);
            // Folios this writeback wrote whole (a streaming writer's) may drop behind.
            let mut whole = Vec::new();
            for r in runs {
                for (f, idx, a, b) in r.parts {
                    if a == 0 && b == nb {
                        whole.push((idx, PageCache::last_used(&f)));
                    }
                }
            }
            cache.drop_behind(ino, &whole);
            done += taken;
        }
        cache.settle(ino);
        Ok(done)
    }

    /// Finds space for each run (in place over the file's own preallocated blocks,
    /// new elsewhere), writes the runs there and maps them in the file. `held` holds
    /// the runs' room until their space is found, and again if their write fails
    /// (the caller makes them dirty again).
    fn write_runs(&self, ino: u64, runs: &[DirtyRun], held: &Held<'_>) -> Result<()> {
        // The preallocated blocks chosen stay the file's until they are mapped: the
        // writeback lock keeps its extents as planned (truncate, hole punching,
        // fallocate and cloning take it), and space an unlink frees meanwhile is
        // held back until the writes end (`begin_in_place`).
        let (spaces, filled) = self.with_space(|i| {
            let mut v: Vec<Vec<super::file::Piece>> = Vec::new();
            for r in runs {
                match i.space_for_run(ino, r.off, r.len) {
                    Ok(s) => v.push(s),
                    Err(e) => {
                        for s in &v {
                            i.release_space(s);
                        }
                        return Err(e);
                    }
                }
            }
            let filled: u64 = v
                .iter()
                .flatten()
                .filter(|p| p.into.is_some())
                .map(|p| p.len)
                .sum();
            if filled > 0 {
                i.store.alloc.begin_in_place();
            }
            held.release();
            Ok((v, filled))
        })?;
        // SAFETY: the runs' folios are under writeback until the caller's
        // `InWriteback` drops, after this returns.
        let segs: Vec<Vec<&[u8]>> = runs.iter().map(|r| unsafe { r.segments() }).collect();
        let batch: Vec<super::file::RunToWrite> = spaces
            .iter()
            .zip(&segs)
            .map(|(s, g)| (s.as_slice(), &g[..]))
            .collect();
        let written = super::file::write_runs_to(self.dev.as_ref(), &self.stats, &batch);
        if filled > 0 {
            self.inner.lock().store.alloc.end_in_place();
        }
        let sums = match written {
            Ok(s) => s,
            Err(e) => {
                let mut g = self.inner.lock();
                held.add(runs.iter().map(|r| r.len).sum());
                for s in &spaces {
                    g.release_space(s);
                }
                return Err(e);
            }
        };
        Stats::add(&self.stats.writeback_runs, runs.len() as u64);
        Stats::add(&self.stats.prealloc_filled_bytes, filled);
        let placed: Vec<super::file::WrittenRun> = runs
            .iter()
            .zip(spaces)
            .zip(sums)
            .map(|((r, s), c)| (r.off, s, c))
            .collect();
        self.with(|i| i.map_written(ino, placed))
    }

    /// Writes back every dirty block of every file; returns the first error after
    /// trying them all.
    pub(crate) fn writeback_all(&self) -> Result<()> {
        let mut first = None;
        for (ino, _) in self.cache.dirty_inodes() {
            if let Err(e) = self.writeback(ino, u64::MAX) {
                tracing::error!("writeback of inode {ino} failed: {e}");
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// One step of the background flusher: waits up to `wait` to be woken (dirty data
    /// past the background threshold), then writes back files whose dirty data is
    /// older than `dirty_expire`, and the oldest ones while the dirty data stays past
    /// the threshold. A daemon calls it in a loop on its own thread.
    pub fn flush_background(&self, wait: std::time::Duration) -> Result<()> {
        let cache = &self.cache;
        cache.wait_flusher(wait);
        let expire = cache.opts().dirty_expire;
        let mut failed = None;
        for (ino, since) in cache.dirty_inodes() {
            let expired = since.elapsed() >= expire;
            let over = cache.dirty_bytes() > cache.background_limit();
            if !expired && !over {
                break;
            }
            // A file whose writeback fails does not hold up the others'.
            if let Err(e) = self.writeback(ino, if expired { u64::MAX } else { WB_CHUNK }) {
                failed.get_or_insert(e);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Under memory pressure (`short`), halves what the page cache may hold and sheds
    /// down to it (`Fs::shed`: the oldest dirty files written back whole past the
    /// lower dirty limit, clean folios evicted); without it, lets the cache grow back,
    /// doubling per call, to `cache_size`.
    /// Servers call it about once a second with [`crate::MemoryPressure::short`].
    pub fn relieve_memory(&self, short: bool) -> Result<()> {
        let cache = &self.cache;
        let was = cache.size_limit();
        if !short && was >= cache.opts().cache_size {
            return Ok(());
        }
        let limit = cache.squeeze(short);
        if !short || limit >= was {
            return Ok(());
        }
        Stats::add(&self.stats.memory_squeezes, 1);
        tracing::info!(
            "memory is short: the page cache keeps to {} MiB",
            limit >> 20
        );
        self.shed(u64::MAX)
    }

    /// Before a change of `ino`'s blocks in the tree (truncate, hole punch,
    /// preallocation), with the file and writeback locks held: writes back the cached
    /// folios below index `keep_below`, then drops those from `invalidate_from` on,
    /// whose device copy is about to change. Folios from `keep_below` on (wholly past
    /// a truncate's new size) stay as they are, dirty or not, for the caller to drop
    /// once the change succeeded: a failed truncate loses no data.
    fn settle_for_change(&self, ino: u64, keep_below: u64, invalidate_from: u64) -> Result<()> {
        self.writeback_locked(ino, u64::MAX, keep_below)?;
        self.cache.discard(ino, invalidate_from, keep_below);
        Ok(())
    }

    /// Shares `len` bytes of `src` at `src_off` into `dst` at `dst_off` without copying
    /// them (a reflink, like FICLONERANGE): later writes to either file un-share only
    /// the blocks they write. Offsets must be block aligned, and `len` too unless the
    /// range ends at the end of `src`; 0 means up to the end of `src`. Returns the
    /// bytes cloned.
    pub fn clone_range(
        &self,
        src: u64,
        src_off: u64,
        dst: u64,
        dst_off: u64,
        len: u64,
    ) -> Result<u64> {
        self.copy_range(src, src_off, dst, dst_off, len, true)
    }

    /// copy_file_range(2): copies up to `len` bytes of `src` at `src_off` to `dst` at
    /// `dst_off`, sharing the whole blocks when both offsets sit at the same place in
    /// a block and copying the rest. Stops at the end of `src`; returns the bytes done
    /// (fewer than asked when a byte copy reached its per-call bound).
    pub fn copy_file_range(
        &self,
        src: u64,
        src_off: u64,
        dst: u64,
        dst_off: u64,
        len: u64,
    ) -> Result<u64> {
        if len == 0 {
            return Ok(0);
        }
        self.copy_range(src, src_off, dst, dst_off, len, false)
    }

    fn copy_range(
        &self,
        src: u64,
        soff: u64,
        dst: u64,
        doff: u64,
        len: u64,
        clone_only: bool,
    ) -> Result<u64> {
        // A snapshot's files may be the source: that restores them without a copy.
        Self::live(dst)?;
        let ssize = self.with(|i| {
            i.check_file(dst)?;
            i.refuse_if_flagged(dst, super::FIXED)?;
            Ok(i.check_file(src)?.size.get())
        })?;
        if clone_only && (soff % BS != 0 || doff % BS != 0) {
            return Err(Error::Invalid("clone offsets must be block aligned"));
        }
        if soff >= ssize {
            return Ok(0);
        }
        let len = if len == 0 {
            ssize - soff
        } else {
            len.min(ssize - soff)
        };
        if src == dst && soff < doff + len && doff < soff + len {
            return Err(Error::Invalid("overlapping ranges of one file"));
        }
        if doff.checked_add(len).is_none_or(|e| e > MAX_FILE_SIZE) {
            return Err(Error::TooBig);
        }
        // Whole blocks are shared when both ranges reach them at the same point;
        // the bytes before and after them are copied.
        let head = if soff % BS == doff % BS {
            ((BS - soff % BS) % BS).min(len)
        } else {
            len
        };
        let mid = (len - head) / BS * BS;
        let tail = len - head - mid;
        if clone_only && ((tail != 0 && soff + len != ssize) || head != 0) {
            return Err(Error::Invalid("clone length must be block aligned"));
        }
        let mut done = self.copy_bytes(src, soff, dst, doff, head.min(COPY_MAX))?;
        if done < head {
            return Ok(done);
        }
        if mid > 0 {
            done += self.clone_whole_blocks(src, soff + done, dst, doff + done, mid)?;
        }
        if tail > 0 && done == head + mid {
            done += self.copy_bytes(src, soff + done, dst, doff + done, tail)?;
        }
        Ok(done)
    }

    /// Copies `len` bytes by reading and writing through the cache.
    fn copy_bytes(&self, src: u64, soff: u64, dst: u64, doff: u64, len: u64) -> Result<u64> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(COPY_CHUNK);
            let data = self.read(src, soff + done, n as u32)?;
            if data.is_empty() {
                break;
            }
            let w = self.write(dst, doff + done, &data)?;
            done += w as u64;
            if w < data.len() {
                break;
            }
        }
        Ok(done)
    }

    /// Shares the block-aligned `[soff, soff + len)` of `src` at `doff` of `dst`, with
    /// both files' locks held; returns the bytes shared.
    fn clone_whole_blocks(
        &self,
        src: u64,
        soff: u64,
        dst: u64,
        doff: u64,
        len: u64,
    ) -> Result<u64> {
        // Each pair in one order (their place in the shard table), each lock once.
        let (f1, f2) = in_order(self.file_lock(src), self.file_lock(dst));
        let _f1 = f1.write();
        let _f2 = f2.map(|l| l.write());
        let (w1, w2) = in_order(self.wb_lock(src), self.wb_lock(dst));
        let _w1 = w1.lock();
        let _w2 = w2.map(|l| l.lock());
        // The trees must hold both files' latest data: the source's is what gets
        // shared, and the target's dirty blocks must not land over the clone later.
        self.writeback_locked(src, u64::MAX, u64::MAX)?;
        if dst != src {
            self.writeback_locked(dst, u64::MAX, u64::MAX)?;
        }
        let mut done = 0;
        let mut res = Ok(());
        while done < len {
            match self.with_space(|i| {
                i.clone_blocks(
                    src,
                    soff + done,
                    dst,
                    doff + done,
                    len - done,
                    CLONE_STEP_EXTENTS,
                )
            }) {
                Ok(n) => done += n,
                Err(e) => {
                    res = Err(e);
                    break;
                }
            }
        }
        // The target's cached folios from the clone on show what it replaced.
        self.cache
            .discard(dst, doff / self.cache.folio_size(), u64::MAX);
        Stats::add(&self.stats.cloned_bytes, done);
        match res {
            Err(e) if done == 0 => Err(e),
            Err(e) => {
                tracing::warn!("short clone into inode {dst} at {}: {e}", doff + done);
                Ok(done)
            }
            Ok(()) => Ok(done),
        }
    }

    /// Changes attributes; size changes truncate or extend the file.
    pub fn setattr(&self, ino: u64, set: &super::SetAttr) -> Result<super::Attr> {
        Self::live(ino)?;
        let Some(size) = set.size else {
            return self.with_space(|i| {
                i.check_setattr_allowed(ino, set)?;
                i.setattr(ino, set)
            });
        };
        // Before cached data past the new size is dropped.
        self.with(|i| i.check_setattr_allowed(ino, set))?;
        let _f = self.file_lock(ino).write();
        let _w = self.wb_lock(ino).lock();
        let file = self.with(|i| i.check_file(ino)).is_ok();
        let fsz = self.cache.folio_size();
        if file {
            self.settle_for_change(ino, size.div_ceil(fsz), size / fsz)?;
        }
        let a = self.with_space(|i| {
            let emptied = size == 0 && i.pinned(ino) && i.get_inode(ino)?.size.get() > 0;
            let a = i.setattr(ino, set)?;
            if emptied {
                i.flush_on_close.insert(ino);
            }
            Ok(a)
        })?;
        if !file {
            return Ok(a);
        }
        // Dirty data wholly past the new size is dropped unwritten; the attributes
        // then count its blocks no more.
        self.cache.discard(ino, size.div_ceil(fsz), u64::MAX);
        self.getattr(ino)
    }

    /// Allocates, or with `punch_hole` deallocates, or with `zero_range` zeroes and
    /// allocates, a range.
    pub fn fallocate(
        &self,
        ino: u64,
        offset: u64,
        len: u64,
        mode: super::FallocMode,
    ) -> Result<()> {
        Self::live(ino)?;
        // As Linux: an append-only file may only gain space, and only at its end.
        let plain = !mode.punch_hole && !mode.zero_range;
        let fixed = inode_flag::IMMUTABLE | if plain { 0 } else { inode_flag::APPEND };
        self.with(|i| i.refuse_if_flagged(ino, fixed))?;
        let _f = self.file_lock(ino).write();
        let _w = self.wb_lock(ino).lock();
        if self.with(|i| i.check_file(ino)).is_ok() {
            let from = if mode.punch_hole || mode.zero_range {
                offset / self.cache.folio_size()
            } else {
                u64::MAX
            };
            self.settle_for_change(ino, u64::MAX, from)?;
        }
        self.with_space(|i| i.fallocate(ino, offset, len, mode))
    }
}
