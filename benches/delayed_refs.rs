//! Seed 4's measurement: the time of each insert into, and each search of, the
//! delayed-ref heads, for a head whose key and links share a cache line against the
//! same head with its links after the other members (as btrfs had it before the
//! patch), reported like the seed's htree_insert histogram: mean, median, p90, p99,
//! max and a log-scale histogram, in nanoseconds.
//!
//! Run: `cargo bench --bench delayed_refs` (HEADS=n to change the count).

use std::hint::black_box;
use std::time::Instant;

use birchfs::refs::DelayedRefHead;
use birchfs::skiplist::{Linked, Links, SkipList};

/// The members btrfs keeps in a head besides key and link (mutex, spinlock, ref
/// tree root, list head, extent op pointer, counters): 88 bytes of them.
type Others = [u64; 11];

/// btrfs's head after the patch: key, then link, then the rest.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Packed {
    bytenr: u64,
    links: Links,
    others: Others,
}

/// btrfs's head before the patch: the link after the other members.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Split {
    bytenr: u64,
    others: Others,
    links: Links,
}

macro_rules! linked {
    ($t:ty) => {
        impl Linked for $t {
            fn key(&self) -> u64 {
                self.bytenr
            }
            fn links(&self) -> &Links {
                &self.links
            }
            fn links_mut(&mut self) -> &mut Links {
                &mut self.links
            }
        }
    };
}
linked!(Packed);
linked!(Split);

fn keys(n: usize, seed: u64) -> Vec<u64> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 20) << 12
        })
        .collect()
}

/// Times every insert of `ks` and then every search, in nanoseconds.
fn run<N: Linked + Clone>(
    ks: &[u64],
    order: &[u64],
    make: impl Fn(u64) -> N,
) -> (Vec<u32>, Vec<u32>) {
    let mut list: SkipList<N> = SkipList::default();
    let mut ins = Vec::with_capacity(ks.len());
    for &k in ks {
        let t = Instant::now();
        list.insert(make(k));
        ins.push(t.elapsed().as_nanos().min(u32::MAX as u128) as u32);
    }
    let mut srch = Vec::with_capacity(order.len());
    for &k in order {
        let t = Instant::now();
        black_box(list.find(k));
        srch.push(t.elapsed().as_nanos().min(u32::MAX as u128) as u32);
    }
    (ins, srch)
}

fn report(name: &str, mut v: Vec<u32>) {
    v.sort_unstable();
    let n = v.len();
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    let pct = |p: f64| v[((n as f64 * p) as usize).min(n - 1)];
    println!(
        "{name:<28} mean {mean:8.1}  median {:6}  p90 {:6}  p99 {:6}  max {:8}",
        pct(0.5),
        pct(0.9),
        pct(0.99),
        v[n - 1]
    );
    // Log-scale buckets from 16 ns up, as the seed's histogram.
    let mut lo = 0u32;
    let mut hi = 16u32;
    while lo <= v[n - 1] {
        let c = v.iter().filter(|&&x| x >= lo && x < hi).count();
        if c > 0 {
            let bar = "#".repeat((c * 50).div_ceil(n));
            println!("    {lo:>8} - {hi:<8} {c:>9} {bar}");
        }
        lo = hi;
        hi = hi.saturating_mul(4);
    }
}

fn main() {
    // `cargo test --benches` runs this once; keep that quick.
    let quick = std::env::args().any(|a| a == "--test" || a == "--list");
    let n: usize = std::env::var("HEADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 10_000 } else { 1_000_000 });
    let rounds = if quick { 1 } else { 3 };
    println!(
        "delayed-ref heads: {n} inserts then {n} searches, {rounds} rounds interleaved; sizes: \
         packed {} B (links at {}), split {} B (links at {}), birchfs DelayedRefHead {} B (links in its first 64 B)",
        std::mem::size_of::<Packed>(),
        std::mem::offset_of!(Packed, links),
        std::mem::size_of::<Split>(),
        std::mem::offset_of!(Split, links),
        std::mem::size_of::<DelayedRefHead>(),
    );
    let mut acc: [(Vec<u32>, Vec<u32>); 3] = Default::default();
    for r in 0..rounds {
        let ks = keys(n, 1 + r as u64);
        let mut order = ks.clone();
        order.reverse();
        order.rotate_left(n / 3);
        let runs = [
            run(&ks, &order, |k| Packed {
                bytenr: k,
                links: Links::default(),
                others: [0; 11],
            }),
            run(&ks, &order, |k| Split {
                bytenr: k,
                others: [0; 11],
                links: Links::default(),
            }),
            run(&ks, &order, |k| DelayedRefHead::new(k, 4096, 1, 1)),
        ];
        for (a, (i, s)) in acc.iter_mut().zip(runs) {
            a.0.extend(i);
            a.1.extend(s);
        }
    }
    let names = [
        "key+link together",
        "link after the rest",
        "birchfs DelayedRefHead",
    ];
    for (name, (i, s)) in names.iter().zip(acc) {
        report(&format!("insert, {name}"), i);
        report(&format!("search, {name}"), s);
    }
}
