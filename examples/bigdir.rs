//! Creates N entries in one directory through the library and prints the create rate
//! per block of 100,000, then the time to list them all: the rate should stay flat
//! (entries are indexed by name hash; readdir walks a sequence index).
//!
//! Run: `cargo run --release --example bigdir -- /var/tmp/bigdir.img 1000000`

use std::sync::Arc;
use std::time::Instant;

use birchfs::dev::FileDev;
use birchfs::{Creds, Fs, MkfsOptions, Options, ROOT_INO};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| "/var/tmp/bigdir.img".into());
    let n: u64 = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1_000_000);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)?;
    f.set_len(8 << 30)?;
    drop(f);
    Fs::mkfs(
        Arc::new(FileDev::open(path.as_ref(), true)?),
        &MkfsOptions::default(),
    )?;
    let fs = Fs::open_path(path.as_ref(), Options::default())?;
    let d = fs.mkdir(ROOT_INO, b"big", 0o755, Creds::default())?;
    let block = 100_000.min(n);
    let mut t = Instant::now();
    for i in 0..n {
        fs.mknod(
            d.ino,
            format!("entry-{i:08}").as_bytes(),
            0o644,
            0,
            Creds::default(),
        )?;
        if (i + 1) % block == 0 {
            println!(
                "{:>8} entries: {:>8.0} creates/s",
                i + 1,
                block as f64 / t.elapsed().as_secs_f64()
            );
            t = Instant::now();
        }
    }
    fs.commit()?;
    let t = Instant::now();
    let (mut off, mut count) = (0, 0u64);
    loop {
        let b = fs.readdir(d.ino, off, 4096)?;
        let Some(last) = b.last() else { break };
        off = last.next_offset;
        count += b.len() as u64;
    }
    println!(
        "readdir of {count} entries (with . and ..): {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    for i in (0..n).step_by(997) {
        fs.lookup(d.ino, format!("entry-{i:08}").as_bytes())?;
    }
    println!(
        "lookups: {:.1} µs each",
        t.elapsed().as_secs_f64() * 1e6 / (n / 997 + 1) as f64
    );
    fs.unmount()?;
    std::fs::remove_file(&path)?;
    Ok(())
}
