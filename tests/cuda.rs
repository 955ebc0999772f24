//! CUDA executor: skips with a printed reason when there is no driver or device (fails instead
//! with `HICACHE_REQUIRE_CUDA=1`); on a GPU, every supported cell against the oracle.

mod common;

use hicache_io::exec::ExecutorKind;
use hicache_io::geometry::Profile;
use hicache_io::tools::check::check_device;

#[test]
fn cuda_without_a_gpu_is_unavailable_not_a_panic() {
    match hicache_io::Device::open(ExecutorKind::Cuda) {
        Ok(d) => eprintln!("cuda present: {}", d.describe()),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with("cuda: unavailable ("), "{msg}");
        }
    }
}

#[test]
fn cuda_equals_oracle_on_every_cell() {
    let Some(device) = common::open(ExecutorKind::Cuda) else { return };
    for profile in [Profile::Extended, Profile::Sglang] {
        let rows = check_device(&device, profile, 3, 6, |_, _| {}).unwrap();
        for (cell, t) in rows {
            assert_eq!(t.matched, t.cases, "{cell}: {:?}", t.first_failure);
        }
    }
}

/// With Debian's libcuda1 unpacked and no GPU (set up by `.ci/run`), the driver loads and every
/// path reports "no device" as an error, never a panic.
#[test]
fn cuda_driver_without_device_reports_no_device() {
    if std::env::var("HICACHE_EXPECT_CUDA_NO_DEVICE").is_err() {
        return;
    }
    let e = hicache_io::Device::open(ExecutorKind::Cuda).err().expect("no GPU expected here");
    assert!(e.to_string().contains("CUDA_ERROR_NO_DEVICE"), "{e}");
    assert!(matches!(hicache_io::Device::auto(), hicache_io::Device::Cpu(_)) || hicache_io::Device::auto().kind() == ExecutorKind::Wgpu);
}
