//! The fsync log: fsync appends records to a preallocated log area and flushes once,
//! instead of committing every tree.
//!
//! What is logged. Every change the running transaction makes to the fs tree and the
//! checksum tree (item inserted, item deleted) and every data-extent reference change
//! becomes a record, in the order it happened. Replaying the records of generation N+1
//! on top of the trees of commit N rebuilds the trees exactly as they were when the
//! last logged operation finished. This is simpler than btrfs's per-inode tree log and
//! keeps its guarantees without its trouble cases (rename, link, new file in new dir):
//! the log holds whole operations in order, so no fsync needs a fallback for them.
//!
//! The seeds' points hold: an fsync does no tree work at all (nothing is inserted,
//! split or locked for it: seed 1); an inode whose changes are all logged returns at
//! once; writing N pending updates costs O(N) (seed 3); concurrent fsyncs share one
//! batch and one flush (group commit).
//!
//! On disk, a batch is a header and records, padded to 4 KiB, written after the
//! previous batch of the same generation; it never rewrites a block an earlier batch
//! wrote. Replay reads batches from the start of the area while magic, fsid,
//! generation (the superblock's + 1), sequence and crc32c are right, then checks the
//! data blocks named by logged checksum items: a batch whose data did not land (its
//! fsync had not returned) ends the log, with every batch after it.
//!
//! ```text
//! batch: magic[8] | csum u32 | nrecords u32 | fsid[16] | generation u64 | seq u64 | payload_len u32 | pad u32
//!        records: kind u8, then
//!          1 insert:  tree u8 | key 17 | len u32 | value
//!          2 delete:  tree u8 | key 17
//!          3 dataref: bytenr u64 | len u64 | delta i64
//! ```
//! A commit makes every logged change durable in the trees; the next generation's
//! batches start again at the beginning of the area. Log writes and commit I/O are
//! serialised (the fs commit lock), so a new generation never overwrites the log of a
//! generation whose commit is not yet durable.

use std::collections::{HashMap, HashSet};

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::format::{csum, objectid, tree, Key, Reader, BLOCK_SIZE};

const LOG_MAGIC: [u8; 8] = *b"BIRCHLOG";

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy)]
#[repr(C)]
struct BatchHeader {
    magic: [u8; 8],
    csum: U32,
    nrecords: U32,
    fsid: [u8; 16],
    generation: U64,
    seq: U64,
    payload_len: U32,
    pad: U32,
}
const HEADER: usize = std::mem::size_of::<BatchHeader>();
const _: () = assert!(HEADER == 56);

/// One logged change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LogOp {
    Insert { tree: u64, key: Key, val: Vec<u8> },
    Delete { tree: u64, key: Key },
    DataRef { bytenr: u64, len: u64, delta: i64 },
}

fn tree_code(t: u64) -> u8 {
    match t {
        tree::FS => 1,
        tree::CSUM => 2,
        _ => unreachable!("only the fs and checksum trees are logged"),
    }
}

fn tree_of(c: u8) -> Option<u64> {
    match c {
        1 => Some(tree::FS),
        2 => Some(tree::CSUM),
        _ => None,
    }
}

impl LogOp {
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            LogOp::Insert { tree, key, val } => {
                out.push(1);
                out.push(tree_code(*tree));
                key.encode(out);
                out.extend_from_slice(&(val.len() as u32).to_le_bytes());
                out.extend_from_slice(val);
            }
            LogOp::Delete { tree, key } => {
                out.push(2);
                out.push(tree_code(*tree));
                key.encode(out);
            }
            LogOp::DataRef { bytenr, len, delta } => {
                out.push(3);
                out.extend_from_slice(&bytenr.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(&delta.to_le_bytes());
            }
        }
    }

    fn decode(r: &mut Reader<'_>) -> Option<LogOp> {
        Some(match r.u8()? {
            1 => {
                let tree = tree_of(r.u8()?)?;
                let key = Key::decode(r)?;
                let n = r.u32()? as usize;
                LogOp::Insert {
                    tree,
                    key,
                    val: r.bytes(n)?.to_vec(),
                }
            }
            2 => LogOp::Delete {
                tree: tree_of(r.u8()?)?,
                key: Key::decode(r)?,
            },
            3 => LogOp::DataRef {
                bytenr: r.u64()?,
                len: r.u64()?,
                delta: r.u64()? as i64,
            },
            _ => return None,
        })
    }

    /// The inode a record belongs to, for fsync's "nothing new" test.
    fn inode(&self) -> Option<u64> {
        match self {
            LogOp::Insert { tree: t, key, .. } | LogOp::Delete { tree: t, key }
                if *t == tree::FS =>
            {
                if key.objectid == objectid::ORPHAN {
                    Some(key.offset)
                } else if key.objectid < objectid::LAST_INODE {
                    Some(key.objectid)
                } else {
                    None
                }
            }
            _ => None,
        }
    }
}

/// A batch ready to write: bytes, where in the log area, and the LSN it makes durable.
pub(crate) struct Batch {
    pub(crate) buf: Vec<u8>,
    pub(crate) offset: u64,
    pub(crate) end_lsn: u64,
}

/// The running transaction's log state, kept in the store.
#[derive(Debug, Default)]
pub(crate) struct LogBuffer {
    /// Whether changes are recorded (off during mkfs and replay).
    pub(crate) enabled: bool,
    pending: Vec<u8>,
    pending_records: u32,
    /// LSN the next record gets; LSNs are global across generations.
    next_lsn: u64,
    /// Every record below this LSN is durable (logged and flushed, or committed).
    pub(crate) durable_lsn: u64,
    /// Every record below this LSN is in a batch written to the device (not
    /// necessarily flushed yet).
    pub(crate) written_lsn: u64,
    /// LSN that the commit in progress makes durable when it completes.
    committing_lsn: u64,
    /// Inode -> LSN just past its last record.
    last: HashMap<u64, u64>,
    /// Inode -> LSN just past the last change a read of its data depends on (creation,
    /// data, size): what fdatasync must make durable.
    last_data: HashMap<u64, u64>,
    /// Inodes with records in the pending buffer.
    pending_inos: HashSet<u64>,
    /// Inodes with records in a batch already written in this generation: their next
    /// fsync logs only what changed since (seed 1's case), counted in stats.
    logged_inos: HashSet<u64>,
    /// Bytes of the log area used by this generation's batches.
    tail: u64,
    seq: u64,
    /// Capacity of the log area.
    pub(crate) capacity: u64,
    /// The pending records no longer fit: the next fsync must commit.
    pub(crate) overflow: bool,
}

impl LogBuffer {
    pub(crate) fn new(capacity: u64) -> LogBuffer {
        LogBuffer {
            capacity,
            ..Default::default()
        }
    }

    /// Records one change of the running transaction.
    pub(crate) fn record(&mut self, op: LogOp) {
        if !self.enabled {
            return;
        }
        let lsn = self.next_lsn;
        self.next_lsn += 1;
        if let Some(ino) = op.inode() {
            self.last.insert(ino, lsn + 1);
            self.pending_inos.insert(ino);
        }
        if self.overflow {
            return;
        }
        op.encode(&mut self.pending);
        self.pending_records += 1;
        if (HEADER + self.pending.len()) as u64 > self.capacity.saturating_sub(self.tail) {
            // Keeping more would only use memory: the next fsync commits instead.
            self.overflow = true;
            self.pending = Vec::new();
            self.pending_records = 0;
        }
    }

    /// What an fsync (or, with `datasync`, an fdatasync) of `ino` must make durable:
    /// `None` when it already is.
    pub(crate) fn target(&self, ino: u64, datasync: bool) -> Option<u64> {
        let map = if datasync {
            &self.last_data
        } else {
            &self.last
        };
        match map.get(&ino) {
            Some(&l) if l > self.durable_lsn => Some(l),
            _ => None,
        }
    }

    /// The records so far of `ino` include a change its data depends on.
    pub(crate) fn mark_data(&mut self, ino: u64) {
        if self.enabled {
            self.last_data.insert(ino, self.next_lsn);
        }
    }

    /// Whether the area is over half used: time to commit, before an fsync has to.
    pub(crate) fn wants_commit(&self) -> bool {
        self.overflow || self.tail > self.capacity / 2
    }

    /// Whether `ino` already went to the log in this generation.
    pub(crate) fn logged_before(&self, ino: u64) -> bool {
        self.logged_inos.contains(&ino)
    }

    /// Takes every pending record as one batch; `None` if the log cannot hold it.
    pub(crate) fn take_batch(&mut self, fsid: &[u8; 16], generation: u64) -> Option<Batch> {
        if self.overflow {
            return None;
        }
        let len = (HEADER + self.pending.len()) as u64;
        let padded = len.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        if self.tail + padded > self.capacity {
            self.overflow = true;
            return None;
        }
        let payload = std::mem::take(&mut self.pending);
        let mut h = BatchHeader {
            magic: LOG_MAGIC,
            csum: 0.into(),
            nrecords: self.pending_records.into(),
            fsid: *fsid,
            generation: generation.into(),
            seq: self.seq.into(),
            payload_len: (payload.len() as u32).into(),
            pad: 0.into(),
        };
        let mut c = crc32c::crc32c(&h.as_bytes()[12..]);
        c = crc32c::crc32c_append(c, &payload);
        h.csum = c.into();
        let mut buf = Vec::with_capacity(padded as usize);
        buf.extend_from_slice(h.as_bytes());
        buf.extend_from_slice(&payload);
        buf.resize(padded as usize, 0);
        let b = Batch {
            buf,
            offset: self.tail,
            end_lsn: self.next_lsn,
        };
        self.tail += padded;
        self.seq += 1;
        self.pending_records = 0;
        let inos = std::mem::take(&mut self.pending_inos);
        self.logged_inos.extend(inos);
        Some(b)
    }

    /// A commit is being prepared: everything recorded so far is in it.
    pub(crate) fn commit_started(&mut self) {
        self.pending.clear();
        self.pending_inos.clear();
        self.logged_inos.clear();
        self.pending_records = 0;
        self.committing_lsn = self.next_lsn;
        self.tail = 0;
        self.seq = 0;
        self.overflow = false;
    }

    /// The commit is durable.
    pub(crate) fn commit_done(&mut self) {
        self.durable_lsn = self.durable_lsn.max(self.committing_lsn);
        let d = self.durable_lsn;
        self.last.retain(|_, l| *l > d);
        self.last_data.retain(|_, l| *l > d);
    }

    /// A batch is durable.
    pub(crate) fn batch_done(&mut self, end_lsn: u64) {
        self.durable_lsn = self.durable_lsn.max(end_lsn);
    }
}

/// Whether a log area whose first block is `first` holds batches of `generation`: only
/// then is the rest worth reading.
pub(crate) fn starts_a_log(first: &[u8], fsid: &[u8; 16], generation: u64) -> bool {
    BatchHeader::read_from_prefix(first).is_ok_and(|(h, _)| h.names(fsid, generation, 0))
}

impl BatchHeader {
    /// Whether this is the header of batch `seq` of `generation` of this filesystem
    /// (the payload's checksum is checked apart).
    fn names(&self, fsid: &[u8; 16], generation: u64, seq: u64) -> bool {
        self.magic == LOG_MAGIC
            && &self.fsid == fsid
            && self.generation.get() == generation
            && self.seq.get() == seq
    }
}

/// Parses the batches of `generation` in a log area image, in order, stopping at the
/// first that is not whole; returns the records of each batch.
pub(crate) fn parse(area: &[u8], fsid: &[u8; 16], generation: u64) -> Vec<Vec<LogOp>> {
    let mut batches = Vec::new();
    let mut off = 0usize;
    let mut seq = 0u64;
    while off + HEADER <= area.len() {
        let Ok((h, _)) = BatchHeader::read_from_prefix(&area[off..]) else {
            break;
        };
        if !h.names(fsid, generation, seq) {
            break;
        }
        let plen = h.payload_len.get() as usize;
        let Some(payload) = area.get(off + HEADER..off + HEADER + plen) else {
            break;
        };
        let mut c = crc32c::crc32c(&h.as_bytes()[12..]);
        c = crc32c::crc32c_append(c, payload);
        if c != h.csum.get() {
            break;
        }
        let mut r = Reader::new(payload);
        let mut ops = Vec::with_capacity(h.nrecords.get() as usize);
        let mut ok = true;
        for _ in 0..h.nrecords.get() {
            match LogOp::decode(&mut r) {
                Some(op) => ops.push(op),
                None => {
                    ok = false;
                    break;
                }
            }
        }
        if !ok || !r.is_empty() {
            break;
        }
        batches.push(ops);
        off += (HEADER + plen).div_ceil(BLOCK_SIZE as usize) * BLOCK_SIZE as usize;
        seq += 1;
    }
    batches
}

/// Whether every data block a batch's checksum items describe holds that data.
pub(crate) fn data_landed(ops: &[LogOp], read: &mut dyn FnMut(u64, &mut [u8]) -> bool) -> bool {
    for op in ops {
        if let LogOp::Insert { tree: t, key, val } = op {
            if *t != tree::CSUM {
                continue;
            }
            let mut buf = vec![0u8; val.len() / 4 * BLOCK_SIZE as usize];
            if !read(key.offset, &mut buf) {
                return false;
            }
            for (i, blk) in buf.chunks(BLOCK_SIZE as usize).enumerate() {
                let want = u32::from_le_bytes(val[i * 4..i * 4 + 4].try_into().unwrap());
                if csum(blk) != want {
                    return false;
                }
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(l: &mut LogBuffer) {
        l.record(LogOp::Insert {
            tree: tree::FS,
            key: Key::new(300, 1, 0),
            val: vec![1, 2, 3],
        });
        l.record(LogOp::Delete {
            tree: tree::CSUM,
            key: Key::new(objectid::CSUM, 128, 4096),
        });
        l.record(LogOp::DataRef {
            bytenr: 1 << 30,
            len: 8192,
            delta: -1,
        });
    }

    #[test]
    fn batches_roundtrip_in_order_and_stop_at_damage() {
        let fsid = [9; 16];
        let mut l = LogBuffer::new(1 << 20);
        l.enabled = true;
        sample(&mut l);
        assert_eq!(l.target(300, false), Some(1));
        assert_eq!(l.target(301, false), None);
        let b1 = l.take_batch(&fsid, 7).unwrap();
        l.batch_done(b1.end_lsn);
        assert_eq!(l.target(300, false), None, "logged inode: nothing new");
        assert!(l.logged_before(300) && !l.logged_before(301));
        l.record(LogOp::Insert {
            tree: tree::FS,
            key: Key::new(301, 1, 0),
            val: vec![],
        });
        let b2 = l.take_batch(&fsid, 7).unwrap();
        assert_eq!(
            b2.offset, 4096,
            "a batch never rewrites an earlier one's block"
        );
        let mut area = vec![0u8; 1 << 20];
        area[..b1.buf.len()].copy_from_slice(&b1.buf);
        area[b2.offset as usize..b2.offset as usize + b2.buf.len()].copy_from_slice(&b2.buf);
        let got = parse(&area, &fsid, 7);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].len(), 3);
        assert!(matches!(got[0][2], LogOp::DataRef { delta: -1, .. }));
        assert!(parse(&area, &fsid, 8).is_empty(), "other generation");
        assert!(parse(&area, &[1; 16], 7).is_empty(), "other filesystem");
        let mut torn = area.clone();
        torn[b2.offset as usize + 60] ^= 1;
        assert_eq!(
            parse(&torn, &fsid, 7).len(),
            1,
            "damaged second batch ends the log"
        );
        let mut first = area.clone();
        first[70] ^= 1;
        assert!(
            parse(&first, &fsid, 7).is_empty(),
            "damaged first batch: nothing after it counts"
        );
    }

    #[test]
    fn overflow_and_commit_reset() {
        let mut l = LogBuffer::new(8192);
        l.enabled = true;
        for i in 0..200 {
            l.record(LogOp::Insert {
                tree: tree::FS,
                key: Key::new(300, 1, i),
                val: vec![0; 100],
            });
        }
        assert!(l.overflow);
        assert!(l.take_batch(&[0; 16], 1).is_none());
        l.commit_started();
        assert!(!l.overflow);
        assert!(
            l.target(300, false).is_some(),
            "not durable until the commit is"
        );
        l.commit_done();
        assert_eq!(l.target(300, false), None);
    }
}
