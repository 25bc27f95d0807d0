//! Replies, whichever way a request came: fuser's `Reply*` types for requests read
//! from `/dev/fuse`, [`super::uring::RingReply`] for requests from an io_uring queue.
//!
//! Each handler in [`super::ops`] is generic over the kind of answer it gives, so one
//! body serves both transports. An answer is an owned value: it can be given later
//! from another thread, which is how the group commit answers every waiting fsync
//! after one flush.

use std::ffi::OsStr;
use std::time::Duration;

use fuser::{
    Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek,
    ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
};

/// Any answer: it can carry an error.
pub(crate) trait Answer: Send + 'static {
    /// Answers with `err`.
    fn error(self, err: Errno);
}

/// An answer that carries nothing but success.
pub(crate) trait AnswerEmpty: Answer {
    /// Answers with success.
    fn ok(self);
}

/// An answer that names an inode (lookup, mknod, mkdir, symlink, link).
pub(crate) trait AnswerEntry: Answer {
    /// Answers with the inode's attributes, cached by the kernel for `ttl`.
    fn entry(self, ttl: &Duration, attr: &FileAttr, generation: Generation);
}

/// An answer with attributes (getattr, setattr).
pub(crate) trait AnswerAttr: Answer {
    /// Answers with `attr`, cached by the kernel for `ttl`.
    fn attr(self, ttl: &Duration, attr: &FileAttr);
}

/// An answer with bytes (read, readlink).
pub(crate) trait AnswerData: Answer {
    /// Answers with `data`.
    fn data(self, data: &[u8]);
}

/// An answer to an open.
pub(crate) trait AnswerOpen: Answer {
    /// Answers with a file handle and open flags.
    fn opened(self, fh: FileHandle, flags: FopenFlags);
}

/// An answer with a byte count (write, copy_file_range).
pub(crate) trait AnswerWrite: Answer {
    /// Answers that `size` bytes were written.
    fn written(self, size: u32);
}

/// An answer with a file offset (lseek's SEEK_DATA and SEEK_HOLE).
pub(crate) trait AnswerLseek: Answer {
    /// Answers with `offset`.
    fn offset(self, offset: u64);
}

/// An answer to an ioctl.
pub(crate) trait AnswerIoctl: Answer {
    /// Answers with the ioctl's return value and the bytes it gives back.
    fn ioctl(self, result: i32, data: &[u8]);
}

/// An answer to a create: the new entry and its open file.
pub(crate) trait AnswerCreate: Answer {
    /// Answers with the new inode and its file handle.
    fn created(
        self,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
        fh: FileHandle,
        flags: FopenFlags,
    );
}

/// An answer to statfs.
pub(crate) trait AnswerStatfs: Answer {
    /// Answers with the filesystem's counts.
    #[allow(clippy::too_many_arguments)]
    fn statfs(
        self,
        blocks: u64,
        bfree: u64,
        bavail: u64,
        files: u64,
        ffree: u64,
        bsize: u32,
        namelen: u32,
        frsize: u32,
    );
}

/// An answer to getxattr or listxattr.
pub(crate) trait AnswerXattr: Answer {
    /// Answers with the size the value would need (the caller asked with size 0).
    fn size(self, size: u32);
    /// Answers with the value.
    fn data(self, data: &[u8]);
}

/// An answer to readdir, filled entry by entry.
pub(crate) trait AnswerDir: Answer {
    /// Adds an entry; true when it did not fit (the reply is full).
    fn add(&mut self, ino: INodeNo, offset: u64, kind: FileType, name: &OsStr) -> bool;
    /// Answers with the entries added.
    fn ok(self);
}

/// An answer to readdirplus, filled entry by entry.
pub(crate) trait AnswerDirPlus: Answer {
    /// Adds an entry with its attributes; true when it did not fit.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        ino: INodeNo,
        offset: u64,
        name: &OsStr,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
    ) -> bool;
    /// Answers with the entries added.
    fn ok(self);
}

/// A boxed success-or-error answer, for answers kept in a queue (fsyncs waiting for
/// the group commit).
pub(crate) type Done = Box<dyn FnOnce(Result<(), Errno>) + Send>;

/// Boxes `reply` as a [`Done`].
pub(crate) fn done(reply: impl AnswerEmpty) -> Done {
    Box::new(move |r| match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    })
}

macro_rules! fuser_answer {
    ($($t:ty),*) => {$(
        impl Answer for $t {
            fn error(self, err: Errno) {
                <$t>::error(self, err)
            }
        }
    )*};
}

fuser_answer!(
    ReplyEmpty,
    ReplyEntry,
    ReplyAttr,
    ReplyData,
    ReplyOpen,
    ReplyWrite,
    ReplyLseek,
    ReplyCreate,
    ReplyStatfs,
    ReplyXattr,
    ReplyDirectory,
    ReplyDirectoryPlus,
    ReplyIoctl
);

impl AnswerEmpty for ReplyEmpty {
    fn ok(self) {
        ReplyEmpty::ok(self)
    }
}

impl AnswerEntry for ReplyEntry {
    fn entry(self, ttl: &Duration, attr: &FileAttr, generation: Generation) {
        ReplyEntry::entry(self, ttl, attr, generation)
    }
}

impl AnswerAttr for ReplyAttr {
    fn attr(self, ttl: &Duration, attr: &FileAttr) {
        ReplyAttr::attr(self, ttl, attr)
    }
}

impl AnswerData for ReplyData {
    fn data(self, data: &[u8]) {
        ReplyData::data(self, data)
    }
}

impl AnswerOpen for ReplyOpen {
    fn opened(self, fh: FileHandle, flags: FopenFlags) {
        ReplyOpen::opened(self, fh, flags)
    }
}

impl AnswerWrite for ReplyWrite {
    fn written(self, size: u32) {
        ReplyWrite::written(self, size)
    }
}

impl AnswerLseek for ReplyLseek {
    fn offset(self, offset: u64) {
        ReplyLseek::offset(self, offset as i64)
    }
}

impl AnswerIoctl for ReplyIoctl {
    fn ioctl(self, result: i32, data: &[u8]) {
        ReplyIoctl::ioctl(self, result, data)
    }
}

impl AnswerCreate for ReplyCreate {
    fn created(
        self,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
        fh: FileHandle,
        flags: FopenFlags,
    ) {
        ReplyCreate::created(self, ttl, attr, generation, fh, flags)
    }
}

impl AnswerStatfs for ReplyStatfs {
    fn statfs(
        self,
        blocks: u64,
        bfree: u64,
        bavail: u64,
        files: u64,
        ffree: u64,
        bsize: u32,
        namelen: u32,
        frsize: u32,
    ) {
        ReplyStatfs::statfs(
            self, blocks, bfree, bavail, files, ffree, bsize, namelen, frsize,
        )
    }
}

impl AnswerXattr for ReplyXattr {
    fn size(self, size: u32) {
        ReplyXattr::size(self, size)
    }
    fn data(self, data: &[u8]) {
        ReplyXattr::data(self, data)
    }
}

impl AnswerDir for ReplyDirectory {
    fn add(&mut self, ino: INodeNo, offset: u64, kind: FileType, name: &OsStr) -> bool {
        ReplyDirectory::add(self, ino, offset, kind, name)
    }
    fn ok(self) {
        ReplyDirectory::ok(self)
    }
}

impl AnswerDirPlus for ReplyDirectoryPlus {
    fn add(
        &mut self,
        ino: INodeNo,
        offset: u64,
        name: &OsStr,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
    ) -> bool {
        ReplyDirectoryPlus::add(self, ino, offset, name, ttl, attr, generation)
    }
    fn ok(self) {
        ReplyDirectoryPlus::ok(self)
    }
}
