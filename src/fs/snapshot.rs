//! Read-only snapshots of the fs tree, seen under `/.snapshots/NAME`.
//!
//! A snapshot is a tree of its own that starts as the fs tree's root with one more
//! reference (`txn` takes it inside a commit); the trees then part by copy-on-write
//! (a node copied from a shared node adds a reference to each child). Deleting one
//! hides it at once and frees what only it held in the background
//! ([`Fs::drop_deleted`]).
//!
//! Inode numbers: a live inode keeps its own number (below 2^40); inode `i` of
//! snapshot tree `t` is `1 << 63 | t << 40 | i`, and `.snapshots` itself is `1 << 63`.
//! The hidden `.snapshots` directory is found by lookup in the root but not listed by
//! readdir, so walks of the filesystem (`du`, `cp -a`, `rsync`) do not descend into
//! every snapshot.

use super::{Attr, DirEntryOut, FileKind, Fs, Inner, ROOT_INO};
use crate::error::{Error, Result};
use crate::format::{objectid, tree, Timespec};

/// Name of the snapshot directory in the root.
pub const SNAPSHOTS_NAME: &[u8] = b".snapshots";

const SNAP_BIT: u64 = 1 << 63;
const INO_BITS: u32 = 40;

/// Inode number of `/.snapshots`.
pub const SNAPSHOTS_INO: u64 = SNAP_BIT;

/// Live inode numbers stay below this, so that snapshot inode numbers can hold them.
pub(crate) const LIVE_INO_LIMIT: u64 = 1 << INO_BITS;

/// Nodes visited per step of a snapshot drop (one hold of the fs lock).
const DROP_BUDGET: usize = 256;

/// Drop steps between commits (bounds the refcount changes queued in memory).
const DROP_STEPS_PER_COMMIT: usize = 32;

/// Whether `ino` is read-only because it is in a snapshot (or is `.snapshots`).
pub fn is_snapshot_ino(ino: u64) -> bool {
    ino & SNAP_BIT != 0
}

/// The tree and the tree's own inode number behind a visible inode number.
pub(crate) fn split(ino: u64) -> (u64, u64) {
    if is_snapshot_ino(ino) {
        ((ino & !SNAP_BIT) >> INO_BITS, ino & (LIVE_INO_LIMIT - 1))
    } else {
        (tree::FS, ino)
    }
}

/// The visible inode number of inode `local` of tree `t`.
pub(crate) fn join(t: u64, local: u64) -> u64 {
    if t == tree::FS {
        local
    } else {
        SNAP_BIT | (t << INO_BITS) | local
    }
}

/// Whether `name` in `parent` is the reserved snapshot directory.
pub(crate) fn is_reserved(parent: u64, name: &[u8]) -> bool {
    parent == ROOT_INO && name == SNAPSHOTS_NAME
}

/// One snapshot, as `birchfs snapshot list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// Its name under `.snapshots`.
    pub name: Vec<u8>,
    /// Tree id (part of its inode numbers).
    pub id: u64,
    /// Generation of the commit that took it.
    pub generation: u64,
    /// When it was taken.
    pub ctime: Timespec,
}

impl SnapshotInfo {
    /// One snapshot as a JSON object (the name lossily as UTF-8).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "name": String::from_utf8_lossy(&self.name),
            "id": self.id,
            "generation": self.generation,
            "created_sec": self.ctime.sec.get(),
            "created_nsec": self.ctime.nsec.get(),
        })
    }

    /// The JSON array `birchfs snapshot list --json` prints.
    pub fn list_to_json(list: &[SnapshotInfo]) -> String {
        serde_json::Value::Array(list.iter().map(SnapshotInfo::to_json).collect()).to_string()
    }
}

/// Checks that `name` can name a snapshot: a file name's rules, and neither `.` nor
/// `..`.
pub fn check_snapshot_name(name: &[u8]) -> Result<()> {
    let bad =
        || Error::Invalid("a snapshot name is one path component: not empty, '.' or '..', no '/'");
    match super::dir::check_name(name) {
        Err(Error::Invalid(_)) => Err(bad()),
        Ok(()) if name == b"." || name == b".." => Err(bad()),
        r => r,
    }
}

impl Inner {
    /// Attributes of `/.snapshots`: a directory owned like the root, read-only to all
    /// but the owner (who takes and drops snapshots in it).
    pub(crate) fn snapshots_dir_attr(&mut self) -> Result<Attr> {
        let mut a = self.getattr(ROOT_INO)?;
        a.ino = SNAPSHOTS_INO;
        a.perm = 0o755;
        a.nlink = 2 + self.store.snapshots.len() as u32;
        a.size = 0;
        a.blocks = 0;
        if let Some(s) = self.store.snapshots.values().next_back().map(|s| s.ctime) {
            a.mtime = s.to_system();
            a.ctime = s.to_system();
        }
        Ok(a)
    }

    /// Lookups in `/.snapshots`: a snapshot's name gives its root directory.
    pub(crate) fn lookup_snapshot(&mut self, name: &[u8]) -> Result<Attr> {
        match name {
            b"." => self.snapshots_dir_attr(),
            b".." => self.getattr(ROOT_INO),
            _ => {
                let id = self.store.snapshot_id(name).ok_or(Error::NotFound)?;
                self.getattr(join(id, objectid::ROOT_DIR))
            }
        }
    }

    /// readdir of `/.snapshots`; offsets are tree ids, which never change.
    pub(crate) fn readdir_snapshots(
        &mut self,
        offset: u64,
        max: usize,
    ) -> Result<Vec<DirEntryOut>> {
        let mut out = Vec::new();
        if offset == 0 && out.len() < max {
            out.push(DirEntryOut {
                ino: SNAPSHOTS_INO,
                kind: FileKind::Dir,
                name: b".".to_vec(),
                next_offset: 1,
            });
        }
        if offset <= 1 && out.len() < max {
            out.push(DirEntryOut {
                ino: ROOT_INO,
                kind: FileKind::Dir,
                name: b"..".to_vec(),
                next_offset: 2,
            });
        }
        for (&id, s) in self.store.snapshots.range(offset.max(2)..) {
            if out.len() >= max {
                break;
            }
            out.push(DirEntryOut {
                ino: join(id, objectid::ROOT_DIR),
                kind: FileKind::Dir,
                name: s.name.clone(),
                next_offset: id + 1,
            });
        }
        Ok(out)
    }
}

impl Fs {
    /// Takes a read-only snapshot of the whole filesystem as it is now (cached writes
    /// included) and names it `name`; it shows as `/.snapshots/NAME`. The snapshot is
    /// durable when this returns. EEXIST if the name is taken.
    pub fn snapshot_create(&self, name: &[u8]) -> Result<Attr> {
        check_snapshot_name(name)?;
        // Fails early, before the writeback; `request_snapshot` asks again under the
        // commit lock.
        self.with(|i| i.store.can_snapshot(name))?;
        self.writeback_all()?;
        {
            let _c = self.commit_lock.lock();
            self.inner.lock().store.request_snapshot(name)?;
            self.commit_locked(true)?;
        }
        tracing::info!("snapshot {:?} taken", String::from_utf8_lossy(name));
        self.with(|i| i.lookup_snapshot(name))
    }

    /// Deletes snapshot `name`: it is gone at once, and durably (with everything else
    /// done so far) when this returns; what only it held is freed by
    /// [`Fs::drop_deleted`].
    pub fn snapshot_delete(&self, name: &[u8]) -> Result<()> {
        check_snapshot_name(name)?;
        let id = self.with(|i| {
            let id = i.store.snapshot_id(name).ok_or(Error::NotFound)?;
            i.store.delete_snapshot(id)?;
            Ok(id)
        })?;
        // Its files' cached data can never be read again.
        self.cache
            .discard_inodes(join(id, 0), join(id, LIVE_INO_LIMIT - 1));
        self.commit()?;
        tracing::info!("snapshot {:?} deleted", String::from_utf8_lossy(name));
        Ok(())
    }

    /// The snapshots, oldest first.
    pub fn snapshot_list(&self) -> Vec<SnapshotInfo> {
        let g = self.inner.lock();
        g.store
            .snapshots
            .iter()
            .map(|(&id, s)| SnapshotInfo {
                name: s.name.clone(),
                id,
                generation: s.generation,
                ctime: s.ctime,
            })
            .collect()
    }

    /// The snapshot whose root directory is `ino`.
    pub fn snapshot_info(&self, ino: u64) -> Option<SnapshotInfo> {
        let (t, local) = split(ino);
        if !is_snapshot_ino(ino) || local != objectid::ROOT_DIR {
            return None;
        }
        let g = self.inner.lock();
        g.store.snapshots.get(&t).map(|s| SnapshotInfo {
            name: s.name.clone(),
            id: t,
            generation: s.generation,
            ctime: s.ctime,
        })
    }

    /// Whether deleted snapshots still hold space that [`Fs::drop_deleted`] would free.
    pub fn has_deleted_snapshots(&self) -> bool {
        self.inner.lock().store.has_dead()
    }

    /// Frees what deleted snapshots alone held, at most `max_steps` bounded steps (each
    /// takes the fs lock for about 256 nodes), committing as it goes and at
    /// the end; returns whether more is left. The mount runs this in the background.
    pub fn drop_deleted(&self, max_steps: usize) -> Result<bool> {
        self.drop_deleted_by(max_steps, DROP_BUDGET)
    }

    /// [`Fs::drop_deleted`] with steps of `budget` nodes.
    pub(crate) fn drop_deleted_by(&self, max_steps: usize, budget: usize) -> Result<bool> {
        let mut more = self.has_deleted_snapshots();
        let mut steps = 0;
        while more && steps < max_steps {
            more = self.with(|i| i.store.drop_step(budget))?;
            steps += 1;
            if steps % DROP_STEPS_PER_COMMIT == 0 {
                self.commit_tree()?;
            }
        }
        if steps % DROP_STEPS_PER_COMMIT != 0 {
            self.commit_tree()?;
        }
        Ok(more)
    }

    /// EROFS for inodes of snapshots (and `.snapshots` itself).
    pub(crate) fn live(ino: u64) -> Result<()> {
        if is_snapshot_ino(ino) {
            Err(Error::ReadOnly)
        } else {
            Ok(())
        }
    }

    /// [`Fs::live`] for a directory that gets or loses a name: in `.snapshots` only
    /// mkdir and rmdir work (EPERM).
    pub(crate) fn live_dir(dir: u64) -> Result<()> {
        if dir == SNAPSHOTS_INO {
            return Err(Error::Perm);
        }
        Self::live(dir)
    }
}
