//! The kvcacheio ops of today's sglang, from Rust, against byte loops written from their
//! definitions: the head-group-major (`pfdhg`) load and backup, whole-row embedding ranges, and
//! the CPU row moves inside a KV pool; rejected calls leave every byte as it was.

#![allow(clippy::type_complexity)] // tables of hostile calls

mod common;

use common::{host_tensor as tensor, random_bytes as random};
use hicache_io::kvcacheio::{self as kv, RawTensor};
use hicache_io::{Device, TransferError};

/// One head-group-major geometry: `heads` kv heads of `dim` elements of `es` bytes, `groups`
/// head groups, `layers` layers, pages of `page` tokens, `pages` pages.
#[derive(Clone, Copy)]
struct Hg {
    heads: usize,
    groups: usize,
    layers: usize,
    page: usize,
    dim: usize,
    es: usize,
    pages: usize,
}

impl Hg {
    fn item(&self) -> usize {
        self.heads * self.dim * self.es
    }
    fn rows(&self) -> usize {
        self.pages * self.page
    }
    fn host_bytes(&self) -> usize {
        self.rows() * self.layers * self.item()
    }
    /// Host byte of (token slot, layer, head, byte within the head's row): the element formula
    /// `((((p·HG + g)·L + l)·P + t)·hg + j)·D + e`, in bytes.
    fn host_byte(&self, slot: usize, layer: usize, head: usize, b: usize) -> usize {
        let hg = self.heads / self.groups;
        let (p, t, g, j) = (slot / self.page, slot % self.page, head / hg, head % hg);
        ((((p * self.groups + g) * self.layers + layer) * self.page + t) * hg + j) * self.dim * self.es + b
    }
}

/// sglang's test shapes (kv heads, head groups, layers, page, head dim), smaller layer counts.
const SHAPES: [(usize, usize, usize, usize, usize); 6] =
    [(8, 8, 5, 16, 128), (8, 4, 4, 8, 64), (16, 2, 5, 16, 128), (16, 4, 3, 8, 128), (8, 1, 3, 4, 32), (4, 4, 1, 4, 64)];

#[test]
fn head_group_load_and_backup_match_byte_loops() {
    let dev = Device::cpu();
    for (n, &(heads, groups, layers, page, dim)) in SHAPES.iter().enumerate() {
        let g = Hg { heads, groups, layers, page, dim, es: 2, pages: 3 };
        let (item, rows) = (g.item(), g.rows());
        // src = every token, dst = reversed (sglang's pattern), plus a skipped pair.
        let mut src: Vec<i64> = (0..rows as i64).collect();
        let mut dst: Vec<i64> = src.iter().rev().copied().collect();
        src.push(-1);
        dst.push(0);
        let mut host_k = random(g.host_bytes(), 1 + n as u64);
        let mut host_v = random(g.host_bytes(), 100 + n as u64);
        for layer in 0..layers {
            let mut dk = vec![0u8; rows * item];
            let mut dv = vec![0u8; rows * item];
            kv::transfer_kv_per_layer_pfdhg_lf(
                &dev,
                &tensor(&mut host_k, &[g.host_bytes() as u64]),
                &tensor(&mut dk, &[rows as u64, item as u64]),
                &tensor(&mut host_v, &[g.host_bytes() as u64]),
                &tensor(&mut dv, &[rows as u64, item as u64]),
                &src,
                &dst,
                layer as i64,
                item as i64,
                (item * layers) as i64,
                page as i64,
                groups as i64,
            )
            .unwrap();
            for (host, dev_layer) in [(&host_k, &dk), (&host_v, &dv)] {
                for (&s, &d) in src.iter().zip(&dst) {
                    if s < 0 {
                        continue;
                    }
                    for head in 0..heads {
                        let row = dim * g.es;
                        let at = d as usize * item + head * row;
                        let from = g.host_byte(s as usize, layer, head, 0);
                        assert_eq!(&dev_layer[at..at + row], &host[from..from + row], "shape {n} layer {layer} slot {s} head {head}");
                    }
                }
            }
        }
        // Backup of every layer into a fresh host buffer, then a load of each layer back: the
        // original device bytes (a round trip with swapped lists).
        let dev_k: Vec<Vec<u8>> = (0..layers).map(|l| random(rows * item, 1000 + l as u64)).collect();
        let dev_v: Vec<Vec<u8>> = (0..layers).map(|l| random(rows * item, 2000 + l as u64)).collect();
        let (mut dk, mut dv) = (dev_k.clone(), dev_v.clone());
        let mut hk = vec![0u8; g.host_bytes()];
        let mut hv = vec![0u8; g.host_bytes()];
        let kt: Vec<RawTensor> = dk.iter_mut().map(|b| tensor(b, &[rows as u64, item as u64])).collect();
        let vt: Vec<RawTensor> = dv.iter_mut().map(|b| tensor(b, &[rows as u64, item as u64])).collect();
        let (dev_src, host_dst): (Vec<i64>, Vec<i64>) = (dst[..rows].to_vec(), src[..rows].to_vec());
        kv::transfer_kv_all_layer_lf_pfdhg(
            &dev,
            &kt,
            &tensor(&mut hk, &[g.host_bytes() as u64]),
            &vt,
            &tensor(&mut hv, &[g.host_bytes() as u64]),
            &dev_src,
            &host_dst,
            item as i64,
            (item * layers) as i64,
            layers as i64,
            page as i64,
            groups as i64,
        )
        .unwrap();
        for (host, layers_src) in [(&hk, &dev_k), (&hv, &dev_v)] {
            for (&s, &d) in dev_src.iter().zip(&host_dst) {
                for (layer, bytes) in layers_src.iter().enumerate() {
                    for head in 0..heads {
                        let row = dim * g.es;
                        let from = s as usize * item + head * row;
                        let at = g.host_byte(d as usize, layer, head, 0);
                        assert_eq!(&host[at..at + row], &bytes[from..from + row], "shape {n} backup layer {layer}");
                    }
                }
            }
        }
    }
}

#[test]
fn one_head_group_is_page_first_direct() {
    let dev = Device::cpu();
    let g = Hg { heads: 4, groups: 1, layers: 3, page: 4, dim: 8, es: 2, pages: 3 };
    let (item, rows) = (g.item(), g.rows());
    let mut host = random(g.host_bytes(), 7);
    let mut host_v = host.clone();
    let mut dk = vec![0u8; rows * item];
    let mut dv = vec![0u8; rows * item];
    let idx: Vec<i64> = (0..rows as i64).collect();
    kv::transfer_kv_per_layer_pfdhg_lf(
        &dev,
        &tensor(&mut host, &[g.host_bytes() as u64]),
        &tensor(&mut dk, &[rows as u64, item as u64]),
        &tensor(&mut host_v, &[g.host_bytes() as u64]),
        &tensor(&mut dv, &[rows as u64, item as u64]),
        &idx,
        &idx,
        1,
        item as i64,
        (item * 3) as i64,
        4,
        1,
    )
    .unwrap();
    // page_first_direct: [pages][L][P][item].
    for s in 0..rows {
        let from = ((s / 4 * 3 + 1) * 4 + s % 4) * item;
        assert_eq!(&dk[s * item..][..item], &host[from..from + item]);
    }
}

/// sglang's checks on the integers (the texts its tests match), then ours; nothing moves.
#[test]
fn head_group_checks_refuse_before_any_byte_moves() {
    let dev = Device::cpu();
    let mut host = random(3 * 4 * 512, 3);
    let mut host_v = random(3 * 4 * 512, 4);
    let mut dk = vec![7u8; 12 * 512];
    let mut dv = vec![7u8; 12 * 512];
    let idx: Vec<i64> = (0..12).collect();
    let mut call = |src: &[i64], dst: &[i64], layer: i64, item: i64, layout: i64, page: i64, groups: i64| {
        kv::transfer_kv_per_layer_pfdhg_lf(
            &dev,
            &tensor(&mut host, &[3 * 4 * 512]),
            &tensor(&mut dk, &[12, 512]),
            &tensor(&mut host_v, &[3 * 4 * 512]),
            &tensor(&mut dv, &[12, 512]),
            src,
            dst,
            layer,
            item,
            layout,
            page,
            groups,
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    };
    let cases: [(&[i64], &[i64], i64, i64, i64, i64, i64, &str); 9] = [
        (&idx, &idx, 0, 512, 512, 0, 4, "page_size"),
        (&idx, &idx, 0, 512, 512, 4, 0, "head_num"),
        (&idx, &idx, 0, 512, 512, 4, 3, "item_size"),
        (&idx, &idx, 0, 24, 24, 4, 2, "Per-head-group"),
        (&idx, &idx, 0, 512, 513, 4, 4, "src_layout_dim"),
        (&idx, &idx[..11], 0, 512, 512, 4, 4, "Source and destination indices must have the same length"),
        (&idx, &idx, 1, 512, 512, 4, 4, "layer 1 is out of range"),
        (&[0, 1, 12], &[0, 1, 2], 0, 512, 512, 4, 4, "source index 12 at position 2 is out of range"),
        (&[0, 1, 2], &[5, 6, 5], 0, 512, 512, 4, 4, "destination slot 5 is written twice (positions 0 and 2)"),
    ];
    for (src, dst, layer, item, layout, page, groups, want) in cases {
        let e = call(src, dst, layer, item, layout, page, groups).unwrap_err();
        assert!(e.contains(want), "{want:?} not in {e:?}");
    }
    // Empty lists: a no-op, not an error.
    call(&[], &[], 0, 512, 512, 4, 4).unwrap();
    assert!(dk.iter().chain(&dv).all(|&b| b == 7), "a refused call moved bytes");
}

#[test]
fn embedding_ranges_match_a_row_loop() {
    let dev = Device::cpu();
    // sglang's shape: 74-byte rows (bf16 × 37), fragmented source, contiguous destination.
    let row = 74usize;
    let mut src = random(28 * row, 5);
    let mut dst = vec![0xffu8; 16 * row];
    let (ss, ds, n) = ([1i64, 11, 23], [2i64, 6, 10], [4i64, 4, 2]);
    kv::transfer_embedding_ranges_direct(&dev, &tensor(&mut src, &[28, 37]), &tensor(&mut dst, &[16, 37]), &ss, &ds, &n).unwrap();
    let mut want = vec![0xffu8; 16 * row];
    for k in 0..3 {
        for i in 0..n[k] as usize {
            let (s, d) = (ss[k] as usize + i, ds[k] as usize + i);
            want[d * row..][..row].copy_from_slice(&src[s * row..][..row]);
        }
    }
    assert_eq!(dst, want);
    // The reverse direction, a zero-length range among them.
    let mut back = vec![0u8; 28 * row];
    kv::transfer_embedding_ranges_direct(&dev, &tensor(&mut dst, &[16, 37]), &tensor(&mut back, &[28, 37]), &[2, 0], &[1, 0], &[4, 0])
        .unwrap();
    assert_eq!(&back[row..5 * row], &src[row..5 * row]);
}

#[test]
fn embedding_ranges_refuse_before_any_byte_moves() {
    let dev = Device::cpu();
    let mut src = random(8 * 16, 6);
    let mut dst = vec![9u8; 8 * 16];
    let mut wide = vec![9u8; 8 * 32];
    let mut run = |d: &mut Vec<u8>, dims: &[u64], ss: &[i64], ds: &[i64], n: &[i64]| {
        kv::transfer_embedding_ranges_direct(&dev, &tensor(&mut src, &[8, 4]), &tensor(d, dims), ss, ds, n).unwrap_err().to_string()
    };
    let cases: [(&[i64], &[i64], &[i64], &str); 5] = [
        (&[0], &[0, 1], &[1], "the same number of ranges"),
        (&[-1], &[0], &[1], "src_starts[0] must not be negative"),
        (&[6], &[0], &[3], "source index 8 at position 0 is out of range (pool holds 8 rows)"),
        (&[0], &[7], &[2], "destination index 8 at position 0 is out of range"),
        (&[0, 4], &[0, 2], &[3, 3], "written twice"),
    ];
    for (ss, ds, n, want) in cases {
        let e = run(&mut dst, &[8, 4], ss, ds, n);
        assert!(e.contains(want), "{want:?} not in {e:?}");
    }
    let e = run(&mut wide, &[8, 8], &[0], &[0], &[1]);
    assert!(e.contains("rows of 32 bytes, src's are 16"), "{e}");
    assert!(dst.iter().chain(&wide).all(|&b| b == 9), "a refused call moved bytes");
}

#[test]
fn copy_all_layer_kv_cache_is_one_simultaneous_assignment() {
    // Two buffers with different row sizes; a rotation (every target is another's source).
    let rows = [16usize, 48];
    let mut bufs: Vec<Vec<u8>> = rows.iter().enumerate().map(|(b, &r)| random(10 * r, 20 + b as u64)).collect();
    let before = bufs.clone();
    let (tgt, src) = ([1i64, 2, 3, 0, 9], [0i64, 1, 2, 3, 4]);
    let ts: Vec<RawTensor> = bufs
        .iter_mut()
        .map(|b| {
            let n = b.len() as u64;
            tensor(b, &[n])
        })
        .collect();
    kv::copy_all_layer_kv_cache(&ts, &[16, 48], &tgt, &src).unwrap();
    for (b, &r) in rows.iter().enumerate() {
        let mut want = before[b].clone();
        for (&t, &s) in tgt.iter().zip(&src) {
            want[t as usize * r..][..r].copy_from_slice(&before[b][s as usize * r..][..r]);
        }
        assert_eq!(bufs[b], want, "buffer {b}");
    }
    // Refusals move nothing.
    let snapshot = bufs.clone();
    let ts: Vec<RawTensor> = bufs
        .iter_mut()
        .map(|b| {
            let n = b.len() as u64;
            tensor(b, &[n])
        })
        .collect();
    for (t, s, want) in [
        (&[1i64, 1][..], &[0i64, 2][..], "destination row 1 is written twice"),
        (&[1], &[10], "source index 10 at position 0 is out of range (pool holds 10 rows)"),
        (&[-1], &[0], "destination index -1"),
        (&[1, 2], &[0], "the same length"),
    ] {
        let e = kv::copy_all_layer_kv_cache(&ts, &[16, 48], t, s).unwrap_err();
        assert!(e.to_string().contains(want), "{want:?} not in {e}");
    }
    assert!(matches!(kv::copy_all_layer_kv_cache(&ts, &[16], &[0], &[1]), Err(TransferError::LayerListMismatch { .. })));
    assert_eq!(bufs, snapshot);
}

/// sglang's tests pass one tensor as both `dst_k` and `dst_v`, read from one tensor: the same
/// bytes written twice are accepted; every other overlap stays refused.
#[test]
fn exact_aliasing_with_identical_sources_is_accepted() {
    let dev = Device::cpu();
    let mut src = random(8 * 16, 8);
    let mut dst = vec![0u8; 8 * 16];
    let mut other = random(8 * 16, 9);
    let (si, di) = ([3i64, 1], [0i64, 5]);
    let (s, d) = (tensor(&mut src, &[8, 16]), tensor(&mut dst, &[8, 16]));
    kv::transfer_kv_per_layer(&dev, &s, &d, &s, &d, &si, &di, 16).unwrap();
    assert_eq!(&dst[..16], &src[48..64]);
    assert_eq!(&dst[80..96], &src[16..32]);
    // Different sources into one destination: refused.
    let o = tensor(&mut other, &[8, 16]);
    let e = kv::transfer_kv_per_layer(&dev, &s, &d, &o, &d, &si, &di, 16).unwrap_err();
    assert!(e.to_string().contains("destination overlaps"), "{e}");
}

/// The same-bytes-twice allowance is for the `kernel` ops only, and only for one tensor of one
/// shape: a `direct` copy splits runs across threads (two would write the same bytes at once),
/// and a reshaped alias addresses other bytes with the same indices.
#[test]
fn aliasing_stays_refused_for_direct_copies_and_reshaped_views() {
    let dev = Device::cpu();
    let mut src = random(8 * 16, 10);
    let mut dst = vec![0u8; 8 * 16];
    let (s, d) = (tensor(&mut src, &[8, 16]), tensor(&mut dst, &[8, 16]));
    let e = kv::transfer_kv_direct(&dev, &[s.clone(), s.clone()], &[d.clone(), d.clone()], &[0, 1], &[2, 3], 1).unwrap_err();
    assert!(e.to_string().contains("destination overlaps"), "{e}");
    let (s2, d2) = (tensor(&mut src, &[4, 32]), tensor(&mut dst, &[4, 32]));
    let e = kv::transfer_kv_per_layer(&dev, &s, &d, &s2, &d2, &[0], &[1], 16).unwrap_err();
    assert!(e.to_string().contains("destination overlaps"), "{e}");
    assert!(dst.iter().all(|&b| b == 0));
}
