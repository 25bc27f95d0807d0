//! Delayed references: refcount changes queued per transaction, keyed by disk
//! address, merged, and applied at commit in address order (seed 4's structure).
//!
//! The heads live in an ordered map whose link is inside the head, like the kernel's
//! rb_node. Seed 4 moved `href_node` next to `bytenr` so that a search touches one
//! cache line per head it passes instead of two; here the head is 64-byte aligned
//! and starts with its key and its links, which fill the first cache line, and the
//! rest of the record follows. `benches/delayed_refs.rs` measures insert and search
//! against the same record with the links after the other fields.

use crate::skiplist::{Linked, Links, SkipList};

/// All pending changes to one extent's refcount. Key and links share the first
/// cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub struct DelayedRefHead {
    /// Disk address of the extent (the key).
    pub bytenr: u64,
    links: Links,
    /// Length of the extent.
    pub len: u64,
    /// Extent flags (data or tree block).
    pub flags: u64,
    /// Net change of the refcount.
    pub delta: i64,
}

// The key and the whole tower of links fit in the head's first cache line.
const _: () =
    assert!(std::mem::offset_of!(DelayedRefHead, links) + std::mem::size_of::<Links>() <= 64);

impl DelayedRefHead {
    /// A head for `delta` references to the extent at `bytenr`.
    pub fn new(bytenr: u64, len: u64, flags: u64, delta: i64) -> DelayedRefHead {
        DelayedRefHead {
            bytenr,
            links: Links::default(),
            len,
            flags,
            delta,
        }
    }
}

impl Linked for DelayedRefHead {
    fn key(&self) -> u64 {
        self.bytenr
    }
    fn links(&self) -> &Links {
        &self.links
    }
    fn links_mut(&mut self) -> &mut Links {
        &mut self.links
    }
}

/// The running transaction's queued refcount changes.
#[derive(Debug, Default)]
pub struct DelayedRefs {
    heads: SkipList<DelayedRefHead>,
}

impl DelayedRefs {
    /// Queues `delta` references to the extent at `bytenr`; merges with what is queued
    /// (one search either way).
    pub fn add(&mut self, bytenr: u64, len: u64, flags: u64, delta: i64) {
        let mut p = self.heads.search(bytenr);
        match self.heads.after(&p) {
            Some(n) if self.heads.node(n).bytenr == bytenr => {
                self.heads.node_mut(n).delta += delta;
            }
            _ => {
                self.heads
                    .insert_at(&mut p, DelayedRefHead::new(bytenr, len, flags, delta));
            }
        }
    }

    /// The queued head of the extent at `bytenr`.
    pub fn find(&self, bytenr: u64) -> Option<&DelayedRefHead> {
        self.heads.find(bytenr).map(|n| self.heads.node(n))
    }

    /// Number of heads queued.
    pub fn len(&self) -> usize {
        self.heads.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    /// Takes the `n` queued heads of lowest address, in address order.
    pub fn take_first(&mut self, n: usize) -> Vec<DelayedRefHead> {
        let p = self.heads.search(0);
        let mut out = Vec::with_capacity(n.min(self.heads.len()));
        while out.len() < n {
            match self.heads.remove_after(&p) {
                Some(h) => out.push(h),
                None => break,
            }
        }
        out
    }

    /// Every queued head, in address order.
    pub fn iter(&self) -> impl Iterator<Item = &DelayedRefHead> + '_ {
        self.heads.iter()
    }

    /// Takes every queued head, in address order.
    pub fn take(&mut self) -> Vec<DelayedRefHead> {
        let out = self.heads.iter().copied().collect();
        self.heads.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_and_orders_by_address() {
        let mut r = DelayedRefs::default();
        r.add(8192, 4096, 1, 1);
        r.add(4096, 4096, 1, 1);
        r.add(8192, 4096, 1, -1);
        r.add(4096, 4096, 1, 1);
        assert_eq!(r.len(), 2);
        assert_eq!(r.find(4096).unwrap().delta, 2);
        r.add(12288, 4096, 1, 1);
        let first = r.take_first(1);
        assert_eq!((first.len(), first[0].bytenr), (1, 4096));
        assert_eq!(r.len(), 2);
        assert!(r.find(4096).is_none());
        r.add(4096, 4096, 1, 2);
        let v = r.take();
        assert_eq!(v.len(), 3);
        r.add(8192, 4096, 1, 0);
        r.add(4096, 4096, 1, 2);
        let v = r.take();
        assert_eq!(v.len(), 2);
        assert_eq!((v[0].bytenr, v[0].delta), (4096, 2));
        assert_eq!((v[1].bytenr, v[1].delta), (8192, 0));
        assert!(r.is_empty());
        r.add(1, 2, 3, 4);
        assert_eq!(r.take().len(), 1);
    }

    #[test]
    fn many_heads_come_out_sorted_and_merged() {
        let mut r = DelayedRefs::default();
        let mut want = std::collections::BTreeMap::new();
        let mut x = 7u64;
        for _ in 0..50_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let b = (x >> 40) % 20_000 * 4096;
            let d = if x & 1 == 0 { 1 } else { -1 };
            r.add(b, 4096, 1, d);
            *want.entry(b).or_insert(0i64) += d;
        }
        let got: Vec<(u64, i64)> = r.take().iter().map(|h| (h.bytenr, h.delta)).collect();
        assert_eq!(got, want.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn the_key_and_the_links_share_a_cache_line() {
        assert_eq!(std::mem::align_of::<DelayedRefHead>(), 64);
        assert_eq!(std::mem::offset_of!(DelayedRefHead, bytenr), 0);
        assert!(std::mem::offset_of!(DelayedRefHead, links) + std::mem::size_of::<Links>() <= 64);
    }
}
