// hicache-io gather/scatter: the `kernel` io backend on wgpu.
//
// One shader for every address mode the planner emits. A side's byte offset of item `idx`,
// head chunk `h` is
//     base + (idx / page) * page_stride + (idx % page) * row_stride + h * head_stride
// (layer_first, page_first, page_first_direct, page_head and per-head layer_first are all this
// formula with different strides). Offsets are in bytes, relative to the buffer start; each
// side binds a window [win_start, win_start + win_len) of its buffer (pools larger than the
// storage binding limit are walked window by window) and only items inside both windows are
// copied by this dispatch.
//
// Shape: `2^lanes_log2` invocations per item (a power of two up to 64, about one per word of
// the item chunk): small items pack many per workgroup (a workgroup per 128-byte item wastes
// lanes), large items get a whole workgroup; each invocation strides over the chunk's words
// (`WORD`: vec4<u32> when every offset allows 16 bytes, u32 otherwise). Address arithmetic is
// done once per (item, head), not per word. Index pairs with a negative entry are skipped.

struct Side {
    base: u32,
    page: u32,
    page_stride: u32,
    row_stride: u32,
    head_stride: u32,
    win_start: u32,
    win_len: u32,
    _pad: u32,
}

struct Params {
    src: Side,
    dst: Side,
    n_items: u32,
    heads: u32,
    words_per_chunk: u32,
    word_shift: u32,
    lanes_log2: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> indices: array<vec2<i32>>;
@group(0) @binding(2) var<storage, read> src: array<WORD>;
@group(0) @binding(3) var<storage, read_write> dst: array<WORD>;

fn offset_of(s: Side, idx: u32, head: u32) -> u32 {
    if (s.page == 1u) {
        return s.base + idx * s.page_stride + head * s.head_stride;
    }
    return s.base + (idx / s.page) * s.page_stride + (idx % s.page) * s.row_stride + head * s.head_stride;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = (wid.x + wid.y * nwg.x) * 64u + lid;
    let item = t >> params.lanes_log2;
    if (item >= params.n_items) {
        return;
    }
    let lanes = 1u << params.lanes_log2;
    let lane = t & (lanes - 1u);
    let pair = indices[item];
    if (pair.x < 0 || pair.y < 0) {
        return;
    }
    for (var head = 0u; head < params.heads; head++) {
        let so = offset_of(params.src, u32(pair.x), head);
        let d_o = offset_of(params.dst, u32(pair.y), head);
        // Items never straddle a window edge (windows are multiples of the chunk), so testing
        // the chunk start is enough.
        if (so < params.src.win_start || so - params.src.win_start >= params.src.win_len) {
            continue;
        }
        if (d_o < params.dst.win_start || d_o - params.dst.win_start >= params.dst.win_len) {
            continue;
        }
        let sw = (so - params.src.win_start) >> params.word_shift;
        let dw = (d_o - params.dst.win_start) >> params.word_shift;
        for (var w = lane; w < params.words_per_chunk; w += lanes) {
            dst[dw + w] = src[sw + w];
        }
    }
}
