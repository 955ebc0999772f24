//! An op's arguments as the catalogue names them: the values a binding (or a generated Rust
//! function) hands over, checked against the entry's kinds once, then read by role and name by
//! the op's semantics.

use super::catalogue::spec::{ArgKind, OpSpec, Value};
use super::*;
use crate::plan::{LaunchTuning, TableGuards};
use crate::{Result, TransferError};

/// A mistake between the catalogue and a caller of [`super::catalogue::call`] or an op's
/// semantics: never the caller's data.
fn mismatch(spec: &OpSpec, message: String) -> TransferError {
    TransferError::BadArgument { arg: "args", value: spec.args.len() as i64, message: format!("{}: {message}", spec.name) }
}

/// The arguments of one op call: `values[i]` is argument `spec.args[i]`.
pub(super) struct OpArgs<'v, 'a> {
    pub(super) spec: &'static OpSpec,
    values: &'v [Value<'a>],
    /// The layers of each table argument, by argument.
    tables: Vec<Vec<RawTensor>>,
    /// The device checks of the tables.
    guards: TableGuards,
    /// The call's launch tuning, for every plan it makes.
    tuning: Option<LaunchTuning>,
}

impl<'v, 'a: 'v> OpArgs<'v, 'a> {
    /// Checks that there is one value per argument, each of its kind, and sizes the layers of
    /// its tables ([`table_extents`]; where that cannot tell, by the largest host index of the
    /// table's side).
    pub(super) fn new(spec: &'static OpSpec, values: &'v [Value<'a>], tuning: Option<LaunchTuning>) -> Result<Self> {
        if values.len() != spec.args.len() {
            return Err(mismatch(spec, format!("{} arguments, the catalogue lists {}", values.len(), spec.args.len())));
        }
        if let Some(i) = (0..values.len()).find(|&i| !values[i].fits(spec.args[i].1)) {
            return Err(mismatch(spec, format!("argument {i} ({}) is of another kind than the catalogue says", spec.args[i].0)));
        }
        let mut a = OpArgs { spec, values, tables: vec![Vec::new(); values.len()], guards: TableGuards::default(), tuning };
        let at: Vec<usize> = (0..values.len()).filter(|&i| matches!(values[i], Value::Table(_))).collect();
        if at.is_empty() {
            return Ok(a);
        }
        let tables: Vec<(ArgKind, &LayerTable)> =
            at.iter().filter_map(|&i| if let Value::Table(t) = values[i] { Some((spec.args[i].1, t)) } else { None }).collect();
        let extents = spec.known_extents(&tables, &|name| a.int(name).unwrap_or(0));
        let (src, dst) = a.indices()?;
        for ((&i, &(_, t)), ext) in at.iter().zip(&tables).zip(extents) {
            let (name, kind) = spec.args[i];
            // A table's layers are addressed by its side's list: the sources read, the
            // destinations written.
            let list = if kind == ArgKind::InLayers { src } else { dst };
            let int = |name: &str| a.int(name).unwrap_or(0);
            let by_index = match list {
                Indices::Host(v) => Some(spec.index_extent(kind == ArgKind::InLayers, v, &int)),
                Indices::Cuda(_) => None,
            };
            let layers = t
                .entries()
                .iter()
                .zip(ext)
                .enumerate()
                .map(|(j, (&addr, len))| {
                    let len = len.or(by_index).ok_or_else(|| {
                        bad(
                            &format!("{name}[{j}]"),
                            format!(
                                "the driver does not say how far the layer at {addr:#x} extends; pass the layers as a list of arrays, \
                                 or host index lists"
                            ),
                        )
                    })?;
                    // SAFETY: the table's contract (`LayerTable::new`): each layer is valid
                    // memory up to its allocation's end, which bounds `len`, or, sized by the
                    // largest index, as sglang trusts its tables.
                    Ok(unsafe { RawTensor::new(addr, len, vec![], t.memory()) })
                })
                .collect::<Result<Vec<_>>>()?;
            a.tables[i] = layers;
            if let Some(g) = t.guard() {
                a.guards.push(g)?;
            }
        }
        Ok(a)
    }

    /// Runs the calls planned from these arguments ([`run_all`]), each carrying the device
    /// checks of the tables it was planned from and the call's launch tuning.
    pub(super) fn run(&self, mut calls: Vec<Call>) -> Result<()> {
        for c in &mut calls {
            if !self.guards.is_empty() {
                c.guard_tables(self.guards)?;
            }
            c.tune(self.tuning);
        }
        run_all(calls)
    }

    fn named(&self, name: &str) -> Option<&'v Value<'a>> {
        self.spec.args.iter().position(|(n, _)| *n == name).map(|i| &self.values[i])
    }

    /// Integer argument `name`.
    pub(super) fn int(&self, name: &str) -> Result<i64> {
        match self.named(name) {
            Some(Value::Int(v)) => Ok(*v),
            _ => Err(mismatch(self.spec, format!("no integer argument {name}"))),
        }
    }

    /// Integer argument `name`, or `default` for an op without it (`page_size` and `head_num`
    /// of the page_first ops are 1).
    pub(super) fn int_or(&self, name: &str, default: i64) -> Result<i64> {
        match self.named(name) {
            None => Ok(default),
            Some(_) => self.int(name),
        }
    }

    /// List of integers `name`.
    pub(super) fn ints(&self, name: &str) -> Result<&'v [i64]> {
        match self.named(name) {
            Some(Value::Ints(v)) => Ok(v),
            _ => Err(mismatch(self.spec, format!("no integer list {name}"))),
        }
    }

    fn of_kind<'k>(&self, kinds: &'k [ArgKind]) -> impl Iterator<Item = (&'static str, &'v Value<'a>)> + 'k
    where
        'v: 'k,
    {
        self.spec.args.iter().zip(self.values).filter(move |((_, k), _)| kinds.contains(k)).map(|((n, _), v)| (*n, v))
    }

    /// The arrays of kind `kind` (`In`: the sources, K then V; `Out`: the destinations),
    /// named by their arguments.
    pub(super) fn tensors(&self, kind: ArgKind) -> Vec<Arg<'v>> {
        self.of_kind(&[kind])
            .filter_map(|(n, v)| match v {
                Value::Tensor(t) => Some(arg(n, t)),
                _ => None,
            })
            .collect()
    }

    /// The lists of arrays of kinds `kinds` (a table's layers too), with their names.
    pub(super) fn lists(&self, kinds: &[ArgKind]) -> Vec<(&'static str, &[RawTensor])> {
        self.spec
            .args
            .iter()
            .zip(self.values)
            .zip(&self.tables)
            .filter(|(((_, k), _), _)| kinds.contains(k))
            .filter_map(|(((n, _), v), layers)| match v {
                Value::Tensors(t) => Some((*n, *t)),
                Value::Table(_) => Some((*n, layers.as_slice())),
                _ => None,
            })
            .collect()
    }

    /// The one list of arrays of kind `kind`, with its name.
    pub(super) fn list(&self, kind: ArgKind) -> Result<(&'static str, &[RawTensor])> {
        self.lists(&[kind]).into_iter().next().ok_or_else(|| mismatch(self.spec, format!("no {kind:?} argument")))
    }

    /// The source and destination index lists, CUDA ones tagged with the op's name (their device
    /// check names it).
    pub(super) fn indices(&self) -> Result<(Indices<'v>, Indices<'v>)> {
        let mut lists = self.of_kind(&[ArgKind::Idx, ArgKind::HostIdx]).filter_map(|(_, v)| match v {
            Value::Indices(x) => Some(x.call(self.spec.name)),
            Value::Ints(x) => Some(Indices::Host(x)),
            _ => None,
        });
        match (lists.next(), lists.next()) {
            (Some(s), Some(d)) => Ok((s, d)),
            _ => Err(mismatch(self.spec, "no source and destination index lists".into())),
        }
    }

    /// The index lists of an op that reads them on the host.
    pub(super) fn host_indices(&self) -> Result<(&'v [i64], &'v [i64])> {
        match self.indices()? {
            (Indices::Host(s), Indices::Host(d)) => Ok((s, d)),
            _ => Err(mismatch(self.spec, "index lists must be on the host".into())),
        }
    }
}

/// The references of `args`, as the pool builders take them.
pub(super) fn refs<'x, 'a>(args: &'x [Arg<'a>]) -> Vec<&'x Arg<'a>> {
    args.iter().collect()
}
