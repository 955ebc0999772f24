//! Timing for benchmarks and executor ceilings: medians of repeated runs within a budget.

use std::time::{Duration, Instant};

use crate::error::Result;

/// The median of `v` (non-empty).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Times `f` at least 3 times and until `budget` is spent (at most 50 times): the median in
/// seconds, after one warm-up run.
pub fn time(budget: Duration, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    let start = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < 3 || (start.elapsed() < budget && samples.len() < 50) {
        let t = Instant::now();
        f()?;
        samples.push(t.elapsed().as_secs_f64());
    }
    Ok(median(samples))
}
