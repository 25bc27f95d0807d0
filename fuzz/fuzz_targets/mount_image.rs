//! Mounting a damaged or hostile image: the input is a list of (offset, byte) patches
//! applied to a small valid image. Mount, walk, change and check must never panic.
#![no_main]

use std::sync::{Arc, OnceLock};

use birchfs::dev::MemDev;
use birchfs::{Creds, Fs, MkfsOptions, Options, ROOT_INO};
use libfuzzer_sys::fuzz_target;

fn base() -> &'static Vec<u8> {
    static IMG: OnceLock<Vec<u8>> = OnceLock::new();
    IMG.get_or_init(|| {
        let dev = Arc::new(MemDev::new(32 << 20));
        Fs::mkfs(dev.clone(), &MkfsOptions { node_size: Some(4096), ..Default::default() }).unwrap();
        let fs = Fs::open(dev.clone(), Options::default()).unwrap();
        for i in 0..40 {
            let f = fs.mknod(ROOT_INO, format!("f{i}").as_bytes(), 0o644, 0, Creds::default()).unwrap();
            fs.write(f.ino, 0, &vec![i as u8; 5000]).unwrap();
            if i % 10 == 0 {
                fs.fsync(f.ino, false).unwrap();
            }
        }
        let img = dev.image();
        drop(fs); // the image above is the crash state; this commit goes to `dev` only
        img
    })
}

fuzz_target!(|data: &[u8]| {
    let mut img = base().clone();
    // Patches land in the first 4 MiB: superblock, log area and the first tree nodes.
    for p in data.chunks_exact(4) {
        let off = (u32::from_le_bytes([p[0], p[1], p[2], 0]) as usize) % (4 << 20);
        img[off] ^= p[3];
    }
    let dev = Arc::new(MemDev::from_image(img));
    if let Ok(fs) = Fs::open(dev.clone(), Options::default()) {
        if let Ok(list) = fs.readdir(ROOT_INO, 0, 1000) {
            for e in list {
                let _ = fs.read(e.ino, 0, 8192);
                let _ = fs.write(e.ino, 10, b"x");
            }
        }
        let _ = fs.mknod(ROOT_INO, b"new", 0o644, 0, Creds::default());
        let _ = fs.commit();
    }
    let _ = birchfs::check::check(dev.as_ref());
});
