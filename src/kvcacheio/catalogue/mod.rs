//! The one table of sglang's ops: each entry names an op, its arguments and what kind each is,
//! its launch tuning, sglang's torch schema and its documentation. The Python bindings read
//! their arguments by kind from it and call [`call_spec`]; the Python wrappers, their stubs, the
//! `torch.ops` schemas and the list of names sglang imports are made from [`CATALOGUE`]. Adding
//! an op is one entry here (with its [`Shape`]); a new shape adds its semantics, one function.
//!
//! One job a file: `spec.rs` (what an entry says), `table.rs` (the entries and the
//! generated op functions), and here the dispatch: an op's generic checks, then its shape's
//! semantics.

// Visible to `kvcacheio`'s files: they take the records from this leaf, not through the
// dispatch here (which imports them: no circle).
pub(super) mod spec;
mod table;

pub use spec::*;
pub use table::*;

use super::args::OpArgs;
use super::*;
use crate::exec::Device;
use crate::plan::LaunchTuning;
use crate::{Result, TransferError};

/// How one call of an op is made, beyond its arguments.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// Launch tuning for this call's kernels (sglang's `block_quota`, `num_warps_per_block`; the
    /// cuda executor's own when `None`; other executors ignore it).
    pub tuning: Option<LaunchTuning>,
    /// The caller made sgl-kernel's first check of an all-layer op itself, the source layers'
    /// count against `num_layers` (in sglang's order, before it read the index lists): it is not
    /// made again.
    pub num_layers_checked: bool,
}

/// Runs generic op `name` with its arguments (`values`, in the catalogue's order and kinds) on
/// `device`: what every generated op function calls.
pub fn call(name: &str, device: &Device, values: &[Value<'_>]) -> Result<()> {
    run(name, device, values)
}

fn run(name: &str, device: &Device, values: &[Value<'_>]) -> Result<()> {
    let spec = OpSpec::find(name).filter(|s| s.binding == Binding::Generic).ok_or_else(|| TransferError::BadArgument {
        arg: "name",
        value: 0,
        message: format!("no generic op {name} in the catalogue"),
    })?;
    call_spec(spec, device, values, CallOptions::default())
}

/// Runs the generic op of entry `spec` (looked up by the caller: the Python bindings read the
/// arguments by the entry's kinds first) with its arguments on `device`.
pub fn call_spec(spec: &'static OpSpec, device: &Device, values: &[Value<'_>], options: CallOptions) -> Result<()> {
    if spec.binding != Binding::Generic {
        return Err(TransferError::BadArgument {
            arg: "name",
            value: 0,
            message: format!("{} is no generic op of the catalogue", spec.name),
        });
    }
    let a = OpArgs::new(spec, values, options.tuning)?;
    if let (Some(mla), false) = (spec.num_layers, options.num_layers_checked) {
        let (_, first) = a.list(ArgKind::InLayers)?;
        check_num_layers(mla, a.int("num_layers")?, first.len())?;
    }
    item_checks(spec, &a)?;
    dispatch(spec, device, &a)
}

/// sglang's checks of the item size (and layer count) before any tensor is read, where the
/// entry names them.
fn item_checks(spec: &OpSpec, a: &OpArgs<'_, '_>) -> Result<()> {
    let ItemCheck::Uint4(kernel) = spec.item_check else { return Ok(()) };
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
    Ok(())
}

/// The shape's semantics.
fn dispatch(spec: &OpSpec, device: &Device, a: &OpArgs<'_, '_>) -> Result<()> {
    match spec.shape {
        Shape::LayerPair => layer_pair(device, a),
        Shape::PagedLoad(layout) => paged_load(device, a, layout),
        Shape::LayerLists(io) => layer_lists_op(device, a, io),
        Shape::LayoutBackup(layout) => layout_backup(device, a, layout),
        Shape::LayerBackup => layer_backup(device, a),
        Shape::DirectLoad => direct_load(device, a),
        Shape::DirectBackup => direct_backup(device, a),
        Shape::DirectLayerBackup => direct_layer_backup(device, a),
        Shape::EmbeddingRanges => embedding_ranges(device, a),
        Shape::Dsv4Tokens => dsv4_tokens(device, a),
        Shape::PageRows => page_rows(device, a),
        Shape::Custom => Err(TransferError::BadArgument { arg: "name", value: 0, message: format!("{} has its own binding", spec.name) }),
    }
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
