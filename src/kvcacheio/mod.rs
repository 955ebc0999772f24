//! sglang's `sgl_kernel.kvcacheio` transfer ops over caller memory, with the same names and
//! argument order, on the cpu and cuda executors.
//!
//! Each op is a pool call in disguise: its tensors are wrapped once, as a device side (layer-first)
//! and a host side (the layout) with the pool geometry of exactly their sizes (no pools are
//! built), and the call goes through the one planner, so it obeys the same table, order of
//! checks and messages as the pools, and adds what sglang's ops lack: every index is
//! range-checked against the tensor it addresses, and
//! destinations must be unique and must not overlap another argument. Nothing moves unless every
//! check of every layer passes.
//!
//! Sizes are in bytes (`item_size`, `src_layout_dim`, `dst_layout_dim`), as in sgl-kernel since
//! its layer-table refactor. The launch tuning arguments (`block_quota`, `num_warps_per_block`)
//! are the executor's business and are not taken here.
//!
//! | op | device side | host side | call |
//! |---|---|---|---|
//! | [`transfer_kv_per_layer`], [`transfer_kv_per_layer_mla`] | `dst` layer | `src` layer (layer_first, one layer) | load |
//! | [`transfer_kv_per_layer_pf_lf`], [`transfer_kv_per_layer_mla_pf_lf`] | `dst` layer | `src` page_first | load of `layer_id` |
//! | [`transfer_kv_per_layer_ph_lf`] | `dst` layer | `src` page_head | load of `layer_id` |
//! | [`transfer_kv_all_layer`], [`transfer_kv_all_layer_mla`], [`transfer_kv_direct`] | `dst[j]` | `src[j]` | one load per layer |
//! | [`transfer_kv_all_layer_lf_pf`], [`transfer_kv_all_layer_mla_lf_pf`] | `src` layers | `dst` page_first | backup |
//! | [`transfer_kv_all_layer_lf_ph`] | `src` layers | `dst` page_head | backup |
//! | [`transfer_kv_per_layer_pfdhg_lf`] | `dst` layer | `src` page_first_direct_hg | load of `layer_id` |
//! | [`transfer_kv_all_layer_lf_pfdhg`] | `src` layers | `dst` page_first_direct_hg | backup |
//! | [`transfer_kv_per_layer_pu_lf`], [`transfer_kv_per_layer_mla_pu_lf`] | `dst` layer | `src` page_unified (one buffer) | load of `layer_id` |
//! | [`transfer_kv_all_layer_lf_pu`], [`transfer_kv_all_layer_mla_lf_pu`] | `src` layers | `dst` page_unified (one buffer) | backup |
//! | [`transfer_kv_per_layer_direct_pf_lf`] | `dst` layers | `src` page_first_direct | load of `layer_id` |
//! | [`transfer_kv_all_layer_direct_lf_pf`] | `src` layers | `dst` page_first_direct | backup |
//! | [`transfer_kv_per_layer_lf_pf`], [`transfer_kv_per_layer_mla_lf_pf`], [`transfer_kv_per_layer_direct_lf_pf`] | `src` layer | `dst` page_first / page_first_direct | per-layer backup (not in sglang) |
//!
//! The last row is what sglang lacks (its seed error): a one-layer backup into page_first or
//! page_first_direct, for layer-sharded and layer-wise backups. It runs under profile
//! `extended`; the thirteen sglang ops run under profile `sglang`.

#![allow(clippy::too_many_arguments)] // sglang's signatures

//!
//! Rooms: `tensors` (caller memory and index lists), `call` (an op's sides and plans, run all or
//! nothing), `loads` (one-layer loads), `lists` (all-layer copies between layer lists, `direct`
//! included), `backups` (all-layer and one-layer backups into a layout), `direct`
//! (page_first_direct), `rows` (whole rows), `blocks` (a host tier
//! for an engine's block tensors: vLLM's offloading), and `catalogue` (the one table of ops the Python
//! bindings, their stubs and torch schemas are made from).

mod args;
mod backups;
mod call;
pub mod catalogue;
mod direct;
mod lists;
mod loads;
mod rows;
mod tensors;
mod tokens;

pub use crate::exec::caller::{page_row_extents, table_extents, CudaIndices, Indices, LayerTable, Layers, Memory, RawTensor};
pub use catalogue::*;
pub use lists::check_num_layers;
pub use rows::{copy_all_layer_kv_cache, MAX_ROWS};
pub use tokens::{DSV4_PAGE_BYTES, DSV4_PAGE_TOKENS, DSV4_SCALE_BYTES, DSV4_VALUE_BYTES};

use backups::*;
use call::*;
use direct::*;
use lists::*;
use loads::*;
use rows::*;
use tensors::*;
use tokens::*;
