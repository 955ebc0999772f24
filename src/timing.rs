//! Timing for benchmarks and executor ceilings: medians of repeated runs within a budget.

use std::time::{Duration, Instant};

use crate::error::Result;

/// The median of `v` (non-empty).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Times `f` at least 3 times and until `budget` is spent (at most [`MAX_SAMPLES`] times): the
/// median in seconds, after one warm-up run.
pub fn time(budget: Duration, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    let start = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < 3 || (start.elapsed() < budget && samples.len() < MAX_SAMPLES) {
        let t = Instant::now();
        f()?;
        samples.push(t.elapsed().as_secs_f64());
    }
    Ok(median(samples))
}

/// Most runs [`time`] takes: enough that the median of a 50 µs call spans 100 ms (50 samples
/// spanned 2.5 ms, and one burst of another tenant's load moved a 128 B cell's median by 2x on
/// these shared machines), few enough that the budget, not the count, bounds slow calls.
pub const MAX_SAMPLES: usize = 2000;
