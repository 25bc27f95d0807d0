//! Block devices: what the engine reads from and writes to.

mod aligned;
mod crash;
mod file;
mod mem;

pub use aligned::{AlignedBuf, BufPool};
pub use crash::{CrashDev, CrashOp};
pub use file::FileDev;
pub use mem::MemDev;

use std::io;

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
    /// Reads each `(buf, off)` pair, as `read_at` would; a device that can keep
    /// several reads in flight at once does.
    fn read_many(&self, reads: &mut [(&mut [u8], u64)]) -> io::Result<()> {
        for (buf, off) in reads.iter_mut() {
            self.read_at(buf, *off)?;
        }
        Ok(())
    }
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Size in bytes.
    fn size(&self) -> u64;
}
