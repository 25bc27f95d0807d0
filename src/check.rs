//! fsck.
