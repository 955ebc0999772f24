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
        let per_unit = if host.kind() == PoolKind::DsaIndexer { 1 } else { host.page_size() };
        Footprint { layers: plan.layers(), host: page_set(&hi, per_unit), device: page_set(&di, per_unit) }
    }

    /// Whether the two calls touch the same bytes: a common layer and a common host or device
    /// page (a load reads host pages and writes device pages, a backup the other way round, so
    /// any common page of a common layer is a read/write pair).
    pub(crate) fn conflicts(&self, other: &Footprint) -> bool {
        intersects(&self.layers, &other.layers) && (intersects(&self.host, &other.host) || intersects(&self.device, &other.device))
    }
}

/// The pages (`per_unit` entries a page) of a list's live entries, sorted and unique.
fn page_set(list: &[i64], per_unit: u64) -> Vec<i64> {
    let p = per_unit.max(1) as i64;
    let mut pages: Vec<i64> = list.iter().filter(|&&x| x >= 0).map(|&x| x / p).collect();
    pages.sort_unstable();
    pages.dedup();
    pages
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

/// The part of one pool a call touches, for admitting calls on pools shared by threads: the
/// layers and pages (`None`: all of them) it reads or writes. Two claims on one pool conflict
/// when either writes and they share a layer and a page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    layers: Option<Vec<u64>>,
    pages: Option<Vec<i64>>,
    pub(crate) write: bool,
}

impl Claim {
    /// Every byte of the pool.
    pub(crate) fn all(write: bool) -> Claim {
        Claim { layers: None, pages: None, write }
    }

    /// Every layer of the pages starting at host tokens `indices` (`page_size` tokens a page).
    pub(crate) fn pages(indices: &[i64], page_size: u64, write: bool) -> Claim {
        Claim { layers: None, pages: Some(page_set(indices, page_size)), write }
    }

    /// What `plan` (accepted for `req`) touches of the host pool (`.0`) and of the device pool
    /// (`.1`). A plan whose lists cannot be read here claims every page of its layers.
    pub(crate) fn of(plan: &Plan, req: &Request<'_>) -> (Claim, Claim) {
        let writes_host = plan.direction() == Direction::DeviceToHost;
        if plan.is_empty() {
            let none = |write| Claim { layers: Some(Vec::new()), pages: Some(Vec::new()), write };
            return (none(writes_host), none(!writes_host));
        }
        let f = Footprint::of(plan, req);
        if f.layers.is_empty() {
            // Lists the footprint cannot read: the whole of both pools.
            return (Claim::all(writes_host), Claim::all(!writes_host));
        }
        let known = !f.host.is_empty() || !f.device.is_empty();
        let claim = |pages: Vec<i64>, write| Claim { layers: Some(f.layers.clone()), pages: known.then_some(pages), write };
        (claim(f.host.clone(), writes_host), claim(f.device.clone(), !writes_host))
    }

    /// Whether the two claims on one pool touch the same bytes and either writes.
    pub(crate) fn conflicts(&self, other: &Claim) -> bool {
        fn meet<T: Ord>(a: &Option<Vec<T>>, b: &Option<Vec<T>>) -> bool {
            match (a, b) {
                (Some(a), Some(b)) => intersects(a, b),
                (Some(x), None) | (None, Some(x)) => !x.is_empty(),
                (None, None) => true,
            }
        }
        (self.write || other.write) && meet(&self.layers, &other.layers) && meet(&self.pages, &other.pages)
    }
}
