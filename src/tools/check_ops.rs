//! `check` and `fuzz` for the op families beyond the pool calls (sglang 0.5.23's JIT-only
//! copies): DeepSeek-V4's token copy between page-padded C4 buffers, the Mamba state load and
//! backup, and MiniMax M3's NVFP4 page rows. Each round draws a geometry and index lists, runs
//! the op on caller memory, and compares every byte with a byte loop written from the op's
//! definition; a hostile variant of the same call (an index out of range, a duplicate
//! destination, a misaligned size, mismatched layer lists, a buffer too small) must be refused
//! with every byte as it was.

use crate::error::Result;
use crate::exec::Device;
use crate::kvcacheio::{self as kv, Memory, RawTensor, DSV4_PAGE_BYTES, DSV4_PAGE_TOKENS, DSV4_SCALE_BYTES, DSV4_VALUE_BYTES};
use crate::tools::check::{Rng, Tally};

/// The ops drawn, in report order.
pub const OPS: [&str; 4] = ["transfer_cache_dsv4_mla", "transfer_kv_mamba_pf_lf", "transfer_kv_mamba_lf_pf", "transfer_page_rows"];

/// Caller memory: source and destination buffers (one per layer where the op takes lists).
struct Bufs {
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
}

impl Bufs {
    fn new(rng: &mut Rng, src: &[usize], dst: &[usize]) -> Bufs {
        let fill = |rng: &mut Rng, n: usize| {
            let mut v = vec![0u8; n];
            rng.fill(&mut v);
            v
        };
        Bufs { src: src.iter().map(|&n| fill(rng, n)).collect(), dst: dst.iter().map(|&n| fill(rng, n)).collect() }
    }
    fn tensors(v: &mut [Vec<u8>]) -> Vec<RawTensor> {
        // SAFETY: every buffer outlives the op that takes these descriptions, and nothing else
        // touches it meanwhile (the op returns after its copies on the executors that take
        // host memory).
        v.iter_mut().map(|b| unsafe { RawTensor::new(b.as_mut_ptr() as u64, b.len() as u64, vec![b.len() as u64], Memory::Host) }).collect()
    }
}

/// `n` distinct values below `limit` (`n <= limit`), in random order.
fn distinct(rng: &mut Rng, n: usize, limit: usize) -> Vec<i64> {
    let mut all: Vec<i64> = (0..limit as i64).collect();
    for i in 0..n.min(limit) {
        let j = i + rng.below((limit - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(n);
    all
}

fn any(rng: &mut Rng, n: usize, limit: usize) -> Vec<i64> {
    (0..n).map(|_| rng.below(limit as u64) as i64).collect()
}

/// `(sources, destinations)`: up to `n` pairs, destinations distinct below `dst_limit`, sources
/// any below `src_limit`; spoiled by `index out of range` (a source at its limit) or `duplicate
/// destination` (the first destination again).
fn pairs(rng: &mut Rng, n: usize, src_limit: usize, dst_limit: usize, spoil: Option<Spoil>) -> (Vec<i64>, Vec<i64>) {
    let mut d = distinct(rng, n.min(dst_limit), dst_limit);
    let mut s = any(rng, d.len(), src_limit);
    match spoil {
        Some("index out of range") => s[0] = src_limit as i64,
        Some("duplicate destination") if d.len() > 1 => d[1] = d[0],
        Some("duplicate destination") => {
            d.push(d[0]);
            s.push(0);
        }
        _ => {}
    }
    (s, d)
}

/// Runs a drawn op on the buffers.
type RunOp = Box<dyn Fn(&Device, &mut Bufs) -> Result<()>>;

/// One drawn call: runs the op on `bufs`, and applies the op's definition to `expect`.
struct Drawn {
    bufs: Bufs,
    run: RunOp,
    oracle: Box<dyn Fn(&mut Bufs)>,
    bytes: u64,
}

/// A hostile variant's change: what it breaks, as a short name for the report.
type Spoil = &'static str;

/// Draws one call of `op` (hostile when `spoil` is given).
fn draw(op: &str, rng: &mut Rng, spoil: Option<Spoil>) -> Drawn {
    match op {
        "transfer_cache_dsv4_mla" => draw_dsv4_mla(rng, spoil),
        "transfer_kv_mamba_pf_lf" | "transfer_kv_mamba_lf_pf" => draw_mamba(op == "transfer_kv_mamba_pf_lf", rng, spoil),
        "transfer_page_rows" => draw_page_rows(rng, spoil),
        other => unreachable!("no generator for {other}"),
    }
}

/// `transfer_cache_dsv4_mla`: tokens copied between page-padded C4 buffers, value and scale parts.
fn draw_dsv4_mla(rng: &mut Rng, spoil: Option<Spoil>) -> Drawn {
    let layers = 1 + rng.below(2) as usize;
    let (sp, dp) = (1 + rng.below(2) as usize, 1 + rng.below(2) as usize);
    let tokens = DSV4_PAGE_TOKENS as usize;
    let n = 1 + rng.below(40) as usize;
    let (si, di) = pairs(rng, n, sp * tokens, dp * tokens, spoil);
    let page = DSV4_PAGE_BYTES as usize;
    let mut dst_layers = layers;
    let mut dst_bytes = dp * page;
    match spoil {
        Some("layer lists differ") => dst_layers = layers + 1,
        Some("buffer too small") => dst_bytes = page - 1,
        _ => {}
    }
    let bufs = Bufs::new(rng, &vec![sp * page; layers], &vec![dst_bytes; dst_layers]);
    let (s2, d2) = (si.clone(), di.clone());
    let bytes = (si.len() * layers) as u64 * (DSV4_VALUE_BYTES + DSV4_SCALE_BYTES);
    Drawn {
        bufs,
        run: Box::new(move |dev, b| {
            let (src, dst) = (Bufs::tensors(&mut b.src), Bufs::tensors(&mut b.dst));
            kv::transfer_cache_dsv4_mla(dev, &src, &dst, &s2, &d2)
        }),
        oracle: Box::new(move |b| {
            let (v, s, t) = (DSV4_VALUE_BYTES as usize, DSV4_SCALE_BYTES as usize, DSV4_PAGE_TOKENS as usize);
            for l in 0..b.src.len() {
                for (&x, &y) in si.iter().zip(&di) {
                    let (x, y) = (x as usize, y as usize);
                    let at = |tok: usize, scale: bool| (tok / t) * page + if scale { t * v + (tok % t) * s } else { (tok % t) * v };
                    let (fv, tv) = (at(x, false), at(y, false));
                    b.dst[l][tv..tv + v].copy_from_slice(&b.src[l][fv..fv + v]);
                    let (fs, ts) = (at(x, true), at(y, true));
                    b.dst[l][ts..ts + s].copy_from_slice(&b.src[l][fs..fs + s]);
                }
            }
        }),
        bytes,
    }
}

/// The Mamba state copies: `load` (`transfer_kv_mamba_pf_lf`) takes one layer of page-first host
/// slots to a device layer; otherwise (`transfer_kv_mamba_lf_pf`) every layer goes back.
fn draw_mamba(load: bool, rng: &mut Rng, spoil: Option<Spoil>) -> Drawn {
    let layers = 1 + rng.below(3) as usize;
    let mut item = 16 * (1 + rng.below(6) as usize);
    let (host_slots, dev_slots) = (4 + rng.below(24) as usize, 4 + rng.below(24) as usize);
    let layer = rng.below(layers as u64) as usize;
    let (src_slots, dst_slots) = if load { (host_slots, dev_slots) } else { (dev_slots, host_slots) };
    let n = 1 + rng.below(dst_slots as u64) as usize;
    let (si, di) = pairs(rng, n, src_slots, dst_slots, spoil);
    let ld = layers * item;
    let mut listed = layers;
    match spoil {
        Some("misaligned size") => item += 8,
        Some("layer lists differ") if !load => listed = layers + 1,
        _ => {}
    }
    let good_item = ld / layers;
    let bufs = if load {
        Bufs::new(rng, &[host_slots * ld], &[dev_slots * good_item])
    } else {
        Bufs::new(rng, &vec![dev_slots * good_item; layers], &[host_slots * ld])
    };
    let (s2, d2) = (si.clone(), di.clone());
    let bytes = (if load { si.len() } else { si.len() * layers }) as u64 * good_item as u64;
    let it = item as i64;
    Drawn {
        bufs,
        run: Box::new(move |dev, b| {
            let (src, dst) = (Bufs::tensors(&mut b.src), Bufs::tensors(&mut b.dst));
            if load {
                kv::transfer_kv_mamba_pf_lf(dev, &src[0], &dst[0], &s2, &d2, layer as i64, it, ld as i64)
            } else {
                kv::transfer_kv_mamba_lf_pf(dev, &src, &dst[0], &s2, &d2, it, ld as i64, listed as i64)
            }
        }),
        oracle: Box::new(move |b| {
            let i = good_item;
            for (&x, &y) in si.iter().zip(&di) {
                let (x, y) = (x as usize, y as usize);
                if load {
                    let from = x * ld + layer * i;
                    let row = b.src[0][from..from + i].to_vec();
                    b.dst[0][y * i..(y + 1) * i].copy_from_slice(&row);
                } else {
                    for l in 0..b.src.len() {
                        let row = b.src[l][x * i..(x + 1) * i].to_vec();
                        b.dst[0][y * ld + l * i..y * ld + (l + 1) * i].copy_from_slice(&row);
                    }
                }
            }
        }),
        bytes,
    }
}

/// `transfer_page_rows`: NVFP4 page rows between host and device layers, in either direction.
fn draw_page_rows(rng: &mut Rng, spoil: Option<Spoil>) -> Drawn {
    let layers = 1 + rng.below(3) as usize;
    let load = rng.below(2) == 1;
    let mut row = 128 * (1 + rng.below(3) as usize);
    let (hs, ds) = (row + 128 * rng.below(2) as usize, row + 128 * rng.below(2) as usize);
    let (hp, dp) = (2 + rng.below(10) as usize, 2 + rng.below(10) as usize);
    let (dst_pages, src_pages) = if load { (dp, hp) } else { (hp, dp) };
    let n = 1 + rng.below(dst_pages as u64) as usize;
    let (s, d) = pairs(rng, n, src_pages, dst_pages, spoil);
    let mut dev_layers = layers;
    match spoil {
        Some("misaligned size") => row += 64,
        Some("layer lists differ") => dev_layers = layers + 1,
        _ => {}
    }
    let good_row = if spoil == Some("misaligned size") { row - 64 } else { row };
    let bufs = Bufs::new(rng, &vec![hp * hs; layers], &vec![dp * ds; dev_layers]);
    let (host_pages, dev_pages) = if load { (s.clone(), d.clone()) } else { (d.clone(), s.clone()) };
    let (h2, d2) = (host_pages.clone(), dev_pages.clone());
    let bytes = (s.len() * layers * good_row) as u64;
    Drawn {
        bufs,
        run: Box::new(move |dev, b| {
            let (host, device) = (Bufs::tensors(&mut b.src), Bufs::tensors(&mut b.dst));
            kv::transfer_page_rows(dev, &host, &device, &h2, &d2, hs as i64, ds as i64, row as i64, load as i64)
        }),
        oracle: Box::new(move |b| {
            for l in 0..b.src.len() {
                for (&h, &d) in host_pages.iter().zip(&dev_pages) {
                    let (h, d) = (h as usize * hs, d as usize * ds);
                    if load {
                        let r = b.src[l][h..h + good_row].to_vec();
                        b.dst[l][d..d + good_row].copy_from_slice(&r);
                    } else {
                        let r = b.dst[l][d..d + good_row].to_vec();
                        b.src[l][h..h + good_row].copy_from_slice(&r);
                    }
                }
            }
        }),
        bytes,
    }
}

/// The hostile variants each op is drawn with.
fn spoils(op: &str) -> &'static [Spoil] {
    match op {
        "transfer_cache_dsv4_mla" => &["index out of range", "duplicate destination", "layer lists differ", "buffer too small"],
        "transfer_kv_mamba_pf_lf" => &["index out of range", "duplicate destination", "misaligned size"],
        "transfer_kv_mamba_lf_pf" => &["index out of range", "duplicate destination", "misaligned size", "layer lists differ"],
        _ => &["index out of range", "duplicate destination", "misaligned size", "layer lists differ"],
    }
}

/// Runs `rounds` drawn calls and `rounds` hostile ones per op on `device`; every op `None` on an
/// executor that does not take pageable caller memory (wgpu moves between its own pools only;
/// cuda takes pinned or device memory, covered by its own suites).
pub fn check_ops(
    device: &Device,
    seed: u64,
    rounds: u64,
    mut progress: impl FnMut(&str, &Tally),
) -> Result<Vec<(&'static str, Option<Tally>)>> {
    if !matches!(device, Device::Cpu(_)) {
        return Ok(OPS.iter().map(|&op| (op, None)).collect());
    }
    let mut rng = Rng::new(seed ^ 0x6f70_7321);
    let mut out = Vec::new();
    for op in OPS {
        let mut t = Tally::default();
        for round in 0..rounds {
            for hostile in [false, true] {
                let spoil = hostile.then(|| spoils(op)[rng.below(spoils(op).len() as u64) as usize]);
                let mut d = draw(op, &mut rng, spoil);
                let mut want = Bufs { src: d.bufs.src.clone(), dst: d.bufs.dst.clone() };
                t.cases += 1;
                let res = (d.run)(device, &mut d.bufs);
                match (res, spoil) {
                    (Ok(()), None) => {
                        (d.oracle)(&mut want);
                        if want.src == d.bufs.src && want.dst == d.bufs.dst {
                            t.matched += 1;
                            t.bytes += d.bytes;
                        } else {
                            t.mismatched += 1;
                            t.first_failure.get_or_insert_with(|| format!("{op}: round {round} differs from its definition"));
                        }
                    }
                    (Err(e), None) => {
                        t.rejected += 1;
                        t.first_failure.get_or_insert_with(|| format!("{op}: round {round} refused: {e}"));
                    }
                    (Err(_), Some(_)) if want.src == d.bufs.src && want.dst == d.bufs.dst => t.matched += 1,
                    (res, Some(what)) => {
                        t.mismatched += 1;
                        let how = if res.is_ok() { "accepted" } else { "refused after moving bytes" };
                        t.first_failure.get_or_insert_with(|| format!("{op}: a call with {what} was {how} (round {round})"));
                    }
                }
                progress(op, &t);
            }
        }
        out.push((op, Some(t)));
    }
    Ok(out)
}
