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
    fn size(&self) -> u64 {
        self.data.read().len() as u64
    }
}
