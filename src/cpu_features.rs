//! Processor features, probed once at run time (a leaf: the checksum and planning passes that
//! have vector forms both ask it).

/// Whether this processor has AVX2 (probed once).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    static AVX2: AtomicU8 = AtomicU8::new(0);
    match AVX2.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let yes = std::is_x86_feature_detected!("avx2");
            AVX2.store(if yes { 1 } else { 2 }, Ordering::Relaxed);
            yes
        }
    }
}
