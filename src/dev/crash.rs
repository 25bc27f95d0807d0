//! A crash-recording device: keeps every write and flush so tests can rebuild what a
//! power cut could leave on the disk.
//!
//! Model: writes between two flushes may reach the disk in any order, in part (a
//! multi-block write may be torn at 4 KiB boundaries), or not at all; a flush makes
//! every earlier write durable. A flush that takes time
//! ([`CrashDev::set_flush_delay`]) is recorded when it returns and makes durable what
//! was written before it began ([`CrashDev::flush_covers`]).

use std::io;

use parking_lot::Mutex;

use super::mem::check_range;
use super::BlockDev;

/// One recorded device operation.
#[derive(Debug, Clone)]
pub enum CrashOp {
    /// A write of `data` at `off`.
    Write {
        /// Byte offset.
        off: u64,
        /// The bytes written.
        data: Vec<u8>,
    },
    /// A durability barrier.
    Flush,
}

#[derive(Debug)]
struct Inner {
    base: Vec<u8>,
    live: Vec<u8>,
    ops: Vec<CrashOp>,
    /// For each flush, in the order of `ops`: how many ops came before it began.
    covers: Vec<usize>,
    fail_after: Option<usize>,
    /// How many of the next flushes fail, once each (see [`CrashDev::fail_flushes`]).
    failing_flushes: usize,
    /// Writes reaching bytes from here on fail with ENOSPC (see
    /// [`CrashDev::refuse_writes_from`]).
    no_room_from: Option<u64>,
}

/// A memory device that records every write and flush since it was made.
#[derive(Debug)]
pub struct CrashDev {
    inner: Mutex<Inner>,
    /// How long each flush takes before it is recorded, in µs (see
    /// [`CrashDev::set_flush_delay`]).
    flush_delay_us: std::sync::atomic::AtomicU64,
}

impl CrashDev {
    /// Records on top of `image`, which counts as durable.
    pub fn new(image: Vec<u8>) -> CrashDev {
        CrashDev {
            inner: Mutex::new(Inner {
                live: image.clone(),
                base: image,
                ops: Vec::new(),
                covers: Vec::new(),
                fail_after: None,
                failing_flushes: 0,
                no_room_from: None,
            }),
            flush_delay_us: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Makes each flush take `d`, as a device's flush takes time: it is recorded when
    /// it returns and covers only the writes recorded before it began, so flushes of
    /// concurrent callers overlap and a write made during one is not durable by it.
    pub fn set_flush_delay(&self, d: std::time::Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.flush_delay_us
            .store(us, std::sync::atomic::Ordering::Relaxed);
    }

    /// The operations recorded so far.
    pub fn ops(&self) -> Vec<CrashOp> {
        self.inner.lock().ops.clone()
    }

    /// Number of recorded operations.
    pub fn op_count(&self) -> usize {
        self.inner.lock().ops.len()
    }

    /// Makes every write and flush after `n` more operations fail with EIO (a dead disk).
    pub fn fail_after(&self, n: usize) {
        let mut g = self.inner.lock();
        g.fail_after = Some(g.ops.len() + n);
    }

    /// Makes the next `n` flushes fail with EIO, and the device work again after
    /// them: a write lost in the host's cache, which Linux's fdatasync reports to one
    /// caller (per open file) and then forgets.
    pub fn fail_flushes(&self, n: usize) {
        self.inner.lock().failing_flushes = n;
    }

    /// Makes writes that reach bytes at `off` or past it fail with ENOSPC, unrecorded,
    /// as the holes of a sparse image do once its host is full (`None`: room again).
    pub fn refuse_writes_from(&self, off: Option<u64>) {
        self.inner.lock().no_room_from = off;
    }

    /// The disk as it is now, as if every write had landed.
    pub fn live_image(&self) -> Vec<u8> {
        self.inner.lock().live.clone()
    }

    /// The image after applying ops `[0, upto)` whole, then `extra` (writes from the
    /// unflushed tail chosen by the caller, possibly torn).
    pub fn image_with(&self, upto: usize, extra: &[(u64, &[u8])]) -> Vec<u8> {
        let g = self.inner.lock();
        let mut img = g.base.clone();
        for op in &g.ops[..upto] {
            if let CrashOp::Write { off, data } = op {
                img[*off as usize..*off as usize + data.len()].copy_from_slice(data);
            }
        }
        for (off, data) in extra {
            img[*off as usize..*off as usize + data.len()].copy_from_slice(data);
        }
        img
    }

    /// Indexes just after each flush: the states a power cut right after a flush leaves.
    pub fn flush_points(&self) -> Vec<usize> {
        let g = self.inner.lock();
        g.ops
            .iter()
            .enumerate()
            .filter(|(_, o)| matches!(o, CrashOp::Flush))
            .map(|(i, _)| i + 1)
            .collect()
    }

    /// For each flush, in the order recorded: the index just after it (as
    /// [`CrashDev::flush_points`]) and how many ops came before it began (all before
    /// it, unless it took time).
    pub fn flush_covers(&self) -> Vec<(usize, usize)> {
        let g = self.inner.lock();
        let points = g
            .ops
            .iter()
            .enumerate()
            .filter(|(_, o)| matches!(o, CrashOp::Flush))
            .map(|(i, _)| i + 1);
        points.zip(g.covers.iter().copied()).collect()
    }

    fn check_fail(g: &Inner) -> io::Result<()> {
        match g.fail_after {
            Some(n) if g.ops.len() >= n => Err(io::Error::from_raw_os_error(libc::EIO)),
            _ => Ok(()),
        }
    }
}

impl BlockDev for CrashDev {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let g = self.inner.lock();
        let o = check_range(buf.len(), off, g.live.len())?;
        buf.copy_from_slice(&g.live[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let mut g = self.inner.lock();
        Self::check_fail(&g)?;
        if g.no_room_from
            .is_some_and(|from| off + buf.len() as u64 > from)
        {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let o = check_range(buf.len(), off, g.live.len())?;
        g.live[o..o + buf.len()].copy_from_slice(buf);
        g.ops.push(CrashOp::Write {
            off,
            data: buf.to_vec(),
        });
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        let us = self
            .flush_delay_us
            .load(std::sync::atomic::Ordering::Relaxed);
        let began = if us > 0 {
            let began = {
                let g = self.inner.lock();
                Self::check_fail(&g)?;
                g.ops.len()
            };
            std::thread::sleep(std::time::Duration::from_micros(us));
            Some(began)
        } else {
            None
        };
        let mut g = self.inner.lock();
        Self::check_fail(&g)?;
        if g.failing_flushes > 0 {
            g.failing_flushes -= 1;
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let covers = began.unwrap_or(g.ops.len());
        g.ops.push(CrashOp::Flush);
        g.covers.push(covers);
        Ok(())
    }
    /// Recorded as a write of [`super::mem::DISCARDED`] bytes: a power cut may leave
    /// the range as it was or discarded, like any write before the next flush.
    fn discard(&self, off: u64, len: u64) -> io::Result<bool> {
        let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        self.write_at(&vec![super::mem::DISCARDED; len], off)?;
        Ok(true)
    }
    fn size(&self) -> u64 {
        self.inner.lock().live.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_writes_and_rebuilds_flush_points() {
        let d = CrashDev::new(vec![0; 8192]);
        d.write_at(&[1; 4096], 0).unwrap();
        d.flush().unwrap();
        d.write_at(&[2; 4096], 4096).unwrap();
        assert_eq!(d.flush_points(), vec![2]);
        let at_flush = d.image_with(2, &[]);
        assert_eq!(&at_flush[..4096], &[1; 4096][..]);
        assert_eq!(&at_flush[4096..], &[0; 4096][..]);
        assert_eq!(&d.live_image()[4096..], &[2; 4096][..]);
        let torn = d.image_with(2, &[(4096, &[2; 100])]);
        assert_eq!(torn[4096 + 99], 2);
        assert_eq!(torn[4096 + 100], 0);
    }

    /// A flush that takes time is recorded when it returns and covers only what was
    /// written before it began; an instant one covers everything before it.
    #[test]
    fn a_slow_flush_covers_what_was_written_before_it_began() {
        let d = std::sync::Arc::new(CrashDev::new(vec![0; 8192]));
        d.write_at(&[1; 4096], 0).unwrap();
        d.flush().unwrap();
        assert_eq!(d.flush_covers(), vec![(2, 1)]);
        d.set_flush_delay(std::time::Duration::from_millis(1000));
        let t = {
            let d = d.clone();
            std::thread::spawn(move || d.flush().unwrap())
        };
        // Written while the flush is under way (it began well before this).
        std::thread::sleep(std::time::Duration::from_millis(100));
        d.write_at(&[2; 4096], 4096).unwrap();
        t.join().unwrap();
        assert_eq!(d.flush_points(), vec![2, 4]);
        assert_eq!(d.flush_covers(), vec![(2, 1), (4, 2)]);
    }

    #[test]
    fn fail_after_makes_writes_fail() {
        let d = CrashDev::new(vec![0; 4096]);
        d.fail_after(1);
        d.write_at(&[1; 10], 0).unwrap();
        assert!(d.write_at(&[1; 10], 0).is_err());
        assert!(d.flush().is_err());
    }
}
