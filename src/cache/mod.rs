//! The page cache: folios with per-block uptodate and dirty bits (seed 5).

mod arena;
mod folio;
mod page_cache;

pub(crate) use folio::Folio;
pub(crate) use page_cache::usable_memory;
pub use page_cache::{default_cache_size, memory_short, CacheOptions};
pub(crate) use page_cache::{CachedFolio, PageCache};
