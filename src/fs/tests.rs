//! Engine tests on an in-memory device.

use std::sync::Arc;

use super::*;
use crate::dev::MemDev;
use crate::error::Error;
use crate::format::kind;

const MB: u64 = 1 << 20;
const BS: u64 = 4096;

pub(super) fn mk(size: u64) -> (Arc<MemDev>, Fs) {
    mk_with(size, &MkfsOptions::default())
}

/// A filesystem of `size` bytes made with `opts`, on an in-memory device.
fn mk_with(size: u64, opts: &MkfsOptions) -> (Arc<MemDev>, Fs) {
    let dev = Arc::new(MemDev::new(size));
    Fs::mkfs(dev.clone(), opts).unwrap();
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    (dev, fs)
}

/// [`mk`] with 4 KiB tree nodes: deep trees and full items come soon.
fn mk_small_nodes(size: u64) -> (Arc<MemDev>, Fs) {
    let opts = MkfsOptions {
        node_size: Some(4096),
        ..Default::default()
    };
    mk_with(size, &opts)
}

/// `len` bytes of a pattern that differs with `seed`.
pub(super) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i / 7) as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The whole content of file `ino`.
pub(super) fn read_all(fs: &Fs, ino: u64) -> Vec<u8> {
    let size = fs.getattr(ino).unwrap().size;
    fs.read(ino, 0, size as u32).unwrap()
}

/// What check finds on the image of `dev` as it is now.
pub(super) fn check_image(dev: &MemDev) -> Vec<String> {
    let img = MemDev::from_image(dev.image());
    crate::check::check(&img).unwrap().problems
}

/// Runs check on the image as it is after unmount; returns its problems.
pub(super) fn problems_after_unmount(dev: &MemDev, fs: Fs) -> Vec<String> {
    fs.unmount().unwrap();
    check_image(dev)
}

pub(super) fn remount(dev: &Arc<MemDev>, fs: Fs) -> Fs {
    fs.unmount().unwrap();
    let dev2 = Arc::new(MemDev::from_image(dev.image()));
    Fs::open(dev2, Options::default()).unwrap()
}

fn cr() -> Creds {
    Creds {
        uid: 1000,
        gid: 100,
    }
}

#[test]
fn create_write_read_persist() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"a", 0o644, 0, cr()).unwrap();
    assert_eq!(f.uid, 1000);
    assert_eq!(f.kind, FileKind::File);
    fs.write(f.ino, 0, b"hello world").unwrap();
    fs.write(f.ino, 6, b"WORLD").unwrap();
    assert_eq!(fs.read(f.ino, 0, 100).unwrap(), b"hello WORLD");
    let big: Vec<u8> = (0..3 * MB as usize + 123)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let g = fs.mknod(ROOT_INO, b"big", 0o644, 0, cr()).unwrap();
    fs.write(g.ino, 5000, &big).unwrap();
    let fs = remount(&dev, fs);
    let a = fs.lookup(ROOT_INO, b"a").unwrap();
    assert_eq!(fs.read(a.ino, 0, 100).unwrap(), b"hello WORLD");
    let b = fs.lookup(ROOT_INO, b"big").unwrap();
    assert_eq!(b.size, 5000 + big.len() as u64);
    let back = fs.read(b.ino, 0, b.size as u32).unwrap();
    assert!(back[..5000].iter().all(|&x| x == 0));
    assert_eq!(&back[5000..], &big[..]);
}

#[test]
fn directories_links_and_errors() {
    let (dev, fs) = mk(64 * MB);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap();
    assert_eq!(d.nlink, 2);
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 3);
    let f = fs.mknod(d.ino, b"f", 0o600, 0, cr()).unwrap();
    assert!(matches!(
        fs.mknod(d.ino, b"f", 0o600, 0, cr()),
        Err(Error::Exists)
    ));
    assert!(matches!(
        fs.mknod(f.ino, b"x", 0o600, 0, cr()),
        Err(Error::NotDir)
    ));
    assert!(matches!(
        fs.mknod(d.ino, &[b'x'; 256], 0o600, 0, cr()),
        Err(Error::NameTooLong)
    ));
    fs.mknod(d.ino, &[b'x'; 255], 0o600, 0, cr()).unwrap();
    assert!(matches!(fs.rmdir(ROOT_INO, b"d"), Err(Error::NotEmpty)));
    assert!(matches!(fs.unlink(ROOT_INO, b"d"), Err(Error::IsDir)));
    assert!(matches!(fs.link(d.ino, ROOT_INO, b"dl"), Err(Error::Perm)));
    let l = fs.link(f.ino, ROOT_INO, b"fl").unwrap();
    assert_eq!(l.nlink, 2);
    fs.unlink(d.ino, b"f").unwrap();
    assert_eq!(fs.getattr(f.ino).unwrap().nlink, 1);
    let s = fs.symlink(ROOT_INO, b"s", b"/some/where", cr()).unwrap();
    assert_eq!(fs.readlink(s.ino).unwrap(), b"/some/where");
    let fs = remount(&dev, fs);
    let names: Vec<Vec<u8>> = fs
        .readdir(ROOT_INO, 0, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(
        names,
        vec![
            b".".to_vec(),
            b"..".to_vec(),
            b"d".to_vec(),
            b"fl".to_vec(),
            b"s".to_vec()
        ]
    );
    fs.unlink(d.ino, &[b'x'; 255]).unwrap();
    fs.rmdir(ROOT_INO, b"d").unwrap();
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 2);
    assert!(matches!(fs.getattr(d.ino), Err(Error::NotFound)));
}

#[test]
fn rename_rules() {
    let (_dev, fs) = mk(64 * MB);
    let a = fs.mkdir(ROOT_INO, b"a", 0o755, cr()).unwrap();
    let b = fs.mkdir(a.ino, b"b", 0o755, cr()).unwrap();
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    let g = fs.mknod(ROOT_INO, b"g", 0o644, 0, cr()).unwrap();
    let nf = RenameFlags::default();
    assert!(matches!(
        fs.rename(ROOT_INO, b"a", b.ino, b"x", nf),
        Err(Error::Invalid(_))
    ));
    assert!(matches!(
        fs.rename(ROOT_INO, b"f", ROOT_INO, b"a", nf),
        Err(Error::IsDir)
    ));
    assert!(matches!(
        fs.rename(ROOT_INO, b"a", ROOT_INO, b"f", nf),
        Err(Error::NotDir)
    ));
    let noreplace = RenameFlags {
        noreplace: true,
        ..nf
    };
    assert!(matches!(
        fs.rename(ROOT_INO, b"f", ROOT_INO, b"g", noreplace),
        Err(Error::Exists)
    ));
    fs.rename(ROOT_INO, b"f", ROOT_INO, b"g", nf).unwrap();
    assert_eq!(fs.lookup_nopin(ROOT_INO, b"g").unwrap().ino, f.ino);
    assert!(matches!(fs.getattr(g.ino), Err(Error::NotFound)));
    // move b from a to root: link counts follow
    fs.rename(a.ino, b"b", ROOT_INO, b"b", nf).unwrap();
    assert_eq!(fs.getattr(a.ino).unwrap().nlink, 2);
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 4);
    assert_eq!(fs.lookup_nopin(b.ino, b"..").unwrap().ino, ROOT_INO);
    // exchange a file and a dir across directories
    let x = RenameFlags {
        exchange: true,
        ..nf
    };
    fs.rename(ROOT_INO, b"g", a.ino, b"missing", x).unwrap_err();
    let h = fs.mknod(a.ino, b"h", 0o644, 0, cr()).unwrap();
    fs.rename(ROOT_INO, b"b", a.ino, b"h", x).unwrap();
    assert_eq!(fs.lookup_nopin(a.ino, b"h").unwrap().ino, b.ino);
    assert_eq!(fs.lookup_nopin(ROOT_INO, b"b").unwrap().ino, h.ino);
    assert_eq!(fs.getattr(a.ino).unwrap().nlink, 3);
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 3);
    assert_eq!(fs.lookup_nopin(b.ino, b"..").unwrap().ino, a.ino);
}

/// Under a setgid directory, every new node takes the directory's group and a new
/// directory its setgid bit too; elsewhere the creator's group stays.
#[test]
fn a_setgid_directory_gives_its_group_to_what_is_made_in_it() {
    let (dev, fs) = mk(64 * MB);
    let shared = fs.mkdir(ROOT_INO, b"shared", 0o775, cr()).unwrap();
    fs.setattr(
        shared.ino,
        &SetAttr {
            gid: Some(4242),
            mode: Some(0o2775),
            ..Default::default()
        },
    )
    .unwrap();
    let plain = fs.mkdir(ROOT_INO, b"plain", 0o775, cr()).unwrap();
    assert_eq!(plain.gid, 100);
    for (parent, gid, sgid) in [(shared.ino, 4242, true), (plain.ino, 100, false)] {
        let f = fs
            .mknod(parent, b"f", libc::S_IFREG | 0o644, 0, cr())
            .unwrap();
        let d = fs.mkdir(parent, b"d", 0o755, cr()).unwrap();
        let l = fs.symlink(parent, b"l", b"f", cr()).unwrap();
        let n = fs
            .create_inheriting(parent, b"n", libc::S_IFIFO | 0o600, 0, cr(), 0o022)
            .unwrap();
        for a in [&f, &d, &l, &n] {
            assert_eq!((a.uid, a.gid), (1000, gid), "{a:?}");
            assert_eq!(fs.getattr(a.ino).unwrap().gid, gid);
        }
        assert_eq!(d.perm & libc::S_ISGID as u16 != 0, sgid, "{d:?}");
        assert_eq!(f.perm & libc::S_ISGID as u16, 0, "{f:?}");
        assert_eq!(
            fs.getattr(parent).unwrap().nlink,
            3,
            "the new directory's link"
        );
        assert!(fs.lookup(parent, b"f").is_ok() && fs.lookup(parent, b"d").is_ok());
        assert!(matches!(
            fs.mknod(parent, b"f", libc::S_IFREG | 0o644, 0, cr()),
            Err(Error::Exists)
        ));
    }
    assert!(problems_after_unmount(&dev, fs).is_empty());
}

#[test]
fn truncate_punch_fallocate() {
    let (_dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    fs.write(f.ino, 0, &vec![0xaa; 20000]).unwrap();
    fs.setattr(
        f.ino,
        &SetAttr {
            size: Some(5000),
            ..Default::default()
        },
    )
    .unwrap();
    fs.setattr(
        f.ino,
        &SetAttr {
            size: Some(20000),
            ..Default::default()
        },
    )
    .unwrap();
    let d = fs.read(f.ino, 0, 20000).unwrap();
    assert!(d[..5000].iter().all(|&b| b == 0xaa));
    assert!(
        d[5000..].iter().all(|&b| b == 0),
        "extended tail reads zeros"
    );
    fs.write(f.ino, 0, &vec![0xbb; 20000]).unwrap();
    fs.fallocate(
        f.ino,
        100,
        10000,
        FallocMode {
            keep_size: true,
            punch_hole: true,
            zero_range: false,
        },
    )
    .unwrap();
    let d = fs.read(f.ino, 0, 20000).unwrap();
    assert!(d[..100].iter().all(|&b| b == 0xbb));
    assert!(d[100..10100].iter().all(|&b| b == 0));
    assert!(d[10100..].iter().all(|&b| b == 0xbb));
    assert_eq!(fs.getattr(f.ino).unwrap().size, 20000);
    fs.fallocate(f.ino, 0, 100_000, FallocMode::default())
        .unwrap();
    let a = fs.getattr(f.ino).unwrap();
    assert_eq!(a.size, 100_000);
    assert!(a.blocks * 512 >= 100_000);
    fs.fallocate(
        f.ino,
        0,
        200_000,
        FallocMode {
            keep_size: true,
            punch_hole: false,
            zero_range: false,
        },
    )
    .unwrap();
    assert_eq!(fs.getattr(f.ino).unwrap().size, 100_000);
    let d = fs.read(f.ino, 0, 100_000).unwrap();
    assert!(d[..100].iter().all(|&b| b == 0xbb));
    assert!(d[20000..].iter().all(|&b| b == 0));
}

#[test]
fn sparse_terabyte_file() {
    let (_dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    fs.write(f.ino, (1 << 40) - 1, b"z").unwrap();
    let a = fs.getattr(f.ino).unwrap();
    assert_eq!(a.size, 1 << 40);
    assert_eq!(a.blocks, 8);
    assert_eq!(fs.read(f.ino, 1 << 39, 10).unwrap(), vec![0; 10]);
    assert_eq!(fs.read(f.ino, (1 << 40) - 1, 10).unwrap(), b"z");
}

#[test]
fn overwrites_free_space_and_unlink_returns_it() {
    let (dev, fs) = mk(64 * MB);
    let before = fs.statfs().bfree;
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    for _ in 0..10 {
        fs.write(f.ino, 0, &vec![1; 4 * MB as usize]).unwrap();
        fs.commit().unwrap();
    }
    let mid = fs.statfs().bfree;
    assert!(
        before - mid < (6 * MB) / 4096,
        "CoW overwrites must free the old blocks"
    );
    fs.unlink(ROOT_INO, b"f").unwrap();
    let fs = remount(&dev, fs);
    let after = fs.statfs().bfree;
    assert!(
        before.abs_diff(after) < 64,
        "space back after unlink: {before} vs {after}"
    );
}

#[test]
fn unlinked_open_file_is_an_orphan_until_released() {
    let (dev, fs) = mk(64 * MB);
    let before = fs.statfs().bfree;
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    fs.open_ino(f.ino).unwrap();
    fs.write(f.ino, 0, &vec![7; 8 * MB as usize]).unwrap();
    fs.unlink(ROOT_INO, b"f").unwrap();
    assert_eq!(fs.getattr(f.ino).unwrap().nlink, 0);
    assert_eq!(fs.read(f.ino, 0, 4).unwrap(), vec![7; 4]);
    // A crash now (image as of a commit) must free the orphan at mount.
    fs.commit().unwrap();
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    let fs2 = Fs::open(crashed, Options::default()).unwrap();
    assert!(matches!(fs2.getattr(f.ino), Err(Error::NotFound)));
    assert!(before.abs_diff(fs2.statfs().bfree) < 64);
    drop(fs2);
    fs.release(f.ino).unwrap();
    assert!(matches!(fs.getattr(f.ino), Err(Error::NotFound)));
}

/// An inode unlinked (or renamed over) while open lives until its last handle is
/// released, whichever way it lost its last link; a file that keeps a link is never
/// freed by a release.
#[test]
fn the_last_release_of_an_unlinked_file_frees_it() {
    let (dev, fs) = mk(64 * MB);
    let empty = fs.statfs().bfree;
    let a = fs.mknod(ROOT_INO, b"a", 0o644, 0, cr()).unwrap();
    let b = fs.mknod(ROOT_INO, b"b", 0o644, 0, cr()).unwrap();
    let c = fs.mknod(ROOT_INO, b"c", 0o644, 0, cr()).unwrap();
    for f in [a.ino, b.ino, c.ino] {
        fs.write(f, 0, &vec![1; MB as usize]).unwrap();
    }
    fs.commit().unwrap();
    // `a` open twice, then unlinked; `b` open, then renamed over by `c`; `c` open
    // and keeps its (new) name.
    fs.open_ino(a.ino).unwrap();
    fs.open_ino(a.ino).unwrap();
    fs.open_ino(b.ino).unwrap();
    fs.open_ino(c.ino).unwrap();
    fs.unlink(ROOT_INO, b"a").unwrap();
    fs.rename(ROOT_INO, b"c", ROOT_INO, b"b", RenameFlags::default())
        .unwrap();
    assert_eq!(fs.getattr(b.ino).unwrap().nlink, 0);
    fs.release(a.ino).unwrap();
    assert_eq!(
        fs.read(a.ino, 0, 2).unwrap(),
        vec![1; 2],
        "freed at the first release"
    );
    fs.release(a.ino).unwrap();
    fs.release(b.ino).unwrap();
    fs.release(c.ino).unwrap();
    for gone in [a.ino, b.ino] {
        assert!(matches!(fs.getattr(gone), Err(Error::NotFound)));
    }
    assert_eq!(fs.getattr(c.ino).unwrap().nlink, 1);
    assert_eq!(fs.lookup(ROOT_INO, b"b").unwrap().ino, c.ino);
    fs.commit().unwrap();
    // Only `c`'s megabyte is still in use.
    let used = empty - fs.statfs().bfree;
    assert!((256..256 + 64).contains(&used), "{used} blocks in use");
    assert_eq!(check_image_after_commit(&fs, &dev), Vec::<String>::new());
}

#[test]
fn xattrs() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    fs.setxattr(f.ino, b"user.a", b"1", false, false).unwrap();
    assert!(matches!(
        fs.setxattr(f.ino, b"user.a", b"2", true, false),
        Err(Error::Exists)
    ));
    assert!(matches!(
        fs.setxattr(f.ino, b"user.b", b"2", false, true),
        Err(Error::NoData)
    ));
    fs.setxattr(f.ino, b"user.b", &[9; 3000], false, false)
        .unwrap();
    let fs = remount(&dev, fs);
    assert_eq!(fs.getxattr(f.ino, b"user.a").unwrap(), b"1");
    let mut l = fs.listxattr(f.ino).unwrap();
    l.sort();
    assert_eq!(l, vec![b"user.a".to_vec(), b"user.b".to_vec()]);
    fs.removexattr(f.ino, b"user.a").unwrap();
    assert!(matches!(fs.getxattr(f.ino, b"user.a"), Err(Error::NoData)));
    // Only the namespaces a kernel filesystem stores take new names.
    for ok in [&b"trusted.t"[..], b"security.s", b"user.\xff"] {
        fs.setxattr(f.ino, ok, b"v", false, false).unwrap();
    }
    for (bad, errno) in [
        (&b"foo"[..], libc::EOPNOTSUPP),
        (b"system.foo", libc::EOPNOTSUPP),
        (b"users.x", libc::EOPNOTSUPP),
        (b"user.", libc::EINVAL),
        (b"security.", libc::EINVAL),
    ] {
        let e = fs.setxattr(f.ino, bad, b"v", false, false).unwrap_err();
        assert_eq!(e.errno(), errno, "{}", String::from_utf8_lossy(bad));
    }
    assert_eq!(fs.listxattr(f.ino).unwrap().len(), 4);
}

#[test]
fn big_directory_and_stable_readdir_offsets() {
    let (dev, fs) = mk(256 * MB);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap();
    for i in 0..5000 {
        fs.mknod(d.ino, format!("file-{i}").as_bytes(), 0o644, 0, cr())
            .unwrap();
    }
    let fs = remount(&dev, fs);
    let first = fs.readdir(d.ino, 0, 100).unwrap();
    let off = first.last().unwrap().next_offset;
    for i in (0..5000).step_by(2) {
        fs.unlink(d.ino, format!("file-{i}").as_bytes()).unwrap();
    }
    let mut seen = std::collections::HashSet::new();
    let mut off = off;
    loop {
        let b = fs.readdir(d.ino, off, 333).unwrap();
        if b.is_empty() {
            break;
        }
        for e in &b {
            assert!(seen.insert(e.name.clone()), "entry returned twice");
        }
        off = b.last().unwrap().next_offset;
    }
    for i in (1..5000).step_by(2) {
        let n = format!("file-{i}").into_bytes();
        let early = first.iter().any(|e| e.name == n);
        assert!(early || seen.contains(&n), "surviving entry {i} missed");
    }
}

#[test]
fn full_disk_gives_enospc_and_unlink_still_works() {
    let (dev, fs) = mk(40 * MB);
    let f = fs.mknod(ROOT_INO, b"keep", 0o644, 0, cr()).unwrap();
    fs.write(f.ino, 0, b"precious").unwrap();
    let g = fs.mknod(ROOT_INO, b"fill", 0o644, 0, cr()).unwrap();
    let chunk = vec![3u8; 4096];
    let mut off = 0;
    let err = loop {
        match fs.write(g.ino, off, &chunk) {
            Ok(n) => off += n as u64,
            Err(e) => break e,
        }
        assert!(off < 100 * MB);
    };
    assert!(matches!(err, Error::NoSpace));
    assert!(off > 20 * MB, "most of the disk was usable: {off}");
    fs.commit().unwrap();
    // The reservation kept a margin for writeback's metadata; what is left of it
    // after the commit fills too.
    for round in 0.. {
        assert!(round < 10, "the disk never filled");
        let before = off;
        while fs.write(g.ino, off, &chunk).is_ok() {
            off += chunk.len() as u64;
            assert!(off < 100 * MB);
        }
        fs.commit().unwrap();
        if off == before {
            break;
        }
    }
    assert!(matches!(
        fs.write(f.ino, 1 << 30, &chunk),
        Err(Error::NoSpace)
    ));
    fs.unlink(ROOT_INO, b"fill").unwrap();
    fs.commit().unwrap();
    let n = fs.mknod(ROOT_INO, b"new", 0o644, 0, cr()).unwrap();
    fs.write(n.ino, 0, &vec![1; 8 * MB as usize]).unwrap();
    let fs = remount(&dev, fs);
    let k = fs.lookup_nopin(ROOT_INO, b"keep").unwrap();
    assert_eq!(fs.read(k.ino, 0, 100).unwrap(), b"precious");
}

#[test]
fn readonly_refuses_changes() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    fs.write(f.ino, 0, b"old").unwrap();
    fs.unmount().unwrap();
    let fs = Fs::open(
        dev.clone(),
        Options {
            readonly: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(matches!(
        fs.mknod(ROOT_INO, b"x", 0o644, 0, cr()),
        Err(Error::ReadOnly)
    ));
    // A write is refused at once, not when its cached data would be written back.
    assert!(matches!(fs.write(f.ino, 0, b"new"), Err(Error::ReadOnly)));
    assert_eq!(fs.read(f.ino, 0, 10).unwrap(), b"old");
}

/// An overwrite replaces the file extent item at its start in place (no delete
/// first) and drops the old extent's reference after: content, extent layout and
/// every refcount stay right, live, after unmount, and after a crash that replays
/// the log.
#[test]
fn overwrites_that_replace_the_item_at_their_start_keep_refcounts_right() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    let mut model = Vec::new();
    // Eight extents of two blocks each, one fsync (so one writeback run) apiece.
    for e in 0..8u64 {
        let d = pattern(2 * BS as usize, e as u8);
        fs.write(f.ino, e * 2 * BS, &d).unwrap();
        fs.fsync(f.ino, true).unwrap();
        model.extend_from_slice(&d);
    }
    assert_eq!(fs.extent_map(f.ino).unwrap().len(), 8);
    fs.commit().unwrap();
    let mut put = |fs: &Fs, off: u64, len: u64, seed: u8| {
        let d = pattern(len as usize, seed);
        fs.write(f.ino, off, &d).unwrap();
        fs.fsync(f.ino, true).unwrap();
        model[off as usize..(off + len) as usize].copy_from_slice(&d);
    };
    // Exactly one extent; two whole extents from the start of the first; the start
    // of an extent and half of it; the start of one to the middle of the next; and
    // the same whole extent again (its item now points at the first overwrite).
    put(&fs, 2 * BS, 2 * BS, 100);
    put(&fs, 4 * BS, 4 * BS, 101);
    put(&fs, 8 * BS, BS, 102);
    put(&fs, 12 * BS, 3 * BS, 103);
    put(&fs, 2 * BS, 2 * BS, 104);
    assert_eq!(read_all(&fs, f.ino), model);
    let offsets: Vec<u64> = fs
        .extent_map(f.ino)
        .unwrap()
        .iter()
        .map(|e| e.offset / BS)
        .collect();
    assert_eq!(offsets, [0, 2, 4, 8, 9, 10, 12, 15]);
    // A crash now: the log holds the overwrites since the commit.
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
    let replayed = Fs::open(crashed.clone(), Options::default()).unwrap();
    assert_eq!(read_all(&replayed, f.ino), model, "the log replayed");
    assert_eq!(
        problems_after_unmount(&crashed, replayed),
        Vec::<String>::new()
    );
}

/// A read-only open that leaves the log unreplayed (norecovery) shows the last commit
/// alone and leaves the log as it was: a later open still replays the fsync. Asked
/// of a writable open, it is refused.
#[test]
fn no_log_replay_shows_the_last_commit_and_keeps_the_log() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"committed", 0o644, 0, cr()).unwrap();
    fs.write(f.ino, 0, b"old").unwrap();
    fs.commit().unwrap();
    fs.write(f.ino, 0, b"new").unwrap();
    let g = fs.mknod(ROOT_INO, b"logged", 0o644, 0, cr()).unwrap();
    fs.fsync(f.ino, false).unwrap();
    fs.fsync(g.ino, false).unwrap();
    // A crash: the device as it is now, no unmount.
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    drop(fs);
    let open = |no_log_replay: bool, readonly: bool| {
        Fs::open(
            crashed.clone(),
            Options {
                readonly,
                no_log_replay,
                ..Default::default()
            },
        )
    };
    assert!(matches!(open(true, false), Err(Error::BadOption(_))));
    let bare = open(true, true).unwrap();
    assert_eq!(bare.read(f.ino, 0, 10).unwrap(), b"old", "the last commit");
    assert!(matches!(
        bare.lookup_nopin(ROOT_INO, b"logged"),
        Err(Error::NotFound)
    ));
    drop(bare);
    let replayed = open(false, false).unwrap();
    assert_eq!(replayed.read(f.ino, 0, 10).unwrap(), b"new", "the log kept");
    replayed.lookup_nopin(ROOT_INO, b"logged").unwrap();
    assert_eq!(
        problems_after_unmount(&crashed, replayed),
        Vec::<String>::new()
    );
}

#[test]
fn fsync_goes_to_the_log_and_counts_seed_one_cases() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    fs.write(f.ino, 0, b"one").unwrap();
    let s0 = fs.stats();
    fs.fsync(f.ino, false).unwrap();
    let s1 = fs.stats();
    assert_eq!(
        s1.log_commits,
        s0.log_commits + 1,
        "an fsync writes one log batch"
    );
    assert_eq!(s1.commits, s0.commits, "and no full commit");
    assert_eq!(
        s1.log_flush_latency.count,
        s0.log_flush_latency.count + 1,
        "its flush is timed"
    );
    assert_eq!(
        s1.log_write_latency.count,
        s0.log_write_latency.count + 1,
        "so is its batch's write"
    );
    assert_eq!(
        s1.fsync_prepare_latency.count,
        s0.fsync_prepare_latency.count + 1,
        "and its preparation"
    );
    fs.fsync(f.ino, false).unwrap();
    let s2 = fs.stats();
    assert_eq!(
        s2.log_flush_latency.count, s1.log_flush_latency.count,
        "an fsync answered at once flushes nothing"
    );
    assert_eq!(
        s2.log_write_latency.count, s1.log_write_latency.count,
        "and writes no batch"
    );
    assert_eq!(
        s2.fsync_prepare_latency.count,
        s1.fsync_prepare_latency.count + 1,
        "but is prepared (it finds nothing to wait for)"
    );
    assert_eq!(
        s2.fsyncs_noop,
        s1.fsyncs_noop + 1,
        "nothing new: answered at once"
    );
    assert_eq!(s2.log_commits, s1.log_commits);
    fs.write(f.ino, 3, b"two").unwrap();
    fs.fsync(f.ino, true).unwrap();
    let s3 = fs.stats();
    assert_eq!(
        s3.fsyncs_relogged,
        s2.fsyncs_relogged + 1,
        "logged before in this generation"
    );
    assert_eq!(s3.log_commits, s2.log_commits + 1);
    // The log alone makes it durable: the image as it is now (no commit) mounts with it.
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    drop(fs); // its final commit goes to `dev`, not to the crashed copy
    let fs = Fs::open(crashed, Options::default()).unwrap();
    let a = fs.lookup(ROOT_INO, b"f").unwrap();
    assert_eq!(fs.read(a.ino, 0, 10).unwrap(), b"onetwo");
}

/// Creates and fsyncs a new file "z" in the root, then mounts the image as a power
/// cut right after that fsync would leave it.
fn crash_after_another_fsync(dev: &MemDev, fs: Fs) -> Fs {
    let z = fs.mknod(ROOT_INO, b"z", 0o644, 0, cr()).unwrap();
    fs.fsync(z.ino, false).unwrap();
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    drop(fs); // its final commit goes to `dev`, not to the crashed copy
    Fs::open(crashed, Options::default()).unwrap()
}

#[test]
fn a_file_renamed_over_another_is_written_back_first() {
    let (dev, fs) = mk(64 * MB);
    let old = fs.mknod(ROOT_INO, b"a", 0o644, 0, cr()).unwrap();
    fs.write(old.ino, 0, &pattern(7000, 1)).unwrap();
    fs.fsync(old.ino, false).unwrap();
    let new = fs.mknod(ROOT_INO, b"t", 0o644, 0, cr()).unwrap();
    let data = pattern(9000, 2);
    fs.write(new.ino, 0, &data).unwrap();
    // A rename onto a free name leaves the data cached.
    fs.rename(ROOT_INO, b"t", ROOT_INO, b"u", RenameFlags::default())
        .unwrap();
    assert!(fs.cache.has_dirty(new.ino), "moved, not written back");
    assert_eq!(fs.stats().replace_writebacks, 0);
    // Over a file, it is written back before the rename.
    fs.rename(ROOT_INO, b"u", ROOT_INO, b"a", RenameFlags::default())
        .unwrap();
    assert!(!fs.cache.has_dirty(new.ino), "written back");
    assert_eq!(fs.stats().replace_writebacks, 1);
    // Another file's fsync makes the rename durable, and the data with it.
    let fs = crash_after_another_fsync(&dev, fs);
    let a = fs.lookup(ROOT_INO, b"a").unwrap();
    assert_eq!(a.ino, new.ino);
    assert_eq!(read_all(&fs, a.ino), data);
}

#[test]
fn a_file_truncated_to_zero_while_open_is_written_back_at_its_release() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    fs.write(f.ino, 0, &pattern(7000, 1)).unwrap();
    fs.fsync(f.ino, false).unwrap();
    let empty = SetAttr {
        size: Some(0),
        ..Default::default()
    };
    // Truncated with no handle open, or shortened but not emptied: nothing at release.
    fs.setattr(f.ino, &empty).unwrap();
    fs.write(f.ino, 0, &pattern(5000, 2)).unwrap();
    fs.open_ino(f.ino).unwrap();
    let short = SetAttr {
        size: Some(100),
        ..Default::default()
    };
    fs.setattr(f.ino, &short).unwrap();
    fs.write(f.ino, 100, &pattern(5000, 3)).unwrap();
    fs.release(f.ino).unwrap();
    assert!(fs.cache.has_dirty(f.ino), "left to writeback");
    assert_eq!(fs.stats().replace_writebacks, 0);
    // open(O_TRUNC), write, close.
    fs.open_ino(f.ino).unwrap();
    fs.setattr(f.ino, &empty).unwrap();
    let data = pattern(9000, 4);
    fs.write(f.ino, 0, &data).unwrap();
    fs.release(f.ino).unwrap();
    assert!(!fs.cache.has_dirty(f.ino), "written back at the release");
    assert_eq!(fs.stats().replace_writebacks, 1);
    // Another file's fsync makes the truncate durable, and the new data with it.
    let fs = crash_after_another_fsync(&dev, fs);
    let a = fs.lookup(ROOT_INO, b"f").unwrap();
    assert_eq!(read_all(&fs, a.ino), data);
}

#[test]
fn a_nearly_full_log_is_committed_before_an_fsync_must_fall_back() {
    let (dev, fs) = mk(40 * MB);
    let blocks = Fs::superblock_of(dev.as_ref()).unwrap().log_len / 4096;
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    let s0 = fs.stats();
    // Each fsync writes at least one block: twice the area's blocks fill it twice.
    for i in 0..2 * blocks {
        fs.write(f.ino, i * 4096, &[i as u8; 4096]).unwrap();
        fs.fsync(f.ino, false).unwrap();
    }
    let s = fs.stats();
    assert!(
        s.commits >= s0.commits + 2,
        "the log area ({blocks} blocks here) filled twice: {s:?}"
    );
    assert_eq!(s.fallbacks, 0, "no fsync had to fall back to a commit");
    assert!(s.log_commits >= s0.log_commits + 2 * blocks - 10);
}

#[test]
fn fdatasync_skips_what_reading_the_data_does_not_need() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    fs.write(f.ino, 0, b"data").unwrap();
    fs.fsync(f.ino, true).unwrap();
    let s0 = fs.stats();
    fs.setattr(
        f.ino,
        &SetAttr {
            mode: Some(0o600),
            ..Default::default()
        },
    )
    .unwrap();
    fs.setxattr(f.ino, b"user.k", b"v", false, false).unwrap();
    fs.fsync(f.ino, true).unwrap();
    let s1 = fs.stats();
    assert_eq!(
        s1.log_commits, s0.log_commits,
        "mode and xattr: nothing for fdatasync"
    );
    assert_eq!(s1.fsyncs_noop, s0.fsyncs_noop + 1);
    fs.fsync(f.ino, false).unwrap();
    assert_eq!(
        fs.stats().log_commits,
        s1.log_commits + 1,
        "fsync still logs them"
    );
    fs.setattr(
        f.ino,
        &SetAttr {
            size: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    fs.fsync(f.ino, true).unwrap();
    let s2 = fs.stats();
    assert_eq!(s2.log_commits, s1.log_commits + 2, "a size change is data");
    fs.unlink(ROOT_INO, b"f").unwrap();
    fs.fsync(ROOT_INO, true).unwrap();
    assert_eq!(
        fs.stats().log_commits,
        s2.log_commits + 1,
        "a directory's entries are its data"
    );
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    drop(fs);
    let fs = Fs::open(crashed, Options::default()).unwrap();
    assert!(matches!(fs.lookup(ROOT_INO, b"f"), Err(Error::NotFound)));
}

#[test]
fn mkfs_writes_zeros_over_the_log_area_and_old_bytes_there_replay_nothing() {
    // A device that held something else: every byte 0xA5, which must neither stay in
    // the log area (mkfs writes it, so a sparse image has it allocated) nor replay.
    let dev = Arc::new(MemDev::from_image(vec![0xA5; (64 * MB) as usize]));
    Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let img = dev.image();
    let sb = crate::txn::Store::read_super(dev.as_ref()).unwrap();
    assert!(sb.log_len >= MB);
    let log = &img[sb.log_start as usize..(sb.log_start + sb.log_len) as usize];
    assert!(
        log.iter().all(|&b| b == 0),
        "mkfs left old bytes in the log area"
    );
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    // Only "." and ".." in the root.
    assert!(fs.readdir(ROOT_INO, 0, 100).unwrap().len() <= 2);
    assert!(problems_after_unmount(&dev, fs).is_empty());
}

/// Files reach the kernel's own largest size for FUSE (`MAX_LFS_FILESIZE`, btrfs's
/// too), so every write the kernel caches can be stored: data written, punched,
/// preallocated, cloned and copied in a file's last blocks comes back after a crash
/// (from the log) and after a commit, and a byte past it is EFBIG.
#[test]
fn files_reach_the_largest_size_the_kernel_allows() {
    let max = crate::format::MAX_FILE_SIZE;
    assert_eq!(max, i64::MAX as u64);
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"huge", 0o644, 0, cr()).unwrap().ino;
    let tail = pattern(70_000, 3);
    let at = max - tail.len() as u64;
    assert_eq!(fs.write(f, at, &tail).unwrap(), tail.len());
    assert!(matches!(fs.write(f, max - 1, b"xy"), Err(Error::TooBig)));
    fs.write(f, 1 << 62, b"middle").unwrap();
    fs.fsync(f, false).unwrap();
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    drop(fs);
    let fs = Fs::open(crashed.clone(), Options::default()).unwrap();
    assert_eq!(fs.getattr(f).unwrap().size, max);
    assert!(fs.read(f, at, 70_000).unwrap() == tail);
    assert_eq!(fs.read(f, 1 << 62, 6).unwrap(), b"middle");
    assert_eq!(fs.seek_data_hole(f, 0, true).unwrap(), 1 << 62);
    assert_eq!(
        fs.seek_data_hole(f, 1 << 62, false).unwrap(),
        (1 << 62) + BS
    );
    assert_eq!(
        fs.seek_data_hole(f, (1 << 62) + BS, true).unwrap(),
        at / BS * BS
    );
    assert_eq!(fs.seek_data_hole(f, at, false).unwrap(), max);

    // The last partial block starts at `last`: punch the two whole blocks before it,
    // preallocate them again, clone three blocks over them, copy into the end.
    let last = max / BS * BS;
    let punch = FallocMode {
        keep_size: true,
        punch_hole: true,
        ..FallocMode::default()
    };
    fs.fallocate(f, last - 2 * BS, 2 * BS, punch).unwrap();
    let mut want = fs
        .read(f, last - 4 * BS, (4 * BS + max - last) as u32)
        .unwrap();
    want[2 * BS as usize..4 * BS as usize].fill(0);
    assert!(fs.read(f, last - 4 * BS, want.len() as u32).unwrap() == want);
    fs.fallocate(f, last - 2 * BS, 2 * BS, FallocMode::default())
        .unwrap();
    let g = fs.mknod(ROOT_INO, b"src", 0o644, 0, cr()).unwrap().ino;
    let src = pattern(3 * BS as usize, 9);
    fs.write(g, 0, &src).unwrap();
    assert_eq!(
        fs.clone_range(g, 0, f, last - 3 * BS, 3 * BS).unwrap(),
        3 * BS
    );
    assert_eq!(fs.copy_file_range(g, 0, f, max - 5, 5).unwrap(), 5);
    want[BS as usize..4 * BS as usize].copy_from_slice(&src);
    let n = want.len();
    want[n - 5..].copy_from_slice(&src[..5]);
    assert!(fs.read(f, last - 4 * BS, n as u32).unwrap() == want);
    assert!(matches!(
        fs.copy_file_range(g, 0, f, max - 4, 5),
        Err(Error::TooBig)
    ));
    let grow = |size| SetAttr {
        size: Some(size),
        ..SetAttr::default()
    };
    assert!(matches!(fs.setattr(g, &grow(max + 1)), Err(Error::TooBig)));
    assert_eq!(fs.setattr(g, &grow(max)).unwrap().size, max);
    assert!(matches!(
        fs.fallocate(g, max - BS, BS + 1, FallocMode::default()),
        Err(Error::TooBig)
    ));
    fs.fsync(f, false).unwrap();
    fs.fsync(g, false).unwrap();
    let after = Arc::new(MemDev::from_image(crashed.image()));
    let fs = Fs::open(after.clone(), Options::default()).unwrap();
    assert!(fs.read(f, last - 4 * BS, n as u32).unwrap() == want);
    assert_eq!(fs.getattr(g).unwrap().size, max);
    // Shrinking it drops its last block whole (the block ends past the largest size):
    // what is left comes back from the log after a crash, and checks clean.
    let keep = last - 4 * BS + 100;
    assert_eq!(fs.setattr(f, &grow(keep)).unwrap().size, keep);
    fs.fsync(f, false).unwrap();
    let crashed = Arc::new(MemDev::from_image(after.image()));
    drop(fs);
    let fs = Fs::open(crashed.clone(), Options::default()).unwrap();
    assert_eq!(fs.getattr(f).unwrap().size, keep);
    assert!(fs.read(f, last - 4 * BS, 2 * BS as u32).unwrap() == want[..100]);
    assert!(problems_after_unmount(&crashed, fs).is_empty());
}

/// A file's names in one directory fill one item after about 27 long names; the
/// names past that go to extended refs, so one directory takes hundreds of long links
/// to one file. The first extended ref reaches the disk by a commit that sets the
/// image's feature flag. Names in both kinds of item survive unlink, rename, a crash
/// after fsync (log replay) and a remount, and check agrees with them.
#[test]
fn one_directory_takes_hundreds_of_long_links_to_one_file() {
    let (dev, fs) = mk(64 * MB);
    let flag = crate::format::INCOMPAT_EXTREF;
    let on_disk = |dev: &MemDev| crate::txn::Store::read_super(dev).unwrap().incompat & flag;
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap().ino;
    let name = |i: usize| format!("{i:05}{}", "x".repeat(250)).into_bytes();
    const N: usize = 400;
    for i in 0..20 {
        fs.link(f, d, &name(i)).unwrap();
    }
    fs.fsync(f, false).unwrap();
    assert_eq!(on_disk(&dev), 0, "names that fit their item need no flag");
    for i in 20..N {
        fs.link(f, d, &name(i)).unwrap();
    }
    fs.fsync(f, false).unwrap();
    assert_ne!(on_disk(&dev), 0, "the fsync committed the flag");
    assert_eq!(fs.getattr(f).unwrap().nlink as usize, N + 1);
    let names = fs.names_of(f, 10_000).unwrap();
    assert_eq!(names.len(), N + 1, "names in refs and extended refs");
    assert!(names.contains(&(d, name(N - 1))) && names.contains(&(ROOT_INO, b"f".to_vec())));
    assert_eq!(fs.names_of(f, 30).unwrap().len(), 30);
    // Unlink names of both kinds; move one of each elsewhere and one in.
    for i in (0..N).step_by(7) {
        fs.unlink(d, &name(i)).unwrap();
    }
    let nf = RenameFlags::default();
    fs.rename(d, &name(1), ROOT_INO, b"early", nf).unwrap();
    fs.rename(d, &name(N - 2), ROOT_INO, b"late", nf).unwrap();
    fs.rename(ROOT_INO, b"f", d, b"in", nf).unwrap();
    let gone: Vec<usize> = (0..N).step_by(7).chain([1, N - 2]).collect();
    let kept: Vec<usize> = (0..N).filter(|i| !gone.contains(i)).collect();
    fs.fsync(f, false).unwrap();
    fs.fsync(d, false).unwrap();
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    drop(fs);
    let fs = Fs::open(crashed.clone(), Options::default()).unwrap();
    let verify = |fs: &Fs| {
        for &i in &kept {
            assert_eq!(fs.lookup(d, &name(i)).unwrap().ino, f, "name {i}");
        }
        for &i in &gone {
            assert!(
                matches!(fs.lookup(d, &name(i)), Err(Error::NotFound)),
                "{i}"
            );
        }
        for n in [&b"early"[..], b"late"] {
            assert_eq!(fs.lookup(ROOT_INO, n).unwrap().ino, f);
        }
        assert_eq!(fs.lookup(d, b"in").unwrap().ino, f);
        assert!(matches!(fs.lookup(ROOT_INO, b"f"), Err(Error::NotFound)));
        assert_eq!(fs.getattr(f).unwrap().nlink as usize, kept.len() + 3);
        let listed = fs.readdir(d, 0, usize::MAX).unwrap();
        assert_eq!(listed.iter().filter(|e| e.ino == f).count(), kept.len() + 1);
    };
    verify(&fs);
    let fs = remount(&crashed, fs);
    verify(&fs);
    // Every name goes; the file with them.
    for &i in &kept {
        fs.unlink(d, &name(i)).unwrap();
    }
    for (p, n) in [(ROOT_INO, &b"early"[..]), (ROOT_INO, b"late"), (d, b"in")] {
        fs.unlink(p, n).unwrap();
    }
    assert!(matches!(fs.getattr(f), Err(Error::NotFound)));
    assert!(problems_after_unmount(&crashed, fs).is_empty());
}

/// chattr's flags: an immutable file refuses every change to its data, attributes
/// and names, an immutable directory every change to its entries; an append-only
/// file takes writes and new space but no truncate, punch, chmod, rename or unlink,
/// an append-only directory new names but no removal. The flags reach the log with
/// an fsync (a crash then keeps them) and survive a remount; cleared, all works.
#[test]
fn inode_flags_forbid_changes_and_survive_a_crash_after_fsync() {
    use crate::format::inode_flag::{APPEND, IMMUTABLE, NODUMP};
    let (imm, app) = (IMMUTABLE as u32, APPEND as u32);
    let (dev, fs) = mk(64 * MB);
    let reg = libc::S_IFREG | 0o644;
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap().ino;
    let f = fs.mknod(d, b"f", reg, 0, cr()).unwrap().ino;
    let g = fs.mknod(ROOT_INO, b"g", reg, 0, cr()).unwrap().ino;
    fs.write(f, 0, b"hello").unwrap();
    fs.write(g, 0, b"other").unwrap();
    fs.commit().unwrap();
    let perm = |r: Result<()>| matches!(r, Err(Error::Perm));
    let sz = |n| SetAttr {
        size: Some(n),
        ..Default::default()
    };
    let nf = RenameFlags::default();
    assert_eq!(fs.get_flags(f).unwrap(), 0);
    // FS_COMPR_FL: not kept, so refused.
    assert!(matches!(fs.set_flags(f, 0x4), Err(Error::NotSupported)));

    fs.set_flags(f, imm | NODUMP as u32).unwrap();
    assert_eq!(fs.get_flags(f).unwrap(), imm | NODUMP as u32);
    assert!(perm(fs.write(f, 5, b"x").map(drop)));
    assert!(perm(fs.write(f, 0, b"j").map(drop)));
    assert!(perm(fs.setattr(f, &sz(0)).map(drop)));
    for set in [
        SetAttr {
            mode: Some(0o600),
            ..Default::default()
        },
        SetAttr {
            uid: Some(7),
            ..Default::default()
        },
        SetAttr {
            mtime: Some(TimeSet::Now),
            ..Default::default()
        },
    ] {
        assert!(perm(fs.setattr(f, &set).map(drop)));
    }
    assert!(perm(fs.unlink(d, b"f")));
    assert!(perm(fs.rename(d, b"f", ROOT_INO, b"f2", nf)));
    assert!(perm(fs.rename(ROOT_INO, b"g", d, b"f", nf)), "replaces it");
    assert!(perm(fs.link(f, ROOT_INO, b"f3").map(drop)));
    assert!(perm(fs.setxattr(f, b"user.a", b"1", false, false)));
    assert!(perm(fs.fallocate(f, 0, BS, FallocMode::default())));
    assert!(perm(fs.clone_range(g, 0, f, 0, 0).map(drop)));
    assert!(perm(fs.access(f, libc::W_OK, 0, 0, &[])));
    let a = fs.getattr(f).unwrap();
    for flags in [libc::O_RDWR, libc::O_WRONLY, libc::O_RDONLY | libc::O_TRUNC] {
        assert!(perm(Fs::check_open(&a, flags)), "{flags:#x}");
    }
    Fs::check_open(&a, libc::O_RDONLY).unwrap();
    assert_eq!(read_all(&fs, f), b"hello");
    assert_eq!(fs.getattr(f).unwrap().nlink, 1);

    fs.set_flags(d, imm).unwrap();
    assert!(perm(fs.mknod(d, b"new", reg, 0, cr()).map(drop)));
    assert!(perm(fs.rename(ROOT_INO, b"g", d, b"g", nf)));
    fs.set_flags(d, 0).unwrap();

    fs.set_flags(g, app).unwrap();
    fs.write(g, 5, b"+more").unwrap();
    assert!(perm(fs.write(g, 2, b"X").map(drop)), "an overwrite");
    fs.fallocate(g, 4 * BS, BS, FallocMode::default()).unwrap();
    fs.setattr(
        g,
        &SetAttr {
            mtime: Some(TimeSet::Now),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(perm(fs.setattr(g, &sz(0)).map(drop)));
    let epoch = TimeSet::At(std::time::UNIX_EPOCH);
    let later = TimeSet::At(std::time::SystemTime::now() + std::time::Duration::from_secs(9));
    for (atime, mtime) in [(Some(epoch), None), (None, Some(epoch))] {
        let set = SetAttr {
            atime,
            mtime,
            ..Default::default()
        };
        assert!(perm(fs.setattr(g, &set).map(drop)), "{set:?}");
    }
    let forward = SetAttr {
        mtime: Some(later),
        ..Default::default()
    };
    fs.setattr(g, &forward).unwrap();
    assert!(perm(
        fs.setattr(
            g,
            &SetAttr {
                mode: Some(0o600),
                ..Default::default()
            }
        )
        .map(drop)
    ));
    let punch = FallocMode {
        keep_size: true,
        punch_hole: true,
        ..Default::default()
    };
    assert!(perm(fs.fallocate(g, 0, BS, punch)));
    assert!(perm(fs.unlink(ROOT_INO, b"g")));
    assert!(perm(fs.rename(ROOT_INO, b"g", d, b"g", nf)));
    let a = fs.getattr(g).unwrap();
    assert_eq!(a.size, 5 * BS);
    for flags in [
        libc::O_WRONLY,
        libc::O_RDWR,
        libc::O_WRONLY | libc::O_APPEND | libc::O_TRUNC,
    ] {
        assert!(perm(Fs::check_open(&a, flags)), "{flags:#x}");
    }
    Fs::check_open(&a, libc::O_WRONLY | libc::O_APPEND).unwrap();

    fs.set_flags(d, app).unwrap();
    fs.mknod(d, b"h", reg, 0, cr()).unwrap();
    assert!(perm(fs.unlink(d, b"h")));
    assert!(perm(fs.rename(d, b"h", ROOT_INO, b"h", nf)));

    for ino in [f, g, d] {
        fs.fsync(ino, false).unwrap();
    }
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    drop(fs);
    let fs = Fs::open(crashed.clone(), Options::default()).unwrap();
    let verify = |fs: &Fs| {
        assert_eq!(fs.get_flags(f).unwrap(), imm | NODUMP as u32);
        assert_eq!(fs.get_flags(g).unwrap(), app);
        assert_eq!(fs.get_flags(d).unwrap(), app);
        assert_eq!(&read_all(fs, g)[..10], b"other+more");
        assert!(perm(fs.unlink(d, b"h")));
    };
    verify(&fs);
    let fs = remount(&crashed, fs);
    verify(&fs);
    for ino in [f, g, d] {
        fs.set_flags(ino, 0).unwrap();
    }
    fs.write(f, 5, b" world").unwrap();
    assert_eq!(read_all(&fs, f), b"hello world");
    fs.unlink(d, b"f").unwrap();
    fs.unlink(d, b"h").unwrap();
    fs.rename(ROOT_INO, b"g", d, b"g", nf).unwrap();
    fs.setattr(g, &sz(0)).unwrap();
    assert!(problems_after_unmount(&crashed, fs).is_empty());
}

/// Random links, unlinks and renames of three files' long names over two
/// directories, on 4 KiB nodes (a handful of names fill an INODE_REF item; the rest
/// are extended refs), against a map of names: after every step the outcome, and
/// now and then every name, link count and listing, also on the image a crash after
/// an fsync leaves and after a remount. Check agrees at the end.
#[test]
fn names_in_inode_refs_and_extended_refs_match_a_model() {
    use std::collections::BTreeMap;
    let (dev, mut fs) = mk_small_nodes(64 * MB);
    let dirs = [ROOT_INO, fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap().ino];
    let mut model: BTreeMap<(u64, Vec<u8>), u64> = BTreeMap::new();
    let files: Vec<u64> = (0..3)
        .map(|i| {
            let n = format!("f{i}").into_bytes();
            let f = fs.mknod(ROOT_INO, &n, 0o644, 0, cr()).unwrap().ino;
            model.insert((ROOT_INO, n), f);
            f
        })
        .collect();
    let name = |k: u64| format!("{k:03}{}", "n".repeat(200)).into_bytes();
    let verify = |fs: &Fs, model: &BTreeMap<(u64, Vec<u8>), u64>| {
        for ((d, n), f) in model {
            assert_eq!(fs.lookup(*d, n).unwrap().ino, *f);
        }
        for f in &files {
            let names = model.values().filter(|x| *x == f).count();
            assert_eq!(fs.getattr(*f).unwrap().nlink as usize, names);
        }
        for d in dirs {
            let mut got: Vec<Vec<u8>> = fs
                .readdir(d, 0, usize::MAX)
                .unwrap()
                .into_iter()
                .filter(|e| e.kind != FileKind::Dir)
                .map(|e| e.name)
                .collect();
            got.sort();
            let want: Vec<Vec<u8>> = model
                .keys()
                .filter(|(md, _)| *md == d)
                .map(|(_, n)| n.clone())
                .collect();
            assert_eq!(got, want);
        }
    };
    let mut x = 7u64;
    let mut extended = false;
    for step in 0..3000u32 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let r = x >> 20;
        let made: Vec<(u64, Vec<u8>)> =
            model.keys().filter(|(_, n)| n.len() > 3).cloned().collect();
        let to = (dirs[(r as usize / 16) % 2], name((r >> 8) % 60));
        match r % 4 {
            0 | 1 => {
                let f = files[(r as usize / 4) % 3];
                let res = fs.link(f, to.0, &to.1);
                match model.entry(to) {
                    std::collections::btree_map::Entry::Occupied(_) => {
                        assert!(matches!(res, Err(Error::Exists)), "{step}")
                    }
                    std::collections::btree_map::Entry::Vacant(v) => {
                        res.unwrap();
                        v.insert(f);
                    }
                }
            }
            2 if !made.is_empty() => {
                let k = &made[(r as usize >> 12) % made.len()];
                fs.unlink(k.0, &k.1).unwrap();
                model.remove(k);
            }
            3 if !made.is_empty() && !model.contains_key(&to) => {
                let k = &made[(r as usize >> 12) % made.len()];
                fs.rename(k.0, &k.1, to.0, &to.1, RenameFlags::default())
                    .unwrap();
                let f = model.remove(k).unwrap();
                model.insert(to, f);
            }
            _ => {}
        }
        if step % 250 == 249 {
            verify(&fs, &model);
            extended |= fs
                .with(|i| Ok(i.store.sb.incompat & crate::format::INCOMPAT_EXTREF != 0))
                .unwrap();
        }
        if step % 1000 == 999 {
            for f in &files {
                fs.fsync(*f, false).unwrap();
            }
            for d in dirs {
                fs.fsync(d, false).unwrap();
            }
            let crashed = Arc::new(MemDev::from_image(dev.image()));
            let after = Fs::open(crashed.clone(), Options::default()).unwrap();
            verify(&after, &model);
            let after = remount(&crashed, after);
            verify(&after, &model);
            assert!(problems_after_unmount(&crashed, after).is_empty());
        }
    }
    assert!(extended, "some names went to extended refs");
    fs = remount(&dev, fs);
    verify(&fs, &model);
    assert!(problems_after_unmount(&dev, fs).is_empty());
}

/// Check finds an extended ref under the wrong hash, and one that no directory entry
/// backs (the file's link count then disagrees too).
#[test]
fn check_reports_extended_refs_that_do_not_add_up() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let stray = crate::format::encode_inode_extrefs(&[crate::format::InodeExtref {
        parent: ROOT_INO,
        index: 999,
        name: b"nowhere".to_vec(),
    }]);
    fs.with(|i| {
        i.store.sb.incompat |= crate::format::INCOMPAT_EXTREF;
        i.store.insert(
            tree::FS,
            Key::new(f, kind::INODE_EXTREF, 12345),
            stray.clone(),
        )
    })
    .unwrap();
    let problems = check_image_after_commit(&fs, &dev);
    assert!(
        problems.iter().any(|p| p.contains("wrong hash")),
        "{problems:?}"
    );
    assert!(
        problems.iter().any(|p| p.contains("link count")),
        "{problems:?}"
    );
    drop(fs);
}

/// A deleted file's space shows free in statfs at once, before the commit that
/// lets it be reused (`rm`, then `df`; xfstests generic/015), whether its data was
/// committed or only fsynced since the last commit; a file that needs that space
/// can then be written.
#[test]
fn statfs_shows_a_deleted_files_space_at_once() {
    let (dev, fs) = mk(64 * MB);
    let empty = fs.statfs().bfree;
    let reg = libc::S_IFREG | 0o644;
    let f = fs.mknod(ROOT_INO, b"f", reg, 0, cr()).unwrap().ino;
    let data = pattern(40 * MB as usize, 3);
    fs.write(f, 0, &data).unwrap();
    fs.commit().unwrap();
    let full = fs.statfs().bfree;
    assert!(empty - full >= 40 * MB / BS, "{empty} {full}");
    let commits = fs.stats().commits;
    fs.unlink(ROOT_INO, b"f").unwrap();
    let freed = fs.statfs().bfree;
    assert_eq!(fs.stats().commits, commits, "no commit in between");
    assert!(freed + empty / 100 >= empty, "{freed} of {empty} free");
    let g = fs.mknod(ROOT_INO, b"g", reg, 0, cr()).unwrap().ino;
    fs.write(g, 0, &data).unwrap();
    fs.fsync(g, false).unwrap();
    let commits = fs.stats().commits;
    assert!(fs.statfs().bfree + 40 * MB / BS <= empty);
    fs.unlink(ROOT_INO, b"g").unwrap();
    let freed = fs.statfs().bfree;
    assert_eq!(fs.stats().commits, commits, "no commit in between");
    assert!(
        freed + empty / 100 >= empty,
        "fsynced only: {freed} of {empty} free"
    );
    let h = fs.mknod(ROOT_INO, b"h", reg, 0, cr()).unwrap().ino;
    fs.write(h, 0, &data).unwrap();
    fs.fsync(h, false).unwrap();
    assert!(read_all(&fs, h) == data);
    assert!(problems_after_unmount(&dev, fs).is_empty());
}

/// Check reports inode flags birchfs does not know (a damaged inode item).
#[test]
fn check_reports_unknown_inode_flags() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.set_flags(f, crate::format::inode_flag::KNOWN as u32)
        .unwrap();
    assert!(check_image_after_commit(&fs, &dev).is_empty());
    fs.with(|i| {
        let mut item = i.get_inode(f)?;
        item.flags = (item.flags.get() | 0x4).into();
        i.put_inode(f, &mut item)
    })
    .unwrap();
    let problems = check_image_after_commit(&fs, &dev);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("unknown inode flags 0x4")),
        "{problems:?}"
    );
    drop(fs);
}

/// mkfs leaves no other filesystem's or partition table's signature behind (blkid
/// would take the device for that): the first MiB but birchfs's superblock and the
/// last MiB hold zeros.
#[test]
fn mkfs_wipes_the_signatures_of_what_the_device_held() {
    let mut img = vec![0xA5; (64 * MB) as usize];
    img[1080..1082].copy_from_slice(&[0x53, 0xef]);
    img[512..520].copy_from_slice(b"EFI PART");
    let dev = Arc::new(MemDev::from_image(img));
    assert!(crate::check::foreign_signature(dev.as_ref()).is_some());
    Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    assert_eq!(crate::check::foreign_signature(dev.as_ref()), None);
    let img = dev.image();
    let sb = crate::format::SUPER_OFFSETS[0] as usize;
    let sb_end = sb + crate::format::SUPER_SIZE;
    assert!(img[..sb].iter().all(|&b| b == 0));
    assert!(img[sb_end..MB as usize].iter().all(|&b| b == 0));
    assert!(img[img.len() - MB as usize..].iter().all(|&b| b == 0));
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    assert!(problems_after_unmount(&dev, fs).is_empty());
}

/// With 4 KiB nodes an item holds less than with the default 16 KiB ones: a large
/// xattr or a long symlink target is refused with an error, never written into a node
/// it does not fit (which panicked at commit).
#[test]
fn small_nodes_refuse_items_they_cannot_hold() {
    let (dev, fs) = mk_small_nodes(32 * MB);
    let c = Creds::default();
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, c).unwrap().ino;
    // An xattr value larger than an item goes into chunks, up to Linux's 64 KiB.
    fs.setxattr(f, b"user.big", &pattern(65536, 3), false, false)
        .unwrap();
    fs.setxattr(f, b"user.ok", &[7; 1900], false, false)
        .unwrap();
    assert!(matches!(
        fs.symlink(ROOT_INO, b"l", &[b'x'; 4000], c),
        Err(Error::NameTooLong)
    ));
    fs.symlink(ROOT_INO, b"m", &[b'x'; 1900], c).unwrap();
    fs.commit().unwrap();
    assert_eq!(fs.getxattr(f, b"user.ok").unwrap(), vec![7; 1900]);
    assert_eq!(fs.getxattr(f, b"user.big").unwrap(), pattern(65536, 3));
    assert!(problems_after_unmount(&dev, fs).is_empty());
}

/// A fallocate that runs out of space part way (the tree's own growth took the room
/// its first check saw) keeps the extents it made and counts them in the inode's
/// nbytes, also when it is retried after a commit; the image stays consistent.
#[test]
fn fallocate_that_runs_out_of_space_leaves_a_consistent_image() {
    let (dev, fs) = mk(32 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let keep = FallocMode {
        keep_size: true,
        punch_hole: false,
        zero_range: false,
    };
    let mut failed = 0;
    for n in 0..20_000u64 {
        // Block 1 of each 4-block group first, then the whole group: two holes, the
        // second allocated after the first one's extent went into the tree.
        let base = n * 4 * 4096;
        let one = fs.fallocate(f, base + 4096, 4096, keep);
        if n % 3 == 0 {
            let _ = fs.commit();
        }
        let all = fs.fallocate(f, base, 3 * 4096, keep);
        if one.is_err() || all.is_err() {
            failed += 1;
            if failed > 200 {
                break;
            }
        }
    }
    assert!(failed > 0, "the disk never filled");
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// A truncate to the middle of a block on a full disk, whose copy of that block finds
/// no room until a commit, leaves nbytes matching the extents that are left.
#[test]
fn truncate_into_a_block_on_a_full_disk_keeps_nbytes_right() {
    let (dev, fs) = mk(32 * MB);
    let g = fs.mknod(ROOT_INO, b"fill", 0o644, 0, cr()).unwrap().ino;
    let chunk = vec![3u8; 64 << 10];
    let mut off = 0;
    for round in 0.. {
        assert!(round < 10, "the disk never filled");
        let before = off;
        while fs.write(g, off, &chunk).is_ok() {
            off += chunk.len() as u64;
            assert!(off < 100 * MB);
        }
        let _ = fs.fsync(g, false);
        let _ = fs.commit();
        if off == before {
            break;
        }
    }
    let size = off / 2 + 100;
    fs.setattr(
        g,
        &SetAttr {
            size: Some(size),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(fs.getattr(g).unwrap().size, size);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

const ALLOCATE: FallocMode = FallocMode {
    keep_size: false,
    punch_hole: false,
    zero_range: false,
};

/// Whether every written extent of `ino` lies in the disk ranges of `prealloc`.
fn all_within(fs: &Fs, ino: u64, prealloc: &[ExtentInfo]) -> bool {
    fs.extent_map(ino).unwrap().iter().all(|e| {
        prealloc
            .iter()
            .any(|p| e.disk_addr >= p.disk_addr && e.disk_addr + e.len <= p.disk_addr + p.len)
    })
}

/// Block numbers `0..n` in a scrambled order.
fn scrambled(n: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..n).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}

/// fallocate's promise: once it succeeded, writes into the range do not fail for
/// want of space. Random overwrites of a range that took most of the free space
/// go in place into its preallocated blocks (with copy-on-write they would need
/// a second copy of each partly written extent), and the data, checksums and
/// refcounts are right after a remount.
#[test]
fn writes_into_a_fallocated_range_need_no_new_space() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let len = fs.statfs().bavail * 4096 * 9 / 10 / 4096 * 4096;
    fs.fallocate(f, 0, len, ALLOCATE).unwrap();
    fs.commit().unwrap();
    let prealloc = fs.extent_map(f).unwrap();
    assert!(prealloc.iter().all(|e| e.prealloc));
    let mut want = vec![0u8; len as usize];
    for (k, b) in scrambled(len / 4096).into_iter().enumerate() {
        let block = pattern(4096, (b % 251) as u8);
        fs.write(f, b * 4096, &block)
            .unwrap_or_else(|e| panic!("write {k} (block {b}) failed: {e}"));
        want[(b * 4096) as usize..][..4096].copy_from_slice(&block);
        if k % 97 == 0 {
            fs.fsync(f, true).unwrap();
        }
    }
    fs.fsync(f, false).unwrap();
    assert!(all_within(&fs, f, &prealloc), "a write went to new space");
    assert!(fs.extent_map(f).unwrap().iter().all(|e| !e.prealloc));
    assert_eq!(fs.stats().prealloc_filled_bytes, len);
    let fs = remount(&dev, fs);
    assert!(read_all(&fs, f) == want, "data differs after a remount");
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// Writes into preallocated blocks, some cached and written back together, others
/// one by one, interleaved with hole punches and a truncate: the file reads back
/// as the model says, the extents it no longer uses are freed with all their
/// checksum items, and check finds nothing wrong.
#[test]
fn in_place_pieces_are_read_punched_and_freed_like_any_extent() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let len = 3 * MB;
    fs.fallocate(f, 0, len, ALLOCATE).unwrap();
    let prealloc = fs.extent_map(f).unwrap();
    let mut want = vec![0u8; len as usize];
    let put = |fs: &Fs, want: &mut Vec<u8>, off: u64, data: &[u8]| {
        fs.write(f, off, data).unwrap();
        want[off as usize..off as usize + data.len()].copy_from_slice(data);
    };
    put(&fs, &mut want, 4096, &pattern(3 * 4096, 1));
    put(&fs, &mut want, 40_000, &pattern(100, 2)); // a partial block: read first (zeros)
    fs.fsync(f, false).unwrap();
    put(&fs, &mut want, MB - 8192, &pattern(16 * 4096, 3)); // across two preallocated extents
    put(&fs, &mut want, 2 * MB + 12_288, &pattern(4096, 4));
    fs.commit().unwrap();
    assert!(all_within(&fs, f, &prealloc), "a write went to new space");
    assert_eq!(read_all(&fs, f), want);
    // Punch through an in-place piece and its preallocated neighbours.
    let punch = FallocMode {
        keep_size: true,
        punch_hole: true,
        zero_range: false,
    };
    fs.fallocate(f, 8192, 64 * 1024, punch).unwrap();
    want[8192..8192 + 64 * 1024].fill(0);
    put(&fs, &mut want, 12_288, &pattern(4096, 5)); // the hole: new space
    assert_eq!(read_all(&fs, f), want);
    let fs = remount(&dev, fs);
    assert_eq!(read_all(&fs, f), want);
    fs.setattr(
        f,
        &SetAttr {
            size: Some(MB / 2),
            ..Default::default()
        },
    )
    .unwrap();
    want.truncate((MB / 2) as usize);
    assert_eq!(read_all(&fs, f), want);
    fs.commit().unwrap();
    assert_eq!(check_image(&dev), Vec::<String>::new());
    let used = fs.statfs().bfree;
    fs.unlink(ROOT_INO, b"f").unwrap();
    fs.commit().unwrap();
    fs.commit().unwrap();
    assert!(fs.statfs().bfree > used);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// A snapshot that shares preallocated blocks keeps reading zeros there while the
/// live file writes them in place (snapshots are read-only, so nothing else ever
/// writes them); deleting the file, then the snapshot, frees the extents and all
/// their checksum items.
#[test]
fn preallocated_blocks_a_snapshot_shares_are_written_in_place() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.fallocate(f, 0, 2 * MB, ALLOCATE).unwrap();
    fs.write(f, 0, &pattern(4096, 9)).unwrap();
    fs.commit().unwrap();
    let prealloc = fs.extent_map(f).unwrap();
    let free = fs.statfs().bfree;
    fs.mkdir(SNAPSHOTS_INO, b"s", 0o755, cr()).unwrap();
    fs.write(f, 8192, &pattern(8192, 10)).unwrap();
    fs.write(f, MB + 4096, &pattern(4096, 11)).unwrap();
    fs.fsync(f, false).unwrap();
    assert!(all_within(&fs, f, &prealloc), "a write went to new space");
    let s = fs.lookup(SNAPSHOTS_INO, b"s").unwrap().ino;
    let sf = fs.lookup(s, b"f").unwrap().ino;
    let mut old = vec![0u8; 2 * MB as usize];
    old[..4096].copy_from_slice(&pattern(4096, 9));
    assert!(read_all(&fs, sf) == old, "the snapshot changed");
    fs.commit().unwrap();
    assert_eq!(check_image(&dev), Vec::<String>::new());
    fs.unlink(ROOT_INO, b"f").unwrap();
    fs.commit().unwrap();
    assert!(
        read_all(&fs, sf) == old,
        "the snapshot changed with the unlink"
    );
    fs.snapshot_delete(b"s").unwrap();
    while fs.drop_deleted(1000).unwrap() {}
    fs.commit().unwrap();
    fs.commit().unwrap();
    assert!(fs.statfs().bfree > free, "the extents were not freed");
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

const ZERO: FallocMode = FallocMode {
    keep_size: false,
    punch_hole: false,
    zero_range: true,
};

/// FALLOC_FL_ZERO_RANGE: the range reads as zeros (partial blocks zeroed, whole
/// ones preallocated in place of their data), the size grows past the end only
/// without KEEP_SIZE, and the preallocated blocks are then written in place with
/// no new space.
#[test]
fn zero_range_zeroes_and_preallocates() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let mut want = pattern(300_000, 3);
    fs.write(f, 0, &want).unwrap();
    fs.commit().unwrap();
    // Inside the file, unaligned at both ends.
    fs.fallocate(f, 5_000, 100_000, ZERO).unwrap();
    want[5_000..105_000].fill(0);
    assert_eq!(read_all(&fs, f), want);
    let map = fs.extent_map(f).unwrap();
    let zeroed: Vec<&ExtentInfo> = map
        .iter()
        .filter(|e| e.offset < 102_400 && e.offset + e.len > 8192)
        .collect();
    assert!(
        zeroed
            .iter()
            .all(|e| e.prealloc && e.offset >= 8192 && e.offset + e.len <= 102_400),
        "whole blocks of the range are preallocated: {zeroed:?}"
    );
    // Within one block.
    fs.fallocate(f, 200_001, 10, ZERO).unwrap();
    want[200_001..200_011].fill(0);
    // Past the end, with and without KEEP_SIZE.
    let keep = FallocMode {
        keep_size: true,
        ..ZERO
    };
    fs.fallocate(f, 290_000, 50_000, keep).unwrap();
    want[290_000..].fill(0);
    assert_eq!(fs.getattr(f).unwrap().size, 300_000);
    assert_eq!(read_all(&fs, f), want);
    fs.fallocate(f, 299_000, 20_000, ZERO).unwrap();
    want.resize(319_000, 0);
    assert_eq!(fs.getattr(f).unwrap().size, 319_000);
    assert_eq!(read_all(&fs, f), want);
    // The zeroed range is written in place.
    let before = fs.extent_map(f).unwrap();
    fs.write(f, 16_384, &pattern(8192, 9)).unwrap();
    want[16_384..24_576].copy_from_slice(&pattern(8192, 9));
    fs.fsync(f, false).unwrap();
    assert!(all_within(&fs, f, &before));
    let fs = remount(&dev, fs);
    assert_eq!(read_all(&fs, f), want);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// A zero range that needs more new space than there is fails with ENOSPC before
/// it changes anything.
#[test]
fn zero_range_without_room_changes_nothing() {
    let (dev, fs) = mk(32 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let data = pattern(
        (fs.statfs().bavail * 4096 * 2 / 3) as usize / 4096 * 4096,
        4,
    );
    fs.write(f, 0, &data).unwrap();
    fs.commit().unwrap();
    let r = fs.fallocate(f, 0, data.len() as u64, ZERO);
    assert!(matches!(r, Err(Error::NoSpace)), "{r:?}");
    assert!(read_all(&fs, f) == data);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// Preallocated extents are large (as btrfs's, up to 128 MiB), so a fallocate of
/// all but 64 KiB of what statfs calls available needs few items and succeeds
/// (xfstests generic/103); the range is then written in place.
#[test]
fn fallocate_of_nearly_all_available_space_succeeds() {
    let (dev, fs) = mk(512 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let len = fs.statfs().bavail * 4096 - (64 << 10);
    fs.fallocate(f, 0, len, ALLOCATE).unwrap();
    let map = fs.extent_map(f).unwrap();
    assert!(map.len() <= 8, "{} extents for {len} bytes", map.len());
    fs.write(f, len - 5 * MB, &pattern(3 * MB as usize, 6))
        .unwrap();
    fs.fsync(f, false).unwrap();
    assert!(all_within(&fs, f, &map));
    let fs = remount(&dev, fs);
    assert!(
        read_all(&fs, f)[(len - 5 * MB) as usize..][..3 * MB as usize]
            == pattern(3 * MB as usize, 6)[..]
    );
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// The library's mknod and mkdir give a new node its parent's default POSIX ACL,
/// masked by the mode asked for (as a FUSE create with no umask); without one the
/// mode is kept as asked.
#[test]
fn library_creates_inherit_the_default_acl() {
    let (dev, fs) = mk(64 * MB);
    let acl = |entries: &[(u16, u16, u32)]| {
        let mut v = 2u32.to_le_bytes().to_vec();
        for &(t, p, id) in entries {
            v.extend_from_slice(&t.to_le_bytes());
            v.extend_from_slice(&p.to_le_bytes());
            v.extend_from_slice(&id.to_le_bytes());
        }
        v
    };
    let u = u32::MAX;
    let def = acl(&[
        (0x01, 7, u),
        (0x02, 7, 1000),
        (0x04, 5, u),
        (0x10, 7, u),
        (0x20, 5, u),
    ]);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap().ino;
    fs.set_acl(d, b"system.posix_acl_default", &def, true)
        .unwrap();
    let f = fs.mknod(d, b"f", 0o666, 0, cr()).unwrap();
    assert_eq!(f.perm, 0o664, "the default ACL masked by the mode");
    let access = fs.getxattr(f.ino, b"system.posix_acl_access").unwrap();
    assert!(
        access.len() == def.len() && access[12..20] == def[12..20],
        "named entries stay"
    );
    assert!(fs.getxattr(f.ino, b"system.posix_acl_default").is_err());
    let sub = fs.mkdir(d, b"sub", 0o777, cr()).unwrap();
    assert_eq!(sub.perm, 0o775);
    assert_eq!(
        fs.getxattr(sub.ino, b"system.posix_acl_default").unwrap(),
        def,
        "a directory passes the default on"
    );
    let plain = fs.mknod(ROOT_INO, b"p", 0o666, 0, cr()).unwrap();
    assert_eq!(plain.perm, 0o666, "no default ACL: the mode as asked");
    assert!(fs.getxattr(plain.ino, b"system.posix_acl_access").is_err());
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// Mounting after a crash reads the log batches that are there, not the whole log
/// area (up to 512 MiB on a large image), and replays them.
#[test]
fn a_crash_mount_reads_the_log_it_replays_not_the_whole_area() {
    let (dev, fs) = mk(256 * MB);
    let sb = crate::txn::Store::read_super(dev.as_ref()).unwrap();
    assert!(sb.log_len >= 8 * MB);
    let mut files = Vec::new();
    for i in 0..3u8 {
        let f = fs
            .mknod(ROOT_INO, &[b'f', b'0' + i], 0o644, 0, cr())
            .unwrap()
            .ino;
        fs.write(f, 0, &pattern(10_000, i)).unwrap();
        fs.fsync(f, false).unwrap();
        files.push(f);
    }
    // The power goes: the image as it is, without the commit an unmount makes.
    let image = dev.image();
    drop(fs);
    let counting = Arc::new(Watched::new(
        image,
        sb.log_start..sb.log_start + sb.log_len,
        false,
    ));
    let fs = Fs::open(counting.clone(), Options::default()).unwrap();
    for (i, &f) in files.iter().enumerate() {
        assert_eq!(read_all(&fs, f), pattern(10_000, i as u8));
    }
    let read = counting.read.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        read < MB,
        "read {read} bytes of a {}-byte log area",
        sb.log_len
    );
}

/// The number of XATTR_CHUNK items of `ino` in the fs tree.
fn xattr_chunks(fs: &Fs, ino: u64) -> usize {
    let mut g = fs.inner.lock();
    g.store
        .range(
            tree::FS,
            &Key::new(ino, kind::XATTR_CHUNK, 0),
            &Key::new(ino, kind::XATTR_CHUNK + 1, 0),
            usize::MAX,
        )
        .unwrap()
        .len()
}

/// xattr values up to 64 KiB: those too large for an item go into chunks, which a
/// replacement, a removal and the file's deletion take away with them; they survive
/// a remount and a crash after fsync (the log), and check finds nothing wrong.
#[test]
fn xattr_values_up_to_64_kib_go_into_chunks_and_leave_none_behind() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let sizes = [0usize, 100, 6000, 7000, 7001, 20_000, 65_535, 65_536];
    for (i, &n) in sizes.iter().enumerate() {
        let name = format!("user.v{n}");
        fs.setxattr(f, name.as_bytes(), &pattern(n, i as u8), false, false)
            .unwrap();
    }
    for (i, &n) in sizes.iter().enumerate() {
        let name = format!("user.v{n}");
        assert_eq!(
            fs.getxattr(f, name.as_bytes()).unwrap(),
            pattern(n, i as u8),
            "{n}"
        );
    }
    assert_eq!(fs.listxattr(f).unwrap().len(), sizes.len());
    assert!(xattr_chunks(&fs, f) > 0);
    assert!(matches!(
        fs.setxattr(f, b"user.over", &vec![1; 65_537], false, false),
        Err(Error::ArgTooBig)
    ));
    // Large to large, large to small, small to large.
    fs.setxattr(f, b"user.v65536", &pattern(30_000, 50), false, false)
        .unwrap();
    fs.setxattr(f, b"user.v20000", b"small now", false, false)
        .unwrap();
    fs.setxattr(f, b"user.v100", &pattern(40_000, 51), false, false)
        .unwrap();
    assert_eq!(fs.getxattr(f, b"user.v65536").unwrap(), pattern(30_000, 50));
    assert_eq!(fs.getxattr(f, b"user.v20000").unwrap(), b"small now");
    assert_eq!(fs.getxattr(f, b"user.v100").unwrap(), pattern(40_000, 51));
    assert_eq!(check_image_after_commit(&fs, &dev), Vec::<String>::new());
    fs.removexattr(f, b"user.v65535").unwrap();
    assert!(matches!(fs.getxattr(f, b"user.v65535"), Err(Error::NoData)));
    // An fsynced large value survives a crash (replayed from the log).
    let g = fs.mknod(ROOT_INO, b"g", 0o644, 0, cr()).unwrap().ino;
    fs.setxattr(g, b"user.big", &pattern(50_000, 9), false, false)
        .unwrap();
    fs.fsync(g, false).unwrap();
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    {
        let fs2 = Fs::open(crashed.clone(), Options::default()).unwrap();
        assert_eq!(fs2.getxattr(g, b"user.big").unwrap(), pattern(50_000, 9));
        assert!(problems_after_unmount(&crashed, fs2).is_empty());
    }
    let fs = remount(&dev, fs);
    assert_eq!(fs.getxattr(f, b"user.v100").unwrap(), pattern(40_000, 51));
    assert_eq!(fs.getxattr(g, b"user.big").unwrap(), pattern(50_000, 9));
    // Removing the file removes its chunks.
    fs.unlink(ROOT_INO, b"f").unwrap();
    assert_eq!(xattr_chunks(&fs, f), 0);
    fs.removexattr(g, b"user.big").unwrap();
    assert_eq!(xattr_chunks(&fs, g), 0);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// Commits and runs check on the image as it is.
fn check_image_after_commit(fs: &Fs, dev: &MemDev) -> Vec<String> {
    fs.commit().unwrap();
    check_image(dev)
}

/// A value whose chunk base is taken (by a chunk no entry names, here) moves on to
/// the next free base and leaves the other chunks alone; check reports a chunk that
/// belongs to no xattr, and a value whose chunks do not add up.
#[test]
fn xattr_chunks_never_share_a_base_and_check_finds_strays() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let base = crate::format::name_hash(b"user.x") & !0xFFFF;
    {
        let mut g = fs.inner.lock();
        g.store
            .insert(tree::FS, Key::new(f, kind::XATTR_CHUNK, base), vec![9; 10])
            .unwrap();
    }
    fs.setxattr(f, b"user.x", &pattern(30_000, 1), false, false)
        .unwrap();
    assert_eq!(fs.getxattr(f, b"user.x").unwrap(), pattern(30_000, 1));
    {
        let mut g = fs.inner.lock();
        assert_eq!(
            g.store
                .search(tree::FS, &Key::new(f, kind::XATTR_CHUNK, base))
                .unwrap(),
            Some(vec![9; 10]),
            "the other chunk is untouched"
        );
    }
    let p = check_image_after_commit(&fs, &dev);
    assert!(
        p.len() == 1 && p[0].contains("belongs to no xattr"),
        "{p:?}"
    );
    // Drop the stray, then one of the value's own chunks.
    {
        let mut g = fs.inner.lock();
        g.store
            .delete(tree::FS, &Key::new(f, kind::XATTR_CHUNK, base))
            .unwrap();
        g.store
            .delete(
                tree::FS,
                &Key::new(f, kind::XATTR_CHUNK, base + 0x10000 + 1),
            )
            .unwrap();
    }
    let p = check_image_after_commit(&fs, &dev);
    assert!(p.iter().any(|p| p.contains("in chunks")), "{p:?}");
    assert!(matches!(
        fs.getxattr(f, b"user.x"),
        Err(Error::Corrupt { .. })
    ));
}

/// A snapshot keeps the large xattr value it was taken with.
#[test]
fn a_snapshot_keeps_its_large_xattr_values() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.setxattr(f, b"user.big", &pattern(40_000, 1), false, false)
        .unwrap();
    fs.snapshot_create(b"s").unwrap();
    fs.setxattr(f, b"user.big", &pattern(60_000, 2), false, false)
        .unwrap();
    let s = fs.lookup(SNAPSHOTS_INO, b"s").unwrap().ino;
    let sf = fs.lookup(s, b"f").unwrap().ino;
    assert_eq!(fs.getxattr(sf, b"user.big").unwrap(), pattern(40_000, 1));
    assert_eq!(fs.getxattr(f, b"user.big").unwrap(), pattern(60_000, 2));
    let fs = remount(&dev, fs);
    assert_eq!(fs.getxattr(sf, b"user.big").unwrap(), pattern(40_000, 1));
    fs.snapshot_delete(b"s").unwrap();
    while fs.drop_deleted(1000).unwrap() {}
    assert_eq!(fs.getxattr(f, b"user.big").unwrap(), pattern(60_000, 2));
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// SEEK_DATA and SEEK_HOLE across many extents, runs that cross the windows the
/// search reads (1 MiB doubling) and data far past the offset asked about: every answer
/// is the one the written ranges give.
#[test]
fn seek_data_and_hole_agree_with_the_written_ranges_far_and_near() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let g = 1u64 << 30;
    let mut runs: Vec<(u64, u64)> = vec![
        (0, BS),
        (MB - 2 * BS, 3 * MB + BS), // across the first windows' ends
        (5 * MB, 5 * MB + BS),
        (g + 7 * BS, g + 9 * BS), // far past the rest
    ];
    // Many small extents, every other block.
    for i in 0..300 {
        let at = 8 * MB + i * 2 * BS;
        runs.push((at, at + BS));
    }
    for (i, &(a, b)) in runs.iter().enumerate() {
        fs.write(f, a, &pattern((b - a) as usize, i as u8)).unwrap();
    }
    fs.commit().unwrap();
    let size = 2 * g;
    fs.setattr(
        f,
        &SetAttr {
            size: Some(size),
            ..Default::default()
        },
    )
    .unwrap();
    runs.sort_unstable();
    let is_data = |p: u64| runs.iter().any(|&(a, b)| a <= p && p < b);
    let model_data = |p: u64| runs.iter().map(|&(a, _)| a.max(p)).find(|&q| is_data(q));
    let model_hole = |p: u64| {
        let mut q = p;
        while is_data(q) {
            q = runs.iter().find(|&&(a, b)| a <= q && q < b).unwrap().1;
        }
        q.min(size)
    };
    let mut probes: Vec<u64> = vec![0, 1, BS, MB - 1, MB, 2 * MB + 5, 4 * MB, g, g + 8 * BS];
    probes.extend(
        runs.iter()
            .flat_map(|&(a, b)| [a.saturating_sub(1), a, b - 1, b]),
    );
    probes.push(size - 1);
    for p in probes {
        let got = fs.seek_data_hole(f, p, true).ok();
        assert_eq!(got, model_data(p), "SEEK_DATA from {p:#x}");
        assert_eq!(
            fs.seek_data_hole(f, p, false).unwrap(),
            model_hole(p),
            "SEEK_HOLE from {p:#x}"
        );
    }
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// SEEK_DATA and SEEK_HOLE: written extents are data, also those still dirty in the
/// cache (written back first); gaps, preallocated ranges and the end are holes;
/// ENXIO at or past the end, or when no data follows.
#[test]
fn seek_data_and_hole_follow_the_extents_and_the_cache() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let seek = |off: u64, data: bool| fs.seek_data_hole(f, off, data);
    let past = |r: Result<u64>| assert!(matches!(r, Err(Error::PastEnd)), "{r:?}");
    past(seek(0, true));
    // Written and committed at 1 MiB; dirty only in the cache at 3 MiB; preallocated
    // at 5 MiB; the file ends at 8 MiB.
    fs.write(f, MB, &pattern(4096, 1)).unwrap();
    fs.commit().unwrap();
    fs.write(f, 3 * MB + 100, &pattern(10_000, 2)).unwrap();
    assert!(fs.dirty_bytes_of(f) > 0);
    let keep = FallocMode {
        keep_size: true,
        punch_hole: false,
        zero_range: false,
    };
    fs.fallocate(f, 5 * MB, MB, keep).unwrap();
    fs.setattr(
        f,
        &SetAttr {
            size: Some(8 * MB),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(seek(0, true).unwrap(), MB);
    assert_eq!(seek(0, false).unwrap(), 0);
    assert_eq!(seek(MB + 10, true).unwrap(), MB + 10);
    assert_eq!(seek(MB + 10, false).unwrap(), MB + 4096);
    assert_eq!(seek(MB + 4096, true).unwrap(), 3 * MB, "the cached write");
    assert_eq!(fs.dirty_bytes_of(f), 0, "written back first");
    assert_eq!(seek(3 * MB, false).unwrap(), 3 * MB + 12_288);
    past(seek(3 * MB + 12_288, true));
    assert_eq!(seek(5 * MB, false).unwrap(), 5 * MB, "preallocated: a hole");
    assert_eq!(seek(8 * MB - 1, false).unwrap(), 8 * MB - 1);
    past(seek(8 * MB, true));
    past(seek(8 * MB, false));
    // A preallocated block written in place becomes data.
    fs.write(f, 5 * MB + 8192, &pattern(4096, 3)).unwrap();
    assert_eq!(seek(4 * MB, true).unwrap(), 5 * MB + 8192);
    assert_eq!(seek(5 * MB + 8192, false).unwrap(), 5 * MB + 12_288);
    // A file whose last block holds its end: the hole starts at the size.
    let g = fs.mknod(ROOT_INO, b"g", 0o644, 0, cr()).unwrap().ino;
    fs.write(g, 0, &pattern(5000, 4)).unwrap();
    assert_eq!(fs.seek_data_hole(g, 0, false).unwrap(), 5000);
    assert_eq!(fs.seek_data_hole(g, 4999, true).unwrap(), 4999);
    assert!(matches!(
        fs.seek_data_hole(ROOT_INO, 0, true),
        Err(Error::Invalid(_))
    ));
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// The first chunked xattr value reaches the disk by a commit that sets the image's
/// feature flag (an older build then refuses the image rather than replay chunks it
/// does not know); later ones go to the log as usual.
#[test]
fn the_first_chunked_xattr_commits_the_feature_flag() {
    let (dev, fs) = mk(64 * MB);
    let flag = crate::format::INCOMPAT_XATTR_CHUNKS;
    let on_disk = |dev: &MemDev| crate::txn::Store::read_super(dev).unwrap().incompat & flag;
    assert_eq!(on_disk(&dev), 0);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.setxattr(f, b"user.small", &[1; 100], false, false)
        .unwrap();
    fs.fsync(f, false).unwrap();
    assert_eq!(on_disk(&dev), 0, "an inline value needs no flag");
    let fallbacks = fs.stats().fallbacks;
    fs.setxattr(f, b"user.big", &pattern(20_000, 1), false, false)
        .unwrap();
    fs.fsync(f, false).unwrap();
    assert_ne!(on_disk(&dev), 0, "the fsync committed the flag");
    assert_eq!(fs.stats().fallbacks, fallbacks + 1);
    fs.setxattr(f, b"user.big2", &pattern(20_000, 2), false, false)
        .unwrap();
    fs.fsync(f, false).unwrap();
    assert_eq!(
        fs.stats().fallbacks,
        fallbacks + 1,
        "later ones go to the log"
    );
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    let fs2 = Fs::open(crashed.clone(), Options::default()).unwrap();
    assert_eq!(fs2.getxattr(f, b"user.big").unwrap(), pattern(20_000, 1));
    assert_eq!(fs2.getxattr(f, b"user.big2").unwrap(), pattern(20_000, 2));
    assert!(problems_after_unmount(&crashed, fs2).is_empty());
    drop(fs);
}

/// A disk filled with many small files in many directories (so the trees are large
/// beside the metadata reserve) still lets every file be deleted, with no commit asked
/// for in between, and the commits that follow succeed.
#[test]
fn a_disk_full_of_small_files_can_be_emptied() {
    for size in [0usize, 1500, 6000] {
        let (dev, fs) = mk(48 * MB);
        const DIRS: u32 = 32;
        let dirs: Vec<u64> = (0..DIRS)
            .map(|d| {
                fs.mkdir(ROOT_INO, format!("d{d}").as_bytes(), 0o755, cr())
                    .unwrap()
                    .ino
            })
            .collect();
        let data = vec![5u8; size];
        let mut n = 0u32;
        'fill: loop {
            let name = format!("f{n:06}");
            let dir = dirs[(n % DIRS) as usize];
            let f = match fs.mknod(dir, name.as_bytes(), 0o644, 0, cr()) {
                Ok(f) => f,
                Err(Error::NoSpace) => break 'fill,
                Err(e) => panic!("mknod {name}: {e}"),
            };
            n += 1;
            if size > 0 {
                match fs.write(f.ino, 0, &data) {
                    Ok(_) => {}
                    Err(Error::NoSpace) => break 'fill,
                    Err(e) => panic!("write {name}: {e}"),
                }
            }
            assert!(n < 1_000_000);
        }
        match fs.commit() {
            Ok(()) | Err(Error::NoSpace) => {}
            Err(e) => panic!("commit of the full disk: {e}"),
        }
        assert!(n > 2000, "only {n} files fit");
        let c0 = fs.stats().commits;
        for i in 0..n {
            let name = format!("f{i:06}");
            let dir = dirs[(i % DIRS) as usize];
            if let Err(e) = fs.unlink(dir, name.as_bytes()) {
                panic!(
                    "{size}-byte files: unlink {name} of {n}: {e}; statfs {:?}",
                    fs.statfs()
                );
            }
        }
        let commits = fs.stats().commits - c0;
        eprintln!("{size}-byte files: {n} deleted with {commits} commits");
        // Short of space, a commit comes when the reserve is reached, not after every
        // deletion.
        assert!(
            commits < u64::from(n) / 10,
            "{commits} commits for {n} deletions"
        );
        for d in 0..DIRS {
            fs.rmdir(ROOT_INO, format!("d{d}").as_bytes()).unwrap();
        }
        fs.commit().unwrap();
        let st = fs.statfs();
        assert!(st.bavail * 4096 > 30 * MB, "space came back: {st:?}");
        assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
    }
}

/// Writes 64 KiB pieces to a new file `f` until a write is refused (no writeback
/// meanwhile); returns its inode and the bytes written.
fn fill_with_cached_writes(fs: &Fs) -> (u64, u64) {
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    let chunk = vec![9u8; 64 << 10];
    let mut off = 0;
    while fs.write(f.ino, off, &chunk).is_ok() {
        off += chunk.len() as u64;
        assert!(off < 1 << 30);
    }
    (f.ino, off)
}

/// Once cached writes fill the disk, statfs shows (about) no space available: what
/// is dirty in the cache counts with the tree margin a write reserves for it.
#[test]
fn statfs_shows_no_room_when_cached_writes_refuse() {
    let (_dev, fs) = mk(64 * MB);
    let (_, off) = fill_with_cached_writes(&fs);
    let st = fs.statfs();
    let dirty = fs.stats().cache_dirty_bytes;
    eprintln!("{off} bytes written, {dirty} dirty; {st:?}");
    assert!(off > 40 * MB, "only {off} bytes fit");
    assert!(
        st.bavail * 4096 < 128 << 10,
        "{} bytes shown available where a 64 KiB write is refused",
        st.bavail * 4096
    );
}

/// Room a cached write reserved stays its own: names created after the disk filled
/// with cached data are refused, and writeback of that data then succeeds.
#[test]
fn cached_writes_keep_their_room_from_later_creates() {
    let (dev, fs) = mk(64 * MB);
    let (f, off) = fill_with_cached_writes(&fs);
    let mut made = 0;
    for n in 0..20_000 {
        match fs.mknod(ROOT_INO, format!("n{n:05}").as_bytes(), 0o644, 0, cr()) {
            Ok(_) => made += 1,
            Err(Error::NoSpace) => break,
            Err(e) => panic!("mknod: {e}"),
        }
    }
    eprintln!("{off} bytes cached, then {made} names");
    fs.fsync(f, false)
        .unwrap_or_else(|e| panic!("writeback after {made} names: {e}"));
    assert_eq!(read_all(&fs, f).len() as u64, off);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// FITRIM discards exactly the free space (what a deleted file held included, once
/// committed) and nothing that is still held: not a live file, not an open unlinked
/// one, not what an fsync logged. All of it reads back after a crash and a remount.
#[test]
fn trim_discards_the_free_space_and_nothing_else() {
    let (dev, fs) = mk(64 * MB);
    let keep = fs.mknod(ROOT_INO, b"keep", 0o644, 0, cr()).unwrap();
    fs.write(keep.ino, 0, &pattern(3 * MB as usize, 1)).unwrap();
    let gone = fs.mknod(ROOT_INO, b"gone", 0o644, 0, cr()).unwrap();
    fs.write(gone.ino, 0, &pattern(4 * MB as usize, 2)).unwrap();
    fs.commit().unwrap();
    let orphan = fs.mknod(ROOT_INO, b"orphan", 0o644, 0, cr()).unwrap();
    fs.open_ino(orphan.ino).unwrap();
    fs.write(orphan.ino, 0, &pattern(2 * MB as usize, 3))
        .unwrap();
    fs.fsync(orphan.ino, false).unwrap();
    fs.unlink(ROOT_INO, b"orphan").unwrap();
    fs.unlink(ROOT_INO, b"gone").unwrap();
    let late = fs.mknod(ROOT_INO, b"late", 0o644, 0, cr()).unwrap();
    fs.write(late.ino, 0, &pattern(MB as usize, 4)).unwrap();
    fs.fsync(late.ino, false).unwrap();

    let free_before = fs.inner.lock().store.alloc.free_bytes();
    let trimmed = fs.trim(0, u64::MAX, 0).unwrap();
    let free = fs.inner.lock().store.alloc.free_bytes();
    assert!(
        trimmed >= free_before + 3 * MB,
        "the deleted file's space was not trimmed: {trimmed} after {free_before} free"
    );
    assert_eq!(trimmed, free, "trimmed other than the free space");
    assert!(trimmed > 40 * MB, "trimmed only {trimmed}");
    let poisoned = dev
        .image()
        .chunks(4096)
        .filter(|b| b.iter().all(|&x| x == crate::dev::DISCARDED))
        .count() as u64;
    assert_eq!(poisoned * 4096, trimmed, "discarded blocks on the device");
    let size = dev.image().len() as u64;
    assert_eq!(
        fs.trim(0, u64::MAX, size).unwrap(),
        0,
        "no free piece that large"
    );
    // What ext4 and XFS refuse (EINVAL): pieces larger than the filesystem, a start
    // past its end, a range shorter than a block.
    for (start, len, min_len) in [
        (0, u64::MAX, size + 1),
        (size, 1 << 20, 0),
        (u64::MAX, u64::MAX, 0),
        (0, 0, 0),
        (0, 4095, 0),
    ] {
        assert!(
            matches!(fs.trim(start, len, min_len), Err(Error::Invalid(_))),
            "trim({start}, {len}, {min_len})"
        );
    }
    // Still readable now, and the space is used again.
    assert_eq!(read_all(&fs, orphan.ino), pattern(2 * MB as usize, 3));
    let new = fs.mknod(ROOT_INO, b"new", 0o644, 0, cr()).unwrap();
    fs.write(new.ino, 0, &pattern(8 * MB as usize, 5)).unwrap();
    fs.fsync(new.ino, false).unwrap();

    // A crash now: the last commit plus the log.
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    let fs2 = Fs::open(crashed.clone(), Options::default()).unwrap();
    for (name, len, seed) in [
        (&b"keep"[..], 3 * MB, 1),
        (b"late", MB, 4),
        (b"new", 8 * MB, 5),
    ] {
        let a = fs2.lookup(ROOT_INO, name).unwrap();
        assert_eq!(read_all(&fs2, a.ino), pattern(len as usize, seed));
    }
    assert!(fs2.lookup(ROOT_INO, b"gone").is_err());
    assert_eq!(problems_after_unmount(&crashed, fs2), Vec::<String>::new());
    // And after a clean unmount.
    fs.release(orphan.ino).unwrap();
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

/// Online discard: each commit discards the runs of at least the minimum among what
/// it freed (a deleted file's blocks, an unlinked file's once closed), and nothing
/// that is still held or shorter (an open unlinked file, one block freed by an
/// overwrite). Everything reads back after a crash and a remount.
#[test]
fn online_discard_discards_what_a_commit_freed_and_nothing_else() {
    let dev = Arc::new(MemDev::new(64 * MB));
    Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let opts = Options {
        discard: Some(MB),
        ..Options::default()
    };
    let fs = Fs::open(dev.clone(), opts.clone()).unwrap();
    let poisoned = |dev: &MemDev| {
        dev.image()
            .chunks(4096)
            .filter(|b| b.iter().all(|&x| x == crate::dev::DISCARDED))
            .count() as u64
            * 4096
    };
    let discarded = |fs: &Fs| fs.stats().dev_discarded_bytes;
    let keep = fs.mknod(ROOT_INO, b"keep", 0o644, 0, cr()).unwrap();
    fs.write(keep.ino, 0, &pattern(3 * MB as usize, 1)).unwrap();
    let gone = fs.mknod(ROOT_INO, b"gone", 0o644, 0, cr()).unwrap();
    fs.write(gone.ino, 0, &pattern(4 * MB as usize, 2)).unwrap();
    let orphan = fs.mknod(ROOT_INO, b"orphan", 0o644, 0, cr()).unwrap();
    fs.open_ino(orphan.ino).unwrap();
    fs.write(orphan.ino, 0, &pattern(2 * MB as usize, 3))
        .unwrap();
    fs.commit().unwrap();
    // (Tree nodes copied on write free runs far below the minimum.)
    assert_eq!(discarded(&fs), 0, "discarded with no file data freed");

    fs.unlink(ROOT_INO, b"orphan").unwrap();
    fs.unlink(ROOT_INO, b"gone").unwrap();
    fs.commit().unwrap();
    let after_delete = discarded(&fs);
    // (A tree node freed next to the file's blocks may join their run.)
    assert!(
        (4 * MB..5 * MB).contains(&after_delete),
        "the deleted file's 4 MiB, not the open one's: {after_delete}"
    );
    assert_eq!(
        poisoned(&dev),
        after_delete,
        "discarded blocks on the device"
    );
    assert_eq!(read_all(&fs, keep.ino), pattern(3 * MB as usize, 1));
    assert_eq!(read_all(&fs, orphan.ino), pattern(2 * MB as usize, 3));

    // One block copied on write frees one block: below the minimum.
    fs.write(keep.ino, MB, &pattern(4096, 7)).unwrap();
    fs.commit().unwrap();
    assert_eq!(discarded(&fs), after_delete, "a 4 KiB run was discarded");

    // A crash now, and after it the data of both live files.
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    let fs2 = Fs::open(crashed.clone(), Options::default()).unwrap();
    let mut want = pattern(3 * MB as usize, 1);
    want[MB as usize..MB as usize + 4096].copy_from_slice(&pattern(4096, 7));
    let a = fs2.lookup(ROOT_INO, b"keep").unwrap();
    assert_eq!(read_all(&fs2, a.ino), want);
    assert!(fs2.lookup(ROOT_INO, b"gone").is_err());
    assert_eq!(problems_after_unmount(&crashed, fs2), Vec::<String>::new());

    // Closed, the unlinked file's space goes at the next commit.
    fs.release(orphan.ino).unwrap();
    fs.commit().unwrap();
    assert!(
        discarded(&fs) >= after_delete + 2 * MB,
        "the closed file's space was not discarded: {}",
        discarded(&fs)
    );
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
    let fs = Fs::open(dev.clone(), opts).unwrap();
    let a = fs.lookup(ROOT_INO, b"keep").unwrap();
    assert_eq!(read_all(&fs, a.ino), want);
}

/// A read-only mount trims nothing.
#[test]
fn trim_is_refused_read_only() {
    let (dev, fs) = mk(64 * MB);
    fs.unmount().unwrap();
    let ro = Fs::open(
        dev.clone(),
        Options {
            readonly: true,
            ..Options::default()
        },
    )
    .unwrap();
    assert!(matches!(ro.trim(0, u64::MAX, 0), Err(Error::ReadOnly)));
}

/// A fresh file system of `size` bytes, mounted on a crash-recording device.
fn on_crash_dev(size: u64) -> (Arc<crate::dev::CrashDev>, Fs) {
    on_crash_dev_with(size, &MkfsOptions::default(), Options::default())
}

/// [`on_crash_dev`], made with `mkfs` and mounted with `opts`.
fn on_crash_dev_with(
    size: u64,
    mkfs: &MkfsOptions,
    opts: Options,
) -> (Arc<crate::dev::CrashDev>, Fs) {
    let (mem, fs) = mk_with(size, mkfs);
    fs.unmount().unwrap();
    let dev = Arc::new(crate::dev::CrashDev::new(mem.image()));
    let fs = Fs::open(dev.clone(), opts).unwrap();
    (dev, fs)
}

/// Where `fs`'s log area ends: past it lie the blocks a sparse image has as holes.
fn past_log(fs: &Fs) -> u64 {
    let g = fs.inner.lock();
    g.store.sb.log_start + g.store.sb.log_len
}

/// A file system on a crash-recording device whose flushes take `delay`, with two
/// files whose fsyncs are logged (not yet written): their targets.
fn two_logged_fsyncs(delay: std::time::Duration) -> (Arc<crate::dev::CrashDev>, Arc<Fs>, u64, u64) {
    let (dev, fs) = on_crash_dev(64 * MB);
    let fs = Arc::new(fs);
    let a = fs.mknod(ROOT_INO, b"a", 0o644, 0, cr()).unwrap();
    let b = fs.mknod(ROOT_INO, b"b", 0o644, 0, cr()).unwrap();
    fs.write(a.ino, 0, &pattern(5000, 1)).unwrap();
    fs.write(b.ino, 0, &pattern(5000, 2)).unwrap();
    let ta = fs.fsync_target(a.ino, false).unwrap().unwrap();
    let tb = fs.fsync_target(b.ino, false).unwrap().unwrap();
    dev.set_flush_delay(delay);
    (dev, fs, ta, tb)
}

/// With two group commits at once (as over io_uring), the one whose records the
/// other's batch already wrote waits for the other's flush, under way, instead of
/// flushing again, and returns only once that flush has returned.
#[test]
fn an_fsync_shares_a_flush_under_way_that_covers_it() {
    let (dev, fs, ta, tb) = two_logged_fsyncs(std::time::Duration::from_millis(200));
    let (flushes, shared) = (fs.stats().flushes, fs.stats().log_flushes_shared);
    let recorded = dev.flush_covers().len();
    let t = {
        let fs = fs.clone();
        std::thread::spawn(move || fs.sync_to(tb))
    };
    // Whichever comes first writes both records and flushes; the other waits for it.
    std::thread::sleep(std::time::Duration::from_millis(50));
    fs.sync_to(ta).unwrap();
    assert!(
        dev.flush_covers().len() > recorded,
        "answered before the flush returned"
    );
    t.join().unwrap().unwrap();
    assert_eq!(fs.stats().flushes - flushes, 1, "flushed twice");
    assert_eq!(fs.stats().log_flushes_shared - shared, 1);
    assert_eq!(dev.flush_covers().len(), recorded + 1);
}

/// When the flush it waits for fails, an fsync does not wait forever, and fails
/// too, though the device works again (as Linux's fdatasync reports a lost write
/// once): a second flush would return 0 with the batch lost. From then on nothing
/// counts as durable, and changes are refused until the next mount.
#[test]
fn an_fsync_waiting_on_a_failed_flush_fails_too() {
    let (dev, fs, ta, tb) = two_logged_fsyncs(std::time::Duration::from_millis(200));
    let flushes = dev.flush_points().len();
    let t = {
        let fs = fs.clone();
        std::thread::spawn(move || fs.sync_to(tb))
    };
    std::thread::sleep(std::time::Duration::from_millis(50));
    // The flush under way fails when it returns; later ones would succeed.
    dev.fail_flushes(1);
    // Whichever of the two flushed, neither is durable.
    assert!(fs.sync_to(ta).is_err(), "a durable after the flush failed");
    assert!(
        t.join().unwrap().is_err(),
        "b durable after the flush failed"
    );
    assert_eq!(fs.stats().log_flushes_shared, 0);
    assert_eq!(dev.flush_points().len(), flushes, "flushed again");
    let e = fs.mknod(ROOT_INO, b"c", 0o644, 0, cr()).unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(fs.commit().is_err(), "committed after a failed flush");
}

/// A commit the device refuses for want of space (a full host under a sparse image)
/// changes nothing on the disk and loses nothing: the commit is kept, the mount goes
/// on taking changes, fsyncs commit (and fail) until there is room, and then one
/// commit writes it all. A crash at any flush point on the way leaves every fsync
/// answered before it, and a clean image.
#[test]
fn a_commit_refused_for_want_of_space_is_written_with_the_next() {
    let (dev, fs) = on_crash_dev(64 * MB);
    let a = fs.mknod(ROOT_INO, b"a", 0o644, 0, cr()).unwrap();
    fs.write(a.ino, 0, &pattern(3 * MB as usize, 1)).unwrap();
    fs.fsync(a.ino, false).unwrap();
    let a_acked = dev.op_count();

    // The host fills up: only the (preallocated) log area still takes writes.
    dev.refuse_writes_from(Some(past_log(&fs)));
    let b = fs.mknod(ROOT_INO, b"b", 0o644, 0, cr()).unwrap();
    fs.write(b.ino, 0, &pattern(MB as usize, 2)).unwrap();
    fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap();
    let e = fs.commit().unwrap_err();
    assert!(
        matches!(&e, Error::Io(io) if io.raw_os_error() == Some(libc::ENOSPC)),
        "{e}"
    );
    assert_eq!(fs.stats().commits_deferred, 1);
    // Still taking changes, and everything reads back.
    let c = fs.mknod(ROOT_INO, b"c", 0o644, 0, cr()).unwrap();
    fs.write(c.ino, 0, b"small").unwrap();
    fs.rename(ROOT_INO, b"d", ROOT_INO, b"dir", RenameFlags::default())
        .unwrap();
    assert!(fs.fsync(b.ino, false).is_err(), "fsynced with no room");
    assert!(fs.fsync(c.ino, false).is_err(), "fsynced with no room");
    // An fsync with no data to write (the directory's rename) may not go through the
    // log either: it commits, and that fails again.
    let fallbacks = fs.stats().fallbacks;
    assert!(fs.fsync(ROOT_INO, false).is_err(), "fsynced with no room");
    assert_eq!(fs.stats().commits_deferred, 2);
    assert_eq!(fs.stats().fallbacks, fallbacks + 1);
    assert_eq!(read_all(&fs, a.ino), pattern(3 * MB as usize, 1));
    assert_eq!(read_all(&fs, b.ino), pattern(MB as usize, 2));

    // Room again: the next fsync commits everything, and so does unmount.
    dev.refuse_writes_from(None);
    fs.fsync(c.ino, false).unwrap();
    let all_acked = dev.op_count();
    fs.write(b.ino, MB, &pattern(4096, 3)).unwrap();
    fs.commit().unwrap();

    let mut b_after = pattern(MB as usize, 2);
    b_after.extend(pattern(4096, 3));
    let points = dev.flush_points();
    assert!(points.len() > 4, "flush points: {points:?}");
    for p in points.into_iter().filter(|&p| p >= a_acked) {
        let img = Arc::new(MemDev::from_image(dev.image_with(p, &[])));
        let fs2 = Fs::open(img.clone(), Options::default())
            .unwrap_or_else(|e| panic!("crash after op {p}: {e}"));
        let a2 = fs2.lookup(ROOT_INO, b"a").unwrap();
        assert_eq!(
            read_all(&fs2, a2.ino),
            pattern(3 * MB as usize, 1),
            "op {p}"
        );
        if p >= all_acked {
            let b2 = fs2.lookup(ROOT_INO, b"b").unwrap();
            let got = read_all(&fs2, b2.ino);
            // b's own fsync failed: its data (still cached then) need not be there.
            assert!(
                got.is_empty() || got == pattern(MB as usize, 2) || got == b_after,
                "crash after op {p}: b has {} bytes",
                got.len()
            );
            let c2 = fs2.lookup(ROOT_INO, b"c").unwrap();
            assert_eq!(read_all(&fs2, c2.ino), b"small", "op {p}");
            assert!(fs2.lookup(ROOT_INO, b"dir").is_ok(), "op {p}");
        }
        assert_eq!(
            problems_after_unmount(&img, fs2),
            Vec::<String>::new(),
            "crash after op {p}"
        );
    }
    fs.unmount().unwrap();
    let img = Arc::new(MemDev::from_image(dev.live_image()));
    let fs2 = Fs::open(img.clone(), Options::default()).unwrap();
    let b2 = fs2.lookup(ROOT_INO, b"b").unwrap();
    assert_eq!(read_all(&fs2, b2.ino), b_after);
    assert_eq!(problems_after_unmount(&img, fs2), Vec::<String>::new());
}

/// On a full disk an operation commits by itself to give back pinned space; when the
/// host refuses that commit, the operation (done in memory) still succeeds, and what
/// it did is written with the next commit once there is room.
#[test]
fn an_operation_whose_own_commit_is_refused_succeeds() {
    let (dev, fs) = on_crash_dev(48 * MB);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap().ino;
    const N: u32 = 3000;
    for n in 0..N {
        fs.mknod(d, format!("f{n:05}").as_bytes(), 0o644, 0, cr())
            .unwrap();
    }
    // Cached writes keep a margin for their tree changes until written back: fill
    // again what is left after each commit.
    let (big, mut off) = fill_with_cached_writes(&fs);
    for _ in 0..3 {
        fs.commit().unwrap();
        while fs.write(big, off, &[7u8; 4096]).is_ok() {
            off += 4096;
        }
    }
    fs.commit().unwrap();
    assert!(fs.statfs().bavail < 16, "{:?}", fs.statfs());

    dev.refuse_writes_from(Some(past_log(&fs)));
    let mut gone = 0;
    while fs.stats().commits_deferred == 0 {
        assert!(gone < N, "no commit of its own after {gone} deletions");
        fs.unlink(d, format!("f{gone:05}").as_bytes())
            .unwrap_or_else(|e| panic!("unlink {gone} with its commit refused: {e}"));
        gone += 1;
    }
    assert_eq!(fs.stats().commits_deferred, 1);
    // For a while after the refusal operations do not commit by themselves (each
    // commit would write everything kept, to be refused again); they go on until
    // the space they pin runs out.
    let t0 = std::time::Instant::now();
    for _ in 0..300 {
        match fs.unlink(d, format!("f{gone:05}").as_bytes()) {
            Ok(()) => gone += 1,
            Err(e) if e.errno() == libc::ENOSPC => break,
            Err(e) => panic!("unlink {gone} after a refused commit: {e}"),
        }
    }
    if t0.elapsed() < REFUSED_COMMIT_PAUSE {
        assert_eq!(fs.stats().commits_deferred, 1);
    }
    assert!(fs.lookup(d, b"f00000").is_err());

    dev.refuse_writes_from(None);
    fs.unmount().unwrap();
    let img = Arc::new(MemDev::from_image(dev.live_image()));
    let fs2 = Fs::open(img.clone(), Options::default()).unwrap();
    for n in 0..N {
        let there = fs2.lookup(d, format!("f{n:05}").as_bytes()).is_ok();
        assert_eq!(there, n >= gone, "f{n:05} after {gone} deletions");
    }
    assert!(!read_all(&fs2, big).is_empty());
    assert_eq!(problems_after_unmount(&img, fs2), Vec::<String>::new());
}

/// The commit that writes a refused one does not let fsyncs go on through the log
/// while it is written (a crash before its superblock would leave their batches two
/// generations past the disk's commit, where replay does not look): an fsync made
/// meanwhile waits for it, and a crash at any moment after that fsync returned keeps
/// its file.
#[test]
fn fsyncs_wait_for_the_commit_that_writes_a_refused_one() {
    let (dev, fs) = on_crash_dev(64 * MB);
    dev.refuse_writes_from(Some(past_log(&fs)));
    let fs = Arc::new(fs);
    let x = fs.mknod(ROOT_INO, b"x", 0o644, 0, cr()).unwrap();
    fs.write(x.ino, 0, &pattern(64 << 10, 1)).unwrap();
    assert!(fs.commit().is_err());
    assert_eq!(fs.stats().commits_deferred, 1);

    dev.refuse_writes_from(None);
    dev.set_flush_delay(std::time::Duration::from_millis(100));
    let committer = {
        let fs = fs.clone();
        std::thread::spawn(move || fs.commit())
    };
    // While the commit's first flush runs: a new file, fsynced.
    std::thread::sleep(std::time::Duration::from_millis(30));
    let y = fs.mknod(ROOT_INO, b"y", 0o644, 0, cr()).unwrap();
    fs.write(y.ino, 0, b"fsynced while a refused commit was written")
        .unwrap();
    fs.fsync(y.ino, false).unwrap();
    let acked = dev.op_count();
    committer.join().unwrap().unwrap();
    dev.set_flush_delay(std::time::Duration::ZERO);

    // What is durable after each flush: every write before the latest start of a
    // flush that has returned.
    let mut durable = 0;
    let mut states = Vec::new();
    for (point, covers) in dev.flush_covers() {
        durable = durable.max(covers);
        states.push((point, durable));
    }
    let first = states
        .iter()
        .rposition(|&(point, _)| point <= acked)
        .expect("the fsync flushed");
    for &(point, upto) in &states[first..] {
        let img = Arc::new(MemDev::from_image(dev.image_with(upto, &[])));
        let fs2 = Fs::open(img.clone(), Options::default())
            .unwrap_or_else(|e| panic!("crash after op {point}: {e}"));
        let y2 = fs2
            .lookup(ROOT_INO, b"y")
            .unwrap_or_else(|e| panic!("crash after op {point}: y: {e}"));
        assert_eq!(
            read_all(&fs2, y2.ino),
            b"fsynced while a refused commit was written",
            "crash after op {point}"
        );
        assert_eq!(
            problems_after_unmount(&img, fs2),
            Vec::<String>::new(),
            "crash after op {point}"
        );
    }
}

/// A full filesystem grown onto a larger device: the new space takes data, the
/// superblock copy at 64 MiB that now fits is written, check finds it all clean, and
/// what was there before is intact. It never shrinks.
#[test]
fn a_grown_filesystem_uses_the_new_space_and_checks_clean() {
    let (dev, fs) = mk(48 * MB);
    let f = fs.mknod(ROOT_INO, b"before", 0o644, 0, cr()).unwrap();
    let chunk = pattern(64 << 10, 5);
    let mut off = 0;
    while fs.write(f.ino, off, &chunk).is_ok() {
        off += chunk.len() as u64;
        assert!(off < 100 * MB);
    }
    fs.commit().unwrap();
    let full = off;
    let blocks_before = fs.statfs().blocks;
    fs.unmount().unwrap();

    // The device grows (as an image file does under `truncate -s`).
    let mut image = dev.image();
    image.resize((200 * MB) as usize, 0);
    let dev = Arc::new(MemDev::from_image(image));
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    assert!(matches!(fs.grow(40 * MB), Err(Error::Invalid(_))));
    fs.grow(200 * MB).unwrap();
    assert!(fs.statfs().blocks >= blocks_before + (150 * MB) / 4096);
    let g = fs.mknod(ROOT_INO, b"after", 0o644, 0, cr()).unwrap();
    let more = pattern((100 * MB) as usize, 9);
    fs.write(g.ino, 0, &more).unwrap();
    fs.commit().unwrap();
    fs.unmount().unwrap();

    assert_eq!(check_image(&dev), Vec::<String>::new());
    let sb = Fs::superblock_of(dev.as_ref()).unwrap();
    assert_eq!(sb.total_bytes, 200 * MB);
    let mut copy = vec![0u8; crate::format::SUPER_SIZE];
    dev.read_at(&mut copy, 64 * MB).unwrap();
    let second = crate::format::Superblock::decode(&copy, 64 * MB).unwrap();
    assert_eq!(second.generation, sb.generation);
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    let f = fs.lookup_nopin(ROOT_INO, b"before").unwrap();
    let got = fs.read(f.ino, 0, full as u32).unwrap();
    assert!(
        got.chunks(chunk.len()).all(|c| c == chunk),
        "before changed"
    );
    assert!(read_all(&fs, fs.lookup_nopin(ROOT_INO, b"after").unwrap().ino) == more);
    fs.unmount().unwrap();
}

/// A power cut anywhere in a grow leaves the filesystem at its old size or its new
/// one, whole: at every write of the grow's commit, the image as far as it got (each
/// write before it landed, none after) opens, checks clean and holds what was fsynced.
#[test]
fn a_power_cut_during_a_grow_leaves_the_old_size_or_the_new() {
    let (mem, fs) = mk(48 * MB);
    let a = fs.mknod(ROOT_INO, b"a", 0o644, 0, cr()).unwrap();
    let data = pattern(3 << 20, 4);
    fs.write(a.ino, 0, &data).unwrap();
    fs.fsync(a.ino, false).unwrap();
    fs.unmount().unwrap();
    let mut image = mem.image();
    image.resize((200 * MB) as usize, 0);
    let dev = Arc::new(crate::dev::CrashDev::new(image));
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    // A device that cannot be lengthened (as a block device) refuses a larger size.
    assert!(matches!(fs.grow(300 * MB), Err(Error::Invalid(_))));
    let start = dev.op_count();
    fs.grow(200 * MB).unwrap();
    drop(fs);
    let end = dev.op_count();
    // The superblocks go out after the commit's nodes are flushed, in any order: the
    // first copy (the new size) may land alone.
    let points = dev.flush_points();
    let nodes_flushed = points[points.len() - 2];
    let primary = dev.live_image()[(64 << 10)..(64 << 10) + crate::format::SUPER_SIZE].to_vec();
    let mut sizes = std::collections::BTreeSet::new();
    let cuts = (start..=end)
        .map(|upto| (upto, vec![]))
        .chain((nodes_flushed..end).map(|upto| (upto, vec![(64u64 << 10, &primary[..])])));
    for (upto, extra) in cuts {
        let img = MemDev::from_image(dev.image_with(upto, &extra));
        let problems = crate::check::check(&img).unwrap().problems;
        assert!(problems.is_empty(), "cut at op {upto}: {problems:?}");
        let fs = Fs::open(Arc::new(img), Options::default()).unwrap();
        sizes.insert(fs.inner.lock().store.sb.total_bytes);
        let a = fs.lookup_nopin(ROOT_INO, b"a").unwrap();
        assert!(read_all(&fs, a.ino) == data, "cut at op {upto}: a differs");
        drop(fs);
    }
    assert_eq!(
        sizes.into_iter().collect::<Vec<_>>(),
        vec![48 * MB, 200 * MB]
    );
}

/// A log batch that names blocks past the filesystem's size is damage (no batch of
/// this size can): check and restore report it, replay stops before it, and what
/// the batches before it hold is there, in trees that check clean.
#[test]
fn replay_stops_at_a_batch_naming_blocks_past_the_size() {
    let (mem, fs) = mk(96 * MB);
    fs.commit().unwrap();
    fs.unmount().unwrap();
    let dev = Arc::new(crate::dev::CrashDev::new(mem.image()));
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    // a's data takes the first 32 MiB and more: the smallest size ends past it.
    let (da, db) = (pattern(32 << 20, 1), pattern(24 << 20, 2));
    let a = fs.mknod(ROOT_INO, b"a", 0o644, 0, cr()).unwrap().ino;
    fs.write(a, 0, &da).unwrap();
    fs.fsync(a, false).unwrap();
    let b = fs.mknod(ROOT_INO, b"b", 0o644, 0, cr()).unwrap().ino;
    fs.write(b, 0, &db).unwrap();
    fs.fsync(b, false).unwrap();
    let end = |ino| {
        let m = fs.extent_map(ino).unwrap();
        (
            m.iter().map(|e| e.disk_addr).min().unwrap(),
            m.iter().map(|e| e.disk_addr + e.len).max().unwrap(),
        )
    };
    let ((_, a_end), (b_start, b_end)) = (end(a), end(b));
    assert!(a_end <= b_start, "b's data is not past a's");
    // The crash: every write landed, nothing committed since the first commit. Then
    // the superblock says the filesystem ends halfway through b's data.
    let mut image = dev.live_image();
    drop(fs);
    let img = MemDev::from_image(image.clone());
    let mut sb = crate::txn::Store::read_super(&img).unwrap();
    sb.total_bytes = ((b_start + b_end) / 2) & !(BS - 1);
    for off in crate::format::SUPER_OFFSETS {
        if off + crate::format::SUPER_SIZE as u64 <= image.len() as u64 {
            let bytes = sb.encode(off);
            image[off as usize..off as usize + bytes.len()].copy_from_slice(&bytes);
        }
    }
    let img = Arc::new(MemDev::from_image(image));
    let problems = crate::check::check(img.as_ref()).unwrap().problems;
    assert!(
        problems.len() == 1 && problems[0].contains("damaged"),
        "check does not report the damaged batch alone: {problems:?}"
    );
    // Restore takes a's file from the batch before and reports the damaged one.
    let tmp = tempfile::tempdir().unwrap();
    let rep = crate::restore::restore(
        img.as_ref(),
        &tmp.path().join("r"),
        &crate::restore::RestoreOptions::default(),
    )
    .unwrap();
    assert!(
        rep.problems.len() == 1 && rep.problems[0].contains("damaged"),
        "restore does not report the damaged batch alone: {:?}",
        rep.problems
    );
    assert!(std::fs::read(tmp.path().join("r/a")).unwrap() == da);
    assert!(
        !tmp.path().join("r/b").exists(),
        "restore replayed b's batch"
    );
    let fs = Fs::open(img.clone(), Options::default()).unwrap();
    let a = fs.lookup_nopin(ROOT_INO, b"a").unwrap().ino;
    assert!(read_all(&fs, a) == da, "a, logged before, differs");
    assert!(
        matches!(fs.lookup_nopin(ROOT_INO, b"b"), Err(Error::NotFound)),
        "the batch past the size was replayed"
    );
    let problems = problems_after_unmount(&img, fs);
    assert!(problems.is_empty(), "{problems:?}");
}

/// A 32 MiB filesystem holding empty files `first` (their inodes returned) and a file
/// `big` that fills it, mounted on a 48 MiB crash-testing device it can grow into.
fn full_with_room_to_grow(first: &[&[u8]]) -> (Arc<crate::dev::CrashDev>, Arc<Fs>, Vec<u64>) {
    let (mem, fs) = mk(32 * MB);
    let made = first
        .iter()
        .map(|n| fs.mknod(ROOT_INO, n, 0o644, 0, cr()).unwrap().ino)
        .collect();
    let big = fs.mknod(ROOT_INO, b"big", 0o644, 0, cr()).unwrap().ino;
    let chunk = pattern(64 << 10, 1);
    let mut off = 0;
    while fs.write(big, off, &chunk).is_ok() {
        off += chunk.len() as u64;
    }
    fs.unmount().unwrap();
    let mut image = mem.image();
    image.resize((48 * MB) as usize, 0);
    let dev = Arc::new(crate::dev::CrashDev::new(image));
    let fs = Arc::new(Fs::open(dev.clone(), Options::default()).unwrap());
    (dev, fs, made)
}

/// A grow's commit keeps the log to itself until it lands: an fsync of data that only
/// the new space holds, made while that commit is written, waits for it. (A batch
/// written before the new size is durable would name blocks past the old end, which a
/// replay on the old size cannot take.) A power cut at any write from the grow on
/// leaves an image that checks clean, with the file whole once its fsync returned.
#[test]
fn an_fsync_of_data_in_the_new_space_waits_for_the_grows_commit() {
    let (dev, fs, made) = full_with_room_to_grow(&[b"new"]);
    let new = made[0];
    // More than the old size has free (its metadata reserve): some of it goes past
    // the old end.
    let data = pattern(8 << 20, 2);
    assert!(
        matches!(fs.write(new, 0, &data), Err(Error::NoSpace)),
        "the filesystem is not full"
    );
    let start = dev.op_count();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let early = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let syncer = Arc::new(parking_lot::Mutex::new(None));
    *fs.commit_hook.lock() = {
        let (weak, dev, data) = (Arc::downgrade(&fs), dev.clone(), data.clone());
        let (early, syncer) = (early.clone(), syncer.clone());
        let done_rx = std::sync::Mutex::new(done_rx);
        Some(Arc::new(move |_| {
            let Some(fs) = weak.upgrade() else { return };
            if syncer.lock().is_some() {
                return;
            }
            let (done_tx, dev, data) = (done_tx.clone(), dev.clone(), data.clone());
            *syncer.lock() = Some(std::thread::spawn(move || {
                fs.write(new, 0, &data)?;
                fs.fsync(new, false)?;
                let _ = done_tx.send(());
                Ok::<_, Error>(dev.op_count())
            }));
            let r = done_rx
                .lock()
                .unwrap()
                .recv_timeout(std::time::Duration::from_millis(500));
            early.store(r.is_ok(), std::sync::atomic::Ordering::Relaxed);
        }))
    };
    fs.grow(48 * MB).unwrap();
    *fs.commit_hook.lock() = None;
    let synced_at = syncer
        .lock()
        .take()
        .expect("the grow made no commit")
        .join()
        .unwrap()
        .unwrap();
    assert!(
        !early.load(std::sync::atomic::Ordering::Relaxed),
        "an fsync wrote the log while the grow's commit was in flight"
    );
    let end = dev.op_count();
    let past_old_end = fs
        .extent_map(new)
        .unwrap()
        .iter()
        .any(|e| e.disk_addr + e.len > 32 * MB);
    assert!(past_old_end, "none of the data went to the new space");
    drop(fs);
    for upto in start..=end {
        let img = Arc::new(MemDev::from_image(dev.image_with(upto, &[])));
        let problems = crate::check::check(img.as_ref()).unwrap().problems;
        assert!(problems.is_empty(), "cut at op {upto}: {problems:?}");
        let fs = Fs::open(img.clone(), Options::default()).unwrap();
        if upto >= synced_at {
            assert!(read_all(&fs, new) == data, "cut at op {upto}: new differs");
        }
        // What the log replayed is in the trees now, and within the size.
        let problems = problems_after_unmount(&img, fs);
        assert!(
            problems.is_empty(),
            "cut at op {upto}, replayed: {problems:?}"
        );
    }
}

/// A grow of a full filesystem in use (`birchfs resize` of a mount) while another
/// thread, refused for want of space, keeps trying to write and fsync files until the
/// new space takes them: a power cut after any flush, or at any write while the grow
/// runs, leaves an image that checks clean, at the old size or the new, with every
/// file whose fsync had returned whole.
#[test]
fn a_power_cut_during_a_grow_in_use_keeps_every_fsynced_file() {
    let (dev, fs, _) = full_with_room_to_grow(&[]);
    let start = dev.op_count();
    let (refused, was_refused) = std::sync::mpsc::channel();
    let writer = {
        let (fs, dev) = (fs.clone(), dev.clone());
        std::thread::spawn(move || {
            let mut done = Vec::new();
            let mut tries = 0;
            let mut retry = || {
                let _ = refused.send(());
                tries += 1;
                assert!(tries < 20_000, "no room came");
                std::thread::sleep(std::time::Duration::from_micros(200));
            };
            for i in 0..16u8 {
                let name = format!("f{i}");
                let f = loop {
                    match fs.mknod(ROOT_INO, name.as_bytes(), 0o644, 0, cr()) {
                        Ok(f) => break f,
                        Err(_) => retry(),
                    }
                };
                let data = pattern(256 << 10, i);
                while fs
                    .write(f.ino, 0, &data)
                    .and_then(|_| fs.fsync(f.ino, false))
                    .is_err()
                {
                    retry();
                }
                done.push((name, i, dev.op_count()));
            }
            done
        })
    };
    was_refused.recv().unwrap();
    let grow_from = dev.op_count();
    fs.grow(48 * MB).unwrap();
    let grow_to = dev.op_count();
    let done = writer.join().unwrap();
    let end = dev.op_count();
    drop(fs);
    let mut sizes = std::collections::BTreeSet::new();
    // Every state a flush leaves, and every write of the grow and beside it.
    let cuts: std::collections::BTreeSet<usize> = dev
        .flush_points()
        .into_iter()
        .filter(|&p| p >= start)
        .chain(grow_from..=grow_to)
        .chain([start, end])
        .collect();
    for upto in cuts {
        let img = MemDev::from_image(dev.image_with(upto, &[]));
        let problems = crate::check::check(&img).unwrap().problems;
        assert!(problems.is_empty(), "cut at op {upto}: {problems:?}");
        let fs = Fs::open(Arc::new(img), Options::default()).unwrap();
        sizes.insert(fs.inner.lock().store.sb.total_bytes);
        for (name, seed, at) in done.iter().filter(|d| d.2 <= upto) {
            let f = fs.lookup_nopin(ROOT_INO, name.as_bytes()).unwrap();
            assert!(
                read_all(&fs, f.ino) == pattern(256 << 10, *seed),
                "cut at op {upto}: {name}, fsynced by op {at}, differs"
            );
        }
    }
    assert_eq!(
        sizes.into_iter().collect::<Vec<_>>(),
        vec![32 * MB, 48 * MB]
    );
}

/// Damage a test makes: the file extent item of `f` at file offset 0, edited by
/// `change`, goes back at file offset `at`.
fn rewrite_first_extent(fs: &Fs, f: u64, at: u64, change: impl Fn(&mut crate::format::FileExtent)) {
    use zerocopy::{FromBytes, IntoBytes};
    let key = Key::new(f, kind::EXTENT_DATA, 0);
    fs.with(|i| {
        let (k, v) = i.store.seek_le(tree::FS, &key)?.unwrap();
        assert_eq!(k, key);
        let mut fe = crate::format::FileExtent::read_from_bytes(&v).unwrap();
        change(&mut fe);
        i.store.delete(tree::FS, &key)?;
        let at = Key::new(f, kind::EXTENT_DATA, at);
        i.store.insert(tree::FS, at, fe.as_bytes().to_vec())
    })
    .unwrap();
}

/// A file extent off block boundaries (a damaged or hostile image: no write makes
/// one) fails a read of it with EIO; nothing panics, and other files still read.
#[test]
fn a_file_extent_off_block_boundaries_fails_its_read() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    let g = fs.mknod(ROOT_INO, b"g", 0o644, 0, cr()).unwrap().ino;
    let data = pattern(4 * BS as usize, 5);
    fs.write(f, 0, &data).unwrap();
    fs.write(g, 0, &data).unwrap();
    fs.commit().unwrap();
    // f's extent, moved one byte on in the file (key) and two into the disk extent.
    rewrite_first_extent(&fs, f, 1, |fe| {
        fe.offset = 2.into();
        fe.num_bytes = (2 * BS).into();
    });
    fs.unmount().unwrap();
    let img = Arc::new(MemDev::from_image(dev.image()));
    let problems = crate::check::check(img.as_ref()).unwrap().problems;
    assert!(
        problems
            .iter()
            .any(|p| p.contains("not on block boundaries")),
        "{problems:?}"
    );
    let fs = Fs::open(img, Options::default()).unwrap();
    for off in [0, BS, 2 * BS] {
        let r = fs.read(f, off, BS as u32);
        assert!(
            matches!(r, Err(Error::Corrupt { .. })),
            "read at {off}: {r:?}"
        );
    }
    assert!(read_all(&fs, g) == data, "g differs");
}

/// A log batch inserting an item larger than a node holds is damage (no batch can):
/// check reports it, replay stops before it, and the mount goes on to commit and
/// unmount, leaving trees that check clean.
#[test]
fn replay_stops_at_a_batch_inserting_an_item_no_node_holds() {
    let (mem, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.commit().unwrap();
    fs.unmount().unwrap();
    let mut image = mem.image();
    let sb = crate::txn::Store::read_super(&MemDev::from_image(image.clone())).unwrap();
    let mut log = crate::log::LogBuffer::new(sb.log_len, sb.log_head);
    log.enabled = true;
    log.record(crate::log::LogOp::Insert {
        tree: tree::FS,
        key: Key::new(f, kind::XATTR_ITEM, 7),
        val: vec![0xee; 20_000],
    });
    let b = log.take_batch(&sb.fsid, sb.generation + 1).unwrap();
    let at = (sb.log_start + b.offset) as usize;
    image[at..at + b.buf.len()].copy_from_slice(&b.buf);
    let img = Arc::new(MemDev::from_image(image));
    let problems = crate::check::check(img.as_ref()).unwrap().problems;
    assert!(
        problems.len() == 1 && problems[0].contains("damaged"),
        "check does not report the damaged batch alone: {problems:?}"
    );
    let fs = Fs::open(img.clone(), Options::default()).unwrap();
    assert_eq!(fs.getattr(f).unwrap().size, 0);
    fs.write(f, 0, b"after").unwrap();
    fs.commit().unwrap();
    fs.unmount().unwrap();
    let problems = crate::check::check(img.as_ref()).unwrap().problems;
    assert!(problems.is_empty(), "{problems:?}");
}

/// The store refuses an item larger than a node holds, with an error, before the
/// tree or the log takes it.
#[test]
fn the_store_refuses_an_item_no_node_holds() {
    let (_, fs) = mk(64 * MB);
    let max = fs.with(|i| Ok(i.store.max_item_size())).unwrap();
    let key = Key::new(ROOT_INO, kind::XATTR_ITEM, 7);
    let r = fs.with(|i| i.store.insert(tree::FS, key, vec![1; max + 1]));
    assert!(matches!(r, Err(Error::Invalid(_))), "{r:?}");
    fs.with(|i| i.store.insert(tree::FS, key, vec![1; max]))
        .unwrap();
    fs.commit().unwrap();
}

/// A preallocated extent that a damaged or hostile image places on a superblock, in
/// the log area or past the end is never written in place: the writeback fails
/// (EIO at fsync, nothing panics) and those blocks keep what they held.
#[test]
fn writes_never_go_in_place_outside_the_data_area() {
    use crate::format::FILE_EXTENT_PREALLOC;
    let (_, probe) = mk(64 * MB);
    let (log_start, size) = probe
        .with(|i| Ok((i.store.sb.log_start, i.store.sb.total_bytes)))
        .unwrap();
    drop(probe);
    // The primary superblock, the log area, and a range that runs past the end.
    for bad in [64 << 10, log_start, size - BS] {
        let (dev, fs) = mk(64 * MB);
        let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
        fs.fallocate(f, 0, 2 * BS, FallocMode::default()).unwrap();
        fs.commit().unwrap();
        rewrite_first_extent(&fs, f, 0, |fe| {
            assert_eq!(fe.kind, FILE_EXTENT_PREALLOC);
            fe.disk_bytenr = bad.into();
        });
        fs.unmount().unwrap();
        let dev = Arc::new(MemDev::from_image(dev.image()));
        let fs = Fs::open(dev.clone(), Options::default()).unwrap();
        let span = |img: &[u8]| img[bad as usize..(bad + 2 * BS).min(size) as usize].to_vec();
        let before = span(&dev.image());
        fs.write(f, 0, &pattern(2 * BS as usize, 7)).unwrap();
        let r = fs.fsync(f, false);
        assert!(
            matches!(r, Err(Error::Corrupt { .. })),
            "extent at {bad}: {r:?}"
        );
        assert_eq!(span(&dev.image()), before, "blocks at {bad} were written");
        drop(fs);
    }
}

/// A directory entry naming an inode number past what a tree holds (a damaged or
/// hostile image: it would read as an inode of a snapshot) fails with EIO; the
/// directory's other names still resolve.
#[test]
fn a_dir_entry_naming_an_inode_past_the_largest_fails_with_eio() {
    use crate::format::{decode_dir_entries, encode_dir_entries};
    let (dev, fs) = mk(64 * MB);
    fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    let g = fs.mknod(ROOT_INO, b"g", 0o644, 0, cr()).unwrap().ino;
    fs.commit().unwrap();
    let far = 1u64 << 41;
    fs.with(|i| {
        let start = Key::new(ROOT_INO, kind::DIR_ITEM, 0);
        let end = Key::new(ROOT_INO, kind::DIR_INDEX + 1, 0);
        for (k, v) in i.store.range(tree::FS, &start, &end, 100)? {
            let mut l = decode_dir_entries(&v).unwrap();
            if l.iter().any(|e| e.name == b"f") {
                for e in l.iter_mut().filter(|e| e.name == b"f") {
                    e.ino = far;
                }
                i.store.insert(tree::FS, k, encode_dir_entries(&l))?;
            }
        }
        Ok(())
    })
    .unwrap();
    fs.unmount().unwrap();
    let problems = check_image(&dev);
    assert!(
        problems.iter().any(|p| p.contains("past the largest")),
        "{problems:?}"
    );
    let fs = Fs::open(
        Arc::new(MemDev::from_image(dev.image())),
        Options::default(),
    )
    .unwrap();
    let e = fs.lookup(ROOT_INO, b"f").unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(e.to_string().contains("past the largest"), "{e}");
    let e = fs.readdir(ROOT_INO, 0, 100).unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert_eq!(fs.lookup(ROOT_INO, b"g").unwrap().ino, g);
}

/// `n` names of 255 bytes that share one name hash, so one dir item. Both halves of
/// the hash are CRC32C of the name (from two seeds), affine in it: names of one
/// length collide when their XOR is in the kernel of the CRC's linear part, found
/// here over the bits of the first 6 bytes.
fn colliding_names(n: usize) -> Vec<Vec<u8>> {
    let base = vec![b'q'; 255];
    let lin = |d: &[u8]| crc32c::crc32c_append(0, d) ^ crc32c::crc32c_append(0, &vec![0; d.len()]);
    let mut pivots: [Option<(u32, u64)>; 32] = [None; 32];
    let mut kernel = Vec::new();
    for bit in 0..48u32 {
        let mut d = vec![0u8; 255];
        d[(bit / 8) as usize] = 1 << (bit % 8);
        let (mut v, mut m) = (lin(&d), 1u64 << bit);
        while v != 0 {
            let b = 31 - v.leading_zeros() as usize;
            match pivots[b] {
                Some((pv, pm)) => (v, m) = (v ^ pv, m ^ pm),
                None => {
                    pivots[b] = Some((v, m));
                    break;
                }
            }
        }
        if v == 0 {
            kernel.push(m);
        }
    }
    let mut names = Vec::new();
    for pick in 0u64..1 << kernel.len() {
        let mask = (0..kernel.len())
            .filter(|i| pick >> i & 1 == 1)
            .fold(0, |m, i| m ^ kernel[i]);
        let mut name = base.clone();
        for (i, c) in name.iter_mut().enumerate().take(6) {
            *c ^= (mask >> (8 * i)) as u8;
        }
        if name.iter().all(|&c| c != 0 && c != b'/') {
            assert_eq!(
                crate::format::name_hash(&name),
                crate::format::name_hash(&base)
            );
            names.push(name);
        }
        if names.len() == n {
            break;
        }
    }
    assert_eq!(names.len(), n, "too few colliding names");
    names
}

/// A name whose dir item (the names that share its hash) is full is refused with
/// EOVERFLOW before anything changes, by create, link and rename alike (also a
/// rename that would leave a whiteout): no inode is left without a name, and a
/// renamed file keeps its old one. A rename over one of the item's names still works
/// (the replaced entry leaves room).
#[test]
fn a_name_for_a_full_dir_item_is_refused_before_anything_changes() {
    let (dev, fs) = mk_small_nodes(64 * MB);
    let names = colliding_names(40);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap();
    let mut made = 0;
    let err = loop {
        match fs.mknod(d.ino, &names[made], 0o644, 0, cr()) {
            Ok(_) => made += 1,
            Err(e) => break e,
        }
    };
    assert!(matches!(err, Error::Overflow), "create: {err:?}");
    assert!((2..names.len()).contains(&made), "{made} names fit");
    let full = &names[made];
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    fs.write(f.ino, 0, b"kept").unwrap();
    let nf = RenameFlags::default();
    let err = fs.rename(ROOT_INO, b"f", d.ino, full, nf).unwrap_err();
    assert!(matches!(err, Error::Overflow), "rename: {err:?}");
    let err = fs.link(f.ino, d.ino, full).unwrap_err();
    assert!(matches!(err, Error::Overflow), "link: {err:?}");
    let err = fs.mkdir(d.ino, full, 0o755, cr()).unwrap_err();
    assert!(matches!(err, Error::Overflow), "mkdir: {err:?}");
    // A rename within the item fits, but not with a whiteout left behind.
    let first = fs.lookup(d.ino, &names[0]).unwrap().ino;
    let err = fs
        .rename_whiteout(d.ino, &names[0], d.ino, full, false, cr())
        .unwrap_err();
    assert!(
        matches!(err, Error::Overflow),
        "rename with whiteout: {err:?}"
    );
    assert_eq!(fs.lookup(d.ino, &names[0]).unwrap().ino, first);
    assert_eq!(fs.lookup(ROOT_INO, b"f").unwrap().ino, f.ino);
    assert_eq!(fs.getattr(f.ino).unwrap().nlink, 1);
    assert_eq!(fs.readdir(d.ino, 0, 1000).unwrap().len(), made + 2);
    fs.rename(ROOT_INO, b"f", d.ino, &names[0], nf).unwrap();
    assert_eq!(
        read_all(&fs, fs.lookup(d.ino, &names[0]).unwrap().ino),
        b"kept"
    );
    assert!(fs.lookup(ROOT_INO, b"f").is_err());
    let problems = problems_after_unmount(&dev, fs);
    assert!(problems.is_empty(), "{problems:?}");
}

/// A tree change that fails halfway (a leaf it needs will not read, after its path's
/// nodes above were copied) stops changes until the next mount, as a failed commit
/// does: the copies are not in the tree, and a commit would free nodes the tree still
/// names. No fsync answers after it (records of the operation it was part of may be
/// pending), and the image keeps its last commit.
#[test]
fn a_tree_change_failing_halfway_stops_changes_until_the_next_mount() {
    use crate::dev::BlockDev;
    let (dev, fs) = mk_small_nodes(64 * MB);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap();
    for i in 0..3000 {
        let name = format!("file-{i:05}");
        fs.mknod(d.ino, name.as_bytes(), 0o644, 0, cr()).unwrap();
    }
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap();
    fs.unmount().unwrap();
    let image = dev.image();
    let eio = |e: Error| e.errno() == libc::EIO;
    // First with nothing changed since the mount, so the insert copies the root;
    // then after a change of the same operation (an item of `f`), whose record must
    // not reach the log.
    let marker = Key::new(f.ino, kind::XATTR_CHUNK, 999);
    for written in [false, true] {
        let dev = Arc::new(MemDev::from_image(image.clone()));
        let fs = Fs::open(dev.clone(), Options::default()).unwrap();
        let mut g = fs.inner.lock();
        let s = &mut g.store;
        if written {
            s.insert(tree::FS, marker, vec![7; 16]).unwrap();
        }
        // A leaf two levels below the fs tree's root.
        let root = s.root(tree::FS);
        assert!(root.level >= 2, "fs tree of level {}", root.level);
        let mut n = crate::btree::load_root(s, &root).unwrap();
        while n.hdr.level > 1 {
            let i = n.len() / 2;
            n = crate::btree::load_child(s, &n, i).unwrap();
        }
        let (key, leaf, _) = n.ptrs()[n.len() / 2];
        let mut good = vec![0u8; 4096];
        dev.read_at(&mut good, leaf).unwrap();
        dev.write_at(&[0xA5; 4096], leaf).unwrap();
        assert!(s.insert(tree::FS, key, vec![1; 16]).is_err());
        dev.write_at(&good, leaf).unwrap();
        drop(g);
        if written {
            assert!(
                eio(fs.sync_to(u64::MAX).unwrap_err()),
                "a log sync after it"
            );
        }
        let made = fs.mknod(ROOT_INO, b"new", 0o644, 0, cr());
        assert!(eio(made.unwrap_err()), "a change after it");
        assert!(
            eio(fs.write(f.ino, 0, b"x").unwrap_err()),
            "a write after it"
        );
        assert!(fs.unmount().is_err(), "the unmount's commit was refused");
        let problems = check_image(&dev);
        assert!(problems.is_empty(), "{problems:?}");
        let dev = Arc::new(MemDev::from_image(dev.image()));
        let fs = Fs::open(dev, Options::default()).unwrap();
        assert_eq!(fs.readdir(d.ino, 0, 5000).unwrap().len(), 3002);
        assert_eq!(fs.getattr(f.ino).unwrap().size, 0);
        let found = fs.inner.lock().store.search(tree::FS, &marker).unwrap();
        assert!(
            found.is_none(),
            "a record of the failed operation was replayed"
        );
    }
}

/// A write past the end that copies nothing, because the block it shares with the
/// end will not read (a damaged data block), fails and leaves the size as it was.
#[test]
fn a_write_past_the_end_that_copies_nothing_keeps_the_size() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.write(f, 0, &pattern(100, 3)).unwrap();
    fs.commit().unwrap();
    let addr = std::cell::Cell::new(0);
    rewrite_first_extent(&fs, f, 0, |fe| addr.set(fe.disk_bytenr.get()));
    fs.unmount().unwrap();
    let dev = Arc::new(MemDev::from_image(dev.image()));
    crate::dev::BlockDev::write_at(&*dev, &[0x5A; 16], addr.get()).unwrap();
    let fs = Fs::open(dev, Options::default()).unwrap();
    let err = fs.write(f, 200, b"x").unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err:?}");
    assert_eq!(fs.getattr(f).unwrap().size, 100);
}

/// A truncate that fails (the block at the new end will not read, to zero its tail)
/// loses no data: dirty data wholly past the new size stays cached and dirty, and
/// reads back.
#[test]
fn a_failed_truncate_keeps_the_dirty_data_past_the_new_size() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.write(f, 0, &pattern(2 * BS as usize, 3)).unwrap();
    fs.commit().unwrap();
    let addr = std::cell::Cell::new(0);
    rewrite_first_extent(&fs, f, 0, |fe| addr.set(fe.disk_bytenr.get()));
    fs.unmount().unwrap();
    let dev = Arc::new(MemDev::from_image(dev.image()));
    crate::dev::BlockDev::write_at(&*dev, &[0x5A; 16], addr.get() + BS).unwrap();
    let fs = Fs::open(dev, Options::default()).unwrap();
    let far = 4 * fs.cache.folio_size();
    let tail = pattern(BS as usize, 9);
    fs.write(f, far, &tail).unwrap();
    let cut = SetAttr {
        size: Some(BS + 100),
        ..Default::default()
    };
    let err = fs.setattr(f, &cut).unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err:?}");
    assert_eq!(fs.getattr(f).unwrap().size, far + BS);
    let back = fs.read(f, far, BS as u32).unwrap();
    assert!(back == tail, "the dirty data past the new size was lost");
    assert_eq!(fs.dirty_bytes_of(f), BS);
}

/// With every writeback failing (a full host under a sparse image), a write that
/// finds the cache past its size because of that is refused whole, before any of
/// its bytes go in (the size stays), with the writeback's error; what is cached
/// still reads, and with room again the writes go on and everything is fsynced.
#[test]
fn a_write_into_a_cache_that_failing_writebacks_keep_full_is_refused_whole() {
    let o = Options {
        cache: CacheOptions {
            cache_size: 4 * MB,
            ..CacheOptions::default()
        },
        ..Options::default()
    };
    let (dev, fs) = on_crash_dev_with(64 * MB, &MkfsOptions::default(), o);
    let a = fs.mknod(ROOT_INO, b"a", 0o644, 0, cr()).unwrap().ino;
    let b = fs.mknod(ROOT_INO, b"b", 0o644, 0, cr()).unwrap().ino;
    dev.refuse_writes_from(Some(past_log(&fs)));
    let data = pattern(16 * MB as usize, 4);
    let chunk = 256 << 10;
    let mut written = 0;
    let err = loop {
        assert!(written < data.len(), "16 MiB went into a 4 MiB cache");
        match fs.write(a, written as u64, &data[written..written + chunk]) {
            Ok(n) => written += n,
            Err(e) => break e,
        }
    };
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    assert_eq!(fs.getattr(a).unwrap().size, written as u64);
    assert!(read_all(&fs, a) == data[..written], "a reads back");
    let err = fs.write(b, 0, &data[..4096]).unwrap_err();
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    assert_eq!(fs.getattr(b).unwrap().size, 0);
    dev.refuse_writes_from(None);
    fs.write(b, 0, &data[..4096]).unwrap();
    fs.write(a, written as u64, &data[written..]).unwrap();
    fs.fsync(a, false).unwrap();
    fs.fsync(b, false).unwrap();
    assert!(read_all(&fs, a) == data, "a reads back whole");
}

/// A device over an image in memory that counts the bytes read in `range`, and with
/// `fail`, fails every read that touches it with EIO.
struct Watched {
    inner: MemDev,
    range: std::ops::Range<u64>,
    fail: bool,
    read: std::sync::atomic::AtomicU64,
}

impl Watched {
    fn new(image: Vec<u8>, range: std::ops::Range<u64>, fail: bool) -> Watched {
        Watched {
            inner: MemDev::from_image(image),
            range,
            fail,
            read: Default::default(),
        }
    }
}

impl crate::dev::BlockDev for Watched {
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        let end = off + buf.len() as u64;
        let inside = end
            .min(self.range.end)
            .saturating_sub(off.max(self.range.start));
        if self.fail && inside > 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        self.read
            .fetch_add(inside, std::sync::atomic::Ordering::Relaxed);
        self.inner.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, off)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
}

/// A read that fails while replay checks that a batch's data landed fails the mount
/// and leaves the log as it is: counted as data that did not land, it dropped that
/// batch and every later one for good. With the device healthy again, both fsyncs
/// replay.
#[test]
fn a_read_error_checking_logged_data_fails_the_mount_and_keeps_the_log() {
    use zerocopy::FromBytes;
    let (dev, fs) = mk(64 * MB);
    let a = fs.mknod(ROOT_INO, b"a", 0o644, 0, cr()).unwrap().ino;
    let b = fs.mknod(ROOT_INO, b"b", 0o644, 0, cr()).unwrap().ino;
    fs.commit().unwrap();
    fs.write(a, 0, &pattern(8192, 1)).unwrap();
    fs.fsync(a, false).unwrap();
    fs.write(b, 0, &pattern(8192, 2)).unwrap();
    fs.fsync(b, false).unwrap();
    let key = Key::new(a, kind::EXTENT_DATA, 0);
    let fe = fs
        .with(|i| i.store.search(tree::FS, &key))
        .unwrap()
        .unwrap();
    let at = crate::format::FileExtent::read_from_bytes(&fe)
        .unwrap()
        .disk_bytenr
        .get();
    let img = dev.image();
    drop(fs); // a crash: both fsyncs are in the log alone
    let failing = Arc::new(Watched::new(img, at..at + BS, true));
    let err = Fs::open(failing.clone(), Options::default()).err();
    assert!(err.is_some(), "mounted with a's data unread");
    let problems = crate::check::check(failing.as_ref()).unwrap().problems;
    assert!(
        problems.len() == 1 && problems[0].contains("cannot be read"),
        "check does not report the unreadable batch alone: {problems:?}"
    );
    let img = failing.inner.image();
    let fs = Fs::open(Arc::new(MemDev::from_image(img)), Options::default()).unwrap();
    assert!(read_all(&fs, a) == pattern(8192, 1), "a's fsync was lost");
    assert!(read_all(&fs, b) == pattern(8192, 2), "b's fsync was lost");
}

/// An fsync whose records are durable in the log answers Ok even when the commit it
/// then starts, because the log is nearly full, fails (here the host refuses the
/// commit's nodes): that failure is the next fsync's to report.
#[test]
fn an_fsync_durable_in_the_log_is_ok_when_the_commit_after_it_fails() {
    let mkfs = MkfsOptions {
        log_size: Some(MB),
        ..Default::default()
    };
    let (dev, fs) = on_crash_dev_with(64 * MB, &mkfs, Options::default());
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.commit().unwrap();
    dev.refuse_writes_from(Some(past_log(&fs)));
    let chmod = |n: u32| {
        let set = SetAttr {
            mode: Some(0o600 | ((n % 2) * 0o44)),
            ..Default::default()
        };
        fs.setattr(f, &set).unwrap();
    };
    for n in 0.. {
        assert!(n < 1000, "the log never filled");
        chmod(n);
        let r = fs.fsync(f, false);
        if fs.stats().commits_deferred > 0 {
            assert!(
                r.is_ok(),
                "fsync {n}, logged, failed with its commit: {r:?}"
            );
            break;
        }
        r.unwrap();
    }
    chmod(7);
    assert!(
        fs.fsync(f, false).is_err(),
        "an fsync with no room for its commit"
    );
}

/// A grow while a commit waits for room on the host (the host refused its nodes)
/// gives the superblock copies the new size brings in the last durable commit's
/// superblock, not the waiting commit's, which names nodes that never reached the
/// disk: a crash right after the grow's first flush mounts, with what was fsynced.
#[test]
fn a_grow_while_a_commit_waits_for_room_writes_the_durable_superblock() {
    let mem = Arc::new(MemDev::new(32 * MB));
    Fs::mkfs(mem.clone(), &MkfsOptions::default()).unwrap();
    let mut img = mem.image();
    img.resize(128 * MB as usize, 0);
    let dev = Arc::new(crate::dev::CrashDev::new(img));
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    let a = fs.mknod(ROOT_INO, b"a", 0o644, 0, cr()).unwrap().ino;
    fs.write(a, 0, &pattern(8192, 5)).unwrap();
    fs.fsync(a, false).unwrap();
    dev.refuse_writes_from(Some(past_log(&fs)));
    fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap();
    assert!(fs.commit().is_err(), "committed with no room");
    assert_eq!(fs.stats().commits_deferred, 1);
    dev.refuse_writes_from(None);
    let before = dev.op_count();
    fs.grow(96 * MB).unwrap();
    let first = dev
        .flush_points()
        .into_iter()
        .find(|&p| p > before)
        .unwrap();
    let crashed = MemDev::from_image(dev.image_with(first, &[]));
    let crashed = Fs::open(Arc::new(crashed), Options::default()).unwrap();
    assert!(
        read_all(&crashed, a) == pattern(8192, 5),
        "a's fsync was lost"
    );
    fs.unmount().unwrap();
    let fs = Fs::open(
        Arc::new(MemDev::from_image(dev.live_image())),
        Options::default(),
    )
    .unwrap();
    assert_eq!(fs.size(), 96 * MB);
    assert!(fs.lookup(ROOT_INO, b"d").is_ok());
}

/// A truncate answers the attributes as they are after it: the blocks of dirty data
/// it dropped unwritten count no more.
#[test]
fn a_truncate_answers_the_blocks_left_after_it() {
    let (_dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.write(f, 0, &pattern(MB as usize, 6)).unwrap();
    assert!(fs.getattr(f).unwrap().blocks > 0);
    let cut = SetAttr {
        size: Some(0),
        ..Default::default()
    };
    let a = fs.setattr(f, &cut).unwrap();
    assert_eq!((a.size, a.blocks), (0, 0));
}
