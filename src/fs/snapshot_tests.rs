//! Snapshots on an in-memory device: contents frozen while the live tree changes,
//! read-only, persistent, refcounts checked across trees, and the background drop
//! (bounded steps, resumed after a remount) giving the space back.

use std::sync::Arc;

use super::tests::{check_image, mk, pattern, problems_after_unmount, read_all, remount};
use super::*;
use crate::dev::MemDev;
use crate::error::Error;

const MB: u64 = 1 << 20;

fn cr() -> Creds {
    Creds { uid: 0, gid: 0 }
}

/// Path lookup from `dir`.
fn at(fs: &Fs, dir: u64, path: &str) -> Result<Attr> {
    let mut a = fs.getattr(dir)?;
    for c in path.split('/').filter(|c| !c.is_empty()) {
        a = fs.lookup(a.ino, c.as_bytes())?;
    }
    Ok(a)
}

fn names(fs: &Fs, dir: u64) -> Vec<String> {
    let mut v: Vec<String> = fs
        .readdir(dir, 0, 10_000)
        .unwrap()
        .into_iter()
        .map(|e| String::from_utf8(e.name).unwrap())
        .filter(|n| n != "." && n != "..")
        .collect();
    v.sort();
    v
}

/// A tree of many files, so the fs tree has internal nodes and many leaves.
fn populate(fs: &Fs, files: usize) -> Vec<(u64, Vec<u8>)> {
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, cr()).unwrap().ino;
    (0..files)
        .map(|i| {
            let ino = fs
                .mknod(d, format!("f{i:05}").as_bytes(), 0o644, 0, cr())
                .unwrap()
                .ino;
            let data = pattern(4096 * (1 + i % 3), i as u8);
            fs.write(ino, 0, &data).unwrap();
            (ino, data)
        })
        .collect()
}

#[test]
fn a_snapshot_keeps_what_was_there_while_the_live_tree_changes() {
    let (dev, fs) = mk(128 * MB);
    let files = populate(&fs, 300);
    let a = fs.mknod(ROOT_INO, b"a", 0o600, 0, cr()).unwrap().ino;
    let old = pattern(3 * MB as usize + 100, 7);
    fs.write(a, 0, &old).unwrap(); // still in the page cache: the snapshot takes it too
    fs.setxattr(a, b"user.k", b"v1", false, false).unwrap();
    fs.symlink(ROOT_INO, b"ln", b"a", cr()).unwrap();
    let s = fs.mkdir(SNAPSHOTS_INO, b"s1", 0o755, cr()).unwrap();
    assert!(is_snapshot_ino(s.ino));
    assert_eq!(s.kind, FileKind::Dir);

    // Change everything the snapshot holds.
    fs.write(a, 4096, &pattern(8192, 99)).unwrap();
    fs.setxattr(a, b"user.k", b"v2", false, false).unwrap();
    fs.unlink(ROOT_INO, b"ln").unwrap();
    let d = fs.lookup(ROOT_INO, b"d").unwrap().ino;
    for i in (0..300).step_by(2) {
        fs.unlink(d, format!("f{i:05}").as_bytes()).unwrap();
    }
    fs.rename(ROOT_INO, b"a", d, b"moved", Default::default())
        .unwrap();
    fs.commit().unwrap();

    let check_snapshot = |fs: &Fs| {
        let s = at(fs, ROOT_INO, ".snapshots/s1").unwrap().ino;
        assert_eq!(names(fs, s), vec!["a", "d", "ln"]);
        let sa = at(fs, s, "a").unwrap();
        assert!(read_all(fs, sa.ino) == old);
        assert_eq!(fs.getxattr(sa.ino, b"user.k").unwrap(), b"v1");
        assert_eq!(fs.readlink(at(fs, s, "ln").unwrap().ino).unwrap(), b"a");
        let sd = at(fs, s, "d").unwrap().ino;
        assert_eq!(names(fs, sd).len(), 300);
        for (i, (_, data)) in files.iter().enumerate().step_by(37) {
            let f = fs.lookup(sd, format!("f{i:05}").as_bytes()).unwrap();
            assert!(&read_all(fs, f.ino) == data, "file {i}");
        }
        // `..` of a snapshot's root is `.snapshots`.
        assert_eq!(fs.lookup(s, b"..").unwrap().ino, SNAPSHOTS_INO);
    };
    check_snapshot(&fs);
    // The live tree has the changes.
    let m = at(&fs, ROOT_INO, "d/moved").unwrap().ino;
    let mut want = old.clone();
    want[4096..12288].copy_from_slice(&pattern(8192, 99));
    assert!(read_all(&fs, m) == want);
    assert_eq!(names(&fs, d).len(), 151);
    assert!(fs.stats().shared_cows > 0);

    let fs = remount(&dev, fs);
    check_snapshot(&fs);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

#[test]
fn snapshots_are_read_only_and_their_names_are_checked() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.write(f, 0, b"hello").unwrap();
    fs.mkdir(ROOT_INO, b"sub", 0o755, cr()).unwrap();
    fs.snapshot_create(b"s").unwrap();
    let s = fs.lookup(SNAPSHOTS_INO, b"s").unwrap().ino;
    let sf = fs.lookup(s, b"f").unwrap().ino;
    let ro = |r: Result<()>| assert!(matches!(r, Err(Error::ReadOnly)), "{r:?}");
    ro(fs.write(sf, 0, b"x").map(|_| ()));
    ro(fs
        .setattr(
            sf,
            &SetAttr {
                size: Some(0),
                ..Default::default()
            },
        )
        .map(|_| ()));
    ro(fs.setxattr(sf, b"user.a", b"b", false, false));
    ro(fs.mknod(s, b"new", 0o644, 0, cr()).map(|_| ()));
    ro(fs.mkdir(s, b"new", 0o755, cr()).map(|_| ()));
    ro(fs.unlink(s, b"f"));
    ro(fs.rmdir(s, b"sub"));
    ro(fs.rename(s, b"f", s, b"g", Default::default()));
    ro(fs.rename(s, b"f", ROOT_INO, b"g", Default::default()));
    ro(fs.link(sf, ROOT_INO, b"g").map(|_| ()));
    ro(fs.access(sf, libc::W_OK, 0, 0, &[]));
    ro(fs.clone_range(f, 0, sf, 0, 0).map(|_| ()));
    // Reading stays possible, and a snapshot's file can be copied out (reflinked).
    assert_eq!(fs.read(sf, 0, 100).unwrap(), b"hello");
    let g = fs.mknod(ROOT_INO, b"g", 0o644, 0, cr()).unwrap().ino;
    assert_eq!(fs.copy_file_range(sf, 0, g, 0, 5).unwrap(), 5);
    assert_eq!(fs.read(g, 0, 100).unwrap(), b"hello");

    // `.snapshots`: only mkdir and rmdir; names are checked; hidden from readdir.
    assert!(matches!(
        fs.mkdir(SNAPSHOTS_INO, b"s", 0o755, cr()),
        Err(Error::Exists)
    ));
    for bad in [&b""[..], b".", b"..", b"a/b"] {
        assert!(fs.snapshot_create(bad).is_err(), "{bad:?}");
    }
    assert!(matches!(
        fs.snapshot_create(&[b'x'; 256]),
        Err(Error::NameTooLong)
    ));
    assert!(matches!(
        fs.mknod(SNAPSHOTS_INO, b"x", 0o644, 0, cr()),
        Err(Error::Perm)
    ));
    assert!(matches!(
        fs.rmdir(SNAPSHOTS_INO, b"nope"),
        Err(Error::NotFound)
    ));
    assert!(matches!(
        fs.mkdir(ROOT_INO, SNAPSHOTS_NAME, 0o755, cr()),
        Err(Error::Exists)
    ));
    assert!(matches!(
        fs.rename(ROOT_INO, b"f", ROOT_INO, SNAPSHOTS_NAME, Default::default()),
        Err(Error::Perm)
    ));
    assert!(matches!(
        fs.rmdir(ROOT_INO, SNAPSHOTS_NAME),
        Err(Error::Perm)
    ));
    assert_eq!(names(&fs, ROOT_INO), vec!["f", "g", "sub"]);
    // `ls -l` asks `.snapshots` for xattrs; it has none (not ENOENT).
    assert!(matches!(
        fs.getxattr(SNAPSHOTS_INO, b"security.selinux"),
        Err(Error::NoData)
    ));
    assert_eq!(fs.listxattr(SNAPSHOTS_INO).unwrap(), Vec::<Vec<u8>>::new());
    assert!(matches!(fs.read(SNAPSHOTS_INO, 0, 10), Err(Error::IsDir)));
    assert_eq!(names(&fs, SNAPSHOTS_INO), vec!["s"]);
    fs.snapshot_create(b"t").unwrap();
    assert_eq!(names(&fs, SNAPSHOTS_INO), vec!["s", "t"]);
    let list = fs.snapshot_list();
    assert_eq!(list.len(), 2);
    assert!(list[0].id < list[1].id && list[0].generation < list[1].generation);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

#[test]
fn deleting_a_snapshot_gives_its_space_back() {
    let (dev, fs) = mk(128 * MB);
    let f = fs.mknod(ROOT_INO, b"big", 0o644, 0, cr()).unwrap().ino;
    fs.write(f, 0, &pattern(16 * MB as usize, 1)).unwrap();
    populate(&fs, 200);
    fs.commit().unwrap();
    let free0 = fs.statfs().bfree;
    fs.snapshot_create(b"s").unwrap();
    // Overwriting the file cannot free its old blocks: the snapshot holds them.
    fs.write(f, 0, &pattern(16 * MB as usize, 2)).unwrap();
    fs.commit().unwrap();
    let free1 = fs.statfs().bfree;
    assert!(
        free0 - free1 >= 16 * MB / 4096,
        "{free0} -> {free1}: the overwrite should take new space"
    );
    // Reading the snapshot's copy fills the cache (backwards, so that it is no stream
    // that drops behind); deleting the snapshot empties it.
    let old = at(&fs, SNAPSHOTS_INO, "s/big").unwrap().ino;
    let want = pattern(16 * MB as usize, 1);
    for n in (0..16u64).rev() {
        let got = fs.read(old, n * MB, MB as u32).unwrap();
        assert!(got == want[(n * MB) as usize..][..MB as usize], "MiB {n}");
    }
    let cached = fs.stats().cache_bytes;
    fs.rmdir(SNAPSHOTS_INO, b"s").unwrap();
    assert!(
        cached - fs.stats().cache_bytes >= 16 * MB,
        "the deleted snapshot's folios stayed cached"
    );
    assert!(matches!(fs.read(old, 0, 10), Err(Error::NotFound)));
    assert!(matches!(
        fs.lookup(SNAPSHOTS_INO, b"s"),
        Err(Error::NotFound)
    ));
    assert!(fs.has_deleted_snapshots());
    while fs.drop_deleted(usize::MAX).unwrap() {}
    assert!(!fs.has_deleted_snapshots());
    fs.commit().unwrap();
    fs.commit().unwrap(); // the second releases what the first freed
    let free2 = fs.statfs().bfree;
    assert!(
        free2 + 64 >= free0,
        "after the drop {free2} blocks free, before the snapshot {free0}"
    );
    assert!(read_all(&fs, f) == pattern(16 * MB as usize, 2));
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

#[test]
fn a_drop_cut_short_is_consistent_and_resumes_after_a_remount() {
    let (dev, fs) = mk(128 * MB);
    let files = populate(&fs, 1500);
    fs.snapshot_create(b"a").unwrap();
    // Change some files between the snapshots and after them, so that the trees share
    // some nodes and not others.
    for (ino, _) in files.iter().step_by(7) {
        fs.write(*ino, 0, b"changed").unwrap();
    }
    fs.snapshot_create(b"b").unwrap();
    for (ino, _) in files.iter().skip(1).step_by(5) {
        fs.write(*ino, 0, b"again").unwrap();
    }
    fs.commit().unwrap();
    let free0 = fs.statfs().bfree;
    fs.snapshot_delete(b"a").unwrap();
    // One small step, then stop: the image must check clean half-dropped.
    assert!(fs.drop_deleted_by(1, 8).unwrap());
    let fs = remount(&dev, fs);
    assert_eq!(check_image(&dev), Vec::<String>::new());
    assert!(fs.has_deleted_snapshots());
    // A crash mid-way (no final commit) resumes from the last committed progress.
    assert!(fs.drop_deleted_by(2, 8).unwrap());
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    drop(fs);
    let fs = Fs::open(crashed.clone(), Options::default()).unwrap();
    let mut steps = 0;
    while fs.drop_deleted_by(1, 8).unwrap() {
        steps += 1;
    }
    assert!(steps > 3, "the drop took {steps} steps of 8 nodes");
    fs.commit().unwrap();
    assert!(fs.statfs().bfree > free0, "the drop freed nothing");
    let b = at(&fs, SNAPSHOTS_INO, "b/d").unwrap().ino;
    for (i, (_, data)) in files.iter().enumerate().step_by(13) {
        let f = fs.lookup(b, format!("f{i:05}").as_bytes()).unwrap();
        let mut want = data.clone();
        if i % 7 == 0 {
            want[..7].copy_from_slice(b"changed");
        }
        assert!(read_all(&fs, f.ino) == want, "file {i} of snapshot b");
    }
    assert_eq!(problems_after_unmount(&crashed, fs), Vec::<String>::new());
}

#[test]
fn fsynced_changes_after_a_snapshot_survive_a_crash() {
    let (dev, fs) = mk(64 * MB);
    let f = fs.mknod(ROOT_INO, b"f", 0o644, 0, cr()).unwrap().ino;
    fs.write(f, 0, &pattern(64 * 1024, 1)).unwrap();
    fs.snapshot_create(b"s").unwrap();
    fs.write(f, 0, &pattern(64 * 1024, 2)).unwrap();
    let g = fs.mknod(ROOT_INO, b"g", 0o644, 0, cr()).unwrap().ino;
    fs.write(g, 0, b"new").unwrap();
    fs.fsync(f, false).unwrap();
    fs.fsync(g, false).unwrap();
    let crashed = Arc::new(MemDev::from_image(dev.image()));
    drop(fs);
    let fs = Fs::open(crashed.clone(), Options::default()).unwrap();
    assert!(read_all(&fs, f) == pattern(64 * 1024, 2));
    assert_eq!(
        read_all(&fs, fs.lookup(ROOT_INO, b"g").unwrap().ino),
        b"new"
    );
    let sf = at(&fs, SNAPSHOTS_INO, "s/f").unwrap().ino;
    assert!(read_all(&fs, sf) == pattern(64 * 1024, 1));
    assert!(at(&fs, SNAPSHOTS_INO, "s/g").is_err());
    assert_eq!(problems_after_unmount(&crashed, fs), Vec::<String>::new());
}

#[test]
fn check_finds_a_wrong_refcount_on_a_shared_node() {
    let (dev, fs) = mk(64 * MB);
    populate(&fs, 200);
    fs.snapshot_create(b"s").unwrap();
    // Break the books on purpose: one reference too few on the shared root.
    {
        let mut g = fs.inner.lock();
        let root = g.store.root(crate::format::tree::FS).addr;
        let ns = g.store.sb.node_size as u64;
        g.store.corrupt_ref_for_test(root, ns, -1);
    }
    fs.unmount().unwrap();
    let problems = check_image(&dev);
    assert!(
        problems.iter().any(|p| p.contains("refcount 1 but 2")),
        "{problems:?}"
    );
}

#[test]
fn a_snapshot_reads_its_shared_root_while_the_commit_that_took_it_is_in_flight() {
    let (dev, fs) = mk(64 * MB);
    populate(&fs, 50);
    fs.commit().unwrap();
    let mut g = fs.inner.lock();
    // The fs tree's root is new in this transaction: only this commit writes it.
    g.setxattr(ROOT_INO, b"user.y", b"2", false, false).unwrap();
    g.store.request_snapshot(b"s").unwrap();
    // The commit is prepared (the snapshot exists in memory) but its nodes are not on
    // the device yet, as while another thread writes them without the lock.
    let batch = g.store.prepare_commit(false).unwrap();
    let id = g.store.snapshot_id(b"s").unwrap();
    // A change to the live tree copies the shared root away from the snapshot...
    g.setxattr(ROOT_INO, b"user.x", b"1", false, false).unwrap();
    assert!(fs.stats().shared_cows > 0);
    // ...and the snapshot must still find it (in the cache: the device lacks it).
    let root = crate::fs::inode::inode_key(crate::format::objectid::ROOT_DIR);
    assert!(g.store.search(id, &root).unwrap().is_some());
    crate::txn::Store::write_commit(dev.as_ref(), &g.store.stats, &batch).unwrap();
    g.store.finish_commit(batch);
    drop(g);
    assert_eq!(problems_after_unmount(&dev, fs), Vec::<String>::new());
}

#[test]
fn an_image_whose_snapshot_books_disagree_is_refused() {
    let (dev, fs) = mk(64 * MB);
    fs.snapshot_create(b"s").unwrap();
    {
        // Lose the bookkeeping item: the next id and the last snapshot's generation.
        let mut g = fs.inner.lock();
        use crate::format::{kind, objectid, tree, Key};
        let meta = Key::new(objectid::SNAPSHOTS, kind::SNAPSHOT_META, 0);
        assert!(g.store.delete(tree::ROOT, &meta).unwrap());
    }
    fs.unmount().unwrap();
    let img = Arc::new(MemDev::from_image(dev.image()));
    match Fs::open(img, Options::default()) {
        Err(Error::Corrupt { why, .. }) => assert!(why.contains("next id"), "{why}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("mounted an image whose snapshot ids could be given twice"),
    }
}
