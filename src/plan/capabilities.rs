//! What an executor can address, read by the planner: [`Capabilities`] and the `auto` io
//! backend's table.

use super::*;
use crate::geometry::{IoBackend, Profile};

/// What an executor can address; read by the planner so that backend limits are rejected (or
/// worked around by splitting) here, in the same place as everything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Executor name, for messages.
    pub name: &'static str,
    /// Smallest word the `kernel` path copies; every copy chunk must be a multiple of it.
    pub kernel_word: u64,
    /// Alignment of every offset and length of a `direct` copy.
    pub direct_align: u64,
    /// Largest range a `kernel` step can bind at once (wgpu: the storage binding limit), and the
    /// alignment of a bound range's start. An item chunk must fit one aligned window.
    pub max_binding: u64,
    /// Alignment of a bound window's start.
    pub binding_align: u64,
    /// Most index pairs one `kernel` step may carry (wgpu: the index table is one binding and
    /// one dispatch); larger calls are split into several steps.
    pub max_gather_items: u64,
    /// Largest index a `kernel` step can address (wgpu: 32-bit signed indices).
    pub max_index: u64,
    /// Most bytes a device pool may hold in all (read by the pools before allocating).
    pub max_pool_bytes: u64,
    /// Most bytes a host pool may hold in all.
    pub max_host_pool_bytes: u64,
    /// Most invocations a `kernel` step gives one item chunk (a power of two): the gather's
    /// shape for this adapter (wgpu: 1 on CPU adapters, up to 64 on GPUs, one per word).
    pub max_lanes: u64,
    /// Largest buffer of one pool segment: a pool buffer above it is split into segments of
    /// whole copy chunks (see [`Capabilities::segment_bytes`]); `u64::MAX` keeps one buffer.
    pub max_segment: u64,
    /// Most loop iterations one `kernel` invocation may run (wgpu: 65,535, the most some
    /// drivers run before they stop a loop without a word, as Mesa's llvmpipe does): the
    /// planner gives an item more lanes until each stays within it, and refuses a chunk shape
    /// no lane count fits. `u64::MAX`: no limit.
    pub max_loop_trips: u64,
    /// Whether the executor checks index lists held in its own (CUDA) memory on the device
    /// ([`Plan::device_check`]); only such an executor gets plans of device lists.
    pub device_index_lists: bool,
    /// Whether the `kernel` copies compute item checksums as they copy (recording them for
    /// backups, verifying them for loads: see [`crate::integrity`]).
    pub checksums: bool,
    /// Whether the `direct` copies compute them too (`checksums` and this: a `direct` plan's
    /// backups otherwise leave their items' checksums unknown, and its loads read them
    /// unverified).
    pub direct_checksums: bool,
    /// Most 32-bit words per item a checksumming copy sums (cuda's summing kernels keep an
    /// item's word positions in 32 bits): a larger item of a pool with checksums is refused
    /// before anything moves. `u64::MAX`: no limit.
    pub max_checksum_item_words: u64,
    /// Which io backend `auto` picks, by item size and run length.
    pub auto: AutoTable,
}

/// The faster io backend by steps of one or several layers, item size and mean run length
/// (consecutive items), for `auto`: measured per executor (see `hicache-io bench --io auto`), or
/// [`AutoTable::DEFAULT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AutoTable {
    /// `direct[m][i][r]`: `direct` is faster for steps of one layer (`m = 0`, loads) or of
    /// several (`m = 1`, backups), items near `AUTO_ITEMS[i]` bytes, runs near `AUTO_RUNS[r]`.
    pub direct: [[[bool; 4]; 6]; 2],
    /// True when measured on this executor (false: the default rule).
    pub calibrated: bool,
}

/// Item sizes of the `auto` table, bytes (MLA records and DSA pages among them).
pub const AUTO_ITEMS: [u64; 6] = [128, 656, 1152, 4096, 8448, 16384];
/// Run lengths of the `auto` table, items.
pub const AUTO_RUNS: [u64; 4] = [1, 4, 16, 64];

impl AutoTable {
    /// Before calibration: `direct` once a run is at least 8 KiB (a copy per run then costs
    /// less than the gather's per-item work on every executor measured).
    pub const DEFAULT: AutoTable = {
        let mut direct = [[[false; 4]; 6]; 2];
        let mut m = 0;
        while m < 2 {
            let mut i = 0;
            while i < 6 {
                let mut r = 0;
                while r < 4 {
                    direct[m][i][r] = AUTO_ITEMS[i] * AUTO_RUNS[r] >= 8192;
                    r += 1;
                }
                i += 1;
            }
            m += 1;
        }
        AutoTable { direct, calibrated: false }
    };

    /// The faster io backend for steps of `layers` layers, `item_bytes` items in runs of
    /// `mean_run` items (nearest table cell on a log scale).
    pub fn choose(&self, layers: usize, item_bytes: u64, mean_run: f64) -> IoBackend {
        let near = |grid: &[u64], v: f64| {
            let lv = v.max(1.0).log2();
            (0..grid.len())
                .min_by(|&a, &b| ((grid[a] as f64).log2() - lv).abs().total_cmp(&((grid[b] as f64).log2() - lv).abs()))
                .unwrap_or(0)
        };
        if self.direct[usize::from(layers > 1)][near(&AUTO_ITEMS, item_bytes as f64)][near(&AUTO_RUNS, mean_run)] {
            IoBackend::Direct
        } else {
            IoBackend::Kernel
        }
    }
}

impl Capabilities {
    /// What every executor of this crate supports; used by `hicache-io matrix`.
    pub const PORTABLE: Capabilities = Capabilities {
        name: "portable",
        kernel_word: 4,
        direct_align: 4,
        max_binding: 128 << 20,
        binding_align: 256,
        max_gather_items: 1 << 24,
        max_index: i32::MAX as u64,
        max_pool_bytes: u64::MAX,
        max_host_pool_bytes: u64::MAX,
        max_segment: u64::MAX,
        max_lanes: 1,
        max_loop_trips: u64::MAX,
        device_index_lists: false,
        checksums: false,
        direct_checksums: false,
        max_checksum_item_words: u64::MAX,
        auto: AutoTable::DEFAULT,
    };
    /// Host-memory executors: no alignment or binding limit.
    pub const UNLIMITED: Capabilities = Capabilities {
        name: "unlimited",
        kernel_word: 4,
        direct_align: 1,
        max_binding: u64::MAX,
        binding_align: 1,
        max_gather_items: u64::MAX,
        max_index: u64::MAX,
        max_pool_bytes: u64::MAX,
        max_host_pool_bytes: u64::MAX,
        max_segment: u64::MAX,
        max_lanes: 1,
        max_loop_trips: u64::MAX,
        device_index_lists: false,
        checksums: false,
        direct_checksums: false,
        max_checksum_item_words: u64::MAX,
        auto: AutoTable::DEFAULT,
    };

    /// The segment size of a pool buffer of `bytes` whose copy chunks are `chunk_bytes` (at
    /// multiples of it): `bytes` when it fits one buffer, else the largest multiple of
    /// `lcm(chunk, binding alignment, 16)` within `max_segment`, so that no chunk straddles two
    /// segments and every binding window and 16-byte word stays inside one. `None` when one
    /// chunk does not fit a segment.
    pub fn segment_bytes(&self, bytes: u64, chunk_bytes: u64) -> Option<u64> {
        if bytes <= self.max_segment {
            return Some(bytes);
        }
        let granule = lcm(lcm(chunk_bytes.max(1), self.binding_align.max(1)), 16);
        Some(self.max_segment / granule * granule).filter(|&s| s > 0)
    }

    /// Bytes a `kernel` window must be a multiple of for chunks of `chunk_bytes`.
    pub fn window_granule(&self, chunk_bytes: u64) -> u64 {
        lcm(lcm(chunk_bytes, self.binding_align), self.kernel_word)
    }
}

/// The word the launcher check of the `kernel` io backend uses: sglang's 8 bytes in profile
/// `sglang`, the executor's own word in profile `extended`.
pub fn kernel_word(profile: Profile, caps: &Capabilities) -> u64 {
    match profile {
        Profile::Sglang => 8,
        Profile::Extended => caps.kernel_word,
    }
}
