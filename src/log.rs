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
//! previous batch; it never rewrites a block an earlier batch of a live generation
//! wrote. The log area is a ring: a generation's batches start where the superblock's
//! `log_head` says and follow one another, wrapping to the start of the area when a
//! batch would not fit before its end. Replay reads batches from `log_head` while
//! magic, fsid, generation (the superblock's + 1), sequence and crc32c are right, then
//! checks the data blocks named by logged checksum items: a batch whose data did not
//! land (its fsync had not returned) ends the log, with every batch after it. So does
//! a batch naming blocks outside the data area of the superblock's size, which no
//! batch of that size can (a grow's commit lands before the log takes another batch),
//! or inserting an item larger than a node holds, which no batch can.
//!
//! ```text
//! batch: magic[8] | csum u32 | nrecords u32 | fsid[16] | generation u64 | seq u64 | payload_len u32 | flags u32
//!        records: kind u8, then
//!          1 insert:  tree u8 | key 17 | len u32 | value
//!          2 delete:  tree u8 | key 17
//!          3 dataref: bytenr u64 | len u64 | delta i64
//! ```
//! A commit makes every logged change durable in the trees, and fsyncs go on while it
//! is written (jbd2's running and committing transactions). When the commit is
//! prepared, the records not yet in a batch become one last batch of the generation,
//! flagged `CLOSES`; the next generation's batches follow it. If the commit lands,
//! replay starts at the next generation (the new superblock's `log_head`); if it does
//! not, replay reads the old generation to its closing batch and goes on into the
//! next, which applies on top of it: every operation is in the log, in order, either
//! way. The ring never overwrites the batches of a generation whose commit is not
//! durable. Where no closing batch fits (the log overflowed), no batch is written
//! until the commit is durable, as fsyncs then have nothing else to wait for.
//!
//! A crash can leave batches of the superblock's generation + 2 (written after a
//! closing batch that did not land) beyond where the new log will run; so a writable
//! mount skips a generation with its first commit, and no stale batch is ever read
//! as a new one.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

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
    flags: U32,
}
const HEADER: usize = std::mem::size_of::<BatchHeader>();
const _: () = assert!(HEADER == 56);
/// Batch flag: the last batch of its generation; the next generation's follow it.
const CLOSES: u32 = 1;
/// Capacity the pending-records buffer keeps after a batch (a rare huge batch does
/// not hold its memory for good).
const KEEP_PENDING: usize = 256 << 10;

/// Room a large log keeps free for the next generation's batches while a commit is
/// written: a commit starts once less than this (or a quarter of a small log) is
/// left. At W3's pace over io_uring (about 40 MB of log a second on a fast disk),
/// 64 MiB lasts well over a commit of every leaf of a 1 GiB file's trees.
pub(crate) const COMMIT_HEADROOM: u64 = 64 << 20;

/// The room to keep free in a log area of `capacity` bytes (see [`COMMIT_HEADROOM`]).
fn commit_headroom(capacity: u64) -> u64 {
    (capacity / 4).min(COMMIT_HEADROOM)
}

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
    /// The most a log flush that began (and has not failed) makes durable: an fsync
    /// whose records lie below it waits for that flush instead of flushing again. A
    /// failed flush sets it back to `durable_lsn`.
    pub(crate) flush_started: u64,
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
    /// Ring position (bytes since the area's offset 0, counting every lap) of the
    /// running generation's first batch.
    head: u64,
    /// Ring position where the next batch goes.
    tail: u64,
    /// Ring position of the oldest batch still needed: the first of the committing
    /// generation while its commit is in flight, else `head`.
    live: u64,
    seq: u64,
    /// Capacity of the log area.
    pub(crate) capacity: u64,
    /// The pending records no longer fit: the next fsync must commit.
    pub(crate) overflow: bool,
}

impl LogBuffer {
    /// An empty log over an area of `capacity` bytes whose next batch goes at `head`.
    pub(crate) fn new(capacity: u64, head: u64) -> LogBuffer {
        LogBuffer {
            capacity,
            head,
            tail: head,
            live: head,
            ..Default::default()
        }
    }

    /// Mount found `used` bytes of batches from the head on: the next batches go after
    /// them, which stay untouched until the next commit is durable.
    pub(crate) fn skip_found(&mut self, used: u64) {
        self.head += used;
        self.tail = self.head;
    }

    /// Bytes of the area not holding a live batch.
    fn room(&self) -> u64 {
        self.capacity.saturating_sub(self.tail - self.live)
    }

    /// Offset in the area of the running generation's first batch (the superblock's
    /// `log_head`).
    pub(crate) fn head_offset(&self) -> u64 {
        self.head.checked_rem(self.capacity).unwrap_or(0)
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
        if (HEADER + self.pending.len()) as u64 > self.room() {
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

    /// Whether the running generation's batches leave less than a quarter of the
    /// area, or [`COMMIT_HEADROOM`] of a large one: time to commit, before an fsync
    /// has to. The rest takes the next generation's batches while that commit is
    /// written.
    pub(crate) fn wants_commit(&self) -> bool {
        self.overflow || self.tail - self.head > self.capacity - commit_headroom(self.capacity)
    }

    /// Whether `ino` already went to the log in this generation.
    pub(crate) fn logged_before(&self, ino: u64) -> bool {
        self.logged_inos.contains(&ino)
    }

    /// Takes every pending record as one batch; `None` if the log cannot hold it.
    pub(crate) fn take_batch(&mut self, fsid: &[u8; 16], generation: u64) -> Option<Batch> {
        self.take(fsid, generation, 0)
    }

    /// Where a batch of `padded` bytes goes: after the last, or at the start of the
    /// area when it would not fit before its end; `None` if that reaches a live batch.
    fn place(&self, padded: u64) -> Option<u64> {
        let mut at = self.tail;
        let off = at % self.capacity.max(1);
        if off + padded > self.capacity {
            at += self.capacity - off;
        }
        (at + padded - self.live <= self.capacity).then_some(at)
    }

    fn take(&mut self, fsid: &[u8; 16], generation: u64, flags: u32) -> Option<Batch> {
        if self.overflow {
            return None;
        }
        let len = (HEADER + self.pending.len()) as u64;
        let padded = len.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        let Some(at) = self.place(padded) else {
            self.overflow = true;
            return None;
        };
        // The pending buffer keeps its capacity: a batch of the same size next
        // time grows no vector.
        let payload = &self.pending;
        let mut h = BatchHeader {
            magic: LOG_MAGIC,
            csum: 0.into(),
            nrecords: self.pending_records.into(),
            fsid: *fsid,
            generation: generation.into(),
            seq: self.seq.into(),
            payload_len: (payload.len() as u32).into(),
            flags: flags.into(),
        };
        let mut c = crc32c::crc32c(&h.as_bytes()[12..]);
        c = crc32c::crc32c_append(c, payload);
        h.csum = c.into();
        let mut buf = Vec::with_capacity(padded as usize);
        buf.extend_from_slice(h.as_bytes());
        buf.extend_from_slice(payload);
        buf.resize(padded as usize, 0);
        self.pending.clear();
        self.pending.shrink_to(KEEP_PENDING);
        let b = Batch {
            buf,
            offset: at % self.capacity,
            end_lsn: self.next_lsn,
        };
        self.tail = at + padded;
        self.seq += 1;
        self.pending_records = 0;
        let inos = std::mem::take(&mut self.pending_inos);
        self.logged_inos.extend(inos);
        Some(b)
    }

    /// A commit of `generation` is being prepared: everything recorded so far is in it,
    /// and the next generation's batches start after this one's. With `chain`, returns
    /// the batch that closes this generation's log (the records not yet in a batch),
    /// to be written before any batch of the next: those may then be written, and
    /// count, while the commit is in flight. `None` (no room, or not asked): no batch
    /// may be written before the commit is durable.
    pub(crate) fn commit_started(
        &mut self,
        fsid: &[u8; 16],
        generation: u64,
        chain: bool,
    ) -> Option<Batch> {
        let closing = if chain && self.enabled {
            self.take(fsid, generation, CLOSES)
        } else {
            None
        };
        self.pending.clear();
        self.pending_inos.clear();
        self.logged_inos.clear();
        self.pending_records = 0;
        self.committing_lsn = self.next_lsn;
        self.head = self.tail;
        self.seq = 0;
        self.overflow = false;
        closing
    }

    /// The commit is durable.
    pub(crate) fn commit_done(&mut self) {
        self.durable_lsn = self.durable_lsn.max(self.committing_lsn);
        let d = self.durable_lsn;
        self.last.retain(|_, l| *l > d);
        self.last_data.retain(|_, l| *l > d);
        self.live = self.head;
    }

    /// A batch is written (not yet flushed).
    pub(crate) fn batch_written(&mut self, end_lsn: u64) {
        self.written_lsn = self.written_lsn.max(end_lsn);
    }

    /// A batch is durable.
    pub(crate) fn batch_done(&mut self, end_lsn: u64) {
        self.durable_lsn = self.durable_lsn.max(end_lsn);
    }
}

/// The batches of one generation read from a log area.
#[derive(Debug, Default)]
pub(crate) struct Parsed {
    /// The records of each batch, in order.
    pub(crate) batches: Vec<Vec<LogOp>>,
    /// Offset in the area just past the last batch.
    pub(crate) end: u64,
    /// Bytes of the ring from the start to `end` (with the end of the area a batch
    /// wrapped over).
    pub(crate) used: u64,
    /// The last batch closes its generation: the next generation's batches follow.
    pub(crate) closed: bool,
}

/// Whether the log area image `area` may hold a batch of `generation` starting at
/// `head`: only then is the rest worth reading. `area` needs only the blocks at `head`
/// and at 0 (where a batch goes when it does not fit before the end).
pub(crate) fn starts_a_log(
    block_at_head: &[u8],
    block_at_zero: &[u8],
    fsid: &[u8; 16],
    generation: u64,
) -> bool {
    [block_at_head, block_at_zero]
        .iter()
        .any(|b| BatchHeader::read_from_prefix(b).is_ok_and(|(h, _)| h.names(fsid, generation, 0)))
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

/// Bytes a [`DevArea`] reads at once (more when one batch is larger).
const WINDOW: usize = 256 << 10;

/// The log area of a device, read a window of [`WINDOW`] bytes at a time as parsing
/// moves on, so that finding a few batches in a log area of hundreds of MiB reads
/// only those and holds only a window in memory.
pub(crate) struct DevArea<'a> {
    dev: &'a dyn crate::dev::BlockDev,
    /// Device offset of the area.
    start: u64,
    cap: usize,
    /// Bytes it reads at once: [`WINDOW`].
    window: usize,
    /// Area offset of `buf`'s first byte.
    lo: usize,
    buf: crate::dev::AlignedBuf,
    /// Bytes read from the device so far.
    pub(crate) read: u64,
}

impl<'a> DevArea<'a> {
    /// The `cap` bytes of `dev` from `start` (both multiples of the block size).
    pub(crate) fn new(dev: &'a dyn crate::dev::BlockDev, start: u64, cap: u64) -> Self {
        DevArea {
            dev,
            start,
            cap: cap as usize,
            window: WINDOW,
            lo: 0,
            buf: crate::dev::AlignedBuf::zeroed(0),
            read: 0,
        }
    }

    /// The `len` bytes at `off`, or `None` where they reach past the end of the area.
    fn get(&mut self, off: usize, len: usize) -> std::io::Result<Option<&[u8]>> {
        let Some(end) = off.checked_add(len).filter(|&e| e <= self.cap) else {
            return Ok(None);
        };
        if off < self.lo || end > self.lo + self.buf.len() {
            // Whole blocks, so that a block device reads them direct like every
            // other read of it.
            let bs = BLOCK_SIZE as usize;
            let lo = off / bs * bs;
            let n = (end - lo).max(self.window).div_ceil(bs) * bs;
            let n = n.min(self.cap - lo);
            let mut buf = crate::dev::AlignedBuf::zeroed(n);
            self.dev.read_at(&mut buf, self.start + lo as u64)?;
            self.read += n as u64;
            (self.lo, self.buf) = (lo, buf);
        }
        Ok(Some(&self.buf[off - self.lo..end - self.lo]))
    }
}

/// The header of batch `seq` of `generation` at `off` of `area`, if one is there.
fn header_at(
    area: &mut DevArea<'_>,
    off: usize,
    fsid: &[u8; 16],
    generation: u64,
    seq: u64,
) -> std::io::Result<Option<BatchHeader>> {
    let Some(b) = area.get(off, HEADER)? else {
        return Ok(None);
    };
    let (h, _) = BatchHeader::read_from_prefix(b).expect("HEADER bytes");
    Ok(h.names(fsid, generation, seq).then_some(h))
}

/// Parses the batches of `generation` in a log area from offset `start`, in order,
/// following them around the end of the area, and stopping at the first that is not
/// whole. Errors are the device's.
pub(crate) fn parse(
    area: &mut DevArea<'_>,
    fsid: &[u8; 16],
    generation: u64,
    start: u64,
) -> std::io::Result<Parsed> {
    let cap = area.cap;
    let mut out = Parsed {
        end: start,
        ..Default::default()
    };
    let mut off = start as usize;
    let mut seq = 0u64;
    // A generation's batches span at most one lap of the ring.
    let mut walked = 0usize;
    loop {
        // A batch that did not fit before the end of the area went to its start; a
        // batch of this generation and sequence is nowhere else.
        let (at, h) = match header_at(area, off, fsid, generation, seq)? {
            Some(h) => (off, h),
            None if off != 0 => match header_at(area, 0, fsid, generation, seq)? {
                Some(h) => (0, h),
                None => break,
            },
            None => break,
        };
        let plen = h.payload_len.get() as usize;
        let padded = (HEADER + plen).div_ceil(BLOCK_SIZE as usize) * BLOCK_SIZE as usize;
        walked += padded + if at == off { 0 } else { cap - off };
        if at + padded > cap || walked > cap {
            break;
        }
        let Some(payload) = area.get(at + HEADER, plen)? else {
            break;
        };
        let mut c = crc32c::crc32c(&h.as_bytes()[12..]);
        c = crc32c::crc32c_append(c, payload);
        if c != h.csum.get() {
            break;
        }
        let mut r = Reader::new(payload);
        let mut ops = Vec::with_capacity(h.nrecords.get().min(1 << 20) as usize);
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
        out.batches.push(ops);
        off = (at + padded) % cap;
        out.end = off as u64;
        out.used = walked as u64;
        out.closed = h.flags.get() & CLOSES != 0;
        seq += 1;
        if out.closed {
            break;
        }
    }
    Ok(out)
}

/// Whether every data block a batch names (in its reference changes, file extents
/// and checksum items) lies within `[lo, hi)`, the data area of the filesystem's
/// size, and outside `holes` (its superblock copies), as whole blocks: a range of
/// no blocks, or not on block boundaries, or a file extent or checksum item of the
/// wrong size, is refused too; and every item it inserts, at most `max_item` bytes,
/// fits in a node.
pub(crate) fn within(
    ops: &[LogOp],
    lo: u64,
    hi: u64,
    holes: &[(u64, u64)],
    max_item: usize,
) -> bool {
    let inside = |start: u64, len: u64| {
        len > 0
            && start % BLOCK_SIZE == 0
            && len % BLOCK_SIZE == 0
            && crate::txn::in_range(start, len, lo, hi, holes)
    };
    ops.iter().all(|op| match op {
        LogOp::Insert { val, .. } if val.len() > max_item => false,
        LogOp::DataRef { bytenr, len, .. } => inside(*bytenr, *len),
        LogOp::Insert { tree: t, key, val } if *t == tree::CSUM => {
            val.len() % 4 == 0 && inside(key.offset, (val.len() / 4) as u64 * BLOCK_SIZE)
        }
        LogOp::Insert { key, val, .. } if key.ty == crate::format::kind::EXTENT_DATA => {
            // One none birchfs writes (`FileExtent::flaw`) is replayed all the same:
            // every use of it refuses it (EIO), where refusing the batch would lose
            // every fsync after it, should a healthy write ever make one.
            crate::format::FileExtent::read_from_bytes(val).is_ok_and(|fe| {
                fe.disk_bytenr.get() == 0 || inside(fe.disk_bytenr.get(), fe.disk_len.get())
            })
        }
        _ => true,
    })
}

/// Blocks [`data_landed`] reads at a time.
const LANDED_CHUNK: usize = 64;

/// Whether every data block a batch's checksum items describe holds that data; a
/// read that fails is an error, not a block that did not land.
pub(crate) fn data_landed(
    ops: &[LogOp],
    read: &mut dyn FnMut(u64, &mut [u8]) -> std::io::Result<()>,
) -> std::io::Result<bool> {
    for op in ops {
        if let LogOp::Insert { tree: t, key, val } = op {
            if *t != tree::CSUM {
                continue;
            }
            // A chunk at a time: the item's size is the batch's word, not a bound.
            let bs = BLOCK_SIZE as usize;
            let mut buf = vec![0u8; (val.len() / 4).min(LANDED_CHUNK) * bs];
            for (c, sums) in val.chunks(LANDED_CHUNK * 4).enumerate() {
                let n = sums.len() / 4;
                let at = key.offset + (c * LANDED_CHUNK * bs) as u64;
                read(at, &mut buf[..n * bs])?;
                for (blk, want) in buf[..n * bs].chunks(bs).zip(sums.chunks_exact(4)) {
                    if csum(blk) != u32::from_le_bytes(want.try_into().unwrap()) {
                        return Ok(false);
                    }
                }
            }
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses an area image held in memory, read whole at once.
    fn parse_image(area: &[u8], fsid: &[u8; 16], generation: u64, start: u64) -> Parsed {
        let dev = crate::dev::MemDev::from_image(area.to_vec());
        let mut d = DevArea::new(&dev, 0, area.len() as u64);
        d.window = area.len();
        parse(&mut d, fsid, generation, start).unwrap()
    }

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

    /// `within` takes a batch whose reference changes, file extents and checksummed
    /// blocks all lie in the range as whole blocks, and refuses one with any of them
    /// reaching past either end or into a hole, off block boundaries, of no blocks,
    /// or of the wrong size, or with an item larger than a node holds.
    #[test]
    fn within_checks_references_and_checksummed_blocks_against_the_range() {
        let csum = |at: u64, blocks: usize| LogOp::Insert {
            tree: tree::CSUM,
            key: Key::new(objectid::CSUM, 128, at),
            val: vec![0; blocks * 4],
        };
        let dref = |bytenr: u64, len: u64| LogOp::DataRef {
            bytenr,
            len,
            delta: 1,
        };
        let (lo, hi) = (1 << 20, 96 << 20);
        let holes = [(64 << 20, 4096)];
        let max_item = crate::txn::max_item_size(16384);
        let ok = |ops: &[LogOp]| within(ops, lo, hi, &holes, max_item);
        assert!(ok(&[dref(lo, 4096), csum(hi - 8192, 2)]));
        assert!(ok(&[
            dref((64 << 20) - 4096, 4096),
            dref((64 << 20) + 4096, 4096)
        ]));
        assert!(!ok(&[dref(lo - 4096, 4096)]));
        assert!(!ok(&[dref(hi - 4096, 8192)]));
        assert!(!ok(&[dref(u64::MAX - 4095, 8192)]));
        assert!(!ok(&[dref(lo, 4096), csum(hi - 4096, 2)]));
        assert!(!ok(&[dref((64 << 20) - 4096, 8192)]));
        assert!(!ok(&[csum(64 << 20, 1)]));
        // Other items name no data blocks.
        let other = LogOp::Insert {
            tree: tree::FS,
            key: Key::new(300, 1, u64::MAX),
            val: vec![0; 8],
        };
        assert!(ok(&[other]));
        // Nor any item larger than a node holds.
        let item = |len: usize| LogOp::Insert {
            tree: tree::FS,
            key: Key::new(300, 1, 0),
            val: vec![0; len],
        };
        assert!(ok(&[item(max_item)]));
        assert!(!ok(&[item(max_item + 1)]));
        // Whole blocks only: not of none, nor off block boundaries.
        assert!(!ok(&[dref(lo, 0)]));
        assert!(!ok(&[dref(lo + 512, 4096)]));
        assert!(!ok(&[dref(lo, 4096 + 512)]));
        assert!(!ok(&[csum(lo, 0)]));
        let odd = LogOp::Insert {
            tree: tree::CSUM,
            key: Key::new(objectid::CSUM, 128, lo),
            val: vec![0; 6],
        };
        assert!(!ok(&[odd]));
        // File extents name their disk extent (none for a hole), and must decode.
        let fext = |bytenr: u64, len: u64| {
            let fe = crate::format::FileExtent {
                disk_bytenr: bytenr.into(),
                disk_len: len.into(),
                num_bytes: len.into(),
                ..Default::default()
            };
            LogOp::Insert {
                tree: tree::FS,
                key: Key::new(300, crate::format::kind::EXTENT_DATA, 0),
                val: fe.as_bytes().to_vec(),
            }
        };
        assert!(ok(&[fext(lo, 8192), fext(0, 8192)]));
        assert!(!ok(&[fext(hi, 4096)]));
        assert!(!ok(&[fext(64 << 20, 4096)]));
        assert!(!ok(&[fext(lo - 4096, 4096)]));
        let LogOp::Insert { tree, key, mut val } = fext(lo, 4096) else {
            unreachable!()
        };
        val.pop();
        assert!(!ok(&[LogOp::Insert { tree, key, val }]));
        // One off block boundaries in the file is no reason to stop: reads of it
        // fail instead.
        let LogOp::Insert { tree, key, val } = fext(lo, 4096) else {
            unreachable!()
        };
        let odd_key = Key::new(key.objectid, key.ty, 512);
        assert!(ok(&[LogOp::Insert {
            tree,
            key: odd_key,
            val
        }]));
    }

    /// `data_landed` checks every block of a checksum item, also one longer than
    /// it reads at a time, and only the blocks the item names.
    #[test]
    fn data_landed_checks_every_block_of_long_items() {
        let bs = BLOCK_SIZE as usize;
        let blocks = LANDED_CHUNK * 2 + 3;
        let at = 1 << 20;
        let mut disk = vec![0u8; (at as usize) + (blocks + 1) * bs];
        for (i, b) in disk[at as usize..].chunks_mut(bs).enumerate() {
            b.fill(i as u8 + 1);
        }
        let sums: Vec<u8> = disk[at as usize..]
            .chunks(bs)
            .take(blocks)
            .flat_map(|b| csum(b).to_le_bytes())
            .collect();
        let item = |val: Vec<u8>| {
            [LogOp::Insert {
                tree: tree::CSUM,
                key: Key::new(objectid::CSUM, 128, at),
                val,
            }]
        };
        let mut reads = Vec::new();
        let read = |disk: &[u8], off: u64, buf: &mut [u8], reads: &mut Vec<(u64, usize)>| {
            reads.push((off, buf.len()));
            buf.copy_from_slice(&disk[off as usize..off as usize + buf.len()]);
            Ok(())
        };
        assert!(data_landed(&item(sums.clone()), &mut |o, b| read(
            &disk, o, b, &mut reads
        ))
        .unwrap());
        assert_eq!(reads.len(), 3, "read in chunks: {reads:?}");
        assert_eq!(
            reads.iter().map(|r| r.1).sum::<usize>(),
            blocks * bs,
            "read past the item: {reads:?}"
        );
        // A block of the last chunk that did not land.
        disk[at as usize + (blocks - 1) * bs] ^= 1;
        assert!(!data_landed(&item(sums.clone()), &mut |o, b| read(
            &disk,
            o,
            b,
            &mut Vec::new()
        ))
        .unwrap());
        // A read that fails says nothing of whether the data landed.
        let failed = data_landed(&item(sums), &mut |_, _| {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        });
        assert!(failed.is_err(), "a failed read counted as data not landed");
    }

    /// Writes `b` into the area image.
    fn put(area: &mut [u8], b: &Batch) {
        area[b.offset as usize..b.offset as usize + b.buf.len()].copy_from_slice(&b.buf);
    }

    #[test]
    fn batches_roundtrip_in_order_and_stop_at_damage() {
        let fsid = [9; 16];
        let mut l = LogBuffer::new(1 << 20, 0);
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
        put(&mut area, &b1);
        put(&mut area, &b2);
        let got = parse_image(&area, &fsid, 7, 0);
        assert_eq!(got.batches.len(), 2);
        assert_eq!(got.batches[0].len(), 3);
        assert!(matches!(
            got.batches[0][2],
            LogOp::DataRef { delta: -1, .. }
        ));
        assert_eq!((got.end, got.used, got.closed), (8192, 8192, false));
        assert!(
            parse_image(&area, &fsid, 8, 0).batches.is_empty(),
            "other generation"
        );
        assert!(
            parse_image(&area, &[1; 16], 7, 0).batches.is_empty(),
            "other filesystem"
        );
        let mut torn = area.clone();
        torn[b2.offset as usize + 60] ^= 1;
        assert_eq!(
            parse_image(&torn, &fsid, 7, 0).batches.len(),
            1,
            "damaged second batch ends the log"
        );
        let mut first = area.clone();
        first[70] ^= 1;
        assert!(
            parse_image(&first, &fsid, 7, 0).batches.is_empty(),
            "damaged first batch: nothing after it counts"
        );
    }

    /// Read from a device a window at a time, a log finds the same batches as from
    /// the whole area in memory, batches larger than a window and batches across
    /// the end of the area included, and reads only about as much as the batches
    /// take, not the whole area.
    #[test]
    fn a_log_read_a_window_at_a_time_parses_as_the_whole_area() {
        use crate::dev::{BlockDev, MemDev};
        let fsid = [5; 16];
        let cap: u64 = 64 * WINDOW as u64;
        let head = cap - WINDOW as u64 - 4096;
        let mut l = LogBuffer::new(cap, head);
        l.enabled = true;
        let mut area = vec![0u8; cap as usize];
        // Small batches, then one of more than a window (it wraps to the start of
        // the area, as it does not fit before the end), then small ones again.
        let sizes = [10usize, 3000, 20_000, 5, WINDOW + 70_000, 100, 9000, 1];
        for (i, &n) in sizes.iter().enumerate() {
            l.record(LogOp::Insert {
                tree: tree::FS,
                key: Key::new(300 + i as u64, 1, 0),
                val: vec![i as u8; n],
            });
            let b = l.take_batch(&fsid, 9).unwrap();
            put(&mut area, &b);
        }
        let want = parse_image(&area, &fsid, 9, head);
        assert_eq!(want.batches.len(), sizes.len());
        assert!(want.end < head, "the log wrapped");
        // The area sits 8 KiB into the device.
        let dev = MemDev::new(cap + 8192 + 4096);
        dev.write_at(&area, 8192).unwrap();
        let mut d = DevArea::new(&dev, 8192, cap);
        let got = parse(&mut d, &fsid, 9, head).unwrap();
        assert_eq!(got.batches, want.batches);
        assert_eq!(
            (got.end, got.used, got.closed),
            (want.end, want.used, want.closed)
        );
        assert!(
            d.read <= want.used + 4 * WINDOW as u64 && d.read < cap / 4,
            "read {} bytes of a {cap}-byte area for {} bytes of log",
            d.read,
            want.used
        );
        // A device that fails to read is an error, not an empty log.
        struct Failing;
        impl BlockDev for Failing {
            fn read_at(&self, _: &mut [u8], _: u64) -> std::io::Result<()> {
                Err(std::io::Error::from_raw_os_error(libc::EIO))
            }
            fn write_at(&self, _: &[u8], _: u64) -> std::io::Result<()> {
                Ok(())
            }
            fn flush(&self) -> std::io::Result<()> {
                Ok(())
            }
            fn size(&self) -> u64 {
                1 << 30
            }
        }
        assert!(parse(&mut DevArea::new(&Failing, 0, cap), &fsid, 9, head).is_err());
    }

    /// A commit starts once the running generation leaves less than a quarter of a
    /// small log free, and less than [`COMMIT_HEADROOM`] of a large one.
    #[test]
    fn a_commit_starts_when_the_headroom_is_used() {
        for (cap, room) in [
            (8 * 4096, 2 * 4096),
            (256 << 20, 64 << 20),
            (512 << 20, 64 << 20),
        ] {
            let mut l = LogBuffer::new(cap, 4096);
            l.enabled = true;
            assert!(!l.wants_commit(), "{cap}: empty");
            l.tail = l.head + cap - room;
            assert!(!l.wants_commit(), "{cap}: {room} left");
            l.tail += 4096;
            assert!(l.wants_commit(), "{cap}: less than {room} left");
        }
        // Through batches: one block each, in an area of eight.
        let mut l = LogBuffer::new(8 * 4096, 0);
        l.enabled = true;
        for i in 0..7 {
            assert_eq!(l.wants_commit(), i > 6, "after {i} batches");
            l.record(LogOp::Insert {
                tree: tree::FS,
                key: Key::new(300 + i, 1, 0),
                val: vec![1; 10],
            });
            l.take_batch(&[0; 16], 1).unwrap();
        }
        assert!(l.wants_commit(), "after 7 batches");
    }

    #[test]
    fn overflow_and_commit_reset() {
        let mut l = LogBuffer::new(8192, 0);
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
        assert!(
            l.commit_started(&[0; 16], 1, true).is_none(),
            "an overflowed log has no closing batch"
        );
        assert!(!l.overflow);
        assert!(
            l.target(300, false).is_some(),
            "not durable until the commit is"
        );
        l.commit_done();
        assert_eq!(l.target(300, false), None);
    }

    /// A commit closes the log of its generation with one batch; the next
    /// generation's batches follow it, wrap around the end of the area, and never
    /// reach the closed generation's batches before its commit is done.
    #[test]
    fn commits_chain_generations_around_the_ring() {
        let fsid = [3; 16];
        let cap = 8 * 4096;
        let mut l = LogBuffer::new(cap, 5 * 4096);
        l.enabled = true;
        let mut area = vec![0u8; cap as usize];
        let rec = |l: &mut LogBuffer, ino: u64| {
            l.record(LogOp::Insert {
                tree: tree::FS,
                key: Key::new(ino, 1, 0),
                val: vec![ino as u8; 10],
            })
        };
        rec(&mut l, 300);
        let b = l.take_batch(&fsid, 4).unwrap();
        assert_eq!(b.offset, 5 * 4096);
        put(&mut area, &b);
        rec(&mut l, 301);
        let close = l.commit_started(&fsid, 4, true).unwrap();
        assert_eq!(close.offset, 6 * 4096);
        put(&mut area, &close);
        assert_eq!(l.head_offset(), 7 * 4096, "the next generation follows");
        // Generation 5, while commit 4 is in flight: 7, then around to 0, 1, 2, 3, 4.
        let mut offs = Vec::new();
        for i in 0..6 {
            rec(&mut l, 400 + i);
            let b = l.take_batch(&fsid, 5).unwrap();
            offs.push(b.offset / 4096);
            put(&mut area, &b);
        }
        assert_eq!(offs, [7, 0, 1, 2, 3, 4]);
        rec(&mut l, 500);
        assert!(
            l.take_batch(&fsid, 5).is_none(),
            "the area is full up to the committing generation's first batch"
        );
        let old = parse_image(&area, &fsid, 4, 5 * 4096);
        assert_eq!(old.batches.len(), 2);
        assert!(old.closed);
        assert_eq!(old.end, 7 * 4096);
        let next = parse_image(&area, &fsid, 5, old.end);
        assert_eq!(next.batches.len(), 6, "read across the end of the area");
        assert_eq!(next.used, 6 * 4096);
        assert!(!next.closed);
        // Once commit 4 is durable its batches' room is free again.
        l.commit_done();
        l.overflow = false;
        rec(&mut l, 501);
        let b = l.take_batch(&fsid, 5).unwrap();
        assert_eq!(b.offset, 5 * 4096);
    }

    /// A batch that does not fit before the end of the area goes to its start, and
    /// replay finds it there.
    #[test]
    fn a_batch_that_does_not_fit_wraps_to_the_start() {
        let fsid = [4; 16];
        let cap = 6 * 4096;
        let mut l = LogBuffer::new(cap, 5 * 4096);
        l.enabled = true;
        l.record(LogOp::Insert {
            tree: tree::FS,
            key: Key::new(300, 1, 0),
            val: vec![1; 5000],
        });
        let b = l.take_batch(&fsid, 2).unwrap();
        assert_eq!((b.offset, b.buf.len()), (0, 8192));
        let mut area = vec![0u8; cap as usize];
        // A stale batch of another generation where the batch did not fit.
        let mut other = LogBuffer::new(cap, 5 * 4096);
        other.enabled = true;
        other.record(LogOp::Delete {
            tree: tree::FS,
            key: Key::new(300, 1, 0),
        });
        put(&mut area, &other.take_batch(&fsid, 1).unwrap());
        put(&mut area, &b);
        let got = parse_image(&area, &fsid, 2, 5 * 4096);
        assert_eq!(got.batches.len(), 1);
        assert_eq!((got.end, got.used), (8192, 3 * 4096));
        assert_eq!(parse_image(&area, &fsid, 1, 5 * 4096).batches.len(), 1);
    }
}
