//! The RAM tier against the fixtures: exactness across budgets, backends and
//! thread counts; cache mechanics; faults; usage history; the planner;
//! the prefetcher; filling the cache ahead of need.

#[path = "tier/common.rs"]
mod common;

#[path = "tier/cache.rs"]
mod cache;
#[path = "tier/faults.rs"]
mod faults;
#[path = "tier/fill.rs"]
mod fill;
#[path = "tier/invariance.rs"]
mod invariance;
#[path = "tier/plan.rs"]
mod plan;
#[path = "tier/prefetch.rs"]
mod prefetch;
#[path = "tier/tiles.rs"]
mod tiles;
#[path = "tier/usage.rs"]
mod usage;
