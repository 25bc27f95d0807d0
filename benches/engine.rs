//! The engine's own cost per operation of the two fsync-heavy workloads the issues
//! measure through FUSE, without FUSE and without a disk: an [`Fs`] over an
//! in-memory device, where a flush costs nothing. What is left is the daemon's CPU
//! per operation (tree updates, log records, writeback, group-commit bookkeeping),
//! far steadier than a timing through a mount on a shared 2-CPU machine.
//!
//! - `create+fsync`: W4's per-file work (create and open, fsync, release), 1,000
//!   files to a directory.
//! - `overwrite+fdatasync`: W3's per-write work (a 4 KiB overwrite at a random
//!   block of a 64 MiB file, then fdatasync).
//!
//! Run: `cargo bench --bench engine`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use birchfs::dev::MemDev;
use birchfs::{Creds, Fs, MkfsOptions, Options, ROOT_INO};
use criterion::{criterion_group, criterion_main, Criterion};

const MB: u64 = 1 << 20;

fn fresh() -> Fs {
    let dev = Arc::new(MemDev::new(2048 * MB));
    Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    Fs::open(dev, Options::default()).unwrap()
}

const CR: Creds = Creds { uid: 0, gid: 0 };

fn create_fsync(c: &mut Criterion) {
    let fs = fresh();
    let mut dir = ROOT_INO;
    let mut n = 0u64;
    let mut g = c.benchmark_group("engine");
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("create+fsync", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                // A new directory every 1,000 files, as W4 spreads them.
                if n % 1000 == 0 {
                    let d = format!("d{n}");
                    dir = fs.mkdir(ROOT_INO, d.as_bytes(), 0o755, CR).unwrap().ino;
                }
                n += 1;
                let name = format!("file{n:08}");
                let a = fs
                    .create_open(dir, name.as_bytes(), libc::S_IFREG | 0o644, CR, 0o022)
                    .unwrap();
                fs.fsync(a.ino, false).unwrap();
                fs.release(a.ino).unwrap();
            }
            t.elapsed()
        })
    });
    g.finish();
}

fn overwrite_fdatasync(c: &mut Criterion) {
    let fs = fresh();
    let ino = fs
        .create_open(ROOT_INO, b"f", libc::S_IFREG | 0o644, CR, 0o022)
        .unwrap()
        .ino;
    let blocks = 64 * MB / 4096;
    let chunk = vec![7u8; MB as usize];
    for i in 0..64 {
        fs.write(ino, i * MB, &chunk).unwrap();
    }
    fs.fsync(ino, false).unwrap();
    fs.commit().unwrap();
    let block = vec![9u8; 4096];
    // A fixed pseudo-random walk over the blocks (an LCG), the same every run.
    let mut x = 12345u64;
    let mut g = c.benchmark_group("engine");
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("overwrite+fdatasync", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let blk = (x >> 33) % blocks;
                fs.write(ino, blk * 4096, &block).unwrap();
                fs.fsync(ino, true).unwrap();
            }
            t.elapsed()
        })
    });
    g.finish();
}

criterion_group!(benches, create_fsync, overwrite_fdatasync);
criterion_main!(benches);
