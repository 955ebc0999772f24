//! The `auto` io backend: on every executor present it moves the oracle's bytes through the
//! path the table allows (or the calibrated faster one where both are allowed), and profile
//! `sglang` refuses it as sglang refuses unknown io backends. The calibration is cached per
//! adapter.

mod common;

use hicache_io::error::TransferError;
use hicache_io::plan::Request;
use hicache_io::tools::check::{random_case, run_case, supported_cells, Outcome, Rng};
use hicache_io::{Device, DevicePool, DevicePoolConfig, HostPool, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile};

#[test]
fn auto_moves_the_oracles_bytes_on_every_supported_cell() {
    let mut rng = Rng::new(21);
    for device in common::devices() {
        for cell in supported_cells(Profile::Extended) {
            for _ in 0..3 {
                let mut case = random_case(cell, Profile::Extended, &mut rng);
                case.cell.io = IoBackend::Auto;
                match run_case(&device, &case).unwrap() {
                    Outcome::Match { .. } => {}
                    other => panic!("{} {cell} as auto: {other:?}", device.name()),
                }
            }
        }
    }
}

#[test]
fn auto_takes_the_only_allowed_path_and_is_not_sglangs() {
    for device in common::devices() {
        let dc = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 64, slots: 64, page_size: 4, layers: LayerMap::new(2) };
        let dev = DevicePool::new(&device, &dc).unwrap();
        let (hi, di): (Vec<i64>, Vec<i64>) = ((0..8).collect(), (8..16).collect());
        let req = Request { op: hicache_io::Op::Backup, io_backend: IoBackend::Auto, host_indices: &hi, device_indices: &di };
        for (layout, want) in [(Layout::PageFirst, IoBackend::Kernel), (Layout::PageFirstDirect, IoBackend::Direct)] {
            let host = HostPool::new(&dev, &HostPoolConfig { layout, size: 64, head_num: 1, profile: Profile::Extended, integrity: None })
                .unwrap();
            assert_eq!(host.plan(&dev, &req).unwrap().io_backend(), want, "{} {layout}", device.name());
        }
        let host = HostPool::new(
            &dev,
            &HostPoolConfig { layout: Layout::LayerFirst, size: 64, head_num: 1, profile: Profile::Extended, integrity: None },
        )
        .unwrap();
        let io = host.plan(&dev, &req).unwrap().io_backend();
        assert!(io == IoBackend::Kernel || io == IoBackend::Direct, "{io}");
        let host = HostPool::new(
            &dev,
            &HostPoolConfig { layout: Layout::LayerFirst, size: 64, head_num: 1, profile: Profile::Sglang, integrity: None },
        )
        .unwrap();
        let err = host.plan(&dev, &req).unwrap_err();
        assert!(matches!(&err, TransferError::UnsupportedIoBackend { io_backend } if io_backend == "auto"), "{err:?}");
        assert_eq!(err.to_string(), "Unsupported IO backend: auto");
    }
}

#[test]
fn calibration_is_cached_per_adapter() {
    let dir = std::env::temp_dir().join(format!("hicache-io-auto-test-{}", std::process::id()));
    // The other tests here may calibrate meanwhile (and write here too): only cpu files count.
    std::env::set_var("XDG_CACHE_HOME", &dir);
    let device = Device::cpu();
    let caps = device.calibrated_capabilities();
    assert!(caps.auto.calibrated);
    let files: Vec<String> = std::fs::read_dir(dir.join("hicache-io"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.contains("-cpu-"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].starts_with("auto-") && files[0].ends_with(".json"), "{files:?}");
    // A second instance reads the file instead of measuring again (same table).
    let again = Device::cpu().calibrated_capabilities();
    assert_eq!(again.auto, caps.auto);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `auto` resolves to a path from the call's shape before any index value is looked at, so an
/// out-of-range index is reported as the fixed paths report it, on every executor whatever its
/// calibration chose. It used to answer "Source indices size must be divisible by page size"
/// on cpu (its calibration preferred direct, which a 2-entry list at P = 4 cannot take) and
/// the range error on wgpu.
#[test]
fn auto_reports_the_first_failing_check_of_the_path_it_resolves_to() {
    let mut seen = Vec::new();
    for device in common::devices() {
        let dc = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 64, slots: 64, page_size: 4, layers: LayerMap::new(2) };
        let dev = DevicePool::new(&device, &dc).unwrap();
        let host = HostPool::new(
            &dev,
            &HostPoolConfig { layout: Layout::LayerFirst, size: 64, head_num: 1, profile: Profile::Extended, integrity: None },
        )
        .unwrap();
        let (hi, di) = ([0i64, 1], [2i64, 64]);
        let op = hicache_io::Op::Load { layer_id: 0, is_draft: false };
        let auto = host.plan(&dev, &Request { op, io_backend: IoBackend::Auto, host_indices: &hi, device_indices: &di }).unwrap_err();
        let kernel = host.plan(&dev, &Request { op, io_backend: IoBackend::Kernel, host_indices: &hi, device_indices: &di }).unwrap_err();
        assert!(matches!(auto, TransferError::IndexOutOfRange { side: "device", index: 64, position: 1, .. }), "{}: {auto}", device.name());
        assert_eq!(auto.to_string(), kernel.to_string(), "{}", device.name());
        // Both paths fit the shape (8 entries): a duplicate destination is the same error too.
        let (hi, di): (Vec<i64>, Vec<i64>) = ((0..8).collect(), vec![8, 9, 10, 11, 12, 13, 14, 8]);
        let auto = host.plan(&dev, &Request { op, io_backend: IoBackend::Auto, host_indices: &hi, device_indices: &di }).unwrap_err();
        assert!(matches!(auto, TransferError::DuplicateDestination { .. }), "{}: {auto}", device.name());
        seen.push(auto.to_string());
    }
    assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
}
