//! The table itself: one entry per op, in the order of the Python module, and the Rust function
//! of each generic op.

use super::super::*;
use super::{run, ArgKind, Binding, ItemCheck, OpSpec, Sglang, Shape, Tuning, Value};
use crate::exec::Device;
use crate::geometry::{IoBackend, Layout};
use crate::Result;

impl OpSpec {
    /// The op named `name` (here, beside the table: the records in `spec` know no table).
    pub fn find(name: &str) -> Option<&'static OpSpec> {
        CATALOGUE.iter().find(|s| s.name == name)
    }
}

/// The Rust parameter type of an argument kind.
macro_rules! param {
    (In) => { &'i RawTensor };
    (Out) => { &'i RawTensor };
    (InLayers) => { impl Into<Layers<'i>> };
    (OutLayers) => { impl Into<Layers<'i>> };
    (InList) => { &'i [RawTensor] };
    (OutList) => { &'i [RawTensor] };
    (Idx) => { impl Into<Indices<'i>> };
    (HostIdx) => { &'i [i64] };
    (Int) => { i64 };
    (Ints) => { &'i [i64] };
}

/// A parameter as a [`Value`].
macro_rules! value {
    (In, $a:ident) => {
        Value::Tensor($a)
    };
    (Out, $a:ident) => {
        Value::Tensor($a)
    };
    (InLayers, $a:ident) => {
        Value::from($a.into())
    };
    (OutLayers, $a:ident) => {
        Value::from($a.into())
    };
    (InList, $a:ident) => {
        Value::Tensors($a)
    };
    (OutList, $a:ident) => {
        Value::Tensors($a)
    };
    (Idx, $a:ident) => {
        Value::Indices($a.into())
    };
    (HostIdx, $a:ident) => {
        Value::Ints($a)
    };
    (Int, $a:ident) => {
        Value::Int($a)
    };
    (Ints, $a:ident) => {
        Value::Ints($a)
    };
}

macro_rules! catalogue {
    (
        generic { $( $name:ident ( $($arg:ident : $kind:ident),* ) { doc: $doc:literal, $($field:ident : $value:expr),* $(,)? } )* }
        custom { $( $cname:ident ( $($carg:ident : $ckind:ident),* ) { doc: $cdoc:literal, $($cfield:ident : $cvalue:expr),* $(,)? } )* }
    ) => {
        /// Every op, in the order of the Python module.
        pub static CATALOGUE: &[OpSpec] = &[
            $( OpSpec { name: stringify!($name), args: &[$((stringify!($arg), ArgKind::$kind)),*], binding: Binding::Generic, doc: $doc, $($field: $value,)* ..OpSpec::DEFAULT }, )*
            $( OpSpec { name: stringify!($cname), args: &[$((stringify!($carg), ArgKind::$ckind)),*], binding: Binding::Custom, doc: $cdoc, $($cfield: $cvalue,)* ..OpSpec::DEFAULT }, )*
        ];

        $(
            #[doc = concat!("sglang's `", stringify!($name), "` (its catalogue entry; sizes in bytes): ", $doc)]
            pub fn $name<'i>(device: &Device, $($arg: param!($kind)),*) -> Result<()> {
                run(stringify!($name), device, &[$(value!($kind, $arg)),*])
            }
        )*
    };
}

catalogue! {
    generic {
        transfer_kv_per_layer(src_k: In, dst_k: Out, src_v: In, dst_v: Out, src_indices: Idx, dst_indices: Idx, item_size: Int) {
            doc: "One layer, layer_first to layer_first: ``dst_k[d] = src_k[s]`` and ``dst_v[d] = src_v[s]`` for each index pair (items of ``item_size`` bytes; negative indices skipped).",
            shape: Shape::LayerPair,
            schema: "(Tensor src_k, Tensor dst_k, Tensor src_v, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int item_size, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_per_layer_pf_lf(src_k: In, dst_k: Out, src_v: In, dst_v: Out, src_indices: Idx, dst_indices: Idx, layer_id: Int, item_size: Int, src_layout_dim: Int) {
            doc: "Layer ``layer_id`` of a page_first host buffer ``[slots][L][item]`` (``src_layout_dim = L * item_size``) into one layer_first device layer.",
            shape: Shape::PagedLoad(Layout::PageFirst),
            schema: "(Tensor src_k, Tensor dst_k, Tensor src_v, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int src_layout_dim, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_per_layer_ph_lf(src_k: In, dst_k: Out, src_v: In, dst_v: Out, src_indices: Idx, dst_indices: Idx, layer_id: Int, item_size: Int, src_layout_dim: Int, page_size: Int, head_num: Int) {
            doc: "Layer ``layer_id`` of a page_head host buffer ``[pages][head_num][page_size][L][item / head_num]`` into one layer_first device layer.",
            shape: Shape::PagedLoad(Layout::PageHead),
            schema: "(Tensor src_k, Tensor dst_k, Tensor src_v, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int src_layout_dim, int page_size, int head_num, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_all_layer(src_k_layers: InLayers, dst_k_layers: OutLayers, src_v_layers: InLayers, dst_v_layers: OutLayers, src_indices: Idx, dst_indices: Idx, item_size: Int, num_layers: Int) {
            doc: "Every layer ``j < num_layers``: ``dst_*_layers[j][d] = src_*_layers[j][s]`` (layer_first both sides).",
            shape: Shape::LayerLists(IoBackend::Kernel),
            num_layers: Some(false),
            schema: "(Tensor src_k_layers, Tensor dst_k_layers, Tensor src_v_layers, Tensor dst_v_layers, Tensor src_indices, Tensor dst_indices, int item_size, int num_layers, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_all_layer_lf_pf(src_k_layers: InLayers, dst_k: Out, src_v_layers: InLayers, dst_v: Out, src_indices: Idx, dst_indices: Idx, item_size: Int, dst_layout_dim: Int, num_layers: Int) {
            doc: "Every device layer into its layer of a page_first host buffer (``dst_layout_dim = num_layers * item_size``).",
            shape: Shape::LayoutBackup(Layout::PageFirst),
            num_layers: Some(false),
            schema: "(Tensor src_k_layers, Tensor dst_k, Tensor src_v_layers, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, int num_layers, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_all_layer_lf_ph(src_k_layers: InLayers, dst_k: Out, src_v_layers: InLayers, dst_v: Out, src_indices: Idx, dst_indices: Idx, item_size: Int, dst_layout_dim: Int, num_layers: Int, page_size: Int, head_num: Int) {
            doc: "Every device layer into its layer of a page_head host buffer.",
            shape: Shape::LayoutBackup(Layout::PageHead),
            num_layers: Some(false),
            schema: "(Tensor src_k_layers, Tensor dst_k, Tensor src_v_layers, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, int num_layers, int page_size, int head_num, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_per_layer_mla(src: In, dst: Out, src_indices: Idx, dst_indices: Idx, item_size: Int) {
            doc: "One layer, layer_first to layer_first, one buffer (MLA, DSA indexer).",
            shape: Shape::LayerPair,
            tuning: Tuning::Env,
            schema: "(Tensor src, Tensor dst, Tensor src_indices, Tensor dst_indices, int item_size, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_per_layer_mla_pf_lf(src: In, dst: Out, src_indices: Idx, dst_indices: Idx, layer_id: Int, item_size: Int, src_layout_dim: Int) {
            doc: "Layer ``layer_id`` of a page_first host buffer into one layer_first device layer (one buffer).",
            shape: Shape::PagedLoad(Layout::PageFirst),
            tuning: Tuning::Env,
            schema: "(Tensor src, Tensor dst, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int src_layout_dim, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_all_layer_mla(src_layers: InLayers, dst_layers: OutLayers, src_indices: Idx, dst_indices: Idx, item_size: Int, num_layers: Int) {
            doc: "Every layer, layer_first to layer_first, one buffer per layer.",
            shape: Shape::LayerLists(IoBackend::Kernel),
            num_layers: Some(true),
            schema: "(Tensor src_layers, Tensor dst_layers, Tensor src_indices, Tensor dst_indices, int item_size, int num_layers, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_all_layer_mla_lf_pf(src_layers: InLayers, dst: Out, src_indices: Idx, dst_indices: Idx, item_size: Int, dst_layout_dim: Int, num_layers: Int) {
            doc: "Every device layer into its layer of a page_first host buffer (one buffer).",
            shape: Shape::LayoutBackup(Layout::PageFirst),
            num_layers: Some(true),
            schema: "(Tensor src_layers, Tensor dst, Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, int num_layers, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_direct(src_layers: InList, dst_layers: OutList, src_indices: HostIdx, dst_indices: HostIdx, page_size: Int) {
            doc: "For every layer ``j``, the runs of consecutive index pairs copied row by row, ``src_layers[j]`` to ``dst_layers[j]`` (rows along dimension 0). ``page_size`` only gates the index count, as in sglang.",
            shape: Shape::LayerLists(IoBackend::Direct),
            tuning: Tuning::None,
            schema: "(Tensor[] src_layers, Tensor[] dst_layers, Tensor src_indices, Tensor dst_indices, int page_size) -> ()",
        }
        transfer_kv_per_layer_direct_pf_lf(src_ptrs: InList, dst_ptrs: OutList, src_indices: HostIdx, dst_indices: HostIdx, layer_id: Int, page_size: Int) {
            doc: "Whole pages of layer ``layer_id + j`` of page_first_direct host buffers (``src_ptrs``: ``[K, V]`` or ``[C]``, shape ``[pages, L, page_size, ...]``) into device layer ``j`` (``dst_ptrs``: K layers then V layers). Only the first index of each page is read; the rest must follow it.",
            shape: Shape::DirectLoad,
            tuning: Tuning::None,
            schema: "(Tensor[] src_ptrs, Tensor[] dst_ptrs, Tensor src_indices, Tensor dst_indices, int layer_id, int page_size)->()",
        }
        transfer_kv_all_layer_direct_lf_pf(src_ptrs: InList, dst_ptrs: OutList, src_indices: HostIdx, dst_indices: HostIdx, page_size: Int) {
            doc: "Whole pages of every device layer (``src_ptrs``: K layers then V layers, or the MLA layers) into page_first_direct host buffers (``dst_ptrs``: ``[K, V]`` or ``[C]``).",
            shape: Shape::DirectBackup,
            tuning: Tuning::None,
            schema: "(Tensor[] src_ptrs, Tensor[] dst_ptrs, Tensor src_indices, Tensor dst_indices, int page_size) ->()",
        }
        transfer_kv_per_layer_lf_pf(src_k: In, dst_k: Out, src_v: In, dst_v: Out, src_indices: Idx, dst_indices: Idx, layer_id: Int, item_size: Int, dst_layout_dim: Int) {
            doc: "Not in sglang: one device layer into layer ``layer_id`` of a page_first host buffer (``dst_layout_dim = L * item_size``) -- the per-layer LF->PF path whose absence makes sglang raise ``Layer-sharded DSA indexer HiCache backup with page_first layout is not supported without a per-layer LF->PF kernel.``",
            shape: Shape::LayerBackup,
            sglang: Sglang::No,
            schema: "(Tensor src_k, Tensor dst_k, Tensor src_v, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int dst_layout_dim, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_per_layer_mla_lf_pf(src: In, dst: Out, src_indices: Idx, dst_indices: Idx, layer_id: Int, item_size: Int, dst_layout_dim: Int) {
            doc: "Not in sglang: ``transfer_kv_per_layer_lf_pf`` with one buffer (MLA, and the DSA indexer with page-sized items and page indices).",
            shape: Shape::LayerBackup,
            sglang: Sglang::No,
            schema: "(Tensor src, Tensor dst, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int dst_layout_dim, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_per_layer_direct_lf_pf(src_ptrs: InList, dst_ptrs: OutList, src_indices: HostIdx, dst_indices: HostIdx, layer_id: Int, page_size: Int) {
            doc: "Not in sglang: whole pages of one device layer (``src_ptrs``: ``[K, V]`` or ``[C]``) into layer ``layer_id`` of page_first_direct host buffers (``dst_ptrs``: ``[K, V]`` or ``[C]``, shape ``[pages, L, page_size, ...]``).",
            shape: Shape::DirectLayerBackup,
            tuning: Tuning::None, sglang: Sglang::No,
            schema: "(Tensor[] src_ptrs, Tensor[] dst_ptrs, Tensor src_indices, Tensor dst_indices, int layer_id, int page_size) -> ()",
        }
        transfer_kv_per_layer_pfdhg_lf(src_k: In, dst_k: Out, src_v: In, dst_v: Out, src_indices: Idx, dst_indices: Idx, layer_id: Int, item_size: Int, src_layout_dim: Int, page_size: Int, head_num: Int) {
            doc: "Layer ``layer_id`` of a head-group-major page_first_direct host buffer into one device layer.\n\nHost shape per component: ``[pages][head_num][L][page_size][item_size / head_num]`` (``head_num`` counts head GROUPS; ``src_layout_dim = L * item_size``); device rows ``[rows][item_size]``, whose group ``g`` is bytes ``[g * item_size / head_num, (g + 1) * item_size / head_num)``. One head group is plain page_first_direct. Indices are token slots. Empty lists are a no-op once the integers pass.",
            shape: Shape::PagedLoad(Layout::PageFirstDirectHeadGroups),
            tuning: Tuning::EnvOr(2), sglang: Sglang::No,
            schema: "(Tensor src_k, Tensor dst_k, Tensor src_v, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int src_layout_dim, int page_size, int head_num, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_all_layer_lf_pfdhg(src_k_layers: InLayers, dst_k: Out, src_v_layers: InLayers, dst_v: Out, src_indices: Idx, dst_indices: Idx, item_size: Int, dst_layout_dim: Int, num_layers: Int, page_size: Int, head_num: Int) {
            doc: "Every device layer into its layer of a head-group-major page_first_direct host buffer: the mirror of ``transfer_kv_per_layer_pfdhg_lf`` (``head_num`` counts head groups, so both directions agree on one host byte order; ``dst_layout_dim = num_layers * item_size``).",
            shape: Shape::LayoutBackup(Layout::PageFirstDirectHeadGroups),
            tuning: Tuning::EnvOr(2), sglang: Sglang::No, num_layers: Some(false),
            schema: "(Tensor src_k_layers, Tensor dst_k, Tensor src_v_layers, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, int num_layers, int page_size, int head_num, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_per_layer_pu_lf(src: In, dst_k: Out, dst_v: Out, src_indices: Idx, dst_indices: Idx, layer_id: Int, item_size: Int, src_layout_dim: Int, page_size: Int, head_num: Int) {
            doc: "Not in sgl-kernel (sglang's JIT ``transfer_hicache_one_layer_page_unified_lf`` runs on it): layer ``layer_id`` of a page_unified host buffer into one device layer, K and V.\n\nOne host buffer holds both components, ``[pages][head_num][L][2][page_size][item_size / head_num]`` (``head_num`` counts head groups; K before V inside each layer; ``src_layout_dim = L * item_size``); device rows ``[rows][item_size]``, whose group ``g`` is bytes ``[g * item_size / head_num, (g + 1) * item_size / head_num)``. Indices are token slots.",
            shape: Shape::PagedLoad(Layout::PageUnified),
            tuning: Tuning::EnvOr(2), sglang: Sglang::No,
            schema: "(Tensor src, Tensor dst_k, Tensor dst_v, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int src_layout_dim, int page_size, int head_num, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_per_layer_mla_pu_lf(src: In, dst: Out, src_indices: Idx, dst_indices: Idx, layer_id: Int, item_size: Int, src_layout_dim: Int, page_size: Int) {
            doc: "Not in sgl-kernel (sglang's JIT ``transfer_hicache_one_layer_mla_page_unified_lf`` runs on it): layer ``layer_id`` of an MLA page_unified host buffer ``[pages][L][page_size][item_size]`` (page_first_direct's bytes) into one device layer. Indices are token slots.",
            shape: Shape::PagedLoad(Layout::PageUnified),
            tuning: Tuning::EnvOr(2), sglang: Sglang::No,
            schema: "(Tensor src, Tensor dst, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int src_layout_dim, int page_size, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_all_layer_lf_pu(src_k_layers: InLayers, src_v_layers: InLayers, dst: Out, src_indices: Idx, dst_indices: Idx, item_size: Int, dst_layout_dim: Int, num_layers: Int, page_size: Int, head_num: Int) {
            doc: "Not in sgl-kernel (sglang's JIT ``transfer_hicache_all_layer_staged_lf_page_unified`` runs on it): every device layer, K and V, into its layer of one page_unified host buffer, the mirror of ``transfer_kv_per_layer_pu_lf`` (``dst_layout_dim = num_layers * item_size``). Indices are token slots.",
            shape: Shape::LayoutBackup(Layout::PageUnified),
            tuning: Tuning::EnvOr(2), sglang: Sglang::No, num_layers: Some(false),
            schema: "(Tensor src_k_layers, Tensor src_v_layers, Tensor dst, Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, int num_layers, int page_size, int head_num, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_kv_all_layer_mla_lf_pu(src_layers: InLayers, dst: Out, src_indices: Idx, dst_indices: Idx, item_size: Int, dst_layout_dim: Int, num_layers: Int, page_size: Int) {
            doc: "Not in sgl-kernel (sglang's JIT ``transfer_hicache_all_layer_mla_staged_lf_page_unified`` runs on it): every device layer into its layer of an MLA page_unified host buffer, the mirror of ``transfer_kv_per_layer_mla_pu_lf``. Indices are token slots.",
            shape: Shape::LayoutBackup(Layout::PageUnified),
            tuning: Tuning::EnvOr(2), sglang: Sglang::No, num_layers: Some(false),
            schema: "(Tensor src_layers, Tensor dst, Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, int num_layers, int page_size, int block_quota, int num_warps_per_block) -> ()",
        }
        transfer_embedding_ranges_direct(src: In, dst: Out, src_starts: Ints, dst_starts: Ints, lengths: Ints) {
            doc: "Copy embedding ranges between host and CUDA tensors: for each ``k``, ``dst[dst_starts[k] : dst_starts[k] + lengths[k]] = src[src_starts[k] : src_starts[k] + lengths[k]]`` along dimension 0 (rows of equal bytes in both; any dtype and row width, 74-byte rows too).\n\nCopy engine only, one copy per range (adjacent ranges merge), enqueued on the caller's stream for CUDA arrays; host to host and device to device work as well. Beyond sglang: every range must lie inside its tensor and destination ranges must not overlap; a call that raises has moved no row.",
            shape: Shape::EmbeddingRanges,
            tuning: Tuning::None, same_dtype: true,
            schema: "(Tensor src, Tensor! dst, int[] src_starts, int[] dst_starts, int[] lengths) -> ()",
        }
        transfer_kv_mamba_pf_lf(src: In, dst: Out, src_indices: Idx, dst_indices: Idx, layer_id: Int, item_size: Int, src_layout_dim: Int) {
            doc: "sglang's JIT Mamba load: layer ``layer_id`` of a page_first host buffer of state slots ``[slots][L][item]`` (``src_layout_dim = L * item_size``) into one device state tensor (rows of ``item_size`` bytes, a positive multiple of 16). Indices are slots.",
            shape: Shape::PagedLoad(Layout::PageFirst),
            tuning: Tuning::PerItem, sglang: Sglang::Jit("sglang.kernels.ops.mamba.transfer_mamba"), item_check: ItemCheck::Uint4("transfer_mamba"), keys: &[],
        }
        transfer_kv_mamba_lf_pf(src_ptrs: InLayers, dst: Out, src_indices: Idx, dst_indices: Idx, item_size: Int, dst_layout_dim: Int, num_layers: Int) {
            doc: "sglang's JIT Mamba backup: every device state tensor (``src_ptrs``, one per layer) into its layer of a page_first host buffer of state slots (``dst_layout_dim = num_layers * item_size``, ``item_size`` a positive multiple of 16). Indices are slots.",
            shape: Shape::LayoutBackup(Layout::PageFirst),
            tuning: Tuning::PerItem, sglang: Sglang::Jit("sglang.kernels.ops.mamba.transfer_mamba"), item_check: ItemCheck::Uint4("transfer_mamba"), keys: &[], num_layers: Some(true),
        }
        transfer_cache_dsv4_mla(src_ptrs: InLayers, dst_ptrs: OutLayers, src_indices: Idx, dst_indices: Idx) {
            doc: "sglang's JIT DeepSeek-V4 token copy: for every layer ``l``, token ``src_indices[i]`` of the page-padded C4 buffer ``src_ptrs[l]`` into token ``dst_indices[i]`` of ``dst_ptrs[l]`` (either direction; 64 tokens a page of 37,440 bytes, each token a 576-byte value at ``page * 37440 + slot * 576`` and an 8-byte scale at ``page * 37440 + 36864 + slot * 8``). Indices are tokens; every layer of a side holds the whole pages its smallest layer holds.",
            shape: Shape::Dsv4Tokens,
            tuning: Tuning::BlockSize, sglang: Sglang::Jit("sglang.kernels.ops.kvcache.hisparse"), keys: &[],
        }
        transfer_page_rows(host_ptrs: InLayers, device_ptrs: OutLayers, host_pages: Idx, device_pages: Idx, host_stride: Int, device_stride: Int, row_bytes: Int, load: Int) {
            doc: "sglang's JIT NVFP4 page-row copy (MiniMax M3): for every layer ``l`` and pair ``i``, ``row_bytes`` bytes between host row ``host_ptrs[l] + host_pages[i] * host_stride`` and device row ``device_ptrs[l] + device_pages[i] * device_stride``, host to device when ``load`` is true, else device to host. Row bytes and strides are multiples of 128, strides at least one row. Indices are pages. Arrays of the side written must be writable.",
            shape: Shape::PageRows,
            tuning: Tuning::None, sglang: Sglang::Jit("sglang.kernels.ops.kvcache.nvfp4_hicache"), keys: &[],
        }
    }
    custom {
        copy_all_layer_kv_cache_cpu(data_ptrs: In, strides: In, tgt_loc: In, src_loc: In) {
            doc: "sglang's CPU row move inside the device KV pool (sgl_kernel's top-level op).",
            shape: Shape::Custom,
            tuning: Tuning::None, sglang: Sglang::No, keys: &["CPU"],
            schema: "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        }
        get_device_accessible_ptr(tensor: In, device_index: Int) {
            doc: "The address a kernel on CUDA device ``device_index`` reads ``tensor`` at.",
            shape: Shape::Custom,
            tuning: Tuning::None,
            schema: "(Tensor tensor, int device_index) -> int",
        }
    }
}
