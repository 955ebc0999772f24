//! What an accepted call touches, for ordering a pipeline's two streams.

use super::*;
use crate::geometry::PoolKind;

/// What an accepted call touches, for ordering a pipeline's two streams: layers (a host layer
/// and its device buffer share the number), and host and device pages (sorted, unique;
/// skipped entries dropped). Pages, not tokens: a `direct` copy moves whole pages, and two
/// calls on different tokens of one page are ordered too, which is never wrong.
#[derive(Debug, Clone, Default)]
pub(crate) struct Footprint {
    layers: Vec<u64>,
    host: Vec<i64>,
    device: Vec<i64>,
}

impl Footprint {
    /// The footprint of `plan`, accepted for `req`.
    pub(crate) fn of(plan: &Plan, req: &Request<'_>) -> Footprint {
        let host = plan.pair().host();
        // An accepted plan's lists convert (the planner did the same); a no-op touches nothing.
        let Ok((hi, di)) = index_units(host, req) else { return Footprint::default() };
        if plan.is_empty() {
            return Footprint::default();
        }
        let per_unit = if host.kind() == PoolKind::DsaIndexer { 1 } else { host.page_size().max(1) as i64 };
        let pages = |v: Vec<i64>| {
            let mut p: Vec<i64> = v.into_iter().filter(|&x| x >= 0).map(|x| x / per_unit).collect();
            p.sort_unstable();
            p.dedup();
            p
        };
        Footprint { layers: plan.layers(), host: pages(hi), device: pages(di) }
    }

    /// Whether the two calls touch the same bytes: a common layer and a common host or device
    /// page (a load reads host pages and writes device pages, a backup the other way round, so
    /// any common page of a common layer is a read/write pair).
    pub(crate) fn conflicts(&self, other: &Footprint) -> bool {
        intersects(&self.layers, &other.layers) && (intersects(&self.host, &other.host) || intersects(&self.device, &other.device))
    }
}

/// Whether two sorted lists share an element.
pub(super) fn intersects<T: Ord>(a: &[T], b: &[T]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => return true,
        }
    }
    false
}
