//! Data integrity of a mounted birchfs: what is written is what is read,
//! before and after a remount, under random overwrites, large sequential
//! writes, many small files and concurrent O_APPEND writers.
//!
//! All data are slices of a seeded pseudo-random pool (`common::pattern`),
//! so expected contents can be regenerated instead of stored.
//!
//! Set BIRCHFS_LONG=1 to run the random-overwrite test on a 1 GiB file (with
//! the model kept in a host file instead of RAM).

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::Barrier;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::*;

const MB: usize = 1 << 20;

fn long_mode() -> bool {
    std::env::var("BIRCHFS_LONG")
        .map(|v| v == "1")
        .unwrap_or(false)
}

// ---------------------------------------------------------------------------
// random overwrites against a model
// ---------------------------------------------------------------------------

/// What the file should contain: in memory, or (for large files) in a plain
/// file on the host filesystem outside the mount.
enum Model {
    Mem(Vec<u8>),
    Host(File),
}

impl Model {
    fn len(&self) -> u64 {
        match self {
            Model::Mem(v) => v.len() as u64,
            Model::Host(f) => f.metadata().unwrap().len(),
        }
    }

    fn write_at(&mut self, off: u64, data: &[u8]) {
        match self {
            Model::Mem(v) => {
                let start = off as usize;
                let end = start + data.len();
                if v.len() < end {
                    v.resize(end, 0);
                }
                v[start..end].copy_from_slice(data);
            }
            Model::Host(f) => f.write_all_at(data, off).unwrap(),
        }
    }

    fn set_len(&mut self, len: u64) {
        match self {
            Model::Mem(v) => v.resize(len as usize, 0),
            Model::Host(f) => f.set_len(len).unwrap(),
        }
    }

    /// Fills `buf` from `off`; the range must lie within the model.
    fn read_at(&self, off: u64, buf: &mut [u8]) {
        match self {
            Model::Mem(v) => {
                let start = off as usize;
                buf.copy_from_slice(&v[start..start + buf.len()]);
            }
            Model::Host(f) => f.read_exact_at(buf, off).unwrap(),
        }
    }
}

/// Compares the whole file with the model, reading with a mix of request
/// sizes, and checks that nothing is readable past the end.
#[track_caller]
fn compare_with_model(f: &File, model: &Model, what: &str) {
    let len = model.len();
    assert_eq!(f.metadata().unwrap().len(), len, "{what}: file size");
    let sizes = [MB, 131_071, 4096, 777_777, 65_536 + 1];
    let mut a = vec![0u8; MB];
    let mut b = vec![0u8; MB];
    let mut off = 0u64;
    let mut k = 0;
    while off < len {
        let n = (len - off).min(sizes[k % sizes.len()] as u64) as usize;
        k += 1;
        f.read_exact_at(&mut a[..n], off)
            .unwrap_or_else(|e| panic!("{what}: read {n} bytes at {off}: {e}"));
        model.read_at(off, &mut b[..n]);
        assert_bytes_eq(&a[..n], &b[..n], off, what);
        off += n as u64;
    }
    let mut one = [0u8; 1];
    assert_eq!(f.read_at(&mut one, len).unwrap(), 0, "{what}: read at EOF");
}

/// A write length: many tiny, many medium, some up to 1 MiB.
fn random_len(rng: &mut StdRng) -> usize {
    match rng.gen_range(0..10) {
        0..=3 => rng.gen_range(1..=512),
        4..=6 => rng.gen_range(1..=65_536),
        _ => rng.gen_range(1..=MB),
    }
}

/// An offset inside the file, often within two bytes of a 4 KiB boundary.
fn random_offset(rng: &mut StdRng, len: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    if rng.gen_bool(0.3) {
        let boundary = rng.gen_range(0..=len / 4096) * 4096;
        let delta: i64 = rng.gen_range(-2..=2);
        (boundary as i64 + delta).clamp(0, len as i64 - 1) as u64
    } else {
        rng.gen_range(0..len)
    }
}

/// Runs `ops` random operations on `f`, mirroring each into `model`.
fn random_operations(f: &File, model: &mut Model, rng: &mut StdRng, ops: usize) {
    for _ in 0..ops {
        let len = model.len();
        let kind = rng.gen_range(0..100);
        if kind < 80 {
            // overwrite (possibly running past EOF)
            let off = random_offset(rng, len);
            let data = pattern(rng.gen(), random_len(rng));
            f.write_all_at(data, off).unwrap();
            model.write_at(off, data);
        } else if kind < 83 {
            // write beyond EOF, leaving a hole
            let off = len + rng.gen_range(1..2 * MIB);
            let data = pattern(rng.gen(), random_len(rng));
            f.write_all_at(data, off).unwrap();
            model.write_at(off, data);
        } else if kind < 93 {
            // read back a random range
            if len == 0 {
                continue;
            }
            let off = random_offset(rng, len);
            let n = (random_len(rng) as u64).min(len - off) as usize;
            let mut a = vec![0u8; n];
            let mut b = vec![0u8; n];
            f.read_exact_at(&mut a, off).unwrap();
            model.read_at(off, &mut b);
            assert_bytes_eq(&a, &b, off, "random read-back during the workload");
        } else if kind < 96 {
            // truncate down or up by up to 1 MiB
            let new_len = if rng.gen_bool(0.5) {
                len.saturating_sub(rng.gen_range(0..MIB))
            } else {
                len + rng.gen_range(0..MIB)
            };
            f.set_len(new_len).unwrap();
            model.set_len(new_len);
        } else if rng.gen_bool(0.5) {
            f.sync_data().unwrap();
        } else {
            f.sync_all().unwrap();
        }
    }
}

/// N MiB of data, then random overwrites/extensions/truncations/reads,
/// compared with the model before and after remounts. N = 64 by default,
/// 1024 with BIRCHFS_LONG=1.
#[test]
fn random_overwrites_64mib_or_1gib_with_birchfs_long() {
    let long = long_mode();
    let (size_mb, ops, image) = if long {
        (1024u64, 3000usize, "4G")
    } else {
        (64u64, 400usize, "2G")
    };
    let mut m = Mount::with_size(image);
    let mut model = if long {
        Model::Host(open_rw_create(&m.host_dir().join("model")))
    } else {
        Model::Mem(Vec::with_capacity((size_mb as usize + 64) * MB))
    };
    let p = m.path("data");
    let mut rng = StdRng::seed_from_u64(0xB12C_F5DA);
    {
        let f = open_rw_create(&p);
        for i in 0..size_mb {
            let chunk = pattern(0x1000 + i, MB);
            f.write_all_at(chunk, i * MIB).unwrap();
            model.write_at(i * MIB, chunk);
        }
        compare_with_model(&f, &model, "after the initial fill");
        random_operations(&f, &mut model, &mut rng, ops / 2);
        compare_with_model(&f, &model, "after the first half of the operations");
    }
    m.remount();
    {
        let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
        compare_with_model(&f, &model, "after the first remount");
        random_operations(&f, &mut model, &mut rng, ops - ops / 2);
        compare_with_model(&f, &model, "after the second half of the operations");
    }
    m.remount();
    compare_with_model(&File::open(&p).unwrap(), &model, "after the second remount");
    m.unmount();
}

// ---------------------------------------------------------------------------
// sequential write with checksums
// ---------------------------------------------------------------------------

/// A byte buffer backed by u64 words, so it can be checksummed word by word.
struct WordBuf(Vec<u64>);

impl WordBuf {
    fn new(bytes: usize) -> WordBuf {
        assert_eq!(bytes % 8, 0);
        WordBuf(vec![0u64; bytes / 8])
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: the Vec owns len*8 initialized bytes; u8 has no alignment needs.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u8, self.0.len() * 8) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and every bit pattern is a valid u64.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut u8, self.0.len() * 8) }
    }
    /// FNV-style hash over the native-endian words (the same on write and
    /// read, which is all it is for).
    fn checksum(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &w in &self.0 {
            h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3);
            h ^= h >> 29;
        }
        h
    }
}

#[test]
fn sequential_256mib_write_fsync_remount_checksum() {
    const CHUNKS: u64 = 256;
    let key = |i: u64| 0x5E0_0000 + i * 7;
    let mut m = Mount::new();
    let p = m.path("sequential");
    let mut buf = WordBuf::new(MB);
    let mut sums = Vec::with_capacity(CHUNKS as usize);
    {
        let mut f = File::create(&p).unwrap();
        for i in 0..CHUNKS {
            buf.bytes_mut().copy_from_slice(pattern(key(i), MB));
            sums.push(buf.checksum());
            f.write_all(buf.bytes()).unwrap();
        }
        f.sync_all().unwrap();
        assert_eq!(f.metadata().unwrap().len(), CHUNKS * MIB);
    }
    m.remount();
    let md = stat(&p);
    assert_eq!(md.len(), CHUNKS * MIB);
    assert!(
        md.blocks() * 512 >= CHUNKS * MIB,
        "a fully written 256 MiB file reports st_blocks {}",
        md.blocks()
    );
    let mut f = File::open(&p).unwrap();
    for i in 0..CHUNKS {
        f.read_exact(buf.bytes_mut())
            .unwrap_or_else(|e| panic!("read chunk {i}: {e}"));
        if buf.checksum() != sums[i as usize] {
            assert_bytes_eq(
                buf.bytes(),
                pattern(key(i), MB),
                i * MIB,
                "sequential read-back",
            );
            panic!("chunk {i}: checksum differs although the bytes compare equal");
        }
    }
    let mut rest = [0u8; 16];
    assert_eq!(f.read(&mut rest).unwrap(), 0, "data past 256 MiB");
    drop(f);
    m.unmount();
}

// ---------------------------------------------------------------------------
// many small files
// ---------------------------------------------------------------------------

#[test]
fn many_small_files_2000() {
    const FILES: usize = 2000;
    const DIRS: usize = 4;
    let mut m = Mount::new();
    let mut rng = StdRng::seed_from_u64(2000);
    for d in 0..DIRS {
        fs::create_dir(m.path(format!("d{d}"))).unwrap();
    }
    let mut files: Vec<(String, u64, usize)> = Vec::with_capacity(FILES);
    for i in 0..FILES {
        let rel = format!("d{}/file-{i:04}", i % DIRS);
        let len = rng.gen_range(0..20_000usize);
        let key: u64 = rng.gen();
        fs::write(m.path(&rel), pattern(key, len)).unwrap();
        files.push((rel, key, len));
    }
    let verify = |m: &Mount, when: &str| {
        for d in 0..DIRS {
            let want: Vec<String> = (0..FILES)
                .filter(|i| i % DIRS == d)
                .map(|i| format!("file-{i:04}"))
                .collect();
            assert_eq!(
                list_dir(&m.path(format!("d{d}"))),
                want,
                "{when}: listing of d{d}"
            );
        }
        for (rel, key, len) in &files {
            let p = m.path(rel);
            assert_eq!(stat(&p).len(), *len as u64, "{when}: size of {rel}");
            let got = fs::read(&p).unwrap();
            assert_bytes_eq(&got, pattern(*key, *len), 0, &format!("{when}: {rel}"));
        }
    };
    verify(&m, "before remount");
    m.remount();
    verify(&m, "after remount");
    m.unmount();
}

// ---------------------------------------------------------------------------
// concurrent fsyncs: group commit and the stats that split an fsync's time
// ---------------------------------------------------------------------------

#[test]
fn concurrent_fsyncs_share_log_commits_and_stats_split_their_time() {
    const THREADS: u64 = 8;
    const FILES: u64 = 30;
    let mut m = Mount::new();
    let before = daemon_stats(&m);
    create_concurrently(m.root(), THREADS, FILES, 3000, "t", true);
    let after = daemon_stats(&m);
    let d = |k: &str| after[k].as_u64().unwrap() - before[k].as_u64().unwrap();
    let lat = |v: &serde_json::Value, k: &str| v["latency_us"][k]["count"].as_u64().unwrap();
    let dl = |k: &str| lat(&after, k) - lat(&before, k);
    let (fsyncs, queued) = (d("fsyncs"), d("fsyncs") - d("fsyncs_noop"));
    assert!(
        fsyncs >= THREADS * FILES,
        "every fsync reached the daemon: {fsyncs}"
    );
    // Over io_uring (the suite's second pass) several group commits run at once, each
    // mostly its own thread's fsync: there they may share none, but then they overlap.
    let rings = extra_mount_options().iter().any(|o| o == "uring=on");
    let overlapped = if rings {
        d("log_commits_overlapped")
    } else {
        0
    };
    assert!(
        d("log_commits") < queued || overlapped > 0,
        "concurrent fsyncs neither shared log commits ({} commits for {queued} fsyncs) \
         nor overlapped ({overlapped} over io_uring)",
        d("log_commits")
    );
    assert_eq!(
        dl("fsync_queue"),
        queued,
        "every fsync that waited for the log has its queue time counted"
    );
    let flushes = dl("log_flush");
    assert!(
        flushes >= 1 && flushes <= queued,
        "a group's flush serves at least one fsync: {flushes} flushes for {queued} fsyncs"
    );
    assert_eq!(
        dl("log_write"),
        d("log_commits"),
        "every log batch written has its write timed"
    );
    assert_eq!(
        dl("fsync_prepare"),
        fsyncs,
        "every fsync has its preparation timed"
    );
    for k in ["log_flush", "log_write", "fsync_prepare", "fsync_queue"] {
        let p50 = after["latency_us"][k]["p50"].as_f64().unwrap();
        let max = after["latency_us"][k]["max"].as_f64().unwrap();
        assert!(p50 <= max && max > 0.0, "{k}: p50 {p50} max {max}");
    }
    m.remount();
    check_created(&m, THREADS, FILES, 3000, "t");
    m.unmount();
}

/// The standby request threads (two by default) serve beside the others while fsyncs
/// arrive; once none has come for a while, each parks after every request it serves,
/// so creates without fsync are left to the core threads. Every file is whole after a
/// remount. Through `/dev/fuse` only: over io_uring (the suite's second pass) the
/// rings serve every request, and this pass checks nothing more.
#[test]
fn standby_threads_serve_while_fsyncs_arrive_and_park_otherwise() {
    const THREADS: u64 = 4;
    const SYNCED: u64 = 100;
    const PLAIN: u64 = 1000;
    if extra_mount_options().iter().any(|o| o == "uring=on") {
        return;
    }
    let mut m = Mount::new();
    let standby = |m: &Mount| {
        let s = daemon_stats(m);
        let n = |k: &str| s["standby"][k].as_u64().unwrap();
        let requests: u64 = s["requests"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        (n("served"), n("parks"), requests)
    };
    let (served0, _, _) = standby(&m);
    create_concurrently(m.root(), THREADS, SYNCED, 100, "s", true);
    let (served1, _, _) = standby(&m);
    assert!(
        served1 > served0,
        "no standby thread served while {THREADS} threads created and fsynced files"
    );
    // Past the time an fsync keeps the standby threads serving.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let (served2, parks2, requests2) = standby(&m);
    create_concurrently(m.root(), THREADS, PLAIN, 100, "p", false);
    let (served3, parks3, requests3) = standby(&m);
    let (served, parks, requests) = (served3 - served2, parks3 - parks2, requests3 - requests2);
    assert_eq!(
        served, parks,
        "with no fsync coming, a standby thread parks after each request it serves"
    );
    assert!(
        served * 10 < requests,
        "standby threads served {served} of {requests} requests without fsync"
    );
    m.remount();
    check_created(&m, THREADS, SYNCED, 100, "s");
    check_created(&m, THREADS, PLAIN, 100, "p");
    m.unmount();
}

/// Threads that each overwrite a block of their own file and fdatasync it, `rounds`
/// times; returns how many group commits waited to gather fsyncs meanwhile.
fn fsync_loop(m: &Mount, threads: u64, rounds: u64, tag: &str) -> u64 {
    let gathers = |m: &Mount| {
        daemon_stats(m)["latency_us"]["fsync_gather"]["count"]
            .as_u64()
            .unwrap()
    };
    let before = gathers(m);
    let start = Barrier::new(threads as usize);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (path, start) = (m.path(format!("{tag}-{t}")), &start);
            s.spawn(move || {
                let f = File::create(path).unwrap();
                start.wait();
                for i in 0..rounds {
                    f.write_all_at(pattern(t * 100_000 + i, 4096), (i % 8) * 4096)
                        .unwrap();
                    f.sync_data().unwrap();
                }
            });
        }
    });
    gathers(m) - before
}

/// The last round of [`fsync_loop`] is what a remount finds.
fn check_fsync_loop(m: &Mount, threads: u64, rounds: u64, tag: &str) {
    for t in 0..threads {
        let got = fs::read(m.path(format!("{tag}-{t}"))).unwrap();
        for i in rounds.saturating_sub(8)..rounds {
            let off = ((i % 8) * 4096) as usize;
            assert_bytes_eq(
                &got[off..off + 4096],
                pattern(t * 100_000 + i, 4096),
                off as u64,
                tag,
            );
        }
    }
}

#[test]
fn group_commits_gather_fsyncing_threads_but_never_keep_a_lone_one_waiting() {
    let mut m = Mount::new();
    // One thread: nobody else is expected, so no commit ever waits.
    assert_eq!(
        fsync_loop(&m, 1, 200, "lone"),
        0,
        "a lone fsyncing thread was kept waiting"
    );
    // Four threads in a loop: commits wait for the ones due back (timing decides how
    // often; a few thousand fsyncs make at least one certain in practice). Over
    // io_uring several group commits run at once instead, and never gather.
    let rings = extra_mount_options().iter().any(|o| o == "uring=on");
    let mut gathered = 0;
    for round in 0..10 {
        gathered += fsync_loop(&m, 4, 300, &format!("four{round}"));
        if gathered > 0 || (rings && round == 2) {
            break;
        }
    }
    if rings {
        assert_eq!(gathered, 0, "a group commit gathered over io_uring");
    } else {
        assert!(
            gathered > 0,
            "no group commit gathered the fsyncs of four looping threads"
        );
    }
    m.remount();
    check_fsync_loop(&m, 1, 200, "lone");
    check_fsync_loop(&m, 4, 300, "four0");
    m.unmount();
    // Turned off, commits never wait.
    let mut m = Mount::with_options(&["fsync_gather=off"]);
    assert_eq!(
        fsync_loop(&m, 4, 300, "off"),
        0,
        "fsync_gather=off still gathered"
    );
    m.remount();
    check_fsync_loop(&m, 4, 300, "off");
    m.unmount();
}

// ---------------------------------------------------------------------------
// concurrent O_APPEND
// ---------------------------------------------------------------------------

const APPEND_THREADS: usize = 4;
const APPEND_FILES: usize = 4;
const RECORDS: u32 = 300;
const HEADER: usize = 16;
const FOOTER: usize = 4;

fn rec_hash(t: usize, f: usize, seq: u32) -> u64 {
    mix64(((t as u64) << 40) ^ ((f as u64) << 32) ^ seq as u64)
}

/// Payload length of a record: mostly up to 8 KiB, one in fifty 40-65 KB.
fn rec_len(t: usize, f: usize, seq: u32) -> usize {
    let h = rec_hash(t, f, seq);
    if h % 50 == 0 {
        40_000 + ((h >> 8) % 25_000) as usize
    } else {
        1 + ((h >> 8) % 8192) as usize
    }
}

fn rec_payload(t: usize, f: usize, seq: u32) -> &'static [u8] {
    pattern(rec_hash(t, f, seq) ^ 0xA77E_4D00, rec_len(t, f, seq))
}

/// "REC:" thread file 0 0 seq(le32) len(le32) payload ":END"
fn record(t: usize, f: usize, seq: u32) -> Vec<u8> {
    let payload = rec_payload(t, f, seq);
    let mut r = Vec::with_capacity(HEADER + payload.len() + FOOTER);
    r.extend_from_slice(b"REC:");
    r.extend_from_slice(&[t as u8, f as u8, 0, 0]);
    r.extend_from_slice(&seq.to_le_bytes());
    r.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    r.extend_from_slice(payload);
    r.extend_from_slice(b":END");
    r
}

#[track_caller]
fn verify_append_file(path: &Path, f: usize, when: &str) {
    let data = fs::read(path).unwrap();
    let expected_len: usize = (0..APPEND_THREADS)
        .flat_map(|t| (0..RECORDS).map(move |s| HEADER + rec_len(t, f, s) + FOOTER))
        .sum();
    assert_eq!(data.len(), expected_len, "{when}: length of file {f}");
    assert_eq!(
        stat(path).len(),
        expected_len as u64,
        "{when}: st_size of file {f}"
    );
    let mut next = [0u32; APPEND_THREADS];
    let mut pos = 0usize;
    while pos < data.len() {
        let at = format!("{when}: file {f}, record at offset {pos}");
        assert!(data.len() - pos >= HEADER + FOOTER, "{at}: truncated");
        assert_eq!(
            &data[pos..pos + 4],
            b"REC:",
            "{at}: bad magic (torn or interleaved write)"
        );
        let t = data[pos + 4] as usize;
        assert!(t < APPEND_THREADS, "{at}: thread {t}");
        assert_eq!(data[pos + 5] as usize, f, "{at}: record of another file");
        let seq = u32::from_le_bytes(data[pos + 8..pos + 12].try_into().unwrap());
        let len = u32::from_le_bytes(data[pos + 12..pos + 16].try_into().unwrap()) as usize;
        assert_eq!(
            seq, next[t],
            "{at}: thread {t}'s records out of order or missing"
        );
        assert_eq!(len, rec_len(t, f, seq), "{at}: payload length");
        let end = pos + HEADER + len + FOOTER;
        assert!(end <= data.len(), "{at}: runs past the end");
        assert_bytes_eq(
            &data[pos + HEADER..pos + HEADER + len],
            rec_payload(t, f, seq),
            (pos + HEADER) as u64,
            &at,
        );
        assert_eq!(&data[end - FOOTER..end], b":END", "{at}: bad footer");
        next[t] += 1;
        pos = end;
    }
    for (t, n) in next.iter().enumerate() {
        assert_eq!(
            *n, RECORDS,
            "{when}: file {f} has {n} records of thread {t}"
        );
    }
}

#[test]
fn concurrent_o_append_4_threads_4_files() {
    let mut m = Mount::new();
    let paths: Vec<_> = (0..APPEND_FILES)
        .map(|f| m.path(format!("log{f}")))
        .collect();
    for p in &paths {
        File::create(p).unwrap();
    }
    let barrier = Barrier::new(APPEND_THREADS);
    std::thread::scope(|s| {
        for t in 0..APPEND_THREADS {
            let paths = &paths;
            let barrier = &barrier;
            s.spawn(move || {
                let mut fds: Vec<File> = paths
                    .iter()
                    .map(|p| OpenOptions::new().append(true).open(p).unwrap())
                    .collect();
                barrier.wait();
                for seq in 0..RECORDS {
                    for k in 0..APPEND_FILES {
                        let f = (k + t + seq as usize) % APPEND_FILES;
                        let rec = record(t, f, seq);
                        let n = fds[f].write(&rec).unwrap();
                        assert_eq!(n, rec.len(), "short O_APPEND write");
                    }
                }
                for fd in &fds {
                    fd.sync_data().unwrap();
                }
            });
        }
    });
    for (f, p) in paths.iter().enumerate() {
        verify_append_file(p, f, "before remount");
    }
    m.remount();
    for (f, p) in paths.iter().enumerate() {
        verify_append_file(p, f, "after remount");
    }
    m.unmount();
}
