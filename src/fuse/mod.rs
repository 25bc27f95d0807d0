//! The FUSE front door: kernel requests, from `/dev/fuse` (through fuser) or from
//! io_uring queues, mapped onto [`crate::Fs`].

pub(crate) mod abi;
mod answer;
mod classic;
#[cfg(test)]
mod crash_tests;
mod direct;
mod group;
mod ops;
mod standby;
pub mod uring;

pub use abi::{BIRCHFS_IOC_RESIZE, BIRCHFS_IOC_SYNC, FITRIM, RESIZE_GROW, RESIZE_QUERY};
pub use ops::{FuseFs, Timeouts, SNAPSHOT_XATTR, SPACE_XATTR, STATS_XATTR};
