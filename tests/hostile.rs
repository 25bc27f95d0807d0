//! Hostile images: a valid image with random damage (bit flips, overwritten bytes,
//! zeroed blocks) in its superblocks, tree nodes and log area. Mount, a walk over every
//! file, a few changes, unmount and check must each return an error or succeed: never
//! panic, hang or allocate without bound. Iterations: 150, or 3000 with BIRCHFS_LONG.
//!
//! The mutations that once found bugs live in `fuzz/corpus/hostile/` (one per file:
//! `seed offset...`), and run first.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use birchfs::dev::MemDev;
use birchfs::{Creds, FileKind, Fs, MkfsOptions, Options, ROOT_INO};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn seed_image() -> Vec<u8> {
    let dev = Arc::new(MemDev::new(40 << 20));
    Fs::mkfs(
        dev.clone(),
        &MkfsOptions {
            node_size: Some(4096),
            ..Default::default()
        },
    )
    .unwrap();
    let fs = Fs::open(dev.clone(), Options::default()).unwrap();
    let c = Creds::default();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, c).unwrap();
    for i in 0..150 {
        let f = fs
            .mknod(d.ino, format!("file{i}").as_bytes(), 0o644, 0, c)
            .unwrap();
        fs.write(f.ino, (i * 1000) as u64, &vec![i as u8; 3000 + i * 50])
            .unwrap();
        fs.setxattr(f.ino, b"user.x", &[i as u8; 30], false, false)
            .unwrap();
    }
    fs.symlink(ROOT_INO, b"s", b"d/file1", c).unwrap();
    fs.commit().unwrap();
    // Leave log batches behind as well: fsyncs after the last commit.
    for i in 0..5 {
        let f = fs
            .mknod(ROOT_INO, format!("logged{i}").as_bytes(), 0o644, 0, c)
            .unwrap();
        fs.write(f.ino, 0, &vec![7; 5000]).unwrap();
        fs.fsync(f.ino, false).unwrap();
    }
    let img = dev.image();
    drop(fs); // `img` was taken before: a crash with no final commit
    img
}

/// Walks and changes the filesystem; errors are fine, panics are not.
fn exercise(fs: &Fs) {
    let mut stack = vec![ROOT_INO];
    let mut seen = 0;
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs.readdir(dir, 0, 10_000) else {
            continue;
        };
        for e in entries {
            seen += 1;
            if seen > 5000 || e.name == b"." || e.name == b".." {
                continue;
            }
            let _ = fs.getattr(e.ino);
            let _ = fs.listxattr(e.ino);
            match e.kind {
                FileKind::Dir => stack.push(e.ino),
                FileKind::File => {
                    let _ = fs.read(e.ino, 0, 1 << 16);
                    let _ = fs.write(e.ino, 100, b"overwrite");
                }
                FileKind::Symlink => {
                    let _ = fs.readlink(e.ino);
                }
                _ => {}
            }
        }
    }
    let c = Creds::default();
    let _ = fs.mknod(ROOT_INO, b"new-after-damage", 0o644, 0, c);
    let _ = fs.unlink(ROOT_INO, b"s");
    let _ = fs.rename(ROOT_INO, b"d", ROOT_INO, b"e", Default::default());
    let _ = fs.commit();
}

fn run_one(base: &[u8], seed: u64) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut img = base.to_vec();
    damage(&mut img, &mut rng);
    survive(img, seed)
}

/// Random damage to `img`: bit flips, bytes and zeroed blocks.
fn damage(img: &mut [u8], rng: &mut StdRng) {
    // Damage where it matters: superblock copy, the log area, and the metadata region
    // right after it, where mkfs and the first commits put tree nodes.
    let regions = [
        (64 << 10, 4096),
        (1 << 20, 64 << 10),
        (2 << 20, 1 << 20),
        (0, img.len()),
    ];
    for _ in 0..rng.gen_range(1..6) {
        let (start, len) = regions[rng.gen_range(0..regions.len())];
        let at = start + rng.gen_range(0..len);
        match rng.gen_range(0..3) {
            0 => img[at] ^= 1 << rng.gen_range(0..8),
            1 => img[at] = rng.gen(),
            _ => {
                let b = at / 4096 * 4096;
                img[b..b + 4096].fill(0);
            }
        }
    }
}

/// Mount, walk, change, unmount, check and restore `img`: errors are fine, panics
/// are not.
fn survive(img: Vec<u8>, seed: u64) -> Result<(), String> {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let dev = Arc::new(MemDev::from_image(img.clone()));
        if let Ok(fs) = Fs::open(dev.clone(), Options::default()) {
            exercise(&fs);
            drop(fs);
        }
        let _ = birchfs::check::check(&MemDev::from_image(dev.image()));
        let out = tempfile::tempdir().expect("a temporary directory");
        let _ = birchfs::restore::restore(
            &MemDev::from_image(img.clone()),
            &out.path().join("restored"),
            &Default::default(),
        );
        let _ = birchfs::check::check(&MemDev::from_image(img));
    }));
    r.map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        format!("seed {seed}: panic: {msg}")
    })
}

/// The tree nodes of `img` (4 KiB nodes, as `seed_image` makes them).
fn nodes_of(img: &[u8]) -> Vec<usize> {
    let sb = birchfs::format::Superblock::decode(&img[64 << 10..(64 << 10) + 4096], 64 << 10)
        .expect("the seed image's superblock");
    (0..img.len() / 4096)
        .map(|i| i * 4096)
        .filter(|&o| birchfs::format::decode_node(&img[o..o + 4096], o as u64, &sb.fsid).is_ok())
        .collect()
}

/// Changes bytes of 1 to 3 tree nodes and writes their checksums anew: what a
/// crafted image holds (a damaged disk's nodes fail their checksums instead). Header
/// fields, keys, item offsets and lengths, and values are all fair game.
fn forge(img: &mut [u8], nodes: &[usize], rng: &mut StdRng) {
    for _ in 0..rng.gen_range(1..4) {
        let n = nodes[rng.gen_range(0..nodes.len())];
        for _ in 0..rng.gen_range(1..4) {
            // Mostly the used front of the node: its header, keys and first items.
            let span = if rng.gen_bool(0.7) { 600 } else { 4092 };
            let at = n + 4 + rng.gen_range(0..span);
            match rng.gen_range(0..4) {
                0 => img[at] ^= 1 << rng.gen_range(0..8),
                1 => img[at] = rng.gen(),
                2 => img[at] = [0, 1, 0x7f, 0x80, 0xff][rng.gen_range(0..5)],
                _ => {
                    let end = (at + 8).min(n + 4096);
                    img[at..end].fill(if rng.gen() { 0xff } else { 0 });
                }
            }
        }
        let c = birchfs::format::csum(&img[n + 4..n + 4096]);
        img[n..n + 4].copy_from_slice(&c.to_le_bytes());
    }
}

/// Nodes with valid checksums and hostile contents: the engine, check and restore
/// must refuse or cope, never panic.
#[test]
fn forged_nodes_never_panic() {
    let base = seed_image();
    let nodes = nodes_of(&base);
    assert!(nodes.len() > 10, "{} nodes", nodes.len());
    let n = if std::env::var("BIRCHFS_LONG").is_ok() {
        3000
    } else {
        150
    };
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let failures: Vec<String> = (5000..5000 + n)
        .filter_map(|seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut img = base.clone();
            forge(&mut img, &nodes, &mut rng);
            survive(img, seed).err()
        })
        .collect();
    std::panic::set_hook(prev);
    eprintln!("forged nodes: {n} runs, {} panics", failures.len());
    assert!(
        failures.is_empty(),
        "{:#?}",
        &failures[..failures.len().min(10)]
    );
}

#[test]
fn damaged_images_never_panic() {
    let base = seed_image();
    let mut seeds: Vec<u64> = std::fs::read_dir("fuzz/corpus/hostile")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                .filter_map(|s| s.split_whitespace().next()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let n = if std::env::var("BIRCHFS_LONG").is_ok() {
        3000
    } else {
        150
    };
    seeds.extend(1000..1000 + n);
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let failures: Vec<String> = seeds
        .iter()
        .filter_map(|&s| run_one(&base, s).err())
        .collect();
    std::panic::set_hook(prev);
    eprintln!(
        "hostile images: {} runs, {} panics",
        seeds.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{:#?}",
        &failures[..failures.len().min(10)]
    );
}
