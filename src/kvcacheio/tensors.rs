//! Caller memory as an op checks it: named arguments and the overlap checks between them (the
//! memory's own types are [`crate::exec::caller`]'s).

use crate::exec::caller::RawTensor;
use crate::exec::{Buffer, Device};
use crate::{Result, TransferError};

/// A named argument.
#[derive(Clone)]
pub(super) struct Arg<'a> {
    pub(super) name: String,
    pub(super) t: &'a RawTensor,
}

pub(super) fn arg(name: impl Into<String>, t: &RawTensor) -> Arg<'_> {
    Arg { name: name.into(), t }
}

pub(super) fn bad(arg: &str, reason: impl Into<String>) -> TransferError {
    TransferError::BadTensor { arg: arg.into(), reason: reason.into() }
}

/// Wraps one tensor argument as a buffer of `device`, without owning it.
pub(super) fn wrap(device: &Device, a: &Arg<'_>) -> Result<Buffer> {
    device.wrap_raw(a.t, &a.name)
}

/// Refuses a destination that overlaps any other argument (the result would depend on the
/// order of the copies, and differ between executors).
pub(super) fn check_overlaps(reads: &[Arg<'_>], writes: &[Arg<'_>]) -> Result<()> {
    overlaps(reads, writes, false)
}

/// [`check_overlaps`] for the `kernel` ops, where `reads[i]` pairs with `writes[i]` (K and V,
/// layer by layer): two destinations that are exactly the same tensor (span and shape), read
/// from sources that are exactly the same tensor too, receive the same bytes twice, and are
/// accepted (sglang's own tests pass `dst_k` as `dst_v` that way). Safe because a gather writes
/// every pair of one index from the same lane or thread, in order; `direct` copies split runs
/// across threads, so the `direct` ops keep the strict check.
pub(super) fn check_overlaps_kernel(reads: &[Arg<'_>], writes: &[Arg<'_>]) -> Result<()> {
    overlaps(reads, writes, true)
}

pub(super) fn overlaps(reads: &[Arg<'_>], writes: &[Arg<'_>], same_bytes_twice_ok: bool) -> Result<()> {
    let span = |t: &RawTensor| (t.memory, t.addr, t.addr.saturating_add(t.len));
    let same = |a: &RawTensor, b: &RawTensor| span(a) == span(b) && a.dims() == b.dims();
    let paired = same_bytes_twice_ok && reads.len() == writes.len();
    let same_bytes_twice = |i: usize, j: usize| paired && same(writes[i].t, writes[j].t) && same(reads[i].t, reads[j].t);
    for (i, w) in writes.iter().enumerate() {
        let (wm, ws, we) = span(w.t);
        let others = reads.iter().chain(writes.iter().enumerate().filter(|&(j, _)| j != i && !same_bytes_twice(i, j)).map(|(_, a)| a));
        for o in others {
            let (om, os, oe) = span(o.t);
            if wm == om && ws < oe && os < we && w.t.len > 0 && o.t.len > 0 {
                return Err(bad(&w.name, format!("destination overlaps {}", o.name)));
            }
        }
    }
    Ok(())
}
