//! Copy-on-write B+tree over a `NodeStore`.

mod node;
mod tree;

pub(crate) use node::Node;
pub(crate) use tree::{
    delete, insert, load_child, load_root, range, search, seek_le, NodeStore, Root,
};
