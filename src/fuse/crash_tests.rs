//! Power cuts under the daemon's own fsync path: FUSE requests handled by
//! [`FuseFs`] (writes as the kernel's writeback sends them, fsyncs through the group
//! commit with gathering, its timer and its workers) on a crash-recording device.
//!
//! The oracle is the power-cut model of [`crate::dev::CrashDev`] at the moment of
//! each answer: an fsync answered while the device had recorded `n` operations
//! must hold in the disk left by a cut right then, which has every write before
//! the last flush among those `n` and none after it. So a group commit that
//! answered before its flush, or for a target its flush did not cover, fails here.

use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::Duration;

use fuser::{Errno, FileAttr, FileHandle, FopenFlags, Generation, WriteFlags};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::answer::{Answer, AnswerCreate, AnswerEmpty, AnswerWrite};
use super::ops::{Caller, FuseFs};
use crate::dev::{CrashDev, MemDev};
use crate::fs::{Fs, MkfsOptions, Options, ROOT_INO};

/// What a handler answered, with the device's operation count at that moment.
#[derive(Debug)]
enum Got {
    Err(i32),
    Written(u32),
    Created,
    Ok { ops: usize },
}

/// An answer that reports what it was given and when (in device operations).
struct Reply(Sender<Got>, Arc<CrashDev>);

impl Answer for Reply {
    fn error(self, e: Errno) {
        let _ = self.0.send(Got::Err(e.code()));
    }
}
impl AnswerEmpty for Reply {
    fn ok(self) {
        let ops = self.1.op_count();
        let _ = self.0.send(Got::Ok { ops });
    }
}
impl AnswerWrite for Reply {
    fn written(self, n: u32) {
        let _ = self.0.send(Got::Written(n));
    }
}
impl AnswerCreate for Reply {
    fn created(self, _: &Duration, _: &FileAttr, _: Generation, _: FileHandle, _: FopenFlags) {
        let _ = self.0.send(Got::Created);
    }
}

/// One thread's record: its files (name, every version in order) and its promises
/// (device operations when an fsync was answered, file, version promised).
struct Record {
    files: Vec<(String, Vec<Vec<u8>>)>,
    promises: Vec<(usize, usize, usize)>,
}

const THREADS: usize = 4;
const ROUNDS: usize = 24;

/// One writer: a file of its own, overwritten and fsynced (or fdatasynced) in a loop,
/// now and then with more than the workers' threshold of dirty data, and every few
/// rounds a new file whose name its fsync must make durable too.
fn writer(ffs: &FuseFs, dev: &Arc<CrashDev>, t: usize) -> Record {
    let mut rng = StdRng::seed_from_u64(t as u64 + 7);
    let (tx, rx) = channel();
    let r = || Reply(tx.clone(), dev.clone());
    let c = Caller {
        uid: 0,
        gid: 0,
        pid: 1000 + t as u32,
    };
    let mut rec = Record {
        files: Vec::new(),
        promises: Vec::new(),
    };
    let mut ino = 0;
    for round in 0..ROUNDS {
        if round % 8 == 0 {
            let name = format!("t{t}-{round}");
            ffs.create(&c, 1, name.as_bytes(), 0o100644, 0, libc::O_RDWR, r());
            assert!(matches!(rx.recv().unwrap(), Got::Created), "create {name}");
            ino = ffs.fs.lookup(ROOT_INO, name.as_bytes()).unwrap().ino;
            rec.files.push((name, vec![Vec::new()]));
        }
        let file = rec.files.len() - 1;
        let versions = &mut rec.files[file].1;
        let mut data = versions.last().unwrap().clone();
        // Every fourth round writes 64-256 KiB, which sends the fsync to a worker.
        let len = if round % 4 == 3 {
            rng.gen_range(64 << 10..256 << 10)
        } else {
            rng.gen_range(1..9_000)
        };
        let off = rng.gen_range(0..40_000usize);
        let byte = (t * ROUNDS + round) as u8 | 1;
        let flags = if rng.gen_bool(0.5) {
            WriteFlags::FUSE_WRITE_CACHE
        } else {
            WriteFlags::empty()
        };
        ffs.write(&c, ino, off as u64, &vec![byte; len], flags, r());
        assert!(matches!(rx.recv().unwrap(), Got::Written(n) if n as usize == len));
        if data.len() < off + len {
            data.resize(off + len, 0);
        }
        data[off..off + len].fill(byte);
        versions.push(data);
        ffs.fsync(c.pid, ino, rng.gen_bool(0.5), r());
        match rx.recv().unwrap() {
            Got::Ok { ops } => rec.promises.push((ops, file, versions.len() - 1)),
            Got::Err(e) => panic!("fsync failed: errno {e}"),
            other => panic!("fsync answered {other:?}"),
        }
    }
    rec
}

/// Checks the disk a power cut leaves after `upto` recorded operations against
/// every fsync answered by operation `answered_by`.
fn check_state(dev: &CrashDev, upto: usize, answered_by: usize, records: &[Record]) {
    let img = dev.image_with(upto, &[]);
    let rep = crate::check::check(&MemDev::from_image(img.clone())).unwrap();
    assert!(rep.problems.is_empty(), "state {upto}: {:#?}", rep.problems);
    let fs = Fs::open(Arc::new(MemDev::from_image(img)), Options::default()).unwrap();
    for (t, rec) in records.iter().enumerate() {
        for (f, (name, versions)) in rec.files.iter().enumerate() {
            let promised = rec
                .promises
                .iter()
                .filter(|&&(ops, file, _)| ops <= answered_by && file == f)
                .map(|&(_, _, v)| v)
                .max();
            let Some(promised) = promised else {
                continue;
            };
            let ino = match fs.lookup(ROOT_INO, name.as_bytes()) {
                Ok(a) => a.ino,
                Err(e) => panic!(
                    "state {upto}: thread {t}'s {name} (fsynced, version {promised}) is gone: {e}"
                ),
            };
            let got = fs.read(ino, 0, 1 << 20).unwrap();
            assert!(
                versions[promised..].contains(&got),
                "state {upto}: thread {t}'s {name} ({} bytes) is not version {promised} or later",
                got.len()
            );
        }
    }
}

/// Four threads write and fsync through the daemon's handlers at once, with
/// gathering on; at each flush, a cut just after it and a cut just before the next
/// one (every write between them landed or none did) keep every fsync answered
/// before the next flush.
#[test]
fn fsyncs_answered_by_the_group_commit_survive_a_power_cut_at_any_moment() {
    power_cuts_under_group_commit(1);
}

/// The same with several group commits at once (as over io_uring): a commit whose
/// flush ends first answers only what that flush covered.
#[test]
fn fsyncs_answered_by_concurrent_group_commits_survive_a_power_cut_at_any_moment() {
    power_cuts_under_group_commit(THREADS);
}

/// Runs [`writer`] on [`THREADS`] threads with up to `committers` group commits at
/// once, then checks the disk a power cut leaves at every flush.
fn power_cuts_under_group_commit(committers: usize) {
    let base = Arc::new(MemDev::new(32 << 20));
    Fs::mkfs(
        base.clone(),
        &MkfsOptions {
            node_size: Some(4096),
            ..Default::default()
        },
    )
    .unwrap();
    let dev = Arc::new(CrashDev::new(base.image()));
    if committers > 1 {
        // Flushes that take time, so that group commits overlap.
        dev.set_flush_delay(Duration::from_micros(300));
    }
    let fs = Arc::new(
        Fs::open(
            dev.clone(),
            Options {
                commit_interval: Duration::ZERO,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let ffs = FuseFs::new(fs.clone());
    ffs.gather_fsyncs(true);
    ffs.fsync_committers(committers);
    let start = dev.op_count();
    let records: Vec<Record> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (ffs, dev) = (&ffs, &dev);
                sc.spawn(move || writer(ffs, dev, t))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(ffs);
    let fs_stats = fs.stats();
    drop(fs);
    // Each flush as (the index just after it, how many ops came before it began).
    let all = dev.flush_covers();
    // The state before the first flush of the run: the last flush of the setup.
    let first = all
        .iter()
        .copied()
        .filter(|&(p, _)| p <= start)
        .max()
        .unwrap_or((0, 0));
    let flushes: Vec<(usize, usize)> = std::iter::once(first)
        .chain(all.into_iter().filter(|&(p, _)| p > start))
        .collect();
    let stats = (dev.op_count(), flushes.len());
    assert!(
        flushes.len() > ROUNDS,
        "few flushes: {stats:?} (ops, flushes)"
    );
    let answered = records.iter().map(|r| r.promises.len()).sum::<usize>();
    assert_eq!(answered, THREADS * ROUNDS);
    let overlapped = fs_stats.log_commits_overlapped;
    if committers == 1 {
        assert_eq!(overlapped, 0, "a second group commit ran beside the first");
    }
    eprintln!(
        "{answered} fsyncs answered with {} flushes ({overlapped} group commits beside another, \
         {} sharing another's flush)",
        flushes.len() - 1,
        fs_stats.log_flushes_shared
    );
    // What the flushes ended so far made durable: a flush covers what was written
    // before it began, and one that ends later may have begun earlier.
    let mut durable = 0;
    for (i, &(p, covers)) in flushes.iter().enumerate() {
        durable = durable.max(covers);
        // Until the next flush ends (its index is next - 1), nothing later is
        // durable.
        let next = flushes.get(i + 1).map_or(usize::MAX, |&(n, _)| n);
        let answered_by = next - 1;
        check_state(&dev, durable, answered_by, &records);
        let before_next = next.min(dev.op_count() + 1) - 1;
        if before_next > p {
            check_state(&dev, before_next, answered_by, &records);
        }
    }
}
