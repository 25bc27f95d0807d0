//! Operation sequences against the library and a model of file contents: every byte
//! triple is one operation; the filesystem must agree with the model and stay clean.
#![no_main]

use std::collections::BTreeMap;
use std::sync::Arc;

use birchfs::dev::MemDev;
use birchfs::{Creds, FallocMode, Fs, MkfsOptions, Options, SetAttr, ROOT_INO};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dev = Arc::new(MemDev::new(32 << 20));
    Fs::mkfs(dev.clone(), &MkfsOptions { node_size: Some(4096), ..Default::default() }).unwrap();
    // A first byte with its top bit set: online discard of every run a commit frees.
    let discard = data.first().is_some_and(|b| b & 0x80 != 0).then_some(4096);
    let opts = Options { discard, ..Options::default() };
    let mut fs = Fs::open(dev.clone(), opts.clone()).unwrap();
    let mut model: BTreeMap<u8, Vec<u8>> = BTreeMap::new();
    for op in data.chunks_exact(3) {
        let name = [b'a' + op[1] % 6];
        let ino = fs.lookup(ROOT_INO, &name).ok().map(|a| a.ino);
        let off = op[2] as usize * 997;
        match (op[0] % 8, ino) {
            (0, None) => {
                fs.mknod(ROOT_INO, &name, 0o644, 0, Creds::default()).unwrap();
                model.insert(name[0], Vec::new());
            }
            (1, Some(i)) => {
                let d = vec![op[2]; 1 + op[2] as usize * 40];
                fs.write(i, off as u64, &d).unwrap();
                let m = model.get_mut(&name[0]).unwrap();
                if m.len() < off + d.len() {
                    m.resize(off + d.len(), 0);
                }
                m[off..off + d.len()].copy_from_slice(&d);
            }
            (2, Some(i)) => {
                fs.setattr(i, &SetAttr { size: Some(off as u64), ..Default::default() }).unwrap();
                model.get_mut(&name[0]).unwrap().resize(off, 0);
            }
            (3, Some(_)) => {
                fs.unlink(ROOT_INO, &name).unwrap();
                model.remove(&name[0]);
            }
            (4, Some(i)) => {
                let len = 1 + op[2] as u64 * 300;
                fs.fallocate(i, off as u64 / 2, len, FallocMode { keep_size: true, punch_hole: true, zero_range: false }).unwrap();
                let m = model.get_mut(&name[0]).unwrap();
                let s = (off / 2).min(m.len());
                let e = (off / 2 + len as usize).min(m.len());
                m[s..e].fill(0);
            }
            (7, Some(i)) => {
                // Allocate or zero, keeping the size or not.
                let how = op[1] / 6 % 4;
                let mode = FallocMode { keep_size: how % 2 == 0, punch_hole: false, zero_range: how >= 2 };
                let len = 1 + op[2] as usize * 300;
                fs.fallocate(i, off as u64 / 2, len as u64, mode).unwrap();
                let m = model.get_mut(&name[0]).unwrap();
                let end = off / 2 + len;
                if mode.zero_range {
                    let n = m.len();
                    m[(off / 2).min(n)..end.min(n)].fill(0);
                }
                if !mode.keep_size && m.len() < end {
                    m.resize(end, 0);
                }
            }
            (5, Some(i)) => fs.fsync(i, false).unwrap(),
            (6, _) => {
                // Now and then a trim first: the remount reads back from the device.
                if op[2] & 1 == 1 {
                    fs.trim(0, u64::MAX, 0).unwrap();
                }
                fs.unmount().unwrap();
                fs = Fs::open(dev.clone(), opts.clone()).unwrap();
            }
            _ => {}
        }
    }
    for (n, want) in &model {
        let a = fs.lookup(ROOT_INO, &[*n]).unwrap();
        assert_eq!(&fs.read(a.ino, 0, want.len() as u32 + 1).unwrap(), want);
    }
    fs.unmount().unwrap();
    let rep = birchfs::check::check(dev.as_ref()).unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);
});
