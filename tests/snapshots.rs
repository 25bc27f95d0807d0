//! Snapshots through a real FUSE mount: `mkdir .snapshots/NAME`, `ls`, `rmdir`, the
//! `birchfs snapshot` command on a mount and on an image, read-only contents, space
//! given back in the background, and a kill -9 after a snapshot. Every unmount runs
//! `birchfs check`, which verifies refcounts across the snapshots.

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use common::*;

const MB: usize = 1 << 20;

fn names(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn sync_fs(m: &Mount) {
    File::open(m.root()).unwrap().sync_all().unwrap();
}

#[test]
fn mkdir_in_dot_snapshots_freezes_the_tree_and_rmdir_gives_the_space_back() {
    let mut m = Mount::new();
    fs::create_dir(m.path("dir")).unwrap();
    fs::write(m.path("dir/a"), b"first").unwrap();
    fs::write(m.path("big"), mib_data(24, 1)).unwrap();
    std::os::unix::fs::symlink("dir/a", m.path("ln")).unwrap();
    sync_fs(&m);

    fs::create_dir(m.path(".snapshots/one")).unwrap();
    assert_eq!(names(&m.path(".snapshots")), vec!["one"]);
    // `ls -la` stats and asks for xattrs of every entry, `.` included: no errors.
    let out = std::process::Command::new("ls")
        .arg("-la")
        .arg(m.path(".snapshots"))
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "ls -la .snapshots: {}",
        describe(&out)
    );
    // Hidden from readdir of the root, as ZFS hides .zfs.
    assert_eq!(names(m.root()), vec!["big", "dir", "ln"]);

    // Change the live tree.
    fs::write(m.path("dir/a"), b"second").unwrap();
    fs::write(m.path("dir/b"), b"new").unwrap();
    fs::remove_file(m.path("ln")).unwrap();
    fs::write(m.path("big"), mib_data(24, 2)).unwrap();
    sync_fs(&m);

    let s = m.path(".snapshots/one");
    assert_eq!(names(&s), vec!["big", "dir", "ln"]);
    assert_eq!(fs::read(s.join("dir/a")).unwrap(), b"first");
    assert!(!s.join("dir/b").exists());
    assert_eq!(fs::read_link(s.join("ln")).unwrap().to_str(), Some("dir/a"));
    assert!(fs::read(s.join("big")).unwrap() == mib_data(24, 1));
    assert!(fs::read(m.path("big")).unwrap() == mib_data(24, 2));

    // Read-only: every change fails with EROFS, in the snapshot and in .snapshots.
    expect_errno(
        OpenOptions::new().write(true).open(s.join("dir/a")),
        libc::EROFS,
        "open for write",
    );
    expect_errno(fs::write(s.join("new"), b"x"), libc::EROFS, "create");
    expect_errno(fs::remove_file(s.join("dir/a")), libc::EROFS, "unlink");
    expect_errno(fs::create_dir(s.join("d")), libc::EROFS, "mkdir");
    expect_errno(
        fs::set_permissions(s.join("dir/a"), fs::Permissions::from_mode(0o600)),
        libc::EROFS,
        "chmod",
    );
    expect_errno(
        fs::rename(s.join("dir/a"), m.path("stolen")),
        libc::EROFS,
        "rename out",
    );
    expect_errno(
        fs::write(m.path(".snapshots/f"), b"x"),
        libc::EPERM,
        "file in .snapshots",
    );
    expect_errno(
        fs::create_dir(m.path(".snapshots/one")),
        libc::EEXIST,
        "same name",
    );
    expect_errno(
        fs::remove_dir(m.path(".snapshots")),
        libc::EPERM,
        "rmdir .snapshots",
    );
    // cp out of a snapshot works (it shares the blocks).
    let out = std::process::Command::new("cp")
        .arg(s.join("dir/a"))
        .arg(m.path("restored"))
        .output()
        .unwrap();
    assert!(out.status.success(), "cp: {}", describe(&out));
    assert_eq!(fs::read(m.path("restored")).unwrap(), b"first");

    // The snapshot survives a remount (check runs at the unmount).
    m.remount();
    assert_eq!(fs::read(m.path(".snapshots/one/dir/a")).unwrap(), b"first");

    // Deleting it frees the 24 MiB only it held, in the background.
    let before = free_bytes(m.root());
    fs::remove_dir(m.path(".snapshots/one")).unwrap();
    assert!(!m.path(".snapshots/one").exists());
    assert_eq!(names(&m.path(".snapshots")), Vec::<String>::new());
    let t0 = Instant::now();
    loop {
        sync_fs(&m);
        let freed = free_bytes(m.root()).saturating_sub(before);
        if freed >= 24 * MB as u64 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "only {freed} bytes freed 30 s after rmdir"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    m.unmount();
}

#[test]
fn the_snapshot_command_works_on_a_mount_and_on_an_image() {
    let mut m = Mount::new();
    let root = m.root().to_str().unwrap().to_string();
    fs::write(m.path("f"), b"v1").unwrap();
    let out = birchfs(["snapshot", "create", &root, "daily"]);
    assert!(out.status.success(), "create: {}", describe(&out));
    fs::write(m.path("f"), b"v2").unwrap();
    let out = birchfs(["snapshot", "create", &root, "daily"]);
    assert!(!out.status.success(), "a second 'daily' was taken");
    // A name that is no path component is refused as such, on a mount and on an image
    // alike (through mkdir it read "File exists" or "No such file or directory").
    for bad in ["", ".", "..", "a/b"] {
        for target in [&root, &m.image().to_str().unwrap().to_string()] {
            let out = birchfs(["snapshot", "create", target, bad]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains("one path component"),
                "snapshot {bad:?} of {target}: {}",
                describe(&out)
            );
        }
    }
    // A name that is not UTF-8 is a name like any other (clap refused it), on a mount
    // and on an image.
    let odd = std::ffi::OsStr::from_bytes(b"caf\xe9-\xff");
    let snap = |verb: &str, target: &std::path::Path| {
        let out = birchfs(["snapshot".as_ref(), verb.as_ref(), target.as_os_str(), odd]);
        assert!(out.status.success(), "{verb} {odd:?}: {}", describe(&out));
    };
    snap("create", m.root());
    assert!(m.path(".snapshots").join(odd).is_dir());
    snap("delete", m.root());
    assert!(!m.path(".snapshots").join(odd).exists());
    m.unmount();
    snap("create", m.image());
    m.mount();
    assert!(m.path(".snapshots").join(odd).is_dir());
    m.unmount();
    snap("delete", m.image());
    m.mount();
    assert!(!m.path(".snapshots").join(odd).exists());
    let out = birchfs(["snapshot", "list", "--json", &root]);
    assert!(out.status.success(), "list: {}", describe(&out));
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(json.contains("\"name\":\"daily\""), "{json}");
    let out = birchfs(["snapshot", "list", &root]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.lines().any(|l| l.starts_with("daily ")), "{table}");
    assert_eq!(fs::read(m.path(".snapshots/daily/f")).unwrap(), b"v1");
    m.unmount();

    // On the unmounted image: take one, list both, delete the first.
    let img = m.image().to_str().unwrap().to_string();
    let out = birchfs(["snapshot", "create", &img, "offline"]);
    assert!(out.status.success(), "create on image: {}", describe(&out));
    let out = birchfs(["snapshot", "delete", &img, "daily"]);
    assert!(out.status.success(), "delete on image: {}", describe(&out));
    let out = birchfs(["snapshot", "list", "--json", &img]);
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(
        json.contains("offline") && !json.contains("daily"),
        "{json}"
    );
    let out = birchfs(["snapshot", "delete", &img, "nope"]);
    assert!(
        !out.status.success(),
        "deleting a missing snapshot succeeded"
    );
    let out = m.check();
    assert_eq!(out.status.code(), Some(0), "check: {}", describe(&out));

    m.mount();
    assert_eq!(fs::read(m.path(".snapshots/offline/f")).unwrap(), b"v2");
    // More snapshots than one xattr value could list at once.
    for i in 0..800 {
        fs::create_dir(m.path(format!(".snapshots/n{i:04}"))).unwrap();
    }
    let out = birchfs(["snapshot", "list", "--json", &root]);
    assert!(out.status.success(), "list of 801: {}", describe(&out));
    let json = String::from_utf8_lossy(&out.stdout);
    assert_eq!(json.matches("\"name\"").count(), 801, "{}", &json[..200]);
    assert!(json.contains("\"name\":\"n0799\""));
    for i in 0..800 {
        fs::remove_dir(m.path(format!(".snapshots/n{i:04}"))).unwrap();
    }
    let out = birchfs(["snapshot", "delete", &root, "offline"]);
    assert!(out.status.success(), "delete on mount: {}", describe(&out));
    assert_eq!(names(&m.path(".snapshots")), Vec::<String>::new());
    m.unmount();
}

#[test]
fn fsynced_writes_after_a_snapshot_survive_a_kill_of_the_daemon() {
    let mut m = Mount::new();
    fs::write(m.path("log"), b"before").unwrap();
    fs::create_dir(m.path(".snapshots/s")).unwrap();
    let mut f = OpenOptions::new().append(true).open(m.path("log")).unwrap();
    f.write_all(b" after").unwrap();
    f.sync_all().unwrap();
    drop(f);
    m.kill_daemon();
    m.mount();
    assert_eq!(fs::read(m.path("log")).unwrap(), b"before after");
    assert_eq!(fs::read(m.path(".snapshots/s/log")).unwrap(), b"before");
    m.unmount();
}
