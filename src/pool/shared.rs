//! Pools shared by threads, as an engine's cache controller shares them: loads on one thread,
//! backups on another, page reads and writes for an L3 store on a third.
//!
//! Every call says what it touches of each pool (layers and pages, read or written) and waits
//! only for calls in flight, or waiting before it, whose claims conflict with its own: a backup
//! of pages a load is writing waits for that load, a backup of other pages runs beside it. A
//! call claims the device pool before the host pool and holds both until it returns, so two
//! calls never wait for each other in a cycle; conflicting calls run in the order they arrived,
//! so a stream of readers cannot starve a writer.

use std::sync::{Condvar, Mutex, MutexGuard};

use super::*;
use crate::error::Result;
use crate::exec::Device;
use crate::geometry::{DeviceGeometry, IoBackend, PoolPair};
use crate::integrity::IntegrityStats;
use crate::plan::{Claim, Op, Request};

/// The claims admitted on one pool, and the calls waiting for theirs.
#[derive(Default)]
struct Claims {
    state: Mutex<ClaimState>,
    changed: Condvar,
}

#[derive(Default)]
struct ClaimState {
    next: u64,
    /// `(arrival, claim, admitted)` in arrival order.
    entries: Vec<(u64, Claim, bool)>,
}

/// An admitted claim; dropping it lets the calls it held back in.
pub(super) struct Held<'a> {
    claims: &'a Claims,
    id: u64,
}

impl Claims {
    fn lock(&self) -> MutexGuard<'_, ClaimState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until no admitted claim and no claim that arrived earlier conflicts with `claim`,
    /// then admits it.
    fn admit(&self, claim: Claim) -> Held<'_> {
        let mut st = self.lock();
        let id = st.next;
        st.next += 1;
        st.entries.push((id, claim, false));
        loop {
            let mine = st.entries.iter().position(|e| e.0 == id).expect("a waiting claim stays listed");
            let (before, rest) = st.entries.split_at(mine);
            if !before.iter().any(|e| e.1.conflicts(&rest[0].1)) {
                st.entries[mine].2 = true;
                return Held { claims: self, id };
            }
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Claims admitted now (test support).
    fn admitted(&self) -> usize {
        self.lock().entries.iter().filter(|e| e.2).count()
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut st = self.claims.lock();
        st.entries.retain(|e| e.0 != self.id);
        drop(st);
        self.claims.changed.notify_all();
    }
}

/// A [`DevicePool`] shared by threads (see the module docs): loads into it through
/// [`SharedHostPool`], its buffers read and written whole.
pub struct SharedDevicePool {
    pool: DevicePool<'static>,
    claims: Claims,
}

/// A [`HostPool`] shared by threads, with the sglang-shaped calls taking `&self`: calls on
/// disjoint layers or pages run at once, conflicting ones in arrival order.
pub struct SharedHostPool {
    pub(super) pool: HostPool<'static>,
    claims: Claims,
}

/// A claim held on purpose (test support): calls that conflict with it wait until it drops.
pub struct Hold<'a>(#[allow(dead_code)] Held<'a>);

impl SharedDevicePool {
    /// Shares `pool`.
    pub fn new(pool: DevicePool<'static>) -> SharedDevicePool {
        SharedDevicePool { pool, claims: Claims::default() }
    }
    /// The pool's shape.
    pub fn geometry(&self) -> &DeviceGeometry {
        self.pool.geometry()
    }
    /// The executor instance the pool lives on.
    pub fn device(&self) -> &Device {
        self.pool.device()
    }
    /// [`DevicePool::read_buffer`], after the calls writing the pool.
    pub fn read_buffer(&self, comp: usize, slot: usize) -> Result<Vec<u8>> {
        let _held = self.claims.admit(Claim::all(false));
        self.pool.read_buffer(comp, slot)
    }
    /// [`DevicePool::write_buffer`], after every call touching the pool.
    pub fn write_buffer(&self, comp: usize, slot: usize, data: &[u8]) -> Result<()> {
        let _held = self.claims.admit(Claim::all(true));
        self.pool.write_device_buffer(comp, slot, data)
    }
    /// Holds the pages starting at device tokens `indices` of every layer (`write`: as a load
    /// would) until the returned guard drops; for tests of what waits for what. A thread holding
    /// it must make no call on these pools itself (it could wait for a call that waits for it).
    #[doc(hidden)]
    pub fn hold_pages(&self, indices: &[i64], write: bool) -> Hold<'_> {
        Hold(self.claims.admit(Claim::pages(indices, self.pool.geometry().page_size(), write)))
    }
    /// Calls admitted on the pool now.
    pub fn calls_in_flight(&self) -> usize {
        self.claims.admitted()
    }
}

impl SharedHostPool {
    /// A host pool for `device_pool` (see [`HostPool::new`]), shared.
    pub fn new(device_pool: &SharedDevicePool, config: &HostPoolConfig) -> Result<SharedHostPool> {
        Ok(SharedHostPool { pool: HostPool::new(&device_pool.pool, config)?, claims: Claims::default() })
    }
    /// The two pools' shapes.
    pub fn pair(&self) -> &PoolPair {
        self.pool.pair()
    }
    /// The executor instance the pool lives on.
    pub fn device(&self) -> &Device {
        self.pool.device()
    }

    /// Plans (nothing waits for a call that is refused), claims both pools, then runs.
    fn transfer(
        &self,
        device_pool: &SharedDevicePool,
        op: Op,
        io_backend: IoBackend,
        host_indices: &[i64],
        device_indices: &[i64],
    ) -> Result<()> {
        let req = Request { op, io_backend, host_indices, device_indices };
        let plan = self.pool.plan(&device_pool.pool, &req)?;
        let (host, device) = Claim::of(&plan, &req);
        let _device = device_pool.claims.admit(device);
        let _host = self.claims.admit(host);
        self.pool.execute(&device_pool.pool, &plan)
    }

    /// [`HostPool::load_to_device_per_layer`].
    pub fn load_to_device_per_layer(
        &self,
        device_pool: &SharedDevicePool,
        host_indices: &[i64],
        device_indices: &[i64],
        layer_id: usize,
        io_backend: IoBackend,
    ) -> Result<()> {
        self.transfer(device_pool, Op::Load { layer_id, is_draft: false }, io_backend, host_indices, device_indices)
    }
    /// [`HostPool::load_draft_to_device`].
    pub fn load_draft_to_device(
        &self,
        device_pool: &SharedDevicePool,
        host_indices: &[i64],
        device_indices: &[i64],
        layer_id: usize,
        io_backend: IoBackend,
    ) -> Result<()> {
        self.transfer(device_pool, Op::Load { layer_id, is_draft: true }, io_backend, host_indices, device_indices)
    }
    /// [`HostPool::backup_from_device_all_layer`].
    pub fn backup_from_device_all_layer(
        &self,
        device_pool: &SharedDevicePool,
        host_indices: &[i64],
        device_indices: &[i64],
        io_backend: IoBackend,
    ) -> Result<()> {
        self.transfer(device_pool, Op::Backup, io_backend, host_indices, device_indices)
    }
    /// [`HostPool::backup_from_device_per_layer`].
    pub fn backup_from_device_per_layer(
        &self,
        device_pool: &SharedDevicePool,
        host_indices: &[i64],
        device_indices: &[i64],
        layer_id: usize,
        is_draft: bool,
        io_backend: IoBackend,
    ) -> Result<()> {
        self.transfer(device_pool, Op::BackupLayer { layer_id, is_draft }, io_backend, host_indices, device_indices)
    }

    /// The claim on the pages starting at host tokens `indices`, every layer.
    pub(super) fn pages(&self, indices: &[i64], write: bool) -> Held<'_> {
        self.claims.admit(Claim::pages(indices, self.pool.pair().host().page_size(), write))
    }
    /// [`HostPool::get_data_page`].
    pub fn get_data_page(&self, index: i64) -> Result<Vec<u8>> {
        let _held = self.pages(&[index], false);
        self.pool.get_data_page(index)
    }
    /// [`HostPool::get_dummy_flat_data_page`].
    pub fn get_dummy_flat_data_page(&self) -> Result<Vec<u8>> {
        self.pool.get_dummy_flat_data_page()
    }
    /// [`HostPool::set_from_flat_data_page`].
    pub fn set_from_flat_data_page(&self, index: i64, data: &[u8]) -> Result<()> {
        let _held = self.pages(&[index], true);
        self.pool.set_page(index, data)
    }
    /// [`HostPool::set_from_flat_data_page_checked`].
    pub fn set_from_flat_data_page_checked(&self, index: i64, data: &[u8], checksums: &[Option<u64>]) -> Result<()> {
        let _held = self.pages(&[index], true);
        self.pool.set_page_checked(index, data, checksums)
    }
    /// [`HostPool::get_page_buffer_meta`] (it names bytes, it reads none).
    pub fn get_page_buffer_meta(&self, indices: &[i64]) -> Result<Vec<(usize, u64, u64)>> {
        self.pool.get_page_buffer_meta(indices)
    }
    /// [`HostPool::pages_intact`].
    pub fn pages_intact(&self, indices: &[i64]) -> Result<Vec<bool>> {
        let _held = self.pages(indices, false);
        self.pool.pages_intact(indices)
    }
    /// [`HostPool::recompute_page_checksums`] for the pages starting at each of `indices`.
    pub fn recompute_page_checksums(&self, indices: &[i64]) -> Result<()> {
        let _held = self.pages(indices, true);
        self.pool.record_page_checksums(indices)
    }
    /// [`HostPool::forget_page_checksums`] for the pages starting at each of `indices`.
    pub fn forget_page_checksums(&self, indices: &[i64]) -> Result<()> {
        let _held = self.pages(indices, true);
        indices.iter().try_for_each(|&i| self.pool.forget_checksums_of_page(i))
    }
    /// [`HostPool::page_checksums`] (after the calls writing the page).
    pub fn page_checksums(&self, index: i64) -> Result<Vec<Option<u64>>> {
        let _held = self.pages(&[index], false);
        self.pool.page_checksums(index)
    }
    /// [`HostPool::read_buffer`], after the calls writing the pool.
    pub fn read_buffer(&self, comp: usize) -> Result<Vec<u8>> {
        let _held = self.claims.admit(Claim::all(false));
        self.pool.read_buffer(comp)
    }
    /// [`HostPool::write_buffer`], after every call touching the pool.
    pub fn write_buffer(&self, comp: usize, data: &[u8]) -> Result<()> {
        let _held = self.claims.admit(Claim::all(true));
        self.pool.write_host_buffer(comp, data)
    }
    /// [`HostPool::inject_host_corruption`], after every call touching the pool.
    pub fn inject_host_corruption(&self, comp: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        let _held = self.claims.admit(Claim::all(true));
        self.pool.corrupt_host(comp, offset, bytes)
    }
    /// [`HostPool::host_span`].
    pub fn host_span(&self, comp: usize) -> Result<Option<(u64, u64)>> {
        self.pool.host_span(comp)
    }
    /// [`HostPool::integrity_enabled`].
    pub fn integrity_enabled(&self) -> bool {
        self.pool.integrity_enabled()
    }
    /// [`HostPool::integrity_stats`].
    pub fn integrity_stats(&self) -> Option<IntegrityStats> {
        self.pool.integrity_stats()
    }
    /// Holds the pages starting at host tokens `indices` of every layer (`write`: as a backup
    /// would) until the returned guard drops; for tests of what waits for what. A thread holding
    /// it must make no call on these pools itself (it could wait for a call that waits for it).
    #[doc(hidden)]
    pub fn hold_pages(&self, indices: &[i64], write: bool) -> Hold<'_> {
        Hold(self.pages(indices, write))
    }
    /// Calls admitted on the pool now.
    pub fn calls_in_flight(&self) -> usize {
        self.claims.admitted()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    fn page(p: i64, write: bool) -> Claim {
        Claim::pages(&[p * 4], 4, write)
    }

    /// Admits `claim` on another thread; the flag says when it got in.
    fn admit_in_thread(claims: &Arc<Claims>, claim: Claim, release: Arc<AtomicBool>) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
        let (c, got) = (claims.clone(), Arc::new(AtomicBool::new(false)));
        let flag = got.clone();
        let t = std::thread::spawn(move || {
            let _held = c.admit(claim);
            flag.store(true, Ordering::SeqCst);
            while !release.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        (got, t)
    }

    fn eventually(flag: &AtomicBool) -> bool {
        (0..2000).any(|_| flag.load(Ordering::SeqCst) || (std::thread::sleep(Duration::from_millis(1)), false).1)
    }

    #[test]
    fn disjoint_claims_run_together_and_conflicting_ones_wait_in_order() {
        let claims = Arc::new(Claims::default());
        let held = claims.admit(page(0, true)); // a load writing page 0
        let go = Arc::new(AtomicBool::new(true));
        // A writer of page 1 and two readers of page 0 get in beside it... the readers do not.
        let (other_page, t1) = admit_in_thread(&claims, page(1, true), go.clone());
        assert!(eventually(&other_page), "a claim on another page waited");
        t1.join().unwrap();
        let (reader, t2) = admit_in_thread(&claims, page(0, false), go.clone());
        std::thread::sleep(Duration::from_millis(50));
        assert!(!reader.load(Ordering::SeqCst), "a reader of a page being written got in");
        // A reader of another page arriving after the waiting reader is not held back by it.
        let (free, t3) = admit_in_thread(&claims, page(2, false), go.clone());
        assert!(eventually(&free));
        t3.join().unwrap();
        drop(held);
        assert!(eventually(&reader), "the reader never got in");
        t2.join().unwrap();
        assert_eq!(claims.admitted(), 0);
    }

    #[test]
    fn a_waiting_writer_is_not_overtaken_by_later_readers() {
        let claims = Arc::new(Claims::default());
        let first = claims.admit(page(3, false));
        let release = Arc::new(AtomicBool::new(false));
        let (writer, tw) = admit_in_thread(&claims, page(3, true), release.clone());
        std::thread::sleep(Duration::from_millis(20));
        let (reader, tr) = admit_in_thread(&claims, page(3, false), Arc::new(AtomicBool::new(true)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!writer.load(Ordering::SeqCst) && !reader.load(Ordering::SeqCst));
        drop(first);
        assert!(eventually(&writer));
        std::thread::sleep(Duration::from_millis(20));
        assert!(!reader.load(Ordering::SeqCst), "a later reader overtook the waiting writer");
        release.store(true, Ordering::SeqCst);
        tw.join().unwrap();
        assert!(eventually(&reader));
        tr.join().unwrap();
    }

    #[test]
    fn claims_conflict_only_on_a_common_layer_and_page_with_a_writer() {
        assert!(!page(1, false).conflicts(&page(1, false)));
        assert!(page(1, true).conflicts(&page(1, false)));
        assert!(!page(1, true).conflicts(&page(2, true)));
        assert!(Claim::all(false).conflicts(&page(7, true)));
        assert!(!Claim::all(false).conflicts(&Claim::all(false)));
    }
}
