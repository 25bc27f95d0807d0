//! Memory for folio buffers: slots of 2 MiB chunks that the kernel may back with
//! transparent huge pages.
//!
//! A folio on its own anonymous pages is made of scattered 4 KiB pages, and each is
//! one segment of a direct read or write. A request to the device holds at most its
//! `max_segments` of them (254 on virtio-blk, so about 1 MiB), however large the
//! readahead window. A folio inside a huge page is physically contiguous, one
//! segment, so the block layer merges a window's folios into requests of up to
//! `max_sectors_kb`. On the benchmark machine's disk, 4 GiB read with O_DIRECT in
//! 4 MiB pieces ran at 3,960-4,050 MiB/s into a huge-page buffer against 1,620-2,490
//! into 4 KiB pages (requests of 3.2 MiB against 1 MiB).
//!
//! Only folios about to be filled whole take a slot (see `FolioBuf::contiguous`): the
//! kernel clears a huge page whole on its first touch, which a random 4 KiB write
//! should not pay for.
//!
//! A chunk is mapped 2 MiB aligned and advised `MADV_HUGEPAGE` (which matters where
//! the system's THP mode is `madvise`, the common default). Without huge pages it
//! works the same on 4 KiB pages. A chunk goes back to the kernel when its last slot
//! is freed; a slot freed earlier is zeroed and handed out again, from the
//! lowest-addressed chunk with room, so that live folios pack into few chunks.

use std::collections::{BTreeSet, HashMap};
use std::ptr::NonNull;

/// Size and alignment of a chunk: one PMD-sized huge page on x86-64 and arm64 (4 KiB
/// pages).
pub(crate) const CHUNK: usize = 2 << 20;

/// The slots of one chunk.
struct Chunk {
    /// Slots freed since they were handed out (their bytes are not zero).
    free: Vec<u32>,
    /// Slots from here on were never handed out (still zero from the mapping).
    fresh: u32,
    /// Slots handed out and not freed.
    used: u32,
}

/// The chunks that hold slots of one size.
struct Class {
    /// Slots in a chunk.
    slots: u32,
    /// Chunks by base address.
    chunks: HashMap<usize, Chunk>,
    /// Bases of the chunks with a slot to hand out.
    room: BTreeSet<usize>,
}

/// Every size's chunks, for the whole process (mounts of one process share them).
static CLASSES: parking_lot::Mutex<Option<HashMap<usize, Class>>> = parking_lot::const_mutex(None);

/// A fresh private anonymous mapping of `len` zero bytes, readable and writable;
/// `None` when the kernel refuses it (`vm.max_map_count`, no memory).
pub(crate) fn map_anon(len: usize) -> Option<NonNull<u8>> {
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    NonNull::new(p.cast::<u8>())
}

/// Maps a fresh chunk, 2 MiB aligned and advised for huge pages; `None` when the
/// kernel refuses the mapping.
fn map_chunk() -> Option<usize> {
    let span = 2 * CHUNK;
    let p = map_anon(span)?.as_ptr();
    let start = p as usize;
    let base = start.next_multiple_of(CHUNK);
    // SAFETY: both ranges lie inside the mapping just made and nothing refers to them.
    unsafe {
        if base > start {
            libc::munmap(start as *mut libc::c_void, base - start);
        }
        let end = base + CHUNK;
        if start + span > end {
            libc::munmap(end as *mut libc::c_void, start + span - end);
        }
        // Advice only: without it (THP off, an old kernel) the chunk is 4 KiB pages.
        libc::madvise(base as *mut libc::c_void, CHUNK, libc::MADV_HUGEPAGE);
    }
    Some(base)
}

/// A zeroed, page-aligned slot of `len` bytes (a multiple of 4096, at most
/// [`CHUNK`]); `None` when `len` does not fit a chunk or no chunk can be mapped.
pub(crate) fn alloc(len: usize) -> Option<NonNull<u8>> {
    if len == 0 || len % 4096 != 0 || len > CHUNK {
        return None;
    }
    let mut g = CLASSES.lock();
    let class = g
        .get_or_insert_with(HashMap::new)
        .entry(len)
        .or_insert_with(|| Class {
            slots: (CHUNK / len) as u32,
            chunks: HashMap::new(),
            room: BTreeSet::new(),
        });
    let base = match class.room.first() {
        Some(&b) => b,
        None => {
            let b = map_chunk()?;
            class.chunks.insert(
                b,
                Chunk {
                    free: Vec::new(),
                    fresh: 0,
                    used: 0,
                },
            );
            class.room.insert(b);
            b
        }
    };
    let slots = class.slots;
    let c = class
        .chunks
        .get_mut(&base)
        .expect("a chunk with room is mapped");
    let (slot, reused) = match c.free.pop() {
        Some(s) => (s, true),
        None => {
            c.fresh += 1;
            (c.fresh - 1, false)
        }
    };
    c.used += 1;
    if c.free.is_empty() && c.fresh == slots {
        class.room.remove(&base);
    }
    drop(g);
    let p = (base + slot as usize * len) as *mut u8;
    if reused {
        // SAFETY: the slot is `len` bytes of the chunk, handed to this caller alone.
        unsafe { std::ptr::write_bytes(p, 0, len) };
    }
    NonNull::new(p)
}

/// Whether a freed slot's pages go back to the system at once (while memory is short:
/// see [`release_freed`]), not only with its whole chunk.
static RELEASE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes freed slots give their pages back to the system at once (`on`), or keep them
/// until their chunk is empty (the default: a reused slot then costs no page faults).
pub(crate) fn release_freed(on: bool) {
    RELEASE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Returns a slot that [`alloc`] gave for `len` bytes.
pub(crate) fn free(p: NonNull<u8>, len: usize) {
    free_with(p, len, RELEASE.load(std::sync::atomic::Ordering::Relaxed))
}

/// [`free`], giving the slot's pages back to the system first when `release`.
fn free_with(p: NonNull<u8>, len: usize, release: bool) {
    if release {
        // SAFETY: the slot is still this caller's alone (it is listed free below), so
        // dropping its pages (they read as zeros after) disturbs no one.
        unsafe { libc::madvise(p.as_ptr().cast(), len, libc::MADV_DONTNEED) };
    }
    let addr = p.as_ptr() as usize;
    let base = addr & !(CHUNK - 1);
    let mut g = CLASSES.lock();
    let Some(class) = g.as_mut().and_then(|m| m.get_mut(&len)) else {
        debug_assert!(false, "a slot of a size never allocated");
        return;
    };
    let Some(c) = class.chunks.get_mut(&base) else {
        debug_assert!(false, "a slot of an unknown chunk");
        return;
    };
    c.used -= 1;
    if c.used == 0 {
        class.chunks.remove(&base);
        class.room.remove(&base);
        drop(g);
        // SAFETY: the chunk mapped in `map_chunk`; its last slot is no longer used.
        unsafe { libc::munmap(base as *mut libc::c_void, CHUNK) };
        return;
    }
    c.free.push(((addr - base) / len) as u32);
    class.room.insert(base);
}

/// Chunks mapped for slots of `len` bytes (for tests).
#[cfg(test)]
fn chunks(len: usize) -> usize {
    CLASSES
        .lock()
        .as_ref()
        .and_then(|m| m.get(&len))
        .map_or(0, |c| c.chunks.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_zeroed_aligned_distinct_and_chunks_go_back_when_empty() {
        // A size no other test uses, so the chunk count is this test's alone.
        let len = 12 << 10;
        let per = CHUNK / len; // 170 slots, the last 8 KiB of a chunk unused
        let mut ps: Vec<NonNull<u8>> = (0..per).map(|_| alloc(len).unwrap()).collect();
        assert_eq!(chunks(len), 1, "one chunk holds {per} slots");
        let mut addrs: Vec<usize> = ps.iter().map(|p| p.as_ptr() as usize).collect();
        addrs.sort_unstable();
        for w in addrs.windows(2) {
            assert!(w[1] - w[0] >= len, "slots overlap");
        }
        assert!(
            addrs[per - 1] + len - addrs[0] <= CHUNK,
            "slots outside the chunk"
        );
        for p in &ps {
            assert_eq!(p.as_ptr() as usize % 4096, 0);
            // SAFETY: a live slot of `len` bytes.
            let s = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), len) };
            assert!(s.iter().all(|&b| b == 0), "not zeroed");
            s.fill(0xa5);
        }
        // A freed slot of the full chunk is the one handed out next, zeroed.
        let mid = ps.swap_remove(per / 2);
        let at = mid.as_ptr() as usize;
        free(mid, len);
        let again = alloc(len).unwrap();
        assert_eq!(again.as_ptr() as usize, at);
        // SAFETY: as above.
        let s = unsafe { std::slice::from_raw_parts(again.as_ptr(), len) };
        assert!(s.iter().all(|&b| b == 0), "a reused slot was not zeroed");
        ps.push(again);
        // The chunk is full: the next slot maps another.
        ps.push(alloc(len).unwrap());
        assert_eq!(chunks(len), 2);
        for p in ps {
            free(p, len);
        }
        assert_eq!(chunks(len), 0, "empty chunks were not unmapped");
    }

    /// Whether every page of `len` bytes at `p` is resident.
    fn resident(p: NonNull<u8>, len: usize) -> bool {
        let mut v = vec![0u8; len / 4096];
        // SAFETY: `p` is page aligned and `len` bytes of a live mapping; `v` has one
        // byte per page.
        let rc = unsafe { libc::mincore(p.as_ptr().cast(), len, v.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().all(|b| b & 1 == 1)
    }

    /// A slot freed with `release` gives its pages back at once though its chunk stays;
    /// without, they stay for the slot's next user.
    #[test]
    fn a_released_slot_gives_its_pages_back_while_its_chunk_stays() {
        let len = 28 << 10; // a size of this test's own
        let ps: Vec<NonNull<u8>> = (0..3).map(|_| alloc(len).unwrap()).collect();
        // On 4 KiB pages only: khugepaged may at any moment collapse a chunk advised for
        // huge pages, released pages and all, back into one resident huge page (the
        // likely cause of this test's one failure in CI, not seen here in 300 runs).
        let base = ps[0].as_ptr() as usize & !(CHUNK - 1);
        // SAFETY: advice on this test's own chunk; no bytes change.
        let rc = unsafe { libc::madvise(base as *mut libc::c_void, CHUNK, libc::MADV_NOHUGEPAGE) };
        assert_eq!(rc, 0, "madvise: {}", std::io::Error::last_os_error());
        for p in &ps {
            // SAFETY: each slot is `len` bytes, ours.
            unsafe { std::ptr::write_bytes(p.as_ptr(), 0xA5, len) };
            assert!(resident(*p, len));
        }
        free_with(ps[0], len, false);
        assert!(resident(ps[0], len), "kept without release");
        free_with(ps[1], len, true);
        assert!(!resident(ps[1], len), "released");
        // SAFETY: the freed slot is still mapped and no one else uses this size.
        let b = unsafe { std::slice::from_raw_parts(ps[1].as_ptr(), len) };
        assert!(b.iter().all(|&x| x == 0), "a released slot kept its bytes");
        assert!(resident(ps[2], len), "a live slot keeps its pages");
        assert_eq!(chunks(len), 1);
        // Reused, a released slot reads as zeros like any other.
        let again: Vec<NonNull<u8>> = (0..2).map(|_| alloc(len).unwrap()).collect();
        for p in &again {
            // SAFETY: `len` bytes, ours.
            let b = unsafe { std::slice::from_raw_parts(p.as_ptr(), len) };
            assert!(b.iter().all(|&x| x == 0));
        }
        for p in again.into_iter().chain([ps[2]]) {
            free(p, len);
        }
        assert_eq!(chunks(len), 0);
    }

    #[test]
    fn sizes_that_do_not_fit_a_chunk_are_refused() {
        assert!(alloc(0).is_none());
        assert!(alloc(4097).is_none());
        assert!(alloc(CHUNK + 4096).is_none());
        let whole = alloc(CHUNK).unwrap();
        assert_eq!(whole.as_ptr() as usize % CHUNK, 0);
        free(whole, CHUNK);
    }

    /// The `THPeligible` line of the mapping of /proc/self/smaps that holds `addr`.
    fn thp_eligible(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = head.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = a <= addr && addr < b;
                    continue;
                }
            }
            if inside && line.starts_with("THPeligible:") {
                return Some(line["THPeligible:".len()..].trim().to_string());
            }
        }
        None
    }

    #[test]
    fn chunks_are_advised_for_huge_pages_where_the_system_allows_them() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        let Ok(mode) = mode else {
            return; // no THP in this kernel: nothing to advise
        };
        if mode.contains("[never]") {
            return;
        }
        let len = 20 << 10; // a size of this test's own
        let p = alloc(len).unwrap();
        let eligible = thp_eligible(p.as_ptr() as usize);
        free(p, len);
        assert_eq!(eligible.as_deref(), Some("1"), "THP mode {}", mode.trim());
    }
}
