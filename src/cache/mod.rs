//! The page cache: folios with per-block uptodate and dirty bits (seed 5).

mod arena;
mod folio;
mod memory;
mod page_cache;

pub(crate) use folio::Folio;
pub use memory::MemoryPressure;
pub use memory::{memory_limit_room, usable_memory};
pub use page_cache::{default_cache_size, CacheOptions};
pub(crate) use page_cache::{CachedFolio, Held, PageCache};
