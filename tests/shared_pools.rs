//! Pools shared by threads (`SharedHostPool`, `SharedDevicePool`): four threads drive one pool
//! pair as an engine's cache controller does — page writes from an L3 store, loads of those
//! pages, backups and page reads of others — and no call ever sees a page half written by
//! another, on every executor here. Every byte is checked.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};

use hicache_io::{
    DevicePool, DevicePoolConfig, HostPoolConfig, IoBackend, LayerMap, Layout, PoolKind, Profile, SharedDevicePool, SharedHostPool,
};

const P: u64 = 4;
const ITEM: u64 = 256;
const LAYERS: usize = 3;

fn tokens(page: i64) -> Vec<i64> {
    (page * P as i64..(page + 1) * P as i64).collect()
}

/// Whether every byte is one value, and which.
fn uniform(bytes: &[u8]) -> Option<u8> {
    bytes.iter().all(|&b| b == bytes[0]).then(|| bytes[0])
}

#[test]
fn threads_never_see_a_page_half_written() {
    for device in common::devices() {
        let slots = 32;
        let dc = DevicePoolConfig { kind: PoolKind::Mha, bytes_per_token: ITEM, slots, page_size: P, layers: LayerMap::new(LAYERS) };
        let dev = SharedDevicePool::new(DevicePool::new(&device, &dc).unwrap());
        let hc = HostPoolConfig { layout: Layout::PageFirst, size: 16, head_num: 1, profile: Profile::Extended, integrity: None };
        let host = SharedHostPool::new(&dev, &hc).unwrap();
        // Device page 3 holds 0x33 in every layer: what backups into host page 3 bring.
        let layer_bytes = dev.geometry().layer_bytes() as usize;
        for c in 0..2 {
            for s in 0..LAYERS {
                let mut b = vec![0u8; layer_bytes];
                b[(3 * P * ITEM) as usize..(4 * P * ITEM) as usize].fill(0x33);
                dev.write_buffer(c, s, &b).unwrap();
            }
        }
        let page_bytes = host.get_dummy_flat_data_page().unwrap().len();
        let rounds = if device.name() == "cpu" { 400 } else { 60 };
        let done = AtomicBool::new(false);
        let torn = |what: &str, bytes: &[u8], allowed: &[u8]| {
            assert!(uniform(bytes).is_some_and(|b| allowed.contains(&b)), "{} on {}: a page half written", what, device.name());
        };
        std::thread::scope(|s| {
            // An L3 store writing host page 1 whole, 0xAA or 0xBB.
            s.spawn(|| {
                for i in 0..rounds {
                    host.set_from_flat_data_page(P as i64, &vec![if i % 2 == 0 { 0xAA } else { 0xBB }; page_bytes]).unwrap();
                }
                done.store(true, Ordering::SeqCst);
            });
            // Loads of host page 1 into device page 2, layer by layer, each read back whole.
            s.spawn(|| {
                for i in 0..rounds {
                    let layer = i % LAYERS;
                    host.load_to_device_per_layer(&dev, &tokens(1), &tokens(2), layer, IoBackend::Kernel).unwrap();
                    let b = dev.read_buffer(1, layer).unwrap();
                    torn("load", &b[(2 * P * ITEM) as usize..(3 * P * ITEM) as usize], &[0, 0xAA, 0xBB]);
                }
            });
            // Backups of device page 3 into host page 3, read back as pages.
            s.spawn(|| {
                for _ in 0..rounds {
                    host.backup_from_device_all_layer(&dev, &tokens(3), &tokens(3), IoBackend::Kernel).unwrap();
                    torn("backup", &host.get_data_page(3 * P as i64).unwrap(), &[0x33]);
                }
            });
            // Page reads of the page being written.
            s.spawn(|| {
                while !done.load(Ordering::SeqCst) {
                    torn("page read", &host.get_data_page(P as i64).unwrap(), &[0, 0xAA, 0xBB]);
                }
            });
        });
        assert_eq!((host.calls_in_flight(), dev.calls_in_flight()), (0, 0));
        let last = if rounds % 2 == 0 { 0xBB } else { 0xAA };
        assert_eq!(uniform(&host.get_data_page(P as i64).unwrap()), Some(last));
    }
}

#[test]
fn a_held_page_holds_back_only_the_calls_that_write_it() {
    for device in common::devices() {
        let dc = DevicePoolConfig { kind: PoolKind::Mla, bytes_per_token: 64, slots: 16, page_size: P, layers: LayerMap::new(2) };
        let dev = SharedDevicePool::new(DevicePool::new(&device, &dc).unwrap());
        let hc = HostPoolConfig { layout: Layout::LayerFirst, size: 8, head_num: 1, profile: Profile::Extended, integrity: None };
        let host = SharedHostPool::new(&dev, &hc).unwrap();
        let hold = dev.hold_pages(&tokens(1), false); // someone reading device page 1
        let landed = AtomicBool::new(false);
        std::thread::scope(|s| {
            // A load into device page 0 and a backup reading device page 1: neither waits.
            host.load_to_device_per_layer(&dev, &tokens(0), &tokens(0), 0, IoBackend::Kernel).unwrap();
            host.backup_from_device_all_layer(&dev, &tokens(1), &tokens(1), IoBackend::Kernel).unwrap();
            // A load into device page 1 waits for the hold.
            let t = s.spawn(|| {
                host.load_to_device_per_layer(&dev, &tokens(0), &tokens(1), 1, IoBackend::Kernel).unwrap();
                landed.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(std::time::Duration::from_millis(100));
            assert!(!landed.load(Ordering::SeqCst), "{}: a load into a held page ran", device.name());
            drop(hold);
            t.join().unwrap();
        });
        assert!(landed.load(Ordering::SeqCst));
    }
}
