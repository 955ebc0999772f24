//! sglang-shaped pools: a device pool (layer_first, one buffer per live layer and component)
//! and a host pool built against it, with `load_to_device_per_layer`,
//! `backup_from_device_all_layer` (layer-sharded when the device pool is) and the page
//! helpers (`get_data_page` and friends, with their per-layout byte order).
//!
//! Every pool belongs to one executor instance; a call that mixes pools, buffers or plans of
//! two instances is an `ExecutorMismatch` error before anything moves.//!
//! Rooms: `device` (the device pool), `host` (the host pool and its calls), `transfers` (calls in
//! flight: `Transfer`, `LayerLoads`, the asynchronous calls), `pages` (page helpers, per-layout
//! byte order), `checksums` (the host pool's item checksums), `faults` (fault injection), `objects` (the page
//! objects an L3 store moves and their sums), `staging` (the passes over those objects' pages,
//! through a store's staging buffer or in place), `pipeline`, `shared` (pools shared by threads),
//! `util`.

mod checksums;
mod device;
mod faults;
mod host;
mod objects;
mod pages;
mod pipeline;
mod share_items;
mod shared;
mod staging;
mod transfers;
mod util;

pub use device::{DevicePool, DevicePoolConfig};
pub use host::{HostPool, HostPoolConfig};
pub use objects::PageObjects;
pub use pipeline::{Pipeline, Ticket};
pub use shared::{Hold, SharedDevicePool, SharedHostPool};
pub use transfers::{LayerLoads, Transfer};

use device::check_budget;
use transfers::{layer_load_plans, partial_layers};
pub(crate) use util::check_wrapped;
use util::{alloc_bytes, exact_size};
