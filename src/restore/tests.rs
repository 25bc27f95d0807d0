//! Tests of restore against images damaged on purpose.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zerocopy::{FromBytes, IntoBytes};

use super::namespace::Namespace;
use super::reader::read_image;
use super::writer::{geteuid_is_root, make_dest, Writer};
use super::*;
use crate::dev::MemDev;
use crate::format::{decode_node, kind, tree, InodeItem, Key, NodeBody, RootItem};
use crate::fs::{SetAttr, TimeSet};
use crate::txn::Store;
use crate::{Creds, Fs, MkfsOptions, Options, ROOT_INO};

fn content(i: usize) -> Vec<u8> {
    (0..5000 + i * 37).map(|j| (i * 7 + j / 13) as u8).collect()
}

/// 300 files in /d, a hard link, a symlink, a FIFO, xattrs, a sparse file, a
/// read-only directory with a file in it, and set times and owners.
fn populated() -> Arc<MemDev> {
    let dev = Arc::new(MemDev::new(64 << 20));
    Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    let c = Creds::default();
    let d = fs.mkdir(ROOT_INO, b"d", 0o750, c).unwrap();
    for i in 0..300 {
        let f = fs
            .mknod(d.ino, format!("f{i}").as_bytes(), 0o644, 0, c)
            .unwrap();
        fs.write(f.ino, 0, &content(i)).unwrap();
    }
    let f1 = fs.lookup_nopin(d.ino, b"f1").unwrap().ino;
    fs.link(f1, ROOT_INO, b"hard").unwrap();
    fs.symlink(ROOT_INO, b"sym", b"d/f1", c).unwrap();
    fs.mknod(ROOT_INO, b"fifo", libc::S_IFIFO | 0o600, 0, c)
        .unwrap();
    fs.setxattr(f1, b"user.small", b"value", false, false)
        .unwrap();
    let big: Vec<u8> = (0..20_000).map(|i| (i % 251) as u8).collect();
    fs.setxattr(f1, b"user.big", &big, false, false).unwrap();
    let s = fs.mknod(ROOT_INO, b"sparse", 0o600, 0, c).unwrap();
    fs.write(s.ino, 10 << 20, b"tail").unwrap();
    let ro = fs.mkdir(ROOT_INO, b"ro", 0o755, c).unwrap();
    let inner = fs.mknod(ro.ino, b"inner", 0o640, 0, c).unwrap();
    fs.write(inner.ino, 0, b"inside").unwrap();
    let when = std::time::UNIX_EPOCH + std::time::Duration::new(1_500_000_000, 123_456_789);
    for ino in [inner.ino, ro.ino, d.ino] {
        let set = SetAttr {
            uid: Some(1234),
            gid: Some(5678),
            atime: Some(TimeSet::At(when)),
            mtime: Some(TimeSet::At(when)),
            ..Default::default()
        };
        fs.setattr(ino, &set).unwrap();
    }
    let set = SetAttr {
        mode: Some(0o555),
        ..Default::default()
    };
    fs.setattr(ro.ino, &set).unwrap();
    fs.unmount().unwrap();
    dev
}

/// The filesystem on `dev`, mounted read-only (to look things up in).
fn readonly(dev: &Arc<MemDev>) -> Fs {
    let opts = Options {
        readonly: true,
        ..Default::default()
    };
    Fs::open(dev.clone(), opts).unwrap()
}

fn run(dev: &MemDev, opts: &RestoreOptions) -> (tempfile::TempDir, PathBuf, Restored) {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("out");
    let rep = restore(dev, &dest, opts).unwrap();
    (tmp, dest, rep)
}

/// What a restore made: (directories, files, symlinks, special files, hard links).
fn made(rep: &Restored) -> (u64, u64, u64, u64, u64) {
    (
        rep.dirs,
        rep.files,
        rep.symlinks,
        rep.specials,
        rep.hard_links,
    )
}

/// The address of the fs tree's root node.
fn fs_root(dev: &MemDev) -> (u64, u8) {
    tree_root(dev, tree::FS)
}

/// The address and level of tree `id`'s root node.
fn tree_root(dev: &MemDev, id: u64) -> (u64, u8) {
    let sb = Store::read_super(dev).unwrap();
    let mut buf = vec![0u8; sb.node_size as usize];
    dev.read_at(&mut buf, sb.root_tree).unwrap();
    let (_, body) = decode_node(&buf, sb.root_tree, &sb.fsid).unwrap();
    let NodeBody::Leaf(items) = body else {
        panic!("a root tree of one leaf")
    };
    let (_, v) = items
        .iter()
        .find(|(k, _)| k.ty == kind::ROOT_ITEM && k.objectid == id)
        .unwrap();
    let r = RootItem::read_from_bytes(v).unwrap();
    (r.bytenr.get(), r.level)
}

/// Writes a leaf of the fs tree holding `items` at a free address near the end of
/// the device, as a copy freed by a commit but not yet overwritten would be.
fn plant(img: &mut [u8], generation: u64, items: Vec<(Key, Vec<u8>)>) -> u64 {
    let sb = Store::read_super(&MemDev::from_image(img.to_vec())).unwrap();
    let ns = sb.node_size as usize;
    let addr = (img.len() - 4 * ns) as u64;
    let h = crate::format::NodeHeader {
        addr,
        generation,
        owner: tree::FS,
        level: 0,
    };
    let node = crate::format::encode_node(&h, &NodeBody::Leaf(items), &sb.fsid, ns);
    let at = &mut img[addr as usize..addr as usize + ns];
    assert!(at.iter().all(|&b| b == 0), "{addr:#x} is free space");
    at.copy_from_slice(&node);
    addr
}

fn flip(dev: &MemDev, addr: u64) -> MemDev {
    let mut img = dev.image();
    img[addr as usize + 300] ^= 0x10;
    MemDev::from_image(img)
}

#[test]
fn a_clean_image_comes_back_whole() {
    let dev = populated();
    let (_t, out, rep) = run(&dev, &RestoreOptions::default());
    assert!(rep.problems.is_empty(), "{:#?}", rep.problems);
    assert_eq!(made(&rep), (2, 302, 1, 1, 1));
    assert_eq!(
        (rep.damaged_nodes, rep.bad_blocks, rep.unverified_blocks),
        (0, 0, 0)
    );
    for i in 0..300 {
        let got = std::fs::read(out.join(format!("d/f{i}"))).unwrap();
        assert!(got == content(i), "d/f{i} differs");
    }
    let a = std::fs::metadata(out.join("hard")).unwrap();
    let b = std::fs::metadata(out.join("d/f1")).unwrap();
    assert_eq!((a.ino(), a.nlink()), (b.ino(), 2), "one file, two names");
    assert_eq!(
        std::fs::read_link(out.join("sym")).unwrap(),
        Path::new("d/f1")
    );
    let fifo = std::fs::symlink_metadata(out.join("fifo")).unwrap();
    assert!(fifo.file_type().is_fifo());
    assert_eq!(fifo.permissions().mode() & 0o7777, 0o600);
    let sparse = std::fs::metadata(out.join("sparse")).unwrap();
    assert_eq!(sparse.len(), (10 << 20) + 4);
    assert!(
        sparse.blocks() < 64,
        "holes stay holes: {}",
        sparse.blocks()
    );
    assert_eq!(
        std::fs::read(out.join("sparse")).unwrap()[10 << 20..],
        *b"tail"
    );
    let x = |name: &str| {
        let p = CString::new(out.join("d/f1").as_os_str().as_bytes()).unwrap();
        let n = CString::new(name).unwrap();
        let mut v = vec![0u8; 65536];
        // SAFETY: valid C strings and a buffer of the given length.
        let r = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        v.truncate(r.max(0) as usize);
        v
    };
    assert_eq!(x("user.small"), b"value");
    // Attributes are set after the contents: a read-only directory holds its file,
    // and directories keep their times.
    let ro = std::fs::metadata(out.join("ro")).unwrap();
    assert_eq!(ro.permissions().mode() & 0o7777, 0o555);
    assert_eq!(std::fs::read(out.join("ro/inner")).unwrap(), b"inside");
    for p in ["ro", "ro/inner", "d"] {
        let m = std::fs::metadata(out.join(p)).unwrap();
        assert_eq!(
            (m.mtime(), m.mtime_nsec()),
            (1_500_000_000, 123_456_789),
            "{p}"
        );
        if geteuid_is_root() {
            assert_eq!((m.uid(), m.gid()), (1234, 5678), "{p}");
        }
    }
    assert_eq!(
        std::fs::metadata(out.join("d"))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777,
        0o750
    );
}

/// As root: owners, a device node, a socket, a set-uid file and its file
/// capability (which a chown after the xattrs would drop) come back.
#[test]
fn owners_devices_sockets_and_capabilities_come_back_as_root() {
    if !geteuid_is_root() {
        eprintln!("skipped: making device nodes and setting capabilities needs root");
        return;
    }
    let dev = Arc::new(MemDev::new(64 << 20));
    Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    let c = Creds {
        uid: 1234,
        gid: 5678,
    };
    let null = libc::makedev(1, 3);
    fs.mknod(ROOT_INO, b"null", libc::S_IFCHR | 0o666, null, c)
        .unwrap();
    fs.mknod(ROOT_INO, b"sock", libc::S_IFSOCK | 0o755, 0, c)
        .unwrap();
    let ping = fs.mknod(ROOT_INO, b"ping", 0o4755, 0, c).unwrap();
    fs.write(ping.ino, 0, b"#!/bin/true\n").unwrap();
    // vfs_cap_data revision 2: effective, CAP_NET_RAW permitted.
    let cap: Vec<u8> = [0x0200_0001u32, 1 << 13, 0, 0, 0]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    fs.setxattr(ping.ino, b"security.capability", &cap, false, false)
        .unwrap();
    fs.unmount().unwrap();
    let (_t, out, rep) = run(&dev, &RestoreOptions::default());
    assert!(rep.problems.is_empty(), "{:#?}", rep.problems);
    assert_eq!((rep.specials, rep.files, rep.attrs_refused), (2, 1, 0));
    let m = std::fs::symlink_metadata(out.join("null")).unwrap();
    assert!(m.file_type().is_char_device() && m.rdev() == null);
    assert!(std::fs::symlink_metadata(out.join("sock"))
        .unwrap()
        .file_type()
        .is_socket());
    let m = std::fs::metadata(out.join("ping")).unwrap();
    assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1234, 5678, 0o4755));
    let p = CString::new(out.join("ping").as_os_str().as_bytes()).unwrap();
    let n = CString::new("security.capability").unwrap();
    let mut v = vec![0u8; 64];
    // SAFETY: valid C strings and a buffer of the given length.
    let r = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
    assert!(
        r > 0,
        "the capability is there: {}",
        std::io::Error::last_os_error()
    );
    v.truncate(r as usize);
    assert_eq!(v, cap);
}

/// A value too large for one item is put together from its chunks (ext4, where
/// the tests restore to, takes no value that large, so this reads it only).
#[test]
fn a_chunked_xattr_value_is_put_together() {
    let dev = populated();
    let f1 = readonly(&dev).resolve("/d/f1").unwrap().ino;
    let img = read_image(dev.as_ref(), &RestoreOptions::default()).unwrap();
    let e = img.ns.xattrs[&f1]
        .iter()
        .find(|e| e.name == b"user.big")
        .unwrap()
        .clone();
    assert!(e.chunks.is_some(), "stored in chunks");
    let want: Vec<u8> = (0..20_000).map(|i| (i % 251) as u8).collect();
    assert!(img.ns.xattr_value(f1, &e) == Some(want));
    let mut ns = img.ns;
    ns.chunks.retain(|&(ino, _), _| ino != f1);
    assert_eq!(ns.xattr_value(f1, &e), None, "a lost chunk loses the value");
}

#[test]
fn the_destination_must_be_new_or_empty() {
    let dev = populated();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("x"), b"keep").unwrap();
    let err = restore(dev.as_ref(), tmp.path(), &RestoreOptions::default()).unwrap_err();
    assert!(err.to_string().contains("not empty"), "{err}");
    assert_eq!(std::fs::read(tmp.path().join("x")).unwrap(), b"keep");
    // An empty directory is fine.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let rep = restore(dev.as_ref(), &empty, &RestoreOptions::default()).unwrap();
    assert_eq!(rep.files, 302);
}

/// The fs tree's root lost after deletes and creates: every file is restored
/// from the live leaves under it, and none of the deleted files come back.
#[test]
fn a_damaged_fs_root_loses_no_file_and_revives_none() {
    let dev = populated();
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    let d = fs.resolve("/d").unwrap().ino;
    for i in 0..50 {
        let g = fs
            .mknod(d, format!("g{i}").as_bytes(), 0o644, 0, Creds::default())
            .unwrap();
        fs.write(g.ino, 0, format!("new {i}").as_bytes()).unwrap();
    }
    fs.unmount().unwrap();
    // Deletes alone in the last session: the leaves that held those files are
    // freed by its one commit, and nothing overwrites them after it.
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    for i in 150..300 {
        fs.unlink(d, format!("f{i}").as_bytes()).unwrap();
    }
    fs.unmount().unwrap();
    let (root, level) = fs_root(&dev);
    assert!(level >= 1, "the fs tree has more than one leaf");
    // A freed leaf of a file deleted long ago, left on the device: not allocated,
    // so it must not come back (its keys are past every live leaf's).
    let mut img = dev.image();
    let ghost = InodeItem {
        mode: (libc::S_IFREG | 0o644).into(),
        nlink: 1.into(),
        ..Default::default()
    };
    let refs = crate::format::encode_inode_refs(&[crate::format::InodeRef {
        index: 9999,
        name: b"ghost".to_vec(),
    }]);
    plant(
        &mut img,
        2,
        vec![
            (
                Key::new(1 << 40, kind::INODE_ITEM, 0),
                ghost.as_bytes().to_vec(),
            ),
            (Key::new(1 << 40, kind::INODE_REF, d), refs),
        ],
    );
    let dev = Arc::new(MemDev::from_image(img));
    let bad = Arc::new(flip(&dev, root));
    assert!(Fs::open(bad.clone(), Options::default()).is_err());
    let (_t, out, rep) = run(&bad, &RestoreOptions::default());
    assert_eq!(rep.problems.len(), 1, "{:#?}", rep.problems);
    assert!(
        rep.problems[0].contains(&format!("{root:#x}"))
            && rep.problems[0].contains("stand in for it"),
        "{:#?}",
        rep.problems
    );
    assert_eq!(rep.damaged_nodes, 1);
    let mut names: Vec<String> = std::fs::read_dir(out.join("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut want: Vec<String> = (0..150)
        .map(|i| format!("f{i}"))
        .chain((0..50).map(|i| format!("g{i}")))
        .collect();
    want.sort();
    assert_eq!(names, want);
    for i in 0..150 {
        assert!(std::fs::read(out.join(format!("d/f{i}"))).unwrap() == content(i));
    }
    assert_eq!(std::fs::read(out.join("d/g7")).unwrap(), b"new 7");
    assert!(std::fs::read(out.join("hard")).unwrap() == content(1));
    assert_eq!(rep.lost_found, 0, "deleted files come back from nowhere");
}

/// With a snapshot taken before the live tree changed a leaf, the snapshot's copy
/// stands in for that leaf when it is lost, and is said to be older: its files come
/// back as they were at the snapshot.
#[test]
fn a_lost_leaf_shared_no_more_comes_back_from_the_snapshot_as_older() {
    let dev = populated();
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    fs.snapshot_create(b"s").unwrap();
    for i in 0..300 {
        let ino = fs.resolve(&format!("/d/f{i}")).unwrap().ino;
        let set = SetAttr {
            mode: Some(0o600),
            ..Default::default()
        };
        fs.setattr(ino, &set).unwrap();
    }
    fs.unmount().unwrap();
    let (root, _) = fs_root(&dev);
    let sb = Store::read_super(dev.as_ref()).unwrap();
    let mut buf = vec![0u8; sb.node_size as usize];
    dev.read_at(&mut buf, root).unwrap();
    let NodeBody::Internal(ptrs) = decode_node(&buf, root, &sb.fsid).unwrap().1 else {
        panic!("an internal root")
    };
    let leaf = ptrs[ptrs.len() / 2].1;
    let (_t, out, rep) = run(&flip(&dev, leaf), &RestoreOptions::default());
    assert!(
        rep.problems[0].contains(&format!("corrupt tree node at {leaf:#x}"))
            && rep.problems[0].contains("older copies"),
        "{:#?}",
        rep.problems
    );
    let mut modes = BTreeMap::new();
    for i in 0..300 {
        let p = out.join(format!("d/f{i}"));
        assert!(std::fs::read(&p).unwrap() == content(i), "{}", p.display());
        let m = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        *modes.entry(m).or_insert(0) += 1;
    }
    assert!(modes[&0o600] > 200, "{modes:?}");
    assert!(
        modes.get(&0o644).is_some_and(|&n| n > 0),
        "as at the snapshot: {modes:?}"
    );
}

/// The extent tree's root lost as well as the fs tree's: what the extent tree
/// still tells (from older copies) must not make restore drop live fs leaves it
/// cannot account for.
#[test]
fn a_damaged_extent_tree_drops_no_live_leaf() {
    let dev = populated();
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    for i in 0..300 {
        let ino = fs.resolve(&format!("/d/f{i}")).unwrap().ino;
        fs.write(ino, 0, b"second").unwrap();
    }
    fs.unmount().unwrap();
    let (fs_root, _) = fs_root(&dev);
    // The extent leaf holding the fs tree's nodes' items.
    let (ext_root, level) = tree_root(&dev, tree::EXTENT);
    assert!(level >= 1, "an extent tree of more than one leaf");
    let sb = Store::read_super(dev.as_ref()).unwrap();
    let mut buf = vec![0u8; sb.node_size as usize];
    dev.read_at(&mut buf, ext_root).unwrap();
    let NodeBody::Internal(ptrs) = decode_node(&buf, ext_root, &sb.fsid).unwrap().1 else {
        panic!("an internal root")
    };
    let i = ptrs.iter().rposition(|p| p.0.objectid <= fs_root).unwrap();
    let ext_leaf = ptrs[i].1;
    let bad = flip(&flip(&dev, fs_root), ext_leaf);
    let (_t, out, rep) = run(&bad, &RestoreOptions::default());
    assert!(
        rep.problems[0].contains(&format!("extent tree: corrupt tree node at {ext_leaf:#x}")),
        "{:#?}",
        rep.problems
    );
    for i in 0..300 {
        let mut want = content(i);
        want[..6].copy_from_slice(b"second");
        let p = out.join(format!("d/f{i}"));
        assert!(std::fs::read(&p).unwrap() == want, "{}", p.display());
    }
}

/// An image cut short: restore says so and gets back what lies before the cut.
#[test]
fn a_truncated_image_gives_back_what_it_holds() {
    let dev = populated();
    let mut img = dev.image();
    img.truncate(48 << 20);
    let (_t, out, rep) = run(&MemDev::from_image(img), &RestoreOptions::default());
    assert!(rep.problems[0].contains("cut short"), "{:#?}", rep.problems);
    for i in 0..300 {
        assert!(std::fs::read(out.join(format!("d/f{i}"))).unwrap() == content(i));
    }
}

/// After a crash the fsyncs since the last commit are in the log: restore replays
/// them as a mount does (new files, a removal), also when the fs tree's root is lost.
#[test]
fn fsyncs_since_the_last_commit_are_replayed() {
    let dev = populated();
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    let d = fs.resolve("/d").unwrap().ino;
    for i in 0..3 {
        let f = fs
            .mknod(
                ROOT_INO,
                format!("new{i}").as_bytes(),
                0o644,
                0,
                Creds::default(),
            )
            .unwrap();
        fs.write(f.ino, 0, format!("fsynced {i}").as_bytes())
            .unwrap();
        fs.fsync(f.ino, false).unwrap();
    }
    fs.unlink(d, b"f5").unwrap();
    fs.fsync(d, false).unwrap();
    let crashed = MemDev::from_image(dev.image());
    drop(fs);
    let (root, _) = fs_root(&crashed);
    for (img, damaged) in [
        (crashed.image(), false),
        (flip(&crashed, root).image(), true),
    ] {
        let (_t, out, rep) = run(&MemDev::from_image(img), &RestoreOptions::default());
        assert_eq!(rep.problems.len(), damaged as usize, "{:#?}", rep.problems);
        assert!(rep.log_batches >= 1, "{rep:?}");
        assert_eq!(rep.unverified_blocks, 0, "the log's checksums came along");
        for i in 0..3 {
            assert_eq!(
                std::fs::read(out.join(format!("new{i}"))).unwrap(),
                format!("fsynced {i}").as_bytes()
            );
        }
        assert!(!out.join("d/f5").exists(), "the fsynced unlink is replayed");
        assert!(std::fs::read(out.join("d/f6")).unwrap() == content(6));
    }
}

#[test]
fn a_damaged_root_tree_loses_no_file() {
    let dev = populated();
    let sb = Store::read_super(dev.as_ref()).unwrap();
    let bad = flip(&dev, sb.root_tree);
    let (_t, out, rep) = run(&bad, &RestoreOptions::default());
    assert!(
        rep.problems[0].contains(&format!(
            "root tree: corrupt tree node at {:#x}",
            sb.root_tree
        )),
        "{:#?}",
        rep.problems
    );
    assert_eq!((rep.files, rep.dirs, rep.hard_links), (302, 2, 1));
    assert_eq!((rep.bad_blocks, rep.lost_found), (0, 0));
    for i in 0..300 {
        assert!(std::fs::read(out.join(format!("d/f{i}"))).unwrap() == content(i));
    }
}

/// A lost leaf costs only what it held: every file whose items lie elsewhere is
/// restored with its name (from its inode ref when the directory's entries went).
#[test]
fn a_damaged_leaf_costs_only_its_own_keys() {
    let dev = populated();
    let (root, _) = fs_root(&dev);
    let sb = Store::read_super(dev.as_ref()).unwrap();
    let mut buf = vec![0u8; sb.node_size as usize];
    dev.read_at(&mut buf, root).unwrap();
    let NodeBody::Internal(ptrs) = decode_node(&buf, root, &sb.fsid).unwrap().1 else {
        panic!("an internal root")
    };
    // A leaf in the middle, and the objectids it may hold items of.
    let i = ptrs.len() / 2;
    let (lo, leaf, hi) = (ptrs[i].0.objectid, ptrs[i].1, ptrs[i + 1].0.objectid);
    let fs = readonly(&dev);
    let inos: Vec<u64> = (0..300)
        .map(|i| fs.resolve(&format!("/d/f{i}")).unwrap().ino)
        .collect();
    drop(fs);
    let (_t, out, rep) = run(&flip(&dev, leaf), &RestoreOptions::default());
    assert!(
        rep.problems[0].contains(&format!("fs tree: corrupt tree node at {leaf:#x}")),
        "{:#?}",
        rep.problems
    );
    let mut outside = 0;
    for (i, ino) in inos.iter().enumerate() {
        if (lo..=hi).contains(ino) {
            continue;
        }
        outside += 1;
        let p = out.join(format!("d/f{i}"));
        assert!(
            std::fs::read(&p).is_ok_and(|c| c == content(i)),
            "{} missing or wrong; {:#?}",
            p.display(),
            rep.problems
        );
    }
    assert!(outside > 200, "{outside}");
    assert!(outside < 300, "the leaf held some of them");

    // With a copy of the lost leaf left from an older generation, that copy
    // stands in for it and nothing is lost.
    let mut img = dev.image();
    let mut buf = vec![0u8; sb.node_size as usize];
    dev.read_at(&mut buf, leaf).unwrap();
    let (h, NodeBody::Leaf(items)) = decode_node(&buf, leaf, &sb.fsid).unwrap() else {
        panic!("a leaf")
    };
    let copy = plant(&mut img, h.generation - 1, items);
    img[leaf as usize + 300] ^= 0x10;
    let (_t, out, rep) = run(&MemDev::from_image(img), &RestoreOptions::default());
    assert!(
        rep.problems[0].contains("older copies of its keys"),
        "{copy:#x}: {:#?}",
        rep.problems
    );
    for i in 0..300 {
        let p = out.join(format!("d/f{i}"));
        assert!(
            std::fs::read(&p).is_ok_and(|c| c == content(i)),
            "{}",
            p.display()
        );
    }
    assert_eq!((rep.files, rep.lost_found), (302, 0));
}

#[test]
fn a_damaged_data_block_is_written_as_read_and_named() {
    let dev = populated();
    let fs = readonly(&dev);
    let addr = fs.extent_map(fs.resolve("/d/f7").unwrap().ino).unwrap()[0].disk_addr;
    drop(fs);
    let mut img = dev.image();
    img[addr as usize + 4096 + 10] ^= 1;
    let (_t, out, rep) = run(&MemDev::from_image(img), &RestoreOptions::default());
    assert_eq!(rep.bad_blocks, 1);
    assert_eq!(rep.problems.len(), 1, "{:#?}", rep.problems);
    assert!(
        rep.problems[0]
            .contains("d/f7: 1 data blocks fail their checksums (the first at offset 4096)"),
        "{:#?}",
        rep.problems
    );
    let mut want = content(7);
    want[4096 + 10] ^= 1;
    assert!(std::fs::read(out.join("d/f7")).unwrap() == want);
    assert!(std::fs::read(out.join("d/f8")).unwrap() == content(8));
}

#[test]
fn restores_a_snapshot_as_it_was() {
    let dev = populated();
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    fs.snapshot_create(b"before").unwrap();
    let f = fs.resolve("/d/f3").unwrap().ino;
    fs.write(f, 0, b"changed").unwrap();
    fs.unlink(fs.resolve("/d").unwrap().ino, b"f4").unwrap();
    fs.unmount().unwrap();
    let snap = RestoreOptions {
        snapshot: Some(b"before".to_vec()),
    };
    let (_t, out, rep) = run(&dev, &snap);
    assert!(rep.problems.is_empty(), "{:#?}", rep.problems);
    assert!(std::fs::read(out.join("d/f3")).unwrap() == content(3));
    assert!(std::fs::read(out.join("d/f4")).unwrap() == content(4));
    let (_t2, live, _) = run(&dev, &RestoreOptions::default());
    assert_eq!(std::fs::read(live.join("d/f3")).unwrap()[..7], *b"changed");
    assert!(!live.join("d/f4").exists());
    let tmp = tempfile::tempdir().unwrap();
    let none = RestoreOptions {
        snapshot: Some(b"nope".to_vec()),
    };
    let err = restore(dev.as_ref(), &tmp.path().join("x"), &none).unwrap_err();
    assert!(
        err.to_string().contains("before"),
        "lists the snapshots: {err}"
    );
}

/// Unnamed inodes go to lost+found; names that are no path component are refused,
/// and a `lost+found` that is a symlink out of DEST is not written through.
#[test]
fn nameless_inodes_go_to_lost_and_found_and_hostile_names_are_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let inode = |mode: u32| InodeItem {
        mode: mode.into(),
        nlink: 1.into(),
        ..Default::default()
    };
    let ent = |ino: u64, name: &[u8]| crate::format::DirEntry {
        ino,
        dtype: libc::DT_REG,
        index: 2,
        name: name.to_vec(),
    };
    let mut items: Vec<(Key, Vec<u8>)> = [
        (256, libc::S_IFDIR | 0o755),
        (300, libc::S_IFREG | 0o644),
        (301, libc::S_IFDIR | 0o755),
        (302, libc::S_IFREG | 0o644),
        (303, libc::S_IFREG | 0o644),
        (304, libc::S_IFLNK | 0o777),
    ]
    .iter()
    .map(|&(ino, mode)| {
        (
            Key::new(ino, kind::INODE_ITEM, 0),
            inode(mode).as_bytes().to_vec(),
        )
    })
    .collect();
    items.push((
        Key::new(304, kind::SYMLINK, 0),
        outside.as_os_str().as_bytes().to_vec(),
    ));
    for (dir, e) in [
        (256, ent(302, b"..")),
        (256, ent(303, b"a/b")),
        (256, ent(304, b"lost+found")),
        (301, ent(302, b"kept")),
    ] {
        items.push((
            Key::new(dir, kind::DIR_INDEX, 2),
            crate::format::encode_dir_entries(&[e]),
        ));
    }
    let mut rep = Restored::default();
    let ns = Namespace::build(items, &mut rep);
    let out = tmp.path().join("out");
    make_dest(&out).unwrap();
    let dev = MemDev::new(1 << 20);
    let csums = BTreeMap::new();
    let mut w = Writer::new(&dev, 1 << 20, &ns, &csums, rep);
    w.run(&out);
    assert!(!tmp.path().join("b").exists() && !out.join("a").exists());
    assert_eq!(std::fs::read_link(out.join("lost+found")).unwrap(), outside);
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "nothing written through the symlink"
    );
    assert!(out.join("lost+found.1/#300").is_file());
    assert!(
        out.join("lost+found.1/#301/kept").is_file(),
        "a lost directory keeps what it holds"
    );
    assert!(out.join("lost+found.1/#303").is_file());
    assert_eq!(w.rep.lost_found, 3);
    assert!(
        w.rep.problems.iter().any(|p| p.contains("\"..\"")),
        "{:#?}",
        w.rep.problems
    );
    assert!(
        w.rep.problems.iter().any(|p| p.contains("\"a/b\"")),
        "{:#?}",
        w.rep.problems
    );
}

/// Opens `name` in directory `dir` (one component, so any depth works).
fn open_in(dir: &std::os::fd::OwnedFd, name: &str, flags: i32) -> std::os::fd::OwnedFd {
    use std::os::fd::{AsRawFd, FromRawFd};
    let n = CString::new(name).unwrap();
    // SAFETY: a valid descriptor and C string.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), n.as_ptr(), flags | libc::O_CLOEXEC) };
    assert!(fd >= 0, "{name}: {}", std::io::Error::last_os_error());
    // SAFETY: just opened, owned by nothing else.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }
}

/// fstat of a descriptor.
fn fstat(fd: &std::os::fd::OwnedFd) -> libc::stat {
    use std::os::fd::AsRawFd;
    // SAFETY: a zeroed stat is a valid buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, an empty path and a stat buffer.
    let r = unsafe { libc::fstatat(fd.as_raw_fd(), c"".as_ptr(), &mut st, libc::AT_EMPTY_PATH) };
    assert_eq!(r, 0);
    st
}

/// A tree deeper than PATH_MAX (12,000 bytes of path) comes back whole: no system
/// call takes such a path, and restore made the lower part nameless pieces in
/// lost+found ("File name too long") before it reached them from their parents.
#[test]
fn a_tree_deeper_than_path_max_comes_back_whole() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let dev = Arc::new(MemDev::new(64 << 20));
    Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    let c = Creds::default();
    let level = |i: usize| format!("{i:03}{}", "n".repeat(197));
    let mut dir = ROOT_INO;
    for i in 0..60 {
        dir = fs.mkdir(dir, level(i).as_bytes(), 0o755, c).unwrap().ino;
    }
    let f = fs.mknod(dir, b"f", 0o640, 0, c).unwrap();
    fs.write(f.ino, 0, b"at the bottom").unwrap();
    fs.setxattr(f.ino, b"user.deep", b"kept", false, false)
        .unwrap();
    fs.link(f.ino, ROOT_INO, b"top").unwrap();
    fs.link(f.ino, dir, b"g").unwrap();
    fs.symlink(dir, b"s", b"f", c).unwrap();
    fs.mknod(dir, b"p", libc::S_IFIFO | 0o600, 0, c).unwrap();
    let set = SetAttr {
        mode: Some(0o700),
        mtime: Some(TimeSet::At(
            std::time::UNIX_EPOCH + std::time::Duration::new(1_600_000_000, 5),
        )),
        ..Default::default()
    };
    fs.setattr(dir, &set).unwrap();
    fs.unmount().unwrap();

    let (_t, out, rep) = run(&dev, &RestoreOptions::default());
    assert!(rep.problems.is_empty(), "{:#?}", rep.problems);
    assert_eq!(made(&rep), (60, 1, 1, 1, 2));
    assert_eq!((rep.lost_found, rep.attrs_refused), (0, 0));
    let mut d = open_in(
        &std::fs::File::open(&out).unwrap().into(),
        ".",
        libc::O_RDONLY | libc::O_DIRECTORY,
    );
    for i in 0..60 {
        d = open_in(&d, &level(i), libc::O_RDONLY | libc::O_DIRECTORY);
    }
    let st = fstat(&d);
    assert_eq!(st.st_mode & 0o7777, 0o700);
    assert_eq!((st.st_mtime, st.st_mtime_nsec), (1_600_000_000, 5));
    let file = open_in(&d, "f", libc::O_RDONLY);
    let mut s = String::new();
    std::fs::File::from(file.try_clone().unwrap())
        .read_to_string(&mut s)
        .unwrap();
    assert_eq!(s, "at the bottom");
    let top = std::fs::metadata(out.join("top")).unwrap();
    let st = fstat(&file);
    assert_eq!(
        (st.st_ino, st.st_nlink, st.st_mode & 0o7777),
        (top.ino(), 3, 0o640)
    );
    assert_eq!(fstat(&open_in(&d, "g", libc::O_RDONLY)).st_ino, top.ino());
    let mut v = [0u8; 16];
    // SAFETY: a valid descriptor, C string and buffer.
    let n = unsafe {
        libc::fgetxattr(
            file.as_raw_fd(),
            c"user.deep".as_ptr(),
            v.as_mut_ptr().cast(),
            v.len(),
        )
    };
    assert_eq!(&v[..n.max(0) as usize], b"kept");
    let mut t = [0u8; 8];
    // SAFETY: a valid descriptor, C string and buffer.
    let n =
        unsafe { libc::readlinkat(d.as_raw_fd(), c"s".as_ptr(), t.as_mut_ptr().cast(), t.len()) };
    assert_eq!(&t[..n.max(0) as usize], b"f");
    let p = fstat(&open_in(&d, "p", libc::O_PATH));
    assert_eq!(p.st_mode & libc::S_IFMT, libc::S_IFIFO);
}

/// Names that only back-references still give (their directory's entries lost) come
/// from extended refs as from inode refs.
#[test]
fn names_come_back_from_extended_refs_as_from_inode_refs() {
    let refs = crate::format::encode_inode_refs(&[crate::format::InodeRef {
        index: 2,
        name: b"plain".to_vec(),
    }]);
    let ext = crate::format::encode_inode_extrefs(&[
        crate::format::InodeExtref {
            parent: 256,
            index: 3,
            name: b"extended".to_vec(),
        },
        crate::format::InodeExtref {
            parent: 257,
            index: 4,
            name: b"other".to_vec(),
        },
    ]);
    let items = vec![
        (Key::new(300, kind::INODE_REF, 256), refs),
        (Key::new(300, kind::INODE_EXTREF, 77), ext),
        (Key::new(301, kind::INODE_EXTREF, 78), vec![1, 2, 3]),
    ];
    let mut rep = Restored::default();
    let ns = Namespace::build(items, &mut rep);
    let names = |dir: u64| -> Vec<(Vec<u8>, u64)> {
        ns.entries[&dir]
            .iter()
            .map(|(n, i)| (n.clone(), *i))
            .collect()
    };
    assert_eq!(
        names(256),
        vec![(b"extended".to_vec(), 300), (b"plain".to_vec(), 300)]
    );
    assert_eq!(names(257), vec![(b"other".to_vec(), 300)]);
    assert_eq!(
        rep.problems.len(),
        1,
        "the malformed one: {:?}",
        rep.problems
    );
}
