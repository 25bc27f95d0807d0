//! The page cache through a real FUSE mount: bounded daemon memory with a file much
//! larger than the cache, the kernel writeback cache's rules (write-only opens,
//! O_APPEND), reads that bypass the kernel's cache (`direct_read=`), and the cache's
//! mount options.

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use common::*;

const MIB: usize = 1 << 20;

/// Peak and current resident set of a process, in bytes (VmHWM, VmRSS).
fn rss(pid: u32) -> (u64, u64) {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// One MiB of the test file: a fixed random-looking base with the chunk number
/// stamped into every 4 KiB block, so a misplaced block is caught.
fn chunk(base: &[u8], i: u64, out: &mut [u8]) {
    out.copy_from_slice(base);
    for b in out.chunks_mut(4096) {
        b[..8].copy_from_slice(&i.to_le_bytes());
    }
}

fn drop_kernel_caches() {
    // Only root may; without it the reads may come from the kernel's cache, which
    // still checks the content but not the daemon's read path.
    let _ = fs::write("/proc/sys/vm/drop_caches", "3");
}

#[test]
fn a_3gib_file_through_a_256mib_cache_keeps_the_daemon_within_bounds() {
    const CHUNKS: u64 = 3 * 1024;
    // The cache plus the daemon's fixed overhead: trees, FUSE buffers, a writeback
    // pass's copy (8 MiB), allocator slack.
    const BOUND: u64 = (256 + 160) << 20;
    let mut m = Mount::with_size_and_options("5G", &["cache_size=256M"]);
    let pid = *processes_naming(m.image()).first().expect("daemon pid");
    let base: Vec<u8> = (0..MIB as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9) >> 13) as u8)
        .collect();
    let mut buf = vec![0u8; MIB];
    let p = m.path("big");
    {
        let mut f = File::create(&p).unwrap();
        for i in 0..CHUNKS {
            chunk(&base, i, &mut buf);
            f.write_all(&buf).unwrap();
            if i % 256 == 0 {
                let (_, now) = rss(pid);
                assert!(now < BOUND, "RSS {} MiB while writing", now >> 20);
            }
        }
        f.sync_all().unwrap();
    }
    drop_kernel_caches();
    let mut f = File::open(&p).unwrap();
    let mut want = vec![0u8; MIB];
    for i in 0..CHUNKS {
        f.read_exact(&mut buf).unwrap();
        chunk(&base, i, &mut want);
        assert!(buf == want, "chunk {i} differs");
    }
    let (peak, _) = rss(pid);
    assert!(
        peak < BOUND,
        "daemon peak RSS {} MiB with cache_size=256M",
        peak >> 20
    );
    drop(f);
    let stats = birchfs(["stats", "--json", m.root().to_str().unwrap()]);
    let json = String::from_utf8_lossy(&stats.stdout).to_string();
    assert!(json.contains("\"cache\":{\"bytes\":"), "{json}");
    m.unmount();
    eprintln!("peak RSS {} MiB", peak >> 20);
}

#[test]
fn a_write_only_open_can_write_partial_pages() {
    let mut m = Mount::new();
    let p = m.path("f");
    fs::write(&p, vec![b'a'; 10_000]).unwrap();
    m.remount();
    {
        // The kernel reads the rest of each page it caches, although the file is
        // open for writing only.
        let f = OpenOptions::new().write(true).open(&p).unwrap();
        f.write_all_at(b"XYZ", 4095).unwrap();
        f.write_all_at(b"end", 9_999).unwrap();
        f.sync_all().unwrap();
    }
    let mut want = vec![b'a'; 10_002];
    want[4095..4098].copy_from_slice(b"XYZ");
    want[9_999..].copy_from_slice(b"end");
    assert_eq!(fs::read(&p).unwrap(), want);
    m.remount();
    assert_eq!(fs::read(&p).unwrap(), want);
    m.unmount();
}

#[test]
fn appends_from_two_descriptors_interleave_without_loss() {
    let mut m = Mount::new();
    let p = m.path("log");
    let open = |p: &Path| {
        OpenOptions::new()
            .append(true)
            .create(true)
            .custom_flags(0)
            .open(p)
            .unwrap()
    };
    let mut a = open(&p);
    let mut b = open(&p);
    for i in 0..200 {
        let (f, tag) = if i % 2 == 0 {
            (&mut a, 'a')
        } else {
            (&mut b, 'b')
        };
        f.write_all(format!("{tag}{i:05}\n").as_bytes()).unwrap();
    }
    a.sync_all().unwrap();
    drop((a, b));
    m.remount();
    let mut s = String::new();
    File::open(&p).unwrap().read_to_string(&mut s).unwrap();
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines.len(), 200);
    for (i, l) in lines.iter().enumerate() {
        let tag = if i % 2 == 0 { 'a' } else { 'b' };
        assert_eq!(*l, format!("{tag}{i:05}"));
    }
    m.unmount();
}

#[test]
fn cache_mount_options_are_checked() {
    let mut m = Mount::unmounted("1G");
    for (opt, says) in [
        ("folio_size=3K", "folio_size"),
        ("folio_size=2M", "folio_size"),
        ("cache_size=64K", "cache_size"),
        ("cache_size=lots", "cache_size"),
        ("cache_size=1000000T", "more than the memory"),
        ("block_dirty=maybe", "unknown mount option"),
        ("threads=0", "threads=0"),
        ("threads=many", "threads=many"),
        ("direct_read=lots", "direct_read"),
    ] {
        m.expect_refused(opt, says);
    }
    m.mount_with(&[
        "cache_size=64M",
        "folio_size=16K",
        "dirty_expire=5",
        "block_dirty=off",
        "threads=1",
        "direct_read=off",
    ]);
    assert_eq!(daemon_stats(&m)["cache"]["limit"].as_u64(), Some(64 << 20));
    let p = m.path("f");
    fs::write(&p, b"hello").unwrap();
    fs::File::open(&p).unwrap().sync_all().unwrap();
    m.remount();
    assert_eq!(fs::read(&p).unwrap(), b"hello");
    m.unmount();
}

/// A memory cgroup of the test's own with a limit, under cgroup v1 or v2; `None` where
/// none can be made (not root, no memory controller, a delegated v2 tree).
struct TestCgroup {
    dir: PathBuf,
    v2: bool,
}

impl TestCgroup {
    fn new(limit: u64) -> Option<TestCgroup> {
        let name = format!("birchfs-test-{}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/memory");
        let v2 = Path::new("/sys/fs/cgroup");
        let (dir, v2, file) = if v1.join("cgroup.procs").exists() {
            (v1.join(&name), false, "memory.limit_in_bytes")
        } else if fs::read_to_string(v2.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"))
        {
            // Children of the root get the memory controller once it is enabled there.
            let _ = fs::write(v2.join("cgroup.subtree_control"), "+memory");
            (v2.join(&name), true, "memory.max")
        } else {
            return None;
        };
        fs::create_dir(&dir).ok()?;
        let cg = TestCgroup { dir, v2 };
        fs::write(cg.dir.join(file), limit.to_string()).ok()?;
        Some(cg)
    }

    /// OOM kills in the cgroup so far (0 where the kernel does not count them).
    fn oom_kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for TestCgroup {
    /// Removes the cgroup once its processes (the daemon finishing) have left.
    fn drop(&mut self) {
        let procs = self.dir.join("cgroup.procs");
        let t0 = std::time::Instant::now();
        while fs::read_to_string(&procs).is_ok_and(|p| !p.trim().is_empty())
            && t0.elapsed() < std::time::Duration::from_secs(30)
        {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = fs::remove_dir(&self.dir);
    }
}

/// A daemon started in a memory cgroup (a container's, say) sizes its default cache
/// from the cgroup's limit, not from the machine's memory, and so writes a file
/// eight times its limit without being OOM-killed (an eighth of RAM as the cache
/// was: killed at about 2 GiB of a 256 MiB cgroup on the benchmark machine). Needs
/// root and a memory cgroup it can make (v1, or v2 from the root); skipped without.
#[test]
fn a_daemon_in_a_256mib_cgroup_sizes_its_cache_to_fit_and_writes_2gib() {
    const CHUNKS: u64 = 2048;
    let Some(cg) = TestCgroup::new(256 << 20) else {
        eprintln!("note: no memory cgroup can be made here; skipped");
        return;
    };
    let m = Mount::unmounted("4G");
    // The mount command joins the cgroup first; its daemon inherits it.
    let out = run(
        std::process::Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$1/cgroup.procs" && exec "$2" mount "$3" "$4""#)
            .arg("sh")
            .arg(&cg.dir)
            .arg(BIN)
            .arg(m.image())
            .arg(m.root()),
        std::time::Duration::from_secs(60),
    );
    let written = out.status.success().then(|| {
        let limit_seen = daemon_stats(&m)["cache"]["limit"].as_u64();
        let base: Vec<u8> = (0..MIB as u64).map(|i| (i * 7 + 3) as u8).collect();
        let mut buf = vec![0u8; MIB];
        let r = (|| {
            let mut f = File::create(m.path("big"))?;
            for i in 0..CHUNKS {
                chunk(&base, i, &mut buf);
                f.write_all(&buf)?;
            }
            f.sync_all()
        })();
        (limit_seen, r)
    });
    let ooms = cg.oom_kills();
    let down = run(
        std::process::Command::new(BIN).arg("umount").arg(m.root()),
        std::time::Duration::from_secs(60),
    );
    if !down.status.success() {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(m.root())
            .status();
    }
    drop(cg);
    assert!(out.status.success(), "mount:\n{}", describe(&out));
    let (limit_seen, r) = written.unwrap();
    assert_eq!(ooms, 0, "the daemon was OOM-killed");
    r.expect("writing 2 GiB in a 256 MiB cgroup");
    assert!(down.status.success(), "umount:\n{}", describe(&down));
    // An eighth of 256 MiB is below the 64 MiB floor, which a quarter of it allows.
    assert_eq!(
        limit_seen,
        Some(64 << 20),
        "cache limit in a 256 MiB cgroup"
    );
    // Outside the cgroup: the default of the test's own surroundings, and the file is
    // whole.
    let mut m = m;
    m.mount();
    assert_eq!(
        daemon_stats(&m)["cache"]["limit"].as_u64(),
        Some(birchfs::default_cache_size())
    );
    drop_kernel_caches();
    let base: Vec<u8> = (0..MIB as u64).map(|i| (i * 7 + 3) as u8).collect();
    let (mut got, mut want) = (vec![0u8; MIB], vec![0u8; MIB]);
    let mut f = File::open(m.path("big")).unwrap();
    for i in 0..CHUNKS {
        f.read_exact(&mut got).unwrap();
        chunk(&base, i, &mut want);
        assert!(got == want, "MiB {i} differs");
    }
    drop(f);
    m.unmount();
}

/// With memory short half of the time (a test hook: five 100 ms ticks short, five
/// not), the cache shrinks to its floor and grows back again and again while files
/// are written, overwritten at random, fsynced and read; nothing read differs from a
/// model, before or after a remount.
#[test]
fn files_stay_whole_while_memory_pressure_squeezes_the_cache_again_and_again() {
    const FILES: usize = 3;
    const LEN: usize = 96 << 20;
    let mut m = Mount::unmounted("2G");
    m.set_daemon_env("BIRCHFS_TEST_MEMORY_SHORT", "1");
    m.mount_with(&["cache_size=128M"]);
    let mut rng_state = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move || {
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        rng_state
    };
    let mut model: Vec<Vec<u8>> = (0..FILES)
        .map(|f| (0..LEN).map(|i| (i / 4096 + f) as u8).collect())
        .collect();
    for (f, data) in model.iter().enumerate() {
        fs::write(m.path(format!("f{f}")), data).unwrap();
    }
    let t0 = std::time::Instant::now();
    let mut rounds = 0;
    while t0.elapsed() < std::time::Duration::from_secs(6) || rounds < 200 {
        rounds += 1;
        let f = (rnd() % FILES as u64) as usize;
        let len = (rnd() % (256 << 10)) as usize + 1;
        let off = (rnd() % (LEN - len) as u64) as usize;
        let p = m.path(format!("f{f}"));
        if rnd() % 3 == 0 {
            let mut got = vec![0u8; len];
            File::open(&p)
                .unwrap()
                .read_exact_at(&mut got, off as u64)
                .unwrap();
            assert!(
                got == model[f][off..off + len],
                "f{f} at {off}+{len} differs"
            );
        } else {
            let byte = rnd() as u8;
            let file = OpenOptions::new().write(true).open(&p).unwrap();
            file.write_all_at(&vec![byte; len], off as u64).unwrap();
            model[f][off..off + len].fill(byte);
            if rnd() % 8 == 0 {
                file.sync_data().unwrap();
            }
        }
    }
    let squeezes = daemon_stats(&m)["cache"]["squeezes"].as_u64().unwrap();
    assert!(squeezes >= 4, "only {squeezes} squeezes in {rounds} rounds");
    for (f, data) in model.iter().enumerate() {
        assert!(fs::read(m.path(format!("f{f}"))).unwrap() == *data, "f{f}");
    }
    m.remount();
    drop_kernel_caches();
    for (f, data) in model.iter().enumerate() {
        assert!(
            fs::read(m.path(format!("f{f}"))).unwrap() == *data,
            "f{f} after remount"
        );
    }
    m.unmount();
}

/// Files the daemon wrote back so that a replacement survives a crash whole.
fn replace_writebacks(m: &Mount) -> u64 {
    daemon_stats(m)["replace_writebacks"]
        .as_u64()
        .expect("replace_writebacks")
}

/// Replacing a file the usual way (write a new one, close it, rename it over the old,
/// no fsync) writes the new data back before the rename: close hands the kernel's
/// dirty pages to the daemon, and the rename does not go ahead of their writeback (so
/// a crash never keeps the rename without the data).
#[test]
fn a_file_written_and_renamed_over_another_is_written_back_first() {
    let mut m = Mount::new();
    fs::write(m.path("a"), b"old").unwrap();
    fs::write(m.path("b"), b"moved").unwrap();
    fs::rename(m.path("b"), m.path("c")).unwrap();
    assert_eq!(
        replace_writebacks(&m),
        0,
        "a rename onto a free name does not write back"
    );
    let new = vec![7u8; 100_000];
    fs::write(m.path("a.tmp"), &new).unwrap();
    fs::rename(m.path("a.tmp"), m.path("a")).unwrap();
    assert_eq!(
        replace_writebacks(&m),
        1,
        "the replacing file is written back"
    );
    assert_eq!(fs::read(m.path("a")).unwrap(), new);
    m.unmount();
}

/// Rewriting a file in place (open(O_TRUNC), write, close, no fsync) writes the new
/// data back at the close, so a crash that keeps the truncate keeps the data too.
#[test]
fn a_file_rewritten_in_place_is_written_back_at_its_close() {
    let mut m = Mount::new();
    fs::write(m.path("a"), b"old content").unwrap();
    fs::write(m.path("b"), b"appended").unwrap();
    OpenOptions::new()
        .append(true)
        .open(m.path("b"))
        .unwrap()
        .write_all(b" more")
        .unwrap();
    assert_eq!(replace_writebacks(&m), 0, "an append is left to writeback");
    let new = vec![9u8; 100_000];
    fs::write(m.path("a"), &new).unwrap();
    // The kernel sends RELEASE after close() has returned.
    assert!(
        wait_until(std::time::Duration::from_secs(10), || replace_writebacks(
            &m
        ) == 1),
        "the rewritten file is written back at its release: {}",
        replace_writebacks(&m)
    );
    assert_eq!(fs::read(m.path("a")).unwrap(), new);
    m.unmount();
}

/// Bytes read through opens that bypass the kernel's page cache, per the daemon.
fn direct_read_bytes(m: &Mount) -> u64 {
    daemon_stats(m)["bytes"]["direct_read"]
        .as_u64()
        .expect("bytes.direct_read")
}

/// Waits until the daemon has had every direct handle released: the kernel sends
/// RELEASE after close() has returned, so an open right after a close can arrive
/// first (and would take the kind of the handle still open).
fn wait_direct_handles_released(m: &Mount) {
    let t0 = std::time::Instant::now();
    loop {
        let n = daemon_stats(m)["direct_handles"]
            .as_u64()
            .expect("direct_handles");
        if n == 0 {
            return;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "{n} direct handles still open 10 s after their close"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn large_read_only_opens_bypass_the_kernel_cache_until_read_through_once() {
    let mut m = Mount::with_options(&["direct_read=1M"]);
    let big = mib_data(4, 31);
    fs::write(m.path("big"), &big).unwrap();
    fs::write(m.path("small"), &big[..512 << 10]).unwrap();
    m.remount();
    assert_eq!(direct_read_bytes(&m), 0);

    // Below direct_read= through the kernel's cache; at or above it past it.
    assert_eq!(fs::read(m.path("small")).unwrap(), &big[..512 << 10]);
    assert_eq!(direct_read_bytes(&m), 0, "a small file read directly");
    assert!(
        fs::read(m.path("big")).unwrap() == big,
        "direct read differs"
    );
    let first = direct_read_bytes(&m);
    assert!(
        first >= 4 << 20,
        "read-only open of 4 MiB not direct: {first}"
    );
    wait_direct_handles_released(&m);

    // Read through once: the next open goes through the kernel's cache.
    assert!(fs::read(m.path("big")).unwrap() == big);
    assert_eq!(direct_read_bytes(&m), first, "second read still direct");

    // Off: never direct.
    m.unmount();
    m.mount_with(&["direct_read=off"]);
    assert!(fs::read(m.path("big")).unwrap() == big);
    assert_eq!(direct_read_bytes(&m), 0);
    m.unmount();
}

#[test]
fn a_file_read_in_scattered_small_pieces_goes_back_to_the_kernel_cache() {
    let mut m = Mount::with_options(&["direct_read=1M"]);
    let big = mib_data(8, 32);
    fs::write(m.path("db"), &big).unwrap();
    m.remount();
    let f = File::open(m.path("db")).unwrap();
    let mut page = vec![0u8; 4096];
    for k in 0..64u64 {
        let off = (k * 389 % 2048) * 4096;
        f.read_exact_at(&mut page, off).unwrap();
        assert!(
            page == big[off as usize..off as usize + 4096],
            "page at {off}"
        );
    }
    drop(f);
    wait_direct_handles_released(&m);
    let direct = direct_read_bytes(&m);
    assert_eq!(direct, 64 * 4096, "the scattered reads were not direct");
    let f = File::open(m.path("db")).unwrap();
    f.read_exact_at(&mut page, 0).unwrap();
    assert_eq!(
        direct_read_bytes(&m),
        direct,
        "reopened file still read directly"
    );
    drop(f);
    m.unmount();
}

/// A mount with `opts` holding file `f` of `data`, remounted so that nothing is known
/// of it, and a reader and then a read-write handle of `f` opened beside it.
fn reader_then_writer(opts: &[&str], data: &[u8]) -> (Mount, std::path::PathBuf, File, File) {
    let mut m = Mount::with_options(opts);
    let p = m.path("f");
    fs::write(&p, data).unwrap();
    m.remount();
    let r = File::open(&p).unwrap();
    let w = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    (m, p, r, w)
}

#[test]
fn a_writer_beside_a_direct_reader_is_direct_and_seen_at_once() {
    let mut all = mib_data(4, 33);
    let (mut m, p, r, w) = reader_then_writer(&["direct_read=1M"], &all);
    // Extend past the end with a gap: had the writer gone through the kernel's cache,
    // a direct read of the gap would end at the size the daemon knew.
    let tail = pattern(34, 64 << 10);
    w.write_all_at(tail, 6 << 20).unwrap();
    all.resize(6 << 20, 0);
    all.extend_from_slice(tail);
    let mut got = vec![0xffu8; 1 << 20];
    r.read_exact_at(&mut got, 4 << 20).unwrap();
    assert!(
        got.iter().all(|&b| b == 0),
        "the gap does not read as zeros"
    );
    let before = direct_read_bytes(&m);
    assert!(before >= 1 << 20, "the reader was not direct");
    // A shared writable mapping of the writer keeps its changes in the kernel's
    // cache; a direct read writes them back first.
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh shared mapping of an open file, unmapped below.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            1 << 20,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            w.as_raw_fd(),
            0,
        )
    };
    assert_ne!(at, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    let new = pattern(35, 8192);
    // SAFETY: the mapping covers 1 MiB of writable bytes.
    let mapped = unsafe { std::slice::from_raw_parts_mut(at.cast::<u8>(), 1 << 20) };
    mapped[4096..4096 + 8192].copy_from_slice(new);
    all[4096..4096 + 8192].copy_from_slice(new);
    let mut got = vec![0u8; 8192];
    r.read_exact_at(&mut got, 4096).unwrap();
    assert!(got == new, "direct read missed the mapping's change");
    // SAFETY: unmaps the mapping made above.
    assert_eq!(unsafe { libc::munmap(at, 1 << 20) }, 0);
    drop((r, w));
    wait_direct_handles_released(&m);
    assert!(fs::read(&p).unwrap() == all);
    m.remount();
    assert!(fs::read(&p).unwrap() == all, "after a remount");
    m.unmount();
}

/// The kernel does not move the mtime for writes past its cache (a writer beside a
/// direct reader), so once the file is closed birchfs has the kernel drop the inode
/// and `stat` shows the mtime birchfs stored, also through a second name.
#[test]
fn the_mtime_of_a_writer_beside_a_direct_reader_shows_once_closed() {
    let all = mib_data(4, 37);
    let (mut m, p, r, w) = reader_then_writer(&["direct_read=1M"], &all);
    fs::hard_link(&p, m.path("second")).unwrap();
    let mtime = |p: &std::path::Path| fs::metadata(p).unwrap().modified().unwrap();
    let old = mtime(&p);
    // Past the kernel's coarse clock tick.
    std::thread::sleep(std::time::Duration::from_millis(50));
    w.write_all_at(b"new", 1 << 20).unwrap();
    let mut got = [0u8; 3];
    r.read_exact_at(&mut got, 1 << 20).unwrap();
    assert_eq!(&got, b"new");
    assert!(direct_read_bytes(&m) > 0, "the reader was not direct");
    drop((r, w));
    wait_direct_handles_released(&m);
    // The kernel is told from a thread of the daemon's after the release.
    let t0 = std::time::Instant::now();
    while mtime(&p) <= old && t0.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let written = mtime(&p);
    assert!(
        written > old,
        "the mtime stayed where it was before the write"
    );
    assert_eq!(mtime(&m.path("second")), written);
    m.remount();
    assert_eq!(mtime(&p), written, "the mtime stored");
    m.unmount();
}

#[test]
fn a_shared_mapping_of_a_direct_open_reads_the_file() {
    let mut m = Mount::with_options(&["direct_read=1M"]);
    let p = m.path("f");
    let data = mib_data(2, 35);
    fs::write(&p, &data).unwrap();
    m.remount();
    let f = File::open(&p).unwrap();
    let mut head = vec![0u8; 4096];
    f.read_exact_at(&mut head, 0).unwrap();
    assert!(direct_read_bytes(&m) >= 4096, "the open is not direct");
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh read-only shared mapping of an open file, unmapped below.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            data.len(),
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(at, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    // SAFETY: the mapping covers data.len() readable bytes.
    let mapped = unsafe { std::slice::from_raw_parts(at.cast::<u8>(), data.len()) };
    assert!(mapped == &data[..], "mapped bytes differ");
    // SAFETY: unmaps the mapping made above.
    assert_eq!(unsafe { libc::munmap(at, data.len()) }, 0);
    drop(f);
    m.unmount();
}

#[test]
fn direct_reads_match_a_model_while_a_writer_changes_the_file() {
    use rand::{Rng, SeedableRng};
    let mut model = mib_data(2, 36);
    // The direct reader first: the writer opened beside it is direct too.
    let (mut m, p, r, w) = reader_then_writer(&["direct_read=0"], &model);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xd1_7ec7);
    for step in 0..400 {
        match rng.gen_range(0..10) {
            0..=4 => {
                let off = rng.gen_range(0..3 << 20);
                let len = rng.gen_range(1..64 << 10);
                let byte = rng.gen::<u8>();
                w.write_all_at(&vec![byte; len], off as u64).unwrap();
                if model.len() < off + len {
                    model.resize(off + len, 0);
                }
                model[off..off + len].fill(byte);
            }
            5 => {
                let len = rng.gen_range(0..3 << 20);
                w.set_len(len as u64).unwrap();
                model.resize(len, 0);
            }
            6 => w.sync_data().unwrap(),
            _ => {
                let off = rng.gen_range(0..3 << 20);
                let len = rng.gen_range(1..256 << 10);
                let mut got = vec![0u8; len];
                let n = r.read_at(&mut got, off as u64).unwrap();
                let want = &model[off.min(model.len())..(off + len).min(model.len())];
                assert_eq!(n, want.len(), "step {step}: read of {len} at {off}");
                assert!(got[..n] == *want, "step {step}: bytes at {off} differ");
            }
        }
    }
    assert!(direct_read_bytes(&m) > 0, "no read was direct");
    drop((r, w));
    assert!(fs::read(&p).unwrap() == model);
    m.remount();
    assert!(fs::read(&p).unwrap() == model, "after a remount");
    m.unmount();
}
