//! What the copy loops share, over raw buffer addresses: the bindings' addresses, prefetching,
//! and the walk over a `direct` step's spans. A leaf: `copy` and `checksums` both use it, and
//! neither the other's loop.

use crate::exec::ChecksumBinding;
use crate::geometry::{Addr, BufRef};
use crate::plan::{CopyStep, Span};

/// A buffer address that threads of one transfer share (each writes its own items).
#[derive(Clone, Copy)]
pub(super) struct SendPtr(pub(super) *mut u8);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The address (a method, so closures capture the whole `Send` wrapper).
    pub(super) fn get(self) -> *mut u8 {
        self.0
    }
}

/// Buffer addresses of a plan's bindings, `[comp]` and `[comp][slot]`.
pub(super) struct RawBindings {
    pub(super) host: Vec<SendPtr>,
    pub(super) device: Vec<Vec<SendPtr>>,
    pub(super) integrity: Option<ChecksumBinding>,
}

impl RawBindings {
    pub(super) fn get(&self, r: BufRef) -> *mut u8 {
        match r {
            BufRef::Host { comp } => self.host[comp as usize].0,
            BufRef::Device { comp, slot } => self.device[comp as usize][slot as usize].0,
        }
    }
}

/// One address pair of a gather: both buffers' addresses and addressing.
pub(super) type Pair = (SendPtr, SendPtr, Addr, Addr);

/// How many items (or spans) ahead the copy loops prefetch.
pub(super) const PREFETCH_AHEAD: usize = 8;

#[inline(always)]
pub(super) fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint; it never faults, even on an invalid address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Prefetches both sides of index pair `j` of a gather (nothing past the lists or for a skipped
/// pair).
#[inline(always)]
pub(super) fn prefetch_item((sp, dp, sa, da): &Pair, si: &[i64], di: &[i64], j: usize) {
    if let (Some(&s), Some(&d)) = (si.get(j), di.get(j)) {
        if s >= 0 && d >= 0 {
            prefetch(sp.0.wrapping_add(sa.offset(s as u64, 0) as usize));
            prefetch(dp.0.wrapping_add(da.offset(d as u64, 0) as usize));
        }
    }
}

/// `body(span, source, destination)` for each span of piece `p` of a `direct` step (`spans`, as
/// [`CopyStep::pieces`] gives them), the span [`PREFETCH_AHEAD`] ahead prefetched first: runs of
/// one item each (random pages) are latency-bound. The addresses are the span's first bytes in
/// the pair's buffers (the planner made every span from range-checked items of their geometry).
#[inline(always)]
pub(super) fn each_span(c: &CopyStep, bufs: &RawBindings, p: usize, spans: &[Span], mut body: impl FnMut(&Span, *mut u8, *mut u8)) {
    let pair = &c.pairs()[p];
    let (sp, dp) = (bufs.get(pair.src.buf()), bufs.get(pair.dst.buf()));
    let at = |s: &Span| {
        let (su, du) = c.units(s);
        (sp.wrapping_add(pair.src.offset(su, 0) as usize), dp.wrapping_add(pair.dst.offset(du, 0) as usize))
    };
    for (k, s) in spans.iter().enumerate() {
        if let Some(a) = spans.get(k + PREFETCH_AHEAD) {
            let (src, dst) = at(a);
            prefetch(src);
            prefetch(dst);
        }
        let (src, dst) = at(s);
        body(s, src, dst);
    }
}
