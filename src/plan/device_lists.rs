//! Index lists in CUDA device memory: planned without reading them, checked on the device.

use std::sync::Arc;

use super::*;
use crate::error::{Result, TransferError};
use crate::geometry::{IoBackend, PoolKind, PoolPair, Profile};

/// Index lists in CUDA device memory: `len` `i64` entries at `host` (the host pool's indices) and
/// at `device` (the device pool's), which the host does not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceIndexLists {
    /// Device address of the host pool's indices.
    pub host: u64,
    /// Device address of the device pool's indices.
    pub device: u64,
    /// Entries in each list.
    pub len: usize,
}

/// The value checks the planner makes on host index lists, left to the executor for lists in
/// device memory, in the planner's order: host indices in range, device indices in range,
/// destinations unique among live pairs. The first failing (check, position) becomes the error
/// the planner would have returned ([`DeviceIndexCheck::error`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceIndexCheck {
    /// The lists.
    pub lists: DeviceIndexLists,
    /// Host indices must be below this.
    pub host_bound: u64,
    /// Device indices must be below this.
    pub device_bound: u64,
    /// Whether the host indices are the destinations (a backup).
    pub dst_is_host: bool,
    /// What an index counts.
    pub unit: &'static str,
    /// The call, for the error.
    pub call: &'static str,
    /// How the error names the host and the device lists (`"host"`, `"device"` for pools;
    /// the kvcacheio ops say `"source"` / `"destination"`).
    pub sides: [&'static str; 2],
    /// The caller's tables of layer addresses in device memory the plan's layers were read
    /// from, each checked on the device to still hold what was read (check 3).
    pub tables: TableGuards,
}

/// A caller's table of `len` layer addresses in device memory at `table`, and the copy of what
/// it held when the call was planned, at `expected` (device memory of the executor's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TableGuard {
    /// Device address of the caller's table (`len` u64 entries).
    pub table: u64,
    /// Device address of the entries the plan was made from.
    pub expected: u64,
    /// Entries.
    pub len: u64,
}

/// The tables of one call: at most four (K and V, on either side of an all-layer copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TableGuards {
    guards: [TableGuard; 4],
    len: usize,
}

impl TableGuards {
    /// Adds `g`; more than four tables in one call is refused.
    pub fn push(&mut self, g: TableGuard) -> crate::Result<()> {
        let slot = self.guards.get_mut(self.len).ok_or_else(|| TransferError::BadArgument {
            arg: "tables",
            value: 5,
            message: "more than four layer tables in one call".into(),
        })?;
        *slot = g;
        self.len += 1;
        Ok(())
    }
    /// The guards, with the position of each one's first entry among all of them.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &TableGuard)> {
        self.guards[..self.len].iter().scan(0u64, |at, g| {
            let first = *at;
            *at += g.len;
            Some((first, g))
        })
    }
    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl DeviceIndexCheck {
    /// The error for the device's finding: `check` 0 (host range), 1 (device range), 2
    /// (duplicate destination) or 3 (a layer table rewritten) at `position`, the index found there, and for a duplicate the
    /// position that wrote the destination first.
    pub fn error(&self, check: u64, position: u64, index: i64, first: u64) -> TransferError {
        let position = usize::try_from(position).unwrap_or(usize::MAX);
        let found = match check {
            0 => TransferError::IndexOutOfRange { side: self.sides[0], index, position, bound: self.host_bound, unit: self.unit },
            1 => TransferError::IndexOutOfRange { side: self.sides[1], index, position, bound: self.device_bound, unit: self.unit },
            3 => {
                let found = self.tables.iter().find(|(first, g)| (*first..first + g.len).contains(&(position as u64)));
                let (table, entry) = found.map_or((0, position as u64), |(first, g)| (g.table, position as u64 - first));
                TransferError::LayerTableChanged { table, entry }
            }
            _ => TransferError::DuplicateDestination {
                side: if self.dst_is_host { self.sides[0] } else { self.sides[1] },
                unit: self.unit,
                index,
                first: usize::try_from(first).unwrap_or(usize::MAX),
                second: position,
            },
        };
        TransferError::DeviceIndexCheck { call: self.call, source: Box::new(found) }
    }
}

/// Entries a device-checked list may have: 2^24, far more than one batch's tokens. The plan is
/// made on the host from the list's length (placeholder entries, about 40 bytes per entry while
/// planning), and positions must fit the device check's 32-bit claim words.
pub const MAX_DEVICE_LIST_LEN: usize = 1 << 24;

/// [`plan`] for index lists in CUDA memory: every check that needs no index value is made here,
/// as for host lists and in the same order; the value checks go to the plan's
/// [`DeviceIndexCheck`]. `kernel` only (a `direct` copy's runs are made from index values on
/// the host), and not for the DSA indexer (its token lists become page lists on the host).
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_device_lists(
    profile: Profile,
    caps: &Capabilities,
    owner: u64,
    pair: &Arc<PoolPair>,
    op: Op,
    io_backend: IoBackend,
    lists: DeviceIndexLists,
    call: &'static str,
) -> Result<Plan> {
    let host = pair.host();
    let refuse = |why: &str| TransferError::BadTensor { arg: "indices".into(), reason: format!("CUDA index lists: {why}") };
    if !caps.device_index_lists {
        return Err(refuse(&format!("the {} executor cannot read them (they need the cuda executor)", caps.name)));
    }
    if io_backend != IoBackend::Kernel {
        return Err(refuse("io backend kernel only (pass host indices to direct and auto)"));
    }
    if host.kind() == PoolKind::DsaIndexer {
        return Err(refuse("not for the DSA indexer (its token lists become pages on the host)"));
    }
    if lists.len > MAX_DEVICE_LIST_LEN {
        return Err(refuse(&format!("{} entries, at most {MAX_DEVICE_LIST_LEN}", lists.len)));
    }
    if host.slots().max(pair.device().slots()).saturating_sub(1) > caps.max_index {
        return Err(refuse("the pools are wider than this executor's indices"));
    }
    // Placeholders of the lists' length: negative entries are skipped by every value check and
    // every step, so the plan below is the call's shape with no value looked at.
    let mut placeholder: Vec<i64> = Vec::new();
    placeholder.try_reserve_exact(lists.len).map_err(|_| TransferError::OutOfMemory {
        what: "plan of CUDA index lists".into(),
        requested: lists.len as u64 * 8,
        limit: "host allocation failed".into(),
    })?;
    placeholder.resize(lists.len, -1);
    let req = Request { op, io_backend, host_indices: &placeholder, device_indices: &placeholder };
    let mut plan = plan_io(profile, caps, owner, pair, &req)?;
    if plan.is_empty() {
        return Ok(plan);
    }
    let direction = op.direction();
    let (src, dst) = match direction {
        Direction::HostToDevice => (lists.host, lists.device),
        Direction::DeviceToHost => (lists.device, lists.host),
    };
    let item = host.kind().components() as u64 * host.item_bytes();
    let (mut offset, mut bytes) = (0u64, 0u64);
    let mut group_start: Option<*const i64> = None;
    let mut steps: Vec<Step> = plan.steps.to_vec();
    for step in &mut steps {
        let layers = step.layers.len() as u64;
        if let StepKind::Gather(g) = &mut step.kind {
            // A layer group's pieces follow each other and cover the lists in order; every group
            // starts again with the first piece (the same list).
            if group_start.is_none() || group_start == Some(g.src_indices.as_ptr()) {
                group_start = Some(g.src_indices.as_ptr());
                offset = 0;
            }
            g.device_lists = Some([src + offset * 8, dst + offset * 8]);
            let n = g.src_indices.len() as u64;
            offset += n;
            // At most: the device may skip negative entries, which the host cannot count.
            bytes = bytes.saturating_add(n.saturating_mul(layers).saturating_mul(item));
        }
    }
    plan.steps = steps.into();
    plan.bytes = bytes;
    plan.device_check = Some(DeviceIndexCheck {
        lists,
        host_bound: host.slots(),
        device_bound: pair.device().slots(),
        dst_is_host: direction == Direction::DeviceToHost,
        unit: "slots",
        call,
        sides: ["host", "device"],
        tables: TableGuards::default(),
    });
    Ok(plan)
}
