//! Padded pages: DeepSeek-V4 C4 token copies (`transfer_cache_dsv4_mla`) against a byte loop
//! written from the page layout (64 tokens a page of 37,440 bytes: values at `slot × 576`,
//! scales at `36864 + slot × 8`), NVFP4 page rows (`transfer_page_rows`) against a row loop, and
//! padded-page pools on every executor present; rejected calls leave every byte as it was.

mod common;

use common::random_bytes as random;
use hicache_io::geometry::{DeviceGeometry, IoBackend, LayerMap, Layout, PagePadding, PoolKind, Profile};
use hicache_io::kvcacheio::{self as kv, Memory, RawTensor, DSV4_PAGE_BYTES as PAGE};
use hicache_io::plan::{Op, Request};
use hicache_io::tools::check::Rng;
use hicache_io::{Device, DevicePool, HostPool, HostPoolConfig, TransferError};

const TOKENS: usize = 64;
const VALUE: usize = 576;
const SCALE: usize = 8;

/// `buf` as a 1-D host tensor.
fn tensor(buf: &mut [u8]) -> RawTensor {
    let n = buf.len() as u64;
    common::host_tensor(buf, &[n])
}

/// The (offset, length) of token `t`'s value and scale in a C4 buffer.
fn token_spans(t: usize) -> [(usize, usize); 2] {
    let (page, slot) = (t / TOKENS, t % TOKENS);
    let page_bytes = PAGE as usize;
    [(page * page_bytes + slot * VALUE, VALUE), (page * page_bytes + TOKENS * VALUE + slot * SCALE, SCALE)]
}

/// The byte loop: every layer, every pair (negative entries skipped, as sglang's kernels do).
fn reference(src: &[Vec<u8>], dst: &mut [Vec<u8>], si: &[i64], di: &[i64]) {
    for (s, d) in src.iter().zip(dst.iter_mut()) {
        for (&a, &b) in si.iter().zip(di) {
            if a < 0 || b < 0 {
                continue;
            }
            for ((so, n), (dof, _)) in token_spans(a as usize).into_iter().zip(token_spans(b as usize)) {
                d[dof..dof + n].copy_from_slice(&s[so..so + n]);
            }
        }
    }
}

/// Distinct random tokens below `bound`.
fn distinct(rng: &mut Rng, n: usize, bound: usize) -> Vec<i64> {
    let mut all: Vec<i64> = (0..bound as i64).collect();
    for i in 0..n {
        let j = i + rng.below((bound - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(n);
    all
}

#[test]
fn page_layout_is_sglangs() {
    assert_eq!(PAGE, 37_440);
    assert_eq!(token_spans(64 + 3), [(37_440 + 3 * 576, 576), (37_440 + 36_864 + 24, 8)]);
}

#[test]
fn token_copies_match_a_byte_loop_both_ways() {
    let dev = Device::cpu();
    let mut rng = Rng::new(7);
    let layers = 3;
    // A "device" side of 2 pages and a "host" side of 3 pages a layer.
    let mut small: Vec<Vec<u8>> = (0..layers).map(|l| random(2 * PAGE as usize, 10 + l as u64)).collect();
    let mut large: Vec<Vec<u8>> = (0..layers).map(|l| random(3 * PAGE as usize, 20 + l as u64)).collect();
    // Backup of one token per request (HiSparse decode), then an unaligned run: small → large.
    for n in [1usize, 5, 77] {
        let si = distinct(&mut rng, n, 2 * TOKENS);
        let di = distinct(&mut rng, n, 3 * TOKENS);
        let mut want = large.clone();
        reference(&small, &mut want, &si, &di);
        let st: Vec<RawTensor> = small.iter_mut().map(|b| tensor(b)).collect();
        let dt: Vec<RawTensor> = large.iter_mut().map(|b| tensor(b)).collect();
        kv::transfer_cache_dsv4_mla(&dev, &st, &dt, &si[..], &di[..]).unwrap();
        assert_eq!(large, want, "{n} tokens small → large");
    }
    // And back (a load), with skipped pairs.
    let mut si = distinct(&mut rng, 40, 3 * TOKENS);
    let mut di = distinct(&mut rng, 40, 2 * TOKENS);
    si[3] = -1;
    di[9] = -1;
    let mut want = small.clone();
    reference(&large, &mut want, &si, &di);
    let st: Vec<RawTensor> = large.iter_mut().map(|b| tensor(b)).collect();
    let dt: Vec<RawTensor> = small.iter_mut().map(|b| tensor(b)).collect();
    kv::transfer_cache_dsv4_mla(&dev, &st, &dt, &si[..], &di[..]).unwrap();
    assert_eq!(small, want, "large → small");
}

#[test]
fn hostile_token_copies_move_nothing() {
    let dev = Device::cpu();
    let layers = 2;
    let mut src: Vec<Vec<u8>> = (0..layers).map(|l| random(2 * PAGE as usize, 30 + l as u64)).collect();
    let mut dst: Vec<Vec<u8>> = (0..layers).map(|l| random(PAGE as usize + 1000, 40 + l as u64)).collect();
    let mut short = random(PAGE as usize - 8, 50);
    let before = dst.clone();
    let st: Vec<RawTensor> = src.iter_mut().map(|b| tensor(b)).collect();
    let dt: Vec<RawTensor> = dst.iter_mut().map(|b| tensor(b)).collect();
    let one_short = vec![dt[0].clone(), tensor(&mut short)];
    let ok = (0..8i64).collect::<Vec<_>>();
    type Case = (&'static str, Vec<RawTensor>, Vec<i64>, Vec<i64>);
    let cases: Vec<Case> = vec![
        // The destination holds one whole page: token 64 is past it (its value would fit in
        // the 1000 spare bytes, its scale would not).
        ("destination token past the last whole page", dt.clone(), ok.clone(), [&ok[..7], &[64]].concat()),
        ("source token past the end", dt.clone(), [&ok[..7], &[128]].concat(), ok.clone()),
        ("a token beyond 32 bits", dt.clone(), [&ok[..7], &[1i64 << 32]].concat(), ok.clone()),
        ("a destination written twice", dt.clone(), ok.clone(), [&ok[..7], &[0]].concat()),
        ("lengths differ", dt.clone(), ok.clone(), ok[..7].to_vec()),
        ("a layer shorter than a page", one_short, ok.clone(), ok.clone()),
        ("layer counts differ", dt[..1].to_vec(), ok.clone(), ok.clone()),
        ("source and destination overlap", st.clone(), ok.clone(), (8..16).collect()),
    ];
    for (what, d, si, di) in cases {
        let err = kv::transfer_cache_dsv4_mla(&dev, &st, &d, &si[..], &di[..]);
        assert!(err.is_err(), "{what}: accepted");
        let err = err.unwrap_err();
        match what {
            "lengths differ" => assert!(matches!(err, TransferError::LengthMismatch { .. }), "{what}: {err:?}"),
            "layer counts differ" => assert!(matches!(err, TransferError::LayerListMismatch { .. }), "{what}: {err:?}"),
            "a destination written twice" => assert!(matches!(err, TransferError::DuplicateDestination { .. }), "{what}: {err:?}"),
            w if w.contains("past") || w.contains("32 bits") => {
                assert!(matches!(err, TransferError::IndexOutOfRange { .. }), "{what}: {err:?}")
            }
            _ => assert!(matches!(err, TransferError::BadTensor { .. }), "{what}: {err:?}"),
        }
        assert_eq!(dst, before, "{what}: bytes moved");
    }
    // Nothing to move is fine.
    kv::transfer_cache_dsv4_mla(&dev, &st, &dt, &[][..], &[][..]).unwrap();
    assert_eq!(dst, before);
}

/// A padded-page pool pair of one part of a C4 token (`item` bytes at `offset` in each page):
/// the geometry the op moves with, on every executor present, loads and backups against the
/// byte loop of that part.
#[test]
fn padded_page_pools_move_exact_bytes_on_every_executor() {
    for device in common::devices() {
        for (item, offset) in [(VALUE as u64, 0u64), (SCALE as u64, (TOKENS * VALUE) as u64)] {
            let padding = PagePadding { page_bytes: PAGE, offset };
            padded_pools_move_exact_bytes(&device, item, TOKENS as u64, padding, (2, 3), item).unwrap();
        }
    }
}

/// wgpu binds pools in windows and segments whose edges fall on whole items; an item of a
/// padded page whose page bytes or offset are not whole items could straddle one. Such pools
/// larger than one window are refused before anything moves; whole-item padding crosses every
/// edge exactly; the cpu executor (no windows) moves both.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_windows_never_cut_a_padded_item() {
    use hicache_io::exec::wgpu::{WgpuExecutor, WgpuOptions};
    use hicache_io::exec::ExecutorKind;
    let (item, p) = (24u64, 2u64);
    // A window must hold whole items at the adapter's binding offsets: 256 bytes on lavapipe
    // (offsets of 32), 768 on SwiftShader (offsets of 256); a layer spans several either way.
    let align = match WgpuExecutor::new() {
        Ok(e) => e.device().limits().min_storage_buffer_offset_alignment as u64,
        Err(e) if common::required(ExecutorKind::Wgpu) => panic!("{e}"),
        Err(e) => return eprintln!("skipping: {e}"),
    };
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let lcm = align / gcd(align, item) * item;
    let window = 256u64.div_ceil(lcm) * lcm;
    let opts = WgpuOptions { max_segment: Some(1024.max(2 * window)), max_window: Some(window), ..Default::default() };
    let wgpu = Device::Wgpu(WgpuExecutor::with_options(opts).unwrap());
    let cut = PagePadding { page_bytes: p * item + 8, offset: 8 };
    let whole = PagePadding { page_bytes: p * item + item, offset: item };
    // 40 device pages of 72 bytes (2880 a layer): several windows and segments.
    padded_pools_move_exact_bytes(&wgpu, item, p, whole, (40, 30), 1).unwrap();
    padded_pools_move_exact_bytes(&Device::cpu(), item, p, cut, (40, 30), 2).unwrap();
    match padded_pools_move_exact_bytes(&wgpu, item, p, cut, (40, 30), 3) {
        Err(TransferError::ExecutorLimit { executor: "wgpu", .. }) => {}
        other => panic!("an item cut by a window edge: {other:?}"),
    }
}

/// Loads layer 1 of a two-layer padded pool pair (`p` items of `item` bytes at
/// `padding.offset` of each `padding.page_bytes`-byte page; `pages` = (device, host) pages a
/// layer), then backs up every layer, each against the byte loop; the planner's refusal, when
/// it refuses, with every byte of both pools as it was.
fn padded_pools_move_exact_bytes(
    device: &Device,
    item: u64,
    p: u64,
    padding: PagePadding,
    (dev_pages, host_pages): (u64, u64),
    seed: u64,
) -> Result<(), TransferError> {
    let layers = 2u64;
    let offset = padding.offset;
    let geometry =
        DeviceGeometry::new(PoolKind::Mla, item, dev_pages * p, p, LayerMap::new(layers as usize)).unwrap().with_padding(padding).unwrap();
    // The last page is used up to its last item.
    assert_eq!(geometry.layer_bytes(), (dev_pages - 1) * padding.page_bytes + offset + p * item);
    let mut dev = DevicePool::with_geometry(device, geometry).unwrap();
    let config = HostPoolConfig {
        layout: Layout::LayerFirst,
        size: (host_pages - 1) * p,
        head_num: 1,
        profile: Profile::Sglang,
        integrity: Some(false),
    };
    let mut host = HostPool::new(&dev, &config).unwrap();
    assert_eq!(host.geometry().buffer_bytes(), (layers * host_pages - 1) * padding.page_bytes + offset + p * item);
    let host0 = random(host.geometry().buffer_bytes() as usize, 60 + seed);
    host.write_buffer(0, &host0).unwrap();
    let dev0: Vec<Vec<u8>> = (0..layers).map(|l| random(dev.geometry().layer_bytes() as usize, 70 + seed + l)).collect();
    for (l, b) in dev0.iter().enumerate() {
        dev.write_buffer(0, l, b).unwrap();
    }
    let unchanged = |dev: &DevicePool, host: &HostPool, what: &str| {
        assert_eq!(host.read_buffer(0).unwrap(), host0, "{}: refused {what} moved host bytes", device.label());
        for (l, b) in dev0.iter().enumerate() {
            assert_eq!(&dev.read_buffer(0, l).unwrap(), b, "{}: refused {what} moved device bytes", device.label());
        }
    };
    let (host_slots, dev_slots) = ((host_pages * p) as usize, (dev_pages * p) as usize);
    let mut rng = Rng::new(seed);
    let hi = distinct(&mut rng, 50.min(dev_slots), host_slots);
    let di = distinct(&mut rng, 50.min(dev_slots), dev_slots);
    let part = |t: i64| {
        let (page, slot) = (t as u64 / p, t as u64 % p);
        (page * padding.page_bytes + offset + slot * item) as usize
    };
    let host_layer = (host_pages * padding.page_bytes) as usize;
    let n = item as usize;
    // Load layer 1, then back up every layer.
    let req =
        Request { op: Op::Load { layer_id: 1, is_draft: false }, io_backend: IoBackend::Kernel, host_indices: &hi, device_indices: &di };
    let plan = match host.plan(&dev, &req) {
        Ok(plan) => plan,
        Err(e) => {
            unchanged(&dev, &host, "load");
            return Err(e);
        }
    };
    host.execute_load(&mut dev, &plan).unwrap();
    device.synchronize().unwrap();
    let mut want = dev0.clone();
    for (&h, &d) in hi.iter().zip(&di) {
        want[1][part(d)..part(d) + n].copy_from_slice(&host0[host_layer + part(h)..][..n]);
    }
    for (l, w) in want.iter().enumerate() {
        assert_eq!(&dev.read_buffer(0, l).unwrap(), w, "{}: load, part of {item} bytes, layer {l}", device.label());
    }
    let back_h = distinct(&mut rng, 30.min(dev_slots), host_slots);
    let back_d = distinct(&mut rng, 30.min(dev_slots), dev_slots);
    let req = Request { op: Op::Backup, io_backend: IoBackend::Kernel, host_indices: &back_h, device_indices: &back_d };
    let plan = host.plan(&dev, &req)?;
    host.execute_backup(&dev, &plan).unwrap();
    device.synchronize().unwrap();
    let mut want_host = host0.clone();
    for l in 0..layers as usize {
        for (&h, &d) in back_h.iter().zip(&back_d) {
            want_host[l * host_layer + part(h)..][..n].copy_from_slice(&want[l][part(d)..part(d) + n]);
        }
    }
    assert_eq!(host.read_buffer(0).unwrap(), want_host, "{}: backup, part of {item} bytes", device.label());
    // Padded pages move by kernel only.
    let req = Request { op: Op::Backup, io_backend: IoBackend::Direct, host_indices: &back_h, device_indices: &back_d };
    assert!(matches!(host.plan(&dev, &req), Err(TransferError::UnsupportedIoBackend { .. })));
    Ok(())
}

/// Page rows: `row_bytes` every stride, host and device strides differing (sglang's page_first
/// host pool: per-layer views `row_bytes` apart, stride `L × row_bytes`), both directions.
#[test]
fn page_rows_match_a_row_loop_both_ways() {
    let dev = Device::cpu();
    let (layers, row, host_pages, dev_pages) = (3usize, 256usize, 6usize, 5usize);
    // Host page_first [pages][L][row]: layer l's view starts l rows in, stride L rows.
    let mut host = random(host_pages * layers * row, 80);
    let mut device: Vec<Vec<u8>> = (0..layers).map(|l| random(dev_pages * row, 90 + l as u64)).collect();
    let (hs, ds) = (layers * row, row);
    let host_views = |host: &mut Vec<u8>| -> Vec<RawTensor> {
        (0..layers)
            .map(|l| {
                let len = (host_pages - 1) * hs + row;
                // SAFETY: a view inside `host`, which outlives the call.
                unsafe { RawTensor::new(host.as_mut_ptr().add(l * row) as u64, len as u64, vec![len as u64], Memory::Host) }
            })
            .collect()
    };
    let (hp, dp) = (vec![4i64, 0, 5], vec![1i64, 4, 0]);
    // Backup (load = 0): device rows into host rows of every layer.
    let mut want = host.clone();
    for (l, d) in device.iter().enumerate() {
        for (&h, &p) in hp.iter().zip(&dp) {
            want[h as usize * hs + l * row..][..row].copy_from_slice(&d[p as usize * ds..][..row]);
        }
    }
    let hv = host_views(&mut host);
    let dv: Vec<RawTensor> = device.iter_mut().map(|b| tensor(b)).collect();
    kv::transfer_page_rows(&dev, &hv, &dv, &hp[..], &dp[..], hs as i64, ds as i64, row as i64, 0).unwrap();
    assert_eq!(host, want, "backup");
    // Load (load = 1) of other rows, after scrambling the host.
    host = random(host_pages * layers * row, 81);
    let (hp, dp) = (vec![2i64, 3], vec![3i64, 2]);
    let mut want: Vec<Vec<u8>> = device.clone();
    for (l, w) in want.iter_mut().enumerate() {
        for (&h, &p) in hp.iter().zip(&dp) {
            w[p as usize * ds..][..row].copy_from_slice(&host[h as usize * hs + l * row..][..row]);
        }
    }
    let hv = host_views(&mut host);
    let dv: Vec<RawTensor> = device.iter_mut().map(|b| tensor(b)).collect();
    kv::transfer_page_rows(&dev, &hv, &dv, &hp[..], &dp[..], hs as i64, ds as i64, row as i64, 1).unwrap();
    assert_eq!(device, want, "load");
    // sglang's checks with its words, and ours; nothing moves.
    let before = device.clone();
    let dv: Vec<RawTensor> = device.iter_mut().map(|b| tensor(b)).collect();
    let refused = |r: hicache_io::Result<()>| r.unwrap_err().to_string();
    assert_eq!(
        refused(kv::transfer_page_rows(&dev, &hv, &dv, &hp[..], &dp[..], hs as i64, ds as i64, 200, 1)),
        "page-row bytes must be a positive multiple of 128"
    );
    assert_eq!(
        refused(kv::transfer_page_rows(&dev, &hv, &dv, &hp[..], &dp[..], hs as i64 + 64, ds as i64, row as i64, 1)),
        "page-row strides must be 128B aligned"
    );
    assert!(refused(kv::transfer_page_rows(&dev, &hv, &dv, &hp[..], &dp[..], 128, ds as i64, row as i64, 1)).contains("rows would overlap"));
    assert!(matches!(
        kv::transfer_page_rows(&dev, &hv, &dv, &[6i64][..], &[0i64][..], hs as i64, ds as i64, row as i64, 1),
        Err(TransferError::IndexOutOfRange { .. })
    ));
    assert!(matches!(
        kv::transfer_page_rows(&dev, &hv, &dv, &[1i64, 2][..], &[0i64, 0][..], hs as i64, ds as i64, row as i64, 1),
        Err(TransferError::DuplicateDestination { .. })
    ));
    assert_eq!(device, before);
    // Destination layers whose rows collide (views half a row apart) are refused.
    let mut host2 = host.clone();
    let colliding: Vec<RawTensor> = (0..2)
        .map(|l| {
            let len = (host_pages - 2) * hs + row;
            // SAFETY: a view inside `host2`, which outlives the call.
            unsafe { RawTensor::new(host2.as_mut_ptr().add(l * 128) as u64, len as u64, vec![len as u64], Memory::Host) }
        })
        .collect();
    let err = kv::transfer_page_rows(&dev, &colliding, &dv[..2], &hp[..], &dp[..], hs as i64, ds as i64, row as i64, 0).unwrap_err();
    assert!(err.to_string().contains("rows overlap"), "{err}");
    assert_eq!(host2, host);
}
