//! Power-cut tests: run a workload on the crash-recording device, rebuild every image a
//! power cut could leave (each flush point; for the writes between two flushes, in-order
//! prefixes, random subsets and torn multi-block writes), and for each image: check it,
//! mount it, and compare with what had been fsynced.
//!
//! The oracle: after fsync(file) returned, the file's data and attributes as of that
//! fsync (or any later version of them) and the name it was fsynced under survive;
//! once a later operation moved that name, some name the file had since still reaches
//! it with such data (after fdatasync, which keeps no names, any name it had), unless
//! a later operation removed its last name. After fsync(dir) returned, its entries
//! survive, and the names it no longer had stay gone (unless later operations changed
//! them again), wherever later renames took the directory.

use std::collections::BTreeMap;
use std::sync::Arc;

use birchfs::dev::{CrashDev, CrashOp, MemDev};
use birchfs::{
    Attr, Creds, FallocMode, FileKind, Fs, MkfsOptions, Options, RenameFlags, SetAttr, ROOT_INO,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
enum Op {
    Create(String),
    Mkdir(String),
    Write(String, u64, usize, u8),
    Truncate(String, u64),
    /// A file rewritten in place: open(O_TRUNC), a write of this many bytes of this
    /// value from the start, close.
    Rewrite(String, usize, u8),
    Punch(String, u64, u64),
    Falloc(String, u64, u64, bool),
    /// fallocate ZERO_RANGE (keep size if true).
    Zero(String, u64, u64, bool),
    Link(String, String),
    Unlink(String),
    Rmdir(String),
    /// rename(2) of a file, symlink or directory, onto a free name or one of its kind
    /// (a directory only onto an empty one).
    Rename(String, String),
    /// rename(2) with RENAME_EXCHANGE: the two names (and what is below them) swap.
    Exchange(String, String),
    /// A symlink at the first path pointing to the second.
    Symlink(String, String),
    SetXattr(String, &'static str, Value),
    RemoveXattr(String, &'static str),
    Chmod(String, u32),
    /// Sets the inode flags (`chattr`); the sequence keeps away from what they forbid.
    Chattr(String, u32),
    Fsync(String),
    Fdatasync(String),
    /// clone_range of the whole first file over the start of the second.
    Clone(String, String),
    Sync,
    /// Take a snapshot of this name.
    Snapshot(&'static str),
    /// Delete the snapshot and drop it at once.
    DeleteSnapshot(&'static str),
    /// FITRIM of the whole device: its discards are writes a power cut may or may not
    /// have let through.
    Trim,
    /// The host under the image fills up (`true`: every write past the log area fails
    /// with ENOSPC, as into the holes of a sparse image) or has room again (`false`).
    /// While it is full, fsyncs and syncs may fail, and then promise nothing.
    NoRoom(bool),
}

/// An xattr value; it prints as `[b; n]` when all its bytes are `b` (as the
/// generated ones are), so that a failing sequence stays readable.
#[derive(Clone, PartialEq)]
struct Value(Vec<u8>);

impl std::fmt::Debug for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.first() {
            Some(b) if self.0.iter().all(|x| x == b) => write!(f, "[{b}; {}]", self.0.len()),
            _ => write!(f, "{:?}", self.0),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Node {
    dir: bool,
    /// A symlink (its target is `data`).
    symlink: bool,
    data: Vec<u8>,
    mode: u32,
    xattrs: BTreeMap<String, Vec<u8>>,
    /// Inode flags (`chattr`).
    flags: u32,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Model {
    names: BTreeMap<String, u64>,
    nodes: BTreeMap<u64, Node>,
    next: u64,
    /// Snapshots: the model as each was taken.
    snaps: BTreeMap<&'static str, Model>,
}

impl Model {
    fn new() -> Model {
        let mut m = Model::default();
        m.nodes.insert(
            0,
            Node {
                dir: true,
                symlink: false,
                data: vec![],
                mode: 0o755,
                xattrs: BTreeMap::new(),
                flags: 0,
            },
        );
        m.names.insert("/".into(), 0);
        m
    }
    fn parent(p: &str) -> String {
        match p.rfind('/') {
            Some(0) => "/".into(),
            Some(i) => p[..i].into(),
            None => "/".into(),
        }
    }
    fn children(&self, dir: &str) -> BTreeMap<String, u64> {
        self.names
            .iter()
            .filter(|(p, _)| *p != "/" && Model::parent(p) == dir)
            .map(|(p, id)| (p.rsplit('/').next().unwrap().to_string(), *id))
            .collect()
    }
    fn is_dir(&self, p: &str) -> bool {
        self.names.get(p).is_some_and(|id| self.nodes[id].dir)
    }
    fn is_file(&self, p: &str) -> bool {
        self.names
            .get(p)
            .is_some_and(|id| !self.nodes[id].dir && !self.nodes[id].symlink)
    }
    /// The names `id` has.
    fn names_of(&self, id: u64) -> impl Iterator<Item = &String> {
        self.names
            .iter()
            .filter(move |(_, v)| **v == id)
            .map(|(k, _)| k)
    }
    /// Whether `p` is strictly below `dir`.
    fn under(dir: &str, p: &str) -> bool {
        p.len() > dir.len() && p.starts_with(dir) && p.as_bytes()[dir.len()] == b'/'
    }
    /// Takes `p` and every name below it out of the namespace: (path below `p`, id).
    fn take_tree(&mut self, p: &str) -> Vec<(String, u64)> {
        let moved: Vec<(String, u64)> = self
            .names
            .iter()
            .filter(|(q, _)| *q == p || Model::under(p, q))
            .map(|(q, id)| (q[p.len()..].to_string(), *id))
            .collect();
        for (rest, _) in &moved {
            self.names.remove(&format!("{p}{rest}"));
        }
        moved
    }
    /// Puts a tree taken by `take_tree` back at `p`.
    fn put_tree(&mut self, p: &str, tree: Vec<(String, u64)>) {
        for (rest, id) in tree {
            self.names.insert(format!("{p}{rest}"), id);
        }
    }
    /// Whether `op` is valid in this state (generated workloads skip the others).
    fn valid(&self, op: &Op) -> bool {
        let free = |p: &String| !self.names.contains_key(p) && self.is_dir(&Model::parent(p));
        match op {
            Op::Create(p) | Op::Mkdir(p) => free(p),
            Op::Write(p, ..)
            | Op::Truncate(p, _)
            | Op::Rewrite(p, ..)
            | Op::Punch(p, ..)
            | Op::Falloc(p, ..)
            | Op::Zero(p, ..) => self.is_file(p),
            Op::Link(a, b) => self.is_file(a) && free(b),
            Op::Clone(a, b) => self.is_file(a) && self.is_file(b) && self.names[a] != self.names[b],
            Op::Unlink(p) => self.names.contains_key(p) && !self.is_dir(p),
            Op::Rmdir(p) => p != "/" && self.is_dir(p) && self.children(p).is_empty(),
            Op::Rename(a, b) | Op::Exchange(a, b) => {
                let exists = |p: &String| p != "/" && self.names.contains_key(p);
                if !exists(a) || a == b || Model::under(a, b) {
                    return false;
                }
                if matches!(op, Op::Exchange(..)) {
                    return exists(b) && !Model::under(b, a);
                }
                free(b)
                    || exists(b)
                        && !Model::under(b, a)
                        && self.is_dir(a) == self.is_dir(b)
                        && (!self.is_dir(b) || self.children(b).is_empty())
            }
            Op::Symlink(p, _) => free(p),
            // (Symlinks: chmod and open follow them, and Linux refuses user xattrs.)
            Op::SetXattr(p, ..)
            | Op::Chmod(p, _)
            | Op::Chattr(p, _)
            | Op::Fsync(p)
            | Op::Fdatasync(p) => self.names.get(p).is_some_and(|id| !self.nodes[id].symlink),
            Op::RemoveXattr(p, n) => self
                .names
                .get(p)
                .is_some_and(|id| self.nodes[id].xattrs.contains_key(*n)),
            Op::Sync | Op::Trim | Op::NoRoom(_) => true,
            Op::Snapshot(n) => !self.snaps.contains_key(n),
            Op::DeleteSnapshot(n) => self.snaps.contains_key(n),
        }
    }
    fn apply(&mut self, op: &Op) {
        let new = |m: &mut Model, p: &str, dir: bool| {
            m.next += 1;
            let mode = if dir { 0o755 } else { 0o644 };
            m.nodes.insert(
                m.next,
                Node {
                    dir,
                    symlink: false,
                    data: vec![],
                    mode,
                    xattrs: BTreeMap::new(),
                    flags: 0,
                },
            );
            m.names.insert(p.to_string(), m.next);
        };
        match op {
            Op::Create(p) => new(self, p, false),
            Op::Mkdir(p) => new(self, p, true),
            Op::Symlink(p, t) => {
                new(self, p, false);
                let n = self.nodes.get_mut(&self.next).unwrap();
                n.symlink = true;
                n.mode = 0o777;
                n.data = t.as_bytes().to_vec();
            }
            Op::Write(p, off, len, b) => {
                let d = &mut self.nodes.get_mut(&self.names[p]).unwrap().data;
                let end = *off as usize + len;
                if d.len() < end {
                    d.resize(end, 0);
                }
                d[*off as usize..end].fill(*b);
            }
            Op::Truncate(p, s) => self
                .nodes
                .get_mut(&self.names[p])
                .unwrap()
                .data
                .resize(*s as usize, 0),
            Op::Rewrite(p, len, b) => {
                self.nodes.get_mut(&self.names[p]).unwrap().data = vec![*b; *len];
            }
            Op::Punch(p, off, len) => {
                let d = &mut self.nodes.get_mut(&self.names[p]).unwrap().data;
                let s = (*off as usize).min(d.len());
                let e = ((off + len) as usize).min(d.len());
                d[s..e].fill(0);
            }
            Op::Falloc(p, off, len, keep) => {
                let d = &mut self.nodes.get_mut(&self.names[p]).unwrap().data;
                if !keep && d.len() < (off + len) as usize {
                    d.resize((off + len) as usize, 0);
                }
            }
            Op::Zero(p, off, len, keep) => {
                let d = &mut self.nodes.get_mut(&self.names[p]).unwrap().data;
                let (s, e) = (*off as usize, (off + len) as usize);
                let n = d.len();
                d[s.min(n)..e.min(n)].fill(0);
                if !keep && n < e {
                    d.resize(e, 0);
                }
            }
            Op::Link(a, b) => {
                let id = self.names[a];
                self.names.insert(b.clone(), id);
            }
            Op::Clone(a, b) => {
                let src = self.nodes[&self.names[a]].data.clone();
                let d = &mut self.nodes.get_mut(&self.names[b]).unwrap().data;
                if d.len() < src.len() {
                    d.resize(src.len(), 0);
                }
                d[..src.len()].copy_from_slice(&src);
            }
            Op::Unlink(p) | Op::Rmdir(p) => {
                self.names.remove(p);
            }
            // Onto another link of the same file, rename does nothing (POSIX).
            Op::Rename(a, b) if self.names.get(b) == self.names.get(a) => {}
            Op::Rename(a, b) => {
                self.names.remove(b);
                let tree = self.take_tree(a);
                self.put_tree(b, tree);
            }
            Op::Exchange(a, b) if self.names.get(b) == self.names.get(a) => {}
            Op::Exchange(a, b) => {
                let ta = self.take_tree(a);
                let tb = self.take_tree(b);
                self.put_tree(b, ta);
                self.put_tree(a, tb);
            }
            Op::SetXattr(p, n, v) => {
                self.nodes
                    .get_mut(&self.names[p])
                    .unwrap()
                    .xattrs
                    .insert(n.to_string(), v.0.clone());
            }
            Op::RemoveXattr(p, n) => {
                self.nodes
                    .get_mut(&self.names[p])
                    .unwrap()
                    .xattrs
                    .remove(*n);
            }
            Op::Chmod(p, m) => self.nodes.get_mut(&self.names[p]).unwrap().mode = *m,
            Op::Chattr(p, f) => self.nodes.get_mut(&self.names[p]).unwrap().flags = *f,
            Op::Fsync(_) | Op::Fdatasync(_) | Op::Sync | Op::Trim | Op::NoRoom(_) => {}
            Op::Snapshot(n) => {
                let frozen = Model {
                    snaps: BTreeMap::new(),
                    ..self.clone()
                };
                self.snaps.insert(n, frozen);
            }
            Op::DeleteSnapshot(n) => {
                self.snaps.remove(n);
            }
        }
        let live: std::collections::BTreeSet<u64> = self.names.values().copied().collect();
        self.nodes.retain(|id, _| live.contains(id));
    }
}

#[derive(Debug)]
enum Promise {
    File {
        id: u64,
        /// Its inode number (never reused), to tell it from another file at `path`.
        ino: u64,
        path: String,
        data_only: bool,
    },
    Dir {
        id: u64,
        /// Its inode number, to find it wherever later operations moved it.
        ino: u64,
        path: String,
    },
    /// A snapshot taken or deleted: (un)done for good once the call returned.
    Snapshot { name: &'static str },
    /// A file renamed over another file (with room on the host): wherever a crash
    /// keeps the rename, the file holds its data as of the rename or later, never
    /// older data (ext4's `auto_da_alloc`: replacing a file by writing a new one and
    /// renaming it over the old without fsync leaves one of the two whole).
    Replaced { id: u64, ino: u64, path: String },
}

struct Run {
    ops: Vec<Op>,
    /// Model after each op (index i: after ops[..=i]).
    history: Vec<Model>,
    /// (device op count when the fsync returned, op index, what it promised)
    promises: Vec<(usize, usize, Promise)>,
}

fn split(p: &str) -> (String, &[u8]) {
    (Model::parent(p), p.rsplit('/').next().unwrap().as_bytes())
}

fn exec(fs: &Fs, op: &Op) {
    let cr = Creds::default();
    let ino = |p: &str| {
        fs.resolve(p)
            .unwrap_or_else(|e| panic!("resolve {p}: {e}"))
            .ino
    };
    match op {
        Op::Create(p) => {
            let (d, n) = split(p);
            fs.mknod(ino(&d), n, 0o644, 0, cr).unwrap();
        }
        Op::Mkdir(p) => {
            let (d, n) = split(p);
            fs.mkdir(ino(&d), n, 0o755, cr).unwrap();
        }
        Op::Write(p, off, len, b) => {
            fs.write(ino(p), *off, &vec![*b; *len]).unwrap();
        }
        Op::Truncate(p, s) => {
            fs.setattr(
                ino(p),
                &SetAttr {
                    size: Some(*s),
                    ..Default::default()
                },
            )
            .unwrap();
        }
        Op::Rewrite(p, len, b) => {
            let f = ino(p);
            fs.open_ino(f).unwrap();
            exec(fs, &Op::Truncate(p.clone(), 0));
            exec(fs, &Op::Write(p.clone(), 0, *len, *b));
            fs.release(f).unwrap();
        }
        Op::Punch(p, off, len) => {
            fs.fallocate(
                ino(p),
                *off,
                *len,
                FallocMode {
                    keep_size: true,
                    punch_hole: true,
                    zero_range: false,
                },
            )
            .unwrap();
        }
        Op::Falloc(p, off, len, keep) | Op::Zero(p, off, len, keep) => {
            fs.fallocate(
                ino(p),
                *off,
                *len,
                FallocMode {
                    keep_size: *keep,
                    punch_hole: false,
                    zero_range: matches!(op, Op::Zero(..)),
                },
            )
            .unwrap();
        }
        Op::Link(a, b) => {
            let (d, n) = split(b);
            fs.link(ino(a), ino(&d), n).unwrap();
        }
        Op::Clone(a, b) => {
            fs.clone_range(ino(a), 0, ino(b), 0, 0).unwrap();
        }
        Op::Unlink(p) => {
            let (d, n) = split(p);
            fs.unlink(ino(&d), n).unwrap();
        }
        Op::Rmdir(p) => {
            let (d, n) = split(p);
            fs.rmdir(ino(&d), n).unwrap();
        }
        Op::Rename(a, b) | Op::Exchange(a, b) => {
            let (da, na) = split(a);
            let (db, nb) = split(b);
            let flags = RenameFlags {
                exchange: matches!(op, Op::Exchange(..)),
                ..Default::default()
            };
            fs.rename(ino(&da), na, ino(&db), nb, flags)
                .unwrap_or_else(|e| panic!("{op:?}: {e}"));
        }
        Op::Symlink(p, t) => {
            let (d, n) = split(p);
            fs.symlink(ino(&d), n, t.as_bytes(), cr).unwrap();
        }
        Op::SetXattr(p, n, v) => fs
            .setxattr(ino(p), n.as_bytes(), &v.0, false, false)
            .unwrap(),
        Op::RemoveXattr(p, n) => fs.removexattr(ino(p), n.as_bytes()).unwrap(),
        Op::Chmod(p, m) => {
            fs.setattr(
                ino(p),
                &SetAttr {
                    mode: Some(*m),
                    ..Default::default()
                },
            )
            .unwrap();
        }
        Op::Chattr(p, f) => {
            fs.set_flags(ino(p), *f).unwrap();
        }
        Op::Fsync(_) | Op::Fdatasync(_) | Op::Sync | Op::Trim => {
            sync(fs, op).unwrap_or_else(|e| panic!("{op:?}: {e}"))
        }
        Op::NoRoom(_) => {}
        Op::Snapshot(n) => {
            fs.snapshot_create(n.as_bytes()).unwrap();
        }
        Op::DeleteSnapshot(n) => {
            fs.snapshot_delete(n.as_bytes()).unwrap();
            while fs.drop_deleted(usize::MAX).unwrap() {}
        }
    }
}

fn base_image() -> Vec<u8> {
    let dev = Arc::new(MemDev::new(32 << 20));
    Fs::mkfs(
        dev.clone(),
        &MkfsOptions {
            node_size: Some(4096),
            // The smallest log, so that the tests' fsyncs wrap around it.
            log_size: Some(1 << 20),
            ..Default::default()
        },
    )
    .unwrap();
    dev.image()
}

/// Runs an fsync, fdatasync, sync or trim `op`, which may fail while the host is full.
fn sync(fs: &Fs, op: &Op) -> birchfs::Result<()> {
    let ino = |p: &str| fs.resolve(p).map(|a| a.ino);
    match op {
        Op::Fsync(p) => fs.fsync(ino(p)?, false),
        Op::Fdatasync(p) => fs.fsync(ino(p)?, true),
        Op::Sync => fs.commit(),
        Op::Trim => fs.trim(0, u64::MAX, 0).map(|_| ()),
        _ => unreachable!("not a sync: {op:?}"),
    }
}

/// Where the log area of `image` ends: writes past it go into holes of a sparse image.
fn past_log(image: &[u8]) -> u64 {
    let at = birchfs::format::SUPER_OFFSETS[0];
    let sb = birchfs::format::Superblock::decode(
        &image[at as usize..at as usize + birchfs::format::SUPER_SIZE],
        at,
    )
    .unwrap();
    sb.log_start + sb.log_len
}

/// Runs `ops` on a crash-recording device, with online discard of freed runs of at
/// least `discard` bytes when given (the discards are recorded as writes, which a
/// power cut may or may not let through); returns the device and the record.
fn record_with(base: &[u8], ops: Vec<Op>, discard: Option<u64>) -> (Arc<CrashDev>, Run) {
    let dev = Arc::new(CrashDev::new(base.to_vec()));
    let fs = Fs::open(
        dev.clone(),
        Options {
            commit_interval: std::time::Duration::ZERO,
            discard,
            ..Default::default()
        },
    )
    .unwrap();
    let mut m = Model::new();
    let mut run = Run {
        ops: ops.clone(),
        history: Vec::new(),
        promises: Vec::new(),
    };
    let mut full = false;
    let mut synced_while_full = false;
    for (i, op) in ops.iter().enumerate() {
        let replaced = (!full).then(|| replace_promise(&fs, &m, op)).flatten();
        // Whether the op did what it promises (a failed sync promises nothing).
        let done = match op {
            Op::NoRoom(on) => {
                full = *on;
                dev.refuse_writes_from(on.then(|| past_log(base)));
                true
            }
            Op::Fsync(_) | Op::Fdatasync(_) | Op::Sync | Op::Trim if full => {
                synced_while_full |= matches!(op, Op::Sync);
                sync(&fs, op)
                    .inspect_err(|e| {
                        // For want of room, never a failure that would stop all changes.
                        assert_eq!(e.errno(), libc::ENOSPC, "{op:?}: {e}");
                    })
                    .is_ok()
            }
            _ => {
                exec(&fs, op);
                true
            }
        };
        m.apply(op);
        if let (true, Some(pr)) = (done, fsync_promise(&fs, &m, op)) {
            run.promises.push((dev.op_count(), i, pr));
        }
        if let Op::Snapshot(name) | Op::DeleteSnapshot(name) = op {
            run.promises
                .push((dev.op_count(), i, Promise::Snapshot { name }));
        }
        if let Some(pr) = replaced {
            run.promises.push((dev.op_count(), i, pr));
        }
        run.history.push(m.clone());
    }
    if synced_while_full {
        assert!(fs.stats().commits_deferred > 0, "no commit was refused");
    }
    drop(fs);
    (dev, run)
}

/// What the fsync or fdatasync `op`, which returned, promises (`m`: the model after it).
fn fsync_promise(fs: &Fs, m: &Model, op: &Op) -> Option<Promise> {
    let (Op::Fsync(p) | Op::Fdatasync(p)) = op else {
        return None;
    };
    let id = m.names[p];
    Some(if m.nodes[&id].dir {
        Promise::Dir {
            id,
            ino: fs.resolve(p).unwrap().ino,
            path: p.clone(),
        }
    } else {
        Promise::File {
            id,
            ino: fs.resolve(p).unwrap().ino,
            path: p.clone(),
            data_only: matches!(op, Op::Fdatasync(_)),
        }
    })
}

/// What the rename `op` promises when it puts a file over another file (`m`: the
/// model before it), and the file was never at that path before.
fn replace_promise(fs: &Fs, m: &Model, op: &Op) -> Option<Promise> {
    let Op::Rename(from, to) = op else {
        return None;
    };
    let file = |p: &String| {
        m.names
            .get(p)
            .filter(|id| m.nodes.get(id).is_some_and(|n| !n.dir && !n.symlink))
    };
    let (&id, &old) = (file(from)?, file(to)?);
    (id != old).then(|| Promise::Replaced {
        id,
        ino: fs.resolve(from).unwrap().ino,
        path: to.clone(),
    })
}

/// A crash while mounting `image` (during log replay and its commit): every state the
/// mount's own writes could leave must verify too. Returns how many were checked.
fn verify_crash_during_replay(
    image: Vec<u8>,
    runs: &[Run],
    flushed_upto: usize,
    what: &str,
    rng: &mut StdRng,
) -> usize {
    let dev = Arc::new(CrashDev::new(image));
    let fs =
        Fs::open(dev.clone(), Options::default()).unwrap_or_else(|e| panic!("{what}: mount: {e}"));
    drop(fs);
    let ops = dev.ops();
    let mut n = 0;
    let mut cuts: Vec<usize> = dev.flush_points();
    cuts.extend((0..ops.len()).filter(|_| rng.gen_bool(0.2)));
    for cut in cuts {
        verify(
            dev.image_with(cut, &[]),
            runs,
            flushed_upto,
            &format!("{what}, then a crash after {cut} writes of its replay"),
        );
        n += 1;
    }
    n
}

/// Checks the crash state `image`: `check` finds nothing, restore and mount agree, and
/// every promise of `runs` (the workloads of threads with names of their own) that
/// had been made by write `flushed_upto` is kept.
fn verify(image: Vec<u8>, runs: &[Run], flushed_upto: usize, what: &str) {
    let all_ops: Vec<Op> = runs.iter().flat_map(|r| r.ops.iter().cloned()).collect();
    let dev = Arc::new(MemDev::from_image(image));
    let rep =
        birchfs::check::check(dev.as_ref()).unwrap_or_else(|e| panic!("{what}: unreadable: {e}"));
    assert!(
        rep.problems.is_empty(),
        "{what}: check: {:#?}\nops: {:?}",
        rep.problems,
        all_ops
    );
    // `birchfs restore` of the same state, which replays the log itself.
    let tmp = tempfile::tempdir().unwrap();
    let restored = tmp.path().join("restored");
    let rr = birchfs::restore::restore(dev.as_ref(), &restored, &Default::default())
        .unwrap_or_else(|e| panic!("{what}: restore: {e}"));
    assert!(
        rr.problems.is_empty(),
        "{what}: restore: {:#?}\nops: {:?}",
        rr.problems,
        all_ops
    );
    let fs = Fs::open(dev, Options::default()).unwrap_or_else(|e| panic!("{what}: mount: {e}"));
    same_as_restored(&fs, ROOT_INO, &restored, what, &all_ops);
    for run in runs {
        keeps_promises(&fs, run, flushed_upto, what);
    }
}

/// Whether file `a` holds the data of some version of model node `id` in `later`,
/// and how many bytes it holds.
fn holds_a_version(fs: &Fs, a: &Attr, later: &[Model], id: u64) -> (bool, usize) {
    let d = fs.read(a.ino, 0, (a.size as u32).max(1)).unwrap();
    let ok = later
        .iter()
        .filter_map(|m| m.nodes.get(&id))
        .any(|v| v.data == d);
    (ok, d.len())
}

/// Every promise of `run` made by write `flushed_upto` is kept in the mounted `fs`.
fn keeps_promises(fs: &Fs, run: &Run, flushed_upto: usize, what: &str) {
    for (ret, i, pr) in &run.promises {
        if *ret > flushed_upto {
            continue;
        }
        let later = &run.history[*i..];
        match pr {
            Promise::File {
                id,
                ino,
                path,
                data_only,
            } => {
                let stable = later.iter().all(|m| m.names.get(path) == Some(id));
                // The path no longer leads to the file: later operations moved or
                // replaced the name, or (fdatasync keeps data, not names: a rename is
                // not data) the name it was fdatasynced under did not last; the path
                // may be gone, or still name the file a rename replaced.
                let moved =
                    !stable || *data_only && fs.resolve(path).map_or(true, |a| a.ino != *ino);
                if moved {
                    // Unless a later operation took the file's last name, some name it
                    // had since the fsync (after an fdatasync, any name it had) still
                    // reaches it, and it holds its data as of the fsync or later.
                    if !later.iter().all(|m| m.names_of(*id).next().is_some()) {
                        continue;
                    }
                    let since = if *data_only { &run.history[..] } else { later };
                    let names: std::collections::BTreeSet<&String> =
                        since.iter().flat_map(|m| m.names_of(*id)).collect();
                    let found = names
                        .iter()
                        .find_map(|n| fs.resolve(n).ok().filter(|a| a.ino == *ino));
                    let Some(a) = found else {
                        panic!(
                            "{what}: fsynced {path} (op {i}) is reachable by none of its names {names:?}\nops: {:?}",
                            run.ops
                        );
                    };
                    let (ok, len) = holds_a_version(fs, &a, later, *id);
                    assert!(
                        ok,
                        "{what}: {path} (fsynced at op {i}), found elsewhere, has {len} bytes: no version since the fsync matches\nops: {:?}",
                        run.ops
                    );
                    continue;
                }
                let a = fs.resolve(path).unwrap_or_else(|e| {
                    panic!(
                        "{what}: fsynced {path} (op {i}) is gone: {e}\nops: {:?}",
                        run.ops
                    )
                });
                let data = fs
                    .read(a.ino, 0, (a.size as u32).max(1))
                    .unwrap_or_else(|e| panic!("{what}: read {path}: {e}"));
                let mut xs = BTreeMap::new();
                for n in fs.listxattr(a.ino).unwrap() {
                    let v = fs.getxattr(a.ino, &n).unwrap();
                    xs.insert(String::from_utf8(n).unwrap(), v);
                }
                let meta =
                    |n: &Node| n.mode == a.perm as u32 && n.xattrs == xs && n.flags == a.flags;
                // fdatasync keeps the data and size; fsync all attributes too. Each
                // must be a version since the promise, and the data no newer than the
                // attributes: data written since and not fsynced may lag the file's
                // attributes (an attribute change is logged at once, and an fsync of
                // another inode makes it durable, while the data waits in the cache for
                // writeback: delayed allocation, as on ext4 and XFS; the same after an
                // fsync of the file that failed for want of room on the host), but an
                // attribute change never lags data written after it (the log keeps
                // their order).
                let first_data = later
                    .iter()
                    .position(|m| m.nodes.get(id).is_some_and(|n| n.data == data));
                let ok = first_data.is_some_and(|k| {
                    *data_only || later[k..].iter().filter_map(|m| m.nodes.get(id)).any(meta)
                });
                assert!(
                    ok,
                    "{what}: {path} (fsynced at op {i}) has {} bytes, mode {:o}, xattrs {:?}, flags {:#x}: no version since the fsync matches\nops: {:?}",
                    data.len(), a.perm, xs.keys().collect::<Vec<_>>(), a.flags, run.ops
                );
            }
            Promise::Replaced { id, ino, path } => {
                // Only where the path reaches the file for the first time with this
                // rename: a crash state from before an earlier stay there could
                // rightly show older data.
                let before = &run.history[..*i];
                if before.iter().any(|m| m.names.get(path) == Some(id)) {
                    continue;
                }
                let Ok(a) = fs.resolve(path) else { continue };
                if a.ino != *ino {
                    continue;
                }
                let (ok, len) = holds_a_version(fs, &a, later, *id);
                assert!(
                    ok,
                    "{what}: {path}, renamed over another file at op {i}, has {len} bytes: no version since the rename matches\nops: {:?}",
                    run.ops
                );
            }
            Promise::Snapshot { name } => {
                let snap = format!("/.snapshots/{name}");
                match later[0].snaps.get(name) {
                    Some(want) if later.iter().all(|m| m.snaps.get(name) == Some(want)) => {
                        compare_snapshot(fs, &snap, want, what, &run.ops)
                    }
                    None if later.iter().all(|m| !m.snaps.contains_key(name)) => assert!(
                        fs.resolve(&snap).is_err(),
                        "{what}: deleted snapshot {name} is back\nops: {:?}",
                        run.ops
                    ),
                    _ => {}
                }
            }
            Promise::Dir { id, ino, path } => {
                // Where the directory is in each state since (one name, if any), and
                // its entries there: later operations may move it.
                let at: Vec<Option<&String>> =
                    later.iter().map(|m| m.names_of(*id).next()).collect();
                let entries: Vec<Option<BTreeMap<String, u64>>> = later
                    .iter()
                    .zip(&at)
                    .map(|(m, p)| p.map(|p| m.children(p)))
                    .collect();
                let then = entries[0].as_ref().unwrap();
                let names: std::collections::BTreeSet<&String> =
                    at.iter().flatten().copied().collect();
                let found = names.iter().find_map(|n| {
                    fs.resolve(n)
                        .ok()
                        .filter(|a| a.ino == *ino)
                        .map(|a| (*n, a))
                });
                let Some((now_at, d)) = found else {
                    assert!(
                        at.iter().any(|p| p.is_none()),
                        "{what}: fsynced dir {path} (op {i}) is reachable by none of its names {names:?}\nops: {:?}",
                        run.ops
                    );
                    continue;
                };
                let mut now = std::collections::BTreeSet::new();
                for e in fs.readdir(d.ino, 0, 100_000).unwrap() {
                    now.insert(String::from_utf8(e.name).unwrap());
                }
                let join = |dir: &str, name: &str| {
                    if dir == "/" {
                        format!("/{name}")
                    } else {
                        format!("{dir}/{name}")
                    }
                };
                for (name, cid) in then {
                    let stable = entries
                        .iter()
                        .all(|e| e.as_ref().is_some_and(|e| e.get(name) == Some(cid)));
                    assert!(
                        !stable || now.contains(name),
                        "{what}: entry {name} of dir {path} (fsynced at op {i}; now at {now_at}) lost\nops: {:?}",
                        run.ops
                    );
                    let node = &later[0].nodes[cid];
                    if stable && node.symlink {
                        let a = fs.resolve(&join(now_at, name)).unwrap();
                        assert_eq!(
                            fs.readlink(a.ino).ok().as_ref(),
                            Some(&node.data),
                            "{what}: symlink {name} of fsynced dir {path} has another target\nops: {:?}",
                            run.ops
                        );
                    }
                }
                for name in &now {
                    if name == "." || name == ".." || then.contains_key(name) {
                        continue;
                    }
                    let ever = entries
                        .iter()
                        .any(|e| e.as_ref().is_some_and(|e| e.contains_key(name)));
                    assert!(
                        ever,
                        "{what}: {} was removed before the dir fsync (op {i}) but is back\nops: {:?}",
                        join(now_at, name),
                        run.ops
                    );
                }
            }
        }
    }
}

/// What restore made of a crash state, at `dir`, is what the mount of that state
/// shows under `ino`: names, kinds, permission bits, file data and link targets.
fn same_as_restored(fs: &Fs, ino: u64, dir: &std::path::Path, what: &str, ops: &[Op]) {
    use std::os::unix::fs::PermissionsExt;
    let mut mounted = BTreeMap::new();
    for e in fs.readdir(ino, 0, 100_000).unwrap() {
        let dots = e.name == b"." || e.name == b"..";
        let snapshots = ino == ROOT_INO && e.name == birchfs::SNAPSHOTS_NAME;
        if !(dots || snapshots) {
            mounted.insert(String::from_utf8(e.name).unwrap(), e.ino);
        }
    }
    let restored: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let mut restored_sorted = restored.clone();
    restored_sorted.sort();
    assert_eq!(
        mounted.keys().cloned().collect::<Vec<_>>(),
        restored_sorted,
        "{what}: restore and mount differ in {}\nops: {ops:?}",
        dir.display()
    );
    for (name, &child) in &mounted {
        let a = fs.getattr(child).unwrap();
        let p = dir.join(name);
        let m = std::fs::symlink_metadata(&p).unwrap();
        let differs = |how: &str| format!("{what}: restored {} {how}\nops: {ops:?}", p.display());
        match a.kind {
            FileKind::Dir => {
                assert!(m.is_dir(), "{}", differs("is no directory"));
                same_as_restored(fs, child, &p, what, ops);
            }
            FileKind::File => {
                let data = fs.read(child, 0, (a.size as u32).max(1)).unwrap();
                assert!(
                    std::fs::read(&p).unwrap() == data,
                    "{}",
                    differs("has other data")
                );
            }
            FileKind::Symlink => {
                let t = fs.readlink(child).unwrap();
                assert_eq!(
                    std::fs::read_link(&p)
                        .unwrap()
                        .as_os_str()
                        .as_encoded_bytes(),
                    t
                );
                continue;
            }
            _ => {}
        }
        assert_eq!(
            m.permissions().mode() & 0o7777,
            a.perm as u32,
            "{}",
            differs("mode")
        );
    }
}

/// The snapshot at `root` holds exactly what `m` had: names, types and file data.
fn compare_snapshot(fs: &Fs, root: &str, m: &Model, what: &str, ops: &[Op]) {
    for (path, id) in &m.names {
        let full = if path == "/" {
            root.to_string()
        } else {
            format!("{root}{path}")
        };
        let a = fs
            .resolve(&full)
            .unwrap_or_else(|e| panic!("{what}: {full}: {e}\nops: {ops:?}"));
        let node = &m.nodes[id];
        if node.dir {
            let mut now = std::collections::BTreeSet::new();
            for e in fs.readdir(a.ino, 0, 100_000).unwrap() {
                now.insert(String::from_utf8(e.name).unwrap());
            }
            now.remove(".");
            now.remove("..");
            let want: std::collections::BTreeSet<String> = m.children(path).into_keys().collect();
            assert_eq!(now, want, "{what}: entries of {full}\nops: {ops:?}");
        } else {
            let data = if node.symlink {
                fs.readlink(a.ino).unwrap()
            } else {
                fs.read(a.ino, 0, (a.size as u32).max(1)).unwrap()
            };
            assert!(
                data == node.data,
                "{what}: {full} has {} bytes, the snapshot took {}\nops: {ops:?}",
                data.len(),
                node.data.len()
            );
        }
    }
}

/// A recorded write: offset and bytes.
type Write<'a> = (u64, &'a [u8]);

/// Each state a power cut can start from (0, then just after each flush) with the
/// writes recorded after it and before the next flush: the unflushed tail a cut may
/// keep any part of.
fn gaps<'a>(dev: &CrashDev, ops: &'a [CrashOp]) -> Vec<(usize, Vec<Write<'a>>)> {
    let mut bases = vec![0];
    bases.extend(dev.flush_points());
    bases
        .iter()
        .enumerate()
        .map(|(bi, &b)| {
            let end = bases.get(bi + 1).map(|e| e - 1).unwrap_or(ops.len());
            let tail = ops[b..end]
                .iter()
                .filter_map(|o| match o {
                    CrashOp::Write { off, data } => Some((*off, data.as_slice())),
                    CrashOp::Flush => None,
                })
                .collect();
            (b, tail)
        })
        .collect()
}

/// Rebuilds and verifies the crash states of one recorded run (of one thread, or of
/// threads that each keep to names of their own); returns how many.
fn crash_states(dev: &CrashDev, runs: &[Run], rng: &mut StdRng, per_gap: usize) -> usize {
    let ops = dev.ops();
    let mut n = 0;
    for (bi, (b, tail)) in gaps(dev, &ops).into_iter().enumerate() {
        verify(dev.image_with(b, &[]), runs, b, &format!("flush point {b}"));
        n += 1;
        if bi % 2 == 1 {
            n += verify_crash_during_replay(
                dev.image_with(b, &[]),
                runs,
                b,
                &format!("flush point {b}"),
                rng,
            );
        }
        if tail.is_empty() {
            continue;
        }
        // in-order prefixes
        let step = (tail.len() / per_gap).max(1);
        for k in (1..=tail.len()).step_by(step) {
            verify(
                dev.image_with(b, &tail[..k]),
                runs,
                b,
                &format!("prefix {k} after {b}"),
            );
            n += 1;
        }
        // random subsets (the device may reorder before a flush)
        for s in 0..per_gap {
            let pick: Vec<(u64, &[u8])> =
                tail.iter().copied().filter(|_| rng.gen_bool(0.5)).collect();
            verify(
                dev.image_with(b, &pick),
                runs,
                b,
                &format!("subset {s} after {b}"),
            );
            n += 1;
        }
        // torn writes: a multi-block write keeps only some of its 4 KiB blocks
        let multi: Vec<usize> = (0..tail.len())
            .filter(|&i| tail[i].1.len() > 4096)
            .collect();
        for s in 0..per_gap.min(multi.len() * 2) {
            let t = multi[rng.gen_range(0..multi.len())];
            let mut pick: Vec<(u64, &[u8])> = tail[..t]
                .iter()
                .copied()
                .filter(|_| rng.gen_bool(0.7))
                .collect();
            let (off, data) = tail[t];
            for (j, blk) in data.chunks(4096).enumerate() {
                if rng.gen_bool(0.5) {
                    pick.push((off + j as u64 * 4096, blk));
                }
            }
            verify(
                dev.image_with(b, &pick),
                runs,
                b,
                &format!("torn write {s} after {b}"),
            );
            n += 1;
        }
    }
    n
}

fn s(x: &str) -> String {
    x.to_string()
}

/// The known hard cases of the btrfs and ext4 fsync tests in xfstests.
fn hard_cases() -> Vec<(&'static str, Vec<Op>)> {
    use Op::*;
    vec![
        (
            "trim between fsyncs, of space freed before and after the last commit",
            vec![
                Create(s("/a")),
                Write(s("/a"), 0, 40000, 1),
                Create(s("/b")),
                Write(s("/b"), 0, 30000, 2),
                Sync,
                Unlink(s("/b")),
                Write(s("/a"), 4096, 8192, 3),
                Fsync(s("/a")),
                Create(s("/c")),
                Write(s("/c"), 0, 20000, 4),
                Fsync(s("/c")),
                Unlink(s("/a")),
                Trim,
                Write(s("/c"), 100, 5000, 5),
                Fsync(s("/c")),
                Fsync(s("/")),
            ],
        ),
        (
            "fsync after rename",
            vec![
                Create(s("/a")),
                Write(s("/a"), 0, 9000, 1),
                Fsync(s("/a")),
                Rename(s("/a"), s("/b")),
                Fsync(s("/b")),
                Write(s("/b"), 100, 10, 2),
            ],
        ),
        (
            "link and unlink",
            vec![
                Mkdir(s("/d")),
                Create(s("/a")),
                Write(s("/a"), 0, 5000, 3),
                Fsync(s("/a")),
                Link(s("/a"), s("/d/b")),
                Fsync(s("/a")),
                Unlink(s("/a")),
                Fsync(s("/d/b")),
                Fsync(s("/")),
            ],
        ),
        (
            "truncate",
            vec![
                Create(s("/f")),
                Write(s("/f"), 0, 65536, 4),
                Fsync(s("/f")),
                Truncate(s("/f"), 5000),
                Fsync(s("/f")),
                Truncate(s("/f"), 100_000),
                Fsync(s("/f")),
            ],
        ),
        (
            "punch hole",
            vec![
                Create(s("/f")),
                Write(s("/f"), 0, 65536, 5),
                Fsync(s("/f")),
                Punch(s("/f"), 4096, 20000),
                Fsync(s("/f")),
                Punch(s("/f"), 100, 50),
                Fsync(s("/f")),
            ],
        ),
        (
            "new file in new dir",
            vec![
                Mkdir(s("/d")),
                Mkdir(s("/d/e")),
                Create(s("/d/e/f")),
                Write(s("/d/e/f"), 0, 3000, 6),
                Fsync(s("/d/e/f")),
            ],
        ),
        (
            "dir fsync after create and delete",
            vec![
                Mkdir(s("/d")),
                Create(s("/d/a")),
                Create(s("/d/b")),
                Fsync(s("/d")),
                Unlink(s("/d/a")),
                Create(s("/d/c")),
                Fsync(s("/d")),
                Create(s("/d/z")),
            ],
        ),
        (
            "rename over existing",
            vec![
                Create(s("/a")),
                Write(s("/a"), 0, 4096, 7),
                Fsync(s("/a")),
                Create(s("/b")),
                Write(s("/b"), 0, 8192, 8),
                Fsync(s("/b")),
                Rename(s("/b"), s("/a")),
                Fsync(s("/a")),
            ],
        ),
        (
            "write-fsync-rename-fsync dir",
            vec![
                Create(s("/f")),
                Write(s("/f"), 0, 10000, 9),
                Fsync(s("/f")),
                Fsync(s("/")),
                Create(s("/f.tmp")),
                Write(s("/f.tmp"), 0, 12000, 10),
                Fsync(s("/f.tmp")),
                Rename(s("/f.tmp"), s("/f")),
                Fsync(s("/")),
            ],
        ),
        (
            "xattr changes",
            vec![
                Create(s("/a")),
                SetXattr(s("/a"), "user.x", Value(vec![1; 100])),
                Fsync(s("/a")),
                RemoveXattr(s("/a"), "user.x"),
                SetXattr(s("/a"), "user.y", Value(vec![2; 1900])),
                Fsync(s("/a")),
                Chmod(s("/a"), 0o600),
                Fsync(s("/a")),
            ],
        ),
        (
            "fallocate beyond EOF",
            vec![
                Create(s("/f")),
                Write(s("/f"), 0, 4096, 11),
                Falloc(s("/f"), 0, 1 << 20, true),
                Fsync(s("/f")),
                Falloc(s("/f"), 0, 2 << 20, false),
                Fsync(s("/f")),
                Write(s("/f"), 1 << 20, 4096, 12),
                Fsync(s("/f")),
            ],
        ),
        (
            "writes in place into preallocated blocks, before and after a snapshot",
            vec![
                Create(s("/f")),
                Falloc(s("/f"), 0, 2 << 20, false),
                Sync,
                Write(s("/f"), 4096, 8192, 31),
                Fdatasync(s("/f")),
                Write(s("/f"), (1 << 20) - 4096, 12288, 32),
                Write(s("/f"), 20000, 100, 33),
                Fsync(s("/f")),
                Snapshot("s"),
                Write(s("/f"), 3 << 19, 4096, 34),
                Write(s("/f"), 8192, 4096, 35),
                Fsync(s("/f")),
                Punch(s("/f"), 4096, 4096),
                Write(s("/f"), 300_000, 4096, 36),
                Fdatasync(s("/f")),
                Truncate(s("/f"), 1 << 20),
                Fsync(s("/f")),
            ],
        ),
        (
            "zero ranges over data, holes and preallocated blocks, then writes into them",
            vec![
                Create(s("/f")),
                Write(s("/f"), 0, 100_000, 41),
                Sync,
                Zero(s("/f"), 5000, 30_000, true),
                Fdatasync(s("/f")),
                Zero(s("/f"), 90_000, 40_000, false),
                Write(s("/f"), 12_288, 4096, 42),
                Fsync(s("/f")),
                Zero(s("/f"), 0, 200_000, true),
                Write(s("/f"), 100_000, 9000, 43),
                Fdatasync(s("/f")),
            ],
        ),
        (
            "hard links across dirs",
            vec![
                Mkdir(s("/x")),
                Mkdir(s("/y")),
                Create(s("/x/a")),
                Write(s("/x/a"), 0, 6000, 13),
                Link(s("/x/a"), s("/y/b")),
                Fsync(s("/y/b")),
                Unlink(s("/x/a")),
                Fsync(s("/x")),
                Fsync(s("/y/b")),
            ],
        ),
        (
            "fdatasync after write, truncate and fallocate",
            vec![
                Create(s("/f")),
                Write(s("/f"), 0, 20000, 17),
                Fdatasync(s("/f")),
                Chmod(s("/f"), 0o600),
                Truncate(s("/f"), 7000),
                Fdatasync(s("/f")),
                Falloc(s("/f"), 0, 50000, false),
                Fdatasync(s("/f")),
                Punch(s("/f"), 0, 4096),
                Fdatasync(s("/f")),
            ],
        ),
        (
            "chattr +i and +a reach the log with an fsync, and so does clearing them",
            vec![
                Create(s("/f")),
                Write(s("/f"), 0, 9000, 3),
                Sync,
                Chattr(s("/f"), 0x10),
                Fsync(s("/f")),
                Mkdir(s("/d")),
                Create(s("/d/g")),
                Write(s("/d/g"), 0, 100, 4),
                Chattr(s("/d/g"), 0x20 | 0x40),
                Fsync(s("/d/g")),
                Chattr(s("/d/g"), 0x40),
                Write(s("/d/g"), 4096, 100, 9),
                Chmod(s("/d/g"), 0o600),
                Fsync(s("/d/g")),
            ],
        ),
        (
            "clone, fsync of the clone, then writes to both",
            vec![
                Create(s("/a")),
                Write(s("/a"), 0, 300_000, 20),
                Sync,
                Create(s("/b")),
                Write(s("/b"), 0, 5000, 21),
                Clone(s("/a"), s("/b")),
                Fsync(s("/b")),
                Write(s("/a"), 4096, 100, 22),
                Write(s("/b"), 200_000, 100, 23),
                Fsync(s("/a")),
                Clone(s("/b"), s("/a")),
                Fdatasync(s("/a")),
            ],
        ),
        (
            "snapshot, fsyncs on the shared tree, delete and drop",
            vec![
                Mkdir(s("/d")),
                Create(s("/d/a")),
                Write(s("/d/a"), 0, 200_000, 30),
                Create(s("/b")),
                Write(s("/b"), 0, 9000, 31),
                Snapshot("one"),
                Write(s("/d/a"), 4096, 50_000, 32),
                Fsync(s("/d/a")),
                Unlink(s("/b")),
                Fsync(s("/")),
                Snapshot("two"),
                Create(s("/d/c")),
                Write(s("/d/c"), 0, 7000, 33),
                Fsync(s("/d/c")),
                DeleteSnapshot("one"),
                Write(s("/d/a"), 0, 10, 34),
                Fdatasync(s("/d/a")),
            ],
        ),
        (
            "extending truncate, then fdatasync",
            vec![
                Create(s("/a")),
                Write(s("/a"), 0, 6000, 1),
                Sync,
                Truncate(s("/a"), 11067),
                Fdatasync(s("/a")),
            ],
        ),
        (
            "fdatasync of a file renamed over another keeps the data, not the name",
            vec![
                Mkdir(s("/d")),
                Create(s("/a")),
                Write(s("/a"), 0, 6000, 1),
                Sync,
                Create(s("/d/c")),
                Fsync(s("/d")),
                Write(s("/a"), 13660, 8357, 56),
                Fsync(s("/a")),
                Rename(s("/a"), s("/d/c")),
                Fdatasync(s("/d/c")),
            ],
        ),
        (
            "rename onto another link of the same file does nothing",
            vec![
                Mkdir(s("/d")),
                Create(s("/a")),
                Write(s("/a"), 0, 6000, 1),
                Sync,
                Link(s("/a"), s("/d/a")),
                Fsync(s("/d/a")),
                Rename(s("/a"), s("/d/a")),
                Fsync(s("/d/a")),
                Fsync(s("/")),
                Create(s("/z")),
                Write(s("/z"), 0, 5000, 99),
                Fsync(s("/z")),
            ],
        ),
        (
            "the host fills up: the refused commit is kept, fsyncs fail, then all lands",
            vec![
                Mkdir(s("/d")),
                Create(s("/d/a")),
                Write(s("/d/a"), 0, 30_000, 51),
                Fsync(s("/d/a")),
                NoRoom(true),
                Create(s("/b")),
                Write(s("/b"), 0, 20_000, 52),
                Rename(s("/d/a"), s("/d/c")),
                Sync,
                Fsync(s("/d")),
                Create(s("/e")),
                SetXattr(s("/e"), "user.k", Value(vec![7; 3000])),
                Fsync(s("/e")),
                NoRoom(false),
                Fsync(s("/b")),
                Write(s("/b"), 4096, 100, 53),
                Fdatasync(s("/b")),
                Unlink(s("/e")),
                Fsync(s("/")),
                Sync,
            ],
        ),
        (
            "large overwrite",
            vec![
                Create(s("/f")),
                Write(s("/f"), 0, 1 << 20, 14),
                Fsync(s("/f")),
                Write(s("/f"), 300_000, 100_000, 15),
                Fsync(s("/f")),
                Sync,
                Write(s("/f"), 0, 5, 16),
            ],
        ),
        (
            "fsync of a file whose directory was renamed since the last commit",
            vec![
                Mkdir(s("/d")),
                Create(s("/d/a")),
                Write(s("/d/a"), 0, 5000, 60),
                Sync,
                Rename(s("/d"), s("/e")),
                Write(s("/e/a"), 100, 100, 61),
                Fsync(s("/e/a")),
            ],
        ),
        (
            "a directory moved into another, both fsynced",
            vec![
                Mkdir(s("/d")),
                Mkdir(s("/e")),
                Create(s("/d/a")),
                Write(s("/d/a"), 0, 3000, 62),
                Sync,
                Rename(s("/d"), s("/e/d")),
                Fsync(s("/e")),
                Create(s("/e/d/b")),
                Fsync(s("/e/d/b")),
                Fsync(s("/")),
            ],
        ),
        (
            "a renamed directory's old name taken by a new file, fsynced",
            vec![
                Mkdir(s("/d")),
                Create(s("/d/a")),
                Sync,
                Rename(s("/d"), s("/e")),
                Create(s("/d")),
                Write(s("/d"), 0, 4000, 63),
                Fsync(s("/d")),
                Fsync(s("/e")),
            ],
        ),
        (
            "exchange of a file and a directory, each side fsynced",
            vec![
                Mkdir(s("/d")),
                Create(s("/d/a")),
                Create(s("/b")),
                Write(s("/b"), 0, 7000, 64),
                Sync,
                Exchange(s("/b"), s("/d")),
                Fsync(s("/b")),
                Write(s("/d"), 0, 10, 65),
                Fsync(s("/d")),
                Exchange(s("/b/a"), s("/d")),
                Fsync(s("/")),
            ],
        ),
        (
            "exchange of two files in different directories, then a dir fsync",
            vec![
                Mkdir(s("/d")),
                Create(s("/a")),
                Write(s("/a"), 0, 3000, 66),
                Create(s("/d/c")),
                Write(s("/d/c"), 0, 9000, 67),
                Fsync(s("/a")),
                Exchange(s("/a"), s("/d/c")),
                Fsync(s("/d")),
                Fsync(s("/a")),
            ],
        ),
        (
            "an old file moved into a new directory, fsynced",
            vec![
                Mkdir(s("/d")),
                Create(s("/a")),
                Write(s("/a"), 0, 8000, 68),
                Sync,
                Mkdir(s("/d/e")),
                Rename(s("/a"), s("/d/e/x")),
                Fsync(s("/d/e/x")),
                Write(s("/d/e/x"), 0, 100, 69),
            ],
        ),
        (
            "a directory replaced by a file of its name, the parent fsynced",
            vec![
                Mkdir(s("/d")),
                Mkdir(s("/d/e")),
                Create(s("/d/e/x")),
                Fsync(s("/d")),
                Unlink(s("/d/e/x")),
                Rmdir(s("/d/e")),
                Create(s("/d/e")),
                Write(s("/d/e"), 0, 3000, 70),
                Fsync(s("/d")),
                Fsync(s("/d/e")),
            ],
        ),
        (
            "more long links in one directory than an inode ref holds (extended refs)",
            {
                let long = |i: usize| format!("/d/{i:02}{}", "l".repeat(240));
                let mut ops = vec![
                    Mkdir(s("/d")),
                    Create(s("/a")),
                    Write(s("/a"), 0, 5000, 71),
                    Fsync(s("/a")),
                ];
                ops.extend((0..36).map(|i| Link(s("/a"), long(i))));
                ops.push(Fsync(s("/a")));
                ops.extend((0..36).step_by(5).map(|i| Unlink(long(i))));
                ops.push(Rename(long(33), s("/b")));
                ops.push(Link(s("/b"), long(40)));
                ops.push(Fsync(s("/a")));
                ops.push(Unlink(long(2)));
                ops.push(Fsync(s("/d")));
                ops
            },
        ),
        (
            "symlinks made, replaced and moved, their directory fsynced",
            vec![
                Mkdir(s("/d")),
                Symlink(s("/d/l"), s("../a")),
                Fsync(s("/d")),
                Create(s("/a")),
                Rename(s("/a"), s("/d/l")),
                Symlink(s("/a"), s("d/l")),
                Fsync(s("/")),
                Rename(s("/a"), s("/d/m")),
                Fsync(s("/d")),
            ],
        ),
        // Found by the generated sequences with BIRCHFS_SEED=1853 (long run): the
        // symlink's directory fsync logs the xattr, and the file's data, whose
        // writeback failed twice, lags it.
        (
            "an xattr set while the host is full, after a write whose writeback failed",
            vec![
                Mkdir(s("/d")),
                Create(s("/a")),
                Write(s("/a"), 0, 6000, 1),
                Sync,
                Create(s("/d/a")),
                Fsync(s("/d/a")),
                NoRoom(true),
                Write(s("/d/a"), 8343, 2921, 204),
                Fsync(s("/d/a")),
                SetXattr(s("/d/a"), "user.k", Value(vec![162; 40])),
                Fsync(s("/d/a")),
                Symlink(s("/b"), s("t7")),
                Fsync(s("/")),
                NoRoom(false),
                Fsync(s("/")),
                Create(s("/z")),
                Write(s("/z"), 0, 5000, 99),
                Fsync(s("/z")),
            ],
        ),
        // Found by the generated sequences with BIRCHFS_SEED=3990 (long run): the same
        // lag with room on the host. A write not fsynced waits in the cache while an
        // xattr and a mode change of the file, logged at once, become durable with a
        // directory's fsync; a crash then finds the new attributes with the old data.
        (
            "attributes made durable by a directory fsync before the file's newer data",
            vec![
                Mkdir(s("/d")),
                Create(s("/d/c")),
                Write(s("/d/c"), 0, 6000, 1),
                Fsync(s("/d/c")),
                Write(s("/d/c"), 3000, 24113, 2),
                SetXattr(s("/d/c"), "user.k", Value(vec![81; 40])),
                Chmod(s("/d/c"), 0o600),
                Fsync(s("/d")),
                Create(s("/d/e")),
                Fsync(s("/d/e")),
            ],
        ),
        // A file replaced by writing a new one and renaming it over the old, without
        // fsync; a later fsync of another file (or a commit) makes the rename durable.
        (
            "a file replaced by rename without fsync, then another file fsynced",
            vec![
                Mkdir(s("/d")),
                Create(s("/d/a")),
                Write(s("/d/a"), 0, 7000, 1),
                Fsync(s("/d/a")),
                Create(s("/d/t")),
                Write(s("/d/t"), 0, 9000, 2),
                Rename(s("/d/t"), s("/d/a")),
                Create(s("/z")),
                Fsync(s("/z")),
                Create(s("/d/t")),
                Write(s("/d/t"), 0, 3000, 3),
                Chmod(s("/d/t"), 0o600),
                Rename(s("/d/t"), s("/d/a")),
                Sync,
            ],
        ),
        // A file rewritten in place without fsync (open(O_TRUNC), write, close); a
        // later fsync of another file makes the truncate durable.
        (
            "a file rewritten in place without fsync, then another file fsynced",
            vec![
                Mkdir(s("/d")),
                Create(s("/d/a")),
                Write(s("/d/a"), 0, 7000, 1),
                Fsync(s("/d/a")),
                Rewrite(s("/d/a"), 9000, 2),
                Create(s("/z")),
                Fsync(s("/z")),
                Rewrite(s("/d/a"), 3000, 3),
                Chmod(s("/d/a"), 0o600),
                Fsync(s("/d")),
                Sync,
            ],
        ),
    ]
}

fn long() -> bool {
    std::env::var("BIRCHFS_LONG").is_ok()
}

/// The seed of a test's random choices: `n`, or `n` mixed with `BIRCHFS_SEED` when it
/// is set (to explore other sequences and crash states than CI's).
fn seed(n: u64) -> u64 {
    match std::env::var("BIRCHFS_SEED") {
        Ok(v) => {
            let extra: u64 = v.parse().expect("BIRCHFS_SEED: an unsigned integer");
            eprintln!("BIRCHFS_SEED={extra}");
            n ^ extra.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        }
        Err(_) => n,
    }
}

/// Runs every `parts`-th of the known hard cases from `first` on, each recorded once
/// (with every run a commit frees discarded, `-o discard=4K`, when `discard`), through
/// its power cuts; returns the crash states checked. The cases are split over
/// several tests so that the test threads share them.
fn hard_cases_survive(first: usize, parts: usize, discard: bool, seed_n: u64) -> usize {
    let base = base_image();
    let mut rng = StdRng::seed_from_u64(seed(seed_n));
    let per_gap = if long() { 24 } else { 6 };
    let mut total = 0;
    for (name, ops) in hard_cases().into_iter().skip(first).step_by(parts) {
        let (dev, run) = record_with(&base, ops, discard.then_some(4096));
        let n = crash_states(&dev, std::slice::from_ref(&run), &mut rng, per_gap);
        let how = if discard { ", online discard" } else { "" };
        eprintln!("{name}{how}: {n} crash states");
        total += n;
    }
    total
}

#[test]
fn known_hard_cases_survive_every_power_cut_first_half() {
    let total = hard_cases_survive(0, 2, false, 1);
    eprintln!("hard cases, first half: {total} crash states checked");
    assert!(total > 500, "too few crash states: {total}");
}

#[test]
fn known_hard_cases_survive_every_power_cut_second_half() {
    let total = hard_cases_survive(1, 2, false, 3);
    eprintln!("hard cases, second half: {total} crash states checked");
    assert!(total > 500, "too few crash states: {total}");
}

/// Every other hard case (all in the long run) once more, with every run a commit
/// frees discarded.
#[test]
fn known_hard_cases_survive_every_power_cut_with_online_discard() {
    let total = hard_cases_survive(0, if long() { 1 } else { 2 }, true, 5);
    eprintln!("hard cases, online discard: {total} crash states checked");
    assert!(total > 500, "too few crash states: {total}");
}

/// Kinds of operation [`random_op`] makes.
const OP_KINDS: u32 = 18;
/// Kinds that take or delete a snapshot (of every thread's names at once).
const SNAPSHOT_KINDS: [u32; 2] = [10, 11];
/// The kind that clones one file over another.
const CLONE_KIND: u32 = 9;
/// The kind that trims (and so commits first).
const TRIM_KIND: u32 = 12;

/// An operation of kind `kind` (below [`OP_KINDS`]) on the names below `top` ("" for
/// the root): files, directories that come and go, move and swap with files (their
/// contents with them), symlinks. It may be invalid in `m`; callers skip those.
fn random_op(rng: &mut StdRng, m: &Model, top: &str, kind: u32) -> Op {
    let files = ["/a", "/b", "/d/a", "/d/c", "/e/a", "/e/c"].map(|f| format!("{top}{f}"));
    let dirs = ["/d", "/e", "/d/e"].map(|d| format!("{top}{d}"));
    let f = files[rng.gen_range(0..files.len())].clone();
    let g = files[rng.gen_range(0..files.len())].clone();
    let any = |rng: &mut StdRng| {
        let i = rng.gen_range(0..files.len() + dirs.len());
        files
            .get(i)
            .unwrap_or_else(|| &dirs[i - files.len()])
            .clone()
    };
    let dir = dirs[rng.gen_range(0..dirs.len())].clone();
    // A name the model has now below `top`, so that moves mostly happen.
    let existing = |rng: &mut StdRng| {
        let names: Vec<&String> = m
            .names
            .keys()
            .filter(|p| *p != "/" && (top.is_empty() || Model::under(top, p)))
            .collect();
        if names.is_empty() {
            return files[0].clone(); // (not there: the op is skipped)
        }
        names[rng.gen_range(0..names.len())].clone()
    };
    match kind {
        0 => Op::Create(f),
        1 => Op::Write(
            f,
            rng.gen_range(0..20000),
            rng.gen_range(1..20000),
            rng.gen(),
        ),
        // Not among threads: another thread's fsync between the truncate and the
        // release may make the truncate durable alone (as on ext4 and btrfs), which
        // the model, taking the rewrite as one step, does not show.
        2 if top.is_empty() && rng.gen_ratio(1, 3) => {
            Op::Rewrite(f, rng.gen_range(1..20000), rng.gen())
        }
        2 => Op::Truncate(f, rng.gen_range(0..20000)),
        3 => Op::Link(f, g),
        4 => Op::Unlink(f),
        5 => Op::Rename(f, g),
        6 => Op::Punch(f, rng.gen_range(0..20000), rng.gen_range(1..10000)),
        // Now and then a value too large for one tree item (chunks).
        7 => Op::SetXattr(
            f,
            "user.k",
            Value(vec![
                rng.gen();
                if rng.gen_ratio(1, 4) { 30_000 } else { 40 }
            ]),
        ),
        8 if rng.gen() => Op::Falloc(f, 0, rng.gen_range(1..40000), rng.gen()),
        8 => Op::Zero(
            f,
            rng.gen_range(0..20000),
            rng.gen_range(1..30000),
            rng.gen(),
        ),
        CLONE_KIND => Op::Clone(f, g),
        10 => Op::Snapshot(if rng.gen() { "s" } else { "t" }),
        11 => Op::DeleteSnapshot(if rng.gen() { "s" } else { "t" }),
        TRIM_KIND => Op::Trim,
        13 => Op::Rmdir(dir),
        14 => Op::Rename(existing(rng), any(rng)),
        15 => Op::Exchange(existing(rng), existing(rng)),
        16 => Op::Symlink(f, format!("t{}", rng.gen_range(0..100))),
        _ => Op::Mkdir(dir),
    }
}

/// An fsync (or fdatasync) of what `op` touched, or of its directory, never above
/// `top`; `m` is the model after `op`.
fn fsync_after(rng: &mut StdRng, m: &Model, op: &Op, top: &str) -> Op {
    let target = match op {
        Op::Link(_, b) | Op::Rename(_, b) | Op::Clone(_, b) => b.clone(),
        Op::Exchange(a, b) => (if rng.gen() { a } else { b }).clone(),
        // A symlink cannot be opened to fsync it: its directory is.
        Op::Symlink(p, _) => Model::parent(p),
        Op::Create(p)
        | Op::Mkdir(p)
        | Op::Rmdir(p)
        | Op::Write(p, ..)
        | Op::Truncate(p, _)
        | Op::Rewrite(p, ..)
        | Op::Punch(p, ..)
        | Op::SetXattr(p, ..)
        | Op::Falloc(p, ..)
        | Op::Zero(p, ..) => p.clone(),
        _ => format!("{top}/d"),
    };
    let mut target = if rng.gen_bool(0.3) {
        Model::parent(&target)
    } else {
        target
    };
    while !m.valid(&Op::Fsync(target.clone())) || !top.is_empty() && !target.starts_with(top) {
        target = if top.is_empty() || Model::under(top, &target) {
            Model::parent(&target)
        } else {
            top.to_string()
        };
    }
    if rng.gen_bool(0.33) && m.is_file(&target) {
        Op::Fdatasync(target)
    } else {
        Op::Fsync(target)
    }
}

/// CrashMonkey ACE-style: sequences of up to 4 operations on a small name space, each
/// ending in an fsync of something it touched.
#[test]
fn generated_sequences_survive_every_power_cut() {
    let base = base_image();
    let mut rng = StdRng::seed_from_u64(seed(2));
    let seqs = if long() { 400 } else { 40 };
    let per_gap = if long() { 8 } else { 3 };
    let mut total = 0;
    for seq in 0..seqs {
        let mut m = Model::new();
        let mut ops = vec![
            Op::Mkdir(s("/d")),
            Op::Create(s("/a")),
            Op::Write(s("/a"), 0, 6000, 1),
            Op::Sync,
        ];
        for op in &ops {
            m.apply(op);
        }
        // Every third sequence runs out of room on the host for some of its steps
        // (only operations that need no device write of their own run then).
        let full_from = (seq % 3 == 2).then(|| rng.gen_range(0..3));
        let mut full = false;
        let mut tries = 0;
        let mut added = 0;
        while added < rng.gen_range(1..=4) && tries < 100 {
            tries += 1;
            if !full && full_from == Some(added) {
                ops.push(Op::NoRoom(true));
                full = true;
            }
            let kind = rng.gen_range(0..OP_KINDS);
            // (Truncating writes the file's cached data back first.)
            if full && (kind == 2 || (6..=12).contains(&kind) && kind != 7) {
                continue;
            }
            // Trims and snapshots are always valid where most others are not: keep
            // one in three, so that they do not crowd the sequences.
            let always = kind == TRIM_KIND || SNAPSHOT_KINDS.contains(&kind);
            if always && !rng.gen_ratio(1, 3) {
                continue;
            }
            let op = random_op(&mut rng, &m, "", kind);
            if m.valid(&op) {
                m.apply(&op);
                let sync = fsync_after(&mut rng, &m, &op, "");
                ops.push(op);
                ops.push(sync);
                added += 1;
            }
        }
        if full {
            // Room again: everything kept is written, and fsyncs use the log again.
            ops.push(Op::NoRoom(false));
            ops.push(Op::Fsync(s("/")));
            ops.push(Op::Create(s("/z")));
            ops.push(Op::Write(s("/z"), 0, 5000, 99));
            ops.push(Op::Fsync(s("/z")));
        }
        // Every other sequence discards every run its commits free (`discard=4K`).
        let (dev, run) = record_with(&base, ops, (seq % 2 == 1).then_some(4096));
        total += crash_states(&dev, std::slice::from_ref(&run), &mut rng, per_gap);
    }
    eprintln!("generated sequences: {seqs} sequences, {total} crash states checked");
    assert!(total > 200);
}

/// Four threads change names of their own (each below its own directory: files and
/// directories made, written, renamed, swapped, linked and removed, symlinks), each
/// fsyncing after every change, so that their namespace updates share log batches and
/// group commits. In every crash state (flush points, and prefixes and subsets of the
/// writes after them), each thread's fsyncs are kept as in the one-thread sequences.
#[test]
fn namespace_changes_of_threads_survive_every_power_cut() {
    const THREADS: usize = 4;
    let steps = if long() { 100 } else { 25 };
    let dev = Arc::new(CrashDev::new(base_image()));
    let fs = Fs::open(
        dev.clone(),
        Options {
            commit_interval: std::time::Duration::ZERO,
            ..Default::default()
        },
    )
    .unwrap();
    let prep = |top: &str| {
        vec![
            Op::Mkdir(top.to_string()),
            Op::Mkdir(format!("{top}/d")),
            Op::Create(format!("{top}/a")),
            Op::Write(format!("{top}/a"), 0, 6000, 1),
        ]
    };
    for t in 0..THREADS {
        for op in prep(&format!("/t{t}")) {
            exec(&fs, &op);
        }
    }
    fs.commit().unwrap();
    let runs: Vec<Run> = std::thread::scope(|sc| {
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let (fs, dev, prep) = (&fs, &dev, &prep);
                sc.spawn(move || {
                    let top = format!("/t{t}");
                    let mut rng = StdRng::seed_from_u64(seed(40 + t as u64));
                    let mut m = Model::new();
                    for op in prep(&top) {
                        m.apply(&op);
                    }
                    let mut run = Run {
                        ops: Vec::new(),
                        history: Vec::new(),
                        promises: Vec::new(),
                    };
                    let mut added = 0;
                    while added < steps {
                        let kind = rng.gen_range(0..OP_KINDS);
                        if SNAPSHOT_KINDS.contains(&kind) {
                            continue; // a snapshot would take the others' names too
                        }
                        if kind == CLONE_KIND {
                            // A clone is done in steps (head, whole blocks a few
                            // extents at a time, tail), and another thread's commit
                            // may land between two: a crash before the file's next
                            // fsync can find it part done, as on btrfs and XFS.
                            continue;
                        }
                        if kind == TRIM_KIND && !rng.gen_ratio(1, 8) {
                            continue; // always valid, and it commits: now and then
                        }
                        let op = random_op(&mut rng, &m, &top, kind);
                        if !m.valid(&op) {
                            continue;
                        }
                        exec(fs, &op);
                        m.apply(&op);
                        let sync = fsync_after(&mut rng, &m, &op, &top);
                        run.ops.push(op);
                        run.history.push(m.clone());
                        exec(fs, &sync);
                        let returned = dev.op_count();
                        m.apply(&sync);
                        let pr = fsync_promise(fs, &m, &sync).expect("an fsync");
                        run.ops.push(sync);
                        run.history.push(m.clone());
                        run.promises.push((returned, run.ops.len() - 1, pr));
                        added += 1;
                    }
                    run
                })
            })
            .collect();
        threads.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let st = fs.stats();
    eprintln!(
        "{} fsyncs in {} log batches, {} full commits, {} fallbacks",
        st.fsyncs, st.log_commits, st.commits, st.fallbacks
    );
    drop(fs);
    let mut rng = StdRng::seed_from_u64(seed(44));
    let n = crash_states(&dev, &runs, &mut rng, if long() { 4 } else { 2 });
    let fsyncs: usize = runs.iter().map(|r| r.promises.len()).sum();
    eprintln!("namespace changes of {THREADS} threads: {fsyncs} fsyncs, {n} crash states checked");
    assert!(n > 100, "too few crash states: {n}");
}

/// Four threads write and fsync their own files at once, so log batches are written
/// while other batches flush. At every flush point the recorded device can stop at,
/// each file must hold the version of its last fsync that had returned by then, or a
/// later version (never an older one, never a mix).
#[test]
fn concurrent_fsyncs_survive_every_flush_point() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 25;
    let dev = Arc::new(CrashDev::new(base_image()));
    let fs = Arc::new(
        Fs::open(
            dev.clone(),
            Options {
                commit_interval: std::time::Duration::ZERO,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let inos: Vec<u64> = (0..THREADS)
        .map(|t| {
            fs.mknod(
                birchfs::ROOT_INO,
                format!("f{t}").as_bytes(),
                0o644,
                0,
                Creds::default(),
            )
            .unwrap()
            .ino
        })
        .collect();
    fs.commit().unwrap();
    let start = dev.op_count();
    // Per thread: every version of its file, and (op count when an fsync returned,
    // version it promised).
    type Record = (Vec<Vec<u8>>, Vec<(usize, usize)>);
    let results: Vec<Record> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (fs, dev, ino) = (fs.clone(), dev.clone(), inos[t]);
                sc.spawn(move || {
                    let mut rng = StdRng::seed_from_u64(seed(t as u64 + 99));
                    let mut data = Vec::new();
                    let mut versions = vec![Vec::new()];
                    let mut promises = Vec::new();
                    for r in 0..ROUNDS {
                        let off = rng.gen_range(0..40_000usize);
                        let len = rng.gen_range(1..9_000usize);
                        let byte = (t * ROUNDS + r) as u8 | 1;
                        fs.write(ino, off as u64, &vec![byte; len]).unwrap();
                        if data.len() < off + len {
                            data.resize(off + len, 0);
                        }
                        data[off..off + len].fill(byte);
                        versions.push(data.clone());
                        fs.fsync(ino, rng.gen_bool(0.5)).unwrap();
                        promises.push((dev.op_count(), versions.len() - 1));
                    }
                    (versions, promises)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(fs);
    let points: Vec<usize> = dev
        .flush_points()
        .into_iter()
        .filter(|&p| p >= start)
        .collect();
    assert!(points.len() >= ROUNDS, "few flushes: {}", points.len());
    for &p in &points {
        let img = dev.image_with(p, &[]);
        let rep = birchfs::check::check(&MemDev::from_image(img.clone())).unwrap();
        assert!(
            rep.problems.is_empty(),
            "flush point {p}: {:#?}",
            rep.problems
        );
        let fs = Fs::open(Arc::new(MemDev::from_image(img)), Options::default()).unwrap();
        for (t, (versions, promises)) in results.iter().enumerate() {
            let promised = promises
                .iter()
                .filter(|(ops, _)| *ops <= p)
                .map(|&(_, v)| v)
                .max()
                .unwrap_or(0);
            let got = fs.read(inos[t], 0, 100_000).unwrap();
            assert!(
                versions[promised..].contains(&got),
                "flush point {p}: file {t} ({} bytes) is not version {promised} or later",
                got.len()
            );
        }
    }
}

/// A device that stops a flush called from the thread named `committer` until the
/// test opens the gate: a commit held in flight between its node writes and its
/// superblocks.
struct GateDev {
    inner: Arc<CrashDev>,
    open: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
    /// Set when a committer's flush is waiting at the gate.
    waiting: std::sync::atomic::AtomicBool,
    /// Stop the committer at its first write instead (right after the commit is
    /// prepared, before it writes anything).
    at_write: std::sync::atomic::AtomicBool,
}

/// A filesystem on a gated, crash-recording device, with no commit timer.
fn gated_fs() -> (Arc<CrashDev>, Arc<GateDev>, Arc<Fs>) {
    let crash = Arc::new(CrashDev::new(base_image()));
    let gate = Arc::new(GateDev {
        inner: crash.clone(),
        open: std::sync::Mutex::new(false),
        cv: std::sync::Condvar::new(),
        waiting: std::sync::atomic::AtomicBool::new(false),
        at_write: std::sync::atomic::AtomicBool::new(false),
    });
    let fs = Fs::open(
        gate.clone(),
        Options {
            commit_interval: std::time::Duration::ZERO,
            ..Default::default()
        },
    )
    .unwrap();
    (crash, gate, Arc::new(fs))
}

/// Starts a commit on a thread named `committer` and returns once it waits at the
/// gate (its nodes written, its superblocks not).
fn hold_a_commit(fs: &Arc<Fs>, gate: &GateDev) -> std::thread::JoinHandle<birchfs::Result<()>> {
    let fs = fs.clone();
    let t = std::thread::Builder::new()
        .name("committer".into())
        .spawn(move || fs.commit())
        .unwrap();
    while !gate.waiting.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    t
}

impl GateDev {
    fn release(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }

    /// Waits while the gate is shut, if called from the committer.
    fn stop_the_committer(&self) {
        if std::thread::current().name() == Some("committer") {
            self.waiting
                .store(true, std::sync::atomic::Ordering::SeqCst);
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.cv.wait(open).unwrap();
            }
        }
    }
}

impl birchfs::dev::BlockDev for GateDev {
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        if self.at_write.load(std::sync::atomic::Ordering::SeqCst) {
            self.stop_the_committer();
        }
        self.inner.write_at(buf, off)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.stop_the_committer();
        self.inner.flush()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
}

/// A commit writes the trees as they were when it was prepared: its nodes are encoded
/// after the fs lock is released, while new changes (creates, unlinks, renames,
/// attribute changes) copy them. The image the commit leaves holds exactly the
/// prepared state, and passes `check`.
#[test]
fn a_commit_writes_its_trees_as_they_were_when_prepared() {
    let (crash, gate, fs) = gated_fs();
    let c = Creds::default();
    let root = birchfs::ROOT_INO;
    let mut want = std::collections::BTreeMap::new();
    for i in 0..200u32 {
        let name = format!("f{i}");
        let ino = fs.mknod(root, name.as_bytes(), 0o644, 0, c).unwrap().ino;
        let data = vec![(i % 251) as u8 + 1; 100 + i as usize * 37];
        fs.write(ino, 0, &data).unwrap();
        fs.fsync(ino, true).unwrap();
        want.insert(name, data);
    }
    // Unbatched changes with no data to write back: the commit's first write comes
    // after its prepare.
    for i in 0..50u32 {
        fs.unlink(root, format!("f{i}").as_bytes()).unwrap();
        want.remove(&format!("f{i}"));
    }
    gate.at_write
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let committer = hold_a_commit(&fs, &gate);
    // The commit is prepared and holds no lock: change every leaf it is about to write.
    for i in 50..200u32 {
        let name = format!("f{i}");
        if i % 3 == 0 {
            fs.unlink(root, name.as_bytes()).unwrap();
        } else if i % 3 == 1 {
            fs.rename(
                root,
                name.as_bytes(),
                root,
                format!("g{i}").as_bytes(),
                RenameFlags::default(),
            )
            .unwrap();
        } else {
            let ino = fs.resolve(&format!("/{name}")).unwrap().ino;
            fs.setattr(
                ino,
                &birchfs::SetAttr {
                    mode: Some(0o600),
                    ..Default::default()
                },
            )
            .unwrap();
        }
        fs.mknod(root, format!("n{i}").as_bytes(), 0o644, 0, c)
            .unwrap();
    }
    gate.release();
    committer.join().unwrap().unwrap();
    let img = crash.image_with(crash.op_count(), &[]);
    drop(fs);
    let rep = birchfs::check::check(&MemDev::from_image(img.clone())).unwrap();
    assert!(rep.problems.is_empty(), "{:#?}", rep.problems);
    let fs = Fs::open(Arc::new(MemDev::from_image(img)), Options::default()).unwrap();
    let mut got = std::collections::BTreeMap::new();
    for e in fs.readdir(root, 0, 10_000).unwrap() {
        let name = String::from_utf8(e.name.clone()).unwrap();
        if name == "." || name == ".." {
            continue;
        }
        let a = fs.getattr(e.ino).unwrap();
        assert_eq!(
            a.perm, 0o644,
            "{name}: a mode changed after the commit began"
        );
        got.insert(name, fs.read(e.ino, 0, 100_000).unwrap());
    }
    assert_eq!(got, want);
}

/// fsync does not wait for a commit in flight: while a commit is held between its
/// node writes and its superblocks, a write and its fsync complete, and a power cut
/// at that moment (the commit never lands) keeps what the fsync made durable, also
/// after a second crash during the mount that replays it. (Before the log's ring, the
/// fsync waited for the whole commit.)
#[test]
fn an_fsync_completes_and_survives_while_a_commit_is_in_flight() {
    let (crash, gate, fs) = gated_fs();
    let c = Creds::default();
    let a = fs.mknod(birchfs::ROOT_INO, b"a", 0o644, 0, c).unwrap().ino;
    fs.write(a, 0, &[1; 10_000]).unwrap();
    fs.fsync(a, false).unwrap();
    // Records not yet in a batch when the commit starts: its closing batch holds them.
    let b = fs.mknod(birchfs::ROOT_INO, b"b", 0o644, 0, c).unwrap().ino;
    fs.write(b, 0, &[2; 5000]).unwrap();
    fs.write(a, 0, &[3; 100]).unwrap();
    let committer = hold_a_commit(&fs, &gate);
    // The commit is in flight. New changes, fsynced from another thread.
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let fs = fs.clone();
        std::thread::spawn(move || {
            let r = (|| {
                let d = fs.mkdir(birchfs::ROOT_INO, b"d", 0o755, c)?.ino;
                let f = fs.mknod(d, b"f", 0o644, 0, c)?.ino;
                fs.write(f, 0, &[4; 7000])?;
                fs.fsync(f, false)?;
                fs.write(b, 4096, &[5; 100])?;
                fs.fsync(b, true)
            })();
            tx.send(r).unwrap();
        });
    }
    let r = rx.recv_timeout(std::time::Duration::from_secs(20));
    let at = crash.op_count();
    gate.release();
    committer.join().unwrap().unwrap();
    assert!(
        matches!(r, Ok(Ok(()))),
        "fsync during a commit in flight did not complete: {r:?}"
    );
    drop(fs);
    let expect = |fs: &Fs, what: &str| {
        let a = fs
            .resolve("/a")
            .unwrap_or_else(|e| panic!("{what}: /a: {e}"));
        let mut want_a = vec![1u8; 10_000];
        want_a[..100].fill(3);
        assert_eq!(fs.read(a.ino, 0, 20_000).unwrap(), want_a, "{what}: /a");
        let f = fs
            .resolve("/d/f")
            .unwrap_or_else(|e| panic!("{what}: /d/f: {e}"));
        assert_eq!(
            fs.read(f.ino, 0, 20_000).unwrap(),
            vec![4u8; 7000],
            "{what}: /d/f"
        );
        let b = fs
            .resolve("/b")
            .unwrap_or_else(|e| panic!("{what}: /b: {e}"));
        let mut want_b = vec![2u8; 5000];
        want_b[4096..4196].fill(5);
        assert_eq!(fs.read(b.ino, 0, 20_000).unwrap(), want_b, "{what}: /b");
    };
    // The power cut: everything written so far landed, the superblocks did not.
    let img = crash.image_with(at, &[]);
    let rep = birchfs::check::check(&MemDev::from_image(img.clone())).unwrap();
    assert!(rep.problems.is_empty(), "{:#?}", rep.problems);
    let again = Arc::new(CrashDev::new(img.clone()));
    let fs = Fs::open(again.clone(), Options::default()).unwrap();
    expect(&fs, "after the cut");
    drop(fs);
    // A second cut at every flush point of that mount (and unmount).
    let mut points = again.flush_points();
    points.push(again.op_count());
    assert!(!points.is_empty());
    for p in points {
        let img = again.image_with(p, &[]);
        let rep = birchfs::check::check(&MemDev::from_image(img.clone())).unwrap();
        assert!(
            rep.problems.is_empty(),
            "cut at {p} of the replay: {:#?}",
            rep.problems
        );
        let fs = Fs::open(Arc::new(MemDev::from_image(img)), Options::default()).unwrap();
        expect(&fs, &format!("cut at {p} of the replay"));
    }
}

/// Whether `got` is a file a power cut may leave: `versions[0]` is the version that
/// its last returned fsync promised, then every later one. Writes after that fsync may
/// be there in part (a commit takes what is written back at its start), so each byte
/// is that of some version and the size lies between the promised one and the last;
/// a size never comes before its data (no zeros where no version had them).
fn holds(versions: &[Vec<u8>], got: &[u8]) -> bool {
    if versions.iter().any(|v| v == got) {
        return true;
    }
    let longest = versions.iter().map(Vec::len).max().unwrap_or(0);
    (versions[0].len()..=longest).contains(&got.len())
        && got
            .iter()
            .enumerate()
            .all(|(i, b)| versions.iter().any(|v| v.get(i) == Some(b)))
}

/// Writers fsync their own files while another thread commits over and over, so log
/// batches are written while commits are in flight and the log wraps around its area.
/// At every flush point, and for random subsets of the writes between two (the device
/// may reorder them), each file holds the version of its last fsync that had returned
/// by then, or a later one; a second cut during the mount that replays changes nothing.
#[test]
fn fsyncs_and_commits_together_survive_every_power_cut() {
    const THREADS: usize = 3;
    let rounds = if long() { 200 } else { 70 };
    let dev = Arc::new(CrashDev::new(base_image()));
    let fs = Arc::new(
        Fs::open(
            dev.clone(),
            Options {
                commit_interval: std::time::Duration::ZERO,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let inos: Vec<u64> = (0..THREADS)
        .map(|t| {
            fs.mknod(
                birchfs::ROOT_INO,
                format!("f{t}").as_bytes(),
                0o644,
                0,
                Creds::default(),
            )
            .unwrap()
            .ino
        })
        .collect();
    // Move the log's ring position near its end first (unchecked), so that the
    // batches below wrap around the area.
    let pad = fs
        .mknod(birchfs::ROOT_INO, b"pad", 0o644, 0, Creds::default())
        .unwrap()
        .ino;
    for i in 0..200u64 {
        fs.write(pad, i % 16 * 4096, &[i as u8; 4096]).unwrap();
        fs.fsync(pad, true).unwrap();
    }
    fs.commit().unwrap();
    let start = dev.op_count();
    let done = std::sync::atomic::AtomicBool::new(false);
    type Record = (Vec<Vec<u8>>, Vec<(usize, usize)>);
    let results: Vec<Record> = std::thread::scope(|sc| {
        sc.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                fs.commit().unwrap();
                std::thread::sleep(std::time::Duration::from_micros(300));
            }
        });
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (fs, dev, ino) = (fs.clone(), dev.clone(), inos[t]);
                sc.spawn(move || {
                    let mut rng = StdRng::seed_from_u64(seed(t as u64 + 7));
                    let mut data = Vec::new();
                    let mut versions = vec![Vec::new()];
                    let mut promises = Vec::new();
                    for r in 0..rounds {
                        let off = rng.gen_range(0..40_000usize);
                        let len = rng.gen_range(1..9_000usize);
                        let byte = 1 + ((t * rounds + r) % 255) as u8;
                        fs.write(ino, off as u64, &vec![byte; len]).unwrap();
                        if data.len() < off + len {
                            data.resize(off + len, 0);
                        }
                        data[off..off + len].fill(byte);
                        versions.push(data.clone());
                        fs.fsync(ino, rng.gen_bool(0.5)).unwrap();
                        promises.push((dev.op_count(), versions.len() - 1));
                        // Leave the committer room to run between fsyncs.
                        std::thread::sleep(std::time::Duration::from_micros(200));
                    }
                    (versions, promises)
                })
            })
            .collect();
        let r = hs.into_iter().map(|h| h.join().unwrap()).collect();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        r
    });
    let st = fs.stats();
    drop(fs);
    assert!(st.commits > 5, "few commits: {}", st.commits);
    let check_at = |img: Vec<u8>, p: usize, what: &str| {
        let rep = birchfs::check::check(&MemDev::from_image(img.clone())).unwrap();
        assert!(rep.problems.is_empty(), "{what}: {:#?}", rep.problems);
        let fs = Fs::open(Arc::new(MemDev::from_image(img)), Options::default())
            .unwrap_or_else(|e| panic!("{what}: mount: {e}"));
        for (t, (versions, promises)) in results.iter().enumerate() {
            let promised = promises
                .iter()
                .filter(|(ops, _)| *ops <= p)
                .map(|&(_, v)| v)
                .max()
                .unwrap_or(0);
            let got = fs.read(inos[t], 0, 100_000).unwrap();
            assert!(
                holds(&versions[promised..], &got),
                "{what}: file {t} ({} bytes) is not version {promised} or later",
                got.len()
            );
        }
    };
    let ops = dev.ops();
    // The log wrapped around its area: a batch went below the one before it.
    let log_end = past_log(&dev.image_with(0, &[]));
    let log_writes: Vec<u64> = ops[start..]
        .iter()
        .filter_map(|op| match op {
            CrashOp::Write { off, .. } if *off < log_end => Some(*off),
            _ => None,
        })
        .filter(|&off| off >= birchfs::format::LOG_START)
        .collect();
    assert!(
        log_writes.windows(2).any(|w| w[1] < w[0]),
        "the log never wrapped ({} batches written)",
        log_writes.len()
    );
    // The flush points from `start` on (not the unflushed start of the recording).
    let points: Vec<_> = gaps(&dev, &ops)
        .into_iter()
        .filter(|&(p, _)| p > 0 && p >= start)
        .collect();
    assert!(points.len() >= rounds, "few flushes: {}", points.len());
    let mut rng = StdRng::seed_from_u64(seed(42));
    for (i, (p, tail)) in points.into_iter().enumerate() {
        check_at(dev.image_with(p, &[]), p, &format!("flush point {p}"));
        if !tail.is_empty() {
            let pick: Vec<(u64, &[u8])> =
                tail.iter().copied().filter(|_| rng.gen_bool(0.5)).collect();
            let img = dev.image_with(p, &pick);
            check_at(img.clone(), p, &format!("subset after {p}"));
            if i % 8 == 0 {
                // A second cut while mounting that image.
                let again = Arc::new(CrashDev::new(img));
                drop(Fs::open(again.clone(), Options::default()).unwrap());
                for q in again.flush_points() {
                    check_at(
                        again.image_with(q, &[]),
                        p,
                        &format!("subset after {p}, then a cut at {q} of its mount"),
                    );
                }
            }
        }
    }
}

/// A crash can leave batches of the next generation beyond where the new log starts
/// (the batch closing the old generation was lost, later ones landed). The mount that
/// follows must never read them as batches of its own log, even where its own batches
/// end exactly where a stale one begins: it skips a generation. (Without the skip,
/// the stale batch below is replayed onto an inode that does not exist.)
#[test]
fn batches_a_crash_left_beyond_the_log_are_never_replayed() {
    let (crash, gate, fs) = gated_fs();
    let c = Creds::default();
    let a = fs.mknod(birchfs::ROOT_INO, b"a", 0o644, 0, c).unwrap().ino;
    fs.write(a, 0, &[1; 10_000]).unwrap();
    fs.fsync(a, false).unwrap();
    // Created only in the closing batch, which is lost below.
    let e = fs.mknod(birchfs::ROOT_INO, b"e", 0o644, 0, c).unwrap().ino;
    fs.write(e, 0, &[2; 5000]).unwrap();
    let committer = hold_a_commit(&fs, &gate);
    // Two one-block batches of the next generation; the second changes `e`.
    let d = fs.mkdir(birchfs::ROOT_INO, b"d", 0o755, c).unwrap().ino;
    let f = fs.mknod(d, b"f", 0o644, 0, c).unwrap().ino;
    fs.write(f, 0, &[4; 7000]).unwrap();
    fs.fsync(f, false).unwrap();
    fs.write(e, 4096, &[5; 100]).unwrap();
    fs.fsync(e, true).unwrap();
    let at = crash.op_count();
    gate.release();
    committer.join().unwrap().unwrap();
    drop(fs);
    // Every write up to here landed but the closing batch.
    let is_batch = |data: &[u8], closing: bool| {
        data.len() >= 56
            && &data[..8] == b"BIRCHLOG"
            && (!closing || data[52..56] == 1u32.to_le_bytes())
    };
    let ops = crash.ops();
    let closing = ops[..at]
        .iter()
        .position(|o| matches!(o, CrashOp::Write { data, .. } if is_batch(data, true)))
        .expect("the commit wrote a closing batch");
    let later: Vec<usize> = ops[closing + 1..at]
        .iter()
        .filter_map(|o| match o {
            CrashOp::Write { data, .. } if is_batch(data, false) => Some(data.len()),
            _ => None,
        })
        .collect();
    assert_eq!(
        later,
        [4096, 4096],
        "two one-block batches after the closing one"
    );
    let keep: Vec<(u64, &[u8])> = ops[..at]
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != closing)
        .filter_map(|(_, o)| match o {
            CrashOp::Write { off, data } => Some((*off, data.as_slice())),
            CrashOp::Flush => None,
        })
        .collect();
    let again = Arc::new(CrashDev::new(crash.image_with(0, &keep)));
    let fs = Fs::open(again.clone(), Options::default()).unwrap();
    assert!(
        fs.resolve("/d").is_err(),
        "the next generation must not replay"
    );
    assert!(fs.resolve("/e").is_err());
    // A first batch of two blocks, where the closing batch was: it ends where the
    // second stale batch begins.
    let big = fs
        .mknod(birchfs::ROOT_INO, b"big", 0o644, 0, c)
        .unwrap()
        .ino;
    for x in [&b"user.x"[..], b"user.y", b"user.z"] {
        fs.setxattr(big, x, &[7; 1500], false, false).unwrap();
    }
    let before = again.op_count();
    fs.fsync(big, false).unwrap();
    let cut = again.op_count();
    let sizes: Vec<usize> = again.ops()[before..cut]
        .iter()
        .filter_map(|o| match o {
            CrashOp::Write { data, .. } if is_batch(data, false) => Some(data.len()),
            _ => None,
        })
        .collect();
    assert_eq!(sizes, [8192], "one two-block batch");
    std::mem::forget(fs); // the power cut: no unmount
    let img = again.image_with(cut, &[]);
    let rep = birchfs::check::check(&MemDev::from_image(img.clone())).unwrap();
    assert!(rep.problems.is_empty(), "{:#?}", rep.problems);
    let dev = Arc::new(MemDev::from_image(img));
    let fs = Fs::open(dev.clone(), Options::default())
        .unwrap_or_else(|e| panic!("mount after the second cut: {e}"));
    let got = fs.resolve("/big").unwrap();
    assert_eq!(fs.getxattr(got.ino, b"user.z").unwrap(), vec![7u8; 1500]);
    assert!(fs.resolve("/d").is_err() && fs.resolve("/e").is_err());
    assert_eq!(fs.read(a, 0, 20_000).unwrap(), vec![1u8; 10_000]);
    fs.unmount().unwrap();
    let rep = birchfs::check::check(dev.as_ref()).unwrap();
    assert!(
        rep.problems.is_empty(),
        "after replaying the second cut: {:#?}",
        rep.problems
    );
}

/// The states every power cut of `dev` can leave: each flush point, and after it
/// in-order prefixes and random subsets of the writes before the next flush.
fn cut_images(dev: &CrashDev, rng: &mut StdRng) -> Vec<(usize, Vec<u8>)> {
    let ops = dev.ops();
    let mut out = Vec::new();
    for (b, tail) in gaps(dev, &ops) {
        out.push((b, dev.image_with(b, &[])));
        for k in 1..=tail.len() {
            out.push((b, dev.image_with(b, &tail[..k])));
        }
        for _ in 0..4 {
            let pick: Vec<(u64, &[u8])> =
                tail.iter().copied().filter(|_| rng.gen_bool(0.5)).collect();
            out.push((b, dev.image_with(b, &pick)));
        }
    }
    out
}

/// A rename with RENAME_WHITEOUT, and a create that takes its parent's default ACL,
/// are each one step for a power cut: every state has the old names or the new ones
/// whole (never the moved file without its whiteout, nor a new file without its
/// ACL), and after the directory's fsync returned, the new ones.
#[test]
fn whiteout_renames_and_acl_creates_are_whole_across_every_power_cut() {
    let dev = Arc::new(CrashDev::new(base_image()));
    let opts = Options {
        commit_interval: std::time::Duration::ZERO,
        ..Default::default()
    };
    let fs = Fs::open(dev.clone(), opts).unwrap();
    let c = Creds::default();
    let root = birchfs::ROOT_INO;
    let a = fs.mknod(root, b"a", 0o644, 0, c).unwrap();
    fs.write(a.ino, 0, b"lower file").unwrap();
    let d = fs.mkdir(root, b"d", 0o755, c).unwrap();
    // A default ACL: user::rwx user:1000:rwx group::r-x mask::rwx other::---
    let mut def = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in [
        (1u16, 7u16, u32::MAX),
        (2, 7, 1000),
        (4, 5, u32::MAX),
        (0x10, 7, u32::MAX),
        (0x20, 0, u32::MAX),
    ] {
        def.extend_from_slice(&tag.to_le_bytes());
        def.extend_from_slice(&perm.to_le_bytes());
        def.extend_from_slice(&id.to_le_bytes());
    }
    fs.set_acl(d.ino, b"system.posix_acl_default", &def, true)
        .unwrap();
    fs.fsync(a.ino, false).unwrap();
    fs.fsync(d.ino, false).unwrap();
    fs.fsync(root, false).unwrap();
    let before = dev.op_count();
    fs.rename_whiteout(root, b"a", root, b"b", false, c)
        .unwrap();
    let f = fs
        .create_inheriting(d.ino, b"f", libc::S_IFREG | 0o666, 0, c, 0o022)
        .unwrap();
    assert_eq!(f.perm & 0o777, 0o660);
    fs.fsync(root, false).unwrap();
    fs.fsync(d.ino, false).unwrap();
    let promised = dev.op_count();
    drop(fs);
    let mut rng = StdRng::seed_from_u64(seed(26));
    let mut n = 0;
    for (b, img) in cut_images(&dev, &mut rng) {
        if b < before {
            continue; // the set-up is not durable yet
        }
        let what = format!("cut after {b} of {} writes and flushes", dev.op_count());
        let mdev = Arc::new(MemDev::from_image(img));
        let rep = birchfs::check::check(mdev.as_ref()).unwrap();
        assert!(rep.problems.is_empty(), "{what}: {:#?}", rep.problems);
        let fs = Fs::open(mdev, Options::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
        let at = |p: u64, n: &[u8]| fs.lookup(p, n).ok();
        match (at(root, b"a"), at(root, b"b")) {
            (Some(x), None) => {
                assert!(b < promised, "{what}: the rename was fsynced");
                assert_eq!(x.kind, birchfs::FileKind::File, "{what}");
            }
            (Some(w), Some(y)) => {
                assert_eq!(
                    (w.kind, w.rdev, w.perm),
                    (birchfs::FileKind::CharDev, 0, 0),
                    "{what}"
                );
                assert_eq!(fs.read(y.ino, 0, 100).unwrap(), b"lower file", "{what}");
            }
            other => panic!("{what}: a and b are {other:?}"),
        }
        let d = at(root, b"d").unwrap();
        match at(d.ino, b"f") {
            None => assert!(b < promised, "{what}: the create was fsynced"),
            Some(f) => {
                assert_eq!(f.perm & 0o777, 0o660, "{what}");
                let acl = fs.getxattr(f.ino, b"system.posix_acl_access");
                assert!(acl.is_ok(), "{what}: the new file has no ACL: {acl:?}");
            }
        }
        n += 1;
    }
    assert!(n >= 10, "only {n} crash states");
    eprintln!("{n} crash states checked");
}
