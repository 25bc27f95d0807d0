//! Engine tests of the page cache: per-block dirty tracking, delayed allocation,
//! bounded memory, writeback triggers, and cached data meeting truncate and unlink.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::dev::MemDev;

const MB: u64 = 1 << 20;
const BS: u64 = 4096;

fn opts(cache_size: u64, folio_size: u64, block_dirty: bool) -> Options {
    Options {
        cache: CacheOptions {
            cache_size,
            folio_size,
            block_dirty,
            ..CacheOptions::default()
        },
        ..Options::default()
    }
}

fn mk(size: u64, o: Options) -> (Arc<MemDev>, Fs) {
    let dev = Arc::new(MemDev::new(size));
    Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let fs = Fs::open(dev.clone(), o).unwrap();
    (dev, fs)
}

fn remount(dev: &Arc<MemDev>, fs: Fs, o: Options) -> Fs {
    fs.unmount().unwrap();
    Fs::open(Arc::new(MemDev::from_image(dev.image())), o).unwrap()
}

/// A file of `len` pattern bytes (`seed`), remounted so that nothing of it is cached:
/// (its options, the device under the new mount, the fs, the inode, the bytes).
fn a_remounted_file(len: u64, seed: u64) -> (Options, Arc<MemDev>, Fs, u64, Vec<u8>) {
    let o = opts(64 * MB, 64 << 10, true);
    let (dev, fs) = mk(64 * MB, o.clone());
    let ino = file(&fs, b"f");
    let data = pattern(len as usize, seed);
    fs.write(ino, 0, &data).unwrap();
    fs.unmount().unwrap();
    let dev = Arc::new(MemDev::from_image(dev.image()));
    let fs = Fs::open(dev.clone(), o.clone()).unwrap();
    (o, dev, fs, ino, data)
}

fn file(fs: &Fs, name: &[u8]) -> u64 {
    fs.mknod(ROOT_INO, name, 0o644, 0, Creds::default())
        .unwrap()
        .ino
}

/// Sets the mode of `ino`: an attribute change that stores its inode item.
fn chmod(fs: &Fs, ino: u64, mode: u32) {
    let set = SetAttr {
        mode: Some(mode),
        ..SetAttr::default()
    };
    fs.setattr(ino, &set).unwrap();
}

/// Sets the size of `ino` (truncates or extends it).
fn set_size(fs: &Fs, ino: u64, size: u64) {
    let set = SetAttr {
        size: Some(size),
        ..SetAttr::default()
    };
    fs.setattr(ino, &set).unwrap();
}

/// Bytes of a pseudo-random pattern, different for each `seed`.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Device data bytes written by `n` 4 KiB overwrites, each fsynced, of a file that
/// is on the device and not cached.
fn data_bytes_of_small_overwrites(block_dirty: bool, n: u64) -> u64 {
    let o = opts(64 * MB, 64 << 10, block_dirty);
    let (dev, fs) = mk(64 * MB, o.clone());
    let ino = file(&fs, b"f");
    fs.write(ino, 0, &pattern(MB as usize, 1)).unwrap();
    let fs = remount(&dev, fs, o);
    let before = fs.stats().dev_data_bytes;
    for i in 0..n {
        // One block in every other folio, so no two share a folio.
        fs.write(ino, i * 128 * 1024 + BS, &[i as u8; BS as usize])
            .unwrap();
        fs.fsync(ino, true).unwrap();
    }
    fs.stats().dev_data_bytes - before
}

#[test]
fn writeback_writes_only_the_dirty_blocks_of_a_folio() {
    assert_eq!(data_bytes_of_small_overwrites(true, 8), 8 * BS);
    // Whole-folio tracking writes the 64 KiB folio for every 4 KiB written.
    assert_eq!(data_bytes_of_small_overwrites(false, 8), 8 * 64 * 1024);
}

#[test]
fn a_partial_block_write_reads_only_that_block() {
    let o = opts(64 * MB, 64 << 10, true);
    let (dev, fs) = mk(64 * MB, o.clone());
    let ino = file(&fs, b"f");
    let data = pattern(MB as usize, 2);
    fs.write(ino, 0, &data).unwrap();
    let fs = remount(&dev, fs, o);
    let before = fs.stats().dev_read_bytes;
    fs.write(ino, 70_000, b"0123456789").unwrap();
    assert_eq!(fs.stats().dev_read_bytes - before, BS);
    // A whole-block write reads nothing.
    fs.write(ino, 8 * BS, &[7; BS as usize]).unwrap();
    assert_eq!(fs.stats().dev_read_bytes - before, BS);
    let mut want = data;
    want[70_000..70_010].copy_from_slice(b"0123456789");
    want[8 * BS as usize..9 * BS as usize].fill(7);
    assert_eq!(fs.read(ino, 0, MB as u32).unwrap(), want);
}

#[test]
fn delayed_allocation_makes_large_extents_of_sequential_writes() {
    let o = opts(64 * MB, 64 << 10, true);
    let (_dev, fs) = mk(64 * MB, o);
    let ino = file(&fs, b"seq");
    let data = pattern(8 * MB as usize, 3);
    for (n, c) in data.chunks(BS as usize).enumerate() {
        fs.write(ino, n as u64 * BS, c).unwrap();
    }
    assert_eq!(
        fs.extent_map(ino).unwrap(),
        vec![],
        "allocated before writeback"
    );
    fs.fsync(ino, false).unwrap();
    let map = fs.extent_map(ino).unwrap();
    assert_eq!(map.len(), 8, "1 MiB extents: {map:?}");
    assert!(map.iter().all(|e| e.len == MB));
    // Random single-block overwrites stay block-sized.
    for i in [3u64, 17, 40, 101, 250] {
        fs.write(ino, i * 8 * BS, &[1; BS as usize]).unwrap();
    }
    fs.fsync(ino, false).unwrap();
    let map = fs.extent_map(ino).unwrap();
    for i in [3u64, 17, 40, 101, 250] {
        let e = map.iter().find(|e| e.offset == i * 8 * BS).unwrap();
        assert_eq!(e.len, BS, "{e:?}");
    }
    assert_eq!(map.len(), 8 + 5 * 2);
}

#[test]
fn the_cache_stays_within_its_size_and_reads_back_what_it_evicted() {
    let o = opts(MB, 16 << 10, true);
    let (dev, fs) = mk(64 * MB, o.clone());
    let ino = file(&fs, b"big");
    let data = pattern(8 * MB as usize + 1234, 4);
    let mut off = 0;
    for len in [1000usize, 5000, 70_000, 4096, 12_345].iter().cycle() {
        if off >= data.len() {
            break;
        }
        let e = (off + len).min(data.len());
        fs.write(ino, off as u64, &data[off..e]).unwrap();
        off = e;
        assert!(fs.stats().cache_bytes <= MB, "{}", fs.stats().cache_bytes);
    }
    for (n, c) in data.chunks(100_000).enumerate() {
        let got = fs.read(ino, n as u64 * 100_000, 100_000).unwrap();
        assert_eq!(got, c, "chunk {n}");
        assert!(fs.stats().cache_bytes <= MB);
    }
    let fs = remount(&dev, fs, o);
    assert_eq!(fs.read(ino, 0, data.len() as u32).unwrap(), data);
}

/// Memory pressure halves what the cache holds (dirty data written back, clean folios
/// evicted, nothing lost); once it passes the cache grows back to `cache_size`.
#[test]
fn memory_pressure_shrinks_the_cache_and_it_grows_back_after() {
    let o = opts(128 * MB, 64 << 10, true);
    let (dev, fs) = mk(512 * MB, o.clone());
    let clean = file(&fs, b"clean");
    let dirty = file(&fs, b"dirty");
    let (a, b) = (pattern(40 * MB as usize, 1), pattern(40 * MB as usize, 2));
    fs.write(clean, 0, &a).unwrap();
    fs.fsync(clean, false).unwrap();
    // Read back out of order (a stream's folios would drop behind): cached clean.
    for i in (0..40).rev() {
        let got = fs.read(clean, i * MB, MB as u32).unwrap();
        assert!(got == a[(i * MB) as usize..((i + 1) * MB) as usize]);
    }
    fs.write(dirty, 0, &b).unwrap();
    let before = fs.stats();
    assert!(before.cache_bytes >= 72 * MB, "{}", before.cache_bytes);
    assert!(
        before.cache_dirty_bytes >= 32 * MB,
        "{}",
        before.cache_dirty_bytes
    );
    fs.relieve_memory(true).unwrap();
    let s = fs.stats();
    assert!(
        s.cache_bytes <= before.cache_bytes / 2,
        "{} of {}",
        s.cache_bytes,
        before.cache_bytes
    );
    assert!(
        s.cache_dirty_bytes <= s.cache_bytes / 2 + MB,
        "dirty {}",
        s.cache_dirty_bytes
    );
    assert_eq!(s.memory_squeezes, 1);
    // Writes while squeezed keep to the smaller size.
    let limit = fs.cache.size_limit();
    assert!(limit < 128 * MB);
    fs.write(dirty, 40 * MB, &a[..8 * MB as usize]).unwrap();
    assert!(
        fs.stats().cache_bytes <= limit + MB,
        "{}",
        fs.stats().cache_bytes
    );
    // Pressure again: halves again, not below 16 MiB; at the floor, nothing more to
    // count.
    for _ in 0..8 {
        fs.relieve_memory(true).unwrap();
    }
    assert_eq!(fs.cache.size_limit(), 16 * MB);
    assert!(fs.stats().cache_bytes <= 16 * MB);
    assert_eq!(
        fs.stats().cache_limit,
        16 * MB,
        "stats show the squeezed size"
    );
    let squeezes = fs.stats().memory_squeezes;
    assert!((2..9).contains(&squeezes), "{squeezes}");
    fs.relieve_memory(true).unwrap();
    assert_eq!(fs.stats().memory_squeezes, squeezes);
    // No pressure: back to cache_size, doubling per call.
    fs.relieve_memory(false).unwrap();
    assert_eq!(fs.cache.size_limit(), 32 * MB);
    for _ in 0..4 {
        fs.relieve_memory(false).unwrap();
    }
    assert_eq!(fs.cache.size_limit(), 128 * MB);
    assert_eq!(fs.stats().memory_squeezes, squeezes);
    assert_eq!(fs.read(clean, 0, a.len() as u32).unwrap(), a);
    let fs = remount(&dev, fs, o);
    assert_eq!(fs.read(dirty, 0, b.len() as u32).unwrap(), b);
    assert_eq!(
        fs.read(dirty, 40 * MB, 8 * MB as u32).unwrap(),
        &a[..8 * MB as usize]
    );
}

#[test]
fn the_dirty_limit_makes_writers_write_back() {
    let o = opts(2 * MB, 16 << 10, true);
    let (_dev, fs) = mk(64 * MB, o);
    let ino = file(&fs, b"f");
    for i in 0..64 {
        fs.write(ino, i * 64 * 1024, &[1; 64 * 1024]).unwrap();
        assert!(fs.stats().cache_dirty_bytes <= MB + 64 * 1024);
    }
    assert!(fs.stats().dev_data_bytes >= 2 * MB);
}

#[test]
fn a_large_cache_keeps_a_streams_dirty_data_and_written_folios_few() {
    // A 1 GiB cache would allow 512 MiB dirty and keep 32 MiB of written folios; a
    // stream's writer writes back past 64 MiB dirty, and 8 MiB of what was written
    // stays.
    let o = opts(1 << 30, 64 << 10, true);
    let (_dev, fs) = mk(160 * MB, o);
    let ino = file(&fs, b"stream");
    let chunk = pattern(MB as usize, 3);
    let mut peak = 0;
    for n in 0..80 {
        fs.write(ino, n * MB, &chunk).unwrap();
        peak = peak.max(fs.stats().cache_dirty_bytes);
    }
    assert!(peak <= 65 * MB, "{peak} bytes dirty at most");
    assert!(
        peak >= 63 * MB,
        "{peak} bytes dirty at the peak, under the limit"
    );
    assert!(fs.stats().dev_data_bytes >= 8 * MB, "the writer wrote back");
    fs.fsync(ino, false).unwrap();
    let kept = fs.stats().cache_bytes;
    assert!(kept <= 8 * MB + MB, "{kept} bytes stayed cached");
    for n in [0, 40, 79] {
        assert_eq!(fs.read(ino, n * MB, MB as u32).unwrap(), chunk, "MiB {n}");
    }
}

#[test]
fn old_dirty_data_is_written_back_by_the_flusher() {
    let mut o = opts(64 * MB, 64 << 10, true);
    o.cache.dirty_expire = Duration::from_millis(50);
    let (_dev, fs) = mk(64 * MB, o);
    let ino = file(&fs, b"f");
    fs.write(ino, 0, &[5; 10_000]).unwrap();
    fs.flush_background(Duration::ZERO).unwrap();
    assert_eq!(fs.stats().cache_dirty_bytes, 3 * BS, "not old yet");
    std::thread::sleep(Duration::from_millis(60));
    fs.flush_background(Duration::ZERO).unwrap();
    assert_eq!(fs.stats().cache_dirty_bytes, 0);
    assert_eq!(fs.stats().dev_data_bytes, 3 * BS);
    assert_eq!(fs.extent_map(ino).unwrap().len(), 1);
}

#[test]
fn dirty_blocks_count_in_blocks_and_against_free_space() {
    let (_dev, fs) = mk(64 * MB, opts(64 * MB, 64 << 10, true));
    let ino = file(&fs, b"f");
    let free0 = fs.statfs().bfree;
    fs.write(ino, 0, &[1; 40_000]).unwrap();
    assert_eq!(fs.getattr(ino).unwrap().blocks, 10 * 8);
    assert_eq!(free0 - fs.statfs().bfree, 10);
    fs.unlink(ROOT_INO, b"f").unwrap();
    assert_eq!(fs.stats().cache_dirty_bytes, 0);
    assert_eq!(fs.statfs().bfree, free0);
    assert_eq!(fs.stats().dev_data_bytes, 0, "deleted data was written");
}

/// Dirty blocks over allocated or preallocated extents add nothing to the blocks
/// (writeback replaces those); only dirty blocks over holes count.
#[test]
fn dirty_blocks_over_allocated_or_preallocated_extents_do_not_count() {
    let (_dev, fs) = mk(64 * MB, opts(64 * MB, 64 << 10, true));
    let ino = file(&fs, b"f");
    fs.fallocate(ino, BS - 1, 2, FallocMode::default()).unwrap();
    assert_eq!(fs.getattr(ino).unwrap().blocks, 2 * 8);
    fs.write(ino, BS - 1, b"ab").unwrap();
    assert_eq!(
        fs.getattr(ino).unwrap().blocks,
        2 * 8,
        "over preallocated blocks"
    );
    fs.write(ino, 10 * BS, &[7; BS as usize]).unwrap();
    assert_eq!(
        fs.getattr(ino).unwrap().blocks,
        3 * 8,
        "a block over a hole"
    );
    fs.fsync(ino, false).unwrap();
    assert_eq!(fs.getattr(ino).unwrap().blocks, 3 * 8, "after writeback");
    fs.write(ino, 10 * BS, &[8; 100]).unwrap();
    fs.write(ino, BS, &[8; 100]).unwrap();
    assert_eq!(
        fs.getattr(ino).unwrap().blocks,
        3 * 8,
        "overwrites of written blocks"
    );
    fs.write(ino, 0, &[8; 100]).unwrap();
    assert_eq!(
        fs.getattr(ino).unwrap().blocks,
        3 * 8,
        "the written block 0"
    );
}

#[test]
fn truncate_and_punch_meet_cached_data() {
    let o = opts(64 * MB, 64 << 10, true);
    let (dev, fs) = mk(64 * MB, o.clone());
    let ino = file(&fs, b"f");
    let mut want = pattern(300_000, 5);
    fs.write(ino, 0, &want).unwrap();
    fs.fsync(ino, false).unwrap();
    fs.write(ino, 100_000, &[9; 150_000]).unwrap(); // dirty, not written back
    want[100_000..250_000].fill(9);
    set_size(&fs, ino, 123_457);
    want.truncate(123_457);
    set_size(&fs, ino, 200_000);
    want.resize(200_000, 0);
    assert_eq!(fs.read(ino, 0, 300_000).unwrap(), want);
    fs.write(ino, 10_000, &[3; 20_000]).unwrap();
    want[10_000..30_000].fill(3);
    let punch = FallocMode {
        keep_size: true,
        punch_hole: true,
        zero_range: false,
    };
    fs.fallocate(ino, 12_000, 9_000, punch).unwrap();
    want[12_000..21_000].fill(0);
    assert_eq!(fs.read(ino, 0, 300_000).unwrap(), want);
    let fs = remount(&dev, fs, o);
    assert_eq!(fs.read(ino, 0, 300_000).unwrap(), want);
}

#[test]
fn sizes_and_times_of_cached_writes_reach_the_tree_with_their_data() {
    let o = opts(64 * MB, 64 << 10, true);
    let (dev, fs) = mk(64 * MB, o.clone());
    let ino = file(&fs, b"f");
    fs.write(ino, 5000, b"tail").unwrap();
    let a = fs.getattr(ino).unwrap();
    assert_eq!(a.size, 5004);
    // An attribute change in between keeps the cached size.
    chmod(&fs, ino, 0o600);
    assert_eq!(fs.getattr(ino).unwrap().size, 5004);
    let fs = remount(&dev, fs, o);
    let b = fs.getattr(ino).unwrap();
    assert_eq!((b.size, b.mtime, b.perm), (5004, a.mtime, 0o600));
    let mut want = vec![0u8; 5004];
    want[5000..].copy_from_slice(b"tail");
    assert_eq!(fs.read(ino, 0, 10_000).unwrap(), want);
}

/// A 64 MiB fs on a device whose writes can be made to fail, mounted with a cache of
/// `cache_size` (64 KiB folios), and an empty file on it.
fn on_a_failing_dev(cache_size: u64) -> (Arc<crate::dev::CrashDev>, Fs, u64) {
    let dev = Arc::new(crate::dev::CrashDev::new(MemDev::new(64 * MB).image()));
    Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let fs = Fs::open(dev.clone(), opts(cache_size, 64 << 10, true)).unwrap();
    let ino = file(&fs, b"f");
    (dev, fs, ino)
}

#[test]
fn a_failed_writeback_keeps_the_data_dirty_for_the_next_try() {
    let (dev, fs, ino) = on_a_failing_dev(64 * MB);
    fs.write(ino, 0, &[8; 20_000]).unwrap();
    dev.fail_after(0);
    assert!(fs.fsync(ino, false).is_err());
    assert_eq!(fs.stats().cache_dirty_bytes, 5 * BS);
    assert_eq!(fs.read(ino, 0, 30_000).unwrap(), vec![8; 20_000]);
}

#[test]
fn a_writer_past_the_dirty_limit_goes_on_when_writeback_fails() {
    // A 4 MiB cache: writers write back past 2 MiB dirty. With the device failing,
    // what they could not write stays dirty and they go on; fsync reports it.
    let (dev, fs, ino) = on_a_failing_dev(4 * MB);
    dev.fail_after(0);
    for n in 0..3 {
        fs.write(ino, n * MB, &[7; MB as usize]).unwrap();
    }
    assert_eq!(fs.stats().cache_dirty_bytes, 3 * MB);
    assert!(fs.fsync(ino, false).is_err());
    assert_eq!(
        fs.read(ino, 2 * MB, MB as u32).unwrap(),
        vec![7; MB as usize]
    );
}

#[test]
fn sequential_reads_read_ahead_and_random_reads_do_not() {
    let (o, dev, fs, ino, data) = a_remounted_file(8 * MB, 6);
    let chunk = 128 * 1024;
    assert_eq!(fs.read(ino, 0, chunk as u32).unwrap(), &data[..chunk]);
    let first = fs.stats().dev_read_bytes;
    assert!(first > chunk as u64, "no readahead: read {first} bytes");
    let mut off = chunk;
    while off < data.len() {
        let got = fs.read(ino, off as u64, chunk as u32).unwrap();
        assert_eq!(got, &data[off..off + chunk]);
        off += chunk;
    }
    // Every byte came from the device once.
    assert_eq!(fs.stats().dev_read_bytes, data.len() as u64);
    let fs = remount(&dev, fs, o);
    // A random read far from the start reads just what it asked for.
    assert_eq!(
        fs.read(ino, 5 * MB + 4096, 4096).unwrap(),
        &data[(5 * MB + 4096) as usize..(5 * MB + 8192) as usize]
    );
    assert_eq!(fs.stats().dev_read_bytes, 4096);
}

#[test]
fn a_readahead_thread_reads_the_next_window_ahead_of_the_reader() {
    let (_, _dev, fs, ino, data) = a_remounted_file(24 * MB, 8);
    let fs = Arc::new(fs);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Two threads, as a mount runs: they fill different windows at once.
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (fs, stop) = (fs.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    fs.readahead_step(Duration::from_millis(10)).unwrap();
                }
            })
        })
        .collect();
    // The thread announces itself on its first step.
    while !fs.ra_thread.load(std::sync::atomic::Ordering::Relaxed) {
        std::thread::yield_now();
    }
    let chunk = 256 * 1024;
    let mut off = 0;
    while off < data.len() {
        let got = fs.read(ino, off as u64, chunk as u32).unwrap();
        assert!(got == data[off..off + chunk], "wrong data at {off}");
        off += chunk;
        // Give the thread time to fetch the next window before the next read.
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    let s = fs.stats();
    assert!(s.readahead_async > 0, "the thread read no window: {s:?}");
    // Every byte came from the device once, whoever read it.
    assert_eq!(s.dev_read_bytes, data.len() as u64);
    // A file deleted or cut short under a queued window is no error.
    fs.queue_readahead(ino, 30 * MB, 34 * MB);
    fs.readahead_step(Duration::ZERO).unwrap();
    set_size(&fs, ino, MB);
    fs.queue_readahead(ino, 4 * MB, 8 * MB);
    fs.readahead_step(Duration::ZERO).unwrap();
    assert_eq!(fs.read(ino, 0, 4096).unwrap(), &data[..4096]);
}

#[test]
fn read_into_a_reused_buffer_replaces_its_contents() {
    let o = opts(64 * MB, 64 << 10, true);
    let (_dev, fs) = mk(64 * MB, o);
    let ino = file(&fs, b"f");
    let data = pattern(300_000, 9);
    fs.write(ino, 0, &data).unwrap();
    // A hole after the data, then more data.
    fs.write(ino, 400_000, b"tail").unwrap();
    let mut buf = vec![0xee; 1 << 20];
    fs.read_into(ino, 1000, 500_000, &mut buf).unwrap();
    assert_eq!(buf.len(), 400_004 - 1000);
    assert_eq!(&buf[..299_000], &data[1000..]);
    assert!(
        buf[299_000..399_000].iter().all(|&b| b == 0),
        "the hole reads as zeros"
    );
    assert_eq!(&buf[399_000..], b"tail");
    fs.read_into(ino, 500_000, 10, &mut buf).unwrap();
    assert!(buf.is_empty(), "past the end: nothing");
}

#[test]
fn streamed_files_drop_behind_and_read_back_whole() {
    // 64 MiB cache: 2 MiB of written-back or read-through folios wait before they
    // drop behind (a 16 MiB stream would otherwise stay cached whole).
    let o = opts(64 * MB, 64 << 10, true);
    let (dev, fs) = mk(128 * MB, o.clone());
    let ino = file(&fs, b"stream");
    let data = pattern(16 * MB as usize, 9);
    for (n, c) in data.chunks(MB as usize).enumerate() {
        fs.write(ino, n as u64 * MB, c).unwrap();
    }
    assert!(fs.stats().cache_bytes >= 16 * MB, "all dirty, all cached");
    fs.fsync(ino, false).unwrap();
    let after_write = fs.stats().cache_bytes;
    assert!(after_write <= 2 * MB, "{after_write} bytes stayed cached");
    // A stream's reader drops behind too, and reads back every byte.
    let fs = remount(&dev, fs, o.clone());
    for (n, c) in data.chunks(128 << 10).enumerate() {
        let got = fs.read(ino, n as u64 * (128 << 10), 128 << 10).unwrap();
        assert_eq!(got, c, "chunk {n}");
    }
    // The reader's readahead windows (up to 4 MiB, two in flight) stay cached too.
    let after_read = fs.stats().cache_bytes;
    assert!(
        after_read <= 2 * MB + 8 * MB,
        "{after_read} bytes stayed cached"
    );
    // Random reads are not a stream: what they read stays.
    let fs = remount(&dev, fs, o);
    for n in (0..16u64).rev() {
        let got = fs.read(ino, n * MB + 4096, 4096).unwrap();
        assert_eq!(got, &data[(n * MB + 4096) as usize..][..4096]);
    }
    assert_eq!(fs.stats().cache_bytes, 16 * (64 << 10));
}

#[test]
fn reused_folio_buffers_never_show_old_bytes() {
    // A small cache of 16 KiB folios: the buffers of evicted or dropped folios are
    // handed out again unzeroed, so holes and the unwritten rest of new blocks must
    // be zeroed where they are made uptodate.
    let o = opts(256 << 10, 16 << 10, true);
    let (_dev, fs) = mk(64 * MB, o);
    let junk = file(&fs, b"junk");
    for round in 0..4u64 {
        // Fill the cache (and then its spare buffers) with non-zero bytes.
        fs.write(junk, 0, &vec![0xA5; MB as usize]).unwrap();
        fs.fsync(junk, false).unwrap();
        for n in 0..16 {
            fs.read(junk, n * 65536, 65536).unwrap();
        }
        let ino = file(&fs, format!("f{round}").as_bytes());
        // A sparse file: data at 0 and at 200 KiB, holes between and after a size
        // set by truncate.
        fs.write(ino, 0, b"head").unwrap();
        fs.write(ino, 200 << 10, &[7u8; 10]).unwrap();
        set_size(&fs, ino, 300 << 10);
        if round % 2 == 1 {
            fs.fsync(ino, false).unwrap();
        }
        let mut want = vec![0u8; 300 << 10];
        want[..4].copy_from_slice(b"head");
        want[200 << 10..(200 << 10) + 10].fill(7);
        assert_eq!(fs.read(ino, 0, 300 << 10).unwrap(), want, "round {round}");
        // Reads from the device after the cache let the file go: holes are zeros.
        for n in 0..16 {
            fs.read(junk, n * 65536, 65536).unwrap();
        }
        for (n, c) in want.chunks(12_345).enumerate() {
            assert_eq!(
                fs.read(ino, n as u64 * 12_345, 12_345).unwrap(),
                c,
                "round {round} chunk {n}"
            );
        }
    }
}

/// The image a power cut at this moment leaves (a `MemDev` holds every write).
fn crashed(dev: &Arc<MemDev>) -> Fs {
    Fs::open(
        Arc::new(MemDev::from_image(dev.image())),
        Options::default(),
    )
    .unwrap()
}

#[test]
fn a_commit_records_a_cached_size_only_with_its_data() {
    let o = opts(64 * MB, 64 << 10, true);
    let (dev, fs) = mk(64 * MB, o);
    let ino = file(&fs, b"f");
    let old = pattern(10_000, 1);
    fs.write(ino, 0, &old).unwrap();
    fs.fsync(ino, false).unwrap();
    // An append that stays cached, an attribute change that stores the inode, and a
    // commit of the trees that writes nothing back.
    fs.write(ino, 10_000, &pattern(20_000, 2)).unwrap();
    chmod(&fs, ino, 0o600);
    assert_eq!(fs.getattr(ino).unwrap().size, 30_000);
    fs.commit_tree().unwrap();
    let after = crashed(&dev);
    let a = after.getattr(ino).unwrap();
    assert_eq!((a.size, a.perm), (10_000, 0o600));
    assert_eq!(after.read(ino, 0, 40_000).unwrap(), old);
    // Once written back, the commit takes the whole size.
    fs.writeback(ino, u64::MAX).unwrap();
    fs.commit_tree().unwrap();
    let mut want = old.clone();
    want.extend_from_slice(&pattern(20_000, 2));
    assert_eq!(crashed(&dev).read(ino, 0, 40_000).unwrap(), want);
}

#[test]
fn a_partial_writeback_lets_the_size_reach_only_what_it_wrote() {
    let o = opts(64 * MB, 64 << 10, true);
    let (dev, fs) = mk(64 * MB, o);
    let ino = file(&fs, b"f");
    let data = pattern(1 << 20, 3);
    fs.write(ino, 0, &data).unwrap();
    // Writeback goes in file order: the first 256 KiB.
    assert_eq!(fs.writeback(ino, 256 << 10).unwrap(), 256 << 10);
    fs.commit_tree().unwrap();
    let after = crashed(&dev);
    assert_eq!(after.getattr(ino).unwrap().size, 256 << 10);
    assert_eq!(after.read(ino, 0, 2 << 20).unwrap(), &data[..256 << 10]);
    assert_eq!(fs.getattr(ino).unwrap().size, 1 << 20);
    fs.fsync(ino, true).unwrap();
    assert_eq!(crashed(&dev).read(ino, 0, 2 << 20).unwrap(), data);
}

/// Writes `data` at `off` of `ino`, and while the write is paused before its copy
/// into the cache (`copied` false) or after it (true), runs `beside` on another
/// thread, giving it a second to finish (it may wait for the write).
fn beside_a_write(fs: &Fs, ino: u64, off: u64, data: &[u8], copied: bool, beside: fn(&Fs, u64)) {
    let (paused_tx, paused_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    // Only this write pauses, not those `beside` makes.
    const WRITER: &str = "paused writer";
    *fs.write_hook.lock() = Some(Arc::new(move |stage| {
        if stage == copied && std::thread::current().name() == Some(WRITER) {
            let _ = paused_tx.send(());
            let _ = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(20));
        }
    }));
    std::thread::scope(|s| {
        let writer = std::thread::Builder::new()
            .name(WRITER.into())
            .spawn_scoped(s, || fs.write(ino, off, data).unwrap())
            .unwrap();
        paused_rx.recv().unwrap();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let other = s.spawn(move || {
            beside(fs, ino);
            let _ = done_tx.send(());
        });
        let _ = done_rx.recv_timeout(Duration::from_secs(1));
        go_tx.send(()).unwrap();
        writer.join().unwrap();
        other.join().unwrap();
    });
    *fs.write_hook.lock() = None;
}

/// Writes to the end of file `b` in 1 MiB, then 64 KiB pieces of 0xbb until the
/// file system has no room for more.
fn fill_b(fs: &Fs, _: u64) {
    let b = fs.lookup_nopin(ROOT_INO, b"b").unwrap().ino;
    let mut off = fs.getattr(b).unwrap().size;
    for piece in [MB, 64 << 10] {
        let buf = vec![0xbb; piece as usize];
        loop {
            match fs.write(b, off, &buf) {
                Ok(n) => off += n as u64,
                Err(Error::NoSpace) => break,
                Err(e) => panic!("write to b at {off}: {e}"),
            }
        }
    }
}

/// A file system of 64 MiB with an empty file `b` beside `a`, whose first 8 MiB a
/// write is to give: its options, device, fs and `a`.
fn a_and_b() -> (Options, Arc<MemDev>, Fs, u64) {
    // The dirty limit (64 MiB) is past what fits: nothing is written back unasked.
    let o = opts(256 * MB, 64 << 10, true);
    let (dev, fs) = mk(64 * MB, o.clone());
    let a = file(&fs, b"a");
    file(&fs, b"b");
    // Committed: a write that finds no room then fails at once, without a commit
    // (which would wait for the write beside it).
    fs.commit().unwrap();
    (o, dev, fs, a)
}

/// `fill_b` filled the file system beside `a`'s write of `da`: both files' writebacks
/// find their space, and both read back whole after a remount.
fn both_reach_the_disk(o: Options, dev: &Arc<MemDev>, fs: Fs, a: u64, da: &[u8]) {
    let b = fs.lookup_nopin(ROOT_INO, b"b").unwrap().ino;
    let nb = fs.getattr(b).unwrap().size;
    assert!(nb >= 16 * MB, "b took only {nb} bytes");
    fs.fsync(a, false)
        .expect("a's writeback found no space for what its write was admitted with");
    fs.fsync(b, false)
        .expect("b's writeback found no space for what its writes were admitted with");
    let fs = remount(dev, fs, o);
    assert!(fs.read(a, 0, da.len() as u32).unwrap() == da, "a differs");
    let got = fs.read(b, 0, nb as u32).unwrap();
    assert!(
        got.len() as u64 == nb && got.iter().all(|&x| x == 0xbb),
        "b differs"
    );
}

/// Writes admitted while another write is copying into the cache leave it the room
/// it was admitted with (held until its blocks count as dirty).
#[test]
fn writes_beside_a_write_leave_it_its_room() {
    let (o, dev, fs, a) = a_and_b();
    let da = pattern(8 * MB as usize, 1);
    beside_a_write(&fs, a, 0, &da, false, fill_b);
    both_reach_the_disk(o, &dev, fs, a, &da);
}

/// While a write copies its data, each folio's share of the room it was admitted
/// with counts once: as dirty blocks once that folio is copied, as held until then;
/// an overwrite of blocks already dirty, too.
#[test]
fn a_copying_write_counts_each_folio_once() {
    let (_, _, fs, a) = a_and_b();
    let fsz = fs.cache.folio_size();
    let n = 16;
    for round in 0..2u64 {
        let data = pattern((n * fsz) as usize, round);
        // The last folio's lock stops the write before it copies that folio.
        let last = fs.cache.get_or_create(a, n - 1, false);
        let g = last.folio.lock();
        std::thread::scope(|s| {
            let writer = s.spawn(|| fs.write(a, 0, &data).unwrap());
            // Held beside the dirty blocks: nothing before the write is admitted, then
            // all of its room, less each folio's share as that folio is copied, until
            // only the locked folio's is left.
            let held = || fs.cache.promised_bytes() - fs.cache.dirty_bytes();
            let since = std::time::Instant::now();
            while held() != fsz && since.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let held = held();
            drop(g);
            writer.join().unwrap();
            assert_eq!(
                held, fsz,
                "round {round}: room held beside the dirty blocks"
            );
        });
        assert_eq!(fs.cache.promised_bytes(), fs.cache.dirty_bytes());
        assert_eq!(fs.cache.dirty_bytes(), n * fsz);
    }
}

/// Writes admitted while a writeback has taken dirty blocks and not yet found space
/// for them leave those blocks their room (held until the space is found).
#[test]
fn writes_beside_a_writeback_leave_its_blocks_their_room() {
    let (o, dev, fs, a) = a_and_b();
    let da = pattern(8 * MB as usize, 2);
    fs.write(a, 0, &da).unwrap();
    let fs = Arc::new(fs);
    let once = std::sync::atomic::AtomicBool::new(false);
    let weak = Arc::downgrade(&fs);
    *fs.writeback_hook.lock() = Some(Arc::new(move |_| {
        if !once.swap(true, std::sync::atomic::Ordering::Relaxed) {
            fill_b(&weak.upgrade().unwrap(), a);
        }
    }));
    fs.fsync(a, false)
        .expect("a's writeback found no space for the blocks it took");
    *fs.writeback_hook.lock() = None;
    let fs = Arc::try_unwrap(fs).ok().unwrap();
    both_reach_the_disk(o, &dev, fs, a, &da);
}

/// After a crash now, `ino` holds `old` or `old` followed by `new` (whole), the
/// image is clean, and an extension of the file reads zeros.
fn crash_shows_old_or_appended(dev: &Arc<MemDev>, ino: u64, old: &[u8], new: &[u8]) {
    let img = MemDev::from_image(dev.image());
    let problems = crate::check::check(&img).unwrap().problems;
    assert!(problems.is_empty(), "{problems:?}");
    let after = crashed(dev);
    let size = after.getattr(ino).unwrap().size;
    let mut want = old.to_vec();
    if size != old.len() as u64 {
        assert_eq!(size, (old.len() + new.len()) as u64);
        want.extend_from_slice(new);
    }
    let ext = 2 * (old.len() + new.len());
    set_size(&after, ino, ext as u64);
    want.resize(ext, 0);
    assert!(after.read(ino, 0, ext as u32).unwrap() == want);
}

/// A filesystem holding one committed 10,000-byte file: (device, fs, inode, bytes).
fn a_committed_file() -> (Arc<MemDev>, Fs, u64, Vec<u8>) {
    let (dev, fs) = mk(64 * MB, opts(64 * MB, 64 << 10, true));
    let ino = file(&fs, b"f");
    let old = pattern(10_000, 1);
    fs.write(ino, 0, &old).unwrap();
    fs.commit().unwrap();
    (dev, fs, ino, old)
}

#[test]
fn writeback_during_an_extending_write_maps_its_blocks_within_its_size() {
    let (dev, fs, ino, old) = a_committed_file();
    // A flusher and a commit once the write has copied its blocks into the cache.
    let new = pattern(200_000, 2);
    beside_a_write(&fs, ino, 10_000, &new, true, |fs, ino| {
        fs.writeback(ino, u64::MAX).unwrap();
        fs.commit_tree().unwrap();
    });
    crash_shows_old_or_appended(&dev, ino, &old, &new);
}

#[test]
fn a_commit_before_an_extending_write_copies_keeps_the_old_size() {
    let (dev, fs, ino, old) = a_committed_file();
    // The write has counted its size and has nothing in the cache yet.
    let new = pattern(200_000, 2);
    beside_a_write(&fs, ino, 10_000, &new, false, |fs, _| {
        fs.commit_tree().unwrap()
    });
    crash_shows_old_or_appended(&dev, ino, &old, &new);
    assert_eq!(fs.getattr(ino).unwrap().size, 210_000);
    fs.commit().unwrap();
    crash_shows_old_or_appended(&dev, ino, &old, &new);
    assert_eq!(crashed(&dev).getattr(ino).unwrap().size, 210_000);
}

#[test]
fn a_write_stopped_before_it_copied_keeps_the_old_size() {
    let (dev, fs, ino, _) = a_committed_file();
    let map = fs.with(|i| i.extent_map(ino)).unwrap();
    assert_eq!((map.len(), map[0].len), (1, 3 * BS));
    fs.unmount().unwrap();
    // Damage the third block, which the next write must read first (it covers part).
    let mut img = dev.image();
    img[map[0].disk_addr as usize + 9_000] ^= 0xff;
    let fs = Fs::open(Arc::new(MemDev::from_image(img)), Options::default()).unwrap();
    assert!(fs.write(ino, 9_000, &pattern(200_000, 2)).is_err());
    assert_eq!(fs.getattr(ino).unwrap().size, 10_000);
    fs.commit().unwrap();
    assert_eq!(fs.getattr(ino).unwrap().size, 10_000);
}

#[test]
fn reads_fill_folios_straight_from_the_device_around_holes_and_cached_blocks() {
    let o = opts(64 * MB, 64 << 10, true);
    let (dev, fs) = mk(64 * MB, o.clone());
    let ino = file(&fs, b"f");
    // Extents of several commits, a hole, an overwrite in the middle of an extent
    // (so a piece starts inside its extent) and a tail that ends mid-block.
    let mut want = vec![0u8; (3 * MB + 1234) as usize];
    let mut put = |fs: &Fs, off: u64, data: &[u8]| {
        fs.write(ino, off, data).unwrap();
        want[off as usize..off as usize + data.len()].copy_from_slice(data);
        fs.commit().unwrap();
    };
    put(&fs, 0, &pattern(300 << 10, 1));
    put(&fs, MB, &pattern(MB as usize, 2));
    put(&fs, MB + 200_000, &pattern(70_000, 3));
    put(&fs, 2 * MB + 4096, &pattern((MB - 4096 + 1234) as usize, 4));
    let fs = remount(&dev, fs, o);
    // Some blocks already cached: folios the fills must go around.
    assert_eq!(
        fs.read(ino, MB + 8192, 100).unwrap(),
        &want[(MB + 8192) as usize..(MB + 8292) as usize]
    );
    assert_eq!(
        fs.read(ino, 2 * MB + 40_000, 5000).unwrap(),
        &want[(2 * MB + 40_000) as usize..(2 * MB + 45_000) as usize]
    );
    let mut got = Vec::new();
    let chunk = 128 << 10;
    while (got.len() as u64) < want.len() as u64 {
        got.extend(fs.read(ino, got.len() as u64, chunk).unwrap());
    }
    assert!(got == want, "the file read back differs");
    // Each data block came from the device once; holes not at all.
    let data_blocks = fs
        .extent_map(ino)
        .unwrap()
        .iter()
        .map(|e| e.len.div_ceil(BS))
        .sum::<u64>();
    assert_eq!(fs.stats().dev_read_bytes, data_blocks * BS);
}

#[test]
fn a_block_failing_its_checksum_reads_as_an_error_every_time() {
    let (_, dev, fs, ino, data) = a_remounted_file(2 * MB, 5);
    let e = fs.extent_map(ino).unwrap();
    let bad = 3 * MB / 2;
    let at = e
        .iter()
        .find(|e| e.offset <= bad && bad < e.offset + e.len)
        .unwrap();
    let addr = at.disk_addr + (bad - at.offset) + 7;
    let mut b = [0u8; 1];
    dev.read_at(&mut b, addr).unwrap();
    dev.write_at(&[b[0] ^ 0x10], addr).unwrap();
    assert_eq!(fs.read(ino, 0, 65536).unwrap(), &data[..65536]);
    for _ in 0..2 {
        // Never the bytes the device returned, however often it is asked.
        let err = fs.read(ino, bad, 4096).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
    }
    let end = 2 * MB as usize;
    assert_eq!(
        fs.read(ino, end as u64 - 4096, 4096).unwrap(),
        &data[end - 4096..]
    );
    // A stream reaching the bad block reads every good block before it, although
    // its readahead windows take in the bad one.
    let fs = Fs::open(
        Arc::new(MemDev::from_image(dev.image())),
        Options::default(),
    )
    .unwrap();
    let chunk = 16 << 10;
    let mut off = 0;
    while off + chunk <= bad / BS * BS {
        let got = fs.read(ino, off, chunk as u32);
        let want = &data[off as usize..(off + chunk) as usize];
        assert!(
            got.as_deref().ok() == Some(want),
            "at {off}: {:?}",
            got.err()
        );
        off += chunk;
    }
    assert!(fs.read(ino, bad, 4096).is_err());
}

/// A memory device whose writes wait while its gate is closed.
struct Gated {
    dev: MemDev,
    /// Whether writes wait, and how many are waiting.
    gate: parking_lot::Mutex<(bool, usize)>,
    cv: parking_lot::Condvar,
}

impl Gated {
    fn new(dev: MemDev) -> Gated {
        Gated {
            dev,
            gate: parking_lot::Mutex::new((false, 0)),
            cv: parking_lot::Condvar::new(),
        }
    }
    fn set_closed(&self, closed: bool) {
        self.gate.lock().0 = closed;
        self.cv.notify_all();
    }
    fn pass(&self) {
        let mut g = self.gate.lock();
        g.1 += 1;
        self.cv.notify_all();
        while g.0 {
            self.cv.wait(&mut g);
        }
        g.1 -= 1;
    }
    /// Waits (up to a minute) until a write waits at the gate.
    fn until_a_write_waits(&self) -> bool {
        let end = std::time::Instant::now() + Duration::from_secs(60);
        let mut g = self.gate.lock();
        while g.1 == 0 {
            if self.cv.wait_until(&mut g, end).timed_out() {
                return false;
            }
        }
        true
    }
}

impl BlockDev for Gated {
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.dev.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.pass();
        self.dev.write_at(buf, off)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.dev.flush()
    }
    fn size(&self) -> u64 {
        self.dev.size()
    }
}

/// A writer of a folio being written back waits until the device has it (stable
/// pages): writeback writes and checksums the folio's own bytes, which must not change
/// under it. The writer's bytes are then the file's, and written back in turn.
#[test]
fn a_writer_of_a_folio_under_writeback_waits_for_the_device() {
    let o = Options {
        commit_interval: Duration::ZERO,
        ..opts(64 * MB, 64 << 10, true)
    };
    let (dev, fs) = mk(64 * MB, o.clone());
    let a = file(&fs, b"a");
    let mut want = pattern(256 << 10, 1);
    fs.write(a, 0, &want).unwrap();
    fs.unmount().unwrap();
    let gated = Arc::new(Gated::new(MemDev::from_image(dev.image())));
    let fs = Arc::new(Fs::open(gated.clone(), o.clone()).unwrap());
    fs.write(a, 0, &pattern(BS as usize, 2)).unwrap();

    gated.set_closed(true);
    let syncer = {
        let fs = fs.clone();
        std::thread::spawn(move || fs.fsync(a, false))
    };
    assert!(gated.until_a_write_waits(), "the fsync never wrote");
    // Blocks 0 (being written back) and 1 (clean) of the same folio.
    let second = pattern(2 * BS as usize, 3);
    let (tx, rx) = std::sync::mpsc::channel();
    let writer = {
        let (fs, second) = (fs.clone(), second.clone());
        std::thread::spawn(move || {
            let r = fs.write(a, 0, &second);
            let _ = tx.send(());
            r
        })
    };
    let early = rx.recv_timeout(Duration::from_millis(500));
    gated.set_closed(false);
    assert!(
        early.is_err(),
        "a write changed a folio while it was written back"
    );
    assert!(
        rx.recv_timeout(Duration::from_secs(30)).is_ok(),
        "the write did not go on once the writeback ended"
    );
    writer.join().unwrap().unwrap();
    syncer.join().unwrap().unwrap();
    want[..2 * BS as usize].copy_from_slice(&second);
    assert!(fs.read(a, 0, 256 << 10).unwrap() == want);
    let fs = Arc::try_unwrap(fs).ok().unwrap();
    fs.unmount().unwrap();
    let fs = Fs::open(Arc::new(MemDev::from_image(gated.dev.image())), o).unwrap();
    assert!(fs.read(a, 0, 256 << 10).unwrap() == want);
}

/// While a writeback waits for the device, readers of the folio being written back,
/// of other folios of its file (cached or not) and of other files go on, and so does
/// a writer of another folio: writeback does its I/O holding no lock they need.
#[test]
fn readers_and_writers_go_on_while_a_writeback_waits_for_the_device() {
    let o = Options {
        commit_interval: Duration::ZERO,
        ..opts(64 * MB, 64 << 10, true)
    };
    let (dev, fs) = mk(64 * MB, o.clone());
    let (a, b) = (file(&fs, b"a"), file(&fs, b"b"));
    let (mut da, db) = (pattern(MB as usize, 1), pattern(256 << 10, 2));
    fs.write(a, 0, &da).unwrap();
    fs.write(b, 0, &db).unwrap();
    fs.unmount().unwrap();
    let gated = Arc::new(Gated::new(MemDev::from_image(dev.image())));
    let fs = Arc::new(Fs::open(gated.clone(), o.clone()).unwrap());
    let folio = 64 << 10;
    assert_eq!(
        fs.read(a, 2 * folio, 4096).unwrap(),
        &da[2 * folio as usize..][..4096]
    );
    let new = pattern(BS as usize, 3);
    fs.write(a, 0, &new).unwrap();
    da[..BS as usize].copy_from_slice(&new);

    gated.set_closed(true);
    let syncer = {
        let fs = fs.clone();
        std::thread::spawn(move || fs.fsync(a, false))
    };
    assert!(gated.until_a_write_waits(), "the fsync never wrote");
    let (tx, rx) = std::sync::mpsc::channel();
    let other = {
        let fs = fs.clone();
        let (da, db) = (da.clone(), db.clone());
        std::thread::spawn(move || {
            let read =
                |ino, off: u64, want: &[u8]| fs.read(ino, off, want.len() as u32).unwrap() == want;
            let at = |d: &[u8], off: u64| d[off as usize..][..BS as usize].to_vec();
            let ok = read(a, 0, &at(&da, 0))
                && read(a, 2 * folio, &at(&da, 2 * folio))
                && read(a, 9 * folio, &at(&da, 9 * folio))
                && read(b, 3 * folio, &at(&db, 3 * folio))
                && fs.write(a, 5 * folio, &[7; BS as usize]).is_ok()
                && read(a, 5 * folio, &[7; BS as usize]);
            let _ = tx.send(ok);
        })
    };
    let went_on = rx.recv_timeout(Duration::from_secs(30));
    gated.set_closed(false);
    assert_eq!(
        went_on,
        Ok(true),
        "reads and writes waited for the writeback"
    );
    syncer.join().unwrap().unwrap();
    other.join().unwrap();
    da[5 * folio as usize..][..BS as usize].fill(7);
    let fs = Arc::try_unwrap(fs).ok().unwrap();
    fs.unmount().unwrap();
    let fs = Fs::open(Arc::new(MemDev::from_image(gated.dev.image())), o).unwrap();
    assert!(fs.read(a, 0, MB as u32).unwrap() == da);
    assert!(fs.read(b, 0, 256 << 10).unwrap() == db);
}
