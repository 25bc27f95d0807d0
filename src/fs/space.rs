//! How the data space is shared: a walk over every file extent of the live tree and of
//! every snapshot, grouping the ranges that files map by the disk extent they come
//! from. A range a snapshot shares with the live file counts as two references.

use std::collections::HashMap;

use zerocopy::FromBytes;

use super::Fs;
use crate::error::Result;
use crate::format::{kind, tree, FileExtent, Key};

/// Data space by how many file ranges refer to it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SpaceUsage {
    /// Bytes of data extents on the device (what statfs counts as used by data).
    pub allocated: u64,
    /// Bytes exactly one file range refers to.
    pub exclusive: u64,
    /// Bytes two or more file ranges refer to (reflinks, clones).
    pub shared: u64,
    /// Bytes of file data that sit on shared bytes, counted once per reference: what
    /// copies would take without sharing.
    pub shared_referenced: u64,
    /// Bytes no file refers to any more, kept because the rest of their extent is
    /// still used; freed with the extent's last reference.
    pub unreferenced: u64,
    /// Bytes only snapshots refer to (no live file): what deleting every snapshot
    /// would free.
    pub snapshot_only: u64,
}

impl SpaceUsage {
    /// The JSON object `birchfs stats --space` prints.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"allocated\":{},\"exclusive\":{},\"shared\":{},\"shared_referenced\":{},\"unreferenced\":{},\"snapshot_only\":{}}}",
            self.allocated,
            self.exclusive,
            self.shared,
            self.shared_referenced,
            self.unreferenced,
            self.snapshot_only
        )
    }

    /// Adds one disk extent of `len` bytes referred to by `refs` (offset, length,
    /// from the live tree) ranges.
    fn add_extent(&mut self, len: u64, refs: &mut [(u64, u64, bool)]) {
        self.allocated += len;
        // Sweep the reference boundaries; between two of them the counts are constant.
        let mut ev: Vec<(u64, i64, i64)> = Vec::with_capacity(refs.len() * 2 + 2);
        for &mut (o, l, live) in refs {
            let (s, e) = (o.min(len), (o + l).min(len));
            let (dl, ds) = if live { (1, 0) } else { (0, 1) };
            if s < e {
                ev.push((s, dl, ds));
                ev.push((e, -dl, -ds));
            }
        }
        ev.push((len, 0, 0));
        ev.sort_unstable();
        let (mut at, mut live, mut snap) = (0u64, 0i64, 0i64);
        for (pos, dl, ds) in ev {
            let span = pos - at;
            match live + snap {
                0 => self.unreferenced += span,
                1 => self.exclusive += span,
                c => {
                    self.shared += span;
                    self.shared_referenced += span * c as u64;
                }
            }
            if live == 0 && snap > 0 {
                self.snapshot_only += span;
            }
            at = pos;
            live += dl;
            snap += ds;
        }
    }
}

/// Disk extent address -> (its length, the file ranges on it: offset, length, live).
type ByExtent = HashMap<u64, (u64, Vec<(u64, u64, bool)>)>;

/// File extent items read per hold of the fs lock.
const BATCH: usize = 1024;

impl Fs {
    /// Walks every file extent and tells exclusive from shared data space. The walk
    /// takes the fs lock a batch at a time, so it sees changes made meanwhile only in
    /// part; data still in the page cache has no space yet and is not counted.
    pub fn space_usage(&self) -> Result<SpaceUsage> {
        let mut by_extent: ByExtent = HashMap::new();
        self.collect_extents(tree::FS, &mut by_extent)?;
        for s in self.snapshot_list() {
            match self.collect_extents(s.id, &mut by_extent) {
                // Deleted during the walk: what it held is on its way out.
                Err(crate::Error::NotFound) => {}
                r => r?,
            }
        }
        let mut u = SpaceUsage::default();
        for (_, (len, mut refs)) in by_extent {
            u.add_extent(len, &mut refs);
        }
        Ok(u)
    }

    /// Adds the file extents of tree `t` to `by_extent`.
    fn collect_extents(&self, t: u64, by_extent: &mut ByExtent) -> Result<()> {
        let mut from = Key::new(0, 0, 0);
        let end = Key::new(u64::MAX, u8::MAX, u64::MAX);
        loop {
            let batch = self.with(|i| i.store.range(t, &from, &end, BATCH))?;
            let Some((last, _)) = batch.last() else { break };
            let last = *last;
            for (k, v) in batch {
                if k.ty != kind::EXTENT_DATA {
                    continue;
                }
                // A damaged extent counts nothing (its reads fail, `check` names it).
                let Ok(fe) = FileExtent::read_from_bytes(&v) else {
                    continue;
                };
                if fe.flaw(k.offset).is_some() {
                    continue;
                }
                let e = by_extent
                    .entry(fe.disk_bytenr.get())
                    .or_insert_with(|| (fe.disk_len.get(), Vec::new()));
                e.1.push((fe.offset.get(), fe.num_bytes.get(), t == tree::FS));
            }
            from = match last.offset.checked_add(1) {
                Some(o) => Key::new(last.objectid, last.ty, o),
                None => match last.ty.checked_add(1) {
                    Some(t) => Key::new(last.objectid, t, 0),
                    None => match last.objectid.checked_add(1) {
                        Some(id) => Key::new(id, 0, 0),
                        None => break,
                    },
                },
            };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::dev::MemDev;
    use crate::fs::{Creds, MkfsOptions, Options, ROOT_INO};

    #[test]
    fn sweeps_one_extent() {
        let mut u = SpaceUsage::default();
        // [0,4) once, [4,8) twice, [8,12) three times, [12,16) nobody.
        u.add_extent(16, &mut [(0, 8, true), (4, 8, true), (8, 4, true)]);
        assert_eq!(
            u,
            SpaceUsage {
                allocated: 16,
                exclusive: 4,
                shared: 8,
                shared_referenced: 4 * 2 + 4 * 2,
                unreferenced: 4,
                snapshot_only: 0,
            }
        );
        // A snapshot holds [0,8), the live file [4,12): [0,4) is the snapshot's alone.
        let mut u = SpaceUsage::default();
        u.add_extent(16, &mut [(0, 8, false), (4, 8, true)]);
        assert_eq!((u.exclusive, u.shared, u.snapshot_only), (8, 4, 4));
    }

    #[test]
    fn clones_show_as_shared_and_overwrites_as_exclusive() {
        const MB: u64 = 1 << 20;
        let dev = Arc::new(MemDev::new(64 * MB));
        Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let fs = Fs::open(dev, Options::default()).unwrap();
        let c = Creds { uid: 0, gid: 0 };
        let a = fs.mknod(ROOT_INO, b"a", 0o644, 0, c).unwrap().ino;
        fs.write(a, 0, &vec![7; 4 * MB as usize]).unwrap();
        fs.commit().unwrap();
        let u = fs.space_usage().unwrap();
        assert_eq!((u.allocated, u.exclusive, u.shared), (4 * MB, 4 * MB, 0));
        let b = fs.mknod(ROOT_INO, b"b", 0o644, 0, c).unwrap().ino;
        fs.clone_range(a, 0, b, 0, 0).unwrap();
        let u = fs.space_usage().unwrap();
        assert_eq!((u.allocated, u.exclusive, u.shared), (4 * MB, 0, 4 * MB));
        assert_eq!(u.shared_referenced, 8 * MB);
        // Overwriting a block of the clone makes it exclusive to each file.
        fs.write(b, MB, &[1; 4096]).unwrap();
        fs.commit().unwrap();
        let u = fs.space_usage().unwrap();
        assert_eq!(u.allocated, 4 * MB + 4096);
        assert_eq!(u.shared, 4 * MB - 4096);
        assert_eq!(u.exclusive, 4096 + 4096);
        assert_eq!(u.unreferenced, 0);
        // Unlinking the original leaves the clone's bytes exclusive.
        fs.unlink(ROOT_INO, b"a").unwrap();
        fs.commit().unwrap();
        let u = fs.space_usage().unwrap();
        assert_eq!(u.shared, 0);
        assert_eq!(u.exclusive, 4 * MB);
        assert_eq!(
            u.unreferenced, 4096,
            "the block b overwrote stays with its extent"
        );
        // A snapshot shares everything; overwriting the live file leaves the old
        // blocks to the snapshot alone.
        fs.snapshot_create(b"s").unwrap();
        let u = fs.space_usage().unwrap();
        assert_eq!((u.shared, u.exclusive, u.snapshot_only), (4 * MB, 0, 0));
        fs.write(b, 0, &vec![2; 4 * MB as usize]).unwrap();
        fs.commit().unwrap();
        let u = fs.space_usage().unwrap();
        assert_eq!(u.snapshot_only, 4 * MB);
        assert_eq!((u.shared, u.exclusive), (0, 8 * MB));
    }
}
