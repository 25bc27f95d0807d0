//! File data: copy-on-write writes, reads with checksum verification, truncate,
//! fallocate and hole punching.
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
use crate::error::{Error, Result};
use crate::format::{
    csum, kind, objectid, tree, FileExtent, InodeItem, Key, Timespec, BLOCK_SIZE,
    FILE_EXTENT_PREALLOC, FILE_EXTENT_REG, MAX_EXTENT_SIZE, MAX_FILE_SIZE,
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

fn decode_fe(ino: u64, v: &[u8]) -> Result<FileExtent> {
    FileExtent::read_from_bytes(v).map_err(|_| Error::corrupt("file extent", ino, "bad size"))
}

impl Inner {
    /// File extents overlapping `[start, end)`, as (file offset, extent).
    fn extents_in(&mut self, ino: u64, start: u64, end: u64) -> Result<Vec<(u64, FileExtent)>> {
        let mut out = Vec::new();
        if let Some((k, v)) = self.store.seek_le(tree::FS, &extent_key(ino, start))? {
            if k.objectid == ino && k.ty == kind::EXTENT_DATA {
                let fe = decode_fe(ino, &v)?;
                if k.offset + fe.num_bytes.get() > start && k.offset < start {
                    out.push((k.offset, fe));
                }
            }
        }
        let mut from = start;
        loop {
            let batch =
                self.store
                    .range(tree::FS, &extent_key(ino, from), &extent_key(ino, end), 256)?;
            let Some(last) = batch.last() else { break };
            from = last.0.offset + 1;
            for (k, v) in batch {
                out.push((k.offset, decode_fe(ino, &v)?));
            }
        }
        Ok(out)
    }

    /// The file's extents as (file offset, disk address, length, preallocated).
    pub(crate) fn extent_map(&mut self, ino: u64) -> Result<Vec<super::ExtentInfo>> {
        self.check_file(ino)?;
        Ok(self
            .extents_in(ino, 0, u64::MAX >> 1)?
            .into_iter()
            .map(|(off, fe)| super::ExtentInfo {
                offset: off,
                disk_addr: fe.disk_bytenr.get() + fe.offset.get(),
                len: fe.num_bytes.get(),
                prealloc: fe.kind == FILE_EXTENT_PREALLOC,
            })
            .collect())
    }

    fn check_file(&mut self, ino: u64) -> Result<InodeItem> {
        let i = self.get_inode(ino)?;
        match i.mode.get() & libc::S_IFMT {
            libc::S_IFREG => Ok(i),
            libc::S_IFDIR => Err(Error::IsDir),
            _ => Err(Error::Invalid("not a regular file")),
        }
    }

    /// Reads `[off, off+len)` of the file (clamped to its size).
    pub(crate) fn read(&mut self, ino: u64, off: u64, len: u64) -> Result<Vec<u8>> {
        let i = self.check_file(ino)?;
        let size = i.size.get();
        if off >= size {
            return Ok(Vec::new());
        }
        let end = (off + len).min(size);
        self.read_range(ino, off, end)
    }

    /// Reads `[off, end)` regardless of the size; holes and prealloc read as zeros.
    fn read_range(&mut self, ino: u64, off: u64, end: u64) -> Result<Vec<u8>> {
        let mut out = vec![0u8; (end - off) as usize];
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
            // Whole blocks of the disk extent that hold [s, e).
            let bs = (s - foff) / BS * BS;
            let be = round_up(e - foff);
            let disk = fe
                .disk_bytenr
                .get()
                .checked_add(fe.offset.get())
                .filter(|d| fe.offset.get() < fe.disk_len.get() && d.checked_add(be).is_some())
                .ok_or_else(|| Error::corrupt("file extent", ino, "points outside the device"))?;
            let mut buf = vec![0u8; (be - bs) as usize];
            self.store.dev.read_at(&mut buf, disk + bs)?;
            self.verify_blocks(fe.disk_bytenr.get(), fe.offset.get() + bs, &buf)?;
            let from = (s - foff - bs) as usize;
            out[(s - off) as usize..(e - off) as usize]
                .copy_from_slice(&buf[from..from + (e - s) as usize]);
        }
        Ok(out)
    }

    /// Checks `buf`, read at `extent + within`, against the extent's checksums.
    fn verify_blocks(&mut self, extent: u64, within: u64, buf: &[u8]) -> Result<()> {
        let sums = self
            .store
            .search(tree::CSUM, &csum_key(extent))?
            .ok_or_else(|| Error::corrupt("data extent", extent, "no checksums"))?;
        for (n, block) in buf.chunks(BS as usize).enumerate() {
            let idx = (within / BS) as usize + n;
            let want = sums
                .get(idx * 4..idx * 4 + 4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .ok_or_else(|| Error::corrupt("data extent", extent, "checksum item too short"))?;
            if csum(block) != want {
                let addr = extent + within + n as u64 * BS;
                let e = Error::corrupt("data block", addr, "checksum mismatch");
                tracing::error!("{e}");
                return Err(e);
            }
        }
        Ok(())
    }

    /// Removes the file's mapping of `[start, end)` (block aligned), dropping references
    /// of extents no longer used; returns the bytes unmapped.
    fn drop_range(&mut self, ino: u64, start: u64, end: u64) -> Result<u64> {
        let mut freed = 0;
        for (foff, fe) in self.extents_in(ino, start, end)? {
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
            } else {
                self.store.delete(tree::FS, &extent_key(ino, foff))?;
                self.store.data_ref(b, l, -1);
                freed += n;
            }
        }
        Ok(freed)
    }

    /// Writes whole blocks `buf` at block-aligned `off`, copy-on-write. All space is
    /// allocated before the old mapping is dropped, so ENOSPC leaves the file as it was.
    fn write_blocks(&mut self, ino: u64, i: &mut InodeItem, off: u64, buf: &[u8]) -> Result<()> {
        let end = off + buf.len() as u64;
        let mut got_space: Vec<(u64, u64)> = Vec::new();
        let mut need = buf.len() as u64;
        while need > 0 {
            match self.store.alloc_data(need.min(MAX_EXTENT_SIZE)) {
                Ok((a, l)) => {
                    got_space.push((a, l));
                    need -= l;
                }
                Err(e) => {
                    for (a, l) in got_space {
                        self.store.alloc.release_unused(a, l);
                    }
                    return Err(e);
                }
            }
        }
        let mut pos = 0usize;
        for &(addr, got) in &got_space {
            let chunk = &buf[pos..pos + got as usize];
            if let Err(e) = self.store.dev.write_at(chunk, addr) {
                for &(a, l) in &got_space {
                    self.store.alloc.release_unused(a, l);
                }
                return Err(e.into());
            }
            Stats::add(&self.store.stats.dev_data_bytes, got);
            pos += got as usize;
        }
        let dropped = self.drop_range(ino, off, end)?;
        let mut nbytes = i.nbytes.get().saturating_sub(dropped);
        let mut pos = 0usize;
        for (addr, got) in got_space {
            let chunk = &buf[pos..pos + got as usize];
            let sums: Vec<u8> = chunk
                .chunks(BS as usize)
                .flat_map(|b| csum(b).to_le_bytes())
                .collect();
            self.store.insert(tree::CSUM, csum_key(addr), sums)?;
            let fe = FileExtent {
                generation: self.store.generation.into(),
                kind: FILE_EXTENT_REG,
                pad: [0; 7],
                disk_bytenr: addr.into(),
                disk_len: got.into(),
                offset: 0.into(),
                num_bytes: got.into(),
            };
            self.store.insert(
                tree::FS,
                extent_key(ino, off + pos as u64),
                fe.as_bytes().to_vec(),
            )?;
            self.store.data_ref(addr, got, 1);
            nbytes += got;
            pos += got as usize;
        }
        i.nbytes = nbytes.into();
        Ok(())
    }

    pub(crate) fn write(&mut self, ino: u64, off: u64, data: &[u8]) -> Result<usize> {
        let mut i = self.check_file(ino)?;
        if data.is_empty() {
            return Ok(0);
        }
        let end = off.checked_add(data.len() as u64).ok_or(Error::TooBig)?;
        if end > MAX_FILE_SIZE {
            return Err(Error::TooBig);
        }
        if !self
            .store
            .alloc
            .has_room(round_up(data.len() as u64) + 2 * BS)
        {
            return Err(Error::NoSpace);
        }
        let bstart = off / BS * BS;
        let bend = round_up(end);
        let mut buf = vec![0u8; (bend - bstart) as usize];
        let size = i.size.get();
        // Partial first and last blocks keep the bytes around the write.
        if off > bstart && bstart < size {
            let head = self.read_range(ino, bstart, bstart + BS)?;
            buf[..BS as usize].copy_from_slice(&head);
        }
        if end < bend && bend - BS < size && (bend - BS > bstart || off == bstart) {
            let tail = self.read_range(ino, bend - BS, bend)?;
            let at = buf.len() - BS as usize;
            buf[at..].copy_from_slice(&tail);
        }
        buf[(off - bstart) as usize..(end - bstart) as usize].copy_from_slice(data);
        // Bytes past EOF in the last block must stay zero on disk for later extends.
        if end > size {
            let z = (end - bstart) as usize;
            buf[z..].fill(0);
        }
        self.write_blocks(ino, &mut i, bstart, &buf)?;
        let now = Timespec::now();
        if end > size {
            i.size = end.into();
        }
        i.mtime = now;
        i.ctime = now;
        self.put_inode(ino, &mut i)?;
        Ok(data.len())
    }

    /// Sets the size: frees blocks past a shorter size and zeroes the rest of the last
    /// block, so that a later extend reads zeros.
    pub(crate) fn truncate(&mut self, ino: u64, i: &mut InodeItem, size: u64) -> Result<()> {
        let old = i.size.get();
        if size < old {
            let keep = round_up(size);
            let dropped = self.drop_range(ino, keep, u64::MAX >> 1)?;
            i.nbytes = i.nbytes.get().saturating_sub(dropped).into();
            if size % BS != 0 {
                let bstart = size / BS * BS;
                let mut block = self.read_range(ino, bstart, bstart + BS)?;
                if block[(size - bstart) as usize..].iter().any(|&b| b != 0) {
                    block[(size - bstart) as usize..].fill(0);
                    self.write_blocks(ino, i, bstart, &block)?;
                }
            }
        }
        i.size = size.into();
        i.ctime = Timespec::now();
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
                            self.write_blocks(ino, &mut i, b0, &block)?;
                        }
                    }
                }
                if bs < be {
                    let dropped = self.drop_range(ino, bs, be)?;
                    i.nbytes = i.nbytes.get().saturating_sub(dropped).into();
                }
            }
        } else {
            self.need_room()?;
            let bs = off / BS * BS;
            let be = round_up(end);
            let mut holes = Vec::new();
            let mut pos = bs;
            for (foff, fe) in self.extents_in(ino, bs, be)? {
                if foff > pos {
                    holes.push((pos, foff.min(be)));
                }
                pos = pos.max(foff + fe.num_bytes.get());
            }
            if pos < be {
                holes.push((pos, be));
            }
            let need: u64 = holes.iter().map(|(s, e)| e - s).sum();
            if !self.store.alloc.has_room(need) {
                return Err(Error::NoSpace);
            }
            for (mut s, e) in holes {
                while s < e {
                    let (addr, got) = self.store.alloc_data((e - s).min(MAX_EXTENT_SIZE))?;
                    let fe = FileExtent {
                        generation: self.store.generation.into(),
                        kind: FILE_EXTENT_PREALLOC,
                        pad: [0; 7],
                        disk_bytenr: addr.into(),
                        disk_len: got.into(),
                        offset: 0.into(),
                        num_bytes: got.into(),
                    };
                    self.store
                        .insert(tree::FS, extent_key(ino, s), fe.as_bytes().to_vec())?;
                    self.store.data_ref(addr, got, 1);
                    i.nbytes = (i.nbytes.get() + got).into();
                    s += got;
                }
            }
            if !mode.keep_size && end > i.size.get() {
                i.size = end.into();
            }
        }
        i.mtime = now;
        i.ctime = now;
        self.put_inode(ino, &mut i)
    }
}
