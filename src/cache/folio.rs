//! A folio: a run of file blocks cached together, with one uptodate and one dirty
//! bit per 4 KiB block (seed 5: writeback writes only the dirty blocks).
//!
//! Invariants: a dirty block is always uptodate (a partial-block write reads the
//! block first), and the bytes of a block that is not uptodate mean nothing (a folio's
//! buffer may be a recycled one): whoever marks a block uptodate has written all of it.

use std::time::Instant;

/// Most blocks a folio can hold: 1 MiB of 4 KiB blocks.
pub(crate) const MAX_BLOCKS: usize = 256;

/// One bit per block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Bitmap([u64; MAX_BLOCKS / 64]);

impl Bitmap {
    /// Whether block `b` is set.
    pub(crate) fn get(&self, b: usize) -> bool {
        self.0[b / 64] & (1 << (b % 64)) != 0
    }

    /// Sets blocks `[a, b)`; returns how many were not set before.
    pub(crate) fn set_range(&mut self, a: usize, b: usize) -> usize {
        let mut n = 0;
        for i in a..b {
            if !self.get(i) {
                self.0[i / 64] |= 1 << (i % 64);
                n += 1;
            }
        }
        n
    }

    /// Clears blocks `[a, b)`.
    pub(crate) fn clear_range(&mut self, a: usize, b: usize) {
        for i in a..b {
            self.0[i / 64] &= !(1 << (i % 64));
        }
    }

    /// Number of set blocks.
    pub(crate) fn count(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether any block is set.
    pub(crate) fn any(&self) -> bool {
        self.0.iter().any(|&w| w != 0)
    }

    /// Maximal runs `[a, b)` of set blocks among the first `n`, in order.
    pub(crate) fn runs(&self, n: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < n {
            if self.get(i) {
                let s = i;
                while i < n && self.get(i) {
                    i += 1;
                }
                out.push((s, i));
            } else {
                i += 1;
            }
        }
        out
    }
}

/// Where a [`FolioBuf`]'s memory comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backing {
    /// A slot of a huge-page chunk ([`super::arena`]).
    Slot,
    /// An anonymous mapping of its own.
    Mapped,
    /// The heap, with [`FolioBuf::layout`].
    Heap,
}

/// The memory of a folio: page aligned (the device reads into it directly) and of
/// exactly the folio's size.
///
/// A folio that is about to be filled whole (a readahead window's, a sequential
/// writer's) takes a slot of a huge-page chunk, so that it is physically contiguous and
/// a window reaches the device in large requests (see [`super::arena`]). Any other
/// folio gets anonymous pages of its own, which the kernel backs only where they are
/// touched: a random 4 KiB write into a folio on a huge page would first have the
/// kernel clear 2 MiB (W3 ran 17 % slower so, 41.6 against 49.9 MiB/s). The heap's
/// aligned allocations left gaps between folio buffers that a streaming write's peak
/// of folios turned into half as much memory again, so the heap is only the fallback
/// where the kernel refuses another mapping.
pub(crate) struct FolioBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: the memory is owned by the FolioBuf alone, like a Box<[u8]>.
unsafe impl Send for FolioBuf {}
// SAFETY: shared access only reads, as through &[u8].
unsafe impl Sync for FolioBuf {}

impl FolioBuf {
    /// `len` zero bytes (a multiple of the page size) on pages of its own; aborts when
    /// out of memory, as the heap's allocations do.
    pub(crate) fn new(len: usize) -> FolioBuf {
        assert!(len > 0 && len % 4096 == 0, "folio buffers hold whole pages");
        match super::arena::map_anon(len) {
            Some(ptr) => FolioBuf {
                ptr,
                len,
                backing: Backing::Mapped,
            },
            None => Self::heap(len),
        }
    }

    /// `len` zero bytes like [`FolioBuf::new`], physically contiguous where the kernel
    /// has huge pages: for a folio that will be filled whole.
    pub(crate) fn contiguous(len: usize) -> FolioBuf {
        // A length no slot takes falls to `new`, which refuses what is not whole pages.
        match super::arena::alloc(len) {
            Some(ptr) => FolioBuf {
                ptr,
                len,
                backing: Backing::Slot,
            },
            None => Self::new(len),
        }
    }

    /// [`FolioBuf::new`] from the heap.
    fn heap(len: usize) -> FolioBuf {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        match std::ptr::NonNull::new(p) {
            Some(ptr) => FolioBuf {
                ptr,
                len,
                backing: Backing::Heap,
            },
            None => std::alloc::handle_alloc_error(layout),
        }
    }

    /// The heap layout of a buffer of `len` bytes.
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len, 4096).expect("a valid layout")
    }

    /// Whether it is a slot of a huge-page chunk.
    pub(crate) fn is_contiguous(&self) -> bool {
        self.backing == Backing::Slot
    }
}

impl Drop for FolioBuf {
    fn drop(&mut self) {
        match self.backing {
            Backing::Slot => super::arena::free(self.ptr, self.len),
            // SAFETY: the mapping made in `new`, no longer borrowed.
            Backing::Mapped => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.len);
            },
            // SAFETY: allocated in `heap` with this layout, no longer borrowed.
            Backing::Heap => unsafe {
                std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len))
            },
        }
    }
}

impl std::ops::Deref for FolioBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped readable and writable, owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl FolioBuf {
    /// The bytes of `range`, to change them.
    ///
    /// Only this range is borrowed mutably, never the whole buffer: a writeback reads
    /// the blocks it writes straight from the buffer while other blocks of the folio
    /// are filled (see `Folio::writeback`).
    pub(crate) fn range_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} out of a folio buffer of {} bytes",
            self.len
        );
        // SAFETY: within the `len` bytes owned by self, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(range.start), range.len()) }
    }
}

impl std::fmt::Debug for FolioBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FolioBuf({} bytes)", self.len)
    }
}

/// The cached bytes of one folio and the state of each of its blocks.
#[derive(Debug)]
pub(crate) struct Folio {
    /// The folio's bytes (aligned: the device reads into them directly); those of
    /// blocks that are not uptodate are left over.
    pub(crate) data: FolioBuf,
    /// Blocks whose bytes are the file's current contents.
    pub(crate) uptodate: Bitmap,
    /// Blocks newer than the device (each also uptodate).
    pub(crate) dirty: Bitmap,
    /// When the oldest dirty block was dirtied (for `dirty_expire`).
    pub(crate) dirty_since: Option<Instant>,
    /// A writeback is writing blocks of this folio to the device straight from `data`
    /// (and checksumming them there): until it ends, nothing may change those bytes,
    /// so a writer of the folio waits (stable pages, as btrfs needs them for its
    /// checksums). Readers go on, and fills only touch blocks that are not uptodate.
    pub(crate) writeback: bool,
}

impl Folio {
    /// An empty folio of `size` bytes: nothing uptodate, nothing dirty.
    #[cfg(test)]
    pub(crate) fn new(size: usize) -> Folio {
        Folio::with_buffer(FolioBuf::new(size))
    }

    /// An empty folio over `data`, whose bytes mean nothing until their block is
    /// uptodate: whoever makes a block uptodate writes all of it.
    pub(crate) fn with_buffer(data: FolioBuf) -> Folio {
        Folio {
            data,
            uptodate: Bitmap::default(),
            dirty: Bitmap::default(),
            dirty_since: None,
            writeback: false,
        }
    }

    /// Marks blocks `[a, b)` dirty (and uptodate); returns how many were clean.
    pub(crate) fn mark_dirty(&mut self, a: usize, b: usize) -> usize {
        debug_assert!(
            (a..b).all(|i| self.uptodate.get(i)),
            "dirty block not uptodate"
        );
        let n = self.dirty.set_range(a, b);
        if n > 0 && self.dirty_since.is_none() {
            self.dirty_since = Some(Instant::now());
        }
        n
    }

    /// Clears the dirty bits of `[a, b)` (their bytes are on their way to the device).
    pub(crate) fn clear_dirty(&mut self, a: usize, b: usize) {
        self.dirty.clear_range(a, b);
        if !self.dirty.any() {
            self.dirty_since = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folio_buffers_are_zeroed_page_aligned_and_their_own() {
        for mut b in [
            FolioBuf::new(64 << 10),
            FolioBuf::contiguous(64 << 10),
            FolioBuf::heap(64 << 10),
        ] {
            assert_eq!(b.len(), 64 << 10);
            assert_eq!(b.as_ptr() as usize % 4096, 0, "not page aligned");
            assert!(b.iter().all(|&x| x == 0), "not zeroed");
            b.range_mut(100..101)[0] = 7;
            b.range_mut((64 << 10) - 1..64 << 10)[0] = 9;
            let other = FolioBuf::new(64 << 10);
            assert_eq!((b[100], b[(64 << 10) - 1], other[100]), (7, 9, 0));
        }
    }

    #[test]
    fn bitmap_runs_and_counts() {
        let mut m = Bitmap::default();
        assert_eq!(m.set_range(3, 6), 3);
        assert_eq!(m.set_range(5, 8), 2);
        assert_eq!(m.set_range(63, 66), 3);
        assert_eq!(m.set_range(255, 256), 1);
        assert_eq!(m.count(), 9);
        assert_eq!(m.runs(256), vec![(3, 8), (63, 66), (255, 256)]);
        assert_eq!(m.runs(64), vec![(3, 8), (63, 64)]);
        m.clear_range(4, 64);
        assert_eq!(m.runs(256), vec![(3, 4), (64, 66), (255, 256)]);
        m.clear_range(0, 256);
        assert!(!m.any());
    }

    #[test]
    fn dirty_marks_only_the_touched_blocks_and_keeps_its_age() {
        let mut f = Folio::new(16 * 4096);
        f.uptodate.set_range(0, 16);
        assert_eq!(f.mark_dirty(2, 3), 1);
        let t = f.dirty_since.unwrap();
        assert_eq!(f.mark_dirty(2, 5), 2);
        assert_eq!(f.dirty_since, Some(t));
        assert_eq!(f.dirty.runs(16), vec![(2, 5)]);
        f.clear_dirty(2, 4);
        assert_eq!(f.dirty.runs(16), vec![(4, 5)]);
        assert!(f.dirty_since.is_some());
        f.clear_dirty(4, 5);
        assert!(f.dirty_since.is_none());
    }
}
