//! Ports of sglang's `sgl-kernel/tests/test_kvcacheio.py` parametrizations:
//! same shapes, same index pattern (whole pages in random order, src and dst disjoint), same
//! reference helpers, run through the pools API on every executor present, byte for byte.
//!
//! sglang's kernel tests copy host→device for both per-layer and all-layer ops; our pools API
//! has per-layer loads (H2D) and all-layer backups (D2H), so `all_layers` maps to a backup.
//! bf16 and fp16 move the same bytes, so one dtype (2-byte elements) stands for both.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)] // index loops mirror sglang's test code

mod common;

use hicache_io::tools::check::Rng;
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

const LAYERS: usize = 4;

struct Setup {
    dev: DevicePool<'static>,
    host: HostPool<'static>,
    dev0: Vec<Vec<Vec<u8>>>,
    host0: Vec<Vec<u8>>,
}

fn setup(device: &Device, kind: PoolKind, item: u64, total: u64, page: u64, layout: Layout, heads: u64, seed: u64) -> Setup {
    let mut dev = DevicePool::new(
        device,
        &DevicePoolConfig { kind, bytes_per_token: item, slots: total, page_size: page, layers: LayerMap::new(LAYERS) },
    )
    .unwrap();
    let mut host =
        HostPool::new(&dev, &HostPoolConfig { layout, size: total, head_num: heads, profile: Profile::Sglang, integrity: None }).unwrap();
    let mut rng = Rng::new(seed);
    let comps = kind.components();
    let mut dev0 = vec![vec![Vec::new(); LAYERS]; comps];
    let mut host0 = vec![Vec::new(); comps];
    for c in 0..comps {
        for l in 0..LAYERS {
            let b = random(&mut rng, (total * item) as usize);
            dev.write_buffer(c, l, &b).unwrap();
            dev0[c][l] = b;
        }
        let b = random(&mut rng, host.geometry().buffer_bytes() as usize);
        host.write_buffer(c, &b).unwrap();
        host0[c] = b;
    }
    Setup { dev, host, dev0, host0 }
}

/// `len` random bytes: a slice of one block generated once, at a place `rng` picks (generating
/// every buffer of every case afresh was a fifth of this suite's time), or fresh where the block
/// is too short.
fn random(rng: &mut Rng, len: usize) -> Vec<u8> {
    static BLOCK: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let block = BLOCK.get_or_init(|| {
        let mut b = vec![0u8; 96 << 20];
        Rng::new(0x5eed).fill(&mut b);
        b
    });
    if len >= block.len() {
        let mut b = vec![0u8; len];
        rng.fill(&mut b);
        return b;
    }
    let at = rng.below((block.len() - len) as u64) as usize;
    block[at..at + len].to_vec()
}

/// sglang's pattern: `randperm(total_pages)`; src = first `num_pages` pages, dst = the next.
fn page_indices(total: u64, page: u64, num_items: u64, seed: u64) -> Option<(Vec<i64>, Vec<i64>)> {
    let num_pages = num_items / page;
    if num_pages == 0 {
        return None;
    }
    let total_pages = total / page;
    let perm = Rng::new(seed).distinct(total_pages, 2 * num_pages);
    let expand = |ps: &[u64]| ps.iter().flat_map(|p| (p * page..(p + 1) * page).map(|t| t as i64)).collect::<Vec<_>>();
    Some((expand(&perm[..num_pages as usize]), expand(&perm[num_pages as usize..])))
}

fn item_at(buf: &[u8], slot: i64, item: u64) -> &[u8] {
    &buf[(slot as u64 * item) as usize..][..item as usize]
}

fn check_device_layers(s: &Setup, want: &[Vec<Vec<u8>>], what: &str) {
    for (c, layers) in want.iter().enumerate() {
        for (l, w) in layers.iter().enumerate() {
            assert!(s.dev.read_buffer(c, l).unwrap() == *w, "{what}: device component {c} layer {l} differs");
        }
    }
}

fn check_host(s: &Setup, want: &[Vec<u8>], what: &str) {
    for (c, w) in want.iter().enumerate() {
        assert!(s.host.read_buffer(c).unwrap() == *w, "{what}: host component {c} differs");
    }
}

#[test]
fn test_transfer_kv() {
    let (total, item) = (10240u64, 256 * 2);
    for device in common::devices() {
        for num_items in [1u64, 128, 1024] {
            for page in [1u64, 16, 64] {
                for is_mla in [false, true] {
                    for all_layers in [false, true] {
                        for io in [IoBackend::Kernel, IoBackend::Direct] {
                            let what = format!("{} items={num_items} P={page} mla={is_mla} all={all_layers} {io}", device.name());
                            let Some((src, dst)) = page_indices(total, page, num_items, 42) else { continue };
                            let kind = if is_mla { PoolKind::Mla } else { PoolKind::Mha };
                            let mut s = setup(&device, kind, item, total, page, Layout::LayerFirst, 1, num_items * 7 + page);
                            let host_slots = s.host.geometry().slots();
                            if !all_layers {
                                // Per-layer, layer 0: dev[0][dst] = host[0][src] (ref_copy_with_indices).
                                s.host.load_to_device_per_layer(&mut s.dev, &src, &dst, 0, io).unwrap();
                                let mut want = s.dev0.clone();
                                for c in 0..kind.components() {
                                    for (a, b) in src.iter().zip(&dst) {
                                        let v = item_at(&s.host0[c], *a, item).to_vec();
                                        want[c][0][(*b as u64 * item) as usize..][..item as usize].copy_from_slice(&v);
                                    }
                                }
                                check_device_layers(&s, &want, &what);
                            } else {
                                // All layers: host[l][dst] = dev[l][src].
                                s.host.backup_from_device_all_layer(&s.dev, &dst, &src, io).unwrap();
                                let mut want = s.host0.clone();
                                for c in 0..kind.components() {
                                    for l in 0..LAYERS as u64 {
                                        for (a, b) in src.iter().zip(&dst) {
                                            let v = item_at(&s.dev0[c][l as usize], *a, item).to_vec();
                                            want[c][((l * host_slots + *b as u64) * item) as usize..][..item as usize].copy_from_slice(&v);
                                        }
                                    }
                                }
                                check_host(&s, &want, &what);
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn test_transfer_kv_pf_direct() {
    let (total, item) = (20480u64, 256 * 2);
    for device in common::devices() {
        for num_items in [128u64, 1024, 8192] {
            for page in [16u64, 64, 128] {
                for is_mla in [false, true] {
                    for lf_to_pf in [false, true] {
                        let what = format!("{} items={num_items} P={page} mla={is_mla} lf_to_pf={lf_to_pf}", device.name());
                        let (src, dst) = page_indices(total, page, num_items, 42).unwrap();
                        let kind = if is_mla { PoolKind::Mla } else { PoolKind::Mha };
                        let mut s = setup(&device, kind, item, total, page, Layout::PageFirstDirect, 1, num_items + page);
                        // [pages][L][P][item]
                        let host_off = |p: u64, l: u64| ((p * LAYERS as u64 + l) * page * item) as usize;
                        let span = (page * item) as usize;
                        if lf_to_pf {
                            // ref: dst[di[i]//ps][layer] = src[layer][si[i:i+ps]], every layer.
                            s.host.backup_from_device_all_layer(&s.dev, &dst, &src, IoBackend::Direct).unwrap();
                            let mut want = s.host0.clone();
                            for c in 0..kind.components() {
                                for l in 0..LAYERS as u64 {
                                    for i in (0..src.len()).step_by(page as usize) {
                                        let v = s.dev0[c][l as usize][(src[i] as u64 * item) as usize..][..span].to_vec();
                                        want[c][host_off(dst[i] as u64 / page, l)..][..span].copy_from_slice(&v);
                                    }
                                }
                            }
                            check_host(&s, &want, &what);
                        } else {
                            // ref: dst[layer][di[i:i+ps]] = src[si[i]//ps][layer], layer 0.
                            s.host.load_to_device_per_layer(&mut s.dev, &src, &dst, 0, IoBackend::Direct).unwrap();
                            let mut want = s.dev0.clone();
                            for c in 0..kind.components() {
                                for i in (0..src.len()).step_by(page as usize) {
                                    let v = s.host0[c][host_off(src[i] as u64 / page, 0)..][..span].to_vec();
                                    want[c][0][(dst[i] as u64 * item) as usize..][..span].copy_from_slice(&v);
                                }
                            }
                            check_device_layers(&s, &want, &what);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn test_transfer_kv_page_head() {
    let (total, item) = (4096u64, 1024 * 2);
    for device in common::devices() {
        for num_items in [256u64, 1024] {
            for page in [16u64, 64, 128] {
                for head_num in [8u64, 16] {
                    for lf_to_ph in [false, true] {
                        let what = format!("{} items={num_items} P={page} H={head_num} lf_to_ph={lf_to_ph}", device.name());
                        let (src, dst) = page_indices(total, page, num_items, 42).unwrap();
                        let mut s =
                            setup(&device, PoolKind::Mha, item, total, page, Layout::PageHead, head_num, num_items + page + head_num);
                        let d = item / head_num;
                        // [pages][H][P][L][D]
                        let ph = |t: u64, h: u64, l: u64| ((((t / page) * head_num + h) * page + t % page) * LAYERS as u64 + l) * d;
                        if lf_to_ph {
                            // ref: dst[di//ps][h][di%ps][layer] = src[layer][si][h], every layer.
                            s.host.backup_from_device_all_layer(&s.dev, &dst, &src, IoBackend::Kernel).unwrap();
                            let mut want = s.host0.clone();
                            for c in 0..2 {
                                for l in 0..LAYERS as u64 {
                                    for (a, b) in src.iter().zip(&dst) {
                                        for h in 0..head_num {
                                            let v = s.dev0[c][l as usize][(*a as u64 * item + h * d) as usize..][..d as usize].to_vec();
                                            want[c][ph(*b as u64, h, l) as usize..][..d as usize].copy_from_slice(&v);
                                        }
                                    }
                                }
                            }
                            check_host(&s, &want, &what);
                        } else {
                            // ref: dst[layer][di][h] = src[si//ps][h][si%ps][layer], layer 0.
                            s.host.load_to_device_per_layer(&mut s.dev, &src, &dst, 0, IoBackend::Kernel).unwrap();
                            let mut want = s.dev0.clone();
                            for c in 0..2 {
                                for (a, b) in src.iter().zip(&dst) {
                                    for h in 0..head_num {
                                        let v = s.host0[c][ph(*a as u64, h, 0) as usize..][..d as usize].to_vec();
                                        want[c][0][(*b as u64 * item + h * d) as usize..][..d as usize].copy_from_slice(&v);
                                    }
                                }
                            }
                            check_device_layers(&s, &want, &what);
                        }
                    }
                }
            }
        }
    }
}
