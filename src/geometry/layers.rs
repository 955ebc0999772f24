//! Which layers a device pool holds and how they map to host layers.

use crate::error::{Result, TransferError};

/// Most host layers (live target layers plus drafts) a pool may have. Real models have fewer
/// than 200; the bound keeps per-layer tables and buffer counts small and their arithmetic exact.
pub const MAX_LAYERS: usize = 1 << 16;

/// Which layers a device pool holds and how they map to host layers.
///
/// Device layer ids are global model layer ids `0..layer_num`; a layer-sharded pool owns
/// `owned.0..owned.1`; DSA skip-topk layers have no buffer. Draft (MTP) pools follow as extra
/// single-layer buffers. Host layers are the live target layers in order, then one per draft.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerMap {
    /// Target layers of the model (`layer_num` in sglang).
    pub layer_num: usize,
    /// The owned range `start..end` of a layer-sharded pool; `None` owns every layer.
    pub layer_shard: Option<(usize, usize)>,
    /// `skipped[l]`: DSA skip-topk layer (no buffer, never transferred). One entry per layer.
    pub skipped: Vec<bool>,
    /// Packed MTP draft pools, one host layer each.
    pub drafts: usize,
}

impl LayerMap {
    /// `layer_num` owned layers, none skipped, no drafts.
    pub fn new(layer_num: usize) -> Self {
        LayerMap { layer_num, layer_shard: None, skipped: vec![false; layer_num], drafts: 0 }
    }
    /// The owned range (every layer when not sharded).
    pub fn owned(&self) -> (usize, usize) {
        self.layer_shard.unwrap_or((0, self.layer_num))
    }
    /// Whether the pool owns a strict shard of the layers (backups go layer by layer).
    pub fn is_sharded(&self) -> bool {
        self.layer_shard.is_some()
    }
    /// Target layer ids that have a device buffer and a host layer, in order.
    pub fn live_layers(&self) -> Vec<usize> {
        let (start, end) = self.owned();
        (start..end).filter(|&l| !self.skipped[l]).collect()
    }
    /// How many target layers are live.
    pub fn live_count(&self) -> usize {
        let (start, end) = self.owned();
        self.skipped[start..end].iter().filter(|s| !**s).count()
    }
    /// Host layer (= device buffer slot) of a live target layer, `None` when the layer is not
    /// owned or skipped (sglang then returns without copying).
    pub fn target_slot(&self, layer_id: usize) -> Option<usize> {
        let (start, end) = self.owned();
        if layer_id < start || layer_id >= end || self.skipped[layer_id] {
            return None;
        }
        Some(self.skipped[start..layer_id].iter().filter(|s| !**s).count())
    }
    /// Host layer (= device buffer slot) of draft pool `k` (`layer_id = layer_num + k`).
    pub fn draft_slot(&self, k: usize) -> usize {
        self.live_count() + k
    }
    /// Host layer count `L`.
    pub fn host_layers(&self) -> usize {
        self.live_count() + self.drafts
    }
    /// Checks the map once; every count it reports afterwards is exact (no wrap).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TransferError::InvalidConfig(m));
        if self.layer_num == 0 {
            return bad("layer_num must be positive".into());
        }
        if self.skipped.len() != self.layer_num {
            return bad(format!("skip list has {} entries for {} layers", self.skipped.len(), self.layer_num));
        }
        if let Some((s, e)) = self.layer_shard {
            if s >= e || e > self.layer_num {
                return bad(format!("owned layer range {s}..{e} is empty or exceeds {} layers", self.layer_num));
            }
        }
        if self.drafts > MAX_LAYERS || self.live_count() + self.drafts > MAX_LAYERS {
            return bad(format!("{} live layers + {} drafts exceed the limit of {MAX_LAYERS} host layers", self.live_count(), self.drafts));
        }
        if self.host_layers() == 0 {
            return bad("the pool has no live layer".into());
        }
        Ok(())
    }
}
