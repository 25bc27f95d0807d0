//! B+tree operations: search, range, insert, delete, split and merge.
//!
//! Every change copies the nodes on its path (CoW) unless they were already copied in
//! the running generation; the caller's `Root` is updated to the new root address.
//! Nodes are split by encoded size; `MAX_ITEM_SIZE` keeps two items in one node so a
//! split always leaves both halves within a node. A child that falls under a quarter
//! full is merged with a sibling, or the pair is rebalanced when both do not fit.
//!
//! A child is trusted only if its level is its parent's minus one and its generation
//! is the one its parent records; otherwise the read fails as corruption.

use std::sync::Arc;

use super::node::Node;
use crate::error::{Error, Result};
use crate::format::{leaf_item_size, Key, NodeBody, NODE_HEADER_SIZE, PTR_SIZE};

/// The root of one tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Root {
    pub(crate) addr: u64,
    pub(crate) level: u8,
    pub(crate) owner: u64,
}

/// Where nodes come from and go to: the transaction layer implements it.
pub(crate) trait NodeStore {
    /// The node at `addr`, from cache or device, verified.
    fn read_node(&mut self, addr: u64) -> Result<Arc<Node>>;
    /// The address of a copy of `addr` writable in the running generation.
    fn cow_node(&mut self, addr: u64) -> Result<u64>;
    /// The node at `addr`, which must be writable in the running generation.
    fn node_mut(&mut self, addr: u64) -> &mut Node;
    /// Allocates a new node in the running generation.
    fn new_node(&mut self, owner: u64, level: u8, body: NodeBody) -> Result<u64>;
    /// Drops this tree's reference to a node.
    fn free_node(&mut self, addr: u64);
    /// Node size in bytes.
    fn node_size(&self) -> usize;
}

/// Reads a tree's root node, checking its level and owner against the root item.
pub(crate) fn load_root<S: NodeStore>(s: &mut S, root: &Root) -> Result<Arc<Node>> {
    let n = s.read_node(root.addr)?;
    if n.hdr.level != root.level || n.hdr.owner != root.owner {
        return Err(Error::corrupt(
            "tree node",
            root.addr,
            format!(
                "root level/owner {}/{} expected {}/{}",
                n.hdr.level, n.hdr.owner, root.level, root.owner
            ),
        ));
    }
    Ok(n)
}

/// Reads child `i` of `parent`, checking its level, generation and owner against the
/// parent's pointer.
pub(crate) fn load_child<S: NodeStore>(s: &mut S, parent: &Node, i: usize) -> Result<Arc<Node>> {
    let (_, addr, gen) = parent.ptrs()[i];
    let n = s.read_node(addr)?;
    if n.hdr.level + 1 != parent.hdr.level
        || n.hdr.generation != gen
        || n.hdr.owner != parent.hdr.owner
    {
        return Err(Error::corrupt(
            "tree node",
            addr,
            format!(
                "child level/gen/owner {}/{}/{} but parent expects {}/{}/{}",
                n.hdr.level,
                n.hdr.generation,
                n.hdr.owner,
                parent.hdr.level - 1,
                gen,
                parent.hdr.owner
            ),
        ));
    }
    Ok(n)
}

/// The value stored under `key`.
pub(crate) fn search<S: NodeStore>(s: &mut S, root: &Root, key: &Key) -> Result<Option<Vec<u8>>> {
    let mut n = load_root(s, root)?;
    loop {
        match n.body() {
            NodeBody::Leaf(items) => {
                return Ok(items
                    .binary_search_by(|(k, _)| k.cmp(key))
                    .ok()
                    .map(|i| items[i].1.clone()))
            }
            NodeBody::Internal(_) => {
                let i = n.child_index(key);
                n = load_child(s, &n, i)?;
            }
        }
    }
}

/// Up to `limit` items with `start <= key < end`, in key order.
pub(crate) fn range<S: NodeStore>(
    s: &mut S,
    root: &Root,
    start: &Key,
    end: &Key,
    limit: usize,
) -> Result<Vec<(Key, Vec<u8>)>> {
    let mut out = Vec::new();
    let n = load_root(s, root)?;
    range_rec(s, &n, start, end, limit, &mut out)?;
    Ok(out)
}

fn range_rec<S: NodeStore>(
    s: &mut S,
    n: &Node,
    start: &Key,
    end: &Key,
    limit: usize,
    out: &mut Vec<(Key, Vec<u8>)>,
) -> Result<()> {
    match n.body() {
        NodeBody::Leaf(items) => {
            let i0 = items.partition_point(|(k, _)| k < start);
            for (k, v) in &items[i0..] {
                if k >= end || out.len() >= limit {
                    break;
                }
                out.push((*k, v.clone()));
            }
        }
        NodeBody::Internal(ptrs) => {
            let i0 = n.child_index(start);
            for (i, p) in ptrs.iter().enumerate().skip(i0) {
                if (i > i0 && p.0 >= *end) || out.len() >= limit {
                    break;
                }
                let c = load_child(s, n, i)?;
                range_rec(s, &c, start, end, limit, out)?;
            }
        }
    }
    Ok(())
}

/// The item with the largest key `<= key`.
pub(crate) fn seek_le<S: NodeStore>(
    s: &mut S,
    root: &Root,
    key: &Key,
) -> Result<Option<(Key, Vec<u8>)>> {
    let n = load_root(s, root)?;
    seek_le_rec(s, &n, key)
}

fn seek_le_rec<S: NodeStore>(s: &mut S, n: &Node, key: &Key) -> Result<Option<(Key, Vec<u8>)>> {
    match n.body() {
        NodeBody::Leaf(items) => {
            let i = items.partition_point(|(k, _)| k <= key);
            Ok(if i == 0 {
                None
            } else {
                Some(items[i - 1].clone())
            })
        }
        NodeBody::Internal(_) => {
            let i = n.child_index(key);
            for j in (0..=i).rev() {
                let c = load_child(s, n, j)?;
                if let Some(x) = seek_le_rec(s, &c, key)? {
                    return Ok(Some(x));
                }
            }
            Ok(None)
        }
    }
}

/// Inserts `key`, replacing any value it had.
pub(crate) fn insert<S: NodeStore>(
    s: &mut S,
    root: &mut Root,
    key: Key,
    val: Vec<u8>,
) -> Result<()> {
    let top = load_root(s, root)?;
    let (addr, split) = insert_rec(s, top, key, val)?;
    root.addr = addr;
    if let Some((skey, saddr, sgen)) = split {
        let left = s.read_node(addr)?;
        let first = left.first_key().unwrap_or(Key::MIN);
        let body = NodeBody::Internal(vec![
            (first, addr, left.hdr.generation),
            (skey, saddr, sgen),
        ]);
        root.addr = s.new_node(root.owner, root.level + 1, body)?;
        root.level += 1;
    }
    Ok(())
}

type Split = Option<(Key, u64, u64)>;

/// Takes `node` by value and lets go of it before changing the node in place: a
/// node already written in this transaction is changed without a copy only when
/// nobody else holds it (`Arc::make_mut`).
fn insert_rec<S: NodeStore>(
    s: &mut S,
    node: Arc<Node>,
    key: Key,
    val: Vec<u8>,
) -> Result<(u64, Split)> {
    let child = if node.hdr.level == 0 {
        None
    } else {
        let i = node.child_index(&key);
        Some((i, load_child(s, &node, i)?))
    };
    let naddr = node.hdr.addr;
    drop(node);
    let addr = s.cow_node(naddr)?;
    match child {
        None => s.node_mut(addr).put_item(key, val),
        Some((i, child)) => {
            let (caddr, split) = insert_rec(s, child, key, val)?;
            let cgen = s.read_node(caddr)?.hdr.generation;
            let p = s.node_mut(addr).ptrs_mut();
            p[i].1 = caddr;
            p[i].2 = cgen;
            if key < p[i].0 {
                p[i].0 = key;
            }
            if let Some(sp) = split {
                p.insert(i + 1, sp);
            }
        }
    }
    let split = if s.node_mut(addr).encoded_size() > s.node_size() {
        Some(split_node(s, addr)?)
    } else {
        None
    };
    Ok((addr, split))
}

/// Index that divides `sizes` into two halves of the most even byte counts.
fn balanced_split(sizes: &[usize]) -> usize {
    let total: usize = sizes.iter().sum();
    let mut best = (usize::MAX, 1);
    let mut left = 0;
    for (i, sz) in sizes.iter().enumerate().take(sizes.len() - 1) {
        left += sz;
        let worst = left.max(total - left);
        if worst < best.0 {
            best = (worst, i + 1);
        }
    }
    best.1
}

fn item_sizes(n: &Node) -> Vec<usize> {
    match n.body() {
        NodeBody::Leaf(v) => v.iter().map(|(_, d)| leaf_item_size(d.len())).collect(),
        NodeBody::Internal(v) => vec![PTR_SIZE; v.len()],
    }
}

fn split_node<S: NodeStore>(s: &mut S, addr: u64) -> Result<(Key, u64, u64)> {
    let n = s.node_mut(addr);
    let at = balanced_split(&item_sizes(n));
    let (owner, level) = (n.hdr.owner, n.hdr.level);
    let right = match n.body_mut() {
        NodeBody::Leaf(v) => NodeBody::Leaf(v.split_off(at)),
        NodeBody::Internal(v) => NodeBody::Internal(v.split_off(at)),
    };
    let rkey = match &right {
        NodeBody::Leaf(v) => v[0].0,
        NodeBody::Internal(v) => v[0].0,
    };
    let raddr = s.new_node(owner, level, right)?;
    let rgen = s.read_node(raddr)?.hdr.generation;
    Ok((rkey, raddr, rgen))
}

/// Deletes `key`; returns whether it was there.
pub(crate) fn delete<S: NodeStore>(s: &mut S, root: &mut Root, key: &Key) -> Result<bool> {
    if search(s, root, key)?.is_none() {
        return Ok(false);
    }
    let top = load_root(s, root)?;
    root.addr = delete_rec(s, top, key)?;
    loop {
        let n = s.read_node(root.addr)?;
        if n.hdr.level > 0 && n.len() == 1 {
            let child = n.ptrs()[0].1;
            s.free_node(root.addr);
            root.addr = child;
            root.level -= 1;
        } else {
            break;
        }
    }
    Ok(true)
}

/// Takes `node` by value for the same reason as `insert_rec`.
fn delete_rec<S: NodeStore>(s: &mut S, node: Arc<Node>, key: &Key) -> Result<u64> {
    let naddr = node.hdr.addr;
    if node.hdr.level == 0 {
        drop(node);
        let addr = s.cow_node(naddr)?;
        s.node_mut(addr).remove_item(key);
        return Ok(addr);
    }
    let i = node.child_index(key);
    let child = load_child(s, &node, i)?;
    drop(node);
    let addr = s.cow_node(naddr)?;
    let caddr = delete_rec(s, child, key)?;
    let cgen = s.read_node(caddr)?.hdr.generation;
    {
        let p = s.node_mut(addr).ptrs_mut();
        p[i].1 = caddr;
        p[i].2 = cgen;
    }
    let small = s.read_node(caddr)?.encoded_size() < s.node_size() / 4;
    let nchildren = s.node_mut(addr).len();
    if small && nchildren > 1 {
        let j = if i > 0 { i - 1 } else { i + 1 };
        rebalance(s, addr, i.min(j))?;
    }
    Ok(addr)
}

/// Merges children `li` and `li + 1` of the writable node `addr`, or evens them out
/// when they do not fit in one node.
fn rebalance<S: NodeStore>(s: &mut S, addr: u64, li: usize) -> Result<()> {
    let parent = s.read_node(addr)?;
    let ln = load_child(s, &parent, li)?;
    let rn = load_child(s, &parent, li + 1)?;
    drop(parent);
    let (lorig, rorig) = (ln.hdr.addr, rn.hdr.addr);
    let combined = ln.encoded_size() + rn.encoded_size() - NODE_HEADER_SIZE;
    drop((ln, rn));
    let la = s.cow_node(lorig)?;
    let ra = s.cow_node(rorig)?;
    let node_size = s.node_size();
    let rbody = std::mem::replace(s.node_mut(ra).body_mut(), NodeBody::Leaf(Vec::new()));
    let l = s.node_mut(la);
    match (l.body_mut(), rbody) {
        (NodeBody::Leaf(a), NodeBody::Leaf(b)) => a.extend(b),
        (NodeBody::Internal(a), NodeBody::Internal(b)) => a.extend(b),
        _ => {
            return Err(Error::corrupt(
                "tree node",
                ra,
                "siblings of different levels",
            ))
        }
    }
    let lgen = l.hdr.generation;
    if combined <= node_size {
        s.free_node(ra);
        let p = s.node_mut(addr).ptrs_mut();
        p[li].1 = la;
        p[li].2 = lgen;
        p.remove(li + 1);
        return Ok(());
    }
    let l = s.node_mut(la);
    let at = balanced_split(&item_sizes(l));
    let moved = match l.body_mut() {
        NodeBody::Leaf(v) => NodeBody::Leaf(v.split_off(at)),
        NodeBody::Internal(v) => NodeBody::Internal(v.split_off(at)),
    };
    let r = s.node_mut(ra);
    *r.body_mut() = moved;
    let (rkey, rgen) = (
        r.first_key().expect("non-empty after rebalance"),
        r.hdr.generation,
    );
    let p = s.node_mut(addr).ptrs_mut();
    p[li].1 = la;
    p[li].2 = lgen;
    p[li + 1] = (rkey, ra, rgen);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::NodeHeader;
    use std::collections::{BTreeMap, HashMap};

    /// An in-memory store that counts generations like the real one.
    struct MemStore {
        nodes: HashMap<u64, Arc<Node>>,
        gen: u64,
        next: u64,
        freed: Vec<u64>,
        node_size: usize,
    }

    impl MemStore {
        fn new(node_size: usize) -> Self {
            MemStore {
                nodes: HashMap::new(),
                gen: 1,
                next: 4096,
                freed: vec![],
                node_size,
            }
        }
        fn live(&self) -> usize {
            self.nodes.len()
        }
    }

    impl NodeStore for MemStore {
        fn read_node(&mut self, addr: u64) -> Result<Arc<Node>> {
            self.nodes
                .get(&addr)
                .cloned()
                .ok_or(Error::corrupt("tree node", addr, "missing"))
        }
        fn cow_node(&mut self, addr: u64) -> Result<u64> {
            let n = self.read_node(addr)?;
            if n.hdr.generation == self.gen {
                return Ok(addr);
            }
            let mut c = (*n).clone();
            self.free_node(addr);
            self.next += 4096;
            c.hdr.addr = self.next;
            c.hdr.generation = self.gen;
            self.nodes.insert(self.next, Arc::new(c));
            Ok(self.next)
        }
        fn node_mut(&mut self, addr: u64) -> &mut Node {
            Arc::make_mut(self.nodes.get_mut(&addr).unwrap())
        }
        fn new_node(&mut self, owner: u64, level: u8, body: NodeBody) -> Result<u64> {
            self.next += 4096;
            let hdr = NodeHeader {
                addr: self.next,
                generation: self.gen,
                owner,
                level,
            };
            self.nodes.insert(self.next, Arc::new(Node::new(hdr, body)));
            Ok(self.next)
        }
        fn free_node(&mut self, addr: u64) {
            self.nodes.remove(&addr);
            self.freed.push(addr);
        }
        fn node_size(&self) -> usize {
            self.node_size
        }
    }

    fn new_tree(s: &mut MemStore) -> Root {
        let addr = s.new_node(5, 0, NodeBody::Leaf(vec![])).unwrap();
        Root {
            addr,
            level: 0,
            owner: 5,
        }
    }

    fn check_tree(s: &mut MemStore, root: &Root) -> Vec<Key> {
        fn rec(s: &mut MemStore, n: &Node, lo: Option<Key>, out: &mut Vec<Key>, is_root: bool) {
            assert!(n.encoded_size() <= s.node_size);
            if !is_root {
                assert!(n.len() > 0, "empty non-root node");
            }
            match n.body() {
                NodeBody::Leaf(v) => {
                    for (k, _) in v {
                        if let Some(lo) = lo {
                            assert!(*k >= lo);
                        }
                        out.push(*k);
                    }
                }
                NodeBody::Internal(p) => {
                    for (i, ptr) in p.iter().enumerate() {
                        let c = load_child(s, n, i).unwrap();
                        rec(s, &c, Some(ptr.0).filter(|_| i > 0).or(lo), out, false);
                    }
                }
            }
        }
        let n = load_root(s, root).unwrap();
        let mut out = vec![];
        rec(s, &n, None, &mut out, true);
        assert!(out.windows(2).all(|w| w[0] < w[1]));
        out
    }

    #[test]
    fn insert_search_range_delete_against_btreemap() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut s = MemStore::new(1024);
        let mut root = new_tree(&mut s);
        let mut model = BTreeMap::new();
        for step in 0..20000 {
            if step % 500 == 0 {
                s.gen += 1; // a commit: later changes must copy
            }
            let k = Key::new(rng.gen_range(0..3000), 1, 0);
            if rng.gen_bool(0.6) {
                let v = vec![rng.gen::<u8>(); rng.gen_range(0..200)];
                insert(&mut s, &mut root, k, v.clone()).unwrap();
                model.insert(k, v);
            } else {
                let had = delete(&mut s, &mut root, &k).unwrap();
                assert_eq!(had, model.remove(&k).is_some());
            }
        }
        let keys = check_tree(&mut s, &root);
        assert_eq!(keys, model.keys().copied().collect::<Vec<_>>());
        for (k, v) in &model {
            assert_eq!(search(&mut s, &root, k).unwrap().as_ref(), Some(v));
        }
        let lo = Key::new(1000, 0, 0);
        let hi = Key::new(2000, 0, 0);
        let got = range(&mut s, &root, &lo, &hi, usize::MAX).unwrap();
        let want: Vec<_> = model.range(lo..hi).map(|(k, v)| (*k, v.clone())).collect();
        assert_eq!(got, want);
        let probe = Key::new(1500, 2, 0);
        assert_eq!(
            seek_le(&mut s, &root, &probe).unwrap(),
            model
                .range(..=probe)
                .next_back()
                .map(|(k, v)| (*k, v.clone()))
        );
        assert!(root.level >= 1, "tree of 1 KiB nodes should have grown");
    }

    #[test]
    fn deleting_everything_shrinks_to_one_leaf() {
        let mut s = MemStore::new(1024);
        let mut root = new_tree(&mut s);
        for i in 0..2000u64 {
            insert(&mut s, &mut root, Key::new(i, 1, 0), vec![0; 40]).unwrap();
        }
        assert!(root.level >= 2);
        s.gen += 1;
        for i in 0..2000u64 {
            assert!(delete(&mut s, &mut root, &Key::new(i, 1, 0)).unwrap());
        }
        assert_eq!(root.level, 0);
        assert_eq!(s.live(), 1, "every node but the root leaf is freed");
        assert!(!delete(&mut s, &mut root, &Key::new(5, 1, 0)).unwrap());
    }

    #[test]
    fn large_items_always_split_into_valid_nodes() {
        let mut s = MemStore::new(16384);
        let mut root = new_tree(&mut s);
        for i in 0..200u64 {
            let len = if i % 3 == 0 {
                crate::format::MAX_ITEM_SIZE
            } else {
                10
            };
            insert(&mut s, &mut root, Key::new(i, 1, 0), vec![1; len]).unwrap();
        }
        assert_eq!(check_tree(&mut s, &root).len(), 200);
    }

    #[test]
    fn a_node_with_a_wrong_generation_is_refused() {
        let mut s = MemStore::new(1024);
        let mut root = new_tree(&mut s);
        for i in 0..200u64 {
            insert(&mut s, &mut root, Key::new(i, 1, 0), vec![0; 40]).unwrap();
        }
        let top = s.read_node(root.addr).unwrap();
        let child = top.ptrs().last().unwrap().1;
        s.node_mut(child).hdr.generation = 999;
        let err = search(&mut s, &root, &Key::new(199, 1, 0)).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }));
    }
}
