//! The checksum every data block and tree node carries: `format::csum` (crc-fast,
//! folding with carry-less multiplies) against the crc32c crate it replaced (three
//! interleaved crc32 instruction streams), on the sizes birchfs sums: a 4 KiB data
//! block, a 16 KiB node, and a 1 MiB run summed block by block as writeback does.
//! Both compute the same CRC-32C (a unit test in `format` holds them to it).
//!
//! Run: `cargo bench --bench csum`.

use std::time::Duration;

use birchfs::format::csum;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn data(len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect()
}

fn sums(c: &mut Criterion) {
    let mut g = c.benchmark_group("csum");
    g.warm_up_time(Duration::from_millis(300));
    g.measurement_time(Duration::from_secs(2));
    for (name, len, block) in [
        ("block 4K", 4096usize, 4096usize),
        ("node 16K", 16384, 16384),
        ("run 1M in 4K blocks", 1 << 20, 4096),
    ] {
        let d = data(len);
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_with_input(BenchmarkId::new("crc-fast (csum)", name), &d, |b, d| {
            b.iter(|| d.chunks(block).fold(0u32, |x, c| x ^ csum(c)))
        });
        g.bench_with_input(BenchmarkId::new("crc32c crate", name), &d, |b, d| {
            b.iter(|| d.chunks(block).fold(0u32, |x, c| x ^ crc32c::crc32c(c)))
        });
    }
    g.finish();
}

criterion_group!(benches, sums);
criterion_main!(benches);
