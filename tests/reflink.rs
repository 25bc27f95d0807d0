//! Reflinks through a real FUSE mount: `cp` and copy_file_range(2) share extents
//! instead of copying them, and writes un-share only what they write.

mod common;

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::process::Command;

use common::*;

const MB: usize = 1 << 20;

/// The number after `"name":` in a flat JSON text.
fn json_u64(json: &str, name: &str) -> u64 {
    let key = format!("\"{name}\":");
    let at = json
        .find(&key)
        .unwrap_or_else(|| panic!("{name} in {json}"))
        + key.len();
    json[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn cloned_bytes(m: &Mount) -> u64 {
    let out = birchfs(["stats", "--json", m.root().to_str().unwrap()]);
    json_u64(&String::from_utf8_lossy(&out.stdout), "cloned")
}

/// `birchfs stats --space`: (exclusive, shared) data bytes.
fn space(m: &Mount) -> (u64, u64) {
    let out = birchfs(["stats", "--space", "--json", m.root().to_str().unwrap()]);
    assert!(out.status.success(), "stats --space: {}", describe(&out));
    let json = String::from_utf8_lossy(&out.stdout);
    (json_u64(&json, "exclusive"), json_u64(&json, "shared"))
}

/// `cp FROM TO` on the mount; the copy must succeed.
fn cp(m: &Mount, from: &str, to: &str) {
    let out = Command::new("cp")
        .arg(m.path(from))
        .arg(m.path(to))
        .output()
        .unwrap();
    assert!(out.status.success(), "cp: {}", describe(&out));
}

fn sync_fs(m: &Mount) {
    // FUSE passes no syncfs; an fsync of the root makes everything so far durable.
    File::open(m.root()).unwrap().sync_all().unwrap();
}

/// copy_file_range(2) once; returns the bytes it reports.
fn copy_range(from: &File, off_in: u64, to: &File, off_out: u64, len: usize) -> usize {
    let (mut a, mut b) = (off_in as i64, off_out as i64);
    // SAFETY: valid fds and offsets owned by this frame.
    let r =
        unsafe { libc::copy_file_range(from.as_raw_fd(), &mut a, to.as_raw_fd(), &mut b, len, 0) };
    assert!(
        r >= 0,
        "copy_file_range: {}",
        std::io::Error::last_os_error()
    );
    r as usize
}

#[test]
fn cp_on_a_mount_shares_the_data_and_writes_unshare_only_their_blocks() {
    let mut m = Mount::new();
    let src = m.path("src");
    let want = mib_data(32, 1);
    fs::write(&src, &want).unwrap();
    File::open(&src).unwrap().sync_all().unwrap();
    sync_fs(&m);
    let free = free_bytes(m.root());
    cp(&m, "src", "dst");
    sync_fs(&m);
    let used = free.saturating_sub(free_bytes(m.root()));
    assert!(used < 4 * MB as u64, "cp of 32 MiB used {used} bytes");
    assert!(cloned_bytes(&m) >= 32 * MB as u64, "cp went through clone");
    let (exclusive, shared) = space(&m);
    assert_eq!(shared, 32 * MB as u64, "src and dst share every byte");
    assert!(
        exclusive < MB as u64,
        "nothing else was written: {exclusive}"
    );
    assert_eq!(fs::read(m.path("dst")).unwrap(), want);
    // A write to the copy changes the copy only and costs about what it wrote.
    let before = free_bytes(m.root());
    let f = OpenOptions::new().write(true).open(m.path("dst")).unwrap();
    f.write_all_at(b"changed", 5 * MB as u64 + 10).unwrap();
    f.sync_all().unwrap();
    drop(f);
    sync_fs(&m);
    let used = before.saturating_sub(free_bytes(m.root()));
    assert!(
        used < MB as u64,
        "a 7-byte write to a clone used {used} bytes"
    );
    let mut changed = want.clone();
    changed[5 * MB + 10..5 * MB + 17].copy_from_slice(b"changed");
    assert_eq!(fs::read(m.path("dst")).unwrap(), changed);
    assert_eq!(fs::read(&src).unwrap(), want);
    m.remount();
    assert_eq!(fs::read(m.path("dst")).unwrap(), changed);
    assert_eq!(fs::read(&src).unwrap(), want);
    // Removing the original leaves the copy whole.
    fs::remove_file(&src).unwrap();
    m.remount();
    assert_eq!(fs::read(m.path("dst")).unwrap(), changed);
    m.unmount();
}

#[test]
fn copy_file_range_with_unaligned_offsets_and_cached_data() {
    let mut m = Mount::new();
    let want_src = mib_data(4, 2);
    fs::write(m.path("a"), &want_src).unwrap();
    let mut want = mib_data(1, 3);
    fs::write(m.path("b"), &want).unwrap();
    let a = File::open(m.path("a")).unwrap();
    let b = OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("b"))
        .unwrap();
    // Same place in a block (whole blocks shared), then different places (copied),
    // with data still in the kernel's and the daemon's caches.
    for (off_in, off_out, len) in [
        (100u64, 4196u64, 2 * MB + 5),
        (7, 3 * MB as u64 + 1, 300_000),
    ] {
        let mut done = 0;
        while done < len {
            let n = copy_range(
                &a,
                off_in + done as u64,
                &b,
                off_out + done as u64,
                len - done,
            );
            assert!(n > 0, "copy_file_range made no progress");
            done += n;
        }
        let end = off_out as usize + len;
        if want.len() < end {
            want.resize(end, 0);
        }
        want[off_out as usize..end]
            .copy_from_slice(&want_src[off_in as usize..off_in as usize + len]);
    }
    // Past the end of the source: nothing.
    assert_eq!(copy_range(&a, 4 * MB as u64, &b, 0, 100), 0);
    let mut got = vec![0; want.len() + 10];
    let n = b.read_at(&mut got, 0).unwrap();
    got.truncate(n);
    assert!(got == want, "content after copy_file_range");
    assert!(cloned_bytes(&m) >= 2 * MB as u64 - 4096);
    drop((a, b));
    m.remount();
    assert!(fs::read(m.path("b")).unwrap() == want);
    m.unmount();
}

#[test]
fn an_fsynced_copy_survives_a_kill_of_the_daemon() {
    let mut m = Mount::new();
    let want = mib_data(8, 4);
    fs::write(m.path("src"), &want).unwrap();
    sync_fs(&m);
    cp(&m, "src", "dst");
    File::open(m.path("dst")).unwrap().sync_all().unwrap();
    File::open(m.root()).unwrap().sync_data().unwrap();
    m.kill_daemon();
    m.mount();
    assert!(fs::read(m.path("dst")).unwrap() == want);
    m.unmount();
}
