//! Seed 2's claim: dropping a range that covers k of a file's n extents costs
//! O(log n + k). Criterion times `ExtentMap::drop_range` over k extents of a map of
//! n extents (each drop cuts into the first and the last, so it splits both), for n
//! up to 1,000,000; only the drop is timed, the map is restored between drops. The
//! `one-search-per-extent` rows drop the same ranges the way btrfs did before the
//! seed: a fresh search from the root for every extent in the range.
//!
//! The `extent_map_w3` group times what W3 asks of the maps per fdatasync: the
//! extents under one random 4 KiB block (`range`) and their replacement by a new
//! block (`replace`), in four files of 256 MiB that random 4 KiB overwrites have cut
//! into 65,536 extents each, so the records lie scattered in memory, as on a mount.
//!
//! Run: `cargo bench --bench extent_map`.

use std::time::{Duration, Instant};

use birchfs::extent_map::{ExtentMap, Mapping};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

const EXT: u64 = 8192;

fn mapping(i: u64) -> Mapping {
    Mapping {
        disk_bytenr: (1 << 30) + i * EXT,
        disk_len: EXT,
        offset: 0,
        len: EXT,
        prealloc: false,
        generation: 1,
    }
}

fn build(n: u64) -> ExtentMap {
    let mut m = ExtentMap::default();
    for i in 0..n {
        m.replace(i * EXT, mapping(i));
    }
    m
}

fn drop_range(c: &mut Criterion) {
    let mut g = c.benchmark_group("extent_map_drop_range");
    g.warm_up_time(Duration::from_millis(300));
    g.measurement_time(Duration::from_secs(2));
    for n in [1_000u64, 10_000, 100_000, 1_000_000] {
        let mut map = build(n);
        for (k, naive) in [
            (1u64, false),
            (16, false),
            (256, false),
            (16, true),
            (256, true),
        ] {
            let name = if naive {
                format!("k={k} one-search-per-extent")
            } else {
                format!("k={k}")
            };
            g.bench_with_input(BenchmarkId::new(name, n), &k, |b, &k| {
                let mut x = 0x9e37_79b9_7f4a_7c15u64;
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let first = (x >> 33) % (n - k);
                        // From the middle of extent `first` to the middle of `first + k`.
                        let (s, e) = (first * EXT + EXT / 2, (first + k) * EXT + EXT / 2);
                        let t = Instant::now();
                        if naive {
                            // Find the next extent from the root, drop it, repeat.
                            let mut pos = s;
                            while let Some((off, m)) = map.lookup(pos) {
                                let end = (off + m.len).min(e);
                                map.drop_range(pos, end);
                                pos = end;
                                if pos >= e {
                                    break;
                                }
                            }
                        } else {
                            std::hint::black_box(map.drop_range(s, e));
                        }
                        total += t.elapsed();
                        for i in first..=first + k {
                            map.replace(i * EXT, mapping(i));
                        }
                    }
                    total
                });
            });
        }
        assert_eq!(map.len() as u64, n, "restored after every drop");
    }
    g.finish();
}

/// One block at `disk`, written in transaction `generation`.
fn block(disk: u64, generation: u64) -> Mapping {
    Mapping {
        disk_bytenr: disk,
        disk_len: 4096,
        offset: 0,
        len: 4096,
        prealloc: false,
        generation,
    }
}

/// Four maps of 65,536 one-block extents, made by random 4 KiB overwrites of one
/// 256 MiB extent each, so neighbours in the file are far apart in memory.
fn scattered() -> Vec<ExtentMap> {
    const FILE: u64 = 256 << 20;
    let blocks = FILE / 4096;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..4u64)
        .map(|f| {
            let mut m = ExtentMap::default();
            let base = (f + 1) << 36;
            m.replace(
                0,
                Mapping {
                    disk_bytenr: base,
                    disk_len: FILE,
                    offset: 0,
                    len: FILE,
                    prealloc: false,
                    generation: 1,
                },
            );
            // A random order of every block: each one overwritten once.
            let mut order: Vec<u64> = (0..blocks).collect();
            for i in (1..order.len()).rev() {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                order.swap(i, ((x >> 33) % (i as u64 + 1)) as usize);
            }
            for (n, b) in order.into_iter().enumerate() {
                let disk = base + FILE + n as u64 * 4096;
                m.replace(b * 4096, block(disk, 2));
            }
            assert_eq!(m.len() as u64, blocks);
            m
        })
        .collect()
}

fn w3_pattern(c: &mut Criterion) {
    let mut maps = scattered();
    let blocks = (256u64 << 20) / 4096;
    let mut g = c.benchmark_group("extent_map_w3");
    g.warm_up_time(Duration::from_millis(300));
    g.measurement_time(Duration::from_secs(2));
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    g.bench_function("range of a random block", |b| {
        b.iter(|| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let (f, blk) = (((x >> 20) % 4) as usize, (x >> 33) % blocks);
            std::hint::black_box(maps[f].range(blk * 4096, blk * 4096 + 4096))
        })
    });
    let mut disk = 1u64 << 44;
    g.bench_function("replace a random block", |b| {
        b.iter(|| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let (f, blk) = (((x >> 20) % 4) as usize, (x >> 33) % blocks);
            disk += 4096;
            maps[f].replace(blk * 4096, block(disk, 3));
        })
    });
    g.finish();
    assert!(
        maps.iter().all(|m| m.len() as u64 == blocks),
        "every block still mapped once"
    );
}

criterion_group!(benches, drop_range, w3_pattern);
criterion_main!(benches);
