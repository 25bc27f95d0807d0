//! Model-based test: random operation sequences run against the library and against a
//! simple in-memory model; remounts and crashes (the disk as of the last flush) in
//! between. After a crash the filesystem must equal the model as of the last fsync;
//! at the end `check` must find the image clean.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use birchfs::dev::{CrashDev, MemDev};
use birchfs::{
    CacheOptions, Creds, Error, FallocMode, FileKind, Fs, MkfsOptions, Options, RenameFlags,
    SetAttr,
};
use proptest::prelude::*;

const DIRS: [&str; 3] = ["/", "/x/", "/y/"];
const NAMES: [&str; 4] = ["a", "b", "c", "d"];

#[derive(Debug, Clone)]
enum Op {
    Create(usize, usize),
    Mkdir(usize),
    Rmdir(usize),
    Write(usize, u32, u32, u8),
    Truncate(usize, u32),
    Punch(usize, u32, u32),
    /// fallocate: allocate (0, 1) or zero (2, 3), keeping the size (0, 2) or not.
    Falloc(usize, u32, u32, u8),
    Unlink(usize),
    Link(usize, usize, usize),
    Rename(usize, usize, usize),
    /// rename with RENAME_EXCHANGE of two names (the same one: nothing happens).
    Exchange(usize, usize),
    /// copy_file_range(src, dst, src offset, dst offset, len)
    Copy(usize, usize, u32, u32, u32),
    /// clone_range in whole blocks (src block, dst block, blocks; 0: to the end)
    Clone(usize, usize, u32, u32, u32),
    Fsync,
    Remount,
    Crash,
    /// Take snapshot `s{n}` (a sync point).
    Snapshot(usize),
    /// Delete snapshot `s{n}` (a sync point); with `true`, also drop it at once.
    DeleteSnapshot(usize, bool),
    /// FITRIM of the whole device (a sync point: it commits first).
    Trim,
}

fn op() -> impl Strategy<Value = Op> {
    let d = 0..DIRS.len();
    let n = 0..NAMES.len();
    let pick = 0..16usize;
    prop_oneof![
        3 => (d.clone(), n.clone()).prop_map(|(d, n)| Op::Create(d, n)),
        1 => (1..DIRS.len()).prop_map(Op::Mkdir),
        1 => (1..DIRS.len()).prop_map(Op::Rmdir),
        4 => (pick.clone(), 0..300_000u32, 1..70_000u32, any::<u8>()).prop_map(|(p, o, l, b)| Op::Write(p, o, l, b)),
        1 => (pick.clone(), 0..300_000u32).prop_map(|(p, s)| Op::Truncate(p, s)),
        1 => (pick.clone(), 0..300_000u32, 1..100_000u32).prop_map(|(p, o, l)| Op::Punch(p, o, l)),
        1 => (pick.clone(), 0..300_000u32, 1..100_000u32, 0..4u8)
            .prop_map(|(p, o, l, m)| Op::Falloc(p, o, l, m)),
        1 => pick.clone().prop_map(Op::Unlink),
        1 => (pick.clone(), d.clone(), n.clone()).prop_map(|(p, d, n)| Op::Link(p, d, n)),
        1 => (pick.clone(), d, n).prop_map(|(p, d, n)| Op::Rename(p, d, n)),
        1 => (pick.clone(), pick.clone()).prop_map(|(a, b)| Op::Exchange(a, b)),
        2 => (pick.clone(), pick.clone(), 0..300_000u32, 0..300_000u32, 1..200_000u32)
            .prop_map(|(a, b, s, d, l)| Op::Copy(a, b, s, d, l)),
        2 => (pick.clone(), pick, 0..75u32, 0..75u32, 0..50u32)
            .prop_map(|(a, b, s, d, l)| Op::Clone(a, b, s, d, l)),
        1 => Just(Op::Fsync),
        1 => Just(Op::Remount),
        1 => Just(Op::Crash),
        1 => (0..3usize).prop_map(Op::Snapshot),
        1 => (0..3usize, any::<bool>()).prop_map(|(n, d)| Op::DeleteSnapshot(n, d)),
        1 => Just(Op::Trim),
    ]
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Model {
    dirs: BTreeSet<String>,
    names: BTreeMap<String, u64>,
    files: BTreeMap<u64, Vec<u8>>,
    next: u64,
    /// Snapshots by name: the model as it was when each was taken.
    snaps: BTreeMap<String, Model>,
}

impl Model {
    fn new() -> Model {
        Model {
            dirs: ["/".to_string()].into(),
            ..Default::default()
        }
    }
    fn pick(&self, i: usize) -> Option<String> {
        let v: Vec<&String> = self.names.keys().collect();
        (!v.is_empty()).then(|| v[i % v.len()].clone())
    }
    fn dir_of(p: &str) -> &str {
        &p[..=p.rfind('/').unwrap()]
    }
    fn dir_empty(&self, d: &str) -> bool {
        !self.names.keys().any(|n| n.starts_with(d))
    }
    fn gc(&mut self) {
        let live: BTreeSet<u64> = self.names.values().copied().collect();
        self.files.retain(|id, _| live.contains(id));
    }
}

struct World {
    dev: Arc<CrashDev>,
    fs: Option<Fs>,
    opts: Options,
}

impl World {
    fn fs(&self) -> &Fs {
        self.fs.as_ref().unwrap()
    }
    fn ino(&self, path: &str) -> u64 {
        self.fs().resolve(path.trim_end_matches('/')).unwrap().ino
    }
    fn reopen(&mut self, image: Vec<u8>) {
        self.dev = Arc::new(CrashDev::new(image));
        self.fs =
            Some(Fs::open(self.dev.clone(), self.opts.clone()).expect("mount after remount/crash"));
    }
}

fn split(p: &str) -> (&str, &[u8]) {
    let i = p.rfind('/').unwrap();
    (&p[..=i], &p.as_bytes()[i + 1..])
}

fn apply(w: &mut World, m: &mut Model, durable: &mut Model, op: &Op) {
    let cr = Creds { uid: 0, gid: 0 };
    match op {
        Op::Create(d, n) => {
            let dir = DIRS[*d];
            let path = format!("{dir}{}", NAMES[*n]);
            if !m.dirs.contains(dir) {
                return;
            }
            let r = w.fs().mknod(w.ino(dir), NAMES[*n].as_bytes(), 0o644, 0, cr);
            if m.names.contains_key(&path) || m.dirs.contains(&format!("{path}/")) {
                assert!(matches!(r, Err(Error::Exists)), "{r:?}");
            } else {
                r.unwrap();
                m.next += 1;
                m.names.insert(path, m.next);
                m.files.insert(m.next, Vec::new());
            }
        }
        Op::Mkdir(d) => {
            let dir = DIRS[*d];
            let r = w
                .fs()
                .mkdir(w.ino("/"), &dir.as_bytes()[1..dir.len() - 1], 0o755, cr);
            if m.dirs.contains(dir) {
                assert!(matches!(r, Err(Error::Exists)), "{r:?}");
            } else {
                r.unwrap();
                m.dirs.insert(dir.to_string());
            }
        }
        Op::Rmdir(d) => {
            let dir = DIRS[*d];
            if !m.dirs.contains(dir) {
                return;
            }
            let r = w.fs().rmdir(w.ino("/"), &dir.as_bytes()[1..dir.len() - 1]);
            if m.dir_empty(dir) {
                r.unwrap();
                m.dirs.remove(dir);
            } else {
                assert!(matches!(r, Err(Error::NotEmpty)), "{r:?}");
            }
        }
        Op::Write(p, off, len, b) => {
            let Some(path) = m.pick(*p) else { return };
            let id = m.names[&path];
            let data = vec![*b; *len as usize];
            w.fs().write(w.ino(&path), *off as u64, &data).unwrap();
            let f = m.files.get_mut(&id).unwrap();
            let end = (*off + *len) as usize;
            if f.len() < end {
                f.resize(end, 0);
            }
            f[*off as usize..end].copy_from_slice(&data);
        }
        Op::Truncate(p, s) => {
            let Some(path) = m.pick(*p) else { return };
            let id = m.names[&path];
            w.fs()
                .setattr(
                    w.ino(&path),
                    &SetAttr {
                        size: Some(*s as u64),
                        ..Default::default()
                    },
                )
                .unwrap();
            m.files.get_mut(&id).unwrap().resize(*s as usize, 0);
        }
        Op::Punch(p, off, len) => {
            let Some(path) = m.pick(*p) else { return };
            let id = m.names[&path];
            let mode = FallocMode {
                keep_size: true,
                punch_hole: true,
                zero_range: false,
            };
            w.fs()
                .fallocate(w.ino(&path), *off as u64, *len as u64, mode)
                .unwrap();
            let f = m.files.get_mut(&id).unwrap();
            let s = (*off as usize).min(f.len());
            let e = ((*off + *len) as usize).min(f.len());
            f[s..e].fill(0);
        }
        Op::Falloc(p, off, len, how) => {
            let Some(path) = m.pick(*p) else { return };
            let id = m.names[&path];
            let mode = FallocMode {
                keep_size: how % 2 == 0,
                punch_hole: false,
                zero_range: *how >= 2,
            };
            w.fs()
                .fallocate(w.ino(&path), *off as u64, *len as u64, mode)
                .unwrap();
            let f = m.files.get_mut(&id).unwrap();
            let end = (*off + *len) as usize;
            if mode.zero_range {
                let s = (*off as usize).min(f.len());
                let e = end.min(f.len());
                f[s..e].fill(0);
            }
            if !mode.keep_size && end > f.len() {
                f.resize(end, 0);
            }
        }
        Op::Unlink(p) => {
            let Some(path) = m.pick(*p) else { return };
            let (dir, name) = split(&path);
            w.fs().unlink(w.ino(dir), name).unwrap();
            m.names.remove(&path);
            m.gc();
        }
        Op::Link(p, d, n) => {
            let Some(path) = m.pick(*p) else { return };
            let dir = DIRS[*d];
            if !m.dirs.contains(dir) {
                return;
            }
            let to = format!("{dir}{}", NAMES[*n]);
            let r = w.fs().link(w.ino(&path), w.ino(dir), NAMES[*n].as_bytes());
            if m.names.contains_key(&to) || m.dirs.contains(&format!("{to}/")) {
                assert!(matches!(r, Err(Error::Exists)), "{r:?}");
            } else {
                r.unwrap();
                let id = m.names[&path];
                m.names.insert(to, id);
            }
        }
        Op::Rename(p, d, n) => {
            let Some(path) = m.pick(*p) else { return };
            let dir = DIRS[*d];
            if !m.dirs.contains(dir) {
                return;
            }
            let to = format!("{dir}{}", NAMES[*n]);
            let (sd, sn) = split(&path);
            let r = w.fs().rename(
                w.ino(sd),
                sn,
                w.ino(dir),
                NAMES[*n].as_bytes(),
                RenameFlags::default(),
            );
            if m.dirs.contains(&format!("{to}/")) {
                assert!(matches!(r, Err(Error::IsDir)), "{r:?}");
            } else {
                r.unwrap();
                let id = m.names[&path];
                if m.names.get(&to) != Some(&id) {
                    m.names.remove(&path);
                    m.names.insert(to, id);
                    m.gc();
                }
            }
        }
        Op::Exchange(a, b) => {
            let (Some(pa), Some(pb)) = (m.pick(*a), m.pick(*b)) else {
                return;
            };
            let ((da, na), (db, nb)) = (split(&pa), split(&pb));
            let flags = RenameFlags {
                exchange: true,
                ..Default::default()
            };
            w.fs()
                .rename(w.ino(da), na, w.ino(db), nb, flags)
                .unwrap_or_else(|e| panic!("exchange {pa} {pb}: {e}"));
            let (ia, ib) = (m.names[&pa], m.names[&pb]);
            m.names.insert(pa, ib);
            m.names.insert(pb, ia);
        }
        Op::Copy(a, b, soff, doff, len) | Op::Clone(a, b, soff, doff, len) => {
            let clone = matches!(op, Op::Clone(..));
            let (Some(sp), Some(dp)) = (m.pick(*a), m.pick(*b)) else {
                return;
            };
            let (sid, did) = (m.names[&sp], m.names[&dp]);
            let (soff, doff, len) = if clone {
                (
                    *soff as usize * 4096,
                    *doff as usize * 4096,
                    *len as usize * 4096,
                )
            } else {
                (*soff as usize, *doff as usize, *len as usize)
            };
            let (si, di) = (w.ino(&sp), w.ino(&dp));
            let r = if clone {
                w.fs()
                    .clone_range(si, soff as u64, di, doff as u64, len as u64)
            } else {
                w.fs()
                    .copy_file_range(si, soff as u64, di, doff as u64, len as u64)
            };
            let src = m.files[&sid].clone();
            if soff >= src.len() {
                assert_eq!(r.unwrap(), 0, "from past the end");
                return;
            }
            let n = if len == 0 {
                src.len() - soff
            } else {
                len.min(src.len() - soff)
            };
            if sid == did && soff < doff + n && doff < soff + n {
                assert!(matches!(r, Err(Error::Invalid(_))), "{r:?}");
                return;
            }
            assert_eq!(r.unwrap(), n as u64);
            let f = m.files.get_mut(&did).unwrap();
            if f.len() < doff + n {
                f.resize(doff + n, 0);
            }
            f[doff..doff + n].copy_from_slice(&src[soff..soff + n]);
        }
        Op::Fsync => {
            // A full sync; per-file fsync through the log is what tests/crash.rs proves.
            w.fs().commit().unwrap();
            *durable = m.clone();
        }
        Op::Trim => {
            w.fs().trim(0, u64::MAX, 0).unwrap();
            *durable = m.clone();
        }
        Op::Remount => {
            w.fs.take().unwrap().unmount().unwrap();
            let img = w.dev.live_image();
            w.reopen(img);
            *durable = m.clone();
        }
        Op::Snapshot(n) => {
            let name = format!("s{n}");
            let r = w.fs().snapshot_create(name.as_bytes());
            if m.snaps.contains_key(&name) {
                assert!(matches!(r, Err(Error::Exists)), "{r:?}");
                return;
            }
            r.unwrap();
            let frozen = Model {
                snaps: BTreeMap::new(),
                ..m.clone()
            };
            m.snaps.insert(name, frozen);
            *durable = m.clone();
        }
        Op::DeleteSnapshot(n, drop_now) => {
            let name = format!("s{n}");
            let r = w.fs().snapshot_delete(name.as_bytes());
            if m.snaps.remove(&name).is_none() {
                assert!(matches!(r, Err(Error::NotFound)), "{r:?}");
                return;
            }
            r.unwrap();
            if *drop_now {
                while w.fs().drop_deleted(1).unwrap() {}
            }
            *durable = m.clone();
        }
        Op::Crash => {
            let last = w.dev.flush_points().last().copied().unwrap_or(0);
            let img = w.dev.image_with(last, &[]);
            // The old instance must not write to the new device; it may commit to the old.
            drop(w.fs.take());
            w.reopen(img);
            *m = durable.clone();
        }
    }
}

fn compare(w: &World, m: &Model) {
    compare_at(w, "", m);
    let fs = w.fs();
    let mut names = BTreeSet::new();
    for e in fs.readdir(birchfs::SNAPSHOTS_INO, 0, 100).unwrap() {
        names.insert(String::from_utf8(e.name).unwrap());
    }
    names.remove(".");
    names.remove("..");
    let want: BTreeSet<String> = m.snaps.keys().cloned().collect();
    assert_eq!(names, want, "snapshots");
    for (name, snap) in &m.snaps {
        compare_at(w, &format!("/.snapshots/{name}"), snap);
    }
}

/// Compares the tree under `prefix` ("" for the live tree) with `m`.
fn compare_at(w: &World, prefix: &str, m: &Model) {
    let fs = w.fs();
    let resolve = |p: &str| fs.resolve(&format!("{prefix}{}", p.trim_end_matches('/')));
    for d in ["/x/", "/y/"] {
        let exists = resolve(d).is_ok();
        assert_eq!(exists, m.dirs.contains(d), "dir {prefix}{d}");
    }
    for dir in &m.dirs {
        let ino = resolve(dir).unwrap().ino;
        let mut names: BTreeSet<String> = BTreeSet::new();
        let mut off = 0;
        loop {
            let b = fs.readdir(ino, off, 7).unwrap();
            if b.is_empty() {
                break;
            }
            off = b.last().unwrap().next_offset;
            for e in b {
                let n = String::from_utf8(e.name).unwrap();
                if n != "." && n != ".." && e.kind != FileKind::Dir {
                    names.insert(format!("{dir}{n}"));
                }
            }
        }
        let want: BTreeSet<String> = m
            .names
            .keys()
            .filter(|p| Model::dir_of(p) == dir)
            .cloned()
            .collect();
        assert_eq!(names, want, "entries of {prefix}{dir}");
    }
    let mut inos = BTreeMap::new();
    for (path, id) in &m.names {
        let a = resolve(path).unwrap();
        let data = &m.files[id];
        assert_eq!(a.size, data.len() as u64, "size of {path}");
        let nlink = m.names.values().filter(|x| *x == id).count() as u32;
        assert_eq!(a.nlink, nlink, "nlink of {path}");
        let got = fs.read(a.ino, 0, data.len() as u32 + 10).unwrap();
        assert!(got == *data, "content of {path}");
        if let Some(prev) = inos.insert(*id, a.ino) {
            assert_eq!(prev, a.ino, "hard links of {path} share an inode");
        }
    }
}

fn run(ops: &[Op]) {
    run_with(ops, Options::default())
}

/// Options whose page cache holds 16 folios of 16 KiB: the model's files (up to
/// 370 KB) do not fit, so writes and reads go through eviction and writeback.
fn tiny_cache(block_dirty: bool) -> Options {
    Options {
        cache: CacheOptions {
            cache_size: 256 << 10,
            folio_size: 16 << 10,
            block_dirty,
            ..CacheOptions::default()
        },
        ..Options::default()
    }
}

fn run_with(ops: &[Op], opts: Options) {
    let base = Arc::new(MemDev::new(40 << 20));
    Fs::mkfs(
        base.clone(),
        &MkfsOptions {
            node_size: Some(4096),
            ..Default::default()
        },
    )
    .unwrap();
    let mut w = World {
        dev: Arc::new(CrashDev::new(base.image())),
        fs: None,
        opts,
    };
    w.reopen(w.dev.live_image());
    let mut m = Model::new();
    let mut durable = Model::new();
    for op in ops {
        apply(&mut w, &mut m, &mut durable, op);
        if matches!(op, Op::Crash | Op::Remount | Op::Fsync | Op::Trim) {
            compare(&w, &m);
        }
    }
    compare(&w, &m);
    w.fs.take().unwrap().unmount().unwrap();
    let rep = birchfs::check::check(&MemDev::from_image(w.dev.live_image())).unwrap();
    assert!(rep.problems.is_empty(), "check: {:#?}", rep.problems);
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]
    #[test]
    fn library_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(&ops);
    }

    /// Also with online discard of every run a commit frees, half the time.
    #[test]
    fn library_matches_model_through_a_tiny_cache(
        ops in proptest::collection::vec(op(), 1..80),
        block_dirty in any::<bool>(),
        discard in any::<bool>(),
    ) {
        let opts = Options {
            discard: discard.then_some(4096),
            ..tiny_cache(block_dirty)
        };
        run_with(&ops, opts);
    }
}

#[test]
fn crash_after_fsync_keeps_everything_fsynced() {
    use Op::*;
    run(&[
        Create(0, 0),
        Write(0, 0, 5000, 1),
        Fsync,
        Write(0, 100, 10, 2),
        Create(0, 1),
        Crash,
        Write(0, 0, 1, 3),
        Remount,
    ]);
}
