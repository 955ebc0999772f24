//! The page objects an L3 store moves, and their sums: one API over the two ways a page is cut
//! into objects (one span per component; the unified key scheme's shares of it). Each call reads
//! the pages once:
//!
//! - [`HostPool::object_sums`]: each object's [`crate::integrity`] checksum;
//! - [`HostPool::put_object_sums`]: those and, per page, whether its bytes still match the item
//!   checksums its backup recorded (what a store needs before a put: a page damaged in host
//!   memory must not reach storage under a trailer of its own);
//! - [`HostPool::landed_object_sums`]: those after a get wrote the pages in place, with the
//!   pool's item checksums settled in the same pass (recorded for pages whose objects all verify,
//!   forgotten for the others);
//! - [`HostPool::stage_put`] / [`HostPool::land_staged`]: the same through the store's staging
//!   buffer, object `j` of the call at byte `j · stride` (each object and the trailer the store
//!   writes after it are one span there).
//!
//! Shapes: `indices` are host token indices, page `k` starting at `indices[k · P]`; objects come
//! page by page, in the order of [`HostPool::get_page_buffer_meta`] (components) or of the shares
//! given; `expected` and `eligible` hold one entry per object, the sums one per object, the page
//! verdicts one per page.

use super::{HostPool, SharedHostPool};
use crate::geometry::PageShare;
use crate::Result;

/// How a page is cut into the objects an L3 store moves.
#[derive(Clone, Copy, Debug)]
pub enum PageObjects<'a> {
    /// One object per component (K, then V): the page's span of each component buffer.
    Components,
    /// The given shares of the page, in order (the unified key scheme's objects; see
    /// [`PageShare`] for a share's byte order).
    Shares(&'a [PageShare]),
}

impl HostPool<'_> {
    /// Each object's checksum, keys seeded by `seed` (see the module docs).
    pub fn object_sums(&self, indices: &[i64], objects: PageObjects<'_>, seed: u64) -> Result<Vec<u64>> {
        match objects {
            PageObjects::Components => self.object_checksums(indices, seed),
            PageObjects::Shares(shares) => self.share_checksums(indices, shares, seed),
        }
    }

    /// Each object's checksum and, per page, whether it is intact, in one read (see the module
    /// docs). Returns (per object, per page).
    pub fn put_object_sums(&self, indices: &[i64], objects: PageObjects<'_>, seed: u64) -> Result<(Vec<u64>, Vec<bool>)> {
        match objects {
            PageObjects::Components => self.put_checksums(indices, seed),
            PageObjects::Shares(shares) => self.put_share_checksums(indices, shares, seed),
        }
    }

    /// After a get wrote the pages in place: each object's checksum, and the pool's item
    /// checksums settled in the same read (a page all of whose objects are `eligible` and match
    /// `expected` is recorded, every other page forgotten; its loads then read as unverified,
    /// never as corrupt).
    pub fn landed_object_sums(
        &self,
        indices: &[i64],
        objects: PageObjects<'_>,
        seed: u64,
        expected: &[u64],
        eligible: &[bool],
    ) -> Result<Vec<u64>> {
        match objects {
            PageObjects::Components => self.landed_checksums(indices, seed, expected, eligible),
            PageObjects::Shares(shares) => self.landed_share_checksums(indices, shares, seed, expected, eligible),
        }
    }
}

impl SharedHostPool {
    /// [`HostPool::object_sums`] (the pages held for reading).
    pub fn object_sums(&self, indices: &[i64], objects: PageObjects<'_>, seed: u64) -> Result<Vec<u64>> {
        let _held = self.pages(indices, false);
        self.pool.object_sums(indices, objects, seed)
    }
    /// [`HostPool::put_object_sums`] (the pages held for reading).
    pub fn put_object_sums(&self, indices: &[i64], objects: PageObjects<'_>, seed: u64) -> Result<(Vec<u64>, Vec<bool>)> {
        let _held = self.pages(indices, false);
        self.pool.put_object_sums(indices, objects, seed)
    }
    /// [`HostPool::landed_object_sums`] (the pages held for writing).
    pub fn landed_object_sums(
        &self,
        indices: &[i64],
        objects: PageObjects<'_>,
        seed: u64,
        expected: &[u64],
        eligible: &[bool],
    ) -> Result<Vec<u64>> {
        let _held = self.pages(indices, true);
        self.pool.landed_object_sums(indices, objects, seed, expected, eligible)
    }
    /// [`HostPool::stage_put`] (the pages held for reading).
    pub fn stage_put(
        &self,
        indices: &[i64],
        objects: PageObjects<'_>,
        seed: u64,
        staging: &mut [u8],
        stride: usize,
    ) -> Result<(Vec<u64>, Vec<bool>)> {
        let _held = self.pages(indices, false);
        self.pool.stage_put(indices, objects, seed, staging, stride)
    }
    /// [`HostPool::land_staged`] (the pages held for writing).
    #[allow(clippy::too_many_arguments)]
    pub fn land_staged(
        &self,
        indices: &[i64],
        objects: PageObjects<'_>,
        seed: u64,
        staging: &[u8],
        stride: usize,
        expected: &[u64],
        eligible: &[bool],
        write: &[bool],
    ) -> Result<Vec<u64>> {
        let _held = self.pages(indices, true);
        self.pool.land_staged(indices, objects, seed, staging, stride, expected, eligible, write)
    }
}
