//! POSIX behaviour of a mounted birchfs, checked the way pjdfstest checks it:
//! exact errno values, link counts, modes, ownership and timestamps.
//!
//! Every test makes its own image and mount (tests run in parallel threads)
//! and ends with `Mount::unmount`, which also runs `birchfs check`.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{
    symlink, DirBuilderExt, FileExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt,
};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::*;

const MB: usize = 1 << 20;

// ---------------------------------------------------------------------------
// open / create / read / write
// ---------------------------------------------------------------------------

#[test]
fn create_write_read_close() {
    let mut m = Mount::new();
    let um = current_umask();
    let p = m.path("file");
    {
        let mut f = File::create(&p).unwrap();
        f.write_all(b"hello, world").unwrap();
    }
    assert_eq!(fs::read(&p).unwrap(), b"hello, world");
    let md = stat(&p);
    assert!(md.is_file());
    assert_eq!(md.len(), 12);
    assert_eq!(md.nlink(), 1);
    assert_eq!((md.uid(), md.gid()), (0, 0));
    assert_eq!(perm(md.mode()), 0o666 & !um);

    // pwrite in the middle; pread at and past EOF returns 0 bytes
    {
        let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
        f.write_all_at(b"WORLD", 7).unwrap();
        let mut buf = [0u8; 4];
        assert_eq!(f.read_at(&mut buf, 12).unwrap(), 0);
        assert_eq!(f.read_at(&mut buf, 100_000).unwrap(), 0);
        let mut five = [0u8; 5];
        f.read_exact_at(&mut five, 7).unwrap();
        assert_eq!(&five, b"WORLD");
    }
    // O_APPEND
    {
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"!!").unwrap();
    }
    assert_eq!(fs::read(&p).unwrap(), b"hello, WORLD!!");
    // O_TRUNC
    {
        let mut f = OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        assert_eq!(f.metadata().unwrap().len(), 0);
        f.write_all(b"xyz").unwrap();
    }
    assert_eq!(fs::read(&p).unwrap(), b"xyz");
    // an explicit creation mode, subject to the umask
    let q = m.path("moded");
    drop(
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o640)
            .open(&q)
            .unwrap(),
    );
    assert_eq!(perm(stat(&q).mode()), 0o640 & !um);
    // a read-only descriptor refuses writes
    {
        let mut f = File::open(&p).unwrap();
        expect_errno(
            f.write(b"a"),
            libc::EBADF,
            "write on an O_RDONLY descriptor",
        );
    }
    // sequential reads in small pieces
    {
        let mut f = File::open(&p).unwrap();
        let mut one = [0u8; 1];
        let mut got = Vec::new();
        while f.read(&mut one).unwrap() == 1 {
            got.push(one[0]);
        }
        assert_eq!(got, b"xyz");
    }
    m.remount();
    assert_eq!(fs::read(&p).unwrap(), b"xyz");
    assert_eq!(perm(stat(&q).mode()), 0o640 & !um);
    m.unmount();
}

#[test]
fn open_error_cases() {
    let mut m = Mount::new();
    let f = m.path("f");
    fs::write(&f, b"x").unwrap();
    fs::create_dir(m.path("d")).unwrap();
    symlink("nowhere", m.path("dangling")).unwrap();

    fn excl(p: &Path) -> std::io::Result<File> {
        OpenOptions::new().write(true).create_new(true).open(p)
    }
    expect_errno(excl(&f), libc::EEXIST, "O_CREAT|O_EXCL on an existing file");
    expect_errno(
        excl(&m.path("d")),
        libc::EEXIST,
        "O_CREAT|O_EXCL on a directory",
    );
    expect_errno(
        excl(&m.path("dangling")),
        libc::EEXIST,
        "O_CREAT|O_EXCL on a dangling symlink",
    );
    expect_errno(
        File::open(m.path("missing")),
        libc::ENOENT,
        "open a missing file",
    );
    expect_errno(
        File::open(m.path("missing/x")),
        libc::ENOENT,
        "open under a missing directory",
    );
    expect_errno(
        File::create(m.path("missing/x")),
        libc::ENOENT,
        "create under a missing directory",
    );
    expect_errno(
        File::open(m.path("f/x")),
        libc::ENOTDIR,
        "open through a file",
    );
    expect_errno(
        File::create(m.path("f/x")),
        libc::ENOTDIR,
        "create through a file",
    );
    expect_errno(
        fs::create_dir(m.path("f/x")),
        libc::ENOTDIR,
        "mkdir through a file",
    );
    expect_errno(fs::metadata(m.path("f/")), libc::ENOTDIR, "stat file/");
    expect_errno(
        OpenOptions::new().write(true).open(m.path("d")),
        libc::EISDIR,
        "open a directory for writing",
    );
    expect_errno(
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(&f),
        libc::ENOTDIR,
        "O_DIRECTORY on a file",
    );
    {
        let mut d = File::open(m.path("d")).unwrap();
        let mut buf = [0u8; 8];
        expect_errno(d.read(&mut buf), libc::EISDIR, "read() on a directory");
    }
    assert_eq!(fs::read(&f).unwrap(), b"x");
    m.unmount();
}

/// ioctls birchfs does not have (FS_IOC_GETVERSION) fail with ENOTTY, as on a
/// kernel filesystem without them, and poll() finds a file ready; quietly: no warning
/// in the log per call.
#[test]
fn unknown_ioctls_and_poll_answer_as_a_kernel_filesystem_and_are_not_logged() {
    let mut m = Mount::unmounted("2G");
    m.log_to_file();
    m.mount();
    let p = m.path("f");
    File::create(&p).unwrap();
    let f = File::open(&p).unwrap();
    const FS_IOC_GETVERSION: libc::c_ulong = 0x8008_7601;
    for _ in 0..20 {
        let mut v: libc::c_long = 0;
        // SAFETY: FS_IOC_GETVERSION writes one long into `v`.
        let rc = unsafe { libc::ioctl(f.as_raw_fd(), FS_IOC_GETVERSION, &mut v) };
        assert_eq!(rc, -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ENOTTY)
        );
    }
    // poll(): ready at once, as a regular file on a kernel filesystem, and not logged.
    let mut pfd = libc::pollfd {
        fd: f.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    for _ in 0..3 {
        // SAFETY: one valid pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 1000) }, 1);
        assert_ne!(pfd.revents & libc::POLLIN, 0);
    }
    drop(f);
    let log = m.daemon_log();
    assert!(!log.contains("ioctl"), "ioctls were logged:\n{log}");
    assert!(!log.contains("poll"), "a poll was logged:\n{log}");
    m.unmount();
}

/// The inode flags of `p` (FS_IOC_GETFLAGS, as lsattr asks).
fn get_flags(p: &Path) -> libc::c_long {
    let f = File::open(p).unwrap();
    let mut flags: libc::c_long = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one long into `flags`.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), 0x8008_6601, &mut flags) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    flags
}

/// Sets the inode flags of `p` (FS_IOC_SETFLAGS, as chattr does).
fn set_flags(p: &Path, flags: libc::c_long) -> std::io::Result<()> {
    let f = File::open(p)?;
    // SAFETY: FS_IOC_SETFLAGS reads one long from `flags`.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), 0x4008_6602, &flags) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// chattr +i and +a through the kernel: an immutable file cannot be opened for
/// writing, truncated, chmodded, renamed, linked or unlinked, and an immutable
/// directory takes no new name; an append-only file takes O_APPEND writes only.
/// The flags read back, survive a remount, and cleared, everything works again.
#[test]
fn chattr_immutable_and_append_only() {
    const IMM: libc::c_long = 0x10;
    const APP: libc::c_long = 0x20;
    let eperm = |r: std::io::Result<()>| {
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EPERM));
    };
    let mut m = Mount::new();
    let (f, g, d) = (m.path("f"), m.path("g"), m.path("d"));
    fs::write(&f, b"fixed").unwrap();
    fs::write(&g, b"log:").unwrap();
    fs::create_dir(&d).unwrap();
    assert_eq!(get_flags(&f), 0);
    set_flags(&f, IMM).unwrap();
    set_flags(&g, APP).unwrap();
    set_flags(&d, IMM).unwrap();
    assert_eq!(
        set_flags(&f, 0x4).unwrap_err().raw_os_error(),
        Some(libc::EOPNOTSUPP),
        "compression is not kept"
    );
    let check = |m: &Mount| {
        assert_eq!(get_flags(&f), IMM);
        assert_eq!(get_flags(&g), APP);
        assert_eq!(get_flags(&d), IMM);
        eperm(OpenOptions::new().write(true).open(&f).map(drop));
        eperm(OpenOptions::new().append(true).open(&f).map(drop));
        eperm(fs::set_permissions(&f, fs::Permissions::from_mode(0o600)));
        eperm(fs::rename(&f, m.path("f2")));
        eperm(fs::hard_link(&f, m.path("f3")));
        eperm(fs::remove_file(&f));
        eperm(File::create(d.join("new")).map(drop));
        assert_eq!(fs::read(&f).unwrap(), b"fixed");
        eperm(OpenOptions::new().write(true).open(&g).map(drop));
        eperm(File::create(&g).map(drop));
        eperm(fs::remove_file(&g));
    };
    check(&m);
    let mut a = OpenOptions::new().append(true).open(&g).unwrap();
    a.write_all(b" one").unwrap();
    a.sync_all().unwrap();
    drop(a);
    m.remount();
    check(&m);
    assert_eq!(fs::read(&g).unwrap(), b"log: one");
    for p in [&f, &g, &d] {
        set_flags(p, 0).unwrap();
    }
    fs::write(&f, b"free").unwrap();
    fs::write(d.join("new"), b"").unwrap();
    fs::remove_file(&g).unwrap();
    assert_eq!(fs::read(&f).unwrap(), b"free");
    m.unmount();
}

#[test]
fn fsync_and_fdatasync_on_files_and_directories() {
    let mut m = Mount::new();
    {
        let mut f = File::create(m.path("f")).unwrap();
        f.write_all(b"durable").unwrap();
        f.sync_data().unwrap();
        f.write_all(b" data").unwrap();
        f.sync_all().unwrap();
    }
    File::open(m.path("f")).unwrap().sync_all().unwrap();
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/g"), b"in d").unwrap();
    File::open(m.path("d")).unwrap().sync_all().unwrap();
    File::open(m.path("d")).unwrap().sync_data().unwrap();
    File::open(m.root()).unwrap().sync_all().unwrap();
    m.remount();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"durable data");
    assert_eq!(fs::read(m.path("d/g")).unwrap(), b"in d");
    m.unmount();
}

/// Other tests rely on this: unprivileged users can traverse the root.
#[test]
fn fresh_filesystem_root_directory() {
    let mut m = Mount::new();
    let s = stat(m.root());
    assert!(s.is_dir());
    assert_eq!(perm(s.mode()), 0o755, "mode of a fresh root");
    assert_eq!((s.uid(), s.gid()), (0, 0), "owner of a fresh root");
    assert_eq!(s.nlink(), 2, "nlink of an empty root");
    assert!(list_dir(m.root()).is_empty(), "a fresh root is empty");
    let raw = readdir_raw(m.root()).unwrap();
    let mut names: Vec<&[u8]> = raw.iter().map(|e| &e.name[..]).collect();
    names.sort();
    assert_eq!(names, vec![&b"."[..], &b".."[..]]);
    assert_eq!(dirent_ino(m.root(), "."), s.ino());
    m.unmount();
}

// ---------------------------------------------------------------------------
// mkdir / rmdir / unlink
// ---------------------------------------------------------------------------

#[test]
fn mkdir_rmdir_errors_and_directory_link_counts() {
    let mut m = Mount::new();
    let um = current_umask();
    let root_links = stat(m.root()).nlink();
    let p = m.path("p");
    fs::create_dir(&p).unwrap();
    assert_eq!(
        stat(m.root()).nlink(),
        root_links + 1,
        "mkdir increments the parent's nlink"
    );
    let md = stat(&p);
    assert!(md.is_dir());
    assert_eq!(md.nlink(), 2, "a new directory has nlink 2");
    assert_eq!(perm(md.mode()), 0o777 & !um);
    assert_eq!((md.uid(), md.gid()), (0, 0));

    fs::create_dir(p.join("a")).unwrap();
    assert_eq!(stat(&p).nlink(), 3);
    assert_eq!(stat(&p.join("a")).nlink(), 2);
    fs::create_dir(p.join("b")).unwrap();
    assert_eq!(stat(&p).nlink(), 4);
    fs::write(p.join("f"), b"").unwrap();
    assert_eq!(
        stat(&p).nlink(),
        4,
        "a file does not add a link to its parent"
    );
    DirBuilder::new().mode(0o700).create(p.join("c")).unwrap();
    assert_eq!(perm(stat(&p.join("c")).mode()), 0o700 & !um);
    assert_eq!(stat(&p).nlink(), 5);

    expect_errno(
        fs::create_dir(p.join("a")),
        libc::EEXIST,
        "mkdir an existing directory",
    );
    expect_errno(
        fs::create_dir(p.join("f")),
        libc::EEXIST,
        "mkdir over an existing file",
    );
    fs::write(p.join("a/x"), b"x").unwrap();
    expect_errno(
        fs::remove_dir(p.join("a")),
        libc::ENOTEMPTY,
        "rmdir a non-empty directory",
    );
    fs::create_dir(p.join("b/sub")).unwrap();
    assert_eq!(stat(&p.join("b")).nlink(), 3);
    expect_errno(
        fs::remove_dir(p.join("b")),
        libc::ENOTEMPTY,
        "rmdir a directory holding an empty directory",
    );
    expect_errno(fs::remove_dir(p.join("f")), libc::ENOTDIR, "rmdir a file");
    expect_errno(
        fs::remove_file(p.join("a")),
        libc::EISDIR,
        "unlink a directory",
    );
    expect_errno(
        fs::remove_dir(p.join("missing")),
        libc::ENOENT,
        "rmdir a missing name",
    );
    expect_errno(
        fs::remove_file(p.join("missing")),
        libc::ENOENT,
        "unlink a missing name",
    );
    expect_errno(fs::remove_dir(p.join("a/.")), libc::EINVAL, "rmdir dir/.");

    m.remount();
    assert_eq!(stat(&p).nlink(), 5);
    assert_eq!(stat(&p.join("a")).nlink(), 2);
    assert_eq!(stat(&p.join("b")).nlink(), 3);
    assert_eq!(stat(&p.join("c")).nlink(), 2);
    assert_eq!(stat(m.root()).nlink(), root_links + 1);

    fs::remove_file(p.join("a/x")).unwrap();
    fs::remove_dir(p.join("a")).unwrap();
    assert_eq!(stat(&p).nlink(), 4, "rmdir decrements the parent's nlink");
    fs::remove_dir(p.join("b/sub")).unwrap();
    assert_eq!(stat(&p.join("b")).nlink(), 2);
    fs::remove_dir(p.join("b")).unwrap();
    fs::remove_dir(p.join("c")).unwrap();
    assert_eq!(stat(&p).nlink(), 2);
    fs::remove_file(p.join("f")).unwrap();
    assert!(list_dir(&p).is_empty());
    fs::remove_dir(&p).unwrap();
    assert_eq!(stat(m.root()).nlink(), root_links);
    expect_errno(fs::metadata(&p), libc::ENOENT, "stat a removed directory");
    m.remount();
    expect_errno(
        fs::metadata(&p),
        libc::ENOENT,
        "removed directory after remount",
    );
    assert_eq!(stat(m.root()).nlink(), root_links);
    m.unmount();
}

// ---------------------------------------------------------------------------
// names
// ---------------------------------------------------------------------------

#[test]
fn name_length_limits() {
    let mut m = Mount::new();
    let n = |c: char, len: usize| c.to_string().repeat(len);
    let src = m.path("src");
    fs::write(&src, b"data").unwrap();

    // 255 bytes work for every kind of name
    fs::write(m.path(n('a', 255)), b"255").unwrap();
    fs::create_dir(m.path(n('b', 255))).unwrap();
    symlink("src", m.path(n('c', 255))).unwrap();
    fs::hard_link(&src, m.path(n('d', 255))).unwrap();
    fs::write(m.path("tmp"), b"renamed").unwrap();
    fs::rename(m.path("tmp"), m.path(n('e', 255))).unwrap();
    mkfifo(&m.path(n('f', 255)), 0o644).unwrap();
    // 255 bytes of UTF-8 (127 two-byte characters and one byte)
    let utf8 = format!("{}x", "\u{e9}".repeat(127));
    assert_eq!(utf8.len(), 255);
    fs::write(m.path(&utf8), b"utf8").unwrap();
    fs::create_dir(m.path("sub")).unwrap();
    fs::write(m.path("sub").join(n('g', 255)), b"in sub").unwrap();

    assert_eq!(fs::read(m.path(n('a', 255))).unwrap(), b"255");
    assert!(stat(&m.path(n('b', 255))).is_dir());
    assert_eq!(
        fs::read_link(m.path(n('c', 255))).unwrap(),
        PathBuf::from("src")
    );
    assert_eq!(stat(&src).nlink(), 2);
    assert_eq!(fs::read(m.path(n('e', 255))).unwrap(), b"renamed");
    assert!(lstat(&m.path(n('f', 255))).file_type().is_fifo());
    assert_eq!(fs::read(m.path(&utf8)).unwrap(), b"utf8");

    let mut expected = vec![
        "src".to_string(),
        "sub".to_string(),
        n('a', 255),
        n('b', 255),
        n('c', 255),
        n('d', 255),
        n('e', 255),
        n('f', 255),
        utf8.clone(),
    ];
    expected.sort();
    assert_eq!(list_dir(m.root()), expected);

    // 256 bytes fail with ENAMETOOLONG
    expect_errno(
        File::create(m.path(n('A', 256))),
        libc::ENAMETOOLONG,
        "create 256",
    );
    expect_errno(
        fs::create_dir(m.path(n('B', 256))),
        libc::ENAMETOOLONG,
        "mkdir 256",
    );
    expect_errno(
        symlink("src", m.path(n('C', 256))),
        libc::ENAMETOOLONG,
        "symlink 256",
    );
    expect_errno(
        fs::hard_link(&src, m.path(n('D', 256))),
        libc::ENAMETOOLONG,
        "link 256",
    );
    expect_errno(
        fs::rename(&src, m.path(n('E', 256))),
        libc::ENAMETOOLONG,
        "rename to 256",
    );
    expect_errno(
        mkfifo(&m.path(n('F', 256)), 0o644),
        libc::ENAMETOOLONG,
        "mkfifo 256",
    );
    expect_errno(
        fs::create_dir(m.path("sub").join(n('G', 256))),
        libc::ENAMETOOLONG,
        "mkdir 256 in a subdirectory",
    );
    expect_errno(
        fs::symlink_metadata(m.path(n('H', 256))),
        libc::ENAMETOOLONG,
        "lstat 256",
    );

    // nothing changed
    assert_eq!(fs::read(&src).unwrap(), b"data");
    assert_eq!(stat(&src).nlink(), 2);
    assert_eq!(list_dir(m.root()), expected);

    m.remount();
    assert_eq!(list_dir(m.root()), expected);
    assert_eq!(list_dir(&m.path("sub")), vec![n('g', 255)]);
    assert_eq!(fs::read(m.path(n('d', 255))).unwrap(), b"data");
    assert_eq!(fs::read(m.path(&utf8)).unwrap(), b"utf8");
    m.unmount();
}

// ---------------------------------------------------------------------------
// link / symlink
// ---------------------------------------------------------------------------

#[test]
fn hard_links() {
    let mut m = Mount::new();
    fs::create_dir(m.path("d")).unwrap();
    let a = m.path("a");
    let b = m.path("d/b");
    fs::write(&a, b"original").unwrap();
    let ino = stat(&a).ino();
    let a0 = stat(&a);
    let d0 = stat(&m.path("d"));
    tick();
    fs::hard_link(&a, &b).unwrap();
    let (sa, sb) = (stat(&a), stat(&b));
    assert_eq!(sa.nlink(), 2);
    assert_eq!(sb.nlink(), 2);
    assert_eq!(sb.ino(), ino);
    assert!(ctime(&sa) > ctime(&a0), "link updates the file's ctime");
    assert_eq!(mtime(&sa), mtime(&a0), "link leaves the file's mtime alone");
    let d1 = stat(&m.path("d"));
    assert!(
        mtime(&d1) > mtime(&d0),
        "link updates the new parent's mtime"
    );
    assert!(
        ctime(&d1) > ctime(&d0),
        "link updates the new parent's ctime"
    );
    assert_eq!(fs::read(&b).unwrap(), b"original");

    // a write through one name shows through the other
    {
        let f = OpenOptions::new().write(true).open(&b).unwrap();
        f.write_all_at(b"ORIG", 0).unwrap();
    }
    assert_eq!(fs::read(&a).unwrap(), b"ORIGinal");
    fs::hard_link(&b, m.path("c")).unwrap();
    assert_eq!(stat(&a).nlink(), 3);

    expect_errno(
        fs::hard_link(&a, &b),
        libc::EEXIST,
        "link onto an existing name",
    );
    expect_errno(
        fs::hard_link(m.path("missing"), m.path("x")),
        libc::ENOENT,
        "link a missing file",
    );
    expect_errno(
        fs::hard_link(m.path("d"), m.path("dlink")),
        libc::EPERM,
        "link to a directory",
    );
    expect_errno(
        fs::hard_link(&a, m.path("nodir/x")),
        libc::ENOENT,
        "link into a missing directory",
    );

    // unlinking one name keeps the others
    fs::remove_file(&a).unwrap();
    expect_errno(fs::metadata(&a), libc::ENOENT, "removed name");
    assert_eq!(stat(&b).nlink(), 2);
    assert_eq!(fs::read(&b).unwrap(), b"ORIGinal");

    m.remount();
    assert_eq!(stat(&b).nlink(), 2);
    assert_eq!(stat(&b).ino(), ino);
    assert_eq!(stat(&m.path("c")).ino(), ino);
    assert_eq!(fs::read(m.path("c")).unwrap(), b"ORIGinal");
    fs::remove_file(m.path("c")).unwrap();
    assert_eq!(stat(&b).nlink(), 1);
    m.remount();
    assert_eq!(stat(&b).nlink(), 1);
    assert_eq!(fs::read(&b).unwrap(), b"ORIGinal");
    m.unmount();
}

/// Hundreds of links with long names to one file in one directory (more than one
/// tree item holds, so most are extended refs): all made through the kernel, all
/// there after a remount, and removed one by one down to the last.
#[test]
fn hundreds_of_long_links_to_one_file_in_one_directory() {
    let mut m = Mount::new();
    fs::create_dir(m.path("d")).unwrap();
    let a = m.path("a");
    fs::write(&a, b"shared").unwrap();
    let d = m.path("d");
    let name = |i: usize| d.join(format!("{i:04}{}", "L".repeat(250)));
    const N: usize = 300;
    for i in 0..N {
        fs::hard_link(&a, name(i)).unwrap();
    }
    assert_eq!(stat(&a).nlink() as usize, N + 1);
    m.remount();
    assert_eq!(stat(&a).nlink() as usize, N + 1);
    assert_eq!(fs::read_dir(&d).unwrap().count(), N);
    for i in (0..N).rev().step_by(3) {
        assert_eq!(fs::read(name(i)).unwrap(), b"shared");
        fs::remove_file(name(i)).unwrap();
    }
    let left = N - N.div_ceil(3);
    assert_eq!(stat(&a).nlink() as usize, left + 1);
    m.remount();
    assert_eq!(fs::read_dir(&d).unwrap().count(), left);
    assert_eq!(stat(&a).nlink() as usize, left + 1);
    for e in fs::read_dir(&d).unwrap() {
        fs::remove_file(e.unwrap().path()).unwrap();
    }
    assert_eq!(stat(&a).nlink(), 1);
    assert_eq!(fs::read(&a).unwrap(), b"shared");
    m.unmount();
}

fn long_symlink_target(len: usize) -> String {
    let mut s = String::new();
    while s.len() + 201 <= len {
        s.push_str(&"x".repeat(200));
        s.push('/');
    }
    while s.len() < len {
        s.push('y');
    }
    assert_eq!(s.len(), len);
    s
}

#[test]
fn symlinks_and_readlink() {
    let mut m = Mount::new();
    fs::write(m.path("t"), b"12345").unwrap();
    let targets: Vec<String> = vec![
        "t".to_string(),
        "some/../odd//path/".to_string(),
        "/absolute/path/that/does/not/exist".to_string(),
        " spaces and \u{e9}\u{1F333} ".to_string(),
        long_symlink_target(4095),
    ];
    for (i, t) in targets.iter().enumerate() {
        let l = m.path(format!("l{i}"));
        symlink(t, &l).unwrap();
        let md = lstat(&l);
        assert!(
            md.file_type().is_symlink(),
            "lstat of l{i} is not a symlink"
        );
        assert_eq!(
            md.len(),
            t.len() as u64,
            "st_size of a symlink is its target's length"
        );
        assert_eq!(perm(md.mode()), 0o777, "symlink permission bits");
        assert_eq!(md.nlink(), 1);
        assert_eq!(
            fs::read_link(&l).unwrap().as_os_str().as_bytes(),
            t.as_bytes()
        );
    }
    expect_errno(
        symlink(long_symlink_target(4096), m.path("too-long")),
        libc::ENAMETOOLONG,
        "symlink target of 4096 bytes",
    );

    // stat follows, lstat does not
    let st = stat(&m.path("l0"));
    assert!(st.is_file());
    assert_eq!(st.len(), 5);
    assert_eq!(st.ino(), stat(&m.path("t")).ino());
    assert_ne!(lstat(&m.path("l0")).ino(), st.ino());
    assert_eq!(fs::read(m.path("l0")).unwrap(), b"12345");
    expect_errno(
        fs::metadata(m.path("l2")),
        libc::ENOENT,
        "stat a dangling symlink",
    );

    // through a symlink to a directory
    fs::create_dir(m.path("dir")).unwrap();
    symlink("dir", m.path("ldir")).unwrap();
    fs::write(m.path("ldir/inner"), b"in").unwrap();
    assert_eq!(fs::read(m.path("dir/inner")).unwrap(), b"in");

    // loops
    symlink("loop2", m.path("loop1")).unwrap();
    symlink("loop1", m.path("loop2")).unwrap();
    expect_errno(
        File::open(m.path("loop1")),
        libc::ELOOP,
        "open a symlink loop",
    );

    expect_errno(
        symlink("x", m.path("t")),
        libc::EEXIST,
        "symlink onto an existing name",
    );
    expect_errno(
        fs::read_link(m.path("t")),
        libc::EINVAL,
        "readlink a regular file",
    );

    // removing a symlink leaves its target
    fs::remove_file(m.path("ldir")).unwrap();
    assert!(stat(&m.path("dir")).is_dir());

    m.remount();
    for (i, t) in targets.iter().enumerate() {
        let l = m.path(format!("l{i}"));
        assert_eq!(
            fs::read_link(&l).unwrap().as_os_str().as_bytes(),
            t.as_bytes()
        );
        assert_eq!(lstat(&l).len(), t.len() as u64);
    }
    assert_eq!(fs::read(m.path("l0")).unwrap(), b"12345");
    m.unmount();
}

// ---------------------------------------------------------------------------
// rename
// ---------------------------------------------------------------------------

#[test]
fn rename_file_over_file() {
    let mut m = Mount::new();
    let (a, b, b2) = (m.path("a"), m.path("b"), m.path("b2"));
    fs::write(&a, b"AAAA").unwrap();
    fs::write(&b, b"BBBBBB").unwrap();
    fs::hard_link(&b, &b2).unwrap();
    let ia = stat(&a).ino();
    let ib = stat(&b).ino();
    let mut old_b = File::open(&b).unwrap();

    fs::rename(&a, &b).unwrap();
    expect_errno(fs::metadata(&a), libc::ENOENT, "old name after rename");
    let sb = stat(&b);
    assert_eq!(
        sb.ino(),
        ia,
        "the target name now refers to the source inode"
    );
    assert_eq!(sb.nlink(), 1);
    assert_eq!(fs::read(&b).unwrap(), b"AAAA");
    let sb2 = stat(&b2);
    assert_eq!(sb2.ino(), ib);
    assert_eq!(sb2.nlink(), 1, "the replaced inode lost one link");
    assert_eq!(fs::read(&b2).unwrap(), b"BBBBBB");
    let mut s = Vec::new();
    old_b.read_to_end(&mut s).unwrap();
    assert_eq!(
        s, b"BBBBBB",
        "an open descriptor of the replaced file still reads it"
    );
    drop(old_b);

    // replacing the last link of a file
    fs::write(m.path("c"), b"CC").unwrap();
    fs::rename(&b2, m.path("c")).unwrap();
    assert_eq!(stat(&m.path("c")).ino(), ib);
    assert_eq!(fs::read(m.path("c")).unwrap(), b"BBBBBB");

    // across directories
    fs::create_dir(m.path("d")).unwrap();
    fs::rename(&b, m.path("d/moved")).unwrap();
    assert_eq!(stat(&m.path("d/moved")).ino(), ia);

    expect_errno(
        fs::rename(m.path("nope"), m.path("x")),
        libc::ENOENT,
        "rename a missing file",
    );
    expect_errno(
        fs::rename(m.path("c"), m.path("nodir/x")),
        libc::ENOENT,
        "rename into a missing directory",
    );
    expect_errno(
        fs::rename(m.path("c"), m.path("d/moved/x")),
        libc::ENOTDIR,
        "rename below a file",
    );

    m.remount();
    expect_errno(fs::metadata(&a), libc::ENOENT, "a after remount");
    expect_errno(fs::metadata(&b), libc::ENOENT, "b after remount");
    expect_errno(fs::metadata(&b2), libc::ENOENT, "b2 after remount");
    assert_eq!(fs::read(m.path("d/moved")).unwrap(), b"AAAA");
    assert_eq!(stat(&m.path("d/moved")).ino(), ia);
    assert_eq!(fs::read(m.path("c")).unwrap(), b"BBBBBB");
    assert_eq!(stat(&m.path("c")).nlink(), 1);
    assert_eq!(list_dir(m.root()), vec!["c", "d"]);
    m.unmount();
}

#[test]
fn rename_directories_and_error_cases() {
    let mut m = Mount::new();
    let p = m.path("p");
    fs::create_dir(&p).unwrap();
    for d in ["d1", "d2", "full", "d1/sub"] {
        fs::create_dir(p.join(d)).unwrap();
    }
    fs::write(p.join("full/x"), b"x").unwrap();
    fs::write(p.join("file"), b"f").unwrap();
    assert_eq!(stat(&p).nlink(), 5);
    let i1 = stat(&p.join("d1")).ino();

    // directory over an empty directory
    fs::rename(p.join("d1"), p.join("d2")).unwrap();
    expect_errno(fs::metadata(p.join("d1")), libc::ENOENT, "d1 after rename");
    assert_eq!(stat(&p.join("d2")).ino(), i1);
    assert!(stat(&p.join("d2/sub")).is_dir());
    assert_eq!(
        stat(&p).nlink(),
        4,
        "the replaced directory's '..' link is gone"
    );
    assert_eq!(stat(&p.join("d2")).nlink(), 3);

    expect_errno(
        fs::rename(p.join("d2"), p.join("full")),
        libc::ENOTEMPTY,
        "directory over a non-empty directory",
    );
    expect_errno(
        fs::rename(p.join("file"), p.join("d2")),
        libc::EISDIR,
        "file over a directory",
    );
    expect_errno(
        fs::rename(p.join("d2"), p.join("file")),
        libc::ENOTDIR,
        "directory over a file",
    );
    expect_errno(
        fs::rename(p.join("d2"), p.join("d2/sub/inner")),
        libc::EINVAL,
        "directory into its own grandchild",
    );
    expect_errno(
        fs::rename(p.join("d2"), p.join("d2/new")),
        libc::EINVAL,
        "directory into itself",
    );

    // nothing moved
    let check = |m: &Mount| {
        let p = m.path("p");
        assert_eq!(list_dir(&p), vec!["d2", "file", "full"]);
        assert_eq!(stat(&p).nlink(), 4);
        assert_eq!(stat(&p.join("d2")).ino(), i1);
        assert_eq!(list_dir(&p.join("d2")), vec!["sub"]);
        assert_eq!(list_dir(&p.join("full")), vec!["x"]);
        assert_eq!(fs::read(p.join("file")).unwrap(), b"f");
    };
    check(&m);
    m.remount();
    check(&m);
    m.unmount();
}

#[test]
fn rename_to_itself_is_a_noop() {
    let mut m = Mount::new();
    let f = m.path("f");
    let g = m.path("g");
    let d = m.path("d");
    fs::write(&f, b"same").unwrap();
    fs::create_dir(&d).unwrap();
    let ino = stat(&f).ino();
    fs::rename(&f, &f).unwrap();
    assert_eq!(stat(&f).ino(), ino);
    assert_eq!(fs::read(&f).unwrap(), b"same");
    fs::rename(&d, &d).unwrap();
    assert!(stat(&d).is_dir());
    // two links of one file: rename(f, g) does nothing
    fs::hard_link(&f, &g).unwrap();
    fs::rename(&f, &g).unwrap();
    assert_eq!(stat(&f).ino(), ino);
    assert_eq!(stat(&g).ino(), ino);
    assert_eq!(stat(&f).nlink(), 2);
    m.remount();
    assert_eq!(list_dir(m.root()), vec!["d", "f", "g"]);
    assert_eq!(stat(&f).nlink(), 2);
    assert_eq!(fs::read(&g).unwrap(), b"same");
    m.unmount();
}

#[test]
fn rename_noreplace() {
    let mut m = Mount::new();
    let (a, b, c) = (m.path("a"), m.path("b"), m.path("c"));
    fs::write(&a, b"a").unwrap();
    fs::write(&b, b"b").unwrap();
    fs::create_dir(m.path("dir")).unwrap();
    let ia = stat(&a).ino();
    expect_errno(
        renameat2(&a, &b, RENAME_NOREPLACE),
        libc::EEXIST,
        "NOREPLACE onto a file",
    );
    expect_errno(
        renameat2(&a, &m.path("dir"), RENAME_NOREPLACE),
        libc::EEXIST,
        "NOREPLACE onto a directory",
    );
    assert_eq!(fs::read(&a).unwrap(), b"a");
    assert_eq!(fs::read(&b).unwrap(), b"b");
    renameat2(&a, &c, RENAME_NOREPLACE).unwrap();
    expect_errno(
        fs::metadata(&a),
        libc::ENOENT,
        "source after NOREPLACE rename",
    );
    assert_eq!(stat(&c).ino(), ia);
    assert_eq!(fs::read(&c).unwrap(), b"a");
    expect_errno(
        renameat2(&c, &b, RENAME_NOREPLACE | RENAME_EXCHANGE),
        libc::EINVAL,
        "NOREPLACE together with EXCHANGE",
    );
    m.remount();
    assert_eq!(list_dir(m.root()), vec!["b", "c", "dir"]);
    assert_eq!(fs::read(&c).unwrap(), b"a");
    m.unmount();
}

/// RENAME_WHITEOUT moves the entry and leaves a whiteout (a 0:0 character device
/// with mode 0) in its place, as overlayfs's upper layer needs.
#[test]
fn rename_whiteout_leaves_a_whiteout() {
    let mut m = Mount::new();
    let (a, b, c) = (m.path("a"), m.path("b"), m.path("c"));
    fs::write(&a, b"a").unwrap();
    fs::write(&c, b"c").unwrap();
    let ia = stat(&a).ino();
    expect_errno(
        renameat2(&a, &c, RENAME_WHITEOUT | RENAME_NOREPLACE),
        libc::EEXIST,
        "WHITEOUT|NOREPLACE onto a file",
    );
    expect_errno(
        renameat2(&a, &c, RENAME_WHITEOUT | RENAME_EXCHANGE),
        libc::EINVAL,
        "WHITEOUT with EXCHANGE",
    );
    assert_eq!(fs::read(&a).unwrap(), b"a");
    renameat2(&a, &b, RENAME_WHITEOUT).unwrap();
    assert_eq!(stat(&b).ino(), ia);
    let check_whiteout = |what: &str| {
        let w = fs::symlink_metadata(&a).unwrap();
        assert!(
            w.file_type().is_char_device(),
            "{what}: {:?}",
            w.file_type()
        );
        assert_eq!((w.rdev(), w.mode() & 0o7777), (0, 0), "{what}");
    };
    check_whiteout("after the rename");
    // Over an existing target, also for a directory.
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/in"), b"in").unwrap();
    renameat2(&m.path("d"), &c, RENAME_WHITEOUT).expect_err("a directory over a file");
    renameat2(&b, &c, RENAME_WHITEOUT).unwrap();
    renameat2(&m.path("d"), &m.path("e"), RENAME_WHITEOUT).unwrap();
    assert_eq!(fs::read(m.path("e/in")).unwrap(), b"in");
    m.remount();
    check_whiteout("after a remount");
    for n in ["b", "d"] {
        assert!(fs::symlink_metadata(m.path(n))
            .unwrap()
            .file_type()
            .is_char_device());
    }
    assert_eq!(fs::read(&c).unwrap(), b"a");
    assert_eq!(list_dir(m.root()), vec!["a", "b", "c", "d", "e"]);
    m.unmount();
    let ck = m.check();
    assert!(ck.status.success(), "check:\n{}", describe(&ck));
}

/// birchfs as overlayfs's upper layer (what container storage does): deleting and
/// renaming lower files leaves whiteouts that hide them, also across a remount.
#[test]
fn overlayfs_takes_birchfs_as_its_upper_layer() {
    let mut m = Mount::new();
    let lower = m.host_dir().join("lower");
    let merged = m.host_dir().join("merged");
    fs::create_dir_all(&lower).unwrap();
    fs::create_dir_all(&merged).unwrap();
    for n in ["gone", "moved", "kept"] {
        fs::write(lower.join(n), n.as_bytes()).unwrap();
    }
    fs::create_dir_all(m.path("upper")).unwrap();
    fs::create_dir_all(m.path("work")).unwrap();
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        m.path("upper").display(),
        m.path("work").display()
    );
    /// Detaches the overlay if the test fails while it is mounted.
    struct Detach<'a>(&'a Path);
    impl Drop for Detach<'_> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                let _ = Command::new("umount").arg("-l").arg(self.0).status();
            }
        }
    }
    let _detach = Detach(&merged);
    let mount_ovl = || {
        let out = run(
            Command::new("mount")
                .args(["-t", "overlay", "overlay", "-o", &opts])
                .arg(&merged),
            SHELL_TIMEOUT,
        );
        assert!(out.status.success(), "overlay mount: {}", describe(&out));
    };
    let umount_ovl = || {
        let out = run(Command::new("umount").arg(&merged), SHELL_TIMEOUT);
        assert!(out.status.success(), "overlay umount: {}", describe(&out));
    };
    mount_ovl();
    fs::remove_file(merged.join("gone")).unwrap();
    fs::rename(merged.join("moved"), merged.join("there")).unwrap();
    fs::write(merged.join("new"), b"new").unwrap();
    let view = |d: &Path| {
        assert_eq!(list_dir(d), vec!["kept", "new", "there"]);
        assert_eq!(fs::read(d.join("there")).unwrap(), b"moved");
    };
    view(&merged);
    umount_ovl();
    m.remount();
    mount_ovl();
    view(&merged);
    umount_ovl();
    m.unmount();
}

#[test]
fn rename_exchange() {
    let mut m = Mount::new();
    let (a, b) = (m.path("a"), m.path("b"));
    fs::write(&a, b"AAA").unwrap();
    fs::write(&b, b"BBBBB").unwrap();
    let (ia, ib) = (stat(&a).ino(), stat(&b).ino());

    // two files
    renameat2(&a, &b, RENAME_EXCHANGE).unwrap();
    assert_eq!(stat(&a).ino(), ib);
    assert_eq!(stat(&b).ino(), ia);
    assert_eq!(fs::read(&a).unwrap(), b"BBBBB");
    assert_eq!(fs::read(&b).unwrap(), b"AAA");

    // a file and a directory in the same parent
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    fs::write(d.join("inside"), b"in").unwrap();
    let id = stat(&d).ino();
    let root_links = stat(m.root()).nlink();
    renameat2(&a, &d, RENAME_EXCHANGE).unwrap();
    assert!(stat(&a).is_dir());
    assert_eq!(stat(&a).ino(), id);
    assert_eq!(fs::read(a.join("inside")).unwrap(), b"in");
    assert!(stat(&d).is_file());
    assert_eq!(stat(&d).ino(), ib);
    assert_eq!(fs::read(&d).unwrap(), b"BBBBB");
    assert_eq!(stat(m.root()).nlink(), root_links);

    // a directory and a file in different parents: the directory changes parent
    let (p1, p2) = (m.path("p1"), m.path("p2"));
    fs::create_dir(&p1).unwrap();
    fs::create_dir(&p2).unwrap();
    fs::create_dir(p1.join("sub")).unwrap();
    fs::write(p1.join("sub/x"), b"x in sub").unwrap();
    fs::write(p2.join("f"), b"file in p2").unwrap();
    let isub = stat(&p1.join("sub")).ino();
    let if2 = stat(&p2.join("f")).ino();
    assert_eq!(stat(&p1).nlink(), 3);
    assert_eq!(stat(&p2).nlink(), 2);
    renameat2(&p1.join("sub"), &p2.join("f"), RENAME_EXCHANGE).unwrap();

    expect_errno(
        renameat2(&b, &m.path("missing"), RENAME_EXCHANGE),
        libc::ENOENT,
        "EXCHANGE with a missing target",
    );
    expect_errno(
        renameat2(&m.path("missing"), &b, RENAME_EXCHANGE),
        libc::ENOENT,
        "EXCHANGE with a missing source",
    );

    let check = |m: &Mount| {
        let (a, b, d) = (m.path("a"), m.path("b"), m.path("d"));
        let (p1, p2) = (m.path("p1"), m.path("p2"));
        assert_eq!(stat(&a).ino(), id);
        assert_eq!(stat(&b).ino(), ia);
        assert_eq!(stat(&d).ino(), ib);
        assert_eq!(fs::read(&b).unwrap(), b"AAA");
        assert_eq!(fs::read(&d).unwrap(), b"BBBBB");
        assert_eq!(fs::read(a.join("inside")).unwrap(), b"in");
        assert_eq!(dirent_ino(&a, ".."), stat(m.root()).ino());

        let s1 = stat(&p1.join("sub"));
        assert!(s1.is_file());
        assert_eq!(s1.ino(), if2);
        assert_eq!(fs::read(p1.join("sub")).unwrap(), b"file in p2");
        let s2 = stat(&p2.join("f"));
        assert!(s2.is_dir());
        assert_eq!(s2.ino(), isub);
        assert_eq!(fs::read(p2.join("f/x")).unwrap(), b"x in sub");
        assert_eq!(stat(&p1).nlink(), 2, "p1 lost the subdirectory");
        assert_eq!(stat(&p2).nlink(), 3, "p2 gained the subdirectory");
        assert_eq!(stat(&p2.join("f/..")).ino(), stat(&p2).ino());
        assert_eq!(
            dirent_ino(&p2.join("f"), ".."),
            stat(&p2).ino(),
            "'..' entry of the moved directory"
        );
        assert_eq!(dirent_ino(&p2.join("f"), "."), isub);
    };
    check(&m);
    m.remount();
    check(&m);
    m.unmount();
}

#[test]
fn rename_directory_across_parents_updates_dotdot_and_link_counts() {
    let mut m = Mount::new();
    let (p1, p2) = (m.path("p1"), m.path("p2"));
    fs::create_dir(&p1).unwrap();
    fs::create_dir(&p2).unwrap();
    fs::create_dir(p1.join("d")).unwrap();
    fs::create_dir(p1.join("d/sub")).unwrap();
    fs::write(p1.join("d/file"), b"content").unwrap();
    let id = stat(&p1.join("d")).ino();
    assert_eq!(stat(&p1).nlink(), 3);
    assert_eq!(stat(&p2).nlink(), 2);
    let (t1, t2) = (stat(&p1), stat(&p2));
    tick();

    fs::rename(p1.join("d"), p2.join("d")).unwrap();

    let (s1, s2) = (stat(&p1), stat(&p2));
    assert!(
        mtime(&s1) > mtime(&t1),
        "rename updates the old parent's mtime"
    );
    assert!(
        ctime(&s1) > ctime(&t1),
        "rename updates the old parent's ctime"
    );
    assert!(
        mtime(&s2) > mtime(&t2),
        "rename updates the new parent's mtime"
    );
    assert!(
        ctime(&s2) > ctime(&t2),
        "rename updates the new parent's ctime"
    );

    let check = |m: &Mount| {
        let (p1, p2) = (m.path("p1"), m.path("p2"));
        let d = p2.join("d");
        expect_errno(fs::metadata(p1.join("d")), libc::ENOENT, "old name");
        assert_eq!(stat(&d).ino(), id);
        assert_eq!(stat(&p1).nlink(), 2);
        assert_eq!(stat(&p2).nlink(), 3);
        assert_eq!(stat(&d).nlink(), 3);
        assert_eq!(stat(&d.join("..")).ino(), stat(&p2).ino());
        assert_eq!(
            dirent_ino(&d, ".."),
            stat(&p2).ino(),
            "readdir '..' of the moved directory"
        );
        assert_eq!(dirent_ino(&d, "."), id);
        assert_eq!(dirent_ino(&d.join("sub"), ".."), id);
        assert_eq!(fs::read(d.join("file")).unwrap(), b"content");
    };
    check(&m);
    m.remount();
    check(&m);
    expect_errno(fs::remove_dir(&p2), libc::ENOTEMPTY, "rmdir the new parent");
    fs::remove_dir(&p1).unwrap();
    m.remount();
    assert_eq!(list_dir(m.root()), vec!["p2"]);
    m.unmount();
}

// ---------------------------------------------------------------------------
// mknod
// ---------------------------------------------------------------------------

#[test]
fn mknod_fifo_and_device_nodes() {
    let mut m = Mount::new();
    let um = current_umask();
    let cdev = makedev(12, 34);
    let bdev = makedev(259, 65_537);
    mkfifo(&m.path("fifo"), 0o644).unwrap();
    mknod(&m.path("fifo2"), libc::S_IFIFO | 0o600, 0).unwrap();
    mknod(&m.path("chr"), libc::S_IFCHR | 0o620, cdev).unwrap();
    mknod(&m.path("blk"), libc::S_IFBLK | 0o640, bdev).unwrap();
    mknod(&m.path("reg"), libc::S_IFREG | 0o644, 0).unwrap();
    mknod(&m.path("sock"), libc::S_IFSOCK | 0o644, 0).unwrap();
    expect_errno(
        mkfifo(&m.path("fifo"), 0o644),
        libc::EEXIST,
        "mkfifo over an existing name",
    );

    let check = |m: &Mount| {
        let s = lstat(&m.path("fifo"));
        assert!(s.file_type().is_fifo());
        assert_eq!(file_type_bits(s.mode()), libc::S_IFIFO);
        assert_eq!(perm(s.mode()), 0o644 & !um);
        assert_eq!(s.len(), 0);
        assert_eq!(s.nlink(), 1);
        assert_eq!((s.uid(), s.gid()), (0, 0));
        assert!(lstat(&m.path("fifo2")).file_type().is_fifo());
        let c = lstat(&m.path("chr"));
        assert!(c.file_type().is_char_device());
        assert_eq!(c.rdev(), cdev, "char device number");
        assert_eq!(perm(c.mode()), 0o620 & !um);
        let b = lstat(&m.path("blk"));
        assert!(b.file_type().is_block_device());
        assert_eq!(b.rdev(), bdev, "block device number");
        let r = lstat(&m.path("reg"));
        assert!(r.is_file());
        assert_eq!(r.len(), 0);
        assert!(lstat(&m.path("sock")).file_type().is_socket());
    };
    check(&m);
    m.remount();
    check(&m);
    m.unmount();
}

// ---------------------------------------------------------------------------
// chmod / chown
// ---------------------------------------------------------------------------

#[test]
fn chmod_stores_every_mode_bit() {
    let mut m = Mount::new();
    let f = m.path("f");
    let d = m.path("d");
    fs::write(&f, b"x").unwrap();
    fs::create_dir(&d).unwrap();
    for mode in [
        0o7777, 0o4755, 0o2755, 0o1755, 0o0000, 0o0644, 0o0777, 0o6711, 0o4750,
    ] {
        chmod(&f, mode).unwrap();
        let s = stat(&f);
        assert_eq!(perm(s.mode()), mode, "file mode {:o}", mode);
        assert_eq!(file_type_bits(s.mode()), libc::S_IFREG);
    }
    for mode in [0o7777, 0o2755, 0o0700, 0o3770, 0o1777] {
        chmod(&d, mode).unwrap();
        let s = stat(&d);
        assert_eq!(perm(s.mode()), mode, "directory mode {:o}", mode);
        assert_eq!(file_type_bits(s.mode()), libc::S_IFDIR);
    }
    fs::set_permissions(m.path("f"), fs::Permissions::from_mode(0o4750)).unwrap();
    // chmod through a symlink changes the target, not the link
    fs::write(m.path("t"), b"t").unwrap();
    symlink("t", m.path("l")).unwrap();
    chmod(&m.path("l"), 0o600).unwrap();
    assert_eq!(perm(stat(&m.path("t")).mode()), 0o600);
    assert_eq!(perm(lstat(&m.path("l")).mode()), 0o777);
    // only the owner (or root) may chmod
    let r = run_as(NOBODY, NOGROUP, || chmod(&f, 0o777));
    expect_errno(r, libc::EPERM, "chmod by a non-owner");

    m.remount();
    assert_eq!(perm(stat(&f).mode()), 0o4750);
    assert_eq!(perm(stat(&d).mode()), 0o1777);
    assert_eq!(perm(stat(&m.path("t")).mode()), 0o600);
    m.unmount();
}

#[test]
fn chown_rules() {
    let mut m = Mount::new();
    let f = m.path("f");
    fs::write(&f, b"data").unwrap();
    let ids = |p: &Path| {
        let s = stat(p);
        (s.uid(), s.gid())
    };
    let lids = |p: &Path| {
        let s = lstat(p);
        (s.uid(), s.gid())
    };

    chown(&f, 65534, 65533).unwrap();
    assert_eq!(ids(&f), (65534, 65533));
    chown(&f, u32::MAX, 1234).unwrap();
    assert_eq!(ids(&f), (65534, 1234), "uid -1 leaves the owner");
    chown(&f, 4321, u32::MAX).unwrap();
    assert_eq!(ids(&f), (4321, 1234), "gid -1 leaves the group");

    // lchown changes the link; chown through a link changes the target
    let l = m.path("l");
    symlink("f", &l).unwrap();
    lchown(&l, 11, 22).unwrap();
    assert_eq!(lids(&l), (11, 22));
    assert_eq!(ids(&f), (4321, 1234));
    chown(&l, 33, 44).unwrap();
    assert_eq!(ids(&f), (33, 44));
    assert_eq!(lids(&l), (11, 22));

    // chown of a regular file clears setuid and group-executable setgid
    chmod(&f, 0o6755).unwrap();
    chown(&f, 1000, 1000).unwrap();
    assert_eq!(perm(stat(&f).mode()), 0o755, "chown clears S_ISUID/S_ISGID");
    // directories keep them
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    chmod(&d, 0o2755).unwrap();
    chown(&d, 1000, 1000).unwrap();
    assert_eq!(perm(stat(&d).mode()), 0o2755);

    // unprivileged callers
    let g = m.path("g");
    fs::write(&g, b"nobody's").unwrap();
    chown(&g, NOBODY, NOGROUP).unwrap();
    expect_errno(
        run_as(NOBODY, NOGROUP, || chown(&f, NOBODY, u32::MAX)),
        libc::EPERM,
        "chown of someone else's file",
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || chown(&g, 0, u32::MAX)),
        libc::EPERM,
        "giving a file away",
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || chown(&g, u32::MAX, 0)),
        libc::EPERM,
        "chgrp to a group the owner is not in",
    );
    run_as(NOBODY, NOGROUP, || chown(&g, NOBODY, NOGROUP)).unwrap();
    run_as(NOBODY, NOGROUP, || chown(&g, u32::MAX, u32::MAX)).unwrap();
    let out = m.as_user(NOBODY, NOGROUP, "chown 65534 f");
    assert!(
        !out.status.success(),
        "chown by a non-owner succeeded:\n{}",
        describe(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"),
        "{}",
        describe(&out)
    );
    assert_eq!(ids(&f), (1000, 1000));
    assert_eq!(ids(&g), (NOBODY, NOGROUP));

    m.remount();
    assert_eq!(ids(&f), (1000, 1000));
    assert_eq!(perm(stat(&f).mode()), 0o755);
    assert_eq!(lids(&l), (11, 22));
    assert_eq!(ids(&d), (1000, 1000));
    assert_eq!(ids(&g), (NOBODY, NOGROUP));
    m.unmount();
}

#[test]
fn write_by_unprivileged_user_clears_setuid() {
    let mut m = Mount::new();
    let f = m.path("suid");
    fs::write(&f, b"0123456789").unwrap();
    chmod(&f, 0o6777).unwrap();
    assert_eq!(perm(stat(&f).mode()), 0o6777);
    run_as(NOBODY, NOGROUP, || -> std::io::Result<()> {
        let h = OpenOptions::new().write(true).open(&f)?;
        h.write_all_at(b"x", 3)?;
        Ok(())
    })
    .unwrap();
    let s = stat(&f);
    assert_eq!(
        perm(s.mode()),
        0o777,
        "a write by an unprivileged user clears S_ISUID and (group-executable) S_ISGID"
    );
    assert_eq!(fs::read(&f).unwrap(), b"012x456789");
    // root (CAP_FSETID) keeps the bits
    chmod(&f, 0o4755).unwrap();
    {
        let h = OpenOptions::new().write(true).open(&f).unwrap();
        h.write_all_at(b"y", 4).unwrap();
    }
    assert_eq!(perm(stat(&f).mode()), 0o4755);
    m.remount();
    assert_eq!(perm(stat(&f).mode()), 0o4755);
    assert_eq!(fs::read(&f).unwrap(), b"012xy56789");
    m.unmount();
}

// ---------------------------------------------------------------------------
// permissions (kernel checks through default_permissions)
// ---------------------------------------------------------------------------

/// A direct write by a caller without CAP_FSETID clears the set-id bits, and the
/// kernel sees the new mode at once (it decides set-id at exec on its cached mode).
#[test]
fn direct_write_by_unprivileged_user_clears_setuid_at_once() {
    let mut m = Mount::new();
    let f = m.path("suid");
    fs::write(&f, vec![7u8; 8192]).unwrap();
    // (nobody is not in the file's group, so S_ISGID goes also without g+x.)
    for (mode, want) in [
        (0o6777, 0o777),
        (0o4777, 0o777),
        (0o2777, 0o777),
        (0o2767, 0o767),
    ] {
        chmod(&f, mode).unwrap();
        assert_eq!(perm(stat(&f).mode()), mode);
        // In a process of its own (the kernel reads set-id from the inode it caches).
        let out = m.as_user(
            NOBODY,
            NOGROUP,
            "dd if=/dev/zero of=suid bs=4096 count=1 seek=2 oflag=direct conv=notrunc status=none",
        );
        assert!(
            out.status.success(),
            "direct write of {mode:o}: {}",
            describe(&out)
        );
        // stat(1) asks for the basic fields only, which the kernel answers from its
        // cache (std's metadata asks for the birth time too, which goes to the daemon).
        let out = run(
            Command::new("stat").args(["-c", "%a"]).arg(&f),
            SHELL_TIMEOUT,
        );
        let shown = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert_eq!(
            shown,
            format!("{want:o}"),
            "mode {mode:o} after a direct write"
        );
        assert_eq!(
            perm(stat(&f).mode()),
            want,
            "mode {mode:o} after a direct write"
        );
    }
    m.unmount();
}

/// With FUSE_HANDLE_KILLPRIV_V2 the kernel leaves clearing set-id bits to the
/// filesystem for truncate, fallocate and copy_file_range too: a caller without
/// CAP_FSETID loses them, root keeps them, a directory or a mode without group
/// execute keeps S_ISGID.
#[test]
fn truncate_fallocate_and_copy_by_unprivileged_user_clear_setuid() {
    let mut m = Mount::new();
    let f = m.path("suid");
    let src = m.path("src");
    fs::write(&f, vec![7u8; 8192]).unwrap();
    fs::write(&src, vec![9u8; 8192]).unwrap();
    chmod(&src, 0o644).unwrap();
    let as_nobody = |what: &str, op: &(dyn Fn(&File) -> std::io::Result<()> + Sync)| {
        chmod(&f, 0o6777).unwrap();
        run_as(NOBODY, NOGROUP, || {
            let h = OpenOptions::new().write(true).open(&f)?;
            op(&h)
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(
            perm(stat(&f).mode()),
            0o777,
            "{what} by nobody keeps set-id bits"
        );
    };
    as_nobody("ftruncate", &|h| h.set_len(4096));
    as_nobody("extending ftruncate", &|h| h.set_len(12288));
    as_nobody("fallocate", &|h| fallocate(h, 0, 0, 65536));
    as_nobody("copy_file_range", &|h| {
        let s = File::open(&src)?;
        let (mut a, mut b) = (0i64, 4096i64);
        // SAFETY: valid fds and offsets owned by this frame.
        let r =
            unsafe { libc::copy_file_range(s.as_raw_fd(), &mut a, h.as_raw_fd(), &mut b, 4096, 0) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    });
    // truncate(2) by path, and O_TRUNC
    chmod(&f, 0o6777).unwrap();
    run_as(NOBODY, NOGROUP, || truncate(&f, 100)).unwrap();
    assert_eq!(perm(stat(&f).mode()), 0o777, "truncate(2) by nobody");
    chmod(&f, 0o6777).unwrap();
    run_as(NOBODY, NOGROUP, || {
        OpenOptions::new().write(true).truncate(true).open(&f)
    })
    .unwrap();
    assert_eq!(perm(stat(&f).mode()), 0o777, "O_TRUNC by nobody");
    // S_ISGID without group execute goes when the caller is not in the file's group
    // (Linux 6.2 on), and stays when it is, for truncate, fallocate and writes alike.
    let in_group = |what: &str, gid: u32, op: &(dyn Fn(&File) -> std::io::Result<()> + Sync)| {
        std::os::unix::fs::chown(&f, None, Some(gid)).unwrap();
        chmod(&f, 0o6766).unwrap();
        run_as(NOBODY, NOGROUP, || {
            let h = OpenOptions::new().write(true).open(&f)?;
            op(&h)
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let want = if gid == NOGROUP { 0o2766 } else { 0o766 };
        assert_eq!(
            perm(stat(&f).mode()),
            want,
            "{what} by nobody, file group {gid}"
        );
    };
    for gid in [0, NOGROUP] {
        in_group("ftruncate", gid, &|h| h.set_len(10));
        in_group("fallocate", gid, &|h| fallocate(h, 0, 0, 65536));
        in_group("direct write", gid, &|h| {
            // Through a handle of its own: O_DIRECT writes are flagged by the kernel.
            let d = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&f)?;
            let _ = h;
            d.write_all_at(&[1u8; 4096], 0)
        });
    }
    std::os::unix::fs::chown(&f, None, Some(0)).unwrap();
    // root has CAP_FSETID
    chmod(&f, 0o6755).unwrap();
    truncate(&f, 50).unwrap();
    fallocate(&File::options().write(true).open(&f).unwrap(), 0, 0, 8192).unwrap();
    assert_eq!(perm(stat(&f).mode()), 0o6755, "root keeps set-id bits");
    m.remount();
    assert_eq!(perm(stat(&f).mode()), 0o6755);
    assert_eq!(fs::metadata(&f).unwrap().len(), 8192);
    m.unmount();
}

#[test]
fn permission_checks_for_an_unprivileged_user() {
    let mut m = Mount::new();
    let secret = m.path("secret");
    fs::write(&secret, b"top secret").unwrap();
    chmod(&secret, 0o600).unwrap();
    let out = m.as_user(NOBODY, NOGROUP, "cat secret");
    assert!(
        !out.status.success(),
        "cat of a 0600 root file succeeded:\n{}",
        describe(&out)
    );
    assert!(out.stdout.is_empty());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{}",
        describe(&out)
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || File::open(&secret)),
        libc::EACCES,
        "read 0600",
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || {
            OpenOptions::new().write(true).open(&secret)
        }),
        libc::EACCES,
        "write 0600",
    );

    // group bits: 0640 root:nogroup is readable by nobody, not writable
    let shared = m.path("shared");
    fs::write(&shared, b"for the group").unwrap();
    chown(&shared, 0, NOGROUP).unwrap();
    chmod(&shared, 0o640).unwrap();
    assert_eq!(
        run_as(NOBODY, NOGROUP, || fs::read(&shared)).unwrap(),
        b"for the group"
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || {
            OpenOptions::new().write(true).open(&shared)
        }),
        libc::EACCES,
        "write 0640 via the group",
    );
    // the owner class wins even when it grants less than the group class
    let own = m.path("own");
    fs::write(&own, b"own").unwrap();
    chown(&own, NOBODY, NOGROUP).unwrap();
    chmod(&own, 0o070).unwrap();
    expect_errno(
        run_as(NOBODY, NOGROUP, || fs::read(&own)),
        libc::EACCES,
        "owner with mode 0070",
    );

    // search permission
    let private = m.path("private");
    fs::create_dir(&private).unwrap();
    fs::write(private.join("file"), b"p").unwrap();
    chmod(&private, 0o700).unwrap();
    expect_errno(
        run_as(NOBODY, NOGROUP, || fs::metadata(private.join("file"))),
        libc::EACCES,
        "lookup in a 0700 directory",
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || fs::read_dir(&private)),
        libc::EACCES,
        "opendir of a 0700 directory",
    );
    chmod(&private, 0o711).unwrap();
    run_as(NOBODY, NOGROUP, || fs::metadata(private.join("file"))).unwrap();
    expect_errno(
        run_as(NOBODY, NOGROUP, || fs::read_dir(&private)),
        libc::EACCES,
        "opendir of a 0711 directory",
    );

    // write permission on directories
    let rodir = m.path("rodir");
    fs::create_dir(&rodir).unwrap();
    chmod(&rodir, 0o755).unwrap();
    fs::write(rodir.join("existing"), b"e").unwrap();
    chmod(&rodir.join("existing"), 0o666).unwrap();
    let out = m.as_user(NOBODY, NOGROUP, "touch rodir/x");
    assert!(
        !out.status.success(),
        "touch in a 0755 root directory succeeded:\n{}",
        describe(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{}",
        describe(&out)
    );
    let x = rodir.join("x");
    expect_errno(
        run_as(NOBODY, NOGROUP, || File::create(&x)),
        libc::EACCES,
        "create",
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || fs::create_dir(rodir.join("y"))),
        libc::EACCES,
        "mkdir",
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || fs::remove_file(rodir.join("existing"))),
        libc::EACCES,
        "unlink",
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || {
            fs::rename(rodir.join("existing"), rodir.join("z"))
        }),
        libc::EACCES,
        "rename",
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || symlink("t", rodir.join("l"))),
        libc::EACCES,
        "symlink",
    );
    // writing the 0666 file itself is allowed
    run_as(NOBODY, NOGROUP, || {
        fs::write(rodir.join("existing"), b"written")
    })
    .unwrap();
    assert_eq!(list_dir(&rodir), vec!["existing"]);
    assert_eq!(fs::read(rodir.join("existing")).unwrap(), b"written");
    m.unmount();
}

#[test]
fn sticky_directory_protects_other_users_files() {
    let mut m = Mount::new();
    let tmp = m.path("tmp");
    fs::create_dir(&tmp).unwrap();
    chmod(&tmp, 0o1777).unwrap();
    let rootf = tmp.join("root-file");
    fs::write(&rootf, b"r").unwrap();
    chmod(&rootf, 0o666).unwrap();

    expect_errno(
        run_as(NOBODY, NOGROUP, || fs::remove_file(&rootf)),
        libc::EPERM,
        "unlink root's file in a sticky directory",
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || fs::rename(&rootf, tmp.join("stolen"))),
        libc::EPERM,
        "rename root's file in a sticky directory",
    );
    let out = m.as_user(NOBODY, NOGROUP, "rm -f tmp/root-file");
    assert!(
        !out.status.success(),
        "rm in a sticky directory succeeded:\n{}",
        describe(&out)
    );
    // the mode still allows writing it
    run_as(NOBODY, NOGROUP, || fs::write(&rootf, b"w")).unwrap();
    // another user's file is protected too
    let other = tmp.join("other");
    run_as(1000, 1000, || fs::write(&other, b"o")).unwrap();
    expect_errno(
        run_as(NOBODY, NOGROUP, || fs::remove_file(&other)),
        libc::EPERM,
        "unlink user 1000's file",
    );
    // one's own file can go
    let mine = tmp.join("mine");
    run_as(NOBODY, NOGROUP, || {
        fs::write(&mine, b"m")?;
        fs::remove_file(&mine)
    })
    .unwrap();
    assert_eq!(list_dir(&tmp), vec!["other", "root-file"]);
    // the directory's owner may delete anything in it
    chown(&tmp, NOBODY, NOGROUP).unwrap();
    run_as(NOBODY, NOGROUP, || fs::remove_file(&rootf)).unwrap();
    assert_eq!(list_dir(&tmp), vec!["other"]);

    // without the sticky bit, write permission on the directory is enough
    let open = m.path("open");
    fs::create_dir(&open).unwrap();
    chmod(&open, 0o777).unwrap();
    fs::write(open.join("rf"), b"r").unwrap();
    run_as(NOBODY, NOGROUP, || fs::remove_file(open.join("rf"))).unwrap();
    assert!(list_dir(&open).is_empty());
    m.unmount();
}

#[test]
fn new_inodes_take_the_callers_uid_and_gid() {
    let mut m = Mount::new();
    let pubd = m.path("pub");
    fs::create_dir(&pubd).unwrap();
    chmod(&pubd, 0o777).unwrap();
    let out = m.as_user(
        NOBODY,
        NOGROUP,
        "cd pub && touch f && mkdir d && ln -s f l && mkfifo p && echo hi > e",
    );
    assert!(out.status.success(), "{}", describe(&out));
    run_as(1234, 5678, || -> std::io::Result<()> {
        File::create(pubd.join("g"))?;
        fs::create_dir(pubd.join("h"))?;
        symlink("g", pubd.join("i"))?;
        mkfifo(&pubd.join("j"), 0o600)?;
        Ok(())
    })
    .unwrap();
    fs::hard_link(pubd.join("g"), pubd.join("k")).unwrap();

    let check = |m: &Mount| {
        let pubd = m.path("pub");
        for name in ["f", "d", "l", "p", "e"] {
            let s = lstat(&pubd.join(name));
            assert_eq!((s.uid(), s.gid()), (NOBODY, NOGROUP), "owner of {name}");
        }
        for name in ["g", "h", "i", "j", "k"] {
            let s = lstat(&pubd.join(name));
            assert_eq!((s.uid(), s.gid()), (1234, 5678), "owner of {name}");
        }
        assert_eq!(stat(&pubd.join("k")).ino(), stat(&pubd.join("g")).ino());
        assert_eq!(fs::read(pubd.join("e")).unwrap(), b"hi\n");
    };
    check(&m);
    m.remount();
    check(&m);
    m.unmount();
}

#[test]
fn umask_is_applied_exactly_once() {
    let mut m = Mount::new();
    let out = m.as_user(
        0,
        0,
        "umask 027 && touch f && umask 0 && touch g && mkdir d && mkfifo p \
         && umask 077 && mkdir e && umask 022 && touch h && mkdir i",
    );
    assert!(out.status.success(), "{}", describe(&out));
    let check = |m: &Mount| {
        for (name, mode) in [
            ("f", 0o640),
            ("g", 0o666),
            ("d", 0o777),
            ("p", 0o666),
            ("e", 0o700),
            ("h", 0o644),
            ("i", 0o755),
        ] {
            assert_eq!(perm(lstat(&m.path(name)).mode()), mode, "mode of {name}");
        }
    };
    check(&m);
    m.remount();
    check(&m);
    m.unmount();
}

/// What a user makes in a setgid directory (open with O_CREAT, mkdir, mkfifo,
/// symlink) takes the directory's group, and a new directory its setgid bit, as on
/// a kernel filesystem; elsewhere the user's own group.
#[test]
fn a_setgid_directory_gives_its_group_to_what_is_made_in_it() {
    let mut m = Mount::new();
    for (d, mode) in [("shared", 0o2777), ("plain", 0o777)] {
        fs::create_dir(m.path(d)).unwrap();
        chown(&m.path(d), 0, 4242).unwrap();
        chmod(&m.path(d), mode).unwrap();
    }
    let out = m.as_user(
        1000,
        1000,
        "for d in shared plain; do touch $d/f && mkdir $d/d && mkfifo $d/p \
         && ln -s f $d/l || exit 1; done",
    );
    assert!(out.status.success(), "{}", describe(&out));
    let check = |m: &Mount| {
        for (d, gid) in [("shared", 4242), ("plain", 1000)] {
            for n in ["f", "d", "p", "l"] {
                let st = lstat(&m.path(format!("{d}/{n}")));
                assert_eq!((st.uid(), st.gid()), (1000, gid), "owner of {d}/{n}");
            }
            let sub = stat(&m.path(format!("{d}/d"))).mode();
            assert_eq!(sub & libc::S_ISGID != 0, d == "shared", "{d}/d: {sub:o}");
            let f = stat(&m.path(format!("{d}/f"))).mode();
            assert_eq!(f & libc::S_ISGID, 0, "{d}/f: {f:o}");
        }
    };
    check(&m);
    m.remount();
    check(&m);
    m.unmount();
}

// ---------------------------------------------------------------------------
// timestamps
// ---------------------------------------------------------------------------

#[test]
fn create_sets_all_times_and_updates_the_parent() {
    let mut m = Mount::new();
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    for kind in ["file", "dir", "symlink", "fifo", "mknod-reg"] {
        let p = d.join(kind);
        let d0 = stat(&d);
        tick();
        let w0 = now();
        match kind {
            "file" => File::create(&p).map(|_| ()),
            "dir" => fs::create_dir(&p),
            "symlink" => symlink("target", &p),
            "fifo" => mkfifo(&p, 0o644),
            "mknod-reg" => mknod(&p, libc::S_IFREG | 0o644, 0),
            _ => unreachable!(),
        }
        .unwrap();
        let w1 = now();
        let s = lstat(&p);
        assert_eq!(atime(&s), mtime(&s), "{kind}: atime == mtime at creation");
        assert_eq!(mtime(&s), ctime(&s), "{kind}: mtime == ctime at creation");
        assert_time_near(mtime(&s), w0, w1, kind);
        assert!(
            mtime(&s) > mtime(&d0),
            "{kind}: newer than the parent's old mtime"
        );
        let d1 = stat(&d);
        assert!(mtime(&d1) > mtime(&d0), "{kind}: parent mtime updated");
        assert!(ctime(&d1) > ctime(&d0), "{kind}: parent ctime updated");
    }
    m.unmount();
}

#[test]
fn write_and_truncate_update_mtime_and_ctime() {
    let mut m = Mount::new();
    let p = m.path("f");
    File::create(&p).unwrap();
    let s0 = stat(&p);
    tick();
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    f.write_all_at(b"some data", 0).unwrap();
    let s1 = f.metadata().unwrap();
    assert!(mtime(&s1) > mtime(&s0), "write updates mtime");
    assert!(ctime(&s1) > ctime(&s0), "write updates ctime");
    assert_eq!(s1.len(), 9);
    drop(f);
    let s2 = stat(&p);
    assert_eq!(
        mtime(&s2),
        mtime(&s1),
        "mtime must not move after the write returned"
    );
    assert_eq!(
        ctime(&s2),
        ctime(&s1),
        "ctime must not move after the write returned"
    );

    tick();
    OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(3)
        .unwrap();
    let s3 = stat(&p);
    assert!(mtime(&s3) > mtime(&s2), "ftruncate updates mtime");
    assert!(ctime(&s3) > ctime(&s2), "ftruncate updates ctime");
    assert_eq!(s3.len(), 3);
    tick();
    truncate(&p, 100).unwrap();
    let s4 = stat(&p);
    assert!(mtime(&s4) > mtime(&s3), "truncate updates mtime");
    assert!(ctime(&s4) > ctime(&s3), "truncate updates ctime");
    tick();
    drop(File::create(&p).unwrap());
    let s5 = stat(&p);
    assert!(mtime(&s5) > mtime(&s4), "O_TRUNC updates mtime");
    assert_eq!(s5.len(), 0);
    tick();
    {
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"appended").unwrap();
    }
    let s6 = stat(&p);
    assert!(mtime(&s6) > mtime(&s5), "append updates mtime");
    m.remount();
    let s7 = stat(&p);
    assert_eq!(mtime(&s7), mtime(&s6), "mtime persists exactly");
    assert_eq!(ctime(&s7), ctime(&s6), "ctime persists exactly");
    assert_eq!(fs::read(&p).unwrap(), b"appended");
    m.unmount();
}

/// With the kernel's writeback cache the kernel keeps a written file's times and
/// sends them itself when they change: what stat showed before a remount is what is
/// stored, also when the data reaches the daemon ticks after the write (here at an
/// fsync). Several files, so that some are written in the tick they were created in
/// (the kernel then sends no times at all).
#[test]
fn times_of_cached_writes_are_the_ones_the_kernel_showed() {
    let mut m = Mount::new();
    let names: Vec<String> = (0..6).map(|n| format!("f{n}")).collect();
    for name in &names {
        let f = open_rw_create(&m.path(name));
        f.write_all_at(b"written right after the create", 0)
            .unwrap();
        tick();
        f.sync_all().unwrap();
    }
    let before: Vec<_> = names.iter().map(|n| stat(&m.path(n))).collect();
    m.remount();
    for (name, s0) in names.iter().zip(&before) {
        let s1 = stat(&m.path(name));
        assert_eq!(
            mtime(&s1),
            mtime(s0),
            "{name}: mtime as the kernel showed it"
        );
        assert_eq!(
            ctime(&s1),
            ctime(s0),
            "{name}: ctime as the kernel showed it"
        );
    }
    m.unmount();
}

#[test]
fn metadata_changes_update_ctime_only() {
    let mut m = Mount::new();
    let f = m.path("f");
    fs::write(&f, b"data").unwrap();
    let d = m.path("d");
    fs::create_dir(&d).unwrap();

    for what in ["chmod", "chown", "setxattr", "removexattr", "link"] {
        let s0 = stat(&f);
        tick();
        match what {
            "chmod" => chmod(&f, 0o600),
            "chown" => chown(&f, 1000, 1000),
            "setxattr" => setxattr(&f, "user.t", b"v", 0),
            "removexattr" => removexattr(&f, "user.t"),
            "link" => fs::hard_link(&f, m.path("f2")),
            _ => unreachable!(),
        }
        .unwrap();
        let s1 = stat(&f);
        assert!(ctime(&s1) > ctime(&s0), "{what} updates ctime");
        assert_eq!(mtime(&s1), mtime(&s0), "{what} leaves mtime");
        assert_eq!(atime(&s1), atime(&s0), "{what} leaves atime");
    }
    let d0 = stat(&d);
    tick();
    chmod(&d, 0o700).unwrap();
    let d1 = stat(&d);
    assert!(
        ctime(&d1) > ctime(&d0),
        "chmod of a directory updates its ctime"
    );
    assert_eq!(
        mtime(&d1),
        mtime(&d0),
        "chmod of a directory leaves its mtime"
    );
    m.unmount();
}

#[test]
fn utimensat_sets_exact_nanoseconds() {
    let mut m = Mount::new();
    let f = m.path("f");
    let d = m.path("d");
    let l = m.path("l");
    fs::write(&f, b"data").unwrap();
    fs::create_dir(&d).unwrap();
    symlink("f", &l).unwrap();
    let at = (1_000_000_000, 123_456_789);
    let mt = (1_000_000_001, 987_654_321);

    let before = stat(&f);
    tick();
    utimens(&f, at, mt).unwrap();
    let s = stat(&f);
    assert_eq!(atime(&s), at);
    assert_eq!(mtime(&s), mt);
    assert!(ctime(&s) > ctime(&before), "utimensat updates ctime");

    // far from now, and at the nanosecond edges
    utimens(&f, (4_102_444_800, 999_999_999), (2_147_483_648, 1)).unwrap();
    let s = stat(&f);
    assert_eq!(atime(&s), (4_102_444_800, 999_999_999));
    assert_eq!(mtime(&s), (2_147_483_648, 1));
    utimens(&f, (0, 0), (1, 0)).unwrap();
    let s = stat(&f);
    assert_eq!(atime(&s), (0, 0));
    assert_eq!(mtime(&s), (1, 0));
    // before the epoch, with a fraction: -2.75 s is (-3 s, +0.25 s), stored as such
    // (fuser's decoding made it -3.25 s)
    utimens(&d, (-3, 250_000_000), (-1_000_000_000, 999_999_999)).unwrap();
    m.remount();
    let s = stat(&d);
    assert_eq!(atime(&s), (-3, 250_000_000), "atime before the epoch");
    assert_eq!(
        mtime(&s),
        (-1_000_000_000, 999_999_999),
        "mtime before the epoch"
    );

    // UTIME_OMIT leaves a time alone; UTIME_NOW takes the current time
    utimens(&f, at, mt).unwrap();
    utimens(&f, (0, UTIME_OMIT), (1_234_567_890, 42)).unwrap();
    let s = stat(&f);
    assert_eq!(atime(&s), at);
    assert_eq!(mtime(&s), (1_234_567_890, 42));
    let w0 = now();
    utimens(&f, (0, UTIME_NOW), (0, UTIME_OMIT)).unwrap();
    let w1 = now();
    let s = stat(&f);
    assert_time_near(atime(&s), w0, w1, "UTIME_NOW");
    assert_eq!(mtime(&s), (1_234_567_890, 42));
    utimens(&f, at, mt).unwrap();

    // directories and symlinks themselves
    let dt = ((1_500_000_000, 5), (1_600_000_000, 500_000_000));
    utimens(&d, dt.0, dt.1).unwrap();
    let lt = ((1_400_000_000, 7), (1_300_000_000, 999));
    utimensat(&l, lt.0, lt.1, libc::AT_SYMLINK_NOFOLLOW).unwrap();
    let sl = lstat(&l);
    assert_eq!((atime(&sl), mtime(&sl)), lt);
    assert_eq!(
        mtime(&stat(&f)),
        mt,
        "AT_SYMLINK_NOFOLLOW leaves the target"
    );

    // permission rules: explicit times need ownership; UTIME_NOW needs write access
    let g = m.path("g");
    fs::write(&g, b"g").unwrap();
    chmod(&g, 0o666).unwrap();
    expect_errno(
        run_as(NOBODY, NOGROUP, || utimens(&g, at, mt)),
        libc::EPERM,
        "explicit times by a non-owner",
    );
    run_as(NOBODY, NOGROUP, || {
        utimens(&g, (0, UTIME_NOW), (0, UTIME_NOW))
    })
    .unwrap();
    expect_errno(
        run_as(NOBODY, NOGROUP, || {
            utimens(&f, (0, UTIME_NOW), (0, UTIME_NOW))
        }),
        libc::EACCES,
        "UTIME_NOW without write access",
    );

    let check = |m: &Mount| {
        let s = stat(&m.path("f"));
        assert_eq!((atime(&s), mtime(&s)), (at, mt));
        let s = stat(&m.path("d"));
        assert_eq!((atime(&s), mtime(&s)), dt);
        let s = lstat(&m.path("l"));
        assert_eq!((atime(&s), mtime(&s)), lt);
    };
    check(&m);
    m.remount();
    check(&m);
    m.unmount();
}

#[test]
fn unlink_updates_parent_times_and_remaining_link_ctime() {
    let mut m = Mount::new();
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    fs::create_dir(d.join("sub")).unwrap();
    fs::write(d.join("a"), b"a").unwrap();
    fs::hard_link(d.join("a"), d.join("b")).unwrap();
    let (d0, a0) = (stat(&d), stat(&d.join("a")));
    tick();
    fs::remove_file(d.join("b")).unwrap();
    let (d1, a1) = (stat(&d), stat(&d.join("a")));
    assert!(mtime(&d1) > mtime(&d0), "unlink updates the parent's mtime");
    assert!(ctime(&d1) > ctime(&d0), "unlink updates the parent's ctime");
    assert!(
        ctime(&a1) > ctime(&a0),
        "unlink updates the remaining link's ctime"
    );
    assert_eq!(
        mtime(&a1),
        mtime(&a0),
        "unlink leaves the remaining link's mtime"
    );
    assert_eq!(a1.nlink(), 1);
    tick();
    fs::remove_dir(d.join("sub")).unwrap();
    let d2 = stat(&d);
    assert!(mtime(&d2) > mtime(&d1), "rmdir updates the parent's mtime");
    assert!(ctime(&d2) > ctime(&d1), "rmdir updates the parent's ctime");
    m.remount();
    let d3 = stat(&d);
    assert_eq!(mtime(&d3), mtime(&d2));
    assert_eq!(ctime(&d3), ctime(&d2));
    m.unmount();
}

#[test]
fn rename_updates_both_parents_times() {
    let mut m = Mount::new();
    let (p1, p2) = (m.path("p1"), m.path("p2"));
    fs::create_dir(&p1).unwrap();
    fs::create_dir(&p2).unwrap();
    fs::write(p1.join("f"), b"f").unwrap();
    let (s1, s2, f0) = (stat(&p1), stat(&p2), stat(&p1.join("f")));
    tick();
    fs::rename(p1.join("f"), p2.join("g")).unwrap();
    let (t1, t2, f1) = (stat(&p1), stat(&p2), stat(&p2.join("g")));
    assert!(mtime(&t1) > mtime(&s1), "old parent mtime");
    assert!(ctime(&t1) > ctime(&s1), "old parent ctime");
    assert!(mtime(&t2) > mtime(&s2), "new parent mtime");
    assert!(ctime(&t2) > ctime(&s2), "new parent ctime");
    assert_eq!(mtime(&f1), mtime(&f0), "rename leaves the file's mtime");
    tick();
    fs::rename(p2.join("g"), p2.join("h")).unwrap();
    let t3 = stat(&p2);
    assert!(
        mtime(&t3) > mtime(&t2),
        "same-directory rename updates its mtime"
    );
    m.unmount();
}

// ---------------------------------------------------------------------------
// truncate, fallocate, sparse files
// ---------------------------------------------------------------------------

#[test]
fn truncate_grow_shrink_and_regrow_reads_zeros() {
    let mut m = Mount::new();
    let a = m.path("a");
    let data = pattern(1, 10_000).to_vec();
    fs::write(&a, &data).unwrap();
    truncate(&a, 20_000).unwrap();
    let got = fs::read(&a).unwrap();
    assert_eq!(got.len(), 20_000);
    assert_bytes_eq(&got[..10_000], &data, 0, "data below the old size");
    assert!(is_zero(&got[10_000..]), "grown part reads zeros");
    truncate(&a, 3_000).unwrap();
    assert_eq!(stat(&a).len(), 3_000);
    assert_bytes_eq(&fs::read(&a).unwrap(), &data[..3_000], 0, "after shrink");
    truncate(&a, 9_000).unwrap();
    let got = fs::read(&a).unwrap();
    assert_eq!(got.len(), 9_000);
    assert_bytes_eq(&got[..3_000], &data[..3_000], 0, "after regrow");
    assert!(
        is_zero(&got[3_000..]),
        "old data past the cut must not come back"
    );

    // ftruncate inside a block, then regrow within the same block
    let b = m.path("b");
    let pat = pattern(2, 8192).to_vec();
    {
        let f = open_rw_create(&b);
        f.write_all_at(&pat, 0).unwrap();
        f.set_len(4097).unwrap();
        f.set_len(8192).unwrap();
        let mut buf = vec![0u8; 8192];
        f.read_exact_at(&mut buf, 0).unwrap();
        assert_bytes_eq(&buf[..4097], &pat[..4097], 0, "kept part");
        assert!(is_zero(&buf[4097..]), "regrown tail of the block");
        assert_eq!(f.metadata().unwrap().len(), 8192);
        // grow far beyond the image size, sparse
        f.set_len(5 * GIB).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 5 * GIB);
        let mut tail = vec![1u8; 4096];
        f.read_exact_at(&mut tail, 5 * GIB - 4096).unwrap();
        assert!(is_zero(&tail));
        f.set_len(8192).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 8192);
    }
    let c = m.path("c");
    fs::write(&c, b"something").unwrap();
    truncate(&c, 0).unwrap();
    assert_eq!(fs::read(&c).unwrap(), b"");
    truncate(&c, 12_345).unwrap();

    expect_errno(
        truncate(&m.path("missing"), 1),
        libc::ENOENT,
        "truncate a missing file",
    );
    fs::create_dir(m.path("d")).unwrap();
    expect_errno(
        truncate(&m.path("d"), 1),
        libc::EISDIR,
        "truncate a directory",
    );
    expect_errno(truncate(&c, -1), libc::EINVAL, "negative length");

    m.remount();
    let got = fs::read(&a).unwrap();
    assert_eq!(got.len(), 9_000);
    assert_bytes_eq(&got[..3_000], &data[..3_000], 0, "a after remount");
    assert!(is_zero(&got[3_000..]));
    let got = fs::read(&b).unwrap();
    assert_eq!(got.len(), 8192);
    assert_bytes_eq(&got[..4097], &pat[..4097], 0, "b after remount");
    assert!(is_zero(&got[4097..]));
    let got = fs::read(&c).unwrap();
    assert_eq!(got.len(), 12_345);
    assert!(is_zero(&got));
    m.unmount();
}

#[test]
fn fallocate_modes() {
    let mut m = Mount::new();
    let p = m.path("f");
    let f = open_rw_create(&p);
    fallocate(&f, 0, 0, MIB).unwrap();
    assert_eq!(f.metadata().unwrap().len(), MIB, "mode 0 extends the size");
    let mut buf = vec![1u8; MB];
    f.read_exact_at(&mut buf, 0).unwrap();
    assert!(is_zero(&buf), "preallocated space reads zeros");
    fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, MIB, MIB).unwrap();
    assert_eq!(
        f.metadata().unwrap().len(),
        MIB,
        "KEEP_SIZE does not change the size"
    );

    // data, then allocating over it keeps it
    let mut expected = Vec::with_capacity(4 * MB);
    for k in 0..3 {
        expected.extend_from_slice(pattern(70 + k, MB));
    }
    f.write_all_at(&expected, 0).unwrap();
    fallocate(&f, 0, 0, 3 * MIB).unwrap();
    fallocate(&f, 0, 2 * MIB, 2 * MIB).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 4 * MIB);
    expected.resize(4 * MB, 0);

    // an unaligned hole, an aligned one, and one past EOF
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    fallocate(&f, punch, 5_000, 70_000).unwrap();
    expected[5_000..75_000].fill(0);
    fallocate(&f, punch, MIB, MIB).unwrap();
    expected[MB..2 * MB].fill(0);
    fallocate(&f, punch, 10 * MIB, MIB).unwrap();
    assert_eq!(
        f.metadata().unwrap().len(),
        4 * MIB,
        "punching keeps the size"
    );
    expect_errno(
        fallocate(&f, libc::FALLOC_FL_PUNCH_HOLE, 0, 4096),
        libc::EOPNOTSUPP,
        "PUNCH_HOLE without KEEP_SIZE",
    );
    let mut got = vec![0u8; 4 * MB];
    f.read_exact_at(&mut got, 0).unwrap();
    assert_bytes_eq(&got, &expected, 0, "after fallocate/punch");
    // writing into a punched hole
    f.write_all_at(b"refill", 6_000).unwrap();
    expected[6_000..6_006].copy_from_slice(b"refill");
    drop(f);

    m.remount();
    let got = fs::read(&p).unwrap();
    assert_eq!(got.len(), 4 * MB);
    assert_bytes_eq(&got, &expected, 0, "after remount");
    m.unmount();
}

/// FALLOC_FL_ZERO_RANGE through a mount: zeros over data (partial blocks too),
/// the size kept with KEEP_SIZE and grown without it, and the same after a remount.
#[test]
fn fallocate_zero_range() {
    let mut m = Mount::new();
    let p = m.path("z");
    let f = open_rw_create(&p);
    let mut expected = Vec::with_capacity(3 * MB);
    for k in 0..3 {
        expected.extend_from_slice(pattern(81 + k, MB));
    }
    f.write_all_at(&expected, 0).unwrap();
    f.sync_all().unwrap();
    fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, 10_000, MIB).unwrap();
    expected[10_000..10_000 + MB].fill(0);
    fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, 2 * MIB + 5, 100).unwrap();
    expected[2 * MB + 5..2 * MB + 105].fill(0);
    let zk = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
    fallocate(&f, zk, 3 * MIB - 4096, MIB).unwrap();
    expected[3 * MB - 4096..].fill(0);
    assert_eq!(f.metadata().unwrap().len(), 3 * MIB, "KEEP_SIZE");
    let mut got = vec![0u8; 3 * MB];
    f.read_exact_at(&mut got, 0).unwrap();
    assert_bytes_eq(&got, &expected, 0, "after zero ranges");
    fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, 3 * MIB - 100, 200).unwrap();
    expected.resize(3 * MB + 100, 0);
    assert_eq!(f.metadata().unwrap().len(), 3 * MIB + 100, "grown");
    // Written again where it was zeroed.
    f.write_all_at(pattern(82, 8192), 20_480).unwrap();
    expected[20_480..20_480 + 8192].copy_from_slice(pattern(82, 8192));
    drop(f);
    m.remount();
    let got = fs::read(&p).unwrap();
    assert_bytes_eq(&got, &expected, 0, "after remount");
    m.unmount();
}

/// fallocate(2)'s promise through a mount: after fallocate took most of the free
/// space, random 4 KiB writes (fsynced now and then) fill the whole range without
/// ENOSPC, and the data is there after a remount.
#[test]
fn random_writes_fill_a_range_fallocate_took_most_of_the_free_space_for() {
    let mut m = Mount::with_size("128M");
    let p = m.path("f");
    let f = open_rw_create(&p);
    let cpath = std::ffi::CString::new(m.root().as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid path and a statvfs owned by this frame.
    let mut sv: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(cpath.as_ptr(), &mut sv) }, 0);
    let len = sv.f_bavail * sv.f_frsize * 9 / 10 / 4096 * 4096;
    fallocate(&f, 0, 0, len).unwrap();
    let mut blocks: Vec<u64> = (0..len / 4096).collect();
    let mut rng = StdRng::seed_from_u64(5);
    for i in (1..blocks.len()).rev() {
        blocks.swap(i, rng.gen_range(0..=i));
    }
    for (k, &b) in blocks.iter().enumerate() {
        f.write_all_at(&[(b % 253) as u8; 4096], b * 4096)
            .unwrap_or_else(|e| panic!("write {k} of {} (block {b}): {e}", blocks.len()));
        if k % 256 == 0 {
            f.sync_data()
                .unwrap_or_else(|e| panic!("fdatasync after write {k}: {e}"));
        }
    }
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(
        daemon_stats(&m)["bytes"]["prealloc_filled"].as_u64(),
        Some(len),
        "every block went in place into the preallocated ones"
    );
    m.remount();
    let got = fs::read(&p).unwrap();
    assert_eq!(got.len() as u64, len);
    for (b, block) in got.chunks(4096).enumerate() {
        assert!(
            block.iter().all(|&x| x == (b % 253) as u8),
            "block {b} after remount"
        );
    }
    m.unmount();
}

#[test]
fn sparse_file_of_one_tib() {
    let mut m = Mount::new();
    let p = m.path("sparse");
    let check = |f: &File| {
        let md = f.metadata().unwrap();
        assert_eq!(md.len(), TIB);
        assert!(
            md.blocks() < 1000,
            "a 1-byte sparse file uses {} blocks",
            md.blocks()
        );
        let mut rng = StdRng::seed_from_u64(11);
        let mut buf = vec![1u8; 65536];
        for off in [0, 4096, GIB, 3 * GIB + 17, TIB / 2] {
            f.read_exact_at(&mut buf, off).unwrap();
            assert!(is_zero(&buf), "hole at {off} reads zeros");
        }
        for _ in 0..64 {
            let off = rng.gen_range(0..TIB - 65536 - 1);
            buf.fill(1);
            f.read_exact_at(&mut buf, off).unwrap();
            assert!(is_zero(&buf), "hole at {off} reads zeros");
        }
        let mut last = vec![1u8; 4096];
        f.read_exact_at(&mut last, TIB - 4096).unwrap();
        assert!(is_zero(&last[..4095]));
        assert_eq!(last[4095], b'Z');
        let mut more = [0u8; 16];
        assert_eq!(f.read_at(&mut more, TIB).unwrap(), 0, "read at EOF");
        assert_eq!(
            f.read_at(&mut more, TIB - 1).unwrap(),
            1,
            "short read before EOF"
        );
        assert_eq!(more[0], b'Z');
    };
    {
        let f = open_rw_create(&p);
        f.write_all_at(b"Z", TIB - 1).unwrap();
        f.sync_all().unwrap();
        check(&f);
    }
    m.remount();
    check(&File::open(&p).unwrap());
    m.unmount();
}

// ---------------------------------------------------------------------------
// xattrs
// ---------------------------------------------------------------------------

#[test]
fn xattrs_set_get_list_remove_and_persist() {
    let mut m = Mount::new();
    let f = m.path("f");
    let d = m.path("d");
    fs::write(&f, b"data").unwrap();
    fs::create_dir(&d).unwrap();

    assert_eq!(listxattr(&f).unwrap(), Vec::<String>::new());
    expect_errno(
        getxattr(&f, "user.missing"),
        libc::ENODATA,
        "get a missing xattr",
    );
    let bin: Vec<u8> = (0..=255u8).chain([0, 0, 255]).collect();
    let big = pattern(3, 4000).to_vec();
    setxattr(&f, "user.a", b"hello", 0).unwrap();
    setxattr(&f, "user.binary", &bin, 0).unwrap();
    setxattr(&f, "user.empty", b"", 0).unwrap();
    setxattr(&f, "user.big", &big, 0).unwrap();
    assert_eq!(getxattr(&f, "user.a").unwrap(), b"hello");
    assert_eq!(getxattr(&f, "user.binary").unwrap(), bin);
    assert_eq!(getxattr(&f, "user.empty").unwrap(), b"");
    assert_eq!(getxattr(&f, "user.big").unwrap(), big);
    assert_eq!(
        listxattr(&f).unwrap(),
        vec!["user.a", "user.big", "user.binary", "user.empty"]
    );

    // names outside the namespaces a kernel filesystem stores, as ext4 answers
    for name in ["foo", "system.foo", "users.a"] {
        expect_errno(setxattr(&f, name, b"v", 0), libc::EOPNOTSUPP, name);
    }
    expect_errno(setxattr(&f, "user.", b"v", 0), libc::EINVAL, "user.");

    // the size query and a too-small buffer
    assert_eq!(getxattr_sized(&f, "user.a", 0).unwrap().0, 5);
    expect_errno(
        getxattr_sized(&f, "user.a", 2),
        libc::ERANGE,
        "getxattr into a small buffer",
    );

    // XATTR_CREATE / XATTR_REPLACE
    expect_errno(
        setxattr(&f, "user.a", b"x", libc::XATTR_CREATE),
        libc::EEXIST,
        "XATTR_CREATE on an existing name",
    );
    assert_eq!(getxattr(&f, "user.a").unwrap(), b"hello");
    expect_errno(
        setxattr(&f, "user.nope", b"x", libc::XATTR_REPLACE),
        libc::ENODATA,
        "XATTR_REPLACE on a missing name",
    );
    expect_errno(
        getxattr(&f, "user.nope"),
        libc::ENODATA,
        "after a failed REPLACE",
    );
    setxattr(
        &f,
        "user.a",
        b"a longer replacement value",
        libc::XATTR_REPLACE,
    )
    .unwrap();
    assert_eq!(
        getxattr(&f, "user.a").unwrap(),
        b"a longer replacement value"
    );
    setxattr(&f, "user.a", b"short", 0).unwrap();
    assert_eq!(getxattr(&f, "user.a").unwrap(), b"short");
    setxattr(&f, "user.new", b"n", libc::XATTR_CREATE).unwrap();

    // remove
    removexattr(&f, "user.binary").unwrap();
    expect_errno(
        getxattr(&f, "user.binary"),
        libc::ENODATA,
        "get a removed xattr",
    );
    expect_errno(
        removexattr(&f, "user.binary"),
        libc::ENODATA,
        "remove a missing xattr",
    );
    assert_eq!(
        listxattr(&f).unwrap(),
        vec!["user.a", "user.big", "user.empty", "user.new"]
    );

    // directories, many names
    for i in 0..50 {
        setxattr(
            &d,
            &format!("user.n{i:02}"),
            format!("value {i}").as_bytes(),
            0,
        )
        .unwrap();
    }
    assert_eq!(listxattr(&d).unwrap().len(), 50);

    // user.* is refused on symlinks; writing needs write permission
    symlink("f", m.path("l")).unwrap();
    expect_errno(
        lsetxattr(&m.path("l"), "user.x", b"v", 0),
        libc::EPERM,
        "user.* on a symlink",
    );
    expect_errno(
        run_as(NOBODY, NOGROUP, || setxattr(&f, "user.x", b"v", 0)),
        libc::EACCES,
        "setxattr without write permission",
    );
    assert_eq!(
        run_as(NOBODY, NOGROUP, || getxattr(&f, "user.a")).unwrap(),
        b"short"
    );

    // xattrs follow the inode through rename
    fs::rename(&f, m.path("g")).unwrap();

    let check = |m: &Mount| {
        let g = m.path("g");
        let d = m.path("d");
        assert_eq!(
            listxattr(&g).unwrap(),
            vec!["user.a", "user.big", "user.empty", "user.new"]
        );
        assert_eq!(getxattr(&g, "user.a").unwrap(), b"short");
        assert_eq!(getxattr(&g, "user.big").unwrap(), big);
        assert_eq!(getxattr(&g, "user.empty").unwrap(), b"");
        assert_eq!(getxattr(&g, "user.new").unwrap(), b"n");
        expect_errno(getxattr(&g, "user.binary"), libc::ENODATA, "removed xattr");
        let names = listxattr(&d).unwrap();
        assert_eq!(names.len(), 50);
        for (i, got) in names.iter().enumerate() {
            let name = format!("user.n{i:02}");
            assert_eq!(*got, name);
            assert_eq!(
                getxattr(&d, &name).unwrap(),
                format!("value {i}").as_bytes()
            );
        }
        assert_eq!(fs::read(&g).unwrap(), b"data");
    };
    check(&m);
    m.remount();
    check(&m);
    m.unmount();
}

/// xattr values up to Linux's 64 KiB through the mount (larger than one tree item,
/// they go into chunks): set, read, replaced, removed, and kept across a remount;
/// one byte more is refused by the kernel (E2BIG).
#[test]
fn xattr_values_up_to_64_kib() {
    let mut m = Mount::new();
    let f = m.path("f");
    fs::write(&f, b"data").unwrap();
    let huge = pattern(7, 65536).to_vec();
    let mid = pattern(8, 20_000).to_vec();
    setxattr(&f, "user.huge", &huge, 0).unwrap();
    setxattr(&f, "user.mid", &mid, 0).unwrap();
    setxattr(&f, "user.gone", &mid, 0).unwrap();
    assert_eq!(getxattr(&f, "user.huge").unwrap(), huge);
    assert_eq!(getxattr_sized(&f, "user.huge", 0).unwrap().0, 65536);
    expect_errno(
        getxattr_sized(&f, "user.huge", 65535),
        libc::ERANGE,
        "a 64 KiB value into a smaller buffer",
    );
    expect_errno(
        setxattr(&f, "user.over", &vec![1; 65537], 0),
        libc::E2BIG,
        "a value over 64 KiB",
    );
    setxattr(&f, "user.mid", b"short", libc::XATTR_REPLACE).unwrap();
    removexattr(&f, "user.gone").unwrap();
    m.remount();
    assert_eq!(getxattr(&f, "user.huge").unwrap(), huge);
    assert_eq!(getxattr(&f, "user.mid").unwrap(), b"short");
    expect_errno(getxattr(&f, "user.gone"), libc::ENODATA, "removed");
    assert_eq!(listxattr(&f).unwrap(), vec!["user.huge", "user.mid"]);
    m.unmount();
}

// ---------------------------------------------------------------------------
// unlinked but open
// ---------------------------------------------------------------------------

#[test]
fn unlinked_open_file_stays_usable_and_space_is_reclaimed() {
    let mut m = Mount::new();
    let free0 = free_bytes(m.root());
    let p = m.path("doomed");
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    for i in 0..64u64 {
        f.write_all(pattern(100 + i, MB)).unwrap();
    }
    f.sync_all().unwrap();
    let free1 = free_bytes(m.root());
    assert!(
        free0 >= free1 + 48 * MIB,
        "writing 64 MiB and fsync must consume space: free before {free0}, after {free1}"
    );
    let ino = f.metadata().unwrap().ino();

    fs::remove_file(&p).unwrap();
    expect_errno(fs::metadata(&p), libc::ENOENT, "unlinked name");
    assert!(list_dir(m.root()).is_empty());
    let md = f.metadata().unwrap();
    assert_eq!(md.nlink(), 0, "fstat of an unlinked file");
    assert_eq!(md.len(), 64 * MIB);
    let mut buf = vec![0u8; MB];
    for i in [0u64, 17, 63] {
        f.read_exact_at(&mut buf, i * MIB).unwrap();
        assert_bytes_eq(&buf, pattern(100 + i, MB), i * MIB, "unlinked file data");
    }
    f.write_all_at(b"still here", 64 * MIB).unwrap();
    f.sync_all().unwrap();
    let mut tail = [0u8; 10];
    f.read_exact_at(&mut tail, 64 * MIB).unwrap();
    assert_eq!(&tail, b"still here");
    assert_eq!(f.metadata().unwrap().len(), 64 * MIB + 10);

    // a new file under the old name is a different file
    fs::write(&p, b"new").unwrap();
    assert_ne!(stat(&p).ino(), ino);
    f.read_exact_at(&mut buf, 0).unwrap();
    assert_bytes_eq(&buf, pattern(100, MB), 0, "unlinked file after name reuse");
    assert_eq!(fs::read(&p).unwrap(), b"new");
    fs::remove_file(&p).unwrap();
    drop(f);

    m.remount();
    let free2 = free_bytes(m.root());
    assert!(
        free0.abs_diff(free2) <= 4 * MIB,
        "the unlinked file's space must come back: free before {free0}, with the file {free1}, after {free2}"
    );
    assert!(list_dir(m.root()).is_empty());
    m.unmount();
}

/// A file handle (name_to_handle_at), as NFS export keeps it.
fn file_handle(p: &Path) -> Vec<u8> {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // struct file_handle: handle_bytes, handle_type, then the handle.
    let mut buf = vec![0u8; 8 + 128];
    // (native-endian fields; every target this runs on is little-endian)
    buf[..4].copy_from_slice(&128u32.to_le_bytes());
    let mut mount_id: libc::c_int = 0;
    // SAFETY: a valid path, a buffer of 8 + handle_bytes bytes and an int.
    let r = unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            libc::AT_FDCWD,
            c.as_ptr(),
            buf.as_mut_ptr(),
            &mut mount_id,
            0,
        )
    };
    assert_eq!(
        r,
        0,
        "name_to_handle_at {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
    let n = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
    buf.truncate(8 + n);
    buf
}

/// Opens a file handle from [`file_handle`] on the mount at `root`.
fn open_by_handle(root: &Path, handle: &[u8], flags: i32) -> std::io::Result<File> {
    let m = File::open(root)?;
    let mut h = handle.to_vec();
    // SAFETY: a valid mount fd and a struct file_handle as the kernel filled it.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            m.as_raw_fd(),
            h.as_mut_ptr(),
            flags,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd owned by nobody else.
    Ok(unsafe { <File as std::os::unix::io::FromRawFd>::from_raw_fd(fd as i32) })
}

/// File handles stay valid while their files live, also across a remount (so the
/// kernel has the inode in no cache), as NFS export needs; a deleted file's handle
/// is stale.
#[test]
fn file_handles_open_files_and_directories_after_a_remount() {
    let mut m = Mount::new();
    fs::create_dir_all(m.path("d/sub")).unwrap();
    fs::write(m.path("d/f"), b"by handle").unwrap();
    fs::write(m.path("gone"), b"x").unwrap();
    let hf = file_handle(&m.path("d/f"));
    let hd = file_handle(&m.path("d/sub"));
    let hg = file_handle(&m.path("gone"));
    fs::remove_file(m.path("gone")).unwrap();
    m.remount();
    let mut s = String::new();
    open_by_handle(m.root(), &hf, libc::O_RDONLY)
        .expect("open_by_handle_at of a file")
        .read_to_string(&mut s)
        .unwrap();
    assert_eq!(s, "by handle");
    let d = open_by_handle(m.root(), &hd, libc::O_RDONLY | libc::O_DIRECTORY)
        .expect("open_by_handle_at of a directory");
    assert!(d.metadata().unwrap().is_dir());
    assert_eq!(d.metadata().unwrap().ino(), stat(&m.path("d/sub")).ino());
    expect_errno(
        open_by_handle(m.root(), &hg, libc::O_RDONLY),
        libc::ESTALE,
        "handle of a deleted file",
    );
    drop(d);
    m.unmount();
}

/// An ACL xattr (version 2) of (tag, perm, id) entries.
fn acl_xattr(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

const ACL_ACCESS: &str = "system.posix_acl_access";
const ACL_DEFAULT: &str = "system.posix_acl_default";
// ACL tags (USER_OBJ, USER, GROUP_OBJ, MASK, OTHER) and the id of unnamed entries.
const AU: u16 = 1;
const AUN: u16 = 2;
const AG: u16 = 4;
const AM: u16 = 0x10;
const AO: u16 = 0x20;
const NOID: u32 = u32::MAX;

/// Setting an access ACL clears S_ISGID when the caller is neither in the file's
/// group nor has CAP_FSETID, as Linux's `posix_acl_update_mode` does (the kernel
/// leaves it to the filesystem); an owner in the group, or root, keeps it.
#[test]
fn an_access_acl_set_from_outside_the_files_group_clears_setgid() {
    let mut m = Mount::new();
    let f = m.path("f");
    fs::write(&f, b"x").unwrap();
    let acl = acl_xattr(&[
        (AU, 6, NOID),
        (AUN, 4, 1234),
        (AG, 5, NOID),
        (AM, 5, NOID),
        (AO, 0, NOID),
    ]);
    for (group, as_root, want) in [
        (0, false, 0o650),
        (NOGROUP, false, 0o2650),
        (0, true, 0o2650),
    ] {
        std::os::unix::fs::chown(&f, Some(NOBODY), Some(group)).unwrap();
        chmod(&f, 0o2750).unwrap();
        if as_root {
            setxattr(&f, ACL_ACCESS, &acl, 0).unwrap();
        } else {
            run_as(NOBODY, NOGROUP, || setxattr(&f, ACL_ACCESS, &acl, 0)).unwrap();
        }
        assert_eq!(
            perm(stat(&f).mode()),
            want,
            "file group {group}, set by {}",
            if as_root { "root" } else { "nobody" }
        );
    }
    m.unmount();
}

/// POSIX ACLs: the kernel enforces what birchfs stores; an access ACL sets the
/// mode's bits (group from the mask), chmod sets the ACL's, a minimal ACL is just
/// the mode, and a directory's default ACL goes to what is made in it (masked by
/// the mode asked for, instead of the umask; subdirectories keep it), across a
/// remount.
#[test]
fn posix_acls_are_enforced_kept_in_step_with_the_mode_and_inherited() {
    let mut m = Mount::new();
    let f = m.path("f");
    fs::write(&f, b"secret").unwrap();
    chmod(&f, 0o600).unwrap();
    let nobody_reads = |p: &Path| run_as(NOBODY, NOGROUP, || fs::read(p)).is_ok();
    assert!(!nobody_reads(&f));
    let acl = acl_xattr(&[
        (AU, 6, NOID),
        (AUN, 4, NOBODY),
        (AG, 0, NOID),
        (AM, 4, NOID),
        (AO, 0, NOID),
    ]);
    setxattr(&f, ACL_ACCESS, &acl, 0).unwrap();
    assert_eq!(
        perm(stat(&f).mode()),
        0o640,
        "the mask shows as the group bits"
    );
    assert_eq!(getxattr(&f, ACL_ACCESS).unwrap(), acl);
    assert!(nobody_reads(&f), "a named entry grants");
    chmod(&f, 0o600).unwrap();
    let masked = acl_xattr(&[
        (AU, 6, NOID),
        (AUN, 4, NOBODY),
        (AG, 0, NOID),
        (AM, 0, NOID),
        (AO, 0, NOID),
    ]);
    assert_eq!(
        getxattr(&f, ACL_ACCESS).unwrap(),
        masked,
        "chmod sets the mask"
    );
    assert!(!nobody_reads(&f), "the mask limits the named entry");
    chmod(&f, 0o640).unwrap();
    assert!(nobody_reads(&f));
    // A minimal ACL is only the mode.
    let g = m.path("g");
    fs::write(&g, b"x").unwrap();
    setxattr(
        &g,
        ACL_ACCESS,
        &acl_xattr(&[(AU, 7, NOID), (AG, 5, NOID), (AO, 1, NOID)]),
        0,
    )
    .unwrap();
    assert_eq!(perm(stat(&g).mode()), 0o751);
    expect_errno(
        getxattr(&g, ACL_ACCESS),
        libc::ENODATA,
        "a minimal ACL is not stored",
    );
    // Inheritance.
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    let def = acl_xattr(&[
        (AU, 7, NOID),
        (AUN, 7, NOBODY),
        (AG, 5, NOID),
        (AM, 7, NOID),
        (AO, 0, NOID),
    ]);
    setxattr(&d, ACL_DEFAULT, &def, 0).unwrap();
    let new = d.join("new");
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o666)
        .open(&new)
        .unwrap();
    assert_eq!(
        perm(stat(&new).mode()),
        0o660,
        "the default ACL masked by 0666, no umask"
    );
    assert_eq!(
        getxattr(&new, ACL_ACCESS).unwrap(),
        acl_xattr(&[
            (AU, 6, NOID),
            (AUN, 7, NOBODY),
            (AG, 5, NOID),
            (AM, 6, NOID),
            (AO, 0, NOID)
        ])
    );
    expect_errno(
        getxattr(&new, ACL_DEFAULT),
        libc::ENODATA,
        "a file has no default ACL",
    );
    run_as(NOBODY, NOGROUP, || fs::write(&new, b"by nobody")).expect("the inherited entry grants");
    let sub = d.join("sub");
    DirBuilder::new().mode(0o777).create(&sub).unwrap();
    assert_eq!(perm(stat(&sub).mode()), 0o770);
    assert_eq!(
        getxattr(&sub, ACL_DEFAULT).unwrap(),
        def,
        "a subdirectory inherits the default"
    );
    m.remount();
    assert!(nobody_reads(&f), "after a remount");
    assert_eq!(fs::read(&new).unwrap(), b"by nobody");
    assert_eq!(getxattr(&sub, ACL_DEFAULT).unwrap(), def);
    // Without a default ACL the umask applies (the kernel leaves it to birchfs).
    let um = current_umask();
    let plain = m.path("plain");
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o666)
        .open(&plain)
        .unwrap();
    assert_eq!(perm(stat(&plain).mode()), 0o666 & !um);
    m.unmount();
    let c = m.check();
    assert!(c.status.success(), "check:\n{}", describe(&c));
}

/// The generic mount flags reach the kernel and are enforced there; options birchfs
/// would not honour are refused with a reason.
#[test]
fn generic_mount_flags_are_applied_and_unsupported_ones_refused() {
    let mut m = Mount::unmounted("1G");
    for (opt, says) in [
        ("relatime", "access times"),
        ("strictatime", "access times"),
        ("dirsync", "dirsync"),
        ("nosuchflag", "unknown mount option"),
    ] {
        m.expect_refused(opt, says);
    }
    m.mount_with(&["defaults", "nosuid", "nodev", "noexec", "noatime"]);
    let cpath = std::ffi::CString::new(m.root().as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid path and a statvfs owned by this frame.
    let mut sv: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(cpath.as_ptr(), &mut sv) }, 0);
    for (flag, name) in [
        (libc::ST_NOSUID, "nosuid"),
        (libc::ST_NODEV, "nodev"),
        (libc::ST_NOEXEC, "noexec"),
        (libc::ST_NOATIME, "noatime"),
    ] {
        assert_ne!(sv.f_flag & flag, 0, "{name} not on the mount");
    }
    // noexec is the kernel's to enforce: a script with x bits does not run.
    let script = m.path("run.sh");
    fs::write(&script, b"#!/bin/sh\nexit 0\n").unwrap();
    chmod(&script, 0o755).unwrap();
    let e = Command::new(&script).status().unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EACCES),
        "exec on a noexec mount"
    );
    m.unmount();
    m.mount_with(&[]);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::statvfs(cpath.as_ptr(), &mut sv) }, 0);
    assert_eq!(
        sv.f_flag & (libc::ST_NOSUID | libc::ST_NOEXEC),
        0,
        "defaults"
    );
    assert!(Command::new(&script).status().unwrap().success());
    m.unmount();
}

/// The filesystem type and the options of the mount at `dir`, from the mount table.
fn mount_type_and_options(dir: &Path) -> (String, String) {
    let table = fs::read_to_string("/proc/self/mounts").unwrap();
    let line = table
        .lines()
        .rev()
        .find(|l| l.split(' ').nth(1) == dir.to_str())
        .unwrap_or_else(|| panic!("{} is not mounted:\n{table}", dir.display()));
    let f: Vec<&str> = line.split(' ').collect();
    (f[2].to_owned(), f[3].to_owned())
}

/// `mount -t fuse…` and /etc/fstab lines mount birchfs: mount(8) runs fuse3's
/// mount.fuse3, which calls `birchfs IMAGE MOUNTPOINT -o OPTIONS` (clap refused that
/// as an unknown subcommand). The mount's type is fuse.birchfs, the options reach the
/// daemon, and the fstab-only ones (nofail, x-systemd.*) are left to mount(8).
#[test]
fn mount_8_and_fstab_lines_mount_birchfs() {
    let mut m = Mount::unmounted("256M");
    // `TYPE#SOURCE` names the program by its path, where `-t fuse.birchfs` would look
    // for `birchfs` on the PATH that mount.fuse3 runs with.
    let source = format!("{BIN}#{}", m.image().display());
    let out = run(
        Command::new("mount")
            .args(["-t", "fuse", "-o", "noatime,cache_size=64M"])
            .arg(&source)
            .arg(m.root()),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "mount -t fuse:\n{}", describe(&out));
    m.mark_mounted();
    let (fstype, opts) = mount_type_and_options(m.root());
    assert_eq!(fstype, "fuse.birchfs");
    assert!(opts.split(',').any(|o| o == "noatime"), "{opts}");
    assert_eq!(daemon_stats(&m)["cache"]["limit"].as_u64(), Some(64 << 20));
    fs::write(m.path("f"), b"through mount(8)").unwrap();
    m.unmount();

    let fstab = m.image().with_file_name("fstab");
    fs::write(
        &fstab,
        format!(
            "# made by the test\n{source} {} fuse ro,nofail,x-systemd.automount,_netdev 0 0\n",
            m.root().display()
        ),
    )
    .unwrap();
    let out = run(
        Command::new("mount").arg("-T").arg(&fstab).arg(m.root()),
        Duration::from_secs(60),
    );
    assert!(
        out.status.success(),
        "mount from fstab:\n{}",
        describe(&out)
    );
    m.mark_mounted();
    assert_eq!(mount_type_and_options(m.root()).0, "fuse.birchfs");
    assert_eq!(fs::read(m.path("f")).unwrap(), b"through mount(8)");
    let e = fs::write(m.path("g"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "fstab's ro");
    m.unmount();

    // The helper call itself, with what mount.fuse3 adds (dev,suid) and a bad option.
    let out = cli(&[
        m.image().as_os_str(),
        m.root().as_os_str(),
        "-o".as_ref(),
        "rw,dev,suid,bogus".as_ref(),
    ]);
    fails_saying(
        &out,
        "unknown mount option 'bogus'",
        "a bad option via the helper call",
    );
    assert!(!is_mounted_at(m.root()));
}

/// `mount -o remount,ro` and back: mount(8) calls birchfs as its helper with the
/// mount's options from the mount table and `remount` (birchfs took that for a new
/// mount and refused `remount`). Going read-only commits, so a crash of the daemon
/// then loses nothing written before; flags not named stay as they were given;
/// a mount made with `-o ro` is not made writable. birchfs's own options stay as
/// mounted: one that differs is named in a warning, one as mounted (from fstab) not.
#[test]
fn remount_read_only_and_back() {
    let mut m = Mount::unmounted("256M");
    m.mount_with(&["nosuid", "cache_size=128M"]);
    fs::write(m.path("f"), b"before the remount").unwrap();
    let source = format!("birchfs:{}", m.image().display());
    let root = m.root().to_path_buf();
    // What mount(8) passes for `mount -o remount,ro MNT` (through mount.fuse3).
    let helper = |opts: &str| {
        cli(&[
            source.as_ref(),
            root.as_os_str(),
            "-o".as_ref(),
            opts.as_ref(),
        ])
    };
    let out = helper(
        "ro,nosuid,relatime,remount,user_id=0,group_id=0,default_permissions,allow_other,dev,\
         cache_size=128M",
    );
    assert!(out.status.success(), "remount,ro:\n{}", describe(&out));
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("not applied"),
        "{}",
        describe(&out)
    );
    let (_, opts) = mount_type_and_options(m.root());
    assert!(opts.starts_with("ro,") && opts.contains("nosuid"), "{opts}");
    let e = fs::write(m.path("g"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    let out = helper("rw,nosuid,remount,cache_size=64M");
    assert!(
        out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("cache_size=64M not applied"),
        "remount,rw:\n{}",
        describe(&out)
    );
    assert!(mount_type_and_options(m.root()).1.starts_with("rw,"));
    fs::write(m.path("g"), b"after").unwrap();
    // `birchfs mount -o remount,ro` does the same; then the daemon dies.
    let out = cli(&[
        "mount".as_ref(),
        "-o".as_ref(),
        "remount,ro".as_ref(),
        m.image().as_os_str(),
        m.root().as_os_str(),
    ]);
    assert!(
        out.status.success(),
        "birchfs mount -o remount,ro:\n{}",
        describe(&out)
    );
    m.kill_daemon();
    m.mount();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"before the remount");
    assert_eq!(
        fs::read(m.path("g")).unwrap(),
        b"after",
        "committed going read-only"
    );
    let out = helper("remount,bogus");
    fails_saying(&out, "bogus", "a bad option on a remount");
    m.unmount();
    m.mount_with(&["ro"]);
    let out = helper("rw,remount");
    fails_saying(
        &out,
        "mounted with -o ro",
        "remount,rw of a read-only daemon",
    );
    assert!(mount_type_and_options(m.root()).1.starts_with("ro,"));
    m.unmount();
}

/// An open directory removed by rmdir or replaced by a rename keeps answering
/// fstat (with no links) until it is closed, as on a kernel filesystem, and is freed
/// then.
#[test]
fn removed_open_directories_stay_until_closed() {
    let mut m = Mount::new();
    for d in ["a", "b", "c"] {
        fs::create_dir(m.path(d)).unwrap();
    }
    let by_rmdir = File::open(m.path("a")).unwrap();
    let by_rename = File::open(m.path("b")).unwrap();
    let ino_a = by_rmdir.metadata().unwrap().ino();
    fs::remove_dir(m.path("a")).unwrap();
    fs::rename(m.path("c"), m.path("b")).unwrap();
    for (what, f) in [("rmdir", &by_rmdir), ("rename over", &by_rename)] {
        let md = f
            .metadata()
            .unwrap_or_else(|e| panic!("fstat after {what}: {e}"));
        assert!(md.is_dir(), "after {what}");
        assert_eq!(md.nlink(), 0, "links of a directory after {what}");
    }
    assert_eq!(by_rmdir.metadata().unwrap().ino(), ino_a);
    expect_errno(fs::metadata(m.path("a")), libc::ENOENT, "removed name");
    assert_eq!(list_dir(m.root()), vec!["b".to_string()]);
    drop(by_rmdir);
    drop(by_rename);
    m.unmount();
    let c = m.check();
    assert!(c.status.success(), "check after closing:\n{}", describe(&c));
}

// ---------------------------------------------------------------------------
// readdir
// ---------------------------------------------------------------------------

/// Every name read from an open directory stream, until its end.
fn read_stream(dir: *mut libc::DIR) -> Vec<String> {
    let mut names = Vec::new();
    loop {
        // SAFETY: `dir` is an open stream; the entry is read before the next call.
        let e = unsafe { libc::readdir(dir) };
        if e.is_null() {
            return names;
        }
        // SAFETY: d_name is NUL-terminated.
        let n = unsafe { std::ffi::CStr::from_ptr((*e).d_name.as_ptr()) };
        names.push(n.to_string_lossy().into_owned());
    }
}

/// Renaming each entry away and back while reading the directory lists every
/// name once (a renamed entry gets a new index, and used to be listed again, so
/// the loop never ended); rewinddir then sees entries made after the opendir.
#[test]
fn readdir_while_renaming_each_entry_ends_and_rewinddir_sees_new_entries() {
    let mut m = Mount::new();
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    const N: usize = 3000;
    for i in 0..N {
        File::create(d.join(format!("f{i}"))).unwrap();
    }
    let cpath = std::ffi::CString::new(d.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid path; the stream is closed below.
    let dir = unsafe { libc::opendir(cpath.as_ptr()) };
    assert!(!dir.is_null());
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut total = 0;
    loop {
        // SAFETY: `dir` is open; the name is copied before the next readdir.
        let e = unsafe { libc::readdir(dir) };
        if e.is_null() {
            break;
        }
        // SAFETY: d_name is NUL-terminated.
        let name = unsafe { std::ffi::CStr::from_ptr((*e).d_name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        total += 1;
        assert!(
            total <= 3 * N,
            "readdir does not end: {total} entries so far"
        );
        if name == "." || name == ".." {
            continue;
        }
        fs::rename(d.join(&name), d.join("TEMP")).unwrap();
        fs::rename(d.join("TEMP"), d.join(&name)).unwrap();
        *seen.entry(name).or_default() += 1;
    }
    assert_eq!(seen.len(), N, "names listed");
    let twice: Vec<_> = seen.iter().filter(|(_, &n)| n > 1).collect();
    assert!(twice.is_empty(), "listed more than once: {twice:?}");
    File::create(d.join("late")).unwrap();
    // SAFETY: `dir` is open.
    unsafe { libc::rewinddir(dir) };
    let again = read_stream(dir);
    // SAFETY: closes the stream opened above.
    unsafe { libc::closedir(dir) };
    assert_eq!(
        again.len(),
        N + 3,
        "after rewinddir: . .. and {} files",
        N + 1
    );
    assert!(
        again.iter().any(|n| n == "late"),
        "rewinddir misses a new entry"
    );
    m.unmount();
}

#[test]
fn readdir_lists_exactly_the_entries() {
    let mut m = Mount::new();
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    let mut expected: BTreeMap<String, u8> = BTreeMap::new();
    for i in 0..1000 {
        let name = format!("entry-{i:04}");
        let p = d.join(&name);
        let t = match i % 20 {
            0 => {
                fs::create_dir(&p).unwrap();
                libc::DT_DIR
            }
            1 => {
                symlink("target", &p).unwrap();
                libc::DT_LNK
            }
            _ => {
                File::create(&p).unwrap();
                libc::DT_REG
            }
        };
        expected.insert(name, t);
    }
    let check = |m: &Mount| {
        let d = m.path("d");
        let names = list_dir(&d);
        assert_eq!(names.len(), 1000);
        assert!(
            names.iter().eq(expected.keys()),
            "listing differs from the created names"
        );
        for e in fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            let ft = e.file_type().unwrap();
            let want = expected[&name];
            assert_eq!(ft.is_dir(), want == libc::DT_DIR, "{name}");
            assert_eq!(ft.is_symlink(), want == libc::DT_LNK, "{name}");
            assert_eq!(ft.is_file(), want == libc::DT_REG, "{name}");
        }
        let raw = readdir_raw(&d).unwrap();
        assert_eq!(raw.len(), 1002, "1000 entries plus . and ..");
        assert_eq!(raw.iter().filter(|e| e.name == b".").count(), 1);
        assert_eq!(raw.iter().filter(|e| e.name == b"..").count(), 1);
        let dino = stat(&d).ino();
        let rootino = stat(m.root()).ino();
        for e in &raw {
            match &e.name[..] {
                b"." => assert_eq!(e.ino, dino, "d_ino of ."),
                b".." => assert_eq!(e.ino, rootino, "d_ino of .."),
                name => {
                    let name = String::from_utf8(name.to_vec()).unwrap();
                    assert_eq!(e.d_type, expected[&name], "d_type of {name}");
                    assert_eq!(e.ino, lstat(&d.join(&name)).ino(), "d_ino of {name}");
                }
            }
        }
    };
    check(&m);
    m.remount();
    check(&m);
    let empty = m.path("empty");
    fs::create_dir(&empty).unwrap();
    assert!(list_dir(&empty).is_empty());
    let raw = readdir_raw(&empty).unwrap();
    let mut names: Vec<&[u8]> = raw.iter().map(|e| &e.name[..]).collect();
    names.sort();
    assert_eq!(names, vec![&b"."[..], &b".."[..]]);
    m.unmount();
}

#[test]
fn readdir_while_deleting_skips_and_repeats_nothing() {
    let mut m = Mount::new();
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    const N: usize = 1000;
    let name =
        |i: usize| format!("a-rather-long-directory-entry-name-to-span-many-readdir-pages-{i:05}");
    for i in 0..N {
        File::create(d.join(name(i))).unwrap();
    }
    let all: HashSet<String> = (0..N).map(name).collect();

    // delete every even entry after the first ten have been returned
    let mut seen = HashSet::new();
    let mut deleted = false;
    for e in fs::read_dir(&d).unwrap() {
        let n = e.unwrap().file_name().into_string().unwrap();
        assert!(all.contains(&n), "readdir returned an unknown name {n}");
        assert!(seen.insert(n.clone()), "readdir returned {n} twice");
        if seen.len() == 10 && !deleted {
            for i in (0..N).step_by(2) {
                fs::remove_file(d.join(name(i))).unwrap();
            }
            deleted = true;
        }
    }
    assert!(deleted);
    for i in (1..N).step_by(2) {
        assert!(
            seen.contains(&name(i)),
            "{} was not deleted but readdir skipped it",
            name(i)
        );
    }
    let survivors: Vec<String> = {
        let mut v: Vec<String> = (1..N).step_by(2).map(name).collect();
        v.sort();
        v
    };
    assert_eq!(list_dir(&d), survivors);

    // rm -r style: unlink each entry as soon as readdir returns it
    let mut seen = HashSet::new();
    for e in fs::read_dir(&d).unwrap() {
        let n = e.unwrap().file_name().into_string().unwrap();
        assert!(seen.insert(n.clone()), "readdir returned {n} twice");
        fs::remove_file(d.join(&n)).unwrap();
    }
    assert_eq!(seen.len(), survivors.len(), "one pass must see every entry");
    assert!(list_dir(&d).is_empty());
    fs::remove_dir(&d).unwrap();
    m.unmount();
}

// ---------------------------------------------------------------------------
// statfs
// ---------------------------------------------------------------------------

#[test]
fn statfs_reports_geometry_and_usage() {
    let mut m = Mount::new();
    let s = statfs(m.root()).unwrap();
    assert_eq!(s.f_bsize as u64, 4096, "f_bsize");
    assert_eq!(s.f_namelen as u64, 255, "f_namelen");
    assert!(s.f_blocks > 0);
    assert!(s.f_bfree <= s.f_blocks);
    assert!(s.f_bavail <= s.f_bfree);
    let unit = if s.f_frsize > 0 {
        s.f_frsize as u64
    } else {
        s.f_bsize as u64
    };
    let total = s.f_blocks as u64 * unit;
    assert!(
        (GIB..=2 * GIB).contains(&total),
        "a 2 GiB image reports {total} bytes in total"
    );
    // Inodes: those made so far plus what the available space holds, about.
    let iused = |s: &libc::statfs| s.f_files - s.f_ffree;
    assert!(s.f_ffree as u64 <= s.f_bavail as u64 * birchfs::INODES_PER_BLOCK);
    assert!(
        s.f_ffree as u64 >= s.f_bavail as u64,
        "{} free inodes",
        s.f_ffree
    );
    for i in 0..100 {
        File::create(m.path(format!("empty{i}"))).unwrap();
    }
    let si = statfs(m.root()).unwrap();
    assert_eq!(iused(&si), iused(&s) + 100, "100 new files");

    {
        let mut f = File::create(m.path("big")).unwrap();
        for i in 0..32u64 {
            f.write_all(pattern(300 + i, MB)).unwrap();
        }
        f.sync_all().unwrap();
    }
    let s2 = statfs(m.root()).unwrap();
    assert_eq!(s2.f_blocks, s.f_blocks, "f_blocks does not change");
    let used = (s.f_bfree as u64).saturating_sub(s2.f_bfree as u64) * unit;
    assert!(
        (24 * MIB..=96 * MIB).contains(&used),
        "writing 32 MiB and fsync used {used} bytes of f_bfree"
    );
    let s3 = statfs(&m.path("big")).unwrap();
    assert_eq!(s3.f_blocks, s.f_blocks, "statfs on a file in the mount");
    m.unmount();
}

// ---------------------------------------------------------------------------
// persistence of a whole tree
// ---------------------------------------------------------------------------

#[derive(Debug, PartialEq, Eq)]
struct Entry {
    path: String,
    kind: &'static str,
    ino: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    nlink: u64,
    size: u64,
    rdev: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    content: Option<u64>,
    target: Option<Vec<u8>>,
    xattrs: Vec<(String, Vec<u8>)>,
}

fn digest(data: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    h.write(data);
    h.write_usize(data.len());
    h.finish()
}

fn snapshot(root: &Path) -> Vec<Entry> {
    fn walk(root: &Path, rel: &Path, out: &mut Vec<Entry>) {
        let p = root.join(rel);
        let md = lstat(&p);
        let ft = md.file_type();
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_file() {
            "file"
        } else if ft.is_symlink() {
            "symlink"
        } else if ft.is_fifo() {
            "fifo"
        } else if ft.is_char_device() {
            "chr"
        } else if ft.is_block_device() {
            "blk"
        } else if ft.is_socket() {
            "sock"
        } else {
            "?"
        };
        let xattrs = if ft.is_symlink() {
            Vec::new()
        } else {
            listxattr(&p)
                .unwrap()
                .into_iter()
                .map(|n| {
                    let v = getxattr(&p, &n).unwrap();
                    (n, v)
                })
                .collect()
        };
        out.push(Entry {
            path: rel.to_string_lossy().into_owned(),
            kind,
            ino: md.ino(),
            mode: md.mode(),
            uid: md.uid(),
            gid: md.gid(),
            nlink: md.nlink(),
            size: md.len(),
            rdev: md.rdev(),
            mtime: mtime(&md),
            ctime: ctime(&md),
            content: if ft.is_file() {
                Some(digest(&fs::read(&p).unwrap()))
            } else {
                None
            },
            target: if ft.is_symlink() {
                Some(fs::read_link(&p).unwrap().as_os_str().as_bytes().to_vec())
            } else {
                None
            },
            xattrs,
        });
        if ft.is_dir() {
            for name in list_dir(&p) {
                walk(root, &rel.join(name), out);
            }
        }
    }
    let mut v = Vec::new();
    walk(root, Path::new(""), &mut v);
    v
}

#[track_caller]
fn assert_same_tree(before: &[Entry], after: &[Entry], when: &str) {
    for (b, a) in before.iter().zip(after) {
        assert_eq!(a, b, "{when}: entry differs");
    }
    assert_eq!(
        after.len(),
        before.len(),
        "{when}: number of entries differs"
    );
}

#[test]
fn mount_right_after_umount_waits_for_the_old_daemon() {
    let mut m = Mount::new();
    for round in 0..3u64 {
        // Unsynced data: the old daemon's last commit has work to do after umount.
        let data: Vec<u8> = (0..24)
            .flat_map(|i| pattern(round * 100 + i, 2 * MB))
            .copied()
            .collect();
        fs::write(m.path("f"), &data).unwrap();
        m.umount_no_wait();
        m.mount();
        assert_eq!(fs::read(m.path("f")).unwrap(), data, "round {round}");
    }
    m.unmount();
}

#[test]
fn tree_persists_across_remount() {
    let mut m = Mount::new();
    let p = |s: &str| m.path(s);
    for d in ["a", "a/b", "a/b/c", "e"] {
        fs::create_dir(p(d)).unwrap();
    }
    fs::write(p("a/f1"), pattern(1, 100)).unwrap();
    fs::write(p("a/b/f2"), pattern(2, 70_001)).unwrap();
    File::create(p("a/b/c/f3")).unwrap();
    fs::hard_link(p("a/f1"), p("a/b/c/hl")).unwrap();
    {
        let f = open_rw_create(&p("big"));
        f.write_all_at(pattern(3, 2 * MB), 0).unwrap();
        f.write_all_at(pattern(4, MB + 17), 2 * MIB).unwrap();
        f.write_all_at(b"tail after a hole", 10 * MIB).unwrap();
    }
    symlink("a/f1", p("s1")).unwrap();
    symlink("/nonexistent/absolute", p("s2")).unwrap();
    symlink("x".repeat(1000), p("s3")).unwrap();
    mkfifo(&p("fifo"), 0o600).unwrap();
    mknod(&p("cdev"), libc::S_IFCHR | 0o640, makedev(10, 200)).unwrap();
    chmod(&p("a/f1"), 0o4755).unwrap();
    chmod(&p("a/b/f2"), 0o640).unwrap();
    chown(&p("a/b/f2"), 65534, 65533).unwrap();
    chmod(&p("a/b/c"), 0o750).unwrap();
    chmod(&p("e"), 0o1777).unwrap();
    lchown(&p("s1"), 7, 8).unwrap();
    setxattr(&p("a/f1"), "user.one", b"1", 0).unwrap();
    setxattr(&p("a/f1"), "user.two", &[0, 1, 2, 255], 0).unwrap();
    setxattr(&p("a"), "user.dir", b"d", 0).unwrap();
    utimens(&p("a/f1"), (1111, 1), (2222, 2)).unwrap();
    utimens(&p("a/b"), (3333, 3), (4444, 4)).unwrap();

    let before = snapshot(m.root());
    assert_eq!(before.len(), 15, "entries in the tree: {:#?}", before);
    m.remount();
    let after = snapshot(m.root());
    assert_same_tree(&before, &after, "after remount");
    m.unmount();
    m.mount_with(&["ro"]);
    let after_ro = snapshot(m.root());
    assert_same_tree(&before, &after_ro, "after a read-only mount");
    m.unmount();
}

// ---------------------------------------------------------------------------
// the mount command
// ---------------------------------------------------------------------------

#[test]
fn mount_rejects_unknown_options() {
    let mut m = Mount::unmounted("2G");
    for opts in [&["bogus"][..], &["commit=5", "bogus"][..]] {
        let out = m.try_mount(opts);
        assert!(
            !out.status.success(),
            "mount -o {:?} succeeded:\n{}",
            opts,
            describe(&out)
        );
        assert!(
            !m.is_mounted() && !is_mounted_at(m.root()),
            "mount -o {:?} mounted",
            opts
        );
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "expected one line on stderr, got {:?}", err);
        assert!(
            lines[0].contains("bogus"),
            "the message should name the option: {:?}",
            err
        );
    }
    // valid options work
    m.mount_with(&["commit=1"]);
    fs::write(m.path("f"), b"committed").unwrap();
    m.remount();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"committed");
    m.unmount();
}

#[test]
fn mount_refuses_an_image_that_is_already_mounted() {
    let mut m = Mount::new();
    fs::write(m.path("f"), b"first mount").unwrap();
    let mnt2 = m.host_dir().join("mnt2");
    fs::create_dir(&mnt2).unwrap();
    let out = run(
        Command::new(BIN).arg("mount").arg(m.image()).arg(&mnt2),
        Duration::from_secs(60),
    );
    let second = is_mounted_at(&mnt2);
    if second {
        let _ = try_run(Command::new("umount").arg(&mnt2), Duration::from_secs(30));
    }
    assert!(
        !out.status.success(),
        "a second mount of the image succeeded:\n{}",
        describe(&out)
    );
    assert!(!second, "the image got mounted twice");
    fails_saying(
        &out,
        &format!("in use by the birchfs mounted at {}", m.root().display()),
        "second mount of a mounted image",
    );
    // By another name (a symbolic link elsewhere), the same.
    let links = m.host_dir().join("links");
    fs::create_dir(&links).unwrap();
    let other = links.join("other-name");
    std::os::unix::fs::symlink(m.image(), &other).unwrap();
    fails_saying(
        &cli(&["check".as_ref(), other.as_os_str()]),
        &format!("in use by the birchfs mounted at {}", m.root().display()),
        "check of a mounted image through a link of another name",
    );
    assert_eq!(fs::read(m.path("f")).unwrap(), b"first mount");
    fs::write(m.path("g"), b"still works").unwrap();
    m.remount();
    assert_eq!(fs::read(m.path("g")).unwrap(), b"still works");
    m.unmount();
}

/// An image mounted through a symbolic link of another name is found by its own
/// name too: a check is refused naming the mount, and a resize grows it there.
#[test]
fn an_image_mounted_through_a_link_is_found_by_its_own_name() {
    let m = Mount::unmounted("64M");
    let link = m.host_dir().join("current-image");
    std::os::unix::fs::symlink(m.image(), &link).unwrap();
    let at = m.host_dir().join("through-link");
    fs::create_dir(&at).unwrap();
    let _g = UnmountOnDrop(at.clone());
    let out = cli(&["mount".as_ref(), link.as_os_str(), at.as_os_str()]);
    assert!(out.status.success(), "mount: {}", describe(&out));
    let img = m.image().as_os_str();
    fails_saying(
        &cli(&["check".as_ref(), img]),
        &format!("in use by the birchfs mounted at {}", at.display()),
        "check of the image mounted through a link",
    );
    let out = cli(&["resize".as_ref(), img, "+16M".as_ref()]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stderr).contains("growing it there"),
        "{}",
        describe(&out)
    );
    let st = statfs(&at).unwrap();
    assert!(
        st.f_blocks as u64 * st.f_bsize as u64 > 64 << 20,
        "the mount did not grow"
    );
    let out = cli(&["umount".as_ref(), at.as_os_str()]);
    assert!(out.status.success(), "umount: {}", describe(&out));
    check_clean(m.image());
}

/// A resize of the file under a mounted loop device is refused, saying how to grow
/// the mount: growing the file alone would leave the device as it was.
#[test]
fn resize_of_the_file_under_a_mounted_loop_device_says_how() {
    let m = Mount::on_loop_device("64M");
    let backing = m.host_dir().join("backing");
    let out = cli(&["resize".as_ref(), backing.as_os_str(), "+16M".as_ref()]);
    fails_saying(
        &out,
        &format!("birchfs resize {} SIZE", m.root().display()),
        "resize of the file under a mounted loop device",
    );
    fails_saying(&out, "losetup -c", "resize of the file under a loop device");
    assert_eq!(
        fs::metadata(&backing).unwrap().len(),
        64 << 20,
        "the file grew"
    );
}

/// A dead mount of the image (its daemon killed, the mount left behind) does not
/// count as the image being mounted: the refusal names the live mount.
#[test]
fn a_refused_mount_names_the_live_mount_not_a_dead_one() {
    let mut m = Mount::new();
    m.kill_daemon_leaving_its_mount();
    let live = m.host_dir().join("live");
    let third = m.host_dir().join("third");
    fs::create_dir(&live).unwrap();
    fs::create_dir(&third).unwrap();
    let _g = UnmountOnDrop(live.clone());
    let out = cli(&["mount".as_ref(), m.image().as_os_str(), live.as_os_str()]);
    assert!(
        out.status.success(),
        "mount after the kill:\n{}",
        describe(&out)
    );
    let out = cli(&["mount".as_ref(), m.image().as_os_str(), third.as_os_str()]);
    fails_saying(
        &out,
        &format!("in use by the birchfs mounted at {}", live.display()),
        "a third mount",
    );
    assert!(!is_mounted_at(&third));
    let out = cli(&["umount".as_ref(), live.as_os_str()]);
    assert!(out.status.success(), "umount:\n{}", describe(&out));
    let _ = Command::new("umount").arg("-l").arg(m.root()).status();
    m.mark_unmounted();
}

#[test]
fn mount_refuses_a_file_that_is_not_birchfs() {
    let mut m = Mount::bare();
    {
        let f = File::create(m.image()).unwrap();
        f.set_len(64 * MIB).unwrap();
    }
    let out = m.try_mount(&[]);
    assert!(
        !out.status.success(),
        "mounting 64 MiB of zeros succeeded:\n{}",
        describe(&out)
    );
    assert!(!m.is_mounted() && !is_mounted_at(m.root()));
    assert!(!out.stderr.is_empty(), "no message for the refused mount");
    let c = m.check();
    assert_eq!(
        c.status.code(),
        Some(2),
        "check of a non-birchfs file:\n{}",
        describe(&c)
    );
    let data = fs::read(m.image()).unwrap();
    assert_eq!(data.len() as u64, 64 * MIB);
    assert!(
        is_zero(&data),
        "mount or check wrote to a file that is not theirs"
    );
}

/// Runs `blockdev FLAG DEV`.
fn blockdev(flag: &str, dev: &Path) -> std::process::Output {
    run(
        Command::new("blockdev").arg(flag).arg(dev),
        Duration::from_secs(30),
    )
}

/// A block device set read-only until dropped: the flag outlives `losetup -d`, and
/// later tests would get a read-only loop device.
struct ReadOnly(PathBuf);

impl ReadOnly {
    /// Sets `dev` read-only (`blockdev --setro`).
    #[track_caller]
    fn set(dev: &Path) -> ReadOnly {
        let out = blockdev("--setro", dev);
        let ro = ReadOnly(dev.to_path_buf());
        assert!(
            out.status.success(),
            "blockdev --setro:\n{}",
            describe(&out)
        );
        ro
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        let out = blockdev("--setrw", &self.0);
        if !out.status.success() {
            eprintln!("blockdev --setrw {}:\n{}", self.0.display(), describe(&out));
        }
    }
}

/// A device that turns read-only under a mount (as a failing disk does): fsync says
/// EROFS (it said EPERM, "Operation not permitted", as if the caller lacked a
/// right), unmount says the last commit failed, and once the device is writable
/// again every fsynced block is there (log replay).
#[test]
fn a_device_that_turns_read_only_under_a_mount_fails_fsync_with_erofs() {
    let mut m = Mount::on_loop_device("256M");
    let mut f = File::create(m.path("f")).unwrap();
    for i in 0..20u8 {
        f.write_all(&[i; 4096]).unwrap();
        f.sync_all().unwrap();
    }
    let ro = ReadOnly::set(m.image());
    f.write_all(&[99; 4096]).unwrap();
    let e = f.sync_all().unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EROFS),
        "fsync on a read-only device: {e}"
    );
    drop(f);
    let out = birchfs(["umount".as_ref(), m.root().as_os_str()]);
    fails_saying(&out, "commit", "umount with a read-only device");
    m.mark_unmounted();
    drop(ro);
    m.mount_with(&[]);
    let got = fs::read(m.path("f")).unwrap();
    assert!(
        got.len() >= 20 * 4096,
        "fsynced blocks lost: {} bytes",
        got.len()
    );
    for i in 0..20u8 {
        assert!(
            got[i as usize * 4096..][..4096].iter().all(|&b| b == i),
            "block {i}"
        );
    }
    m.unmount();
}

/// A block device set read-only is refused a read-write mount with a hint (it opens
/// for writing, and the first write failed with EPERM, "I/O error"), and mounts `ro`.
#[test]
fn a_read_only_block_device_is_refused_rw_with_a_hint_and_mounts_ro() {
    let mut m = Mount::on_loop_device("256M");
    fs::write(m.path("f"), b"kept").unwrap();
    m.unmount();
    let ro = ReadOnly::set(m.image());
    let out = m.try_mount(&[]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success() && err.contains("Read-only") && err.contains("-o ro"),
        "a read-write mount of a read-only device:\n{}",
        describe(&out)
    );
    m.mount_with(&["ro"]);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"kept");
    // A read-only mount is one: trim says why it does nothing there.
    let out = birchfs(["trim".as_ref(), m.root().as_os_str()]);
    fails_saying(&out, "read-only", "trim of a read-only mount");
    m.unmount();
    drop(ro);
}

/// Asserts that a command failed and said `needle` on stderr.
#[track_caller]
fn fails_saying(out: &std::process::Output, needle: &str, what: &str) {
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains(needle),
        "{what}:\n{}",
        describe(out)
    );
}

/// Runs the birchfs CLI with `args` (at most a minute).
fn cli(args: &[&std::ffi::OsStr]) -> std::process::Output {
    run(Command::new(BIN).args(args), Duration::from_secs(60))
}

/// Asserts that `birchfs check` finds the image at `img` clean.
#[track_caller]
fn check_clean(img: &Path) {
    let out = cli(&["check".as_ref(), img.as_os_str()]);
    assert!(out.status.success(), "check:\n{}", describe(&out));
}

/// A mount made by hand, unmounted (lazily) if a test fails with it still mounted.
struct UnmountOnDrop(PathBuf);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        if is_mounted_at(&self.0) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// Makes a 64 MiB birchfs at `img` and mounts it at `mnt` with the CLI; unmounted
/// when the guard drops, if still mounted.
#[track_caller]
fn mkfs_and_mount(img: &Path, mnt: &Path) -> UnmountOnDrop {
    let out = cli(&[
        "mkfs".as_ref(),
        "--size".as_ref(),
        "64M".as_ref(),
        img.as_os_str(),
    ]);
    assert!(out.status.success(), "mkfs:\n{}", describe(&out));
    let out = cli(&["mount".as_ref(), img.as_os_str(), mnt.as_os_str()]);
    let guard = UnmountOnDrop(mnt.to_path_buf());
    assert!(out.status.success(), "mount:\n{}", describe(&out));
    guard
}

/// A block device that something else holds is not birchfs's to write: while birchfs
/// is mounted on it, mkfs.ext4 will not touch it (birchfs claims it, O_EXCL); while
/// the kernel has ext4 mounted on it, `birchfs mkfs --force` and `birchfs mount`
/// refuse it and leave it whole (both wrote over the mounted ext4 before).
#[test]
fn a_block_device_in_use_by_the_system_is_refused() {
    let mut m = Mount::on_loop_device("256M");
    fs::write(m.path("f"), b"kept").unwrap();
    let dev = m.image().to_path_buf();
    let mkfs_ext4 = |dev: &Path| {
        Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(dev)
            .output()
    };
    let Ok(out) = mkfs_ext4(&dev) else {
        eprintln!("note: no mkfs.ext4 here; skipped");
        return;
    };
    assert!(
        !out.status.success(),
        "mkfs.ext4 wrote over a mounted birchfs:\n{}",
        describe(&out)
    );
    assert_eq!(fs::read(m.path("f")).unwrap(), b"kept");
    m.unmount();
    let c = m.check();
    assert!(c.status.success(), "check:\n{}", describe(&c));

    let out = mkfs_ext4(&dev).unwrap();
    assert!(out.status.success(), "mkfs.ext4:\n{}", describe(&out));
    /// A kernel mount, unmounted when dropped.
    struct KernelMount(PathBuf);
    impl Drop for KernelMount {
        fn drop(&mut self) {
            let out = run(Command::new("umount").arg(&self.0), Duration::from_secs(60));
            if !out.status.success() {
                eprintln!("umount {}:\n{}", self.0.display(), describe(&out));
            }
        }
    }
    let kdir = tempfile::tempdir().unwrap();
    let out = run(
        Command::new("mount")
            .args(["-t", "ext4"])
            .arg(&dev)
            .arg(kdir.path()),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "mount -t ext4:\n{}", describe(&out));
    let k = KernelMount(kdir.path().to_path_buf());
    fs::write(kdir.path().join("keep"), b"ext4's").unwrap();
    let out = m.mkfs(&["--force"]);
    fails_saying(
        &out,
        "in use by the system",
        "mkfs --force of a mounted ext4",
    );
    let out = m.try_mount(&[]);
    fails_saying(&out, "in use by the system", "mount of a mounted ext4");
    assert!(!m.is_mounted());
    assert_eq!(fs::read(kdir.path().join("keep")).unwrap(), b"ext4's");
    drop(k);
    let out = run(
        Command::new("e2fsck").arg("-fn").arg(&dev),
        Duration::from_secs(120),
    );
    assert!(
        out.status.success(),
        "e2fsck after the refusals:\n{}",
        describe(&out)
    );
}

/// An image inside its own mount point mounts (the daemon looked at the image's
/// path once mounted, through the mount it did not serve yet, and hung), serves,
/// and is whole after `umount`; `birchfs umount` waits for its daemon too (it could
/// not open the image, hidden under the mount, and unmounted nothing), also when the
/// filesystem holds a file of the image's name.
#[test]
fn an_image_inside_its_own_mount_point_mounts() {
    let m = Mount::bare();
    let dir = m.host_dir().join("d");
    fs::create_dir(&dir).unwrap();
    let img = dir.join("img");
    let _c = mkfs_and_mount(&img, &dir);
    fs::write(dir.join("f"), b"over the image").unwrap();
    assert_eq!(fs::read(dir.join("f")).unwrap(), b"over the image");
    let out = run(Command::new("umount").arg(&dir), Duration::from_secs(60));
    assert!(out.status.success(), "umount:\n{}", describe(&out));
    // `umount` returns before the daemon's last commit.
    let end = std::time::Instant::now() + Duration::from_secs(30);
    while !image_unlocked(&img) && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        image_unlocked(&img),
        "the daemon did not let go of the image"
    );
    check_clean(&img);
    let out = cli(&["mount".as_ref(), img.as_os_str(), dir.as_os_str()]);
    let _again = UnmountOnDrop(dir.clone());
    assert!(out.status.success(), "mount:\n{}", describe(&out));
    assert_eq!(fs::read(dir.join("f")).unwrap(), b"over the image");
    fs::write(dir.join("img"), b"a file of the image's name").unwrap();
    let out = cli(&["umount".as_ref(), dir.as_os_str()]);
    assert!(out.status.success(), "birchfs umount:\n{}", describe(&out));
    assert!(!is_mounted_at(&dir));
    assert!(
        image_unlocked(&img),
        "birchfs umount returned before the daemon ended"
    );
    check_clean(&img);
}

/// `birchfs umount` of one of two mounts of a filesystem (a bind mount of it, or the
/// original while a bind mount stays) unmounts that one and returns: the daemon goes on
/// serving the other (it waited for that daemon to end, for ever). Unmounting the last
/// one waits for the daemon as before.
#[test]
fn birchfs_umount_of_a_bind_mount_leaves_the_other() {
    let m = Mount::bare();
    let (img, a, b) = (
        m.host_dir().join("img"),
        m.host_dir().join("a"),
        m.host_dir().join("b"),
    );
    fs::create_dir(&a).unwrap();
    fs::create_dir(&b).unwrap();
    let _a = mkfs_and_mount(&img, &a);
    let _b = UnmountOnDrop(b.clone());
    fs::write(a.join("f"), b"shared").unwrap();
    let bind = |from: &Path, to: &Path| {
        let out = run(
            Command::new("mount").arg("--bind").arg(from).arg(to),
            Duration::from_secs(60),
        );
        assert!(out.status.success(), "mount --bind:\n{}", describe(&out));
    };
    let umount = |p: &Path| {
        let out = cli(&[
            "umount".as_ref(),
            "--timeout".as_ref(),
            "20".as_ref(),
            p.as_os_str(),
        ]);
        assert!(
            out.status.success(),
            "birchfs umount {p:?}:\n{}",
            describe(&out)
        );
        assert!(!is_mounted_at(p));
        out
    };
    bind(&a, &b);
    let out = umount(&b);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("stays mounted at"),
        "{}",
        describe(&out)
    );
    assert_eq!(fs::read(a.join("f")).unwrap(), b"shared");
    bind(&a, &b);
    umount(&a);
    assert_eq!(
        fs::read(b.join("f")).unwrap(),
        b"shared",
        "served on at the bind"
    );
    fs::write(b.join("g"), b"after").unwrap();
    umount(&b);
    assert!(
        image_unlocked(&img),
        "the last unmount returned before the daemon ended"
    );
    check_clean(&img);
}

/// A command whose reader goes away (`birchfs snapshot list IMG | head -0`) ends
/// quietly, killed by SIGPIPE as cat or ls are; it panicked ("failed printing to
/// stdout: Broken pipe") with a backtrace.
#[test]
fn a_reader_that_goes_away_ends_a_command_quietly() {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::process::ExitStatusExt;
    let mut m = Mount::new();
    m.unmount();
    for args in [&["snapshot", "list"][..], &["dump"][..]] {
        let mut fds = [0i32; 2];
        // SAFETY: pipe writes two fds into the array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both just made, owned here; the read end closes at once.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        drop(r);
        let out = Command::new(BIN)
            .args(args)
            .arg(m.image())
            .stdout(std::process::Stdio::from(w))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !err.contains("panicked") && out.status.signal() == Some(libc::SIGPIPE),
            "{args:?} into a closed pipe:\n{}",
            describe(&out)
        );
    }
}

/// An image and a mount point whose names are not UTF-8 (or hold a backslash) work
/// with every command: the background mount passed its paths on as text (the mount
/// point became U+FFFD and was not found), and `birchfs umount` could not read the
/// mount table while any mount's path was not UTF-8.
#[test]
fn names_that_are_not_utf8_mount_sync_and_unmount() {
    use std::ffi::OsStr;
    let m = Mount::bare();
    let img = m.host_dir().join(OsStr::from_bytes(b"im\\g\xff.img"));
    let mnt = m.host_dir().join(OsStr::from_bytes(b"mn\xfet"));
    fs::create_dir(&mnt).unwrap();
    let _c = mkfs_and_mount(&img, &mnt);
    fs::write(mnt.join("f"), b"bytes").unwrap();
    for cmd in ["sync", "stats"] {
        let out = cli(&[cmd.as_ref(), mnt.as_os_str()]);
        assert!(out.status.success(), "{cmd}:\n{}", describe(&out));
    }
    let out = cli(&["umount".as_ref(), mnt.as_os_str()]);
    assert!(out.status.success(), "umount:\n{}", describe(&out));
    assert!(!is_mounted_at(&mnt));
    check_clean(&img);
}

/// An image and a loop device over it are one filesystem: while either is mounted,
/// a mount of the other is refused (each took the other for a free image, and both
/// daemons wrote the same blocks).
#[test]
fn an_image_and_a_loop_device_over_it_are_not_mounted_twice() {
    let mut m = Mount::on_loop_device("256M");
    // A block device's mount names the device itself as its source, as a kernel
    // filesystem's does (xfstests compares the two); `birchfs stats` still finds it.
    let mounts = fs::read_to_string("/proc/mounts").unwrap();
    let want = format!(
        "{} {} fuse.birchfs ",
        m.image().display(),
        m.root().display()
    );
    assert!(
        mounts.lines().any(|l| l.starts_with(&want)),
        "no line starting {want:?} in /proc/mounts:\n{mounts}"
    );
    let out = cli(&["stats".as_ref(), m.root().as_os_str()]);
    assert!(out.status.success(), "stats:\n{}", describe(&out));
    fs::write(m.path("f"), b"kept").unwrap();
    let backing = m.host_dir().join("backing");
    let dir = m.host_dir().join("file-mnt");
    fs::create_dir(&dir).unwrap();
    let _c = UnmountOnDrop(dir.clone());
    let out = cli(&["mount".as_ref(), backing.as_os_str(), dir.as_os_str()]);
    // Refused at once, naming the mount (not after waiting for a daemon to finish).
    fails_saying(
        &out,
        &format!("in use by the birchfs mounted at {}", m.root().display()),
        "mount of the file under a mounted loop device",
    );
    assert!(!is_mounted_at(&dir));
    m.unmount();
    let out = cli(&["mount".as_ref(), backing.as_os_str(), dir.as_os_str()]);
    assert!(
        out.status.success(),
        "mount of the file:\n{}",
        describe(&out)
    );
    assert_eq!(fs::read(dir.join("f")).unwrap(), b"kept");
    let out = m.try_mount(&[]);
    fails_saying(
        &out,
        &format!("in use by the birchfs mounted at {}", dir.display()),
        "mount of the loop device over a mounted file",
    );
    let out = cli(&["umount".as_ref(), dir.as_os_str()]);
    assert!(out.status.success(), "umount:\n{}", describe(&out));
    m.mount_with(&[]);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"kept");
    m.unmount();
}

/// `mkfs --log-size` makes a log of that size, which fsyncs use and a mount after a
/// crash replays; a size mkfs cannot place is refused before anything is written.
#[test]
fn mkfs_log_size_sets_the_log_area_or_is_refused_untouched() {
    let mut m = Mount::bare();
    let out = m.mkfs(&["--size", "256M", "--log-size", "3M"]);
    assert!(
        out.status.success(),
        "mkfs --log-size 3M:\n{}",
        describe(&out)
    );
    let dump = cli(&["dump".as_ref(), m.image().as_os_str()]);
    let text = String::from_utf8_lossy(&dump.stdout);
    assert!(text.contains("log 0x100000+3145728"), "{}", describe(&dump));
    m.mount_with(&[]);
    fs::write(m.path("f"), b"logged").unwrap();
    File::open(m.path("f")).unwrap().sync_all().unwrap();
    m.kill_daemon();
    m.mount_with(&[]);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"logged");
    m.unmount();
    let before = fs::read(m.image()).unwrap();
    for bad in ["200M", "1000", "513M", "0"] {
        let out = m.mkfs(&["--force", "--log-size", bad]);
        fails_saying(&out, "--log-size", &format!("mkfs --log-size {bad}"));
        assert!(
            fs::read(m.image()).unwrap() == before,
            "--log-size {bad} wrote"
        );
    }
}

/// mkfs will not overwrite another filesystem unforced (ext4 here, as mkfs.ext4 makes
/// it), and once forced, leaves no trace of it where blkid would find it.
#[test]
fn mkfs_refuses_another_filesystem_without_force_and_wipes_it_with_force() {
    use std::os::unix::fs::FileExt;
    let m = Mount::bare();
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(m.image())
        .unwrap();
    f.set_len(64 << 20).unwrap();
    let made = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(m.image())
        .status()
        .is_ok_and(|s| s.success());
    if !made {
        eprintln!("note: no mkfs.ext4 here; writing an ext4 signature by hand");
        f.write_all_at(&[0x53, 0xef], 1080).unwrap();
    }
    let magic = |f: &fs::File| {
        let mut b = [0u8; 2];
        f.read_exact_at(&mut b, 1080).unwrap();
        b
    };
    let out = m.mkfs(&[]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("ext2/3/4"),
        "mkfs overwrote an ext4 image without --force:\n{}",
        describe(&out)
    );
    assert_eq!(magic(&f), [0x53, 0xef], "the refused mkfs wrote");
    let out = m.mkfs(&["--force"]);
    assert!(out.status.success(), "mkfs --force:\n{}", describe(&out));
    assert_eq!(magic(&f), [0, 0], "the ext4 signature survived mkfs");
    if let Ok(out) = Command::new("blkid").arg("-p").arg(m.image()).output() {
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(!said.contains("TYPE="), "blkid still finds: {said}");
    }
    let c = m.check();
    assert_eq!(c.status.code(), Some(0), "check:\n{}", describe(&c));
}

#[test]
fn mkfs_refuses_an_existing_image_without_force() {
    let mut m = Mount::new();
    fs::write(m.path("keep"), b"precious").unwrap();
    m.unmount();
    let out = m.mkfs(&["--size", "2G"]);
    assert!(
        !out.status.success(),
        "mkfs overwrote an image without --force:\n{}",
        describe(&out)
    );
    assert!(!out.stderr.is_empty());
    m.mount();
    assert_eq!(fs::read(m.path("keep")).unwrap(), b"precious");
    m.unmount();
    let out = m.mkfs(&["--size", "2G", "--force"]);
    assert!(
        out.status.success(),
        "mkfs --force failed:\n{}",
        describe(&out)
    );
    let c = m.check();
    assert_eq!(
        c.status.code(),
        Some(0),
        "check after mkfs --force:\n{}",
        describe(&c)
    );
    m.mount();
    expect_errno(
        fs::metadata(m.path("keep")),
        libc::ENOENT,
        "old file after mkfs --force",
    );
    assert!(
        list_dir(m.root()).is_empty(),
        "a fresh filesystem has an empty root"
    );
    m.unmount();
}

/// A mount of an image its user may not write fails with a message that names the
/// reason and points to `-o ro`, before anything is mounted.
#[test]
fn mounting_an_unwritable_image_says_why_and_suggests_ro() {
    let m = Mount::unmounted("256M");
    let dir = m.host_dir().join("u");
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(m.host_dir(), fs::Permissions::from_mode(0o755)).unwrap();
    let (img, mnt) = (dir.join("img"), dir.join("mnt"));
    fs::copy(m.image(), &img).unwrap();
    fs::create_dir(&mnt).unwrap();
    for p in [&dir, &img, &mnt] {
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
    }
    fs::set_permissions(&img, fs::Permissions::from_mode(0o444)).unwrap();
    let bin = binary_for_nobody(&dir);
    let out = run(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&bin)
            .arg("mount")
            .arg(&img)
            .arg(&mnt),
        Duration::from_secs(60),
    );
    assert!(!is_mounted_at(&mnt), "mounted anyway");
    assert!(!out.status.success(), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Permission denied") && err.contains("-o ro"),
        "{}",
        describe(&out)
    );
}

#[test]
fn read_only_mount_refuses_writes() {
    let mut m = Mount::new();
    fs::write(m.path("f"), b"read me").unwrap();
    fs::create_dir(m.path("d")).unwrap();
    setxattr(&m.path("f"), "user.k", b"v", 0).unwrap();
    m.unmount();
    m.mount_with(&["ro"]);
    let f = m.path("f");
    assert_eq!(fs::read(&f).unwrap(), b"read me");
    assert_eq!(getxattr(&f, "user.k").unwrap(), b"v");
    assert_eq!(list_dir(m.root()), vec!["d", "f"]);
    let erofs = libc::EROFS;
    expect_errno(File::create(m.path("new")), erofs, "create");
    expect_errno(
        OpenOptions::new().write(true).open(&f),
        erofs,
        "open for writing",
    );
    expect_errno(
        OpenOptions::new().append(true).open(&f),
        erofs,
        "open for appending",
    );
    expect_errno(fs::create_dir(m.path("d2")), erofs, "mkdir");
    expect_errno(fs::remove_file(&f), erofs, "unlink");
    expect_errno(fs::remove_dir(m.path("d")), erofs, "rmdir");
    expect_errno(fs::rename(&f, m.path("g")), erofs, "rename");
    expect_errno(symlink("f", m.path("l")), erofs, "symlink");
    expect_errno(fs::hard_link(&f, m.path("h")), erofs, "link");
    expect_errno(mkfifo(&m.path("p"), 0o644), erofs, "mkfifo");
    expect_errno(chmod(&f, 0o600), erofs, "chmod");
    expect_errno(chown(&f, 1, 1), erofs, "chown");
    expect_errno(truncate(&f, 0), erofs, "truncate");
    expect_errno(utimens(&f, (1, 0), (1, 0)), erofs, "utimensat");
    expect_errno(setxattr(&f, "user.x", b"v", 0), erofs, "setxattr");
    expect_errno(removexattr(&f, "user.k"), erofs, "removexattr");
    m.unmount();
    m.mount_with(&[]);
    assert_eq!(list_dir(m.root()), vec!["d", "f"]);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"read me");
    assert_eq!(perm(stat(&m.path("f")).mode()), 0o666 & !current_umask());
    m.unmount();
}

/// A copy of the birchfs binary in `dir` (which uid 65534 can reach), for running it
/// as that user: the build's own path may pass through directories closed to it.
fn binary_for_nobody(dir: &Path) -> PathBuf {
    let bin = dir.join("birchfs");
    fs::copy(BIN, &bin).unwrap();
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

/// The root directory belongs to whoever ran mkfs (as mke2fs does), so a user who
/// makes and mounts an image can write to it; `--root-owner` names another owner.
#[test]
fn mkfs_gives_the_root_directory_to_the_user_who_ran_it() {
    let mut m = Mount::bare();
    let out = m.mkfs(&["--size", "256M", "--root-owner", "1234:5678"]);
    assert!(out.status.success(), "mkfs:\n{}", describe(&out));
    for bad in ["1234", "a:b", "1:2:3", ":5"] {
        let out = m.mkfs(&["--force", "--root-owner", bad]);
        assert!(!out.status.success(), "--root-owner {bad} was taken");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("bad owner"),
            "{}",
            describe(&out)
        );
    }
    m.mount();
    let st = stat(m.root());
    assert_eq!((st.uid(), st.gid()), (1234, 5678));
    assert_eq!(perm(st.mode()), 0o755);
    assert!(st.is_dir());
    m.unmount();
    // Run by root without the option: root's.
    let out = m.mkfs(&["--force"]);
    assert!(out.status.success(), "mkfs:\n{}", describe(&out));
    m.mount();
    assert_eq!((stat(m.root()).uid(), stat(m.root()).gid()), (0, 0));
    m.unmount();
    // Run by another user: theirs.
    let dir = m.host_dir().join("u");
    fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    fs::set_permissions(m.host_dir(), fs::Permissions::from_mode(0o755)).unwrap();
    let img = dir.join("img");
    let bin = binary_for_nobody(&dir);
    let out = run(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&bin)
            .args(["mkfs", "--size", "256M"])
            .arg(&img),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "mkfs as nobody:\n{}", describe(&out));
    fs::rename(&img, m.image()).unwrap();
    m.mount();
    assert_eq!((stat(m.root()).uid(), stat(m.root()).gid()), (65534, 65534));
    m.unmount();
}

#[test]
fn mkfs_of_a_mounted_image_changes_nothing() {
    let mut m = Mount::new();
    fs::write(m.path("keep"), b"precious").unwrap();
    File::open(m.path("keep")).unwrap().sync_all().unwrap();
    let before = fs::metadata(m.image()).unwrap().len();
    // --force and a new size: it used to cut the image down before it saw the lock.
    let out = m.mkfs(&["--force", "--size", "64M"]);
    assert!(
        !out.status.success(),
        "mkfs of a mounted image succeeded:\n{}",
        describe(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("in use"),
        "the refusal should say the image is in use:\n{}",
        describe(&out)
    );
    assert_eq!(
        fs::metadata(m.image()).unwrap().len(),
        before,
        "image resized"
    );
    assert_eq!(fs::read(m.path("keep")).unwrap(), b"precious");
    m.remount();
    assert_eq!(fs::read(m.path("keep")).unwrap(), b"precious");
    m.unmount();
}

/// Right after `umount` the daemon may still be writing its last commit: `check`
/// waits for the image's lock instead of refusing it as in use.
#[test]
fn check_waits_for_a_daemon_that_is_finishing() {
    let mut m = Mount::new();
    fs::write(m.path("f"), b"x").unwrap();
    m.unmount();
    // Stand in for a daemon still committing: hold the lock for a second.
    let f = File::open(m.image()).unwrap();
    // SAFETY: flock on a valid fd owned by `f`.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
    let holder = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        drop(f);
    });
    let c = m.check();
    holder.join().unwrap();
    assert_eq!(
        c.status.code(),
        Some(0),
        "check while the image was held for a second:\n{}",
        describe(&c)
    );
}

/// Where there is no /dev/fuse (a container not given the device), the mount says so
/// and how to get it; it said "cannot mount on MNT: No such file or directory", as if
/// the mount point were missing. Run in a mount namespace of its own with an empty
/// /dev (but for /dev/null).
#[test]
fn a_missing_dev_fuse_is_named() {
    let m = Mount::unmounted("64M");
    let out = run(
        Command::new("unshare")
            .args([
                "-m",
                "sh",
                "-c",
                "mount -t tmpfs none /dev && mknod -m 666 /dev/null c 1 3 && \
                 exec \"$0\" mount \"$1\" \"$2\"",
                BIN,
            ])
            .arg(m.image())
            .arg(m.root()),
        Duration::from_secs(60),
    );
    fails_saying(&out, "there is no /dev/fuse", "mount without /dev/fuse");
    assert!(!is_mounted_at(m.root()));
}

/// A user who is not root makes, mounts (through the setuid fusermount3), uses and
/// unmounts a filesystem of their own. Needs root (to act as uid 65534) and
/// fusermount3; where /dev/fuse is closed to users, the mount says so, and then
/// /dev/fuse is opened to users for the test (as most distributions have it) and
/// set back after.
#[test]
fn a_user_makes_mounts_uses_and_unmounts_their_own_filesystem() {
    if !Path::new("/usr/bin/fusermount3").exists() && !Path::new("/bin/fusermount3").exists() {
        eprintln!("note: no fusermount3 here; skipped");
        return;
    }
    struct DevFuseMode(Option<u32>);
    impl Drop for DevFuseMode {
        fn drop(&mut self) {
            if let Some(mode) = self.0 {
                let _ = fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(mode));
            }
        }
    }
    let m = Mount::bare();
    fs::set_permissions(m.host_dir(), fs::Permissions::from_mode(0o755)).unwrap();
    let dir = m.host_dir().join("u");
    fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    let bin = binary_for_nobody(&dir);
    let (img, mnt) = (dir.join("img"), dir.join("mnt"));
    let as_nobody = |script: &str| {
        run(
            Command::new("setpriv")
                .args([
                    "--reuid=65534",
                    "--regid=65534",
                    "--clear-groups",
                    "sh",
                    "-c",
                ])
                .arg(script)
                .arg("sh")
                .arg(&bin)
                .arg(&img)
                .arg(&mnt),
            Duration::from_secs(120),
        )
    };
    let mode = stat(Path::new("/dev/fuse")).mode() & 0o7777;
    if mode & 0o006 != 0o006 {
        // Closed to users, as here: the mount says so (it said "Permission denied").
        let out = as_nobody(r#""$1" mkfs --size 64M "$2" && mkdir "$3" && "$1" mount "$2" "$3""#);
        let what = format!("mount as uid 65534 with /dev/fuse mode {mode:o}");
        fails_saying(&out, "may not open /dev/fuse", &what);
        assert!(!is_mounted_at(&mnt));
        fs::remove_file(&img).unwrap();
        fs::remove_dir(&mnt).unwrap();
    } else {
        eprintln!("note: /dev/fuse is open to users here; its message is not checked");
    }
    let _restore = DevFuseMode((mode & 0o006 != 0o006).then_some(mode));
    if mode & 0o006 != 0o006 {
        fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(0o666)).unwrap();
    }
    let script = r#"set -e
        "$1" mkfs --size 256M "$2"
        mkdir "$3"
        "$1" mount "$2" "$3"
        echo mine > "$3/f"
        mkdir "$3/d"
        cat "$3/f"
        "$1" stats "$3" | grep -q fsyncs
        "$1" umount "$3"
        "$1" check "$2""#;
    let out = as_nobody(script);
    let left_mounted = is_mounted_at(&mnt);
    if left_mounted {
        let _ = Command::new("umount").arg("-l").arg(&mnt).status();
    }
    assert!(out.status.success(), "as uid 65534:\n{}", describe(&out));
    assert!(!left_mounted, "still mounted after birchfs umount");
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l == "mine"),
        "{}",
        describe(&out)
    );
    assert!(image_unlocked(&img));
    // What the user wrote is theirs, on the disk.
    let mut root = Mount::bare();
    fs::rename(&img, root.image()).unwrap();
    root.mount();
    let st = stat(&root.path("f"));
    assert_eq!((st.uid(), st.gid()), (65534, 65534));
    assert_eq!(fs::read(root.path("f")).unwrap(), b"mine\n");
    assert_eq!(stat(&root.path("d")).uid(), 65534);
    root.unmount();
}

/// `birchfs umount` unmounts nothing when it cannot open the image to wait on (here,
/// renamed while mounted), and says so.
#[test]
fn birchfs_umount_leaves_a_mount_whose_image_it_cannot_open() {
    let mut m = Mount::new();
    let moved = m.image().with_extension("moved");
    fs::rename(m.image(), &moved).unwrap();
    let out = run(
        Command::new(BIN).arg("umount").arg(m.root()),
        Duration::from_secs(30),
    );
    fs::rename(&moved, m.image()).unwrap();
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nothing unmounted"),
        "{}",
        describe(&out)
    );
    assert!(is_mounted_at(m.root()), "unmounted without waiting");
    let out = m.birchfs_umount();
    assert!(out.status.success(), "{}", describe(&out));
    assert!(image_unlocked(m.image()));
}

/// An image deleted while mounted: `birchfs umount` unmounts nothing (that would lose
/// the image and all it holds) and names the daemon's descriptor of it, and the way out
/// it gives (remount read-only, copy from there, unmount) gets the image back whole.
#[test]
fn birchfs_umount_keeps_a_mount_whose_image_was_deleted_and_says_how_to_save_it() {
    let mut m = Mount::new();
    fs::write(m.path("f"), b"kept").unwrap();
    fs::remove_file(m.image()).unwrap();
    let out = m.birchfs_umount();
    fails_saying(
        &out,
        "was deleted while mounted",
        "umount of a deleted image",
    );
    assert!(is_mounted_at(m.root()), "unmounted a deleted image");
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let held = err
        .split_whitespace()
        .find(|w| w.starts_with("/proc/"))
        .map(|w| w.trim_end_matches(['.', ',']))
        .unwrap_or_else(|| panic!("no /proc path in: {err}"))
        .to_owned();
    let remount = cli(&[
        "mount".as_ref(),
        "-o".as_ref(),
        "remount,ro".as_ref(),
        m.image().as_os_str(),
        m.root().as_os_str(),
    ]);
    assert!(remount.status.success(), "{}", describe(&remount));
    fs::copy(&held, m.image()).unwrap();
    let out = m.birchfs_umount();
    assert!(out.status.success(), "{}", describe(&out));
    assert!(!is_mounted_at(m.root()));
    check_clean(m.image());
    m.mount();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"kept");
    m.unmount();
}

/// FITRIM on the mount (what `fstrim` does), with `start`, `len` and `minlen`: the
/// bytes trimmed, or the errno.
fn fitrim(dir: &Path, start: u64, len: u64, min_len: u64) -> Result<u64, i32> {
    const FITRIM: libc::c_ulong = 0xc018_5879;
    let d = File::open(dir).unwrap();
    let mut range = [start, len, min_len];
    // SAFETY: FITRIM reads and writes a struct fstrim_range (three u64s).
    let rc = unsafe { libc::ioctl(d.as_raw_fd(), FITRIM, range.as_mut_ptr()) };
    if rc == 0 {
        Ok(range[1])
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    }
}

/// A 512 MiB birchfs, on a loop device or an image file, mounted with `opts`, that
/// holds a 64 MiB file `big` and a 1 MiB file `keep`, both fsynced.
struct Stored {
    m: Mount,
    /// The host file whose blocks hold the filesystem: the image, or the loop
    /// device's backing file.
    host: PathBuf,
    /// What `keep` holds.
    keep: Vec<u8>,
    /// Bytes of the host's blocks in `host` once both files were stored.
    full: u64,
}

impl Stored {
    fn new(on_loop: bool, opts: &[&str], seed: u64) -> Stored {
        let mut m = if on_loop {
            Mount::on_loop_device("512M")
        } else {
            Mount::with_size("512M")
        };
        if !opts.is_empty() {
            m.unmount();
            m.mount_with(opts);
        }
        let host = if on_loop {
            m.host_dir().join("backing")
        } else {
            m.image().to_path_buf()
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let big: Vec<u8> = (0..64 << 20).map(|_| rng.gen()).collect();
        let keep: Vec<u8> = (0..1 << 20).map(|_| rng.gen()).collect();
        for (name, data) in [("big", &big), ("keep", &keep)] {
            let mut f = File::create(m.path(name)).unwrap();
            f.write_all(data).unwrap();
            f.sync_all().unwrap();
        }
        let full = host_blocks(&host);
        assert!(
            full >= 65 << 20,
            "{}: only {full} bytes stored",
            host.display()
        );
        Stored {
            m,
            host,
            keep,
            full,
        }
    }

    /// `keep` reads back, also after a remount; then unmounts (check is clean).
    fn keep_stays(mut self) {
        let m = &mut self.m;
        assert!(
            fs::read(m.path("keep")).unwrap() == self.keep,
            "keep differs"
        );
        m.remount();
        assert!(
            fs::read(m.path("keep")).unwrap() == self.keep,
            "keep differs after remount"
        );
        m.unmount();
    }
}

/// Bytes of the host's blocks that `p` takes.
fn host_blocks(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(p).unwrap().blocks() * 512
}

/// `fstrim` gives a deleted file's space back to the host, on an image file (as
/// holes) and on a loop device (as discards, which punch the holes in its backing
/// file); what is stored stays. Only root or the user who mounted may trim.
#[test]
fn fstrim_gives_the_free_space_back_to_the_host() {
    for on_loop in [false, true] {
        let st = Stored::new(on_loop, &[], 11);
        let m = &st.m;
        fs::remove_file(m.path("big")).unwrap();
        let trimmed = fitrim(m.root(), 0, u64::MAX, 0).expect("FITRIM failed");
        let after = host_blocks(&st.host);
        assert!(
            trimmed >= 64 << 20 && st.full - after >= 60 << 20,
            "on_loop {on_loop}: {trimmed} bytes trimmed, host blocks {} -> {after}",
            st.full
        );
        // What ext4 and XFS refuse: pieces larger than the filesystem, a range
        // shorter than a block or starting past the end.
        assert_eq!(
            fitrim(m.root(), 0, u64::MAX, 1 << 40),
            Err(libc::EINVAL),
            "minlen"
        );
        assert_eq!(fitrim(m.root(), 0, 100, 0), Err(libc::EINVAL), "len");
        assert_eq!(
            fitrim(m.root(), 1 << 50, 1 << 20, 0),
            Err(libc::EINVAL),
            "start"
        );
        let as_nobody = run_as(65534, 65534, || fitrim(m.root(), 0, u64::MAX, 0));
        assert_eq!(
            as_nobody,
            Err(libc::EPERM),
            "a user who did not mount trimmed"
        );
        st.keep_stays();
    }
}

/// `-o discard` gives freed space back at each commit, without fstrim: deleting a
/// 64 MiB file and committing (`birchfs sync`) takes it off the host's blocks, of an
/// image file and of a loop device's backing file; what is kept reads back after a
/// remount, and check is clean.
#[test]
fn online_discard_gives_a_deleted_files_space_back_at_its_commit() {
    for on_loop in [false, true] {
        let st = Stored::new(on_loop, &["discard"], 14);
        let m = &st.m;
        let sync = || {
            let out = birchfs(["sync".as_ref(), m.root().as_os_str()]);
            assert!(out.status.success(), "{}", describe(&out));
        };
        sync();
        let full = host_blocks(&st.host);
        fs::remove_file(m.path("big")).unwrap();
        sync();
        let after = host_blocks(&st.host);
        assert!(
            full - after >= 60 << 20,
            "on_loop {on_loop}: host blocks {full} -> {after} after the delete's commit"
        );
        st.keep_stays();
    }
}

/// syncfs() (`sync -f`) succeeds after an unlink, and after a rename over a file:
/// the kernel writes back the times it stamped on the deleted file, and an error for
/// that was kept as a writeback error of the whole mount, which syncfs returned
/// (ENOENT).
#[test]
fn syncfs_succeeds_after_an_unlink() {
    let m = Mount::new();
    for i in 0..4 {
        let p = m.path(format!("f{i}"));
        let mut f = File::create(&p).unwrap();
        f.write_all(b"data").unwrap();
        f.sync_all().unwrap();
        drop(f);
        if i % 2 == 0 {
            fs::remove_file(&p).unwrap();
        } else {
            // Write, fsync, rename over: the old file goes.
            let t = m.path("new");
            let mut f = File::create(&t).unwrap();
            f.write_all(b"new data").unwrap();
            f.sync_all().unwrap();
            fs::rename(&t, &p).unwrap();
        }
        let d = File::open(m.root()).unwrap();
        // SAFETY: syncfs on a valid fd owned by `d`.
        let rc = unsafe { libc::syncfs(d.as_raw_fd()) };
        assert_eq!(
            rc,
            0,
            "syncfs after unlink or rename {i}: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// `timeout=` and `negative_timeout=` let the kernel keep names, attributes and
/// missing names: a second walk over the same files and a second look for a missing
/// name send nothing, and every change made through the mount shows at once all the
/// same (the kernel drops what it kept of what it changes): a name created where one
/// was missing, a link count, a mode, a rename, an unlink, a snapshot.
#[test]
fn long_timeouts_keep_what_the_kernel_was_told_and_every_change_shows() {
    let mut m = Mount::unmounted("128M");
    m.mount_with(&["timeout=3600", "negative_timeout=3600"]);
    let kinds = ["lookup", "getattr"];
    let asked = |m: &Mount| {
        let requests = &daemon_stats(m)["requests"];
        kinds.map(|k| requests[k].as_u64().unwrap_or(0))
    };
    fs::create_dir(m.path("d")).unwrap();
    for i in 0..50 {
        fs::write(m.path(format!("d/f{i}")), b"x").unwrap();
    }
    let walk = |m: &Mount| {
        for i in 0..50 {
            fs::symlink_metadata(m.path(format!("d/f{i}"))).unwrap();
        }
        assert!(fs::symlink_metadata(m.path("d/missing")).is_err());
    };
    walk(&m);
    // Past the default one-second timeout, which would send them all again.
    std::thread::sleep(Duration::from_millis(1500));
    let before = asked(&m);
    walk(&m);
    assert_eq!(
        asked(&m),
        before,
        "lookups or getattrs sent for what the kernel kept"
    );
    // Changes through the mount show at once.
    fs::write(m.path("d/missing"), b"now here").unwrap();
    assert_eq!(fs::read(m.path("d/missing")).unwrap(), b"now here");
    fs::hard_link(m.path("d/f0"), m.path("d/g0")).unwrap();
    assert_eq!(stat(&m.path("d/f0")).nlink(), 2);
    fs::remove_file(m.path("d/g0")).unwrap();
    assert_eq!(stat(&m.path("d/f0")).nlink(), 1);
    assert!(fs::symlink_metadata(m.path("d/g0")).is_err());
    fs::set_permissions(m.path("d/f1"), fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(stat(&m.path("d/f1")).mode() & 0o7777, 0o600);
    fs::rename(m.path("d/f2"), m.path("d/f3")).unwrap();
    assert!(fs::symlink_metadata(m.path("d/f2")).is_err());
    assert_eq!(stat(&m.path("d")).nlink(), 2);
    assert!(fs::symlink_metadata(m.path(".snapshots/s")).is_err());
    let out = birchfs([
        "snapshot".as_ref(),
        "create".as_ref(),
        m.root().as_os_str(),
        "s".as_ref(),
    ]);
    assert!(out.status.success(), "snapshot create:\n{}", describe(&out));
    assert_eq!(
        fs::read(m.path(".snapshots/s/d/missing")).unwrap(),
        b"now here"
    );
    // A file written and closed shows its blocks (close drops the kernel's count).
    fs::write(m.path("big"), vec![7u8; 1 << 20]).unwrap();
    assert!(stat(&m.path("big")).blocks() >= 2048);
    m.remount();
    assert_eq!(fs::read(m.path("d/missing")).unwrap(), b"now here");
    m.unmount();
}

/// `birchfs stats` counts the FUSE requests served, per kind: a create, an fsync, a
/// rename and an unlink show up as one request each (also over io_uring, where they
/// take another way in), the data as writes, and `birchfs stats` names them.
#[test]
fn stats_count_fuse_requests_by_kind() {
    let m = Mount::new();
    let kinds = ["create", "fsync", "rename", "unlink", "write", "lookup"];
    // One reading of the counters, each kind's count in it.
    let counts = || {
        let requests = &daemon_stats(&m)["requests"];
        kinds.map(|k| requests[k].as_u64().unwrap_or(0))
    };
    let before = counts();
    let mut f = File::create(m.path("a")).unwrap();
    f.write_all(&[1; 4096]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    fs::rename(m.path("a"), m.path("b")).unwrap();
    fs::remove_file(m.path("b")).unwrap();
    let after = counts();
    let delta: BTreeMap<&str, u64> = (0..kinds.len())
        .map(|i| (kinds[i], after[i] - before[i]))
        .collect();
    for kind in ["create", "fsync", "rename", "unlink"] {
        assert_eq!(delta[kind], 1, "{kind} requests: {delta:?}");
    }
    assert!(delta["write"] >= 1 && delta["lookup"] >= 1, "{delta:?}");
    let out = birchfs(["stats".as_ref(), m.root().as_os_str()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("requests.create"),
        "{}",
        describe(&out)
    );
}

/// After a kill -9 the dead mount stays until unmounted: mounting again there says
/// so and how to clear it (it said "does not exist or is not a directory"), and
/// `birchfs umount` clears it, after which the mount finds what was fsynced.
#[test]
fn a_mount_over_a_dead_one_says_how_to_clear_it() {
    let mut m = Mount::new();
    let f = File::create(m.path("kept")).unwrap();
    f.write_all_at(b"fsynced", 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    m.kill_daemon_leaving_its_mount();
    assert!(
        is_mounted_at(m.root()),
        "the dead mount went away by itself"
    );
    let out = birchfs([
        "mount".as_ref(),
        m.image().as_os_str(),
        m.root().as_os_str(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success() && err.contains("gone") && err.contains("birchfs umount"),
        "a mount over a dead one:\n{}",
        describe(&out)
    );
    // So do the commands that take a mount point (snapshot and trim took it for an
    // image: "Is a directory").
    let root = m.root().as_os_str();
    for args in [
        vec!["stats".as_ref(), root],
        vec!["sync".as_ref(), root],
        vec!["trim".as_ref(), root],
        vec!["snapshot".as_ref(), "list".as_ref(), root],
    ] {
        let out = birchfs(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("birchfs umount"),
            "{args:?} on a dead mount:\n{}",
            describe(&out)
        );
    }
    let out = birchfs(["umount".as_ref(), m.root().as_os_str()]);
    assert!(
        out.status.success(),
        "umount of a dead mount:\n{}",
        describe(&out)
    );
    m.mark_unmounted();
    m.mount();
    assert_eq!(fs::read(m.path("kept")).unwrap(), b"fsynced");
    m.unmount();
}

/// `birchfs sync` makes what a mount holds durable at once: a file written and not
/// fsynced, in a new directory, survives a kill -9 of the daemon right after it, where
/// one written after it is lost (commit=0: no timer commits). A directory that is not
/// a birchfs mount is refused.
#[test]
fn birchfs_sync_makes_what_a_mount_holds_durable() {
    let mut m = Mount::new();
    m.unmount();
    m.mount_with(&["commit=0"]);
    let mut rng = StdRng::seed_from_u64(13);
    let data: Vec<u8> = (0..3 << 20).map(|_| rng.gen()).collect();
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/synced"), &data).unwrap();
    let out = birchfs(["sync".as_ref(), m.root().as_os_str()]);
    assert!(out.status.success(), "{}", describe(&out));
    fs::write(m.path("unsynced"), b"not synced").unwrap();
    m.kill_daemon();
    m.mount();
    assert!(
        fs::read(m.path("d/synced")).unwrap() == data,
        "the synced file differs"
    );
    assert!(
        !m.path("unsynced").exists(),
        "a file never synced survived the kill: this test cannot tell a sync from none"
    );
    refused_as_not_a_mount("sync", m.host_dir());
    // A directory inside the mount is named as such, with the mount point to give
    // (stats said "not on a birchfs mount?", snapshot "No such file or directory").
    fs::create_dir(m.path("sub")).unwrap();
    let root = m.root().to_string_lossy().into_owned();
    for args in [
        &["sync"][..],
        &["stats"],
        &["trim"],
        &["umount"],
        &["snapshot", "list"],
    ] {
        let out = run(
            Command::new(BIN).args(args).arg(m.path("sub")),
            Duration::from_secs(30),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains("is inside the birchfs mounted at")
                && err.contains(&root),
            "birchfs {args:?} on a directory inside the mount:\n{}",
            describe(&out)
        );
    }
    m.unmount();
}

/// When the file system is full and some of the kernel's cached writes cannot reach
/// birchfs, `birchfs sync` still commits the rest, and then fails naming the error:
/// a file written before survives a kill -9 right after it.
#[test]
fn birchfs_sync_commits_the_rest_when_cached_writes_find_no_room() {
    let mut m = Mount::with_size_and_options("64M", &["commit=0"]);
    fs::write(m.path("keep"), b"written before the disk filled").unwrap();
    // More than fits, cached by the kernel and written back as it goes: the last of
    // it is still cached when the sync asks for it, and finds no room.
    let mut f = File::create(m.path("big")).unwrap();
    let chunk = vec![7u8; 1 << 20];
    for _ in 0..96 {
        if f.write_all(&chunk).is_err() {
            break;
        }
    }
    let out = birchfs(["sync".as_ref(), m.root().as_os_str()]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("did not reach birchfs") && said.contains("everything else is committed"),
        "{}",
        describe(&out)
    );
    drop(f);
    m.kill_daemon();
    m.mount();
    assert_eq!(
        fs::read(m.path("keep")).unwrap(),
        b"written before the disk filled",
        "the sync did not commit what did reach birchfs"
    );
    m.unmount();
}

/// `birchfs CMD DIR` fails, saying DIR is not a birchfs mountpoint.
#[track_caller]
fn refused_as_not_a_mount(cmd: &str, dir: &Path) {
    let out = run(Command::new(BIN).arg(cmd).arg(dir), Duration::from_secs(30));
    assert!(
        !out.status.success(),
        "birchfs {cmd} {} succeeded:\n{}",
        dir.display(),
        describe(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a birchfs mountpoint"),
        "{}",
        describe(&out)
    );
}

/// `birchfs trim` does the same for an unmounted image, and through FITRIM for a
/// mount; the image stays clean and its files whole.
#[test]
fn birchfs_trim_takes_an_image_or_a_mount() {
    let mut m = Mount::with_size("512M");
    let mut rng = StdRng::seed_from_u64(12);
    let big: Vec<u8> = (0..64 << 20).map(|_| rng.gen()).collect();
    fs::write(m.path("big"), &big).unwrap();
    fs::write(m.path("keep"), &big[..1 << 20]).unwrap();
    m.unmount();
    let full = host_blocks(m.image());
    m.mount();
    fs::remove_file(m.path("big")).unwrap();
    m.unmount();
    let out = birchfs(["trim".as_ref(), m.image().as_os_str()]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("trimmed"),
        "{}",
        describe(&out)
    );
    let after = host_blocks(m.image());
    assert!(full - after >= 60 << 20, "image blocks {full} -> {after}");
    let c = m.check();
    assert_eq!(c.status.code(), Some(0), "check:\n{}", describe(&c));
    m.mount();
    assert!(
        fs::read(m.path("keep")).unwrap() == big[..1 << 20],
        "keep differs"
    );
    let out = birchfs(["trim".as_ref(), m.root().as_os_str()]);
    assert!(out.status.success(), "{}", describe(&out));
    // Not a birchfs mount (here the host's directory around it): refused, as FITRIM
    // there would trim the host's filesystem.
    refused_as_not_a_mount("trim", m.host_dir());
    m.unmount();
}

/// `birchfs umount --timeout` stops waiting for a daemon that does not finish (here,
/// stopped) with an error naming it; the mount is gone, and the daemon ends by itself
/// once it runs again, with everything written.
#[test]
fn birchfs_umount_gives_up_after_its_timeout() {
    let mut m = Mount::new();
    fs::write(m.path("f"), b"kept").unwrap();
    let pids = processes_naming(m.image());
    assert_eq!(pids.len(), 1, "daemons: {pids:?}");
    let signal = |sig| {
        // SAFETY: kill on the daemon's pid, found in /proc.
        unsafe { libc::kill(pids[0] as i32, sig) }
    };
    signal(libc::SIGSTOP);
    let t0 = std::time::Instant::now();
    let out = m.birchfs_umount_with(&["--timeout", "1"]);
    let took = t0.elapsed();
    signal(libc::SIGCONT);
    assert!(!out.status.success(), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("(pid {})", pids[0])) && err.contains("after 1 s"),
        "{}",
        describe(&out)
    );
    assert!(took < Duration::from_secs(10), "gave up after {took:?}");
    assert!(!is_mounted_at(m.root()), "still mounted");
    assert!(
        wait_until(Duration::from_secs(30), || image_unlocked(m.image())),
        "the daemon never ended"
    );
    m.mount();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"kept");
}

/// SIGUSR1 makes the daemon log its counters and SIGUSR2 is only logged (their
/// default would end it and leave a dead mount); SIGHUP unmounts cleanly, with
/// everything written kept.
#[test]
fn the_daemon_logs_its_counters_on_sigusr1_and_unmounts_on_sighup() {
    let mut m = Mount::unmounted("256M");
    m.log_to_file();
    m.mount();
    fs::write(m.path("before"), b"one").unwrap();
    let pids = processes_naming(m.image());
    assert_eq!(pids.len(), 1, "daemons: {pids:?}");
    let signal = |sig| {
        // SAFETY: kill on the daemon's pid, found in /proc.
        assert_eq!(unsafe { libc::kill(pids[0] as i32, sig) }, 0);
    };
    signal(libc::SIGUSR1);
    signal(libc::SIGUSR2);
    let logged = |m: &Mount, what: &str| {
        assert!(
            wait_until(Duration::from_secs(10), || m.daemon_log().contains(what)),
            "never logged {what:?}:\n{}",
            m.daemon_log()
        );
    };
    logged(
        &m,
        &format!("signal {}: stats {{\"readonly\":false,", libc::SIGUSR1),
    );
    logged(&m, &format!("signal {}: ignored", libc::SIGUSR2));
    fs::write(m.path("after"), b"two").unwrap();
    assert_eq!(fs::read(m.path("before")).unwrap(), b"one");
    assert_eq!(processes_naming(m.image()), pids, "the daemon changed");
    signal(libc::SIGHUP);
    assert!(
        wait_until(Duration::from_secs(30), || !is_mounted_at(m.root())
            && image_unlocked(m.image())),
        "SIGHUP did not unmount"
    );
    m.mark_unmounted();
    logged(&m, &format!("signal {}: unmounting", libc::SIGHUP));
    let c = m.check();
    assert_eq!(c.status.code(), Some(0), "check:\n{}", describe(&c));
    m.mount();
    assert_eq!(fs::read(m.path("before")).unwrap(), b"one");
    assert_eq!(fs::read(m.path("after")).unwrap(), b"two");
}

/// `birchfs umount` waits for the daemon it unmounted, not for the image's lock: when
/// another process takes the lock as the daemon ends, it still returns.
#[test]
fn birchfs_umount_returns_when_its_daemon_ends_though_another_takes_the_lock() {
    let m = Mount::new();
    let pids = processes_naming(m.image());
    assert_eq!(pids.len(), 1, "daemons: {pids:?}");
    // SAFETY: kill on the daemon's pid, found in /proc.
    unsafe { libc::kill(pids[0] as i32, libc::SIGSTOP) };
    let (mnt, img) = (m.root().to_path_buf(), m.image().to_path_buf());
    let umount = std::thread::spawn(move || {
        try_run(
            Command::new(BIN).arg("umount").arg(&mnt),
            Duration::from_secs(20),
        )
    });
    assert!(
        wait_until(Duration::from_secs(10), || !is_mounted_at(m.root())),
        "never unmounted"
    );
    // The daemon dies (a crash while stopped); this test takes the lock at once.
    // SAFETY: as above.
    unsafe { libc::kill(pids[0] as i32, libc::SIGKILL) };
    let holder = File::open(&img).unwrap();
    // SAFETY: flock on a valid fd owned by `holder`; it waits for the dead daemon's.
    assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
    let out = umount.join().unwrap();
    drop(holder);
    let out = out.expect("birchfs umount still waited with its daemon gone");
    assert!(out.status.success(), "{}", describe(&out));
}

/// `birchfs umount` returns once the daemon has written everything and let go of the
/// image, where `umount` returns while the daemon is still committing. Neither
/// leaves a warning in the daemon's log.
#[test]
fn birchfs_umount_returns_after_the_last_commit() {
    let mut m = Mount::new();
    m.unmount();
    m.log_to_file();
    m.mount_with(&["commit=0"]);
    let mut rng = StdRng::seed_from_u64(7);
    let data: Vec<u8> = (0..64 * MIB).map(|_| rng.gen()).collect();
    fs::write(m.path("big"), &data).unwrap();
    fs::write(m.path("small"), b"small").unwrap();
    let out = m.birchfs_umount();
    assert!(out.status.success(), "birchfs umount:\n{}", describe(&out));
    assert!(!is_mounted_at(m.root()), "still mounted");
    assert!(
        image_unlocked(m.image()),
        "birchfs umount returned while the daemon still held the image"
    );
    let c = m.check();
    assert_eq!(c.status.code(), Some(0), "check:\n{}", describe(&c));
    // Not a birchfs mount, or nothing mounted: an error, and nothing unmounted.
    for p in [m.root(), Path::new("/proc")] {
        refused_as_not_a_mount("umount", p);
    }
    assert!(is_mounted_at(Path::new("/proc")));
    m.mount();
    assert!(fs::read(m.path("big")).unwrap() == data, "big differs");
    assert_eq!(fs::read(m.path("small")).unwrap(), b"small");
    // A busy mount stays mounted, with a message.
    let open = File::open(m.path("small")).unwrap();
    let out = m.birchfs_umount();
    assert!(
        !out.status.success(),
        "umount with a file open:\n{}",
        describe(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("busy"),
        "{}",
        describe(&out)
    );
    assert!(is_mounted_at(m.root()));
    drop(open);
    m.unmount();
    let log = m.daemon_log();
    assert!(
        !log.contains("WARN") && !log.contains("ERROR"),
        "clean unmounts left this in the log:\n{log}"
    );
    // Also with a log level asked for (that does not name fuser).
    m.set_daemon_env("BIRCHFS_LOG", "info");
    m.mount();
    m.unmount();
    let more = m.daemon_log()[log.len()..].to_string();
    assert!(
        more.contains("INFO"),
        "BIRCHFS_LOG=info logged nothing:\n{more}"
    );
    assert!(!more.contains("WARN"), "{more}");
}

// ---------------------------------------------------------------------------
// scale and concurrency
// ---------------------------------------------------------------------------

#[test]
fn directory_with_20000_entries() {
    let mut m = Mount::new();
    const N: usize = 20_000;
    let d = m.path("big");
    fs::create_dir(&d).unwrap();
    let name = |i: usize| format!("file-{i:05}");
    for i in 0..N {
        File::create(d.join(name(i))).unwrap();
    }
    assert_eq!(stat(&d).nlink(), 2);
    m.remount(); // cold caches: every stat below is a lookup in birchfs
    let d = m.path("big");
    let mut inos = HashSet::with_capacity(N);
    for i in 0..N {
        let s = lstat(&d.join(name(i)));
        assert!(s.is_file());
        assert_eq!(s.len(), 0);
        assert!(inos.insert(s.ino()), "inode number {} used twice", s.ino());
    }
    for i in [N, N + 1, 99_999] {
        expect_errno(
            fs::symlink_metadata(d.join(name(i))),
            libc::ENOENT,
            "missing name",
        );
    }
    let listed = list_dir(&d);
    assert_eq!(listed.len(), N);
    assert!(
        listed.iter().enumerate().all(|(i, n)| *n == name(i)),
        "listing differs"
    );
    for i in 0..N {
        fs::remove_file(d.join(name(i))).unwrap();
    }
    assert!(list_dir(&d).is_empty());
    assert_eq!(readdir_raw(&d).unwrap().len(), 2);
    fs::remove_dir(&d).unwrap();
    m.remount();
    expect_errno(
        fs::metadata(m.path("big")),
        libc::ENOENT,
        "removed directory",
    );
    m.unmount();
}

fn conc_key(t: usize, i: usize) -> u64 {
    7_000_000 + (t * 1000 + i) as u64
}

fn conc_len(t: usize, i: usize) -> usize {
    (mix64(conc_key(t, i)) % 20_000) as usize + 1
}

#[test]
fn concurrent_create_write_fsync_delete() {
    let mut m = Mount::new();
    const THREADS: usize = 8;
    const FILES: usize = 200;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let dir = m.path(format!("t{t}"));
            s.spawn(move || {
                fs::create_dir(&dir).unwrap();
                for i in 0..FILES {
                    let mut f = File::create(dir.join(format!("f{i:03}"))).unwrap();
                    f.write_all(pattern(conc_key(t, i), conc_len(t, i)))
                        .unwrap();
                    f.sync_all().unwrap();
                }
                for i in 0..FILES {
                    let got = fs::read(dir.join(format!("f{i:03}"))).unwrap();
                    assert_bytes_eq(
                        &got,
                        pattern(conc_key(t, i), conc_len(t, i)),
                        0,
                        "just written",
                    );
                }
                for i in (0..FILES).step_by(2) {
                    fs::remove_file(dir.join(format!("f{i:03}"))).unwrap();
                }
                File::open(&dir).unwrap().sync_all().unwrap();
            });
        }
    });
    let check = |m: &Mount| {
        let mut dirs: Vec<String> = (0..THREADS).map(|t| format!("t{t}")).collect();
        dirs.sort();
        assert_eq!(list_dir(m.root()), dirs);
        for t in 0..THREADS {
            let dir = m.path(format!("t{t}"));
            let want: Vec<String> = (1..FILES).step_by(2).map(|i| format!("f{i:03}")).collect();
            assert_eq!(list_dir(&dir), want, "contents of t{t}");
            for i in (1..FILES).step_by(2) {
                let got = fs::read(dir.join(format!("f{i:03}"))).unwrap();
                assert_bytes_eq(&got, pattern(conc_key(t, i), conc_len(t, i)), 0, "survivor");
            }
        }
    };
    check(&m);
    m.remount();
    check(&m);
    m.unmount();
}

#[test]
fn mkfs_preallocate_writes_the_whole_image_and_mounts() {
    use std::os::unix::fs::MetadataExt;
    let mut m = Mount::new();
    m.unmount();
    // An existing file is overwritten whole only with --force, and a tiny one not at all.
    let other = m.image().with_extension("other");
    fs::write(&other, vec![7u8; 40 << 20]).unwrap();
    let out = Command::new(BIN)
        .args(["mkfs", "--preallocate"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(!out.status.success(), "--preallocate without --force");
    assert!(
        fs::read(&other).unwrap().iter().all(|&b| b == 7),
        "a refused --preallocate wrote to the file"
    );
    fs::remove_file(&other).unwrap();
    let before = fs::metadata(m.image()).unwrap().len();
    let out = m.mkfs(&["--size", "16M", "--force", "--preallocate"]);
    assert!(!out.status.success(), "--preallocate of 16 MiB");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nothing written"),
        "refused only after zeroing:\n{}",
        describe(&out)
    );
    assert_eq!(
        fs::metadata(m.image()).unwrap().len(),
        before,
        "resized anyway"
    );
    // A new file that mkfs refuses is not left behind.
    let new = m.image().with_extension("new");
    let out = Command::new(BIN)
        .args(["mkfs", "--preallocate", "--size", "16M"])
        .arg(&new)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        !new.exists(),
        "a refused mkfs left {} behind",
        new.display()
    );
    let out = m.mkfs(&["--size", "96M", "--force", "--preallocate"]);
    assert!(
        out.status.success(),
        "mkfs --preallocate failed:\n{}",
        describe(&out)
    );
    let meta = fs::metadata(m.image()).unwrap();
    assert_eq!(meta.len(), 96 * MIB);
    // Every block is allocated on the host: no holes left for fsyncs to fill.
    assert!(
        meta.blocks() * 512 >= 96 * MIB,
        "only {} bytes allocated",
        meta.blocks() * 512
    );
    let c = m.check();
    assert_eq!(c.status.code(), Some(0), "check:\n{}", describe(&c));
    m.mount();
    fs::write(m.path("f"), b"after preallocate").unwrap();
    m.unmount();
    m.mount();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"after preallocate");
    m.unmount();
}

// ---------------------------------------------------------------------------
// SEEK_DATA / SEEK_HOLE
// ---------------------------------------------------------------------------

/// A write the kernel takes, up to its largest file size (8 EiB for FUSE), is stored:
/// the fsync succeeds and the data is there after a remount (past 1 PiB, birchfs's
/// limit before, the kernel took such writes into its cache and the fsync failed).
#[test]
fn files_grow_to_the_kernels_largest_size() {
    let max = i64::MAX as u64;
    let mut m = Mount::new();
    let p = m.path("huge");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&p)
        .unwrap();
    let tail = pattern(5, 70_000);
    f.write_all_at(tail, max - tail.len() as u64).unwrap();
    f.write_all_at(b"middle", 1 << 62).unwrap();
    f.sync_all()
        .expect("fsync of a file written up to the largest size");
    drop(f);
    m.remount();
    let f = File::open(&p).unwrap();
    assert_eq!(f.metadata().unwrap().len(), max);
    let mut got = vec![0u8; tail.len()];
    f.read_exact_at(&mut got, max - tail.len() as u64).unwrap();
    assert!(got == tail, "the last 70,000 bytes differ");
    let mut mid = [0u8; 6];
    f.read_exact_at(&mut mid, 1 << 62).unwrap();
    assert_eq!(&mid, b"middle");
    assert_eq!(seek(&f, 0, libc::SEEK_DATA), Ok(1 << 62));
    drop(f);
    m.unmount();
    let c = m.check();
    assert_eq!(c.status.code(), Some(0), "check:\n{}", describe(&c));
}

/// lseek with `whence` on `f`: the offset, or the errno.
fn seek(f: &File, off: u64, whence: i32) -> Result<u64, i32> {
    let r = unsafe { libc::lseek(f.as_raw_fd(), off as libc::off_t, whence) };
    if r < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    } else {
        Ok(r as u64)
    }
}

/// SEEK_DATA and SEEK_HOLE find a sparse file's data and holes, so `cp` keeps it
/// sparse; while a handle is open for writing, the data it left in the kernel's cache
/// (written, or through a shared mapping) is found too, and the mount goes on
/// answering for every file (it used to decline, and the kernel then said all data).
#[test]
fn seek_data_and_hole_through_the_mount() {
    const MB: u64 = 1 << 20;
    let mut m = Mount::new();
    let p = m.path("sparse");
    {
        let f = File::create(&p).unwrap();
        f.write_all_at(&[7; 4096], MB).unwrap();
        f.write_all_at(&[8; 8192], 3 * MB).unwrap();
        f.set_len(5 * MB).unwrap();
    }
    let f = File::open(&p).unwrap();
    let (data, hole) = (libc::SEEK_DATA, libc::SEEK_HOLE);
    assert_eq!(seek(&f, 0, data), Ok(MB));
    assert_eq!(seek(&f, 0, hole), Ok(0));
    assert_eq!(seek(&f, MB + 100, hole), Ok(MB + 4096));
    assert_eq!(seek(&f, MB + 4096, data), Ok(3 * MB));
    assert_eq!(seek(&f, 3 * MB, hole), Ok(3 * MB + 8192));
    assert_eq!(seek(&f, 3 * MB + 8192, data), Err(libc::ENXIO));
    assert_eq!(seek(&f, 5 * MB, hole), Err(libc::ENXIO));
    let copy = m.path("copy");
    let out = Command::new("cp")
        .arg("--sparse=always")
        .arg(&p)
        .arg(&copy)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(fs::read(&copy).unwrap(), fs::read(&p).unwrap());
    assert!(
        fs::metadata(&copy).unwrap().blocks() <= 64,
        "the copy is not sparse: {} blocks",
        fs::metadata(&copy).unwrap().blocks()
    );
    // A writer's data, cached by the kernel, at 4 MiB, and through a shared mapping
    // at 4.5 MiB: birchfs has the kernel write them back first, and answers exactly.
    let w = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    w.write_all_at(&[9; 4096], 4 * MB).unwrap();
    assert_eq!(
        seek(&f, 3 * MB + 8192, data),
        Ok(4 * MB),
        "the writer's data"
    );
    assert_eq!(seek(&f, 4 * MB, hole), Ok(4 * MB + 4096));
    let len = MB as usize;
    // SAFETY: a fresh shared mapping of 1 MiB of the file from 4 MiB, within its size;
    // unmapped below before `w` is dropped.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            w.as_raw_fd(),
            (4 * MB) as libc::off_t,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    // SAFETY: within the mapping.
    unsafe { std::ptr::write_bytes((map as *mut u8).add(len / 2), 10, 4096) };
    assert_eq!(
        seek(&f, 4 * MB + 4096, data),
        Ok(4 * MB + MB / 2),
        "data written through the mapping"
    );
    assert_eq!(seek(&f, 4 * MB + MB / 2, hole), Ok(4 * MB + MB / 2 + 4096));
    // The mount still answers for every file (a decline would have handed that to the
    // kernel, which says all data up to the size).
    let c = File::open(&copy).unwrap();
    assert_eq!(seek(&c, 0, hole), Ok(0), "the copy's hole, writer open");
    // SAFETY: the mapping made above.
    assert_eq!(unsafe { libc::munmap(map, len) }, 0);
    drop(w);
    let mut all = Vec::new();
    File::open(&p).unwrap().read_to_end(&mut all).unwrap();
    assert_eq!(&all[4 * MB as usize..4 * MB as usize + 4096], &[9; 4096]);
    let at = 4 * MB as usize + len / 2;
    assert_eq!(&all[at..at + 4096], &[10; 4096]);
    drop((f, c));
    m.unmount();
}

/// Appends `chunk` to `f`, each time with an fsync, until the filesystem refuses
/// (or 200 MiB are in); returns the bytes that went in whole.
fn fill_until_refused(f: &mut File, chunk: &[u8]) -> u64 {
    let mut written = 0u64;
    while written < 200 << 20 && f.write_all(chunk).and_then(|()| f.sync_all()).is_ok() {
        written += chunk.len() as u64;
    }
    written
}

/// `birchfs resize` of a mounted filesystem grows it in place, given the mount point
/// or the image: a writer refused for want of space goes on in the new space with the
/// same open file, `df` shows the new size at once, and the image checks clean after
/// the unmount. It never shrinks, and a read-only mount is refused.
#[test]
fn birchfs_resize_grows_a_mounted_filesystem() {
    const MIB: u64 = 1 << 20;
    let mut m = Mount::unmounted("64M");
    m.mount();
    let chunk = mib_data(4, 31);
    let mut f = File::create(m.path("log")).unwrap();
    let written = fill_until_refused(&mut f, &chunk);
    assert!(
        written < 64 * MIB,
        "a 64 MiB filesystem took {written} bytes"
    );
    let size = |m: &Mount| {
        let st = statfs(m.root()).unwrap();
        st.f_blocks as u64 * st.f_bsize as u64
    };
    let before = size(&m);
    let root = m.root().as_os_str().to_owned();
    let resize =
        |what: &std::ffi::OsStr, size: &str| cli(&["resize".as_ref(), what, size.as_ref()]);
    let out = resize(&root, "+64M");
    assert!(out.status.success(), "{}", describe(&out));
    assert!(size(&m) >= before + 60 * MIB, "df: {} bytes", size(&m));
    assert_eq!(fs::metadata(m.image()).unwrap().len(), 128 * MIB);
    // The writer goes on where it was refused, with the same open file.
    f.seek(SeekFrom::Start(written)).unwrap();
    f.set_len(written).unwrap();
    for _ in 0..8 {
        f.write_all(&chunk).unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    // The image, while mounted: the mount grows it; `max` takes the whole file.
    File::options()
        .write(true)
        .open(m.image())
        .unwrap()
        .set_len(256 * MIB)
        .unwrap();
    // Named through a symbolic link of another name, too.
    let link = m.host_dir().join("grown-image");
    std::os::unix::fs::symlink(m.image(), &link).unwrap();
    let out = resize(link.as_os_str(), "max");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stderr).contains("growing it there"),
        "{}",
        describe(&out)
    );
    assert!(size(&m) > 240 * MIB, "df: {} bytes", size(&m));
    fails_saying(&resize(&root, "100M"), "never shrinks", "resize to less");
    fails_saying(&resize(&root, "256M"), "already", "resize to the same size");
    let img = m.image().as_os_str().to_owned();
    let out = resize(&img, "256M");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("growing it there"),
        "{}",
        describe(&out)
    );
    fails_saying(&out, "already", "resize of the mounted image to its size");
    m.unmount();
    check_clean(m.image());
    m.mount_with(&["ro"]);
    assert!(size(&m) > 240 * MIB, "the grown size did not last");
    let all = fs::read(m.path("log")).unwrap();
    assert_eq!(all.len() as u64, written + 8 * chunk.len() as u64);
    assert!(all.chunks(chunk.len()).all(|c| c == chunk), "log changed");
    fails_saying(
        &resize(&root, "+64M"),
        "read-only",
        "resize of a read-only mount",
    );
    m.unmount();
}

/// `birchfs resize` grows a full filesystem: an image file is lengthened (`+SIZE`) or
/// taken whole as it now is (`max`, after `truncate -s`, which a mount points out);
/// the new space takes data, check finds it clean, and what was there stays. It never
/// shrinks.
#[test]
fn birchfs_resize_grows_a_full_filesystem() {
    const MIB: u64 = 1 << 20;
    let mut m = Mount::unmounted("64M");
    m.mount();
    let first = mib_data(8, 21);
    let mut f = File::create(m.path("first")).unwrap();
    let written = fill_until_refused(&mut f, &first);
    drop(f);
    assert!(
        written < 64 * MIB,
        "a 64 MiB filesystem took {written} bytes"
    );
    fs::remove_file(m.path("first")).unwrap();
    fs::write(m.path("kept"), &first).unwrap();
    m.unmount();
    let img = m.image().as_os_str().to_owned();
    let resize = |size: &str| cli(&["resize".as_ref(), img.as_os_str(), size.as_ref()]);
    fails_saying(&resize("32M"), "never shrinks", "resize to less");
    let out = resize("+192M");
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(fs::metadata(m.image()).unwrap().len(), 256 * MIB);
    m.mount();
    let big = mib_data(150, 22);
    fs::write(m.path("big"), &big).unwrap();
    File::open(m.path("big")).unwrap().sync_all().unwrap();
    m.unmount();
    check_clean(m.image());
    File::options()
        .write(true)
        .open(m.image())
        .unwrap()
        .set_len(512 * MIB)
        .unwrap();
    // A mount of the longer image says what lies unused.
    let out = m.try_mount(&[]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stderr).contains("resize"),
        "{}",
        describe(&out)
    );
    m.unmount();
    let out = resize("max");
    assert!(out.status.success(), "{}", describe(&out));
    m.mount();
    let st = statfs(m.root()).unwrap();
    assert!(
        st.f_blocks as u64 * st.f_bsize as u64 > 450 * MIB,
        "{} blocks",
        st.f_blocks
    );
    assert!(fs::read(m.path("kept")).unwrap() == first, "kept changed");
    assert!(fs::read(m.path("big")).unwrap() == big, "big changed");
    m.unmount();
    check_clean(m.image());
}
