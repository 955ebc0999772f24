//! `hicache_io::kvcacheio` from Rust: sgl-kernel's ops on caller memory against plain byte
//! loops written from sglang's offset formulas, and rejected calls that leave every byte as it
//! was. (The Python suite runs every op with sglang's parametrizations.)

mod common;

use common::{host_tensor as tensor, random_bytes as random};
use hicache_io::kvcacheio::{self as kv, Memory, RawTensor};
use hicache_io::{Device, TransferError};

const ITEM: usize = 48;
const LAYERS: usize = 3;
const SLOTS: usize = 32;

#[test]
fn page_first_load_and_backup_match_byte_loops() {
    let dev = Device::cpu();
    // Host page_first [slots][L][item]; device layer [slots][item].
    let mut host = random(SLOTS * LAYERS * ITEM, 1);
    let host0 = host.clone();
    let mut layer = vec![0u8; SLOTS * ITEM];
    let (si, di) = (vec![5i64, -1, 9, 30], vec![0i64, 1, 31, 7]);
    kv::transfer_kv_per_layer_mla_pf_lf(
        &dev,
        &tensor(&mut host, &[SLOTS as u64, LAYERS as u64, ITEM as u64]),
        &tensor(&mut layer, &[SLOTS as u64, ITEM as u64]),
        &si,
        &di,
        2,
        ITEM as i64,
        (ITEM * LAYERS) as i64,
    )
    .unwrap();
    let mut want = vec![0u8; SLOTS * ITEM];
    for (&s, &d) in si.iter().zip(&di) {
        if s >= 0 && d >= 0 {
            let src = s as usize * LAYERS * ITEM + 2 * ITEM;
            want[d as usize * ITEM..][..ITEM].copy_from_slice(&host0[src..src + ITEM]);
        }
    }
    assert_eq!(layer, want);
    // One layer back into a fresh page_first buffer (what sglang lacks): only layer 1 of the
    // destination slots changes.
    let mut host2 = vec![0u8; SLOTS * LAYERS * ITEM];
    kv::transfer_kv_per_layer_mla_lf_pf(
        &dev,
        &tensor(&mut layer, &[SLOTS as u64, ITEM as u64]),
        &tensor(&mut host2, &[SLOTS as u64, LAYERS as u64, ITEM as u64]),
        &di,
        &si,
        1,
        ITEM as i64,
        (ITEM * LAYERS) as i64,
    )
    .unwrap();
    let mut want2 = vec![0u8; SLOTS * LAYERS * ITEM];
    for (&d, &s) in di.iter().zip(&si) {
        if s >= 0 && d >= 0 {
            let dst = s as usize * LAYERS * ITEM + ITEM;
            want2[dst..dst + ITEM].copy_from_slice(&layer[d as usize * ITEM..][..ITEM]);
        }
    }
    assert_eq!(host2, want2);
}

#[test]
fn page_first_direct_backup_matches_a_byte_loop() {
    let dev = Device::cpu();
    let p = 4usize;
    let pages = SLOTS / p;
    let mut layers: Vec<Vec<u8>> = (0..LAYERS).map(|l| random(SLOTS * ITEM, 10 + l as u64)).collect();
    let mut host = vec![0u8; pages * LAYERS * p * ITEM];
    let di: Vec<i64> = (8..12).chain(20..24).collect();
    let hi: Vec<i64> = (0..4).chain(12..16).collect();
    let src: Vec<RawTensor> = layers.iter_mut().map(|b| tensor(b, &[SLOTS as u64, ITEM as u64])).collect();
    let dst = [tensor(&mut host, &[pages as u64, LAYERS as u64, p as u64, ITEM as u64])];
    kv::transfer_kv_all_layer_direct_lf_pf(&dev, &src, &dst, &di, &hi, p as i64).unwrap();
    let mut want = vec![0u8; pages * LAYERS * p * ITEM];
    for (&d, &h) in di.iter().zip(&hi) {
        for (l, layer) in layers.iter().enumerate() {
            let (page, row) = (h as usize / p, h as usize % p);
            let off = ((page * LAYERS + l) * p + row) * ITEM;
            want[off..off + ITEM].copy_from_slice(&layer[d as usize * ITEM..][..ITEM]);
        }
    }
    assert_eq!(host, want);
}

#[test]
fn rejected_calls_move_nothing() {
    let dev = Device::cpu();
    let mut src = random(SLOTS * ITEM, 3);
    let mut dst = random(SLOTS * ITEM, 4);
    let before = dst.clone();
    let dims = [SLOTS as u64, ITEM as u64];
    let mut call = |si: &[i64], di: &[i64], item: i64| {
        kv::transfer_kv_per_layer_mla(&dev, &tensor(&mut src, &dims), &tensor(&mut dst, &dims), si, di, item).unwrap_err()
    };
    assert_eq!(call(&[1, 2], &[3], 48).to_string(), "Source and destination indices must have the same length");
    assert_eq!(call(&[1], &[3], 12).to_string(), "Item byte size must be divisible by 8");
    assert!(matches!(call(&[1], &[SLOTS as i64], 48), TransferError::IndexOutOfRange { side: "destination", .. }));
    assert!(matches!(call(&[1, 2], &[3, 3], 48), TransferError::DuplicateDestination { .. }));
    assert!(matches!(call(&[1], &[2], -8), TransferError::BadTensor { .. }));
    // A destination that overlaps the source.
    let mut one = random(SLOTS * ITEM, 5);
    let (a, b) = one.split_at_mut(SLOTS * ITEM / 2);
    let t_a = tensor(a, &[SLOTS as u64 / 2, ITEM as u64]);
    // SAFETY: a span covering both halves of `one`, alive for the call.
    let whole = unsafe { RawTensor::new(t_a.addr(), (SLOTS * ITEM) as u64, dims.to_vec(), Memory::Host) };
    let e = kv::transfer_kv_per_layer_mla(&dev, &tensor(b, &[SLOTS as u64 / 2, ITEM as u64]), &whole, &[0], &[1], 48).unwrap_err();
    assert!(e.to_string().contains("overlaps"), "{e}");
    assert_eq!(dst, before);
    // sglang's layer-count and layer-list checks.
    let e = kv::transfer_kv_all_layer_mla(&dev, &[], &[], &[0], &[0], 48, 2).unwrap_err();
    assert_eq!(e.to_string(), "Number of layers in source tensor does not match num_layers");
    let e = kv::transfer_kv_direct(&dev, &[tensor(&mut src, &dims)], &[], &[0], &[0], 1).unwrap_err();
    assert_eq!(e.to_string(), "Source and destination layers must have the same number of layers");
}
