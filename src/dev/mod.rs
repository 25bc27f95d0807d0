//! Block devices: what the engine reads from and writes to.

mod aligned;
mod crash;
mod file;
mod mem;

pub use aligned::AlignedBuf;
pub use crash::{CrashDev, CrashOp};
pub use file::{loop_backing_file, FileDev};
pub use mem::{MemDev, DISCARDED};

use std::io;

/// The soft limit of `resource` (`ulimit`: RLIMIT_FSIZE, RLIMIT_AS, ...), `None` when
/// there is none.
pub(crate) fn soft_limit(resource: libc::__rlimit_resource_t) -> Option<u64> {
    // SAFETY: getrlimit with a valid resource and a pointer to a local rlimit.
    let mut lim = unsafe { std::mem::zeroed::<libc::rlimit>() };
    let rc = unsafe { libc::getrlimit(resource, &mut lim) };
    (rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// Writes zeros over `len` bytes of `dev` at `start`, in large pieces in flight
/// together (mkfs over the log area; `mkfs --preallocate` over a whole image), so a
/// sparse image has those blocks allocated before any fsync needs them.
pub fn write_zeros(dev: &dyn BlockDev, start: u64, len: u64) -> io::Result<()> {
    const CHUNK: u64 = 4 << 20;
    const BATCH: u64 = 16;
    let zeros = AlignedBuf::zeroed(CHUNK as usize);
    let mut off = 0;
    while off < len {
        let pieces: Vec<(&[u8], u64)> = (0..BATCH)
            .map(|k| off + k * CHUNK)
            .take_while(|&o| o < len)
            .map(|o| (&zeros[..(len - o).min(CHUNK) as usize], start + o))
            .collect();
        dev.write_many(&pieces)?;
        off += BATCH * CHUNK;
    }
    Ok(())
}

/// The pieces of gathered writes (see [`BlockDev::write_gathered`]), each with the
/// length of the write it belongs to.
pub(crate) fn flatten<'a>(writes: &[(&[&'a [u8]], u64)]) -> (Vec<(&'a [u8], u64)>, Vec<usize>) {
    let mut pieces = Vec::new();
    let mut whole = Vec::new();
    for &(segs, off) in writes {
        let len: usize = segs.iter().map(|s| s.len()).sum();
        let mut at = off;
        for &s in segs {
            pieces.push((s, at));
            whole.push(len);
            at += s.len() as u64;
        }
    }
    (pieces, whole)
}

/// A byte-addressed device with a durability barrier.
pub trait BlockDev: Send + Sync {
    /// Reads exactly `buf.len()` bytes at `off`.
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
    /// Writes all of `buf` at `off`; not durable until `flush`.
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()>;
    /// Writes each `(buf, off)` pair, as `write_at` would; a device that can keep
    /// several writes in flight at once does, so the pieces must not overlap.
    fn write_many(&self, writes: &[(&[u8], u64)]) -> io::Result<()> {
        for &(buf, off) in writes {
            self.write_at(buf, off)?;
        }
        Ok(())
    }
    /// Writes each `(segments, off)`: the segments back to back from `off`, as
    /// `write_many` writes its pieces. A device that sends large writes past its
    /// host's cache judges each write by its whole length, not by its segments'.
    fn write_gathered(&self, writes: &[(&[&[u8]], u64)]) -> io::Result<()> {
        self.write_many(&flatten(writes).0)
    }
    /// Reads each `(buf, off)` pair, as `read_at` would; a device that can keep
    /// several reads in flight at once does.
    fn read_many(&self, reads: &mut [(&mut [u8], u64)]) -> io::Result<()> {
        for (buf, off) in reads.iter_mut() {
            self.read_at(buf, *off)?;
        }
        Ok(())
    }
    /// Makes every write completed before it began durable, or fails: it never
    /// returns Ok with such a write lost (a device that reports a lost write to one
    /// caller only must keep failing after it).
    fn flush(&self) -> io::Result<()>;
    /// Tells the device that `len` bytes at `off` hold nothing (an image file gives
    /// them back to the host as a hole); later reads there may return anything.
    /// Returns false where the device cannot, which is no error.
    fn discard(&self, _off: u64, _len: u64) -> io::Result<bool> {
        Ok(false)
    }
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Whether this is a block device (not an image file or memory).
    fn is_block_device(&self) -> bool {
        false
    }
    /// The size in bytes as it is now, which may have grown since the device was
    /// opened (an image file lengthened, a loop device or volume grown).
    fn current_size(&self) -> io::Result<u64> {
        Ok(self.size())
    }
    /// Makes the device at least `len` bytes where it can (an image file is
    /// lengthened) and takes in what it has grown by; returns its size, which may
    /// still be less than `len` (a block device is only measured again). Never
    /// shrinks it.
    fn grow(&self, _len: u64) -> io::Result<u64> {
        Ok(self.size())
    }
}
