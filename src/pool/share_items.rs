//! The pool's item checks inside an L3 store's staging pass over page shares: where a share's
//! bytes are pieces of the pool's items (each piece a run of one item's words), the pass that
//! copies a share into (or out of) the staging buffer adds each piece's terms under the item's
//! keys as it adds them under the object's, so a put's item check and a get's item record read
//! no page a second time.
//!
//! A share holds bytes `b0..b1` of every item of its layers, in the order (layer, token, byte);
//! byte `b` of an item is word `b / 4` of the item's checksum when its head chunks are whole words
//! (chunk `h` keyed from word `h · words(chunk)`), so a piece's item keys start at `b0 / 4` of its
//! chunk. Pieces that follow each other in memory, of one length and one item-key start, whose
//! items step evenly, are one [`Run`] (a head group's 16 tokens of one layer: one run).

use crate::geometry::{HostGeometry, PageShare, SharePiece, ShareSpans};

/// `count` pieces of `chunk` bytes end to end, `rel` bytes into span `span` of a share (its
/// [`ShareSpans`]) and at word `obj_word` of the object; piece `c` is the bytes from word
/// `item_word` of the page's item `item + c · step` (items in the order of the pool's table:
/// component, layer, unit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Run {
    pub span: usize,
    pub rel: usize,
    pub chunk: usize,
    pub count: usize,
    pub obj_word: usize,
    pub item_word: usize,
    pub item: usize,
    pub step: usize,
}

/// Per share, its runs in its spans' order; and the items of a page.
pub(super) struct ItemRuns {
    pub runs: Vec<Vec<Run>>,
    pub items: usize,
}

/// Most pieces a call's shares are cut into for their runs; past it the items are read on
/// their own (a share walked in more pieces gains nothing from the one read).
const MAX_PIECES: u64 = 1 << 16;

impl ItemRuns {
    /// The runs of `shares` (whose spans are `spans`, in the same order) of a pool of geometry
    /// `g`; `None` where the shares do not cover every item of a page exactly once, a piece is not
    /// whole words, a page's units are not its tokens, or there are too many pieces.
    pub(super) fn new(g: &HostGeometry, shares: &[PageShare], spans: &[ShareSpans]) -> Option<ItemRuns> {
        let (p, layers, comps) = (g.page_size(), g.layer_num(), g.kind().components() as u64);
        let (item_bytes, chunk) = (g.item_bytes(), g.chunk_bytes());
        if chunk == 0
            || !chunk.is_multiple_of(4)
            || !item_bytes.is_multiple_of(4)
            || g.index_page_size() != p
            || spans.len() != shares.len()
        {
            return None;
        }
        if !covers_every_item_once(shares, layers, comps, item_bytes) {
            return None;
        }
        let pieces = shares.iter().try_fold(0u64, |n, &s| n.checked_add(g.share_piece_count(s).0))?;
        if pieces > MAX_PIECES {
            return None;
        }
        let items = usize::try_from(comps.checked_mul(layers)?.checked_mul(p)?).ok()?;
        let mut runs = Vec::with_capacity(shares.len());
        for (share, (template, _)) in shares.iter().zip(spans) {
            let share_runs = share_runs(g, *share, template)?;
            // Every run inside its span, its object, its item and the page's items: the passes
            // that follow then find nothing to refuse once they have begun writing.
            let object = template.iter().try_fold(0u64, |n, s| n.checked_add(s.2))?;
            let fits = |r: &Run| -> Option<bool> {
                let bytes = r.chunk.checked_mul(r.count)? as u64;
                let last = r.step.checked_mul(r.count - 1)?.checked_add(r.item)?;
                Some(
                    (r.rel as u64).checked_add(bytes)? <= template.get(r.span)?.2
                        && (r.obj_word as u64 * 4).checked_add(bytes)? <= object
                        && (r.item_word as u64 * 4).checked_add(r.chunk as u64)? <= item_bytes
                        && last < items,
                )
            };
            if !share_runs.iter().all(|r| fits(r) == Some(true)) {
                return None;
            }
            runs.push(share_runs);
        }
        Some(ItemRuns { runs, items })
    }
}

/// Whether the shares' `(layers, bytes)` tile every item of every component and layer once,
/// on word boundaries.
fn covers_every_item_once(shares: &[PageShare], layers: u64, comps: u64, item_bytes: u64) -> bool {
    let mut cuts: Vec<Vec<(u64, u64)>> = vec![Vec::new(); (comps * layers) as usize];
    for s in shares {
        if !s.bytes.0.is_multiple_of(4) || !s.bytes.1.is_multiple_of(4) || s.comp as u64 >= comps || s.layers.1 > layers {
            return false;
        }
        for layer in s.layers.0..s.layers.1 {
            cuts[(s.comp as u64 * layers + layer) as usize].push(s.bytes);
        }
    }
    cuts.iter_mut().all(|c| {
        c.sort_unstable();
        let mut end = 0;
        for &(b0, b1) in c.iter() {
            if b0 != end {
                return false;
            }
            end = b1;
        }
        end == item_bytes
    })
}

/// One share's runs: its pieces in its own order (layer, token, byte), each found in the span
/// that holds it (the spans are the pieces merged where adjacent), merged where they continue a
/// run.
fn share_runs(g: &HostGeometry, share: PageShare, template: &[(usize, u64, u64)]) -> Option<Vec<Run>> {
    let (p, layers) = (g.page_size(), g.layer_num());
    let mut runs: Vec<Run> = Vec::new();
    let (mut span, mut x) = (0usize, 0u64);
    for SharePiece { layer, token, byte, len, off } in g.share_pieces(share) {
        // The spans hold the pieces in this order: the piece is in this span or a later one.
        while !template.get(span).is_some_and(|&(_, at, n)| off >= at && off + len <= at + n) {
            span += 1;
            if span >= template.len() {
                return None;
            }
        }
        let piece = Run {
            span,
            rel: usize::try_from(off - template[span].1).ok()?,
            chunk: usize::try_from(len).ok()?,
            count: 1,
            obj_word: usize::try_from(x / 4).ok()?,
            item_word: usize::try_from(byte / 4).ok()?,
            item: usize::try_from((share.comp as u64 * layers + layer) * p + token).ok()?,
            step: 0,
        };
        match runs.last_mut() {
            Some(r) if continues(r, &piece) => {
                if r.count == 1 {
                    r.step = piece.item - r.item;
                }
                r.count += 1;
            }
            _ => runs.push(piece),
        }
        x += len;
    }
    Some(runs)
}

/// Whether `piece` continues run `r`: the next bytes of its span and object, of the same length
/// and item-key start, its item the next one at the run's step (any growing step after one piece).
fn continues(r: &Run, piece: &Run) -> bool {
    let last = r.step.checked_mul(r.count - 1).and_then(|d| d.checked_add(r.item));
    r.span == piece.span
        && r.rel + r.chunk * r.count == piece.rel
        && r.chunk == piece.chunk
        && r.item_word == piece.item_word
        && r.obj_word + r.chunk * r.count / 4 == piece.obj_word
        && if r.count == 1 { piece.item > r.item } else { last.and_then(|l| l.checked_add(r.step)) == Some(piece.item) }
}
