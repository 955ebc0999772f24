//! Pool buffers: one storage buffer or segments of whole copy chunks, read and written through
//! the mapping where host pools are host-visible, through staging copies elsewhere.

use super::*;
use crate::error::{Result, TransferError};

/// A pool buffer of one executor instance: one storage buffer, or for a pool larger than the
/// adapter's largest buffer, segments of `seg` bytes (the last one shorter) that hold whole copy
/// chunks, so that no chunk straddles two. Sizes are rounded up to 4 bytes; `len` is the
/// requested size.
pub struct WgpuBuffer {
    pub(super) segments: Vec<wgpu::Buffer>,
    pub(super) seg: u64,
    pub(super) len: u64,
    pub(super) owner: u64,
}

impl WgpuBuffer {
    /// The (first) wgpu buffer; [`WgpuBuffer::segments`] lists all of a segmented pool's.
    pub fn raw(&self) -> &wgpu::Buffer {
        &self.segments[0]
    }
    /// The segments, in order: byte `o` of the pool is byte `o % seg` of segment `o / seg`.
    pub fn segments(&self) -> &[wgpu::Buffer] {
        &self.segments
    }
    /// Bytes per segment (every segment but the last).
    pub fn segment_bytes(&self) -> u64 {
        self.seg
    }
    pub(super) fn usage(&self) -> wgpu::BufferUsages {
        self.segments[0].usage()
    }
    /// `[offset, offset + len)` split at segment edges: `(segment, offset in it, bytes, offset
    /// in the span)`.
    pub(super) fn pieces(&self, offset: u64, len: u64) -> Vec<(usize, u64, u64, u64)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < len {
            let o = offset + at;
            let (k, within) = ((o / self.seg) as usize, o % self.seg);
            let n = (self.seg - within).min(len - at);
            out.push((k, within, n, at));
            at += n;
        }
        out
    }
    /// Wraps a caller's buffer created on `exec`'s device (a shared handle: the engine keeps
    /// using it). It needs `STORAGE | COPY_SRC | COPY_DST`; pools check that when they wrap it.
    /// Pools then refuse to mix it with any other executor instance.
    ///
    /// # Safety
    /// `buffer` must have been created by the `wgpu::Device` of `exec` (`exec.device()`). wgpu
    /// has no way to ask a buffer for its device, so this is the caller's promise, and a broken
    /// one is not caught: a buffer of another device makes wgpu-core panic, or writes land in
    /// an unrelated buffer of this device.
    pub unsafe fn wrap(exec: &WgpuExecutor, buffer: wgpu::Buffer) -> WgpuBuffer {
        let len = buffer.size();
        WgpuBuffer { segments: vec![buffer], seg: len.max(1), len, owner: exec.inner.id }
    }
}
/// The usages every pool buffer needs: storage for the shader, copy source and destination for
/// `direct` runs and host reads/writes.
pub const REQUIRED_USAGES: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

impl WgpuExecutor {
    /// A buffer holding `contents` (rounded up to 4 bytes): `create_buffer_init` without its
    /// panic when the device cannot map the new buffer (a lost device): an error instead.
    pub(super) fn buffer_with(&self, label: &str, contents: &[u8], usage: wgpu::BufferUsages) -> Result<wgpu::Buffer> {
        self.check_lost()?;
        let size = (contents.len() as u64).max(4).next_multiple_of(4);
        let buffer = self.inner.device.create_buffer(&wgpu::BufferDescriptor { label: Some(label), size, usage, mapped_at_creation: true });
        let padded;
        let data = if contents.len() as u64 == size {
            contents
        } else {
            padded = [contents, &[0u8; 4][..(size as usize - contents.len())]].concat();
            &padded
        };
        {
            let mut view = buffer.get_mapped_range_mut(..).map_err(|e| self.lost_or(err(format!("{label}: {e}"))))?;
            view.copy_from_slice(data);
        }
        buffer.unmap();
        Ok(buffer)
    }

    /// A zeroed pool buffer of `bytes` (rounded up to 4) with `usage`, in segments of `segment`
    /// bytes (the pool's choice, [`Capabilities::segment_bytes`]; one buffer when it covers the
    /// pool).
    pub(super) fn alloc_with(&self, bytes: u64, segment: u64, usage: wgpu::BufferUsages) -> Result<WgpuBuffer> {
        self.check_lost()?;
        let inner = &self.inner;
        let size = bytes.max(4).checked_next_multiple_of(4).ok_or_else(|| err("buffer size overflows"))?;
        let seg = if segment >= bytes { size } else { segment };
        if seg > inner.max_buffer || !seg.is_multiple_of(4) {
            return Err(TransferError::OutOfMemory {
                what: format!("one wgpu buffer on {}", inner.info.name),
                requested: seg,
                limit: format!("the adapter's largest buffer is {} bytes", inner.max_buffer),
            });
        }
        let count = size.div_ceil(seg);
        let scope = inner.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let segments: Vec<wgpu::Buffer> = (0..count)
            .map(|k| {
                inner.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("hicache-io pool"),
                    size: seg.min(size - k * seg),
                    usage,
                    mapped_at_creation: false,
                })
            })
            .collect();
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(TransferError::OutOfMemory { what: "wgpu buffer".into(), requested: size, limit: e.to_string() });
        }
        if count > 1 {
            log::debug!("wgpu: a {size}-byte pool in {count} segments of {seg} bytes");
        }
        Ok(WgpuBuffer { segments, seg, len: bytes, owner: inner.id })
    }

    pub(super) fn write_segment(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if buffer.usage().contains(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE) {
            return self.write_mapped(buffer, offset, data);
        }
        // `write_buffer` lands before the next submission: queued transfers go first.
        self.inner.submitter.drain();
        let start = offset / 4 * 4;
        let end = (offset + data.len() as u64).next_multiple_of(4);
        if start == offset && end == offset + data.len() as u64 {
            self.inner.queue.write_buffer(buffer, offset, data);
        } else {
            // write_buffer needs 4-byte spans: read-modify-write the edges.
            let mut span = vec![0u8; (end - start) as usize];
            self.read_raw(buffer, start, &mut span)?;
            span[(offset - start) as usize..][..data.len()].copy_from_slice(data);
            self.inner.queue.write_buffer(buffer, start, &span);
        }
        Ok(())
    }

    pub(super) fn read_segment(&self, buffer: &wgpu::Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        if buffer.usage().contains(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE) {
            return self.read_mapped(buffer, offset, out);
        }
        let start = offset / 4 * 4;
        let end = (offset + out.len() as u64).next_multiple_of(4);
        let mut span = vec![0u8; (end - start) as usize];
        self.read_raw(buffer, start, &mut span)?;
        out.copy_from_slice(&span[(offset - start) as usize..][..out.len()]);
        Ok(())
    }

    /// Maps `[start, end)` of a mappable (host-visible) buffer (`start` a multiple of 8, `end`
    /// of 4), runs `f` on it and unmaps. The submit queue is drained first and submissions from
    /// every thread wait on the map lock meanwhile; `map_async` waits for the GPU work already
    /// submitted that uses the buffer. So a mapped pool is never bound for GPU work, and every
    /// path out of here leaves it unmapped.
    fn mapped<T>(
        &self,
        buffer: &wgpu::Buffer,
        start: u64,
        end: u64,
        mode: wgpu::MapMode,
        f: impl FnOnce(&wgpu::BufferSlice<'_>) -> Result<T>,
    ) -> Result<T> {
        self.inner.submitter.drain();
        let _exclusive = self.inner.map_lock.write().unwrap_or_else(|e| e.into_inner());
        let scope = self.inner.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let slice = buffer.slice(start..end);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(mode, move |r| {
            let _ = tx.send(r);
        });
        // Poll without draining the submit thread (it waits on the map lock).
        let mapped = self.wait_index(None).and_then(|_| rx.recv_timeout(WAIT).map_err(|e| err(format!("map_async: {e}"))));
        let r = match mapped {
            Ok(Ok(())) => {
                let r = f(&slice);
                buffer.unmap();
                r
            }
            // Never mapped: nothing to undo.
            Ok(Err(e)) => Err(err(format!("map_async: {e}"))),
            // Still pending: unmapping cancels it.
            Err(e) => {
                buffer.unmap();
                Err(e)
            }
        };
        let _ = pollster::block_on(scope.pop());
        r
    }

    /// The map-aligned span around `[offset, offset + len)`.
    fn map_span(buffer: &wgpu::Buffer, offset: u64, len: u64) -> (u64, u64) {
        let start = offset / wgpu::MAP_ALIGNMENT * wgpu::MAP_ALIGNMENT;
        (start, (offset + len).next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT).min(buffer.size()))
    }

    /// Reads through the mapping of a host-visible buffer (no staging copy).
    fn read_mapped(&self, buffer: &wgpu::Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        let (start, end) = Self::map_span(buffer, offset, out.len() as u64);
        self.mapped(buffer, start, end, wgpu::MapMode::Read, |slice| {
            let view = slice.get_mapped_range().map_err(|e| err(format!("get_mapped_range: {e}")))?;
            let at = (offset - start) as usize;
            out.copy_from_slice(&view[at..at + out.len()]);
            Ok(())
        })
    }

    /// Writes through the mapping of a host-visible buffer (no staging copy). The mapping is
    /// write-only: a span that does not start and end on map boundaries is read first and
    /// written whole.
    fn write_mapped(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        let (start, end) = Self::map_span(buffer, offset, data.len() as u64);
        let patched;
        let span: &[u8] = if start == offset && end == offset + data.len() as u64 {
            data
        } else {
            let mut whole = vec![0u8; (end - start) as usize];
            self.read_mapped(buffer, start, &mut whole)?;
            whole[(offset - start) as usize..][..data.len()].copy_from_slice(data);
            patched = whole;
            &patched
        };
        self.mapped(buffer, start, end, wgpu::MapMode::Write, |slice| {
            let mut view = slice.get_mapped_range_mut().map_err(|e| err(format!("get_mapped_range_mut: {e}")))?;
            view.copy_from_slice(span);
            Ok(())
        })
    }

    /// Reads a 4-byte aligned span through a MAP_READ staging buffer.
    fn read_raw(&self, buffer: &wgpu::Buffer, offset: u64, out: &mut [u8]) -> Result<()> {
        let size = out.len() as u64;
        let staging = self.inner.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("hicache-io readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.submit(|enc| {
            enc.copy_buffer_to_buffer(buffer, offset, &staging, 0, size);
            Ok(())
        })?;
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv_timeout(WAIT).map_err(|e| err(format!("map_async: {e}")))?.map_err(|e| err(format!("map_async: {e}")))?;
        {
            let view = staging.get_mapped_range(..).map_err(|e| err(format!("get_mapped_range: {e}")))?;
            out.copy_from_slice(&view);
        }
        staging.unmap();
        Ok(())
    }
}
