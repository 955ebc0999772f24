// hicache-io gather/scatter: the `kernel` io backend on wgpu.
//
// One shader for every address mode the planner emits. A side's byte offset of item `idx`,
// head chunk `h` is
//     base + (idx / page) * page_stride + (idx % page) * row_stride + h * head_stride
// (layer_first, page_first, page_first_direct, page_head and per-head layer_first are all this
// formula with different strides). Each side binds a window of one buffer segment (pools larger
// than one buffer are split into segments, and segments larger than the storage binding limit
// are walked window by window); only item chunks inside both windows are copied by a dispatch.
// Offsets can exceed 32 bits across a segmented pool, so the shader never forms them: the host
// gives each side the range [unit_lo, unit_hi) of units (`idx / page`) whose bytes can touch
// the window and `rel0`, the window-relative offset of unit `unit_lo` (possibly negative,
// wrapped); a chunk's window-relative offset is then small, and it is in the window when it is
// below `win_len` (a negative one wraps above it).
//
// Shape: `2^lanes_log2` invocations per item (a power of two up to 64, about one per word of
// the item chunk): small items pack many per workgroup (a workgroup per 128-byte item wastes
// lanes), large items get a whole workgroup; each invocation strides over the chunk's words
// (`WORD`: vec4<u32> when every offset allows 16 bytes, u32 otherwise). Address arithmetic is
// done once per (item, head), not per word. Index pairs with a negative entry are skipped.
//
// Item checksums (the pipelines built with the lines between `//<sum` and `//sum>`): each
// invocation also sums key(j) * word[j] mod 2^64 over the 32-bit words j it copies (j counted
// from the item's first head chunk; key(j) = mix32(key_base ^ j) | 1, computed in registers, so
// the checksum reads no memory besides the words it copies), and adds its sum into the item's two-word (lo, hi) entry
// of `sums` with two atomic adds (the carry of the low word's add goes into the high word, so
// the entry ends up as the exact sum whatever the order). Core WGSL has no 64-bit integers: a
// product of a key below 2^32 and a word is formed from 16-bit halves (sections `i16`), and an
// invocation keeps three exact partial sums (low-half products with their carries, cross
// products with their carries, high-half products mod 2^32) that it combines once at the end.
// Where the device has 64-bit integers (wgpu's SHADER_INT64: Vulkan's shaderInt64, lavapipe's
// among them) the sections `i64` replace them: one 64-bit multiply-add per word into a `WIDE`
// (u64, lane-wise) sum. Both give the same bits.

struct Side {
    rel0: u32,
    page: u32,
    page_stride: u32,
    row_stride: u32,
    head_stride: u32,
    unit_lo: u32,
    unit_hi: u32,
    win_len: u32,
}

struct Params {
    src: Side,
    dst: Side,
    n_items: u32,
    heads: u32,
    words_per_chunk: u32,
    word_shift: u32,
    lanes_log2: u32,
    key_base: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> indices: array<vec2<i32>>;
@group(0) @binding(2) var<storage, read> src: array<WORD>;
@group(0) @binding(3) var<storage, read_write> dst: array<WORD>;
//<sum
// Two u32 per index pair.
@group(0) @binding(5) var<storage, read_write> sums: array<atomic<u32>>;

// The checksum key of the item's 32-bit word `j` (odd, below 2^32): the crate's key stream for
// words below 2^32 (the planner bounds items by it).
fn key32(j: u32) -> u32 {
    var x = params.key_base ^ j;
    x ^= x >> 16u;
    x *= 0x7feb352du;
    x ^= x >> 15u;
    x *= 0x846ca68bu;
    x ^= x >> 16u;
    return x | 1u;
}

// The keys of copy word `w` (in WORD units from the item's start).
//<w4
fn key_of(w: u32) -> WORD {
    return key32(w);
}
//w4>
//<w16
fn key_of(w: u32) -> WORD {
    let j = w * 4u;
    return vec4<u32>(key32(j), key32(j + 1u), key32(j + 2u), key32(j + 3u));
}
//w16>

//<i16
// Partial sums of one invocation: exact, each word of them lane-wise (`WORD` may be a vector).
struct Acc {
    lo: WORD,     // sum of klo*vlo, low word
    lo_c: WORD,   // ... its carries (the high word)
    mid: WORD,    // sum of khi*vlo + klo*vhi, low word
    mid_c: WORD,  // ... its carries
    hi: WORD,     // sum of khi*vhi mod 2^32
}

fn acc_add(a: Acc, k: WORD, v: WORD) -> Acc {
    let m = WORD(0xffffu);
    let kl = k & m;
    let kh = k >> WORD(16u);
    let vl = v & m;
    let vh = v >> WORD(16u);
    var r = a;
    let p0 = kl * vl;
    r.lo = r.lo + p0;
    r.lo_c = r.lo_c + select(WORD(0u), WORD(1u), r.lo < p0);
    let p1 = kh * vl;
    r.mid = r.mid + p1;
    r.mid_c = r.mid_c + select(WORD(0u), WORD(1u), r.mid < p1);
    let p2 = kl * vh;
    r.mid = r.mid + p2;
    r.mid_c = r.mid_c + select(WORD(0u), WORD(1u), r.mid < p2);
    r.hi = r.hi + kh * vh;
    return r;
}

// (lo, hi) of lo_c:lo + (mid_c:mid << 16) + (hi << 32), lane-wise.
fn acc_total(a: Acc) -> array<WORD, 2> {
    let ml = a.mid << WORD(16u);
    let mh = (a.mid_c << WORD(16u)) | (a.mid >> WORD(16u));
    let lo = a.lo + ml;
    let hi = a.lo_c + mh + a.hi + select(WORD(0u), WORD(1u), lo < ml);
    return array<WORD, 2>(lo, hi);
}

// The 64-bit sum (lo, hi) of a total's lanes, unrolled (no loop trips beyond the copy's, which
// the planner bounds).
//<w4
fn lanes_total(t: array<WORD, 2>) -> vec2<u32> {
    return vec2<u32>(t[0], t[1]);
}
//w4>
//<w16
fn add64(a: vec2<u32>, lo: u32, hi: u32) -> vec2<u32> {
    let l = a.x + lo;
    return vec2<u32>(l, a.y + hi + select(0u, 1u, l < lo));
}

fn lanes_total(t: array<WORD, 2>) -> vec2<u32> {
    let a = add64(vec2<u32>(t[0].x, t[1].x), t[0].y, t[1].y);
    let b = add64(a, t[0].z, t[1].z);
    return add64(b, t[0].w, t[1].w);
}
//w16>
//i16>
//<i64
// Sum of key * word mod 2^64, lane-wise: keys and words are below 2^32, so each product is exact.
fn acc_add(a: WIDE, k: WORD, v: WORD) -> WIDE {
    return a + WIDE(k) * WIDE(v);
}

// The 64-bit sum (lo, hi) of the lanes.
fn wide_total(a: WIDE) -> vec2<u32> {
//<w4
    let t = a;
//w4>
//<w16
    let t = a.x + a.y + a.z + a.w;
//w16>
    return vec2<u32>(u32(t), u32(t >> 32u));
}
//i64>

// Adds the 64-bit (lo, hi) into entry `e`.
fn add_sum(e: u32, lo: u32, hi: u32) {
    if (lo == 0u && hi == 0u) {
        return;
    }
    let old = atomicAdd(&sums[2u * e], lo);
    atomicAdd(&sums[2u * e + 1u], hi + select(0u, 1u, old + lo < lo));
}
//sum>

// Window-relative offset of item `idx`'s first chunk (wrapping), or 0xffffffff when its unit
// cannot touch the window.
fn rel_of(s: Side, idx: u32) -> u32 {
    var unit = idx;
    var within = 0u;
    if (s.page != 1u) {
        unit = idx / s.page;
        within = (idx % s.page) * s.row_stride;
    }
    if (unit < s.unit_lo || unit >= s.unit_hi) {
        return 0xffffffffu;
    }
    return s.rel0 + (unit - s.unit_lo) * s.page_stride + within;
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
    let s0 = rel_of(params.src, u32(pair.x));
    let d0 = rel_of(params.dst, u32(pair.y));
    if (s0 == 0xffffffffu || d0 == 0xffffffffu) {
        return;
    }
    //<sum
    //<i16
    var acc = Acc(WORD(0u), WORD(0u), WORD(0u), WORD(0u), WORD(0u));
    //i16>
    //<i64
    var acc = WIDE();
    //i64>
    //sum>
    for (var head = 0u; head < params.heads; head++) {
        let so = s0 + head * params.src.head_stride;
        let d_o = d0 + head * params.dst.head_stride;
        // Windows are whole chunks: a chunk starting inside one lies inside it.
        if (so >= params.src.win_len || d_o >= params.dst.win_len) {
            continue;
        }
        let sw = so >> params.word_shift;
        let dw = d_o >> params.word_shift;
        //<plain
        for (var w = lane; w < params.words_per_chunk; w += lanes) {
            dst[dw + w] = src[sw + w];
        }
        //plain>
        //<sum
        let kw = head * params.words_per_chunk;
        for (var w = lane; w < params.words_per_chunk; w += lanes) {
            let v = src[sw + w];
            dst[dw + w] = v;
            acc = acc_add(acc, key_of(kw + w), v);
        }
        //sum>
    }
    //<sum
    //<i16
    let total = lanes_total(acc_total(acc));
    //i16>
    //<i64
    let total = wide_total(acc);
    //i64>
    add_sum(item, total.x, total.y);
    //sum>
}
