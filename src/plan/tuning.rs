//! Launch tuning: how wide a kernel copy may spread on a GPU, a field of the request that a plan
//! carries to its executor (the cuda executor reads it; the others move bytes the same way
//! whatever it says).

/// Grid tuning, sglang's defaults: 2 blocks of 32 warps (so copies leave SMs to the forward
/// pass). `HICACHE_CUDA_BLOCK_QUOTA` / `HICACHE_CUDA_WARPS_PER_BLOCK` override; a call can
/// bring its own (sglang's `block_quota` / `num_warps_per_block` arguments), clamped by
/// [`LaunchTuning::clamped`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchTuning {
    /// Blocks per launch, at most.
    pub block_quota: u32,
    /// Warps per block (clamped to what the kernel function allows).
    pub num_warps_per_block: u32,
}

impl Default for LaunchTuning {
    fn default() -> Self {
        let env = |k: &str, d: u32| std::env::var(k).ok().and_then(|v| v.parse().ok()).filter(|v: &u32| *v > 0).unwrap_or(d);
        LaunchTuning { block_quota: env("HICACHE_CUDA_BLOCK_QUOTA", 2), num_warps_per_block: env("HICACHE_CUDA_WARPS_PER_BLOCK", 32) }
            .clamped()
    }
}

/// The most blocks a call may ask for: far more than any GPU runs at once, and few enough that
/// the grid arithmetic stays small.
pub const MAX_BLOCK_QUOTA: u32 = 65_536;

impl LaunchTuning {
    /// A call's tuning from sglang's arguments (any `i64`), clamped: block quota to
    /// 1..=[`MAX_BLOCK_QUOTA`], warps to 1..=32 (the kernel function's own limit applies at launch).
    pub fn from_args(block_quota: i64, num_warps_per_block: i64) -> LaunchTuning {
        let c = |v: i64, hi: u32| v.clamp(1, hi as i64) as u32;
        LaunchTuning { block_quota: c(block_quota, MAX_BLOCK_QUOTA), num_warps_per_block: c(num_warps_per_block, 32) }
    }
    /// This tuning within the limits of [`LaunchTuning::from_args`].
    pub fn clamped(self) -> LaunchTuning {
        LaunchTuning::from_args(self.block_quota as i64, self.num_warps_per_block as i64)
    }
}
