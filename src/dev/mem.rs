//! A device in memory, for tests and the library's scratch use.

use std::io;

use parking_lot::RwLock;

use super::BlockDev;

/// A zero-filled device held in memory; flush is a no-op.
#[derive(Debug)]
pub struct MemDev {
    data: RwLock<Vec<u8>>,
}

impl MemDev {
    /// A device of `size` bytes of zeros.
    pub fn new(size: u64) -> MemDev {
        MemDev {
            data: RwLock::new(vec![0; size as usize]),
        }
    }
    /// A device holding `image`.
    pub fn from_image(image: Vec<u8>) -> MemDev {
        MemDev {
            data: RwLock::new(image),
        }
    }
    /// A copy of the whole device.
    pub fn image(&self) -> Vec<u8> {
        self.data.read().clone()
    }
}

pub(super) fn check_range(len: usize, off: u64, size: usize) -> io::Result<usize> {
    let off = usize::try_from(off).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    match off.checked_add(len) {
        Some(end) if end <= size => Ok(off),
        _ => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
    }
}

impl BlockDev for MemDev {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let d = self.data.read();
        let o = check_range(buf.len(), off, d.len())?;
        buf.copy_from_slice(&d[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let mut d = self.data.write();
        let o = check_range(buf.len(), off, d.len())?;
        d[o..o + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    /// Fills the range with [`DISCARDED`], so that a test that reads a discarded block
    /// back as if it still held something sees it fail its checksum.
    fn discard(&self, off: u64, len: u64) -> io::Result<bool> {
        let mut d = self.data.write();
        let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let o = check_range(len, off, d.len())?;
        d[o..o + len].fill(DISCARDED);
        Ok(true)
    }
    fn size(&self) -> u64 {
        self.data.read().len() as u64
    }
    fn grow(&self, len: u64) -> io::Result<u64> {
        let mut d = self.data.write();
        if (d.len() as u64) < len {
            d.resize(len as usize, 0);
        }
        Ok(d.len() as u64)
    }
}

/// What the memory devices leave in a discarded range.
pub const DISCARDED: u8 = 0xdb;
