//! The `auto` io backend's table: for each (item size, run length) cell, whether `direct` beats
//! `kernel` on this executor. Measured once per executor instance on first use (small pools,
//! at most about a second), and kept in a cache file per adapter (`$XDG_CACHE_HOME` or
//! `~/.cache`, `hicache-io/auto-*.json`; `HICACHE_IO_AUTO_CACHE=0` neither reads nor writes it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Bindings, Device};
use crate::error::Result;
use crate::geometry::{DeviceGeometry, IoBackend, LayerMap, Layout, PoolKind, PoolPair, Profile};
use crate::plan::{self, AutoTable, Capabilities, Op, Request, AUTO_ITEMS, AUTO_RUNS};
use crate::rng::Rng;

/// Most time the measurement may take; cells not reached keep the default rule.
const BUDGET: Duration = Duration::from_millis(1000);

impl Device {
    /// [`Device::capabilities`] with the `auto` table measured: on first use per executor
    /// instance (at most about a second, or read from the cache file of this adapter).
    pub fn calibrated_capabilities(&self) -> Capabilities {
        let mut caps = self.base_capabilities();
        caps.auto = table(self, caps);
        caps
    }

    /// The capabilities a request with io backend `io` is planned with: measured for `auto`
    /// (which consults the table), plain for the others.
    pub fn capabilities_for(&self, io: IoBackend) -> Capabilities {
        if io == IoBackend::Auto {
            self.calibrated_capabilities()
        } else {
            self.capabilities()
        }
    }
}

/// The table of `device`: measured (or read from the cache file) on first use, then kept on
/// the instance.
fn table(device: &Device, caps: Capabilities) -> AutoTable {
    if let Some(t) = device.auto_slot().get() {
        return t;
    }
    let file = cache_file(device);
    let t = file
        .as_ref()
        .and_then(|f| std::fs::read_to_string(f).ok())
        .and_then(|s| serde_json::from_str::<AutoTable>(&s).ok())
        .unwrap_or_else(|| {
            let t = measure(device, caps).unwrap_or_else(|e| {
                log::warn!("auto: calibration on {} failed ({e}); using the default rule", device.name());
                AutoTable::DEFAULT
            });
            if let (Some(f), true) = (&file, t.calibrated) {
                let _ = f.parent().map(std::fs::create_dir_all);
                if let Err(e) = std::fs::write(f, serde_json::to_string(&t).unwrap_or_default()) {
                    log::debug!("auto: cannot write {}: {e}", f.display());
                }
            }
            t
        });
    device.auto_slot().set(t);
    t
}

/// `…/hicache-io/auto-<executor>-<hash of the adapter description>.json`, or `None` when
/// caching is off or there is no cache dir.
fn cache_file(device: &Device) -> Option<std::path::PathBuf> {
    if std::env::var("HICACHE_IO_AUTO_CACHE").is_ok_and(|v| v == "0") {
        return None;
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))?;
    // FNV-1a of the description: the adapter, driver and limits.
    // The crate version is in the hash too: a new release may move bytes at other speeds.
    let key = format!("{} {}", env!("CARGO_PKG_VERSION"), device.describe());
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    // The format version changes whenever the measurement does (v6: the cpu executor streams
    // large transfers), so old files are ignored.
    Some(base.join("hicache-io").join(format!("auto-v6-{}-{hash:016x}.json", device.name())))
}

/// Times `kernel` and `direct` loads of one layer for every cell of the table.
fn measure(device: &Device, caps: Capabilities) -> Result<AutoTable> {
    // Work already queued on the executor would be timed with ours.
    device.wait_idle()?;
    let start = Instant::now();
    let mut table = AutoTable { calibrated: true, ..AutoTable::DEFAULT };
    let mut rng = Rng::new(0x5eed);
    // Loads (one layer per step) first, then 4-layer backups; within each, the DSA and MLA
    // sizes first, so a spent budget leaves the least common cells on the default rule.
    let order = [4usize, 2, 1, 0, 3, 5];
    for (m, layers) in [(0usize, 1usize), (1, 4)] {
        for &i in &order {
            let item = AUTO_ITEMS[i];
            for (r, &run) in AUTO_RUNS.iter().enumerate() {
                if start.elapsed() > BUDGET {
                    log::info!("auto: calibration budget spent; remaining cells keep the default rule");
                    return Ok(table);
                }
                // About 2 MiB per transfer (128 to 2048 items, whole runs) from pools four times
                // larger, so that neither side runs from cache.
                let items = ((2 << 20) / (item * layers as u64)).clamp(128, 2048) / run * run;
                let slots = items * 4;
                let geometry = DeviceGeometry::new(PoolKind::Mla, item, slots, 1, LayerMap::new(layers))?;
                let pair = Arc::new(PoolPair::new(geometry, Layout::LayerFirst, slots, 1)?);
                let dev_bufs = (0..layers).map(|_| device.alloc(pair.device().layer_bytes())).collect::<Result<Vec<_>>>()?;
                let host_buf = device.alloc_host(pair.host().buffer_bytes())?;
                let runs = |rng: &mut Rng| -> Vec<i64> {
                    rng.distinct(slots / run, items / run).iter().flat_map(|b| (b * run..(b + 1) * run).map(|t| t as i64)).collect()
                };
                let (hi, di) = (runs(&mut rng), runs(&mut rng));
                let op = if layers == 1 { Op::Load { layer_id: 0, is_draft: false } } else { Op::Backup };
                let time_io = |io: IoBackend| -> Result<f64> {
                    let req = Request { op, io_backend: io, host_indices: &hi, device_indices: &di };
                    let p = plan::plan(Profile::Extended, &caps, device.id(), &pair, &req)?;
                    let bufs = Bindings { host: vec![&host_buf], device: vec![dev_bufs.iter().collect()], integrity: None };
                    // Stream-ordered executors (cuda) return once the work is queued: wait for it.
                    let run = || device.execute_unfaulted(&p, &bufs).and_then(|_| device.wait_idle());
                    run()?; // warm-up
                    let mut best = f64::MAX;
                    for _ in 0..3 {
                        let t = Instant::now();
                        run()?;
                        best = best.min(t.elapsed().as_secs_f64());
                    }
                    Ok(best)
                };
                let (kernel, direct) = (time_io(IoBackend::Kernel)?, time_io(IoBackend::Direct)?);
                // A clear winner (10 %) decides; within the noise of these machines the default rule
                // stays.
                if direct < 0.9 * kernel {
                    table.direct[m][i][r] = true;
                } else if kernel < 0.9 * direct {
                    table.direct[m][i][r] = false;
                }
            }
        }
    }
    log::info!("auto: calibrated {} in {:.0} ms", device.name(), start.elapsed().as_secs_f64() * 1e3);
    Ok(table)
}
