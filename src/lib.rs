//! # hicache-io
//!
//! Moves KV-cache data between a host pool and a device pool with the semantics of sglang's
//! HiCache transfer layer, on three executors chosen at run time: `cpu` (reference), `wgpu`
//! (WGSL compute shaders) and `cuda` (copy kernels and DMA copies through cudarc).
//!
//! The layers of the crate, each importing only from the ones before it: [`geometry`] (shapes,
//! checked sizes and byte addresses), [`plan`] (the one validation table, the order of checks
//! and the lowering into plans), [`exec`] (executors that only execute), [`pool`]
//! (sglang-shaped pools), [`kvcacheio`] (sglang's transfer ops on an engine's own memory).
//! Beside them: [`names`] (the vocabulary: pool kinds, layouts, io backends, profiles),
//! [`error`], [`integrity`] (item checksums), the leaf helpers [`rng`] and [`timing`], and the [`tools`] built on the layers (the oracle, `check`, `fuzz`, `bench`, the
//! support matrix). The `hicache-io` command line lives in `src/cli/`.
//!
//! # Vocabulary
//! | word | meaning |
//! |---|---|
//! | executor | a backend that moves bytes: `cpu`, `wgpu` or `cuda` (which one: [`ExecutorKind`]) |
//! | [`Device`] | a handle to one executor *instance*, chosen at run time; clones share its identity, and pools, buffers and plans of two instances never mix |
//! | io backend | sglang's `kernel` (gather/scatter copy kernel) or `direct` (one copy per coalesced run): [`IoBackend`] |
//! | `L` | host layers: owned target layers (minus DSA skip-topk layers), then one per MTP draft pool |
//! | `P` | page size in tokens |
//! | item | bytes per (index, layer): the token stride for MHA/MLA, the indexer page for DSA |
//! | `H`, `D` | heads and head bytes of page_head (`D = item / H`, the per-head copy chunk) |
//! | plan, step | the planner's lowered form of one accepted call; a plan runs step by step |
//!
//! ```
//! use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, Layout, LayerMap, PoolKind, Profile};
//!
//! # fn main() -> Result<(), hicache_io::TransferError> {
//! let device = Device::cpu(); // or Device::from_env()? for HICACHE_IO_EXECUTOR=cpu|wgpu|cuda|auto
//! // MLA device pool: 4 layers of 256 token slots, 1152-byte records, page size 16.
//! let mut dev = DevicePool::new(&device, &DevicePoolConfig {
//!     kind: PoolKind::Mla, bytes_per_token: 1152, slots: 256, page_size: 16, layers: LayerMap::new(4),
//! })?;
//! let mut host = HostPool::new(&dev, &HostPoolConfig {
//!     layout: Layout::PageFirst, size: 1024, head_num: 1, profile: Profile::Extended, integrity: None,
//! })?;
//! // Back up one page (16 tokens) of every layer, then load layer 2 back elsewhere.
//! let device_slots: Vec<i64> = (32..48).collect();
//! let host_slots: Vec<i64> = (160..176).collect();
//! host.backup_from_device_all_layer(&dev, &host_slots, &device_slots, IoBackend::Kernel)?;
//! let back: Vec<i64> = (64..80).collect();
//! host.load_to_device_per_layer(&mut dev, &host_slots, &back, 2, IoBackend::Kernel)?;
//!
//! // A combination sglang rejects is an error with sglang's message, and nothing moves:
//! let err = host.load_to_device_per_layer(&mut dev, &host_slots, &back, 2, IoBackend::Direct).unwrap_err();
//! assert_eq!(err.to_string(), "Unsupported layout: page_first");
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

/// Host tiers for an engine's block tensors (vLLM's offloading): [`blocks::BlockTier`].
pub mod blocks;
pub(crate) mod cpu_features;
pub mod error;
pub mod exec;
pub mod geometry;
pub mod integrity;
pub mod kvcacheio;
pub mod names;
pub mod plan;
pub mod pool;
pub mod rng;
pub mod timing;
pub mod tools;

pub use error::{Result, TransferError};
#[allow(deprecated)]
pub use exec::BackendKind;
pub use exec::{Completion, Device, ExecutorKind};
pub use geometry::{IoBackend, LayerMap, Layout, PoolKind, Profile};
pub use plan::{Capabilities, Op, Plan, Request};
pub use pool::{
    DevicePool, DevicePoolConfig, Hold, HostPool, HostPoolConfig, LayerLoads, PageObjects, Pipeline, SharedDevicePool, SharedHostPool,
    Ticket, Transfer,
};

/// The README's Rust examples compile and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// So do those of the Rust guide.
#[cfg(doctest)]
#[doc = include_str!("../docs/rust.md")]
pub struct RustGuideDoctests;
