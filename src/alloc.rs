//! Free-space allocator: free extents in an ordered map, pinned extents, and a
//! metadata reserve.
//!
//! Invariant (DESIGN "pinned extents"): a block freed in generation N is not handed out
//! again before the superblock of generation N is durable. Frees go to `pinned` and
//! return to `free` only through `unpin` after the commit's final flush.
//!
//! Nor while a write into blocks that were preallocated is in flight (see
//! [`Allocator::begin_in_place`]): the file may lose them meanwhile (an unlink), and
//! that late write must not land in whatever they are given to next.
//!
//! The reserve keeps room for the tree copies that a commit, an unlink or an rmdir
//! needs on a full disk: operations that add data or names refuse with ENOSPC before
//! the free space falls into it; freeing operations and commit may use it.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

/// Most free space an operation needs to start (see [`Allocator::has_op_margin`]).
const OP_MARGIN: u64 = 1 << 20;

/// Free extents of one device.
#[derive(Debug, Clone)]
pub(crate) struct Allocator {
    free: BTreeMap<u64, u64>,
    pinned: Vec<(u64, u64)>,
    free_bytes: u64,
    pinned_bytes: u64,
    reserve: u64,
    /// Where the next search starts.
    cursor: u64,
    /// The lowest address it manages.
    start: u64,
    /// Writes in place into preallocated blocks now in flight.
    in_place: usize,
    /// Extents whose freeing commit is durable, held back for those writes.
    held: Vec<(u64, u64)>,
}

impl Allocator {
    /// An allocator over `[start, end)` less `holes`, keeping `reserve` bytes back.
    pub(crate) fn new(start: u64, end: u64, holes: &[(u64, u64)], reserve: u64) -> Allocator {
        let mut a = Allocator {
            free: BTreeMap::new(),
            pinned: Vec::new(),
            free_bytes: 0,
            pinned_bytes: 0,
            reserve,
            cursor: start,
            start,
            in_place: 0,
            held: Vec::new(),
        };
        a.add_free(start, end - start);
        for &(s, l) in holes {
            a.mark_used(s, l);
        }
        a
    }

    /// Free bytes, not counting pinned ones.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Bytes freed in running or committing generations.
    pub(crate) fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes
    }

    /// The metadata reserve.
    pub(crate) fn reserve(&self) -> u64 {
        self.reserve
    }

    /// Whether an operation that adds `need` bytes of data may start.
    pub(crate) fn has_room(&self, need: u64) -> bool {
        self.free_bytes >= self.reserve.saturating_add(need)
    }

    /// Whether `need` bytes of tree growth may come out of the metadata reserve for
    /// a write that needs no data space (its blocks are preallocated): up to half of
    /// the reserve, the rest kept for commits, unlinks and rmdirs.
    pub(crate) fn has_metadata_room(&self, need: u64) -> bool {
        self.free_bytes >= (self.reserve / 2).saturating_add(need)
    }

    /// Whether free space has fallen into the metadata reserve.
    pub(crate) fn in_reserve(&self) -> bool {
        self.free_bytes < self.reserve
    }

    /// Free space an operation needs to start: a quarter of the reserve, at most
    /// 1 MiB (the node copies of any one small operation many times over).
    pub(crate) fn op_margin(&self) -> u64 {
        (self.reserve / 4).min(OP_MARGIN)
    }

    /// Whether an operation may start ([`Allocator::op_margin`] is free).
    pub(crate) fn has_op_margin(&self) -> bool {
        self.free_bytes >= self.op_margin()
    }

    fn add_free(&mut self, start: u64, len: u64) {
        let end = start + len;
        // Free extents that overlap the range: none, unless something frees space
        // twice (extents a damaged image lists twice). Their parts stay as they are
        // and only the gaps are added, so no block is ever handed out twice.
        let mut overlaps: Vec<(u64, u64)> = self
            .free
            .range(..end)
            .rev()
            .take_while(|&(&s, &l)| s + l > start)
            .map(|(&s, &l)| (s, s + l))
            .collect();
        if overlaps.is_empty() {
            return self.add_free_gap(start, len);
        }
        tracing::error!("space at {start:#x} (+{len:#x}) freed while already free, in part");
        overlaps.reverse();
        let mut at = start;
        for (s, e) in overlaps.into_iter().chain([(end, end)]) {
            if s > at {
                self.add_free_gap(at, s.min(end) - at);
            }
            at = at.max(e);
        }
    }

    /// Adds `[start, start+len)`, none of it free, to free space.
    fn add_free_gap(&mut self, mut start: u64, mut len: u64) {
        if len == 0 {
            return;
        }
        self.free_bytes += len;
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            if ps + pl == start {
                self.free.remove(&ps);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += nl;
        }
        self.free.insert(start, len);
    }

    /// Takes in `[old_end, new_end)` (the device grew) less `holes` as free space, and
    /// keeps `reserve` back from then on.
    pub(crate) fn grow(&mut self, old_end: u64, new_end: u64, holes: &[(u64, u64)], reserve: u64) {
        self.add_free(old_end, new_end - old_end);
        for &(s, l) in holes.iter().filter(|&&(s, _)| s >= old_end) {
            self.mark_used(s, l);
        }
        self.reserve = reserve;
    }

    /// Removes `[start, start+len)` from free space wherever it is free.
    pub(crate) fn mark_used(&mut self, start: u64, len: u64) {
        // (Extent keys read from a damaged image may reach past the address space.)
        let end = start.saturating_add(len);
        let overl: Vec<(u64, u64)> = self
            .free
            .range(..end)
            .rev()
            .take_while(|(&s, &l)| s + l > start)
            .map(|(&s, &l)| (s, l))
            .collect();
        for (s, l) in overl {
            self.free.remove(&s);
            self.free_bytes -= l;
            if s < start {
                self.free.insert(s, start - s);
                self.free_bytes += start - s;
            }
            if s + l > end {
                self.free.insert(end, s + l - end);
                self.free_bytes += s + l - end;
            }
        }
    }

    /// Allocates up to `len` bytes (a multiple of 4 KiB), at least `min` contiguous,
    /// next-fit from the last allocation. `reserve_ok` lets it dip into the reserve.
    pub(crate) fn alloc(&mut self, len: u64, min: u64, reserve_ok: bool) -> Result<(u64, u64)> {
        let limit = if reserve_ok { 0 } else { self.reserve };
        if self.free_bytes < limit.saturating_add(min) {
            return Err(Error::NoSpace);
        }
        let pick = self
            .free
            .range(self.cursor..)
            .chain(self.free.range(..self.cursor))
            .find(|(_, &l)| l >= len)
            .or_else(|| {
                self.free
                    .iter()
                    .filter(|(_, &l)| l >= min)
                    .max_by_key(|(_, &l)| l)
            })
            .map(|(&s, &l)| (s, l));
        let (s, l) = pick.ok_or(Error::NoSpace)?;
        let take = len.min(l);
        if !reserve_ok && self.free_bytes - take < self.reserve {
            return Err(Error::NoSpace);
        }
        self.free.remove(&s);
        self.free_bytes -= l;
        if l > take {
            self.free.insert(s + take, l - take);
            self.free_bytes += l - take;
        }
        self.cursor = s + take;
        Ok((s, take))
    }

    /// Free extents of at least `min_len` bytes within `[lo, hi)`, clipped to it, in
    /// address order, up to `max_bytes` of them in all (the last one cut short).
    pub(crate) fn free_within(
        &self,
        lo: u64,
        hi: u64,
        min_len: u64,
        max_bytes: u64,
    ) -> Vec<(u64, u64)> {
        let first = self
            .free
            .range(..=lo)
            .next_back()
            .filter(|(&s, &l)| s + l > lo)
            .map(|(&s, &l)| (s, l));
        let mut out = Vec::new();
        let mut total = 0;
        for (s, l) in first.into_iter().chain(
            self.free
                .range(lo.saturating_add(1)..hi)
                .map(|(&s, &l)| (s, l)),
        ) {
            let (s, e) = (s.max(lo), (s + l).min(hi));
            if e <= s || e - s < min_len.max(1) {
                continue;
            }
            let take = (e - s).min(max_bytes - total);
            out.push((s, take));
            total += take;
            if total >= max_bytes {
                break;
            }
        }
        out
    }

    /// Returns space that was allocated but never referenced (a failed operation).
    pub(crate) fn release_unused(&mut self, start: u64, len: u64) {
        self.add_free(start, len);
    }

    /// Frees an extent once the running generation is durable.
    pub(crate) fn pin(&mut self, start: u64, len: u64) {
        self.pinned.push((start, len));
        self.pinned_bytes += len;
    }

    /// Takes the extents pinned so far (at commit), to release after the flush.
    pub(crate) fn take_pinned(&mut self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.pinned)
    }

    /// Returns extents whose freeing commit is durable.
    ///
    /// The next allocation starts looking from the bottom again: space freed by
    /// copy-on-write is reused soon, so the device's used span stays compact (a
    /// sparse image file or a thin device does not grow on every overwrite), while
    /// allocations within one generation still go forward, next to each other.
    pub(crate) fn unpin(&mut self, list: Vec<(u64, u64)>) {
        if self.in_place > 0 {
            self.held.extend(list);
            return;
        }
        for (s, l) in list.into_iter().chain(std::mem::take(&mut self.held)) {
            self.pinned_bytes -= l;
            self.add_free(s, l);
        }
        self.cursor = self.start;
    }

    /// Notes a write into preallocated blocks about to go out without the fs lock:
    /// nothing is unpinned until it ends ([`Allocator::end_in_place`]).
    pub(crate) fn begin_in_place(&mut self) {
        self.in_place += 1;
    }

    /// Ends a write noted by [`Allocator::begin_in_place`]; the last one to end
    /// releases what was held back for them.
    pub(crate) fn end_in_place(&mut self) {
        self.in_place -= 1;
        if self.in_place == 0 && !self.held.is_empty() {
            self.unpin(Vec::new());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_pin_unpin_and_coalesce() {
        let mut a = Allocator::new(0, 1 << 20, &[(4096, 4096)], 0);
        assert_eq!(a.free_bytes(), (1 << 20) - 4096);
        let (s, l) = a.alloc(8192, 4096, false).unwrap();
        assert_eq!(l, 8192);
        assert!(s >= 8192, "must skip the hole");
        a.pin(s, l);
        let before = a.free_bytes();
        let p = a.take_pinned();
        assert_eq!(a.free_bytes(), before, "pinned space is not free");
        a.unpin(p);
        assert_eq!(a.free_bytes(), before + 8192);
        assert_eq!(a.free.len(), 2, "freed range coalesced back");
    }

    /// Free extents are found within a window, clipped to it, long enough, in order,
    /// and no more of them than asked; pinned space is not free.
    #[test]
    fn free_within_clips_filters_and_stops() {
        let mut a = Allocator::new(0, 1 << 20, &[], 0);
        // Used: [0, 64K), [96K, 100K), [200K, 1M); free: [64K, 96K), [100K, 200K).
        a.mark_used(0, 64 << 10);
        a.mark_used(96 << 10, 4 << 10);
        a.mark_used(200 << 10, (1 << 20) - (200 << 10));
        const K: u64 = 1 << 10;
        assert_eq!(
            a.free_within(0, 1 << 20, 0, u64::MAX),
            vec![(64 * K, 32 * K), (100 * K, 100 * K)]
        );
        assert_eq!(
            a.free_within(80 * K, 150 * K, 0, u64::MAX),
            vec![(80 * K, 16 * K), (100 * K, 50 * K)],
            "clipped to the window"
        );
        assert_eq!(
            a.free_within(0, 1 << 20, 64 * K, u64::MAX),
            vec![(100 * K, 100 * K)],
            "too short"
        );
        assert_eq!(
            a.free_within(0, 1 << 20, 0, 40 * K),
            vec![(64 * K, 32 * K), (100 * K, 8 * K)],
            "stops at max_bytes"
        );
        assert!(a.free_within(300 * K, 1 << 20, 0, u64::MAX).is_empty());
        let (s, l) = a.alloc(4 * K, 4 * K, false).unwrap();
        a.pin(s, l);
        assert!(
            !a.free_within(0, 1 << 20, 0, u64::MAX)
                .iter()
                .any(|&(fs, fl)| fs < s + l && s < fs + fl),
            "an allocated, pinned extent is offered"
        );
    }

    /// Space whose freeing commit became durable while writes into preallocated
    /// blocks were in flight comes back only when the last of them ends.
    #[test]
    fn frees_wait_for_writes_in_place_in_flight() {
        let mut a = Allocator::new(0, 1 << 20, &[], 0);
        let (s, l) = a.alloc(8192, 4096, false).unwrap();
        let (s2, l2) = a.alloc(4096, 4096, false).unwrap();
        let before = a.free_bytes();
        a.begin_in_place();
        a.begin_in_place();
        a.pin(s, l);
        let p = a.take_pinned();
        a.unpin(p);
        a.pin(s2, l2);
        let p = a.take_pinned();
        a.unpin(p);
        assert_eq!(a.free_bytes(), before, "freed while writes were in flight");
        assert_eq!(a.pinned_bytes(), l + l2);
        a.end_in_place();
        assert_eq!(
            a.free_bytes(),
            before,
            "freed while one write was in flight"
        );
        a.end_in_place();
        assert_eq!(a.free_bytes(), before + l + l2);
        assert_eq!(a.pinned_bytes(), 0);
    }

    /// Space freed twice, whole or in part (extents a damaged image lists twice),
    /// counts once and is handed out once.
    #[test]
    fn space_freed_twice_is_handed_out_once() {
        let mut a = Allocator::new(0, 64 << 10, &[], 0);
        let (s, l) = a.alloc(64 << 10, 4096, false).unwrap();
        assert_eq!((s, l), (0, 64 << 10));
        a.release_unused(8 << 10, 16 << 10);
        a.release_unused(16 << 10, 16 << 10);
        a.release_unused(4 << 10, 8 << 10);
        a.release_unused(8 << 10, 4 << 10);
        assert_eq!(a.free_bytes(), 28 << 10, "4K..32K free, counted once");
        let mut got = Vec::new();
        while let Ok((s, l)) = a.alloc(4096, 4096, false) {
            got.push((s, l));
        }
        got.sort_unstable();
        let want: Vec<(u64, u64)> = (1..8).map(|i| (i * 4096, 4096)).collect();
        assert_eq!(got, want, "each free block once");
        assert_eq!(a.free_bytes(), 0);
    }

    #[test]
    fn reserve_refuses_data_but_not_metadata() {
        let mut a = Allocator::new(0, 64 << 10, &[], 32 << 10);
        assert!(a.alloc(32 << 10, 4096, false).is_ok());
        assert!(matches!(a.alloc(4096, 4096, false), Err(Error::NoSpace)));
        assert!(a.alloc(4096, 4096, true).is_ok());
        assert!(!a.has_room(1));
    }

    #[test]
    fn short_extents_when_fragmented() {
        let mut a = Allocator::new(0, 16 * 4096, &[], 0);
        let mut got = vec![];
        while let Ok(x) = a.alloc(4096, 4096, false) {
            got.push(x);
        }
        assert_eq!(got.len(), 16);
        for (i, x) in got.iter().enumerate() {
            if i % 2 == 0 {
                a.pin(x.0, x.1);
            }
        }
        let p = a.take_pinned();
        a.unpin(p);
        let (_, l) = a.alloc(65536, 4096, false).unwrap();
        assert_eq!(l, 4096, "only single blocks are free");
    }
}
