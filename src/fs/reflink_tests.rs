//! Clone (reflink) and copy_file_range on an in-memory device: shared extents,
//! un-sharing on write, refcounts checked, and the log replaying a clone.

use std::sync::Arc;

use super::tests::{mk, pattern, problems_after_unmount, read_all, remount};
use super::*;
use crate::dev::MemDev;
use crate::error::Error;

const MB: u64 = 1 << 20;
const BS: u64 = 4096;

fn file(fs: &Fs, name: &[u8]) -> u64 {
    let c = Creds { uid: 0, gid: 0 };
    fs.mknod(ROOT_INO, name, 0o644, 0, c).unwrap().ino
}

#[test]
fn a_clone_shares_every_block_and_costs_no_data_space() {
    let (dev, fs) = mk(64 * MB);
    let src = file(&fs, b"src");
    let data = pattern(8 * MB as usize + 1000, 1);
    fs.write(src, 0, &data).unwrap();
    fs.commit().unwrap();
    let free = fs.statfs().bfree;
    let dst = file(&fs, b"dst");
    assert_eq!(
        fs.clone_range(src, 0, dst, 0, 0).unwrap(),
        data.len() as u64
    );
    fs.commit().unwrap();
    // Metadata only: far less than the 8 MiB a copy would take.
    let used = (free - fs.statfs().bfree) * BS;
    assert!(used < MB, "a clone of 8 MiB used {used} bytes");
    assert_eq!(read_all(&fs, dst), data);
    // The whole blocks point at the same disk extents; the partial last block is a copy.
    let (a, b) = (fs.extent_map(src).unwrap(), fs.extent_map(dst).unwrap());
    let shared: u64 = b
        .iter()
        .filter(|e| a.iter().any(|x| x.disk_addr == e.disk_addr))
        .map(|e| e.len)
        .sum();
    assert_eq!(shared, data.len() as u64 / BS * BS);
    assert_eq!(fs.stats().cloned_bytes, shared);
    let fs = remount(&dev, fs);
    assert_eq!(read_all(&fs, dst), data);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

#[test]
fn a_write_to_either_file_unshares_only_the_blocks_it_writes() {
    let (dev, fs) = mk(64 * MB);
    let src = file(&fs, b"src");
    let data = pattern(4 * MB as usize, 2);
    fs.write(src, 0, &data).unwrap();
    let dst = file(&fs, b"dst");
    fs.clone_range(src, 0, dst, 0, 0).unwrap();
    fs.commit().unwrap();
    let free = fs.statfs().bfree;
    fs.write(dst, MB + 100, b"changed").unwrap();
    fs.write(src, 3 * MB, &[9; 4096]).unwrap();
    fs.commit().unwrap();
    let used = free - fs.statfs().bfree;
    assert!(used < 256, "two one-block writes used {used} blocks");
    let mut want_dst = data.clone();
    want_dst[MB as usize + 100..MB as usize + 107].copy_from_slice(b"changed");
    let mut want_src = data.clone();
    want_src[3 * MB as usize..3 * MB as usize + 4096].fill(9);
    assert_eq!(read_all(&fs, dst), want_dst);
    assert_eq!(read_all(&fs, src), want_src);
    // Every block but the two written is still shared.
    let (a, b) = (fs.extent_map(src).unwrap(), fs.extent_map(dst).unwrap());
    let block_of = |m: &[ExtentInfo], off: u64| {
        let e = m
            .iter()
            .find(|e| e.offset <= off && off < e.offset + e.len)
            .unwrap();
        e.disk_addr + (off - e.offset)
    };
    for blk in 0..(4 * MB / BS) {
        let off = blk * BS;
        let same = block_of(&a, off) == block_of(&b, off);
        let written = off == MB || off == 3 * MB;
        assert_eq!(same, !written, "block at {off}");
    }
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

#[test]
fn space_comes_back_when_the_last_sharer_goes() {
    let (dev, fs) = mk(64 * MB);
    fs.commit().unwrap();
    let empty = fs.statfs().bfree;
    let src = file(&fs, b"src");
    fs.write(src, 0, &pattern(6 * MB as usize, 3)).unwrap();
    let dst = file(&fs, b"dst");
    fs.clone_range(src, 0, dst, 0, 0).unwrap();
    // Clone the middle again into the same target, over what it shares already.
    fs.clone_range(src, MB, dst, 4 * MB, 2 * MB).unwrap();
    fs.unlink(ROOT_INO, b"src").unwrap();
    fs.commit().unwrap();
    // The clone holds src's first 4 MiB (its last 2 MiB were replaced by a second
    // share of [1M, 3M)); src's last 2 MiB are free.
    let held = empty - fs.statfs().bfree;
    assert!(
        (4 * MB / BS..4 * MB / BS + 256).contains(&held),
        "the clone keeps what it shares: {held} blocks"
    );
    let mut want = pattern(6 * MB as usize, 3);
    want.copy_within(MB as usize..3 * MB as usize, 4 * MB as usize);
    assert_eq!(read_all(&fs, dst), want);
    fs.unlink(ROOT_INO, b"dst").unwrap();
    let fs = remount(&dev, fs);
    fs.commit().unwrap();
    let back = fs.statfs().bfree;
    assert!(
        empty.abs_diff(back) < 64,
        "space back after both unlinks: {empty} vs {back}"
    );
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

#[test]
fn copy_file_range_shares_aligned_blocks_and_copies_the_rest() {
    let (dev, fs) = mk(64 * MB);
    let src = file(&fs, b"src");
    let data = pattern(3 * MB as usize, 4);
    fs.write(src, 0, &data).unwrap();
    let dst = file(&fs, b"dst");
    fs.write(dst, 0, &pattern(MB as usize, 5)).unwrap();
    let mut want = pattern(MB as usize, 5);
    // Same place in a block: the whole blocks between are shared.
    let n = fs.copy_file_range(src, 100, dst, BS + 100, 2 * MB).unwrap();
    assert_eq!(n, 2 * MB);
    want.resize((BS + 100 + 2 * MB) as usize, 0);
    want[(BS + 100) as usize..].copy_from_slice(&data[100..100 + 2 * MB as usize]);
    let cloned = fs.stats().cloned_bytes;
    assert_eq!(cloned, 2 * MB - BS, "every whole block between is shared");
    // Different places in a block: copied byte by byte.
    let n = fs.copy_file_range(src, 10, dst, 7, 10_000).unwrap();
    assert_eq!(n, 10_000);
    want[7..10_007].copy_from_slice(&data[10..10_010]);
    assert_eq!(fs.stats().cloned_bytes, cloned);
    // Past the end of the source: nothing; up to it: what is there.
    assert_eq!(fs.copy_file_range(src, 3 * MB, dst, 0, 10).unwrap(), 0);
    assert_eq!(fs.copy_file_range(src, 0, dst, 0, 0).unwrap(), 0);
    let n = fs.copy_file_range(src, 3 * MB - 5000, dst, 0, MB).unwrap();
    assert_eq!(n, 5000);
    want[..5000].copy_from_slice(&data[3 * MB as usize - 5000..]);
    assert_eq!(read_all(&fs, dst), want);
    let fs = remount(&dev, fs);
    let dst = fs.lookup(ROOT_INO, b"dst").unwrap().ino;
    assert_eq!(read_all(&fs, dst), want);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

#[test]
fn clones_within_one_file_and_bad_requests() {
    let (dev, fs) = mk(64 * MB);
    let f = file(&fs, b"f");
    let data = pattern(2 * MB as usize, 6);
    fs.write(f, 0, &data).unwrap();
    assert!(matches!(
        fs.clone_range(f, 0, f, MB / 2, MB),
        Err(Error::Invalid(_))
    ));
    assert!(matches!(
        fs.clone_range(f, 100, f, 2 * MB, BS),
        Err(Error::Invalid(_))
    ));
    assert!(matches!(
        fs.clone_range(f, 0, f, 2 * MB, 100),
        Err(Error::Invalid(_))
    ));
    assert!(matches!(
        fs.clone_range(f, 0, ROOT_INO, 0, BS),
        Err(Error::IsDir)
    ));
    // Non-overlapping ranges of one file, cutting through the same extent.
    assert_eq!(fs.clone_range(f, 0, f, MB, 256 * 1024).unwrap(), 256 * 1024);
    let mut want = data.clone();
    want.copy_within(0..256 * 1024, MB as usize);
    assert_eq!(read_all(&fs, f), want);
    // Dirty cached data of the target inside the range is replaced, outside kept.
    fs.write(f, MB + 10, b"dirty inside").unwrap();
    fs.write(f, 2 * MB - 5, b"dirty after").unwrap();
    fs.clone_range(f, 0, f, MB, BS).unwrap();
    want[MB as usize..(MB + BS) as usize].copy_from_slice(&data[..BS as usize]);
    want.resize(2 * MB as usize + 6, 0);
    want[2 * MB as usize - 5..].copy_from_slice(b"dirty after");
    assert_eq!(read_all(&fs, f), want);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

#[test]
fn an_fsynced_clone_survives_a_crash_through_the_log() {
    let (dev, fs) = mk(64 * MB);
    let src = file(&fs, b"src");
    let data = pattern(2 * MB as usize, 7);
    fs.write(src, 0, &data).unwrap();
    fs.commit().unwrap();
    let dst = file(&fs, b"dst");
    fs.clone_range(src, 0, dst, 0, 0).unwrap();
    fs.fsync(dst, false).unwrap();
    let commits = fs.stats().commits;
    // The image as it is now: the clone is only in the log.
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    assert_eq!(fs.stats().commits, commits);
    drop(fs);
    let fs = Fs::open(crashed.clone(), Options::default()).unwrap();
    let dst = fs.lookup(ROOT_INO, b"dst").unwrap().ino;
    assert_eq!(read_all(&fs, dst), data);
    assert_eq!(problems_after_unmount(&crashed, fs), Vec::<String>::new());
}
