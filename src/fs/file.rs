//! File data: copy-on-write writes, reads with checksum verification, truncate,
//! fallocate, zero ranges and hole punching.
//!
//! Writes never overwrite data in place. They do fill preallocated blocks in place:
//! those blocks read as zeros whatever they hold until the item mapping them
//! becomes a written one, in the same tree change that adds their checksums, so a
//! crash still shows the old contents (zeros) or the new, a snapshot sharing them
//! keeps reading zeros, and fallocate's range never needs new space. Each piece so
//! written gets its own checksum item.
//!
//! A file's data is the set of its EXTENT_DATA items, keyed by file offset and
//! non-overlapping; what no item covers is a hole and reads as zeros. Every file range
//! and every offset into a disk extent is a multiple of 4 KiB, so a file block is
//! always a whole disk block with its own crc32c in the checksum tree.
//!
//! `drop_range` replaces a range in one search plus a walk over the successors, and
//! splits at most the first and the last extent it meets (seed 2's rule, on the tree).

use zerocopy::{FromBytes, IntoBytes};

use super::{FallocMode, Inner};
use crate::dev::BlockDev;
use crate::error::{Error, Result};
use crate::extent_map::{ExtentMap, Mapping};
use crate::format::{
    csum, inode_flag, kind, objectid, tree, FileExtent, InodeItem, Key, Timespec, BLOCK_SIZE,
    FILE_END, FILE_EXTENT_PREALLOC, FILE_EXTENT_REG, MAX_EXTENT_SIZE, MAX_FILE_SIZE,
    MAX_PREALLOC_SIZE,
};
use crate::stats::Stats;

const BS: u64 = BLOCK_SIZE;

fn round_up(x: u64) -> u64 {
    x.div_ceil(BS) * BS
}

fn extent_key(ino: u64, off: u64) -> Key {
    Key::new(ino, kind::EXTENT_DATA, off)
}

fn csum_key(bytenr: u64) -> Key {
    Key::new(objectid::CSUM, kind::EXTENT_CSUM, bytenr)
}

fn mapping_of(fe: &FileExtent) -> Mapping {
    Mapping {
        disk_bytenr: fe.disk_bytenr.get(),
        disk_len: fe.disk_len.get(),
        offset: fe.offset.get(),
        len: fe.num_bytes.get(),
        prealloc: fe.kind == FILE_EXTENT_PREALLOC,
        generation: fe.generation.get(),
    }
}

fn fe_of(m: &Mapping) -> FileExtent {
    FileExtent {
        generation: m.generation.into(),
        kind: if m.prealloc {
            FILE_EXTENT_PREALLOC
        } else {
            FILE_EXTENT_REG
        },
        pad: [0; 7],
        disk_bytenr: m.disk_bytenr.into(),
        disk_len: m.disk_len.into(),
        offset: m.offset.into(),
        num_bytes: m.len.into(),
    }
}

/// The file extent item of `ino` at file offset `at`, refused as damage when it is
/// none birchfs writes (see [`FileExtent::flaw`]): every use of it may then count on
/// whole blocks within its disk extent.
fn decode_fe(ino: u64, at: u64, v: &[u8]) -> Result<FileExtent> {
    let fe = FileExtent::read_from_bytes(v)
        .map_err(|_| Error::corrupt("file extent", ino, "bad size"))?;
    match fe.flaw(at) {
        Some(why) => Err(Error::corrupt("file extent", ino, why)),
        None => Ok(fe),
    }
}

impl Inner {
    /// File extents overlapping `[start, end)`, as (file offset, extent): from the
    /// file's extent map, loaded from the tree on first use.
    pub(super) fn extents_in(
        &mut self,
        ino: u64,
        start: u64,
        end: u64,
    ) -> Result<Vec<(u64, FileExtent)>> {
        self.load_map(ino)?;
        match self.maps.get(ino) {
            Some(m) => Ok(m
                .range(start, end)
                .into_iter()
                .map(|(off, mp)| (off, fe_of(&mp)))
                .collect()),
            None => self.extents_in_tree(ino, start, end),
        }
    }

    /// Loads the extent map of `ino` from the tree unless it is kept or too big.
    fn load_map(&mut self, ino: u64) -> Result<()> {
        if self.maps.get(ino).is_none() && !self.maps.is_too_big(ino) {
            let mut map = ExtentMap::default();
            for (off, fe) in self.extents_in_tree(ino, 0, FILE_END)? {
                map.replace(off, mapping_of(&fe));
            }
            self.maps.put(ino, map);
        }
        Ok(())
    }

    /// [`Inner::extents_in`] read from the tree.
    fn extents_in_tree(
        &mut self,
        ino: u64,
        start: u64,
        end: u64,
    ) -> Result<Vec<(u64, FileExtent)>> {
        let mut out = Vec::new();
        let (t, ino) = super::snapshot::split(ino);
        if let Some((k, v)) = self.store.seek_le(t, &extent_key(ino, start))? {
            if k.objectid == ino && k.ty == kind::EXTENT_DATA {
                let fe = decode_fe(ino, k.offset, &v)?;
                if k.offset + fe.num_bytes.get() > start && k.offset < start {
                    out.push((k.offset, fe));
                }
            }
        }
        let mut from = start;
        loop {
            let batch = self
                .store
                .range(t, &extent_key(ino, from), &extent_key(ino, end), 256)?;
            let Some(last) = batch.last() else { break };
            from = last.0.offset + 1;
            for (k, v) in batch {
                out.push((k.offset, decode_fe(ino, k.offset, &v)?));
            }
        }
        Ok(out)
    }

    /// The file's extents as (file offset, disk address, length, preallocated).
    pub(crate) fn extent_map(&mut self, ino: u64) -> Result<Vec<super::ExtentInfo>> {
        self.check_file(ino)?;
        Ok(self
            .extents_in(ino, 0, FILE_END)?
            .into_iter()
            .map(|(off, fe)| super::ExtentInfo {
                offset: off,
                disk_addr: fe.disk_bytenr.get() + fe.offset.get(),
                len: fe.num_bytes.get(),
                prealloc: fe.kind == FILE_EXTENT_PREALLOC,
            })
            .collect())
    }

    pub(crate) fn check_file(&mut self, ino: u64) -> Result<InodeItem> {
        if ino == super::SNAPSHOTS_INO {
            return Err(Error::IsDir);
        }
        let i = self.get_inode(ino)?;
        match i.mode.get() & libc::S_IFMT {
            libc::S_IFREG => Ok(i),
            libc::S_IFDIR => Err(Error::IsDir),
            _ => Err(Error::Invalid("not a regular file")),
        }
    }

    /// Reads `[off, end)` regardless of the size, under the fs lock.
    fn read_range(&mut self, ino: u64, off: u64, end: u64) -> Result<Vec<u8>> {
        let plan = self.plan_range(ino, off, end)?;
        plan.execute(self.store.dev.as_ref())
    }

    /// The checksum item holding disk block `addr` of data extent `extent`, as its
    /// start and end, loaded into `sums` if it is not there yet.
    fn csum_item_at(
        &mut self,
        sums: &mut std::collections::BTreeMap<u64, Vec<u8>>,
        addr: u64,
        extent: u64,
    ) -> Result<(u64, u64)> {
        let covers = |start: u64, v: &Vec<u8>| start + v.len() as u64 / 4 * BS > addr;
        if let Some((&start, v)) = sums.range(..=addr).next_back() {
            if covers(start, v) {
                return Ok((start, start + v.len() as u64 / 4 * BS));
            }
        }
        match self.store.seek_le(tree::CSUM, &csum_key(addr))? {
            Some((k, v))
                if k.objectid == objectid::CSUM
                    && k.ty == kind::EXTENT_CSUM
                    && k.offset >= extent
                    && k.offset % BS == 0
                    && covers(k.offset, &v) =>
            {
                let end = k.offset + v.len() as u64 / 4 * BS;
                sums.insert(k.offset, v);
                Ok((k.offset, end))
            }
            _ => Err(Error::corrupt("data extent", extent, "no checksums")),
        }
    }

    /// Which disk blocks hold `[off, end)`, with their checksums; holes and
    /// preallocated ranges read as zeros.
    pub(crate) fn plan_range(&mut self, ino: u64, off: u64, end: u64) -> Result<ReadPlan> {
        let mut plan = ReadPlan {
            len: (end - off) as usize,
            ..Default::default()
        };
        for (foff, fe) in self.extents_in(ino, off, end)? {
            if fe.kind == FILE_EXTENT_PREALLOC {
                continue;
            }
            let fend = foff + fe.num_bytes.get();
            let s = off.max(foff);
            let e = end.min(fend);
            if s >= e {
                continue;
            }
            // Whole blocks of the disk extent that hold [s, e): `decode_fe` refused
            // extents off block boundaries.
            let bs = (s - foff) / BS * BS;
            let be = round_up(e - foff);
            let extent = fe.disk_bytenr.get();
            let disk = extent
                .checked_add(fe.offset.get())
                .filter(|d| fe.offset.get() < fe.disk_len.get() && d.checked_add(be).is_some())
                .ok_or_else(|| Error::corrupt("file extent", ino, "points outside the device"))?;
            // One piece per checksum item the blocks fall in: an extent has one, a
            // preallocated one written in place one per piece written.
            let (mut at, stop) = (disk + bs, disk + be);
            let (mut out, mut skip, mut take) = (
                (s - off) as usize,
                (s - foff - bs) as usize,
                (e - s) as usize,
            );
            while at < stop {
                let (item, item_end) = self.csum_item_at(&mut plan.sums, at, extent)?;
                let upto = stop.min(item_end);
                let blocks_len = (upto - at) as usize;
                let here = take.min(blocks_len - skip);
                plan.pieces.push(ReadPiece {
                    out,
                    disk: at,
                    blocks_len,
                    skip,
                    take: here,
                    sums_at: item,
                    within: at - item,
                });
                (out, skip, take) = (out + here, 0, take - here);
                at = upto;
            }
        }
        Ok(plan)
    }

    /// Removes the file's mapping of `[start, end)` (block aligned), dropping references
    /// of extents no longer used; returns the bytes unmapped. The extent map makes the
    /// same change in one drop; if the tree fails part-way, the map is forgotten.
    fn drop_range(&mut self, ino: u64, start: u64, end: u64) -> Result<u64> {
        let (n, _) =
            self.forgetting_map_on_error(ino, |s| s.drop_range_tree(ino, start, end, false, None))?;
        self.maps.update(ino, |m| {
            m.drop_range(start, end);
        });
        Ok(n)
    }

    /// Runs `f`, which changes the extents of `ino` in the tree; if it fails, the
    /// file's extent map is forgotten (the tree is the truth, and may be half done).
    fn forgetting_map_on_error<R>(
        &mut self,
        ino: u64,
        f: impl FnOnce(&mut Self) -> Result<R>,
    ) -> Result<R> {
        let r = f(self);
        if r.is_err() {
            self.maps.forget(ino);
        }
        r
    }

    /// Puts a file extent item at `off` and into the extent map (which the caller has
    /// cleared there).
    fn put_extent(&mut self, ino: u64, off: u64, fe: &FileExtent) -> Result<()> {
        self.forgetting_map_on_error(ino, |s| {
            s.store
                .insert(tree::FS, extent_key(ino, off), fe.as_bytes().to_vec())
        })?;
        self.maps.update(ino, |m| m.replace(off, mapping_of(fe)));
        Ok(())
    }

    /// [`Inner::drop_range`] in the tree alone; returns the bytes unmapped.
    ///
    /// With `rewritten`, the caller puts an item at `start` next, which replaces the
    /// one there. An extent that starts at `start` and ends inside the range is then
    /// left in place, reference and all, and returned (disk address, length): the
    /// caller drops its reference once its own item is in (one tree search and one
    /// log record fewer per overwrite). Should that put fail, the old item is still
    /// whole and counted, so a retry drops it once, as it should. `old`: the extents
    /// overlapping the range when the caller has them already (see
    /// [`ExtentMap::replace_taking`]).
    fn drop_range_tree(
        &mut self,
        ino: u64,
        start: u64,
        end: u64,
        rewritten: bool,
        old: Option<Vec<(u64, FileExtent)>>,
    ) -> Result<(u64, Option<(u64, u64)>)> {
        let mut freed = 0;
        let mut kept = None;
        let old = match old {
            Some(v) => v,
            None => self.extents_in(ino, start, end)?,
        };
        for (foff, fe) in old {
            let n = fe.num_bytes.get();
            let fend = foff + n;
            let (b, l) = (fe.disk_bytenr.get(), fe.disk_len.get());
            if foff < start && fend > end {
                // The range is inside one extent: keep both sides (one split).
                let mut left = fe;
                left.num_bytes = (start - foff).into();
                self.store
                    .insert(tree::FS, extent_key(ino, foff), left.as_bytes().to_vec())?;
                let mut right = fe;
                right.offset = (fe.offset.get() + end - foff).into();
                right.num_bytes = (fend - end).into();
                self.store
                    .insert(tree::FS, extent_key(ino, end), right.as_bytes().to_vec())?;
                self.store.data_ref(b, l, 1);
                freed += end - start;
            } else if foff < start {
                let mut left = fe;
                left.num_bytes = (start - foff).into();
                self.store
                    .insert(tree::FS, extent_key(ino, foff), left.as_bytes().to_vec())?;
                freed += fend - start;
            } else if fend > end {
                self.store.delete(tree::FS, &extent_key(ino, foff))?;
                let mut right = fe;
                right.offset = (fe.offset.get() + end - foff).into();
                right.num_bytes = (fend - end).into();
                self.store
                    .insert(tree::FS, extent_key(ino, end), right.as_bytes().to_vec())?;
                freed += end - foff;
            } else if rewritten && foff == start {
                kept = Some((b, l));
                freed += n;
            } else {
                self.store.delete(tree::FS, &extent_key(ino, foff))?;
                self.store.data_ref(b, l, -1);
                freed += n;
            }
        }
        Ok((freed, kept))
    }

    /// Shares the blocks of `src` in `[soff, soff + len)` into `dst` at `doff` (all
    /// block aligned), replacing what `dst` had there: every source extent gets one more
    /// reference and no data moves; holes and preallocated ranges become holes. Stops
    /// after `max_extents` extents (each call is one bounded step); returns the bytes
    /// done. Ranges of one file must not overlap.
    pub(crate) fn clone_blocks(
        &mut self,
        src: u64,
        soff: u64,
        dst: u64,
        doff: u64,
        len: u64,
        max_extents: usize,
    ) -> Result<u64> {
        debug_assert!(soff % BS == 0 && doff % BS == 0 && len % BS == 0);
        self.need_room()?;
        self.check_file(src)?;
        let mut di = self.check_file(dst)?;
        let mut exts = self.extents_in(src, soff, soff + len)?;
        let mut end = soff + len;
        if exts.len() > max_extents {
            exts.truncate(max_extents.max(1));
            let (foff, fe) = exts[exts.len() - 1];
            end = end.min(foff + fe.num_bytes.get());
        }
        let done = end - soff;
        let dropped = self.drop_range(dst, doff, doff + done)?;
        let mut nbytes = di.nbytes.get().saturating_sub(dropped);
        for (foff, fe) in exts {
            let s = foff.max(soff);
            let e = (foff + fe.num_bytes.get()).min(end);
            if fe.kind == FILE_EXTENT_PREALLOC || s >= e {
                continue;
            }
            let mut shared = fe;
            shared.offset = (fe.offset.get() + (s - foff)).into();
            shared.num_bytes = (e - s).into();
            self.put_extent(dst, doff + (s - soff), &shared)?;
            self.store
                .data_ref(fe.disk_bytenr.get(), fe.disk_len.get(), 1);
            nbytes += e - s;
        }
        let now = Timespec::now();
        di.nbytes = nbytes.into();
        if doff + done > di.size.get() {
            di.size = (doff + done).into();
        }
        di.mtime = now;
        di.ctime = now;
        self.put_inode(dst, &mut di)?;
        self.store.log.mark_data(dst);
        Ok(done)
    }

    /// Allocates `len` bytes of data space as one or more extents; all or nothing.
    pub(crate) fn alloc_space(&mut self, len: u64) -> Result<Vec<Piece>> {
        let mut space: Vec<Piece> = Vec::new();
        let mut need = len;
        while need > 0 {
            match self.store.alloc_data(need.min(MAX_EXTENT_SIZE)) {
                Ok((addr, len)) => {
                    space.push(Piece::new(addr, len));
                    need -= len;
                }
                Err(e) => {
                    self.release_space(&space);
                    return Err(e);
                }
            }
        }
        Ok(space)
    }

    /// Returns the new space of `space` for a write that did not happen (blocks of
    /// preallocated extents stay theirs).
    pub(crate) fn release_space(&mut self, space: &[Piece]) {
        for p in space.iter().filter(|p| p.into.is_none()) {
            self.store.alloc.release_unused(p.addr, p.len);
        }
    }

    /// Whether a write may go in place into the blocks `fe` maps: preallocated ones.
    /// No one reads a preallocated block (it reads as zeros whatever it holds), so
    /// writing it changes nothing anyone sees until the item that maps it becomes a
    /// written one. Only one item that can be written maps it: fallocate takes new
    /// space, cloning leaves preallocated ranges out, and the other trees that may
    /// share it are read-only snapshots (which keep reading zeros there).
    fn writable_in_place(&self, fe: &FileExtent) -> bool {
        fe.kind == FILE_EXTENT_PREALLOC
    }

    /// Space for `len` dirty bytes at `off` of `ino` being written back: its
    /// preallocated blocks, in place (so a write into a fallocated range needs no
    /// new space, as fallocate(2) promises, and the file keeps the layout it was
    /// given); new space for the rest. In file order; all or nothing.
    pub(crate) fn space_for_run(&mut self, ino: u64, off: u64, len: u64) -> Result<Vec<Piece>> {
        let mut out = Vec::new();
        match self.place_run(ino, off, off + len, &mut out) {
            Ok(()) => Ok(out),
            Err(e) => {
                self.release_space(&out);
                Err(e)
            }
        }
    }

    /// [`Inner::space_for_run`] of `[off, end)` into `out`, which holds what it
    /// took when it fails.
    fn place_run(&mut self, ino: u64, off: u64, end: u64, out: &mut Vec<Piece>) -> Result<()> {
        let mut pos = off;
        for (foff, fe) in self.extents_in(ino, off, end)? {
            let (s, e) = (foff.max(off), (foff + fe.num_bytes.get()).min(end));
            if s >= e || !self.writable_in_place(&fe) {
                continue;
            }
            if s > pos {
                out.extend(self.alloc_space(s - pos)?);
            }
            // Written in place: only where this filesystem keeps data, whatever a
            // damaged or hostile image says (never on its log or superblocks).
            let addr = fe
                .disk_bytenr
                .get()
                .checked_add(fe.offset.get())
                .and_then(|a| a.checked_add(s - foff))
                .filter(|&a| {
                    fe.offset
                        .get()
                        .checked_add(e - foff)
                        .is_some_and(|end| end <= fe.disk_len.get())
                        && self.store.in_data_area(a, e - s)
                })
                .ok_or_else(|| {
                    Error::corrupt(
                        "file extent",
                        ino,
                        format!(
                            "preallocated blocks at {}+{} (disk extent {}+{}) lie outside \
                             the data area",
                            fe.disk_bytenr.get(),
                            fe.offset.get(),
                            fe.disk_bytenr.get(),
                            fe.disk_len.get()
                        ),
                    )
                })?;
            let into = Some((fe.disk_bytenr.get(), fe.disk_len.get()));
            match out.last_mut() {
                Some(p) if p.into == into && p.addr + p.len == addr => p.len += e - s,
                _ => out.push(Piece {
                    addr,
                    len: e - s,
                    into,
                }),
            }
            pos = e;
        }
        if pos < end {
            out.extend(self.alloc_space(end - pos)?);
        }
        Ok(())
    }

    /// A file extent of `kind` that maps all `len` bytes of new space at `addr`, made
    /// in this transaction.
    fn whole_extent(&self, kind: u8, addr: u64, len: u64) -> FileExtent {
        FileExtent {
            generation: self.store.generation.into(),
            kind,
            pad: [0; 7],
            disk_bytenr: addr.into(),
            disk_len: len.into(),
            offset: 0.into(),
            num_bytes: len.into(),
        }
    }

    /// Maps `space` (already holding the data, with `sums` per piece) at
    /// block-aligned `off`, replacing what was there. If it fails part-way, the
    /// file's extent map is forgotten (the tree is the truth).
    fn map_blocks(
        &mut self,
        ino: u64,
        i: &mut InodeItem,
        off: u64,
        space: &[Piece],
        sums: Vec<Vec<u8>>,
    ) -> Result<()> {
        self.forgetting_map_on_error(ino, |s| {
            let len: u64 = space.iter().map(|p| p.len).sum();
            let fes: Vec<FileExtent> = space
                .iter()
                .map(|p| match p.into {
                    None => s.whole_extent(FILE_EXTENT_REG, p.addr, p.len),
                    Some((b, l)) => FileExtent {
                        offset: (p.addr - b).into(),
                        num_bytes: p.len.into(),
                        ..s.whole_extent(FILE_EXTENT_REG, b, l)
                    },
                })
                .collect();
            // A preallocated extent written in place gets its new reference before the
            // items it replaces drop theirs, so its count never passes through zero.
            for p in space {
                if let Some((b, l)) = p.into {
                    s.store.data_ref(b, l, 1);
                }
            }
            // One piece (an overwrite): the extent map gives the old extents and takes
            // the new one in one search (seed 2); otherwise each piece's `replace` drops
            // what the map had under it.
            let old: Option<Vec<(u64, FileExtent)>> = match fes.as_slice() {
                [fe] => {
                    s.load_map(ino)?;
                    let m = mapping_of(fe);
                    s.maps
                        .update_with(ino, |map| map.replace_taking(off, m))
                        .map(|v| v.iter().map(|(o, m)| (*o, fe_of(m))).collect())
                }
                _ => None,
            };
            let mapped = old.is_some();
            // The pieces cover [off, off + len) from `off` on, so the first one's item
            // replaces the one at `off`: the tree alone needs the drop.
            let (dropped, mut kept) = s.drop_range_tree(ino, off, off + len, true, old)?;
            let mut nbytes = i.nbytes.get().saturating_sub(dropped);
            let mut pos = off;
            for ((p, sums), fe) in space.iter().zip(sums).zip(fes) {
                s.store.insert(tree::CSUM, csum_key(p.addr), sums)?;
                // As `put_extent`, without its own forgetting of the map on an error
                // (this closure's does).
                s.store
                    .insert(tree::FS, extent_key(ino, pos), fe.as_bytes().to_vec())?;
                if !mapped {
                    s.maps.update(ino, |m| m.replace(pos, mapping_of(&fe)));
                }
                if p.into.is_none() {
                    s.store.data_ref(p.addr, p.len, 1);
                }
                if let Some((b, l)) = kept.take() {
                    // The item it was mapped by is replaced now.
                    s.store.data_ref(b, l, -1);
                }
                nbytes += p.len;
                pos += p.len;
            }
            i.nbytes = nbytes.into();
            Ok(())
        })
    }

    /// Writes whole blocks `buf` at block-aligned `off`, copy-on-write, all under the
    /// fs lock (truncate and hole punching). Space is allocated before the old mapping
    /// is dropped, so ENOSPC leaves the file as it was.
    fn write_blocks(&mut self, ino: u64, i: &mut InodeItem, off: u64, buf: &[u8]) -> Result<()> {
        let space = self.alloc_space(buf.len() as u64)?;
        let sums = match write_extents(self.store.dev.as_ref(), &self.store.stats, &space, buf) {
            Ok(s) => s,
            Err(e) => {
                self.release_space(&space);
                return Err(e);
            }
        };
        self.map_blocks(ino, i, off, &space, sums)
    }

    /// Checks a cached write of `ino` that dirties at most the blocks of `span`
    /// (byte range), with `dirty` bytes already dirty in the cache; returns the file
    /// size. Room is needed for the span and every dirty block, and for the tree
    /// nodes that writeback will copy a margin on top (1/32: checksums, extent items
    /// and the nodes holding them), so the reservation holds at writeback. Blocks
    /// that writeback will write in place (preallocated, see
    /// [`Inner::space_for_run`]) need no room: a write all over them is refused only
    /// when its margin would take more than half the metadata reserve.
    /// A write ending at `end` is noted as under way, its size counted before any of
    /// its blocks reaches the cache (writeback mapping them must know the size they
    /// lie within); [`Inner::note_write`] ends it. An immutable file takes no write
    /// (one through a handle opened before `chattr +i`); an append-only file takes
    /// the caller's own write at `own` only from its end (the kernel's cache writes
    /// back whole pages, `own` None, so its appends may start before the end).
    pub(crate) fn write_begin(
        &mut self,
        ino: u64,
        span: (u64, u64),
        dirty: u64,
        end: Option<u64>,
        own: Option<u64>,
    ) -> Result<u64> {
        self.store.writable()?;
        let i = self.check_file(ino)?;
        let f = i.flags.get();
        if f & inode_flag::IMMUTABLE != 0
            || (f & inode_flag::APPEND != 0 && own.is_some_and(|o| o < i.size.get()))
        {
            return Err(Error::Perm);
        }
        let margin = |room: u64| room + room / 32 + 2 * BS;
        let worst = span.1 - span.0;
        if !self.store.alloc.has_room(margin(worst + dirty)) {
            let own = worst - self.in_place_bytes(ino, span.0, span.1)?;
            let fits = if own == 0 {
                self.store.alloc.has_metadata_room(margin(worst) - worst)
            } else {
                self.store.alloc.has_room(margin(own + dirty))
            };
            if !fits {
                return Err(Error::NoSpace);
            }
        }
        if let Some(end) = end {
            // Without an entry, the item read is the stored one.
            let p = self
                .pending
                .entry(ino)
                .or_insert_with(|| super::PendingAttr::of(&i));
            p.size = p.size.max(end);
            p.writing = true;
        }
        Ok(i.size.get())
    }

    /// Bytes of `[start, end)` of `ino` that writeback would write in place.
    fn in_place_bytes(&mut self, ino: u64, start: u64, end: u64) -> Result<u64> {
        self.mapped_bytes(ino, start, end, |me, fe| me.writable_in_place(fe))
    }

    /// Bytes of `[start, end)` of `ino` that extents `pick` chooses map.
    pub(super) fn mapped_bytes(
        &mut self,
        ino: u64,
        start: u64,
        end: u64,
        pick: impl Fn(&Inner, &FileExtent) -> bool,
    ) -> Result<u64> {
        Ok(self
            .extents_in(ino, start, end)?
            .iter()
            .filter(|(_, fe)| pick(self, fe))
            .map(|(at, fe)| {
                let (a, b) = ((*at).max(start), (at + fe.num_bytes.get()).min(end));
                b.saturating_sub(a)
            })
            .sum())
    }

    /// Ends a cached write of `ino` begun at size `before` that copied up to `end`
    /// (short of its own end when an error stopped it): the size is what the write
    /// reached; the time of the write becomes the file's mtime and ctime if `stamp`.
    pub(crate) fn note_write(
        &mut self,
        ino: u64,
        before: u64,
        end: u64,
        stamp: bool,
    ) -> Result<()> {
        if !self.pending.contains_key(&ino) {
            // A store of the inode took the entry: the tree holds the whole size.
            let i = self.get_inode(ino)?;
            self.pending.insert(ino, super::PendingAttr::of(&i));
        }
        let Some(p) = self.pending.get_mut(&ino) else {
            return Ok(());
        };
        // Writers of a file take turns (its lock), so nothing else moved the size.
        p.size = before.max(end);
        p.disk_size = p.disk_size.min(p.size);
        p.writing = false;
        if stamp {
            let now = Timespec::now();
            p.mtime = now;
            p.ctime = now;
        }
        Ok(())
    }

    /// Maps runs written back to `ino`: (file offset, space holding the data, its
    /// checksums). Releases the new space if the inode is gone.
    pub(crate) fn map_written(&mut self, ino: u64, placed: Vec<WrittenRun>) -> Result<()> {
        let mut i = match self.get_inode_opt(ino)? {
            Some(i) => i,
            None => {
                for (_, space, _) in &placed {
                    self.release_space(space);
                }
                return Ok(());
            }
        };
        let mut end = 0;
        for (off, space, sums) in placed {
            end = end.max(off + space.iter().map(|p| p.len).sum::<u64>());
            self.map_blocks(ino, &mut i, off, &space, sums)?;
        }
        // Writeback takes a file's dirty blocks in file order, so every block below
        // `end` that was dirty is now mapped: the size may reach it.
        if let Some(p) = self.pending.get_mut(&ino) {
            p.disk_size = p.disk_size.max(end.min(p.size));
        }
        self.put_inode(ino, &mut i)?;
        self.store.log.mark_data(ino);
        Ok(())
    }

    /// Puts the pending size and times of `ino` into its inode item (the size up to
    /// the data written back; all of it when nothing of `ino` waits in the cache).
    pub(crate) fn flush_pending(&mut self, ino: u64) -> Result<()> {
        let Some(p) = self.pending.get_mut(&ino) else {
            return Ok(());
        };
        if p.data_written(&self.cache, ino) {
            p.disk_size = p.size;
        }
        match self.get_inode_opt(ino)? {
            Some(mut i) => {
                self.put_inode(ino, &mut i)?;
                self.store.log.mark_data(ino);
            }
            None => {
                self.pending.remove(&ino);
            }
        }
        Ok(())
    }

    /// Puts every pending size and time into the inode items (before a commit),
    /// except those of files whose new size waits for its data in the cache: their
    /// writeback stores them.
    pub(crate) fn flush_all_pending(&mut self) -> Result<()> {
        let inos: Vec<u64> = self
            .pending
            .iter()
            .filter(|(ino, p)| p.disk_size == p.size || p.data_written(&self.cache, **ino))
            .map(|(ino, _)| *ino)
            .collect();
        for ino in inos {
            self.flush_pending(ino)?;
        }
        Ok(())
    }

    /// Sets the size: frees blocks past a shorter size and zeroes the rest of the last
    /// block, so that a later extend reads zeros. The caller stores `i` and then marks
    /// the change as data for fdatasync.
    pub(crate) fn truncate(&mut self, ino: u64, i: &mut InodeItem, size: u64) -> Result<()> {
        let old = i.size.get();
        if size < old {
            // The last block's copy first: it is the step that can find no room, and
            // failing before anything changed lets the caller commit and retry.
            if size % BS != 0 {
                let bstart = size / BS * BS;
                let mut block = self.read_range(ino, bstart, bstart + BS)?;
                if block[(size - bstart) as usize..].iter().any(|&b| b != 0) {
                    block[(size - bstart) as usize..].fill(0);
                    self.write_blocks(ino, i, bstart, &block)?;
                }
            }
            let keep = round_up(size);
            let dropped = self.drop_range(ino, keep, FILE_END)?;
            i.nbytes = i.nbytes.get().saturating_sub(dropped).into();
        }
        i.size = size.into();
        i.ctime = Timespec::now();
        Ok(())
    }

    /// Maps newly allocated, preallocated (unwritten) extents over `holes` of `ino`,
    /// counting each in `i.nbytes` as it goes in.
    fn prealloc_holes(&mut self, ino: u64, i: &mut InodeItem, holes: &[(u64, u64)]) -> Result<()> {
        for &(mut s, e) in holes {
            while s < e {
                let (addr, got) = self.store.alloc_data((e - s).min(MAX_PREALLOC_SIZE))?;
                let fe = self.whole_extent(FILE_EXTENT_PREALLOC, addr, got);
                if let Err(err) = self.put_extent(ino, s, &fe) {
                    self.release_space(&[Piece::new(addr, got)]);
                    return Err(err);
                }
                self.store.data_ref(addr, got, 1);
                i.nbytes = (i.nbytes.get() + got).into();
                s += got;
            }
        }
        Ok(())
    }

    pub(crate) fn fallocate(
        &mut self,
        ino: u64,
        off: u64,
        len: u64,
        mode: FallocMode,
    ) -> Result<()> {
        let mut i = self.check_file(ino)?;
        if len == 0 {
            return Err(Error::Invalid("zero length"));
        }
        if mode.punch_hole && mode.zero_range {
            return Err(Error::Invalid("punch_hole with zero_range"));
        }
        let end = off.checked_add(len).ok_or(Error::TooBig)?;
        if end > MAX_FILE_SIZE {
            return Err(Error::TooBig);
        }
        let now = Timespec::now();
        if mode.punch_hole {
            if !mode.keep_size {
                return Err(Error::NotSupported);
            }
            // Past the last block there is nothing to zero; partial blocks at either
            // end are zeroed by a CoW rewrite, whole blocks are dropped.
            let end = end.min(round_up(i.size.get()));
            if off < end {
                self.zero_partial_blocks(ino, &mut i, off, end)?;
                let (bs, be) = (round_up(off), end / BS * BS);
                if bs < be {
                    let dropped = self.drop_range(ino, bs, be)?;
                    i.nbytes = i.nbytes.get().saturating_sub(dropped).into();
                }
            }
        } else {
            self.need_room()?;
            // Allocation covers every block the range touches; zeroing, the whole
            // blocks inside it (its partial blocks are zeroed in place).
            let (bs, be) = if mode.zero_range {
                (round_up(off), end / BS * BS)
            } else {
                (off / BS * BS, round_up(end))
            };
            let mut mapped = Vec::new();
            let mut written = Vec::new();
            for (foff, fe) in self.extents_in(ino, bs, be.max(bs))? {
                let (s, e) = (foff.max(bs), (foff + fe.num_bytes.get()).min(be));
                mapped.push((s, e));
                if mode.zero_range && fe.kind != FILE_EXTENT_PREALLOC && s < e {
                    written.push((s, e));
                }
            }
            let mut holes = super::io::gaps(&mapped, bs, be);
            // Written blocks being zeroed become holes to preallocate; their space
            // comes back only with a commit, so the new space is checked for first.
            holes.extend(written.iter().copied());
            holes.sort_unstable();
            let need: u64 = holes.iter().map(|(s, e)| e - s).sum();
            // Dirty cached blocks were promised room when they were written.
            if !self
                .store
                .alloc
                .has_room(need + self.cache.promised_bytes())
            {
                return Err(Error::NoSpace);
            }
            if mode.zero_range {
                let size_end = end.min(round_up(i.size.get()));
                if off < size_end {
                    self.zero_partial_blocks(ino, &mut i, off, size_end)?;
                }
                for &(s, e) in &written {
                    let dropped = self.drop_range(ino, s, e)?;
                    i.nbytes = i.nbytes.get().saturating_sub(dropped).into();
                }
            }
            // The tree's growth under this loop can take the room checked above. The
            // extents made before an allocation fails stay (preallocated, as on ext4)
            // and the inode counts them, so that a retry after a commit (which sees
            // them as no longer holes) leaves nbytes right.
            let filled = self.prealloc_holes(ino, &mut i, &holes);
            if filled.is_err() {
                i.ctime = now;
                self.put_inode(ino, &mut i)?;
                self.store.log.mark_data(ino);
                return filled;
            }
            if !mode.keep_size && end > i.size.get() {
                i.size = end.into();
            }
        }
        i.mtime = now;
        i.ctime = now;
        self.put_inode(ino, &mut i)?;
        self.store.log.mark_data(ino);
        Ok(())
    }

    /// Zeroes the parts of `[off, end)` (inside the file) that cover blocks only
    /// partly, by a copy-on-write rewrite of those blocks where they hold data.
    fn zero_partial_blocks(
        &mut self,
        ino: u64,
        i: &mut InodeItem,
        off: u64,
        end: u64,
    ) -> Result<()> {
        let bs = round_up(off);
        let be = end / BS * BS;
        let partials = if bs <= be {
            [(off, bs), (be, end)]
        } else {
            [(off, end), (0, 0)]
        };
        for (s, e) in partials {
            if s < e {
                let b0 = s / BS * BS;
                let mut block = self.read_range(ino, b0, b0 + BS)?;
                let r = (s - b0) as usize..(e - b0) as usize;
                if block[r.clone()].iter().any(|&b| b != 0) {
                    block[r].fill(0);
                    self.write_blocks(ino, i, b0, &block)?;
                }
            }
        }
        Ok(())
    }
}

/// Where part of a write goes: `len` bytes at `addr`, in new space, or in place in
/// the preallocated disk extent `into` (start, length).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub addr: u64,
    pub len: u64,
    pub into: Option<(u64, u64)>,
}

impl Piece {
    /// A piece of new space.
    pub(crate) fn new(addr: u64, len: u64) -> Piece {
        Piece {
            addr,
            len,
            into: None,
        }
    }
}

/// A run written back: its file offset, the pieces holding it, their checksums.
pub(crate) type WrittenRun = (u64, Vec<Piece>, Vec<Vec<u8>>);

/// Writes `buf` into the pieces of `space`, in order; returns each piece's
/// checksums. Needs no lock: the space belongs to the caller until it is mapped.
pub(crate) fn write_extents(
    dev: &dyn BlockDev,
    stats: &Stats,
    space: &[Piece],
    buf: &[u8],
) -> Result<Vec<Vec<u8>>> {
    let mut all = write_runs_to(dev, stats, &[(space, &[buf])])?;
    Ok(all.pop().unwrap_or_default())
}

/// A run to write: the pieces that hold it, and its bytes (in segments, one after
/// another; each a whole number of blocks).
pub(crate) type RunToWrite<'a> = (&'a [Piece], &'a [&'a [u8]]);

/// Writes each `(space, segments)` run as [`write_extents`] does, with every piece's
/// write of every run handed to the device at once (so it may keep them all in
/// flight); returns the checksums per run, per piece.
pub(crate) fn write_runs_to(
    dev: &dyn BlockDev,
    stats: &Stats,
    runs: &[RunToWrite],
) -> Result<Vec<Vec<Vec<u8>>>> {
    // Each piece of space gets the segments' bytes that fall in it: a write gathered
    // from them, and its blocks to checksum.
    let mut pieces: Vec<Vec<&[u8]>> = Vec::new();
    for &(space, segs) in runs {
        let mut segs = segs.iter().copied().filter(|s| !s.is_empty());
        let mut rest: &[u8] = &[];
        for p in space {
            let mut want = p.len as usize;
            let mut parts = Vec::new();
            while want > 0 {
                if rest.is_empty() {
                    rest = segs
                        .next()
                        .ok_or(Error::Invalid("a run is shorter than its space"))?;
                }
                let n = want.min(rest.len());
                parts.push(&rest[..n]);
                rest = &rest[n..];
                want -= n;
            }
            pieces.push(parts);
        }
        if !rest.is_empty() || segs.next().is_some() {
            return Err(Error::Invalid("a run is longer than its space"));
        }
    }
    let addrs = runs
        .iter()
        .flat_map(|(space, _)| space.iter().map(|p| p.addr));
    let writes: Vec<(&[&[u8]], u64)> = pieces.iter().map(|p| &p[..]).zip(addrs).collect();
    dev.write_gathered(&writes)?;
    let mut w = pieces.iter();
    let sums = runs
        .iter()
        .map(|(space, _)| {
            space
                .iter()
                .zip(&mut w)
                .map(|(p, parts)| {
                    Stats::add(&stats.dev_data_bytes, p.len);
                    parts
                        .iter()
                        .flat_map(|part| part.chunks(BS as usize))
                        .flat_map(|b| csum(b).to_le_bytes())
                        .collect()
                })
                .collect()
        })
        .collect();
    Ok(sums)
}

/// Bytes of pieces a read sends to the device together at most.
const READ_BATCH: usize = 4 << 20;

/// One contiguous run of disk blocks a read needs.
#[derive(Debug)]
struct ReadPiece {
    /// Where the wanted bytes go in the output.
    out: usize,
    /// Device address of the first whole block.
    disk: u64,
    /// Bytes of whole blocks to read.
    blocks_len: usize,
    /// Bytes to skip at the start of those blocks.
    skip: usize,
    /// Bytes wanted.
    take: usize,
    /// Start of the checksum item that covers these blocks.
    sums_at: u64,
    /// Offset of the first block from that start.
    within: u64,
}

/// A read resolved to disk blocks and checksums, carried out without the fs lock
/// while the file's lock keeps its extents from being freed.
#[derive(Debug, Default)]
pub(crate) struct ReadPlan {
    len: usize,
    pieces: Vec<ReadPiece>,
    /// Checksum items by start.
    sums: std::collections::BTreeMap<u64, Vec<u8>>,
}

impl ReadPlan {
    /// Reads and verifies every block; a checksum mismatch is EIO, never data.
    pub(crate) fn execute(&self, dev: &dyn BlockDev) -> Result<Vec<u8>> {
        thread_local! {
            /// Each thread's read buffer, reused: pieces are at most one extent.
            static BUF: std::cell::RefCell<crate::dev::AlignedBuf> =
                std::cell::RefCell::new(crate::dev::AlignedBuf::default());
        }
        let mut out = vec![0u8; self.len];
        BUF.with(|b| {
            self.for_each_piece(dev, &mut b.borrow_mut(), |at, bytes| {
                out[at..at + bytes.len()].copy_from_slice(bytes)
            })
        })?;
        Ok(out)
    }

    /// Reads and verifies every piece into `scratch`, handing each one's wanted bytes
    /// with their offset in the planned range to `put`; holes are not handed over.
    /// Pieces are read in batches of up to [`READ_BATCH`] bytes, in flight together.
    pub(crate) fn for_each_piece(
        &self,
        dev: &dyn BlockDev,
        scratch: &mut crate::dev::AlignedBuf,
        mut put: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        let mut rest = &self.pieces[..];
        while !rest.is_empty() {
            let mut n = 1;
            let mut total = rest[0].blocks_len;
            while n < rest.len() && total + rest[n].blocks_len <= READ_BATCH {
                total += rest[n].blocks_len;
                n += 1;
            }
            let (batch, after) = rest.split_at(n);
            rest = after;
            if scratch.len() < total {
                *scratch = crate::dev::AlignedBuf::zeroed(total);
            }
            {
                let mut reads: Vec<(&mut [u8], u64)> = Vec::with_capacity(n);
                let mut free = &mut scratch[..total];
                for p in batch {
                    let (buf, tail) = free.split_at_mut(p.blocks_len);
                    reads.push((buf, p.disk));
                    free = tail;
                }
                dev.read_many(&mut reads)?;
            }
            let mut pos = 0;
            for p in batch {
                let buf = &scratch[pos..pos + p.blocks_len];
                pos += p.blocks_len;
                self.verify_from(p, 0, buf)?;
                put(p.out, &buf[p.skip..p.skip + p.take]);
            }
        }
        Ok(())
    }

    /// Reads every piece straight into `out`, the buffers that hold the planned range
    /// in order (each with its offset in the range; together they cover it), and
    /// verifies it; returns the parts of the range that were read (the rest is holes).
    /// `None`, with nothing read, when a piece does not cover whole blocks: then
    /// [`ReadPlan::for_each_piece`] has to read it into a buffer of its own.
    ///
    /// The device may take the buffers as they are (direct I/O into aligned ones):
    /// this saves the copy out of a scratch buffer.
    pub(crate) fn read_direct(
        &self,
        dev: &dyn BlockDev,
        out: &mut [(usize, &mut [u8])],
    ) -> Result<Option<Vec<(usize, usize)>>> {
        let whole = |p: &ReadPiece| p.skip == 0 && p.take == p.blocks_len;
        let sorted = self
            .pieces
            .windows(2)
            .all(|w| w[0].out + w[0].take <= w[1].out);
        if !sorted || !self.pieces.iter().all(whole) {
            return Ok(None);
        }
        // Each piece's part of each buffer: (buffer part, device address), and the
        // piece and offset in it that part starts at.
        let mut reads: Vec<(&mut [u8], u64)> = Vec::new();
        let mut at: Vec<(usize, usize)> = Vec::new();
        let mut pieces = self.pieces.iter().enumerate().peekable();
        for (start, buf) in out.iter_mut() {
            let (mut pos, end) = (*start, *start + buf.len());
            let mut rest: &mut [u8] = buf;
            while let Some(&(n, p)) = pieces.peek() {
                let p_end = p.out + p.take;
                if p_end <= pos {
                    pieces.next();
                    continue;
                }
                if p.out >= end {
                    break;
                }
                let from = pos.max(p.out);
                let to = end.min(p_end);
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(from - pos);
                let (part, tail) = tail.split_at_mut(to - from);
                reads.push((part, p.disk + (from - p.out) as u64));
                at.push((n, from - p.out));
                rest = tail;
                pos = to;
                if to < p_end {
                    break;
                }
                pieces.next();
            }
        }
        dev.read_many(&mut reads)?;
        for ((buf, _), &(n, within)) in reads.iter().zip(&at) {
            self.verify_from(&self.pieces[n], within, buf)?;
        }
        Ok(Some(
            self.pieces
                .iter()
                .map(|p| (p.out, p.out + p.take))
                .collect(),
        ))
    }

    /// Checks blocks of piece `p` from byte `from` on (a block boundary), read into
    /// `buf`, against their checksums.
    fn verify_from(&self, p: &ReadPiece, from: usize, buf: &[u8]) -> Result<()> {
        let sums = &self.sums[&p.sums_at];
        let (within, disk) = (p.within + from as u64, p.disk + from as u64);
        for (n, block) in buf.chunks(BS as usize).enumerate() {
            let idx = (within / BS) as usize + n;
            let want = sums
                .get(idx * 4..idx * 4 + 4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .ok_or_else(|| Error::corrupt("checksum item", p.sums_at, "too short"))?;
            if csum(block) != want {
                let e = Error::corrupt("data block", disk + n as u64 * BS, "checksum mismatch");
                tracing::error!("{e}");
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::MemDev;

    /// Bytes `k * 7 + seed` (mod 251): different in every block.
    fn bytes(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|k| ((k * 7 + seed as usize) % 251) as u8)
            .collect()
    }

    #[test]
    fn a_run_in_segments_lands_in_its_pieces_with_each_blocks_checksum() {
        let dev = MemDev::new(1 << 20);
        let stats = Stats::default();
        let b = BS as usize;
        // Segments of 2, 4 and 1 blocks into pieces of 3 and 4 blocks: the first
        // piece ends inside the second segment.
        let segs = [bytes(2 * b, 1), bytes(4 * b, 2), bytes(b, 3)];
        let seg_refs: Vec<&[u8]> = segs.iter().map(|s| &s[..]).collect();
        let space = [Piece::new(64 * BS, 3 * BS), Piece::new(16 * BS, 4 * BS)];
        let other = bytes(2 * b, 4);
        let runs: [RunToWrite; 2] = [
            (&space, &seg_refs),
            (&[Piece::new(100 * BS, 2 * BS)], &[&other[..]]),
        ];
        let sums = write_runs_to(&dev, &stats, &runs).unwrap();
        let all: Vec<u8> = segs.concat();
        let mut got = vec![0u8; 3 * b];
        dev.read_at(&mut got, 64 * BS).unwrap();
        assert!(got == all[..3 * b], "first piece");
        let mut got = vec![0u8; 4 * b];
        dev.read_at(&mut got, 16 * BS).unwrap();
        assert!(got == all[3 * b..], "second piece");
        let mut got = vec![0u8; 2 * b];
        dev.read_at(&mut got, 100 * BS).unwrap();
        assert!(got == other, "second run");
        let want =
            |d: &[u8]| -> Vec<u8> { d.chunks(b).flat_map(|c| csum(c).to_le_bytes()).collect() };
        assert_eq!(sums.len(), 2);
        assert_eq!(sums[0], vec![want(&all[..3 * b]), want(&all[3 * b..])]);
        assert_eq!(sums[1], vec![want(&other)]);
        assert_eq!(
            stats
                .dev_data_bytes
                .load(std::sync::atomic::Ordering::Relaxed),
            9 * BS
        );
    }

    #[test]
    fn a_run_that_does_not_fill_its_space_exactly_is_refused_unwritten() {
        let dev = MemDev::new(1 << 20);
        let stats = Stats::default();
        let data = bytes(2 * BS as usize, 5);
        for space in [
            vec![Piece::new(0, 3 * BS)],
            vec![Piece::new(0, BS)],
            vec![Piece::new(0, BS), Piece::new(8 * BS, 2 * BS)],
        ] {
            let runs: [RunToWrite; 1] = [(&space, &[&data[..]])];
            assert!(write_runs_to(&dev, &stats, &runs).is_err(), "{space:?}");
        }
        let mut got = vec![1u8; 16 * BS as usize];
        dev.read_at(&mut got, 0).unwrap();
        assert!(got.iter().all(|&x| x == 0), "something was written");
    }
}
