//! Delayed references: refcount changes queued per transaction, keyed by disk
//! address, merged, and applied at commit in address order (seed 4's structure).

use std::collections::BTreeMap;

/// All pending changes to one extent's refcount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DelayedRefHead {
    pub(crate) bytenr: u64,
    pub(crate) len: u64,
    pub(crate) flags: u64,
    pub(crate) delta: i64,
}

/// The running transaction's queued refcount changes.
#[derive(Debug, Default)]
pub(crate) struct DelayedRefs {
    heads: BTreeMap<u64, DelayedRefHead>,
}

impl DelayedRefs {
    /// Queues `delta` references to the extent at `bytenr`; merges with what is queued.
    pub(crate) fn add(&mut self, bytenr: u64, len: u64, flags: u64, delta: i64) {
        self.heads
            .entry(bytenr)
            .and_modify(|h| h.delta += delta)
            .or_insert(DelayedRefHead {
                bytenr,
                len,
                flags,
                delta,
            });
    }

    /// Whether nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    /// Takes every queued head, in address order.
    pub(crate) fn take(&mut self) -> Vec<DelayedRefHead> {
        std::mem::take(&mut self.heads).into_values().collect()
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
        let v = r.take();
        assert_eq!(v.len(), 2);
        assert_eq!((v[0].bytenr, v[0].delta), (4096, 2));
        assert_eq!((v[1].bytenr, v[1].delta), (8192, 0));
        assert!(r.is_empty());
    }
}
