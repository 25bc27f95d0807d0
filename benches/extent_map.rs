//! Seed 2's claim: dropping a range that covers k of a file's n extents costs
//! O(log n + k). Criterion times `ExtentMap::drop_range` over k extents of a map of
//! n extents (each drop cuts into the first and the last, so it splits both), for n
//! up to 1,000,000; only the drop is timed, the map is restored between drops. The
//! `one-search-per-extent` rows drop the same ranges the way btrfs did before the
//! seed: a fresh search from the root for every extent in the range.
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

criterion_group!(benches, drop_range);
criterion_main!(benches);
