//! Faults through a real mount: kill -9 of the daemon during fsyncs, corrupted data
//! and metadata, a full disk, and many threads at once.

mod common;

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

/// What thread `t` writes to its file `i` in attempt `gen`: 4..13 KiB, or with `big`
/// 64..640 KiB (enough for the daemon to write it back on an fsync worker).
fn content(t: usize, i: usize, gen: usize, big: bool) -> Vec<u8> {
    let len = if big {
        (64 << 10) + (i * 52_711 + t * 7_919 + gen * 131) % (576 << 10)
    } else {
        4096 + (i * 977 + t * 131) % 9000
    };
    (0..len)
        .map(|k| (k * 31 + t * 7 + i * 13 + gen) as u8)
        .collect()
}

fn long() -> bool {
    std::env::var("BIRCHFS_LONG").is_ok()
}

#[test]
fn kill_9_during_fsyncs_loses_nothing_acknowledged() {
    let mut m = Mount::new();
    kill_9_rounds(&mut m, false);
}

#[test]
fn kill_9_during_large_fsyncs_loses_nothing_acknowledged() {
    let mut m = Mount::new();
    kill_9_rounds(&mut m, true);
}

#[test]
fn kill_9_during_large_fsyncs_on_a_loop_device_loses_nothing_acknowledged() {
    let mut m = Mount::on_loop_device("2G");
    kill_9_rounds(&mut m, true);
}

#[test]
fn kill_9_during_fsyncs_with_a_log_past_the_second_superblock_copy_loses_nothing_acknowledged() {
    // 4 GiB: the log is 256 MiB and starts past the copy at 64 MiB; 8 GiB: 512 MiB,
    // the largest, which older builds refuse by a feature flag.
    for (size, log) in [("4G", 256u64 << 20), ("8G", 512 << 20)] {
        let mut m = Mount::with_size(size);
        kill_9_rounds(&mut m, false);
        let out = birchfs(["dump", m.image().to_str().unwrap()]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(&format!("log {:#x}+{log}", (64 << 20) + (64 << 10))),
            "{size}: {}",
            describe(&out)
        );
    }
}

/// Lets the `workers` run for `wait`, kills the daemon (kill -9) under them, stops them
/// (they see errors, or `stop`) and mounts again.
fn kill_while_running(
    m: &mut Mount,
    wait: Duration,
    stop: &AtomicBool,
    workers: Vec<std::thread::JoinHandle<()>>,
) {
    std::thread::sleep(wait);
    m.kill_daemon();
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    m.mount();
}

/// Three rounds of: four threads create and overwrite files with an fsync each (and
/// now and then one of their directory), kill -9 of the daemon, then every
/// acknowledged file must hold what was fsynced (or a part of a later attempt).
fn kill_9_rounds(m: &mut Mount, big: bool) {
    for round in 0..3 {
        let acked: Arc<Mutex<BTreeMap<(usize, usize), usize>>> = Arc::default();
        let tried: Arc<Mutex<BTreeMap<(usize, usize), usize>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for t in 0..4 {
            let dir = m.path(format!("r{round}t{t}"));
            fs::create_dir(&dir).unwrap();
            let (acked, tried, stop) = (acked.clone(), tried.clone(), stop.clone());
            hs.push(std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    // New files, and overwrites of an earlier one.
                    let (idx, gen) = if i % 3 == 2 { (i / 2, i) } else { (i, 0) };
                    let p = dir.join(format!("f{idx}"));
                    tried.lock().unwrap().insert((t, idx), gen);
                    let r = (|| -> std::io::Result<()> {
                        let mut f = OpenOptions::new()
                            .create(true)
                            .write(true)
                            .truncate(true)
                            .open(&p)?;
                        f.write_all(&content(t, idx, gen, big))?;
                        f.sync_all()?;
                        if i % 5 == 4 {
                            File::open(&dir)?.sync_all()?;
                        }
                        Ok(())
                    })();
                    if r.is_err() {
                        break;
                    }
                    acked.lock().unwrap().insert((t, idx), gen);
                    i += 1;
                }
            }));
        }
        kill_while_running(
            m,
            Duration::from_millis(700 + 400 * round as u64),
            &stop,
            hs,
        );
        let acked = acked.lock().unwrap();
        let tried = tried.lock().unwrap();
        assert!(
            acked.len() > 10,
            "workload made too little progress: {}",
            acked.len()
        );
        for (&(t, idx), &gen) in acked.iter() {
            let p = m.path(format!("r{round}t{t}/f{idx}"));
            let got = fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            // A later attempt that was not acknowledged (O_TRUNC, then pages written
            // back in any order) may have been made durable by another thread's fsync:
            // then each block holds that attempt's data or zeros.
            let later = tried[&(t, idx)];
            let partial_later = later != gen && {
                let want = content(t, idx, later, big);
                got.len() <= want.len()
                    && got
                        .chunks(4096)
                        .zip(want.chunks(4096))
                        .all(|(g, w)| g == &w[..g.len()] || g.iter().all(|&b| b == 0))
            };
            assert!(
                got == content(t, idx, gen, big) || partial_later,
                "{} ({} bytes) holds neither its fsynced content nor a part of a later attempt",
                p.display(),
                got.len()
            );
        }
        m.remount();
    }
    m.unmount();
}

/// The atomic replace that applications use to save a file (write a temporary file,
/// fsync it, rename it over the target, fsync the directory), by four threads at once
/// with kill -9 of the daemon in the middle, twice: after a remount each target holds,
/// whole, the last version whose directory fsync returned or a later one its thread
/// went on to rename; never a mix, never nothing (and `check` is clean at the end).
#[test]
fn kill_9_during_atomic_replaces_keeps_every_acknowledged_version_whole() {
    const TARGETS: usize = 4;
    let mut m = Mount::new();
    for round in 0..2 {
        // (thread, target) -> the version acknowledged, and the last one renamed.
        let acked: Arc<Mutex<BTreeMap<(usize, usize), usize>>> = Arc::default();
        let renamed: Arc<Mutex<BTreeMap<(usize, usize), usize>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for t in 0..4 {
            let dir = m.path(format!("r{round}t{t}"));
            fs::create_dir(&dir).unwrap();
            File::open(m.root()).unwrap().sync_all().unwrap();
            let (acked, renamed, stop) = (acked.clone(), renamed.clone(), stop.clone());
            hs.push(std::thread::spawn(move || {
                let mut gen = 0;
                while !stop.load(Ordering::Relaxed) {
                    gen += 1;
                    let target = gen % TARGETS;
                    let tmp = dir.join(format!("f{target}.tmp"));
                    let r = (|| -> std::io::Result<()> {
                        let mut f = File::create(&tmp)?;
                        f.write_all(&content(t, target, gen, false))?;
                        f.sync_all()?;
                        renamed.lock().unwrap().insert((t, target), gen);
                        fs::rename(&tmp, dir.join(format!("f{target}")))?;
                        File::open(&dir)?.sync_all()
                    })();
                    if r.is_err() {
                        break;
                    }
                    acked.lock().unwrap().insert((t, target), gen);
                }
            }));
        }
        kill_while_running(
            &mut m,
            Duration::from_millis(600 + 400 * round as u64),
            &stop,
            hs,
        );
        let acked = acked.lock().unwrap();
        let renamed = renamed.lock().unwrap();
        assert!(
            acked.len() == 4 * TARGETS,
            "workload made too little progress: {acked:?}"
        );
        for (&(t, target), &gen) in acked.iter() {
            let p = m.path(format!("r{round}t{t}/f{target}"));
            let got = fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let last = renamed[&(t, target)];
            assert!(
                (gen..=last)
                    .step_by(TARGETS)
                    .any(|g| got == content(t, target, g, false)),
                "{} ({} bytes) holds neither version {gen}, whose directory fsync returned, nor a later one (up to {last}), whole",
                p.display(),
                got.len()
            );
        }
    }
    m.unmount();
}

/// The image offset of the first data block of `rel`, found through the library.
fn first_block(m: &Mount, rel: &str) -> u64 {
    let fs = birchfs::Fs::open_path(
        m.image(),
        birchfs::Options {
            readonly: true,
            ..Default::default()
        },
    )
    .unwrap();
    let a = fs.resolve(rel).unwrap();
    fs.extent_map(a.ino).unwrap()[0].disk_addr
}

fn flip(image: &std::path::Path, at: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x10;
    f.write_all_at(&b, at).unwrap();
}

#[test]
fn corrupted_data_block_reads_as_eio_and_the_rest_stays_readable() {
    let mut m = Mount::new();
    fs::write(m.path("bad"), vec![0x5a; 64 << 10]).unwrap();
    fs::write(m.path("good"), vec![0xa5; 64 << 10]).unwrap();
    m.unmount();
    let addr = first_block(&m, "/bad");
    flip(m.image(), addr + 100);
    let out = m.check();
    assert_eq!(
        out.status.code(),
        Some(1),
        "check must report the block: {}",
        describe(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("checksum mismatch"),
        "{}",
        describe(&out)
    );
    m.mount();
    let mut buf = Vec::new();
    let e = File::open(m.path("bad"))
        .unwrap()
        .read_to_end(&mut buf)
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO));
    assert_eq!(fs::read(m.path("good")).unwrap(), vec![0xa5; 64 << 10]);
    fs::write(m.path("new"), b"still writable").unwrap();
    assert_eq!(fs::read(m.path("new")).unwrap(), b"still writable");
    let out = m.unmount_unchecked();
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn corrupted_tree_node_is_refused_and_the_daemon_survives() {
    let mut m = Mount::new();
    fs::create_dir(m.path("big")).unwrap();
    for i in 0..3000 {
        File::create(m.path(format!("big/entry-with-a-long-name-{i:05}"))).unwrap();
    }
    fs::write(m.path("keep"), b"keep me").unwrap();
    m.unmount();
    // Find an fs-tree leaf that holds only DIR_INDEX items of /big: readdir walks them.
    let dump = birchfs(["dump", "--tree", "fs", m.image().to_str().unwrap()]);
    let text = String::from_utf8_lossy(&dump.stdout).to_string();
    let big_ino = {
        let fs = birchfs::Fs::open_path(
            m.image(),
            birchfs::Options {
                readonly: true,
                ..Default::default()
            },
        )
        .unwrap();
        fs.resolve("/big").unwrap().ino
    };
    let mut victim = None;
    let mut cur: Option<(u64, bool)> = None;
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("leaf 0x") {
            if let Some((a, true)) = cur {
                victim = Some(a);
                break;
            }
            cur = Some((
                u64::from_str_radix(rest.split_whitespace().next().unwrap(), 16).unwrap(),
                true,
            ));
        } else if let Some(k) = line.strip_prefix("key (") {
            let mut f = k.split_whitespace();
            let obj: u64 = f.next().unwrap().parse().unwrap();
            let ty: u8 = f.next().unwrap().parse().unwrap();
            if let Some((_, only)) = cur.as_mut() {
                *only &= obj == big_ino && ty == 96;
            }
        }
    }
    let victim = victim.expect("a leaf of /big entries");
    flip(m.image(), victim + 300);
    let out = m.check();
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    m.mount();
    let listed = fs::read_dir(m.path("big")).and_then(|rd| rd.collect::<std::io::Result<Vec<_>>>());
    let e = listed
        .map(|v| v.len())
        .expect_err("listing through a damaged node must fail");
    assert_eq!(e.raw_os_error(), Some(libc::EIO));
    assert_eq!(fs::read(m.path("keep")).unwrap(), b"keep me");
    assert!(
        fs::metadata(m.path("big")).is_ok(),
        "the directory's inode is elsewhere"
    );
    let out = m.unmount_unchecked();
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn full_disk_gives_enospc_keeps_data_and_still_deletes() {
    let mut m = Mount::with_size("64M");
    fs::write(m.path("keep"), vec![7u8; 1 << 20]).unwrap();
    fs::create_dir(m.path("d")).unwrap();
    File::create(m.path("d/x")).unwrap();
    let mut f = File::create(m.path("fill")).unwrap();
    let chunk = vec![1u8; 256 << 10];
    let mut written = 0u64;
    let err = loop {
        match f.write_all(&chunk).and_then(|_| {
            if written % (8 << 20) == 0 {
                f.sync_data()
            } else {
                Ok(())
            }
        }) {
            Ok(()) => written += chunk.len() as u64,
            Err(e) => break e,
        }
        assert!(written < 128 << 20, "64M filesystem took more than 128 MiB");
    };
    let err = f.sync_all().err().unwrap_or(err);
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    drop(f);
    assert!(written > 16 << 20, "only {written} bytes fit");
    assert_eq!(fs::read(m.path("keep")).unwrap(), vec![7u8; 1 << 20]);
    fs::remove_file(m.path("d/x")).unwrap();
    fs::remove_dir(m.path("d")).unwrap();
    fs::remove_file(m.path("fill")).unwrap();
    File::open(m.root()).unwrap().sync_all().unwrap();
    fs::write(m.path("again"), vec![9u8; 16 << 20]).unwrap();
    File::open(m.path("again")).unwrap().sync_all().unwrap();
    m.remount();
    assert_eq!(fs::read(m.path("again")).unwrap().len(), 16 << 20);
    m.unmount();
}

/// A tmpfs of a given size mounted for a test (the host filesystem of an image), lazily
/// unmounted when dropped, also while a daemon still holds a file on it.
struct SmallHost(std::path::PathBuf);

impl SmallHost {
    fn new(dir: std::path::PathBuf, size: &str) -> SmallHost {
        fs::create_dir(&dir).unwrap();
        let out = run(
            Command::new("mount")
                .args(["-t", "tmpfs", "-o"])
                .arg(format!("size={size}"))
                .arg("tmpfs")
                .arg(&dir),
            SHELL_TIMEOUT,
        );
        assert!(
            out.status.success(),
            "tmpfs (needs root):\n{}",
            describe(&out)
        );
        SmallHost(dir)
    }

    fn resize(&self, size: &str) {
        let out = run(
            Command::new("mount")
                .arg("-o")
                .arg(format!("remount,size={size}"))
                .arg(&self.0),
            SHELL_TIMEOUT,
        );
        assert!(out.status.success(), "{}", describe(&out));
    }
}

impl Drop for SmallHost {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A sparse image whose host has less room than the image may still take is mounted
/// with a warning that says so. When the host then fills up, `birchfs sync` fails
/// with ENOSPC (exit code 3), `birchfs umount` leaves the mount in place, and nothing
/// is lost: once space is freed on the host, the next sync writes everything, and a
/// preallocated image there mounts without the warning.
#[test]
fn a_full_host_under_a_sparse_image_loses_nothing() {
    let mut m = Mount::bare();
    let host = SmallHost::new(m.host_dir().join("host"), "96M");
    std::os::unix::fs::symlink(host.0.join("img"), m.image()).unwrap();
    let out = m.mkfs(&["--size", "1G"]);
    assert!(out.status.success(), "{}", describe(&out));
    let out = m.try_mount(&["commit=0"]);
    assert!(out.status.success(), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("warning:") && err.contains("host has") && err.contains("--preallocate"),
        "no warning: {}",
        describe(&out)
    );
    fs::write(m.path("keep"), b"fsynced").unwrap();
    File::open(m.path("keep")).unwrap().sync_all().unwrap();
    // 160 MiB into the daemon's cache: more than the host can take.
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let mut rng = StdRng::seed_from_u64(11);
    let big: Vec<u8> = (0..160 << 20).map(|_| rng.gen()).collect();
    fs::write(m.path("big"), &big).unwrap();
    let sync = |m: &Mount| birchfs([std::ffi::OsStr::new("sync"), m.root().as_os_str()]);
    let out = sync(&m);
    assert_eq!(out.status.code(), Some(3), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("No space left"),
        "{}",
        describe(&out)
    );
    // Still taking changes, and everything reads back.
    fs::write(m.path("after"), b"small").unwrap();
    assert!(fs::read(m.path("big")).unwrap() == big, "big differs");
    // `birchfs umount` does not unmount what it could not commit.
    let out = m.birchfs_umount();
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nothing was unmounted"),
        "{}",
        describe(&out)
    );
    assert!(is_mounted_at(m.root()), "unmounted with nowhere to write");
    // Room on the host again: the next sync writes it all, and so would umount.
    host.resize("1200M");
    let out = sync(&m);
    assert!(out.status.success(), "{}", describe(&out));
    fs::write(m.path("last"), b"written by the unmount").unwrap();
    let out = m.birchfs_umount();
    assert!(out.status.success(), "{}", describe(&out));
    let out = m.check();
    assert!(out.status.success(), "{}", describe(&out));
    m.mount_with(&[]);
    assert_eq!(fs::read(m.path("keep")).unwrap(), b"fsynced");
    assert_eq!(fs::read(m.path("after")).unwrap(), b"small");
    assert_eq!(fs::read(m.path("last")).unwrap(), b"written by the unmount");
    assert!(
        fs::read(m.path("big")).unwrap() == big,
        "big differs after the remount"
    );
    m.unmount();
    // A preallocated image that fits its host: no warning.
    fs::remove_file(host.0.join("img")).unwrap();
    host.resize("96M");
    let out = m.mkfs(&["--size", "64M", "--preallocate"]);
    assert!(out.status.success(), "{}", describe(&out));
    let out = m.try_mount(&[]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("warning"),
        "{}",
        describe(&out)
    );
    m.unmount();
}

/// A disk filled up with small files in many directories (the trees large beside
/// the metadata reserve), killed with fsynced work in its log, can be emptied with
/// `rm -rf` after the crash: every deletion succeeds, and so do the commits that
/// follow (before, the deletions used the reserve up with node copies and failed
/// with ENOSPC, and the commit at unmount failed too).
#[test]
fn a_full_disk_of_small_files_empties_after_a_crash() {
    let mut m = Mount::with_size("64M");
    let mut n = 0usize;
    let mut full = false;
    for d in 0.. {
        let dir = m.path(format!("d{d:03}"));
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("mkdir: {e}"),
        }
        for i in 0..200 {
            let r = File::create(dir.join(format!("f{i}")))
                .and_then(|mut f| f.write_all(&[7u8; 700]).and_then(|()| f.sync_all()));
            match r {
                Ok(()) => n += 1,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                    full = true;
                    break;
                }
                Err(e) => panic!("file {n}: {e}"),
            }
        }
        if full {
            break;
        }
        assert!(d < 10_000, "the disk never filled");
    }
    assert!(n > 1000, "only {n} files fit");
    m.kill_daemon();
    m.mount();
    for e in fs::read_dir(m.root()).unwrap() {
        let p = e.unwrap().path();
        fs::remove_dir_all(&p).unwrap_or_else(|e| panic!("rm -rf {}: {e}", p.display()));
    }
    File::open(m.root()).unwrap().sync_all().unwrap();
    fs::write(m.path("after"), vec![1u8; 8 << 20]).unwrap();
    m.remount();
    assert_eq!(fs::read_dir(m.root()).unwrap().count(), 1);
    assert_eq!(fs::read(m.path("after")).unwrap(), vec![1u8; 8 << 20]);
    m.unmount();
}

/// A writer that never calls fsync or close (`dd if=/dev/zero of=fill`) is stopped
/// by ENOSPC from write() once the disk is full. Through the kernel's writeback
/// cache, write() only fills the kernel's page cache; before, such a writer went on
/// for ever (14 GB in 20 s on a 64 MiB image).
#[test]
fn a_writer_that_never_syncs_gets_enospc_from_write_on_a_full_disk() {
    let mut m = Mount::with_size("64M");
    fs::write(m.path("keep"), vec![3u8; 1 << 20]).unwrap();
    File::open(m.path("keep")).unwrap().sync_all().unwrap();
    let mut f = File::create(m.path("fill")).unwrap();
    let chunk = vec![0u8; 1 << 20];
    let mut written = 0u64;
    let err = loop {
        match f.write(&chunk) {
            Ok(n) => written += n as u64,
            Err(e) => break e,
        }
        assert!(written < 4 << 30, "write() never failed on a 64 MiB disk");
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert!(written < 1 << 30, "{written} bytes written before ENOSPC");
    drop(f);
    // The disk still works: what was there is intact, and deleting makes room.
    assert_eq!(fs::read(m.path("keep")).unwrap(), vec![3u8; 1 << 20]);
    fs::remove_file(m.path("fill")).unwrap();
    fs::write(m.path("after"), vec![4u8; 8 << 20]).unwrap();
    File::open(m.path("after")).unwrap().sync_all().unwrap();
    m.remount();
    assert_eq!(fs::read(m.path("after")).unwrap(), vec![4u8; 8 << 20]);
    m.unmount();
}

/// `sync(1)` does not reach a FUSE daemon; it makes the kernel write its dirty pages
/// back to birchfs and returns. What it wrote back, and the names changed before it,
/// are committed once changes have been quiet for a second, so they survive a kill -9
/// two seconds later (with the default `commit=30`, they were lost).
#[test]
fn what_sync_wrote_back_is_committed_a_second_later() {
    let mut m = Mount::new();
    let sync_and_wait = || {
        let out = run(&mut Command::new("sync"), Duration::from_secs(30));
        assert!(out.status.success(), "sync: {}", describe(&out));
        std::thread::sleep(Duration::from_millis(2500));
    };
    fs::write(m.path("old-name"), b"renamed").unwrap();
    fs::write(m.path("gone"), b"deleted").unwrap();
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
    fs::write(m.path("synced"), &data).unwrap();
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/small"), b"small").unwrap();
    sync_and_wait();
    // Names changed after that, with no data written.
    fs::rename(m.path("old-name"), m.path("new-name")).unwrap();
    fs::remove_file(m.path("gone")).unwrap();
    sync_and_wait();
    m.kill_daemon();
    m.mount();
    assert_eq!(fs::read(m.path("synced")).unwrap(), data);
    assert_eq!(fs::read(m.path("d/small")).unwrap(), b"small");
    assert_eq!(fs::read(m.path("new-name")).unwrap(), b"renamed");
    assert!(!m.path("old-name").exists(), "the rename was lost");
    assert!(!m.path("gone").exists(), "the unlink was lost");
    m.unmount();
}

#[test]
fn sixteen_threads_of_mixed_work_then_check_and_model_agree() {
    let secs = if long() { 180 } else { 8 };
    let mut m = Mount::new();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut hs = Vec::new();
    for t in 0..16 {
        let dir = m.path(format!("t{t}"));
        fs::create_dir(&dir).unwrap();
        hs.push(std::thread::spawn(move || {
            let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
            let mut i = 0usize;
            while Instant::now() < deadline {
                let name = format!("f{}", i % 40);
                let p = dir.join(&name);
                match i % 7 {
                    0..=2 => {
                        let data = content(t, i, 0, false);
                        fs::write(&p, &data).unwrap();
                        if i % 2 == 0 {
                            File::open(&p).unwrap().sync_all().unwrap();
                        }
                        model.insert(name, data);
                    }
                    3 => {
                        let to = format!("f{}", (i * 7) % 40);
                        if model.contains_key(&name) && to != name {
                            fs::rename(&p, dir.join(&to)).unwrap();
                            let d = model.remove(&name).unwrap();
                            model.insert(to, d);
                        }
                    }
                    4 => {
                        if model.remove(&name).is_some() {
                            fs::remove_file(&p).unwrap();
                        }
                    }
                    5 => {
                        if let Some(d) = model.get_mut(&name) {
                            let f = OpenOptions::new().write(true).open(&p).unwrap();
                            let off = (i % 3000) as u64;
                            f.write_all_at(b"xyz", off).unwrap();
                            if d.len() < off as usize + 3 {
                                d.resize(off as usize + 3, 0);
                            }
                            d[off as usize..off as usize + 3].copy_from_slice(b"xyz");
                            f.sync_data().unwrap();
                        }
                    }
                    _ => {
                        File::open(&dir).unwrap().sync_all().unwrap();
                    }
                }
                i += 1;
            }
            (dir, model, i)
        }));
    }
    let results: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let ops: usize = results.iter().map(|r| r.2).sum();
    eprintln!("load: 16 threads, {secs} s, {ops} operations");
    m.remount();
    for (dir, model, _) in &results {
        let on_disk: BTreeMap<String, Vec<u8>> = fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().into_string().unwrap(),
                    fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        assert!(
            on_disk == *model,
            "{} differs from its model",
            dir.display()
        );
    }
    m.unmount();
}

/// Pages of `len` bytes at `off` of the block device `path` that are in the kernel's
/// cache of it.
fn resident_pages(path: &std::path::Path, off: u64, len: usize) -> usize {
    use std::os::unix::io::AsRawFd;
    let f = File::open(path).unwrap();
    // SAFETY: a shared read-only mapping of `len` bytes of an open file; only its
    // residency is asked, nothing is read through it, and it is unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            off as libc::off_t,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "mmap of {}", path.display());
    let mut v = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `p` maps `len` bytes; `v` has a byte per page.
    let rc = unsafe { libc::mincore(p, len, v.as_mut_ptr()) };
    // SAFETY: unmaps what was mapped above.
    unsafe { libc::munmap(p, len) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    v.iter().filter(|&&b| b & 1 != 0).count()
}

/// On a block device, reads never fill the kernel's cache of the device: an io_uring
/// direct write to a block device does not drop pages that a buffered read's readahead
/// brought in meanwhile, and four concurrent fsx runs then read stale blocks (checksum
/// mismatches) and got EIO from fdatasync.
#[test]
fn reads_of_a_block_device_leave_its_page_cache_empty() {
    use birchfs::dev::{BlockDev, FileDev};
    let mut m = Mount::on_loop_device("256M");
    m.unmount();
    let path = m.image().to_path_buf();
    let dev = FileDev::open(&path, true).unwrap();
    let at: u64 = 128 << 20;
    let len = 1 << 20;
    let data: Vec<u8> = (0..len).map(|i| (i / 4096) as u8 ^ 0x5a).collect();
    dev.write_many(&[(&data[..], at)]).unwrap();
    {
        // Drop whatever of the range is cached (none should be: that write went direct).
        use std::os::unix::io::AsRawFd;
        let f = File::open(&path).unwrap();
        // SAFETY: an advice on an open file.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), at as i64, len as i64, 4) };
    }
    assert_eq!(resident_pages(&path, at, len), 0);
    // A node-sized read, a block-sized one and a batch of small pieces.
    let mut node = vec![0u8; 16 << 10];
    dev.read_at(&mut node, at + (64 << 10)).unwrap();
    assert_eq!(node[..], data[64 << 10..80 << 10]);
    let mut block = vec![0u8; 4096];
    dev.read_at(&mut block, at + (256 << 10)).unwrap();
    assert_eq!(block[..], data[256 << 10..(256 << 10) + 4096]);
    let (mut a, mut b) = (vec![0u8; 8192], vec![0u8; 4096]);
    dev.read_many(&mut [
        (&mut a[..], at + (512 << 10)),
        (&mut b[..], at + (768 << 10)),
    ])
    .unwrap();
    assert_eq!(a[..], data[512 << 10..(512 << 10) + 8192]);
    assert_eq!(b[..], data[768 << 10..(768 << 10) + 4096]);
    assert_eq!(
        resident_pages(&path, at, len),
        0,
        "reads of the block device went through its page cache"
    );
    drop(dev);
}

/// Four threads write, read back (O_DIRECT, so that reads reach the daemon), fsync
/// and truncate files together larger than the daemon's cache on a loop device, and
/// every read must match a model: the block-device paths (direct writes through
/// io_uring beside small reads and writes) under eviction and refills. Four such fsx
/// runs read stale blocks before block-device reads went direct.
#[test]
fn concurrent_reads_and_writes_on_a_loop_device_with_a_small_cache_match_a_model() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::os::unix::fs::OpenOptionsExt;
    let secs = if long() { 60 } else { 6 };
    let mut m = Mount::on_loop_device("1G");
    m.unmount();
    m.mount_with(&["cache_size=8M", "folio_size=16K"]);
    const FILE: usize = 6 << 20;
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut hs = Vec::new();
    for t in 0..4u64 {
        let p = m.path(format!("f{t}"));
        hs.push(std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(0xb1c4 + t);
            let mut model = vec![0u8; FILE];
            let w = OpenOptions::new()
                .create_new(true)
                .read(true)
                .write(true)
                .open(&p)
                .unwrap();
            w.set_len(FILE as u64).unwrap();
            let d = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&p)
                .unwrap();
            let mut buf = birchfs::dev::AlignedBuf::zeroed(256 << 10);
            let mut ops = 0u64;
            while Instant::now() < deadline {
                let size = model.len();
                match rng.gen_range(0..10) {
                    0..=4 => {
                        let len = rng.gen_range(1..256 << 10);
                        let off = rng.gen_range(0..FILE - len);
                        let fill = rng.gen::<u8>();
                        let data: Vec<u8> = (0..len).map(|i| fill ^ (i / 512) as u8).collect();
                        w.write_all_at(&data, off as u64).unwrap();
                        if model.len() < off + len {
                            model.resize(off + len, 0);
                        }
                        model[off..off + len].copy_from_slice(&data);
                    }
                    5..=7 => {
                        let blocks = rng.gen_range(1..=64usize);
                        let len = blocks * 4096;
                        let off = rng.gen_range(0..FILE / 4096 - blocks) * 4096;
                        let got = d.read_at(&mut buf[..len], off as u64).unwrap();
                        let want = size.saturating_sub(off).min(len);
                        assert_eq!(got, want, "thread {t}: short read at {off}");
                        assert!(
                            got == 0 || buf[..got] == model[off..off + got],
                            "thread {t}: wrong data in {len} bytes at {off}"
                        );
                    }
                    8 => w.sync_data().unwrap(),
                    _ => {
                        let to = rng.gen_range(FILE / 2..=FILE);
                        w.set_len(to as u64).unwrap();
                        model.resize(to, 0);
                    }
                }
                ops += 1;
            }
            (p, model, ops)
        }));
    }
    let results: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let ops: u64 = results.iter().map(|r| r.2).sum();
    eprintln!("loop device load: 4 threads, {secs} s, {ops} operations");
    m.remount();
    for (p, model, _) in &results {
        assert!(
            fs::read(p).unwrap() == *model,
            "{} differs from its model",
            p.display()
        );
    }
    m.unmount();
}

/// The daemon killed after fsyncs: restore, without a mount, replays the log as a
/// mount would and gets every fsynced file back.
#[test]
fn restore_after_kill_9_has_every_fsynced_file() {
    let mut m = Mount::with_options(&["commit=0"]);
    fs::create_dir(m.path("d")).unwrap();
    for i in 0..50 {
        let mut f = fs::File::create(m.path(format!("d/f{i}"))).unwrap();
        f.write_all(format!("fsynced {i}").repeat(1000).as_bytes())
            .unwrap();
        f.sync_all().unwrap();
    }
    fs::File::open(m.path("d")).unwrap().sync_all().unwrap();
    m.kill_daemon();
    let dest = m.host_dir().join("restored");
    let out = birchfs([
        "restore",
        m.image().to_str().unwrap(),
        dest.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("log batches after the last commit were replayed"),
        "{}",
        describe(&out)
    );
    for i in 0..50 {
        assert_eq!(
            fs::read(dest.join(format!("d/f{i}"))).unwrap(),
            format!("fsynced {i}").repeat(1000).as_bytes(),
            "f{i}"
        );
    }
}

#[test]
fn a_damaged_root_node_refuses_the_mount_and_restore_gets_the_files_back() {
    let mut m = Mount::new();
    fs::create_dir(m.path("d")).unwrap();
    for i in 0..2000 {
        fs::write(m.path(format!("d/file-{i:05}")), b"x").unwrap();
    }
    m.unmount();
    // The fs tree's root: the first node `dump` prints under "tree 5:".
    let dump = birchfs(["dump", "--tree", "fs", m.image().to_str().unwrap()]);
    let text = String::from_utf8_lossy(&dump.stdout).to_string();
    let root = text
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("node 0x"))
        .map(|r| u64::from_str_radix(r.split_whitespace().next().unwrap(), 16).unwrap())
        .expect("an fs tree of more than one leaf");
    flip(m.image(), root + 300);
    let out = m.try_mount(&[]);
    assert!(!out.status.success(), "mounted with a damaged root");
    assert!(!m.is_mounted());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("corrupt tree node at {root:#x}")),
        "names the block: {err}"
    );
    assert!(err.contains("birchfs check"), "points at check: {err}");
    let out = m.check();
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("{root:#x}")),
        "{}",
        describe(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("birchfs restore"),
        "check points at restore: {}",
        describe(&out)
    );
    assert!(
        err.contains("birchfs restore"),
        "the mount points at restore: {err}"
    );
    // restore gets every file back from the leaves under the lost root, says which
    // node was lost, and exits 1 for it.
    let dest = m.host_dir().join("restored");
    let out = birchfs([
        "restore",
        m.image().to_str().unwrap(),
        dest.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains(&format!("fs tree: corrupt tree node at {root:#x}")),
        "{}",
        describe(&out)
    );
    for i in 0..2000 {
        assert_eq!(
            fs::read(dest.join(format!("d/file-{i:05}"))).unwrap(),
            b"x",
            "file-{i:05}"
        );
    }
    assert_eq!(fs::read_dir(dest.join("d")).unwrap().count(), 2000);
    // A second restore into the same, now full, directory is refused (exit 2) and
    // leaves it alone.
    let out = birchfs([
        "restore",
        m.image().to_str().unwrap(),
        dest.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not empty") && !err.contains("I/O error"),
        "{err}"
    );
    assert_eq!(fs::read_dir(dest.join("d")).unwrap().count(), 2000);
    // So is one into a file.
    let file = dest.join("d/file-00000");
    let out = birchfs([
        "restore",
        m.image().to_str().unwrap(),
        file.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a directory"));
    assert_eq!(fs::read(&file).unwrap(), b"x");
}

/// A file size limit (`ulimit -f`) the mount starts under: a soft one is lifted, so
/// the daemon writes the whole image (SIGXFSZ killed it at its first write past the
/// limit, before the mount was even ready); a hard one below the image's size
/// refuses the mount and says why.
#[test]
fn a_file_size_limit_is_lifted_for_the_image_or_refuses_the_mount() {
    const MIB: u64 = 1 << 20;
    let mut m = Mount::unmounted("256M");
    m.set_rlimit(libc::RLIMIT_FSIZE, MIB, MIB);
    let out = m.try_mount(&[]);
    assert!(!out.status.success(), "mounted: {}", describe(&out));
    assert!(!m.is_mounted());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ulimit -f"), "{err}");
    m.set_rlimit(libc::RLIMIT_FSIZE, MIB, libc::RLIM_INFINITY);
    m.mount();
    let data = mib_data(8, 7);
    let mut f = fs::File::create(m.path("f")).unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    drop(f);
    m.unmount();
    let out = m.check();
    assert!(out.status.success(), "{}", describe(&out));
    m.mount();
    assert!(fs::read(m.path("f")).unwrap() == data, "f differs");
    m.unmount();
}

/// restore under a file size limit writes every file it can and reports each one the
/// limit stops, as not restored, without also putting it in lost+found.
#[test]
fn restore_reports_a_file_the_size_limit_stops_and_goes_on() {
    let mut m = Mount::new();
    fs::write(m.path("big"), mib_data(2, 3)).unwrap();
    fs::write(m.path("small"), b"small").unwrap();
    m.unmount();
    let dest = m.host_dir().join("restored");
    let mut cmd = Command::new(BIN);
    cmd.arg("restore").arg(m.image()).arg(&dest);
    set_rlimit(&mut cmd, libc::RLIMIT_FSIZE, 1 << 20, libc::RLIM_INFINITY);
    let out = run(&mut cmd, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let text = describe(&out);
    assert!(
        text.contains("big: cannot create: File too large"),
        "{text}"
    );
    assert!(
        text.contains("0 in lost+found") && !text.contains("no name left"),
        "{text}"
    );
    assert_eq!(fs::read(dest.join("small")).unwrap(), b"small");
}

/// Under an address-space limit (`ulimit -v`) the default cache takes part of the room
/// the limit leaves, so that a file larger than the limit is written and read back
/// (a cache sized from the machine's memory took the daemon past the limit, and it
/// aborted on an allocation).
#[test]
fn an_address_space_limit_sizes_the_cache_within_it() {
    const LIMIT: u64 = 1 << 30;
    let mut m = Mount::unmounted("3G");
    m.set_rlimit(libc::RLIMIT_AS, LIMIT, libc::RLIM_INFINITY);
    m.mount();
    let limit = daemon_stats(&m)["cache"]["limit"].as_u64().unwrap();
    assert!(limit <= LIMIT / 2, "cache limit {limit}");
    let chunk = mib_data(16, 11);
    let mut f = fs::File::create(m.path("f")).unwrap();
    for _ in 0..80 {
        f.write_all(&chunk).unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    // Read back through a fresh mount: through the daemon, not the kernel's cache.
    m.unmount();
    m.mount();
    let mut f = fs::File::open(m.path("f")).unwrap();
    let mut buf = vec![0; chunk.len()];
    for i in 0..80 {
        f.read_exact(&mut buf).unwrap();
        assert!(buf == chunk, "chunk {i} differs");
    }
    drop(f);
    m.unmount();
}

/// A daemon that dies of what it cannot log itself (an abort, as a failed allocation
/// ends it) once mounted but before it reports ready leaves its message in its log,
/// mount names the signal, and the dead mount is taken down (it stayed, answering
/// ENOTCONN, until `birchfs umount`).
#[test]
fn a_daemon_that_aborts_before_ready_leaves_why_in_its_log_and_no_mount() {
    let mut m = Mount::unmounted("256M");
    m.log_to_file();
    m.set_daemon_env("BIRCHFS_TEST_ABORT_BEFORE_READY", "1");
    let out = m.try_mount(&[]);
    assert!(!out.status.success(), "mounted: {}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("killed by signal 6"), "{err}");
    assert!(!is_mounted_at(m.root()), "the dead mount stayed");
    let log = m.daemon_log();
    assert!(log.contains("test hook: aborting"), "log: {log}");
}

/// Under a tight `ulimit -v` the mount is refused up front with the figures, instead
/// of a daemon that aborts on an allocation once mounted.
#[test]
fn too_tight_an_address_space_limit_refuses_the_mount() {
    let mut m = Mount::unmounted("256M");
    m.set_rlimit(libc::RLIMIT_AS, 100 << 20, libc::RLIM_INFINITY);
    let out = m.try_mount(&[]);
    assert!(!out.status.success(), "mounted: {}", describe(&out));
    assert!(!m.is_mounted());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("too little memory to mount"), "{err}");
}

/// A loop device over a sparse file on a tmpfs too small for it: writes the loop
/// device takes into its page cache fail later, when written back (a lost write, as a
/// failing disk or a full thin pool gives). Detached and unmounted on drop.
struct LosingDevice {
    dev: std::path::PathBuf,
    // Dropped after the detach, in this order: the tmpfs, then its directory.
    host: SmallHost,
    _dir: tempfile::TempDir,
}

impl LosingDevice {
    fn new() -> LosingDevice {
        let dir = tempfile::Builder::new()
            .prefix("birchfs-lost-")
            .tempdir()
            .unwrap();
        let mut d = LosingDevice {
            dev: std::path::PathBuf::new(),
            host: SmallHost::new(dir.path().join("host"), "256k"),
            _dir: dir,
        };
        let backing = d.host.0.join("backing");
        File::create(&backing).unwrap().set_len(64 << 20).unwrap();
        let out = run(
            Command::new("losetup").args(["-f", "--show"]).arg(&backing),
            SHELL_TIMEOUT,
        );
        assert!(
            out.status.success(),
            "losetup (the test needs root and loop devices):\n{}",
            describe(&out)
        );
        d.dev = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        d
    }
}

impl Drop for LosingDevice {
    fn drop(&mut self) {
        // The tmpfs goes lazily (SmallHost): udev may still hold the loop device open,
        // and the loop device its backing file, for a moment after the detach.
        if !self.dev.as_os_str().is_empty() {
            let _ = try_run(
                Command::new("losetup").arg("-d").arg(&self.dev),
                SHELL_TIMEOUT,
            );
        }
    }
}

/// Linux reports a write lost in writeback to the next fdatasync of each open file
/// once, then marks the pages clean: a second fdatasync returns 0. The device keeps
/// the failure (every later flush fails), and two flushes under way at once both
/// fail, though the host tells each open file only once.
#[test]
fn a_write_lost_in_writeback_fails_every_flush_from_then_on() {
    use birchfs::dev::{BlockDev, FileDev};
    let lost = LosingDevice::new();
    let dev = Arc::new(FileDev::open(&lost.dev, true).unwrap());
    // 1 MiB of small (buffered) writes, four times what the tmpfs holds.
    let block = vec![0x5au8; 4096];
    for i in 0..256u64 {
        dev.write_at(&block, i * 8192).unwrap();
    }
    let flushes: Vec<_> = (0..2)
        .map(|_| {
            let dev = dev.clone();
            std::thread::spawn(move || dev.flush())
        })
        .collect();
    for (i, f) in flushes.into_iter().enumerate() {
        assert!(f.join().unwrap().is_err(), "flush {i} under way returned 0");
    }
    assert!(dev.flush().is_err(), "a later flush returned 0");
    // A write after the failure that the device could store changes nothing.
    dev.write_at(&block, 0).unwrap();
    assert!(dev.flush().is_err(), "a flush after a new write returned 0");
}
