//! The backend interface: where buffers live and where ops run.
//!
//! [`Backend::Cpu`] runs every op's plain reference (the contract evaluated on the host);
//! `Backend::Cuda` (feature `cuda`) runs the NVRTC kernels and cuBLAS. Buffers are typed
//! ([`Element`]: bf16, f16, f32, i32), flat, and belong to the backend that made them; an op
//! refuses a buffer from another backend with [`OpsError::WrongBackend`].
//!
//! Ops are free functions `op::run(&Backend, inputs.., outputs.., &Params)`: they validate every
//! shape and parameter before touching an output, so a refused call leaves all outputs as they
//! were.

use crate::{Element, OpsError, Result};

/// Which implementation runs the ops.
#[derive(Clone, Debug, Default)]
pub enum Backend {
    /// The host reference implementation (always available).
    #[default]
    Cpu,
    /// An NVIDIA GPU through cudarc (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaBackend),
}

/// Storage of a [`Buffer`].
#[derive(Debug)]
pub(crate) enum Storage<T: Element> {
    /// Host memory.
    Host(Vec<T>),
    /// Host memory the caller owns, read-only (a [`Borrowed`] view; the pointer is valid and
    /// unaliased by writers for the view's lifetime).
    HostBorrowed(*const T, usize),
    /// Device memory and the logical length (an empty buffer holds a 1-element allocation,
    /// since the driver refuses zero-byte allocations).
    #[cfg(feature = "cuda")]
    Device(cudarc::driver::CudaSlice<T>, usize),
    /// Device memory the caller owns, read-only (a [`Borrowed`] view): never freed here.
    #[cfg(feature = "cuda")]
    DeviceBorrowed(crate::cuda::BorrowedSlice<T>, usize),
}

/// A flat, typed array owned by one backend (or, inside a [`Borrowed`] view, memory the
/// caller owns).
#[derive(Debug)]
pub struct Buffer<T: Element> {
    pub(crate) storage: Storage<T>,
}

// SAFETY: the owned storages are Send + Sync already; a borrowed storage is a read-only view
// of `[T]` (`T: Sync`, as every `Element` is) that only a `Borrowed<'a, T>` holds, which
// never hands out the `Buffer` by value, so sharing or sending it is sharing `&'a [T]`.
unsafe impl<T: Element> Send for Buffer<T> {}
// SAFETY: as above.
unsafe impl<T: Element> Sync for Buffer<T> {}

/// A read-only view of memory the caller owns (a host slice on the CPU backend, a device
/// range on CUDA) that every op and buffer operation reads like a `&Buffer<T>` (it
/// dereferences to one): the way an engine lends its target's embedding, output head,
/// shortlist or verify outputs to these crates without a copy. Nothing is ever written
/// through it (the `host_mut` / `device_mut` accessors refuse it) and dropping it frees
/// nothing.
///
/// Made by [`Borrowed::host`] (a slice, safe), `Borrowed::cuda` (a cudarc slice or view of
/// the backend's context, safe) or the one unsafe constructor [`Borrowed::from_raw`].
#[derive(Debug)]
pub struct Borrowed<'a, T: Element> {
    buf: Buffer<T>,
    _lent: std::marker::PhantomData<&'a [T]>,
}

impl<T: Element> std::ops::Deref for Borrowed<'_, T> {
    type Target = Buffer<T>;
    fn deref(&self) -> &Buffer<T> {
        &self.buf
    }
}

impl<'a, T: Element> Borrowed<'a, T> {
    /// The view over a borrowed storage.
    fn over(storage: Storage<T>) -> Self {
        Borrowed {
            buf: Buffer { storage },
            _lent: std::marker::PhantomData,
        }
    }

    /// A view of host memory, for the CPU backend.
    pub fn host(data: &'a [T]) -> Self {
        Self::over(Storage::HostBorrowed(data.as_ptr(), data.len()))
    }

    /// A view of `len` elements of `T` at address `addr`: a host address on
    /// [`Backend::Cpu`], a device address (`CUdeviceptr`) on CUDA.
    ///
    /// Checked (an [`OpsError::Borrow`] names what failed): the address is not null (unless
    /// `len` is 0) and is aligned to `T` on the host and to 16 bytes on a device (what the
    /// kernels' vector and TMA loads need; `cudaMalloc` gives 256); on CUDA the driver knows
    /// the address as device memory of the backend's device and the whole range
    /// `[addr, addr + len * size_of::<T>())` lies inside one allocation.
    ///
    /// # Safety
    ///
    /// For the lifetime `'a` the caller guarantees that:
    /// - the memory stays allocated and holds `len` valid `T` (not freed, not remapped);
    /// - nothing writes it while any op may read it (no host write, no kernel of another
    ///   stream; on the backend's own stream, work queued before an op is ordered before it);
    /// - on CUDA, it is accessible from the backend's context (allocated in that context,
    ///   or through a context of the same device sharing it, e.g. the primary context), and
    ///   it outlives every op queued on the stream that reads it (drop the view only after
    ///   those have run, e.g. after a synchronize or an event the host waits for).
    pub unsafe fn from_raw(be: &Backend, addr: u64, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| OpsError::Borrow {
                problem: format!("{len} x {} overflows the address space", T::DTYPE),
            })?;
        match be {
            Backend::Cpu => {
                let align = std::mem::align_of::<T>() as u64;
                if len > 0 && (addr == 0 || !addr.is_multiple_of(align)) {
                    return Err(OpsError::Borrow {
                        problem: format!(
                            "host address {addr:#x} is null or not aligned to {align} bytes ({})",
                            T::DTYPE
                        ),
                    });
                }
                if bytes > isize::MAX as usize {
                    return Err(OpsError::Borrow {
                        problem: format!("{bytes} bytes exceed isize::MAX"),
                    });
                }
                Ok(Self::over(Storage::HostBorrowed(addr as *const T, len)))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                // SAFETY: forwarded from this function's contract.
                let slice = unsafe { c.borrow_range::<T>(addr, len, bytes)? };
                Ok(Self::over(Storage::DeviceBorrowed(slice, len)))
            }
        }
    }
}

/// A buffer a component either owns or borrows from its host (e.g. the target parts an
/// engine lends the draft): reads are the same either way (it dereferences to a `Buffer`).
#[derive(Debug)]
pub enum Held<'a, T: Element> {
    /// Allocated on (and freed by) the backend.
    Owned(Buffer<T>),
    /// The host's memory, read-only.
    Borrowed(Borrowed<'a, T>),
}

impl<T: Element> Held<'_, T> {
    /// Bytes this holder allocated (0 for borrowed memory).
    pub fn owned_bytes(&self) -> u64 {
        match self {
            Held::Owned(b) => (b.len() * std::mem::size_of::<T>()) as u64,
            Held::Borrowed(_) => 0,
        }
    }
}

impl<T: Element> std::ops::Deref for Held<'_, T> {
    type Target = Buffer<T>;
    fn deref(&self) -> &Buffer<T> {
        match self {
            Held::Owned(b) => b,
            Held::Borrowed(b) => b,
        }
    }
}

impl<T: Element> From<Buffer<T>> for Held<'_, T> {
    fn from(b: Buffer<T>) -> Self {
        Held::Owned(b)
    }
}

impl<'a, T: Element> From<Borrowed<'a, T>> for Held<'a, T> {
    fn from(b: Borrowed<'a, T>) -> Self {
        Held::Borrowed(b)
    }
}

#[cfg(feature = "cuda")]
impl<'a, T: Element> Borrowed<'a, T> {
    /// A view of a cudarc slice or view (`&CudaSlice<T>`, `&CudaView<'_, T>`) allocated in
    /// the context of `be` (a CUDA backend), checked as [`Self::from_raw`] does. The borrow
    /// keeps Rust code from writing or freeing it for `'a`; the backend's stream is ordered
    /// after the slice's last recorded write (cudarc event tracking) when the view is made.
    /// Kernels of other streams that write it while ops read it remain the caller's to
    /// avoid, as with any cudarc slice.
    pub fn cuda<S>(be: &Backend, slice: &'a S) -> Result<Self>
    where
        S: cudarc::driver::DevicePtr<T>,
    {
        let Backend::Cuda(c) = be else {
            return Err(OpsError::WrongBackend {
                op: "borrow",
                tensor: "slice",
                expected: "cpu",
                found: "cuda",
            });
        };
        let len = slice.len();
        let (addr, _order) = slice.device_ptr(c.stream());
        // SAFETY: `slice` is a live cudarc allocation borrowed for `'a` (so it is neither
        // freed nor written through Rust meanwhile); `from_raw` checks it belongs to this
        // backend's device and that the range fits the allocation.
        unsafe { Self::from_raw(be, addr, len) }
    }
}

impl<T: Element> Buffer<T> {
    /// A host buffer holding `data` (the CPU backend's buffers are exactly these).
    pub fn from_vec(data: Vec<T>) -> Self {
        Buffer {
            storage: Storage::Host(data),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.storage {
            Storage::Host(v) => v.len(),
            Storage::HostBorrowed(_, len) => *len,
            #[cfg(feature = "cuda")]
            Storage::Device(_, len) | Storage::DeviceBorrowed(_, len) => *len,
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements the buffer's own allocation holds (`>= len()`; a [`Borrowed`] view: its
    /// length). [`Self::set_len`] moves the length within it.
    pub fn capacity(&self) -> usize {
        match &self.storage {
            Storage::Host(v) => v.capacity(),
            Storage::HostBorrowed(_, len) => *len,
            #[cfg(feature = "cuda")]
            Storage::Device(d, _) => d.len(),
            #[cfg(feature = "cuda")]
            Storage::DeviceBorrowed(_, len) => *len,
        }
    }

    /// Make the buffer `len` elements long within its allocation, without allocating or
    /// moving it (its address stays, so a captured CUDA graph still finds it): how a
    /// workspace planned for its largest shape runs a smaller one (ops check exact lengths).
    /// The first `min(old, len)` elements keep their values; elements a growth exposes hold
    /// unspecified values (zeros on the CPU, what the device memory held on CUDA).
    ///
    /// Errors: [`OpsError::Length`] when `len` exceeds [`Self::capacity`];
    /// [`OpsError::ReadOnly`] for a [`Borrowed`] view (its length is the lender's).
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        let cap = self.capacity();
        if self.is_borrowed() {
            return Err(OpsError::ReadOnly {
                op: "set_len",
                tensor: "buf",
            });
        }
        if len > cap {
            return Err(OpsError::Length {
                op: "set_len",
                tensor: "buf",
                expected: cap,
                shape: "at most the buffer's capacity".into(),
                found: len,
            });
        }
        match &mut self.storage {
            // Within the capacity: `resize` never reallocates.
            Storage::Host(v) => v.resize(len, T::default()),
            #[cfg(feature = "cuda")]
            Storage::Device(_, l) => *l = len,
            _ => {}
        }
        Ok(())
    }

    /// The name of the backend the buffer lives on (`"cpu"` or `"cuda"`).
    pub fn backend_name(&self) -> &'static str {
        match &self.storage {
            Storage::Host(_) | Storage::HostBorrowed(..) => "cpu",
            #[cfg(feature = "cuda")]
            Storage::Device(..) | Storage::DeviceBorrowed(..) => "cuda",
        }
    }

    /// True when the buffer is a [`Borrowed`] view of the caller's memory.
    pub fn is_borrowed(&self) -> bool {
        match &self.storage {
            Storage::HostBorrowed(..) => true,
            #[cfg(feature = "cuda")]
            Storage::DeviceBorrowed(..) => true,
            _ => false,
        }
    }

    /// The address of the first element (host or device), for identity checks: a
    /// [`Borrowed`] view reports the lender's address.
    pub fn address(&self) -> u64 {
        match &self.storage {
            Storage::Host(v) => v.as_ptr() as u64,
            Storage::HostBorrowed(p, _) => *p as u64,
            #[cfg(feature = "cuda")]
            Storage::Device(d, _) => crate::cuda::slice_address(d),
            #[cfg(feature = "cuda")]
            Storage::DeviceBorrowed(d, _) => crate::cuda::slice_address(d.slice()),
        }
    }

    /// A read-only [`Borrowed`] view of elements `offset..offset + len` of this buffer, on its
    /// own backend, for as long as the buffer is borrowed (so nothing writes or frees it
    /// meanwhile): how one allocation serves as several tensors, e.g. the `k_proj` rows of a
    /// row-concatenated `[q_proj; k_proj; v_proj]` weight read on their own. Making one costs
    /// no driver call.
    ///
    /// Errors: [`OpsError::Range`] when the range passes the end; [`OpsError::Borrow`] when a
    /// device view would not start 16-byte aligned (what the kernels' vector and TMA loads
    /// assume of every device buffer).
    pub fn view(&self, offset: usize, len: usize) -> Result<Borrowed<'_, T>> {
        let end = offset.checked_add(len).filter(|&e| e <= self.len());
        if end.is_none() {
            return Err(OpsError::Range {
                op: "view",
                tensor: "buf",
                start: offset,
                end: offset.saturating_add(len),
                len: self.len(),
            });
        }
        let storage = match &self.storage {
            Storage::Host(v) => Storage::HostBorrowed(v[offset..].as_ptr(), len),
            // SAFETY: `offset <= len` of the lent range (checked above), so the pointer stays
            // inside (or one past) it.
            Storage::HostBorrowed(p, _) => Storage::HostBorrowed(unsafe { p.add(offset) }, len),
            #[cfg(feature = "cuda")]
            Storage::Device(d, _) => {
                Storage::DeviceBorrowed(crate::cuda::sub_slice(d, offset, len)?, len)
            }
            #[cfg(feature = "cuda")]
            Storage::DeviceBorrowed(b, _) => {
                Storage::DeviceBorrowed(crate::cuda::sub_slice(b.slice(), offset, len)?, len)
            }
        };
        Ok(Borrowed::over(storage))
    }

    /// The host elements, or [`OpsError::WrongBackend`] for a device buffer.
    pub fn host(&self, op: &'static str, tensor: &'static str) -> Result<&[T]> {
        let _ = (op, tensor); // used only when a device variant exists
        match &self.storage {
            Storage::Host(v) => Ok(v),
            Storage::HostBorrowed(p, len) => Ok(if *len == 0 {
                &[]
            } else {
                // SAFETY: a `Borrowed` view's contract: `len` valid `T` at `p`, unwritten
                // for the view's lifetime, which outlives `&self`.
                unsafe { std::slice::from_raw_parts(*p, *len) }
            }),
            #[cfg(feature = "cuda")]
            Storage::Device(..) | Storage::DeviceBorrowed(..) => Err(OpsError::WrongBackend {
                op,
                tensor,
                expected: "cpu",
                found: "cuda",
            }),
        }
    }

    /// The host elements, mutable, or [`OpsError::WrongBackend`] for a device buffer.
    pub fn host_mut(&mut self, op: &'static str, tensor: &'static str) -> Result<&mut [T]> {
        let _ = (op, tensor); // used only when a device variant exists
        match &mut self.storage {
            Storage::Host(v) => Ok(v),
            Storage::HostBorrowed(..) => Err(OpsError::ReadOnly { op, tensor }),
            #[cfg(feature = "cuda")]
            Storage::Device(..) | Storage::DeviceBorrowed(..) => Err(OpsError::WrongBackend {
                op,
                tensor,
                expected: "cpu",
                found: "cuda",
            }),
        }
    }

    /// The device slice, or [`OpsError::WrongBackend`] for a host buffer.
    #[cfg(feature = "cuda")]
    pub fn device(
        &self,
        op: &'static str,
        tensor: &'static str,
    ) -> Result<&cudarc::driver::CudaSlice<T>> {
        match &self.storage {
            Storage::Device(d, _) => Ok(d),
            Storage::DeviceBorrowed(d, _) => Ok(d.slice()),
            Storage::Host(_) | Storage::HostBorrowed(..) => Err(OpsError::WrongBackend {
                op,
                tensor,
                expected: "cuda",
                found: "cpu",
            }),
        }
    }

    /// The device slice, mutable, or [`OpsError::WrongBackend`] for a host buffer.
    #[cfg(feature = "cuda")]
    pub fn device_mut(
        &mut self,
        op: &'static str,
        tensor: &'static str,
    ) -> Result<&mut cudarc::driver::CudaSlice<T>> {
        match &mut self.storage {
            Storage::Device(d, _) => Ok(d),
            Storage::DeviceBorrowed(..) => Err(OpsError::ReadOnly { op, tensor }),
            Storage::Host(_) | Storage::HostBorrowed(..) => Err(OpsError::WrongBackend {
                op,
                tensor,
                expected: "cuda",
                found: "cpu",
            }),
        }
    }
}

/// Device work recorded once by [`Backend::capture`] (a CUDA graph) and replayed on the
/// backend's stream by [`Graph::launch`]: one launch instead of one per kernel. It reads and
/// writes the buffers it was captured with, so those must outlive it and keep their
/// addresses ([`Buffer::set_len`] keeps them).
pub struct Graph {
    #[cfg(feature = "cuda")]
    inner: cudarc::driver::CudaGraph,
}

// SAFETY: the graph's handles belong to the backend's context, which cudarc binds to the
// calling thread before each launch; `Graph` is not `Sync`, so launches never race.
#[cfg(feature = "cuda")]
unsafe impl Send for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

impl Graph {
    /// Queue one replay of the recorded work on the backend's stream (returns at once).
    pub fn launch(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            self.inner.launch().map_err(|e| OpsError::Cuda {
                context: "launching a captured graph".into(),
                message: e.to_string(),
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            // No graph exists without CUDA (`Backend::capture` refuses on the CPU).
            Ok(())
        }
    }
}

/// A device-to-host read queued by [`Backend::read_async`]: [`PendingRead::wait`] returns its
/// elements, synchronizing once if nothing synchronized since it was queued (so reads queued
/// together cost one synchronize). Dropping it unread gives its pinned bytes back.
#[derive(Debug)]
pub struct PendingRead<T: Element> {
    state: ReadState<T>,
}

#[derive(Debug)]
enum ReadState<T> {
    /// Already on the host (the CPU backend, an empty read, or one made at once).
    Ready(Vec<T>),
    /// In the CUDA backend's pinned readback block at byte `at`, queued in synchronize epoch
    /// `epoch`.
    #[cfg(feature = "cuda")]
    Queued {
        backend: crate::cuda::CudaBackend,
        at: usize,
        len: usize,
        epoch: u64,
    },
    /// Taken.
    Done,
}

impl<T: Element> PendingRead<T> {
    /// A completed read.
    pub(crate) fn ready(v: Vec<T>) -> Self {
        PendingRead {
            state: ReadState::Ready(v),
        }
    }

    /// A read queued into the readback block.
    #[cfg(feature = "cuda")]
    pub(crate) fn queued(
        backend: crate::cuda::CudaBackend,
        at: usize,
        len: usize,
        epoch: u64,
    ) -> Self {
        PendingRead {
            state: ReadState::Queued {
                backend,
                at,
                len,
                epoch,
            },
        }
    }

    /// The elements (synchronizes the stream if nothing did since the read was queued).
    pub fn wait(mut self) -> Result<Vec<T>> {
        match std::mem::replace(&mut self.state, ReadState::Done) {
            ReadState::Ready(v) => Ok(v),
            ReadState::Done => Ok(Vec::new()),
            #[cfg(feature = "cuda")]
            ReadState::Queued {
                backend,
                at,
                len,
                epoch,
            } => backend.take_read(at, len, epoch),
        }
    }
}

impl<T: Element> Drop for PendingRead<T> {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let ReadState::Queued { backend, epoch, .. } =
            std::mem::replace(&mut self.state, ReadState::Done)
        {
            backend.release_read(epoch);
        }
    }
}

pub(crate) fn check_range(
    op: &'static str,
    tensor: &'static str,
    start: usize,
    len: usize,
    total: usize,
) -> Result<()> {
    match start.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(OpsError::Range {
            op,
            tensor,
            start,
            end: start.saturating_add(len),
            len: total,
        }),
    }
}

thread_local! {
    /// Buffers the calling thread allocated through a CPU backend.
    static HOST_ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn count_host_allocation() {
    HOST_ALLOCATIONS.with(|c| c.set(c.get() + 1));
}

impl Backend {
    /// The host reference backend.
    pub fn cpu() -> Self {
        Backend::Cpu
    }

    /// `"cpu"` or `"cuda"`.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => "cuda",
        }
    }

    /// True for the host backend.
    pub fn is_cpu(&self) -> bool {
        matches!(self, Backend::Cpu)
    }

    /// A buffer of `len` zero elements (an allocation: [`Self::allocations`]).
    pub fn zeros<T: Element>(&self, len: usize) -> Result<Buffer<T>> {
        match self {
            Backend::Cpu => {
                count_host_allocation();
                Ok(Buffer::from_vec(vec![T::default(); len]))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.zeros(len),
        }
    }

    /// A buffer of `len` copies of `value` (an allocation).
    pub fn filled<T: Element>(&self, len: usize, value: T) -> Result<Buffer<T>> {
        match self {
            Backend::Cpu => {
                count_host_allocation();
                Ok(Buffer::from_vec(vec![value; len]))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => self.upload(&vec![value; len]),
        }
    }

    /// A buffer holding a copy of `data` (an allocation).
    pub fn upload<T: Element>(&self, data: &[T]) -> Result<Buffer<T>> {
        match self {
            Backend::Cpu => {
                count_host_allocation();
                Ok(Buffer::from_vec(data.to_vec()))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.upload(data),
        }
    }

    /// Buffers this backend has allocated (`zeros`, `filled`, `upload`, op scratch): on
    /// CUDA, the backend's device allocations since it was created; on the CPU (whose
    /// buffers are host vectors and whose ops run on the calling thread), those the calling
    /// thread made through any CPU backend. An engine checks that a round after warm-up adds
    /// none (`round_allocates_nothing_after_warmup`). [`Borrowed`] views do not count.
    pub fn allocations(&self) -> u64 {
        match self {
            Backend::Cpu => HOST_ALLOCATIONS.with(std::cell::Cell::get),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.allocations(),
        }
    }

    /// Times the host has waited for the device (0 on the CPU): each [`Self::synchronize`],
    /// each read back to the host, and each write that found the pinned staging full.
    pub fn synchronizations(&self) -> u64 {
        match self {
            Backend::Cpu => 0,
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.synchronizations(),
        }
    }

    /// Reserve `bytes` of pinned host memory through which writes are queued without
    /// waiting (CUDA; a no-op on the CPU): at least what one round writes between two
    /// reads. See `CudaBackend::reserve_staging`.
    pub fn reserve_staging(&self, bytes: usize) -> Result<()> {
        let _ = bytes; // used only when a device variant exists
        match self {
            Backend::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.reserve_staging(bytes),
        }
    }

    /// All elements of `buf`, copied to the host (synchronizes).
    pub fn download<T: Element>(&self, buf: &Buffer<T>) -> Result<Vec<T>> {
        self.read(buf, 0, buf.len())
    }

    /// Elements `offset..offset+len` of `buf`, copied to the host (synchronizes).
    pub fn read<T: Element>(&self, buf: &Buffer<T>, offset: usize, len: usize) -> Result<Vec<T>> {
        check_range("read", "buf", offset, len, buf.len())?;
        match self {
            Backend::Cpu => Ok(buf.host("read", "buf")?[offset..offset + len].to_vec()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.read(buf, offset, len),
        }
    }

    /// Queue a read of elements `offset..offset+len` of `buf` (their values at this point of
    /// the backend's queue) and return at once; [`PendingRead::wait`] delivers them. On CUDA
    /// the copy lands in pinned memory with the next synchronize, so several reads queued
    /// before the first `wait` cost one synchronize; on the CPU the read is made at once.
    pub fn read_async<T: Element>(
        &self,
        buf: &Buffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<PendingRead<T>> {
        check_range("read", "buf", offset, len, buf.len())?;
        match self {
            Backend::Cpu => Ok(PendingRead::ready(
                buf.host("read", "buf")?[offset..offset + len].to_vec(),
            )),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.read_async(buf, offset, len),
        }
    }

    /// Overwrite elements `offset..offset+data.len()` of `buf` with `data` (on CUDA queued on
    /// the stream through pinned staging, so it returns without waiting; `data` may be
    /// reused at once).
    pub fn write<T: Element>(&self, buf: &mut Buffer<T>, offset: usize, data: &[T]) -> Result<()> {
        check_range("write", "buf", offset, data.len(), buf.len())?;
        match self {
            Backend::Cpu => {
                buf.host_mut("write", "buf")?[offset..offset + data.len()].copy_from_slice(data);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.write(buf, offset, data),
        }
    }

    /// Copy `len` elements from `src[src_offset..]` to `dst[dst_offset..]` on this backend.
    pub fn copy<T: Element>(
        &self,
        src: &Buffer<T>,
        src_offset: usize,
        dst: &mut Buffer<T>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range("copy", "src", src_offset, len, src.len())?;
        check_range("copy", "dst", dst_offset, len, dst.len())?;
        match self {
            Backend::Cpu => {
                let s = src.host("copy", "src")?;
                let d = dst.host_mut("copy", "dst")?;
                d[dst_offset..dst_offset + len].copy_from_slice(&s[src_offset..src_offset + len]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.copy(src, src_offset, dst, dst_offset, len),
        }
    }

    /// Copy `rows` runs of `len` elements on this backend: run `r` from
    /// `src[src_offset + r * src_stride ..]` to `dst[dst_offset + r * dst_stride ..]` (one
    /// strided copy on CUDA, recordable into a graph). Strides are at least `len`
    /// ([`OpsError::Param`] otherwise); every run must lie in its buffer.
    #[allow(clippy::too_many_arguments)] // reason: a 2-D copy's source and destination geometry
    pub fn copy_rows<T: Element>(
        &self,
        src: &Buffer<T>,
        src_offset: usize,
        src_stride: usize,
        dst: &mut Buffer<T>,
        dst_offset: usize,
        dst_stride: usize,
        len: usize,
        rows: usize,
    ) -> Result<()> {
        if rows == 0 || len == 0 {
            return Ok(());
        }
        for (stride, name) in [(src_stride, "src_stride"), (dst_stride, "dst_stride")] {
            crate::check_param("copy_rows", name, stride >= len, stride, || {
                format!("at least the run length {len}")
            })?;
        }
        let span = |offset: usize, stride: usize| {
            (rows - 1)
                .checked_mul(stride)
                .and_then(|x| x.checked_add(offset))
                .unwrap_or(usize::MAX)
        };
        check_range(
            "copy_rows",
            "src",
            span(src_offset, src_stride),
            len,
            src.len(),
        )?;
        check_range(
            "copy_rows",
            "dst",
            span(dst_offset, dst_stride),
            len,
            dst.len(),
        )?;
        match self {
            Backend::Cpu => {
                let s = src.host("copy_rows", "src")?;
                let d = dst.host_mut("copy_rows", "dst")?;
                for r in 0..rows {
                    let (a, b) = (src_offset + r * src_stride, dst_offset + r * dst_stride);
                    d[b..b + len].copy_from_slice(&s[a..a + len]);
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.copy_rows(
                src, src_offset, src_stride, dst, dst_offset, dst_stride, len, rows,
            ),
        }
    }

    /// Set every element of `buf` to `value`.
    pub fn fill<T: Element>(&self, buf: &mut Buffer<T>, value: T) -> Result<()> {
        match self {
            Backend::Cpu => {
                buf.host_mut("fill", "buf")?.fill(value);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                let n = buf.len();
                c.write(buf, 0, &vec![value; n])
            }
        }
    }

    /// Record the device work `f` queues on this backend (kernels, library calls,
    /// device-to-device copies) into a [`Graph`] without running it; [`Graph::launch`]
    /// replays it. The recorded launches keep the addresses and shapes of the capture: what
    /// changes between replays must live in device buffers the graph reads (metadata
    /// written with [`Self::write`] before each launch). While `f` runs, calls that cannot
    /// be recorded (host reads and writes, synchronizes, allocations) fail with
    /// [`OpsError::Capture`], and so does the capture; run `f`'s work once eagerly first,
    /// so that kernels and library handles are loaded outside the capture.
    ///
    /// Errors: [`OpsError::Capture`] on the CPU (its ops run at once: there is nothing to
    /// record), when CUDA event tracking is on for the context, or when `f` or the driver
    /// fails (the stream is left out of capture either way).
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<Graph> {
        match self {
            Backend::Cpu => {
                let _ = f;
                Err(OpsError::Capture {
                    problem: "the CPU backend runs ops at once; there is nothing to record".into(),
                })
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => Ok(Graph {
                inner: c.capture(f)?,
            }),
        }
    }

    /// Whether [`Self::capture`] can record on this backend (`Err` says why not).
    pub fn can_capture(&self) -> std::result::Result<(), String> {
        match self {
            Backend::Cpu => Err("the CPU backend runs ops at once".into()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) if c.context().is_event_tracking() => {
                Err("cudarc event tracking is on for the host's context".into())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Ok(()),
        }
    }

    /// Wait until all work queued on this backend has finished (a no-op on the CPU).
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Backend::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.synchronize(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn a_view_reads_its_range_only_and_refuses_to_pass_the_end() {
        let be = Backend::cpu();
        let b = be.upload(&[1i32, 2, 3, 4, 5]).expect("upload");
        let v = b.view(1, 3).expect("view");
        assert_eq!(v.len(), 3);
        assert!(v.is_borrowed());
        assert_eq!(be.download(&v).expect("download"), vec![2, 3, 4]);
        assert_eq!(v.address(), b.address() + 4);
        // A view of a view.
        assert_eq!(
            be.download(&v.view(1, 2).expect("view")).expect("dl"),
            vec![3, 4]
        );
        assert!(v.view(2, 2).is_err());
        assert_eq!(
            be.download(&b.view(5, 0).expect("empty")).expect("dl"),
            vec![]
        );
        for (offset, len) in [(3, 3), (6, 0), (usize::MAX, 2)] {
            assert!(
                matches!(b.view(offset, len), Err(OpsError::Range { op: "view", .. })),
                "offset {offset} len {len}"
            );
        }
    }

    #[test]
    fn cpu_buffer_round_trip_and_ranges() {
        let be = Backend::cpu();
        let mut b = be.upload(&[1i32, 2, 3, 4]).expect("upload");
        be.write(&mut b, 1, &[9, 8]).expect("write");
        assert_eq!(be.download(&b).expect("download"), vec![1, 9, 8, 4]);
        assert!(matches!(
            be.write(&mut b, 3, &[1, 2]),
            Err(OpsError::Range {
                start: 3,
                end: 5,
                len: 4,
                ..
            })
        ));
        let mut c = be.zeros::<i32>(4).expect("zeros");
        be.copy(&b, 1, &mut c, 2, 2).expect("copy");
        assert_eq!(be.download(&c).expect("download"), vec![0, 0, 9, 8]);
        assert!(be.copy(&b, 3, &mut c, 0, 2).is_err());
        assert_eq!(
            be.download(&c).expect("download"),
            vec![0, 0, 9, 8],
            "refused copy wrote nothing"
        );
        assert_eq!(be.read(&b, 2, 2).expect("read"), vec![8, 4]);
        assert!(
            be.read(&b, usize::MAX, 2).is_err(),
            "overflowing range is refused"
        );
    }

    #[test]
    fn borrowed_host_view_reads_the_lenders_memory_and_is_never_written() {
        let lent: Vec<bf16> = (0..12).map(|i| bf16::from_f32(i as f32 - 3.5)).collect();
        let view = Borrowed::host(&lent);
        assert!(view.is_borrowed());
        assert_eq!(view.len(), 12);
        assert_eq!(view.address(), lent.as_ptr() as u64, "no copy was made");
        assert_eq!(
            view.host("t", "table").expect("host").as_ptr(),
            lent.as_ptr(),
            "ops read the lender's memory"
        );
        // An op reads it like an owned buffer and gives the same bits.
        let be = Backend::cpu();
        let ids = be.upload(&[2i32, 0]).expect("ids");
        let p = crate::embedding_gather::EmbeddingGatherParams {
            vocab: 4,
            hidden: 3,
        };
        let mut from_view = be.filled(6, bf16::POISON).expect("out");
        crate::embedding_gather::run(&be, &ids, &view, &mut from_view, &p).expect("view");
        let owned = be.upload(&lent).expect("owned");
        let mut from_owned = be.filled(6, bf16::POISON).expect("out");
        crate::embedding_gather::run(&be, &ids, &owned, &mut from_owned, &p).expect("owned");
        assert_eq!(
            from_view.host("t", "out").expect("host"),
            from_owned.host("t", "out").expect("host")
        );
        assert_eq!(from_view.host("t", "out").expect("host")[0], lent[6]);
        // Nothing writes through a borrowed storage, even from inside the crate.
        let mut inner = Buffer {
            storage: Storage::HostBorrowed(lent.as_ptr(), lent.len()),
        };
        assert!(matches!(
            inner.host_mut("op", "lent"),
            Err(OpsError::ReadOnly {
                op: "op",
                tensor: "lent"
            })
        ));
        assert!(be.write(&mut inner, 0, &[bf16::ZERO]).is_err());
        assert!(be.fill(&mut inner, bf16::ZERO).is_err());
        drop(inner);
        drop(view);
        assert_eq!(
            lent[0],
            bf16::from_f32(-3.5),
            "the lender's memory is untouched"
        );
    }

    #[test]
    fn borrowed_from_raw_checks_the_address() {
        let be = Backend::cpu();
        let data = [1i32, 2, 3, 4];
        // SAFETY: `data` outlives the view and is not written.
        let ok = unsafe { Borrowed::<i32>::from_raw(&be, data.as_ptr() as u64 + 4, 3) }
            .expect("aligned, in range");
        assert_eq!(ok.host("t", "x").expect("host"), &[2, 3, 4]);
        // SAFETY: refused before any use.
        let null = unsafe { Borrowed::<i32>::from_raw(&be, 0, 1) };
        assert!(matches!(null, Err(OpsError::Borrow { .. })));
        // SAFETY: refused before any use.
        let odd = unsafe { Borrowed::<i32>::from_raw(&be, data.as_ptr() as u64 + 2, 1) };
        assert!(matches!(odd, Err(OpsError::Borrow { .. })), "{odd:?}");
        // SAFETY: refused before any use.
        let huge = unsafe { Borrowed::<i32>::from_raw(&be, 4, usize::MAX / 2) };
        assert!(matches!(huge, Err(OpsError::Borrow { .. })));
        // SAFETY: an empty view is never dereferenced.
        let empty = unsafe { Borrowed::<i32>::from_raw(&be, 0, 0) }.expect("empty");
        assert!(empty.host("t", "x").expect("host").is_empty());
    }

    #[test]
    fn cpu_allocations_are_counted_per_thread() {
        let be = Backend::cpu();
        let before = be.allocations();
        let a = be.zeros::<f32>(3).expect("zeros");
        let _b = be.filled(2, 1i32).expect("filled");
        let _c = be.upload(&[1u16 as i32]).expect("upload");
        assert_eq!(be.allocations(), before + 3);
        let lent = [0.5f32; 3];
        let _v = Borrowed::host(&lent);
        let _d = be.download(&a).expect("download");
        assert_eq!(
            be.allocations(),
            before + 3,
            "views and reads allocate no buffer"
        );
        let other = std::thread::spawn(|| Backend::cpu().allocations())
            .join()
            .expect("thread");
        assert_eq!(other, 0, "another thread's count is its own");
        assert_eq!(be.synchronizations(), 0);
    }

    #[test]
    fn read_async_delivers_the_range_and_checks_it() {
        let be = Backend::cpu();
        let b = be.upload(&[5i32, 6, 7, 8]).expect("upload");
        let r1 = be.read_async(&b, 1, 2).expect("queued");
        let r2 = be.read_async(&b, 0, 0).expect("empty");
        assert_eq!(r1.wait().expect("wait"), vec![6, 7]);
        assert!(r2.wait().expect("wait").is_empty());
        assert!(matches!(
            be.read_async(&b, 3, 2),
            Err(OpsError::Range {
                start: 3,
                end: 5,
                len: 4,
                ..
            })
        ));
        drop(be.read_async(&b, 0, 4).expect("dropped unread"));
    }

    #[test]
    fn set_len_moves_the_length_within_the_allocation() {
        let be = Backend::cpu();
        let mut b = be.upload(&[1i32, 2, 3, 4, 5, 6]).expect("upload");
        let (addr, cap, made) = (b.address(), b.capacity(), be.allocations());
        assert!(cap >= 6);
        b.set_len(2).expect("shrink");
        assert_eq!(
            be.download(&b).expect("read"),
            vec![1, 2],
            "the prefix keeps its values"
        );
        assert!(
            matches!(be.write(&mut b, 2, &[9]), Err(OpsError::Range { .. })),
            "ops see the new length"
        );
        b.set_len(cap).expect("grow back");
        assert_eq!(b.len(), cap);
        assert_eq!(&be.download(&b).expect("read")[..2], &[1, 2]);
        assert_eq!(
            (b.address(), be.allocations()),
            (addr, made),
            "no move, no allocation"
        );
        assert!(matches!(
            b.set_len(cap + 1),
            Err(OpsError::Length { op: "set_len", expected, found, .. })
                if expected == cap && found == cap + 1
        ));
        assert_eq!(b.len(), cap, "a refused resize changes nothing");
        let lent = [1.0f32, 2.0];
        let mut view = Borrowed::host(&lent);
        let shared: &Buffer<f32> = &view;
        assert_eq!(shared.capacity(), 2);
        // A view's length is the lender's: even a shrink is refused.
        let buf: &mut Buffer<f32> = &mut view.buf;
        assert!(matches!(buf.set_len(1), Err(OpsError::ReadOnly { .. })));
        assert_eq!(buf.len(), 2);
    }

    #[test]
    fn cpu_backend_refuses_to_capture_and_runs_nothing() {
        let be = Backend::cpu();
        let mut ran = false;
        assert!(matches!(
            be.capture(|| {
                ran = true;
                Ok(())
            }),
            Err(OpsError::Capture { .. })
        ));
        assert!(
            !ran,
            "nothing is queued on the CPU: the work is not run either"
        );
        assert!(be.can_capture().is_err());
    }

    #[test]
    fn copy_rows_copies_strided_runs_and_checks_them() {
        let be = Backend::cpu();
        // A [3, 4] source; copy columns 1..3 of rows 0..3 into columns 2..4 of a [3, 5] dst.
        let src = be.upload(&(0..12).collect::<Vec<i32>>()).expect("src");
        let mut dst = be.filled(15, -1i32).expect("dst");
        be.copy_rows(&src, 1, 4, &mut dst, 2, 5, 2, 3)
            .expect("copy");
        assert_eq!(
            be.download(&dst).expect("read"),
            vec![-1, -1, 1, 2, -1, -1, -1, 5, 6, -1, -1, -1, 9, 10, -1]
        );
        assert!(matches!(
            be.copy_rows(&src, 0, 1, &mut dst, 0, 5, 2, 3),
            Err(OpsError::Param {
                param: "src_stride",
                ..
            })
        ));
        // The last run would end past the source.
        assert!(matches!(
            be.copy_rows(&src, 3, 4, &mut dst, 0, 5, 2, 3),
            Err(OpsError::Range { .. })
        ));
        assert_eq!(
            be.download(&dst).expect("read")[2],
            1,
            "refused copies write nothing"
        );
        be.copy_rows(&src, 0, 4, &mut dst, 0, 5, 2, 0)
            .expect("no rows");
    }
}
