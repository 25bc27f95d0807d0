//! Copy-on-write B+tree over a `NodeStore`.

mod node;
mod tree;

pub(crate) use node::Node;
pub(crate) use tree::{delete, insert, range, search, seek_le, NodeStore, Root};
