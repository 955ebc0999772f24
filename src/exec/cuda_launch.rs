//! The cuda executor's launch description of a gather step, built without a driver: the
//! argument structs `kernels/transfer.cu` reads, the copy word and the grid. The executor
//! launches exactly this; the host emulation test (`tests/kernel_emu.rs`) runs the kernel's
//! source on the CPU with the same description, so index, struct and grid mistakes show up
//! without a GPU.

use crate::error::{Result, TransferError};
use crate::geometry::{Addr, BufRef};
use crate::plan::{DeviceIndexCheck, GatherStep, TableGuard};

pub use crate::plan::{LaunchTuning, MAX_BLOCK_QUOTA};

/// The kernel's `Side`: 48 bytes, six 64-bit fields.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SideC {
    /// Base address of the buffer (device pointer, or a host address under emulation).
    pub ptr: u64,
    /// The address formula's terms (see [`Addr`]).
    pub base: u64,
    /// Items per page.
    pub page: u64,
    /// Bytes between pages.
    pub page_stride: u64,
    /// Bytes between items within a page.
    pub row_stride: u64,
    /// Bytes between head chunks.
    pub head_stride: u64,
}

/// The kernel's `Launch`: one (layer, component) address pair, 96 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchC {
    /// Where items are read.
    pub src: SideC,
    /// Where items are written.
    pub dst: SideC,
}

const _: () = assert!(std::mem::size_of::<SideC>() == 48 && std::mem::size_of::<LaunchC>() == 96);

/// Everything one `hicache_gather_w{16,8,4}` launch takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherLaunch {
    /// The `launches` table, K before V, layer by layer.
    pub table: Vec<LaunchC>,
    /// 16 (`hicache_gather_w16`), 8 (`hicache_gather_w8`) or 4 (`hicache_gather_w4`).
    pub word: u32,
    /// Grid size.
    pub blocks: u32,
    /// Threads per block (`num_warps_per_block × 32`).
    pub threads_per_block: u32,
    /// Index pairs.
    pub n_items: i64,
    /// Head chunks per item.
    pub heads: u64,
    /// Bytes per head chunk.
    pub chunk_bytes: u64,
    /// Items each warp visits (strided).
    pub items_per_warp: i64,
}

/// The kernels' nine arguments, in their order: the address-pair table, its length, the index
/// lists, the item count, heads, chunk bytes, items per warp and the status word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelArgs {
    /// Address of the `launches` table.
    pub table: u64,
    /// Entries in it.
    pub n_launches: i32,
    /// Address of the source indices (`i64`).
    pub src_idx: u64,
    /// Address of the destination indices (`i64`).
    pub dst_idx: u64,
    /// Index pairs.
    pub n_items: i64,
    /// Head chunks per item.
    pub heads: u64,
    /// Bytes per head chunk.
    pub chunk_bytes: u64,
    /// Items each warp visits.
    pub items_per_warp: i64,
    /// Address of the call's device-check status word (`hicache_check_indices`), or 0 when its
    /// index lists were checked on the host: the kernel copies nothing unless the word is all
    /// ones.
    pub status: u64,
}

impl KernelArgs {
    /// Pointers to each argument, as `cuLaunchKernel` takes them (valid while `self` is).
    pub fn params(&mut self) -> [*mut std::ffi::c_void; 9] {
        use std::ffi::c_void;
        [
            &mut self.table as *mut _ as *mut c_void,
            &mut self.n_launches as *mut _ as *mut c_void,
            &mut self.src_idx as *mut _ as *mut c_void,
            &mut self.dst_idx as *mut _ as *mut c_void,
            &mut self.n_items as *mut _ as *mut c_void,
            &mut self.heads as *mut _ as *mut c_void,
            &mut self.chunk_bytes as *mut _ as *mut c_void,
            &mut self.items_per_warp as *mut _ as *mut c_void,
            &mut self.status as *mut _ as *mut c_void,
        ]
    }
}

/// The checksumming gathers' (`hicache_gather_sum_w{16,8,4}`) eleven arguments: the plain
/// kernels' nine, then the key stream's base and the sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SumKernelArgs {
    /// The plain kernels' arguments.
    pub args: KernelArgs,
    /// The checksum key stream's base ([`crate::integrity::key_base`] of the seed, below
    /// `2^32`): the kernels compute key `i` of an item's 32-bit word `i` from it in registers.
    pub key_base: u64,
    /// Address of the sums, [`GatherLaunch::sum_entries`] `u64`s (index pair major, then address
    /// pair), zeroed before the launch: entry `i · n_launches + l` ends as the checksum of index
    /// pair `i`'s item of address pair `l` (skipped pairs stay zero).
    pub sums: u64,
}

impl SumKernelArgs {
    /// Pointers to each argument, as `cuLaunchKernel` takes them (valid while `self` is).
    pub fn params(&mut self) -> [*mut std::ffi::c_void; 11] {
        use std::ffi::c_void;
        let [a0, a1, a2, a3, a4, a5, a6, a7, a8] = self.args.params();
        [a0, a1, a2, a3, a4, a5, a6, a7, a8, &mut self.key_base as *mut _ as *mut c_void, &mut self.sums as *mut _ as *mut c_void]
    }
}

/// `hicache_check_indices`'s nine arguments, in its order, for one phase (0, 1 or 2) of the
/// checks of `check`: the index lists, their length, both bounds, which side is the
/// destination, the claim words and the call's status slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckArgs {
    /// Address of the host pool's indices.
    pub host_idx: u64,
    /// Address of the device pool's indices.
    pub dev_idx: u64,
    /// Entries in each list.
    pub n: i64,
    /// Host indices must be below this.
    pub host_bound: u64,
    /// Device indices must be below this.
    pub dev_bound: u64,
    /// 1 when the host indices are the destinations.
    pub dst_is_host: i32,
    /// Address of the claim words (one `u32` per destination slot).
    pub owner: u64,
    /// Address of the call's 32-byte status slot.
    pub status: u64,
    /// The phase.
    pub phase: i32,
}

impl CheckArgs {
    /// The arguments of phase `phase` of `check`, with claim words at `owner` and the status at
    /// `status`.
    pub fn new(check: &DeviceIndexCheck, owner: u64, status: u64, phase: i32) -> CheckArgs {
        CheckArgs {
            host_idx: check.lists.host,
            dev_idx: check.lists.device,
            n: check.lists.len as i64,
            host_bound: check.host_bound,
            dev_bound: check.device_bound,
            dst_is_host: check.dst_is_host as i32,
            owner,
            status,
            phase,
        }
    }
    /// The arguments of phase 3 for table guard `g`, whose first entry is at `first` among the
    /// call's tables.
    pub fn table(g: &TableGuard, first: u64, status: u64) -> CheckArgs {
        CheckArgs {
            host_idx: g.table,
            dev_idx: g.expected,
            n: g.len as i64,
            host_bound: first,
            dev_bound: 0,
            dst_is_host: 0,
            owner: 0,
            status,
            phase: 3,
        }
    }
    /// Pointers to each argument, as `cuLaunchKernel` takes them (valid while `self` is).
    pub fn params(&mut self) -> [*mut std::ffi::c_void; 9] {
        use std::ffi::c_void;
        [
            &mut self.host_idx as *mut _ as *mut c_void,
            &mut self.dev_idx as *mut _ as *mut c_void,
            &mut self.n as *mut _ as *mut c_void,
            &mut self.host_bound as *mut _ as *mut c_void,
            &mut self.dev_bound as *mut _ as *mut c_void,
            &mut self.dst_is_host as *mut _ as *mut c_void,
            &mut self.owner as *mut _ as *mut c_void,
            &mut self.status as *mut _ as *mut c_void,
            &mut self.phase as *mut _ as *mut c_void,
        ]
    }
}

impl GatherLaunch {
    /// The kernel arguments of this launch, with the table, index lists and status word (0: none)
    /// at these addresses.
    pub fn args(&self, table: u64, src_idx: u64, dst_idx: u64, status: u64) -> KernelArgs {
        KernelArgs {
            table,
            n_launches: self.table.len() as i32,
            src_idx,
            dst_idx,
            n_items: self.n_items,
            heads: self.heads,
            chunk_bytes: self.chunk_bytes,
            items_per_warp: self.items_per_warp,
            status,
        }
    }
}

/// Most 32-bit words per item the summing kernels sum (their word positions are 32-bit).
pub const MAX_SUM_ITEM_WORDS: u64 = u32::MAX as u64 / 2;

impl GatherLaunch {
    /// 32-bit words of one item (all its head chunks).
    pub fn item_words(&self) -> u64 {
        self.heads.saturating_mul(self.chunk_bytes / 4)
    }
    /// The sums a checksumming launch writes (index pairs × address pairs), checked: the
    /// summing kernels keep an item's word positions in 32 bits.
    pub fn sum_entries(&self) -> Result<u64> {
        let too_big = |what: &str, v: u64, limit: u64| TransferError::OutOfMemory {
            what: format!("cuda checksums: {what}"),
            requested: v,
            limit: format!("at most {limit}"),
        };
        // The planner refuses such items ([`Capabilities::max_checksum_item_words`]); kept
        // as the kernels' own guard.
        if self.item_words() > MAX_SUM_ITEM_WORDS {
            return Err(too_big("32-bit words per item", self.item_words(), MAX_SUM_ITEM_WORDS));
        }
        (self.n_items.max(0) as u64)
            .checked_mul(self.table.len() as u64)
            .filter(|n| n.checked_mul(8).is_some_and(|b| b <= isize::MAX as u64))
            .ok_or_else(|| too_big("sum entries", u64::MAX, isize::MAX as u64 / 8))
    }
    /// The summing kernels' arguments: [`GatherLaunch::args`], the key stream's base and the
    /// sums at `sums`.
    pub fn sum_args(&self, table: u64, src_idx: u64, dst_idx: u64, status: u64, key_base: u32, sums: u64) -> SumKernelArgs {
        SumKernelArgs { args: self.args(table, src_idx, dst_idx, status), key_base: u64::from(key_base), sums }
    }
}

fn side(a: &Addr, ptr: u64) -> SideC {
    let (base, page, page_stride, row_stride, head_stride) = a.strides();
    SideC { ptr, base, page, page_stride, row_stride, head_stride }
}

/// The launch of gather step `g` whose buffers start at `ptr_of(buf)`. `max_threads_per_block`
/// is the kernel function's limit (`CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`): more warps than
/// it allows are clamped, never launched.
pub fn gather_launch(
    g: &GatherStep,
    ptr_of: impl Fn(BufRef) -> u64,
    tuning: LaunchTuning,
    max_threads_per_block: u32,
) -> Result<GatherLaunch> {
    let chunk = g.chunk_bytes();
    // The planner guarantees whole 4-byte words (the portable chunk rule); a plan that broke
    // it would copy misaligned words, a sticky error that kills the context.
    if !chunk.is_multiple_of(4) || chunk == 0 {
        return Err(TransferError::ChunkNotWordAligned { chunk_bytes: chunk, item_bytes: chunk * g.heads(), heads: g.heads(), word: 4 });
    }
    let table: Vec<LaunchC> = g
        .pairs()
        .iter()
        .map(|l| LaunchC { src: side(l.src(), ptr_of(l.src().buf())), dst: side(l.dst(), ptr_of(l.dst().buf())) })
        .collect();
    // The widest word every address of the launch is aligned to: 16-byte words for the usual
    // item sizes (656, 1152, 8448 B) on aligned pools.
    let aligned = |w: u64, s: &SideC| [s.ptr, s.base, s.page_stride, s.row_stride, s.head_stride].iter().all(|v| v % w == 0);
    let word = [16u32, 8]
        .into_iter()
        .find(|&w| chunk.is_multiple_of(w as u64) && table.iter().all(|l| aligned(w as u64, &l.src) && aligned(w as u64, &l.dst)))
        .unwrap_or(4);
    // Every address the 4-byte kernel forms must be 4-byte aligned too: bases and strides, not
    // only the buffers' addresses (a misaligned access is a sticky error that kills the context).
    for l in &table {
        for (what, s) in [("source", &l.src), ("destination", &l.dst)] {
            let terms = [
                ("address", s.ptr),
                ("base", s.base),
                ("page stride", s.page_stride),
                ("row stride", s.row_stride),
                ("head stride", s.head_stride),
            ];
            if let Some((name, value)) = terms.iter().find(|(_, v)| !v.is_multiple_of(4)) {
                return Err(TransferError::Misaligned { what: format!("cuda {what} {name}"), value: *value, required: 4 });
            }
        }
    }
    let warps = tuning.num_warps_per_block.clamp(1, (max_threads_per_block / 32).max(1));
    let quota = tuning.block_quota.max(1) as i64;
    let n = g.src_indices().len() as i64;
    // sglang's grid: at most `block_quota` blocks, each warp a strided share of the items.
    let items_per_warp = (n.max(1) + quota * warps as i64 - 1) / (quota * warps as i64);
    let blocks = ((n.max(1) + items_per_warp * warps as i64 - 1) / (items_per_warp * warps as i64)) as u32;
    Ok(GatherLaunch {
        table,
        word,
        blocks,
        threads_per_block: warps * 32,
        n_items: n,
        heads: g.heads(),
        chunk_bytes: chunk,
        items_per_warp,
    })
}
