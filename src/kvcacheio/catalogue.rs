//! The one table of sglang's ops: each entry names an op, its arguments and what kind each is,
//! its launch tuning, sglang's torch schema and its documentation. The Python bindings read
//! their arguments by kind from it and call [`call`]; the Python wrappers, their stubs, the
//! `torch.ops` schemas and the list of names sglang imports are made from [`CATALOGUE`]. Adding
//! an op is one entry here (with its [`Shape`]); a new shape adds its semantics, one function.

use super::args::OpArgs;
pub use super::args::Value;
use super::*;
use crate::exec::Device;
use crate::geometry::{IoBackend, Layout};
use crate::{Result, TransferError};

/// What an argument is, for the bindings (how to read it) and for the op (what it takes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ArgKind {
    /// An array the op reads (`&RawTensor`).
    In,
    /// An array the op writes (`&RawTensor`).
    Out,
    /// Layers the op reads: a list of arrays, or a 1-D table of layer addresses (`&[RawTensor]`).
    InLayers,
    /// Layers the op writes, likewise.
    OutLayers,
    /// A list of arrays the op reads (`Tensor[]`; `&[RawTensor]`).
    InList,
    /// A list of arrays the op writes.
    OutList,
    /// An index list that may stay in CUDA memory (`impl Into<Indices>`; the source list, then the
    /// destination list).
    Idx,
    /// An index list read on the host (`&[i64]`).
    HostIdx,
    /// An integer (`i64`).
    Int,
    /// A list of integers (`&[i64]`).
    Ints,
}

/// The launch tuning an op takes from Python (`block_quota`, `num_warps_per_block`), and what
/// `block_quota=None` means there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Tuning {
    /// No tuning arguments (copy-engine ops).
    None,
    /// Passed through; `None` is the executor's own grid.
    Pass,
    /// `None` takes `SGLANG_HICACHE_BLOCK_QUOTA` when set, as sglang's MLA per-layer ops do.
    Env,
    /// `None` takes `SGLANG_HICACHE_BLOCK_QUOTA` when set, else this; must be positive.
    EnvOr(i64),
    /// `num_warps_per_item` (default 32), accepted and ignored, as sglang's JIT Mamba kernels do.
    PerItem,
    /// `block_size` (default 1024: threads of a block, a multiple of 32 up to 1024), checked and
    /// otherwise ignored (sglang's JIT DeepSeek-V4 token copy compiles one kernel per value).
    BlockSize,
}

/// Where sglang takes an op from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Sglang {
    /// `sgl_kernel.kvcacheio` (sgl-kernel's AOT ops, also `torch.ops.sgl_kernel`).
    Aot,
    /// A JIT module of sglang's, by its import path.
    Jit(&'static str),
    /// Nowhere: hicache-io's own.
    No,
}

/// sglang's checks of the item size (and layer count) before any tensor is read, with its words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ItemCheck {
    /// sgl-kernel's launcher: a positive multiple of 8 bytes.
    SglKernel,
    /// A JIT kernel moving 16-byte vectors (`uint4`): `"<kernel>: item_size must be positive"`,
    /// `"… 16-byte aligned (uint4)"`, then `"<kernel>: num_layers must be positive"` where the op
    /// takes `num_layers`.
    Uint4(&'static str),
}

/// How the bindings serve an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Binding {
    /// Arguments read by kind and passed to [`call`].
    Generic,
    /// Its own binding and wrapper (checks of sglang's that need more than the kinds say).
    Custom,
}

/// What an op does, as one of the semantics the ops share (each a function of this module that
/// reads the op's arguments by role and name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Shape {
    /// One layer_first layer to another: the `In` arrays (K, V or one) into the `Out` arrays.
    LayerPair,
    /// Layer `layer_id` of a paged host buffer of this layout into one device layer
    /// (`src_layout_dim`; `page_size` and `head_num` where the layout has them).
    PagedLoad(Layout),
    /// Layer `j` of the source layer lists into layer `j` of the destination lists.
    LayerLists(IoBackend),
    /// Every device layer of the source lists into its layer of a paged host buffer of this
    /// layout (`dst_layout_dim`).
    LayoutBackup(Layout),
    /// One device layer into layer `layer_id` of a page_first host buffer (not in sglang).
    LayerBackup,
    /// page_first_direct host pages of layers `layer_id + j` into device layers `j`.
    DirectLoad,
    /// Every device layer into page_first_direct host pages.
    DirectBackup,
    /// One device layer into layer `layer_id` of page_first_direct host pages (not in sglang).
    DirectLayerBackup,
    /// Row ranges by the copy engine.
    EmbeddingRanges,
    /// DeepSeek-V4 C4 tokens (a 576-byte value and an 8-byte scale in pages of 37,440 bytes)
    /// between the layers of two tables.
    Dsv4Tokens,
    /// Page rows (`row_bytes` every stride) between the layers of a host and a device table,
    /// either way (`load`).
    PageRows,
    /// Served by its own binding.
    Custom,
}

/// One op of the catalogue.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct OpSpec {
    /// sglang's name.
    pub name: &'static str,
    /// Arguments in sglang's order, with their kinds.
    pub args: &'static [(&'static str, ArgKind)],
    /// Its semantics.
    pub shape: Shape,
    /// Launch tuning.
    pub tuning: Tuning,
    /// sglang's `torch.ops` schema without the name (sgl-kernel's own spacing); empty for an op
    /// that is no torch op (sglang's JIT ops).
    pub schema: &'static str,
    /// Where sglang 0.5.23 imports it from.
    pub sglang: Sglang,
    /// `torch.library` dispatch keys.
    pub keys: &'static [&'static str],
    /// sgl-kernel checks the source layer table's length against `num_layers` first: `Some(mla)`
    /// (the MLA ops' wording).
    pub num_layers: Option<bool>,
    /// The source and destination arrays must have one dtype (sglang's check).
    pub same_dtype: bool,
    /// sglang's item checks.
    pub item_check: ItemCheck,
    /// How the bindings serve it.
    pub binding: Binding,
    /// What it does (the Python docstring).
    pub doc: &'static str,
}

impl OpSpec {
    /// What an entry does not say: an sgl-kernel op in `sgl_kernel.kvcacheio` with sgl-kernel's
    /// tuning and checks, registered for CPU and CUDA tensors.
    const DEFAULT: OpSpec = OpSpec {
        name: "",
        args: &[],
        shape: Shape::Custom,
        tuning: Tuning::Pass,
        schema: "",
        sglang: Sglang::Aot,
        keys: &["CPU", "CUDA"],
        num_layers: None,
        same_dtype: false,
        item_check: ItemCheck::SglKernel,
        binding: Binding::Generic,
        doc: "",
    };

    /// The op named `name`.
    pub fn find(name: &str) -> Option<&'static OpSpec> {
        CATALOGUE.iter().find(|s| s.name == name)
    }

    /// Each layer's extent in the tables of one call (`(kind, table)`: its argument's kind) as
    /// the driver can tell it (`int` reads the op's integer arguments): up to the next layer
    /// ([`table_extents`]), or for page rows, whose layers may interleave, up to the next layer
    /// whose rows would meet its own ([`page_row_extents`]).
    pub fn known_extents(&self, tables: &[(ArgKind, &LayerTable)], int: &dyn Fn(&str) -> i64) -> Vec<Vec<Option<u64>>> {
        let positive = |name: &str| u64::try_from(int(name)).unwrap_or(0);
        match self.shape {
            Shape::PageRows => {
                let stride = |k: ArgKind| positive(if k == ArgKind::InLayers { "host_stride" } else { "device_stride" });
                let strided: Vec<(&LayerTable, u64)> = tables.iter().map(|&(k, t)| (t, stride(k))).collect();
                page_row_extents(&strided, positive("row_bytes"))
            }
            _ => table_extents(&tables.iter().map(|&(_, t)| t).collect::<Vec<_>>()),
        }
    }

    /// Whether the op writes its layer or array argument of `kind` (`int` reads the op's integer
    /// arguments): the `Out` kinds, except that page rows go whichever way `load` says.
    pub fn writes(&self, kind: ArgKind, int: &dyn Fn(&str) -> i64) -> bool {
        match (self.shape, kind) {
            (Shape::PageRows, ArgKind::InLayers) => int("load") == 0,
            (Shape::PageRows, ArgKind::OutLayers) => int("load") != 0,
            (_, k) => matches!(k, ArgKind::Out | ArgKind::OutLayers | ArgKind::OutList),
        }
    }

    /// Bytes a layer of a trusted table of addresses must hold for index values below `top`
    /// (`source`: the op's first layer argument, else its second; `int` reads the op's integer
    /// arguments, 0 where absent): items of `item_size` bytes, DeepSeek-V4 C4 tokens in whole
    /// 37,440-byte pages, page rows of `row_bytes` every `host_stride` / `device_stride` bytes.
    pub fn trusted_extent(&self, source: bool, top: u64, int: &dyn Fn(&str) -> i64) -> u64 {
        let positive = |name: &str| u64::try_from(int(name)).unwrap_or(0).max(1);
        match self.shape {
            Shape::Dsv4Tokens => top.div_ceil(DSV4_PAGE_TOKENS).saturating_mul(DSV4_PAGE_BYTES),
            Shape::PageRows => {
                let stride = positive(if source { "host_stride" } else { "device_stride" });
                top.saturating_sub(1).saturating_mul(stride).saturating_add(positive("row_bytes"))
            }
            _ => top.saturating_mul(positive("item_size")),
        }
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

/// Runs generic op `name` with its arguments (`values`, in the catalogue's order and kinds) on
/// `device`: the Python bindings' entry, and what every generated op function calls.
pub fn call(name: &str, device: &Device, values: &[Value<'_>]) -> Result<()> {
    run(name, device, values)
}

fn run(name: &str, device: &Device, values: &[Value<'_>]) -> Result<()> {
    let spec = OpSpec::find(name).filter(|s| s.binding == Binding::Generic).ok_or_else(|| TransferError::BadArgument {
        arg: "name",
        value: 0,
        message: format!("no generic op {name} in the catalogue"),
    })?;
    let a = OpArgs::new(spec, values)?;
    if let Some(mla) = spec.num_layers {
        let (_, first) = a.list(ArgKind::InLayers)?;
        check_num_layers(mla, a.int("num_layers")?, first.len())?;
    }
    if let ItemCheck::Uint4(kernel) = spec.item_check {
        let item = a.int("item_size")?;
        let refuse =
            |arg: &'static str, value: i64, what: &str| TransferError::BadArgument { arg, value, message: format!("{kernel}: {what}") };
        if item <= 0 {
            return Err(refuse("item_size", item, "item_size must be positive"));
        }
        if item % 16 != 0 {
            return Err(refuse("item_size", item, "item_size must be 16-byte aligned (uint4)"));
        }
        if let Some(n) = a.int_or("num_layers", 1).ok().filter(|&n| n <= 0) {
            return Err(refuse("num_layers", n, "num_layers must be positive"));
        }
    }
    match spec.shape {
        Shape::LayerPair => layer_pair(device, &a),
        Shape::PagedLoad(layout) => paged_load(device, &a, layout),
        Shape::LayerLists(io) => layer_lists_op(device, &a, io),
        Shape::LayoutBackup(layout) => layout_backup(device, &a, layout),
        Shape::LayerBackup => layer_backup(device, &a),
        Shape::DirectLoad => direct_load(device, &a),
        Shape::DirectBackup => direct_backup(device, &a),
        Shape::DirectLayerBackup => direct_layer_backup(device, &a),
        Shape::EmbeddingRanges => embedding_ranges(device, &a),
        Shape::Dsv4Tokens => dsv4_tokens(device, &a),
        Shape::PageRows => page_rows(device, &a),
        Shape::Custom => Err(TransferError::BadArgument { arg: "name", value: 0, message: format!("{name} has its own binding") }),
    }
}

/// What every kernel op's docstring ends with.
const SIZES: &str = "Sizes are bytes; arrays, executors and checks: see the module docstring.";

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

/// An op's whole docstring: its documentation, then how its arguments and tuning are taken.
pub fn docstring(spec: &OpSpec) -> String {
    let mut out = spec.doc.to_string();
    match spec.tuning {
        Tuning::Env => out.push_str(" ``block_quota=None`` takes ``SGLANG_HICACHE_BLOCK_QUOTA`` when set, as sglang does."),
        Tuning::EnvOr(n) => {
            out.push_str(&format!(" ``block_quota=None`` takes ``SGLANG_HICACHE_BLOCK_QUOTA`` when set, else {n} (sglang's)."))
        }
        Tuning::PerItem => out.push_str(" ``num_warps_per_item`` is accepted and ignored, as sglang's JIT kernel does."),
        Tuning::BlockSize => {
            out.push_str(" ``block_size`` (sglang's threads per block) must be a multiple of 32 from 32 to 1024 and is otherwise ignored.")
        }
        Tuning::None | Tuning::Pass => {}
    }
    if spec.binding == Binding::Custom {
        return out;
    }
    if spec.args.iter().any(|(_, k)| matches!(k, ArgKind::InLayers | ArgKind::OutLayers)) {
        out.push_str(
            "\n\n``*_layers`` arguments take a list of arrays (every index is bounds-checked against its layer) or, as sglang \
             passes them, a 1-D int64 or uint64 table of layer base addresses (host or GPU memory), which is trusted: each layer \
             is assumed to hold what the largest index needs.",
        );
    }
    if spec.args.iter().any(|(_, k)| matches!(k, ArgKind::Idx | ArgKind::HostIdx)) {
        out.push_str("\n\n");
        out.push_str(SIZES);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each schema names the catalogue's arguments in its order with matching types, then the
    /// tuning arguments exactly where the op takes them.
    #[test]
    fn schemas_agree_with_the_arguments() {
        for spec in CATALOGUE {
            if spec.schema.is_empty() {
                // No torch op: sglang calls it from a JIT module only.
                assert!(matches!(spec.sglang, Sglang::Jit(_)) && spec.keys.is_empty(), "{}", spec.name);
                continue;
            }
            let (args, _) = spec.schema.rsplit_once("->").expect("schema has a result");
            let inner = args.trim().strip_prefix('(').and_then(|a| a.strip_suffix(')')).expect("schema has arguments");
            let params: Vec<(String, String)> = inner
                .split(',')
                .map(|p| {
                    let mut w = p.split_whitespace();
                    let ty = w.next().unwrap_or_default().to_string();
                    (w.next().unwrap_or_default().to_string(), ty)
                })
                .collect();
            let mut want: Vec<(String, String)> = spec
                .args
                .iter()
                .map(|(n, k)| {
                    let ty = match k {
                        ArgKind::InList | ArgKind::OutList => "Tensor[]",
                        ArgKind::Int => "int",
                        ArgKind::Ints => "int[]",
                        ArgKind::Out if spec.schema.contains("Tensor!") => "Tensor!",
                        _ => "Tensor",
                    };
                    (n.to_string(), ty.to_string())
                })
                .collect();
            match spec.tuning {
                Tuning::None | Tuning::BlockSize => {}
                Tuning::PerItem => want.push(("num_warps_per_item".into(), "int".into())),
                Tuning::Pass | Tuning::Env | Tuning::EnvOr(_) => {
                    want.push(("block_quota".into(), "int".into()));
                    want.push(("num_warps_per_block".into(), "int".into()));
                }
            }
            assert_eq!(params, want, "{}", spec.name);
            assert!(spec.schema.ends_with("()") || spec.schema.ends_with("-> int"), "{}", spec.name);
        }
    }

    /// Every generic op runs through [`call`] on the cpu executor with one small argument of each
    /// kind: each semantics finds every argument it reads by name and role (a name missing from
    /// an entry is an `args` error), and the op succeeds.
    #[test]
    fn every_generic_op_finds_its_arguments() {
        let dev = Device::cpu();
        for spec in CATALOGUE.iter().filter(|s| s.binding == Binding::Generic) {
            // One 64-byte array per argument: 8 rows of 8 bytes, also a page_first_direct
            // buffer [8 pages, 1 layer, page_size 1, 8 bytes].
            // A DeepSeek-V4 C4 buffer is one page; page rows are 128 bytes.
            let len = match spec.shape {
                Shape::Dsv4Tokens => DSV4_PAGE_BYTES as usize,
                Shape::PageRows => 256,
                _ => 64,
            };
            let mut bufs: Vec<Vec<u8>> = spec.args.iter().map(|_| vec![7u8; len]).collect();
            let tensors: Vec<Vec<RawTensor>> = bufs
                .iter_mut()
                .map(|b| {
                    vec![unsafe { RawTensor::new(b.as_mut_ptr() as u64, b.len() as u64, vec![8, 1, 1, len as u64 / 8], Memory::Host) }]
                })
                .collect();
            let (src, dst, none) = ([0i64], [1i64], [] as [i64; 0]);
            let mut idx = 0;
            let values: Vec<Value<'_>> = spec
                .args
                .iter()
                .enumerate()
                .map(|(i, (_, kind))| match kind {
                    ArgKind::In | ArgKind::Out => Value::Tensor(&tensors[i][0]),
                    ArgKind::InLayers | ArgKind::OutLayers | ArgKind::InList | ArgKind::OutList => Value::Tensors(&tensors[i]),
                    ArgKind::Idx | ArgKind::HostIdx => {
                        idx += 1;
                        let list: &[i64] = if idx == 1 { &src } else { &dst };
                        if *kind == ArgKind::Idx {
                            Value::Indices(Indices::Host(list))
                        } else {
                            Value::Ints(list)
                        }
                    }
                    ArgKind::Ints => Value::Ints(&none),
                    ArgKind::Int => Value::Int(match spec.args[i].0 {
                        "layer_id" => 0,
                        "item_size" | "src_layout_dim" | "dst_layout_dim" if matches!(spec.item_check, ItemCheck::Uint4(_)) => 16,
                        "item_size" | "src_layout_dim" | "dst_layout_dim" => 8,
                        "row_bytes" | "host_stride" | "device_stride" => 128,
                        _ => 1,
                    }),
                })
                .collect();
            let r = call(spec.name, &dev, &values);
            assert!(r.is_ok(), "{}: {r:?}", spec.name);
        }
        let err = call("transfer_kv_per_layer", &dev, &[Value::Int(1)]).unwrap_err();
        assert!(matches!(err, TransferError::BadArgument { arg: "args", .. }), "{err:?}");
    }

    #[test]
    fn names_are_unique_and_found() {
        for (i, s) in CATALOGUE.iter().enumerate() {
            assert!(CATALOGUE[..i].iter().all(|t| t.name != s.name), "{} twice", s.name);
            assert_eq!(OpSpec::find(s.name).map(|t| t.name), Some(s.name));
        }
    }
}
