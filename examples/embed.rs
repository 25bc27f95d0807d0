//! Embeds birchfs without FUSE: makes an image, writes a file, commits, reopens and
//! reads it back.
//!
//! Run: `cargo run --example embed -- /tmp/demo.img`

use std::sync::Arc;

use birchfs::dev::FileDev;
use birchfs::{Creds, Fs, MkfsOptions, Options, ROOT_INO};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "/tmp/birchfs-demo.img".into());
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)?;
    file.set_len(256 << 20)?;
    drop(file);

    Fs::mkfs(
        Arc::new(FileDev::open(path.as_ref(), true)?),
        &MkfsOptions::default(),
    )?;
    let fs = Fs::open_path(path.as_ref(), Options::default())?;
    let me = Creds {
        uid: 1000,
        gid: 1000,
    };
    let dir = fs.mkdir(ROOT_INO, b"notes", 0o755, me)?;
    let f = fs.mknod(dir.ino, b"today.txt", 0o644, 0, me)?;
    fs.write(f.ino, 0, b"birchfs keeps what was fsynced\n")?;
    fs.fsync(f.ino, false)?;
    fs.unmount()?;

    let fs = Fs::open_path(path.as_ref(), Options::default())?;
    let f = fs.resolve("/notes/today.txt")?;
    let data = fs.read(f.ino, 0, f.size as u32)?;
    print!("{}", String::from_utf8_lossy(&data));
    for e in fs.readdir(dir.ino, 0, 100)? {
        println!("{:?} {}", e.kind, String::from_utf8_lossy(&e.name));
    }
    Ok(())
}
