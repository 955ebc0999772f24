//! `check`'s draw of the op families beyond the pool calls (DeepSeek-V4 token copies, Mamba
//! states, NVFP4 page rows): every drawn call matches its definition byte for byte and every
//! hostile variant is refused with nothing moved, on every executor that takes caller memory.

use hicache_io::tools::check_ops::{check_ops, OPS};
use hicache_io::Device;

#[test]
fn newer_ops_match_their_definitions_and_refuse_hostile_calls() {
    let rows = check_ops(&Device::cpu(), 7, 60, |_, _| {}).unwrap();
    assert_eq!(rows.iter().map(|(op, _)| *op).collect::<Vec<_>>(), OPS);
    for (op, tally) in rows {
        let t = tally.expect("the cpu executor runs every op");
        assert_eq!(t.cases, 120, "{op}");
        assert_eq!(t.matched, t.cases, "{op}: {:?}", t.first_failure);
        assert!(t.bytes > 0, "{op} moved nothing");
    }
}

#[test]
fn executors_without_caller_memory_skip_them() {
    if let Ok(device) = Device::open(hicache_io::ExecutorKind::Wgpu) {
        assert!(check_ops(&device, 1, 2, |_, _| {}).unwrap().iter().all(|(_, t)| t.is_none()));
    }
}
