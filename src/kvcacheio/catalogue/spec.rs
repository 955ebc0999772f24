//! What a catalogue entry says: the kinds of arguments, the launch tuning, where sglang takes
//! the op from, its item checks, how the bindings serve it and its semantics ([`Shape`]); and
//! the values its arguments take ([`Value`]). A leaf of `kvcacheio`: the catalogue's dispatch and
//! the ops' argument reader (`args`) both take these records from here, so neither imports the
//! other's.

use super::super::*;
use crate::geometry::{IoBackend, Layout};

/// What every kernel op's docstring ends with.
const SIZES: &str = "Sizes are bytes; arrays, executors and checks: see the module docstring.";

/// One argument, as the bindings hand it over.
#[derive(Debug, Clone, Copy)]
pub enum Value<'a> {
    /// [`ArgKind::In`], [`ArgKind::Out`].
    Tensor(&'a RawTensor),
    /// [`ArgKind::InLayers`], [`ArgKind::OutLayers`], [`ArgKind::InList`], [`ArgKind::OutList`].
    Tensors(&'a [RawTensor]),
    /// [`ArgKind::Idx`].
    Indices(Indices<'a>),
    /// [`ArgKind::HostIdx`], [`ArgKind::Ints`].
    Ints(&'a [i64]),
    /// [`ArgKind::Int`].
    Int(i64),
    /// [`ArgKind::InLayers`], [`ArgKind::OutLayers`]: a table of layer addresses.
    Table(&'a LayerTable),
}

impl<'a> From<Layers<'a>> for Value<'a> {
    fn from(l: Layers<'a>) -> Self {
        match l {
            Layers::List(v) => Value::Tensors(v),
            Layers::Table(t) => Value::Table(t),
        }
    }
}

impl Value<'_> {
    /// Whether this value can be an argument of `kind`.
    pub(in crate::kvcacheio) fn fits(&self, kind: ArgKind) -> bool {
        use ArgKind::*;
        matches!(
            (self, kind),
            (Value::Tensor(_), In | Out)
                | (Value::Tensors(_), InLayers | OutLayers | InList | OutList)
                | (Value::Table(_), InLayers | OutLayers)
                | (Value::Indices(_), Idx)
                | (Value::Ints(_), HostIdx | Ints)
                | (Value::Int(_), Int)
        )
    }
}

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
    pub(super) const DEFAULT: OpSpec = OpSpec {
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

    /// [`OpSpec::trusted_extent`] for host index values `idx`: what its largest index needs (one
    /// index's worth when none is positive).
    pub fn index_extent(&self, source: bool, idx: &[i64], int: &dyn Fn(&str) -> i64) -> u64 {
        let top = idx.iter().copied().filter(|&i| i >= 0).max().map_or(1, |m| m as u64 + 1);
        self.trusted_extent(source, top, int)
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
