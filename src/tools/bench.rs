//! Throughput measurement shared by `hicache-io bench` and the criterion benches: GB/s of bytes
//! moved, beside the executor's own ceiling measured in the same run (one contiguous copy of the
//! same bytes), and the planning time as a share of the transfer.

use std::time::Duration;

use crate::error::Result;
use crate::exec::Device;
use crate::geometry::{IoBackend, LayerMap, Layout, PoolKind, Profile};
use crate::plan::{Op, Plan, Request};
use crate::pool::{DevicePool, DevicePoolConfig, HostPool, HostPoolConfig};
use crate::rng::Rng;
use crate::timing::time;

/// Which items a transfer touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pattern {
    /// Items `0..N` in order.
    Contiguous,
    /// N distinct items at random.
    Random,
    /// Runs of 4 consecutive items at random places.
    Runs4,
}

impl Pattern {
    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Contiguous => "contig",
            Pattern::Random => "random",
            Pattern::Runs4 => "runs4",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
/// What a benchmark cell moves.
pub enum BenchOp {
    /// One layer, host → device.
    Load,
    /// Every layer, device → host.
    Backup,
}

/// One benchmark cell. Items of 8448 B are DSA indexer pages (132 B/token × P = 64); other
/// sizes are MLA records with `P = 1` (each item its own page).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct BenchSpec {
    /// Item bytes.
    pub item: u64,
    /// Which items.
    pub pattern: Pattern,
    /// Items moved (N).
    pub items: u64,
    /// Layers of the pools (L).
    pub layers: usize,
    /// Load or backup.
    pub op: BenchOp,
    /// Host layout.
    pub layout: Layout,
    /// io backend.
    pub io: IoBackend,
    /// Item checksums in the host pool (the `extended` default), computed where the executor's
    /// copies can.
    pub checksums: bool,
}

impl std::fmt::Display for BenchSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let op = match self.op {
            BenchOp::Load => "load",
            BenchOp::Backup => "backup",
        };
        write!(f, "{op} {} {} {}B {} N={} L={}", self.layout, self.io, self.item, self.pattern.name(), self.items, self.layers)?;
        if !self.checksums {
            write!(f, " nosum")?;
        }
        Ok(())
    }
}

/// The paths worth timing: kernel on layer_first and page_first, direct on layer_first and
/// page_first_direct.
pub const PATHS: [(Layout, IoBackend); 4] = [
    (Layout::LayerFirst, IoBackend::Kernel),
    (Layout::PageFirst, IoBackend::Kernel),
    (Layout::LayerFirst, IoBackend::Direct),
    (Layout::PageFirstDirect, IoBackend::Direct),
];

/// The benchmark matrix. `quick`: random pages, N = 4096, L = 8, items 8448 / 1152 / 128 B.
pub fn specs(quick: bool) -> Vec<BenchSpec> {
    let mut v = Vec::new();
    let items: &[u64] = if quick { &[8448, 1152, 128] } else { &[8448, 1152, 656, 128] };
    let patterns: &[Pattern] = if quick { &[Pattern::Random] } else { &[Pattern::Contiguous, Pattern::Random, Pattern::Runs4] };
    let counts: &[u64] = if quick { &[4096] } else { &[256, 4096] };
    let layer_counts: &[usize] = if quick { &[8] } else { &[8, 61] };
    for &item in items {
        for &pattern in patterns {
            for &n in counts {
                for &layers in layer_counts {
                    for op in [BenchOp::Load, BenchOp::Backup] {
                        for (layout, io) in PATHS {
                            v.push(BenchSpec { item, pattern, items: n, layers, op, layout, io, checksums: true });
                        }
                    }
                }
            }
        }
    }
    v
}

/// What one cell measured. Times are medians over the repetitions.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchResult {
    /// Executor name.
    pub backend: &'static str,
    /// The cell.
    pub spec: BenchSpec,
    /// The io backend that ran (what `auto` chose).
    pub io_used: IoBackend,
    /// Bytes one transfer moves.
    pub bytes: u64,
    /// Median seconds of one transfer.
    pub transfer_s: f64,
    /// Bytes moved per second, in GB/s.
    pub gbps: f64,
    /// The executor's one-copy ceiling for the same bytes, in GB/s.
    pub ceiling_gbps: f64,
    /// `gbps / ceiling_gbps`.
    pub ratio: f64,
    /// Median seconds of planning the call.
    pub plan_s: f64,
    /// Planning time as a share of the transfer time.
    pub plan_share: f64,
}

/// A pool pair and the index lists of one cell.
pub struct Fixture {
    /// The device pool.
    pub dev: DevicePool<'static>,
    /// The host pool.
    pub host: HostPool<'static>,
    /// Host token indices.
    pub host_indices: Vec<i64>,
    /// Device token indices.
    pub device_indices: Vec<i64>,
    /// The operation.
    pub op: Op,
}

impl Fixture {
    /// Pools and indices for `spec` on `device`.
    pub fn new(device: &Device, spec: &BenchSpec, seed: u64) -> Result<Fixture> {
        let dsa = spec.item == 8448;
        let (kind, per_token, page) = if dsa { (PoolKind::DsaIndexer, 132, 64) } else { (PoolKind::Mla, spec.item, 1) };
        // 25% more slots than items, so random picks are sparse but pools stay small.
        let units = spec.items + spec.items / 4 + 4;
        let dev = DevicePool::new(
            device,
            &DevicePoolConfig { kind, bytes_per_token: per_token, slots: units, page_size: page, layers: LayerMap::new(spec.layers) },
        )?;
        let mut dev = dev;
        let mut host = HostPool::new(
            &dev,
            &HostPoolConfig {
                layout: spec.layout,
                size: units * page,
                head_num: 1,
                profile: Profile::Extended,
                integrity: Some(spec.checksums),
            },
        )?;
        let mut rng = Rng::new(seed);
        // Every page written: untouched memory may be the OS's shared zero page (cpu pools are
        // mapped lazily), which reads from cache and would flatter the numbers.
        let mut noise = |bytes: u64| -> Vec<u8> {
            let mut v = vec![0u8; bytes as usize];
            rng.fill(&mut v);
            v
        };
        let g = dev.geometry().clone();
        for c in 0..g.kind().components() {
            for s in 0..g.buffer_count() {
                dev.write_buffer(c, s, &noise(g.layer_bytes()))?;
            }
        }
        for c in 0..host.geometry().buffers() {
            host.write_buffer(c, &noise(host.geometry().buffer_bytes()))?;
        }
        let pick = |rng: &mut Rng| -> Vec<u64> {
            match spec.pattern {
                Pattern::Contiguous => (0..spec.items).collect(),
                Pattern::Random => rng.distinct(units - 1, spec.items),
                Pattern::Runs4 => rng
                    .distinct((units - 1) / 4, spec.items.div_ceil(4))
                    .iter()
                    .flat_map(|r| r * 4..r * 4 + 4)
                    .take(spec.items as usize)
                    .collect(),
            }
        };
        let expand = |units: Vec<u64>| units.iter().flat_map(|u| (u * page..(u + 1) * page).map(|t| t as i64)).collect::<Vec<_>>();
        let (hi, di) = (expand(pick(&mut rng)), expand(pick(&mut rng)));
        let op = match spec.op {
            BenchOp::Load => Op::Load { layer_id: spec.layers / 2, is_draft: false },
            BenchOp::Backup => Op::Backup,
        };
        if spec.op == BenchOp::Load && host.integrity_enabled() {
            // Loads verify recorded checksums (not unknown ones): back the items up first, by
            // whichever path the table allows for this layout.
            if host.backup_from_device_all_layer(&dev, &hi, &di, spec.io).is_err() {
                host.backup_from_device_all_layer(&dev, &hi, &di, IoBackend::Kernel)?;
            }
        }
        Ok(Fixture { dev, host, host_indices: hi, device_indices: di, op })
    }

    /// The plan of this fixture's call.
    pub fn plan(&self, io: IoBackend) -> Result<Plan> {
        self.host.plan(
            &self.dev,
            &Request { op: self.op, io_backend: io, host_indices: &self.host_indices, device_indices: &self.device_indices },
        )
    }

    /// Executes a plan of this fixture and waits for it.
    pub fn run(&mut self, plan: &Plan) -> Result<()> {
        match self.op {
            Op::Load { .. } => self.host.execute_load(&mut self.dev, plan)?,
            Op::Backup | Op::BackupLayer { .. } => self.host.execute_backup(&self.dev, plan)?,
        }
        self.dev.device().synchronize()
    }
}

/// What `hicache-io bench --pipeline` measured on one executor.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PipelineResult {
    /// Executor name.
    pub backend: &'static str,
    /// Layers loaded.
    pub layers: usize,
    /// Bytes per layer load.
    pub layer_bytes: u64,
    /// Stand-in compute per layer, seconds.
    pub compute_s: f64,
    /// Every layer loaded (synchronously), then every layer's compute.
    pub sequential_s: f64,
    /// Layers loaded layer by layer while each layer's compute waits only for its own layer.
    pub pipelined_s: f64,
    /// From issuing the loads to layer 0 being usable.
    pub first_layer_s: f64,
    /// Total load time (sequential run).
    pub load_s: f64,
    /// `(sequential − pipelined) / min(total load, total compute)`: 1 hides the shorter side
    /// completely, 0 hides nothing.
    pub overlap: f64,
    /// A backup of other pages issued right after the layer loads: seconds until it has landed
    /// when it queues behind them on one stream.
    pub backup_one_stream_s: f64,
    /// The same on a [`crate::Pipeline`]'s backup stream (cpu: its own worker; wgpu: the same
    /// queue, so no faster).
    pub backup_stream_s: f64,
    /// Bytes that backup moves.
    pub backup_bytes: u64,
}

/// A busy loop of `d` on this thread (the stand-in for a layer's forward pass).
fn spin(d: Duration) {
    let t = std::time::Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Layer-wise loading against load-then-compute: DSA indexer pages (8448 B) of `items` random
/// pages into `layers` layers; the stand-in compute is a busy loop on the calling thread of
/// `compute` per layer (`None`: as long as one layer's load, so neither side dominates). Times
/// are medians of 5 runs. The cpu executor copies with one thread fewer than the machine has in
/// both runs: the forward pass needs a core too, so that is the budget a serving engine gives it.
pub fn pipeline(device: &Device, layers: usize, items: u64, compute: Option<Duration>) -> Result<PipelineResult> {
    let cpu_budget;
    let device = match device {
        Device::Cpu(_) => {
            let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            cpu_budget = Device::cpu_with_threads(cores.saturating_sub(1).max(1));
            &cpu_budget
        }
        #[allow(unreachable_patterns)] // the cpu executor alone (no GPU features)
        other => other,
    };
    let spec = BenchSpec {
        item: 8448,
        pattern: Pattern::Random,
        items,
        layers,
        op: BenchOp::Load,
        layout: Layout::PageFirst,
        io: IoBackend::Kernel,
        checksums: true,
    };
    let mut fx = Fixture::new(device, &spec, 11)?;
    let (hi, di) = (fx.host_indices.clone(), fx.device_indices.clone());
    let load_all = |fx: &mut Fixture| -> Result<()> {
        for l in 0..layers {
            fx.host.load_to_device_per_layer(&mut fx.dev, &hi, &di, l, IoBackend::Kernel)?;
        }
        fx.dev.device().synchronize()
    };
    load_all(&mut fx)?; // warm-up
    const RUNS: usize = 5;
    let mut loads_s = Vec::new();
    for _ in 0..RUNS {
        let t = std::time::Instant::now();
        load_all(&mut fx)?;
        loads_s.push(t.elapsed().as_secs_f64());
    }
    let load_s = crate::timing::median(loads_s);
    let compute = compute.unwrap_or(Duration::from_secs_f64(load_s / layers as f64));
    let (mut seq, mut pipe, mut first) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let t = std::time::Instant::now();
        load_all(&mut fx)?;
        for _ in 0..layers {
            spin(compute);
        }
        seq.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        let loads = fx.host.load_layers(&mut fx.dev, &hi, &di, IoBackend::Kernel)?;
        for (i, l) in loads.layer_ids().into_iter().enumerate() {
            loads.wait_layer(l)?;
            if i == 0 {
                first.push(t.elapsed().as_secs_f64());
            }
            spin(compute);
        }
        loads.wait()?;
        pipe.push(t.elapsed().as_secs_f64());
    }
    let (sequential_s, pipelined_s, first_layer_s) =
        (crate::timing::median(seq), crate::timing::median(pipe), crate::timing::median(first));
    let (backup_one_stream_s, backup_stream_s, backup_bytes) = backup_latency(&mut fx, &hi, &di, RUNS)?;
    let compute_s = compute.as_secs_f64();
    let hidden = (sequential_s - pipelined_s) / load_s.min(compute_s * layers as f64);
    Ok(PipelineResult {
        backend: device.name(),
        layers,
        layer_bytes: items * 8448,
        compute_s,
        sequential_s,
        pipelined_s,
        first_layer_s,
        load_s,
        overlap: hidden,
        backup_one_stream_s,
        backup_stream_s,
        backup_bytes,
    })
}

/// A backup of pages the loads do not touch (up to 128 host and device pages each), issued
/// right after every layer's load: median seconds until it lands behind the loads on one
/// stream, and on a pipeline's backup stream; and its bytes.
fn backup_latency(fx: &mut Fixture, hi: &[i64], di: &[i64], runs: usize) -> Result<(f64, f64, u64)> {
    let page = fx.host.geometry().page_size().max(1) as i64;
    let units = fx.dev.geometry().slots() as i64;
    let free = |used: &[i64]| -> Vec<i64> {
        let used: std::collections::BTreeSet<i64> = used.iter().map(|t| t / page).collect();
        (0..units - 1).filter(|u| !used.contains(u)).take(128).collect()
    };
    let (hp, dp) = (free(hi), free(di));
    let n = hp.len().min(dp.len());
    let expand = |pages: &[i64]| pages[..n].iter().flat_map(|u| u * page..(u + 1) * page).collect::<Vec<i64>>();
    let (bhi, bdi) = (expand(&hp), expand(&dp));
    let (mut one, mut side) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = std::time::Instant::now();
        fx.host.load_layers(&mut fx.dev, hi, di, IoBackend::Kernel)?.wait()?;
        fx.host.backup_from_device_all_layer(&fx.dev, &bhi, &bdi, IoBackend::Kernel)?;
        fx.dev.device().synchronize()?;
        one.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        let mut pipe = fx.host.pipeline(&mut fx.dev)?;
        pipe.load_layers(hi, di, IoBackend::Kernel)?;
        let b = pipe.backup(&bhi, &bdi, IoBackend::Kernel)?;
        pipe.wait(b)?;
        side.push(t.elapsed().as_secs_f64());
        pipe.finish()?;
    }
    let bytes = (bdi.len() as u64 / page as u64) * fx.dev.geometry().item_bytes() * fx.dev.geometry().buffer_count() as u64;
    Ok((crate::timing::median(one), crate::timing::median(side), bytes))
}

/// One cell with item checksums and without, in one run: `(with, without)`, each the faster of
/// `rounds` interleaved measurements (alternating, so drift on a noisy machine hits both).
pub fn checksum_pair(device: &Device, spec: &BenchSpec, budget: Duration, rounds: usize) -> Result<(BenchResult, BenchResult)> {
    let (mut with, mut without): (Option<BenchResult>, Option<BenchResult>) = (None, None);
    let better = |a: Option<BenchResult>, b: BenchResult| match a {
        Some(a) if a.gbps >= b.gbps => Some(a),
        _ => Some(b),
    };
    for _ in 0..rounds.max(1) {
        without = better(without, run_spec(device, &BenchSpec { checksums: false, ..*spec }, budget)?);
        with = better(with, run_spec(device, &BenchSpec { checksums: true, ..*spec }, budget)?);
    }
    Ok((with.expect("one round ran"), without.expect("one round ran")))
}

/// Measures one cell: transfer, planning and the executor's one-copy ceiling, in one run.
pub fn run_spec(device: &Device, spec: &BenchSpec, budget: Duration) -> Result<BenchResult> {
    let mut fx = Fixture::new(device, spec, 7)?;
    let plan = fx.plan(spec.io)?;
    let bytes = plan.bytes();
    let io_used = plan.io_backend();
    let transfer_s = time(budget, || fx.run(&plan))?;
    let plan_s = time(budget / 4, || fx.plan(spec.io).map(|_| ()))?;
    drop(fx);
    let ceiling_s = device.time_one_copy(bytes, budget)?;
    let gbps = bytes as f64 / transfer_s / 1e9;
    let ceiling_gbps = bytes as f64 / ceiling_s / 1e9;
    Ok(BenchResult {
        backend: device.name(),
        spec: *spec,
        io_used,
        bytes,
        transfer_s,
        gbps,
        ceiling_gbps,
        ratio: gbps / ceiling_gbps,
        plan_s,
        plan_share: plan_s / transfer_s,
    })
}
